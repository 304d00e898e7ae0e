//! Long-read and runting-read messages: the sender's protocol choice and packets, EOR and
//! READ_NACK at the sender, the receiver's reads, EOR and READ_NACK, the long-CTS continuation.

use super::*;
use crate::proto::engine::peer::our_sender;
use crate::proto::engine::util::Timer;

/// A read-based message we send.
#[derive(Debug)]
pub(super) struct TxRead {
    /// Runt bytes not yet completed (counted in the peer's `runt_in_flight`).
    pub(super) runt_left: usize,
    /// Counted in `ReadState::read_msgs` (EOR or READ_NACK still to come).
    pub(super) reading: bool,
    /// The region peers read: `(key, address)`; a region send (`SendOp::region_len`) reads
    /// the rest of its bytes from it after a READ_NACK.
    pub(super) region: (u64, u64),
}

impl Engine {
    /// The read-based protocol for a send, if any (libfabric's `efa_rdm_msg_select_rtm`): the
    /// buffer is registered, the message is at least `inter_min_read_message_size`, both sides
    /// can RDMA-read (so never before the HANDSHAKE: then the size decides as usual). A runting
    /// read when no other read message is in flight, the runt is not zero and no delivery
    /// complete is asked for; else long read.
    pub(in crate::proto::engine) fn read_protocol(
        &self,
        pid: u64,
        op: &SendOp,
        device_only: bool,
    ) -> Option<ReadProto> {
        let (key, addr) = op.read_key?;
        let len = op.len();
        let small = len < self.cfg.inter_min_read_message_size && !device_only;
        if len == 0 || small || !self.both_read(pid) {
            return None;
        }
        let iov = RemoteIov {
            addr,
            len: len as u64,
            key,
        };
        let in_flight = self.peers.get(&pid)?.runt_in_flight;
        let runt = self.cfg.runt_size.saturating_sub(in_flight).min(len) & !(RUNT_ALIGN - 1);
        // A device-only region has no runt to put in packets: its bytes are the NIC's alone.
        if self.rd.read_msgs == 0 && runt > 0 && !op.delivery_complete && !device_only {
            Some(ReadProto::Runt(iov, runt))
        } else {
            Some(ReadProto::Long(iov))
        }
    }

    /// Whether `op` sends device-only memory ([`RmaMemory::device_only`] of its read key), and
    /// whether it may go now: `Ok(true)` for such a send, which goes by the long-read protocol
    /// alone (an empty one by eager, which carries no byte); `Ok(false)` for any other send.
    /// `Again` while the peer's HANDSHAKE (which says whether it can RDMA-read) is unknown (it
    /// is triggered, as libfabric does for protocols that need the peer's features);
    /// `NotSupported` when the peer or this side cannot RDMA-read: nothing else moves the
    /// bytes without the CPU.
    pub(in crate::proto::engine) fn device_only_send(
        &mut self,
        pid: u64,
        op: &SendOp,
    ) -> Result<bool, Error> {
        let Some((key, _)) = op.read_key.filter(|_| op.region_len.is_some()) else {
            return Ok(false);
        };
        if !self.memory.as_ref().is_some_and(|m| m.device_only(key)) {
            return Ok(false);
        }
        if op.is_empty() || self.both_read(pid) {
            return Ok(true);
        }
        let known = self
            .peers
            .get(&pid)
            .is_some_and(|p| p.hs_received || p.addr == self.local);
        if !known && self.cfg.device_rdma_read {
            self.trigger_handshake(pid);
            self.out.stats.again += 1;
            return Err(Error::new(ErrorKind::Again, "send").with_detail(
                "a device-only region goes by the long-read protocol, which waits for the \
                 peer's handshake (requested): retry",
            ));
        }
        Err(crate::mem::device_only_error("send").with_detail(
            "a device-only region goes only by the long-read protocol, and this peer cannot \
             RDMA-read it (or device RDMA read is off here): its bytes cannot go in packets",
        ))
    }

    /// `len` bytes of a region send, read through the engine's memory (the application must
    /// not hold the region's lock while it sends from it: `Again` then).
    pub(in crate::proto::engine) fn region_bytes(
        &self,
        key: u64,
        addr: u64,
        len: usize,
    ) -> Result<Bytes, Error> {
        let Some(mem) = self.memory.as_ref() else {
            return Err(Error::new(ErrorKind::InvalidArgument, "send")
                .with_detail("a region send needs the engine's memory (Engine::set_memory)"));
        };
        mem.read(key, addr, len as u64)
    }

    /// The packets of a read-based message: one LONGREAD_RTM, or the RUNTREAD_RTMs carrying
    /// the runt (split as medium segments).
    pub(in crate::proto::engine) fn packetize_read(
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
                    region: (iov.key, iov.addr),
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
                    region: (iov.key, iov.addr),
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
    pub(in crate::proto::engine) fn read_pkt_done(&mut self, id: u32, pkt: &Pkt) {
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
    pub(in crate::proto::engine) fn read_tx_gone(&mut self, id: u32, peer: u64) {
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

    pub(super) fn read_msg_answered(&mut self, send_id: u32) {
        if let Some(tr) = self.rd.tx_read.get_mut(&send_id) {
            if std::mem::take(&mut tr.reading) {
                self.rd.read_msgs = self.rd.read_msgs.saturating_sub(1);
            }
        }
    }

    /// EOR: the receiver read a message (or the target of LONGREAD_RTW placed a write).
    pub(super) fn handle_eor(&mut self, pid: u64, send_id: u32) {
        if let Some(t) = self.tx.ops.get_mut(&send_id) {
            let reading = matches!(t.proto, Proto::LongRead | Proto::RuntRead);
            if t.peer != pid || !reading || t.scheduled >= t.len {
                return self.drop_pkt("EOR that does not match its send");
            }
            t.scheduled = t.len;
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
                RmaBuf::from_kind(op.kind),
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
    pub(super) fn handle_read_nack(&mut self, now: Instant, pid: u64, send_id: u32, recv_id: u32) {
        if let Some(t) = self.tx.ops.get(&send_id) {
            let reading = matches!(t.proto, Proto::LongRead | Proto::RuntRead);
            if t.peer != pid || !reading || t.scheduled >= t.len {
                return self.drop_pkt("READ_NACK that does not match its send");
            }
            // A region send holds only its runt: the rest now goes in packets too.
            let region = self.rd.tx_read.get(&send_id).map(|r| r.region);
            if let Some((key, addr)) = region.filter(|_| t.buf.len() < t.len) {
                match self.region_bytes(key, addr, t.len) {
                    Ok(b) => {
                        if let Some(t) = self.tx.ops.get_mut(&send_id) {
                            t.buf = b;
                        }
                    }
                    Err(e) => return self.fail_tx(send_id, e, None),
                }
            }
            let Some(t) = self.tx.ops.get(&send_id) else {
                return;
            };
            let hs = self.peers.get(&pid).is_some_and(|p| p.hs_received);
            let sender = our_sender(self.local, hs);
            let pkt = Packet::LongCtsRtm {
                opt: ReqOpt {
                    sender,
                    cq_data: None,
                },
                msg_id: t.msg_id,
                msg_length: t.len as u64,
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
            if let Some(t) = self.tx.ops.get_mut(&send_id) {
                tracing::debug!(send_id, "READ_NACK: the message goes on as long-CTS");
                t.proto = Proto::LongCts;
                t.window_end = t.scheduled;
                t.recv_id = recv_id;
                t.pending += 1;
            }
            self.peers
                .enqueue(Pkt::new(pid, Owner::Tx(send_id), hdr, at, at), false, false);
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

    /// The message `rid` was matched: read what fits of its non-runt part, or NACK.
    pub(in crate::proto::engine) fn start_rx_read(&mut self, now: Instant, rid: u32) {
        let seg = self.read_segment();
        let can = self.cfg.device_rdma_read;
        let Some(e) = self.rx.ops.get_mut(&rid) else {
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
        let region_holds = sink.region.as_ref().is_some_and(|g| g.len >= end);
        if can && !region_holds {
            // The read part goes into the buffer: a receive whose room is not its capacity (a
            // region slice, `RecvOp::room`) gets it now.
            sink.buf.reserve(end.saturating_sub(sink.buf.len()));
        }
        let ranges = if can {
            carve(r.iovs.as_slice(), start, end, seg)
        } else {
            None
        };
        let Some(ranges) = ranges else {
            r.phase = Phase::NackPending;
            return self.maybe_nack(rid);
        };
        let lens: Vec<usize> = ranges.iter().map(|x| x.len as usize).collect();
        // Into the receive's region when it has one that holds the read part (no copy), else
        // into pieces cut from its buffer.
        let region = sink.region.as_ref().filter(|g| g.len >= end);
        let (pieces, whats) = Pieces::targets(&mut sink.buf, region, start, &lens);
        r.pieces = pieces;
        r.phase = Phase::Reading;
        for (remote, what) in ranges.into_iter().zip(whats) {
            self.rd.wrs.push_back(Wr {
                owner: WrOwner::Rx(rid),
                peer: pid,
                dest,
                remote,
                what,
                rnr: 0,
                no_ah: 0,
            });
        }
    }

    pub(super) fn rx_wr_done(&mut self, now: Instant, rid: u32, w: Wr, status: Status) {
        let WrWhat::Read { piece, buf, region } = w.what else {
            return;
        };
        let Some(e) = self.rx.ops.get_mut(&rid) else {
            return;
        };
        e.last = now;
        let into_region = region.is_some();
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
        // Every piece is back: the user's buffer is whole again (or the region holds the read
        // part, and the buffer the runt).
        let pieces = std::mem::take(&mut r.pieces);
        let failed = pieces.error.is_some();
        if let RxState::Matched(sink) = state {
            let start = r.start.min(msg_len);
            if into_region {
                if !failed {
                    sink.in_region = Some(start);
                }
            } else {
                let head = std::mem::take(&mut sink.buf);
                sink.buf = pieces.join(head, start);
            }
        }
        if self.rx.in_progress > 0 {
            let at = now.checked_add(self.cfg.rx_stall_timeout);
            self.out.timers.arm_if_stopped(Timer::RxStall, at);
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
    pub(super) fn rx_read_finished(&mut self, rid: u32) {
        let qkey = self.local.qkey;
        let Some(e) = self.rx.ops.get_mut(&rid) else {
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
    pub(super) fn maybe_nack(&mut self, rid: u32) {
        let qkey = self.local.qkey;
        let Some(e) = self.rx.ops.get_mut(&rid) else {
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
    pub(in crate::proto::engine) fn runt_progress(&mut self, rid: u32) {
        self.maybe_nack(rid);
    }

    /// The sender continues NACKed message `msg_id` as long-CTS: the entry becomes a long-CTS
    /// receive and asks for the rest.
    pub(in crate::proto::engine) fn handle_nack_rtm(
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
        let Some(e) = self.rx.ops.get_mut(&rid) else {
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
    pub(in crate::proto::engine) fn read_entry_removed(&mut self, rid: u32, e: &mut RxEntry) {
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
                    what:
                        WrWhat::Read {
                            piece,
                            buf,
                            region: None,
                        },
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
}
