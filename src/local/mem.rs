//! In-memory channels, so that the simulator (`proto::sim`) drives the same-host path in
//! virtual time with seeded faults: a [`MemHost`] stands for one host's shm directory, each
//! path's ring is an in-memory copy of the shared-memory ring (the same slots, sequence words
//! and positions), and [`SimLocal`] plugs a path into a simulated node
//! ([`Sim::attach`](crate::proto::sim::Sim::attach)).
//!
//! Faults: pushes refused as if the ring were full (other producers winning the race), an owner
//! that dies without closing, a slot reserved and never published, and slots of any content
//! planted by a hostile peer.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use parking_lot::Mutex;

use super::ring::{
    ADDR_LEN, Channels, Head, Liveness, OpenError, PeerRing, SlotHdr, decode_addr, encode_addr,
};
use super::{LocalPath, LocalSend, LocalStats};
use crate::addr::RawAddr;
use crate::error::{Error, ErrorKind};
use crate::fault::Rng;
use crate::progress::Clock;
use crate::proto::engine::{Engine, Event, SendOp};
use crate::proto::sim::Beside;

/// One simulated host: the rings of the paths on it, by address.
#[derive(Clone)]
pub(crate) struct MemHost(Arc<Mutex<HostState>>);

struct HostState {
    rings: HashMap<RawAddr, Arc<MemRing>>,
    rng: Rng,
    /// Pushes refused as if the ring were full, per 1000.
    refuse: u32,
    slots: usize,
    chunk: usize,
}

struct Slot {
    hdr: SlotHdr,
    src: [u8; ADDR_LEN],
    bytes: Vec<u8>,
}

struct RingState {
    /// Vyukov's sequence word per slot, as in the shared-memory ring.
    seq: Vec<u64>,
    slots: Vec<Option<Slot>>,
    head: u64,
    tail: u64,
}

/// One path's ring.
pub(crate) struct MemRing {
    st: Mutex<RingState>,
    chunk: usize,
    closed: AtomicBool,
    dead: AtomicBool,
}

impl MemRing {
    fn new(slots: usize, chunk: usize) -> MemRing {
        MemRing {
            st: Mutex::new(RingState {
                seq: (0..slots as u64).collect(),
                slots: (0..slots).map(|_| None).collect(),
                head: 0,
                tail: 0,
            }),
            chunk,
            closed: AtomicBool::new(false),
            dead: AtomicBool::new(false),
        }
    }

    /// Writes and publishes a slot as given (no checks of the content: a peer may write
    /// anything, its `len` too); `None` when the ring is full.
    fn put(&self, hdr: SlotHdr, src: [u8; ADDR_LEN], data: &[u8]) -> Option<u64> {
        let mut st = self.st.lock();
        let n = st.seq.len() as u64;
        let pos = st.tail;
        let i = (pos % n) as usize;
        if st.seq[i] != pos {
            return None;
        }
        st.tail += 1;
        st.slots[i] = Some(Slot {
            hdr,
            src,
            bytes: data.to_vec(),
        });
        st.seq[i] = pos + 1;
        Some(pos)
    }
}

impl MemHost {
    /// A host whose rings have `slots` slots of `chunk` bytes; `seed` drives the faults.
    pub(crate) fn new(slots: usize, chunk: usize, seed: u64) -> MemHost {
        MemHost(Arc::new(Mutex::new(HostState {
            rings: HashMap::new(),
            rng: Rng::new(seed),
            refuse: 0,
            slots: slots.max(1),
            chunk,
        })))
    }

    /// Refuses this many pushes per 1000 as if the ring were full.
    pub(crate) fn refuse_pushes(&self, per_mille: u32) {
        self.0.lock().refuse = per_mille;
    }

    /// The channels of the path at `addr`.
    pub(crate) fn channels(&self, addr: &RawAddr) -> MemChannels {
        let mut h = self.0.lock();
        let ring = Arc::new(MemRing::new(h.slots, h.chunk));
        h.rings.insert(*addr, ring.clone());
        MemChannels {
            host: self.clone(),
            own: ring,
            addr: *addr,
        }
    }

    fn ring(&self, addr: &RawAddr) -> Option<Arc<MemRing>> {
        self.0.lock().rings.get(addr).cloned()
    }

    /// The owner of `addr` dies without closing: its ring stays where peers hold it, and can
    /// no longer be opened.
    pub(crate) fn kill(&self, addr: &RawAddr) {
        if let Some(r) = self.0.lock().rings.remove(addr) {
            r.dead.store(true, Ordering::Release);
        }
    }

    /// A producer reserves the next slot of `addr`'s ring and dies before publishing it.
    pub(crate) fn reserve_stuck(&self, addr: &RawAddr) {
        if let Some(r) = self.ring(addr) {
            r.st.lock().tail += 1;
        }
    }

    /// A hostile peer writes a slot of its choosing into `addr`'s ring: `hdr` as given (its
    /// `len` too, which may lie), from `src`.
    pub(crate) fn plant(&self, addr: &RawAddr, hdr: SlotHdr, src: [u8; ADDR_LEN], data: &[u8]) {
        if let Some(r) = self.ring(addr) {
            r.put(hdr, src, data);
        }
    }

    fn refused(&self) -> bool {
        let mut h = self.0.lock();
        h.refuse > 0 && (h.rng.next_u64() % 1000) < u64::from(h.refuse)
    }
}

/// The channels of one path on a [`MemHost`].
pub(crate) struct MemChannels {
    host: MemHost,
    own: Arc<MemRing>,
    addr: RawAddr,
}

/// A peer's ring on a [`MemHost`].
pub(crate) struct MemPeer {
    host: MemHost,
    ring: Arc<MemRing>,
}

impl Channels for MemChannels {
    type Peer = MemPeer;

    fn peek(&self) -> Option<Head> {
        let st = self.own.st.lock();
        let n = st.seq.len() as u64;
        let i = (st.head % n) as usize;
        if st.seq[i] != st.head + 1 {
            return None;
        }
        let slot = st.slots[i].as_ref()?;
        let src = if slot.hdr.len as usize <= self.own.chunk
            && slot.bytes.len() >= slot.hdr.len as usize
        {
            decode_addr(&slot.src)
        } else {
            None
        };
        Some(Head {
            hdr: slot.hdr,
            src,
            data_off: i,
        })
    }

    fn copy(&self, h: &Head, n: usize, buf: &mut BytesMut) -> bool {
        let st = self.own.st.lock();
        match st.slots.get(h.data_off).and_then(Option::as_ref) {
            Some(s) if n <= h.hdr.len as usize && n <= s.bytes.len() => {
                crate::mem::copy::extend(buf, &s.bytes[..n]);
                true
            }
            _ => false,
        }
    }

    fn pop(&self) {
        let mut st = self.own.st.lock();
        let n = st.seq.len() as u64;
        let head = st.head;
        st.seq[(head % n) as usize] = head + n;
        st.head = head + 1;
    }

    fn ready(&self) -> bool {
        let st = self.own.st.lock();
        st.seq[(st.head % st.seq.len() as u64) as usize] == st.head + 1
    }

    fn reserved_head(&self) -> Option<u64> {
        let st = self.own.st.lock();
        let published = st.seq[(st.head % st.seq.len() as u64) as usize] == st.head + 1;
        (st.tail > st.head && !published).then_some(st.head)
    }

    fn skip_head(&self) {
        self.pop()
    }

    fn close(&mut self) {
        self.own.closed.store(true, Ordering::Release);
        let mut h = self.host.0.lock();
        if h.rings
            .get(&self.addr)
            .is_some_and(|r| Arc::ptr_eq(r, &self.own))
        {
            h.rings.remove(&self.addr);
        }
    }

    fn open_peer(&mut self, dest: &RawAddr) -> Result<MemPeer, OpenError> {
        match self.host.ring(dest) {
            Some(ring) => Ok(MemPeer {
                host: self.host.clone(),
                ring,
            }),
            None => Err(OpenError::Absent),
        }
    }
}

impl PeerRing for MemPeer {
    fn chunk(&self) -> usize {
        self.ring.chunk
    }

    fn push(&self, hdr: &SlotHdr, src: &[u8; ADDR_LEN], data: &[u8]) -> Option<u64> {
        if data.len() > self.ring.chunk || self.host.refused() {
            return None;
        }
        let hdr = SlotHdr {
            len: data.len() as u32,
            ..*hdr
        };
        self.ring.put(hdr, *src, data)
    }

    fn consumed(&self, pos: u64) -> bool {
        let st = self.ring.st.lock();
        let w = st.seq[(pos % st.seq.len() as u64) as usize];
        w.wrapping_sub(pos.wrapping_add(1)) as i64 > 0
    }

    fn wake(&self) {}

    fn nudge(&self) {}

    fn closed(&self) -> bool {
        self.ring.closed.load(Ordering::Acquire)
    }

    fn liveness(&self) -> Liveness {
        if self.ring.closed.load(Ordering::Acquire) {
            Liveness::Closed
        } else if self.ring.dead.load(Ordering::Acquire) {
            Liveness::Dead
        } else {
            Liveness::Alive
        }
    }
}

/// A simulated node's same-host path ([`Beside`]): the waiter thread's part (a pass every
/// millisecond while sends or a message wait) is its timer.
pub(crate) struct SimLocal {
    path: LocalPath<MemChannels>,
    last: Option<Instant>,
    /// The path's counters after its last pass (for tests, which hand the path to the
    /// simulator).
    stats: Arc<Mutex<LocalStats>>,
}

impl SimLocal {
    /// The path of the node at `addr` on `host`, with at most `max_inflight` sends in flight.
    pub(crate) fn new(host: &MemHost, addr: &RawAddr, max_inflight: usize) -> SimLocal {
        SimLocal {
            path: LocalPath::new(host.channels(addr), addr, max_inflight),
            last: None,
            stats: Arc::default(),
        }
    }

    /// The path's counters, as of its last pass.
    pub(crate) fn stats(&self) -> Arc<Mutex<LocalStats>> {
        self.stats.clone()
    }
}

impl fmt::Debug for SimLocal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimLocal")
            .field("stats", &self.path.stats())
            .finish()
    }
}

impl Beside for SimLocal {
    fn send(
        &mut self,
        engine: &mut Engine,
        now: Instant,
        op: SendOp,
    ) -> Result<Option<SendOp>, (Error, SendOp)> {
        self.last.get_or_insert(now);
        let Some(peer) = self.path.route(engine, &op.dest) else {
            return Ok(Some(op));
        };
        if !self.path.has_room() {
            return Err((Error::new(ErrorKind::Again, "send"), op));
        }
        let len = op.buf.len();
        self.path.send(
            peer,
            LocalSend {
                context: op.context,
                tag: op.tag,
                data: op.data,
                delivery_complete: op.delivery_complete,
                buf: op.buf,
                region: None,
                len,
            },
        );
        Ok(None)
    }

    fn progress(&mut self, engine: &mut Engine, now: Instant, events: &mut Vec<Event>) -> bool {
        self.last = Some(now);
        let busy = self.path.progress(engine, &mut Clock::at(now));
        events.extend(std::iter::from_fn(|| self.path.pop_event()));
        *self.stats.lock() = self.path.stats();
        busy
    }

    fn next_timer(&self) -> Option<Instant> {
        // The path looks at its own clock (liveness checks, a stuck slot) on the passes it gets;
        // what it needs is the waiter's pass every millisecond while something waits.
        if self.path.waiting() {
            self.last.map(|t| t + Duration::from_millis(1))
        } else {
            None
        }
    }
}

/// The encoded form of `a` as slots carry it (for planting slots).
pub(crate) fn slot_src(a: &RawAddr) -> [u8; ADDR_LEN] {
    encode_addr(a)
}
