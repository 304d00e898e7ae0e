//! Device RDMA and the read-based protocols:
//!
//! * **device RMA**: `RmaKind::Write` / `RmaKind::Read` towards a peer where both sides advertised
//!   RDMA write / read go to the device as one-sided work requests ([`TransmitKind::RdmaWrite`] /
//!   [`TransmitKind::RdmaRead`]), split at `max_rdma_size`; before the peer's HANDSHAKE such an
//!   operation waits for it (a 0-byte EAGER_RTW makes the peer send it), as libfabric does;
//! * **LONGREAD_RTW**: a long write from a registered buffer, read by the target, then EOR;
//! * **LONGREAD_RTM / RUNTREAD_RTM**: large messages from a registered buffer, read by the
//!   receiver (after a runt sent in packets: `rx/read.rs`), then EOR;
//! * **READ_NACK**: a receiver that cannot read makes the sender fall back to long-CTS (messages,
//!   `tx/read.rs`) or to the emulated write (LONGREAD_RTW: the operation is handed back to the
//!   dispatcher, which gives it to the emulation).
//!
//! The choices are described in `docs/protocol.md`, "Device RDMA and the read-based protocols".
//!
//! Buffers are never copied for device reads: the user's buffer is cut into pieces
//! ([`BytesMut::split_off`]), each piece goes to the device and comes back in its completion, and
//! the pieces are joined again ([`BytesMut::unsplit`], which is O(1) for neighbouring pieces).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::cx::Cx;
use super::peer::Peers;
use super::rx::RxSide;
use super::tx::TxSide;
use super::types::{Gone, Owner, Pkt};
use super::util::{IdMap, Out, Timer, WrTable, encode, sorted};
use super::wr::{Pieces, ReadIovs, Wr, WrOwner, WrWhat, carve, read_segment, write_segment};
use super::{
    Error, ErrorKind, RemoteWriteDone, RmaBuf, RmaKind, RmaMemory, RmaOp, RmaPath, Transmit,
    TransmitKind,
};
use crate::device::{RemoteIov, Status};
use crate::mem::RegionSlice;
use crate::proto::wire::{ExtraFeature, IovList, Packet, ReqOpt};

/// Marks the `wr_id`s of RDMA work requests (those of packets have bit 63 clear).
const RDMA_WR: u64 = 1 << 63;
/// Largest piece a LONGREAD_RTW target reads at once: its buffer is held until written into
/// the memory, so this bounds what a peer makes the target allocate per work request.
const RTW_SEGMENT: usize = 1 << 20;
/// RMA operations that may wait for HANDSHAKEs at once
/// (`EFA_RDM_MAX_QUEUED_OPE_BEFORE_HANDSHAKE`); beyond, `Again`.
const MAX_QUEUED_BEFORE_HANDSHAKE: usize = 16;
/// Retry of a write into memory the application holds locked (`RmaMemory` said `Again`).
const MEMORY_RETRY: Duration = Duration::from_micros(20);

mod device;
mod rtw;

use device::DevOp;
pub(super) use device::own_buffers;
use rtw::RtwTarget;
pub(super) use rtw::write_range;

/// How often a device RDMA work request is posted again after the target said it holds no AH
/// for us (status 14), each time after introducing ourselves and backing off, before the
/// operation fails (the peer stays: status 14 is not a sign it is gone).
pub(super) const NO_AH_RETRIES: u8 = 4;

/// The state of this module in the engine (`Engine::rd`).
#[derive(Debug, Default)]
pub(super) struct ReadState {
    ops: IdMap<u32, DevOp>,
    /// Operations in `ops` waiting for a HANDSHAKE.
    waiting: usize,
    /// Work requests on the device.
    outstanding: WrTable<Wr, RDMA_WR>,
    rtw: IdMap<u32, RtwTarget>,
    next_rtw: u32,
    /// Alternates work requests and packets in `poll_transmit`.
    turn: bool,
    /// The queue pair has unsolicited write-recv.
    unsolicited: bool,
}

impl ReadState {
    /// The device completed RDMA work request `wr_id` (`buf`: a read's buffer handed back).
    /// A write that met RNR, or any request the target refused for want of an AH for us, goes
    /// again (backing off; the latter after introducing us) and `None` is returned; else the
    /// work request goes to its owner (a device RMA operation, a LONGREAD_RTW target here, or
    /// a message's reads in `rx`) and its peer is returned.
    pub(super) fn completed(
        &mut self,
        now: Instant,
        wr_id: u64,
        status: Status,
        buf: Option<BytesMut>,
        rx: &mut RxSide,
        cx: &mut Cx,
    ) -> Option<u64> {
        let Some(mut w) = self.outstanding.take(wr_id) else {
            tracing::debug!(wr_id, "RDMA completion for an unknown work request");
            return None;
        };
        if status == Status::RnrRetryExceeded
            && matches!(w.what, WrWhat::Write { .. })
            && cx.peers.contains_key(&w.peer)
        {
            // A write with immediate data found no receive buffer at the target: again at
            // once, backing off from its second RNR on (as packets).
            cx.out.stats.rnr += 1;
            cx.out.stats.retransmits += 1;
            w.rnr = w.rnr.saturating_add(1);
            let (again, pid) = (w.rnr > 1, w.peer);
            cx.wrs.push_front(w);
            if again {
                cx.peers
                    .rnr_backoff(pid, now, &cx.cfg, &mut cx.rng, &mut cx.out.timers);
            }
            return None;
        }
        if status == Status::UnknownPeer
            && w.no_ah < NO_AH_RETRIES
            && cx.peers.contains_key(&w.peer)
        {
            // EFA: the target's NIC holds no AH for us (it evicted it, or never made one), so it
            // refuses our RDMA. A datagram carrying our raw address makes its provider create
            // one (libfabric inserts an implicit peer; our efa device makes an AH for a sender
            // it learns the GID of); then the work request goes again, after a backoff.
            cx.out.stats.retransmits += 1;
            w.no_ah += 1;
            if let WrWhat::Read { buf: slot, .. } = &mut w.what {
                *slot = buf;
            }
            let pid = w.peer;
            cx.wrs.push_front(w);
            cx.peers.introduce(pid, cx.local);
            cx.peers
                .rnr_backoff(pid, now, &cx.cfg, &mut cx.rng, &mut cx.out.timers);
            return None;
        }
        if let WrWhat::Read { buf: slot, .. } = &mut w.what {
            *slot = buf;
        }
        let pid = w.peer;
        match w.owner {
            WrOwner::Op(id) => self.op_wr_done(id, w, status, cx),
            WrOwner::Rx(rid) => rx.read_done(now, rid, w, status, cx),
            WrOwner::Rtw(id) => self.rtw_wr_done(now, id, w, status, cx),
        }
        Some(pid)
    }

    /// True when `id` is the id of a device RMA operation in flight.
    pub(super) fn owns_id(&self, id: u32) -> bool {
        !self.ops.is_empty() && self.ops.contains_key(&id)
    }

    /// Whose turn it is on the device when packets and RDMA work requests both wait: true for
    /// RDMA (they take turns; `max_outstanding_tx` bounds them together).
    pub(super) fn rdma_turn(&mut self) -> bool {
        self.turn = !self.turn;
        self.turn
    }

    /// The next RDMA work request of the queue `wrs` for the device (skipping peers in RNR
    /// backoff).
    pub(super) fn next_wr(&mut self, wrs: &mut VecDeque<Wr>, peers: &Peers) -> Option<Transmit> {
        loop {
            let i = wrs
                .iter()
                .position(|w| peers.get(&w.peer).is_none_or(|p| p.backoff_until.is_none()))?;
            let mut w = wrs.remove(i)?;
            let (payload, kind) = match &mut w.what {
                WrWhat::Write { off, end, imm } => {
                    let (buf, region) = match w.owner {
                        WrOwner::Op(id) => match self.ops.get(&id) {
                            Some(DevOp::Write { buf, region, .. }) => (buf, region),
                            _ => continue,
                        },
                        _ => continue,
                    };
                    if let Some(r) = region {
                        let Some(local) = r.sub(*off, end.saturating_sub(*off)) else {
                            continue;
                        };
                        let kind = TransmitKind::RdmaWriteRegion {
                            remote: w.remote,
                            imm: *imm,
                            local,
                        };
                        (Bytes::new(), kind)
                    } else {
                        if *off > *end || *end > buf.len() {
                            continue;
                        }
                        let kind = TransmitKind::RdmaWrite {
                            remote: w.remote,
                            imm: *imm,
                        };
                        (buf.slice(*off..*end), kind)
                    }
                }
                WrWhat::Read {
                    region: Some(r), ..
                } => {
                    let kind = TransmitKind::RdmaReadRegion {
                        remote: w.remote,
                        local: r.clone(),
                    };
                    (Bytes::new(), kind)
                }
                WrWhat::Read { buf, .. } => {
                    let n = usize::try_from(w.remote.len).unwrap_or(0);
                    let b = buf.take().unwrap_or_else(|| BytesMut::with_capacity(n));
                    let kind = TransmitKind::RdmaRead {
                        remote: w.remote,
                        buf: b,
                    };
                    (Bytes::new(), kind)
                }
            };
            let dest = w.dest;
            let wr_id = self.outstanding.insert(w);
            return Some(Transmit {
                wr_id,
                dest,
                hdr: Bytes::new(),
                payload,
                kind,
            });
        }
    }

    /// Whether the queue pair lets RDMA writes with immediate data land without a posted
    /// receive buffer (`Engine::set_unsolicited_write_recv`).
    pub(super) fn set_unsolicited(&mut self, on: bool) {
        self.unsolicited = on;
    }

    pub(super) fn unsolicited(&self) -> bool {
        self.unsolicited
    }

    /// RMA operations of this module in flight (counted as operations in `Resources::tx_ops`).
    pub(super) fn ops_len(&self) -> usize {
        self.ops.len()
    }

    /// LONGREAD_RTW writes of peers this side reads and places.
    pub(super) fn targets(&self) -> usize {
        self.rtw.len()
    }

    /// RDMA work requests on the device.
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// A write with immediate data may go to the device: both sides agree on unsolicited
    /// write-recv.
    fn imm_ok(&self, pid: u64, cx: &Cx) -> bool {
        cx.peers.get(&pid).is_some_and(|p| {
            p.addr == cx.local
                || p.features.has(ExtraFeature::UnsolicitedWriteRecv) == self.unsolicited
        })
    }

    /// The peer is gone: its RMA operations fail, the LONGREAD_RTW reads from it stop.
    pub(super) fn peer_failed(&mut self, pid: u64, g: Gone, cx: &mut Cx) {
        let ids = self.ops.iter().filter(|(_, o)| o.peer() == pid);
        for id in sorted(ids.map(|(&id, _)| id)) {
            // An operation with work requests on the device ends with their completions: a
            // write the target's device acknowledged before the peer failed (it got its data and
            // exited) succeeded, and a read's buffer is not handed back while the device may
            // still fill it. Only what was not posted yet is withdrawn, failing the operation.
            let on_device = self
                .outstanding
                .values()
                .any(|w| w.owner == WrOwner::Op(id));
            if on_device {
                let status = g.status.unwrap_or(Status::UnresponsiveRemote);
                self.withdraw_queued(id, status, &mut cx.wrs);
            } else {
                self.abort_op(id, g.kind, g.status, g.why, cx);
            }
        }
        self.rtw.retain(|_, t| t.peer != pid);
        cx.wrs.retain(|w| w.peer != pid);
    }

    /// `close()`: every operation of this module completes with `Canceled`.
    pub(super) fn close(&mut self, cx: &mut Cx) {
        for id in sorted(self.ops.keys().copied()) {
            self.abort_op(id, ErrorKind::Canceled, None, "endpoint closed", cx);
        }
        cx.wrs.clear();
        self.outstanding.clear();
        self.rtw.clear();
        self.waiting = 0;
        cx.out.timers.stop(Timer::ReadRetry);
    }

    /// EOR, READ_NACK (a read-based message's go to the transmit side `tx`) and LONGREAD_RTW.
    /// A LONGREAD_RTW the target NACKed comes back, to be emulated.
    pub(super) fn handle_pkt(
        &mut self,
        pid: u64,
        pkt: &Packet<'_>,
        tx: &mut TxSide,
        cx: &mut Cx,
    ) -> Option<RmaOp> {
        match *pkt {
            Packet::Eor { send_id, .. } if tx.ops.contains_key(&send_id) => {
                tx.handle_eor(pid, send_id, cx)
            }
            Packet::Eor { send_id, .. } => self.handle_eor(pid, send_id, &mut cx.out),
            Packet::ReadNack {
                send_id, recv_id, ..
            } if tx.ops.contains_key(&send_id) => tx.handle_read_nack(pid, send_id, recv_id, cx),
            Packet::ReadNack { send_id, .. } => {
                return self.handle_read_nack(pid, send_id, &mut cx.out);
            }
            Packet::LongReadRtw {
                ref opt,
                msg_length,
                send_id,
                ref rma_iov,
                ref read_iov,
            } => {
                let data = opt.cq_data.map(|d| d as u32);
                let (rma, read) = (ReadIovs::of(rma_iov), ReadIovs::of(read_iov));
                self.handle_longread_rtw(pid, data, msg_length, send_id, rma, read, cx)
            }
            _ => cx.out.drop_pkt_type(pkt),
        }
        None
    }
}
