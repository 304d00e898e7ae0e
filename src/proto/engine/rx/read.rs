//! The receiver's side of long-read and runting-read messages: the reads of a matched
//! message's read part (queued as RDMA work requests in `Cx::wrs`), their completions, EOR,
//! READ_NACK and the sender's long-CTS continuation after it.

use std::collections::VecDeque;
use std::time::Instant;

use super::{Cx, Kind, RxEntry, RxSide, RxState};
use crate::device::Status;
use crate::proto::engine::util::Timer;
use crate::proto::engine::wr::{Phase, Pieces, Wr, WrOwner, WrWhat, carve, read_segment};
use crate::proto::wire::Packet;

impl RxSide {
    /// The message `rid` was matched: read what fits of its non-runt part, or NACK.
    pub(super) fn start_read(&mut self, now: Instant, rid: u32, cx: &mut Cx) {
        let seg = read_segment(&cx.cfg);
        let can = cx.cfg.device_rdma_read;
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let (pid, dest, msg_len) = (e.msg.peer, e.msg.src, e.msg.msg_len);
        e.last = now;
        let (Some(r), RxState::Matched(sink)) = (e.read.as_mut(), &mut e.state) else {
            return;
        };
        if r.phase != Phase::Idle {
            return;
        }
        let start = r.start.min(msg_len);
        let end = sink.place;
        if start == msg_len {
            // The runt is the whole message: nothing to read, no EOR (libfabric reads, and
            // answers, only when the message is longer than its runt).
            r.phase = Phase::Done;
            return;
        }
        if end <= start {
            // Nothing of the read part fits (truncated, discarded): EOR at once.
            return self.read_finished(rid, cx);
        }
        let region_holds = sink.region.as_ref().is_some_and(|g| g.len >= end);
        if can && !region_holds {
            // The read part goes into the buffer: a receive whose room is not its capacity (a
            // region slice, `RecvOp::room`) gets it now.
            sink.buf.reserve(end.saturating_sub(sink.buf.len()));
        }
        let ranges = if can {
            carve(r.iovs.as_slice(), start, end, seg)
        } else {
            None
        };
        let Some(ranges) = ranges else {
            r.phase = Phase::NackPending;
            return self.maybe_nack(rid, cx);
        };
        let lens: Vec<usize> = ranges.iter().map(|x| x.len as usize).collect();
        // Into the receive's region when it has one that holds the read part (no copy), else
        // into pieces cut from its buffer.
        let region = sink.region.as_ref().filter(|g| g.len >= end);
        let (pieces, whats) = Pieces::targets(&mut sink.buf, region, start, &lens);
        r.pieces = pieces;
        r.phase = Phase::Reading;
        for (remote, what) in ranges.into_iter().zip(whats) {
            let owner = WrOwner::Rx(rid);
            cx.wrs.push_back(Wr::new(owner, pid, dest, remote, what));
        }
    }

    /// The device completed a read of message `rid` (its work request `w`).
    pub(in crate::proto::engine) fn read_done(
        &mut self,
        now: Instant,
        rid: u32,
        w: Wr,
        status: Status,
        cx: &mut Cx,
    ) {
        let WrWhat::Read { piece, buf, region } = w.what else {
            return;
        };
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        e.last = now;
        let into_region = region.is_some();
        let msg_len = e.msg.msg_len;
        let (Some(r), state) = (e.read.as_mut(), &mut e.state) else {
            return;
        };
        if r.phase != Phase::Reading {
            return;
        }
        r.pieces.put(piece, buf, status);
        if r.pieces.outstanding > 0 {
            return;
        }
        // Every piece is back: the user's buffer is whole again (or the region holds the read
        // part, and the buffer the runt).
        let pieces = std::mem::take(&mut r.pieces);
        let failed = pieces.error.is_some();
        if let RxState::Matched(sink) = state {
            let start = r.start.min(msg_len);
            if into_region {
                if !failed {
                    sink.in_region = Some(start);
                }
            } else {
                let head = std::mem::take(&mut sink.buf);
                sink.buf = pieces.join(head, start);
            }
        }
        if self.in_progress > 0 {
            let at = now.checked_add(cx.cfg.rx_stall_timeout);
            cx.out.timers.arm_if_stopped(Timer::RxStall, at);
        }
        if failed {
            tracing::debug!(rid, "RDMA read of a message failed: READ_NACK");
            r.phase = Phase::NackPending;
            self.maybe_nack(rid, cx);
        } else {
            self.read_finished(rid, cx);
        }
    }

    /// The read part is in place (or there was nothing to read): EOR, and the completion if
    /// the runt is in too.
    fn read_finished(&mut self, rid: u32, cx: &mut Cx) {
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let Some(r) = e.read.as_mut() else {
            return;
        };
        r.phase = Phase::Done;
        let (send_id, start) = (r.send_id, r.start.min(e.msg.msg_len));
        // What did not fit counts as received, as for the packets of a truncated message.
        e.received += e.msg.msg_len - start;
        let (pid, complete) = (e.msg.peer, e.received >= e.msg.msg_len);
        let eor = Packet::Eor {
            connid: Some(cx.local.qkey),
            send_id,
            recv_id: rid,
        };
        cx.peers.queue_ctrl(pid, &eor);
        if complete {
            self.complete_rx(rid, cx);
        }
    }

    /// Sends the READ_NACK of `rid` once its runt has all arrived (libfabric sends it after
    /// the last RUNTREAD packet: the long-CTS part then starts where the runt ends).
    pub(super) fn maybe_nack(&mut self, rid: u32, cx: &mut Cx) {
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let (received, msg_len, pid) = (e.received, e.msg.msg_len, e.msg.peer);
        let Some(r) = e.read.as_mut() else {
            return;
        };
        if r.phase != Phase::NackPending || received < r.start.min(msg_len) {
            return;
        }
        r.phase = Phase::Nacked;
        let nack = Packet::ReadNack {
            connid: Some(cx.local.qkey),
            send_id: r.send_id,
            recv_id: rid,
        };
        cx.peers.queue_ctrl(pid, &nack);
    }

    /// The sender continues NACKed message `msg_id` as long-CTS: the entry becomes a long-CTS
    /// receive and asks for the rest.
    pub(super) fn handle_nack_rtm(
        &mut self,
        now: Instant,
        pid: u64,
        msg_id: u32,
        send_id: u32,
        dc: bool,
        cx: &mut Cx,
    ) {
        let Some(&rid) = cx.peers.get(&pid).and_then(|p| p.inbound.get(&msg_id)) else {
            return cx.out.drop_pkt("read-NACK REQ without a long-read message");
        };
        let Some(e) = self.ops.get_mut(&rid) else {
            return cx.out.drop_pkt("read-NACK REQ without a long-read message");
        };
        let nacked = e
            .read
            .as_ref()
            .is_some_and(|r| r.phase == Phase::Nacked && r.send_id == send_id);
        if !nacked {
            return cx
                .out
                .drop_pkt("read-NACK REQ for a message that was not NACKed");
        }
        e.read = None;
        e.kind = Kind::LongCts { send_id };
        e.msg.dc_send_id = dc.then_some(send_id);
        e.last = now;
        if e.matched() {
            self.send_cts(rid, cx);
        }
    }
}

/// A matched entry with reads leaves (completion, failure, close): pieces not yet on the
/// device come back into its buffer (out of the queue `wrs`); those on the device are replaced
/// by zeros (their completions find no entry).
pub(super) fn entry_removed(rid: u32, e: &mut RxEntry, wrs: &mut VecDeque<Wr>) {
    let msg_len = e.msg.msg_len;
    let Some(r) = e.read.as_mut() else {
        return;
    };
    if r.phase != Phase::Reading {
        return;
    }
    let mut i = 0;
    while i < wrs.len() {
        if wrs.get(i).is_some_and(|w| w.owner == WrOwner::Rx(rid)) {
            if let Some(Wr {
                what:
                    WrWhat::Read {
                        piece,
                        buf,
                        region: None,
                    },
                ..
            }) = wrs.remove(i)
            {
                r.pieces.put(piece, buf, Status::Flushed);
            }
        } else {
            i += 1;
        }
    }
    r.phase = Phase::Done;
    let pieces = std::mem::take(&mut r.pieces);
    if let RxState::Matched(sink) = &mut e.state {
        let head = std::mem::take(&mut sink.buf);
        sink.buf = pieces.join(head, r.start.min(msg_len));
    }
}
