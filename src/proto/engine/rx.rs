//! The receive side: REQ packets through the reorder window, matching against posted receives
//! (or the unexpected queue), segment placement, CTS windows and CTSDATA, RECEIPT, application
//! receives (multi-receive, cancel, peek / claim / discard) and stalled receives.

use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::cx::Cx;
use super::peer::Peer;
use super::tx::grant_cts;
use super::types::{Gone, Kind, LOCAL_PEER};
use super::util::{IdMap, Out, RangeSet, SeqMap, Timer, sorted};
use super::{Error, ErrorKind, Event, RecvDone, RecvOp};
use super::{MultiRecv, PostedItem};
use crate::addr::RawAddr;
use crate::mem::RegionSlice;
use crate::proto::matching::Matcher;
use crate::proto::matching::Unexpected;
use crate::proto::reorder::Arrival;
use crate::proto::wire::Packet;

mod read;

/// Where a matched message goes.
#[derive(Debug)]
pub(super) struct Sink {
    /// The receive's context; `None` for a discarded message.
    pub(super) context: Option<u64>,
    /// Its buffer: `place` bytes long once the message is matched.
    pub(super) buf: BytesMut,
    /// Bytes of the message that fit.
    pub(super) place: usize,
    /// The multi-receive buffer this piece comes from.
    pub(super) multi: Option<u32>,
    /// The receive is a region the device registered (`RecvOp::local_region`): the read part
    /// of a long/runting-read message is read into it, not into `buf`.
    pub(super) region: Option<RegionSlice>,
    /// The bytes from this offset on were read into `region` (`RecvDone::in_region`).
    pub(super) in_region: Option<usize>,
}

impl Sink {
    /// Where a message of `msg_len` bytes goes when it matches the posted receive `op`.
    pub(super) fn of(op: RecvOp, msg_len: usize) -> Sink {
        Sink {
            context: Some(op.context),
            place: msg_len.min(op.room.unwrap_or(op.buf.capacity())),
            buf: op.buf,
            multi: None,
            region: op.local_region,
            in_region: None,
        }
    }

    /// A message received and thrown away (a discard, or what is left of a failed receive).
    pub(super) fn discard() -> Sink {
        Sink {
            context: None,
            buf: BytesMut::new(),
            place: 0,
            multi: None,
            region: None,
            in_region: None,
        }
    }
}

/// Where an inbound message is.
#[derive(Debug)]
pub(super) enum RxState {
    /// Waiting in the reorder window for the messages before it.
    Waiting,
    /// Processed without a matching receive: in the unexpected queue.
    Unexpected,
    /// Reserved by a peek with claim.
    Claimed,
    /// Being received into a buffer.
    Matched(Sink),
    /// Dropped (memory bounds, or a type not implemented): the id only advances the window.
    Dropped,
}

/// The receive side of the engine: inbound messages by `recv_id` (from their first packet to
/// completion), the matching of posted receives and unexpected messages, multi-receive buffers,
/// claimed messages, and the stall accounting.
#[derive(Debug)]
pub(super) struct RxSide {
    pub(super) ops: SeqMap<RxEntry>,
    pub(super) next_id: u32,
    pub(super) matcher: Matcher<RawAddr, PostedItem, u32>,
    pub(super) multi: IdMap<u32, MultiRecv>,
    pub(super) next_multi_id: u32,
    pub(super) claimed: IdMap<u64, u32>,
    pub(super) next_claim: u64,
    /// Application receives posted or in progress (multi-receive buffers count once).
    pub(super) user_ops: usize,
    /// Matched receives waiting for more packets (while there are, `Timer::RxStall` runs).
    pub(super) in_progress: usize,
}

impl RxSide {
    /// A matched receive left (completed or failed): when none is in progress, no stall timer.
    pub(super) fn left(&mut self, in_progress: bool, out: &mut Out) {
        if in_progress {
            self.in_progress = self.in_progress.saturating_sub(1);
            if self.in_progress == 0 {
                out.timers.stop(Timer::RxStall);
            }
        }
    }

    pub(super) fn new(cap: usize) -> RxSide {
        RxSide {
            ops: SeqMap::new(cap),
            next_id: 1,
            matcher: Matcher::default(),
            multi: IdMap::default(),
            next_multi_id: 1,
            claimed: IdMap::default(),
            next_claim: 1,
            user_ops: 0,
            in_progress: 0,
        }
    }
}

/// An inbound message, from its first packet to its completion.
#[derive(Debug)]
pub(super) struct RxEntry {
    /// Who sent it, its id and length, what its completion reports.
    pub(super) msg: Done,
    pub(super) kind: Kind,
    /// Bytes received so far, and where.
    pub(super) received: usize,
    pub(super) ranges: RangeSet,
    /// Data copied out while no buffer is matched, with its offsets.
    pub(super) held: Vec<(usize, Bytes)>,
    pub(super) held_bytes: usize,
    /// Long-CTS: the window the last CTS granted.
    pub(super) window_start: usize,
    pub(super) window_end: usize,
    /// Last packet (stall detection).
    pub(super) last: Instant,
    /// Counted in `Engine::rx_in_progress` (matched, waiting for more packets).
    pub(super) in_progress: bool,
    pub(super) state: RxState,
    /// Long-read and runting-read messages: what to read and how far it got (`read.rs`).
    pub(super) read: Option<Box<super::wr::RxRead>>,
}

impl RxEntry {
    pub(super) fn matched(&self) -> bool {
        matches!(self.state, RxState::Matched(_))
    }
}

/// What the completion of a received message reports.
#[derive(Debug)]
pub(super) struct Done {
    pub(super) peer: u64,
    pub(super) src: RawAddr,
    pub(super) msg_id: u32,
    pub(super) msg_len: usize,
    pub(super) tagged: bool,
    pub(super) tag: u64,
    pub(super) data: Option<u32>,
    pub(super) dc_send_id: Option<u32>,
}

impl Done {
    /// The message `m` of peer `pid` from `src`, `msg_len` bytes long.
    #[inline]
    fn new(pid: u64, src: RawAddr, m: &Rtm, msg_len: usize) -> Done {
        Done {
            peer: pid,
            src,
            msg_id: m.msg_id,
            msg_len,
            tagged: m.tag.is_some(),
            tag: m.tag.unwrap_or(0),
            data: m.data,
            dc_send_id: m.dc_send_id,
        }
    }
}

/// The fields of an RTM packet the receive side uses.
pub(super) struct Rtm {
    pub(super) msg_id: u32,
    pub(super) kind: Kind,
    pub(super) tag: Option<u64>,
    pub(super) data: Option<u32>,
    pub(super) dc_send_id: Option<u32>,
    /// Total length (`None` for eager: the data length).
    pub(super) msg_length: Option<u64>,
    pub(super) seg_offset: u64,
    /// The sender's buffers (long-read and runting-read messages).
    pub(super) read: Option<super::wr::ReadIovs>,
}

impl Rtm {
    pub(super) fn of(pkt: &Packet<'_>) -> Option<Rtm> {
        let data = |o: &crate::proto::wire::ReqOpt| o.cq_data.map(|d| d as u32);
        Some(match *pkt {
            Packet::EagerRtm {
                ref opt,
                msg_id,
                tag,
                dc_send_id,
            } => Rtm {
                msg_id,
                kind: Kind::Eager,
                tag,
                data: data(opt),
                dc_send_id,
                msg_length: None,
                seg_offset: 0,
                read: None,
            },
            Packet::MediumRtm {
                ref opt,
                msg_id,
                msg_length,
                seg_offset,
                tag,
                dc_send_id,
            } => Rtm {
                msg_id,
                kind: Kind::Medium,
                tag,
                data: data(opt),
                dc_send_id,
                msg_length: Some(msg_length),
                seg_offset,
                read: None,
            },
            Packet::LongCtsRtm {
                ref opt,
                msg_id,
                msg_length,
                send_id,
                tag,
                dc,
                read_nack: false,
                ..
            } => Rtm {
                msg_id,
                kind: Kind::LongCts { send_id },
                tag,
                data: data(opt),
                dc_send_id: dc.then_some(send_id),
                msg_length: Some(msg_length),
                seg_offset: 0,
                read: None,
            },
            Packet::LongReadRtm {
                ref opt,
                msg_id,
                msg_length,
                send_id,
                tag,
                ref read_iov,
            } => Rtm {
                msg_id,
                kind: Kind::LongRead { send_id },
                tag,
                data: data(opt),
                dc_send_id: None,
                msg_length: Some(msg_length),
                seg_offset: 0,
                read: Some(super::wr::ReadIovs::of(read_iov)),
            },
            Packet::RuntReadRtm {
                ref opt,
                msg_id,
                msg_length,
                send_id,
                seg_offset,
                runt_length,
                tag,
                ref read_iov,
            } => Rtm {
                msg_id,
                kind: Kind::RuntRead {
                    send_id,
                    runt: runt_length,
                },
                tag,
                data: data(opt),
                dc_send_id: None,
                msg_length: Some(msg_length),
                seg_offset,
                read: Some(super::wr::ReadIovs::of(read_iov)),
            },
            _ => return None,
        })
    }
}

/// Writes `data` at message offset `off` into a sink (the part that fits).
///
/// The buffer grows as data arrives: in-order data is appended (no zero-filling first), a gap
/// before out-of-order data is zero-filled and overwritten when its data comes. Once every byte
/// arrived the buffer is exactly `place` long.
fn place(sink: &mut Sink, off: usize, data: &[u8]) {
    if off >= sink.place {
        return;
    }
    let n = data.len().min(sink.place - off);
    let Some(data) = data.get(..n) else { return };
    let len = sink.buf.len();
    if off >= len {
        if off > len {
            sink.buf.resize(off, 0);
        }
        crate::mem::copy::extend(&mut sink.buf, data);
        return;
    }
    // Filling a gap (maybe running past the end).
    let inside = n.min(len - off);
    if let (Some(dst), Some(src)) = (sink.buf.get_mut(off..off + inside), data.get(..inside)) {
        crate::mem::copy::copy(dst, src);
    }
    if let Some(rest) = data.get(inside..) {
        crate::mem::copy::extend(&mut sink.buf, rest);
    }
}

/// What [`RxSide::next_ready`] processed: a message, or the placeholder of an emulated atomic
/// whose turn came (the emulation applies it now, `Ema::rta_turn`).
pub(super) enum Ready {
    Message,
    Atomic(u32),
}

impl RxSide {
    /// A receive-side id no inbound message uses and `taken` (the emulation's long-CTS ids)
    /// does not hold: one space for the ids peers echo in CTSDATA.
    pub(super) fn alloc_id(&mut self, taken: impl Fn(u32) -> bool) -> u32 {
        self.ops.free_id(&mut self.next_id, taken)
    }

    /// An RTM packet (eager, medium segment, long-CTS first chunk, long/runting read) from peer
    /// `pid`; `taken` as in [`RxSide::alloc_id`]. True when messages of `pid` may be next in
    /// order now: the caller drains its window ([`RxSide::next_ready`]).
    pub(super) fn handle_rtm(
        &mut self,
        now: Instant,
        pid: u64,
        pkt: &Packet<'_>,
        data: &[u8],
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> bool {
        if let Packet::LongCtsRtm {
            read_nack: true,
            msg_id,
            send_id,
            dc,
            ..
        } = *pkt
        {
            // The sender continues a NACKed read message as long-CTS (`rx/read.rs`).
            self.handle_nack_rtm(now, pid, msg_id, send_id, dc, cx);
            return false;
        }
        let Some(m) = Rtm::of(pkt) else {
            cx.out.drop_pkt("read-NACK REQ without a long-read message");
            return false;
        };
        let Some(peer) = cx.peers.get(&pid) else {
            return false;
        };
        let (exp, src) = (peer.robuf.expected(), peer.addr);
        // The expected id is never in `inbound` (messages waiting in the window are after it,
        // processed ones before it).
        debug_assert!(m.msg_id != exp || !peer.inbound.contains_key(&m.msg_id));
        let eager_turn = m.kind == Kind::Eager && m.msg_id == exp;
        let known = if eager_turn {
            None
        } else {
            peer.inbound.get(&m.msg_id).copied()
        };
        let mut unmatched = false;
        if eager_turn {
            match self.eager_in_order(pid, src, &m, data, &taken, cx) {
                Some(passed) => return passed,
                None => unmatched = true,
            }
        } else if let Some(rid) = known {
            self.continue_rtm(now, rid, &m, data, cx);
            return false;
        }
        if (m.msg_id.wrapping_sub(exp) as i32) < 0 {
            cx.out.drop_pkt("REQ with an already processed msg_id");
            return false;
        }
        let n = data.len();
        let msg_len = match (m.kind, m.msg_length.map(usize::try_from)) {
            (Kind::Eager, _) => n,
            (_, Some(Ok(l))) => l,
            _ => {
                cx.out
                    .drop_pkt("REQ with a message length beyond this host");
                return false;
            }
        };
        let off = usize::try_from(m.seg_offset).unwrap_or(usize::MAX);
        let valid = match m.kind {
            Kind::Eager => true,
            Kind::Medium => n > 0 && off.checked_add(n).is_some_and(|e| e <= msg_len),
            Kind::LongCts { .. } => n <= msg_len,
            Kind::LongRead { .. } => n == 0,
            Kind::RuntRead { runt, .. } => {
                n > 0
                    && runt <= msg_len as u64
                    && off.checked_add(n).is_some_and(|e| e as u64 <= runt)
            }
        };
        if !valid {
            cx.out
                .drop_pkt("REQ segment inconsistent with its message length");
            return false;
        }
        let ready = m.msg_id == exp;
        // Past `max_buffered_msgs` the message is held all the same: the device acknowledged
        // it, so dropping it would lose it (and leave the peer's window waiting). The bound is
        // kept by the caller, which posts no more device receive buffers than the budget left
        // (receiver-not-ready pushes the senders back), so an excess is at most the buffers
        // already posted (issue 17, defect 2).
        if !ready && !cx.budget.room_for_msg() {
            tracing::debug!("over max_buffered_msgs: held (the device is held back)");
        }
        let rid = self.new_rx(now, pid, src, &m, msg_len, RxState::Waiting, taken, cx);
        if let Some(e) = self.ops.get_mut(&rid) {
            e.received = n;
            if n > 0 {
                e.ranges.insert(off as u64, (off + n) as u64);
            }
        }
        if let Some(p) = cx.peers.get_mut(&pid) {
            if p.robuf.insert(m.msg_id, rid) != Arrival::Stored {
                // Cannot happen (checked above); keep the state consistent anyway.
                p.inbound.remove(&m.msg_id);
                self.remove_unmatched(rid, cx);
                cx.out.drop_pkt("duplicate msg_id");
                return false;
            }
        }
        if ready {
            if let Some(p) = cx.peers.get_mut(&pid) {
                p.robuf.pop_ready();
            }
            self.process(now, rid, Some((off, data)), unmatched, cx);
        } else {
            cx.out.stats.reorder_buffered += 1;
            self.hold(rid, off, data, cx);
        }
        true
    }

    /// Reserves `msg_id` of peer `pid` in its reorder window with a placeholder entry (state
    /// `Dropped`: a REQ this engine does not implement, or an emulated atomic waiting for its
    /// turn) and returns the entry's id; the caller drains the window. `None` for an id
    /// already seen or processed.
    pub(super) fn window_slot(
        &mut self,
        now: Instant,
        pid: u64,
        msg_id: u32,
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> Option<u32> {
        let p = cx.peers.get(&pid)?;
        if p.inbound.contains_key(&msg_id) || (msg_id.wrapping_sub(p.robuf.expected()) as i32) < 0 {
            return None;
        }
        let m = Rtm {
            msg_id,
            kind: Kind::Eager,
            tag: None,
            data: None,
            dc_send_id: None,
            msg_length: None,
            seg_offset: 0,
            read: None,
        };
        let src = p.addr;
        let rid = self.new_rx(now, pid, src, &m, 0, RxState::Dropped, taken, cx);
        if let Some(p) = cx.peers.get_mut(&pid) {
            p.robuf.insert(msg_id, rid);
        }
        Some(rid)
    }

    /// A new inbound message entry of peer `pid` (the local path's `LOCAL_PEER` too) from `src`,
    /// counted as held; `taken` as in [`RxSide::alloc_id`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new_rx(
        &mut self,
        now: Instant,
        pid: u64,
        src: RawAddr,
        m: &Rtm,
        msg_len: usize,
        state: RxState,
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> u32 {
        let rid = self.alloc_id(taken);
        self.ops.insert(
            rid,
            RxEntry {
                msg: Done::new(pid, src, m, msg_len),
                kind: m.kind,
                received: 0,
                ranges: RangeSet::default(),
                held: Vec::new(),
                held_bytes: 0,
                window_start: 0,
                window_end: 0,
                last: now,
                in_progress: false,
                state,
                read: m.read.and_then(|iovs| super::wr::RxRead::new(m.kind, iovs)),
            },
        );
        if let Some(p) = cx.peers.get_mut(&pid) {
            p.inbound.insert(m.msg_id, rid);
        }
        cx.budget.add_msg();
        cx.budget.peer_held(&mut cx.peers, pid, 1, 0, true);
        rid
    }

    /// Copies data of an unmatched message out of the device buffer. Past
    /// `max_buffered_bytes` it is held all the same (the device acknowledged it: nothing
    /// acknowledged is dropped); the caller keeps the bound by posting no more device receive
    /// buffers than the budget left.
    pub(super) fn hold(&mut self, rid: u32, off: usize, data: &[u8], cx: &mut Cx) {
        if data.is_empty() {
            return;
        }
        let fits = cx.budget.fits(data.len());
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        if !fits {
            tracing::debug!("over max_buffered_bytes: held (the device is held back)");
        }
        let n = data.len();
        e.held.push((off, Bytes::copy_from_slice(data)));
        e.held_bytes += n;
        cx.budget
            .add_bytes(n, matches!(e.state, RxState::Unexpected | RxState::Claimed));
        let pid = e.msg.peer;
        cx.budget.peer_held(&mut cx.peers, pid, 0, n, true);
    }

    /// A further packet of a message whose first packet arrived (medium segments).
    fn continue_rtm(&mut self, now: Instant, rid: u32, m: &Rtm, data: &[u8], cx: &mut Cx) {
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let same_kind = match (m.kind, e.kind) {
            (Kind::Medium, Kind::Medium) => true,
            (Kind::RuntRead { .. }, Kind::RuntRead { .. }) => m.kind == e.kind,
            _ => false,
        };
        let consistent = same_kind
            && m.msg_length.and_then(|l| usize::try_from(l).ok()) == Some(e.msg.msg_len)
            && m.tag.unwrap_or(0) == e.msg.tag
            && m.tag.is_some() == e.msg.tagged;
        if !consistent {
            return cx
                .out
                .drop_pkt("duplicate or inconsistent REQ for a known msg_id");
        }
        let n = data.len();
        let off = usize::try_from(m.seg_offset).unwrap_or(usize::MAX);
        let limit = match e.kind {
            Kind::RuntRead { runt, .. } => usize::try_from(runt).unwrap_or(usize::MAX),
            _ => e.msg.msg_len,
        };
        let Some(end) = off.checked_add(n).filter(|&end| n > 0 && end <= limit) else {
            return cx.out.drop_pkt("medium segment beyond its message");
        };
        if !e.ranges.insert(off as u64, end as u64) {
            return cx.out.drop_pkt("duplicate medium segment");
        }
        e.received += n;
        e.last = now;
        let complete = e.received == e.msg.msg_len;
        let reading = e.read.is_some();
        match &mut e.state {
            RxState::Matched(sink) => {
                place(sink, off, data);
                if complete {
                    self.complete_rx(rid, cx);
                } else if reading {
                    // A runt segment: a READ_NACK may wait for the whole runt.
                    self.maybe_nack(rid, cx);
                }
            }
            RxState::Dropped => cx.out.stats.dropped_pkts += 1,
            RxState::Waiting | RxState::Unexpected | RxState::Claimed => {
                self.hold(rid, off, data, cx)
            }
        }
    }

    /// Processes the next message of `pid` in order, if its turn has come: matched or made
    /// unexpected; a placeholder is forgotten, and when it holds an emulated atomic's place
    /// the caller hands that its turn ([`Ready::Atomic`]). `None` when none is ready.
    pub(super) fn next_ready(&mut self, now: Instant, pid: u64, cx: &mut Cx) -> Option<Ready> {
        let (_, rid) = cx.peers.get_mut(&pid)?.robuf.pop_ready()?;
        if self
            .ops
            .get(&rid)
            .is_some_and(|e| matches!(e.state, RxState::Dropped))
        {
            // Its later packets are stale now; nothing more to keep.
            self.remove_unmatched(rid, cx);
            return Some(Ready::Atomic(rid));
        }
        self.process(now, rid, None, false, cx);
        Some(Ready::Message)
    }

    /// The fast path of the usual case: an eager message whose turn it is (`msg_id` is the
    /// expected one) and that a posted receive matches is placed and completed at once, without
    /// an `RxEntry` (what [`RxSide::handle_rtm`] then [`RxSide::process`] would do with one).
    /// `None`, changing nothing, when no posted receive takes it; else whether later messages
    /// were waiting for this one (the caller drains the window).
    fn eager_in_order(
        &mut self,
        pid: u64,
        src: RawAddr,
        m: &Rtm,
        data: &[u8],
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> Option<bool> {
        let tagged = m.tag.is_some();
        let tag = m.tag.unwrap_or(0);
        let idx = self.matcher.find_posted(tagged, src, tag)?;
        let mut sink = self.take_posted(tagged, idx, data.len())?;
        // The id the entry would have had, so that later ids are the same.
        self.alloc_id(taken);
        let passed = cx.peers.get_mut(&pid).is_some_and(|p| {
            let ok = p.robuf.pass(m.msg_id);
            debug_assert!(ok, "the expected msg_id passes");
            p.robuf.held() > 0
        });
        sink.buf.clear();
        place(&mut sink, 0, data);
        self.finish_rx(sink, &Done::new(pid, src, m, data.len()), cx);
        Some(passed)
    }

    /// A message's turn has come (all earlier ones from its peer were processed): match it
    /// against the posted receives or make it unexpected. `fresh` is data of the packet being
    /// handled that was not copied out.
    ///
    /// `unmatched`: the caller found already that no posted receive matches.
    fn process(
        &mut self,
        now: Instant,
        rid: u32,
        fresh: Option<(usize, &[u8])>,
        unmatched: bool,
        cx: &mut Cx,
    ) {
        let Some(e) = self.ops.get(&rid) else {
            return;
        };
        let (tagged, src, tag, msg_len) = (e.msg.tagged, e.msg.src, e.msg.tag, e.msg.msg_len);
        let posted = if unmatched {
            None
        } else {
            self.matcher.find_posted(tagged, src, tag)
        };
        if let Some(idx) = posted {
            if let Some(sink) = self.take_posted(tagged, idx, msg_len) {
                return self.start_matched(now, rid, sink, fresh, cx);
            }
        }
        // Unexpected.
        cx.out.stats.unexpected_msgs += 1;
        if cx.budget.over_msgs() {
            tracing::debug!(
                "over max_buffered_msgs: unexpected message held (the device is held back)"
            );
        }
        if !self.queue_unexpected(rid, cx) {
            return;
        }
        if let Some((off, data)) = fresh {
            self.hold(rid, off, data, cx);
        }
    }

    /// Puts message `rid` on the unexpected queue (no receive matched it); false when there is
    /// no such message.
    pub(super) fn queue_unexpected(&mut self, rid: u32, cx: &mut Cx) -> bool {
        let Some(e) = self.ops.get_mut(&rid) else {
            return false;
        };
        e.state = RxState::Unexpected;
        let (tagged, src, tag) = (e.msg.tagged, e.msg.src, e.msg.tag);
        cx.budget.became_unexpected(e.held_bytes);
        self.matcher.push_unexpected(
            tagged,
            Unexpected {
                src,
                tag,
                item: rid,
            },
        );
        true
    }

    /// The message found its buffer: held data is placed, long-CTS asks for the rest, a
    /// long/runting read starts reading.
    pub(super) fn start_matched(
        &mut self,
        now: Instant,
        rid: u32,
        mut sink: Sink,
        fresh: Option<(usize, &[u8])>,
        cx: &mut Cx,
    ) {
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let unexp = match e.state {
            RxState::Unexpected | RxState::Claimed => true,
            RxState::Waiting => false,
            RxState::Matched(_) | RxState::Dropped => return,
        };
        cx.budget.release(e.held_bytes, unexp);
        let (pid, released) = (e.msg.peer, e.held_bytes);
        sink.buf.clear();
        for (off, bytes) in std::mem::take(&mut e.held) {
            place(&mut sink, off, &bytes);
        }
        if let Some((off, data)) = fresh {
            place(&mut sink, off, data);
        }
        e.held_bytes = 0;
        e.last = now;
        e.state = RxState::Matched(sink);
        let (whole, long_cts) = (
            e.received == e.msg.msg_len,
            matches!(e.kind, Kind::LongCts { .. }),
        );
        cx.budget.peer_held(&mut cx.peers, pid, 1, released, false);
        if whole {
            return self.complete_rx(rid, cx);
        }
        if long_cts {
            self.send_cts(rid, cx);
        }
        if let Some(e) = self.ops.get_mut(&rid) {
            e.in_progress = true;
        }
        self.in_progress += 1;
        {
            let at = now.checked_add(cx.cfg.rx_stall_timeout);
            cx.out.timers.arm_if_stopped(Timer::RxStall, at);
        }
        if self.ops.get(&rid).is_some_and(|e| e.read.is_some()) {
            self.start_read(now, rid, cx);
        }
    }

    /// Grants the sender of long-CTS message `rid` its next window.
    pub(super) fn send_cts(&mut self, rid: u32, cx: &mut Cx) {
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let Kind::LongCts { send_id } = e.kind else {
            return;
        };
        let window = grant_cts(
            cx,
            e.msg.peer,
            send_id,
            rid,
            e.msg.msg_len - e.received,
            false,
        );
        e.window_start = e.received;
        e.window_end = e.received + window;
    }

    /// A CTSDATA packet: data of a long-CTS message within the window granted.
    pub(super) fn handle_ctsdata(
        &mut self,
        now: Instant,
        pid: u64,
        recv_id: u32,
        seg_offset: u64,
        data: &[u8],
        cx: &mut Cx,
    ) {
        let Some(e) = self.ops.get_mut(&recv_id) else {
            return cx.out.drop_pkt("CTSDATA for an unknown recv_id");
        };
        if e.msg.peer != pid || !matches!(e.kind, Kind::LongCts { .. }) || !e.matched() {
            return cx
                .out
                .drop_pkt("CTSDATA for a message that is not receiving from this peer");
        }
        let n = data.len();
        let off = usize::try_from(seg_offset).unwrap_or(usize::MAX);
        let ok = n > 0
            && off >= e.window_start
            && off.checked_add(n).is_some_and(|end| end <= e.window_end);
        if !ok {
            return cx.out.drop_pkt("CTSDATA outside the window");
        }
        if !e.ranges.insert(off as u64, (off + n) as u64) {
            return cx.out.drop_pkt("duplicate CTSDATA");
        }
        e.received += n;
        e.last = now;
        if let RxState::Matched(sink) = &mut e.state {
            place(sink, off, data);
        }
        let (received, msg_len, window_end) = (e.received, e.msg.msg_len, e.window_end);
        if received == msg_len {
            self.complete_rx(recv_id, cx);
        } else if received == window_end {
            self.send_cts(recv_id, cx);
        }
    }

    /// Removes an entry that has no buffer (waiting, unexpected, claimed, dropped) without a
    /// completion, releasing what it held.
    pub(super) fn remove_unmatched(&mut self, rid: u32, cx: &mut Cx) {
        let Some(e) = self.ops.remove(&rid) else {
            return;
        };
        if let Some(p) = cx.peers.get_mut(&e.msg.peer) {
            if p.inbound.get(&e.msg.msg_id) == Some(&rid) {
                p.inbound.remove(&e.msg.msg_id);
            }
        }
        cx.budget.release(
            e.held_bytes,
            matches!(e.state, RxState::Unexpected | RxState::Claimed),
        );
        cx.budget
            .peer_held(&mut cx.peers, e.msg.peer, 1, e.held_bytes, false);
    }

    /// Removes a matched entry (from the peer's map and the stall accounting too).
    fn take_entry(&mut self, rid: u32, cx: &mut Cx) -> Option<RxEntry> {
        let mut e = self.ops.remove(&rid)?;
        if e.read.is_some() {
            read::entry_removed(rid, &mut e, &mut cx.wrs);
        }
        if let Some(p) = cx.peers.get_mut(&e.msg.peer) {
            if p.inbound.get(&e.msg.msg_id) == Some(&rid) {
                p.inbound.remove(&e.msg.msg_id);
            }
        }
        self.left(e.in_progress, &mut cx.out);
        Some(e)
    }

    /// The whole message is in place: RECEIPT for delivery complete, and the completion.
    pub(super) fn complete_rx(&mut self, rid: u32, cx: &mut Cx) {
        let Some(e) = self.take_entry(rid, cx) else {
            return;
        };
        let RxState::Matched(sink) = e.state else {
            return;
        };
        self.finish_rx(sink, &e.msg, cx);
    }

    /// A message is in its buffer: RECEIPT for delivery complete, and the completion.
    #[inline]
    pub(super) fn finish_rx(&mut self, sink: Sink, msg: &Done, cx: &mut Cx) {
        if let Some(send_id) = msg.dc_send_id {
            if msg.peer == LOCAL_PEER {
                cx.receipts.push_back((msg.src, send_id));
            } else {
                let r = Packet::Receipt {
                    connid: Some(cx.local.qkey),
                    send_id,
                    msg_id: msg.msg_id,
                };
                cx.peers.queue_ctrl(msg.peer, &r);
            }
        }
        let Some(context) = sink.context else { return };
        let olen = msg.msg_len - sink.place;
        let out = &mut cx.out;
        let error = if olen > 0 {
            out.stats.errors += 1;
            out.stats.truncated += 1;
            Some(
                Error::new(ErrorKind::Truncated, "recv").with_detail(format!(
                    "message of {} bytes, buffer of {}",
                    msg.msg_len, sink.place
                )),
            )
        } else {
            out.stats.rx_msgs += 1;
            out.stats.rx_bytes += sink.place as u64;
            None
        };
        out.events.push_back(Event::Recv(RecvDone {
            context,
            buf: sink.buf,
            len: sink.place,
            olen,
            tag: msg.tagged.then_some(msg.tag),
            data: msg.data,
            src: Some(msg.src),
            multi_recv_done: false,
            error,
            in_region: sink.in_region,
        }));
        self.piece_done(sink.multi, out);
    }

    /// A receive ends without its message (peer failure, stall, close): an error completion
    /// for a matched receive, nothing for a message without one.
    pub(super) fn abort_rx(&mut self, rid: u32, kind: ErrorKind, why: &'static str, cx: &mut Cx) {
        let Some(e) = self.ops.get(&rid) else {
            return;
        };
        if !e.matched() {
            if matches!(e.state, RxState::Claimed) {
                self.claimed.retain(|_, r| *r != rid);
            }
            return self.remove_unmatched(rid, cx);
        }
        let Some(e) = self.take_entry(rid, cx) else {
            return;
        };
        let RxState::Matched(sink) = e.state else {
            return;
        };
        let msg = (e.msg.tagged.then_some(e.msg.tag), e.msg.data, e.msg.src);
        self.fail_sink(sink, msg, kind, why, &mut cx.out);
    }

    /// The peer `p` is gone: its unexpected messages are dropped, the receives in progress from
    /// it fail.
    pub(super) fn peer_gone(&mut self, p: &Peer, g: Gone, cx: &mut Cx) {
        let addr = p.addr;
        self.matcher.remove_unexpected_where(|u| u.src == addr);
        for rid in sorted(p.inbound.values().copied()) {
            self.abort_rx(rid, g.kind, g.why, cx);
        }
    }

    /// `close()`: every receive completes with `Canceled` (pieces of multi-receive buffers
    /// before the buffers themselves), nothing is kept.
    pub(super) fn close(&mut self, cx: &mut Cx) {
        self.matcher.remove_unexpected_where(|_| true);
        for id in self.ops.sorted_keys() {
            self.abort_rx(id, ErrorKind::Canceled, "close", cx);
        }
        self.cancel_all(&mut cx.out);
        self.claimed.clear();
        self.user_ops = 0;
        cx.out.timers.stop(Timer::RxStall);
        self.in_progress = 0;
    }

    /// The error completion of a receive whose message will not (all) arrive.
    fn fail_sink(
        &mut self,
        mut sink: Sink,
        msg: (Option<u64>, Option<u32>, RawAddr),
        kind: ErrorKind,
        why: &'static str,
        out: &mut Out,
    ) {
        let Some(context) = sink.context else { return };
        out.stats.errors += 1;
        if kind == ErrorKind::Canceled {
            out.stats.canceled += 1;
        }
        sink.buf.clear();
        out.events.push_back(Event::Recv(RecvDone {
            context,
            buf: sink.buf,
            len: 0,
            olen: 0,
            tag: msg.0,
            data: msg.1,
            src: Some(msg.2),
            multi_recv_done: false,
            error: Some(Error::new(kind, "recv").with_detail(why)),
            in_region: None,
        }));
        self.piece_done(sink.multi, out);
    }

    /// `Timer::RxStall` expired: receives that got no packet for `rx_stall_timeout` fail
    /// ([`RxSide::stall_rx`]); the timer is set again for the next one.
    pub(super) fn stall_timeout(&mut self, now: Instant, cx: &mut Cx) {
        let stall = cx.cfg.rx_stall_timeout;
        let (stalled, mut next) = self.stalled(now, stall);
        for rid in stalled {
            self.stall_rx(rid, now, cx);
            if self.ops.contains_key(&rid) {
                let due = now.checked_add(stall).unwrap_or(now);
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        let next = if self.in_progress > 0 { next } else { None };
        cx.out.timers.set(Timer::RxStall, next);
    }

    /// A matched receive got no packet for `rx_stall_timeout`: its application receive fails,
    /// but the message goes on being received and thrown away, so that a sender that is only
    /// slow (long RNR backoffs) still completes (no RECEIPT is sent for it, though). A message
    /// that is already being thrown away and stalls again is forgotten.
    fn stall_rx(&mut self, rid: u32, now: Instant, cx: &mut Cx) {
        let Some(e) = self.ops.get_mut(&rid) else {
            return;
        };
        let RxState::Matched(sink) = &mut e.state else {
            return;
        };
        if sink.context.is_none() {
            self.take_entry(rid, cx);
            return;
        }
        let user = std::mem::replace(sink, Sink::discard());
        e.last = now;
        e.msg.dc_send_id = None;
        let msg = (e.msg.tagged.then_some(e.msg.tag), e.msg.data, e.msg.src);
        self.fail_sink(
            user,
            msg,
            ErrorKind::ConnectionAborted,
            "no packet from the sender for rx_stall_timeout",
            &mut cx.out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{Sink, place};
    use crate::fault::{Rng, test_seed};
    use bytes::BytesMut;

    #[test]
    fn place_in_any_order_with_truncation() {
        let seed = test_seed();
        let mut rng = Rng::new(seed);
        for _ in 0..50 {
            let len = 1 + rng.below(5000) as usize;
            let place_len = rng.below(len as u64 + 1) as usize;
            let msg: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            let seg = 1 + rng.below(700) as usize;
            let mut segs: Vec<usize> = (0..len).step_by(seg).collect();
            for i in (1..segs.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                segs.swap(i, j);
            }
            let mut sink = Sink {
                buf: BytesMut::with_capacity(place_len),
                place: place_len,
                ..Sink::discard()
            };
            for off in segs {
                place(&mut sink, off, &msg[off..(off + seg).min(len)]);
            }
            assert_eq!(sink.buf.len(), place_len, "seed {seed}");
            assert!(sink.buf[..] == msg[..place_len], "seed {seed}");
        }
    }
}
