//! Hostile input for the protocol engine: seeded random byte strings and mutated valid packets
//! (built with the codec) from known and unknown sources. Nothing may panic, the drop counters
//! must move, and afterwards the engine still serves a normal peer.

use std::time::Duration;

use bytes::Bytes;
use efa::RawAddr;
use efa::device::Source;
use efa::fault::{Rng, test_seed};
use efa::proto::engine::{EngineLimits, Event, RecvOp};
use efa::proto::sim::{Sim, SimConfig, pattern, recv_op, send_op};
use efa::proto::wire::{ExtraInfo, Handshake, IovList, Packet, ReqOpt, RtaKind, Sender};

fn src(a: RawAddr) -> Source {
    Source {
        gid: a.gid,
        qpn: a.qpn,
    }
}

/// A valid packet of a random type, as `from` would send it (or claiming another sender).
fn valid_packet(rng: &mut Rng, from: RawAddr) -> Vec<u8> {
    let sender = match rng.below(4) {
        0 => Sender::RawAddr(from),
        1 => Sender::RawAddr(RawAddr::new(from.gid, from.qpn, rng.next_u64() as u32)),
        2 => Sender::None,
        _ => Sender::Connid(from.qkey),
    };
    let opt = ReqOpt {
        sender,
        cq_data: rng.chance(0.3).then(|| rng.next_u64()),
    };
    let msg_id = if rng.chance(0.8) {
        rng.below(40) as u32
    } else {
        rng.next_u64() as u32
    };
    let tag = rng.chance(0.5).then(|| rng.below(8));
    let small = |rng: &mut Rng| rng.below(64) as u32;
    let len = |rng: &mut Rng| {
        if rng.chance(0.8) {
            rng.below(200_000)
        } else {
            rng.next_u64()
        }
    };
    let connid = if rng.chance(0.8) {
        Some(from.qkey)
    } else {
        Some(rng.next_u64() as u32)
    };
    let data = pattern(rng.next_u64(), rng.below(2000) as usize);
    let pkt = match rng.below(12) {
        0 => Packet::EagerRtm {
            opt,
            msg_id,
            tag,
            dc_send_id: rng.chance(0.3).then(|| small(rng)),
        },
        1 | 2 => Packet::MediumRtm {
            opt,
            msg_id,
            msg_length: len(rng),
            seg_offset: if rng.chance(0.5) {
                rng.below(4) * 1000
            } else {
                len(rng)
            },
            tag,
            dc_send_id: rng.chance(0.3).then(|| small(rng)),
        },
        3 => Packet::LongCtsRtm {
            opt,
            msg_id,
            msg_length: len(rng),
            send_id: small(rng),
            credit_request: 32,
            tag,
            dc: rng.chance(0.3),
            read_nack: rng.chance(0.1),
        },
        4 => Packet::Cts {
            connid,
            send_id: small(rng),
            recv_id: small(rng),
            recv_length: if rng.chance(0.2) { 0 } else { len(rng) },
            read_req: rng.chance(0.1),
        },
        5 | 6 => {
            let n = data.len() as u64;
            let p = Packet::CtsData {
                connid,
                recv_id: small(rng),
                seg_length: n,
                seg_offset: rng.below(300_000),
            };
            return p.to_vec(&data).unwrap_or_default();
        }
        7 => Packet::Receipt {
            connid,
            send_id: small(rng),
            msg_id,
        },
        8 => Packet::Handshake(Handshake {
            extra_info: ExtraInfo::from_words(
                &[rng.next_u64(), rng.next_u64()][..rng.below(3) as usize],
            ),
            connid,
            host_id: rng.chance(0.5).then(|| rng.next_u64()),
            device_version: rng.chance(0.5).then_some(0xefa1),
            user_recv_qp: None,
            p2p: Some(rng.chance(0.5)),
        }),
        9 => Packet::Rta {
            opt,
            kind: RtaKind::Write,
            msg_id,
            atomic_datatype: 1,
            atomic_op: 1,
            rma_iov: IovList::EMPTY,
        },
        10 => Packet::EagerRtw {
            opt,
            dc_send_id: None,
            rma_iov: IovList::EMPTY,
        },
        _ => Packet::Eor {
            connid,
            send_id: small(rng),
            recv_id: small(rng),
        },
    };
    pkt.to_vec(&data).unwrap_or_default()
}

fn mutate(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    if b.is_empty() {
        return b;
    }
    if rng.chance(0.5) {
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(b.len() as u64) as usize;
            b[i] ^= 1 << rng.below(8);
        }
    }
    if rng.chance(0.2) {
        b.truncate(rng.below(b.len() as u64 + 1) as usize);
    }
    if rng.chance(0.1) {
        let n = rng.below(64) as usize;
        b.extend((0..n).map(|_| rng.next_u64() as u8));
    }
    if rng.chance(0.05) && !b.is_empty() {
        b[0] = rng.next_u64() as u8;
    }
    b
}

fn random_bytes(rng: &mut Rng) -> Vec<u8> {
    let n = if rng.chance(0.9) {
        rng.below(80)
    } else {
        rng.below(9000)
    } as usize;
    let mut b: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
    if b.len() >= 2 && rng.chance(0.5) {
        // A plausible base header, to get past the first checks.
        b[0] = [3, 4, 9, 10, 64, 65, 66, 67, 68, 69, 133, 135, 137][rng.below(13) as usize];
        b[1] = 4;
    }
    b
}

/// Checks that `a` and `b` still exchange messages both ways (directed receives, so that
/// forged unexpected messages cannot take them).
fn exchange_works(sim: &mut Sim, a: usize, b: usize, seed: u64) {
    let (aa, ab) = (sim.addr(a), sim.addr(b));
    for (from, to, to_addr, from_addr, ctx) in [(a, b, ab, aa, 900_001u64), (b, a, aa, ab, 900_002)]
    {
        for (k, len) in [10usize, 30_000, 200_000].into_iter().enumerate() {
            let mut r: RecvOp = recv_op(len, ctx + 10 * k as u64);
            r.src = Some(from_addr);
            r.tag = Some((0xabc0 + k as u64, 0));
            sim.post_recv(to, r).unwrap();
            let mut s = send_op(to_addr, pattern(ctx + k as u64, len), ctx + 10 * k as u64);
            s.tag = Some(0xabc0 + k as u64);
            sim.send(from, s).unwrap();
        }
    }
    assert!(sim.run(), "seed {seed}");
    for i in [a, b] {
        let evs = sim.take_events(i);
        let mut sends = 0;
        let mut recvs = 0;
        for e in evs {
            match e {
                Event::Send(s) if s.context >= 900_000 => {
                    assert!(
                        s.error.is_none(),
                        "seed {seed}: node {i} send {}: {:?}",
                        s.context,
                        s.error
                    );
                    sends += 1;
                }
                Event::Recv(r) if r.context >= 900_000 => {
                    assert!(
                        r.error.is_none(),
                        "seed {seed}: node {i} recv {}: {:?}",
                        r.context,
                        r.error
                    );
                    let k = (r.context % 100) / 10;
                    let base = r.context - 10 * k;
                    assert!(
                        r.buf[..] == pattern(base + k, r.len)[..],
                        "seed {seed}: node {i}: bytes differ"
                    );
                    recvs += 1;
                }
                _ => {}
            }
        }
        assert_eq!((sends, recvs), (3, 3), "seed {seed}: node {i}");
    }
}

#[test]
fn hostile_packets_never_panic_and_a_normal_peer_still_works() {
    let base = test_seed();
    for round in 0..3u64 {
        let seed = base.wrapping_add(round);
        // Shown with the failure, also when the engine itself panics.
        eprintln!("seed {seed}");
        let mut rng = Rng::new(seed);
        let mut cfg = SimConfig::clean(seed);
        cfg.engine.rx_stall_timeout = Duration::from_millis(50);
        let mut sim = Sim::new(cfg, 3);
        let limits = EngineLimits {
            max_peers: 64,
            max_buffered_msgs: 500,
            max_buffered_bytes: 1 << 20,
        };
        for i in 0..3 {
            sim.engine(i).set_limits(limits);
        }
        let (a0, a1) = (sim.addr(0), sim.addr(1));
        // Peers 0 and 1 know each other (handshakes done); 2 is the normal peer checked at the
        // end. Traffic between 0 and 1 runs while the forged packets arrive.
        exchange_works(&mut sim, 0, 1, seed);
        for k in 0..20u64 {
            sim.post_recv(1, recv_op(100_000, k)).unwrap();
            sim.send(0, send_op(a1, pattern(k, (k as usize * 7919) % 90_000), k))
                .unwrap();
        }
        let before: Vec<u64> = (0..3).map(|i| sim.engine(i).stats().dropped_pkts).collect();
        // `EFA_FUZZ_ITERS` runs longer (e.g. in release builds).
        let n: u64 = std::env::var("EFA_FUZZ_ITERS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7000);
        for k in 0..n {
            // Target 1 (a receiver) or 0 (a sender), from the other one or from nowhere.
            let (to, from) = if rng.chance(0.7) { (1, a0) } else { (0, a1) };
            let from = if rng.chance(0.2) {
                RawAddr::new(
                    std::net::Ipv4Addr::new(192, 168, 0, rng.below(4) as u8).into(),
                    rng.below(3) as u16,
                    7,
                )
            } else {
                from
            };
            let bytes = match rng.below(3) {
                0 => random_bytes(&mut rng),
                1 => valid_packet(&mut rng, from),
                _ => {
                    let p = valid_packet(&mut rng, from);
                    mutate(&mut rng, p)
                }
            };
            sim.inject(to, src(from), &bytes);
            if k % 50 == 0 {
                sim.run_for(Duration::from_micros(rng.below(100)));
            }
            let r = sim.engine(1).resources();
            assert!(
                r.unexpected_bytes <= limits.max_buffered_bytes,
                "seed {seed}: {r:?}"
            );
            assert!(r.peers <= limits.max_peers, "seed {seed}: {r:?}");
        }
        assert!(sim.run(), "seed {seed}");
        for (i, b) in before.iter().enumerate().take(2) {
            let d = sim.engine(i).stats().dropped_pkts - b;
            assert!(d > 100, "seed {seed}: node {i} dropped only {d} packets");
        }
        // The traffic between 0 and 1 may have been disturbed by forged packets carrying 0's
        // connid, but every operation completed exactly once.
        let evs = sim.take_events(0);
        let mut done = vec![0; 20];
        for e in evs {
            if let Event::Send(s) = e {
                done[s.context as usize] += 1;
            }
        }
        assert!(done.iter().all(|&d| d <= 1), "seed {seed}: {done:?}");
        sim.take_events(1);
        // A normal peer still gets through, both ways, with every protocol.
        exchange_works(&mut sim, 2, 1, seed);
        exchange_works(&mut sim, 2, 0, seed);
        eprintln!("seed {seed}: node 1 {:?}", sim.engine(1).stats());
    }
}

#[test]
fn malformed_bytes_from_nowhere_are_counted() {
    let seed = test_seed();
    eprintln!("seed {seed}");
    let mut rng = Rng::new(seed);
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let stranger = Source {
        gid: std::net::Ipv4Addr::new(172, 16, 0, 1).into(),
        qpn: 9,
    };
    for _ in 0..3000 {
        let b = random_bytes(&mut rng);
        sim.inject(0, stranger, &b);
    }
    assert!(
        sim.engine(0).stats().dropped_pkts >= 2900,
        "seed {seed}: {:?}",
        sim.engine(0).stats()
    );
    // Truncations of every valid packet.
    let me = sim.addr(1);
    let mut count = 0;
    for _ in 0..300 {
        let p = valid_packet(&mut rng, me);
        for cut in 0..p.len().min(64) {
            sim.inject(0, stranger, &p[..cut]);
            count += 1;
        }
    }
    assert!(count > 0);
    assert!(sim.run());
    exchange_works(&mut sim, 0, 1, seed);
    let _ = Bytes::new();
}
