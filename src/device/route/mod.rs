//! Routing to peers on this host through shared memory, like libfabric's EFA provider does with
//! its shm peer provider when `FI_EFA_ENABLE_SHM_TRANSFER` is on.
//!
//! A [`RoutedDevice`] wraps a primary device (`udp` or `efa`) and an [`ShmDevice`]. Its SRD
//! queue pairs own two queue pairs:
//!
//! * the **primary** one, whose address is *the* address: peers, address vectors and the protocol
//!   engine only ever see primary addresses;
//! * an **shm** one (same QKEY), published in a host-local directory under a name derived from
//!   the primary address (see [`dir`]).
//!
//! A send to a destination whose directory entry exists, is owned by a live process of this
//! user in the same network namespace, and whose shm address has this device's shm GID (same
//! kernel, user and directory) goes over shm, with a 24-byte routing header in front (magic,
//! the sender's primary GID and QPN, the destination's primary QPN); anything else goes over the
//! primary. A datagram received over shm completes with the sender's **primary**
//! [`Source`](crate::device::Source), so the layer above sees one peer whichever path a packet
//! took. Receive buffers are split between the two queue pairs and follow the traffic (each
//! path gets a few ([`BASE_RECV`]), the rest are kept spare and handed to the path that consumes; a
//! buffer that comes back from a path is reposted there), so buffers are consumed in the order
//! they were posted on each path but not across the two, and a datagram lands in a buffer of its
//! path; every posted work request completes exactly once,
//! also on close (`Flushed`). RNR, QKEY checks and error statuses are each
//! path's own: the shm queue pair has the primary's QKEY, and a stale primary address (another
//! QKEY) has no entry, so it goes to the primary path and fails there as it always did.
//!
//! UD queue pairs (DGRAM endpoints) are not routed: they are the primary device's. One-sided
//! RDMA and memory registration are forwarded to the primary device (its keys).
//!
//! Mixed setups work: a process without routing sends to primary addresses, and a routed queue
//! pair receives on both paths; replies go over shm only if the replying side routes. The
//! counters `shm_route_*` of [`DeviceStats`] count what went over shm.
//!
//! ```
//! use efa::device::route::RoutedDevice;
//! use efa::device::shm::ShmConfig;
//! use efa::device::udp::{UdpConfig, UdpDevice};
//! use efa::device::{Device, QpAttr, QpType};
//!
//! # fn main() -> efa::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let dev = RoutedDevice::open(UdpDevice::open(UdpConfig::default())?, ShmConfig::in_dir(dir.path()))?;
//! let qp = dev.create_qp(QpAttr::new(QpType::Srd))?;
//! assert_eq!(qp.addr().gid, dev.attr().gid); // the primary (udp) address
//! # Ok(()) }
//! ```

pub mod dir;
mod qp;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::addr::Gid;
use crate::device::shm::{self, ShmConfig, ShmDevice};
use crate::device::{Device, DeviceAttr, QpAttr, QpType, QueuePair};
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{Access, RegionMem};
use crate::stats::{DeviceCounters, DeviceStats};

/// Bytes of the routing header in front of every datagram sent over shm.
pub const HDR_LEN: usize = 24;
/// Receive buffers each path of an SRD queue pair gets before further ones are kept spare and
/// handed to the path that consumes (an eighth of the receive queue depth when that is more).
/// A path whose buffers are used up has its datagrams wait (receiver not ready) even while the
/// other path holds some: buffers posted to a device queue pair cannot be taken back. With at
/// least twice this many posted, the path the traffic takes always has one (the RDM endpoint
/// posts hundreds).
pub const BASE_RECV: usize = 16;
/// First four bytes of the routing header.
const HDR_MAGIC: [u8; 4] = *b"EFRT";

/// What the device and its queue pairs share.
struct RouteShared {
    /// The shm device's canonical directory (entries live there).
    dir: PathBuf,
    uid: u32,
    netns: String,
    shm_gid: Gid,
    counters: DeviceCounters,
}

/// A primary device (`udp`, `efa`) whose SRD queue pairs reach peers on this host over shm.
pub struct RoutedDevice {
    primary: Arc<dyn Device>,
    shm: Arc<ShmDevice>,
    shared: Arc<RouteShared>,
}

impl RoutedDevice {
    /// Wraps `primary`, opening an shm device from `shm` for the local path. The shm MTU is set
    /// to the primary's plus [`HDR_LEN`] and its queue depths to at least the primary's; the
    /// other fields (directory, ring slots, timeouts) are `shm`'s. Removes the stale entries
    /// dead processes left in the directory.
    ///
    /// Errors: `InvalidArgument` if the primary is itself `shm` or `loopback`, or the resulting
    /// shm configuration is invalid; the shm device's errors (e.g. a missing directory).
    pub fn open(primary: Arc<dyn Device>, shm: ShmConfig) -> Result<Arc<RoutedDevice>> {
        let pa = primary.attr();
        if !pa.policy.same_host_route {
            return Err(Error::new(ErrorKind::InvalidArgument, "route_open")
                .with_detail(format!("cannot route a {} device over shm", pa.kind)));
        }
        let cfg = ShmConfig {
            mtu: pa.mtu + HDR_LEN,
            max_send_wr: shm
                .max_send_wr
                .max(pa.max_send_wr)
                .min(shm::MAX_QUEUE_DEPTH),
            max_recv_wr: shm
                .max_recv_wr
                .max(pa.max_recv_wr)
                .min(shm::MAX_QUEUE_DEPTH),
            ..shm
        };
        let shm = ShmDevice::open(cfg)?;
        let shm_gid = shm.attr().gid;
        let uid = dir::uid();
        // `ShmDevice::open` swept the directory's stale files of every kind.
        let d = shm.dir().to_path_buf();
        tracing::debug!(primary = %pa.name, dir = %d.display(), "shm route: device opened");
        Ok(Arc::new(RoutedDevice {
            primary,
            shm,
            shared: Arc::new(RouteShared {
                dir: d,
                uid,
                netns: dir::netns(),
                shm_gid,
                counters: DeviceCounters::default(),
            }),
        }))
    }

    /// The primary device.
    pub fn primary(&self) -> &Arc<dyn Device> {
        &self.primary
    }

    /// The shm device of the local path.
    pub fn shm(&self) -> &Arc<ShmDevice> {
        &self.shm
    }

    /// Removes this user's stale files of dead processes (routing entries, shm segments,
    /// channels) from the directory; returns how many files it removed.
    /// [`RoutedDevice::open`] does this once.
    pub fn sweep(&self) -> usize {
        self.shm.sweep()
    }
}

impl fmt::Debug for RoutedDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoutedDevice")
            .field("primary", &self.primary)
            .field("shm", &self.shm)
            .finish()
    }
}

impl Device for RoutedDevice {
    /// The primary device's attributes: the layers above see the primary device.
    fn attr(&self) -> &DeviceAttr {
        self.primary.attr()
    }

    fn create_qp(&self, attr: QpAttr) -> Result<Box<dyn QueuePair>> {
        if attr.qp_type != QpType::Srd || !attr.same_host_route {
            return self.primary.create_qp(attr);
        }
        let recv_depth = attr.recv_depth.min(self.primary.attr().max_recv_wr).max(1);
        let primary = self.primary.create_qp(attr.clone())?;
        let addr = primary.addr();
        let shm_attr = QpAttr {
            qkey: Some(addr.qkey),
            ..attr
        };
        let local = match self.shm.create_qp(shm_attr) {
            Ok(sq) => {
                let info = dir::EntryInfo {
                    pid: std::process::id(),
                    netns: self.shared.netns.clone(),
                    primary: addr,
                    shm: sq.addr(),
                };
                let entry = match dir::publish(&self.shared.dir, self.shared.uid, &info) {
                    Ok(Some(e)) => Some(e),
                    Ok(None) => {
                        tracing::warn!(%addr, "shm route: another live queue pair has this address; local peers will use the primary path to reach it");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "shm route: cannot publish the local path; local peers will use the primary path to reach it");
                        None
                    }
                };
                Some(qp::Local::new(sq, entry, &addr, recv_depth))
            }
            Err(e) => {
                tracing::warn!(%addr, error = %e, "shm route: no shm queue pair; every peer goes over the primary path");
                None
            }
        };
        Ok(Box::new(qp::RoutedQp {
            shared: self.shared.clone(),
            primary,
            local,
            addr,
            mtu: self.primary.attr().mtu,
            shm_first: false,
            failed: Default::default(),
            closed: false,
            recv_depth,
            rdma_to_local: Default::default(),
            introduce: Default::default(),
        }))
    }

    /// The primary's and the shm device's counters added up, plus the `shm_route_*` counters of
    /// this device (and its `malformed_dropped`: shm datagrams without a routing header).
    fn stats(&self) -> DeviceStats {
        let mut s = self.primary.stats();
        s += self.shm.stats();
        s += self.shared.counters.snapshot();
        s
    }

    fn register_mem(&self, mem: &Arc<RegionMem>, access: Access) -> Result<Option<u64>> {
        self.primary.register_mem(mem, access)
    }

    fn deregister_mem(&self, key: u64) {
        self.primary.deregister_mem(key)
    }

    /// Device-only memory goes to the primary's NIC (RDMA always goes over the primary, even to
    /// peers on this host); the shm side never touches region memory.
    fn register_device_mem(&self, mem: &Arc<RegionMem>, access: Access) -> Result<u64> {
        self.primary.register_device_mem(mem, access)
    }

    fn query_mem(&self, key: u64) -> Result<crate::device::MrQuery> {
        self.primary.query_mem(key)
    }

    fn local_dir(&self) -> Option<&std::path::Path> {
        Some(self.shm.dir())
    }
}

/// The device a domain opened from an RDM [`Info`](crate::Info) uses: a [`RoutedDevice`] over
/// `device` (with the shm device in `/dev/shm`) when `config.enable_shm_transfer` is on and the
/// device is `udp` or `efa`; otherwise `device` itself. If the shm side cannot be opened, a
/// warning is logged and `device` is used alone.
pub fn for_rdm(device: Arc<dyn Device>, enable_shm_transfer: bool) -> Arc<dyn Device> {
    if !enable_shm_transfer || !device.attr().policy.same_host_route {
        return device;
    }
    match RoutedDevice::open(device.clone(), ShmConfig::default()) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(device = %device.attr().name, error = %e, "FI_EFA_ENABLE_SHM_TRANSFER: cannot open the shm device; local peers go over the primary device");
            device
        }
    }
}
