//! Work-request bookkeeping: every work request handed to the NIC gets a token (the verbs `wr_id`)
//! that names a slab entry holding what the request owns (bounce slots, the user's buffer, address
//! handle and memory-registration references). A completion takes the entry back exactly once.
//!
//! A token is `generation << 32 | slab key`. The generation is a per-queue-pair counter that is
//! never 0, so a token is never 0, and a completion carrying a token whose slot has since been
//! reused (a stale completion, e.g. reported twice) does not match: it is ignored and counted, as
//! is a token that names no entry at all.

use slab::Slab;

/// Why a completion's token matched no outstanding work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Miss {
    /// The slot exists but belongs to a later work request (the token's generation is old).
    Stale,
    /// No such slot.
    Unknown,
}

struct Entry<T> {
    generation: u32,
    seq: u64,
    user_wr_id: u64,
    res: T,
}

/// Outstanding work requests and what each owns.
pub struct WrTable<T> {
    slab: Slab<Entry<T>>,
    seq: u64,
    stale: u64,
    unknown: u64,
}

impl<T> Default for WrTable<T> {
    fn default() -> Self {
        WrTable::new()
    }
}

impl<T> WrTable<T> {
    /// An empty table.
    pub fn new() -> WrTable<T> {
        WrTable {
            slab: Slab::new(),
            seq: 0,
            stale: 0,
            unknown: 0,
        }
    }

    /// Records a work request the application knows as `user_wr_id`, owning `res`; returns the
    /// token to post as the verbs `wr_id`.
    pub fn insert(&mut self, user_wr_id: u64, res: T) -> u64 {
        self.seq += 1;
        // 1..=u32::MAX, cycling: never 0.
        let generation = ((self.seq - 1) % u64::from(u32::MAX)) as u32 + 1;
        let key = self.slab.insert(Entry {
            generation,
            seq: self.seq,
            user_wr_id,
            res,
        });
        debug_assert!(
            key <= u32::MAX as usize,
            "work-request table beyond 2^32 entries"
        );
        (u64::from(generation) << 32) | (key as u64 & 0xffff_ffff)
    }

    /// Takes back the work request `token` names: its user `wr_id` and what it owned. A stale or
    /// unknown token is counted and leaves the table unchanged.
    pub fn take(&mut self, token: u64) -> Result<(u64, T), Miss> {
        let key = (token & 0xffff_ffff) as usize;
        let generation = (token >> 32) as u32;
        match self.slab.get(key) {
            Some(e) if e.generation == generation => {
                let e = self.slab.remove(key);
                Ok((e.user_wr_id, e.res))
            }
            Some(_) => {
                self.stale += 1;
                Err(Miss::Stale)
            }
            None => {
                self.unknown += 1;
                Err(Miss::Unknown)
            }
        }
    }

    /// Takes back a work request the NIC refused at posting (not counted as a miss).
    pub fn cancel(&mut self, token: u64) -> Option<(u64, T)> {
        let key = (token & 0xffff_ffff) as usize;
        match self.slab.get(key) {
            Some(e) if u64::from(e.generation) == token >> 32 => {
                let e = self.slab.remove(key);
                Some((e.user_wr_id, e.res))
            }
            _ => None,
        }
    }

    /// Takes back every outstanding work request, in posting order (for the flush on close).
    pub fn drain(&mut self) -> Vec<(u64, T)> {
        let mut all: Vec<Entry<T>> = self.slab.drain().collect();
        all.sort_by_key(|e| e.seq);
        all.into_iter().map(|e| (e.user_wr_id, e.res)).collect()
    }

    /// Work requests outstanding.
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    /// True when none is outstanding.
    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// Completions whose token's slot had been reused since.
    #[cfg(test)]
    pub fn stale(&self) -> u64 {
        self.stale
    }

    /// Completions whose token named no slot.
    #[cfg(test)]
    pub fn unknown(&self) -> u64 {
        self.unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    #[test]
    fn tokens_are_nonzero_and_distinct() {
        let mut t = WrTable::new();
        let a = t.insert(10, ());
        let b = t.insert(11, ());
        assert_ne!(a, 0);
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        assert_eq!(t.take(a), Ok((10, ())));
        // The slot of `a` is reused with a new generation.
        let c = t.insert(12, ());
        assert_eq!(c & 0xffff_ffff, a & 0xffff_ffff);
        assert_ne!(c, a);
    }

    #[test]
    fn each_buffer_comes_back_exactly_once() {
        let mut t: WrTable<BytesMut> = WrTable::new();
        let mut tokens = Vec::new();
        for i in 0..8u64 {
            let mut b = BytesMut::with_capacity(16);
            b.extend_from_slice(&i.to_le_bytes());
            tokens.push(t.insert(100 + i, b));
        }
        let mut back = Vec::new();
        // Completions out of order, one duplicated, one stale, one unknown.
        for &i in &[3usize, 0, 7, 3] {
            match t.take(tokens[i]) {
                Ok((id, buf)) => back.push((id, buf)),
                Err(m) => assert_eq!(m, Miss::Unknown, "duplicate of a freed slot"),
            }
        }
        let reused = t.insert(200, BytesMut::from(&b"new"[..]));
        let old = *tokens
            .iter()
            .find(|t| *t & 0xffff_ffff == reused & 0xffff_ffff)
            .unwrap();
        assert_eq!(t.take(old), Err(Miss::Stale), "old token, slot reused");
        assert_eq!(t.take(0xdead_0000_0000_0999), Err(Miss::Unknown));
        assert_eq!(t.cancel(reused).map(|(id, _)| id), Some(200));
        // Close: everything else flushes, in posting order.
        let flushed = t.drain();
        assert!(t.is_empty());
        let ids: Vec<u64> = flushed.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, vec![101, 102, 104, 105, 106], "posting order");
        back.extend(flushed);
        let mut seen: Vec<u64> = back
            .iter()
            .map(|(id, b)| {
                assert_eq!(&b[..], &(id - 100).to_le_bytes());
                *id
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (100..108).collect::<Vec<_>>());
        assert_eq!(t.stale(), 1);
        assert_eq!(t.unknown(), 2);
        // Taking after the drain finds nothing.
        assert_eq!(t.take(tokens[5]), Err(Miss::Unknown));
    }

    #[test]
    fn generation_wraps_without_zero() {
        let mut t: WrTable<()> = WrTable::new();
        t.seq = u64::from(u32::MAX) - 1;
        let a = t.insert(1, ());
        assert_eq!(a >> 32, u64::from(u32::MAX));
        let b = t.insert(2, ());
        assert_eq!(b >> 32, 1);
        assert!(t.take(a).is_ok() && t.take(b).is_ok());
    }
}
