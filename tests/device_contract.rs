//! The contract every device honours at the `Device` / `QueuePair` seam, run on each of them:
//! `loopback`, `udp`, `shm` and the routing device (`udp` with routes over shm to queue pairs
//! on this host) always, and the `efa` device when `EFA_TEST_DEVICE=efa` (under the
//! emulated NIC: `efa-emu run -- cargo test --features efa --test device_contract`).
//!
//! Each work request completes exactly once; datagrams arrive intact with their immediate data
//! and source, into receive buffers in the order they were posted (on each path, for the
//! routing device's SRD queue pairs: `QueuePair::post_recv`); sends above the MTU are
//! refused with `MsgSize` and full queues with `Again`; closing flushes every outstanding work
//! request (buffers handed back) and later posts fail with `Closed`; a receiver-not-ready SRD
//! send fails after its retries or is delivered once a buffer comes; a short receive buffer
//! completes with `LocalBadLength` (and the SRD sender with `RemoteBadLength` on the software
//! devices); a wrong QKEY is dropped (and counted, but for EFA). What only one device does (loss, faults,
//! replay, files, threads) stays in that device's own test file; one-sided RDMA and its keys are
//! in `tests/device_rdma.rs`.
//!
//! There are no timing assertions: deadlines only turn a hang into a failure.

#[allow(dead_code)]
#[path = "common/seam.rs"]
mod seam;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::route::RoutedDevice;
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::device::{Device, DeviceCompletion, DeviceKind, Opcode, QpAttr, QpType, Source, Status};
use efa::notify::Notifier;
use efa::{ErrorKind, FaultConfig};
use seam::{Qp, poll_for_with, poll_until_with, wr};

/// How long an SRD send to a queue pair that does not answer waits before `UnresponsiveRemote`.
const UNRESPONSIVE: Duration = Duration::from_millis(200);

/// The first work request id of the receive buffers [`Fixture::post_path_buffers`] posts.
const FILLER: u64 = 1000;

/// One device under test, with what keeps it alive and a notifier its queue pairs signal.
struct Fixture {
    dev: Arc<dyn Device>,
    /// The loopback device's network, pumped while polling.
    net: Option<LoopbackNetwork>,
    notifier: Arc<Notifier>,
    /// Receive buffers are consumed in the order they were posted. A routing device's SRD queue
    /// pairs split their buffers between two paths (primary and shm), each consumed in order:
    /// see `efa::device::route` and `QueuePair::post_recv`.
    in_post_order: bool,
    /// A name for the messages: the routing device reports its primary's kind.
    name: &'static str,
    _keep: Option<Box<dyn Any>>,
}

/// The devices of this run: the software devices, or only the efa device when
/// `EFA_TEST_DEVICE=efa`.
fn fixtures() -> Vec<Fixture> {
    let notifier = Arc::new(Notifier::new());
    if std::env::var("EFA_TEST_DEVICE").as_deref() == Ok("efa") {
        return efa_fixture(notifier).into_iter().collect();
    }
    let net = LoopbackNetwork::new(FaultConfig::default());
    let loopback = LoopbackDevice::open(
        &net,
        LoopbackConfig::default().with_unresponsive_timeout(UNRESPONSIVE),
    )
    .expect("loopback device");
    let udp = UdpDevice::open(
        UdpConfig::default()
            .with_unresponsive_timeout(UNRESPONSIVE)
            .with_peer_idle_timeout(Duration::from_secs(2)),
    )
    .expect("udp device");
    let shm_config = |dir: &std::path::Path| {
        ShmConfig::in_dir(dir)
            .with_unresponsive_timeout(UNRESPONSIVE)
            .with_ring_slots(64)
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    let shm = ShmDevice::open(shm_config(dir.path())).expect("shm device");
    // The routing device: udp as the primary, and its queue pairs of this process reach each
    // other over shm (they are on the same host), as two processes' endpoints do by default.
    let route_dir = tempfile::tempdir().expect("temporary directory");
    let routed = RoutedDevice::open(
        UdpDevice::open(
            UdpConfig::default()
                .with_unresponsive_timeout(UNRESPONSIVE)
                .with_peer_idle_timeout(Duration::from_secs(2)),
        )
        .expect("udp device"),
        shm_config(route_dir.path()),
    )
    .expect("routing device");
    let fixture = |dev, name, keep: Option<Box<dyn Any>>| Fixture {
        dev,
        net: None,
        notifier: notifier.clone(),
        in_post_order: true,
        name,
        _keep: keep,
    };
    vec![
        Fixture {
            net: Some(net),
            ..fixture(loopback, "loopback", None)
        },
        fixture(udp, "udp", None),
        fixture(shm, "shm", Some(Box::new(dir))),
        Fixture {
            in_post_order: false,
            ..fixture(routed, "udp+shm route", Some(Box::new(route_dir)))
        },
    ]
}

#[cfg(feature = "efa")]
fn efa_fixture(notifier: Arc<Notifier>) -> Option<Fixture> {
    let devs = efa::device::efa::EfaDevice::open_all(&efa::Config::default()).unwrap();
    let dev = devs
        .into_iter()
        .next()
        .expect("EFA_TEST_DEVICE=efa but no EFA device (run under efa-emu)");
    Some(Fixture {
        dev,
        net: None,
        notifier,
        in_post_order: true,
        name: "efa",
        _keep: None,
    })
}

#[cfg(not(feature = "efa"))]
fn efa_fixture(_: Arc<Notifier>) -> Option<Fixture> {
    panic!("EFA_TEST_DEVICE=efa needs the `efa` feature");
}

impl Fixture {
    fn kind(&self) -> DeviceKind {
        self.dev.attr().kind
    }

    fn qp(&self, ty: QpType, f: impl FnOnce(&mut QpAttr)) -> Qp {
        let mut a = QpAttr::new(ty);
        a.notifier = self.notifier.clone();
        f(&mut a);
        self.dev.create_qp(a).expect("create_qp")
    }

    /// Runs a loopback network's deliveries (other devices progress on their own).
    fn pump(&self) {
        if let Some(net) = &self.net {
            net.pump();
        }
    }

    /// Polls until `done` says so, waiting on the notifier in between.
    fn poll_until(
        &self,
        qps: &mut [&mut Qp],
        what: &str,
        done: impl FnMut(&[(usize, DeviceCompletion)]) -> bool,
    ) -> Vec<(usize, DeviceCompletion)> {
        let what = format!("{}: {what}", self.name);
        poll_until_with(qps, &self.notifier, &|| self.pump(), &what, done)
    }

    /// Posts the receive buffers a routing device needs beside the test's own so that the path
    /// the traffic takes has one (`route::BASE_RECV` per path; buffers posted to one path do not
    /// move to the other), each of `room` bytes, with work request ids from `FILLER`. Nothing on
    /// the other devices, which consume buffers in the order they were posted.
    fn post_path_buffers(&self, q: &mut Qp, room: usize) {
        if self.in_post_order {
            return;
        }
        for i in 0..2 * efa::device::route::BASE_RECV as u64 {
            q.post_recv(FILLER + i, BytesMut::with_capacity(room))
                .unwrap();
        }
    }

    /// Polls for `d` and returns whatever completes.
    fn poll_for(&self, qps: &mut [&mut Qp], d: Duration) -> Vec<(usize, DeviceCompletion)> {
        poll_for_with(qps, &|| self.pump(), d)
    }
}

/// Ten datagrams each way of UD and SRD: every send and receive completes once and successfully,
/// each datagram intact in the next posted buffer, with its immediate data and its source; the
/// device counts them. SRD delivers in order.
#[test]
fn datagrams_arrive_intact_once_with_imm_and_source() {
    for f in fixtures() {
        for ty in [QpType::Ud, QpType::Srd] {
            let k = f.name;
            let before = f.dev.stats();
            let mut a = f.qp(ty, |_| {});
            let mut b = f.qp(ty, |_| {});
            assert_eq!(a.qp_type(), ty);
            if ty == QpType::Srd {
                f.post_path_buffers(&mut b, 256);
            }
            for i in 0..10u64 {
                b.post_recv(100 + i, BytesMut::with_capacity(256)).unwrap();
            }
            let mut buffers_used = Vec::new();
            for i in 0..10u64 {
                let payload = vec![i as u8; i as usize * 10];
                let imm = (i % 2 == 0).then_some(i as u32 * 7);
                a.post_send(wr(i, b.addr(), b"hd", &payload, imm)).unwrap();
            }
            let got = f.poll_until(&mut [&mut a, &mut b], "datagrams", |c| c.len() >= 20);
            let (mut sends, mut recvd) = (Vec::new(), 0u64);
            for (q, c) in &got {
                assert_eq!(c.status, Status::Success, "{k} {ty:?}: {c:?}");
                if *q == 0 {
                    assert_eq!(c.opcode, Opcode::Send, "{k} {ty:?}");
                    sends.push(c.wr_id);
                    continue;
                }
                assert_eq!(c.opcode, Opcode::Recv, "{k} {ty:?}");
                let buf = c.buf.as_ref().unwrap();
                assert_eq!(buf.len(), c.byte_len, "{k} {ty:?}");
                assert_eq!(&buf[..2], b"hd", "{k} {ty:?}");
                let i = (buf.len() - 2) as u64 / 10;
                assert!(buf[2..].iter().all(|x| *x == i as u8), "{k}: payload {i}");
                if f.in_post_order || ty == QpType::Ud {
                    assert_eq!(c.wr_id, 100 + recvd, "{k} {ty:?}: buffers in order");
                }
                buffers_used.push(c.wr_id);
                if ty == QpType::Srd {
                    assert_eq!(i, recvd, "{k}: SRD delivers in order here");
                }
                assert_eq!(
                    c.imm,
                    i.is_multiple_of(2).then_some(i as u32 * 7),
                    "{k} {ty:?}"
                );
                let src = a.addr();
                assert_eq!(
                    c.src,
                    Some(Source {
                        gid: src.gid,
                        qpn: src.qpn
                    }),
                    "{k} {ty:?}"
                );
                recvd += 1;
            }
            sends.sort_unstable();
            assert_eq!(sends, (0..10).collect::<Vec<u64>>(), "{k} {ty:?}");
            assert_eq!(recvd, 10, "{k} {ty:?}");
            buffers_used.sort_unstable();
            buffers_used.dedup();
            assert_eq!(buffers_used.len(), 10, "{k} {ty:?}: each buffer once");
            let late = f.poll_for(&mut [&mut a, &mut b], Duration::from_millis(20));
            assert!(late.is_empty(), "{k} {ty:?}: exactly once: {late:?}");
            let s = f.dev.stats();
            assert_eq!(
                (s.tx_pkts - before.tx_pkts, s.rx_pkts - before.rx_pkts),
                (10, 10),
                "{k} {ty:?}: {s:?}"
            );
            if !f.in_post_order && ty == QpType::Srd {
                // The routing device's queue pairs of one host reach each other over shm.
                assert_eq!(
                    s.shm_route_tx_pkts - before.shm_route_tx_pkts,
                    10,
                    "{k}: {s:?}"
                );
            }
        }
    }
}

/// An SRD send to a queue pair with no receive buffer fails with `RnrRetryExceeded` after
/// `rnr_retry` retries (0, 1, 2), and the receiver never sees it, even once a buffer comes.
#[test]
fn srd_rnr_retry_exceeded() {
    for f in fixtures() {
        let k = f.name;
        let before = f.dev.stats();
        let mut rx = f.qp(QpType::Srd, |_| {});
        for rnr_retry in 0..=2u8 {
            let mut tx = f.qp(QpType::Srd, |a| a.rnr_retry = rnr_retry);
            tx.post_send(wr(9, rx.addr(), b"", b"nobody listens", None))
                .unwrap();
            let got = f.poll_until(&mut [&mut tx, &mut rx], "RNR failure", |c| !c.is_empty());
            assert_eq!(got.len(), 1, "{k}: {got:?}");
            let (q, c) = &got[0];
            assert_eq!(*q, 0, "{k}: the receiver must see nothing: {c:?}");
            assert_eq!(
                (c.wr_id, c.status),
                (9, Status::RnrRetryExceeded),
                "{k} rnr_retry {rnr_retry}"
            );
        }
        let s = f.dev.stats();
        assert!(s.rnr_events > before.rnr_events, "{k}: {s:?}");
        assert_eq!(s.rx_pkts, before.rx_pkts, "{k}: {s:?}");
        rx.post_recv(1, BytesMut::with_capacity(64)).unwrap();
        let late = f.poll_for(&mut [&mut rx], Duration::from_millis(50));
        assert!(late.is_empty(), "{k}: {late:?}");
    }
}

/// With `rnr_retry` 7 (for ever) an SRD send waits for a receive buffer and is delivered once,
/// intact with its immediate data, when one is posted.
#[test]
fn srd_rnr_forever_delivers_once_a_buffer_comes() {
    for f in fixtures() {
        let k = f.name;
        let mut rx = f.qp(QpType::Srd, |_| {});
        let mut tx = f.qp(QpType::Srd, |a| a.rnr_retry = 7);
        tx.post_send(wr(5, rx.addr(), b"h", b"late receiver", Some(3)))
            .unwrap();
        let early = f.poll_for(&mut [&mut tx, &mut rx], Duration::from_millis(30));
        assert!(early.is_empty(), "{k}: {early:?}");
        f.post_path_buffers(&mut rx, 64);
        rx.post_recv(1, BytesMut::with_capacity(64)).unwrap();
        let got = f.poll_until(&mut [&mut tx, &mut rx], "delivery after RNR", |c| {
            c.len() >= 2
        });
        for (q, c) in &got {
            assert_eq!(c.status, Status::Success, "{k}: {c:?}");
            if *q == 1 {
                assert_eq!(&c.buf.as_ref().unwrap()[..], b"hlate receiver", "{k}");
                assert_eq!(c.imm, Some(3), "{k}");
            } else {
                assert_eq!(c.wr_id, 5, "{k}");
            }
        }
        let late = f.poll_for(&mut [&mut tx, &mut rx], Duration::from_millis(20));
        assert!(late.is_empty(), "{k}: exactly once: {late:?}");
    }
}

/// Above the MTU (header and payload together) a send is refused with `MsgSize`; a full send
/// or receive queue says `Again`; closing flushes every outstanding work request exactly once,
/// handing receive buffers back, and later posts fail with `Closed`. UD sends complete when
/// sent; SRD sends to a queue pair without buffers stay outstanding until the close.
#[test]
fn msg_size_again_and_close_flushes() {
    for f in fixtures() {
        let k = f.name;
        let mtu = f.dev.attr().mtu;
        for ty in [QpType::Ud, QpType::Srd] {
            let mut q = f.qp(ty, |a| {
                a.send_depth = 4;
                a.recv_depth = 3;
                a.rnr_retry = 7;
            });
            let peer = f.qp(ty, |_| {});
            let dest = peer.addr();
            let e = q
                .post_send(wr(0, dest, b"x", &vec![0; mtu], None))
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::MsgSize, "{k} {ty:?}");
            let e = q
                .post_send(wr(0, dest, b"", &vec![0; mtu + 1], None))
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::MsgSize, "{k} {ty:?}");
            q.post_send(wr(0, dest, &[1; 8], &vec![0; mtu - 8], None))
                .unwrap();
            for i in 1..4 {
                q.post_send(wr(i, dest, b"", b"x", None)).unwrap();
            }
            let mut out = Vec::new();
            if ty == QpType::Ud {
                // UD sends complete once sent: collect them, which frees the queue.
                let mut qs = [&mut q];
                let got = f.poll_until(&mut qs, "UD sends", |c| c.len() >= 4);
                assert!(got.iter().all(|(_, c)| c.status == Status::Success), "{k}");
                out.extend(got.into_iter().map(|(_, c)| c));
                for i in 4..8 {
                    q.post_send(wr(i, dest, b"", b"x", None)).unwrap();
                }
                let got = f.poll_until(&mut [&mut q], "UD sends", |c| c.len() >= 4);
                out.extend(got.into_iter().map(|(_, c)| c));
            } else {
                let e = q.post_send(wr(99, dest, b"", b"x", None)).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Again, "{k} {ty:?}");
            }
            for i in 0..3 {
                q.post_recv(10 + i, BytesMut::with_capacity(16 + i as usize))
                    .unwrap();
            }
            let e = q.post_recv(99, BytesMut::with_capacity(16)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Again, "{k} {ty:?}");
            q.close();
            for e in [
                q.post_send(wr(0, dest, b"", b"x", None)).unwrap_err(),
                q.post_recv(0, BytesMut::new()).unwrap_err(),
            ] {
                assert_eq!(e.kind(), ErrorKind::Closed, "{k} {ty:?}");
            }
            let mut flushed = Vec::new();
            q.poll(&mut flushed, 100);
            let mut sends: Vec<u64> = out.iter().map(|c| c.wr_id).collect();
            let mut recvs = Vec::new();
            for c in &flushed {
                assert_eq!(c.status, Status::Flushed, "{k} {ty:?}: {c:?}");
                match c.opcode {
                    Opcode::Send => sends.push(c.wr_id),
                    Opcode::Recv => {
                        let b = c.buf.as_ref().expect("receive buffer handed back");
                        assert_eq!(b.capacity(), 16 + (c.wr_id - 10) as usize, "{k}");
                        recvs.push(c.wr_id);
                    }
                    o => panic!("{k} {ty:?}: unexpected opcode {o:?}"),
                }
            }
            sends.sort_unstable();
            recvs.sort_unstable();
            let want: Vec<u64> = if ty == QpType::Ud {
                (0..8).collect()
            } else {
                (0..4).collect()
            };
            assert_eq!(sends, want, "{k} {ty:?}: every send once");
            assert_eq!(recvs, [10, 11, 12], "{k} {ty:?}: every receive once");
            q.close();
            flushed.clear();
            assert_eq!(q.poll(&mut flushed, 100), 0, "{k} {ty:?}: nothing twice");
        }
    }
}

/// A datagram longer than the receive buffer: the buffer completes with `LocalBadLength` (and
/// the datagram's length), is handed back, and the next buffer is not consumed by it (no
/// retransmission lands there). The SRD sender learns `RemoteBadLength` on the software
/// devices; EFA's sender sees success (its NIC copies into a bounce buffer that fits).
#[test]
fn short_receive_buffer() {
    for f in fixtures() {
        let k = f.name;
        for ty in [QpType::Ud, QpType::Srd] {
            let mut a = f.qp(ty, |_| {});
            let mut b = f.qp(ty, |_| {});
            if ty == QpType::Srd {
                // Short too: whichever of them the datagram's path gives it is too short.
                f.post_path_buffers(&mut b, 10);
            }
            b.post_recv(1, BytesMut::with_capacity(10)).unwrap();
            b.post_recv(2, BytesMut::with_capacity(100)).unwrap();
            a.post_send(wr(7, b.addr(), b"", &[5; 50], None)).unwrap();
            let got = f.poll_until(&mut [&mut a, &mut b], "bad length", |c| c.len() >= 2);
            for (q, c) in &got {
                if *q == 1 {
                    // The first buffer, or on a routing device the first of the datagram's path.
                    let first = if f.in_post_order || ty == QpType::Ud {
                        1
                    } else {
                        c.wr_id.max(FILLER)
                    };
                    assert_eq!(
                        (c.wr_id, c.status, c.opcode),
                        (first, Status::LocalBadLength, Opcode::Recv),
                        "{k} {ty:?}"
                    );
                    assert_eq!(c.status.error_kind(), ErrorKind::MsgSize);
                    assert_eq!(c.byte_len, 50, "{k} {ty:?}");
                    assert!(c.buf.as_ref().is_some_and(|b| b.capacity() >= 10));
                } else {
                    let want = if ty == QpType::Srd && f.kind() != DeviceKind::Efa {
                        Status::RemoteBadLength
                    } else {
                        Status::Success
                    };
                    assert_eq!((c.wr_id, c.status), (7, want), "{k} {ty:?}");
                }
            }
            let late = f.poll_for(&mut [&mut a, &mut b], Duration::from_millis(50));
            assert!(late.is_empty(), "{k} {ty:?}: {late:?}");
        }
    }
}

/// A datagram with the wrong QKEY is dropped (and counted as stale by the software devices); a
/// UD send completes anyway, an SRD send fails as unresponsive. The right QKEY still works.
#[test]
fn wrong_qkey_is_dropped_and_counted() {
    for f in fixtures() {
        let k = f.name;
        for ty in [QpType::Ud, QpType::Srd] {
            let mut a = f.qp(ty, |_| {});
            let mut b = f.qp(ty, |_| {});
            if ty == QpType::Srd {
                f.post_path_buffers(&mut b, 64);
            }
            b.post_recv(1, BytesMut::with_capacity(64)).unwrap();
            let before = f.dev.stats().stale_dropped;
            let mut wrong = b.addr();
            wrong.qkey ^= 0x55;
            a.post_send(wr(3, wrong, b"", b"stale", None)).unwrap();
            let got = f.poll_until(&mut [&mut a, &mut b], "stale", |c| !c.is_empty());
            assert_eq!(got.len(), 1, "{k} {ty:?}: {got:?}");
            assert_eq!(got[0].0, 0, "{k}: the receiver must not deliver: {got:?}");
            let want = if ty == QpType::Ud {
                Status::Success
            } else {
                Status::UnresponsiveRemote
            };
            assert_eq!(got[0].1.status, want, "{k} {ty:?}");
            // An EFA NIC drops it in hardware, where no host counter sees it.
            let s = f.dev.stats();
            assert!(
                s.stale_dropped > before || f.kind() == DeviceKind::Efa,
                "{k} {ty:?}: {s:?}"
            );
            a.post_send(wr(4, b.addr(), b"", b"fresh", None)).unwrap();
            let got = f.poll_until(&mut [&mut a, &mut b], "fresh", |c| c.len() >= 2);
            assert!(
                got.iter().all(|(_, c)| c.status == Status::Success),
                "{k} {ty:?}: {got:?}"
            );
        }
    }
}

/// Every device refuses a queue pair with an empty queue or an RNR retry count above 7, with
/// `InvalidArgument`, and creates one with retry 7 (for ever).
#[test]
fn queue_pair_attributes_are_checked() {
    for f in fixtures() {
        let k = f.name;
        for (what, set) in [
            (
                "send depth 0",
                &(|a: &mut QpAttr| a.send_depth = 0) as &dyn Fn(&mut QpAttr),
            ),
            ("receive depth 0", &|a: &mut QpAttr| a.recv_depth = 0),
            ("rnr_retry 8", &|a: &mut QpAttr| a.rnr_retry = 8),
        ] {
            let mut a = QpAttr::new(QpType::Srd);
            set(&mut a);
            let e = f.dev.create_qp(a).map(|_| ()).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{k} {what}: {e}");
        }
        f.qp(QpType::Srd, |a| a.rnr_retry = 7);
    }
}
