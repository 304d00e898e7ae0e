//! Per-peer state: identification of the sender of a packet (raw address, connid, source),
//! the HANDSHAKE, RNR backoff and the failure of a peer.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

#[cfg(doc)]
use super::Engine;
use super::EngineConfig;
use super::types::{Owner, Pkt};
use super::util::{GenSlab, Hdr, Out, Timer, TimerTable, encode};
use crate::addr::{Gid, RawAddr};
use crate::device::{Source, Status};
use crate::fault::Rng;
use crate::proto::reorder::ReorderWindow;
use crate::proto::wire::{ExtraFeature, ExtraInfo, Handshake, IovList, Packet, ReqOpt, Sender};

/// Connids remembered per (GID, QPN) after their incarnation was replaced.
const RETIRED_PER_QP: usize = 8;

/// The engine's peers (a sub-state): the table by engine-chosen id (never reused), the ways to
/// find one ([`PeerIndex`]), the peers with packets to send (served in turn) and those in RNR
/// backoff, and the packets queued to them. Finding the sender of a packet, queueing, turns,
/// backoffs and the HANDSHAKE's bookkeeping are its methods; failing a peer's operations
/// touches every other sub-state and is the engine's (`Engine::fail_peer`).
#[derive(Debug, Default)]
pub(super) struct Peers {
    table: GenSlab<Peer>,
    index: PeerIndex,
    /// Peers with queued packets, served round-robin.
    ready: VecDeque<u64>,
    /// Peers in RNR backoff.
    backoff: Vec<u64>,
    /// Packets queued at peers, not handed out yet.
    queued: usize,
}

impl Peers {
    pub(super) fn get(&self, id: &u64) -> Option<&Peer> {
        self.table.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &u64) -> Option<&mut Peer> {
        self.table.get_mut(id)
    }

    pub(super) fn contains_key(&self, id: &u64) -> bool {
        self.table.contains_key(id)
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Peer> {
        self.table.values()
    }

    /// Adds `p`, the newest incarnation at its (GID, QPN); returns its id.
    fn add(&mut self, p: Peer) -> u64 {
        let addr = p.addr;
        let id = self.table.insert(p);
        self.index.add(addr, id);
        id
    }

    /// Forgets peer `id` (its ids left in the ready and backoff lists find nothing) and the
    /// packets queued to it.
    pub(super) fn remove(&mut self, id: &u64) -> Option<Peer> {
        let p = self.table.remove(id)?;
        self.index.remove(p.addr, *id);
        self.queued = self.queued.saturating_sub(p.ctrl_q.len() + p.data_q.len());
        Some(p)
    }

    /// The peer at exactly `a`.
    fn find(&mut self, a: &RawAddr) -> Option<u64> {
        self.index.find(a)
    }

    /// The newest incarnation at (GID, QPN): the one packets without a connid are from.
    pub(super) fn newest(&self, gid: Gid, qpn: u16) -> Option<u64> {
        self.index.newest(gid, qpn)
    }

    /// Who wrote with immediate data from `src`: the device names the writer by GID and QPN
    /// only, so it is that queue pair's newest incarnation (QKEY 0 when unknown).
    pub(super) fn writer(&self, src: Source) -> RawAddr {
        self.newest(src.gid, src.qpn)
            .and_then(|id| self.get(&id))
            .map_or(RawAddr::new(src.gid, src.qpn, 0), |p| p.addr)
    }

    /// Puts a packet on its peer's queue (at the front for a resend) and the peer on the ready
    /// list (nothing when the peer is gone).
    pub(super) fn enqueue(&mut self, pkt: Pkt, ctrl: bool, front: bool) {
        let pid = pkt.peer;
        let Some(p) = self.table.get_mut(&pid) else {
            return;
        };
        self.queued += 1;
        let q = if ctrl { &mut p.ctrl_q } else { &mut p.data_q };
        if front {
            q.push_front(pkt);
        } else {
            q.push_back(pkt);
        }
        if !p.in_ready && p.backoff_until.is_none() {
            p.in_ready = true;
            self.ready.push_back(pid);
        }
    }

    /// Packets queued at peers, not handed out yet.
    pub(super) fn queued(&self) -> usize {
        self.queued
    }

    /// Takes the data packets of `owner` off peer `pid`'s queue, and `owner`'s place among the
    /// sends waiting for its HANDSHAKE (a send that failed).
    pub(super) fn withdraw(&mut self, pid: u64, owner: Owner) {
        let Some(p) = self.table.get_mut(&pid) else {
            return;
        };
        if let Owner::Tx(id) = owner {
            p.blocked.retain(|&x| x != id);
        }
        let before = p.data_q.len();
        p.data_q.retain(|k| k.owner != owner);
        self.queued = self.queued.saturating_sub(before - p.data_q.len());
    }

    /// The next packet to send, from the next ready peer not in backoff (control packets
    /// first), with its destination; the peer stays in turn while it has more.
    pub(super) fn next_packet(&mut self) -> Option<(RawAddr, Pkt)> {
        while let Some(pid) = self.ready.pop_front() {
            let Some(p) = self.table.get_mut(&pid) else {
                continue;
            };
            p.in_ready = false;
            if p.backoff_until.is_some() {
                continue;
            }
            let Some(pkt) = p.ctrl_q.pop_front().or_else(|| p.data_q.pop_front()) else {
                continue;
            };
            self.queued = self.queued.saturating_sub(1);
            if !(p.ctrl_q.is_empty() && p.data_q.is_empty()) {
                p.in_ready = true;
                self.ready.push_back(pid);
            }
            return Some((p.addr, pkt));
        }
        None
    }

    /// Packets wait for their turn.
    pub(super) fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Some peer is in RNR backoff.
    pub(super) fn in_backoff(&self) -> bool {
        !self.backoff.is_empty()
    }

    /// When the first backoff ends.
    pub(super) fn backoff_deadline(&self) -> Option<Instant> {
        self.backoff
            .iter()
            .filter_map(|p| self.table.get(p)?.backoff_until)
            .min()
    }

    /// Puts `p` (id `pid`) in turn if it has packets and is not in turn yet.
    fn ready_if_queued(ready: &mut VecDeque<u64>, pid: u64, p: &mut Peer) {
        let queued = !p.ctrl_q.is_empty() || !p.data_q.is_empty();
        if !p.in_ready && queued {
            p.in_ready = true;
            ready.push_back(pid);
        }
    }

    /// A packet to `pid` met RNR a second time: the peer backs off (new episode: the wait
    /// doubles from `initial`, capped by `max`; already backing off: the wait restarts).
    fn enter_backoff(
        &mut self,
        pid: u64,
        now: Instant,
        initial: Duration,
        max: Duration,
        timers: &mut TimerTable,
    ) {
        let Some(p) = self.table.get_mut(&pid) else {
            return;
        };
        if p.backoff_until.is_none() {
            p.rnr_wait = if p.rnr_wait.is_zero() {
                initial
            } else {
                p.rnr_wait.saturating_mul(2)
            }
            .min(max);
            self.backoff.push(pid);
            tracing::debug!(peer = %p.addr, wait = ?p.rnr_wait, "RNR backoff");
        }
        p.backoff_until = Some(now.checked_add(p.rnr_wait).unwrap_or(now));
        timers.set(Timer::Backoff, self.backoff_deadline());
    }

    /// A resent packet completed: the backoff of `pid` ends and its next one starts from the
    /// initial wait again.
    pub(super) fn reset_backoff(&mut self, pid: u64, timers: &mut TimerTable) {
        let Some(p) = self.table.get_mut(&pid) else {
            return;
        };
        p.rnr_wait = Duration::ZERO;
        if p.backoff_until.take().is_some() {
            self.backoff.retain(|&x| x != pid);
            Self::ready_if_queued(&mut self.ready, pid, p);
            timers.set(Timer::Backoff, self.backoff_deadline());
        }
    }

    /// Ends the backoffs that are due.
    pub(super) fn expire_backoffs(&mut self, now: Instant, timers: &mut TimerTable) {
        let mut i = 0;
        while let Some(&pid) = self.backoff.get(i) {
            let due = match self.table.get_mut(&pid) {
                None => true,
                Some(p) => match p.backoff_until {
                    Some(t) if t > now => false,
                    _ => {
                        p.backoff_until = None;
                        Self::ready_if_queued(&mut self.ready, pid, p);
                        true
                    }
                },
            };
            if due {
                self.backoff.swap_remove(i);
            } else {
                i += 1;
            }
        }
        timers.set(Timer::Backoff, self.backoff_deadline());
    }

    /// The engine closed: every queue is emptied, every message window starts afresh, nobody
    /// is in turn or in backoff any more.
    pub(super) fn close(&mut self, recvwin_size: usize, timers: &mut TimerTable) {
        for p in self.table.values_mut() {
            p.ctrl_q.clear();
            p.data_q.clear();
            p.robuf = ReorderWindow::new(p.robuf.expected(), recvwin_size);
            p.inbound.clear();
            p.blocked.clear();
            p.in_ready = false;
            p.backoff_until = None;
        }
        self.ready.clear();
        self.backoff.clear();
        self.queued = 0;
        timers.stop(Timer::Backoff);
    }

    /// A packet to `pid` met RNR a second time: the peer backs off (new episode: the wait
    /// doubles, capped by `max_timeout`; already backing off: the wait restarts). The first
    /// wait is `timeout_interval`, or random in 40..120 µs when it is zero (as libfabric).
    pub(super) fn rnr_backoff(
        &mut self,
        pid: u64,
        now: Instant,
        cfg: &EngineConfig,
        rng: &mut Rng,
        timers: &mut TimerTable,
    ) {
        let initial = if cfg.timeout_interval.is_zero() {
            Duration::from_micros(40 + rng.below(80))
        } else {
            cfg.timeout_interval
        };
        self.enter_backoff(pid, now, initial, cfg.max_timeout, timers);
    }

    /// A new peer for `addr`; `None` (counted as a dropped packet) when the table holds
    /// `max_peers` already.
    pub(super) fn new_peer(
        &mut self,
        addr: RawAddr,
        max_peers: usize,
        recvwin_size: usize,
        out: &mut Out,
    ) -> Option<u64> {
        if self.len() >= max_peers {
            out.drop_pkt("peer table full");
            return None;
        }
        let peer = Peer {
            addr,
            hs_sent: false,
            hs_received: false,
            features: ExtraInfo::empty(),
            next_msg_id: 0,
            robuf: ReorderWindow::new(0, recvwin_size),
            inbound: HashMap::new(),
            ctrl_q: VecDeque::new(),
            data_q: VecDeque::new(),
            in_ready: false,
            backoff_until: None,
            rnr_wait: Duration::ZERO,
            blocked: Vec::new(),
            p2p: true,
            runt_in_flight: 0,
            hs_triggered: false,
            last_heard: None,
            verified: false,
            held_msgs: 0,
            held_bytes: 0,
            held_back: false,
        };
        let id = self.add(peer);
        tracing::debug!(peer = %addr, "new peer");
        Some(id)
    }

    /// The peer a send to `dest` goes to, created if new; `None` when the table is full.
    pub(super) fn for_send(
        &mut self,
        dest: RawAddr,
        max_peers: usize,
        recvwin_size: usize,
        out: &mut Out,
    ) -> Option<u64> {
        if let Some(id) = self.find(&dest) {
            return Some(id);
        }
        if self.len() >= max_peers {
            return None;
        }
        self.new_peer(dest, max_peers, recvwin_size, out)
    }

    /// The incarnations at `addr`'s (GID, QPN) that a REQ from `addr`, a new QKEY, replaces,
    /// with their QKEYs: all but `addr`'s own and those that are live, verified (the device
    /// delivered a packet to them) and heard from within `quiet`. Nothing authenticates the
    /// REQ (on udp, a host that forges the source address can send it), so it must not abort
    /// a live peer: a live incarnation stays, beside the new one, and its operations end as
    /// any peer's do (completed, or failed by the device's unresponsive-peer timeout or the
    /// engine's stall timeout). The engine fails the others and retires their connids
    /// ([`Peers::retire`]), so made-up incarnations replace each other instead of piling up.
    pub(super) fn replaced_by(
        &self,
        addr: RawAddr,
        now: Instant,
        quiet: Duration,
    ) -> Vec<(u64, u32)> {
        let mut old = Vec::new();
        for &id in self.index.incarnations(addr.gid, addr.qpn) {
            let Some(p) = self.get(&id) else {
                continue;
            };
            let qkey = p.addr.qkey;
            if qkey == addr.qkey {
                continue;
            }
            if p.verified
                && p.last_heard
                    .is_some_and(|t| now.saturating_duration_since(t) < quiet)
            {
                tracing::debug!(old = %p.addr, new = %addr, "a new incarnation beside a live one: both kept");
                continue;
            }
            tracing::debug!(old = %p.addr, new = %addr, "peer restarted with a new connid");
            old.push((id, qkey));
        }
        old
    }

    /// Remembers that the incarnation with `qkey` at (`gid`, `qpn`) was replaced: its packets
    /// are stale from now on.
    pub(super) fn retire(&mut self, gid: Gid, qpn: u16, qkey: u32, max: usize) {
        self.index.retire(gid, qpn, qkey, max);
    }

    /// Who sent `pkt` (arrived from `src`): a known peer, or the address of a new incarnation
    /// that a REQ with a raw address introduces (the engine replaces older ones and adds it).
    /// `Who::Nobody` (counted) for stale, unknown or unidentifiable senders.
    pub(super) fn identify(&mut self, src: Source, pkt: &Packet<'_>, out: &mut Out) -> Who {
        let newest = |peers: &Peers| match peers.newest(src.gid, src.qpn) {
            Some(id) => Who::Peer(id),
            None => Who::Nobody,
        };
        if let Some(opt) = pkt.req_opt() {
            match opt.sender {
                Sender::RawAddr(a) => {
                    // A device that cannot tell the sender's GID (Gid::UNKNOWN) leaves the
                    // header's to be trusted, as libfabric's EFA provider trusts it then.
                    if (a.gid != src.gid && !src.gid.is_unknown()) || a.qpn != src.qpn {
                        out.drop_pkt("raw address header does not match the source");
                        return Who::Nobody;
                    }
                    if let Some(id) = self.find(&a) {
                        return Who::Peer(id);
                    }
                    if self.index.is_retired(&a) {
                        out.drop_pkt("stale connid (replaced incarnation)");
                        return Who::Nobody;
                    }
                    Who::New(a)
                }
                Sender::Connid(c) => match self.find(&RawAddr::new(src.gid, src.qpn, c)) {
                    Some(id) => Who::Peer(id),
                    None => {
                        out.drop_pkt("REQ with an unknown connid");
                        Who::Nobody
                    }
                },
                Sender::None => match newest(self) {
                    Who::Nobody => {
                        out.drop_pkt("REQ with no identifiable sender");
                        Who::Nobody
                    }
                    who => who,
                },
            }
        } else {
            let found = match pkt.connid() {
                Some(c) => match self.find(&RawAddr::new(src.gid, src.qpn, c)) {
                    Some(id) => Who::Peer(id),
                    None => Who::Nobody,
                },
                None => newest(self),
            };
            if matches!(found, Who::Nobody) {
                out.drop_pkt("packet from an unknown peer or with a stale connid");
            }
            found
        }
    }

    /// Our HANDSHAKE has not gone to `pid` yet (a known peer).
    pub(super) fn handshake_due(&self, pid: u64) -> bool {
        self.get(&pid).is_some_and(|p| !p.hs_sent)
    }

    /// Queues a control packet (CTS, RECEIPT, EOR, READ_NACK) to `pid`.
    pub(super) fn queue_ctrl(&mut self, pid: u64, pkt: &Packet<'_>) {
        if !self.contains_key(&pid) {
            return;
        }
        if let Some(hdr) = encode(pkt) {
            self.enqueue(Pkt::ctrl(pid, Owner::Ctrl, hdr), true, false);
        }
    }

    /// Makes a peer that does not know us send its HANDSHAKE: a 0-byte EAGER_RTW (libfabric's
    /// `efa_rdm_ep_trigger_handshake`), unless one of our REQs went to it already.
    pub(super) fn trigger_handshake(&mut self, pid: u64, local: RawAddr) {
        let Some(p) = self.get_mut(&pid) else {
            return;
        };
        if p.hs_received || p.hs_triggered || p.next_msg_id != 0 {
            return;
        }
        p.hs_triggered = true;
        self.introduce(pid, local);
    }

    /// Sends `pid` a 0-byte EAGER_RTW with our raw address `local` (libfabric's handshake
    /// trigger), whatever was sent before: its receipt makes the peer's provider hold an AH
    /// for us.
    pub(super) fn introduce(&mut self, pid: u64, local: RawAddr) {
        let pkt = Packet::EagerRtw {
            opt: ReqOpt {
                sender: Sender::RawAddr(local),
                cq_data: None,
            },
            dc_send_id: None,
            rma_iov: IovList::EMPTY,
        };
        self.queue_ctrl(pid, &pkt);
    }

    /// Both sides can RDMA-read: this side's device and configuration, and the peer's
    /// HANDSHAKE (feature bit and p2p) — libfabric's `efa_both_support_rdma_read`. Towards
    /// ourselves (`local`) only this side counts: not when it counts remote reads
    /// (`remote_reads`, what it advertises).
    pub(super) fn both_read(
        &self,
        pid: u64,
        cfg: &EngineConfig,
        local: RawAddr,
        remote_reads: bool,
    ) -> bool {
        cfg.device_rdma_read && self.both(pid, local, remote_reads, ExtraFeature::RdmaRead)
    }

    /// Both sides can RDMA-write (`efa_both_support_rdma_write`), as [`Peers::both_read`].
    pub(super) fn both_write(
        &self,
        pid: u64,
        cfg: &EngineConfig,
        local: RawAddr,
        remote_writes: bool,
    ) -> bool {
        cfg.device_rdma_write && self.both(pid, local, remote_writes, ExtraFeature::RdmaWrite)
    }

    fn both(&self, pid: u64, local: RawAddr, counted: bool, f: ExtraFeature) -> bool {
        self.get(&pid).is_some_and(|p| {
            if p.addr == local {
                !counted
            } else {
                p.hs_received && p.p2p && p.features.has(f)
            }
        })
    }

    /// Queues our HANDSHAKE (`hdr`) to `pid`; it goes once.
    pub(super) fn queue_handshake(&mut self, pid: u64, hdr: Hdr) {
        if let Some(p) = self.get_mut(&pid) {
            p.hs_sent = true;
        }
        self.enqueue(Pkt::ctrl(pid, Owner::Handshake, hdr), true, false);
    }

    /// The peer's HANDSHAKE `h`: its features; REQs switch to the connid header. Returns
    /// whether it is the first from it and the long-CTS sends whose CTSDATA waited for it.
    pub(super) fn handshake_arrived(
        &mut self,
        pid: u64,
        h: &Handshake,
    ) -> Option<(bool, Vec<u32>)> {
        let p = self.get_mut(&pid)?;
        p.features = h.extra_info;
        p.p2p = h.p2p.unwrap_or(true);
        let first = !p.hs_received;
        if first {
            tracing::debug!(peer = %p.addr, features = ?h.extra_info, "handshake received");
        }
        p.hs_received = true;
        Some((first, std::mem::take(&mut p.blocked)))
    }
}

/// The ways to find a peer (a sub-state of the engine): by its full address (with a cache in
/// front), the incarnations at a (GID, QPN) oldest first, and the connids of incarnations that
/// a newer one replaced (their packets are stale).
#[derive(Debug, Default)]
pub(super) struct PeerIndex {
    /// Every known incarnation by full address.
    by_addr: HashMap<RawAddr, u64>,
    /// The last peers found in `by_addr`.
    cache: AddrCache,
    /// The incarnations at (GID, QPN), oldest first; the newest takes packets without connid.
    incarnations: HashMap<(Gid, u16), Vec<u64>>,
    /// Connids of incarnations replaced by a newer one at the same (GID, QPN).
    retired: HashMap<(Gid, u16), VecDeque<u32>>,
}

impl PeerIndex {
    /// A new peer `id` at `addr`, the newest incarnation at its (GID, QPN).
    fn add(&mut self, addr: RawAddr, id: u64) {
        self.by_addr.insert(addr, id);
        self.cache.forget(&addr);
        self.incarnations
            .entry((addr.gid, addr.qpn))
            .or_default()
            .push(id);
    }

    /// Forgets peer `id` at `addr`.
    fn remove(&mut self, addr: RawAddr, id: u64) {
        self.by_addr.remove(&addr);
        self.cache.forget(&addr);
        if let Some(v) = self.incarnations.get_mut(&(addr.gid, addr.qpn)) {
            v.retain(|&x| x != id);
            if v.is_empty() {
                self.incarnations.remove(&(addr.gid, addr.qpn));
            }
        }
    }

    /// The peer at exactly `a`.
    fn find(&mut self, a: &RawAddr) -> Option<u64> {
        if let Some(id) = self.cache.get(a) {
            return Some(id);
        }
        let id = *self.by_addr.get(a)?;
        self.cache.put(*a, id);
        Some(id)
    }

    /// The incarnations at (`gid`, `qpn`), oldest first.
    fn incarnations(&self, gid: Gid, qpn: u16) -> &[u64] {
        self.incarnations
            .get(&(gid, qpn))
            .map_or(&[], |v| v.as_slice())
    }

    /// The newest incarnation at (`gid`, `qpn`).
    fn newest(&self, gid: Gid, qpn: u16) -> Option<u64> {
        self.incarnations(gid, qpn).last().copied()
    }

    /// Whether `addr` names an incarnation a newer one replaced.
    fn is_retired(&self, addr: &RawAddr) -> bool {
        self.retired
            .get(&(addr.gid, addr.qpn))
            .is_some_and(|v| v.contains(&addr.qkey))
    }

    /// Remembers that `qkey` at (`gid`, `qpn`) was replaced: bounded to `RETIRED_PER_QP` per
    /// queue pair and `max` queue pairs (past it, every retired connid is forgotten rather than
    /// growing without end).
    fn retire(&mut self, gid: Gid, qpn: u16, qkey: u32, max: usize) {
        if self.retired.len() >= max && !self.retired.contains_key(&(gid, qpn)) {
            self.retired.clear();
        }
        let r = self.retired.entry((gid, qpn)).or_default();
        if r.len() >= RETIRED_PER_QP {
            r.pop_front();
        }
        r.push_back(qkey);
    }
}

/// Slots of [`AddrCache`] (a power of two).
const ADDR_CACHE_SLOTS: usize = 64;

/// A direct-mapped cache in front of `PeerIndex::by_addr`, whose keys come from peers and are
/// therefore hashed with the randomly keyed SipHash: an endpoint mostly talks to a few peers,
/// and finding one by its full address is then one comparison. A peer that picks addresses to
/// collide here only makes lookups miss and go to the map.
#[derive(Debug)]
pub(super) struct AddrCache {
    slots: Box<[Option<(RawAddr, u64)>]>,
}

impl Default for AddrCache {
    fn default() -> Self {
        AddrCache {
            slots: vec![None; ADDR_CACHE_SLOTS].into_boxed_slice(),
        }
    }
}

impl AddrCache {
    fn slot(a: &RawAddr) -> usize {
        let g = a.gid.0;
        let low = u32::from_le_bytes([g[12], g[13], g[14], g[15]]);
        let h = (low ^ a.qkey ^ u32::from(a.qpn).rotate_left(16)).wrapping_mul(0x9e37_79b9);
        (h >> 26) as usize & (ADDR_CACHE_SLOTS - 1)
    }

    fn get(&self, a: &RawAddr) -> Option<u64> {
        match self.slots.get(Self::slot(a)) {
            Some(Some((k, id))) if k == a => Some(*id),
            _ => None,
        }
    }

    fn put(&mut self, a: RawAddr, id: u64) {
        if let Some(s) = self.slots.get_mut(Self::slot(&a)) {
            *s = Some((a, id));
        }
    }

    fn forget(&mut self, a: &RawAddr) {
        if let Some(s) = self.slots.get_mut(Self::slot(a)) {
            if s.is_some_and(|(k, _)| k == *a) {
                *s = None;
            }
        }
    }
}

/// How our REQ packets to a peer name us: by the connid header (our QKEY) once its HANDSHAKE
/// arrived (`hs_received`), by our raw address before (it may not know us yet).
pub(super) fn our_sender(local: RawAddr, hs_received: bool) -> Sender {
    if hs_received {
        Sender::Connid(local.qkey)
    } else {
        Sender::RawAddr(local)
    }
}

/// What the engine knows about one remote endpoint (one incarnation: GID, QPN and QKEY).
#[derive(Debug)]
pub(super) struct Peer {
    /// Its address; the QKEY is its connid.
    pub(super) addr: RawAddr,
    /// Our HANDSHAKE to it is queued or sent (it goes once).
    pub(super) hs_sent: bool,
    /// Its HANDSHAKE arrived: REQs carry the connid header instead of our raw address, and
    /// CTSDATA may be sent.
    pub(super) hs_received: bool,
    /// The feature bits it advertised.
    pub(super) features: ExtraInfo,
    /// `msg_id` of our next message to it.
    pub(super) next_msg_id: u32,
    /// Its messages in `msg_id` order.
    pub(super) robuf: ReorderWindow<u32>,
    /// Its messages not yet complete, by `msg_id` (peer-chosen keys: standard hasher).
    pub(super) inbound: HashMap<u32, u32>,
    /// Control packets (HANDSHAKE, CTS, RECEIPT) waiting for the device.
    pub(super) ctrl_q: VecDeque<Pkt>,
    /// Data packets (REQ, CTSDATA) waiting for the device.
    pub(super) data_q: VecDeque<Pkt>,
    /// It is on the engine's ready list.
    pub(super) in_ready: bool,
    /// In RNR backoff until then.
    pub(super) backoff_until: Option<Instant>,
    /// Length of the last backoff (doubles per episode; back to zero once a resent packet
    /// completes, as libfabric).
    pub(super) rnr_wait: Duration,
    /// Long-CTS sends with a window granted, waiting for its HANDSHAKE before CTSDATA.
    pub(super) blocked: Vec<u32>,
    /// Its buffers are reachable by the NIC (the HANDSHAKE's p2p field; true when absent, as
    /// libfabric assumes for legacy peers).
    pub(super) p2p: bool,
    /// Bytes of our runting-read messages to it sent eagerly and not yet completed
    /// (libfabric's `num_runt_bytes_in_flight`).
    pub(super) runt_in_flight: usize,
    /// We sent it a 0-byte EAGER_RTW to make it send its HANDSHAKE (libfabric's trigger).
    pub(super) hs_triggered: bool,
    /// When a packet of it last arrived (`None`: never).
    pub(super) last_heard: Option<Instant>,
    /// A packet to it completed successfully: the device at its address, with its QKEY,
    /// acknowledged it. (A host that forges source addresses can make up an incarnation, but
    /// not receive for it.)
    pub(super) verified: bool,
    /// Messages and bytes of it held without a receive (its share of the buffering budget).
    pub(super) held_msgs: usize,
    pub(super) held_bytes: usize,
    /// Over its share: the device is asked to refuse its new messages (receiver not ready).
    pub(super) held_back: bool,
}

/// Device statuses after which a peer is considered gone. Not `UnknownPeer` (14): on EFA it
/// says the target holds no AH for us, which a datagram from us repairs (RDMA work requests
/// that meet it are posted again, `NO_AH_RETRIES`).
pub(super) fn peer_fatal(s: Status) -> bool {
    matches!(
        s,
        Status::UnresponsiveRemote
            | Status::UnreachableRemote
            | Status::BadDestQpn
            | Status::RemoteAbort
            | Status::InvalidAh
    )
}

/// Who sent a packet ([`Peers::identify`]).
pub(super) enum Who {
    /// A known peer.
    Peer(u64),
    /// A new incarnation, at this address, introduced by a REQ with its raw address.
    New(RawAddr),
    /// Stale, unknown or unidentifiable (the packet was counted as dropped).
    Nobody,
}

/// The HANDSHAKE this engine sends: only what is implemented is advertised.
///
/// Always: delivery complete, the connid-header request, runting read and READ_NACK (as
/// libfabric, which advertises the baselined bits whatever the device). RDMA read and write
/// only when the device can and the configuration allows (`device_rdma_read`,
/// `device_rdma_write`), unsolicited write-recv only with RDMA write and when the queue pair
/// has it (`unsolicited_write_recv`, [`Engine::set_unsolicited_write_recv`]). Peers' one-sided
/// accesses this side counts (`remote_events`: writes, reads) must reach the engine: device
/// RDMA for them is not advertised ([`Engine::set_remote_events`]). p2p is `true`: all our
/// buffers are host memory, which the NIC always reaches (libfabric's `efa_rdm_ep_use_p2p`
/// without FI_HMEM).
pub(super) fn handshake(
    cfg: &EngineConfig,
    local: RawAddr,
    remote_events: (bool, bool),
    unsolicited_write_recv: bool,
) -> Handshake {
    let mut extra_info = ExtraInfo::with_features(&[
        ExtraFeature::DeliveryComplete,
        ExtraFeature::RequestConnidHeader,
        ExtraFeature::Runt,
        ExtraFeature::ReadNack,
    ]);
    let (count_writes, count_reads) = remote_events;
    if cfg.device_rdma_read && !count_reads {
        extra_info.set(ExtraFeature::RdmaRead);
    }
    if cfg.device_rdma_write && !count_writes {
        extra_info.set(ExtraFeature::RdmaWrite);
        if unsolicited_write_recv {
            extra_info.set(ExtraFeature::UnsolicitedWriteRecv);
        }
    }
    Handshake {
        extra_info,
        connid: Some(local.qkey),
        host_id: None,
        device_version: None,
        user_recv_qp: None,
        p2p: Some(true),
    }
}
