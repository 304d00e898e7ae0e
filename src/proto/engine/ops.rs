//! What the engine takes and gives back: application operations (`SendOp`, `RecvOp`,
//! `RmaOp`), the work requests it hands to the device (`Transmit`), its completions
//! (`Event`), the memory peers reach (`RmaMemory`) and what it holds (`Resources`).

use bytes::{Bytes, BytesMut};

#[cfg(doc)]
use super::{Engine, EngineLimits};
use crate::addr::RawAddr;
use crate::device::{RemoteIov, Status};
use crate::error::{Error, Result};
use crate::mem::RegionSlice;

/// One send operation (message or tagged message).
#[derive(Debug)]
pub struct SendOp {
    /// Destination (its QKEY is the peer's connection id).
    pub dest: RawAddr,
    /// The data; handed back in the completion.
    pub buf: Bytes,
    /// `Some(tag)` for a tagged send.
    pub tag: Option<u64>,
    /// 4 bytes of remote CQ data.
    pub data: Option<u32>,
    /// Complete only when the data is in the receiver's buffer (`FI_DELIVERY_COMPLETE`, RECEIPT).
    pub delivery_complete: bool,
    /// Returned in the completion.
    pub context: u64,
    /// The send buffer is a registered region peers can RDMA-read: `(key, address of its first
    /// byte)`. Makes the long-read and runting-read protocols possible for large messages.
    pub read_key: Option<(u64, u64)>,
    /// `Some(len)`: the message is the `len` bytes at `read_key` (which must be set) and `buf`
    /// is left empty. The engine reads, through its memory ([`Engine::set_memory`]), only the
    /// bytes that must go in packets: none for a long-read message, the runt of a runting read,
    /// all of them when no read protocol applies or after a READ_NACK. This spares copying a
    /// large registered buffer that the receiver reads itself.
    pub region_len: Option<usize>,
}

impl SendOp {
    /// Length of the message.
    pub fn len(&self) -> usize {
        self.region_len.unwrap_or(self.buf.len())
    }

    /// Whether the message is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One receive operation.
#[derive(Debug)]
pub struct RecvOp {
    /// Where the message goes; `capacity()` is the room. Handed back in the completion.
    pub buf: BytesMut,
    /// `Some((tag, ignore))` for a tagged receive.
    pub tag: Option<(u64, u64)>,
    /// Only from this peer (directed receive).
    pub src: Option<RawAddr>,
    /// `Some(min_free)`: a multi-receive buffer, retired when less than `min_free` bytes remain.
    pub multi_recv: Option<usize>,
    /// Returned in the completion.
    pub context: u64,
    /// The receive buffer is this slice of a region the device registered, and the queue pair
    /// takes region slices: the part of a long-read or runting-read message the engine reads
    /// with device RDMA lands in the region directly (no copy, no registration), the rest in
    /// `buf` ([`RecvDone::in_region`] says where the split is).
    pub local_region: Option<RegionSlice>,
    /// The room when it is not `buf.capacity()`: a region slice's length, whose bytes the
    /// endpoint copies into the slice at completion. `buf` then grows only as data arrives, so
    /// a small message into a large slice takes a buffer of its own size. Not for
    /// multi-receive buffers.
    pub room: Option<usize>,
}

/// A work request to post on the device: a datagram (two segments) to `dest`, or a one-sided
/// RDMA operation ([`TransmitKind`]).
#[derive(Debug, Clone)]
pub struct Transmit {
    /// Give it back in [`Engine::handle_send_completion`] (datagrams) or
    /// [`Engine::handle_rdma_completion`] (RDMA).
    pub wr_id: u64,
    /// Destination queue pair.
    pub dest: RawAddr,
    /// Protocol header (datagrams only).
    pub hdr: Bytes,
    /// Application data: a datagram's second segment, or the data of an RDMA write.
    pub payload: Bytes,
    /// What to post.
    pub kind: TransmitKind,
}

/// What a [`Transmit`] asks the device for.
#[derive(Debug, Clone, Default)]
pub enum TransmitKind {
    /// `post_send` of `hdr` + `payload`.
    #[default]
    Send,
    /// `post_write` of `payload` to `remote`, with optional immediate data.
    RdmaWrite {
        /// Target range.
        remote: RemoteIov,
        /// Immediate data for the target's completion.
        imm: Option<u32>,
    },
    /// `post_read` of `remote` into `buf` (its capacity holds `remote.len` bytes).
    RdmaRead {
        /// Source range.
        remote: RemoteIov,
        /// Local buffer, handed back in the device completion.
        buf: BytesMut,
    },
    /// `post_write_region` of `local` (region memory the device registered) to `remote`, with
    /// optional immediate data; `payload` is empty.
    RdmaWriteRegion {
        /// Target range.
        remote: RemoteIov,
        /// Immediate data for the target's completion.
        imm: Option<u32>,
        /// The source bytes, in a region.
        local: RegionSlice,
    },
    /// `post_read_region` of `remote` into `local` (region memory the device registered); the
    /// device completion hands back no buffer.
    RdmaReadRegion {
        /// Source range.
        remote: RemoteIov,
        /// Where the bytes land.
        local: RegionSlice,
    },
}

/// One RMA or atomic operation (`fi_write`, `fi_read`, `fi_writedata`, `fi_atomic`, ...).
#[derive(Debug)]
pub struct RmaOp {
    /// Target endpoint.
    pub dest: RawAddr,
    /// Target range (key, address in the key's address space, length).
    pub remote: RemoteIov,
    /// What to do.
    pub kind: RmaKind,
    /// The local buffer of a write is a registered region peers can read (key, address): makes
    /// the LONGREAD_RTW protocol possible.
    pub local_key: Option<(u64, u64)>,
    /// Complete only when the data is in the target's memory (`FI_DELIVERY_COMPLETE`: DC_*RTW /
    /// DC_*RTA, or device write followed by nothing more since device writes are placed).
    pub delivery_complete: bool,
    /// Returned in the completion.
    pub context: u64,
    /// The local side is this slice of a region the device registered, and the queue pair
    /// takes region slices ([`QueuePair::region_rdma`](crate::device::QueuePair::region_rdma)):
    /// a device write reads it and a device read lands in it, with no copy and no registration.
    /// A write's buffer is then empty (its length is the slice's) and is filled from the region
    /// only when the write takes another route; a read's buffer is empty and gets the data
    /// only on another route, else the completion says [`RmaBuf::InRegion`].
    pub local_region: Option<RegionSlice>,
}

impl RmaOp {
    /// The bytes the operation moves from or into local memory.
    pub fn local_len(&self) -> usize {
        match (&self.kind, &self.local_region) {
            (RmaKind::Write { .. } | RmaKind::Read { .. }, Some(r)) => r.len,
            (RmaKind::Write { buf, .. }, None) => buf.len(),
            (RmaKind::Read { buf }, None) => buf.capacity(),
            (RmaKind::Atomic { operand, .. }, _) => operand.len(),
        }
    }
}

/// The kind of an [`RmaOp`].
#[derive(Debug)]
pub enum RmaKind {
    /// Write `buf` (its length must equal `remote.len`); with `data`, the target gets a
    /// [`Event::RemoteWrite`] carrying it (`fi_writedata`).
    Write {
        /// The data.
        buf: Bytes,
        /// 4 bytes of remote CQ data.
        data: Option<u32>,
    },
    /// Read `remote.len` bytes into `buf` (its capacity must hold them).
    Read {
        /// The destination.
        buf: BytesMut,
    },
    /// An atomic on `remote.len / datatype.size()` elements.
    Atomic {
        /// The operation.
        op: crate::atomic::AtomicOp,
        /// The element type.
        datatype: crate::atomic::AtomicType,
        /// Operand elements (empty for [`AtomicOp::Read`](crate::atomic::AtomicOp::Read)).
        operand: Bytes,
        /// Compare elements (compare operations only).
        compare: Option<Bytes>,
        /// Where the target's previous values go (fetch and compare atomics).
        fetch: Option<BytesMut>,
    },
}

/// The buffers of a finished [`RmaOp`], handed back. (`Debug` shows lengths and first bytes.)
pub enum RmaBuf {
    /// A write's data.
    Write(Bytes),
    /// A read's destination, filled on success.
    Read(BytesMut),
    /// A read's data went straight into its local region ([`RmaOp::local_region`]): nothing
    /// to copy (on failure the region holds what the device wrote, unspecified).
    InRegion,
    /// An atomic's operand and, for fetch and compare atomics, the previous target values.
    Atomic {
        /// The operand.
        operand: Bytes,
        /// The previous values (filled on success).
        fetch: Option<BytesMut>,
    },
}

impl RmaBuf {
    /// The buffers an operation of this kind carries, handed back.
    pub fn from_kind(kind: RmaKind) -> RmaBuf {
        match kind {
            RmaKind::Write { buf, .. } => RmaBuf::Write(buf),
            RmaKind::Read { buf } => RmaBuf::Read(buf),
            RmaKind::Atomic { operand, fetch, .. } => RmaBuf::Atomic { operand, fetch },
        }
    }
}

impl std::fmt::Debug for RmaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::mem::Short;
        match self {
            RmaBuf::Write(b) => f.debug_tuple("Write").field(&Short(b)).finish(),
            RmaBuf::Read(b) => f.debug_tuple("Read").field(&Short(b)).finish(),
            RmaBuf::InRegion => f.write_str("InRegion"),
            RmaBuf::Atomic { operand, fetch } => f
                .debug_struct("Atomic")
                .field("operand", &Short(operand))
                .field("fetch", &fetch.as_ref().map(|b| Short(b)))
                .finish(),
        }
    }
}

/// Whether an RMA operation ran as one-sided device RDMA or was emulated with packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RmaPath {
    /// Device RDMA read/write.
    Device,
    /// The engine's emulation (RTW / RTR / RTA packets, or the read-based protocols).
    Emulated,
}

/// A finished RMA or atomic operation.
#[derive(Debug)]
pub struct RmaDone {
    /// The operation's context.
    pub context: u64,
    /// The buffers, handed back.
    pub buf: RmaBuf,
    /// Bytes transferred.
    pub len: usize,
    /// How it ran.
    pub path: RmaPath,
    /// `None` on success; `RemoteAccess` for a bad key or range, ...
    pub error: Option<Error>,
    /// Device (or peer-reported) status behind an error, if any.
    pub status: Option<Status>,
}

/// The target side of a write with immediate data (`FI_REMOTE_CQ_DATA | FI_REMOTE_WRITE`): the
/// data is already in the target's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteWriteDone {
    /// The writer.
    pub src: RawAddr,
    /// The 4 bytes of immediate data.
    pub data: u32,
    /// Bytes written.
    pub len: usize,
}

/// The memory peers reach with emulated RMA and atomics: the domain's registered regions
/// ([`crate::Domain`] implements it). Access is checked against the key, bounds and rights.
pub trait RmaMemory: Send + Sync + std::fmt::Debug {
    /// Writes `data` at `addr` of the region `key` names. `RemoteAccess` for a bad key, range or
    /// right (nothing written); `Again` when the application holds the region's lock right now
    /// (retry later).
    fn write(&self, key: u64, addr: u64, data: &[u8]) -> Result<()>;
    /// The `len` bytes at `addr` of the region `key` names; errors as for `write`.
    fn read(&self, key: u64, addr: u64, len: u64) -> Result<Bytes>;
    /// Checks, without touching the memory, that the key is live and grants the right
    /// (`REMOTE_WRITE` when `write`, else `REMOTE_READ`) and that `len` bytes at `addr` lie in
    /// its region: a long-CTS write or read is checked whole before its first byte moves.
    /// `RemoteAccess` otherwise.
    fn check(&self, key: u64, addr: u64, len: u64, write: bool) -> Result<()>;
    /// Applies an atomic to the elements at `addr` as one step and returns their previous
    /// values; errors as for `write`, `InvalidArgument` for a bad operand length or an operation
    /// the datatype does not support.
    fn atomic(&self, key: u64, addr: u64, a: crate::atomic::AtomicArgs<'_>) -> Result<Bytes>;
    /// True when `key` names device-only memory (a dmabuf with no CPU mapping): only the NIC
    /// reaches its bytes, so a send from it goes by the long-read protocol alone, and every
    /// access above refuses it with `NotSupported`. The default: no device-only memory.
    fn device_only(&self, key: u64) -> bool {
        let _ = key;
        false
    }
}

/// A finished send.
#[derive(Debug)]
pub struct SendDone {
    /// The operation's context.
    pub context: u64,
    /// The buffer, handed back.
    pub buf: Bytes,
    /// Bytes sent.
    pub len: usize,
    /// The tag of a tagged send.
    pub tag: Option<u64>,
    /// `None` on success.
    pub error: Option<Error>,
    /// Device status behind an error, if any.
    pub status: Option<Status>,
}

/// A finished receive.
#[derive(Debug)]
pub struct RecvDone {
    /// The operation's context.
    pub context: u64,
    /// The buffer (for a multi-receive: the part this message occupies), handed back.
    pub buf: BytesMut,
    /// Bytes placed.
    pub len: usize,
    /// For truncation: bytes that did not fit.
    pub olen: usize,
    /// Tag of a tagged message.
    pub tag: Option<u64>,
    /// Remote CQ data.
    pub data: Option<u32>,
    /// The sender (`FI_SOURCE`); `None` for cancelled receives.
    pub src: Option<RawAddr>,
    /// This completion retires a multi-receive buffer (`FI_MULTI_RECV`).
    pub multi_recv_done: bool,
    /// `None` on success; `Truncated`, `Canceled`, `ConnectionAborted`, ... otherwise.
    pub error: Option<Error>,
    /// `Some(from)`: the bytes of the message from offset `from` on were read straight into
    /// the receive's region ([`RecvOp::local_region`]); `buf` holds only those before it.
    pub in_region: Option<usize>,
}

/// What the engine reports.
#[derive(Debug)]
pub enum Event {
    /// A send finished.
    Send(SendDone),
    /// A receive finished.
    Recv(RecvDone),
    /// An RMA or atomic operation this side initiated finished.
    Rma(RmaDone),
    /// A peer's write with immediate data landed in this side's memory.
    RemoteWrite(RemoteWriteDone),
}

/// Result of a peek at the unexpected messages (`FI_PEEK`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peeked {
    /// Message length.
    pub len: usize,
    /// Its tag.
    pub tag: u64,
    /// Its remote CQ data.
    pub data: Option<u32>,
    /// Its sender.
    pub src: RawAddr,
    /// With `claim`: the token that [`Engine::recv_claimed`] takes.
    pub claim: Option<u64>,
}

/// What the engine holds right now (to check that memory returns to its baseline).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    /// Send operations in flight.
    pub tx_ops: usize,
    /// Posted or in-progress receives.
    pub rx_ops: usize,
    /// Unexpected messages held.
    pub unexpected_msgs: usize,
    /// Bytes copied out for unexpected messages.
    pub unexpected_bytes: usize,
    /// Packets held in reorder windows and overflow lists.
    pub reorder_held: usize,
    /// Messages held without a receive (waiting their turn, unexpected, claimed): what
    /// [`EngineLimits::max_buffered_msgs`] caps.
    pub buffered_msgs: usize,
    /// Bytes copied out for them: what [`EngineLimits::max_buffered_bytes`] caps.
    pub buffered_bytes: usize,
    /// Packets queued for transmission (not yet handed out).
    pub queued_pkts: usize,
    /// Packets handed out and not yet completed by the device.
    pub outstanding_pkts: usize,
    /// Known peers.
    pub peers: usize,
    /// Peers' RMA work this side serves: emulated long-CTS writes and reads, LONGREAD_RTW
    /// targets, atomics waiting for their turn, work waiting for a locked region, responses
    /// on the device.
    pub target_ops: usize,
    /// Completions of peers' writes with immediate data not yet taken by the application
    /// (at most [`MAX_REMOTE_WRITE_EVENTS`]).
    pub remote_write_events: usize,
}

/// Most completions of peers' writes with immediate data the engine holds while the
/// application does not take them (its completion queue is full): further such writes wait,
/// their data held within `EngineLimits::max_buffered_bytes` and beyond it refused, so a peer
/// cannot grow memory without limit (issue 17, defect 7).
pub const MAX_REMOTE_WRITE_EVENTS: usize = 1024;
