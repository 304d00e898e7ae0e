//! Many endpoints in one tokio program that never busy-polls: each completion queue's descriptor
//! (`CompletionQueue::wait_fd`, libfabric's `FI_WAIT_FD`) sits in tokio's reactor through
//! `AsyncFd`, and a task blocks on it after `trywait` (libfabric's `fi_trywait`) says nothing is
//! ready. While idle the process uses next to no CPU; then every endpoint sends to the next one
//! and each task wakes for its messages.
//!
//! ```text
//! cargo run --release --example wait-fd -- [-n ENDPOINTS] [-m MESSAGES] [--idle-secs S] [-p udp|shm|loopback|efa]
//! ```
//!
//! It prints the CPU time the process used while idle (user + system, from `getrusage`, as a
//! share of one CPU) and fails when that is over half a CPU: a program that busy-polls uses all
//! of one. Then a pinger in a thread of its own (busy-polling) sends pings to the sleeping
//! tasks, one at a time and a few milliseconds apart so that each finds its task asleep; each
//! task answers from its wait. The round trips' median, 99th percentile and maximum bound how
//! soon a sleeping task answers a ping after it arrives; each ping also carries the time it
//! was sent, and the task notes when it sent the answer: that one-way figure (ping sent, task
//! woken, answer sent) is printed too.

mod common;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use efa::{AddressVector, CompletionQueue, Domain, Endpoint, EpType, Hints, Rdm, getinfo};
use tokio::io::unix::AsyncFd;

#[derive(Parser, Debug)]
#[command(about = "Many endpoints waiting on their completion queues' descriptors under tokio")]
struct Args {
    /// Endpoints (each with its own completion queue and task)
    #[arg(short = 'n', default_value_t = 16)]
    endpoints: usize,
    /// Messages each endpoint sends to the next one
    #[arg(short = 'm', default_value_t = 100)]
    messages: usize,
    /// Seconds of idling measured before the messages
    #[arg(long, default_value_t = 2.0)]
    idle_secs: f64,
    /// Device (provider): udp, shm, loopback, or efa (cargo feature `efa`)
    #[arg(short = 'p', default_value = "udp")]
    provider: String,
    /// Pings to each sleeping task after the messages (0: none)
    #[arg(long, default_value_t = 20)]
    pings: usize,
}

/// CPU time this process used so far (user + system).
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// A completion queue in tokio's reactor through its descriptor (the queue is `AsFd`).
struct FdQueue {
    cq: Arc<CompletionQueue>,
    fd: AsyncFd<Arc<CompletionQueue>>,
}

impl FdQueue {
    fn new(cq: Arc<CompletionQueue>) -> efa::Result<FdQueue> {
        // SAFETY: the descriptor is the queue's for its whole life (`CompletionQueue::wait_fd`),
        // and the `AsyncFd` holds the queue (an `Arc`) until it is dropped; nothing closes it
        // meanwhile.
        let fd =
            unsafe { AsyncFd::register_with_interest(cq.clone(), tokio::io::Interest::READABLE) }
                .map_err(|e| efa::Error::io("AsyncFd", std::io::Error::other(e.to_string())))?;
        Ok(FdQueue { cq, fd })
    }

    /// Takes up to `max` completions into `out` (emptied first); when none was ready and
    /// `trywait` says nothing is, first sleeps until the descriptor is readable (then `out` may
    /// stay empty: call again).
    async fn poll(&self, out: &mut Vec<efa::Completion>, max: usize) -> efa::Result<()> {
        out.clear();
        self.cq.poll(out, max)?;
        if out.is_empty() && self.cq.trywait().is_ok() {
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(|e| efa::Error::io("readable", e))?;
            guard.clear_ready();
        }
        Ok(())
    }
}

/// Receives `want` messages on `ep`, blocking on the queue's descriptor whenever nothing is
/// ready; returns how many it got.
async fn receiver(
    ep: Arc<Endpoint<Rdm>>,
    cq: Arc<CompletionQueue>,
    want: usize,
) -> efa::Result<usize> {
    let q = FdQueue::new(cq)?;
    for i in 0..want.min(64) {
        ep.recv(BytesMut::with_capacity(64), i as u64)?;
    }
    let (mut got, mut posted) = (0, want.min(64));
    let mut out = Vec::new();
    while got < want {
        q.poll(&mut out, 64).await?;
        for c in &out {
            if c.flags.contains(efa::CompletionFlags::RECV) {
                got += 1;
                if posted < want {
                    ep.recv(BytesMut::with_capacity(64), posted as u64)?;
                    posted += 1;
                }
            }
        }
    }
    Ok(got)
}

/// The clock the pinger and the echo tasks share (one process): nanoseconds since `base`.
fn stamp(base: Instant) -> u64 {
    base.elapsed().as_nanos() as u64
}

/// Answers `count` pings from `pinger`, sleeping on the queue's descriptor in between; returns
/// for each ping the time from its send (the stamp it carries) to the answer's send.
async fn echo(
    ep: Arc<Endpoint<Rdm>>,
    cq: Arc<CompletionQueue>,
    pinger: efa::PeerId,
    count: usize,
    base: Instant,
) -> efa::Result<Vec<Duration>> {
    let q = FdQueue::new(cq)?;
    ep.recv(BytesMut::with_capacity(64), 0)?;
    let (mut answers, mut out) = (Vec::with_capacity(count), Vec::new());
    while answers.len() < count {
        q.poll(&mut out, 16).await?;
        for c in &out {
            if c.flags.contains(efa::CompletionFlags::RECV) {
                ep.inject(pinger, b"pong")?;
                let now = stamp(base);
                let sent = c
                    .buf
                    .as_recv()
                    .and_then(|b| b.get(..8))
                    .and_then(|b| b.try_into().ok())
                    .map_or(now, u64::from_le_bytes);
                answers.push(Duration::from_nanos(now.saturating_sub(sent)));
                ep.recv(BytesMut::with_capacity(64), 0)?;
            }
        }
    }
    Ok(answers)
}

/// The pinger: `rounds` pings to each of `targets` in turn, a few milliseconds apart, each
/// answered before the next; the round trips, sorted.
fn pinger(
    ep: Endpoint<Rdm>,
    cq: CompletionQueue,
    targets: Vec<efa::PeerId>,
    rounds: usize,
    base: Instant,
) -> efa::Result<Vec<Duration>> {
    let mut rtts = Vec::with_capacity(targets.len() * rounds);
    let mut out = Vec::new();
    for _ in 0..rounds {
        for &t in &targets {
            // Long enough for the task to be asleep again.
            std::thread::sleep(Duration::from_millis(3));
            ep.recv(BytesMut::with_capacity(64), 0)?;
            let start = Instant::now();
            ep.inject(t, &stamp(base).to_le_bytes())?;
            loop {
                out.clear();
                cq.poll(&mut out, 16)?;
                if out
                    .iter()
                    .any(|c| c.flags.contains(efa::CompletionFlags::RECV))
                {
                    break;
                }
                if start.elapsed() > Duration::from_secs(10) {
                    return Err(efa::Error::new(efa::ErrorKind::TimedOut, "ping"));
                }
            }
            rtts.push(start.elapsed());
        }
    }
    rtts.sort();
    Ok(rtts)
}

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("wait-fd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> efa::Result<bool> {
    let n = args.endpoints.max(2);
    let info = getinfo(&Hints::new().provider(&args.provider).ep_type(EpType::Rdm))?.remove(0);
    let domain = Domain::open(&info)?;
    let av = AddressVector::new(&domain);
    let mut eps = Vec::new();
    for _ in 0..n {
        let cq = Arc::new(CompletionQueue::new(&domain, 256)?);
        let ep = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
        eps.push((Arc::new(ep), cq));
    }
    let peers: Vec<_> = eps
        .iter()
        .map(|(ep, _)| av.insert(ep.addr()))
        .collect::<efa::Result<_>>()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| efa::Error::io("tokio", e))?;
    let m = args.messages;
    let idle = Duration::from_secs_f64(args.idle_secs);
    rt.block_on(async {
        let tasks: Vec<_> = eps
            .iter()
            .map(|(ep, cq)| tokio::spawn(receiver(ep.clone(), cq.clone(), m)))
            .collect();
        // Idle: every task blocks on its descriptor.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (t0, c0) = (Instant::now(), cpu_time());
        tokio::time::sleep(idle).await;
        let share = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
        println!(
            "# {n} endpoints on {}, each waiting on its completion queue's descriptor: idle \
             CPU {:.1}% of one CPU over {:.1} s",
            args.provider,
            share * 100.0,
            idle.as_secs_f64()
        );
        // Every endpoint sends `m` messages to the next one.
        let start = Instant::now();
        for (i, (ep, cq)) in eps.iter().enumerate() {
            let to = peers[(i + 1) % n];
            let mut sent = 0;
            let mut out = Vec::new();
            while sent < m {
                match ep.send(to, Bytes::from(vec![i as u8; 32]), 1_000_000 + sent as u64) {
                    Ok(()) => sent += 1,
                    Err(e) if e.kind() == efa::ErrorKind::Again => {
                        out.clear();
                        let _ = cq.poll(&mut out, 64);
                        tokio::task::yield_now().await;
                    }
                    Err(e) => return Err(e.error),
                }
            }
        }
        let mut got = 0;
        for t in tasks {
            got += tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .map_err(|_| efa::Error::new(efa::ErrorKind::TimedOut, "receive"))?
                .map_err(|e| efa::Error::io("join", std::io::Error::other(e)))??;
        }
        println!(
            "# {got} messages of {} delivered to {n} waiting tasks in {:.1} ms",
            n * m,
            start.elapsed().as_secs_f64() * 1e3
        );
        if args.pings > 0 {
            let cq = CompletionQueue::new(&domain, 256)?;
            let pav = AddressVector::new(&domain);
            let p = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&pav).build()?;
            let me = av.insert(p.addr())?;
            let targets = eps
                .iter()
                .map(|(ep, _)| pav.insert(ep.addr()))
                .collect::<efa::Result<Vec<_>>>()?;
            let base = Instant::now();
            let echoes: Vec<_> = eps
                .iter()
                .map(|(ep, cq)| tokio::spawn(echo(ep.clone(), cq.clone(), me, args.pings, base)))
                .collect();
            let rounds = args.pings;
            let t = std::thread::spawn(move || pinger(p, cq, targets, rounds, base));
            let mut answers = Vec::new();
            for e in echoes {
                answers.extend(
                    e.await
                        .map_err(|e| efa::Error::io("join", std::io::Error::other(e)))??,
                );
            }
            answers.sort();
            let rtts = t
                .join()
                .map_err(|_| efa::Error::new(efa::ErrorKind::Io, "the pinger panicked"))??;
            let us = |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
            println!(
                "# {} pings to sleeping tasks: round trip median {:.1} us, p99 {:.1} us, max {:.1} us",
                rtts.len(),
                us(&rtts, 0.5),
                us(&rtts, 0.99),
                us(&rtts, 1.0)
            );
            println!(
                "# ping sent -> answer sent by the woken task: median {:.1} us, p90 {:.1} us, \
                 p99 {:.1} us, max {:.1} us",
                us(&answers, 0.5),
                us(&answers, 0.9),
                us(&answers, 0.99),
                us(&answers, 1.0)
            );
        }
        Ok(got == n * m && share < 0.5)
    })
}
