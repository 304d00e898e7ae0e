//! The sans-I/O RDM protocol engine (EFA RDM wire protocol v4).
//!
//! One `Engine` serves one RDM endpoint. It never reads a clock, sleeps or touches a device:
//! the caller feeds it application operations ([`Engine::send`], [`Engine::post_recv`], ...),
//! device completions ([`Engine::handle_recv`], [`Engine::handle_send_completion`]) and the
//! time, and takes out packets to post ([`Engine::poll_transmit`]), completions
//! ([`Engine::poll_event`]) and the next timer ([`Engine::poll_timeout`]).
//!
//! The device under it must deliver datagrams of at most one MTU exactly once, in any order (SRD);
//! the engine adds per-peer ordering (send-after-send), segmentation (eager / medium / long-CTS),
//! tag matching, flow control and RNR backoff.
//!
//! How it works (state per peer, protocol choice, windows, backoff, memory caps, what the
//! handshake advertises) is described in the "Engine" section of `docs/protocol.md`. The code is
//! split by direction: `peer` (identification, handshake, backoff, failure), `tx` (protocol
//! choice, packet queues, CTS/RECEIPT, device completions), `rx` (reordering, matching,
//! segments, CTSDATA, receives, peek/claim/discard) and `read` (device RDMA, long/runting read,
//! EOR, READ_NACK, LONGREAD_RTW), sharing the leaf types of `types` and `wr`.

// The engine's operations hand a refused operation back by value (`Err((error, op))`), so the
// caller keeps its buffers: the `Err` side is as large as the operation.
#![allow(
    clippy::result_large_err,
    reason = "a refused operation is handed back by value"
)]

use std::collections::VecDeque;
use std::time::Instant;

use bytes::BytesMut;

use crate::addr::RawAddr;
use crate::device::{Source, Status};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::Rng;
use crate::proto::wire::{self, Packet};
use crate::stats::EndpointStats;

mod budget;
mod config;
mod counts;
mod cx;
mod local;
mod ops;
mod peer;
mod read;
mod recv;
mod rma;
mod rx;
mod tx;
mod types;
mod util;
mod wr;

pub use config::{EngineConfig, EngineLimits, EngineSizes};
pub use counts::TargetCounts;
use cx::Cx;
pub use local::{CopyFn, LocalMsg, SameHost};
pub use ops::{
    Event, MAX_REMOTE_WRITE_EVENTS, Peeked, RecvDone, RecvOp, RemoteWriteDone, Resources, RmaBuf,
    RmaDone, RmaKind, RmaMemory, RmaOp, RmaPath, SendDone, SendOp, Transmit, TransmitKind,
};
use recv::{MultiRecv, PostedItem};
use rx::Done;
use util::{HeaderArena, Out, Timer};

/// The RDM protocol engine of one endpoint.
#[derive(Debug)]
pub struct Engine {
    closed: bool,
    /// The configuration, the peers, the budget, the completions and the rest every handler
    /// reaches (`cx.rs`), kept together so that a handler gets them as one reference.
    cx: Cx,
    /// Send operations by `send_id`.
    tx: tx::TxSide,
    /// The receive side: inbound messages, matching, multi-receive buffers, claimed messages.
    rx: rx::RxSide,
    /// Arena the headers handed to the device are copied into.
    hdr: HeaderArena,
    /// Device RDMA and the read-based protocols (`read.rs`).
    rd: read::ReadState,
    /// Emulated RMA and atomics (`rma.rs`).
    ema: rma::Ema,
}

impl Engine {
    /// An engine for the endpoint whose queue pair has raw address `local`.
    pub fn new(cfg: EngineConfig, local: RawAddr, _now: Instant) -> Engine {
        let rng = Rng::new(cfg.seed ^ 0x5eed_e761_9e00_0000);
        let (max_tx, max_rx) = (cfg.max_tx_ops, cfg.max_rx_ops);
        Engine {
            closed: false,
            cx: Cx {
                cfg,
                local,
                remote_events: (false, false),
                memory: None,
                peers: peer::Peers::default(),
                budget: budget::Budget::new(EngineLimits::default()),
                wrs: VecDeque::new(),
                out: Out::default(),
                rng,
                counts: TargetCounts::default(),
                receipts: VecDeque::new(),
            },
            tx: tx::TxSide::new(2 * max_tx),
            rx: rx::RxSide::new((2 * max_rx).max(4096)),
            hdr: HeaderArena::default(),
            rd: read::ReadState::default(),
            ema: rma::Ema::default(),
        }
    }

    /// The engine's interface for the same-host path.
    #[inline]
    pub fn same_host(&mut self) -> SameHost<'_> {
        SameHost(self)
    }

    /// The endpoint's own address.
    pub fn local_addr(&self) -> RawAddr {
        self.cx.local
    }

    /// Replaces the memory bounds (an addition to the declared API).
    pub fn set_limits(&mut self, limits: EngineLimits) {
        self.cx.budget.limits = limits;
    }

    /// The memory bounds in force.
    pub fn limits(&self) -> EngineLimits {
        self.cx.budget.limits
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cx.cfg
    }

    /// Starts a send. `Again` (with the operation handed back) when `max_tx_ops` are in flight
    /// or the peer is in RNR backoff; `MsgSize` never (any size is allowed).
    pub fn send(&mut self, now: Instant, op: SendOp) -> Result<(), (Error, SendOp)> {
        if self.closed {
            return Err((Engine::closed_error("send"), op));
        }
        let p = self.parts();
        let (rd, ema) = (&*p.rd, &*p.ema);
        let taken = |id| rd.owns_id(id) || ema.owns_send_id(id);
        p.tx.send(now, op, taken, p.cx)
    }

    /// Posts a receive: matched at once against unexpected messages, else queued. `Again` (with
    /// the operation handed back) when `max_rx_ops` are posted.
    pub fn post_recv(&mut self, now: Instant, op: RecvOp) -> Result<(), (Error, RecvOp)> {
        if self.closed {
            return Err((Engine::closed_error("recv"), op));
        }
        // Only a receive that matched at once needs the handlers' context.
        let posting = self.rx.post(op, self.cx.cfg.max_rx_ops, &mut self.cx.out)?;
        if !matches!(posting, recv::Posting::Done) {
            let p = self.parts();
            p.rx.posted(now, posting, p.cx);
        }
        Ok(())
    }

    /// Cancels the oldest posted receive with `context` that has not started matching; it
    /// completes with `Canceled`. Returns false when there is none.
    pub fn cancel_recv(&mut self, context: u64) -> bool {
        !self.closed && self.rx.cancel(context, &mut self.cx.out)
    }

    /// Looks for an unexpected tagged message (`FI_PEEK`); with `claim` it is reserved for
    /// [`Engine::recv_claimed`] (`FI_CLAIM`). `NoMessage` when none matches.
    pub fn peek(
        &mut self,
        tag: u64,
        ignore: u64,
        src: Option<RawAddr>,
        claim: bool,
    ) -> Result<Peeked> {
        if self.closed {
            return Err(Engine::closed_error("peek"));
        }
        self.rx.peek(tag, ignore, src, claim)
    }

    /// Receives a claimed message into `op.buf`.
    pub fn recv_claimed(
        &mut self,
        now: Instant,
        claim: u64,
        op: RecvOp,
    ) -> Result<(), (Error, RecvOp)> {
        if self.closed {
            return Err((Engine::closed_error("recv_claimed"), op));
        }
        let p = self.parts();
        p.rx.recv_claimed(now, claim, op, p.cx)
    }

    /// Discards an unexpected tagged message (`FI_DISCARD`); its sender's operation still
    /// completes normally. `NoMessage` when none matches.
    pub fn discard(&mut self, tag: u64, ignore: u64, src: Option<RawAddr>) -> Result<Peeked> {
        if self.closed {
            return Err(Engine::closed_error("discard"));
        }
        let (p, entry) = self.rx.discard(tag, ignore, src)?;
        if let Some((rid, last)) = entry {
            // Received and thrown away, so that the sender completes normally.
            let p = self.parts();
            p.rx.start_matched(last, rid, rx::Sink::discard(), None, p.cx);
        }
        Ok(p)
    }

    /// Tells the engine whether its queue pair lets RDMA writes with immediate data land without
    /// a posted receive buffer
    /// ([`DeviceCaps::unsolicited_write_recv`](crate::device::DeviceCaps::unsolicited_write_recv)):
    /// advertised in the HANDSHAKE (with RDMA write), and device
    /// writes with immediate data are used only towards peers with the same setting, as
    /// libfabric. Default false. (An addition to the declared API.)
    pub fn set_unsolicited_write_recv(&mut self, on: bool) {
        self.rd.set_unsolicited(on);
    }

    /// Gives the engine the memory peers' emulated RMA and atomics reach. Without it, such
    /// requests are refused with [`Status::RemoteBadAddress`].
    pub fn set_memory(&mut self, mem: std::sync::Arc<dyn RmaMemory>) {
        self.cx.memory = Some(mem);
    }

    /// Starts an RMA or atomic operation; `Again` when `max_tx_ops` operations are in flight.
    pub fn rma(&mut self, now: Instant, op: RmaOp) -> Result<(), (Error, RmaOp)> {
        if self.closed {
            return Err((Engine::closed_error("rma"), op));
        }
        // Device RDMA (and LONGREAD_RTW) first; the op comes back when it must be emulated.
        let p = self.parts();
        let ema = &*p.ema;
        let taken = |id| ema.owns_send_id(id);
        match p.rd.try_device(now, op, p.tx, taken, p.cx)? {
            None => Ok(()),
            Some(op) => {
                let p = self.parts();
                p.ema.start(op, p.tx, p.rd, p.rx, p.cx)
            }
        }
    }

    /// The device completed the RDMA work request `wr_id` (a [`TransmitKind::RdmaWrite`] or
    /// [`TransmitKind::RdmaRead`] handed out by [`Engine::poll_transmit`]); `buf` is the read
    /// buffer the device handed back.
    pub fn handle_rdma_completion(
        &mut self,
        now: Instant,
        wr_id: u64,
        status: Status,
        buf: Option<BytesMut>,
    ) {
        if self.closed {
            return;
        }
        let p = self.parts();
        let Some(pid) = p.rd.completed(now, wr_id, status, buf, p.rx, p.cx) else {
            return;
        };
        if peer::peer_fatal(status) && self.cx.peers.contains_key(&pid) {
            self.fail_peer(pid, status.error_kind(), Some(status), "RDMA failed");
        }
    }

    /// The device placed a peer's RDMA write with immediate data (`imm`, `len` bytes) in this
    /// side's memory: reported as [`Event::RemoteWrite`].
    pub fn handle_remote_write(&mut self, now: Instant, src: Source, imm: u32, len: usize) {
        let _ = now;
        if self.closed {
            return;
        }
        // The device wrote already: the completion is kept; the endpoint stops reposting
        // receive buffers while too many wait ([`Engine::remote_writes_full`]), which holds the
        // device back (receiver not ready) on devices where a write with immediate data takes
        // one.
        let cx = self.parts().cx;
        cx.counts.count(true, true);
        cx.out.remote_write(RemoteWriteDone {
            src: cx.peers.writer(src),
            data: imm,
            len,
        });
    }

    /// A datagram arrived from `src` (the device's receive completion); `data` is its bytes.
    /// Malformed, stale or duplicate packets are dropped and counted, never a panic.
    pub fn handle_recv(&mut self, now: Instant, src: Source, data: &[u8]) {
        if self.closed {
            self.drop_pkt("endpoint closed");
            return;
        }
        let (pkt, payload) = match wire::decode(data) {
            Ok(x) => x,
            Err(e) => {
                self.cx.out.stats.dropped_pkts += 1;
                tracing::debug!(error = %e, len = data.len(), "dropped an undecodable packet");
                return;
            }
        };
        let Some(pid) = self.identify(now, src, &pkt) else {
            return;
        };
        let p = self.parts();
        match pkt {
            Packet::EagerRtm { .. }
            | Packet::MediumRtm { .. }
            | Packet::LongCtsRtm { .. }
            | Packet::LongReadRtm { .. }
            | Packet::RuntReadRtm { .. } => {
                let ema = &*p.ema;
                let taken = |id| ema.owns_recv_id(id);
                if p.rx.handle_rtm(now, pid, &pkt, payload, taken, p.cx) {
                    p.ema.drain(now, pid, p.rx, p.cx);
                }
            }
            Packet::LongReadRtw { .. } | Packet::Eor { .. } | Packet::ReadNack { .. } => {
                if let Some(op) = p.rd.handle_pkt(pid, &pkt, p.tx, p.cx) {
                    self.emulate(op);
                }
            }
            Packet::EagerRtw {
                rma_iov,
                dc_send_id: None,
                ..
            } if rma_iov.is_empty() && payload.is_empty() => {
                // A 0-byte write: libfabric's handshake trigger. Nothing to do but answer with
                // our HANDSHAKE (below).
            }
            Packet::Handshake(h) => self.handle_handshake(now, pid, &h),
            // A CTS with READ_REQ is for a read the emulation serves; without, the id says whose
            // write it is (one id space: `TxSide::alloc_id`).
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                read_req,
                ..
            } if read_req || p.ema.owns_send_id(send_id) => {
                p.ema
                    .cts(now, pid, send_id, recv_id, recv_length, read_req, p.cx)
            }
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                ..
            } => p.tx.handle_cts(pid, send_id, recv_id, recv_length, p.cx),
            Packet::CtsData {
                recv_id,
                seg_offset,
                ..
            } if p.ema.owns_recv_id(recv_id) => {
                p.ema.ctsdata(now, pid, recv_id, seg_offset, payload, p.cx)
            }
            Packet::CtsData {
                recv_id,
                seg_offset,
                ..
            } => {
                p.rx.handle_ctsdata(now, pid, recv_id, seg_offset, payload, p.cx)
            }
            Packet::LongCtsRtw { .. }
            | Packet::LongCtsRtr { .. }
            | Packet::EagerRtw { .. }
            | Packet::ShortRtr { .. }
            | Packet::Rta { .. } => p.ema.request(now, pid, &pkt, payload, p.rx, p.cx),
            Packet::Receipt { send_id, .. } if p.ema.owns_send_id(send_id) => {
                p.ema.receipt(pid, send_id, &mut p.cx.out)
            }
            Packet::Receipt {
                send_id, msg_id, ..
            } => p.tx.handle_receipt(pid, send_id, msg_id, p.cx),
            Packet::ReadRsp {
                recv_id, send_id, ..
            } => p.ema.readrsp(pid, recv_id, send_id, payload, p.cx),
            Packet::AtomRsp { recv_id, .. } => p.ema.atomrsp(pid, recv_id, payload, &mut p.cx.out),
            Packet::PeerError {
                op_id,
                ref_kind: wire::peer_error_ref::OPE_INDEX,
                prov_errno,
                ..
            } => p.ema.peer_error(pid, op_id, prov_errno, &mut p.cx.out),
            // Exhaustive: a new packet type does not compile until it has its arm here.
            Packet::PeerError { .. } => p.cx.out.drop_pkt_type(&pkt),
        }
        // Every packet from a peer makes sure our HANDSHAKE goes to it (once).
        if self.cx.peers.contains_key(&pid) {
            self.queue_handshake(pid);
        }
    }

    /// The device completed the packet `wr_id` handed out by [`Engine::poll_transmit`].
    pub fn handle_send_completion(&mut self, now: Instant, wr_id: u64, status: Status) {
        if self.closed {
            return;
        }
        let p = self.parts();
        match p.tx.completed(now, wr_id, status, p.cx) {
            tx::Then::Nothing => {}
            tx::Then::Ema(owner, s) => self.ema.pkt_done(&owner, s, &mut self.cx.out),
            tx::Then::FailPeer(pid, s) => {
                self.fail_peer(pid, s.error_kind(), Some(s), "send failed")
            }
            tx::Then::ReadReqFailed(id, s) => self.rd.req_failed(id, s, &mut self.cx.out),
        }
    }

    /// Runs due timers (RNR backoff, stalled receives).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.closed {
            return;
        }
        let mut p = self.parts();
        let (cx, due) = (&mut p.cx, |cx: &Cx, t| cx.out.timers.expired(t, now));
        if due(cx, Timer::Backoff) {
            cx.peers.expire_backoffs(now, &mut cx.out.timers);
        }
        if due(cx, Timer::RxStall) {
            p.rx.stall_timeout(now, cx);
        }
        if due(cx, Timer::ReadRetry) {
            p.rd.timeout(now, cx);
        }
        if due(cx, Timer::EmaRetry) {
            p.ema.timeout(now, cx);
        }
    }

    /// The next packet to post, if the device has room (`max_outstanding_tx`).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        if self.closed || self.wrs_outstanding() >= self.cx.cfg.max_outstanding_tx {
            return None;
        }
        if self.cx.peers.in_backoff() {
            self.cx.peers.expire_backoffs(now, &mut self.cx.out.timers);
        }
        let (tx, peers, hdr) = (&mut self.tx, &mut self.cx.peers, &mut self.hdr);
        let ema = |o: &_, a, b| self.ema.payload(o, a, b);
        if self.cx.wrs.is_empty() {
            return tx.next_packet(peers, hdr, ema);
        }
        // Packets and RDMA work requests take turns (the device's send queue holds both).
        let wrs = &mut self.cx.wrs;
        if self.rd.rdma_turn() {
            self.rd
                .next_wr(wrs, peers)
                .or_else(|| tx.next_packet(peers, hdr, ema))
        } else {
            tx.next_packet(peers, hdr, ema)
                .or_else(|| self.rd.next_wr(wrs, peers))
        }
    }

    /// True when [`Engine::poll_transmit`] may have something (packets queued, peers in
    /// backoff, RDMA work requests waiting); false means it certainly has nothing.
    pub fn transmit_pending(&self) -> bool {
        self.cx.peers.has_ready() || self.cx.peers.in_backoff() || !self.cx.wrs.is_empty()
    }

    /// Messages and bytes held without a receive now (what [`Engine::resources`] reports as
    /// `buffered_msgs` and `buffered_bytes`, without its walk over the peers).
    pub fn buffered(&self) -> (usize, usize) {
        self.cx.budget.held()
    }

    /// The next change of which peers the device should hold back: `(peer, true)` when a peer
    /// holds more than its share of the buffering budget (half of
    /// [`EngineLimits::max_buffered_msgs`] or of [`EngineLimits::max_buffered_bytes`]) in
    /// messages no receive has taken, `(peer, false)` once it is under a quarter again (or gone).
    /// The caller asks the device to refuse the held peer's new messages with receiver-not-ready
    /// ([`QueuePair::hold_source`](crate::device::QueuePair::hold_source)), so one flooding peer
    /// cannot use up the budget that holds every peer back (issue 17, defect 2).
    pub fn poll_hold(&mut self) -> Option<(RawAddr, bool)> {
        self.cx.budget.poll_change()
    }

    /// True when messages wait without a receive (unexpected or claimed).
    pub fn has_unexpected(&self) -> bool {
        self.cx.budget.unexpected().0 > 0
    }

    /// True when [`Engine::poll_event`] has a completion.
    pub fn has_events(&self) -> bool {
        !self.cx.out.events.is_empty()
    }

    /// [`MAX_REMOTE_WRITE_EVENTS`] completions of peers' writes with immediate data wait for
    /// the application: the caller should hold the device back (stop reposting receive buffers).
    pub fn remote_writes_full(&self) -> bool {
        self.cx.out.remote_write_events >= MAX_REMOTE_WRITE_EVENTS
    }

    /// The next completion.
    pub fn poll_event(&mut self) -> Option<Event> {
        let ev = self.cx.out.events.pop_front();
        if matches!(ev, Some(Event::RemoteWrite(_))) {
            self.cx.out.remote_write_events = self.cx.out.remote_write_events.saturating_sub(1);
        }
        ev
    }

    /// When [`Engine::handle_timeout`] should run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.closed {
            return None;
        }
        self.cx.out.timers.next()
    }

    /// Closes: every operation still in flight completes with `Canceled` (collect them with
    /// [`Engine::poll_event`]); later calls are refused with `Closed`.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        // Receives first (pieces of multi-receive buffers before the buffers themselves).
        let p = self.parts();
        p.rx.close(p.cx);
        p.tx.close(p.cx);
        p.rd.close(p.cx);
        let e = Engine::closed_error("rma").with_detail("endpoint closed");
        p.ema.fail(None, &e, None, &mut p.cx.out);
        p.cx.peers
            .close(p.cx.cfg.recvwin_size, &mut p.cx.out.timers);
        p.cx.budget.reset();
    }

    /// What the engine holds now.
    pub fn resources(&self) -> Resources {
        Resources {
            tx_ops: self.tx.ops.len() + self.rd.ops_len() + self.ema.ops_len(),
            rx_ops: self.rx.user_ops,
            unexpected_msgs: self.cx.budget.unexpected().0,
            unexpected_bytes: self.cx.budget.unexpected().1,
            reorder_held: self.cx.peers.values().map(|p| p.robuf.held()).sum(),
            buffered_msgs: self.cx.budget.held().0,
            buffered_bytes: self.cx.budget.held().1,
            queued_pkts: self.cx.peers.queued() + self.cx.wrs.len(),
            outstanding_pkts: self.wrs_outstanding(),
            peers: self.cx.peers.len(),
            target_ops: self.ema.target_ops() + self.rd.targets(),
            remote_write_events: self.cx.out.remote_write_events,
        }
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        self.cx.out.stats
    }

    /// The application counts peers' writes (`writes`) or reads (`reads`) of this side's
    /// memory (`FI_REMOTE_WRITE` / `FI_REMOTE_READ` counters). A NIC serves one-sided RDMA
    /// without telling its target, so the HANDSHAKE then leaves out device RDMA write (read):
    /// peers, this crate's and libfabric's alike, emulate those operations with packets, and
    /// this side sees each one land ([`Engine::take_target_counts`]). Set it before the first
    /// HANDSHAKE goes out.
    pub fn set_remote_events(&mut self, writes: bool, reads: bool) {
        self.cx.remote_events = (writes, reads);
    }

    /// Takes the count of peers' RMA this side served since the last call.
    pub fn take_target_counts(&mut self) -> TargetCounts {
        std::mem::take(&mut self.cx.counts)
    }

    /// Counts a packet the caller dropped before it reached [`Engine::handle_recv`] (the device
    /// could not say where it came from).
    pub fn count_dropped(&mut self, why: &'static str) {
        self.drop_pkt(why);
    }

    fn drop_pkt(&mut self, why: &'static str) {
        self.cx.out.drop_pkt(why);
    }

    /// Packets and RDMA work requests on the device (bounded by `max_outstanding_tx`).
    fn wrs_outstanding(&self) -> usize {
        self.tx.wrs.len() + self.rd.outstanding()
    }

    fn closed_error(op: &'static str) -> Error {
        Error::new(ErrorKind::Closed, op)
    }

    // ---- what touches several sub-states ----

    /// Who sent `pkt` (arrived from `src`); a REQ with the raw address of a new incarnation
    /// replaces the older ones at its queue pair ([`peer::Peers::replaced_by`]) and adds it.
    /// `None` (counted) for stale, unknown or unidentifiable senders.
    fn identify(&mut self, now: Instant, src: Source, pkt: &Packet<'_>) -> Option<u64> {
        let pid = match self.cx.peers.identify(src, pkt, &mut self.cx.out) {
            peer::Who::Peer(id) => id,
            peer::Who::Nobody => return None,
            peer::Who::New(addr) => {
                let max = self.cx.budget.limits.max_peers;
                for (id, qkey) in self
                    .cx
                    .peers
                    .replaced_by(addr, now, self.cx.cfg.rx_stall_timeout)
                {
                    self.fail_peer(id, ErrorKind::ConnectionAborted, None, "peer restarted");
                    self.cx.peers.retire(addr.gid, addr.qpn, qkey, max);
                }
                self.cx
                    .peers
                    .new_peer(addr, max, self.cx.cfg.recvwin_size, &mut self.cx.out)?
            }
        };
        if let Some(p) = self.cx.peers.get_mut(&pid) {
            p.last_heard = Some(now);
        }
        Some(pid)
    }

    /// Queues our HANDSHAKE to `pid` unless it went already.
    fn queue_handshake(&mut self, pid: u64) {
        if !self.cx.peers.handshake_due(pid) {
            return;
        }
        let hs = peer::handshake(
            &self.cx.cfg,
            self.cx.local,
            self.cx.remote_events,
            self.rd.unsolicited(),
        );
        if let Some(hdr) = util::encode(&Packet::Handshake(hs)) {
            self.cx.peers.queue_handshake(pid, hdr);
        }
    }

    /// The peer's HANDSHAKE: held CTSDATA windows go out and RMA operations that waited for
    /// it choose their protocol.
    fn handle_handshake(&mut self, now: Instant, pid: u64, h: &wire::Handshake) {
        let Some((first, blocked)) = self.cx.peers.handshake_arrived(pid, h) else {
            return;
        };
        let p = self.parts();
        for id in blocked {
            p.tx.schedule_ctsdata(id, p.cx);
        }
        p.ema.handshake(now, pid, p.cx);
        if first {
            loop {
                let p = self.parts();
                let ema = &*p.ema;
                let taken = |id| ema.owns_send_id(id);
                let Some(op) = p.rd.next_after_handshake(pid, p.tx, taken, p.cx) else {
                    break;
                };
                self.emulate(op);
            }
        }
    }

    /// The peer is gone (or replaced): its send operations and the receives in progress from
    /// it fail with `kind`, its unexpected and reordered messages are dropped, and its state is
    /// forgotten so that a new incarnation starts afresh.
    fn fail_peer(&mut self, pid: u64, kind: ErrorKind, status: Option<Status>, why: &'static str) {
        let Some(p) = self.cx.peers.remove(&pid) else {
            return;
        };
        tracing::debug!(peer = %p.addr, ?kind, ?status, why, "peer failed");
        if p.held_back {
            self.cx.budget.hold_change(p.addr, false);
        }
        let g = types::Gone { kind, status, why };
        let Parts {
            tx,
            rx,
            rd,
            ema,
            cx,
        } = self.parts();
        rx.peer_gone(&p, g, cx);
        tx.peer_failed(pid, g, cx);
        rd.peer_failed(pid, g, cx);
        ema.fail(Some(pid), &g.error("rma"), status, &mut cx.out);
    }

    /// Starts `op` with the emulation; a refused one completes with its error.
    fn emulate(&mut self, op: RmaOp) {
        let p = self.parts();
        if let Err((e, op)) = p.ema.start(op, p.tx, p.rd, p.rx, p.cx) {
            let buf = RmaBuf::from_kind(op.kind);
            p.cx.out
                .rma_done(op.context, buf, 0, RmaPath::Emulated, Some(e), None);
        }
    }

    /// The sub-states and what their handlers reach (a split borrow of the engine).
    fn parts(&mut self) -> Parts<'_> {
        Parts {
            tx: &mut self.tx,
            rx: &mut self.rx,
            rd: &mut self.rd,
            ema: &mut self.ema,
            cx: &mut self.cx,
        }
    }
}

/// The engine's sub-states and the context their handlers take ([`Engine::parts`]).
struct Parts<'a> {
    tx: &'a mut tx::TxSide,
    rx: &'a mut rx::RxSide,
    rd: &'a mut read::ReadState,
    ema: &'a mut rma::Ema,
    cx: &'a mut Cx,
}
