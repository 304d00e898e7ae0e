//! The `ibv_cq_ex` polling table (`ibv_start_poll` .. `ibv_end_poll`, `ibv_wc_read_*`) and
//! `efadv_cq`'s `wc_read_sgid` / `wc_is_unsolicited`.

use std::os::raw::c_int;

use crate::abi::*;
use crate::cq::Cqe;
use crate::verbs::{Cq, guard};

/// # Safety
/// `cq` is a CQ this library made.
unsafe fn cq<'a>(cq: *mut ibv_cq_ex) -> &'a Cq {
    // SAFETY: as the caller promises (the ibv_cq_ex is the first field of `Cq`).
    unsafe { &*(cq as *const Cq) }
}

/// Loads `e` as the current completion.
fn load(c: &Cq, p: *mut ibv_cq_ex, e: Cqe) {
    // SAFETY: the program reads wr_id and status from its ibv_cq_ex after a poll.
    unsafe {
        (*p).wr_id = e.wr_id;
        (*p).status = e.status;
    }
    c.core.set_cur(Some(e));
}

pub unsafe extern "C" fn start_poll(p: *mut ibv_cq_ex, _attr: *mut ibv_poll_cq_attr) -> c_int {
    // SAFETY: the program's CQ.
    unsafe { next_poll(p) }
}

/// Loads the next completion, `ENOENT` when there is none (`start_poll` and `next_poll` alike).
pub unsafe extern "C" fn next_poll(p: *mut ibv_cq_ex) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the program's CQ.
        let c = unsafe { cq(p) };
        match c.core.pop() {
            Some(e) => {
                load(c, p, e);
                0
            }
            None => libc::ENOENT,
        }
    })
}

pub unsafe extern "C" fn end_poll(p: *mut ibv_cq_ex) {
    // SAFETY: the program's CQ.
    unsafe { cq(p) }.core.set_cur(None);
}

fn read<R: Default>(p: *mut ibv_cq_ex, f: impl FnOnce(&Cqe) -> R) -> R {
    // SAFETY: the program's CQ, between start_poll and end_poll.
    unsafe { cq(p) }.core.cur(f).unwrap_or_default()
}

pub unsafe extern "C" fn read_opcode(p: *mut ibv_cq_ex) -> c_int {
    read(p, |e| e.opcode)
}
pub unsafe extern "C" fn read_vendor_err(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| e.vendor_err)
}
pub unsafe extern "C" fn read_byte_len(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| e.byte_len)
}
pub unsafe extern "C" fn read_imm_data(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| e.imm.map_or(0, u32::to_be))
}
pub unsafe extern "C" fn read_qp_num(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| e.qp_num)
}
pub unsafe extern "C" fn read_src_qp(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| e.src_qp)
}
pub unsafe extern "C" fn read_wc_flags(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| if e.imm.is_some() { IBV_WC_WITH_IMM } else { 0 })
}
pub unsafe extern "C" fn read_slid(p: *mut ibv_cq_ex) -> u32 {
    read(p, |e| u32::from(e.slid))
}
pub unsafe extern "C" fn read_sl(_p: *mut ibv_cq_ex) -> u8 {
    0
}
pub unsafe extern "C" fn read_dlid_path_bits(_p: *mut ibv_cq_ex) -> u8 {
    0
}

/// # Safety
/// `dv` is the `efadv_cq` of a CQ this library made.
unsafe fn cq_of_dv<'a>(dv: *mut efadv_cq) -> &'a Cq {
    let off = std::mem::offset_of!(Cq, dv);
    // SAFETY: the efadv_cq handed out is the `dv` field of a `Cq`.
    unsafe { &*((dv as *mut u8).sub(off) as *const Cq) }
}

/// The source GID of the current receive, only when the receiver holds no AH for the sender
/// (`slid` 0xffff); `ENOENT` otherwise.
pub unsafe extern "C" fn wc_read_sgid(dv: *mut efadv_cq, sgid: *mut ibv_gid) -> c_int {
    guard(-libc::EIO, || {
        // SAFETY: the program's efadv_cq.
        let c = unsafe { cq_of_dv(dv) };
        match c.core.cur(|e| e.sgid).flatten() {
            Some(g) if !sgid.is_null() => {
                // SAFETY: the program's out-parameter.
                unsafe { (*sgid).raw = g };
                0
            }
            _ => -libc::ENOENT,
        }
    })
}

pub unsafe extern "C" fn wc_is_unsolicited(dv: *mut efadv_cq) -> bool {
    // SAFETY: the program's efadv_cq.
    let c = unsafe { cq_of_dv(dv) };
    c.core.cur(|e| e.unsolicited).unwrap_or(false)
}
