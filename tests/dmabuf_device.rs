//! Device-only regions (`Domain::register_dmabuf_device_only`): GPU memory registered with the
//! NIC and never mapped by the crate, with a memfd standing in for the GPU's dmabuf (the test's
//! own view of the memfd is "the GPU's view": it writes a region's bytes before registering it,
//! and reads what the NIC put there with `pread`).
//!
//! The software devices refuse such a registration (every run). On the efa device under the
//! emulated NIC (`#[ignore]`d: `.ci/run` runs them with `EFA_TEST_DEVICE=efa` under
//! `efa-emu run`, and with `EFA_EMU_DMABUF=unmappable`, which makes a stand-in the NIC
//! registered unmappable by the program): device RDMA to, from and into such regions, long
//! messages from and into them by the long-read protocol, slices of one in flight at once, and
//! every path that would copy their bytes with the CPU refused with `NotSupported` naming the
//! operation.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{DeviceMemory, Node};
use efa::fault::test_seed;
use efa::{
    Access, AtomicOp, AtomicRequest, AtomicType, Completion, CompletionError, Config, Domain,
    ErrorKind, FaultConfig, MemoryRegion, PeerId, SendBuf, SendOptions, WriteOptions,
};

const PAGE: u64 = 4096;

/// Every local and remote right.
fn all() -> Access {
    Access::LOCAL | Access::REMOTE
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = efa::fault::Rng::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// A domain on the efa device (the emulated NIC) with `config`; fails the test elsewhere.
fn efa_domain(config: Config) -> Domain {
    assert!(
        common::on_efa(),
        "device-only regions need the efa device: run with EFA_TEST_DEVICE=efa under \
         `efa-emu run -- cargo test --features efa` (see .ci/run)"
    );
    let dev = common::net_device(IpAddr::V4(Ipv4Addr::LOCALHOST), FaultConfig::default());
    Domain::with_device(dev, config)
}

/// Endpoints whose same-host peers go through the NIC.
fn pair(d: &Domain) -> (Node, Node, PeerId, PeerId) {
    let (a, b) = (Node::device_path(d), Node::device_path(d));
    let pb = a.insert(b.ep.addr());
    let pa = b.insert(a.ep.addr());
    (a, b, pb, pa)
}

/// Polls both nodes until `a` has `n` completions; an error completion fails the test.
fn until(a: &Node, b: &Node, n: usize, what: &str) -> Vec<Completion> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    while got.len() < n {
        a.poll_ok(&mut got, &what);
        let _ = b.cq.poll(&mut Vec::new(), 0);
        assert!(Instant::now() < deadline, "{what}: timed out");
    }
    got
}

/// Polls both nodes until `a` has an error completion; a success fails the test.
fn until_err(a: &Node, b: &Node, what: &str) -> CompletionError {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut out = Vec::new();
        match a.cq.poll(&mut out, 1) {
            Ok(0) => {}
            Ok(_) => panic!("{what}: completed instead of failing"),
            Err(e) if e.kind() == ErrorKind::ErrorAvailable => return a.cq.read_err().unwrap(),
            Err(e) => panic!("{what}: {e}"),
        }
        let _ = b.cq.poll(&mut Vec::new(), 0);
        assert!(Instant::now() < deadline, "{what}: no error completion");
    }
}

/// Sends `buf` to `peer`, retrying while the engine waits for the peer's handshake (`Again`:
/// a device-only region goes by the long-read protocol, which needs the peer's features).
fn send(a: &Node, b: &Node, peer: PeerId, mut buf: SendBuf, ctx: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match a.ep.send(peer, buf, ctx) {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::Again => {
                buf = match e.buf {
                    efa::Buffer::Region(r) => SendBuf::Region(r),
                    efa::Buffer::Send(b) => SendBuf::Bytes(b),
                    other => panic!("send handed back {other:?}"),
                };
                let _ = a.cq.poll(&mut Vec::new(), 0);
                let _ = b.cq.poll(&mut Vec::new(), 0);
                assert!(Instant::now() < deadline, "send: still Again");
            }
            Err(e) => panic!("send: {}", e.error),
        }
    }
}

/// The bytes at `off` of the GPU's view.
fn gpu(mem: &DeviceMemory, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mem.read_exact_at(&mut v, off).unwrap();
    v
}

/// `(kind, operation)` of a refusal.
fn said(e: &efa::Error) -> (ErrorKind, &'static str) {
    (e.kind(), e.op())
}

/// The software devices have no NIC to reach device memory: the registration is refused, naming
/// itself and the device. On the efa device (`EFA_TEST_DEVICE=efa`) it is taken.
#[test]
fn software_devices_refuse_device_only_registrations() {
    for (name, d, _keep) in common::device_domains("efa-devonly-") {
        let mem = DeviceMemory::stand_in(&format!("sw-{name}"), 2 * PAGE);
        match d.register_dmabuf_device_only(mem.as_fd(), 0, PAGE as usize, all()) {
            Ok(mr) => {
                assert_eq!(name, "efa", "{name} took a device-only region");
                assert!(mr.is_device_only() && mr.is_dmabuf());
            }
            Err(e) => {
                assert_ne!(name, "efa", "{e}");
                assert_eq!(
                    said(&e),
                    (ErrorKind::NotSupported, "register_dmabuf_device_only"),
                    "{name}: {e}"
                );
                assert!(
                    e.to_string().contains(name),
                    "{name}: names the device: {e}"
                );
            }
        }
        // Bad ranges are refused before any device is asked.
        for (off, len) in [(0u64, 0usize), (100, 4096), (PAGE, 2 * PAGE as usize)] {
            let e = d
                .register_dmabuf_device_only(mem.as_fd(), off, len, all())
                .unwrap_err();
            assert_eq!(
                e.kind(),
                ErrorKind::InvalidArgument,
                "{name} {off}+{len}: {e}"
            );
        }
        let e = d
            .register_dmabuf_device_only(mem.as_fd(), 0, 4096, Access::empty())
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{name}: {e}");
    }
}

/// Device RDMA writes into a device-only region and reads from it through its key; a
/// device-only region is the local source of a write (with immediate data) and the
/// destination of a read. What lands is checked through the GPU's view.
#[test]
#[ignore = "needs the efa device under the emulated NIC (.ci/run)"]
fn device_rdma_moves_device_only_regions() {
    let seed = test_seed();
    let d = efa_domain(Config::default());
    let (a, b, pb, _) = pair(&d);
    let len = 4 * PAGE as usize;
    // The target of a peer's RDMA.
    let tmem = DeviceMemory::stand_in("do-target", 8 * PAGE);
    let target = d
        .register_dmabuf_device_only(tmem.as_fd(), PAGE, len, all())
        .unwrap();
    assert!(target.is_device_only() && target.is_dmabuf());
    let rk = target.remote_key().unwrap();
    let data = pattern(seed, len);
    a.ep.write(pb, Bytes::from(data.clone()), rk.at(0), 1)
        .unwrap();
    until(&a, &b, 1, "write into");
    assert!(
        gpu(&tmem, PAGE, len) == data,
        "seed {seed}: the write is in the GPU's memory"
    );
    assert!(
        gpu(&tmem, 0, PAGE as usize).iter().all(|&x| x == 0),
        "nothing before the range"
    );
    a.ep.read(pb, BytesMut::new(), len - 100, rk.at(100), 2)
        .unwrap();
    let c = until(&a, &b, 1, "read from").pop().unwrap();
    assert!(
        c.buf.as_recv().unwrap()[..] == data[100..],
        "seed {seed}: read back"
    );

    // The local source of a write with immediate data, and the destination of a read.
    let data2 = pattern(seed ^ 1, len);
    let smem = DeviceMemory::stand_in("do-wsrc", len as u64);
    smem.write_all_at(&data2, 0).unwrap();
    let src = d
        .register_dmabuf_device_only(smem.as_fd(), 0, len, Access::WRITE)
        .unwrap();
    let host = d.register(vec![0u8; len], Access::REMOTE).unwrap();
    let hk = host.remote_key().unwrap();
    a.ep.write_data(pb, src, hk.at(0), 0xabc, 3).unwrap();
    let c = until(&a, &b, 1, "write from").pop().unwrap();
    assert!(
        c.buf.into_region().unwrap().is_device_only(),
        "the region comes back"
    );
    let r = until(&b, &a, 1, "remote write").pop().unwrap();
    assert_eq!(r.data, Some(0xabc));
    assert!(
        host.read()[..] == data2[..],
        "seed {seed}: written from the GPU's memory"
    );
    let dmem = DeviceMemory::stand_in("do-rdst", len as u64);
    let dst = d
        .register_dmabuf_device_only(dmem.as_fd(), 0, len, Access::READ)
        .unwrap();
    a.ep.read(pb, dst, len, hk.at(0), 4).unwrap();
    let c = until(&a, &b, 1, "read into").pop().unwrap();
    assert_eq!(c.len, len);
    assert!(c.buf.into_region().unwrap().is_device_only());
    assert!(
        gpu(&dmem, 0, len) == data2,
        "seed {seed}: read into the GPU's memory"
    );
    let s = a.ep.stats();
    assert!(s.device_rma_bytes >= 4 * len as u64 - 100, "{s:?}");
    assert_eq!(s.emulated_rma_bytes, 0, "{s:?}");
}

/// A message from a device-only region goes by the long-read protocol at any size (the
/// receiver's NIC reads it): received into a device-only region (read straight into it) and
/// into a plain buffer.
#[test]
#[ignore = "needs the efa device under the emulated NIC (.ci/run)"]
fn messages_go_from_and_into_device_only_regions_by_long_read() {
    let seed = test_seed();
    let d = efa_domain(Config::default());
    let (a, b, pb, _) = pair(&d);
    for (i, len) in [1usize, 100, 70_000, 1 << 20].into_iter().enumerate() {
        let data = pattern(seed ^ len as u64, len);
        let smem = DeviceMemory::stand_in(&format!("lr-src-{len}"), len as u64);
        smem.write_all_at(&data, 0).unwrap();
        let src = d
            .register_dmabuf_device_only(smem.as_fd(), 0, len, Access::SEND | Access::REMOTE_READ)
            .unwrap();
        let rmem = DeviceMemory::stand_in(&format!("lr-dst-{len}"), len as u64 + 2 * PAGE);
        let dst = d
            .register_dmabuf_device_only(rmem.as_fd(), PAGE, len, Access::RECV)
            .unwrap();
        b.ep.recv(dst, 10 + i as u64).unwrap();
        send(&a, &b, pb, SendBuf::Region(src), 20 + i as u64);
        let got = until(&b, &a, 1, "long-read receive").pop().unwrap();
        assert_eq!((got.context, got.len), (10 + i as u64, len));
        assert!(got.buf.into_region().unwrap().is_device_only());
        assert!(
            gpu(&rmem, PAGE, len) == data,
            "seed {seed} {len}: in the GPU's memory"
        );
        let sent = until(&a, &b, 1, "long-read send").pop().unwrap();
        assert!(sent.buf.into_region().unwrap().is_device_only());
        // Into a plain buffer: the NIC reads the GPU's memory into the host's.
        let again = d
            .register_dmabuf_device_only(smem.as_fd(), 0, len, Access::SEND | Access::REMOTE_READ)
            .unwrap();
        b.ep.recv(BytesMut::with_capacity(len), 30).unwrap();
        send(&a, &b, pb, SendBuf::Region(again), 31);
        let got = until(&b, &a, 1, "into host memory").pop().unwrap();
        assert!(
            got.buf.as_recv().unwrap()[..] == data[..],
            "seed {seed} {len}"
        );
        until(&a, &b, 1, "send");
    }
}

/// Slices of one device-only region in flight at once: sixteen pages written from at once,
/// then read into at once (each to another place), and joined back together.
#[test]
#[ignore = "needs the efa device under the emulated NIC (.ci/run)"]
fn slices_of_a_device_only_region_are_in_flight_at_once() {
    let seed = test_seed();
    let d = efa_domain(Config::default());
    let (a, b, pb, _) = pair(&d);
    const N: usize = 16;
    let len = N * PAGE as usize;
    let data = pattern(seed, len);
    let mem = DeviceMemory::stand_in("slices", len as u64);
    mem.write_all_at(&data, 0).unwrap();
    let region = d
        .register_dmabuf_device_only(mem.as_fd(), 0, len, all())
        .unwrap();
    let mut host = d.register(vec![0u8; len], Access::REMOTE).unwrap();
    let hk = host.remote_key().unwrap();
    let p = PAGE as usize;
    // Page i of the region goes to page N-1-i of the host.
    for (i, page) in region.chunks(p).unwrap().into_iter().enumerate() {
        a.ep.write(pb, page, hk.at(((N - 1 - i) * p) as u64), i as u64)
            .unwrap();
    }
    let done = until(&a, &b, N, "page writes");
    let mut pages: Vec<MemoryRegion> = done
        .into_iter()
        .map(|c| c.buf.into_region().unwrap())
        .collect();
    for i in 0..N {
        let want = &data[(N - 1 - i) * p..(N - i) * p];
        assert!(
            &host.read()[i * p..(i + 1) * p] == want,
            "seed {seed}: page {i}"
        );
    }
    // Read the host's pages back into the slices, page i from page i.
    let fresh = pattern(seed ^ 7, len);
    host.write().copy_from_slice(&fresh);
    for (i, page) in pages.drain(..).enumerate() {
        let off = page.offset() as u64;
        a.ep.read(pb, page, p, hk.at(off), 100 + i as u64).unwrap();
    }
    let done = until(&a, &b, N, "page reads");
    let mut pages: Vec<MemoryRegion> = done
        .into_iter()
        .map(|c| c.buf.into_region().unwrap())
        .collect();
    pages.sort_by_key(MemoryRegion::offset);
    let mut whole = pages.remove(0);
    for p in pages {
        whole.unsplit(p).expect("adjacent slices");
    }
    assert_eq!(whole.len(), len);
    assert!(
        gpu(&mem, 0, len) == fresh,
        "seed {seed}: read into the slices"
    );
}

/// Every path that would copy a device-only region's bytes with the CPU refuses with
/// `NotSupported` naming the operation: the guards, the domain's emulated-RMA entry points,
/// sends it cannot take by long-read, gathers and scatters, and messages that arrive in packets
/// (the receive completes with the refusal; nothing lands in the region).
#[test]
#[ignore = "needs the efa device under the emulated NIC (.ci/run)"]
fn cpu_paths_refuse_device_only_regions() {
    let d = efa_domain(Config::default());
    let (a, b, pb, _) = pair(&d);
    let mem = DeviceMemory::stand_in("refusals", 4 * PAGE);
    let len = PAGE as usize;
    let mut mr = d
        .register_dmabuf_device_only(mem.as_fd(), 0, len, all())
        .unwrap();
    assert_eq!(
        said(&mr.try_read().err().unwrap()),
        (ErrorKind::NotSupported, "mr_read")
    );
    assert_eq!(
        said(&mr.try_write().err().unwrap()),
        (ErrorKind::NotSupported, "mr_write")
    );
    assert!(
        mr.read().is_empty() && mr.write().is_empty(),
        "the CPU sees no bytes"
    );
    let rk = mr.remote_key().unwrap();
    let e = d.remote_write(rk.key, rk.addr, b"x").unwrap_err();
    assert_eq!(
        said(&e),
        (ErrorKind::NotSupported, "mr_remote_write"),
        "{e}"
    );
    let e = d.remote_read(rk.key, rk.addr, 8).unwrap_err();
    assert_eq!(said(&e), (ErrorKind::NotSupported, "mr_remote_read"), "{e}");

    // A send from a region peers may not read could go only in packets.
    let no_read = d
        .register_dmabuf_device_only(mem.as_fd(), PAGE, len, Access::SEND)
        .unwrap();
    let e = a.ep.send(pb, no_read, 1).unwrap_err();
    assert_eq!(
        said(&e.error),
        (ErrorKind::NotSupported, "send"),
        "{}",
        e.error
    );
    assert!(e.buf.as_region().is_some_and(MemoryRegion::is_device_only));

    // Gathers and scatters copy.
    let part = d
        .register_dmabuf_device_only(mem.as_fd(), 2 * PAGE, len, all())
        .unwrap();
    let e =
        a.ep.send_iov(pb, vec![SendBuf::Region(part)], SendOptions::default(), 2)
            .unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::NotSupported, "{}", e.error);
    let part = e.buf.into_iov().unwrap().remove(0).into_region().unwrap();
    let e =
        a.ep.write_iov(
            pb,
            vec![SendBuf::Region(part)],
            rk.at(0),
            WriteOptions::default(),
            3,
        )
        .unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::NotSupported, "{}", e.error);
    let part = e.buf.into_iov().unwrap().remove(0).into_region().unwrap();
    let e =
        b.ep.recv_iov(vec![efa::RecvBuf::Region(part)], Default::default(), 4)
            .unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::NotSupported, "{}", e.error);

    // Messages that arrive in packets (eager, medium, long-CTS) are refused by the receive.
    for (i, n) in [100usize, 3000, 4096].into_iter().enumerate() {
        let dst = d
            .register_dmabuf_device_only(mem.as_fd(), 3 * PAGE, len, Access::RECV)
            .unwrap();
        b.ep.recv(dst, 50 + i as u64).unwrap();
        a.ep.send(pb, Bytes::from(vec![0xee; n]), 60).unwrap();
        let e = until_err(&b, &a, "an eager message into device memory");
        assert_eq!(
            said(&e.error),
            (ErrorKind::NotSupported, "recv"),
            "{n}: {}",
            e.error
        );
        assert_eq!((e.context, e.len, e.olen), (50 + i as u64, 0, n), "{n}");
        assert!(e.buf.into_region().unwrap().is_device_only());
        until(&a, &b, 1, "the sender's completion");
    }
    assert!(
        gpu(&mem, 0, 4 * len).iter().all(|&x| x == 0),
        "no byte reached the GPU's memory"
    );
    drop(mr);
}

/// Emulated RMA cannot reach a device-only region: a peer without device RDMA that reads it,
/// writes it or applies an atomic to it gets a remote-access error (nothing is written), and an
/// endpoint without device RDMA refuses to emulate a write from, a read into or a send of one.
#[test]
#[ignore = "needs the efa device under the emulated NIC (.ci/run)"]
fn emulated_rma_refuses_device_only_regions() {
    let d = efa_domain(Config::default());
    let emu = efa_domain(Config::default().with_use_device_rdma(false));
    let owner = Node::device_path(&d);
    let peer = Node::device_path(&emu);
    let po = peer.insert(owner.ep.addr());
    owner.insert(peer.ep.addr());
    let mem = DeviceMemory::stand_in("emulated", 4 * PAGE);
    let len = PAGE as usize;
    let target = d
        .register_dmabuf_device_only(mem.as_fd(), 0, len, all())
        .unwrap();
    let rk = target.remote_key().unwrap();
    peer.ep.read(po, BytesMut::new(), 64, rk.at(0), 1).unwrap();
    let e = until_err(&peer, &owner, "an emulated read of device memory");
    assert_eq!(e.error.kind(), ErrorKind::RemoteAccess, "{}", e.error);
    peer.ep
        .write(po, Bytes::from(vec![0xab; 64]), rk.at(0), 2)
        .unwrap();
    let e = until_err(&peer, &owner, "an emulated write to device memory");
    assert_eq!(e.error.kind(), ErrorKind::RemoteAccess, "{}", e.error);
    let req = AtomicRequest {
        op: AtomicOp::Sum,
        datatype: AtomicType::U64,
        operand: Bytes::from(1u64.to_le_bytes().to_vec()),
        compare: None,
    };
    peer.ep
        .fetch_atomic(po, req, BytesMut::with_capacity(8), rk.at(8), 3)
        .unwrap();
    let e = until_err(&peer, &owner, "an atomic on device memory");
    assert_eq!(e.error.kind(), ErrorKind::RemoteAccess, "{}", e.error);
    assert!(gpu(&mem, 0, len).iter().all(|&x| x == 0), "nothing written");

    // This side without device RDMA: nothing may copy its own device-only regions.
    let host = d.register(vec![0u8; len], Access::REMOTE).unwrap();
    let hk = host.remote_key().unwrap();
    let src = emu
        .register_dmabuf_device_only(mem.as_fd(), PAGE, len, all())
        .unwrap();
    let refusal = |r: Result<(), efa::PostError>, what: &str| match r {
        Err(e) => {
            assert_eq!(
                e.error.kind(),
                ErrorKind::NotSupported,
                "{what}: {}",
                e.error
            );
            assert!(e.buf.as_region().is_some_and(MemoryRegion::is_device_only));
            e.buf.into_region().unwrap()
        }
        Ok(()) => {
            let e = until_err(&peer, &owner, what);
            assert_eq!(
                e.error.kind(),
                ErrorKind::NotSupported,
                "{what}: {}",
                e.error
            );
            e.buf.into_region().unwrap()
        }
    };
    let src = refusal(peer.ep.write(po, src, hk.at(0), 4), "write");
    let src = refusal(peer.ep.read(po, src, len, hk.at(0), 5), "read");
    let e = peer.ep.send(po, src, 6).unwrap_err();
    assert_eq!(
        said(&e.error),
        (ErrorKind::NotSupported, "send"),
        "{}",
        e.error
    );
    assert!(host.read().iter().all(|&x| x == 0));
}

/// `EFA_EMU_DMABUF=unmappable`: once the emulated NIC registered a stand-in, the program cannot
/// map it for writing (as GPU memory): a CPU-mapped registration of it is refused with
/// `NotSupported` ("not CPU-mappable"), while device-only regions of it work, also registered
/// again after a close.
#[test]
#[ignore = "needs the efa device under the emulated NIC with EFA_EMU_DMABUF=unmappable (.ci/run)"]
fn the_unmappable_switch_leaves_device_only_registration() {
    assert_eq!(
        std::env::var("EFA_EMU_DMABUF").as_deref(),
        Ok("unmappable"),
        "run under `EFA_EMU_DMABUF=unmappable efa-emu run` (see .ci/run)"
    );
    let seed = test_seed();
    let d = efa_domain(Config::default());
    let (a, b, pb, _) = pair(&d);
    let len = 2 * PAGE as usize;
    let data = pattern(seed, len);
    let mem = DeviceMemory::stand_in("unmappable", 4 * PAGE);
    // The GPU's own writes come before the NIC makes the memory unmappable.
    mem.write_all_at(&data, 0).unwrap();
    let first = d
        .register_dmabuf_device_only(mem.as_fd(), 0, len, all())
        .unwrap();
    let e = efa::mem::SharedMapping::map(mem.as_fd(), 0, PAGE as usize)
        .err()
        .expect("the program can no longer map it for writing");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    let e = d
        .register_dmabuf(mem.as_fd(), 2 * PAGE, PAGE as usize, Access::REMOTE_WRITE)
        .unwrap_err();
    assert_eq!(
        said(&e),
        (ErrorKind::NotSupported, "register_dmabuf"),
        "{e}"
    );
    assert!(e.to_string().contains("not CPU-mappable"), "{e}");
    // The NIC still reaches it.
    let rk = first.remote_key().unwrap();
    a.ep.read(pb, BytesMut::new(), len, rk.at(0), 1).unwrap();
    let c = until(&a, &b, 1, "read").pop().unwrap();
    assert!(c.buf.as_recv().unwrap()[..] == data[..], "seed {seed}");
    a.ep.write(pb, Bytes::from_static(b"by the NIC"), rk.at(PAGE), 2)
        .unwrap();
    until(&a, &b, 1, "write");
    assert_eq!(gpu(&mem, PAGE, 10), b"by the NIC");
    // Closed and registered again (and another range): the NIC's view of it stays.
    drop(first);
    let again = d
        .register_dmabuf_device_only(mem.as_fd(), 0, len, all())
        .unwrap();
    let more = d
        .register_dmabuf_device_only(mem.as_fd(), 2 * PAGE, len, all())
        .unwrap();
    a.ep.read(
        pb,
        BytesMut::new(),
        10,
        again.remote_key().unwrap().at(PAGE),
        3,
    )
    .unwrap();
    let c = until(&a, &b, 1, "read again").pop().unwrap();
    assert_eq!(c.buf.as_recv().unwrap(), &b"by the NIC"[..]);
    a.ep.write(
        pb,
        Bytes::from_static(b"more"),
        more.remote_key().unwrap().at(0),
        4,
    )
    .unwrap();
    until(&a, &b, 1, "write more");
    assert_eq!(gpu(&mem, 2 * PAGE, 4), b"more");
}

/// The same-host path copies messages with the CPU: on a routed efa device (shm for peers on
/// this host, as `FI_EFA_ENABLE_SHM_TRANSFER` gives), a send of a device-only region to a peer
/// the path reaches is refused, and a message that comes by the path into a device-only
/// receive completes it with the refusal. DGRAM endpoints copy too and refuse both.
#[test]
#[ignore = "needs the efa device under the emulated NIC (.ci/run)"]
fn the_same_host_path_and_dgram_refuse_device_only_regions() {
    let plain = efa_domain(Config::default());
    let dir = common::shm_test_dir("efa-devonly-route-");
    let routed = efa::device::route::RoutedDevice::open(
        plain.device().clone(),
        efa::device::shm::ShmConfig::in_dir(dir.path()),
    )
    .unwrap();
    let d = Domain::with_device(routed, Config::default());
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    b.insert(a.ep.addr());
    let mem = DeviceMemory::stand_in("local-path", 4 * PAGE);
    let len = PAGE as usize;
    let src = d
        .register_dmabuf_device_only(mem.as_fd(), 0, len, Access::SEND | Access::REMOTE_READ)
        .expect("a routed efa device registers with its NIC");
    let e = a.ep.send(pb, src, 1).unwrap_err();
    assert_eq!(
        said(&e.error),
        (ErrorKind::NotSupported, "send"),
        "{}",
        e.error
    );
    assert!(
        e.error.to_string().contains("local_path(false)"),
        "{}",
        e.error
    );
    let dst = d
        .register_dmabuf_device_only(mem.as_fd(), PAGE, len, Access::RECV)
        .unwrap();
    b.ep.recv(dst, 2).unwrap();
    a.ep.send(pb, Bytes::from(vec![0x5a; 1000]), 3).unwrap();
    let e = until_err(&b, &a, "a same-host message into device memory");
    assert_eq!(
        said(&e.error),
        (ErrorKind::NotSupported, "recv"),
        "{}",
        e.error
    );
    assert!(e.buf.into_region().unwrap().is_device_only());
    until(&a, &b, 1, "the sender's completion");
    assert!(
        gpu(&mem, 0, 2 * len).iter().all(|&x| x == 0),
        "nothing written"
    );

    // DGRAM: every send and receive is a copy.
    let cq = efa::CompletionQueue::new(&plain, 64).unwrap();
    let av = efa::AddressVector::new(&plain);
    let ep = efa::Endpoint::<efa::Dgram>::builder(&plain)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let me = av.insert(ep.addr()).unwrap();
    let r = plain
        .register_dmabuf_device_only(mem.as_fd(), 2 * PAGE, len, all())
        .unwrap();
    let e = ep.send(me, r, 4).unwrap_err();
    assert_eq!(
        said(&e.error),
        (ErrorKind::NotSupported, "send"),
        "{}",
        e.error
    );
    let r = e.buf.into_region().unwrap();
    let e = ep.recv(r, 5).unwrap_err();
    assert_eq!(
        said(&e.error),
        (ErrorKind::NotSupported, "recv"),
        "{}",
        e.error
    );
}
