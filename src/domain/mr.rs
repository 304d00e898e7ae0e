//! [`MemoryRegion`]: a registered region that owns its buffer, carries a key, and is moved into
//! the operations that use it (and handed back in their completions). Registered with (and
//! revoked from) its domain's key table and device; the memory itself is
//! [`RegionMem`](crate::mem::RegionMem).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use bytes::BytesMut;

use super::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{Access, RegionMem, RemoteKey, WriteGuard};

/// A registered memory region that owns its buffer.
///
/// Move it into an operation (`Endpoint::recv`, `Endpoint::send`) and get it back from the
/// completion. Read and write its bytes with the [`read`](MemoryRegion::read) and
/// [`write`](MemoryRegion::write) guards: remote accesses (RDMA by a peer's device, or emulated
/// RMA) take the same lock, so a guard never sees a remote write half done. Do not hold a guard
/// while this thread posts an RDMA operation that targets the same region (the device would wait
/// for the guard); a guard held in another thread only delays remote accesses.
///
/// Dropping it (or [`MemoryRegion::close`]) revokes its key first; remote accesses that arrive
/// later fail with `RemoteAccess` (`Status::RemoteBadAddress` on the device).
///
/// ```
/// # use efa::{Access, Domain};
/// # fn main() -> efa::Result<()> {
/// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
/// let mut mr = domain.register(vec![0u8; 8], Access::SEND | Access::REMOTE_WRITE)?;
/// mr.write()[..2].copy_from_slice(b"hi");
/// assert_eq!(&mr.read()[..3], b"hi\0");
/// let buf = mr.close();
/// assert_eq!(&buf[..2], b"hi");
/// # Ok(()) }
/// ```
///
/// A guard borrows the region, so the region cannot be moved into an operation (or closed) while
/// a guard is alive:
///
/// ```compile_fail
/// # use efa::{Access, Domain};
/// # fn main() -> efa::Result<()> {
/// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
/// let mr = domain.register(vec![0u8; 8], Access::SEND)?;
/// let bytes = mr.read();
/// let buf = mr.close(); // error: `mr` is borrowed by `bytes`
/// assert_eq!(bytes[0], 0);
/// # drop(buf); Ok(()) }
/// ```
pub struct MemoryRegion {
    mem: Arc<RegionMem>,
    key: u64,
    access: Access,
    domain: Domain,
    revoked: bool,
    /// The device registered the region itself (its key is the device's): peers' device RDMA
    /// can reach it. Without, the key is the domain's alone and only emulated RMA serves it.
    device_registered: bool,
}

impl MemoryRegion {
    pub(crate) fn register(domain: &Domain, buf: BytesMut, access: Access) -> Result<MemoryRegion> {
        if buf.is_empty() {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "mr_reg").with_detail(
                    "cannot register an empty buffer (give it a length, not only capacity)",
                ),
            );
        }
        if access.is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, "mr_reg")
                .with_detail("access flags are empty"));
        }
        MemoryRegion::register_mem(domain, RegionMem::new(buf), access)
    }

    /// Registers a region over the dmabuf range ([`RegionMem::dmabuf`]).
    pub(crate) fn register_dmabuf(
        domain: &Domain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        if access.is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, "register_dmabuf")
                .with_detail("access flags are empty"));
        }
        MemoryRegion::register_mem(domain, RegionMem::dmabuf(fd, offset, len)?, access)
    }

    /// Registers `mem` with the device and the domain's key table.
    fn register_mem(domain: &Domain, mem: Arc<RegionMem>, access: Access) -> Result<MemoryRegion> {
        let device_key = domain.device().register_mem(&mem, access)?;
        // Under the device's key, or a fresh 64-bit software key (CSPRNG) when the device has
        // none; `None` when the device's key is live already.
        let key = {
            let mut table = domain.mr_table().lock();
            match device_key {
                Some(k) => table.insert_as(k, &mem, access).then_some(k),
                None => Some(table.insert_random(&mem, access, u64::MAX)),
            }
        };
        let Some(key) = key else {
            // A device handed out a key that is live already: refuse rather than alias.
            if let Some(k) = device_key {
                domain.device().deregister_mem(k);
            }
            return Err(Error::new(ErrorKind::Io, "mr_reg").with_detail(format!(
                "the device returned key {device_key:?}, which is registered already"
            )));
        };
        tracing::debug!(
            key,
            len = mem.len,
            ?access,
            device_key = device_key.is_some(),
            "mr_reg"
        );
        Ok(MemoryRegion {
            mem,
            key,
            access,
            domain: domain.clone(),
            revoked: false,
            device_registered: device_key.is_some(),
        })
    }

    /// The key a peer's device RDMA read may use on this region, with its address: `Some` only
    /// for a region with `REMOTE_READ` that the device registered itself. The read-based
    /// protocols (long-read, runting read, LONGREAD_RTW) advertise only such keys: a libfabric
    /// 1.17 peer cannot refuse a read that fails (it has no READ_NACK), so a key the NIC does
    /// not know must never reach it; such regions go by long-CTS from the start.
    pub(crate) fn device_read_key(&self) -> Option<(u64, u64)> {
        (self.device_registered && self.access.contains(Access::REMOTE_READ) && !self.revoked)
            .then_some((self.key, self.mem.addr))
    }

    /// The whole region as its device registered it, for device RDMA straight to and from its
    /// memory (`QueuePair::post_read_region` / `post_write_region`): `Some` only when the
    /// device registered the region itself and it is not revoked.
    pub(crate) fn device_slice(&self) -> Option<crate::mem::RegionSlice> {
        (self.device_registered && !self.revoked).then(|| crate::mem::RegionSlice {
            mem: self.mem.clone(),
            key: self.key,
            addr: self.mem.addr,
            len: self.mem.len,
        })
    }

    /// True for a region over a dmabuf ([`Domain::register_dmabuf`]): its memory is a mapping
    /// of the dmabuf, and [`close`](MemoryRegion::close) gives back an empty buffer.
    pub fn is_dmabuf(&self) -> bool {
        self.mem.dmabuf_fd().is_some()
    }

    /// The key.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The access rights.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The domain it is registered with.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// The registered length, bytes.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Always false: a region is never empty (registration refuses empty buffers).
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// The region's bytes, for reading, under the region's lock (shared with remote reads).
    pub fn read(&self) -> impl Deref<Target = [u8]> + '_ {
        self.mem.read()
    }

    /// The region's memory (what devices and the same-host path reach).
    pub(crate) fn mem(&self) -> &Arc<RegionMem> {
        &self.mem
    }

    /// The region's bytes, for writing, under the region's lock (remote accesses wait for the
    /// guard to go).
    pub fn write(&mut self) -> impl DerefMut<Target = [u8]> + '_ {
        WriteGuard {
            guard: Some(self.mem.data.write()),
            mem: &self.mem,
        }
    }

    /// The description a peer needs for remote access. `InvalidArgument` unless the region was
    /// registered with `REMOTE_READ` or `REMOTE_WRITE`.
    pub fn remote_key(&self) -> Result<RemoteKey> {
        if !self.access.is_remote() {
            return Err(Error::new(ErrorKind::InvalidArgument, "mr_remote_key")
                .with_detail("region was not registered for remote access"));
        }
        Ok(RemoteKey {
            addr: self.mem.addr,
            len: self.mem.len as u64,
            key: self.key,
        })
    }

    /// Revokes the key (in the domain and the device), then hands the buffer back. A remote
    /// access still in flight either landed before or fails with `RemoteAccess`.
    pub fn close(mut self) -> BytesMut {
        self.revoke();
        self.mem.take()
    }

    fn revoke(&mut self) {
        if !self.revoked {
            self.revoked = true;
            self.domain.mr_table().lock().remove(self.key);
            self.domain.device().deregister_mem(self.key);
            tracing::debug!(key = self.key, "mr_close");
        }
    }

    /// Checks that this region may serve as `needed` for an operation of `op`.
    pub(crate) fn check_local(
        &self,
        domain: &Domain,
        needed: Access,
        op: &'static str,
    ) -> Result<()> {
        if !domain.same(&self.domain) {
            return Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail("memory region belongs to another domain"));
        }
        if !self.access.contains(needed) {
            return Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail(format!("memory region lacks {needed:?} access")));
        }
        Ok(())
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("key", &self.key)
            .field("len", &self.mem.len)
            .field("access", &self.access)
            .field("dmabuf", &self.is_dmabuf())
            .finish()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if !self.revoked {
            self.revoke();
            // Leave nothing for a remote access that looked the key up before the revocation.
            drop(self.mem.take());
        }
    }
}
