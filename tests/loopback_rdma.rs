//! One-sided RDMA on the loopback device, and the memory-region core it rests on: reads and writes
//! complete while the target never polls, every remote access is checked against key, bounds and
//! access rights, writes with immediate data complete exactly once at the target under faults, and
//! closing a region while remote writes race is safe. Randomised tests print their seed
//! (`EFA_TEST_SEED=<seed>` replays one).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::{
    Device, DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, RemoteIov, Status,
    UNSOLICITED_WR_ID,
};
use efa::fault::test_seed;
use efa::notify::Notifier;
use efa::{Access, Config, Domain, ErrorKind, FaultConfig, MemoryRegion, RemoteKey};

type Qp = Box<dyn QueuePair>;

/// Generous: only there to fail instead of hanging.
const DEADLINE: Duration = Duration::from_secs(60);

/// One device with a domain on it.
struct Node {
    dev: Arc<LoopbackDevice>,
    domain: Domain,
}

fn node(net: &LoopbackNetwork, cfg: LoopbackConfig) -> Node {
    let dev = LoopbackDevice::open(net, cfg).expect("open loopback device");
    let domain = Domain::with_device(dev.clone(), Config::default());
    Node { dev, domain }
}

fn qp(n: &Node, f: impl FnOnce(&mut QpAttr)) -> Qp {
    let mut attr = QpAttr::new(QpType::Srd);
    f(&mut attr);
    n.dev.create_qp(attr).expect("create_qp")
}

/// A region of `len` bytes, each `fill`.
fn region(n: &Node, len: usize, fill: u8, access: Access) -> MemoryRegion {
    n.domain
        .register(vec![fill; len], access)
        .expect("register")
}

fn iov(rk: &RemoteKey, offset: u64, len: u64) -> RemoteIov {
    RemoteIov {
        addr: rk.addr.wrapping_add(offset),
        len,
        key: rk.key,
    }
}

/// Polls `q` until it yields `n` completions, pumping the network and moving a manual clock.
fn poll_n(net: &LoopbackNetwork, q: &mut Qp, n: usize, what: &str) -> Vec<DeviceCompletion> {
    let t0 = Instant::now();
    let mut v = Vec::new();
    while v.len() < n {
        assert!(
            t0.elapsed() < DEADLINE,
            "{what}: {} of {n} completions",
            v.len()
        );
        if net.has_manual_clock() {
            net.advance(Duration::from_micros(100)).unwrap();
        }
        net.pump();
        let room = n - v.len();
        q.poll(&mut v, room);
        std::thread::yield_now();
    }
    v
}

fn poll_all(q: &mut Qp) -> Vec<DeviceCompletion> {
    let mut v = Vec::new();
    while q.poll(&mut v, 64) > 0 {}
    v
}

/// Posts a write of `data` and returns its completion.
fn write(
    net: &LoopbackNetwork,
    q: &mut Qp,
    dest: efa::RawAddr,
    data: &[u8],
    to: RemoteIov,
) -> DeviceCompletion {
    q.post_write(7, dest, Bytes::copy_from_slice(data), to, None)
        .expect("post_write");
    poll_n(net, q, 1, "write").pop().unwrap()
}

/// Posts a read into a fresh buffer and returns its completion.
fn read(
    net: &LoopbackNetwork,
    q: &mut Qp,
    dest: efa::RawAddr,
    from: RemoteIov,
) -> DeviceCompletion {
    q.post_read(8, dest, BytesMut::with_capacity(from.len as usize), from)
        .expect("post_read");
    poll_n(net, q, 1, "read").pop().unwrap()
}

#[test]
fn write_and_read_complete_without_the_target_polling() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = node(&net, LoopbackConfig::default());
    let b = node(&net, LoopbackConfig::default());
    let mut ia = qp(&a, |_| {});
    // The target only creates its queue pair and registers its region; it never polls.
    let tb = qp(&b, |_| {});
    let mr = region(&b, 4096, 0x11, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let rk = mr.remote_key().unwrap();

    let data: Vec<u8> = (0..100u8).collect();
    let c = write(&net, &mut ia, tb.addr(), &data, iov(&rk, 1000, 100));
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (7, Status::Success, Opcode::RdmaWrite, 100)
    );
    assert!(c.buf.is_none());
    {
        let mem = mr.read();
        assert_eq!(&mem[1000..1100], &data[..]);
        assert!(
            mem[..1000].iter().all(|&x| x == 0x11),
            "bytes before the range"
        );
        assert!(
            mem[1100..].iter().all(|&x| x == 0x11),
            "bytes after the range"
        );
    }

    let c = read(&net, &mut ia, tb.addr(), iov(&rk, 990, 200));
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (8, Status::Success, Opcode::RdmaRead, 200)
    );
    let buf = c.buf.expect("a read hands its buffer back");
    assert_eq!(buf.len(), 200);
    assert!(buf[..10].iter().all(|&x| x == 0x11));
    assert_eq!(&buf[10..110], &data[..]);
    assert!(buf[110..].iter().all(|&x| x == 0x11));

    // A whole-region read, and a zero-length write at the end of the region.
    let c = read(&net, &mut ia, tb.addr(), iov(&rk, 0, 4096));
    assert_eq!(&c.buf.unwrap()[..], &mr.read()[..]);
    let c = write(&net, &mut ia, tb.addr(), &[], iov(&rk, 4096, 0));
    assert_eq!(c.status, Status::Success);

    let st = a.dev.stats();
    assert_eq!((st.rdma_ops, st.rdma_bytes), (4, 100 + 200 + 4096));
    // Nothing for the target: plain writes and reads produce no target completion.
    let mut tb = tb;
    assert!(poll_all(&mut tb).is_empty());
}

#[test]
fn rdma_on_own_device_and_own_queue_pair() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = node(&net, LoopbackConfig::default());
    let mut q = qp(&a, |_| {});
    let mr = region(&a, 64, 0, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let rk = mr.remote_key().unwrap();
    let me = q.addr();
    assert!(
        write(&net, &mut q, me, b"self", iov(&rk, 4, 4))
            .status
            .is_ok()
    );
    assert_eq!(&mr.read()[4..8], b"self");
    let c = read(&net, &mut q, me, iov(&rk, 4, 4));
    assert_eq!(&c.buf.unwrap()[..], b"self");
}

#[test]
fn bad_remote_accesses_fail_and_touch_nothing() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = node(&net, LoopbackConfig::default());
    let b = node(&net, LoopbackConfig::default());
    let mut ia = qp(&a, |_| {});
    let tb = qp(&b, |_| {});
    let dest = tb.addr();
    let rw = region(&b, 256, 0x22, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let wo = region(&b, 256, 0x33, Access::REMOTE_WRITE);
    let ro = region(&b, 256, 0x44, Access::REMOTE_READ);
    let local = region(&b, 256, 0x55, Access::LOCAL);
    let (rk, wk, rok) = (
        rw.remote_key().unwrap(),
        wo.remote_key().unwrap(),
        ro.remote_key().unwrap(),
    );
    let local_iov = RemoteIov {
        addr: rk.addr,
        len: 8,
        key: local.key(),
    };
    let snapshot =
        |mrs: &[&MemoryRegion]| -> Vec<Vec<u8>> { mrs.iter().map(|m| m.read().to_vec()).collect() };
    let all = [&rw, &wo, &ro, &local];
    let before = snapshot(&all);

    let unknown = RemoteIov {
        key: rk.key ^ 0xdead_0000,
        ..iov(&rk, 0, 8)
    };
    let cases: Vec<(&str, RemoteIov)> = vec![
        ("unknown key", unknown),
        ("start before the region", iov(&rk, u64::MAX, 8)), // rk.addr - 1
        ("end after the region", iov(&rk, 252, 8)),
        ("start after the region", iov(&rk, 256, 1)),
        (
            "address u64::MAX",
            RemoteIov {
                addr: u64::MAX,
                ..iov(&rk, 0, 8)
            },
        ),
        (
            "address 0",
            RemoteIov {
                addr: 0,
                ..iov(&rk, 0, 8)
            },
        ),
        ("local-only region", local_iov),
        (
            "key of another device's region",
            RemoteIov {
                key: rk.key,
                ..iov(&rk, 0, 8)
            },
        ),
    ];
    // The last case goes to a queue pair on another device (a's), which has no such key.
    let other = qp(&a, |_| {});
    let other_dev = other.addr();
    for (i, (what, to)) in cases.iter().enumerate() {
        let d = if i == cases.len() - 1 {
            other_dev
        } else {
            dest
        };
        let c = write(&net, &mut ia, d, &[9u8; 8][..to.len as usize], *to);
        assert_eq!(c.status, Status::RemoteBadAddress, "write: {what}");
        assert_eq!(c.status.error_kind(), ErrorKind::RemoteAccess);
        let c = read(&net, &mut ia, d, *to);
        assert_eq!(c.status, Status::RemoteBadAddress, "read: {what}");
        assert_eq!(c.opcode, Opcode::RdmaRead);
        assert!(c.buf.is_some(), "read: {what}: buffer handed back");
    }
    // Missing rights: read of a write-only region, write of a read-only region.
    let c = read(&net, &mut ia, dest, iov(&wk, 0, 8));
    assert_eq!(
        c.status,
        Status::RemoteBadAddress,
        "read of a write-only region"
    );
    let c = write(&net, &mut ia, dest, &[9u8; 8], iov(&rok, 0, 8));
    assert_eq!(
        c.status,
        Status::RemoteBadAddress,
        "write of a read-only region"
    );
    // The rights that are there work.
    assert!(read(&net, &mut ia, dest, iov(&rok, 0, 8)).status.is_ok());
    assert_eq!(snapshot(&all), before, "no target memory changed");
    assert!(
        write(&net, &mut ia, dest, &[9u8; 8], iov(&wk, 0, 8))
            .status
            .is_ok()
    );
    assert_eq!(&wo.read()[..8], &[9u8; 8]);
    assert_eq!(a.dev.stats().rdma_ops, 2);
}

#[test]
fn revoked_keys_fail_and_are_never_reused() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = node(&net, LoopbackConfig::default());
    let b = node(&net, LoopbackConfig::default());
    let mut ia = qp(&a, |_| {});
    let tb = qp(&b, |_| {});
    let dest = tb.addr();

    // Closed: the key is revoked, and the memory handed back is not written.
    let mr = region(&b, 64, 0x66, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let rk = mr.remote_key().unwrap();
    assert!(
        write(&net, &mut ia, dest, b"live", iov(&rk, 0, 4))
            .status
            .is_ok()
    );
    let buf = mr.close();
    assert_eq!(&buf[..4], b"live");
    let c = write(&net, &mut ia, dest, b"dead", iov(&rk, 0, 4));
    assert_eq!(c.status, Status::RemoteBadAddress);
    let c = read(&net, &mut ia, dest, iov(&rk, 0, 4));
    assert_eq!(c.status, Status::RemoteBadAddress);
    assert_eq!(&buf[..4], b"live");
    assert!(buf[4..].iter().all(|&x| x == 0x66));

    // Dropped: the same.
    let mr = region(&b, 64, 0, Access::REMOTE_WRITE);
    let rk2 = mr.remote_key().unwrap();
    drop(mr);
    let c = write(&net, &mut ia, dest, b"dead", iov(&rk2, 0, 4));
    assert_eq!(c.status, Status::RemoteBadAddress);

    // Keys are unique on the network and never reused, across devices and registrations.
    let mut keys = HashSet::from([rk.key, rk2.key]);
    for i in 0..200 {
        let n = if i % 2 == 0 { &a } else { &b };
        let m = region(n, 8, 0, Access::REMOTE_WRITE);
        assert!(keys.insert(m.key()), "key {} handed out twice", m.key());
    }
    // A fresh region at (possibly) the same address does not answer to an old key.
    let fresh = region(&b, 64, 0x77, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let old = RemoteIov {
        addr: fresh.remote_key().unwrap().addr,
        len: 4,
        key: rk.key,
    };
    assert_eq!(
        write(&net, &mut ia, dest, b"dead", old).status,
        Status::RemoteBadAddress
    );
    assert!(fresh.read().iter().all(|&x| x == 0x77));
}

#[test]
fn posts_are_checked() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let cfg = LoopbackConfig::default().with_max_rdma_size(64);
    let a = node(&net, cfg.clone());
    let b = node(&net, cfg);
    let mut ia = qp(&a, |_| {});
    let tb = qp(&b, |_| {});
    let mr = region(&b, 256, 0, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let rk = mr.remote_key().unwrap();
    let kind = |r: efa::Result<()>| r.unwrap_err().kind();

    // Above max_rdma_size: MsgSize at post.
    assert_eq!(
        kind(ia.post_write(
            1,
            tb.addr(),
            Bytes::from(vec![0u8; 65]),
            iov(&rk, 0, 65),
            None
        )),
        ErrorKind::MsgSize
    );
    assert_eq!(
        kind(ia.post_read(1, tb.addr(), BytesMut::with_capacity(65), iov(&rk, 0, 65))),
        ErrorKind::MsgSize
    );
    // Lengths that disagree: InvalidArgument.
    assert_eq!(
        kind(ia.post_write(
            1,
            tb.addr(),
            Bytes::from(vec![0u8; 8]),
            iov(&rk, 0, 9),
            None
        )),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        kind(ia.post_read(1, tb.addr(), BytesMut::with_capacity(4), iov(&rk, 0, 8))),
        ErrorKind::InvalidArgument
    );
    // A read fills exactly remote.len bytes, whatever room the buffer has beyond them.
    let c = {
        ia.post_read(2, tb.addr(), BytesMut::with_capacity(100), iov(&rk, 0, 8))
            .unwrap();
        poll_n(&net, &mut ia, 1, "read").pop().unwrap()
    };
    assert_eq!(
        (c.status, c.byte_len, c.buf.unwrap().len()),
        (Status::Success, 8, 8)
    );
    // Not refused posts produced no completion.
    assert!(poll_all(&mut ia).is_empty());

    // UD queue pairs have no RDMA.
    let mut ud = a.dev.create_qp(QpAttr::new(QpType::Ud)).unwrap();
    assert_eq!(
        kind(ud.post_write(1, tb.addr(), Bytes::from_static(b"x"), iov(&rk, 0, 1), None)),
        ErrorKind::NotSupported
    );
    // Closed queue pairs refuse.
    ia.close();
    assert_eq!(
        kind(ia.post_read(1, tb.addr(), BytesMut::with_capacity(1), iov(&rk, 0, 1))),
        ErrorKind::Closed
    );

    // Without RDMA: NotSupported, and the domain makes up software keys.
    let plain = node(&net, LoopbackConfig::default().with_rdma(false));
    let mut p = qp(&plain, |_| {});
    assert_eq!(
        kind(p.post_write(1, tb.addr(), Bytes::from_static(b"x"), iov(&rk, 0, 1), None)),
        ErrorKind::NotSupported
    );
    assert_eq!(
        kind(p.post_read(1, tb.addr(), BytesMut::with_capacity(1), iov(&rk, 0, 1))),
        ErrorKind::NotSupported
    );
    // A device with RDMA reaching one without: UnsupportedOp.
    let tp = qp(&plain, |_| {});
    let soft = region(&plain, 8, 0, Access::REMOTE_WRITE);
    let srk = soft.remote_key().unwrap();
    let mut ib = qp(&b, |_| {});
    let c = write(&net, &mut ib, tp.addr(), b"x", iov(&srk, 0, 1));
    assert_eq!(c.status, Status::UnsupportedOp);
    assert_eq!(soft.read()[0], 0);
}

#[test]
fn unreachable_targets_fail_like_sends() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let cfg = LoopbackConfig::default().with_unresponsive_timeout(Duration::ZERO);
    let a = node(&net, cfg.clone());
    let b = node(&net, cfg);
    let mut ia = qp(&a, |_| {});
    let mut tb = qp(&b, |_| {});
    let mr = region(&b, 8, 0, Access::REMOTE_WRITE);
    let rk = mr.remote_key().unwrap();
    let mut wrong_qkey = tb.addr();
    wrong_qkey.qkey ^= 1;
    let c = write(&net, &mut ia, wrong_qkey, b"x", iov(&rk, 0, 1));
    assert_eq!(c.status, Status::UnresponsiveRemote);
    let dest = tb.addr();
    tb.close();
    let c = write(&net, &mut ia, dest, b"x", iov(&rk, 0, 1));
    assert_eq!(c.status, Status::UnresponsiveRemote);
    assert_eq!(mr.read()[0], 0);
}

/// Runs `n` writes with immediate data `1000 + i` (8 bytes each, at offset `8 * i`) from a fresh
/// initiator to a target that polls only at the end, under seeded faults; checks the data and
/// returns the target's completions.
fn writes_with_imm(
    seed: u64,
    cfg: LoopbackConfig,
    n: usize,
    recv_bufs: usize,
) -> (Vec<DeviceCompletion>, Vec<DeviceCompletion>) {
    let faults = FaultConfig::seeded(seed)
        .drop(0.2)
        .duplicate(0.2)
        .reorder(0.3)
        .delay(0.2, Duration::from_millis(2));
    let net = LoopbackNetwork::with_manual_clock(faults);
    let a = node(&net, cfg.clone());
    let b = node(&net, cfg);
    let mut ia = qp(&a, |at| at.send_depth = n);
    let mut tb = qp(&b, |at| at.recv_depth = recv_bufs.max(1));
    for i in 0..recv_bufs {
        let mut buf = BytesMut::with_capacity(16);
        buf.extend_from_slice(b"untouched");
        tb.post_recv(5000 + i as u64, buf).unwrap();
    }
    let mr = region(&b, 8 * n, 0, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let rk = mr.remote_key().unwrap();
    for i in 0..n {
        let data = Bytes::copy_from_slice(&(i as u64 + 1).to_le_bytes());
        ia.post_write(
            i as u64,
            tb.addr(),
            data,
            iov(&rk, 8 * i as u64, 8),
            Some(1000 + i as u32),
        )
        .unwrap();
    }
    let init = poll_n(&net, &mut ia, n, &format!("seed {seed}: initiator"));
    let mut ids: Vec<u64> = init.iter().map(|c| c.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (0..n as u64).collect::<Vec<_>>(),
        "seed {seed}: each write completes once"
    );
    assert!(
        init.iter()
            .all(|c| c.status.is_ok() && c.opcode == Opcode::RdmaWrite),
        "seed {seed}: {init:?}"
    );
    assert_eq!(net.in_flight(), 0, "seed {seed}");
    {
        let mem = mr.read();
        for i in 0..n {
            assert_eq!(
                mem[8 * i..8 * i + 8],
                (i as u64 + 1).to_le_bytes(),
                "seed {seed}: data of write {i}"
            );
        }
    }
    // Only now does the target look.
    let target = poll_all(&mut tb);
    assert_eq!(
        target.len(),
        n,
        "seed {seed}: exactly one target completion per write"
    );
    let mut imms: Vec<u32> = target.iter().map(|c| c.imm.unwrap()).collect();
    imms.sort_unstable();
    assert_eq!(
        imms,
        (1000..1000 + n as u32).collect::<Vec<_>>(),
        "seed {seed}"
    );
    for c in &target {
        assert_eq!(
            (c.status, c.opcode, c.byte_len),
            (Status::Success, Opcode::RecvRdmaWithImm, 8),
            "seed {seed}"
        );
        assert_eq!(c.src.unwrap().qpn, ia.addr().qpn);
    }
    (init, target)
}

#[test]
fn writes_with_imm_complete_once_at_the_target_unsolicited() {
    let seed = test_seed();
    println!("seed {seed} (EFA_TEST_SEED={seed} replays)");
    let (_, target) = writes_with_imm(seed, LoopbackConfig::default(), 300, 0);
    for c in &target {
        assert_eq!(c.wr_id, UNSOLICITED_WR_ID, "seed {seed}");
        assert!(c.buf.is_none(), "seed {seed}: no buffer consumed");
    }
}

#[test]
fn writes_with_imm_consume_receive_buffers_without_unsolicited_write_recv() {
    let seed = test_seed();
    println!("seed {seed} (EFA_TEST_SEED={seed} replays)");
    let cfg = LoopbackConfig::default().with_unsolicited_write_recv(false);
    let n = 200;
    // Fewer buffers than writes would leave writes waiting (rnr_retry 7 retries forever), so
    // post exactly one per write, plus spares that must stay posted.
    let (_, target) = writes_with_imm(seed, cfg, n, n + 3);
    let mut ids: Vec<u64> = target.iter().map(|c| c.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (5000..5000 + n as u64).collect::<Vec<_>>(),
        "seed {seed}: buffers in posting order"
    );
    for c in &target {
        assert_eq!(
            &c.buf.as_ref().expect("the buffer comes back")[..],
            b"untouched",
            "seed {seed}: the data went to the region, not the buffer"
        );
    }
}

#[test]
fn write_with_imm_and_no_buffer_is_receiver_not_ready() {
    let net = LoopbackNetwork::with_manual_clock(FaultConfig::default());
    let cfg = LoopbackConfig::default().with_unsolicited_write_recv(false);
    let a = node(&net, cfg.clone());
    let b = node(&net, cfg);
    assert!(!a.dev.attr().caps.unsolicited_write_recv);
    let mut ia = qp(&a, |at| at.rnr_retry = 2);
    let mut tb = qp(&b, |_| {});
    let mr = region(&b, 16, 0, Access::REMOTE_WRITE);
    let rk = mr.remote_key().unwrap();

    // A write without immediate data needs no buffer.
    assert!(
        write(&net, &mut ia, tb.addr(), b"plain", iov(&rk, 0, 5))
            .status
            .is_ok()
    );
    // With immediate data and no buffer: refused, retried twice, then RnrRetryExceeded; nothing
    // written.
    ia.post_write(
        9,
        tb.addr(),
        Bytes::from_static(b"imm!"),
        iov(&rk, 8, 4),
        Some(1),
    )
    .unwrap();
    let c = poll_n(&net, &mut ia, 1, "rnr").pop().unwrap();
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (9, Status::RnrRetryExceeded, Opcode::RdmaWrite)
    );
    assert_eq!(c.status.error_kind(), ErrorKind::NoRx);
    assert!(mr.read()[8..].iter().all(|&x| x == 0));
    assert!(poll_all(&mut tb).is_empty());
    assert_eq!(b.dev.stats().rnr_events, 3);
    assert_eq!(a.dev.stats().rnr_naks_received, 3);

    // A buffer posted before the retries run out is consumed by the write.
    ia.post_write(
        10,
        tb.addr(),
        Bytes::from_static(b"imm!"),
        iov(&rk, 8, 4),
        Some(2),
    )
    .unwrap();
    tb.post_recv(77, BytesMut::with_capacity(4)).unwrap();
    let c = poll_n(&net, &mut ia, 1, "retry").pop().unwrap();
    assert_eq!((c.wr_id, c.status), (10, Status::Success));
    assert_eq!(&mr.read()[8..12], b"imm!");
    let t = poll_all(&mut tb);
    assert_eq!(t.len(), 1);
    assert_eq!(
        (t[0].wr_id, t[0].opcode, t[0].imm, t[0].byte_len),
        (77, Opcode::RecvRdmaWithImm, Some(2), 4)
    );
    assert!(t[0].buf.as_ref().unwrap().is_empty());
}

#[test]
fn region_guards() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = node(&net, LoopbackConfig::default());
    let mut mr = region(&a, 8, 0, Access::SEND | Access::REMOTE_READ);
    assert_eq!(mr.len(), 8);
    assert!(!mr.is_empty());
    mr.write()[..3].copy_from_slice(b"abc");
    {
        // Several readers at once.
        let (r1, r2) = (mr.read(), mr.read());
        assert_eq!(&r1[..3], b"abc");
        assert_eq!(&r2[..], &r1[..]);
    }
    let rk = mr.remote_key().unwrap();
    assert_eq!((rk.len, rk.key), (8, mr.key()));
    assert!(format!("{mr:?}").contains("key"));
    let buf = mr.close();
    assert_eq!(&buf[..], b"abc\0\0\0\0\0");
}

#[test]
fn domain_remote_write_and_read_check_key_bounds_and_rights() {
    for rdma in [true, false] {
        let net = LoopbackNetwork::new(FaultConfig::default());
        let a = node(&net, LoopbackConfig::default().with_rdma(rdma));
        let d = &a.domain;
        let mut rw = region(&a, 64, 0x10, Access::REMOTE_READ | Access::REMOTE_WRITE);
        let wo = region(&a, 64, 0x20, Access::REMOTE_WRITE);
        let ro = region(&a, 64, 0x30, Access::REMOTE_READ);
        let (rk, wk, rok) = (
            rw.remote_key().unwrap(),
            wo.remote_key().unwrap(),
            ro.remote_key().unwrap(),
        );
        d.remote_write(rk.key, rk.addr + 60, b"tail").unwrap();
        assert_eq!(&rw.read()[60..], b"tail");
        assert_eq!(
            &d.remote_read(rk.key, rk.addr + 58, 6).unwrap()[..],
            b"\x10\x10tail"
        );
        assert_eq!(d.remote_read(rk.key, rk.addr + 64, 0).unwrap().len(), 0);
        let before: Vec<Vec<u8>> = [&rw, &wo, &ro].iter().map(|m| m.read().to_vec()).collect();
        let kind = |r: efa::Result<()>| r.unwrap_err().kind();
        let rkind = |r: efa::Result<Bytes>| r.unwrap_err().kind();
        for (what, r) in [
            ("end after", d.remote_write(rk.key, rk.addr + 61, b"tail")),
            ("start before", d.remote_write(rk.key, rk.addr - 1, b"x")),
            ("address u64::MAX", d.remote_write(rk.key, u64::MAX, b"xy")),
            (
                "unknown key",
                d.remote_write(rk.key ^ 0xffff_0000, rk.addr, b"x"),
            ),
            ("read-only region", d.remote_write(rok.key, rok.addr, b"x")),
        ] {
            assert_eq!(
                kind(r),
                ErrorKind::RemoteAccess,
                "remote_write: {what} (rdma {rdma})"
            );
        }
        for (what, r) in [
            ("end after", d.remote_read(rk.key, rk.addr + 1, 64)),
            ("start before", d.remote_read(rk.key, rk.addr - 1, 2)),
            (
                "length u64::MAX (overflow)",
                d.remote_read(rk.key, rk.addr + 1, u64::MAX),
            ),
            ("address u64::MAX", d.remote_read(rk.key, u64::MAX, 1)),
            (
                "unknown key",
                d.remote_read(rk.key ^ 0xffff_0000, rk.addr, 1),
            ),
            ("write-only region", d.remote_read(wk.key, wk.addr, 1)),
        ] {
            assert_eq!(
                rkind(r),
                ErrorKind::RemoteAccess,
                "remote_read: {what} (rdma {rdma})"
            );
        }
        let after: Vec<Vec<u8>> = [&rw, &wo, &ro].iter().map(|m| m.read().to_vec()).collect();
        assert_eq!(before, after, "nothing changed (rdma {rdma})");

        // Never blocks on a guard: a write waits for a read guard with Again; reads share it.
        {
            let g = ro.read();
            let gw = wo.read();
            assert_eq!(
                kind(d.remote_write(wk.key, wk.addr, b"x")),
                ErrorKind::Again
            );
            assert_eq!(d.remote_read(rok.key, rok.addr, 1).unwrap()[0], g[0]);
            drop(gw);
        }
        {
            let _g = rw.write();
            assert_eq!(rkind(d.remote_read(rk.key, rk.addr, 1)), ErrorKind::Again);
        }
        d.remote_write(wk.key, wk.addr, b"x").unwrap();

        // Revoked: after close and after drop.
        let buf = rw.close();
        assert_eq!(
            kind(d.remote_write(rk.key, rk.addr, b"x")),
            ErrorKind::RemoteAccess
        );
        assert_eq!(
            rkind(d.remote_read(rk.key, rk.addr, 1)),
            ErrorKind::RemoteAccess
        );
        assert_eq!(&buf[60..], b"tail");
        drop(wo);
        assert_eq!(
            kind(d.remote_write(wk.key, wk.addr, b"x")),
            ErrorKind::RemoteAccess
        );
        assert!(
            d.verify_remote(rok.key, rok.addr, 64, Access::REMOTE_READ)
                .is_ok()
        );
    }
}

#[test]
fn a_held_guard_delays_remote_access_without_deadlock() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let a = node(&net, LoopbackConfig::default());
    let b = node(&net, LoopbackConfig::default());
    let notifier = Arc::new(Notifier::new());
    let n2 = notifier.clone();
    let mut ia = qp(&a, move |at| at.notifier = n2);
    let tb = qp(&b, |_| {});
    let mut mr = region(&b, 16, 0, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let rk = mr.remote_key().unwrap();

    // Same thread: the write waits while this thread holds a guard and polls; no deadlock.
    {
        let g = mr.read();
        ia.post_write(
            1,
            tb.addr(),
            Bytes::from_static(b"abcd"),
            iov(&rk, 0, 4),
            None,
        )
        .unwrap();
        let mut v = Vec::new();
        for _ in 0..100 {
            ia.poll(&mut v, 4);
        }
        assert!(v.is_empty(), "completed while a read guard was held");
        assert_eq!(&g[..4], &[0; 4]);
        assert!(net.in_flight() > 0);
    }
    let c = poll_n(&net, &mut ia, 1, "after the guard").pop().unwrap();
    assert_eq!(c.status, Status::Success);
    assert_eq!(&mr.read()[..4], b"abcd");

    // Another thread sleeps on its notifier; dropping the guard wakes it.
    let dest = tb.addr();
    let g = mr.write();
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let t = std::thread::spawn(move || {
        ia.post_write(2, dest, Bytes::from_static(b"wxyz"), iov(&rk, 4, 4), None)
            .unwrap();
        let t0 = Instant::now();
        let mut v = Vec::new();
        loop {
            let seen = notifier.generation();
            if ia.poll(&mut v, 4) > 0 {
                break;
            }
            assert!(t0.elapsed() < DEADLINE, "never woken");
            // No polling loop: only the guard's release can wake this thread.
            notifier.wait_until(seen, None);
        }
        done2.store(true, Ordering::SeqCst);
        v.pop().unwrap()
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !done.load(Ordering::SeqCst),
        "completed while a write guard was held"
    );
    drop(g);
    let c = t.join().unwrap();
    assert_eq!((c.wr_id, c.status), (2, Status::Success));
    assert_eq!(&mr.read()[..8], b"abcdwxyz");
}

#[test]
fn close_races_remote_writes() {
    for round in 0..20 {
        let net = LoopbackNetwork::new(FaultConfig::default());
        let a = node(&net, LoopbackConfig::default());
        let b = node(&net, LoopbackConfig::default());
        let mut ia = qp(&a, |_| {});
        let tb = qp(&b, |_| {});
        let slots = 512u64;
        let mr = region(&b, 8 * slots as usize, 0, Access::REMOTE_WRITE);
        let rk = mr.remote_key().unwrap();
        let dest = tb.addr();
        let posted = Arc::new(AtomicUsize::new(0));
        let posted2 = posted.clone();
        // Write `i + 1` to slot `i % slots` until the writes fail, then a few more.
        let writer = std::thread::spawn(move || {
            let mut out = Vec::new();
            let mut after_failure = 0;
            let t0 = Instant::now();
            for i in 0u64.. {
                let data = Bytes::copy_from_slice(&(i + 1).to_le_bytes());
                ia.post_write(i, dest, data, iov(&rk, 8 * (i % slots), 8), None)
                    .unwrap();
                posted2.store(i as usize + 1, Ordering::SeqCst);
                let mut v = Vec::new();
                while ia.poll(&mut v, 1) == 0 {
                    assert!(t0.elapsed() < DEADLINE);
                }
                let c = v.pop().unwrap();
                if !c.status.is_ok() {
                    after_failure += 1;
                }
                out.push(c);
                if after_failure > 10 {
                    break;
                }
            }
            out
        });
        while posted.load(Ordering::SeqCst) < 50 + round * 40 {
            std::thread::yield_now();
        }
        let buf = mr.close();
        let done = writer.join().unwrap();
        let slot = |i: u64| &buf[8 * (i % slots) as usize..8 * (i % slots) as usize + 8];
        let mut failed = false;
        let mut last_ok = std::collections::HashMap::new();
        for (i, c) in done.iter().enumerate() {
            let i = i as u64;
            assert_eq!(c.wr_id, i);
            match c.status {
                Status::Success => {
                    assert!(
                        !failed,
                        "round {round}: write {i} succeeded after one failed"
                    );
                    last_ok.insert(i % slots, i);
                }
                Status::RemoteBadAddress => {
                    failed = true;
                    assert_ne!(
                        slot(i),
                        (i + 1).to_le_bytes(),
                        "round {round}: write {i} failed but landed"
                    );
                }
                s => panic!("round {round}: write {i}: {s}"),
            }
        }
        assert!(failed, "round {round}: the writes after close failed");
        for (s, i) in last_ok {
            assert_eq!(
                slot(s),
                (i + 1).to_le_bytes(),
                "round {round}: write {i} succeeded but is not in the buffer"
            );
        }
        drop(tb);
    }
}
