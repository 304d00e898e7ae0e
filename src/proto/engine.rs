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

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::addr::RawAddr;
use crate::device::{Source, Status};
use crate::error::{Error, Result};
use crate::stats::EndpointStats;

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
}

/// A packet to post on the device: two segments to `dest`.
#[derive(Debug, Clone)]
pub struct Transmit {
    /// Give it back in [`Engine::handle_send_completion`].
    pub wr_id: u64,
    /// Destination queue pair.
    pub dest: RawAddr,
    /// Protocol header.
    pub hdr: Bytes,
    /// Application data (may be empty).
    pub payload: Bytes,
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
}

/// What the engine reports.
#[derive(Debug)]
pub enum Event {
    /// A send finished.
    Send(SendDone),
    /// A receive finished.
    Recv(RecvDone),
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
    /// Packets queued for transmission (not yet handed out).
    pub queued_pkts: usize,
    /// Packets handed out and not yet completed by the device.
    pub outstanding_pkts: usize,
    /// Known peers.
    pub peers: usize,
}

/// The RDM protocol engine of one endpoint.
#[derive(Debug)]
pub struct Engine {
    _todo: (),
}

impl Engine {
    /// An engine for the endpoint whose queue pair has raw address `local`.
    pub fn new(_cfg: EngineConfig, _local: RawAddr, _now: Instant) -> Engine {
        todo!()
    }

    /// The endpoint's own address.
    pub fn local_addr(&self) -> RawAddr {
        todo!()
    }

    /// Starts a send. `Again` (with the operation handed back) when `max_tx_ops` are in flight
    /// or the peer is in RNR backoff; `MsgSize` never (any size is allowed).
    pub fn send(&mut self, _now: Instant, _op: SendOp) -> Result<(), (Error, SendOp)> {
        todo!()
    }

    /// Posts a receive: matched at once against unexpected messages, else queued. `Again` (with
    /// the operation handed back) when `max_rx_ops` are posted.
    pub fn post_recv(&mut self, _now: Instant, _op: RecvOp) -> Result<(), (Error, RecvOp)> {
        todo!()
    }

    /// Cancels the oldest posted receive with `context` that has not started matching; it
    /// completes with `Canceled`. Returns false when there is none.
    pub fn cancel_recv(&mut self, _context: u64) -> bool {
        todo!()
    }

    /// Looks for an unexpected tagged message (`FI_PEEK`); with `claim` it is reserved for
    /// [`Engine::recv_claimed`] (`FI_CLAIM`). `NoMessage` when none matches.
    pub fn peek(
        &mut self,
        _tag: u64,
        _ignore: u64,
        _src: Option<RawAddr>,
        _claim: bool,
    ) -> Result<Peeked> {
        todo!()
    }

    /// Receives a claimed message into `op.buf`.
    pub fn recv_claimed(
        &mut self,
        _now: Instant,
        _claim: u64,
        _op: RecvOp,
    ) -> Result<(), (Error, RecvOp)> {
        todo!()
    }

    /// Discards an unexpected tagged message (`FI_DISCARD`); its sender's operation still
    /// completes normally. `NoMessage` when none matches.
    pub fn discard(&mut self, _tag: u64, _ignore: u64, _src: Option<RawAddr>) -> Result<Peeked> {
        todo!()
    }

    /// A datagram arrived from `src` (the device's receive completion); `data` is its bytes.
    /// Malformed, stale or duplicate packets are dropped and counted, never a panic.
    pub fn handle_recv(&mut self, _now: Instant, _src: Source, _data: &[u8]) {
        todo!()
    }

    /// The device completed the packet `wr_id` handed out by [`Engine::poll_transmit`].
    pub fn handle_send_completion(&mut self, _now: Instant, _wr_id: u64, _status: Status) {
        todo!()
    }

    /// Runs due timers (RNR backoff, stalled receives).
    pub fn handle_timeout(&mut self, _now: Instant) {
        todo!()
    }

    /// The next packet to post, if the device has room (`max_outstanding_tx`).
    pub fn poll_transmit(&mut self, _now: Instant) -> Option<Transmit> {
        todo!()
    }

    /// The next completion.
    pub fn poll_event(&mut self) -> Option<Event> {
        todo!()
    }

    /// When [`Engine::handle_timeout`] should run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        todo!()
    }

    /// Closes: every operation still in flight completes with `Canceled` (collect them with
    /// [`Engine::poll_event`]); later calls are refused with `Closed`.
    pub fn close(&mut self) {
        todo!()
    }

    /// What the engine holds now.
    pub fn resources(&self) -> Resources {
        todo!()
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        todo!()
    }
}
