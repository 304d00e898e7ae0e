//! The protocol engine in the simulator.

use bytes::Bytes;
use efa::RawAddr;
use efa::proto::engine::{Event, RecvDone, RecvOp, SendDone, SendOp};
use efa::proto::sim::{Sim, SimConfig, pattern, recv_op, send_op};

fn sop(dest: RawAddr, buf: Bytes, context: u64) -> SendOp {
    send_op(dest, buf, context)
}

fn rop(cap: usize, context: u64) -> RecvOp {
    recv_op(cap, context)
}

fn split(events: Vec<Event>) -> (Vec<SendDone>, Vec<RecvDone>) {
    let mut s = Vec::new();
    let mut r = Vec::new();
    for e in events {
        match e {
            Event::Send(x) => s.push(x),
            Event::Recv(x) => r.push(x),
        }
    }
    (s, r)
}

#[test]
fn smoke_sizes() {
    let seed = efa::fault::test_seed();
    for (k, len) in [0usize, 1, 100, 8000, 8200, 30_000, 65_536, 70_000, 1 << 20]
        .into_iter()
        .enumerate()
    {
        for dc in [false, true] {
            let mut sim = Sim::new(SimConfig::clean(seed), 2);
            let data = pattern(k as u64, len);
            sim.post_recv(1, rop(len, 5)).unwrap();
            let mut op = sop(sim.addr(1), data.clone(), 9);
            op.delivery_complete = dc;
            sim.send(0, op).unwrap();
            assert!(sim.run(), "seed {seed} len {len}");
            let (s, _) = split(sim.take_events(0));
            let (_, r) = split(sim.take_events(1));
            assert_eq!(s.len(), 1, "seed {seed} len {len} dc {dc}");
            assert!(
                s[0].error.is_none(),
                "seed {seed} len {len}: {:?}",
                s[0].error
            );
            assert_eq!(r.len(), 1, "seed {seed} len {len} dc {dc}");
            assert!(
                r[0].error.is_none(),
                "seed {seed} len {len}: {:?}",
                r[0].error
            );
            assert_eq!(r[0].len, len);
            assert!(r[0].buf[..] == data[..], "seed {seed} len {len}");
            assert_eq!(r[0].src, Some(sim.addr(0)));
            for i in 0..2 {
                let res = sim.engine(i).resources();
                assert_eq!(
                    res,
                    efa::proto::engine::Resources {
                        peers: 1,
                        ..Default::default()
                    },
                    "seed {seed} len {len} node {i}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Random message mixes under faults.

use efa::fault::Rng;
use efa::proto::engine::Resources;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Largest untagged message in the mixes (untagged receives are interchangeable, so each has
/// this capacity); larger messages are tagged and get a receive of their own size.
const UNTAGGED_MAX: usize = 150_000;

#[derive(Debug)]
struct Msg {
    src: usize,
    dst: usize,
    data: Bytes,
    tag: Option<u64>,
    cq: Option<u32>,
    dc: bool,
}

#[derive(Clone, Copy, Debug)]
enum RecvKind {
    /// Untagged from any source.
    Any,
    /// The tagged messages of sender `s` (by tag bits or by source), expecting message `msg`.
    Tagged {
        s: usize,
        msg: usize,
        directed: bool,
    },
}

fn draw_size(rng: &mut Rng) -> usize {
    let p = rng.below(1000);
    let (lo, hi) = match p {
        0..=549 => (0, 256),
        550..=749 => (257, 4096),
        750..=869 => (4097, 9000),
        870..=959 => (9001, 65_536),
        _ => (65_537, UNTAGGED_MAX),
    };
    lo + rng.below((hi - lo + 1) as u64) as usize
}

fn baseline(sim: &mut Sim, seed: u64) {
    for i in 0..sim.len() {
        if !sim.node(i).alive {
            continue;
        }
        let r = sim.engine(i).resources();
        assert_eq!(
            r,
            Resources {
                peers: r.peers,
                ..Default::default()
            },
            "seed {seed}: node {i} holds resources"
        );
    }
}

/// Sends `n_msgs` random messages (plus `n_big` multi-MiB ones) over `pairs` and checks
/// exactly-once, intact, ordered delivery and that every operation completes once.
fn run_mix(
    seed: u64,
    cfg: SimConfig,
    nodes: usize,
    pairs: &[(usize, usize)],
    n_msgs: usize,
    n_big: usize,
) -> Sim {
    let mut rng = Rng::new(seed ^ 0xa11ce);
    let mut msgs: Vec<Msg> = Vec::new();
    for _ in 0..n_msgs {
        let (src, dst) = pairs[rng.below(pairs.len() as u64) as usize];
        let len = draw_size(&mut rng);
        let tag = rng
            .chance(0.4)
            .then(|| ((src as u64) << 32) | rng.below(1 << 32));
        let cq = rng.chance(0.3).then(|| rng.next_u64() as u32);
        let dc = rng.chance(0.25);
        msgs.push(Msg {
            src,
            dst,
            data: Bytes::new(),
            tag,
            cq,
            dc,
        });
        let k = msgs.len() as u64;
        msgs.last_mut().unwrap().data = pattern(seed ^ (k << 20), len);
    }
    for b in 0..n_big {
        let (src, dst) = pairs[rng.below(pairs.len() as u64) as usize];
        let len = (1 << 20) + rng.below(3 << 20) as usize;
        let at = rng.below(msgs.len() as u64 + 1) as usize;
        let tag = Some(((src as u64) << 32) | 0xb16);
        let m = Msg {
            src,
            dst,
            data: pattern(seed ^ 0xb16 ^ b as u64, len),
            tag,
            cq: None,
            dc: rng.chance(0.5),
        };
        msgs.insert(at, m);
    }

    let mut sim = Sim::new(cfg, nodes);
    let addrs: Vec<RawAddr> = (0..nodes).map(|i| sim.addr(i)).collect();
    let mut sendq: Vec<VecDeque<usize>> = vec![VecDeque::new(); nodes];
    let mut recvq: Vec<VecDeque<(u64, RecvOp)>> = (0..nodes).map(|_| VecDeque::new()).collect();
    let mut recv_kind: Vec<HashMap<u64, RecvKind>> = vec![HashMap::new(); nodes];
    for (k, m) in msgs.iter().enumerate() {
        sendq[m.src].push_back(k);
        let ctx = 1_000_000 + recvq[m.dst].len() as u64;
        let (kind, op) = match m.tag {
            None => (RecvKind::Any, rop(UNTAGGED_MAX, ctx)),
            Some(_) => {
                let directed = rng.chance(0.5);
                let mut op = rop(m.data.len() + rng.below(16) as usize, ctx);
                if directed {
                    op.src = Some(addrs[m.src]);
                    op.tag = Some((0, u64::MAX));
                } else {
                    op.tag = Some(((m.src as u64) << 32, 0xffff_ffff));
                }
                (
                    RecvKind::Tagged {
                        s: m.src,
                        msg: k,
                        directed,
                    },
                    op,
                )
            }
        };
        recv_kind[m.dst].insert(ctx, kind);
        recvq[m.dst].push_back((ctx, op));
    }

    // Post sends and receives in random bursts while the network runs.
    loop {
        let mut left = false;
        for i in 0..nodes {
            let burst = 1 + rng.below(48);
            for _ in 0..burst {
                let Some(&k) = sendq[i].front() else { break };
                let m = &msgs[k];
                let op = SendOp {
                    dest: addrs[m.dst],
                    buf: m.data.clone(),
                    tag: m.tag,
                    data: m.cq,
                    delivery_complete: m.dc,
                    context: k as u64,
                };
                match sim.send(i, op) {
                    Ok(()) => {
                        sendq[i].pop_front();
                    }
                    Err((e, _)) => {
                        assert_eq!(e.kind(), efa::ErrorKind::Again, "seed {seed}: {e}");
                        break;
                    }
                }
            }
            if rng.chance(0.6) {
                let burst = 1 + rng.below(48);
                for _ in 0..burst {
                    let Some((ctx, op)) = recvq[i].pop_front() else {
                        break;
                    };
                    if let Err((e, op)) = sim.post_recv(i, op) {
                        assert_eq!(e.kind(), efa::ErrorKind::Again, "seed {seed}: {e}");
                        recvq[i].push_front((ctx, op));
                        break;
                    }
                }
            }
            left |= !sendq[i].is_empty() || !recvq[i].is_empty();
        }
        sim.run_for(Duration::from_micros(rng.below(300)));
        if !left {
            break;
        }
        if sim.elapsed() > Duration::from_secs(600) {
            for i in 0..nodes {
                eprintln!(
                    "node {i}: {:?} {:?} sendq {} recvq {}",
                    sim.engine(i).resources(),
                    sim.engine(i).stats(),
                    sendq[i].len(),
                    recvq[i].len()
                );
            }
            let now = sim.now();
            for i in 0..nodes {
                eprintln!(
                    "node {i}: timeout {:?} transmit {:?}",
                    sim.engine(i).poll_timeout().map(|t| t - now),
                    sim.engine(i).poll_transmit(now).map(|t| t.wr_id)
                );
            }
            panic!(
                "seed {seed}: posting never finished ({:?} virtual)",
                sim.elapsed()
            );
        }
    }
    assert!(
        sim.run(),
        "seed {seed}: not quiescent after {:?}",
        sim.elapsed()
    );

    // Senders: every operation completed once, successfully, with its buffer.
    let mut events: Vec<Vec<Event>> = (0..nodes).map(|i| sim.take_events(i)).collect();
    let mut sent_done = vec![0u32; msgs.len()];
    let mut recvs: Vec<Vec<RecvDone>> = (0..nodes).map(|_| Vec::new()).collect();
    for (i, evs) in events.iter_mut().enumerate() {
        for e in evs.drain(..) {
            match e {
                Event::Send(s) => {
                    let k = s.context as usize;
                    assert!(
                        s.error.is_none(),
                        "seed {seed}: send {k} failed: {:?}",
                        s.error
                    );
                    assert_eq!(msgs[k].src, i, "seed {seed}");
                    assert_eq!(s.len, msgs[k].data.len(), "seed {seed}");
                    assert_eq!(s.buf, msgs[k].data, "seed {seed}");
                    assert_eq!(s.tag, msgs[k].tag, "seed {seed}");
                    sent_done[k] += 1;
                }
                Event::Recv(r) => recvs[i].push(r),
            }
        }
    }
    for (k, n) in sent_done.iter().enumerate() {
        assert_eq!(
            *n,
            1,
            "seed {seed}: send {k} completed {n} times ({:?} bytes)",
            msgs[k].data.len()
        );
    }

    // Receivers: every receive once; per (sender, receiver) and queue, in send order.
    for (r, mut rs) in recvs.into_iter().enumerate() {
        rs.sort_by_key(|x| x.context);
        let expected_n = recv_kind[r].len();
        assert_eq!(
            rs.len(),
            expected_n,
            "seed {seed}: node {r} got {} of {expected_n} receives",
            rs.len()
        );
        for w in rs.windows(2) {
            assert_ne!(
                w[0].context, w[1].context,
                "seed {seed}: receive completed twice"
            );
        }
        let mut untagged: Vec<VecDeque<usize>> = vec![VecDeque::new(); nodes];
        for (k, m) in msgs.iter().enumerate() {
            if m.dst == r && m.tag.is_none() {
                untagged[m.src].push_back(k);
            }
        }
        for d in &rs {
            assert!(
                d.error.is_none(),
                "seed {seed}: receive {} failed: {:?}",
                d.context,
                d.error
            );
            let src = d.src.expect("FI_SOURCE");
            let s = addrs.iter().position(|a| *a == src).expect("known source");
            let k = match recv_kind[r][&d.context] {
                RecvKind::Any => {
                    let k = untagged[s].pop_front();
                    k.unwrap_or_else(|| {
                        panic!("seed {seed}: extra untagged message from {s} at {r}")
                    })
                }
                RecvKind::Tagged {
                    s: want,
                    msg,
                    directed,
                } => {
                    assert_eq!(
                        s, want,
                        "seed {seed}: tagged receive (directed {directed}) got a message from {s}"
                    );
                    msg
                }
            };
            let m = &msgs[k];
            assert_eq!(
                d.len,
                m.data.len(),
                "seed {seed}: message {k} {s}->{r} out of order or wrong length"
            );
            assert!(
                d.buf[..] == m.data[..],
                "seed {seed}: message {k} {s}->{r}: bytes differ"
            );
            assert_eq!(d.tag, m.tag, "seed {seed}: message {k}");
            assert_eq!(d.data, m.cq, "seed {seed}: message {k}");
            assert!(!d.multi_recv_done && d.olen == 0, "seed {seed}");
        }
        assert!(
            untagged.iter().all(|q| q.is_empty()),
            "seed {seed}: untagged messages to {r} not delivered"
        );
    }
    baseline(&mut sim, seed);
    assert_eq!(
        (sim.stats.oversize, sim.stats.over_depth),
        (0, 0),
        "seed {seed}: MTU or device depth exceeded"
    );
    sim
}

fn mix_seeds() -> Vec<u64> {
    let base = efa::fault::test_seed();
    (0..4).map(|i| base.wrapping_add(i)).collect()
}

#[test]
fn mix_three_senders_one_receiver_under_faults() {
    for seed in mix_seeds() {
        let mut cfg = SimConfig::faulty(seed);
        cfg.rx_buffers = 24;
        cfg.rx_repost_delay = Duration::from_micros(20);
        let sim = run_mix(seed, cfg, 4, &[(1, 0), (2, 0), (3, 0)], 1000, 3);
        let st = sim.stats;
        eprintln!("seed {seed}: {st:?} in {:?} virtual", sim.elapsed());
        let e = sim.node(0).engine.stats();
        eprintln!("seed {seed}: receiver {e:?}");
    }
}

#[test]
fn mix_all_to_all_under_faults() {
    for seed in mix_seeds() {
        let cfg = SimConfig::faulty(seed);
        let pairs: Vec<(usize, usize)> = (0..4)
            .flat_map(|a| (0..4).filter(move |&b| b != a).map(move |b| (a, b)))
            .collect();
        let sim = run_mix(seed, cfg, 4, &pairs, 1000, 4);
        eprintln!(
            "seed {seed}: {:?} in {:?} virtual",
            sim.stats,
            sim.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Targeted tests.

use efa::ErrorKind;
use efa::device::{Source, Status};
use efa::proto::engine::{Engine, EngineConfig};
use efa::proto::wire::{self, ExtraFeature, Handshake, Packet, ReqOpt, Sender};
use std::time::Instant;

fn src_of(a: RawAddr) -> Source {
    Source {
        gid: a.gid,
        qpn: a.qpn,
    }
}

fn recv_events(sim: &mut Sim, i: usize) -> Vec<RecvDone> {
    split(sim.take_events(i)).1
}

fn send_events(sim: &mut Sim, i: usize) -> Vec<SendDone> {
    split(sim.take_events(i)).0
}

#[test]
fn handshake_advertises_dc_and_connid_and_reqs_switch_to_connid() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    sim.set_tap(true);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    for k in 0..3 {
        sim.post_recv(1, rop(100_000, k)).unwrap();
    }
    sim.send(0, sop(a1, pattern(1, 10), 1)).unwrap();
    assert!(sim.run());
    sim.send(0, sop(a1, pattern(2, 10), 2)).unwrap();
    sim.send(0, sop(a1, pattern(3, 90_000), 3)).unwrap();
    assert!(sim.run());
    assert_eq!(recv_events(&mut sim, 1).len(), 3, "seed {seed}");
    let tap = sim.take_tap();
    let mut reqs = Vec::new();
    let mut handshakes = [0, 0];
    for d in &tap {
        let (pkt, _) = wire::decode(&d.bytes).expect("engine packets decode");
        match pkt {
            Packet::Handshake(h) => {
                handshakes[d.from] += 1;
                let feats: Vec<ExtraFeature> = h.extra_info.features().collect();
                assert_eq!(
                    feats,
                    vec![
                        ExtraFeature::DeliveryComplete,
                        ExtraFeature::RequestConnidHeader
                    ],
                    "seed {seed}"
                );
                assert_eq!(h.connid, Some(sim.addr(d.from).qkey), "seed {seed}");
            }
            Packet::CtsData { connid, .. } => assert_eq!(connid, Some(a0.qkey), "seed {seed}"),
            Packet::Cts { connid, .. } => assert_eq!(connid, Some(a1.qkey), "seed {seed}"),
            p if p.req_opt().is_some() => reqs.push(*p.req_opt().unwrap()),
            _ => {}
        }
    }
    assert_eq!(handshakes, [1, 1], "seed {seed}: one HANDSHAKE each way");
    assert_eq!(
        reqs[0].sender,
        Sender::RawAddr(a0),
        "seed {seed}: first REQ carries the raw address"
    );
    assert_eq!(
        reqs.last().unwrap().sender,
        Sender::Connid(a0.qkey),
        "seed {seed}: REQs after the handshake carry the connid"
    );
}

fn engine_cfg() -> EngineConfig {
    let mut c = SimConfig::default_engine();
    c.timeout_interval = Duration::from_millis(1);
    c.max_timeout = Duration::from_millis(3);
    c
}

fn addr(n: u8, qkey: u32) -> RawAddr {
    RawAddr::new(
        std::net::Ipv4Addr::new(10, 9, 9, n).into(),
        77 + u16::from(n),
        qkey,
    )
}

#[test]
fn ctsdata_waits_for_the_peer_handshake() {
    let now = Instant::now();
    let (a, b) = (addr(1, 0x111), addr(2, 0x222));
    let mut e = Engine::new(engine_cfg(), a, now);
    let len = 200_000;
    e.send(now, sop(b, pattern(5, len), 9)).unwrap();
    let t = e.poll_transmit(now).unwrap();
    let mut bytes = t.hdr.to_vec();
    bytes.extend_from_slice(&t.payload);
    let (
        Packet::LongCtsRtm {
            send_id,
            msg_length,
            opt,
            ..
        },
        first,
    ) = wire::decode(&bytes).unwrap()
    else {
        panic!("expected a LONGCTS RTM");
    };
    assert_eq!(msg_length, len as u64);
    assert_eq!(opt.sender, Sender::RawAddr(a));
    let first = first.len();
    e.handle_send_completion(now, t.wr_id, Status::Success);
    let cts = Packet::Cts {
        connid: Some(b.qkey),
        send_id,
        recv_id: 77,
        recv_length: 100_000,
        read_req: false,
    };
    e.handle_recv(now, src_of(b), &cts.to_vec(&[]).unwrap());
    while let Some(t) = e.poll_transmit(now) {
        let bytes = [&t.hdr[..], &t.payload[..]].concat();
        let (p, _) = wire::decode(&bytes).unwrap();
        assert!(
            matches!(p, Packet::Handshake(_)),
            "only our HANDSHAKE may go before the peer's: {p:?}"
        );
        e.handle_send_completion(now, t.wr_id, Status::Success);
    }
    let hs = Handshake {
        connid: Some(b.qkey),
        ..Default::default()
    };
    e.handle_recv(now, src_of(b), &Packet::Handshake(hs).to_vec(&[]).unwrap());
    let mut next = first;
    while let Some(t) = e.poll_transmit(now) {
        let bytes = [&t.hdr[..], &t.payload[..]].concat();
        let (
            Packet::CtsData {
                connid,
                recv_id,
                seg_offset,
                seg_length,
            },
            _,
        ) = wire::decode(&bytes).unwrap()
        else {
            panic!("expected CTSDATA");
        };
        assert_eq!(
            (connid, recv_id, seg_offset),
            (Some(a.qkey), 77, next as u64)
        );
        assert!(t.hdr.len() + t.payload.len() <= e.config().mtu);
        assert_eq!(seg_length as usize, t.payload.len());
        next += t.payload.len();
        e.handle_send_completion(now, t.wr_id, Status::Success);
    }
    assert_eq!(next, first + 100_000, "exactly the window");
    assert!(
        e.poll_event().is_none(),
        "not complete before the rest is granted"
    );
}

#[test]
fn stale_connid_and_unidentifiable_packets_are_dropped() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    sim.post_recv(1, rop(64, 1)).unwrap();
    sim.send(0, sop(a1, pattern(1, 10), 1)).unwrap();
    assert!(sim.run());
    assert_eq!(recv_events(&mut sim, 1).len(), 1);
    sim.post_recv(1, rop(64, 2)).unwrap();
    let before = sim.engine(1).stats().dropped_pkts;
    let stale = |sender| Packet::EagerRtm {
        opt: ReqOpt {
            sender,
            cq_data: None,
        },
        msg_id: 1,
        tag: None,
        dc_send_id: None,
    };
    let wrong = a0.qkey ^ 0x55;
    let pkts = [
        stale(Sender::Connid(wrong)).to_vec(b"stale").unwrap(),
        stale(Sender::RawAddr(addr(3, 1)))
            .to_vec(b"spoofed raw address")
            .unwrap(),
        Packet::Cts {
            connid: Some(wrong),
            send_id: 1,
            recv_id: 1,
            recv_length: 10,
            read_req: false,
        }
        .to_vec(&[])
        .unwrap(),
        Packet::Receipt {
            connid: Some(wrong),
            send_id: 1,
            msg_id: 0,
        }
        .to_vec(&[])
        .unwrap(),
    ];
    for p in &pkts {
        sim.inject(1, src_of(a0), p);
    }
    // A REQ from an unknown source with only a connid cannot be attributed.
    sim.inject(
        1,
        src_of(addr(4, 4)),
        &stale(Sender::Connid(4)).to_vec(b"x").unwrap(),
    );
    assert!(sim.run());
    assert_eq!(
        sim.engine(1).stats().dropped_pkts - before,
        pkts.len() as u64 + 1,
        "seed {seed}"
    );
    assert!(
        recv_events(&mut sim, 1).is_empty(),
        "seed {seed}: nothing stale was delivered"
    );
    // The real peer still gets through.
    sim.send(0, sop(a1, pattern(2, 10), 2)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert!(r[0].buf[..] == pattern(2, 10)[..], "seed {seed}");
}

#[test]
fn restarted_peer_with_a_new_qkey_is_a_new_peer() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (old0, a1) = (sim.addr(0), sim.addr(1));
    for k in 0..3 {
        sim.send(0, sop(a1, pattern(k, 100), k)).unwrap();
    }
    assert!(sim.run());
    assert_eq!(sim.engine(1).resources().unexpected_msgs, 3, "seed {seed}");
    let new0 = sim.restart(0);
    assert_ne!(new0.qkey, old0.qkey);
    sim.send(0, sop(a1, pattern(10, 100), 10)).unwrap();
    assert!(sim.run());
    let res = sim.engine(1).resources();
    assert_eq!(
        (res.unexpected_msgs, res.peers),
        (1, 1),
        "seed {seed}: the old incarnation's state is gone"
    );
    sim.post_recv(1, rop(1000, 1)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].src, Some(new0), "seed {seed}");
    assert!(r[0].buf[..] == pattern(10, 100)[..], "seed {seed}");
    // A late packet of the old incarnation is stale.
    let before = sim.engine(1).stats().dropped_pkts;
    let old = Packet::EagerRtm {
        opt: ReqOpt {
            sender: Sender::RawAddr(old0),
            cq_data: None,
        },
        msg_id: 3,
        tag: None,
        dc_send_id: None,
    };
    sim.inject(1, src_of(old0), &old.to_vec(b"late").unwrap());
    assert_eq!(
        sim.engine(1).stats().dropped_pkts,
        before + 1,
        "seed {seed}"
    );
    // Both ways work with the new incarnation; the old address is gone.
    sim.post_recv(0, rop(5000, 5)).unwrap();
    sim.send(1, sop(new0, pattern(11, 5000), 1)).unwrap();
    sim.send(1, sop(old0, pattern(12, 5000), 2)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 0);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert!(
        r[0].error.is_none() && r[0].buf[..] == pattern(11, 5000)[..],
        "seed {seed}"
    );
    let mut s = send_events(&mut sim, 1);
    s.sort_by_key(|s| s.context);
    assert!(s[0].error.is_none(), "seed {seed}");
    assert_eq!(
        s[1].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::ConnectionAborted),
        "seed {seed}"
    );
    assert_eq!(s[1].status, Some(Status::UnresponsiveRemote));
    baseline(&mut sim, seed);
}

#[test]
fn reorder_window_overflow_keeps_order() {
    let seed = efa::fault::test_seed();
    for win in [1usize, 16] {
        let mut cfg = SimConfig::clean(seed);
        cfg.engine.recvwin_size = win;
        cfg.jitter = Duration::from_micros(400);
        let mut sim = Sim::new(cfg, 2);
        let a1 = sim.addr(1);
        let n = 400u64;
        for k in 0..n {
            let len = (k as usize * 37) % 300 + if k % 50 == 0 { 20_000 } else { 0 };
            sim.send(0, sop(a1, pattern(k, len), k)).unwrap();
        }
        let mut max_held = 0;
        sim.run_until(|s| {
            max_held = max_held.max(s.engine(1).resources().reorder_held);
            false
        });
        assert!(
            max_held > win,
            "seed {seed} win {win}: overflow list used (held at most {max_held})"
        );
        for k in 0..n {
            sim.post_recv(1, rop(30_000, k)).unwrap();
        }
        assert!(sim.run());
        let mut r = recv_events(&mut sim, 1);
        r.sort_by_key(|r| r.context);
        assert_eq!(r.len(), n as usize, "seed {seed}");
        for (k, d) in r.iter().enumerate() {
            let len = (k * 37) % 300 + if k % 50 == 0 { 20_000 } else { 0 };
            assert!(
                d.buf[..] == pattern(k as u64, len)[..],
                "seed {seed} win {win}: message {k} out of order"
            );
        }
        assert!(sim.engine(1).stats().reorder_buffered > 0, "seed {seed}");
        assert_eq!(send_events(&mut sim, 0).len(), n as usize);
        baseline(&mut sim, seed);
    }
}

fn trop(cap: usize, tag: u64, ignore: u64, src: Option<RawAddr>, context: u64) -> RecvOp {
    let mut op = rop(cap, context);
    op.tag = Some((tag, ignore));
    op.src = src;
    op
}

fn tsop(dest: RawAddr, buf: Bytes, tag: u64, context: u64) -> SendOp {
    let mut op = sop(dest, buf, context);
    op.tag = Some(tag);
    op
}

#[test]
fn tag_matching_with_ignore_bits_and_directed_receives() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.jitter = Duration::from_micros(20);
    let mut sim = Sim::new(cfg, 4);
    let a: Vec<RawAddr> = (0..4).map(|i| sim.addr(i)).collect();
    sim.post_recv(0, trop(100, 0x100, 0x0ff, None, 1)).unwrap();
    sim.post_recv(0, trop(100, 0x200, 0, Some(a[2]), 2))
        .unwrap();
    sim.post_recv(0, trop(100, 0x200, 0, None, 3)).unwrap();
    sim.post_recv(0, rop(100, 4)).unwrap();
    sim.send(1, tsop(a[0], pattern(1, 10), 0x200, 1)).unwrap();
    sim.send(2, tsop(a[0], pattern(2, 20), 0x200, 1)).unwrap();
    sim.send(3, tsop(a[0], pattern(3, 30), 0x1ab, 1)).unwrap();
    sim.send(3, sop(a[0], pattern(4, 40), 2)).unwrap();
    sim.send(1, tsop(a[0], pattern(5, 50), 0x3cd, 2)).unwrap();
    assert!(sim.run());
    let mut r = recv_events(&mut sim, 0);
    r.sort_by_key(|r| r.context);
    let got: Vec<(u64, Option<u64>, Option<RawAddr>, usize)> =
        r.iter().map(|d| (d.context, d.tag, d.src, d.len)).collect();
    assert_eq!(
        got,
        vec![
            (1, Some(0x1ab), Some(a[3]), 30),
            (2, Some(0x200), Some(a[2]), 20),
            (3, Some(0x200), Some(a[1]), 10),
            (4, None, Some(a[3]), 40),
        ],
        "seed {seed}"
    );
    // 0x3cd matched nothing: it waits as unexpected until a receive ignoring the low byte.
    assert_eq!(sim.engine(0).resources().unexpected_msgs, 1);
    sim.post_recv(0, trop(100, 0x3ff, 0xf0, Some(a[2]), 5))
        .unwrap();
    sim.post_recv(0, trop(100, 0x3ff, 0xf2, Some(a[1]), 6))
        .unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 0);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert_eq!((r[0].context, r[0].tag), (6, Some(0x3cd)));
    assert!(sim.engine(0).cancel_recv(5));
    assert_eq!(recv_events(&mut sim, 0).len(), 1);
    baseline(&mut sim, seed);
}

#[test]
fn multi_recv_buffers_hand_out_pieces_then_retire() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let a1 = sim.addr(1);
    let mut mop = rop(10_000, 7);
    mop.multi_recv = Some(1500);
    let base = mop.buf.as_ptr() as usize;
    sim.post_recv(1, mop).unwrap();
    for k in 0..12u64 {
        sim.send(0, sop(a1, pattern(k, 1000), k)).unwrap();
    }
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    // 9 messages fit (1000 bytes left < 1500 after the 9th), then the retiring completion.
    assert_eq!(r.len(), 10, "seed {seed}");
    for (k, d) in r[..9].iter().enumerate() {
        assert_eq!(
            (d.context, d.len, d.multi_recv_done),
            (7, 1000, false),
            "seed {seed}"
        );
        assert!(
            d.buf[..] == pattern(k as u64, 1000)[..],
            "seed {seed}: piece {k}"
        );
        assert_eq!(
            d.buf.as_ptr() as usize,
            base + 1000 * k,
            "seed {seed}: pieces share the buffer"
        );
    }
    let last = &r[9];
    assert!(
        last.multi_recv_done && last.error.is_none() && last.len == 0,
        "seed {seed}: {last:?}"
    );
    assert_eq!(last.buf.capacity(), 1000);
    // The other 3 wait as unexpected; a new buffer takes them at once, and a medium message.
    assert_eq!(sim.engine(1).resources().unexpected_msgs, 3);
    let mut mop = rop(64 * 1024, 8);
    mop.multi_recv = Some(100);
    sim.post_recv(1, mop).unwrap();
    sim.send(0, sop(a1, pattern(100, 30_000), 100)).unwrap();
    sim.send(0, sop(a1, pattern(101, 40_000), 101)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    let lens: Vec<(usize, usize, bool)> = r
        .iter()
        .map(|d| (d.len, d.olen, d.multi_recv_done))
        .collect();
    // 3 x 1000 + 30 000 leave 32 536 bytes: the 40 000-byte message is truncated into it.
    assert_eq!(
        lens,
        vec![
            (1000, 0, false),
            (1000, 0, false),
            (1000, 0, false),
            (30_000, 0, false),
            (32_536, 7464, false),
            (0, 0, true)
        ],
        "seed {seed}"
    );
    assert!(r[3].buf[..] == pattern(100, 30_000)[..], "seed {seed}");
    assert_eq!(
        r[4].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::Truncated)
    );
    assert!(
        r[4].buf[..] == pattern(101, 40_000)[..32_536],
        "seed {seed}"
    );
    // Cancelling a multi-receive buffer retires it with Canceled.
    let mut mop = rop(4096, 9);
    mop.multi_recv = Some(100);
    sim.post_recv(1, mop).unwrap();
    assert!(sim.engine(1).cancel_recv(9));
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1);
    assert!(r[0].multi_recv_done && r[0].buf.capacity() == 4096);
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::Canceled)
    );
    assert_eq!(send_events(&mut sim, 0).len(), 14);
    baseline(&mut sim, seed);
}

#[test]
fn peek_claim_and_discard_unexpected_messages() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.jitter = Duration::from_micros(10);
    let mut sim = Sim::new(cfg, 2);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    let mut long_dc = tsop(a1, pattern(2, 300_000), 0x11, 2);
    long_dc.delivery_complete = true;
    let mut with_data = tsop(a1, pattern(1, 100), 0x10, 1);
    with_data.data = Some(0xfeed);
    sim.send(0, with_data).unwrap();
    sim.send(0, long_dc).unwrap();
    sim.send(0, tsop(a1, pattern(3, 20_000), 0x12, 3)).unwrap();
    assert!(sim.run());
    let e = sim.engine(1);
    assert_eq!(
        e.peek(0x99, 0, None, false).unwrap_err().kind(),
        ErrorKind::NoMessage
    );
    let p = e.peek(0x10, 0, None, false).unwrap();
    assert_eq!(
        (p.len, p.tag, p.data, p.src, p.claim),
        (100, 0x10, Some(0xfeed), a0, None)
    );
    assert_eq!(
        e.peek(0x13, 0x3, Some(a0), false).unwrap().tag,
        0x10,
        "ignore bits: oldest match"
    );
    let c = e.peek(0x12, 0, Some(a0), true).unwrap();
    let token = c.claim.expect("claimed");
    assert_eq!(c.len, 20_000);
    assert_eq!(
        e.peek(0x12, 0, None, false).unwrap_err().kind(),
        ErrorKind::NoMessage,
        "claimed is hidden"
    );
    let d = e.discard(0x11, 0, None).unwrap();
    assert_eq!(d.len, 300_000);
    let now = sim.now();
    sim.engine(1)
        .recv_claimed(now, token, rop(20_000, 30))
        .unwrap();
    assert_eq!(
        sim.engine(1)
            .recv_claimed(now, token, rop(1, 31))
            .unwrap_err()
            .0
            .kind(),
        ErrorKind::NoMessage
    );
    sim.post_recv(1, trop(100, 0x10, 0, None, 10)).unwrap();
    assert!(sim.run());
    let mut r = recv_events(&mut sim, 1);
    r.sort_by_key(|d| d.context);
    assert_eq!(
        r.len(),
        2,
        "seed {seed}: the discarded message has no completion"
    );
    assert!(r[0].context == 10 && r[0].buf[..] == pattern(1, 100)[..] && r[0].data == Some(0xfeed));
    assert!(r[1].context == 30 && r[1].buf[..] == pattern(3, 20_000)[..]);
    let s = send_events(&mut sim, 0);
    assert_eq!(
        s.len(),
        3,
        "seed {seed}: the discarded (DC, long) send completes normally"
    );
    assert!(s.iter().all(|s| s.error.is_none()));
    baseline(&mut sim, seed);
}

#[test]
fn cancel_a_posted_receive_but_not_one_that_started() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let a1 = sim.addr(1);
    sim.post_recv(1, rop(4096, 1)).unwrap();
    assert!(sim.engine(1).cancel_recv(1));
    assert!(!sim.engine(1).cancel_recv(1));
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1);
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::Canceled)
    );
    assert!(r[0].buf.capacity() >= 4096 && r[0].src.is_none());
    sim.post_recv(1, rop(1 << 20, 2)).unwrap();
    sim.send(0, sop(a1, pattern(1, 1 << 20), 1)).unwrap();
    sim.run_until(|s| s.engine(1).resources().rx_ops == 1 && s.stats.delivered > 3);
    assert!(
        !sim.engine(1).cancel_recv(2),
        "seed {seed}: matching started"
    );
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert!(
        r.len() == 1 && r[0].error.is_none() && r[0].buf[..] == pattern(1, 1 << 20)[..],
        "seed {seed}"
    );
    assert_eq!(sim.engine(1).stats().canceled, 1);
    baseline(&mut sim, seed);
}

#[test]
fn truncation_of_eager_medium_and_long_cts_messages() {
    let seed = efa::fault::test_seed();
    for (len, cap) in [
        (1000, 100),
        (30_000, 10_000),
        (500_000, 100_000),
        (200_000, 0),
        (8000, 7999),
    ] {
        for dc in [false, true] {
            let mut sim = Sim::new(SimConfig::faulty(seed), 2);
            let a1 = sim.addr(1);
            let data = pattern(len as u64, len);
            sim.post_recv(1, rop(cap, 1)).unwrap();
            let mut op = sop(a1, data.clone(), 1);
            op.delivery_complete = dc;
            sim.send(0, op).unwrap();
            assert!(sim.run(), "seed {seed}");
            let r = recv_events(&mut sim, 1);
            assert_eq!(r.len(), 1, "seed {seed} {len} {cap}");
            assert_eq!(
                r[0].error.as_ref().map(|e| e.kind()),
                Some(ErrorKind::Truncated),
                "seed {seed}"
            );
            assert_eq!((r[0].len, r[0].olen), (cap, len - cap), "seed {seed}");
            assert!(r[0].buf[..] == data[..cap], "seed {seed} {len} {cap}");
            let s = send_events(&mut sim, 0);
            assert!(
                s.len() == 1 && s[0].error.is_none(),
                "seed {seed} {len} {cap} dc {dc}: the sender completes normally"
            );
            assert_eq!(sim.engine(1).stats().truncated, 1);
            baseline(&mut sim, seed);
        }
    }
}

#[test]
fn delivery_complete_waits_for_the_receipt() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let a1 = sim.addr(1);
    for (k, len) in [100usize, 30_000, 300_000].into_iter().enumerate() {
        let mut op = sop(a1, pattern(k as u64, len), k as u64);
        op.delivery_complete = true;
        sim.send(0, op).unwrap();
        sim.send(0, sop(a1, pattern(10 + k as u64, len), 10 + k as u64))
            .unwrap();
    }
    assert!(sim.run());
    // Transmit complete: the eager and medium sends without DC are done; nothing with DC is.
    let mut s: Vec<u64> = send_events(&mut sim, 0).iter().map(|s| s.context).collect();
    s.sort_unstable();
    assert_eq!(s, vec![10, 11], "seed {seed}");
    let res = sim.engine(0).resources();
    assert_eq!(
        (res.tx_ops, res.outstanding_pkts),
        (4, 0),
        "seed {seed}: every packet completed, still waiting"
    );
    for k in 0..6 {
        sim.post_recv(1, rop(300_000, k)).unwrap();
    }
    assert!(sim.run());
    let mut s: Vec<u64> = send_events(&mut sim, 0).iter().map(|s| s.context).collect();
    s.sort_unstable();
    assert_eq!(s, vec![0, 1, 2, 12], "seed {seed}");
    assert_eq!(recv_events(&mut sim, 1).len(), 6);
    baseline(&mut sim, seed);
}

#[test]
fn again_when_operation_queues_are_full() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.engine.max_tx_ops = 4;
    cfg.engine.max_rx_ops = 2;
    let mut sim = Sim::new(cfg, 2);
    let a1 = sim.addr(1);
    for k in 0..4 {
        sim.send(0, sop(a1, pattern(k, 10), k)).unwrap();
    }
    let (e, op) = sim.send(0, sop(a1, pattern(4, 10), 4)).unwrap_err();
    assert_eq!(
        (e.kind(), op.context, op.buf.len()),
        (ErrorKind::Again, 4, 10)
    );
    sim.post_recv(1, rop(10, 1)).unwrap();
    sim.post_recv(1, rop(10, 2)).unwrap();
    let (e, op) = sim.post_recv(1, rop(10, 3)).unwrap_err();
    assert_eq!((e.kind(), op.context), (ErrorKind::Again, 3));
    assert!(sim.run());
    assert_eq!(send_events(&mut sim, 0).len(), 4);
    sim.send(0, op_again(a1)).unwrap();
    assert_eq!(sim.engine(0).stats().again, 1);
    assert_eq!(sim.engine(1).stats().again, 1);
    fn op_again(a: RawAddr) -> SendOp {
        sop(a, pattern(4, 10), 4)
    }
}

#[test]
fn rnr_resends_at_once_then_backs_off_exponentially() {
    let t0 = Instant::now();
    let (a, b) = (addr(1, 0x111), addr(2, 0x222));
    let mut e = Engine::new(engine_cfg(), a, t0);
    e.send(t0, sop(b, pattern(1, 100), 1)).unwrap();
    let t1 = e.poll_transmit(t0).unwrap();
    e.handle_send_completion(t0, t1.wr_id, Status::RnrRetryExceeded);
    assert_eq!(e.poll_timeout(), None, "first RNR of a packet: no backoff");
    let t2 = e.poll_transmit(t0).expect("resent at once");
    assert_eq!(
        (t2.hdr.clone(), t2.payload.clone()),
        (t1.hdr.clone(), t1.payload.clone())
    );
    e.handle_send_completion(t0, t2.wr_id, Status::RnrRetryExceeded);
    let ms = Duration::from_millis;
    assert_eq!(
        e.poll_timeout(),
        Some(t0 + ms(1)),
        "second RNR: backoff of timeout_interval"
    );
    assert!(e.poll_transmit(t0 + ms(0)).is_none());
    let (err, _) = e.send(t0, sop(b, pattern(2, 10), 2)).unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::Again,
        "no new work for a peer in backoff"
    );
    e.handle_timeout(t0 + Duration::from_micros(500));
    assert!(
        e.poll_transmit(t0 + Duration::from_micros(500)).is_none(),
        "backoff honoured"
    );
    e.handle_timeout(t0 + ms(1));
    let t3 = e
        .poll_transmit(t0 + ms(1))
        .expect("resent after the backoff");
    e.handle_send_completion(t0 + ms(1), t3.wr_id, Status::RnrRetryExceeded);
    assert_eq!(e.poll_timeout(), Some(t0 + ms(3)), "next episode doubles");
    e.handle_timeout(t0 + ms(3));
    let t4 = e.poll_transmit(t0 + ms(3)).unwrap();
    e.handle_send_completion(t0 + ms(3), t4.wr_id, Status::RnrRetryExceeded);
    assert_eq!(e.poll_timeout(), Some(t0 + ms(6)), "capped by max_timeout");
    e.handle_timeout(t0 + ms(6));
    let t5 = e.poll_transmit(t0 + ms(6)).unwrap();
    e.handle_send_completion(t0 + ms(6), t5.wr_id, Status::Success);
    let Some(Event::Send(s)) = e.poll_event() else {
        panic!("send completes")
    };
    assert!(s.error.is_none());
    let st = e.stats();
    assert_eq!((st.rnr, st.retransmits, st.again), (4, 4, 1));

    // Without FI_EFA_TIMEOUT_INTERVAL the first backoff is random in 40..120 µs.
    for seed in 0..20 {
        let mut cfg = engine_cfg();
        cfg.timeout_interval = Duration::ZERO;
        cfg.seed = seed;
        let mut e = Engine::new(cfg, a, t0);
        e.send(t0, sop(b, pattern(1, 100), 1)).unwrap();
        for _ in 0..2 {
            let t = e.poll_transmit(t0).unwrap();
            e.handle_send_completion(t0, t.wr_id, Status::RnrRetryExceeded);
        }
        let wait = e.poll_timeout().unwrap() - t0;
        assert!(
            wait >= Duration::from_micros(40) && wait < Duration::from_micros(120),
            "{wait:?}"
        );
    }
}

#[test]
fn rnr_under_a_slow_receiver_still_delivers_everything_in_order() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.rx_buffers = 2;
    cfg.rx_repost_delay = Duration::from_micros(100);
    cfg.rnr_retry = 0;
    let mut sim = Sim::new(cfg, 2);
    let a1 = sim.addr(1);
    let n = 60u64;
    for k in 0..n {
        sim.post_recv(1, rop(70_000, k)).unwrap();
    }
    for k in 0..n {
        let len = if k % 10 == 9 { 60_000 } else { 2000 };
        sim.send(0, sop(a1, pattern(k, len), k)).unwrap();
    }
    let mut saw_again = false;
    assert!(sim.run_until(|s| {
        if !saw_again && s.engine(0).poll_timeout().is_some() {
            let (e, _) = s.send(0, sop(a1, Bytes::new(), 99)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Again, "seed {seed}");
            saw_again = true;
        }
        s.engine(1).resources().rx_ops == 0 && s.engine(0).resources().tx_ops == 0
    }));
    assert!(saw_again, "seed {seed}: the sender backed off");
    let mut r = recv_events(&mut sim, 1);
    r.sort_by_key(|d| d.context);
    assert_eq!(r.len(), n as usize);
    for (k, d) in r.iter().enumerate() {
        let len = if k % 10 == 9 { 60_000 } else { 2000 };
        assert!(
            d.error.is_none() && d.buf[..] == pattern(k as u64, len)[..],
            "seed {seed}: message {k}"
        );
    }
    let st = sim.engine(0).stats();
    assert!(
        st.rnr > 0 && st.retransmits >= st.rnr,
        "seed {seed}: {st:?}"
    );
    assert_eq!(send_events(&mut sim, 0).len(), n as usize);
    assert!(sim.run());
    baseline(&mut sim, seed);
}

#[test]
fn unresponsive_peer_fails_operations_instead_of_hanging() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.unresponsive_after = Duration::from_millis(1);
    let mut sim = Sim::new(cfg, 3);
    let (a1, a2) = (sim.addr(1), sim.addr(2));
    // Node 2 is gone: everything to it fails; traffic to node 1 is unaffected.
    sim.vanish(2);
    for (k, len) in [100usize, 30_000, 300_000, 10].into_iter().enumerate() {
        let mut op = sop(a2, pattern(k as u64, len), k as u64);
        op.delivery_complete = k == 3;
        sim.send(0, op).unwrap();
        sim.post_recv(1, rop(len, k as u64)).unwrap();
        sim.send(0, sop(a1, pattern(k as u64, len), 10 + k as u64))
            .unwrap();
    }
    assert!(sim.run());
    let mut s = send_events(&mut sim, 0);
    s.sort_by_key(|s| s.context);
    assert_eq!(s.len(), 8, "seed {seed}");
    for d in &s[..4] {
        assert_eq!(
            d.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::ConnectionAborted),
            "seed {seed}"
        );
        assert_eq!(d.status, Some(Status::UnresponsiveRemote));
    }
    assert!(s[4..].iter().all(|d| d.error.is_none()), "seed {seed}");
    assert_eq!(recv_events(&mut sim, 1).len(), 4);
    assert_eq!(
        sim.engine(0).resources().peers,
        1,
        "seed {seed}: the dead peer is forgotten"
    );

    // A sender that vanishes in the middle of a long message: the receive fails after
    // rx_stall_timeout (the CTS to it takes longer to fail here).
    let mut cfg = SimConfig::clean(seed);
    cfg.unresponsive_after = Duration::from_secs(60);
    let mut sim = Sim::new(cfg, 3);
    let (a1, a2) = (sim.addr(1), sim.addr(2));
    sim.post_recv(1, rop(4 << 20, 1)).unwrap();
    sim.send(2, sop(a1, pattern(1, 4 << 20), 1)).unwrap();
    sim.run_until(|s| s.stats.delivered_bytes > 1 << 20);
    sim.vanish(2);
    let t = sim.elapsed();
    sim.run_until(|s| !s.node(1).events.is_empty() || s.engine(1).resources().rx_ops == 0);
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::ConnectionAborted),
        "seed {seed}"
    );
    assert_eq!(r[0].src, Some(a2));
    let waited = sim.elapsed() - t;
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(7),
        "seed {seed}: {waited:?}"
    );
    assert!(sim.run());
    assert!(
        recv_events(&mut sim, 1).is_empty(),
        "seed {seed}: one completion only"
    );
    baseline(&mut sim, seed);
    // A new incarnation at the same place works.
    sim.restart(2);
    sim.post_recv(1, rop(100, 2)).unwrap();
    sim.send(2, sop(a1, pattern(2, 100), 2)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert!(
        r.len() == 1 && r[0].error.is_none() && r[0].src == Some(sim.addr(2)),
        "seed {seed}"
    );
}

#[test]
fn close_completes_every_operation_once() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (a1, _) = (sim.addr(1), sim.addr(0));
    sim.post_recv(1, rop(100, 1)).unwrap();
    let mut m = rop(10_000, 2);
    m.multi_recv = Some(100);
    sim.post_recv(1, m).unwrap();
    sim.post_recv(1, trop(100, 0x1, 0, None, 3)).unwrap();
    sim.post_recv(1, trop(2 << 20, 0x2, 0, None, 4)).unwrap();
    sim.send(0, tsop(a1, pattern(10, 2 << 20), 0x2, 10))
        .unwrap();
    let mut dc = tsop(a1, pattern(11, 100), 0x77, 11);
    dc.delivery_complete = true;
    sim.send(0, dc).unwrap();
    sim.send(0, sop(a1, pattern(12, 100), 12)).unwrap();
    sim.send(0, tsop(a1, pattern(13, 300_000), 0x78, 13))
        .unwrap();
    sim.run_until(|s| s.stats.delivered_bytes > 200_000);
    sim.engine(0).close();
    sim.engine(1).close();
    sim.engine(1).close();
    assert!(sim.run());
    let mut s: Vec<(u64, Option<ErrorKind>)> = send_events(&mut sim, 0)
        .iter()
        .map(|d| (d.context, d.error.as_ref().map(|e| e.kind())))
        .collect();
    s.sort_by_key(|x| x.0);
    assert_eq!(
        s,
        vec![
            (10, Some(ErrorKind::Canceled)),
            (11, Some(ErrorKind::Canceled)),
            (12, None),
            (13, Some(ErrorKind::Canceled))
        ],
        "seed {seed}"
    );
    let mut r: Vec<(u64, Option<ErrorKind>, bool)> = recv_events(&mut sim, 1)
        .iter()
        .map(|d| {
            (
                d.context,
                d.error.as_ref().map(|e| e.kind()),
                d.multi_recv_done,
            )
        })
        .collect();
    r.sort_by_key(|x| x.0);
    assert_eq!(
        r,
        vec![
            (1, None, false),
            (2, Some(ErrorKind::Canceled), true),
            (3, Some(ErrorKind::Canceled), false),
            (4, Some(ErrorKind::Canceled), false)
        ],
        "seed {seed}"
    );
    let now = sim.now();
    let e = sim.engine(0);
    assert_eq!(
        e.send(now, sop(a1, Bytes::new(), 1)).unwrap_err().0.kind(),
        ErrorKind::Closed
    );
    assert_eq!(
        e.post_recv(now, rop(1, 1)).unwrap_err().0.kind(),
        ErrorKind::Closed
    );
    e.handle_send_completion(now, 1 << 32, Status::Success);
    assert!(
        e.poll_event().is_none() && e.poll_timeout().is_none() && e.poll_transmit(now).is_none()
    );
    baseline(&mut sim, seed);
}

/// Many seeds with varied MTU, windows and queue depths (`cargo test --release -- --ignored`;
/// `EFA_STRESS_SEEDS` sets how many).
#[test]
#[ignore]
fn stress_many_seeds_and_shapes() {
    let n: u64 = std::env::var("EFA_STRESS_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let base = efa::fault::test_seed();
    for i in 0..n {
        let seed = base.wrapping_add(i);
        let mut rng = Rng::new(seed);
        let mut cfg = SimConfig::faulty(seed);
        cfg.engine.mtu = [512, 1500, 4096, 8192][rng.below(4) as usize];
        cfg.engine.recvwin_size = [1, 4, 16, 64][rng.below(4) as usize];
        cfg.engine.tx_min_credits = [1, 2, 32][rng.below(3) as usize];
        cfg.engine.max_outstanding_tx = [1, 4, 256][rng.below(3) as usize];
        cfg.engine.max_tx_ops = [1, 8, 1024][rng.below(3) as usize];
        // Receives are posted in a fixed order: with fewer than all of them allowed, a test
        // that waits for specific messages could deadlock itself.
        cfg.engine.max_rx_ops = 1024;
        cfg.engine.max_medium_msg_size = [0, 16_384, 65_536][rng.below(3) as usize];
        cfg.rx_buffers = [1, 4, 64][rng.below(3) as usize];
        cfg.rnr_retry = rng.below(3) as u32;
        cfg.rx_repost_delay = Duration::from_micros(rng.below(50));
        cfg.jitter = Duration::from_micros(rng.below(200));
        cfg.loss = 0.1 * rng.below(4) as f64;
        // Under extreme RNR contention a sender can starve for seconds; this checks the
        // protocol, not the stall heuristic.
        cfg.engine.rx_stall_timeout = Duration::from_secs(3600);
        let all = rng.chance(0.5);
        let pairs: Vec<(usize, usize)> = if all {
            (0..4)
                .flat_map(|a| (0..4).filter(move |&b| b != a).map(move |b| (a, b)))
                .collect()
        } else {
            vec![(1, 0), (2, 0), (3, 0)]
        };
        eprintln!("seed {seed}: {:?}", cfg.engine);
        let sim = run_mix(seed, cfg, 4, &pairs, 400, 1);
        eprintln!(
            "seed {seed}: ok, {:?} virtual, {:?}",
            sim.elapsed(),
            sim.stats
        );
    }
}
