//! Device-level tests of the `udp` software device, through the `Device` / `QueuePair` traits.
//!
//! Randomised tests take `test_seed()` (set `EFA_TEST_SEED` to replay) and print it in every
//! assertion message. There are no timing assertions: deadlines only turn a hang into a failure.

#[allow(dead_code)]
#[path = "common/seam.rs"]
mod seam;

use std::collections::HashSet;
use std::net::{IpAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::device::{
    Device, DeviceCompletion, DeviceKind, Opcode, QpType, QueuePair, SendWr, Source, Status,
};
use efa::fault::{FaultConfig, Rng, test_seed};
use efa::notify::Notifier;
use efa::{ErrorKind, RawAddr};
use seam::{attr, poll_for, poll_until, wr};

/// Overall deadline of one wait: generous, only there to fail instead of hanging.
const DEADLINE: Duration = Duration::from_secs(60);

fn v4() -> IpAddr {
    "127.0.0.1".parse().unwrap()
}

fn v6() -> IpAddr {
    "::1".parse().unwrap()
}

fn open(cfg: UdpConfig) -> Arc<UdpDevice> {
    UdpDevice::open(cfg).expect("open udp device")
}

fn qp(dev: &UdpDevice, ty: QpType, n: &Arc<Notifier>) -> Box<dyn QueuePair> {
    dev.create_qp(attr(ty, n)).expect("create qp")
}

/// UD over IPv6: the address and the source of a datagram are the IPv6 ones (the datagram
/// contract itself is `tests/device_contract.rs`).
#[test]
fn ud_ipv6_delivers_with_imm_and_source() {
    let dev = open(UdpConfig::new(v6()));
    let n = Arc::new(Notifier::new());
    let mut a = qp(&dev, QpType::Ud, &n);
    let mut b = qp(&dev, QpType::Ud, &n);
    assert_eq!(a.addr().gid, efa::Gid::from_ip(v6()));
    b.post_recv(1, BytesMut::with_capacity(64)).unwrap();
    a.post_send(wr(2, b.addr(), b"hd", b"six", Some(6)))
        .unwrap();
    let got = poll_until(&mut [&mut a, &mut b], &n, "UD over IPv6", |c| c.len() >= 2);
    let (_, r) = got.iter().find(|(q, _)| *q == 1).expect("received");
    assert_eq!(r.status, Status::Success, "{r:?}");
    assert_eq!(&r.buf.as_ref().unwrap()[..], b"hdsix");
    assert_eq!(r.imm, Some(6));
    let src = a.addr();
    assert_eq!(
        r.src,
        Some(Source {
            gid: src.gid,
            qpn: src.qpn
        })
    );
}

#[test]
fn srd_ipv6_and_unspecified_bind() {
    for bind in ["::1", "0.0.0.0", "::"] {
        let bind: IpAddr = bind.parse().unwrap();
        let dev = open(UdpConfig::new(bind));
        let n = Arc::new(Notifier::new());
        let mut a = qp(&dev, QpType::Srd, &n);
        let mut b = qp(&dev, QpType::Srd, &n);
        b.post_recv(1, BytesMut::with_capacity(64)).unwrap();
        a.post_send(wr(2, b.addr(), b"", b"hello", None)).unwrap();
        let got = poll_until(&mut [&mut a, &mut b], &n, "SRD datagram", |c| c.len() >= 2);
        for (_, c) in &got {
            assert_eq!(c.status, Status::Success, "{bind}: {c:?}");
        }
        let r = got.iter().find(|(q, _)| *q == 1).unwrap();
        assert_eq!(&r.1.buf.as_ref().unwrap()[..], b"hello", "{bind}");
        assert_eq!(r.1.src.unwrap().qpn, a.addr().qpn, "{bind}");
    }
}

#[test]
fn attributes() {
    let dev = open(UdpConfig::default());
    let a = dev.attr();
    assert_eq!(a.kind, DeviceKind::Udp);
    assert_eq!(a.name, "udp-127.0.0.1");
    assert_eq!(a.gid, efa::Gid::from_ip(v4()));
    assert_eq!(a.mtu, efa::device::udp::LOOPBACK_MTU);
    assert_eq!(a.max_sge, 2);
    assert_eq!(a.max_rdma_size, efa::device::udp::MAX_RDMA_SIZE);
    assert!(a.caps.rnr_retry);
    assert!(a.caps.rdma_read && a.caps.rdma_write && !a.caps.unsolicited_write_recv);
    assert_eq!(a.pci_addr, None);
    // RDMA off: no capability, no size.
    let off = open(UdpConfig::default().with_rdma(false));
    assert_eq!(off.attr().max_rdma_size, 0);
    assert!(!off.attr().caps.rdma_read && !off.attr().caps.rdma_write);
    for mtu in [10, 70_000] {
        let e = UdpDevice::open(UdpConfig::default().with_mtu(mtu)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    }
    let n = Arc::new(Notifier::new());
    let mut at = attr(QpType::Srd, &n);
    at.qkey = Some(0x1234);
    let q = dev.create_qp(at).unwrap();
    assert_eq!(q.addr().qkey, 0x1234);
    assert_ne!(q.addr().qpn, 0);
}

/// The bytes of datagram `i` of sender `s`: a 12-byte header naming it and a payload derived from
/// the seed, of a random total length in `0..=mtu` (at least the header).
/// Datagram `i` of sender `s`: 12 bytes naming it, then seeded bytes. Its size is random up to
/// `mtu`, or with `runs`, 700 bytes but every eighth shorter, so that lists hold runs of equal
/// datagrams (GSO messages).
fn datagram(seed: u64, s: u64, i: u64, mtu: usize, runs: bool) -> (Vec<u8>, Vec<u8>) {
    let mut rng = Rng::new(seed ^ (s << 32) ^ i.wrapping_mul(0x9E37_79B9));
    let total = if runs {
        if i % 8 == 7 {
            12 + rng.below(688) as usize
        } else {
            700
        }
    } else {
        12 + rng.below((mtu - 12) as u64 + 1) as usize
    };
    let mut hdr = Vec::with_capacity(12);
    hdr.extend_from_slice(&(s as u32).to_le_bytes());
    hdr.extend_from_slice(&i.to_le_bytes());
    let payload = (0..total - 12).map(|_| rng.next_u64() as u8).collect();
    (hdr, payload)
}

/// How [`srd_exactly_once`] posts and what it injects.
#[derive(Clone, Copy)]
struct Run {
    senders: usize,
    count: u64,
    /// Drop, duplicate and reorder faults.
    faults: bool,
    /// Delays too.
    delay: bool,
    /// Post with `post_send_list`, in lists of random length, instead of one `post_send` each.
    lists: bool,
    /// `UdpConfig::gso`: lists leave as GSO messages, reads take coalesced datagrams.
    gso: bool,
}

/// `senders` queue pairs each send `count` datagrams to one receiver, under drop, duplicate and
/// reorder faults if asked; every datagram must arrive exactly once, intact, and every send must
/// succeed.
fn srd_exactly_once(run: Run) {
    let Run {
        senders,
        count,
        delay,
        ..
    } = run;
    let seed = test_seed();
    let mut faults = FaultConfig::seeded(seed);
    if run.faults {
        faults = faults.drop(0.1).duplicate(0.1).reorder(0.1);
    }
    if delay {
        faults = faults.delay(0.1, Duration::from_millis(3));
    }
    let mut list_rng = Rng::new(seed ^ 0x11575);
    let mut list = std::collections::VecDeque::new();
    let dev = open(UdpConfig::default().with_faults(faults).with_gso(run.gso));
    let mtu = dev.attr().mtu;
    let n = Arc::new(Notifier::new());
    let mut rx = {
        let mut a = attr(QpType::Srd, &n);
        a.recv_depth = 512;
        a.rnr_retry = 7;
        dev.create_qp(a).unwrap()
    };
    let mut txs: Vec<Box<dyn QueuePair>> = (0..senders)
        .map(|_| {
            let mut a = attr(QpType::Srd, &n);
            a.send_depth = 128;
            a.rnr_retry = 7;
            dev.create_qp(a).unwrap()
        })
        .collect();
    let dest = rx.addr();
    let mut next_recv = 0u64;
    while rx
        .post_recv(next_recv, BytesMut::with_capacity(mtu))
        .is_ok()
    {
        next_recv += 1;
    }
    let mut next = vec![0u64; senders];
    let mut delivered: HashSet<(u64, u64)> = HashSet::new();
    let mut sent_ok: HashSet<(usize, u64)> = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut buf = Vec::new();
    let total = senders as u64 * count;
    while delivered.len() < total as usize || sent_ok.len() < total as usize {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: timed out with {} delivered, {} sends completed, stats {:?}",
            delivered.len(),
            sent_ok.len(),
            dev.stats()
        );
        let seen = n.generation();
        let mut progress = 0;
        for (s, tx) in txs.iter_mut().enumerate() {
            while run.lists && next[s] < count {
                let len = 1 + list_rng.below(80);
                list.clear();
                for i in next[s]..(next[s] + len).min(count) {
                    let (hdr, payload) = datagram(seed, s as u64, i, mtu, run.gso);
                    let imm = (i % 3 == 0).then_some(i as u32);
                    list.push_back(wr(i, dest, &hdr, &payload, imm));
                }
                let want = next[s] + list.len() as u64;
                match tx.post_send_list(&mut list) {
                    Ok(()) => next[s] = want,
                    Err((id, e)) if e.kind() == ErrorKind::Again => {
                        // Not posted: that one and the ones behind it go again later.
                        assert_eq!(id + list.len() as u64 + 1, want, "seed {seed}");
                        next[s] = id;
                        break;
                    }
                    Err((_, e)) => panic!("seed {seed}: post_send_list: {e}"),
                }
            }
            while next[s] < count {
                let (hdr, payload) = datagram(seed, s as u64, next[s], mtu, run.gso);
                let imm = (next[s] % 3 == 0).then_some(next[s] as u32);
                match tx.post_send(wr(next[s], dest, &hdr, &payload, imm)) {
                    Ok(()) => next[s] += 1,
                    Err(e) if e.kind() == ErrorKind::Again => break,
                    Err(e) => panic!("seed {seed}: post_send: {e}"),
                }
            }
            buf.clear();
            progress += tx.poll(&mut buf, 256);
            for c in buf.drain(..) {
                assert_eq!(c.opcode, Opcode::Send, "seed {seed}");
                assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
                assert!(
                    sent_ok.insert((s, c.wr_id)),
                    "seed {seed}: send {s}/{} completed twice",
                    c.wr_id
                );
            }
        }
        buf.clear();
        progress += rx.poll(&mut buf, 256);
        for c in buf.drain(..) {
            assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
            let b = c.buf.unwrap();
            assert_eq!(b.len(), c.byte_len, "seed {seed}");
            assert!(b.len() >= 12, "seed {seed}: short datagram {}", b.len());
            let s = u32::from_le_bytes(b[..4].try_into().unwrap()) as u64;
            let i = u64::from_le_bytes(b[4..12].try_into().unwrap());
            let (hdr, payload) = datagram(seed, s, i, mtu, run.gso);
            assert_eq!(&b[..12], &hdr[..], "seed {seed}: header of {s}/{i}");
            assert!(
                b[12..] == payload[..],
                "seed {seed}: payload of {s}/{i} corrupted"
            );
            assert_eq!(
                c.imm,
                (i % 3 == 0).then_some(i as u32),
                "seed {seed}: imm of {s}/{i}"
            );
            assert_eq!(
                c.src.map(|x| x.qpn),
                Some(txs[s as usize].addr().qpn),
                "seed {seed}"
            );
            assert!(
                delivered.insert((s, i)),
                "seed {seed}: {s}/{i} delivered twice"
            );
            rx.post_recv(next_recv, b).unwrap();
            next_recv += 1;
        }
        if progress == 0 {
            n.wait_until(seen, Some(Instant::now() + Duration::from_millis(2)));
        }
    }
    // Nothing more may arrive: late duplicates must still be suppressed.
    let mut all: Vec<&mut Box<dyn QueuePair>> = vec![&mut rx];
    all.extend(txs.iter_mut());
    let late = poll_for(&mut all, Duration::from_millis(200));
    assert!(late.is_empty(), "seed {seed}: late completions {late:?}");
    let s = dev.stats();
    eprintln!("seed {seed}: {senders} sender(s) x {count}: {s:?}");
    if run.faults {
        assert!(s.retransmits > 0, "seed {seed}: {s:?}");
        assert!(s.duplicates_dropped > 0, "seed {seed}: {s:?}");
        assert!(
            s.faults_dropped > 0 && s.faults_duplicated > 0 && s.faults_reordered > 0,
            "seed {seed}: {s:?}"
        );
    }
    if run.lists {
        // Lists of several sends went out with `sendmmsg`.
        assert!(s.tx_batches > 0, "seed {seed}: {s:?}");
    }
    if run.gso {
        // Coalesced reads came (GSO messages through loopback to a `UDP_GRO` socket), or the
        // kernel offers neither and every datagram came alone: either way all arrived above.
        eprintln!("seed {seed}: {} multi-datagram reads", s.rx_batches);
    }
    assert_eq!(s.rx_pkts, total, "seed {seed}: {s:?}");
    assert_eq!(s.tx_pkts, total, "seed {seed}: {s:?}");
    assert_eq!(s.send_errors, 0, "seed {seed}: {s:?}");
}

/// One sender at a time, drop, duplicate and reorder faults, one `post_send` per datagram.
fn faulty(senders: usize, count: u64) -> Run {
    Run {
        senders,
        count,
        faults: true,
        delay: false,
        lists: false,
        gso: false,
    }
}

#[test]
fn srd_exactly_once_under_faults() {
    srd_exactly_once(faulty(1, 2000));
}

#[test]
fn srd_exactly_once_two_senders_under_faults() {
    srd_exactly_once(faulty(2, 1000));
}

#[test]
fn srd_exactly_once_with_delays() {
    srd_exactly_once(Run {
        delay: true,
        ..faulty(1, 1000)
    });
}

#[test]
fn srd_post_lists_deliver_exactly_once() {
    srd_exactly_once(Run {
        faults: false,
        lists: true,
        ..faulty(2, 2000)
    });
}

#[test]
fn srd_post_lists_as_gso_messages_deliver_exactly_once() {
    srd_exactly_once(Run {
        faults: false,
        lists: true,
        gso: true,
        ..faulty(2, 2000)
    });
}

#[test]
fn srd_post_lists_deliver_exactly_once_under_faults() {
    srd_exactly_once(Run {
        lists: true,
        ..faulty(2, 1000)
    });
}

/// A list stops at the first work request the queue pair refuses: the ones before it are posted
/// and complete, it comes back with its error, the ones behind it stay in the list.
#[test]
fn post_list_stops_at_a_refused_request() {
    for ty in [QpType::Ud, QpType::Srd] {
        let dev = open(UdpConfig::default());
        let mtu = dev.attr().mtu;
        let n = Arc::new(Notifier::new());
        let mut a = qp(&dev, ty, &n);
        let mut b = qp(&dev, ty, &n);
        for i in 0..4 {
            b.post_recv(100 + i, BytesMut::with_capacity(mtu)).unwrap();
        }
        let big = vec![1u8; mtu + 1];
        let mut list: std::collections::VecDeque<SendWr> = [
            wr(1, b.addr(), b"a", b"first", None),
            wr(2, b.addr(), b"b", b"second", Some(2)),
            wr(3, b.addr(), b"", &big, None),
            wr(4, b.addr(), b"d", b"fourth", None),
        ]
        .into_iter()
        .collect();
        let (id, e) = a.post_send_list(&mut list).unwrap_err();
        assert_eq!((id, e.kind()), (3, ErrorKind::MsgSize), "{ty:?}");
        assert_eq!(list.len(), 1, "{ty:?}");
        assert_eq!(list[0].wr_id, 4, "{ty:?}");
        let got = poll_until(&mut [&mut a, &mut b], &n, "the two posted sends", |c| {
            c.len() >= 4
        });
        let mut sends: Vec<u64> = got
            .iter()
            .filter(|(q, _)| *q == 0)
            .map(|(_, c)| {
                assert_eq!(c.status, Status::Success, "{ty:?}: {c:?}");
                c.wr_id
            })
            .collect();
        sends.sort_unstable();
        assert_eq!(sends, [1, 2], "{ty:?}");
        let mut data: Vec<Vec<u8>> = got
            .iter()
            .filter(|(q, _)| *q == 1)
            .map(|(_, c)| c.buf.as_ref().unwrap()[..c.byte_len].to_vec())
            .collect();
        data.sort();
        assert_eq!(data, [b"afirst".to_vec(), b"bsecond".to_vec()], "{ty:?}");
        let late = poll_for(&mut [&mut a, &mut b], Duration::from_millis(100));
        assert!(late.is_empty(), "{ty:?}: {late:?}");
    }
}

/// A datagram the kernel refuses for good (here: to the broadcast address, without
/// `SO_BROADCAST`) fails its own send with `UnreachableRemote` when it went out in a list (one
/// `sendmmsg`); the others of the list arrive.
#[test]
fn a_refused_datagram_in_a_list_fails_only_its_send() {
    for ty in [QpType::Ud, QpType::Srd] {
        let dev = open(UdpConfig::default());
        let n = Arc::new(Notifier::new());
        let mut a = qp(&dev, ty, &n);
        let mut b = qp(&dev, ty, &n);
        for i in 0..8 {
            b.post_recv(100 + i, BytesMut::with_capacity(256)).unwrap();
        }
        let mut bcast = b.addr();
        bcast.gid = efa::Gid::from_ip("255.255.255.255".parse().unwrap());
        let mut list: std::collections::VecDeque<SendWr> = (0..6u64)
            .map(|i| {
                let dest = if i == 2 || i == 3 { bcast } else { b.addr() };
                wr(i, dest, b"h", &[i as u8; 20], None)
            })
            .collect();
        a.post_send_list(&mut list).unwrap();
        let got = poll_until(&mut [&mut a, &mut b], &n, "the list's completions", |c| {
            c.len() >= 10
        });
        let mut sends: Vec<(u64, Status)> = got
            .iter()
            .filter(|(q, _)| *q == 0)
            .map(|(_, c)| (c.wr_id, c.status))
            .collect();
        sends.sort_unstable_by_key(|x| x.0);
        let want: Vec<(u64, Status)> = (0..6u64)
            .map(|i| {
                let st = if i == 2 || i == 3 {
                    Status::UnreachableRemote
                } else {
                    Status::Success
                };
                (i, st)
            })
            .collect();
        assert_eq!(sends, want, "{ty:?}");
        let mut data: Vec<u8> = got
            .iter()
            .filter(|(q, _)| *q == 1)
            .map(|(_, c)| c.buf.as_ref().unwrap()[1])
            .collect();
        data.sort_unstable();
        assert_eq!(data, [0, 1, 4, 5], "{ty:?}");
        assert_eq!(dev.stats().send_errors, 2, "{ty:?}");
        let late = poll_for(&mut [&mut a, &mut b], Duration::from_millis(100));
        assert!(late.is_empty(), "{ty:?}: {late:?}");
    }
}

fn short_unresponsive() -> UdpConfig {
    UdpConfig::default()
        .with_unresponsive_timeout(Duration::from_millis(200))
        .with_peer_idle_timeout(Duration::from_secs(2))
}

#[test]
fn srd_unresponsive_closed_peer_and_silent_port() {
    let dev = open(short_unresponsive());
    let n = Arc::new(Notifier::new());
    let mut tx = qp(&dev, QpType::Srd, &n);
    // A closed queue pair.
    let mut closed = qp(&dev, QpType::Srd, &n);
    closed.post_recv(1, BytesMut::with_capacity(64)).unwrap();
    closed.close();
    let dead = closed.addr();
    // A dropped queue pair.
    let dropped = qp(&dev, QpType::Srd, &n).addr();
    // A port nobody listens on.
    let silent = {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = s.local_addr().unwrap().port();
        RawAddr::new(efa::Gid::from_ip(v4()), port, 77)
    };
    for (i, d) in [dead, dead, dropped, silent].into_iter().enumerate() {
        tx.post_send(wr(i as u64, d, b"", b"anyone?", None))
            .unwrap();
    }
    let got = poll_until(&mut [&mut tx], &n, "unresponsive", |c| c.len() >= 4);
    let mut ids: Vec<u64> = got.iter().map(|(_, c)| c.wr_id).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 2, 3]);
    for (_, c) in &got {
        assert_eq!(c.status, Status::UnresponsiveRemote, "{c:?}");
        assert_eq!(c.status.error_kind(), ErrorKind::ConnectionAborted);
    }
    assert!(dev.stats().send_errors >= 4);
    // The closed queue pair handed back its buffer, flushed.
    let mut out = Vec::new();
    closed.poll(&mut out, 8);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].status, Status::Flushed);
}

#[test]
fn progress_without_polling() {
    // A lossy network: the device must retransmit and acknowledge while nobody polls.
    let seed = test_seed();
    let dev = open(UdpConfig::default().with_faults(FaultConfig::seeded(seed).drop(0.5)));
    let rx_n = Arc::new(Notifier::new());
    let tx_n = Arc::new(Notifier::new());
    let mut rx = qp(&dev, QpType::Srd, &rx_n);
    let mut tx = qp(&dev, QpType::Srd, &tx_n);
    for i in 0..20 {
        rx.post_recv(i, BytesMut::with_capacity(64)).unwrap();
    }
    let tx_seen = tx_n.generation();
    for i in 0..20 {
        tx.post_send(wr(i, rx.addr(), b"", &[i as u8; 32], None))
            .unwrap();
    }
    // Sleep until the sender's device reports completions, without polling either side.
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: no progress without polling"
        );
        tx_n.wait_until(tx_seen, Some(Instant::now() + Duration::from_millis(100)));
        if tx_n.generation() != tx_seen && rx_n.generation() != 0 {
            break;
        }
    }
    let n2 = Notifier::new();
    let got = poll_until(&mut [&mut tx, &mut rx], &n2, "all", |c| c.len() >= 40);
    assert!(
        got.iter().all(|(_, c)| c.status == Status::Success),
        "seed {seed}: {got:?}"
    );
}

/// Builds a valid datagram by the documented layout (docs/udp-device.md).
fn valid_datagram(rng: &mut Rng, qkey: u32, srd: bool) -> Vec<u8> {
    let mut b = vec![0xEF, 0xA5, 1];
    let payload: Vec<u8> = (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect();
    let imm = rng.chance(0.5);
    if !srd {
        b.extend_from_slice(&[1, imm as u8, 0, 0, 0]);
        b.extend_from_slice(&qkey.to_le_bytes());
        if imm {
            b.extend_from_slice(&7u32.to_le_bytes());
        }
        b.extend_from_slice(&payload);
        return b;
    }
    match rng.below(3) {
        0 => {
            b.extend_from_slice(&[2, imm as u8, 0, 0, 0]);
            b.extend_from_slice(&qkey.to_le_bytes());
            b.extend_from_slice(&(rng.next_u64() as u32).to_le_bytes()); // src qkey
            b.extend_from_slice(&(rng.next_u64() as u32).to_le_bytes()); // conn
            b.extend_from_slice(&0u32.to_le_bytes()); // try
            let base = rng.below(1000);
            b.extend_from_slice(&(base + rng.below(8)).to_le_bytes()); // seq
            b.extend_from_slice(&base.to_le_bytes()); // base
            b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            if imm {
                b.extend_from_slice(&7u32.to_le_bytes());
            }
            b.extend_from_slice(&payload);
        }
        1 => {
            b.extend_from_slice(&[3, 0, 0, 0, 0]);
            b.extend_from_slice(&qkey.to_le_bytes());
            b.extend_from_slice(&(rng.next_u64() as u32).to_le_bytes());
            b.extend_from_slice(&(rng.below(4) as u32).to_le_bytes());
            let n = rng.below(4) as u16;
            b.extend_from_slice(&n.to_le_bytes());
            b.extend_from_slice(&[0, 0]);
            b.extend_from_slice(&rng.below(100).to_le_bytes());
            b.extend((0..n).map(|_| rng.next_u64() as u8));
        }
        _ => {
            b.extend_from_slice(&[4, 0, 0, 0, 0]);
            b.extend_from_slice(&qkey.to_le_bytes());
            b.extend_from_slice(&(rng.next_u64() as u32).to_le_bytes());
            b.extend_from_slice(&(rng.below(4) as u32).to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b.extend_from_slice(&rng.below(100).to_le_bytes());
            b.extend_from_slice(&[1 + rng.below(2) as u8, 0, 0, 0]);
        }
    }
    b
}

#[test]
fn garbage_is_dropped_and_counted() {
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    for ty in [QpType::Ud, QpType::Srd] {
        let dev = open(UdpConfig::default());
        let n = Arc::new(Notifier::new());
        let mut victim = qp(&dev, ty, &n);
        let mut peer = qp(&dev, ty, &n);
        let target = victim.addr();
        let qkey = target.qkey;
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let dest = ("127.0.0.1", target.qpn);
        let mut sent = 0;
        for i in 0..3000 {
            let d = match i % 3 {
                0 => (0..rng.below(120)).map(|_| rng.next_u64() as u8).collect(),
                _ => {
                    let mut d = valid_datagram(&mut rng, qkey, ty == QpType::Srd);
                    match rng.below(4) {
                        0 => {
                            let cut = rng.below(d.len() as u64) as usize;
                            d.truncate(cut);
                        }
                        1 => d.extend((0..1 + rng.below(8)).map(|_| rng.next_u64() as u8)),
                        _ => {
                            for _ in 0..1 + rng.below(3) {
                                let at = rng.below(d.len().min(48) as u64) as usize;
                                d[at] = rng.next_u64() as u8;
                            }
                        }
                    }
                    d
                }
            };
            if sock.send_to(&d, dest).is_ok() {
                sent += 1;
            }
            if i % 200 == 0 {
                // Let the device keep up so the socket buffer does not overflow.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        assert!(sent > 0);
        // The queue pair still works, and its NIC thread is alive: wait for the receive
        // completion through the notifier without polling the victim.
        let mut buf = Vec::new();
        let _ = poll_for(&mut [&mut victim], Duration::from_millis(50));
        victim.post_recv(1, BytesMut::with_capacity(64)).unwrap();
        let seen = n.generation();
        peer.post_send(wr(2, target, b"", b"still alive", None))
            .unwrap();
        let deadline = Instant::now() + DEADLINE;
        let mut got = Vec::new();
        while got.is_empty() {
            assert!(
                Instant::now() < deadline,
                "seed {seed}: {ty:?} dead after garbage"
            );
            n.wait_until(seen, Some(Instant::now() + Duration::from_millis(50)));
            if n.generation() != seen {
                victim.poll(&mut got, 8);
            }
            buf.clear();
            peer.poll(&mut buf, 8);
        }
        assert_eq!(got[0].wr_id, 1, "seed {seed}: {got:?}");
        assert_eq!(got[0].status, Status::Success, "seed {seed}");
        assert_eq!(
            &got[0].buf.as_ref().unwrap()[..],
            b"still alive",
            "seed {seed}"
        );
        let s = dev.stats();
        eprintln!("seed {seed}: {ty:?} after garbage: {s:?}");
        assert!(s.malformed_dropped > 800, "seed {seed}: {ty:?} {s:?}");
    }
}

#[test]
fn device_stats_aggregate_queue_pairs() {
    let dev = open(UdpConfig::default());
    let n = Arc::new(Notifier::new());
    let mut a = qp(&dev, QpType::Srd, &n);
    let mut b = qp(&dev, QpType::Srd, &n);
    let mut c = qp(&dev, QpType::Srd, &n);
    c.post_recv(1, BytesMut::with_capacity(8)).unwrap();
    c.post_recv(2, BytesMut::with_capacity(8)).unwrap();
    a.post_send(wr(1, c.addr(), b"", b"a", None)).unwrap();
    b.post_send(wr(1, c.addr(), b"", b"bb", None)).unwrap();
    poll_until(&mut [&mut a, &mut b, &mut c], &n, "two sends", |x| {
        x.len() >= 4
    });
    let s = dev.stats();
    assert_eq!(s.tx_pkts, 2);
    assert_eq!(s.tx_bytes, 3);
    assert_eq!(s.rx_pkts, 2);
    assert_eq!(s.rx_bytes, 3);
    assert!(s.acks_sent >= 1);
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
                .map(|s| s.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits (up to the deadline) until no thread is named `name`: a joined thread stays listed in
/// `/proc/self/task` for a moment, until the kernel reaps it.
fn thread_gone(name: &str) -> bool {
    let deadline = Instant::now() + DEADLINE;
    while thread_names().iter().any(|t| t == name) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
fn dropping_a_queue_pair_stops_its_thread() {
    if !std::path::Path::new("/proc/self/task").exists() {
        return; // not Linux
    }
    let dev = open(UdpConfig::default());
    let n = Arc::new(Notifier::new());
    for ty in [QpType::Ud, QpType::Srd] {
        let mut q = qp(&dev, ty, &n);
        let name = format!("efa-udp-{}", q.addr().qpn);
        // The new thread names itself once it runs.
        let deadline = Instant::now() + DEADLINE;
        while !thread_names().contains(&name) {
            assert!(
                Instant::now() < deadline,
                "{name} not running: {:?}",
                thread_names()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        q.post_recv(1, BytesMut::with_capacity(8)).unwrap();
        drop(q);
        assert!(thread_gone(&name), "{name} leaked");
        let mut q = qp(&dev, ty, &n);
        let name = format!("efa-udp-{}", q.addr().qpn);
        q.close();
        assert!(thread_gone(&name), "{name} runs after close");
    }
}

#[test]
fn srd_one_sender_many_receivers_under_faults() {
    let seed = test_seed();
    let dev = open(
        UdpConfig::default().with_faults(
            FaultConfig::seeded(seed)
                .drop(0.1)
                .duplicate(0.1)
                .reorder(0.1),
        ),
    );
    let n = Arc::new(Notifier::new());
    let mut tx = {
        let mut a = attr(QpType::Srd, &n);
        a.send_depth = 64;
        dev.create_qp(a).unwrap()
    };
    let mut rxs: Vec<Box<dyn QueuePair>> = (0..3)
        .map(|_| {
            let mut a = attr(QpType::Srd, &n);
            a.recv_depth = 512;
            dev.create_qp(a).unwrap()
        })
        .collect();
    const PER: u64 = 300;
    for r in rxs.iter_mut() {
        for i in 0..PER {
            r.post_recv(i, BytesMut::with_capacity(256)).unwrap();
        }
    }
    let dests: Vec<RawAddr> = rxs.iter().map(|r| r.addr()).collect();
    let mut next = 0u64;
    let mut sends = HashSet::new();
    let mut recvd = HashSet::new();
    let deadline = Instant::now() + DEADLINE;
    let mut buf = Vec::new();
    while sends.len() < 3 * PER as usize || recvd.len() < 3 * PER as usize {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: timed out, {:?}",
            dev.stats()
        );
        let seen = n.generation();
        while next < 3 * PER {
            let r = (next % 3) as usize;
            let body = next.to_le_bytes();
            match tx.post_send(wr(next, dests[r], b"", &body, None)) {
                Ok(()) => next += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => panic!("seed {seed}: {e}"),
            }
        }
        buf.clear();
        let mut got = tx.poll(&mut buf, 64);
        for c in buf.drain(..) {
            assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
            assert!(sends.insert(c.wr_id), "seed {seed}: send {} twice", c.wr_id);
        }
        for (r, q) in rxs.iter_mut().enumerate() {
            buf.clear();
            got += q.poll(&mut buf, 64);
            for c in buf.drain(..) {
                assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
                let b = c.buf.unwrap();
                let i = u64::from_le_bytes(b[..8].try_into().unwrap());
                assert_eq!(i % 3, r as u64, "seed {seed}: {i} at the wrong receiver");
                assert!(recvd.insert(i), "seed {seed}: {i} delivered twice");
            }
        }
        if got == 0 {
            n.wait_until(seen, Some(Instant::now() + Duration::from_millis(2)));
        }
    }
}

/// Polls `q` until a receive completes; counts the send completions seen meanwhile.
fn spin_recv(q: &mut Box<dyn QueuePair>, sends: &mut u64, what: &str) -> DeviceCompletion {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    let mut got = None;
    while got.is_none() {
        assert!(Instant::now() < deadline, "{what}: no receive");
        out.clear();
        q.poll(&mut out, 16);
        for c in out.drain(..) {
            assert_eq!(c.status, Status::Success, "{what}: {c:?}");
            if c.opcode == Opcode::Send {
                *sends += 1;
            } else {
                got = Some(c);
            }
        }
    }
    got.unwrap()
}

#[test]
fn busy_polling_request_response_piggybacks_acks_and_hands_off() {
    // Both queue pairs busy-polled from one thread: every acknowledgement can ride on the reply
    // (or on the next request), so far fewer ack datagrams than data packets go out.
    let dev = open(UdpConfig::default());
    let (na, nb) = (Arc::new(Notifier::new()), Arc::new(Notifier::new()));
    let mut a = qp(&dev, QpType::Srd, &na);
    let mut b = qp(&dev, QpType::Srd, &nb);
    const N: u64 = 200;
    let (mut a_sends, mut b_sends) = (0, 0);
    for i in 0..N {
        a.post_recv(i, BytesMut::with_capacity(64)).unwrap();
        b.post_recv(i, BytesMut::with_capacity(64)).unwrap();
        a.post_send(wr(i, b.addr(), b"q", &i.to_le_bytes(), None))
            .unwrap();
        let c = spin_recv(&mut b, &mut b_sends, "request");
        assert_eq!(&c.buf.unwrap()[1..], &i.to_le_bytes());
        b.post_send(wr(i, a.addr(), b"r", &i.to_le_bytes(), Some(7)))
            .unwrap();
        let c = spin_recv(&mut a, &mut a_sends, "reply");
        assert_eq!(c.imm, Some(7));
        assert_eq!(&c.buf.unwrap()[1..], &i.to_le_bytes());
    }
    // The application of `a` goes to sleep on its notifier: its NIC thread takes over and sends
    // the acknowledgement `a` still owes for the last reply, so `b`'s last send completes.
    na.wait_until(
        na.generation(),
        Some(Instant::now() + Duration::from_millis(20)),
    );
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while b_sends < N || a_sends < N {
        assert!(
            Instant::now() < deadline,
            "sends {a_sends} {b_sends} of {N}"
        );
        for (q, n) in [(&mut a, &mut a_sends), (&mut b, &mut b_sends)] {
            out.clear();
            q.poll(&mut out, 64);
            assert!(out.iter().all(|c| c.status == Status::Success), "{out:?}");
            *n += out.len() as u64;
        }
    }
    let s = dev.stats();
    assert_eq!(s.tx_pkts, 2 * N);
    assert_eq!(s.rx_pkts, 2 * N);
    // Without piggybacking every data packet would be acknowledged by a datagram of its own.
    assert!(s.acks_sent < 2 * N, "{s:?}");
}

/// A queue pair with nothing in flight that nothing reached for a while is polled without a
/// system call per poll (it reads its socket only every 16th poll at most), and a datagram
/// that then reaches it is still received, once.
#[test]
fn an_idle_queue_pair_reads_its_socket_rarely_and_still_receives() {
    let dev = open(UdpConfig::default());
    let n = Arc::new(Notifier::new());
    let mut a = qp(&dev, QpType::Srd, &n);
    let mut b = qp(&dev, QpType::Srd, &n);
    b.post_recv(7, BytesMut::with_capacity(64)).unwrap();
    // Longer than the 200 µs after which a queue pair with nothing in flight is cold.
    std::thread::sleep(Duration::from_millis(5));
    let polls = 20_000u64;
    let before = dev.stats().rx_empty_reads;
    let mut out = Vec::new();
    for _ in 0..polls {
        b.poll(&mut out, 16);
    }
    let empty = dev.stats().rx_empty_reads - before;
    assert!(out.is_empty(), "{out:?}");
    // One poll in 16 may read; a few more while the NIC thread hands over to the polls.
    assert!(
        empty <= polls / 16 + 64,
        "{empty} empty reads of the socket in {polls} idle polls"
    );
    a.post_send(wr(1, b.addr(), b"", b"after the quiet", None))
        .unwrap();
    let got = poll_until(
        &mut [&mut a, &mut b],
        &n,
        "a datagram to a cold queue pair",
        |c| c.len() >= 2,
    );
    let recvs: Vec<_> = got.iter().filter(|(q, _)| *q == 1).collect();
    assert_eq!(recvs.len(), 1, "{got:?}");
    assert_eq!(recvs[0].1.status, Status::Success, "{got:?}");
    assert_eq!(&recvs[0].1.buf.as_ref().unwrap()[..], b"after the quiet");
}

/// While an application busy-polls a cold queue pair, the NIC thread watches its socket for it:
/// the polls make no empty reads at all (not one every few microseconds), and every datagram
/// that comes after a quiet spell is still received, once, cycle after cycle (a datagram the
/// thread saw must not be left unread by anyone).
#[test]
fn a_busy_polled_cold_queue_pair_is_watched_and_never_misses_a_datagram() {
    let dev = open(UdpConfig::default());
    let n = Arc::new(Notifier::new());
    let mut a = qp(&dev, QpType::Srd, &n);
    let mut b = qp(&dev, QpType::Srd, &n);
    let mut out = Vec::new();
    let spin = |q: &mut Box<dyn QueuePair>, out: &mut Vec<DeviceCompletion>, d: Duration| {
        let until = Instant::now() + d;
        while Instant::now() < until {
            q.poll(out, 16);
        }
    };
    // Cold (200 µs with nothing in flight), and the NIC thread (which looks at least every
    // millisecond) watching.
    spin(&mut b, &mut out, Duration::from_millis(3));
    let before = dev.stats().rx_empty_reads;
    spin(&mut b, &mut out, Duration::from_millis(20));
    let empty = dev.stats().rx_empty_reads - before;
    assert!(out.is_empty(), "{out:?}");
    // Reading every 5 µs would be about 4 000.
    assert!(empty <= 20, "{empty} empty reads in 20 ms of busy polls");
    for cycle in 0..40u64 {
        b.post_recv(cycle, BytesMut::with_capacity(64)).unwrap();
        // Quiet long enough to be cold and watched again (longer every few cycles).
        spin(
            &mut b,
            &mut out,
            Duration::from_micros(300 + 400 * (cycle % 4)),
        );
        assert!(out.is_empty(), "cycle {cycle}: {out:?}");
        let msg = format!("cycle {cycle}");
        a.post_send(wr(cycle, b.addr(), b"", msg.as_bytes(), None))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let (mut sent, mut got) = (0, Vec::new());
        while sent == 0 || got.is_empty() {
            assert!(
                Instant::now() < deadline,
                "cycle {cycle}: the datagram after a quiet spell never came (sent {sent})"
            );
            out.clear();
            a.poll(&mut out, 16);
            sent += out.len();
            out.clear();
            b.poll(&mut out, 16);
            got.append(&mut out);
        }
        assert_eq!(got.len(), 1, "cycle {cycle}: {got:?}");
        assert_eq!(got[0].wr_id, cycle);
        assert_eq!(got[0].status, Status::Success, "cycle {cycle}");
        assert_eq!(&got[0].buf.as_ref().unwrap()[..], msg.as_bytes());
    }
}
