//! The send side: protocol choice by size (eager, medium, long-CTS and their delivery-complete
//! variants), the packet queues and the device's send queue, CTS and RECEIPT, and the device's
//! send completions (success, RNR, failure).

use std::time::Instant;

use bytes::Bytes;

use super::cx::Cx;
use super::peer::our_sender;
use super::peer::{Peers, peer_fatal};
use super::types::{Gone, MsgHdr, Owner, Pkt, Proto, medium_segments};
use super::util::{Hdr, HeaderArena, IdMap, SeqMap, WrTable, encode, sorted};
use super::wr::ReadProto;
use super::{EngineConfig, Error, ErrorKind, Event, RmaMemory, SendDone, SendOp, Transmit};
use crate::addr::RawAddr;
use crate::device::{RemoteIov, Status};
use crate::proto::wire::{
    CONNID_HDR_LEN, CQ_DATA_HDR_LEN, CTSDATA_MAX_HEADER_LEN, IovList, PROTOCOL_VERSION, Packet,
    PacketType, RAW_ADDR_HDR_ADDR_LEN, RAW_ADDR_HDR_LEN, ReqOpt, Sender, req_flags,
};

mod read;

use read::TxRead;

/// The transmit side of the engine: send operations by id and the packets on the device.
#[derive(Debug)]
pub(super) struct TxSide {
    pub(super) ops: SeqMap<TxEntry>,
    pub(super) next_id: u32,
    /// Packets handed to the device.
    pub(super) wrs: WrTable<Pkt, 0>,
    /// Reused list of the packets a send or a CTS window creates (no allocation per message).
    scratch: Vec<Pkt>,
    /// Our read-based messages whose EOR or READ_NACK has not come (libfabric's
    /// `num_read_msg_in_flight`; runting reads are used only when it is 0).
    read_msgs: usize,
    tx_read: IdMap<u32, TxRead>,
}

impl TxSide {
    pub(super) fn new(cap: usize) -> TxSide {
        TxSide {
            ops: SeqMap::new(cap),
            next_id: 1,
            wrs: WrTable::default(),
            scratch: Vec::new(),
            read_msgs: 0,
            tx_read: IdMap::default(),
        }
    }

    /// The next packet for the device, from the peers in turn: its payload is a slice of its
    /// owner's buffer (a send's here, the emulation's through `ema_payload`: owner, range),
    /// its headers are copied into the arena `hdr`. `None` for a packet whose owner is gone.
    pub(super) fn next_packet(
        &mut self,
        peers: &mut Peers,
        hdr: &mut HeaderArena,
        ema_payload: impl Fn(&Owner, usize, usize) -> Option<Bytes>,
    ) -> Option<Transmit> {
        while let Some((dest, pkt)) = peers.next_packet() {
            let payload = match pkt.owner {
                Owner::Tx(id) => match self.ops.get(&id) {
                    Some(t) => t.buf.slice(pkt.off..pkt.end),
                    None => continue,
                },
                Owner::Handshake | Owner::Ctrl | Owner::Rd(_) => Bytes::new(),
                Owner::Ema(_) | Owner::Resp(_) => match ema_payload(&pkt.owner, pkt.off, pkt.end) {
                    Some(b) => b,
                    None => continue,
                },
            };
            let hdr = hdr.copy(pkt.hdr.bytes());
            let wr_id = self.wrs.insert(pkt);
            return Some(Transmit {
                wr_id,
                dest,
                hdr,
                payload,
                kind: super::TransmitKind::Send,
            });
        }
        None
    }
}

/// A send operation in flight.
#[derive(Debug)]
pub(super) struct TxEntry {
    pub(super) peer: u64,
    pub(super) context: u64,
    /// The bytes that go in packets: the whole message, or (a region send, `SendOp::region_len`)
    /// only those read so far.
    pub(super) buf: Bytes,
    /// Length of the message.
    pub(super) len: usize,
    pub(super) tag: Option<u64>,
    pub(super) dc: bool,
    pub(super) msg_id: u32,
    pub(super) proto: Proto,
    /// Packets created and not yet completed by the device.
    pub(super) pending: usize,
    /// Bytes put into packets so far.
    pub(super) scheduled: usize,
    /// Long-CTS: bytes the receiver has granted (first chunk plus CTS windows).
    pub(super) window_end: usize,
    /// Long-CTS: the receiver's id, echoed in CTSDATA.
    pub(super) recv_id: u32,
    /// Delivery complete: the RECEIPT arrived.
    pub(super) receipt: bool,
}

/// Length of the headers of an eager REQ (what [`Packet::header_len`] says of
/// `Packet::EagerRtm`).
fn eager_header_len(opt: &ReqOpt, tagged: bool, dc: bool) -> usize {
    let sender = match opt.sender {
        Sender::RawAddr(_) => RAW_ADDR_HDR_LEN,
        Sender::Connid(_) => CONNID_HDR_LEN,
        Sender::None => 0,
    };
    let cq = if opt.cq_data.is_some() {
        CQ_DATA_HDR_LEN
    } else {
        0
    };
    8 + 8 * usize::from(tagged) + 8 * usize::from(dc) + sender + cq
}

/// The headers of an eager REQ (EAGER_MSGRTM/TAGRTM, DC_EAGER_MSGRTM/TAGRTM), byte for byte
/// what [`Packet::encode_header`] writes for `Packet::EagerRtm` (a test compares them), written
/// without the codec's generality: every small message has one.
fn eager_header(opt: &ReqOpt, msg_id: u32, tag: Option<u64>, dc_send_id: Option<u32>) -> Hdr {
    let ty = match (tag.is_some(), dc_send_id.is_some()) {
        (false, false) => PacketType::EagerMsgRtm,
        (true, false) => PacketType::EagerTagRtm,
        (false, true) => PacketType::DcEagerMsgRtm,
        (true, true) => PacketType::DcEagerTagRtm,
    };
    let mut flags = req_flags::MSG;
    if tag.is_some() {
        flags |= req_flags::TAGGED;
    }
    match opt.sender {
        Sender::RawAddr(_) => flags |= req_flags::RAW_ADDR_HDR,
        Sender::Connid(_) => flags |= req_flags::CONNID_HDR,
        Sender::None => {}
    }
    if opt.cq_data.is_some() {
        flags |= req_flags::CQ_DATA_HDR;
    }
    let mut h = Hdr::empty();
    h.put(&[ty.id(), PROTOCOL_VERSION]);
    h.put(&flags.to_le_bytes());
    h.put(&msg_id.to_le_bytes());
    if let Some(id) = dc_send_id {
        h.put(&id.to_le_bytes());
        h.put(&[0; 4]);
    }
    if let Some(t) = tag {
        h.put(&t.to_le_bytes());
    }
    if let Sender::RawAddr(a) = opt.sender {
        h.put(&RAW_ADDR_HDR_ADDR_LEN.to_le_bytes());
        h.put(&a.to_bytes());
        h.put(&[0; RAW_ADDR_HDR_LEN - 4 - crate::addr::RAW_ADDR_LEN]);
    }
    if let Some(d) = opt.cq_data {
        h.put(&d.to_le_bytes());
    }
    if let Sender::Connid(c) = opt.sender {
        h.put(&c.to_le_bytes());
    }
    h
}

/// What the dispatcher does after a send completion the transmit side took
/// ([`TxSide::completed`]): work for another sub-state.
pub(super) enum Then {
    Nothing,
    /// A packet of the RMA emulation completed (`Ema::pkt_done`).
    Ema(Owner, Status),
    /// The device says the peer is gone.
    FailPeer(u64, Status),
    /// The REQ of device RMA operation `id` (LONGREAD_RTW) failed.
    ReadReqFailed(u32, Status),
}

impl TxSide {
    /// A send-side id no operation uses: messages, device RMA and emulated RMA draw from this
    /// one space (`taken` says which ids the others hold), so a CTS, CTSDATA or RECEIPT finds
    /// its owner by its id alone.
    pub(super) fn alloc_id(&mut self, taken: impl Fn(u32) -> bool) -> u32 {
        self.ops.free_id(&mut self.next_id, taken)
    }

    /// Starts send `op`: `Again` when `max_tx_ops` are in flight or the peer is in RNR
    /// backoff, `NoMemory` when the peer table is full; else chooses its protocol and queues
    /// its first packets. `taken` as in [`TxSide::alloc_id`].
    pub(super) fn send(
        &mut self,
        now: Instant,
        mut op: SendOp,
        taken: impl Fn(u32) -> bool,
        cx: &mut Cx,
    ) -> Result<(), (Error, SendOp)> {
        if cx.peers.in_backoff() {
            cx.peers.expire_backoffs(now, &mut cx.out.timers);
        }
        if self.ops.len() >= cx.cfg.max_tx_ops {
            return Err((cx.out.again("send", "max_tx_ops operations in flight"), op));
        }
        let Some(pid) = cx.peer_for_send(op.dest) else {
            let e = Error::new(ErrorKind::NoMemory, "send").with_detail("peer table full");
            return Err((e, op));
        };
        let Some(peer) = cx.peers.get(&pid) else {
            return Err((Error::new(ErrorKind::Io, "send"), op));
        };
        if peer.backoff_until.is_some() {
            return Err((cx.out.again("send", "peer in RNR backoff"), op));
        }
        let sender = our_sender(cx.local, peer.hs_received);
        let msg_id = peer.next_msg_id;
        let opt = ReqOpt {
            sender,
            cq_data: op.data.map(u64::from),
        };
        let send_id = self.alloc_id(taken);
        let tag = op.tag;
        let dc = op.delivery_complete;
        let m = MsgHdr {
            pid,
            send_id,
            opt,
            msg_id,
            tag,
            dc,
        };
        let len = op.len();
        let device_only = match self.device_only_send(pid, &op, cx) {
            Ok(d) => d,
            Err(e) => return Err((e, op)),
        };
        let rp = self.read_protocol(pid, &op, device_only, cx);
        if op.region_len.is_some() {
            if let Err(e) = region_packet_bytes(&mut op, rp, cx.memory.as_deref()) {
                return Err((e, op));
            }
        }
        let mut pkts = std::mem::take(&mut self.scratch);
        let packed = match rp {
            Some(rp) => self.packetize_read(&mut pkts, &m, len, rp, cx),
            None => packetize(&mut pkts, &m, len, &cx.cfg),
        };
        let (proto, scheduled) = match packed {
            Ok(x) => x,
            Err(e) => {
                pkts.clear();
                self.scratch = pkts;
                return Err((e, op));
            }
        };
        if let Some(p) = cx.peers.get_mut(&pid) {
            p.next_msg_id = p.next_msg_id.wrapping_add(1);
        }
        self.ops.insert(
            send_id,
            TxEntry {
                peer: pid,
                context: op.context,
                buf: op.buf,
                len,
                tag,
                dc,
                msg_id,
                proto,
                pending: pkts.len(),
                scheduled,
                window_end: scheduled,
                recv_id: 0,
                receipt: false,
            },
        );
        for p in pkts.drain(..) {
            cx.peers.enqueue(p, false, false);
        }
        self.scratch = pkts;
        Ok(())
    }

    /// The device completed packet `wr_id`: a send's packet counts down (and completes it),
    /// RNR puts it back, a failure fails its send; what concerns another sub-state is returned.
    #[inline]
    pub(super) fn completed(
        &mut self,
        now: Instant,
        wr_id: u64,
        status: Status,
        cx: &mut Cx,
    ) -> Then {
        let Some(pkt) = self.wrs.take(wr_id) else {
            tracing::debug!(wr_id, "send completion for an unknown work request");
            return Then::Nothing;
        };
        if status == Status::Success
            && let Some(p) = cx.peers.get_mut(&pkt.peer)
        {
            // The device delivered to it: it answers at its address.
            p.verified = true;
        }
        if matches!(pkt.owner, Owner::Ema(_) | Owner::Resp(_))
            && status != Status::RnrRetryExceeded
            && !peer_fatal(status)
        {
            if status == Status::Success && pkt.rnr > 0 {
                cx.peers.reset_backoff(pkt.peer, &mut cx.out.timers);
            }
            return Then::Ema(pkt.owner, status);
        }
        match status {
            Status::Success => {
                if pkt.rnr > 0 {
                    // A resent packet got through: the peer's backoff is over and its wait
                    // starts afresh (libfabric's `efa_rdm_pke_release_tx`).
                    cx.peers.reset_backoff(pkt.peer, &mut cx.out.timers);
                }
                if let Owner::Tx(id) = pkt.owner {
                    self.read_pkt_done(id, &pkt, &mut cx.peers);
                    if let Some(t) = self.ops.get_mut(&id) {
                        t.pending = t.pending.saturating_sub(1);
                        self.maybe_complete(id, cx);
                    }
                }
            }
            Status::RnrRetryExceeded => {
                cx.out.stats.rnr += 1;
                self.requeue_rnr(now, pkt, cx);
            }
            s if peer_fatal(s) => return Then::FailPeer(pkt.peer, s),
            s => match pkt.owner {
                Owner::Tx(id) => {
                    let e = Error::new(s.error_kind(), "send")
                        .with_detail(format!("device status {s}"));
                    self.fail(id, e, Some(s), cx);
                }
                Owner::Rd(id) => return Then::ReadReqFailed(id, s),
                _ => tracing::debug!(status = %s, "a control packet failed; dropped"),
            },
        }
        Then::Nothing
    }

    /// RNR: the packet goes back to the front of its peer's queue; from its second RNR on, the
    /// peer backs off.
    fn requeue_rnr(&mut self, now: Instant, mut pkt: Pkt, cx: &mut Cx) {
        if !cx.peers.contains_key(&pkt.peer) {
            return;
        }
        if let Owner::Tx(id) = pkt.owner {
            if !self.ops.contains_key(&id) {
                return;
            }
        }
        pkt.rnr = pkt.rnr.saturating_add(1);
        cx.out.stats.retransmits += 1;
        let again = pkt.rnr > 1;
        let pid = pkt.peer;
        let ctrl = !matches!(pkt.owner, Owner::Tx(_));
        cx.peers.enqueue(pkt, ctrl, true);
        if again {
            cx.peers
                .rnr_backoff(pid, now, &cx.cfg, &mut cx.rng, &mut cx.out.timers);
        }
    }

    /// Completes a send when all its packets are done, all its bytes sent and (delivery
    /// complete) its RECEIPT arrived.
    #[inline]
    pub(super) fn maybe_complete(&mut self, id: u32, cx: &mut Cx) {
        // Read-based messages are delivery complete by nature (EOR), without RECEIPT.
        let done = self.ops.get(&id).is_some_and(|t| {
            t.pending == 0
                && t.scheduled == t.len
                && (!t.dc || t.receipt || matches!(t.proto, Proto::LongRead | Proto::RuntRead))
        });
        if !done {
            return;
        }
        let Some(t) = self.ops.remove(&id) else {
            return;
        };
        self.read_gone(id, t.peer, &mut cx.peers);
        let len = t.len;
        cx.out.stats.tx_msgs += 1;
        cx.out.stats.tx_bytes += len as u64;
        cx.out.events.push_back(Event::Send(SendDone {
            context: t.context,
            buf: t.buf,
            len,
            tag: t.tag,
            error: None,
            status: None,
        }));
    }

    /// Fails a send at once; its packets still on the device complete unnoticed.
    pub(super) fn fail(&mut self, id: u32, error: Error, status: Option<Status>, cx: &mut Cx) {
        let Some(t) = self.ops.remove(&id) else {
            return;
        };
        self.read_gone(id, t.peer, &mut cx.peers);
        cx.peers.withdraw(t.peer, Owner::Tx(id));
        cx.out.stats.errors += 1;
        tracing::debug!(error = %error, "send failed");
        cx.out.events.push_back(Event::Send(SendDone {
            context: t.context,
            buf: t.buf,
            len: 0,
            tag: t.tag,
            error: Some(error),
            status,
        }));
    }

    /// The peer `pid` is gone: its sends fail.
    pub(super) fn peer_failed(&mut self, pid: u64, g: Gone, cx: &mut Cx) {
        let ids = self.ops.iter().filter(|(_, t)| t.peer == pid);
        for id in sorted(ids.map(|(id, _)| id)) {
            self.fail(id, g.error("send"), g.status, cx);
        }
    }

    /// `close()`: every send completes with `Canceled`; nothing is kept.
    pub(super) fn close(&mut self, cx: &mut Cx) {
        for id in self.ops.sorted_keys() {
            let e = Error::new(ErrorKind::Canceled, "send").with_detail("endpoint closed");
            self.fail(id, e, None, cx);
        }
        self.read_close();
        self.wrs.clear();
    }

    /// A CTS: the receiver grants `recv_length` more bytes of a long-CTS send (a CTS with
    /// READ_REQ goes to the emulation, `rma/cts.rs`).
    pub(super) fn handle_cts(
        &mut self,
        pid: u64,
        send_id: u32,
        recv_id: u32,
        recv_length: u64,
        cx: &mut Cx,
    ) {
        let Some(t) = self.ops.get_mut(&send_id) else {
            return cx.out.drop_pkt("CTS for an unknown send_id");
        };
        if t.peer != pid || t.proto != Proto::LongCts {
            return cx
                .out
                .drop_pkt("CTS for a send that is not a long-CTS send to this peer");
        }
        if t.scheduled != t.window_end {
            return cx.out.drop_pkt("CTS while a window is still being sent");
        }
        let Some(end) = cts_window_end(t.scheduled, recv_length, t.len) else {
            return cx
                .out
                .drop_pkt("CTS with a zero window or beyond the message");
        };
        t.window_end = end;
        t.recv_id = recv_id;
        let hs = cx.peers.get(&pid).is_some_and(|p| p.hs_received);
        if hs {
            self.schedule_ctsdata(send_id, cx);
        } else if let Some(p) = cx.peers.get_mut(&pid) {
            // CTSDATA carries our connid after its header; it waits for the peer's HANDSHAKE.
            p.blocked.push(send_id);
        }
    }

    /// Queues the CTSDATA packets of the window granted to send `id`.
    pub(super) fn schedule_ctsdata(&mut self, id: u32, cx: &mut Cx) {
        let Some(t) = self.ops.get(&id) else {
            return;
        };
        let (pid, recv_id, off, end) = (t.peer, t.recv_id, t.scheduled, t.window_end);
        let mut pkts = std::mem::take(&mut self.scratch);
        let (cfg, local) = (&cx.cfg, cx.local);
        if push_ctsdata(
            &mut pkts,
            pid,
            Owner::Tx(id),
            recv_id,
            off..end,
            0,
            cfg,
            local,
        ) != end
        {
            pkts.clear();
            self.scratch = pkts;
            let e = Error::new(ErrorKind::Io, "send").with_detail("packet encoding failed");
            return self.fail(id, e, None, cx);
        }
        if let Some(t) = self.ops.get_mut(&id) {
            t.scheduled = end;
            t.pending += pkts.len();
        }
        for p in pkts.drain(..) {
            cx.peers.enqueue(p, false, false);
        }
        self.scratch = pkts;
    }

    /// A RECEIPT: the data of delivery-complete send `send_id` is in the receiver's buffer.
    pub(super) fn handle_receipt(&mut self, pid: u64, send_id: u32, msg_id: u32, cx: &mut Cx) {
        let Some(t) = self.ops.get_mut(&send_id) else {
            return cx.out.drop_pkt("RECEIPT for an unknown send_id");
        };
        if t.peer != pid || !t.dc || t.msg_id != msg_id || t.receipt {
            return cx.out.drop_pkt("RECEIPT that does not match its send");
        }
        t.receipt = true;
        self.maybe_complete(send_id, cx);
    }
}

/// A region send (`SendOp::region_len`): reads into `op.buf` the bytes that go in packets
/// now, none for a long read, the runt of a runting read, all of them otherwise.
fn region_packet_bytes(
    op: &mut SendOp,
    rp: Option<ReadProto>,
    memory: Option<&dyn RmaMemory>,
) -> Result<(), Error> {
    let Some((key, addr)) = op.read_key else {
        return Err(Error::new(ErrorKind::InvalidArgument, "send")
            .with_detail("region_len without read_key"));
    };
    let need = match rp {
        Some(ReadProto::Long(_)) => 0,
        Some(ReadProto::Runt(_, runt)) => runt,
        None => op.len(),
    };
    if need > 0 {
        op.buf = region_bytes(memory, key, addr, need)?;
    }
    Ok(())
}

/// `len` bytes of a region send, read through the engine's memory (the application must
/// not hold the region's lock while it sends from it: `Again` then).
pub(super) fn region_bytes(
    memory: Option<&dyn RmaMemory>,
    key: u64,
    addr: u64,
    len: usize,
) -> Result<Bytes, Error> {
    let Some(mem) = memory else {
        return Err(Error::new(ErrorKind::InvalidArgument, "send")
            .with_detail("a region send needs the engine's memory (Engine::set_memory)"));
    };
    mem.read(key, addr, len as u64)
}

/// The packets a message is sent in now (all of eager and medium, the first of long-CTS),
/// appended to `pkts`; the protocol and the bytes they carry.
fn packetize(
    pkts: &mut Vec<Pkt>,
    m: &MsgHdr,
    len: usize,
    cfg: &EngineConfig,
) -> Result<(Proto, usize), Error> {
    let mtu = cfg.mtu;
    let (opt, msg_id, tag) = (m.opt, m.msg_id, m.tag);
    let dc_send_id = m.dc.then_some(m.send_id);
    if mtu
        .checked_sub(eager_header_len(&opt, tag.is_some(), m.dc))
        .is_some_and(|cap| len <= cap)
    {
        let hdr = eager_header(&opt, msg_id, tag, dc_send_id);
        pkts.push(Pkt::new(m.pid, Owner::Tx(m.send_id), hdr, 0, len));
        return Ok((Proto::Eager, len));
    }
    if len <= cfg.max_medium_msg_size {
        let seg = |seg_offset: u64| Packet::MediumRtm {
            opt,
            msg_id,
            msg_length: len as u64,
            seg_offset,
            tag,
            dc_send_id,
        };
        let cap = mtu.saturating_sub(seg(0).header_len());
        if cap == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "send").with_detail("MTU too small"));
        }
        let mut off = 0;
        for n in medium_segments(len, cap) {
            push_pkt(pkts, m, &seg(off as u64), off, off + n)?;
            off += n;
        }
        return Ok((Proto::Medium, off));
    }
    let first = Packet::LongCtsRtm {
        opt,
        msg_id,
        msg_length: len as u64,
        send_id: m.send_id,
        credit_request: u32::try_from(cfg.tx_min_credits).unwrap_or(u32::MAX),
        tag,
        dc: m.dc,
        read_nack: false,
    };
    let cap = mtu.saturating_sub(first.header_len());
    if mtu <= CTSDATA_MAX_HEADER_LEN || cap == 0 {
        return Err(Error::new(ErrorKind::InvalidArgument, "send").with_detail("MTU too small"));
    }
    let n = cap.min(len);
    push_pkt(pkts, m, &first, 0, n)?;
    Ok((Proto::LongCts, n))
}

/// Encodes `pkt` and appends it, with bytes `a..b` of the message as payload, to `pkts`.
pub(super) fn push_pkt(
    pkts: &mut Vec<Pkt>,
    m: &MsgHdr,
    pkt: &Packet<'_>,
    a: usize,
    b: usize,
) -> Result<(), Error> {
    let Some(hdr) = encode(pkt) else {
        return Err(Error::new(ErrorKind::Io, "send").with_detail("packet encoding failed"));
    };
    pkts.push(Pkt::new(m.pid, Owner::Tx(m.send_id), hdr, a, b));
    Ok(())
}

/// Payload bytes of one CTSDATA packet (libfabric's `max_data_payload_size`).
pub(super) fn ctsdata_room(cfg: &EngineConfig) -> usize {
    cfg.mtu.saturating_sub(CTSDATA_MAX_HEADER_LEN).max(1)
}

/// Where the window a CTS grants ends: `recv_length` more bytes after the `sent` bytes of a
/// `len`-byte long-CTS transfer. `None` for an empty window or one past the transfer.
#[inline]
pub(super) fn cts_window_end(sent: usize, recv_length: u64, len: usize) -> Option<usize> {
    let n = usize::try_from(recv_length).ok().filter(|&n| n > 0)?;
    sent.checked_add(n).filter(|&end| end <= len)
}

/// Bytes of one CTS window: `tx_min_credits` CTSDATA packets' worth.
pub(super) fn cts_credit(cfg: &EngineConfig) -> usize {
    cfg.tx_min_credits.max(1).saturating_mul(ctsdata_room(cfg))
}

/// Grants `pid` the next window of a long-CTS transfer: one CTS credit of the `left` bytes
/// still to come at most, in a CTS naming the peer's `send_id` and our `recv_id` (`read_req`
/// when a read's requester grants it). Returns the window's length.
#[inline]
pub(super) fn grant_cts(
    cx: &mut Cx,
    pid: u64,
    send_id: u32,
    recv_id: u32,
    left: usize,
    read_req: bool,
) -> usize {
    let window = left.min(cts_credit(&cx.cfg));
    let cts = Packet::Cts {
        connid: Some(cx.local.qkey),
        send_id,
        recv_id,
        recv_length: window as u64,
        read_req,
    };
    cx.peers.queue_ctrl(pid, &cts);
    window
}

/// Appends to `pkts` the CTSDATA packets to `pid` carrying bytes `range` of a long-CTS
/// transfer the peer knows as `recv_id`; a packet's payload is bytes `off - base ..` of its
/// owner's buffer. Returns where the packets end (`range.end`, unless a header failed to
/// encode).
#[allow(clippy::too_many_arguments)]
pub(super) fn push_ctsdata(
    pkts: &mut Vec<Pkt>,
    pid: u64,
    owner: Owner,
    recv_id: u32,
    range: std::ops::Range<usize>,
    base: usize,
    cfg: &EngineConfig,
    local: RawAddr,
) -> usize {
    let max = ctsdata_room(cfg);
    let (mut off, to) = (range.start, range.end);
    while off < to {
        let n = max.min(to - off);
        let h = Packet::CtsData {
            connid: Some(local.qkey),
            recv_id,
            seg_length: n as u64,
            seg_offset: off as u64,
        };
        let Some(hdr) = encode(&h) else {
            break;
        };
        pkts.push(Pkt::new(pid, owner, hdr, off - base, off - base + n));
        off += n;
    }
    off
}

#[cfg(test)]
mod tests {
    use super::{eager_header, eager_header_len};
    use crate::addr::{Gid, RawAddr};
    use crate::fault::{Rng, test_seed};
    use crate::proto::engine::types::medium_split;
    use crate::proto::wire::{Packet, ReqOpt, Sender};

    #[test]
    fn eager_header_is_the_codecs() {
        let seed = test_seed();
        let mut rng = Rng::new(seed);
        for _ in 0..200 {
            let mut gid = [0u8; 16];
            for b in &mut gid {
                *b = rng.next_u64() as u8;
            }
            let addr = RawAddr::new(Gid(gid), rng.next_u64() as u16, rng.next_u64() as u32);
            for sender in [
                Sender::None,
                Sender::RawAddr(addr),
                Sender::Connid(rng.next_u64() as u32),
            ] {
                for (cq, tag, dc) in (0..8).map(|k| (k & 1 != 0, k & 2 != 0, k & 4 != 0)) {
                    let opt = ReqOpt {
                        sender,
                        cq_data: cq.then(|| rng.next_u64()),
                    };
                    let msg_id = rng.next_u64() as u32;
                    let tag = tag.then(|| rng.next_u64());
                    let dc_send_id = dc.then(|| rng.next_u64() as u32);
                    let p = Packet::EagerRtm {
                        opt,
                        msg_id,
                        tag,
                        dc_send_id,
                    };
                    let mut want = Vec::new();
                    let n = p.encode_header(&mut want).unwrap();
                    let h = eager_header(&opt, msg_id, tag, dc_send_id);
                    assert_eq!(h.bytes(), &want[..], "seed {seed} {p:?}");
                    assert_eq!(eager_header_len(&opt, tag.is_some(), dc), n, "seed {seed}");
                    assert_eq!(p.header_len(), n, "seed {seed}");
                }
            }
        }
    }

    #[test]
    fn medium_split_like_libfabric() {
        for total in [1usize, 7, 8, 9, 100, 8000, 8700, 17_000, 65_536, 65_535] {
            for max in [64usize, 1000, 8748] {
                let v = medium_split(total, max);
                assert_eq!(v.iter().sum::<usize>(), total, "{total} {max}");
                assert!(v.iter().all(|&n| n > 0 && n <= max), "{total} {max} {v:?}");
                let n = v.len();
                assert!(
                    v[..n - 1].iter().all(|&x| x % 8 == 0 || total < 8),
                    "{total} {max} {v:?}"
                );
            }
        }
        // 65536 bytes in 8748-byte packets: 8 packets of 8192.
        assert_eq!(medium_split(65_536, 8748), vec![8192; 8]);
    }
}
