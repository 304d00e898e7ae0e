//! Completion queues: every operation ends in exactly one [`Completion`] or one
//! [`CompletionError`], which hands back the operation's buffer.
//!
//! Progress is manual, as in libfabric: polling or waiting on a completion queue drives the
//! endpoints bound to it. Waiting blocks the thread ([`CompletionQueue::wait`]) or awaits a future
//! that needs no particular runtime ([`CompletionQueue::ready`]).

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;

use crate::av::PeerId;
use crate::device::Status;
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::mem::Short;
use crate::mr::MemoryRegion;
use crate::notify::Notifier;

mod sources;
pub(crate) use sources::Sources;

bit_set! {
    /// Completion flags (`FI_SEND`, `FI_RECV`, `FI_MSG`, `FI_REMOTE_CQ_DATA`, ...).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
    pub struct CompletionFlags(u32) {
        /// A send (`FI_SEND`).
        SEND = 1 => "FI_SEND";
        /// A receive (`FI_RECV`).
        RECV = 2 => "FI_RECV";
        /// A two-sided message (`FI_MSG`).
        MSG = 4 => "FI_MSG";
        /// A tagged message (`FI_TAGGED`).
        TAGGED = 8 => "FI_TAGGED";
        /// An RMA operation (`FI_RMA`).
        RMA = 16 => "FI_RMA";
        /// An RMA read (`FI_READ`).
        READ = 32 => "FI_READ";
        /// An RMA write (`FI_WRITE`).
        WRITE = 64 => "FI_WRITE";
        /// A peer read this side's memory (`FI_REMOTE_READ`).
        REMOTE_READ = 128 => "FI_REMOTE_READ";
        /// A peer wrote this side's memory (`FI_REMOTE_WRITE`).
        REMOTE_WRITE = 256 => "FI_REMOTE_WRITE";
        /// The completion carries the peer's immediate data (`FI_REMOTE_CQ_DATA`).
        REMOTE_CQ_DATA = 512 => "FI_REMOTE_CQ_DATA";
        /// A multi-receive buffer (`FI_MULTI_RECV`): set on the completion that releases it.
        MULTI_RECV = 1024 => "FI_MULTI_RECV";
        /// An atomic operation (`FI_ATOMIC`).
        ATOMIC = 2048 => "FI_ATOMIC";
    }
}

/// A buffer handed back by a completion: whatever the operation was given.
///
/// `Debug` shows the length and the first bytes, never a whole payload:
///
/// ```
/// let b = efa::Buffer::Send(bytes::Bytes::from(vec![7u8; 1 << 20]));
/// assert_eq!(format!("{b:?}"), "Send(1048576 bytes: 07 07 07 07 07 07 07 07 ..)");
/// ```
#[derive(Default)]
pub enum Buffer {
    /// The operation had no buffer.
    #[default]
    None,
    /// The `Bytes` a send was given.
    Send(Bytes),
    /// The `BytesMut` a receive was given; its `len()` is what arrived.
    Recv(BytesMut),
    /// The memory region (or slice of one) an operation was given.
    Region(MemoryRegion),
    /// The buffers of a scatter-gather operation (`send_iov`, `recv_iov`, `write_iov`,
    /// `read_iov`), in the order given, each filled as its part of the data.
    Iov(Vec<Buffer>),
}

impl Buffer {
    /// The received bytes of a receive's `BytesMut` (`None` for a region: read it through
    /// [`as_region`](Buffer::as_region)`.read()`, as its bytes sit behind the region's lock).
    pub fn as_recv(&self) -> Option<&[u8]> {
        match self {
            Buffer::Recv(b) => Some(b),
            _ => None,
        }
    }

    /// The memory region handed back, if the operation was given one.
    pub fn as_region(&self) -> Option<&MemoryRegion> {
        match self {
            Buffer::Region(r) => Some(r),
            _ => None,
        }
    }

    /// The sent bytes handed back.
    pub fn as_send(&self) -> Option<&Bytes> {
        match self {
            Buffer::Send(b) => Some(b),
            _ => None,
        }
    }

    /// Takes a receive buffer out.
    pub fn into_recv(self) -> Option<BytesMut> {
        match self {
            Buffer::Recv(b) => Some(b),
            _ => None,
        }
    }

    /// Takes a memory region out.
    pub fn into_region(self) -> Option<MemoryRegion> {
        match self {
            Buffer::Region(r) => Some(r),
            _ => None,
        }
    }

    /// The buffers of a scatter-gather operation.
    pub fn as_iov(&self) -> Option<&[Buffer]> {
        match self {
            Buffer::Iov(v) => Some(v),
            _ => None,
        }
    }

    /// Takes the buffers of a scatter-gather operation out.
    pub fn into_iov(self) -> Option<Vec<Buffer>> {
        match self {
            Buffer::Iov(v) => Some(v),
            _ => None,
        }
    }
}

/// What a send can be given: `Bytes` (zero-copy, reference counted), anything that converts into
/// `Bytes` (`Vec<u8>`, `&'static [u8]`, `String`), or a memory region with `SEND` access.
/// (`Debug` shows the length and the first bytes.)
pub enum SendBuf {
    /// Bytes.
    Bytes(Bytes),
    /// A registered region (all of it).
    Region(MemoryRegion),
}

impl From<Bytes> for SendBuf {
    fn from(b: Bytes) -> SendBuf {
        SendBuf::Bytes(b)
    }
}
impl From<Vec<u8>> for SendBuf {
    fn from(b: Vec<u8>) -> SendBuf {
        SendBuf::Bytes(b.into())
    }
}
impl From<&'static [u8]> for SendBuf {
    fn from(b: &'static [u8]) -> SendBuf {
        SendBuf::Bytes(Bytes::from_static(b))
    }
}
impl From<MemoryRegion> for SendBuf {
    fn from(r: MemoryRegion) -> SendBuf {
        SendBuf::Region(r)
    }
}

impl SendBuf {
    /// The buffer a refused send or write hands back, as given (`Bytes` or a region).
    pub(crate) fn from_returned(buf: Buffer) -> SendBuf {
        match buf {
            Buffer::Region(r) => SendBuf::Region(r),
            Buffer::Send(b) => SendBuf::Bytes(b),
            _ => SendBuf::Bytes(Bytes::new()),
        }
    }

    /// Its length in bytes (a region's: the slice's).
    pub(crate) fn len(&self) -> usize {
        match self {
            SendBuf::Bytes(b) => b.len(),
            SendBuf::Region(r) => r.len(),
        }
    }

    pub(crate) fn into_buffer(self) -> Buffer {
        match self {
            SendBuf::Bytes(b) => Buffer::Send(b),
            SendBuf::Region(r) => Buffer::Region(r),
        }
    }
}

/// What a receive can be given: a `BytesMut` (its `capacity()` is the room offered; its contents
/// are replaced) or a memory region with `RECV` access (its length is the room). (`Debug` shows
/// the length, the capacity and the first bytes.)
pub enum RecvBuf {
    /// A growable buffer.
    Bytes(BytesMut),
    /// A registered region.
    Region(MemoryRegion),
}

impl From<BytesMut> for RecvBuf {
    fn from(b: BytesMut) -> RecvBuf {
        RecvBuf::Bytes(b)
    }
}
impl From<MemoryRegion> for RecvBuf {
    fn from(r: MemoryRegion) -> RecvBuf {
        RecvBuf::Region(r)
    }
}

impl RecvBuf {
    /// The buffer a refused receive or read hands back, as given (`BytesMut` or a region).
    pub(crate) fn from_returned(buf: Buffer) -> RecvBuf {
        match buf {
            Buffer::Region(r) => RecvBuf::Region(r),
            Buffer::Recv(b) => RecvBuf::Bytes(b),
            _ => RecvBuf::Bytes(BytesMut::new()),
        }
    }

    pub(crate) fn into_buffer(self) -> Buffer {
        match self {
            RecvBuf::Bytes(b) => Buffer::Recv(b),
            RecvBuf::Region(r) => Buffer::Region(r),
        }
    }
}

/// A received `BytesMut`: its bytes and its capacity.
struct ShortMut<'a>(&'a BytesMut);

impl fmt::Debug for ShortMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}, capacity {}", Short(self.0), self.0.capacity())
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Buffer::None => f.write_str("None"),
            Buffer::Send(b) => f.debug_tuple("Send").field(&Short(b)).finish(),
            Buffer::Recv(b) => f.debug_tuple("Recv").field(&ShortMut(b)).finish(),
            Buffer::Region(r) => f.debug_tuple("Region").field(r).finish(),
            Buffer::Iov(v) => f.debug_tuple("Iov").field(v).finish(),
        }
    }
}

impl fmt::Debug for SendBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendBuf::Bytes(b) => f.debug_tuple("Bytes").field(&Short(b)).finish(),
            SendBuf::Region(r) => f.debug_tuple("Region").field(r).finish(),
        }
    }
}

impl fmt::Debug for RecvBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecvBuf::Bytes(b) => f.debug_tuple("Bytes").field(&ShortMut(b)).finish(),
            RecvBuf::Region(r) => f.debug_tuple("Region").field(r).finish(),
        }
    }
}

/// A refused post: the error and the buffer, handed back untouched so nothing is lost.
///
/// Converts into [`Error`] with `?`.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct PostError {
    /// Why the operation was refused.
    #[source]
    pub error: Error,
    /// The buffer the operation was given.
    pub buf: Buffer,
}

impl PostError {
    /// The kind of the error.
    pub fn kind(&self) -> ErrorKind {
        self.error.kind()
    }

    /// The buffer back.
    pub fn into_buffer(self) -> Buffer {
        self.buf
    }
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Error {
        e.error
    }
}

/// A successful completion.
#[derive(Debug)]
#[non_exhaustive]
pub struct Completion {
    /// The context the operation was posted with.
    pub context: u64,
    /// What completed.
    pub flags: CompletionFlags,
    /// Bytes transferred (for a receive: bytes placed in the buffer).
    pub len: usize,
    /// The peer's 4-byte immediate data, when `flags` has `REMOTE_CQ_DATA`.
    pub data: Option<u32>,
    /// The tag of a tagged message.
    pub tag: u64,
    /// The sender of a received message, when it is in the address vector (`FI_SOURCE`).
    pub source: Option<PeerId>,
    /// The sender's raw address when it is **not** in the address vector (`FI_SOURCE_ERR`, as a
    /// field instead of libfabric's error completion): insert it
    /// ([`AddressVector::insert`](crate::AddressVector::insert)) to answer, and its later
    /// messages carry the `PeerId`. RDM receives and remote writes with data; `None` otherwise.
    #[doc(alias = "FI_SOURCE_ERR")]
    pub source_addr: Option<crate::addr::RawAddr>,
    /// The operation's buffer, handed back.
    pub buf: Buffer,
}

/// An error completion (`fi_cq_err_entry`).
#[derive(Debug)]
#[non_exhaustive]
pub struct CompletionError {
    /// The context the operation was posted with.
    pub context: u64,
    /// What failed.
    pub flags: CompletionFlags,
    /// The error (kind, operation, detail).
    pub error: Error,
    /// Bytes transferred before the error (for truncation: bytes placed in the buffer).
    pub len: usize,
    /// For `Truncated`: how many bytes did not fit (`olen`).
    pub olen: usize,
    /// The device status behind the error, when there is one (`prov_errno`).
    pub status: Option<Status>,
    /// Immediate data that arrived with a failed receive.
    pub data: Option<u32>,
    /// The tag of a tagged operation.
    pub tag: u64,
    /// The operation's buffer, handed back.
    pub buf: Buffer,
}

/// Something bound to a completion queue that must be driven when the queue is polled.
pub(crate) trait ProgressSource: Send + Sync {
    /// Moves ready device completions into the bound completion queues.
    fn progress(&self);

    /// [`Self::progress`] for a poll of an empty queue: successful completions for that queue
    /// may go straight into the poller's vector ([`Direct::offer`]).
    fn progress_into(&self, _direct: &mut Direct<'_>) {
        self.progress();
    }
}

/// The vector of a thread polling an empty completion queue, handed down to the endpoints it
/// drives: a successful completion for that queue goes straight in, without the queue's lock
/// and copy, as long as the queue holds nothing older (the queue's order is kept; completions
/// of different endpoints have no order between them anyway).
pub(crate) struct Direct<'a> {
    cq: &'a CqInner,
    out: &'a mut Vec<Completion>,
    room: usize,
}

impl Direct<'_> {
    /// Takes `c` when it is for the polled queue, that queue is empty and the poller has room;
    /// otherwise hands it back.
    pub(crate) fn offer(&mut self, cq: &CompletionQueue, c: Completion) -> Option<Completion> {
        if self.room > 0
            && std::ptr::eq(self.cq, &*cq.inner)
            && self.cq.count.load(Ordering::Acquire) == 0
        {
            self.room -= 1;
            self.out.push(c);
            None
        } else {
            Some(c)
        }
    }
}

struct CqState {
    ok: VecDeque<Completion>,
    err: VecDeque<CompletionError>,
}

pub(crate) struct CqInner {
    domain: Domain,
    capacity: usize,
    state: Mutex<CqState>,
    /// Entries held (`ok` plus `err`), written under the `state` lock: an empty queue is polled
    /// and an endpoint checks for room without taking the lock.
    count: AtomicUsize,
    notifier: Arc<Notifier>,
    sources: Sources,
    /// Entries pushed while the queue was full (kept: see [`CompletionQueue::overruns`]).
    overruns: AtomicUsize,
    /// Keeps nothing ([`CompletionQueue::discard`]).
    discard: bool,
}

impl CqInner {
    /// Publishes the number of entries held; called with the `state` lock held (the only writer),
    /// so a plain store does.
    fn set_count(&self, s: &CqState) {
        self.count
            .store(s.ok.len() + s.err.len(), Ordering::Release);
    }
}

/// A completion queue. Cheap to clone; holds its domain.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

impl CompletionQueue {
    /// A completion queue holding up to `capacity` entries (successes plus errors). When it is
    /// full, endpoints leave further completions in the device until it is read.
    ///
    /// Errors: `InvalidArgument` for capacity 0.
    #[doc(alias = "fi_cq_open")]
    pub fn new(domain: &Domain, capacity: usize) -> Result<CompletionQueue> {
        if capacity == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "cq_open").with_detail("capacity 0"));
        }
        // The descriptor programs may wait on (`wait_fd`), made now: it is the queue's for life.
        let notifier = Arc::new(Notifier::new());
        if notifier.fd().is_none() {
            return Err(Error::io("cq_open", std::io::Error::last_os_error())
                .with_detail("no eventfd for the queue's wait descriptor"));
        }
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                domain: domain.clone(),
                capacity,
                state: Mutex::new(CqState {
                    ok: VecDeque::new(),
                    err: VecDeque::new(),
                }),
                count: AtomicUsize::new(0),
                notifier,
                sources: Sources::default(),
                overruns: AtomicUsize::new(0),
                discard: false,
            }),
        })
    }

    /// The queue of an endpoint bound to counters and not to a completion queue (for one
    /// direction or both): it keeps nothing, so completions there are only counted, and their
    /// buffers dropped. Never full, no descriptor.
    pub(crate) fn discard(domain: &Domain) -> CompletionQueue {
        CompletionQueue {
            inner: Arc::new(CqInner {
                domain: domain.clone(),
                capacity: usize::MAX,
                state: Mutex::new(CqState {
                    ok: VecDeque::new(),
                    err: VecDeque::new(),
                }),
                count: AtomicUsize::new(0),
                notifier: Arc::new(Notifier::new()),
                sources: Sources::default(),
                overruns: AtomicUsize::new(0),
                discard: true,
            }),
        }
    }

    /// A completion queue of the configured default capacity, `FI_EFA_CQ_SIZE`
    /// ([`Config::cq_size`](crate::Config::cq_size), 8192 unless set), as libfabric sizes a
    /// queue opened with `cq_attr.size` 0.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// let info = efa::getinfo(&efa::Hints::new().provider("loopback"))?.remove(0);
    /// let domain = efa::Domain::open(&info)?;
    /// let cq = efa::CompletionQueue::with_default_capacity(&domain)?;
    /// assert_eq!(cq.capacity(), domain.config().cq_size);
    /// # Ok(()) }
    /// ```
    pub fn with_default_capacity(domain: &Domain) -> Result<CompletionQueue> {
        CompletionQueue::new(domain, domain.config().cq_size)
    }

    /// The domain.
    pub fn domain(&self) -> &Domain {
        &self.inner.domain
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Entries waiting to be read (successes and errors).
    pub fn len(&self) -> usize {
        self.inner.count.load(Ordering::Acquire)
    }

    /// True when nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drives the bound endpoints, then moves up to `max` successful completions to `out`.
    ///
    /// Returns how many were moved. When none are ready but an error completion is waiting,
    /// returns `Err` of kind [`ErrorKind::ErrorAvailable`] whose detail describes that error
    /// completion (its context, flags and error), so `?` reports the cause; take it (and its
    /// buffer) with [`Self::read_err`].
    #[doc(alias = "fi_cq_read")]
    #[doc(alias = "fi_cq_readfrom")]
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let before = out.len();
        if max > 0 && self.inner.count.load(Ordering::Acquire) == 0 {
            let mut d = Direct {
                cq: &self.inner,
                out,
                room: max,
            };
            self.progress_with(Some(&mut d));
        } else {
            self.progress();
        }
        let direct = out.len() - before;
        if self.inner.count.load(Ordering::Acquire) == 0 || direct == max {
            return Ok(direct);
        }
        let mut s = self.inner.state.lock();
        let n = (max - direct).min(s.ok.len());
        out.extend(s.ok.drain(..n));
        self.inner.set_count(&s);
        if n + direct == 0 {
            if let Some(e) = s.err.front() {
                // The cause travels with the error, so `?` on a poll or wait says what failed;
                // the error completion itself stays queued for `read_err` (its buffer, say).
                return Err(
                    Error::new(ErrorKind::ErrorAvailable, "cq_read").with_detail(format!(
                        "context {}, {:?}: {} (take it with CompletionQueue::read_err)",
                        e.context, e.flags, e.error
                    )),
                );
            }
        }
        Ok(n + direct)
    }

    /// Takes the oldest error completion (`fi_cq_readerr`).
    #[doc(alias = "fi_cq_readerr")]
    pub fn read_err(&self) -> Option<CompletionError> {
        self.progress();
        let mut s = self.inner.state.lock();
        let e = s.err.pop_front();
        self.inner.set_count(&s);
        e
    }

    /// Like [`Self::poll`], but sleeps until at least one completion (or an error) is ready or
    /// `timeout` passes (`None`: forever). A timeout is `Err` of kind [`ErrorKind::TimedOut`].
    #[doc(alias = "fi_cq_sread")]
    #[doc(alias = "fi_cq_sreadfrom")]
    pub fn wait(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let seen = self.inner.notifier.generation();
            let n = self.poll(out, max)?;
            if n > 0 {
                return Ok(n);
            }
            if !self.inner.notifier.wait_until(seen, deadline) {
                let n = self.poll(out, max)?;
                if n > 0 {
                    return Ok(n);
                }
                return Err(Error::new(ErrorKind::TimedOut, "cq_wait"));
            }
        }
    }

    /// A future that resolves when a completion or an error completion is ready to read, without
    /// depending on any async runtime (the device's wake-ups drive the `Waker`).
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// let cq = efa::CompletionQueue::new(&domain, 16)?;
    /// // Inside any async runtime: `cq.ready().await; cq.poll(&mut out, 16)?;`
    /// let _fut = cq.ready();
    /// # Ok(()) }
    /// ```
    pub fn ready(&self) -> Ready<'_> {
        Ready { cq: self }
    }

    /// Whether the program may block on [`wait_fd`](Self::wait_fd) now (libfabric's
    /// `fi_trywait`): `Ok` when nothing is ready, after which the descriptor becomes readable at
    /// the next completion (the devices' threads take over the progress meanwhile); `Again`
    /// when completions (or errors) are ready or something just happened: poll instead of
    /// blocking. Call it right before every block on the descriptor.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// use std::os::fd::AsRawFd;
    /// let cq = efa::CompletionQueue::new(&domain, 16)?;
    /// let mut out = Vec::new();
    /// cq.poll(&mut out, 16)?;
    /// if cq.trywait().is_ok() {
    ///     // Nothing ready: block in poll(2) (epoll, mio, tokio's AsyncFd) until readable.
    ///     let mut p = libc::pollfd { fd: cq.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    ///     unsafe { libc::poll(&mut p, 1, 10) };
    /// }
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_trywait")]
    pub fn trywait(&self) -> Result<()> {
        let n = &self.inner.notifier;
        let seen = n.generation();
        if self.has_entries() || n.arm_fd(seen) {
            return Err(Error::new(ErrorKind::Again, "trywait")
                .with_detail("completions are ready (or something happened): poll them"));
        }
        Ok(())
    }

    /// The descriptor to block on (`FI_WAIT_FD`; also `AsFd` and `AsRawFd`): readable after a
    /// successful [`trywait`](Self::trywait) once a completion may be ready. Usable with epoll,
    /// mio and `tokio::io::unix::AsyncFd`; it is the queue's for its life. Only wait for it to be
    /// readable; do not read it (it is an epoll set, as libfabric's `FI_WAIT_FD` is: it holds
    /// the queue's eventfd and the wake pipes of its endpoints' same-host channels, which a
    /// same-host sender writes itself, so a message wakes the program with no thread in
    /// between); `trywait` empties it.
    #[doc(alias = "fi_control")]
    #[doc(alias = "FI_GETWAIT")]
    pub fn wait_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }

    /// Awaits and reads at least one completion (see [`Self::ready`]).
    pub async fn next_batch(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        loop {
            self.ready().await;
            let n = self.poll(out, max)?;
            if n > 0 {
                return Ok(n);
            }
        }
    }

    pub(crate) fn notifier(&self) -> &Arc<Notifier> {
        &self.inner.notifier
    }

    pub(crate) fn bind(&self, source: Weak<dyn ProgressSource>) {
        self.inner.sources.bind(source);
    }

    /// Room left before the queue is full.
    pub(crate) fn room(&self) -> usize {
        self.inner
            .capacity
            .saturating_sub(self.inner.count.load(Ordering::Acquire))
    }

    pub(crate) fn push(&self, c: Completion) {
        self.push_with(|s| s.ok.push_back(c));
    }

    pub(crate) fn push_err(&self, e: CompletionError) {
        self.push_with(|s| s.err.push_back(e));
    }

    /// Adds one entry with `add` under the lock (nothing on a queue that keeps nothing).
    #[inline]
    fn push_with(&self, add: impl FnOnce(&mut CqState)) {
        if self.inner.discard {
            return;
        }
        let mut s = self.inner.state.lock();
        self.check_room(&s);
        add(&mut s);
        self.inner.set_count(&s);
    }

    /// Counts (and reports once) a push into a full queue. Endpoints deliver only while the
    /// queue has room, so this happens only when several endpoints race for its last entries.
    fn check_room(&self, s: &CqState) {
        if s.ok.len() + s.err.len() >= self.inner.capacity
            && self.inner.overruns.fetch_add(1, Ordering::Relaxed) == 0
        {
            tracing::warn!(
                capacity = self.inner.capacity,
                "completion queue overrun: an entry was added to a full queue (kept; see \
                 CompletionQueue::overruns)"
            );
        }
    }

    /// Entries added while the queue was already full (libfabric's `FI_EOVERRUN` condition).
    /// Nothing is dropped: an endpoint stops moving completions into a full queue and leaves
    /// further work in the device (whose senders then see receiver-not-ready), so this stays 0
    /// unless several endpoints sharing the queue race for its last entries, which can exceed
    /// the capacity by at most one entry per endpoint.
    pub fn overruns(&self) -> usize {
        self.inner.overruns.load(Ordering::Relaxed)
    }

    /// Wakes waiters after pushing from outside a device notification.
    pub(crate) fn signal(&self) {
        self.inner.notifier.notify();
    }

    /// A queue that keeps nothing ([`CompletionQueue::discard`]).
    pub(crate) fn is_discard(&self) -> bool {
        self.inner.discard
    }

    /// True when both handles are the same queue.
    pub fn same(&self, other: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn progress(&self) {
        self.progress_with(None);
    }

    /// Drives the bound sources, handing `direct` down when a poll of this empty queue asked.
    fn progress_with(&self, mut direct: Option<&mut Direct<'_>>) {
        self.inner.sources.drive(|src| match &mut direct {
            Some(d) => src.progress_into(d),
            None => src.progress(),
        });
    }

    fn has_entries(&self) -> bool {
        self.progress();
        self.inner.count.load(Ordering::Acquire) != 0
    }
}

wait_fd_impls!(CompletionQueue);

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.inner.capacity)
            .field("len", &self.len())
            .finish()
    }
}

/// Future returned by [`CompletionQueue::ready`].
#[derive(Debug)]
pub struct Ready<'a> {
    cq: &'a CompletionQueue,
}

impl Future for Ready<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let seen = self.cq.inner.notifier.generation();
            if self.cq.has_entries() {
                return Poll::Ready(());
            }
            if !self.cq.inner.notifier.register(seen, cx.waker()) {
                return Poll::Pending;
            }
        }
    }
}

#[cfg(test)]
mod debug_tests {
    use super::*;

    /// A refused 8 MiB send returned with `?` and printed with `{:?}` stays one short line
    /// (issue 18: it printed 16 777 377 bytes).
    #[test]
    fn debug_of_buffers_is_short() {
        let big = Bytes::from(vec![0xabu8; 8 << 20]);
        let e = PostError {
            error: Error::new(ErrorKind::MsgSize, "send"),
            buf: Buffer::Send(big),
        };
        let s = format!("{e:?}");
        assert!(s.len() < 200, "{s}");
        assert!(s.contains("8388608 bytes: ab ab"), "{s}");
        let mut m = BytesMut::with_capacity(100);
        m.extend_from_slice(b"hi");
        let c = Completion {
            context: 1,
            flags: CompletionFlags::RECV,
            len: 2,
            data: None,
            tag: 0,
            source: None,
            source_addr: None,
            buf: Buffer::Recv(m),
        };
        let s = format!("{c:?}");
        assert!(s.contains("Recv(2 bytes: 68 69, capacity 100)"), "{s}");
        assert_eq!(
            format!("{:?}", SendBuf::Bytes(Bytes::new())),
            "Bytes(0 bytes)"
        );
    }
}
