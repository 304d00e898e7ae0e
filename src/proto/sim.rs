//! A deterministic simulator for the protocol engine: several [`Engine`]s joined by a simulated
//! SRD network with a virtual clock (tests and benches; not a stable API).
//!
//! The network keeps the device contract: every datagram is delivered **exactly once**, in a
//! seeded random order. "Loss" is modelled as what SRD turns it into — a retransmission delay —
//! and "duplicates" are suppressed (counted only). Each node has a limited number of device
//! receive buffers, consumed by a delivery and re-posted after [`Engine::handle_recv`] returns
//! (optionally after a delay): a datagram that finds none is retried by the simulated device up
//! to `rnr_retry` times, then the sender's packet completes with [`Status::RnrRetryExceeded`].
//! A sender's completion comes when its datagram is delivered. A node can vanish (datagrams to it
//! complete with [`Status::UnresponsiveRemote`]) or restart with a new QKEY.
//!
//! Device RDMA ([`TransmitKind::RdmaWrite`] / [`TransmitKind::RdmaRead`]) is applied to the target
//! node's device memory ([`Sim::set_device_memory`]) without its engine doing anything, after the
//! same latency, jitter and "loss" delay as a datagram; a bad key or range completes with
//! [`Status::RemoteBadAddress`] and touches nothing; a write with immediate data also gives the
//! target a [`Engine::handle_remote_write`] (the device's `RecvRdmaWithImm` completion). A node can
//! be frozen ([`Sim::freeze`]): its engine is not polled and what is delivered to it waits, but
//! RDMA against its memory still completes.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use efa::proto::engine::{Event, RecvOp, SendOp};
//! use efa::proto::sim::{Sim, SimConfig};
//!
//! let mut sim = Sim::new(SimConfig::default(), 2);
//! let dest = sim.addr(1);
//! sim.post_recv(1, RecvOp { buf: BytesMut::with_capacity(64), tag: None, src: None, multi_recv: None,
//!     context: 7, local_region: None, room: None }).unwrap();
//! sim.send(0, SendOp { dest, buf: Bytes::from_static(b"hello"), tag: None, data: None,
//!     delivery_complete: false, context: 1, read_key: None, region_len: None }).unwrap();
//! assert!(sim.run());
//! let Some(Event::Recv(r)) = sim.take_events(1).pop() else { panic!() };
//! assert_eq!(&r.buf[..], b"hello");
//! ```

// As the engine's, the simulator's operations hand a refused operation back by value.
#![allow(
    clippy::result_large_err,
    reason = "a refused operation is handed back by value"
)]

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::addr::{Gid, RawAddr};
use crate::device::{DeviceAttr, RemoteIov, Source, Status};
use crate::error::{Error, ErrorKind};
use crate::fault::Rng;
use crate::mem::RegionSlice;
use crate::proto::engine::{
    Engine, EngineConfig, EngineSizes, Event, RecvOp, RmaMemory, RmaOp, SendOp, Transmit,
    TransmitKind,
};

/// `len` bytes of a seeded pseudo-random pattern (cheap even in debug builds).
pub fn pattern(seed: u64, len: usize) -> Bytes {
    let mut v = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

/// An untagged send without CQ data or delivery complete.
pub fn send_op(dest: RawAddr, buf: Bytes, context: u64) -> SendOp {
    SendOp {
        dest,
        buf,
        tag: None,
        data: None,
        delivery_complete: false,
        context,
        read_key: None,
        region_len: None,
    }
}

/// An untagged receive from any source into a new buffer of `cap` bytes.
pub fn recv_op(cap: usize, context: u64) -> RecvOp {
    RecvOp {
        buf: bytes::BytesMut::with_capacity(cap),
        tag: None,
        src: None,
        multi_recv: None,
        context,
        local_region: None,
        room: None,
    }
}

/// How the simulated network and devices behave.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Seed of every random decision (and of the QKEYs).
    pub seed: u64,
    /// Template of every node's engine configuration (the seed is varied per node).
    pub engine: EngineConfig,
    /// One-way latency.
    pub latency: Duration,
    /// Extra random delay in `0..jitter` per datagram: reordering.
    pub jitter: Duration,
    /// Probability that a datagram is "lost" and delivered after SRD's retransmission delay.
    pub loss: f64,
    /// Retransmission delay of a lost datagram (1 to 3 times this).
    pub retransmit_delay: Duration,
    /// Probability that a datagram is duplicated on the wire (SRD suppresses it: counted only).
    pub duplicate: f64,
    /// Device receive buffers per node.
    pub rx_buffers: usize,
    /// Delay before a consumed receive buffer is posted again.
    pub rx_repost_delay: Duration,
    /// RNR retries of the simulated device before the sender sees `RnrRetryExceeded`.
    pub rnr_retry: u32,
    /// Interval between RNR retries.
    pub rnr_interval: Duration,
    /// Delay of a sender's completion after the delivery.
    pub completion_delay: Duration,
    /// After this long a datagram to a vanished node completes with `UnresponsiveRemote`.
    pub unresponsive_after: Duration,
}

impl SimConfig {
    /// The default engine configuration of simulated nodes: MTU 8192, 256 packets on the
    /// device, 1024 operations each way, libfabric's protocol defaults, 5 s receive stall.
    pub fn default_engine() -> EngineConfig {
        let attr = DeviceAttr::software(
            crate::device::DeviceKind::Loopback,
            "sim".into(),
            Gid::from(Ipv4Addr::LOCALHOST),
            8192,
            256,
            1024,
        );
        let sizes = EngineSizes {
            send_depth: 256,
            tx_ops: 1024,
            rx_ops: 1024,
        };
        let mut e = EngineConfig::new(&crate::config::Config::default(), &attr, sizes, false, 0);
        e.max_rdma_size = 0;
        e.rx_stall_timeout = Duration::from_secs(5);
        e.runt_size = 307_200;
        e
    }

    /// No faults (but latency, so that packets interleave), plenty of receive buffers.
    pub fn clean(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            ..SimConfig::default()
        }
    }

    /// Faults of the issue's mixes: 10 % "loss", 10 % duplicates, jitter, few receive buffers
    /// (so RNR happens), buffers re-posted after a delay.
    pub fn faulty(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            jitter: Duration::from_micros(30),
            loss: 0.1,
            duplicate: 0.1,
            rx_buffers: 32,
            rx_repost_delay: Duration::from_micros(3),
            rnr_retry: 1,
            ..SimConfig::default()
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 0,
            engine: SimConfig::default_engine(),
            latency: Duration::from_micros(2),
            jitter: Duration::ZERO,
            loss: 0.0,
            retransmit_delay: Duration::from_micros(50),
            duplicate: 0.0,
            rx_buffers: 4096,
            rx_repost_delay: Duration::ZERO,
            rnr_retry: 3,
            rnr_interval: Duration::from_micros(10),
            completion_delay: Duration::from_micros(1),
            unresponsive_after: Duration::from_millis(10),
        }
    }
}

/// Counters of the simulated network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Datagrams posted by engines.
    pub sent: u64,
    /// Datagrams delivered to an engine.
    pub delivered: u64,
    /// Payload bytes delivered.
    pub delivered_bytes: u64,
    /// Datagrams delayed by a simulated loss.
    pub lost: u64,
    /// Duplicates suppressed.
    pub duplicates: u64,
    /// Times a datagram found no receive buffer.
    pub rnr_naks: u64,
    /// Sender completions with `RnrRetryExceeded`.
    pub rnr_exceeded: u64,
    /// Sender completions with `UnresponsiveRemote`.
    pub unresponsive: u64,
    /// Datagrams larger than the MTU (an engine bug; completed with `LocalBadLength`).
    pub oversize: u64,
    /// Datagrams handed out while the node already had `max_outstanding_tx` on the device
    /// (an engine bug).
    pub over_depth: u64,
    /// RDMA work requests posted by engines.
    pub rdma_ops: u64,
    /// Bytes RDMA wrote or read successfully.
    pub rdma_bytes: u64,
    /// RDMA work requests refused by the target (`RemoteBadAddress`).
    pub rdma_refused: u64,
    /// RDMA work requests refused because the target held no AH for the initiator
    /// (`UnknownPeer`, EFA status 14; see [`Sim::forget_ah`]).
    pub rdma_no_ah: u64,
}

/// A datagram as the tap saw it.
#[derive(Clone, Debug)]
pub struct Datagram {
    /// Virtual time it was handed to the device.
    pub at: Duration,
    /// Sending node.
    pub from: usize,
    /// Destination address.
    pub to: RawAddr,
    /// Header and payload, contiguous.
    pub bytes: Vec<u8>,
}

/// A second transport of a node beside the simulated network: the same-host path (the RDM
/// endpoint's shared-memory channels), run over in-memory rings. The simulator offers it every
/// send of its node first and gives it a pass whenever it polls the node's engine, with the
/// virtual time; between passes it wakes it at [`Beside::next_timer`], as the endpoint's waiter
/// thread would.
pub trait Beside: std::fmt::Debug {
    /// Takes a send whose destination it reaches: `Ok(None)`. `Ok(Some(op))`: not one of its
    /// peers, the engine sends it. `Err`: refused (`Again` when too many are in flight).
    fn send(
        &mut self,
        engine: &mut Engine,
        now: Instant,
        op: SendOp,
    ) -> Result<Option<SendOp>, (Error, SendOp)>;
    /// One pass: what arrived goes into `engine`, what waits goes on, completions go into
    /// `events`. True when anything moved.
    fn progress(&mut self, engine: &mut Engine, now: Instant, events: &mut Vec<Event>) -> bool;
    /// When it next needs a pass while nothing arrives (after the current time).
    fn next_timer(&self) -> Option<Instant>;
}

/// One simulated endpoint.
#[derive(Debug)]
pub struct Node {
    /// Its engine.
    pub engine: Engine,
    /// Its address.
    pub addr: RawAddr,
    /// False once it vanished.
    pub alive: bool,
    /// Completions collected from the engine.
    pub events: Vec<Event>,
    incarnation: u64,
    free_bufs: usize,
    /// Datagrams on the simulated device, not yet completed.
    in_flight: usize,
    /// What peers' device RDMA reaches (and the engine's memory).
    device_mem: Option<Arc<dyn RmaMemory>>,
    /// Not polled; what is delivered to it waits in `parked`.
    frozen: bool,
    parked: Vec<Action>,
    /// Its same-host transport, if any ([`Sim::attach`]).
    beside: Option<Box<dyn Beside>>,
    /// Initiators this node's device holds no AH for: their RDMA fails with `UnknownPeer` until
    /// a datagram of theirs arrives here (the provider then makes an AH, as libfabric's
    /// implicit AV insertion and the crate's efa device do).
    no_ah: std::collections::HashSet<usize>,
}

/// A datagram on its way to (the device of) `to`, after `rnr` receiver-not-ready refusals.
#[derive(Debug)]
struct Arrival {
    from: usize,
    src: Source,
    to: RawAddr,
    wr_id: u64,
    inc: u64,
    hdr: Bytes,
    payload: Bytes,
    rnr: u32,
}

#[derive(Debug)]
enum Action {
    Arrive(Arrival),
    Complete {
        node: usize,
        inc: u64,
        wr_id: u64,
        status: Status,
    },
    Repost {
        node: usize,
        inc: u64,
    },
    /// An RDMA work request reaches its target's memory.
    Rdma {
        from: usize,
        inc: u64,
        to: RawAddr,
        wr_id: u64,
        op: RdmaOp,
    },
    /// The initiator's completion of an RDMA work request.
    RdmaDone {
        node: usize,
        inc: u64,
        wr_id: u64,
        status: Status,
        buf: Option<BytesMut>,
    },
    /// The target's completion of a write with immediate data.
    RemoteWrite {
        node: usize,
        inc: u64,
        src: Source,
        imm: u32,
        len: usize,
    },
}

#[derive(Debug)]
enum RdmaOp {
    Write {
        remote: RemoteIov,
        data: Bytes,
        imm: Option<u32>,
    },
    Read {
        remote: RemoteIov,
        buf: BytesMut,
        /// A region read: the data goes here, and the completion hands back no buffer.
        into: Option<RegionSlice>,
    },
}

impl RdmaOp {
    /// The buffer the completion hands back: a read's own buffer; none for a write or a read
    /// into a region.
    fn into_buf(self) -> Option<BytesMut> {
        match self {
            RdmaOp::Read {
                buf, into: None, ..
            } => Some(buf),
            RdmaOp::Read { .. } | RdmaOp::Write { .. } => None,
        }
    }
}

#[derive(Debug)]
struct Item {
    at: Duration,
    seq: u64,
    action: Action,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    /// Reversed: the heap pops the earliest first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// Lanes of [`Queue`]: distinct delays scheduled without the heap.
const LANES: usize = 8;

/// The simulator's agenda, popped in `(at, seq)` order.
///
/// Most actions are scheduled after one of a few fixed delays (latency, completion delay, RNR
/// interval, ...); since the clock never goes back, the actions of one delay come due in the
/// order they were scheduled. Each of the first [`LANES`] delays seen gets a FIFO lane; other
/// delays (jitter, loss) go to a heap. The earliest of the lane heads and the heap top is next:
/// the same order as one heap, at O(1) for the lanes.
#[derive(Debug, Default)]
struct Queue {
    lanes: Vec<(Duration, VecDeque<Item>)>,
    heap: BinaryHeap<Item>,
}

impl Queue {
    fn push(&mut self, after: Duration, item: Item) {
        if let Some((_, q)) = self.lanes.iter_mut().find(|(d, _)| *d == after) {
            q.push_back(item);
        } else if self.lanes.len() < LANES {
            self.lanes.push((after, VecDeque::from([item])));
        } else {
            self.heap.push(item);
        }
    }

    /// Where the earliest item is: `Some(lane)` or `None` for the heap; and its time.
    fn first(&self) -> Option<(Option<usize>, Duration)> {
        let mut best: Option<(Option<usize>, (Duration, u64))> =
            self.heap.peek().map(|it| (None, (it.at, it.seq)));
        for (i, (_, q)) in self.lanes.iter().enumerate() {
            if let Some(it) = q.front() {
                if best.is_none_or(|(_, k)| (it.at, it.seq) < k) {
                    best = Some((Some(i), (it.at, it.seq)));
                }
            }
        }
        best.map(|(w, (at, _))| (w, at))
    }

    /// When the earliest item is due.
    fn next_at(&self) -> Option<Duration> {
        self.first().map(|(_, at)| at)
    }

    /// The earliest item, if it is due at `now`.
    fn pop_due(&mut self, now: Duration) -> Option<Item> {
        match self.first()? {
            (_, at) if at > now => None,
            (Some(i), _) => self.lanes.get_mut(i)?.1.pop_front(),
            (None, _) => self.heap.pop(),
        }
    }
}

/// Engines on a simulated SRD network with a virtual clock.
#[derive(Debug)]
pub struct Sim {
    cfg: SimConfig,
    base: Instant,
    now: Duration,
    rng: Rng,
    seq: u64,
    queue: Queue,
    nodes: Vec<Node>,
    scratch: Vec<u8>,
    tap: Option<Vec<Datagram>>,
    /// Network counters.
    pub stats: SimStats,
    /// Stop [`Sim::run`] after this much virtual time (default 600 s).
    pub time_limit: Duration,
}

impl Sim {
    /// A simulator with `n` nodes configured by `cfg.engine`.
    pub fn new(cfg: SimConfig, n: usize) -> Sim {
        let mut sim = Sim {
            rng: Rng::new(cfg.seed),
            cfg,
            base: Instant::now(),
            now: Duration::ZERO,
            seq: 0,
            queue: Queue::default(),
            nodes: Vec::new(),
            scratch: Vec::new(),
            tap: None,
            stats: SimStats::default(),
            time_limit: Duration::from_secs(600),
        };
        for _ in 0..n {
            let e = sim.cfg.engine.clone();
            sim.add_node(e);
        }
        sim
    }

    fn new_qkey(&mut self) -> u32 {
        (self.rng.next_u64() as u32 & 0x7fff_ffff).max(1)
    }

    /// Adds a node with its own engine configuration; returns its index.
    pub fn add_node(&mut self, mut ecfg: EngineConfig) -> usize {
        let i = self.nodes.len();
        let ip = Ipv4Addr::new(10, 0, (i >> 8) as u8, (i & 0xff) as u8 + 1);
        let addr = RawAddr::new(Gid::from(ip), 1000 + i as u16, self.new_qkey());
        ecfg.seed ^= self.cfg.seed.rotate_left(17) ^ i as u64;
        let engine = Engine::new(ecfg, addr, self.now());
        self.nodes.push(Node {
            engine,
            addr,
            alive: true,
            events: Vec::new(),
            incarnation: 0,
            free_bufs: self.cfg.rx_buffers,
            in_flight: 0,
            device_mem: None,
            frozen: false,
            parked: Vec::new(),
            beside: None,
            no_ah: Default::default(),
        });
        i
    }

    /// Gives node `i` a transport beside the network (the same-host path): its sends go there
    /// first, and it runs with the node's engine.
    pub fn attach(&mut self, i: usize, b: Box<dyn Beside>) {
        self.nodes[i].beside = Some(b);
    }

    /// Node `target`'s device drops its AH for node `initiator` (EFA evicts AHs): the
    /// initiator's RDMA to it fails with `UnknownPeer` (status 14) until a datagram from the
    /// initiator arrives at the target.
    pub fn forget_ah(&mut self, target: usize, initiator: usize) {
        self.nodes[target].no_ah.insert(initiator);
    }

    /// The current virtual time.
    pub fn now(&self) -> Instant {
        self.base.checked_add(self.now).unwrap_or(self.base)
    }

    /// Virtual time elapsed since the start.
    pub fn elapsed(&self) -> Duration {
        self.now
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True without nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    /// Node `i`'s engine.
    pub fn engine(&mut self, i: usize) -> &mut Engine {
        &mut self.nodes[i].engine
    }

    /// Node `i`'s address.
    pub fn addr(&self, i: usize) -> RawAddr {
        self.nodes[i].addr
    }

    /// Starts a send on node `i` at the current virtual time.
    pub fn send(&mut self, i: usize, op: SendOp) -> Result<(), (Error, SendOp)> {
        let now = self.now();
        let n = &mut self.nodes[i];
        let op = match n.beside.as_mut() {
            Some(b) => match b.send(&mut n.engine, now, op)? {
                Some(op) => op,
                None => return Ok(()),
            },
            None => op,
        };
        n.engine.send(now, op)
    }

    /// Posts a receive on node `i`.
    pub fn post_recv(&mut self, i: usize, op: RecvOp) -> Result<(), (Error, RecvOp)> {
        let now = self.now();
        self.nodes[i].engine.post_recv(now, op)
    }

    /// Takes the completions node `i` collected (also polls its engine).
    pub fn take_events(&mut self, i: usize) -> Vec<Event> {
        let n = &mut self.nodes[i];
        while let Some(e) = n.engine.poll_event() {
            n.events.push(e);
        }
        // The next batch is likely as large: room for it, without growing step by step.
        let room = n.events.len();
        std::mem::replace(&mut n.events, Vec::with_capacity(room))
    }

    /// Hands `bytes` to node `i` as if it arrived from `src` (fuzzing, crafted packets).
    pub fn inject(&mut self, i: usize, src: Source, bytes: &[u8]) {
        let now = self.now();
        self.nodes[i].engine.handle_recv(now, src, bytes);
    }

    /// The device source of node `i`'s datagrams.
    pub fn source(&self, i: usize) -> Source {
        let a = self.nodes[i].addr;
        Source {
            gid: a.gid,
            qpn: a.qpn,
        }
    }

    /// Records every datagram sent from now on (or stops recording).
    pub fn set_tap(&mut self, on: bool) {
        self.tap = on.then(Vec::new);
    }

    /// The datagrams recorded since the last call.
    pub fn take_tap(&mut self) -> Vec<Datagram> {
        self.tap.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Node `i` vanishes: datagrams to it complete with `UnresponsiveRemote`, its own are
    /// forgotten.
    pub fn vanish(&mut self, i: usize) {
        self.nodes[i].alive = false;
    }

    /// Node `i` restarts on the same GID and QPN with a new QKEY and a fresh engine.
    pub fn restart(&mut self, i: usize) -> RawAddr {
        let qkey = self.new_qkey();
        let now = self.now();
        let n = &mut self.nodes[i];
        n.addr.qkey = qkey;
        let mut ecfg = n.engine.config().clone();
        ecfg.seed = ecfg.seed.wrapping_add(1);
        n.engine = Engine::new(ecfg, n.addr, now);
        n.alive = true;
        n.incarnation += 1;
        n.events.clear();
        n.free_bufs = self.cfg.rx_buffers;
        n.in_flight = 0;
        n.frozen = false;
        n.parked.clear();
        if let Some(mem) = n.device_mem.clone() {
            n.engine.set_memory(mem);
        }
        n.addr
    }

    fn schedule(&mut self, after: Duration, action: Action) {
        self.seq += 1;
        let at = self.now.saturating_add(after);
        let item = Item {
            at,
            seq: self.seq,
            action,
        };
        self.queue.push(after, item);
    }

    /// Polls every live engine until none has anything to do right now. Returns whether any did.
    fn pump(&mut self) -> bool {
        let now = self.now();
        let mut any = false;
        loop {
            let mut busy = false;
            for i in 0..self.nodes.len() {
                if !self.nodes[i].alive || self.nodes[i].frozen {
                    continue;
                }
                if self.nodes[i]
                    .engine
                    .poll_timeout()
                    .is_some_and(|t| t <= now)
                {
                    self.nodes[i].engine.handle_timeout(now);
                    busy = true;
                }
                while let Some(t) = self.nodes[i].engine.poll_transmit(now) {
                    busy = true;
                    self.launch(i, t);
                }
                let n = &mut self.nodes[i];
                if let Some(b) = n.beside.as_mut() {
                    let before = n.events.len();
                    busy |= b.progress(&mut n.engine, now, &mut n.events);
                    busy |= n.events.len() != before;
                }
                while let Some(e) = n.engine.poll_event() {
                    busy = true;
                    n.events.push(e);
                }
            }
            if !busy {
                return any;
            }
            any = true;
        }
    }

    fn launch(&mut self, from: usize, t: crate::proto::engine::Transmit) {
        let n = &mut self.nodes[from];
        n.in_flight += 1;
        if n.in_flight > n.engine.config().max_outstanding_tx {
            self.stats.over_depth += 1;
        }
        if !matches!(t.kind, TransmitKind::Send) {
            return self.launch_rdma(from, t);
        }
        self.stats.sent += 1;
        let inc = self.nodes[from].incarnation;
        if t.hdr.len() + t.payload.len()
            > self
                .cfg
                .engine
                .mtu
                .max(self.nodes[from].engine.config().mtu)
        {
            self.stats.oversize += 1;
            self.complete_after(Duration::ZERO, from, inc, t.wr_id, Status::LocalBadLength);
            return;
        }
        if let Some(tap) = &mut self.tap {
            let mut bytes = t.hdr.to_vec();
            bytes.extend_from_slice(&t.payload);
            tap.push(Datagram {
                at: self.now,
                from,
                to: t.dest,
                bytes,
            });
        }
        let delay = self.transit_delay();
        if self.rng.chance(self.cfg.duplicate) {
            self.stats.duplicates += 1;
        }
        let src = self.source(from);
        let action = Action::Arrive(Arrival {
            from,
            src,
            to: t.dest,
            wr_id: t.wr_id,
            inc,
            hdr: t.hdr,
            payload: t.payload,
            rnr: 0,
        });
        self.schedule(delay, action);
    }

    /// How long a datagram or RDMA work request takes to arrive: the latency, a random jitter,
    /// and, when "lost", one to three retransmission delays.
    fn transit_delay(&mut self) -> Duration {
        let mut delay = self.cfg.latency;
        if !self.cfg.jitter.is_zero() {
            delay += Duration::from_nanos(self.rng.below(self.cfg.jitter.as_nanos() as u64));
        }
        if self.rng.chance(self.cfg.loss) {
            self.stats.lost += 1;
            delay += self.cfg.retransmit_delay * (1 + self.rng.below(3) as u32);
        }
        delay
    }

    /// Schedules, `delay` from now, the send completion of work request `wr_id` of node `node`
    /// (incarnation `inc`) with `status`.
    fn complete_after(
        &mut self,
        delay: Duration,
        node: usize,
        inc: u64,
        wr_id: u64,
        status: Status,
    ) {
        let action = Action::Complete {
            node,
            inc,
            wr_id,
            status,
        };
        self.schedule(delay, action);
    }

    fn target(&self, to: &RawAddr) -> Option<usize> {
        self.nodes.iter().position(|n| n.alive && n.addr == *to)
    }

    /// A datagram reaches the device of its destination: no such node (the sender's completion
    /// says so after a while), no receive buffer (receiver not ready: tried again or failed),
    /// or delivered to the engine, then the sender's completion.
    fn arrive(&mut self, a: Arrival) {
        let (from, inc, wr_id) = (a.from, a.inc, a.wr_id);
        let Some(j) = self.target(&a.to) else {
            self.stats.unresponsive += 1;
            let after = self.cfg.unresponsive_after;
            return self.complete_after(after, from, inc, wr_id, Status::UnresponsiveRemote);
        };
        if self.nodes[j].free_bufs == 0 {
            self.stats.rnr_naks += 1;
            let after = self.cfg.rnr_interval;
            if a.rnr >= self.cfg.rnr_retry {
                self.stats.rnr_exceeded += 1;
                return self.complete_after(after, from, inc, wr_id, Status::RnrRetryExceeded);
            }
            return self.schedule(
                after,
                Action::Arrive(Arrival {
                    rnr: a.rnr + 1,
                    ..a
                }),
            );
        }
        self.stats.delivered += 1;
        self.stats.delivered_bytes += a.payload.len() as u64;
        let now = self.now();
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        buf.extend_from_slice(&a.hdr);
        buf.extend_from_slice(&a.payload);
        let node = &mut self.nodes[j];
        node.free_bufs -= 1;
        node.no_ah.remove(&from);
        node.engine.handle_recv(now, a.src, &buf);
        self.scratch = buf;
        let jinc = self.nodes[j].incarnation;
        if self.cfg.rx_repost_delay.is_zero() {
            self.nodes[j].free_bufs += 1;
        } else {
            self.schedule(
                self.cfg.rx_repost_delay,
                Action::Repost { node: j, inc: jinc },
            );
        }
        self.complete_after(self.cfg.completion_delay, from, inc, wr_id, Status::Success);
    }

    fn act(&mut self, action: Action) {
        let reaches = match &action {
            Action::Arrive(a) => self.target(&a.to),
            a => a.node(),
        };
        if let Some(n) = reaches.and_then(|i| self.nodes.get_mut(i)) {
            if n.frozen {
                n.parked.push(action);
                return;
            }
        }
        match action {
            Action::Arrive(a) => self.arrive(a),
            Action::Complete {
                node,
                inc,
                wr_id,
                status,
            } => {
                if let Some((n, now)) = self.completing(node, inc) {
                    n.engine.handle_send_completion(now, wr_id, status);
                }
            }
            Action::Repost { node, inc } => {
                let n = &mut self.nodes[node];
                if n.incarnation == inc {
                    n.free_bufs += 1;
                }
            }
            Action::Rdma {
                from,
                inc,
                to,
                wr_id,
                op,
            } => self.rdma_arrive(from, inc, to, wr_id, op),
            Action::RdmaDone {
                node,
                inc,
                wr_id,
                status,
                buf,
            } => {
                if let Some((n, now)) = self.completing(node, inc) {
                    n.engine.handle_rdma_completion(now, wr_id, status, buf);
                }
            }
            Action::RemoteWrite {
                node,
                inc,
                src,
                imm,
                len,
            } => {
                if let Some((n, now)) = self.live(node, inc) {
                    n.engine.handle_remote_write(now, src, imm, len);
                }
            }
        }
    }

    /// Node `node` with the current time, if it is alive and still in incarnation `inc` (what
    /// was sent to an earlier incarnation is lost with it).
    /// A work request of node `node` (incarnation `inc`) completes: the node, no longer counting
    /// it in flight, if it is still that incarnation.
    fn completing(&mut self, node: usize, inc: u64) -> Option<(&mut Node, Instant)> {
        let (n, now) = self.live(node, inc)?;
        n.in_flight = n.in_flight.saturating_sub(1);
        Some((n, now))
    }

    fn live(&mut self, node: usize, inc: u64) -> Option<(&mut Node, Instant)> {
        let now = self.now();
        let n = &mut self.nodes[node];
        (n.alive && n.incarnation == inc).then_some((n, now))
    }

    /// Polls the engines and performs what is due now; true if anything happened.
    fn work(&mut self) -> bool {
        let mut progressed = self.pump();
        while let Some(it) = self.queue.pop_due(self.now) {
            self.act(it.action);
            progressed = true;
        }
        progressed
    }

    /// When the next datagram event or engine timer is due.
    fn next_time(&self) -> Option<Duration> {
        let timer = self
            .nodes
            .iter()
            .filter(|n| n.alive)
            .flat_map(|n| {
                let beside = (!n.frozen)
                    .then(|| n.beside.as_ref().and_then(|b| b.next_timer()))
                    .flatten();
                n.engine.poll_timeout().into_iter().chain(beside)
            })
            .min()
            .map(|t| t.saturating_duration_since(self.base));
        match (self.queue.next_at(), timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// One step: polls the engines and performs what is due, or else advances the clock to the
    /// next datagram or timer. Returns false when nothing is left to do (quiescent).
    pub fn step(&mut self) -> bool {
        if self.work() {
            return true;
        }
        match self.next_time() {
            Some(t) => {
                self.now = self.now.max(t);
                true
            }
            None => false,
        }
    }

    /// Runs until quiescent; false if [`Sim::time_limit`] ran out first.
    pub fn run(&mut self) -> bool {
        while self.step() {
            if self.now > self.time_limit {
                return false;
            }
        }
        true
    }

    /// Runs for `d` of virtual time: afterwards the clock reads exactly `d` later.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now.saturating_add(d);
        loop {
            if self.work() {
                continue;
            }
            match self.next_time() {
                Some(t) if t <= end => self.now = self.now.max(t),
                _ => {
                    self.now = self.now.max(end);
                    return;
                }
            }
        }
    }

    /// Runs until `done` holds (checked after every step) or quiescence; returns `done`'s last
    /// answer.
    pub fn run_until(&mut self, mut done: impl FnMut(&mut Sim) -> bool) -> bool {
        loop {
            if done(self) {
                return true;
            }
            if !self.step() || self.now > self.time_limit {
                return done(self);
            }
        }
    }
    // ---- Device RDMA between nodes ----

    /// Gives node `i` the memory peers' device RDMA reaches; its engine gets it too (as a
    /// domain's registered regions serve both the device and the emulated protocols).
    pub fn set_device_memory(&mut self, i: usize, mem: Arc<dyn RmaMemory>) {
        let n = &mut self.nodes[i];
        n.engine.set_memory(mem.clone());
        n.device_mem = Some(mem);
    }

    /// Starts an RMA operation on node `i`.
    pub fn rma(&mut self, i: usize, op: RmaOp) -> Result<(), (Error, RmaOp)> {
        let now = self.now();
        self.nodes[i].engine.rma(now, op)
    }

    /// Freezes node `i` (its application stops polling) or thaws it. While frozen its engine is
    /// not polled and what is delivered to it (datagrams, completions) waits; RDMA against its
    /// memory still completes.
    pub fn freeze(&mut self, i: usize, on: bool) {
        let n = &mut self.nodes[i];
        n.frozen = on;
        if !on {
            let parked = std::mem::take(&mut n.parked);
            for a in parked {
                self.schedule(Duration::ZERO, a);
            }
        }
    }

    fn launch_rdma(&mut self, from: usize, t: Transmit) {
        self.stats.rdma_ops += 1;
        let inc = self.nodes[from].incarnation;
        let op = match t.kind {
            TransmitKind::RdmaWrite { remote, imm } => RdmaOp::Write {
                remote,
                data: t.payload,
                imm,
            },
            TransmitKind::RdmaRead { remote, buf } => RdmaOp::Read {
                remote,
                buf,
                into: None,
            },
            // Region memory: the simulated NIC copies it out when the work request starts, and
            // puts read data into it when the read is served.
            TransmitKind::RdmaWriteRegion { remote, imm, local } => RdmaOp::Write {
                remote,
                data: local.to_bytes().unwrap_or_default(),
                imm,
            },
            TransmitKind::RdmaReadRegion { remote, local } => RdmaOp::Read {
                remote,
                buf: BytesMut::with_capacity(local.len),
                into: Some(local),
            },
            TransmitKind::Send => return,
        };
        let delay = self.transit_delay();
        let action = Action::Rdma {
            from,
            inc,
            to: t.dest,
            wr_id: t.wr_id,
            op,
        };
        self.schedule(delay, action);
    }

    /// An RDMA work request reaches the target's memory: applied (or refused), then the
    /// initiator's completion; the target's engine does nothing (except for the completion of a
    /// write with immediate data).
    fn rdma_arrive(&mut self, from: usize, inc: u64, to: RawAddr, wr_id: u64, op: RdmaOp) {
        let done = |status, buf| Action::RdmaDone {
            node: from,
            inc,
            wr_id,
            status,
            buf,
        };
        // The target's memory is busy (the application holds the region): the NIC tries again.
        let again = |op| Action::Rdma {
            from,
            inc,
            to,
            wr_id,
            op,
        };
        let Some(j) = self.target(&to) else {
            self.stats.unresponsive += 1;
            let a = done(Status::UnresponsiveRemote, op.into_buf());
            return self.schedule(self.cfg.unresponsive_after, a);
        };
        if self.nodes[j].no_ah.contains(&from) {
            self.stats.rdma_no_ah += 1;
            let a = done(Status::UnknownPeer, op.into_buf());
            return self.schedule(self.cfg.completion_delay, a);
        }
        let mem = self.nodes[j].device_mem.clone();
        let refused = Error::new(ErrorKind::RemoteAccess, "rdma");
        match op {
            RdmaOp::Write { remote, data, imm } => {
                let r = match &mem {
                    Some(_) if data.len() as u64 != remote.len => Err(refused),
                    Some(m) => m.write(remote.key, remote.addr, &data),
                    None => Err(refused),
                };
                let status = match r {
                    Err(e) if e.kind() == ErrorKind::Again => {
                        let op = RdmaOp::Write { remote, data, imm };
                        return self.schedule(self.cfg.rnr_interval, again(op));
                    }
                    Err(_) => {
                        self.stats.rdma_refused += 1;
                        Status::RemoteBadAddress
                    }
                    Ok(()) => {
                        self.stats.rdma_bytes += data.len() as u64;
                        if let Some(imm) = imm {
                            let a = Action::RemoteWrite {
                                node: j,
                                inc: self.nodes[j].incarnation,
                                src: self.source(from),
                                imm,
                                len: data.len(),
                            };
                            self.schedule(Duration::ZERO, a);
                        }
                        Status::Success
                    }
                };
                self.schedule(self.cfg.completion_delay, done(status, None));
            }
            RdmaOp::Read {
                remote,
                mut buf,
                into,
            } => {
                let r = match &mem {
                    Some(_) if (buf.capacity() as u64) < remote.len => {
                        Err(Error::new(ErrorKind::MsgSize, "rdma"))
                    }
                    Some(m) => m.read(remote.key, remote.addr, remote.len),
                    None => Err(refused),
                };
                let status = match r {
                    Err(e) if e.kind() == ErrorKind::Again => {
                        let op = RdmaOp::Read { remote, buf, into };
                        return self.schedule(self.cfg.rnr_interval, again(op));
                    }
                    Err(e) if e.kind() == ErrorKind::MsgSize => Status::LocalBadLength,
                    Err(_) => {
                        self.stats.rdma_refused += 1;
                        Status::RemoteBadAddress
                    }
                    Ok(data) => {
                        self.stats.rdma_bytes += data.len() as u64;
                        buf.clear();
                        buf.extend_from_slice(&data);
                        match &into {
                            Some(r) if r.write_from(&data).is_err() => Status::LocalQpInternalError,
                            _ => Status::Success,
                        }
                    }
                };
                let buf = if into.is_some() { None } else { Some(buf) };
                self.schedule(self.cfg.completion_delay, done(status, buf));
            }
        }
    }
}

impl Action {
    /// The node whose engine the action reaches (frozen nodes park it).
    fn node(&self) -> Option<usize> {
        match self {
            Action::Complete { node, .. }
            | Action::RdmaDone { node, .. }
            | Action::RemoteWrite { node, .. } => Some(*node),
            Action::Arrive(_) | Action::Repost { .. } | Action::Rdma { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The simulator's default engine, derived from `Config::default()` through
    /// `EngineConfig::new`, is the configuration the simulator tests were written against.
    #[test]
    fn default_engine_is_the_documented_one() {
        let want = EngineConfig {
            mtu: 8192,
            max_outstanding_tx: 256,
            max_tx_ops: 1024,
            max_rx_ops: 1024,
            recvwin_size: 16,
            tx_min_credits: 32,
            max_medium_msg_size: 65536,
            timeout_interval: Duration::ZERO,
            max_timeout: Duration::from_millis(1000),
            rx_stall_timeout: Duration::from_secs(5),
            seed: 0,
            device_rdma_read: false,
            device_rdma_write: false,
            max_rdma_size: 0,
            inter_min_read_write_size: 65536,
            inter_min_read_message_size: 1_048_576,
            runt_size: 307_200,
            inter_read_segment_size: 1 << 30,
        };
        assert_eq!(SimConfig::default_engine(), want);
    }
}
