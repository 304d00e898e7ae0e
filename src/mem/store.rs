//! The storage of a region's bytes: owned, lent by the caller of `RegionMem::foreign`, a
//! shared mapping of a dmabuf (`RegionMem::dmabuf`) that the store unmaps when dropped, or
//! none at all: a device-only dmabuf region (`RegionMem::dmabuf_device_only`) holds only the
//! inaccessible address range that names it.
#![allow(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use bytes::BytesMut;

/// The bytes behind a [`RegionMem`]: a buffer it owns, memory it was lent by a caller of
/// [`RegionMem::foreign`], a dmabuf's CPU mapping, or (device-only) no bytes the CPU may reach.
/// An empty owned store is a closed region ([`Store::is_closed`]).
pub(crate) enum Store {
    Owned(BytesMut),
    /// Made only with the `emu-hooks` feature ([`RegionMem::foreign`]).
    #[cfg_attr(not(any(test, feature = "emu-hooks")), allow(dead_code))]
    Foreign {
        ptr: NonNull<u8>,
        len: usize,
    },
    Mapped(SharedMapping),
    /// A device-only region: its bytes are the NIC's to reach; the CPU sees none (empty).
    Device(
        #[allow(dead_code, reason = "held for its Drop, which releases the range")] AddressRange,
    ),
}

/// `len` bytes of address space reserved with no access (`PROT_NONE`, nothing behind it): the
/// name of a device-only region, unique in the process, whose bytes the CPU never touches (a
/// stray access faults instead of reaching other memory). Released when dropped.
pub(crate) struct AddressRange {
    ptr: NonNull<u8>,
    len: usize,
}

impl AddressRange {
    /// Reserves `len` bytes of address space.
    pub(crate) fn reserve(len: usize) -> std::io::Result<AddressRange> {
        // SAFETY: a fresh, inaccessible anonymous mapping at an address the kernel chooses; it
        // aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(AddressRange { ptr, len })
    }

    /// The first reserved address.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as usize as u64
    }
}

/// Unmaps `len` bytes at `ptr` when their owner is dropped; a failure (which leaves the range
/// mapped) is logged naming `what`.
///
/// # Safety
///
/// `ptr` starts a mapping (or reservation) of `len` bytes owned by the caller, unmapped once,
/// that nothing reaches any more.
unsafe fn unmap(ptr: NonNull<u8>, len: usize, what: &str) {
    // SAFETY: as the caller guarantees.
    if unsafe { libc::munmap(ptr.as_ptr().cast(), len) } != 0 {
        tracing::error!(error = %std::io::Error::last_os_error(), what, "munmap failed");
    }
}

impl Drop for AddressRange {
    fn drop(&mut self) {
        // SAFETY: reserved in `reserve` with this length, released once; nothing is behind it.
        unsafe { unmap(self.ptr, self.len, "a device-only region's address range") };
    }
}

// SAFETY: a reservation owned by this value alone; it is a plain address range with nothing to
// read or write.
unsafe impl Send for AddressRange {}
// SAFETY: as above.
unsafe impl Sync for AddressRange {}

/// `len` bytes of a file mapped shared for reading and writing (`MAP_SHARED`), unmapped when
/// dropped: the CPU mapping behind a dmabuf region ([`RegionMem::dmabuf`](super::RegionMem::dmabuf)),
/// and the emulated NIC's mapping of a dmabuf it registers. Making one is safe; reaching the
/// bytes through [`addr`](SharedMapping::addr) is the caller's `unsafe` business (a page past
/// the end of the file faults).
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
}

/// The system's page size, bytes (mappings start at multiples of it).
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

impl SharedMapping {
    /// Maps `len` bytes of `fd` at `offset` (page aligned) for reading and writing, shared
    /// with every other mapping of the file. Whoever touches the bytes must know the file is
    /// at least `offset + len` bytes long (touching a page past its end raises `SIGBUS`).
    pub fn map(
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> std::io::Result<SharedMapping> {
        use std::os::fd::AsRawFd;
        let off = libc::off_t::try_from(offset)
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: a fresh mapping at an address the kernel chooses; it aliases no Rust
        // allocation. The fd is valid for the call (borrowed).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(SharedMapping { ptr, len })
    }

    /// The first mapped byte.
    pub fn addr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Mapped bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a mapping is at least one byte (`mmap` refuses 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `SharedMapping::map` with this length, unmapped once. The bytes are
        // reached only through owners that drop this value when nothing points into it any
        // more: a region's store (once no range of the region is held, after its device
        // registrations are gone), the emulated NIC's registration (after deregistration).
        unsafe { unmap(self.ptr, self.len, "a dmabuf region") };
    }
}

// SAFETY: the mapping is owned by this value alone; it is a plain address range.
unsafe impl Send for SharedMapping {}
// SAFETY: `&SharedMapping` only hands out the address.
unsafe impl Sync for SharedMapping {}

// SAFETY: a foreign store is memory the creator of the region promised to keep valid, and to
// reach from Rust only through this region, until the region is closed (`RegionMem::foreign`);
// a mapped store is a mapping this store alone owns. Every access goes through the region's
// lock, as for an owned buffer.
unsafe impl Send for Store {}
// SAFETY: as above; shared access is the lock's read mode.
unsafe impl Sync for Store {}

impl Deref for Store {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Store::Owned(b) => b,
            // SAFETY: `RegionMem::foreign`'s contract: `len` bytes at `ptr` are valid until the
            // region is closed, which replaces this store once no range of it is held.
            Store::Foreign { ptr, len } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
            // SAFETY: the mapping is valid for `len` bytes until the store is dropped.
            Store::Mapped(m) => unsafe { std::slice::from_raw_parts(m.ptr.as_ptr(), m.len) },
            Store::Device(_) => &[],
        }
    }
}

impl DerefMut for Store {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Store::Owned(b) => b,
            // SAFETY: as in `deref`; only `RangeLock::new` takes this, before any guard exists.
            Store::Foreign { ptr, len } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
            // SAFETY: as in `deref`; only `RangeLock::new` takes this, before any guard exists.
            Store::Mapped(m) => unsafe { std::slice::from_raw_parts_mut(m.ptr.as_ptr(), m.len) },
            Store::Device(_) => &mut [],
        }
    }
}

impl Store {
    /// A store over `len` bytes at `ptr`; `None` when `ptr` is null or `len` is 0.
    ///
    /// # Safety
    ///
    /// `RegionMem::foreign`'s contract.
    #[cfg(any(test, feature = "emu-hooks"))]
    pub(super) unsafe fn foreign(ptr: *mut u8, len: usize) -> Option<Store> {
        let ptr = NonNull::new(ptr)?;
        (len > 0).then_some(Store::Foreign { ptr, len })
    }
}
