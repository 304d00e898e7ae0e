//! Device RMA: the route an RMA operation takes, its work requests, waiting for the peer's
//! HANDSHAKE, completions (`docs/protocol.md`, "Device RDMA and the read-based protocols").

use super::*;
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

impl Engine {
    /// Where `op` goes, once the peer's HANDSHAKE is known.
    pub(super) fn rma_route(&self, pid: u64, op: &RmaOp) -> Route {
        let len = op.local_len();
        if !device_key(op.remote.key) {
            return Route::Emulated;
        }
        match &op.kind {
            RmaKind::Write { data, .. } => {
                if self
                    .peers
                    .both_write(pid, &self.cfg, self.local, self.remote_events.0)
                    && (data.is_none() || self.imm_ok(pid))
                {
                    Route::Device
                } else if op.local_key.is_some()
                    && len > 0
                    && len >= self.cfg.inter_min_read_write_size
                    && self
                        .peers
                        .both_read(pid, &self.cfg, self.local, self.remote_events.1)
                {
                    Route::LongReadRtw
                } else {
                    Route::Emulated
                }
            }
            RmaKind::Read { .. }
                if self
                    .peers
                    .both_read(pid, &self.cfg, self.local, self.remote_events.1) =>
            {
                Route::Device
            }
            _ => Route::Emulated,
        }
    }

    /// Whether this side could run `op` with the device (or LONGREAD_RTW) at all.
    pub(super) fn rma_could_use_device(&self, op: &RmaOp) -> bool {
        let len = op.local_len();
        if !device_key(op.remote.key) {
            return false;
        }
        match &op.kind {
            RmaKind::Write { .. } => {
                self.cfg.device_rdma_write
                    || (self.cfg.device_rdma_read
                        && op.local_key.is_some()
                        && len > 0
                        && len >= self.cfg.inter_min_read_write_size)
            }
            RmaKind::Read { .. } => self.cfg.device_rdma_read,
            RmaKind::Atomic { .. } => false,
        }
    }

    pub(super) fn validate_rma(op: &RmaOp) -> Result<(), Error> {
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
    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value"
    )]
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

    #[allow(
        clippy::result_large_err,
        reason = "the refused operation is handed back by value"
    )]
    pub(super) fn rma_again<T>(
        &mut self,
        op: RmaOp,
        why: &'static str,
    ) -> Result<T, (Error, RmaOp)> {
        self.out.stats.again += 1;
        Err((Error::new(ErrorKind::Again, "rma").with_detail(why), op))
    }

    pub(in crate::proto::engine) fn new_op_id(&mut self) -> u32 {
        loop {
            let (rd, ema) = (&self.rd, &self.ema);
            let id = self
                .tx
                .alloc_id(|id| rd.owns_id(id) || ema.owns_send_id(id));
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
    pub(in crate::proto::engine) fn try_device_rma(
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
        if self.peers.in_backoff() {
            self.peers.expire_backoffs(now, &mut self.out.timers);
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
        if self.tx.ops.len() + self.rd.ops.len() >= self.cfg.max_tx_ops {
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
            self.peers.trigger_handshake(pid, self.local);
            return Ok(None);
        }
        Ok(self.start_rma(pid, op))
    }

    /// Starts `op` on the route its peer allows; hands it back when that is the emulation.
    pub(super) fn start_rma(&mut self, pid: u64, op: RmaOp) -> Option<RmaOp> {
        match self.rma_route(pid, &op) {
            Route::Emulated => Some(op),
            Route::Device => self.start_device(pid, op),
            Route::LongReadRtw => self.start_longread_rtw(pid, op),
        }
    }

    /// Queues the work requests of a device write or read.
    pub(super) fn start_device(&mut self, pid: u64, op: RmaOp) -> Option<RmaOp> {
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
            local_region,
            ..
        } = op;
        let wr = |remote: RemoteIov, what: WrWhat| Wr {
            owner: WrOwner::Op(id),
            peer: pid,
            dest,
            remote,
            what,
            rnr: 0,
            no_ah: 0,
        };
        let piece = |off: usize, n: usize| RemoteIov {
            addr: remote.addr.wrapping_add(off as u64),
            len: n as u64,
            key: remote.key,
        };
        match kind {
            RmaKind::Write { buf, data } => {
                let seg = self.write_segment();
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
                self.rd.wrs.extend(wrs);
                self.rd.ops.insert(
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
                let seg = self.read_segment();
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
                        in_region,
                    },
                );
            }
            RmaKind::Atomic { .. } => {}
        }
        None
    }

    /// Sends LONGREAD_RTW: the target reads our registered buffer (`local_key`).
    pub(super) fn start_longread_rtw(&mut self, pid: u64, op: RmaOp) -> Option<RmaOp> {
        let (RmaKind::Write { data, .. }, Some((key, addr))) = (&op.kind, op.local_key) else {
            return Some(op);
        };
        let len = op.local_len();
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
        let sender = our_sender(self.local, hs);
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
        self.rd
            .ops
            .insert(id, DevOp::LongReadRtw { peer: pid, op, len });
        self.peers
            .enqueue(Pkt::ctrl(pid, Owner::Rd(id), hdr), false, false);
        None
    }

    /// The peer's HANDSHAKE arrived: the operations that waited for it choose their protocol,
    /// in the order they were started.
    pub(in crate::proto::engine) fn read_handshake_arrived(&mut self, now: Instant, pid: u64) {
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
    pub(super) fn fail_rma_op(&mut self, op: RmaOp, e: Error) {
        self.rma_event(
            op.context,
            RmaBuf::from_kind(op.kind),
            0,
            RmaPath::Emulated,
            Some(e),
            None,
        );
    }

    pub(in crate::proto::engine) fn rma_event(
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
                self.out.stats.errors += 1;
                tracing::debug!(error = %e, "RMA operation failed");
            }
            (None, RmaPath::Device) => self.out.stats.device_rma_bytes += len as u64,
            (None, RmaPath::Emulated) => self.out.stats.emulated_rma_bytes += len as u64,
        }
        let len = if error.is_some() { 0 } else { len };
        self.out.events.push_back(Event::Rma(RmaDone {
            context,
            buf,
            len,
            path,
            error,
            status,
        }));
    }

    /// The completion of a finished (or failed: `forced`) operation of this module.
    pub(super) fn finish_dev_op(&mut self, op: DevOp, forced: Option<(Error, Option<Status>)>) {
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
                self.rma_event(context, RmaBuf::Write(buf), len, RmaPath::Device, err, st);
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
                self.rma_event(context, buf, len, RmaPath::Device, err, st);
            }
            DevOp::Waiting { op, .. } | DevOp::LongReadRtw { op, .. } => {
                let (err, st) = outcome(Some(Status::LocalQpInternalError), forced);
                self.rma_event(
                    op.context,
                    RmaBuf::from_kind(op.kind),
                    0,
                    RmaPath::Emulated,
                    err,
                    st,
                );
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
    ) {
        // Its queued work requests are withdrawn (a read's pieces come back); those on the
        // device complete into nothing.
        self.withdraw_queued(id, Status::Flushed);
        let Some(op) = self.rd.ops.remove(&id) else {
            return;
        };
        if matches!(op, DevOp::Waiting { .. }) {
            self.rd.waiting = self.rd.waiting.saturating_sub(1);
        }
        let e = Error::new(kind, "rma").with_detail(why);
        self.finish_dev_op(op, Some((e, status)));
    }

    /// Takes the queued (not yet posted) work requests of operation `id` out of the queue.
    fn take_queued(&mut self, id: u32) -> Vec<Wr> {
        type Q = std::collections::VecDeque<Wr>;
        let (mine, rest): (Q, Q) = std::mem::take(&mut self.rd.wrs)
            .into_iter()
            .partition(|w| w.owner == WrOwner::Op(id));
        self.rd.wrs = rest;
        mine.into()
    }

    /// Withdraws the queued (not yet posted) work requests of operation `id`, which then fails
    /// with `status` once those on the device have completed.
    pub(super) fn withdraw_queued(&mut self, id: u32, status: Status) {
        let withdrawn = self.take_queued(id);
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
                *pending = pending.saturating_sub(withdrawn.len());
                if (held.take().is_some() || !withdrawn.is_empty()) && error.is_none() {
                    *error = Some(status);
                }
            }
            DevOp::Read { pieces, .. } => {
                for w in withdrawn {
                    if let WrWhat::Read { piece, buf, .. } = w.what {
                        pieces.put(piece, buf, status);
                    }
                }
            }
            DevOp::Waiting { .. } | DevOp::LongReadRtw { .. } => {}
        }
    }

    pub(in crate::proto::engine) fn op_wr_done(&mut self, id: u32, w: Wr, status: Status) {
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
                if let WrWhat::Read { piece, buf, .. } = w.what {
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

    /// A LONGREAD_RTW REQ failed on the device (not a peer failure): its operation fails.
    pub(in crate::proto::engine) fn read_req_failed(&mut self, id: u32, s: Status) {
        if let Some(op) = self.rd.ops.remove(&id) {
            self.finish_dev_op(op, Some((dev_error(s), Some(s))));
        }
    }
}
