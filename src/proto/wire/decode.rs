//! The decoder: total over all byte strings, allocation-free.
//!
//! Every read goes through [`Reader`], which bounds-checks with `get` and `checked_add`; counts
//! and lengths read from the packet are validated before they size anything.

use super::handshake::{ExtraInfo, Handshake};
use super::iov::IovList;
use super::types::{Packet, ReqOpt, RtaKind, Sender};
use super::{
    CONNID_HDR, CTS_READ_REQ, IOV_LIMIT, MAX_NUM_EXINFO, PROTOCOL_VERSION, PacketType, RMA_IOV_LEN,
    WireError, handshake_flags, req_flags,
};
use crate::addr::{RAW_ADDR_LEN, RawAddr};

type Result<T> = std::result::Result<T, WireError>;

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A `u32` in an 8-byte slot (4 bytes of padding after it) when `present`: the
    /// delivery-complete `send_id`, CTSDATA's connid trailer.
    fn padded_u32(&mut self, present: bool) -> Result<Option<u32>> {
        if !present {
            return Ok(None);
        }
        let v = self.u32()?;
        self.take(4)?;
        Ok(Some(v))
    }

    /// A `u64` when `present`: the tag of a tagged REQ type, the CQ-data header.
    fn u64_if(&mut self, present: bool) -> Result<Option<u64>> {
        present.then(|| self.u64()).transpose()
    }

    /// `n` bytes where `n` comes from the packet.
    fn take_len(&mut self, n: u64) -> Result<&'a [u8]> {
        self.take(usize::try_from(n).map_err(|_| WireError::Truncated)?)
    }

    fn rest(&self) -> &'a [u8] {
        self.buf.get(self.pos..).unwrap_or(&[])
    }

    /// `count` `efa_rma_iov` entries; `count` comes from the packet.
    fn iovs(&mut self, count: u32, field: &'static str) -> Result<IovList<'a>> {
        let count = usize::try_from(count).map_err(|_| WireError::BadField(field))?;
        if count > IOV_LIMIT {
            return Err(WireError::BadField(field));
        }
        Ok(IovList::from_wire(self.take(count * RMA_IOV_LEN)?))
    }
}

/// The 4-byte base header every packet starts with, undecoded beyond its fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BaseHeader {
    /// Packet type id.
    pub ty: u8,
    /// Protocol version.
    pub version: u8,
    /// Flags (type-specific; bit 15 is [`CONNID_HDR`]).
    pub flags: u16,
}

impl BaseHeader {
    /// Reads the base header; only fails when `buf` is shorter than 4 bytes.
    pub fn parse(buf: &[u8]) -> std::result::Result<BaseHeader, WireError> {
        let mut r = Reader::new(buf);
        Ok(BaseHeader {
            ty: r.u8()?,
            version: r.u8()?,
            flags: r.u16()?,
        })
    }

    /// The packet type, if the id is one protocol v4 defines.
    pub fn packet_type(&self) -> std::result::Result<PacketType, WireError> {
        PacketType::try_from(self.ty)
    }
}

/// Decodes one packet: its typed headers and the application data after them.
///
/// The data is the rest of `buf` after all headers (after `read_iov` for long/runting reads),
/// except for CTSDATA, READRSP and ATOMRSP, whose data is exactly `seg_length` bytes (extra
/// trailing bytes are ignored, missing ones are [`WireError::Truncated`]).
///
/// Total: every input gives `Ok` or `Err`, without panicking or allocating. Errors:
/// fewer bytes than the headers need → [`Truncated`](WireError::Truncated); version ≠ 4 →
/// [`BadVersion`](WireError::BadVersion); an id v4 does not define →
/// [`UnknownType`](WireError::UnknownType); a defined type that is never sent →
/// [`NotDecodable`](WireError::NotDecodable); an `rma_iov_count`/`read_iov_count` above
/// [`IOV_LIMIT`], a raw-address `addr_len` below 32, `nextra_p3` below 3, or a REQ with both
/// the raw-address and connid flags → [`BadField`](WireError::BadField).
pub fn decode(buf: &[u8]) -> std::result::Result<(Packet<'_>, &[u8]), WireError> {
    let mut r = Reader::new(buf);
    let ty = r.u8()?;
    let version = r.u8()?;
    let flags = r.u16()?;
    if version != PROTOCOL_VERSION {
        return Err(WireError::BadVersion(version));
    }
    let ty = PacketType::try_from(ty)?;
    if !ty.is_decodable() {
        return Err(WireError::NotDecodable(ty));
    }
    if ty.is_req() {
        return decode_req(ty, flags, r);
    }
    let connid = |slot: u32| (flags & CONNID_HDR != 0).then_some(slot);
    // A struct expression evaluates its fields in the order written: each literal below lists
    // the fields in wire order, each with its read.
    let packet = match ty {
        PacketType::Cts => Packet::Cts {
            connid: connid(r.u32()?),
            send_id: r.u32()?,
            recv_id: r.u32()?,
            recv_length: r.u64()?,
            read_req: flags & CTS_READ_REQ != 0,
        },
        PacketType::CtsData => Packet::CtsData {
            recv_id: r.u32()?,
            seg_length: r.u64()?,
            seg_offset: r.u64()?,
            connid: r.padded_u32(flags & CONNID_HDR != 0)?,
        },
        PacketType::ReadRsp => Packet::ReadRsp {
            connid: connid(r.u32()?),
            recv_id: r.u32()?,
            send_id: r.u32()?,
            seg_length: r.u64()?,
        },
        PacketType::AtomRsp => {
            let slot = r.u32()?;
            let _reserved = r.u32()?;
            Packet::AtomRsp {
                connid: connid(slot),
                recv_id: r.u32()?,
                seg_length: r.u64()?,
            }
        }
        PacketType::Eor => Packet::Eor {
            send_id: r.u32()?,
            recv_id: r.u32()?,
            connid: connid(r.u32()?),
        },
        PacketType::Receipt => Packet::Receipt {
            send_id: r.u32()?,
            msg_id: r.u32()?,
            connid: connid(r.u32()?),
        },
        PacketType::ReadNack => Packet::ReadNack {
            send_id: r.u32()?,
            recv_id: r.u32()?,
            connid: connid(r.u32()?),
        },
        PacketType::PeerError => Packet::PeerError {
            op_id: r.u32()?,
            ref_kind: r.u32()?,
            prov_errno: r.u32()?,
            connid: connid(r.u32()?),
        },
        PacketType::Handshake => Packet::Handshake(decode_handshake(flags, &mut r)?),
        // Every other decodable type is a REQ, handled above.
        _ => return Err(WireError::NotDecodable(ty)),
    };
    let data = match packet.seg_length() {
        Some(len) => r.take_len(len)?,
        None => r.rest(),
    };
    Ok((packet, data))
}

fn decode_handshake(flags: u16, r: &mut Reader<'_>) -> Result<Handshake> {
    let nextra_p3 = r.u32()?;
    let nex = nextra_p3
        .checked_sub(3)
        .ok_or(WireError::BadField("nextra_p3"))?;
    let nex = usize::try_from(nex).map_err(|_| WireError::Truncated)?;
    let words_len = nex.checked_mul(8).ok_or(WireError::Truncated)?;
    let words = r.take(words_len)?;
    let mut kept = [0u64; MAX_NUM_EXINFO];
    for (d, w) in kept.iter_mut().zip(words.chunks_exact(8)) {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        *d = u64::from_le_bytes(a);
    }
    let extra_info = ExtraInfo::from_words(kept.get(..nex.min(MAX_NUM_EXINFO)).unwrap_or(&[]));

    let mut opt8 = |flag: u16| -> Result<Option<[u8; 8]>> {
        if flags & flag != 0 {
            Ok(Some(r.array::<8>()?))
        } else {
            Ok(None)
        }
    };
    let lo32 = |a: [u8; 8]| u32::from_le_bytes([a[0], a[1], a[2], a[3]]);
    let hi32 = |a: [u8; 8]| u32::from_le_bytes([a[4], a[5], a[6], a[7]]);
    let connid = opt8(CONNID_HDR)?.map(lo32);
    let host_id = opt8(handshake_flags::HOST_ID)?.map(u64::from_le_bytes);
    let device_version = opt8(handshake_flags::DEVICE_VERSION)?.map(lo32);
    let user_recv_qp = opt8(handshake_flags::USER_RECV_QP)?.map(|a| (lo32(a), hi32(a)));
    let p2p = opt8(handshake_flags::HMEM_P2P)?.map(|a| a[0] != 0);
    Ok(Handshake {
        extra_info,
        connid,
        host_id,
        device_version,
        user_recv_qp,
        p2p,
    })
}

/// The optional headers, in flag-bit order: raw address, CQ data, connid.
fn decode_req_opt(flags: u16, r: &mut Reader<'_>) -> Result<ReqOpt> {
    let raw = flags & req_flags::RAW_ADDR_HDR != 0;
    let conn = flags & req_flags::CONNID_HDR != 0;
    if raw && conn {
        return Err(WireError::BadField("flags"));
    }
    let mut sender = Sender::None;
    if raw {
        // `{u32 addr_len; u8 raw_addr[addr_len]}`: libfabric writes addr_len = 36 and skips the
        // header with the value it reads (older providers used another size).
        let addr_len = r.u32()?;
        let addr_len = usize::try_from(addr_len).map_err(|_| WireError::Truncated)?;
        if addr_len < RAW_ADDR_LEN {
            return Err(WireError::BadField("addr_len"));
        }
        let body = r.take(addr_len)?;
        let addr = body
            .get(..RAW_ADDR_LEN)
            .and_then(|b| RawAddr::from_bytes(b).ok())
            .ok_or(WireError::BadField("raw_addr"))?;
        sender = Sender::RawAddr(addr);
    }
    let cq_data = r.u64_if(flags & req_flags::CQ_DATA_HDR != 0)?;
    if conn {
        sender = Sender::Connid(r.u32()?);
    }
    Ok(ReqOpt { sender, cq_data })
}

fn decode_req(
    ty: PacketType,
    flags: u16,
    mut r: Reader<'_>,
) -> std::result::Result<(Packet<'_>, &[u8]), WireError> {
    use PacketType as T;
    let tagged = ty.is_tagged();
    let dc = ty.is_dc();
    let read_nack = flags & req_flags::READ_NACK != 0;
    // As in `decode`: each literal lists the fields in wire order, each with its read.
    let packet = match ty {
        T::EagerMsgRtm | T::EagerTagRtm | T::DcEagerMsgRtm | T::DcEagerTagRtm => Packet::EagerRtm {
            msg_id: r.u32()?,
            dc_send_id: r.padded_u32(dc)?,
            tag: r.u64_if(tagged)?,
            opt: decode_req_opt(flags, &mut r)?,
        },
        T::MediumMsgRtm | T::MediumTagRtm | T::DcMediumMsgRtm | T::DcMediumTagRtm => {
            Packet::MediumRtm {
                msg_id: r.u32()?,
                dc_send_id: r.padded_u32(dc)?,
                msg_length: r.u64()?,
                seg_offset: r.u64()?,
                tag: r.u64_if(tagged)?,
                opt: decode_req_opt(flags, &mut r)?,
            }
        }
        T::LongCtsMsgRtm | T::LongCtsTagRtm | T::DcLongCtsMsgRtm | T::DcLongCtsTagRtm => {
            Packet::LongCtsRtm {
                msg_id: r.u32()?,
                msg_length: r.u64()?,
                send_id: r.u32()?,
                credit_request: r.u32()?,
                tag: r.u64_if(tagged)?,
                opt: decode_req_opt(flags, &mut r)?,
                dc,
                read_nack,
            }
        }
        T::LongReadMsgRtm | T::LongReadTagRtm => {
            let (msg_id, msg_length, send_id) = (r.u32()?, r.u64()?, r.u32()?);
            let read_iov_count = r.u32()?;
            Packet::LongReadRtm {
                msg_id,
                msg_length,
                send_id,
                tag: r.u64_if(tagged)?,
                opt: decode_req_opt(flags, &mut r)?,
                read_iov: r.iovs(read_iov_count, "read_iov_count")?,
            }
        }
        T::RuntReadMsgRtm | T::RuntReadTagRtm => {
            let (msg_id, msg_length, send_id) = (r.u32()?, r.u64()?, r.u32()?);
            let read_iov_count = r.u32()?;
            Packet::RuntReadRtm {
                msg_id,
                msg_length,
                send_id,
                seg_offset: r.u64()?,
                runt_length: r.u64()?,
                tag: r.u64_if(tagged)?,
                opt: decode_req_opt(flags, &mut r)?,
                read_iov: r.iovs(read_iov_count, "read_iov_count")?,
            }
        }
        T::EagerRtw | T::DcEagerRtw => {
            let count = r.u32()?;
            Packet::EagerRtw {
                dc_send_id: r.padded_u32(dc)?,
                rma_iov: r.iovs(count, "rma_iov_count")?,
                opt: decode_req_opt(flags, &mut r)?,
            }
        }
        T::LongCtsRtw | T::DcLongCtsRtw => {
            let count = r.u32()?;
            Packet::LongCtsRtw {
                msg_length: r.u64()?,
                send_id: r.u32()?,
                credit_request: r.u32()?,
                rma_iov: r.iovs(count, "rma_iov_count")?,
                opt: decode_req_opt(flags, &mut r)?,
                dc,
                read_nack,
            }
        }
        T::LongReadRtw => {
            let count = r.u32()?;
            let (msg_length, send_id) = (r.u64()?, r.u32()?);
            let read_iov_count = r.u32()?;
            Packet::LongReadRtw {
                msg_length,
                send_id,
                rma_iov: r.iovs(count, "rma_iov_count")?,
                opt: decode_req_opt(flags, &mut r)?,
                read_iov: r.iovs(read_iov_count, "read_iov_count")?,
            }
        }
        T::ShortRtr | T::LongCtsRtr => {
            let count = r.u32()?;
            let (msg_length, recv_id, recv_length) = (r.u64()?, r.u32()?, r.u32()?);
            let rma_iov = r.iovs(count, "rma_iov_count")?;
            let opt = decode_req_opt(flags, &mut r)?;
            if ty == T::ShortRtr {
                Packet::ShortRtr {
                    opt,
                    msg_length,
                    recv_id,
                    rma_iov,
                }
            } else {
                Packet::LongCtsRtr {
                    opt,
                    msg_length,
                    recv_id,
                    recv_length,
                    rma_iov,
                }
            }
        }
        T::WriteRta | T::DcWriteRta | T::FetchRta | T::CompareRta => {
            let (msg_id, count) = (r.u32()?, r.u32()?);
            let (atomic_datatype, atomic_op, id) = (r.u32()?, r.u32()?, r.u32()?);
            let kind = match ty {
                T::DcWriteRta => RtaKind::DcWrite { send_id: id },
                T::FetchRta => RtaKind::Fetch { recv_id: id },
                T::CompareRta => RtaKind::Compare { recv_id: id },
                _ => RtaKind::Write,
            };
            Packet::Rta {
                msg_id,
                kind,
                atomic_datatype,
                atomic_op,
                rma_iov: r.iovs(count, "rma_iov_count")?,
                opt: decode_req_opt(flags, &mut r)?,
            }
        }
        _ => return Err(WireError::NotDecodable(ty)),
    };
    Ok((packet, r.rest()))
}
