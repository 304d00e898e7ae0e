//! The encoder and the header-size helpers the engine sizes packets with.

use bytes::BufMut;

use super::iov::IovList;
use super::types::{Packet, ReqOpt, Sender};
use super::{
    CONNID_HDR_LEN, CQ_DATA_HDR_LEN, IOV_LIMIT, PROTOCOL_VERSION, PacketType,
    RAW_ADDR_HDR_ADDR_LEN, RAW_ADDR_HDR_LEN, RMA_IOV_LEN, WireError, req_flags,
};

/// Exact header size of a REQ packet of type `ty` with base-header `flags` and `rma_iov_count`
/// target ranges, as libfabric computes it (`efa_rdm_pkt_type_get_req_hdr_size`): the mandatory
/// header, `rma_iov` (RTW/RTR/RTA only), then 40 bytes for the raw-address header or else 4 for
/// the connid header, and 8 for CQ data. The `read_iov` array of long/runting-read packets is not
/// included (libfabric counts it as payload).
///
/// `None` if `ty` is not a REQ type that is sent on the wire.
///
/// ```
/// use efa::proto::wire::{req_header_len, req_flags, PacketType, MAX_REQ_HEADER_LEN};
/// assert_eq!(req_header_len(PacketType::EagerMsgRtm, req_flags::CONNID_HDR, 0), Some(12));
/// assert_eq!(req_header_len(PacketType::EagerMsgRtm, req_flags::RAW_ADDR_HDR, 0), Some(48));
/// let f = req_flags::RAW_ADDR_HDR | req_flags::CQ_DATA_HDR;
/// assert_eq!(req_header_len(PacketType::LongCtsRtw, f, 4), Some(MAX_REQ_HEADER_LEN));
/// ```
pub fn req_header_len(ty: PacketType, flags: u16, rma_iov_count: usize) -> Option<usize> {
    if !ty.is_req() {
        return None;
    }
    let mut len = ty.base_hdr_len()?;
    if flags & req_flags::RAW_ADDR_HDR != 0 {
        len += RAW_ADDR_HDR_LEN;
    } else if flags & req_flags::CONNID_HDR != 0 {
        len += CONNID_HDR_LEN;
    }
    if flags & req_flags::CQ_DATA_HDR != 0 {
        len += CQ_DATA_HDR_LEN;
    }
    if ty.has_rma_iov() {
        len = len.checked_add(rma_iov_count.checked_mul(RMA_IOV_LEN)?)?;
    }
    Some(len)
}

/// Application data one REQ packet of type `ty` can carry in an `mtu`-byte packet:
/// `mtu - req_header_len(..)` (libfabric's `efa_rdm_txe_max_req_data_capacity`). `None` if `ty`
/// is not a sent REQ type or the header alone exceeds `mtu`.
///
/// ```
/// use efa::proto::wire::{max_req_data_capacity, req_flags, PacketType};
/// let f = req_flags::CONNID_HDR;
/// assert_eq!(max_req_data_capacity(8760, PacketType::EagerMsgRtm, f, 0), Some(8760 - 12));
/// ```
pub fn max_req_data_capacity(
    mtu: usize,
    ty: PacketType,
    flags: u16,
    rma_iov_count: usize,
) -> Option<usize> {
    mtu.checked_sub(req_header_len(ty, flags, rma_iov_count)?)
}

/// Counts what it writes.
struct W<'b, B: BufMut> {
    out: &'b mut B,
    n: usize,
}

impl<B: BufMut> W<'_, B> {
    // `BufMut::put_u32_le` and its siblings are `put_slice` of `to_le_bytes`, as these are.
    #[inline]
    fn bytes(&mut self, b: &[u8]) {
        self.out.put_slice(b);
        self.n += b.len();
    }
    #[inline]
    fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    #[inline]
    fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    #[inline]
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    #[inline]
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn iovs(&mut self, l: IovList<'_>) {
        for v in l {
            self.u64(v.addr);
            self.u64(v.len);
            self.u64(v.key);
        }
    }
    /// The optional REQ headers in flag-bit order.
    fn opt(&mut self, o: &ReqOpt) {
        if let Sender::RawAddr(a) = o.sender {
            self.u32(RAW_ADDR_HDR_ADDR_LEN);
            self.bytes(&a.to_bytes());
            self.bytes(&[0; RAW_ADDR_HDR_LEN - 4 - crate::addr::RAW_ADDR_LEN]);
        }
        if let Some(d) = o.cq_data {
            self.u64(d);
        }
        if let Sender::Connid(c) = o.sender {
            self.u32(c);
        }
    }
    fn tag(&mut self, t: Option<u64>) {
        if let Some(t) = t {
            self.u64(t);
        }
    }
    /// The fields long-read and runting-read RTMs start with: `msg_id`, `msg_length`, `send_id`
    /// and the `read_iov` count.
    #[inline]
    fn read_rtm(&mut self, msg_id: u32, msg_length: u64, send_id: u32, read_iov: IovList<'_>) {
        self.u32(msg_id);
        self.u64(msg_length);
        self.u32(send_id);
        self.u32(count(read_iov));
    }
    /// A `u32` in an 8-byte slot (4 bytes of padding after it), when there is one.
    fn padded_u32(&mut self, v: Option<u32>) {
        if let Some(v) = v {
            self.u32(v);
            self.u32(0);
        }
    }
}

fn count(l: IovList<'_>) -> u32 {
    // Checked against IOV_LIMIT before anything is written.
    l.len() as u32
}

impl Packet<'_> {
    fn check(&self, extra: usize, remaining: usize) -> Result<usize, WireError> {
        if self.rma_iov().len() > IOV_LIMIT {
            return Err(WireError::BadField("rma_iov_count"));
        }
        if self.read_iov().len() > IOV_LIMIT {
            return Err(WireError::BadField("read_iov_count"));
        }
        let len = self.header_len();
        if len.checked_add(extra).is_none_or(|total| total > remaining) {
            return Err(WireError::BadField("out: buffer too small"));
        }
        Ok(len)
    }

    /// Appends this packet's headers (base header, mandatory header, `rma_iov`, optional headers
    /// in flag-bit order, `read_iov`; CTSDATA's connid trailer; HANDSHAKE's `extra_info` and
    /// optional fields) to `out` and returns their length, which is [`Packet::header_len`].
    ///
    /// The raw-address header is written with `addr_len = 36`, pad and reserved bytes as zeros.
    /// Fails, writing nothing, with [`WireError::BadField`] when an iov list is longer than
    /// [`IOV_LIMIT`] or `out` (e.g. a `&mut [u8]`) has no room for the header.
    pub fn encode_header<B: BufMut>(&self, out: &mut B) -> Result<usize, WireError> {
        let len = self.check(0, out.remaining_mut())?;
        let mut w = W { out, n: 0 };
        self.write(&mut w);
        debug_assert_eq!(w.n, len);
        Ok(w.n)
    }

    /// Appends the headers and then `payload` to `out`; returns the header length.
    ///
    /// For CTSDATA, READRSP and ATOMRSP `payload.len()` must equal `seg_length`
    /// ([`WireError::BadField`] otherwise).
    pub fn encode<B: BufMut>(&self, payload: &[u8], out: &mut B) -> Result<usize, WireError> {
        let len_ok = |seg_length| u64::try_from(payload.len()).ok() == Some(seg_length);
        if !self.seg_length().is_none_or(len_ok) {
            return Err(WireError::BadField("seg_length"));
        }
        let len = self.check(payload.len(), out.remaining_mut())?;
        let mut w = W { out, n: 0 };
        self.write(&mut w);
        debug_assert_eq!(w.n, len);
        w.bytes(payload);
        Ok(len)
    }

    /// The packet (headers and `payload`) as a new vector.
    pub fn to_vec(&self, payload: &[u8]) -> Result<Vec<u8>, WireError> {
        let mut v = Vec::with_capacity(self.header_len().saturating_add(payload.len()));
        self.encode(payload, &mut v)?;
        Ok(v)
    }

    fn write<B: BufMut>(&self, w: &mut W<'_, B>) {
        w.u8(self.packet_type().id());
        w.u8(PROTOCOL_VERSION);
        w.u16(self.flags());
        let slot = |c: Option<u32>| c.unwrap_or(0);
        match *self {
            Packet::EagerRtm {
                ref opt,
                msg_id,
                tag,
                dc_send_id,
            } => {
                w.u32(msg_id);
                w.padded_u32(dc_send_id);
                w.tag(tag);
                w.opt(opt);
            }
            Packet::MediumRtm {
                ref opt,
                msg_id,
                msg_length,
                seg_offset,
                tag,
                dc_send_id,
            } => {
                w.u32(msg_id);
                w.padded_u32(dc_send_id);
                w.u64(msg_length);
                w.u64(seg_offset);
                w.tag(tag);
                w.opt(opt);
            }
            Packet::LongCtsRtm {
                ref opt,
                msg_id,
                msg_length,
                send_id,
                credit_request,
                tag,
                ..
            } => {
                w.u32(msg_id);
                w.u64(msg_length);
                w.u32(send_id);
                w.u32(credit_request);
                w.tag(tag);
                w.opt(opt);
            }
            Packet::LongReadRtm {
                ref opt,
                msg_id,
                msg_length,
                send_id,
                tag,
                read_iov,
            } => {
                w.read_rtm(msg_id, msg_length, send_id, read_iov);
                w.tag(tag);
                w.opt(opt);
                w.iovs(read_iov);
            }
            Packet::RuntReadRtm {
                ref opt,
                msg_id,
                msg_length,
                send_id,
                seg_offset,
                runt_length,
                tag,
                read_iov,
            } => {
                w.read_rtm(msg_id, msg_length, send_id, read_iov);
                w.u64(seg_offset);
                w.u64(runt_length);
                w.tag(tag);
                w.opt(opt);
                w.iovs(read_iov);
            }
            Packet::EagerRtw {
                ref opt,
                dc_send_id,
                rma_iov,
            } => {
                w.u32(count(rma_iov));
                w.padded_u32(dc_send_id);
                w.iovs(rma_iov);
                w.opt(opt);
            }
            Packet::LongCtsRtw {
                ref opt,
                msg_length,
                send_id,
                credit_request,
                rma_iov,
                ..
            } => {
                w.u32(count(rma_iov));
                w.u64(msg_length);
                w.u32(send_id);
                w.u32(credit_request);
                w.iovs(rma_iov);
                w.opt(opt);
            }
            Packet::LongReadRtw {
                ref opt,
                msg_length,
                send_id,
                rma_iov,
                read_iov,
            } => {
                w.u32(count(rma_iov));
                w.u64(msg_length);
                w.u32(send_id);
                w.u32(count(read_iov));
                w.iovs(rma_iov);
                w.opt(opt);
                w.iovs(read_iov);
            }
            Packet::ShortRtr {
                ref opt,
                msg_length,
                recv_id,
                rma_iov,
            } => {
                w.u32(count(rma_iov));
                w.u64(msg_length);
                w.u32(recv_id);
                w.u32(0);
                w.iovs(rma_iov);
                w.opt(opt);
            }
            Packet::LongCtsRtr {
                ref opt,
                msg_length,
                recv_id,
                recv_length,
                rma_iov,
            } => {
                w.u32(count(rma_iov));
                w.u64(msg_length);
                w.u32(recv_id);
                w.u32(recv_length);
                w.iovs(rma_iov);
                w.opt(opt);
            }
            Packet::Rta {
                ref opt,
                kind,
                msg_id,
                atomic_datatype,
                atomic_op,
                rma_iov,
            } => {
                w.u32(msg_id);
                w.u32(count(rma_iov));
                w.u32(atomic_datatype);
                w.u32(atomic_op);
                w.u32(kind.id());
                w.iovs(rma_iov);
                w.opt(opt);
            }
            Packet::Cts {
                connid,
                send_id,
                recv_id,
                recv_length,
                ..
            } => {
                w.u32(slot(connid));
                w.u32(send_id);
                w.u32(recv_id);
                w.u64(recv_length);
            }
            Packet::CtsData {
                connid,
                recv_id,
                seg_length,
                seg_offset,
            } => {
                w.u32(recv_id);
                w.u64(seg_length);
                w.u64(seg_offset);
                w.padded_u32(connid);
            }
            Packet::ReadRsp {
                connid,
                recv_id,
                send_id,
                seg_length,
            } => {
                w.u32(slot(connid));
                w.u32(recv_id);
                w.u32(send_id);
                w.u64(seg_length);
            }
            // The same layout.
            Packet::Eor {
                connid,
                send_id,
                recv_id,
            }
            | Packet::ReadNack {
                connid,
                send_id,
                recv_id,
            } => {
                w.u32(send_id);
                w.u32(recv_id);
                w.u32(slot(connid));
            }
            Packet::AtomRsp {
                connid,
                recv_id,
                seg_length,
            } => {
                w.u32(slot(connid));
                w.u32(0);
                w.u32(recv_id);
                w.u64(seg_length);
            }
            Packet::Handshake(ref h) => {
                let words = h.extra_info.words();
                w.u32(words.len() as u32 + 3);
                for x in words {
                    w.u64(*x);
                }
                w.padded_u32(h.connid);
                if let Some(id) = h.host_id {
                    w.u64(id);
                }
                w.padded_u32(h.device_version);
                if let Some((qpn, qkey)) = h.user_recv_qp {
                    w.u32(qpn);
                    w.u32(qkey);
                }
                if let Some(p) = h.p2p {
                    w.u64(u64::from(p));
                }
            }
            Packet::Receipt {
                connid,
                send_id,
                msg_id,
            } => {
                w.u32(send_id);
                w.u32(msg_id);
                w.u32(slot(connid));
            }
            Packet::PeerError {
                connid,
                op_id,
                ref_kind,
                prov_errno,
            } => {
                w.u32(op_id);
                w.u32(ref_kind);
                w.u32(prov_errno);
                w.u32(slot(connid));
            }
        }
    }
}
