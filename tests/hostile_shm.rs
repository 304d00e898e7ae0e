//! Issue 17, defect 4: files planted in the shm directory. The directory (`/dev/shm`) is writable
//! by every local user, so another user can create files, symlinks and FIFOs under the names a
//! victim will address, and truncate what it created. The victim must disclose nothing, accept
//! nothing forged, never die of SIGBUS, and fail the affected sends with a clear error at worst.
//!
//! Here as any user: a symlink planted under a segment name. The checks of owner, mode, size and
//! file type are tested in `src/device/shm/segment.rs` (unit tests). A test with a real second
//! local user (root forking a child as `nobody`) is not written yet.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::addr::RawAddr;
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::device::{Device, DeviceCompletion, QpAttr, QpType, QueuePair, SendWr, Status};

/// Hang detector only (never a timing assertion).
const DEADLINE: Duration = Duration::from_secs(20);

fn my_uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

fn device(dir: &Path) -> Arc<ShmDevice> {
    ShmDevice::open(ShmConfig::in_dir(dir)).expect("shm device")
}

fn seg_path(dir: &Path, uid: u32, qpn: u16) -> PathBuf {
    dir.join(format!("efa-shm-{uid}-{qpn}"))
}

fn send(q: &mut Box<dyn QueuePair>, wr_id: u64, dest: RawAddr, payload: &'static [u8]) {
    let wr = SendWr {
        wr_id,
        dest,
        hdr: Bytes::new(),
        payload: Bytes::from_static(payload),
        imm: None,
    };
    if let Err(e) = q.post_send(wr) {
        // A refusal at post time is a clear error too; make it look like a completion.
        eprintln!("post_send {wr_id} refused: {e}");
    }
}

/// Polls `q` until the send `wr_id` completes (or the post was refused: `None`), also polling
/// `other` (the real peer) meanwhile; returns the send's status and what `other` received.
fn complete(
    q: &mut Box<dyn QueuePair>,
    wr_id: u64,
    mut other: Option<&mut Box<dyn QueuePair>>,
) -> (Status, Vec<DeviceCompletion>) {
    let deadline = Instant::now() + DEADLINE;
    let (mut out, mut got) = (Vec::new(), Vec::new());
    loop {
        q.poll(&mut out, 16);
        if let Some(o) = other.as_deref_mut() {
            o.poll(&mut got, 16);
        }
        if let Some(c) = out.iter().find(|c| c.wr_id == wr_id) {
            return (c.status, got);
        }
        assert!(
            Instant::now() < deadline,
            "send {wr_id} did not complete in {DEADLINE:?} (hang)"
        );
        std::thread::yield_now();
    }
}

/// A symlink under a segment name, to a live segment in another directory: the sender must
/// not follow it (it used to, and wrote its message into whatever the link named).
#[test]
fn a_symlink_planted_under_a_segment_name_gets_nothing() {
    let uid = my_uid();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (victim, peer) = (device(a.path()), device(b.path()));
    let mut vq = victim.create_qp(QpAttr::new(QpType::Srd)).unwrap();
    let mut pq = peer.create_qp(QpAttr::new(QpType::Srd)).unwrap();
    for i in 0..4 {
        pq.post_recv(i, BytesMut::with_capacity(256)).unwrap();
    }
    let p = pq.addr();
    let planted = seg_path(a.path(), uid, p.qpn);
    std::os::unix::fs::symlink(seg_path(b.path(), uid, p.qpn), &planted).unwrap();
    let dest = RawAddr::new(vq.addr().gid, p.qpn, p.qkey);
    send(&mut vq, 1, dest, b"for the victim's peer only");
    let (status, got) = complete(&mut vq, 1, Some(&mut pq));
    assert!(!status.is_ok(), "a send through a planted symlink fails");
    // Nothing was written into the link's target, so nothing can arrive later either.
    let mut more = got;
    for _ in 0..100 {
        pq.poll(&mut more, 16);
    }
    assert!(more.is_empty(), "the link's target received {more:?}");
}
