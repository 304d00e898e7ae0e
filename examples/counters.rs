//! One-sided writes counted at the target (`efa::Counter`, libfabric's `fi_cntr` with
//! `FI_REMOTE_WRITE`): a writer puts N chunks into a region of the target with plain RMA
//! writes; the target has no completion queue at all, only a remote-write counter, waits on it
//! until it counts N, and checks every chunk. The writer has no completion queue either: a
//! write counter paces it.
//!
//! ```text
//! cargo run --example counters -- [-n WRITES] [-s SIZE] [-w block|async|fd] [-p udp|shm|loopback|efa]
//! ```
//!
//! `-w` picks how the target waits: `block` (`Counter::wait`), `async` (`Counter::wait_async`
//! under tokio) or `fd` (the counter's descriptor in tokio's reactor through `AsyncFd`, after
//! `Counter::trywait`). Both sides are in this process, each with its own domain, as two hosts
//! would be. Exits non-zero when a count or a byte is wrong.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use efa::bytes::Bytes;
use efa::{
    Access, AddressVector, Counter, CounterEvents, Domain, Endpoint, EpType, ErrorKind, Hints,
    RawAddr, Rdm, RemoteKey, getinfo,
};

#[derive(Parser, Debug)]
#[command(about = "One-sided writes counted by the target's remote-write counter")]
struct Args {
    /// Writes
    #[arg(short = 'n', default_value_t = 1000)]
    writes: u64,
    /// Bytes per write
    #[arg(short = 's', default_value_t = 4096)]
    size: usize,
    /// How the target waits: block, async or fd
    #[arg(short = 'w', default_value = "block")]
    wait: String,
    /// Device (provider): udp, shm, loopback, or efa (cargo feature `efa`)
    #[arg(short = 'p', default_value = "udp")]
    provider: String,
}

const LIMIT: Duration = Duration::from_secs(60);

/// The bytes of chunk `i`.
fn chunk(i: u64, size: usize) -> Bytes {
    (0..size)
        .map(|k| (i as usize).wrapping_mul(31).wrapping_add(k) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("counters: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn domain(provider: &str) -> efa::Result<Domain> {
    let info = getinfo(&Hints::new().provider(provider).ep_type(EpType::Rdm))?.remove(0);
    Domain::open(&info)
}

fn run(args: &Args) -> efa::Result<bool> {
    if !["block", "async", "fd"].contains(&args.wait.as_str()) {
        return Err(efa::Error::new(ErrorKind::InvalidArgument, "counters")
            .with_detail(format!("-w {}: block, async or fd", args.wait)));
    }
    let (n, size) = (args.writes, args.size.max(1));
    // The target: a region peers may write, and an endpoint with a counter and no queue.
    let td = domain(&args.provider)?;
    let region = td.register(vec![0u8; n as usize * size], Access::REMOTE_WRITE)?;
    let landed = Counter::new(&td)?;
    let target = Endpoint::<Rdm>::builder(&td)
        .av(&AddressVector::new(&td))
        .counter(&landed, CounterEvents::REMOTE_WRITE)
        .build()?;
    let start = Instant::now();
    let writer = {
        let (addr, key, provider) = (target.addr(), region.remote_key()?, args.provider.clone());
        std::thread::spawn(move || write_all(&provider, addr, key, n, size))
    };
    let counted = match args.wait.as_str() {
        "block" => landed.wait(n, Some(LIMIT)),
        other => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| efa::Error::io("tokio", e))?
            .block_on(async {
                let waited = if other == "async" {
                    tokio::time::timeout(LIMIT, landed.wait_async(n)).await
                } else {
                    tokio::time::timeout(LIMIT, wait_on_fd(&landed, n)).await
                };
                waited.unwrap_or_else(|_| Err(efa::Error::new(ErrorKind::TimedOut, "counters")))
            }),
    };
    let wrote = writer.join().map_err(|_| {
        efa::Error::io(
            "writer",
            std::io::Error::other("the writer thread panicked"),
        )
    })??;
    let counted = counted?;
    // Every chunk where it belongs, exactly as written.
    let bad = {
        let mem = region.read();
        (0..n)
            .filter(|&i| {
                let at = i as usize * size;
                mem[at..at + size] != chunk(i, size)[..]
            })
            .count()
    };
    println!(
        "# {} writes of {size} bytes on {}; the target ({} wait, no completion queue) counted \
         {counted} of {n}, {} errors; the writer's counter {wrote}",
        n,
        args.provider,
        args.wait,
        landed.read_err()
    );
    println!(
        "# data {}: {bad} of {n} chunks differ ({:.1} s)",
        if bad == 0 { "intact" } else { "CORRUPT" },
        start.elapsed().as_secs_f64()
    );
    Ok(counted == n && wrote == n && bad == 0 && landed.read_err() == 0)
}

/// Waits for `n` on the counter's descriptor in tokio's reactor, reading it when woken.
async fn wait_on_fd(c: &Counter, n: u64) -> efa::Result<u64> {
    use tokio::io::unix::AsyncFd;
    // SAFETY: the descriptor is the counter's for its whole life (`Counter::wait_fd`); the
    // `AsyncFd` holds a clone of the counter until it is dropped, so nothing closes it.
    let fd = unsafe { AsyncFd::register_with_interest(c.clone(), tokio::io::Interest::READABLE) }
        .map_err(|e| efa::Error::io("AsyncFd", std::io::Error::other(e.to_string())))?;
    loop {
        let v = c.read();
        if v >= n {
            return Ok(v);
        }
        if c.read_err() > 0 {
            return Err(efa::Error::new(ErrorKind::ErrorAvailable, "counters"));
        }
        if c.trywait().is_ok() {
            let mut ready = fd
                .readable()
                .await
                .map_err(|e| efa::Error::io("readable", e))?;
            ready.clear_ready();
        }
    }
}

/// The writer: its own domain, an endpoint with a write counter and no queue; `n` writes,
/// retried while the endpoint has no room, then waits until all are done. Returns its count.
fn write_all(provider: &str, to: RawAddr, key: RemoteKey, n: u64, size: usize) -> efa::Result<u64> {
    let d = domain(provider)?;
    let done = Counter::new(&d)?;
    let av = AddressVector::new(&d);
    let ep = Endpoint::<Rdm>::builder(&d)
        .av(&av)
        .counter(&done, CounterEvents::WRITE)
        .build()?;
    let peer = av.insert(to)?;
    let deadline = Instant::now() + LIMIT;
    for i in 0..n {
        let data = chunk(i, size);
        loop {
            match ep.write(peer, data.clone(), key.at(i * size as u64), i) {
                Ok(()) => break,
                Err(e) if e.error.kind() == ErrorKind::Again && Instant::now() < deadline => {
                    // Full: let the done ones go (reading drives the endpoint).
                    done.read();
                }
                Err(e) => return Err(e.error),
            }
        }
    }
    done.wait(n, Some(LIMIT))
}
