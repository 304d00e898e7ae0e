//! The receive ring of a segment: a bounded multi-producer (any process), single-consumer (the
//! owner) queue of fixed slots, after Dmitry Vyukov's bounded queue, plus a per-slot state word
//! that lets an SRD sender take back a datagram the receiver has not taken (RNR give-up), and the
//! acknowledgement table receivers write final send statuses into.
//!
//! Every function works on a [`Mapping`] and a [`Geometry`] the caller validated (or, for its own
//! segment, wrote); every word is reached through a bounds-checked accessor, so garbage written
//! by another process changes what is read, never where.
//!
//! Memory ordering: a producer reserves position `p` by CAS on `tail` when slot `p`'s sequence is
//! `p`, writes the slot (fields relaxed, data copied), then stores sequence `p + 1` with
//! `Release`; the consumer loads the sequence with `Acquire`, and after consuming stores
//! `p + slots` with `Release`, which hands the slot to the producer of the next lap.

use crate::shmem::sync::{AtomicU32, AtomicU64, Ordering};

use bytes::BytesMut;

use super::segment::Geometry;
use crate::shmem::file::{self, Doorbell, H_CLOSED, H_TAIL, SLOT_HDR};
use crate::shmem::map::Mapping;

// Slot offsets.
const S_SEQ: usize = 0; // u64
const S_STATE: usize = 8; // u64: (pos << 8) | state
const S_WRITER: usize = 16; // u32: sender QPN (0: none)
const S_LEN: usize = 20; // u32
const S_QKEY: usize = 24; // u32: destination QKEY
const S_IMM: usize = 28; // u32
const S_FLAGS: usize = 32; // u32
const S_SRC_QKEY: usize = 36; // u32
const S_TOKEN: usize = 40; // u64: acknowledgement entry | generation << 32

/// Slot flag: immediate data present.
pub(crate) const F_IMM: u32 = 1;
/// Slot flag: written by an SRD queue pair.
pub(crate) const F_SRD: u32 = 2;
/// Slot flag: a one-sided RDMA message for the device (`device::soft_rdma`).
pub(crate) const F_RDMA: u32 = 4;

/// Slot states (low byte of the state word).
pub(crate) const ST_FREE: u8 = 0;
pub(crate) const ST_PUBLISHED: u8 = 1;
pub(crate) const ST_RNR: u8 = 2;
pub(crate) const ST_TAKEN: u8 = 3;
pub(crate) const ST_CANCELLED: u8 = 4;

/// Acknowledgement code of an entry still waiting.
pub(crate) const ACK_PENDING: u8 = 0xff;

const TAG_MASK: u64 = (1 << 56) - 1;

/// The state word of position `pos` in state `st`.
pub(crate) fn state_word(pos: u64, st: u8) -> u64 {
    ((pos & TAG_MASK) << 8) | u64::from(st)
}

/// Splits a state word into (position tag, state).
pub(crate) fn split_state(w: u64) -> (u64, u8) {
    (w >> 8, (w & 0xff) as u8)
}

/// The tag a position has in state words.
pub(crate) fn tag(pos: u64) -> u64 {
    pos & TAG_MASK
}

/// An acknowledgement word.
pub(crate) fn ack_word(gen_: u32, code: u8) -> u64 {
    (u64::from(gen_) << 8) | u64::from(code)
}

/// What a sender writes besides the data.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Meta {
    pub writer: u32,
    pub len: u32,
    pub qkey: u32,
    pub imm: u32,
    pub flags: u32,
    pub src_qkey: u32,
    pub token: u64,
}

/// One ring (and header words) seen through a mapping.
#[derive(Clone, Copy)]
pub(crate) struct Ring<'a> {
    pub m: &'a Mapping,
    pub g: &'a Geometry,
}

/// What the consumer finds at its head position.
pub(crate) enum Peek {
    /// Nothing there (the tail has not passed the head).
    Empty,
    /// Reserved by a producer that has not published yet.
    Reserved,
    /// Published: the state word and the slot's fields.
    Ready(u8, Meta),
    /// The slot's words make no sense for this position.
    Garbage,
}

impl<'a> Ring<'a> {
    pub(crate) fn new(m: &'a Mapping, g: &'a Geometry) -> Ring<'a> {
        Ring { m, g }
    }

    fn w32(&self, off: usize) -> Option<&'a AtomicU32> {
        self.m.u32(off)
    }

    fn w64(&self, off: usize) -> Option<&'a AtomicU64> {
        self.m.u64(off)
    }

    fn slot_w32(&self, pos: u64, f: usize) -> Option<&'a AtomicU32> {
        self.w32(self.g.slot(pos) + f)
    }

    fn slot_w64(&self, pos: u64, f: usize) -> Option<&'a AtomicU64> {
        self.w64(self.g.slot(pos) + f)
    }

    /// The shared tail (next position producers reserve).
    pub(crate) fn tail(&self) -> Option<&'a AtomicU64> {
        self.w64(H_TAIL)
    }

    /// The closed flag.
    pub(crate) fn closed(&self) -> bool {
        self.w32(H_CLOSED)
            .is_none_or(|w| w.load(Ordering::Acquire) != 0)
    }

    /// Sets the closed flag.
    pub(crate) fn set_closed(&self) {
        if let Some(w) = self.w32(H_CLOSED) {
            w.store(1, Ordering::Release);
        }
    }

    /// The owner's doorbell.
    pub(crate) fn bell(&self) -> Option<Doorbell<'a>> {
        Doorbell::of(self.m)
    }

    /// Rings the doorbell: wakes the owner's thread if it sleeps.
    pub(crate) fn ring_bell(&self) {
        if let Some(d) = self.bell() {
            d.ring();
        }
    }

    /// After publishing a datagram: wakes the owner's thread only if it sleeps (or is about to).
    /// The owner's polls and its thread's last look before sleeping find datagrams through the
    /// ring tail, so a busy receiver is not made to re-scan anything by a bell that moved.
    pub(crate) fn ring_bell_if_asleep(&self) {
        if let Some(d) = self.bell() {
            // A segment's owner never sleeps on a descriptor (only channels' owners do), so
            // the answer is always `Done`; should one ever, ring the futex instead.
            if d.ring_if_asleep() == file::Rung::Fd {
                d.ring();
            }
        }
    }

    // ---- producer side ------------------------------------------------------------------

    /// Reserves a slot for `writer`; `None` when the ring is full (or unusable).
    pub(crate) fn reserve(&self, writer: u32) -> Option<u64> {
        let pos = file::reserve(self.m, |p| self.g.slot(p) + S_SEQ)?;
        self.slot_w32(pos, S_WRITER)?
            .store(writer, Ordering::Relaxed);
        Some(pos)
    }

    /// Fills reserved position `pos` with `meta` and the two segments, then publishes it.
    /// The caller checked that the data fits the slot.
    pub(crate) fn publish(&self, pos: u64, meta: &Meta, hdr: &[u8], payload: &[u8]) {
        let base = self.g.slot(pos);
        let put32 = |f: usize, v: u32| {
            if let Some(w) = self.w32(base + f) {
                w.store(v, Ordering::Relaxed);
            }
        };
        put32(S_LEN, meta.len);
        put32(S_QKEY, meta.qkey);
        put32(S_IMM, meta.imm);
        put32(S_FLAGS, meta.flags);
        put32(S_SRC_QKEY, meta.src_qkey);
        if let Some(w) = self.w64(base + S_TOKEN) {
            w.store(meta.token, Ordering::Relaxed);
        }
        let data = base + SLOT_HDR;
        self.m.write(data, hdr);
        self.m.write(data + hdr.len(), payload);
        if let Some(w) = self.w64(base + S_STATE) {
            w.store(state_word(pos, ST_PUBLISHED), Ordering::Relaxed);
        }
        if let Some(w) = self.w64(base + S_SEQ) {
            w.store(pos.wrapping_add(1), Ordering::Release);
        }
    }

    /// The state word of the slot of `pos` as (tag, state).
    pub(crate) fn state(&self, pos: u64) -> Option<(u64, u8)> {
        self.slot_w64(pos, S_STATE)
            .map(|w| split_state(w.load(Ordering::Acquire)))
    }

    /// Moves the slot of `pos` from state `from` to `to`; false when it was not in `from` (for
    /// this position).
    pub(crate) fn transition(&self, pos: u64, from: u8, to: u8) -> bool {
        self.slot_w64(pos, S_STATE).is_some_and(|w| {
            w.compare_exchange(
                state_word(pos, from),
                state_word(pos, to),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        })
    }

    // ---- consumer side ------------------------------------------------------------------

    /// Looks at position `pos` (the consumer's head).
    pub(crate) fn peek(&self, pos: u64) -> Peek {
        let Some(seq) = self.slot_w64(pos, S_SEQ) else {
            return Peek::Garbage;
        };
        let seq = seq.load(Ordering::Acquire);
        if seq == pos {
            let tail = self.tail().map_or(pos, |t| t.load(Ordering::Acquire));
            return if tail.wrapping_sub(pos) as i64 > 0 {
                Peek::Reserved
            } else {
                Peek::Empty
            };
        }
        if seq != pos.wrapping_add(1) {
            return Peek::Garbage;
        }
        let Some((t, st)) = self.state(pos) else {
            return Peek::Garbage;
        };
        if t != tag(pos) {
            return Peek::Garbage;
        }
        let base = self.g.slot(pos);
        let get32 = |f: usize| self.w32(base + f).map_or(0, |w| w.load(Ordering::Relaxed));
        Peek::Ready(
            st,
            Meta {
                writer: get32(S_WRITER),
                len: get32(S_LEN),
                qkey: get32(S_QKEY),
                imm: get32(S_IMM),
                flags: get32(S_FLAGS),
                src_qkey: get32(S_SRC_QKEY),
                token: self
                    .w64(base + S_TOKEN)
                    .map_or(0, |w| w.load(Ordering::Relaxed)),
            },
        )
    }

    /// The writer recorded in the slot of `pos` (0: none yet).
    pub(crate) fn writer(&self, pos: u64) -> u32 {
        self.slot_w32(pos, S_WRITER)
            .map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// Copies `n` data bytes of the slot of `pos` into `buf` (bounded by the slot).
    pub(crate) fn read_data(&self, pos: u64, n: usize, buf: &mut BytesMut) -> bool {
        n <= self.g.mtu as usize && self.m.read_into(self.g.slot(pos) + SLOT_HDR, n, buf)
    }

    /// Releases the slot of `pos` to the producer of the next lap.
    pub(crate) fn free(&self, pos: u64) {
        if let Some(w) = self.slot_w32(pos, S_WRITER) {
            w.store(0, Ordering::Relaxed);
        }
        if let Some(w) = self.slot_w64(pos, S_STATE) {
            w.store(state_word(pos, ST_FREE), Ordering::Relaxed);
        }
        file::release(self.m, self.g.slot(pos) + S_SEQ, pos, self.g.slots);
    }

    /// Is the slot of `pos` published (sequence `pos + 1`)?
    pub(crate) fn is_published(&self, pos: u64) -> bool {
        file::published(self.m, self.g.slot(pos) + S_SEQ, pos)
    }

    // ---- acknowledgement table ------------------------------------------------------------

    /// Acknowledgement entry `i`.
    pub(crate) fn ack(&self, i: u32) -> Option<&'a AtomicU64> {
        self.w64(self.g.ack(i)?)
    }

    /// Completes entry `i` of generation `gen_` with `code`, if it is still pending.
    pub(crate) fn complete_ack(&self, i: u32, gen_: u32, code: u8) -> bool {
        self.ack(i).is_some_and(|w| {
            w.compare_exchange(
                ack_word(gen_, ACK_PENDING),
                ack_word(gen_, code),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        })
    }
}
