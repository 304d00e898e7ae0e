//! The lock of a region's bytes, by byte range: a guard of one slice keeps out only what
//! overlaps it. Two slices of one region are two disjoint ranges, so a thread that holds a write
//! guard on one slice can copy another slice (a device posting a write from it), a remote write
//! can land beside a page the application is filling, and none of them waits for the other.
//!
//! Readers share a range, a writer has it alone. There is no writer preference: a reader never
//! waits for a writer that is only waiting, so read guards nest (a thread may hold read guards of
//! overlapping slices, as `RwLock::read_recursive` allows), and a writer waits until no held
//! range overlaps its own. Holds are few (the guards alive and the copies in progress), so they
//! are a short list under a mutex.

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::ops::Range;

use parking_lot::{Condvar, Mutex};

use super::store::Store;

/// One held range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hold {
    start: usize,
    end: usize,
    write: bool,
}

impl Hold {
    /// True when `self` and `other` cannot both be held.
    fn conflicts(&self, other: &Hold) -> bool {
        (self.write || other.write) && self.start < other.end && other.start < self.end
    }
}

#[derive(Debug, Default)]
struct State {
    holds: Vec<Hold>,
    /// The bytes were taken out ([`RangeLock::close`]): every later guard is empty.
    closed: bool,
    /// Threads blocked in [`RangeLock::lock`].
    sleepers: usize,
}

/// A region's bytes behind a lock by byte range.
pub(crate) struct RangeLock {
    store: UnsafeCell<Store>,
    /// The bytes' first address and length, taken once from the store (it never moves them
    /// until [`close`](RangeLock::close) replaces it).
    base: *mut u8,
    len: usize,
    state: Mutex<State>,
    released: Condvar,
}

// SAFETY: the store is `Send` and `Sync`; the raw pointer names its bytes, and every access to
// them goes through a `Held` whose range no other `Held` overlaps mutably (see `lock`).
unsafe impl Send for RangeLock {}
// SAFETY: as above: shared access hands out only `Held`s, which the state keeps apart.
unsafe impl Sync for RangeLock {}

/// A held range of a [`RangeLock`]'s bytes; released when dropped. Empty (and holding nothing)
/// when the range is not inside the bytes or they were taken out.
pub(crate) struct Held<'a> {
    lock: &'a RangeLock,
    hold: Option<Hold>,
}

impl RangeLock {
    pub(crate) fn new(mut store: Store) -> RangeLock {
        let bytes: &mut [u8] = &mut store;
        let (base, len) = (bytes.as_mut_ptr(), bytes.len());
        RangeLock {
            store: UnsafeCell::new(store),
            base,
            len,
            state: Mutex::new(State::default()),
            released: Condvar::new(),
        }
    }

    /// Holds `range` for reading or writing (`write`). Blocks while an overlapping range is
    /// held in a conflicting mode when `block`; otherwise `None` then. An empty range, one not
    /// inside the bytes, or bytes taken out give an empty `Held` that holds nothing.
    pub(crate) fn lock(&self, range: Range<usize>, write: bool, block: bool) -> Option<Held<'_>> {
        let empty = Held {
            lock: self,
            hold: None,
        };
        if range.start >= range.end || range.end > self.len {
            return Some(empty);
        }
        let h = Hold {
            start: range.start,
            end: range.end,
            write,
        };
        let mut st = self.state.lock();
        loop {
            if st.closed {
                return Some(empty);
            }
            if !st.holds.iter().any(|o| o.conflicts(&h)) {
                break;
            }
            if !block {
                return None;
            }
            st.sleepers += 1;
            self.released.wait(&mut st);
            st.sleepers -= 1;
        }
        st.holds.push(h);
        Some(Held {
            lock: self,
            hold: Some(h),
        })
    }

    /// True once the bytes were taken out.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// Waits until no range is held, then takes the store out (an empty one stays) and empties
    /// every later guard. Taken out already: an empty store.
    pub(crate) fn close(&self) -> Store {
        let whole = Hold {
            start: 0,
            end: usize::MAX,
            write: true,
        };
        let mut st = self.state.lock();
        while !st.closed && st.holds.iter().any(|o| o.conflicts(&whole)) {
            st.sleepers += 1;
            self.released.wait(&mut st);
            st.sleepers -= 1;
        }
        if st.closed {
            return Store::Owned(bytes::BytesMut::new());
        }
        st.closed = true;
        // SAFETY: no range is held and `closed` (set under the same mutex) keeps every later
        // `lock` from handing out one, so nothing else reaches the store or its bytes.
        unsafe { std::mem::replace(&mut *self.store.get(), Store::Owned(bytes::BytesMut::new())) }
    }
}

impl Held<'_> {
    /// The held bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        match self.hold {
            // SAFETY: `lock` checked `start < end <= len`; the bytes stay valid while a range is
            // held (`close` waits for every hold), and no writer holds an overlapping range.
            Some(h) => unsafe {
                std::slice::from_raw_parts(self.lock.base.add(h.start), h.end - h.start)
            },
            None => &[],
        }
    }

    /// The held bytes, for writing; empty unless held for writing.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self.hold {
            // SAFETY: as in `bytes`; held for writing, no other hold overlaps this range, and
            // `&mut self` makes this the only reference made from this hold.
            Some(h) if h.write => unsafe {
                std::slice::from_raw_parts_mut(self.lock.base.add(h.start), h.end - h.start)
            },
            _ => &mut [],
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let Some(h) = self.hold.take() else {
            return;
        };
        let mut st = self.lock.state.lock();
        if let Some(i) = st.holds.iter().position(|o| *o == h) {
            st.holds.swap_remove(i);
        }
        if st.sleepers > 0 {
            self.lock.released.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use std::sync::Arc;
    use std::time::Duration;

    fn lock(n: usize) -> RangeLock {
        RangeLock::new(Store::Owned(BytesMut::from(&vec![0u8; n][..])))
    }

    #[test]
    fn disjoint_ranges_are_held_at_once_overlapping_writes_are_not() {
        let l = lock(100);
        let mut a = l.lock(0..50, true, false).unwrap();
        let mut b = l.lock(50..100, true, false).unwrap();
        a.bytes_mut().fill(1);
        b.bytes_mut().fill(2);
        assert!(
            l.lock(49..51, false, false).is_none(),
            "overlaps both writers"
        );
        assert!(l.lock(10..20, true, false).is_none());
        drop(a);
        let r1 = l.lock(10..20, false, false).unwrap();
        let r2 = l.lock(0..50, false, false).unwrap();
        assert_eq!(r1.bytes(), &[1; 10]);
        assert_eq!(r2.bytes().len(), 50);
        assert!(
            l.lock(45..55, true, false).is_none(),
            "readers and a writer there"
        );
        drop((r1, r2, b));
        let w = l.lock(45..55, true, false).unwrap();
        assert_eq!(w.bytes(), &[1, 1, 1, 1, 1, 2, 2, 2, 2, 2]);
    }

    #[test]
    fn empty_or_outside_ranges_hold_nothing() {
        let l = lock(10);
        let _w = l.lock(0..10, true, false).unwrap();
        for r in [5..5, 8..11, 20..30] {
            let h = l.lock(r.clone(), true, false).expect("nothing to wait for");
            assert!(h.bytes().is_empty(), "{r:?}");
        }
    }

    #[test]
    fn a_blocked_writer_goes_on_when_the_overlap_is_released_and_close_waits_for_all() {
        let l = Arc::new(lock(64));
        let r = l.lock(0..8, false, true).unwrap();
        let l2 = l.clone();
        let t = std::thread::spawn(move || {
            let mut w = l2.lock(4..12, true, true).unwrap();
            w.bytes_mut().fill(9);
        });
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "the writer waits for the reader");
        drop(r);
        t.join().unwrap();
        let held = l.lock(0..64, false, true).unwrap();
        let l3 = l.clone();
        let c = std::thread::spawn(move || l3.close());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!c.is_finished(), "close waits for the guard");
        assert_eq!(&held.bytes()[4..12], &[9; 8]);
        drop(held);
        let store = c.join().unwrap();
        assert_eq!(store.len(), 64);
        assert!(l.is_closed());
        assert!(l.lock(0..8, true, false).unwrap().bytes().is_empty());
        assert!(l.close().is_empty(), "closed once");
    }

    /// Threads take random ranges for reading or writing: a writer fills its range with its own
    /// mark and finds it intact before it lets go (no one else wrote there meanwhile), a reader
    /// finds its range as it was at the start (no one wrote while it read).
    #[test]
    fn random_holds_never_see_each_other_write() {
        let seed = crate::fault::test_seed();
        let l = Arc::new(lock(256));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let mut rng = crate::fault::Rng::new(seed ^ u64::from(t));
                    for _ in 0..2000 {
                        let a = rng.below(256) as usize;
                        let b = a + 1 + rng.below((256 - a) as u64) as usize;
                        if rng.below(2) == 0 {
                            let mut h = l.lock(a..b, true, true).unwrap();
                            h.bytes_mut().fill(t + 1);
                            std::thread::yield_now();
                            assert!(h.bytes().iter().all(|x| *x == t + 1), "seed {seed}");
                        } else {
                            let h = l.lock(a..b, false, true).unwrap();
                            let first = h.bytes().to_vec();
                            std::thread::yield_now();
                            assert_eq!(h.bytes(), &first[..], "seed {seed}");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(l.state.lock().holds.is_empty(), "seed {seed}");
    }
}
