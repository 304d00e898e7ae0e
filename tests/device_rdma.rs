//! One-sided RDMA on the `udp` and `shm` devices, at the device seam: writes and reads of every
//! size complete while the target never polls, bad keys, ranges, rights and revoked keys are
//! refused with `RemoteBadAddress` and change nothing, N writes with immediate data give exactly
//! N target completions (udp: under loss, duplication and reordering), and the device option
//! turns it all off. Randomised tests print their seed (`EFA_TEST_SEED=<seed>` replays one).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::device::{
    Device, DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, RemoteIov, Status,
    UNSOLICITED_WR_ID,
};
use efa::fault::test_seed;
use efa::{Access, Config, Domain, ErrorKind, FaultConfig, MemoryRegion, RemoteKey};

type Qp = Box<dyn QueuePair>;

const DEADLINE: Duration = Duration::from_secs(60);

struct Node {
    dev: Arc<dyn Device>,
    domain: Domain,
}

fn node(cfg: UdpConfig) -> Node {
    let dev: Arc<dyn Device> = UdpDevice::open(cfg).expect("udp device");
    let domain = Domain::with_device(dev.clone(), Config::default());
    Node { dev, domain }
}

/// Two nodes on one device kind: udp with `cfg`, or shm in a fresh directory (kept alive by the
/// returned guard) with RDMA and unsolicited write-recv as `cfg` says.
fn pair(shm: bool, cfg: UdpConfig) -> (Node, Node, Option<tempfile::TempDir>) {
    if !shm {
        return (node(cfg.clone()), node(cfg), None);
    }
    let dir = tempfile::tempdir().unwrap();
    let mk = || {
        let dev: Arc<dyn Device> = ShmDevice::open(
            ShmConfig::in_dir(dir.path())
                .with_rdma(cfg.rdma)
                .with_unsolicited_write_recv(cfg.unsolicited_write_recv),
        )
        .expect("shm device");
        let domain = Domain::with_device(dev.clone(), Config::default());
        Node { dev, domain }
    };
    let (a, b) = (mk(), mk());
    (a, b, Some(dir))
}

fn qp(n: &Node) -> Qp {
    // Retry receiver-not-ready forever (7, as EFA): the tests read the target region under its
    // lock while writes arrive, and a write that finds it locked is not ready.
    let mut attr = QpAttr::new(QpType::Srd);
    attr.rnr_retry = 7;
    n.dev.create_qp(attr).expect("create_qp")
}

fn iov(rk: &RemoteKey, offset: u64, len: u64) -> RemoteIov {
    RemoteIov {
        addr: rk.addr.wrapping_add(offset),
        len,
        key: rk.key,
    }
}

fn pattern(seed: u64, len: usize) -> Bytes {
    let mut r = efa::fault::Rng::new(seed);
    Bytes::from((0..len).map(|_| r.next_u64() as u8).collect::<Vec<u8>>())
}

/// Polls `q` (only `q`) until it yields `n` completions.
fn poll_n(q: &mut Qp, n: usize, what: &str) -> Vec<DeviceCompletion> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while out.len() < n {
        let want = n - out.len();
        q.poll(&mut out, want);
        assert!(
            Instant::now() < deadline,
            "{what}: {} of {n} completions",
            out.len()
        );
    }
    out
}

#[test]
fn writes_and_reads_of_every_size_complete_without_the_target_polling() {
    for shm in [false, true] {
        every_size(shm);
    }
}

fn every_size(shm: bool) {
    let (a, b, _dir) = pair(shm, UdpConfig::default());
    let mut qa = qp(&a);
    // The target's queue pair exists but is never polled: its NIC thread serves the RDMA.
    let qb = qp(&b);
    let mtu = a.dev.attr().mtu;
    let sizes = [
        1,
        100,
        mtu - 49,
        mtu - 48,
        mtu - 47,
        mtu + 1,
        1 << 20,
        4 << 20,
    ];
    let total: usize = sizes.iter().sum();
    let mr = b
        .domain
        .register(vec![0u8; total], Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    let rk = mr.remote_key().unwrap();
    let mut off = 0u64;
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(i as u64, len);
        qa.post_write(
            i as u64,
            qb.addr(),
            data.clone(),
            iov(&rk, off, len as u64),
            None,
        )
        .unwrap();
        let c = poll_n(&mut qa, 1, "write");
        assert_eq!(
            (c[0].wr_id, c[0].status, c[0].opcode),
            (i as u64, Status::Success, Opcode::RdmaWrite)
        );
        assert_eq!(c[0].byte_len, len);
        assert!(
            mr.read()[off as usize..off as usize + len] == data[..],
            "write of {len}"
        );
        qa.post_read(
            100 + i as u64,
            qb.addr(),
            BytesMut::new(),
            iov(&rk, off, len as u64),
        )
        .unwrap();
        let c = poll_n(&mut qa, 1, "read");
        assert_eq!(
            (c[0].status, c[0].opcode),
            (Status::Success, Opcode::RdmaRead)
        );
        assert!(c[0].buf.as_ref().unwrap()[..] == data[..], "read of {len}");
        off += len as u64;
    }
    drop(qb);
    // Every operation counted once as RDMA; the packets count themselves, each byte once (a
    // write's bytes went out once, with at most a header per packet; a read's came in).
    let s = a.dev.stats();
    assert_eq!(s.rdma_ops, 2 * sizes.len() as u64, "shm {shm}: {s:?}");
    assert_eq!(s.rdma_bytes, 2 * total as u64, "shm {shm}: {s:?}");
    assert!(
        s.tx_bytes >= total as u64 && s.tx_bytes <= total as u64 + 64 * s.tx_pkts,
        "shm {shm}: written bytes counted once: {s:?}"
    );
}

#[test]
fn bad_accesses_are_refused_and_change_nothing() {
    for shm in [false, true] {
        bad_accesses(shm);
    }
}

fn bad_accesses(shm: bool) {
    let (a, b, _dir) = pair(shm, UdpConfig::default());
    let mut qa = qp(&a);
    let qb = qp(&b);
    let ro = b
        .domain
        .register(vec![7u8; 4096], Access::REMOTE_READ)
        .unwrap();
    let wo = b
        .domain
        .register(vec![7u8; 4096], Access::REMOTE_WRITE)
        .unwrap();
    let (rk_ro, rk_wo) = (ro.remote_key().unwrap(), wo.remote_key().unwrap());
    let big = Bytes::from(vec![1u8; 200_000]);
    let cases: Vec<(Bytes, RemoteIov)> = vec![
        (Bytes::from_static(b"x"), iov(&rk_ro, 0, 1)), // no write right
        (Bytes::from_static(b"xy"), iov(&rk_wo, 4095, 2)), // past the end
        (
            Bytes::from_static(b"x"),
            RemoteIov {
                key: rk_wo.key ^ 0xff,
                ..iov(&rk_wo, 0, 1)
            },
        ),
        (big.clone(), iov(&rk_wo, 0, big.len() as u64)), // multi-packet, too long
    ];
    for (i, (d, r)) in cases.iter().enumerate() {
        qa.post_write(i as u64, qb.addr(), d.clone(), *r, None)
            .unwrap();
    }
    qa.post_read(50, qb.addr(), BytesMut::new(), iov(&rk_wo, 0, 16))
        .unwrap(); // no read right
    qa.post_read(51, qb.addr(), BytesMut::new(), iov(&rk_ro, 100, 4000))
        .unwrap(); // past end
    let got = poll_n(&mut qa, cases.len() + 2, "refusals");
    let ids: HashSet<u64> = got.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids.len(), cases.len() + 2, "each refused once");
    for c in &got {
        assert_eq!(c.status, Status::RemoteBadAddress, "{c:?}");
    }
    assert!(ro.read().iter().all(|&x| x == 7));
    assert!(wo.read().iter().all(|&x| x == 7));
    // A revoked key, and keys never come back.
    let gone = b
        .domain
        .register(vec![0u8; 64], Access::REMOTE_WRITE)
        .unwrap();
    let rk_gone = gone.remote_key().unwrap();
    let _ = gone.close();
    let fresh = b
        .domain
        .register(vec![0u8; 64], Access::REMOTE_WRITE)
        .unwrap();
    assert_ne!(fresh.key(), rk_gone.key);
    qa.post_write(
        60,
        qb.addr(),
        Bytes::from_static(b"z"),
        iov(&rk_gone, 0, 1),
        None,
    )
    .unwrap();
    let c = poll_n(&mut qa, 1, "revoked");
    assert_eq!(c[0].status, Status::RemoteBadAddress);
    assert!(fresh.read().iter().all(|&x| x == 0));
}

fn writes_with_imm(shm: bool, unsolicited: bool, seed: u64) {
    let faults = FaultConfig::seeded(seed)
        .drop(0.05)
        .duplicate(0.05)
        .reorder(0.1);
    let cfg = UdpConfig::default()
        .with_faults(faults)
        .with_unsolicited_write_recv(unsolicited);
    let (a, b, _dir) = pair(shm, cfg);
    let mut qa = qp(&a);
    let mut qb = qp(&b);
    const N: usize = 120;
    const SLOT: usize = 200_000;
    let mr: MemoryRegion = b
        .domain
        .register(vec![0u8; N * SLOT], Access::REMOTE_WRITE)
        .unwrap();
    let rk = mr.remote_key().unwrap();
    if !unsolicited {
        for i in 0..N {
            qb.post_recv(1000 + i as u64, BytesMut::with_capacity(16))
                .unwrap();
        }
    }
    let mut r = efa::fault::Rng::new(seed);
    let datas: Vec<Bytes> = (0..N)
        .map(|i| pattern(seed ^ i as u64, 1 + r.below(SLOT as u64) as usize))
        .collect();
    let mut posted = 0;
    let mut done = 0;
    let mut seen = HashSet::new();
    let deadline = Instant::now() + DEADLINE;
    let mut comps = Vec::new();
    while done < N || seen.len() < N {
        while posted < N {
            let at = iov(&rk, (posted * SLOT) as u64, datas[posted].len() as u64);
            match qa.post_write(
                posted as u64,
                qb.addr(),
                datas[posted].clone(),
                at,
                Some(posted as u32),
            ) {
                Ok(()) => posted += 1,
                Err(e) if e.kind() == ErrorKind::Again => break,
                Err(e) => panic!("seed {seed}: {e}"),
            }
        }
        comps.clear();
        qa.poll(&mut comps, 64);
        for c in &comps {
            assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
            done += 1;
        }
        comps.clear();
        qb.poll(&mut comps, 64);
        for c in &comps {
            assert_eq!(c.opcode, Opcode::RecvRdmaWithImm, "seed {seed}");
            let i = c.imm.expect("imm") as usize;
            assert!(seen.insert(i), "seed {seed}: imm {i} twice");
            assert_eq!(c.byte_len, datas[i].len(), "seed {seed}");
            if unsolicited {
                assert_eq!((c.wr_id, c.buf.is_none()), (UNSOLICITED_WR_ID, true));
            } else {
                assert!(c.wr_id >= 1000 && c.buf.is_some(), "seed {seed}");
            }
            // All of it is in place when its completion comes.
            let m = mr.read();
            assert!(
                m[i * SLOT..i * SLOT + datas[i].len()] == datas[i][..],
                "seed {seed}: {i}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {done} done, {} arrived",
            seen.len()
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    comps.clear();
    qb.poll(&mut comps, 64);
    assert!(comps.is_empty(), "seed {seed}: nothing arrives twice");
    if !shm {
        let faults = b.dev.stats().duplicates_dropped + a.dev.stats().retransmits;
        assert!(faults > 0, "seed {seed}: faults happened");
    }
}

#[test]
fn writes_with_immediate_data_complete_once_at_the_target_under_faults() {
    let seed = test_seed();
    eprintln!("seed {seed}");
    for shm in [false, true] {
        writes_with_imm(shm, false, seed);
        writes_with_imm(shm, true, seed.wrapping_add(1));
    }
}

#[test]
fn rdma_off_is_not_supported_and_registers_no_key() {
    for shm in [false, true] {
        rdma_off(shm);
    }
}

fn rdma_off(shm: bool) {
    let off = UdpConfig::default().with_rdma(false);
    let (a, _b, _dir) = pair(shm, off);
    assert!(!a.dev.attr().caps.rdma_read && !a.dev.attr().caps.rdma_write);
    assert_eq!(
        a.domain
            .register(vec![0u8; 8], Access::REMOTE_WRITE)
            .map(|_| ())
            .ok(),
        Some(())
    );
    let mut qa = qp(&a);
    let e = qa
        .post_write(
            1,
            qa.addr(),
            Bytes::from_static(b"x"),
            RemoteIov {
                addr: 0,
                len: 1,
                key: 1,
            },
            None,
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    let e = qa
        .post_read(
            2,
            qa.addr(),
            BytesMut::new(),
            RemoteIov {
                addr: 0,
                len: 1,
                key: 1,
            },
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    // UD queue pairs have no RDMA either.
    let (on, _b2, _dir2) = pair(shm, UdpConfig::default());
    let mut ud = on.dev.create_qp(QpAttr::new(QpType::Ud)).unwrap();
    let e = ud
        .post_write(
            3,
            ud.addr(),
            Bytes::from_static(b"x"),
            RemoteIov {
                addr: 0,
                len: 1,
                key: 1,
            },
            None,
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
}

/// Issue 17, defect 1: the application holds `MemoryRegion::write()` on a region while a peer
/// RDMA-writes into it, and polls its queue pair. The device must never wait for the region's
/// lock (it used to, in `Keys::check`, with the key table and the queue pair locked: the poll
/// hung for ever). The write is not ready while the guard is held and completes once it is
/// dropped.
#[test]
fn polling_while_holding_a_region_guard_under_a_remote_write_does_not_hang() {
    for shm in [false, true] {
        guard_held_during_remote_write(shm);
    }
}

fn guard_held_during_remote_write(shm: bool) {
    let (a, b, dir) = pair(shm, UdpConfig::default());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // The target runs in its own thread: a hang is detected below, not waited for.
    let target = std::thread::spawn(move || {
        let mut qa = qp(&a);
        let mut qb = qp(&b);
        let mut mr = b
            .domain
            .register(vec![0u8; 4096], Access::REMOTE_WRITE)
            .unwrap();
        let rk = mr.remote_key().unwrap();
        let data = pattern(17, 4096);
        let rnr_before = b.dev.stats().rnr_events;
        {
            let mut guard = mr.write();
            guard[0] = 1;
            qa.post_write(1, qb.addr(), data.clone(), iov(&rk, 0, 4096), None)
                .unwrap();
            // Poll the target while the write keeps arriving and finding the region locked
            // (receiver-not-ready): until the target has refused it, then some more.
            let mut out = Vec::new();
            while b.dev.stats().rnr_events == rnr_before {
                qb.poll(&mut out, 16);
                std::thread::yield_now();
            }
            for _ in 0..1000 {
                qb.poll(&mut out, 16);
                qa.poll(&mut out, 16);
            }
            assert!(out.is_empty(), "no completion while the region is held");
            assert_eq!(guard[0], 1, "nothing placed under the guard");
        }
        let c = poll_n(&mut qa, 1, "write after the guard is dropped");
        assert_eq!(
            (c[0].wr_id, c[0].status, c[0].opcode),
            (1, Status::Success, Opcode::RdmaWrite)
        );
        assert!(mr.read()[..] == data[..], "the write landed");
        drop((qa, qb, dir));
        done_tx.send(()).unwrap();
    });
    match done_rx.recv_timeout(Duration::from_secs(20)) {
        Ok(()) => target.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // The thread panicked: show its message.
            if let Err(e) = target.join() {
                std::panic::resume_unwind(e);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("shm={shm}: polling while holding a region guard hung (no result in 20 s)")
        }
    }
}

/// Issue 27: the udp device writes straight from a region it registered (`post_write_region`:
/// each chunk is read from the region as it goes out, no copy at posting), of every size, under
/// loss, duplication and reordering (the simulator, `device::udp::sim`, also holds the source
/// locked for a while: what would go out meanwhile is lost and sent again). A slice outside
/// the registration its key names is refused with `InvalidArgument`. The udp device reads into
/// bytes only (`region_rdma` stays false).
#[test]
fn udp_writes_straight_from_a_registered_region() {
    use efa::mem::{RegionMem, RegionSlice};
    let seed = test_seed();
    let faults = FaultConfig::seeded(seed)
        .drop(0.05)
        .duplicate(0.05)
        .reorder(0.1);
    let (a, b, _dir) = pair(false, UdpConfig::default().with_faults(faults));
    let mut qa = qp(&a);
    let qb = qp(&b);
    assert!(qa.region_rdma_write() && !qa.region_rdma(), "seed {seed}");
    let mtu = a.dev.attr().mtu;
    let sizes = [1, 100, 2048, 2049, mtu - 48, mtu + 1, 1 << 20];
    let total: usize = sizes.iter().sum();
    let data = pattern(seed, total);
    let src = RegionMem::new(BytesMut::from(&data[..]));
    let key = a
        .dev
        .register_mem(&src, Access::WRITE)
        .unwrap()
        .expect("the udp device registers regions");
    let mr = b
        .domain
        .register(vec![0u8; total], Access::REMOTE_WRITE)
        .unwrap();
    let rk = mr.remote_key().unwrap();
    let slice = |off: usize, len: usize| RegionSlice {
        mem: src.clone(),
        key,
        addr: src.addr() + off as u64,
        len,
    };
    // Refused: another key, a slice past the registration's end, another memory.
    let other = RegionMem::new(BytesMut::zeroed(16));
    let bad = [
        RegionSlice {
            key: key ^ 1,
            ..slice(0, 1)
        },
        slice(total - 1, 2),
        RegionSlice {
            mem: other.clone(),
            addr: other.addr(),
            len: 1,
            key,
        },
    ];
    for s in bad {
        let e = qa
            .post_write_region(9, qb.addr(), s, iov(&rk, 0, 1), None)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "seed {seed}: {e}");
    }
    let mut off = 0;
    for (i, &len) in sizes.iter().enumerate() {
        let to = iov(&rk, off as u64, len as u64);
        qa.post_write_region(i as u64, qb.addr(), slice(off, len), to, None)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        off += len;
    }
    let done = poll_n(&mut qa, sizes.len(), "region writes");
    for c in &done {
        assert_eq!(
            (c.status, c.opcode, c.byte_len),
            (Status::Success, Opcode::RdmaWrite, sizes[c.wr_id as usize]),
            "seed {seed}: {c:?}"
        );
    }
    assert!(mr.read()[..] == data[..], "seed {seed}: the target differs");
}
