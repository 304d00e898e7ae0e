//! The rdma-core objects behind the efa device, each an RAII handle holding its parent by `Arc`:
//! context ← protection domain ← address handles and memory registrations (the CQ and QP are in
//! [`cq`](super::cq) and [`verbs_nic`](super::verbs_nic)).
//!
//! Every verb that can fail is checked; a failure becomes an [`Error`] naming the verb. A
//! destroy/deregister verb that fails in `Drop` is logged (it can only fail on a programming
//! error such as destroying a PD that still has children, which the `Arc` chain rules out).

use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use rdma_sys::{
    ibv_ah, ibv_ah_attr, ibv_context, ibv_device, ibv_device_attr, ibv_gid, ibv_mr, ibv_pd,
    ibv_port_attr,
};

use super::ah::{AhCache, AhFactory, gid_from_ibv, gid_to_ibv};
use super::discovery::{EfadvAttrs, IbvDeviceAttrs, PortAttrs, QueriedDevice, sysfs_location};
use super::ffi::{self, errno};
use super::nic::Registration;
use super::verbs_error;
use crate::addr::Gid;
use crate::error::{Error, ErrorKind, Result};

/// The AHN an EFA receive completion carries when the sender has no address handle here.
pub const AHN_UNKNOWN: u32 = 0xffff;
/// Most address handles kept cached (idle ones beyond this are destroyed).
const AH_CACHE_BOUND: usize = 4096;

fn c_name(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: rdma-core returns NUL-terminated names that live as long as the device list.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

// ---------------------------------------------------------------------------------------------
// Device list and context
// ---------------------------------------------------------------------------------------------

/// `ibv_get_device_list`, freed on drop.
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    /// The RDMA devices of this host; empty when there are none or the kernel has no RDMA.
    fn get() -> Option<DeviceList> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the result is null or a list of `n` devices.
        let list = unsafe { rdma_sys::ibv_get_device_list(&mut n) };
        match NonNull::new(list) {
            Some(list) => Some(DeviceList {
                list,
                len: usize::try_from(n).unwrap_or(0),
            }),
            None => {
                tracing::debug!(errno = errno(), "efa: ibv_get_device_list returned no list");
                None
            }
        }
    }

    fn devices(&self) -> impl Iterator<Item = (String, *mut ibv_device)> + '_ {
        (0..self.len).filter_map(|i| {
            // SAFETY: `i < len`, the list holds `len` valid entries while `self` lives.
            let d = unsafe { *self.list.as_ptr().add(i) };
            if d.is_null() {
                return None;
            }
            // SAFETY: `d` is a device of the live list.
            Some((c_name(unsafe { rdma_sys::ibv_get_device_name(d) }), d))
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: obtained from `ibv_get_device_list`, freed once.
        unsafe { rdma_sys::ibv_free_device_list(self.list.as_ptr()) };
    }
}

/// Names of the RDMA devices of this host (EFA or not); empty without RDMA.
pub fn device_names() -> Vec<String> {
    DeviceList::get()
        .map(|l| l.devices().map(|(n, _)| n).collect())
        .unwrap_or_default()
}

/// An opened device (`ibv_context`), closed on drop.
pub struct Context {
    ctx: NonNull<ibv_context>,
    name: String,
}

// SAFETY: an `ibv_context` may be used from any thread; rdma-core locks internally. It is only
// closed in `Drop`, when no child object (each holds an `Arc<Context>`) is left.
unsafe impl Send for Context {}
// SAFETY: as above; every verb taking a context is thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// Opens device `name`.
    pub fn open(name: &str) -> Result<Arc<Context>> {
        let list = DeviceList::get().ok_or_else(|| {
            Error::new(ErrorKind::NoData, "ibv_get_device_list").with_detail(format!(
                "no RDMA devices (looking for {name}); is the efa kernel module loaded?"
            ))
        })?;
        let (_, dev) = list.devices().find(|(n, _)| n == name).ok_or_else(|| {
            Error::new(ErrorKind::NoData, "ibv_open_device")
                .with_detail(format!("no RDMA device named {name}"))
        })?;
        // SAFETY: `dev` belongs to the live list; opening does not need the list afterwards.
        let ctx = unsafe { rdma_sys::ibv_open_device(dev) };
        let ctx = NonNull::new(ctx)
            .ok_or_else(|| verbs_error("ibv_open_device", errno()).with_detail(name.to_string()))?;
        Ok(Arc::new(Context {
            ctx,
            name: name.to_string(),
        }))
    }

    /// The raw context.
    pub fn as_ptr(&self) -> *mut ibv_context {
        self.ctx.as_ptr()
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Everything discovery needs: `efadv_query_device` (which fails with `NotSupported` on a
    /// device that is not EFA), `ibv_query_device`, `ibv_query_port(1)`, `ibv_query_gid(1, 0)`,
    /// and the PCI address and NUMA node from sysfs.
    pub fn query(&self) -> Result<QueriedDevice> {
        let ctx = self.as_ptr();
        let mut efa = ffi::efadv_device_attr::default();
        // SAFETY: valid context and out-struct of the size passed.
        let rc =
            unsafe { ffi::efadv_query_device(ctx, &mut efa, std::mem::size_of_val(&efa) as u32) };
        if rc != 0 {
            return Err(Error::new(ErrorKind::NotSupported, "efadv_query_device")
                .with_detail(format!("{} is not an EFA device (errno {rc})", self.name)));
        }
        let mut dev = MaybeUninit::<ibv_device_attr>::zeroed();
        // SAFETY: valid context; the struct is plain data, zeroed, filled by the call.
        let rc = unsafe { rdma_sys::ibv_query_device(ctx, dev.as_mut_ptr()) };
        if rc != 0 {
            return Err(verbs_error("ibv_query_device", rc));
        }
        // SAFETY: zero-initialised plain data, then filled by the verb.
        let dev = unsafe { dev.assume_init() };
        let mut port = MaybeUninit::<ibv_port_attr>::zeroed();
        // SAFETY: valid context; the provider is told the struct size (ffi::query_port).
        let rc = unsafe { super::ffi::query_port(ctx, 1, port.as_mut_ptr()) };
        if rc != 0 {
            return Err(verbs_error("ibv_query_port", rc).with_detail("port 1"));
        }
        // SAFETY: as above.
        let port = unsafe { port.assume_init() };
        let mut gid = ibv_gid { raw: [0; 16] };
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { rdma_sys::ibv_query_gid(ctx, 1, 0, &mut gid) };
        if rc != 0 {
            return Err(verbs_error("ibv_query_gid", errno()).with_detail("port 1, index 0"));
        }
        let fw: Vec<u8> = dev
            .fw_ver
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        // Under SYSFS_PATH, as rdma-core reads the tree (the emulated NIC's fake one).
        let class = crate::topo::sysfs_root().join("class/infiniband");
        let (pci_addr, numa_node) = sysfs_location(&class, &self.name);
        let nonneg = |v: c_int| u32::try_from(v).unwrap_or(0);
        Ok(QueriedDevice {
            name: self.name.clone(),
            device: IbvDeviceAttrs {
                fw_ver: String::from_utf8_lossy(&fw).into_owned(),
                vendor_id: dev.vendor_id,
                vendor_part_id: dev.vendor_part_id,
                max_qp: nonneg(dev.max_qp),
                max_qp_wr: nonneg(dev.max_qp_wr),
                max_cq: nonneg(dev.max_cq),
                max_cqe: nonneg(dev.max_cqe),
                max_mr_size: dev.max_mr_size,
                max_ah: nonneg(dev.max_ah),
                phys_port_cnt: dev.phys_port_cnt,
            },
            port: PortAttrs {
                state: port.state,
                max_msg_sz: port.max_msg_sz,
                link_layer: port.link_layer,
            },
            efa: EfadvAttrs {
                max_sq_wr: efa.max_sq_wr,
                max_rq_wr: efa.max_rq_wr,
                max_sq_sge: efa.max_sq_sge,
                max_rq_sge: efa.max_rq_sge,
                inline_buf_size: efa.inline_buf_size,
                device_caps: efa.device_caps,
                max_rdma_size: efa.max_rdma_size,
            },
            gid: gid_from_ibv(&gid),
            pci_addr,
            numa_node,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once; every child holds an `Arc<Context>`, so none is left.
        let rc = unsafe { rdma_sys::ibv_close_device(self.ctx.as_ptr()) };
        if rc != 0 {
            tracing::error!(device = %self.name, rc, "efa: ibv_close_device failed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Protection domain, address handles, memory registrations
// ---------------------------------------------------------------------------------------------

/// A protection domain, deallocated on drop.
pub struct Pd {
    pub(super) pd: NonNull<ibv_pd>,
    ctx: Arc<Context>,
    /// Registrations of this PD the NIC refused to release (`DeviceStats::dereg_failures`).
    pub dereg_failures: AtomicU64,
}

// SAFETY: PD verbs are thread-safe; the PD is only deallocated in `Drop`, after every child
// (each holds an `Arc<Pd>`).
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    /// `ibv_alloc_pd`.
    pub fn alloc(ctx: &Arc<Context>) -> Result<Arc<Pd>> {
        // SAFETY: valid context.
        let pd = unsafe { rdma_sys::ibv_alloc_pd(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| verbs_error("ibv_alloc_pd", errno()))?;
        Ok(Arc::new(Pd {
            pd,
            ctx: ctx.clone(),
            dereg_failures: AtomicU64::new(0),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// `ibv_reg_mr` of `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// As [`Nic::register`].
    pub unsafe fn reg_mr(self: &Arc<Pd>, ptr: *mut u8, len: usize, access: u32) -> Result<EfaMr> {
        // SAFETY: valid PD; the caller guarantees the range.
        let mr =
            unsafe { rdma_sys::ibv_reg_mr(self.pd.as_ptr(), ptr.cast(), len, access as c_int) };
        let mr = NonNull::new(mr).ok_or_else(|| {
            let e = errno();
            let hint = if e == ffi::ENOMEM || e == 1 {
                memlock_hint()
            } else {
                String::new()
            };
            verbs_error("ibv_reg_mr", e)
                .with_detail(format!("{len} bytes, access {access:#x}{hint}"))
        })?;
        // SAFETY: just registered on this PD.
        Ok(unsafe { self.registered(mr) })
    }

    /// The region `mr` of this PD.
    ///
    /// # Safety
    ///
    /// `mr` was just returned by a registration verb of this PD, which fills the struct before
    /// returning it.
    unsafe fn registered(self: &Arc<Pd>, mr: NonNull<rdma_sys::ibv_mr>) -> EfaMr {
        EfaMr {
            mr,
            // SAFETY: a registered region's struct, filled (the caller's contract).
            fields: unsafe { mr.as_ptr().read() },
            pd: self.clone(),
            dereg: None,
        }
    }

    /// `ibv_reg_dmabuf_mr`.
    ///
    /// # Safety
    ///
    /// As [`EfaDevice::register_dmabuf`](super::EfaDevice::register_dmabuf).
    pub unsafe fn reg_dmabuf_mr(
        self: &Arc<Pd>,
        fd: c_int,
        offset: u64,
        len: usize,
        iova: u64,
        access: u32,
    ) -> Result<EfaMr> {
        // SAFETY: valid PD; the kernel checks the fd and range.
        let mr = unsafe {
            rdma_sys::ibv_reg_dmabuf_mr(self.pd.as_ptr(), offset, len, iova, fd, access as c_int)
        };
        let mr = NonNull::new(mr).ok_or_else(|| {
            verbs_error("ibv_reg_dmabuf_mr", errno()).with_detail(format!(
                "fd {fd}, offset {offset}, {len} bytes, access {access:#x}"
            ))
        })?;
        // SAFETY: just registered on this PD.
        Ok(unsafe { self.registered(mr) })
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc`, deallocated once, no child left.
        let rc = unsafe { rdma_sys::ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "efa: ibv_dealloc_pd failed");
        }
    }
}

/// An address handle, destroyed on drop (when the cache and every work request using it let go).
pub struct Ah {
    ah: NonNull<ibv_ah>,
    _pd: Arc<Pd>,
}

// SAFETY: an address handle is immutable after creation and only destroyed in `Drop`.
unsafe impl Send for Ah {}
// SAFETY: as above; posting with it from several queue pairs is allowed by verbs.
unsafe impl Sync for Ah {}

impl Ah {
    pub(super) fn as_ptr(&self) -> *mut ibv_ah {
        self.ah.as_ptr()
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: created by `ibv_create_ah`, destroyed once, no work request uses it any more.
        let rc = unsafe { rdma_sys::ibv_destroy_ah(self.ah.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "efa: ibv_destroy_ah failed");
        }
    }
}

impl AhFactory for Arc<Pd> {
    type Ah = Ah;

    /// `ibv_create_ah` (global route to `gid`, port 1) and `efadv_query_ah` for its number.
    fn create_ah(&self, gid: &Gid) -> Result<(Ah, u16)> {
        // SAFETY: `ibv_ah_attr` is plain data; all-zero is a valid value.
        let mut attr: ibv_ah_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.is_global = 1;
        attr.port_num = 1;
        attr.grh.dgid = gid_to_ibv(gid);
        // SAFETY: valid PD and attribute struct.
        let ah = unsafe { rdma_sys::ibv_create_ah(self.pd.as_ptr(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(|| {
            let e = errno();
            let kind = if e == 12 {
                ErrorKind::NoMemory
            } else {
                ErrorKind::Unreachable
            };
            Error::new(kind, "ibv_create_ah")
                .with_detail(format!("GID {gid}"))
                .with_source(std::io::Error::from_raw_os_error(e))
        })?;
        let ah = Ah {
            ah,
            _pd: self.clone(),
        };
        let mut efa = ffi::efadv_ah_attr::default();
        // SAFETY: valid AH and out-struct of the size passed.
        let rc = unsafe {
            ffi::efadv_query_ah(ah.as_ptr(), &mut efa, std::mem::size_of_val(&efa) as u32)
        };
        if rc != 0 {
            return Err(verbs_error("efadv_query_ah", rc).with_detail(format!("GID {gid}")));
        }
        Ok((ah, efa.ahn))
    }
}

/// A memory registration on an efa device, deregistered on drop. From
/// [`EfaDevice::register_dmabuf`](super::EfaDevice::register_dmabuf) or
/// [`EfaDevice::register`](super::EfaDevice::register).
pub struct EfaMr {
    mr: NonNull<ibv_mr>,
    /// `*mr` as registered (read once: a successful deregistration frees it).
    fields: ibv_mr,
    pd: Arc<Pd>,
    /// Set by the first deregistration: whether it succeeded.
    dereg: Option<bool>,
}

// SAFETY: a registration is immutable after creation and only deregistered in `Drop`.
unsafe impl Send for EfaMr {}
// SAFETY: as above.
unsafe impl Sync for EfaMr {}

impl EfaMr {
    fn fields(&self) -> &ibv_mr {
        &self.fields
    }

    /// The registration as libibverbs holds it (for `efadv_query_mr`).
    pub fn as_ptr(&self) -> *mut ibv_mr {
        self.mr.as_ptr()
    }

    /// Local key (for this side's work requests).
    pub fn lkey(&self) -> u32 {
        self.fields().lkey
    }

    /// Remote key (for peers' RDMA reads and writes).
    pub fn rkey(&self) -> u32 {
        self.fields().rkey
    }

    /// Start address the registration covers (the IOVA for dmabuf registrations).
    pub fn addr(&self) -> u64 {
        self.fields().addr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.fields().length
    }

    /// True for an empty registration.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for EfaMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EfaMr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl Registration for EfaMr {
    fn lkey(&self) -> u32 {
        EfaMr::lkey(self)
    }

    fn deregister(&mut self) -> bool {
        if let Some(ok) = self.dereg {
            return ok;
        }
        // SAFETY: registered by `ibv_reg_mr`/`ibv_reg_dmabuf_mr`, deregistered once (`dereg`).
        let rc = unsafe { rdma_sys::ibv_dereg_mr(self.mr.as_ptr()) };
        let ok = rc == 0;
        if !ok {
            self.pd.dereg_failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                rc,
                "efa: ibv_dereg_mr failed; the memory it covers is leaked (the NIC may still use it)"
            );
        }
        self.dereg = Some(ok);
        ok
    }
}

impl Drop for EfaMr {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// What the queue pairs of one device share: the protection domain and the address handles.
pub struct Shared {
    /// The device's protection domain.
    pub pd: Arc<Pd>,
    /// Address handles by GID.
    pub ahs: Mutex<AhCache<Ah>>,
}

impl Shared {
    /// A new protection domain on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Shared>> {
        Ok(Arc::new(Shared {
            pd: Pd::alloc(ctx)?,
            ahs: Mutex::new(AhCache::new(AH_CACHE_BOUND)),
        }))
    }
}

/// Why a registration may have failed for want of locked memory: the process's
/// `RLIMIT_MEMLOCK`, and what to do about it.
fn memlock_hint() -> String {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0 {
        if r.rlim_cur == libc::RLIM_INFINITY {
            "unlimited".to_string()
        } else {
            format!("{} bytes", r.rlim_cur)
        }
    } else {
        "unknown".to_string()
    };
    format!(
        "; RLIMIT_MEMLOCK (`ulimit -l`) is {limit}: registered memory is pinned and counts against it \
         (each queue pair pins send × MTU + recv × (MTU + 40) bytes, FI_EFA_TX_SIZE / FI_EFA_RX_SIZE \
         choose the depths); raise the limit, see docs/efa-hardware.md"
    )
}
