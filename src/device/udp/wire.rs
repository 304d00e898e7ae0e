//! Datagram formats of the udp device (see `docs/udp-device.md` for the byte layout).
//!
//! Every datagram starts with a 12-byte common header:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 2 | magic `0xEF 0xA5` |
//! | 2 | 1 | version (1) |
//! | 3 | 1 | type: 1 UD data, 2 SRD data, 3 SRD ack, 4 SRD NAK, 5 packed SRD datagrams |
//! | 4 | 1 | flags: bit 0 = immediate data present (data types only); SRD data only: bit 1 = an acknowledgement rides along, bit 2 = acknowledge at once |
//! | 5 | 3 | reserved, zero |
//! | 8 | 4 | destination QKEY (little-endian) |
//!
//! Decoding never panics: every field is read through checked slicing and any inconsistency is a
//! [`Malformed`] reason.

/// First two bytes of every datagram.
pub(crate) const MAGIC: [u8; 2] = [0xEF, 0xA5];
/// Wire format version.
pub(crate) const VERSION: u8 = 1;
/// Length of the common header.
pub(crate) const COMMON_LEN: usize = 12;
/// Flag: a 4-byte immediate value follows the type-specific header.
pub(crate) const FLAG_IMM: u8 = 0x01;
/// Flag (SRD data): a piggybacked acknowledgement for the reverse direction follows the data
/// header (before the immediate).
pub(crate) const FLAG_ACK: u8 = 0x02;
/// Flag (SRD data): the sender is window-limited or retransmitting; acknowledge without delay.
pub(crate) const FLAG_ACK_REQ: u8 = 0x04;
/// Data flag: the payload is a one-sided RDMA message for the device (`rdma.rs`), not for a
/// receive buffer.
pub(crate) const FLAG_RDMA: u8 = 0x08;

/// Type byte of an unreliable datagram.
pub(crate) const T_UD: u8 = 1;
/// Type byte of an SRD data packet.
pub(crate) const T_DATA: u8 = 2;
/// Type byte of an SRD acknowledgement.
pub(crate) const T_ACK: u8 = 3;
/// Type byte of an SRD negative acknowledgement.
pub(crate) const T_NAK: u8 = 4;
/// Type byte of a packed datagram: several SRD datagrams (data, acks, NAKs) to one queue pair
/// in one UDP datagram, each behind its length. Sent only to peers that said they unpack
/// (a `PACKED` datagram of theirs came first, see [`FLAG_HELLO`]); a peer of an older wire drops
/// it as an unknown type.
pub(crate) const T_PACKED: u8 = 5;
/// Flag (packed datagram): the sender asks whether the receiver unpacks; a receiver that does
/// answers with a packed datagram of its own (an empty one if it has nothing to send).
pub(crate) const FLAG_HELLO: u8 = 0x01;
/// Fixed part of a packed datagram: the common header and the source QKEY.
pub(crate) const PACKED_LEN: usize = 16;
/// Length prefix of each datagram in a packed datagram.
pub(crate) const PACKED_ENTRY: usize = 2;

/// Fixed part of an SRD data packet (before the optional immediate).
pub(crate) const DATA_LEN: usize = 44;
/// Fixed part of an SRD acknowledgement (before the bitmap).
pub(crate) const ACK_LEN: usize = 32;
/// Length of an SRD NAK.
pub(crate) const NAK_LEN: usize = 36;
/// Fixed part of an acknowledgement piggybacked on SRD data (before its bitmap): `conn` (4),
/// bitmap length (2), reserved (2), `cum` (8). Its source QKEY is the data's.
pub(crate) const PIGGY_LEN: usize = 16;

/// Largest number of SRD sequence numbers a sender may have between its base and its newest
/// packet; the receiver remembers delivery state for this many packets per sender.
pub(crate) const WINDOW: u64 = 1024;
/// Largest selective-acknowledgement bitmap, bytes.
pub(crate) const MAX_BITMAP: usize = (WINDOW / 8) as usize;

/// Largest header this device prepends to a user datagram (data header, piggybacked
/// acknowledgement with the largest bitmap, immediate).
pub(crate) const MAX_OVERHEAD: usize = DATA_LEN + PIGGY_LEN + MAX_BITMAP + 4;

/// Why a NAK was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NakReason {
    /// Receiver not ready: no receive buffer was posted.
    Rnr = 1,
    /// The posted receive buffer was shorter than the datagram.
    BadLength = 2,
    /// An RDMA access was refused: bad key, range or right.
    BadAddress = 3,
    /// The receiver forgot this sender's state (too many senders) and may have delivered this
    /// sequence number before: it is not delivered again, and the send fails.
    Forgotten = 4,
    /// An RDMA access refused because the target's NIC holds no address handle for the
    /// initiator (EFA status 14; only an emulated EFA NIC refuses so).
    UnknownPeer = 5,
}

impl NakReason {
    /// How the send a NAK of this reason answers fails; `None` for [`NakReason::Rnr`], after
    /// which the sender tries again.
    pub(crate) fn failure(self) -> Option<crate::device::Status> {
        use crate::device::Status;
        match self {
            NakReason::Rnr => None,
            NakReason::BadLength => Some(Status::RemoteBadLength),
            NakReason::BadAddress => Some(Status::RemoteBadAddress),
            NakReason::Forgotten => Some(Status::RemoteAbort),
            NakReason::UnknownPeer => Some(Status::UnknownPeer),
        }
    }
}

/// Why a datagram was rejected.
pub(crate) type Malformed = &'static str;

/// Header of an SRD data packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DataHdr {
    /// The sender queue pair's QKEY (identifies a restarted sender).
    pub src_qkey: u32,
    /// Sender's connection id for this receiver, echoed in acks and NAKs.
    pub conn: u32,
    /// Transmission attempt of this sequence number (0 first, +1 per retransmission).
    pub try_: u32,
    /// Sequence number.
    pub seq: u64,
    /// Every sequence number below `base` is finished at the sender (acknowledged or given up).
    pub base: u64,
    /// Immediate data.
    pub imm: Option<u32>,
    /// The sender asks for an acknowledgement without delay (`FLAG_ACK_REQ`).
    pub ack_req: bool,
    /// The payload is an RDMA message (`FLAG_RDMA`).
    pub rdma: bool,
}

/// Body of an SRD acknowledgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AckHdr {
    /// The acknowledging queue pair's QKEY.
    pub src_qkey: u32,
    /// The data sender's connection id.
    pub conn: u32,
    /// Every sequence number in `[sender base, cum)` was delivered.
    pub cum: u64,
}

/// Body of an SRD negative acknowledgement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NakHdr {
    /// The refusing queue pair's QKEY.
    pub src_qkey: u32,
    /// The data sender's connection id.
    pub conn: u32,
    /// The attempt that was refused.
    pub try_: u32,
    /// The refused sequence number.
    pub seq: u64,
    /// Why.
    pub reason: NakReason,
}

/// A decoded datagram, borrowing the receive buffer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Packet<'a> {
    /// Unreliable datagram.
    Ud {
        /// Immediate data.
        imm: Option<u32>,
        /// User bytes.
        payload: &'a [u8],
    },
    /// SRD data.
    Data(DataHdr, &'a [u8]),
    /// SRD data carrying an acknowledgement (with its bitmap) for the reverse direction.
    DataAck(DataHdr, AckHdr, &'a [u8], &'a [u8]),
    /// SRD acknowledgement with its selective bitmap (bit `i` = `cum + 1 + i`).
    Ack(AckHdr, &'a [u8]),
    /// SRD negative acknowledgement.
    Nak(NakHdr),
}

fn common(out: &mut Vec<u8>, ty: u8, flags: u8, dst_qkey: u32) {
    out.clear();
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(ty);
    out.push(flags);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&dst_qkey.to_le_bytes());
}

/// Encodes an unreliable datagram into `out`.
pub(crate) fn encode_ud(
    out: &mut Vec<u8>,
    dst_qkey: u32,
    imm: Option<u32>,
    hdr: &[u8],
    payload: &[u8],
) {
    common(
        out,
        T_UD,
        if imm.is_some() { FLAG_IMM } else { 0 },
        dst_qkey,
    );
    if let Some(i) = imm {
        out.extend_from_slice(&i.to_le_bytes());
    }
    out.extend_from_slice(hdr);
    out.extend_from_slice(payload);
}

/// Encodes an SRD data packet into `out`.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn encode_data(
    out: &mut Vec<u8>,
    dst_qkey: u32,
    h: &DataHdr,
    hdr: &[u8],
    payload: &[u8],
) {
    encode_data_header(out, dst_qkey, h, None, hdr.len() + payload.len());
    out.extend_from_slice(hdr);
    out.extend_from_slice(payload);
}

/// Encodes the header of an SRD data packet carrying `len` user bytes into `out`, with an
/// acknowledgement `(ack, bitmap)` riding along if given (its `src_qkey` must be `h.src_qkey`;
/// the bitmap is at most [`MAX_BITMAP`] bytes). The user bytes follow.
pub(crate) fn encode_data_header(
    out: &mut Vec<u8>,
    dst_qkey: u32,
    h: &DataHdr,
    ack: Option<(&AckHdr, &[u8])>,
    len: usize,
) {
    let mut flags = 0;
    if h.imm.is_some() {
        flags |= FLAG_IMM;
    }
    if ack.is_some() {
        flags |= FLAG_ACK;
    }
    if h.ack_req {
        flags |= FLAG_ACK_REQ;
    }
    if h.rdma {
        flags |= FLAG_RDMA;
    }
    common(out, T_DATA, flags, dst_qkey);
    out.extend_from_slice(&h.src_qkey.to_le_bytes());
    out.extend_from_slice(&h.conn.to_le_bytes());
    out.extend_from_slice(&h.try_.to_le_bytes());
    out.extend_from_slice(&h.seq.to_le_bytes());
    out.extend_from_slice(&h.base.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    if let Some((a, bitmap)) = ack {
        let bitmap = &bitmap[..bitmap.len().min(MAX_BITMAP)];
        out.extend_from_slice(&a.conn.to_le_bytes());
        out.extend_from_slice(&(bitmap.len() as u16).to_le_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&a.cum.to_le_bytes());
        out.extend_from_slice(bitmap);
    }
    if let Some(i) = h.imm {
        out.extend_from_slice(&i.to_le_bytes());
    }
}

/// Encodes an SRD acknowledgement into `out`; `bitmap` is at most [`MAX_BITMAP`] bytes.
pub(crate) fn encode_ack(out: &mut Vec<u8>, dst_qkey: u32, a: &AckHdr, bitmap: &[u8]) {
    let bitmap = &bitmap[..bitmap.len().min(MAX_BITMAP)];
    common(out, T_ACK, 0, dst_qkey);
    out.extend_from_slice(&a.src_qkey.to_le_bytes());
    out.extend_from_slice(&a.conn.to_le_bytes());
    out.extend_from_slice(&(bitmap.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&a.cum.to_le_bytes());
    out.extend_from_slice(bitmap);
}

/// Encodes an SRD negative acknowledgement into `out`.
pub(crate) fn encode_nak(out: &mut Vec<u8>, dst_qkey: u32, n: &NakHdr) {
    common(out, T_NAK, 0, dst_qkey);
    out.extend_from_slice(&n.src_qkey.to_le_bytes());
    out.extend_from_slice(&n.conn.to_le_bytes());
    out.extend_from_slice(&n.try_.to_le_bytes());
    out.extend_from_slice(&n.seq.to_le_bytes());
    out.push(n.reason as u8);
    out.extend_from_slice(&[0, 0, 0]);
}

/// Encodes the fixed part of a packed datagram into `out`; the entries follow, each written
/// with [`push_packed_entry`].
pub(crate) fn encode_packed_header(out: &mut Vec<u8>, dst_qkey: u32, src_qkey: u32, hello: bool) {
    common(out, T_PACKED, if hello { FLAG_HELLO } else { 0 }, dst_qkey);
    out.extend_from_slice(&src_qkey.to_le_bytes());
}

/// Appends the length prefix of a `len`-byte datagram to a packed datagram (the datagram's
/// bytes follow). `len` fits in a `u16`: packed datagrams are at most one MTU (65,000).
pub(crate) fn push_packed_entry(out: &mut Vec<u8>, len: usize) {
    out.extend_from_slice(&(len.min(u16::MAX as usize) as u16).to_le_bytes());
}

/// A packed datagram, checked whole: every entry decodes as an SRD datagram (data, ack or
/// NAK) for the same destination QKEY.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Packed<'a> {
    /// The sending queue pair's QKEY.
    pub src_qkey: u32,
    /// The sender asks whether we unpack ([`FLAG_HELLO`]).
    pub hello: bool,
    /// The entries, each behind its length prefix.
    entries: &'a [u8],
}

impl<'a> Packed<'a> {
    /// The datagrams inside, in order.
    pub fn datagrams(&self) -> PackedIter<'a> {
        PackedIter { rest: self.entries }
    }
}

/// The datagrams of a [`Packed`] datagram.
pub(crate) struct PackedIter<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for PackedIter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let len = u16_at(self.rest, 0)? as usize;
        let d = self.rest.get(PACKED_ENTRY..PACKED_ENTRY + len)?;
        self.rest = self.rest.get(PACKED_ENTRY + len..).unwrap_or_default();
        Some(d)
    }
}

/// Whether `b` claims to be a packed datagram (its type byte; [`decode_packed`] checks the rest).
pub(crate) fn is_packed(b: &[u8]) -> bool {
    b.get(3) == Some(&T_PACKED)
}

/// Decodes a packed datagram: its destination QKEY and its contents. The whole datagram is
/// checked before anything in it is used: the entries' lengths add up to the datagram, and every
/// entry decodes as an SRD data, ack or NAK datagram (never UD, never packed again) with the
/// packed datagram's destination and source QKEYs; else the whole datagram is malformed.
pub(crate) fn decode_packed(b: &[u8]) -> Result<(u32, Packed<'_>), Malformed> {
    check_common(b, PACKED_LEN, "truncated packed header")?;
    if b.get(3) != Some(&T_PACKED) {
        return Err("not a packed datagram");
    }
    let flags = b.get(4).copied().ok_or("truncated")?;
    if flags & !FLAG_HELLO != 0 {
        return Err("unknown flags");
    }
    let dst_qkey = u32_at(b, 8).ok_or("truncated")?;
    let src_qkey = u32_at(b, 12).ok_or("truncated")?;
    let entries = b.get(PACKED_LEN..).ok_or("truncated")?;
    let mut rest = entries;
    while !rest.is_empty() {
        let len = u16_at(rest, 0).ok_or("truncated entry length")? as usize;
        let d = rest
            .get(PACKED_ENTRY..PACKED_ENTRY + len)
            .ok_or("packed entry longer than the datagram")?;
        let (q, p) = decode(d)?;
        if q != dst_qkey {
            return Err("packed entry for another QKEY");
        }
        let from = match p {
            Packet::Ud { .. } => return Err("UD datagram in a packed datagram"),
            Packet::Data(h, _) | Packet::DataAck(h, ..) => h.src_qkey,
            Packet::Ack(a, _) => a.src_qkey,
            Packet::Nak(n) => n.src_qkey,
        };
        if from != src_qkey {
            return Err("packed entry from another QKEY");
        }
        rest = rest.get(PACKED_ENTRY + len..).unwrap_or_default();
    }
    Ok((
        dst_qkey,
        Packed {
            src_qkey,
            hello: flags & FLAG_HELLO != 0,
            entries,
        },
    ))
}

/// The `N` bytes at `at`, if `b` has them.
#[inline]
fn bytes_at<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    b.get(at..at.checked_add(N)?)?.try_into().ok()
}

#[inline]
fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    bytes_at(b, at).map(u16::from_le_bytes)
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    bytes_at(b, at).map(u32::from_le_bytes)
}

#[inline]
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    bytes_at(b, at).map(u64::from_le_bytes)
}

/// Checks the fixed parts of the common header every datagram starts with: at least `min`
/// bytes (else `short`), the magic, the version and the zero reserved bytes.
#[inline]
fn check_common(b: &[u8], min: usize, short: Malformed) -> Result<(), Malformed> {
    if b.len() < min {
        return Err(short);
    }
    if b.get(0..2) != Some(&MAGIC[..]) {
        return Err("bad magic");
    }
    if b.get(2) != Some(&VERSION) {
        return Err("unknown version");
    }
    if b.get(5..8) != Some(&[0u8, 0, 0][..]) {
        return Err("reserved bytes not zero");
    }
    Ok(())
}

/// Reads the fixed part of an acknowledgement at `at`, laid out alike in an ACK datagram and
/// piggybacked on data: `conn` (4), bitmap length (2, at most [`MAX_BITMAP`]), reserved (2,
/// zero), `cum` (8). `truncated` is the error when `b` ends inside it.
#[inline]
fn ack_fields(b: &[u8], at: usize, truncated: Malformed) -> Result<(u32, usize, u64), Malformed> {
    let conn = u32_at(b, at).ok_or(truncated)?;
    let n = u16_at(b, at + 4).ok_or(truncated)? as usize;
    if u16_at(b, at + 6) != Some(0) {
        return Err("reserved bytes not zero");
    }
    let cum = u64_at(b, at + 8).ok_or(truncated)?;
    if n > MAX_BITMAP {
        return Err("ack bitmap too long");
    }
    Ok((conn, n, cum))
}

/// Decodes a datagram: its destination QKEY and its contents.
pub(crate) fn decode(b: &[u8]) -> Result<(u32, Packet<'_>), Malformed> {
    check_common(b, COMMON_LEN, "shorter than the common header")?;
    let ty = b.get(3).copied().ok_or("truncated")?;
    let flags = b.get(4).copied().ok_or("truncated")?;
    let dst_qkey = u32_at(b, 8).ok_or("truncated")?;
    let pkt = match ty {
        T_UD => {
            if flags & !FLAG_IMM != 0 {
                return Err("unknown flags");
            }
            let (imm, at) = if flags & FLAG_IMM != 0 {
                (
                    Some(u32_at(b, COMMON_LEN).ok_or("truncated immediate")?),
                    COMMON_LEN + 4,
                )
            } else {
                (None, COMMON_LEN)
            };
            Packet::Ud {
                imm,
                payload: b.get(at..).ok_or("truncated")?,
            }
        }
        T_DATA => {
            if flags & !(FLAG_IMM | FLAG_ACK | FLAG_ACK_REQ | FLAG_RDMA) != 0 {
                return Err("unknown flags");
            }
            if b.len() < DATA_LEN {
                return Err("truncated data header");
            }
            let src_qkey = u32_at(b, 12).ok_or("truncated")?;
            let conn = u32_at(b, 16).ok_or("truncated")?;
            let try_ = u32_at(b, 20).ok_or("truncated")?;
            let seq = u64_at(b, 24).ok_or("truncated")?;
            let base = u64_at(b, 32).ok_or("truncated")?;
            let len = u32_at(b, 40).ok_or("truncated")? as usize;
            if base > seq || seq - base >= WINDOW {
                return Err("sequence number outside the window");
            }
            let mut at = DATA_LEN;
            let ack = if flags & FLAG_ACK != 0 {
                let (conn, n, cum) = ack_fields(b, at, "truncated piggybacked ack")?;
                at += PIGGY_LEN;
                let bitmap = b.get(at..at + n).ok_or("truncated piggybacked ack")?;
                at += n;
                Some((
                    AckHdr {
                        src_qkey,
                        conn,
                        cum,
                    },
                    bitmap,
                ))
            } else {
                None
            };
            let imm = if flags & FLAG_IMM != 0 {
                let i = u32_at(b, at).ok_or("truncated immediate")?;
                at += 4;
                Some(i)
            } else {
                None
            };
            let payload = b.get(at..).ok_or("truncated")?;
            if payload.len() != len {
                return Err("payload length does not match the datagram");
            }
            let h = DataHdr {
                src_qkey,
                conn,
                try_,
                seq,
                base,
                imm,
                ack_req: flags & FLAG_ACK_REQ != 0,
                rdma: flags & FLAG_RDMA != 0,
            };
            match ack {
                Some((a, bitmap)) => Packet::DataAck(h, a, bitmap, payload),
                None => Packet::Data(h, payload),
            }
        }
        T_ACK => {
            if flags != 0 {
                return Err("unknown flags");
            }
            let src_qkey = u32_at(b, 12).ok_or("truncated ack")?;
            let (conn, n, cum) = ack_fields(b, 16, "truncated ack")?;
            if b.len() != ACK_LEN + n {
                return Err("ack length does not match its bitmap");
            }
            let bitmap = b.get(ACK_LEN..).ok_or("truncated ack")?;
            Packet::Ack(
                AckHdr {
                    src_qkey,
                    conn,
                    cum,
                },
                bitmap,
            )
        }
        T_NAK => {
            if flags != 0 {
                return Err("unknown flags");
            }
            if b.len() != NAK_LEN {
                return Err("bad NAK length");
            }
            let src_qkey = u32_at(b, 12).ok_or("truncated nak")?;
            let conn = u32_at(b, 16).ok_or("truncated nak")?;
            let try_ = u32_at(b, 20).ok_or("truncated nak")?;
            let seq = u64_at(b, 24).ok_or("truncated nak")?;
            let reason = match b.get(32).copied() {
                Some(1) => NakReason::Rnr,
                Some(2) => NakReason::BadLength,
                Some(3) => NakReason::BadAddress,
                Some(4) => NakReason::Forgotten,
                Some(5) => NakReason::UnknownPeer,
                _ => return Err("unknown NAK reason"),
            };
            if b.get(33..36) != Some(&[0u8, 0, 0][..]) {
                return Err("reserved bytes not zero");
            }
            Packet::Nak(NakHdr {
                src_qkey,
                conn,
                try_,
                seq,
                reason,
            })
        }
        _ => return Err("unknown type"),
    };
    Ok((dst_qkey, pkt))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plain data header of sender QKEY 9, connection 3 (no immediate, no flag).
    fn data_hdr(try_: u32, seq: u64, base: u64) -> DataHdr {
        DataHdr {
            src_qkey: 9,
            conn: 3,
            try_,
            seq,
            base,
            imm: None,
            ack_req: false,
            rdma: false,
        }
    }

    /// Asserts that every strict prefix of `b` fails to decode.
    fn every_cut_is_refused(b: &[u8]) {
        for cut in 0..b.len() {
            assert!(decode(&b[..cut]).is_err(), "cut {cut}");
        }
    }

    #[test]
    fn ud_round_trip() {
        let mut b = Vec::new();
        encode_ud(&mut b, 0x1234_5678, Some(7), b"hd", b"payload");
        assert_eq!(b.len(), COMMON_LEN + 4 + 9);
        assert_eq!(&b[..4], &[0xEF, 0xA5, 1, T_UD]);
        let (q, p) = decode(&b).unwrap();
        assert_eq!(q, 0x1234_5678);
        assert_eq!(
            p,
            Packet::Ud {
                imm: Some(7),
                payload: b"hdpayload"
            }
        );
        encode_ud(&mut b, 1, None, b"", b"");
        assert_eq!(
            decode(&b).unwrap(),
            (
                1,
                Packet::Ud {
                    imm: None,
                    payload: b""
                }
            )
        );
    }

    #[test]
    fn data_ack_nak_round_trip() {
        let mut b = Vec::new();
        let h = data_hdr(2, 1000, 990);
        encode_data(&mut b, 5, &h, b"ab", b"cd");
        assert_eq!(b.len(), DATA_LEN + 4);
        assert_eq!(decode(&b).unwrap(), (5, Packet::Data(h, b"abcd")));
        let h2 = DataHdr {
            imm: Some(0xdead),
            ..h
        };
        encode_data(&mut b, 5, &h2, b"", b"x");
        assert_eq!(decode(&b).unwrap(), (5, Packet::Data(h2, b"x")));
        let h3 = DataHdr {
            imm: Some(7),
            ack_req: true,
            ..h
        };
        let pa = AckHdr {
            src_qkey: 9,
            conn: 11,
            cum: 500,
        };
        encode_data_header(&mut b, 5, &h3, Some((&pa, &[0b11, 0x80])), 3);
        assert_eq!(b.len(), DATA_LEN + PIGGY_LEN + 2 + 4);
        b.extend_from_slice(b"xyz");
        assert_eq!(
            decode(&b).unwrap(),
            (5, Packet::DataAck(h3, pa, &[0b11, 0x80][..], b"xyz"))
        );
        every_cut_is_refused(&b);

        let a = AckHdr {
            src_qkey: 1,
            conn: 2,
            cum: 77,
        };
        encode_ack(&mut b, 6, &a, &[0b101]);
        assert_eq!(b.len(), ACK_LEN + 1);
        assert_eq!(decode(&b).unwrap(), (6, Packet::Ack(a, &[0b101][..])));

        let n = NakHdr {
            src_qkey: 1,
            conn: 2,
            try_: 3,
            seq: 4,
            reason: NakReason::BadLength,
        };
        encode_nak(&mut b, 7, &n);
        assert_eq!(b.len(), NAK_LEN);
        assert_eq!(decode(&b).unwrap(), (7, Packet::Nak(n)));
    }

    #[test]
    fn rejects_inconsistent() {
        let mut b = Vec::new();
        let h = data_hdr(0, 10, 10);
        encode_data(&mut b, 5, &h, b"", b"abc");
        every_cut_is_refused(&b);
        let mut long = b.clone();
        long.push(0);
        assert!(decode(&long).is_err());
        let bad = DataHdr { base: 11, ..h };
        encode_data(&mut b, 5, &bad, b"", b"");
        assert!(decode(&b).is_err());
        let far = DataHdr {
            seq: 10 + WINDOW,
            ..h
        };
        encode_data(&mut b, 5, &far, b"", b"");
        assert!(decode(&b).is_err());
        assert!(decode(&[0xEF, 0xA5, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(decode(&[0xEF, 0xA5, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }

    /// A packed datagram of `parts` (each a whole SRD datagram) from `src_qkey` to `dst_qkey`.
    /// The fuzz tests' damage, one of four at random: a bit flipped, the datagram cut short,
    /// bytes added at its end, or none.
    fn damage(b: &mut Vec<u8>, r: &mut crate::fault::Rng) {
        match r.below(4) {
            0 if !b.is_empty() => {
                let at = r.below(b.len() as u64) as usize;
                b[at] ^= 1 << r.below(8);
            }
            1 => b.truncate(r.below(b.len() as u64 + 1) as usize),
            2 => b.extend((0..r.below(8)).map(|_| r.next_u64() as u8)),
            _ => {}
        }
    }

    fn packed(dst_qkey: u32, src_qkey: u32, hello: bool, parts: &[&[u8]]) -> Vec<u8> {
        let mut b = Vec::new();
        encode_packed_header(&mut b, dst_qkey, src_qkey, hello);
        for p in parts {
            push_packed_entry(&mut b, p.len());
            b.extend_from_slice(p);
        }
        b
    }

    #[test]
    fn packed_round_trip_and_refusals() {
        let h = DataHdr {
            imm: Some(4),
            rdma: true,
            ..data_hdr(0, 10, 10)
        };
        let (mut d, mut a, mut n) = (Vec::new(), Vec::new(), Vec::new());
        encode_data(&mut d, 5, &h, b"hd", b"payload");
        let ack = AckHdr {
            src_qkey: 9,
            conn: 8,
            cum: 77,
        };
        encode_ack(&mut a, 5, &ack, &[1]);
        let nak = NakHdr {
            src_qkey: 9,
            conn: 3,
            try_: 1,
            seq: 11,
            reason: NakReason::Rnr,
        };
        encode_nak(&mut n, 5, &nak);
        let b = packed(5, 9, false, &[&d, &a, &n]);
        assert_eq!(
            b.len(),
            PACKED_LEN + 3 * PACKED_ENTRY + d.len() + a.len() + n.len()
        );
        assert!(is_packed(&b));
        let (q, p) = decode_packed(&b).unwrap();
        assert_eq!((q, p.src_qkey, p.hello), (5, 9, false));
        let inner: Vec<_> = p.datagrams().map(|x| decode(x).unwrap()).collect();
        assert_eq!(
            inner,
            vec![
                (5, Packet::Data(h, b"hdpayload")),
                (5, Packet::Ack(ack, &[1][..])),
                (5, Packet::Nak(nak))
            ]
        );
        // A hello: no entries.
        let hello = packed(5, 9, true, &[]);
        let (_, p) = decode_packed(&hello).unwrap();
        assert!(p.hello && p.datagrams().next().is_none());
        // The plain decoder does not take a packed datagram.
        assert!(decode(&b).is_err());
        // Every cut but the entry boundaries is refused; so is anything appended.
        let bounds = [
            PACKED_LEN,
            PACKED_LEN + PACKED_ENTRY + d.len(),
            PACKED_LEN + 2 * PACKED_ENTRY + d.len() + a.len(),
        ];
        for cut in 0..b.len() {
            assert_eq!(
                decode_packed(&b[..cut]).is_ok(),
                bounds.contains(&cut),
                "cut {cut}"
            );
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_packed(&long).is_err());
        // Entries that are not SRD datagrams for this queue pair from the sender.
        let mut ud = Vec::new();
        encode_ud(&mut ud, 5, None, b"x", b"");
        let mut other = Vec::new();
        encode_data(&mut other, 6, &h, b"", b"x");
        let mut foreign = Vec::new();
        encode_data(&mut foreign, 5, &DataHdr { src_qkey: 1, ..h }, b"", b"x");
        let nested = packed(5, 9, false, &[&d]);
        let mut junk = d.clone();
        junk[0] ^= 0xff;
        for bad in [&ud, &other, &foreign, &nested, &junk] {
            assert!(decode_packed(&packed(5, 9, false, &[&d, bad])).is_err());
        }
        // Header fields.
        for (at, v) in [(2, 2u8), (4, 0x02), (5, 1), (7, 1)] {
            let mut x = b.clone();
            x[at] = v;
            assert!(decode_packed(&x).is_err(), "byte {at} = {v}");
        }
    }

    /// Issue 17: a fuzz loop over the decoder a peer feeds: random bytes, and valid packets of
    /// every kind with random fields, cut short, extended or with a flipped bit. Decoding never
    /// panics; what decodes re-encodes to the same bytes (nothing is read that was not there).
    #[test]
    fn decode_is_total_and_exact_on_hostile_bytes() {
        use crate::fault::{Rng, test_seed};
        let seed = test_seed();
        let mut r = Rng::new(seed);
        let (mut ok, mut bad) = (0u32, 0u32);
        let mut b = Vec::new();
        for i in 0..50_000u32 {
            let data = DataHdr {
                src_qkey: r.next_u64() as u32,
                conn: r.next_u64() as u32,
                try_: r.next_u64() as u32,
                seq: r.next_u64(),
                base: r.next_u64(),
                imm: r.chance(0.5).then(|| r.next_u64() as u32),
                ack_req: r.chance(0.5),
                rdma: r.chance(0.5),
            };
            let ack = AckHdr {
                src_qkey: r.next_u64() as u32,
                conn: r.next_u64() as u32,
                cum: r.next_u64(),
            };
            let bitmap: Vec<u8> = (0..r.below(6)).map(|_| r.next_u64() as u8).collect();
            let body: Vec<u8> = (0..r.below(40)).map(|_| r.next_u64() as u8).collect();
            let q = r.next_u64() as u32;
            match r.below(6) {
                0 => {
                    b.clear();
                    b.extend((0..r.below(80)).map(|_| r.next_u64() as u8));
                }
                1 => encode_ud(&mut b, q, data.imm, &body, b""),
                2 => encode_data(&mut b, q, &data, &body, b""),
                3 => {
                    encode_data_header(&mut b, q, &data, Some((&ack, &bitmap)), body.len());
                    b.extend_from_slice(&body);
                }
                4 => encode_ack(&mut b, q, &ack, &bitmap),
                _ => {
                    let reason = match r.below(5) {
                        0 => NakReason::Rnr,
                        1 => NakReason::BadLength,
                        2 => NakReason::BadAddress,
                        3 => NakReason::Forgotten,
                        _ => NakReason::UnknownPeer,
                    };
                    let n = NakHdr {
                        src_qkey: data.src_qkey,
                        conn: data.conn,
                        try_: data.try_,
                        seq: data.seq,
                        reason,
                    };
                    encode_nak(&mut b, q, &n);
                }
            }
            damage(&mut b, &mut r);
            let Ok((q, p)) = decode(&b) else {
                bad += 1;
                continue;
            };
            ok += 1;
            let mut again = Vec::new();
            match p {
                Packet::Ud { imm, payload } => encode_ud(&mut again, q, imm, payload, b""),
                Packet::Data(h, body) => encode_data(&mut again, q, &h, body, b""),
                Packet::DataAck(h, a, bm, body) => {
                    encode_data_header(&mut again, q, &h, Some((&a, bm)), body.len());
                    again.extend_from_slice(body);
                }
                Packet::Ack(a, bm) => encode_ack(&mut again, q, &a, bm),
                Packet::Nak(n) => encode_nak(&mut again, q, &n),
            }
            // Reserved bits a flip may set are not re-encoded: compare what the decoder read.
            let (q2, p2) = decode(&again).expect("a decoded packet re-encodes validly");
            assert_eq!((q2, p2), (q, p), "seed {seed}: packet {i}: {b:?}");
        }
        assert!(
            ok > 10_000 && bad > 10_000,
            "seed {seed}: {ok} decoded, {bad} refused"
        );
    }

    /// The same for packed datagrams: entries of every SRD kind with random fields (some
    /// broken), cut, extended or with a flipped bit. Decoding never panics; a datagram that
    /// decodes is exactly its header and entries, each of which decodes.
    #[test]
    fn decode_packed_is_total_and_exact_on_hostile_bytes() {
        use crate::fault::{Rng, test_seed};
        let seed = test_seed();
        let mut r = Rng::new(seed);
        let (mut ok, mut bad) = (0u32, 0u32);
        for i in 0..20_000u32 {
            let (dst, src) = (r.below(3) as u32, r.below(3) as u32);
            let mut parts = Vec::new();
            for _ in 0..r.below(5) {
                let mut e = Vec::new();
                let seq = r.below(1 << 20) + 2000;
                let data = DataHdr {
                    src_qkey: src,
                    conn: r.next_u64() as u32,
                    try_: r.below(3) as u32,
                    seq,
                    base: seq - r.below(2000),
                    imm: r.chance(0.5).then(|| r.next_u64() as u32),
                    ack_req: r.chance(0.5),
                    rdma: r.chance(0.5),
                };
                let body: Vec<u8> = (0..r.below(40)).map(|_| r.next_u64() as u8).collect();
                match r.below(4) {
                    0 => encode_data(&mut e, dst, &data, &body, b""),
                    1 => encode_ud(&mut e, dst, None, &body, b""),
                    2 => {
                        let a = AckHdr {
                            src_qkey: src,
                            conn: data.conn,
                            cum: data.seq,
                        };
                        encode_ack(&mut e, dst, &a, &body[..body.len().min(4)]);
                    }
                    _ => e = body,
                }
                parts.push(e);
            }
            let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            let mut b = packed(dst, src, r.chance(0.3), &refs);
            damage(&mut b, &mut r);
            let Ok((q, p)) = decode_packed(&b) else {
                bad += 1;
                continue;
            };
            ok += 1;
            let inner: Vec<&[u8]> = p.datagrams().collect();
            for d in &inner {
                let (qi, pi) = decode(d).expect("every entry of a packed datagram decodes");
                assert_eq!(qi, q, "seed {seed}: packet {i}");
                assert!(!matches!(pi, Packet::Ud { .. }), "seed {seed}: packet {i}");
            }
            let again = packed(q, p.src_qkey, p.hello, &inner);
            assert_eq!(again, b, "seed {seed}: packet {i}");
        }
        assert!(
            ok > 1_000 && bad > 1_000,
            "seed {seed}: {ok} decoded, {bad} refused"
        );
    }
}
