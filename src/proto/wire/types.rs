//! The decoded forms: [`Packet`], the REQ optional headers ([`ReqOpt`], [`Sender`]) and
//! [`RtaKind`].

use super::handshake::Handshake;
use super::iov::IovList;
use super::{CONNID_HDR, CTS_READ_REQ, CTSDATA_CONNID_HDR_LEN, PacketType, RMA_IOV_LEN, req_flags};
use crate::addr::RawAddr;

/// How a REQ packet names its sender: by raw address before the peer's HANDSHAKE has been
/// received, by connid after (libfabric never sends both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Sender {
    /// Neither header (a peer older than libfabric 1.14, or a peer that does not want connids).
    #[default]
    None,
    /// The optional raw-address header: the sender's full address; its QKEY is the connid.
    RawAddr(RawAddr),
    /// The optional connid header: the sender's QKEY.
    Connid(u32),
}

/// The optional headers of a REQ packet (written after the mandatory header, in flag-bit order:
/// raw address, CQ data, connid).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ReqOpt {
    /// Raw-address or connid header, or neither.
    pub sender: Sender,
    /// Remote CQ data (`fi_senddata`, `fi_writedata`): the CQ-data header.
    pub cq_data: Option<u64>,
}

impl ReqOpt {
    /// The sender's connid: the raw address's QKEY or the connid header, as libfabric reads it
    /// (`efa_rdm_pke_get_req_connid_ptr`).
    pub fn connid(&self) -> Option<u32> {
        match self.sender {
            Sender::None => None,
            Sender::RawAddr(a) => Some(a.qkey),
            Sender::Connid(c) => Some(c),
        }
    }

    /// The REQ flag bits these optional headers set.
    pub fn flags(&self) -> u16 {
        let s = match self.sender {
            Sender::None => 0,
            Sender::RawAddr(_) => req_flags::RAW_ADDR_HDR,
            Sender::Connid(_) => req_flags::CONNID_HDR,
        };
        s | if self.cq_data.is_some() {
            req_flags::CQ_DATA_HDR
        } else {
            0
        }
    }
}

/// Which emulated atomic an RTA packet asks for, with the id its union slot (offset 20) carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RtaKind {
    /// WRITE_RTA (74); the slot is padding.
    Write,
    /// DC_WRITE_RTA (141); the slot is the sender's `send_id`, echoed in the RECEIPT.
    DcWrite {
        /// The sender's tx entry id.
        send_id: u32,
    },
    /// FETCH_RTA (75); the slot is the requester's `recv_id`, echoed in the ATOMRSP.
    Fetch {
        /// The requester's entry id.
        recv_id: u32,
    },
    /// COMPARE_RTA (76): data is the operand then the compare buffer; the slot is `recv_id`.
    Compare {
        /// The requester's entry id.
        recv_id: u32,
    },
}

impl RtaKind {
    /// The packet type.
    pub fn packet_type(self) -> PacketType {
        match self {
            RtaKind::Write => PacketType::WriteRta,
            RtaKind::DcWrite { .. } => PacketType::DcWriteRta,
            RtaKind::Fetch { .. } => PacketType::FetchRta,
            RtaKind::Compare { .. } => PacketType::CompareRta,
        }
    }

    /// The value of the union slot at offset 20.
    pub fn id(self) -> u32 {
        match self {
            RtaKind::Write => 0,
            RtaKind::DcWrite { send_id } => send_id,
            RtaKind::Fetch { recv_id } | RtaKind::Compare { recv_id } => recv_id,
        }
    }
}

/// A decoded (or to-be-encoded) packet: one variant per packet type sent on the wire, with its
/// header fields by name. Offsets are in `docs/protocol.md` and `tests/vectors/efa-rdm-v4.json`.
///
/// `tag` is `Some` exactly for the tagged types, `dc_send_id`/`dc` for the delivery-complete
/// types. `connid` of non-REQ packets is `Some` exactly when the [`CONNID_HDR`] flag is set.
/// Message ids, `send_id`s and `recv_id`s are opaque 32-bit values; lengths and offsets are u64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packet<'a> {
    /// EAGER_MSGRTM (64), EAGER_TAGRTM (65), DC_EAGER_MSGRTM (133), DC_EAGER_TAGRTM (134): the
    /// whole message; its length is the packet length minus the headers.
    EagerRtm {
        /// Optional headers.
        opt: ReqOpt,
        /// Per-peer message sequence number.
        msg_id: u32,
        /// Tag of a tagged message.
        tag: Option<u64>,
        /// Delivery-complete: the sender's tx entry id, echoed in the RECEIPT.
        dc_send_id: Option<u32>,
    },
    /// MEDIUM_MSGRTM (66), MEDIUM_TAGRTM (67), DC_MEDIUM_* (135, 136): one segment of a message.
    MediumRtm {
        /// Optional headers.
        opt: ReqOpt,
        /// Per-peer message sequence number.
        msg_id: u32,
        /// Total message length (the code's layout; the document says `seg_length`).
        msg_length: u64,
        /// Offset of this segment in the message.
        seg_offset: u64,
        /// Tag of a tagged message.
        tag: Option<u64>,
        /// Delivery-complete: the sender's tx entry id.
        dc_send_id: Option<u32>,
    },
    /// LONGCTS_MSGRTM (68), LONGCTS_TAGRTM (69), DC_LONGCTS_* (137, 138): the first part of a
    /// message continued by CTS/CTSDATA.
    LongCtsRtm {
        /// Optional headers.
        opt: ReqOpt,
        /// Per-peer message sequence number.
        msg_id: u32,
        /// Total message length.
        msg_length: u64,
        /// The sender's tx entry id, echoed in CTS.
        send_id: u32,
        /// Credits asked for (filled by libfabric, ignored by its receiver).
        credit_request: u32,
        /// Tag of a tagged message.
        tag: Option<u64>,
        /// Delivery-complete variant (137, 138).
        dc: bool,
        /// Flag [`req_flags::READ_NACK`]: a data-less REQ continuing a NACKed read message.
        read_nack: bool,
    },
    /// LONGREAD_MSGRTM (128), LONGREAD_TAGRTM (129): the receiver RDMA-reads `read_iov`.
    LongReadRtm {
        /// Optional headers.
        opt: ReqOpt,
        /// Per-peer message sequence number.
        msg_id: u32,
        /// Total message length.
        msg_length: u64,
        /// The sender's tx entry id, echoed in EOR / READ_NACK.
        send_id: u32,
        /// Tag of a tagged message.
        tag: Option<u64>,
        /// The sender's buffers and keys (after the optional headers).
        read_iov: IovList<'a>,
    },
    /// RUNTREAD_MSGRTM (145), RUNTREAD_TAGRTM (146): a runt segment plus `read_iov` for the rest.
    RuntReadRtm {
        /// Optional headers.
        opt: ReqOpt,
        /// Per-peer message sequence number.
        msg_id: u32,
        /// Total message length.
        msg_length: u64,
        /// The sender's tx entry id.
        send_id: u32,
        /// Offset of this packet's runt data in the message.
        seg_offset: u64,
        /// Total bytes sent as runts.
        runt_length: u64,
        /// Tag of a tagged message.
        tag: Option<u64>,
        /// The sender's buffers and keys.
        read_iov: IovList<'a>,
    },
    /// EAGER_RTW (70), DC_EAGER_RTW (139): an emulated write carrying all its data.
    EagerRtw {
        /// Optional headers.
        opt: ReqOpt,
        /// Delivery-complete: the sender's tx entry id.
        dc_send_id: Option<u32>,
        /// Target ranges.
        rma_iov: IovList<'a>,
    },
    /// LONGCTS_RTW (71), DC_LONGCTS_RTW (140).
    LongCtsRtw {
        /// Optional headers.
        opt: ReqOpt,
        /// Total write length.
        msg_length: u64,
        /// The sender's tx entry id.
        send_id: u32,
        /// Credits asked for.
        credit_request: u32,
        /// Delivery-complete variant (140).
        dc: bool,
        /// Flag [`req_flags::READ_NACK`]: a data-less REQ continuing a NACKed long-read write.
        read_nack: bool,
        /// Target ranges.
        rma_iov: IovList<'a>,
    },
    /// LONGREAD_RTW (130): the target RDMA-reads `read_iov` into `rma_iov`.
    LongReadRtw {
        /// Optional headers.
        opt: ReqOpt,
        /// Total write length.
        msg_length: u64,
        /// The sender's tx entry id.
        send_id: u32,
        /// Target ranges.
        rma_iov: IovList<'a>,
        /// The sender's buffers and keys (after the optional headers).
        read_iov: IovList<'a>,
    },
    /// SHORT_RTR (72): an emulated read answered by one READRSP.
    ShortRtr {
        /// Optional headers.
        opt: ReqOpt,
        /// Total read length.
        msg_length: u64,
        /// The requester's entry id, echoed in READRSP.
        recv_id: u32,
        /// Source ranges at the responder.
        rma_iov: IovList<'a>,
    },
    /// LONGCTS_RTR (73): an emulated read answered by READRSP then CTSDATA.
    LongCtsRtr {
        /// Optional headers.
        opt: ReqOpt,
        /// Total read length.
        msg_length: u64,
        /// The requester's entry id.
        recv_id: u32,
        /// First window the requester grants (u32 on the wire).
        recv_length: u32,
        /// Source ranges at the responder.
        rma_iov: IovList<'a>,
    },
    /// WRITE_RTA (74), FETCH_RTA (75), COMPARE_RTA (76), DC_WRITE_RTA (141); data is the operand
    /// (then, for compare, the compare buffer).
    Rta {
        /// Optional headers.
        opt: ReqOpt,
        /// Which atomic, and its id slot.
        kind: RtaKind,
        /// Per-peer message sequence number (atomics are ordered with messages).
        msg_id: u32,
        /// `enum fi_datatype`.
        atomic_datatype: u32,
        /// `enum fi_op`.
        atomic_op: u32,
        /// Target ranges.
        rma_iov: IovList<'a>,
    },
    /// CTS (3): clear to send `recv_length` more bytes.
    Cts {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// The data sender's entry id.
        send_id: u32,
        /// The data receiver's entry id, to be echoed in CTSDATA.
        recv_id: u32,
        /// Window in bytes.
        recv_length: u64,
        /// Flag [`CTS_READ_REQ`]: answers an emulated read.
        read_req: bool,
    },
    /// CTSDATA (4): `seg_length` bytes at `seg_offset`; the connid sits in an 8-byte trailer
    /// between header and data.
    CtsData {
        /// Sender's connid (flag [`CONNID_HDR`], trailer header).
        connid: Option<u32>,
        /// The receiver's entry id.
        recv_id: u32,
        /// Data length in this packet.
        seg_length: u64,
        /// Offset of the data in the message.
        seg_offset: u64,
    },
    /// READRSP (5): first segment of an emulated read's data (`recv_id` before `send_id`, the
    /// code's layout).
    ReadRsp {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// The requester's entry id.
        recv_id: u32,
        /// The responder's entry id, to be echoed in CTS.
        send_id: u32,
        /// Data length in this packet.
        seg_length: u64,
    },
    /// EOR (7): end of a long-read transfer.
    Eor {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// The data sender's entry id.
        send_id: u32,
        /// The reader's entry id.
        recv_id: u32,
    },
    /// ATOMRSP (8): the result of a fetch/compare atomic.
    AtomRsp {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// The requester's entry id.
        recv_id: u32,
        /// Data length.
        seg_length: u64,
    },
    /// HANDSHAKE (9).
    Handshake(Handshake),
    /// RECEIPT (10): the data of a delivery-complete operation is in place.
    Receipt {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// The operation sender's tx entry id (`tx_id`).
        send_id: u32,
        /// The message id.
        msg_id: u32,
    },
    /// READ_NACK (11): the receiver cannot RDMA-read; resend as long-CTS.
    ReadNack {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// The data sender's entry id.
        send_id: u32,
        /// The receiver's entry id.
        recv_id: u32,
    },
    /// PEER_ERROR (12): the peer aborted an operation.
    PeerError {
        /// Sender's connid (flag [`CONNID_HDR`]).
        connid: Option<u32>,
        /// Operation reference, interpreted per `ref_kind`.
        op_id: u32,
        /// One of [`peer_error_ref`](super::peer_error_ref).
        ref_kind: u32,
        /// Provider errno (e.g. `FI_EFA_ERR_PEER_ABORTED`).
        prov_errno: u32,
    },
}

fn pick(tag: bool, dc: bool, types: [PacketType; 4]) -> PacketType {
    let [msg, tagged, dc_msg, dc_tagged] = types;
    match (dc, tag) {
        (false, false) => msg,
        (false, true) => tagged,
        (true, false) => dc_msg,
        (true, true) => dc_tagged,
    }
}

impl<'a> Packet<'a> {
    /// The packet type this packet is encoded as.
    pub fn packet_type(&self) -> PacketType {
        use PacketType as T;
        match *self {
            Packet::EagerRtm {
                tag, dc_send_id, ..
            } => pick(
                tag.is_some(),
                dc_send_id.is_some(),
                [
                    T::EagerMsgRtm,
                    T::EagerTagRtm,
                    T::DcEagerMsgRtm,
                    T::DcEagerTagRtm,
                ],
            ),
            Packet::MediumRtm {
                tag, dc_send_id, ..
            } => pick(
                tag.is_some(),
                dc_send_id.is_some(),
                [
                    T::MediumMsgRtm,
                    T::MediumTagRtm,
                    T::DcMediumMsgRtm,
                    T::DcMediumTagRtm,
                ],
            ),
            Packet::LongCtsRtm { tag, dc, .. } => pick(
                tag.is_some(),
                dc,
                [
                    T::LongCtsMsgRtm,
                    T::LongCtsTagRtm,
                    T::DcLongCtsMsgRtm,
                    T::DcLongCtsTagRtm,
                ],
            ),
            Packet::LongReadRtm { tag, .. } => {
                if tag.is_some() {
                    T::LongReadTagRtm
                } else {
                    T::LongReadMsgRtm
                }
            }
            Packet::RuntReadRtm { tag, .. } => {
                if tag.is_some() {
                    T::RuntReadTagRtm
                } else {
                    T::RuntReadMsgRtm
                }
            }
            Packet::EagerRtw { dc_send_id, .. } => {
                if dc_send_id.is_some() {
                    T::DcEagerRtw
                } else {
                    T::EagerRtw
                }
            }
            Packet::LongCtsRtw { dc, .. } => {
                if dc {
                    T::DcLongCtsRtw
                } else {
                    T::LongCtsRtw
                }
            }
            Packet::LongReadRtw { .. } => T::LongReadRtw,
            Packet::ShortRtr { .. } => T::ShortRtr,
            Packet::LongCtsRtr { .. } => T::LongCtsRtr,
            Packet::Rta { kind, .. } => kind.packet_type(),
            Packet::Cts { .. } => T::Cts,
            Packet::CtsData { .. } => T::CtsData,
            Packet::ReadRsp { .. } => T::ReadRsp,
            Packet::Eor { .. } => T::Eor,
            Packet::AtomRsp { .. } => T::AtomRsp,
            Packet::Handshake(_) => T::Handshake,
            Packet::Receipt { .. } => T::Receipt,
            Packet::ReadNack { .. } => T::ReadNack,
            Packet::PeerError { .. } => T::PeerError,
        }
    }

    /// The optional headers of a REQ packet; `None` for the others.
    pub fn req_opt(&self) -> Option<&ReqOpt> {
        match self {
            Packet::EagerRtm { opt, .. }
            | Packet::MediumRtm { opt, .. }
            | Packet::LongCtsRtm { opt, .. }
            | Packet::LongReadRtm { opt, .. }
            | Packet::RuntReadRtm { opt, .. }
            | Packet::EagerRtw { opt, .. }
            | Packet::LongCtsRtw { opt, .. }
            | Packet::LongReadRtw { opt, .. }
            | Packet::ShortRtr { opt, .. }
            | Packet::LongCtsRtr { opt, .. }
            | Packet::Rta { opt, .. } => Some(opt),
            _ => None,
        }
    }

    /// The sender's connid wherever this packet carries it (REQ raw address or connid header,
    /// the `connid` slot or trailer of the others, HANDSHAKE's optional field).
    pub fn connid(&self) -> Option<u32> {
        if let Some(opt) = self.req_opt() {
            return opt.connid();
        }
        match *self {
            Packet::Cts { connid, .. }
            | Packet::CtsData { connid, .. }
            | Packet::ReadRsp { connid, .. }
            | Packet::Eor { connid, .. }
            | Packet::AtomRsp { connid, .. }
            | Packet::Receipt { connid, .. }
            | Packet::ReadNack { connid, .. }
            | Packet::PeerError { connid, .. } => connid,
            Packet::Handshake(h) => h.connid,
            _ => None,
        }
    }

    /// The `msg_id` of RTM and RTA packets (the ones that go through the reorder window).
    pub fn msg_id(&self) -> Option<u32> {
        match *self {
            Packet::EagerRtm { msg_id, .. }
            | Packet::MediumRtm { msg_id, .. }
            | Packet::LongCtsRtm { msg_id, .. }
            | Packet::LongReadRtm { msg_id, .. }
            | Packet::RuntReadRtm { msg_id, .. }
            | Packet::Rta { msg_id, .. } => Some(msg_id),
            _ => None,
        }
    }

    /// The base-header flags the encoder writes: optional-header bits, `MSG`/`TAGGED` for RTMs,
    /// `ATOMIC` for RTAs, `READ_NACK`, [`CTS_READ_REQ`], [`CONNID_HDR`] and the handshake bits.
    pub fn flags(&self) -> u16 {
        let conn = |c: Option<u32>| if c.is_some() { CONNID_HDR } else { 0 };
        let nack = |b: bool| if b { req_flags::READ_NACK } else { 0 };
        let rtm = |opt: &ReqOpt, tag: Option<u64>| {
            opt.flags() | req_flags::MSG | if tag.is_some() { req_flags::TAGGED } else { 0 }
        };
        match self {
            Packet::EagerRtm { opt, tag, .. }
            | Packet::MediumRtm { opt, tag, .. }
            | Packet::LongReadRtm { opt, tag, .. }
            | Packet::RuntReadRtm { opt, tag, .. } => rtm(opt, *tag),
            Packet::LongCtsRtm {
                opt,
                tag,
                read_nack,
                ..
            } => rtm(opt, *tag) | nack(*read_nack),
            Packet::LongCtsRtw { opt, read_nack, .. } => opt.flags() | nack(*read_nack),
            Packet::EagerRtw { opt, .. }
            | Packet::LongReadRtw { opt, .. }
            | Packet::ShortRtr { opt, .. }
            | Packet::LongCtsRtr { opt, .. } => opt.flags(),
            Packet::Rta { opt, .. } => opt.flags() | req_flags::ATOMIC,
            Packet::Cts {
                connid, read_req, ..
            } => conn(*connid) | if *read_req { CTS_READ_REQ } else { 0 },
            Packet::CtsData { connid, .. }
            | Packet::ReadRsp { connid, .. }
            | Packet::Eor { connid, .. }
            | Packet::AtomRsp { connid, .. }
            | Packet::Receipt { connid, .. }
            | Packet::ReadNack { connid, .. }
            | Packet::PeerError { connid, .. } => conn(*connid),
            Packet::Handshake(h) => h.flags(),
        }
    }

    /// The `seg_length` of CTSDATA, READRSP and ATOMRSP, whose data is exactly that many bytes
    /// after the headers; `None` for the others (their data is the rest of the packet).
    pub(super) fn seg_length(&self) -> Option<u64> {
        match *self {
            Packet::CtsData { seg_length, .. }
            | Packet::ReadRsp { seg_length, .. }
            | Packet::AtomRsp { seg_length, .. } => Some(seg_length),
            _ => None,
        }
    }

    /// The `rma_iov` list of RTW, RTR and RTA packets (empty for the others).
    pub fn rma_iov(&self) -> IovList<'a> {
        match *self {
            Packet::EagerRtw { rma_iov, .. }
            | Packet::LongCtsRtw { rma_iov, .. }
            | Packet::LongReadRtw { rma_iov, .. }
            | Packet::ShortRtr { rma_iov, .. }
            | Packet::LongCtsRtr { rma_iov, .. }
            | Packet::Rta { rma_iov, .. } => rma_iov,
            _ => IovList::EMPTY,
        }
    }

    /// The `read_iov` list of long-read and runting-read packets (empty for the others).
    pub fn read_iov(&self) -> IovList<'a> {
        match *self {
            Packet::LongReadRtm { read_iov, .. }
            | Packet::RuntReadRtm { read_iov, .. }
            | Packet::LongReadRtw { read_iov, .. } => read_iov,
            _ => IovList::EMPTY,
        }
    }

    /// The number of bytes [`encode_header`](Packet::encode_header) writes: for REQ packets the
    /// libfabric REQ header size ([`req_header_len`](super::req_header_len)) plus the `read_iov`
    /// array; for CTSDATA 24 plus the connid trailer; for HANDSHAKE 8 + 8 per word and field.
    pub fn header_len(&self) -> usize {
        let ty = self.packet_type();
        if ty.is_req() {
            let base =
                super::req_header_len(ty, self.flags(), self.rma_iov().len()).unwrap_or(usize::MAX);
            return base.saturating_add(self.read_iov().len().saturating_mul(RMA_IOV_LEN));
        }
        match self {
            Packet::CtsData { connid, .. } => {
                24 + if connid.is_some() {
                    CTSDATA_CONNID_HDR_LEN
                } else {
                    0
                }
            }
            Packet::Handshake(h) => h.header_len(),
            _ => ty.base_hdr_len().unwrap_or(0),
        }
    }
}
