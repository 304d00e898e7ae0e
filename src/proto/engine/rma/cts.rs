//! The long-CTS protocols of the emulation: LONGCTS_RTW (and DC_LONGCTS_RTW) for writes and
//! LONGCTS_RTR for reads longer than one packet. They use the message protocol's flow control:
//! the side that receives the data grants windows of `tx_min_credits` packets with CTS, the
//! other side sends the window as CTSDATA.
//!
//! * **Write**: the initiator's LONGCTS_RTW names the target ranges and carries the first bytes.
//!   The target checks every range (key, bounds, `REMOTE_WRITE`) before it places anything, then
//!   answers with CTS windows (or PEER_ERROR). It reports a write with immediate data once every
//!   byte is in place, and answers DC_LONGCTS_RTW with a RECEIPT then. The initiator completes a
//!   plain write when the device has completed all its packets (transmit complete), a
//!   delivery-complete one at the RECEIPT.
//! * **Read**: the requester's LONGCTS_RTR grants the first window. The responder checks the
//!   ranges (`REMOTE_READ`), answers with one READRSP (the first bytes and its own id) and
//!   CTSDATA for the rest of the window; the requester grants further windows with CTS carrying
//!   the READ_REQ flag, and completes when every byte is in its buffer.
//!
//! Memory the application holds locked is retried like the rest of the target work (`Again`).

use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::super::cx::Cx;
use super::super::read::write_range;
use super::super::rx::RxSide;
use super::super::tx::{cts_credit, cts_window_end, grant_cts, push_ctsdata};
use super::super::types::{Owner, Pkt};
use super::super::util::{Out, RangeSet, encode};
use super::super::wr::{ReadIovs, carve};
use super::super::{Event, RemoteWriteDone, RmaMemory};
use super::{Ema, EmaOp, OpKind, Work, refuse_op};
use crate::device::{RemoteIov, Status};
use crate::error::{Error, ErrorKind};
use crate::proto::wire::{CTSDATA_MAX_HEADER_LEN, IovList, Packet, ReqOpt};

/// The long-CTS state of an operation this side started.
#[derive(Debug, Default)]
pub(super) struct CtsOp {
    /// Write: bytes put into packets. Read: bytes received.
    pub(super) done: usize,
    /// End of the windows granted so far.
    pub(super) window_end: usize,
    /// The peer's id of the operation: the target's `recv_id` from its CTS (write), the
    /// responder's `send_id` from its READRSP (read).
    pub(super) peer_id: Option<u32>,
    /// Packets of the operation (its REQ and CTSDATA) not yet completed by the device.
    pub(super) pkts: usize,
    /// Read: the ranges received (an overlap is a duplicate and dropped).
    pub(super) got: RangeSet,
}

/// Bytes of a READRSP's payload at most.
pub(super) fn readrsp_room(cx: &Cx) -> usize {
    let rsp = Packet::ReadRsp {
        connid: Some(cx.local.qkey),
        recv_id: 0,
        send_id: 0,
        seg_length: 0,
    };
    let hdr = encode(&rsp).map_or(cx.cfg.mtu, |h| h.bytes().len());
    cx.cfg.mtu.saturating_sub(hdr)
}

impl Ema {
    /// True when `id` is an id `Ema::recv_id` handed out and still in use.
    pub(in crate::proto::engine) fn owns_recv_id(&self, id: u32) -> bool {
        (!self.tgt.is_empty() && self.tgt.contains_key(&id))
            || (!self.ops.is_empty()
                && self
                    .ops
                    .get(&id)
                    .is_some_and(|o| o.cts.is_some() && matches!(o.kind, OpKind::Read(_))))
    }
}

/// A long-CTS operation of a peer that this side serves.
#[derive(Debug)]
pub(super) struct Tgt {
    pid: u64,
    rma: ReadIovs,
    total: usize,
    /// Write: bytes placed in memory. Read: bytes put into packets.
    done: usize,
    /// End of the windows granted so far.
    window_end: usize,
    /// Write: the ranges received (placement may lag behind while a region is locked).
    got: RangeSet,
    kind: TgtKind,
}

#[derive(Debug, Clone, Copy)]
enum TgtKind {
    Write {
        send_id: u32,
        dc: bool,
        cq_data: Option<u64>,
    },
    Read {
        recv_id: u32,
    },
}

impl TgtKind {
    /// The initiator's id of the operation (a write's `send_id`, a read's `recv_id`): what a
    /// refusal names.
    fn initiator_id(self) -> u32 {
        match self {
            TgtKind::Write { send_id, .. } => send_id,
            TgtKind::Read { recv_id } => recv_id,
        }
    }
}

impl Ema {
    /// An id for state that a peer names in `recv_id` (CTSDATA, READRSP): unique among the
    /// receive entries (`RxSide::alloc_id`) and the emulation's operations and targets (whose
    /// other ids come from the send ids), so CTSDATA finds its owner.
    fn recv_id(&self, rx: &mut RxSide) -> u32 {
        loop {
            let id = rx.alloc_id(|id| self.owns_recv_id(id));
            if !self.ops.contains_key(&id) && !self.tgt.contains_key(&id) {
                return id;
            }
        }
    }

    // ---- initiator ----

    /// Starts a LONGCTS_RTW (DC_LONGCTS_RTW when `dc`): the REQ with the first bytes; the rest
    /// follows the target's CTS windows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cts_write_start(
        &mut self,
        pid: u64,
        id: u32,
        opt: ReqOpt,
        remote: RemoteIov,
        buf: Bytes,
        dc: bool,
        context: u64,
        cx: &mut Cx,
    ) -> Result<(), (Error, Bytes)> {
        let len = buf.len();
        let one = [remote];
        let req = Packet::LongCtsRtw {
            opt,
            msg_length: len as u64,
            send_id: id,
            credit_request: u32::try_from(cx.cfg.tx_min_credits).unwrap_or(u32::MAX),
            dc,
            read_nack: false,
            rma_iov: IovList::new(&one),
        };
        let Some(hdr) = encode(&req) else {
            return Err((Error::new(ErrorKind::Io, "write"), buf));
        };
        let room = cx.cfg.mtu.saturating_sub(hdr.bytes().len());
        if cx.cfg.mtu <= CTSDATA_MAX_HEADER_LEN {
            let e = Error::new(ErrorKind::InvalidArgument, "write").with_detail("MTU too small");
            return Err((e, buf));
        }
        let n = room.min(len);
        self.ops.insert(
            id,
            EmaOp {
                pid,
                context,
                pay: buf,
                kind: OpKind::Write,
                len,
                // A delivery-complete write waits for its RECEIPT.
                waiting: usize::from(dc),
                error: None,
                cts: Some(Box::new(CtsOp {
                    done: n,
                    window_end: n,
                    peer_id: None,
                    pkts: 1,
                    got: RangeSet::default(),
                })),
            },
        );
        cx.peers
            .enqueue(Pkt::new(pid, Owner::Ema(id), hdr, 0, n), false, false);
        Ok(())
    }

    /// Starts a LONGCTS_RTR granting the first window; `buf` is `len` bytes long.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cts_read_start(
        &mut self,
        pid: u64,
        opt: ReqOpt,
        remote: RemoteIov,
        buf: BytesMut,
        context: u64,
        rx: &mut RxSide,
        cx: &mut Cx,
    ) -> Result<(), (Error, BytesMut)> {
        let len = buf.len();
        let id = self.recv_id(rx);
        let window = len.min(cts_credit(&cx.cfg));
        let one = [remote];
        let req = Packet::LongCtsRtr {
            opt,
            msg_length: len as u64,
            recv_id: id,
            recv_length: u32::try_from(window).unwrap_or(u32::MAX),
            rma_iov: IovList::new(&one),
        };
        let Some(hdr) = encode(&req) else {
            return Err((Error::new(ErrorKind::Io, "read"), buf));
        };
        let window = window.min(u32::MAX as usize);
        self.ops.insert(
            id,
            EmaOp {
                pid,
                context,
                pay: Bytes::new(),
                kind: OpKind::Read(buf),
                len,
                waiting: 1,
                error: None,
                cts: Some(Box::new(CtsOp {
                    done: 0,
                    window_end: window,
                    peer_id: None,
                    pkts: 1,
                    got: RangeSet::default(),
                })),
            },
        );
        cx.peers
            .enqueue(Pkt::ctrl(pid, Owner::Ema(id), hdr), false, false);
        Ok(())
    }

    /// Data of one of our long-CTS reads (READRSP or CTSDATA), at `off`.
    pub(super) fn cts_read_data(&mut self, pid: u64, id: u32, off: u64, data: &[u8], cx: &mut Cx) {
        let Some(op) = self.ops.get_mut(&id) else {
            return cx.out.drop_pkt("CTSDATA for no read");
        };
        let (Some(c), OpKind::Read(buf)) = (op.cts.as_deref_mut(), &mut op.kind) else {
            return cx
                .out
                .drop_pkt("CTSDATA for an operation that is not a long-CTS read");
        };
        if op.pid != pid || op.error.is_some() {
            return cx
                .out
                .drop_pkt("CTSDATA from another peer or for a failed read");
        }
        let Some(end) = in_window(off, data, c.window_end) else {
            return cx.out.drop_pkt("read data outside the window granted");
        };
        if !c.got.insert(off, end) {
            return cx.out.drop_pkt("duplicate read data");
        }
        if let Some(dst) = buf.get_mut(off as usize..end as usize) {
            crate::mem::copy::copy(dst, data);
        }
        c.done += data.len();
        let (done, window_end, len) = (c.done, c.window_end, op.len);
        if done == len {
            op.waiting = 0;
            return self.maybe_done(id, &mut cx.out);
        }
        if done == window_end {
            let Some(responder) = c.peer_id else {
                return;
            };
            c.window_end += grant_cts(cx, pid, responder, id, len - done, true);
        }
    }

    /// A device completion of one of our long-CTS operations' packets (success).
    pub(super) fn cts_pkt_sent(&mut self, id: u32, out: &mut Out) {
        let Some(c) = self.ops.get_mut(&id).and_then(|o| o.cts.as_deref_mut()) else {
            return;
        };
        c.pkts = c.pkts.saturating_sub(1);
        self.maybe_done(id, out);
    }

    /// Queues the CTSDATA (and for a read's first window the READRSP) of the window granted.
    /// Waits for the peer's HANDSHAKE: CTSDATA carries our connid after its header.
    fn cts_send_window(&mut self, now: Instant, pid: u64, side: Side, cx: &mut Cx) {
        if !cx.peers.get(&pid).is_some_and(|p| p.hs_received) {
            if !self.blocked.contains(&(pid, side)) {
                self.blocked.push((pid, side));
            }
            return;
        }
        match side {
            Side::Op(id) => self.cts_send_write_window(pid, id, cx),
            Side::Tgt(tid) => self.target(now, Work::Respond { tid }, cx),
        }
    }

    /// The peer's HANDSHAKE arrived: windows that waited for it go.
    pub(in crate::proto::engine) fn handshake(&mut self, now: Instant, pid: u64, cx: &mut Cx) {
        if self.blocked.is_empty() {
            return;
        }
        let (ready, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.blocked)
            .into_iter()
            .partition(|&(p, _)| p == pid);
        self.blocked = later;
        for (p, side) in ready {
            self.cts_send_window(now, p, side, cx);
        }
    }

    fn cts_send_write_window(&mut self, pid: u64, id: u32, cx: &mut Cx) {
        let Some(c) = self.ops.get(&id).and_then(|o| o.cts.as_deref()) else {
            return;
        };
        let Some(recv_id) = c.peer_id else {
            return;
        };
        let (from, to) = (c.done, c.window_end);
        let mut pkts = Vec::new();
        let end = push_ctsdata(
            &mut pkts,
            pid,
            Owner::Ema(id),
            recv_id,
            from..to,
            0,
            &cx.cfg,
            cx.local,
        );
        let Some(c) = self.ops.get_mut(&id).and_then(|o| o.cts.as_deref_mut()) else {
            return;
        };
        c.done = end;
        c.pkts += pkts.len();
        for p in pkts {
            cx.peers.enqueue(p, false, false);
        }
    }

    // ---- target ----

    /// A LONGCTS_RTW or DC_LONGCTS_RTW: checks every range, places the first bytes, then CTS.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::proto::engine) fn longcts_rtw(
        &mut self,
        now: Instant,
        pid: u64,
        rma_iov: IovList<'_>,
        msg_length: u64,
        send_id: u32,
        dc: bool,
        cq_data: Option<u64>,
        data: &[u8],
        rx: &mut RxSide,
        cx: &mut Cx,
    ) {
        if data.len() as u64 > msg_length {
            return cx.out.drop_pkt("LONGCTS_RTW carrying more than its length");
        }
        let Some((rma, total)) = self.cts_accept(pid, rma_iov, msg_length, send_id, true, cx)
        else {
            return;
        };
        let kind = TgtKind::Write {
            send_id,
            dc,
            cq_data,
        };
        let tid = self.serve(rx, pid, rma, total, data.len(), data.len(), kind);
        let data = Bytes::copy_from_slice(data);
        self.target(now, Work::Place { tid, off: 0, data }, cx);
    }

    /// A LONGCTS_RTR: checks every range, then READRSP and CTSDATA for the first window.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::proto::engine) fn longcts_rtr(
        &mut self,
        now: Instant,
        pid: u64,
        rma_iov: IovList<'_>,
        msg_length: u64,
        recv_id: u32,
        recv_length: u32,
        rx: &mut RxSide,
        cx: &mut Cx,
    ) {
        if recv_length == 0 || msg_length == 0 {
            return cx.out.drop_pkt("LONGCTS_RTR with an empty window or range");
        }
        let Some((rma, total)) = self.cts_accept(pid, rma_iov, msg_length, recv_id, false, cx)
        else {
            return;
        };
        let window_end = total.min(recv_length as usize);
        let tid = self.serve(
            rx,
            pid,
            rma,
            total,
            window_end,
            0,
            TgtKind::Read { recv_id },
        );
        self.cts_send_window(now, pid, Side::Tgt(tid), cx);
    }

    /// A CTS for the emulation. With READ_REQ (`read_req`) the requester grants the next window
    /// of a read we serve; without, the target grants the next window of one of our long-CTS
    /// writes (`send_id` is an emulated operation's).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::proto::engine) fn cts(
        &mut self,
        now: Instant,
        pid: u64,
        send_id: u32,
        recv_id: u32,
        recv_length: u64,
        read_req: bool,
        cx: &mut Cx,
    ) {
        let side = if read_req {
            let Some(t) = self.tgt.get_mut(&send_id) else {
                return cx.out.drop_pkt("CTS (read) for an unknown send_id");
            };
            let ok = t.pid == pid
                && matches!(t.kind, TgtKind::Read { recv_id: r } if r == recv_id)
                && t.done == t.window_end;
            let end = cts_window_end(t.done, recv_length, t.total).filter(|_| ok);
            let Some(end) = end else {
                return cx.out.drop_pkt("CTS (read) that does not match its read");
            };
            t.window_end = end;
            Side::Tgt(send_id)
        } else {
            let Some(op) = self.ops.get_mut(&send_id) else {
                return cx
                    .out
                    .drop_pkt("CTS for an RMA operation of another peer or state");
            };
            let (Some(c), OpKind::Write) = (op.cts.as_deref_mut(), &op.kind) else {
                return cx
                    .out
                    .drop_pkt("CTS for an RMA operation of another peer or state");
            };
            if op.pid != pid {
                return cx
                    .out
                    .drop_pkt("CTS for an RMA operation of another peer or state");
            }
            if op.error.is_some() {
                return cx.out.drop_pkt("CTS for a failed write");
            }
            let end =
                cts_window_end(c.done, recv_length, op.len).filter(|_| c.done == c.window_end);
            let Some(end) = end else {
                return cx
                    .out
                    .drop_pkt("CTS outside the write, or while a window is being sent");
            };
            c.window_end = end;
            c.peer_id = Some(recv_id);
            Side::Op(send_id)
        };
        self.cts_send_window(now, pid, side, cx);
    }

    /// CTSDATA of a long-CTS write we serve or of one of our long-CTS reads (`recv_id` is an
    /// id of the emulation's).
    pub(in crate::proto::engine) fn ctsdata(
        &mut self,
        now: Instant,
        pid: u64,
        recv_id: u32,
        off: u64,
        data: &[u8],
        cx: &mut Cx,
    ) {
        if let Some(t) = self.tgt.get_mut(&recv_id) {
            if t.pid != pid || !matches!(t.kind, TgtKind::Write { .. }) {
                return cx.out.drop_pkt("CTSDATA from another peer or for a read");
            }
            let Some(end) = in_window(off, data, t.window_end) else {
                return cx.out.drop_pkt("CTSDATA outside the window granted");
            };
            if !t.got.insert(off, end) {
                return cx.out.drop_pkt("duplicate CTSDATA");
            }
            let w = Work::Place {
                tid: recv_id,
                off: off as usize,
                data: Bytes::copy_from_slice(data),
            };
            return self.target(now, w, cx);
        }
        if self.owns_recv_id(recv_id) {
            return self.cts_read_data(pid, recv_id, off, data, cx);
        }
        cx.out
            .drop_pkt("CTSDATA for an RMA operation of another peer or state")
    }

    /// Starts serving a peer's long-CTS request: a target under a fresh id ([`Self::recv_id`],
    /// returned) for the ranges `rma` of `total` bytes, with the windows granted up to
    /// `window_end`, of which bytes `..received` arrived already (a write's REQ carries them).
    #[allow(clippy::too_many_arguments)]
    fn serve(
        &mut self,
        rx: &mut RxSide,
        pid: u64,
        rma: ReadIovs,
        total: usize,
        window_end: usize,
        received: usize,
        kind: TgtKind,
    ) -> u32 {
        let tid = self.recv_id(rx);
        let mut got = RangeSet::default();
        if received > 0 {
            got.insert(0, received as u64);
        }
        let t = Tgt {
            pid,
            rma,
            total,
            done: 0,
            window_end,
            got,
            kind,
        };
        self.tgt.insert(tid, t);
        tid
    }

    /// Whether this side serves a long-CTS request: its ranges must add up to `msg_length` (else
    /// it is dropped), all of them must be in the memory with the right (`REMOTE_WRITE` when
    /// `write`), and fewer than `max_rx_ops` such requests may be served at once (else
    /// PEER_ERROR to `op_id`). The ranges and the length when it is served.
    fn cts_accept(
        &mut self,
        pid: u64,
        rma_iov: IovList<'_>,
        msg_length: u64,
        op_id: u32,
        write: bool,
        cx: &mut Cx,
    ) -> Option<(ReadIovs, usize)> {
        let rma = ReadIovs::of(&rma_iov);
        if rma_iov.len() != rma.as_slice().len() || rma.total() != Some(msg_length) {
            cx.out
                .drop_pkt("long-CTS request whose ranges and length differ");
            return None;
        }
        let Ok(total) = usize::try_from(msg_length) else {
            cx.out.drop_pkt("long-CTS request longer than memory");
            return None;
        };
        let in_memory = cx.memory.as_deref().is_some_and(|mem| {
            rma.as_slice()
                .iter()
                .all(|iov| mem.check(iov.key, iov.addr, iov.len, write).is_ok())
        });
        if !in_memory {
            cx.counts.count(write, false);
            refuse_op(pid, op_id, Status::RemoteBadAddress, cx);
            return None;
        }
        if self.tgt.len() >= cx.cfg.max_rx_ops {
            tracing::debug!("long-CTS request: max_rx_ops peer operations served already");
            cx.counts.count(write, false);
            refuse_op(pid, op_id, Status::RemoteAbort, cx);
            return None;
        }
        Some((rma, total))
    }

    /// Target work: places bytes `off..` of write `tid`. `Err(())`: the region is locked.
    pub(super) fn cts_place(
        &mut self,
        mem: &dyn RmaMemory,
        tid: u32,
        off: usize,
        data: &[u8],
        cx: &mut Cx,
    ) -> Result<(), ()> {
        let Some(t) = self.tgt.get(&tid) else {
            return Ok(());
        };
        let TgtKind::Write {
            send_id,
            dc,
            cq_data,
        } = t.kind
        else {
            return Ok(());
        };
        let pid = t.pid;
        match write_range(mem, &t.rma, off, data) {
            Err(e) if e.kind() == ErrorKind::Again => return Err(()),
            Err(_) => {
                self.cts_refuse(tid, Status::RemoteBadAddress, cx);
                return Ok(());
            }
            Ok(()) => {}
        }
        let qkey = cx.local.qkey;
        let Some(t) = self.tgt.get_mut(&tid) else {
            return Ok(());
        };
        t.done += data.len();
        if t.done == t.total {
            let total = t.total;
            self.tgt.remove(&tid);
            cx.counts.count(true, true);
            if dc {
                let r = Packet::Receipt {
                    connid: Some(qkey),
                    send_id,
                    msg_id: 0,
                };
                cx.peers.queue_ctrl(pid, &r);
            }
            if let (Some(d), Some(src)) = (cq_data, cx.peers.get(&pid).map(|p| p.addr)) {
                cx.out.events.push_back(Event::RemoteWrite(RemoteWriteDone {
                    src,
                    data: d as u32,
                    len: total,
                }));
            }
        } else if t.done == t.window_end {
            t.window_end += grant_cts(cx, pid, send_id, tid, t.total - t.done, false);
        }
        Ok(())
    }

    /// Target work: reads the window granted to read `tid` and queues it as READRSP (first) and
    /// CTSDATA. `Err(())`: the region is locked.
    pub(super) fn cts_respond(
        &mut self,
        mem: &dyn RmaMemory,
        tid: u32,
        cx: &mut Cx,
    ) -> Result<(), ()> {
        let Some(t) = self.tgt.get(&tid) else {
            return Ok(());
        };
        let TgtKind::Read { recv_id } = t.kind else {
            return Ok(());
        };
        let (pid, from, to) = (t.pid, t.done, t.window_end);
        if from >= to {
            return Ok(());
        }
        let data = match read_range(mem, &t.rma, from, to) {
            Err(e) if e.kind() == ErrorKind::Again => return Err(()),
            Err(_) => {
                self.cts_refuse(tid, Status::RemoteBadAddress, cx);
                return Ok(());
            }
            Ok(d) => d,
        };
        let rid = self.next_resp;
        self.next_resp = self.next_resp.wrapping_add(1);
        let owner = Owner::Resp(rid);
        let mut pkts = Vec::new();
        // The first window starts with one READRSP (the responder's id, the first bytes).
        let mut off = from;
        if from == 0 {
            let n = readrsp_room(cx).max(1).min(to);
            let rsp = Packet::ReadRsp {
                connid: Some(cx.local.qkey),
                recv_id,
                send_id: tid,
                seg_length: n as u64,
            };
            if let Some(hdr) = encode(&rsp) {
                pkts.push(Pkt::new(pid, owner, hdr, 0, n));
                off = n;
            }
        }
        push_ctsdata(
            &mut pkts,
            pid,
            owner,
            recv_id,
            off..to,
            from,
            &cx.cfg,
            cx.local,
        );
        self.resp.insert(rid, (data, pkts.len()));
        for p in pkts {
            cx.peers.enqueue(p, false, false);
        }
        if let Some(t) = self.tgt.get_mut(&tid) {
            t.done = to;
            if t.done == t.total {
                self.tgt.remove(&tid);
                cx.counts.count(false, true);
            }
        }
        Ok(())
    }

    /// Refuses target `tid` (its memory went away or changed since its request was checked,
    /// or the memory refused the work): it is forgotten, counted as failed, and its initiator
    /// gets a PEER_ERROR with `status`.
    pub(super) fn cts_refuse(&mut self, tid: u32, status: Status, cx: &mut Cx) {
        let Some(t) = self.tgt.remove(&tid) else {
            return;
        };
        cx.counts
            .count(matches!(t.kind, TgtKind::Write { .. }), false);
        refuse_op(t.pid, t.kind.initiator_id(), status, cx);
    }

    /// Forgets the long-CTS work of `pid` (every peer's when `None`) it serves.
    pub(super) fn cts_forget(&mut self, pid: Option<u64>) {
        self.tgt.retain(|_, t| pid.is_some_and(|p| t.pid != p));
        self.blocked.retain(|(p, _)| pid.is_some_and(|x| *p != x));
    }
}

/// Which side of a long-CTS operation a window belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// One of our writes (its op id).
    Op(u32),
    /// A read we serve (its target id).
    Tgt(u32),
}

/// Bytes `from..to` of the ranges `rma`, read from `mem`.
fn read_range(mem: &dyn RmaMemory, rma: &ReadIovs, from: usize, to: usize) -> crate::Result<Bytes> {
    let ranges = carve(rma.as_slice(), from, to, usize::MAX)
        .ok_or_else(|| Error::new(ErrorKind::RemoteAccess, "rma").with_detail("beyond rma_iov"))?;
    if let [one] = ranges.as_slice() {
        return mem.read(one.key, one.addr, one.len);
    }
    let mut out = BytesMut::with_capacity(to - from);
    for r in ranges {
        out.extend_from_slice(&mem.read(r.key, r.addr, r.len)?);
    }
    Ok(out.freeze())
}

/// Where `data`, at `off` of a long-CTS transfer, ends, if it is not empty and lies within the
/// windows granted so far (up to `window_end`).
fn in_window(off: u64, data: &[u8], window_end: usize) -> Option<u64> {
    let n = data.len() as u64;
    off.checked_add(n)
        .filter(|&end| n > 0 && end <= window_end as u64)
}
