//! Declarations of libefa's direct-verbs API (`<infiniband/efadv.h>`), which `rdma-sys` does not
//! bind, and the function-pointer tables of rdma-core's extended CQ and QP that this device calls.
//!
//! The structs are declared in their **first** (smallest) layout and passed with that `inlen`, so
//! every libefa since rdma-core v28 accepts them: libefa only reads `inlen` bytes and requires the
//! bytes it does not know to be zero. Newer fields that sit inside the old `reserved` bytes
//! (`efadv_qp_init_attr::flags`, `efadv_device_attr::inline_buf_size_ex`) are set or read only where
//! the device reports the matching capability, which only a libefa that knows them does.

use std::os::raw::{c_int, c_uint};

use rdma_sys::{
    __be32, ibv_ah, ibv_context, ibv_cq_ex, ibv_cq_init_attr_ex, ibv_data_buf, ibv_gid,
    ibv_poll_cq_attr, ibv_port_attr, ibv_qp, ibv_qp_ex, ibv_qp_init_attr, ibv_qp_init_attr_ex,
    ibv_sge, ibv_wc_opcode, verbs_context,
};

/// `EFADV_QP_DRIVER_TYPE_SRD`: the driver QP type of an SRD queue pair.
pub const EFADV_QP_DRIVER_TYPE_SRD: u32 = 0;

/// `EFADV_DEVICE_ATTR_CAPS_RDMA_READ`.
pub const CAPS_RDMA_READ: u32 = 1 << 0;
/// `EFADV_DEVICE_ATTR_CAPS_RNR_RETRY`: the RNR retry count of a QP can be modified.
pub const CAPS_RNR_RETRY: u32 = 1 << 1;
/// `EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID`: CQs can report the source GID of unknown senders.
pub const CAPS_CQ_WITH_SGID: u32 = 1 << 2;
/// `EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE`.
pub const CAPS_RDMA_WRITE: u32 = 1 << 3;
/// `EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV`.
pub const CAPS_UNSOLICITED_WRITE_RECV: u32 = 1 << 4;

/// `EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV`.
pub const QP_FLAGS_UNSOLICITED_WRITE_RECV: u16 = 1 << 0;

/// `EFADV_WC_EX_WITH_SGID`.
pub const WC_EX_WITH_SGID: u64 = 1 << 0;
/// `EFADV_WC_EX_WITH_IS_UNSOLICITED`.
pub const WC_EX_WITH_IS_UNSOLICITED: u64 = 1 << 1;

/// `struct efadv_device_attr` (32 bytes in every libefa; `inline_buf_size_ex` was `reserved[2]`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct efadv_device_attr {
    pub comp_mask: u64,
    pub max_sq_wr: u32,
    pub max_rq_wr: u32,
    pub max_sq_sge: u16,
    pub max_rq_sge: u16,
    pub inline_buf_size: u16,
    pub inline_buf_size_ex: u16,
    pub device_caps: u32,
    pub max_rdma_size: u32,
}

/// `struct efadv_qp_init_attr`, first 16 bytes (`flags` and `sl` were `reserved[4]`; the later
/// `wr_flags` is left out and therefore zero).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct efadv_qp_init_attr {
    pub comp_mask: u64,
    pub driver_qp_type: u32,
    pub flags: u16,
    pub sl: u8,
    pub reserved: u8,
}

/// `struct efadv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct efadv_ah_attr {
    pub comp_mask: u64,
    pub ahn: u16,
    pub reserved: [u8; 6],
}

/// `struct efadv_cq_init_attr`, first 16 bytes (the later `flags` and external-memory fields are
/// left out and therefore zero).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct efadv_cq_init_attr {
    pub comp_mask: u64,
    pub wc_flags: u64,
}

/// `struct efadv_cq` as every libefa that has `efadv_create_cq` lays it out.
#[repr(C)]
pub struct efadv_cq {
    pub comp_mask: u64,
    pub wc_read_sgid: Option<unsafe extern "C" fn(cq: *mut efadv_cq, sgid: *mut ibv_gid) -> c_int>,
}

/// `struct efadv_cq` of a libefa that knows unsolicited write-recv completions. Only read through a
/// pointer whose CQ was created with [`WC_EX_WITH_IS_UNSOLICITED`] (which an older libefa refuses).
#[repr(C)]
pub struct efadv_cq_v2 {
    pub comp_mask: u64,
    pub wc_read_sgid: Option<unsafe extern "C" fn(cq: *mut efadv_cq, sgid: *mut ibv_gid) -> c_int>,
    pub wc_is_unsolicited: Option<unsafe extern "C" fn(cq: *mut efadv_cq) -> bool>,
}

/// `struct efadv_mr_attr` (rdma-core 50, `efadv_query_mr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct efadv_mr_attr {
    pub comp_mask: u64,
    pub ic_id_validity: u16,
    pub recv_ic_id: u16,
    pub rdma_read_ic_id: u16,
    pub rdma_recv_ic_id: u16,
}

/// `efadv_mr_attr::ic_id_validity` bits.
pub const EFADV_MR_ATTR_VALIDITY_RECV_IC_ID: u16 = 1 << 0;
pub const EFADV_MR_ATTR_VALIDITY_RDMA_READ_IC_ID: u16 = 1 << 1;
pub const EFADV_MR_ATTR_VALIDITY_RDMA_RECV_IC_ID: u16 = 1 << 2;

/// `efadv_query_mr`'s type. rdma-core 50 added it (`EFA_1.3`): it is looked up when called, so
/// the crate still loads with an older libefa (Debian 12 has rdma-core 44), where a query is
/// `NotSupported`.
pub type EfadvQueryMr = unsafe extern "C" fn(
    ibvmr: *mut rdma_sys::ibv_mr,
    attr: *mut efadv_mr_attr,
    inlen: u32,
) -> c_int;

/// `efadv_query_mr` of the libefa this process loaded, if it has one.
pub fn efadv_query_mr() -> Option<EfadvQueryMr> {
    static SYM: std::sync::OnceLock<Option<EfadvQueryMr>> = std::sync::OnceLock::new();
    *SYM.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; a non-null result is libefa's
        // `efadv_query_mr`, whose C signature `EfadvQueryMr` is.
        unsafe {
            let p = libc::dlsym(libc::RTLD_DEFAULT, c"efadv_query_mr".as_ptr());
            (!p.is_null()).then(|| std::mem::transmute::<*mut libc::c_void, EfadvQueryMr>(p))
        }
    })
}

#[link(name = "efa")]
unsafe extern "C" {
    /// `efadv_query_device`: 0 or an errno (`EOPNOTSUPP` for a device that is not EFA).
    pub fn efadv_query_device(
        ibvctx: *mut ibv_context,
        attr: *mut efadv_device_attr,
        inlen: u32,
    ) -> c_int;

    /// `efadv_create_qp_ex`: an SRD queue pair (`attr_ex.qp_type` must be `IBV_QPT_DRIVER`), or
    /// null with `errno` set.
    pub fn efadv_create_qp_ex(
        ibvctx: *mut ibv_context,
        attr_ex: *mut ibv_qp_init_attr_ex,
        efa_attr: *mut efadv_qp_init_attr,
        inlen: u32,
    ) -> *mut ibv_qp;

    /// `efadv_query_ah`: the address handle number the device reports in receive completions.
    pub fn efadv_query_ah(ibvah: *mut ibv_ah, attr: *mut efadv_ah_attr, inlen: u32) -> c_int;

    /// `efadv_create_cq`: an extended CQ with EFA completion fields, or null with `errno` set.
    pub fn efadv_create_cq(
        ibvctx: *mut ibv_context,
        attr_ex: *mut ibv_cq_init_attr_ex,
        efa_attr: *mut efadv_cq_init_attr,
        inlen: u32,
    ) -> *mut ibv_cq_ex;

    /// `efadv_cq_from_ibv_cq_ex`: the EFA view of a CQ made by `efadv_create_cq` (null otherwise).
    pub fn efadv_cq_from_ibv_cq_ex(ibvcqx: *mut ibv_cq_ex) -> *mut efadv_cq;
}

/// `F_GETFL`.
pub const F_GETFL: c_int = 3;
/// `F_SETFL`.
pub const F_SETFL: c_int = 4;
/// `O_NONBLOCK` (Linux).
pub const O_NONBLOCK: c_int = 0o4000;

// The C library is always linked (std uses it); this one is not in std's public API.
unsafe extern "C" {
    /// `fcntl(2)` (variadic).
    pub fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
}

/// `ENOENT` (an empty CQ).
pub const ENOENT: c_int = 2;
/// `EAGAIN`.
pub const EAGAIN: c_int = 11;
/// `ENOMEM`.
pub const ENOMEM: c_int = 12;
/// `EINVAL`.
pub const EINVAL: c_int = 22;
/// `EOPNOTSUPP`.
pub const EOPNOTSUPP: c_int = 95;

/// The current thread's `errno` (0 when the OS reports none).
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Declares `$name`, a table of function pointers each copied from a field of the C struct `$c`
/// (`field = c_field: type`; in `$c` the field is an `Option`), and `$name::copy_from(p)`: the
/// table of `*p`, or the C name of the first `required` function it lacks. `optional` ones are
/// copied as the `Option`s they are.
macro_rules! fn_table {
    (
        $(#[$meta:meta])*
        pub struct $name:ident from $c:ty {
            required { $($field:ident = $c_field:ident: $ty:ty,)* }
            optional { $($ofield:ident = $oc_field:ident: $oty:ty,)* }
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy)]
        pub struct $name {
            $(pub $field: $ty,)*
            $(pub $ofield: Option<$oty>,)*
        }

        impl $name {
            /// The table of `*p`, or the C name of the first missing required function.
            ///
            /// # Safety
            ///
            /// `p` must point to a live struct.
            unsafe fn copy_from(p: *const $c) -> Result<$name, &'static str> {
                // SAFETY: the caller guarantees `p` is live; reading its function pointers is a
                // plain read.
                let c = unsafe { &*p };
                Ok($name {
                    $($field: c.$c_field.ok_or(stringify!($c_field))?,)*
                    $($ofield: c.$oc_field,)*
                })
            }
        }
    };
}

fn_table! {
    /// The polling functions of an extended CQ, checked once at creation so that calling them can
    /// never hit a missing entry.
    pub struct CqFns from ibv_cq_ex {
        required {
            start_poll = start_poll:
                unsafe extern "C" fn(*mut ibv_cq_ex, *mut ibv_poll_cq_attr) -> c_int,
            next_poll = next_poll: unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int,
            end_poll = end_poll: unsafe extern "C" fn(*mut ibv_cq_ex),
            read_opcode = read_opcode: unsafe extern "C" fn(*mut ibv_cq_ex) -> ibv_wc_opcode::Type,
            read_vendor_err = read_vendor_err: unsafe extern "C" fn(*mut ibv_cq_ex) -> u32,
            read_byte_len = read_byte_len: unsafe extern "C" fn(*mut ibv_cq_ex) -> u32,
            read_imm_data = read_imm_data: unsafe extern "C" fn(*mut ibv_cq_ex) -> __be32,
            read_wc_flags = read_wc_flags: unsafe extern "C" fn(*mut ibv_cq_ex) -> c_uint,
            read_src_qp = read_src_qp: unsafe extern "C" fn(*mut ibv_cq_ex) -> u32,
            read_slid = read_slid: unsafe extern "C" fn(*mut ibv_cq_ex) -> u32,
        }
        optional {}
    }
}

impl CqFns {
    /// The table of `cq`, or the name of the first missing function.
    ///
    /// # Safety
    ///
    /// `cq` must point to a live extended CQ.
    pub unsafe fn of(cq: *const ibv_cq_ex) -> Result<CqFns, &'static str> {
        // SAFETY: the caller's live CQ.
        unsafe { CqFns::copy_from(cq) }
    }
}

fn_table! {
    /// The work-request builder functions of an extended QP (`ibv_wr_*`), checked once at
    /// creation.
    pub struct WrFns from ibv_qp_ex {
        required {
            start = wr_start: unsafe extern "C" fn(*mut ibv_qp_ex),
            complete = wr_complete: unsafe extern "C" fn(*mut ibv_qp_ex) -> c_int,
            abort = wr_abort: unsafe extern "C" fn(*mut ibv_qp_ex),
            send = wr_send: unsafe extern "C" fn(*mut ibv_qp_ex),
            send_imm = wr_send_imm: unsafe extern "C" fn(*mut ibv_qp_ex, __be32),
            set_ud_addr = wr_set_ud_addr:
                unsafe extern "C" fn(*mut ibv_qp_ex, *mut ibv_ah, u32, u32),
            set_sge_list = wr_set_sge_list:
                unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_sge),
            set_inline_data_list = wr_set_inline_data_list:
                unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_data_buf),
        }
        optional {
            rdma_read = wr_rdma_read: unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64),
            rdma_write = wr_rdma_write: unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64),
            rdma_write_imm = wr_rdma_write_imm:
                unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, __be32),
        }
    }
}

impl WrFns {
    /// The table of `qpx`, or the name of the first missing function. The RDMA entries are
    /// required only when `read` / `write` is asked for.
    ///
    /// # Safety
    ///
    /// `qpx` must point to a live extended QP.
    pub unsafe fn of(
        qpx: *const ibv_qp_ex,
        read: bool,
        write: bool,
    ) -> Result<WrFns, &'static str> {
        // SAFETY: the caller's live QP.
        let fns = unsafe { WrFns::copy_from(qpx) }?;
        if read && fns.rdma_read.is_none() {
            return Err("wr_rdma_read");
        }
        if write && (fns.rdma_write.is_none() || fns.rdma_write_imm.is_none()) {
            return Err("wr_rdma_write");
        }
        Ok(fns)
    }
}

/// Compile-time checks that the declared layouts match libefa's.
const _: () = {
    assert!(std::mem::size_of::<efadv_device_attr>() == 32);
    assert!(std::mem::size_of::<efadv_qp_init_attr>() == 16);
    assert!(std::mem::size_of::<efadv_ah_attr>() == 16);
    assert!(std::mem::size_of::<efadv_cq_init_attr>() == 16);
    assert!(std::mem::offset_of!(efadv_device_attr, device_caps) == 24);
    assert!(std::mem::offset_of!(efadv_device_attr, max_rdma_size) == 28);
};

// ---------------------------------------------------------------------------------------------
// libibverbs' inline dispatch, done right.
//
// verbs.h's inline helpers (`ibv_create_qp_ex`, `ibv_create_cq_ex`, `ibv_query_port`) find the
// provider's operation through the `verbs_context` around the program's `ibv_context`, which
// exists when `context.abi_compat == __VERBS_ABI_IS_EXTENDED` (`UINTPTR_MAX`). rdma-sys 0.3.0's
// Rust copies compare `abi_compat` with `u32::MAX`, so on 64-bit they never find the operation
// and fail with `EOPNOTSUPP` without reaching the provider: UD queue pairs (DGRAM endpoints) could
// not be created on any EFA. These do the lookup with the right check (docs/efa-hardware.md,
// "rdma-sys").

/// The provider's operation `$op` (a field of `verbs_context`) for the context `$ctx`, if the
/// context is extended and its provider has it. Unsafe: `$ctx` must be a live context from
/// `ibv_open_device`.
macro_rules! provider_op {
    ($ctx:expr, $op:ident) => {
        verbs_ctx($ctx, std::mem::offset_of!(verbs_context, $op)).and_then(|v| (*v).$op)
    };
}

/// The `verbs_context` around `ctx` when its `sz` covers the operation at `op_offset`.
///
/// # Safety
/// `ctx` is a live context from `ibv_open_device`.
unsafe fn verbs_ctx(ctx: *mut ibv_context, op_offset: usize) -> Option<*mut verbs_context> {
    // SAFETY: the caller's context is live.
    if unsafe { (*ctx).abi_compat } as usize != usize::MAX {
        return None;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    let vctx = (ctx as *mut u8).wrapping_sub(off) as *mut verbs_context;
    // SAFETY: an extended context sits at the end of a `verbs_context` (verbs.h's contract).
    let sz = unsafe { (*vctx).sz };
    (sz >= std::mem::size_of::<verbs_context>() - op_offset).then_some(vctx)
}

/// `ibv_create_qp_ex`: the plain `ibv_create_qp` when only the PD is given, else the provider's
/// `create_qp_ex`; null with errno `EOPNOTSUPP` when the provider has none.
///
/// # Safety
/// `ctx` is live; `attr` is a valid init attribute struct.
pub unsafe fn create_qp_ex(ctx: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    // SAFETY: the caller's attributes.
    let mask = unsafe { (*attr).comp_mask };
    if mask == rdma_sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 {
        // SAFETY: `ibv_qp_init_attr` is the prefix of `ibv_qp_init_attr_ex`, as verbs.h uses it.
        return unsafe { rdma_sys::ibv_create_qp((*attr).pd, attr as *mut ibv_qp_init_attr) };
    }
    // SAFETY: the caller's live context; the `verbs_context` around it is read only as far as
    // its size says.
    let op = unsafe { provider_op!(ctx, create_qp_ex) };
    match op {
        // SAFETY: the provider's operation, with the caller's arguments.
        Some(f) => unsafe { f(ctx, attr) },
        None => unsupported(),
    }
}

/// `ibv_create_cq_ex` through the provider's `create_cq_ex`; null with errno `EOPNOTSUPP` when
/// it has none.
///
/// # Safety
/// `ctx` is live; `attr` is a valid init attribute struct.
pub unsafe fn create_cq_ex(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    // SAFETY: the caller's live context; the `verbs_context` around it is read only as far as
    // its size says.
    let op = unsafe { provider_op!(ctx, create_cq_ex) };
    match op {
        // SAFETY: the provider's operation, with the caller's arguments.
        Some(f) => unsafe { f(ctx, attr) },
        None => unsupported(),
    }
}

/// `ibv_query_port` through the provider's extended `query_port` (with the full struct size),
/// else the exported compat call.
///
/// # Safety
/// `ctx` is live; `attr` is writable.
pub unsafe fn query_port(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int {
    // SAFETY: the caller's live context; the `verbs_context` around it is read only as far as
    // its size says.
    let op = unsafe { provider_op!(ctx, query_port) };
    match op {
        // SAFETY: the provider's operation, told the size of the caller's struct.
        Some(f) => unsafe { f(ctx, port, attr, std::mem::size_of::<ibv_port_attr>()) },
        None => {
            // SAFETY: the caller's struct zeroed, then the old layout (its prefix) filled.
            unsafe {
                std::ptr::write_bytes(attr, 0, 1);
                rdma_sys::ibv_query_port(ctx, port, attr as *mut rdma_sys::_compat_ibv_port_attr)
            }
        }
    }
}

/// Null with errno `EOPNOTSUPP`: what verbs.h's helpers return when the provider lacks the
/// operation.
fn unsupported<T>() -> *mut T {
    // SAFETY: the thread's errno location is always valid.
    unsafe { *libc::__errno_location() = EOPNOTSUPP };
    std::ptr::null_mut()
}
