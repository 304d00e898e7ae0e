//! The memory core, below the devices and the domain: a region's bytes ([`RegionMem`], behind
//! a lock by byte range and shared by `Arc` between the application's
//! [`MemoryRegion`](crate::mr::MemoryRegion) and whatever may access it remotely), access rights
//! ([`Access`]), the serializable [`RemoteKey`] a peer needs, and the domain's key table with the
//! one check of a remote access against it (key live, right granted, range inside).
//!
//! A remote access takes the region's lock to copy data in or out ([`RegionMem::write_at`],
//! [`RegionMem::read_into`]), as the application's guards do, so a user never sees a torn remote
//! write, a remote access never sees a half-done local one, and Rust's aliasing rules hold (the
//! lock, `ranges`, holds the one piece of `unsafe` code: the bytes of a range no conflicting
//! guard holds). Closing a region revokes its key everywhere, then takes the bytes out once no
//! range is held: a remote access that had already looked the key up finds the region
//! empty and fails with `RemoteAccess` (the device reports `Status::RemoteBadAddress`).
//!
//! This module imports nothing above `error`, `notify` and `random`: devices, the protocol
//! engine's simulator and the domain all build on it.

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;

pub(crate) mod copy;
mod dmabuf;
mod ranges;
mod store;
pub(crate) use dmabuf::device_only_error;
pub use store::SharedMapping;
pub(crate) use store::Store;

bit_set! {
    /// Access rights of a memory region (`FI_SEND`, `FI_RECV`, `FI_READ`, `FI_WRITE`,
    /// `FI_REMOTE_READ`, `FI_REMOTE_WRITE`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
    pub struct Access(u32) {
        /// Local source of sends.
        SEND = 1 => "FI_SEND";
        /// Local target of receives.
        RECV = 2 => "FI_RECV";
        /// Local target of RMA reads this side initiates.
        READ = 4 => "FI_READ";
        /// Local source of RMA writes this side initiates.
        WRITE = 8 => "FI_WRITE";
        /// Peers may read it.
        REMOTE_READ = 16 => "FI_REMOTE_READ";
        /// Peers may write it.
        REMOTE_WRITE = 32 => "FI_REMOTE_WRITE";
    }
}

impl Access {
    /// Every local access.
    pub const LOCAL: Access = Access(1 | 2 | 4 | 8);
    /// Both remote accesses.
    pub const REMOTE: Access = Access(16 | 32);

    /// True when peers may read or write.
    pub const fn is_remote(self) -> bool {
        self.0 & Access::REMOTE.0 != 0
    }
}

/// Buffers a [`MemoryRegion`](crate::mr::MemoryRegion) can own: `BytesMut`, `Vec<u8>` and `Box<[u8]>` (taken without
/// copying).
pub trait IntoRegionBuf {
    /// The buffer as `BytesMut`.
    fn into_region_buf(self) -> BytesMut;
}

impl IntoRegionBuf for BytesMut {
    fn into_region_buf(self) -> BytesMut {
        self
    }
}

impl IntoRegionBuf for Vec<u8> {
    fn into_region_buf(self) -> BytesMut {
        // A uniquely owned `Bytes` converts back without copying.
        bytes::Bytes::from(self)
            .try_into_mut()
            .unwrap_or_else(|b| BytesMut::from(&b[..]))
    }
}

impl IntoRegionBuf for Box<[u8]> {
    fn into_region_buf(self) -> BytesMut {
        Vec::from(self).into_region_buf()
    }
}

/// What a peer needs to access a region: its address, length and key (`FI_MR_VIRT_ADDR` style:
/// `addr` is the region's address in its owner's address space). Exchange it out of band; it
/// serializes with serde.
///
/// ```
/// # use efa::{Domain, Access, RemoteKey};
/// # fn main() -> efa::Result<()> {
/// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
/// let mr = domain.register(vec![0u8; 4096], Access::REMOTE_READ | Access::REMOTE_WRITE)?;
/// let rk: RemoteKey = mr.remote_key()?;
/// assert_eq!(rk.len, 4096);
/// let json = serde_json::to_string(&rk).unwrap();
/// assert_eq!(serde_json::from_str::<RemoteKey>(&json).unwrap(), rk);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteKey {
    /// Start address of the region.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The key.
    pub key: u64,
}

/// The memory of a registered region, shared by `Arc` between the [`MemoryRegion`](crate::mr::MemoryRegion) that owns it
/// and the device (or domain) that serves remote accesses to it.
///
/// The bytes sit behind a lock by byte range (readers share a range, a writer has it alone,
/// disjoint ranges never wait for each other); every access, local or remote, copies under it.
/// Remote accesses name bytes by address, as [`RemoteKey::addr`] does: `addr()` is the address of
/// the first byte at registration (`FI_MR_VIRT_ADDR` style). The buffer is never reallocated
/// while registered (the guards hand out slices, not the `BytesMut`), so the address stays true.
/// When the region is closed the bytes are taken out, leaving it empty: every later remote access
/// fails its bounds check.
///
/// Devices inside the crate never block on the lock (an application thread that holds a guard may
/// be the one driving the device): they try it, and when it is taken they register a notifier
/// that is signalled as soon as the lock is released, and retry later.
pub struct RegionMem {
    pub(crate) data: ranges::RangeLock,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    /// Signalled (and cleared) whenever the lock is released; see [`RegionMem::try_write_with`].
    waiters: Mutex<Vec<Arc<Notifier>>>,
    /// The dmabuf the memory maps ([`RegionMem::dmabuf`]): a duplicate of its descriptor and
    /// the offset, for devices that register dmabufs with their NIC.
    dmabuf: Option<(std::os::fd::OwnedFd, u64)>,
    /// A device could not release its registration of this memory ([`RegionMem::leak`]).
    leaked: AtomicBool,
    /// Unique in the process: tells two registrations apart that a recycled key and the same
    /// address would name alike.
    id: u64,
    /// The file range a dmabuf region maps, claimed for it alone in this process.
    _claim: Option<dmabuf::DmabufClaim>,
    /// Device-only memory ([`RegionMem::dmabuf_device_only`]): no CPU mapping.
    device_only: bool,
}

/// A fresh [`RegionMem::id`].
fn next_region_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The outcome of a non-blocking access to a [`RegionMem`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TryAccess<R> {
    /// Done (or, for a gated write, decided).
    Done(R),
    /// The lock is taken (a guard is alive or another access copies); the waiter, if one was
    /// given, is signalled when it is released.
    Busy,
    /// The range is not inside the region, or the region is closed. Nothing was touched.
    OutOfRange,
}

/// Whether [`RegionMem::access`] waits for the bytes, or only tries them (registering the
/// notifier, if any, to be signalled when they are released).
#[derive(Clone, Copy)]
enum Wait<'a> {
    Block,
    Try(Option<&'a Arc<Notifier>>),
}

impl RegionMem {
    /// A region's memory owning `buf` (its `len()` bytes), named from the address of its first
    /// byte. [`Domain::register`](crate::Domain::register) makes one for every region; devices
    /// outside the crate, and tests driving the protocol engine, make their own.
    pub fn new(buf: BytesMut) -> Arc<RegionMem> {
        let (addr, len) = (buf.as_ptr() as usize as u64, buf.len());
        Arc::new(RegionMem::over(addr, len, Store::Owned(buf)))
    }

    /// The memory of `store`, named `addr` and `len` bytes long, with a new id, no waiters and
    /// no dmabuf (the constructors that have one set it).
    fn over(addr: u64, len: usize, store: Store) -> RegionMem {
        RegionMem {
            addr,
            len,
            data: ranges::RangeLock::new(store),
            waiters: Mutex::new(Vec::new()),
            leaked: AtomicBool::new(false),
            id: next_region_id(),
            _claim: None,
            dmabuf: None,
            device_only: false,
        }
    }

    /// A region over `len` bytes at `ptr` that it does not own: for devices outside the crate
    /// that register a program's memory themselves, such as the emulated EFA NIC (`efa-emu`),
    /// which registers a C program's buffers for one-sided RDMA. Remote accesses name its first
    /// byte `addr` (the I/O virtual address of `ibv_reg_mr_iova2`; usually `ptr`'s). Give it
    /// to a device ([`Device::register_mem`](crate::device::Device::register_mem)) and call
    /// [`close_foreign`](RegionMem::close_foreign) before the memory goes away. `None` when `ptr`
    /// is null, `len` is 0 or `addr + len` overflows.
    ///
    /// # Safety
    ///
    /// Until `close_foreign` returns, the `len` bytes at `ptr` must stay valid for reads and
    /// writes and must not be reached through Rust references other than this region's (code
    /// outside Rust, such as the C program that lent them, may race with a device's copies as it
    /// would with a NIC's DMA: the bytes it then sees are unspecified, never other memory).
    ///
    /// A hook of the emulated EFA NIC (feature `emu-hooks`), not for applications.
    #[allow(unsafe_code)]
    #[cfg(any(test, feature = "emu-hooks"))]
    pub unsafe fn foreign(ptr: *mut u8, len: usize, addr: u64) -> Option<Arc<RegionMem>> {
        // SAFETY: this function's contract is `Store::foreign`'s.
        let store = unsafe { Store::foreign(ptr, len) }?;
        addr.checked_add(len as u64)?;
        Some(Arc::new(RegionMem::over(addr, len, store)))
    }

    /// Closes a region made by [`foreign`](RegionMem::foreign): waits for an access in progress
    /// to finish, then forgets the memory, so every later access fails its bounds check. Revoke
    /// the region's key in its device first.
    #[cfg(any(test, feature = "emu-hooks"))]
    pub fn close_foreign(&self) {
        drop(self.take());
    }

    /// The address of the first byte (what [`RemoteKey::addr`] names).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The length at registration, bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the region was registered empty (never: registration refuses empty buffers).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes at offsets `range` (a slice's), for reading, under the lock. The lock is taken
    /// recursively: a thread may hold read guards of several slices of one region at once.
    /// Empty when the range is not inside the region or the region is closed.
    pub(crate) fn read_range(&self, range: Range<usize>) -> ReadGuard<'_> {
        ReadGuard(Guard {
            held: self.data.lock(range, false, true),
            mem: self,
        })
    }

    /// The bytes at offsets `range`, for writing, under the lock (remote accesses wait for the
    /// guard to go). Empty when the range is not inside the region or the region is closed.
    pub(crate) fn write_range(&self, range: Range<usize>) -> WriteGuard<'_> {
        WriteGuard(Guard {
            held: self.data.lock(range, true, true),
            mem: self,
        })
    }

    /// True once the owning region has been closed or dropped (its bytes were taken out).
    pub fn is_closed(&self) -> bool {
        self.data.is_closed()
    }

    /// The offsets of `addr .. addr + len` in the region, with overflow-safe arithmetic;
    /// `None` when the range is not inside it.
    fn range(&self, addr: u64, len: u64) -> Option<Range<usize>> {
        let have = self.len;
        let start = addr.checked_sub(self.addr)?;
        let end = start.checked_add(len)?;
        if end > have as u64 {
            return None;
        }
        Some(start as usize..end as usize)
    }

    fn out_of_range(&self, op: &'static str, addr: u64, len: u64) -> Error {
        Error::new(ErrorKind::RemoteAccess, op).with_detail(format!(
            "range {addr:#x}+{len} outside region {:#x}+{} (or region closed)",
            self.addr, self.len
        ))
    }

    /// Copies `src` to `addr`, blocking while a guard of those bytes is alive. `RemoteAccess` (and nothing
    /// written) when the range is not inside the region or the region is closed. Checks no key or
    /// right: the caller (a device's key table) has. `NotSupported` for device-only memory (the
    /// CPU cannot reach it). For devices outside the crate; never call it from a thread that may
    /// hold a guard on those bytes.
    pub fn write_at(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.check_cpu("mr_remote_write")?;
        let len = src.len() as u64;
        match self.access(addr, len, true, Wait::Block, |held| {
            copy::copy(held.bytes_mut(), src);
            TryAccess::Done(())
        }) {
            TryAccess::Done(()) => Ok(()),
            _ => Err(self.out_of_range("mr_remote_write", addr, len)),
        }
    }

    /// Replaces the contents of `out` with the `len` bytes at `addr`, blocking while a write guard
    /// of those bytes is alive. `RemoteAccess` (and `out` left as it was) when the range is not inside the region
    /// or the region is closed. Checks no key or right: the caller has. `NotSupported` for
    /// device-only memory. For devices outside the crate; never call it from a thread that may
    /// hold a write guard on those bytes.
    pub fn read_into(&self, addr: u64, len: u64, out: &mut BytesMut) -> Result<()> {
        self.check_cpu("mr_remote_read")?;
        match self.access(addr, len, false, Wait::Block, |held| {
            out.clear();
            copy::extend(out, held.bytes());
            TryAccess::Done(())
        }) {
            TryAccess::Done(()) => Ok(()),
            _ => Err(self.out_of_range("mr_remote_read", addr, len)),
        }
    }

    /// Registers `w` to be signalled at the next release of the lock.
    fn add_waiter(&self, w: &Arc<Notifier>) {
        let mut ws = self.waiters.lock();
        if !ws.iter().any(|x| Arc::ptr_eq(x, w)) {
            ws.push(w.clone());
        }
    }

    /// Signals (and forgets) every registered waiter; called after every release of the lock.
    fn wake_waiters(&self) {
        // Always under the mutex: a waiter registers under it and then tries the lock once more,
        // so either its retry sees the lock free or this sees the waiter.
        let ws = std::mem::take(&mut *self.waiters.lock());
        for w in ws {
            w.notify();
        }
    }

    /// Holds `range` without blocking; when an overlapping hold is in the way, registers
    /// `waiter` and tries once more (so a release in between is never missed).
    fn try_lock(
        &self,
        range: Range<usize>,
        write: bool,
        waiter: Option<&Arc<Notifier>>,
    ) -> Option<ranges::Held<'_>> {
        if let Some(g) = self.data.lock(range.clone(), write, false) {
            return Some(g);
        }
        let w = waiter?;
        self.add_waiter(w);
        self.data.lock(range, write, false)
    }

    /// What every access of a range shares: takes the `len` bytes at `addr` (for writing when
    /// `write`), waiting for them or not (`wait`), hands them to `access`, then releases them
    /// and wakes the waiters. `OutOfRange` when the bytes are not all inside the region or it
    /// is closed, `Busy` (only without waiting) when a guard or an access holds some of them.
    #[inline]
    fn access<T>(
        &self,
        addr: u64,
        len: u64,
        write: bool,
        wait: Wait<'_>,
        access: impl FnOnce(&mut ranges::Held<'_>) -> TryAccess<T>,
    ) -> TryAccess<T> {
        let Some(r) = self.range(addr, len) else {
            return TryAccess::OutOfRange;
        };
        let held = match wait {
            Wait::Block => self.data.lock(r, write, true),
            Wait::Try(waiter) => self.try_lock(r, write, waiter),
        };
        let Some(mut held) = held else {
            return TryAccess::Busy;
        };
        // (An empty range holds nothing: only the closed flag says the region is gone.)
        let out = if held.bytes().len() as u64 != len || len == 0 && self.is_closed() {
            TryAccess::OutOfRange
        } else {
            access(&mut held)
        };
        drop(held);
        self.wake_waiters();
        out
    }

    /// Non-blocking write of `src` at `addr`, gated: once the bytes are held and the range
    /// checked, `gate` decides whether to write (`Some(r)`: write, then `Done(Some(r))`; `None`:
    /// write nothing, `Done(None)`). `Busy` when a guard or an access holds some of the bytes
    /// (then `waiter` is signalled at its release), `OutOfRange` when the range is not inside
    /// the region or the region is closed.
    pub(crate) fn try_write_with<R>(
        &self,
        addr: u64,
        src: &[u8],
        waiter: Option<&Arc<Notifier>>,
        gate: impl FnOnce() -> Option<R>,
    ) -> TryAccess<Option<R>> {
        self.access(
            addr,
            src.len() as u64,
            true,
            Wait::Try(waiter),
            |held| match gate() {
                Some(v) => {
                    copy::copy(held.bytes_mut(), src);
                    TryAccess::Done(Some(v))
                }
                None => TryAccess::Done(None),
            },
        )
    }

    /// Whether the `len` bytes at `addr` could be read now, without reading them: `Busy` while
    /// a write guard or a write holds some of them (then `waiter` is signalled at its release),
    /// `OutOfRange` when they are not inside the region or it is closed. For a grant that lets
    /// a peer copy the bytes itself (shm's direct reads).
    pub(crate) fn try_probe_read(
        &self,
        addr: u64,
        len: u64,
        waiter: Option<&Arc<Notifier>>,
    ) -> TryAccess<()> {
        self.access(addr, len, false, Wait::Try(waiter), |_| TryAccess::Done(()))
    }

    /// Non-blocking [`read_into`](RegionMem::read_into): `Busy` when a write guard or a write
    /// holds some of the bytes (then `waiter` is signalled at its release), `OutOfRange` as
    /// there.
    pub(crate) fn try_read_into(
        &self,
        addr: u64,
        len: u64,
        out: &mut BytesMut,
        waiter: Option<&Arc<Notifier>>,
    ) -> TryAccess<()> {
        self.access(addr, len, false, Wait::Try(waiter), |held| {
            out.clear();
            copy::extend(out, held.bytes());
            TryAccess::Done(())
        })
    }

    /// This memory's identity, unique in the process (never 0): a key names it only while it
    /// is registered, and a key may come back for another registration at the same address
    /// (NICs recycle theirs), so code that checks "still the region it was" compares this.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// A device could not release its registration of this memory (the NIC may still read or
    /// write it): the memory is never freed, and [`take`](Self::take) hands back nothing.
    #[cfg_attr(not(feature = "efa"), allow(dead_code))]
    pub(crate) fn leak(self: Arc<Self>) {
        self.leaked.store(true, Ordering::Release);
        std::mem::forget(self);
    }

    /// The bytes of the region, leaving it empty (closed); a foreign region, or one whose
    /// registration was leaked ([`leak`](Self::leak)), gives nothing back. Blocks while a guard
    /// is alive.
    pub(crate) fn take(&self) -> BytesMut {
        if self.leaked.load(Ordering::Acquire) {
            return BytesMut::new();
        }
        let old = self.data.close();
        self.wake_waiters();
        match old {
            Store::Owned(b) => b,
            // Dropping a mapped store unmaps it.
            Store::Foreign { .. } | Store::Mapped(_) | Store::Device(_) => BytesMut::new(),
        }
    }
}

/// The local side of a one-sided operation that lies inside a region registered with the device
/// ([`Device::register_mem`](crate::device::Device::register_mem) returned `key`): the `len` bytes
/// at `addr` of `mem`. A device that takes such slices
/// ([`QueuePair::region_rdma`](crate::device::QueuePair::region_rdma)) reads or writes the
/// region's memory itself, with the registration it already holds: no copy and no registration
/// per operation.
#[derive(Clone)]
pub struct RegionSlice {
    /// The region's memory (kept alive while the operation runs).
    pub mem: Arc<RegionMem>,
    /// The key the device returned when it registered the region.
    pub key: u64,
    /// Address of the first byte (in the region's address space, as [`RegionMem::addr`]).
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
}

impl RegionSlice {
    /// The `len` bytes at `off` of this slice; `None` when they are not inside it.
    pub fn sub(&self, off: usize, len: usize) -> Option<RegionSlice> {
        let end = off.checked_add(len)?;
        (end <= self.len).then(|| RegionSlice {
            mem: self.mem.clone(),
            key: self.key,
            addr: self.addr.wrapping_add(off as u64),
            len,
        })
    }

    /// True when the slice lies inside its region's registered range.
    pub fn in_bounds(&self) -> bool {
        self.addr
            .checked_sub(self.mem.addr)
            .and_then(|o| o.checked_add(self.len as u64))
            .is_some_and(|end| end <= self.mem.len as u64)
    }

    /// The slice's bytes, held for reading (empty when the region is closed).
    pub(crate) fn read(&self) -> ReadGuard<'_> {
        let off = self.addr.wrapping_sub(self.mem.addr) as usize;
        let range = if self.in_bounds() {
            off..off + self.len
        } else {
            0..0
        };
        self.mem.read_range(range)
    }

    /// The slice's bytes, held for reading, without waiting: `None` while a write guard on bytes
    /// of the slice (the application's, or a remote write's) is alive, or when the
    /// region is closed or the slice not inside it. A device sending from region memory reads
    /// it so at transmission, as a NIC reads it by DMA: the guard keeps every writer out while
    /// the bytes are read (the kernel's copy included), so nothing aliases them mutably.
    pub(crate) fn try_read(&self) -> Option<ReadGuard<'_>> {
        let off = self.addr.checked_sub(self.mem.addr)? as usize;
        if !self.in_bounds() {
            return None;
        }
        let guard = ReadGuard(Guard {
            held: Some(self.mem.data.lock(off..off + self.len, false, false)?),
            mem: &self.mem,
        });
        (guard.len() == self.len).then_some(guard)
    }

    /// A copy of the slice's bytes, blocking while a write guard on the region is alive.
    /// `RemoteAccess` when the region is closed; `NotSupported` for device-only memory.
    pub fn to_bytes(&self) -> Result<Bytes> {
        self.mem.check_cpu("to_bytes")?;
        let mut out = BytesMut::with_capacity(self.len);
        self.mem.read_into(self.addr, self.len as u64, &mut out)?;
        Ok(out.freeze())
    }

    /// Copies `src` to the start of the slice (at most `len` bytes), blocking while a guard on
    /// the region is alive. `RemoteAccess` when the region is closed; `NotSupported` for
    /// device-only memory.
    pub fn write_from(&self, src: &[u8]) -> Result<()> {
        self.mem.check_cpu("write_from")?;
        let n = src.len().min(self.len);
        self.mem.write_at(self.addr, &src[..n])
    }
}

impl fmt::Debug for RegionSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionSlice")
            .field("key", &self.key)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

impl fmt::Debug for RegionMem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionMem")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

/// A held range of a region's bytes; releases it, then signals waiting accesses.
struct Guard<'a> {
    /// `None` only inside `drop`, and for a `try_read` that found the bytes held.
    held: Option<ranges::Held<'a>>,
    mem: &'a RegionMem,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        drop(self.held.take());
        self.mem.wake_waiters();
    }
}

impl Guard<'_> {
    fn bytes(&self) -> &[u8] {
        self.held.as_ref().map_or(&[], |h| h.bytes())
    }
}

/// The guard [`MemoryRegion::read`](crate::mr::MemoryRegion::read) returns: the bytes of one
/// range of the region, which no write reaches while it lives (other ranges stay free).
pub(crate) struct ReadGuard<'a>(Guard<'a>);

impl Deref for ReadGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// The guard [`MemoryRegion::write`](crate::mr::MemoryRegion::write) returns: the bytes of
/// one range of the region, which nothing else reaches while it lives (other ranges stay free).
pub(crate) struct WriteGuard<'a>(Guard<'a>);

impl Deref for WriteGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl DerefMut for WriteGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.held.as_mut().map_or(&mut [], |h| h.bytes_mut())
    }
}

/// Keys handed out and not yet revoked, with the memory and the rights each grants: the
/// domain's table (its regions' keys, for emulated RMA), and the software devices' tables (their
/// RDMA keys). [`KeyTable::check`] is the one check of a remote access.
#[derive(Debug, Default)]
pub(crate) struct KeyTable {
    live: HashMap<u64, (Arc<RegionMem>, Access)>,
}

/// Why [`KeyTable::check`] refused an access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The key is not live.
    UnknownKey,
    /// The key does not grant the access (it grants the rights given).
    NotGranted(Access),
    /// The range does not lie inside the region.
    OutOfRange,
}

impl KeyTable {
    /// Registers `mem` under a fresh key: random bits from the kernel's CSPRNG within `mask`,
    /// with the bits of `set` set (not 0, never a live key), so a peer holding one key learns
    /// nothing about the others.
    pub(crate) fn insert_random(
        &mut self,
        mem: &Arc<RegionMem>,
        access: Access,
        mask: u64,
        set: u64,
    ) -> u64 {
        let key = loop {
            let k = (crate::random::secure_u64() & mask) | set;
            if k != 0 && !self.live.contains_key(&k) {
                break k;
            }
        };
        self.live.insert(key, (mem.clone(), access));
        key
    }

    /// Registers `mem` under `key`, a key its caller chose (a device's). False, and nothing
    /// registered, when `key` is live.
    pub(crate) fn insert_as(&mut self, key: u64, mem: &Arc<RegionMem>, access: Access) -> bool {
        if self.live.contains_key(&key) {
            return false;
        }
        self.live.insert(key, (mem.clone(), access));
        true
    }

    /// Revokes `key`.
    pub(crate) fn remove(&mut self, key: u64) {
        self.live.remove(&key);
    }

    /// True when `key` is live and names device-only memory
    /// ([`RegionMem::dmabuf_device_only`]).
    pub(crate) fn is_device_only(&self, key: u64) -> bool {
        self.live.get(&key).is_some_and(|(m, _)| m.is_device_only())
    }

    /// Live keys.
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// The region `key` names if the key is live, grants `need`, and `addr..addr+len` lies
    /// inside the registered range. Takes no region lock (the table is locked, and an
    /// application thread may hold a guard on the region): a region closed since is refused by
    /// the access itself, which checks the range again under the region's lock.
    pub(crate) fn check(
        &self,
        key: u64,
        need: Access,
        addr: u64,
        len: u64,
    ) -> std::result::Result<Arc<RegionMem>, Refused> {
        let (mem, granted) = self.live.get(&key).ok_or(Refused::UnknownKey)?;
        if !granted.contains(need) {
            return Err(Refused::NotGranted(*granted));
        }
        mem.range(addr, len)
            .map(|_| mem.clone())
            .ok_or(Refused::OutOfRange)
    }

    /// [`KeyTable::check`], refusals as `RemoteAccess` errors of `op` that say what was wrong.
    fn check_or_error(
        &self,
        key: u64,
        need: Access,
        addr: u64,
        len: u64,
        op: &'static str,
    ) -> Result<Arc<RegionMem>> {
        self.check(key, need, addr, len).map_err(|r| {
            let detail = match r {
                Refused::UnknownKey => format!("key {key:#x} is not registered"),
                Refused::NotGranted(have) => {
                    format!("access {need:?} not granted (region has {have:?})")
                }
                Refused::OutOfRange => match self.live.get(&key) {
                    Some((mem, _)) => {
                        return mem.out_of_range(op, addr, len);
                    }
                    None => format!("key {key:#x} is not registered"),
                },
            };
            Error::new(ErrorKind::RemoteAccess, op).with_detail(detail)
        })
    }
}

/// Checks a remote access against the key table of `table`: the key must be live, the range
/// inside the region and the access granted. Errors are `ErrorKind::RemoteAccess`.
pub(crate) fn verify(
    table: &Mutex<KeyTable>,
    key: u64,
    addr: u64,
    len: u64,
    access: Access,
) -> Result<()> {
    // Against the registered range; takes no region lock, so it never waits for a guard.
    table
        .lock()
        .check_or_error(key, access, addr, len, "mr_verify")
        .map(drop)
}

fn busy(op: &'static str) -> Error {
    Error::new(ErrorKind::Again, op)
        .with_detail("the region is locked (a guard is alive or another access copies); retry")
}

/// Writes `src` at `addr` of the region `key` names, if the key is live and grants
/// `REMOTE_WRITE` and the range lies inside the region (`RemoteAccess` otherwise, nothing
/// written), `NotSupported` for a device-only region (the CPU cannot reach it). Never blocks:
/// `Again` while the region's lock is taken.
pub(crate) fn remote_write(table: &Mutex<KeyTable>, key: u64, addr: u64, src: &[u8]) -> Result<()> {
    const OP: &str = "mr_remote_write";
    let len = src.len() as u64;
    let mem = table
        .lock()
        .check_or_error(key, Access::REMOTE_WRITE, addr, len, OP)?;
    mem.check_cpu(OP)?;
    match mem.try_write_with(addr, src, None, || Some(())) {
        TryAccess::Done(_) => Ok(()),
        TryAccess::Busy => Err(busy(OP)),
        TryAccess::OutOfRange => Err(mem.out_of_range(OP, addr, src.len() as u64)),
    }
}

/// Whether the key is live and grants `REMOTE_WRITE` (`write`) or `REMOTE_READ`, and `len` bytes
/// at `addr` lie inside its region (`RemoteAccess` otherwise), and the CPU may copy its bytes
/// (`NotSupported` for a device-only region). Touches no data.
pub(crate) fn remote_check(
    table: &Mutex<KeyTable>,
    key: u64,
    addr: u64,
    len: u64,
    write: bool,
) -> Result<()> {
    const OP: &str = "mr_remote_check";
    let access = if write {
        Access::REMOTE_WRITE
    } else {
        Access::REMOTE_READ
    };
    table
        .lock()
        .check_or_error(key, access, addr, len, OP)?
        .check_cpu(OP)
}

/// The `len` bytes at `addr` of the region `key` names, if the key is live and grants
/// `REMOTE_READ` and the range lies inside the region (`RemoteAccess` otherwise; `NotSupported`
/// for a device-only region). Never blocks: `Again` while a write guard on the region is alive.
pub(crate) fn remote_read(table: &Mutex<KeyTable>, key: u64, addr: u64, len: u64) -> Result<Bytes> {
    const OP: &str = "mr_remote_read";
    // Checked against the registered length before allocating, so an absurd length allocates
    // nothing; checked again under the lock.
    let mem = table
        .lock()
        .check_or_error(key, Access::REMOTE_READ, addr, len, OP)?;
    mem.check_cpu(OP)?;
    let mut out = BytesMut::with_capacity(len as usize);
    match mem.try_read_into(addr, len, &mut out, None) {
        TryAccess::Done(()) => Ok(out.freeze()),
        TryAccess::Busy => Err(busy(OP)),
        TryAccess::OutOfRange => Err(mem.out_of_range(OP, addr, len)),
    }
}

/// Applies an atomic to the elements at `addr` of the region `key` names, as one step under the
/// region's write lock, and returns their previous values. The key must be live and grant
/// `REMOTE_WRITE` (and `REMOTE_READ` for operations that return values), the range must
/// lie inside the region (`RemoteAccess` otherwise, nothing changed; `NotSupported` for a
/// device-only region); invalid operands are `InvalidArgument`. Never blocks: `Again` while the region's lock is taken.
pub(crate) fn remote_atomic(
    table: &Mutex<KeyTable>,
    key: u64,
    addr: u64,
    a: crate::atomic::AtomicArgs<'_>,
) -> Result<Bytes> {
    const OP: &str = "mr_remote_atomic";
    let crate::atomic::AtomicArgs {
        op,
        datatype,
        operand,
        compare,
    } = a;
    let mut need = Access::REMOTE_WRITE;
    if a.fetches() {
        need |= Access::REMOTE_READ;
    }
    let len = if op == crate::atomic::AtomicOp::Read {
        operand.len().max(datatype.size())
    } else {
        operand.len()
    };
    let mem = table
        .lock()
        .check_or_error(key, need, addr, len as u64, OP)?;
    mem.check_cpu(OP)?;
    crate::atomic::validate(op, datatype, len, operand, compare)?;
    let done = mem.access(addr, len as u64, true, Wait::Try(None), |held| {
        let data = held.bytes_mut();
        let old = Bytes::copy_from_slice(data);
        TryAccess::Done(crate::atomic::apply(op, datatype, data, operand, compare).map(|()| old))
    });
    match done {
        TryAccess::Done(r) => r,
        TryAccess::Busy => Err(busy(OP)),
        TryAccess::OutOfRange => Err(mem.out_of_range(OP, addr, len as u64)),
    }
}

/// How many leading bytes `Debug` shows of a buffer.
const DEBUG_PREFIX: usize = 8;

/// `N bytes: 01 02 .. ` — the length and the first [`DEBUG_PREFIX`] bytes.
pub(crate) struct Short<'a>(pub &'a [u8]);

impl fmt::Debug for Short<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes", self.0.len())?;
        if !self.0.is_empty() {
            f.write_str(":")?;
            for b in self.0.iter().take(DEBUG_PREFIX) {
                write!(f, " {b:02x}")?;
            }
            if self.0.len() > DEBUG_PREFIX {
                f.write_str(" ..")?;
            }
        }
        Ok(())
    }
}
