//! Small helpers of the engine: a coalescing set of byte ranges and a fast hasher for the ids
//! the engine allocates itself.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

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

/// The byte ranges of a message received so far: sorted, disjoint, adjacent ranges merged.
///
/// Segments arrive in any order; an overlapping segment is a duplicate (or a lie) and refused.
#[derive(Debug, Default)]
pub(super) struct RangeSet {
    r: Vec<(u64, u64)>,
}

impl RangeSet {
    /// Adds `[start, end)`. Returns false, changing nothing, when the range is empty or overlaps
    /// a range already present.
    pub(super) fn insert(&mut self, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
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
        self.r.len()
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
