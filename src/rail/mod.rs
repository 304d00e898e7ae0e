//! Multi-rail striping: one transfer over several NICs.
//!
//! A [`RailGroup`] holds one RDM endpoint per chosen NIC (a *rail*: a domain, its endpoint,
//! completion queue and address vector), and offers the operations of one endpoint whose large
//! transfers are cut into stripes that run on all rails at once:
//!
//! * RMA: [`write`](RailGroup::write), [`write_data`](RailGroup::write_data) and
//!   [`read`](RailGroup::read) into or from a peer's [`RailRegion`] (one memory registered on
//!   every rail's domain; its [`RailRemoteKey`] carries a key per rail);
//! * messages: [`send`](RailGroup::send) and [`recv`](RailGroup::recv) of any size, in order.
//!
//! Peers exchange one address bundle ([`RailAddr`], every rail's address) out of band and
//! [`insert`](RailGroup::insert) it to get one [`RailPeer`]. Completions come from
//! [`poll`](RailGroup::poll) / [`wait`](RailGroup::wait), one per operation, after all its
//! stripes.
//!
//! How stripes are sized and placed, the order and notification promises, and what happens when
//! a rail fails are in `docs/multi-nic.md` ("Striping"). In short: a transfer of at least
//! [`min_stripe`](RailGroupBuilder::min_stripe) bytes is cut into equal stripes (about four per
//! rail, none smaller than the minimum), and each rail pulls the next stripe whenever it has
//! fewer than [`depth`](RailGroupBuilder::depth) in flight, so a rail that completes faster
//! carries more; a stripe whose rail fails moves to another rail; an operation fails (once,
//! with a clear error) only when no rail to the peer is left.
//!
//! The group lives beside the endpoint layer: it uses [`Endpoint<Rdm>`](crate::Endpoint) as any
//! application would, and the protocol engine knows nothing of it.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use efa::rail::{RailGroup, RailOp};
//! use efa::device::loopback::{LoopbackDevice, LoopbackNetwork};
//! use efa::{Access, Domain};
//!
//! # fn main() -> efa::Result<()> {
//! // Four loopback devices stand in for four NICs, on each side.
//! let net = LoopbackNetwork::new(Default::default());
//! let nics = || -> efa::Result<Vec<Domain>> {
//!     (0..4).map(|_| Ok(Domain::with_device(LoopbackDevice::open(&net, Default::default())?,
//!         Default::default()))).collect()
//! };
//! let a = RailGroup::builder(nics()?).min_stripe(64 << 10).build()?;
//! let b = RailGroup::builder(nics()?).min_stripe(64 << 10).build()?;
//! let to_b = a.insert(&b.addr())?;
//! b.insert(&a.addr())?;
//! // B's buffer, registered on its four NICs; its keys go to A.
//! let region = b.register(vec![0u8; 1 << 20], Access::REMOTE_WRITE)?;
//! let rk = region.remote_key()?;
//! let data = Bytes::from((0..1 << 20).map(|i| i as u8).collect::<Vec<u8>>());
//! a.write_data(to_b, data.clone(), &rk, 0, 42, 1)?;
//! // A large message, too.
//! b.recv(BytesMut::with_capacity(300_000), 2)?;
//! a.send(to_b, Bytes::from(vec![5u8; 300_000]), 3)?;
//! let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
//! while at_a.len() < 2 || at_b.len() < 2 {
//!     a.poll(&mut at_a, 8)?;
//!     b.poll(&mut at_b, 8)?;
//! }
//! assert!(at_a.iter().all(|c| c.result.is_ok()));
//! let note = at_b.iter().find(|c| c.op == RailOp::RemoteWrite).unwrap();
//! assert_eq!((note.data, note.len), (Some(42), 1 << 20));
//! assert_eq!(&region.read()[..], &data[..]);
//! let msg = at_b.iter().find(|c| c.op == RailOp::Recv).unwrap();
//! assert_eq!(msg.buf.as_recv().unwrap(), &[5u8; 300_000][..]);
//! // Every rail carried part of it.
//! assert!(a.stats().rails.iter().all(|r| r.bytes > 0));
//! # Ok(()) }
//! ```

mod addr;
mod ctrl;
mod region;
mod rx;
mod state;
mod tx;
mod wire;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;

pub use addr::{MAX_RAILS, RailAddr, RailRemoteKey};
pub use region::RailRegion;

use crate::cq::{Buffer, PostError};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::info::Info;
use crate::mem::{Access, IntoRegionBuf};
use state::State;

/// A peer group, as [`RailGroup::insert`] numbers it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct RailPeer(u32);

impl RailPeer {
    /// Its index in the group's peer table.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a [`RailCompletion`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RailOp {
    /// A [`RailGroup::write`] or [`RailGroup::write_data`].
    Write,
    /// A [`RailGroup::read`].
    Read,
    /// A [`RailGroup::send`].
    Send,
    /// A [`RailGroup::recv`] (a message arrived, or failed to).
    Recv,
    /// A peer's [`write_data`](RailGroup::write_data) into this group's memory: all its bytes
    /// landed. Context 0.
    RemoteWrite,
}

/// The one completion of a group operation, after all its stripes.
#[derive(Debug)]
pub struct RailCompletion {
    /// The context the operation was posted with (0 for [`RailOp::RemoteWrite`]).
    pub context: u64,
    /// What completed.
    pub op: RailOp,
    /// The peer: the target of a write, read or send, the sender of a received message or
    /// notification.
    pub peer: Option<RailPeer>,
    /// Bytes moved (a receive: bytes placed in the buffer; a remote write: the whole write's
    /// length).
    pub len: usize,
    /// The immediate data of a [`RailOp::RemoteWrite`].
    pub data: Option<u32>,
    /// `Ok`, or why the operation failed (`Truncated` for a message longer than the receive
    /// buffer, whose first bytes are in it; the rails' errors when no rail to the peer was left).
    pub result: Result<()>,
    /// The operation's buffer, handed back: the `Bytes` of a write or send, the `BytesMut` of a
    /// read or receive (filled), nothing for a remote write.
    pub buf: Buffer,
}

/// Counters of one rail.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct RailStats {
    /// The rail's device name (`efa_0`, `rdmap16s27`, `loopback0`, ...).
    pub device: String,
    /// Stripe bytes this rail completed (written, read, or message bytes written).
    pub bytes: u64,
    /// Stripes this rail completed.
    pub stripes: u64,
    /// Rail operations completed: stripes and control messages.
    pub ops: u64,
    /// Rail operations that failed (each one's stripe moved to another rail or failed its
    /// operation).
    pub errors: u64,
    /// Stripes that failed here and moved to another rail.
    pub moved: u64,
    /// Stripe bytes in flight now.
    pub in_flight_bytes: u64,
    /// False once [`RailGroup::disable_rail`] closed it.
    pub enabled: bool,
}

/// Counters of a group: each rail's and the group's own.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct RailGroupStats {
    /// One entry per rail, in rail order.
    pub rails: Vec<RailStats>,
    /// Group operations completed successfully.
    pub completed: u64,
    /// Group operations that completed with an error.
    pub failed: u64,
    /// Control messages dropped: malformed, from a source no inserted peer has, or stale
    /// duplicates (a message resent on another rail after its first copy arrived).
    pub ctrl_dropped: u64,
}

impl RailGroupStats {
    /// Stripe bytes of all rails together.
    pub fn bytes(&self) -> u64 {
        self.rails.iter().map(|r| r.bytes).sum()
    }
}

/// Tunables of a group, from its builder.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    pub min_stripe: usize,
    pub max_stripe: usize,
    pub depth: usize,
    pub inline_size: usize,
    pub ctrl_recvs: usize,
    pub ctrl_timeout: Duration,
}

/// Builds a [`RailGroup`] over some domains (one rail each).
#[derive(Debug)]
pub struct RailGroupBuilder {
    domains: Vec<Domain>,
    set: Settings,
    progress_thread: bool,
    cq_size: usize,
}

/// Default [`RailGroupBuilder::min_stripe`].
pub const DEFAULT_MIN_STRIPE: usize = 128 << 10;
/// Default [`RailGroupBuilder::max_stripe`].
pub const DEFAULT_MAX_STRIPE: usize = 8 << 20;
/// Default [`RailGroupBuilder::depth`].
pub const DEFAULT_DEPTH: usize = 4;
/// Default [`RailGroupBuilder::ctrl_timeout`].
pub const DEFAULT_CTRL_TIMEOUT: Duration = Duration::from_millis(500);
/// Default [`RailGroupBuilder::inline_size`].
pub const DEFAULT_INLINE_SIZE: usize = 8 << 10;

builder_setters! {
    RailGroupBuilder, in set {
        /// The smallest stripe (default 128 KiB): a transfer shorter than twice this goes on one
        /// rail; longer ones are cut into stripes of at least this. At least 1.
        min_stripe: usize;
        /// The largest stripe (default 8 MiB): longer transfers are cut into more stripes than
        /// four per rail.
        max_stripe: usize;
        /// Stripes one rail keeps in flight (default 4); a rail takes the next stripe when one of
        /// its own completes.
        depth: usize;
        /// Messages up to this many bytes go whole in one control message (default 8 KiB); longer
        /// ones are written into the receiver's buffer by RMA, striped.
        inline_size: usize;
        /// How long a control message (a small message, a large one's handshake, a write's
        /// notification) waits for the peer group's acknowledgement before it is sent again on
        /// another rail (default 500 ms; doubling on each try up to 16 times this). Copies are
        /// harmless: the peer drops them. Not zero.
        ctrl_timeout: Duration;
    }
}

impl RailGroupBuilder {
    /// Gives every rail's endpoint a progress thread pinned near its NIC
    /// ([`ProgressCpu::NearDevice`](crate::ProgressCpu::NearDevice)). Default off: polling the
    /// group drives its rails.
    pub fn progress_thread(mut self, on: bool) -> Self {
        self.progress_thread = on;
        self
    }

    /// Opens every rail: a completion queue, an address vector and an RDM endpoint on each
    /// domain, with control receives posted. `InvalidArgument` for no domain, more than
    /// [`MAX_RAILS`], a minimum stripe of 0, a maximum below the minimum, a depth of 0, or an
    /// inline size above 64 KiB.
    pub fn build(self) -> Result<RailGroup> {
        let s = self.set;
        let why = if self.domains.is_empty() || self.domains.len() > MAX_RAILS {
            Some(format!(
                "1 to {MAX_RAILS} domains, not {}",
                self.domains.len()
            ))
        } else if s.min_stripe == 0 || s.max_stripe < s.min_stripe {
            Some(format!(
                "stripes of {}..={} bytes: the minimum must be at least 1 and at most the maximum",
                s.min_stripe, s.max_stripe
            ))
        } else if s.depth == 0 {
            Some("a depth of 0 stripes per rail".into())
        } else if s.ctrl_timeout.is_zero() {
            Some("a control timeout of 0".into())
        } else if s.inline_size > 64 << 10 {
            Some(format!("inline size {} is above 64 KiB", s.inline_size))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::new(ErrorKind::InvalidArgument, "rail_group").with_detail(why));
        }
        let state = State::open(&self.domains, s, self.progress_thread, self.cq_size)?;
        Ok(RailGroup {
            domains: self.domains,
            state: Mutex::new(state),
        })
    }
}

/// One transfer striped over several NICs: see the [module documentation](self).
///
/// `Send + Sync`: operations may be posted from several threads; [`poll`](Self::poll) drives
/// every rail.
pub struct RailGroup {
    domains: Vec<Domain>,
    state: Mutex<State>,
}

impl std::fmt::Debug for RailGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailGroup")
            .field("rails", &self.domains)
            .finish()
    }
}

impl RailGroup {
    /// A builder for a group with one rail per domain, in the given order (rail `i` on
    /// `domains[i]`).
    pub fn builder(domains: Vec<Domain>) -> RailGroupBuilder {
        RailGroupBuilder {
            domains,
            set: Settings {
                min_stripe: DEFAULT_MIN_STRIPE,
                max_stripe: DEFAULT_MAX_STRIPE,
                depth: DEFAULT_DEPTH,
                inline_size: DEFAULT_INLINE_SIZE,
                ctrl_recvs: 32,
                ctrl_timeout: DEFAULT_CTRL_TIMEOUT,
            },
            progress_thread: false,
            cq_size: 1024,
        }
    }

    /// A group with default settings over the devices of `infos` (from
    /// [`getinfo`](crate::getinfo), for example the NICs nearest a GPU with
    /// [`Hints::near`](crate::Hints::near)): a domain per entry.
    pub fn open(infos: &[Info]) -> Result<RailGroup> {
        let domains = infos.iter().map(Domain::open).collect::<Result<Vec<_>>>()?;
        RailGroup::builder(domains).build()
    }

    /// The number of rails.
    pub fn rails(&self) -> usize {
        self.domains.len()
    }

    /// Rail `rail`'s domain.
    pub fn domain(&self, rail: usize) -> Option<&Domain> {
        self.domains.get(rail)
    }

    /// The address bundle to hand to peers (every rail's endpoint address, in rail order).
    pub fn addr(&self) -> RailAddr {
        self.state.lock().addr()
    }

    /// Inserts a peer group's address bundle; its rail `i` is reached from this group's rail `i`
    /// (the first `min(ours, theirs)` rails pair up; further ones are unused). Both sides insert
    /// each other: a control message from a group not inserted here is dropped. `InvalidArgument`
    /// if a rail's address vector refuses an address.
    pub fn insert(&self, addr: &RailAddr) -> Result<RailPeer> {
        self.state.lock().insert(addr)
    }

    /// Registers `buf` with every rail's domain (one memory, a key per rail) for a peer's
    /// striped RMA, or as the target of this group's own operations' data.
    pub fn register(&self, buf: impl IntoRegionBuf, access: Access) -> Result<RailRegion> {
        let refs: Vec<&Domain> = self.domains.iter().collect();
        RailRegion::register_on(&refs, buf, access)
    }

    /// Writes `buf` into the peer's region `to` at `offset`, striped over the rails. One
    /// [`RailOp::Write`] completion after every stripe completed, handing `buf` back.
    /// `InvalidArgument` (and `buf` back) for an unknown peer, a key bundle with fewer keys than
    /// rails in use, or a range outside the region.
    pub fn write(
        &self,
        peer: RailPeer,
        buf: impl Into<Bytes>,
        to: &RailRemoteKey,
        offset: u64,
        context: u64,
    ) -> Result<(), PostError> {
        self.state
            .lock()
            .post_write(peer, buf.into(), to, offset, None, context)
    }

    /// [`write`](Self::write) with 4 bytes of immediate data: the peer gets one
    /// [`RailOp::RemoteWrite`] completion carrying `data` and the whole length, only after every
    /// stripe landed (the notification is a control message sent once all stripes completed
    /// here), in order with this group's sends and other notifications to that peer.
    pub fn write_data(
        &self,
        peer: RailPeer,
        buf: impl Into<Bytes>,
        to: &RailRemoteKey,
        offset: u64,
        data: u32,
        context: u64,
    ) -> Result<(), PostError> {
        self.state
            .lock()
            .post_write(peer, buf.into(), to, offset, Some(data), context)
    }

    /// Reads `len` bytes of the peer's region `from` at `offset` into `buf` (its contents are
    /// replaced; it grows if needed), striped over the rails. One [`RailOp::Read`] completion
    /// hands `buf` back filled.
    pub fn read(
        &self,
        peer: RailPeer,
        buf: BytesMut,
        len: usize,
        from: &RailRemoteKey,
        offset: u64,
        context: u64,
    ) -> Result<(), PostError> {
        self.state
            .lock()
            .post_read(peer, buf, len, from, offset, context)
    }

    /// Sends a message of any size to the peer. Up to
    /// [`inline_size`](RailGroupBuilder::inline_size) bytes it travels whole in one control
    /// message; longer, the receiver registers its buffer on its rails and this group writes the
    /// message into it, striped, then tells it so. The peer's receives take this group's
    /// messages in the order they were sent, whatever rails carried them.
    pub fn send(
        &self,
        peer: RailPeer,
        buf: impl Into<Bytes>,
        context: u64,
    ) -> Result<(), PostError> {
        self.state.lock().post_send(peer, buf.into(), context)
    }

    /// Posts a receive for the next message from any peer; a message takes up to
    /// `buf.capacity()` bytes (a longer one completes `Truncated` with its first bytes).
    pub fn recv(&self, buf: BytesMut, context: u64) -> Result<(), PostError> {
        self.state.lock().post_recv(buf, context);
        Ok(())
    }

    /// Drives every rail, then moves up to `max` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<RailCompletion>, max: usize) -> Result<usize> {
        self.state.lock().poll(out, max)
    }

    /// [`poll`](Self::poll), sleeping until a rail has news when there is nothing to report, up
    /// to `timeout` (`None`: forever); a timeout is `TimedOut`.
    pub fn wait(
        &self,
        out: &mut Vec<RailCompletion>,
        max: usize,
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let waker = std::task::Waker::from(Arc::new(ThreadWaker(std::thread::current())));
        loop {
            let notifiers = self.state.lock().notifiers();
            let seen: Vec<u64> = notifiers.iter().map(|n| n.generation()).collect();
            let n = self.poll(out, max)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::new(ErrorKind::TimedOut, "rail_wait"));
            }
            if notifiers
                .iter()
                .zip(&seen)
                .any(|(n, s)| n.register(*s, &waker))
            {
                continue;
            }
            // Bounded: a loopback device delivers only when some thread drives it.
            let nap = Duration::from_millis(2);
            std::thread::park_timeout(deadline.map_or(nap, |d| (d - now).min(nap)));
        }
    }

    /// Closes rail `rail`'s endpoint, as if its NIC went away: its operations in flight fail
    /// and move to the other rails (or fail, when none is left), and no new stripe uses it.
    /// Peers see their stripes to it fail and move likewise. `InvalidArgument` for a rail that
    /// does not exist.
    pub fn disable_rail(&self, rail: usize) -> Result<()> {
        self.state.lock().disable_rail(rail)
    }

    /// Every rail's counters and the group's.
    pub fn stats(&self) -> RailGroupStats {
        self.state.lock().stats()
    }
}

/// Wakes a thread parked in [`RailGroup::wait`].
struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}
