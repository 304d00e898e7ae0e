//! [`Domain`]: one opened device plus what hangs off it (memory registrations, address vectors,
//! completion queues, endpoints), like a libfabric domain / verbs protection domain.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::config::Config;
use crate::device::{Device, DeviceAttr};
use crate::error::Result;
use crate::info::Info;
use crate::mem::{Access, IntoRegionBuf, KeyTable};

pub(crate) mod mr;
use crate::stats::DeviceStats;
use mr::MemoryRegion;

/// An opened device. Cheap to clone (an `Arc` inside); every child handle keeps its domain alive,
/// so handles may be dropped in any order.
#[derive(Clone)]
pub struct Domain {
    inner: Arc<DomainInner>,
}

struct DomainInner {
    device: Arc<dyn Device>,
    config: Config,
    mrs: Mutex<KeyTable>,
    msg_prefix: bool,
}

impl Domain {
    /// Opens the device an [`Info`] from [`getinfo`](crate::getinfo) describes, with its config.
    ///
    /// An RDM info on a `udp` or `efa` device with `config.enable_shm_transfer` on
    /// (`FI_EFA_ENABLE_SHM_TRANSFER`, the default) gets a
    /// [`RoutedDevice`](crate::device::route::RoutedDevice): peers on this host are reached
    /// over shared memory (`/dev/shm`). [`Domain::with_device`] never wraps.
    #[doc(alias = "fi_domain")]
    #[doc(alias = "fi_fabric")]
    pub fn open(info: &Info) -> Result<Domain> {
        let device = info.open_device()?;
        #[cfg(target_os = "linux")]
        let device = if info.ep_type == crate::info::EpType::Rdm {
            crate::device::route::for_rdm(device, info.config.enable_shm_transfer)
        } else {
            device
        };
        let mut d = Domain::with_device(device, info.config.clone());
        if info.ep_attr.msg_prefix_size > 0 {
            if let Some(inner) = Arc::get_mut(&mut d.inner) {
                inner.msg_prefix = true;
            }
        }
        Ok(d)
    }

    /// A domain on a device opened by hand (tests, custom loopback networks).
    pub fn with_device(device: Arc<dyn Device>, config: Config) -> Domain {
        tracing::debug!(device = %device.attr().name, "domain_open");
        Domain {
            inner: Arc::new(DomainInner {
                device,
                config,
                mrs: Mutex::new(KeyTable::default()),
                msg_prefix: false,
            }),
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.inner.device
    }

    /// The device's attributes.
    pub fn attr(&self) -> &DeviceAttr {
        self.inner.device.attr()
    }

    /// The configuration endpoints of this domain use.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The device's counters.
    pub fn device_stats(&self) -> DeviceStats {
        self.inner.device.stats()
    }

    /// Registers `buf` (its `len()` bytes) with `access` rights. The region owns the buffer.
    ///
    /// The device is asked first ([`Device::register_mem`]): a device with one-sided RDMA hands
    /// out the key its peers use; otherwise the domain makes up a software key. Either way the
    /// key is in this domain's key table until the region is closed or dropped (then it is
    /// revoked in the device too), and is never handed out again by this domain.
    ///
    /// Errors: `InvalidArgument` for an empty buffer or empty access flags; the device's error
    /// if it refuses the registration.
    #[doc(alias = "fi_mr_reg")]
    pub fn register(&self, buf: impl IntoRegionBuf, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::register(self, buf.into_region_buf(), access)
    }

    /// Registers `len` bytes at `offset` of the dmabuf `fd` (GPU memory its driver exported;
    /// any file the CPU can map shared, such as a memfd) with `access` rights. The region works
    /// in every operation a region of [`register`](Domain::register) works in, on every device:
    /// the `efa` device registers the dmabuf itself with its NIC (`ibv_reg_dmabuf_mr`, named by
    /// the mapping's virtual address, as libfabric does), the others serve the CPU mapping of
    /// it. The descriptor is duplicated; the caller keeps its own. [`MemoryRegion::close`] of
    /// such a region unmaps it and gives back an empty buffer (the memory is the dmabuf's, not
    /// the crate's).
    ///
    /// Errors: `InvalidArgument` for `len` 0, empty access flags, an `offset` that is not a
    /// multiple of the page size, a range past the end of the file, or bytes of the file that
    /// another live dmabuf region of this process maps (two regions over the same bytes would
    /// alias their guards: split one region into slices instead); `NotSupported` when the
    /// descriptor cannot be mapped for the CPU ("not CPU-mappable": register it with
    /// [`register_dmabuf_device_only`](Domain::register_dmabuf_device_only)); the device's
    /// error if it refuses the registration.
    ///
    /// ```
    /// # use efa::{Access, Domain};
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    /// // A memfd stands in for GPU memory.
    /// let fd = unsafe { libc::memfd_create(c"gpu".as_ptr(), libc::MFD_CLOEXEC) };
    /// assert!(fd >= 0);
    /// let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    /// std::fs::File::from(fd.try_clone().unwrap()).set_len(8192).unwrap();
    /// let mut mr = domain.register_dmabuf(fd.as_fd(), 4096, 4096, Access::REMOTE_WRITE)?;
    /// assert!(mr.is_dmabuf());
    /// mr.write()[..5].copy_from_slice(b"hello");
    /// assert_eq!(mr.remote_key()?.len, 4096);
    /// assert!(mr.close().is_empty());
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_mr_regattr")]
    #[doc(alias = "FI_HMEM")]
    pub fn register_dmabuf(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        MemoryRegion::register_dmabuf(self, fd, offset, len, access, false)
    }

    /// Registers `len` bytes at `offset` of the dmabuf `fd` **device-only**: with the NIC, which
    /// alone reaches the bytes, and never mapped for the CPU. This is the registration for GPU
    /// memory whose exporter offers no CPU mapping (most of it); libfabric's counterpart is
    /// `fi_mr_regattr` with `FI_MR_DMABUF` on an `FI_HMEM` domain. The descriptor is
    /// duplicated; the caller keeps its own. Only the `efa` device takes it (the software
    /// devices move bytes with the CPU); on a NIC that cannot register the dmabuf it is refused
    /// rather than served through a CPU mapping.
    ///
    /// The region is a [`MemoryRegion`] like the others: it splits into slices, hands out a
    /// [`RemoteKey`](crate::RemoteKey), goes into operations and comes back in their completions.
    /// What moves its bytes without the CPU takes it: device RDMA (`write`, `write_data`,
    /// `read`, with the region as the local buffer or as the target of a peer's RDMA), a send
    /// of it by the long-read protocol (the receiver's NIC reads it; the region needs
    /// `REMOTE_READ`) and a receive into it of a message the engine reads straight into it.
    /// Every path that would copy its bytes with the CPU refuses with `NotSupported` naming
    /// the operation: [`MemoryRegion::try_read`]/[`try_write`](MemoryRegion::try_write) (the
    /// plain guards are empty), eager/medium/long-CTS messages (a receive that gets one
    /// completes with the error), emulated RMA and atomics in either direction (a peer whose
    /// emulated read, delivery-complete write or atomic targets it gets a remote-access error;
    /// nothing is written), scatter/gather lists, the same-host path (build such endpoints with
    /// `local_path(false)`), DGRAM endpoints. See docs/rma.md, "Device-only regions".
    ///
    /// Remote accesses name an address range reserved for the region with no access (nothing
    /// is mapped there). Two device-only regions may cover the same bytes (the same GPU buffer
    /// registered with two NICs).
    ///
    /// Errors: `InvalidArgument` for `len` 0, empty access flags, an `offset` that is not a
    /// multiple of the page size or a range past the end of the file; `NotSupported` on a
    /// device without a NIC that registers dmabufs, or when the NIC refuses this one.
    ///
    /// ```
    /// # use efa::{Access, ErrorKind};
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    /// // A memfd stands in for GPU memory.
    /// let fd = unsafe { libc::memfd_create(c"gpu".as_ptr(), libc::MFD_CLOEXEC) };
    /// assert!(fd >= 0);
    /// let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    /// std::fs::File::from(fd.try_clone().unwrap()).set_len(1 << 20).unwrap();
    /// let access = Access::SEND | Access::RECV | Access::REMOTE_READ | Access::REMOTE_WRITE;
    /// match domain.register_dmabuf_device_only(fd.as_fd(), 0, 1 << 20, access) {
    ///     Ok(mr) => {
    ///         // On the efa device: the NIC has it, the CPU does not.
    ///         assert!(mr.is_device_only());
    ///         assert_eq!(mr.try_read().err().map(|e| e.kind()), Some(ErrorKind::NotSupported));
    ///         let pages = mr.chunks(4096)?; // slices for operations in flight at once
    ///         assert_eq!(pages.len(), 256);
    ///     }
    ///     // The software devices (here loopback) have no NIC to reach device memory.
    ///     Err(e) => assert_eq!(e.kind(), ErrorKind::NotSupported),
    /// }
    /// # Ok(()) }
    /// ```
    #[doc(alias = "FI_MR_DMABUF")]
    pub fn register_dmabuf_device_only(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion> {
        MemoryRegion::register_dmabuf(self, fd, offset, len, access, true)
    }

    /// Checks a remote access (`key`, `addr`, `len`, needed `access`) against this domain's live
    /// registrations: `RemoteAccess` if the key is unknown or revoked, the range is outside the
    /// region or the right was not granted.
    pub fn verify_remote(&self, key: u64, addr: u64, len: u64, access: Access) -> Result<()> {
        crate::mem::verify(&self.inner.mrs, key, addr, len, access)
    }

    /// Writes `data` at `addr` of the region `key` names, as a peer's RMA write does (the
    /// protocol engine's emulated RMA). `RemoteAccess` — and nothing written — if the key is
    /// unknown or revoked, the region lacks `REMOTE_WRITE`, or `addr .. addr + data.len()` is not
    /// inside it; `NotSupported` for a device-only region (the CPU cannot reach it). The copy
    /// happens under the region's lock, which this never waits for: `Again` while it is taken
    /// (a [`MemoryRegion::read`]/[`write`](MemoryRegion::write) guard is alive, or another
    /// access copies) — retry later.
    pub fn remote_write(&self, key: u64, addr: u64, data: &[u8]) -> Result<()> {
        crate::mem::remote_write(&self.inner.mrs, key, addr, data)
    }

    /// The `len` bytes at `addr` of the region `key` names, as a peer's RMA read sees them (the
    /// protocol engine's emulated RMA). `RemoteAccess` if the key is unknown or revoked, the
    /// region lacks `REMOTE_READ`, or the range is not inside it; `NotSupported` for a
    /// device-only region. The copy happens under the region's lock, which this never waits
    /// for: `Again` while a [`write`](MemoryRegion::write) guard is alive — retry later.
    pub fn remote_read(&self, key: u64, addr: u64, len: u64) -> Result<Bytes> {
        crate::mem::remote_read(&self.inner.mrs, key, addr, len)
    }

    /// True when the `Info` this domain was opened from asked for `FI_MSG_PREFIX`
    /// (`Hints::mode(Mode::MSG_PREFIX)`): DGRAM endpoints then default to prefix mode.
    pub fn msg_prefix(&self) -> bool {
        self.inner.msg_prefix
    }

    pub(crate) fn mr_table(&self) -> &Mutex<KeyTable> {
        &self.inner.mrs
    }

    /// True when both handles are the same domain.
    pub fn same(&self, other: &Domain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain")
            .field("device", &self.attr().name)
            .finish()
    }
}
