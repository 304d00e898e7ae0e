//! The `udp` software device: every queue pair is one UDP socket, so it works across hosts.
//!
//! * The QPN of a queue pair is its socket's local port, and its GID is the device's bind address,
//!   so a [`RawAddr`](crate::RawAddr) names a socket: datagrams for `dest` go to
//!   `(dest.gid.to_ip(), dest.qpn)`.
//! * [`QpType::Ud`](crate::device::QpType::Ud) queue pairs send each datagram once, with a small header (magic, version,
//!   type, flags, destination QKEY, optional immediate data).
//! * [`QpType::Srd`](crate::device::QpType::Srd) queue pairs add reliability in the manner of EFA's SRD: per-peer sequence
//!   numbers, cumulative plus selective acknowledgements, retransmission with exponential backoff,
//!   duplicate suppression, receiver-not-ready NAKs with retries and an unresponsive-peer timeout.
//!   Delivery is exactly once, in any order.
//! * A background thread per queue pair (the "NIC") receives, acknowledges and retransmits even
//!   while the application does not poll; [`QueuePair::poll`] makes progress too, and while the
//!   application busy-polls, all of it happens on the polling thread and the NIC thread stands
//!   aside (it takes over when the application sleeps on its notifier or stops polling).
//! * Seeded fault injection ([`UdpConfig::faults`]) drops, duplicates, reorders and delays every
//!   datagram the device puts on the wire.
//!
//! The wire format and the protocol rules are in `docs/udp-device.md`.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use efa::device::{Device, QpAttr, QpType, SendWr, Status};
//! use efa::device::udp::{UdpConfig, UdpDevice};
//!
//! # fn main() -> efa::Result<()> {
//! let dev = UdpDevice::open(UdpConfig::default())?;
//! let mut a = dev.create_qp(QpAttr::new(QpType::Srd))?;
//! let mut b = dev.create_qp(QpAttr::new(QpType::Srd))?;
//! b.post_recv(1, BytesMut::with_capacity(64))?;
//! a.post_send(SendWr {
//!     wr_id: 2,
//!     dest: b.addr(),
//!     hdr: Bytes::new(),
//!     payload: Bytes::from_static(b"hello"),
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
//! assert_eq!(&recv.buf.as_ref().unwrap()[..], b"hello");
//! assert_eq!(recv.imm, Some(42));
//! # Ok(()) }
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::addr::Gid;
use crate::device::{Device, DeviceAttr, DeviceKind, QpAttr, QueuePair};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::FaultConfig;
use crate::stats::{DeviceCounters, DeviceStats};

mod link;
mod mmsg;
mod qp;
#[cfg(test)]
mod sim;
mod srd;
mod wire;

/// The udp device in the registry: one device, bound to the hints' address (loopback by
/// default).
pub(crate) const PROVIDER: super::registry::Provider = super::registry::Provider {
    kind: crate::device::DeviceKind::Udp,
    discover: |q| super::registry::open_one(super::spec::DeviceSpec::udp(q.bind)),
};

/// Smallest MTU the device accepts.
pub const MIN_MTU: usize = 64;
/// Largest MTU the device accepts (a UDP datagram holds at most 65,507 bytes over IPv4, and the
/// device adds at most 48 bytes of header).
pub const MAX_MTU: usize = 65_000;
/// The MTU an automatic (`0`) [`UdpConfig::mtu`] becomes on a loopback bind address: the
/// loopback interface carries 64 KiB datagrams without fragmentation, and fewer, larger
/// datagrams mean fewer system calls per byte (see `docs/udp-device.md`, "Fast path").
pub const LOOPBACK_MTU: usize = MAX_MTU;
/// The MTU an automatic (`0`) [`UdpConfig::mtu`] becomes on any other bind address (as an EFA
/// NIC's, about 8 KiB; larger datagrams are IP-fragmented on real networks).
pub const NETWORK_MTU: usize = 8192;
/// Largest inline send the device reports.
pub const INLINE_SIZE: usize = 32;
/// Most SRD packets a sender may have outstanding towards one peer (the receiver's window).
pub const MAX_INFLIGHT: usize = wire::WINDOW as usize;

/// Largest single RDMA read or write the device reports (1 GiB, as EFA).
pub const MAX_RDMA_SIZE: u64 = 1 << 30;

/// Longest duration any [`UdpConfig`] field accepts (one day).
pub const MAX_DURATION: Duration = Duration::from_secs(86_400);

/// Who may reach a registration by RDMA (see [`UdpDevice::set_rdma_admission`]): `(key,
/// initiator GID)` → allowed. A hook of the emulated EFA NIC (feature `emu-hooks`).
#[cfg(any(test, feature = "emu-hooks"))]
pub type RdmaAdmit = crate::device::soft_rdma::Admit;

/// Configuration of a [`UdpDevice`].
///
/// ```
/// use efa::device::udp::UdpConfig;
/// let cfg = UdpConfig::new("::1".parse().unwrap()).with_mtu(4096);
/// assert!(cfg.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct UdpConfig {
    /// Address every queue pair's socket binds to (port 0: ephemeral). IPv4 or IPv6; an
    /// unspecified address (`0.0.0.0`, `::`) listens on every interface. Default `127.0.0.1`.
    pub bind: IpAddr,
    /// Largest datagram (header plus payload of one send), bytes; `64..=65_000`, or `0` (the
    /// default) for automatic: [`LOOPBACK_MTU`] (65,000) when `bind` is a loopback address,
    /// else [`NETWORK_MTU`] (8192). [`UdpDevice::config`] shows the value in use.
    pub mtu: usize,
    /// Send queue depth of a queue pair. Default 1024.
    pub max_send_wr: usize,
    /// Receive queue depth of a queue pair. Default 4096.
    pub max_recv_wr: usize,
    /// Faults injected into every datagram the device sends (data, acks and NAKs). Default none.
    pub faults: FaultConfig,
    /// Initial SRD retransmission timeout; it doubles per retransmission of a packet up to
    /// `max_retransmit_timeout`, and grows with the measured round-trip time. Default 300 µs.
    pub retransmit_timeout: Duration,
    /// Cap of the SRD retransmission timeout. Default 50 ms.
    pub max_retransmit_timeout: Duration,
    /// Time without any acknowledgement from a peer after which every outstanding SRD send to it
    /// completes with `Status::UnresponsiveRemote`. Default 5 s.
    pub unresponsive_timeout: Duration,
    /// Wait before re-sending a packet refused with an RNR NAK; doubles per RNR retry of the
    /// packet up to `max_rnr_retry_interval`. Default 100 µs.
    pub rnr_retry_interval: Duration,
    /// Cap of the RNR retry interval. Default 10 ms.
    pub max_rnr_retry_interval: Duration,
    /// Most SRD packets outstanding towards one peer (the congestion window never exceeds it);
    /// `1..=1024`. Default 256.
    pub max_inflight: usize,
    /// Requested socket send and receive buffer size, bytes (the kernel may cap it); 0 keeps the
    /// system default. Default 4 MiB.
    pub socket_buffer: usize,
    /// Per-peer SRD state unused for this long is forgotten. Must exceed
    /// `unresponsive_timeout`. Default 60 s.
    pub peer_idle_timeout: Duration,
    /// One-sided RDMA read, write and write with immediate data on SRD queue pairs (served by
    /// the target's device, without its application; `docs/udp-device.md`). Off: the device
    /// offers no RDMA and the protocol engine emulates RMA. Default on.
    pub rdma: bool,
    /// RDMA writes with immediate data complete at the target without consuming a posted
    /// receive buffer (`UNSOLICITED_WR_ID`). Default off.
    pub unsolicited_write_recv: bool,
    /// UDP segmentation offload where the kernel has it: a run of equal-sized datagrams to one
    /// peer leaves in one GSO message (`UDP_SEGMENT`), and coalesced datagrams are taken in one
    /// read (`UDP_GRO`), so a burst crosses the network stack once instead of once per
    /// datagram. Default off: on loopback it made `examples/batch` slower (0.5–0.94x against
    /// 1.43–1.48x with plain `sendmmsg`), as whole bursts landing at once drive the receiver
    /// into receiver-not-ready storms (`docs/udp-device.md`, "Batched I/O").
    pub gso: bool,
    /// Pack small SRD packets (data, acknowledgements, NAKs) to one queue pair into one UDP
    /// datagram where they fit in the MTU, as QUIC coalesces packets (RFC 9000 §12.2): a post
    /// list of small sends or writes to one peer then costs the kernel one datagram instead of
    /// one per packet. Only towards peers that said they unpack (negotiated per peer,
    /// `docs/udp-device.md`, "Packed datagrams"); every queue pair unpacks whatever this is.
    /// Default on.
    pub pack: bool,
}

with_setters! {
    UdpConfig {
        with_bind => bind: IpAddr,
        with_mtu => mtu: usize,
        with_max_send_wr => max_send_wr: usize,
        with_max_recv_wr => max_recv_wr: usize,
        with_faults => faults: FaultConfig,
        with_retransmit_timeout => retransmit_timeout: Duration,
        with_max_retransmit_timeout => max_retransmit_timeout: Duration,
        with_unresponsive_timeout => unresponsive_timeout: Duration,
        with_rnr_retry_interval => rnr_retry_interval: Duration,
        with_max_rnr_retry_interval => max_rnr_retry_interval: Duration,
        with_max_inflight => max_inflight: usize,
        with_socket_buffer => socket_buffer: usize,
        with_peer_idle_timeout => peer_idle_timeout: Duration,
        with_rdma => rdma: bool,
        with_unsolicited_write_recv => unsolicited_write_recv: bool,
        with_gso => gso: bool,
        with_pack => pack: bool,
    }
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            mtu: 0,
            max_send_wr: 1024,
            max_recv_wr: 4096,
            faults: FaultConfig::default(),
            retransmit_timeout: Duration::from_micros(300),
            max_retransmit_timeout: Duration::from_millis(50),
            unresponsive_timeout: Duration::from_secs(5),
            rnr_retry_interval: Duration::from_micros(100),
            max_rnr_retry_interval: Duration::from_millis(10),
            max_inflight: 256,
            socket_buffer: 4 << 20,
            peer_idle_timeout: Duration::from_secs(60),
            rdma: true,
            unsolicited_write_recv: false,
            gso: false,
            pack: true,
        }
    }
}

impl UdpConfig {
    /// The defaults with another bind address.
    pub fn new(bind: IpAddr) -> UdpConfig {
        UdpConfig {
            bind,
            ..UdpConfig::default()
        }
    }

    /// The MTU in use: `mtu`, or for `0` the automatic choice by bind address.
    pub fn effective_mtu(&self) -> usize {
        match self.mtu {
            0 if self.bind.is_loopback() => LOOPBACK_MTU,
            0 => NETWORK_MTU,
            m => m,
        }
    }

    /// Checks every field; errors are `ErrorKind::InvalidArgument`.
    pub fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::new(ErrorKind::InvalidArgument, "udp_config").with_detail(detail))
        };
        if self.mtu != 0 && !(MIN_MTU..=MAX_MTU).contains(&self.mtu) {
            return bad(format!("mtu {} outside {MIN_MTU}..={MAX_MTU}", self.mtu));
        }
        if self.max_send_wr == 0 || self.max_recv_wr == 0 {
            return bad("queue depths must be at least 1".into());
        }
        if !(1..=MAX_INFLIGHT).contains(&self.max_inflight) {
            return bad(format!(
                "max_inflight {} outside 1..={MAX_INFLIGHT}",
                self.max_inflight
            ));
        }
        for (name, d, may_be_zero) in [
            ("retransmit_timeout", self.retransmit_timeout, false),
            ("max_retransmit_timeout", self.max_retransmit_timeout, false),
            ("unresponsive_timeout", self.unresponsive_timeout, false),
            ("rnr_retry_interval", self.rnr_retry_interval, false),
            ("max_rnr_retry_interval", self.max_rnr_retry_interval, false),
            ("peer_idle_timeout", self.peer_idle_timeout, true),
            ("faults.max_delay", self.faults.max_delay, true),
        ] {
            if d.is_zero() && !may_be_zero {
                return bad(format!("{name} must not be zero"));
            }
            if d > MAX_DURATION {
                return bad(format!("{name} {d:?} longer than {MAX_DURATION:?}"));
            }
        }
        if self.max_retransmit_timeout < self.retransmit_timeout {
            return bad("max_retransmit_timeout below retransmit_timeout".into());
        }
        if self.max_rnr_retry_interval < self.rnr_retry_interval {
            return bad("max_rnr_retry_interval below rnr_retry_interval".into());
        }
        if self.peer_idle_timeout <= self.unresponsive_timeout {
            return bad("peer_idle_timeout must exceed unresponsive_timeout".into());
        }
        self.faults.validate().map_err(|e| {
            Error::new(ErrorKind::InvalidArgument, "udp_config").with_detail(e.to_string())
        })
    }
}

/// The udp software device. Open it with [`UdpDevice::open`]; every queue pair is one UDP socket
/// bound to an ephemeral port of [`UdpConfig::bind`].
#[derive(Debug)]
pub struct UdpDevice {
    cfg: Arc<UdpConfig>,
    attr: DeviceAttr,
    counters: Arc<DeviceCounters>,
    /// Registered regions (`None` without RDMA).
    keys: Option<crate::device::soft_rdma::KeyTable>,
}

impl UdpDevice {
    /// Validates `cfg` and opens the device (sockets are created per queue pair). An automatic
    /// MTU is resolved here.
    pub fn open(mut cfg: UdpConfig) -> Result<Arc<UdpDevice>> {
        cfg.validate()?;
        cfg.mtu = cfg.effective_mtu();
        let attr = DeviceAttr::software(
            DeviceKind::Udp,
            format!("udp-{}", cfg.bind),
            Gid::from_ip(cfg.bind),
            cfg.mtu,
            cfg.max_send_wr,
            cfg.max_recv_wr,
        );
        debug_assert_eq!(attr.inline_size, INLINE_SIZE);
        let mut attr = attr.with_soft_rdma(cfg.rdma, cfg.unsolicited_write_recv, MAX_RDMA_SIZE);
        // Peers on this host are reached over shared memory, as the efa device's are.
        attr.policy.same_host_route = true;
        let keys = cfg.rdma.then(crate::device::soft_rdma::KeyTable::default);
        Ok(Arc::new(UdpDevice {
            cfg: Arc::new(cfg),
            attr,
            counters: Arc::new(DeviceCounters::default()),
            keys,
        }))
    }

    /// The configuration the device was opened with (an automatic MTU resolved).
    pub fn config(&self) -> &UdpConfig {
        &self.cfg
    }

    /// Sets who may reach this device's registrations by RDMA: `admit(key, initiator GID)`;
    /// refused accesses complete at the initiator with `UnknownPeer` (EFA status 14). For an
    /// emulated EFA NIC, which refuses initiators the key's protection domain holds no address
    /// handle for. `None` (the default) admits everyone. Without RDMA, nothing happens. A hook
    /// of the emulated EFA NIC (feature `emu-hooks`), not for applications.
    #[cfg(any(test, feature = "emu-hooks"))]
    pub fn set_rdma_admission(&self, admit: Option<RdmaAdmit>) {
        if let Some(keys) = &self.keys {
            keys.lock().set_admit(admit);
        }
    }

    /// Registers `mem` for one-sided RDMA under `key`, a key the caller chose instead of one
    /// [`Device::register_mem`] would make up: for an emulated NIC that hands out keys of its
    /// own (EFA's are 32 bits). Revoke it with [`Device::deregister_mem`]. `NotSupported`
    /// without RDMA ([`UdpConfig::rdma`]), `InvalidArgument` when `key` is live. A hook of the
    /// emulated EFA NIC (feature `emu-hooks`), not for applications.
    #[cfg(any(test, feature = "emu-hooks"))]
    pub fn register_mem_as(
        &self,
        mem: &Arc<crate::mem::RegionMem>,
        access: crate::mem::Access,
        key: u64,
    ) -> Result<()> {
        let Some(keys) = &self.keys else {
            return Err(Error::new(ErrorKind::NotSupported, "register_mem_as")
                .with_detail("the device was opened without RDMA"));
        };
        if keys.lock().register_as(mem, access, key) {
            Ok(())
        } else {
            Err(Error::new(ErrorKind::InvalidArgument, "register_mem_as")
                .with_detail(format!("key {key:#x} is in use")))
        }
    }
}

impl Device for UdpDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn create_qp(&self, attr: QpAttr) -> Result<Box<dyn QueuePair>> {
        Ok(Box::new(qp::UdpQp::create(
            self.cfg.clone(),
            self.counters.clone(),
            attr,
            self.keys.clone(),
        )?))
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot()
    }

    fn register_mem(
        &self,
        mem: &Arc<crate::mem::RegionMem>,
        access: crate::mem::Access,
    ) -> Result<Option<u64>> {
        let key = self.keys.as_ref().map(|k| k.lock().register(mem, access));
        if key.is_some() {
            crate::stats::inc(&self.counters.mem_registrations);
        }
        Ok(key)
    }

    fn deregister_mem(&self, key: u64) {
        if let Some(k) = &self.keys {
            k.lock().deregister(key);
        }
    }
}

/// The socket address a raw destination names, for a socket of the given family.
fn sockaddr_for(gid: &Gid, qpn: u16, v6_socket: bool) -> SocketAddr {
    let ip = match (gid.to_ip(), v6_socket) {
        (IpAddr::V4(v4), true) => IpAddr::V6(v4.to_ipv6_mapped()),
        (ip, _) => ip,
    };
    SocketAddr::new(ip, qpn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        assert!(UdpConfig::default().validate().is_ok());
        assert_eq!(UdpConfig::default().effective_mtu(), LOOPBACK_MTU);
        assert_eq!(
            UdpConfig::new("::1".parse().unwrap()).effective_mtu(),
            LOOPBACK_MTU
        );
        for bind in ["10.1.2.3", "0.0.0.0", "::"] {
            assert_eq!(
                UdpConfig::new(bind.parse().unwrap()).effective_mtu(),
                NETWORK_MTU
            );
        }
        let fixed = UdpConfig {
            mtu: 1500,
            ..Default::default()
        };
        assert_eq!(fixed.effective_mtu(), 1500);
        for mtu in [1, 63, 65_001] {
            let e = UdpConfig {
                mtu,
                ..Default::default()
            }
            .validate()
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        }
        let e = UdpConfig {
            faults: FaultConfig::seeded(1).drop(2.0),
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(
            UdpConfig {
                max_inflight: 0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }

    #[test]
    fn config_serde_round_trip() {
        let cfg = UdpConfig::new("::1".parse().unwrap());
        let s = serde_json::to_string(&cfg).unwrap();
        let back: UdpConfig = serde_json::from_str(&s).unwrap();
        assert_eq!(back, cfg);
        let partial: UdpConfig = serde_json::from_str(r#"{"mtu": 1500}"#).unwrap();
        assert_eq!(partial.mtu, 1500);
        assert_eq!(partial.bind, UdpConfig::default().bind);
    }

    #[test]
    fn sockaddr_mapping() {
        let g = Gid::from_ip("10.1.2.3".parse().unwrap());
        assert_eq!(sockaddr_for(&g, 5, false).to_string(), "10.1.2.3:5");
        assert_eq!(sockaddr_for(&g, 5, true).to_string(), "[::ffff:10.1.2.3]:5");
        let g6 = Gid::from_ip("::1".parse().unwrap());
        assert_eq!(sockaddr_for(&g6, 7, true).to_string(), "[::1]:7");
    }
}
