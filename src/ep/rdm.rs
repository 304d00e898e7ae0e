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
use super::local::LocalPath;
use super::pin::ProgressCpu;
use super::{Endpoint, EndpointBuilder, Rdm};
use crate::addr::RawAddr;
use crate::av::{AddressVector, PeerId};
use crate::cq::{
    Buffer, Completion, CompletionError, CompletionFlags, CompletionQueue, Direct, PostError,
    ProgressSource, RecvBuf, SendBuf,
};
use crate::device::{DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, SendWr, Status};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;
use crate::proto::engine::{
    Engine, EngineConfig, Event, LocalMsg, Peeked, RecvDone, RecvOp, SendDone, SendOp, TransmitKind,
};
use crate::stats::EndpointStats;

/// Passes in a row that may leave the device alone because local messages came.
const MAX_DEVICE_SKIPS: u32 = 4;

/// The time of one progress pass, read from the system clock only if something needs it (an
/// idle busy poll then reads no clock at all).
#[derive(Default)]
pub(super) struct Clock(Option<Instant>);

impl Clock {
    /// A clock already read.
    pub(super) fn at(now: Instant) -> Clock {
        Clock(Some(now))
    }

    /// The time if it was read already.
    pub(super) fn cached(&self) -> Option<Instant> {
        self.0
    }

    /// The pass's time (read once, at the first call).
    pub(super) fn now(&mut self) -> Instant {
        *self.0.get_or_insert_with(Instant::now)
    }
}

/// Options of one send (`fi_sendmsg` flags): tag, remote CQ data, delivery completion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendOptions {
    /// `Some(tag)`: a tagged send.
    pub tag: Option<u64>,
    /// 4 bytes of remote CQ data (`FI_REMOTE_CQ_DATA`).
    pub data: Option<u32>,
    /// Complete only once the data is in the receiver's buffer (`FI_DELIVERY_COMPLETE`).
    pub delivery_complete: bool,
}

/// Options of one receive (`fi_recvmsg` flags): tag and ignore bits, source, multi-receive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvOptions {
    /// `Some((tag, ignore))`: a tagged receive.
    pub tag: Option<(u64, u64)>,
    /// Only from this peer (`FI_DIRECTED_RECV`).
    pub from: Option<PeerId>,
    /// `Some(min_free)`: a multi-receive buffer (`FI_MULTI_RECV`) retired when less than
    /// `min_free` bytes remain; every message that lands in it completes with its part.
    pub multi_recv: Option<usize>,
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
#[error("batch stopped after {posted} sends: {error}")]
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
    /// `(key, address)` of a region peers may read.
    read_key: Option<(u64, u64)>,
    /// The region's bytes were not copied into `data` (`SendOp::region_len`).
    region_len: Option<usize>,
    /// The region's bytes are to be copied into `data` if the send goes to the engine (the
    /// local path reads them from the region itself).
    copy_region: bool,
}

impl EndpointBuilder<Rdm> {
    /// Starts a progress thread that drives the endpoint while the application does not poll
    /// (real automatic progress). Off by default: progress is manual, driven by polling or
    /// waiting on the completion queues.
    pub fn progress_thread(mut self, on: bool) -> Self {
        self.progress_thread = on;
        self
    }

    /// Where the progress thread runs: unpinned (default), on one CPU, or near the device's NUMA
    /// node. Implies [`progress_thread(true)`](Self::progress_thread) unless `Unpinned`. A CPU
    /// the process may not run on makes [`build`](Self::build) fail with `InvalidArgument`.
    pub fn progress_cpu(mut self, cpu: ProgressCpu) -> Self {
        self.progress_cpu = cpu;
        if cpu != ProgressCpu::Unpinned {
            self.progress_thread = true;
        }
        self
    }

    /// Whether messages to peers on this host bypass the protocol engine through shared-memory
    /// channels (default on; it takes effect on devices with a shm directory: `shm`, and `udp`
    /// or `efa` routed over shm). Off, such peers are reached through the device as any other.
    /// Matching, ordering and completions are the same either way; see `docs/rdm.md`, "Local
    /// fast path".
    pub fn local_path(mut self, on: bool) -> Self {
        self.local_path = on;
        self
    }

    /// Creates the endpoint, its SRD queue pair and its protocol engine.
    pub fn build(self) -> Result<Endpoint<Rdm>> {
        let (tx_cq, rx_cq, av) = self.parts()?;
        let attr = self.domain.attr().clone();
        if attr.gid.to_ip().is_unspecified() {
            // Peers check the raw address an RDM endpoint puts in its packets against where the
            // packets came from; `0.0.0.0` or `::` matches nothing.
            return Err(Error::new(ErrorKind::InvalidArgument, "ep_open").with_detail(format!(
                "device {} has the unspecified GID {}: bind it to a routable address for RDM endpoints",
                attr.name, attr.gid
            )));
        }
        let cfg = self.domain.config().clone();
        let tx_ops = self.queue_size(
            self.tx_size,
            cfg.tx_size,
            attr.max_send_wr,
            attr.max_send_wr,
            "tx_size",
        )?;
        let rx_ops = self.queue_size(
            self.rx_size,
            cfg.rx_size,
            attr.max_recv_wr,
            attr.max_recv_wr,
            "rx_size",
        )?;
        // The queue pair's depths (its bounce buffers, pinned on efa): the configured sizes when
        // set, else the device kind's default; the engine's operation tables are not bounded
        // by them.
        let (def_send, def_recv) = super::default_qp_depths(&attr);
        let send_depth = self.queue_size(
            self.tx_size,
            cfg.tx_size,
            attr.max_send_wr,
            def_send,
            "tx_size",
        )?;
        let recv_depth = self.queue_size(
            self.rx_size,
            cfg.rx_size,
            attr.max_recv_wr,
            def_recv,
            "rx_size",
        )?;
        let own = Arc::new(Notifier::new());
        let use_rdma = cfg.device_rdma(attr.caps.rdma_read)?;
        let notifier = Self::qp_notifier(&tx_cq, &rx_cq, Some(&own));
        let qp = self.domain.device().create_qp(QpAttr {
            qp_type: QpType::Srd,
            send_depth,
            recv_depth,
            rnr_retry: 3,
            qkey: None,
            notifier: notifier.clone(),
            // FI_EFA_USE_UNSOLICITED_WRITE_RECV: ask for it only when allowed.
            unsolicited_write_recv: Some(cfg.use_unsolicited_write_recv),
        })?;
        let addr = qp.addr();
        let local = match self.domain.device().local_dir() {
            Some(dir) if self.local_path => LocalPath::open(dir, &addr, tx_ops, &notifier),
            _ => None,
        };
        let now = Instant::now();
        let mut engine = Engine::new(
            EngineConfig {
                mtu: attr.mtu,
                // FI_EFA_TX_QUEUE_SIZE caps the sends outstanding on the device.
                max_outstanding_tx: match cfg.tx_queue_size {
                    0 => send_depth,
                    n => n.min(send_depth),
                },
                max_tx_ops: tx_ops,
                max_rx_ops: rx_ops,
                recvwin_size: cfg.recvwin_size,
                tx_min_credits: cfg.tx_min_credits as usize,
                max_medium_msg_size: cfg.inter_max_medium_message_size,
                timeout_interval: cfg.timeout_interval,
                max_timeout: cfg.max_timeout,
                rx_stall_timeout: Duration::from_secs(30),
                seed: u64::from(addr.qkey) ^ u64::from(addr.qpn) << 32,
                device_rdma_read: use_rdma && attr.caps.rdma_read,
                device_rdma_write: use_rdma && attr.caps.rdma_write,
                max_rdma_size: attr.max_rdma_size,
                inter_min_read_write_size: cfg.inter_min_read_write_size,
                inter_min_read_message_size: cfg.inter_min_read_message_size,
                runt_size: cfg.runt_size,
                inter_read_segment_size: cfg.inter_read_segment_size,
            },
            addr,
            now,
        );
        // Peers' emulated RMA and atomics reach this domain's regions.
        engine.set_memory(Arc::new(self.domain.clone()));
        // The HANDSHAKE advertises what the queue pair does, not what the device could.
        engine.set_unsolicited_write_recv(qp.unsolicited_write_recv());
        let rx_bufs = recv_depth;
        let core = Arc::new(RdmCore {
            domain: self.domain.clone(),
            av,
            tx_cq: tx_cq.clone(),
            rx_cq: rx_cq.clone(),
            addr,
            region_send_min: if use_rdma && attr.caps.rdma_read {
                cfg.inter_min_read_message_size.max(1)
            } else {
                usize::MAX
            },
            inject_size: crate::info::rdm_inject_size(&attr, &cfg),
            notifier: own,
            state: Mutex::new(State {
                engine,
                qp,
                ops: Slab::new(),
                scratch: Vec::new(),
                sends: VecDeque::new(),
                pending: Default::default(),
                closed: false,
                rx_free: Vec::new(),
                rx_posted: 0,
                rx_buf_size: attr.mtu,
                rx_refill_threshold: cfg
                    .internal_rx_refill_threshold
                    .clamp(1, (recv_depth / 2).max(1)),
                cq_read_size: cfg.efa_cq_read_size.max(1),
                local,
                src_cache: SrcCache::default(),
                dest_cache: DestCache::default(),
                device_skips: 0,
                created: now,
            }),
            stop: Arc::new(AtomicBool::new(false)),
            thread: Mutex::new(None),
            orphans: Mutex::new(Vec::new()),
        });
        {
            let mut st = core.state.lock();
            st.rx_free = (0..rx_bufs)
                .map(|i| (i as u64, BytesMut::with_capacity(attr.mtu)))
                .collect();
            st.rx_buf_size = attr.mtu;
            RdmCore::repost_rx(&mut st);
            if st.rx_posted == 0 {
                return Err(Error::new(ErrorKind::NoMemory, "ep_open")
                    .with_detail("no receive buffer could be posted"));
            }
        }
        let weak: Weak<dyn ProgressSource> = Arc::downgrade(&core) as _;
        if let Some(l) = core.state.lock().local.as_ref() {
            l.set_source(weak.clone());
        }
        tx_cq.bind(weak.clone());
        if !rx_cq.same(&tx_cq) {
            rx_cq.bind(weak);
        }
        if self.progress_thread {
            let w = Arc::downgrade(&core);
            let stop = core.stop.clone();
            let notifier = core.notifier.clone();
            let cpu = super::pin::resolve(self.progress_cpu, attr.numa_node);
            let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
            let handle = std::thread::Builder::new()
                .name(format!("efa-progress-{}", addr.qpn))
                .spawn(move || {
                    let pinned = cpu.map_or(Ok(()), super::pin::pin_current);
                    let ok = pinned.is_ok();
                    let _ = pinned_tx.send(pinned);
                    if ok {
                        progress_thread(w, stop, notifier)
                    }
                })
                .map_err(|e| Error::io("ep_open", e))?;
            let pinned = pinned_rx.recv().unwrap_or(Ok(()));
            if let Err(e) = pinned {
                let _ = handle.join();
                return Err(e);
            }
            if let Some(c) = cpu {
                tracing::debug!(cpu = c, "progress thread pinned");
            }
            *core.thread.lock() = Some(handle);
        }
        tracing::debug!(%addr, tx_ops, rx_ops, "rdm_ep_open");
        Ok(Endpoint::from_core(core))
    }
}

fn progress_thread(core: Weak<RdmCore>, stop: Arc<AtomicBool>, notifier: Arc<Notifier>) {
    while !stop.load(Ordering::Acquire) {
        let seen = notifier.generation();
        let next = match core.upgrade() {
            Some(c) => c.progress_once(),
            None => return,
        };
        let deadline = Instant::now()
            + next
                .unwrap_or(Duration::from_millis(10))
                .min(Duration::from_millis(10));
        notifier.wait_until(seen, Some(deadline));
    }
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
    pub(super) region: Option<crate::mr::MemoryRegion>,
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
    pub(super) av: AddressVector,
    tx_cq: CompletionQueue,
    rx_cq: CompletionQueue,
    addr: RawAddr,
    /// Region sends of at least this many bytes (that peers may read) are not copied: the
    /// engine reads the bytes it must send from the region (`SendOp::region_len`). The
    /// read-message threshold when the device reads, else never.
    region_send_min: usize,
    /// Largest inject (`tx_attr.inject_size`).
    inject_size: usize,
    notifier: Arc<Notifier>,
    pub(super) state: Mutex<State>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Messages received for `recv_async` futures dropped before they finished: they go back
    /// into matching, for the next receive (see [`OpFuture`]'s `Drop`).
    orphans: Mutex<Vec<RecvDone>>,
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

impl Endpoint<Rdm> {
    /// This endpoint's raw address.
    pub fn addr(&self) -> RawAddr {
        self.core.addr
    }

    /// The domain.
    pub fn domain(&self) -> &Domain {
        &self.core.domain
    }

    /// Sends a message of any size to `peer`; the buffer is handed back in the completion.
    pub fn send(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_send(peer, buf.into(), SendOptions::default(), Sink::Cq(context))
    }

    /// Sends a message with 4 bytes of remote CQ data (`fi_senddata`).
    pub fn send_data(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        data: u32,
        context: u64,
    ) -> Result<(), PostError> {
        let o = SendOptions {
            data: Some(data),
            ..Default::default()
        };
        self.core.post_send(peer, buf.into(), o, Sink::Cq(context))
    }

    /// Sends a tagged message (`fi_tsend`).
    pub fn tsend(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        tag: u64,
        context: u64,
    ) -> Result<(), PostError> {
        let o = SendOptions {
            tag: Some(tag),
            ..Default::default()
        };
        self.core.post_send(peer, buf.into(), o, Sink::Cq(context))
    }

    /// Sends with explicit options (`fi_sendmsg` / `fi_tsendmsg`).
    pub fn send_with(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        options: SendOptions,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_send(peer, buf.into(), options, Sink::Cq(context))
    }

    /// Sends a small message and forgets it (`fi_inject`): the bytes are copied before this
    /// returns, and a send that succeeds writes no completion. A send that fails later writes an
    /// error completion with context 0 to the transmit queue.
    ///
    /// `data` may be at most `tx_attr.inject_size` bytes ([`Self::inject_size`]); longer is
    /// `InvalidArgument`. `Again` when `tx_size` sends are in flight.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, CompletionQueue, AddressVector};
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 64)?;
    /// # let av = AddressVector::new(&domain);
    /// # let ep = Endpoint::<efa::Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// let me = av.insert(ep.addr())?;
    /// ep.recv(bytes::BytesMut::with_capacity(64), 1).map_err(efa::Error::from)?;
    /// ep.inject(me, b"hello")?; // the slice is free again at once
    /// let mut out = Vec::new();
    /// while out.is_empty() {
    ///     cq.poll(&mut out, 8)?;
    /// }
    /// assert_eq!(out[0].buf.as_recv(), Some(&b"hello"[..]));
    /// # Ok(()) }
    /// ```
    pub fn inject(&self, peer: PeerId, data: &[u8]) -> Result<()> {
        self.core.post_inject(peer, data, SendOptions::default())
    }

    /// A tagged [`inject`](Self::inject) (`fi_tinject`).
    pub fn tinject(&self, peer: PeerId, data: &[u8], tag: u64) -> Result<()> {
        let o = SendOptions {
            tag: Some(tag),
            ..Default::default()
        };
        self.core.post_inject(peer, data, o)
    }

    /// An [`inject`](Self::inject) with 4 bytes of remote CQ data (`fi_injectdata`).
    pub fn inject_data(&self, peer: PeerId, data: &[u8], imm: u32) -> Result<()> {
        let o = SendOptions {
            data: Some(imm),
            ..Default::default()
        };
        self.core.post_inject(peer, data, o)
    }

    /// An [`inject`](Self::inject) with a tag and/or remote CQ data (`fi_tinjectdata`).
    /// `delivery_complete` is `InvalidArgument`: an inject reports no completion to wait for.
    pub fn inject_with(&self, peer: PeerId, data: &[u8], options: SendOptions) -> Result<()> {
        self.core.post_inject(peer, data, options)
    }

    /// The largest message [`inject`](Self::inject) takes (`tx_attr.inject_size`).
    pub fn inject_size(&self) -> usize {
        self.core.inject_size
    }

    /// Posts the sends at the front of `reqs` together, like a chain of `fi_sendmsg` calls with
    /// `FI_MORE` ending in one without: the endpoint is locked once, the engine takes them all,
    /// and one progress pass hands their packets to the device back to back (the device can
    /// then push them out with one system call or doorbell). Posted requests are removed from
    /// the front of `reqs`; when the endpoint is full (`Again`) the rest stay there, to be posted
    /// again after completions. Returns how many were posted; another refusal stops the batch
    /// with a [`BatchError`] that hands that send's buffer back.
    ///
    /// ```
    /// # use std::collections::VecDeque;
    /// # use bytes::{Bytes, BytesMut};
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, SendRequest, SendOptions};
    /// # fn main() -> efa::Result<()> {
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 256)?;
    /// # let av = AddressVector::new(&domain);
    /// # let a = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// # let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// let peer = av.insert(b.addr())?;
    /// for i in 0..16 {
    ///     b.recv(BytesMut::with_capacity(64), 100 + i)?;
    /// }
    /// let mut reqs: VecDeque<SendRequest> = (0..16)
    ///     .map(|i| SendRequest {
    ///         peer,
    ///         buf: Bytes::from(vec![i as u8; 64]).into(),
    ///         options: SendOptions::default(),
    ///         context: i,
    ///     })
    ///     .collect();
    /// let mut posted = 0;
    /// while !reqs.is_empty() {
    ///     posted += a.send_batch(&mut reqs).map_err(|e| e.error.error)?;
    ///     a.progress();
    /// }
    /// assert_eq!(posted, 16);
    /// let mut done = Vec::new();
    /// while done.len() < 32 {
    ///     cq.wait(&mut done, 32, Some(std::time::Duration::from_secs(5)))?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn send_batch(&self, reqs: &mut VecDeque<SendRequest>) -> Result<usize, BatchError> {
        self.core.post_send_batch(reqs)
    }

    /// Posts a receive for an untagged message from any peer.
    ///
    /// ```compile_fail
    /// # fn f(ep: &efa::Endpoint<efa::Rdm>) {
    /// let buf = bytes::BytesMut::with_capacity(1024);
    /// ep.recv(buf, 7).unwrap();
    /// buf.len(); // error[E0382]: borrow of moved value: `buf`
    /// # }
    /// ```
    pub fn recv(&self, buf: impl Into<RecvBuf>, context: u64) -> Result<(), PostError> {
        self.core
            .post_recv(buf.into(), RecvOptions::default(), Sink::Cq(context))
    }

    /// Posts a tagged receive: matches messages whose tag equals `tag` on every bit not set in
    /// `ignore` (`fi_trecv`).
    pub fn trecv(
        &self,
        buf: impl Into<RecvBuf>,
        tag: u64,
        ignore: u64,
        context: u64,
    ) -> Result<(), PostError> {
        let o = RecvOptions {
            tag: Some((tag, ignore)),
            ..Default::default()
        };
        self.core.post_recv(buf.into(), o, Sink::Cq(context))
    }

    /// Posts a receive with explicit options (`fi_recvmsg` / `fi_trecvmsg`).
    pub fn recv_with(
        &self,
        buf: impl Into<RecvBuf>,
        options: RecvOptions,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_recv(buf.into(), options, Sink::Cq(context))
    }

    /// Cancels the oldest posted receive with `context` (`fi_cancel`): it completes with a
    /// `Canceled` error completion that hands its buffer back. `NoMessage` if none is pending.
    pub fn cancel(&self, context: u64) -> Result<()> {
        self.core.cancel(context)
    }

    /// Looks for an unexpected tagged message (`FI_PEEK`); with `claim`, reserves it for
    /// [`Endpoint::recv_claimed`] (`FI_CLAIM`). `NoMessage` when none matches.
    pub fn peek(&self, tag: u64, ignore: u64, from: Option<PeerId>, claim: bool) -> Result<Peeked> {
        let src = self.core.resolve_src(from)?;
        let mut st = self.core.state.lock();
        let p = st.engine.peek(tag, ignore, src, claim)?;
        if let Some(t) = p.claim {
            st.pending.insert(t);
        }
        Ok(p)
    }

    /// Receives a message claimed by [`Endpoint::peek`].
    pub fn recv_claimed(
        &self,
        claim: u64,
        buf: impl Into<RecvBuf>,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_claimed(claim, buf.into(), context)
    }

    /// Discards an unexpected tagged message (`FI_DISCARD`). `NoMessage` when none matches.
    pub fn discard(&self, tag: u64, ignore: u64, from: Option<PeerId>) -> Result<Peeked> {
        let src = self.core.resolve_src(from)?;
        self.core.state.lock().engine.discard(tag, ignore, src)
    }

    /// Sends and awaits the completion. Cancel-safe: dropping the future leaves the operation
    /// running; its buffer stays owned by the endpoint until the device is done with it.
    pub fn send_async(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        options: SendOptions,
    ) -> OpFuture {
        let slot = Arc::new(Slot::default());
        let posted = self
            .core
            .post_send(peer, buf.into(), options, Sink::Future(slot.clone()));
        OpFuture {
            core: self.core.clone(),
            slot,
            early: posted.err(),
            recv: false,
            finished: false,
        }
    }

    /// Posts a receive and awaits the completion. Cancel-safe: dropping the future before it
    /// resolved (`tokio::time::timeout`, `select!`) cancels the receive, and the buffer is
    /// released once the endpoint no longer needs it; if a message had already matched it, that
    /// message is not lost but goes back into matching for the next receive (it lands behind
    /// messages from the same sender that are already waiting unexpected).
    pub fn recv_async(&self, buf: impl Into<RecvBuf>, options: RecvOptions) -> OpFuture {
        let slot = Arc::new(Slot::default());
        let posted = self
            .core
            .post_recv(buf.into(), options, Sink::Future(slot.clone()));
        OpFuture {
            core: self.core.clone(),
            slot,
            early: posted.err(),
            recv: true,
            finished: false,
        }
    }

    /// Drives the endpoint once (polling a bound completion queue does this too).
    pub fn progress(&self) {
        self.core.progress_once();
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        self.core.state.lock().engine.stats()
    }

    /// What the protocol engine holds now (for leak checks).
    pub fn resources(&self) -> crate::proto::engine::Resources {
        self.core.state.lock().engine.resources()
    }
}

/// The future of an async operation: resolves to its completion or error completion.
pub struct OpFuture {
    core: Arc<RdmCore>,
    slot: Arc<Slot>,
    early: Option<PostError>,
    /// A receive (`recv_async`): dropping it unfinished cancels it.
    recv: bool,
    /// It resolved.
    finished: bool,
}

impl OpFuture {
    pub(super) fn new(core: Arc<RdmCore>, slot: Arc<Slot>, early: Option<PostError>) -> OpFuture {
        OpFuture {
            core,
            slot,
            early,
            recv: false,
            finished: false,
        }
    }
}

impl Drop for OpFuture {
    /// A receive dropped before it resolved: cancel it if no message matched it yet; else its
    /// message goes back into matching for the next receive (now if it is complete, when it
    /// completes otherwise). Sends, RMA and atomics keep running (their buffers stay with the
    /// endpoint until the device is done).
    fn drop(&mut self) {
        if !self.recv || self.finished || self.early.is_some() {
            return;
        }
        let now = Instant::now();
        let mut st = self.core.state.lock();
        let key = st
            .ops
            .iter()
            .find(|(_, o)| matches!(&o.sink, Sink::Future(s) if Arc::ptr_eq(s, &self.slot)))
            .map(|(k, _)| k);
        match key {
            Some(k) => {
                if !st.engine.cancel_recv(k as u64) {
                    // Matched and in progress: its completion is re-matched when it comes.
                    self.slot.orphaned.store(true, Ordering::Release);
                }
            }
            None => {
                // Completed, not yet taken: put the message back now.
                let done = self.slot.done.lock().0.take();
                let src = self.slot.src.lock().take();
                if let (Some(Ok(c)), Some(src)) = (done, src) {
                    if let Buffer::Recv(buf) = c.buf {
                        self.core.orphans.lock().push(RecvDone {
                            context: 0,
                            len: c.len,
                            olen: 0,
                            tag: c.flags.contains(CompletionFlags::TAGGED).then_some(c.tag),
                            data: c.data,
                            src: Some(src),
                            multi_recv_done: false,
                            error: None,
                            buf,
                        });
                    }
                }
            }
        }
        self.core.pump(&mut st, now);
    }
}

impl fmt::Debug for OpFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpFuture").finish()
    }
}

/// How an async operation ended.
#[derive(Debug)]
pub enum OpOutcome {
    /// It completed.
    Done(Completion),
    /// It completed with an error.
    Failed(CompletionError),
    /// It was refused when posted.
    Refused(PostError),
}

impl OpOutcome {
    /// The completion, or the error as [`Error`].
    pub fn into_result(self) -> Result<Completion> {
        match self {
            OpOutcome::Done(c) => Ok(c),
            OpOutcome::Failed(e) => Err(e.error),
            OpOutcome::Refused(e) => Err(e.error),
        }
    }
}

impl Future for OpFuture {
    type Output = OpOutcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<OpOutcome> {
        if let Some(e) = self.early.take() {
            self.finished = true;
            return Poll::Ready(OpOutcome::Refused(e));
        }
        loop {
            let done = self.slot.done.lock().0.take();
            if let Some(r) = done {
                self.finished = true;
                return Poll::Ready(match r {
                    Ok(c) => OpOutcome::Done(c),
                    Err(e) => OpOutcome::Failed(e),
                });
            }
            let seen = self.core.notifier.generation();
            self.core.progress_once();
            {
                let mut d = self.slot.done.lock();
                if d.0.is_some() {
                    continue;
                }
                d.1 = Some(cx.waker().clone());
            }
            if !self.core.notifier.register(seen, cx.waker()) {
                return Poll::Pending;
            }
        }
    }
}

pub(super) fn refuse(error: Error, buf: Buffer) -> PostError {
    PostError { error, buf }
}

impl RdmCore {
    fn resolve_src(&self, from: Option<PeerId>) -> Result<Option<RawAddr>> {
        from.map(|p| self.av.lookup(p)).transpose()
    }

    fn post_send(
        &self,
        peer: PeerId,
        buf: SendBuf,
        o: SendOptions,
        sink: Sink,
    ) -> Result<(), PostError> {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        let prepared = self.prepare_send(&mut st.dest_cache, peer, buf)?;
        self.enqueue_send(&mut st, &mut clock, prepared, o, sink)?;
        // A send on the local path is in the peer's ring (or queued for it) already; only the
        // engine's sends need a pass to reach the device.
        if st.engine.transmit_pending() || st.engine.has_events() {
            self.pump_with(&mut st, &mut clock);
        }
        Ok(())
    }

    /// An inject: straight into a local peer's ring when it has room, else a copy of the bytes
    /// sent like any message, whose completion only reports a failure.
    fn post_inject(&self, peer: PeerId, data: &[u8], o: SendOptions) -> Result<()> {
        if o.delivery_complete {
            return Err(Error::new(ErrorKind::InvalidArgument, "inject")
                .with_detail("an inject has no completion to deliver: use send_with"));
        }
        super::buf::check_inject(data.len(), self.inject_size)?;
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "inject"));
        }
        let dest = self.dest(&mut st.dest_cache, peer)?;
        let st = &mut *st;
        if let Some(l) = st.local.as_mut() {
            if let Some(p) = l.route(&mut st.engine, &dest) {
                if l.inject(&mut st.engine, p, &o, data) {
                    return Ok(());
                }
            }
        }
        let prepared = PreparedSend {
            dest,
            data: Bytes::copy_from_slice(data),
            region: None,
            read_key: None,
            region_len: None,
            copy_region: false,
        };
        self.enqueue_send(st, &mut clock, prepared, o, Sink::Inject)
            .map_err(|e| e.error)?;
        if st.engine.transmit_pending() || st.engine.has_events() {
            self.pump_with(st, &mut clock);
        }
        Ok(())
    }

    /// A peer's address, through the one-entry cache of the last destination.
    fn dest(&self, cache: &mut DestCache, peer: PeerId) -> Result<RawAddr> {
        let generation = self.av.generation();
        match cache.0 {
            Some((p, g, a)) if p == peer && g == generation => Ok(a),
            _ => {
                let a = self.av.lookup(peer)?;
                cache.0 = Some((peer, generation, a));
                Ok(a)
            }
        }
    }

    /// The checks of a send: destination and bytes.
    fn prepare_send(
        &self,
        cache: &mut DestCache,
        peer: PeerId,
        buf: SendBuf,
    ) -> Result<PreparedSend, PostError> {
        let dest = match self.dest(cache, peer) {
            Ok(a) => a,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        // A region peers may read lets the engine use the read-based message protocols; at
        // the read-message threshold its bytes are not copied (the engine reads what it sends).
        let (data, read_key, region_len) = match &buf {
            SendBuf::Region(r) => {
                let read_key = r.device_read_key();
                if read_key.is_some() && r.len() >= self.region_send_min {
                    let data = r
                        .check_local(&self.domain, crate::mem::Access::SEND, "send")
                        .map(|()| Bytes::new());
                    (data, read_key, Some(r.len()))
                } else {
                    let data = r
                        .check_local(&self.domain, crate::mem::Access::SEND, "send")
                        .map(|()| Bytes::new());
                    (data, read_key, None)
                }
            }
            SendBuf::Bytes(_) => (Ok(Bytes::new()), None, None),
        };
        let copy_region = matches!(buf, SendBuf::Region(_)) && region_len.is_none();
        let data = match data {
            Ok(d) => d,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        let (data, region) = match buf {
            SendBuf::Region(r) => (data, Some(r)),
            SendBuf::Bytes(b) => (b, None),
        };
        Ok(PreparedSend {
            dest,
            data,
            region,
            read_key,
            region_len,
            copy_region,
        })
    }

    /// Hands a prepared send to the engine (the caller pumps).
    fn enqueue_send(
        &self,
        st: &mut State,
        clock: &mut Clock,
        p: PreparedSend,
        o: SendOptions,
        sink: Sink,
    ) -> Result<(), PostError> {
        let PreparedSend {
            dest,
            mut data,
            region,
            read_key,
            region_len,
            copy_region,
        } = p;
        if st.closed {
            let b = region.map_or(Buffer::Send(data), Buffer::Region);
            return Err(refuse(Error::new(ErrorKind::Closed, "send"), b));
        }
        // A peer on this host goes through the local path (which reads a region's bytes from
        // the region itself); anyone else through the engine.
        let local = match st.local.as_mut() {
            Some(l) => l
                .route(&mut st.engine, &dest)
                .map(|peer| (peer, l.has_room())),
            None => None,
        };
        if let Some((_, false)) = local {
            let b = region.map_or(Buffer::Send(data), Buffer::Region);
            let e =
                Error::new(ErrorKind::Again, "send").with_detail("tx_size local sends in flight");
            return Err(refuse(e, b));
        }
        if local.is_none() && copy_region {
            if let Some(r) = &region {
                data = Bytes::copy_from_slice(&r.read());
            }
        }
        let len = match &region {
            Some(r) if copy_region || region_len.is_some() => r.len(),
            _ => data.len(),
        };
        let key = st.ops.insert(OpState {
            sink,
            target: None,
            region,
            multi: false,
            rma: None,
        });
        if let (Some((peer, _)), Some(l)) = (local, st.local.as_mut()) {
            l.send(&mut st.engine, &st.ops, key, peer, &o, data, len);
            return Ok(());
        }
        let op = SendOp {
            dest,
            buf: data,
            tag: o.tag,
            data: o.data,
            delivery_complete: o.delivery_complete,
            context: key as u64,
            read_key,
            region_len,
        };
        match st.engine.send(clock.now(), op) {
            Ok(()) => Ok(()),
            Err((e, op)) => {
                let s = st.ops.remove(key);
                Err(refuse(
                    e,
                    s.region.map_or(Buffer::Send(op.buf), Buffer::Region),
                ))
            }
        }
    }

    /// Posts the sends at the front of `reqs` under one lock and one progress pass.
    pub(super) fn post_send_batch(
        &self,
        reqs: &mut VecDeque<SendRequest>,
    ) -> Result<usize, BatchError> {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        let mut posted = 0;
        let mut failure = None;
        while let Some(r) = reqs.pop_front() {
            let prepared = match self.prepare_send(&mut st.dest_cache, r.peer, r.buf) {
                Ok(p) => p,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            match self.enqueue_send(
                &mut st,
                &mut clock,
                prepared,
                r.options,
                Sink::Cq(r.context),
            ) {
                Ok(()) => posted += 1,
                Err(e) if e.kind() == ErrorKind::Again => {
                    // Full: leave it (and the rest) for the caller to post later.
                    reqs.push_front(SendRequest {
                        peer: r.peer,
                        buf: match e.buf {
                            Buffer::Region(m) => SendBuf::Region(m),
                            Buffer::Send(b) => SendBuf::Bytes(b),
                            _ => SendBuf::Bytes(Bytes::new()),
                        },
                        options: r.options,
                        context: r.context,
                    });
                    break;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if posted > 0 {
            self.pump_with(&mut st, &mut clock);
        }
        match failure {
            None => Ok(posted),
            Some(error) => Err(BatchError { posted, error }),
        }
    }

    fn post_recv(&self, buf: RecvBuf, o: RecvOptions, sink: Sink) -> Result<(), PostError> {
        let src = match self.resolve_src(o.from) {
            Ok(s) => s,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        if o.multi_recv.is_some() {
            return self.post_multi_recv(buf, o, sink, src);
        }
        self.post_recv_checked(buf, o, sink, src)
    }

    /// The checks of a multi-receive buffer, then [`Self::post_recv_checked`].
    #[inline(never)]
    fn post_multi_recv(
        &self,
        buf: RecvBuf,
        o: RecvOptions,
        sink: Sink,
        src: Option<RawAddr>,
    ) -> Result<(), PostError> {
        let why = if o.tag.is_some() {
            Some("multi-receive buffers take untagged messages only (FI_MULTI_RECV)")
        } else if matches!(buf, RecvBuf::Region(_)) {
            Some("a multi-receive buffer must be a BytesMut, not a memory region")
        } else if matches!(sink, Sink::Future(_)) {
            Some(
                "a multi-receive buffer completes many times: post it with recv_with, not recv_async",
            )
        } else {
            None
        };
        if let Some(why) = why {
            return Err(refuse(
                Error::new(ErrorKind::InvalidArgument, "recv").with_detail(why),
                buf.into_buffer(),
            ));
        }
        self.post_recv_checked(buf, o, sink, src)
    }

    /// Posts a receive whose options passed their checks.
    fn post_recv_checked(
        &self,
        buf: RecvBuf,
        o: RecvOptions,
        sink: Sink,
        src: Option<RawAddr>,
    ) -> Result<(), PostError> {
        let (down, target) = RecvTarget::prepare(buf, &self.domain, 0, "recv")?;
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        if st.closed {
            return Err(refuse(
                Error::new(ErrorKind::Closed, "recv"),
                target.finish(down, false),
            ));
        }
        let key = st.ops.insert(OpState {
            sink,
            target: Some(target),
            region: None,
            multi: o.multi_recv.is_some(),
            rma: None,
        });
        let op = RecvOp {
            buf: down,
            tag: o.tag,
            src,
            multi_recv: o.multi_recv,
            context: key as u64,
        };
        // The engine needs the time only to match an unexpected message; otherwise no clock.
        let now = if st.engine.has_unexpected() {
            clock.now()
        } else {
            clock.cached().unwrap_or(st.created)
        };
        match st.engine.post_recv(now, op) {
            Ok(()) => {
                // Only a receive that matched an unexpected message has something to move.
                if st.engine.transmit_pending() || st.engine.has_events() {
                    self.pump_with(&mut st, &mut clock);
                }
                Ok(())
            }
            Err((e, op)) => {
                let s = st.ops.remove(key);
                // The refused buffer goes back whole: the engine hands back what went down.
                let b = match s.target {
                    Some(t) => t.finish(op.buf, false),
                    None => Buffer::Recv(op.buf),
                };
                Err(refuse(e, b))
            }
        }
    }

    fn post_claimed(&self, claim: u64, buf: RecvBuf, context: u64) -> Result<(), PostError> {
        let (down, target) = RecvTarget::prepare(buf, &self.domain, 0, "recv_claimed")?;
        let now = Instant::now();
        let mut st = self.state.lock();
        if !st.pending.remove(&claim) {
            let e =
                Error::new(ErrorKind::InvalidArgument, "recv_claimed").with_detail("unknown claim");
            return Err(refuse(e, target.finish(down, false)));
        }
        let key = st.ops.insert(OpState {
            sink: Sink::Cq(context),
            target: Some(target),
            region: None,
            multi: false,
            rma: None,
        });
        let op = RecvOp {
            buf: down,
            tag: None,
            src: None,
            multi_recv: None,
            context: key as u64,
        };
        match st.engine.recv_claimed(now, claim, op) {
            Ok(()) => {
                self.pump(&mut st, now);
                Ok(())
            }
            Err((e, op)) => {
                let s = st.ops.remove(key);
                // The refused buffer goes back whole: the engine hands back what went down.
                let b = match s.target {
                    Some(t) => t.finish(op.buf, false),
                    None => Buffer::Recv(op.buf),
                };
                Err(refuse(e, b))
            }
        }
    }

    /// Puts the messages of dropped `recv_async` futures back into matching, as whole local
    /// messages from their sender: a posted receive takes each, or it waits unexpected.
    fn rematch_orphans(&self, st: &mut State, clock: &mut Clock) {
        let orphans = std::mem::take(&mut *self.orphans.lock());
        for r in orphans {
            let Some(src) = r.src else { continue };
            let n = r.len.min(r.buf.len());
            let m = LocalMsg {
                tag: r.tag,
                data: r.data,
                dc_token: None,
                msg_len: n,
            };
            let mut at = 0;
            let mut copy = |out: &mut BytesMut, k: usize| {
                let end = (at + k).min(r.buf.len());
                out.extend_from_slice(r.buf.get(at..end).unwrap_or_default());
                at = end;
            };
            let _ = st
                .engine
                .local_first(&mut || clock.now(), src, &m, n, &mut copy);
        }
    }

    fn cancel(&self, context: u64) -> Result<()> {
        let now = Instant::now();
        let mut st = self.state.lock();
        let key = st
            .ops
            .iter()
            .find(|(_, o)| matches!(o.sink, Sink::Cq(c) if c == context) && o.target.is_some())
            .map(|(k, _)| k);
        let found = key.is_some_and(|k| st.engine.cancel_recv(k as u64));
        if !found {
            return Err(Error::new(ErrorKind::NoMessage, "cancel")
                .with_detail(format!("no pending receive {context}")));
        }
        self.pump(&mut st, now);
        Ok(())
    }

    /// One progress pass; returns the time until the engine's next timer.
    fn progress_once(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut st = self.state.lock();
        self.pump(&mut st, now);
        let local = st.local.as_ref().and_then(LocalPath::next_timer);
        let next = match (st.engine.poll_timeout(), local) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        next.map(|t| t.saturating_duration_since(now))
    }

    /// Moves everything that is ready: device completions into the engine, the engine's packets
    /// onto the device, the engine's completions into queues and futures.
    pub(super) fn pump(&self, st: &mut State, now: Instant) {
        self.pump_with(st, &mut Clock::at(now))
    }

    /// A progress pass for a caller that polls: no clock read unless something needs it.
    fn progress_quick(&self) {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        self.pump_with(&mut st, &mut clock);
    }

    /// [`Self::pump`] with a clock read only when needed.
    pub(super) fn pump_with(&self, st: &mut State, clock: &mut Clock) {
        self.pump_into(st, clock, None);
    }

    /// [`Self::pump_with`] for a poll of an empty completion queue: successful completions for
    /// it go straight to the poller (`direct`).
    fn pump_into(&self, st: &mut State, clock: &mut Clock, mut direct: Option<&mut Direct<'_>>) {
        loop {
            let mut busy = false;
            if !self.orphans.lock().is_empty() {
                busy = true;
                self.rematch_orphans(st, clock);
            }
            if let Some(l) = st.local.as_mut() {
                busy |= l.progress(&mut st.engine, &st.ops, clock);
            }
            // A pass that took local messages delivers them first and leaves the device to the
            // next pass (at most a few passes in a row).
            let n = if busy && st.device_skips < MAX_DEVICE_SKIPS {
                st.device_skips += 1;
                0
            } else {
                st.device_skips = 0;
                self.poll_device(st, clock)
            };
            busy |= n > 0;
            Self::repost_rx(st);
            if let Some(t) = st.engine.poll_timeout() {
                let now = clock.now();
                if t <= now {
                    st.engine.handle_timeout(now);
                }
            }
            if !st.engine.transmit_pending() && !st.engine.has_events() {
                let idle = st.local.as_ref().is_none_or(|l| l.events.is_empty());
                if idle && !busy {
                    break;
                }
            }
            if st.engine.transmit_pending() {
                busy |= Self::transmit(st, clock);
            }
            let mut delivered = false;
            while st.engine.has_events() && self.tx_cq.room() > 0 && self.rx_cq.room() > 0 {
                let Some(ev) = st.engine.poll_event() else {
                    break;
                };
                busy = true;
                delivered |= self.deliver(&mut st.ops, &mut st.src_cache, ev, &mut direct);
            }
            if let Some(l) = st.local.as_mut() {
                while !l.events.is_empty() && self.tx_cq.room() > 0 {
                    let Some(ev) = l.events.pop_front() else {
                        break;
                    };
                    busy = true;
                    delivered |= self.deliver(&mut st.ops, &mut st.src_cache, ev, &mut direct);
                }
            }
            if delivered {
                self.tx_cq.signal();
                if !self.rx_cq.same(&self.tx_cq) {
                    self.rx_cq.signal();
                }
            }
            // One pass moves what is ready; another only when a batch limit left more behind
            // (what this pass set off, such as send completions, shows at the next poll).
            let more = n >= st.cq_read_size || st.local.as_ref().is_some_and(|l| l.more);
            if !busy || !more {
                break;
            }
        }
    }

    /// Hands the engine's output to the device: datagrams as one post list (one doorbell; one
    /// system call on the udp device), RDMA operations one by one. True when anything went.
    #[inline(never)]
    fn transmit(st: &mut State, clock: &mut Clock) -> bool {
        let mut busy = false;
        let now = clock.now();
        let mut sends = std::mem::take(&mut st.sends);
        while let Some(t) = st.engine.poll_transmit(now) {
            busy = true;
            let wr_id = t.wr_id;
            let posted = match t.kind {
                TransmitKind::Send => {
                    sends.push_back(SendWr {
                        wr_id,
                        dest: t.dest,
                        hdr: t.hdr,
                        payload: t.payload,
                        imm: None,
                    });
                    continue;
                }
                TransmitKind::RdmaWrite { remote, imm } => {
                    Self::post_sends(st, now, &mut sends);
                    st.qp.post_write(wr_id, t.dest, t.payload, remote, imm)
                }
                TransmitKind::RdmaRead { remote, buf } => {
                    Self::post_sends(st, now, &mut sends);
                    st.qp.post_read(wr_id, t.dest, buf, remote)
                }
            };
            if let Err(e) = posted {
                tracing::warn!(error = %e, "device refused a work request");
                st.engine
                    .handle_rdma_completion(now, wr_id, refused_status(&e), None);
            }
        }
        Self::post_sends(st, now, &mut sends);
        st.sends = sends;
        busy
    }

    /// Takes the device's completions into the engine; returns how many.
    fn poll_device(&self, st: &mut State, clock: &mut Clock) -> usize {
        let mut batch = std::mem::take(&mut st.scratch);
        let n = st.qp.poll(&mut batch, st.cq_read_size);
        if n > 0 {
            let now = clock.now();
            for c in batch.drain(..) {
                self.device_completion(st, now, c);
            }
        }
        st.scratch = batch;
        n
    }

    /// Posts `sends` as one list; a send the device refuses fails in the engine.
    fn post_sends(st: &mut State, now: Instant, sends: &mut VecDeque<SendWr>) {
        while !sends.is_empty() {
            if let Err((wr_id, e)) = st.qp.post_send_list(sends) {
                tracing::warn!(error = %e, "device refused a work request");
                st.engine
                    .handle_send_completion(now, wr_id, refused_status(&e));
            }
        }
    }

    fn device_completion(&self, st: &mut State, now: Instant, c: DeviceCompletion) {
        match c.opcode {
            Opcode::Recv => {
                let Some(mut buf) = c.buf else { return };
                if c.status.is_ok() {
                    match c.src {
                        Some(src) => {
                            st.engine
                                .handle_recv(now, src, &buf[..c.byte_len.min(buf.len())])
                        }
                        None => st.engine.count_dropped("a receive with no source"),
                    }
                } else if c.status == Status::Flushed {
                    return;
                } else {
                    tracing::debug!(status = %c.status, "receive error on the device; packet dropped");
                }
                buf.clear();
                st.rx_posted -= 1;
                st.rx_free.push((c.wr_id, buf));
            }
            Opcode::RdmaRead | Opcode::RdmaWrite => st
                .engine
                .handle_rdma_completion(now, c.wr_id, c.status, c.buf),
            Opcode::RecvRdmaWithImm => {
                if c.status.is_ok() {
                    if let (Some(src), Some(imm)) = (c.src, c.imm) {
                        st.engine.handle_remote_write(now, src, imm, c.byte_len);
                    }
                } else if c.status != Status::Flushed {
                    tracing::debug!(status = %c.status, "write-with-immediate error on the device");
                }
                // The write consumed a posted receive buffer (devices without unsolicited
                // write-recv): it comes back untouched.
                if let Some(mut buf) = c.buf {
                    if c.status == Status::Flushed {
                        return;
                    }
                    buf.clear();
                    st.rx_posted -= 1;
                    st.rx_free.push((c.wr_id, buf));
                }
            }
            Opcode::Send => st.engine.handle_send_completion(now, c.wr_id, c.status),
        }
    }

    /// Reposts free device receive buffers, as many as the engine could buffer if every one of
    /// them brought an unexpected message: beyond that the device refuses packets with
    /// receiver-not-ready, the senders back off, and nothing a peer sent is dropped for lack of
    /// memory (the engine's `EngineLimits` cap what it holds for messages without a receive).
    fn repost_rx(st: &mut State) {
        // Peers over their share of the buffering budget are held back at the device (where it
        // can: others go on), before the budget as a whole holds every sender back.
        while let Some((peer, hold)) = st.engine.poll_hold() {
            let src = crate::device::Source {
                gid: peer.gid,
                qpn: peer.qpn,
            };
            if !st.qp.hold_source(src, hold) {
                break;
            }
        }
        if st.rx_free.is_empty() || st.engine.remote_writes_full() {
            // (Too many completions of peers' writes with immediate data wait for the
            // application: a device that takes a receive buffer per such write is held back.)
            return;
        }
        let lim = st.engine.limits();
        let (msgs, bytes) = st.engine.buffered();
        let by_msgs = lim.max_buffered_msgs.saturating_sub(msgs);
        let by_bytes = lim.max_buffered_bytes.saturating_sub(bytes) / st.rx_buf_size.max(1);
        let allowed = by_msgs.min(by_bytes).saturating_sub(st.rx_posted);
        // Repost in bulk (FI_EFA_INTERNAL_RX_REFILL_THRESHOLD), unless the device has none.
        if st.rx_posted > 0 && st.rx_free.len().min(allowed) < st.rx_refill_threshold {
            return;
        }
        for _ in 0..allowed.min(st.rx_free.len()) {
            let Some((wr_id, buf)) = st.rx_free.pop() else {
                break;
            };
            match st.qp.post_recv(wr_id, buf) {
                Ok(()) => st.rx_posted += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "could not repost a receive buffer");
                    break;
                }
            }
        }
    }

    /// Routes one engine event; returns true when it went to a completion queue.
    fn deliver(
        &self,
        ops: &mut Slab<OpState>,
        cache: &mut SrcCache,
        ev: Event,
        direct: &mut Option<&mut Direct<'_>>,
    ) -> bool {
        // The usual cases first: a send, or a receive that is not a multi-receive buffer's,
        // completing into its queue.
        let key = match &ev {
            Event::Send(s) => s.context as usize,
            Event::Recv(r) if !r.multi_recv_done => r.context as usize,
            _ => return self.deliver_other(ops, cache, ev),
        };
        if !ops
            .get(key)
            .is_some_and(|o| matches!(o.sink, Sink::Cq(_)) && !o.multi)
        {
            return self.deliver_other(ops, cache, ev);
        }
        let Some(OpState {
            sink: Sink::Cq(ctx),
            target,
            region,
            ..
        }) = ops.try_remove(key)
        else {
            return false;
        };
        match ev {
            Event::Send(s) => match self.send_completion(s, ctx, region) {
                Ok(c) => push_ok(&self.tx_cq, c, direct),
                Err(e) => self.tx_cq.push_err(e),
            },
            Event::Recv(r) => match self.recv_completion(r, ctx, target, cache) {
                Ok(c) => push_ok(&self.rx_cq, c, direct),
                Err(e) => self.rx_cq.push_err(e),
            },
            _ => return false,
        }
        true
    }

    /// [`Self::deliver`] for the rest: multi-receive pieces, futures, RMA, remote writes.
    #[inline(never)]
    fn deliver_other(&self, ops: &mut Slab<OpState>, cache: &mut SrcCache, ev: Event) -> bool {
        let (key, is_send) = match &ev {
            Event::Send(s) => (s.context as usize, true),
            Event::Recv(r) => (r.context as usize, false),
            Event::Rma(r) => (r.context as usize, true),
            Event::RemoteWrite(w) => {
                let c = self.remote_write_completion(*w);
                self.rx_cq.push(c);
                return true;
            }
        };
        // A multi-receive buffer completes once per message (each with its own part of the
        // buffer) and is only retired by its final `multi_recv_done` completion.
        if let Event::Recv(r) = &ev {
            if !r.multi_recv_done && ops.get(key).is_some_and(|o| o.multi) {
                let Some(Sink::Cq(ctx)) = ops.get(key).map(|o| &o.sink) else {
                    return false;
                };
                let ctx = *ctx;
                let Event::Recv(r) = ev else { return false };
                match self.recv_completion(r, ctx, None, cache) {
                    Ok(c) => self.rx_cq.push(c),
                    Err(e) => self.rx_cq.push_err(e),
                }
                return true;
            }
        }
        let Some(op) = ops.try_remove(key) else {
            tracing::warn!(key, "engine completion for an unknown operation");
            return false;
        };
        // The usual cases, straight into the queue.
        if let (&Sink::Cq(ctx), true) = (&op.sink, matches!(ev, Event::Send(_) | Event::Recv(_))) {
            match ev {
                Event::Send(s) => match self.send_completion(s, ctx, op.region) {
                    Ok(c) => self.tx_cq.push(c),
                    Err(e) => self.tx_cq.push_err(e),
                },
                Event::Recv(r) => match self.recv_completion(r, ctx, op.target, cache) {
                    Ok(c) => self.rx_cq.push(c),
                    Err(e) => self.rx_cq.push_err(e),
                },
                _ => return false,
            }
            return true;
        }
        let user_ctx = match &op.sink {
            Sink::Cq(c) => *c,
            Sink::Future(_) | Sink::Inject => 0,
        };
        if let (Sink::Future(slot), Event::Recv(r)) = (&op.sink, &ev) {
            if r.error.is_none() && slot.orphaned.load(Ordering::Acquire) {
                // Its future is gone: the message is the next receive's.
                if let Event::Recv(r) = ev {
                    self.orphans.lock().push(r);
                }
                return false;
            }
            *slot.src.lock() = r.src;
        }
        let (sink, result) = match ev {
            Event::Send(s) => (op.sink, self.send_completion(s, user_ctx, op.region)),
            Event::Recv(r) => (op.sink, self.recv_completion(r, user_ctx, op.target, cache)),
            Event::Rma(r) => {
                let OpState {
                    sink,
                    target,
                    region,
                    multi,
                    rma,
                } = op;
                let rest = OpState {
                    sink: Sink::Cq(0),
                    target,
                    region,
                    multi,
                    rma,
                };
                (sink, self.rma_completion(r, user_ctx, rest))
            }
            Event::RemoteWrite(_) => return false,
        };
        match sink {
            Sink::Cq(_) => {
                let cq = if is_send { &self.tx_cq } else { &self.rx_cq };
                match result {
                    Ok(c) => cq.push(c),
                    Err(e) => cq.push_err(e),
                }
                true
            }
            Sink::Inject => match result {
                Ok(_) => false,
                Err(e) => {
                    self.tx_cq.push_err(e);
                    true
                }
            },
            Sink::Future(slot) => {
                let waker = {
                    let mut d = slot.done.lock();
                    d.0 = Some(result);
                    d.1.take()
                };
                if let Some(w) = waker {
                    w.wake();
                }
                false
            }
        }
    }

    fn send_completion(
        &self,
        s: SendDone,
        context: u64,
        region: Option<crate::mr::MemoryRegion>,
    ) -> std::result::Result<Completion, CompletionError> {
        let mut flags = CompletionFlags::SEND;
        flags |= if s.tag.is_some() {
            CompletionFlags::TAGGED
        } else {
            CompletionFlags::MSG
        };
        let buf = region.map_or(Buffer::Send(s.buf), Buffer::Region);
        match s.error {
            None => Ok(Completion {
                context,
                flags,
                len: s.len,
                data: None,
                tag: s.tag.unwrap_or(0),
                source: None,
                buf,
            }),
            Some(error) => Err(CompletionError {
                context,
                flags,
                error,
                len: 0,
                olen: 0,
                status: s.status,
                data: None,
                tag: s.tag.unwrap_or(0),
                buf,
            }),
        }
    }

    fn recv_completion(
        &self,
        r: RecvDone,
        context: u64,
        target: Option<RecvTarget>,
        cache: &mut SrcCache,
    ) -> std::result::Result<Completion, CompletionError> {
        let mut flags = CompletionFlags::RECV;
        flags |= if r.tag.is_some() {
            CompletionFlags::TAGGED
        } else {
            CompletionFlags::MSG
        };
        if r.data.is_some() {
            flags |= CompletionFlags::REMOTE_CQ_DATA;
        }
        if r.multi_recv_done {
            flags |= CompletionFlags::MULTI_RECV;
        }
        let source = r.src.and_then(|a| {
            let generation = self.av.generation();
            match cache.0 {
                Some((addr, peer, g)) if addr == a && g == generation => peer,
                _ => {
                    let peer = self
                        .av
                        .find(&a)
                        .or_else(|| self.av.reverse_lookup(a.gid, a.qpn));
                    cache.0 = Some((a, peer, generation));
                    peer
                }
            }
        });
        let filled = r.error.is_none()
            || r.error
                .as_ref()
                .is_some_and(|e| e.kind() == ErrorKind::Truncated);
        let buf = match target {
            Some(t) => t.finish(r.buf, filled),
            None => Buffer::Recv(r.buf),
        };
        match r.error {
            None => Ok(Completion {
                context,
                flags,
                len: r.len,
                data: r.data,
                tag: r.tag.unwrap_or(0),
                source,
                buf,
            }),
            Some(error) => Err(CompletionError {
                context,
                flags,
                error,
                len: r.len,
                olen: r.olen,
                status: None,
                data: r.data,
                tag: r.tag.unwrap_or(0),
                buf,
            }),
        }
    }
}

impl RdmCore {
    /// The application's handle goes: unless operations in flight (futures) keep the endpoint,
    /// its thread is to drop the last reference, so the endpoint closes there and then (its
    /// local channel file removed before the application goes on), not later on the local
    /// waiter's thread.
    pub(super) fn handle_dropped(core: &Arc<RdmCore>) {
        let gate = core.state.lock().local.as_ref().map(LocalPath::gate);
        if let Some(g) = gate {
            g.pause();
            if Arc::strong_count(core) > 1 {
                // Futures still hold the endpoint: the waiter goes on driving it for them.
                g.resume();
            }
        }
    }
}

impl ProgressSource for RdmCore {
    fn progress(&self) {
        self.progress_quick();
    }

    fn progress_into(&self, direct: &mut Direct<'_>) {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        self.pump_into(&mut st, &mut clock, Some(direct));
    }
}

/// A successful completion into `cq`, or straight to the thread polling it.
fn push_ok(cq: &CompletionQueue, c: Completion, direct: &mut Option<&mut Direct<'_>>) {
    let c = match direct {
        Some(d) => match d.offer(cq, c) {
            Some(c) => c,
            None => return,
        },
        None => c,
    };
    cq.push(c);
}

impl Drop for RdmCore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.notifier.notify();
        if let Some(h) = self.thread.get_mut().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let now = Instant::now();
        let st = self.state.get_mut();
        st.closed = true;
        st.engine.close();
        st.qp.close();
        let mut local_events = Vec::new();
        if let Some(l) = st.local.as_mut() {
            l.close(&mut st.engine);
            local_events.extend(l.events.drain(..));
        }
        let mut batch = Vec::new();
        while st.qp.poll(&mut batch, usize::MAX) > 0 {}
        for c in batch {
            if c.opcode != Opcode::Recv {
                st.engine.handle_send_completion(now, c.wr_id, c.status);
            }
        }
        let mut events = local_events;
        while let Some(ev) = st.engine.poll_event() {
            events.push(ev);
        }
        let mut ops = std::mem::take(&mut st.ops);
        let mut cache = SrcCache::default();
        for ev in events {
            self.deliver(&mut ops, &mut cache, ev, &mut None);
        }
        self.tx_cq.signal();
        self.rx_cq.signal();
        tracing::debug!(addr = %self.addr, "rdm_ep_close");
    }
}

/// The completion status of a work request the device refused to post.
fn refused_status(e: &Error) -> Status {
    if e.kind() == ErrorKind::Closed {
        Status::Flushed
    } else {
        Status::LocalQpInternalError
    }
}
