//! The RDMA side's shared types (a leaf module: it imports none of its siblings but `types`):
//! remote iov lists and how a read is carved from them, a buffer cut into pieces read
//! separately, the RDMA work requests, the read state of an inbound read-based message and the
//! read-based protocol a send chose. The receive side keeps an inbound message's read state in
//! its entry; the read protocols (`read.rs`) drive it.

use bytes::BytesMut;

use super::EngineConfig;
use super::types::Kind;
use crate::addr::RawAddr;
use crate::device::{RemoteIov, Status};
use crate::mem::RegionSlice;
use crate::proto::wire::{IOV_LIMIT, IovList};

const NO_IOV: RemoteIov = RemoteIov {
    addr: 0,
    len: 0,
    key: 0,
};

/// Largest piece of a device write (libfabric's `efa_write_segment_size`).
pub(super) const WRITE_SEGMENT: u64 = 1 << 30;

/// Largest piece of an RDMA work request: `min(limit, max_rdma_size)` (`limit` 0: 1 GiB;
/// `max_rdma_size` 0: no limit of its own).
fn segment(cfg: &EngineConfig, limit: u64) -> usize {
    let limit = if limit == 0 { WRITE_SEGMENT } else { limit };
    let seg = match cfg.max_rdma_size {
        0 => limit,
        m => limit.min(m),
    };
    usize::try_from(seg).unwrap_or(usize::MAX)
}

/// Largest piece of a read: `min(inter_read_segment_size, max_rdma_size)`.
pub(super) fn read_segment(cfg: &EngineConfig) -> usize {
    segment(cfg, cfg.inter_read_segment_size as u64)
}

/// Largest piece of a device write: `min(1 GiB, max_rdma_size)`.
pub(super) fn write_segment(cfg: &EngineConfig) -> usize {
    segment(cfg, WRITE_SEGMENT)
}

/// A packet's `read_iov` / `rma_iov` list, copied out (at most [`IOV_LIMIT`] entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ReadIovs {
    n: usize,
    v: [RemoteIov; IOV_LIMIT],
}

impl ReadIovs {
    pub(super) fn of(l: &IovList<'_>) -> ReadIovs {
        let mut r = ReadIovs {
            n: 0,
            v: [NO_IOV; IOV_LIMIT],
        };
        for (slot, iov) in r.v.iter_mut().zip(l.iter()) {
            *slot = iov;
            r.n += 1;
        }
        r
    }

    pub(super) fn as_slice(&self) -> &[RemoteIov] {
        self.v.get(..self.n).unwrap_or(&[])
    }

    pub(super) fn total(&self) -> Option<u64> {
        self.as_slice()
            .iter()
            .try_fold(0u64, |a, i| a.checked_add(i.len))
    }
}

/// The remote ranges that hold bytes `from..to` of the concatenation of `iovs`, each at most
/// `seg` long and within one iov; `None` when the iovs end before `to`.
pub(super) fn carve(
    iovs: &[RemoteIov],
    from: usize,
    to: usize,
    seg: usize,
) -> Option<Vec<RemoteIov>> {
    let (mut pos, to, seg) = (from as u64, to as u64, seg.max(1) as u64);
    let mut out = Vec::new();
    let mut base = 0u64;
    for iov in iovs {
        if pos >= to {
            break;
        }
        let end = base.checked_add(iov.len)?;
        while pos < to && pos < end {
            let n = (end.min(to) - pos).min(seg);
            out.push(RemoteIov {
                addr: iov.addr.checked_add(pos - base)?,
                len: n,
                key: iov.key,
            });
            pos += n;
        }
        base = end;
    }
    (pos >= to).then_some(out)
}

/// A destination buffer cut into pieces that are read separately.
#[derive(Debug, Default)]
pub(super) struct Pieces {
    /// Expected length and buffer of each piece (`None` while it is on the device).
    pub(super) bufs: Vec<(usize, Option<BytesMut>)>,
    /// The capacity beyond the last piece.
    pub(super) rest: BytesMut,
    /// Pieces not completed yet.
    pub(super) outstanding: usize,
    /// The first failure.
    pub(super) error: Option<Status>,
}

impl Pieces {
    /// Cuts `buf` (capacity at least `start + Σ lens`): `buf` keeps `..start`, the pieces follow.
    pub(super) fn cut(buf: &mut BytesMut, start: usize, lens: &[usize]) -> (Pieces, Vec<BytesMut>) {
        let end = start + lens.iter().sum::<usize>();
        let rest = buf.split_off(end);
        let mut tail = buf.split_off(start);
        let mut out = Vec::with_capacity(lens.len());
        for &n in lens {
            let next = tail.split_off(n);
            out.push(std::mem::replace(&mut tail, next));
        }
        let pieces = Pieces {
            bufs: lens.iter().map(|&n| (n, None)).collect(),
            rest,
            outstanding: lens.len(),
            error: None,
        };
        (pieces, out)
    }

    /// The pieces of a read of `lens` bytes from offset `start` on, and the work request each
    /// makes: slices of `region` (the buffer stays whole) when there is one, else pieces cut
    /// from `buf`.
    pub(super) fn targets(
        buf: &mut BytesMut,
        region: Option<&RegionSlice>,
        start: usize,
        lens: &[usize],
    ) -> (Pieces, Vec<WrWhat>) {
        let Some(g) = region else {
            let (pieces, bufs) = Pieces::cut(buf, start, lens);
            let what = bufs
                .into_iter()
                .enumerate()
                .map(|(piece, b)| WrWhat::Read {
                    piece,
                    buf: Some(b),
                    region: None,
                })
                .collect();
            return (pieces, what);
        };
        let mut off = start;
        let what = lens
            .iter()
            .enumerate()
            .map(|(piece, &n)| {
                let region = g.sub(off, n);
                off += n;
                WrWhat::Read {
                    piece,
                    buf: None,
                    region,
                }
            })
            .collect();
        let pieces = Pieces {
            bufs: lens.iter().map(|&n| (n, None)).collect(),
            rest: BytesMut::new(),
            outstanding: lens.len(),
            error: None,
        };
        (pieces, what)
    }

    /// A piece came back (or will not: `buf` is `None`).
    pub(super) fn put(&mut self, i: usize, buf: Option<BytesMut>, status: Status) {
        if let Some(slot) = self.bufs.get_mut(i) {
            if slot.1.is_none() {
                slot.1 = buf;
            }
        }
        self.outstanding = self.outstanding.saturating_sub(1);
        if !status.is_ok() && self.error.is_none() {
            self.error = Some(status);
        }
    }

    /// `head` (made `start` long), the pieces and the spare capacity, joined again; a piece
    /// that did not come back is replaced by zeros.
    pub(super) fn join(self, mut head: BytesMut, start: usize) -> BytesMut {
        if head.len() != start {
            head.resize(start, 0);
        }
        for (n, b) in self.bufs {
            let mut b = b.unwrap_or_else(|| BytesMut::zeroed(n));
            if b.len() != n {
                b.resize(n, 0);
            }
            head.unsplit(b);
        }
        head.unsplit(self.rest);
        head
    }
}

/// Who a work request serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WrOwner {
    /// A device RMA operation (`ReadState::ops`).
    Op(u32),
    /// The reads of a long/runting-read message (`Engine::rx`, by `recv_id`).
    Rx(u32),
    /// The reads of a LONGREAD_RTW target (`ReadState::rtw`).
    Rtw(u32),
}

#[derive(Debug)]
pub(super) enum WrWhat {
    /// Bytes `off..end` of the operation's buffer.
    Write {
        off: usize,
        end: usize,
        imm: Option<u32>,
    },
    /// Piece `piece`; its buffer (`None` once on the device, or allocated when posted), or
    /// the slice of the operation's region it lands in.
    Read {
        piece: usize,
        buf: Option<BytesMut>,
        region: Option<RegionSlice>,
    },
}

/// One RDMA work request, queued or on the device.
#[derive(Debug)]
pub(super) struct Wr {
    pub(super) owner: WrOwner,
    pub(super) peer: u64,
    pub(super) dest: RawAddr,
    pub(super) remote: RemoteIov,
    pub(super) what: WrWhat,
    /// RNR completions met (writes with immediate data).
    pub(super) rnr: u8,
    /// `UnknownPeer` (EFA status 14: the target holds no AH for us) completions met.
    pub(super) no_ah: u8,
}

impl Wr {
    /// A work request of `owner` towards peer `pid` at `dest`, before any retry.
    pub(super) fn new(
        owner: WrOwner,
        peer: u64,
        dest: RawAddr,
        remote: RemoteIov,
        what: WrWhat,
    ) -> Wr {
        Wr {
            owner,
            peer,
            dest,
            remote,
            what,
            rnr: 0,
            no_ah: 0,
        }
    }
}

/// Where a long/runting-read message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Not matched yet.
    Idle,
    /// Reads on the device (or queued for it).
    Reading,
    /// Read (or nothing to read): EOR sent.
    Done,
    /// Cannot read: READ_NACK goes once the runt has arrived.
    NackPending,
    /// READ_NACK sent: waiting for the sender's long-CTS REQ.
    Nacked,
}

/// The read state of an inbound long/runting-read message (`RxEntry::read`).
#[derive(Debug)]
pub(super) struct RxRead {
    pub(super) send_id: u32,
    pub(super) iovs: ReadIovs,
    /// The reads start here: the runt (bytes sent in packets) is before.
    pub(super) start: usize,
    pub(super) phase: Phase,
    pub(super) pieces: Pieces,
}

impl RxRead {
    pub(super) fn new(kind: Kind, iovs: ReadIovs) -> Option<Box<RxRead>> {
        let (send_id, start) = match kind {
            Kind::LongRead { send_id } => (send_id, 0),
            Kind::RuntRead { send_id, runt } => {
                (send_id, usize::try_from(runt).unwrap_or(usize::MAX))
            }
            _ => return None,
        };
        Some(Box::new(RxRead {
            send_id,
            iovs,
            start,
            phase: Phase::Idle,
            pieces: Pieces::default(),
        }))
    }

    /// Reads are on the device: the receive is not stalled.
    pub(super) fn reading(&self) -> bool {
        self.phase == Phase::Reading
    }
}

/// The read-based protocol a message uses.
#[derive(Clone, Copy, Debug)]
pub(super) enum ReadProto {
    Long(RemoteIov),
    Runt(RemoteIov, usize),
}

#[cfg(test)]
mod tests {
    use super::{Pieces, carve};
    use crate::device::RemoteIov;
    use bytes::BytesMut;

    fn iov(addr: u64, len: u64, key: u64) -> RemoteIov {
        RemoteIov { addr, len, key }
    }

    #[test]
    fn carve_splits_at_iovs_and_segments() {
        let iovs = [iov(1000, 10, 1), iov(5000, 20, 2)];
        let v = carve(&iovs, 4, 26, 8).unwrap();
        assert_eq!(v, vec![iov(1004, 6, 1), iov(5000, 8, 2), iov(5008, 8, 2)]);
        assert_eq!(carve(&iovs, 0, 31, 100), None, "beyond the iovs");
        assert_eq!(carve(&iovs, 7, 7, 100), Some(vec![]));
    }

    #[test]
    fn pieces_join_without_copying() {
        let mut buf = BytesMut::with_capacity(100);
        buf.extend_from_slice(b"abc");
        let base = buf.as_ptr();
        let (p, bufs) = Pieces::cut(&mut buf, 10, &[30, 30, 5]);
        assert_eq!(buf.capacity(), 10);
        let mut p = p;
        for (i, mut b) in bufs.into_iter().enumerate() {
            let n = b.capacity();
            b.extend(std::iter::repeat_n(b'0' + i as u8, n));
            p.put(i, Some(b), crate::device::Status::Success);
        }
        let out = p.join(buf, 10);
        assert_eq!(out.len(), 75);
        assert_eq!(out.capacity(), 100);
        assert_eq!(out.as_ptr(), base, "joined in place");
        assert_eq!(&out[..3], b"abc");
        assert_eq!(&out[3..10], &[0; 7]);
        assert!(out[10..40].iter().all(|&c| c == b'0'));
        assert!(out[70..75].iter().all(|&c| c == b'2'));
    }
}
