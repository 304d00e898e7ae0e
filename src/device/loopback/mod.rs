//! The `loopback` device: an in-process software NIC with seeded fault injection.
//!
//! Devices opened on the same [`LoopbackNetwork`] reach each other through an in-process "wire".
//! Queue pairs behave like EFA's: SRD queue pairs deliver every datagram **exactly once, in any
//! order** (the simulated device retransmits what the fault injector "drops" and suppresses what
//! it "duplicates"), UD queue pairs suffer every fault. Every fault decision comes from the
//! network's seeded generator, so a test replays from the seed it prints.
//!
//! Nothing runs in the background: a datagram is delivered in the thread that posts it, and held
//! datagrams (reordered, delayed, retransmitted, waiting for a receive buffer) are released by the
//! next `post_send` or `poll` on any queue pair of the network, or by [`LoopbackNetwork::pump`].
//!
//! One-sided RDMA read, write and write with immediate data (on by default,
//! [`LoopbackConfig::rdma`]) are performed in the initiator's thread against memory the target
//! registered ([`Device::register_mem`], which [`Domain::register`](crate::Domain::register)
//! calls), checked against key, bounds and access rights, and complete without the target
//! application polling.
//!
//! See `docs/loopback-device.md` for the full model and the status each failure gives.

mod qp;
mod rdma;
mod wire;

/// The loopback device in the registry: one device on the process's global network.
pub(crate) const PROVIDER: super::registry::Provider = super::registry::Provider {
    kind: crate::device::DeviceKind::Loopback,
    discover: |_| super::registry::open_one(super::spec::DeviceSpec::loopback()),
};

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use crate::addr::Gid;
use crate::device::{Device, DeviceAttr, DeviceKind, QpAttr, QueuePair};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::FaultConfig;
use crate::mem::{Access, KeyTable, RegionMem};
use crate::stats::{DeviceCounters, DeviceStats};

use self::qp::{LoopbackQp, QpnTable};
use self::wire::Wire;

/// Smallest MTU a loopback device accepts, bytes.
pub const MIN_MTU: usize = 64;
/// Largest MTU a loopback device accepts, bytes.
pub const MAX_MTU: usize = 1 << 20;
/// Largest queue depth a loopback device accepts.
pub const MAX_QUEUE_DEPTH: usize = 1 << 20;
/// Largest inline send the loopback device advertises, bytes (as EFA).
pub const INLINE_SIZE: usize = 32;
/// Default largest single RDMA read or write, bytes (1 GiB, EFA's write segment size).
pub const DEFAULT_MAX_RDMA_SIZE: u64 = 1 << 30;

/// Settings of one loopback device.
///
/// ```
/// use efa::device::loopback::LoopbackConfig;
/// let cfg = LoopbackConfig::default().with_mtu(4096);
/// assert!(cfg.validate().is_ok());
/// assert!(LoopbackConfig::default().with_mtu(1).validate().is_err());
/// ```
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct LoopbackConfig {
    /// Largest datagram (header and payload together), bytes. Default 8192; must lie in
    /// [`MIN_MTU`]`..=`[`MAX_MTU`].
    pub mtu: usize,
    /// Send queue depth of one queue pair. Default 1024; `1..=`[`MAX_QUEUE_DEPTH`].
    pub max_send_wr: usize,
    /// Receive queue depth of one queue pair. Default 4096; `1..=`[`MAX_QUEUE_DEPTH`].
    pub max_recv_wr: usize,
    /// Simulated time between two receiver-not-ready retries of an SRD send. Default 50 µs.
    pub rnr_retry_interval: Duration,
    /// How long an SRD send to a queue pair that is gone (closed, never existed, wrong QKEY) or to
    /// an unknown device waits before it completes with an error status. Default 1 s.
    pub unresponsive_timeout: Duration,
    /// One-sided RDMA read and write (`caps.rdma_read`, `caps.rdma_write`). Default true; when
    /// false, `post_read`/`post_write` are `NotSupported` and `max_rdma_size` is 0.
    pub rdma: bool,
    /// An RDMA write with immediate data completes at the target without consuming a receive
    /// buffer (`caps.unsolicited_write_recv`; the completion's `wr_id` is
    /// [`UNSOLICITED_WR_ID`](crate::device::UNSOLICITED_WR_ID)). Default true; only with `rdma`.
    pub unsolicited_write_recv: bool,
    /// Largest single RDMA read or write, bytes. Default [`DEFAULT_MAX_RDMA_SIZE`]; at least 1.
    pub max_rdma_size: u64,
}

with_setters! {
    LoopbackConfig {
        with_mtu => mtu: usize,
        with_max_send_wr => max_send_wr: usize,
        with_max_recv_wr => max_recv_wr: usize,
        with_rnr_retry_interval => rnr_retry_interval: Duration,
        with_unresponsive_timeout => unresponsive_timeout: Duration,
        with_rdma => rdma: bool,
        with_unsolicited_write_recv => unsolicited_write_recv: bool,
        with_max_rdma_size => max_rdma_size: u64,
    }
}

impl Default for LoopbackConfig {
    fn default() -> Self {
        LoopbackConfig {
            mtu: 8192,
            max_send_wr: 1024,
            max_recv_wr: 4096,
            rnr_retry_interval: Duration::from_micros(50),
            unresponsive_timeout: Duration::from_secs(1),
            rdma: true,
            unsolicited_write_recv: true,
            max_rdma_size: DEFAULT_MAX_RDMA_SIZE,
        }
    }
}

impl LoopbackConfig {
    /// Checks the ranges; a bad value is `ErrorKind::InvalidArgument`.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::new(ErrorKind::InvalidArgument, "loopback_config").with_detail(detail))
        };
        let depths = (self.max_send_wr, self.max_recv_wr);
        let mtus = MIN_MTU..=MAX_MTU;
        crate::device::check_limits("loopback_config", self.mtu, mtus, depths, MAX_QUEUE_DEPTH)?;
        if self.max_rdma_size == 0 {
            return bad("max_rdma_size must be at least 1".into());
        }
        Ok(())
    }
}

/// The in-process "wire" that connects loopback devices, with its fault injector and clock.
///
/// Cloning is cheap and gives another handle to the same network. Devices on different networks
/// cannot reach each other (their GIDs differ too).
///
/// The clock is real time ([`LoopbackNetwork::new`]) or a manual clock that moves only when
/// [`LoopbackNetwork::advance`] is called ([`LoopbackNetwork::with_manual_clock`]); with the manual
/// clock even delays, RNR retries and unresponsive timeouts replay exactly.
#[derive(Clone)]
pub struct LoopbackNetwork {
    wire: Arc<Wire>,
}

static NEXT_NETWORK_ID: AtomicU32 = AtomicU32::new(1);

impl LoopbackNetwork {
    /// A new network, on the real clock, injecting `faults` (validated when a device is opened).
    pub fn new(faults: FaultConfig) -> LoopbackNetwork {
        Self::build(faults, false)
    }

    /// A new network whose clock starts at zero and moves only by [`LoopbackNetwork::advance`].
    pub fn with_manual_clock(faults: FaultConfig) -> LoopbackNetwork {
        Self::build(faults, true)
    }

    fn build(faults: FaultConfig, manual: bool) -> LoopbackNetwork {
        let id = NEXT_NETWORK_ID.fetch_add(1, Ordering::Relaxed);
        LoopbackNetwork {
            wire: Arc::new(Wire::new(id, faults, manual)),
        }
    }

    /// The process-wide fault-free network (real clock), created on first use.
    pub fn global() -> LoopbackNetwork {
        static GLOBAL: OnceLock<LoopbackNetwork> = OnceLock::new();
        GLOBAL
            .get_or_init(|| LoopbackNetwork::new(FaultConfig::default()))
            .clone()
    }

    /// This network's number (part of its devices' GIDs).
    pub fn id(&self) -> u32 {
        self.wire.id
    }

    /// The fault configuration in force.
    pub fn faults(&self) -> FaultConfig {
        self.wire.state.lock().faults.config().clone()
    }

    /// Replaces the fault configuration and restarts the generator from its seed. Datagrams
    /// already held keep their fate.
    pub fn set_faults(&self, faults: FaultConfig) -> Result<()> {
        faults.validate()?;
        self.wire.state.lock().set_faults(faults);
        Ok(())
    }

    /// Releases every held datagram whose time has come (delivering it, retrying it or failing
    /// it), as any `post_send` or `poll` on the network does. Returns how many it handled.
    pub fn pump(&self) -> usize {
        self.wire.pump()
    }

    /// Datagrams currently held by the network (reordered, delayed, retransmitted, waiting for a
    /// receive buffer or for their unresponsive timeout).
    pub fn in_flight(&self) -> usize {
        self.wire.in_flight()
    }

    /// The network's time: since creation on the real clock, or the sum of `advance` calls.
    pub fn now(&self) -> Duration {
        self.wire.now()
    }

    /// True when the network runs on the manual clock.
    pub fn has_manual_clock(&self) -> bool {
        self.wire.has_manual_clock()
    }

    /// Moves the manual clock forward by `d` (then `pump` or `poll` to release what became due).
    /// On the real clock this is `ErrorKind::NotSupported`.
    pub fn advance(&self, d: Duration) -> Result<()> {
        if self.wire.advance(d) {
            Ok(())
        } else {
            Err(Error::new(ErrorKind::NotSupported, "loopback_advance")
                .with_detail("the network runs on the real clock"))
        }
    }
}

impl fmt::Debug for LoopbackNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackNetwork")
            .field("id", &self.wire.id)
            .field("manual_clock", &self.wire.has_manual_clock())
            .field("in_flight", &self.wire.in_flight())
            .finish()
    }
}

/// What queue pairs share with their device (and keep alive after the device handle is gone).
pub(crate) struct DevShared {
    net: LoopbackNetwork,
    gid: Gid,
    cfg: LoopbackConfig,
    counters: DeviceCounters,
    qpns: Mutex<QpnTable>,
    /// Regions peers may reach by RDMA, by key (32 random bits, unique among the live ones).
    mrs: Mutex<KeyTable>,
}

/// An in-process software NIC on a [`LoopbackNetwork`].
///
/// ```
/// use bytes::{Bytes, BytesMut};
/// use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
/// use efa::device::{Device, Opcode, QpAttr, QpType, SendWr};
/// use efa::FaultConfig;
///
/// # fn main() -> efa::Result<()> {
/// let net = LoopbackNetwork::new(FaultConfig::seeded(7));
/// let dev = LoopbackDevice::open(&net, LoopbackConfig::default())?;
/// let mut a = dev.create_qp(QpAttr::new(QpType::Srd))?;
/// let mut b = dev.create_qp(QpAttr::new(QpType::Srd))?;
///
/// b.post_recv(1, BytesMut::with_capacity(64))?;
/// a.post_send(SendWr {
///     wr_id: 2,
///     dest: b.addr(),
///     hdr: Bytes::from_static(b"hi "),
///     payload: Bytes::from_static(b"there"),
///     imm: Some(9),
/// })?;
///
/// let mut got = Vec::new();
/// b.poll(&mut got, 8);
/// assert_eq!(got[0].opcode, Opcode::Recv);
/// assert_eq!(&got[0].buf.as_ref().unwrap()[..], b"hi there");
/// assert_eq!(got[0].src.unwrap().qpn, a.addr().qpn);
/// assert_eq!(got[0].imm, Some(9));
///
/// got.clear();
/// a.poll(&mut got, 8);
/// assert!(got[0].status.is_ok() && got[0].opcode == Opcode::Send);
/// # Ok(()) }
/// ```
pub struct LoopbackDevice {
    attr: DeviceAttr,
    shared: Arc<DevShared>,
}

impl LoopbackDevice {
    /// Opens a new device on `network`, with the next GID (`fd00::<network>:<n>` in IPv6
    /// notation, `<network>` and `<n>` as 32-bit numbers) and the name `loopback<n>`.
    ///
    /// Fails with `ErrorKind::InvalidArgument` when `cfg` or the network's faults are invalid.
    pub fn open(network: &LoopbackNetwork, cfg: LoopbackConfig) -> Result<Arc<LoopbackDevice>> {
        cfg.validate()?;
        let (n, shared) = {
            let mut st = network.wire.state.lock();
            st.faults.config().validate()?;
            st.register_device(network.wire.id, |gid| {
                Arc::new(DevShared {
                    net: network.clone(),
                    gid,
                    cfg: cfg.clone(),
                    counters: DeviceCounters::default(),
                    qpns: Mutex::new(QpnTable::new()),
                    mrs: Mutex::new(KeyTable::default()),
                })
            })
        };
        let gid = shared.gid;
        let attr = DeviceAttr::software(
            DeviceKind::Loopback,
            format!("loopback{n}"),
            gid,
            cfg.mtu,
            cfg.max_send_wr,
            cfg.max_recv_wr,
        )
        .with_soft_rdma(cfg.rdma, cfg.unsolicited_write_recv, cfg.max_rdma_size);
        debug_assert_eq!(attr.inline_size, INLINE_SIZE);
        tracing::debug!(name = %attr.name, %gid, network = network.id(), "loopback device opened");
        Ok(Arc::new(LoopbackDevice { attr, shared }))
    }

    /// The network this device is on.
    pub fn network(&self) -> &LoopbackNetwork {
        &self.shared.net
    }

    /// The configuration the device was opened with.
    pub fn config(&self) -> &LoopbackConfig {
        &self.shared.cfg
    }
}

impl fmt::Debug for LoopbackDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackDevice")
            .field("name", &self.attr.name)
            .field("gid", &self.attr.gid)
            .field("network", &self.shared.net.id())
            .finish()
    }
}

impl Device for LoopbackDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn create_qp(&self, attr: QpAttr) -> Result<Box<dyn QueuePair>> {
        Ok(Box::new(LoopbackQp::create(&self.shared, attr)?))
    }

    fn stats(&self) -> DeviceStats {
        self.shared.counters.snapshot()
    }

    /// With RDMA on, enters `mem` in the device's key table under 32 random bits from the
    /// kernel's CSPRNG that no live region of the device holds, as a NIC's rkey is wide (a
    /// domain's own keys are wider, and peers emulate RMA to those); without, `Ok(None)`.
    fn register_mem(&self, mem: &Arc<RegionMem>, access: Access) -> Result<Option<u64>> {
        if !self.shared.cfg.rdma {
            return Ok(None);
        }
        let key = self
            .shared
            .mrs
            .lock()
            .insert_random(mem, access, 0xffff_ffff, 0);
        crate::stats::inc(&self.shared.counters.mem_registrations);
        Ok(Some(key))
    }

    fn deregister_mem(&self, key: u64) {
        self.shared.mrs.lock().remove(key);
    }
}
