//! RMA and atomics on RDM endpoints, on every software device, with device RDMA on and off and
//! the protocol thresholds moved so that every path runs: data intact, every operation completes
//! exactly once, writes with immediate data arrive exactly once each, bad keys and ranges are
//! refused with the target memory unchanged, device RDMA needs no target progress.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{DEADLINE, LOCAL4, Node, payload};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::{Device, Status};
use efa::fault::{FaultConfig, test_seed};
use efa::{
    Access, AtomicOp, AtomicRequest, AtomicType, Completion, CompletionError, CompletionFlags,
    Config, Domain, ErrorKind, MemoryRegion, PeerId, RemoteKey, WriteOptions,
};

/// Where the two endpoints live and how RMA may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    /// Loopback device with RDMA, lossy network: device RDMA.
    Loopback,
    /// Loopback device without RDMA: everything emulated.
    LoopbackNoRdma,
    /// Loopback device with RDMA but `FI_EFA_USE_DEVICE_RDMA=0`: emulated.
    LoopbackRdmaOff,
    /// Loopback with RDMA and low read thresholds: the read-based protocols.
    LoopbackReadProtocols,
    /// Loopback without RDMA and a small medium size: long-CTS everywhere.
    LoopbackLongCts,
    /// udp device with faults, as it comes.
    Udp,
    /// udp device with faults, `FI_EFA_USE_DEVICE_RDMA=0`.
    UdpRdmaOff,
    /// shm device (its own directory), device RDMA.
    Shm,
    /// shm device without RDMA.
    ShmNoRdma,
}

struct Pair {
    a: Node,
    b: Node,
    /// b as a's peer.
    peer_b: PeerId,
    /// Keeps the in-process network alive.
    _net: Option<LoopbackNetwork>,
    /// Keeps the shm directory alive.
    _dir: Option<tempfile::TempDir>,
    emulated: bool,
}

fn config(setup: Setup) -> Config {
    let mut c = Config::default();
    match setup {
        Setup::LoopbackRdmaOff | Setup::UdpRdmaOff => c.use_device_rdma = Some(false),
        Setup::LoopbackReadProtocols => {
            c.inter_min_read_write_size = 4096;
            c.inter_min_read_message_size = 4096;
        }
        Setup::LoopbackLongCts => c.inter_max_medium_message_size = 4096,
        _ => {}
    }
    c
}

fn pair(setup: Setup, seed: u64) -> Pair {
    let cfg = config(setup);
    let mut dir = None;
    let (da, db, net): (Arc<dyn Device>, Arc<dyn Device>, _) = match setup {
        Setup::Shm | Setup::ShmNoRdma => {
            let d = tempfile::tempdir().unwrap();
            let dev = || -> Arc<dyn Device> {
                efa::device::shm::ShmDevice::open(
                    efa::device::shm::ShmConfig::in_dir(d.path()).with_rdma(setup == Setup::Shm),
                )
                .expect("shm device")
            };
            let pair = (dev(), dev(), None);
            dir = Some(d);
            pair
        }
        Setup::Udp | Setup::UdpRdmaOff => {
            let faults = FaultConfig::seeded(seed)
                .drop(0.05)
                .duplicate(0.05)
                .reorder(0.1);
            let a = common::net_device(LOCAL4, faults.clone());
            (a, common::net_device(LOCAL4, faults), None)
        }
        _ => {
            let net = LoopbackNetwork::new(
                FaultConfig::seeded(seed)
                    .drop(0.1)
                    .duplicate(0.1)
                    .reorder(0.1),
            );
            let rdma = !matches!(setup, Setup::LoopbackNoRdma | Setup::LoopbackLongCts);
            let lc = LoopbackConfig::default().with_rdma(rdma);
            let a: Arc<dyn Device> = LoopbackDevice::open(&net, lc.clone()).expect("loopback");
            let b: Arc<dyn Device> = LoopbackDevice::open(&net, lc).expect("loopback");
            (a, b, Some(net))
        }
    };
    let a = Node::new(&Domain::with_device(da, cfg.clone()));
    let b = Node::new(&Domain::with_device(db, cfg));
    let peer_b = a.insert(b.ep.addr());
    b.insert(a.ep.addr());
    let emulated = a.ep.rma_emulation().write;
    Pair {
        a,
        b,
        peer_b,
        _net: net,
        _dir: dir,
        emulated,
    }
}

const ALL: [Setup; 9] = [
    Setup::Loopback,
    Setup::LoopbackNoRdma,
    Setup::LoopbackRdmaOff,
    Setup::LoopbackReadProtocols,
    Setup::LoopbackLongCts,
    Setup::Udp,
    Setup::UdpRdmaOff,
    Setup::Shm,
    Setup::ShmNoRdma,
];

/// Every setup, or with `EFA_TEST_DEVICE=efa` the two that run on the network device (the `efa`
/// device under the emulated NIC then).
fn setups() -> Vec<Setup> {
    if common::on_efa() {
        vec![Setup::Udp, Setup::UdpRdmaOff]
    } else {
        ALL.to_vec()
    }
}

/// Drives both endpoints until `node` has `n` completions (or error completions) whose flags
/// contain `flags`; the other completions are kept in `other`.
fn gather(
    p: &Pair,
    on_a: bool,
    n: usize,
    flags: CompletionFlags,
    what: &str,
) -> (Vec<Completion>, Vec<CompletionError>) {
    let deadline = Instant::now() + DEADLINE;
    let (me, other) = if on_a { (&p.a, &p.b) } else { (&p.b, &p.a) };
    let (mut ok, mut err) = (Vec::new(), Vec::new());
    let mut batch = Vec::new();
    while ok.len() + err.len() < n {
        other.ep.progress();
        match me.cq.poll(&mut batch, 64) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ErrorAvailable => {
                while let Some(e) = me.cq.read_err() {
                    assert!(e.flags.contains(flags), "{what}: unexpected error {e:?}");
                    err.push(e);
                }
            }
            Err(e) => panic!("{what}: {e}"),
        }
        for c in batch.drain(..) {
            if c.flags.contains(flags) {
                ok.push(c);
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what}: only {} of {n} completions; me {:?} {:?}; other {:?} {:?}",
            ok.len() + err.len(),
            me.ep.stats(),
            me.ep.resources(),
            other.ep.stats(),
            other.ep.resources(),
        );
        if ok.len() + err.len() < n {
            std::thread::yield_now();
        }
    }
    (ok, err)
}

/// Posts with retries on `Again`.
fn retry<T>(p: &Pair, mut post: impl FnMut() -> Result<(), T>, what: &str)
where
    T: std::fmt::Debug + HasKind,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        match post() {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::Again => {
                p.a.ep.progress();
                p.b.ep.progress();
                assert!(Instant::now() < deadline, "{what}: kept getting Again");
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

trait HasKind {
    fn kind(&self) -> ErrorKind;
}
impl HasKind for efa::PostError {
    fn kind(&self) -> ErrorKind {
        efa::PostError::kind(self)
    }
}

fn target_region(p: &Pair, len: usize, access: Access) -> (MemoryRegion, RemoteKey) {
    let mr = p.b.ep.domain().register(vec![0u8; len], access).unwrap();
    let rk = mr.remote_key().unwrap();
    (mr, rk)
}

const SIZES: [usize; 9] = [1, 100, 4095, 8000, 9000, 70_000, 300_000, 1 << 20, 3 << 20];

fn write_then_read(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let total: usize = SIZES.iter().sum::<usize>() + SIZES.len() * 8;
    let (mr, rk) = target_region(&p, total, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let mut offs = Vec::new();
    let mut off = 0u64;
    for (i, &len) in SIZES.iter().enumerate() {
        offs.push(off);
        let data = payload(seed, i, len);
        if i % 2 == 0 {
            retry(
                &p,
                || p.a.ep.write(p.peer_b, data.clone(), rk.at(off), i as u64),
                "write",
            );
        } else {
            // From a registered region peers may read (makes LONGREAD_RTW possible).
            let src =
                p.a.ep
                    .domain()
                    .register(data.to_vec(), Access::WRITE | Access::REMOTE_READ)
                    .unwrap();
            let mut src = Some(src);
            retry(
                &p,
                || match p
                    .a
                    .ep
                    .write(p.peer_b, src.take().unwrap(), rk.at(off), i as u64)
                {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let k = e.kind();
                        src = e.buf.into_region();
                        Err(efa::PostError {
                            error: efa::Error::new(k, "write"),
                            buf: efa::Buffer::None,
                        })
                    }
                },
                "write from a region",
            );
        }
        off += len as u64 + 8;
    }
    let (done, errs) = gather(&p, true, SIZES.len(), CompletionFlags::WRITE, "writes");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let ctxs: HashSet<u64> = done.iter().map(|c| c.context).collect();
    assert_eq!(
        ctxs.len(),
        SIZES.len(),
        "{setup:?} seed {seed}: each write once"
    );
    for c in &done {
        assert!(c.flags.contains(CompletionFlags::RMA));
        assert_eq!(c.len, SIZES[c.context as usize], "{setup:?} seed {seed}");
    }
    {
        let m = mr.read();
        for (i, &len) in SIZES.iter().enumerate() {
            let o = offs[i] as usize;
            assert!(
                m[o..o + len] == payload(seed, i, len)[..],
                "{setup:?} seed {seed}: write {i} ({len} bytes) landed wrong"
            );
            assert!(
                m[o + len..o + len + 8].iter().all(|&x| x == 0),
                "{setup:?} seed {seed}: write {i} overran"
            );
        }
    }
    // Read everything back, half into BytesMut, half into regions.
    for (i, &len) in SIZES.iter().enumerate() {
        let o = offs[i];
        if i % 2 == 0 {
            let mut buf = Some(BytesMut::new());
            retry(
                &p,
                || match p
                    .a
                    .ep
                    .read(p.peer_b, buf.take().unwrap(), len, rk.at(o), 100 + i as u64)
                {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let k = e.kind();
                        buf = e.buf.into_recv();
                        Err(efa::PostError {
                            error: efa::Error::new(k, "read"),
                            buf: efa::Buffer::None,
                        })
                    }
                },
                "read",
            );
        } else {
            let dst =
                p.a.ep
                    .domain()
                    .register(vec![0u8; len], Access::READ)
                    .unwrap();
            let mut dst = Some(dst);
            retry(
                &p,
                || match p
                    .a
                    .ep
                    .read(p.peer_b, dst.take().unwrap(), len, rk.at(o), 100 + i as u64)
                {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let k = e.kind();
                        dst = e.buf.into_region();
                        Err(efa::PostError {
                            error: efa::Error::new(k, "read"),
                            buf: efa::Buffer::None,
                        })
                    }
                },
                "read into a region",
            );
        }
    }
    let (done, errs) = gather(&p, true, SIZES.len(), CompletionFlags::READ, "reads");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut seen = HashSet::new();
    for c in done {
        let i = (c.context - 100) as usize;
        assert!(seen.insert(i), "{setup:?} seed {seed}: read {i} twice");
        let want = payload(seed, i, SIZES[i]);
        assert_eq!(c.len, SIZES[i]);
        match c.buf {
            efa::Buffer::Recv(b) => assert!(b[..] == want[..], "{setup:?} seed {seed}: read {i}"),
            efa::Buffer::Region(r) => {
                assert!(r.read()[..] == want[..], "{setup:?} seed {seed}: read {i}")
            }
            other => panic!("read {i} handed back {other:?}"),
        }
    }
    let s = p.a.ep.stats();
    let moved = 2 * SIZES.iter().sum::<usize>() as u64;
    if p.emulated {
        assert_eq!(s.device_rma_bytes, 0, "{setup:?}: {s:?}");
        assert_eq!(s.emulated_rma_bytes, moved, "{setup:?}: {s:?}");
    } else {
        assert!(s.device_rma_bytes > 0, "{setup:?}: {s:?}");
        assert_eq!(
            s.device_rma_bytes + s.emulated_rma_bytes,
            moved,
            "{setup:?}: {s:?}"
        );
    }
}

#[test]
fn write_then_read_every_setup() {
    for s in setups() {
        write_then_read(s);
    }
}

fn writedata_exactly_once(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let n = 300;
    let (mr, rk) = target_region(&p, 64 << 10, Access::REMOTE_WRITE);
    let mut r = efa::fault::Rng::new(seed);
    let lens: Vec<usize> = (0..n).map(|_| 1 + r.below(60_000) as usize).collect();
    for (i, &len) in lens.iter().enumerate() {
        let data = payload(seed, i, len);
        let o = WriteOptions::default()
            .with_data(i as u32)
            .with_delivery_complete(i % 7 == 0);
        retry(
            &p,
            || {
                p.a.ep
                    .write_with(p.peer_b, data.clone(), rk.start(), o, i as u64)
            },
            "writedata",
        );
        // Drive the target now and then so that emulated writes make progress.
        if i % 16 == 0 {
            p.b.ep.progress();
        }
    }
    let (done, errs) = gather(&p, true, n, CompletionFlags::WRITE, "initiator");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    assert_eq!(done.len(), n);
    let (arrived, errs) = gather(&p, false, n, CompletionFlags::REMOTE_WRITE, "target");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut seen = vec![false; n];
    for c in &arrived {
        assert!(c.flags.contains(CompletionFlags::REMOTE_CQ_DATA));
        let i = c.data.expect("immediate data") as usize;
        assert!(!seen[i], "{setup:?} seed {seed}: imm {i} twice");
        seen[i] = true;
        assert_eq!(c.len, lens[i], "{setup:?} seed {seed}: length of write {i}");
        assert!(c.source.is_some(), "{setup:?}: FI_SOURCE of write {i}");
    }
    // Nothing more arrives later.
    std::thread::sleep(Duration::from_millis(50));
    p.b.ep.progress();
    let mut extra = Vec::new();
    let _ = p.b.cq.poll(&mut extra, 64);
    assert!(
        extra
            .iter()
            .all(|c| !c.flags.contains(CompletionFlags::REMOTE_WRITE)),
        "{setup:?} seed {seed}: a write with immediate data arrived twice"
    );
    drop(mr);
}

#[test]
fn writes_with_immediate_data_arrive_exactly_once() {
    for s in setups() {
        writedata_exactly_once(s);
    }
}

fn bad_accesses(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let (mr, rk) = target_region(&p, 4096, Access::REMOTE_READ);
    let (mr_w, rk_w) = target_region(&p, 4096, Access::REMOTE_WRITE);
    let data = Bytes::from(vec![0xabu8; 100]);
    let big = Bytes::from(vec![0xcdu8; 20_000]);
    let cases: Vec<(&str, Bytes, efa::RmaAddr)> = vec![
        (
            "wrong key",
            data.clone(),
            efa::RmaAddr {
                addr: rk.addr,
                key: rk.key ^ 0x5555,
            },
        ),
        ("no REMOTE_WRITE right", data.clone(), rk.start()),
        ("past the end", data.clone(), rk_w.at(4000)),
        (
            "before the start",
            data.clone(),
            efa::RmaAddr {
                addr: rk_w.addr - 1,
                key: rk_w.key,
            },
        ),
        ("long write past the end", big.clone(), rk_w.at(0)),
    ];
    for (i, (_, d, at)) in cases.iter().enumerate() {
        retry(
            &p,
            || p.a.ep.write(p.peer_b, d.clone(), *at, i as u64),
            "bad write",
        );
    }
    // Reads: no right, out of range.
    retry(
        &p,
        || {
            p.a.ep
                .read(p.peer_b, BytesMut::new(), 100, rk_w.start(), 50)
        },
        "bad read",
    );
    retry(
        &p,
        || p.a.ep.read(p.peer_b, BytesMut::new(), 200, rk.at(4000), 51),
        "bad read",
    );
    let n = cases.len() + 2;
    let (ok, errs) = gather(&p, true, n, CompletionFlags::RMA, "refusals");
    assert!(ok.is_empty(), "{setup:?} seed {seed}: accepted {ok:?}");
    for e in &errs {
        assert_eq!(e.error.kind(), ErrorKind::RemoteAccess, "{setup:?}: {e:?}");
        assert_eq!(e.status, Some(Status::RemoteBadAddress), "{setup:?}: {e:?}");
        if e.context < cases.len() as u64 {
            assert!(e.buf.as_send().is_some(), "the write's bytes come back");
        }
    }
    let ctxs: HashSet<u64> = errs.iter().map(|e| e.context).collect();
    assert_eq!(ctxs.len(), n, "{setup:?}: each refusal once");
    assert!(
        mr.read().iter().all(|&x| x == 0),
        "{setup:?}: memory changed"
    );
    assert!(
        mr_w.read().iter().all(|&x| x == 0),
        "{setup:?}: memory changed"
    );
    // A revoked key.
    let (mr2, rk2) = target_region(&p, 4096, Access::REMOTE_WRITE);
    let _ = mr2.close();
    retry(
        &p,
        || p.a.ep.write(p.peer_b, data.clone(), rk2.start(), 99),
        "revoked",
    );
    let (ok, errs) = gather(&p, true, 1, CompletionFlags::RMA, "revoked");
    assert!(ok.is_empty());
    assert_eq!(errs[0].error.kind(), ErrorKind::RemoteAccess);
}

#[test]
fn bad_keys_and_ranges_are_refused_and_change_nothing() {
    for s in setups() {
        bad_accesses(s);
    }
}

fn atomics(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let (mr, rk) = target_region(&p, 4096, Access::REMOTE_READ | Access::REMOTE_WRITE);
    // 200 SUMs of 1..=200 on a u64 counter at offset 0, two i32 MIN/MAX, f64 SUM.
    let n = 200u64;
    for i in 1..=n {
        let req = AtomicRequest {
            op: AtomicOp::Sum,
            datatype: AtomicType::U64,
            operand: Bytes::copy_from_slice(&i.to_le_bytes()),
            compare: None,
        };
        retry(
            &p,
            || p.a.ep.atomic(p.peer_b, req.clone(), rk.at(0), i),
            "sum",
        );
    }
    for (k, v) in [5i32, -7, 3].iter().enumerate() {
        let min = AtomicRequest {
            op: AtomicOp::Min,
            datatype: AtomicType::I32,
            operand: Bytes::copy_from_slice(&v.to_le_bytes()),
            compare: None,
        };
        retry(
            &p,
            || {
                p.a.ep
                    .atomic(p.peer_b, min.clone(), rk.at(8), 1000 + k as u64)
            },
            "min",
        );
        let max = AtomicRequest {
            op: AtomicOp::Max,
            ..min.clone()
        };
        retry(
            &p,
            || {
                p.a.ep
                    .atomic(p.peer_b, max.clone(), rk.at(12), 2000 + k as u64)
            },
            "max",
        );
    }
    let fsum = AtomicRequest {
        op: AtomicOp::Sum,
        datatype: AtomicType::F64,
        operand: Bytes::copy_from_slice(&[1.5f64.to_le_bytes(), 2.25f64.to_le_bytes()].concat()),
        compare: None,
    };
    retry(
        &p,
        || p.a.ep.atomic(p.peer_b, fsum.clone(), rk.at(16), 3000),
        "fsum",
    );
    let (_, errs) = gather(&p, true, n as usize + 7, CompletionFlags::ATOMIC, "atomics");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    {
        let m = mr.read();
        assert_eq!(
            u64::from_le_bytes(m[0..8].try_into().unwrap()),
            n * (n + 1) / 2
        );
        assert_eq!(i32::from_le_bytes(m[8..12].try_into().unwrap()), -7);
        assert_eq!(i32::from_le_bytes(m[12..16].try_into().unwrap()), 5);
        assert_eq!(f64::from_le_bytes(m[16..24].try_into().unwrap()), 1.5);
        assert_eq!(f64::from_le_bytes(m[24..32].try_into().unwrap()), 2.25);
    }
    // Fetch-add, compare-swap (hit and miss), atomic read.
    let fetch = |op, operand: u64, compare: Option<u64>, ctx| {
        let req = AtomicRequest {
            op,
            datatype: AtomicType::U64,
            operand: Bytes::copy_from_slice(&operand.to_le_bytes()),
            compare: compare.map(|c| Bytes::copy_from_slice(&c.to_le_bytes())),
        };
        retry(
            &p,
            || {
                p.a.ep
                    .fetch_atomic(p.peer_b, req.clone(), BytesMut::new(), rk.at(0), ctx)
            },
            "fetch",
        );
        let (mut ok, errs) = gather(&p, true, 1, CompletionFlags::ATOMIC, "fetch");
        assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
        let c = ok.remove(0);
        assert!(c.flags.contains(CompletionFlags::READ));
        let b = c.buf.into_recv().expect("fetch buffer");
        u64::from_le_bytes(b[..8].try_into().unwrap())
    };
    let total = n * (n + 1) / 2;
    assert_eq!(fetch(AtomicOp::Sum, 10, None, 1), total);
    assert_eq!(fetch(AtomicOp::Cswap, 7, Some(total + 10), 2), total + 10);
    assert_eq!(fetch(AtomicOp::Cswap, 9, Some(12345), 3), 7);
    assert_eq!(fetch(AtomicOp::Read, 0, None, 4), 7);
    assert_eq!(u64::from_le_bytes(mr.read()[0..8].try_into().unwrap()), 7);
    // Bad atomics: refused when posted or by the target.
    let bad = AtomicRequest {
        op: AtomicOp::Bor,
        datatype: AtomicType::F32,
        operand: Bytes::from_static(&[0; 4]),
        compare: None,
    };
    let e = p.a.ep.atomic(p.peer_b, bad, rk.at(0), 9).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let past = AtomicRequest {
        op: AtomicOp::Sum,
        datatype: AtomicType::U64,
        operand: Bytes::copy_from_slice(&1u64.to_le_bytes()),
        compare: None,
    };
    retry(
        &p,
        || p.a.ep.atomic(p.peer_b, past.clone(), rk.at(4092), 10),
        "past",
    );
    let (ok, errs) = gather(&p, true, 1, CompletionFlags::ATOMIC, "past the end");
    assert!(ok.is_empty());
    assert_eq!(errs[0].error.kind(), ErrorKind::RemoteAccess);
}

#[test]
fn atomics_apply_in_order_and_fetch_previous_values() {
    for s in setups() {
        atomics(s);
    }
}

#[test]
fn device_rdma_completes_while_the_target_never_polls() {
    for setup in [Setup::Loopback, Setup::Udp, Setup::Shm] {
        let seed = test_seed();
        let p = pair(setup, seed);
        if p.emulated {
            // The udp device without RDMA: nothing to show here.
            eprintln!("{setup:?}: device has no RDMA; skipped");
            continue;
        }
        let (mr, rk) = target_region(&p, 1 << 20, Access::REMOTE_READ | Access::REMOTE_WRITE);
        // One message each way so both ends know each other's features (the handshake needs
        // the target's progress once, as it does on EFA).
        retry(&p, || p.b.ep.recv(BytesMut::with_capacity(8), 1), "recv");
        retry(
            &p,
            || p.a.ep.send(p.peer_b, Bytes::from_static(b"hi"), 2),
            "send",
        );
        gather(&p, false, 1, CompletionFlags::RECV, "hello");
        gather(&p, true, 1, CompletionFlags::SEND, "hello");
        for _ in 0..20 {
            p.b.ep.progress();
            p.a.ep.progress();
        }
        // From now on only the initiator is driven.
        let data = payload(seed, 0, 1 << 20);
        retry(
            &p,
            || p.a.ep.write(p.peer_b, data.clone(), rk.start(), 10),
            "write",
        );
        let deadline = Instant::now() + DEADLINE;
        let mut got = Vec::new();
        while got.is_empty() {
            let _ = p.a.cq.poll(&mut got, 8);
            assert!(
                Instant::now() < deadline,
                "{setup:?}: write never completed"
            );
        }
        assert_eq!(got[0].context, 10, "{setup:?}: {:?}", p.a.cq.read_err());
        assert!(mr.read()[..] == data[..], "{setup:?}: data");
        retry(
            &p,
            || {
                p.a.ep
                    .read(p.peer_b, BytesMut::new(), 1 << 20, rk.start(), 11)
            },
            "read",
        );
        got.clear();
        while got.is_empty() {
            let _ = p.a.cq.poll(&mut got, 8);
            assert!(Instant::now() < deadline, "{setup:?}: read never completed");
        }
        assert_eq!(got[0].context, 11);
        assert!(got[0].buf.as_recv().unwrap()[..] == data[..]);
        assert!(p.a.ep.stats().device_rma_bytes >= 2 << 20);
    }
}

#[test]
fn closing_the_target_region_fails_later_operations_exactly_once() {
    let seed = test_seed();
    for setup in [Setup::Loopback, Setup::LoopbackNoRdma] {
        let p = pair(setup, seed);
        let (mr, rk) = target_region(&p, 1 << 16, Access::REMOTE_WRITE);
        let n = 100;
        for i in 0..n {
            let d = payload(seed, i, 1 + (i * 613) % 60_000);
            retry(
                &p,
                || p.a.ep.write(p.peer_b, d.clone(), rk.start(), i as u64),
                "write",
            );
            if i == n / 2 {
                let _ = mr.close();
                break;
            }
        }
        let posted = n / 2 + 1;
        let (ok, errs) = gather(&p, true, posted, CompletionFlags::WRITE, "writes");
        let mut ctx: Vec<u64> = ok.iter().map(|c| c.context).collect();
        ctx.extend(errs.iter().map(|e| e.context));
        ctx.sort_unstable();
        ctx.dedup();
        assert_eq!(ctx.len(), posted, "{setup:?} seed {seed}: each write once");
        for e in &errs {
            assert_eq!(e.error.kind(), ErrorKind::RemoteAccess);
        }
        // After the close every write fails.
        retry(
            &p,
            || {
                p.a.ep
                    .write(p.peer_b, Bytes::from_static(b"x"), rk.start(), 999)
            },
            "late",
        );
        let (ok, errs) = gather(&p, true, 1, CompletionFlags::WRITE, "late write");
        assert!(ok.is_empty() && errs[0].error.kind() == ErrorKind::RemoteAccess);
    }
}

#[test]
fn refused_posts_hand_the_buffer_back() {
    let p = pair(Setup::Loopback, 1);
    let region =
        p.a.ep
            .domain()
            .register(vec![1u8; 64], Access::SEND)
            .unwrap();
    // A region without WRITE access cannot be the source of a write.
    let e =
        p.a.ep
            .write(p.peer_b, region, efa::RmaAddr { addr: 0, key: 1 }, 1)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.buf.as_region().is_some());
    // Compare operations need a compare operand and a fetch buffer.
    let req = AtomicRequest {
        op: AtomicOp::Cswap,
        datatype: AtomicType::U32,
        operand: Bytes::from_static(&[0; 4]),
        compare: None,
    };
    let e =
        p.a.ep
            .fetch_atomic(
                p.peer_b,
                req,
                BytesMut::with_capacity(4),
                efa::RmaAddr { addr: 0, key: 1 },
                2,
            )
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.buf.as_recv().is_some());
    // The emulation query.
    let e = p.a.ep.rma_emulation();
    assert!(!e.read && !e.write && e.atomics);
    let q = pair(Setup::LoopbackRdmaOff, 1);
    let e = q.a.ep.rma_emulation();
    assert!(e.read && e.write && e.atomics);
}

/// Messages sent from registered regions peers may read (as fabtests registers its buffers):
/// at or above the read-message threshold the receiver reads them (long read) and the sender
/// copies nothing; below it, or without device reads, they go in packets. Either way they
/// arrive intact, each send completes once and hands its region back unchanged.
fn region_sends(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let sizes = [1usize, 4095, 4096, 70_000, (1 << 20) - 1, 1 << 20, 3 << 20];
    let mut regions = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let data = payload(seed, i, len);
        let access = if i % 3 == 2 {
            Access::SEND
        } else {
            Access::SEND | Access::REMOTE_READ
        };
        let mr = p.a.ep.domain().register(data.to_vec(), access).unwrap();
        regions.push(data);
        retry(
            &p,
            || p.b.ep.recv(BytesMut::with_capacity(len), i as u64),
            "recv",
        );
        let mut mr = Some(mr);
        retry(
            &p,
            || match p.a.ep.send(p.peer_b, mr.take().unwrap(), i as u64) {
                Ok(()) => Ok(()),
                Err(e) => {
                    let k = e.kind();
                    mr = e.buf.into_region();
                    Err(efa::PostError {
                        error: efa::Error::new(k, "send"),
                        buf: efa::Buffer::None,
                    })
                }
            },
            "send",
        );
    }
    let n = sizes.len();
    let (sent, errs) = gather(&p, true, n, CompletionFlags::SEND, "sender");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let (got, errs) = gather(&p, false, n, CompletionFlags::RECV, "receiver");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut seen = HashSet::new();
    for c in &sent {
        let i = c.context as usize;
        assert!(seen.insert(i), "{setup:?} seed {seed}: send {i} twice");
        assert_eq!(c.len, sizes[i], "{setup:?} seed {seed}: send {i}");
        let mr = c.buf.as_region().expect("the region comes back");
        assert!(
            mr.read()[..] == regions[i][..],
            "{setup:?} seed {seed}: region {i} unchanged"
        );
    }
    for c in &got {
        let i = c.context as usize;
        assert_eq!(c.len, sizes[i], "{setup:?} seed {seed}: message {i}");
        assert!(
            c.buf.as_recv().expect("bytes") == &regions[i][..],
            "{setup:?} seed {seed}: message {i} intact"
        );
    }
}

#[test]
fn messages_from_registered_regions_arrive_intact() {
    for s in setups() {
        region_sends(s);
    }
}

/// Issue 17, defect 7: a peer's (emulated) writes with immediate data while the target's
/// completion queue is full and the target does not read it: the completions the target holds stay bounded
/// (`MAX_REMOTE_WRITE_EVENTS` in the engine, the queue's capacity in the queue), the writes are
/// held back instead, and once the target reads, every write completes once on both sides.
#[test]
fn writes_with_immediate_data_into_a_full_queue_stay_bounded() {
    use efa::proto::engine::MAX_REMOTE_WRITE_EVENTS;
    let seed = efa::fault::test_seed();
    // Emulated RMA (the engine serves the writes; device RDMA writes with immediate data on a
    // device without unsolicited write-recv are held back by the receive buffers instead).
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = LoopbackDevice::open(&net, LoopbackConfig::default()).unwrap();
    let d = Domain::with_device(dev, config(Setup::LoopbackRdmaOff));
    let (cqa, cqb) = (
        efa::CompletionQueue::new(&d, 4096).unwrap(),
        efa::CompletionQueue::new(&d, 8).unwrap(),
    );
    let av = efa::AddressVector::new(&d);
    let a = efa::Endpoint::<efa::Rdm>::builder(&d)
        .cq(&cqa)
        .av(&av)
        .build()
        .unwrap();
    let b = efa::Endpoint::<efa::Rdm>::builder(&d)
        .cq(&cqb)
        .av(&av)
        .build()
        .unwrap();
    let region = d
        .register(vec![0u8; 64], Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    let rk = region.remote_key().unwrap();
    let pb = av.insert(b.addr()).unwrap();
    let n = 3 * MAX_REMOTE_WRITE_EVENTS as u32;
    let mut posted = 0u32;
    let mut done_a = Vec::new();
    let mut most = 0;
    // Phase 1: the target only makes progress; its queue fills and stays full.
    let phase = Instant::now() + Duration::from_secs(2);
    while Instant::now() < phase && done_a.len() < n as usize {
        while posted < n {
            match a.write_data(
                pb,
                Bytes::from_static(b"imm"),
                rk.at(0),
                posted,
                posted as u64,
            ) {
                Ok(()) => posted += 1,
                Err(e) if e.error.kind() == ErrorKind::Again => break,
                Err(e) => panic!("seed {seed}: write {posted}: {}", e.error),
            }
        }
        b.progress();
        let _ = cqa.poll(&mut done_a, 256);
        most = most.max(b.resources().remote_write_events);
        assert!(
            cqb.len() <= cqb.capacity(),
            "seed {seed}: {} queued",
            cqb.len()
        );
    }
    assert!(
        most <= MAX_REMOTE_WRITE_EVENTS,
        "seed {seed}: the target held {most} write completions"
    );
    // Phase 2: the target reads; everything completes once.
    let mut got = vec![0u32; n as usize];
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen < n as usize || done_a.len() < n as usize {
        while posted < n {
            match a.write_data(
                pb,
                Bytes::from_static(b"imm"),
                rk.at(0),
                posted,
                posted as u64,
            ) {
                Ok(()) => posted += 1,
                Err(e) if e.error.kind() == ErrorKind::Again => break,
                Err(e) => panic!("seed {seed}: write {posted}: {}", e.error),
            }
        }
        let mut out = Vec::new();
        if let Err(e) = cqb.poll(&mut out, 64) {
            panic!("seed {seed}: target: {e}: {:?}", cqb.read_err());
        }
        for c in out {
            let i = c.data.expect("immediate data") as usize;
            got[i] += 1;
            seen += 1;
        }
        if let Err(e) = cqa.poll(&mut done_a, 256) {
            panic!("seed {seed}: initiator: {e}: {:?}", cqa.read_err());
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {seen} of {n} at the target, {} at the initiator",
            done_a.len()
        );
    }
    assert!(
        got.iter().all(|&k| k == 1),
        "seed {seed}: each write exactly once"
    );
    assert_eq!(done_a.len(), n as usize);
    assert_eq!(
        cqb.overruns(),
        0,
        "seed {seed}: never pushed into a full queue"
    );
}

/// A device with RDMA that leaves domain regions unregistered (the `Device::register_mem`
/// default): their keys are the domain's, which its NIC does not know. Counts the RDMA reads
/// its queue pairs post.
#[derive(Debug)]
struct Unregistered(Arc<dyn Device>, Arc<std::sync::atomic::AtomicUsize>);

impl Device for Unregistered {
    fn attr(&self) -> &efa::device::DeviceAttr {
        self.0.attr()
    }
    fn create_qp(&self, attr: efa::device::QpAttr) -> efa::Result<Box<dyn efa::device::QueuePair>> {
        Ok(Box::new(ReadCounting(
            self.0.create_qp(attr)?,
            self.1.clone(),
        )))
    }
    fn stats(&self) -> efa::DeviceStats {
        self.0.stats()
    }
}

#[derive(Debug)]
struct ReadCounting(
    Box<dyn efa::device::QueuePair>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl efa::device::QueuePair for ReadCounting {
    fn addr(&self) -> efa::RawAddr {
        self.0.addr()
    }
    fn qp_type(&self) -> efa::device::QpType {
        self.0.qp_type()
    }
    fn post_send(&mut self, wr: efa::device::SendWr) -> efa::Result<()> {
        self.0.post_send(wr)
    }
    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> efa::Result<()> {
        self.0.post_recv(wr_id, buf)
    }
    fn poll(&mut self, out: &mut Vec<efa::device::DeviceCompletion>, max: usize) -> usize {
        self.0.poll(out, max)
    }
    fn close(&mut self) {
        self.0.close()
    }
    fn unsolicited_write_recv(&self) -> bool {
        self.0.unsolicited_write_recv()
    }
    fn post_read(
        &mut self,
        wr_id: u64,
        dest: efa::RawAddr,
        local: BytesMut,
        remote: efa::device::RemoteIov,
    ) -> efa::Result<()> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.0.post_read(wr_id, dest, local, remote)
    }
    fn post_write(
        &mut self,
        wr_id: u64,
        dest: efa::RawAddr,
        local: Bytes,
        remote: efa::device::RemoteIov,
        imm: Option<u32>,
    ) -> efa::Result<()> {
        self.0.post_write(wr_id, dest, local, remote, imm)
    }
}

/// A region the device did not register is never offered to a peer's device RDMA read: a
/// message sent from it above the read threshold goes by long-CTS from the start instead of
/// by a long-read the peer's NIC would refuse (a libfabric 1.17 peer, which has no READ_NACK,
/// would hang on it). Issue 16, defect 14.
#[test]
fn unregistered_regions_are_never_offered_for_device_reads() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let cfg = Config::default()
        .with_inter_min_read_message_size(4096)
        .with_runt_size(0); // long-read, not a runt that carries everything
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let dev = || -> Arc<dyn Device> {
        Arc::new(Unregistered(
            LoopbackDevice::open(&net, LoopbackConfig::default().with_rdma(true))
                .expect("loopback"),
            reads.clone(),
        ))
    };
    let (da, db) = (
        Domain::with_device(dev(), cfg.clone()),
        Domain::with_device(dev(), cfg),
    );
    let (a, b) = (Node::new(&da), Node::new(&db));
    let peer_b = a.insert(b.ep.addr());
    b.insert(a.ep.addr());
    // A first message: the handshake, after which the sender knows the receiver can read.
    b.ep.recv(BytesMut::with_capacity(64), 0).unwrap();
    a.ep.send(peer_b, Bytes::from_static(b"hi"), 1).unwrap();
    let deadline = Instant::now() + DEADLINE;
    while b.collect_some().is_empty() {
        a.ep.progress();
        assert!(
            Instant::now() < deadline,
            "the first message did not arrive"
        );
    }
    a.collect(1, "first send completion");
    let len = 64 << 10;
    let msg = payload(3, 0, len);
    let region = da
        .register(BytesMut::from(&msg[..]), Access::SEND | Access::REMOTE_READ)
        .unwrap();
    b.ep.recv(BytesMut::with_capacity(len), 1).unwrap();
    a.ep.send(peer_b, region, 2).unwrap();
    let mut got = Vec::new();
    while got.is_empty() {
        a.ep.progress();
        got.extend(b.collect_some());
        assert!(Instant::now() < deadline, "the message did not arrive");
    }
    assert_eq!(got[0].buf.as_recv().unwrap()[..], msg[..]);
    a.collect(1, "send completion");
    assert_eq!(
        reads.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "a device read was tried with a key the device never registered"
    );
    assert_eq!(a.ep.stats().errors + b.ep.stats().errors, 0);
}

#[path = "rdm_rma/slices.rs"]
mod slices;

#[path = "rdm_rma/batch.rs"]
mod batch;
