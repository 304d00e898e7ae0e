//! The data-path verbs one queue pair uses, as a trait: [`VerbsNic`](super::verbs::VerbsNic)
//! implements it on rdma-core, the tests implement it with a fake NIC that copies between the
//! posted buffers, so the queue-pair logic ([`EfaQp`](super::qp::EfaQp)) is tested without
//! hardware.

use std::sync::Arc;

use crate::addr::Gid;
use crate::error::Result;

/// A memory registration (shared by the MR cache and the work requests that use it); dropping
/// the last handle deregisters the memory (after which the NIC no longer
/// touches it).
pub trait Registration: Send + Sync {
    /// Local key.
    fn lkey(&self) -> u32;
    /// Deregisters now (dropping it does, too, if this was not called); only drop it after.
    /// False when the NIC refused (`ibv_dereg_mr` failed): it may still use the memory, which
    /// must then never be freed or reused (see [`release_or_leak`]). Later calls give the same
    /// answer without asking the NIC again.
    fn deregister(&mut self) -> bool;
}

/// Deregisters `mr` when this is its last reference, then drops `mem`, the memory it covers
/// (or a handle keeping it allocated); when the NIC refuses, `mem` is leaked instead, never freed
/// or reused, since the NIC may still use it. Not the last reference: the other holder, who
/// holds the memory too, decides later. False when `mem` was leaked.
pub fn release_or_leak<M: Registration, T>(mut mr: Arc<M>, mem: T) -> bool {
    let ok = Arc::get_mut(&mut mr).is_none_or(|m| m.deregister());
    drop(mr);
    if ok {
        drop(mem);
    } else {
        std::mem::forget(mem);
    }
    ok
}

/// One scatter/gather entry (`struct ibv_sge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key of the registration the range lies in.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// A datagram, with optional immediate data.
    Send {
        /// Immediate data (host order).
        imm: Option<u32>,
    },
    /// RDMA read of `raddr` (remote key `rkey`) into the local SGE.
    Read {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        raddr: u64,
    },
    /// RDMA write of the local SGE to `raddr`, with optional immediate data.
    Write {
        /// Remote key.
        rkey: u32,
        /// Remote address.
        raddr: u64,
        /// Immediate data (host order).
        imm: Option<u32>,
    },
}

/// The data of a send work request.
#[derive(Clone, Copy, Debug)]
pub enum Payload<'a> {
    /// Copied into the work queue entry at posting (at most the inline size).
    Inline(&'a [&'a [u8]]),
    /// Gathered from registered memory by the NIC.
    Sge(Sge),
    /// No data.
    Empty,
}

/// A send work request.
#[derive(Debug)]
pub struct SendWqe<'a, A> {
    /// The token the completion carries back.
    pub wr_id: u64,
    /// Operation.
    pub op: SendOp,
    /// Destination address handle.
    pub ah: &'a A,
    /// Destination QPN.
    pub remote_qpn: u32,
    /// Destination QKEY.
    pub remote_qkey: u32,
    /// Data.
    pub payload: Payload<'a>,
}

/// One completion as the CQ reports it, before it is matched to its work request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawWc {
    /// The token (verbs `wr_id`); meaningless for unsolicited completions.
    pub wr_id: u64,
    /// `ibv_wc_status`.
    pub status: u32,
    /// EFA status code.
    pub vendor_err: u32,
    /// `ibv_wc_opcode`.
    pub opcode: u32,
    /// Bytes (for UD receives: including the 40-byte GRH).
    pub byte_len: u32,
    /// Sender's QPN (receives).
    pub src_qp: u32,
    /// Sender's address handle number on this device (receives); `0xffff` when unknown.
    pub slid: u32,
    /// Immediate data (host order), if the completion has some.
    pub imm: Option<u32>,
    /// Sender's GID, when the device reports it (receives from senders without an AH here).
    pub sgid: Option<Gid>,
    /// An RDMA write with immediate that consumed no receive buffer.
    pub unsolicited: bool,
}

/// The data-path verbs of one queue pair and its CQ.
pub trait Nic: Send {
    /// Address handle type.
    type Ah: Send + Sync;
    /// Memory registration type.
    type Mr: Registration;

    /// Registers `len` bytes at `ptr` with `ibv_access_flags` `access`.
    ///
    /// # Safety
    ///
    /// The range must stay valid (allocated, not moved) until the registration is dropped, and
    /// Rust code must not hold references to bytes the NIC may write while it is registered.
    unsafe fn register(&self, ptr: *mut u8, len: usize, access: u32) -> Result<Self::Mr>;
    /// A reference to the address handle of `gid` (created on first use).
    fn address_handle(&self, gid: &Gid) -> Result<Arc<Self::Ah>>;
    /// The GID of the sender whose address handle number is `ahn`, if known.
    fn gid_of_ahn(&self, ahn: u16) -> Option<Gid>;
    /// Posts a send work request; `Err(errno)` when refused.
    fn post_send(&mut self, wqe: &SendWqe<'_, Self::Ah>) -> std::result::Result<(), i32> {
        self.post_send_list(std::slice::from_ref(wqe))
    }
    /// Posts `wqes` as one chain behind one doorbell (one `ibv_wr_start` .. `ibv_wr_complete`
    /// session): all of them, or, on `Err(errno)`, none.
    fn post_send_list(&mut self, wqes: &[SendWqe<'_, Self::Ah>]) -> std::result::Result<(), i32>;
    /// Posts a receive work request; `Err(errno)` when refused.
    fn post_recv(&mut self, wr_id: u64, sge: Sge) -> std::result::Result<(), i32>;
    /// Appends up to `max` completions to `out`.
    fn poll(&mut self, max: usize, out: &mut Vec<RawWc>) -> std::result::Result<(), i32>;
    /// Moves the queue pair to ERR (the device stops it and may flush its work requests).
    fn to_error(&mut self) -> Result<()>;
    /// Destroys the queue pair; afterwards the NIC touches none of the memory posted to it, and
    /// `post_*`/`poll` do nothing. False when the destroy failed: the NIC may still use the
    /// memory, which must then never be freed.
    fn destroy(&mut self) -> bool;
}
