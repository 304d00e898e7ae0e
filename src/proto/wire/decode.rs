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
    let packet = match ty {
        PacketType::Cts => {
            let slot = r.u32()?;
            let send_id = r.u32()?;
            let recv_id = r.u32()?;
            let recv_length = r.u64()?;
            Packet::Cts {
                connid: connid(slot),
                send_id,
                recv_id,
                recv_length,
                read_req: flags & CTS_READ_REQ != 0,
            }
        }
        PacketType::CtsData => {
            let recv_id = r.u32()?;
            let seg_length = r.u64()?;
            let seg_offset = r.u64()?;
            let connid = if flags & CONNID_HDR != 0 {
                let c = r.u32()?;
                r.take(4)?;
                Some(c)
            } else {
                None
            };
            let data = r.take_len(seg_length)?;
            let p = Packet::CtsData {
                connid,
                recv_id,
                seg_length,
                seg_offset,
            };
            return Ok((p, data));
        }
        PacketType::ReadRsp => {
            let slot = r.u32()?;
            let recv_id = r.u32()?;
            let send_id = r.u32()?;
            let seg_length = r.u64()?;
            let data = r.take_len(seg_length)?;
            let p = Packet::ReadRsp {
                connid: connid(slot),
                recv_id,
                send_id,
                seg_length,
            };
            return Ok((p, data));
        }
        PacketType::AtomRsp => {
            let slot = r.u32()?;
            let _reserved = r.u32()?;
            let recv_id = r.u32()?;
            let seg_length = r.u64()?;
            let data = r.take_len(seg_length)?;
            let p = Packet::AtomRsp {
                connid: connid(slot),
                recv_id,
                seg_length,
            };
            return Ok((p, data));
        }
        PacketType::Eor => {
            let send_id = r.u32()?;
            let recv_id = r.u32()?;
            let slot = r.u32()?;
            Packet::Eor {
                connid: connid(slot),
                send_id,
                recv_id,
            }
        }
        PacketType::Receipt => {
            let send_id = r.u32()?;
            let msg_id = r.u32()?;
            let slot = r.u32()?;
            Packet::Receipt {
                connid: connid(slot),
                send_id,
                msg_id,
            }
        }
        PacketType::ReadNack => {
            let send_id = r.u32()?;
            let recv_id = r.u32()?;
            let slot = r.u32()?;
            Packet::ReadNack {
                connid: connid(slot),
                send_id,
                recv_id,
            }
        }
        PacketType::PeerError => {
            let op_id = r.u32()?;
            let ref_kind = r.u32()?;
            let prov_errno = r.u32()?;
            let slot = r.u32()?;
            Packet::PeerError {
                connid: connid(slot),
                op_id,
                ref_kind,
                prov_errno,
            }
        }
        PacketType::Handshake => Packet::Handshake(decode_handshake(flags, &mut r)?),
        // Every other decodable type is a REQ, handled above.
        _ => return Err(WireError::NotDecodable(ty)),
    };
    Ok((packet, r.rest()))
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
    let cq_data = if flags & req_flags::CQ_DATA_HDR != 0 {
        Some(r.u64()?)
    } else {
        None
    };
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
    let packet = match ty {
        T::EagerMsgRtm | T::EagerTagRtm | T::DcEagerMsgRtm | T::DcEagerTagRtm => {
            let msg_id = r.u32()?;
            let dc_send_id = if dc {
                let id = r.u32()?;
                r.take(4)?;
                Some(id)
            } else {
                None
            };
            let tag = if tagged { Some(r.u64()?) } else { None };
            Packet::EagerRtm {
                opt: decode_req_opt(flags, &mut r)?,
                msg_id,
                tag,
                dc_send_id,
            }
        }
        T::MediumMsgRtm | T::MediumTagRtm | T::DcMediumMsgRtm | T::DcMediumTagRtm => {
            let msg_id = r.u32()?;
            let dc_send_id = if dc {
                let id = r.u32()?;
                r.take(4)?;
                Some(id)
            } else {
                None
            };
            let msg_length = r.u64()?;
            let seg_offset = r.u64()?;
            let tag = if tagged { Some(r.u64()?) } else { None };
            Packet::MediumRtm {
                opt: decode_req_opt(flags, &mut r)?,
                msg_id,
                msg_length,
                seg_offset,
                tag,
                dc_send_id,
            }
        }
        T::LongCtsMsgRtm | T::LongCtsTagRtm | T::DcLongCtsMsgRtm | T::DcLongCtsTagRtm => {
            let msg_id = r.u32()?;
            let msg_length = r.u64()?;
            let send_id = r.u32()?;
            let credit_request = r.u32()?;
            let tag = if tagged { Some(r.u64()?) } else { None };
            Packet::LongCtsRtm {
                opt: decode_req_opt(flags, &mut r)?,
                msg_id,
                msg_length,
                send_id,
                credit_request,
                tag,
                dc,
                read_nack: flags & req_flags::READ_NACK != 0,
            }
        }
        T::LongReadMsgRtm | T::LongReadTagRtm => {
            let msg_id = r.u32()?;
            let msg_length = r.u64()?;
            let send_id = r.u32()?;
            let read_iov_count = r.u32()?;
            let tag = if tagged { Some(r.u64()?) } else { None };
            let opt = decode_req_opt(flags, &mut r)?;
            Packet::LongReadRtm {
                opt,
                msg_id,
                msg_length,
                send_id,
                tag,
                read_iov: r.iovs(read_iov_count, "read_iov_count")?,
            }
        }
        T::RuntReadMsgRtm | T::RuntReadTagRtm => {
            let msg_id = r.u32()?;
            let msg_length = r.u64()?;
            let send_id = r.u32()?;
            let read_iov_count = r.u32()?;
            let seg_offset = r.u64()?;
            let runt_length = r.u64()?;
            let tag = if tagged { Some(r.u64()?) } else { None };
            let opt = decode_req_opt(flags, &mut r)?;
            Packet::RuntReadRtm {
                opt,
                msg_id,
                msg_length,
                send_id,
                seg_offset,
                runt_length,
                tag,
                read_iov: r.iovs(read_iov_count, "read_iov_count")?,
            }
        }
        T::EagerRtw | T::DcEagerRtw => {
            let count = r.u32()?;
            let dc_send_id = if dc {
                let id = r.u32()?;
                r.take(4)?;
                Some(id)
            } else {
                None
            };
            let rma_iov = r.iovs(count, "rma_iov_count")?;
            Packet::EagerRtw {
                opt: decode_req_opt(flags, &mut r)?,
                dc_send_id,
                rma_iov,
            }
        }
        T::LongCtsRtw | T::DcLongCtsRtw => {
            let count = r.u32()?;
            let msg_length = r.u64()?;
            let send_id = r.u32()?;
            let credit_request = r.u32()?;
            let rma_iov = r.iovs(count, "rma_iov_count")?;
            Packet::LongCtsRtw {
                opt: decode_req_opt(flags, &mut r)?,
                msg_length,
                send_id,
                credit_request,
                dc,
                read_nack: flags & req_flags::READ_NACK != 0,
                rma_iov,
            }
        }
        T::LongReadRtw => {
            let count = r.u32()?;
            let msg_length = r.u64()?;
            let send_id = r.u32()?;
            let read_iov_count = r.u32()?;
            let rma_iov = r.iovs(count, "rma_iov_count")?;
            let opt = decode_req_opt(flags, &mut r)?;
            Packet::LongReadRtw {
                opt,
                msg_length,
                send_id,
                rma_iov,
                read_iov: r.iovs(read_iov_count, "read_iov_count")?,
            }
        }
        T::ShortRtr | T::LongCtsRtr => {
            let count = r.u32()?;
            let msg_length = r.u64()?;
            let recv_id = r.u32()?;
            let recv_length = r.u32()?;
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
            let msg_id = r.u32()?;
            let count = r.u32()?;
            let atomic_datatype = r.u32()?;
            let atomic_op = r.u32()?;
            let id = r.u32()?;
            let rma_iov = r.iovs(count, "rma_iov_count")?;
            let kind = match ty {
                T::DcWriteRta => RtaKind::DcWrite { send_id: id },
                T::FetchRta => RtaKind::Fetch { recv_id: id },
                T::CompareRta => RtaKind::Compare { recv_id: id },
                _ => RtaKind::Write,
            };
            Packet::Rta {
                opt: decode_req_opt(flags, &mut r)?,
                kind,
                msg_id,
                atomic_datatype,
                atomic_op,
                rma_iov,
            }
        }
        _ => return Err(WireError::NotDecodable(ty)),
    };
    Ok((packet, r.rest()))
}
