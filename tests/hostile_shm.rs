//! Issue 17, defect 4: files planted in the shm directory. The directory (`/dev/shm`) is writable
//! by every local user, so another user can create files, symlinks and FIFOs under the names a
//! victim will address, and truncate what it created. The victim must disclose nothing, accept
//! nothing forged, never die of SIGBUS, and fail the affected sends with a clear error at worst.
//!
//! Here as any user: a symlink planted under a segment name. The checks of owner, mode, size and
//! file type are tested in `src/device/shm/segment.rs` (unit tests). A test with a real second
//! local user (root forking a child as `nobody`) is not written yet.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
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

/// FIFOs planted under the names the shm device, the local path's channels and the routing
/// directory sweep or claim: opening one for reading used to block until a writer came, so one
/// `mkfifo` in `/dev/shm` hung every later domain of the user. Opening a device and an endpoint
/// in such a directory now finishes, leaves the FIFOs alone, and traffic still flows.
#[test]
fn fifos_under_our_names_hang_nothing() {
    let uid = my_uid();
    let dir = tempfile::tempdir().unwrap();
    let names = [
        format!("efa-shm-{uid}-4242"),
        format!("efa-shm-{uid}-tmp-1-1"),
        format!("efa-chan-{uid}-0123456789abcdef"),
        format!("efa-route-{uid}-fifo"),
    ];
    for n in &names {
        let c = std::ffi::CString::new(dir.path().join(n).as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {n}");
    }
    let path = dir.path().to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let d = device(&path);
        let (mut a, mut b) = (
            d.create_qp(QpAttr::new(QpType::Srd)).unwrap(),
            d.create_qp(QpAttr::new(QpType::Srd)).unwrap(),
        );
        b.post_recv(7, BytesMut::with_capacity(64)).unwrap();
        send(&mut a, 1, b.addr(), b"through a directory with fifos");
        let (status, got) = complete(&mut a, 1, Some(&mut b));
        let swept = d.sweep();
        tx.send((status, got.len(), swept)).unwrap();
    });
    let (status, got, _swept) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("opening and using a device hung on a planted FIFO");
    assert!(status.is_ok(), "{status:?}");
    assert_eq!(got, 1);
    for n in &names {
        let m = std::fs::symlink_metadata(dir.path().join(n)).unwrap();
        assert!(m.file_type().is_fifo(), "{n} left alone");
    }
}

/// A real second local user: the test (root) forks a child that becomes `nobody` and plants, in
/// a sticky world-writable directory like `/dev/shm`, files under the names root's device will
/// address or sweep: a regular file with a garbage ring, a symlink to a root-only secret, FIFOs.
/// Root's sends to those names fail with an error (no hang, nothing written into nobody's file,
/// the secret untouched), its sweeps leave nobody's files alone, and real traffic still flows.
#[test]
#[ignore = "needs root (forks a child that drops to nobody): .ci/run runs it"]
fn another_user_plants_files_and_gets_nothing() {
    assert_eq!(my_uid(), 0, "this test needs root");
    use std::ffi::CString;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let vault = tempfile::tempdir().unwrap();
    let secret = vault.path().join("secret");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = device(dir.path());
    let mut vq = d.create_qp(QpAttr::new(QpType::Srd)).unwrap();
    let mut pq = d.create_qp(QpAttr::new(QpType::Srd)).unwrap();
    pq.post_recv(9, BytesMut::with_capacity(64)).unwrap();
    let taken = [vq.addr().qpn, pq.addr().qpn];
    let base = (1000u16..60000)
        .step_by(7)
        .find(|q| (0..3).all(|k| !taken.contains(&(q + k))))
        .unwrap();
    let p = |name: String| {
        CString::new(dir.path().join(name).into_os_string().into_encoded_bytes()).unwrap()
    };
    let garbage = p(format!("efa-shm-0-{base}"));
    let link = p(format!("efa-shm-0-{}", base + 1));
    let fifo = p(format!("efa-shm-0-{}", base + 2));
    let chan_fifo = p("efa-chan-0-0123456789abcdef".into());
    let chan_file = p("efa-chan-0-tmp-1-1".into());
    let route_link = p("efa-route-0-x".into());
    let target = CString::new(secret.clone().into_os_string().into_encoded_bytes()).unwrap();
    let ring = vec![0xAAu8; 1 << 16];
    // SAFETY: the child only makes system calls on data prepared before the fork, then _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork");
    if pid == 0 {
        unsafe {
            let nobody = 65534;
            if libc::setgid(nobody) != 0 || libc::setuid(nobody) != 0 {
                libc::_exit(2);
            }
            let fd = libc::open(
                garbage.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY,
                0o666,
            );
            if fd < 0 || libc::write(fd, ring.as_ptr().cast(), ring.len()) != ring.len() as isize {
                libc::_exit(3);
            }
            libc::fchmod(fd, 0o666);
            libc::close(fd);
            let ok = libc::symlink(target.as_ptr(), link.as_ptr()) == 0
                && libc::mkfifo(fifo.as_ptr(), 0o666) == 0
                && libc::mkfifo(chan_fifo.as_ptr(), 0o666) == 0
                && libc::symlink(target.as_ptr(), route_link.as_ptr()) == 0;
            let fd = libc::open(
                chan_file.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY,
                0o666,
            );
            libc::_exit(if ok && fd >= 0 { 0 } else { 4 });
        }
    }
    let mut st = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(
        libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
        "the planting child failed: {st}"
    );
    let planted: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.uid() == 65534))
        .collect();
    assert_eq!(planted.len(), 6, "{planted:?}");
    // Root sends to the three planted segment names: each fails, none hangs.
    let gid = vq.addr().gid;
    for (k, q) in (base..base + 3).enumerate() {
        send(
            &mut vq,
            10 + k as u64,
            RawAddr::new(gid, q, 0x1234),
            b"not for nobody",
        );
        let (status, _) = complete(&mut vq, 10 + k as u64, None);
        assert!(!status.is_ok(), "send to planted name {q}: {status:?}");
    }
    d.sweep();
    for p in &planted {
        assert!(
            std::fs::symlink_metadata(p).is_ok(),
            "{} removed by root's sweep",
            p.display()
        );
    }
    let data = std::fs::read(dir.path().join(format!("efa-shm-0-{base}"))).unwrap();
    assert!(
        data.iter().all(|&b| b == 0xAA) && data.len() == 1 << 16,
        "nobody's file was written"
    );
    assert_eq!(std::fs::read(&secret).unwrap(), b"root only");
    // Real traffic between root's own queue pairs still flows.
    send(&mut vq, 1, pq.addr(), b"between root's own");
    let (status, got) = complete(&mut vq, 1, Some(&mut pq));
    assert!(status.is_ok(), "{status:?}");
    let mut got = got;
    let deadline = Instant::now() + DEADLINE;
    while got.is_empty() {
        pq.poll(&mut got, 4);
        assert!(Instant::now() < deadline);
    }
    assert_eq!(got[0].buf.as_deref(), Some(&b"between root's own"[..]));
}

/// Fuzz of the shm ring records (issue 17): a hostile writer of our own user scribbles random
/// bytes over both queue pairs' segments (headers, slot states, lengths, acknowledgement words,
/// data) between rounds of traffic. Nothing panics or hangs: every send completes exactly once
/// (with any status: forged records are outside the other-user threat model), every receive
/// completes at most once, and the counters show what was dropped.
#[test]
fn scribbled_rings_never_panic_or_hang() {
    use efa::fault::{Rng, test_seed};
    use std::collections::HashSet;
    use std::io::{Seek, SeekFrom, Write};
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    let uid = my_uid();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ShmConfig::in_dir(dir.path());
    cfg.unresponsive_timeout = Duration::from_millis(200);
    cfg.ring_slots = 16;
    cfg.mtu = 4096;
    let d = ShmDevice::open(cfg).unwrap();
    let (mut a, mut b) = (
        d.create_qp(QpAttr::new(QpType::Srd)).unwrap(),
        d.create_qp(QpAttr::new(QpType::Srd)).unwrap(),
    );
    let files = [
        seg_path(dir.path(), uid, a.addr().qpn),
        seg_path(dir.path(), uid, b.addr().qpn),
    ];
    let mut next_recv = 1000u64;
    let mut seen = HashSet::new();
    let mut failures = 0;
    for round in 0..40u64 {
        // Sends first, with no receive posted: they wait in b's ring (receiver not ready).
        let ids: Vec<u64> = (0..8).map(|k| round * 100 + k).collect();
        for &id in &ids {
            send(&mut a, id, b.addr(), b"a message before the scribbling");
        }
        // Scribble over both segments, then let b take what is left.
        for f in &files {
            let mut file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
            let len = file.metadata().unwrap().len();
            for _ in 0..rng.below(256) {
                let at = 8 + rng.below(len.saturating_sub(16).max(1));
                let n = 1 + rng.below(8) as usize;
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                file.seek(SeekFrom::Start(at)).unwrap();
                file.write_all(&bytes).unwrap();
            }
        }
        for _ in 0..8 {
            b.post_recv(next_recv, BytesMut::with_capacity(4096)).ok();
            next_recv += 1;
        }
        // Every send of this round completes once, whatever the status.
        let deadline = Instant::now() + DEADLINE;
        let (mut out, mut got) = (Vec::new(), Vec::new());
        let mut done = HashSet::new();
        let mut failed = 0;
        while done.len() < ids.len() {
            a.poll(&mut out, 16);
            b.poll(&mut got, 16);
            for c in out.drain(..) {
                assert!(
                    ids.contains(&c.wr_id),
                    "seed {seed}: unknown send completion {}",
                    c.wr_id
                );
                assert!(
                    done.insert(c.wr_id),
                    "seed {seed}: send {} completed twice",
                    c.wr_id
                );
                failed += usize::from(!c.status.is_ok());
            }
            for c in got.drain(..) {
                assert!(
                    (1000..next_recv).contains(&c.wr_id),
                    "seed {seed}: unknown receive completion {}",
                    c.wr_id
                );
                assert!(
                    seen.insert(c.wr_id),
                    "seed {seed}: receive {} completed twice",
                    c.wr_id
                );
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: round {round}: {} of {} sends completed",
                done.len(),
                ids.len()
            );
            std::thread::yield_now();
        }
        failures += failed;
    }
    let s = d.stats();
    eprintln!("seed {seed}: {failures} of 320 sends failed");
    eprintln!("seed {seed}: after scribbling: {s:?}");
}
