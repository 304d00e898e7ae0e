//! `Endpoint<Rdm>`: reliable, ordered (send-after-send) messages and tagged messages of any size
//! on the protocol engine, over a device's SRD queue pair.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use slab::Slab;

use super::buf::RecvTarget;
use super::pin::ProgressCpu;
use super::{Endpoint, EndpointBuilder, Rdm};
use crate::addr::RawAddr;
use crate::av::PeerId;
use crate::cntr::Kind as CntrKind;
use crate::cq::{
    Buffer, Completion, CompletionError, CompletionFlags, CompletionQueue, Direct, PostError,
    ProgressSource, RecvBuf, SendBuf,
};
use crate::device::{
    DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, RdmaKind, RdmaWr, SendWr, Status,
};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::local::{LocalPath, LocalSend};
use crate::notify::Notifier;
pub(super) use crate::progress::Clock;
use crate::proto::engine::{
    Engine, EngineConfig, EngineSizes, Event, LocalMsg, Peeked, RecvDone, RecvOp, SendDone, SendOp,
    TargetCounts, TransmitKind,
};
use crate::stats::EndpointStats;

mod api;
mod builder;
mod driver;
mod events;
mod future;
mod opts;
mod post;
pub(super) use post::BatchRequest;

use driver::push_ok;
pub(crate) use events::local_completion;
pub use future::{OpFuture, OpOutcome};
pub use opts::EndpointOptions;
use opts::LiveOptions;
pub(crate) use opts::RequestedOptions;

/// Passes in a row that may leave the device alone because local messages came.
const MAX_DEVICE_SKIPS: u32 = 4;

/// Options of one send (`fi_sendmsg` flags): tag, remote CQ data, delivery completion.
///
/// `#[non_exhaustive]`, so that a flag can be added without breaking anyone: build it from
/// [`SendOptions::default`] (or [`SendOptions::tagged`]) with the `with_*` methods, or assign
/// its public fields (docs/api-conventions.md).
///
/// ```
/// use efa::SendOptions;
/// let o = SendOptions::tagged(7).with_data(42).with_delivery_complete(true);
/// assert_eq!((o.tag, o.data, o.delivery_complete), (Some(7), Some(42), true));
/// let mut p = SendOptions::default();
/// p.tag = o.tag; // fields can still be read and assigned
/// assert_eq!(p, SendOptions::tagged(7));
/// ```
///
/// A struct literal does not compile outside the crate, not even with `..Default::default()`:
///
/// ```compile_fail,E0639
/// let o = efa::SendOptions { tag: Some(7), ..Default::default() };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SendOptions {
    /// `Some(tag)`: a tagged send.
    pub tag: Option<u64>,
    /// 4 bytes of remote CQ data (`FI_REMOTE_CQ_DATA`).
    pub data: Option<u32>,
    /// Complete only once the data is in the receiver's buffer (`FI_DELIVERY_COMPLETE`).
    pub delivery_complete: bool,
}

/// Options of one receive (`fi_recvmsg` flags): tag and ignore bits, source, multi-receive.
///
/// `#[non_exhaustive]`: build it from [`RecvOptions::default`] (or [`RecvOptions::tagged`])
/// with the `with_*` methods, or assign its public fields (docs/api-conventions.md).
///
/// ```
/// use efa::RecvOptions;
/// let o = RecvOptions::tagged(0x100, 0xff).with_multi_recv(256);
/// assert_eq!((o.tag, o.from, o.multi_recv), (Some((0x100, 0xff)), None, Some(256)));
/// ```
///
/// ```compile_fail,E0639
/// let o = efa::RecvOptions { multi_recv: Some(256), ..Default::default() };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecvOptions {
    /// `Some((tag, ignore))`: a tagged receive.
    pub tag: Option<(u64, u64)>,
    /// Only from this peer (`FI_DIRECTED_RECV`).
    pub from: Option<PeerId>,
    /// `Some(min_free)`: a multi-receive buffer (`FI_MULTI_RECV`) retired when less than
    /// `min_free` bytes remain; every message that lands in it completes with its part.
    pub multi_recv: Option<usize>,
}

impl SendOptions {
    /// A tagged send (`fi_tsend`) with no other option.
    pub fn tagged(tag: u64) -> Self {
        SendOptions::default().with_tag(tag)
    }
}

with_setters! {
    SendOptions { with_delivery_complete => delivery_complete: bool }
    some { with_tag => tag: u64, with_data => data: u32 }
}

impl RecvOptions {
    /// A tagged receive (`fi_trecv`) matching `tag` in every bit not set in `ignore`.
    pub fn tagged(tag: u64, ignore: u64) -> Self {
        RecvOptions::default().with_tag(tag, ignore)
    }

    /// Sets [`tag`](Self::tag) to `Some((tag, ignore))`: a tagged receive.
    #[must_use]
    pub fn with_tag(mut self, tag: u64, ignore: u64) -> Self {
        self.tag = Some((tag, ignore));
        self
    }
}

with_setters! {
    RecvOptions {}
    some { with_from => from: PeerId, with_multi_recv => multi_recv: usize }
}

/// One send of a batch ([`Endpoint::send_batch`]).
#[derive(Debug)]
pub struct SendRequest {
    /// Destination.
    pub peer: PeerId,
    /// The data.
    pub buf: SendBuf,
    /// Tag, remote CQ data, delivery completion.
    pub options: SendOptions,
    /// Returned in the completion.
    pub context: u64,
}

/// A batch stopped by an error other than `Again`: how many sends before it were posted, and
/// the refused one's error with its buffer.
#[derive(Debug, thiserror::Error)]
#[error("batch stopped after {posted} operations: {error}")]
pub struct BatchError {
    /// Sends posted before the refusal (they complete as usual).
    pub posted: usize,
    /// The refusal, with the refused send's buffer.
    #[source]
    pub error: PostError,
}

/// A send whose destination and bytes are checked, ready for the engine.
struct PreparedSend {
    dest: RawAddr,
    data: Bytes,
    region: Option<crate::mr::MemoryRegion>,
    /// The parts of a gather (`send_iov`), handed back instead of `data`.
    iov: Option<Vec<Buffer>>,
    /// `(key, address)` of a region peers may read.
    read_key: Option<(u64, u64)>,
    /// The region's bytes were not copied into `data` (`SendOp::region_len`).
    region_len: Option<usize>,
    /// The region's bytes are to be copied into `data` if the send goes to the engine (the
    /// local path reads them from the region itself).
    copy_region: bool,
}

/// Where an operation's completion goes.
pub(super) enum Sink {
    /// The bound completion queue, with the user's context.
    Cq(u64),
    /// An awaiting future.
    Future(Arc<Slot>),
    /// An inject (`fi_inject`): no completion when it succeeds, an error completion with
    /// context 0 when it fails.
    Inject,
}

/// An operation the endpoint tracks: its sink and what to restore in its buffer.
pub(super) struct OpState {
    pub(super) sink: Sink,
    pub(super) target: Option<RecvTarget>,
    /// What the completion hands back instead of the engine's buffer: the region (slice) a
    /// send or write came from, or the parts of a gather (`Buffer::Iov`).
    pub(super) keep: Option<Buffer>,
    /// A multi-receive buffer: it completes once per message and stays until retired.
    pub(super) multi: bool,
    /// An RMA or atomic operation: its completion flags.
    pub(super) rma: Option<CompletionFlags>,
}

pub(super) struct State {
    pub(super) engine: Engine,
    qp: Box<dyn QueuePair>,
    pub(super) ops: Slab<OpState>,
    scratch: Vec<DeviceCompletion>,
    /// The sends of one pump pass, posted as one list (kept for its capacity).
    sends: VecDeque<SendWr>,
    /// The one-sided operations of one pump pass, posted as one list.
    rdma: VecDeque<RdmaWr>,
    /// Claimed unexpected messages (`FI_CLAIM`) by token.
    pending: HashSet<u64>,
    pub(super) closed: bool,
    /// Device receive buffers back from the device and not yet reposted.
    rx_free: Vec<(u64, BytesMut)>,
    /// Device receive buffers posted now.
    rx_posted: usize,
    /// Their size (the device MTU).
    rx_buf_size: usize,
    /// `FI_EFA_INTERNAL_RX_REFILL_THRESHOLD` (at most half the buffers): free buffers are
    /// reposted once this many are back, or at once when the device holds none.
    rx_refill_threshold: usize,
    /// `FI_EFA_EFA_CQ_READ_SIZE`: device completions taken per progress pass.
    cq_read_size: usize,
    /// The fast path to peers on this host (`local.rs`).
    local: Option<LocalPath>,
    /// The last source address looked up in the address vector (`FI_SOURCE`).
    src_cache: SrcCache,
    /// The last destination looked up.
    dest_cache: DestCache,
    /// Passes in a row that left the device alone (`MAX_DEVICE_SKIPS`).
    device_skips: u32,
    /// When the endpoint was created (a time for calls that do not use it).
    created: Instant,
}

/// The last destination looked up, valid while the address vector's generation is unchanged.
#[derive(Default)]
pub(super) struct DestCache(Option<(PeerId, u64, RawAddr)>);

/// One address-vector lookup, valid while the vector's generation is unchanged.
#[derive(Default)]
pub(super) struct SrcCache(Option<(RawAddr, Option<PeerId>, u64)>);

/// Shared state of an RDM endpoint.
pub struct RdmCore {
    pub(super) domain: Domain,
    /// The completion queues, address vector and counters (by what they count) it is bound to.
    pub(super) parts: super::Parts,
    addr: RawAddr,
    /// Region sends of at least this many bytes (that peers may read) are not copied: the
    /// engine reads the bytes it must send from the region (`SendOp::region_len`). The
    /// read-message threshold when the device reads, else never.
    region_send_min: usize,
    /// Device RDMA reads and writes go straight to and from device-registered regions
    /// (`QueuePair::region_rdma`, device RDMA on).
    pub(super) region_rdma: bool,
    /// Writes from slices of regions the device registered go to the device as slices
    /// (`QueuePair::region_rdma_write`, device RDMA on): the device reads the region as it
    /// sends, with no copy at posting.
    pub(super) region_write: bool,
    /// Largest inject (`tx_attr.inject_size`).
    inject_size: usize,
    notifier: Arc<Notifier>,
    pub(super) state: Mutex<State>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<crate::progress::Background>>,
    /// Messages received for `recv_async` futures dropped before they finished: they go back
    /// into matching, for the next receive (see [`OpFuture`]'s `Drop`).
    orphans: Orphans,
    /// The endpoint options in effect (`opts.rs`).
    pub(super) options: LiveOptions,
}

/// [`RdmCore::orphans`]: a list every progress pass looks at, so its emptiness is a plain load
/// (no lock taken, no atomic read-modify-write on the busy-poll path).
#[derive(Default)]
pub(super) struct Orphans {
    list: Mutex<Vec<RecvDone>>,
    /// `list` is not empty (written under its lock).
    any: AtomicBool,
}

impl Orphans {
    pub(super) fn push(&self, r: RecvDone) {
        let mut l = self.list.lock();
        l.push(r);
        self.any.store(true, Ordering::Release);
    }

    pub(super) fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    pub(super) fn take(&self) -> Vec<RecvDone> {
        let mut l = self.list.lock();
        self.any.store(false, Ordering::Release);
        std::mem::take(&mut *l)
    }
}

impl fmt::Debug for RdmCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmCore").field("addr", &self.addr).finish()
    }
}

/// How one operation ended, as a future receives it.
type OpResult = std::result::Result<Completion, CompletionError>;

/// A completion delivered to a future.
#[derive(Default)]
pub(super) struct Slot {
    done: Mutex<(Option<OpResult>, Option<Waker>)>,
    /// The future of this receive was dropped after its message matched: the message is not
    /// the future's any more but the next receive's.
    orphaned: AtomicBool,
    /// Where the message of a receive came from (to put it back if the future is dropped).
    src: Mutex<Option<RawAddr>>,
}

pub(super) fn refuse(error: Error, buf: Buffer) -> PostError {
    PostError { error, buf }
}
