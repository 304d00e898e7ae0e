//! RDMA reads on the `shm` device with cross-memory attach (`ShmConfig::cma`): the initiator
//! copies the target's bytes itself once the target granted the read, whatever the mix of
//! settings on both sides the data is the same, the target sends one grant instead of the data,
//! refused keys stay refused, and a region the target's application holds locked is read only
//! after the lock is released.

#![cfg(target_os = "linux")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::device::{Device, DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, RemoteIov, Status};
use efa::{Access, Config, Domain, RemoteKey};

type Qp = Box<dyn QueuePair>;

const DEADLINE: Duration = Duration::from_secs(60);

struct Node {
    dev: Arc<dyn Device>,
    domain: Domain,
}

fn node(dir: &std::path::Path, cma: bool) -> Node {
    let dev: Arc<dyn Device> =
        ShmDevice::open(ShmConfig::in_dir(dir).with_cma(cma)).expect("shm device");
    let domain = Domain::with_device(dev.clone(), Config::default());
    Node { dev, domain }
}

fn qp(n: &Node) -> Qp {
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

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = efa::fault::Rng::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

fn poll_one(q: &mut Qp, what: &str) -> DeviceCompletion {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while out.is_empty() {
        q.poll(&mut out, 1);
        assert!(Instant::now() < deadline, "{what}: no completion");
    }
    out.remove(0)
}

/// Reads a few sizes from a region of `b` into buffers of `a`; returns the bytes the target
/// sent (datagram headers and payloads) and the bytes read.
fn read_all(initiator_cma: bool, target_cma: bool) -> (u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (
        node(dir.path(), initiator_cma),
        node(dir.path(), target_cma),
    );
    let mut qa = qp(&a);
    let qb = qp(&b);
    let sizes = [1usize, 63, 4096, 65_000, 65_536 * 3 + 7, 1 << 20];
    let total: usize = sizes.iter().sum();
    let data = pattern(initiator_cma as u64 * 2 + target_cma as u64, total);
    let mr = b
        .domain
        .register(data.clone(), Access::REMOTE_READ)
        .unwrap();
    let rk = mr.remote_key().unwrap();
    let tx0 = b.dev.stats().tx_bytes;
    let mut off = 0usize;
    for (i, &len) in sizes.iter().enumerate() {
        // Half of the reads go into a buffer with room already, half into an empty one.
        let buf = if i % 2 == 0 {
            BytesMut::with_capacity(len)
        } else {
            BytesMut::new()
        };
        qa.post_read(i as u64, qb.addr(), buf, iov(&rk, off as u64, len as u64))
            .unwrap();
        let c = poll_one(&mut qa, "read");
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (i as u64, Status::Success, Opcode::RdmaRead, len),
            "read of {len} (cma {initiator_cma}/{target_cma})"
        );
        let got = c.buf.expect("the read's buffer");
        assert!(
            got[..] == data[off..off + len],
            "data of the read of {len} (cma {initiator_cma}/{target_cma})"
        );
        off += len;
    }
    let sent = b.dev.stats().tx_bytes - tx0;
    drop(qb);
    (sent, total as u64)
}

#[test]
fn reads_return_the_same_bytes_with_and_without_cma_on_either_side() {
    let (both, total) = read_all(true, true);
    let (none, _) = read_all(false, false);
    read_all(true, false);
    read_all(false, true);
    // With CMA on both sides the large reads cost the target a header-only grant each (the
    // small ones, below the device's threshold, still come in chunks); else all data is sent.
    assert!(
        both < 64 << 10,
        "the target sent {both} bytes for reads of {total}"
    );
    assert!(
        none >= total,
        "chunks through the rings: {none} bytes for {total}"
    );
}

/// Reads large enough to be served with CMA (the device's threshold is 16 KiB).
#[test]
fn refused_keys_stay_refused_with_cma() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (node(dir.path(), true), node(dir.path(), true));
    let mut qa = qp(&a);
    let qb = qp(&b);
    let mr = b
        .domain
        .register(vec![7u8; 128 << 10], Access::REMOTE_WRITE)
        .unwrap();
    let rk = mr.remote_key().unwrap();
    // No REMOTE_READ right.
    qa.post_read(1, qb.addr(), BytesMut::new(), iov(&rk, 0, 64 << 10))
        .unwrap();
    let c = poll_one(&mut qa, "read without the right");
    assert_eq!(c.status, Status::RemoteBadAddress);
    // Out of range.
    let mr2 = b
        .domain
        .register(vec![7u8; 128 << 10], Access::REMOTE_READ)
        .unwrap();
    let rk2 = mr2.remote_key().unwrap();
    qa.post_read(
        2,
        qb.addr(),
        BytesMut::new(),
        iov(&rk2, 64 << 10, 128 << 10),
    )
    .unwrap();
    let c = poll_one(&mut qa, "read out of range");
    assert_eq!(c.status, Status::RemoteBadAddress);
    // Revoked.
    drop(mr2);
    qa.post_read(3, qb.addr(), BytesMut::new(), iov(&rk2, 0, 128 << 10))
        .unwrap();
    let c = poll_one(&mut qa, "read of a revoked key");
    assert_eq!(c.status, Status::RemoteBadAddress);
    drop(qb);
}

#[test]
fn a_region_locked_by_its_application_is_read_after_the_release() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (node(dir.path(), true), node(dir.path(), true));
    let mut qa = qp(&a);
    let qb = qp(&b);
    let len = 256 << 10;
    let mut mr = b
        .domain
        .register(vec![1u8; len], Access::REMOTE_READ)
        .unwrap();
    let rk = mr.remote_key().unwrap();
    let new = pattern(9, len);
    {
        let mut g = mr.write();
        g.copy_from_slice(&new);
        qa.post_read(1, qb.addr(), BytesMut::new(), iov(&rk, 0, len as u64))
            .unwrap();
        // Drive the initiator a while the guard is alive: the target answers receiver-not-ready
        // (retried forever), so the read cannot complete.
        let mut out = Vec::new();
        for _ in 0..1000 {
            qa.poll(&mut out, 1);
        }
        assert!(out.is_empty(), "read completed while the region was locked");
    }
    let c = poll_one(&mut qa, "read after the release");
    assert_eq!(c.status, Status::Success);
    assert!(c.buf.as_deref() == Some(&Bytes::from(new)[..]));
    drop(qb);
}
