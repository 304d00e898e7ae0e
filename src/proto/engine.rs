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
    cfg: EngineConfig,
    local: RawAddr,
    rng: Rng,
    closed: bool,

    /// The peers, finding them, their turns and backoffs.
    peers: peer::Peers,
    /// Send operations by `send_id`.
    tx: tx::TxSide,

    /// The receive side: inbound messages, matching, multi-receive buffers, claimed messages.
    rx: rx::RxSide,
    /// Messages and bytes held without a receive.
    budget: budget::Budget,

    /// The completions, counters and timers every handler reports into.
    out: Out,
    /// Memory peers reach with emulated RMA and atomics.
    memory: Option<std::sync::Arc<dyn RmaMemory>>,
    /// Arena the headers handed to the device are copied into.
    hdr: HeaderArena,
    /// Device RDMA and the read-based protocols (`read.rs`).
    rd: read::ReadState,
    /// RDMA work requests waiting for room on the device.
    wrs: VecDeque<wr::Wr>,
    /// Emulated RMA and atomics (`rma.rs`).
    ema: rma::Ema,
    /// Delivery-complete acknowledgements the local path owes (`local.rs`).
    local_receipts: VecDeque<(RawAddr, u32)>,
    /// Peers' RMA served since the last [`Engine::take_target_counts`].
    target_counts: TargetCounts,
    /// The application counts peers' writes / reads of its memory
    /// ([`Engine::set_remote_events`]).
    remote_events: (bool, bool),
}

impl Engine {
    /// An engine for the endpoint whose queue pair has raw address `local`.
    pub fn new(cfg: EngineConfig, local: RawAddr, _now: Instant) -> Engine {
        let rng = Rng::new(cfg.seed ^ 0x5eed_e761_9e00_0000);
        let (max_tx, max_rx) = (cfg.max_tx_ops, cfg.max_rx_ops);
        Engine {
            cfg,
            local,
            rng,
            closed: false,
            peers: peer::Peers::default(),
            tx: tx::TxSide::new(2 * max_tx),
            rx: rx::RxSide::new((2 * max_rx).max(4096)),
            budget: budget::Budget::new(EngineLimits::default()),
            out: Out::default(),
            memory: None,
            hdr: HeaderArena::default(),
            rd: read::ReadState::default(),
            wrs: VecDeque::new(),
            ema: rma::Ema::default(),
            local_receipts: VecDeque::new(),
            target_counts: TargetCounts::default(),
            remote_events: (false, false),
        }
    }

    /// The engine's interface for the same-host path.
    #[inline]
    pub fn same_host(&mut self) -> SameHost<'_> {
        SameHost(self)
    }

    /// The endpoint's own address.
    pub fn local_addr(&self) -> RawAddr {
        self.local
    }

    /// Replaces the memory bounds (an addition to the declared API).
    pub fn set_limits(&mut self, limits: EngineLimits) {
        self.budget.limits = limits;
    }

    /// The memory bounds in force.
    pub fn limits(&self) -> EngineLimits {
        self.budget.limits
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Starts a send. `Again` (with the operation handed back) when `max_tx_ops` are in flight
    /// or the peer is in RNR backoff; `MsgSize` never (any size is allowed).
    pub fn send(&mut self, now: Instant, op: SendOp) -> Result<(), (Error, SendOp)> {
        if self.closed {
            return Err((Engine::closed_error("send"), op));
        }
        let mut p = self.parts();
        let (rd, ema) = (&*p.rd, &*p.ema);
        let taken = |id| rd.owns_id(id) || ema.owns_send_id(id);
        p.tx.send(now, op, taken, &mut p.cx)
    }

    /// Posts a receive: matched at once against unexpected messages, else queued. `Again` (with
    /// the operation handed back) when `max_rx_ops` are posted.
    pub fn post_recv(&mut self, now: Instant, op: RecvOp) -> Result<(), (Error, RecvOp)> {
        if self.closed {
            return Err((Engine::closed_error("recv"), op));
        }
        // Only a receive that matched at once needs the handlers' context.
        let posting = self.rx.post(op, self.cfg.max_rx_ops, &mut self.out)?;
        if !matches!(posting, recv::Posting::Done) {
            let mut p = self.parts();
            p.rx.posted(now, posting, &mut p.cx);
        }
        Ok(())
    }

    /// Cancels the oldest posted receive with `context` that has not started matching; it
    /// completes with `Canceled`. Returns false when there is none.
    pub fn cancel_recv(&mut self, context: u64) -> bool {
        !self.closed && self.rx.cancel(context, &mut self.out)
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
        let mut p = self.parts();
        p.rx.recv_claimed(now, claim, op, &mut p.cx)
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
            let mut p = self.parts();
            p.rx.start_matched(last, rid, rx::Sink::discard(), None, &mut p.cx);
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
        self.memory = Some(mem);
    }

    /// Starts an RMA or atomic operation; `Again` when `max_tx_ops` operations are in flight.
    pub fn rma(&mut self, now: Instant, op: RmaOp) -> Result<(), (Error, RmaOp)> {
        if self.closed {
            return Err((Engine::closed_error("rma"), op));
        }
        // Device RDMA (and LONGREAD_RTW) first; the op comes back when it must be emulated.
        let mut p = self.parts();
        let ema = &*p.ema;
        let taken = |id| ema.owns_send_id(id);
        match p.rd.try_device(now, op, p.tx, taken, &mut p.cx)? {
            None => Ok(()),
            Some(op) => {
                let mut p = self.parts();
                p.ema.start(op, p.tx, p.rd, p.rx, &mut p.cx)
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
        let mut p = self.parts();
        let Some(pid) = p.rd.completed(now, wr_id, status, buf, p.rx, &mut p.cx) else {
            return;
        };
        if peer::peer_fatal(status) && self.peers.contains_key(&pid) {
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
                self.out.stats.dropped_pkts += 1;
                tracing::debug!(error = %e, len = data.len(), "dropped an undecodable packet");
                return;
            }
        };
        let Some(pid) = self.identify(now, src, &pkt) else {
            return;
        };
        let mut p = self.parts();
        match pkt {
            Packet::EagerRtm { .. }
            | Packet::MediumRtm { .. }
            | Packet::LongCtsRtm { .. }
            | Packet::LongReadRtm { .. }
            | Packet::RuntReadRtm { .. } => {
                let ema = &*p.ema;
                let taken = |id| ema.owns_recv_id(id);
                if p.rx.handle_rtm(now, pid, &pkt, payload, taken, &mut p.cx) {
                    p.ema.drain(now, pid, p.rx, &mut p.cx);
                }
            }
            Packet::LongReadRtw { .. } | Packet::Eor { .. } | Packet::ReadNack { .. } => {
                if let Some(op) = p.rd.handle_pkt(pid, &pkt, p.tx, &mut p.cx) {
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
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                read_req: true,
                ..
            } => p
                .ema
                .cts_read(now, pid, send_id, recv_id, recv_length, &mut p.cx),
            // The id says whose it is (one id space: `TxSide::alloc_id`).
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                ..
            } if p.ema.owns_send_id(send_id) => {
                p.ema
                    .cts_write(now, pid, send_id, recv_id, recv_length, &mut p.cx)
            }
            Packet::Cts {
                send_id,
                recv_id,
                recv_length,
                ..
            } => {
                p.tx.handle_cts(pid, send_id, recv_id, recv_length, &mut p.cx)
            }
            Packet::CtsData {
                recv_id,
                seg_offset,
                ..
            } if p.ema.owns_recv_id(recv_id) => p
                .ema
                .ctsdata(now, pid, recv_id, seg_offset, payload, &mut p.cx),
            Packet::CtsData {
                recv_id,
                seg_offset,
                ..
            } => {
                p.rx.handle_ctsdata(now, pid, recv_id, seg_offset, payload, &mut p.cx)
            }
            Packet::LongCtsRtw { .. }
            | Packet::LongCtsRtr { .. }
            | Packet::EagerRtw { .. }
            | Packet::ShortRtr { .. }
            | Packet::Rta { .. } => p.ema.request(now, pid, &pkt, payload, p.rx, &mut p.cx),
            Packet::Receipt { send_id, .. } if p.ema.owns_send_id(send_id) => {
                p.ema.receipt(pid, send_id, p.cx.out)
            }
            Packet::Receipt {
                send_id, msg_id, ..
            } => p.tx.handle_receipt(pid, send_id, msg_id, &mut p.cx),
            Packet::ReadRsp {
                recv_id, send_id, ..
            } => p.ema.readrsp(pid, recv_id, send_id, payload, &mut p.cx),
            Packet::AtomRsp { recv_id, .. } => p.ema.atomrsp(pid, recv_id, payload, p.cx.out),
            Packet::PeerError {
                op_id,
                ref_kind: wire::peer_error_ref::OPE_INDEX,
                prov_errno,
                ..
            } => p.ema.peer_error(pid, op_id, prov_errno, p.cx.out),
            // Exhaustive: a new packet type does not compile until it has its arm here.
            Packet::PeerError { .. } => p.cx.out.drop_pkt_type(&pkt),
        }
        // Every packet from a peer makes sure our HANDSHAKE goes to it (once).
        if self.peers.contains_key(&pid) {
            self.queue_handshake(pid);
        }
    }

    /// The device completed the packet `wr_id` handed out by [`Engine::poll_transmit`].
    pub fn handle_send_completion(&mut self, now: Instant, wr_id: u64, status: Status) {
        if self.closed {
            return;
        }
        let mut p = self.parts();
        match p.tx.completed(now, wr_id, status, &mut p.cx) {
            tx::Then::Nothing => {}
            tx::Then::Ema(owner, s) => self.ema.pkt_done(&owner, s, &mut self.out),
            tx::Then::FailPeer(pid, s) => {
                self.fail_peer(pid, s.error_kind(), Some(s), "send failed")
            }
            tx::Then::ReadReqFailed(id, s) => self.rd.req_failed(id, s, &mut self.out),
        }
    }

    /// Runs due timers (RNR backoff, stalled receives).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.closed {
            return;
        }
        let mut p = self.parts();
        let (cx, due) = (&mut p.cx, |cx: &Cx<'_>, t| cx.out.timers.expired(t, now));
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
        if self.closed || self.wrs_outstanding() >= self.cfg.max_outstanding_tx {
            return None;
        }
        if self.peers.in_backoff() {
            self.peers.expire_backoffs(now, &mut self.out.timers);
        }
        let (tx, peers, hdr) = (&mut self.tx, &mut self.peers, &mut self.hdr);
        let ema = |o: &_, a, b| self.ema.payload(o, a, b);
        if self.wrs.is_empty() {
            return tx.next_packet(peers, hdr, ema);
        }
        // Packets and RDMA work requests take turns (the device's send queue holds both).
        let wrs = &mut self.wrs;
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
        self.peers.has_ready() || self.peers.in_backoff() || !self.wrs.is_empty()
    }

    /// Messages and bytes held without a receive now (what [`Engine::resources`] reports as
    /// `buffered_msgs` and `buffered_bytes`, without its walk over the peers).
    pub fn buffered(&self) -> (usize, usize) {
        self.budget.held()
    }

    /// The next change of which peers the device should hold back: `(peer, true)` when a peer
    /// holds more than its share of the buffering budget (half of
    /// [`EngineLimits::max_buffered_msgs`] or of [`EngineLimits::max_buffered_bytes`]) in
    /// messages no receive has taken, `(peer, false)` once it is under a quarter again (or gone).
    /// The caller asks the device to refuse the held peer's new messages with receiver-not-ready
    /// ([`QueuePair::hold_source`](crate::device::QueuePair::hold_source)), so one flooding peer
    /// cannot use up the budget that holds every peer back (issue 17, defect 2).
    pub fn poll_hold(&mut self) -> Option<(RawAddr, bool)> {
        self.budget.poll_change()
    }

    /// True when messages wait without a receive (unexpected or claimed).
    pub fn has_unexpected(&self) -> bool {
        self.budget.unexpected().0 > 0
    }

    /// True when [`Engine::poll_event`] has a completion.
    pub fn has_events(&self) -> bool {
        !self.out.events.is_empty()
    }

    /// [`MAX_REMOTE_WRITE_EVENTS`] completions of peers' writes with immediate data wait for
    /// the application: the caller should hold the device back (stop reposting receive buffers).
    pub fn remote_writes_full(&self) -> bool {
        self.out.remote_write_events >= MAX_REMOTE_WRITE_EVENTS
    }

    /// The next completion.
    pub fn poll_event(&mut self) -> Option<Event> {
        let ev = self.out.events.pop_front();
        if matches!(ev, Some(Event::RemoteWrite(_))) {
            self.out.remote_write_events = self.out.remote_write_events.saturating_sub(1);
        }
        ev
    }

    /// When [`Engine::handle_timeout`] should run next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.closed {
            return None;
        }
        self.out.timers.next()
    }

    /// Closes: every operation still in flight completes with `Canceled` (collect them with
    /// [`Engine::poll_event`]); later calls are refused with `Closed`.
    pub fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        // Receives first (pieces of multi-receive buffers before the buffers themselves).
        let mut p = self.parts();
        p.rx.close(&mut p.cx);
        p.tx.close(&mut p.cx);
        p.rd.close(&mut p.cx);
        let e = Engine::closed_error("rma").with_detail("endpoint closed");
        p.ema.fail(None, &e, None, p.cx.out);
        p.cx.peers
            .close(p.cx.cfg.recvwin_size, &mut p.cx.out.timers);
        p.cx.budget.reset();
    }

    /// What the engine holds now.
    pub fn resources(&self) -> Resources {
        Resources {
            tx_ops: self.tx.ops.len() + self.rd.ops_len() + self.ema.ops_len(),
            rx_ops: self.rx.user_ops,
            unexpected_msgs: self.budget.unexpected().0,
            unexpected_bytes: self.budget.unexpected().1,
            reorder_held: self.peers.values().map(|p| p.robuf.held()).sum(),
            buffered_msgs: self.budget.held().0,
            buffered_bytes: self.budget.held().1,
            queued_pkts: self.peers.queued() + self.wrs.len(),
            outstanding_pkts: self.wrs_outstanding(),
            peers: self.peers.len(),
            target_ops: self.ema.target_ops() + self.rd.targets(),
            remote_write_events: self.out.remote_write_events,
        }
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        self.out.stats
    }

    /// The application counts peers' writes (`writes`) or reads (`reads`) of this side's
    /// memory (`FI_REMOTE_WRITE` / `FI_REMOTE_READ` counters). A NIC serves one-sided RDMA
    /// without telling its target, so the HANDSHAKE then leaves out device RDMA write (read):
    /// peers, this crate's and libfabric's alike, emulate those operations with packets, and
    /// this side sees each one land ([`Engine::take_target_counts`]). Set it before the first
    /// HANDSHAKE goes out.
    pub fn set_remote_events(&mut self, writes: bool, reads: bool) {
        self.remote_events = (writes, reads);
    }

    /// Takes the count of peers' RMA this side served since the last call.
    pub fn take_target_counts(&mut self) -> TargetCounts {
        std::mem::take(&mut self.target_counts)
    }

    /// Counts a packet the caller dropped before it reached [`Engine::handle_recv`] (the device
    /// could not say where it came from).
    pub fn count_dropped(&mut self, why: &'static str) {
        self.drop_pkt(why);
    }

    fn drop_pkt(&mut self, why: &'static str) {
        self.out.drop_pkt(why);
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
        let pid = match self.peers.identify(src, pkt, &mut self.out) {
            peer::Who::Peer(id) => id,
            peer::Who::Nobody => return None,
            peer::Who::New(addr) => {
                let max = self.budget.limits.max_peers;
                for (id, qkey) in self.peers.replaced_by(addr, now, self.cfg.rx_stall_timeout) {
                    self.fail_peer(id, ErrorKind::ConnectionAborted, None, "peer restarted");
                    self.peers.retire(addr.gid, addr.qpn, qkey, max);
                }
                self.peers
                    .new_peer(addr, max, self.cfg.recvwin_size, &mut self.out)?
            }
        };
        if let Some(p) = self.peers.get_mut(&pid) {
            p.last_heard = Some(now);
        }
        Some(pid)
    }

    /// Queues our HANDSHAKE to `pid` unless it went already.
    fn queue_handshake(&mut self, pid: u64) {
        if !self.peers.handshake_due(pid) {
            return;
        }
        let hs = peer::handshake(
            &self.cfg,
            self.local,
            self.remote_events,
            self.rd.unsolicited(),
        );
        if let Some(hdr) = util::encode(&Packet::Handshake(hs)) {
            self.peers.queue_handshake(pid, hdr);
        }
    }

    /// The peer's HANDSHAKE: held CTSDATA windows go out and RMA operations that waited for
    /// it choose their protocol.
    fn handle_handshake(&mut self, now: Instant, pid: u64, h: &wire::Handshake) {
        let Some((first, blocked)) = self.peers.handshake_arrived(pid, h) else {
            return;
        };
        let mut p = self.parts();
        for id in blocked {
            p.tx.schedule_ctsdata(id, &mut p.cx);
        }
        p.ema.handshake(now, pid, &mut p.cx);
        if first {
            loop {
                let mut p = self.parts();
                let ema = &*p.ema;
                let taken = |id| ema.owns_send_id(id);
                let Some(op) = p.rd.next_after_handshake(pid, p.tx, taken, &mut p.cx) else {
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
        let Some(p) = self.peers.remove(&pid) else {
            return;
        };
        tracing::debug!(peer = %p.addr, ?kind, ?status, why, "peer failed");
        if p.held_back {
            self.budget.hold_change(p.addr, false);
        }
        let g = types::Gone { kind, status, why };
        let Parts {
            tx,
            rx,
            rd,
            ema,
            mut cx,
        } = self.parts();
        rx.peer_gone(&p, g, &mut cx);
        tx.peer_failed(pid, g, &mut cx);
        rd.peer_failed(pid, g, &mut cx);
        ema.fail(Some(pid), &g.error("rma"), status, cx.out);
    }

    /// Starts `op` with the emulation; a refused one completes with its error.
    fn emulate(&mut self, op: RmaOp) {
        let mut p = self.parts();
        if let Err((e, op)) = p.ema.start(op, p.tx, p.rd, p.rx, &mut p.cx) {
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
            cx: Cx {
                cfg: &self.cfg,
                local: self.local,
                remote_events: self.remote_events,
                memory: self.memory.as_deref(),
                peers: &mut self.peers,
                budget: &mut self.budget,
                wrs: &mut self.wrs,
                out: &mut self.out,
                rng: &mut self.rng,
                counts: &mut self.target_counts,
                receipts: &mut self.local_receipts,
            },
        }
    }
}

/// The engine's sub-states and the context their handlers take ([`Engine::parts`]).
struct Parts<'a> {
    tx: &'a mut tx::TxSide,
    rx: &'a mut rx::RxSide,
    rd: &'a mut read::ReadState,
    ema: &'a mut rma::Ema,
    cx: Cx<'a>,
}
