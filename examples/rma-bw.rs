//! RMA bandwidth in the manner of fabtests' `fi_rma_bw`: the client keeps a window of RMA writes,
//! writes with immediate data or reads outstanding against a region the server registered and
//! handed out (its `RemoteKey` travels over the out-of-band connection as JSON), and reports
//! MB/sec in fabtests' columns.
//!
//! ```text
//! cargo run --release --example rma-bw                          # both ends in this process
//! cargo run --release --example rma-bw -- -o read -S 64k -c     # reads, verified
//! cargo run --release --example rma-bw -- -l                    # server
//! cargo run --release --example rma-bw -- -o writedata 127.0.0.1   # client
//! FI_EFA_USE_DEVICE_RDMA=0 cargo run --release --example rma-bw # force the emulated protocols
//! ```
//!
//! The client decides the operation, sizes, iterations, window and verification and sends them
//! to the server. With `writedata` the server waits for one completion per write (each carrying
//! the 4-byte immediate data, checked to arrive exactly once each) before it acknowledges; with
//! `write` and `read` the server only drives its endpoint (emulated RMA needs the target's
//! progress; device RDMA does not) until the client says it is done. Whether the operations ran
//! as device RDMA or emulated is printed before the table, with the endpoint's byte counters.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{
    Conn, RdmPeer, Role, Side, check_pattern, fill_pattern, launch, parse_size, poll_cq,
    print_header, print_row, rdm_peer,
};
use efa::{
    Access, Completion, CompletionFlags, CompletionQueue, Endpoint, ErrorKind, PeerId, Rdm,
    RemoteKey,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "RMA bandwidth test (fabtests fi_rma_bw style) over efa RDM endpoints")]
struct Args {
    /// Operation: write, writedata or read.
    #[arg(short = 'o', default_value = "write")]
    op: String,
    /// Transfer size (64, 64k, 4m) or a comma-separated list.
    #[arg(short = 'S', default_value = "64,64k,4m")]
    size: String,
    /// Transfers per size (default 10000; 1000 from 64 KiB on, 100 from 4 MiB on), rounded up
    /// to a whole number of windows (-W): 100 with the default window of 64 runs 128.
    #[arg(short = 'I', value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    iters: Option<usize>,
    /// Window: transfers outstanding before waiting for their completions.
    #[arg(short = 'W', default_value_t = 64)]
    window: usize,
    /// Verify the data (written: checked in the server's region; read: in every read buffer).
    #[arg(short = 'c')]
    verify: bool,
    /// Print the endpoint's and the device's counters at the end (retransmissions, RNR, ...).
    #[arg(short = 'v')]
    verbose: bool,
    /// Writes: cycle the source and the target of the writes through this many bytes (the
    /// largest multiple of the size at most this), write `k` going from and to offset
    /// `k * size mod span`, instead of one buffer that stays in the cache. With 256m this moves
    /// data between memory as large as `examples/kv-transfer`'s, one write at a time.
    #[arg(long, value_parser = parse_size)]
    span: Option<usize>,
    #[command(flatten)]
    conn: Conn,
}

type Res<T> = Result<T, String>;

/// The test the client asks for.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Plan {
    op: Op,
    sizes: Vec<usize>,
    iters: Option<usize>,
    window: usize,
    verify: bool,
    /// See `Args::span`; 0: one buffer.
    #[serde(default)]
    span: usize,
}

impl Plan {
    /// The slots the writes of `size` bytes cycle through (1: one buffer).
    fn slots(&self, size: usize) -> usize {
        if self.op == Op::Read {
            1
        } else {
            (self.span / size).max(1)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum Op {
    Write,
    WriteData,
    Read,
}

const DONE_TAG: u64 = 0xd0e;

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let conn = args.conn.clone();
    match launch(&conn, move |side| session(&args, side)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rma-bw: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn iters_for(plan: &Plan, size: usize) -> usize {
    let n = plan.iters.unwrap_or(if size >= 4 << 20 {
        100
    } else if size >= 64 << 10 {
        1000
    } else {
        10_000
    });
    n.div_ceil(plan.window).max(1) * plan.window
}

fn plan_of(args: &Args) -> Res<Plan> {
    let op = match args.op.as_str() {
        "write" => Op::Write,
        "writedata" => Op::WriteData,
        "read" => Op::Read,
        o => return Err(format!("-o {o}: expected write, writedata or read")),
    };
    if args.window == 0 {
        return Err("-W must be at least 1".into());
    }
    let sizes = args
        .size
        .split(',')
        .map(parse_size)
        .collect::<Result<Vec<_>, _>>()?;
    if sizes.contains(&0) {
        return Err("-S: sizes must be at least 1 byte".into());
    }
    if args.span.is_some() && op == Op::Read {
        return Err("--span: writes only".into());
    }
    Ok(Plan {
        op,
        sizes,
        iters: args.iters,
        window: args.window,
        verify: args.verify,
        span: args.span.unwrap_or(0),
    })
}

fn session(args: &Args, side: Side) -> Res<()> {
    let Side {
        role,
        mut oob,
        print,
        bind,
    } = side;
    // The client's plan rules; the server follows.
    let plan = match role {
        Role::Client => {
            let plan = plan_of(args)?;
            let line = serde_json::to_string(&plan).map_err(|e| e.to_string())?;
            oob.send_line(&line).map_err(|e| e.to_string())?;
            plan
        }
        Role::Server => {
            let line = oob.recv_line().map_err(|e| format!("plan: {e}"))?;
            serde_json::from_str(&line).map_err(|e| format!("plan: {e}"))?
        }
    };
    let max = plan
        .sizes
        .iter()
        .map(|&n| n * plan.slots(n))
        .max()
        .unwrap_or(1);
    let RdmPeer {
        domain,
        cq,
        ep,
        peer,
        ..
    } = rdm_peer(&args.conn, bind, &mut oob, 4 * plan.window + 16, |b| b)?;
    let mut t = Bw {
        ep: &ep,
        cq: &cq,
        peer,
        done: Vec::new(),
    };
    match role {
        Role::Server => {
            let mut region = domain
                .register(vec![0u8; max], Access::REMOTE_READ | Access::REMOTE_WRITE)
                .map_err(|e| e.to_string())?;
            let rk = region.remote_key().map_err(|e| e.to_string())?;
            let line = serde_json::to_string(&rk).map_err(|e| e.to_string())?;
            oob.send_line(&line).map_err(|e| e.to_string())?;
            for &size in &plan.sizes {
                let iters = iters_for(&plan, size);
                if plan.op == Op::Read {
                    fill_pattern(&mut region.write()[..size], size as u64);
                }
                oob.sync().map_err(|e| e.to_string())?;
                if plan.op == Op::WriteData {
                    t.await_remote_writes(iters, size)?;
                    t.send_done()?;
                } else {
                    t.await_done()?;
                }
                if plan.verify && plan.op != Op::Read {
                    let slots = plan.slots(size).min(iters);
                    for (k, slot) in region.read()[..slots * size].chunks(size).enumerate() {
                        check_pattern(slot, size as u64).map_err(|e| {
                            format!("written data, {size} bytes at offset {}: {e}", k * size)
                        })?;
                    }
                }
                oob.sync().map_err(|e| e.to_string())?;
            }
            if print {
                print_paths(&ep, "server");
            }
            if args.verbose {
                print_counters(&ep, &domain, "server");
            }
        }
        Role::Client => {
            let line = oob.recv_line().map_err(|e| format!("remote key: {e}"))?;
            let rk: RemoteKey =
                serde_json::from_str(&line).map_err(|e| format!("remote key: {e}"))?;
            let e = ep.rma_emulation();
            if print {
                let path = |emulated: bool| if emulated { "emulated" } else { "device" };
                println!(
                    "# rma-bw -o {:?}: write {}, read {} (towards peers with device RDMA)",
                    plan.op,
                    path(e.write),
                    path(e.read)
                );
                print_header();
            }
            for &size in &plan.sizes {
                let iters = iters_for(&plan, size);
                let slots = plan.slots(size);
                let mut msg = vec![0u8; size * slots];
                for slot in msg.chunks_mut(size) {
                    fill_pattern(slot, size as u64);
                }
                let msg = Bytes::from(msg);
                let mut spare: Vec<BytesMut> = Vec::new();
                oob.sync().map_err(|e| e.to_string())?;
                let start = Instant::now();
                let mut posted = 0;
                let mut completed = 0;
                while completed < iters {
                    while posted < iters && posted - completed < plan.window {
                        let at = (posted % slots) * size;
                        let (src, to) = (msg.slice(at..at + size), rk.at(at as u64));
                        let posted_ok = match plan.op {
                            Op::Write => t.ep.write(peer, src, to, 0),
                            Op::WriteData => t.ep.write_data(peer, src, to, posted as u32, 0),
                            Op::Read => {
                                let buf = spare.pop().unwrap_or_default();
                                t.ep.read(peer, buf, size, rk.start(), 0)
                            }
                        };
                        match posted_ok {
                            Ok(()) => posted += 1,
                            Err(e) if e.kind() == ErrorKind::Again => {
                                if let Some(b) = e.into_buffer().into_recv() {
                                    spare.push(b);
                                }
                                break;
                            }
                            Err(e) => return Err(format!("{:?}: {e}", plan.op)),
                        }
                    }
                    t.poll()?;
                    for c in t.done.drain(..) {
                        if !c.flags.contains(CompletionFlags::RMA) {
                            continue;
                        }
                        completed += 1;
                        if let Some(b) = c.buf.into_recv() {
                            if plan.verify {
                                if b.len() != size {
                                    return Err(format!("read {} bytes, expected {size}", b.len()));
                                }
                                check_pattern(&b, size as u64)
                                    .map_err(|e| format!("read data: {e}"))?;
                            }
                            spare.push(b);
                        }
                    }
                }
                if plan.op == Op::WriteData {
                    t.await_done()?;
                } else {
                    t.send_done()?;
                }
                if print {
                    print_row(size, iters, 1, start.elapsed());
                }
                oob.sync().map_err(|e| e.to_string())?;
            }
            if print {
                print_paths(&ep, "client");
            }
            if args.verbose {
                print_counters(&ep, &domain, "client");
            }
        }
    }
    Ok(())
}

fn print_counters(ep: &Endpoint<Rdm>, domain: &efa::Domain, who: &str) {
    println!("# {who} endpoint: {:?}", ep.stats());
    println!("# {who} device: {:?}", domain.device().stats());
}

fn print_paths(ep: &Endpoint<Rdm>, who: &str) {
    let s = ep.stats();
    println!(
        "# {who}: rma bytes on the device {}, emulated {}; messages to the peer: {}",
        s.device_rma_bytes,
        s.emulated_rma_bytes,
        common::path_taken(Some(&s), ep.domain().device())
    );
}

struct Bw<'a> {
    ep: &'a Endpoint<Rdm>,
    cq: &'a CompletionQueue,
    peer: PeerId,
    done: Vec<Completion>,
}

impl Bw<'_> {
    fn poll(&mut self) -> Res<()> {
        poll_cq(self.cq, &mut self.done, 64).map(|_| ())
    }

    /// Tells the peer this size is over (a tagged message).
    fn send_done(&mut self) -> Res<()> {
        loop {
            match self
                .ep
                .tsend(self.peer, Bytes::from_static(b"done"), DONE_TAG, 1)
            {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Again => self.poll()?,
                Err(e) => return Err(format!("tsend: {e}")),
            }
        }
        self.wait_for(|c| c.flags.contains(CompletionFlags::SEND))
    }

    /// Drives the endpoint until the peer says this size is over.
    fn await_done(&mut self) -> Res<()> {
        self.ep
            .trecv(BytesMut::with_capacity(8), DONE_TAG, 0, 2)
            .map_err(|e| format!("trecv: {e}"))?;
        self.wait_for(|c| c.flags.contains(CompletionFlags::RECV) && c.context == 2)
    }

    /// Waits for `n` writes with immediate data, each immediate value exactly once.
    fn await_remote_writes(&mut self, n: usize, size: usize) -> Res<()> {
        let mut seen = vec![false; n];
        let mut got = 0;
        let deadline = Instant::now() + Duration::from_secs(120);
        while got < n {
            self.poll()?;
            for c in self.done.drain(..) {
                if !c.flags.contains(CompletionFlags::REMOTE_WRITE) {
                    continue;
                }
                let imm = c.data.ok_or("remote write without its immediate data")? as usize;
                if imm >= n || seen[imm] {
                    return Err(format!(
                        "immediate data {imm} arrived twice or out of range"
                    ));
                }
                if c.len != size {
                    return Err(format!("remote write of {} bytes, expected {size}", c.len));
                }
                seen[imm] = true;
                got += 1;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "only {got} of {n} remote writes within two minutes"
                ));
            }
        }
        Ok(())
    }

    fn wait_for(&mut self, pred: impl Fn(&Completion) -> bool) -> Res<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            self.poll()?;
            if let Some(i) = self.done.iter().position(&pred) {
                self.done.remove(i);
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("no completion within two minutes".into());
            }
        }
    }
}
