//! Emulated RMA and atomics: what runs when device RDMA does not (`read.rs` decides).
//!
//! * **Writes** that fit one packet go as DC_EAGER_RTW; the target answers with a RECEIPT once
//!   the bytes are in its memory, or with PEER_ERROR when the key, range or right is wrong, so
//!   a refused write fails at the initiator. Longer writes go as DC_LONGCTS_RTW with CTS flow
//!   control ([`cts`]): an emulated write is always delivery complete. (The target serves
//!   plain LONGCTS_RTW and EAGER_RTW from other implementations too.)
//! * **Reads** that fit one READRSP go as SHORT_RTR, answered by one READRSP (or PEER_ERROR);
//!   longer ones as LONGCTS_RTR ([`cts`]).
//! * **Atomics** go as one RTA packet (WRITE as DC_WRITE_RTA answered by RECEIPT, FETCH and
//!   COMPARE answered by ATOMRSP), with a `msg_id` of the peer's message sequence: the target
//!   applies them in the reorder window's order, after the messages sent before them.
//! * At the target, memory the application holds locked (`Again`) is retried from
//!   `Engine::handle_timeout` ([`Ema::timeout`]) in arrival order; nothing is dropped.

use crate::proto::engine::util::Timer;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::cx::Cx;
use super::peer::our_sender;
use super::read::ReadState;
use super::rx::{Ready, RxSide};
use super::tx::TxSide;
use super::types::{Owner, Pkt};
use super::util::{Out, encode};
use super::{Event, RemoteWriteDone, RmaBuf, RmaKind, RmaOp, RmaPath};
use crate::atomic::{AtomicOp, AtomicType};
use crate::device::{RemoteIov, Status};
use crate::error::{Error, ErrorKind};
use crate::proto::wire::{IovList, Packet, ReqOpt, RtaKind, Sender, peer_error_ref};

mod cts;

use cts::{CtsOp, Side, Tgt};

/// How long target work waits before retrying a region the application holds.
const RETRY: Duration = Duration::from_micros(50);

/// The emulation's state.
#[derive(Debug, Default)]
pub(super) struct Ema {
    /// Operations this side started, by id (the `send_id` / `recv_id` of their packets).
    ops: HashMap<u32, EmaOp>,
    /// Payloads of response packets (READRSP, CTSDATA of a read, ATOMRSP) until the device is
    /// done with them: the bytes and the packets still using them.
    resp: HashMap<u32, (Bytes, usize)>,
    next_resp: u32,
    /// Target work waiting for a region the application holds, in arrival order.
    retry: VecDeque<Work>,
    /// Bytes the waiting work holds (bounded by `EngineLimits::max_buffered_bytes`).
    retry_bytes: usize,
    /// Atomics waiting for their turn in the reorder window, by their rx entry id.
    rta: HashMap<u32, Work>,
    /// Long-CTS writes and reads of peers this side serves, by the id it gave them.
    tgt: HashMap<u32, Tgt>,
    /// Long-CTS windows waiting for the peer's HANDSHAKE.
    blocked: Vec<(u64, Side)>,
}

#[derive(Debug)]
struct EmaOp {
    pid: u64,
    context: u64,
    /// The write's data, or the atomic's operand (then compare).
    pay: Bytes,
    kind: OpKind,
    len: usize,
    /// Answers still expected.
    waiting: usize,
    error: Option<(Error, Option<Status>)>,
    /// Long-CTS writes and reads.
    cts: Option<Box<CtsOp>>,
}

#[derive(Debug)]
enum OpKind {
    Write,
    Read(BytesMut),
    Atomic {
        operand_len: usize,
        fetch: Option<BytesMut>,
    },
}

/// Work for the target side.
#[derive(Debug)]
enum Work {
    Write {
        pid: u64,
        iovs: Vec<RemoteIov>,
        data: Bytes,
        dc_send_id: Option<u32>,
        cq_data: Option<u64>,
    },
    Read {
        pid: u64,
        iov: RemoteIov,
        recv_id: u32,
    },
    Atomic {
        pid: u64,
        kind: RtaKind,
        msg_id: u32,
        op: u32,
        datatype: u32,
        iov: RemoteIov,
        data: Bytes,
    },
    /// Bytes `off..` of a long-CTS write this side serves.
    Place { tid: u32, off: usize, data: Bytes },
    /// The window granted to a long-CTS read this side serves.
    Respond { tid: u32 },
}

impl Work {
    /// Bytes of data the work holds.
    fn held_bytes(&self) -> usize {
        match self {
            Work::Write { data, .. } | Work::Atomic { data, .. } | Work::Place { data, .. } => {
                data.len()
            }
            Work::Read { .. } | Work::Respond { .. } => 0,
        }
    }

    /// Whether the work may change memory (a write, an atomic other than a read): counted as a
    /// remote write, else as a remote read ([`TargetCounts`](super::TargetCounts)).
    fn writes(&self) -> bool {
        match self {
            Work::Write { .. } | Work::Place { .. } => true,
            Work::Read { .. } | Work::Respond { .. } => false,
            Work::Atomic { op, .. } => AtomicOp::from_code(*op).is_ok_and(|o| o != AtomicOp::Read),
        }
    }
}

/// What an emulated operation starts from: its peer, how it names itself to it, its id, and the
/// parts of its `RmaOp` to hand back if it is refused.
#[derive(Clone, Copy)]
struct Start {
    pid: u64,
    sender: Sender,
    id: u32,
    dest: crate::addr::RawAddr,
    remote: RemoteIov,
    local_key: Option<(u64, u64)>,
    delivery_complete: bool,
    context: u64,
}

impl Start {
    /// The operation again, with `kind` (its buffers handed back).
    fn op(self, kind: RmaKind) -> RmaOp {
        RmaOp {
            dest: self.dest,
            remote: self.remote,
            kind,
            local_key: self.local_key,
            delivery_complete: self.delivery_complete,
            context: self.context,
            local_region: None,
        }
    }
}

impl Ema {
    /// True when `id` is the send-side id of an emulated operation in flight.
    pub(super) fn owns_send_id(&self, id: u32) -> bool {
        !self.ops.is_empty() && self.ops.contains_key(&id)
    }

    /// Peers' operations the emulation serves (see [`super::Resources::target_ops`]).
    pub(super) fn target_ops(&self) -> usize {
        self.tgt.len() + self.retry.len() + self.rta.len() + self.resp.len()
    }

    /// Operations of the emulation in flight.
    pub(super) fn ops_len(&self) -> usize {
        self.ops.len()
    }

    /// The payload of a packet of the emulation (`None`: its owner is gone).
    pub(super) fn payload(&self, owner: &Owner, off: usize, end: usize) -> Option<Bytes> {
        match owner {
            Owner::Ema(id) => {
                let op = self.ops.get(id)?;
                Some(
                    op.pay
                        .get(off..end)
                        .map_or_else(Bytes::new, |_| op.pay.slice(off..end)),
                )
            }
            Owner::Resp(id) => {
                let (p, _) = self.resp.get(id)?;
                Some(
                    p.get(off..end)
                        .map_or_else(Bytes::new, |_| p.slice(off..end)),
                )
            }
            _ => None,
        }
    }
}

impl Ema {
    /// A request of a peer's RMA or atomic operation (LONGCTS_RTW, LONGCTS_RTR, EAGER_RTW,
    /// SHORT_RTR, RTA): this side is its target.
    pub(super) fn request(
        &mut self,
        now: Instant,
        pid: u64,
        pkt: &Packet<'_>,
        payload: &[u8],
        rx: &mut RxSide,
        cx: &mut Cx,
    ) {
        match *pkt {
            Packet::LongCtsRtw {
                opt,
                msg_length,
                send_id,
                dc,
                rma_iov,
                ..
            } => self.longcts_rtw(
                now,
                pid,
                rma_iov,
                msg_length,
                send_id,
                dc,
                opt.cq_data,
                payload,
                rx,
                cx,
            ),
            Packet::LongCtsRtr {
                msg_length,
                recv_id,
                recv_length,
                rma_iov,
                ..
            } => self.longcts_rtr(now, pid, rma_iov, msg_length, recv_id, recv_length, rx, cx),
            Packet::EagerRtw {
                opt,
                dc_send_id,
                rma_iov,
            } => self.rtw(now, pid, rma_iov, dc_send_id, opt.cq_data, payload, cx),
            Packet::ShortRtr {
                rma_iov, recv_id, ..
            } => self.rtr(now, pid, rma_iov, recv_id, cx),
            Packet::Rta {
                kind,
                msg_id,
                atomic_datatype,
                atomic_op,
                rma_iov,
                ..
            } => self.rta(
                now,
                pid,
                kind,
                msg_id,
                atomic_op,
                atomic_datatype,
                rma_iov,
                payload,
                rx,
                cx,
            ),
            _ => cx.out.drop_pkt_type(pkt),
        }
    }

    /// Starts an emulated operation (RTW / RTR / RTA); it owns its buffers from here on.
    /// The ids come from the transmit side's space (`tx`, `rd`: the ids device RMA holds) and,
    /// for a long-CTS read, the receive side's (`rx`).
    pub(super) fn start(
        &mut self,
        op: RmaOp,
        tx: &mut TxSide,
        rd: &ReadState,
        rx: &mut RxSide,
        cx: &mut Cx,
    ) -> Result<(), (Error, RmaOp)> {
        let op = super::read::own_buffers(op)?;
        if tx.ops.len() + rd.ops_len() + self.ops.len() >= cx.cfg.max_tx_ops {
            return Err((
                Error::new(ErrorKind::Again, "rma").with_detail("max_tx_ops operations in flight"),
                op,
            ));
        }
        let Some(pid) = cx.peer_for_send(op.dest) else {
            let e = Error::new(ErrorKind::NoMemory, "rma").with_detail("peer table full");
            return Err((e, op));
        };
        let hs = cx.peers.get(&pid).is_some_and(|p| p.hs_received);
        let s = Start {
            pid,
            sender: our_sender(cx.local, hs),
            id: tx.alloc_id(|id| rd.owns_id(id) || self.owns_send_id(id)),
            dest: op.dest,
            remote: op.remote,
            local_key: op.local_key,
            delivery_complete: op.delivery_complete,
            context: op.context,
        };
        match op.kind {
            RmaKind::Write { buf, data } => self.start_write(s, buf, data, cx),
            RmaKind::Read { buf } => self.start_read(s, buf, rx, cx),
            RmaKind::Atomic {
                op,
                datatype,
                operand,
                compare,
                fetch,
            } => self.start_atomic(s, op, datatype, operand, compare, fetch, cx),
        }
    }

    /// An emulated write: one EAGER_RTW when it fits a packet, else long-CTS.
    fn start_write(
        &mut self,
        s: Start,
        buf: Bytes,
        data: Option<u32>,
        cx: &mut Cx,
    ) -> Result<(), (Error, RmaOp)> {
        let back = |e: Error, buf: Bytes| Err((e, s.op(RmaKind::Write { buf, data })));
        let len = buf.len();
        if s.remote.len != len as u64 {
            let e = Error::new(ErrorKind::InvalidArgument, "write")
                .with_detail("remote length differs from the data's");
            return back(e, buf);
        }
        let opt = ReqOpt {
            sender: s.sender,
            cq_data: data.map(u64::from),
        };
        let one = [s.remote];
        let pkt = Packet::EagerRtw {
            opt,
            dc_send_id: Some(s.id),
            rma_iov: IovList::new(&one),
        };
        let mtu = cx.cfg.mtu;
        let hdr = encode(&pkt).filter(|h| h.bytes().len().saturating_add(len) <= mtu);
        let Some(hdr) = hdr else {
            // Longer than one packet: long-CTS, delivery complete like the eager write (so a
            // write that completed is in the target's memory, and one refused midway fails
            // here).
            let (pid, id, remote, context) = (s.pid, s.id, s.remote, s.context);
            return match self.cts_write_start(pid, id, opt, remote, buf, true, context, cx) {
                Ok(()) => Ok(()),
                Err((e, buf)) => back(e, buf),
            };
        };
        self.ops.insert(
            s.id,
            EmaOp {
                pid: s.pid,
                context: s.context,
                pay: buf,
                kind: OpKind::Write,
                len,
                waiting: 1,
                error: None,
                cts: None,
            },
        );
        cx.peers
            .enqueue(Pkt::new(s.pid, Owner::Ema(s.id), hdr, 0, len), false, false);
        Ok(())
    }

    /// An emulated read: one SHORT_RTR when the response fits a packet, else long-CTS.
    fn start_read(
        &mut self,
        s: Start,
        mut buf: BytesMut,
        rx: &mut RxSide,
        cx: &mut Cx,
    ) -> Result<(), (Error, RmaOp)> {
        let back = |e: Error, buf: BytesMut| Err((e, s.op(RmaKind::Read { buf })));
        let len = usize::try_from(s.remote.len).unwrap_or(usize::MAX);
        if len > isize::MAX as usize / 2 {
            return back(Error::new(ErrorKind::MsgSize, "read"), buf);
        }
        buf.clear();
        buf.resize(len, 0);
        let opt = ReqOpt {
            sender: s.sender,
            cq_data: None,
        };
        if len > cts::readrsp_room(cx) {
            return match self.cts_read_start(s.pid, opt, s.remote, buf, s.context, rx, cx) {
                Ok(()) => Ok(()),
                Err((e, buf)) => back(e, buf),
            };
        }
        let one = [s.remote];
        let pkt = Packet::ShortRtr {
            opt,
            msg_length: len as u64,
            recv_id: s.id,
            rma_iov: IovList::new(&one),
        };
        let Some(hdr) = encode(&pkt) else {
            return back(Error::new(ErrorKind::Io, "read"), buf);
        };
        self.ops.insert(
            s.id,
            EmaOp {
                pid: s.pid,
                context: s.context,
                pay: Bytes::new(),
                kind: OpKind::Read(buf),
                len,
                waiting: 1,
                error: None,
                cts: None,
            },
        );
        cx.peers
            .enqueue(Pkt::ctrl(s.pid, Owner::Ema(s.id), hdr), false, false);
        Ok(())
    }

    /// An emulated atomic: one RTA packet (its operands must fit).
    #[allow(clippy::too_many_arguments)]
    fn start_atomic(
        &mut self,
        s: Start,
        aop: AtomicOp,
        datatype: AtomicType,
        operand: Bytes,
        compare: Option<Bytes>,
        fetch: Option<BytesMut>,
        cx: &mut Cx,
    ) -> Result<(), (Error, RmaOp)> {
        let id = s.id;
        let len = usize::try_from(s.remote.len).unwrap_or(usize::MAX);
        let cmp = compare.as_deref();
        let check = crate::atomic::validate(aop, datatype, len, &operand, cmp);
        let kind = match (&fetch, aop.is_compare()) {
            (Some(_), true) => RtaKind::Compare { recv_id: id },
            (Some(_), false) => RtaKind::Fetch { recv_id: id },
            (None, _) => RtaKind::DcWrite { send_id: id },
        };
        let pay = match &compare {
            Some(c) => {
                let mut v = BytesMut::with_capacity(operand.len() + c.len());
                v.extend_from_slice(&operand);
                v.extend_from_slice(c);
                v.freeze()
            }
            None if aop == AtomicOp::Read => Bytes::new(),
            None => operand.clone(),
        };
        let msg_id = cx.peers.get(&s.pid).map_or(0, |p| p.next_msg_id);
        let one = [s.remote];
        let pkt = Packet::Rta {
            opt: ReqOpt {
                sender: s.sender,
                cq_data: None,
            },
            kind,
            msg_id,
            atomic_datatype: datatype.code(),
            atomic_op: aop.code(),
            rma_iov: IovList::new(&one),
        };
        let mtu = cx.cfg.mtu;
        let hdr = encode(&pkt).filter(|h| h.bytes().len() + pay.len() <= mtu);
        let hdr = match (check, hdr) {
            (Ok(()), Some(h)) => h,
            (check, _) => {
                let e = check.err().unwrap_or_else(|| {
                    Error::new(ErrorKind::MsgSize, "atomic")
                        .with_detail("operands do not fit one packet")
                });
                let kind = RmaKind::Atomic {
                    op: aop,
                    datatype,
                    operand,
                    compare,
                    fetch,
                };
                return Err((e, s.op(kind)));
            }
        };
        if let Some(p) = cx.peers.get_mut(&s.pid) {
            p.next_msg_id = p.next_msg_id.wrapping_add(1);
        }
        let n = pay.len();
        self.ops.insert(
            id,
            EmaOp {
                pid: s.pid,
                context: s.context,
                pay: if aop == AtomicOp::Read { operand } else { pay },
                kind: OpKind::Atomic {
                    operand_len: len,
                    fetch,
                },
                len,
                waiting: 1,
                error: None,
                cts: None,
            },
        );
        // Read atomics carry no payload: the packet's range is empty.
        let end = if aop == AtomicOp::Read { 0 } else { n };
        cx.peers
            .enqueue(Pkt::new(s.pid, Owner::Ema(id), hdr, 0, end), false, false);
        Ok(())
    }

    /// A packet of the emulation left the device: responses free their payload; a failed
    /// request fails its operation.
    pub(super) fn pkt_done(&mut self, owner: &Owner, status: Status, out: &mut Out) {
        match *owner {
            Owner::Resp(id) => {
                if let Some((_, n)) = self.resp.get_mut(&id) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.resp.remove(&id);
                    }
                }
            }
            Owner::Ema(id) if status.is_ok() => self.cts_pkt_sent(id, out),
            Owner::Ema(id) => {
                let e = Error::new(status.error_kind(), "rma")
                    .with_detail(format!("device status {status}"));
                if let Some(op) = self.ops.get_mut(&id) {
                    op.error.get_or_insert((e, Some(status)));
                    op.waiting = op.waiting.saturating_sub(1);
                }
                self.maybe_done(id, out);
            }
            _ => {}
        }
    }

    fn maybe_done(&mut self, id: u32, out: &mut Out) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        // A long-CTS operation ends at its first error (its packets still queued are skipped).
        let busy = match &op.cts {
            Some(c) => op.error.is_none() && (op.waiting > 0 || c.pkts > 0 || c.done < op.len),
            None => op.waiting > 0,
        };
        if busy {
            return;
        }
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        if op.cts.is_some() && !self.blocked.is_empty() {
            self.blocked.retain(|&(_, s)| s != Side::Op(id));
        }
        let (error, status) = match op.error {
            Some((e, s)) => (Some(e), s),
            None => (None, None),
        };
        let buf = match op.kind {
            OpKind::Write => RmaBuf::Write(op.pay),
            OpKind::Read(b) => RmaBuf::Read(b),
            OpKind::Atomic { fetch, operand_len } => {
                let operand = if op.pay.len() > operand_len {
                    op.pay.slice(..operand_len)
                } else {
                    op.pay
                };
                RmaBuf::Atomic { operand, fetch }
            }
        };
        out.rma_done(op.context, buf, op.len, RmaPath::Emulated, error, status);
    }

    /// Fails every operation towards `pid` (peer failure) or every one (close, `pid` `None`).
    pub(super) fn fail(
        &mut self,
        pid: Option<u64>,
        e: &Error,
        status: Option<Status>,
        out: &mut Out,
    ) {
        let ids: Vec<u32> = self
            .ops
            .iter()
            .filter(|(_, o)| pid.is_none_or(|p| o.pid == p))
            .map(|(k, _)| *k)
            .collect();
        for id in ids {
            if let Some(op) = self.ops.get_mut(&id) {
                op.error = Some((e.clone(), status));
                op.waiting = 0;
            }
            self.maybe_done(id, out);
        }
        self.cts_forget(pid);
        if pid.is_none() {
            self.retry.clear();
            self.retry_bytes = 0;
            self.rta.clear();
            self.resp.clear();
        }
    }

    /// A RECEIPT for an emulated operation (`send_id` is one's): it answered a write or an
    /// atomic.
    pub(super) fn receipt(&mut self, pid: u64, send_id: u32, out: &mut Out) {
        match self.ops.get_mut(&send_id) {
            Some(op) if op.pid == pid && !matches!(op.kind, OpKind::Read(_)) => {
                op.waiting = op.waiting.saturating_sub(1);
                self.maybe_done(send_id, out);
            }
            _ => out.drop_pkt("RECEIPT for an RMA operation of another peer or a read"),
        }
    }

    /// A READRSP: the answer to a SHORT_RTR, or the start of a LONGCTS_RTR's data.
    pub(super) fn readrsp(
        &mut self,
        pid: u64,
        recv_id: u32,
        send_id: u32,
        data: &[u8],
        cx: &mut Cx,
    ) {
        let Some(op) = self.ops.get_mut(&recv_id) else {
            return cx.out.drop_pkt("READRSP for no read");
        };
        if let Some(c) = op.cts.as_deref_mut() {
            // A long-CTS read: the responder's id and the first bytes.
            if op.pid != pid || c.peer_id.is_some() {
                return cx
                    .out
                    .drop_pkt("READRSP that does not start a long-CTS read");
            }
            c.peer_id = Some(send_id);
            return self.cts_read_data(pid, recv_id, 0, data, cx);
        }
        let OpKind::Read(b) = &mut op.kind else {
            return cx
                .out
                .drop_pkt("READRSP for an operation that is not a read");
        };
        if op.pid != pid || data.len() != op.len || op.waiting == 0 {
            return cx
                .out
                .drop_pkt("READRSP from another peer, of the wrong length or repeated");
        }
        if let Some(dst) = b.get_mut(..data.len()) {
            crate::mem::copy::copy(dst, data);
        }
        op.waiting = 0;
        self.maybe_done(recv_id, &mut cx.out);
    }

    /// An ATOMRSP: the previous values of a fetch or compare atomic.
    pub(super) fn atomrsp(&mut self, pid: u64, recv_id: u32, data: &[u8], out: &mut Out) {
        let Some(op) = self.ops.get_mut(&recv_id) else {
            return out.drop_pkt("ATOMRSP for no atomic");
        };
        let OpKind::Atomic {
            fetch: Some(f),
            operand_len,
        } = &mut op.kind
        else {
            return out.drop_pkt("ATOMRSP for no fetching atomic");
        };
        if op.pid != pid || data.len() != *operand_len {
            return out.drop_pkt("ATOMRSP from another peer or of the wrong length");
        }
        f.clear();
        f.extend_from_slice(data);
        op.waiting = op.waiting.saturating_sub(1);
        self.maybe_done(recv_id, out);
    }

    /// A PEER_ERROR: the target refused one of our operations.
    pub(super) fn peer_error(&mut self, pid: u64, op_id: u32, prov_errno: u32, out: &mut Out) {
        let Some(op) = self.ops.get_mut(&op_id) else {
            return out.drop_pkt("PEER_ERROR for no operation");
        };
        if op.pid != pid {
            return out.drop_pkt("PEER_ERROR from another peer");
        }
        let status = u8::try_from(prov_errno)
            .ok()
            .and_then(Status::from_code)
            .unwrap_or(Status::RemoteBadAddress);
        let e = Error::new(status.error_kind(), "rma")
            .with_detail(format!("the target refused it: {status}"));
        op.error.get_or_insert((e, Some(status)));
        op.waiting = op.waiting.saturating_sub(1);
        self.maybe_done(op_id, out);
    }

    // ---- target side ----

    /// An EAGER_RTW or DC_EAGER_RTW with its data.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rtw(
        &mut self,
        now: Instant,
        pid: u64,
        rma_iov: IovList<'_>,
        dc_send_id: Option<u32>,
        cq_data: Option<u64>,
        data: &[u8],
        cx: &mut Cx,
    ) {
        let iovs: Vec<RemoteIov> = rma_iov.iter().collect();
        let total = iovs.iter().try_fold(0u64, |t, i| t.checked_add(i.len));
        if total != Some(data.len() as u64) {
            return cx
                .out
                .drop_pkt("RTW whose ranges and data differ in length");
        }
        self.target(
            now,
            Work::Write {
                pid,
                iovs,
                data: Bytes::copy_from_slice(data),
                dc_send_id,
                cq_data,
            },
            cx,
        );
    }

    /// A SHORT_RTR.
    pub(super) fn rtr(
        &mut self,
        now: Instant,
        pid: u64,
        rma_iov: IovList<'_>,
        recv_id: u32,
        cx: &mut Cx,
    ) {
        let mut it = rma_iov.iter();
        let (Some(iov), None) = (it.next(), it.next()) else {
            return cx.out.drop_pkt("SHORT_RTR with other than one range");
        };
        let fits = encode(&Packet::ReadRsp {
            connid: Some(cx.local.qkey),
            recv_id,
            send_id: 0,
            seg_length: iov.len,
        })
        .is_some_and(|h| {
            (h.bytes().len() as u64)
                .checked_add(iov.len)
                .is_some_and(|n| n <= cx.cfg.mtu as u64)
        });
        if !fits {
            return cx.out.drop_pkt("SHORT_RTR larger than one READRSP");
        }
        self.target(now, Work::Read { pid, iov, recv_id }, cx);
    }

    /// An RTA: held in the peer's reorder window until its turn.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rta(
        &mut self,
        now: Instant,
        pid: u64,
        kind: RtaKind,
        msg_id: u32,
        op: u32,
        datatype: u32,
        rma_iov: IovList<'_>,
        data: &[u8],
        rx: &mut RxSide,
        cx: &mut Cx,
    ) {
        let mut it = rma_iov.iter();
        let (Some(iov), None) = (it.next(), it.next()) else {
            cx.out.drop_pkt("RTA with other than one range");
            return self.skip_msg_id(now, pid, msg_id, rx, cx);
        };
        // An atomic's operands fit one packet; so does what it fetches.
        if iov.len > cx.cfg.mtu as u64 || data.len() > cx.cfg.mtu {
            cx.out.drop_pkt("RTA larger than a packet");
            return self.skip_msg_id(now, pid, msg_id, rx, cx);
        }
        let w = Work::Atomic {
            pid,
            kind,
            msg_id,
            op,
            datatype,
            iov,
            data: Bytes::copy_from_slice(data),
        };
        match rx.window_slot(now, pid, msg_id, |id| self.owns_recv_id(id), cx) {
            Some(rid) => {
                self.rta.insert(rid, w);
                self.drain(now, pid, rx, cx);
            }
            None => cx.out.drop_pkt("RTA outside the reorder window"),
        }
    }

    /// Skips `msg_id` of a REQ this engine does not implement, so the window moves on.
    fn skip_msg_id(&mut self, now: Instant, pid: u64, msg_id: u32, rx: &mut RxSide, cx: &mut Cx) {
        if rx
            .window_slot(now, pid, msg_id, |id| self.owns_recv_id(id), cx)
            .is_some()
        {
            self.drain(now, pid, rx, cx);
        }
    }

    /// Processes the messages of `pid` that are next in order (`rx`); an atomic among them is
    /// applied in its turn, after the messages sent before it.
    pub(super) fn drain(&mut self, now: Instant, pid: u64, rx: &mut RxSide, cx: &mut Cx) {
        while let Some(ready) = rx.next_ready(now, pid, cx) {
            if let Ready::Atomic(rid) = ready {
                if let Some(w) = self.rta.remove(&rid) {
                    self.target(now, w, cx);
                }
            }
        }
    }

    /// Runs target work now, or after the work waiting before it. The waiting work is bounded:
    /// beyond `max_buffered_bytes` of held data a request is refused (PEER_ERROR, `RemoteAbort`)
    /// instead of growing memory while the application holds a region.
    fn target(&mut self, now: Instant, w: Work, cx: &mut Cx) {
        let w = if self.retry.is_empty() {
            match self.run(w, cx) {
                None => return,
                Some(w) => {
                    cx.out.timers.set(Timer::EmaRetry, Some(now + RETRY));
                    w
                }
            }
        } else {
            w
        };
        let n = w.held_bytes();
        if self.retry_bytes.saturating_add(n) > cx.budget.limits.max_buffered_bytes {
            tracing::debug!("emulated RMA: too much work waits for locked regions; refused");
            return self.refuse(&w, Status::RemoteAbort, cx);
        }
        self.retry_bytes += n;
        self.retry.push_back(w);
    }

    /// Retries target work whose region was locked.
    pub(super) fn timeout(&mut self, now: Instant, cx: &mut Cx) {
        if !cx.out.timers.expired(Timer::EmaRetry, now) {
            return;
        }
        cx.out.timers.stop(Timer::EmaRetry);
        while let Some(w) = self.retry.pop_front() {
            let n = w.held_bytes();
            match self.run(w, cx) {
                Some(w) => {
                    self.retry.push_front(w);
                    cx.out.timers.set(Timer::EmaRetry, Some(now + RETRY));
                    return;
                }
                None => self.retry_bytes = self.retry_bytes.saturating_sub(n),
            }
        }
    }

    /// Applies target work; hands it back when the region is locked (`Again`).
    fn run(&mut self, w: Work, cx: &mut Cx) -> Option<Work> {
        // (A handle of its own: the handlers below take the context mutably.)
        let Some(mem) = cx.memory.clone() else {
            self.refuse(&w, Status::RemoteBadAddress, cx);
            return None;
        };
        let mem: &dyn super::RmaMemory = &*mem;
        match &w {
            Work::Write { cq_data, .. }
                if cq_data.is_some()
                    && cx.out.remote_write_events >= super::MAX_REMOTE_WRITE_EVENTS =>
            {
                // The application has not taken the completions of earlier writes: this one
                // waits (untouched memory), as for a locked region.
                return Some(w);
            }
            Work::Write {
                pid,
                iovs,
                data,
                dc_send_id,
                cq_data,
            } => {
                // The whole range is checked before the first byte is placed.
                let mut off = 0usize;
                let mut res = Ok(());
                for iov in iovs {
                    let n = iov.len as usize;
                    res = mem.write(iov.key, iov.addr, &data[off..off + n]);
                    if res.is_err() {
                        break;
                    }
                    off += n;
                }
                match res {
                    Err(e) if e.kind() == ErrorKind::Again => return Some(w),
                    Err(_) => self.refuse(&w, Status::RemoteBadAddress, cx),
                    Ok(()) => {
                        cx.counts.count(true, true);
                        let pid = *pid;
                        if let Some(send_id) = *dc_send_id {
                            let r = Packet::Receipt {
                                connid: Some(cx.local.qkey),
                                send_id,
                                msg_id: 0,
                            };
                            cx.peers.queue_ctrl(pid, &r);
                        }
                        if let (Some(d), Some(src)) = (*cq_data, cx.peers.get(&pid).map(|p| p.addr))
                        {
                            cx.out.remote_write_events += 1;
                            cx.out.events.push_back(Event::RemoteWrite(RemoteWriteDone {
                                src,
                                data: d as u32,
                                len: data.len(),
                            }));
                        }
                    }
                }
            }
            Work::Place { tid, off, data } => {
                if self.cts_place(mem, *tid, *off, data, cx).is_err() {
                    return Some(w);
                }
            }
            Work::Respond { tid } => {
                if self.cts_respond(mem, *tid, cx).is_err() {
                    return Some(w);
                }
            }
            Work::Read { pid, iov, recv_id } => match mem.read(iov.key, iov.addr, iov.len) {
                Err(e) if e.kind() == ErrorKind::Again => return Some(w),
                Err(_) => self.refuse(&w, Status::RemoteBadAddress, cx),
                Ok(bytes) => {
                    cx.counts.count(false, true);
                    let (pid, recv_id) = (*pid, *recv_id);
                    let pkt = Packet::ReadRsp {
                        connid: Some(cx.local.qkey),
                        recv_id,
                        send_id: 0,
                        seg_length: bytes.len() as u64,
                    };
                    self.respond(pid, &pkt, bytes, cx);
                }
            },
            Work::Atomic {
                pid,
                kind,
                msg_id,
                op,
                datatype,
                iov,
                data,
            } => {
                let (Ok(aop), Ok(dt)) =
                    (AtomicOp::from_code(*op), AtomicType::from_code(*datatype))
                else {
                    self.refuse(&w, Status::UnsupportedOp, cx);
                    return None;
                };
                let len = iov.len as usize;
                let (operand, compare) = match kind {
                    RtaKind::Compare { .. } if Some(data.len()) == len.checked_mul(2) => {
                        (&data[..len], Some(&data[len..]))
                    }
                    RtaKind::Compare { .. } => {
                        self.refuse(&w, Status::RemoteBadLength, cx);
                        return None;
                    }
                    _ if aop == AtomicOp::Read => (&[0u8; 0][..], None),
                    _ => (&data[..], None),
                };
                let operand: Vec<u8> = if aop == AtomicOp::Read {
                    vec![0; len]
                } else {
                    operand.to_vec()
                };
                let args = crate::atomic::AtomicArgs {
                    op: aop,
                    datatype: dt,
                    operand: &operand,
                    compare,
                };
                match mem.atomic(iov.key, iov.addr, args) {
                    Err(e) if e.kind() == ErrorKind::Again => return Some(w),
                    // A device-only region: the CPU cannot apply the atomic.
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::RemoteAccess | ErrorKind::NotSupported
                        ) =>
                    {
                        self.refuse(&w, Status::RemoteBadAddress, cx)
                    }
                    Err(_) => self.refuse(&w, Status::RemoteBadLength, cx),
                    Ok(old) => {
                        cx.counts.count(aop != AtomicOp::Read, true);
                        let pid = *pid;
                        match *kind {
                            RtaKind::Write => {}
                            RtaKind::DcWrite { send_id } => {
                                let r = Packet::Receipt {
                                    connid: Some(cx.local.qkey),
                                    send_id,
                                    msg_id: *msg_id,
                                };
                                cx.peers.queue_ctrl(pid, &r);
                            }
                            RtaKind::Fetch { recv_id } | RtaKind::Compare { recv_id } => {
                                let pkt = Packet::AtomRsp {
                                    connid: Some(cx.local.qkey),
                                    recv_id,
                                    seg_length: old.len() as u64,
                                };
                                self.respond(pid, &pkt, old, cx);
                            }
                        }
                    }
                }
            }
        }
        None
    }

    /// Queues a response packet carrying `data`.
    fn respond(&mut self, pid: u64, pkt: &Packet<'_>, data: Bytes, cx: &mut Cx) {
        let Some(hdr) = encode(pkt) else {
            return;
        };
        let id = self.next_resp;
        self.next_resp = self.next_resp.wrapping_add(1);
        let n = data.len();
        self.resp.insert(id, (data, 1));
        cx.peers
            .enqueue(Pkt::new(pid, Owner::Resp(id), hdr, 0, n), true, false);
    }

    /// Tells the initiator its operation was refused (PEER_ERROR naming its id); requests that
    /// expect no answer (plain EAGER_RTW, WRITE_RTA from other implementations) are dropped and
    /// counted.
    fn refuse(&mut self, w: &Work, status: Status, cx: &mut Cx) {
        let (pid, op_id) = match w {
            Work::Write {
                pid,
                dc_send_id: Some(id),
                ..
            } => (*pid, *id),
            Work::Read { pid, recv_id, .. } => (*pid, *recv_id),
            Work::Atomic { pid, kind, .. } if !matches!(kind, RtaKind::Write) => (*pid, kind.id()),
            Work::Place { tid, .. } | Work::Respond { tid } => {
                return self.cts_refuse(*tid, status, cx);
            }
            _ => {
                cx.counts.count(w.writes(), false);
                return cx
                    .out
                    .drop_pkt("emulated RMA refused by the memory (no answer expected)");
            }
        };
        cx.counts.count(w.writes(), false);
        refuse_op(pid, op_id, status, cx);
    }
}

/// PEER_ERROR (OPE_INDEX) naming the initiator's operation `op_id`, with the EFA status.
fn refuse_op(pid: u64, op_id: u32, status: Status, cx: &mut Cx) {
    tracing::debug!(%status, "emulated RMA refused");
    let pkt = Packet::PeerError {
        connid: Some(cx.local.qkey),
        op_id,
        ref_kind: peer_error_ref::OPE_INDEX,
        prov_errno: u32::from(status.code()),
    };
    cx.peers.queue_ctrl(pid, &pkt);
}
