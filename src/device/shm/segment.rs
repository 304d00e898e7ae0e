//! Shared-memory segments: the byte layout of a queue pair's segment file, its name, creating
//! one (with a host-unique QPN), opening a peer's (validating every field), and cleaning up the
//! segments of processes that are gone.
//!
//! The layout is documented byte by byte in `docs/shm-device.md`; the constants below are the
//! single source of truth for it.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::QpType;
use crate::shmem::dir::SEGMENT;
pub(crate) use crate::shmem::file::{
    H_CLOSED, H_HDR_SIZE, H_MAGIC, H_PID, H_TOTAL, H_VERSION, HDR_SIZE, Liveness, MAX_SLOTS,
    SLOT_HDR,
};
use crate::shmem::map::{self, Mapping};

/// Every file of the device starts with this.
pub(crate) const PREFIX: &str = SEGMENT.prefix;
/// `"EFA-SHM\0"` little-endian: the first 8 bytes of every segment.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"EFA-SHM\0");
/// Layout version; a peer with another version is refused.
pub(crate) const VERSION: u32 = 1;
/// Largest MTU a peer may announce, bytes.
pub(crate) const MAX_SEG_MTU: u32 = 1 << 20;
/// Largest acknowledgement table a peer may announce (entries).
pub(crate) const MAX_ACKS: u32 = 1 << 20;
/// Largest segment, bytes.
pub(crate) const MAX_SEGMENT: usize = 1 << 30;

// Header offsets beyond the common ones of `file` (all little-endian; every field is read and
// written as an atomic word).
pub(crate) const H_QKEY: usize = 28; // u32
pub(crate) const H_QPN: usize = 32; // u32
pub(crate) const H_QP_TYPE: usize = 36; // u32: 1 SRD, 2 UD
pub(crate) const H_SLOTS: usize = 40; // u32
pub(crate) const H_STRIDE: usize = 44; // u32
pub(crate) const H_MTU: usize = 48; // u32
pub(crate) const H_ACKS: usize = 52; // u32
pub(crate) const H_ACK_OFF: usize = 56; // u64
pub(crate) const H_RING_OFF: usize = 64; // u64
pub(crate) const H_UID: usize = 72; // u32
pub(crate) const H_HEAD: usize = 200; // u64

/// The shape of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub qp_type: QpType,
    /// Ring slots (a power of two).
    pub slots: u32,
    /// Bytes from one slot to the next (multiple of 64, at least `SLOT_HDR + mtu`).
    pub stride: u32,
    /// Largest datagram a slot holds.
    pub mtu: u32,
    /// Acknowledgement table entries.
    pub acks: u32,
    pub ack_off: usize,
    pub ring_off: usize,
    pub total: usize,
}

fn qp_type_code(t: QpType) -> u32 {
    match t {
        QpType::Srd => 1,
        QpType::Ud => 2,
    }
}

fn align64(n: usize) -> Option<usize> {
    n.checked_add(63).map(|n| n & !63)
}

impl Geometry {
    /// The geometry of a new segment; `None` when it would exceed [`MAX_SEGMENT`].
    pub(crate) fn new(qp_type: QpType, slots: u32, mtu: u32, acks: u32) -> Option<Geometry> {
        let stride = align64(SLOT_HDR + mtu as usize)?;
        let ack_off = HDR_SIZE;
        let ring_off = align64(ack_off + acks as usize * 8)?;
        let total = ring_off.checked_add(stride.checked_mul(slots as usize)?)?;
        (total <= MAX_SEGMENT).then_some(Geometry {
            qp_type,
            slots,
            stride: u32::try_from(stride).ok()?,
            mtu,
            acks,
            ack_off,
            ring_off,
            total,
        })
    }

    /// Offset of the slot of ring position `pos`.
    pub(crate) fn slot(&self, pos: u64) -> usize {
        let i = (pos & u64::from(self.slots - 1)) as usize;
        self.ring_off + i * self.stride as usize
    }

    /// Offset of acknowledgement entry `i` (`None` when out of range).
    pub(crate) fn ack(&self, i: u32) -> Option<usize> {
        (i < self.acks).then(|| self.ack_off + i as usize * 8)
    }
}

/// Why a peer's segment cannot be used.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No such file: the queue pair does not exist (any more).
    Gone,
    /// The file is not a valid segment (the reason).
    Malformed(&'static str),
    /// Another I/O error.
    Io(io::Error),
}

/// The name of the segment of queue pair `qpn` of user `uid`.
pub(crate) fn seg_name(uid: u32, qpn: u16) -> String {
    SEGMENT.name(uid, format_args!("{qpn}"))
}

/// The temporary name a process creates a segment under before it owns a QPN.
fn tmp_name(uid: u32, pid: u32, n: u64) -> String {
    SEGMENT.tmp_name(uid, pid, n)
}

/// What identifies the owner of a segment, written once at creation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Identity {
    pub pid: u32,
    pub uid: u32,
    pub qkey: u32,
    pub qpn: u16,
}

/// Writes every static header field (magic last).
pub(crate) fn write_header(m: &Mapping, g: &Geometry, id: &Identity) {
    m.store32(H_VERSION, VERSION);
    m.store32(H_HDR_SIZE, HDR_SIZE as u32);
    m.store64(H_TOTAL, g.total as u64);
    m.store32(H_PID, id.pid);
    m.store32(H_QKEY, id.qkey);
    m.store32(H_QPN, u32::from(id.qpn));
    m.store32(H_QP_TYPE, qp_type_code(g.qp_type));
    m.store32(H_SLOTS, g.slots);
    m.store32(H_STRIDE, g.stride);
    m.store32(H_MTU, g.mtu);
    m.store32(H_ACKS, g.acks);
    m.store64(H_ACK_OFF, g.ack_off as u64);
    m.store64(H_RING_OFF, g.ring_off as u64);
    m.store32(H_UID, id.uid);
    if let Some(w) = m.u64(H_MAGIC) {
        w.store(MAGIC, Ordering::Release);
    }
}

/// True when the static header still says what the owner wrote.
pub(crate) fn header_intact(m: &Mapping, g: &Geometry, id: &Identity) -> bool {
    match read_header(m, m.len()) {
        Ok((g2, id2)) => {
            g2 == *g
                && id2.pid == id.pid
                && id2.qkey == id.qkey
                && id2.qpn == id.qpn
                && id2.uid == id.uid
        }
        Err(_) => false,
    }
}

/// Reads and validates a header against a mapping of `len` bytes.
pub(crate) fn read_header(m: &Mapping, len: usize) -> Result<(Geometry, Identity), &'static str> {
    let g = |off| m.load32(off).ok_or("header truncated");
    crate::shmem::file::check_kind(m, MAGIC, VERSION)?;
    let qp_type = match g(H_QP_TYPE)? {
        1 => QpType::Srd,
        2 => QpType::Ud,
        _ => return Err("bad queue pair type"),
    };
    let slots = g(H_SLOTS)?;
    if slots == 0 || !slots.is_power_of_two() || slots > MAX_SLOTS {
        return Err("bad slot count");
    }
    let mtu = g(H_MTU)?;
    if mtu == 0 || mtu > MAX_SEG_MTU {
        return Err("bad mtu");
    }
    let acks = g(H_ACKS)?;
    if acks > MAX_ACKS {
        return Err("bad acknowledgement table size");
    }
    let want = Geometry::new(qp_type, slots, mtu, acks).ok_or("segment too large")?;
    let total = m.load64(H_TOTAL).ok_or("header truncated")?;
    if g(H_STRIDE)? != want.stride
        || m.load64(H_ACK_OFF) != Some(want.ack_off as u64)
        || m.load64(H_RING_OFF) != Some(want.ring_off as u64)
        || total != want.total as u64
    {
        return Err("inconsistent geometry");
    }
    if want.total > len {
        return Err("file shorter than its geometry");
    }
    let qpn = u16::try_from(g(H_QPN)?).map_err(|_| "bad qpn")?;
    Ok((
        want,
        Identity {
            pid: g(H_PID)?,
            uid: g(H_UID)?,
            qkey: g(H_QKEY)?,
            qpn,
        },
    ))
}

/// A segment this process owns.
pub(crate) struct OwnSegment {
    /// Holds the shared `flock` that tells peers the owner lives.
    file: Option<File>,
    pub map: Arc<Mapping>,
    pub geo: Geometry,
    pub id: Identity,
    pub path: PathBuf,
    ino: u64,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A pseudo-random starting point for the QPN search.
fn qpn_start() -> u16 {
    (crate::device::random_qkey() % 65_535) as u16
}

impl OwnSegment {
    /// Creates a segment in `dir`: under a temporary name (carrying the pid) it is sized,
    /// allocated, locked and initialised, then hard-linked to the first free `efa-shm-<uid>-<qpn>`
    /// (`link` fails on an existing name, so a QPN is unique in `dir` while its file exists).
    pub(crate) fn create(dir: &Path, uid: u32, qkey: u32, geo: Geometry) -> io::Result<OwnSegment> {
        let pid = std::process::id();
        let tmp = dir.join(tmp_name(
            uid,
            pid,
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed),
        ));
        let res = Self::create_at(dir, &tmp, uid, qkey, geo);
        let _ = fs::remove_file(&tmp);
        res
    }

    fn create_at(
        dir: &Path,
        tmp: &Path,
        uid: u32,
        qkey: u32,
        geo: Geometry,
    ) -> io::Result<OwnSegment> {
        let (file, ino) = crate::shmem::file::create_owned(tmp, geo.total)?;
        let map = Mapping::map(&file, geo.total)?;
        // Ring: slot i starts with sequence i (free for the producer of position i).
        for i in 0..u64::from(geo.slots) {
            map.store64(geo.slot(i), i);
        }
        let mut id = Identity {
            pid: std::process::id(),
            uid,
            qkey,
            qpn: 0,
        };
        let start = qpn_start();
        for k in 0..65_535u32 {
            let qpn = ((u32::from(start) + k) % 65_535 + 1) as u16;
            id.qpn = qpn;
            write_header(&map, &geo, &id);
            let path = dir.join(seg_name(uid, qpn));
            match fs::hard_link(tmp, &path) {
                Ok(()) => {
                    return Ok(OwnSegment {
                        file: Some(file),
                        map: Arc::new(map),
                        geo,
                        id,
                        path,
                        ino,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "every QPN of this directory is in use",
        ))
    }

    /// Removes the segment's name (only if it still names this file) and releases the lock, so
    /// peers see the queue pair gone. The mapping stays valid until `self` is dropped.
    pub(crate) fn unlink(&mut self) {
        map::remove_if_same(&self.path, self.ino);
        self.file = None;
    }
}

/// A peer's segment, mapped and validated.
pub(crate) struct PeerSegment {
    pub file: File,
    pub map: Arc<Mapping>,
    pub geo: Geometry,
    pub id: Identity,
    pub path: PathBuf,
    pub ino: u64,
}

/// Opens an existing segment file for reading and writing, the way a peer's file must be
/// opened in a directory every user can write (`/dev/shm`): no symlink followed (`O_NOFOLLOW`),
/// no blocking on a FIFO (`O_NONBLOCK`), then checked on the open descriptor (`fstat`, so the
/// file checked is the file used): a regular file owned by `uid` with mode 0600. Another user
/// can plant files under our names but cannot create one owned by us, nor change the size or
/// contents of ours; what passes is a file of our own user.
fn open_owned(path: &Path, uid: u32) -> Result<(File, fs::Metadata), OpenError> {
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(OpenError::Gone),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(OpenError::Malformed("a symbolic link"));
        }
        Err(e) => return Err(OpenError::Io(e)),
    };
    let meta = file.metadata().map_err(OpenError::Io)?;
    if !meta.is_file() {
        return Err(OpenError::Malformed("not a regular file"));
    }
    if meta.uid() != uid {
        return Err(OpenError::Malformed("owned by another user"));
    }
    if meta.mode() & 0o7777 != 0o600 {
        return Err(OpenError::Malformed("mode is not 0600"));
    }
    Ok((file, meta))
}

/// Opens the segment of queue pair `qpn` of user `uid` in `dir` (see [`open_owned`]),
/// validating its header against the file's real size before trusting any of it: the file is
/// exactly as long as the geometry its header announces.
pub(crate) fn open_peer(dir: &Path, uid: u32, qpn: u16) -> Result<PeerSegment, OpenError> {
    let path = dir.join(seg_name(uid, qpn));
    let (file, meta) = open_owned(&path, uid)?;
    let size = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    if size < HDR_SIZE {
        return Err(OpenError::Malformed("file shorter than a header"));
    }
    // Map only the header first; the rest once its geometry is known to fit the file.
    let head = Mapping::map(&file, HDR_SIZE).map_err(OpenError::Io)?;
    let total = match read_header(&head, size) {
        Ok((g, _)) => g.total,
        Err(why) => return Err(OpenError::Malformed(why)),
    };
    drop(head);
    if total != size {
        return Err(OpenError::Malformed("file size differs from its geometry"));
    }
    let map = Mapping::map(&file, total).map_err(OpenError::Io)?;
    let (geo, id) = read_header(&map, total).map_err(OpenError::Malformed)?;
    if geo.total != total {
        return Err(OpenError::Malformed("header changed while opening"));
    }
    if id.qpn != qpn {
        return Err(OpenError::Malformed("qpn does not match the file name"));
    }
    if id.uid != uid {
        return Err(OpenError::Malformed("header names another user"));
    }
    Ok(PeerSegment {
        file,
        map: Arc::new(map),
        geo,
        id,
        path,
        ino: meta.ino(),
    })
}

impl PeerSegment {
    /// The closed flag, then the owner's lock: a free lock means no process holds the segment.
    pub(crate) fn liveness(&self) -> Liveness {
        crate::shmem::file::liveness(&self.map, &self.file, &self.path, self.ino)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn own(dir: &Path) -> OwnSegment {
        let geo = Geometry::new(QpType::Srd, 8, 256, 8).unwrap();
        OwnSegment::create(dir, map::uid(), 0x1234, geo).unwrap()
    }

    fn malformed(r: Result<PeerSegment, OpenError>) -> &'static str {
        match r {
            Err(OpenError::Malformed(why)) => why,
            Err(e) => panic!("expected a refusal, got {e:?}"),
            Ok(_) => panic!("expected a refusal, the segment was accepted"),
        }
    }

    /// Issue 17, defect 4: a peer's segment is opened without following symlinks, and only as
    /// a regular file of this user, mode 0600, exactly as large as its header says.
    #[test]
    fn open_peer_refuses_symlinks_modes_sizes_and_other_files() {
        let uid = map::uid();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let seg = own(a.path());
        let q = seg.id.qpn;
        assert!(open_peer(a.path(), uid, q).is_ok(), "the real segment");
        let planted = b.path().join(seg_name(uid, q));
        // A symlink to a valid segment elsewhere.
        std::os::unix::fs::symlink(&seg.path, &planted).unwrap();
        assert_eq!(malformed(open_peer(b.path(), uid, q)), "a symbolic link");
        fs::remove_file(&planted).unwrap();
        // A copy readable by others.
        fs::copy(&seg.path, &planted).unwrap();
        fs::set_permissions(&planted, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(malformed(open_peer(b.path(), uid, q)), "mode is not 0600");
        // A copy longer than its geometry.
        fs::set_permissions(&planted, fs::Permissions::from_mode(0o600)).unwrap();
        assert!(
            open_peer(b.path(), uid, q).is_ok(),
            "an exact copy is a segment"
        );
        let f = OpenOptions::new().write(true).open(&planted).unwrap();
        f.set_len(seg.geo.total as u64 + 4096).unwrap();
        assert_eq!(
            malformed(open_peer(b.path(), uid, q)),
            "file size differs from its geometry"
        );
        // ... or shorter (truncated).
        f.set_len(seg.geo.total as u64 - 64).unwrap();
        assert_eq!(
            malformed(open_peer(b.path(), uid, q)),
            "file shorter than its geometry"
        );
        drop(f);
        fs::remove_file(&planted).unwrap();
        // A directory and a FIFO under the name: refused, and the open does not block.
        fs::create_dir(&planted).unwrap();
        assert!(open_peer(b.path(), uid, q).is_err());
        fs::remove_dir(&planted).unwrap();
        let made = std::process::Command::new("mkfifo")
            .args(["-m", "600"])
            .arg(&planted)
            .status()
            .unwrap();
        assert!(made.success());
        assert_eq!(malformed(open_peer(b.path(), uid, q)), "not a regular file");
    }

    /// The sweep acts on this user's regular segment files only: a symlink planted under a
    /// segment name is neither followed nor counted.
    #[test]
    fn sweep_follows_no_symlink() {
        let uid = map::uid();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // An unlocked file of ours elsewhere (a stale-looking target).
        let target = a.path().join("victim-data");
        fs::write(&target, b"keep").unwrap();
        let planted = b.path().join(seg_name(uid, 4242));
        std::os::unix::fs::symlink(&target, &planted).unwrap();
        assert_eq!(SEGMENT.sweep(b.path(), uid), 0);
        assert_eq!(fs::read(&target).unwrap(), b"keep");
        // A stale segment of ours (its owner gone: nobody holds its lock) is swept.
        // (The lock lives as long as the mapping: the whole segment goes.)
        let path = own(b.path()).path;
        assert!(path.exists());
        assert_eq!(SEGMENT.sweep(b.path(), uid), 1);
        assert!(!path.exists());
    }
}
