//! A udp queue pair's protocol side, without a socket: it takes received datagrams, posts and
//! the time, and gives back completions and the datagrams to send ([`Outbox`]). `qp.rs` drives
//! it with a socket and a thread; the simulator (`sim.rs`, tests) drives it with a virtual
//! network and virtual time. Nothing here reads a clock or touches a socket.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::srd::Srd;
use super::wire::{self, Packet};
use super::{UdpConfig, sockaddr_for};
use crate::addr::{Gid, RawAddr};
use crate::device::queues::{Completions, flush_recvs};
use crate::device::soft_rdma::{self as rdma, KeyTable, Rdma, RdmaHost, RdmaOps, Served, Src};
use crate::device::{DeviceCompletion, Opcode, QpType, SendWr, Source, Status};
use crate::error::Result;
use crate::fault::{FaultConfig, FaultInjector};
use crate::mem::RegionSlice;
use crate::stats::{self, DeviceCounters};

/// User bytes up to this size are copied behind the device header into the outbox; larger ones
/// stay where they are, for the kernel to gather them (`sendmsg`) without a copy here.
pub(super) const GATHER_MIN: usize = 2048;
/// How long a datagram held back for reordering waits for a later one, when `max_delay` is zero.
const DEFAULT_REORDER_HOLD: Duration = Duration::from_millis(1);

/// Whom a datagram belongs to, so that a permanent failure the kernel reports when the datagram
/// goes out reaches the right work request ([`Link::send_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tag {
    /// Acknowledgements, NAKs and other datagrams no work request waits for.
    None,
    /// The UD send with this work request id.
    Ud(u64),
    /// The SRD packet `seq` towards connection `conn`.
    Srd { conn: u32, seq: u64 },
}

/// What follows a datagram's device header: the user's two segments, and region bytes read at
/// transmission (an RDMA write from a registered region).
#[derive(Clone, Copy)]
pub(super) struct Parts<'a> {
    pub hdr: &'a Bytes,
    pub payload: &'a Bytes,
    pub region: Option<&'a RegionSlice>,
}

static EMPTY: Bytes = Bytes::new();

impl Parts<'_> {
    /// Nothing after the device header.
    pub const NONE: Parts<'static> = Parts {
        hdr: &EMPTY,
        payload: &EMPTY,
        region: None,
    };

    fn len(&self) -> usize {
        self.hdr.len() + self.payload.len() + self.region.map_or(0, |r| r.len)
    }

    /// Appends every part to `out`; false, with `out` as it was, when the region is locked
    /// for writing right now (the datagram is then lost on the wire, and SRD sends it again).
    fn copy_to(&self, out: &mut Vec<u8>) -> bool {
        let guard = match self.region {
            Some(r) => match r.try_read() {
                Some(g) => Some(g),
                None => return false,
            },
            None => None,
        };
        out.extend_from_slice(self.hdr);
        out.extend_from_slice(self.payload);
        if let Some(g) = &guard {
            out.extend_from_slice(g);
        }
        true
    }
}

/// One datagram to send: its device header (and, when small, everything) in the outbox's
/// arena, then the user's segments and region bytes, sent from where they are (the region's
/// under its read lock, taken when the datagram goes out). A packed datagram (several SRD
/// packets to one queue pair) is all in the arena.
pub(super) struct Queued {
    pub dest: SocketAddr,
    pub head: Range<usize>,
    pub hdr: Bytes,
    pub payload: Bytes,
    pub region: Option<RegionSlice>,
    /// Whose packets the datagram carries ([`Outbox::tags`]).
    tags: Range<usize>,
    /// The destination QKEY while later small packets to the same queue pair may join this
    /// datagram (the peer unpacks); `None` for a datagram that stays as it is.
    pack: Option<u32>,
    /// Packets packed in this datagram (0: a plain datagram).
    packed: usize,
}

impl Queued {
    /// The datagram's length on the wire.
    pub fn len(&self) -> usize {
        self.head.len()
            + self.hdr.len()
            + self.payload.len()
            + self.region.as_ref().map_or(0, |r| r.len)
    }
}

/// Fault-injection state: the seeded injector and the datagrams it holds back.
pub(super) struct Faults {
    inj: FaultInjector,
    hold: Duration,
    held: Vec<(SocketAddr, Vec<u8>, Instant)>,
    delayed: Vec<(Instant, SocketAddr, Vec<u8>)>,
}

impl Faults {
    /// The fault layer of `cfg`, or `None` when it injects nothing.
    pub fn new(cfg: &FaultConfig) -> Option<Faults> {
        (!cfg.is_none()).then(|| Faults {
            inj: FaultInjector::new(cfg.clone()),
            hold: if cfg.max_delay.is_zero() {
                DEFAULT_REORDER_HOLD
            } else {
                cfg.max_delay
            },
            held: Vec::new(),
            delayed: Vec::new(),
        })
    }
}

/// The datagrams a step produced, in order, and the fault layer they pass first. The driver
/// sends them ([`Outbox::queued`], [`Outbox::head`]) and empties it ([`Outbox::clear`]).
pub(super) struct Outbox {
    /// Scratch buffer the device header of the next datagram is encoded into.
    pub tx: Vec<u8>,
    pub faults: Option<Faults>,
    pub counters: Arc<DeviceCounters>,
    arena: Vec<u8>,
    queued: Vec<Queued>,
    /// The packets of the queued datagrams, each datagram's a range ([`Queued::tags`]).
    tags: Vec<Tag>,
    /// The queue pair's own QKEY (the source QKEY of a packed datagram).
    qkey: u32,
    /// Largest packed datagram, bytes (the MTU).
    pack_limit: usize,
}

impl Outbox {
    pub fn new(
        mtu: usize,
        qkey: u32,
        faults: Option<Faults>,
        counters: Arc<DeviceCounters>,
    ) -> Outbox {
        Outbox {
            tx: Vec::with_capacity(mtu + wire::MAX_OVERHEAD),
            faults,
            counters,
            arena: Vec::new(),
            queued: Vec::new(),
            tags: Vec::new(),
            qkey,
            pack_limit: mtu,
        }
    }

    /// Queues the datagram in `self.tx` for `dest`, through the fault layer.
    pub fn emit(&mut self, dest: SocketAddr, now: Instant) {
        self.emit_parts(dest, now, Parts::NONE, Tag::None, None)
    }

    /// Queues the datagram `self.tx` + `parts` for `dest`, through the fault layer;
    /// a permanent failure when it goes out is reported with `tag`. `pack`: the destination
    /// QKEY, when the peer unpacks: a small datagram then joins the last queued one to the same
    /// queue pair as long as their packed datagram fits in the MTU (RFC 9000 §12.2 coalesces
    /// QUIC packets so), and later ones may join it.
    pub fn emit_parts(
        &mut self,
        dest: SocketAddr,
        now: Instant,
        parts: Parts<'_>,
        tag: Tag,
        pack: Option<u32>,
    ) {
        let Some(f) = self.faults.as_mut() else {
            return self.out(dest, parts, tag, pack);
        };
        let fate = f.inj.next_fate();
        if fate.drop {
            stats::inc(&self.counters.faults_dropped);
            return;
        }
        let copies = if fate.duplicate {
            stats::inc(&self.counters.faults_duplicated);
            2
        } else {
            1
        };
        let tx = &self.tx;
        let whole = || {
            let mut w = tx.clone();
            parts.copy_to(&mut w).then_some(w)
        };
        if fate.reorder {
            stats::inc(&self.counters.faults_reordered);
            for _ in 0..copies {
                if let Some(w) = whole() {
                    f.held.push((dest, w, now + f.hold));
                }
            }
            return;
        }
        if !fate.delay.is_zero() {
            stats::inc(&self.counters.faults_reordered);
            for _ in 0..copies {
                if let Some(w) = whole() {
                    f.delayed.push((now + fate.delay, dest, w));
                }
            }
            return;
        }
        let held = std::mem::take(&mut f.held);
        self.out(dest, parts, tag, pack);
        if copies > 1 {
            self.out(dest, parts, Tag::None, pack);
        }
        // Held-back datagrams go out after this later one: that is the reordering.
        for (d, b, _) in held {
            self.out_owned(d, &b);
        }
    }

    /// Queues the datagram `self.tx` + `parts`, packed into the last queued one if `pack`
    /// allows (see [`Outbox::emit_parts`]). Small ones are copied into the arena (region bytes
    /// under the region's read lock: a region locked for writing right now makes the datagram
    /// a loss on the wire, which SRD repairs).
    fn out(&mut self, dest: SocketAddr, parts: Parts<'_>, tag: Tag, pack: Option<u32>) {
        let small = parts.len() <= GATHER_MIN;
        if small && pack.is_some() && self.join_last(dest, parts, tag, pack) {
            return;
        }
        let start = self.arena.len();
        self.arena.extend_from_slice(&self.tx);
        let (hdr, payload, region) = if small {
            if !parts.copy_to(&mut self.arena) {
                self.arena.truncate(start);
                tracing::trace!(%dest, "udp: region locked, datagram left for a retransmission");
                return;
            }
            (Bytes::new(), Bytes::new(), None)
        } else {
            (
                parts.hdr.clone(),
                parts.payload.clone(),
                parts.region.cloned(),
            )
        };
        self.tags.push(tag);
        stats::inc(&self.counters.tx_datagrams);
        self.queued.push(Queued {
            dest,
            head: start..self.arena.len(),
            hdr,
            payload,
            region,
            tags: self.tags.len() - 1..self.tags.len(),
            pack: pack.filter(|_| small),
            packed: 0,
        });
    }

    /// Packs the datagram `self.tx` + `hdr` + `payload` (small) into the last queued datagram,
    /// when that one goes to the same queue pair, may take more and has room; false otherwise.
    fn join_last(
        &mut self,
        dest: SocketAddr,
        parts: Parts<'_>,
        tag: Tag,
        pack: Option<u32>,
    ) -> bool {
        let len = self.tx.len() + parts.len();
        let Some(last) = self.queued.last_mut() else {
            return false;
        };
        if last.pack != pack || last.dest != dest || last.head.end != self.arena.len() {
            return false;
        }
        let wrap = if last.packed == 0 {
            wire::PACKED_LEN + wire::PACKED_ENTRY
        } else {
            0
        };
        if last.head.len() + wrap + wire::PACKED_ENTRY + len > self.pack_limit {
            // Full: the next packets start a datagram of their own.
            last.pack = None;
            return false;
        }
        let end = self.arena.len();
        wire::push_packed_entry(&mut self.arena, len);
        self.arena.extend_from_slice(&self.tx);
        if !parts.copy_to(&mut self.arena) {
            // The region is locked for writing: this packet is lost on the wire (SRD repairs).
            self.arena.truncate(end);
            return true;
        }
        if last.packed == 0 {
            // The last datagram becomes the first entry of a packed one.
            let mut front = Vec::with_capacity(wrap);
            wire::encode_packed_header(&mut front, pack.unwrap_or_default(), self.qkey, false);
            wire::push_packed_entry(&mut front, last.head.len());
            let at = last.head.start;
            self.arena.splice(at..at, front);
            last.head.end += wrap;
            last.packed = 1;
            stats::inc(&self.counters.tx_packed);
        }
        last.head.end = self.arena.len();
        last.packed += 1;
        self.tags.push(tag);
        last.tags.end = self.tags.len();
        stats::inc(&self.counters.tx_packed);
        true
    }

    /// [`Outbox::out`] for a datagram the fault layer built in one piece.
    fn out_owned(&mut self, dest: SocketAddr, whole: &[u8]) {
        let start = self.arena.len();
        self.arena.extend_from_slice(whole);
        self.tags.push(Tag::None);
        stats::inc(&self.counters.tx_datagrams);
        self.queued.push(Queued {
            dest,
            head: start..self.arena.len(),
            hdr: Bytes::new(),
            payload: Bytes::new(),
            region: None,
            tags: self.tags.len() - 1..self.tags.len(),
            pack: None,
            packed: 0,
        });
    }

    /// The datagrams to send, oldest first.
    pub fn queued(&self) -> &[Queued] {
        &self.queued
    }

    /// Whose packets datagram `q` carries: one tag, or one per packet of a packed datagram. A
    /// permanent failure of the datagram fails each of them.
    pub fn tags(&self, q: &Queued) -> &[Tag] {
        self.tags.get(q.tags.clone()).unwrap_or_default()
    }

    /// The first part of datagram `q` (all of it when its user bytes were small).
    pub fn head(&self, q: &Queued) -> &[u8] {
        self.arena.get(q.head.clone()).unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Forgets the queued datagrams (they were sent).
    pub fn clear(&mut self) {
        self.queued.clear();
        self.arena.clear();
        self.tags.clear();
    }

    /// Queues held-back and delayed datagrams whose time has come.
    fn run_timers(&mut self, now: Instant) {
        let Some(f) = self.faults.as_mut() else {
            return;
        };
        let mut due = Vec::new();
        if f.held.iter().any(|h| h.2 <= now) {
            due.extend(f.held.drain(..).map(|(d, b, _)| (d, b)));
        }
        let mut i = 0;
        while i < f.delayed.len() {
            if f.delayed.get(i).is_some_and(|d| d.0 <= now) {
                let (_, d, b) = f.delayed.swap_remove(i);
                due.push((d, b));
            } else {
                i += 1;
            }
        }
        for (d, b) in due {
            self.out_owned(d, &b);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let f = self.faults.as_ref()?;
        let held = f.held.iter().map(|h| h.2).min();
        let delayed = f.delayed.iter().map(|d| d.0).min();
        min_opt(held, delayed)
    }
}

pub(super) fn min_opt(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// What happened to a datagram offered to the receive queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Delivery {
    /// Copied into a posted buffer.
    Ok,
    /// No buffer posted.
    NoBuffer,
    /// The buffer at the head was too short; it completed with `LocalBadLength`.
    BadLength,
    /// An RDMA access refused: bad key, range or right (`rdma.rs`).
    Denied,
    /// An RDMA access refused: no address handle for the initiator (an emulated EFA NIC).
    NoAh,
}

/// The parts of a queue pair's state both modes use.
pub(super) struct Ctx {
    pub out: Outbox,
    /// The socket is IPv6 (IPv4 destinations are sent as IPv4-mapped addresses).
    pub v6: bool,
    pub cfg: Arc<UdpConfig>,
    pub qkey: u32,
    pub rnr_retry: u8,
    pub cq: Completions,
    pub recvs: VecDeque<(u64, BytesMut)>,
    /// One-sided RDMA (`rdma.rs`).
    pub rdma: Rdma,
    /// Senders held back ([`QueuePair::hold_source`](crate::device::QueuePair::hold_source)):
    /// their new messages get RNR.
    pub held: Vec<Source>,
}

impl RdmaHost for Ctx {
    fn rdma(&mut self) -> &mut Rdma {
        &mut self.rdma
    }
    fn complete(&mut self, c: DeviceCompletion) {
        Ctx::complete(self, c)
    }
    fn recvs(&mut self) -> &mut VecDeque<(u64, BytesMut)> {
        &mut self.recvs
    }
    fn counters(&self) -> &DeviceCounters {
        &self.out.counters
    }
    fn mtu(&self) -> usize {
        self.cfg.mtu
    }
}

impl Ctx {
    pub fn counters(&self) -> &DeviceCounters {
        &self.out.counters
    }

    /// Queues a completion.
    pub fn complete(&mut self, c: DeviceCompletion) {
        self.cq.push(c);
    }

    /// Queues a send completion.
    pub fn complete_send(&mut self, wr_id: u64, status: Status, byte_len: usize) {
        if wr_id & rdma::INTERNAL != 0 {
            return self.rdma_send_done(wr_id, status);
        }
        if !status.is_ok() && status != Status::Flushed {
            stats::inc(&self.out.counters.send_errors);
        }
        self.complete(DeviceCompletion::new(wr_id, status, Opcode::Send, byte_len));
    }

    /// A UD send completed `Success` when it was queued, and the kernel refused it for good
    /// when it went out: its completion (still queued, as the driver sends before it lets go
    /// of the queue pair) becomes `UnreachableRemote`.
    fn fail_sent_ud(&mut self, wr_id: u64) {
        let c = self
            .cq
            .iter_mut()
            .rev()
            .find(|c| c.wr_id == wr_id && c.opcode == Opcode::Send && c.status.is_ok());
        if let Some(c) = c {
            c.status = Status::UnreachableRemote;
            c.byte_len = 0;
            stats::inc(&self.out.counters.send_errors);
        }
    }

    /// An RDMA message from the SRD path (`soft_rdma`).
    pub fn deliver_rdma_udp(
        &mut self,
        src: SocketAddr,
        src_qkey: u32,
        imm: Option<u32>,
        data: &[u8],
    ) -> Delivery {
        match self.deliver_rdma(Src::udp(src), src_qkey, imm, data) {
            Served::Ok => Delivery::Ok,
            Served::NotReady => Delivery::NoBuffer,
            Served::Denied => Delivery::Denied,
            Served::NoAh => Delivery::NoAh,
        }
    }

    /// Offers a received datagram to the head of the receive queue.
    pub fn deliver(&mut self, src: SocketAddr, imm: Option<u32>, data: &[u8]) -> Delivery {
        if !self.held.is_empty() {
            let from = Source {
                gid: Gid::from_ip(src.ip()),
                qpn: src.port(),
            };
            if self.held.contains(&from) {
                return Delivery::NoBuffer;
            }
        }
        let Some((wr_id, mut buf)) = self.recvs.pop_front() else {
            return Delivery::NoBuffer;
        };
        let status = crate::device::queues::fill_recv(&mut buf, data);
        let res = if status == Status::Success {
            stats::inc(&self.out.counters.rx_pkts);
            stats::add(&self.out.counters.rx_bytes, data.len() as u64);
            Delivery::Ok
        } else {
            Delivery::BadLength
        };
        self.complete(DeviceCompletion {
            wr_id,
            status,
            opcode: Opcode::Recv,
            byte_len: data.len(),
            src: Some(Source {
                gid: Gid::from_ip(src.ip()),
                qpn: src.port(),
            }),
            imm,
            buf: Some(buf),
        });
        res
    }
}

/// What a link is built from (the queue pair's attributes the protocol reads).
pub(super) struct LinkAttr {
    pub qp_type: QpType,
    pub qkey: u32,
    pub rnr_retry: u8,
    /// The socket is IPv6.
    pub v6: bool,
    /// Remote keys of the device's registered memory, if it does RDMA.
    pub keys: Option<KeyTable>,
    /// RDMA writes with immediate data complete without a posted receive.
    pub unsolicited_write_recv: bool,
}

/// A queue pair's protocol state: the UD and SRD rules, one-sided RDMA, the receive and
/// completion queues, and the outgoing datagrams.
pub(super) struct Link {
    pub ctx: Ctx,
    pub srd: Srd,
    pub qp_type: QpType,
    /// Tests: this queue pair speaks the wire from before packed datagrams (it drops them as
    /// an unknown type; give it `UdpConfig::pack` off too, so that it never asks).
    #[cfg(test)]
    pub old_wire: bool,
}

impl Link {
    pub fn new(
        cfg: Arc<UdpConfig>,
        counters: Arc<DeviceCounters>,
        attr: LinkAttr,
        now: Instant,
    ) -> Link {
        let faults = Faults::new(&cfg.faults);
        Link {
            srd: Srd::new(now, &cfg),
            ctx: Ctx {
                out: Outbox::new(cfg.mtu, attr.qkey, faults, counters),
                v6: attr.v6,
                cfg,
                qkey: attr.qkey,
                rnr_retry: attr.rnr_retry,
                cq: Completions::default(),
                recvs: VecDeque::new(),
                held: Vec::new(),
                rdma: Rdma::new(attr.keys, attr.unsolicited_write_recv),
            },
            qp_type: attr.qp_type,
            #[cfg(test)]
            old_wire: false,
        }
    }

    fn is_srd(&self) -> bool {
        self.qp_type == QpType::Srd
    }

    /// The queue pair's QKEY changes (`modify_qp`): what it accepts and the source QKEY of
    /// everything it sends, packed datagrams' headers included.
    #[cfg(any(test, feature = "emu-hooks"))]
    pub fn set_qkey(&mut self, qkey: u32) {
        self.ctx.qkey = qkey;
        self.ctx.out.qkey = qkey;
    }

    /// Handles one datagram from `src`.
    pub fn handle(&mut self, data: &[u8], src: SocketAddr, now: Instant) {
        stats::inc(&self.ctx.counters().rx_datagrams);
        #[cfg(test)]
        if self.old_wire && wire::is_packed(data) {
            stats::inc(&self.ctx.counters().malformed_dropped);
            return;
        }
        if wire::is_packed(data) {
            self.handle_packed(data, src, now);
        } else {
            self.handle_one(data, src, now);
        }
        self.flush_rdma(now);
    }

    /// Handles a packed datagram: checked whole first (a malformed one is dropped whole and
    /// counted once), then each SRD datagram in it as if it had come alone.
    fn handle_packed(&mut self, data: &[u8], src: SocketAddr, now: Instant) {
        let (dst_qkey, packed) = match wire::decode_packed(data) {
            Ok(x) => x,
            Err(why) => return self.drop_malformed(src, "packed", data.len(), why),
        };
        if !self.accepts(src, dst_qkey, self.is_srd(), "packed", data.len()) {
            return;
        }
        self.srd
            .unpacker(&mut self.ctx, src, packed.src_qkey, packed.hello, now);
        for d in packed.datagrams() {
            stats::inc(&self.ctx.counters().rx_packed);
            self.handle_one(d, src, now);
        }
    }

    /// Whether a decoded datagram (`what`: packed, SRD or UD) is for this queue pair: of its
    /// type (`type_ok`), else dropped as malformed; for its QKEY, else dropped as stale.
    #[inline]
    fn accepts(
        &self,
        src: SocketAddr,
        dst_qkey: u32,
        type_ok: bool,
        what: &'static str,
        len: usize,
    ) -> bool {
        if !type_ok {
            self.drop_malformed(src, what, len, "for the other queue pair type");
            return false;
        }
        if dst_qkey != self.ctx.qkey {
            stats::inc(&self.ctx.counters().stale_dropped);
            tracing::trace!(%src, what, dst_qkey, qkey = self.ctx.qkey, "udp: dropped a datagram with a stale QKEY");
            return false;
        }
        true
    }

    /// Counts and logs a dropped datagram (`what`: packed, single, SRD or UD) that does not
    /// decode, or does not suit this queue pair (`why`).
    #[cold]
    fn drop_malformed(&self, src: SocketAddr, what: &'static str, len: usize, why: &'static str) {
        stats::inc(&self.ctx.counters().malformed_dropped);
        tracing::debug!(%src, what, len, why, "udp: dropped a malformed datagram");
    }

    /// Handles one (not packed) datagram from `src`.
    fn handle_one(&mut self, data: &[u8], src: SocketAddr, now: Instant) {
        let (dst_qkey, pkt) = match wire::decode(data) {
            Ok(x) => x,
            Err(why) => return self.drop_malformed(src, "single", data.len(), why),
        };
        let ud = matches!(pkt, Packet::Ud { .. });
        let what = if ud { "UD" } else { "SRD" };
        if !self.accepts(src, dst_qkey, self.is_srd() != ud, what, data.len()) {
            return;
        }
        match pkt {
            Packet::Ud { imm, payload } => {
                if self.ctx.deliver(src, imm, payload) == Delivery::NoBuffer {
                    stats::inc(&self.ctx.counters().rnr_events);
                    tracing::trace!(%src, "udp: UD datagram dropped, no receive buffer");
                }
            }
            Packet::Data(h, payload) => self.srd.on_data(&mut self.ctx, src, &h, payload, now),
            Packet::DataAck(h, a, bitmap, payload) => {
                // Deliver first, so that what the acknowledgement releases carries the newest
                // acknowledgement back.
                self.srd.on_data(&mut self.ctx, src, &h, payload, now);
                self.srd.on_ack(&mut self.ctx, src, &a, bitmap, now);
            }
            Packet::Ack(a, bitmap) => self.srd.on_ack(&mut self.ctx, src, &a, bitmap, now),
            Packet::Nak(n) => self.srd.on_nak(&mut self.ctx, src, &n, now),
        }
    }

    /// Puts the RDMA messages the last step produced on the SRD path.
    fn flush_rdma(&mut self, now: Instant) {
        while !self.ctx.rdma.outbox.is_empty() {
            let batch = std::mem::take(&mut self.ctx.rdma.outbox);
            for (to, wr, region) in batch {
                let to = to.unwrap_or_else(|| sockaddr_for(&wr.dest.gid, wr.dest.qpn, self.ctx.v6));
                self.srd
                    .post_flagged(&mut self.ctx, to, wr, now, true, region);
            }
        }
    }

    /// Starts an RDMA write or read towards `dest` (the caller checked that this is an SRD
    /// queue pair with RDMA, and took its work-request slot).
    pub fn start_rdma(
        &mut self,
        now: Instant,
        start: impl FnOnce(&mut Ctx, Option<SocketAddr>, usize) -> Result<()>,
        dest: &RawAddr,
    ) -> Result<()> {
        let to = sockaddr_for(&dest.gid, dest.qpn, self.ctx.v6);
        let chunk = self.ctx.cfg.mtu.saturating_sub(rdma::HDR).max(1);
        start(&mut self.ctx, Some(to), chunk)?;
        self.flush_rdma(now);
        Ok(())
    }

    /// Sends `wr` (the caller checked its length against the MTU and took its slot).
    pub fn post_send(&mut self, wr: SendWr, now: Instant) {
        let dest = sockaddr_for(&wr.dest.gid, wr.dest.qpn, self.ctx.v6);
        if dest.is_ipv6() && !self.ctx.v6 {
            tracing::debug!(%dest, "udp: IPv6 destination on an IPv4 device");
            self.ctx
                .complete_send(wr.wr_id, Status::UnreachableRemote, 0);
            return;
        }
        match self.qp_type {
            QpType::Ud => {
                let len = wr.len();
                wire::encode_ud(&mut self.ctx.out.tx, wr.dest.qkey, wr.imm, &[], &[]);
                let tag = Tag::Ud(wr.wr_id);
                let parts = Parts {
                    hdr: &wr.hdr,
                    payload: &wr.payload,
                    region: None,
                };
                self.ctx.out.emit_parts(dest, now, parts, tag, None);
                stats::inc(&self.ctx.counters().tx_pkts);
                stats::add(&self.ctx.counters().tx_bytes, len as u64);
                self.ctx.complete_send(wr.wr_id, Status::Success, len);
            }
            QpType::Srd => self.srd.post(&mut self.ctx, dest, wr, now),
        }
    }

    /// A datagram the driver could not send, for good (not a transient loss): its work request
    /// fails with `UnreachableRemote`.
    pub fn send_failed(&mut self, tag: Tag, now: Instant) {
        match tag {
            Tag::None => {}
            Tag::Ud(wr_id) => self.ctx.fail_sent_ud(wr_id),
            Tag::Srd { conn, seq } => self.srd.send_failed(&mut self.ctx, conn, seq, now),
        }
    }

    /// Sends the acknowledgements that are due (with `all`, every pending one; see
    /// [`Srd::flush_acks`]).
    pub fn flush_acks(&mut self, now: Instant, all: bool) {
        if self.is_srd() {
            self.srd.flush_acks(&mut self.ctx, now, all);
        }
    }

    /// Runs the timers that are due at `now`.
    pub fn run_timers(&mut self, now: Instant) {
        self.ctx.out.run_timers(now);
        if self.is_srd() {
            self.srd.run_timers(&mut self.ctx, now);
            self.flush_rdma(now);
        }
    }

    /// When [`Link::run_timers`] is next due.
    pub fn next_deadline(&mut self) -> Option<Instant> {
        min_opt(self.ctx.out.next_deadline(), self.srd.next_deadline())
    }

    /// Completes every outstanding work request with `Flushed`.
    pub fn flush(&mut self, now: Instant) {
        let ctx = &mut self.ctx;
        let mut recvs = std::mem::take(&mut ctx.recvs);
        flush_recvs(&mut recvs, |c| ctx.complete(c));
        // Acknowledgements still held back (delayed, to ride on data) go now: a peer whose
        // last packet we received must not wait for an ack that never comes.
        self.flush_acks(now, true);
        self.srd.flush(&mut self.ctx);
        self.ctx.rdma_flush();
        if let Some(f) = self.ctx.out.faults.as_mut() {
            f.held.clear();
            f.delayed.clear();
        }
    }
}
