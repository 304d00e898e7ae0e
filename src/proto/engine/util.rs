//! Small helpers of the engine: a coalescing set of byte ranges, a fast hasher for the ids
//! the engine allocates itself and the arena packet headers are encoded into.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use bytes::{Bytes, BytesMut};

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

/// A map keyed by engine-chosen ids.
pub(super) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
/// A set of engine-chosen ids.
pub(super) type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

/// Size of one chunk of the header arena: a header is a slice of a chunk, so the `Bytes`
/// handed out share a few allocations.
const HDR_CHUNK: usize = 16 * 1024;

/// Used-up chunks the arena keeps to reuse once their headers are all gone.
const HDR_SPARES: usize = 8;

/// The arena packet headers are encoded into: one chunk is filled header after header (each
/// split off as a `Bytes`); a used-up chunk is kept and reused, without allocating, once the
/// packets that point into it have all been released (by the device completion that frees the
/// packet and by the device dropping the `Transmit`). In steady state two chunks take turns.
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
    /// Room for a header of `len` bytes, appended with [`HeaderArena::buf`].
    pub(super) fn reserve(&mut self, len: usize) {
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

    /// A header already encoded elsewhere, copied into the arena.
    pub(super) fn copy(&mut self, hdr: &[u8]) -> Bytes {
        self.reserve(hdr.len());
        self.cur.extend_from_slice(hdr);
        self.take()
    }

    /// The buffer to append the header to (after [`HeaderArena::reserve`]).
    pub(super) fn buf(&mut self) -> &mut BytesMut {
        &mut self.cur
    }

    /// The header appended since the last call.
    pub(super) fn take(&mut self) -> Bytes {
        self.cur.split().freeze()
    }

    /// Forgets a partly written header.
    pub(super) fn discard(&mut self) {
        self.cur.clear();
    }
}

/// The byte ranges of a message received so far: sorted, disjoint, adjacent ranges merged.
///
/// Segments arrive in any order; an overlapping segment is a duplicate (or a lie) and refused.
/// While the ranges received form one range (segments in order, the usual case) it is kept
/// inline, without allocating.
#[derive(Debug, Default)]
pub(super) struct RangeSet {
    /// The only range while `r` is empty.
    one: Option<(u64, u64)>,
    r: Vec<(u64, u64)>,
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
            self.r.push((s, e));
        }
        // First range that ends after `start`: the only one that can overlap or follow.
        let i = self.r.partition_point(|&(_, e)| e <= start);
        if let Some(&(s, _)) = self.r.get(i) {
            if s < end {
                return false;
            }
        }
        let joins_prev = i > 0 && self.r.get(i - 1).is_some_and(|&(_, e)| e == start);
        let joins_next = self.r.get(i).is_some_and(|&(s, _)| s == end);
        match (joins_prev, joins_next) {
            (true, true) => {
                let next_end = self.r.get(i).map_or(end, |&(_, e)| e);
                if let Some(p) = self.r.get_mut(i - 1) {
                    p.1 = next_end;
                }
                self.r.remove(i);
            }
            (true, false) => {
                if let Some(p) = self.r.get_mut(i - 1) {
                    p.1 = end;
                }
            }
            (false, true) => {
                if let Some(n) = self.r.get_mut(i) {
                    n.0 = start;
                }
            }
            (false, false) => self.r.insert(i, (start, end)),
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
