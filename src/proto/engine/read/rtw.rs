//! The target of LONGREAD_RTW: reads the initiator's buffer, writes it into the memory, EOR or
//! READ_NACK.

use super::*;
use crate::proto::engine::Event;

/// The target of a LONGREAD_RTW: reads the initiator's buffer and writes it into the memory.
#[derive(Debug)]
pub(super) struct RtwTarget {
    pub(super) peer: u64,
    pub(super) send_id: u32,
    pub(super) len: usize,
    /// Where the data goes here.
    pub(super) rma: ReadIovs,
    /// Remote CQ data (`fi_writedata`).
    pub(super) data: Option<u32>,
    /// Message offset of each piece.
    pub(super) offs: Vec<usize>,
    pub(super) pieces: Pieces,
    /// Pieces read and not yet written (the memory said `Again`).
    pub(super) unwritten: Vec<(usize, BytesMut)>,
}

/// Writes `data`, bytes `off..` of a write, into the ranges `rma` of `mem`.
pub(in crate::proto::engine) fn write_range(
    mem: &dyn RmaMemory,
    rma: &ReadIovs,
    off: usize,
    data: &[u8],
) -> Result<(), Error> {
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

impl ReadState {
    /// LONGREAD_RTW: read the initiator's buffer, write it into `rma_iov`, then EOR; READ_NACK
    /// when this side cannot (no RDMA read, no memory, a bad range or key here or there).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn handle_longread_rtw(
        &mut self,
        pid: u64,
        data: Option<u32>,
        msg_length: u64,
        send_id: u32,
        rma: ReadIovs,
        read: ReadIovs,
        cx: &mut Cx,
    ) {
        let nack = Packet::ReadNack {
            connid: Some(cx.local.qkey),
            send_id,
            recv_id: 0,
        };
        let len = usize::try_from(msg_length).ok();
        let writable = match (cx.memory.as_deref(), len) {
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
        let seg = read_segment(&cx.cfg).min(RTW_SEGMENT);
        let ranges = match len {
            Some(len) if writable && cx.cfg.device_rdma_read => carve(read.as_slice(), 0, len, seg),
            _ => None,
        };
        let (Some(len), Some(ranges)) = (len, ranges) else {
            tracing::debug!(send_id, "LONGREAD_RTW cannot be read here: READ_NACK");
            return cx.peers.queue_ctrl(pid, &nack);
        };
        if ranges.is_empty() {
            return rtw_finish(pid, send_id, len, data, cx);
        }
        let Some(dest) = cx.peers.get(&pid).map(|p| p.addr) else {
            return;
        };
        let id = loop {
            self.next_rtw = self.next_rtw.wrapping_add(1);
            if !self.rtw.contains_key(&self.next_rtw) {
                break self.next_rtw;
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
            let what = WrWhat::Read {
                region: None,
                piece: i,
                buf: None,
            };
            cx.wrs
                .push_back(Wr::new(WrOwner::Rtw(id), pid, dest, remote, what));
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
        self.rtw.insert(id, t);
    }

    /// A read of LONGREAD_RTW target `id` completed.
    pub(super) fn rtw_wr_done(
        &mut self,
        now: Instant,
        id: u32,
        w: Wr,
        status: Status,
        cx: &mut Cx,
    ) {
        let WrWhat::Read { piece, buf, .. } = w.what else {
            return;
        };
        let Some(t) = self.rtw.get_mut(&id) else {
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
        self.rtw_write_out(now, id, cx);
    }

    /// Writes what LONGREAD_RTW target `id` read into the memory; when all is read and written,
    /// EOR (or READ_NACK after a failure).
    fn rtw_write_out(&mut self, now: Instant, id: u32, cx: &mut Cx) {
        let Some(t) = self.rtw.get_mut(&id) else {
            return;
        };
        if t.pieces.error.is_none() {
            let mut keep = Vec::new();
            for (off, b) in std::mem::take(&mut t.unwritten) {
                let r = match cx.memory.as_deref() {
                    Some(m) => write_range(m, &t.rma, off, &b),
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
            if waiting {
                let at = now.checked_add(MEMORY_RETRY);
                cx.out.timers.arm_if_stopped(Timer::ReadRetry, at);
            }
            return;
        }
        let Some(t) = self.rtw.remove(&id) else {
            return;
        };
        if t.pieces.error.is_some() {
            tracing::debug!(send_id = t.send_id, "LONGREAD_RTW failed here: READ_NACK");
            let nack = Packet::ReadNack {
                connid: Some(cx.local.qkey),
                send_id: t.send_id,
                recv_id: id,
            };
            return cx.peers.queue_ctrl(t.peer, &nack);
        }
        rtw_finish(t.peer, t.send_id, t.len, t.data, cx);
    }

    /// Retries the writes into memory the application held locked (`Timer::ReadRetry`).
    pub(in crate::proto::engine) fn timeout(&mut self, now: Instant, cx: &mut Cx) {
        cx.out.timers.stop(Timer::ReadRetry);
        let mut ids: Vec<u32> = self
            .rtw
            .iter()
            .filter(|(_, t)| !t.unwritten.is_empty())
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            self.rtw_write_out(now, id, cx);
        }
    }

    // ---- the initiator ----

    /// EOR of one of our LONGREAD_RTW: the target placed the write.
    pub(super) fn handle_eor(&mut self, pid: u64, send_id: u32, out: &mut Out) {
        let ours = matches!(self.ops.get(&send_id),
            Some(DevOp::LongReadRtw { peer, .. }) if *peer == pid);
        if !ours {
            return out.drop_pkt("EOR for an unknown send_id");
        }
        if let Some(DevOp::LongReadRtw { op, len, .. }) = self.ops.remove(&send_id) {
            let buf = RmaBuf::from_kind(op.kind);
            out.rma_done(op.context, buf, len, RmaPath::Emulated, None, None);
        }
    }

    /// READ_NACK of one of our LONGREAD_RTW: the target cannot read it, the write is handed
    /// back to be emulated.
    pub(super) fn handle_read_nack(
        &mut self,
        pid: u64,
        send_id: u32,
        out: &mut Out,
    ) -> Option<RmaOp> {
        let ours = matches!(self.ops.get(&send_id),
            Some(DevOp::LongReadRtw { peer, .. }) if *peer == pid);
        if !ours {
            out.drop_pkt("READ_NACK for an unknown send_id");
            return None;
        }
        let Some(DevOp::LongReadRtw { op, .. }) = self.ops.remove(&send_id) else {
            return None;
        };
        tracing::debug!(send_id, "READ_NACK: the write is emulated");
        Some(op)
    }
}

/// A LONGREAD_RTW is in place: the remote CQ data (if any) is reported, EOR goes back.
fn rtw_finish(pid: u64, send_id: u32, len: usize, data: Option<u32>, cx: &mut Cx) {
    let Some(src) = cx.peers.get(&pid).map(|p| p.addr) else {
        return;
    };
    cx.counts.count(true, true);
    if let Some(data) = data {
        cx.out
            .events
            .push_back(Event::RemoteWrite(RemoteWriteDone { src, data, len }));
    }
    let eor = Packet::Eor {
        connid: Some(cx.local.qkey),
        send_id,
        recv_id: 0,
    };
    cx.peers.queue_ctrl(pid, &eor);
}
