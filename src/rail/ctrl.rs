//! Control messages, delivered once to the peer group even when a rail fails under them.
//!
//! A rail's send completion says the peer's endpoint on that rail took the message, not that
//! the peer group did: if that endpoint closes before the group polled it, the message is gone
//! although the send succeeded. So every control message but an acknowledgement is kept until
//! the peer group acknowledges it (`Ack` with its kind and sequence number), and sent again on
//! another working rail when its rail fails or no acknowledgement came within the control
//! timeout (doubling on each try, up to 16 times the first). The receiver drops the copies
//! (every kind is idempotent by kind and sequence number) and acknowledges each one. An
//! operation that waits for a control message moves on when it is acknowledged, and fails when
//! no rail to the peer is left.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::state::{State, Work, rail_failure};
use super::wire::Ctrl;
use crate::error::{Error, ErrorKind};

/// A control message's identity: its kind and sequence number.
pub(super) type CtrlKey = (u8, u64);

/// A control message waiting for its acknowledgement.
pub(super) struct Unacked {
    msg: Bytes,
    /// The group operation that waits for it.
    op: Option<usize>,
    /// When to send it again.
    due: Instant,
    tries: u32,
    /// The rail it went on last.
    rail: Option<usize>,
}

impl State {
    fn ctrl_timeout(&self, tries: u32) -> Duration {
        self.set.ctrl_timeout * (1u32 << tries.min(4))
    }

    /// Sends `c` to `peer` until acknowledged; `op` (if any) waits for the acknowledgement.
    pub fn send_ctrl(&mut self, peer: usize, c: Ctrl, op: Option<usize>) {
        let key = (c.kind(), c.seq());
        let msg = c.encode();
        let due = Instant::now() + self.ctrl_timeout(0);
        let u = Unacked {
            msg: msg.clone(),
            op,
            due,
            tries: 0,
            rail: None,
        };
        if let Some(old) = self.peers[peer].unacked.insert(key, u) {
            // Not expected (keys are unique per peer); keep the older one's operation waiting.
            if let Some(op) = old.op {
                self.op_step_done(op);
            }
        }
        self.transmit(peer, msg, Some(key), None);
    }

    /// Acknowledges `c` to its sender (also for copies: the first acknowledgement may be lost).
    pub fn ack(&mut self, peer: usize, c: &Ctrl) {
        let a = Ctrl::Ack {
            seq: c.seq(),
            kind: c.kind(),
        };
        self.transmit(peer, a.encode(), None, None);
    }

    /// `peer` acknowledged the control message `key`.
    pub fn on_ack(&mut self, peer: usize, key: CtrlKey) {
        match self.peers[peer].unacked.remove(&key) {
            Some(u) => {
                if let Some(op) = u.op {
                    self.op_step_done(op);
                }
            }
            None => self.ctrl_dropped += 1,
        }
    }

    /// Posts `msg` to `peer` on a working rail (not `avoid` when another works; the one with
    /// the fewest stripe bytes in flight), trying the others when one refuses it; `Again`
    /// keeps it for the next poll. With no rail left, a tracked message is given up and its
    /// operation fails.
    pub fn transmit(
        &mut self,
        peer: usize,
        msg: Bytes,
        key: Option<CtrlKey>,
        avoid: Option<usize>,
    ) {
        if key.is_some_and(|k| !self.peers[peer].unacked.contains_key(&k)) {
            return; // acknowledged meanwhile
        }
        loop {
            let live: Vec<usize> = (0..self.peers[peer].paths.len())
                .filter(|&r| self.live(peer, r))
                .collect();
            let best = live
                .iter()
                .copied()
                .filter(|&r| Some(r) != avoid || live.len() == 1)
                .min_by_key(|&r| (self.rails[r].stats.in_flight_bytes, r));
            let Some(rail) = best else {
                self.give_up(peer, key);
                return;
            };
            let dest = self.peers[peer].paths[rail];
            let w = self.work.insert(Work::Ctrl {
                rail,
                peer,
                msg: msg.clone(),
                key,
            });
            let ep = self.rails[rail]
                .ep
                .as_ref()
                .expect("live rails have an endpoint");
            match ep.send(dest, msg.clone(), w as u64 + 1) {
                Ok(()) => {
                    if let Some(u) = key.and_then(|k| self.peers[peer].unacked.get_mut(&k)) {
                        u.rail = Some(rail);
                    }
                    return;
                }
                Err(e) => {
                    self.work.remove(w);
                    if e.kind() == ErrorKind::Again {
                        self.ctrl_backlog.push_back((peer, msg, key));
                        return;
                    }
                    self.rails[rail].stats.errors += 1;
                    self.kill_path(peer, rail, &e.error);
                }
            }
        }
    }

    /// No rail to `peer` is left for control message `key`: its operation fails.
    fn give_up(&mut self, peer: usize, key: Option<CtrlKey>) {
        let Some(u) = key.and_then(|k| self.peers[peer].unacked.remove(&k)) else {
            return;
        };
        if let Some(op) = u.op {
            let e = self.no_rail_error(peer, "rail_ctrl");
            self.op_failed(op, e);
            self.op_step_done(op);
        }
    }

    /// A control message's send failed on `rail`.
    pub fn ctrl_failed(
        &mut self,
        rail: usize,
        peer: usize,
        msg: Bytes,
        key: Option<CtrlKey>,
        e: Error,
    ) {
        if rail_failure(e.kind()) {
            self.kill_path(peer, rail, &e);
            self.transmit(peer, msg, key, Some(rail));
            return;
        }
        tracing::warn!(peer, rail, error = %e, "control message refused");
        if let Some(u) = key.and_then(|k| self.peers[peer].unacked.remove(&k)) {
            if let Some(op) = u.op {
                self.op_failed(op, e);
                self.op_step_done(op);
            }
        }
    }

    /// Sends again, on another rail, every control message whose acknowledgement is overdue.
    pub fn resend_overdue(&mut self, now: Instant) {
        for peer in 0..self.peers.len() {
            if self.peers[peer].unacked.is_empty() {
                continue;
            }
            let overdue: Vec<CtrlKey> = (self.peers[peer].unacked.iter())
                .filter(|(_, u)| u.due <= now)
                .map(|(k, _)| *k)
                .collect();
            for key in overdue {
                let timeout = {
                    let u = &self.peers[peer].unacked[&key];
                    self.ctrl_timeout(u.tries + 1)
                };
                let Some(u) = self.peers[peer].unacked.get_mut(&key) else {
                    continue;
                };
                u.tries += 1;
                u.due = now + timeout;
                let (msg, avoid) = (u.msg.clone(), u.rail);
                tracing::debug!(
                    peer,
                    ?key,
                    tries = u.tries,
                    "control message unacknowledged; sent again"
                );
                self.transmit(peer, msg, Some(key), avoid);
            }
        }
    }
}
