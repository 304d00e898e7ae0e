//! Endpoint options (`fi_setopt`/`fi_getopt` at `FI_OPT_ENDPOINT` level, libfabric's
//! `FI_OPT_*` and `FI_OPT_EFA_*`): set on the builder, read back with
//! [`Endpoint::options`], and the ones libfabric lets an application change on a live endpoint
//! settable there too. docs/rdm.md, "Endpoint options", says what each does on each device.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// The options of an RDM endpoint, as [`Endpoint::options`] reports them (the values in
/// effect). Set them with the builder's methods of the same names.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EndpointOptions {
    /// Receiver-not-ready retries of the queue pair before a send reports RNR to the protocol,
    /// which then backs off and resends (`FI_OPT_EFA_RNR_RETRY`; 7: the device retries for
    /// ever). Default 3, as libfabric's.
    pub rnr_retry: u8,
    /// One-sided RMA and the read-based message protocols use the device's RDMA
    /// (`FI_OPT_EFA_USE_DEVICE_RDMA`); off, they are emulated with messages.
    pub use_device_rdma: bool,
    /// Peers on this host are reached over shared memory (the same-host path and the routing
    /// device's shm path; `FI_OPT_SHARED_MEMORY_PERMITTED`). Off, through the device as any
    /// other peer.
    pub shared_memory_permitted: bool,
    /// `FI_OPT_EFA_SENDRECV_IN_ORDER_ALIGNED_128_BYTES`: the 128-byte aligned blocks of a
    /// received message are never seen partly written. Every device guarantees it here (a
    /// receive buffer is the operation's until its completion, so nothing of a message can be
    /// read before all of it is in).
    pub sendrecv_in_order_aligned_128_bytes: bool,
    /// `FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES`: the 128-byte aligned blocks of an RMA write
    /// land in order at the target. No device here guarantees it, so asking for it is
    /// `NotSupported` (as libfabric answers on a device without it): software devices place a
    /// write's datagrams in any order at boundaries that are not 128-byte aligned, and the efa
    /// device cannot ask the NIC (rdma-core's `ibv_query_qp_data_in_order` is not wired).
    pub write_in_order_aligned_128_bytes: bool,
    /// A multi-receive buffer posted with [`Endpoint::recv_multi`] is retired when less than this
    /// many bytes remain (`FI_OPT_MIN_MULTI_RECV`). Default: the device's MTU less the largest
    /// packet header, as libfabric's.
    pub min_multi_recv: usize,
    /// Longest message a send takes (`FI_OPT_MAX_MSG_SIZE`); longer ones are refused with
    /// `MsgSize`. Default unlimited (`usize::MAX`).
    pub max_msg_size: usize,
    /// Longest [`inject_write`](Endpoint::inject_write) (`FI_OPT_INJECT_RMA_SIZE`); at most the
    /// endpoint's inject size, its default.
    pub inject_rma_size: usize,
    /// One-sided reads are emulated with messages (`FI_OPT_EFA_EMULATED_READ`, read only).
    pub emulated_read: bool,
    /// One-sided writes are emulated with messages (`FI_OPT_EFA_EMULATED_WRITE`, read only).
    pub emulated_write: bool,
    /// Atomics are emulated with messages (`FI_OPT_EFA_EMULATED_ATOMICS`, read only; always, as
    /// in libfabric's EFA provider).
    pub emulated_atomics: bool,
}

/// What the builder was asked for (`None`: the default).
#[derive(Clone, Debug, Default)]
pub(crate) struct RequestedOptions {
    pub rnr_retry: Option<u8>,
    pub use_device_rdma: Option<bool>,
    pub shared_memory_permitted: Option<bool>,
    pub sendrecv_in_order_aligned_128_bytes: bool,
    pub write_in_order_aligned_128_bytes: bool,
    pub min_multi_recv: Option<usize>,
    pub max_msg_size: Option<usize>,
    pub inject_rma_size: Option<usize>,
}

/// The options a live endpoint keeps, the changeable ones atomically.
#[derive(Debug)]
pub(crate) struct LiveOptions {
    /// What was fixed at build.
    pub fixed: EndpointOptions,
    pub min_multi_recv: AtomicUsize,
    pub max_msg_size: AtomicUsize,
    pub inject_rma_size: AtomicUsize,
}

impl LiveOptions {
    pub(crate) fn new(fixed: EndpointOptions) -> LiveOptions {
        LiveOptions {
            min_multi_recv: AtomicUsize::new(fixed.min_multi_recv),
            max_msg_size: AtomicUsize::new(fixed.max_msg_size),
            inject_rma_size: AtomicUsize::new(fixed.inject_rma_size),
            fixed,
        }
    }

    pub(crate) fn max_msg_size(&self) -> usize {
        self.max_msg_size.load(Ordering::Relaxed)
    }

    pub(crate) fn inject_rma_size(&self) -> usize {
        self.inject_rma_size.load(Ordering::Relaxed)
    }
}

/// `n` as `FI_OPT_INJECT_RMA_SIZE`: at most the endpoint's inject size.
fn check_inject_rma_size(n: usize, inject_size: usize) -> Result<usize> {
    if n > inject_size {
        return Err(
            Error::new(ErrorKind::InvalidArgument, "ep_setopt").with_detail(format!(
                "FI_OPT_INJECT_RMA_SIZE {n} is more than the inject size {inject_size}"
            )),
        );
    }
    Ok(n)
}

impl RequestedOptions {
    /// The options in effect on a device with `attr`, or why they cannot be: `use_rdma` is what
    /// the domain's configuration gives, `inject_size` the endpoint's.
    pub(crate) fn resolve(
        &self,
        attr: &crate::device::DeviceAttr,
        use_rdma: bool,
        inject_size: usize,
    ) -> Result<EndpointOptions> {
        let refuse = |what: &str| {
            Error::new(ErrorKind::NotSupported, "ep_setopt")
                .with_detail(format!("{what} on the {} device {}", attr.kind, attr.name))
        };
        if let Some(r) = self.rnr_retry {
            if r > 7 {
                return Err(Error::new(ErrorKind::InvalidArgument, "ep_setopt")
                    .with_detail(format!("FI_OPT_EFA_RNR_RETRY {r} is more than 7")));
            }
            if !attr.caps.rnr_retry {
                return Err(refuse(
                    "FI_OPT_EFA_RNR_RETRY: the device's RNR retry count cannot be set",
                ));
            }
        }
        let device_rdma = attr.caps.rdma_read || attr.caps.rdma_write;
        let use_device_rdma = match self.use_device_rdma {
            Some(true) if !device_rdma => {
                return Err(refuse("FI_OPT_EFA_USE_DEVICE_RDMA: no RDMA"));
            }
            Some(on) => on && use_rdma,
            None => use_rdma,
        };
        if self.write_in_order_aligned_128_bytes {
            return Err(refuse(
                "FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES: no in-order 128-byte writes",
            ));
        }
        let inject_rma_size = match self.inject_rma_size {
            Some(n) => check_inject_rma_size(n, inject_size)?,
            None => inject_size,
        };
        Ok(EndpointOptions {
            rnr_retry: self.rnr_retry.unwrap_or(3),
            use_device_rdma,
            shared_memory_permitted: self.shared_memory_permitted.unwrap_or(true),
            sendrecv_in_order_aligned_128_bytes: self.sendrecv_in_order_aligned_128_bytes,
            write_in_order_aligned_128_bytes: false,
            min_multi_recv: self
                .min_multi_recv
                .unwrap_or(attr.mtu.saturating_sub(crate::info::RDM_MAX_HDR_SIZE)),
            max_msg_size: self.max_msg_size.unwrap_or(usize::MAX),
            inject_rma_size,
            emulated_read: !(use_device_rdma && attr.caps.rdma_read),
            emulated_write: !(use_device_rdma && attr.caps.rdma_write),
            emulated_atomics: true,
        })
    }
}

builder_setters! {
    EndpointBuilder<Rdm>, in options {
        /// `FI_OPT_EFA_RNR_RETRY` (see [`EndpointOptions::rnr_retry`]): 0 to 7, 7 for ever.
        /// `NotSupported` at [`build`](Self::build) on a device whose retry count cannot be set.
        rnr_retry: u8 => Some;
        /// `FI_OPT_EFA_USE_DEVICE_RDMA` for this endpoint (see
        /// [`EndpointOptions::use_device_rdma`]); `true` on a device without RDMA is `NotSupported`
        /// at [`build`](Self::build). Default: the domain's `FI_EFA_USE_DEVICE_RDMA`.
        use_device_rdma: bool => Some;
        /// `FI_OPT_SHARED_MEMORY_PERMITTED` (see [`EndpointOptions::shared_memory_permitted`]).
        shared_memory_permitted: bool => Some;
        /// `FI_OPT_EFA_SENDRECV_IN_ORDER_ALIGNED_128_BYTES` (see
        /// [`EndpointOptions::sendrecv_in_order_aligned_128_bytes`]).
        sendrecv_in_order_aligned_128_bytes: bool;
        /// `FI_OPT_EFA_WRITE_IN_ORDER_ALIGNED_128_BYTES` (see
        /// [`EndpointOptions::write_in_order_aligned_128_bytes`]): `true` makes
        /// [`build`](Self::build) fail with `NotSupported`.
        write_in_order_aligned_128_bytes: bool;
        /// `FI_OPT_MIN_MULTI_RECV` (see [`EndpointOptions::min_multi_recv`]).
        min_multi_recv: usize => Some;
        /// `FI_OPT_MAX_MSG_SIZE` (see [`EndpointOptions::max_msg_size`]).
        max_msg_size: usize => Some;
        /// `FI_OPT_INJECT_RMA_SIZE` (see [`EndpointOptions::inject_rma_size`]); more than the inject
        /// size is `InvalidArgument` at [`build`](Self::build).
        inject_rma_size: usize => Some;
    }
}

impl Endpoint<Rdm> {
    /// The options in effect (`fi_getopt`).
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// use efa::{AddressVector, CompletionQueue, Domain, Endpoint, Hints, Rdm};
    /// let d = Domain::open(&efa::getinfo(&Hints::new().provider("loopback"))?[0])?;
    /// let (cq, av) = (CompletionQueue::new(&d, 64)?, AddressVector::new(&d));
    /// let ep = Endpoint::<Rdm>::builder(&d)
    ///     .cq(&cq)
    ///     .av(&av)
    ///     .rnr_retry(7)
    ///     .max_msg_size(1 << 20)
    ///     .build()?;
    /// let o = ep.options();
    /// assert_eq!((o.rnr_retry, o.max_msg_size), (7, 1 << 20));
    /// ep.set_max_msg_size(4096)?;
    /// assert_eq!(ep.options().max_msg_size, 4096);
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_getopt")]
    pub fn options(&self) -> EndpointOptions {
        let o = &self.core.options;
        EndpointOptions {
            min_multi_recv: o.min_multi_recv.load(Ordering::Relaxed),
            max_msg_size: o.max_msg_size(),
            inject_rma_size: o.inject_rma_size(),
            ..o.fixed.clone()
        }
    }

    /// Changes `FI_OPT_MIN_MULTI_RECV` on the live endpoint (`fi_setopt`): multi-receive buffers
    /// posted from now on use it.
    #[doc(alias = "fi_setopt")]
    pub fn set_min_multi_recv(&self, n: usize) {
        self.core.options.min_multi_recv.store(n, Ordering::Relaxed);
    }

    /// Changes `FI_OPT_MAX_MSG_SIZE` on the live endpoint: sends posted from now on longer than
    /// `n` are refused with `MsgSize`. `InvalidArgument` for 0.
    pub fn set_max_msg_size(&self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "ep_setopt")
                .with_detail("FI_OPT_MAX_MSG_SIZE 0"));
        }
        self.core.options.max_msg_size.store(n, Ordering::Relaxed);
        Ok(())
    }

    /// Changes `FI_OPT_INJECT_RMA_SIZE` on the live endpoint; more than the inject size is
    /// `InvalidArgument`.
    pub fn set_inject_rma_size(&self, n: usize) -> Result<()> {
        let n = check_inject_rma_size(n, self.core.inject_size)?;
        self.core
            .options
            .inject_rma_size
            .store(n, Ordering::Relaxed);
        Ok(())
    }

    /// Posts a multi-receive buffer (`FI_MULTI_RECV`) retired when less than the endpoint's
    /// [`min_multi_recv`](EndpointOptions::min_multi_recv) bytes remain: the same as
    /// [`recv_with`](Self::recv_with) with `RecvOptions::multi_recv` set to it.
    pub fn recv_multi(&self, buf: BytesMut, context: u64) -> Result<(), PostError> {
        let min = self.core.options.min_multi_recv.load(Ordering::Relaxed);
        self.recv_with(
            buf,
            RecvOptions {
                multi_recv: Some(min),
                ..RecvOptions::default()
            },
            context,
        )
    }
}
