//! The protocol engine alone: two engines joined directly by the simulator (no faults, no
//! device, no threads), so the figures are the engine's own cost per message.
//!
//! * message rate of small messages (8 B and 64 B, eager), in messages per second;
//! * the same small messages between two engines joined by a minimal loop instead of the
//!   simulator (`engine/direct_rate`): the engine's own cost, without the simulator's agenda;
//! * throughput of 64 KiB (medium) and 1 MiB (long-CTS) messages.
//!
//! `cargo bench --bench engine` (sample size 10, short measurement).
//!
//! For instruction counts (repeatable on a noisy machine),
//! `EFA_ENGINE_PROFILE=<kind>:<size>:<n>[:<batch>]` skips criterion and runs `n` messages (in
//! batches of 1000, or `batch`, after a warm-up) of `size` bytes, so
//! that `valgrind --tool=callgrind` (or `perf stat`) of the bench binary with and without the
//! measured part gives the cost per message; `kind` is `rate` (untagged, receives posted first),
//! `tagged`, or `direct` (the minimal loop of `engine/direct_rate`).

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use efa::RawAddr;
use efa::device::{Source, Status};
use efa::proto::engine::{Engine, Event, RecvOp};
use efa::proto::sim::{Sim, SimConfig, pattern, recv_op, send_op};

/// One batch: `n` receives posted, `n` messages sent, run to quiescence, completions taken.
fn batch(sim: &mut Sim, payload: &Bytes, n: usize) {
    let dest = sim.addr(1);
    for k in 0..n {
        if let Err((e, _)) = sim.post_recv(1, recv_op(payload.len(), k as u64)) {
            panic!("post_recv: {e}");
        }
        if let Err((e, _)) = sim.send(0, send_op(dest, payload.clone(), k as u64)) {
            panic!("send: {e}");
        }
    }
    assert!(sim.run());
    let r = sim.take_events(1);
    let s = sim.take_events(0);
    assert_eq!((r.len(), s.len()), (n, n));
}

fn new_sim() -> Sim {
    let mut cfg = SimConfig::clean(1);
    cfg.engine.max_tx_ops = 4096;
    cfg.engine.max_rx_ops = 4096;
    Sim::new(cfg, 2)
}

fn message_rate(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/message_rate");
    let n = 1000;
    for size in [8usize, 64] {
        let payload = pattern(1, size);
        let mut sim = new_sim();
        batch(&mut sim, &payload, 10);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &payload, |b, p| {
            b.iter(|| batch(&mut sim, p, n))
        });
    }
    g.finish();
}

fn throughput(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/throughput");
    for (size, n) in [(64 << 10, 64usize), (1 << 20, 8)] {
        let payload = pattern(2, size);
        let mut sim = new_sim();
        batch(&mut sim, &payload, 2);
        g.throughput(Throughput::Bytes((size * n) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &payload, |b, p| {
            b.iter(|| batch(&mut sim, p, n))
        });
    }
    g.finish();
}

/// Two engines joined by the smallest loop (no simulator): every packet is copied into one
/// datagram buffer and handed to the other engine, its send completes at once; receive buffers
/// are reused. What is left of the cost is the engine's (and the copy).
struct Direct {
    e: [Engine; 2],
    addr: [RawAddr; 2],
    now: Instant,
    wire: Vec<u8>,
    bufs: Vec<BytesMut>,
}

impl Direct {
    fn new(size: usize) -> Direct {
        let sim = new_sim();
        let mut cfg = sim.config().engine.clone();
        cfg.max_tx_ops = 4096;
        cfg.max_rx_ops = 4096;
        let addr = [sim.addr(0), sim.addr(1)];
        let now = Instant::now();
        Direct {
            e: [
                Engine::new(cfg.clone(), addr[0], now),
                Engine::new(cfg, addr[1], now),
            ],
            addr,
            now,
            wire: Vec::with_capacity(1 << 16),
            bufs: (0..1000).map(|_| BytesMut::with_capacity(size)).collect(),
        }
    }

    fn pump(&mut self) {
        loop {
            let mut busy = false;
            for i in 0..2 {
                let src = Source {
                    gid: self.addr[i].gid,
                    qpn: self.addr[i].qpn,
                };
                while let Some(t) = self.e[i].poll_transmit(self.now) {
                    busy = true;
                    self.wire.clear();
                    self.wire.extend_from_slice(&t.hdr);
                    self.wire.extend_from_slice(&t.payload);
                    drop(t.payload);
                    self.e[1 - i].handle_recv(self.now, src, &self.wire);
                    self.e[i].handle_send_completion(self.now, t.wr_id, Status::Success);
                }
            }
            if !busy {
                return;
            }
        }
    }

    /// `n` messages: `n` receives posted, `n` sends, pumped, completions taken.
    fn batch(&mut self, payload: &Bytes, n: usize) {
        for k in 0..n {
            let mut buf = self.bufs.pop().unwrap_or_default();
            buf.clear();
            let r = RecvOp {
                buf,
                tag: None,
                src: None,
                multi_recv: None,
                context: k as u64,
                local_region: None,
                room: None,
            };
            if self.e[1].post_recv(self.now, r).is_err() {
                panic!("post_recv");
            }
            let s = send_op(self.addr[1], payload.clone(), k as u64);
            if self.e[0].send(self.now, s).is_err() {
                panic!("send");
            }
        }
        self.pump();
        let mut got = 0;
        for i in 0..2 {
            while let Some(ev) = self.e[i].poll_event() {
                got += 1;
                if let Event::Recv(r) = ev {
                    self.bufs.push(r.buf);
                }
            }
        }
        assert_eq!(got, 2 * n);
    }
}

fn direct_rate(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine/direct_rate");
    let n = 1000;
    for size in [8usize, 64] {
        let payload = pattern(1, size);
        let mut d = Direct::new(size);
        d.batch(&payload, 10);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &payload, |b, p| {
            b.iter(|| d.batch(p, n))
        });
    }
    g.finish();
}

/// `EFA_ENGINE_PROFILE=<kind>:<size>:<n>[:<batch>]`: runs `n` messages outside criterion (see the top).
fn profile(spec: &str) {
    let mut it = spec.split(':');
    let kind = it.next().unwrap_or("rate");
    let size: usize = it.next().and_then(|x| x.parse().ok()).unwrap_or(8);
    let n: usize = it.next().and_then(|x| x.parse().ok()).unwrap_or(100_000);
    let per: usize = it.next().and_then(|x| x.parse().ok()).unwrap_or(1000);
    let payload = pattern(1, size);
    let per = per.clamp(1, 4096);
    if kind == "direct" {
        let mut d = Direct::new(size);
        d.batch(&payload, 10);
        let mut left = n;
        while left > 0 {
            let k = per.min(left).min(1000);
            d.batch(&payload, k);
            left -= k;
        }
        println!("{kind}: {n} messages of {size} bytes");
        return;
    }
    let mut sim = new_sim();
    batch(&mut sim, &payload, 10);
    let mut left = n;
    while left > 0 {
        let k = per.min(left);
        match kind {
            "tagged" => tagged_batch(&mut sim, &payload, k),
            _ => batch(&mut sim, &payload, k),
        }
        left -= k;
    }
    println!("{kind}: {n} messages of {size} bytes");
}

/// Like [`batch`] with tagged messages (tag = index).
fn tagged_batch(sim: &mut Sim, payload: &Bytes, n: usize) {
    let dest = sim.addr(1);
    for k in 0..n {
        let mut r = recv_op(payload.len(), k as u64);
        r.tag = Some((k as u64, 0));
        if let Err((e, _)) = sim.post_recv(1, r) {
            panic!("post_recv: {e}");
        }
        let mut s = send_op(dest, payload.clone(), k as u64);
        s.tag = Some(k as u64);
        if let Err((e, _)) = sim.send(0, s) {
            panic!("send: {e}");
        }
    }
    assert!(sim.run());
    let r = sim.take_events(1);
    let s = sim.take_events(0);
    assert_eq!((r.len(), s.len()), (n, n));
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    targets = message_rate, direct_rate, throughput
}
fn main() {
    if let Ok(spec) = std::env::var("EFA_ENGINE_PROFILE") {
        return profile(&spec);
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
