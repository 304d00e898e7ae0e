//! What the same-host path needs of its channels, so that one implementation of it runs over
//! shared-memory files ([`ShmChannels`](super::chan::ShmChannels)) and, in the simulator, over
//! in-memory rings (`super::mem`): the own ring (multi-producer, single consumer, in order,
//! lossless), read slot by slot; peers' rings, written slot by slot; and whether a peer is
//! still there.

use bytes::BytesMut;

use crate::addr::{Gid, RawAddr};
pub(crate) use crate::shmem::file::Liveness;

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

// The slot format both kinds of channel share (the shared-memory files and the in-memory
// rings): kinds, flags, the header and the sender's address.

/// Bytes of an encoded raw address (qkey, qpn, GID).
pub(crate) const ADDR_LEN: usize = 24;

/// Slot kinds.
pub(crate) const K_MSG: u8 = 1;
pub(crate) const K_NEXT: u8 = 2;
pub(crate) const K_DC_ACK: u8 = 3;

/// Slot flags.
pub(crate) const F_TAGGED: u8 = 1;
pub(crate) const F_DATA: u8 = 2;
pub(crate) const F_DC: u8 = 4;
/// Nobody waits for the slot's consumption (an inject): the consumer need not wake its sender.
pub(crate) const F_UNWATCHED: u8 = 8;

/// A raw address as channel headers carry it.
pub(crate) fn encode_addr(a: &RawAddr) -> [u8; ADDR_LEN] {
    let mut b = [0u8; ADDR_LEN];
    b[..4].copy_from_slice(&a.qkey.to_le_bytes());
    b[4..8].copy_from_slice(&u32::from(a.qpn).to_le_bytes());
    b[8..].copy_from_slice(&a.gid.0);
    b
}

pub(crate) fn decode_addr(b: &[u8; ADDR_LEN]) -> Option<RawAddr> {
    let qkey = u32::from_le_bytes(b[..4].try_into().ok()?);
    let qpn = u16::try_from(u32::from_le_bytes(b[4..8].try_into().ok()?)).ok()?;
    let gid = Gid(b[8..].try_into().ok()?);
    Some(RawAddr { gid, qpn, qkey })
}

/// What a slot says besides its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlotHdr {
    pub kind: u8,
    pub flags: u8,
    /// Bytes of data in this slot.
    pub len: u32,
    pub tag: u64,
    /// Message length (first chunk) or offset (further chunks).
    pub word: u64,
    pub data: u32,
    pub token: u32,
}

/// A published slot at the head of the owner's ring.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Head {
    pub hdr: SlotHdr,
    /// The sender (`None`: unreadable, the slot is malformed).
    pub src: Option<RawAddr>,
    /// Where the data starts: in the mapping (shm), the slot's index (in-memory rings).
    pub(super) data_off: usize,
}

/// Why a peer's channel could not be used.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// No channel of that name (a remote peer, or one without a local path).
    Absent,
    /// A file that is not a channel of a live owner in this namespace for this address.
    Unusable(&'static str),
}
