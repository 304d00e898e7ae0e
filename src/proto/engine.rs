//! The sans-I/O RDM protocol engine (EFA RDM wire protocol v4).
//!
//! One `Engine` serves one RDM endpoint. It never reads a clock, sleeps or touches a device:
//! the caller feeds it application operations ([`Engine::send`], [`Engine::post_recv`], ...),
//! device completions ([`Engine::handle_recv`], [`Engine::handle_send_completion`]) and the
//! time, and takes out packets to post ([`Engine::poll_transmit`]), completions
//! ([`Engine::poll_event`]) and the next timer ([`Engine::poll_timeout`]).
//!
//! The device under it must deliver datagrams of at most one MTU exactly once, in any order (SRD);
//! the engine adds per-peer ordering (send-after-send), segmentation (eager / medium / long-CTS),
//! tag matching, flow control and RNR backoff.
//!
//! How it works (state per peer, protocol choice, windows, backoff, memory caps, what the
//! handshake advertises) is described in the "Engine" section of `docs/protocol.md`. The code is
//! split by direction: `peer` (identification, handshake, backoff, failure), `tx` (protocol
//! choice, packet queues, CTS/RECEIPT, device completions), `rx` (reordering, matching,
//! segments, CTSDATA, receives, peek/claim/discard) and `read` (device RDMA, long/runting read,
//! EOR, READ_NACK, LONGREAD_RTW).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::addr::RawAddr;
use crate::device::{RemoteIov, Source, Status};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::Rng;
use crate::mem::RegionSlice;
use crate::proto::wire::{self, Packet};
use crate::stats::EndpointStats;

mod budget;
mod counts;
mod local;
mod peer;
mod read;
mod recv;
mod rma;
mod rx;
mod tx;
mod util;

pub use counts::TargetCounts;
pub use local::{CopyFn, LocalMsg, SameHost};
use recv::{MultiRecv, PostedItem};
use rx::Done;
use tx::Pkt;
use util::{Hdr, HeaderArena, Timer};

/// Engine parameters (from [`crate::Config`] and the device attributes).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Largest datagram the device sends (header + payload).
    pub mtu: usize,
    /// Send-queue depth of the device queue pair: the engine never has more packets outstanding.
    pub max_outstanding_tx: usize,
    /// Largest number of application send operations in flight (`tx_size`); more is `Again`.
    pub max_tx_ops: usize,
    /// Largest number of posted receives (`rx_size`); more is `Again`.
    pub max_rx_ops: usize,
    /// `FI_EFA_RECVWIN_SIZE`: reorder window (power of two).
    pub recvwin_size: usize,
    /// `FI_EFA_TX_MIN_CREDITS`: packets per CTS window.
    pub tx_min_credits: usize,
    /// `FI_EFA_INTER_MAX_MEDIUM_MESSAGE_SIZE`: largest medium message; above it long-CTS.
    pub max_medium_msg_size: usize,
    /// `FI_EFA_TIMEOUT_INTERVAL`: first RNR backoff (zero: random 40..120 µs, as libfabric).
    pub timeout_interval: Duration,
    /// `FI_EFA_MAX_TIMEOUT`: cap of the RNR backoff.
    pub max_timeout: Duration,
    /// A receive that made no progress for this long (its sender vanished mid-message) fails.
    pub rx_stall_timeout: Duration,
    /// Seed of the engine's randomness (backoff jitter).
    pub seed: u64,
    /// This side's device can do one-sided RDMA read and `FI_EFA_USE_DEVICE_RDMA` allows it
    /// (advertised in the handshake; used towards peers that advertise it too).
    pub device_rdma_read: bool,
    /// This side's device can do one-sided RDMA write (and write with immediate data) and the
    /// configuration allows it.
    pub device_rdma_write: bool,
    /// Largest single device RDMA read or write (bytes); larger operations are split.
    pub max_rdma_size: u64,
    /// `FI_EFA_INTER_MIN_READ_WRITE_SIZE`: emulated RMA writes at least this long use
    /// LONGREAD_RTW when RDMA read exists on both sides.
    pub inter_min_read_write_size: usize,
    /// `FI_EFA_INTER_MIN_READ_MESSAGE_SIZE`: messages at least this long use the long-read (or
    /// runting-read) protocol when RDMA read exists on both sides and the buffer is readable.
    pub inter_min_read_message_size: usize,
    /// `FI_EFA_RUNT_SIZE`: bytes a runting read sends eagerly before the receiver reads the rest
    /// (0 disables runting reads).
    pub runt_size: usize,
    /// `FI_EFA_INTER_READ_SEGMENT_SIZE`: largest single read of the read-based protocols.
    pub inter_read_segment_size: usize,
}

/// The queue sizes an endpoint chose: its queue pair's send depth and its operation tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineSizes {
    /// Send-queue depth of the queue pair.
    pub send_depth: usize,
    /// Send operations in flight at most (`tx_size`).
    pub tx_ops: usize,
    /// Posted receives at most (`rx_size`).
    pub rx_ops: usize,
}

impl EngineConfig {
    /// The engine parameters of an endpoint, the one place they are derived: the protocol
    /// variables of `cfg`, the device's MTU, RDMA capabilities (as far as `use_rdma`, the
    /// outcome of `FI_EFA_USE_DEVICE_RDMA`, allows) and largest RDMA, and the queue sizes.
    /// `FI_EFA_TX_QUEUE_SIZE` caps the packets on the device below the send depth.
    ///
    /// ```
    /// use efa::device::{DeviceAttr, DeviceKind};
    /// use efa::proto::engine::{EngineConfig, EngineSizes};
    /// let gid = std::net::Ipv4Addr::LOCALHOST.into();
    /// let attr = DeviceAttr::software(DeviceKind::Udp, "t".into(), gid, 8192, 256, 256);
    /// let cfg = efa::Config::default().with_tx_queue_size(64);
    /// let sizes = EngineSizes { send_depth: 256, tx_ops: 1024, rx_ops: 1024 };
    /// let e = EngineConfig::new(&cfg, &attr, sizes, true, 1);
    /// assert_eq!((e.mtu, e.max_outstanding_tx, e.max_tx_ops), (8192, 64, 1024));
    /// assert_eq!(e.device_rdma_read, attr.caps.rdma_read);
    /// ```
    pub fn new(
        cfg: &crate::config::Config,
        attr: &crate::device::DeviceAttr,
        sizes: EngineSizes,
        use_rdma: bool,
        seed: u64,
    ) -> EngineConfig {
        EngineConfig {
            mtu: attr.mtu,
            max_outstanding_tx: match cfg.tx_queue_size {
                0 => sizes.send_depth,
                n => n.min(sizes.send_depth),
            },
            max_tx_ops: sizes.tx_ops,
            max_rx_ops: sizes.rx_ops,
            recvwin_size: cfg.recvwin_size,
            tx_min_credits: cfg.tx_min_credits as usize,
            max_medium_msg_size: cfg.inter_max_medium_message_size,
            timeout_interval: cfg.timeout_interval,
            max_timeout: cfg.max_timeout,
            rx_stall_timeout: Duration::from_secs(30),
            seed,
            device_rdma_read: use_rdma && attr.caps.rdma_read,
            device_rdma_write: use_rdma && attr.caps.rdma_write,
            max_rdma_size: attr.max_rdma_size,
            inter_min_read_write_size: cfg.inter_min_read_write_size,
            inter_min_read_message_size: cfg.inter_min_read_message_size,
            runt_size: cfg.runt_size,
            inter_read_segment_size: cfg.inter_read_segment_size,
        }
    }
}

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

/// Bounds on what peers can make the engine hold (an addition to the declared API; see
/// [`Engine::set_limits`]). A REQ from a new peer beyond `max_peers` is dropped and counted. The
/// buffering bounds are kept by the caller, never by dropping what the device delivered (it was
/// acknowledged): the RDM endpoint posts no more device receive buffers than the budget left, so
/// past it senders get receiver-not-ready; a message delivered anyway is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Most peers known at once; a REQ from a new peer beyond it is dropped (and [`Engine::send`]
    /// to a new peer is refused with `NoMemory`).
    pub max_peers: usize,
    /// Most messages held without a receive (waiting in reorder windows, unexpected, claimed).
    pub max_buffered_msgs: usize,
    /// Most bytes copied out for such messages.
    pub max_buffered_bytes: usize,
}

impl Default for EngineLimits {
    /// 65 536 peers, 65 536 messages, 64 MiB.
    fn default() -> Self {
        EngineLimits {
            max_peers: 65_536,
            max_buffered_msgs: 65_536,
            max_buffered_bytes: 64 << 20,
        }
    }
}

/// The RDM protocol engine of one endpoint.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    local: RawAddr,
    rng: Rng,
    closed: bool,

    /// The peers, finding them, their turns and backoffs.
    peers: peer::Peers,
    /// Every timer of the engine and its sub-states; `poll_timeout` is the earliest.
    timers: util::TimerTable,

    /// Send operations by `send_id`.
    tx: tx::TxSide,

    /// The receive side: inbound messages, matching, multi-receive buffers, claimed messages.
    rx: rx::RxSide,
    /// Messages and bytes held without a receive.
    budget: budget::Budget,

    events: VecDeque<Event>,
    /// `Event::RemoteWrite`s in `events`: peers cause them, so they are capped
    /// ([`MAX_REMOTE_WRITE_EVENTS`]); beyond, writes with immediate data wait.
    remote_write_events: usize,
    stats: EndpointStats,
    /// Memory peers reach with emulated RMA and atomics.
    memory: Option<std::sync::Arc<dyn RmaMemory>>,
    /// Arena the headers handed to the device are copied into.
    hdr: HeaderArena,
    /// Reused list of the packets a send or a CTS window creates (no allocation per message).
    pkt_scratch: Vec<Pkt>,
    /// Device RDMA and the read-based protocols (`read.rs`).
    rd: read::ReadState,
    /// Emulated RMA and atomics (`rma.rs`).
    ema: rma::Ema,
    /// Delivery-complete acknowledgements the local path owes (`local.rs`).
    local_receipts: VecDeque<(RawAddr, u32)>,
    /// Peers' RMA served since the last [`Engine::take_target_counts`].
    target_counts: TargetCounts,
    /// The application counts peers' writes / reads of its memory
    /// ([`Engine::set_remote_events`]).
    remote_events: (bool, bool),
}

impl Engine {
    /// An engine for the endpoint whose queue pair has raw address `local`.
    pub fn new(cfg: EngineConfig, local: RawAddr, _now: Instant) -> Engine {
        let rng = Rng::new(cfg.seed ^ 0x5eed_e761_9e00_0000);
        let (max_tx, max_rx) = (cfg.max_tx_ops, cfg.max_rx_ops);
        Engine {
            cfg,
            local,
            rng,
            closed: false,
            peers: peer::Peers::default(),
            timers: util::TimerTable::default(),
            tx: tx::TxSide::new(2 * max_tx),
            rx: rx::RxSide::new((2 * max_rx).max(4096)),
            budget: budget::Budget::new(EngineLimits::default()),
            events: VecDeque::new(),
            remote_write_events: 0,
            stats: EndpointStats::default(),
            memory: None,
            hdr: HeaderArena::default(),
            pkt_scratch: Vec::new(),
            rd: read::ReadState::default(),
            ema: rma::Ema::default(),
            local_receipts: VecDeque::new(),
            target_counts: TargetCounts::default(),
            remote_events: (false, false),
        }
    }

    /// The endpoint's own address.
    pub fn local_addr(&self) -> RawAddr {
        self.local
    }

    /// Replaces the memory bounds (an addition to the declared API).
    pub fn set_limits(&mut self, limits: EngineLimits) {
        self.budget.limits = limits;
    }

    /// The memory bounds in force.
    pub fn limits(&self) -> EngineLimits {
        self.budget.limits
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Starts a send. `Again` (with the operation handed back) when `max_tx_ops` are in flight
    /// or the peer is in RNR backoff; `MsgSize` never (any size is allowed).
    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value"
    )]
    pub fn send(&mut self, now: Instant, op: SendOp) -> Result<(), (Error, SendOp)> {
        self.send_impl(now, op)
    }

    /// Posts a receive: matched at once against unexpected messages, else queued. `Again` (with
    /// the operation handed back) when `max_rx_ops` are posted.
    #[allow(
        clippy::result_large_err,
        reason = "the refused receive is handed back by value"
    )]
    pub fn post_recv(&mut self, now: Instant, op: RecvOp) -> Result<(), (Error, RecvOp)> {
        self.post_recv_impl(now, op)
    }

    /// Cancels the oldest posted receive with `context` that has not started matching; it
    /// completes with `Canceled`. Returns false when there is none.
    pub fn cancel_recv(&mut self, context: u64) -> bool {
        self.cancel_impl(context)
    }

    /// Looks for an unexpected tagged message (`FI_PEEK`); with `claim` it is reserved for
    /// [`Engine::recv_claimed`] (`FI_CLAIM`). `NoMessage` when none matches.
    pub fn peek(
        &mut self,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
        claim: bool,
    ) -> Result<Peeked> {
        self.peek_impl(tag, ignore, src, claim)
    }

    /// Receives a claimed message into `op.buf`.
    #[allow(
        clippy::result_large_err,
        reason = "the refused receive is handed back by value"
    )]
    pub fn recv_claimed(
        &mut self,
        now: Instant,
        claim: u64,
        op: RecvOp,
    ) -> Result<(), (Error, RecvOp)> {
        self.recv_claimed_impl(now, claim, op)
    }

    /// Discards an unexpected tagged message (`FI_DISCARD`); its sender's operation still
    /// completes normally. `NoMessage` when none matches.
    pub fn discard(&mut self, tag: u64, ignore: u64, src: Option<RawAddr>) -> Result<Peeked> {
        self.discard_impl(tag, ignore, src)
    }

    /// Gives the engine the memory peers' emulated RMA and atomics reach. Without it, such
    /// requests are refused with [`Status::RemoteBadAddress`].
    pub fn set_memory(&mut self, mem: std::sync::Arc<dyn RmaMemory>) {
        self.memory = Some(mem);
    }

    /// Starts an RMA or atomic operation; `Again` when `max_tx_ops` operations are in flight.
    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value, as send and post_recv do"
    )]
    pub fn rma(&mut self, now: Instant, op: RmaOp) -> Result<(), (Error, RmaOp)> {
        // Device RDMA (and LONGREAD_RTW) first; the op comes back when it must be emulated.
        match self.try_device_rma(now, op)? {
            None => Ok(()),
            Some(op) => self.rma_emulated(now, op),
        }
    }

    /// Emulated RMA and atomics (RTW / RTR / RTA). Filled in by the emulated-RMA work.
    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value, as send and post_recv do"
    )]
    fn rma_emulated(&mut self, now: Instant, op: RmaOp) -> Result<(), (Error, RmaOp)> {
        let _ = now;
        let op = Engine::own_buffers(op)?;
        self.ema_start(op)
    }

    /// The device completed the RDMA work request `wr_id` (a [`TransmitKind::RdmaWrite`] or
    /// [`TransmitKind::RdmaRead`] handed out by [`Engine::poll_transmit`]); `buf` is the read
    /// buffer the device handed back.
    pub fn handle_rdma_completion(
        &mut self,
        now: Instant,
        wr_id: u64,
        status: Status,
        buf: Option<BytesMut>,
    ) {
        self.rdma_completion_impl(now, wr_id, status, buf)
    }

    /// The device placed a peer's RDMA write with immediate data (`imm`, `len` bytes) in this
    /// side's memory: reported as [`Event::RemoteWrite`].
    pub fn handle_remote_write(&mut self, now: Instant, src: Source, imm: u32, len: usize) {
        self.remote_write_impl(now, src, imm, len)
    }

    /// A datagram arrived from `src` (the device's receive completion); `data` is its bytes.
    /// Malformed, stale or duplicate packets are dropped and counted, never a panic.
    pub fn handle_recv(&mut self, now: Instant, src: Source, data: &[u8]) {
        if self.closed {
            self.drop_pkt("endpoint closed");
            return;
        }
        let (pkt, payload) = match wire::decode(data) {
            Ok(x) => x,
            Err(e) => {
                self.stats.dropped_pkts += 1;
                tracing::debug!(error = %e, len = data.len(), "dropped an undecodable packet");
                return;
            }
        };
        let Some(pid) = self.identify(now, src, &pkt) else {
            return;
        };
        match pkt {
            Packet::EagerRtm { .. }
            | Packet::MediumRtm { .. }
            | Packet::LongCtsRtm { .. }
            | Packet::LongReadRtm { .. }
            | Packet::RuntReadRtm { .. } => self.handle_rtm(now, pid, &pkt, payload),
            Packet::LongReadRtw { .. } | Packet::Eor { .. } | Packet::ReadNack { .. } => {
                self.handle_read_pkt(now, pid, &pkt, payload)
            }
            Packet::EagerRtw {
                rma_iov,
                dc_send_id: None,
                ..
            } if rma_iov.is_empty() && payload.is_empty() => {
                // A 0-byte write: libfabric's handshake trigger. Nothing to do but answer with
                // our HANDSHAKE (below).
            }
            Packet::Handshake(h) => self.handle_handshake(now, pid, &h),
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                read_req: true,
                ..
            } => self.ema_cts_read(now, pid, send_id, recv_id, recv_length),
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                ..
            } => {
                // The id says whose it is (one id space: `alloc_tx_id`).
                if !self.ema_owns_send_id(send_id) {
                    self.handle_cts(pid, send_id, recv_id, recv_length)
                } else if !self.ema_cts_write(now, pid, send_id, recv_id, recv_length) {
                    self.drop_pkt("CTS for an RMA operation of another peer or state");
                }
            }
            Packet::CtsData {
                recv_id,
                seg_offset,
                ..
            } => {
                if !self.ema_owns_recv_id(recv_id) {
                    self.handle_ctsdata(now, pid, recv_id, seg_offset, payload)
                } else if !self.ema_ctsdata(now, pid, recv_id, seg_offset, payload) {
                    self.drop_pkt("CTSDATA for an RMA operation of another peer or state");
                }
            }
            Packet::LongCtsRtw {
                opt,
                msg_length,
                send_id,
                dc,
                rma_iov,
                ..
            } => self.ema_longcts_rtw(
                now,
                pid,
                rma_iov,
                msg_length,
                send_id,
                dc,
                opt.cq_data,
                payload,
            ),
            Packet::LongCtsRtr {
                msg_length,
                recv_id,
                recv_length,
                rma_iov,
                ..
            } => self.ema_longcts_rtr(now, pid, rma_iov, msg_length, recv_id, recv_length),
            Packet::Receipt {
                send_id, msg_id, ..
            } => {
                if !self.ema_owns_send_id(send_id) {
                    self.handle_receipt(pid, send_id, msg_id)
                } else if !self.ema_receipt(pid, send_id) {
                    self.drop_pkt("RECEIPT for an RMA operation of another peer or a read");
                }
            }
            Packet::EagerRtw {
                opt,
                dc_send_id,
                rma_iov,
            } => self.ema_rtw(now, pid, rma_iov, dc_send_id, opt.cq_data, payload),
            Packet::ShortRtr {
                rma_iov, recv_id, ..
            } => self.ema_rtr(now, pid, rma_iov, recv_id),
            Packet::Rta {
                kind,
                msg_id,
                atomic_datatype,
                atomic_op,
                rma_iov,
                ..
            } => self.ema_rta(
                now,
                pid,
                kind,
                msg_id,
                atomic_op,
                atomic_datatype,
                rma_iov,
                payload,
            ),
            Packet::ReadRsp {
                recv_id, send_id, ..
            } => self.ema_readrsp(pid, recv_id, send_id, payload),
            Packet::AtomRsp { recv_id, .. } => self.ema_atomrsp(pid, recv_id, payload),
            Packet::PeerError {
                op_id,
                ref_kind: wire::peer_error_ref::OPE_INDEX,
                prov_errno,
                ..
            } => self.ema_peer_error(pid, op_id, prov_errno),
            // Exhaustive: a new packet type does not compile until it has its arm here.
            Packet::PeerError { .. } => self.drop_pkt_type(&pkt),
        }
        // Every packet from a peer makes sure our HANDSHAKE goes to it (once).
        if self.peers.contains_key(&pid) {
            self.queue_handshake(pid);
        }
    }

    /// The device completed the packet `wr_id` handed out by [`Engine::poll_transmit`].
    pub fn handle_send_completion(&mut self, now: Instant, wr_id: u64, status: Status) {
        self.send_completion_impl(now, wr_id, status)
    }

    /// Runs due timers (RNR backoff, stalled receives).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.closed {
            return;
        }
        if self.timers.expired(Timer::Backoff, now) {
            self.peers.expire_backoffs(now, &mut self.timers);
        }
        if self.timers.expired(Timer::RxStall, now) {
            self.check_stalls(now);
        }
        if self.timers.expired(Timer::ReadRetry, now) {
            self.read_timeout(now);
        }
        if self.timers.expired(Timer::EmaRetry, now) {
            self.ema_timeout(now);
        }
    }

    /// The next packet to post, if the device has room (`max_outstanding_tx`).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        self.poll_transmit_any(now)
    }

    /// True when [`Engine::poll_transmit`] may have something (packets queued, peers in
    /// backoff, RDMA work requests waiting); false means it certainly has nothing.
    pub fn transmit_pending(&self) -> bool {
        self.peers.has_ready() || self.peers.in_backoff() || self.rd.has_wrs()
    }

    /// Messages and bytes held without a receive now (what [`Engine::resources`] reports as
    /// `buffered_msgs` and `buffered_bytes`, without its walk over the peers).
    pub fn buffered(&self) -> (usize, usize) {
        self.budget.held()
    }

    /// The next change of which peers the device should hold back: `(peer, true)` when a peer
    /// holds more than its share of the buffering budget (half of
    /// [`EngineLimits::max_buffered_msgs`] or of [`EngineLimits::max_buffered_bytes`]) in
    /// messages no receive has taken, `(peer, false)` once it is under a quarter again (or gone).
    /// The caller asks the device to refuse the held peer's new messages with receiver-not-ready
    /// ([`QueuePair::hold_source`](crate::device::QueuePair::hold_source)), so one flooding peer
    /// cannot use up the budget that holds every peer back (issue 17, defect 2).
    pub fn poll_hold(&mut self) -> Option<(RawAddr, bool)> {
        self.budget.poll_change()
    }

    /// True when messages wait without a receive (unexpected or claimed).
    pub fn has_unexpected(&self) -> bool {
        self.budget.unexpected().0 > 0
    }

    /// True when [`Engine::poll_event`] has a completion.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// [`MAX_REMOTE_WRITE_EVENTS`] completions of peers' writes with immediate data wait for
    /// the application: the caller should hold the device back (stop reposting receive buffers).
    pub fn remote_writes_full(&self) -> bool {
        self.remote_write_events >= MAX_REMOTE_WRITE_EVENTS
    }

    /// The next completion.
    pub fn poll_event(&mut self) -> Option<Event> {
        let ev = self.events.pop_front();
        if matches!(ev, Some(Event::RemoteWrite(_))) {
            self.remote_write_events = self.remote_write_events.saturating_sub(1);
        }
        ev
    }

    /// When [`Engine::handle_timeout`] should run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.closed {
            return None;
        }
        self.timers.next()
    }

    /// Closes: every operation still in flight completes with `Canceled` (collect them with
    /// [`Engine::poll_event`]); later calls are refused with `Closed`.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.close_impl();
    }

    /// What the engine holds now.
    pub fn resources(&self) -> Resources {
        Resources {
            tx_ops: self.tx.ops.len() + self.rd_ops() + self.ema_ops(),
            rx_ops: self.rx.user_ops,
            unexpected_msgs: self.budget.unexpected().0,
            unexpected_bytes: self.budget.unexpected().1,
            reorder_held: self.peers.values().map(|p| p.robuf.held()).sum(),
            buffered_msgs: self.budget.held().0,
            buffered_bytes: self.budget.held().1,
            queued_pkts: self.tx.queued + self.rd_queued_wrs(),
            outstanding_pkts: self.wrs_outstanding(),
            peers: self.peers.len(),
            target_ops: self.ema_target_ops() + self.rd_targets(),
            remote_write_events: self.remote_write_events,
        }
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    // ---- shared helpers ----

    /// Counts and logs a dropped packet.
    /// Counts a packet the caller dropped before it reached [`Engine::handle_recv`] (the device
    /// could not say where it came from).
    pub fn count_dropped(&mut self, why: &'static str) {
        self.drop_pkt(why);
    }

    fn drop_pkt(&mut self, why: &'static str) {
        self.stats.dropped_pkts += 1;
        tracing::debug!(why, "dropped a packet");
    }

    fn drop_pkt_type(&mut self, pkt: &Packet<'_>) {
        self.stats.dropped_pkts += 1;
        tracing::debug!(ty = %pkt.packet_type(), "dropped a packet of a type this engine does not implement");
    }

    /// Encodes a packet's headers; `None` only if the codec refuses (a bug).
    fn encode(&self, pkt: &Packet<'_>) -> Option<Hdr> {
        match Hdr::encode(pkt) {
            Ok(h) => Some(h),
            Err(e) => {
                tracing::error!(error = %e, ty = %pkt.packet_type(), "could not encode a packet");
                None
            }
        }
    }

    fn closed_error(op: &'static str) -> Error {
        Error::new(ErrorKind::Closed, op)
    }

    fn close_impl(&mut self) {
        self.closed = true;
        self.rx.matcher.remove_unexpected_where(|_| true);
        // Receives first (pieces of multi-receive buffers before the buffers themselves).
        let ids = self.rx.ops.sorted_keys();
        for id in ids {
            self.abort_rx(id, ErrorKind::Canceled, "close");
        }
        for (_, p) in self.rx.matcher.drain_posted() {
            match p.item {
                PostedItem::One(op) => self.cancel_event(op),
                PostedItem::Multi(mid) => self.retire_multi(mid, Some(ErrorKind::Canceled)),
            }
        }
        let mids: Vec<u32> = self.rx.multi.keys().copied().collect();
        for mid in mids {
            self.retire_multi(mid, Some(ErrorKind::Canceled));
        }
        let tids = self.tx.ops.sorted_keys();
        for id in tids {
            self.fail_tx(
                id,
                Error::new(ErrorKind::Canceled, "send").with_detail("endpoint closed"),
                None,
            );
        }
        self.read_close();
        self.ema_fail(
            None,
            &Engine::closed_error("rma").with_detail("endpoint closed"),
            None,
        );
        self.rx.claimed.clear();
        self.tx.wrs.clear();
        for p in self.peers.values_mut() {
            p.ctrl_q.clear();
            p.data_q.clear();
            p.robuf = crate::proto::reorder::ReorderWindow::new(
                p.robuf.expected(),
                self.cfg.recvwin_size,
            );
            p.inbound.clear();
            p.blocked.clear();
            p.in_ready = false;
            p.backoff_until = None;
        }
        self.peers.clear_turns(&mut self.timers);
        self.tx.queued = 0;
        self.budget.reset();
        self.rx.user_ops = 0;
        self.timers.stop(Timer::RxStall);
        self.rx.in_progress = 0;
    }

    /// A matched receive left (completed or failed): when none is in progress, no stall timer.
    fn rx_left(&mut self, in_progress: bool) {
        if in_progress {
            self.rx.in_progress = self.rx.in_progress.saturating_sub(1);
            if self.rx.in_progress == 0 {
                self.timers.stop(Timer::RxStall);
            }
        }
    }
}
