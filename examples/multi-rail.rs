//! One transfer striped over several NICs (issue 32): a [`RailGroup`] of one RDM endpoint per
//! NIC on each side, the NICs nearest a GPU (`--gpu <bus id>`, through `Hints::near`) or the
//! first `-n` of them; the client moves `-S` bytes to (or from) the server `-I` times, striped
//! over all rails, checks every byte, and prints each NIC's share and bandwidth and the total.
//!
//! ```text
//! cargo run --release --example multi-rail                    # both ends in this process, 4 udp "NICs"
//! cargo run --release --example multi-rail -- -o send -S 16m  # a striped message instead of a write
//! cargo run --release --example multi-rail -- -l              # server
//! cargo run --release --example multi-rail -- 127.0.0.1      # client
//! cargo build -p efa-emu && cargo build --release --features efa --example multi-rail
//! target/release/efa-emu run --devices 4 --bandwidth 25m -- \
//!     target/release/examples/multi-rail -p efa -S 64m          # four emulated NICs, capped
//! target/release/efa-emu run --devices 4 --bandwidth 25m -- \
//!     target/release/examples/multi-rail -p efa -S 64m -n 1     # one of them, the same cap
//! target/release/efa-emu run --devices 4 -- \
//!     target/release/examples/multi-rail -p efa --gpu first   # the NICs beside the first GPU
//! ```
//!
//! With `-p efa` the rails are the `efa` devices `getinfo` lists (nearest the GPU first with
//! `--gpu`: then, unless `-n` says otherwise, all NICs at the nearest distance); with a
//! software device (`udp`, the default, `shm`, `loopback`) the device is opened `-n` times
//! (default 4), each standing in for a NIC. Both processes must choose the same number of rails
//! (the first `min` of each side pair up).
//!
//! How it goes: the sides exchange their address bundles (`RailAddr`, hex) on the out-of-band
//! connection. For `write` (the default) and `read` the server registers one region of `-S`
//! bytes on all its rails and sends its `RailRemoteKey`. Each round `r`:
//!
//! * `write`: the client fills its buffer with the examples' pattern of round `r` and posts one
//!   `write_data` of the whole buffer (immediate data `r`); the server waits for the
//!   notification, checks the region, and says `ok` out of band.
//! * `read`: the server fills its region with round `r`'s pattern and says `go`; the client
//!   reads the region and checks it.
//! * `send`: the server posts a receive of `-S` bytes and says `go`; the client sends a message
//!   of round `r`'s pattern; the server checks it (and says `done` after the last).
//!
//! The client times each round from the post to its completion (the write or message has landed
//! in the server's memory; the read's bytes are here) and prints, after the rounds, one line per
//! rail (device, bytes it carried, its share, its bandwidth over the rounds' time) and the total.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{Conn, MAX_SIZE, Role, Side, check_pattern, fill_pattern, launch, parse_size};
use efa::rail::{RailAddr, RailCompletion, RailGroup, RailOp, RailPeer, RailRemoteKey};
use efa::topo::Near;
use efa::{Access, Domain, EpType, Hints};

#[derive(Parser, Debug, Clone)]
#[command(about = "One transfer striped over several NICs (a multi-rail group)")]
struct Args {
    /// Bytes per transfer.
    #[arg(short = 'S', default_value = "64m")]
    size: String,
    /// Rounds.
    #[arg(short = 'I', default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// What moves: write (write_data into the server's region), read (from it) or send (a
    /// message).
    #[arg(short = 'o', default_value = "write")]
    op: String,
    /// Rails: the first N NICs (efa: nearest the GPU first with --gpu; software devices: the
    /// device opened N times, default 4).
    #[arg(short = 'n')]
    rails: Option<usize>,
    /// The GPU (PCI bus id, or `first`: the topology's first GPU) whose nearest NICs carry the
    /// transfer (efa only).
    #[arg(long)]
    gpu: Option<String>,
    /// Smallest stripe (a transfer below twice this goes on one rail).
    #[arg(long, default_value = "128k")]
    min_stripe: String,
    /// Give up after this many seconds without progress.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    timeout_secs: u64,
    #[command(flatten)]
    conn: Conn,
}

type Res<T> = Result<T, String>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Write,
    Read,
    Send,
}

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let conn = args.conn.clone();
    let run = || -> Res<()> {
        // Checked once, before any connection.
        plan(&args)?;
        launch(&conn, move |side| session(&args, side))
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("multi-rail: {e}");
            ExitCode::FAILURE
        }
    }
}

fn plan(args: &Args) -> Res<(Op, usize, usize)> {
    let op = match args.op.as_str() {
        "write" => Op::Write,
        "read" => Op::Read,
        "send" => Op::Send,
        o => return Err(format!("-o {o}: expected write, read or send")),
    };
    let size = parse_size(&args.size)?;
    if size == 0 || size > MAX_SIZE {
        return Err(format!("-S {}: 1 byte to the limit of 1 GiB", args.size));
    }
    let min_stripe = parse_size(&args.min_stripe)?.max(1);
    if args.gpu.is_some() && args.conn.provider != "efa" {
        return Err("--gpu chooses efa NICs: add -p efa".into());
    }
    if args
        .rails
        .is_some_and(|n| n == 0 || n > efa::rail::MAX_RAILS)
    {
        return Err(format!("-n: 1 to {} rails", efa::rail::MAX_RAILS));
    }
    Ok((op, size, min_stripe))
}

/// The rails' domains: efa NICs (nearest `--gpu` first), or a software device opened N times.
fn open_rails(args: &Args, side: &Side) -> Res<Vec<Domain>> {
    if args.conn.provider == "efa" {
        let mut hints = Hints::new().provider("efa").ep_type(EpType::Rdm);
        if let Some(g) = &args.gpu {
            let near: Near = if g == "first" {
                let topo = efa::topo::Topology::detect().map_err(|e| e.to_string())?;
                let gpu = topo
                    .gpus()
                    .first()
                    .ok_or("--gpu first: this host has no GPU")?;
                Near::Device(gpu.addr)
            } else {
                g.parse().map_err(|e: efa::Error| e.to_string())?
            };
            if side.print {
                println!("# NICs nearest {near}");
            }
            hints = hints.near(near);
        }
        let mut infos = efa::getinfo(&hints).map_err(|e| e.to_string())?;
        if infos.is_empty() {
            return Err("no efa device".into());
        }
        let n = match (args.rails, &args.gpu) {
            (Some(n), _) => n,
            // The NICs at the nearest distance from the GPU.
            (None, Some(_)) => infos
                .iter()
                .filter(|i| i.distance == infos[0].distance)
                .count(),
            (None, None) => infos.len(),
        };
        infos.truncate(n);
        if side.print {
            for i in &infos {
                let d = i
                    .distance
                    .map_or(String::new(), |d| format!(" ({d} from the GPU)"));
                println!("# rail {}{d}", i.device.name);
            }
        }
        return infos
            .iter()
            .map(|i| Domain::open(i).map_err(|e| e.to_string()))
            .collect();
    }
    (0..args.rails.unwrap_or(4))
        .map(|_| common::open_domain(&args.conn, EpType::Rdm, side.bind))
        .collect()
}

fn session(args: &Args, mut side: Side) -> Res<()> {
    let (op, size, min_stripe) = plan(args)?;
    let rails = open_rails(args, &side)?;
    let group = RailGroup::builder(rails)
        .min_stripe(min_stripe)
        .build()
        .map_err(|e| e.to_string())?;
    let oob = &mut side.oob;
    let io = |e: std::io::Error| format!("out-of-band: {e}");
    oob.send_line(&hex(&group.addr().to_bytes())).map_err(io)?;
    let theirs = unhex(&oob.recv_line().map_err(io)?)?;
    let peer = group
        .insert(&RailAddr::from_bytes(&theirs).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(args.timeout_secs);
    let mut run = Run {
        group: &group,
        peer,
        timeout,
    };
    match side.role {
        Role::Server => server(&mut run, &mut side, op, size, args.rounds),
        Role::Client => client(&mut run, &mut side, op, size, args.rounds),
    }
}

struct Run<'a> {
    group: &'a RailGroup,
    peer: RailPeer,
    timeout: Duration,
}

impl Run<'_> {
    /// The next completion (an error completion is an error).
    fn next(&mut self) -> Res<RailCompletion> {
        let mut out = Vec::new();
        self.group
            .wait(&mut out, 1, Some(self.timeout))
            .map_err(|e| format!("waiting for a completion: {e}"))?;
        let c = out.remove(0);
        if let Err(e) = &c.result {
            return Err(format!("{:?} {} failed: {e}", c.op, c.context));
        }
        Ok(c)
    }
}

fn server(run: &mut Run, side: &mut Side, op: Op, size: usize, rounds: u32) -> Res<()> {
    let io = |e: std::io::Error| format!("out-of-band: {e}");
    let mut region = run
        .group
        .register(vec![0u8; size], Access::REMOTE_WRITE | Access::REMOTE_READ)
        .map_err(|e| e.to_string())?;
    let rk = region.remote_key().map_err(|e| e.to_string())?;
    side.oob.send_line(&hex(&rk.to_bytes())).map_err(io)?;
    // Lines alternate (one side's line is read before the other writes the next), so a
    // buffered reader never holds a line the rails' loop does not see.
    if side.oob.recv_line().map_err(io)?.trim() != "ready" {
        return Err("the client did not get ready".into());
    }
    for r in 0..rounds {
        let seq = u64::from(r);
        match op {
            Op::Write => {
                let c = run.next()?;
                if c.op != RailOp::RemoteWrite || c.data != Some(r) || c.len != size {
                    return Err(format!("round {r}: expected its notification, got {c:?}"));
                }
                check_pattern(&region.read(), seq)?;
                side.oob.send_line("ok").map_err(io)?;
            }
            Op::Read => {
                fill_pattern(&mut region.write(), seq);
                side.oob.send_line("go").map_err(io)?;
                // The client reads; keep the rails going until it says it is done.
                wait_line(run, side, "ok")?;
            }
            Op::Send => {
                run.group
                    .recv(BytesMut::with_capacity(size), seq)
                    .map_err(|e| e.to_string())?;
                side.oob.send_line("go").map_err(io)?;
                let c = run.next()?;
                let buf = c.buf.as_recv().ok_or("a receive without its buffer")?;
                if c.len != size {
                    return Err(format!("round {r}: {} bytes of {size}", c.len));
                }
                check_pattern(buf, seq)?;
            }
        }
    }
    if op == Op::Send {
        side.oob.send_line("done").map_err(io)?;
    }
    if side.print {
        println!("# server: {rounds} rounds of {size} bytes checked");
    }
    Ok(())
}

/// Polls the group until the peer's out-of-band line `want` arrives.
fn wait_line(run: &mut Run, side: &mut Side, want: &str) -> Res<()> {
    let watch = side.oob.watch().map_err(|e| e.to_string())?;
    let deadline = Instant::now() + run.timeout;
    while !watch.has_news() {
        let mut out = Vec::new();
        let _ = run.group.wait(&mut out, 8, Some(Duration::from_millis(10)));
        if let Some(c) = out.into_iter().find(|c| c.result.is_err()) {
            return Err(format!("{c:?}"));
        }
        if watch.gone() || Instant::now() > deadline {
            return Err(format!("no {want:?} from the peer"));
        }
    }
    let l = side.oob.recv_line().map_err(|e| e.to_string())?;
    if l.trim() != want {
        return Err(format!("expected {want:?} from the peer, got {l:?}"));
    }
    Ok(())
}

fn client(run: &mut Run, side: &mut Side, op: Op, size: usize, rounds: u32) -> Res<()> {
    let io = |e: std::io::Error| format!("out-of-band: {e}");
    let rk = RailRemoteKey::from_bytes(&unhex(&side.oob.recv_line().map_err(io)?)?)
        .map_err(|e| e.to_string())?;
    side.oob.send_line("ready").map_err(io)?;
    let before = run.group.stats();
    let mut spent = Duration::ZERO;
    let mut buf = vec![0u8; size];
    for r in 0..rounds {
        let seq = u64::from(r);
        if op != Op::Write {
            wait_line(run, side, "go")?;
        }
        if op != Op::Read {
            fill_pattern(&mut buf, seq);
        }
        let data = Bytes::from(buf);
        let start = Instant::now();
        let posted = match op {
            Op::Write => run.group.write_data(run.peer, data.clone(), &rk, 0, r, seq),
            Op::Read => run.group.read(run.peer, BytesMut::new(), size, &rk, 0, seq),
            Op::Send => run.group.send(run.peer, data.clone(), seq),
        };
        posted.map_err(|e| e.error.to_string())?;
        let c = run.next()?;
        spent += start.elapsed();
        if c.context != seq || c.len != size {
            return Err(format!("round {r}: unexpected {c:?}"));
        }
        buf = match c.buf {
            efa::Buffer::Recv(b) => {
                check_pattern(&b, seq)?;
                b.to_vec()
            }
            _ => data.to_vec(),
        };
        match op {
            Op::Read => side.oob.send_line("ok").map_err(io)?,
            Op::Write => wait_line(run, side, "ok")?,
            // The next round's "go" says this message arrived intact.
            Op::Send => {}
        }
    }
    if op == Op::Send {
        wait_line(run, side, "done")?;
    }
    let after = run.group.stats();
    if side.print {
        report(&before, &after, spent, size, rounds);
    }
    Ok(())
}

/// Per-rail and total bandwidth over the rounds' time.
fn report(
    before: &efa::rail::RailGroupStats,
    after: &efa::rail::RailGroupStats,
    spent: Duration,
    size: usize,
    rounds: u32,
) {
    let secs = spent.as_secs_f64().max(1e-9);
    let total: u64 = after.bytes() - before.bytes();
    println!(
        "{:<6}{:<16}{:>14}{:>8}{:>12}",
        "rail", "device", "bytes", "share", "MB/sec"
    );
    for (i, (a, b)) in after.rails.iter().zip(&before.rails).enumerate() {
        let n = a.bytes - b.bytes;
        println!(
            "{:<6}{:<16}{:>14}{:>7.1}%{:>12.2}",
            i,
            a.device,
            n,
            100.0 * n as f64 / total.max(1) as f64,
            n as f64 / secs / 1e6
        );
    }
    println!(
        "{:<6}{:<16}{:>14}{:>8}{:>12.2}",
        "total",
        format!("{rounds} x {size}"),
        total,
        "",
        total as f64 / secs / 1e6
    );
    let moved: u64 = after.rails.iter().map(|r| r.moved).sum();
    println!(
        "# {:.3} s, every byte checked, {moved} stripes moved after a rail error",
        secs
    );
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Res<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return Err(format!("not hex: {s:?}"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| format!("not hex: {s:?}")))
        .collect()
}
