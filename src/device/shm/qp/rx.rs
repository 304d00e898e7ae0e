//! The receive side of a queue pair: draining the own ring into posted buffers, RNR marking,
//! acknowledging SRD senders, and surviving garbage in the ring.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::ring::{
    self, F_IMM, F_RDMA, F_SRD, Meta, Peek, Ring, ST_CANCELLED, ST_PUBLISHED, ST_RNR, ST_TAKEN,
};
use super::super::segment::{self, Liveness, OpenError};
use super::{Consumed, STUCK_CHECK, State, min_opt};
use crate::device::soft_rdma::{RdmaOps, Served, Src};
use crate::device::{DeviceCompletion, Opcode, QpType, Source, Status};
use crate::stats;
use bytes::BytesMut;

impl State {
    // ---- receiving --------------------------------------------------------------------------

    /// Consumes up to `budget` slots of the own ring; true when more may be waiting.
    pub(super) fn drain(&mut self, now: Instant, budget: usize) -> bool {
        let m = self.own.map.clone();
        let g = self.own.geo;
        let r = Ring::new(&m, &g);
        let mut n = 0;
        let mut more = false;
        let mut again = 0;
        while n < budget {
            match r.peek(self.head) {
                Peek::Empty => {
                    self.stuck = None;
                    self.check_tail(&r);
                    break;
                }
                Peek::Reserved => {
                    self.check_tail(&r);
                    self.check_stuck(&r, now);
                    break;
                }
                Peek::Garbage => {
                    stats::inc(&self.counters().malformed_dropped);
                    tracing::debug!(pos = self.head, "shm: garbage in a ring slot; dropped");
                    self.advance(&r);
                    n += 1;
                }
                Peek::Ready(st, meta) => match self.consume(&r, st, &meta) {
                    Consumed::Advance => {
                        self.advance(&r);
                        n += 1;
                    }
                    Consumed::Again => {
                        again += 1;
                        if again > 4 {
                            break;
                        }
                    }
                    Consumed::Blocked => break,
                },
            }
            if n == budget {
                more = true;
            }
        }
        // The header's head word (informational) is written by the header check, not here: it
        // shares a cache line with the tail every producer reserves on.
        self.ring_acked();
        more
    }

    /// Resets a tail more than a ring ahead of the head (garbage, or a producer's wild CAS), so
    /// that producers are not stuck seeing a full ring. Only looked at when the head slot is not
    /// ready: while datagrams flow, the tail's cache line (which every producer writes) is not
    /// read by the consumer at all.
    fn check_tail(&mut self, r: &Ring<'_>) {
        if let Some(t) = r.tail() {
            let tail = t.load(Ordering::Acquire);
            if tail.wrapping_sub(self.head) > u64::from(r.g.slots) {
                stats::inc(&self.counters().malformed_dropped);
                tracing::debug!(tail, head = self.head, "shm: ring tail out of range; reset");
                let _ = t.compare_exchange(tail, self.head, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn advance(&mut self, r: &Ring<'_>) {
        r.free(self.head);
        self.head = self.head.wrapping_add(1);
        self.stuck = None;
    }

    /// A producer reserved the head slot and has not published it: if that lasts, check that
    /// the producer still lives, and skip the slot of a dead one.
    pub(super) fn check_stuck(&mut self, r: &Ring<'_>, now: Instant) {
        let since = match self.stuck {
            Some((p, since)) if p == self.head => since,
            _ => {
                self.stuck = Some((self.head, now));
                self.next_timer = min_opt(self.next_timer, Some(now + STUCK_CHECK));
                return;
            }
        };
        let waited = now.saturating_duration_since(since);
        if waited < STUCK_CHECK {
            self.next_timer = min_opt(self.next_timer, Some(since + STUCK_CHECK));
            return;
        }
        let writer = r.writer(self.head);
        let gone = match u16::try_from(writer) {
            Ok(q) if q != 0 => match segment::open_peer(&self.dev.dir, self.dev.uid, q) {
                Err(OpenError::Gone) => true,
                Ok(p) => p.liveness() != Liveness::Alive,
                Err(_) => false,
            },
            _ => false,
        };
        if gone || waited >= self.dev.cfg.unresponsive_timeout {
            stats::inc(&self.counters().malformed_dropped);
            tracing::debug!(
                pos = self.head,
                writer,
                "shm: skipped a slot its writer never published"
            );
            self.advance(r);
        } else {
            self.next_timer = min_opt(self.next_timer, Some(now + STUCK_CHECK));
        }
    }

    /// Handles the published slot at the head.
    pub(super) fn consume(&mut self, r: &Ring<'_>, st: u8, meta: &Meta) -> Consumed {
        let head = self.head;
        if st == ST_CANCELLED {
            return Consumed::Advance;
        }
        let srd = self.qp_type == QpType::Srd;
        let valid = (st == ST_PUBLISHED || st == ST_RNR)
            && (meta.flags & F_SRD != 0) == srd
            && meta.len <= r.g.mtu
            && meta.len as usize <= self.dev.cfg.mtu
            && (1..=u32::from(u16::MAX)).contains(&meta.writer);
        if !valid {
            stats::inc(&self.counters().malformed_dropped);
            tracing::debug!(pos = head, st, ?meta, "shm: malformed slot dropped");
            return Consumed::Advance;
        }
        if meta.qkey != self.addr.qkey {
            stats::inc(&self.counters().stale_dropped);
            tracing::trace!(qkey = meta.qkey, "shm: datagram with a stale QKEY dropped");
            return Consumed::Advance;
        }
        if srd && meta.flags & F_RDMA != 0 {
            return self.consume_rdma(r, st, meta);
        }
        if self.recvs.is_empty() {
            if !srd {
                stats::inc(&self.counters().rnr_events);
                tracing::trace!(
                    writer = meta.writer,
                    "shm: UD datagram dropped, no receive buffer"
                );
                return Consumed::Advance;
            }
            if st == ST_PUBLISHED {
                if !r.transition(head, ST_PUBLISHED, ST_RNR) {
                    return Consumed::Again;
                }
                stats::inc(&self.counters().rnr_events);
                self.ring_peer(meta.writer as u16);
            }
            self.mark_rnr_beyond(r);
            return Consumed::Blocked;
        }
        if srd && !r.transition(head, st, ST_TAKEN) {
            return Consumed::Again;
        }
        let Some((wr_id, mut buf)) = self.recvs.pop_front() else {
            return Consumed::Blocked;
        };
        let len = meta.len as usize;
        let cap = buf.capacity();
        buf.clear();
        let copied = r.read_data(head, len.min(cap), &mut buf);
        let status = if !copied {
            Status::LocalQpInternalError
        } else if len > cap {
            Status::LocalBadLength
        } else {
            stats::inc(&self.counters().rx_pkts);
            stats::add(&self.counters().rx_bytes, len as u64);
            Status::Success
        };
        self.complete(DeviceCompletion {
            wr_id,
            status,
            opcode: Opcode::Recv,
            byte_len: len,
            src: Some(Source {
                gid: self.dev.gid,
                qpn: meta.writer as u16,
            }),
            imm: (meta.flags & F_IMM != 0).then_some(meta.imm),
            buf: Some(buf),
        });
        if srd {
            let code = match status {
                Status::Success => Status::Success,
                Status::LocalBadLength => Status::RemoteBadLength,
                _ => Status::RemoteBadStatus,
            };
            self.ack_sender(meta.writer, meta.src_qkey, meta.token, code.code());
        }
        Consumed::Advance
    }

    /// With no receive buffer, marks the published SRD slots behind the head RNR too, so that
    /// their senders start counting retries.
    pub(super) fn mark_rnr_beyond(&mut self, r: &Ring<'_>) {
        let Some(tail) = r.tail().map(|t| t.load(Ordering::Acquire)) else {
            return;
        };
        let limit = tail.min(self.head.wrapping_add(u64::from(r.g.slots)));
        let mut p = self.rnr_marked.max(self.head.wrapping_add(1));
        while p < limit {
            if !r.is_published(p) {
                break;
            }
            if r.state(p) == Some((ring::tag(p), ST_PUBLISHED))
                && r.transition(p, ST_PUBLISHED, ST_RNR)
            {
                stats::inc(&self.counters().rnr_events);
                if let Ok(q) = u16::try_from(r.writer(p)) {
                    self.ring_peer(q);
                }
            }
            p += 1;
        }
        self.rnr_marked = p;
    }

    /// An RDMA message at the head (`device::soft_rdma`): placed, answered or refused now, or
    /// receiver-not-ready (no buffer for its immediate data, or the region is locked).
    fn consume_rdma(&mut self, r: &Ring<'_>, st: u8, meta: &Meta) -> Consumed {
        let head = self.head;
        let mut data = BytesMut::with_capacity(meta.len as usize);
        if !r.read_data(head, meta.len as usize, &mut data) {
            stats::inc(&self.counters().malformed_dropped);
            return Consumed::Advance;
        }
        let src = Src {
            source: Source {
                gid: self.dev.gid,
                qpn: meta.writer as u16,
            },
            sock: None,
        };
        let imm = (meta.flags & F_IMM != 0).then_some(meta.imm);
        let code = match self.deliver_rdma(src, meta.src_qkey, imm, &data) {
            Served::NotReady => {
                if st == ST_PUBLISHED {
                    if !r.transition(head, ST_PUBLISHED, ST_RNR) {
                        return Consumed::Again;
                    }
                    stats::inc(&self.counters().rnr_events);
                    self.ring_peer(meta.writer as u16);
                }
                return Consumed::Blocked;
            }
            Served::Ok => Status::Success,
            Served::Denied => Status::RemoteBadAddress,
            Served::NoAh => Status::UnknownPeer,
        };
        // The sender may have cancelled it meanwhile (its deadline): nothing to acknowledge.
        if r.transition(head, st, ST_TAKEN) {
            self.ack_sender(meta.writer, meta.src_qkey, meta.token, code.code());
        }
        Consumed::Advance
    }
}
