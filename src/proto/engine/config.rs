//! The engine's parameters: what the configuration and the device give it (`EngineConfig`,
//! `EngineSizes`) and the bounds on what peers can make it hold (`EngineLimits`).

use std::time::Duration;

#[cfg(doc)]
use super::Engine;

/// Engine parameters (from [`crate::Config`] and the device attributes).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Largest datagram the device sends (header + payload).
    pub mtu: usize,
    /// Send-queue depth of the device queue pair: the engine never has more packets outstanding.
    pub max_outstanding_tx: usize,
    /// Largest number of application send operations in flight (`tx_size`); more is `Again`.
    pub max_tx_ops: usize,
    /// Largest number of posted receives (`rx_size`); more is `Again`.
    pub max_rx_ops: usize,
    /// `FI_EFA_RECVWIN_SIZE`: reorder window (power of two).
    pub recvwin_size: usize,
    /// `FI_EFA_TX_MIN_CREDITS`: packets per CTS window.
    pub tx_min_credits: usize,
    /// `FI_EFA_INTER_MAX_MEDIUM_MESSAGE_SIZE`: largest medium message; above it long-CTS.
    pub max_medium_msg_size: usize,
    /// `FI_EFA_TIMEOUT_INTERVAL`: first RNR backoff (zero: random 40..120 µs, as libfabric).
    pub timeout_interval: Duration,
    /// `FI_EFA_MAX_TIMEOUT`: cap of the RNR backoff.
    pub max_timeout: Duration,
    /// A receive that made no progress for this long (its sender vanished mid-message) fails.
    pub rx_stall_timeout: Duration,
    /// Seed of the engine's randomness (backoff jitter).
    pub seed: u64,
    /// This side's device can do one-sided RDMA read and `FI_EFA_USE_DEVICE_RDMA` allows it
    /// (advertised in the handshake; used towards peers that advertise it too).
    pub device_rdma_read: bool,
    /// This side's device can do one-sided RDMA write (and write with immediate data) and the
    /// configuration allows it.
    pub device_rdma_write: bool,
    /// Largest single device RDMA read or write (bytes); larger operations are split.
    pub max_rdma_size: u64,
    /// `FI_EFA_INTER_MIN_READ_WRITE_SIZE`: emulated RMA writes at least this long use
    /// LONGREAD_RTW when RDMA read exists on both sides.
    pub inter_min_read_write_size: usize,
    /// `FI_EFA_INTER_MIN_READ_MESSAGE_SIZE`: messages at least this long use the long-read (or
    /// runting-read) protocol when RDMA read exists on both sides and the buffer is readable.
    pub inter_min_read_message_size: usize,
    /// `FI_EFA_RUNT_SIZE`: bytes a runting read sends eagerly before the receiver reads the rest
    /// (0 disables runting reads).
    pub runt_size: usize,
    /// `FI_EFA_INTER_READ_SEGMENT_SIZE`: largest single read of the read-based protocols.
    pub inter_read_segment_size: usize,
}

/// The queue sizes an endpoint chose: its queue pair's send depth and its operation tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineSizes {
    /// Send-queue depth of the queue pair.
    pub send_depth: usize,
    /// Send operations in flight at most (`tx_size`).
    pub tx_ops: usize,
    /// Posted receives at most (`rx_size`).
    pub rx_ops: usize,
}

impl EngineConfig {
    /// The engine parameters of an endpoint, the one place they are derived: the protocol
    /// variables of `cfg`, the device's MTU, RDMA capabilities (as far as `use_rdma`, the
    /// outcome of `FI_EFA_USE_DEVICE_RDMA`, allows) and largest RDMA, and the queue sizes.
    /// `FI_EFA_TX_QUEUE_SIZE` caps the packets on the device below the send depth.
    ///
    /// ```
    /// use efa::device::{DeviceAttr, DeviceKind};
    /// use efa::proto::engine::{EngineConfig, EngineSizes};
    /// let gid = std::net::Ipv4Addr::LOCALHOST.into();
    /// let attr = DeviceAttr::software(DeviceKind::Udp, "t".into(), gid, 8192, 256, 256);
    /// let cfg = efa::Config::default().with_tx_queue_size(64);
    /// let sizes = EngineSizes { send_depth: 256, tx_ops: 1024, rx_ops: 1024 };
    /// let e = EngineConfig::new(&cfg, &attr, sizes, true, 1);
    /// assert_eq!((e.mtu, e.max_outstanding_tx, e.max_tx_ops), (8192, 64, 1024));
    /// assert_eq!(e.device_rdma_read, attr.caps.rdma_read);
    /// ```
    pub fn new(
        cfg: &crate::config::Config,
        attr: &crate::device::DeviceAttr,
        sizes: EngineSizes,
        use_rdma: bool,
        seed: u64,
    ) -> EngineConfig {
        EngineConfig {
            mtu: attr.mtu,
            max_outstanding_tx: match cfg.tx_queue_size {
                0 => sizes.send_depth,
                n => n.min(sizes.send_depth),
            },
            max_tx_ops: sizes.tx_ops,
            max_rx_ops: sizes.rx_ops,
            recvwin_size: cfg.recvwin_size,
            tx_min_credits: cfg.tx_min_credits as usize,
            max_medium_msg_size: cfg.inter_max_medium_message_size,
            timeout_interval: cfg.timeout_interval,
            max_timeout: cfg.max_timeout,
            rx_stall_timeout: Duration::from_secs(30),
            seed,
            device_rdma_read: use_rdma && attr.caps.rdma_read,
            device_rdma_write: use_rdma && attr.caps.rdma_write,
            max_rdma_size: attr.max_rdma_size,
            inter_min_read_write_size: cfg.inter_min_read_write_size,
            inter_min_read_message_size: cfg.inter_min_read_message_size,
            runt_size: cfg.runt_size,
            inter_read_segment_size: cfg.inter_read_segment_size,
        }
    }
}

/// Bounds on what peers can make the engine hold (an addition to the declared API; see
/// [`Engine::set_limits`]). A REQ from a new peer beyond `max_peers` is dropped and counted. The
/// buffering bounds are kept by the caller, never by dropping what the device delivered (it was
/// acknowledged): the RDM endpoint posts no more device receive buffers than the budget left, so
/// past it senders get receiver-not-ready; a message delivered anyway is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Most peers known at once; a REQ from a new peer beyond it is dropped (and [`Engine::send`]
    /// to a new peer is refused with `NoMemory`).
    pub max_peers: usize,
    /// Most messages held without a receive (waiting in reorder windows, unexpected, claimed).
    pub max_buffered_msgs: usize,
    /// Most bytes copied out for such messages.
    pub max_buffered_bytes: usize,
}

impl Default for EngineLimits {
    /// 65 536 peers, 65 536 messages, 64 MiB.
    fn default() -> Self {
        EngineLimits {
            max_peers: 65_536,
            max_buffered_msgs: 65_536,
            max_buffered_bytes: 64 << 20,
        }
    }
}
