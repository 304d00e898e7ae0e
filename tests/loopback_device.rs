//! The loopback device through the `Device` / `QueuePair` seam: delivery, faults, replay, RNR and
//! the contract every device honours. Randomised tests print their seed (`EFA_TEST_SEED=<seed>`
//! replays one).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::{
    Device, DeviceCompletion, DeviceKind, Opcode, QpAttr, QpType, QueuePair, SendWr, Status,
};
use efa::fault::{Rng, test_seed};
use efa::{ErrorKind, FaultConfig, RawAddr};

type Qp = Box<dyn QueuePair>;

/// Generous: only there to fail instead of hanging.
const DEADLINE: Duration = Duration::from_secs(120);

fn open(net: &LoopbackNetwork) -> Arc<LoopbackDevice> {
    LoopbackDevice::open(net, LoopbackConfig::default()).expect("open loopback device")
}

fn qp(dev: &LoopbackDevice, t: QpType, f: impl FnOnce(&mut QpAttr)) -> Qp {
    let mut attr = QpAttr::new(t);
    f(&mut attr);
    dev.create_qp(attr).expect("create_qp")
}

fn send_wr(wr_id: u64, dest: RawAddr, data: &[u8], split: usize, imm: Option<u32>) -> SendWr {
    let data = Bytes::copy_from_slice(data);
    SendWr {
        wr_id,
        dest,
        hdr: data.slice(..split),
        payload: data.slice(split..),
        imm,
    }
}

fn poll_all(q: &mut Qp) -> Vec<DeviceCompletion> {
    let mut v = Vec::new();
    while q.poll(&mut v, 16) > 0 {}
    v
}

/// Polls `q` until it yields `n` completions (pumping the network meanwhile).
fn poll_n(net: &LoopbackNetwork, q: &mut Qp, n: usize, what: &str) -> Vec<DeviceCompletion> {
    let t0 = Instant::now();
    let mut v = Vec::new();
    while v.len() < n {
        assert!(
            t0.elapsed() < DEADLINE,
            "{what}: {} of {n} completions",
            v.len()
        );
        net.pump();
        let room = n - v.len();
        q.poll(&mut v, room);
        std::thread::yield_now();
    }
    v
}

/// The payload of datagram `id`: its id (when there is room), then bytes derived from it.
fn payload(id: u32, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(u64::from(id) ^ 0xa5a5_5a5a);
    let mut v: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    let idb = id.to_le_bytes();
    let n = len.min(4);
    v[..n].copy_from_slice(&idb[..n]);
    v
}

#[test]
fn device_attributes() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = open(&net);
    let b = open(&net);
    let attr = a.attr();
    assert_eq!(attr.kind, DeviceKind::Loopback);
    assert!(attr.name.starts_with("loopback"));
    assert_ne!(attr.gid, b.attr().gid);
    assert_ne!(attr.name, b.attr().name);
    assert_eq!(
        (attr.mtu, attr.max_sge, attr.max_rdma_size),
        (8192, 2, 1 << 30)
    );
    assert!(attr.caps.rnr_retry && attr.caps.rdma_read && attr.caps.rdma_write);
    assert!(attr.caps.unsolicited_write_recv);
    // Without RDMA: no RDMA caps, max_rdma_size 0.
    let cfg = LoopbackConfig::default().with_rdma(false);
    let plain = LoopbackDevice::open(&net, cfg).unwrap();
    let p = plain.attr();
    assert_eq!(p.max_rdma_size, 0);
    assert!(!p.caps.rdma_read && !p.caps.rdma_write && !p.caps.unsolicited_write_recv);
    // Another network: another GID space.
    let other = open(&LoopbackNetwork::new(FaultConfig::default()));
    assert_ne!(other.attr().gid, attr.gid);
    // The global network is one network.
    assert_eq!(
        LoopbackNetwork::global().id(),
        LoopbackNetwork::global().id()
    );
}

#[test]
fn config_validation() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    for cfg in [
        LoopbackConfig::default().with_mtu(10),
        LoopbackConfig::default().with_mtu(usize::MAX),
        LoopbackConfig::default().with_max_send_wr(0),
        LoopbackConfig::default().with_max_recv_wr(0),
    ] {
        let e = LoopbackDevice::open(&net, cfg.clone()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{cfg:?}");
    }
    let bad = LoopbackNetwork::new(FaultConfig::seeded(1).drop(1.5));
    let e = LoopbackDevice::open(&bad, LoopbackConfig::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        net.set_faults(FaultConfig::seeded(1).reorder(-0.1))
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let dev = open(&net);
    let e = dev
        .create_qp(QpAttr {
            rnr_retry: 8,
            ..QpAttr::new(QpType::Srd)
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(
        net.advance(Duration::from_secs(1)).unwrap_err().kind(),
        ErrorKind::NotSupported
    );
}

#[test]
fn ud_delivers_intact_with_imm_and_src() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let (da, db) = (open(&net), open(&net));
    for t in [QpType::Ud, QpType::Srd] {
        let mut a = qp(&da, t, |_| {});
        let mut b = qp(&db, t, |_| {});
        b.post_recv(7, BytesMut::with_capacity(100)).unwrap();
        let data = payload(1, 50);
        a.post_send(send_wr(3, b.addr(), &data, 20, Some(0xdead_beef)))
            .unwrap();
        let r = poll_all(&mut b);
        assert_eq!(r.len(), 1, "{t:?}");
        let r = &r[0];
        assert_eq!(
            (r.wr_id, r.status, r.opcode, r.byte_len),
            (7, Status::Success, Opcode::Recv, 50)
        );
        assert_eq!(&r.buf.as_ref().unwrap()[..], &data[..]);
        let src = r.src.unwrap();
        assert_eq!((src.gid, src.qpn), (a.addr().gid, a.addr().qpn));
        assert_eq!(r.imm, Some(0xdead_beef));
        let s = poll_all(&mut a);
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].wr_id, s[0].status, s[0].opcode, s[0].byte_len),
            (3, Status::Success, Opcode::Send, 50)
        );
        // Without immediate data and with empty segments.
        b.post_recv(8, BytesMut::with_capacity(8)).unwrap();
        a.post_send(send_wr(4, b.addr(), &[], 0, None)).unwrap();
        let r = poll_all(&mut b);
        assert_eq!(
            (r[0].status, r[0].byte_len, r[0].imm),
            (Status::Success, 0, None)
        );
        assert_eq!(poll_all(&mut a).len(), 1);
    }
    let (sa, sb) = (da.stats(), db.stats());
    assert_eq!((sa.tx_pkts, sa.tx_bytes), (4, 100));
    assert_eq!((sb.rx_pkts, sb.rx_bytes), (4, 100));
}

#[test]
fn notifier_signals_the_completing_queue_pair() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Srd, |_| {});
    let mut attr = QpAttr::new(QpType::Srd);
    let nb = attr.notifier.clone();
    attr.recv_depth = 4;
    let mut b = dev.create_qp(attr).unwrap();
    b.post_recv(1, BytesMut::with_capacity(16)).unwrap();
    let g = nb.generation();
    a.post_send(send_wr(1, b.addr(), b"x", 0, None)).unwrap();
    assert!(nb.wait_until(g, Some(Instant::now() + DEADLINE)));
    assert_eq!(poll_all(&mut b).len(), 1);
    assert_eq!(poll_all(&mut a).len(), 1);
}

#[test]
fn ud_faults_lose_and_duplicate_and_counters_agree() {
    let seed = test_seed();
    let faults = FaultConfig::seeded(seed)
        .drop(0.2)
        .duplicate(0.2)
        .reorder(0.2)
        .delay(0.05, Duration::from_micros(200));
    let net = LoopbackNetwork::new(faults);
    let (da, db) = (open(&net), open(&net));
    let n = 1500u32;
    let mut a = qp(&da, QpType::Ud, |a| a.send_depth = 64);
    let mut b = qp(&db, QpType::Ud, |a| a.recv_depth = 4096);
    for i in 0..4096 {
        b.post_recv(i, BytesMut::with_capacity(64)).unwrap();
    }
    let mut sends = Vec::new();
    for id in 0..n {
        let wr = send_wr(u64::from(id), b.addr(), &payload(id, 16), 4, Some(id));
        a.post_send(wr).unwrap();
        a.poll(&mut sends, 64);
    }
    sends.extend(poll_all(&mut a));
    assert_eq!(sends.len(), n as usize, "seed {seed}");
    assert!(
        sends
            .iter()
            .all(|c| c.status.is_ok() && c.opcode == Opcode::Send),
        "seed {seed}"
    );
    let t0 = Instant::now();
    while net.in_flight() > 0 {
        assert!(
            t0.elapsed() < DEADLINE,
            "seed {seed}: held datagrams never released"
        );
        net.pump();
    }
    let got = poll_all(&mut b);
    let mut count: HashMap<u32, u32> = HashMap::new();
    for c in &got {
        assert!(c.status.is_ok(), "seed {seed}: {c:?}");
        let id = c.imm.unwrap();
        assert_eq!(
            &c.buf.as_ref().unwrap()[..],
            &payload(id, 16)[..],
            "seed {seed}"
        );
        *count.entry(id).or_default() += 1;
    }
    let lost = n as usize - count.len();
    let dups = count.values().filter(|&&k| k == 2).count();
    assert!(count.values().all(|&k| k <= 2), "seed {seed}");
    let (sa, sb) = (da.stats(), db.stats());
    assert_eq!(sa.faults_dropped as usize, lost, "seed {seed}");
    assert_eq!(sa.faults_duplicated as usize, dups, "seed {seed}");
    assert_eq!(sb.rx_pkts as usize, got.len(), "seed {seed}");
    assert_eq!(sb.rnr_events, 0, "seed {seed}");
    assert!(
        lost > 0 && dups > 0 && sa.faults_reordered > 0,
        "seed {seed}: {sa:?}"
    );
    assert_eq!(
        (sa.retransmits, sb.duplicates_dropped),
        (0, 0),
        "seed {seed}"
    );
}

/// Several SRD senders to one receiver under every fault; returns nothing, asserts everything.
#[test]
fn srd_exactly_once_any_order_under_faults() {
    let seed = test_seed();
    let faults = FaultConfig::seeded(seed)
        .drop(0.1)
        .duplicate(0.1)
        .reorder(0.1)
        .delay(0.02, Duration::from_micros(300));
    let net = LoopbackNetwork::new(faults);
    let mtu = LoopbackConfig::default().mtu;
    let devs: Vec<_> = (0..3).map(|_| open(&net)).collect();
    let mut rx = qp(&devs[0], QpType::Srd, |a| a.recv_depth = 256);
    let mut senders: Vec<Qp> = (0..4)
        .map(|i| {
            qp(&devs[i % 3], QpType::Srd, |a| {
                a.send_depth = 64;
                a.rnr_retry = 7;
            })
        })
        .collect();
    for i in 0..256 {
        rx.post_recv(i, BytesMut::with_capacity(mtu)).unwrap();
    }
    let total = 4000u32;
    let mut rng = Rng::new(seed);
    let mut next_id = 0u32;
    let mut sent_order = Vec::new();
    let mut sizes = HashMap::new();
    let mut send_done: HashMap<u64, Status> = HashMap::new();
    let mut recv_order = Vec::new();
    let mut next_buf = 256u64;
    let t0 = Instant::now();
    let mut comps = Vec::new();
    while send_done.len() < total as usize || recv_order.len() < total as usize {
        assert!(
            t0.elapsed() < DEADLINE,
            "seed {seed}: stuck at {} sends, {} receives",
            send_done.len(),
            recv_order.len()
        );
        for s in senders.iter_mut() {
            // A few posts per sender per round, until the queue is full.
            for _ in 0..3 {
                if next_id == total {
                    break;
                }
                let len = rng.below(mtu as u64 + 1) as usize;
                let split = rng.below(len as u64 + 1) as usize;
                let wr = send_wr(
                    u64::from(next_id),
                    rx.addr(),
                    &payload(next_id, len),
                    split,
                    Some(next_id),
                );
                match s.post_send(wr) {
                    Ok(()) => {
                        sent_order.push(next_id);
                        sizes.insert(next_id, len);
                        next_id += 1;
                    }
                    Err(e) if e.kind() == ErrorKind::Again => break,
                    Err(e) => panic!("seed {seed}: {e}"),
                }
            }
            comps.clear();
            s.poll(&mut comps, 64);
            for c in comps.drain(..) {
                assert_eq!(c.opcode, Opcode::Send, "seed {seed}");
                assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
                assert!(
                    send_done.insert(c.wr_id, c.status).is_none(),
                    "seed {seed}: send {} completed twice",
                    c.wr_id
                );
            }
        }
        rx.poll(&mut comps, 256);
        for c in comps.drain(..) {
            assert_eq!(
                (c.opcode, c.status),
                (Opcode::Recv, Status::Success),
                "seed {seed}: {c:?}"
            );
            let id = c.imm.unwrap();
            let buf = c.buf.unwrap();
            assert_eq!(c.byte_len, sizes[&id], "seed {seed}: id {id}");
            assert!(
                buf[..] == payload(id, sizes[&id])[..],
                "seed {seed}: id {id} corrupted"
            );
            recv_order.push(id);
            rx.post_recv(next_buf, buf).unwrap();
            next_buf += 1;
        }
    }
    let mut seen = vec![false; total as usize];
    for &id in &recv_order {
        assert!(
            !std::mem::replace(&mut seen[id as usize], true),
            "seed {seed}: {id} delivered twice"
        );
    }
    assert_ne!(
        recv_order, sent_order,
        "seed {seed}: no reordering happened"
    );
    // Nothing more comes.
    net.pump();
    assert!(poll_all(&mut rx).is_empty(), "seed {seed}");
    for s in senders.iter_mut() {
        assert!(poll_all(s).is_empty(), "seed {seed}");
    }
    assert_eq!(net.in_flight(), 0, "seed {seed}");
    let mut sum = efa::DeviceStats::default();
    for d in &devs {
        sum += d.stats();
    }
    assert_eq!(sum.rx_pkts, u64::from(total), "seed {seed}");
    assert_eq!(sum.tx_pkts, u64::from(total), "seed {seed}");
    assert_eq!(sum.faults_dropped, sum.retransmits, "seed {seed}");
    assert_eq!(sum.faults_duplicated, sum.duplicates_dropped, "seed {seed}");
    assert!(
        sum.faults_dropped > 0 && sum.faults_duplicated > 0 && sum.faults_reordered > 0,
        "seed {seed}: {sum:?}"
    );
    assert_eq!(sum.send_errors, 0, "seed {seed}");
}

#[test]
fn srd_exactly_once_from_many_threads() {
    let seed = test_seed();
    let net = LoopbackNetwork::new(
        FaultConfig::seeded(seed)
            .drop(0.1)
            .duplicate(0.1)
            .reorder(0.1),
    );
    let rx_dev = open(&net);
    let mut rx = qp(&rx_dev, QpType::Srd, |a| a.recv_depth = 512);
    for i in 0..512 {
        rx.post_recv(i, BytesMut::with_capacity(64)).unwrap();
    }
    let dest = rx.addr();
    let (threads, per) = (4u32, 500u32);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let net = net.clone();
            std::thread::spawn(move || {
                let dev = open(&net);
                let mut q = qp(&dev, QpType::Srd, |a| {
                    a.send_depth = 32;
                    a.rnr_retry = 7;
                });
                let mut done = 0;
                let mut i = 0;
                let t0 = Instant::now();
                let mut v = Vec::new();
                while done < per {
                    assert!(t0.elapsed() < DEADLINE, "seed {seed}: thread {t} stuck");
                    if i < per {
                        let id = t * per + i;
                        match q.post_send(send_wr(
                            u64::from(id),
                            dest,
                            &payload(id, 32),
                            8,
                            Some(id),
                        )) {
                            Ok(()) => i += 1,
                            Err(e) => assert_eq!(e.kind(), ErrorKind::Again),
                        }
                    }
                    v.clear();
                    q.poll(&mut v, 32);
                    for c in &v {
                        assert_eq!(c.status, Status::Success, "seed {seed}");
                        done += 1;
                    }
                }
            })
        })
        .collect();
    let mut seen = vec![false; (threads * per) as usize];
    let mut got = 0;
    let t0 = Instant::now();
    let mut v = Vec::new();
    while got < threads * per {
        assert!(
            t0.elapsed() < DEADLINE,
            "seed {seed}: receiver stuck at {got}"
        );
        v.clear();
        rx.poll(&mut v, 64);
        for c in v.drain(..) {
            let id = c.imm.unwrap();
            assert_eq!(
                &c.buf.as_ref().unwrap()[..],
                &payload(id, 32)[..],
                "seed {seed}"
            );
            assert!(
                !std::mem::replace(&mut seen[id as usize], true),
                "seed {seed}: {id} twice"
            );
            got += 1;
            rx.post_recv(u64::from(id), c.buf.unwrap()).unwrap();
        }
        std::thread::yield_now();
    }
    for h in handles {
        h.join().unwrap();
    }
}

/// One single-threaded run on the manual clock, with every fault: the sequence of deliveries
/// (receiver, id) and of send completions.
fn replay_run(seed: u64) -> Vec<(u8, u32)> {
    let faults = FaultConfig::seeded(seed)
        .drop(0.1)
        .duplicate(0.1)
        .reorder(0.2)
        .delay(0.1, Duration::from_micros(500));
    let net = LoopbackNetwork::with_manual_clock(faults);
    let (da, db) = (open(&net), open(&net));
    let mut s_srd = qp(&da, QpType::Srd, |a| a.rnr_retry = 7);
    let mut s_ud = qp(&da, QpType::Ud, |_| {});
    let mut r_srd = qp(&db, QpType::Srd, |a| a.recv_depth = 32);
    let mut r_ud = qp(&db, QpType::Ud, |a| a.recv_depth = 1024);
    for i in 0..32 {
        r_srd.post_recv(i, BytesMut::with_capacity(64)).unwrap();
    }
    for i in 0..1024 {
        r_ud.post_recv(i, BytesMut::with_capacity(64)).unwrap();
    }
    let n = 400u32;
    let mut log = Vec::new();
    let (mut srd_rx, mut srd_tx, mut id) = (0, 0, 0u32);
    let mut v = Vec::new();
    let mut rounds = 0;
    while srd_rx < n || srd_tx < n {
        rounds += 1;
        assert!(rounds < 1_000_000, "seed {seed}: replay run stuck");
        if id < n
            && s_srd
                .post_send(send_wr(
                    id.into(),
                    r_srd.addr(),
                    &payload(id, 20),
                    3,
                    Some(id),
                ))
                .is_ok()
        {
            s_ud.post_send(send_wr(
                id.into(),
                r_ud.addr(),
                &payload(id, 20),
                3,
                Some(id),
            ))
            .unwrap();
            id += 1;
        }
        net.advance(Duration::from_micros(20)).unwrap();
        v.clear();
        s_srd.poll(&mut v, 8);
        srd_tx += v.len() as u32;
        for c in v.drain(..) {
            assert!(c.status.is_ok(), "seed {seed}: {c:?}");
            log.push((0, c.wr_id as u32));
        }
        s_ud.poll(&mut v, 8);
        for c in v.drain(..) {
            assert!(c.status.is_ok(), "seed {seed}: {c:?}");
            log.push((3, c.wr_id as u32));
        }
        v.clear();
        r_srd.poll(&mut v, 4);
        for c in v.drain(..) {
            log.push((1, c.imm.unwrap()));
            srd_rx += 1;
            r_srd.post_recv(0, c.buf.unwrap()).unwrap();
        }
        r_ud.poll(&mut v, 4);
        for c in v.drain(..) {
            log.push((2, c.imm.unwrap()));
            r_ud.post_recv(0, c.buf.unwrap()).unwrap();
        }
    }
    log
}

#[test]
fn replay_same_seed_same_sequence() {
    let seed = test_seed();
    let a = replay_run(seed);
    let b = replay_run(seed);
    assert_eq!(a, b, "seed {seed}: two runs differ");
    let c = replay_run(seed.wrapping_add(1));
    assert_ne!(
        a,
        c,
        "seeds {seed} and {} gave the same sequence",
        seed.wrapping_add(1)
    );
}

#[test]
fn replay_on_the_real_clock_without_delays() {
    let seed = test_seed();
    let run = |seed: u64| {
        let net = LoopbackNetwork::new(
            FaultConfig::seeded(seed)
                .drop(0.2)
                .duplicate(0.2)
                .reorder(0.3),
        );
        let dev = open(&net);
        let mut s = qp(&dev, QpType::Srd, |a| a.send_depth = 1024);
        let mut r = qp(&dev, QpType::Srd, |a| a.recv_depth = 1024);
        for i in 0..1024 {
            r.post_recv(i, BytesMut::with_capacity(8)).unwrap();
        }
        for id in 0..1000u32 {
            s.post_send(send_wr(id.into(), r.addr(), &id.to_le_bytes(), 0, Some(id)))
                .unwrap();
        }
        let got = poll_n(
            &net,
            &mut r,
            1000,
            &format!("real-clock replay, seed {seed}"),
        );
        got.iter().map(|c| c.imm.unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(run(seed), run(seed), "seed {seed}");
}

#[test]
fn rnr_retry_exceeded_without_a_receive_buffer() {
    for rnr_retry in 0..=2u8 {
        let net = LoopbackNetwork::with_manual_clock(FaultConfig::default());
        let cfg = LoopbackConfig::default();
        let interval = cfg.rnr_retry_interval;
        let (da, db) = (open(&net), open(&net));
        let mut a = qp(&da, QpType::Srd, |a| a.rnr_retry = rnr_retry);
        let mut b = qp(&db, QpType::Srd, |_| {});
        a.post_send(send_wr(5, b.addr(), b"hello", 0, None))
            .unwrap();
        // Each retry happens one interval after the previous refusal.
        for _ in 0..rnr_retry {
            assert!(
                poll_all(&mut a).is_empty(),
                "rnr_retry {rnr_retry}: completed too early"
            );
            net.advance(interval).unwrap();
        }
        let c = poll_all(&mut a);
        assert_eq!(c.len(), 1, "rnr_retry {rnr_retry}");
        assert_eq!((c[0].wr_id, c[0].status), (5, Status::RnrRetryExceeded));
        assert_eq!(c[0].status.error_kind(), ErrorKind::NoRx);
        // Nothing is delivered afterwards.
        b.post_recv(1, BytesMut::with_capacity(16)).unwrap();
        net.advance(interval * 10).unwrap();
        net.pump();
        assert!(poll_all(&mut b).is_empty());
        assert_eq!(db.stats().rnr_events, u64::from(rnr_retry) + 1);
        assert_eq!(da.stats().rnr_naks_received, u64::from(rnr_retry) + 1);
        assert_eq!(da.stats().send_errors, 1);
        assert_eq!(net.in_flight(), 0);
    }
    // The same on the real clock.
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Srd, |a| a.rnr_retry = 2);
    let b = qp(&dev, QpType::Srd, |_| {});
    a.post_send(send_wr(1, b.addr(), b"x", 0, None)).unwrap();
    let c = poll_n(&net, &mut a, 1, "real-clock rnr");
    assert_eq!(c[0].status, Status::RnrRetryExceeded);
}

#[test]
fn rnr_retry_forever_delivers_once_when_a_buffer_comes() {
    let net = LoopbackNetwork::with_manual_clock(FaultConfig::default());
    let interval = LoopbackConfig::default().rnr_retry_interval;
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Srd, |a| a.rnr_retry = 7);
    let mut b = qp(&dev, QpType::Srd, |_| {});
    a.post_send(send_wr(9, b.addr(), b"late", 2, Some(1)))
        .unwrap();
    for _ in 0..100 {
        net.advance(interval).unwrap();
        assert!(poll_all(&mut a).is_empty());
        assert!(poll_all(&mut b).is_empty());
    }
    assert_eq!(net.in_flight(), 1);
    b.post_recv(2, BytesMut::with_capacity(16)).unwrap();
    b.post_recv(3, BytesMut::with_capacity(16)).unwrap();
    net.advance(interval).unwrap();
    let r = poll_all(&mut b);
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].wr_id, r[0].status, &r[0].buf.as_ref().unwrap()[..]),
        (2, Status::Success, &b"late"[..])
    );
    let s = poll_all(&mut a);
    assert_eq!((s.len(), s[0].status), (1, Status::Success));
    for _ in 0..10 {
        net.advance(interval).unwrap();
        net.pump();
    }
    assert!(poll_all(&mut b).is_empty(), "delivered more than once");
    assert_eq!(dev.stats().rnr_events, 101);

    // The real clock, receiver posted later from another thread.
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Srd, |a| a.rnr_retry = 7);
    let mut b = qp(&dev, QpType::Srd, |_| {});
    a.post_send(send_wr(1, b.addr(), b"x", 0, None)).unwrap();
    let h = {
        let net = net.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            b.post_recv(1, BytesMut::with_capacity(4)).unwrap();
            poll_n(&net, &mut b, 1, "late receiver").len()
        })
    };
    let c = poll_n(&net, &mut a, 1, "rnr forever");
    assert_eq!(c[0].status, Status::Success);
    assert_eq!(h.join().unwrap(), 1);
}

#[test]
fn ud_without_a_receive_buffer_drops_and_counts() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Ud, |_| {});
    let mut b = qp(&dev, QpType::Ud, |_| {});
    a.post_send(send_wr(1, b.addr(), b"gone", 0, None)).unwrap();
    let s = poll_all(&mut a);
    assert_eq!(s[0].status, Status::Success);
    b.post_recv(1, BytesMut::with_capacity(16)).unwrap();
    net.pump();
    assert!(poll_all(&mut b).is_empty());
    assert_eq!(dev.stats().rnr_events, 1);
}

#[test]
fn close_flushes_and_later_posts_fail() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Srd, |a| a.rnr_retry = 7);
    let mut b = qp(&dev, QpType::Srd, |_| {});
    a.post_send(send_wr(1, b.addr(), b"one", 0, None)).unwrap();
    a.post_send(send_wr(2, b.addr(), b"two", 0, None)).unwrap();
    for i in 0..3 {
        a.post_recv(10 + i, BytesMut::with_capacity(100 + i as usize))
            .unwrap();
    }
    assert_eq!(net.in_flight(), 2);
    a.close();
    assert_eq!(
        net.in_flight(),
        0,
        "the closed sender's datagrams stay in flight"
    );
    let mut c = poll_all(&mut a);
    assert_eq!(c.len(), 5);
    assert!(c.iter().all(|c| c.status == Status::Flushed));
    c.sort_by_key(|c| c.wr_id);
    assert_eq!(
        c.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        [1, 2, 10, 11, 12]
    );
    assert!(
        c[..2]
            .iter()
            .all(|c| c.opcode == Opcode::Send && c.buf.is_none())
    );
    for (i, c) in c[2..].iter().enumerate() {
        assert_eq!(c.opcode, Opcode::Recv);
        assert_eq!(c.buf.as_ref().unwrap().capacity(), 100 + i);
    }
    assert_eq!(
        a.post_send(send_wr(3, b.addr(), b"", 0, None))
            .unwrap_err()
            .kind(),
        ErrorKind::Closed
    );
    assert_eq!(
        a.post_recv(3, BytesMut::new()).unwrap_err().kind(),
        ErrorKind::Closed
    );
    a.close(); // twice is fine
    assert!(poll_all(&mut a).is_empty());
    // Nothing of the closed sender reaches b.
    b.post_recv(1, BytesMut::with_capacity(8)).unwrap();
    net.pump();
    assert!(poll_all(&mut b).is_empty());
    // b's own close hands back its buffer.
    b.close();
    let c = poll_all(&mut b);
    assert_eq!(
        (
            c.len(),
            c[0].status,
            c[0].buf.as_ref().map(|b| b.capacity())
        ),
        (1, Status::Flushed, Some(8))
    );
}

#[test]
fn srd_to_a_gone_queue_pair_is_unresponsive() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let fast = LoopbackConfig::default().with_unresponsive_timeout(Duration::ZERO);
    let dev = LoopbackDevice::open(&net, fast.clone()).unwrap();
    let mut a = qp(&dev, QpType::Srd, |a| a.rnr_retry = 7);
    let mut b = qp(&dev, QpType::Srd, |_| {});
    let gone = b.addr();
    b.close();
    a.post_send(send_wr(1, gone, b"x", 0, None)).unwrap();
    let c = poll_all(&mut a);
    assert_eq!(c[0].status, Status::UnresponsiveRemote);
    assert_eq!(c[0].status.error_kind(), ErrorKind::ConnectionAborted);
    // Dropping a queue pair is closing it.
    let c2 = qp(&dev, QpType::Srd, |_| {});
    let gone = c2.addr();
    drop(c2);
    a.post_send(send_wr(2, gone, b"x", 0, None)).unwrap();
    assert_eq!(poll_all(&mut a)[0].status, Status::UnresponsiveRemote);
    // An unknown device is unreachable.
    let mut nowhere = a.addr();
    nowhere.gid.0[15] ^= 0xff;
    a.post_send(send_wr(3, nowhere, b"x", 0, None)).unwrap();
    assert_eq!(poll_all(&mut a)[0].status, Status::UnreachableRemote);
    // A destination that closes while the send waits for a buffer (RNR) becomes unresponsive.
    let mut d = qp(&dev, QpType::Srd, |_| {});
    a.post_send(send_wr(4, d.addr(), b"x", 0, None)).unwrap();
    d.close();
    let c = poll_n(&net, &mut a, 1, "rnr then close");
    assert_eq!((c[0].wr_id, c[0].status), (4, Status::UnresponsiveRemote));
    // UD to a gone queue pair is silently lost.
    let mut u = qp(&dev, QpType::Ud, |_| {});
    let v = qp(&dev, QpType::Ud, |_| {});
    let gone = v.addr();
    drop(v);
    u.post_send(send_wr(1, gone, b"x", 0, None)).unwrap();
    assert_eq!(poll_all(&mut u)[0].status, Status::Success);
    assert_eq!(dev.stats().send_errors, 4);
}

#[test]
fn unresponsive_timeout_on_the_manual_clock() {
    let net = LoopbackNetwork::with_manual_clock(FaultConfig::default());
    let timeout = LoopbackConfig::default().unresponsive_timeout;
    let dev = open(&net);
    let mut a = qp(&dev, QpType::Srd, |_| {});
    let b = qp(&dev, QpType::Srd, |_| {});
    let gone = b.addr();
    drop(b);
    a.post_send(send_wr(1, gone, b"x", 0, None)).unwrap();
    net.advance(timeout - Duration::from_nanos(1)).unwrap();
    assert!(poll_all(&mut a).is_empty());
    net.advance(Duration::from_nanos(1)).unwrap();
    assert_eq!(poll_all(&mut a)[0].status, Status::UnresponsiveRemote);
    // Closing the sender flushes a send still waiting for its timeout.
    a.post_send(send_wr(2, gone, b"x", 0, None)).unwrap();
    a.close();
    let c = poll_all(&mut a);
    assert_eq!((c.len(), c[0].wr_id, c[0].status), (1, 2, Status::Flushed));
}

#[test]
fn qpns_are_unique_and_reused_only_after_wrapping_with_a_new_qkey() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = open(&net);
    let first = qp(&dev, QpType::Ud, |_| {});
    let keep = qp(&dev, QpType::Srd, |_| {});
    assert_ne!(first.addr().qpn, keep.addr().qpn);
    assert_ne!(first.addr().qpn, 0);
    let (qpn1, qkey1) = (first.addr().qpn, first.addr().qkey);
    drop(first);
    let next = qp(&dev, QpType::Ud, |_| {});
    assert_ne!(
        next.addr().qpn,
        qpn1,
        "a freed QPN was reused before wrapping"
    );
    drop(next);
    // Go round the whole QPN space.
    let mut reused = None;
    for _ in 0..u16::MAX {
        let q = qp(&dev, QpType::Ud, |_| {});
        assert_ne!(
            q.addr().qpn,
            keep.addr().qpn,
            "a live QPN was handed out twice"
        );
        assert_ne!(q.addr().qpn, 0);
        if q.addr().qpn == qpn1 {
            reused = Some(q.addr().qkey);
            break;
        }
    }
    let qkey2 = reused.expect("QPN never reused after wrapping");
    assert_ne!(qkey2, qkey1, "a reused QPN kept its QKEY");
    // A requested QKEY is honoured.
    let q = qp(&dev, QpType::Srd, |a| a.qkey = Some(0x1234));
    assert_eq!(q.addr().qkey, 0x1234);
}
