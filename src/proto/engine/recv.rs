//! Application receives: posting (with multi-receive buffers), matching against posted
//! receives, cancel, peek / claim / discard, and stalled receives.

use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::cx::Cx;
use super::rx::{RxSide, RxState, Sink};
use super::util::Out;
use super::{Error, ErrorKind, Event, Peeked, RecvDone, RecvOp};
use crate::addr::RawAddr;
use crate::proto::matching::Posted;

/// A posted receive in the matcher.
#[derive(Debug)]
pub(super) enum PostedItem {
    /// An ordinary receive.
    One(RecvOp),
    /// A multi-receive buffer (in `RxSide::multi`).
    Multi(u32),
}

/// A multi-receive buffer: messages take pieces off its front.
#[derive(Debug)]
pub(super) struct MultiRecv {
    pub(super) context: u64,
    /// What is left (length 0; its capacity is the room).
    pub(super) buf: BytesMut,
    pub(super) min_free: usize,
    /// Pieces whose message is still arriving.
    pub(super) pieces: usize,
    /// No longer matched; its final completion goes out when `pieces` reaches 0.
    pub(super) retired: bool,
    /// The final completion's error (cancel, close).
    pub(super) error: Option<ErrorKind>,
}

/// What posting a receive led to ([`RxSide::post`]).
pub(super) enum Posting {
    /// Queued for a message to come (or a multi-receive buffer too small to hold any: its
    /// final completion went out).
    Done,
    /// An unexpected message matched: the engine starts receiving it into the sink.
    Matched(u32, Sink),
    /// A multi-receive buffer: the engine feeds it the unexpected messages it matches
    /// ([`RxSide::next_multi_match`]), then queues it ([`RxSide::queue_multi`]).
    Multi(MultiMatch),
}

/// A multi-receive buffer being matched against the unexpected messages.
pub(super) struct MultiMatch {
    mid: u32,
    tagged: bool,
    src: Option<RawAddr>,
    tag: u64,
    ignore: u64,
}

/// The `NoMessage` error of `op`.
pub(super) fn no_message(op: &'static str) -> Error {
    Error::new(ErrorKind::NoMessage, op)
}

impl RxSide {
    /// Takes (or carves a piece off) the posted receive at `idx` for a message of `msg_len`.
    pub(super) fn take_posted(&mut self, tagged: bool, idx: usize, msg_len: usize) -> Option<Sink> {
        let mid = match &self.matcher.posted_mut(tagged, idx)?.item {
            PostedItem::One(_) => None,
            PostedItem::Multi(mid) => Some(*mid),
        };
        match mid {
            None => match self.matcher.take_posted(tagged, idx)?.item {
                PostedItem::One(op) => Some(Sink::of(op, msg_len)),
                PostedItem::Multi(_) => None,
            },
            Some(mid) => {
                let (sink, retired) = self.carve(mid, msg_len)?;
                if retired {
                    self.matcher.take_posted(tagged, idx);
                }
                Some(sink)
            }
        }
    }

    /// A piece of multi-receive buffer `mid` for a message of `msg_len`; true when the buffer
    /// is retired by it (less than `min_free` left).
    pub(super) fn carve(&mut self, mid: u32, msg_len: usize) -> Option<(Sink, bool)> {
        let m = self.multi.get_mut(&mid)?;
        let place = msg_len.min(m.buf.capacity());
        let rest = m.buf.split_off(place);
        let piece = std::mem::replace(&mut m.buf, rest);
        m.pieces += 1;
        let retired = m.buf.capacity() < m.min_free;
        if retired {
            m.retired = true;
        }
        Some((
            Sink {
                context: Some(m.context),
                buf: piece,
                place,
                multi: Some(mid),
                ..Sink::discard()
            },
            retired,
        ))
    }

    /// A receive op's completion went out: ordinary receives stop counting; a piece of a
    /// retired multi-receive buffer may release it.
    pub(super) fn piece_done(&mut self, multi: Option<u32>, out: &mut Out) {
        match multi {
            None => self.user_ops = self.user_ops.saturating_sub(1),
            Some(mid) => {
                if let Some(m) = self.multi.get_mut(&mid) {
                    m.pieces = m.pieces.saturating_sub(1);
                    if m.retired && m.pieces == 0 {
                        let err = m.error;
                        self.retire_multi(mid, err, out);
                    }
                }
            }
        }
    }

    /// Retires multi-receive buffer `mid`: its final completion (`multi_recv_done`) hands back
    /// what is left, once the pieces in progress have completed.
    pub(super) fn retire_multi(&mut self, mid: u32, error: Option<ErrorKind>, out: &mut Out) {
        let Some(m) = self.multi.get_mut(&mid) else {
            return;
        };
        m.retired = true;
        if error.is_some() {
            m.error = error;
        }
        if m.pieces > 0 {
            return;
        }
        let Some(m) = self.multi.remove(&mid) else {
            return;
        };
        self.finish_empty(m.context, m.buf, None, true, m.error, out);
    }

    /// A posted receive's `Canceled` completion.
    pub(super) fn cancel_event(&mut self, op: RecvOp, out: &mut Out) {
        let tag = op.tag.map(|t| t.0);
        let canceled = Some(ErrorKind::Canceled);
        self.finish_empty(op.context, op.buf, tag, false, canceled, out);
    }

    /// The completion of a receive operation that carries no message (a canceled receive, a
    /// multi-receive buffer's final one), failed with `error` if any; the operation is no longer
    /// the application's.
    fn finish_empty(
        &mut self,
        context: u64,
        buf: BytesMut,
        tag: Option<u64>,
        multi_recv_done: bool,
        error: Option<ErrorKind>,
        out: &mut Out,
    ) {
        self.user_ops = self.user_ops.saturating_sub(1);
        if let Some(k) = error {
            out.stats.errors += 1;
            if k == ErrorKind::Canceled {
                out.stats.canceled += 1;
            }
        }
        out.events.push_back(Event::Recv(RecvDone {
            context,
            buf,
            len: 0,
            olen: 0,
            tag,
            data: None,
            src: None,
            multi_recv_done,
            error: error.map(|k| Error::new(k, "recv")),
            in_region: None,
        }));
    }

    /// Every posted receive and multi-receive buffer completes with `Canceled` (close).
    pub(super) fn cancel_all(&mut self, out: &mut Out) {
        for (_, p) in self.matcher.drain_posted() {
            match p.item {
                PostedItem::One(op) => self.cancel_event(op, out),
                PostedItem::Multi(mid) => self.retire_multi(mid, Some(ErrorKind::Canceled), out),
            }
        }
        let mids: Vec<u32> = self.multi.keys().copied().collect();
        for mid in mids {
            self.retire_multi(mid, Some(ErrorKind::Canceled), out);
        }
    }

    /// What follows the posting of a receive ([`RxSide::post`]) when it matched at once: the
    /// matched message starts being received into it (a multi-receive buffer takes every
    /// unexpected message that fits, then waits for more).
    pub(super) fn posted(&mut self, now: Instant, posting: Posting, cx: &mut Cx) {
        match posting {
            Posting::Done => {}
            Posting::Matched(rid, sink) => self.start_matched(now, rid, sink, None, cx),
            Posting::Multi(m) => {
                while let Some((rid, sink, retired)) = self.next_multi_match(&m) {
                    self.start_matched(now, rid, sink, None, cx);
                    if retired {
                        self.multi_retired(&m, &mut cx.out);
                        return;
                    }
                }
                self.queue_multi(m);
            }
        }
    }

    /// Receives claimed message `claim` into `op` (`Engine::recv_claimed`).
    pub(super) fn recv_claimed(
        &mut self,
        now: Instant,
        claim: u64,
        op: RecvOp,
        cx: &mut Cx,
    ) -> Result<(), (Error, RecvOp)> {
        let (rid, sink) = self.take_claimed(claim, op, cx.cfg.max_rx_ops, &mut cx.out)?;
        self.start_matched(now, rid, sink, None, cx);
        Ok(())
    }

    /// Posts a receive (at most `max_rx_ops`; more is `Again`, the receive handed back): an
    /// ordinary receive takes the oldest unexpected message it matches or is queued; a
    /// multi-receive buffer is matched by the engine ([`Posting::Multi`]).
    #[inline]
    pub(super) fn post(
        &mut self,
        mut op: RecvOp,
        max_rx_ops: usize,
        out: &mut Out,
    ) -> Result<Posting, (Error, RecvOp)> {
        if self.user_ops >= max_rx_ops {
            out.stats.again += 1;
            return Err((
                Error::new(ErrorKind::Again, "recv").with_detail("max_rx_ops receives posted"),
                op,
            ));
        }
        self.user_ops += 1;
        let tagged = op.tag.is_some();
        let (tag, ignore) = op.tag.unwrap_or((0, 0));
        let src = op.src;
        let Some(min_free) = op.multi_recv else {
            if let Some(idx) = self.matcher.find_unexpected(tagged, src, tag, ignore) {
                if let Some(u) = self.matcher.take_unexpected(tagged, idx) {
                    let msg_len = self.ops.get(&u.item).map_or(0, |e| e.msg.msg_len);
                    return Ok(Posting::Matched(u.item, Sink::of(op, msg_len)));
                }
            }
            self.matcher.post(
                tagged,
                Posted {
                    src,
                    tag,
                    ignore,
                    item: PostedItem::One(op),
                },
            );
            return Ok(Posting::Done);
        };
        let mid = self.next_multi_id;
        self.next_multi_id = self.next_multi_id.wrapping_add(1);
        op.buf.clear();
        let retired = op.buf.capacity() < min_free;
        self.multi.insert(
            mid,
            MultiRecv {
                context: op.context,
                buf: op.buf,
                min_free,
                pieces: 0,
                retired,
                error: None,
            },
        );
        if retired {
            self.retire_multi(mid, None, out);
            return Ok(Posting::Done);
        }
        Ok(Posting::Multi(MultiMatch {
            mid,
            tagged,
            src,
            tag,
            ignore,
        }))
    }

    /// The next unexpected message multi-receive buffer `m` matches, with the piece carved
    /// for it and whether that retired the buffer.
    pub(super) fn next_multi_match(&mut self, m: &MultiMatch) -> Option<(u32, Sink, bool)> {
        let idx = self
            .matcher
            .find_unexpected(m.tagged, m.src, m.tag, m.ignore)?;
        let u = self.matcher.take_unexpected(m.tagged, idx)?;
        let msg_len = self.ops.get(&u.item).map_or(0, |e| e.msg.msg_len);
        let (sink, retired) = self.carve(m.mid, msg_len)?;
        Some((u.item, sink, retired))
    }

    /// Multi-receive buffer `m` was retired while matching: its final completion goes out
    /// if no piece is in progress.
    pub(super) fn multi_retired(&mut self, m: &MultiMatch, out: &mut Out) {
        let (err, pieces) = self
            .multi
            .get(&m.mid)
            .map_or((None, 1), |b| (b.error, b.pieces));
        if pieces == 0 {
            self.retire_multi(m.mid, err, out);
        }
    }

    /// Queues multi-receive buffer `m` (with room left) for messages to come.
    pub(super) fn queue_multi(&mut self, m: MultiMatch) {
        self.matcher.post(
            m.tagged,
            Posted {
                src: m.src,
                tag: m.tag,
                ignore: m.ignore,
                item: PostedItem::Multi(m.mid),
            },
        );
    }

    /// Cancels the oldest posted receive with `context` (it completes with `Canceled`);
    /// false when there is none.
    pub(super) fn cancel(&mut self, context: u64, out: &mut Out) -> bool {
        let multi = &self.multi;
        let found = self.matcher.cancel_posted(|it| match it {
            PostedItem::One(op) => op.context == context,
            PostedItem::Multi(mid) => multi.get(mid).is_some_and(|m| m.context == context),
        });
        match found {
            Some((_, p)) => {
                match p.item {
                    PostedItem::One(op) => self.cancel_event(op, out),
                    PostedItem::Multi(mid) => {
                        self.retire_multi(mid, Some(ErrorKind::Canceled), out)
                    }
                }
                true
            }
            None => false,
        }
    }

    pub(super) fn peeked(&self, rid: u32) -> Option<Peeked> {
        let e = self.ops.get(&rid)?;
        Some(Peeked {
            len: e.msg.msg_len,
            tag: e.msg.tag,
            data: e.msg.data,
            src: e.msg.src,
            claim: None,
        })
    }

    /// The oldest unexpected tagged message a (`tag`, `ignore`, `src`) receive matches: its
    /// matcher key, its id and what peeking shows of it; `NoMessage` (of `op`) when none.
    fn tagged_unexpected(
        &self,
        op: &'static str,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
    ) -> super::Result<(usize, u32, Peeked)> {
        let none = || no_message(op);
        let idx = self
            .matcher
            .find_unexpected(true, src, tag, ignore)
            .ok_or_else(none)?;
        let rid = self
            .matcher
            .unexpected(true, idx)
            .map(|u| u.item)
            .ok_or_else(none)?;
        let p = self.peeked(rid).ok_or_else(none)?;
        Ok((idx, rid, p))
    }

    /// `FI_PEEK` (with `claim`: `FI_CLAIM`, the message reserved under the returned token).
    pub(super) fn peek(
        &mut self,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
        claim: bool,
    ) -> super::Result<Peeked> {
        let (idx, rid, mut p) = self.tagged_unexpected("peek", tag, ignore, src)?;
        if claim {
            self.matcher.take_unexpected(true, idx);
            if let Some(e) = self.ops.get_mut(&rid) {
                e.state = RxState::Claimed;
            }
            let token = self.next_claim;
            self.next_claim = self.next_claim.wrapping_add(1);
            self.claimed.insert(token, rid);
            p.claim = Some(token);
        }
        Ok(p)
    }

    /// The receive `op` takes the message claimed under `claim`: its id and the sink to start
    /// receiving it into. `NoMessage` for an unknown claim, `Again` past `max_rx_ops`.
    pub(super) fn take_claimed(
        &mut self,
        claim: u64,
        op: RecvOp,
        max_rx_ops: usize,
        out: &mut Out,
    ) -> Result<(u32, Sink), (Error, RecvOp)> {
        let Some(&rid) = self.claimed.get(&claim) else {
            return Err((no_message("recv_claimed").with_detail("unknown claim"), op));
        };
        if self.user_ops >= max_rx_ops {
            out.stats.again += 1;
            return Err((Error::new(ErrorKind::Again, "recv_claimed"), op));
        }
        self.claimed.remove(&claim);
        self.user_ops += 1;
        let msg_len = self.ops.get(&rid).map_or(0, |e| e.msg.msg_len);
        Ok((rid, Sink::of(op, msg_len)))
    }

    /// `FI_DISCARD`: takes the oldest unexpected tagged message that matches off the queue;
    /// what peeking shows of it, and its id and last arrival time for the engine to receive it
    /// into nothing (so that its sender completes normally).
    pub(super) fn discard(
        &mut self,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
    ) -> super::Result<(Peeked, Option<(u32, Instant)>)> {
        let (idx, rid, p) = self.tagged_unexpected("discard", tag, ignore, src)?;
        self.matcher.take_unexpected(true, idx);
        Ok((p, self.ops.get(&rid).map(|e| (rid, e.last))))
    }

    /// The receives that got no packet for `stall` by `now`, and when the next one is due.
    pub(super) fn stalled(&self, now: Instant, stall: Duration) -> (Vec<u32>, Option<Instant>) {
        let mut stalled = Vec::new();
        let mut next: Option<Instant> = None;
        for (rid, e) in self.ops.iter() {
            // A receive whose reads are on the device is not stalled: the device completes them.
            if !e.matched() || e.read.as_ref().is_some_and(|r| r.reading()) {
                continue;
            }
            let due = e.last.checked_add(stall).unwrap_or(e.last);
            if due <= now {
                stalled.push(rid);
            } else {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        stalled.sort_unstable();
        (stalled, next)
    }
}
