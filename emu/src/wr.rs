//! The `ibv_qp_ex` work-request table (`ibv_wr_start` .. `ibv_wr_complete`): each operation
//! call begins a work request, the setters fill the current one, `wr_complete` checks the whole
//! batch and posts it (or nothing).

use std::os::raw::{c_int, c_void};

use crate::abi::*;
use crate::qp::{SendOp, SendReq};
use crate::verbs::{Ah, Batch, Qp, guard, obj};

/// Fills the table for the operations `ops` (`IBV_QP_EX_WITH_*`) asks for.
pub fn fill(q: &mut ibv_qp_ex, ops: u64) {
    if ops == 0 {
        return;
    }
    q.wr_start = Some(wr_start);
    q.wr_complete = Some(wr_complete);
    q.wr_abort = Some(wr_abort);
    q.wr_set_ud_addr = Some(wr_set_ud_addr);
    q.wr_set_sge = Some(wr_set_sge);
    q.wr_set_sge_list = Some(wr_set_sge_list);
    q.wr_set_inline_data = Some(wr_set_inline_data);
    q.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    if ops & IBV_QP_EX_WITH_SEND != 0 {
        q.wr_send = Some(wr_send);
    }
    if ops & IBV_QP_EX_WITH_SEND_WITH_IMM != 0 {
        q.wr_send_imm = Some(wr_send_imm);
    }
    if ops & IBV_QP_EX_WITH_RDMA_READ != 0 {
        q.wr_rdma_read = Some(wr_rdma_read);
    }
    if ops & IBV_QP_EX_WITH_RDMA_WRITE != 0 {
        q.wr_rdma_write = Some(wr_rdma_write);
    }
    if ops & IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM != 0 {
        q.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    }
}

/// Runs `f` on the batch of `qpx` (a started one).
fn with(qpx: *mut ibv_qp_ex, f: impl FnOnce(&mut Batch, &ibv_qp_ex)) {
    guard((), || {
        // SAFETY: a queue pair this library made.
        let Some(q) = (unsafe { obj::<Qp, _>(qpx) }) else {
            return;
        };
        let mut b = q.batch.lock();
        match b.as_mut() {
            Some(batch) => f(batch, &q.qpx),
            None => tracing::debug!("efa-emu: ibv_wr_* call outside ibv_wr_start"),
        }
    })
}

fn begin(qpx: *mut ibv_qp_ex, op: SendOp) {
    with(qpx, |b, q| {
        b.reqs.push(SendReq {
            wr_id: q.wr_id,
            op,
            dest: None,
            sges: Vec::new(),
            inline: None,
        })
    });
}

/// Applies `f` to the current work request.
fn current(qpx: *mut ibv_qp_ex, f: impl FnOnce(&mut SendReq) -> bool) {
    with(qpx, |b, _| match b.reqs.last_mut() {
        Some(r) => {
            if !f(r) {
                b.bad = true;
            }
        }
        None => b.bad = true,
    });
}

unsafe extern "C" fn wr_start(qpx: *mut ibv_qp_ex) {
    guard((), || {
        // SAFETY: a queue pair this library made.
        if let Some(q) = unsafe { obj::<Qp, _>(qpx) } {
            *q.batch.lock() = Some(Batch::default());
        }
    })
}

unsafe extern "C" fn wr_complete(qpx: *mut ibv_qp_ex) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: a queue pair this library made.
        let Some(q) = (unsafe { obj::<Qp, _>(qpx) }) else {
            return libc::EINVAL;
        };
        let Some(b) = q.batch.lock().take() else {
            return libc::EINVAL;
        };
        if b.bad {
            return libc::EINVAL;
        }
        match q.core.post_sends(b.reqs) {
            Ok(()) => 0,
            Err((_, e)) => e,
        }
    })
}

unsafe extern "C" fn wr_abort(qpx: *mut ibv_qp_ex) {
    guard((), || {
        // SAFETY: a queue pair this library made.
        if let Some(q) = unsafe { obj::<Qp, _>(qpx) } {
            *q.batch.lock() = None;
        }
    })
}

unsafe extern "C" fn wr_send(qpx: *mut ibv_qp_ex) {
    begin(qpx, SendOp::Send { imm: None });
}

unsafe extern "C" fn wr_send_imm(qpx: *mut ibv_qp_ex, imm_be: u32) {
    begin(
        qpx,
        SendOp::Send {
            imm: Some(u32::from_be(imm_be)),
        },
    );
}

unsafe extern "C" fn wr_rdma_read(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    begin(qpx, SendOp::Read { rkey, addr });
}

unsafe extern "C" fn wr_rdma_write(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    begin(
        qpx,
        SendOp::Write {
            rkey,
            addr,
            imm: None,
        },
    );
}

unsafe extern "C" fn wr_rdma_write_imm(qpx: *mut ibv_qp_ex, rkey: u32, addr: u64, imm_be: u32) {
    begin(
        qpx,
        SendOp::Write {
            rkey,
            addr,
            imm: Some(u32::from_be(imm_be)),
        },
    );
}

unsafe extern "C" fn wr_set_ud_addr(qpx: *mut ibv_qp_ex, ah: *mut ibv_ah, qpn: u32, qkey: u32) {
    // SAFETY: an AH this library made (or null, which marks the batch bad).
    let ah = unsafe { obj::<Ah, _>(ah) }.map(|a| a.gid);
    current(qpx, |r| match ah {
        Some(gid) => {
            r.dest = Some((gid, qpn, qkey));
            true
        }
        None => false,
    });
}

unsafe extern "C" fn wr_set_sge(qpx: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    current(qpx, |r| {
        r.sges = vec![ibv_sge { addr, length, lkey }];
        r.inline = None;
        true
    });
}

unsafe extern "C" fn wr_set_sge_list(qpx: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    let sges = if n == 0 {
        Some(Vec::new())
    } else if list.is_null() || n > 64 {
        None
    } else {
        // SAFETY: `n` entries, as the program promises.
        Some(unsafe { std::slice::from_raw_parts(list, n) }.to_vec())
    };
    current(qpx, |r| match sges {
        Some(s) => {
            r.sges = s;
            r.inline = None;
            true
        }
        None => false,
    });
}

unsafe extern "C" fn wr_set_inline_data(qpx: *mut ibv_qp_ex, addr: *mut c_void, len: usize) {
    let buf = ibv_data_buf { addr, length: len };
    // SAFETY: one buffer, as the program promises.
    unsafe { wr_set_inline_data_list(qpx, 1, &buf) };
}

unsafe extern "C" fn wr_set_inline_data_list(
    qpx: *mut ibv_qp_ex,
    n: usize,
    list: *const ibv_data_buf,
) {
    let mut data = Vec::new();
    let mut ok = n == 0 || !list.is_null();
    if ok {
        for i in 0..n {
            // SAFETY: `n` entries, as the program promises.
            let b = unsafe { &*list.add(i) };
            if b.length > 4096 || (b.length > 0 && b.addr.is_null()) {
                ok = false;
                break;
            }
            if b.length > 0 {
                // SAFETY: inline data is copied at this call, from the program's buffer.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(b.addr as *const u8, b.length)
                });
            }
        }
    }
    current(qpx, |r| {
        if ok {
            r.inline = Some(data);
            r.sges.clear();
        }
        ok
    });
}
