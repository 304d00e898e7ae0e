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
//! | 128 | closed flag, 132 sleepers, 136 doorbell (futex word), 140 descriptor sleeper |
//! | 192 | ring tail (its own cache line) |
//! | 256 | the kind's tables and slots |

use std::fs::File;
use std::path::Path;
use std::time::Duration;

// Every ring slot starts with its sequence word (Vyukov's bounded queue): position `p` is free
// for a producer when the word is `p`, published when it is `p + 1`, and handed to the producer
// of the next lap (`p + slots`) when the consumer frees it.

use super::map::{self, Mapping};
use super::sync::{AtomicU32, Ordering, fence};

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
pub(crate) const H_FD_WAIT: usize = 140; // u32 (the owner's application sleeps on a descriptor)
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

/// Creates the temporary file `tmp` of a new segment or channel of `size` bytes: this user's
/// only (mode 0600 whatever the umask; peers refuse anything else), no symlink followed,
/// locked shared (the owner's mark of life) and allocated. Returns it with its inode.
pub(crate) fn create_owned(tmp: &Path, size: usize) -> std::io::Result<(File, u64)> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    map::lock_shared(&file)?;
    file.set_len(size as u64)?;
    map::allocate(&file, size)?;
    let ino = file.metadata()?.ino();
    Ok((file, ino))
}

/// The doorbell of a file's owner: a futex word (`H_BELL`) it sleeps on and the count of its
/// sleepers (`H_SLEEPERS`). One implementation, so the orderings that make a wake-up never
/// lost are written once: a producer publishes, then (`ring_if_asleep`) fences and looks at the
/// sleepers word; the owner counts itself a sleeper, fences and looks at the ring once more
/// before it sleeps. Either the owner sees the slot, or the producer sees it asleep.
///
/// The owner's application may sleep on a descriptor instead (a completion queue's, in epoll
/// or an async runtime): it sets `fd_wait` (`H_FD_WAIT`) to [`FD_ARMED`], fences and looks at
/// the ring; the first producer that sees it armed takes it ([`FD_TAKEN`], [`Rung::Fd`]) and
/// makes that descriptor readable itself, leaving the futex alone, so the application wakes
/// with no thread in between. Later producers leave the owner alone until its application has
/// polled ([`Doorbell::awake`]: the word is clear again, and the futex rule holds).
#[derive(Clone, Copy)]
pub(crate) struct Doorbell<'a> {
    pub(crate) bell: &'a AtomicU32,
    pub(crate) sleepers: &'a AtomicU32,
    pub(crate) fd_wait: &'a AtomicU32,
}

/// `fd_wait`: the owner's application sleeps on its descriptor.
pub(crate) const FD_ARMED: u32 = 1;
/// `fd_wait`: a producer has made the descriptor readable; the application is waking.
pub(crate) const FD_TAKEN: u32 = 2;

/// What [`Doorbell::ring_if_asleep`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rung {
    /// Nobody sleeps, or the futex was rung.
    Done,
    /// The owner's application sleeps on its descriptor and this producer took the word: it
    /// must make the descriptor readable (or, if it cannot, [`Doorbell::ring`]).
    Fd,
}

impl<'a> Doorbell<'a> {
    /// The doorbell in `m`'s header.
    pub(crate) fn of(m: &'a Mapping) -> Option<Doorbell<'a>> {
        Some(Doorbell {
            bell: m.u32(H_BELL)?,
            sleepers: m.u32(H_SLEEPERS)?,
            fd_wait: m.u32(H_FD_WAIT)?,
        })
    }

    /// Rings: the bell moves (an owner about to sleep sees it moved and does not), and a
    /// sleeping owner is woken.
    pub(crate) fn ring(&self) {
        self.bell.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            map::futex_wake(self.bell);
        }
    }

    /// Rings and wakes whoever waits on the bell, counted as a sleeper or not (the owner is to
    /// look now: stop, its application going to sleep on a completion queue).
    pub(crate) fn wake(&self) {
        self.bell.fetch_add(1, Ordering::SeqCst);
        map::futex_wake(self.bell);
    }

    /// After publishing: rings only if the owner sleeps (or is about to). When its
    /// application sleeps on a descriptor, the first producer to see it takes the word and is
    /// told to write the descriptor ([`Rung::Fd`]); later ones (the word taken) do nothing, as
    /// the application is waking and will poll. No system call unless somebody sleeps.
    #[must_use]
    pub(crate) fn ring_if_asleep(&self) -> Rung {
        fence(Ordering::SeqCst);
        match self.fd_wait.load(Ordering::Relaxed) {
            0 => {}
            // Lost to another producer (it writes the descriptor) or to the owner taking the
            // word back (it looks at the ring after its fence, and finds this slot).
            FD_ARMED => {
                let took = self.fd_wait.compare_exchange(
                    FD_ARMED,
                    FD_TAKEN,
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                );
                return if took.is_ok() { Rung::Fd } else { Rung::Done };
            }
            _ => return Rung::Done,
        }
        self.ring_if_seen_asleep();
        Rung::Done
    }

    /// The owner's application is about to sleep on its descriptor: producers from now on write
    /// it instead of the futex. Call after emptying the descriptor; then look at the ring once
    /// more (the fence orders the two).
    pub(crate) fn arm_fd(&self) {
        self.fd_wait.store(FD_ARMED, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// The owner's application no longer sleeps on its descriptor (it polls, or waits another
    /// way): producers ring the futex again. Then look at the ring once more: a producer may
    /// have seen the word set and written the descriptor instead.
    pub(crate) fn disarm_fd(&self) {
        self.fd_wait.store(0, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// The owner's application polls after a producer woke it through its descriptor: from now
    /// on producers ring the futex again when the waiter sleeps (a plain load when the word is
    /// clear).
    pub(crate) fn awake(&self) {
        if self.fd_wait.load(Ordering::Relaxed) == FD_TAKEN {
            let _ =
                self.fd_wait
                    .compare_exchange(FD_TAKEN, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The owner's side of the handshake: counts itself the sleeper, fences, and sleeps on the
    /// bell (at most `nap()`) unless `ready()` finds work; then is a sleeper no more. Returns
    /// the bell it saw before the look (a bell that moved since means someone rang). The look
    /// after the fence is what makes a wake-up never lost: a producer that published before it
    /// is seen by `ready()`, one that publishes after it sees the sleeper (`ring_if_asleep`).
    pub(crate) fn sleep_unless(
        &self,
        ready: impl FnOnce() -> bool,
        nap: impl FnOnce() -> Duration,
    ) -> u32 {
        self.sleepers.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let seen = self.bell.load(Ordering::Acquire);
        if !ready() {
            map::futex_wait(self.bell, seen, nap());
        }
        self.sleepers.store(0, Ordering::Relaxed);
        seen
    }

    /// Rings if the owner is seen asleep, without the fence: for news the owner also finds by
    /// itself soon (it naps briefly while it waits for it), so a missed wake-up costs a nap.
    pub(crate) fn ring_if_seen_asleep(&self) {
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.ring();
        }
    }
}

/// Whether the slot of position `pos` (sequence word at `seq`) is published: the consumer's
/// look at its head.
pub(crate) fn published(m: &Mapping, seq: usize, pos: u64) -> bool {
    m.u64(seq)
        .is_some_and(|w| w.load(Ordering::Acquire) == pos.wrapping_add(1))
}

/// Frees the consumed slot of position `pos` (sequence word at `seq`) of a ring of `slots`
/// slots for the producer of the next lap.
pub(crate) fn release(m: &Mapping, seq: usize, pos: u64, slots: u32) {
    if let Some(w) = m.u64(seq) {
        w.store(pos.wrapping_add(u64::from(slots)), Ordering::Release);
    }
}

/// Whether a producer reserved the head position `head` (the tail is past it) and has not
/// published it: the consumer's occasional look for a producer that died between the two.
/// Reads the tail's cache line, which the producers write.
pub(crate) fn reserved_unpublished(m: &Mapping, seq: usize, head: u64) -> bool {
    let tail = m.u64(H_TAIL).map_or(head, |t| t.load(Ordering::Acquire));
    tail.wrapping_sub(head) as i64 > 0 && !published(m, seq, head)
}
