//! Application receives: posting (with multi-receive buffers), matching against posted
//! receives, cancel, peek / claim / discard, and stalled receives.

use crate::proto::engine::util::Timer;
use std::time::Instant;

use bytes::BytesMut;

use super::rx::{RxState, Sink};
use super::{Engine, Error, ErrorKind, Event, Peeked, RecvDone, RecvOp};
use crate::addr::RawAddr;
use crate::proto::matching::Posted;

/// A posted receive in the matcher.
#[derive(Debug)]
pub(super) enum PostedItem {
    /// An ordinary receive.
    One(RecvOp),
    /// A multi-receive buffer (in `Engine::multi`).
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

impl Engine {
    /// Takes (or carves a piece off) the posted receive at `idx` for a message of `msg_len`.
    pub(super) fn take_posted(&mut self, tagged: bool, idx: usize, msg_len: usize) -> Option<Sink> {
        let mid = match &self.rx.matcher.posted_mut(tagged, idx)?.item {
            PostedItem::One(_) => None,
            PostedItem::Multi(mid) => Some(*mid),
        };
        match mid {
            None => match self.rx.matcher.take_posted(tagged, idx)?.item {
                PostedItem::One(op) => Some(Sink::of(op, msg_len)),
                PostedItem::Multi(_) => None,
            },
            Some(mid) => {
                let (sink, retired) = self.carve(mid, msg_len)?;
                if retired {
                    self.rx.matcher.take_posted(tagged, idx);
                }
                Some(sink)
            }
        }
    }

    /// A piece of multi-receive buffer `mid` for a message of `msg_len`; true when the buffer
    /// is retired by it (less than `min_free` left).
    pub(super) fn carve(&mut self, mid: u32, msg_len: usize) -> Option<(Sink, bool)> {
        let m = self.rx.multi.get_mut(&mid)?;
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
    pub(super) fn piece_done(&mut self, multi: Option<u32>) {
        match multi {
            None => self.rx.user_ops = self.rx.user_ops.saturating_sub(1),
            Some(mid) => {
                if let Some(m) = self.rx.multi.get_mut(&mid) {
                    m.pieces = m.pieces.saturating_sub(1);
                    if m.retired && m.pieces == 0 {
                        let err = m.error;
                        self.retire_multi(mid, err);
                    }
                }
            }
        }
    }

    /// Retires multi-receive buffer `mid`: its final completion (`multi_recv_done`) hands back
    /// what is left, once the pieces in progress have completed.
    pub(super) fn retire_multi(&mut self, mid: u32, error: Option<ErrorKind>) {
        let Some(m) = self.rx.multi.get_mut(&mid) else {
            return;
        };
        m.retired = true;
        if error.is_some() {
            m.error = error;
        }
        if m.pieces > 0 {
            return;
        }
        let Some(m) = self.rx.multi.remove(&mid) else {
            return;
        };
        self.rx.user_ops = self.rx.user_ops.saturating_sub(1);
        if let Some(k) = m.error {
            self.out.stats.errors += 1;
            if k == ErrorKind::Canceled {
                self.out.stats.canceled += 1;
            }
        }
        self.out.events.push_back(Event::Recv(RecvDone {
            context: m.context,
            buf: m.buf,
            len: 0,
            olen: 0,
            tag: None,
            data: None,
            src: None,
            multi_recv_done: true,
            error: m.error.map(|k| Error::new(k, "recv")),
            in_region: None,
        }));
    }

    /// A posted receive's `Canceled` completion.
    pub(super) fn cancel_event(&mut self, op: RecvOp) {
        self.rx.user_ops = self.rx.user_ops.saturating_sub(1);
        self.out.stats.errors += 1;
        self.out.stats.canceled += 1;
        self.out.events.push_back(Event::Recv(RecvDone {
            context: op.context,
            buf: op.buf,
            len: 0,
            olen: 0,
            tag: op.tag.map(|t| t.0),
            data: None,
            src: None,
            multi_recv_done: false,
            error: Some(Error::new(ErrorKind::Canceled, "recv")),
            in_region: None,
        }));
    }

    #[allow(
        clippy::result_large_err,
        reason = "the refused receive is handed back by value"
    )]
    pub(super) fn post_recv_impl(
        &mut self,
        now: Instant,
        mut op: RecvOp,
    ) -> Result<(), (Error, RecvOp)> {
        if self.closed {
            return Err((Engine::closed_error("recv"), op));
        }
        if self.rx.user_ops >= self.cfg.max_rx_ops {
            self.out.stats.again += 1;
            return Err((
                Error::new(ErrorKind::Again, "recv").with_detail("max_rx_ops receives posted"),
                op,
            ));
        }
        self.rx.user_ops += 1;
        let tagged = op.tag.is_some();
        let (tag, ignore) = op.tag.unwrap_or((0, 0));
        let src = op.src;
        let Some(min_free) = op.multi_recv else {
            if let Some(idx) = self.rx.matcher.find_unexpected(tagged, src, tag, ignore) {
                if let Some(u) = self.rx.matcher.take_unexpected(tagged, idx) {
                    let msg_len = self.rx.ops.get(&u.item).map_or(0, |e| e.msg_len);
                    self.start_matched(now, u.item, Sink::of(op, msg_len), None);
                    return Ok(());
                }
            }
            self.rx.matcher.post(
                tagged,
                Posted {
                    src,
                    tag,
                    ignore,
                    item: PostedItem::One(op),
                },
            );
            return Ok(());
        };
        let mid = self.rx.next_multi_id;
        self.rx.next_multi_id = self.rx.next_multi_id.wrapping_add(1);
        op.buf.clear();
        let retired = op.buf.capacity() < min_free;
        self.rx.multi.insert(
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
            self.retire_multi(mid, None);
            return Ok(());
        }
        while let Some(idx) = self.rx.matcher.find_unexpected(tagged, src, tag, ignore) {
            let Some(u) = self.rx.matcher.take_unexpected(tagged, idx) else {
                break;
            };
            let msg_len = self.rx.ops.get(&u.item).map_or(0, |e| e.msg_len);
            let Some((sink, retired)) = self.carve(mid, msg_len) else {
                break;
            };
            self.start_matched(now, u.item, sink, None);
            if retired {
                let (err, pieces) = self
                    .rx
                    .multi
                    .get(&mid)
                    .map_or((None, 1), |m| (m.error, m.pieces));
                if pieces == 0 {
                    self.retire_multi(mid, err);
                }
                return Ok(());
            }
        }
        self.rx.matcher.post(
            tagged,
            Posted {
                src,
                tag,
                ignore,
                item: PostedItem::Multi(mid),
            },
        );
        Ok(())
    }

    pub(super) fn cancel_impl(&mut self, context: u64) -> bool {
        if self.closed {
            return false;
        }
        let multi = &self.rx.multi;
        let found = self.rx.matcher.cancel_posted(|it| match it {
            PostedItem::One(op) => op.context == context,
            PostedItem::Multi(mid) => multi.get(mid).is_some_and(|m| m.context == context),
        });
        match found {
            Some((_, p)) => {
                match p.item {
                    PostedItem::One(op) => self.cancel_event(op),
                    PostedItem::Multi(mid) => self.retire_multi(mid, Some(ErrorKind::Canceled)),
                }
                true
            }
            None => false,
        }
    }

    pub(super) fn peeked(&self, rid: u32) -> Option<Peeked> {
        let e = self.rx.ops.get(&rid)?;
        Some(Peeked {
            len: e.msg_len,
            tag: e.tag,
            data: e.data,
            src: e.src,
            claim: None,
        })
    }

    pub(super) fn no_message(op: &'static str) -> Error {
        Error::new(ErrorKind::NoMessage, op)
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
        if self.closed {
            return Err(Engine::closed_error(op));
        }
        let none = || Engine::no_message(op);
        let idx = self
            .rx
            .matcher
            .find_unexpected(true, src, tag, ignore)
            .ok_or_else(none)?;
        let rid = self
            .rx
            .matcher
            .unexpected(true, idx)
            .map(|u| u.item)
            .ok_or_else(none)?;
        let p = self.peeked(rid).ok_or_else(none)?;
        Ok((idx, rid, p))
    }

    pub(super) fn peek_impl(
        &mut self,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
        claim: bool,
    ) -> super::Result<Peeked> {
        let (idx, rid, mut p) = self.tagged_unexpected("peek", tag, ignore, src)?;
        if claim {
            self.rx.matcher.take_unexpected(true, idx);
            if let Some(e) = self.rx.ops.get_mut(&rid) {
                e.state = RxState::Claimed;
            }
            let token = self.rx.next_claim;
            self.rx.next_claim = self.rx.next_claim.wrapping_add(1);
            self.rx.claimed.insert(token, rid);
            p.claim = Some(token);
        }
        Ok(p)
    }

    #[allow(
        clippy::result_large_err,
        reason = "the refused receive is handed back by value"
    )]
    pub(super) fn recv_claimed_impl(
        &mut self,
        now: Instant,
        claim: u64,
        op: RecvOp,
    ) -> Result<(), (Error, RecvOp)> {
        if self.closed {
            return Err((Engine::closed_error("recv_claimed"), op));
        }
        let Some(&rid) = self.rx.claimed.get(&claim) else {
            return Err((
                Engine::no_message("recv_claimed").with_detail("unknown claim"),
                op,
            ));
        };
        if self.rx.user_ops >= self.cfg.max_rx_ops {
            self.out.stats.again += 1;
            return Err((Error::new(ErrorKind::Again, "recv_claimed"), op));
        }
        self.rx.claimed.remove(&claim);
        self.rx.user_ops += 1;
        let msg_len = self.rx.ops.get(&rid).map_or(0, |e| e.msg_len);
        self.start_matched(now, rid, Sink::of(op, msg_len), None);
        Ok(())
    }

    pub(super) fn discard_impl(
        &mut self,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
    ) -> super::Result<Peeked> {
        let (idx, rid, p) = self.tagged_unexpected("discard", tag, ignore, src)?;
        self.rx.matcher.take_unexpected(true, idx);
        let now = self.rx.ops.get(&rid).map(|e| e.last);
        if let Some(now) = now {
            // Received and thrown away, so that the sender completes normally.
            self.start_matched(now, rid, Sink::discard(), None);
        }
        Ok(p)
    }

    /// Fails the receives that got no packet for `rx_stall_timeout`.
    pub(super) fn check_stalls(&mut self, now: Instant) {
        let stall = self.cfg.rx_stall_timeout;
        let mut stalled = Vec::new();
        let mut next: Option<Instant> = None;
        for (rid, e) in self.rx.ops.iter() {
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
        for rid in stalled {
            self.stall_rx(rid, now);
            if self.rx.ops.contains_key(&rid) {
                let due = now.checked_add(stall).unwrap_or(now);
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        let next = if self.rx.in_progress > 0 { next } else { None };
        self.out.timers.set(Timer::RxStall, next);
    }
}
