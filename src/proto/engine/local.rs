//! Messages from peers on this host that bypass the packet protocol (the same-host path,
//! `crate::local`, reaches the engine only through [`SameHost`]): they arrive whole and in order through a shared-memory ring, in chunks,
//! and meet the same matching as packet-borne messages: the same posted receives (untagged,
//! tagged, directed, multi-receive), the same unexpected queue (peek, claim, discard), the same
//! completions and memory bounds. Only the transport differs, so a receive posted once is
//! matched by whichever path brings the next message.
//!
//! The data is never handed over as a slice: it sits in memory other processes write, so the
//! caller passes a `copy` function that appends `n` bytes of the current chunk to a buffer.

use std::time::Instant;

use bytes::BytesMut;

use super::rx::{Rtm, RxState, Sink};
use super::types::{Kind, LOCAL_PEER};
use super::{Done, Engine};
use crate::addr::RawAddr;

/// Appends `n` bytes of the chunk being delivered to the buffer (which has the room).
pub type CopyFn<'a> = &'a mut dyn FnMut(&mut BytesMut, usize);

/// The first chunk's description of a local message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalMsg {
    /// Tag of a tagged message.
    pub tag: Option<u64>,
    /// Remote CQ data.
    pub data: Option<u32>,
    /// Delivery complete: the token to acknowledge once the message is in its buffer
    /// (see [`SameHost::take_receipt`]).
    pub dc_token: Option<u32>,
    /// Length of the whole message.
    pub msg_len: usize,
}

/// Appends `n` bytes at message offset `off` to a sink, as far as they fit; the rest of the
/// chunk is skipped (truncation). Local chunks come in order, so `off` is the buffer's end.
fn place_local(sink: &mut Sink, off: usize, n: usize, copy: CopyFn<'_>) {
    if off >= sink.place || off != sink.buf.len() {
        return;
    }
    let k = n.min(sink.place - off);
    if k > 0 {
        sink.buf.reserve(k);
        copy(&mut sink.buf, k);
    }
}

/// The engine as the same-host path sees it ([`Engine::same_host`]): messages that arrive whole
/// and in order through another transport go into the engine's matching, and peers met there
/// get a handshake through the device. The path keeps its own send bookkeeping and counters.
pub struct SameHost<'a>(pub(super) &'a mut Engine);

impl SameHost<'_> {
    /// The first chunk (`n` bytes) of a message from `src` on the local path. Returns the id to
    /// pass with the message's further chunks, `None` when this chunk was all of it (or the
    /// message was dropped for the memory bounds: its further chunks are then refused too).
    ///
    /// `now`: the caller's clock, asked only when the time matters (a message that is not
    /// taken whole by a waiting receive); the engine never reads a clock itself, so the
    /// simulator can pass virtual time.
    pub fn first(
        &mut self,
        now: &mut dyn FnMut() -> Instant,
        src: RawAddr,
        m: &LocalMsg,
        n: usize,
        copy: CopyFn<'_>,
    ) -> Option<u32> {
        if self.0.closed || n > m.msg_len {
            self.0
                .drop_pkt("local message: endpoint closed or chunk beyond its length");
            return None;
        }
        let tagged = m.tag.is_some();
        let tag = m.tag.unwrap_or(0);
        self.0.cx.out.stats.local_rx_msgs += 1;
        let posted = self.0.rx.matcher.find_posted(tagged, src, tag);
        if n == m.msg_len {
            // The common case: the whole message in one chunk, a receive waiting for it.
            if let Some(mut sink) = posted.and_then(|i| self.0.rx.take_posted(tagged, i, n)) {
                sink.buf.clear();
                place_local(&mut sink, 0, n, copy);
                let done = Done {
                    peer: LOCAL_PEER,
                    src,
                    msg_id: 0,
                    msg_len: m.msg_len,
                    tagged,
                    tag,
                    data: m.data,
                    dc_send_id: m.dc_token,
                };
                let p = self.0.parts();
                p.rx.finish_rx(sink, &done, p.cx);
                return None;
            }
        }
        let now = now();
        if posted.is_none() && !self.0.cx.budget.room_for_msg() {
            // The local path asks `local_must_wait` first; a message past the bound anyway
            // (a re-matched one) is held, never dropped.
            tracing::debug!("over max_buffered_msgs: local message held");
        }
        let rtm = Rtm {
            msg_id: 0,
            kind: Kind::Medium,
            tag: m.tag,
            data: m.data,
            dc_send_id: m.dc_token,
            msg_length: Some(m.msg_len as u64),
            seg_offset: 0,
            read: None,
        };
        let mut p = self.0.parts();
        let (rx, ema, cx) = (p.rx, &*p.ema, &mut p.cx);
        let taken = |id| ema.owns_recv_id(id);
        let rid = rx.new_rx(
            now,
            LOCAL_PEER,
            src,
            &rtm,
            m.msg_len,
            RxState::Waiting,
            taken,
            cx,
        );
        match posted.and_then(|i| rx.take_posted(tagged, i, m.msg_len)) {
            Some(sink) => rx.start_matched(now, rid, sink, None, cx),
            None => {
                cx.out.stats.unexpected_msgs += 1;
                rx.queue_unexpected(rid, cx);
            }
        }
        self.local_data(now, rid, 0, n, copy);
        self.0.rx.ops.contains_key(&rid).then_some(rid)
    }

    /// A further chunk (`n` bytes at message offset `off`) of local message `rid` from `src`.
    /// False when no such message is in progress (dropped, aborted, or a chunk out of place):
    /// the chunk is then thrown away.
    pub fn next(
        &mut self,
        now: Instant,
        rid: u32,
        src: RawAddr,
        off: usize,
        n: usize,
        copy: CopyFn<'_>,
    ) -> bool {
        let ok = self.0.rx.ops.get(&rid).is_some_and(|e| {
            e.msg.peer == LOCAL_PEER
                && e.msg.src == src
                && e.received == off
                && off.checked_add(n).is_some_and(|end| end <= e.msg.msg_len)
        });
        if !ok {
            self.0.drop_pkt("local chunk of no message in progress");
            return false;
        }
        self.local_data(now, rid, off, n, copy);
        true
    }

    /// True when a chunk of `n` bytes cannot be taken now: it would be held (no receive takes
    /// it) beyond the memory bounds (`EngineLimits`). The caller leaves it where it is and
    /// offers it again later: back-pressure, as receiver-not-ready is on the packet path.
    /// `first`: the chunk starts message `first`; else it continues message `rid`.
    pub fn must_wait(
        &self,
        src: RawAddr,
        first: Option<&LocalMsg>,
        rid: Option<u32>,
        n: usize,
    ) -> bool {
        let room_msgs = first.is_none() || self.0.cx.budget.room_for_msg();
        if room_msgs && self.0.cx.budget.fits(n) {
            return false;
        }
        match (first, rid) {
            (Some(m), _) => self
                .0
                .rx
                .matcher
                .find_posted(m.tag.is_some(), src, m.tag.unwrap_or(0))
                .is_none(),
            (None, Some(rid)) => self.0.rx.ops.get(&rid).is_some_and(|e| !e.matched()),
            (None, None) => false,
        }
    }

    /// A peer first met on the local path: the engine makes sure it has the peer and sends it
    /// its HANDSHAKE through the device, so one-sided operations (which stay on the device)
    /// know the peer's features as if messages had gone that way too.
    pub fn contact(&mut self, addr: RawAddr) {
        if self.0.closed {
            return;
        }
        if let Some(pid) = self.0.parts().cx.peer_for_send(addr) {
            self.0.queue_handshake(pid);
        }
    }

    /// Ends local message `rid` without the rest of its chunks: a matched receive fails with
    /// `ConnectionAborted`, an unmatched message is forgotten.
    pub fn abort(&mut self, rid: u32) {
        if self
            .0
            .rx
            .ops
            .get(&rid)
            .is_some_and(|e| e.msg.peer == LOCAL_PEER)
        {
            let p = self.0.parts();
            p.rx.abort_rx(
                rid,
                crate::error::ErrorKind::ConnectionAborted,
                "the sender's message was cut short",
                p.cx,
            );
        }
    }

    /// The next delivery-complete acknowledgement the local path owes: `(sender, token)` of a
    /// local message flagged delivery complete that is now in its buffer.
    pub fn take_receipt(&mut self) -> Option<(RawAddr, u32)> {
        self.0.cx.receipts.pop_front()
    }

    /// Places or holds `n` bytes at `off` of local message `rid`; completes it when whole.
    fn local_data(&mut self, now: Instant, rid: u32, off: usize, n: usize, copy: CopyFn<'_>) {
        let mut p = self.0.parts();
        let (rx, cx) = (p.rx, &mut p.cx);
        let fits = cx.budget.fits(n);
        let Some(e) = rx.ops.get_mut(&rid) else {
            return;
        };
        e.received += n;
        e.last = now;
        if n > 0 {
            e.ranges.insert(off as u64, (off + n) as u64);
        }
        let complete = e.received == e.msg.msg_len;
        match &mut e.state {
            RxState::Matched(sink) => {
                place_local(sink, off, n, copy);
                if complete {
                    rx.complete_rx(rid, cx);
                }
            }
            RxState::Dropped => {}
            RxState::Waiting | RxState::Unexpected | RxState::Claimed => {
                if n == 0 {
                    return;
                }
                if !fits {
                    tracing::debug!("over max_buffered_bytes: local message held");
                }
                let mut b = BytesMut::with_capacity(n);
                copy(&mut b, n);
                let unexp = !matches!(e.state, RxState::Waiting);
                e.held.push((off, b.freeze()));
                e.held_bytes += n;
                cx.budget.add_bytes(n, unexp);
            }
        }
    }
}
