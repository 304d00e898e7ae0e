//! The flood budget: what the engine holds for messages no receive has taken yet (waiting in
//! reorder windows, unexpected, claimed), against [`EngineLimits`], and the changes of which
//! peers the device should hold back for using more than their share (issue 17).

use std::collections::VecDeque;

use super::EngineLimits;
use super::peer::Peers;
use crate::addr::RawAddr;

#[derive(Debug, Default)]
pub(super) struct Budget {
    pub(super) limits: EngineLimits,
    /// Messages held without a receive, and the bytes copied out for them.
    msgs: usize,
    bytes: usize,
    /// Of those, the unexpected (or claimed) ones.
    unexp_msgs: usize,
    unexp_bytes: usize,
    /// Peers to hold back (`true`) or let go (`false`), for [`super::Engine::poll_hold`].
    changes: VecDeque<(RawAddr, bool)>,
}

impl Budget {
    pub(super) fn new(limits: EngineLimits) -> Budget {
        Budget {
            limits,
            ..Budget::default()
        }
    }

    /// `n` more bytes stay within `max_buffered_bytes`.
    #[inline]
    pub(super) fn fits(&self, n: usize) -> bool {
        self.bytes.saturating_add(n) <= self.limits.max_buffered_bytes
    }

    /// Another message stays within `max_buffered_msgs`.
    #[inline]
    pub(super) fn room_for_msg(&self) -> bool {
        self.msgs < self.limits.max_buffered_msgs
    }

    /// More messages are held than `max_buffered_msgs` (held anyway: the device acknowledged
    /// them).
    pub(super) fn over_msgs(&self) -> bool {
        self.msgs > self.limits.max_buffered_msgs
    }

    /// A message starts being held.
    pub(super) fn add_msg(&mut self) {
        self.msgs += 1;
    }

    /// `n` bytes copied out for a held message (`unexp`: an unexpected or claimed one).
    pub(super) fn add_bytes(&mut self, n: usize, unexp: bool) {
        self.bytes += n;
        if unexp {
            self.unexp_bytes += n;
        }
    }

    /// A held message (with `bytes` copied out) became unexpected.
    pub(super) fn became_unexpected(&mut self, bytes: usize) {
        self.unexp_msgs += 1;
        self.unexp_bytes += bytes;
    }

    /// A held message (with `bytes` copied out) found its receive or went: released
    /// (`unexp`: from the unexpected ones too).
    pub(super) fn release(&mut self, bytes: usize, unexp: bool) {
        self.msgs = self.msgs.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(bytes);
        if unexp {
            self.unexp_msgs = self.unexp_msgs.saturating_sub(1);
            self.unexp_bytes = self.unexp_bytes.saturating_sub(bytes);
        }
    }

    /// One peer's share: half of each bound.
    pub(super) fn share(&self) -> (usize, usize) {
        (
            (self.limits.max_buffered_msgs / 2).max(1),
            (self.limits.max_buffered_bytes / 2).max(1),
        )
    }

    /// Peer `addr` is to be held back (`on`) or let go.
    pub(super) fn hold_change(&mut self, addr: RawAddr, on: bool) {
        self.changes.push_back((addr, on));
    }

    pub(super) fn poll_change(&mut self) -> Option<(RawAddr, bool)> {
        self.changes.pop_front()
    }

    /// Messages and bytes held.
    pub(super) fn held(&self) -> (usize, usize) {
        (self.msgs, self.bytes)
    }

    /// Unexpected (or claimed) messages and their bytes.
    pub(super) fn unexpected(&self) -> (usize, usize) {
        (self.unexp_msgs, self.unexp_bytes)
    }

    /// Nothing is held any more (the endpoint closed); the limits stay.
    pub(super) fn reset(&mut self) {
        *self = Budget {
            limits: self.limits,
            changes: std::mem::take(&mut self.changes),
            ..Budget::default()
        };
    }

    /// Counts (`add`) or releases messages and bytes peer `pid` holds without a receive, and
    /// records when it crosses its share of the budget ([`Budget::poll_change`]).
    pub(super) fn peer_held(
        &mut self,
        peers: &mut Peers,
        pid: u64,
        msgs: usize,
        bytes: usize,
        add: bool,
    ) {
        let (cap_msgs, cap_bytes) = self.share();
        let Some(p) = peers.get_mut(&pid) else {
            return;
        };
        if add {
            p.held_msgs += msgs;
            p.held_bytes += bytes;
        } else {
            p.held_msgs = p.held_msgs.saturating_sub(msgs);
            p.held_bytes = p.held_bytes.saturating_sub(bytes);
        }
        let over = p.held_msgs > cap_msgs || p.held_bytes > cap_bytes;
        let under = p.held_msgs <= cap_msgs / 2 && p.held_bytes <= cap_bytes / 2;
        if over && !p.held_back {
            p.held_back = true;
            tracing::debug!(peer = %p.addr, msgs = p.held_msgs, bytes = p.held_bytes, "peer over its buffering share: held back");
            self.hold_change(p.addr, true);
        } else if under && p.held_back {
            p.held_back = false;
            self.hold_change(p.addr, false);
        }
    }
}
