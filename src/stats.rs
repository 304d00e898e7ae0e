//! Counters per device and per endpoint. Counting is a relaxed atomic add; a snapshot is a plain
//! struct that serializes with serde.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($(#[$m:meta])* $snap:ident, $atomic:ident { $($(#[$fm:meta])* $f:ident),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        #[non_exhaustive]
        pub struct $snap {
            $($(#[$fm])* pub $f: u64,)*
        }

        #[doc = concat!("The live, atomically updated form of [`", stringify!($snap), "`].")]
        #[derive(Debug, Default)]
        pub struct $atomic {
            $($(#[$fm])* pub $f: AtomicU64,)*
        }

        impl $atomic {
            /// A consistent-enough copy of every counter.
            pub fn snapshot(&self) -> $snap {
                $snap { $($f: self.$f.load(Ordering::Relaxed),)* }
            }
        }

        impl std::ops::AddAssign for $snap {
            fn add_assign(&mut self, o: $snap) {
                $(self.$f += o.$f;)*
            }
        }
    };
}

/// Adds `n` to a counter.
#[inline]
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Adds one to a counter.
#[inline]
pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

counters!(
    /// Counters of a device (all its queue pairs).
    DeviceStats, DeviceCounters {
        /// Datagrams handed to the wire (first transmissions).
        tx_pkts,
        /// Payload bytes of those datagrams.
        tx_bytes,
        /// Datagrams delivered into posted receive buffers.
        rx_pkts,
        /// Payload bytes delivered.
        rx_bytes,
        /// Retransmissions (SRD mode).
        retransmits,
        /// Acknowledgements sent (SRD mode).
        acks_sent,
        /// Duplicate datagrams suppressed (SRD mode).
        duplicates_dropped,
        /// Malformed or foreign datagrams dropped.
        malformed_dropped,
        /// Datagrams dropped because their QKEY did not match the receiving queue pair (stale peer).
        stale_dropped,
        /// Datagrams dropped for lack of a posted receive buffer (UD mode) or refused with RNR (SRD).
        rnr_events,
        /// RNR negative acknowledgements received (SRD mode).
        rnr_naks_received,
        /// Sends completed with an error status.
        send_errors,
        /// Datagrams dropped by fault injection.
        faults_dropped,
        /// Datagrams duplicated by fault injection.
        faults_duplicated,
        /// Datagrams reordered or delayed by fault injection.
        faults_reordered,
        /// One-sided RDMA operations served by the device.
        rdma_ops,
        /// Bytes moved by one-sided RDMA.
        rdma_bytes,
        /// Datagrams a routing device ([`RoutedDevice`](crate::device::route::RoutedDevice),
        /// `FI_EFA_ENABLE_SHM_TRANSFER`) sent over its shm path to a peer on this host; 0 on
        /// every other device.
        shm_route_tx_pkts,
        /// Bytes of those datagrams (without the routing header).
        shm_route_tx_bytes,
        /// Datagrams a routing device received over its shm path.
        shm_route_rx_pkts,
        /// Bytes of those datagrams (without the routing header).
        shm_route_rx_bytes,
        /// System calls that sent several datagrams at once (`sendmmsg`: post lists, bursts of
        /// acknowledgements; udp device), or doorbells rung for lists of several work requests
        /// (one `ibv_wr_start` .. `ibv_wr_complete` session; efa device).
        tx_batches,
        /// System calls that read several datagrams at once (`recvmmsg`; udp device).
        rx_batches,
        /// Reads of a socket that found it empty (udp device): what waiting costs in system
        /// calls. A queue pair with nothing in flight and no datagram for 200 µs is read only
        /// every 5 µs and every 16th poll (docs/udp-device.md).
        rx_empty_reads,
        /// Bytes of bounce pools on huge pages (`FI_EFA_USE_HUGE_PAGE`; efa device).
        huge_page_bytes,
        /// Bounce pools that asked for huge pages and got ordinary ones (none reserved,
        /// `vm.nr_hugepages`); efa device.
        huge_page_fallbacks,
        /// Memory registrations made for the local buffer of one RDMA operation (efa device):
        /// reads into `BytesMut`, and writes from `Bytes` the MR cache did not hold. RDMA to
        /// and from device-registered regions needs none.
        mr_registrations,
        /// RDMA writes whose buffer's registration came from the MR cache (efa device,
        /// `FI_EFA_MR_CACHE_ENABLE`).
        mr_cache_hits,
        /// dmabuf regions registered with the NIC as dmabufs (`ibv_reg_dmabuf_mr`; efa device).
        dmabuf_registrations,
        /// dmabuf regions the NIC refused (`ibv_reg_dmabuf_mr` takes only a real dma-buf, with a
        /// peer-to-peer path to its memory): served through their CPU mapping with emulated RMA
        /// instead, and said once each with a warning (efa device).
        dmabuf_fallbacks,
        /// Regions the device registered for one-sided RDMA (`Device::register_mem`): one per
        /// `Domain::register`, however many slices of it operations use.
        mem_registrations,
        /// Registrations the NIC refused to release (`ibv_dereg_mr` failed; efa device): the
        /// memory each covers is leaked, never freed, reused or handed back (a region's
        /// `close` gives an empty buffer), since the NIC may still use it.
        dereg_failures,
        /// UDP datagrams handed to the socket, of every kind (data, retransmissions, acks,
        /// NAKs), a packed one once (udp device). Beside `tx_pkts` it shows how many SRD
        /// packets shared a datagram.
        tx_datagrams,
        /// UDP datagrams taken from the socket (udp device), a packed one once.
        rx_datagrams,
        /// Transmissions of SRD packets (data, retransmissions, acks) that left packed with
        /// others in one datagram (udp device, `UdpConfig::pack`).
        tx_packed,
        /// SRD packets that arrived packed with others in one datagram (udp device).
        rx_packed,
    }
);

counters!(
    /// Counters of one endpoint.
    EndpointStats, EndpointCounters {
        /// Messages sent (completed successfully).
        tx_msgs,
        /// Bytes sent.
        tx_bytes,
        /// Messages received.
        rx_msgs,
        /// Bytes received.
        rx_bytes,
        /// Operations completed with an error.
        errors,
        /// Operations refused with `Again`.
        again,
        /// Receive operations cancelled or flushed.
        canceled,
        /// Received datagrams longer than the posted buffer (truncated).
        truncated,
        /// Packets retransmitted by the protocol engine.
        retransmits,
        /// Receiver-not-ready events seen by the protocol engine.
        rnr,
        /// Messages that arrived before a matching receive was posted.
        unexpected_msgs,
        /// Packets held in the reorder buffer.
        reorder_buffered,
        /// Malformed, stale or duplicate packets dropped by the protocol engine.
        dropped_pkts,
        /// Bytes moved by device RDMA.
        device_rma_bytes,
        /// Bytes moved by emulated RMA protocols.
        emulated_rma_bytes,
        /// Messages sent to peers on this host through the local fast path (also in `tx_msgs`).
        local_tx_msgs,
        /// Messages received through the local fast path (also in `rx_msgs`).
        local_rx_msgs,
    }
);
