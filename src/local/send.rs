//! The send side of the same-host path: messages cut into slot-sized chunks into peers' rings,
//! what waits for room, for consumption or for a delivery-complete acknowledgement, and the
//! send completions.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use super::ring::{
    Channels, F_DATA, F_DC, F_TAGGED, F_UNWATCHED, K_DC_ACK, K_MSG, K_NEXT, Liveness, PeerRing,
    SlotHdr,
};
use super::{DcWait, LocalPath, LocalSend, Out, OutMsg, Unconsumed};
use crate::device::Status;
use crate::error::Error;
use crate::proto::engine::{Event, SendDone};

/// The header of a message's first chunk.
fn first_hdr(tag: Option<u64>, data: Option<u32>, dc: Option<u32>, len: usize) -> SlotHdr {
    let mut flags = 0;
    if tag.is_some() {
        flags |= F_TAGGED;
    }
    if data.is_some() {
        flags |= F_DATA;
    }
    if dc.is_some() {
        flags |= F_DC;
    }
    SlotHdr {
        kind: K_MSG,
        flags,
        len: 0,
        tag: tag.unwrap_or(0),
        word: len as u64,
        data: data.unwrap_or(0),
        token: dc.unwrap_or(0),
    }
}

impl<C: Channels> LocalPath<C> {
    /// Sends `m` to peer `peer` (from [`Self::route`]). Its completion comes from
    /// [`Self::pop_event`].
    pub(crate) fn send(&mut self, peer: usize, m: LocalSend) {
        self.inflight += 1;
        // The usual case first: one chunk to a peer with nothing queued goes straight into its
        // ring.
        if !m.delivery_complete {
            if let Some(p) = self.peers.get_mut(peer) {
                if let Some(chan) = p.straight_in(m.len) {
                    let guard;
                    let data: &[u8] = match &m.region {
                        Some(r) if m.buf.len() != m.len => {
                            guard = r.read();
                            guard.get(..m.len).unwrap_or_default()
                        }
                        _ => &m.buf[..],
                    };
                    let h = first_hdr(m.tag, m.data, None, m.len);
                    if let Some(pos) = chan.push(&h, &self.me, data) {
                        chan.wake();
                        if p.unconsumed.is_empty() {
                            self.consuming.push(peer);
                        }
                        p.unconsumed.push_back(Unconsumed {
                            context: m.context,
                            pos,
                            tag: m.tag,
                            buf: m.buf,
                            len: m.len,
                        });
                        self.pace.waiting.store(true, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }
        let dc = m.delivery_complete.then(|| {
            let t = self.next_token;
            self.next_token = self.next_token.wrapping_add(1).max(1);
            t
        });
        let out = Out::Msg(OutMsg {
            context: m.context,
            tag: m.tag,
            data: m.data,
            dc,
            buf: m.buf,
            region: m.region,
            len: m.len,
            sent: 0,
            started: false,
            last: 0,
        });
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        if let Some(l) = p.gone {
            tracing::debug!(?l, "local path: send to a peer that is gone");
            if let Out::Msg(m) = out {
                self.complete(
                    m.context,
                    m.buf,
                    m.len,
                    m.tag,
                    Some(Status::UnresponsiveRemote),
                );
            }
            return;
        }
        p.queue.push_back(out);
        self.queued += 1;
        self.flush_peer(peer);
    }

    /// An inject of one chunk straight into `peer`'s ring, when nothing waits before it and the
    /// ring has room: nothing to track, as an inject completes when its bytes are copied.
    /// `false`: the caller sends a copy the usual way.
    pub(crate) fn inject(
        &mut self,
        peer: usize,
        tag: Option<u64>,
        data: Option<u32>,
        bytes: &[u8],
    ) -> bool {
        let Some(p) = self.peers.get_mut(peer) else {
            return false;
        };
        // A peer that closed its endpoint gets the copy, so the failure is reported; one that
        // died without closing loses the inject (as a datagram would be lost).
        let Some(chan) = p.straight_in(bytes.len()).filter(|c| !c.closed()) else {
            return false;
        };
        let mut h = first_hdr(tag, data, None, bytes.len());
        h.flags |= F_UNWATCHED;
        if chan.push(&h, &self.me, bytes).is_none() {
            return false;
        }
        chan.wake();
        self.count_sent(bytes.len());
        true
    }

    fn count_sent(&mut self, len: usize) {
        self.stats.tx_msgs += 1;
        self.stats.tx_bytes += len as u64;
    }

    /// Pushes what waits for `peer` into its ring, as far as there is room.
    pub(super) fn flush_peer(&mut self, peer: usize) -> bool {
        let mut pushed = false;
        loop {
            let Some(p) = self.peers.get_mut(peer) else {
                return pushed;
            };
            // Nothing is queued for a peer that is gone (its sends fail, acknowledgements to it
            // are not made).
            let Some(chan) = p.chan.as_ref() else {
                break;
            };
            let Some(front) = p.queue.front_mut() else {
                break;
            };
            let done = match front {
                Out::DcAck(token) => {
                    let h = SlotHdr {
                        kind: K_DC_ACK,
                        flags: 0,
                        len: 0,
                        tag: 0,
                        word: 0,
                        data: 0,
                        token: *token,
                    };
                    if chan.push(&h, &self.me, &[]).is_none() {
                        break;
                    }
                    pushed = true;
                    true
                }
                Out::Msg(m) => {
                    let bytes;
                    let src: &[u8] = match &m.region {
                        Some(r) if m.buf.len() != m.len => {
                            bytes = r.read();
                            &bytes[..]
                        }
                        _ => &m.buf[..],
                    };
                    let chunk = chan.chunk();
                    let mut full = false;
                    while !m.started || m.sent < m.len {
                        let n = (m.len - m.sent).min(chunk);
                        let Some(data) = src.get(m.sent..m.sent + n) else {
                            // The region was closed under the send (its slice reads empty).
                            m.sent = m.len;
                            break;
                        };
                        let h = if m.started {
                            SlotHdr {
                                kind: K_NEXT,
                                flags: 0,
                                len: 0,
                                tag: 0,
                                word: m.sent as u64,
                                data: 0,
                                token: 0,
                            }
                        } else {
                            first_hdr(m.tag, m.data, m.dc, m.len)
                        };
                        let Some(pos) = chan.push(&h, &self.me, data) else {
                            full = true;
                            break;
                        };
                        m.last = pos;
                        pushed = true;
                        m.started = true;
                        m.sent += n;
                    }
                    !full
                }
            };
            if !done {
                break;
            }
            let Some(out) = p.queue.pop_front() else {
                break;
            };
            self.queued = self.queued.saturating_sub(1);
            if let Out::Msg(m) = out {
                match m.dc {
                    Some(token) => {
                        p.dc_waiting += 1;
                        self.dc.insert(
                            token,
                            DcWait {
                                context: m.context,
                                peer,
                                tag: m.tag,
                                buf: m.buf,
                                len: m.len,
                            },
                        );
                    }
                    None => {
                        if p.unconsumed.is_empty() {
                            self.consuming.push(peer);
                        }
                        p.unconsumed.push_back(Unconsumed {
                            context: m.context,
                            pos: m.last,
                            tag: m.tag,
                            buf: m.buf,
                            len: m.len,
                        });
                    }
                }
            }
        }
        if pushed {
            if let Some(c) = self.peers.get(peer).and_then(|p| p.chan.as_ref()) {
                c.wake();
            }
        }
        self.publish_waiting();
        pushed
    }

    /// Completes the sends whose last chunk the peer consumed.
    pub(super) fn reap(&mut self) -> bool {
        let mut done = false;
        let mut i = 0;
        while let Some(&peer) = self.consuming.get(i) {
            while let Some(u) = self.peers.get_mut(peer).and_then(|p| {
                let pos = p.unconsumed.front()?.pos;
                if p.chan.as_ref().is_none_or(|c| c.consumed(pos)) {
                    p.unconsumed.pop_front()
                } else {
                    None
                }
            }) {
                done = true;
                self.complete(u.context, u.buf, u.len, u.tag, None);
            }
            if self.peers.get(peer).is_none_or(|p| p.unconsumed.is_empty()) {
                self.consuming.swap_remove(i);
            } else {
                i += 1;
            }
        }
        done
    }

    /// A send's one completion: counted, and queued for the endpoint.
    fn complete(
        &mut self,
        context: u64,
        buf: bytes::Bytes,
        len: usize,
        tag: Option<u64>,
        fail: Option<Status>,
    ) {
        self.inflight = self.inflight.saturating_sub(1);
        match fail {
            None => self.count_sent(len),
            Some(Status::Flushed) => {}
            Some(_) => self.stats.tx_errors += 1,
        }
        let error = fail
            .map(|s| Error::new(s.error_kind(), "send").with_detail(format!("local peer: {s}")));
        self.events.push_back(Event::Send(SendDone {
            context,
            buf,
            len: if fail.is_some() { 0 } else { len },
            tag,
            error,
            status: fail,
        }));
    }

    /// Peer `i` is gone (`why`): everything waiting for it fails.
    pub(super) fn fail_peer(&mut self, i: usize, why: Liveness) {
        tracing::debug!(?why, "local path: sends to a peer that is gone fail");
        self.end_peer(i, Status::UnresponsiveRemote);
    }

    /// Completes every send waiting for peer `i` (queued, unconsumed, waiting for its
    /// acknowledgement) with `status`.
    pub(super) fn end_peer(&mut self, i: usize, status: Status) {
        let Some(p) = self.peers.get_mut(i) else {
            return;
        };
        let q = std::mem::take(&mut p.queue);
        let unconsumed: VecDeque<Unconsumed> = std::mem::take(&mut p.unconsumed);
        p.dc_waiting = 0;
        self.queued = self.queued.saturating_sub(q.len());
        for out in q {
            if let Out::Msg(m) = out {
                self.complete(m.context, m.buf, m.len, m.tag, Some(status));
            }
        }
        for u in unconsumed {
            self.complete(u.context, u.buf, u.len, u.tag, Some(status));
        }
        let tokens: Vec<u32> = self
            .dc
            .iter()
            .filter(|(_, w)| w.peer == i)
            .map(|(t, _)| *t)
            .collect();
        for t in tokens {
            if let Some(w) = self.dc.remove(&t) {
                self.complete(w.context, w.buf, w.len, w.tag, Some(status));
            }
        }
    }

    /// The receiver acknowledged delivery-complete message `token`.
    pub(super) fn dc_acked(&mut self, token: u32) {
        let Some(w) = self.dc.remove(&token) else {
            return;
        };
        if let Some(p) = self.peers.get_mut(w.peer) {
            p.dc_waiting = p.dc_waiting.saturating_sub(1);
        }
        self.complete(w.context, w.buf, w.len, w.tag, None);
    }
}
