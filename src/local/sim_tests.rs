//! The same-host path driven by the simulator: in-memory rings, virtual time, seeded faults.

use std::time::Duration;

use bytes::Bytes;

use super::mem::{MemHost, SimLocal, slot_src};
use super::ring::{K_MSG, K_NEXT, SlotHdr};
use crate::device::Status;
use crate::error::ErrorKind;
use crate::fault::{Rng, test_seed};
use crate::proto::engine::{EngineLimits, Event, RecvDone, SendDone};
use crate::proto::sim::{Sim, SimConfig, pattern, recv_op, send_op};

/// Nodes 0 and 1 share a host (in-memory rings of `slots` slots of `chunk` bytes); node 2 is
/// remote (the simulated network only).
fn sim(cfg: SimConfig, slots: usize, chunk: usize) -> (Sim, MemHost, Vec<SimLocalStats>) {
    let mut sim = Sim::new(cfg.clone(), 3);
    let host = MemHost::new(slots, chunk, cfg.seed ^ 0x10ca1);
    let mut stats = Vec::new();
    for i in 0..2 {
        let l = SimLocal::new(&host, &sim.addr(i), 1024);
        stats.push(l.stats());
        sim.attach(i, Box::new(l));
    }
    (sim, host, stats)
}

type SimLocalStats = std::sync::Arc<parking_lot::Mutex<super::LocalStats>>;

/// The send and the receive completions among `events`.
fn split(events: &[Event]) -> (Vec<&SendDone>, Vec<&RecvDone>) {
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    for e in events {
        match e {
            Event::Send(s) => sends.push(s),
            Event::Recv(r) => recvs.push(r),
            _ => {}
        }
    }
    (sends, recvs)
}

fn sends(events: &[Event]) -> Vec<&SendDone> {
    split(events).0
}

fn recvs(events: &[Event]) -> Vec<&RecvDone> {
    split(events).1
}

/// Random traffic from a same-host peer and a remote one, with receives posted before and
/// after, delivery complete on some sends, pushes refused at random (the ring "full"), the
/// receiver's memory bounds small (chunks wait in the ring) and a faulty network: every
/// message arrives intact, exactly once, matched in order per sender; every send completes once; and
/// the same-host messages never touch the network.
#[test]
fn random_traffic_through_rings_and_network_arrives_once_in_order() {
    for round in 0..4 {
        let seed = test_seed().wrapping_add(round);
        let mut rng = Rng::new(seed);
        let (mut s, host, stats) = sim(SimConfig::faulty(seed), 8, 4096);
        s.time_limit = Duration::from_secs(30);
        host.refuse_pushes(200);
        s.engine(1).set_limits(EngineLimits {
            max_buffered_msgs: 4,
            max_buffered_bytes: 48 << 10,
            ..EngineLimits::default()
        });
        let dest = s.addr(1);
        let n = 60;
        let mut expect = [Vec::new(), Vec::new(), Vec::new()];
        let mut early = 0;
        for k in 0..n {
            if rng.chance(0.3) {
                s.post_recv(1, recv_op(64 << 10, 10_000 + early)).unwrap();
                early += 1;
            }
            let from = if rng.chance(0.7) { 0 } else { 2 };
            let len = rng.below(40_000) as usize;
            let data = pattern(seed ^ k, len);
            let mut op = send_op(dest, data.clone(), k);
            op.delivery_complete = rng.chance(0.25);
            s.send(from, op).unwrap();
            expect[from].push(data);
            if rng.chance(0.2) {
                s.run_for(Duration::from_micros(rng.below(200)));
            }
        }
        // Sends wait for room while the receiver's bounds hold chunks back: the path's timers
        // keep running, so the simulation is not quiescent until receives come.
        s.run_for(Duration::from_millis(20));
        for k in early..n {
            s.post_recv(1, recv_op(64 << 10, 10_000 + k)).unwrap();
        }
        assert!(s.run(), "seed {seed}: did not settle");
        let ev1 = s.take_events(1);
        // Completions come as messages complete (a long one after a short one matched behind
        // it); the receives were posted in order, so their contexts give the matching order.
        let mut got = recvs(&ev1);
        got.sort_by_key(|r| r.context);
        assert_eq!(got.len(), n as usize, "seed {seed}: every message once");
        for from in [0, 2] {
            let src = s.addr(from);
            let bufs: Vec<Bytes> = got
                .iter()
                .filter(|r| r.src == Some(src))
                .map(|r| {
                    assert!(r.error.is_none(), "seed {seed}: {:?}", r.error);
                    Bytes::copy_from_slice(&r.buf[..r.len])
                })
                .collect();
            if bufs != expect[from] {
                let lens = |v: &[Bytes]| v.iter().map(Bytes::len).collect::<Vec<_>>();
                let pos: Vec<Option<usize>> = bufs
                    .iter()
                    .map(|b| expect[from].iter().position(|e| e == b))
                    .collect();
                panic!(
                    "seed {seed}: node {from}'s messages intact, in order: got {:?} (at {pos:?}), sent {:?}",
                    lens(&bufs),
                    lens(&expect[from])
                );
            }
        }
        for from in [0, 2] {
            let ev = s.take_events(from);
            let done = sends(&ev);
            let mut ctx: Vec<u64> = done.iter().map(|d| d.context).collect();
            ctx.sort_unstable();
            ctx.dedup();
            assert_eq!(
                ctx.len(),
                done.len(),
                "seed {seed}: one completion per send"
            );
            assert_eq!(
                done.len(),
                expect[from].len(),
                "seed {seed}: node {from}'s sends"
            );
            assert!(done.iter().all(|d| d.error.is_none()), "seed {seed}");
        }
        let local = expect[0].len() as u64;
        assert_eq!(stats[0].lock().tx_msgs, local, "seed {seed}");
        assert_eq!(s.engine(1).stats().local_rx_msgs, local, "seed {seed}");
        assert_eq!(
            s.engine(0).stats().tx_msgs,
            0,
            "seed {seed}: node 0's messages went through the rings"
        );
        assert_eq!(stats[1].lock().dropped, 0, "seed {seed}");
    }
}

/// A receiver that stops polling and dies: the sends waiting for it fail once, with
/// `UnresponsiveRemote`, within a few virtual milliseconds (the path's liveness checks), and
/// a later send fails at once.
#[test]
fn sends_to_a_peer_that_dies_fail_in_virtual_time() {
    let seed = test_seed();
    let (mut s, host, _) = sim(SimConfig::clean(seed), 4, 1024);
    let dest = s.addr(1);
    s.freeze(1, true);
    for k in 0..3 {
        s.send(0, send_op(dest, pattern(k, 3000), k)).unwrap();
    }
    s.run_for(Duration::from_millis(50));
    assert!(
        s.take_events(0).is_empty(),
        "seed {seed}: nothing completes while it lives"
    );
    host.kill(&dest);
    let start = s.elapsed();
    assert!(s.run_until(|s| s.node(0).events.len() >= 3), "seed {seed}");
    let waited = s.elapsed() - start;
    assert!(
        waited < Duration::from_millis(200),
        "seed {seed}: took {waited:?}"
    );
    s.send(0, send_op(dest, pattern(9, 10), 9)).unwrap();
    assert!(s.run(), "seed {seed}");
    let ev = s.take_events(0);
    let done = sends(&ev);
    assert_eq!(done.len(), 4, "seed {seed}: {done:?}");
    for d in done {
        assert_eq!(d.status, Some(Status::UnresponsiveRemote), "seed {seed}");
    }
}

/// A sender that dies in the middle of a message: the receive it matched fails with
/// `ConnectionAborted` (not after the engine's stall timeout), and the receiver goes on.
#[test]
fn a_sender_dying_mid_message_aborts_its_receive() {
    let seed = test_seed();
    let (mut s, host, _) = sim(SimConfig::clean(seed), 4, 1024);
    let (a, b) = (s.addr(0), s.addr(1));
    s.post_recv(1, recv_op(16 << 10, 7)).unwrap();
    s.send(0, send_op(b, pattern(1, 10_000), 1)).unwrap();
    s.freeze(0, true);
    s.run_for(Duration::from_millis(1));
    host.kill(&a);
    assert!(s.run_until(|s| !s.node(1).events.is_empty()), "seed {seed}");
    assert!(
        s.elapsed() < Duration::from_secs(1),
        "seed {seed}: {:?}",
        s.elapsed()
    );
    let ev = s.take_events(1);
    let r = recvs(&ev);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::ConnectionAborted),
        "seed {seed}"
    );
}

/// A slot reserved and never published (its producer died between the two steps) blocks the
/// ring for 5 virtual seconds; then it is skipped and counted, and the message behind it
/// arrives intact.
#[test]
fn a_slot_reserved_and_never_published_is_skipped() {
    let seed = test_seed();
    let (mut s, host, stats) = sim(SimConfig::clean(seed), 8, 1024);
    let b = s.addr(1);
    host.reserve_stuck(&b);
    s.post_recv(1, recv_op(64, 7)).unwrap();
    s.send(0, send_op(b, Bytes::from_static(b"behind the hole"), 1))
        .unwrap();
    assert!(s.run_until(|s| !s.node(1).events.is_empty()), "seed {seed}");
    assert!(
        s.elapsed() >= super::STUCK_SLOT && s.elapsed() < super::STUCK_SLOT * 2,
        "seed {seed}: {:?}",
        s.elapsed()
    );
    let ev = s.take_events(1);
    let r = recvs(&ev);
    assert_eq!(&r[0].buf[..r[0].len], b"behind the hole", "seed {seed}");
    assert_eq!(stats[1].lock().dropped, 1, "seed {seed}");
}

/// Slots a hostile peer plants — an unknown kind, a further chunk of no message, a length
/// beyond the slot, a sender that is no address — are dropped and counted; real traffic
/// behind them arrives intact.
#[test]
fn planted_slots_are_dropped_and_counted() {
    let seed = test_seed();
    let (mut s, host, stats) = sim(SimConfig::clean(seed), 8, 1024);
    let (a, b) = (s.addr(0), s.addr(1));
    let hdr = |kind, len, word| SlotHdr {
        kind,
        flags: 0,
        len,
        tag: 0,
        word,
        data: 0,
        token: 0,
    };
    host.plant(&b, hdr(9, 3, 3), slot_src(&a), b"abc");
    host.plant(&b, hdr(K_NEXT, 3, 100), slot_src(&a), b"abc");
    host.plant(&b, hdr(K_MSG, 4096, 4096), slot_src(&a), b"short");
    host.plant(&b, hdr(K_MSG, 3, 3), [0xff; 24], b"abc");
    s.post_recv(1, recv_op(64, 7)).unwrap();
    s.send(0, send_op(b, Bytes::from_static(b"real"), 1))
        .unwrap();
    assert!(s.run(), "seed {seed}");
    let ev = s.take_events(1);
    let r = recvs(&ev);
    assert_eq!(r.len(), 1, "seed {seed}: {r:?}");
    assert_eq!(&r[0].buf[..r[0].len], b"real", "seed {seed}");
    assert_eq!(stats[1].lock().dropped, 4, "seed {seed}");
}

/// The route to a peer is chosen once for the endpoint's life: a peer found remote stays
/// remote even when a channel of its address appears later and however many other peers were
/// looked up since (the path used to forget "remote" answers after 65 536 of them, so a peer
/// could switch paths mid-stream and a message overtake the ones before it; issue 30, point 14).
#[test]
fn a_route_once_chosen_never_changes() {
    use std::net::Ipv4Addr;
    use std::time::Instant;

    use crate::addr::{Gid, RawAddr};
    use crate::proto::engine::Engine;

    let host = MemHost::new(4, 1024, 1);
    let at = |i: u32| RawAddr::new(Gid::from(Ipv4Addr::from(0x0a00_0000 + i)), 1000, 7);
    let (me, peer) = (at(1), at(2));
    let mut path = super::LocalPath::new(host.channels(&me), &me, 16);
    let mut engine = Engine::new(SimConfig::default_engine(), me, Instant::now());
    assert_eq!(
        path.route(&mut engine, &peer),
        None,
        "no channel yet: remote"
    );
    let _later = host.channels(&peer);
    for i in 0..(1 << 16) + 10 {
        assert_eq!(path.route(&mut engine, &at(1000 + i)), None);
    }
    assert_eq!(path.route(&mut engine, &peer), None, "still remote");
    // A new path finds the channel.
    let other = at(3);
    let mut fresh = super::LocalPath::new(host.channels(&other), &other, 16);
    let mut engine = Engine::new(SimConfig::default_engine(), other, Instant::now());
    assert!(fresh.route(&mut engine, &peer).is_some());
}
