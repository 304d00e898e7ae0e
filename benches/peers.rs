//! Peer scaling: message rate and latency of `Endpoint<Rdm>` with 1, 16 and 256 peers on the
//! loopback device (in-process, no system calls, one thread drives every endpoint).
//!
//! * `peers_fanout/N`: one endpoint (the hub) sends 64-byte messages to N peers round-robin;
//! * `peers_fanin/N`: N peers send 64-byte messages to the hub, round-robin;
//! * `peers_pingpong_one_way/N`: the hub ping-pongs 64 bytes with the N peers in turn.
//!
//! The N peers share one completion queue (as N endpoints of one process would), so polling it
//! drives all of them; the hub has its own. The device gets 256 receive buffers per queue pair
//! (instead of 4096) so that 257 endpoints fit in memory.

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::fault::FaultConfig;
use efa::{
    AddressVector, Completion, CompletionFlags, CompletionQueue, Config, Domain, Endpoint,
    ErrorKind, PeerId, Rdm,
};

const SIZE: usize = 64;
/// Messages per iteration of the rate benches.
const BATCH: usize = 2048;
/// Most sends outstanding per sender.
const WINDOW: usize = 256;

struct Star {
    hub: Endpoint<Rdm>,
    hub_cq: CompletionQueue,
    peers: Vec<Endpoint<Rdm>>,
    peers_cq: CompletionQueue,
    /// The hub's id of each peer.
    to_peer: Vec<PeerId>,
    /// The peers' id of the hub (one shared address vector).
    to_hub: PeerId,
}

fn star(n: usize) -> Star {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = LoopbackDevice::open(&net, LoopbackConfig::default().with_max_recv_wr(256)).unwrap();
    let d = Domain::with_device(dev, Config::default());
    let hub_cq = CompletionQueue::new(&d, 1 << 16).unwrap();
    let hub_av = AddressVector::new(&d);
    let hub = Endpoint::<Rdm>::builder(&d)
        .cq(&hub_cq)
        .av(&hub_av)
        .build()
        .unwrap();
    let peers_cq = CompletionQueue::new(&d, 1 << 16).unwrap();
    let peers_av = AddressVector::new(&d);
    let peers: Vec<_> = (0..n)
        .map(|_| {
            Endpoint::<Rdm>::builder(&d)
                .cq(&peers_cq)
                .av(&peers_av)
                .build()
                .unwrap()
        })
        .collect();
    let to_peer = peers
        .iter()
        .map(|p| hub_av.insert(p.addr()).unwrap())
        .collect();
    let to_hub = peers_av.insert(hub.addr()).unwrap();
    Star {
        hub,
        hub_cq,
        peers,
        peers_cq,
        to_peer,
        to_hub,
    }
}

/// Completions of `cq` polled once: (sends, receives).
fn reap(cq: &CompletionQueue, out: &mut Vec<Completion>) -> (usize, usize) {
    out.clear();
    cq.poll(out, 1024).unwrap();
    let recvs = out
        .iter()
        .filter(|c| c.flags.contains(CompletionFlags::RECV))
        .count();
    (out.len() - recvs, recvs)
}

/// The hub sends `BATCH` messages to the peers round-robin.
fn fanout(s: &Star, out: &mut Vec<Completion>) {
    let n = s.peers.len();
    let msg = Bytes::from(vec![7u8; SIZE]);
    let (mut sent, mut posted, mut done, mut recvd) = (0, 0, 0, 0);
    while done < BATCH || recvd < BATCH {
        while sent < BATCH && sent - done < WINDOW {
            // Each message's receive is posted just before it is sent.
            if posted == sent {
                s.peers[sent % n]
                    .recv(BytesMut::with_capacity(SIZE), 0)
                    .unwrap();
                posted += 1;
            }
            match s.hub.send(s.to_peer[sent % n], msg.clone(), 0) {
                Ok(()) => sent += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => panic!("{e}"),
            }
        }
        done += reap(&s.hub_cq, out).0;
        recvd += reap(&s.peers_cq, out).1;
    }
}

/// The peers send `BATCH` messages to the hub, round-robin.
fn fanin(s: &Star, out: &mut Vec<Completion>) {
    let n = s.peers.len();
    let msg = Bytes::from(vec![7u8; SIZE]);
    let (mut sent, mut posted, mut done, mut recvd) = (0, 0, 0, 0);
    while done < BATCH || recvd < BATCH {
        while sent < BATCH && sent - done < WINDOW {
            if posted == sent {
                s.hub.recv(BytesMut::with_capacity(SIZE), 0).unwrap();
                posted += 1;
            }
            match s.peers[sent % n].send(s.to_hub, msg.clone(), 0) {
                Ok(()) => sent += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => panic!("{e}"),
            }
        }
        done += reap(&s.peers_cq, out).0;
        recvd += reap(&s.hub_cq, out).1;
    }
}

fn wait_recv(cq: &CompletionQueue, out: &mut Vec<Completion>) {
    while reap(cq, out).1 == 0 {}
}

/// `iters` round trips, each with the next peer; returns the elapsed time.
fn pingpong(s: &Star, iters: u64, out: &mut Vec<Completion>) -> Duration {
    let n = s.peers.len();
    let msg = Bytes::from(vec![1u8; SIZE]);
    let start = Instant::now();
    for i in 0..iters as usize {
        let k = i % n;
        s.peers[k].recv(BytesMut::with_capacity(SIZE), 0).unwrap();
        s.hub.recv(BytesMut::with_capacity(SIZE), 0).unwrap();
        s.hub.send(s.to_peer[k], msg.clone(), 0).unwrap();
        wait_recv(&s.peers_cq, out);
        s.peers[k].send(s.to_hub, msg.clone(), 0).unwrap();
        wait_recv(&s.hub_cq, out);
    }
    let t = start.elapsed();
    for _ in 0..4 {
        reap(&s.hub_cq, out);
        reap(&s.peers_cq, out);
    }
    t
}

fn benches(c: &mut Criterion) {
    let mut out = Vec::with_capacity(1024);
    for (name, f) in [
        ("peers_fanout", fanout as fn(&Star, &mut Vec<Completion>)),
        ("peers_fanin", fanin),
    ] {
        let mut g = c.benchmark_group(name);
        g.sample_size(10)
            .measurement_time(Duration::from_secs(3))
            .warm_up_time(Duration::from_millis(500))
            .throughput(Throughput::Elements(BATCH as u64));
        for n in [1usize, 16, 256] {
            let s = star(n);
            g.bench_function(format!("{n}"), |b| b.iter(|| f(&s, &mut out)));
        }
        g.finish();
    }
    let mut g = c.benchmark_group("peers_pingpong_one_way");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500));
    for n in [1usize, 16, 256] {
        let s = star(n);
        g.bench_function(format!("{n}"), |b| {
            b.iter_custom(|iters| pingpong(&s, iters, &mut out) / 2)
        });
    }
    g.finish();
}

criterion_group!(peers, benches);
criterion_main!(peers);
