//! The per-peer reorder window for `msg_id`s (libfabric's `robuf` plus its overflow list).
//!
//! RTM and RTA packets carry a per-peer `msg_id` drawn from one 32-bit counter; the receiver
//! processes them strictly in `msg_id` order (send-after-send ordering). Ids are compared
//! wrap-aware: `a` is after `b` when `(a - b) as i32 > 0`. A window of `size` slots (a power of
//! two) holds ids `exp .. exp + size`; ids beyond it go to an overflow map instead of being an
//! error (as libfabric does since 2024).

use std::collections::HashMap;

/// Where an arriving id landed.
#[derive(Debug, PartialEq, Eq)]
pub enum Arrival<T> {
    /// Stored; take items in order with [`ReorderWindow::pop_ready`].
    Stored,
    /// Already processed (behind the window's start): the item is handed back to be dropped.
    Stale(T),
    /// The same id is already waiting: the item is handed back to be dropped.
    Duplicate(T),
}

/// A reorder window of `size` slots with an unbounded overflow map.
#[derive(Debug)]
pub struct ReorderWindow<T> {
    exp: u32,
    slots: Vec<Option<T>>,
    overflow: HashMap<u32, T>,
    held: usize,
}

impl<T> ReorderWindow<T> {
    /// A window expecting id `first` next, with `size` slots (rounded up to a power of two, ≥ 1).
    pub fn new(first: u32, size: usize) -> ReorderWindow<T> {
        let size = size.max(1).next_power_of_two();
        ReorderWindow {
            exp: first,
            slots: (0..size).map(|_| None).collect(),
            overflow: HashMap::new(),
            held: 0,
        }
    }

    /// The next id to be processed.
    pub fn expected(&self) -> u32 {
        self.exp
    }

    /// Items waiting (in the window and in overflow).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Items waiting beyond the window.
    pub fn overflowed(&self) -> usize {
        self.overflow.len()
    }

    fn slot(&self, id: u32) -> usize {
        id as usize & (self.slots.len() - 1)
    }

    /// Records an arriving id.
    pub fn insert(&mut self, id: u32, item: T) -> Arrival<T> {
        let dist = id.wrapping_sub(self.exp);
        if (dist as i32) < 0 {
            return Arrival::Stale(item);
        }
        if (dist as usize) < self.slots.len() {
            let s = self.slot(id);
            if self.slots[s].is_some() {
                return Arrival::Duplicate(item);
            }
            self.slots[s] = Some(item);
        } else {
            if self.overflow.contains_key(&id) {
                return Arrival::Duplicate(item);
            }
            self.overflow.insert(id, item);
        }
        self.held += 1;
        Arrival::Stored
    }

    /// Takes the item with the expected id, if it has arrived, and advances past it.
    pub fn pop_ready(&mut self) -> Option<(u32, T)> {
        let id = self.exp;
        let s = self.slot(id);
        let item = match self.slots[s].take() {
            Some(x) => x,
            None if self.overflow.is_empty() => return None,
            None => self.overflow.remove(&id)?,
        };
        self.exp = self.exp.wrapping_add(1);
        self.held -= 1;
        // The slot of `id + size` just became part of the window: promote it from overflow.
        if !self.overflow.is_empty() {
            let promote = id.wrapping_add(self.slots.len() as u32);
            if let Some(x) = self.overflow.remove(&promote) {
                self.slots[s] = Some(x);
            }
        }
        Some((id, item))
    }

    /// The expected id arrived and is processed at once: advances past it without storing it
    /// (as [`ReorderWindow::insert`] then [`ReorderWindow::pop_ready`] would). False, changing
    /// nothing, when `id` is not the expected id or an item already waits under it.
    pub fn pass(&mut self, id: u32) -> bool {
        let s = self.slot(id);
        if id != self.exp || self.slots[s].is_some() {
            return false;
        }
        self.exp = self.exp.wrapping_add(1);
        if !self.overflow.is_empty() {
            let promote = id.wrapping_add(self.slots.len() as u32);
            if let Some(x) = self.overflow.remove(&promote) {
                self.slots[s] = Some(x);
            }
        }
        true
    }

    /// Skips the expected id without an item (an aborted message that will never arrive).
    pub fn skip(&mut self) {
        let id = self.exp;
        let s = self.slot(id);
        if self.slots[s].take().is_some() || self.overflow.remove(&id).is_some() {
            self.held -= 1;
        }
        self.exp = self.exp.wrapping_add(1);
        if let Some(x) = self
            .overflow
            .remove(&id.wrapping_add(self.slots.len() as u32))
        {
            self.slots[s] = Some(x);
        }
    }

    /// Drains every waiting item (peer teardown).
    pub fn drain(&mut self) -> Vec<(u32, T)> {
        let mut v = Vec::with_capacity(self.held);
        let n = self.slots.len() as u32;
        for k in 0..n {
            let id = self.exp.wrapping_add(k);
            let s = self.slot(id);
            if let Some(x) = self.slots[s].take() {
                v.push((id, x));
            }
        }
        v.extend(self.overflow.drain());
        self.held = 0;
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{Rng, test_seed};

    #[test]
    fn in_order_and_out_of_order_with_overflow_and_wrap() {
        for &size in &[1usize, 2, 16] {
            for &start in &[0u32, u32::MAX - 40] {
                let seed = test_seed();
                let mut rng = Rng::new(seed);
                let n = 500u32;
                let mut ids: Vec<u32> = (0..n).map(|i| start.wrapping_add(i)).collect();
                // Shuffle locally so some ids land far beyond the window.
                for i in (1..ids.len()).rev() {
                    let j = rng.below(i as u64 + 1) as usize;
                    ids.swap(i, j);
                }
                let mut w = ReorderWindow::new(start, size);
                let mut out = Vec::new();
                for &id in &ids {
                    assert_eq!(w.insert(id, id), Arrival::Stored, "seed {seed}");
                    assert_eq!(w.insert(id, id), Arrival::Duplicate(id), "seed {seed}");
                    while let Some((k, v)) = w.pop_ready() {
                        assert_eq!(k, v);
                        out.push(v);
                    }
                }
                let want: Vec<u32> = (0..n).map(|i| start.wrapping_add(i)).collect();
                assert_eq!(out, want, "seed {seed} size {size}");
                assert_eq!(w.held(), 0);
                assert_eq!(
                    w.insert(start, 0),
                    Arrival::Stale(0),
                    "processed ids are stale"
                );
            }
        }
    }

    #[test]
    fn pass_is_insert_then_pop() {
        let seed = test_seed();
        let mut rng = Rng::new(seed);
        let mut a = ReorderWindow::new(u32::MAX - 20, 4);
        let mut b = ReorderWindow::new(u32::MAX - 20, 4);
        let mut next = u32::MAX - 20;
        for _ in 0..2000 {
            // Either the expected id passes, or a later one is stored in both.
            if rng.chance(0.5) {
                let id = a.expected();
                assert_eq!(
                    a.pass(id),
                    b.insert(id, id) == Arrival::Stored,
                    "seed {seed}"
                );
                assert_eq!(b.pop_ready(), Some((id, id)), "seed {seed}");
                assert!(!a.pass(id), "seed {seed}");
            } else {
                if (a.expected().wrapping_sub(next) as i32) > 0 {
                    next = a.expected();
                }
                next = next.wrapping_add(1 + rng.below(8) as u32);
                assert_eq!(a.insert(next, next), b.insert(next, next), "seed {seed}");
            }
            loop {
                let (x, y) = (a.pop_ready(), b.pop_ready());
                assert_eq!(x, y, "seed {seed}");
                if x.is_none() {
                    break;
                }
            }
            assert_eq!(
                (a.expected(), a.held(), a.overflowed()),
                (b.expected(), b.held(), b.overflowed()),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn skip_advances_past_an_aborted_id() {
        let mut w = ReorderWindow::new(10, 4);
        assert_eq!(w.insert(11, 'b'), Arrival::Stored);
        assert!(w.pop_ready().is_none());
        w.skip();
        assert_eq!(w.pop_ready(), Some((11, 'b')));
        assert_eq!(w.expected(), 12);
    }
}
