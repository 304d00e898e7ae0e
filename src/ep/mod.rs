//! Typed endpoints: [`Endpoint<Dgram>`](Dgram) (datagrams, on the device directly) and
//! [`Endpoint<Rdm>`](Rdm) (reliable datagrams, through the protocol engine and the same-host
//! path).
//!
//! Endpoint kinds are types, so a method a kind does not support does not exist on it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::av::AddressVector;
use crate::cntr::{Bound, Counter, CounterEvents};
use crate::cq::CompletionQueue;
use crate::device::DeviceAttr;
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::info::{Caps, EpType, Info};
use crate::notify::Notifier;

mod buf;
mod dgram;
mod pin;
mod rdm;
mod rma;
mod rma_batch;

pub use dgram::{DgramCore, MSG_PREFIX_SIZE};
pub use pin::ProgressCpu;
pub use rdm::{
    BatchError, EndpointOptions, OpFuture, OpOutcome, RdmCore, RecvOptions, SendOptions,
    SendRequest,
};
pub use rma::{AtomicRequest, RmaAddr, RmaEmulation, WriteOptions};
pub use rma_batch::{ReadRequest, WriteRequest};

mod sealed {
    pub trait Sealed {}
}

/// An endpoint kind: [`Rdm`] (through the protocol engine) or [`Dgram`] (straight on the
/// device). Sealed.
pub trait EndpointKind: sealed::Sealed + Sized + 'static {
    /// The libfabric endpoint type.
    const EP_TYPE: EpType;
    /// Shared state of an endpoint of this kind.
    #[doc(hidden)]
    type Core: Send + Sync + fmt::Debug;
    /// Marker deciding `Sync`: `Endpoint<Dgram>` is `Send` but not `Sync` (like `FI_THREAD_DOMAIN`).
    #[doc(hidden)]
    type Marker: Send;
    /// Called when the application's handle is dropped, before its reference to the core goes.
    #[doc(hidden)]
    fn handle_dropped(_core: &std::sync::Arc<Self::Core>) {}
}

/// Datagram endpoints: unreliable, unordered messages of at most one MTU, straight on the
/// device's UD queue pair (`FI_EP_DGRAM`). `Endpoint<Dgram>` is `Send` but not `Sync`.
#[derive(Debug, Clone, Copy)]
pub enum Dgram {}

impl sealed::Sealed for Dgram {}

/// Reliable datagram endpoints (`FI_EP_RDM`): reliable, send-after-send ordered messages and
/// tagged messages of any size on the protocol engine. `Endpoint<Rdm>` is `Send + Sync`
/// (`FI_THREAD_SAFE`).
#[derive(Debug, Clone, Copy)]
pub enum Rdm {}

impl sealed::Sealed for Rdm {}

impl EndpointKind for Rdm {
    const EP_TYPE: EpType = EpType::Rdm;
    type Core = RdmCore;
    type Marker = ();
    fn handle_dropped(core: &std::sync::Arc<RdmCore>) {
        RdmCore::handle_dropped(core);
    }
}

impl EndpointKind for Dgram {
    const EP_TYPE: EpType = EpType::Dgram;
    type Core = DgramCore;
    type Marker = PhantomData<std::cell::Cell<()>>;
}

/// An endpoint of kind `K`. Holds its domain, address vector and completion queues, so handles may
/// be dropped in any order. Dropping it closes it: every outstanding operation completes with a
/// `Canceled` error completion that hands its buffer back.
pub struct Endpoint<K: EndpointKind> {
    pub(crate) core: std::sync::Arc<K::Core>,
    _marker: PhantomData<K::Marker>,
}

impl<K: EndpointKind> Drop for Endpoint<K> {
    fn drop(&mut self) {
        K::handle_dropped(&self.core);
    }
}

impl<K: EndpointKind> fmt::Debug for Endpoint<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Endpoint")
            .field("type", &K::EP_TYPE)
            .field("core", &self.core)
            .finish()
    }
}

impl<K: EndpointKind> Endpoint<K> {
    /// A builder for an endpoint of this kind on `domain`.
    #[doc(alias = "fi_endpoint")]
    #[doc(alias = "fi_enable")]
    #[doc(alias = "fi_ep_bind")]
    pub fn builder(domain: &Domain) -> EndpointBuilder<K> {
        EndpointBuilder {
            domain: domain.clone(),
            tx_cq: None,
            rx_cq: None,
            av: None,
            tx_size: None,
            rx_size: None,
            msg_prefix: domain.msg_prefix(),
            progress_thread: false,
            local_path: true,
            progress_cpu: ProgressCpu::Unpinned,
            caps: Caps::empty(),
            options: rdm::RequestedOptions::default(),
            counters: Vec::new(),
            _kind: PhantomData,
        }
    }

    pub(crate) fn from_core(core: std::sync::Arc<K::Core>) -> Endpoint<K> {
        Endpoint {
            core,
            _marker: PhantomData,
        }
    }
}

/// Builds an endpoint: completion queue(s), address vector, queue sizes, options.
#[derive(Debug)]
pub struct EndpointBuilder<K: EndpointKind> {
    pub(crate) domain: Domain,
    pub(crate) tx_cq: Option<CompletionQueue>,
    pub(crate) rx_cq: Option<CompletionQueue>,
    pub(crate) av: Option<AddressVector>,
    pub(crate) tx_size: Option<usize>,
    pub(crate) rx_size: Option<usize>,
    pub(crate) msg_prefix: bool,
    pub(crate) progress_thread: bool,
    /// RDM: the local fast path to peers on this host (`local.rs`).
    pub(crate) local_path: bool,
    pub(crate) progress_cpu: ProgressCpu,
    pub(crate) caps: Caps,
    /// RDM: the endpoint options asked for (`rdm::opts`).
    pub(crate) options: rdm::RequestedOptions,
    /// Counters and what each counts (`fi_ep_bind` of a counter).
    pub(crate) counters: Vec<(Counter, CounterEvents)>,
    _kind: PhantomData<K>,
}

/// What an endpoint is bound to: its completion queues (a queue that keeps nothing stands for
/// one not given when counters are bound), address vector and counters.
pub(crate) struct Parts {
    pub(crate) tx_cq: CompletionQueue,
    pub(crate) rx_cq: CompletionQueue,
    pub(crate) av: AddressVector,
    pub(crate) counters: Bound,
}

impl Parts {
    /// Makes the endpoint `source` the one the completion queues and counters drive when
    /// polled or waited on.
    pub(crate) fn bind(&self, source: std::sync::Weak<dyn crate::cq::ProgressSource>) {
        self.counters.bind(&source);
        self.tx_cq.bind(source.clone());
        if !self.rx_cq.same(&self.tx_cq) {
            self.rx_cq.bind(source);
        }
    }
}

impl<K: EndpointKind> EndpointBuilder<K> {
    /// One completion queue for sends and receives.
    pub fn cq(mut self, cq: &CompletionQueue) -> Self {
        self.tx_cq = Some(cq.clone());
        self.rx_cq = Some(cq.clone());
        self
    }

    /// The completion queue of sends.
    pub fn tx_cq(mut self, cq: &CompletionQueue) -> Self {
        self.tx_cq = Some(cq.clone());
        self
    }

    /// The completion queue of receives.
    pub fn rx_cq(mut self, cq: &CompletionQueue) -> Self {
        self.rx_cq = Some(cq.clone());
        self
    }

    /// The address vector peers are named in.
    pub fn av(mut self, av: &AddressVector) -> Self {
        self.av = Some(av.clone());
        self
    }

    /// Send queue size (default: `Config::tx_size`, 0 meaning the device's depth).
    pub fn tx_size(mut self, n: usize) -> Self {
        self.tx_size = Some(n);
        self
    }

    /// Receive queue size (default: `Config::rx_size`, 0 meaning the device's depth).
    pub fn rx_size(mut self, n: usize) -> Self {
        self.rx_size = Some(n);
        self
    }

    /// Binds `counter` to count the operations `events` names (`fi_ep_bind` with a counter):
    /// [`CounterEvents::SEND`], `RECV` on every endpoint, and on RDM endpoints also `READ`,
    /// `WRITE` (operations this endpoint starts) and `REMOTE_READ`, `REMOTE_WRITE` (peers'
    /// accesses to this domain's memory through this endpoint). Call it once per counter; a
    /// counter may count on several endpoints. An endpoint with counters may go without a
    /// completion queue (for either direction): its operations are then only counted, their
    /// completions and buffers dropped (futures such as `send_async` still resolve).
    ///
    /// Building fails with `NotSupported` for events the endpoint kind does not count (RMA on
    /// DGRAM) and `InvalidArgument` for a counter of another domain or bound for no event.
    #[doc(alias = "fi_ep_bind")]
    pub fn counter(mut self, counter: &Counter, events: CounterEvents) -> Self {
        self.counters.push((counter.clone(), events));
        self
    }

    /// Capabilities the endpoint must have (`fi_info.caps` of the hints); building fails with
    /// `NotSupported` naming the missing ones when this kind of endpoint lacks any.
    pub fn caps(mut self, caps: Caps) -> Self {
        self.caps = caps;
        self
    }

    /// The queues, address vector and counters, checked: present (a queue may be missing when
    /// counters are bound) and of this domain; and the requested capabilities, checked against
    /// what this kind of endpoint offers.
    pub(crate) fn parts(&self) -> Result<Parts> {
        let missing = |what: &str| {
            Error::new(ErrorKind::InvalidArgument, "ep_open")
                .with_detail(format!("no {what} bound (call .{what}(..))"))
        };
        let offered = Info::ep_caps(K::EP_TYPE);
        if !offered.contains(self.caps) {
            return Err(
                Error::new(ErrorKind::NotSupported, "ep_open").with_detail(format!(
                    "{} endpoints lack {}",
                    K::EP_TYPE,
                    self.caps - offered
                )),
            );
        }
        let countable = match K::EP_TYPE {
            EpType::Rdm => CounterEvents::all(),
            _ => CounterEvents::SEND | CounterEvents::RECV,
        };
        let counters = Bound::new(&self.counters, &self.domain, countable, K::EP_TYPE.as_str())?;
        let queue = |cq: &Option<CompletionQueue>| match cq {
            Some(q) => Ok(q.clone()),
            None if !counters.is_empty() => Ok(CompletionQueue::discard(&self.domain)),
            None => Err(missing("cq")),
        };
        let tx = queue(&self.tx_cq)?;
        let rx = match (&self.rx_cq, &self.tx_cq) {
            // Both missing: one queue that keeps nothing.
            (None, None) if !counters.is_empty() => tx.clone(),
            (rx, _) => queue(rx)?,
        };
        let av = self.av.clone().ok_or_else(|| missing("av"))?;
        for (what, d) in [
            ("tx cq", tx.domain()),
            ("rx cq", rx.domain()),
            ("av", av.domain()),
        ] {
            if !d.same(&self.domain) {
                return Err(Error::new(ErrorKind::InvalidArgument, "ep_open")
                    .with_detail(format!("{what} belongs to another domain")));
            }
        }
        Ok(Parts {
            tx_cq: tx,
            rx_cq: rx,
            av,
            counters,
        })
    }

    /// The notifier the queue pair signals: it wakes the waiters of both completion queues (one
    /// notifier when they are the same queue), of the counters and, if given, the endpoint's
    /// own waiters.
    pub(crate) fn qp_notifier(parts: &Parts, own: Option<&Arc<Notifier>>) -> Arc<Notifier> {
        let (tx, rx) = (&parts.tx_cq, &parts.rx_cq);
        let mut targets = Vec::new();
        if !tx.is_discard() {
            targets.push(tx.notifier().clone());
        }
        if !rx.same(tx) && !rx.is_discard() {
            targets.push(rx.notifier().clone());
        }
        targets.extend(parts.counters.notifiers().cloned());
        targets.extend(own.cloned());
        if targets.is_empty() {
            return Arc::new(Notifier::new());
        }
        match targets.len() {
            1 => targets.remove(0),
            _ => Arc::new(Notifier::forwarding(targets)),
        }
    }

    /// Resolves a queue size: the builder's, else the config's, 0 meaning `default` (at most
    /// the device's depth); larger than the device's depth is `InvalidArgument`.
    pub(crate) fn queue_size(
        &self,
        set: Option<usize>,
        config: usize,
        device: usize,
        default: usize,
        what: &str,
    ) -> Result<usize> {
        let n = set.unwrap_or(config);
        if n == 0 {
            return Ok(default.min(device));
        }
        if n > device {
            return Err(Error::new(ErrorKind::InvalidArgument, "ep_open")
                .with_detail(format!("{what} {n} exceeds the device's {device}")));
        }
        Ok(n)
    }
}

impl<T: EndpointKind> EndpointBuilder<T> {
    /// The queue pair's send and receive depths (its bounce buffers, pinned on efa): the
    /// builder's or configured sizes when set, else the device kind's default
    /// ([`default_qp_depths`]); more than the device's is `InvalidArgument`.
    pub(crate) fn qp_depths(&self, attr: &DeviceAttr) -> Result<(usize, usize)> {
        let cfg = self.domain.config();
        let (def_send, def_recv) = default_qp_depths(attr);
        let send = self.queue_size(
            self.tx_size,
            cfg.tx_size,
            attr.max_send_wr,
            def_send,
            "tx_size",
        )?;
        let recv = self.queue_size(
            self.rx_size,
            cfg.rx_size,
            attr.max_recv_wr,
            def_recv,
            "rx_size",
        )?;
        Ok((send, recv))
    }
}

/// Work requests a queue pair holds by default on a device that pins a bounce buffer of one
/// MTU per work request (`efa`: `send × MTU + recv × (MTU + 40)` bytes, about 4.6 MB at 256 each
/// and an MTU of 8928, inside the usual 8 MB `RLIMIT_MEMLOCK`). A device's maximum (4096 send,
/// 32768 receive on recent EFA) would pin about 290 MB. `FI_EFA_TX_SIZE` / `FI_EFA_RX_SIZE` (or
/// the builders' `tx_size` / `rx_size`) choose other depths, up to the device's.
pub(crate) const PINNED_QP_DEPTH: usize = 256;

/// The default send and receive depths of a queue pair on a device with `attr`: the device's
/// maxima on software devices (whose buffers are not pinned), [`PINNED_QP_DEPTH`] on `efa`.
pub(crate) fn default_qp_depths(attr: &DeviceAttr) -> (usize, usize) {
    if attr.policy.pins_queue_buffers {
        (
            PINNED_QP_DEPTH.min(attr.max_send_wr),
            PINNED_QP_DEPTH.min(attr.max_recv_wr),
        )
    } else {
        (attr.max_send_wr, attr.max_recv_wr)
    }
}

/// `Endpoint<Dgram>` is `Send` but not `Sync` (`FI_THREAD_DOMAIN`): sharing it between threads
/// by reference does not compile.
///
/// ```compile_fail
/// fn is_sync<T: Sync>() {}
/// is_sync::<efa::Endpoint<efa::Dgram>>();
/// ```
#[doc(hidden)]
pub const _DGRAM_IS_NOT_SYNC: () = ();
