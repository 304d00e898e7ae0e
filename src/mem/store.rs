//! The storage of a region's bytes: owned, or lent by the caller of `RegionMem::foreign`.
#![allow(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use bytes::BytesMut;

/// The bytes behind a [`RegionMem`]: a buffer it owns, or memory it was lent by a caller of
/// [`RegionMem::foreign`]. An empty store is a closed region.
pub(crate) enum Store {
    Owned(BytesMut),
    Foreign { ptr: NonNull<u8>, len: usize },
}

// SAFETY: a foreign store is memory the creator of the region promised to keep valid, and to
// reach from Rust only through this region, until the region is closed (`RegionMem::foreign`);
// every access goes through the region's lock, as for an owned buffer.
unsafe impl Send for Store {}
// SAFETY: as above; shared access is the lock's read mode.
unsafe impl Sync for Store {}

impl Deref for Store {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Store::Owned(b) => b,
            // SAFETY: `RegionMem::foreign`'s contract: `len` bytes at `ptr` are valid until the
            // region is closed, which replaces this store under the write lock.
            Store::Foreign { ptr, len } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
        }
    }
}

impl DerefMut for Store {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Store::Owned(b) => b,
            // SAFETY: as in `deref`; the write lock makes this the only access from Rust.
            Store::Foreign { ptr, len } => unsafe {
                std::slice::from_raw_parts_mut(ptr.as_ptr(), *len)
            },
        }
    }
}

impl Store {
    /// A store over `len` bytes at `ptr`; `None` when `ptr` is null or `len` is 0.
    ///
    /// # Safety
    ///
    /// `RegionMem::foreign`'s contract.
    pub(super) unsafe fn foreign(ptr: *mut u8, len: usize) -> Option<Store> {
        let ptr = NonNull::new(ptr)?;
        (len > 0).then_some(Store::Foreign { ptr, len })
    }
}
