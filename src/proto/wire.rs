//! Packet codec for the EFA RDM wire protocol, version 4, byte for byte as libfabric's EFA
//! provider lays it out (`efa_rdm_protocol.h`; where the protocol document and the code disagree,
//! the code).
//!
//! Every packet starts with a 4-byte base header `{u8 type; u8 version; u16 flags}`; everything is
//! little-endian and naturally aligned. [`decode`] turns any byte string into a typed [`Packet`]
//! and the application data that follows its headers, or a [`WireError`] — it never panics and
//! never allocates. [`Packet::encode_header`] writes the headers into a caller's buffer and
//! returns their length, so that an engine can post the header and the payload as two segments
//! of one device send; [`Packet::encode`] appends the payload too.
//!
//! ```
//! use efa::proto::wire::{decode, Packet, ReqOpt, Sender};
//!
//! let pkt = Packet::EagerRtm {
//!     opt: ReqOpt { sender: Sender::Connid(0x1234), cq_data: None },
//!     msg_id: 7,
//!     tag: Some(42),
//!     dc_send_id: None,
//! };
//! let mut buf = bytes::BytesMut::new();
//! let hdr_len = pkt.encode(b"hello", &mut buf).unwrap();
//! assert_eq!(hdr_len, 16 + 4); // eager_tagrtm_hdr + connid header
//! assert_eq!(buf[0], 65); // EAGER_TAGRTM
//! let (back, data) = decode(&buf).unwrap();
//! assert_eq!(back, pkt);
//! assert_eq!(data, b"hello");
//! ```
//!
//! The layouts, and the choices made where libfabric's code and its protocol document differ,
//! are listed in `docs/protocol.md`; `tests/vectors/efa-rdm-v4.json` holds them as data and the
//! tests check the encoder against it.

use std::fmt;

/// Defines a `#[repr(u8)]` enum of protocol ids with libfabric's names: the enum, `ALL` (every
/// variant, in declaration order), a `const fn` from the id (`None` for an id not listed) and
/// `name`. The doc comments of the enum and of each item are passed in.
macro_rules! id_enum {
    (
        $(#[$em:meta])* pub enum $e:ident;
        $(#[$am:meta])* ALL;
        $(#[$fm:meta])* fn $from:ident($x:ident: $t:ty);
        $(#[$nm:meta])* fn name;
        $( $(#[$m:meta])* $v:ident = $id:literal, $name:literal; )*
    ) => {
        $(#[$em])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum $e {
            $( $(#[$m])* $v = $id, )*
        }

        impl $e {
            $(#[$am])*
            pub const ALL: &'static [$e] = &[ $( $e::$v, )* ];

            $(#[$fm])*
            pub const fn $from($x: $t) -> Option<$e> {
                match $x {
                    $( $id => Some($e::$v), )*
                    _ => None,
                }
            }

            $(#[$nm])*
            pub const fn name(self) -> &'static str {
                match self {
                    $( $e::$v => $name, )*
                }
            }
        }
    };
}

mod decode;
mod encode;
mod handshake;
mod iov;
mod types;

pub use decode::{BaseHeader, decode};
pub use encode::{max_req_data_capacity, req_header_len};
pub use handshake::{ExtraFeature, ExtraInfo, Handshake};
pub use iov::{IovIter, IovList};
pub use types::{Packet, ReqOpt, RtaKind, Sender};

/// The protocol version this codec speaks and requires (`EFA_RDM_PROTOCOL_VERSION`).
pub const PROTOCOL_VERSION: u8 = 4;

/// Size of the base header `{type, version, flags}`.
pub const BASE_HDR_LEN: usize = 4;

/// Size of one `efa_rma_iov` `{u64 addr; u64 len; u64 key}` on the wire.
pub const RMA_IOV_LEN: usize = 24;

/// Most `rma_iov` / `read_iov` entries one REQ packet may carry (`EFA_RDM_IOV_LIMIT`).
///
/// libfabric's receiver copies these arrays into fixed arrays of this length, so a count above it
/// is refused by the decoder ([`WireError::BadField`]) and by the encoder.
pub const IOV_LIMIT: usize = 4;

/// Size of the REQ optional raw-address header as libfabric writes it
/// (`EFA_RDM_REQ_OPT_RAW_ADDR_HDR_SIZE`): `{u32 addr_len; u8 raw_addr[32]; u8 pad[4]}`.
pub const RAW_ADDR_HDR_LEN: usize = 40;

/// The `addr_len` libfabric (and this encoder) writes in the raw-address header (40 − 4).
pub const RAW_ADDR_HDR_ADDR_LEN: u32 = 36;

/// Size of the REQ optional CQ-data header `{u64 cq_data}`.
pub const CQ_DATA_HDR_LEN: usize = 8;

/// Size of the REQ optional connid header `{u32 connid}`.
pub const CONNID_HDR_LEN: usize = 4;

/// Size of the CTSDATA connid trailer `{u32 connid; u32 pad}` (present when [`CONNID_HDR`] is set).
pub const CTSDATA_CONNID_HDR_LEN: usize = 8;

/// Size of each HANDSHAKE optional field (connid, host id, device version, user recv QP, p2p).
pub const HANDSHAKE_OPT_LEN: usize = 8;

/// Number of handshake extra feature/request bits defined (`EFA_RDM_NUM_EXTRA_FEATURE_OR_REQUEST`).
pub const NUM_EXTRA_FEATURE_OR_REQUEST: u32 = 10;

/// Most `extra_info` words kept from a HANDSHAKE (`EFA_RDM_MAX_NUM_EXINFO`); further words are
/// skipped by the decoder.
pub const MAX_NUM_EXINFO: usize = 4;

/// Largest REQ header libfabric can produce (`efa_rdm_pkt_type_get_max_hdr_size`): a 24-byte
/// RTW/RTR/RTA header with [`IOV_LIMIT`] `rma_iov`, the raw-address header and the CQ-data header.
pub const MAX_REQ_HEADER_LEN: usize =
    24 + IOV_LIMIT * RMA_IOV_LEN + RAW_ADDR_HDR_LEN + CQ_DATA_HDR_LEN;

/// Size of the largest CTSDATA header (24 + connid trailer); the CTSDATA payload capacity of an
/// MTU is `mtu - CTSDATA_MAX_HEADER_LEN` (libfabric's `max_data_payload_size`).
pub const CTSDATA_MAX_HEADER_LEN: usize = 24 + CTSDATA_CONNID_HDR_LEN;

/// Universal flag (bit 15): the packet carries the sender's connid (its QKEY).
///
/// REQ packets then have the optional connid header; CTS, READRSP, ATOMRSP, EOR, RECEIPT,
/// READ_NACK and PEER_ERROR carry it in their `connid` slot; CTSDATA in an 8-byte trailer after
/// its header; HANDSHAKE as its first optional field.
pub const CONNID_HDR: u16 = 0x8000;

/// CTS flag (bit 7): the CTS answers an emulated read request (`EFA_RDM_CTS_READ_REQ`).
pub const CTS_READ_REQ: u16 = 0x80;

/// Flags of REQ packets (types ≥ 64), `EFA_RDM_REQ_*`.
pub mod req_flags {
    /// The optional raw-address header follows the mandatory header.
    pub const RAW_ADDR_HDR: u16 = 0x1;
    /// The optional CQ-data header follows (remote CQ data).
    pub const CQ_DATA_HDR: u16 = 0x2;
    /// A two-sided message (set on every RTM).
    pub const MSG: u16 = 0x4;
    /// A tagged message (set on tagged RTMs).
    pub const TAGGED: u16 = 0x8;
    /// An RMA request (defined, never set by libfabric).
    pub const RMA: u16 = 0x10;
    /// An atomic request (set on every RTA).
    pub const ATOMIC: u16 = 0x20;
    /// A LONGCTS REQ resent as the read-NACK fallback; it carries no data
    /// (`EFA_RDM_REQ_READ_NACK`, not in the protocol document's flag table).
    pub const READ_NACK: u16 = 0x2000;
    /// The optional connid header follows (the universal [`super::CONNID_HDR`]).
    pub const CONNID_HDR: u16 = super::CONNID_HDR;
}

/// Flags of the HANDSHAKE packet: which optional 8-byte fields follow `extra_info`.
///
/// The fields appear in this order: connid, host id, device version, user recv QP, p2p.
pub mod handshake_flags {
    /// `host_id` (u64), `EFA_RDM_HANDSHAKE_HOST_ID_HDR`.
    pub const HOST_ID: u16 = 0x1;
    /// `device_version` (u32 + 4 pad), `EFA_RDM_HANDSHAKE_DEVICE_VERSION_HDR`.
    pub const DEVICE_VERSION: u16 = 0x2;
    /// `{u32 qpn; u32 qkey}` of a legacy user receive QP, `EFA_RDM_HANDSHAKE_USER_RECV_QP_HDR`.
    pub const USER_RECV_QP: u16 = 0x4;
    /// `{u8 p2p_supported; 7 reserved}`, `EFA_RDM_HANDSHAKE_HMEM_P2P_HDR`.
    pub const HMEM_P2P: u16 = 0x8;
    /// `connid` (u32 + 4 pad), the universal [`super::CONNID_HDR`].
    pub const CONNID_HDR: u16 = super::CONNID_HDR;
}

/// `ref_kind` values of a PEER_ERROR packet: how `op_id` names the operation.
pub mod peer_error_ref {
    /// `op_id` is the bufpool index of the receiver's tx/rx entry.
    pub const OPE_INDEX: u32 = 0;
    /// `op_id` is a message id, resolved through the receiver's `rxe_map`.
    pub const MSG_ID: u32 = 1;
    /// `op_id` is a message id of a message aborted before any data: no completion is owed, the
    /// id only advances the reorder window.
    pub const MSG_ID_SKIP: u32 = 2;
}

/// Why a byte string is not a packet this codec accepts (or why a packet cannot be encoded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum WireError {
    /// The packet ends before its headers (or the data its `seg_length` announces) do.
    #[error("packet truncated")]
    Truncated,
    /// The base header's version is not [`PROTOCOL_VERSION`].
    #[error("protocol version {0}, expected 4")]
    BadVersion(u8),
    /// The type id is not one protocol v4 defines.
    #[error("unknown packet type {0}")]
    UnknownType(u8),
    /// A type protocol v4 defines but never sends (retired, local-only or without a send path).
    #[error("packet type {0} is never sent on the wire")]
    NotDecodable(PacketType),
    /// A field has a value the protocol does not allow; the field is named.
    #[error("bad value in field {0}")]
    BadField(&'static str),
}

impl From<WireError> for crate::Error {
    fn from(e: WireError) -> crate::Error {
        crate::Error::new(crate::ErrorKind::InvalidArgument, "decode").with_detail(e.to_string())
    }
}

id_enum! {
    /// Every packet type id protocol v4 defines (`efa_rdm_protocol.h`).
    ///
    /// Some are known but never sent — retired, local-only, or without a send path in current
    /// libfabric; [`decode`] reports them as [`WireError::NotDecodable`]
    /// (see [`PacketType::is_decodable`]).
    pub enum PacketType;
    /// Every type, in id order.
    ALL;
    /// The type of an id, if protocol v4 defines it.
    fn from_id(id: u8);
    /// libfabric's name without the `EFA_RDM_` prefix and `_PKT` suffix (`"EAGER_MSGRTM"`).
    fn name;

    /// Retired RTS (1).
    RetiredRts = 1, "RETIRED_RTS";
    /// Retired CONNACK (2).
    RetiredConnack = 2, "RETIRED_CONNACK";
    /// Clear to send (3).
    Cts = 3, "CTS";
    /// Data sent in answer to a CTS (4).
    CtsData = 4, "CTSDATA";
    /// Response to an emulated read (5).
    ReadRsp = 5, "READRSP";
    /// Local context of RDMA read/write work requests, never sent (6).
    RmaContext = 6, "RMA_CONTEXT";
    /// End of a long-read transfer (7).
    Eor = 7, "EOR";
    /// Response to a fetch/compare atomic (8).
    AtomRsp = 8, "ATOMRSP";
    /// Capability exchange (9).
    Handshake = 9, "HANDSHAKE";
    /// Delivery-complete acknowledgement (10).
    Receipt = 10, "RECEIPT";
    /// The receiver cannot RDMA-read: fall back to long-CTS (11).
    ReadNack = 11, "READ_NACK";
    /// The peer aborted an operation (12).
    PeerError = 12, "PEER_ERROR";
    /// Eager message (64).
    EagerMsgRtm = 64, "EAGER_MSGRTM";
    /// Eager tagged message (65).
    EagerTagRtm = 65, "EAGER_TAGRTM";
    /// Medium message segment (66).
    MediumMsgRtm = 66, "MEDIUM_MSGRTM";
    /// Medium tagged message segment (67).
    MediumTagRtm = 67, "MEDIUM_TAGRTM";
    /// Long-CTS message (68).
    LongCtsMsgRtm = 68, "LONGCTS_MSGRTM";
    /// Long-CTS tagged message (69).
    LongCtsTagRtm = 69, "LONGCTS_TAGRTM";
    /// Emulated eager write (70).
    EagerRtw = 70, "EAGER_RTW";
    /// Emulated long-CTS write (71).
    LongCtsRtw = 71, "LONGCTS_RTW";
    /// Emulated short read (72).
    ShortRtr = 72, "SHORT_RTR";
    /// Emulated long-CTS read (73).
    LongCtsRtr = 73, "LONGCTS_RTR";
    /// Emulated atomic write (74).
    WriteRta = 74, "WRITE_RTA";
    /// Emulated fetch atomic (75).
    FetchRta = 75, "FETCH_RTA";
    /// Emulated compare atomic (76).
    CompareRta = 76, "COMPARE_RTA";
    /// Long-read message (128).
    LongReadMsgRtm = 128, "LONGREAD_MSGRTM";
    /// Long-read tagged message (129).
    LongReadTagRtm = 129, "LONGREAD_TAGRTM";
    /// Emulated long-read write (130).
    LongReadRtw = 130, "LONGREAD_RTW";
    /// Read RTR: defined, never sent (131).
    ReadRtr = 131, "READ_RTR";
    /// Delivery-complete eager message (133).
    DcEagerMsgRtm = 133, "DC_EAGER_MSGRTM";
    /// Delivery-complete eager tagged message (134).
    DcEagerTagRtm = 134, "DC_EAGER_TAGRTM";
    /// Delivery-complete medium message segment (135).
    DcMediumMsgRtm = 135, "DC_MEDIUM_MSGRTM";
    /// Delivery-complete medium tagged message segment (136).
    DcMediumTagRtm = 136, "DC_MEDIUM_TAGRTM";
    /// Delivery-complete long-CTS message (137).
    DcLongCtsMsgRtm = 137, "DC_LONGCTS_MSGRTM";
    /// Delivery-complete long-CTS tagged message (138).
    DcLongCtsTagRtm = 138, "DC_LONGCTS_TAGRTM";
    /// Delivery-complete emulated eager write (139).
    DcEagerRtw = 139, "DC_EAGER_RTW";
    /// Delivery-complete emulated long-CTS write (140).
    DcLongCtsRtw = 140, "DC_LONGCTS_RTW";
    /// Delivery-complete emulated atomic write (141).
    DcWriteRta = 141, "DC_WRITE_RTA";
    /// Runting long-CTS message: defined, no send path in current libfabric (142).
    RuntCtsMsgRtm = 142, "RUNTCTS_MSGRTM";
    /// Runting long-CTS tagged message: defined, no send path (143).
    RuntCtsTagRtm = 143, "RUNTCTS_TAGRTM";
    /// Runting long-CTS write: defined, no send path (144).
    RuntCtsRtw = 144, "RUNTCTS_RTW";
    /// Runting read message (145).
    RuntReadMsgRtm = 145, "RUNTREAD_MSGRTM";
    /// Runting read tagged message (146).
    RuntReadTagRtm = 146, "RUNTREAD_TAGRTM";
    /// Runting read write: defined, never sent (147).
    RuntReadRtw = 147, "RUNTREAD_RTW";
}

impl PacketType {
    /// The type id on the wire.
    pub const fn id(self) -> u8 {
        self as u8
    }

    /// A REQ packet (id ≥ 64): it opens an operation and may carry the optional headers.
    pub const fn is_req(self) -> bool {
        self as u8 >= 64
    }

    /// A tagged RTM: its header carries a 64-bit tag.
    pub const fn is_tagged(self) -> bool {
        matches!(
            self,
            PacketType::EagerTagRtm
                | PacketType::MediumTagRtm
                | PacketType::LongCtsTagRtm
                | PacketType::LongReadTagRtm
                | PacketType::DcEagerTagRtm
                | PacketType::DcMediumTagRtm
                | PacketType::DcLongCtsTagRtm
                | PacketType::RuntCtsTagRtm
                | PacketType::RuntReadTagRtm
        )
    }

    /// A delivery-complete REQ (133–141): the receiver answers with a RECEIPT.
    pub const fn is_dc(self) -> bool {
        matches!(self as u8, 133..=141)
    }

    /// A two-sided message REQ (RTM).
    pub const fn is_rtm(self) -> bool {
        use PacketType::*;
        matches!(
            self,
            EagerMsgRtm
                | EagerTagRtm
                | MediumMsgRtm
                | MediumTagRtm
                | LongCtsMsgRtm
                | LongCtsTagRtm
                | LongReadMsgRtm
                | LongReadTagRtm
                | DcEagerMsgRtm
                | DcEagerTagRtm
                | DcMediumMsgRtm
                | DcMediumTagRtm
                | DcLongCtsMsgRtm
                | DcLongCtsTagRtm
                | RuntCtsMsgRtm
                | RuntCtsTagRtm
                | RuntReadMsgRtm
                | RuntReadTagRtm
        )
    }

    /// The type is sent on the wire by current libfabric, and [`decode`] accepts it.
    pub const fn is_decodable(self) -> bool {
        use PacketType::*;
        !matches!(
            self,
            RetiredRts
                | RetiredConnack
                | RmaContext
                | ReadRtr
                | RuntCtsMsgRtm
                | RuntCtsTagRtm
                | RuntCtsRtw
                | RuntReadRtw
        )
    }

    /// The header carries `rma_iov[rma_iov_count]` right after its fixed part
    /// (RTW, RTR and RTA packets).
    pub const fn has_rma_iov(self) -> bool {
        use PacketType::*;
        matches!(
            self,
            EagerRtw
                | DcEagerRtw
                | LongCtsRtw
                | DcLongCtsRtw
                | LongReadRtw
                | ShortRtr
                | LongCtsRtr
                | WriteRta
                | DcWriteRta
                | FetchRta
                | CompareRta
        )
    }

    /// The sender's `read_iov[read_iov_count]` follows the optional headers (long-read and
    /// runting-read packets).
    pub const fn has_read_iov(self) -> bool {
        use PacketType::*;
        matches!(
            self,
            LongReadMsgRtm | LongReadTagRtm | LongReadRtw | RuntReadMsgRtm | RuntReadTagRtm
        )
    }

    /// Size of the fixed part of the type's mandatory header (without `rma_iov`, optional
    /// headers, `read_iov` or HANDSHAKE's `extra_info`); `None` for types that are never sent.
    pub const fn base_hdr_len(self) -> Option<usize> {
        use PacketType::*;
        Some(match self {
            Cts | CtsData | ReadRsp | AtomRsp => 24,
            Eor | Receipt | ReadNack => 16,
            PeerError => 20,
            Handshake => 8,
            EagerMsgRtm => 8,
            EagerTagRtm => 16,
            MediumMsgRtm => 24,
            MediumTagRtm => 32,
            LongCtsMsgRtm | DcLongCtsMsgRtm => 24,
            LongCtsTagRtm | DcLongCtsTagRtm => 32,
            LongReadMsgRtm => 24,
            LongReadTagRtm => 32,
            DcEagerMsgRtm => 16,
            DcEagerTagRtm => 24,
            DcMediumMsgRtm => 32,
            DcMediumTagRtm => 40,
            RuntReadMsgRtm => 40,
            RuntReadTagRtm => 48,
            EagerRtw => 8,
            DcEagerRtw => 16,
            LongCtsRtw | DcLongCtsRtw | LongReadRtw => 24,
            ShortRtr | LongCtsRtr => 24,
            WriteRta | DcWriteRta | FetchRta | CompareRta => 24,
            RetiredRts | RetiredConnack | RmaContext | ReadRtr | RuntCtsMsgRtm | RuntCtsTagRtm
            | RuntCtsRtw | RuntReadRtw => return None,
        })
    }
}

impl TryFrom<u8> for PacketType {
    type Error = WireError;

    /// The type of an id; ids protocol v4 does not define are [`WireError::UnknownType`].
    fn try_from(id: u8) -> Result<PacketType, WireError> {
        PacketType::from_id(id).ok_or(WireError::UnknownType(id))
    }
}

impl From<PacketType> for u8 {
    fn from(t: PacketType) -> u8 {
        t as u8
    }
}

impl fmt::Display for PacketType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), *self as u8)
    }
}

#[cfg(test)]
mod tests;
