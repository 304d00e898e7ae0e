//! The sender's side of long-read and runting-read messages: the protocol choice, the REQ
//! packets, the runt in flight, EOR and READ_NACK (the message goes on as long-CTS).

use super::*;

/// Runt sizes are multiples of this (host memory alignment, as medium segments).
const RUNT_ALIGN: usize = 8;

/// A read-based message we send.
#[derive(Debug)]
pub(in crate::proto::engine) struct TxRead {
    /// Runt bytes not yet completed (counted in the peer's `runt_in_flight`).
    runt_left: usize,
    /// Counted in `TxSide::read_msgs` (EOR or READ_NACK still to come).
    reading: bool,
    /// The region peers read: `(key, address)`; a region send (`SendOp::region_len`) reads
    /// the rest of its bytes from it after a READ_NACK.
    region: (u64, u64),
}

impl TxSide {
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
        cx: &Cx,
    ) -> Option<ReadProto> {
        let (key, addr) = op.read_key?;
        let len = op.len();
        let small = len < cx.cfg.inter_min_read_message_size && !device_only;
        if len == 0 || small || !both_read(pid, cx) {
            return None;
        }
        let iov = RemoteIov {
            addr,
            len: len as u64,
            key,
        };
        let in_flight = cx.peers.get(&pid)?.runt_in_flight;
        let runt = cx.cfg.runt_size.saturating_sub(in_flight).min(len) & !(RUNT_ALIGN - 1);
        // A device-only region has no runt to put in packets: its bytes are the NIC's alone.
        if self.read_msgs == 0 && runt > 0 && !op.delivery_complete && !device_only {
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
        cx: &mut Cx,
    ) -> Result<bool, Error> {
        let Some((key, _)) = op.read_key.filter(|_| op.region_len.is_some()) else {
            return Ok(false);
        };
        if !cx.memory.as_deref().is_some_and(|m| m.device_only(key)) {
            return Ok(false);
        }
        if op.is_empty() || both_read(pid, cx) {
            return Ok(true);
        }
        let known = cx
            .peers
            .get(&pid)
            .is_some_and(|p| p.hs_received || p.addr == cx.local);
        if !known && cx.cfg.device_rdma_read {
            cx.peers.trigger_handshake(pid, cx.local);
            return Err(cx.out.again(
                "send",
                "a device-only region goes by the long-read protocol, which waits for the \
                 peer's handshake (requested): retry",
            ));
        }
        Err(crate::mem::device_only_error("send").with_detail(
            "a device-only region goes only by the long-read protocol, and this peer cannot \
             RDMA-read it (or device RDMA read is off here): its bytes cannot go in packets",
        ))
    }

    /// The packets of a read-based message: one LONGREAD_RTM, or the RUNTREAD_RTMs carrying
    /// the runt (split as medium segments).
    pub(in crate::proto::engine) fn packetize_read(
        &mut self,
        pkts: &mut Vec<Pkt>,
        m: &MsgHdr,
        len: usize,
        rp: ReadProto,
        cx: &mut Cx,
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
                push_pkt(pkts, m, &pkt, 0, 0)?;
                self.read_msgs += 1;
                let tr = TxRead {
                    runt_left: 0,
                    reading: true,
                    region: (iov.key, iov.addr),
                };
                self.tx_read.insert(m.send_id, tr);
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
                let cap = cx.cfg.mtu.saturating_sub(seg(0).header_len());
                if cap == 0 {
                    return Err(
                        Error::new(ErrorKind::InvalidArgument, "send").with_detail("MTU too small")
                    );
                }
                let mut off = 0;
                for n in medium_segments(runt, cap) {
                    push_pkt(pkts, m, &seg(off as u64), off, off + n)?;
                    off += n;
                }
                let reading = runt < len;
                if reading {
                    self.read_msgs += 1;
                }
                let tr = TxRead {
                    runt_left: runt,
                    reading,
                    region: (iov.key, iov.addr),
                };
                self.tx_read.insert(m.send_id, tr);
                if let Some(p) = cx.peers.get_mut(&m.pid) {
                    p.runt_in_flight += runt;
                }
                Ok((Proto::RuntRead, runt))
            }
        }
    }

    /// A packet of send `id` completed: a runt's bytes are no longer in flight.
    pub(in crate::proto::engine) fn read_pkt_done(
        &mut self,
        id: u32,
        pkt: &Pkt,
        peers: &mut Peers,
    ) {
        let runt = [
            PacketType::RuntReadMsgRtm.id(),
            PacketType::RuntReadTagRtm.id(),
        ];
        if !pkt.hdr.bytes().first().is_some_and(|t| runt.contains(t)) {
            return;
        }
        let Some(tr) = self.tx_read.get_mut(&id) else {
            return;
        };
        let n = pkt.end.saturating_sub(pkt.off).min(tr.runt_left);
        tr.runt_left -= n;
        if let Some(p) = peers.get_mut(&pkt.peer) {
            p.runt_in_flight = p.runt_in_flight.saturating_sub(n);
        }
    }

    /// Send `id` to `peer` is gone (completed or failed): its read bookkeeping too.
    pub(in crate::proto::engine) fn read_gone(&mut self, id: u32, peer: u64, peers: &mut Peers) {
        let Some(tr) = self.tx_read.remove(&id) else {
            return;
        };
        if tr.reading {
            self.read_msgs = self.read_msgs.saturating_sub(1);
        }
        if let Some(p) = peers.get_mut(&peer) {
            p.runt_in_flight = p.runt_in_flight.saturating_sub(tr.runt_left);
        }
    }

    /// The receiver answered read-based message `send_id` (EOR or READ_NACK).
    fn read_answered(&mut self, send_id: u32) {
        if let Some(tr) = self.tx_read.get_mut(&send_id) {
            if std::mem::take(&mut tr.reading) {
                self.read_msgs = self.read_msgs.saturating_sub(1);
            }
        }
    }

    /// EOR for our send `send_id` (the caller found it ours): the receiver read the message.
    pub(in crate::proto::engine) fn handle_eor(&mut self, pid: u64, send_id: u32, cx: &mut Cx) {
        let Some(t) = self.ops.get_mut(&send_id) else {
            return;
        };
        let reading = matches!(t.proto, Proto::LongRead | Proto::RuntRead);
        if t.peer != pid || !reading || t.scheduled >= t.len {
            return cx.out.drop_pkt("EOR that does not match its send");
        }
        t.scheduled = t.len;
        t.window_end = t.scheduled;
        self.read_answered(send_id);
        self.maybe_complete(send_id, cx);
    }

    /// READ_NACK for our send `send_id` (the caller found it ours): the receiver cannot read,
    /// so the message goes on as long-CTS (a LONGCTS REQ with the READ_NACK flag and no data,
    /// then CTS / CTSDATA from where the runt ended).
    pub(in crate::proto::engine) fn handle_read_nack(
        &mut self,
        pid: u64,
        send_id: u32,
        recv_id: u32,
        cx: &mut Cx,
    ) {
        let Some(t) = self.ops.get(&send_id) else {
            return;
        };
        let reading = matches!(t.proto, Proto::LongRead | Proto::RuntRead);
        if t.peer != pid || !reading || t.scheduled >= t.len {
            return cx.out.drop_pkt("READ_NACK that does not match its send");
        }
        // A region send holds only its runt: the rest now goes in packets too.
        let region = self.tx_read.get(&send_id).map(|r| r.region);
        if let Some((key, addr)) = region.filter(|_| t.buf.len() < t.len) {
            match region_bytes(cx.memory.as_deref(), key, addr, t.len) {
                Ok(b) => {
                    if let Some(t) = self.ops.get_mut(&send_id) {
                        t.buf = b;
                    }
                }
                Err(e) => return self.fail(send_id, e, None, cx),
            }
        }
        let Some(t) = self.ops.get(&send_id) else {
            return;
        };
        let hs = cx.peers.get(&pid).is_some_and(|p| p.hs_received);
        let sender = our_sender(cx.local, hs);
        let pkt = Packet::LongCtsRtm {
            opt: ReqOpt {
                sender,
                cq_data: None,
            },
            msg_id: t.msg_id,
            msg_length: t.len as u64,
            send_id,
            credit_request: u32::try_from(cx.cfg.tx_min_credits).unwrap_or(u32::MAX),
            tag: t.tag,
            dc: t.dc,
            read_nack: true,
        };
        let at = t.scheduled;
        let Some(hdr) = encode(&pkt) else {
            let e = Error::new(ErrorKind::Io, "send").with_detail("packet encoding failed");
            return self.fail(send_id, e, None, cx);
        };
        self.read_answered(send_id);
        if let Some(t) = self.ops.get_mut(&send_id) {
            tracing::debug!(send_id, "READ_NACK: the message goes on as long-CTS");
            t.proto = Proto::LongCts;
            t.window_end = t.scheduled;
            t.recv_id = recv_id;
            t.pending += 1;
        }
        cx.peers
            .enqueue(Pkt::new(pid, Owner::Tx(send_id), hdr, at, at), false, false);
    }

    /// `close()`: no read-based message is in flight any more.
    pub(super) fn read_close(&mut self) {
        self.tx_read.clear();
        self.read_msgs = 0;
    }
}

fn both_read(pid: u64, cx: &Cx) -> bool {
    cx.peers
        .both_read(pid, &cx.cfg, cx.local, cx.remote_events.1)
}
