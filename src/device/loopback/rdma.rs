//! One-sided RDMA on the loopback device: what an operation carries, and how a routed operation is
//! applied to the target's registered memory once the network lock is released.
//!
//! Checks, in order (the first failure decides, and nothing is touched): the target device has
//! RDMA (`UnsupportedOp`), the key is live in the target device's key table and grants the right
//! (`RemoteBadAddress`), the range lies inside the region and the region is not closed
//! (`RemoteBadAddress`). A write with immediate data to a device without unsolicited write-recv
//! then needs a posted receive buffer at the target queue pair (receiver not ready otherwise:
//! retried like a send). The region's lock is only tried: when it is taken the operation is held
//! for the next network event and the initiator's notifier is signalled when the lock is released.

use std::sync::Arc;

use bytes::BytesMut;

use super::qp::QpShared;
use super::wire::{Datagram, Wake};
use crate::device::{DeviceCompletion, Opcode, RemoteIov, Status, UNSOLICITED_WR_ID};
use crate::mem::{Access, TryAccess};
use crate::stats::{add, inc};

/// The initiator's side of an RDMA read or write.
pub(super) struct RdmaOp {
    pub(super) initiator: Arc<QpShared>,
    pub(super) wr_id: u64,
    pub(super) remote: RemoteIov,
    /// The local buffer of a read (`None` for a write, whose data travels in the datagram).
    pub(super) read_buf: Option<BytesMut>,
    /// RNR retries done so far (writes with immediate data).
    pub(super) rnr_retries: u8,
    /// Set when the destination is gone: the operation completes with this status when released.
    pub(super) doom: Option<Status>,
    /// The fault injector duplicated it; the target suppresses the copy.
    pub(super) dup: bool,
}

impl RdmaOp {
    pub(super) fn new(
        initiator: Arc<QpShared>,
        wr_id: u64,
        remote: RemoteIov,
        read_buf: Option<BytesMut>,
    ) -> RdmaOp {
        RdmaOp {
            initiator,
            wr_id,
            remote,
            read_buf,
            rnr_retries: 0,
            doom: None,
            dup: false,
        }
    }

    fn opcode(&self) -> Opcode {
        if self.read_buf.is_some() {
            Opcode::RdmaRead
        } else {
            Opcode::RdmaWrite
        }
    }

    /// The initiator's completion with `status` (`byte_len` = the length asked for; a read hands
    /// its buffer back).
    pub(super) fn into_completion(self, status: Status) -> DeviceCompletion {
        let mut c =
            DeviceCompletion::new(self.wr_id, status, self.opcode(), self.remote.len as usize);
        c.buf = self.read_buf;
        c
    }

    /// Completes the operation at the initiator with `status`, counting a success.
    pub(super) fn complete(self, status: Status, wake: &mut Wake) {
        let qp = self.initiator.clone();
        if status.is_ok() {
            inc(&qp.dev.counters.rdma_ops);
            add(&qp.dev.counters.rdma_bytes, self.remote.len);
        } else {
            tracing::debug!(wr_id = self.wr_id, op = ?self.opcode(), %status, "loopback: RDMA failed");
        }
        qp.push(self.into_completion(status), wake);
    }
}

/// A routed operation, to be applied once the network lock is released.
pub(super) struct Deferred {
    pub(super) seq: u64,
    pub(super) dg: Datagram,
    pub(super) op: Box<RdmaOp>,
    pub(super) target: Arc<QpShared>,
}

/// What became of an applied operation.
pub(super) enum Applied {
    /// Completed (successfully or not).
    Done,
    /// The region's lock was taken: hold it until the next network event.
    Busy(Deferred),
    /// A write with immediate data found no receive buffer: RNR.
    NotReady(Deferred),
}

/// Applies `d` to the target's memory and completes it, unless it must wait. Takes no network
/// lock; never blocks on a region lock.
pub(super) fn apply(mut d: Deferred, wake: &mut Wake) -> Applied {
    let tdev = d.target.dev.clone();
    if !tdev.cfg.rdma {
        d.op.complete(Status::UnsupportedOp, wake);
        return Applied::Done;
    }
    let remote = d.op.remote;
    let needed = if d.op.read_buf.is_some() {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_WRITE
    };
    let checked = tdev
        .mrs
        .lock()
        .check(remote.key, needed, remote.addr, remote.len);
    let mem = match checked {
        Ok(mem) => mem,
        Err(_) => {
            d.op.complete(Status::RemoteBadAddress, wake);
            return Applied::Done;
        }
    };
    let waiter = d.op.initiator.notifier.clone();
    if let Some(mut buf) = d.op.read_buf.take() {
        let r = mem.try_read_into(remote.addr, remote.len, &mut buf, Some(&waiter));
        d.op.read_buf = Some(buf);
        return match r {
            TryAccess::Busy => Applied::Busy(d),
            TryAccess::OutOfRange => {
                d.op.complete(Status::RemoteBadAddress, wake);
                Applied::Done
            }
            TryAccess::Done(()) => {
                if d.op.dup {
                    inc(&tdev.counters.duplicates_dropped);
                }
                d.op.complete(Status::Success, wake);
                Applied::Done
            }
        };
    }
    // A write. With immediate data and no unsolicited write-recv, it consumes a receive buffer,
    // taken under the region's lock once the range is known to be good.
    let imm = d.dg.imm;
    let needs_buf = imm.is_some() && !tdev.cfg.unsolicited_write_recv;
    let target = d.target.clone();
    let gate = || {
        if !needs_buf {
            return Some(None);
        }
        match target.state.lock().recvs.pop_front() {
            Some(b) => Some(Some(b)),
            None => {
                inc(&tdev.counters.rnr_events);
                None
            }
        }
    };
    match mem.try_write_with(remote.addr, &d.dg.payload, Some(&waiter), gate) {
        TryAccess::Busy => Applied::Busy(d),
        TryAccess::OutOfRange => {
            d.op.complete(Status::RemoteBadAddress, wake);
            Applied::Done
        }
        TryAccess::Done(None) => Applied::NotReady(d),
        TryAccess::Done(Some(recv)) => {
            if d.op.dup {
                inc(&tdev.counters.duplicates_dropped);
            }
            if let Some(imm) = imm {
                let (wr_id, buf) = match recv {
                    Some((wr_id, buf)) => (wr_id, Some(buf)),
                    None => (UNSOLICITED_WR_ID, None),
                };
                d.target.push(
                    DeviceCompletion {
                        wr_id,
                        status: Status::Success,
                        opcode: Opcode::RecvRdmaWithImm,
                        byte_len: d.dg.payload.len(),
                        src: Some(d.dg.src),
                        imm: Some(imm),
                        buf,
                    },
                    wake,
                );
            }
            d.op.complete(Status::Success, wake);
            Applied::Done
        }
    }
}
