//! The RDM endpoint's local fast path: messages to peers on this host go through shared-memory
//! message channels ([`chan`]) instead of the protocol engine's packets, as libfabric's EFA
//! provider hands same-host peers to its shm provider. Matching, ordering and completions are
//! the engine's (its `local_*` entry points), so an application sees no difference but speed.
//!
//! * **Which peers.** A destination is local when a live channel named after its raw address
//!   exists in the device's shm directory ([`Device::local_dir`](crate::device::Device)), owned
//!   by this user in this network namespace. The answer is cached for the endpoint's life, so
//!   every message to one peer takes the same path (send-after-send order holds within each).
//! * **Sending.** A message goes as chunks of up to one slot (16 KiB) into the peer's ring, in
//!   order; what does not fit waits in a per-peer queue and goes as slots free up. A send
//!   completes once its last chunk is in the ring (the ring loses nothing and is read in order),
//!   or, with delivery complete, when the receiver acknowledges that the message is in its
//!   buffer.
//! * **Receiving.** Each progress pass reads the own ring: a first chunk is matched against the
//!   posted receives (or becomes unexpected) and copied straight from the slot into the
//!   receive buffer; further chunks follow it. A chunk the engine would have to hold beyond its
//!   memory bounds stays in the ring until there is room (back-pressure; nothing is dropped).
//! * **Waking.** While the application busy-polls, senders make no system call. When it stops
//!   polling, a waiter thread sleeps on the channel's futex and wakes the endpoint's completion
//!   queues when a chunk arrives (senders see it asleep and ring its doorbell).
//! * **Failure.** Every 10 ms while sends to a peer wait, its channel is checked: a closed or
//!   dead peer fails them with `UnresponsiveRemote`. One-sided RMA and atomics stay on the
//!   engine and the device.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use slab::Slab;

use super::rdm::{Clock, OpState, SendOptions};
use crate::addr::RawAddr;
use crate::cq::ProgressSource;
use crate::device::Status;
use crate::device::shm::chan::{
    self, F_DATA, F_DC, F_TAGGED, Geometry, K_DC_ACK, K_MSG, K_NEXT, Liveness, OwnChan, OwnRing,
    PeerChan, SlotHdr,
};
use crate::device::shm::map;
use crate::error::Error;
use crate::notify::{Notifier, SleepHook};
use crate::proto::engine::{Engine, Event, LocalMsg, SendDone};

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
/// How long the waiter stays aside while the application busy-polls before it looks again
/// (the application going to sleep on a completion queue wakes it at once, `WaiterHook`).
const BUSY_WINDOW: Duration = Duration::from_millis(20);
/// A busy-polling endpoint looks whether its sends were consumed every this many passes.
const REAP_EVERY: u64 = 32;
/// Polls per millisecond from which the application counts as busy-polling.
const BUSY_POLLS: u64 = 256;
/// The application finds by itself that it busy-polls when this many of its passes take less
/// than `APP_SAMPLE_SPAN` (the rate of `BUSY_POLLS`): the waiter then stands aside at once,
/// instead of after its next look, and peers stop ringing its doorbell.
const APP_SAMPLE: u64 = 64;
const APP_SAMPLE_SPAN: Duration = Duration::from_micros(1000 * APP_SAMPLE / BUSY_POLLS);

/// What the endpoint and its waiter thread share.
struct Shared {
    ring: Arc<OwnRing>,
    /// Progress passes so far (the waiter's busy-poll detector).
    polls: AtomicU64,
    /// Sends wait for room or for the peer (the waiter progresses the endpoint now and then).
    waiting: AtomicBool,
    /// The application busy-polls (the waiter's finding).
    app_polls: AtomicBool,
    /// A thread is about to sleep on the endpoint's completion queues (the sleep hook).
    sleeping: AtomicBool,
    stop: AtomicBool,
    /// The endpoint, which the waiter drives while the application does not poll.
    source: OnceLock<Weak<dyn ProgressSource>>,
    /// The waiter holds the endpoint (a strong reference) for a progress pass.
    driving: AtomicBool,
    /// The application's handle is being dropped: the waiter takes no strong reference.
    paused: AtomicBool,
}

impl Shared {
    /// One progress pass of the endpoint from the waiter, unless the handle is being dropped.
    /// (Otherwise the waiter could end up with the last reference, and the endpoint would be
    /// closed on its thread, after the application's thread went on — maybe out of `main`,
    /// with the channel file still there.)
    fn drive(&self) {
        self.driving.store(true, Ordering::SeqCst);
        if !self.paused.load(Ordering::SeqCst) {
            if let Some(src) = self.source.get().and_then(Weak::upgrade) {
                src.progress();
            }
        }
        self.driving.store(false, Ordering::SeqCst);
    }
}

/// Lets the application's handle keep the waiter from holding the endpoint while it drops it.
pub(super) struct WaiterGate(Arc<Shared>);

impl WaiterGate {
    /// Stops the waiter from taking the endpoint and waits for a pass it is in to end.
    pub(super) fn pause(&self) {
        self.0.paused.store(true, Ordering::SeqCst);
        while self.0.driving.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }

    /// Lets the waiter drive the endpoint again.
    pub(super) fn resume(&self) {
        self.0.paused.store(false, Ordering::SeqCst);
    }
}

/// A send (or acknowledgement) waiting for room in a peer's ring.
enum Out {
    Msg(OutMsg),
    DcAck(u32),
}

struct OutMsg {
    /// The operation (`State::ops`).
    key: usize,
    tag: Option<u64>,
    data: Option<u32>,
    /// Delivery complete: its token.
    dc: Option<u32>,
    /// The bytes (empty when they are read from the operation's region).
    buf: Bytes,
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
    key: usize,
    pos: u64,
    tag: Option<u64>,
    buf: Bytes,
    len: usize,
}

struct Peer {
    /// `None` once the peer is gone: its mapping and file descriptor are let go.
    chan: Option<PeerChan>,
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
    key: usize,
    peer: usize,
    tag: Option<u64>,
    buf: Bytes,
    len: usize,
}

/// The header of a message's first chunk.
fn first_hdr(tag: Option<u64>, data: Option<u32>, dc: Option<u32>, len: usize) -> SlotHdr {
    let mut flags = 0;
    if tag.is_some() {
        flags |= F_TAGGED;
    }
    if data.is_some() {
        flags |= F_DATA;
    }
    if dc.is_some() {
        flags |= F_DC;
    }
    SlotHdr {
        kind: K_MSG,
        flags,
        len: 0,
        tag: tag.unwrap_or(0),
        word: len as u64,
        data: data.unwrap_or(0),
        token: dc.unwrap_or(0),
    }
}

/// The local fast path of one RDM endpoint.
pub(super) struct LocalPath {
    own: OwnChan,
    /// Registered on the endpoint's notifier (kept alive here).
    _hook: Arc<dyn SleepHook>,
    shared: Arc<Shared>,
    waiter: Option<JoinHandle<()>>,
    me: [u8; 24],
    dir: std::path::PathBuf,
    uid: u32,
    netns: u64,
    routes: HashMap<RawAddr, Option<usize>>,
    last: Option<(RawAddr, Option<usize>)>,
    peers: Vec<Peer>,
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
    /// Send completions for the pump to deliver.
    pub(super) events: VecDeque<Event>,
    next_check: Option<Instant>,
    /// Chunks left in the ring for lack of memory (back-pressure), counted once per stall.
    blocked: bool,
    /// Passes in a row in which waiting sends did not move.
    stuck: u32,
    /// The last drain stopped at its batch limit: more may be in the ring.
    pub(super) more: bool,
    /// A reserved, unpublished head slot and since when (see `STUCK_SLOT`).
    stuck_head: Option<(u64, Instant)>,
    /// When the application's last `APP_SAMPLE` passes began (its own busy-poll detector).
    app_mark: Option<Instant>,
}

impl Peer {
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
    fn straight_in(&self, len: usize) -> Option<&PeerChan> {
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

impl LocalPath {
    /// Opens the local path of the endpoint at `addr` in the shm directory `dir`. `None` (after
    /// a log line) when it cannot: the endpoint then uses the engine for every peer.
    pub(super) fn open(
        dir: &Path,
        addr: &RawAddr,
        max_inflight: usize,
        notifier: &Notifier,
    ) -> Option<LocalPath> {
        static SWEPT: AtomicBool = AtomicBool::new(false);
        let uid = map::uid();
        if !SWEPT.swap(true, Ordering::Relaxed) {
            let n = chan::sweep(dir, uid);
            if n > 0 {
                tracing::info!(dir = %dir.display(), n, "local path: removed stale channels of dead processes");
            }
        }
        let netns = chan::fnv(&crate::device::route::dir::netns());
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
        let shared = Arc::new(Shared {
            ring: own.ring().clone(),
            polls: AtomicU64::new(0),
            waiting: AtomicBool::new(false),
            app_polls: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            source: OnceLock::new(),
            driving: AtomicBool::new(false),
            paused: AtomicBool::new(false),
        });
        let s = shared.clone();
        let waiter = std::thread::Builder::new()
            .name(format!("efa-local-{}", addr.qpn))
            .spawn(move || waiter(s));
        let waiter = match waiter {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "local path: no waiter thread; same-host peers reach this endpoint through the device");
                return None;
            }
        };
        let hook: Arc<dyn SleepHook> = Arc::new(WaiterHook(Arc::downgrade(&shared)));
        notifier.add_sleep_hook(Arc::downgrade(&hook));
        Some(LocalPath {
            own,
            _hook: hook,
            shared,
            waiter: Some(waiter),
            me: chan::encode_addr(addr),
            dir: dir.to_path_buf(),
            uid,
            netns,
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
        })
    }

    /// The peer index of `dest` when it is reached through the local path.
    #[inline]
    pub(super) fn route(&mut self, engine: &mut Engine, dest: &RawAddr) -> Option<usize> {
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
                let r = match PeerChan::open(&self.dir, self.uid, self.netns, dest) {
                    Ok(chan) => {
                        tracing::debug!(%dest, pid = chan.pid, "local path: peer on this host");
                        engine.local_contact(*dest);
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
                    Err(chan::OpenError::Absent) => None,
                    Err(chan::OpenError::Unusable(why)) => {
                        tracing::debug!(%dest, why, "local path: channel not usable; the peer goes through the device");
                        None
                    }
                };
                if self.routes.len() >= 1 << 16 {
                    self.routes.retain(|_, r| r.is_some());
                }
                self.routes.insert(*dest, r);
                r
            }
        };
        self.last = Some((*dest, r));
        r
    }

    /// Room for one more send (`Again` otherwise).
    pub(super) fn has_room(&self) -> bool {
        self.inflight < self.max_inflight
    }

    /// Sends the message of operation `key` (`buf`, or the region of `ops[key]` when `buf` is
    /// empty and `len` is not) to peer `peer`. Its completion lands in [`Self::events`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send(
        &mut self,
        engine: &mut Engine,
        ops: &Slab<OpState>,
        key: usize,
        peer: usize,
        o: &SendOptions,
        buf: Bytes,
        len: usize,
    ) {
        self.inflight += 1;
        // The usual case first: one chunk to a peer with nothing queued goes straight into its
        // ring.
        if !o.delivery_complete {
            if let Some(p) = self.peers.get_mut(peer) {
                if let Some(chan) = p.straight_in(len) {
                    let region = ops.get(key).and_then(|x| x.region.as_ref());
                    let guard;
                    let data: &[u8] = match region {
                        Some(r) if buf.len() != len => {
                            guard = r.read();
                            guard.get(..len).unwrap_or_default()
                        }
                        _ => &buf[..],
                    };
                    let h = first_hdr(o.tag, o.data, None, len);
                    if let Some(pos) = chan.push(&h, &self.me, data) {
                        chan.ring_bell_if_asleep();
                        if p.unconsumed.is_empty() {
                            self.consuming.push(peer);
                        }
                        p.unconsumed.push_back(Unconsumed {
                            key,
                            pos,
                            tag: o.tag,
                            buf,
                            len,
                        });
                        self.shared.waiting.store(true, Ordering::Relaxed);
                        return;
                    }
                }
            }
        }
        let dc = o.delivery_complete.then(|| {
            let t = self.next_token;
            self.next_token = self.next_token.wrapping_add(1).max(1);
            t
        });
        let m = OutMsg {
            key,
            tag: o.tag,
            data: o.data,
            dc,
            buf,
            len,
            sent: 0,
            started: false,
            last: 0,
        };
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        if let Some(l) = p.gone {
            let m = Out::Msg(m);
            return self.fail(engine, m, l);
        }
        p.queue.push_back(Out::Msg(m));
        self.queued += 1;
        self.flush_peer(ops, peer);
    }

    /// An inject of one chunk straight into `peer`'s ring, when nothing waits before it and the
    /// ring has room: nothing to track, as an inject completes when its bytes are copied.
    /// `false`: the caller sends a copy the usual way.
    pub(super) fn inject(
        &mut self,
        engine: &mut Engine,
        peer: usize,
        o: &SendOptions,
        data: &[u8],
    ) -> bool {
        let Some(p) = self.peers.get_mut(peer) else {
            return false;
        };
        // A peer that closed its endpoint gets the copy, so the failure is reported; one that
        // died without closing loses the inject (as a datagram would be lost).
        let Some(chan) = p.straight_in(data.len()).filter(|c| !c.closed()) else {
            return false;
        };
        let h = first_hdr(o.tag, o.data, None, data.len());
        if chan.push(&h, &self.me, data).is_none() {
            return false;
        }
        chan.ring_bell_if_asleep();
        engine.local_sent(data.len());
        true
    }

    /// Pushes what waits for `peer` into its ring, as far as there is room.
    fn flush_peer(&mut self, ops: &Slab<OpState>, peer: usize) -> bool {
        let mut pushed = false;
        loop {
            let Some(p) = self.peers.get_mut(peer) else {
                return pushed;
            };
            // Nothing is queued for a peer that is gone (its sends fail, acknowledgements to it
            // are not made).
            let Some(chan) = p.chan.as_ref() else {
                break;
            };
            let Some(front) = p.queue.front_mut() else {
                break;
            };
            let done = match front {
                Out::DcAck(token) => {
                    let h = SlotHdr {
                        kind: K_DC_ACK,
                        flags: 0,
                        len: 0,
                        tag: 0,
                        word: 0,
                        data: 0,
                        token: *token,
                    };
                    if chan.push(&h, &self.me, &[]).is_none() {
                        break;
                    }
                    pushed = true;
                    true
                }
                Out::Msg(m) => {
                    let region = ops.get(m.key).and_then(|o| o.region.as_ref());
                    let bytes;
                    let src: &[u8] = match region {
                        Some(r) if m.buf.len() != m.len => {
                            bytes = r.read();
                            &bytes[..]
                        }
                        _ => &m.buf[..],
                    };
                    let chunk = chan.chunk();
                    let mut full = false;
                    while !m.started || m.sent < m.len {
                        let n = (m.len - m.sent).min(chunk);
                        let Some(data) = src.get(m.sent..m.sent + n) else {
                            // The region shrank? Cannot happen (regions keep their length).
                            m.sent = m.len;
                            break;
                        };
                        let h = if m.started {
                            SlotHdr {
                                kind: K_NEXT,
                                flags: 0,
                                len: 0,
                                tag: 0,
                                word: m.sent as u64,
                                data: 0,
                                token: 0,
                            }
                        } else {
                            first_hdr(m.tag, m.data, m.dc, m.len)
                        };
                        let Some(pos) = chan.push(&h, &self.me, data) else {
                            full = true;
                            break;
                        };
                        m.last = pos;
                        pushed = true;
                        m.started = true;
                        m.sent += n;
                    }
                    !full
                }
            };
            if !done {
                break;
            }
            let Some(out) = p.queue.pop_front() else {
                break;
            };
            self.queued = self.queued.saturating_sub(1);
            if let Out::Msg(m) = out {
                match m.dc {
                    Some(token) => {
                        p.dc_waiting += 1;
                        self.dc.insert(
                            token,
                            DcWait {
                                key: m.key,
                                peer,
                                tag: m.tag,
                                buf: m.buf,
                                len: m.len,
                            },
                        );
                    }
                    None => {
                        if p.unconsumed.is_empty() {
                            self.consuming.push(peer);
                        }
                        p.unconsumed.push_back(Unconsumed {
                            key: m.key,
                            pos: m.last,
                            tag: m.tag,
                            buf: m.buf,
                            len: m.len,
                        });
                    }
                }
            }
        }
        if pushed {
            if let Some(c) = self.peers.get(peer).and_then(|p| p.chan.as_ref()) {
                c.ring_bell_if_asleep();
            }
        }
        self.publish_waiting();
        pushed
    }

    /// Tells the waiter whether sends wait (for room, consumption or acknowledgement) or a
    /// message is only partly here: it then looks every millisecond.
    fn publish_waiting(&self) {
        let w = self.sends_wait() || !self.inbound.is_empty();
        self.shared.waiting.store(w, Ordering::Relaxed);
    }

    /// Sends wait for room in a ring, for their consumption or for an acknowledgement.
    fn sends_wait(&self) -> bool {
        self.queued > 0 || !self.consuming.is_empty() || !self.dc.is_empty()
    }

    /// The handle that keeps the waiter from the endpoint while the application drops it.
    pub(super) fn gate(&self) -> WaiterGate {
        WaiterGate(self.shared.clone())
    }

    /// The endpoint the waiter thread drives while the application does not poll.
    pub(super) fn set_source(&self, source: Weak<dyn ProgressSource>) {
        let _ = self.shared.source.set(source);
    }

    fn complete(
        &mut self,
        engine: &mut Engine,
        key: usize,
        buf: Bytes,
        len: usize,
        tag: Option<u64>,
        fail: Option<Status>,
    ) {
        self.inflight = self.inflight.saturating_sub(1);
        match fail {
            None => engine.local_sent(len),
            Some(Status::Flushed) => {}
            Some(_) => engine.local_failed(),
        }
        let error = fail
            .map(|s| Error::new(s.error_kind(), "send").with_detail(format!("local peer: {s}")));
        self.events.push_back(Event::Send(SendDone {
            context: key as u64,
            buf,
            len: if fail.is_some() { 0 } else { len },
            tag,
            error,
            status: fail,
        }));
    }

    /// Fails a queued item to a closed or dead peer.
    fn fail(&mut self, engine: &mut Engine, out: Out, why: Liveness) {
        if let Out::Msg(m) = out {
            tracing::debug!(?why, "local path: send to a peer that is gone");
            self.complete(
                engine,
                m.key,
                m.buf,
                m.len,
                m.tag,
                Some(Status::UnresponsiveRemote),
            );
        }
    }

    /// One progress step: reads the own ring into the engine, answers delivery-complete
    /// messages, retries waiting sends and checks on peers. True when anything moved.
    pub(super) fn progress(
        &mut self,
        engine: &mut Engine,
        ops: &Slab<OpState>,
        clock: &mut Clock,
    ) -> bool {
        let polls = self.shared.polls.load(Ordering::Relaxed);
        self.shared
            .polls
            .store(polls.wrapping_add(1), Ordering::Relaxed);
        if polls % APP_SAMPLE == 0 && !self.shared.app_polls.load(Ordering::Relaxed) {
            self.sample_app_polls(clock);
        }
        let drained = self.drain(engine, clock);
        let mut busy = drained;
        if busy {
            self.stuck_head = None;
        } else if polls % STUCK_CHECK_POLLS == 0 || !self.shared.app_polls.load(Ordering::Relaxed) {
            self.check_stuck(engine, clock);
        }
        while let Some((src, token)) = engine.take_local_receipt() {
            busy = true;
            match self.route(engine, &src) {
                Some(p) => {
                    // A sender that is gone waits for no acknowledgement.
                    if let Some(peer) = self.peers.get_mut(p).filter(|x| x.gone.is_none()) {
                        peer.queue.push_back(Out::DcAck(token));
                        self.queued += 1;
                        self.flush_peer(ops, p);
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
                    moved |= self.flush_peer(ops, p);
                }
            }
        }
        // Whether the peer consumed a slot is read from the peer's ring, whose cache line the
        // peer is working on: a busy-polling application looks only every few passes.
        let look = polls % REAP_EVERY == 0 || !self.shared.app_polls.load(Ordering::Relaxed);
        if look && !self.consuming.is_empty() {
            moved |= self.reap(engine);
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
        if self.shared.driving.load(Ordering::Relaxed) {
            return;
        }
        let now = clock.now();
        if self
            .app_mark
            .is_some_and(|t| now.saturating_duration_since(t) < APP_SAMPLE_SPAN)
        {
            self.shared.app_polls.store(true, Ordering::Relaxed);
            if let Some(w) = self.shared.ring.sleepers() {
                w.store(0, Ordering::Relaxed);
            }
        }
        self.app_mark = Some(now);
    }

    /// Completes the sends whose last chunk the peer consumed.
    fn reap(&mut self, engine: &mut Engine) -> bool {
        let mut done = false;
        let mut i = 0;
        while let Some(&peer) = self.consuming.get(i) {
            while let Some(u) = self.peers.get_mut(peer).and_then(|p| {
                let pos = p.unconsumed.front()?.pos;
                if p.chan.as_ref().is_none_or(|c| c.consumed(pos)) {
                    p.unconsumed.pop_front()
                } else {
                    None
                }
            }) {
                done = true;
                self.complete(engine, u.key, u.buf, u.len, u.tag, None);
            }
            if self.peers.get(peer).is_none_or(|p| p.unconsumed.is_empty()) {
                self.consuming.swap_remove(i);
            } else {
                i += 1;
            }
        }
        done
    }

    /// Reads up to a batch of slots of the own ring.
    fn drain(&mut self, engine: &mut Engine, clock: &mut Clock) -> bool {
        let mut n = 0;
        let mut senders: [Option<usize>; 2] = [None; 2];
        let mut more_senders = false;
        while n < DRAIN_BATCH {
            let Some(h) = self.own.peek() else { break };
            let Some(src) = h.src else {
                engine.local_malformed("local slot with a bad length or sender");
                self.own.pop();
                n += 1;
                continue;
            };
            // Both sides know each other (the engine's handshake, for one-sided operations), and
            // a sender that sleeps learns that its slots were consumed.
            if let Some(p) = self.route(engine, &src) {
                match senders {
                    [Some(a), _] if a == p => {}
                    [_, Some(b)] if b == p => {}
                    [None, _] => senders[0] = Some(p),
                    [_, None] => senders[1] = Some(p),
                    _ => more_senders = true,
                }
            }
            let own = &self.own;
            let len = h.hdr.len as usize;
            // The slot is freed as soon as its data is copied: the free moves the slot's cache
            // line to this core, and that transfer then overlaps the matching's remaining work.
            let popped = std::cell::Cell::new(false);
            let mut copy = |b: &mut BytesMut, k: usize| {
                own.copy(&h, k, b);
                if !popped.get() {
                    popped.set(true);
                    own.pop();
                }
            };
            match h.hdr.kind {
                K_MSG => {
                    let f = h.hdr.flags;
                    let m = LocalMsg {
                        tag: (f & F_TAGGED != 0).then_some(h.hdr.tag),
                        data: (f & F_DATA != 0).then_some(h.hdr.data),
                        dc_token: (f & F_DC != 0).then_some(h.hdr.token),
                        msg_len: usize::try_from(h.hdr.word).unwrap_or(usize::MAX),
                    };
                    if engine.local_must_wait(src, Some(&m), None, len) {
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
                        engine.local_malformed("local message cut short by the next");
                        if let Some(rid) = old.rid {
                            engine.local_abort(rid);
                        }
                    }
                    let rid = engine.local_first(&mut || clock.now(), src, &m, len, &mut copy);
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
                        engine.local_malformed("local chunk of no message");
                        self.own.pop();
                        n += 1;
                        continue;
                    };
                    if inb.next != off || off.checked_add(len).is_none_or(|e| e > inb.len) {
                        engine.local_malformed("local chunk out of place");
                        if let Some(rid) = inb.rid {
                            engine.local_abort(rid);
                        }
                        self.inbound.remove(&src);
                        self.own.pop();
                        n += 1;
                        continue;
                    }
                    if let Some(rid) = inb.rid {
                        if engine.local_must_wait(src, None, Some(rid), len) {
                            self.stall();
                            break;
                        }
                        engine.local_next(clock.now(), rid, src, off, len, &mut copy);
                    }
                    inb.next += len;
                    if inb.next == inb.len {
                        self.inbound.remove(&src);
                    }
                }
                K_DC_ACK => self.dc_acked(engine, h.hdr.token),
                _ => engine.local_malformed("local slot of an unknown kind"),
            }
            if !popped.get() {
                self.own.pop();
            }
            self.blocked = false;
            n += 1;
        }
        // A sender that sleeps learns that its slots were consumed (its sends complete). No
        // fence: it naps at most a millisecond while sends wait, and a fence here would wait for
        // the slot frees above to leave the store buffer, on the way to this side's completion.
        if more_senders {
            for c in self.peers.iter().filter_map(|p| p.chan.as_ref()) {
                c.ring_bell_if_seen_asleep();
            }
        } else {
            for p in senders.into_iter().flatten() {
                if let Some(c) = self.peers.get(p).and_then(|p| p.chan.as_ref()) {
                    c.ring_bell_if_seen_asleep();
                }
            }
        }
        self.more = n >= DRAIN_BATCH;
        n > 0
    }

    /// Gives up on a head slot a producer reserved and has not published for `STUCK_SLOT`.
    fn check_stuck(&mut self, engine: &mut Engine, clock: &mut Clock) {
        let Some(head) = self.own.reserved_head() else {
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
                    engine.local_malformed("local slot reserved and never published");
                    self.own.skip_head();
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

    fn dc_acked(&mut self, engine: &mut Engine, token: u32) {
        let Some(w) = self.dc.remove(&token) else {
            return;
        };
        if let Some(p) = self.peers.get_mut(w.peer) {
            p.dc_waiting = p.dc_waiting.saturating_sub(1);
        }
        self.complete(engine, w.key, w.buf, w.len, w.tag, None);
    }

    /// Checks the peers we wait for; fails everything waiting for one that is gone.
    fn check(&mut self, engine: &mut Engine, now: Instant) {
        self.next_check = None;
        let mut again = false;
        // A sender that went away in the middle of a message: the receive it matched fails now
        // (not after the engine's stall timeout), and the peer counts as gone below.
        // While slots wait in the own ring (this side held back, or a batch limit), the rest of
        // the message may be among them.
        let partial: Vec<RawAddr> = if self.shared.ring.ready() {
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
                engine.local_abort(rid);
            }
        }
        for i in 0..self.peers.len() {
            let waits =
                |p: &Peer| !p.queue.is_empty() || p.dc_waiting > 0 || !p.unconsumed.is_empty();
            if !self.peers.get(i).is_some_and(waits) {
                continue;
            }
            let Some(l) = self.find_gone(i, "a peer gone; its sends fail") else {
                again = true;
                continue;
            };
            let Some(p) = self.peers.get_mut(i) else {
                continue;
            };
            let q = std::mem::take(&mut p.queue);
            p.dc_waiting = 0;
            self.queued = self.queued.saturating_sub(q.len());
            let unconsumed = std::mem::take(&mut p.unconsumed);
            for out in q {
                self.fail(engine, out, l);
            }
            for u in unconsumed {
                self.complete(
                    engine,
                    u.key,
                    u.buf,
                    u.len,
                    u.tag,
                    Some(Status::UnresponsiveRemote),
                );
            }
            let tokens: Vec<u32> = self
                .dc
                .iter()
                .filter(|(_, w)| w.peer == i)
                .map(|(t, _)| *t)
                .collect();
            for t in tokens {
                if let Some(w) = self.dc.remove(&t) {
                    self.complete(
                        engine,
                        w.key,
                        w.buf,
                        w.len,
                        w.tag,
                        Some(Status::UnresponsiveRemote),
                    );
                }
            }
        }
        if again {
            self.next_check = Some(now + CHECK_EVERY);
        }
    }

    /// `None` while peer `i` is alive. Otherwise why it is gone: the first time, it is marked
    /// gone (its channel let go) and, when it died, what else it left in the directory (its
    /// device's files) is removed too.
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
                crate::device::shm::sweep_dir(&self.dir, self.uid);
            }
        }
        Some(l)
    }

    /// When the next check is due.
    pub(super) fn next_timer(&self) -> Option<Instant> {
        self.next_check
    }

    /// Closes the channel (peers see it closed) and completes every local send with `Flushed`.
    pub(super) fn close(&mut self, engine: &mut Engine) {
        self.own.close();
        for i in 0..self.peers.len() {
            let q = match self.peers.get_mut(i) {
                Some(p) => std::mem::take(&mut p.queue),
                None => continue,
            };
            for out in q {
                if let Out::Msg(m) = out {
                    self.complete(engine, m.key, m.buf, m.len, m.tag, Some(Status::Flushed));
                }
            }
        }
        self.queued = 0;
        self.consuming.clear();
        for i in 0..self.peers.len() {
            let u = match self.peers.get_mut(i) {
                Some(p) => std::mem::take(&mut p.unconsumed),
                None => continue,
            };
            for u in u {
                self.complete(engine, u.key, u.buf, u.len, u.tag, Some(Status::Flushed));
            }
        }
        let waits: Vec<DcWait> = self.dc.drain().map(|(_, w)| w).collect();
        for w in waits {
            self.complete(engine, w.key, w.buf, w.len, w.tag, Some(Status::Flushed));
        }
        self.stop_waiter();
    }

    fn stop_waiter(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(b) = self.shared.ring.bell() {
            b.fetch_add(1, Ordering::Release);
            map::futex_wake(b);
        }
        if let Some(h) = self.waiter.take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for LocalPath {
    fn drop(&mut self) {
        self.stop_waiter();
    }
}

/// Tells the waiter that the application is about to sleep on a completion queue: it takes
/// over at once instead of at the end of its busy window.
struct WaiterHook(Weak<Shared>);

impl SleepHook for WaiterHook {
    fn before_sleep(&self) {
        if let Some(s) = self.0.upgrade() {
            if s.app_polls.load(Ordering::Relaxed) {
                s.sleeping.store(true, Ordering::SeqCst);
                if let Some(b) = s.ring.bell() {
                    b.fetch_add(1, Ordering::Release);
                    map::futex_wake(b);
                }
            }
        }
    }
}

/// The waiter thread: stands aside while the application polls; otherwise sleeps on the
/// channel's doorbell (as a sleeper, so peers ring it when they write to the ring or consume
/// what this endpoint sent) and drives the endpoint when there is something to do, as the shm
/// device's thread does for the device path: chunks are consumed, sends complete, completion
/// queues are woken. While sends wait it looks every millisecond.
fn waiter(s: Arc<Shared>) {
    let (Some(bell), Some(sleepers)) = (s.ring.bell(), s.ring.sleepers()) else {
        return;
    };
    while !s.stop.load(Ordering::Acquire) {
        let before = s.polls.load(Ordering::Relaxed);
        let seen = bell.load(Ordering::Acquire);
        let window = if s.app_polls.load(Ordering::Relaxed) {
            BUSY_WINDOW
        } else {
            Duration::from_millis(1)
        };
        map::futex_wait(bell, seen, window);
        let polls = s.polls.load(Ordering::Relaxed).wrapping_sub(before);
        let busy = polls >= BUSY_POLLS && !s.sleeping.swap(false, Ordering::SeqCst);
        if s.app_polls.load(Ordering::Relaxed) != busy {
            s.app_polls.store(busy, Ordering::Relaxed);
        }
        if busy || s.stop.load(Ordering::Acquire) {
            continue;
        }
        sleepers.store(1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
        let seen = bell.load(Ordering::Acquire);
        if !s.ring.ready() {
            let nap = if s.waiting.load(Ordering::Relaxed) {
                1
            } else {
                20
            };
            map::futex_wait(bell, seen, Duration::from_millis(nap));
        }
        sleepers.store(0, Ordering::Relaxed);
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        if s.ring.ready()
            || s.waiting.load(Ordering::Relaxed)
            || bell.load(Ordering::Acquire) != seen
            || s.ring.stuck()
        {
            s.drive();
        }
    }
}
