//! SRD reliability over UDP: per-peer sequence numbers, cumulative + selective acknowledgements,
//! retransmission with exponential backoff, duplicate suppression, RNR NAKs and the
//! unresponsive-peer timeout. The rules are in `docs/udp-device.md`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

// Keyed by what peers send (addresses, connection ids): a fast hash with a random seed per map
// (foldhash), not SipHash, which showed in the per-packet profile.
use foldhash::{HashMap, HashMapExt, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::UdpConfig;
use super::link::{Ctx, Delivery, Parts, Tag, min_opt};
use super::wire::{self, AckHdr, DataHdr, NakHdr, NakReason, WINDOW};
use crate::device::{SendWr, Status};
use crate::fault::Rng;
use crate::mem::RegionSlice;
use crate::stats;

/// RNR retry count that means "retry forever", as on EFA.
const RNR_RETRY_INFINITE: u8 = 7;
/// Initial congestion window, packets.
const INITIAL_CWND: f64 = 32.0;
/// Most senders whose receive state a queue pair keeps (beyond, one not heard from recently is
/// forgotten).
const MAX_RX_PEERS: usize = 16_384;
/// Most forgotten senders whose highest sequence number a queue pair remembers, so that it never
/// delivers a packet of theirs again (it fails it instead).
const MAX_FORGOTTEN: usize = 4 * MAX_RX_PEERS;
/// Smallest congestion window, packets.
const MIN_CWND: f64 = 2.0;
/// Longest an acknowledgement waits, while the application busy-polls, for a data packet to the
/// same peer to ride on (a reply usually follows within microseconds).
const ACK_DELAY: Duration = Duration::from_micros(30);
/// Packets delivered from one sender after which it is acknowledged without delay.
const ACK_EVERY: u32 = 16;
/// Packets sent to a peer not known to unpack after which it is asked again (a lost question
/// or answer is asked again so).
const HELLO_EVERY: u32 = 256;

/// A send work request waiting for its acknowledgement.
struct SendOp {
    wr_id: u64,
    hdr: Bytes,
    payload: Bytes,
    /// Region bytes after `payload`, read at each transmission (an RDMA write from a region).
    region: Option<RegionSlice>,
    imm: Option<u32>,
    /// An RDMA message of the device (`FLAG_RDMA`).
    rdma: bool,
}

impl SendOp {
    fn len(&self) -> usize {
        self.hdr.len() + self.payload.len() + self.region.as_ref().map_or(0, |r| r.len)
    }
}

/// A packet on the wire, not yet acknowledged.
struct InFlight {
    op: SendOp,
    /// Attempt number of the last transmission.
    try_: u32,
    /// Retransmissions after a timeout (drives the backoff).
    retries: u32,
    /// RNR NAKs received for this packet.
    rnr_count: u32,
    /// Waiting out an RNR interval (NAKs are ignored meanwhile).
    rnr_wait: bool,
    /// Identifies the one live timer of this packet.
    epoch: u64,
    sent_at: Instant,
    retransmitted: bool,
    /// Its timer ran out while the peer was silent after a probe ([`TxPeer::probe`]): it waits
    /// for the next probe time or the answer that ends the silence.
    deferred: bool,
}

/// Send side state towards one peer queue pair (address + QKEY). Its connection number and first
/// sequence number are random, so that an off-path host cannot guess what an acknowledgement
/// must name.
struct TxPeer {
    addr: SocketAddr,
    qkey: u32,
    conn: u32,
    next_seq: u64,
    pending: VecDeque<SendOp>,
    inflight: BTreeMap<u64, InFlight>,
    cwnd: f64,
    ssthresh: f64,
    /// Sequence number before which losses belong to the current congestion event.
    recovery: u64,
    srtt: Option<Duration>,
    rttvar: Duration,
    last_heard: Instant,
    unresp_armed: bool,
    last_active: Instant,
    /// The last retransmission for a timeout (when it went, when the next may go): while the
    /// peer says nothing after it, the other packets whose timers run out wait for that time
    /// instead of going too, so that a silent peer (descheduled, or gone) is probed with one
    /// packet per timeout rather than sent the whole window at each (as TCP retransmits only
    /// its oldest segment on a timeout).
    probe: Option<(Instant, Instant)>,
    /// Probes sent to the silent peer so far: the probes' timeout doubles with each.
    probes: u32,
    /// Packets sent since this peer was last asked whether it unpacks.
    since_hello: u32,
}

impl TxPeer {
    /// Every sequence number below is finished (acknowledged or given up).
    fn base(&self) -> u64 {
        self.inflight
            .keys()
            .next()
            .copied()
            .unwrap_or(self.next_seq)
    }

    /// The peer has said nothing since our last probe ([`TxPeer::probe`]).
    fn silent(&self) -> bool {
        self.probe.is_some_and(|(sent, _)| self.last_heard < sent)
    }

    fn rto(&self, cfg: &UdpConfig, retries: u32) -> Duration {
        let mut rto = cfg.retransmit_timeout;
        if let Some(srtt) = self.srtt {
            rto = rto.max(srtt + self.rttvar * 4);
        }
        rto.checked_mul(1u32 << retries.min(20))
            .unwrap_or(cfg.max_retransmit_timeout)
            .min(cfg.max_retransmit_timeout)
    }

    fn on_rtt_sample(&mut self, sample: Duration) {
        match self.srtt {
            None => {
                self.srtt = Some(sample);
                self.rttvar = sample / 2;
            }
            Some(srtt) => {
                let err = srtt.abs_diff(sample);
                self.rttvar = (self.rttvar * 3 + err) / 4;
                self.srtt = Some((srtt * 7 + sample) / 8);
            }
        }
    }
}

/// What the receiver remembers of one sequence number in its window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Empty,
    /// Refused with RNR at this attempt; only a later attempt may be delivered.
    Refused(u32),
    Delivered,
    /// Failed for good, and answered with a NAK of this reason; duplicates get it again:
    /// `BadLength`, delivered into a too-short buffer; `BadAddress`, an RDMA access refused (bad
    /// key, range or right); `UnknownPeer`, an RDMA access refused for want of an address
    /// handle for the initiator (it posts a new work request once the target has one);
    /// `Forgotten`, below the floor of a sender whose state was forgotten: it may have been
    /// delivered before, so it is refused (the send fails) rather than delivered again.
    Failed(NakReason),
}

/// Receive state is kept per sending queue pair and connection: (its address, its QKEY, the
/// connection number it chose). A packet naming another connection number (a forged one, or the
/// sender's next connection after it forgot the last) gets state of its own and never touches
/// this one.
type RxKey = (Addr, u32, u32);

/// A socket address as a key of SRD's maps, hashed as one or two words: `SocketAddr`'s own
/// `Hash` makes six hasher calls (variant, length, octets, port, flow, scope), and every
/// message looks up several of these maps (about 660 instructions a message went to hashing).
/// Equal addresses hash equally (the flow label, which `Eq` compares, is left out of the hash).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Addr(SocketAddr);

impl std::hash::Hash for Addr {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        match self.0 {
            SocketAddr::V4(a) => {
                h.write_u64(u64::from(a.ip().to_bits()) << 16 | u64::from(a.port()))
            }
            SocketAddr::V6(a) => {
                h.write_u128(a.ip().to_bits());
                h.write_u64(u64::from(a.port()) << 32 | u64::from(a.scope_id()));
            }
        }
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Receive side state for one sending queue pair (address + its QKEY).
struct RxPeer {
    /// Every sequence number below is finished at the sender.
    base: u64,
    /// Every sequence number in `[base, cum)` was delivered.
    cum: u64,
    /// Slots of `base..base + slots.len()`.
    slots: VecDeque<Slot>,
    conn: u32,
    /// In `Srd::acks`: an acknowledgement is due (delayed, piggybacked or immediate).
    ack_pending: bool,
    /// Packets delivered since the last acknowledgement.
    unacked: u32,
    /// Acknowledge at the next flush (duplicate, or the sender asked).
    ack_now: bool,
    last_active: Instant,
    /// Heard from since the eviction clock last passed (second chance, [`Srd::evict_one`]).
    touched: bool,
    /// One above the highest sequence number seen.
    high: u64,
    /// Sequence numbers below were seen by a forgotten state of this same key: never delivered
    /// again.
    floor: u64,
}

impl RxPeer {
    fn advance_base(&mut self, base: u64) {
        if base <= self.base {
            return;
        }
        let shift = base - self.base;
        if shift >= self.slots.len() as u64 {
            self.slots.clear();
        } else {
            self.slots.drain(..shift as usize);
        }
        self.base = base;
        self.cum = self.cum.max(base);
        self.advance_cum();
    }

    /// Builds the acknowledgement of this peer's state into `bitmap`, and clears the pending
    /// state.
    fn take_ack(&mut self, src_qkey: u32, bitmap: &mut Vec<u8>) -> AckHdr {
        self.ack_pending = false;
        self.unacked = 0;
        self.ack_now = false;
        bitmap.clear();
        // Bit i of the bitmap stands for cum + 1 + i.
        let first = (self.cum - self.base) as usize + 1;
        for (i, s) in self.slots.iter().skip(first).enumerate() {
            if *s == Slot::Delivered {
                let byte = i / 8;
                if bitmap.len() <= byte {
                    bitmap.resize(byte + 1, 0);
                }
                if let Some(b) = bitmap.get_mut(byte) {
                    *b |= 1 << (i % 8);
                }
            }
        }
        AckHdr {
            src_qkey,
            conn: self.conn,
            cum: self.cum,
        }
    }

    fn advance_cum(&mut self) {
        while self
            .slots
            .get((self.cum - self.base) as usize)
            .is_some_and(|s| *s == Slot::Delivered)
        {
            // A sender's numbers end below 2^64 (a forged base may sit at the very top).
            let Some(next) = self.cum.checked_add(1) else {
                break;
            };
            self.cum = next;
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum TimerKind {
    /// Retransmission (or RNR retry) of one packet.
    Packet { seq: u64, epoch: u64 },
    /// Check whether the peer has been silent too long.
    Unresponsive,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Timer {
    at: Instant,
    conn: u32,
    kind: TimerKind,
}

/// SRD state of one queue pair.
pub(super) struct Srd {
    tx: HashMap<u32, TxPeer>,
    tx_by_addr: HashMap<(Addr, u32), u32>,
    rx: HashMap<RxKey, RxPeer>,
    /// The connection number last heard from a sending (address, QKEY): whose acknowledgement
    /// rides on our data packets to it.
    rx_conn: HashMap<(Addr, u32), u32>,
    /// The eviction clock over `rx` (second chance: O(1) amortized per packet).
    rx_clock: VecDeque<RxKey>,
    /// Forgotten receive states: one above their highest sequence number (`RxPeer::floor` of
    /// a state created again for the key), oldest first in `forgotten_order`.
    forgotten: HashMap<RxKey, u64>,
    forgotten_order: VecDeque<RxKey>,
    acks: Vec<RxKey>,
    /// When the delayed acknowledgements in `acks` must go out at the latest.
    ack_deadline: Option<Instant>,
    timers: BinaryHeap<Reverse<Timer>>,
    epoch: u64,
    next_sweep: Instant,
    bitmap: Vec<u8>,
    /// Where connection numbers and first sequence numbers come from: the kernel's CSPRNG
    /// (`None`; they defend against forged packets), or a seeded generator in the simulator, so
    /// that a seed replays a run exactly.
    ids: Option<Rng>,
    /// Queue pairs (address, QKEY) that sent us a packed datagram, so unpack ours.
    packers: Packers,
}

/// The queue pairs that unpack (they sent us a packed datagram), with the last answer kept:
/// every packet asks for its destination, almost always the same one as the packet before.
#[derive(Default)]
struct Packers {
    set: HashSet<(Addr, u32)>,
    last: std::cell::Cell<Option<(SocketAddr, u32, bool)>>,
}

impl Packers {
    /// Whether `(addr, qkey)` unpacks (an IPv4 address and its IPv4-mapped form are one).
    fn contains(&self, addr: SocketAddr, qkey: u32) -> bool {
        if let Some((a, q, r)) = self.last.get()
            && a == addr
            && q == qkey
        {
            return r;
        }
        let r = self.set.contains(&(Addr(canonical(addr)), qkey));
        self.last.set(Some((addr, qkey, r)));
        r
    }

    /// `(addr, qkey)` unpacks; the set is bounded by `max` (forgetting costs only packing, until
    /// the next hello).
    fn insert(&mut self, addr: SocketAddr, qkey: u32, max: usize) {
        self.last.set(None);
        let key = (Addr(canonical(addr)), qkey);
        if self.set.len() >= max && !self.set.contains(&key) {
            self.set.clear();
        }
        self.set.insert(key);
    }
}

/// The form of `a` under which the set of queue pairs that unpack knows it (an IPv4 address and
/// its IPv4-mapped form are one).
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl Srd {
    pub fn new(now: Instant, cfg: &UdpConfig) -> Srd {
        Srd {
            tx: HashMap::new(),
            tx_by_addr: HashMap::new(),
            rx: HashMap::new(),
            rx_conn: HashMap::new(),
            rx_clock: VecDeque::new(),
            forgotten: HashMap::new(),
            forgotten_order: VecDeque::new(),
            acks: Vec::new(),
            ack_deadline: None,
            timers: BinaryHeap::new(),
            epoch: 0,
            next_sweep: now + cfg.peer_idle_timeout / 4,
            bitmap: Vec::with_capacity(wire::MAX_BITMAP),
            ids: None,
            packers: Packers::default(),
        }
    }

    /// A packed datagram came from `(src, src_qkey)`, with our QKEY: it unpacks, so ours to
    /// it may be packed. `hello`: it asks whether we unpack; we answer with an empty packed
    /// datagram.
    pub fn unpacker(
        &mut self,
        cx: &mut Ctx,
        src: SocketAddr,
        src_qkey: u32,
        hello: bool,
        now: Instant,
    ) {
        self.packers.insert(src, src_qkey, MAX_RX_PEERS);
        if hello {
            wire::encode_packed_header(&mut cx.out.tx, src_qkey, cx.qkey, false);
            cx.out.emit(src, now);
        }
    }

    /// Draws connection numbers and first sequence numbers from `seed` instead of the kernel's
    /// CSPRNG (the simulator: a seed then replays a run exactly).
    #[cfg(test)]
    pub fn seed_ids(&mut self, seed: u64) {
        self.ids = Some(Rng::new(seed));
    }

    fn random(&mut self) -> u64 {
        match self.ids.as_mut() {
            Some(r) => r.next_u64(),
            None => crate::random::secure_u64(),
        }
    }

    /// Queues a send to `dest` and transmits what the window allows.
    pub fn post(&mut self, cx: &mut Ctx, dest: SocketAddr, wr: SendWr, now: Instant) {
        self.post_flagged(cx, dest, wr, now, false, None)
    }

    /// [`post`](Self::post), for an RDMA message when `rdma` (`rdma.rs`), whose bytes end with
    /// those of `region` when given (read at each transmission).
    pub fn post_flagged(
        &mut self,
        cx: &mut Ctx,
        dest: SocketAddr,
        wr: SendWr,
        now: Instant,
        rdma: bool,
        region: Option<RegionSlice>,
    ) {
        let key = (Addr(dest), wr.dest.qkey);
        let conn = match self.tx_by_addr.get(&key) {
            Some(c) => *c,
            None => {
                let mut conn = self.random() as u32;
                while conn == 0 || self.tx.contains_key(&conn) {
                    conn = self.random() as u32;
                }
                // Below 2^62: sequence numbers never wrap.
                let first = self.random() >> 2;
                self.tx.insert(
                    conn,
                    TxPeer {
                        addr: dest,
                        qkey: wr.dest.qkey,
                        conn,
                        next_seq: first,
                        pending: VecDeque::new(),
                        inflight: BTreeMap::new(),
                        cwnd: INITIAL_CWND.min(cx.cfg.max_inflight as f64),
                        ssthresh: cx.cfg.max_inflight as f64,
                        recovery: first,
                        srtt: None,
                        rttvar: Duration::ZERO,
                        last_heard: now,
                        unresp_armed: false,
                        last_active: now,
                        probe: None,
                        probes: 0,
                        since_hello: HELLO_EVERY,
                    },
                );
                self.tx_by_addr.insert(key, conn);
                conn
            }
        };
        if let Some(p) = self.tx.get_mut(&conn) {
            p.last_active = now;
            p.pending.push_back(SendOp {
                wr_id: wr.wr_id,
                hdr: wr.hdr,
                payload: wr.payload,
                region,
                imm: wr.imm,
                rdma,
            });
        }
        self.pump(cx, conn, now);
    }

    /// Puts pending sends of peer `conn` on the wire while the windows allow.
    fn pump(&mut self, cx: &mut Ctx, conn: u32, now: Instant) {
        let Srd {
            tx,
            timers,
            epoch,
            rx,
            rx_conn,
            bitmap,
            packers,
            ..
        } = self;
        let Some(p) = tx.get_mut(&conn) else {
            return;
        };
        let pack = pack_for(packers, cx, p.addr, p.qkey);
        let limit = (p.cwnd as usize).clamp(1, cx.cfg.max_inflight);
        while !p.pending.is_empty() && p.inflight.len() < limit && p.next_seq < p.base() + WINDOW {
            let Some(op) = p.pending.pop_front() else {
                break;
            };
            if p.inflight.is_empty() {
                p.last_heard = now;
            }
            if !p.unresp_armed {
                p.unresp_armed = true;
                timers.push(Reverse(Timer {
                    at: now + cx.cfg.unresponsive_timeout,
                    conn,
                    kind: TimerKind::Unresponsive,
                }));
            }
            let seq = p.next_seq;
            p.next_seq += 1;
            *epoch += 1;
            let len = op.len();
            p.inflight.insert(
                seq,
                InFlight {
                    op,
                    try_: 0,
                    retries: 0,
                    rnr_count: 0,
                    rnr_wait: false,
                    epoch: *epoch,
                    sent_at: now,
                    retransmitted: false,
                    deferred: false,
                },
            );
            if pack.is_none() && cx.cfg.pack {
                hello(cx, p, now);
            }
            let rev = reverse(rx, rx_conn, p);
            transmit(cx, p, seq, rev, bitmap, limit, pack, now);
            stats::inc(&cx.counters().tx_pkts);
            stats::add(&cx.counters().tx_bytes, len as u64);
            timers.push(Reverse(Timer {
                at: now + p.rto(&cx.cfg, 0),
                conn,
                kind: TimerKind::Packet { seq, epoch: *epoch },
            }));
        }
    }

    /// Handles a data packet from `src`.
    pub fn on_data(
        &mut self,
        cx: &mut Ctx,
        src: SocketAddr,
        h: &DataHdr,
        payload: &[u8],
        now: Instant,
    ) {
        let from = Addr(src);
        let key = (from, h.src_qkey, h.conn);
        let bound = self.rx_conn.get(&(from, h.src_qkey)).copied();
        if let Some(bound) = bound
            && bound != h.conn
        {
            // Another connection number from this sender: its next connection after it forgot
            // the last (idle for `peer_idle_timeout`), or a forged packet. It may take over
            // only once the bound connection has been silent for `peer_idle_timeout` too, so
            // that a host forging the source address cannot inject data into, or shift the
            // window of, a live connection without guessing its random number.
            let old = (from, h.src_qkey, bound);
            let live = self.rx.get(&old).is_some_and(|r| {
                now.saturating_duration_since(r.last_active) < cx.cfg.peer_idle_timeout
            });
            if live {
                stats::inc(&cx.counters().stale_dropped);
                tracing::debug!(%src, conn = h.conn, "udp: data for another connection of a live sender");
                return;
            }
            if let Some(r) = self.rx.remove(&old) {
                self.remember_forgotten(old, r.high);
            }
            self.rx_conn.remove(&(from, h.src_qkey));
        }
        if !self.rx.contains_key(&key) {
            if self.rx.len() >= MAX_RX_PEERS {
                self.evict_one();
            }
            let floor = self.forgotten.get(&key).copied().unwrap_or(0);
            self.rx.insert(
                key,
                RxPeer {
                    base: h.base,
                    cum: h.base,
                    slots: VecDeque::new(),
                    conn: h.conn,
                    ack_pending: false,
                    unacked: 0,
                    ack_now: false,
                    last_active: now,
                    touched: false,
                    high: h.base,
                    floor,
                },
            );
            self.rx_clock.push_back(key);
        }
        if bound != Some(h.conn) {
            self.rx_conn.insert((from, h.src_qkey), h.conn);
        }
        let Some(rx) = self.rx.get_mut(&key) else {
            return;
        };
        rx.last_active = now;
        rx.touched = true;
        rx.high = rx.high.max(h.seq.saturating_add(1));
        rx.advance_base(h.base);
        if h.seq < rx.base {
            // The sender finished this one already: a stale copy.
            stats::inc(&cx.counters().duplicates_dropped);
            return;
        }
        let idx = (h.seq - rx.base) as usize;
        if idx as u64 >= WINDOW {
            // Cannot happen for a well-formed packet (decode checks seq - base < WINDOW).
            stats::inc(&cx.counters().malformed_dropped);
            return;
        }
        while rx.slots.len() <= idx {
            rx.slots.push_back(Slot::Empty);
        }
        let Some(slot) = rx.slots.get_mut(idx) else {
            return;
        };
        let nak = |cx: &mut Ctx, reason: NakReason| {
            send_nak(cx, src, h, reason, now);
        };
        let mut ack = |rx: &mut RxPeer, now_: bool| {
            rx.ack_now |= now_ || h.ack_req;
            if !rx.ack_pending {
                rx.ack_pending = true;
                self.acks.push(key);
                if self.ack_deadline.is_none() {
                    self.ack_deadline = Some(now + ACK_DELAY);
                }
            }
        };
        match *slot {
            Slot::Delivered => {
                stats::inc(&cx.counters().duplicates_dropped);
                // The sender retransmitted: our acknowledgement may have been lost.
                ack(rx, true);
            }
            Slot::Failed(reason) => {
                stats::inc(&cx.counters().duplicates_dropped);
                nak(cx, reason);
            }
            Slot::Refused(t) if h.try_ <= t => {
                stats::inc(&cx.counters().duplicates_dropped);
                nak(cx, NakReason::Rnr);
            }
            Slot::Empty | Slot::Refused(_) if h.seq < rx.floor => {
                // This state was forgotten once and this packet may have been delivered then.
                tracing::debug!(%src, seq = h.seq, "udp: packet of a forgotten sender state, failing it");
                *slot = Slot::Failed(NakReason::Forgotten);
                stats::inc(&cx.counters().stale_dropped);
                nak(cx, NakReason::Forgotten);
            }
            Slot::Empty | Slot::Refused(_) => match if h.rdma {
                cx.deliver_rdma_udp(src, h.src_qkey, h.imm, payload)
            } else {
                cx.deliver(src, h.imm, payload)
            } {
                Delivery::Denied => {
                    *slot = Slot::Failed(NakReason::BadAddress);
                    nak(cx, NakReason::BadAddress);
                }
                Delivery::NoAh => {
                    *slot = Slot::Failed(NakReason::UnknownPeer);
                    nak(cx, NakReason::UnknownPeer);
                }
                Delivery::NoBuffer => {
                    *slot = Slot::Refused(h.try_);
                    stats::inc(&cx.counters().rnr_events);
                    nak(cx, NakReason::Rnr);
                }
                Delivery::BadLength => {
                    *slot = Slot::Failed(NakReason::BadLength);
                    nak(cx, NakReason::BadLength);
                }
                Delivery::Ok => {
                    *slot = Slot::Delivered;
                    rx.advance_cum();
                    rx.unacked += 1;
                    let full = rx.unacked >= ACK_EVERY;
                    ack(rx, full);
                }
            },
        }
    }

    /// Sends the due acknowledgements: with `all`, one to every peer that delivered or repeated
    /// data since its last acknowledgement; else only those that must not wait (duplicates, a
    /// sender asking, [`ACK_EVERY`] packets) unless the delay [`ACK_DELAY`] ran out, leaving the
    /// others to ride on a data packet to the same peer or to go out at the deadline.
    pub fn flush_acks(&mut self, cx: &mut Ctx, now: Instant, all: bool) {
        if self.acks.is_empty() {
            self.ack_deadline = None;
            return;
        }
        let all = all || self.ack_deadline.is_some_and(|d| d <= now);
        let mut bitmap = std::mem::take(&mut self.bitmap);
        let mut i = 0;
        while i < self.acks.len() {
            let Some(key) = self.acks.get(i).copied() else {
                break;
            };
            let Some(rx) = self.rx.get_mut(&key).filter(|r| r.ack_pending) else {
                // Forgotten, or acknowledged on a data packet meanwhile.
                self.acks.swap_remove(i);
                continue;
            };
            if !all && !rx.ack_now {
                i += 1;
                continue;
            }
            self.acks.swap_remove(i);
            let a = rx.take_ack(cx.qkey, &mut bitmap);
            wire::encode_ack(&mut cx.out.tx, key.1, &a, &bitmap);
            let pack = pack_for(&self.packers, cx, key.0.0, key.1);
            cx.out
                .emit_parts(key.0.0, now, Parts::NONE, Tag::None, pack);
            stats::inc(&cx.counters().acks_sent);
        }
        self.bitmap = bitmap;
        if self.acks.is_empty() {
            self.ack_deadline = None;
        }
    }

    /// Acknowledgements are waiting for a data packet to ride on, or for their deadline.
    pub fn acks_delayed(&self) -> bool {
        self.ack_deadline.is_some()
    }

    /// Handles an acknowledgement.
    pub fn on_ack(
        &mut self,
        cx: &mut Ctx,
        src: SocketAddr,
        a: &AckHdr,
        bitmap: &[u8],
        now: Instant,
    ) {
        let Some(p) = peer_of(&mut self.tx, cx, src, a.conn, a.src_qkey) else {
            return;
        };
        if a.cum > p.next_seq {
            // Acknowledges sequence numbers never sent: forged (or corrupt), completes nothing.
            stats::inc(&cx.counters().stale_dropped);
            tracing::debug!(%src, cum = a.cum, next = p.next_seq, "udp: ack beyond what was sent");
            return;
        }
        let silence_ends = p.silent();
        p.last_heard = now;
        p.last_active = now;
        while let Some(e) = p.inflight.first_entry() {
            if *e.key() >= a.cum {
                break;
            }
            let inf = e.remove();
            acked(cx, p, inf, now);
        }
        // The highest sequence number the peer has (`cum` - 1 when the bitmap is empty).
        let mut high = a.cum;
        for (i, byte) in bitmap.iter().enumerate() {
            if *byte == 0 {
                continue;
            }
            for bit in 0..8 {
                if byte & (1 << bit) != 0 {
                    let seq = a.cum.saturating_add(1 + (i * 8 + bit) as u64);
                    high = high.max(seq.saturating_add(1));
                    if let Some(inf) = p.inflight.remove(&seq) {
                        acked(cx, p, inf, now);
                    }
                }
            }
        }
        let conn = p.conn;
        if silence_ends {
            self.end_silence(cx, conn, high, now);
        }
        self.pump(cx, conn, now);
    }

    /// The peer answered after a silence: the packets held back meanwhile
    /// ([`InFlight::deferred`]) below the highest one it has are lost (it would have them
    /// otherwise: it takes them in order) and go again now; the others may still be on their
    /// way (a peer that was descheduled works through its backlog) and get a fresh timeout.
    fn end_silence(&mut self, cx: &mut Ctx, conn: u32, high: u64, now: Instant) {
        let Some(p) = self.tx.get_mut(&conn) else {
            return;
        };
        p.probe = None;
        p.probes = 0;
        let rto = p.rto(&cx.cfg, 0);
        let mut lost = Vec::new();
        for (&seq, inf) in p.inflight.iter_mut().filter(|(_, i)| i.deferred) {
            if seq < high {
                lost.push(seq);
            } else {
                inf.deferred = false;
                self.epoch += 1;
                inf.epoch = self.epoch;
                self.timers.push(Reverse(Timer {
                    at: now + rto,
                    conn,
                    kind: TimerKind::Packet {
                        seq,
                        epoch: self.epoch,
                    },
                }));
            }
        }
        for seq in lost {
            self.retransmit(cx, conn, seq, now);
        }
    }

    /// Handles a negative acknowledgement.
    pub fn on_nak(&mut self, cx: &mut Ctx, src: SocketAddr, n: &NakHdr, now: Instant) {
        let Srd {
            tx, timers, epoch, ..
        } = self;
        let Some(p) = peer_of(tx, cx, src, n.conn, n.src_qkey) else {
            return;
        };
        let conn = p.conn;
        p.last_heard = now;
        p.last_active = now;
        match n.reason.failure() {
            Some(status) => {
                if let Some(inf) = p.inflight.remove(&n.seq) {
                    cx.complete_send(inf.op.wr_id, status, 0);
                }
            }
            // Receiver not ready: retried.
            None => {
                stats::inc(&cx.counters().rnr_naks_received);
                let Some(inf) = p.inflight.get_mut(&n.seq) else {
                    return;
                };
                if inf.rnr_wait || inf.try_ != n.try_ {
                    return; // a NAK of an older attempt, or a duplicate
                }
                inf.rnr_count = inf.rnr_count.saturating_add(1);
                // Receiver not ready: send less to it, once per window (as for a loss), so a
                // receiver holding this sender back is not met by a window of retries per
                // interval; the window grows back as acknowledgements come.
                if n.seq >= p.recovery {
                    p.ssthresh = (p.cwnd / 2.0).max(MIN_CWND);
                    p.cwnd = MIN_CWND;
                    p.recovery = p.next_seq;
                }
                let Some(inf) = p.inflight.get_mut(&n.seq) else {
                    return;
                };
                if cx.rnr_retry != RNR_RETRY_INFINITE && inf.rnr_count > u32::from(cx.rnr_retry) {
                    if let Some(inf) = p.inflight.remove(&n.seq) {
                        cx.complete_send(inf.op.wr_id, Status::RnrRetryExceeded, 0);
                    }
                } else {
                    let wait = cx
                        .cfg
                        .rnr_retry_interval
                        .checked_mul(1u32 << (inf.rnr_count - 1).min(20))
                        .unwrap_or(cx.cfg.max_rnr_retry_interval)
                        .min(cx.cfg.max_rnr_retry_interval);
                    inf.rnr_wait = true;
                    *epoch += 1;
                    inf.epoch = *epoch;
                    timers.push(Reverse(Timer {
                        at: now + wait,
                        conn,
                        kind: TimerKind::Packet {
                            seq: n.seq,
                            epoch: *epoch,
                        },
                    }));
                    return;
                }
            }
        }
        self.pump(cx, conn, now);
    }

    fn timer_live(&self, t: &Timer) -> bool {
        let Some(p) = self.tx.get(&t.conn) else {
            return false;
        };
        match t.kind {
            TimerKind::Packet { seq, epoch } => {
                p.inflight.get(&seq).is_some_and(|i| i.epoch == epoch)
            }
            TimerKind::Unresponsive => p.unresp_armed,
        }
    }

    /// The earliest live timer (dropping dead ones from the top of the heap).
    pub fn next_deadline(&mut self) -> Option<Instant> {
        let ack = self.ack_deadline;
        min_opt(ack, self.next_timer())
    }

    fn next_timer(&mut self) -> Option<Instant> {
        while let Some(Reverse(t)) = self.timers.peek() {
            if self.timer_live(t) {
                let at = t.at;
                return Some(if self.tx.is_empty() && self.rx.is_empty() {
                    at
                } else {
                    at.min(self.next_sweep)
                });
            }
            self.timers.pop();
        }
        (!self.tx.is_empty() || !self.rx.is_empty()).then_some(self.next_sweep)
    }

    /// Runs every timer that is due.
    pub fn run_timers(&mut self, cx: &mut Ctx, now: Instant) {
        if self.ack_deadline.is_some_and(|d| d <= now) {
            self.flush_acks(cx, now, true);
        }
        while let Some(Reverse(t)) = self.timers.peek().copied() {
            if t.at > now {
                break;
            }
            self.timers.pop();
            if !self.timer_live(&t) {
                continue;
            }
            match t.kind {
                TimerKind::Packet { seq, .. } => self.retransmit(cx, t.conn, seq, now),
                TimerKind::Unresponsive => self.check_unresponsive(cx, t.conn, now),
            }
        }
        if now >= self.next_sweep {
            self.sweep(cx, now);
            self.next_sweep = now + cx.cfg.peer_idle_timeout / 4;
        }
    }

    fn retransmit(&mut self, cx: &mut Ctx, conn: u32, seq: u64, now: Instant) {
        let Some(p) = self.tx.get_mut(&conn) else {
            return;
        };
        let next_seq = p.next_seq;
        let silent = p.silent();
        let Some(inf) = p.inflight.get_mut(&seq) else {
            return;
        };
        let timeout = !inf.rnr_wait;
        if inf.rnr_wait {
            inf.rnr_wait = false;
        } else {
            if !silent {
                p.probes = 0;
            }
            if let Some((_, next)) = p.probe.filter(|&(_, next)| silent && now < next) {
                // The peer has said nothing since the last probe: this packet waits for the
                // next probe time (or for the answer that ends the silence).
                inf.deferred = true;
                self.epoch += 1;
                inf.epoch = self.epoch;
                self.timers.push(Reverse(Timer {
                    at: next,
                    conn,
                    kind: TimerKind::Packet {
                        seq,
                        epoch: self.epoch,
                    },
                }));
                return;
            }
            inf.retries += 1;
            if seq >= p.recovery {
                // One multiplicative decrease per window of losses.
                p.ssthresh = (p.cwnd / 2.0).max(MIN_CWND);
                p.cwnd = p.ssthresh;
                p.recovery = next_seq;
            }
        }
        stats::inc(&cx.counters().retransmits);
        let Some(inf) = p.inflight.get_mut(&seq) else {
            return;
        };
        inf.try_ = inf.try_.wrapping_add(1);
        inf.retransmitted = true;
        inf.deferred = false;
        inf.sent_at = now;
        self.epoch += 1;
        inf.epoch = self.epoch;
        let retries = inf.retries;
        let limit = (p.cwnd as usize).clamp(1, cx.cfg.max_inflight);
        let pack = pack_for(&self.packers, cx, p.addr, p.qkey);
        let rev = reverse(&mut self.rx, &self.rx_conn, p);
        transmit(cx, p, seq, rev, &mut self.bitmap, limit, pack, now);
        let at = if timeout {
            p.probes += 1;
            let at = now + p.rto(&cx.cfg, retries.max(p.probes));
            p.probe = Some((now, at));
            at
        } else {
            now + p.rto(&cx.cfg, retries)
        };
        self.timers.push(Reverse(Timer {
            at,
            conn,
            kind: TimerKind::Packet {
                seq,
                epoch: self.epoch,
            },
        }));
    }

    /// Packet `seq` of connection `conn` could not be sent, for good (the kernel refused it, not
    /// a transient loss): its send completes `UnreachableRemote`, and the window slot it held
    /// goes to the next pending send.
    pub fn send_failed(&mut self, cx: &mut Ctx, conn: u32, seq: u64, now: Instant) {
        let inf = self.tx.get_mut(&conn).and_then(|p| p.inflight.remove(&seq));
        if let Some(inf) = inf {
            cx.complete_send(inf.op.wr_id, Status::UnreachableRemote, 0);
            self.pump(cx, conn, now);
        }
    }

    fn check_unresponsive(&mut self, cx: &mut Ctx, conn: u32, now: Instant) {
        let Some(p) = self.tx.get_mut(&conn) else {
            return;
        };
        p.unresp_armed = false;
        if p.inflight.is_empty() {
            return;
        }
        let due = p.last_heard + cx.cfg.unresponsive_timeout;
        if now >= due {
            tracing::debug!(peer = %p.addr, qkey = p.qkey, "udp: peer unresponsive, failing its sends");
            fail_all(cx, p, Status::UnresponsiveRemote);
        } else {
            p.unresp_armed = true;
            self.timers.push(Reverse(Timer {
                at: due,
                conn,
                kind: TimerKind::Unresponsive,
            }));
        }
    }

    /// Forgets peers idle for longer than `peer_idle_timeout`.
    fn sweep(&mut self, cx: &Ctx, now: Instant) {
        let idle = cx.cfg.peer_idle_timeout;
        self.tx.retain(|_, p| {
            !p.inflight.is_empty()
                || !p.pending.is_empty()
                || now.saturating_duration_since(p.last_active) < idle
        });
        let tx = &self.tx;
        self.tx_by_addr.retain(|_, c| tx.contains_key(c));
        let mut gone = Vec::new();
        self.rx.retain(|k, r| {
            let keep = now.saturating_duration_since(r.last_active) < idle;
            if !keep {
                gone.push((*k, r.high));
            }
            keep
        });
        for (k, high) in gone {
            self.remember_forgotten(k, high);
        }
        let rx = &self.rx;
        self.rx_clock.retain(|k| rx.contains_key(k));
        self.rx_conn
            .retain(|(a, q), c| rx.contains_key(&(*a, *q, *c)));
    }

    /// Forgets one sender's receive state to make room: the first on the eviction clock not
    /// heard from since the clock last passed it (each packet sets its mark once, each pass
    /// clears it once, so this is O(1) amortized per packet, whatever senders an attacker
    /// makes up). Its highest sequence number is remembered, so nothing of it is delivered twice.
    fn evict_one(&mut self) {
        // Two passes at most: the first clears every mark.
        let mut budget = 2 * self.rx_clock.len() + 1;
        while let Some(k) = self.rx_clock.pop_front() {
            budget -= 1;
            let Some(r) = self.rx.get_mut(&k) else {
                continue; // already gone
            };
            if r.touched && budget > 0 {
                r.touched = false;
                self.rx_clock.push_back(k);
                continue;
            }
            let high = r.high;
            self.rx.remove(&k);
            if self.rx_conn.get(&(k.0, k.1)) == Some(&k.2) {
                self.rx_conn.remove(&(k.0, k.1));
            }
            tracing::debug!(peer = %k.0, "udp: too many senders, forgetting one");
            self.remember_forgotten(k, high);
            return;
        }
    }

    fn remember_forgotten(&mut self, k: RxKey, high: u64) {
        if self.forgotten.insert(k, high).is_none() {
            self.forgotten_order.push_back(k);
        }
        while self.forgotten_order.len() > MAX_FORGOTTEN {
            if let Some(old) = self.forgotten_order.pop_front() {
                self.forgotten.remove(&old);
            }
        }
    }

    /// Completes every outstanding send with `Flushed`.
    pub fn flush(&mut self, cx: &mut Ctx) {
        for p in self.tx.values_mut() {
            fail_all(cx, p, Status::Flushed);
        }
        self.timers.clear();
    }
}

/// The destination QKEY to pack datagrams to `(addr, qkey)` under, when packing is on and that
/// queue pair unpacks (it is in `packers`).
fn pack_for(packers: &Packers, cx: &Ctx, addr: SocketAddr, qkey: u32) -> Option<u32> {
    (cx.cfg.pack && packers.contains(addr, qkey)).then_some(qkey)
}

/// Asks `p`, not known to unpack, whether it does (an empty packed datagram with `HELLO`), before
/// its first packet and then every [`HELLO_EVERY`] packets until it answers. A peer of an older
/// wire drops the question as malformed, and is never sent a packed datagram.
fn hello(cx: &mut Ctx, p: &mut TxPeer, now: Instant) {
    p.since_hello += 1;
    if p.since_hello < HELLO_EVERY {
        return;
    }
    p.since_hello = 0;
    wire::encode_packed_header(&mut cx.out.tx, p.qkey, cx.qkey, true);
    cx.out.emit(p.addr, now);
}

/// Encodes and queues packet `seq` of `p`, with the acknowledgement due to the same peer riding
/// along. `limit` is the sender's current window; `pack`: packed with other datagrams to the
/// peer where they fit ([`Outbox::emit_parts`](super::link::Outbox::emit_parts)).
#[allow(clippy::too_many_arguments)]
fn transmit(
    cx: &mut Ctx,
    p: &TxPeer,
    seq: u64,
    rev: Option<&mut RxPeer>,
    bitmap: &mut Vec<u8>,
    limit: usize,
    pack: Option<u32>,
    now: Instant,
) {
    let Some(inf) = p.inflight.get(&seq) else {
        return;
    };
    let base = p.base();
    // Ask for an acknowledgement at once when the window is full, more waits, or this is a
    // re-send: the sender is held up until it comes.
    let ack_req = inf.try_ > 0
        || p.inflight.len() >= limit
        || !p.pending.is_empty()
        || p.next_seq >= base + WINDOW;
    let h = DataHdr {
        src_qkey: cx.qkey,
        conn: p.conn,
        try_: inf.try_,
        seq,
        base,
        imm: inf.op.imm,
        ack_req,
        rdma: inf.op.rdma,
    };
    let ack = match rev {
        Some(r) if r.ack_pending => Some(r.take_ack(cx.qkey, bitmap)),
        _ => None,
    };
    let len = inf.op.len();
    wire::encode_data_header(
        &mut cx.out.tx,
        p.qkey,
        &h,
        ack.as_ref().map(|a| (a, &bitmap[..])),
        len,
    );
    let tag = Tag::Srd { conn: p.conn, seq };
    let parts = Parts {
        hdr: &inf.op.hdr,
        payload: &inf.op.payload,
        region: inf.op.region.as_ref(),
    };
    cx.out.emit_parts(p.addr, now, parts, tag, pack);
}

/// The receive state of the reverse direction of `p` (whose acknowledgement may ride along).
fn reverse<'a>(
    rx: &'a mut HashMap<RxKey, RxPeer>,
    rx_conn: &HashMap<(Addr, u32), u32>,
    p: &TxPeer,
) -> Option<&'a mut RxPeer> {
    let addr = Addr(p.addr);
    let conn = rx_conn.get(&(addr, p.qkey))?;
    rx.get_mut(&(addr, p.qkey, *conn))
}

fn send_nak(cx: &mut Ctx, src: SocketAddr, h: &DataHdr, reason: NakReason, now: Instant) {
    let n = NakHdr {
        src_qkey: cx.qkey,
        conn: h.conn,
        try_: h.try_,
        seq: h.seq,
        reason,
    };
    wire::encode_nak(&mut cx.out.tx, h.src_qkey, &n);
    cx.out.emit(src, now);
}

/// A packet was acknowledged: complete its send, sample the round trip, open the window.
fn acked(cx: &mut Ctx, p: &mut TxPeer, inf: InFlight, now: Instant) {
    if !inf.retransmitted {
        p.on_rtt_sample(now.saturating_duration_since(inf.sent_at));
    }
    if p.cwnd < p.ssthresh {
        p.cwnd += 1.0;
    } else {
        p.cwnd += 1.0 / p.cwnd;
    }
    p.cwnd = p.cwnd.min(cx.cfg.max_inflight as f64);
    cx.complete_send(inf.op.wr_id, Status::Success, inf.op.len());
}

/// Completes every outstanding send of `p` with `status`.
fn fail_all(cx: &mut Ctx, p: &mut TxPeer, status: Status) {
    for (_, inf) in std::mem::take(&mut p.inflight) {
        cx.complete_send(inf.op.wr_id, status, 0);
    }
    for op in p.pending.drain(..) {
        cx.complete_send(op.wr_id, status, 0);
    }
    p.cwnd = INITIAL_CWND.min(cx.cfg.max_inflight as f64);
    p.ssthresh = cx.cfg.max_inflight as f64;
    p.recovery = p.next_seq;
}

/// The send peer an ack or NAK is for, checking that it came from that peer.
fn peer_of<'a>(
    tx: &'a mut HashMap<u32, TxPeer>,
    cx: &Ctx,
    src: SocketAddr,
    conn: u32,
    src_qkey: u32,
) -> Option<&'a mut TxPeer> {
    match tx.get_mut(&conn) {
        Some(p) if p.qkey == src_qkey && same_addr(p.addr, src) => Some(p),
        _ => {
            stats::inc(&cx.counters().stale_dropped);
            tracing::trace!(%src, conn, src_qkey, "udp: ack or NAK for no known peer");
            None
        }
    }
}

/// Whether an ack or NAK from `src` can come from the peer we send to at `dest`: the same
/// socket address (an IPv4 address and its IPv4-mapped IPv6 form being the same). Sending to an
/// unspecified address (`0.0.0.0`, `::`) reaches this host, whose answer comes from a loopback
/// address.
fn same_addr(dest: SocketAddr, src: SocketAddr) -> bool {
    let (d, s) = (dest.ip().to_canonical(), src.ip().to_canonical());
    dest.port() == src.port() && (d == s || (d.is_unspecified() && s.is_loopback()))
}
