//! Device memory as dmabuf regions (`Domain::register_dmabuf`), with a memfd standing in for a
//! GPU's dmabuf: on the loopback, udp and shm devices (and, with `EFA_TEST_DEVICE=efa` under
//! the emulated NIC, on the efa device in place of udp) such a region is the target of a
//! peer's writes, reads and atomics, the source of a send and the destination of a receive;
//! what lands in it is in the file (read back through the file, not the region); bad ranges and
//! descriptors are refused; closing unmaps it and revokes its key.

mod common;

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{DeviceMemory, Node, loopback_domain};
use efa::device::loopback::LoopbackNetwork;
use efa::fault::test_seed;
use efa::info::{Caps, EpType};
use efa::{
    Access, AtomicOp, AtomicRequest, AtomicType, Completion, Domain, ErrorKind, FaultConfig, Hints,
    MemoryRegion, PeerId, getinfo,
};

const PAGE: u64 = 4096;

/// A memfd of `len` bytes named `name` (unique per test: the name shows in /proc/self/maps).
fn memfd(name: &str, len: u64) -> File {
    common::memfd(name, len, 0)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = efa::fault::Rng::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// The devices of this run, each a domain with what keeps it alive.
fn setups() -> Vec<(&'static str, Domain, Box<dyn std::any::Any>)> {
    common::device_domains("efa-dmabuf-")
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

fn pair(d: &Domain) -> (Node, Node, PeerId, PeerId) {
    let (a, b) = (Node::new(d), Node::new(d));
    let pb = a.insert(b.ep.addr());
    let pa = b.insert(a.ep.addr());
    (a, b, pb, pa)
}

/// A peer writes into, reads from and applies atomics to a dmabuf region; the bytes are the
/// file's (read and written through the file itself).
#[test]
fn dmabuf_regions_are_targets_of_writes_reads_and_atomics() {
    let seed = test_seed();
    for (name, d, _keep) in setups() {
        let (a, b, pb, _) = pair(&d);
        let file = DeviceMemory::new(&format!("target-{name}"), 4 * PAGE);
        let len = 2 * PAGE as usize;
        let mr = d
            .register_dmabuf(
                file.as_fd(),
                PAGE,
                len,
                Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(mr.is_dmabuf(), "{name}");
        let rk = mr.remote_key().unwrap();
        assert_eq!(rk.len, len as u64);
        // A write lands in the file at the region's offset.
        let data = pattern(seed, len);
        a.ep.write(pb, Bytes::from(data.clone()), rk.at(0), 1)
            .unwrap();
        until(&a, &b, 1, name);
        let mut back = vec![0u8; len];
        file.read_exact_at(&mut back, PAGE).unwrap();
        assert!(back == data, "{name} seed {seed}: the write is in the file");
        // By the device's one-sided RDMA (the NIC's, on efa: the dmabuf registered as such).
        assert!(a.ep.stats().device_rma_bytes >= len as u64, "{name}");
        if name == "efa" {
            let s = d.device_stats();
            assert_eq!(
                s.dmabuf_registrations, 1,
                "{name}: ibv_reg_dmabuf_mr: {s:?}"
            );
        }
        let mut outside = vec![0u8; PAGE as usize];
        file.read_exact_at(&mut outside, 0).unwrap();
        assert!(
            outside.iter().all(|&x| x == 0),
            "{name}: nothing before the range"
        );
        // What the file says is what a read gets.
        file.write_all_at(b"from the file", PAGE + 100).unwrap();
        a.ep.read(pb, BytesMut::new(), 13, rk.at(100), 2).unwrap();
        let c = until(&a, &b, 1, name).pop().unwrap();
        assert_eq!(c.buf.as_recv().unwrap(), &b"from the file"[..], "{name}");
        assert_eq!(
            &mr.read()[100..113],
            b"from the file",
            "{name}: the guard sees it"
        );
        // An atomic on 8 bytes of it.
        file.write_all_at(&40u64.to_le_bytes(), PAGE + 512).unwrap();
        let req = AtomicRequest {
            op: AtomicOp::Sum,
            datatype: AtomicType::U64,
            operand: Bytes::from(2u64.to_le_bytes().to_vec()),
            compare: None,
        };
        a.ep.fetch_atomic(pb, req, BytesMut::with_capacity(8), rk.at(512), 3)
            .unwrap();
        let c = until(&a, &b, 1, name).pop().unwrap();
        assert_eq!(c.buf.as_recv().unwrap(), &40u64.to_le_bytes()[..], "{name}");
        let mut v = [0u8; 8];
        file.read_exact_at(&mut v, PAGE + 512).unwrap();
        assert_eq!(u64::from_le_bytes(v), 42, "{name}");
        drop(mr);
    }
}

/// A send from a dmabuf region and a receive into one: the message is the file's bytes, and
/// lands in the receiver's file.
#[test]
fn dmabuf_regions_send_and_receive() {
    let seed = test_seed();
    for (name, d, _keep) in setups() {
        let (a, b, pb, _) = pair(&d);
        for len in [100usize, 70_000] {
            let src_file = DeviceMemory::new(&format!("src-{name}"), 32 * PAGE);
            let dst_file = DeviceMemory::new(&format!("dst-{name}"), 32 * PAGE);
            let data = pattern(seed ^ len as u64, len);
            src_file.write_all_at(&data, 0).unwrap();
            let src = d
                .register_dmabuf(src_file.as_fd(), 0, len, Access::SEND)
                .unwrap();
            let dst = d
                .register_dmabuf(dst_file.as_fd(), 2 * PAGE, len, Access::RECV)
                .unwrap();
            b.ep.recv(dst, 7).unwrap();
            a.ep.send(pb, src, 8).unwrap();
            let got = until(&b, &a, 1, name).pop().unwrap();
            assert_eq!((got.context, got.len), (7, len), "{name}");
            let dst: MemoryRegion = got.buf.into_region().unwrap();
            assert!(dst.read()[..] == data[..], "{name} {len}: the region");
            let mut back = vec![0u8; len];
            dst_file.read_exact_at(&mut back, 2 * PAGE).unwrap();
            assert!(
                back == data,
                "{name} seed {seed} {len}: the receiver's file"
            );
            let sent = until(&a, &b, 1, name).pop().unwrap();
            assert!(sent.buf.into_region().unwrap().is_dmabuf(), "{name}");
        }
    }
}

/// A dmabuf region as the local side of one-sided operations: the source of a write and the
/// destination of a read (on efa, straight from and into the dmabuf under its own
/// registration: no registration per operation).
#[test]
fn dmabuf_regions_are_sources_of_writes_and_destinations_of_reads() {
    let seed = test_seed();
    for (name, d, _keep) in setups() {
        let (a, b, pb, _) = pair(&d);
        let len = 3 * PAGE as usize;
        let target = d
            .register(vec![0u8; len], Access::REMOTE_WRITE | Access::REMOTE_READ)
            .unwrap();
        let rk = target.remote_key().unwrap();
        let src_file = DeviceMemory::new(&format!("wsrc-{name}"), len as u64);
        let data = pattern(seed, len);
        src_file.write_all_at(&data, 0).unwrap();
        let src = d
            .register_dmabuf(src_file.as_fd(), 0, len, Access::WRITE)
            .unwrap();
        let before = d.device_stats();
        a.ep.write(pb, src, rk.at(0), 1).unwrap();
        let c = until(&a, &b, 1, name).pop().unwrap();
        assert!(
            c.buf.into_region().unwrap().is_dmabuf(),
            "{name}: the region comes back"
        );
        assert!(
            target.read()[..] == data[..],
            "{name} seed {seed}: written from the dmabuf"
        );
        let dst_file = DeviceMemory::new(&format!("rdst-{name}"), len as u64);
        let dst = d
            .register_dmabuf(dst_file.as_fd(), 0, len, Access::READ)
            .unwrap();
        a.ep.read(pb, dst, len, rk.at(0), 2).unwrap();
        let c = until(&a, &b, 1, name).pop().unwrap();
        assert_eq!(c.len, len, "{name}");
        let mut back = vec![0u8; len];
        dst_file.read_exact_at(&mut back, 0).unwrap();
        assert!(back == data, "{name} seed {seed}: read into the dmabuf");
        if name == "efa" {
            let s = d.device_stats();
            assert_eq!(s.mr_registrations, before.mr_registrations, "{name}: {s:?}");
        }
    }
}

/// Bad ranges, descriptors and rights are refused with clear errors; nothing is mapped then.
#[test]
fn bad_dmabuf_registrations_are_refused() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let file = memfd("efa-dmabuf-refused", 2 * PAGE);
    let rw = Access::REMOTE_WRITE;
    for (what, off, len, access, kind) in [
        ("empty", 0, 0, rw, ErrorKind::InvalidArgument),
        (
            "unaligned offset",
            100,
            4096,
            rw,
            ErrorKind::InvalidArgument,
        ),
        (
            "past the end",
            PAGE,
            2 * PAGE as usize,
            rw,
            ErrorKind::InvalidArgument,
        ),
        (
            "overflow",
            u64::MAX - PAGE + 1,
            8192,
            rw,
            ErrorKind::InvalidArgument,
        ),
        (
            "no rights",
            0,
            4096,
            Access::empty(),
            ErrorKind::InvalidArgument,
        ),
    ] {
        let e = d
            .register_dmabuf(file.as_fd(), off, len, access)
            .unwrap_err();
        assert_eq!(e.kind(), kind, "{what}: {e}");
    }
    // A descriptor the CPU cannot map (a pipe).
    let mut fds = [0; 2];
    // SAFETY: a two-element array for pipe(2); the descriptors are owned below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors nobody else owns.
    let (r, _w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let e = d.register_dmabuf(r.as_fd(), 0, 4096, rw).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
    assert!(e.to_string().contains("CPU mapping"), "{e}");
    assert!(
        !maps().contains("efa-dmabuf-refused"),
        "nothing stays mapped"
    );
}

/// Two regions over the same bytes of one file would hand out write guards that alias them
/// (`&mut [u8]` twice): the second registration of overlapping bytes is refused, in this or any
/// domain, until the first region goes; disjoint ranges of one file are fine (issue 30, point
/// 10).
#[test]
fn overlapping_dmabuf_registrations_are_refused() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let d2 = loopback_domain(&net);
    let file = DeviceMemory::new("alias", 4 * PAGE);
    let rw = Access::REMOTE_WRITE;
    let first = d
        .register_dmabuf(file.as_fd(), PAGE, 2 * PAGE as usize, rw)
        .unwrap();
    for (dom, off, len) in [
        (&d, PAGE, PAGE),
        (&d2, PAGE, PAGE),
        (&d, 0, 2 * PAGE),
        (&d, 2 * PAGE, 100),
    ] {
        let e = dom
            .register_dmabuf(file.as_fd(), off, len as usize, rw)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{off}+{len}: {e}");
        assert!(e.to_string().contains("alias"), "{e}");
    }
    // Another descriptor of the same file is the same file.
    let dup = file.try_clone().unwrap();
    assert!(d.register_dmabuf(dup.as_fd(), PAGE, 4096, rw).is_err());
    let before = d
        .register_dmabuf(file.as_fd(), 0, PAGE as usize, rw)
        .unwrap();
    let after = d
        .register_dmabuf(file.as_fd(), 3 * PAGE, PAGE as usize, rw)
        .unwrap();
    drop(first);
    let again = d
        .register_dmabuf(file.as_fd(), PAGE, 2 * PAGE as usize, rw)
        .expect("free again once the first region went");
    drop((before, after, again));
}

/// A descriptor the NIC will not register as a dma-buf (a plain memfd: the kernel takes only
/// dma-bufs) still makes a working region, served through its CPU mapping, and the fallback is
/// counted (`dmabuf_fallbacks`) where it was silent (issue 30, point 2). On the software devices
/// there is no NIC and nothing falls back.
#[test]
fn a_dmabuf_the_nic_refuses_falls_back_visibly() {
    for (name, d, _keep) in setups() {
        let (a, b, pb, _) = pair(&d);
        let file = memfd(&format!("efa-plain-{name}"), PAGE);
        let mr = d
            .register_dmabuf(file.as_fd(), 0, PAGE as usize, Access::REMOTE_WRITE)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(mr.is_dmabuf());
        let s = d.device_stats();
        let want = u64::from(name == "efa");
        assert_eq!(
            (s.dmabuf_fallbacks, s.dmabuf_registrations),
            (want, 0),
            "{name}: {s:?}"
        );
        a.ep.write(
            pb,
            Bytes::from_static(b"served"),
            mr.remote_key().unwrap().at(0),
            1,
        )
        .unwrap();
        until(&a, &b, 1, name);
        let mut v = [0u8; 6];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut v, 0).unwrap();
        assert_eq!(&v, b"served", "{name}");
    }
}

fn maps() -> String {
    std::fs::read_to_string("/proc/self/maps").unwrap()
}

/// Closing a dmabuf region revokes its key (a peer's later write fails with `RemoteAccess`)
/// and unmaps it; `close` gives back an empty buffer.
#[test]
fn closing_a_dmabuf_region_unmaps_and_revokes() {
    for (name, d, _keep) in setups() {
        let (a, b, pb, _) = pair(&d);
        let tag = format!("efa-dmabuf-close-{name}");
        let file = DeviceMemory::stand_in(&tag, PAGE);
        let mr = d
            .register_dmabuf(file.as_fd(), 0, PAGE as usize, Access::REMOTE_WRITE)
            .unwrap();
        assert!(maps().contains(&tag), "{name}: mapped while registered");
        let rk = mr.remote_key().unwrap();
        assert!(mr.close().is_empty(), "{name}: close gives nothing back");
        assert!(!maps().contains(&tag), "{name}: unmapped by close");
        a.ep.write(pb, Bytes::from_static(b"late"), rk.at(0), 1)
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let e = loop {
            let mut out = Vec::new();
            match a.cq.poll(&mut out, 1) {
                Ok(0) => {}
                Ok(_) => panic!("{name}: a write to a closed region succeeded"),
                Err(e) if e.kind() == ErrorKind::ErrorAvailable => break a.cq.read_err().unwrap(),
                Err(e) => panic!("{name}: {e}"),
            }
            let _ = b.cq.poll(&mut Vec::new(), 0);
            assert!(Instant::now() < deadline, "{name}: no error");
        };
        assert_eq!(e.error.kind(), ErrorKind::RemoteAccess, "{name}: {e:?}");
        let mut v = [0u8; 4];
        file.read_exact_at(&mut v, 0).unwrap();
        assert_eq!(v, [0; 4], "{name}: nothing written");
    }
}

/// `getinfo` offers `FI_HMEM` (and `FI_MR_HMEM`) on RDM endpoints, so hints asking for it find
/// them; DGRAM endpoints do not take device memory.
#[test]
fn hints_for_device_memory_find_rdm_endpoints() {
    let infos = getinfo(&Hints::new().provider("loopback").caps(Caps::HMEM)).unwrap();
    assert!(!infos.is_empty());
    assert!(infos.iter().all(|i| i.ep_type == EpType::Rdm), "{infos:?}");
    assert!(
        getinfo(
            &Hints::new()
                .provider("loopback")
                .ep_type(EpType::Dgram)
                .caps(Caps::HMEM)
        )
        .is_err()
    );
}
