//! The initiator's side: group operations (writes, reads, sends), their stripes, which rail
//! carries each stripe, and what happens when a stripe fails.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::addr::RailRemoteKey;
use super::state::{State, Work, rail_failure};
use super::wire::Ctrl;
use super::{RailCompletion, RailOp, RailPeer};
use crate::cq::{Buffer, PostError};
use crate::error::{Error, ErrorKind, Result};

/// Where a group operation's stripes go: the peer's key bundle and the offset of the
/// operation's first byte in its region.
pub(super) struct Target {
    pub key: RailRemoteKey,
    pub base: u64,
}

/// What an operation is waiting for (see [`State::op_step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Its stripes.
    Data,
    /// A write's notification to be delivered.
    Notify,
    /// A small message's control message to be delivered.
    Inline,
    /// A large message's request (RTS) to be delivered.
    Rts,
    /// The receiver's buffer (CTS).
    AwaitCts,
    /// A large message's FIN to be delivered.
    Fin,
}

pub(super) enum OpKind {
    Write {
        buf: Bytes,
        notify: Option<(u64, u32)>,
    },
    Read {
        parts: Vec<(usize, BytesMut)>,
    },
    Send {
        buf: Bytes,
        seq: u64,
    },
}

/// A group operation in flight.
pub(super) struct Op {
    pub context: u64,
    pub peer: usize,
    pub len: usize,
    pub kind: OpKind,
    pub stage: Stage,
    pub target: Option<Arc<Target>>,
    /// Stripes queued or in flight, and control messages it waits for.
    pub pending: usize,
    /// The first error; the operation completes with it once nothing is pending.
    pub error: Option<Error>,
}

/// One stripe: bytes `off..off + len` of operation `op` (a read's part of the buffer rides
/// along while the stripe is not in flight).
pub(super) struct Stripe {
    pub op: usize,
    pub peer: usize,
    pub off: usize,
    pub len: usize,
    pub buf: Option<BytesMut>,
}

/// Cuts `len` bytes into stripes for `rails` working rails: one stripe below twice the
/// minimum; else about four per rail, each at least `min` and, where the length allows, at
/// most `max` bytes, the lengths differing by at most one byte.
pub(super) fn plan(len: usize, rails: usize, min: usize, max: usize) -> Vec<(usize, usize)> {
    if len == 0 {
        return Vec::new();
    }
    let by_min = (len / min).max(1);
    let by_max = len.div_ceil(max);
    let k = (rails.max(1) * 4).max(by_max).min(by_min);
    let (q, r) = (len / k, len % k);
    let mut off = 0;
    (0..k)
        .map(|i| {
            let l = q + usize::from(i < r);
            let s = (off, l);
            off += l;
            s
        })
        .collect()
}

fn refuse(e: Error, buf: Buffer) -> PostError {
    PostError { error: e, buf }
}

impl State {
    /// Checks a peer, a key bundle and a range for an RMA operation.
    fn check_rma(
        &self,
        peer: RailPeer,
        key: &RailRemoteKey,
        offset: u64,
        len: usize,
        op: &'static str,
    ) -> Result<usize> {
        let p = self.peer_index(peer, op)?;
        let paths = self.peers[p].paths.len();
        let why = if key.keys.len() < paths {
            Some(format!(
                "the key bundle has {} keys for {paths} rails",
                key.keys.len()
            ))
        } else if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > key.len)
        {
            Some(format!(
                "{len} bytes at offset {offset} of a region of {} bytes",
                key.len
            ))
        } else {
            None
        };
        match why {
            Some(w) => Err(Error::new(ErrorKind::InvalidArgument, op).with_detail(w)),
            None => Ok(p),
        }
    }

    fn new_op(
        &mut self,
        context: u64,
        peer: usize,
        len: usize,
        kind: OpKind,
        stage: Stage,
    ) -> usize {
        self.ops.insert(Op {
            context,
            peer,
            len,
            kind,
            stage,
            target: None,
            pending: 0,
            error: None,
        })
    }

    /// Queues operation `op`'s stripes over `len` bytes into `target`; returns how many.
    fn queue_stripes(
        &mut self,
        op: usize,
        len: usize,
        target: Arc<Target>,
        mut buf: Option<BytesMut>,
    ) {
        let peer = self.ops[op].peer;
        let plan = plan(
            len,
            self.live_paths(peer),
            self.set.min_stripe,
            self.set.max_stripe,
        );
        self.ops[op].target = Some(target);
        self.ops[op].pending += plan.len();
        for (off, l) in plan {
            let part = buf.as_mut().map(|b| b.split_to(l));
            self.queue.push_back(Stripe {
                op,
                peer,
                off,
                len: l,
                buf: part,
            });
        }
    }

    pub fn post_write(
        &mut self,
        peer: RailPeer,
        buf: Bytes,
        to: &RailRemoteKey,
        offset: u64,
        data: Option<u32>,
        context: u64,
    ) -> Result<(), PostError> {
        let p = match self.check_rma(peer, to, offset, buf.len(), "rail_write") {
            Ok(p) => p,
            Err(e) => return Err(refuse(e, Buffer::Send(buf))),
        };
        let notify = data.map(|d| {
            let s = self.peers[p].tx_seq;
            self.peers[p].tx_seq += 1;
            (s, d)
        });
        let len = buf.len();
        let op = self.new_op(context, p, len, OpKind::Write { buf, notify }, Stage::Data);
        let target = Arc::new(Target {
            key: to.clone(),
            base: offset,
        });
        self.queue_stripes(op, len, target, None);
        self.op_step(op);
        self.dispatch();
        Ok(())
    }

    pub fn post_read(
        &mut self,
        peer: RailPeer,
        mut buf: BytesMut,
        len: usize,
        from: &RailRemoteKey,
        offset: u64,
        context: u64,
    ) -> Result<(), PostError> {
        let p = match self.check_rma(peer, from, offset, len, "rail_read") {
            Ok(p) => p,
            Err(e) => return Err(refuse(e, Buffer::Recv(buf))),
        };
        buf.clear();
        buf.resize(len, 0);
        let op = self.new_op(
            context,
            p,
            len,
            OpKind::Read { parts: Vec::new() },
            Stage::Data,
        );
        let target = Arc::new(Target {
            key: from.clone(),
            base: offset,
        });
        self.queue_stripes(op, len, target, Some(buf));
        self.op_step(op);
        self.dispatch();
        Ok(())
    }

    pub fn post_send(&mut self, peer: RailPeer, buf: Bytes, context: u64) -> Result<(), PostError> {
        let p = match self.peer_index(peer, "rail_send") {
            Ok(p) => p,
            Err(e) => return Err(refuse(e, Buffer::Send(buf))),
        };
        let seq = self.peers[p].tx_seq;
        self.peers[p].tx_seq += 1;
        let len = buf.len();
        let (msg, stage) = if len <= self.set.inline_size {
            (
                Ctrl::Msg {
                    seq,
                    data: buf.clone(),
                },
                Stage::Inline,
            )
        } else {
            (
                Ctrl::Rts {
                    seq,
                    len: len as u64,
                },
                Stage::Rts,
            )
        };
        let op = self.new_op(context, p, len, OpKind::Send { buf, seq }, stage);
        if stage == Stage::Rts {
            self.peers[p].await_cts.insert(seq, op);
        }
        self.ops[op].pending += 1;
        self.send_ctrl(p, msg, Some(op));
        Ok(())
    }

    /// The receiver's buffer for our large message `seq` arrived: write the message into it.
    pub fn on_cts(&mut self, peer: usize, seq: u64, key: RailRemoteKey) {
        let Some(op) = self.peers[peer].await_cts.remove(&seq) else {
            self.ctrl_dropped += 1;
            return;
        };
        let Some(o) = self.ops.get_mut(op) else {
            return;
        };
        if o.error.is_some() {
            return;
        }
        if key.keys.len() < self.peers[peer].paths.len() {
            let e = Error::new(ErrorKind::RemoteAccess, "rail_send")
                .with_detail("the receiver's key bundle has fewer keys than rails");
            self.op_failed(op, e);
            self.op_step(op);
            return;
        }
        o.stage = Stage::Data;
        let len = o.len.min(key.len as usize);
        self.queue_stripes(op, len, Arc::new(Target { key, base: 0 }), None);
        self.op_step(op);
        self.dispatch();
    }

    /// The receiver could not take our message `seq`.
    pub fn on_refuse(&mut self, peer: usize, seq: u64) {
        if let Some(op) = self.peers[peer].await_cts.remove(&seq) {
            let e = Error::new(ErrorKind::RemoteIo, "rail_send")
                .with_detail("the receiver could not register its buffer for the message");
            self.op_failed(op, e);
            self.op_step(op);
        } else {
            self.ctrl_dropped += 1;
        }
    }

    /// Records `op`'s first error.
    pub fn op_failed(&mut self, op: usize, e: Error) {
        if let Some(o) = self.ops.get_mut(op) {
            o.error.get_or_insert(e);
        }
    }

    /// One thing `op` waited for is done.
    pub fn op_step_done(&mut self, op: usize) {
        if let Some(o) = self.ops.get_mut(op) {
            o.pending = o.pending.saturating_sub(1);
        }
        self.op_step(op);
    }

    /// Moves `op` on once nothing is pending: to its next stage, or to its completion.
    pub fn op_step(&mut self, op: usize) {
        enum Next {
            Send(Ctrl, Stage),
            Wait(Stage),
            Complete,
        }
        let Some(o) = self.ops.get(op) else { return };
        if o.pending > 0 {
            return;
        }
        let peer = o.peer;
        let next = match (&o.kind, o.stage) {
            _ if o.error.is_some() => Next::Complete,
            (
                OpKind::Write {
                    notify: Some((seq, data)),
                    ..
                },
                Stage::Data,
            ) => {
                let len = o.len as u64;
                Next::Send(
                    Ctrl::Notify {
                        seq: *seq,
                        data: *data,
                        len,
                    },
                    Stage::Notify,
                )
            }
            (OpKind::Send { seq, .. }, Stage::Data) => Next::Send(
                Ctrl::Fin {
                    seq: *seq,
                    len: o.len as u64,
                },
                Stage::Fin,
            ),
            // Delivered; the CTS comes when the receiver has a buffer.
            (OpKind::Send { .. }, Stage::Rts | Stage::AwaitCts) => Next::Wait(Stage::AwaitCts),
            _ => Next::Complete,
        };
        match next {
            Next::Send(msg, stage) => {
                let o = &mut self.ops[op];
                o.stage = stage;
                o.pending += 1;
                self.send_ctrl(peer, msg, Some(op));
            }
            Next::Wait(stage) => self.ops[op].stage = stage,
            Next::Complete => self.complete(op),
        }
    }

    /// Completes `op` (its error, if any), handing its buffer back; a failed operation that
    /// held a place in the peer's order tells the peer to skip it.
    fn complete(&mut self, op: usize) {
        let o = self.ops.remove(op);
        let seq = match &o.kind {
            OpKind::Write {
                notify: Some((s, _)),
                ..
            } => Some(*s),
            OpKind::Send { seq, .. } => Some(*seq),
            _ => None,
        };
        if let (Some(seq), Some(_)) = (seq, &o.error) {
            self.peers[o.peer].await_cts.remove(&seq);
            self.send_ctrl(o.peer, Ctrl::Abort { seq }, None);
        }
        let (kind, buf) = match o.kind {
            OpKind::Write { buf, .. } => (RailOp::Write, Buffer::Send(buf)),
            OpKind::Send { buf, .. } => (RailOp::Send, Buffer::Send(buf)),
            OpKind::Read { mut parts } => {
                parts.sort_by_key(|p| p.0);
                let mut all = BytesMut::new();
                for (_, p) in parts {
                    all.unsplit(p);
                }
                (RailOp::Read, Buffer::Recv(all))
            }
        };
        self.finish(RailCompletion {
            context: o.context,
            op: kind,
            peer: Some(RailPeer(o.peer as u32)),
            len: if o.error.is_some() { 0 } else { o.len },
            data: None,
            result: o.error.map_or(Ok(()), Err),
            buf,
        });
    }

    /// Hands queued stripes to rails with room: each stripe to the working rail (to its peer)
    /// with the fewest stripe bytes in flight among those with fewer than `depth` stripes in
    /// flight. Stripes of an operation that failed meanwhile are dropped; a stripe no rail can
    /// carry any more fails its operation.
    pub fn dispatch(&mut self) {
        let mut keep = std::collections::VecDeque::new();
        let mut full = vec![false; self.rails.len()];
        while let Some(s) = self.queue.pop_front() {
            if self.ops.get(s.op).is_none_or(|o| o.error.is_some()) {
                self.stripe_finished(s);
                continue;
            }
            let depth = self.set.depth;
            let candidates: Vec<usize> = (0..self.peers[s.peer].paths.len())
                .filter(|&r| self.live(s.peer, r))
                .collect();
            if candidates.is_empty() {
                let e = self.no_rail_error(s.peer, "rail_stripe");
                self.op_failed(s.op, e);
                self.stripe_finished(s);
                continue;
            }
            let pick = candidates
                .into_iter()
                .filter(|&r| !full[r] && self.rails[r].in_flight < depth)
                .min_by_key(|&r| (self.rails[r].stats.in_flight_bytes, r));
            let Some(rail) = pick else {
                keep.push_back(s);
                continue;
            };
            if let Err((s, again)) = self.post_stripe(rail, s) {
                if again {
                    full[rail] = true;
                    keep.push_back(s);
                } else {
                    self.queue.push_front(s);
                }
            }
        }
        keep.append(&mut self.queue);
        self.queue = keep;
    }

    /// A stripe that is done (or will not run): its operation stops waiting for it, and a read
    /// keeps its part of the buffer.
    fn stripe_finished(&mut self, s: Stripe) {
        if let (Some(o), Some(b)) = (self.ops.get_mut(s.op), s.buf) {
            if let OpKind::Read { parts } = &mut o.kind {
                parts.push((s.off, b));
            }
        }
        self.op_step_done(s.op);
    }

    /// Posts stripe `s` on `rail`. On refusal hands it back: `true` for `Again` (the rail is
    /// full), `false` after the rail was given up for the peer.
    fn post_stripe(
        &mut self,
        rail: usize,
        mut s: Stripe,
    ) -> std::result::Result<(), (Stripe, bool)> {
        let o = &self.ops[s.op];
        let t = o
            .target
            .clone()
            .expect("stripes are queued with their target");
        let to = t.key.at(t.base + s.off as u64, rail);
        let dest = self.peers[s.peer].paths[rail];
        let key = self.work.vacant_key() as u64 + 1;
        let ep = self.rails[rail]
            .ep
            .as_ref()
            .expect("live rails have an endpoint");
        let posted = match &o.kind {
            OpKind::Write { buf, .. } | OpKind::Send { buf, .. } => {
                ep.write(dest, buf.slice(s.off..s.off + s.len), to, key)
            }
            OpKind::Read { .. } => {
                let b = s.buf.take().unwrap_or_default();
                ep.read(dest, b, s.len, to, key)
            }
        };
        match posted {
            Ok(()) => {
                let r = &mut self.rails[rail];
                r.in_flight += 1;
                r.stats.in_flight_bytes += s.len as u64;
                self.work.insert(Work::Stripe { rail, stripe: s });
                Ok(())
            }
            Err(e) => {
                if let Buffer::Recv(b) = e.buf {
                    s.buf = Some(b);
                }
                if e.error.kind() == ErrorKind::Again {
                    return Err((s, true));
                }
                self.rails[rail].stats.errors += 1;
                if !rail_failure(e.error.kind()) {
                    self.op_failed(s.op, e.error);
                    self.stripe_finished(s);
                    return Ok(());
                }
                self.kill_path(s.peer, rail, &e.error);
                self.rails[rail].stats.moved += 1;
                Err((s, false))
            }
        }
    }

    /// A stripe's rail operation completed (or failed) on `rail`.
    pub fn stripe_done(&mut self, rail: usize, mut s: Stripe, result: Result<()>, buf: Buffer) {
        let r = &mut self.rails[rail];
        r.in_flight -= 1;
        r.stats.in_flight_bytes -= s.len as u64;
        if let Buffer::Recv(b) = buf {
            s.buf = Some(b);
        }
        match result {
            Ok(()) => {
                r.stats.bytes += s.len as u64;
                r.stats.stripes += 1;
                self.stripe_finished(s);
            }
            Err(e)
                if rail_failure(e.kind())
                    && self.ops.get(s.op).is_some_and(|o| o.error.is_none()) =>
            {
                r.stats.moved += 1;
                self.kill_path(s.peer, rail, &e);
                // Written or read again, whole, on another rail: the same bytes to the same
                // place, so a part that landed before the failure does no harm.
                self.queue.push_front(s);
            }
            Err(e) => {
                self.op_failed(s.op, e);
                self.stripe_finished(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::plan;

    #[test]
    fn stripes_cover_the_transfer_and_respect_the_sizes() {
        for (len, rails) in [
            (1, 4),
            (100, 4),
            (255, 4),
            (256, 4),
            (1000, 1),
            (1 << 20, 4),
            ((1 << 20) + 7, 3),
            (64 << 20, 4),
            (5 << 30, 2),
        ] {
            let (min, max) = (128, 1 << 26);
            let p = plan(len, rails, min, max);
            let mut off = 0;
            for &(o, l) in &p {
                assert_eq!(o, off);
                off += l;
            }
            assert_eq!(off, len, "{len}");
            if len < 2 * min {
                assert_eq!(p.len(), 1, "{len}: one rail below twice the minimum");
            } else {
                assert!(p.iter().all(|&(_, l)| l >= min), "{len}: {p:?}");
                let biggest = p.iter().map(|s| s.1).max().unwrap();
                let smallest = p.iter().map(|s| s.1).min().unwrap();
                assert!(biggest - smallest <= 1);
                assert!(
                    p.len() >= rails.min(len / min),
                    "{len}: every rail gets one"
                );
            }
            if len >= 4 * rails * max {
                assert!(p.iter().all(|&(_, l)| l <= max));
            }
        }
        assert!(plan(0, 4, 1, 1).is_empty());
    }
}
