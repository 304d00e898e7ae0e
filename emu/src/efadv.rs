//! The exported `efadv_*` functions (libefa.so.1).

use std::os::raw::c_int;

use efa::device::QpType;

use crate::abi::*;
use crate::verbs::{Ah, context, copy_prefix, guard, new_cq, new_qp, null, obj};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_query_device(
    ctx: *mut ibv_context,
    attr: *mut efadv_device_attr,
    inlen: u32,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's context.
        let Some(c) = (unsafe { context(ctx) }) else {
            return libc::EINVAL;
        };
        let cfg = &c.nic.cfg;
        let a = efadv_device_attr {
            comp_mask: 0,
            max_sq_wr: cfg.max_sq_wr,
            max_rq_wr: cfg.max_rq_wr,
            max_sq_sge: cfg.max_sq_sge,
            max_rq_sge: cfg.max_rq_sge,
            inline_buf_size: cfg.inline_size,
            inline_buf_size_ex: 0,
            device_caps: cfg.caps.bits(),
            max_rdma_size: if cfg.caps.rdma_read || cfg.caps.rdma_write {
                cfg.max_rdma_size
            } else {
                0
            },
        };
        // SAFETY: the program gave `inlen` bytes.
        unsafe { copy_prefix(attr, &a, inlen as usize) }
    })
}

/// The SRD queue pair.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_create_qp_ex(
    _ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
    efa_attr: *mut efadv_qp_init_attr,
    inlen: u32,
) -> *mut ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's attributes (`inlen` bytes of `efa_attr`).
        let (Some(a), Some(e)) = (unsafe { attr.as_mut() }, unsafe { efa_attr.as_ref() }) else {
            return null(libc::EINVAL);
        };
        // As libefa: the fields it knows of an `inlen` it understands, nothing in `comp_mask`
        // or `reserved`, and zeros in any tail it does not know.
        let len = inlen as usize;
        if len < std::mem::offset_of!(efadv_qp_init_attr, flags)
            || e.comp_mask != 0
            || (len > std::mem::offset_of!(efadv_qp_init_attr, reserved) && e.reserved != 0)
            // SAFETY: the program gave `inlen` bytes.
            || !unsafe { ext_cleared(efa_attr.cast(), std::mem::size_of::<efadv_qp_init_attr>(), len) }
            || a.qp_type != IBV_QPT_DRIVER
        {
            return null(libc::EINVAL);
        }
        if e.driver_qp_type != EFADV_QP_DRIVER_TYPE_SRD
            || a.comp_mask & !(IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) != 0
        {
            return null(libc::EOPNOTSUPP);
        }
        if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || !a.srq.is_null() {
            return null(libc::EINVAL);
        }
        let flags = if inlen as usize >= std::mem::offset_of!(efadv_qp_init_attr, sl) {
            e.flags
        } else {
            0
        };
        if flags & !EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV != 0 {
            return null(libc::EOPNOTSUPP);
        }
        let ops = if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            a.send_ops_flags
        } else {
            0
        };
        // SAFETY: the program's PD and CQs.
        unsafe {
            new_qp(
                a.pd,
                a.send_cq,
                a.recv_cq,
                a.qp_context,
                &mut a.cap,
                QpType::Srd,
                ops,
                flags & EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV != 0,
            )
        }
    })
}

/// The first SRD entry point (`efadv_create_driver_qp`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_create_driver_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
    driver_qp_type: u32,
) -> *mut ibv_qp {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else {
            return null(libc::EINVAL);
        };
        if driver_qp_type != EFADV_QP_DRIVER_TYPE_SRD || a.qp_type != IBV_QPT_DRIVER {
            return null(libc::EINVAL);
        }
        // SAFETY: the program's PD and CQs.
        unsafe {
            new_qp(
                pd,
                a.send_cq,
                a.recv_cq,
                a.qp_context,
                &mut a.cap,
                QpType::Srd,
                0,
                false,
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_query_ah(
    ah: *mut ibv_ah,
    attr: *mut efadv_ah_attr,
    inlen: u32,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: an AH this library made.
        let Some(a) = (unsafe { obj::<Ah, _>(ah) }) else {
            return libc::EINVAL;
        };
        let out = efadv_ah_attr {
            comp_mask: 0,
            ahn: a.ahn,
            reserved: [0; 6],
        };
        // SAFETY: the program gave `inlen` bytes.
        unsafe { copy_prefix(attr, &out, inlen as usize) }
    })
}

/// `efadv_query_mr` (rdma-core 50): the interconnects a registration's traffic uses. The
/// emulated NIC has one interconnect per device, its index: all three ids are it, all valid.
/// `EINVAL` for a region this library did not make, a non-zero `comp_mask` or an `inlen` shorter
/// than the fields it fills (16 bytes).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_query_mr(
    mr: *mut ibv_mr,
    attr: *mut efadv_mr_attr,
    inlen: u32,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a region this library made.
        let Some(m) = (unsafe { obj::<crate::verbs::Mr, _>(mr) }) else {
            return libc::EINVAL;
        };
        // SAFETY: the program's attributes, `inlen` bytes of them.
        let Some(a) = (unsafe { attr.as_ref() }) else {
            return libc::EINVAL;
        };
        if a.comp_mask != 0 || (inlen as usize) < std::mem::size_of::<efadv_mr_attr>() {
            return libc::EINVAL;
        }
        let ic = m.nic.cfg.index as u16;
        let out = efadv_mr_attr {
            comp_mask: 0,
            ic_id_validity: EFADV_MR_ATTR_VALIDITY_RECV_IC_ID
                | EFADV_MR_ATTR_VALIDITY_RDMA_READ_IC_ID
                | EFADV_MR_ATTR_VALIDITY_RDMA_RECV_IC_ID,
            recv_ic_id: ic,
            rdma_read_ic_id: ic,
            rdma_recv_ic_id: ic,
        };
        // SAFETY: the program gave `inlen` bytes.
        unsafe { copy_prefix(attr, &out, inlen as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_create_cq(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
    efa_attr: *mut efadv_cq_init_attr,
    inlen: u32,
) -> *mut ibv_cq_ex {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the program's attributes.
        let (Some(a), Some(e)) = (unsafe { attr.as_ref() }, unsafe { efa_attr.as_ref() }) else {
            return null(libc::EINVAL);
        };
        // As libefa: `wc_flags` within `inlen`, nothing in `comp_mask`, zeros in an unknown tail.
        let len = inlen as usize;
        if len < std::mem::size_of::<efadv_cq_init_attr>()
            || e.comp_mask != 0
            // SAFETY: the program gave `inlen` bytes.
            || !unsafe { ext_cleared(efa_attr.cast(), std::mem::size_of::<efadv_cq_init_attr>(), len) }
        {
            return null(libc::EINVAL);
        }
        let wc_flags = e.wc_flags;
        // SAFETY: the program's context (null is refused by new_cq below).
        let caps = unsafe { crate::verbs::context(ctx) }.map(|c| c.nic.cfg.caps);
        let mut supported = 0;
        if caps.is_some_and(|c| c.cq_with_sgid) {
            supported |= EFADV_WC_EX_WITH_SGID;
        }
        if caps.is_some_and(|c| c.unsolicited_write_recv) {
            supported |= EFADV_WC_EX_WITH_IS_UNSOLICITED;
        }
        if a.wc_flags & !IBV_WC_STANDARD_FLAGS != 0 || wc_flags & !supported != 0 {
            return null(libc::EOPNOTSUPP);
        }
        // SAFETY: the program's context and channel.
        unsafe {
            new_cq(
                ctx,
                a.cqe,
                a.cq_context,
                a.channel,
                wc_flags & EFADV_WC_EX_WITH_SGID != 0,
                wc_flags & EFADV_WC_EX_WITH_IS_UNSOLICITED != 0,
            )
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn emu_efadv_cq_from_ibv_cq_ex(cq: *mut ibv_cq_ex) -> *mut efadv_cq {
    if cq.is_null() {
        return std::ptr::null_mut();
    }
    let off = std::mem::offset_of!(crate::verbs::Cq, dv);
    // SAFETY: every ibv_cq_ex this library hands out is the first field of a `Cq`.
    unsafe { (cq as *mut u8).add(off) as *mut efadv_cq }
}

/// Whether the bytes of a `len`-byte argument past the `known` bytes of its struct are all zero
/// (libibverbs' `is_ext_cleared`: a newer caller's fields this version does not know must be
/// unset).
///
/// # Safety
///
/// `p` points to `len` readable bytes.
unsafe fn ext_cleared(p: *const u8, known: usize, len: usize) -> bool {
    if len <= known {
        return true;
    }
    // SAFETY: the caller's contract.
    let tail = unsafe { std::slice::from_raw_parts(p.add(known), len - known) };
    tail.iter().all(|&b| b == 0)
}
