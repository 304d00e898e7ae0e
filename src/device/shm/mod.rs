//! The `shm` software device: queue pairs of processes on one host exchange datagrams through
//! shared memory, like libfabric's shm provider, under the same contract as the `udp` and
//! `loopback` devices.
//!
//! * Every queue pair owns one **segment**: a file `efa-shm-<uid>-<qpn>` in [`ShmConfig::dir`]
//!   (default `/dev/shm`) holding a header, an acknowledgement table and a receive ring of fixed
//!   slots. The QPN is unique in that directory while the file exists (it is claimed with
//!   `link`, which fails on an existing name), so a [`RawAddr`](crate::RawAddr) is all a sender
//!   needs: it maps `efa-shm-<uid>-<dest.qpn>`, checks the QKEY and appends to the ring.
//! * The GID names the host, the user and the directory: `fd00:5:<boot>:<uid>:<dir>` (32-bit
//!   fields; `<boot>` hashes the kernel's boot id, `<dir>` the canonical directory path). Devices
//!   reach each other exactly when their GIDs are equal; another GID is `UnreachableRemote`.
//! * [`QpType::Srd`](crate::device::QpType::Srd): exactly once, in order (a valid "any order").
//!   A datagram waits in its slot while the receiver has no buffer posted (RNR); the sender gives
//!   it back after `rnr_retry` retries of [`ShmConfig::rnr_retry_interval`] and completes with
//!   `RnrRetryExceeded`. The send completes when the receiver has consumed the datagram and
//!   written its status into the sender's acknowledgement table.
//!   [`QpType::Ud`](crate::device::QpType::Ud): a full ring or a missing buffer drops.
//! * A background thread per queue pair (the "NIC") sleeps on a futex in its own segment and is
//!   woken by peers that append to its ring or acknowledge its sends, so receives, send
//!   completions and RNR timeouts progress while the application does not poll.
//! * A peer that dies is noticed through its segment's `flock` (held by the owner for the
//!   segment's life): outstanding sends to it complete with `UnresponsiveRemote` and its file is
//!   removed; opening a device sweeps the stale files of dead processes.
//! * [`cma`] probes whether cross-memory attach (`process_vm_readv`) is permitted towards a
//!   process, the basis of single-copy transfers and RDMA read/write between processes.
//!
//! The byte layout, the ring protocol and the rules are in `docs/shm-device.md`.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use efa::device::shm::{ShmConfig, ShmDevice};
//! use efa::device::{Device, QpAttr, QpType, SendWr, Status};
//!
//! # fn main() -> efa::Result<()> {
//! let dir = std::env::temp_dir();
//! let dev = ShmDevice::open(ShmConfig::in_dir(dir).with_mtu(4096))?;
//! let mut a = dev.create_qp(QpAttr::new(QpType::Srd))?;
//! let mut b = dev.create_qp(QpAttr::new(QpType::Srd))?;
//! b.post_recv(1, BytesMut::with_capacity(64))?;
//! a.post_send(SendWr {
//!     wr_id: 2,
//!     dest: b.addr(),
//!     hdr: Bytes::from_static(b"hi "),
//!     payload: Bytes::from_static(b"there"),
//!     imm: Some(42),
//! })?;
//! let mut got = Vec::new();
//! let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
//! while got.len() < 2 && std::time::Instant::now() < deadline {
//!     a.poll(&mut got, 8);
//!     b.poll(&mut got, 8);
//! }
//! let recv = got.iter().find(|c| c.wr_id == 1).unwrap();
//! assert_eq!(recv.status, Status::Success);
//! assert_eq!(&recv.buf.as_ref().unwrap()[..], b"hi there");
//! assert_eq!((recv.imm, recv.src.unwrap().qpn), (Some(42), a.addr().qpn));
//! # Ok(()) }
//! ```

pub mod cma;
#[cfg(all(test, loom))]
mod loom_tests;
mod qp;
mod ring;
mod segment;

/// The shm device in the registry: one device, segments in `/dev/shm`.
pub(crate) const PROVIDER: super::registry::Provider = super::registry::Provider {
    kind: crate::device::DeviceKind::Shm,
    discover: |_| super::registry::open_one(super::spec::DeviceSpec::shm()),
};

use std::fmt;
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::time::Duration;

use crate::addr::Gid;
use crate::device::{Device, DeviceAttr, DeviceKind, QpAttr, QueuePair};
use crate::error::{Error, ErrorKind, Result};
use crate::shmem::{dir as shm_dir, map};
use crate::stats::{DeviceCounters, DeviceStats};

/// Smallest MTU the device accepts, bytes.
pub const MIN_MTU: usize = 64;
/// Largest MTU the device accepts, bytes.
pub const MAX_MTU: usize = 1 << 20;
/// Largest queue depth the device accepts.
pub const MAX_QUEUE_DEPTH: usize = 1 << 16;
/// Largest receive ring, slots.
pub const MAX_RING_SLOTS: usize = 1 << 16;
/// Largest segment (header, acknowledgement table and ring), bytes.
pub const MAX_SEGMENT_SIZE: usize = segment::MAX_SEGMENT;
/// Largest inline send the device reports, bytes.
pub const INLINE_SIZE: usize = 32;
/// Longest duration a [`ShmConfig`] field accepts (one day).
pub const MAX_DURATION: Duration = Duration::from_secs(86_400);
/// Name prefix of every file the device creates (`efa-shm-<uid>-<qpn>`).
pub const FILE_PREFIX: &str = segment::PREFIX;

/// Configuration of an [`ShmDevice`].
///
/// ```
/// use efa::device::shm::ShmConfig;
/// let cfg = ShmConfig::default().with_mtu(8192).with_ring_slots(64);
/// assert!(cfg.validate().is_ok());
/// assert!(ShmConfig::default().with_ring_slots(100).validate().is_err());
/// ```
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct ShmConfig {
    /// Largest datagram (header plus payload of one send), bytes; `64..=1 MiB`. Default 64 KiB
    /// (shared memory has no wire limit). Each ring slot holds one datagram of this size.
    pub mtu: usize,
    /// Send queue depth of a queue pair; `1..=65536`. Default 1024.
    pub max_send_wr: usize,
    /// Receive queue depth of a queue pair; `1..=65536`. Default 4096.
    pub max_recv_wr: usize,
    /// Receive ring slots per queue pair, a power of two in `2..=65536`. Default 128. A segment
    /// takes about `ring_slots × (mtu + 64)` bytes, allocated when the queue pair is created.
    pub ring_slots: usize,
    /// Time between two receiver-not-ready retries of an SRD send. Default 100 µs.
    pub rnr_retry_interval: Duration,
    /// How long an SRD send may wait for a live receiver that neither takes it nor reports RNR
    /// (or for room in its ring) before it completes with `UnresponsiveRemote`. Default 5 s.
    /// Dead receivers are noticed sooner, through their lock.
    pub unresponsive_timeout: Duration,
    /// Directory of the segment files (a tmpfs, so they live in memory). Default `/dev/shm`.
    /// Only devices with the same directory reach each other.
    pub dir: PathBuf,
    /// One-sided RDMA read, write and write with immediate data on SRD queue pairs, served by
    /// the target's device without its application (`docs/shm-device.md`). Off: no RDMA, the
    /// protocol engine emulates RMA. Default on.
    pub rdma: bool,
    /// RDMA writes with immediate data consume no receive buffer. Default off.
    pub unsolicited_write_recv: bool,
    /// Serve RDMA reads between processes with cross-memory attach where the kernel permits it
    /// (the initiator copies the target's bytes with one `process_vm_readv`; see
    /// `docs/shm-device.md`, "RDMA"); else, and when off, reads come back in chunks through
    /// the rings. Default on.
    pub cma: bool,
}

with_setters! {
    ShmConfig {
        with_mtu => mtu: usize,
        with_max_send_wr => max_send_wr: usize,
        with_max_recv_wr => max_recv_wr: usize,
        with_ring_slots => ring_slots: usize,
        with_rnr_retry_interval => rnr_retry_interval: Duration,
        with_unresponsive_timeout => unresponsive_timeout: Duration,
        with_rdma => rdma: bool,
        with_unsolicited_write_recv => unsolicited_write_recv: bool,
        with_cma => cma: bool,
    }
    into {
        with_dir => dir: PathBuf,
    }
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            mtu: 64 << 10,
            max_send_wr: 1024,
            max_recv_wr: 4096,
            ring_slots: 128,
            rnr_retry_interval: Duration::from_micros(100),
            unresponsive_timeout: Duration::from_secs(5),
            dir: PathBuf::from("/dev/shm"),
            rdma: true,
            unsolicited_write_recv: false,
            cma: true,
        }
    }
}

impl ShmConfig {
    /// The defaults with another directory.
    pub fn in_dir(dir: impl Into<PathBuf>) -> ShmConfig {
        ShmConfig {
            dir: dir.into(),
            ..ShmConfig::default()
        }
    }

    /// Checks every field; errors are `ErrorKind::InvalidArgument`.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::new(ErrorKind::InvalidArgument, "shm_config").with_detail(detail))
        };
        let depths = (self.max_send_wr, self.max_recv_wr);
        let mtus = MIN_MTU..=MAX_MTU;
        crate::device::check_limits("shm_config", self.mtu, mtus, depths, MAX_QUEUE_DEPTH)?;
        if !(2..=MAX_RING_SLOTS).contains(&self.ring_slots) || !self.ring_slots.is_power_of_two() {
            return bad(format!(
                "ring_slots {} is not a power of two in 2..={MAX_RING_SLOTS}",
                self.ring_slots
            ));
        }
        if self
            .geometry(crate::device::QpType::Srd, self.max_send_wr)
            .is_none()
        {
            return bad(format!(
                "a segment of {} slots of mtu {} exceeds {MAX_SEGMENT_SIZE} bytes",
                self.ring_slots, self.mtu
            ));
        }
        for (name, d) in [
            ("rnr_retry_interval", self.rnr_retry_interval),
            ("unresponsive_timeout", self.unresponsive_timeout),
        ] {
            if d.is_zero() {
                return bad(format!("{name} must not be zero"));
            }
            if d > MAX_DURATION {
                return bad(format!("{name} {d:?} longer than {MAX_DURATION:?}"));
            }
        }
        if self.dir.as_os_str().is_empty() {
            return bad("dir must not be empty".into());
        }
        Ok(())
    }

    fn geometry(&self, t: crate::device::QpType, acks: usize) -> Option<segment::Geometry> {
        segment::Geometry::new(
            t,
            u32::try_from(self.ring_slots).ok()?,
            u32::try_from(self.mtu).ok()?,
            u32::try_from(acks).ok()?,
        )
    }
}

/// 32-bit FNV-1a.
fn fnv32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// The identity of this kernel: its boot id (or, lacking it, the host name).
fn host_identity() -> String {
    [
        "/proc/sys/kernel/random/boot_id",
        "/proc/sys/kernel/hostname",
        "/etc/hostname",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .map(|s| s.trim().to_string())
    .unwrap_or_default()
}

/// The GID of a device of user `uid` on directory `dir`: `fd00:5:<boot>:<uid>:<dir>`.
fn device_gid(uid: u32, dir: &Path) -> Gid {
    use std::os::unix::ffi::OsStrExt;
    let mut g = [0u8; 16];
    g[..4].copy_from_slice(&[0xfd, 0x00, 0x00, 0x05]);
    g[4..8].copy_from_slice(&fnv32(host_identity().as_bytes()).to_be_bytes());
    g[8..12].copy_from_slice(&uid.to_be_bytes());
    g[12..16].copy_from_slice(&fnv32(dir.as_os_str().as_bytes()).to_be_bytes());
    Gid(g)
}

/// What queue pairs share with their device.
pub(crate) struct DevShared {
    pub cfg: ShmConfig,
    /// The canonical directory.
    pub dir: PathBuf,
    pub uid: u32,
    pub gid: Gid,
    pub counters: DeviceCounters,
    /// Registered regions (`None` without RDMA).
    pub keys: Option<crate::device::soft_rdma::KeyTable>,
    /// A random value at a fixed address of this process: a peer granted a direct (CMA) read
    /// reads it first to make sure the pid it has is this process (pid namespaces, reuse).
    pub cookie: Box<u64>,
}

/// The shared-memory software device. Open it with [`ShmDevice::open`].
pub struct ShmDevice {
    attr: DeviceAttr,
    shared: Arc<DevShared>,
}

impl ShmDevice {
    /// Validates `cfg`, checks its directory, removes the stale files dead processes left there
    /// (see [`ShmDevice::sweep`]) and opens the device (segments are created per queue pair).
    pub fn open(cfg: ShmConfig) -> Result<Arc<ShmDevice>> {
        cfg.validate()?;
        let dir = std::fs::canonicalize(&cfg.dir).map_err(|e| {
            Error::io("shm_open", e).with_detail(format!("directory {}", cfg.dir.display()))
        })?;
        if !dir.is_dir() {
            return Err(Error::new(ErrorKind::InvalidArgument, "shm_open")
                .with_detail(format!("{} is not a directory", dir.display())));
        }
        let uid = map::uid();
        let swept = shm_dir::sweep_all(&dir, uid);
        if swept > 0 {
            tracing::info!(dir = %dir.display(), swept, "shm: removed stale segments of dead processes");
        }
        let gid = device_gid(uid, &dir);
        let attr = DeviceAttr::software(
            DeviceKind::Shm,
            "shm".to_string(),
            gid,
            cfg.mtu,
            cfg.max_send_wr,
            cfg.max_recv_wr,
        );
        debug_assert_eq!(attr.inline_size, INLINE_SIZE);
        let attr = attr.with_soft_rdma(cfg.rdma, cfg.unsolicited_write_recv, 1 << 30);
        let keys = cfg.rdma.then(crate::device::soft_rdma::KeyTable::default);
        tracing::debug!(%gid, dir = %dir.display(), "shm device opened");
        Ok(Arc::new(ShmDevice {
            attr,
            shared: Arc::new(DevShared {
                cfg,
                dir,
                uid,
                gid,
                counters: DeviceCounters::default(),
                keys,
                cookie: Box::new(
                    u64::from(crate::device::random_qkey()) << 32
                        | u64::from(crate::device::random_qkey())
                        | 1,
                ),
            }),
        }))
    }

    /// The configuration the device was opened with.
    pub fn config(&self) -> &ShmConfig {
        &self.shared.cfg
    }

    /// The directory of the segment files (canonical).
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The path of the segment file of queue pair `qpn` on this device's directory.
    pub fn segment_path(&self, qpn: u16) -> PathBuf {
        self.shared
            .dir
            .join(segment::seg_name(self.shared.uid, qpn))
    }

    /// Removes this user's stale files from the directory: segments, RDM endpoints' message
    /// channels and routing entries no live process holds (its owner died without closing) and
    /// half-created files of processes that no longer exist. Returns how many it removed.
    /// [`ShmDevice::open`] does this once.
    pub fn sweep(&self) -> usize {
        shm_dir::sweep_all(&self.shared.dir, self.shared.uid)
    }
}

impl fmt::Debug for ShmDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmDevice")
            .field("gid", &self.attr.gid)
            .field("dir", &self.shared.dir)
            .finish()
    }
}

impl Device for ShmDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn create_qp(&self, attr: QpAttr) -> Result<Box<dyn QueuePair>> {
        Ok(Box::new(qp::ShmQp::create(&self.shared, attr)?))
    }

    fn stats(&self) -> DeviceStats {
        self.shared.counters.snapshot()
    }

    fn local_dir(&self) -> Option<&Path> {
        Some(&self.shared.dir)
    }

    fn register_mem(
        &self,
        mem: &Arc<crate::mem::RegionMem>,
        access: crate::mem::Access,
    ) -> Result<Option<u64>> {
        let key = self
            .shared
            .keys
            .as_ref()
            .map(|k| k.lock().register(mem, access));
        if key.is_some() {
            crate::stats::inc(&self.shared.counters.mem_registrations);
        }
        Ok(key)
    }

    fn deregister_mem(&self, key: u64) {
        if let Some(k) = &self.shared.keys {
            k.lock().deregister(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        assert!(ShmConfig::default().validate().is_ok());
        for mtu in [0, 63, MAX_MTU + 1] {
            let e = ShmConfig {
                mtu,
                ..Default::default()
            }
            .validate()
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        }
        for ring_slots in [0, 1, 3, 100, MAX_RING_SLOTS * 2] {
            assert!(
                ShmConfig {
                    ring_slots,
                    ..Default::default()
                }
                .validate()
                .is_err(),
                "{ring_slots}"
            );
        }
        // 65536 slots of 1 MiB exceed the segment limit.
        assert!(
            ShmConfig {
                ring_slots: 1 << 16,
                mtu: MAX_MTU,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            ShmConfig {
                unresponsive_timeout: Duration::ZERO,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn config_serde_round_trip() {
        let cfg = ShmConfig::in_dir("/tmp");
        let s = serde_json::to_string(&cfg).unwrap();
        let back: ShmConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(back, cfg);
        let partial: ShmConfig = serde_json::from_str(r#"{"mtu": 1500}"#).unwrap();
        assert_eq!(partial.mtu, 1500);
        assert_eq!(partial.dir, PathBuf::from("/dev/shm"));
    }

    #[test]
    fn gid_names_host_user_and_dir() {
        let a = device_gid(1000, Path::new("/dev/shm"));
        let b = device_gid(1001, Path::new("/dev/shm"));
        let c = device_gid(1000, Path::new("/tmp"));
        assert_eq!(&a.0[..4], &[0xfd, 0, 0, 5]);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_eq!(a, device_gid(1000, Path::new("/dev/shm")));
        assert!(a.to_string().starts_with("fd00:5:"), "{a}");
    }
}
