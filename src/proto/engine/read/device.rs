//! Device RMA: the route an RMA operation takes, its work requests, waiting for the peer's
//! HANDSHAKE, completions (`docs/protocol.md`, "Device RDMA and the read-based protocols").

use super::*;
use crate::proto::engine::EngineConfig;
use crate::proto::engine::peer::our_sender;

/// An RMA operation of this module.
#[derive(Debug)]
pub(super) enum DevOp {
    /// Waits for the peer's HANDSHAKE to choose its protocol.
    Waiting { peer: u64, op: RmaOp },
    /// Device write: `pending` work requests on the device or queued; with immediate data the
    /// last piece is `held` until the others completed, so that the target's completion means
    /// all the data is in place.
    Write {
        peer: u64,
        context: u64,
        buf: Bytes,
        /// The source is region memory (`RmaOp::local_region`); `buf` is empty.
        region: Option<RegionSlice>,
        pending: usize,
        held: Option<Wr>,
        error: Option<Status>,
    },
    /// Device read into the pieces of the user's buffer (or straight into a region).
    Read {
        peer: u64,
        context: u64,
        len: usize,
        pieces: Pieces,
        in_region: bool,
    },
    /// LONGREAD_RTW sent: waits for EOR (or READ_NACK).
    LongReadRtw { peer: u64, op: RmaOp, len: usize },
}

impl DevOp {
    /// Work requests `wrs` of this operation ended with `status` (completed by the device, or
    /// withdrawn before it had them): a write counts them off `pending` and keeps the first
    /// failure, a read takes their pieces back.
    #[inline]
    fn wrs_ended(&mut self, wrs: impl IntoIterator<Item = Wr>, status: Status) {
        match self {
            DevOp::Write { pending, error, .. } => {
                let n = wrs.into_iter().count();
                *pending = pending.saturating_sub(n);
                if n > 0 && !status.is_ok() && error.is_none() {
                    *error = Some(status);
                }
            }
            DevOp::Read { pieces, .. } => {
                for w in wrs {
                    if let WrWhat::Read { piece, buf, .. } = w.what {
                        pieces.put(piece, buf, status);
                    }
                }
            }
            DevOp::Waiting { .. } | DevOp::LongReadRtw { .. } => {}
        }
    }

    pub(super) fn peer(&self) -> u64 {
        match self {
            DevOp::Waiting { peer, .. }
            | DevOp::Write { peer, .. }
            | DevOp::Read { peer, .. }
            | DevOp::LongReadRtw { peer, .. } => *peer,
        }
    }
}

/// Where an RMA operation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    Device,
    LongReadRtw,
    Emulated,
}

pub(super) fn dev_error(s: Status) -> Error {
    Error::new(s.error_kind(), "rma").with_detail(format!("device status {s}"))
}

/// Whether a device could have made `key`: NIC rkeys and the software devices' keys are 32
/// bits; a domain's own keys (regions its device did not register: no device RDMA, or a dmabuf
/// the NIC refused) have bit 63 set, and only the emulated protocols reach them.
fn device_key(key: u64) -> bool {
    key <= u64::from(u32::MAX)
}

impl ReadState {
    /// Where `op` goes, once the peer's HANDSHAKE is known.
    fn route(&self, pid: u64, op: &RmaOp, cx: &Cx) -> Route {
        let len = op.local_len();
        if !device_key(op.remote.key) {
            return Route::Emulated;
        }
        let (cfg, local, events) = (&cx.cfg, cx.local, cx.remote_events);
        match &op.kind {
            RmaKind::Write { data, .. } => {
                if cx.peers.both_write(pid, cfg, local, events.0)
                    && (data.is_none() || self.imm_ok(pid, cx))
                {
                    Route::Device
                } else if op.local_key.is_some()
                    && len > 0
                    && len >= cfg.inter_min_read_write_size
                    && cx.peers.both_read(pid, cfg, local, events.1)
                {
                    Route::LongReadRtw
                } else {
                    Route::Emulated
                }
            }
            RmaKind::Read { .. } if cx.peers.both_read(pid, cfg, local, events.1) => Route::Device,
            _ => Route::Emulated,
        }
    }

    /// An id for a new operation of this module: one space with the transmit side's and the
    /// emulation's (`taken` says which ids the emulation holds).
    fn new_id(&self, tx: &mut TxSide, taken: impl Fn(u32) -> bool) -> u32 {
        tx.alloc_id(|id| self.owns_id(id) || taken(id))
    }

    /// The device part of `Engine::rma`: starts `op` with device RDMA (or LONGREAD_RTW), or
    /// queues it until the peer's HANDSHAKE says which, and returns `Ok(None)`; hands the
    /// operation back (`Ok(Some)`) when it must be emulated (atomics, no RDMA on this side or
    /// the peer's, writes with immediate data across an unsolicited write-recv mismatch).
    /// `taken` as in [`ReadState::new_id`].
    pub(in crate::proto::engine) fn try_device(
        &mut self,
        now: Instant,
        op: RmaOp,
        tx: &mut TxSide,
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> Result<Option<RmaOp>, (Error, RmaOp)> {
        if !could_use_device(&op, &cx.cfg) {
            return Ok(Some(op));
        }
        if cx.peers.in_backoff() {
            cx.peers.expire_backoffs(now, &mut cx.out.timers);
        }
        let Some(pid) = cx.peer_for_send(op.dest) else {
            let e = Error::new(ErrorKind::NoMemory, "rma").with_detail("peer table full");
            return Err((e, op));
        };
        let Some(p) = cx.peers.get(&pid) else {
            return Err((Error::new(ErrorKind::Io, "rma"), op));
        };
        let known = p.hs_received || p.addr == cx.local;
        let backoff = p.backoff_until.is_some();
        if known && self.route(pid, &op, cx) == Route::Emulated {
            return Ok(Some(op));
        }
        if let Err(e) = validate(&op) {
            return Err((e, op));
        }
        if tx.ops.len() + self.ops.len() >= cx.cfg.max_tx_ops {
            return Err((cx.out.again("rma", "max_tx_ops operations in flight"), op));
        }
        if backoff {
            return Err((cx.out.again("rma", "peer in RNR backoff"), op));
        }
        if !known {
            if self.waiting >= MAX_QUEUED_BEFORE_HANDSHAKE {
                let why = "too many operations waiting for handshakes";
                return Err((cx.out.again("rma", why), op));
            }
            let id = self.new_id(tx, taken);
            self.ops.insert(id, DevOp::Waiting { peer: pid, op });
            self.waiting += 1;
            cx.peers.trigger_handshake(pid, cx.local);
            return Ok(None);
        }
        Ok(self.start(pid, op, tx, taken, cx))
    }

    /// Starts `op` on the route its peer allows; hands it back when that is the emulation.
    fn start(
        &mut self,
        pid: u64,
        op: RmaOp,
        tx: &mut TxSide,
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> Option<RmaOp> {
        let route = self.route(pid, &op, cx);
        if route == Route::Emulated {
            return Some(op);
        }
        let id = self.new_id(tx, taken);
        match route {
            Route::Device => self.start_device(pid, id, op, cx),
            _ => self.start_longread_rtw(pid, id, op, cx),
        }
    }

    /// Queues the work requests of device write or read `op`, operation `id`.
    fn start_device(&mut self, pid: u64, id: u32, op: RmaOp, cx: &mut Cx) -> Option<RmaOp> {
        if matches!(op.kind, RmaKind::Atomic { .. }) {
            return Some(op);
        }
        let Some(dest) = cx.peers.get(&pid).map(|p| p.addr) else {
            return Some(op);
        };
        let RmaOp {
            remote,
            kind,
            context,
            local_region,
            ..
        } = op;
        let wr = |remote, what| Wr::new(WrOwner::Op(id), pid, dest, remote, what);
        let piece = |off: usize, n: usize| RemoteIov {
            addr: remote.addr.wrapping_add(off as u64),
            len: n as u64,
            key: remote.key,
        };
        match kind {
            RmaKind::Write { buf, data } => {
                let seg = write_segment(&cx.cfg);
                let len = local_region.as_ref().map_or(buf.len(), |r| r.len);
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
                cx.wrs.extend(wrs);
                self.ops.insert(
                    id,
                    DevOp::Write {
                        peer: pid,
                        context,
                        buf,
                        region: local_region,
                        pending,
                        held,
                        error: None,
                    },
                );
            }
            RmaKind::Read { mut buf } => {
                let len = usize::try_from(remote.len).unwrap_or(usize::MAX);
                let seg = read_segment(&cx.cfg);
                let lens: Vec<usize> = if len == 0 {
                    vec![0]
                } else {
                    (0..len).step_by(seg).map(|o| seg.min(len - o)).collect()
                };
                buf.clear();
                let in_region = local_region.is_some();
                let (pieces, whats) = Pieces::targets(&mut buf, local_region.as_ref(), 0, &lens);
                let mut off = 0;
                for (what, &n) in whats.into_iter().zip(&lens) {
                    cx.wrs.push_back(wr(piece(off, n), what));
                    off += n;
                }
                self.ops.insert(
                    id,
                    DevOp::Read {
                        peer: pid,
                        context,
                        len,
                        pieces,
                        in_region,
                    },
                );
            }
            RmaKind::Atomic { .. } => {}
        }
        None
    }

    /// Sends LONGREAD_RTW for `op`, operation `id`: the target reads our registered buffer
    /// (`local_key`).
    fn start_longread_rtw(&mut self, pid: u64, id: u32, op: RmaOp, cx: &mut Cx) -> Option<RmaOp> {
        let (RmaKind::Write { data, .. }, Some((key, addr))) = (&op.kind, op.local_key) else {
            return Some(op);
        };
        let len = op.local_len();
        let Some(hs) = cx.peers.get(&pid).map(|p| p.hs_received) else {
            return Some(op);
        };
        let read = [RemoteIov {
            addr,
            len: len as u64,
            key,
        }];
        let rma = [op.remote];
        let sender = our_sender(cx.local, hs);
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
        let hdr = encode(&pkt)?;
        self.ops
            .insert(id, DevOp::LongReadRtw { peer: pid, op, len });
        cx.peers
            .enqueue(Pkt::ctrl(pid, Owner::Rd(id), hdr), false, false);
        None
    }

    /// The peer's HANDSHAKE arrived: the operations that waited for it choose their protocol,
    /// in the order they were started, until one must be emulated: that one is handed back
    /// (the caller gives it to the emulation and calls again); `None` when none is left.
    pub(in crate::proto::engine) fn next_after_handshake(
        &mut self,
        pid: u64,
        tx: &mut TxSide,
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> Option<RmaOp> {
        loop {
            let id = self
                .ops
                .iter()
                .filter(|(_, o)| matches!(o, DevOp::Waiting { peer, .. } if *peer == pid))
                .map(|(&id, _)| id)
                .min()?;
            let Some(DevOp::Waiting { op, .. }) = self.ops.remove(&id) else {
                return None;
            };
            self.waiting = self.waiting.saturating_sub(1);
            if let Some(op) = self.start(pid, op, tx, &taken, cx) {
                return Some(op);
            }
        }
    }

    /// The completion of a finished (or failed: `forced`) operation of this module.
    fn finish(op: DevOp, forced: Option<(Error, Option<Status>)>, out: &mut Out) {
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
                region,
                error,
                ..
            } => {
                let (err, st) = outcome(error, forced);
                let len = region.as_ref().map_or(buf.len(), |r| r.len);
                out.rma_done(context, RmaBuf::Write(buf), len, RmaPath::Device, err, st);
            }
            DevOp::Read {
                context,
                len,
                pieces,
                in_region,
                ..
            } => {
                let (err, st) = outcome(pieces.error, forced);
                let buf = if in_region {
                    RmaBuf::InRegion
                } else {
                    let mut b = pieces.join(BytesMut::new(), 0);
                    if err.is_some() {
                        b.clear();
                    }
                    RmaBuf::Read(b)
                };
                out.rma_done(context, buf, len, RmaPath::Device, err, st);
            }
            DevOp::Waiting { op, .. } | DevOp::LongReadRtw { op, .. } => {
                let (err, st) = outcome(Some(Status::LocalQpInternalError), forced);
                let buf = RmaBuf::from_kind(op.kind);
                out.rma_done(op.context, buf, 0, RmaPath::Emulated, err, st);
            }
        }
    }

    /// Ends operation `id` with an error; its queued work requests are withdrawn (their
    /// buffers come back), those on the device complete into nothing.
    pub(super) fn abort_op(
        &mut self,
        id: u32,
        kind: ErrorKind,
        status: Option<Status>,
        why: &'static str,
        cx: &mut Cx,
    ) {
        // Its queued work requests are withdrawn (a read's pieces come back); those on the
        // device complete into nothing.
        self.withdraw_queued(id, Status::Flushed, &mut cx.wrs);
        let Some(op) = self.ops.remove(&id) else {
            return;
        };
        if matches!(op, DevOp::Waiting { .. }) {
            self.waiting = self.waiting.saturating_sub(1);
        }
        let e = Error::new(kind, "rma").with_detail(why);
        Self::finish(op, Some((e, status)), &mut cx.out);
    }

    /// Withdraws the queued (not yet posted) work requests of operation `id` from `wrs`; the
    /// operation then fails with `status` once those on the device have completed.
    pub(super) fn withdraw_queued(&mut self, id: u32, status: Status, wrs: &mut VecDeque<Wr>) {
        let (withdrawn, rest): (VecDeque<Wr>, VecDeque<Wr>) = std::mem::take(wrs)
            .into_iter()
            .partition(|w| w.owner == WrOwner::Op(id));
        *wrs = rest;
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        // A write's held last piece is withdrawn too.
        if let DevOp::Write { held, error, .. } = op
            && held.take().is_some()
            && error.is_none()
        {
            *error = Some(status);
        }
        op.wrs_ended(withdrawn, status);
    }

    /// A work request of device RMA operation `id` completed.
    pub(super) fn op_wr_done(&mut self, id: u32, w: Wr, status: Status, cx: &mut Cx) {
        let Some(op) = self.ops.get_mut(&id) else {
            return;
        };
        op.wrs_ended([w], status);
        match op {
            DevOp::Write {
                pending,
                held,
                error,
                ..
            } => {
                if *pending > 0 {
                    return;
                }
                if error.is_none() {
                    if let Some(last) = held.take() {
                        *pending = 1;
                        cx.wrs.push_back(last);
                        return;
                    }
                }
            }
            DevOp::Read { pieces, .. } => {
                if pieces.outstanding > 0 {
                    return;
                }
            }
            DevOp::Waiting { .. } | DevOp::LongReadRtw { .. } => return,
        }
        if let Some(op) = self.ops.remove(&id) {
            Self::finish(op, None, &mut cx.out);
        }
    }

    /// A LONGREAD_RTW REQ failed on the device (not a peer failure): its operation fails.
    pub(in crate::proto::engine) fn req_failed(&mut self, id: u32, s: Status, out: &mut Out) {
        if let Some(op) = self.ops.remove(&id) {
            Self::finish(op, Some((dev_error(s), Some(s))), out);
        }
    }
}

/// Whether this side could run `op` with the device (or LONGREAD_RTW) at all.
fn could_use_device(op: &RmaOp, cfg: &EngineConfig) -> bool {
    let len = op.local_len();
    if !device_key(op.remote.key) {
        return false;
    }
    match &op.kind {
        RmaKind::Write { .. } => {
            cfg.device_rdma_write
                || (cfg.device_rdma_read
                    && op.local_key.is_some()
                    && len > 0
                    && len >= cfg.inter_min_read_write_size)
        }
        RmaKind::Read { .. } => cfg.device_rdma_read,
        RmaKind::Atomic { .. } => false,
    }
}

fn validate(op: &RmaOp) -> Result<(), Error> {
    let len = op.local_len() as u64;
    match &op.kind {
        RmaKind::Write { buf, .. } if op.local_region.is_some() && !buf.is_empty() => {
            Err(Error::new(ErrorKind::InvalidArgument, "rma")
                .with_detail("a write from a region carries no buffer of its own"))
        }
        RmaKind::Write { .. } if len != op.remote.len => {
            Err(Error::new(ErrorKind::InvalidArgument, "rma")
                .with_detail("the write's length differs from the remote range"))
        }
        RmaKind::Read { .. } if len < op.remote.len => {
            Err(Error::new(ErrorKind::InvalidArgument, "rma")
                .with_detail("the read buffer is smaller than the remote range"))
        }
        _ => Ok(()),
    }
}

/// An operation with a local region (`RmaOp::local_region`) that takes a route other than
/// device RDMA gets buffers of its own: a write's bytes are copied out of the region, a
/// read gets room (the endpoint copies its data into the region at completion). A
/// device-only region cannot be copied: `NotSupported`.
pub(in crate::proto::engine) fn own_buffers(mut op: RmaOp) -> Result<RmaOp, (Error, RmaOp)> {
    let Some(region) = op.local_region.take() else {
        return Ok(op);
    };
    if region.mem.is_device_only() {
        let name = match op.kind {
            RmaKind::Read { .. } => "read",
            _ => "write",
        };
        let e = crate::mem::device_only_error(name).with_detail(
            "the operation would be emulated (no device RDMA for it between these two \
             endpoints), which copies the region's bytes with the CPU; a device-only region \
             goes only by device RDMA",
        );
        return Err((e, op));
    }
    match &mut op.kind {
        RmaKind::Write { buf, .. } => match region.to_bytes() {
            Ok(b) => *buf = b,
            Err(e) => return Err((e, op)),
        },
        RmaKind::Read { buf } => {
            buf.clear();
            buf.reserve(region.len);
        }
        RmaKind::Atomic { .. } => {}
    }
    Ok(op)
}
