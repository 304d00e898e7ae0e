//! Peers and the send side of a queue pair: mapping destinations, publishing datagrams,
//! the backlog of sends waiting for room, acknowledgements, RNR retries and dead-peer checks.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::super::ring::{
    self, ACK_PENDING, F_IMM, F_SRD, Meta, Ring, ST_CANCELLED, ST_PUBLISHED, ST_RNR,
};
use super::super::segment::{self, Liveness, OpenError};
use super::{
    BACKLOG_RETRY, Inflight, LIVENESS_INTERVAL, MAX_IDLE_PEERS, Peer, Pending, RNR_INFINITE, Sent,
    State, min_opt,
};
use crate::addr::RawAddr;
use crate::device::{QpType, SendWr, Status};
use crate::error::{Error, ErrorKind, Result};
use crate::stats;

impl State {
    // ---- peers ------------------------------------------------------------------------------

    /// The mapped segment of `qpn`, opened (again) when not cached or when `fresh`.
    pub(super) fn peer(
        &mut self,
        qpn: u16,
        fresh: bool,
    ) -> std::result::Result<&mut Peer, OpenError> {
        // Sends in flight keep their mapping until they complete (a liveness check fails them
        // when its owner closed or died); only then is the QPN looked up again.
        if fresh && self.peers.get(&qpn).is_some_and(|p| p.outstanding == 0) {
            self.peers.remove(&qpn);
        }
        if !self.peers.contains_key(&qpn) {
            let seg = segment::open_peer(&self.dev.dir, self.dev.uid, qpn)?;
            if self.peers.len() >= MAX_IDLE_PEERS {
                self.peers.retain(|_, p| p.outstanding > 0);
            }
            self.peers.insert(
                qpn,
                Peer {
                    seg,
                    outstanding: 0,
                    next_check: Instant::now(),
                    cma: None,
                },
            );
        }
        self.peers
            .get_mut(&qpn)
            .ok_or(OpenError::Malformed("peer vanished"))
    }

    /// The usable segment of `dest` for a send, or the status the send completes with.
    pub(super) fn peer_for_send(&mut self, dest: &RawAddr) -> std::result::Result<(), Status> {
        let me = self.qp_type;
        for fresh in [false, true] {
            let p = match self.peer(dest.qpn, fresh) {
                Ok(p) => p,
                Err(OpenError::Gone) => return Err(Status::UnresponsiveRemote),
                Err(OpenError::Malformed(why)) => {
                    stats::inc(&self.counters().malformed_dropped);
                    tracing::debug!(dest = %dest, why, "shm: unusable destination segment");
                    return Err(Status::UnresponsiveRemote);
                }
                Err(OpenError::Io(e)) => {
                    tracing::debug!(dest = %dest, error = %e, "shm: cannot open destination");
                    return Err(Status::UnreachableRemote);
                }
            };
            let ring = Ring::new(&p.seg.map, &p.seg.geo);
            let closed = ring.closed();
            let peer_qkey = p.seg.id.qkey;
            let qkey_ok = peer_qkey == dest.qkey;
            let type_ok = p.seg.geo.qp_type == me;
            if !closed && qkey_ok {
                if !type_ok {
                    stats::inc(&self.counters().malformed_dropped);
                    tracing::debug!(dest = %dest, "shm: destination of the other queue pair type");
                    return Err(Status::UnresponsiveRemote);
                }
                return Ok(());
            }
            if fresh {
                if !qkey_ok {
                    stats::inc(&self.dev.counters.stale_dropped);
                    tracing::trace!(dest = %dest, qkey = peer_qkey, "shm: stale QKEY");
                }
                return Err(Status::UnresponsiveRemote);
            }
        }
        Err(Status::UnresponsiveRemote)
    }

    /// Rings the doorbell of queue pair `qpn` (a sender we acknowledged or refused).
    pub(super) fn ring_peer(&mut self, qpn: u16) {
        if let Ok(p) = self.peer(qpn, false) {
            Ring::new(&p.seg.map, &p.seg.geo).ring_bell();
        }
    }

    /// Writes the final status of an SRD datagram into its sender's acknowledgement table.
    pub(super) fn ack_sender(&mut self, writer: u32, src_qkey: u32, token: u64, code: u8) {
        let Ok(qpn) = u16::try_from(writer) else {
            return;
        };
        for fresh in [false, true] {
            let Ok(p) = self.peer(qpn, fresh) else {
                return;
            };
            if p.seg.id.qkey != src_qkey {
                continue;
            }
            let r = Ring::new(&p.seg.map, &p.seg.geo);
            r.complete_ack(token as u32, (token >> 32) as u32, code);
            // One doorbell per sender and drain (`ring_acked`), not one per datagram.
            if !self.to_ring.contains(&qpn) {
                self.to_ring.push(qpn);
            }
            return;
        }
    }

    /// Rings the doorbells of the senders the last drain acknowledged.
    pub(super) fn ring_acked(&mut self) {
        while let Some(qpn) = self.to_ring.pop() {
            self.ring_peer(qpn);
        }
    }

    // ---- sending ----------------------------------------------------------------------------

    pub(super) fn try_send(&mut self, wr: &SendWr, now: Instant) -> Sent {
        let len = wr.len();
        let srd = self.qp_type == QpType::Srd;
        if wr.dest.gid != self.dev.gid {
            tracing::debug!(dest = %wr.dest, "shm: destination on another host or directory");
            return Sent::Done(Status::UnreachableRemote, 0);
        }
        // A UD datagram that cannot be delivered is lost on the "wire": the send succeeds.
        let lost = |s: Status| {
            if srd {
                Sent::Done(s, 0)
            } else {
                Sent::Done(Status::Success, len)
            }
        };
        if let Err(s) = self.peer_for_send(&wr.dest) {
            return lost(s);
        }
        let Some(peer) = self.peers.get(&wr.dest.qpn) else {
            return lost(Status::UnresponsiveRemote);
        };
        let (m, g) = (peer.seg.map.clone(), peer.seg.geo);
        if len > g.mtu as usize {
            stats::inc(&self.counters().malformed_dropped);
            tracing::debug!(dest = %wr.dest, len, mtu = g.mtu, "shm: datagram larger than the receiver's slots");
            return lost(Status::RemoteBadLength);
        }
        let ring = Ring::new(&m, &g);
        let imm = wr.imm.unwrap_or(0);
        let mut flags = if wr.imm.is_some() { F_IMM } else { 0 };
        if wr.wr_id & crate::device::soft_rdma::INTERNAL != 0 {
            flags |= super::super::ring::F_RDMA;
        }
        let mut meta = Meta {
            writer: u32::from(self.addr.qpn),
            len: len as u32,
            qkey: wr.dest.qkey,
            imm,
            flags,
            src_qkey: self.addr.qkey,
            token: 0,
        };
        if !srd {
            let Some(pos) = ring.reserve(meta.writer) else {
                stats::inc(&self.counters().rnr_events);
                tracing::trace!(dest = %wr.dest, "shm: UD datagram dropped, ring full");
                return Sent::Done(Status::Success, len);
            };
            ring.publish(pos, &meta, &wr.hdr, &wr.payload);
            ring.ring_bell_if_asleep();
            stats::inc(&self.counters().tx_pkts);
            stats::add(&self.counters().tx_bytes, len as u64);
            return Sent::Done(Status::Success, len);
        }
        let Some(idx) = self.free_acks.pop() else {
            return Sent::Full;
        };
        let Some(pos) = ring.reserve(meta.writer) else {
            self.free_acks.push(idx);
            return Sent::Full;
        };
        let i = idx as usize;
        let gen_ = self.gens[i].wrapping_add(1);
        self.gens[i] = gen_;
        let own = Ring::new(&self.own.map, &self.own.geo);
        if let Some(w) = own.ack(idx) {
            w.store(ring::ack_word(gen_, ACK_PENDING), Ordering::Release);
        }
        flags |= F_SRD;
        meta.flags = flags;
        meta.token = u64::from(idx) | (u64::from(gen_) << 32);
        ring.publish(pos, &meta, &wr.hdr, &wr.payload);
        ring.ring_bell_if_asleep();
        stats::inc(&self.counters().tx_pkts);
        stats::add(&self.counters().tx_bytes, len as u64);
        self.inflight[i] = Some(Inflight {
            wr_id: wr.wr_id,
            qpn: wr.dest.qpn,
            pos,
            len,
            gen_,
            rnr_count: 0,
            next_rnr: None,
            deadline: now + self.dev.cfg.unresponsive_timeout,
        });
        self.n_inflight += 1;
        self.inflight_hi = self.inflight_hi.max(i + 1);
        if let Some(p) = self.peers.get_mut(&wr.dest.qpn) {
            if p.outstanding == 0 {
                p.next_check = now + LIVENESS_INTERVAL;
            }
            p.outstanding += 1;
        }
        self.next_timer = min_opt(self.next_timer, Some(now + LIVENESS_INTERVAL));
        Sent::Inflight
    }

    pub(super) fn post_send(&mut self, wr: SendWr, now: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "post_send").with_detail("queue pair closed"));
        }
        let len = wr.len();
        let mtu = self.dev.cfg.mtu;
        if len > mtu {
            return Err(Error::new(ErrorKind::MsgSize, "post_send")
                .with_detail(format!("{len} bytes > MTU {mtu}")));
        }
        self.slots.take_send("post_send")?;
        if !self.backlog.is_empty() {
            self.backlog.push_back(Pending { wr, since: now });
            self.run_backlog(now);
            return Ok(());
        }
        self.send_or_queue(wr, now);
        Ok(())
    }

    /// Sends `wr` now, or, when its ring is full, queues it in the backlog and arms the retry.
    pub(super) fn send_or_queue(&mut self, wr: SendWr, now: Instant) {
        match self.try_send(&wr, now) {
            Sent::Done(s, n) => self.complete_send(wr.wr_id, s, n),
            Sent::Inflight => {}
            Sent::Full => {
                self.backlog.push_back(Pending { wr, since: now });
                self.next_timer = min_opt(self.next_timer, Some(now + BACKLOG_RETRY));
            }
        }
    }

    /// Tries the sends waiting for room again, in order (per destination).
    pub(super) fn run_backlog(&mut self, now: Instant) {
        let mut blocked: Vec<u16> = Vec::new();
        for _ in 0..self.backlog.len() {
            let Some(p) = self.backlog.pop_front() else {
                break;
            };
            if blocked.contains(&p.wr.dest.qpn) {
                self.backlog.push_back(p);
                continue;
            }
            if now.saturating_duration_since(p.since) >= self.dev.cfg.unresponsive_timeout {
                tracing::debug!(dest = %p.wr.dest, "shm: no room in the destination ring in time");
                self.complete_send(p.wr.wr_id, Status::UnresponsiveRemote, 0);
                continue;
            }
            match self.try_send(&p.wr, now) {
                Sent::Done(s, n) => self.complete_send(p.wr.wr_id, s, n),
                Sent::Inflight => {}
                Sent::Full => {
                    blocked.push(p.wr.dest.qpn);
                    self.backlog.push_back(p);
                }
            }
        }
    }

    /// Completes in-flight send `i` (acknowledgement entry) with `status`.
    pub(super) fn finish(&mut self, i: usize, status: Status) {
        let Some(inf) = self.inflight.get_mut(i).and_then(Option::take) else {
            return;
        };
        self.n_inflight -= 1;
        self.free_acks.push(i as u32);
        if let Some(p) = self.peers.get_mut(&inf.qpn) {
            p.outstanding = p.outstanding.saturating_sub(1);
        }
        let n = if status.is_ok() { inf.len } else { 0 };
        self.complete_send(inf.wr_id, status, n);
    }

    /// Looks at every in-flight send: acknowledged, refused (RNR), or overdue.
    pub(super) fn check_sends(&mut self, now: Instant) {
        let own_map = self.own.map.clone();
        let own_geo = self.own.geo;
        let own = Ring::new(&own_map, &own_geo);
        let interval = self.dev.cfg.rnr_retry_interval;
        let unresponsive = self.dev.cfg.unresponsive_timeout;
        let mut timer = None;
        let mut hi = 0;
        for i in 0..self.inflight_hi.min(self.inflight.len()) {
            let Some(inf) = self.inflight[i].as_ref() else {
                continue;
            };
            let (gen_, qpn, pos) = (inf.gen_, inf.qpn, inf.pos);
            let w = own.ack(i as u32).map_or(0, |w| w.load(Ordering::Acquire));
            if (w >> 8) as u32 == gen_ && (w & 0xff) as u8 != ACK_PENDING {
                let status = Status::from_code((w & 0xff) as u8).unwrap_or_else(|| {
                    stats::inc(&self.dev.counters.malformed_dropped);
                    Status::RemoteBadStatus
                });
                self.finish(i, status);
                continue;
            }
            let Some(peer) = self.peers.get(&qpn) else {
                self.finish(i, Status::UnresponsiveRemote);
                continue;
            };
            let m = peer.seg.map.clone();
            let g = peer.seg.geo;
            let r = Ring::new(&m, &g);
            let state = r
                .state(pos)
                .filter(|(t, _)| *t == ring::tag(pos))
                .map(|s| s.1);
            let rnr_retry = self.rnr_retry;
            let Some(inf) = self.inflight[i].as_mut() else {
                continue;
            };
            match state {
                Some(ST_RNR) => {
                    if inf.next_rnr.is_none_or(|t| now >= t) {
                        inf.rnr_count += 1;
                        stats::inc(&self.dev.counters.rnr_naks_received);
                        if rnr_retry != RNR_INFINITE
                            && inf.rnr_count > u32::from(rnr_retry)
                            && r.transition(pos, ST_RNR, ST_CANCELLED)
                        {
                            self.finish(i, Status::RnrRetryExceeded);
                            continue;
                        }
                        inf.next_rnr = Some(now + interval);
                    }
                    inf.deadline = now + unresponsive;
                    timer = min_opt(timer, inf.next_rnr);
                }
                // Not taken in time: take it back (unless the receiver takes it right now).
                Some(ST_PUBLISHED)
                    if now >= inf.deadline && r.transition(pos, ST_PUBLISHED, ST_CANCELLED) =>
                {
                    self.finish(i, Status::UnresponsiveRemote);
                    continue;
                }
                Some(ST_PUBLISHED) => {}
                // Taken (or consumed, the acknowledgement on its way): delivered, as far as SRD
                // goes; only its final status is awaited. A receiver that dies meanwhile fails it
                // (`check_peers`); one that stays alive but never writes the acknowledgement (a
                // bug, or a hostile process of ours) gets a second deadline, after which the send
                // completes successfully: a delivered send never completes with an error.
                _ if now >= inf.deadline + unresponsive => {
                    stats::inc(&self.dev.counters.malformed_dropped);
                    tracing::debug!(
                        qpn,
                        "shm: a taken send was never acknowledged; completed as delivered"
                    );
                    self.finish(i, Status::Success);
                    continue;
                }
                _ => {}
            }
            if let Some(inf) = self.inflight[i].as_ref() {
                // Past its deadline only a taken send stays: its second deadline is next.
                let next = if now >= inf.deadline {
                    inf.deadline + unresponsive
                } else {
                    inf.deadline
                };
                timer = min_opt(timer, Some(next));
                hi = i + 1;
            }
        }
        self.inflight_hi = hi;
        self.next_timer = min_opt(self.next_timer, timer);
    }

    /// Checks the owners of peers we wait on; a closed or dead one fails its sends.
    pub(super) fn check_peers(&mut self, now: Instant) {
        let mut gone = Vec::new();
        let mut timer = None;
        for (qpn, p) in self.peers.iter_mut() {
            if p.outstanding == 0 {
                continue;
            }
            if now >= p.next_check {
                p.next_check = now + LIVENESS_INTERVAL;
                let l = p.seg.liveness();
                if l != Liveness::Alive {
                    tracing::debug!(qpn, pid = p.seg.id.pid, liveness = ?l, "shm: peer gone");
                    gone.push(*qpn);
                    continue;
                }
            }
            timer = min_opt(timer, Some(p.next_check));
        }
        self.next_timer = min_opt(self.next_timer, timer);
        if !gone.is_empty() {
            // A peer that acknowledged and then exited (a server that got its last message):
            // acknowledgements it wrote before it went count, so read them again first.
            self.check_sends(now);
        }
        for qpn in gone {
            for i in 0..self.inflight_hi.min(self.inflight.len()) {
                if self.inflight[i].as_ref().is_some_and(|f| f.qpn == qpn) {
                    self.finish(i, Status::UnresponsiveRemote);
                }
            }
            self.peers.remove(&qpn);
        }
    }
}
