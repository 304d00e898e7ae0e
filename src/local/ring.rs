//! What the same-host path needs of its channels, so that one implementation of it runs over
//! shared-memory files ([`ShmChannels`](super::chan::ShmChannels)) and, in the simulator, over
//! in-memory rings (`super::mem`): the own ring (multi-producer, single consumer, in order,
//! lossless), read slot by slot; peers' rings, written slot by slot; and whether a peer is
//! still there.

use bytes::BytesMut;

use super::chan::{ADDR_LEN, Head, Liveness, OpenError, SlotHdr};
use crate::addr::RawAddr;

/// The own ring and the way to peers' rings.
pub(crate) trait Channels {
    /// A peer's ring.
    type Peer: PeerRing;

    /// The published slot at the head of the own ring, if any (its fields read once; a slot
    /// whose length exceeds the ring's chunk has `src: None`).
    fn peek(&self) -> Option<Head>;
    /// Appends `n` bytes of the head slot's data to `buf` (which has the room).
    fn copy(&self, h: &Head, n: usize, buf: &mut BytesMut) -> bool;
    /// Frees the head slot.
    fn pop(&self);
    /// True when the head slot is published.
    fn ready(&self) -> bool;
    /// The head position when a producer reserved it and has not published it.
    fn reserved_head(&self) -> Option<u64>;
    /// Gives up on that slot (its producer died between reserving and publishing).
    fn skip_head(&self);
    /// Closes the own channel: peers see it closed, and it cannot be found any more.
    fn close(&mut self);
    /// The application busy-polls: peers need not wake this side.
    fn quiet(&self) {}
    /// The application polls (not busy-polling, as far as known): a wake-up through its
    /// descriptor, if there was one, has reached it.
    fn awake(&self) {}
    /// Opens the ring of the endpoint at `dest`.
    fn open_peer(&mut self, dest: &RawAddr) -> Result<Self::Peer, OpenError>;
    /// A peer was found dead: what it left behind may go.
    fn peer_died(&self) {}
}

/// A peer's ring, for sending.
pub(crate) trait PeerRing {
    /// Largest chunk one slot holds.
    fn chunk(&self) -> usize;
    /// Writes and publishes one slot; its position, or `None` when the ring is full (nothing
    /// written).
    fn push(&self, hdr: &SlotHdr, src: &[u8; ADDR_LEN], data: &[u8]) -> Option<u64>;
    /// True once the owner consumed the slot at `pos`.
    fn consumed(&self, pos: u64) -> bool;
    /// Wakes the owner if it sleeps (after pushes).
    fn wake(&self);
    /// Wakes the owner if it is seen asleep, without ordering (news it finds by itself soon).
    fn nudge(&self);
    /// True when the owner closed its endpoint.
    fn closed(&self) -> bool;
    /// The closed flag, then whether the owner still lives.
    fn liveness(&self) -> Liveness;
}
