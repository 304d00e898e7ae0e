//! Device RDMA and the read-based protocols:
//!
//! * **device RMA**: `RmaKind::Write` / `RmaKind::Read` towards a peer where both sides advertised
//!   RDMA write / read go to the device as one-sided work requests ([`TransmitKind::RdmaWrite`] /
//!   [`TransmitKind::RdmaRead`]), split at `max_rdma_size`; before the peer's HANDSHAKE such an
//!   operation waits for it (a 0-byte EAGER_RTW makes the peer send it), as libfabric does;
//! * **LONGREAD_RTW**: a long write from a registered buffer, read by the target, then EOR;
//! * **LONGREAD_RTM / RUNTREAD_RTM**: large messages from a registered buffer, read by the
//!   receiver (after a runt sent in packets), then EOR;
//! * **READ_NACK**: a receiver that cannot read makes the sender fall back to long-CTS (messages)
//!   or to the emulated write (LONGREAD_RTW).
//!
//! The choices are described in `docs/protocol.md`, "Device RDMA and the read-based protocols".
//!
//! Buffers are never copied for device reads: the user's buffer is cut into pieces
//! ([`BytesMut::split_off`]), each piece goes to the device and comes back in its completion, and
//! the pieces are joined again ([`BytesMut::unsplit`], which is O(1) for neighbouring pieces).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use slab::Slab;

use super::peer::peer_fatal;
use super::rx::{Kind, RxEntry, RxState};
use super::tx::{MsgHdr, Owner, Pkt, Proto, medium_segments};
use super::util::IdMap;
use super::{
    Engine, Error, ErrorKind, Event, RemoteWriteDone, RmaBuf, RmaDone, RmaKind, RmaMemory, RmaOp,
    RmaPath, SendOp, Transmit, TransmitKind,
};
use crate::addr::RawAddr;
use crate::device::{RemoteIov, Source, Status};
use crate::proto::wire::{ExtraFeature, IOV_LIMIT, IovList, Packet, PacketType, ReqOpt, Sender};

/// Marks the `wr_id`s of RDMA work requests (those of packets have bit 63 clear).
const RDMA_WR: u64 = 1 << 63;
/// Largest piece of a device write (libfabric's `efa_write_segment_size`).
const WRITE_SEGMENT: u64 = 1 << 30;
/// Largest piece a LONGREAD_RTW target reads at once: its buffer is held until written into
/// the memory, so this bounds what a peer makes the target allocate per work request.
const RTW_SEGMENT: usize = 1 << 20;
/// RMA operations that may wait for HANDSHAKEs at once
/// (`EFA_RDM_MAX_QUEUED_OPE_BEFORE_HANDSHAKE`); beyond, `Again`.
const MAX_QUEUED_BEFORE_HANDSHAKE: usize = 16;
/// Runt sizes are multiples of this (host memory alignment, as medium segments).
const RUNT_ALIGN: usize = 8;
/// Retry of a write into memory the application holds locked (`RmaMemory` said `Again`).
const MEMORY_RETRY: Duration = Duration::from_micros(20);

const NO_IOV: RemoteIov = RemoteIov {
    addr: 0,
    len: 0,
    key: 0,
};

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

    fn as_slice(&self) -> &[RemoteIov] {
        self.v.get(..self.n).unwrap_or(&[])
    }

    fn total(&self) -> Option<u64> {
        self.as_slice()
            .iter()
            .try_fold(0u64, |a, i| a.checked_add(i.len))
    }
}

/// The remote ranges that hold bytes `from..to` of the concatenation of `iovs`, each at most
/// `seg` long and within one iov; `None` when the iovs end before `to`.
fn carve(iovs: &[RemoteIov], from: usize, to: usize, seg: usize) -> Option<Vec<RemoteIov>> {
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
struct Pieces {
    /// Expected length and buffer of each piece (`None` while it is on the device).
    bufs: Vec<(usize, Option<BytesMut>)>,
    /// The capacity beyond the last piece.
    rest: BytesMut,
    /// Pieces not completed yet.
    outstanding: usize,
    /// The first failure.
    error: Option<Status>,
}

impl Pieces {
    /// Cuts `buf` (capacity at least `start + Σ lens`): `buf` keeps `..start`, the pieces follow.
    fn cut(buf: &mut BytesMut, start: usize, lens: &[usize]) -> (Pieces, Vec<BytesMut>) {
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

    /// A piece came back (or will not: `buf` is `None`).
    fn put(&mut self, i: usize, buf: Option<BytesMut>, status: Status) {
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
    fn join(self, mut head: BytesMut, start: usize) -> BytesMut {
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
enum WrOwner {
    /// A device RMA operation (`ReadState::ops`).
    Op(u32),
    /// The reads of a long/runting-read message (`Engine::rx`, by `recv_id`).
    Rx(u32),
    /// The reads of a LONGREAD_RTW target (`ReadState::rtw`).
    Rtw(u32),
}

#[derive(Debug)]
enum WrWhat {
    /// Bytes `off..end` of the operation's buffer.
    Write {
        off: usize,
        end: usize,
        imm: Option<u32>,
    },
    /// Piece `piece`; its buffer (`None` once on the device, or allocated when posted).
    Read { piece: usize, buf: Option<BytesMut> },
}

/// One RDMA work request, queued or on the device.
#[derive(Debug)]
struct Wr {
    owner: WrOwner,
    peer: u64,
    dest: RawAddr,
    remote: RemoteIov,
    what: WrWhat,
    /// RNR completions met (writes with immediate data).
    rnr: u8,
    wr_id: u64,
}

/// An RMA operation of this module.
#[derive(Debug)]
enum DevOp {
    /// Waits for the peer's HANDSHAKE to choose its protocol.
    Waiting { peer: u64, op: RmaOp },
    /// Device write: `pending` work requests on the device or queued; with immediate data the
    /// last piece is `held` until the others completed, so that the target's completion means
    /// all the data is in place.
    Write {
        peer: u64,
        context: u64,
        buf: Bytes,
        pending: usize,
        held: Option<Wr>,
        error: Option<Status>,
    },
    /// Device read into the pieces of the user's buffer.
    Read {
        peer: u64,
        context: u64,
        len: usize,
        pieces: Pieces,
    },
    /// LONGREAD_RTW sent: waits for EOR (or READ_NACK).
    LongReadRtw { peer: u64, op: RmaOp, len: usize },
}

impl DevOp {
    fn peer(&self) -> u64 {
        match self {
            DevOp::Waiting { peer, .. }
            | DevOp::Write { peer, .. }
            | DevOp::Read { peer, .. }
            | DevOp::LongReadRtw { peer, .. } => *peer,
        }
    }
}

/// The target of a LONGREAD_RTW: reads the initiator's buffer and writes it into the memory.
#[derive(Debug)]
struct RtwTarget {
    peer: u64,
    send_id: u32,
    len: usize,
    /// Where the data goes here.
    rma: ReadIovs,
    /// Remote CQ data (`fi_writedata`).
    data: Option<u32>,
    /// Message offset of each piece.
    offs: Vec<usize>,
    pieces: Pieces,
    /// Pieces read and not yet written (the memory said `Again`).
    unwritten: Vec<(usize, BytesMut)>,
}

/// Where a long/runting-read message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
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
    send_id: u32,
    iovs: ReadIovs,
    /// The reads start here: the runt (bytes sent in packets) is before.
    start: usize,
    phase: Phase,
    pieces: Pieces,
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

/// A read-based message we send.
#[derive(Debug)]
struct TxRead {
    /// Runt bytes not yet completed (counted in the peer's `runt_in_flight`).
    runt_left: usize,
    /// Counted in `ReadState::read_msgs` (EOR or READ_NACK still to come).
    reading: bool,
}

/// The read-based protocol a message uses.
#[derive(Clone, Copy, Debug)]
pub(super) enum ReadProto {
    Long(RemoteIov),
    Runt(RemoteIov, usize),
}

/// Where an RMA operation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Device,
    LongReadRtw,
    Emulated,
}

/// The state of this module in the engine (`Engine::rd`).
#[derive(Debug, Default)]
pub(super) struct ReadState {
    ops: IdMap<u32, DevOp>,
    /// Operations in `ops` waiting for a HANDSHAKE.
    waiting: usize,
    /// Work requests waiting for room on the device.
    wrs: VecDeque<Wr>,
    /// Work requests on the device, by the low 32 bits of their `wr_id`.
    outstanding: Slab<Wr>,
    seq: u32,
    rtw: IdMap<u32, RtwTarget>,
    next_rtw: u32,
    /// Our read-based messages whose EOR or READ_NACK has not come (libfabric's
    /// `num_read_msg_in_flight`; runting reads are used only when it is 0).
    read_msgs: usize,
    tx_read: IdMap<u32, TxRead>,
    /// Alternates work requests and packets in `poll_transmit`.
    turn: bool,
    /// The queue pair has unsolicited write-recv.
    unsolicited: bool,
    /// When to retry writes into locked memory.
    pub(super) timer: Option<Instant>,
}

fn dev_error(s: Status) -> Error {
    Error::new(s.error_kind(), "rma").with_detail(format!("device status {s}"))
}

fn rma_buf(kind: RmaKind) -> RmaBuf {
    match kind {
        RmaKind::Write { buf, .. } => RmaBuf::Write(buf),
        RmaKind::Read { buf } => RmaBuf::Read(buf),
        RmaKind::Atomic { operand, fetch, .. } => RmaBuf::Atomic { operand, fetch },
    }
}

/// Writes `data`, bytes `off..` of a write, into the ranges `rma` of `mem`.
fn write_range(mem: &dyn RmaMemory, rma: &ReadIovs, off: usize, data: &[u8]) -> Result<(), Error> {
    let ranges = carve(rma.as_slice(), off, off + data.len(), usize::MAX)
        .ok_or_else(|| Error::new(ErrorKind::RemoteAccess, "rma").with_detail("beyond rma_iov"))?;
    let mut pos = 0usize;
    for r in ranges {
        let n = r.len as usize;
        let part = data.get(pos..pos + n).unwrap_or(&[]);
        mem.write(r.key, r.addr, part)?;
        pos += n;
    }
    Ok(())
}

impl Engine {
    /// Tells the engine whether its queue pair lets RDMA writes with immediate data land without
    /// a posted receive buffer ([`DeviceCaps::unsolicited_write_recv`]
    /// (crate::device::DeviceCaps)): advertised in the HANDSHAKE (with RDMA write), and device
    /// writes with immediate data are used only towards peers with the same setting, as
    /// libfabric. Default false. (An addition to the declared API.)
    pub fn set_unsolicited_write_recv(&mut self, on: bool) {
        self.rd.unsolicited = on;
    }

    pub(super) fn rd_unsolicited_write_recv(&self) -> bool {
        self.rd.unsolicited
    }

    /// RMA operations of this module in flight (counted as operations in `Resources::tx_ops`).
    pub(super) fn rd_ops(&self) -> usize {
        self.rd.ops.len()
    }

    /// RDMA work requests waiting for room on the device.
    pub(super) fn rd_queued_wrs(&self) -> usize {
        self.rd.wrs.len()
    }

    /// Packets and RDMA work requests on the device (bounded by `max_outstanding_tx`).
    pub(super) fn wrs_outstanding(&self) -> usize {
        self.outstanding.len() + self.rd.outstanding.len()
    }

    fn segment(&self, limit: u64) -> usize {
        let limit = if limit == 0 { WRITE_SEGMENT } else { limit };
        let seg = match self.cfg.max_rdma_size {
            0 => limit,
            m => limit.min(m),
        };
        usize::try_from(seg).unwrap_or(usize::MAX)
    }

    /// Largest piece of a read: `min(inter_read_segment_size, max_rdma_size)` (`max_rdma_size`
    /// 0: no limit of its own).
    fn read_segment(&self) -> usize {
        self.segment(self.cfg.inter_read_segment_size as u64)
    }

    /// Largest piece of a device write: `min(1 GiB, max_rdma_size)`.
    fn write_segment(&self) -> usize {
        self.segment(WRITE_SEGMENT)
    }

    /// Both sides can RDMA-read: this side's device and configuration, and the peer's
    /// HANDSHAKE (feature bit and p2p) — libfabric's `efa_both_support_rdma_read`. Towards
    /// ourselves only this side counts.
    pub(super) fn both_read(&self, pid: u64) -> bool {
        self.cfg.device_rdma_read
            && self.peers.get(&pid).is_some_and(|p| {
                p.addr == self.local
                    || (p.hs_received && p.p2p && p.features.has(ExtraFeature::RdmaRead))
            })
    }

    /// Both sides can RDMA-write (`efa_both_support_rdma_write`).
    fn both_write(&self, pid: u64) -> bool {
        self.cfg.device_rdma_write
            && self.peers.get(&pid).is_some_and(|p| {
                p.addr == self.local
                    || (p.hs_received && p.p2p && p.features.has(ExtraFeature::RdmaWrite))
            })
    }

    /// A write with immediate data may go to the device: both sides agree on unsolicited
    /// write-recv.
    fn imm_ok(&self, pid: u64) -> bool {
        self.peers.get(&pid).is_some_and(|p| {
            p.addr == self.local
                || p.features.has(ExtraFeature::UnsolicitedWriteRecv) == self.rd.unsolicited
        })
    }

    /// Where `op` goes, once the peer's HANDSHAKE is known.
    fn rma_route(&self, pid: u64, op: &RmaOp) -> Route {
        match &op.kind {
            RmaKind::Write { buf, data } => {
                if self.both_write(pid) && (data.is_none() || self.imm_ok(pid)) {
                    Route::Device
                } else if op.local_key.is_some()
                    && !buf.is_empty()
                    && buf.len() >= self.cfg.inter_min_read_write_size
                    && self.both_read(pid)
                {
                    Route::LongReadRtw
                } else {
                    Route::Emulated
                }
            }
            RmaKind::Read { .. } if self.both_read(pid) => Route::Device,
            _ => Route::Emulated,
        }
    }

    /// Whether this side could run `op` with the device (or LONGREAD_RTW) at all.
    fn rma_could_use_device(&self, op: &RmaOp) -> bool {
        match &op.kind {
            RmaKind::Write { buf, .. } => {
                self.cfg.device_rdma_write
                    || (self.cfg.device_rdma_read
                        && op.local_key.is_some()
                        && !buf.is_empty()
                        && buf.len() >= self.cfg.inter_min_read_write_size)
            }
            RmaKind::Read { .. } => self.cfg.device_rdma_read,
            RmaKind::Atomic { .. } => false,
        }
    }

    fn validate_rma(op: &RmaOp) -> Result<(), Error> {
        match &op.kind {
            RmaKind::Write { buf, .. } if buf.len() as u64 != op.remote.len => {
                Err(Error::new(ErrorKind::InvalidArgument, "rma")
                    .with_detail("the write's length differs from the remote range"))
            }
            RmaKind::Read { buf } if (buf.capacity() as u64) < op.remote.len => {
                Err(Error::new(ErrorKind::InvalidArgument, "rma")
                    .with_detail("the read buffer is smaller than the remote range"))
            }
            _ => Ok(()),
        }
    }

    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value"
    )]
    fn rma_again<T>(&mut self, op: RmaOp, why: &'static str) -> Result<T, (Error, RmaOp)> {
        self.stats.again += 1;
        Err((Error::new(ErrorKind::Again, "rma").with_detail(why), op))
    }

    fn new_op_id(&mut self) -> u32 {
        loop {
            let id = self.alloc_tx_id();
            if !self.rd.ops.contains_key(&id) {
                return id;
            }
        }
    }

    /// The device part of [`Engine::rma`]: starts `op` with device RDMA (or LONGREAD_RTW), or
    /// queues it until the peer's HANDSHAKE says which, and returns `Ok(None)`; hands the
    /// operation back (`Ok(Some)`) when it must be emulated (atomics, no RDMA on this side or
    /// the peer's, writes with immediate data across an unsolicited write-recv mismatch).
    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value"
    )]
    pub(super) fn try_device_rma(
        &mut self,
        now: Instant,
        op: RmaOp,
    ) -> Result<Option<RmaOp>, (Error, RmaOp)> {
        if self.closed {
            return Err((Engine::closed_error("rma"), op));
        }
        if !self.rma_could_use_device(&op) {
            return Ok(Some(op));
        }
        if !self.backoff.is_empty() {
            self.expire_backoffs(now);
        }
        let Some(pid) = self.peer_for_send(op.dest) else {
            let e = Error::new(ErrorKind::NoMemory, "rma").with_detail("peer table full");
            return Err((e, op));
        };
        let Some(p) = self.peers.get(&pid) else {
            return Err((Error::new(ErrorKind::Io, "rma"), op));
        };
        let known = p.hs_received || p.addr == self.local;
        let backoff = p.backoff_until.is_some();
        if known && self.rma_route(pid, &op) == Route::Emulated {
            return Ok(Some(op));
        }
        if let Err(e) = Self::validate_rma(&op) {
            return Err((e, op));
        }
        if self.tx.len() + self.rd.ops.len() >= self.cfg.max_tx_ops {
            return self.rma_again(op, "max_tx_ops operations in flight");
        }
        if backoff {
            return self.rma_again(op, "peer in RNR backoff");
        }
        if !known {
            if self.rd.waiting >= MAX_QUEUED_BEFORE_HANDSHAKE {
                return self.rma_again(op, "too many operations waiting for handshakes");
            }
            let id = self.new_op_id();
            self.rd.ops.insert(id, DevOp::Waiting { peer: pid, op });
            self.rd.waiting += 1;
            self.trigger_handshake(pid);
            return Ok(None);
        }
        Ok(self.start_rma(pid, op))
    }

    /// Starts `op` on the route its peer allows; hands it back when that is the emulation.
    fn start_rma(&mut self, pid: u64, op: RmaOp) -> Option<RmaOp> {
        match self.rma_route(pid, &op) {
            Route::Emulated => Some(op),
            Route::Device => self.start_device(pid, op),
            Route::LongReadRtw => self.start_longread_rtw(pid, op),
        }
    }

    /// Queues the work requests of a device write or read.
    fn start_device(&mut self, pid: u64, op: RmaOp) -> Option<RmaOp> {
        if matches!(op.kind, RmaKind::Atomic { .. }) {
            return Some(op);
        }
        let Some(dest) = self.peers.get(&pid).map(|p| p.addr) else {
            return Some(op);
        };
        let id = self.new_op_id();
        let RmaOp {
            remote,
            kind,
            context,
            ..
        } = op;
        let wr = |remote: RemoteIov, what: WrWhat| Wr {
            owner: WrOwner::Op(id),
            peer: pid,
            dest,
            remote,
            what,
            rnr: 0,
            wr_id: 0,
        };
        let piece = |off: usize, n: usize| RemoteIov {
            addr: remote.addr.wrapping_add(off as u64),
            len: n as u64,
            key: remote.key,
        };
        match kind {
            RmaKind::Write { buf, data } => {
                let seg = self.write_segment();
                let len = buf.len();
                let n = if len == 0 { 1 } else { (len - 1) / seg + 1 };
                let mut wrs: Vec<Wr> = (0..n)
                    .map(|i| {
                        let off = i * seg;
                        let end = (off + seg).min(len);
                        let imm = if i + 1 == n { data } else { None };
                        wr(piece(off, end - off), WrWhat::Write { off, end, imm })
                    })
                    .collect();
                let held = if data.is_some() && n > 1 {
                    wrs.pop()
                } else {
                    None
                };
                let pending = wrs.len();
                self.rd.wrs.extend(wrs);
                self.rd.ops.insert(
                    id,
                    DevOp::Write {
                        peer: pid,
                        context,
                        buf,
                        pending,
                        held,
                        error: None,
                    },
                );
            }
            RmaKind::Read { mut buf } => {
                let len = usize::try_from(remote.len).unwrap_or(usize::MAX);
                let seg = self.read_segment();
                let lens: Vec<usize> = if len == 0 {
                    vec![0]
                } else {
                    (0..len).step_by(seg).map(|o| seg.min(len - o)).collect()
                };
                buf.clear();
                let (pieces, bufs) = Pieces::cut(&mut buf, 0, &lens);
                let mut off = 0;
                for (i, (b, &n)) in bufs.into_iter().zip(&lens).enumerate() {
                    let what = WrWhat::Read {
                        piece: i,
                        buf: Some(b),
                    };
                    self.rd.wrs.push_back(wr(piece(off, n), what));
                    off += n;
                }
                self.rd.ops.insert(
                    id,
                    DevOp::Read {
                        peer: pid,
                        context,
                        len,
                        pieces,
                    },
                );
            }
            RmaKind::Atomic { .. } => {}
        }
        None
    }

    /// Sends LONGREAD_RTW: the target reads our registered buffer (`local_key`).
    fn start_longread_rtw(&mut self, pid: u64, op: RmaOp) -> Option<RmaOp> {
        let (RmaKind::Write { buf, data }, Some((key, addr))) = (&op.kind, op.local_key) else {
            return Some(op);
        };
        let len = buf.len();
        let Some(hs) = self.peers.get(&pid).map(|p| p.hs_received) else {
            return Some(op);
        };
        let id = self.new_op_id();
        let read = [RemoteIov {
            addr,
            len: len as u64,
            key,
        }];
        let rma = [op.remote];
        let sender = if hs {
            Sender::Connid(self.local.qkey)
        } else {
            Sender::RawAddr(self.local)
        };
        let pkt = Packet::LongReadRtw {
            opt: ReqOpt {
                sender,
                cq_data: data.map(u64::from),
            },
            msg_length: len as u64,
            send_id: id,
            rma_iov: IovList::new(&rma),
            read_iov: IovList::new(&read),
        };
        let hdr = self.encode(&pkt)?;
        self.rd
            .ops
            .insert(id, DevOp::LongReadRtw { peer: pid, op, len });
        self.enqueue(Pkt::ctrl(pid, Owner::Rd(id), hdr), false, false);
        None
    }

    /// Makes a peer that does not know us send its HANDSHAKE: a 0-byte EAGER_RTW (libfabric's
    /// `efa_rdm_ep_trigger_handshake`), unless one of our REQs went to it already.
    fn trigger_handshake(&mut self, pid: u64) {
        let Some(p) = self.peers.get_mut(&pid) else {
            return;
        };
        if p.hs_received || p.hs_triggered || p.next_msg_id != 0 {
            return;
        }
        p.hs_triggered = true;
        let pkt = Packet::EagerRtw {
            opt: ReqOpt {
                sender: Sender::RawAddr(self.local),
                cq_data: None,
            },
            dc_send_id: None,
            rma_iov: IovList::EMPTY,
        };
        if let Some(hdr) = self.encode(&pkt) {
            self.enqueue(Pkt::ctrl(pid, Owner::Ctrl, hdr), true, false);
        }
    }

    /// The peer's HANDSHAKE arrived: the operations that waited for it choose their protocol,
    /// in the order they were started.
    pub(super) fn read_handshake_arrived(&mut self, now: Instant, pid: u64) {
        let mut ids: Vec<u32> = self
            .rd
            .ops
            .iter()
            .filter(|(_, o)| matches!(o, DevOp::Waiting { peer, .. } if *peer == pid))
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            let Some(DevOp::Waiting { op, .. }) = self.rd.ops.remove(&id) else {
                continue;
            };
            self.rd.waiting = self.rd.waiting.saturating_sub(1);
            if let Some(op) = self.start_rma(pid, op) {
                if let Err((e, op)) = self.rma_emulated(now, op) {
                    self.fail_rma_op(op, e);
                }
            }
        }
    }

    /// An error completion for an operation handed back by the emulation.
    fn fail_rma_op(&mut self, op: RmaOp, e: Error) {
        self.rma_event(
            op.context,
            rma_buf(op.kind),
            0,
            RmaPath::Emulated,
            Some(e),
            None,
        );
    }

    fn rma_event(
        &mut self,
        context: u64,
        buf: RmaBuf,
        len: usize,
        path: RmaPath,
        error: Option<Error>,
        status: Option<Status>,
    ) {
        match (&error, path) {
            (Some(e), _) => {
                self.stats.errors += 1;
                tracing::debug!(error = %e, "RMA operation failed");
            }
            (None, RmaPath::Device) => self.stats.device_rma_bytes += len as u64,
            (None, RmaPath::Emulated) => self.stats.emulated_rma_bytes += len as u64,
        }
        let len = if error.is_some() { 0 } else { len };
        self.events.push_back(Event::Rma(RmaDone {
            context,
            buf,
            len,
            path,
            error,
            status,
        }));
    }

    /// The completion of a finished (or failed: `forced`) operation of this module.
    fn finish_dev_op(&mut self, op: DevOp, forced: Option<(Error, Option<Status>)>) {
        let outcome = |dev: Option<Status>, forced: Option<(Error, Option<Status>)>| match forced {
            Some((e, s)) => (Some(e), s),
            None => match dev {
                Some(s) => (Some(dev_error(s)), Some(s)),
                None => (None, None),
            },
        };
        match op {
            DevOp::Write {
                context,
                buf,
                error,
                ..
            } => {
                let (err, st) = outcome(error, forced);
                let len = buf.len();
                self.rma_event(context, RmaBuf::Write(buf), len, RmaPath::Device, err, st);
            }
            DevOp::Read {
                context,
                len,
                pieces,
                ..
            } => {
                let (err, st) = outcome(pieces.error, forced);
                let mut b = pieces.join(BytesMut::new(), 0);
                if err.is_some() {
                    b.clear();
                }
                self.rma_event(context, RmaBuf::Read(b), len, RmaPath::Device, err, st);
            }
            DevOp::Waiting { op, .. } | DevOp::LongReadRtw { op, .. } => {
                let (err, st) = outcome(Some(Status::LocalQpInternalError), forced);
                self.rma_event(op.context, rma_buf(op.kind), 0, RmaPath::Emulated, err, st);
            }
        }
    }

    /// Ends operation `id` with an error; its queued work requests are withdrawn (their
    /// buffers come back), those on the device complete into nothing.
    fn abort_op(&mut self, id: u32, kind: ErrorKind, status: Option<Status>, why: &'static str) {
        let Some(mut op) = self.rd.ops.remove(&id) else {
            return;
        };
        let mut i = 0;
        while i < self.rd.wrs.len() {
            if self
                .rd
                .wrs
                .get(i)
                .is_some_and(|w| w.owner == WrOwner::Op(id))
            {
                if let Some(w) = self.rd.wrs.remove(i) {
                    if let (DevOp::Read { pieces, .. }, WrWhat::Read { piece, buf }) =
                        (&mut op, w.what)
                    {
                        pieces.put(piece, buf, Status::Flushed);
                    }
                }
            } else {
                i += 1;
            }
        }
        if matches!(op, DevOp::Waiting { .. }) {
            self.rd.waiting = self.rd.waiting.saturating_sub(1);
        }
        let e = Error::new(kind, "rma").with_detail(why);
        self.finish_dev_op(op, Some((e, status)));
    }

    /// The peer is gone: its RMA operations fail, the LONGREAD_RTW reads from it stop.
    pub(super) fn read_peer_failed(
        &mut self,
        pid: u64,
        kind: ErrorKind,
        status: Option<Status>,
        why: &'static str,
    ) {
        let mut ids: Vec<u32> = self
            .rd
            .ops
            .iter()
            .filter(|(_, o)| o.peer() == pid)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            self.abort_op(id, kind, status, why);
        }
        self.rd.rtw.retain(|_, t| t.peer != pid);
        self.rd.wrs.retain(|w| w.peer != pid);
    }

    /// `close()`: every operation of this module completes with `Canceled`.
    pub(super) fn read_close(&mut self) {
        let mut ids: Vec<u32> = self.rd.ops.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            self.abort_op(id, ErrorKind::Canceled, None, "endpoint closed");
        }
        self.rd.wrs.clear();
        self.rd.outstanding.clear();
        self.rd.rtw.clear();
        self.rd.tx_read.clear();
        self.rd.read_msgs = 0;
        self.rd.waiting = 0;
        self.rd.timer = None;
    }

    /// `poll_transmit`: packets and RDMA work requests take turns (the device's send queue
    /// holds both; `max_outstanding_tx` bounds them together).
    pub(super) fn poll_transmit_any(&mut self, now: Instant) -> Option<Transmit> {
        if self.rd.wrs.is_empty() {
            return self.poll_transmit_impl(now);
        }
        if self.closed || self.wrs_outstanding() >= self.cfg.max_outstanding_tx {
            return None;
        }
        if !self.backoff.is_empty() {
            self.expire_backoffs(now);
        }
        self.rd.turn = !self.rd.turn;
        if self.rd.turn {
            if let Some(t) = self.next_wr() {
                return Some(t);
            }
            self.poll_transmit_impl(now)
        } else {
            if let Some(t) = self.poll_transmit_impl(now) {
                return Some(t);
            }
            self.next_wr()
        }
    }

    /// The next RDMA work request for the device (skipping peers in RNR backoff).
    fn next_wr(&mut self) -> Option<Transmit> {
        loop {
            let peers = &self.peers;
            let i = self
                .rd
                .wrs
                .iter()
                .position(|w| peers.get(&w.peer).is_none_or(|p| p.backoff_until.is_none()))?;
            let mut w = self.rd.wrs.remove(i)?;
            let (payload, kind) = match &mut w.what {
                WrWhat::Write { off, end, imm } => {
                    let buf = match w.owner {
                        WrOwner::Op(id) => match self.rd.ops.get(&id) {
                            Some(DevOp::Write { buf, .. }) => buf,
                            _ => continue,
                        },
                        _ => continue,
                    };
                    if *off > *end || *end > buf.len() {
                        continue;
                    }
                    let kind = TransmitKind::RdmaWrite {
                        remote: w.remote,
                        imm: *imm,
                    };
                    (buf.slice(*off..*end), kind)
                }
                WrWhat::Read { buf, .. } => {
                    let n = usize::try_from(w.remote.len).unwrap_or(0);
                    let b = buf.take().unwrap_or_else(|| BytesMut::with_capacity(n));
                    let kind = TransmitKind::RdmaRead {
                        remote: w.remote,
                        buf: b,
                    };
                    (Bytes::new(), kind)
                }
            };
            self.rd.seq = self.rd.seq.wrapping_add(1);
            let entry = self.rd.outstanding.vacant_entry();
            let wr_id = RDMA_WR
                | (u64::from(self.rd.seq & 0x7fff_ffff) << 32)
                | (entry.key() as u64 & 0xffff_ffff);
            w.wr_id = wr_id;
            let dest = w.dest;
            entry.insert(w);
            return Some(Transmit {
                wr_id,
                dest,
                hdr: Bytes::new(),
                payload,
                kind,
            });
        }
    }

    /// [`Engine::handle_rdma_completion`].
    pub(super) fn rdma_completion_impl(
        &mut self,
        now: Instant,
        wr_id: u64,
        status: Status,
        buf: Option<BytesMut>,
    ) {
        if self.closed {
            return;
        }
        let key = (wr_id & 0xffff_ffff) as usize;
        if wr_id & RDMA_WR == 0
            || self
                .rd
                .outstanding
                .get(key)
                .is_none_or(|w| w.wr_id != wr_id)
        {
            tracing::debug!(wr_id, "RDMA completion for an unknown work request");
            return;
        }
        let mut w = self.rd.outstanding.remove(key);
        if status == Status::RnrRetryExceeded
            && matches!(w.what, WrWhat::Write { .. })
            && self.peers.contains_key(&w.peer)
        {
            // A write with immediate data found no receive buffer at the target: again at
            // once, backing off from its second RNR on (as packets).
            self.stats.rnr += 1;
            self.stats.retransmits += 1;
            w.rnr = w.rnr.saturating_add(1);
            let (again, pid) = (w.rnr > 1, w.peer);
            self.rd.wrs.push_front(w);
            if again {
                self.enter_backoff(pid, now);
            }
            return;
        }
        if let WrWhat::Read { buf: slot, .. } = &mut w.what {
            *slot = buf;
        }
        let pid = w.peer;
        match w.owner {
            WrOwner::Op(id) => self.op_wr_done(id, w, status),
            WrOwner::Rx(rid) => self.rx_wr_done(now, rid, w, status),
            WrOwner::Rtw(id) => self.rtw_wr_done(now, id, w, status),
        }
        if peer_fatal(status) && self.peers.contains_key(&pid) {
            self.fail_peer(pid, status.error_kind(), Some(status), "RDMA failed");
        }
    }

    fn op_wr_done(&mut self, id: u32, w: Wr, status: Status) {
        let Some(op) = self.rd.ops.get_mut(&id) else {
            return;
        };
        match op {
            DevOp::Write {
                pending,
                held,
                error,
                ..
            } => {
                *pending = pending.saturating_sub(1);
                if !status.is_ok() && error.is_none() {
                    *error = Some(status);
                }
                if *pending > 0 {
                    return;
                }
                if error.is_none() {
                    if let Some(last) = held.take() {
                        *pending = 1;
                        self.rd.wrs.push_back(last);
                        return;
                    }
                }
            }
            DevOp::Read { pieces, .. } => {
                if let WrWhat::Read { piece, buf } = w.what {
                    pieces.put(piece, buf, status);
                }
                if pieces.outstanding > 0 {
                    return;
                }
            }
            DevOp::Waiting { .. } | DevOp::LongReadRtw { .. } => return,
        }
        if let Some(op) = self.rd.ops.remove(&id) {
            self.finish_dev_op(op, None);
        }
    }

    /// [`Engine::handle_remote_write`]: one event per write with immediate data. The device
    /// names the writer by GID and QPN only: it is reported as that queue pair's newest
    /// incarnation (QKEY 0 when unknown).
    pub(super) fn remote_write_impl(&mut self, now: Instant, src: Source, imm: u32, len: usize) {
        let _ = now;
        if self.closed {
            return;
        }
        let addr = self
            .incarnations
            .get(&(src.gid, src.qpn))
            .and_then(|v| v.last())
            .and_then(|id| self.peers.get(id))
            .map_or(RawAddr::new(src.gid, src.qpn, 0), |p| p.addr);
        self.events.push_back(Event::RemoteWrite(RemoteWriteDone {
            src: addr,
            data: imm,
            len,
        }));
    }

    // ---- messages: the sender ----

    /// The read-based protocol for a send, if any (libfabric's `efa_rdm_msg_select_rtm`): the
    /// buffer is registered, the message is at least `inter_min_read_message_size`, both sides
    /// can RDMA-read (so never before the HANDSHAKE: then the size decides as usual). A runting
    /// read when no other read message is in flight, the runt is not zero and no delivery
    /// complete is asked for; else long read.
    pub(super) fn read_protocol(&self, pid: u64, op: &SendOp) -> Option<ReadProto> {
        let (key, addr) = op.read_key?;
        let len = op.buf.len();
        if len == 0 || len < self.cfg.inter_min_read_message_size || !self.both_read(pid) {
            return None;
        }
        let iov = RemoteIov {
            addr,
            len: len as u64,
            key,
        };
        let in_flight = self.peers.get(&pid)?.runt_in_flight;
        let runt = self.cfg.runt_size.saturating_sub(in_flight).min(len) & !(RUNT_ALIGN - 1);
        if self.rd.read_msgs == 0 && runt > 0 && !op.delivery_complete {
            Some(ReadProto::Runt(iov, runt))
        } else {
            Some(ReadProto::Long(iov))
        }
    }

    /// The packets of a read-based message: one LONGREAD_RTM, or the RUNTREAD_RTMs carrying
    /// the runt (split as medium segments).
    pub(super) fn packetize_read(
        &mut self,
        pkts: &mut Vec<Pkt>,
        m: &MsgHdr,
        len: usize,
        rp: ReadProto,
    ) -> Result<(Proto, usize), Error> {
        match rp {
            ReadProto::Long(iov) => {
                let iovs = [iov];
                let pkt = Packet::LongReadRtm {
                    opt: m.opt,
                    msg_id: m.msg_id,
                    msg_length: len as u64,
                    send_id: m.send_id,
                    tag: m.tag,
                    read_iov: IovList::new(&iovs),
                };
                self.push_pkt(pkts, m, &pkt, 0, 0)?;
                self.rd.read_msgs += 1;
                let tr = TxRead {
                    runt_left: 0,
                    reading: true,
                };
                self.rd.tx_read.insert(m.send_id, tr);
                Ok((Proto::LongRead, 0))
            }
            ReadProto::Runt(iov, runt) => {
                let iovs = [iov];
                let seg = |seg_offset: u64| Packet::RuntReadRtm {
                    opt: m.opt,
                    msg_id: m.msg_id,
                    msg_length: len as u64,
                    send_id: m.send_id,
                    seg_offset,
                    runt_length: runt as u64,
                    tag: m.tag,
                    read_iov: IovList::new(&iovs),
                };
                let cap = self.cfg.mtu.saturating_sub(seg(0).header_len());
                if cap == 0 {
                    return Err(
                        Error::new(ErrorKind::InvalidArgument, "send").with_detail("MTU too small")
                    );
                }
                let mut off = 0;
                for n in medium_segments(runt, cap) {
                    self.push_pkt(pkts, m, &seg(off as u64), off, off + n)?;
                    off += n;
                }
                let reading = runt < len;
                if reading {
                    self.rd.read_msgs += 1;
                }
                let tr = TxRead {
                    runt_left: runt,
                    reading,
                };
                self.rd.tx_read.insert(m.send_id, tr);
                if let Some(p) = self.peers.get_mut(&m.pid) {
                    p.runt_in_flight += runt;
                }
                Ok((Proto::RuntRead, runt))
            }
        }
    }

    /// A packet of send `id` completed: a runt's bytes are no longer in flight.
    pub(super) fn read_pkt_done(&mut self, id: u32, pkt: &Pkt) {
        let runt = [
            PacketType::RuntReadMsgRtm.id(),
            PacketType::RuntReadTagRtm.id(),
        ];
        if !pkt.hdr.bytes().first().is_some_and(|t| runt.contains(t)) {
            return;
        }
        let Some(tr) = self.rd.tx_read.get_mut(&id) else {
            return;
        };
        let n = pkt.end.saturating_sub(pkt.off).min(tr.runt_left);
        tr.runt_left -= n;
        if let Some(p) = self.peers.get_mut(&pkt.peer) {
            p.runt_in_flight = p.runt_in_flight.saturating_sub(n);
        }
    }

    /// Send `id` to `peer` is gone (completed or failed): its read bookkeeping too.
    pub(super) fn read_tx_gone(&mut self, id: u32, peer: u64) {
        let Some(tr) = self.rd.tx_read.remove(&id) else {
            return;
        };
        if tr.reading {
            self.rd.read_msgs = self.rd.read_msgs.saturating_sub(1);
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            p.runt_in_flight = p.runt_in_flight.saturating_sub(tr.runt_left);
        }
    }

    fn read_msg_answered(&mut self, send_id: u32) {
        if let Some(tr) = self.rd.tx_read.get_mut(&send_id) {
            if std::mem::take(&mut tr.reading) {
                self.rd.read_msgs = self.rd.read_msgs.saturating_sub(1);
            }
        }
    }

    /// A LONGREAD_RTW REQ failed on the device (not a peer failure): its operation fails.
    pub(super) fn read_req_failed(&mut self, id: u32, s: Status) {
        if let Some(op) = self.rd.ops.remove(&id) {
            self.finish_dev_op(op, Some((dev_error(s), Some(s))));
        }
    }

    /// EOR, READ_NACK and LONGREAD_RTW.
    pub(super) fn handle_read_pkt(
        &mut self,
        now: Instant,
        pid: u64,
        pkt: &Packet<'_>,
        payload: &[u8],
    ) {
        let _ = payload;
        match *pkt {
            Packet::Eor { send_id, .. } => self.handle_eor(pid, send_id),
            Packet::ReadNack {
                send_id, recv_id, ..
            } => self.handle_read_nack(now, pid, send_id, recv_id),
            Packet::LongReadRtw {
                ref opt,
                msg_length,
                send_id,
                ref rma_iov,
                ref read_iov,
            } => {
                let data = opt.cq_data.map(|d| d as u32);
                let (rma, read) = (ReadIovs::of(rma_iov), ReadIovs::of(read_iov));
                self.handle_longread_rtw(pid, data, msg_length, send_id, rma, read)
            }
            _ => self.drop_pkt_type(pkt),
        }
    }

    /// EOR: the receiver read a message (or the target of LONGREAD_RTW placed a write).
    fn handle_eor(&mut self, pid: u64, send_id: u32) {
        if let Some(t) = self.tx.get_mut(&send_id) {
            let reading = matches!(t.proto, Proto::LongRead | Proto::RuntRead);
            if t.peer != pid || !reading || t.scheduled >= t.buf.len() {
                return self.drop_pkt("EOR that does not match its send");
            }
            t.scheduled = t.buf.len();
            t.window_end = t.scheduled;
            self.read_msg_answered(send_id);
            return self.maybe_complete_tx(send_id);
        }
        let ours = matches!(self.rd.ops.get(&send_id),
            Some(DevOp::LongReadRtw { peer, .. }) if *peer == pid);
        if !ours {
            return self.drop_pkt("EOR for an unknown send_id");
        }
        if let Some(DevOp::LongReadRtw { op, len, .. }) = self.rd.ops.remove(&send_id) {
            self.rma_event(
                op.context,
                rma_buf(op.kind),
                len,
                RmaPath::Emulated,
                None,
                None,
            );
        }
    }

    /// READ_NACK: the receiver cannot read. A message goes on as long-CTS (a LONGCTS REQ with
    /// the READ_NACK flag and no data, then CTS / CTSDATA from where the runt ended); a
    /// LONGREAD_RTW starts again as an emulated write.
    fn handle_read_nack(&mut self, now: Instant, pid: u64, send_id: u32, recv_id: u32) {
        if let Some(t) = self.tx.get(&send_id) {
            let reading = matches!(t.proto, Proto::LongRead | Proto::RuntRead);
            if t.peer != pid || !reading || t.scheduled >= t.buf.len() {
                return self.drop_pkt("READ_NACK that does not match its send");
            }
            let hs = self.peers.get(&pid).is_some_and(|p| p.hs_received);
            let sender = if hs {
                Sender::Connid(self.local.qkey)
            } else {
                Sender::RawAddr(self.local)
            };
            let pkt = Packet::LongCtsRtm {
                opt: ReqOpt {
                    sender,
                    cq_data: None,
                },
                msg_id: t.msg_id,
                msg_length: t.buf.len() as u64,
                send_id,
                credit_request: u32::try_from(self.cfg.tx_min_credits).unwrap_or(u32::MAX),
                tag: t.tag,
                dc: t.dc,
                read_nack: true,
            };
            let at = t.scheduled;
            let Some(hdr) = self.encode(&pkt) else {
                let e = Error::new(ErrorKind::Io, "send").with_detail("packet encoding failed");
                return self.fail_tx(send_id, e, None);
            };
            self.read_msg_answered(send_id);
            if let Some(t) = self.tx.get_mut(&send_id) {
                tracing::debug!(send_id, "READ_NACK: the message goes on as long-CTS");
                t.proto = Proto::LongCts;
                t.window_end = t.scheduled;
                t.recv_id = recv_id;
                t.pending += 1;
            }
            self.enqueue(Pkt::new(pid, Owner::Tx(send_id), hdr, at, at), false, false);
            return;
        }
        let ours = matches!(self.rd.ops.get(&send_id),
            Some(DevOp::LongReadRtw { peer, .. }) if *peer == pid);
        if !ours {
            return self.drop_pkt("READ_NACK for an unknown send_id");
        }
        if let Some(DevOp::LongReadRtw { op, .. }) = self.rd.ops.remove(&send_id) {
            tracing::debug!(send_id, "READ_NACK: the write is emulated");
            if let Err((e, op)) = self.rma_emulated(now, op) {
                self.fail_rma_op(op, e);
            }
        }
    }

    // ---- messages: the receiver ----

    /// The message `rid` was matched: read what fits of its non-runt part, or NACK.
    pub(super) fn start_rx_read(&mut self, now: Instant, rid: u32) {
        let seg = self.read_segment();
        let can = self.cfg.device_rdma_read;
        let Some(e) = self.rx.get_mut(&rid) else {
            return;
        };
        let (pid, dest, msg_len) = (e.peer, e.src, e.msg_len);
        e.last = now;
        let (Some(r), RxState::Matched(sink)) = (e.read.as_mut(), &mut e.state) else {
            return;
        };
        if r.phase != Phase::Idle {
            return;
        }
        let start = r.start.min(msg_len);
        let end = sink.place;
        if start == msg_len {
            // The runt is the whole message: nothing to read, no EOR (libfabric reads, and
            // answers, only when the message is longer than its runt).
            r.phase = Phase::Done;
            return;
        }
        if end <= start {
            // Nothing of the read part fits (truncated, discarded): EOR at once.
            return self.rx_read_finished(rid);
        }
        let ranges = if can && sink.buf.capacity() >= end {
            carve(r.iovs.as_slice(), start, end, seg)
        } else {
            None
        };
        let Some(ranges) = ranges else {
            r.phase = Phase::NackPending;
            return self.maybe_nack(rid);
        };
        let lens: Vec<usize> = ranges.iter().map(|x| x.len as usize).collect();
        let (pieces, bufs) = Pieces::cut(&mut sink.buf, start, &lens);
        r.pieces = pieces;
        r.phase = Phase::Reading;
        for (i, (remote, b)) in ranges.into_iter().zip(bufs).enumerate() {
            self.rd.wrs.push_back(Wr {
                owner: WrOwner::Rx(rid),
                peer: pid,
                dest,
                remote,
                what: WrWhat::Read {
                    piece: i,
                    buf: Some(b),
                },
                rnr: 0,
                wr_id: 0,
            });
        }
    }

    fn rx_wr_done(&mut self, now: Instant, rid: u32, w: Wr, status: Status) {
        let WrWhat::Read { piece, buf } = w.what else {
            return;
        };
        let Some(e) = self.rx.get_mut(&rid) else {
            return;
        };
        e.last = now;
        let msg_len = e.msg_len;
        let (Some(r), state) = (e.read.as_mut(), &mut e.state) else {
            return;
        };
        if r.phase != Phase::Reading {
            return;
        }
        r.pieces.put(piece, buf, status);
        if r.pieces.outstanding > 0 {
            return;
        }
        // Every piece is back: the user's buffer is whole again.
        let pieces = std::mem::take(&mut r.pieces);
        let failed = pieces.error.is_some();
        if let RxState::Matched(sink) = state {
            let head = std::mem::take(&mut sink.buf);
            sink.buf = pieces.join(head, r.start.min(msg_len));
        }
        if self.stall_check.is_none() && self.rx_in_progress > 0 {
            self.stall_check = now.checked_add(self.cfg.rx_stall_timeout);
        }
        if failed {
            tracing::debug!(rid, "RDMA read of a message failed: READ_NACK");
            r.phase = Phase::NackPending;
            self.maybe_nack(rid);
        } else {
            self.rx_read_finished(rid);
        }
    }

    /// The read part is in place (or there was nothing to read): EOR, and the completion if
    /// the runt is in too.
    fn rx_read_finished(&mut self, rid: u32) {
        let qkey = self.local.qkey;
        let Some(e) = self.rx.get_mut(&rid) else {
            return;
        };
        let Some(r) = e.read.as_mut() else {
            return;
        };
        r.phase = Phase::Done;
        let (send_id, start) = (r.send_id, r.start.min(e.msg_len));
        // What did not fit counts as received, as for the packets of a truncated message.
        e.received += e.msg_len - start;
        let (pid, complete) = (e.peer, e.received >= e.msg_len);
        let eor = Packet::Eor {
            connid: Some(qkey),
            send_id,
            recv_id: rid,
        };
        self.queue_ctrl(pid, &eor);
        if complete {
            self.complete_rx(rid);
        }
    }

    /// Sends the READ_NACK of `rid` once its runt has all arrived (libfabric sends it after
    /// the last RUNTREAD packet: the long-CTS part then starts where the runt ends).
    fn maybe_nack(&mut self, rid: u32) {
        let qkey = self.local.qkey;
        let Some(e) = self.rx.get_mut(&rid) else {
            return;
        };
        let (received, msg_len, pid) = (e.received, e.msg_len, e.peer);
        let Some(r) = e.read.as_mut() else {
            return;
        };
        if r.phase != Phase::NackPending || received < r.start.min(msg_len) {
            return;
        }
        r.phase = Phase::Nacked;
        let nack = Packet::ReadNack {
            connid: Some(qkey),
            send_id: r.send_id,
            recv_id: rid,
        };
        self.queue_ctrl(pid, &nack);
    }

    /// A runt segment of `rid` arrived (and the message is not complete).
    pub(super) fn runt_progress(&mut self, rid: u32) {
        self.maybe_nack(rid);
    }

    /// The sender continues NACKed message `msg_id` as long-CTS: the entry becomes a long-CTS
    /// receive and asks for the rest.
    pub(super) fn handle_nack_rtm(
        &mut self,
        now: Instant,
        pid: u64,
        msg_id: u32,
        send_id: u32,
        dc: bool,
    ) {
        let Some(&rid) = self.peers.get(&pid).and_then(|p| p.inbound.get(&msg_id)) else {
            return self.drop_pkt("read-NACK REQ without a long-read message");
        };
        let Some(e) = self.rx.get_mut(&rid) else {
            return self.drop_pkt("read-NACK REQ without a long-read message");
        };
        let nacked = e
            .read
            .as_ref()
            .is_some_and(|r| r.phase == Phase::Nacked && r.send_id == send_id);
        if !nacked {
            return self.drop_pkt("read-NACK REQ for a message that was not NACKed");
        }
        e.read = None;
        e.kind = Kind::LongCts { send_id };
        e.dc_send_id = dc.then_some(send_id);
        e.last = now;
        if e.matched() {
            self.send_cts(rid);
        }
    }

    /// A matched entry with reads leaves (completion, failure, close): pieces not yet on the
    /// device come back into its buffer; those on the device are replaced by zeros (their
    /// completions find no entry).
    pub(super) fn read_entry_removed(&mut self, rid: u32, e: &mut RxEntry) {
        let msg_len = e.msg_len;
        let Some(r) = e.read.as_mut() else {
            return;
        };
        if r.phase != Phase::Reading {
            return;
        }
        let mut i = 0;
        while i < self.rd.wrs.len() {
            if self
                .rd
                .wrs
                .get(i)
                .is_some_and(|w| w.owner == WrOwner::Rx(rid))
            {
                if let Some(Wr {
                    what: WrWhat::Read { piece, buf },
                    ..
                }) = self.rd.wrs.remove(i)
                {
                    r.pieces.put(piece, buf, Status::Flushed);
                }
            } else {
                i += 1;
            }
        }
        r.phase = Phase::Done;
        let pieces = std::mem::take(&mut r.pieces);
        if let RxState::Matched(sink) = &mut e.state {
            let head = std::mem::take(&mut sink.buf);
            sink.buf = pieces.join(head, r.start.min(msg_len));
        }
    }

    // ---- LONGREAD_RTW: the target ----

    /// LONGREAD_RTW: read the initiator's buffer, write it into `rma_iov`, then EOR; READ_NACK
    /// when this side cannot (no RDMA read, no memory, a bad range or key here or there).
    fn handle_longread_rtw(
        &mut self,
        pid: u64,
        data: Option<u32>,
        msg_length: u64,
        send_id: u32,
        rma: ReadIovs,
        read: ReadIovs,
    ) {
        let nack = Packet::ReadNack {
            connid: Some(self.local.qkey),
            send_id,
            recv_id: 0,
        };
        let len = usize::try_from(msg_length).ok();
        let writable = match (&self.memory, len) {
            // The target range must exist before anything is read into it.
            (Some(mem), Some(_)) => {
                rma.total() == Some(msg_length) && {
                    rma.as_slice().iter().all(|r| {
                        mem.write(r.key, r.addr, &[]).is_ok()
                            && r.addr
                                .checked_add(r.len)
                                .is_some_and(|end| mem.write(r.key, end, &[]).is_ok())
                    })
                }
            }
            _ => false,
        };
        let seg = self.read_segment().min(RTW_SEGMENT);
        let ranges = match len {
            Some(len) if writable && self.cfg.device_rdma_read => {
                carve(read.as_slice(), 0, len, seg)
            }
            _ => None,
        };
        let (Some(len), Some(ranges)) = (len, ranges) else {
            tracing::debug!(send_id, "LONGREAD_RTW cannot be read here: READ_NACK");
            return self.queue_ctrl(pid, &nack);
        };
        if ranges.is_empty() {
            return self.rtw_finish(pid, send_id, len, data);
        }
        let Some(dest) = self.peers.get(&pid).map(|p| p.addr) else {
            return;
        };
        let id = loop {
            self.rd.next_rtw = self.rd.next_rtw.wrapping_add(1);
            if !self.rd.rtw.contains_key(&self.rd.next_rtw) {
                break self.rd.next_rtw;
            }
        };
        let mut offs = Vec::with_capacity(ranges.len());
        let mut off = 0usize;
        for r in &ranges {
            offs.push(off);
            off += r.len as usize;
        }
        let pieces = Pieces {
            bufs: ranges.iter().map(|r| (r.len as usize, None)).collect(),
            rest: BytesMut::new(),
            outstanding: ranges.len(),
            error: None,
        };
        for (i, remote) in ranges.into_iter().enumerate() {
            self.rd.wrs.push_back(Wr {
                owner: WrOwner::Rtw(id),
                peer: pid,
                dest,
                remote,
                what: WrWhat::Read {
                    piece: i,
                    buf: None,
                },
                rnr: 0,
                wr_id: 0,
            });
        }
        let t = RtwTarget {
            peer: pid,
            send_id,
            len,
            rma,
            data,
            offs,
            pieces,
            unwritten: Vec::new(),
        };
        self.rd.rtw.insert(id, t);
    }

    fn rtw_wr_done(&mut self, now: Instant, id: u32, w: Wr, status: Status) {
        let WrWhat::Read { piece, buf } = w.what else {
            return;
        };
        let Some(t) = self.rd.rtw.get_mut(&id) else {
            return;
        };
        let want = t.pieces.bufs.get(piece).map_or(0, |b| b.0);
        let off = t.offs.get(piece).copied().unwrap_or(0);
        let status = match buf {
            Some(b) if status.is_ok() && b.len() == want => {
                t.unwritten.push((off, b));
                status
            }
            _ if status.is_ok() => Status::LocalBadLength,
            _ => status,
        };
        t.pieces.put(piece, None, status);
        self.rtw_write_out(now, id);
    }

    /// Writes what LONGREAD_RTW target `id` read into the memory; when all is read and written,
    /// EOR (or READ_NACK after a failure).
    fn rtw_write_out(&mut self, now: Instant, id: u32) {
        let mem = self.memory.clone();
        let Some(t) = self.rd.rtw.get_mut(&id) else {
            return;
        };
        if t.pieces.error.is_none() {
            let mut keep = Vec::new();
            for (off, b) in std::mem::take(&mut t.unwritten) {
                let r = match &mem {
                    Some(m) => write_range(m.as_ref(), &t.rma, off, &b),
                    None => Err(Error::new(ErrorKind::RemoteAccess, "rma")),
                };
                match r {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::Again => keep.push((off, b)),
                    Err(_) => {
                        t.pieces.error = Some(Status::RemoteBadAddress);
                        break;
                    }
                }
            }
            t.unwritten = if t.pieces.error.is_none() {
                keep
            } else {
                Vec::new()
            };
        } else {
            t.unwritten.clear();
        }
        let waiting = !t.unwritten.is_empty();
        if t.pieces.outstanding > 0 || waiting {
            if waiting && self.rd.timer.is_none() {
                self.rd.timer = now.checked_add(MEMORY_RETRY);
            }
            return;
        }
        let Some(t) = self.rd.rtw.remove(&id) else {
            return;
        };
        if t.pieces.error.is_some() {
            tracing::debug!(send_id = t.send_id, "LONGREAD_RTW failed here: READ_NACK");
            let nack = Packet::ReadNack {
                connid: Some(self.local.qkey),
                send_id: t.send_id,
                recv_id: id,
            };
            return self.queue_ctrl(t.peer, &nack);
        }
        self.rtw_finish(t.peer, t.send_id, t.len, t.data);
    }

    /// A LONGREAD_RTW is in place: the remote CQ data (if any) is reported, EOR goes back.
    fn rtw_finish(&mut self, pid: u64, send_id: u32, len: usize, data: Option<u32>) {
        let Some(src) = self.peers.get(&pid).map(|p| p.addr) else {
            return;
        };
        if let Some(data) = data {
            self.events
                .push_back(Event::RemoteWrite(RemoteWriteDone { src, data, len }));
        }
        let eor = Packet::Eor {
            connid: Some(self.local.qkey),
            send_id,
            recv_id: 0,
        };
        self.queue_ctrl(pid, &eor);
    }

    /// Retries the writes into memory the application held locked.
    pub(super) fn read_timeout(&mut self, now: Instant) {
        self.rd.timer = None;
        let mut ids: Vec<u32> = self
            .rd
            .rtw
            .iter()
            .filter(|(_, t)| !t.unwritten.is_empty())
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            self.rtw_write_out(now, id);
        }
    }
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
