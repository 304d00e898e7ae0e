//! The exported `ibv_*` functions (libibverbs.so.1) and the objects behind the pointers they
//! hand out. Every object embeds the verbs struct the program sees as its first field, so the
//! program's pointer is the object's address.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use efa::Gid;
use efa::device::{Device, QpAttr, QpModify, QpType};
use parking_lot::Mutex;

use crate::abi::*;
use crate::cq::{ChannelCore, CqCore, Cqe};
use crate::nic::{Nic, nics};
use crate::qp::{QpCore, SendOp, SendReq};

pub fn set_errno(e: c_int) {
    // SAFETY: the thread's errno location is always valid.
    unsafe { *libc::__errno_location() = e };
}

/// Runs an exported function's body; a panic (a bug) becomes an error return with `EIO` instead
/// of unwinding into C.
pub fn guard<R>(fail: R, f: impl FnOnce() -> R) -> R {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_errno(libc::EIO);
        fail
    })
}

/// Copies the first `len` bytes of `src` to `dst` (at most all of it): an out-parameter of a
/// caller built against an older, shorter layout (libefa's `inlen` rule, the extended
/// `query_port`'s size) gets only the bytes it knows. `EINVAL` for a null `dst` or fewer than
/// 8 bytes.
///
/// # Safety
/// `dst` has room for `len` bytes.
pub unsafe fn copy_prefix<T>(dst: *mut T, src: &T, len: usize) -> c_int {
    let n = len.min(std::mem::size_of::<T>());
    if dst.is_null() || n < 8 {
        return libc::EINVAL;
    }
    // SAFETY: as the caller promises.
    unsafe { std::ptr::copy_nonoverlapping(src as *const T as *const u8, dst as *mut u8, n) };
    0
}

/// Fails with `e` in errno and a null pointer.
pub fn null<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

fn copy_cstr(dst: &mut [c_char], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().chain(std::iter::once(0))) {
        *d = b as c_char;
    }
    if let Some(last) = dst.last_mut() {
        *last = 0;
    }
}

// ---------------------------------------------------------------------------------------------
// Objects

#[repr(C)]
pub struct Context {
    pub vctx: verbs_context,
    pub nic: Arc<Nic>,
}

#[repr(C)]
pub struct Pd {
    pub pd: ibv_pd,
    pub nic: Arc<Nic>,
}

#[repr(C)]
pub struct Mr {
    pub mr: ibv_mr,
    pub nic: Arc<Nic>,
    /// A dmabuf registration's mapping, unmapped (dropped) at deregistration.
    pub mapping: Option<crate::dmabuf::NicMapping>,
}

#[repr(C)]
pub struct Ah {
    pub ah: ibv_ah,
    pub nic: Arc<Nic>,
    pub gid: Gid,
    pub ahn: u16,
}

#[repr(C)]
pub struct Cq {
    pub cq: ibv_cq_ex,
    pub dv: efadv_cq,
    pub core: Arc<CqCore>,
}

#[repr(C)]
pub struct Qp {
    pub qpx: ibv_qp_ex,
    pub core: Arc<QpCore>,
    /// The work requests of an `ibv_wr_start` .. `ibv_wr_complete` batch; `None` outside one.
    pub batch: Mutex<Option<Batch>>,
}

#[derive(Default)]
pub struct Batch {
    pub reqs: Vec<SendReq>,
    /// A setter was called with no work request to apply to, or with bad arguments.
    pub bad: bool,
}

#[repr(C)]
pub struct Channel {
    pub ch: ibv_comp_channel,
    pub core: Arc<ChannelCore>,
}

/// # Safety
/// `ctx` is a context this library made.
pub unsafe fn context<'a>(ctx: *mut ibv_context) -> Option<&'a Context> {
    if ctx.is_null() {
        return None;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    // SAFETY: every `ibv_context` this library hands out is the `context` field of a `Context`
    // (whose first field is the `verbs_context`).
    Some(unsafe { &*((ctx as *mut u8).sub(off) as *const Context) })
}

/// # Safety
/// `p` is null or an object of type `T` this library made (`T`'s verbs struct first).
pub unsafe fn obj<'a, T, V>(p: *mut V) -> Option<&'a T> {
    // SAFETY: as the caller promises.
    unsafe { (p as *const T).as_ref() }
}

// ---------------------------------------------------------------------------------------------
// Devices and contexts

struct DeviceBox(*mut ibv_device);
// SAFETY: the device struct is written once, before it is shared, and only read afterwards.
unsafe impl Send for DeviceBox {}
// SAFETY: as above.
unsafe impl Sync for DeviceBox {}

static DEVICES: std::sync::OnceLock<Vec<DeviceBox>> = std::sync::OnceLock::new();

/// The `ibv_device` of each NIC, in order (made once).
fn devices(nics: &[Arc<Nic>]) -> &'static [DeviceBox] {
    DEVICES.get_or_init(|| {
        let root = crate::sysfs::root();
        nics.iter()
            .enumerate()
            .map(|(i, n)| {
                // SAFETY: an all-zero ibv_device is valid (null ops, empty strings).
                let mut d: Box<ibv_device> = Box::new(unsafe { std::mem::zeroed() });
                d.node_type = IBV_NODE_UNSPECIFIED;
                d.transport_type = IBV_TRANSPORT_UNSPECIFIED;
                copy_cstr(&mut d.name, &n.cfg.device);
                copy_cstr(&mut d.dev_name, &format!("uverbs{i}"));
                copy_cstr(
                    &mut d.dev_path,
                    &format!("{root}/class/infiniband_verbs/uverbs{i}"),
                );
                copy_cstr(
                    &mut d.ibdev_path,
                    &format!("{root}/class/infiniband/{}", n.cfg.device),
                );
                DeviceBox(Box::into_raw(d))
            })
            .collect()
    })
}

/// The NIC and index of device `dev` (one this library listed).
fn nic_of(dev: *mut ibv_device) -> Option<(usize, &'static Arc<Nic>)> {
    let nics = crate::nic::nics().ok()?;
    let i = devices(nics).iter().position(|d| d.0 == dev)?;
    Some((i, nics.get(i)?))
}

fn node_guid(n: &Nic) -> u64 {
    u64::from_be_bytes(n.gid.0[8..16].try_into().unwrap_or([0; 8]))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard(std::ptr::null_mut(), || {
        let devs = match nics() {
            Ok(nics) => {
                // The sysfs tree libfabric checks must exist for these devices.
                if let Err(e) = crate::sysfs::ensure(&nics[0].cfg) {
                    tracing::warn!("efa-emu: {e}");
                }
                let mut v: Vec<*mut ibv_device> = devices(nics).iter().map(|d| d.0).collect();
                v.push(std::ptr::null_mut());
                v
            }
            Err(e) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| eprintln!("efa-emu: no emulated EFA device: {e}"));
                vec![std::ptr::null_mut()]
            }
        };
        if !num.is_null() {
            // SAFETY: the caller's out-parameter.
            unsafe { *num = (devs.len() - 1) as c_int };
        }
        Box::into_raw(devs.into_boxed_slice()) as *mut *mut ibv_device
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_free_device_list(list: *mut *mut ibv_device) {
    guard((), || {
        if list.is_null() {
            return;
        }
        // Recover the boxed slice's length: entries up to and including the terminating null.
        let mut n = 0;
        // SAFETY: the list is null-terminated (we made it).
        while !unsafe { *list.add(n) }.is_null() {
            n += 1;
        }
        // SAFETY: `list` came from `Box<[*mut ibv_device]>` of `n + 1` entries.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n + 1)) });
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    if dev.is_null() {
        return std::ptr::null();
    }
    // SAFETY: a device this library made.
    unsafe { (*dev).name.as_ptr() }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    nic_of(dev).map(|(_, n)| node_guid(n).to_be()).unwrap_or(0)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    nic_of(dev).map_or(-1, |(i, _)| i as c_int)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    guard(std::ptr::null_mut(), || {
        if nics().is_err() {
            return null(libc::ENODEV);
        }
        let Some((_, n)) = nic_of(dev) else {
            return null(libc::EINVAL);
        };
        // SAFETY: all-zero is a valid verbs_context (null pointers, zeroed mutex = initializer).
        let mut vctx: verbs_context = unsafe { std::mem::zeroed() };
        vctx.query_port = Some(emu_query_port_ex);
        vctx.create_cq_ex = Some(emu_create_cq_ex);
        vctx.create_qp_ex = Some(emu_create_qp_ex);
        vctx.sz = std::mem::size_of::<verbs_context>();
        vctx.context.device = dev;
        vctx.context.ops.poll_cq = Some(emu_poll_cq);
        vctx.context.ops.req_notify_cq = Some(emu_req_notify_cq);
        vctx.context.ops.post_send = Some(emu_post_send);
        vctx.context.ops.post_recv = Some(emu_post_recv);
        vctx.context.cmd_fd = -1;
        vctx.context.async_fd = -1;
        vctx.context.num_comp_vectors = 1;
        vctx.context.abi_compat = VERBS_ABI_IS_EXTENDED;
        let c = Box::into_raw(Box::new(Context {
            vctx,
            nic: n.clone(),
        }));
        // SAFETY: just allocated.
        unsafe { &mut (*c).vctx.context }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_close_device(ctx: *mut ibv_context) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a context this library made.
        let Some(c) = (unsafe { context(ctx) }) else {
            return libc::EINVAL;
        };
        // SAFETY: made by Box::into_raw in open_device; the program gives it back once.
        drop(unsafe { Box::from_raw(c as *const Context as *mut Context) });
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's context and out-parameter.
        let (Some(c), Some(a)) = (unsafe { context(ctx) }, unsafe { attr.as_mut() }) else {
            return libc::EINVAL;
        };
        let cfg = &c.nic.cfg;
        // SAFETY: all-zero is a valid ibv_device_attr.
        *a = unsafe { std::mem::zeroed() };
        copy_cstr(
            &mut a.fw_ver,
            concat!("efa-emu ", env!("CARGO_PKG_VERSION")),
        );
        a.node_guid = node_guid(&c.nic).to_be();
        a.sys_image_guid = a.node_guid;
        a.max_mr_size = 1 << 40;
        a.page_size_cap = 0x1000;
        a.vendor_id = 0x1d0f;
        a.vendor_part_id = cfg.vendor_part_id;
        a.hw_ver = 0xefa0;
        a.max_qp = 256;
        a.max_qp_wr = cfg.max_sq_wr.min(cfg.max_rq_wr) as c_int;
        a.max_sge = c_int::from(cfg.max_sq_sge.min(cfg.max_rq_sge));
        a.max_sge_rd = 1;
        a.max_cq = 512;
        a.max_cqe = 1 << 20;
        a.max_mr = 1 << 18;
        a.max_pd = 256;
        a.max_ah = 1 << 16;
        a.max_pkeys = 1;
        a.phys_port_cnt = 1;
        0
    })
}

fn fill_port(n: &Nic, a: &mut ibv_port_attr) {
    // SAFETY: all-zero is a valid ibv_port_attr.
    *a = unsafe { std::mem::zeroed() };
    a.state = IBV_PORT_ACTIVE;
    a.max_mtu = IBV_MTU_4096;
    a.active_mtu = IBV_MTU_4096;
    a.gid_tbl_len = 1;
    a.max_msg_sz = n.cfg.mtu as u32;
    a.pkey_tbl_len = 1;
    a.lid = 0;
    a.active_width = 2; // 4x
    a.active_speed = 32; // EDR (25 Gb/s per lane)
    a.phys_state = 5; // LinkUp
    a.link_layer = IBV_LINK_LAYER_UNSPECIFIED;
}

/// `verbs_context.query_port` (the extended query the inline `ibv_query_port` calls).
unsafe extern "C" fn emu_query_port_ex(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's context.
        let Some(c) = (unsafe { context(ctx) }) else {
            return libc::EINVAL;
        };
        if port != 1 {
            return libc::EINVAL;
        }
        // SAFETY: all-zero is valid.
        let mut full: ibv_port_attr = unsafe { std::mem::zeroed() };
        fill_port(&c.nic, &mut full);
        // SAFETY: the program gave `len` writable bytes at `attr`.
        unsafe { copy_prefix(attr, &full, len) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // The exported symbol fills the old, shorter layout.
    // SAFETY: forwarded.
    unsafe { emu_query_port_ex(ctx, port, attr, COMPAT_PORT_ATTR_LEN) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    guard(-1, || {
        // SAFETY: the program's context and out-parameter.
        let (Some(c), Some(g)) = (unsafe { context(ctx) }, unsafe { gid.as_mut() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if port != 1 || index != 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        g.raw = c.nic.gid.0;
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_query_pkey(
    _ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if port != 1 || index != 0 || pkey.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the program's out-parameter.
    unsafe { *pkey = 0xffff_u16.to_be() };
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_pkey_index(
    _ctx: *mut ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    if port == 1 && u16::from_be(pkey) | 0x8000 == 0xffff {
        0
    } else {
        set_errno(libc::ENOENT);
        -1
    }
}

// ---------------------------------------------------------------------------------------------
// Protection domains, memory regions, address handles

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's context.
        let Some(c) = (unsafe { context(ctx) }) else {
            return null(libc::EINVAL);
        };
        let p = Box::into_raw(Box::new(Pd {
            pd: ibv_pd {
                context: ctx,
                handle: 0,
            },
            nic: c.nic.clone(),
        }));
        p as *mut ibv_pd
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    if pd.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: a protection domain this library made, given back once.
    drop(unsafe { Box::from_raw(pd as *mut Pd) });
    0
}

/// Registers memory for `pd`.
///
/// # Safety
/// `pd` is ours; the memory stays valid until deregistration.
unsafe fn reg(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
    mapping: Option<crate::dmabuf::NicMapping>,
) -> *mut ibv_mr {
    // SAFETY: as the caller promises.
    let Some(p) = (unsafe { obj::<Pd, _>(pd) }) else {
        return null(libc::EINVAL);
    };
    // SAFETY: the program keeps the memory valid while registered.
    match unsafe { p.nic.reg(pd as usize, addr as *mut u8, len, iova, access) } {
        Ok((lkey, rkey)) => Box::into_raw(Box::new(Mr {
            mr: ibv_mr {
                context: p.pd.context,
                pd,
                addr,
                length: len,
                handle: lkey,
                lkey,
                rkey,
            },
            nic: p.nic.clone(),
            mapping,
        })) as *mut ibv_mr,
        Err(e) => null(e),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the program's registration.
    guard(std::ptr::null_mut(), || unsafe {
        reg(pd, addr, len, addr as u64, access, None)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: the program's registration.
    guard(std::ptr::null_mut(), || unsafe {
        reg(pd, addr, len, iova, access, None)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    // SAFETY: the program's registration.
    guard(std::ptr::null_mut(), || unsafe {
        reg(pd, addr, len, iova, access as c_int, None)
    })
}

/// `ibv_reg_dmabuf_mr`: the emulator maps `len` bytes of `fd` at `offset` (any mmap-able
/// descriptor, such as a memfd standing in for GPU memory) and registers the mapping; remote
/// accesses name it by `iova`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    len: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    guard(std::ptr::null_mut(), || {
        if len == 0 || fd < 0 {
            return null(libc::EINVAL);
        }
        // The kernel takes only a dma-buf (`dma_buf_get`: `EINVAL` for any other file, a memfd
        // too); the emulated NIC also takes the marked stand-in where the kernel exports none.
        if !crate::dmabuf::accepted(fd) {
            return null(libc::EINVAL);
        }
        // SAFETY: the program's descriptor, valid for this call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        // SAFETY: the program's PD (checked again by `reg`).
        let unmappable = unsafe { obj::<Pd, _>(pd) }.is_some_and(|p| p.nic.cfg.dmabuf_unmappable);
        let (p, map) = match crate::dmabuf::map_for_nic(fd, offset, len, unmappable) {
            Ok(m) => m,
            Err(e) => return null(e),
        };
        let p = p.cast::<c_void>();
        // SAFETY: the mapping lives as long as the registration (it is dropped, unmapping it,
        // at dereg or here when registration fails).
        let mr = unsafe { reg(pd, p, len, iova, access, Some(map)) };
        if !mr.is_null() {
            // The program sees the I/O virtual address, as with a real dmabuf.
            // SAFETY: just made.
            unsafe { (*mr).addr = iova as usize as *mut c_void };
        }
        mr
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a region this library made.
        let Some(m) = (unsafe { obj::<Mr, _>(mr) }) else {
            return libc::EINVAL;
        };
        if let Err(e) = m.nic.dereg(m.mr.lkey) {
            return e;
        }
        // SAFETY: given back once; dropping it unmaps a dmabuf's mapping, no longer registered.
        drop(unsafe { Box::from_raw(mr as *mut Mr) });
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's PD and attributes.
        let (Some(p), Some(a)) = (unsafe { obj::<Pd, _>(pd) }, unsafe { attr.as_ref() }) else {
            return null(libc::EINVAL);
        };
        if a.is_global == 0 || a.port_num > 1 {
            return null(libc::EINVAL);
        }
        let gid = Gid(a.grh.dgid.raw);
        let Some(ahn) = p.nic.ah_get(pd as usize, gid) else {
            return null(libc::ENOMEM);
        };
        Box::into_raw(Box::new(Ah {
            ah: ibv_ah {
                context: p.pd.context,
                pd,
                handle: u32::from(ahn),
            },
            nic: p.nic.clone(),
            gid,
            ahn,
        })) as *mut ibv_ah
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    guard(libc::EIO, || {
        if ah.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: an AH this library made, given back once.
        let a = unsafe { Box::from_raw(ah as *mut Ah) };
        a.nic.ah_put(a.ah.pd as usize, a.gid);
        0
    })
}

// ---------------------------------------------------------------------------------------------
// Completion channels and CQs

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_create_comp_channel(
    ctx: *mut ibv_context,
) -> *mut ibv_comp_channel {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's context.
        if unsafe { context(ctx) }.is_none() {
            return null(libc::EINVAL);
        }
        match ChannelCore::new() {
            Ok(core) => Box::into_raw(Box::new(Channel {
                ch: ibv_comp_channel {
                    context: ctx,
                    fd: core.fds.0,
                    refcnt: 0,
                },
                core,
            })) as *mut ibv_comp_channel,
            Err(e) => null(e),
        }
    })
}

/// The number of CQs using a channel (`ibv_comp_channel::refcnt`), updated atomically: CQs of
/// one channel are made and destroyed from any thread, and only this library touches it.
fn channel_refs<'a>(ch: *mut ibv_comp_channel) -> &'a std::sync::atomic::AtomicI32 {
    // SAFETY: a live channel this library made (callers checked); `c_int` and `AtomicI32` have
    // the same size and alignment, and every access to the field goes through this.
    unsafe { std::sync::atomic::AtomicI32::from_ptr(&raw mut (*ch).refcnt) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a channel this library made.
        let Some(c) = (unsafe { obj::<Channel, _>(ch) }) else {
            return libc::EINVAL;
        };
        if channel_refs(ch).load(Ordering::Acquire) > 0 {
            return libc::EBUSY;
        }
        c.core.close();
        // SAFETY: given back once.
        drop(unsafe { Box::from_raw(ch as *mut Channel) });
        0
    })
}

/// Makes a CQ; `sgid`: `efadv_wc_read_sgid` reports unknown senders' GIDs.
///
/// # Safety
/// `ctx` and `channel` (if not null) are ours.
pub unsafe fn new_cq(
    ctx: *mut ibv_context,
    cqe: u32,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    sgid: bool,
    unsolicited: bool,
) -> *mut ibv_cq_ex {
    // SAFETY: as the caller promises.
    // libefa rounds the depth up to a power of two; the kernel checks that against the maximum.
    let cqe = cqe.checked_next_power_of_two().unwrap_or(u32::MAX);
    // SAFETY: as the caller promises.
    let Some(c) = (unsafe { context(ctx) }) else {
        return null(libc::EINVAL);
    };
    if cqe == 0 || cqe > 1 << 20 {
        return null(libc::EINVAL);
    }
    if !channel.is_null() && !c.nic.cfg.caps.cq_notifications {
        // libefa: no completion channel without the kernel's CQ_NOTIFICATIONS.
        return null(libc::EOPNOTSUPP);
    }
    // SAFETY: as the caller promises.
    let ch = unsafe { obj::<Channel, _>(channel) };
    let core = Arc::new(CqCore::new(cqe as usize, ch.map(|c| c.core.clone()), sgid));
    // SAFETY: all-zero is a valid ibv_cq_ex (null pointers, initializer mutex and cond).
    let mut cq: ibv_cq_ex = unsafe { std::mem::zeroed() };
    cq.context = ctx;
    cq.channel = channel;
    cq.cq_context = cq_context;
    cq.cqe = cqe as c_int;
    cq.start_poll = Some(crate::poll::start_poll);
    cq.next_poll = Some(crate::poll::next_poll);
    cq.end_poll = Some(crate::poll::end_poll);
    cq.read_opcode = Some(crate::poll::read_opcode);
    cq.read_vendor_err = Some(crate::poll::read_vendor_err);
    cq.read_byte_len = Some(crate::poll::read_byte_len);
    cq.read_imm_data = Some(crate::poll::read_imm_data);
    cq.read_qp_num = Some(crate::poll::read_qp_num);
    cq.read_src_qp = Some(crate::poll::read_src_qp);
    cq.read_wc_flags = Some(crate::poll::read_wc_flags);
    cq.read_slid = Some(crate::poll::read_slid);
    cq.read_sl = Some(crate::poll::read_sl);
    cq.read_dlid_path_bits = Some(crate::poll::read_dlid_path_bits);
    let dv = efadv_cq {
        comp_mask: 0,
        wc_read_sgid: sgid.then_some(crate::poll::wc_read_sgid as ReadSgidFn),
        wc_is_unsolicited: unsolicited.then_some(crate::poll::wc_is_unsolicited as IsUnsolicitedFn),
    };
    if ch.is_some() {
        channel_refs(channel).fetch_add(1, Ordering::AcqRel);
    }
    core.ibv.store(0, Ordering::Relaxed);
    let keep = core.clone();
    let p = Box::into_raw(Box::new(Cq { cq, dv, core }));
    keep.ibv.store(p as usize, Ordering::Relaxed);
    p as *mut ibv_cq_ex
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    guard(std::ptr::null_mut(), || {
        let Ok(n) = u32::try_from(cqe) else {
            return null(libc::EINVAL);
        };
        // SAFETY: the program's context and channel.
        unsafe { new_cq(ctx, n, cq_context, channel, false, false) as *mut ibv_cq }
    })
}

/// `verbs_context.create_cq_ex`.
unsafe extern "C" fn emu_create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's attributes.
        let Some(a) = (unsafe { attr.as_ref() }) else {
            return null(libc::EINVAL);
        };
        if a.wc_flags & !IBV_WC_STANDARD_FLAGS != 0 {
            return null(libc::EOPNOTSUPP);
        }
        // SAFETY: the program's context and channel.
        unsafe { new_cq(ctx, a.cqe, a.cq_context, a.channel, false, false) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a CQ this library made.
        let Some(c) = (unsafe { obj::<Cq, _>(cq) }) else {
            return libc::EINVAL;
        };
        if c.core.users.load(Ordering::Acquire) > 0 {
            return libc::EBUSY;
        }
        if !c.cq.channel.is_null() {
            channel_refs(c.cq.channel).fetch_sub(1, Ordering::AcqRel);
        }
        // SAFETY: given back once.
        drop(unsafe { Box::from_raw(cq as *mut Cq) });
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard(-1, || {
        // SAFETY: a channel this library made.
        let Some(c) = (unsafe { obj::<Channel, _>(ch) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let mut b = [0u8; 1];
        // SAFETY: reads one byte of our pipe (blocking unless the program made it non-blocking).
        let r = unsafe { libc::read(c.core.fds.0, b.as_mut_ptr().cast(), 1) };
        if r != 1 {
            return -1; // errno from read (EAGAIN on a non-blocking channel)
        }
        let Some(addr) = c.core.events.lock().pop_front() else {
            set_errno(libc::EAGAIN);
            return -1;
        };
        let p = addr as *mut ibv_cq;
        // SAFETY: the program's out-parameters; the CQ is live (it has unacknowledged events).
        unsafe {
            if !cq.is_null() {
                *cq = p;
            }
            if !cq_context.is_null() {
                *cq_context = (*p).cq_context;
            }
        }
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_ack_cq_events(cq: *mut ibv_cq, n: u32) {
    if !cq.is_null() {
        // As libibverbs: under the CQ's mutex (threads may acknowledge events of one CQ at
        // once), signalling its condition.
        // SAFETY: the program's CQ; its mutex and condition were zero-initialized (the
        // initializers) when this library made it.
        unsafe {
            libc::pthread_mutex_lock(&raw mut (*cq).mutex.0);
            (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(n);
            libc::pthread_cond_signal(&raw mut (*cq).cond.0);
            libc::pthread_mutex_unlock(&raw mut (*cq).mutex.0);
        }
    }
}

unsafe extern "C" fn emu_req_notify_cq(cq: *mut ibv_cq, _solicited: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a CQ this library made.
        let Some(c) = (unsafe { obj::<Cq, _>(cq) }) else {
            return libc::EINVAL;
        };
        if c.core.channel.is_none() {
            return libc::EINVAL;
        }
        c.core.arm();
        0
    })
}

unsafe extern "C" fn emu_poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    guard(-1, || {
        // SAFETY: a CQ this library made.
        let Some(c) = (unsafe { obj::<Cq, _>(cq) }) else {
            return -1;
        };
        let mut got = 0;
        while got < n {
            let Some(e) = c.core.pop() else { break };
            // SAFETY: the program gave room for `n` work completions.
            let w = unsafe { &mut *wc.add(got as usize) };
            *w = wc_of(&e);
            got += 1;
        }
        got
    })
}

pub fn wc_of(e: &Cqe) -> ibv_wc {
    ibv_wc {
        wr_id: e.wr_id,
        status: e.status,
        opcode: e.opcode,
        vendor_err: e.vendor_err,
        byte_len: e.byte_len,
        imm_data: e.imm.map_or(0, u32::to_be),
        qp_num: e.qp_num,
        src_qp: e.src_qp,
        wc_flags: if e.imm.is_some() { IBV_WC_WITH_IMM } else { 0 },
        pkey_index: 0,
        slid: e.slid,
        sl: 0,
        dlid_path_bits: 0,
    }
}

// ---------------------------------------------------------------------------------------------
// Queue pairs

/// Makes a queue pair on the udp device.
///
/// # Safety
/// `pd`, `send_cq`, `recv_cq` are ours.
#[allow(clippy::too_many_arguments)]
pub unsafe fn new_qp(
    pd: *mut ibv_pd,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    qp_context: *mut c_void,
    cap: &mut ibv_qp_cap,
    qp_type: QpType,
    send_ops: u64,
    unsolicited: bool,
) -> *mut ibv_qp {
    // SAFETY: as the caller promises.
    let (Some(p), Some(scq), Some(rcq)) = (
        unsafe { obj::<Pd, _>(pd) },
        unsafe { obj::<Cq, _>(send_cq) },
        unsafe { obj::<Cq, _>(recv_cq) },
    ) else {
        return null(libc::EINVAL);
    };
    let cfg = &p.nic.cfg;
    if cap.max_send_wr > cfg.max_sq_wr
        || cap.max_recv_wr > cfg.max_rq_wr
        || cap.max_send_sge > u32::from(cfg.max_sq_sge)
        || cap.max_recv_sge > u32::from(cfg.max_rq_sge)
        || cap.max_inline_data > u32::from(cfg.inline_size)
    {
        return null(libc::EINVAL);
    }
    // libefa rounds both depths up to a power of two and reports them back; the kernel then
    // checks the rounded depths against the device's maxima: where a maximum is not a power of
    // two, asking for it exactly is refused.
    let (Some(sq), Some(rq)) = (
        cap.max_send_wr.max(1).checked_next_power_of_two(),
        cap.max_recv_wr.max(1).checked_next_power_of_two(),
    ) else {
        return null(libc::EINVAL);
    };
    if sq > cfg.max_sq_wr || rq > cfg.max_rq_wr {
        return null(libc::EINVAL);
    }
    cap.max_send_wr = sq;
    cap.max_recv_wr = rq;
    let supported = IBV_QP_EX_WITH_SEND
        | IBV_QP_EX_WITH_SEND_WITH_IMM
        | if cfg.caps.rdma_read {
            IBV_QP_EX_WITH_RDMA_READ
        } else {
            0
        }
        | if cfg.caps.rdma_write {
            IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
        } else {
            0
        };
    if send_ops & !supported != 0 || (unsolicited && !cfg.caps.unsolicited_write_recv) {
        return null(libc::EOPNOTSUPP);
    }
    let mut attr = QpAttr::new(qp_type);
    attr.send_depth = cap.max_send_wr.max(1) as usize;
    attr.recv_depth = cap.max_recv_wr.max(1) as usize;
    attr.notifier = Arc::new(efa::notify::Notifier::forwarding(
        if Arc::ptr_eq(&scq.core, &rcq.core) {
            vec![scq.core.notifier.clone()]
        } else {
            vec![scq.core.notifier.clone(), rcq.core.notifier.clone()]
        },
    ));
    attr.unsolicited_write_recv = Some(unsolicited);
    let dev = match p.nic.dev.create_qp(attr) {
        Ok(d) => d,
        Err(e) => return null(crate::qp::errno_of(&e)),
    };
    scq.core.users.fetch_add(1, Ordering::AcqRel);
    if !Arc::ptr_eq(&scq.core, &rcq.core) {
        rcq.core.users.fetch_add(1, Ordering::AcqRel);
    }
    let core = QpCore::new(
        p.nic.clone(),
        dev,
        pd as usize,
        scq.core.clone(),
        rcq.core.clone(),
        cap,
    );
    cap.max_inline_data = u32::from(cfg.inline_size);
    // SAFETY: all-zero is a valid ibv_qp_ex (null table, initializer mutex and cond).
    let mut qpx: ibv_qp_ex = unsafe { std::mem::zeroed() };
    qpx.qp_base.context = p.pd.context;
    qpx.qp_base.qp_context = qp_context;
    qpx.qp_base.pd = pd;
    qpx.qp_base.send_cq = send_cq;
    qpx.qp_base.recv_cq = recv_cq;
    qpx.qp_base.handle = core.qp_num;
    qpx.qp_base.qp_num = core.qp_num;
    qpx.qp_base.state = IBV_QPS_RESET;
    qpx.qp_base.qp_type = if qp_type == QpType::Ud {
        IBV_QPT_UD
    } else {
        IBV_QPT_DRIVER
    };
    crate::wr::fill(&mut qpx, send_ops);
    Box::into_raw(Box::new(Qp {
        qpx,
        core,
        batch: Mutex::new(None),
    })) as *mut ibv_qp
}

/// # Safety
/// `pd` and `attr` are the program's.
unsafe fn create_ud(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    // SAFETY: as the caller promises.
    let Some(a) = (unsafe { attr.as_mut() }) else {
        return null(libc::EINVAL);
    };
    if a.qp_type != IBV_QPT_UD {
        // EFA offers UD here and SRD through efadv; nothing else.
        return null(libc::EOPNOTSUPP);
    }
    if !a.srq.is_null() {
        return null(libc::EOPNOTSUPP);
    }
    // SAFETY: as the caller promises.
    unsafe {
        new_qp(
            pd,
            a.send_cq,
            a.recv_cq,
            a.qp_context,
            &mut a.cap,
            QpType::Ud,
            0,
            false,
        )
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    // SAFETY: the program's arguments.
    guard(std::ptr::null_mut(), || unsafe { create_ud(pd, attr) })
}

/// `verbs_context.create_qp_ex`: UD queue pairs with the extended attributes.
unsafe extern "C" fn emu_create_qp_ex(
    _ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else {
            return null(libc::EINVAL);
        };
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || a.qp_type != IBV_QPT_UD {
            return null(libc::EOPNOTSUPP);
        }
        let ops = if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            a.send_ops_flags
        } else {
            0
        };
        if ops & !(IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM) != 0 {
            return null(libc::EOPNOTSUPP);
        }
        // SAFETY: the program's arguments.
        unsafe {
            new_qp(
                a.pd,
                a.send_cq,
                a.recv_cq,
                a.qp_context,
                &mut a.cap,
                QpType::Ud,
                ops,
                false,
            )
        }
    })
}

/// The attribute masks the EFA kernel driver takes for a transition (`efa_modify_qp_validate`:
/// its supported mask, then the IB core's table for UD, `ib_modify_qp_is_ok`, with
/// `IBV_QP_RNR_RETRY` allowed on SRD where the device has the capability): `EOPNOTSUPP` for an
/// attribute EFA never takes, `EINVAL` for one the transition does not take or a required one
/// missing.
fn modify_mask_ok(
    cur: c_int,
    next: c_int,
    mask: c_int,
    qp_type: QpType,
    cfg: &crate::config::EmuConfig,
) -> Result<(), c_int> {
    let supported = IBV_QP_STATE
        | IBV_QP_CUR_STATE
        | IBV_QP_EN_SQD_ASYNC_NOTIFY
        | IBV_QP_PKEY_INDEX
        | IBV_QP_PORT
        | IBV_QP_QKEY
        | IBV_QP_SQ_PSN
        | IBV_QP_RNR_RETRY;
    if mask & !supported != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if mask & IBV_QP_RNR_RETRY != 0 && (qp_type != QpType::Srd || !cfg.caps.rnr_retry) {
        return Err(libc::EOPNOTSUPP);
    }
    let mask = mask & !IBV_QP_RNR_RETRY & !IBV_QP_STATE;
    let (required, optional) = match (cur, next) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (IBV_QP_SQ_PSN, IBV_QP_CUR_STATE | IBV_QP_QKEY),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_CUR_STATE | IBV_QP_QKEY),
        _ => return Err(libc::EINVAL),
    };
    if mask & required != required || mask & !(required | optional) != 0 {
        return Err(libc::EINVAL);
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's queue pair and attributes.
        let (Some(q), Some(a)) = (unsafe { obj::<Qp, _>(qp) }, unsafe { attr.as_ref() }) else {
            return libc::EINVAL;
        };
        let mut state = q.core.state.lock();
        let next = if mask & IBV_QP_STATE != 0 {
            a.qp_state
        } else {
            *state
        };
        if let Err(e) = modify_mask_ok(*state, next, mask, q.core.qp_type, &q.core.nic.cfg) {
            return e;
        }
        let mut m = QpModify::default();
        if mask & IBV_QP_QKEY != 0 {
            m.qkey = Some(a.qkey);
        }
        if mask & IBV_QP_RNR_RETRY != 0 {
            if q.core.qp_type != QpType::Srd || a.rnr_retry > 7 {
                return libc::EINVAL;
            }
            m.rnr_retry = Some(a.rnr_retry);
        }
        if mask & IBV_QP_PORT != 0 && a.port_num != 1 {
            return libc::EINVAL;
        }
        // The verbs state machine (RESET -> INIT -> RTR -> RTS; any -> RESET or ERR).
        let ok = match (*state, next) {
            (s, n) if s == n => true,
            (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => true,
            (IBV_QPS_RESET, IBV_QPS_INIT) => mask & IBV_QP_QKEY != 0,
            (IBV_QPS_INIT, IBV_QPS_RTR) | (IBV_QPS_RTR, IBV_QPS_RTS) => true,
            _ => false,
        };
        if !ok {
            return libc::EINVAL;
        }
        if m != QpModify::default() {
            if let Err(e) = q.core.modify(m) {
                return e;
            }
        }
        if next == IBV_QPS_ERR && *state != IBV_QPS_ERR {
            q.core.close();
        }
        *state = next;
        // SAFETY: the program reads `state` of its ibv_qp; we keep it current.
        unsafe { (*qp).state = next };
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's queue pair and out-parameters.
        let (Some(q), Some(a)) = (unsafe { obj::<Qp, _>(qp) }, unsafe { attr.as_mut() }) else {
            return libc::EINVAL;
        };
        // SAFETY: all-zero is valid.
        *a = unsafe { std::mem::zeroed() };
        a.qp_state = *q.core.state.lock();
        a.cur_qp_state = a.qp_state;
        a.qkey = q.core.qkey();
        a.port_num = 1;
        if let Some(i) = unsafe { init.as_mut() } {
            i.qp_context = q.qpx.qp_base.qp_context;
            i.send_cq = q.qpx.qp_base.send_cq;
            i.recv_cq = q.qpx.qp_base.recv_cq;
            i.qp_type = q.qpx.qp_base.qp_type;
            i.sq_sig_all = 1;
        }
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a queue pair this library made, given back once.
        let q = unsafe { Box::from_raw(qp as *mut Qp) };
        q.core.linger();
        q.core.close();
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    qp as *mut ibv_qp_ex
}

unsafe extern "C" fn emu_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's queue pair.
        let Some(q) = (unsafe { obj::<Qp, _>(qp) }) else {
            return libc::EINVAL;
        };
        // SAFETY: the program's list.
        match unsafe { q.core.post_recv(wr) } {
            Ok(()) => 0,
            Err((at, e)) => {
                if !bad.is_null() {
                    // SAFETY: the program's out-parameter.
                    unsafe { *bad = at as *mut ibv_recv_wr };
                }
                e
            }
        }
    })
}

/// A send request of the old `ibv_post_send` API (sends only: RDMA needs the `ibv_wr_*` API
/// on EFA, whose work request cannot carry an AH and a remote address at once).
///
/// # Safety
/// `w` is the program's work request.
unsafe fn old_req(w: &ibv_send_wr) -> Result<SendReq, c_int> {
    let op = match w.opcode {
        IBV_WR_SEND => SendOp::Send { imm: None },
        IBV_WR_SEND_WITH_IMM => SendOp::Send {
            imm: Some(u32::from_be(w.imm_data)),
        },
        _ => return Err(libc::EINVAL),
    };
    // SAFETY: the `ud` member is the one a send on a datagram queue pair uses.
    let ud = unsafe { w.wr.ud };
    // SAFETY: an AH this library made.
    let ah = unsafe { obj::<Ah, _>(ud.ah) }.ok_or(libc::EINVAL)?;
    let n = usize::try_from(w.num_sge).map_err(|_| libc::EINVAL)?;
    let inline = w.send_flags & IBV_SEND_INLINE != 0;
    let sges: Vec<ibv_sge> = if n == 0 {
        Vec::new()
    } else if w.sg_list.is_null() {
        return Err(libc::EINVAL);
    } else {
        // SAFETY: `num_sge` entries, as the program promises.
        unsafe { std::slice::from_raw_parts(w.sg_list, n) }.to_vec()
    };
    let inline_data = if inline {
        let mut v = Vec::new();
        for s in &sges {
            // An empty entry (libfabric's DGRAM send of a message no longer than its prefix
            // leaves one, with whatever address) contributes nothing.
            if s.length == 0 {
                continue;
            }
            if s.addr == 0 {
                return Err(libc::EINVAL);
            }
            // SAFETY: inline data is read at posting from the program's buffers.
            v.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
            });
        }
        Some(v)
    } else {
        None
    };
    Ok(SendReq {
        wr_id: w.wr_id,
        op,
        dest: Some((ah.gid, ud.remote_qpn, ud.remote_qkey)),
        sges: if inline { Vec::new() } else { sges },
        inline: inline_data,
    })
}

unsafe extern "C" fn emu_post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's queue pair.
        let Some(q) = (unsafe { obj::<Qp, _>(qp) }) else {
            return libc::EINVAL;
        };
        let mut ptrs = Vec::new();
        let mut reqs = Vec::new();
        let mut cur = wr;
        let mut err = None;
        while !cur.is_null() {
            // SAFETY: the program's list.
            let w = unsafe { &*cur };
            // SAFETY: as above.
            match unsafe { old_req(w) } {
                Ok(r) => {
                    reqs.push(r);
                    ptrs.push(cur);
                }
                Err(e) => {
                    err = Some((cur, e));
                    break;
                }
            }
            cur = w.next;
        }
        let res = q.core.post_sends(reqs).map_err(|(i, e)| (ptrs[i], e));
        match err.map_or(res, |e| res.and(Err(e))) {
            Ok(()) => 0,
            Err((at, e)) => {
                if !bad.is_null() {
                    // SAFETY: the program's out-parameter.
                    unsafe { *bad = at };
                }
                e
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// The rest of the imported ABI

/// `EFA_EMU_FORK=disabled` models a kernel older than 5.13, where registered pages are not
/// copied on fork: `ibv_is_fork_initialized` says `IBV_FORK_DISABLED` until `ibv_fork_init`
/// (which refuses with `EINVAL` once memory was registered) enables it. Unset or `unneeded`
/// (the default): `IBV_FORK_UNNEEDED`, as on 5.13+ (the emulator pins nothing anyway).
fn fork_modelled() -> bool {
    std::env::var("EFA_EMU_FORK").is_ok_and(|v| v == "disabled")
}

static FORK_ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_fork_init() -> c_int {
    use std::sync::atomic::Ordering::Relaxed;
    if !fork_modelled() || FORK_ENABLED.load(Relaxed) {
        return 0;
    }
    if crate::nic::REGISTERED.load(Relaxed) {
        return libc::EINVAL;
    }
    FORK_ENABLED.store(true, Relaxed);
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_is_fork_initialized() -> c_int {
    if !fork_modelled() {
        IBV_FORK_UNNEEDED
    } else if FORK_ENABLED.load(std::sync::atomic::Ordering::Relaxed) {
        IBV_FORK_ENABLED
    } else {
        IBV_FORK_DISABLED
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_wc_status_str(status: c_int) -> *const c_char {
    let s: &'static CStr = match status {
        0 => c"success",
        1 => c"local length error",
        2 => c"local QP operation error",
        4 => c"local protection error",
        5 => c"Work Request Flushed Error",
        7 => c"bad response error",
        9 => c"invalid request error",
        13 => c"RNR retry counter exceeded",
        15 => c"remote invalid RD request",
        16 => c"remote aborted error",
        20 => c"response timeout error",
        21 => c"general error",
        _ => c"unknown",
    };
    s.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_create_srq(_pd: *mut ibv_pd, _attr: *mut c_void) -> *mut c_void {
    null(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_destroy_srq(_srq: *mut c_void) -> c_int {
    libc::EINVAL
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_attach_mcast(
    _qp: *mut ibv_qp,
    _gid: *const ibv_gid,
    _lid: u16,
) -> c_int {
    libc::EOPNOTSUPP
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_detach_mcast(
    _qp: *mut ibv_qp,
    _gid: *const ibv_gid,
    _lid: u16,
) -> c_int {
    libc::EOPNOTSUPP
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_query_ece(_qp: *mut ibv_qp, _ece: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_set_ece(_qp: *mut ibv_qp, _ece: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

/// librdmacm converts kernel replies with these; the emulator has no rdma_cm device, so they are
/// never reached, and leave the destination as it is.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_copy_qp_attr_from_kern(_dst: *mut c_void, _src: *const c_void) {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_copy_ah_attr_from_kern(_dst: *mut c_void, _src: *const c_void) {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_copy_path_rec_from_kern(_dst: *mut c_void, _src: *const c_void) {}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_get_sysfs_path() -> *const c_char {
    crate::sysfs::root_cstr().as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard(-1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            return -1;
        }
        // SAFETY: the program's strings.
        let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let path = format!("{}/{}", d.to_string_lossy(), f.to_string_lossy());
        let Ok(mut s) = std::fs::read(&path) else {
            return -1;
        };
        if s.last() == Some(&b'\n') {
            s.pop();
        }
        let n = s.len().min(size - 1);
        // SAFETY: the program gave `size` bytes at `buf`.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
            *buf.add(n) = 0;
        }
        n as c_int
    })
}
