//! What posting in batches buys: the message rate of small sends posted one call at a time
//! (`Endpoint::send`) against the same sends posted as batches (`Endpoint::send_batch`, like
//! `FI_MORE` chains), over the same endpoints, back to back; with `-o write`, RMA writes
//! (`Endpoint::write` against `Endpoint::write_batch`) into a region the server hands out.
//!
//! ```text
//! cargo run --release --example batch                         # both ends in this process
//! cargo run --release --example batch -- -S 64 -b 32 -I 200000
//! cargo run --release --example batch -- -o write -p udp      # writes, udp device
//! cargo run --release --example batch -- -l                   # server
//! cargo run --release --example batch -- 127.0.0.1            # client
//! ```
//!
//! The client sends `-I` messages of `-S` bytes with a window of `-W` outstanding, first one at a
//! time, then in batches of `-b`; the server keeps a window of receives posted. Each row gives
//! fabtests' columns plus the mode; the last line the ratio.

mod common;

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{
    Conn, RdmPeer, Role, Side, launch, parse_size, poll_cq, print_header, print_row, rdm_peer,
};
use efa::{
    Access, Completion, CompletionFlags, CompletionQueue, Endpoint, ErrorKind, PeerId, Rdm,
    RemoteKey, SendOptions, SendRequest, WriteOptions, WriteRequest,
};

/// The tag of the message that ends a mode of writes.
const DONE_TAG: u64 = 0xd0e;

#[derive(Parser, Debug, Clone)]
#[command(about = "Batched vs single posting of small sends over efa RDM endpoints")]
struct Args {
    /// Operation: send (messages) or write (RMA writes).
    #[arg(short = 'o', default_value = "send")]
    op: String,
    /// Message size.
    #[arg(short = 'S', default_value = "64")]
    size: String,
    /// Messages per mode.
    #[arg(short = 'I', default_value_t = 100_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    iters: usize,
    /// Sends outstanding at most.
    #[arg(short = 'W', default_value_t = 256)]
    window: usize,
    /// Sends per batch.
    #[arg(short = 'b', default_value_t = 32)]
    batch: usize,
    /// Print both endpoints' counters (RNR events, retransmits, unexpected messages) per mode.
    #[arg(short = 'v')]
    verbose: bool,
    #[command(flatten)]
    conn: Conn,
}

type Res<T> = Result<T, String>;

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let conn = args.conn.clone();
    match launch(&conn, move |side| session(&args, side)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("batch: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The device's system-call economy during one mode: packets, the datagrams that carried them
/// (several packets share one when packed), acknowledgements, and the `sendmmsg` / `recvmmsg`
/// calls that moved several datagrams at once.
fn print_device(domain: &efa::Domain, before: &efa::DeviceStats, who: &str) {
    let now = domain.device_stats();
    println!(
        "# {who} device: {} packets sent in {} datagrams ({} packed), {} received in {} datagrams, {} acks sent, {} sendmmsg, {} recvmmsg",
        now.tx_pkts - before.tx_pkts,
        now.tx_datagrams - before.tx_datagrams,
        now.tx_packed - before.tx_packed,
        now.rx_pkts - before.rx_pkts,
        now.rx_datagrams - before.rx_datagrams,
        now.acks_sent - before.acks_sent,
        now.tx_batches - before.tx_batches,
        now.rx_batches - before.rx_batches,
    );
}

fn session(args: &Args, side: Side) -> Res<()> {
    let size = parse_size(&args.size)?;
    if args.window == 0 || args.batch == 0 {
        return Err("-W and -b must be at least 1".into());
    }
    let Side {
        role,
        mut oob,
        print,
        bind,
    } = side;
    let RdmPeer {
        domain,
        cq,
        ep,
        peer,
        ..
    } = rdm_peer(&args.conn, bind, &mut oob, 4 * args.window + 64, |b| {
        b.tx_size(args.window.max(args.batch)).rx_size(args.window)
    })?;
    let writes = match args.op.as_str() {
        "send" => false,
        "write" => true,
        o => return Err(format!("-o {o}: send or write")),
    };
    // Writes land in a region of the server's, one slot per write of the window.
    let mut _region = None;
    let mut rk = None;
    if writes {
        match role {
            Role::Server => {
                let mr = domain
                    .register(vec![0u8; size.max(1) * args.window], Access::REMOTE_WRITE)
                    .map_err(|e| e.to_string())?;
                let line = serde_json::to_string(&mr.remote_key().map_err(|e| e.to_string())?)
                    .map_err(|e| e.to_string())?;
                oob.send_line(&line).map_err(|e| e.to_string())?;
                _region = Some(mr);
            }
            Role::Client => {
                let line = oob.recv_line().map_err(|e| format!("remote key: {e}"))?;
                let k: RemoteKey =
                    serde_json::from_str(&line).map_err(|e| format!("remote key: {e}"))?;
                rk = Some(k);
            }
        }
    }
    let (single, batch) = if writes {
        ("write", "write_batch")
    } else {
        ("send", "send_batch")
    };
    if print && role == Role::Client {
        print_header();
    }
    let mut rates = Vec::new();
    for batched in [false, true] {
        oob.sync().map_err(|e| e.to_string())?;
        let dev_before = domain.device_stats();
        match role {
            Role::Client => {
                let start = Instant::now();
                match rk {
                    Some(rk) => write_all(&ep, &cq, peer, rk, size, args, batched)?,
                    None => send_all(&ep, &cq, peer, size, args, batched)?,
                }
                let elapsed = start.elapsed();
                // The server confirms it got everything before the next mode starts.
                oob.recv_line().map_err(|e| e.to_string())?;
                if print {
                    print_row(size, args.iters, 1, elapsed);
                    println!(
                        "# {}: {:.0} operations/s",
                        if batched {
                            format!("{batch}, {} per batch", args.batch)
                        } else {
                            format!("{single}, one call per operation")
                        },
                        args.iters as f64 / elapsed.as_secs_f64()
                    );
                }
                rates.push(args.iters as f64 / elapsed.as_secs_f64());
                if args.verbose {
                    println!("# client {:?}", ep.stats());
                    print_device(&domain, &dev_before, "client");
                }
            }
            Role::Server => {
                if writes {
                    await_done(&ep, &cq)?;
                } else {
                    recv_all(&ep, &cq, size, args)?;
                }
                if args.verbose {
                    println!("# server {:?}", ep.stats());
                    print_device(&domain, &dev_before, "server");
                }
                oob.send_line("done").map_err(|e| e.to_string())?;
            }
        }
    }
    if print && role == Role::Client {
        println!("# {batch} / {single}: {:.2}x", rates[1] / rates[0]);
    }
    oob.sync().map_err(|e| e.to_string())?;
    Ok(())
}

/// Keeps `args.window` operations in flight until `args.iters` have completed with `flag`:
/// `post(first, n)` posts up to `n` operations numbered from `first` (as one batch or one call
/// each) and says how many went.
fn run_window(
    cq: &CompletionQueue,
    args: &Args,
    flag: CompletionFlags,
    what: &str,
    mut post: impl FnMut(usize, usize) -> Res<usize>,
) -> Res<()> {
    let mut done: Vec<Completion> = Vec::new();
    let (mut posted, mut completed) = (0usize, 0usize);
    let deadline = Instant::now() + Duration::from_secs(300);
    while completed < args.iters {
        let room = (args.window - (posted - completed)).min(args.iters - posted);
        if room > 0 {
            posted += post(posted, room)?;
        }
        poll_cq(cq, &mut done, 256)?;
        completed += done.drain(..).filter(|c| c.flags.contains(flag)).count();
        if Instant::now() > deadline {
            return Err(format!(
                "only {completed} of {} {what} completed",
                args.iters
            ));
        }
    }
    Ok(())
}

/// Posts `n` operations, one call each, until the endpoint says `Again`.
fn each(
    n: usize,
    what: &str,
    mut post: impl FnMut(usize) -> Result<(), efa::PostError>,
) -> Res<usize> {
    for i in 0..n {
        match post(i) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Again => return Ok(i),
            Err(e) => return Err(format!("{what}: {e}")),
        }
    }
    Ok(n)
}

fn send_all(
    ep: &Endpoint<Rdm>,
    cq: &CompletionQueue,
    peer: PeerId,
    size: usize,
    args: &Args,
    batched: bool,
) -> Res<()> {
    let msg = Bytes::from(vec![0x5au8; size]);
    let mut reqs: VecDeque<SendRequest> = VecDeque::with_capacity(args.batch);
    run_window(cq, args, CompletionFlags::SEND, "sends", |_, room| {
        if !batched {
            return each(room, "send", |_| ep.send(peer, msg.clone(), 0));
        }
        reqs.clear();
        reqs.extend((0..args.batch.min(room)).map(|_| SendRequest {
            peer,
            buf: msg.clone().into(),
            options: SendOptions::default(),
            context: 0,
        }));
        // Unposted requests are rebuilt next round with the current room.
        ep.send_batch(&mut reqs).map_err(|e| e.to_string())
    })
}

/// `send_all` for RMA writes into the server's region (one slot per write of the window), then
/// the message that tells the server the mode is over.
fn write_all(
    ep: &Endpoint<Rdm>,
    cq: &CompletionQueue,
    peer: PeerId,
    rk: RemoteKey,
    size: usize,
    args: &Args,
    batched: bool,
) -> Res<()> {
    let msg = Bytes::from(vec![0x5au8; size]);
    let mut reqs: VecDeque<WriteRequest> = VecDeque::with_capacity(args.batch);
    let slot = |i: usize| rk.at(((i % args.window) * size) as u64);
    run_window(cq, args, CompletionFlags::WRITE, "writes", |first, room| {
        if !batched {
            return each(room, "write", |i| {
                ep.write(peer, msg.clone(), slot(first + i), 0)
            });
        }
        reqs.clear();
        reqs.extend((0..args.batch.min(room)).map(|i| WriteRequest {
            peer,
            buf: msg.clone().into(),
            to: slot(first + i),
            options: WriteOptions::default(),
            context: 0,
        }));
        ep.write_batch(&mut reqs).map_err(|e| e.to_string())
    })?;
    ep.tsend(peer, Bytes::from_static(b"done"), DONE_TAG, 1)
        .map_err(|e| format!("tsend: {e}"))?;
    wait_for(cq, |c| {
        c.flags.contains(CompletionFlags::SEND) && c.context == 1
    })
}

/// Drives the endpoint (emulated writes need the target's progress) until the client says
/// the mode is over.
fn await_done(ep: &Endpoint<Rdm>, cq: &CompletionQueue) -> Res<()> {
    ep.trecv(BytesMut::with_capacity(8), DONE_TAG, 0, 2)
        .map_err(|e| format!("trecv: {e}"))?;
    wait_for(cq, |c| {
        c.flags.contains(CompletionFlags::RECV) && c.context == 2
    })
}

fn wait_for(cq: &CompletionQueue, pred: impl Fn(&Completion) -> bool) -> Res<()> {
    let mut done: Vec<Completion> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        poll_cq(cq, &mut done, 64)?;
        if done.iter().any(&pred) {
            return Ok(());
        }
        done.clear();
        if Instant::now() > deadline {
            return Err("no completion within five minutes".into());
        }
    }
}

fn recv_all(ep: &Endpoint<Rdm>, cq: &CompletionQueue, size: usize, args: &Args) -> Res<()> {
    let mut done: Vec<Completion> = Vec::new();
    let (mut posted, mut completed) = (0usize, 0usize);
    let deadline = Instant::now() + Duration::from_secs(300);
    while completed < args.iters {
        while posted < args.iters && posted - completed < args.window {
            match ep.recv(BytesMut::with_capacity(size.max(1)), 0) {
                Ok(()) => posted += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => return Err(format!("recv: {e}")),
            }
        }
        poll_cq(cq, &mut done, 256)?;
        for c in done.drain(..) {
            if c.flags.contains(CompletionFlags::RECV) {
                if c.len != size {
                    return Err(format!("received {} bytes, expected {size}", c.len));
                }
                completed += 1;
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "only {completed} of {} messages arrived",
                args.iters
            ));
        }
    }
    Ok(())
}
