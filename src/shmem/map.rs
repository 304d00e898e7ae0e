//! The only place of the shm device that talks to the kernel through raw calls: shared file
//! mappings, futex waits and wakes, `flock`, `posix_fallocate`, `kill(pid, 0)` and `getuid`.
//!
//! A [`Mapping`] hands out **no references to shared bytes**: control words are reached as
//! `&AtomicU32` / `&AtomicU64` (lock-free atomics are valid between processes), data is copied in
//! and out with bounds-checked raw copies. Every offset is checked against the mapping's length,
//! so whatever another process writes into the segment, this process never reads or writes
//! outside it.

#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
#[cfg(not(loom))]
use std::ptr::NonNull;
#[cfg(not(loom))]
use std::time::Duration;

#[cfg(not(loom))]
use bytes::BytesMut;

use super::sync::Ordering;
#[cfg(not(loom))]
use super::sync::{AtomicU32, AtomicU64};

// Under the model checker: a model of the shared memory and of the futex (see `super::model`).
#[cfg(loom)]
pub(crate) use super::model::{Mapping, futex_wait, futex_wake};

/// A `MAP_SHARED`, read-write mapping of the first `len` bytes of a file.
#[cfg(not(loom))]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

#[cfg(not(loom))]
// SAFETY: the mapping is plain memory owned by this value until `Drop`; every access goes
// through atomics or raw copies that tolerate concurrent writers, so sharing it between threads
// is no different from sharing it between processes.
unsafe impl Send for Mapping {}
#[cfg(not(loom))]
// SAFETY: as above; no method hands out `&mut` access or a plain reference to the bytes.
unsafe impl Sync for Mapping {}

#[cfg(not(loom))]
impl Mapping {
    /// Maps the first `len` bytes of `file` (which must be at least that long; the caller checks
    /// the file size first so no access can fall beyond the end of the file).
    pub(crate) fn map(file: &File, len: usize) -> io::Result<Mapping> {
        Self::map_flags(file, len, libc::MAP_SHARED)
    }

    /// [`Mapping::map`] with every page mapped now (`MAP_POPULATE`): the first touches of a ring
    /// (a page fault each, on both sides) then happen at setup, not on a message's path.
    pub(crate) fn map_populated(file: &File, len: usize) -> io::Result<Mapping> {
        Self::map_flags(file, len, libc::MAP_SHARED | libc::MAP_POPULATE)
    }

    fn map_flags(file: &File, len: usize, flags: libc::c_int) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"));
        }
        // SAFETY: a fresh shared mapping chosen by the kernel (no fixed address), of a file
        // descriptor that is valid for the duration of the call; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Mapping { ptr, len })
    }

    /// Length of the mapping, bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The byte range `off..off + n`, if it lies inside the mapping.
    #[inline]
    fn range(&self, off: usize, n: usize) -> Option<usize> {
        let end = off.checked_add(n)?;
        (end <= self.len).then_some(off)
    }

    /// The address of the `N`-byte word at `off`, if it lies inside the mapping and `off` is a
    /// multiple of `N`: the mapping is page aligned, so the address is `N`-aligned too. (`N` is
    /// a constant so that the alignment check is a mask, never a division: the rings check
    /// every control word they touch.)
    #[inline(always)]
    fn word<const N: usize>(&self, off: usize) -> Option<*mut u8> {
        let off = self.range(off, N)?;
        if !off.is_multiple_of(N) {
            return None;
        }
        // SAFETY: `off..off+N` lies inside the mapping (checked above).
        Some(unsafe { self.ptr.as_ptr().add(off) })
    }

    /// The 32-bit control word at `off` (4-aligned, inside the mapping).
    #[inline]
    pub(crate) fn u32(&self, off: usize) -> Option<&AtomicU32> {
        let p = self.word::<4>(off)?;
        // SAFETY: `p..p+4` lies inside the mapping and is 4-aligned (`word`); `AtomicU32` has
        // the size and alignment of `u32` and is valid for any bit pattern; the reference lives
        // no longer than `&self`, i.e. the mapping. Other processes may change the word at any
        // time, which atomics allow.
        Some(unsafe { &*p.cast::<AtomicU32>() })
    }

    /// The 64-bit control word at `off` (8-aligned, inside the mapping).
    #[inline]
    pub(crate) fn u64(&self, off: usize) -> Option<&AtomicU64> {
        let p = self.word::<8>(off)?;
        // SAFETY: as in `u32`, for an 8-byte, 8-aligned word.
        Some(unsafe { &*p.cast::<AtomicU64>() })
    }

    /// Copies `src` to `off`; false (nothing written) when the range leaves the mapping.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        let Some(off) = self.range(off, src.len()) else {
            return false;
        };
        // SAFETY: the destination range lies inside the mapping (checked), the source is a
        // valid slice in private memory, so the two cannot overlap. Concurrent writers in other
        // processes can only make the bytes garbage, which every reader validates.
        unsafe { copy_out(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) };
        true
    }

    /// Copies `dst.len()` bytes from `off` into `dst`; false (nothing copied) when the range
    /// leaves the mapping.
    pub(crate) fn read_to(&self, off: usize, dst: &mut [u8]) -> bool {
        let Some(off) = self.range(off, dst.len()) else {
            return false;
        };
        // SAFETY: the source range lies inside the mapping (checked); the destination is a
        // private slice of exactly that length, which cannot overlap the mapping.
        unsafe { copy_out(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// Appends `n` bytes from `off` to `buf`, within its spare capacity; false (nothing copied)
    /// when the range leaves the mapping or `buf` lacks the room.
    pub(crate) fn read_into(&self, off: usize, n: usize, buf: &mut BytesMut) -> bool {
        let Some(off) = self.range(off, n) else {
            return false;
        };
        if buf.capacity() - buf.len() < n {
            return false;
        }
        let spare = buf.spare_capacity_mut();
        // SAFETY: the source range lies inside the mapping (checked); the destination is the
        // buffer's spare capacity, at least `n` bytes (checked), private memory that cannot
        // overlap the mapping. After the copy those `n` bytes are initialised, so extending the
        // length by `n` is sound.
        unsafe {
            copy_out(
                self.ptr.as_ptr().add(off),
                spare.as_mut_ptr().cast::<u8>(),
                n,
            );
            buf.set_len(buf.len() + n);
        }
        true
    }
}

/// Copies `n` bytes from `src` to `dst` (in pieces where one copy would alias, see
/// [`crate::mem::copy`]) without making a slice of the mapping, which other processes may
/// write.
///
/// # Safety
/// `src..src + n` must be readable and `dst..dst + n` writable, and the two must not overlap.
#[cfg(not(loom))]
#[inline]
unsafe fn copy_out(src: *const u8, dst: *mut u8, n: usize) {
    let step = crate::mem::copy::piece_len(dst, src, n);
    if step >= n {
        // SAFETY: the caller's ranges, whole.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        return;
    }
    let mut at = 0;
    while at < n {
        let k = step.min(n - at);
        // SAFETY: `at + k <= n`, inside both ranges the caller vouches for.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), k) };
        at += k;
    }
}

// Relaxed loads and stores of control words, through `u32`/`u64`: the same for the real
// mapping and, under loom, its model.
impl Mapping {
    /// The `u32` word at `off` (relaxed); `None` outside the mapping or unaligned.
    #[inline]
    pub(crate) fn load32(&self, off: usize) -> Option<u32> {
        self.u32(off).map(|w| w.load(Ordering::Relaxed))
    }

    /// The `u64` word at `off` (relaxed); `None` outside the mapping or unaligned.
    #[inline]
    pub(crate) fn load64(&self, off: usize) -> Option<u64> {
        self.u64(off).map(|w| w.load(Ordering::Relaxed))
    }

    /// Stores `v` at `off` (relaxed); nothing outside the mapping or unaligned.
    #[inline]
    pub(crate) fn store32(&self, off: usize, v: u32) {
        if let Some(w) = self.u32(off) {
            w.store(v, Ordering::Relaxed);
        }
    }

    /// Stores `v` at `off` (relaxed); nothing outside the mapping or unaligned.
    #[inline]
    pub(crate) fn store64(&self, off: usize, v: u64) {
        if let Some(w) = self.u64(off) {
            w.store(v, Ordering::Relaxed);
        }
    }
}

#[cfg(not(loom))]
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what `mmap` returned; no reference into the mapping
        // outlives `self` (every accessor borrows `self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout` (a shared futex: works between
/// processes mapping the same file). Spurious returns are fine; callers re-check.
#[cfg(not(loom))]
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit word for the duration of the call; the timespec
    // is a valid local; FUTEX_WAIT only reads the word and sleeps.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every waiter of `word` in any process.
#[cfg(not(loom))]
pub(crate) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 32-bit word; FUTEX_WAKE does not access memory beyond
    // looking the address up.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Takes a shared `flock` on `file` (held until the file is closed): the owner's mark of life.
pub(crate) fn lock_shared(file: &File) -> io::Result<()> {
    // SAFETY: plain syscall on a valid descriptor.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Tries to take an exclusive `flock` without waiting: `Ok(true)` when taken (nobody else holds
/// a lock on the file), `Ok(false)` when someone does.
pub(crate) fn try_lock_exclusive(file: &File) -> io::Result<bool> {
    // SAFETY: plain syscall on a valid descriptor.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Reserves the blocks of the first `len` bytes of `file`, so that touching the mapping later
/// cannot fail with `SIGBUS` for lack of space. Filesystems without `fallocate` are accepted.
pub(crate) fn allocate(file: &File, len: usize) -> io::Result<()> {
    let len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: plain syscall on a valid descriptor.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    match r {
        0 | libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// True unless process `pid` certainly does not exist (`kill(pid, 0)` fails with `ESRCH`).
/// Pid 0 and pids beyond `i32::MAX` (which `kill` would read as process groups) count as gone.
pub(crate) fn pid_exists(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission; `p` is a positive pid, never
    // a process group.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// A descriptor doorbell: a pipe whose read end the owner's completion queues watch (it is in
/// their epoll set) and which peers in other processes open through `/proc/<pid>/fd/<n>` and
/// write one byte to. The owner keeps the write end open too, so the read end never reports
/// end-of-file (which would leave it readable for ever).
pub(crate) struct WakePipe {
    read: File,
    _write: File,
    /// The pipe's identity (device, inode), which a peer checks after opening it by number.
    pub(crate) id: (u64, u64),
}

impl WakePipe {
    /// A new non-blocking, close-on-exec pipe.
    pub(crate) fn new() -> io::Result<WakePipe> {
        use std::os::fd::FromRawFd;
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: two fresh descriptors nobody else owns.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let m = read.metadata()?;
        Ok(WakePipe {
            read,
            _write: write,
            id: (m.dev(), m.ino()),
        })
    }

    /// The read end (to watch).
    pub(crate) fn read_end(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.read.as_fd()
    }

    /// Empties the pipe; true when it held anything.
    pub(crate) fn drain(&self) -> bool {
        use std::io::Read;
        let mut buf = [0u8; 64];
        let mut any = false;
        while let Ok(n @ 1..) = (&self.read).read(&mut buf) {
            any = true;
            if n < buf.len() {
                break;
            }
        }
        any
    }
}

/// Opens the write side of the wake pipe of process `pid`, its descriptor `fd`, if it still is
/// the pipe `id` (device, inode) there: anything else (the number reused, another process, no
/// `/proc`) is `None`.
pub(crate) fn open_wake_pipe(pid: u32, fd: u32, id: (u64, u64)) -> Option<File> {
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(format!("/proc/{pid}/fd/{fd}"))
        .ok()?;
    let m = f.metadata().ok()?;
    use std::os::unix::fs::FileTypeExt;
    (m.file_type().is_fifo() && (m.dev(), m.ino()) == id).then_some(f)
}

/// Makes a wake pipe readable: one byte (a full pipe is readable already). False when the
/// write failed otherwise (the reader is gone).
pub(crate) fn write_wake_pipe(f: &File) -> bool {
    use std::io::Write;
    // One byte is written whole or not at all.
    match (&*f).write_all(&[1]) {
        Ok(()) => true,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
    }
}

/// The real user id of this process.
pub(crate) fn uid() -> u32 {
    // SAFETY: `getuid` cannot fail and touches no memory.
    unsafe { libc::getuid() }
}

// ---- Named files whose owner holds a lock (the routing directory's entries, the RDM endpoints'
// message channels): safe helpers, no `unsafe` below.

/// Removes `path` if it still names inode `ino` (a new owner may have taken the name).
pub(crate) fn remove_if_same(path: &Path, ino: u64) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.ino() == ino => std::fs::remove_file(path).is_ok(),
        _ => false,
    }
}

/// Opens an existing file for probing or reading: no symlinks followed, never created.
pub(crate) fn open_existing(path: &Path) -> io::Result<File> {
    // O_NONBLOCK: a FIFO planted under one of our names would otherwise block the open until
    // a writer comes (issue 17, defect 4); callers check the file type before using it.
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
}

/// True when nobody holds the lock of `f` (its owner is gone). Errors count as "held".
/// (Taking it exclusively is the probe; it is released when `f` is closed.)
pub(crate) fn lock_free(f: &File) -> bool {
    try_lock_exclusive(f).unwrap_or(false)
}

/// The directory walk of every sweep: calls `remove(path, rest)` for each entry of `dir` whose
/// name is `prefix` followed by `rest`; returns how many calls removed their file (true).
pub(crate) fn sweep_dir(
    dir: &Path,
    prefix: &str,
    mut remove: impl FnMut(&Path, &str) -> bool,
) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        if let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) {
            removed += usize::from(remove(&e.path(), rest));
        }
    }
    removed
}

/// Removes the file at `path` if its owner is gone (its lock is free); true when the name is
/// free now.
pub(crate) fn remove_if_stale(path: &Path) -> bool {
    let Ok(f) = open_existing(path) else {
        return !path.exists();
    };
    let Ok(m) = f.metadata() else {
        return false;
    };
    // Only our own regular files: a FIFO, device or another user's file under our name is
    // left alone (the name stays taken: a clear error for whoever wanted it).
    if !m.is_file() || m.uid() != uid() {
        return false;
    }
    if lock_free(&f) {
        remove_if_same(path, m.ino());
        return !path.exists();
    }
    false
}

/// Gives the prepared (locked, written) file `tmp` its name `path` with `link`, which fails on
/// an existing name: a name whose owner is gone is taken over once. `Ok(false)` when a live
/// owner holds the name.
pub(crate) fn link_claim(tmp: &Path, path: &Path) -> io::Result<bool> {
    for attempt in 0..2 {
        match std::fs::hard_link(tmp, path) {
            Ok(()) => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt == 0 => {
                // A stale file of a dead owner is removed; a live one is left alone.
                if !remove_if_stale(path) {
                    return Ok(false);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}
