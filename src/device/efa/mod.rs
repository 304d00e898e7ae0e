//! The `efa` device: AWS Elastic Fabric Adapter hardware through rdma-core (`libibverbs` +
//! `libefa`), behind the cargo feature `efa`.
//!
//! # What it does
//!
//! * **Discovery** ([`EfaDevice::open_all`]): every RDMA device `ibv_get_device_list` lists that
//!   `efadv_query_device` accepts (that is, whose driver is EFA) and `FI_EFA_IFACE` allows, with
//!   its attributes from `ibv_query_device`, `ibv_query_port` (port 1: `max_msg_sz` is the MTU),
//!   `efadv_query_device` (queue depths, SGEs, inline size, RDMA read/write, RNR retry,
//!   unsolicited write-recv, `max_rdma_size`), `ibv_query_gid` (port 1, index 0), and the PCI
//!   address and NUMA node from sysfs, so threads can be placed near the NIC. The conversion to
//!   the seam's [`DeviceAttr`] is the pure [`QueriedDevice::device_attr`]; `FI_EFA_USE_DEVICE_RDMA`
//!   decides the advertised RDMA capabilities ([`apply_use_device_rdma`]).
//! * **Queue pairs** ([`Device::create_qp`]): [`QpType::Srd`] is an SRD QP made with
//!   `efadv_create_qp_ex` (send, send with immediate, and RDMA read / write / write with
//!   immediate where the device and the configuration allow), [`QpType::Ud`] a UD QP; both share
//!   one extended CQ and are brought RESET → INIT (pkey 0, port 1, QKEY) → RTR → RTS (send PSN 0;
//!   the RNR retry count on SRD when the device can set it). The QKEY is [`QpAttr::qkey`] or a
//!   random 31-bit value.
//! * **Data path**: sends build one work request with `ibv_wr_start` / `ibv_wr_send(_imm)` /
//!   `ibv_wr_set_ud_addr` / `ibv_wr_set_sge_list` (or `ibv_wr_set_inline_data_list` up to the
//!   inline size) / `ibv_wr_complete`; receives use `ibv_post_recv`; completions are read with
//!   `ibv_start_poll` / `ibv_next_poll` / `ibv_end_poll`, with the sender's QPN and address handle
//!   number (mapped back to its GID through the device's address-handle cache, or read with
//!   `efadv_wc_read_sgid` for senders without one) and the immediate data.
//! * **Memory**: each queue pair copies through registered bounce buffers it owns (see the `mr`
//!   module docs: every address given to the NIC lies in memory the queue pair owns and has
//!   registered); one-sided reads and writes register the caller's buffer for the duration of the
//!   operation. [`EfaDevice::register`] and [`EfaDevice::register_dmabuf`] make registrations
//!   peers can target (GPU memory through a dmabuf file descriptor).
//! * **Bookkeeping**: every work request gets a token (`wr_id` = slab key + generation) naming
//!   what it owns; its completion hands that back exactly once. Stale or unknown tokens from the
//!   CQ are ignored and counted ([`EfaDevice::stray_completions`]). [`QueuePair::close`] moves the
//!   QP to ERR, lets outstanding sends complete for up to 50 ms, destroys the QP (after which the
//!   NIC touches nothing) and completes the rest with [`Status::Flushed`].
//! * **Statuses**: `vendor_err` is the EFA status code (0–18) and becomes the seam's [`Status`]
//!   ([`status_from_wc`]); unknown codes become [`Status::LocalQpInternalError`], never a panic.
//! * **UD receives**: the NIC writes a 40-byte GRH in front of every datagram; receive buffers are
//!   40 bytes larger and the GRH is stripped, so a receive completion holds exactly the datagram.
//! * **Waiting**: each CQ gets a completion channel where the device supports CQ notifications;
//!   a small thread turns its events into [`Notifier`](crate::notify::Notifier) signals, so
//!   blocking and async waits on completion queues wake up. On devices without CQ notifications
//!   (libefa refuses a channel) a thread per queue pair signals the notifier every millisecond
//!   while a waiter sleeps, so the waiter polls again: waits return within about a millisecond of
//!   a completion. A busy-polling program arms neither.
//!
//! # Linking
//!
//! `rdma-sys` links `libibverbs` (found with pkg-config); the `efadv_*` functions, which `rdma-sys`
//! does not bind, are declared here and link `libefa` (`#[link(name = "efa")]`), which rdma-core
//! installs next to `libibverbs`. The crate needs **rdma-core 43 or newer**: it links
//! `efadv_create_cq` and `efadv_cq_from_ibv_cq_ex` (symbol version `EFA_1.2`, rdma-core 43) and
//! `ibv_reg_dmabuf_mr` (`IBVERBS_1.12`, rdma-core 34); an older libefa fails at load time, naming
//! the missing symbol. Struct layouts follow the `efadv.h` of that version and are passed with
//! their size, so newer libefa accepts them too.
//!
//! Nothing here has run on a NIC: the data path is unit-tested against a fake NIC. See
//! `docs/efa-hardware.md`.

#![allow(unsafe_code)]

mod ah;
mod cq;
mod discovery;
mod ffi;
mod fork;
mod mr;
mod nic;
mod qp;
mod qp_state;
mod status;
mod verbs;
mod verbs_nic;
mod wr;

/// The efa device in the registry: one device per NIC rdma-core lists (and `FI_EFA_IFACE`
/// allows). A configuration error (`FI_EFA_USE_DEVICE_RDMA=1` without RDMA) fails `getinfo`,
/// as in libfabric; NICs that fail to open are skipped with a warning.
pub(crate) const PROVIDER: super::registry::Provider = super::registry::Provider {
    kind: crate::device::DeviceKind::Efa,
    discover: |q| {
        use super::registry::Discovery;
        match EfaDevice::open_all(q.config) {
            Err(e) => Discovery::Fatal(e),
            Ok(found) if found.is_empty() => Discovery::Nothing("no EFA device found"),
            Ok(found) => Discovery::Found(
                found
                    .into_iter()
                    .map(|d| {
                        let spec = super::spec::DeviceSpec::Efa {
                            name: d.attr().name.clone(),
                            use_device_rdma: q.config.use_device_rdma,
                        };
                        (spec, d as std::sync::Arc<dyn Device>)
                    })
                    .collect(),
            ),
        }
    },
};

#[cfg(test)]
mod fake;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::BytesMut;

pub use discovery::{
    EfadvAttrs, IbvDeviceAttrs, PORT_ACTIVE, PortAttrs, QueriedDevice, SYSFS_CLASS,
    apply_use_device_rdma, is_pci_addr, sysfs_location,
};
pub use fork::ForkSupport;
pub use mr::{MrCacheLimits, ibv_access};
pub use status::{opcode_from_wc, status_from_vendor_err, status_from_wc};
pub use verbs::{EfaMr, device_names};

use crate::config::Config;
use crate::device::{Device, DeviceAttr, QpAttr, QpType, QueuePair, RemoteIov, random_qkey};
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{Access, RegionMem};
use crate::stats::{self, DeviceCounters, DeviceStats};

#[cfg(doc)]
use crate::device::Status;

/// Bytes of the Global Routing Header the NIC writes in front of every datagram received on a UD
/// queue pair (libfabric's `FI_MSG_PREFIX` size for EFA DGRAM).
pub const GRH_LEN: usize = 40;

pub use crate::device::UNSOLICITED_WR_ID;

/// An error of verb `op` that failed with `errno`, with the OS error as its source.
pub(crate) fn verbs_error(op: &'static str, errno: i32) -> Error {
    let kind = match errno {
        11 => ErrorKind::Again,
        12 => ErrorKind::NoMemory,
        16 => ErrorKind::Busy,
        22 => ErrorKind::InvalidArgument,
        38 | 95 => ErrorKind::NotSupported,
        _ => ErrorKind::Io,
    };
    Error::new(kind, op).with_source(std::io::Error::from_raw_os_error(errno))
}

/// An EFA NIC, opened: its context, protection domain, address handles and attributes. Queue
/// pairs hold it (by `Arc`) until they are dropped.
pub struct EfaDevice {
    attr: DeviceAttr,
    queried: QueriedDevice,
    shared: Arc<verbs::Shared>,
    counters: Arc<DeviceCounters>,
    strays: Arc<AtomicU64>,
    /// The NIC registrations of domain regions ([`Device::register_mem`]), by rkey.
    regions: parking_lot::Mutex<std::collections::HashMap<u64, (EfaMr, Arc<RegionMem>)>>,
    /// The local keys of `regions`, shared with the queue pairs (region RDMA).
    local_keys: Arc<mr::LocalKeys>,
    /// Registrations of RDMA write buffers, shared with the queue pairs.
    mr_cache: Arc<mr::MrCache<EfaMr>>,
    /// Queue pairs' bounce pools go on huge pages when there are any (`FI_EFA_USE_HUGE_PAGE`).
    huge_pages: bool,
    /// Entries of a queue pair's CQ with unsolicited write-recv, at least (`FI_EFA_CQ_SIZE`).
    cq_size: usize,
}

impl std::fmt::Debug for EfaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EfaDevice")
            .field("name", &self.attr.name)
            .field("gid", &self.attr.gid)
            .field("pci_addr", &self.attr.pci_addr)
            .finish_non_exhaustive()
    }
}

impl EfaDevice {
    /// Opens the EFA device `name` (e.g. `rdmap0s6`), with device RDMA as
    /// `FI_EFA_USE_DEVICE_RDMA` (`use_device_rdma`) allows.
    ///
    /// Errors: `NoData` when there is no such device, `NotSupported` when it is not an EFA
    /// device, `Config` for `use_device_rdma = Some(true)` without RDMA read, and the verb that
    /// failed otherwise.
    pub fn open(name: &str, use_device_rdma: Option<bool>) -> Result<Arc<EfaDevice>> {
        // FI_EFA_FORK_SAFE and FI_EFA_USE_HUGE_PAGE from the environment.
        let env = Config::from_env().unwrap_or_default();
        EfaDevice::open_with(name, use_device_rdma, &env)
    }

    /// [`EfaDevice::open`] with fork safety, huge pages and the MR cache as `config` says (what
    /// a domain opened from an `Info` uses: the configuration the `Info` carries, not the
    /// environment).
    pub fn open_configured(
        name: &str,
        use_device_rdma: Option<bool>,
        config: &Config,
    ) -> Result<Arc<EfaDevice>> {
        EfaDevice::open_with(name, use_device_rdma, config)
    }

    fn open_with(
        name: &str,
        use_device_rdma: Option<bool>,
        config: &Config,
    ) -> Result<Arc<EfaDevice>> {
        // Before anything is registered: ibv_fork_init must come first (see `fork`).
        let fork = fork::prepare(config.fork_safe);
        let ctx = verbs::Context::open(name)?;
        let queried = ctx.query()?;
        let attr = queried.device_attr(use_device_rdma)?;
        if queried.port.state != PORT_ACTIVE {
            tracing::warn!(
                device = name,
                state = queried.port.state,
                "efa: port 1 is not active"
            );
        }
        let shared = verbs::Shared::new(&ctx)?;
        let cache_limits = mr::MrCacheLimits::from_config(config, queried.device.max_mr_size);
        tracing::debug!(device = name, gid = %attr.gid, mtu = attr.mtu, caps = ?attr.caps, ?fork, "efa: device opened");
        Ok(Arc::new(EfaDevice {
            attr,
            queried,
            shared,
            counters: Arc::new(DeviceCounters::default()),
            strays: Arc::new(AtomicU64::new(0)),
            regions: parking_lot::Mutex::new(std::collections::HashMap::new()),
            local_keys: Arc::default(),
            mr_cache: Arc::new(mr::MrCache::new(cache_limits)),
            huge_pages: config.huge_pages(),
            cq_size: config.cq_size,
        }))
    }

    /// Opens every EFA device `config.iface` (`FI_EFA_IFACE`) allows, in rdma-core's order.
    /// RDMA devices that are not EFA are skipped, as are devices that fail to open (with a
    /// warning). No device at all is an empty list, not an error.
    ///
    /// Errors: a `Config` error (`FI_EFA_USE_DEVICE_RDMA=1` on a device without RDMA read).
    pub fn open_all(config: &Config) -> Result<Vec<Arc<EfaDevice>>> {
        let mut out = Vec::new();
        for name in device_names() {
            if !config.iface_allows(&name) {
                continue;
            }
            match EfaDevice::open_with(&name, config.use_device_rdma, config) {
                Ok(d) => out.push(d),
                Err(e) if e.kind() == ErrorKind::Config => return Err(e),
                Err(e) if e.kind() == ErrorKind::NotSupported => {
                    tracing::debug!(device = %name, error = %e, "efa: not an EFA device; skipped");
                }
                Err(e) => {
                    tracing::warn!(device = %name, error = %e, "efa: cannot open device; skipped")
                }
            }
        }
        Ok(out)
    }

    /// The process's fork support as found when the first device opened (and turned on then
    /// if `FI_EFA_FORK_SAFE`, `RDMAV_FORK_SAFE` or `IBV_FORK_SAFE` asked for it).
    pub fn fork_support(&self) -> ForkSupport {
        fork::status().unwrap_or(ForkSupport::Disabled)
    }

    /// What discovery learned about the device.
    pub fn queried(&self) -> &QueriedDevice {
        &self.queried
    }

    /// Address handles: (cached now, created so far, evicted so far).
    pub fn address_handle_counts(&self) -> (usize, u64, u64) {
        let c = self.shared.ahs.lock();
        let (created, evicted) = c.counts();
        (c.len(), created, evicted)
    }

    /// Completions the device reported for no outstanding work request (ignored), over all its
    /// queue pairs.
    pub fn stray_completions(&self) -> u64 {
        self.strays.load(Ordering::Relaxed)
    }

    /// Registers `len` bytes at `offset` of the dmabuf `fd` (GPU memory exported by its driver)
    /// with `access` rights (`ibv_reg_dmabuf_mr`). `addr` is the address the program names the
    /// first byte by (the buffer's virtual address, a GPU pointer for device memory): it is the
    /// registration's IOVA, so peers address the memory by it, as libfabric's EFA provider
    /// registers dmabufs (`iova = iov_base`), never by the offset in the dmabuf. Deregistered
    /// when the returned [`EfaMr`] is dropped.
    ///
    /// # Safety
    ///
    /// The NIC (and, with remote rights, any peer holding the rkey) may read and write the
    /// memory while the registration lives. The memory must not be memory Rust code in this
    /// process holds references to (for instance through an `mmap` of the same dmabuf).
    pub unsafe fn register_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        addr: u64,
        access: Access,
    ) -> Result<EfaMr> {
        if len == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "ibv_reg_dmabuf_mr")
                .with_detail("empty range"));
        }
        // SAFETY: forwarded contract; the kernel checks fd, offset and length.
        unsafe {
            self.shared
                .pd
                .reg_dmabuf_mr(fd.as_raw_fd(), offset, len, addr, ibv_access(access))
        }
    }

    /// Registers `buf` (its `len()` bytes) with `access` rights, so peers can target it with RDMA
    /// (describe it with [`EfaRegion::remote_iov`]). The region owns the buffer; get it back with
    /// [`EfaRegion::into_inner`], which deregisters first.
    pub fn register(&self, mut buf: BytesMut, access: Access) -> Result<EfaRegion> {
        if buf.is_empty() {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "ibv_reg_mr").with_detail("empty buffer")
            );
        }
        let len = buf.len();
        // SAFETY: the region owns `buf` and offers no access to its bytes while registered; it is
        // deregistered before the buffer is released (field order, `into_inner`).
        let mr = unsafe {
            self.shared
                .pd
                .reg_mr(buf.as_mut_ptr(), len, ibv_access(access))
        }?;
        Ok(EfaRegion { mr: Some(mr), buf })
    }
}

/// A buffer registered on an efa device (from [`EfaDevice::register`]). Its bytes are not
/// accessible while it is registered (the NIC and peers may write them); [`into_inner`]
/// deregisters and gives the buffer back.
///
/// [`into_inner`]: EfaRegion::into_inner
#[derive(Debug)]
pub struct EfaRegion {
    /// Dropped before `buf` (declaration order).
    mr: Option<EfaMr>,
    buf: BytesMut,
}

impl EfaRegion {
    /// The registration (keys).
    pub fn mr(&self) -> Option<&EfaMr> {
        self.mr.as_ref()
    }

    /// What a peer needs to read or write the whole region: address, length, rkey.
    pub fn remote_iov(&self) -> RemoteIov {
        RemoteIov {
            addr: self.buf.as_ptr() as u64,
            len: self.buf.len() as u64,
            key: self.mr.as_ref().map_or(0, |m| u64::from(m.rkey())),
        }
    }

    /// Deregisters (after which neither the NIC nor a peer can touch the memory) and returns the
    /// buffer.
    pub fn into_inner(self) -> BytesMut {
        let EfaRegion { mr, buf } = self;
        drop(mr);
        buf
    }
}

impl Device for EfaDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn create_qp(&self, attr: QpAttr) -> Result<Box<dyn QueuePair>> {
        attr.check()?;
        let a = &self.attr;
        let qkey = attr.qkey.unwrap_or_else(random_qkey);
        if qkey & 0x8000_0000 != 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "create_qp")
                .with_detail(format!("QKEY {qkey:#x} has the high (controlled) bit set")));
        }
        let send_depth = fit_depth(attr.send_depth, a.max_send_wr);
        let mut recv_depth = fit_depth(attr.recv_depth, a.max_recv_wr);
        // Both queues complete into one CQ, which must hold them all (libefa rounds its depth up
        // to a power of two, which the kernel checks against the maximum, as for queues).
        let max_cqe = match self.queried.device.max_cqe as usize {
            0 => usize::MAX,
            m => m,
        };
        let fit = fit_depth(send_depth + recv_depth, max_cqe);
        if send_depth + recv_depth > fit {
            let lower = fit.saturating_sub(send_depth).max(1);
            tracing::debug!(
                recv_depth,
                lower,
                max_cqe,
                "efa: receive depth lowered to fit the CQ"
            );
            recv_depth = lower;
        }
        let srd = attr.qp_type == QpType::Srd;
        let caps = if srd {
            a.caps
        } else {
            crate::device::DeviceCaps {
                rnr_retry: a.caps.rnr_retry,
                ..Default::default()
            }
        };
        let unsolicited = caps.unsolicited_write_recv
            && caps.rdma_write
            && attr.unsolicited_write_recv.unwrap_or(true);
        let spec = verbs_nic::QpSpec {
            qp_type: attr.qp_type,
            send_depth: u32::try_from(send_depth).unwrap_or(u32::MAX),
            recv_depth: u32::try_from(recv_depth).unwrap_or(u32::MAX),
            max_send_sge: u32::try_from(a.max_sge.clamp(1, 2)).unwrap_or(1),
            max_inline: u32::try_from(a.inline_size).unwrap_or(0),
            rdma_read: caps.rdma_read,
            rdma_write: caps.rdma_write,
            unsolicited_write_recv: unsolicited,
            cq_depth: u32::try_from(cq_depth(
                send_depth,
                recv_depth,
                unsolicited.then_some(self.cq_size),
                max_cqe,
            ))
            .unwrap_or(u32::MAX),
            cq_with_sgid: self.queried.efa.cq_with_sgid(),
            qkey,
            rnr_retry: attr.rnr_retry,
            rnr_retry_modifiable: a.caps.rnr_retry,
        };
        let nic = verbs_nic::VerbsNic::create(&self.shared, &spec, &attr.notifier)?;
        let qpn = u16::try_from(nic.qpn()).map_err(|_| {
            Error::new(ErrorKind::NotSupported, "create_qp").with_detail(format!(
                "QPN {} does not fit the 16-bit EFA address",
                nic.qpn()
            ))
        })?;
        let caps = crate::device::DeviceCaps {
            unsolicited_write_recv: caps.unsolicited_write_recv && nic.unsolicited(),
            ..caps
        };
        let limits = qp::QpLimits {
            mtu: a.mtu,
            inline_size: a.inline_size,
            send_depth,
            recv_depth,
            caps,
            max_rdma_size: if srd { a.max_rdma_size } else { 0 },
            huge_pages: self.huge_pages,
        };
        let addr = crate::addr::RawAddr::new(a.gid, qpn, qkey);
        let mut qp = qp::EfaQp::new(
            nic,
            addr,
            attr.qp_type,
            limits,
            attr.notifier,
            self.counters.clone(),
            self.strays.clone(),
        )?;
        qp.set_local_keys(self.local_keys.clone());
        qp.set_mr_cache(self.mr_cache.clone());
        tracing::debug!(%addr, qp_type = ?attr.qp_type, send_depth, recv_depth, "efa: queue pair created");
        Ok(Box::new(qp))
    }

    fn stats(&self) -> DeviceStats {
        let mut s = self.counters.snapshot();
        s.dereg_failures = self
            .shared
            .pd
            .dereg_failures
            .load(std::sync::atomic::Ordering::Relaxed);
        s
    }

    /// Registers a domain region with the NIC (iova = its address, as `RemoteKey::addr` names
    /// it), asking only for the remote rights the device has (a device with RDMA read but not
    /// write refuses `REMOTE_WRITE`), and hands out the NIC's rkey. Without device RDMA the
    /// domain makes up a software key (`Ok(None)`).
    fn register_mem(&self, mem: &Arc<RegionMem>, access: Access) -> Result<Option<u64>> {
        let caps = self.attr.caps;
        if !caps.rdma_read && !caps.rdma_write {
            return Ok(None);
        }
        match self.register_with_nic(mem, access) {
            Ok(key) => Ok(Some(key)),
            Err(e) if mem.dmabuf_fd().is_some() => {
                // No peer-to-peer path from the NIC to this memory (libfabric's non-p2p HMEM):
                // the domain gives the region a software key and serves it through the CPU
                // mapping with the emulated protocols; no read key of it is ever advertised.
                stats::inc(&self.counters.dmabuf_fallbacks);
                tracing::warn!(error = %e, "efa: the NIC cannot register this dmabuf (ibv_reg_dmabuf_mr takes only a dma-buf, and needs a peer-to-peer path to its memory); it is served through its CPU mapping with emulated RMA (DeviceStats::dmabuf_fallbacks)");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Registers device-only memory: the dmabuf itself, with no fallback (nothing else can
    /// reach its bytes). `NotSupported` without device RDMA, or when the NIC refuses the dmabuf.
    fn register_device_mem(&self, mem: &Arc<RegionMem>, access: Access) -> Result<u64> {
        const OP: &str = "register_dmabuf_device_only";
        let caps = self.attr.caps;
        if !caps.rdma_read && !caps.rdma_write {
            return Err(Error::new(ErrorKind::NotSupported, OP).with_detail(
                "this EFA device has neither RDMA read nor RDMA write: nothing could move a \
                 device-only region's bytes",
            ));
        }
        if mem.dmabuf_fd().is_none() || !mem.is_device_only() {
            return Err(Error::new(ErrorKind::InvalidArgument, OP)
                .with_detail("not device-only dmabuf memory"));
        }
        self.register_with_nic(mem, access).map_err(|e| {
            Error::new(ErrorKind::NotSupported, OP)
                .with_detail(format!(
                    "the NIC cannot register this dmabuf (ibv_reg_dmabuf_mr takes only a \
                     dma-buf with a peer-to-peer path to the NIC), and a device-only region \
                     has no CPU mapping to fall back on: {e}"
                ))
                .with_source(e)
        })
    }

    /// `efadv_query_mr` of the registration `key` (rdma-core 50 on; `NotSupported` with an older
    /// libefa, `InvalidArgument` for a key this device did not register).
    fn query_mem(&self, key: u64) -> Result<crate::device::MrQuery> {
        use ffi::{
            EFADV_MR_ATTR_VALIDITY_RDMA_READ_IC_ID, EFADV_MR_ATTR_VALIDITY_RDMA_RECV_IC_ID,
            EFADV_MR_ATTR_VALIDITY_RECV_IC_ID,
        };
        let Some(query) = ffi::efadv_query_mr() else {
            return Err(Error::new(ErrorKind::NotSupported, "query_mr").with_detail(
                "this libefa has no efadv_query_mr (it needs rdma-core 50 or later)",
            ));
        };
        let regions = self.regions.lock();
        let Some((mr, _)) = regions.get(&key) else {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "query_mr").with_detail(format!(
                    "key {key:#x} is no registration of {}",
                    self.attr.name
                )),
            );
        };
        let mut a = ffi::efadv_mr_attr::default();
        // SAFETY: a live registration of this device (held under the lock, so not deregistered
        // meanwhile) and a struct of the size given.
        let rc = unsafe {
            query(
                mr.as_ptr(),
                &mut a,
                std::mem::size_of::<ffi::efadv_mr_attr>() as u32,
            )
        };
        if rc != 0 {
            return Err(Error::io(
                "efadv_query_mr",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        let valid = |bit: u16, id: u16| (a.ic_id_validity & bit != 0).then_some(id);
        Ok(crate::device::MrQuery {
            recv_ic_id: valid(EFADV_MR_ATTR_VALIDITY_RECV_IC_ID, a.recv_ic_id),
            rdma_read_ic_id: valid(EFADV_MR_ATTR_VALIDITY_RDMA_READ_IC_ID, a.rdma_read_ic_id),
            rdma_recv_ic_id: valid(EFADV_MR_ATTR_VALIDITY_RDMA_RECV_IC_ID, a.rdma_recv_ic_id),
        })
    }

    fn deregister_mem(&self, key: u64) {
        // Forget the local key first (a queue pair posts under this lock), then drop the
        // registration: `ibv_dereg_mr`, after which the NIC serves the key no more.
        self.local_keys.0.lock().remove(&key);
        let removed = self.regions.lock().remove(&key);
        if let Some((mr, mem)) = removed {
            release_region(mr, mem);
        }
    }
}

impl EfaDevice {
    /// Registers `mem` with the NIC (a dmabuf as itself, named by `mem.addr()` as its iova, as
    /// libfabric registers dmabufs; other memory at its address) with the remote rights of
    /// `access` the device has, and records the registration; the NIC's rkey.
    fn register_with_nic(&self, mem: &Arc<RegionMem>, access: Access) -> Result<u64> {
        let caps = self.attr.caps;
        let mut want = Access::RECV; // LOCAL_WRITE: the target of reads and of peers' writes
        if access.contains(Access::REMOTE_READ) && caps.rdma_read {
            want |= Access::REMOTE_READ;
        }
        if access.contains(Access::REMOTE_WRITE) && caps.rdma_write {
            want |= Access::REMOTE_WRITE;
        }
        // SAFETY: the region's buffer (or its dmabuf, mapped at `mem.addr()` or device-only)
        // stays there for `mem.len()` bytes until the region is closed, and a region is
        // deregistered here (`deregister_mem`) before its memory is handed back or unmapped
        // (`MemoryRegion::revoke`); the Arc kept beside the registration keeps the `RegionMem`
        // alive as long. A dmabuf is registered as itself: the NIC reaches its pages, never
        // through `mem.addr()` (for device-only memory an address range with nothing behind it).
        let mr = unsafe {
            match mem.dmabuf_fd() {
                Some((fd, offset)) => self.shared.pd.reg_dmabuf_mr(
                    fd.as_raw_fd(),
                    offset,
                    mem.len(),
                    mem.addr(),
                    ibv_access(want),
                ),
                None => self.shared.pd.reg_mr(
                    mem.addr() as usize as *mut u8,
                    mem.len(),
                    ibv_access(want),
                ),
            }
        }?;
        let key = u64::from(mr.rkey());
        tracing::debug!(
            key,
            len = mem.len(),
            ?want,
            dmabuf = mem.dmabuf_fd().is_some(),
            device_only = mem.is_device_only(),
            "efa: region registered with the NIC"
        );
        stats::inc(&self.counters.mem_registrations);
        if mem.dmabuf_fd().is_some() {
            stats::inc(&self.counters.dmabuf_registrations);
        }
        let local = mr::LocalKey {
            lkey: mr.lkey(),
            addr: mem.addr(),
            len: mem.len(),
        };
        self.regions.lock().insert(key, (mr, mem.clone()));
        self.local_keys.0.lock().insert(key, local);
        Ok(key)
    }
}

/// Deregisters a region's registration; when the NIC refuses (it may still use the memory), the
/// region's memory is leaked: never freed, and `MemoryRegion::close` hands back nothing.
fn release_region<M: nic::Registration>(mut mr: M, mem: Arc<RegionMem>) {
    if mr.deregister() {
        drop(mem);
    } else {
        mem.leak();
    }
}

/// A queue depth the NIC takes: libefa rounds a depth up to a power of two and the kernel checks
/// the rounded depth against the device's maximum, so where the maximum is not a power of two,
/// a depth that rounds past it becomes the largest power of two within it (as libfabric rounds
/// its sizes down).
fn fit_depth(want: usize, max: usize) -> usize {
    let max = max.max(1);
    let want = want.clamp(1, max);
    match want.checked_next_power_of_two() {
        Some(p) if p <= max => want,
        _ => 1 << max.ilog2(),
    }
}

/// The entries of a queue pair's CQ. Every send and every posted receive completes once into
/// it; with unsolicited write-recv (`unsolicited`: the configured `FI_EFA_CQ_SIZE`), a peer's
/// RDMA writes with immediate data complete into it too without taking a receive, so nothing
/// bounds them but polling: the CQ gets at least `FI_EFA_CQ_SIZE` entries, as libfabric sizes
/// its CQs, within the device's maximum. A real CQ that overflows loses completions.
fn cq_depth(send: usize, recv: usize, unsolicited: Option<usize>, max_cqe: usize) -> usize {
    let want = (send + recv).max(unsolicited.unwrap_or(0));
    fit_depth(want, max_cqe)
}

#[cfg(test)]
mod depth_tests {
    #[test]
    fn depths_round_down_only_past_a_maximum_that_is_no_power_of_two() {
        use super::fit_depth;
        assert_eq!(fit_depth(1000, 4096), 1000, "libefa's rounding (1024) fits");
        assert_eq!(fit_depth(1000, 1000), 512);
        assert_eq!(fit_depth(3000, 3000), 2048);
        assert_eq!(fit_depth(1024, 1000), 512);
        assert_eq!(fit_depth(0, 1000), 1);
        assert_eq!(fit_depth(5, 0), 1);
        assert_eq!(fit_depth(usize::MAX, usize::MAX), 1 << (usize::BITS - 1));
    }

    #[test]
    fn a_cq_with_unsolicited_writes_holds_at_least_the_configured_size() {
        use super::cq_depth;
        assert_eq!(cq_depth(8, 8, None, 32768), 16);
        assert_eq!(cq_depth(8, 8, Some(8192), 32768), 8192);
        assert_eq!(
            cq_depth(8, 8, Some(8192), 5000),
            4096,
            "within the device's maximum"
        );
        assert_eq!(cq_depth(4096, 8192, Some(8192), 32768), 4096 + 8192);
    }
}
