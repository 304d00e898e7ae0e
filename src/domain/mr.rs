//! [`MemoryRegion`]: a registered region that owns its buffer, carries a key, and is moved into
//! the operations that use it (and handed back in their completions). Registered with (and
//! revoked from) its domain's key table and device; the memory itself is
//! [`RegionMem`](crate::mem::RegionMem).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::BytesMut;

use super::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{Access, RegionMem, RegionSlice, RemoteKey};

/// A registered memory region that owns its buffer, or an owned slice of one.
///
/// Move it into an operation (`Endpoint::recv`, `Endpoint::send`, `write`, `read`, ...) and get
/// it back from the completion. A region registers once and splits into owned, non-overlapping
/// slices ([`split_to`](MemoryRegion::split_to), [`split_off`](MemoryRegion::split_off),
/// [`chunks`](MemoryRegion::chunks)) as a `BytesMut` does: each slice carries the region's
/// registration and key, every operation that takes a region takes a slice at its offset, and
/// many operations on different slices run at once with no registration per operation. Slices
/// rejoin with [`unsplit`](MemoryRegion::unsplit). A slice is not `Clone` and is moved into its
/// operation, so two operations in flight can never hold the same bytes.
///
/// Read and write its bytes with the [`read`](MemoryRegion::read) and
/// [`write`](MemoryRegion::write) guards. What a guard holds off depends on who serves remote
/// access:
///
/// * **Emulated RMA and the software devices** (`udp`, `shm`, `loopback`) take the same lock,
///   so there a guard never sees a remote write half done, and a remote access waits for it. Do
///   not hold a guard while this thread posts an RDMA operation that targets the same region
///   (the device would wait for the guard); a guard held in another thread only delays remote
///   accesses.
/// * **A NIC** (the `efa` device with device RDMA) reads and writes the registered memory by
///   DMA, knowing nothing of the lock: a guard does not hold a peer's write or read off, and
///   bytes a peer writes while a guard looks at them are unspecified (never other memory), as on
///   any RDMA NIC. Order accesses by protocol instead: a write with immediate data, or a message
///   sent after the write completed, tells the target its bytes are there; revoke the key
///   ([`close`](MemoryRegion::close)) to stop remote access for good. See `docs/rma.md`.
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
///
/// A slice moved into one operation cannot be given to a second one while the first holds it
/// (slices do not overlap, and a slice is not `Clone`):
///
/// ```compile_fail,E0382
/// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, Access};
/// # fn main() -> efa::Result<()> {
/// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
/// # let domain = Domain::open(&info)?;
/// # let cq = CompletionQueue::new(&domain, 64)?;
/// # let av = AddressVector::new(&domain);
/// # let ep = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
/// # let peer = av.insert(ep.addr())?;
/// # let target = domain.register(vec![0u8; 8192], Access::REMOTE_WRITE)?;
/// # let rk = target.remote_key()?;
/// let mut region = domain.register(vec![0u8; 8192], Access::WRITE)?;
/// let page = region.split_to(4096)?;
/// ep.write(peer, page, rk.at(0), 1)?;
/// ep.write(peer, page, rk.at(4096), 2)?; // error: use of moved value: `page`
/// # Ok(()) }
/// ```
pub struct MemoryRegion {
    /// The registration this is a slice of (shared by every slice of it).
    reg: Arc<Registration>,
    /// Offset of the slice's first byte in the registered memory.
    off: usize,
    /// Length of the slice.
    len: usize,
}

/// One registration with the domain and its device: the memory, its key and rights. Every
/// slice of a region holds it; the key is revoked, and the memory released, when the last slice
/// goes (or at once by [`MemoryRegion::close`]).
/// Set in every key the domain makes up for a region its device did not register (no device
/// RDMA, or a dmabuf the NIC refused). Device keys (a NIC's 32-bit rkey, the software devices'
/// 32-bit keys) never have it: peers' RMA to a key above 32 bits is emulated, never device
/// RDMA.
pub(crate) const SOFTWARE_KEY_BIT: u64 = 1 << 63;

struct Registration {
    mem: Arc<RegionMem>,
    key: u64,
    access: Access,
    domain: Domain,
    revoked: AtomicBool,
    /// The device registered the region itself (its key is the device's): peers' device RDMA
    /// can reach it. Without, the key is the domain's alone and only emulated RMA serves it.
    device_registered: bool,
    /// Shared by every registration of the same memory with other domains
    /// ([`MemoryRegion::register_also`]): the memory is released only by the last of them.
    /// `Some` until the registration drops.
    siblings: Option<Arc<()>>,
}

impl Registration {
    fn revoke(&self) {
        if !self.revoked.swap(true, Ordering::AcqRel) {
            self.domain.mr_table().lock().remove(self.key);
            self.domain.device().deregister_mem(self.key);
            tracing::debug!(key = self.key, "mr_close");
        }
    }

    fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.revoke();
        // Another domain's registration of the same memory still serves it.
        if self
            .siblings
            .take()
            .is_some_and(|s| Arc::into_inner(s).is_none())
        {
            return;
        }
        // Leave nothing for a remote access that looked the key up before the revocation.
        drop(self.mem.take());
    }
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
        MemoryRegion::register_mem(domain, RegionMem::new(buf), access, None)
    }

    /// Registers this slice's memory (the whole registration's, under the same address) with
    /// another `domain` as well, with the same rights, and returns the slice of the new
    /// registration at this slice's place: one memory, a key in each domain (a multi-rail
    /// group's region on every rail's NIC). The memory is released when the last registration
    /// of it goes; each key is revoked with its own registration.
    pub(crate) fn register_also(&self, domain: &Domain) -> Result<MemoryRegion> {
        let siblings = self.reg.siblings.clone();
        if self.reg.is_revoked() || self.reg.mem.is_closed() {
            return Err(Error::new(ErrorKind::InvalidArgument, "mr_reg")
                .with_detail("the region is closed"));
        }
        let mut r =
            MemoryRegion::register_mem(domain, self.reg.mem.clone(), self.reg.access, siblings)?;
        (r.off, r.len) = (self.off, self.len);
        Ok(r)
    }

    /// True when `other` is a registration of the same memory (by [`Self::register_also`]).
    #[cfg(test)]
    pub(crate) fn same_memory(&self, other: &MemoryRegion) -> bool {
        Arc::ptr_eq(&self.reg.mem, &other.reg.mem)
    }

    /// Registers a region over the dmabuf range: mapped for the CPU ([`RegionMem::dmabuf`]),
    /// or with `device_only` never mapped ([`RegionMem::dmabuf_device_only`]) and registered
    /// with the device's NIC, which alone reaches it.
    pub(crate) fn register_dmabuf(
        domain: &Domain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        access: Access,
        device_only: bool,
    ) -> Result<MemoryRegion> {
        if access.is_empty() {
            let op = if device_only {
                "register_dmabuf_device_only"
            } else {
                "register_dmabuf"
            };
            return Err(
                Error::new(ErrorKind::InvalidArgument, op).with_detail("access flags are empty")
            );
        }
        if !device_only {
            let mem = RegionMem::dmabuf(fd, offset, len)?;
            return MemoryRegion::register_mem(domain, mem, access, None);
        }
        let mem = RegionMem::dmabuf_device_only(fd, offset, len)?;
        let key = domain.device().register_device_mem(&mem, access)?;
        MemoryRegion::register_mem_as(domain, mem, access, Some(key), None)
    }

    /// Registers `mem` with the device and the domain's key table (`siblings`: the other
    /// domains' registrations of it share this).
    fn register_mem(
        domain: &Domain,
        mem: Arc<RegionMem>,
        access: Access,
        siblings: Option<Arc<()>>,
    ) -> Result<MemoryRegion> {
        let device_key = domain.device().register_mem(&mem, access)?;
        MemoryRegion::register_mem_as(domain, mem, access, device_key, siblings)
    }

    /// Enters `mem`, which the device registered under `device_key` (`None`: it did not), in
    /// the domain's key table (`siblings`: as [`Self::register_mem`]'s).
    fn register_mem_as(
        domain: &Domain,
        mem: Arc<RegionMem>,
        access: Access,
        device_key: Option<u64>,
        siblings: Option<Arc<()>>,
    ) -> Result<MemoryRegion> {
        let siblings = Some(siblings.unwrap_or_default());
        // Under the device's key, or a fresh 64-bit software key (CSPRNG) when the device has
        // none; `None` when the device's key is live already.
        let key = {
            let mut table = domain.mr_table().lock();
            match device_key {
                Some(k) => table.insert_as(k, &mem, access).then_some(k),
                // Bit 63 set: no device key (a NIC's rkey is 32 bits) looks like it, so an
                // initiator knows to emulate RMA to it.
                None => Some(table.insert_random(&mem, access, u64::MAX, SOFTWARE_KEY_BIT)),
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
        let len = mem.len;
        Ok(MemoryRegion {
            reg: Arc::new(Registration {
                mem,
                key,
                access,
                domain: domain.clone(),
                revoked: AtomicBool::new(false),
                device_registered: device_key.is_some(),
                siblings,
            }),
            off: 0,
            len,
        })
    }

    /// The address of the slice's first byte (in the registration's address space).
    fn addr(&self) -> u64 {
        self.reg.mem.addr + self.off as u64
    }

    /// The key a peer's device RDMA read may use on this slice, with the slice's address:
    /// `Some` only for a region with `REMOTE_READ` that the device registered itself. The
    /// read-based protocols (long-read, runting read, LONGREAD_RTW) advertise only such keys: a
    /// libfabric 1.17 peer cannot refuse a read that fails (it has no READ_NACK), so a key the
    /// NIC does not know must never reach it; such regions go by long-CTS from the start.
    pub(crate) fn device_read_key(&self) -> Option<(u64, u64)> {
        let r = &self.reg;
        (r.device_registered && r.access.contains(Access::REMOTE_READ) && !r.is_revoked())
            .then_some((r.key, self.addr()))
    }

    /// The slice as its device registered it, for device RDMA straight to and from its memory
    /// (`QueuePair::post_read_region` / `post_write_region`): `Some` only when the device
    /// registered the region itself and it is not revoked.
    pub(crate) fn device_slice(&self) -> Option<RegionSlice> {
        (self.reg.device_registered && !self.reg.is_revoked()).then(|| self.as_slice())
    }

    /// The slice's memory (what the same-host path reads a send from).
    pub(crate) fn as_slice(&self) -> RegionSlice {
        RegionSlice {
            mem: self.reg.mem.clone(),
            key: self.reg.key,
            addr: self.addr(),
            len: self.len,
        }
    }

    /// True for a region over a dmabuf ([`Domain::register_dmabuf`],
    /// [`Domain::register_dmabuf_device_only`]): [`close`](MemoryRegion::close) gives back an
    /// empty buffer (the memory is the dmabuf's).
    pub fn is_dmabuf(&self) -> bool {
        self.reg.mem.dmabuf_fd().is_some()
    }

    /// True for a device-only region ([`Domain::register_dmabuf_device_only`]): the CPU has no
    /// mapping of its bytes. [`try_read`](MemoryRegion::try_read) and
    /// [`try_write`](MemoryRegion::try_write) refuse it, [`read`](MemoryRegion::read) and
    /// [`write`](MemoryRegion::write) show no bytes, and only device RDMA and the read-based
    /// message protocols move its data (docs/rma.md, "Device-only regions").
    pub fn is_device_only(&self) -> bool {
        self.reg.mem.is_device_only()
    }

    /// `NotSupported` naming `op` for a device-only region: `op` would copy its bytes with the
    /// CPU.
    pub(crate) fn check_cpu(&self, op: &'static str) -> Result<()> {
        self.reg.mem.check_cpu(op)
    }

    /// The key (the same for every slice of a region).
    pub fn key(&self) -> u64 {
        self.reg.key
    }

    /// The access rights.
    pub fn access(&self) -> Access {
        self.reg.access
    }

    /// The domain it is registered with.
    pub fn domain(&self) -> &Domain {
        &self.reg.domain
    }

    /// The length of this slice, bytes (of the whole region until it is split).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a slice of no bytes (a region is never registered empty; a split can leave an
    /// empty slice).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where this slice starts in the registered memory, bytes (0 for a whole region).
    pub fn offset(&self) -> usize {
        self.off
    }

    /// The length of the whole registration this slice belongs to, bytes.
    pub fn registered_len(&self) -> usize {
        self.reg.mem.len
    }

    /// The slice's bytes, for reading, under the region's lock by byte range (shared with remote
    /// reads of them). A thread may hold guards of several slices of one region at once.
    ///
    /// A device-only region ([`is_device_only`](MemoryRegion::is_device_only)) has no bytes the
    /// CPU may see: the guard is empty. [`try_read`](MemoryRegion::try_read) says so as an
    /// error instead.
    pub fn read(&self) -> impl Deref<Target = [u8]> + '_ {
        self.reg.mem.read_range(self.off..self.off + self.len)
    }

    /// [`read`](MemoryRegion::read), or `NotSupported` (operation `mr_read`) for a device-only
    /// region, whose bytes the CPU cannot reach.
    ///
    /// ```
    /// # use efa::Access;
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// let mr = domain.register(vec![7u8; 8], Access::SEND)?;
    /// assert_eq!(mr.try_read()?[0], 7);
    /// # Ok(()) }
    /// ```
    pub fn try_read(&self) -> Result<impl Deref<Target = [u8]> + '_> {
        self.check_cpu("mr_read")?;
        Ok(self.read())
    }

    /// The slice's bytes, for writing, under the region's lock by byte range: remote accesses
    /// to these bytes wait for the guard to go; the other slices of the region stay free, so a
    /// thread may hold write guards of several slices at once and post operations on other
    /// slices meanwhile.
    ///
    /// A device-only region has no bytes the CPU may touch: the guard is empty
    /// ([`try_write`](MemoryRegion::try_write) refuses instead).
    pub fn write(&mut self) -> impl DerefMut<Target = [u8]> + '_ {
        self.reg.mem.write_range(self.off..self.off + self.len)
    }

    /// [`write`](MemoryRegion::write), or `NotSupported` (operation `mr_write`) for a
    /// device-only region, whose bytes the CPU cannot reach.
    pub fn try_write(&mut self) -> Result<impl DerefMut<Target = [u8]> + '_> {
        self.check_cpu("mr_write")?;
        Ok(self.write())
    }

    /// The interconnects the NIC uses for this region's traffic (libfabric's
    /// `FI_EFA_DOMAIN_OPS` `query_mr`, rdma-core's `efadv_query_mr`): `None` where the NIC does
    /// not say. `NotSupported` for a region the device did not register with a NIC (the software
    /// devices; an efa domain's region whose memory the NIC could not take) and with a libefa
    /// older than rdma-core 50; `Closed` for a revoked region.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// let d = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("udp"))?[0])?;
    /// let mr = d.register(vec![0u8; 4096], efa::Access::REMOTE_WRITE)?;
    /// // A software device has no NIC to ask.
    /// assert_eq!(mr.query_mr().unwrap_err().kind(), efa::ErrorKind::NotSupported);
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_open_ops")]
    #[doc(alias = "FI_EFA_DOMAIN_OPS")]
    pub fn query_mr(&self) -> Result<crate::device::MrQuery> {
        let r = &self.reg;
        if r.is_revoked() {
            return Err(
                Error::new(ErrorKind::Closed, "query_mr").with_detail("the region is revoked")
            );
        }
        if !r.device_registered {
            return Err(
                Error::new(ErrorKind::NotSupported, "query_mr").with_detail(format!(
                    "the {} device did not register this region with a NIC (it has a software key)",
                    r.domain.attr().name
                )),
            );
        }
        r.domain.device().query_mem(r.key)
    }

    /// The description a peer needs for remote access to this slice: its address and length,
    /// and the region's key. `InvalidArgument` unless the region was registered with
    /// `REMOTE_READ` or `REMOTE_WRITE`. The key itself grants the whole registration, as a
    /// libfabric key does: hand a peer only what it may touch.
    #[doc(alias = "fi_mr_key")]
    pub fn remote_key(&self) -> Result<RemoteKey> {
        if !self.reg.access.is_remote() {
            return Err(Error::new(ErrorKind::InvalidArgument, "mr_remote_key")
                .with_detail("region was not registered for remote access"));
        }
        Ok(RemoteKey {
            addr: self.addr(),
            len: self.len as u64,
            key: self.reg.key,
        })
    }

    /// Revokes the region's key (in the domain and the device), then hands the buffer back. A
    /// remote access still in flight either landed before or fails with `RemoteAccess`.
    ///
    /// On a slice while other slices of the region live, the key is revoked for all of them
    /// (peers reach none of it any more; local operations on the others still work) and the
    /// buffer is empty: the memory goes when the last slice goes. [`unsplit`](Self::unsplit)
    /// the slices first to get the buffer back; drop a slice to let it go without revoking.
    #[doc(alias = "fi_close")]
    pub fn close(self) -> BytesMut {
        self.reg.revoke();
        let whole = self.off == 0 && self.len == self.reg.mem.len;
        let alone = (self.reg.siblings.as_ref()).is_none_or(|s| Arc::strong_count(s) == 1);
        if whole && alone && Arc::strong_count(&self.reg) == 1 {
            self.reg.mem.take()
        } else {
            BytesMut::new()
        }
    }

    /// Splits the slice in two at `at`: this keeps `[0, at)`, the returned slice has
    /// `[at, len)`, as [`BytesMut::split_off`] does. Both carry the region's registration (no
    /// new registration); operations on them may run at once. `InvalidArgument` when `at` is
    /// past the end.
    pub fn split_off(&mut self, at: usize) -> Result<MemoryRegion> {
        self.check_split(at, "split_off")?;
        let tail = MemoryRegion {
            reg: self.reg.clone(),
            off: self.off + at,
            len: self.len - at,
        };
        self.len = at;
        Ok(tail)
    }

    /// Splits the slice in two at `at`: the returned slice has `[0, at)`, this keeps
    /// `[at, len)`, as [`BytesMut::split_to`] does. `InvalidArgument` when `at` is past the end.
    ///
    /// ```
    /// # use efa::Access;
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// let mut region = domain.register(vec![0u8; 3 * 4096], Access::SEND | Access::RECV)?;
    /// let mut page = region.split_to(4096)?;
    /// page.write().fill(7);
    /// assert_eq!((page.offset(), page.len()), (0, 4096));
    /// assert_eq!((region.offset(), region.len()), (4096, 8192));
    /// assert_eq!(page.key(), region.key()); // one registration
    /// page.unsplit(region).expect("adjacent slices of one region");
    /// assert_eq!(page.len(), 3 * 4096);
    /// assert_eq!(page.close()[4095], 7);
    /// # Ok(()) }
    /// ```
    pub fn split_to(&mut self, at: usize) -> Result<MemoryRegion> {
        self.check_split(at, "split_to")?;
        let head = MemoryRegion {
            reg: self.reg.clone(),
            off: self.off,
            len: at,
        };
        self.off += at;
        self.len -= at;
        Ok(head)
    }

    /// Cuts the slice into consecutive slices of `size` bytes (the last may be shorter): the
    /// pages of a transfer. `InvalidArgument` for `size` 0.
    ///
    /// ```
    /// # use efa::Access;
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// let region = domain.register(vec![0u8; 10_000], Access::WRITE)?;
    /// let pages = region.chunks(4096)?;
    /// let lens: Vec<usize> = pages.iter().map(|p| p.len()).collect();
    /// assert_eq!(lens, [4096, 4096, 1808]);
    /// # Ok(()) }
    /// ```
    pub fn chunks(mut self, size: usize) -> Result<Vec<MemoryRegion>> {
        if size == 0 {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "chunks").with_detail("chunk size is 0")
            );
        }
        let mut out = Vec::with_capacity(self.len.div_ceil(size));
        while self.len > size {
            out.push(self.split_to(size)?);
        }
        out.push(self);
        Ok(out)
    }

    /// Joins `other` back onto this slice when both are slices of the same region and `other`
    /// lies right after (or right before) this one, as [`BytesMut::unsplit`] does; an empty
    /// slice takes `other`'s place. Otherwise `other` is handed back untouched.
    pub fn unsplit(&mut self, other: MemoryRegion) -> std::result::Result<(), MemoryRegion> {
        if !Arc::ptr_eq(&self.reg, &other.reg) {
            return Err(other);
        }
        if self.off + self.len == other.off {
            self.len += other.len;
        } else if other.off + other.len == self.off {
            self.off = other.off;
            self.len += other.len;
        } else if self.len == 0 {
            (self.off, self.len) = (other.off, other.len);
        } else if other.len != 0 {
            return Err(other);
        }
        Ok(())
    }

    fn check_split(&self, at: usize, op: &'static str) -> Result<()> {
        if at > self.len {
            return Err(
                Error::new(ErrorKind::InvalidArgument, op).with_detail(format!(
                    "split at {at} is past the end of a slice of {} bytes",
                    self.len
                )),
            );
        }
        Ok(())
    }

    /// Checks that this region may serve as `needed` for an operation of `op`.
    pub(crate) fn check_local(
        &self,
        domain: &Domain,
        needed: Access,
        op: &'static str,
    ) -> Result<()> {
        if !domain.same(&self.reg.domain) {
            return Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail("memory region belongs to another domain"));
        }
        if !self.reg.access.contains(needed) {
            return Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail(format!("memory region lacks {needed:?} access")));
        }
        Ok(())
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("key", &self.reg.key)
            .field("offset", &self.off)
            .field("len", &self.len)
            .field("access", &self.reg.access)
            .field("dmabuf", &self.is_dmabuf())
            .field("device_only", &self.is_device_only())
            .finish()
    }
}
