//! Criterion benches of `Endpoint<Rdm>` on the loopback device (no system calls): small-message
//! rate through the whole stack (endpoint, engine, device), and ping-pong latency on loopback,
//! udp and shm (the local fast path, in one thread: the software cost of a message, without the
//! cache-line transfers between two cores).
//!
//! For instruction counts (repeatable on a noisy machine), `EFA_RDM_PROFILE=<path>:<n>` skips
//! criterion and runs `n` 64-byte `inject` round trips (after 1000 to warm up) between two
//! endpoints of one domain, `path` being `loopback`, `shm-local` (the shm device's endpoints
//! through their local channels), `udp-local` (the default same-host path) or `udp` (the udp
//! device alone, over loopback: user space only, the kernel's part is not counted): the difference of
//! `valgrind --tool=callgrind` totals for two values of `n` is the whole stack's cost per round
//! trip (endpoint, completion queue, engine, local path, device polls), the two sides' together.
//! `idle-<path>:<n>` instead polls one endpoint's completion queue `n` times after the warm-up,
//! with nothing arriving: the cost of an empty progress pass.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::fault::FaultConfig;
use efa::{
    AddressVector, Completion, CompletionFlags, CompletionQueue, Config, Domain, Endpoint,
    ErrorKind, PeerId, Rdm,
};

struct Pair {
    a: (CompletionQueue, AddressVector, Endpoint<Rdm>),
    b: (CompletionQueue, AddressVector, Endpoint<Rdm>),
    pb: PeerId,
    pa: PeerId,
}

fn pair(d: &Domain) -> Pair {
    let mk = || {
        let cq = CompletionQueue::new(d, 8192).unwrap();
        let av = AddressVector::new(d);
        let ep = Endpoint::<Rdm>::builder(d).cq(&cq).av(&av).build().unwrap();
        (cq, av, ep)
    };
    let (a, b) = (mk(), mk());
    let pb = a.1.insert(b.2.addr()).unwrap();
    let pa = b.1.insert(a.2.addr()).unwrap();
    Pair { a, b, pb, pa }
}

fn loopback() -> Domain {
    let net = LoopbackNetwork::new(FaultConfig::default());
    Domain::with_device(
        LoopbackDevice::open(&net, LoopbackConfig::default()).unwrap(),
        Config::default(),
    )
}

/// An shm domain in `dir`: RDM endpoints on it reach each other through their local fast path.
fn shm(dir: &std::path::Path) -> Domain {
    Domain::with_device(
        ShmDevice::open(ShmConfig::in_dir(dir)).unwrap(),
        Config::default(),
    )
}

fn udp() -> Domain {
    Domain::with_device(
        UdpDevice::open(UdpConfig::default()).unwrap(),
        Config::default(),
    )
}

/// The default same-host path: a udp device routed through an shm directory in `dir`, as
/// `getinfo` builds it, so RDM endpoints reach each other through their local channels.
fn udp_local(dir: &std::path::Path) -> Domain {
    let udp = UdpDevice::open(UdpConfig::default()).unwrap();
    let routed = efa::device::route::RoutedDevice::open(udp, ShmConfig::in_dir(dir)).unwrap();
    Domain::with_device(routed, Config::default())
}

/// Sends `n` messages of `size` from a to b, with b's receives posted as they complete.
fn stream(p: &Pair, n: usize, size: usize, out: &mut Vec<Completion>) {
    let msg = Bytes::from(vec![7u8; size]);
    let window = 256;
    let (mut sent, mut recvd, mut posted, mut send_done) = (0, 0, 0, 0);
    while recvd < n || send_done < n {
        while posted < n && posted - recvd < window {
            p.b.2.recv(BytesMut::with_capacity(size), 0).unwrap();
            posted += 1;
        }
        while sent < n && sent - send_done < window {
            match p.a.2.send(p.pb, msg.clone(), 0) {
                Ok(()) => sent += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => panic!("{e}"),
            }
        }
        out.clear();
        send_done += p.a.0.poll(out, 256).unwrap();
        out.clear();
        recvd += p.b.0.poll(out, 256).unwrap();
    }
}

fn pingpong(p: &Pair, iters: u64, size: usize, out: &mut Vec<Completion>) -> Duration {
    let msg = Bytes::from(vec![1u8; size]);
    let start = Instant::now();
    for _ in 0..iters {
        p.b.2.recv(BytesMut::with_capacity(size.max(1)), 0).unwrap();
        p.a.2.recv(BytesMut::with_capacity(size.max(1)), 0).unwrap();
        p.a.2.send(p.pb, msg.clone(), 0).unwrap();
        wait_recv(&p.b.0, out);
        p.b.2.send(p.pa, msg.clone(), 0).unwrap();
        wait_recv(&p.a.0, out);
    }
    let t = start.elapsed();
    // Drain send completions.
    for _ in 0..4 {
        out.clear();
        let _ = p.a.0.poll(out, 1024);
        out.clear();
        let _ = p.b.0.poll(out, 1024);
    }
    t
}

/// [`pingpong`] with `inject` (no send completions), as `fi_pingpong` sends small messages.
fn pingpong_inject(p: &Pair, iters: u64, size: usize, out: &mut Vec<Completion>) -> Duration {
    let msg = vec![1u8; size];
    let (mut ba, mut bb) = (
        BytesMut::with_capacity(size.max(1)),
        BytesMut::with_capacity(size.max(1)),
    );
    let start = Instant::now();
    for _ in 0..iters {
        p.b.2.recv(bb, 0).unwrap();
        p.a.2.recv(ba, 0).unwrap();
        p.a.2.inject(p.pb, &msg).unwrap();
        bb = wait_recv_buf(&p.b.0, out);
        p.b.2.inject(p.pa, &msg).unwrap();
        ba = wait_recv_buf(&p.a.0, out);
    }
    start.elapsed()
}

/// Waits for a receive completion and hands its buffer back, emptied for the next receive.
fn wait_recv_buf(cq: &CompletionQueue, out: &mut Vec<Completion>) -> BytesMut {
    loop {
        out.clear();
        cq.poll(out, 16).unwrap();
        if let Some(c) = out
            .drain(..)
            .find(|c| c.flags.contains(CompletionFlags::RECV))
        {
            let mut b = c.buf.into_recv().unwrap();
            b.clear();
            return b;
        }
    }
}

fn wait_recv(cq: &CompletionQueue, out: &mut Vec<Completion>) {
    loop {
        out.clear();
        cq.poll(out, 16).unwrap();
        if out.iter().any(|c| c.flags.contains(CompletionFlags::RECV)) {
            return;
        }
    }
}

fn benches(c: &mut Criterion) {
    let mut out = Vec::with_capacity(256);
    let mut g = c.benchmark_group("rdm_message_rate_loopback");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for size in [8usize, 64] {
        let d = loopback();
        let p = pair(&d);
        let n = 10_000;
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("{size}B"), |bch| {
            bch.iter(|| stream(&p, n, size, &mut out))
        });
    }
    for size in [64 << 10, 1 << 20] {
        let d = loopback();
        let p = pair(&d);
        let n = if size >= 1 << 20 { 20 } else { 200 };
        g.throughput(Throughput::Bytes((n * size) as u64));
        g.bench_function(format!("{}KiB", size >> 10), |bch| {
            bch.iter(|| stream(&p, n, size, &mut out))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("rdm_pingpong_one_way");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    let dir = tempfile::tempdir().unwrap();
    for (name, d) in [
        ("loopback", loopback()),
        ("udp", udp()),
        ("shm-local", shm(dir.path())),
    ] {
        let p = pair(&d);
        for size in [64usize, 64 << 10] {
            g.bench_function(format!("{name}/{size}B"), |bch| {
                bch.iter_custom(|iters| pingpong(&p, iters, size, &mut out) / 2)
            });
        }
        g.bench_function(format!("{name}/inject/64B"), |bch| {
            bch.iter_custom(|iters| pingpong_inject(&p, iters, 64, &mut out) / 2)
        });
    }
    g.finish();
}

/// One poll of a completion queue whose endpoint has nothing to do: what a busy-polling
/// application pays per spin, and half of it on average before it sees a message.
fn idle_poll(c: &mut Criterion) {
    let mut out = Vec::with_capacity(16);
    let dir = tempfile::tempdir().unwrap();
    let mut g = c.benchmark_group("rdm_idle_poll");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for (name, d) in [
        ("loopback", loopback()),
        ("shm-local", shm(dir.path())),
        ("udp-local", udp_local(dir.path())),
    ] {
        let p = pair(&d);
        // One message each way first, so that the peers know each other.
        p.b.2.recv(BytesMut::with_capacity(8), 0).unwrap();
        p.a.2.send(p.pb, Bytes::from_static(b"hi"), 0).unwrap();
        wait_recv(&p.b.0, &mut out);
        g.bench_function(name, |bch| {
            bch.iter(|| {
                out.clear();
                p.a.0.poll(&mut out, 16).unwrap()
            })
        });
    }
    g.finish();
}

/// `EFA_RDM_PROFILE=<path>:<n>`: `n` inject round trips outside criterion (see the top).
fn profile(spec: &str) {
    let mut it = spec.split(':');
    let path = it.next().unwrap_or("shm-local");
    let n: u64 = it.next().and_then(|v| v.parse().ok()).unwrap_or(100_000);
    let (idle, path) = match path.strip_prefix("idle-") {
        Some(p) => (true, p),
        None => (false, path),
    };
    let dir = tempfile::tempdir().unwrap();
    let d = match path {
        "loopback" => loopback(),
        "shm-local" => shm(dir.path()),
        "udp-local" => udp_local(dir.path()),
        "udp" => udp(),
        other => {
            panic!("EFA_RDM_PROFILE: unknown path {other} (loopback, shm-local, udp-local, udp)")
        }
    };
    let p = pair(&d);
    let mut out = Vec::with_capacity(256);
    pingpong_inject(&p, 1000, 64, &mut out);
    if idle {
        let start = Instant::now();
        for _ in 0..n {
            out.clear();
            p.a.0.poll(&mut out, 16).unwrap();
        }
        eprintln!(
            "idle-{path}: {n} polls, {:?} each",
            start.elapsed() / n.max(1) as u32
        );
        return;
    }
    let t = pingpong_inject(&p, n, 64, &mut out);
    eprintln!(
        "{path}: {n} round trips, {:?} one way",
        t / (2 * n.max(1) as u32)
    );
}

criterion_group!(rdm, benches, idle_poll);

fn main() {
    if let Ok(spec) = std::env::var("EFA_RDM_PROFILE") {
        return profile(&spec);
    }
    rdm();
    Criterion::default().configure_from_args().final_summary();
}
