//! Memory the NIC touches: access flags, the registered bounce-buffer pools of a queue pair, and
//! (in [`verbs`](super::verbs)) the public registrations [`EfaMr`](super::EfaMr).
//!
//! # Why bounce buffers
//!
//! The device seam hands the device owned `Bytes` (sends) and `BytesMut` (receives), allocated by
//! whoever called it, anywhere in the heap. Registering each one (`ibv_reg_mr` pins pages and
//! costs a system call) per datagram would be slower than copying an MTU, and two `Bytes` may share
//! pages with unrelated data. So each queue pair owns two pools of MTU-sized slots carved out of one
//! page-aligned allocation, registered once:
//!
//! * a send copies its header and payload into a free send slot (sends of at most the inline size
//!   are copied into the work queue entry instead and need no slot);
//! * a receive posts a free receive slot (MTU bytes, plus 40 for the GRH on UD) and keeps the
//!   caller's `BytesMut`; at completion the datagram is copied from the slot into it.
//!
//! Every address the NIC is given therefore lies in memory the queue pair owns and has
//! registered, and the caller's buffers are never touched by the NIC. A slot returns to its pool
//! only when its work request has completed (or the queue pair has been destroyed, after which the
//! NIC touches nothing). One-sided RDMA is the exception: the local buffer of a read or write
//! (up to `max_rdma_size`) is registered for the duration of the operation (and deregistered before
//! it is handed back). Zero-copy sends and receives are left for later.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;

use super::nic::{Nic, Registration, Sge};
use crate::error::{Error, ErrorKind, Result};
use crate::mem::Access;

/// `IBV_ACCESS_LOCAL_WRITE`.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
/// `IBV_ACCESS_REMOTE_WRITE`.
pub const ACCESS_REMOTE_WRITE: u32 = 2;
/// `IBV_ACCESS_REMOTE_READ`.
pub const ACCESS_REMOTE_READ: u32 = 4;

const _: () = {
    use rdma_sys::ibv_access_flags as a;
    assert!(ACCESS_LOCAL_WRITE == a::IBV_ACCESS_LOCAL_WRITE.0);
    assert!(ACCESS_REMOTE_WRITE == a::IBV_ACCESS_REMOTE_WRITE.0);
    assert!(ACCESS_REMOTE_READ == a::IBV_ACCESS_REMOTE_READ.0);
};

/// The `ibv_access_flags` of the crate's [`Access`] rights. The NIC writes local memory for
/// receives and as the target of reads (`LOCAL_WRITE`); verbs requires `LOCAL_WRITE` with
/// `REMOTE_WRITE`; local reads (sends, write sources) need no flag.
///
/// ```
/// # #[cfg(feature = "efa")] {
/// use efa::Access;
/// use efa::device::efa::ibv_access;
/// assert_eq!(ibv_access(Access::SEND), 0);
/// assert_eq!(ibv_access(Access::RECV), 1);
/// assert_eq!(ibv_access(Access::REMOTE_WRITE), 1 | 2);
/// assert_eq!(ibv_access(Access::REMOTE_READ), 4);
/// # }
/// ```
pub fn ibv_access(access: Access) -> u32 {
    let mut f = 0;
    if access.contains(Access::RECV) || access.contains(Access::READ) {
        f |= ACCESS_LOCAL_WRITE;
    }
    if access.contains(Access::REMOTE_WRITE) {
        f |= ACCESS_REMOTE_WRITE | ACCESS_LOCAL_WRITE;
    }
    if access.contains(Access::REMOTE_READ) {
        f |= ACCESS_REMOTE_READ;
    }
    f
}

/// Slots are aligned to this many bytes (a cache line; the NIC writes whole lines).
const SLOT_ALIGN: usize = 64;
/// The pool's memory is page aligned and a whole number of pages long.
fn pool_align() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(page).unwrap_or(4096).max(4096)
}

/// Huge pages are this large (x86-64 and arm64 default `Hugepagesize`).
const HUGE_PAGE: usize = 2 << 20;

/// Fixed-size slots of one registered, page-aligned allocation (on huge pages when asked for
/// and available).
pub struct SlotPool<M: Registration> {
    base: NonNull<u8>,
    layout: Layout,
    /// The memory is an anonymous huge-page mapping of `layout.size()` bytes (else the heap's).
    huge: bool,
    /// Bytes between slot starts (the slot size rounded up to [`SLOT_ALIGN`]).
    stride: usize,
    /// Usable bytes of a slot.
    slot_size: usize,
    mr: Option<M>,
    free: Vec<u32>,
    in_use: Vec<bool>,
}

// SAFETY: the pool exclusively owns its allocation (the raw pointer is never shared outside of the
// work requests it tracks), and its registration is `Send`.
unsafe impl<M: Registration> Send for SlotPool<M> {}

impl<M: Registration> SlotPool<M> {
    /// `slots` slots of `slot_size` bytes, zeroed and registered with `nic` for local write;
    /// on huge pages when `huge` and the system has them reserved (else on ordinary pages:
    /// [`SlotPool::is_huge`] says which).
    pub fn new<N: Nic<Mr = M>>(
        nic: &N,
        slot_size: usize,
        slots: usize,
        huge: bool,
    ) -> Result<SlotPool<M>> {
        let bad =
            |d: String| Error::new(ErrorKind::InvalidArgument, "efa_slot_pool").with_detail(d);
        if slots == 0
            || slots > u32::MAX as usize
            || slot_size == 0
            || slot_size > u32::MAX as usize
        {
            return Err(bad(format!("{slots} slots of {slot_size} bytes")));
        }
        let stride = slot_size.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        // Whole pages: with fork support on, registration marks the pages MADV_DONTFORK, which
        // must not catch unrelated heap data sharing the pool's last page.
        let total = stride
            .checked_mul(slots)
            .and_then(|t| t.checked_next_multiple_of(pool_align()))
            .ok_or_else(|| bad(format!("{slots} slots of {slot_size} bytes overflow")))?;
        let (base, layout, huge) = match huge.then(|| map_huge(total)).flatten() {
            Some((base, len)) => {
                let layout = Layout::from_size_align(len, HUGE_PAGE)
                    .map_err(|e| bad(format!("{len} bytes: {e}")))?;
                (base, layout, true)
            }
            None => {
                let layout = Layout::from_size_align(total, pool_align())
                    .map_err(|e| bad(format!("{total} bytes: {e}")))?;
                // SAFETY: `layout` has a non-zero size (slots, slot_size ≥ 1).
                let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
                let base = NonNull::new(ptr).ok_or_else(|| {
                    Error::new(ErrorKind::NoMemory, "efa_slot_pool")
                        .with_detail(format!("cannot allocate {total} bytes"))
                })?;
                (base, layout, false)
            }
        };
        // Only the slots are registered: a huge-page mapping rounds up to 2 MiB, and registering
        // all of it would pin (and count against RLIMIT_MEMLOCK, which the kernel charges by the
        // registered range) up to twice what the slots need.
        // SAFETY: the allocation stays valid and in place until `Drop`, which drops the
        // registration first; no reference to it exists until a slot is handed out.
        let mr = match unsafe { nic.register(base.as_ptr(), total, ACCESS_LOCAL_WRITE) } {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: allocated above as recorded, never registered.
                unsafe { release(base, layout, huge) };
                return Err(e);
            }
        };
        Ok(SlotPool {
            base,
            layout,
            huge,
            stride,
            slot_size,
            mr: Some(mr),
            free: (0..slots as u32).rev().collect(),
            in_use: vec![false; slots],
        })
    }

    /// Whether the pool is on huge pages.
    pub fn is_huge(&self) -> bool {
        self.huge
    }

    /// Bytes allocated and registered.
    pub fn len_bytes(&self) -> usize {
        self.layout.size()
    }

    /// Takes a free slot.
    pub fn alloc(&mut self) -> Option<u32> {
        let i = self.free.pop()?;
        if let Some(u) = self.in_use.get_mut(i as usize) {
            *u = true;
        }
        Some(i)
    }

    /// Gives slot `i` back; freeing a slot twice is ignored (and logged).
    pub fn release(&mut self, i: u32) {
        match self.in_use.get_mut(i as usize) {
            Some(u) if *u => {
                *u = false;
                self.free.push(i);
            }
            _ => tracing::warn!(
                slot = i,
                "efa: slot released twice or out of range; ignored"
            ),
        }
    }

    /// Free slots.
    #[cfg(test)]
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Usable bytes per slot.
    pub fn slot_size(&self) -> usize {
        self.slot_size
    }

    /// The SGE of the first `len` bytes of slot `i` (`len` is capped at the slot size).
    pub fn sge(&self, i: u32, len: usize) -> Sge {
        Sge {
            addr: self.base.as_ptr() as u64 + (i as usize * self.stride) as u64,
            len: len.min(self.slot_size) as u32,
            lkey: self.mr.as_ref().map_or(0, |m| m.lkey()),
        }
    }

    fn slot_ptr(&self, i: u32) -> Option<*mut u8> {
        if (i as usize) < self.in_use.len() {
            // SAFETY: `i < slots`, so the offset lies inside the allocation.
            Some(unsafe { self.base.as_ptr().add(i as usize * self.stride) })
        } else {
            None
        }
    }

    /// The bytes of slot `i`, for reading a completed receive.
    ///
    /// # Safety
    ///
    /// The NIC must not be writing slot `i`: its work request has completed, or was never posted.
    pub unsafe fn slot(&self, i: u32) -> &[u8] {
        match self.slot_ptr(i) {
            // SAFETY: in bounds (checked), initialized (zeroed at allocation, then written only by
            // the NIC or by `slot_mut`), and not written concurrently (caller's contract).
            Some(p) => unsafe { std::slice::from_raw_parts(p, self.slot_size) },
            None => &[],
        }
    }

    /// The bytes of slot `i`, for filling a send before posting it.
    ///
    /// # Safety
    ///
    /// Slot `i` must not be posted to the NIC.
    pub unsafe fn slot_mut(&mut self, i: u32) -> &mut [u8] {
        match self.slot_ptr(i) {
            // SAFETY: in bounds (checked); `&mut self` and the caller's contract make this the only
            // access to these bytes.
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p, self.slot_size) },
            None => &mut [],
        }
    }
}

impl<M: Registration> Drop for SlotPool<M> {
    fn drop(&mut self) {
        // Deregister first: after that the NIC cannot touch the memory, which can then be freed;
        // when the NIC refuses, the memory is leaked (it may still write it).
        if let Some(mut mr) = self.mr.take() {
            if !mr.deregister() {
                return;
            }
        }
        // SAFETY: allocated in `new` as recorded; deregistered just above.
        unsafe { release(self.base, self.layout, self.huge) };
    }
}

/// An anonymous, zeroed mapping of at least `len` bytes on huge pages, and its length; `None`
/// when the system has none to give (`vm.nr_hugepages` is 0 or used up).
fn map_huge(len: usize) -> Option<(NonNull<u8>, usize)> {
    let len = len.checked_next_multiple_of(HUGE_PAGE)?;
    // SAFETY: a fresh anonymous mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        tracing::debug!(
            len,
            errno = std::io::Error::last_os_error().raw_os_error(),
            "efa: no huge pages for a bounce pool; ordinary pages"
        );
        return None;
    }
    NonNull::new(p.cast::<u8>()).map(|b| (b, len))
}

/// Frees a pool's memory.
///
/// # Safety
///
/// `base` and `layout` are a pool's allocation (`huge`: its mapping), not registered any more and
/// not used afterwards.
unsafe fn release(base: NonNull<u8>, layout: Layout, huge: bool) {
    if huge {
        // SAFETY: the caller's contract; the mapping is `layout.size()` bytes.
        unsafe { libc::munmap(base.as_ptr().cast(), layout.size()) };
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::alloc::dealloc(base.as_ptr(), layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags() {
        assert_eq!(ibv_access(Access::SEND | Access::WRITE), 0);
        assert_eq!(ibv_access(Access::RECV), ACCESS_LOCAL_WRITE);
        assert_eq!(ibv_access(Access::READ), ACCESS_LOCAL_WRITE);
        assert_eq!(
            ibv_access(Access::REMOTE_WRITE),
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
        );
        assert_eq!(ibv_access(Access::REMOTE_READ), ACCESS_REMOTE_READ);
        assert_eq!(ibv_access(Access::LOCAL | Access::REMOTE), 7);
    }
}

/// What a queue pair needs to point a work request at the memory of a domain region the device
/// registered ([`Device::register_mem`](crate::device::Device::register_mem)): its local key
/// and range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalKey {
    /// The registration's local key.
    pub lkey: u32,
    /// First registered address.
    pub addr: u64,
    /// Registered length.
    pub len: usize,
}

impl LocalKey {
    /// The local key for the `len` bytes at `addr`, when they lie inside this registration.
    pub fn covering(&self, addr: u64, len: usize) -> Option<u32> {
        let off = addr.checked_sub(self.addr)?;
        let end = off.checked_add(len as u64)?;
        (end <= self.len as u64).then_some(self.lkey)
    }
}

/// The local keys of a device's live region registrations, by the key the device handed out,
/// shared by the device and its queue pairs. The device removes an entry before it deregisters
/// (under this lock), and a queue pair posts a work request naming an entry while it holds the
/// lock: no work request is posted with a key that is being deregistered. (One that is on the
/// device when its region is deregistered completes with an error; the NIC no longer touches
/// the memory once `ibv_dereg_mr` has returned.)
#[derive(Debug, Default)]
pub struct LocalKeys(pub(crate) parking_lot::Mutex<std::collections::HashMap<u64, LocalKey>>);

/// How many registrations, and how many bytes, the MR cache of a device keeps at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MrCacheLimits {
    /// Most cached registrations (0: the cache is off).
    pub count: usize,
    /// Most cached bytes.
    pub bytes: usize,
}

impl MrCacheLimits {
    /// Registrations kept when `FI_EFA_MR_MAX_CACHED_COUNT` is 0.
    pub const DEFAULT_COUNT: usize = 1024;
    /// Bytes kept when `FI_EFA_MR_MAX_CACHED_SIZE` is 0 (bounded further by 90 % of the
    /// device's largest registration).
    pub const DEFAULT_BYTES: usize = 256 << 20;

    /// The limits `FI_EFA_MR_CACHE_ENABLE`, `FI_EFA_MR_MAX_CACHED_COUNT` and
    /// `FI_EFA_MR_MAX_CACHED_SIZE` set, on a device whose largest registration is
    /// `max_mr_size` bytes. Disabled: a count of 0.
    ///
    /// ```
    /// # #[cfg(feature = "efa")] {
    /// use efa::Config;
    /// use efa::device::efa::MrCacheLimits;
    /// let l = MrCacheLimits::from_config(&Config::default(), 1 << 40);
    /// assert_eq!((l.count, l.bytes), (1024, 256 << 20));
    /// let off = Config::from_vars([("FI_EFA_MR_CACHE_ENABLE", "0")]).unwrap();
    /// assert_eq!(MrCacheLimits::from_config(&off, 1 << 40).count, 0);
    /// # }
    /// ```
    pub fn from_config(config: &crate::config::Config, max_mr_size: u64) -> MrCacheLimits {
        if !config.mr_cache_enable {
            return MrCacheLimits { count: 0, bytes: 0 };
        }
        let device = usize::try_from(max_mr_size / 10 * 9).unwrap_or(usize::MAX);
        MrCacheLimits {
            count: match config.mr_max_cached_count {
                0 => Self::DEFAULT_COUNT,
                n => n,
            },
            bytes: match config.mr_max_cached_size {
                0 => Self::DEFAULT_BYTES.min(device),
                n => n,
            },
        }
    }
}

struct Cached<M: Registration> {
    /// `None` only while dropped.
    mr: Option<Arc<M>>,
    /// Keeps the registered memory allocated while the NIC knows it: the buffer cannot be freed
    /// (and its pages handed to other data) as long as the registration is cached.
    keep: Bytes,
    used: u64,
}

impl<M: Registration> Drop for Cached<M> {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.take() {
            // The last holder deregisters; a refusal leaks the buffer.
            super::nic::release_or_leak(mr, std::mem::take(&mut self.keep));
        }
    }
}

/// The device's cache of registrations of the buffers RDMA writes send from (`FI_EFA_MR_CACHE_*`):
/// writing the same `Bytes` again reuses its registration instead of registering and
/// deregistering it per operation.
///
/// An entry holds a clone of the `Bytes` it registered, so the memory stays allocated, at the
/// same pages, while the NIC may read it: a later buffer at the same address and length is then
/// the same memory (nothing else can be allocated there), which is what makes a lookup by
/// address safe without a memory monitor (libfabric hooks `munmap`/uses userfaultfd instead).
/// The price: up to the cache's byte limit of written buffers stays allocated until their
/// entries are evicted (least recently used first) or the device is dropped. Receive buffers
/// (`BytesMut`) are never cached: nothing can keep them alive without owning them. Regions need
/// no cache: they are registered once, at [`Domain::register`](crate::Domain::register).
pub struct MrCache<M: Registration> {
    limits: MrCacheLimits,
    inner: parking_lot::Mutex<CacheInner<M>>,
}

struct CacheInner<M: Registration> {
    entries: std::collections::HashMap<(usize, usize), Cached<M>>,
    bytes: usize,
    tick: u64,
}

impl<M: Registration> MrCache<M> {
    /// An empty cache with these limits.
    pub fn new(limits: MrCacheLimits) -> MrCache<M> {
        MrCache {
            limits,
            inner: parking_lot::Mutex::new(CacheInner {
                entries: std::collections::HashMap::new(),
                bytes: 0,
                tick: 0,
            }),
        }
    }

    /// The registration of `buf` (non-empty), from the cache or made by `register` (and
    /// cached when it fits the limits). The flag is true for a cache hit.
    pub fn get(&self, buf: &Bytes, register: impl FnOnce() -> Result<M>) -> Result<(Arc<M>, bool)> {
        let key = (buf.as_ptr() as usize, buf.len());
        let len = buf.len();
        if self.limits.count == 0 || len > self.limits.bytes {
            return Ok((Arc::new(register()?), false));
        }
        let mut g = self.inner.lock();
        g.tick += 1;
        let tick = g.tick;
        if let Some(e) = g.entries.get_mut(&key)
            && let Some(mr) = &e.mr
        {
            e.used = tick;
            return Ok((mr.clone(), true));
        }
        let mr = Arc::new(register()?);
        while g.entries.len() >= self.limits.count || g.bytes + len > self.limits.bytes {
            let Some((&old, _)) = g.entries.iter().min_by_key(|(_, e)| e.used) else {
                break;
            };
            g.entries.remove(&old);
            g.bytes -= old.1;
        }
        g.bytes += len;
        g.entries.insert(
            key,
            Cached {
                mr: Some(mr.clone()),
                keep: buf.clone(),
                used: tick,
            },
        );
        Ok((mr, false))
    }

    /// Cached registrations and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.entries.len(), g.bytes)
    }
}

impl<M: Registration> std::fmt::Debug for MrCache<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, b) = self.usage();
        f.debug_struct("MrCache")
            .field("limits", &self.limits)
            .field("entries", &n)
            .field("bytes", &b)
            .finish()
    }
}
