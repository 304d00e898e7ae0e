//! The same-host path: messages to peers on this host go through shared-memory message
//! channels ([`chan`]) instead of the protocol engine's packets, as libfabric's EFA provider
//! hands same-host peers to its shm provider. Matching, ordering and receive completions are
//! the engine's (reached through its narrow [`SameHost`] interface), so an application sees no
//! difference but speed. The path owns its send bookkeeping, its send completions and its
//! counters ([`LocalStats`]); the RDM endpoint hands it sends and progress passes and takes
//! its completions.
//!
//! * **Which peers.** A destination is local when a live channel named after its raw address
//!   exists in the device's shm directory ([`Device::local_dir`](crate::device::Device)), owned
//!   by this user in this network namespace. The answer is cached for the endpoint's life, so
//!   every message to one peer takes the same path (send-after-send order holds within each).
//! * **Sending.** A message goes as chunks of up to one slot (16 KiB) into the peer's ring, in
//!   order; what does not fit waits in a per-peer queue and goes as slots free up. A send
//!   completes once its last chunk is consumed by the peer, or, with delivery complete, when
//!   the receiver acknowledges that the message is in its buffer.
//! * **Receiving.** Each progress pass reads the own ring: a first chunk is matched against the
//!   posted receives (or becomes unexpected) and copied straight from the slot into the
//!   receive buffer; further chunks follow it. A chunk the engine would have to hold beyond its
//!   memory bounds stays in the ring until there is room (back-pressure; nothing is dropped).
//! * **Waking.** While the application busy-polls, senders make no system call. When it stops
//!   polling, a waiter thread ([`waiter`]) sleeps on the channel's futex and wakes the
//!   endpoint's completion queues when a chunk arrives (senders see it asleep and ring its
//!   doorbell).
//! * **Failure.** Every 10 ms while sends to a peer wait, its channel is checked: a closed or
//!   dead peer fails them with `UnresponsiveRemote`. One-sided RMA and atomics stay on the
//!   engine and the device.
//!
//! The path is written against [`ring::Channels`]: the shared-memory files in production, and
//! in-memory rings (`mem`) with which the simulator drives it in virtual time with seeded
//! faults.

mod chan;
#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(test)]
mod mem;
mod recv;
mod ring;
mod send;
#[cfg(test)]
mod sim_tests;
mod waiter;

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

pub(crate) use self::chan::ShmChannels;
use self::chan::{Geometry, OwnChan};
use self::ring::{Channels, Liveness, OpenError, PeerRing};
pub(crate) use self::waiter::WaiterGate;
use self::waiter::{Pace, Waiter};
use crate::addr::RawAddr;
use crate::cq::ProgressSource;
use crate::device::Status;
use crate::mem::RegionSlice;
use crate::notify::Notifier;
use crate::progress::{Clock, busy_polling};
use crate::proto::engine::{Engine, Event};
use crate::shmem::map;
use crate::stats::EndpointStats;

/// Slots of a channel's ring.
const SLOTS: u32 = 256;
/// Bytes of data per slot: with the 64-byte header a slot is 16 KiB, a multiple of 128, so a
/// slot's header and its first 64 bytes of data share an aligned pair of cache lines (which the
/// CPU fetches together).
const CHUNK: u32 = (16 << 10) - 64;
/// Slots read per progress pass at most.
const DRAIN_BATCH: usize = 64;
/// A slot reserved and not published for this long is given up (its producer died between the
/// two steps).
const STUCK_SLOT: Duration = Duration::from_secs(5);
/// Idle busy polls between two looks for such a slot.
const STUCK_CHECK_POLLS: u64 = 4096;
/// How often peers with waiting sends are checked for life.
const CHECK_EVERY: Duration = Duration::from_millis(10);
/// Progress passes without any send completing or moving, while sends wait, between two looks
/// at the clock (for the liveness checks).
const STUCK_PASSES: u32 = 64;
/// A busy-polling endpoint looks whether its sends were consumed every this many passes.
const REAP_EVERY: u64 = 32;
/// The application finds by itself that it busy-polls when this many of its passes come at the
/// busy-poll rate (`progress::busy_polling`): the waiter then stands aside at once, instead of
/// after its next look, and peers stop ringing its doorbell.
const APP_SAMPLE: u64 = 64;

/// The path's own counters; the endpoint's statistics add them in ([`LocalPath::add_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LocalStats {
    /// Messages sent (completed successfully, or injected).
    pub tx_msgs: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Sends that failed (a peer gone).
    pub tx_errors: u64,
    /// Malformed slots dropped from the own ring.
    pub dropped: u64,
}

/// One message for the path to send.
pub(crate) struct LocalSend {
    /// The endpoint's operation; its completion carries it back (`SendDone::context`).
    pub context: u64,
    pub tag: Option<u64>,
    pub data: Option<u32>,
    pub delivery_complete: bool,
    /// The bytes; empty when they are read from `region` (a slice of `len` bytes).
    pub buf: Bytes,
    pub region: Option<RegionSlice>,
    pub len: usize,
}

/// A send (or acknowledgement) waiting for room in a peer's ring.
enum Out {
    Msg(OutMsg),
    DcAck(u32),
}

struct OutMsg {
    context: u64,
    tag: Option<u64>,
    data: Option<u32>,
    /// Delivery complete: its token.
    dc: Option<u32>,
    /// The bytes (empty when they are read from the region).
    buf: Bytes,
    region: Option<RegionSlice>,
    len: usize,
    /// Bytes in the ring so far.
    sent: usize,
    started: bool,
    /// Ring position of the last chunk pushed.
    last: u64,
}

/// A send whose chunks are all in the peer's ring, waiting for the peer to consume the last
/// one (transmit complete, as the device's acknowledgement).
struct Unconsumed {
    context: u64,
    pos: u64,
    tag: Option<u64>,
    buf: Bytes,
    len: usize,
}

struct Peer<P> {
    /// `None` once the peer is gone: its mapping and file descriptor are let go.
    chan: Option<P>,
    addr: RawAddr,
    queue: VecDeque<Out>,
    /// Closed or dead: every send to it fails at once.
    gone: Option<Liveness>,
    /// Delivery-complete sends waiting for its acknowledgement.
    dc_waiting: usize,
    /// Sends waiting for the peer to consume their last chunk.
    unconsumed: VecDeque<Unconsumed>,
}

/// A message from one sender whose further chunks are still coming.
struct Inbound {
    /// The engine's id (`None`: dropped, its chunks are skipped).
    rid: Option<u32>,
    next: usize,
    len: usize,
}

/// A delivery-complete send waiting for its acknowledgement.
struct DcWait {
    context: u64,
    peer: usize,
    tag: Option<u64>,
    buf: Bytes,
    len: usize,
}

/// The same-host path of one RDM endpoint, over channels `C`.
pub(crate) struct LocalPath<C: Channels = ShmChannels> {
    chans: C,
    /// What the waiter (or the simulator) and the path share.
    pace: Arc<Pace>,
    /// The waiter thread (none in the simulator, which drives the path itself).
    waiter: Option<Waiter>,
    me: [u8; 24],
    routes: HashMap<RawAddr, Option<usize>>,
    last: Option<(RawAddr, Option<usize>)>,
    peers: Vec<Peer<C::Peer>>,
    /// Items waiting in peer queues.
    queued: usize,
    /// Peers with sends waiting to be consumed.
    consuming: Vec<usize>,
    inbound: HashMap<RawAddr, Inbound>,
    dc: HashMap<u32, DcWait>,
    next_token: u32,
    /// Local sends not completed yet.
    inflight: usize,
    max_inflight: usize,
    /// Send completions for the endpoint to deliver.
    events: VecDeque<Event>,
    next_check: Option<Instant>,
    /// Chunks left in the ring for lack of memory (back-pressure), counted once per stall.
    blocked: bool,
    /// Passes in a row in which waiting sends did not move.
    stuck: u32,
    /// The last drain stopped at its batch limit: more may be in the ring.
    more: bool,
    /// A reserved, unpublished head slot and since when (see `STUCK_SLOT`).
    stuck_head: Option<(u64, Instant)>,
    /// When the application's last `APP_SAMPLE` passes began (its own busy-poll detector).
    app_mark: Option<Instant>,
    stats: LocalStats,
}

impl<P: PeerRing> Peer<P> {
    /// Whether the peer is still there: what an earlier check found, else its channel's word.
    fn liveness(&self) -> Liveness {
        match (self.gone, &self.chan) {
            (Some(l), _) => l,
            (None, Some(c)) => c.liveness(),
            (None, None) => Liveness::Closed,
        }
    }

    /// The channel, when a chunk of `len` bytes may go straight into it: the peer is there,
    /// nothing waits for it before this chunk, and the chunk fits a slot.
    fn straight_in(&self, len: usize) -> Option<&P> {
        self.chan
            .as_ref()
            .filter(|c| self.queue.is_empty() && len <= c.chunk())
    }

    /// The peer is gone: sends to it fail from now on, and its channel is unmapped.
    fn set_gone(&mut self, l: Liveness) {
        self.gone = Some(l);
        self.chan = None;
    }
}

impl LocalPath<ShmChannels> {
    /// Opens the local path of the endpoint at `addr` in the shm directory `dir`. `None` (after
    /// a log line) when it cannot: the endpoint then uses the engine for every peer.
    pub(crate) fn open(
        dir: &Path,
        addr: &RawAddr,
        max_inflight: usize,
        notifier: &Notifier,
    ) -> Option<LocalPath> {
        static SWEPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let uid = map::uid();
        if !SWEPT.swap(true, Ordering::Relaxed) {
            let n = crate::shmem::dir::sweep_all(dir, uid);
            if n > 0 {
                tracing::info!(dir = %dir.display(), n, "local path: removed stale channels of dead processes");
            }
        }
        let netns = chan::fnv(&crate::shmem::netns());
        let geo = Geometry::new(SLOTS, CHUNK)?;
        let own = match OwnChan::create(dir, uid, netns, addr, geo) {
            Ok(Some(c)) => c,
            Ok(None) => {
                tracing::warn!(%addr, "local path: another live endpoint has this address; same-host peers reach this one through the device");
                return None;
            }
            Err(e) => {
                tracing::warn!(%addr, error = %e, "local path: cannot create the channel; same-host peers reach this endpoint through the device");
                return None;
            }
        };
        let ring = own.ring().clone();
        let chans = ShmChannels {
            own,
            dir: dir.to_path_buf(),
            uid,
            netns,
        };
        let mut path = LocalPath::new(chans, addr, max_inflight);
        match Waiter::start(&path.pace, &ring, addr.qpn, notifier) {
            Ok(w) => path.waiter = Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "local path: no waiter thread; same-host peers reach this endpoint through the device");
                return None;
            }
        }
        Some(path)
    }

    /// The handle that keeps the waiter from the endpoint while the application drops it.
    pub(crate) fn gate(&self) -> Option<WaiterGate> {
        self.waiter.as_ref().map(Waiter::gate)
    }

    /// The endpoint the waiter thread drives while the application does not poll.
    pub(crate) fn set_source(&self, source: Weak<dyn ProgressSource>) {
        if let Some(w) = &self.waiter {
            w.set_source(source);
        }
    }
}

impl<C: Channels> LocalPath<C> {
    /// The path of the endpoint at `addr` over `chans`, with at most `max_inflight` sends in
    /// flight; no waiter (the caller drives it).
    fn new(chans: C, addr: &RawAddr, max_inflight: usize) -> LocalPath<C> {
        LocalPath {
            chans,
            pace: Arc::new(Pace::default()),
            waiter: None,
            me: ring::encode_addr(addr),
            routes: HashMap::new(),
            last: None,
            peers: Vec::new(),
            queued: 0,
            consuming: Vec::new(),
            inbound: HashMap::new(),
            dc: HashMap::new(),
            next_token: 1,
            inflight: 0,
            max_inflight: max_inflight.max(1),
            events: VecDeque::new(),
            next_check: None,
            blocked: false,
            stuck: 0,
            more: false,
            stuck_head: None,
            app_mark: None,
            stats: LocalStats::default(),
        }
    }

    /// The peer index of `dest` when it is reached through the local path.
    #[inline]
    pub(crate) fn route(&mut self, engine: &mut Engine, dest: &RawAddr) -> Option<usize> {
        match self.last {
            Some((a, r)) if a == *dest => r,
            _ => self.route_slow(engine, dest),
        }
    }

    /// [`Self::route`] past the last destination: the table, or a first look for a channel.
    #[cold]
    #[inline(never)]
    fn route_slow(&mut self, engine: &mut Engine, dest: &RawAddr) -> Option<usize> {
        let r = match self.routes.get(dest) {
            Some(r) => *r,
            None => {
                let r = match self.chans.open_peer(dest) {
                    Ok(chan) => {
                        tracing::debug!(%dest, "local path: peer on this host");
                        engine.same_host().contact(*dest);
                        self.peers.push(Peer {
                            chan: Some(chan),
                            addr: *dest,
                            queue: VecDeque::new(),
                            gone: None,
                            dc_waiting: 0,
                            unconsumed: VecDeque::new(),
                        });
                        Some(self.peers.len() - 1)
                    }
                    Err(OpenError::Absent) => None,
                    Err(OpenError::Unusable(why)) => {
                        tracing::debug!(%dest, why, "local path: channel not usable; the peer goes through the device");
                        None
                    }
                };
                // Kept for the endpoint's life, "remote" answers too (one entry per peer ever
                // addressed, as the engine keeps one per peer): a peer that switched paths
                // mid-stream could see a message overtake the ones before it.
                self.routes.insert(*dest, r);
                r
            }
        };
        self.last = Some((*dest, r));
        r
    }

    /// Room for one more send (`Again` otherwise).
    pub(crate) fn has_room(&self) -> bool {
        self.inflight < self.max_inflight
    }

    /// The next send completion for the endpoint to deliver.
    #[inline]
    pub(crate) fn pop_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Send completions wait to be delivered.
    #[inline]
    pub(crate) fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// The last pass stopped at its batch limit: more may be in the ring.
    #[inline]
    pub(crate) fn more(&self) -> bool {
        self.more
    }

    /// The path's counters.
    #[cfg(test)]
    pub(crate) fn stats(&self) -> LocalStats {
        self.stats
    }

    /// Adds the path's counters to the endpoint's (`tx_msgs`, `tx_bytes` and `errors` count
    /// both paths; `local_tx_msgs` this one).
    pub(crate) fn add_stats(&self, s: &mut EndpointStats) {
        s.tx_msgs += self.stats.tx_msgs;
        s.tx_bytes += self.stats.tx_bytes;
        s.local_tx_msgs += self.stats.tx_msgs;
        s.errors += self.stats.tx_errors;
        s.dropped_pkts += self.stats.dropped;
    }

    /// Tells the waiter whether sends wait (for room, consumption or acknowledgement) or a
    /// message is only partly here: it then looks every millisecond.
    fn publish_waiting(&self) {
        let w = self.sends_wait() || !self.inbound.is_empty();
        self.pace.waiting.store(w, Ordering::Relaxed);
    }

    /// Sends wait for room in a ring, for their consumption or for an acknowledgement.
    fn sends_wait(&self) -> bool {
        self.queued > 0 || !self.consuming.is_empty() || !self.dc.is_empty()
    }

    /// Whether the path needs passes while nothing arrives (sends or a message wait, or a
    /// reserved slot blocks the ring): whoever drives it besides the application then comes
    /// every millisecond.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> bool {
        self.pace.waiting.load(Ordering::Relaxed) || self.chans.reserved_head().is_some()
    }

    /// One progress step: reads the own ring into the engine, answers delivery-complete
    /// messages, retries waiting sends and checks on peers. True when anything moved.
    pub(crate) fn progress(&mut self, engine: &mut Engine, clock: &mut Clock) -> bool {
        let polls = self.pace.polls.count();
        if !self.pace.app_polls.load(Ordering::Relaxed) {
            self.chans.awake();
            if polls.is_multiple_of(APP_SAMPLE) {
                self.sample_app_polls(clock);
            }
        }
        let drained = self.drain(engine, clock);
        let mut busy = drained;
        if busy {
            self.stuck_head = None;
        } else if polls.is_multiple_of(STUCK_CHECK_POLLS)
            || !self.pace.app_polls.load(Ordering::Relaxed)
        {
            self.check_stuck(clock);
        }
        while let Some((src, token)) = engine.same_host().take_receipt() {
            busy = true;
            match self.route(engine, &src) {
                Some(p) => {
                    // A sender that is gone waits for no acknowledgement.
                    if let Some(peer) = self.peers.get_mut(p).filter(|x| x.gone.is_none()) {
                        peer.queue.push_back(Out::DcAck(token));
                        self.queued += 1;
                        self.flush_peer(p);
                    }
                }
                None => {
                    tracing::debug!(%src, "local path: delivery-complete acknowledgement for a peer without a channel")
                }
            }
        }
        let mut moved = false;
        if self.queued > 0 {
            for p in 0..self.peers.len() {
                if self.peers.get(p).is_some_and(|x| !x.queue.is_empty()) {
                    moved |= self.flush_peer(p);
                }
            }
        }
        // Whether the peer consumed a slot is read from the peer's ring, whose cache line the
        // peer is working on: a busy-polling application looks only every few passes.
        let look = polls.is_multiple_of(REAP_EVERY) || !self.pace.app_polls.load(Ordering::Relaxed);
        if look && !self.consuming.is_empty() {
            moved |= self.reap();
        }
        busy |= moved;
        // Sends wait for their peers, or a message is only partly here: when nothing moves for
        // them, look at the clock now and then and check on the peers (a dead one fails them).
        let sends_wait = self.sends_wait();
        let progressed = if sends_wait { moved } else { drained };
        let nothing_waits = !sends_wait && self.inbound.is_empty();
        if progressed || nothing_waits {
            self.stuck = 0;
        } else {
            self.stuck += 1;
            if self.stuck >= STUCK_PASSES {
                self.stuck = 0;
                let now = clock.now();
                match self.next_check {
                    None => self.next_check = Some(now + CHECK_EVERY),
                    Some(t) if t <= now => self.check(engine, now),
                    Some(_) => {}
                }
            }
        }
        self.publish_waiting();
        busy
    }

    /// On the application's passes while it does not count as busy-polling: when its last
    /// `APP_SAMPLE` passes came at the busy-poll rate, it does, and the waiter's doorbell goes
    /// quiet (the waiter, if napping, finds that out when it wakes).
    fn sample_app_polls(&mut self, clock: &mut Clock) {
        if self.pace.driving.load(Ordering::Relaxed) {
            return;
        }
        let now = clock.now();
        if self
            .app_mark
            .is_some_and(|t| busy_polling(APP_SAMPLE, now.saturating_duration_since(t)))
        {
            self.pace.app_polls.store(true, Ordering::Relaxed);
            self.chans.quiet();
        }
        self.app_mark = Some(now);
    }

    /// Checks the peers we wait for; fails everything waiting for one that is gone.
    fn check(&mut self, engine: &mut Engine, now: Instant) {
        self.next_check = None;
        let mut again = false;
        // A sender that went away in the middle of a message: the receive it matched fails now
        // (not after the engine's stall timeout), and the peer counts as gone below.
        // While slots wait in the own ring (this side held back, or a batch limit), the rest of
        // the message may be among them.
        let partial: Vec<RawAddr> = if self.chans.ready() {
            again = !self.inbound.is_empty();
            Vec::new()
        } else {
            self.inbound.keys().copied().collect()
        };
        for src in partial {
            let Some(i) = self.route(engine, &src) else {
                continue;
            };
            if self
                .find_gone(i, "a sender gone in the middle of a message")
                .is_none()
            {
                again = true;
                continue;
            }
            if let Some(rid) = self.inbound.remove(&src).and_then(|inb| inb.rid) {
                engine.same_host().abort(rid);
            }
        }
        for i in 0..self.peers.len() {
            let waits = |p: &Peer<C::Peer>| {
                !p.queue.is_empty() || p.dc_waiting > 0 || !p.unconsumed.is_empty()
            };
            if !self.peers.get(i).is_some_and(waits) {
                continue;
            }
            let Some(l) = self.find_gone(i, "a peer gone; its sends fail") else {
                again = true;
                continue;
            };
            self.fail_peer(i, l);
        }
        if again {
            self.next_check = Some(now + CHECK_EVERY);
        }
    }

    /// `None` while peer `i` is alive. Otherwise why it is gone: the first time, it is marked
    /// gone (its channel let go) and, when it died, what else it left behind is removed too.
    fn find_gone(&mut self, i: usize, what: &str) -> Option<Liveness> {
        let p = self.peers.get_mut(i)?;
        let l = p.liveness();
        if l == Liveness::Alive {
            return None;
        }
        if p.gone.is_none() {
            tracing::debug!(peer = %p.addr, ?l, "local path: {what}");
            p.set_gone(l);
            if l == Liveness::Dead {
                self.chans.peer_died();
            }
        }
        Some(l)
    }

    /// When the next check is due.
    pub(crate) fn next_timer(&self) -> Option<Instant> {
        self.next_check
    }

    /// Closes the channel (peers see it closed) and completes every local send with `Flushed`.
    pub(crate) fn close(&mut self) {
        self.chans.close();
        for i in 0..self.peers.len() {
            self.end_peer(i, Status::Flushed);
        }
        self.queued = 0;
        self.consuming.clear();
        if let Some(w) = self.waiter.as_mut() {
            w.stop();
        }
    }
}
