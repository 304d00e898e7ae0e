//! The protocol engine in the simulator: seeded message mixes under faults (here) and targeted
//! tests of the protocol (`engine_sim/protocol.rs`), the receive side (`engine_sim/receive.rs`)
//! and failures (`engine_sim/failure.rs`). Seeds come from `EFA_TEST_SEED` (printed in every
//! assertion message).

use bytes::Bytes;
use efa::ErrorKind;
use efa::RawAddr;
use efa::device::{Source, Status};
use efa::fault::Rng;
use efa::proto::engine::Resources;
use efa::proto::engine::{Engine, EngineConfig};
use efa::proto::engine::{Event, RecvDone, RecvOp, SendDone, SendOp};
use efa::proto::sim::{Sim, SimConfig, pattern, recv_op, send_op};
use efa::proto::wire::{self, ExtraFeature, Handshake, Packet, ReqOpt, Sender};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use std::time::Instant;

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
            other => panic!("unexpected event {other:?}"),
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

// Random message mixes under faults.

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
                    read_key: None,
                    region_len: None,
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
                other => panic!("seed {seed}: unexpected event {other:?}"),
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

#[path = "engine_sim/failure.rs"]
mod failure;
#[path = "engine_sim/protocol.rs"]
mod protocol;
#[path = "engine_sim/receive.rs"]
mod receive;
