//! Small helpers of the engine: a coalescing set of byte ranges, a fast hasher for the ids
//! the engine allocates itself and the arena packet headers are encoded into.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::Event;
use crate::proto::wire::{Packet, WireError};
use crate::stats::EndpointStats;

/// A multiplicative hasher for keys the engine chooses (operation, peer and claim ids). Keys a
/// peer controls (message ids) use the standard, randomly keyed hasher instead.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IdHasher(u64);

const K: u64 = 0x517c_c1b7_2722_0a95;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(*b)).wrapping_mul(K);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A slab whose ids carry a generation (high 32 bits; the slot is the low 32 bits): finding an
/// entry is an index and a compare, and an id is not reused when its slot is (a stale id, say of
/// a packet of a failed peer completing late, finds nothing).
#[derive(Debug)]
pub(super) struct GenSlab<T> {
    /// (generation, entry) per slot.
    slots: Vec<(u32, Option<T>)>,
    /// Empty slots.
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for GenSlab<T> {
    fn default() -> Self {
        GenSlab {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T> GenSlab<T> {
    fn split(id: u64) -> (u32, usize) {
        ((id >> 32) as u32, (id & 0xffff_ffff) as usize)
    }

    /// Stores `v` under a new id (never 0).
    pub(super) fn insert(&mut self, v: T) -> u64 {
        self.len += 1;
        if let Some(i) = self.free.pop() {
            if let Some(s) = self.slots.get_mut(i as usize) {
                s.0 = s.0.wrapping_add(1).max(1);
                s.1 = Some(v);
                return (u64::from(s.0) << 32) | u64::from(i);
            }
        }
        let i = self.slots.len() as u64;
        self.slots.push((1, Some(v)));
        (1 << 32) | i
    }

    pub(super) fn get(&self, id: &u64) -> Option<&T> {
        let (g, i) = Self::split(*id);
        match self.slots.get(i) {
            Some((sg, Some(v))) if *sg == g => Some(v),
            _ => None,
        }
    }

    pub(super) fn get_mut(&mut self, id: &u64) -> Option<&mut T> {
        let (g, i) = Self::split(*id);
        match self.slots.get_mut(i) {
            Some((sg, Some(v))) if *sg == g => Some(v),
            _ => None,
        }
    }

    pub(super) fn contains_key(&self, id: &u64) -> bool {
        self.get(id).is_some()
    }

    pub(super) fn remove(&mut self, id: &u64) -> Option<T> {
        let (g, i) = Self::split(*id);
        match self.slots.get_mut(i) {
            Some((sg, v @ Some(_))) if *sg == g => {
                self.len -= 1;
                self.free.push(i as u32);
                v.take()
            }
            _ => None,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|(_, v)| v.as_ref())
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.slots.iter_mut().filter_map(|(_, v)| v.as_mut())
    }
}

/// Smallest ring of a [`SeqMap`].
const SEQ_MIN_RING: usize = 16;

/// A map for the ids the engine hands out in sequence (send and receive ids): an id's slot in a
/// ring is its low bits, so the ids in flight, being close together, sit in the ring and finding
/// one is an index and a compare. The ring doubles (up to `max_ring`) when a slot is taken while
/// it is at least half full; an id whose slot is taken otherwise (a long-lived operation lapped
/// by later ones) goes to an overflow map.
#[derive(Debug)]
pub(super) struct SeqMap<T> {
    ring: Vec<Option<(u32, T)>>,
    overflow: IdMap<u32, T>,
    len: usize,
    max_ring: usize,
}

impl<T> SeqMap<T> {
    /// A map whose ring grows to `max_ring` slots at most (rounded up to a power of two).
    pub(super) fn new(max_ring: usize) -> SeqMap<T> {
        SeqMap {
            ring: Vec::new(),
            overflow: IdMap::default(),
            len: 0,
            max_ring: max_ring.clamp(SEQ_MIN_RING, 1 << 20).next_power_of_two(),
        }
    }

    fn slot(&self, id: u32) -> usize {
        id as usize & self.ring.len().wrapping_sub(1)
    }

    fn place(&mut self, id: u32, v: T) {
        let s = self.slot(id);
        match self.ring.get_mut(s) {
            Some(e @ None) => *e = Some((id, v)),
            _ => {
                self.overflow.insert(id, v);
            }
        }
    }

    fn grow(&mut self) {
        let n = (self.ring.len() * 2).max(SEQ_MIN_RING);
        let old = std::mem::replace(&mut self.ring, (0..n).map(|_| None).collect());
        for (id, v) in old.into_iter().flatten() {
            self.place(id, v);
        }
        if !self.overflow.is_empty() {
            let mut ids: Vec<u32> = self.overflow.keys().copied().collect();
            ids.sort_unstable();
            for id in ids {
                let s = self.slot(id);
                if self.ring.get(s).is_some_and(Option::is_none) {
                    if let Some(v) = self.overflow.remove(&id) {
                        self.place(id, v);
                    }
                }
            }
        }
    }

    /// Stores `v` under `id`, which must not be present.
    pub(super) fn insert(&mut self, id: u32, v: T) {
        let taken = self.ring.get(self.slot(id)).is_none_or(Option::is_some);
        if taken && self.ring.len() < self.max_ring && self.len >= self.ring.len() / 2 {
            self.grow();
        }
        self.place(id, v);
        self.len += 1;
    }

    pub(super) fn get(&self, id: &u32) -> Option<&T> {
        match self.ring.get(self.slot(*id)) {
            Some(Some((k, v))) if k == id => Some(v),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(id),
        }
    }

    pub(super) fn get_mut(&mut self, id: &u32) -> Option<&mut T> {
        let s = self.slot(*id);
        match self.ring.get_mut(s) {
            Some(Some((k, v))) if k == id => Some(v),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get_mut(id),
        }
    }

    pub(super) fn contains_key(&self, id: &u32) -> bool {
        self.get(id).is_some()
    }

    /// The next id from the counter `next` (wrapping) that neither this map nor `taken` holds.
    #[inline]
    pub(super) fn free_id(&self, next: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
        next_free_id(next, |id| self.contains_key(&id) || taken(id))
    }

    pub(super) fn remove(&mut self, id: &u32) -> Option<T> {
        let s = self.slot(*id);
        let v = match self.ring.get_mut(s) {
            Some(e @ Some(_)) if e.as_ref().is_some_and(|(k, _)| k == id) => {
                e.take().map(|(_, v)| v)
            }
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.remove(id),
        };
        if v.is_some() {
            self.len -= 1;
        }
        v
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Every entry, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.ring
            .iter()
            .filter_map(|e| e.as_ref().map(|(k, v)| (*k, v)))
            .chain(self.overflow.iter().map(|(&k, v)| (k, v)))
    }

    /// Every id, in increasing order.
    pub(super) fn sorted_keys(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.iter().map(|(k, _)| k).collect();
        v.sort_unstable();
        v
    }
}

/// A map keyed by engine-chosen ids.
pub(super) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Room for the largest header the engine sends: a DC tagged MEDIUM segment with the
/// raw-address and CQ-data headers (88 bytes), a HANDSHAKE (80 at most), a DC_LONGCTS_RTW with
/// its range, the raw address and CQ data (96).
pub(super) const HDR_INLINE: usize = 128;

/// Headers up to this long are kept inside the packet: every header of a message packet after
/// the HANDSHAKE (eager, medium, long-CTS with tag, delivery complete, CQ data and connid; CTS,
/// CTSDATA, RECEIPT) fits, so steady-state messages never allocate for a header. Longer ones
/// (raw-address REQs before the HANDSHAKE, RMA requests with their ranges, the HANDSHAKE) take
/// a heap box of [`HDR_INLINE`] bytes.
pub(super) const HDR_SMALL: usize = 54;

/// A packet's headers, kept with the packet until it goes to the device (and again if an RNR
/// sends it once more): no shared buffer whose references are counted per packet. Small
/// (64 bytes with its length) so that queues move packets cheaply.
#[derive(Clone)]
pub(super) struct Hdr {
    n: u8,
    repr: HdrRepr,
}

#[derive(Clone)]
enum HdrRepr {
    Small([u8; HDR_SMALL]),
    Big(Box<[u8; HDR_INLINE]>),
}

impl std::fmt::Debug for Hdr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hdr({} bytes)", self.n)
    }
}

impl Hdr {
    /// Empty, to be filled with [`Hdr::put`].
    pub(super) fn empty() -> Hdr {
        Hdr {
            n: 0,
            repr: HdrRepr::Small([0; HDR_SMALL]),
        }
    }

    /// Appends `bytes` (nothing if they do not fit [`HDR_INLINE`]; the header sizes the engine
    /// sends do).
    pub(super) fn put(&mut self, bytes: &[u8]) {
        let n = usize::from(self.n);
        let end = n + bytes.len();
        if end > HDR_INLINE {
            return;
        }
        if let HdrRepr::Small(s) = &self.repr {
            if end > HDR_SMALL {
                let mut big = Box::new([0u8; HDR_INLINE]);
                big[..n].copy_from_slice(&s[..n]);
                self.repr = HdrRepr::Big(big);
            }
        }
        let dst = match &mut self.repr {
            HdrRepr::Small(s) => s.get_mut(n..end),
            HdrRepr::Big(b) => b.get_mut(n..end),
        };
        if let Some(d) = dst {
            d.copy_from_slice(bytes);
            self.n = end as u8;
        }
    }

    /// `pkt`'s headers, encoded by the codec.
    pub(super) fn encode(pkt: &Packet<'_>) -> Result<Hdr, WireError> {
        let mut buf = [0u8; HDR_INLINE];
        let mut out: &mut [u8] = &mut buf[..];
        let n = pkt.encode_header(&mut out)?;
        let mut h = Hdr::empty();
        h.put(&buf[..n]);
        Ok(h)
    }

    pub(super) fn bytes(&self) -> &[u8] {
        let n = usize::from(self.n);
        match &self.repr {
            HdrRepr::Small(s) => s.get(..n).unwrap_or(&[]),
            HdrRepr::Big(b) => b.get(..n).unwrap_or(&[]),
        }
    }
}

/// Size of one chunk of the header arena: a header is a slice of a chunk, so the `Bytes`
/// handed out share a few allocations.
const HDR_CHUNK: usize = 16 * 1024;

/// Used-up chunks the arena keeps to reuse once their headers are all gone.
const HDR_SPARES: usize = 8;

/// The arena the headers handed to the device are copied into: one chunk is filled header
/// after header (each split off as a `Bytes`); a used-up chunk is kept and reused, without
/// allocating, once the headers that point into it have all been dropped by the device (with
/// their `Transmit`). In steady state two chunks take turns.
#[derive(Debug, Default)]
pub(super) struct HeaderArena {
    /// The chunk being filled (empty and unallocated before the first header).
    cur: BytesMut,
    /// `cur` is a chunk (not the initial empty buffer).
    live: bool,
    /// Used-up chunks, oldest first.
    spares: VecDeque<BytesMut>,
}

impl HeaderArena {
    /// Room for a header of `len` bytes.
    fn reserve(&mut self, len: usize) {
        if self.cur.capacity() >= len {
            return;
        }
        let want = HDR_CHUNK.max(len);
        let used = std::mem::take(&mut self.cur);
        if self.live {
            if self.spares.len() >= HDR_SPARES {
                // Its headers keep it alive; it is freed when they go.
                self.spares.pop_front();
            }
            self.spares.push_back(used);
        }
        self.live = true;
        // The oldest chunk whose headers are all released (nothing else points into it).
        for _ in 0..self.spares.len() {
            let Some(mut c) = self.spares.pop_front() else {
                break;
            };
            if c.try_reclaim(want) {
                self.cur = c;
                return;
            }
            self.spares.push_back(c);
        }
        self.cur = BytesMut::with_capacity(want);
    }

    /// `hdr` as a `Bytes` in the arena.
    pub(super) fn copy(&mut self, hdr: &[u8]) -> Bytes {
        self.reserve(hdr.len());
        self.cur.extend_from_slice(hdr);
        self.cur.split().freeze()
    }
}

/// The byte ranges of a message received so far: sorted, disjoint, adjacent ranges merged.
///
/// Segments arrive in any order; an overlapping segment is a duplicate (or a lie) and refused.
/// While the ranges received form one range (segments in order, the usual case) it is kept
/// inline, without allocating. Otherwise they are in a B-tree by start, so every insertion is
/// O(log n) whatever the order (a sorted vector made a peer's alternating one-byte segments
/// quadratic: issue 17, defect 7).
#[derive(Debug, Default)]
pub(super) struct RangeSet {
    /// The only range while `r` is empty.
    one: Option<(u64, u64)>,
    /// Start -> end.
    r: BTreeMap<u64, u64>,
}

impl RangeSet {
    /// Adds `[start, end)`. Returns false, changing nothing, when the range is empty or overlaps
    /// a range already present.
    pub(super) fn insert(&mut self, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
        }
        if self.r.is_empty() {
            let Some((s, e)) = self.one else {
                self.one = Some((start, end));
                return true;
            };
            if start < e && s < end {
                return false;
            }
            if start == e {
                self.one = Some((s, end));
                return true;
            }
            if end == s {
                self.one = Some((start, e));
                return true;
            }
            self.one = None;
            self.r.insert(s, e);
        }
        // The range starting before `start` and the one starting at or after it: the only two
        // that can overlap or join.
        let prev = self.r.range(..start).next_back().map(|(&s, &e)| (s, e));
        let next = self.r.range(start..).next().map(|(&s, &e)| (s, e));
        if prev.is_some_and(|(_, e)| e > start) || next.is_some_and(|(s, _)| s < end) {
            return false;
        }
        let joins_prev = prev.filter(|&(_, e)| e == start);
        let joins_next = next.filter(|&(s, _)| s == end);
        match (joins_prev, joins_next) {
            (Some((ps, _)), Some((ns, ne))) => {
                self.r.remove(&ns);
                self.r.insert(ps, ne);
            }
            (Some((ps, _)), None) => {
                self.r.insert(ps, end);
            }
            (None, Some((ns, ne))) => {
                self.r.remove(&ns);
                self.r.insert(start, ne);
            }
            (None, None) => {
                self.r.insert(start, end);
            }
        }
        true
    }

    /// Number of disjoint ranges held.
    #[cfg(test)]
    pub(super) fn ranges(&self) -> usize {
        if self.r.is_empty() {
            usize::from(self.one.is_some())
        } else {
            self.r.len()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{Rng, test_seed};

    /// The largest header of each message packet (tag, delivery complete, CQ data) with `opt`.
    fn message_packets(opt: crate::proto::wire::ReqOpt) -> [Packet<'static>; 6] {
        [
            Packet::EagerRtm {
                opt,
                msg_id: 1,
                tag: Some(2),
                dc_send_id: Some(3),
            },
            Packet::MediumRtm {
                opt,
                msg_id: 1,
                msg_length: 2,
                seg_offset: 3,
                tag: Some(4),
                dc_send_id: Some(5),
            },
            Packet::LongCtsRtm {
                opt,
                msg_id: 1,
                msg_length: 2,
                send_id: 3,
                credit_request: 4,
                tag: Some(5),
                dc: true,
                read_nack: false,
            },
            Packet::CtsData {
                connid: Some(1),
                recv_id: 2,
                seg_length: 3,
                seg_offset: 4,
            },
            Packet::Cts {
                connid: Some(1),
                send_id: 2,
                recv_id: 3,
                recv_length: 4,
                read_req: false,
            },
            Packet::Receipt {
                connid: Some(1),
                send_id: 2,
                msg_id: 3,
            },
        ]
    }

    #[test]
    fn every_header_the_engine_sends_fits_inline() {
        use crate::addr::{Gid, RawAddr};
        use crate::proto::wire::{ExtraInfo, Handshake, ReqOpt, Sender};
        let opt = ReqOpt {
            sender: Sender::RawAddr(RawAddr::new(Gid([0xff; 16]), u16::MAX, u32::MAX)),
            cq_data: Some(u64::MAX),
        };
        let handshake = Packet::Handshake(Handshake {
            extra_info: ExtraInfo::from_words(&[u64::MAX; 8]),
            connid: Some(1),
            host_id: Some(2),
            device_version: Some(3),
            user_recv_qp: Some((4, 5)),
            p2p: Some(true),
        });
        for p in message_packets(opt).into_iter().chain([handshake]) {
            let h = Hdr::encode(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            assert_eq!(h.bytes().len(), p.header_len(), "{p:?}");
            let mut want = Vec::new();
            p.encode_header(&mut want).unwrap();
            assert_eq!(h.bytes(), &want[..], "{p:?}");
        }
    }

    #[test]
    fn message_headers_after_the_handshake_stay_inline() {
        use crate::proto::wire::{ReqOpt, Sender};
        let opt = ReqOpt {
            sender: Sender::Connid(u32::MAX),
            cq_data: Some(u64::MAX),
        };
        for p in message_packets(opt) {
            let h = Hdr::encode(&p).unwrap();
            assert!(matches!(h.repr, HdrRepr::Small(_)), "{p:?}: {h:?}");
            assert_eq!(h.bytes().len(), p.header_len(), "{p:?}");
        }
        // A longer one spills to the heap, intact.
        let mut h = Hdr::empty();
        let long: Vec<u8> = (0..100u8).collect();
        h.put(&long[..50]);
        h.put(&long[50..]);
        assert!(matches!(h.repr, HdrRepr::Big(_)));
        assert_eq!(h.bytes(), &long[..]);
    }

    #[test]
    fn gen_slab_never_reuses_an_id() {
        let mut s: GenSlab<u32> = GenSlab::default();
        let a = s.insert(1);
        let b = s.insert(2);
        assert_ne!(a, 0);
        assert_eq!(s.remove(&a), Some(1));
        assert_eq!(s.remove(&a), None);
        let c = s.insert(3);
        assert_ne!(c, a, "the slot is reused, the id is not");
        assert_eq!(s.get(&a), None);
        assert_eq!(s.get(&c), Some(&3));
        assert_eq!(s.get_mut(&b), Some(&mut 2));
        assert_eq!(s.len(), 2);
        assert_eq!(s.values().copied().sum::<u32>(), 5);
        assert!(!s.contains_key(&(a + (7 << 40))));
    }

    #[test]
    fn seq_map_is_a_map() {
        let seed = test_seed();
        let mut rng = Rng::new(seed);
        for max in [16usize, 64, 1024] {
            let mut m: SeqMap<u64> = SeqMap::new(max);
            let mut want: HashMap<u32, u64> = HashMap::new();
            let mut next = u32::MAX - 300;
            for step in 0..20_000u64 {
                // Mostly recent ids complete; a few linger for long.
                if rng.chance(0.5) || want.len() > 200 {
                    let k = *want
                        .keys()
                        .nth(rng.below(want.len().max(1) as u64) as usize)
                        .unwrap_or(&0);
                    assert_eq!(m.remove(&k), want.remove(&k), "seed {seed}");
                } else {
                    while want.contains_key(&next) {
                        next = next.wrapping_add(1);
                    }
                    assert!(!m.contains_key(&next), "seed {seed}");
                    m.insert(next, step);
                    want.insert(next, step);
                    next = next.wrapping_add(1 + rng.below(3) as u32);
                }
                let probe = next.wrapping_sub(rng.below(400) as u32);
                assert_eq!(m.get(&probe), want.get(&probe), "seed {seed}");
                if let Some(v) = m.get_mut(&probe) {
                    *v += 1;
                    *want.get_mut(&probe).unwrap() += 1;
                }
                assert_eq!(m.len(), want.len(), "seed {seed}");
            }
            let mut keys: Vec<u32> = want.keys().copied().collect();
            keys.sort_unstable();
            assert_eq!(m.sorted_keys(), keys, "seed {seed}");
        }
    }

    #[test]
    fn alternating_one_byte_segments_in_the_worst_order() {
        // Every other byte, from the end backwards, then the bytes between, backwards too: a
        // sorted vector moved every range on each insertion (quadratic: ~10^10 moves here).
        let n = 200_000u64;
        let mut s = RangeSet::default();
        for i in (0..n).rev() {
            assert!(s.insert(2 * i, 2 * i + 1));
        }
        assert_eq!(s.ranges(), n as usize);
        assert!(!s.insert(10, 11), "an overlap is refused");
        for i in (0..n).rev() {
            assert!(s.insert(2 * i + 1, 2 * i + 2));
        }
        assert_eq!(s.ranges(), 1);
        assert!(!s.insert(0, 2 * n));
    }

    #[test]
    fn ranges_merge_and_refuse_overlaps() {
        let mut s = RangeSet::default();
        assert!(s.insert(10, 20));
        assert!(!s.insert(15, 16));
        assert!(!s.insert(5, 11));
        assert!(!s.insert(19, 30));
        assert!(!s.insert(3, 3), "empty ranges are refused");
        assert!(s.insert(20, 30));
        assert!(s.insert(0, 10));
        assert_eq!(s.ranges(), 1);
        assert!(s.insert(40, 50));
        assert!(s.insert(30, 40));
        assert_eq!(s.ranges(), 1);
    }

    #[test]
    fn random_segments_cover_once() {
        let seed = test_seed();
        let mut rng = Rng::new(seed);
        let n = 200u64;
        let mut order: Vec<u64> = (0..n).collect();
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        let mut s = RangeSet::default();
        for &k in &order {
            assert!(s.insert(k * 7, k * 7 + 7), "seed {seed}");
            assert!(!s.insert(k * 7, k * 7 + 7), "seed {seed}");
        }
        assert_eq!(s.ranges(), 1, "seed {seed}");
    }
}

/// Work requests on the device, by id: the slab key in the low 32 bits and a sequence number
/// above it (so the id of a completed request, or a forged one, finds nothing), with the bits
/// of `TAG` set (what tells the packets' table from the RDMA table; a tagged table's sequence
/// keeps clear of the tag).
#[derive(Debug)]
pub(super) struct WrTable<T, const TAG: u64> {
    slab: slab::Slab<(u64, T)>,
    seq: u32,
}

impl<T, const TAG: u64> Default for WrTable<T, TAG> {
    fn default() -> Self {
        WrTable {
            slab: slab::Slab::new(),
            seq: 0,
        }
    }
}

impl<T, const TAG: u64> WrTable<T, TAG> {
    /// Stores `v`; returns its work request id.
    pub(super) fn insert(&mut self, v: T) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        let seq = if TAG == 0 {
            self.seq
        } else {
            self.seq & 0x7fff_ffff
        };
        let entry = self.slab.vacant_entry();
        let wr_id = TAG | (u64::from(seq) << 32) | (entry.key() as u64 & 0xffff_ffff);
        entry.insert((wr_id, v));
        wr_id
    }

    /// Takes the work request `wr_id` completed; `None` when it is not one of this table's.
    pub(super) fn take(&mut self, wr_id: u64) -> Option<T> {
        if wr_id & TAG != TAG {
            return None;
        }
        let key = (wr_id & 0xffff_ffff) as usize;
        if self.slab.get(key).is_none_or(|(id, _)| *id != wr_id) {
            return None;
        }
        Some(self.slab.remove(key).1)
    }

    pub(super) fn len(&self) -> usize {
        self.slab.len()
    }

    /// The requests on the device.
    pub(super) fn values(&self) -> impl Iterator<Item = &T> {
        self.slab.iter().map(|(_, (_, v))| v)
    }

    pub(super) fn clear(&mut self) {
        self.slab.clear();
    }
}

/// The engine's timers, one slot each (as quinn-proto's `TimerTable`): a sub-state arms and
/// stops its own; [`Engine::poll_timeout`](super::Engine::poll_timeout) is the earliest armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Timer {
    /// The first RNR backoff of a peer ends (`Peers`).
    Backoff,
    /// A matched receive may have stalled (`rx_stall_timeout`).
    RxStall,
    /// A LONGREAD_RTW's data waits for the application to release its region.
    ReadRetry,
    /// Emulated RMA target work waits for a locked region.
    EmaRetry,
}

impl Timer {
    const COUNT: usize = 4;
}

/// When each [`Timer`] is due (`None`: stopped).
#[derive(Debug, Default)]
pub(super) struct TimerTable {
    at: [Option<Instant>; Timer::COUNT],
}

impl TimerTable {
    /// Arms `t` for `at` (`None` stops it).
    pub(super) fn set(&mut self, t: Timer, at: Option<Instant>) {
        self.at[t as usize] = at;
    }

    /// Arms `t` for `at` unless it is armed already.
    pub(super) fn arm_if_stopped(&mut self, t: Timer, at: Option<Instant>) {
        let slot = &mut self.at[t as usize];
        if slot.is_none() {
            *slot = at;
        }
    }

    pub(super) fn stop(&mut self, t: Timer) {
        self.at[t as usize] = None;
    }

    /// `t` is armed and due at `now`.
    pub(super) fn expired(&self, t: Timer, now: Instant) -> bool {
        self.at[t as usize].is_some_and(|at| at <= now)
    }

    /// The earliest armed timer.
    pub(super) fn next(&self) -> Option<Instant> {
        self.at.iter().flatten().min().copied()
    }
}

/// Encodes a packet's headers; `None` only if the codec refuses (a bug).
pub(super) fn encode(pkt: &Packet<'_>) -> Option<Hdr> {
    match Hdr::encode(pkt) {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::error!(error = %e, ty = %pkt.packet_type(), "could not encode a packet");
            None
        }
    }
}

/// The ids `ids` yields, in ascending order (what a failure or a close walks: a stable order
/// for the completions it reports).
pub(super) fn sorted(ids: impl Iterator<Item = u32>) -> Vec<u32> {
    let mut v: Vec<u32> = ids.collect();
    v.sort_unstable();
    v
}

/// The next id from the counter `next` (wrapping) that `taken` does not hold.
#[inline]
fn next_free_id(next: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
    loop {
        let id = *next;
        *next = next.wrapping_add(1);
        if !taken(id) {
            return id;
        }
    }
}

/// What the engine's handlers report into, beside the sub-state they change (a split borrow of
/// the engine, as quinn-proto hands its streams the connection's pieces they need): the
/// completions for the application, the counters and the timers.
#[derive(Debug, Default)]
pub(super) struct Out {
    pub(super) events: VecDeque<Event>,
    /// `Event::RemoteWrite`s in `events`: peers cause them, so they are capped
    /// ([`MAX_REMOTE_WRITE_EVENTS`](super::MAX_REMOTE_WRITE_EVENTS)); beyond, writes with
    /// immediate data wait.
    pub(super) remote_write_events: usize,
    pub(super) stats: EndpointStats,
    /// Every timer of the engine and its sub-states; `poll_timeout` is the earliest.
    pub(super) timers: TimerTable,
}

impl Out {
    /// Counts and logs a dropped packet.
    pub(super) fn drop_pkt(&mut self, why: &'static str) {
        self.stats.dropped_pkts += 1;
        tracing::debug!(why, "dropped a packet");
    }

    /// Counts an operation refused with `Again` and says why.
    pub(super) fn again(&mut self, what: &'static str, why: &'static str) -> crate::Error {
        self.stats.again += 1;
        crate::Error::new(crate::ErrorKind::Again, what).with_detail(why)
    }

    /// Counts and logs a dropped packet of a type this engine does not implement.
    pub(super) fn drop_pkt_type(&mut self, pkt: &Packet<'_>) {
        self.stats.dropped_pkts += 1;
        tracing::debug!(ty = %pkt.packet_type(), "dropped a packet of a type this engine does not implement");
    }

    /// The completion of an RMA or atomic operation (counted: bytes by path, or an error).
    pub(super) fn rma_done(
        &mut self,
        context: u64,
        buf: super::RmaBuf,
        len: usize,
        path: super::RmaPath,
        error: Option<crate::Error>,
        status: Option<crate::device::Status>,
    ) {
        match (&error, path) {
            (Some(e), _) => {
                self.stats.errors += 1;
                tracing::debug!(error = %e, "RMA operation failed");
            }
            (None, super::RmaPath::Device) => self.stats.device_rma_bytes += len as u64,
            (None, super::RmaPath::Emulated) => self.stats.emulated_rma_bytes += len as u64,
        }
        let len = if error.is_some() { 0 } else { len };
        self.events.push_back(Event::Rma(super::RmaDone {
            context,
            buf,
            len,
            path,
            error,
            status,
        }));
    }

    /// Reports a peer's write with immediate data (counted among the capped events).
    pub(super) fn remote_write(&mut self, done: super::RemoteWriteDone) {
        self.remote_write_events += 1;
        self.events.push_back(Event::RemoteWrite(done));
    }
}
