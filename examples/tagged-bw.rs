//! Tagged-message bandwidth in the manner of fabtests' `fi_rdm_tagged_bw`: the client keeps a
//! window of tagged sends outstanding, the server a window of tagged receives; after the last
//! window the server acknowledges, and the client reports MB/sec.
//!
//! ```text
//! cargo run --release --example tagged-bw                    # both ends in this process
//! cargo run --release --example tagged-bw -- -l              # server
//! cargo run --release --example tagged-bw -- 127.0.0.1       # client
//! ```

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{
    Conn, RdmPeer, Role, Side, check_pattern, fill_pattern, launch, parse_size, poll_cq,
    print_header, print_row, rdm_peer,
};
use efa::{Completion, CompletionFlags, CompletionQueue, Endpoint, ErrorKind, PeerId, Rdm};

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Tagged-message bandwidth test (fabtests fi_rdm_tagged_bw style) over efa RDM endpoints"
)]
struct Args {
    /// Message size (64, 1k, 64k, 1m) or a comma-separated list.
    #[arg(short = 'S', default_value = "64,1k,64k,1m")]
    size: String,
    /// Messages per size (default 10000; 1000 from 64 KiB on, 200 from 1 MiB on), rounded up
    /// to a whole number of windows (-W): 200 with the default window of 64 runs 256.
    #[arg(short = 'I', value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    iters: Option<usize>,
    /// Window: messages outstanding before waiting for their completions.
    #[arg(short = 'W', default_value_t = 64)]
    window: usize,
    /// Warm-up windows per size.
    #[arg(short = 'w', default_value_t = 1)]
    warmup: usize,
    /// Verify the data of every message.
    #[arg(short = 'c')]
    verify: bool,
    #[command(flatten)]
    conn: Conn,
}

type Res<T> = Result<T, String>;

const TAG: u64 = 0xb00;
const ACK_TAG: u64 = 0xac0;

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let conn = args.conn.clone();
    match launch(&conn, move |side| session(&args, side)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tagged-bw: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn iters_for(args: &Args, size: usize) -> usize {
    let n = args.iters.unwrap_or(if size >= 1 << 20 {
        200
    } else if size >= 64 << 10 {
        1000
    } else {
        10_000
    });
    // Whole windows only.
    n.div_ceil(args.window).max(1) * args.window
}

fn session(args: &Args, side: Side) -> Res<()> {
    if args.window == 0 {
        return Err("-W must be at least 1".into());
    }
    let sizes: Vec<usize> = args
        .size
        .split(',')
        .map(parse_size)
        .collect::<Result<_, _>>()?;
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
    } = rdm_peer(&args.conn, bind, &mut oob, 4 * args.window + 16, |b| b)?;
    if print && role == Role::Client {
        print_header();
    }
    let mut t = Bw {
        ep: &ep,
        cq: &cq,
        peer,
        done: Vec::new(),
    };
    for &size in &sizes {
        let iters = iters_for(args, size);
        let windows = iters / args.window;
        oob.sync().map_err(|e| e.to_string())?;
        let mut start = Instant::now();
        match role {
            Role::Client => {
                let mut msg = vec![0u8; size];
                fill_pattern(&mut msg, size as u64);
                let msg = Bytes::from(msg);
                for w in 0..args.warmup + windows {
                    if w == args.warmup {
                        start = Instant::now();
                    }
                    for _ in 0..args.window {
                        t.send(msg.clone(), TAG)?;
                    }
                    t.wait(args.window, CompletionFlags::SEND, None)?;
                }
                t.recv(BytesMut::with_capacity(8), ACK_TAG)?;
                t.wait(1, CompletionFlags::RECV, None)?;
                if print {
                    print_row(size, iters, 1, start.elapsed());
                }
            }
            Role::Server => {
                let verify = args.verify.then_some(size);
                for _ in 0..args.warmup + windows {
                    for _ in 0..args.window {
                        t.recv(BytesMut::with_capacity(size.max(1)), TAG)?;
                    }
                    t.wait(args.window, CompletionFlags::RECV, verify)?;
                }
                t.send(Bytes::from_static(b"ack"), ACK_TAG)?;
                t.wait(1, CompletionFlags::SEND, None)?;
            }
        }
        oob.sync().map_err(|e| e.to_string())?;
    }
    if print {
        eprintln!(
            "# path to the peer: {}",
            common::path_taken(Some(&ep.stats()), domain.device())
        );
    }
    Ok(())
}

struct Bw<'a> {
    ep: &'a Endpoint<Rdm>,
    cq: &'a CompletionQueue,
    peer: PeerId,
    done: Vec<Completion>,
}

impl Bw<'_> {
    fn send(&mut self, msg: Bytes, tag: u64) -> Res<()> {
        loop {
            match self.ep.tsend(self.peer, msg.clone(), tag, 0) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Again => self.poll()?,
                Err(e) => return Err(format!("tsend: {e}")),
            }
        }
    }

    fn recv(&mut self, buf: BytesMut, tag: u64) -> Res<()> {
        let mut buf = buf;
        loop {
            match self.ep.trecv(buf, tag, 0, 0) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Again => {
                    buf = e.into_buffer().into_recv().ok_or("receive buffer lost")?;
                    self.poll()?;
                }
                Err(e) => return Err(format!("trecv: {e}")),
            }
        }
    }

    fn poll(&mut self) -> Res<()> {
        poll_cq(self.cq, &mut self.done, 64).map(|_| ())
    }

    /// Waits for `n` completions of `kind` (verifying received data when asked).
    fn wait(&mut self, n: usize, kind: CompletionFlags, verify: Option<usize>) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut got = 0;
        while got < n {
            self.poll()?;
            for c in self.done.drain(..) {
                if !c.flags.contains(kind) {
                    continue;
                }
                if let (Some(size), Some(data)) = (verify, c.buf.as_recv()) {
                    if c.len != size {
                        return Err(format!("received {} bytes, expected {size}", c.len));
                    }
                    check_pattern(data, size as u64)?;
                }
                got += 1;
            }
            if Instant::now() > deadline {
                return Err(format!("only {got} of {n} completions within a minute"));
            }
        }
        Ok(())
    }
}
