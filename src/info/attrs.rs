//! The attribute groups of an [`Info`] (`fi_tx_attr`, `fi_rx_attr`, `fi_ep_attr`, `fi_domain_attr`).

use super::*;

// Attributes
// ---------------------------------------------------------------------------------------------

/// Transmit attributes (`fi_tx_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct TxAttr {
    /// Capabilities of the transmit side.
    pub caps: Caps,
    /// Outstanding transmit operations before `Again`.
    pub size: usize,
    /// Largest inject (buffer reusable on return), bytes.
    pub inject_size: usize,
    /// Segments per send.
    pub iov_limit: usize,
    /// Remote segments per RMA operation.
    pub rma_iov_limit: usize,
    /// Ordering guarantees.
    pub msg_order: MsgOrder,
    /// Largest message, bytes (same as [`EpAttr::max_msg_size`]).
    pub max_msg_size: u64,
}

/// Receive attributes (`fi_rx_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct RxAttr {
    /// Capabilities of the receive side.
    pub caps: Caps,
    /// Posted receives before `Again`.
    pub size: usize,
    /// Segments per receive.
    pub iov_limit: usize,
    /// Ordering guarantees.
    pub msg_order: MsgOrder,
    /// Bytes buffered for unexpected messages beyond the provider's own (always 0).
    pub total_buffered_recv: usize,
}

/// Endpoint attributes (`fi_ep_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct EpAttr {
    /// Largest message, bytes: unlimited for RDM (`u64::MAX`), one MTU for DGRAM.
    pub max_msg_size: u64,
    /// Bytes the application reserves in front of each DGRAM buffer: 0, or
    /// [`DGRAM_MSG_PREFIX_SIZE`] when the info carries [`Mode::MSG_PREFIX`].
    pub msg_prefix_size: usize,
    /// Tag format: `FI_TAG_GENERIC` (`0xaaaa_aaaa_aaaa_aaaa`) for RDM, 0 without tags.
    pub mem_tag_format: u64,
    /// Transmit contexts per endpoint.
    pub tx_ctx_cnt: usize,
    /// Receive contexts per endpoint.
    pub rx_ctx_cnt: usize,
}

/// Domain attributes (`fi_domain_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct DomainAttr {
    /// Domain name (= [`Info::domain`]).
    pub name: String,
    /// Threading model.
    pub threading: Threading,
    /// Data progress.
    pub progress: Progress,
    /// Control progress.
    pub control_progress: Progress,
    /// Resource management.
    pub resource_mgmt: ResourceMgmt,
    /// Address vector type.
    pub av_type: AvType,
    /// Memory registration mode.
    pub mr_mode: MrMode,
    /// Bytes of a remote key.
    pub mr_key_size: usize,
    /// Bytes of immediate (CQ) data.
    pub cq_data_size: usize,
    /// Segments per memory registration.
    pub mr_iov_limit: usize,
    /// Domain capabilities.
    pub caps: Caps,
}

// ---------------------------------------------------------------------------------------------
