//! The receive side of the same-host path: the own ring read slot by slot into the engine's
//! matching, chunk by chunk, with back-pressure when the engine's memory bounds are reached.

use bytes::BytesMut;

use super::ring::{Channels, PeerRing};
use super::ring::{F_DATA, F_DC, F_TAGGED, F_UNWATCHED, K_DC_ACK, K_MSG, K_NEXT};
use super::{DRAIN_BATCH, Inbound, LocalPath, STUCK_SLOT};
use crate::progress::Clock;
use crate::proto::engine::{Engine, LocalMsg};

impl<C: Channels> LocalPath<C> {
    /// Reads up to a batch of slots of the own ring.
    pub(super) fn drain(&mut self, engine: &mut Engine, clock: &mut Clock) -> bool {
        let mut n = 0;
        let mut senders: [Option<usize>; 2] = [None; 2];
        let mut more_senders = false;
        while n < DRAIN_BATCH {
            let Some(h) = self.chans.peek() else { break };
            let Some(src) = h.src else {
                self.malformed("local slot with a bad length or sender");
                self.chans.pop();
                n += 1;
                continue;
            };
            // Both sides know each other (the engine's handshake, for one-sided operations), and
            // a sender that sleeps learns that its slots were consumed (unless nothing of its
            // waits for that: an inject).
            let p = self.route(engine, &src);
            if let Some(p) = p.filter(|_| h.hdr.flags & F_UNWATCHED == 0) {
                match senders {
                    [Some(a), _] if a == p => {}
                    [_, Some(b)] if b == p => {}
                    [None, _] => senders[0] = Some(p),
                    [_, None] => senders[1] = Some(p),
                    _ => more_senders = true,
                }
            }
            let chans = &self.chans;
            let len = h.hdr.len as usize;
            // The slot is freed as soon as its data is copied: the free moves the slot's cache
            // line to this core, and that transfer then overlaps the matching's remaining work.
            let popped = std::cell::Cell::new(false);
            let mut copy = |b: &mut BytesMut, k: usize| {
                chans.copy(&h, k, b);
                if !popped.get() {
                    popped.set(true);
                    chans.pop();
                }
            };
            let mut port = engine.same_host();
            match h.hdr.kind {
                K_MSG => {
                    let f = h.hdr.flags;
                    let m = LocalMsg {
                        tag: (f & F_TAGGED != 0).then_some(h.hdr.tag),
                        data: (f & F_DATA != 0).then_some(h.hdr.data),
                        dc_token: (f & F_DC != 0).then_some(h.hdr.token),
                        msg_len: usize::try_from(h.hdr.word).unwrap_or(usize::MAX),
                    };
                    if port.must_wait(src, Some(&m), None, len) {
                        self.stall();
                        break;
                    }
                    let old = if self.inbound.is_empty() {
                        None
                    } else {
                        self.inbound.remove(&src)
                    };
                    if let Some(old) = old {
                        // The sender started another message before finishing this one: it
                        // cannot (it writes chunks in order), so its state was garbage.
                        self.stats.dropped += 1;
                        tracing::debug!("local message cut short by the next");
                        if let Some(rid) = old.rid {
                            port.abort(rid);
                        }
                    }
                    let rid = port.first(&mut || clock.now(), src, &m, len, &mut copy);
                    if len < m.msg_len {
                        self.inbound.insert(
                            src,
                            Inbound {
                                rid,
                                next: len,
                                len: m.msg_len,
                            },
                        );
                    }
                }
                K_NEXT => {
                    let off = usize::try_from(h.hdr.word).unwrap_or(usize::MAX);
                    let Some(inb) = self.inbound.get_mut(&src) else {
                        self.malformed("local chunk of no message");
                        self.chans.pop();
                        n += 1;
                        continue;
                    };
                    if inb.next != off || off.checked_add(len).is_none_or(|e| e > inb.len) {
                        if let Some(rid) = inb.rid {
                            port.abort(rid);
                        }
                        self.inbound.remove(&src);
                        self.malformed("local chunk out of place");
                        self.chans.pop();
                        n += 1;
                        continue;
                    }
                    if let Some(rid) = inb.rid {
                        if port.must_wait(src, None, Some(rid), len) {
                            self.stall();
                            break;
                        }
                        port.next(clock.now(), rid, src, off, len, &mut copy);
                    }
                    inb.next += len;
                    if inb.next == inb.len {
                        self.inbound.remove(&src);
                    }
                }
                K_DC_ACK => self.dc_acked(h.hdr.token),
                _ => self.malformed("local slot of an unknown kind"),
            }
            if !popped.get() {
                self.chans.pop();
            }
            self.blocked = false;
            n += 1;
        }
        // A sender that sleeps learns that its slots were consumed (its sends complete). No
        // fence: it naps at most a millisecond while sends wait, and a fence here would wait for
        // the slot frees above to leave the store buffer, on the way to this side's completion.
        if more_senders {
            for c in self.peers.iter().filter_map(|p| p.chan.as_ref()) {
                c.nudge();
            }
        } else {
            for p in senders.into_iter().flatten() {
                if let Some(c) = self.peers.get(p).and_then(|p| p.chan.as_ref()) {
                    c.nudge();
                }
            }
        }
        self.more = n >= DRAIN_BATCH;
        n > 0
    }

    /// Counts and logs a malformed slot (dropped).
    fn malformed(&mut self, why: &'static str) {
        self.stats.dropped += 1;
        tracing::debug!(why, "local path: dropped a slot");
    }

    /// Gives up on a head slot a producer reserved and has not published for `STUCK_SLOT`.
    pub(super) fn check_stuck(&mut self, clock: &mut Clock) {
        let Some(head) = self.chans.reserved_head() else {
            self.stuck_head = None;
            return;
        };
        let now = clock.now();
        match self.stuck_head {
            Some((h, since)) if h == head => {
                if now.saturating_duration_since(since) >= STUCK_SLOT {
                    tracing::warn!(
                        pos = head,
                        "local path: a slot reserved and never published (its sender died?) is skipped"
                    );
                    self.malformed("local slot reserved and never published");
                    self.chans.skip_head();
                    self.stuck_head = None;
                }
            }
            _ => self.stuck_head = Some((head, now)),
        }
    }

    fn stall(&mut self) {
        if !self.blocked {
            self.blocked = true;
            tracing::debug!("local path: receive memory bounds reached; chunks wait in the ring");
        }
    }
}
