//! Completion counters (`fi_cntr`): a [`Counter`] counts the operations of the kinds it is bound
//! for ([`CounterEvents`]: sends, receives, reads, writes, and peers' reads and writes of this
//! side's memory) on the endpoints it is bound to, successes in [`Counter::read`] and errors in
//! [`Counter::read_err`], whether or not the operation writes a completion queue entry.
//!
//! A program that only needs to know *how many* operations finished (a one-sided writer's
//! target waiting for N writes, a sender pacing itself) waits on a counter instead of reading
//! completions: [`Counter::wait`] blocks until a threshold, [`Counter::wait_async`] is its
//! future, and [`Counter::wait_fd`] (with [`Counter::trywait`]) is a descriptor for epoll, mio
//! or tokio's `AsyncFd`. Reading or waiting drives the bound endpoints, as polling a completion
//! queue does. `docs/rma.md`, "Counters", tells what is counted where and how it differs from
//! libfabric.
//!
//! ```
//! # fn main() -> efa::Result<()> {
//! use efa::{AddressVector, CompletionQueue, Counter, CounterEvents, Domain, Endpoint, Rdm};
//! let info = efa::getinfo(&efa::Hints::new().provider("loopback"))?.remove(0);
//! let domain = Domain::open(&info)?;
//! let (cq, av) = (CompletionQueue::new(&domain, 64)?, AddressVector::new(&domain));
//! let sent = Counter::new(&domain)?;
//! let a = Endpoint::<Rdm>::builder(&domain)
//!     .cq(&cq)
//!     .av(&av)
//!     .counter(&sent, CounterEvents::SEND)
//!     .build()?;
//! let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
//! let pb = av.insert(b.addr())?;
//! for i in 0..3 {
//!     b.recv(bytes::BytesMut::with_capacity(16), i)?;
//!     a.send(pb, &b"ping"[..], 10 + i)?;
//! }
//! // Blocks (driving both endpoints) until three sends completed.
//! assert!(sent.wait(3, Some(std::time::Duration::from_secs(10)))? >= 3);
//! assert_eq!(sent.read_err(), 0);
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::cq::{ProgressSource, Sources};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;

bit_set! {
    /// The operations a counter counts on an endpoint (`fi_ep_bind` flags of a counter): any
    /// combination of the six kinds libfabric has.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct CounterEvents(u8) {
        /// Sends (`FI_SEND`): messages, tagged messages and injects this endpoint sent.
        SEND = 1 => "FI_SEND";
        /// Receives (`FI_RECV`): messages this endpoint received (each message of a multi-receive
        /// buffer).
        RECV = 2 => "FI_RECV";
        /// Reads (`FI_READ`): RMA reads and fetching atomics this endpoint initiated.
        READ = 4 => "FI_READ";
        /// Writes (`FI_WRITE`): RMA writes and non-fetching atomics this endpoint initiated.
        WRITE = 8 => "FI_WRITE";
        /// Peers' reads of this side's memory (`FI_REMOTE_READ`, RDM only).
        REMOTE_READ = 16 => "FI_REMOTE_READ";
        /// Peers' writes (and atomics) into this side's memory (`FI_REMOTE_WRITE`, RDM only).
        REMOTE_WRITE = 32 => "FI_REMOTE_WRITE";
    }
}

impl CounterEvents {
    /// All six.
    pub const fn all() -> CounterEvents {
        CounterEvents(63)
    }

    /// True when an event of `other` is set here too.
    pub const fn intersects(self, other: CounterEvents) -> bool {
        self.0 & other.0 != 0
    }
}

struct CntrInner {
    domain: Domain,
    value: AtomicU64,
    errors: AtomicU64,
    /// Signalled at every change of the counter and (forwarded from the bound endpoints' queue
    /// pairs) whenever their devices have completions: waiters drive progress again.
    notifier: Arc<Notifier>,
    sources: Sources,
    /// What [`Counter::read`] and [`Counter::read_err`] last returned ([`Counter::trywait`]).
    seen_value: AtomicU64,
    seen_errors: AtomicU64,
}

/// A completion counter (`fid_cntr`): successes and errors of the operations it is bound to
/// count (see the [module documentation](crate::cntr)). Cheap to clone; holds its domain. Bind
/// it when building endpoints ([`EndpointBuilder::counter`](crate::EndpointBuilder::counter));
/// one counter may count on several endpoints, and an endpoint may have several counters.
#[derive(Clone)]
pub struct Counter {
    inner: Arc<CntrInner>,
}

impl Counter {
    /// A counter at 0 (successes and errors), with its wait descriptor.
    ///
    /// Errors: `Io` when the system gives no eventfd.
    #[doc(alias = "fi_cntr_open")]
    pub fn new(domain: &Domain) -> Result<Counter> {
        let notifier = Arc::new(Notifier::new());
        if notifier.fd().is_none() {
            return Err(Error::io("cntr_open", std::io::Error::last_os_error())
                .with_detail("no eventfd for the counter's wait descriptor"));
        }
        Ok(Counter {
            inner: Arc::new(CntrInner {
                domain: domain.clone(),
                value: AtomicU64::new(0),
                errors: AtomicU64::new(0),
                notifier,
                sources: Sources::default(),
                seen_value: AtomicU64::new(0),
                seen_errors: AtomicU64::new(0),
            }),
        })
    }

    /// The domain.
    pub fn domain(&self) -> &Domain {
        &self.inner.domain
    }

    /// Drives the bound endpoints, then returns the count of successful operations.
    #[doc(alias = "fi_cntr_read")]
    pub fn read(&self) -> u64 {
        self.progress();
        let v = self.value();
        self.inner.seen_value.store(v, Ordering::Relaxed);
        v
    }

    /// Drives the bound endpoints, then returns the count of failed operations.
    #[doc(alias = "fi_cntr_readerr")]
    pub fn read_err(&self) -> u64 {
        self.progress();
        let e = self.errors();
        self.inner.seen_errors.store(e, Ordering::Relaxed);
        e
    }

    /// Adds `n` to the success count (wrapping), waking waiters.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// let c = efa::Counter::new(&domain)?;
    /// c.add(5);
    /// c.set_err(2);
    /// c.add_err(1);
    /// assert_eq!((c.read(), c.read_err()), (5, 3));
    /// c.set(1);
    /// assert_eq!(c.read(), 1);
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_cntr_add")]
    pub fn add(&self, n: u64) {
        self.inner.value.fetch_add(n, Ordering::AcqRel);
        self.inner.notifier.notify();
    }

    /// Sets the success count, waking waiters.
    #[doc(alias = "fi_cntr_set")]
    pub fn set(&self, n: u64) {
        self.inner.value.store(n, Ordering::Release);
        self.inner.notifier.notify();
    }

    /// Adds `n` to the error count (wrapping), waking waiters (whose waits then end with
    /// `ErrorAvailable`).
    #[doc(alias = "fi_cntr_adderr")]
    pub fn add_err(&self, n: u64) {
        self.inner.errors.fetch_add(n, Ordering::AcqRel);
        self.inner.notifier.notify();
    }

    /// Sets the error count, waking waiters.
    #[doc(alias = "fi_cntr_seterr")]
    pub fn set_err(&self, n: u64) {
        self.inner.errors.store(n, Ordering::Release);
        self.inner.notifier.notify();
    }

    /// Blocks, driving the bound endpoints, until the success count reaches `threshold`, and
    /// returns it; `timeout` `None` waits for ever.
    ///
    /// Errors: `TimedOut` when `timeout` passed first; `ErrorAvailable` as soon as the error
    /// count differs from what it was when the wait began (as `fi_cntr_wait` returns
    /// `-FI_EAVAIL`): an operation failed, read [`read_err`](Self::read_err) and the completion
    /// queue's error entries.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// use std::time::Duration;
    /// let c = efa::Counter::new(&domain)?;
    /// let e = c.wait(1, Some(Duration::from_millis(5))).unwrap_err();
    /// assert_eq!(e.kind(), efa::ErrorKind::TimedOut);
    /// c.add(1);
    /// assert_eq!(c.wait(1, None)?, 1);
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_cntr_wait")]
    pub fn wait(&self, threshold: u64, timeout: Option<Duration>) -> Result<u64> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let errors = self.errors();
        loop {
            let seen = self.inner.notifier.generation();
            if let Some(r) = self.check(threshold, errors) {
                return r;
            }
            if !self.inner.notifier.wait_until(seen, deadline) {
                return match self.check(threshold, errors) {
                    Some(r) => r,
                    None => Err(
                        Error::new(ErrorKind::TimedOut, "cntr_wait").with_detail(format!(
                            "the count is {} after {:?}, below the threshold {threshold}",
                            self.value(),
                            timeout.unwrap_or_default()
                        )),
                    ),
                };
            }
        }
    }

    /// [`wait`](Self::wait) as a future, needing no particular runtime (the devices' wake-ups
    /// drive the `Waker`): resolves to the count once it reaches `threshold`, or to
    /// `ErrorAvailable` once the error count differs from what it was when the future was made.
    /// Put a timeout around it with the runtime's timer.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// let c = efa::Counter::new(&domain)?;
    /// c.add(2);
    /// // Inside any async runtime: `let n = c.wait_async(2).await?;`
    /// let _fut = c.wait_async(2);
    /// # Ok(()) }
    /// ```
    pub fn wait_async(&self, threshold: u64) -> CounterWait<'_> {
        CounterWait {
            cntr: self,
            threshold,
            errors: self.errors(),
        }
    }

    /// Whether the program may block on [`wait_fd`](Self::wait_fd) now (libfabric's
    /// `fi_trywait`): `Ok` when, after driving the bound endpoints, the count and the error
    /// count are what [`read`](Self::read) and [`read_err`](Self::read_err) last returned and
    /// nothing else happened meanwhile; the descriptor then becomes readable at the next change
    /// of the counter or completion on a bound endpoint's device (the devices' threads take
    /// over the progress). `Again` otherwise: read the counter again instead of blocking. Call
    /// it right before every block on the descriptor.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// use std::os::fd::AsRawFd;
    /// let c = efa::Counter::new(&domain)?;
    /// while c.read() < 1 {
    ///     if c.trywait().is_ok() {
    ///         # c.add(1);
    ///         // Nothing happened: block in poll(2) (epoll, mio, tokio's AsyncFd).
    ///         let mut p = libc::pollfd { fd: c.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    ///         unsafe { libc::poll(&mut p, 1, 1000) };
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_trywait")]
    pub fn trywait(&self) -> Result<()> {
        let n = &self.inner.notifier;
        let seen = n.generation();
        self.progress();
        let moved = self.value() != self.inner.seen_value.load(Ordering::Relaxed)
            || self.errors() != self.inner.seen_errors.load(Ordering::Relaxed);
        if moved || n.arm_fd(seen) {
            return Err(Error::new(ErrorKind::Again, "trywait")
                .with_detail("the counter changed (or may have) since it was last read: read it"));
        }
        Ok(())
    }

    /// The descriptor to block on (an epoll set holding an eventfd, `FI_WAIT_FD`; also `AsFd`
    /// and `AsRawFd`; wait for it to be readable, do not read it):
    /// readable after a successful [`trywait`](Self::trywait) once the counter may have
    /// changed. Usable with epoll, mio and `tokio::io::unix::AsyncFd`; it is the counter's for
    /// its life.
    #[doc(alias = "fi_control")]
    #[doc(alias = "FI_GETWAIT")]
    pub fn wait_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }

    /// True when both handles are the same counter.
    pub fn same(&self, other: &Counter) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn value(&self) -> u64 {
        self.inner.value.load(Ordering::Acquire)
    }

    fn errors(&self) -> u64 {
        self.inner.errors.load(Ordering::Acquire)
    }

    fn progress(&self) {
        self.inner.sources.drive(|s| s.progress());
    }

    /// Drives progress, then: `Some(Ok)` at the threshold, `Some(Err)` when the error count
    /// moved from `errors`, `None` to go on waiting.
    fn check(&self, threshold: u64, errors: u64) -> Option<Result<u64>> {
        self.progress();
        let now = self.errors();
        if now != errors {
            return Some(Err(Error::new(ErrorKind::ErrorAvailable, "cntr_wait")
                .with_detail(format!(
                    "the error count went from {errors} to {now} (see Counter::read_err and \
                     the completion queue's errors)"
                ))));
        }
        let v = self.value();
        (v >= threshold).then_some(Ok(v))
    }

    pub(crate) fn notifier(&self) -> &Arc<Notifier> {
        &self.inner.notifier
    }

    pub(crate) fn bind(&self, source: Weak<dyn ProgressSource>) {
        self.inner.sources.bind(source);
    }

    /// Counts one operation (no wake-up: [`Bound`] signals once per batch).
    fn hit(&self, ok: bool) {
        let c = if ok {
            &self.inner.value
        } else {
            &self.inner.errors
        };
        c.fetch_add(1, Ordering::AcqRel);
    }

    fn hit_n(&self, ok: u64, err: u64) {
        if ok > 0 {
            self.inner.value.fetch_add(ok, Ordering::AcqRel);
        }
        if err > 0 {
            self.inner.errors.fetch_add(err, Ordering::AcqRel);
        }
    }
}

wait_fd_impls!(Counter);

impl fmt::Debug for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Counter")
            .field("value", &self.value())
            .field("errors", &self.errors())
            .finish()
    }
}

/// Future returned by [`Counter::wait_async`].
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited"]
pub struct CounterWait<'a> {
    cntr: &'a Counter,
    threshold: u64,
    errors: u64,
}

impl Future for CounterWait<'_> {
    type Output = Result<u64>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<u64>> {
        let n = &self.cntr.inner.notifier;
        loop {
            let seen = n.generation();
            if let Some(r) = self.cntr.check(self.threshold, self.errors) {
                return Poll::Ready(r);
            }
            if !n.register(seen, cx.waker()) {
                return Poll::Pending;
            }
        }
    }
}

/// The counters bound to one endpoint, by the kind of operation they count.
#[derive(Clone, Default)]
pub(crate) struct Bound {
    by_kind: [Vec<Counter>; 6],
    /// Every bound counter once.
    all: Vec<Counter>,
}

/// One kind of counted operation (an index into [`Bound`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Send = 0,
    Recv = 1,
    Read = 2,
    Write = 3,
    RemoteRead = 4,
    RemoteWrite = 5,
}

impl Bound {
    /// The bindings of a builder, checked: events the endpoint kind counts (`allowed`),
    /// counters of `domain`, at least one event each.
    pub(crate) fn new(
        list: &[(Counter, CounterEvents)],
        domain: &Domain,
        allowed: CounterEvents,
        kind: &str,
    ) -> Result<Bound> {
        let mut b = Bound::default();
        for (c, ev) in list {
            let bad = |why: String| {
                Err(Error::new(ErrorKind::InvalidArgument, "ep_bind").with_detail(why))
            };
            if !c.domain().same(domain) {
                return bad("the counter belongs to another domain".into());
            }
            if ev.is_empty() {
                return bad("a counter bound for no event".into());
            }
            if !allowed.contains(*ev) {
                return Err(
                    Error::new(ErrorKind::NotSupported, "ep_bind").with_detail(format!(
                        "{kind} endpoints count only {allowed:?}, not {ev:?}"
                    )),
                );
            }
            for (i, (e, _)) in CounterEvents::NAMES.iter().enumerate() {
                if ev.contains(*e) && !b.by_kind[i].iter().any(|x| x.same(c)) {
                    b.by_kind[i].push(c.clone());
                }
            }
            if !b.all.iter().any(|x| x.same(c)) {
                b.all.push(c.clone());
            }
        }
        Ok(b)
    }

    /// True when a counter counts `kind`.
    pub(crate) fn counts(&self, kind: Kind) -> bool {
        !self.by_kind[kind as usize].is_empty()
    }

    /// Counts one operation of `kind`; true when a counter counted it (call
    /// [`Bound::signal`] once the batch is done).
    pub(crate) fn hit(&self, kind: Kind, ok: bool) -> bool {
        let list = &self.by_kind[kind as usize];
        for c in list {
            c.hit(ok);
        }
        !list.is_empty()
    }

    /// Counts `ok` successes and `err` errors of `kind` and wakes the waiters.
    pub(crate) fn hit_n(&self, kind: Kind, ok: u64, err: u64) {
        for c in &self.by_kind[kind as usize] {
            c.hit_n(ok, err);
            c.notifier().notify();
        }
    }

    /// Wakes the waiters of every counter (after a batch of [`Bound::hit`]s).
    pub(crate) fn signal(&self) {
        for c in &self.all {
            c.notifier().notify();
        }
    }

    /// The notifiers of the bound counters (each once), for the queue pair to signal.
    pub(crate) fn notifiers(&self) -> impl Iterator<Item = &Arc<Notifier>> {
        self.all.iter().map(Counter::notifier)
    }

    /// True when no counter is bound.
    pub(crate) fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    /// Makes every bound counter drive `source` when read or waited on.
    pub(crate) fn bind(&self, source: &Weak<dyn ProgressSource>) {
        for c in &self.all {
            c.bind(source.clone());
        }
    }
}

impl fmt::Debug for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bound")
            .field("counters", &self.all.len())
            .finish()
    }
}
