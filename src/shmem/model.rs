//! Under `--cfg loom` only: a model of a shared file mapping and of the kernel's futex, so the
//! lock-free code that works on memory other processes share (the rings and doorbells of
//! [`file`](super::file), `device::shm::ring`, `local::chan`) runs unchanged inside the model
//! checker, which cannot see a real mapping.
//!
//! - Every 4-aligned offset has its own loom `AtomicU32` and every 8-aligned offset its own
//!   `AtomicU64`. The two do not alias: the model holds as long as each word of a layout is
//!   always reached at one width, which every layout of the crate does (each offset is one
//!   named constant of one width).
//! - The bytes copied in and out ([`Mapping::write`], [`Mapping::read_to`],
//!   [`Mapping::read_into`]) live in loom cells of one 64-byte line each: a copy that is not
//!   ordered after the last copy into the same line by another thread (a slot's data read
//!   before its publication is seen, or written before its consumer let go of it) is reported
//!   by loom as a data race.
//! - [`futex_wait`] sleeps on one model futex bucket (a loom mutex and condition variable)
//!   while the word holds the expected value, and [`futex_wake`] wakes every sleeper. The
//!   timeout is ignored: a sleep nobody ends is a deadlock loom reports, which is how a lost
//!   wake-up shows (the real code would only lose one nap).
//!
//! A mapping is a handle on shared model memory: cloning it is mapping the same file again.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use loom::cell::UnsafeCell;
use loom::sync::{Condvar, Mutex};

use super::sync::{AtomicU32, AtomicU64, Ordering};

const LINE: usize = 64;

struct Memory {
    len: usize,
    w32: Vec<AtomicU32>,
    w64: Vec<AtomicU64>,
    lines: Vec<UnsafeCell<[u8; LINE]>>,
}

// SAFETY: the cells are only reached through loom's `with`/`with_mut`, which check every access
// against the other threads' (a concurrent one is reported, not performed); the rest are atomics.
unsafe impl Sync for Memory {}

/// Model shared memory of `len` zero bytes (as a new file is), or another handle on it.
#[derive(Clone)]
pub(crate) struct Mapping(Arc<Memory>);

impl Mapping {
    /// `len` bytes of fresh model memory (all zero). Only inside `loom::model`.
    pub(crate) fn new(len: usize) -> Mapping {
        Mapping(Arc::new(Memory {
            len,
            w32: (0..len / 4).map(|_| AtomicU32::new(0)).collect(),
            w64: (0..len / 8).map(|_| AtomicU64::new(0)).collect(),
            lines: (0..len.div_ceil(LINE))
                .map(|_| UnsafeCell::new([0; LINE]))
                .collect(),
        }))
    }

    /// What mapping a file gives: fresh model memory of `len` bytes (the file is not read; the
    /// model tests hand one `Mapping` to every side instead).
    pub(crate) fn map(_file: &File, len: usize) -> io::Result<Mapping> {
        Ok(Mapping::new(len))
    }

    /// As [`Mapping::map`].
    pub(crate) fn map_populated(file: &File, len: usize) -> io::Result<Mapping> {
        Mapping::map(file, len)
    }

    /// Length, bytes.
    pub(crate) fn len(&self) -> usize {
        self.0.len
    }

    fn range(&self, off: usize, n: usize) -> Option<usize> {
        let end = off.checked_add(n)?;
        (end <= self.0.len).then_some(off)
    }

    /// The 32-bit word at `off` (4-aligned, inside).
    pub(crate) fn u32(&self, off: usize) -> Option<&AtomicU32> {
        let off = self.range(off, 4)?;
        (off % 4 == 0).then(|| &self.0.w32[off / 4])
    }

    /// The 64-bit word at `off` (8-aligned, inside).
    pub(crate) fn u64(&self, off: usize) -> Option<&AtomicU64> {
        let off = self.range(off, 8)?;
        (off % 8 == 0).then(|| &self.0.w64[off / 8])
    }

    // `load32`, `load64`, `store32` and `store64` are the real mapping's (`super::map`).

    /// Calls `f(line, offset in the line, offset in the copy, bytes)` for each line piece of
    /// `off..off + n`.
    fn pieces(
        &self,
        off: usize,
        n: usize,
        mut f: impl FnMut(&UnsafeCell<[u8; LINE]>, usize, usize, usize),
    ) {
        let mut done = 0;
        while done < n {
            let at = off + done;
            let (line, inner) = (at / LINE, at % LINE);
            let k = (LINE - inner).min(n - done);
            f(&self.0.lines[line], inner, done, k);
            done += k;
        }
    }

    /// Copies `src` to `off`; false when the range leaves the memory.
    pub(crate) fn write(&self, off: usize, src: &[u8]) -> bool {
        let Some(off) = self.range(off, src.len()) else {
            return false;
        };
        self.pieces(off, src.len(), |cell, inner, at, k| {
            // SAFETY: loom's cell checks that no other thread reaches the line concurrently
            // (it reports a race instead); the pointer is valid for the closure.
            cell.with_mut(|p| unsafe {
                (&mut *p)[inner..inner + k].copy_from_slice(&src[at..at + k])
            });
        });
        true
    }

    /// Copies `dst.len()` bytes from `off`; false when the range leaves the memory.
    pub(crate) fn read_to(&self, off: usize, dst: &mut [u8]) -> bool {
        let Some(off) = self.range(off, dst.len()) else {
            return false;
        };
        self.pieces(off, dst.len(), |cell, inner, at, k| {
            // SAFETY: as in `write`, for a read.
            cell.with(|p| dst[at..at + k].copy_from_slice(unsafe { &(&*p)[inner..inner + k] }));
        });
        true
    }

    /// Appends `n` bytes from `off` to `buf`, within its spare capacity.
    pub(crate) fn read_into(&self, off: usize, n: usize, buf: &mut BytesMut) -> bool {
        if self.range(off, n).is_none() || buf.capacity() - buf.len() < n {
            return false;
        }
        let mut tmp = vec![0; n];
        self.read_to(off, &mut tmp);
        buf.extend_from_slice(&tmp);
        true
    }
}

/// Runs the model test `f` under loom: every interleaving with at most `LOOM_MAX_PREEMPTIONS`
/// preemptions (2 when unset; loom's other `LOOM_*` variables apply too).
#[cfg(test)]
pub(crate) fn check(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    b.check(f);
}

loom::lazy_static! {
    /// The model's futex bucket: every word shares it (a wake-up of another word is a spurious
    /// return, which callers of the real futex handle too).
    static ref FUTEX: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());
}

/// Sleeps while `word` holds `expected`, until a [`futex_wake`] (no timeout in the model).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, _timeout: Duration) {
    let (lock, cv) = &*FUTEX;
    let guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    if word.load(Ordering::SeqCst) == expected {
        drop(cv.wait(guard));
    }
}

/// Wakes every sleeper.
pub(crate) fn futex_wake(_word: &AtomicU32) {
    let (lock, cv) = &*FUTEX;
    let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
    cv.notify_all();
}
