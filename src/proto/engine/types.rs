//! Types the engine's sub-states share (a leaf module: it imports none of its siblings but
//! `util`): the packets queued to the device and who owns them, the protocols of sends and of
//! inbound messages, the fields every packet of a message shares.

use crate::device::Status;
use crate::error::{Error, ErrorKind};
use crate::proto::wire::ReqOpt;

use super::util::Hdr;

/// Why a peer's operations end (`Engine::fail_peer`): each sub-state fails its own with it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Gone {
    pub(super) kind: ErrorKind,
    /// The device's status, when the device said so.
    pub(super) status: Option<Status>,
    pub(super) why: &'static str,
}

impl Gone {
    /// The error an operation `op` ends with.
    pub(super) fn error(&self, op: &'static str) -> Error {
        Error::new(self.kind, op).with_detail(self.why)
    }
}

/// The peer id of entries of the local path (no engine peer: no reorder window, no handshake).
pub(super) const LOCAL_PEER: u64 = u64::MAX;

/// Alignment of medium segments in host memory (libfabric's `EFA_RDM_DEFAULT_MEMORY_ALIGNMENT`).
const MEDIUM_ALIGN: usize = 8;

/// What a packet belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Owner {
    /// A packet of a send operation (REQ or CTSDATA).
    Tx(u32),
    /// Our HANDSHAKE.
    Handshake,
    /// A CTS or RECEIPT (owned by no application operation).
    Ctrl,
    /// A REQ of an RMA operation of `read.rs` (LONGREAD_RTW).
    Rd(u32),
    /// A packet of an emulated RMA operation (`rma.rs`), payload from its buffer.
    Ema(u32),
    /// A response of the emulation's target side (READRSP, ATOMRSP) with its payload.
    Resp(u32),
}

/// A packet queued for, or handed to, the device.
///
/// It holds no reference-counted buffer: its headers are inline and its payload is a range of
/// its send's buffer, turned into the `Transmit`'s `Bytes` when it goes to the device (and
/// again if an RNR sends it once more).
#[derive(Debug)]
pub(super) struct Pkt {
    pub(super) peer: u64,
    pub(super) owner: Owner,
    pub(super) hdr: Hdr,
    /// The payload: bytes `off..end` of the buffer of send `owner` (none for other owners).
    pub(super) off: usize,
    pub(super) end: usize,
    /// RNR completions this packet has met.
    pub(super) rnr: u8,
}

impl Pkt {
    /// A control packet (no payload).
    pub(super) fn ctrl(peer: u64, owner: Owner, hdr: Hdr) -> Pkt {
        Pkt::new(peer, owner, hdr, 0, 0)
    }

    /// A packet of send `owner` carrying bytes `off..end` of its buffer.
    pub(super) fn new(peer: u64, owner: Owner, hdr: Hdr, off: usize, end: usize) -> Pkt {
        Pkt {
            peer,
            owner,
            hdr,
            off,
            end,
            rnr: 0,
        }
    }
}

/// The protocol a send uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Proto {
    Eager,
    Medium,
    LongCts,
    /// LONGREAD_RTM: the receiver reads the message, then EOR.
    LongRead,
    /// RUNTREAD_RTM: runt bytes in packets, the receiver reads the rest, then EOR.
    RuntRead,
}

/// Which protocol an inbound message uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Eager,
    Medium,
    LongCts {
        send_id: u32,
    },
    /// LONGREAD_RTM: read by this side (`read.rs`), then EOR.
    LongRead {
        send_id: u32,
    },
    /// RUNTREAD_RTM: `runt` bytes in packets, the rest read by this side.
    RuntRead {
        send_id: u32,
        runt: u64,
    },
}

/// The fields every packet of one message shares.
pub(super) struct MsgHdr {
    pub(super) pid: u64,
    pub(super) send_id: u32,
    pub(super) opt: ReqOpt,
    pub(super) msg_id: u32,
    pub(super) tag: Option<u64>,
    pub(super) dc: bool,
}

/// How libfabric splits a medium message over packets (`efa_rdm_ope_prepare_to_post_send`):
/// equal, aligned segments, the remainder on the last one or in one more packet. The segment
/// sizes in order, without allocating.
pub(super) fn medium_segments(total: usize, max: usize) -> impl Iterator<Item = usize> {
    // (segments of `single`, the size of the last of them, an extra last segment).
    let (single, cnt, last, extra) = if total == 0 || max == 0 {
        (total, 1, total, 0)
    } else {
        let cnt = (total - 1) / max + 1;
        let mut single = ((total - 1) / cnt + 1) & !(MEDIUM_ALIGN - 1);
        if single == 0 {
            single = total.min(max);
        }
        let cnt = total / single;
        let rem = total - cnt * single;
        if rem > 0 && single + rem <= max {
            (single, cnt, single + rem, 0)
        } else {
            (single, cnt, single, rem)
        }
    };
    let extra = (extra > 0).then_some(extra);
    (0..cnt)
        .map(move |i| if i + 1 == cnt { last } else { single })
        .chain(extra)
}

/// [`medium_segments`] as a vector.
#[cfg(test)]
pub(super) fn medium_split(total: usize, max: usize) -> Vec<usize> {
    medium_segments(total, max).collect()
}
