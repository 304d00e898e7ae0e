//! The queue pair on rdma-core — created with `efadv_create_qp_ex` (SRD) or `ibv_create_qp_ex`
//! (UD), brought to RTS, posted to with the `ibv_wr_*` builder and `ibv_post_recv` — and
//! [`VerbsNic`], the [`Nic`] it makes together with its [`Cq`].

use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys::{
    ibv_data_buf, ibv_qp, ibv_qp_attr, ibv_qp_ex, ibv_qp_init_attr_ex, ibv_recv_wr, ibv_sge,
};

use super::cq::Cq;
use super::ffi::{self, EAGAIN, EINVAL, ENOMEM, EOPNOTSUPP, WrFns, errno};
use super::nic::{Nic, Payload, RawWc, SendOp, SendWqe, Sge};
use super::qp_state::{self, BringUpPlan, ModifyQp, QpOps};
use super::verbs::{Ah, EfaMr, Pd, Shared};
use super::verbs_error;
use crate::addr::Gid;
use crate::device::QpType;
use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;

// ---------------------------------------------------------------------------------------------
// Queue pair
// ---------------------------------------------------------------------------------------------

type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// A queue pair, destroyed on drop.
struct QpHandle {
    qp: NonNull<ibv_qp>,
    qpx: NonNull<ibv_qp_ex>,
    wr: WrFns,
    post_recv: PostRecvFn,
    /// Still to be destroyed.
    live: bool,
    _pd: Arc<Pd>,
}

impl QpHandle {
    /// `ibv_destroy_qp`; false when it failed (then the QP may still be using its buffers).
    fn destroy(&mut self) -> bool {
        if !self.live {
            return true;
        }
        self.live = false;
        // SAFETY: created by `efadv_create_qp_ex`/`ibv_create_qp_ex`, destroyed once.
        let rc = unsafe { rdma_sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "efa: ibv_destroy_qp failed");
        }
        rc == 0
    }
}

// SAFETY: used by one owner (`&mut self` for every post) and destroyed in `Drop`.
unsafe impl Send for QpHandle {}

impl QpOps for QpHandle {
    fn modify_qp(&mut self, m: &ModifyQp) -> std::result::Result<(), i32> {
        // SAFETY: plain data; all-zero is valid.
        let mut attr: ibv_qp_attr = unsafe { MaybeUninit::zeroed().assume_init() };
        attr.qp_state = m.state.ibv();
        attr.pkey_index = m.pkey_index;
        attr.port_num = m.port_num;
        attr.qkey = m.qkey;
        attr.sq_psn = m.sq_psn;
        attr.rnr_retry = m.rnr_retry;
        // SAFETY: live QP and attribute struct; the mask selects the fields set above.
        match unsafe { rdma_sys::ibv_modify_qp(self.qp.as_ptr(), &mut attr, m.mask as c_int) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }
}

impl Drop for QpHandle {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// How to create a queue pair.
#[derive(Clone, Debug)]
pub struct QpSpec {
    /// SRD or UD.
    pub qp_type: QpType,
    /// Send queue depth.
    pub send_depth: u32,
    /// Receive queue depth.
    pub recv_depth: u32,
    /// Scatter/gather entries per send.
    pub max_send_sge: u32,
    /// Inline bytes per send.
    pub max_inline: u32,
    /// Post RDMA reads (SRD only).
    pub rdma_read: bool,
    /// Post RDMA writes (SRD only).
    pub rdma_write: bool,
    /// Ask for unsolicited write-recv (SRD with RDMA write only).
    pub unsolicited_write_recv: bool,
    /// Entries of the CQ (at least `send_depth + recv_depth`).
    pub cq_depth: u32,
    /// Ask the CQ for the GID of unknown senders.
    pub cq_with_sgid: bool,
    /// The QKEY.
    pub qkey: u32,
    /// RNR retry count.
    pub rnr_retry: u8,
    /// The device can set the RNR retry count.
    pub rnr_retry_modifiable: bool,
}

/// The [`Nic`] of one queue pair on rdma-core: the QP, its CQ (both directions), and the device's
/// shared protection domain and address handles.
pub struct VerbsNic {
    /// Destroyed first (the CQ cannot be destroyed while a QP uses it).
    qp: Option<QpHandle>,
    cq: Cq,
    shared: Arc<Shared>,
    qpn: u32,
    unsolicited: bool,
}

impl VerbsNic {
    /// Creates the CQ and the queue pair and brings it to RTS. Returns the NIC and the QPN.
    pub fn create(
        shared: &Arc<Shared>,
        spec: &QpSpec,
        notifier: &Arc<Notifier>,
    ) -> Result<VerbsNic> {
        let ctx = shared.pd.context().clone();
        let srd = spec.qp_type == QpType::Srd;
        let want_uns = srd && spec.rdma_write && spec.unsolicited_write_recv;
        let cq = Cq::create(
            &ctx,
            spec.cq_depth.max(1),
            spec.cq_with_sgid,
            want_uns,
            notifier,
            format!("efa-cq-{}", ctx.name()),
        )?;
        let unsolicited = want_uns && cq.unsolicited;
        if want_uns && !unsolicited {
            tracing::warn!(
                device = ctx.name(),
                "efa: the CQ cannot report unsolicited write-recv; RDMA writes with immediate \
                 data will consume receive buffers on this queue pair"
            );
        }
        use rdma_sys::ibv_qp_create_send_ops_flags as ops;
        use rdma_sys::ibv_qp_init_attr_mask as im;
        // SAFETY: plain data; all-zero is valid.
        let mut init: ibv_qp_init_attr_ex = unsafe { MaybeUninit::zeroed().assume_init() };
        init.send_cq = cq.as_cq();
        init.recv_cq = cq.as_cq();
        init.cap.max_send_wr = spec.send_depth;
        init.cap.max_recv_wr = spec.recv_depth;
        init.cap.max_send_sge = spec.max_send_sge;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = spec.max_inline;
        init.sq_sig_all = 1;
        init.pd = shared.pd.pd.as_ptr();
        init.comp_mask = (im::IBV_QP_INIT_ATTR_PD | im::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS).0;
        let mut send_ops = ops::IBV_QP_EX_WITH_SEND | ops::IBV_QP_EX_WITH_SEND_WITH_IMM;
        if srd && spec.rdma_read {
            send_ops |= ops::IBV_QP_EX_WITH_RDMA_READ;
        }
        if srd && spec.rdma_write {
            send_ops =
                send_ops | ops::IBV_QP_EX_WITH_RDMA_WRITE | ops::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
        }
        init.send_ops_flags = u64::from(send_ops.0);
        let (qp, verb) = if srd {
            init.qp_type = rdma_sys::ibv_qp_type::IBV_QPT_DRIVER;
            let mut efa = ffi::efadv_qp_init_attr {
                driver_qp_type: ffi::EFADV_QP_DRIVER_TYPE_SRD,
                flags: if unsolicited {
                    ffi::QP_FLAGS_UNSOLICITED_WRITE_RECV
                } else {
                    0
                },
                ..Default::default()
            };
            // SAFETY: valid context and attribute structs of the sizes passed.
            let qp = unsafe {
                ffi::efadv_create_qp_ex(
                    ctx.as_ptr(),
                    &mut init,
                    &mut efa,
                    std::mem::size_of_val(&efa) as u32,
                )
            };
            (qp, "efadv_create_qp_ex")
        } else {
            init.qp_type = rdma_sys::ibv_qp_type::IBV_QPT_UD;
            // SAFETY: as above (rdma-sys's inline helper is broken on 64-bit: ffi::create_qp_ex).
            let qp = unsafe { ffi::create_qp_ex(ctx.as_ptr(), &mut init) };
            (qp, "ibv_create_qp_ex")
        };
        let qp = NonNull::new(qp).ok_or_else(|| {
            verbs_error(verb, errno()).with_detail(format!(
                "{:?} queue pair, depths {}/{}, inline {}",
                spec.qp_type, spec.send_depth, spec.recv_depth, spec.max_inline
            ))
        })?;
        // SAFETY: live QP.
        let qpx = unsafe { rdma_sys::ibv_qp_to_qp_ex(qp.as_ptr()) };
        // SAFETY: live QP; its context is rdma-core's.
        let post_recv = unsafe { (*(*qp.as_ptr()).context).ops.post_recv };
        // SAFETY: live QP.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        let fail = |what: String| {
            // SAFETY: created above, not yet owned by a handle.
            unsafe { rdma_sys::ibv_destroy_qp(qp.as_ptr()) };
            Error::new(ErrorKind::NotSupported, verb).with_detail(what)
        };
        let Some(qpx) = NonNull::new(qpx) else {
            return Err(fail("no extended QP (ibv_qp_to_qp_ex)".into()));
        };
        let Some(post_recv) = post_recv else {
            return Err(fail("the QP has no post_recv".into()));
        };
        // SAFETY: live extended QP.
        let wr =
            match unsafe { WrFns::of(qpx.as_ptr(), srd && spec.rdma_read, srd && spec.rdma_write) }
            {
                Ok(f) => f,
                Err(missing) => return Err(fail(format!("the QP has no {missing} function"))),
            };
        let mut handle = QpHandle {
            qp,
            qpx,
            wr,
            post_recv,
            live: true,
            _pd: shared.pd.clone(),
        };
        qp_state::bring_up(
            &mut handle,
            BringUpPlan {
                qp_type: spec.qp_type,
                qkey: spec.qkey,
                rnr_retry: spec.rnr_retry,
                rnr_retry_modifiable: spec.rnr_retry_modifiable,
            },
        )?;
        Ok(VerbsNic {
            qp: Some(handle),
            cq,
            shared: shared.clone(),
            qpn,
            unsolicited,
        })
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Unsolicited write-recv is on for this queue pair.
    pub fn unsolicited(&self) -> bool {
        self.unsolicited
    }
}

impl Nic for VerbsNic {
    type Ah = Ah;
    type Mr = EfaMr;

    unsafe fn register(&self, ptr: *mut u8, len: usize, access: u32) -> Result<EfaMr> {
        // SAFETY: forwarded contract.
        unsafe { self.shared.pd.reg_mr(ptr, len, access) }
    }

    fn address_handle(&self, gid: &Gid) -> Result<Arc<Ah>> {
        super::ah::get_shared(&self.shared.ahs, gid, &self.shared.pd)
    }

    fn gid_of_ahn(&self, ahn: u16) -> Option<Gid> {
        self.shared.ahs.lock().gid_of(ahn)
    }

    fn post_send_list(&mut self, wqes: &[SendWqe<'_, Ah>]) -> std::result::Result<(), i32> {
        let Some(q) = self.qp.as_ref() else {
            return Err(EINVAL);
        };
        let qpx = q.qpx.as_ptr();
        let f = &q.wr;
        // SAFETY: live extended QP with checked builder functions; one session from `start` to
        // `complete` (or `abort`, which drops every request of it).
        unsafe {
            (f.start)(qpx);
            for wqe in wqes {
                if let Err(e) = build(qpx, f, wqe) {
                    (f.abort)(qpx);
                    return Err(e);
                }
            }
            match (f.complete)(qpx) {
                0 => Ok(()),
                rc => Err(rc),
            }
        }
    }

    fn post_recv(&mut self, wr_id: u64, sge: Sge) -> std::result::Result<(), i32> {
        let Some(q) = self.qp.as_ref() else {
            return Err(EINVAL);
        };
        let mut s = ibv_sge {
            addr: sge.addr,
            length: sge.len,
            lkey: sge.lkey,
        };
        let mut wr = ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut s,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; the SGE names registered memory the work request owns until its
        // completion; `wr`/`s` are only read during the call.
        match unsafe { (q.post_recv)(q.qp.as_ptr(), &mut wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    fn poll(&mut self, max: usize, out: &mut Vec<RawWc>) -> std::result::Result<(), i32> {
        if self.qp.is_none() {
            return Ok(());
        }
        self.cq.poll(max, out)
    }

    fn to_error(&mut self) -> Result<()> {
        match self.qp.as_mut() {
            Some(q) => qp_state::to_error(q),
            None => Ok(()),
        }
    }

    fn destroy(&mut self) -> bool {
        match self.qp.take() {
            Some(mut q) => {
                let ok = q.destroy();
                if !ok {
                    // The QP may still be alive: keep its CQ (and context) alive too, forever.
                    std::mem::forget(q);
                }
                ok
            }
            None => true,
        }
    }
}

impl Drop for VerbsNic {
    fn drop(&mut self) {
        // The QP before its CQ (then the CQ, then its channel, as fields).
        self.qp = None;
    }
}

/// `EAGAIN`/`ENOMEM` from a post mean a full queue.
pub fn is_queue_full(errno: i32) -> bool {
    errno == EAGAIN || errno == ENOMEM
}

/// Adds `wqe` to the session open on `qpx`; `Err(errno)` when the device cannot do it (the
/// caller aborts the session).
///
/// # Safety
///
/// `qpx` is a live extended QP inside `ibv_wr_start`, `f` its checked builder functions; the
/// SGE / inline data point to memory that stays valid until `ibv_wr_complete` returns (inline
/// data is copied by it) or until the completion (registered memory owned by the work request).
unsafe fn build(
    qpx: *mut ibv_qp_ex,
    f: &WrFns,
    wqe: &SendWqe<'_, Ah>,
) -> std::result::Result<(), i32> {
    // SAFETY: the caller's contract.
    unsafe {
        (*qpx).wr_id = wqe.wr_id;
        (*qpx).wr_flags = rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        match wqe.op {
            SendOp::Send { imm: None } => (f.send)(qpx),
            SendOp::Send { imm: Some(i) } => (f.send_imm)(qpx, i.to_be()),
            SendOp::Read { rkey, raddr } => match f.rdma_read {
                Some(g) => g(qpx, rkey, raddr),
                None => return Err(EOPNOTSUPP),
            },
            SendOp::Write { rkey, raddr, imm } => match (imm, f.rdma_write, f.rdma_write_imm) {
                (None, Some(g), _) => g(qpx, rkey, raddr),
                (Some(i), _, Some(g)) => g(qpx, rkey, raddr, i.to_be()),
                _ => return Err(EOPNOTSUPP),
            },
        }
        (f.set_ud_addr)(qpx, wqe.ah.as_ptr(), wqe.remote_qpn, wqe.remote_qkey);
        match wqe.payload {
            Payload::Inline(segs) => {
                let mut bufs = [ibv_data_buf {
                    addr: ptr::null_mut(),
                    length: 0,
                }; 2];
                let mut n = 0;
                for s in segs.iter().filter(|s| !s.is_empty()) {
                    let Some(b) = bufs.get_mut(n) else {
                        return Err(EINVAL);
                    };
                    // libefa only reads the inline data (the cast to `*mut` is the C API's).
                    *b = ibv_data_buf {
                        addr: s.as_ptr().cast_mut().cast(),
                        length: s.len(),
                    };
                    n += 1;
                }
                (f.set_inline_data_list)(qpx, n, bufs.as_ptr());
            }
            Payload::Sge(s) => {
                let sge = ibv_sge {
                    addr: s.addr,
                    length: s.len,
                    lkey: s.lkey,
                };
                (f.set_sge_list)(qpx, 1, &sge);
            }
            Payload::Empty => (f.set_sge_list)(qpx, 0, ptr::null()),
        }
    }
    Ok(())
}
