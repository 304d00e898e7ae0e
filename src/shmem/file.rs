//! What every shared-memory file of the crate has in common: the shm device's segments
//! ([`segment`](super::segment)) and the local path's channels ([`chan`](super::chan)) start
//! with the same 256-byte header layout, hold a ring of 64-byte-headed slots, and tell whether
//! their owner is alive the same way (a closed flag, then the owner's shared `flock`).
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic (8 bytes, written last with `Release`: a file is valid only once it is there) |
//! | 8 | version, 12 header size (256) |
//! | 16 | total size |
//! | 24 | owner pid |
//! | 28 .. 128 | the kind's own fields |
//! | 128 | closed flag, 132 sleepers, 136 doorbell (futex word) |
//! | 192 | ring tail (its own cache line) |
//! | 256 | the kind's tables and slots |

use std::fs::File;
use std::path::Path;
use std::sync::atomic::Ordering;

// Every ring slot starts with its sequence word (Vyukov's bounded queue): position `p` is free
// for a producer when the word is `p`, published when it is `p + 1`, and handed to the producer
// of the next lap (`p + slots`) when the consumer frees it.

use super::map::{self, Mapping};

/// Bytes of the header.
pub(crate) const HDR_SIZE: usize = 256;
/// Bytes of a slot's header (its data follows).
pub(crate) const SLOT_HDR: usize = 64;
/// Most slots of a ring.
pub(crate) const MAX_SLOTS: u32 = 1 << 16;
/// Attempts at reserving a slot before reporting the ring full (other producers or garbage).
pub(crate) const RESERVE_TRIES: usize = 64;

pub(crate) const H_MAGIC: usize = 0; // u64
pub(crate) const H_VERSION: usize = 8; // u32
pub(crate) const H_HDR_SIZE: usize = 12; // u32
pub(crate) const H_TOTAL: usize = 16; // u64
pub(crate) const H_PID: usize = 24; // u32
pub(crate) const H_CLOSED: usize = 128; // u32
pub(crate) const H_SLEEPERS: usize = 132; // u32
pub(crate) const H_BELL: usize = 136; // u32 (futex word)
pub(crate) const H_TAIL: usize = 192; // u64

/// Whether the mapping starts with `magic` (read with `Acquire`: the rest of the header was
/// written before it), `version` and the common header size.
pub(crate) fn check_kind(m: &Mapping, magic: u64, version: u32) -> Result<(), &'static str> {
    if m.u64(H_MAGIC).map(|w| w.load(Ordering::Acquire)) != Some(magic) {
        return Err("bad magic");
    }
    if m.load32(H_VERSION) != Some(version) {
        return Err("unsupported version");
    }
    if m.load32(H_HDR_SIZE) != Some(HDR_SIZE as u32) {
        return Err("bad header size");
    }
    Ok(())
}

/// True when the owner set the closed flag (or the header is cut short): a plain load.
pub(crate) fn closed(m: &Mapping) -> bool {
    m.u32(H_CLOSED)
        .is_none_or(|w| w.load(Ordering::Acquire) != 0)
}

/// Is the owner of a peer's file still there?
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Liveness {
    Alive,
    /// The owner closed it.
    Closed,
    /// The owner is gone without closing (its lock is free); the name has been removed.
    Dead,
}

/// The liveness of the peer file `file` (inode `ino`, at `path`, mapped as `m`): the closed
/// flag, then the owner's lock. A free lock means no process holds the file: its name is
/// removed (if it still names the same file) while this process holds the lock.
pub(crate) fn liveness(m: &Mapping, file: &File, path: &Path, ino: u64) -> Liveness {
    if closed(m) {
        return Liveness::Closed;
    }
    match map::try_lock_exclusive(file) {
        Ok(true) => {
            if map::remove_if_same(path, ino) {
                tracing::debug!(path = %path.display(), "shm: removed the file of a dead owner");
            }
            Liveness::Dead
        }
        Ok(false) => Liveness::Alive,
        Err(e) => {
            tracing::debug!(error = %e, "shm: cannot probe a peer's lock");
            Liveness::Alive
        }
    }
}

/// Reserves the next position of the ring whose tail is at `H_TAIL` and whose slot of position
/// `p` starts at byte `slot(p)` (its sequence word): the producer side of Vyukov's bounded queue,
/// shared by the shm device's rings and the local path's channels. `None` when the ring is full
/// or, after `RESERVE_TRIES` lost races (other producers, or garbage in the words), looks full:
/// the caller then writes nothing.
pub(crate) fn reserve(m: &Mapping, slot: impl Fn(u64) -> usize) -> Option<u64> {
    let tail = m.u64(H_TAIL)?;
    let mut pos = tail.load(Ordering::Relaxed);
    for _ in 0..RESERVE_TRIES {
        let seq = m.u64(slot(pos))?.load(Ordering::Acquire);
        let diff = seq.wrapping_sub(pos) as i64;
        if diff == 0 {
            match tail.compare_exchange_weak(
                pos,
                pos.wrapping_add(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(pos),
                Err(p) => pos = p,
            }
        } else if diff < 0 {
            return None; // full: the slot still holds the previous lap's datagram
        } else {
            pos = tail.load(Ordering::Relaxed);
        }
        std::hint::spin_loop();
    }
    None
}
