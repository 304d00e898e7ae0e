//! An shm queue pair: its own segment (receive ring and acknowledgement table), the peers it has
//! mapped, its state behind one lock, its background "NIC" thread and the [`QueuePair`] handle.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use parking_lot::Mutex;

use super::DevShared;
use super::map::{self, Mapping};
use super::ring::{
    self, ACK_PENDING, F_IMM, F_SRD, Meta, Peek, Ring, ST_CANCELLED, ST_PUBLISHED, ST_RNR, ST_TAKEN,
};
use super::segment::{self, Geometry, Liveness, OpenError, OwnSegment, PeerSegment};
use crate::addr::RawAddr;
use crate::device::{
    DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, SendWr, Source, Status, random_qkey,
};
use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;
use crate::stats::{self, DeviceCounters};

/// Ring slots one application `poll` consumes at most.
const APP_BUDGET: usize = 64;
/// Ring slots the NIC thread consumes before it looks at its timers again.
const NIC_BUDGET: usize = 1024;
/// How often the owner of a peer with outstanding sends is checked for life.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(10);
/// Longest sleep of the NIC thread (a bound on a lost wake-up, e.g. from garbage in the header).
const IDLE_WAIT: Duration = Duration::from_millis(20);
/// How long a reserved, unpublished slot at the head may wait before its writer is checked.
const STUCK_CHECK: Duration = Duration::from_millis(20);
/// How often the owner checks that its segment header is intact.
const HEADER_CHECK: Duration = Duration::from_millis(100);
/// How often sends waiting for room in a full ring try again.
const BACKLOG_RETRY: Duration = Duration::from_micros(200);
/// Peer segments kept mapped without outstanding sends, at most.
const MAX_IDLE_PEERS: usize = 1024;
/// RNR retry count that means "retry forever".
const RNR_INFINITE: u8 = 7;

/// A peer's mapped segment.
struct Peer {
    seg: PeerSegment,
    /// SRD sends in flight to it.
    outstanding: usize,
    /// Next liveness check (while sends are outstanding).
    next_check: Instant,
}

/// An SRD send published in a peer's ring, waiting for its acknowledgement.
struct Inflight {
    wr_id: u64,
    qpn: u16,
    pos: u64,
    len: usize,
    gen_: u32,
    rnr_count: u32,
    next_rnr: Option<Instant>,
    deadline: Instant,
}

/// A send waiting for room in its destination's ring.
struct Pending {
    wr: SendWr,
    since: Instant,
}

/// What became of one attempt to send.
enum Sent {
    /// Completed at once with this status and byte count.
    Done(Status, usize),
    /// Published; the acknowledgement will complete it.
    Inflight,
    /// The destination ring is full.
    Full,
}

/// What the consumer did with the slot at its head.
enum Consumed {
    /// Done with it: advance.
    Advance,
    /// Look at the same slot again (its state changed under us).
    Again,
    /// Blocked (SRD datagram, no receive buffer).
    Blocked,
}

/// Everything behind the queue pair's lock.
pub(super) struct State {
    dev: Arc<DevShared>,
    own: OwnSegment,
    addr: RawAddr,
    qp_type: QpType,
    rnr_retry: u8,
    closed: bool,
    send_depth: usize,
    recv_depth: usize,
    send_outstanding: usize,
    recv_outstanding: usize,
    recvs: VecDeque<(u64, BytesMut)>,
    cq: VecDeque<DeviceCompletion>,
    new_comps: bool,
    /// The consumer's next ring position.
    head: u64,
    /// Ring positions below this were already marked RNR.
    rnr_marked: u64,
    /// A reserved, unpublished head slot and since when.
    stuck: Option<(u64, Instant)>,
    peers: HashMap<u16, Peer>,
    /// SRD sends in flight, indexed by acknowledgement entry.
    inflight: Vec<Option<Inflight>>,
    /// Generation of each acknowledgement entry.
    gens: Vec<u32>,
    free_acks: Vec<u32>,
    n_inflight: usize,
    backlog: VecDeque<Pending>,
    /// The doorbell value of the last scan of the in-flight sends.
    last_bell: u32,
    /// Earliest timer (RNR retry, liveness check, deadline, backlog retry, header check).
    next_timer: Option<Instant>,
    next_header_check: Instant,
}

fn min_opt(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

impl State {
    fn counters(&self) -> &DeviceCounters {
        &self.dev.counters
    }

    fn complete(&mut self, c: DeviceCompletion) {
        self.cq.push_back(c);
        self.new_comps = true;
    }

    fn complete_send(&mut self, wr_id: u64, status: Status, n: usize) {
        if !status.is_ok() {
            stats::inc(&self.counters().send_errors);
        }
        self.complete(DeviceCompletion::new(wr_id, status, Opcode::Send, n));
    }

    // ---- peers ------------------------------------------------------------------------------

    /// The mapped segment of `qpn`, opened (again) when not cached or when `fresh`.
    fn peer(&mut self, qpn: u16, fresh: bool) -> std::result::Result<&mut Peer, OpenError> {
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
                },
            );
        }
        self.peers
            .get_mut(&qpn)
            .ok_or(OpenError::Malformed("peer vanished"))
    }

    /// The usable segment of `dest` for a send, or the status the send completes with.
    fn peer_for_send(&mut self, dest: &RawAddr) -> std::result::Result<(), Status> {
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
    fn ring_peer(&mut self, qpn: u16) {
        if let Ok(p) = self.peer(qpn, false) {
            Ring::new(&p.seg.map, &p.seg.geo).ring_bell();
        }
    }

    /// Writes the final status of an SRD datagram into its sender's acknowledgement table.
    fn ack_sender(&mut self, writer: u32, src_qkey: u32, token: u64, code: u8) {
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
            r.ring_bell();
            return;
        }
    }

    // ---- sending ----------------------------------------------------------------------------

    fn try_send(&mut self, wr: &SendWr, now: Instant) -> Sent {
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
            ring.ring_bell();
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
        ring.ring_bell();
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
        if let Some(p) = self.peers.get_mut(&wr.dest.qpn) {
            if p.outstanding == 0 {
                p.next_check = now + LIVENESS_INTERVAL;
            }
            p.outstanding += 1;
        }
        self.next_timer = min_opt(self.next_timer, Some(now + LIVENESS_INTERVAL));
        Sent::Inflight
    }

    fn post_send(&mut self, wr: SendWr, now: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "post_send").with_detail("queue pair closed"));
        }
        let len = wr.len();
        let mtu = self.dev.cfg.mtu;
        if len > mtu {
            return Err(Error::new(ErrorKind::MsgSize, "post_send")
                .with_detail(format!("{len} bytes > MTU {mtu}")));
        }
        if self.send_outstanding >= self.send_depth {
            return Err(
                Error::new(ErrorKind::Again, "post_send").with_detail(format!(
                    "send queue full ({} work requests)",
                    self.send_depth
                )),
            );
        }
        self.send_outstanding += 1;
        if !self.backlog.is_empty() {
            self.backlog.push_back(Pending { wr, since: now });
            self.run_backlog(now);
            return Ok(());
        }
        match self.try_send(&wr, now) {
            Sent::Done(s, n) => self.complete_send(wr.wr_id, s, n),
            Sent::Inflight => {}
            Sent::Full => {
                self.backlog.push_back(Pending { wr, since: now });
                self.next_timer = min_opt(self.next_timer, Some(now + BACKLOG_RETRY));
            }
        }
        Ok(())
    }

    /// Tries the sends waiting for room again, in order (per destination).
    fn run_backlog(&mut self, now: Instant) {
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
    fn finish(&mut self, i: usize, status: Status) {
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
    fn check_sends(&mut self, now: Instant) {
        let own_map = self.own.map.clone();
        let own_geo = self.own.geo;
        let own = Ring::new(&own_map, &own_geo);
        let interval = self.dev.cfg.rnr_retry_interval;
        let unresponsive = self.dev.cfg.unresponsive_timeout;
        let mut timer = None;
        for i in 0..self.inflight.len() {
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
                // Taken (or consumed, the acknowledgement on its way): only the deadline.
                _ if now >= inf.deadline => {
                    self.finish(i, Status::UnresponsiveRemote);
                    continue;
                }
                _ => {}
            }
            if let Some(inf) = self.inflight[i].as_ref() {
                timer = min_opt(timer, Some(inf.deadline));
            }
        }
        self.next_timer = min_opt(self.next_timer, timer);
    }

    /// Checks the owners of peers we wait on; a closed or dead one fails its sends.
    fn check_peers(&mut self, now: Instant) {
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
        for qpn in gone {
            for i in 0..self.inflight.len() {
                if self.inflight[i].as_ref().is_some_and(|f| f.qpn == qpn) {
                    self.finish(i, Status::UnresponsiveRemote);
                }
            }
            self.peers.remove(&qpn);
        }
    }

    // ---- receiving --------------------------------------------------------------------------

    /// Consumes up to `budget` slots of the own ring; true when more may be waiting.
    fn drain(&mut self, now: Instant, budget: usize) -> bool {
        let m = self.own.map.clone();
        let g = self.own.geo;
        let r = Ring::new(&m, &g);
        if let Some(t) = r.tail() {
            let tail = t.load(Ordering::Acquire);
            if tail.wrapping_sub(self.head) > u64::from(g.slots) {
                stats::inc(&self.counters().malformed_dropped);
                tracing::debug!(tail, head = self.head, "shm: ring tail out of range; reset");
                let _ = t.compare_exchange(tail, self.head, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
        let mut n = 0;
        let mut more = false;
        let mut again = 0;
        while n < budget {
            match r.peek(self.head) {
                Peek::Empty => {
                    self.stuck = None;
                    break;
                }
                Peek::Reserved => {
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
        if let Some(w) = m.u64(segment::H_HEAD) {
            w.store(self.head, Ordering::Relaxed);
        }
        more
    }

    fn advance(&mut self, r: &Ring<'_>) {
        r.free(self.head);
        self.head = self.head.wrapping_add(1);
        self.stuck = None;
    }

    /// A producer reserved the head slot and has not published it: if that lasts, check that
    /// the producer still lives, and skip the slot of a dead one.
    fn check_stuck(&mut self, r: &Ring<'_>, now: Instant) {
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
    fn consume(&mut self, r: &Ring<'_>, st: u8, meta: &Meta) -> Consumed {
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
    fn mark_rnr_beyond(&mut self, r: &Ring<'_>) {
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

    // ---- progress ---------------------------------------------------------------------------

    /// One pass: the ring, the in-flight sends, the peers, the backlog, the header. True when
    /// more ring slots may be waiting.
    fn progress(&mut self, now: Instant, budget: usize) -> bool {
        if self.closed {
            return false;
        }
        let more = self.drain(now, budget);
        let bell = Ring::new(&self.own.map, &self.own.geo)
            .bell()
            .map_or(0, |(b, _)| b.load(Ordering::SeqCst));
        let due = self.next_timer.is_some_and(|t| now >= t);
        if due {
            self.next_timer = None;
        }
        if bell != self.last_bell || due {
            self.last_bell = bell;
            if self.n_inflight > 0 {
                self.check_sends(now);
                self.check_peers(now);
            }
            if !self.backlog.is_empty() {
                self.run_backlog(now);
                if !self.backlog.is_empty() {
                    self.next_timer = min_opt(self.next_timer, Some(now + BACKLOG_RETRY));
                }
            }
        }
        if now >= self.next_header_check {
            self.next_header_check = now + HEADER_CHECK;
            let m = &self.own.map;
            let intact = segment::header_intact(m, &self.own.geo, &self.own.id)
                && !Ring::new(m, &self.own.geo).closed();
            if !intact {
                stats::inc(&self.dev.counters.malformed_dropped);
                tracing::warn!(path = %self.own.path.display(), "shm: own segment header overwritten; restored");
                segment::write_header(m, &self.own.geo, &self.own.id);
                if let Some(w) = m.u32(segment::H_CLOSED) {
                    w.store(0, Ordering::Release);
                }
            }
        }
        self.next_timer = min_opt(self.next_timer, Some(self.next_header_check));
        more
    }

    /// Completes every outstanding work request (acknowledged sends with their status, the
    /// rest `Flushed`) and hands receive buffers back.
    fn flush(&mut self) {
        let own_map = self.own.map.clone();
        let own_geo = self.own.geo;
        let own = Ring::new(&own_map, &own_geo);
        for i in 0..self.inflight.len() {
            let Some(inf) = self.inflight[i].as_ref() else {
                continue;
            };
            let w = own.ack(i as u32).map_or(0, |w| w.load(Ordering::Acquire));
            let acked = (w >> 8) as u32 == inf.gen_ && (w & 0xff) as u8 != ACK_PENDING;
            let status = if acked {
                Status::from_code((w & 0xff) as u8).unwrap_or(Status::RemoteBadStatus)
            } else {
                // Take the datagram back where the receiver has not taken it yet.
                if let Some(p) = self.peers.get(&inf.qpn) {
                    let r = Ring::new(&p.seg.map, &p.seg.geo);
                    let _ = r.transition(inf.pos, ST_PUBLISHED, ST_CANCELLED)
                        || r.transition(inf.pos, ST_RNR, ST_CANCELLED);
                }
                Status::Flushed
            };
            self.finish(i, status);
        }
        while let Some(p) = self.backlog.pop_front() {
            self.complete_send(p.wr.wr_id, Status::Flushed, 0);
        }
        while let Some((wr_id, buf)) = self.recvs.pop_front() {
            let mut c = DeviceCompletion::new(wr_id, Status::Flushed, Opcode::Recv, 0);
            c.buf = Some(buf);
            self.complete(c);
        }
    }
}

/// What the application handle and the NIC thread share.
pub(super) struct Shared {
    state: Mutex<State>,
    /// The own segment's mapping (for the doorbell, without the lock).
    map: Arc<Mapping>,
    geo: Geometry,
    stop: AtomicBool,
    notifier: Arc<Notifier>,
}

impl Shared {
    /// One progress pass; returns whether more is waiting and the next timer.
    fn progress(&self, budget: usize) -> (bool, Option<Instant>) {
        let mut st = self.state.lock();
        if st.closed {
            return (false, None);
        }
        let more = st.progress(Instant::now(), budget);
        let timer = st.next_timer;
        let notify = std::mem::take(&mut st.new_comps);
        drop(st);
        if notify {
            self.notifier.notify();
        }
        (more, timer)
    }

    fn after(&self, mut st: parking_lot::MutexGuard<'_, State>) {
        let notify = std::mem::take(&mut st.new_comps);
        drop(st);
        if notify {
            self.notifier.notify();
        }
    }

    fn wake_thread(&self) {
        Ring::new(&self.map, &self.geo).ring_bell();
    }
}

/// The background "NIC": drains the ring into posted buffers, completes acknowledged sends and
/// runs the timers; sleeps on the own doorbell (a futex) in between.
fn nic_thread(shared: Arc<Shared>) {
    let map = shared.map.clone();
    let geo = shared.geo;
    let ring = Ring::new(&map, &geo);
    let Some((bell, sleepers)) = ring.bell() else {
        return;
    };
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let b0 = bell.load(Ordering::SeqCst);
        let (more, timer) = shared.progress(NIC_BUDGET);
        if more {
            continue;
        }
        sleepers.fetch_add(1, Ordering::SeqCst);
        let b = bell.load(Ordering::SeqCst);
        if b == b0 && !shared.stop.load(Ordering::Acquire) {
            let wait = timer
                .map_or(IDLE_WAIT, |t| t.saturating_duration_since(Instant::now()))
                .min(IDLE_WAIT);
            if !wait.is_zero() {
                map::futex_wait(bell, b, wait);
            }
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A queue pair of the shm device.
pub(crate) struct ShmQp {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    addr: RawAddr,
    qp_type: QpType,
}

impl fmt::Debug for ShmQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmQp")
            .field("addr", &self.addr)
            .field("qp_type", &self.qp_type)
            .finish_non_exhaustive()
    }
}

impl ShmQp {
    pub(super) fn create(dev: &Arc<DevShared>, attr: QpAttr) -> Result<ShmQp> {
        let bad = |detail: String| {
            Error::new(ErrorKind::InvalidArgument, "create_qp").with_detail(detail)
        };
        if attr.send_depth == 0 || attr.recv_depth == 0 {
            return Err(bad(format!(
                "queue depths must be positive (send {}, recv {})",
                attr.send_depth, attr.recv_depth
            )));
        }
        if attr.rnr_retry > RNR_INFINITE {
            return Err(bad(format!(
                "rnr_retry {} outside 0..={RNR_INFINITE}",
                attr.rnr_retry
            )));
        }
        let cfg = &dev.cfg;
        let send_depth = attr.send_depth.min(cfg.max_send_wr);
        let recv_depth = attr.recv_depth.min(cfg.max_recv_wr);
        let acks = if attr.qp_type == QpType::Srd {
            send_depth
        } else {
            0
        };
        let geo = cfg
            .geometry(attr.qp_type, acks)
            .ok_or_else(|| bad("segment too large".into()))?;
        let qkey = attr.qkey.unwrap_or_else(random_qkey);
        let own = OwnSegment::create(&dev.dir, dev.uid, qkey, geo).map_err(|e| {
            let detail = format!(
                "cannot create a {}-byte segment in {}",
                geo.total,
                dev.dir.display()
            );
            let no_space = e.raw_os_error() == Some(libc::ENOSPC);
            let err = if no_space || e.kind() == io::ErrorKind::AddrInUse {
                Error::new(ErrorKind::NoMemory, "create_qp").with_source(e)
            } else {
                Error::io("create_qp", e)
            };
            err.with_detail(detail)
        })?;
        let addr = RawAddr::new(dev.gid, own.id.qpn, qkey);
        let map = own.map.clone();
        let now = Instant::now();
        let state = State {
            dev: dev.clone(),
            addr,
            qp_type: attr.qp_type,
            rnr_retry: attr.rnr_retry,
            closed: false,
            send_depth,
            recv_depth,
            send_outstanding: 0,
            recv_outstanding: 0,
            recvs: VecDeque::new(),
            cq: VecDeque::new(),
            new_comps: false,
            head: 0,
            rnr_marked: 0,
            stuck: None,
            peers: HashMap::new(),
            inflight: (0..acks).map(|_| None).collect(),
            gens: vec![0; acks],
            free_acks: (0..acks as u32).rev().collect(),
            n_inflight: 0,
            backlog: VecDeque::new(),
            last_bell: 0,
            next_timer: None,
            next_header_check: now + HEADER_CHECK,
            own,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            map,
            geo,
            stop: AtomicBool::new(false),
            notifier: attr.notifier,
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("efa-shm-{}", addr.qpn))
            .spawn(move || nic_thread(s2))
            .map_err(|e| Error::io("create_qp", e))?;
        tracing::debug!(%addr, qp_type = ?attr.qp_type, "shm: queue pair created");
        Ok(ShmQp {
            shared,
            thread: Some(thread),
            addr,
            qp_type: attr.qp_type,
        })
    }

    fn stop_thread(&mut self) {
        if let Some(t) = self.thread.take() {
            self.shared.stop.store(true, Ordering::Release);
            self.shared.wake_thread();
            let _ = t.join();
        }
    }
}

impl QueuePair for ShmQp {
    fn addr(&self) -> RawAddr {
        self.addr
    }

    fn qp_type(&self) -> QpType {
        self.qp_type
    }

    fn post_send(&mut self, wr: SendWr) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.post_send(wr, Instant::now())?;
        self.shared.after(st);
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "post_recv").with_detail("queue pair closed"));
        }
        if st.recv_outstanding >= st.recv_depth {
            return Err(
                Error::new(ErrorKind::Again, "post_recv").with_detail(format!(
                    "receive queue full ({} work requests)",
                    st.recv_depth
                )),
            );
        }
        st.recv_outstanding += 1;
        st.recvs.push_back((wr_id, buf));
        if st.recvs.len() == 1 {
            // A datagram may be waiting for a buffer (RNR): take it now.
            st.drain(Instant::now(), APP_BUDGET);
        }
        self.shared.after(st);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        self.shared.progress(APP_BUDGET);
        let mut st = self.shared.state.lock();
        let mut n = 0;
        while n < max {
            let Some(c) = st.cq.pop_front() else {
                break;
            };
            if c.opcode == Opcode::Send {
                st.send_outstanding = st.send_outstanding.saturating_sub(1);
            } else {
                st.recv_outstanding = st.recv_outstanding.saturating_sub(1);
            }
            out.push(c);
            n += 1;
        }
        n
    }

    fn close(&mut self) {
        {
            let mut st = self.shared.state.lock();
            if !st.closed {
                st.closed = true;
                Ring::new(&self.shared.map, &self.shared.geo).set_closed();
                st.flush();
                st.own.unlink();
                st.peers.clear();
                tracing::debug!(addr = %self.addr, "shm: queue pair closed");
            }
            st.new_comps = false;
        }
        self.stop_thread();
        self.shared.notifier.notify();
    }
}

impl Drop for ShmQp {
    fn drop(&mut self) {
        self.close();
    }
}
