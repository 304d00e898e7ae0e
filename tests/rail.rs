//! Multi-rail groups (`efa::rail`) on the software devices: several loopback or udp domains
//! stand in for several NICs. Striped writes, reads and messages of many sizes arrive intact
//! and complete exactly once; messages keep their order; a rail whose peer goes away mid-run
//! moves its stripes to the other rails, and with no rail left every operation fails once with
//! a clear error. Randomised tests print their seed (`EFA_TEST_SEED` replays one).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::fault::{Rng, test_seed};
use efa::rail::{RailAddr, RailCompletion, RailGroup, RailOp, RailPeer, RailRemoteKey};
use efa::{Access, AddressVector, CompletionQueue, Config, Domain, Endpoint, ErrorKind, Rdm};

const DEADLINE: Duration = Duration::from_secs(60);
const MIN_STRIPE: usize = 16 << 10;

fn loopback_domains(net: &LoopbackNetwork, n: usize, cfg: &LoopbackConfig) -> Vec<Domain> {
    (0..n)
        .map(|_| {
            Domain::with_device(
                LoopbackDevice::open(net, cfg.clone()).unwrap(),
                Config::default(),
            )
        })
        .collect()
}

fn udp_domains(n: usize) -> Vec<Domain> {
    (0..n)
        .map(|_| {
            let cfg = UdpConfig::default().with_bind(IpAddr::V4(Ipv4Addr::LOCALHOST));
            Domain::with_device(UdpDevice::open(cfg).unwrap(), Config::default())
        })
        .collect()
}

/// Two groups that know each other: `a` reaches `b` as `to_b`, `b` reaches `a` as `to_a`.
struct Pair {
    a: RailGroup,
    b: RailGroup,
    to_b: RailPeer,
    to_a: RailPeer,
}

fn pair(da: Vec<Domain>, db: Vec<Domain>) -> Pair {
    let build = |d| {
        RailGroup::builder(d)
            .min_stripe(MIN_STRIPE)
            .build()
            .unwrap()
    };
    let (a, b) = (build(da), build(db));
    // Through the byte form, as two processes would.
    let to_b = a
        .insert(&RailAddr::from_bytes(&b.addr().to_bytes()).unwrap())
        .unwrap();
    let to_a = b
        .insert(&RailAddr::from_bytes(&a.addr().to_bytes()).unwrap())
        .unwrap();
    Pair { a, b, to_b, to_a }
}

fn loopback_pair(rails: usize, cfg: LoopbackConfig) -> Pair {
    let net = LoopbackNetwork::new(Default::default());
    pair(
        loopback_domains(&net, rails, &cfg),
        loopback_domains(&net, rails, &cfg),
    )
}

/// Completions by context: each context exactly once.
#[derive(Default)]
struct Seen {
    a: HashMap<u64, RailCompletion>,
    b: Vec<RailCompletion>,
}

impl Seen {
    fn add_a(&mut self, c: RailCompletion) {
        let ctx = c.context;
        if let Some(old) = self.a.insert(ctx, c) {
            panic!(
                "context {ctx} completed twice: {old:?} and {:?}",
                self.a[&ctx]
            );
        }
    }
}

/// Polls both groups until `a` reported `na` completions and `b` `nb`, then a little longer to
/// catch a duplicate.
fn drive(p: &Pair, na: usize, nb: usize) -> Seen {
    let mut s = Seen::default();
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    let mut extra = None;
    loop {
        p.a.poll(&mut out, 64).unwrap();
        for c in out.drain(..) {
            s.add_a(c);
        }
        p.b.poll(&mut out, 64).unwrap();
        s.b.append(&mut out);
        if s.a.len() >= na && s.b.len() >= nb {
            let until = *extra.get_or_insert(Instant::now() + Duration::from_millis(50));
            if Instant::now() >= until {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "timed out: a has {}/{na} completions, b {}/{nb}; a: {:?}; b: {:?}",
            s.a.len(),
            s.b.len(),
            p.a.stats(),
            p.b.stats()
        );
    }
    assert_eq!(s.a.len(), na, "a completed more than it posted");
    assert_eq!(s.b.len(), nb, "b completed more than expected: {:?}", s.b);
    s
}

fn pattern(len: usize, salt: u64) -> Bytes {
    let mut r = Rng::new(salt);
    let mut v = vec![0u8; len];
    for chunk in v.chunks_mut(8) {
        let x = r.next_u64().to_le_bytes();
        chunk.copy_from_slice(&x[..chunk.len()]);
    }
    Bytes::from(v)
}

/// The sizes every striped operation is tried with: one byte, around the minimum stripe and
/// twice it, non-multiples, a few MiB.
const SIZES: [usize; 10] = [
    1,
    4095,
    MIN_STRIPE - 1,
    MIN_STRIPE,
    2 * MIN_STRIPE - 1,
    2 * MIN_STRIPE + 3,
    100_000,
    (1 << 20) + 7,
    3 << 20,
    (5 << 20) - 13,
];

fn region_at(p: &Pair, len: usize) -> (efa::rail::RailRegion, RailRemoteKey) {
    let r =
        p.b.register(vec![0u8; len], Access::REMOTE_WRITE | Access::REMOTE_READ)
            .unwrap();
    let rk = r.remote_key().unwrap();
    (r, rk)
}

fn writes_and_reads_of_every_size(p: &Pair) {
    for (i, &len) in SIZES.iter().enumerate() {
        // Written at an odd offset into a larger region: the bytes around stay untouched.
        let (region, rk) = region_at(p, len + 64);
        let data = pattern(len, i as u64);
        p.a.write_data(p.to_b, data.clone(), &rk, 17, i as u32, 1)
            .unwrap();
        let s = drive(p, 1, 1);
        let w = &s.a[&1];
        assert!(w.result.is_ok(), "{len}: {w:?}");
        assert_eq!((w.op, w.len), (RailOp::Write, len));
        assert_eq!(w.buf.as_send(), Some(&data));
        let n = &s.b[0];
        assert_eq!(
            (n.op, n.data, n.len, n.peer),
            (RailOp::RemoteWrite, Some(i as u32), len, Some(p.to_a))
        );
        {
            let m = region.read();
            assert!(
                m[..17].iter().all(|&x| x == 0) && m[17 + len..].iter().all(|&x| x == 0),
                "{len}: outside"
            );
            assert!(m[17..17 + len] == data[..], "{len}: content");
        }
        // Read it back, into a buffer that had other bytes.
        p.a.read(p.to_b, BytesMut::from(&b"old"[..]), len, &rk, 17, 2)
            .unwrap();
        let s = drive(p, 1, 0);
        let r = &s.a[&2];
        assert!(r.result.is_ok(), "{len}: {r:?}");
        assert_eq!((r.op, r.len), (RailOp::Read, len));
        assert!(r.buf.as_recv().unwrap() == &data[..], "{len}: read content");
    }
}

#[test]
fn striped_writes_and_reads_of_every_size_on_loopback_device_rdma() {
    let p = loopback_pair(4, LoopbackConfig::default());
    writes_and_reads_of_every_size(&p);
    let st = p.a.stats();
    assert!(
        st.rails.iter().all(|r| r.bytes > 0 && r.errors == 0),
        "{st:?}"
    );
    assert_eq!((st.completed, st.failed), (2 * SIZES.len() as u64, 0));
}

#[test]
fn striped_writes_and_reads_of_every_size_emulated_rma() {
    // Without device RDMA the protocol engine emulates the RMA (the target's endpoint works).
    let p = loopback_pair(3, LoopbackConfig::default().with_rdma(false));
    writes_and_reads_of_every_size(&p);
}

#[test]
fn striped_writes_and_reads_on_udp_devices() {
    let p = pair(udp_domains(3), udp_domains(3));
    writes_and_reads_of_every_size(&p);
    assert!(p.a.stats().rails.iter().all(|r| r.bytes > 0));
}

#[test]
fn a_64_mib_write_read_and_message_over_four_rails() {
    let p = loopback_pair(4, LoopbackConfig::default());
    let len = 64 << 20;
    let data = pattern(len, 64);
    let (region, rk) = region_at(&p, len);
    p.a.write(p.to_b, data.clone(), &rk, 0, 1).unwrap();
    let s = drive(&p, 1, 0);
    assert!(s.a[&1].result.is_ok(), "{:?}", s.a[&1]);
    assert!(region.read()[..] == data[..]);
    p.a.read(p.to_b, BytesMut::new(), len, &rk, 0, 2).unwrap();
    p.b.recv(BytesMut::with_capacity(len), 3).unwrap();
    p.a.send(p.to_b, data.clone(), 4).unwrap();
    let s = drive(&p, 2, 1);
    assert!(s.a[&2].buf.as_recv().unwrap() == &data[..]);
    assert!(s.a[&4].result.is_ok());
    assert_eq!((s.b[0].context, s.b[0].len), (3, len));
    assert!(s.b[0].buf.as_recv().unwrap() == &data[..]);
    // Every rail carried a share of each transfer (16 stripes over 4 rails).
    let st = p.a.stats();
    assert!(
        st.rails.iter().all(|r| r.bytes >= (len as u64) / 4),
        "{st:?}"
    );
    assert_eq!(st.bytes(), 3 * len as u64);
}

#[test]
fn messages_of_random_sizes_arrive_once_in_order() {
    let seed = test_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let p = loopback_pair(3, LoopbackConfig::default());
    let n = 60;
    let sizes: Vec<usize> = (0..n)
        .map(|_| match rng.below(4) {
            0 => rng.below(64) as usize,
            1 => rng.below(9000) as usize,
            2 => 1 + rng.below(200_000) as usize,
            _ => 1 + rng.below(1 << 20) as usize,
        })
        .collect();
    // Receives posted partly before and partly after the messages: both orders meet.
    for (i, _) in sizes.iter().enumerate().take(n / 2) {
        p.b.recv(BytesMut::with_capacity(1 << 20), 1000 + i as u64)
            .unwrap();
    }
    for (i, &len) in sizes.iter().enumerate() {
        p.a.send(p.to_b, pattern(len, i as u64), i as u64).unwrap();
    }
    let mut out = Vec::new();
    for _ in 0..20 {
        p.a.poll(&mut out, 64).unwrap();
    }
    for i in n / 2..n {
        p.b.recv(BytesMut::with_capacity(1 << 20), 1000 + i as u64)
            .unwrap();
    }
    let mut s = drive(&p, n - out.len(), n);
    for c in out {
        s.add_a(c);
    }
    for i in 0..n as u64 {
        assert!(s.a[&i].result.is_ok(), "seed {seed}: {:?}", s.a[&i]);
    }
    // The i-th receive got the i-th message, and they completed in that order.
    for (i, c) in s.b.iter().enumerate() {
        assert_eq!(c.context, 1000 + i as u64, "seed {seed}: order");
        assert!(c.result.is_ok(), "seed {seed}: {c:?}");
        assert_eq!(c.peer, Some(p.to_a));
        assert!(
            c.buf.as_recv().unwrap() == &pattern(sizes[i], i as u64)[..],
            "seed {seed}: message {i}"
        );
    }
}

#[test]
fn notifications_and_messages_keep_their_order_and_truncation_is_reported() {
    let p = loopback_pair(2, LoopbackConfig::default());
    let (region, rk) = region_at(&p, 1 << 20);
    let big = pattern(1 << 20, 9);
    p.a.write_data(p.to_b, big.clone(), &rk, 0, 7, 1).unwrap();
    p.a.send(p.to_b, Bytes::from_static(b"after the write"), 2)
        .unwrap();
    p.a.send(p.to_b, pattern(100_000, 3), 3).unwrap();
    p.b.recv(BytesMut::with_capacity(64), 10).unwrap();
    p.b.recv(BytesMut::with_capacity(50_000), 11).unwrap();
    let s = drive(&p, 3, 3);
    assert!(
        s.a.values().all(|c| c.result.is_ok()),
        "the sender's side succeeds"
    );
    assert_eq!(s.b[0].op, RailOp::RemoteWrite);
    assert!(region.read()[..] == big[..]);
    assert_eq!(s.b[1].buf.as_recv(), Some(&b"after the write"[..]));
    let t = &s.b[2];
    assert_eq!(
        t.result.as_ref().unwrap_err().kind(),
        ErrorKind::Truncated,
        "{t:?}"
    );
    assert!(t.buf.as_recv().unwrap() == &pattern(100_000, 3)[..50_000]);
}

#[test]
fn bad_input_is_refused_with_the_buffer_back() {
    let p = loopback_pair(2, LoopbackConfig::default());
    let (_region, rk) = region_at(&p, 4096);
    let data = Bytes::from_static(b"0123456789");
    let e = p.a.write(p.to_b, data.clone(), &rk, 4090, 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.buf.as_send(), Some(&data));
    let short = RailRemoteKey {
        keys: rk.keys[..1].to_vec(),
        ..rk.clone()
    };
    assert_eq!(
        p.a.write(p.to_b, data.clone(), &short, 0, 1)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let e =
        p.a.read(p.to_b, BytesMut::with_capacity(8), 8, &rk, u64::MAX, 1)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.buf.as_recv().is_some());
    // A peer id that was never inserted here (another group's second peer).
    let other = loopback_pair(1, LoopbackConfig::default());
    let never = other.a.insert(&other.b.addr()).unwrap();
    assert_eq!(never.index(), 1);
    assert_eq!(
        p.a.send(never, data.clone(), 1).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert!(RailAddr::from_bytes(b"RA1\x02short").is_err());
    assert!(RailRemoteKey::from_bytes(&[0u8; 3]).is_err());
    assert!(RailGroup::builder(Vec::new()).build().is_err());
    let net = LoopbackNetwork::new(Default::default());
    let d = loopback_domains(&net, 1, &LoopbackConfig::default());
    assert!(RailGroup::builder(d).min_stripe(0).build().is_err());
    // Nothing was posted, nothing completes.
    let s = drive(&p, 0, 0);
    assert!(s.a.is_empty());
}

#[test]
fn control_messages_from_strangers_and_garbage_are_dropped() {
    let net = LoopbackNetwork::new(Default::default());
    let p = pair(
        loopback_domains(&net, 2, &LoopbackConfig::default()),
        loopback_domains(&net, 2, &LoopbackConfig::default()),
    );
    // A plain endpoint that is no inserted peer, and an inserted peer's raw endpoint sending
    // garbage, both to b's rail 0.
    let d = loopback_domains(&net, 1, &LoopbackConfig::default()).remove(0);
    let cq = CompletionQueue::new(&d, 64).unwrap();
    let av = AddressVector::new(&d);
    let ep = Endpoint::<Rdm>::builder(&d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let to_b0 = av.insert(p.b.addr().addrs()[0]).unwrap();
    ep.send(
        to_b0,
        Bytes::from_static(b"RL\x01\x01\0\0\0\0\0\0\0\0hello"),
        1,
    )
    .unwrap();
    ep.send(to_b0, Bytes::from_static(b"garbage"), 2).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while p.b.stats().ctrl_dropped < 2 {
        cq.poll(&mut got, 8).unwrap();
        p.b.poll(&mut Vec::new(), 8).unwrap();
        assert!(Instant::now() < deadline, "{:?}", p.b.stats());
    }
    p.b.recv(BytesMut::with_capacity(64), 5).unwrap();
    let s = drive(&p, 0, 0);
    assert!(s.b.is_empty(), "nothing from a stranger is delivered");
}

/// A seeded mix of striped writes (some with data), reads and sends from a to b; returns
/// what each should produce.
struct Mix {
    region: efa::rail::RailRegion,
    /// Context -> (kind, data) of a's operations.
    ops: Vec<(u64, RailOp, Bytes, u64)>,
    recvs: usize,
    notes: usize,
}

const SLOT: usize = 1 << 20;

/// One striped write over every rail, so that each rail's endpoints have met (the protocol
/// engine's handshake, which device RDMA waits for: an endpoint that dies during it leaves the
/// operations behind it waiting, as on a plain endpoint; see docs/multi-nic.md).
fn warm_up(p: &Pair) {
    let (_r, rk) = region_at(p, 1 << 20);
    p.a.write(p.to_b, pattern(1 << 20, 0), &rk, 0, 99).unwrap();
    let s = drive(p, 1, 0);
    assert!(s.a[&99].result.is_ok());
    assert!(p.a.stats().rails.iter().all(|r| r.bytes > 0));
}

fn post_mix(p: &Pair, rng: &mut Rng, n: usize) -> Mix {
    let (mut region, rk) = region_at(p, n * SLOT);
    let mut ops = Vec::new();
    let (mut recvs, mut notes) = (0, 0);
    for i in 0..n {
        let len = 1 + rng.below(SLOT as u64) as usize;
        let data = pattern(len, rng.next_u64());
        let off = (i * SLOT) as u64;
        let ctx = i as u64;
        match rng.below(4) {
            0 => {
                p.a.write(p.to_b, data.clone(), &rk, off, ctx).unwrap();
                ops.push((ctx, RailOp::Write, data, off));
            }
            1 => {
                p.a.write_data(p.to_b, data.clone(), &rk, off, i as u32, ctx)
                    .unwrap();
                notes += 1;
                ops.push((ctx, RailOp::Write, data, off));
            }
            2 => {
                p.b.recv(BytesMut::with_capacity(SLOT), 1000 + ctx).unwrap();
                p.a.send(p.to_b, data.clone(), ctx).unwrap();
                recvs += 1;
                ops.push((ctx, RailOp::Send, data, off));
            }
            _ => {
                // b's own bytes in this slot, which a reads (no write goes there).
                region.write()[i * SLOT..i * SLOT + len].copy_from_slice(&data);
                p.a.read(p.to_b, BytesMut::new(), data.len(), &rk, off, ctx)
                    .unwrap();
                ops.push((ctx, RailOp::Read, data, off));
            }
        }
    }
    Mix {
        region,
        ops,
        recvs,
        notes,
    }
}

/// Checks every outcome of a mix: each operation once, intact when it succeeded; `failed`
/// says how many may have failed (with a rail error).
fn check_mix(seed: u64, m: &Mix, s: &Seen, allow_fail: bool) -> usize {
    let mut failed = 0;
    let mut rx = s.b.iter().filter(|c| c.op == RailOp::Recv);
    for (ctx, kind, data, off) in &m.ops {
        let c = &s.a[ctx];
        assert_eq!(c.op, *kind, "seed {seed}");
        match &c.result {
            Err(e) => {
                assert!(allow_fail, "seed {seed}: {c:?}");
                assert!(
                    matches!(
                        e.kind(),
                        ErrorKind::ConnectionAborted
                            | ErrorKind::Unreachable
                            | ErrorKind::NotConnected
                            | ErrorKind::Canceled
                            | ErrorKind::PeerAborted
                    ),
                    "seed {seed}: a clear rail error, not {e}"
                );
                failed += 1;
            }
            Ok(()) => match kind {
                RailOp::Write => {
                    let at = *off as usize;
                    assert!(
                        m.region.read()[at..at + data.len()] == data[..],
                        "seed {seed}: write {ctx} content"
                    );
                }
                RailOp::Read => {
                    assert!(
                        c.buf.as_recv().unwrap() == &data[..],
                        "seed {seed}: read {ctx} content"
                    );
                }
                RailOp::Send => {
                    let r = rx.next().expect("a receive per successful send");
                    assert!(
                        r.result.is_ok() && r.buf.as_recv().unwrap() == &data[..],
                        "seed {seed}: send {ctx}: {r:?}"
                    );
                }
                _ => unreachable!(),
            },
        }
    }
    failed
}

#[test]
fn a_rail_whose_peer_goes_away_mid_run_moves_its_stripes_and_everything_completes_once() {
    let seed = test_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    // The unresponsive-peer timeout is what a sender waits before its stripes to the closed
    // endpoint fail; short, so the test is quick.
    let cfg = LoopbackConfig::default().with_unresponsive_timeout(Duration::from_millis(200));
    let p = loopback_pair(4, cfg);
    warm_up(&p);
    let n = 24;
    let m = post_mix(&p, &mut rng, n);
    // A few passes in, b's rail 2 closes (as if its NIC went away).
    let (mut early, mut early_b) = (Vec::new(), Vec::new());
    for _ in 0..rng.below(4) {
        p.a.poll(&mut early, 64).unwrap();
        p.b.poll(&mut early_b, 64).unwrap();
    }
    p.b.disable_rail(2).unwrap();
    let mut s = drive(&p, n - early.len(), m.recvs + m.notes - early_b.len());
    for c in early {
        s.add_a(c);
    }
    early_b.append(&mut s.b);
    s.b = early_b;
    let failed = check_mix(seed, &m, &s, false);
    assert_eq!(failed, 0);
    let notes: Vec<_> = s.b.iter().filter(|c| c.op == RailOp::RemoteWrite).collect();
    assert_eq!(notes.len(), m.notes, "seed {seed}: each notification once");
    let st = p.a.stats();
    assert!(!p.b.stats().rails[2].enabled);
    println!("{st:?}");
    // Stripes to b's rail 2 were in flight when it closed, or found it closed: they moved.
    assert!(
        st.rails[2].errors > 0 && st.rails[2].moved > 0,
        "seed {seed}: {st:?}"
    );
}

#[test]
fn with_every_rail_of_the_peer_gone_each_operation_fails_once_with_a_clear_error() {
    let seed = test_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let cfg = LoopbackConfig::default().with_unresponsive_timeout(Duration::from_millis(200));
    let p = loopback_pair(3, cfg);
    warm_up(&p);
    let n = 12;
    let m = post_mix(&p, &mut rng, n);
    for r in 0..3 {
        p.b.disable_rail(r).unwrap();
    }
    // b can deliver nothing any more; only a's completions are awaited.
    let mut s = Seen::default();
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while s.a.len() < n {
        p.a.poll(&mut out, 64).unwrap();
        for c in out.drain(..) {
            s.add_a(c);
        }
        p.b.poll(&mut out, 64).unwrap();
        s.b.append(&mut out);
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {} of {n}: {:?}",
            s.a.len(),
            p.a.stats()
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    p.a.poll(&mut out, 64).unwrap();
    assert!(out.is_empty(), "seed {seed}: completed twice: {out:?}");
    let failed = check_mix(seed, &m, &s, true);
    // Writes that had all landed before the rails closed may succeed; the rest fail.
    assert!(failed > 0, "seed {seed}");
    let e = s.a.values().find_map(|c| c.result.as_ref().err()).unwrap();
    assert!(e.to_string().contains("no rail to the peer is left"), "{e}");
}

#[test]
fn a_local_rail_disabled_mid_transfer_hands_its_stripes_to_the_others() {
    let p = loopback_pair(4, LoopbackConfig::default());
    let len = 16 << 20;
    let data = pattern(len, 5);
    let (region, rk) = region_at(&p, len);
    p.a.write(p.to_b, data.clone(), &rk, 0, 1).unwrap();
    p.a.disable_rail(1).unwrap();
    let s = drive(&p, 1, 0);
    assert!(s.a[&1].result.is_ok(), "{:?}", s.a[&1]);
    assert!(region.read()[..] == data[..]);
    let st = p.a.stats();
    assert!(!st.rails[1].enabled);
    // Each byte counted once, and rail 1 took no stripe after it closed (at most the ones it
    // had taken when the write was posted).
    assert_eq!(st.bytes(), len as u64, "{st:?}");
    assert!(st.rails[1].stripes + st.rails[1].moved <= 4, "{st:?}");
}
