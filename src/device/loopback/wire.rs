//! The network core: routing, fault fates, held datagrams and their release.
//!
//! # Locking
//!
//! One mutex per network ([`Wire::state`]) guards routing, the fault generator and every held
//! datagram; each queue pair has its own mutex for its receive buffers and completions. The order
//! is always *network, then at most one queue pair*: a queue pair lock is never held while taking
//! the network lock or another queue pair's lock. `post_recv` and the fast path of `poll` take only
//! their own queue pair's lock. Notifiers are signalled after every lock is released.
//!
//! RDMA operations are routed under the network lock but applied after it is released
//! ([`Wake::defer`], run by [`Wire::with_state`]): a region's lock is never taken under the network
//! lock, and never waited for (it is only tried; a busy region holds the operation for the next
//! network event and signals the initiator when it is free). While a region lock is held, at most
//! the target queue pair's lock is taken (to consume a receive buffer); a device's key-table lock
//! is taken alone.
//!
//! # Determinism
//!
//! Fates are drawn from the seeded generator in transmission order, under the network lock. Held
//! datagrams are released either after a number of network *events* (a progress pass: every
//! `post_send`, every `poll` while something is held, every `pump`) — for reordering and SRD
//! retransmission — or at a point of the network clock — for delays, RNR retries and unresponsive
//! timeouts. Datagrams released together are handled in transmission order. Nothing depends on
//! hash order or on addresses.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;

use super::DevShared;
use super::qp::QpShared;
use super::rdma::{self, Applied, Deferred, RdmaOp};
use crate::addr::{Gid, RawAddr};
use crate::device::{DeviceCompletion, Opcode, QpType, SendWr, Source, Status};
use crate::fault::Fate;
use crate::fault::{FaultConfig, FaultInjector};
use crate::notify::Notifier;
use crate::stats::{DeviceCounters, add, inc};

/// A reordered or retransmitted datagram is held for `1..=MAX_HOLD_EVENTS` network events.
pub(super) const MAX_HOLD_EVENTS: u64 = 16;
/// The RNR retry count that means "retry forever", as on EFA.
pub(super) const RNR_INFINITE: u8 = crate::device::RNR_RETRY_FOREVER;

enum Clock {
    Real(Instant),
    /// Nanoseconds since creation.
    Manual(AtomicU64),
}

/// The shared core of a [`super::LoopbackNetwork`].
pub(super) struct Wire {
    pub(super) id: u32,
    clock: Clock,
    /// Mirror of `WireState::in_flight()`, so that `poll` skips the network lock when nothing is held.
    held: AtomicUsize,
    pub(super) state: Mutex<WireState>,
}

impl Wire {
    pub(super) fn new(id: u32, faults: FaultConfig, manual: bool) -> Wire {
        Wire {
            id,
            clock: if manual {
                Clock::Manual(AtomicU64::new(0))
            } else {
                Clock::Real(Instant::now())
            },
            held: AtomicUsize::new(0),
            state: Mutex::new(WireState {
                faults: FaultInjector::new(faults),
                next_dev: 0,
                devices: HashMap::new(),
                qps: HashMap::new(),
                by_event: BTreeMap::new(),
                by_time: BTreeMap::new(),
                event: 0,
                seq: 0,
            }),
        }
    }

    pub(super) fn now(&self) -> Duration {
        match &self.clock {
            Clock::Real(t0) => t0.elapsed(),
            Clock::Manual(ns) => Duration::from_nanos(ns.load(Ordering::Acquire)),
        }
    }

    pub(super) fn has_manual_clock(&self) -> bool {
        matches!(self.clock, Clock::Manual(_))
    }

    /// Moves the manual clock; false on the real clock.
    pub(super) fn advance(&self, d: Duration) -> bool {
        match &self.clock {
            Clock::Real(_) => false,
            Clock::Manual(ns) => {
                let d = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
                let _ = ns.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_add(d))
                });
                true
            }
        }
    }

    pub(super) fn in_flight(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Runs `f` under the network lock with the current time, then publishes the held count;
    /// after the lock is released, applies the RDMA operations `f` routed (holding again those
    /// that must wait) and signals the notifiers collected.
    pub(super) fn with_state<R>(
        &self,
        f: impl FnOnce(&mut WireState, Duration, &mut Wake) -> R,
    ) -> R {
        let now = self.now();
        let mut wake = Wake::default();
        let r = {
            let mut st = self.state.lock();
            let r = f(&mut st, now, &mut wake);
            self.held.store(st.in_flight(), Ordering::Release);
            r
        };
        let mut again = Vec::new();
        for d in std::mem::take(&mut wake.rdma) {
            match rdma::apply(d, &mut wake) {
                Applied::Done => {}
                other => again.push(other),
            }
        }
        if !again.is_empty() {
            let now = self.now();
            let mut st = self.state.lock();
            for a in again {
                st.hold_again(now, a, &mut wake);
            }
            self.held.store(st.in_flight(), Ordering::Release);
        }
        wake.notify();
        r
    }

    /// One progress pass: releases what is due.
    pub(super) fn pump(&self) -> usize {
        self.with_state(|st, now, wake| st.progress(now, wake))
    }

    /// Transmits one datagram of `sender`, then makes progress (one network event).
    pub(super) fn send(&self, sender: &Arc<QpShared>, wr: SendWr) {
        self.with_state(|st, now, wake| {
            st.transmit(now, sender, wr, wake);
            st.progress(now, wake);
        });
    }

    /// Puts one RDMA operation of `sender` on the wire (to `dest`; `data` is what a write
    /// carries), then makes progress (one network event). It is applied in this thread unless a
    /// fault holds it.
    pub(super) fn rdma(
        &self,
        sender: &Arc<QpShared>,
        dest: RawAddr,
        data: Bytes,
        imm: Option<u32>,
        op: RdmaOp,
    ) {
        self.with_state(|st, now, wake| {
            st.transmit_rdma(now, sender, dest, data, imm, op, wake);
            st.progress(now, wake);
        });
    }
}

/// What to do once the locks are released: notifiers to signal and RDMA operations to apply.
#[derive(Default)]
pub(super) struct Wake {
    notifiers: Vec<Arc<Notifier>>,
    rdma: Vec<Deferred>,
}

impl Wake {
    pub(super) fn add(&mut self, n: &Arc<Notifier>) {
        if !self.notifiers.iter().any(|x| Arc::ptr_eq(x, n)) {
            self.notifiers.push(n.clone());
        }
    }

    /// Applies the routed RDMA operation `d` after the network lock is released.
    fn defer(&mut self, d: Deferred) {
        self.rdma.push(d);
    }

    pub(super) fn notify(self) {
        for n in self.notifiers {
            n.notify();
        }
    }
}

/// One datagram on the wire (for an RDMA operation: its route, the data a write carries and the
/// immediate data).
pub(super) struct Datagram {
    pub(super) src: Source,
    pub(super) dest: RawAddr,
    qp_type: QpType,
    hdr: Bytes,
    pub(super) payload: Bytes,
    pub(super) imm: Option<u32>,
}

impl Datagram {
    pub(super) fn len(&self) -> usize {
        self.hdr.len() + self.payload.len()
    }
}

/// The sender side of an SRD datagram: it completes when the datagram is delivered or fails.
struct SrdSend {
    sender: Arc<QpShared>,
    wr_id: u64,
    /// RNR retries done so far.
    rnr_retries: u8,
    /// Set when the destination is gone: the send completes with this status when released.
    doom: Option<Status>,
    /// The fault injector duplicated it; the receiving device suppresses the copy on delivery.
    dup: bool,
}

enum Kind {
    /// Send already completed; deliver `copies` times (2 when duplicated).
    Ud {
        copies: u8,
    },
    Srd(SrdSend),
    /// A one-sided RDMA operation (on SRD queue pairs only).
    Rdma(Box<RdmaOp>),
}

/// A held datagram.
struct Flight {
    /// Transmission number: the tie-breaker that keeps release order deterministic.
    seq: u64,
    dg: Datagram,
    kind: Kind,
}

/// What happened when a datagram reached its destination.
enum Outcome {
    Delivered,
    /// The posted buffer was too short; it was handed back with `LocalBadLength`.
    BadLength,
    /// No receive buffer posted.
    NotReady,
    /// The destination queue pair is gone, of the wrong type, or has another QKEY
    /// (`UnresponsiveRemote`), or no such device exists (`UnreachableRemote`).
    Gone(Status),
}

pub(super) struct WireState {
    pub(super) faults: FaultInjector,
    next_dev: u32,
    devices: HashMap<Gid, Weak<DevShared>>,
    qps: HashMap<(Gid, u16), Arc<QpShared>>,
    /// Held until a network event number: key `(event, seq)`.
    by_event: BTreeMap<(u64, u64), Flight>,
    /// Held until a point of the network clock: key `(time, seq)`.
    by_time: BTreeMap<(Duration, u64), Flight>,
    event: u64,
    seq: u64,
}

impl WireState {
    pub(super) fn in_flight(&self) -> usize {
        self.by_event.len() + self.by_time.len()
    }

    pub(super) fn set_faults(&mut self, faults: FaultConfig) {
        self.faults = FaultInjector::new(faults);
    }

    /// Gives a new device its number and GID (`fd00::` + network id + device number) and
    /// registers what `make` builds.
    pub(super) fn register_device(
        &mut self,
        net_id: u32,
        make: impl FnOnce(Gid) -> Arc<DevShared>,
    ) -> (u32, Arc<DevShared>) {
        self.devices.retain(|_, d| d.strong_count() > 0);
        let n = self.next_dev;
        self.next_dev = self.next_dev.wrapping_add(1);
        let mut g = [0u8; 16];
        g[0] = 0xfd;
        g[8..12].copy_from_slice(&net_id.to_be_bytes());
        g[12..16].copy_from_slice(&n.to_be_bytes());
        let gid = Gid(g);
        let dev = make(gid);
        self.devices.insert(gid, Arc::downgrade(&dev));
        (n, dev)
    }

    pub(super) fn attach_qp(&mut self, qp: Arc<QpShared>) {
        self.qps.insert((qp.addr.gid, qp.addr.qpn), qp);
    }

    /// Removes `qp` from the routing table and takes back its SRD sends and RDMA operations still
    /// held by the network; returns their `Flushed` completions in transmission order (an RDMA
    /// read's completion hands its buffer back).
    pub(super) fn detach_qp(&mut self, qp: &Arc<QpShared>) -> Vec<DeviceCompletion> {
        let key = (qp.addr.gid, qp.addr.qpn);
        if self.qps.get(&key).is_some_and(|e| Arc::ptr_eq(e, qp)) {
            self.qps.remove(&key);
        }
        let mine = |f: &Flight| match &f.kind {
            Kind::Srd(s) => Arc::ptr_eq(&s.sender, qp),
            Kind::Rdma(op) => Arc::ptr_eq(&op.initiator, qp),
            Kind::Ud { .. } => false,
        };
        let mut taken = Vec::new();
        take_flights(&mut self.by_event, mine, &mut taken);
        take_flights(&mut self.by_time, mine, &mut taken);
        taken.sort_unstable_by_key(|f| f.seq);
        taken
            .into_iter()
            .filter_map(|f| {
                let len = f.dg.len();
                match f.kind {
                    Kind::Srd(s) => Some(DeviceCompletion::new(
                        s.wr_id,
                        Status::Flushed,
                        Opcode::Send,
                        len,
                    )),
                    Kind::Rdma(op) => Some(op.into_completion(Status::Flushed)),
                    Kind::Ud { .. } => None,
                }
            })
            .collect()
    }

    /// Puts one datagram of `sender` on the wire: counts it, draws its fate, and delivers or holds
    /// it. A UD send completes here; an SRD send completes when delivered or failed.
    fn transmit(&mut self, now: Duration, sender: &Arc<QpShared>, wr: SendWr, wake: &mut Wake) {
        let len = wr.len();
        let c = &sender.dev.counters;
        inc(&c.tx_pkts);
        add(&c.tx_bytes, len as u64);
        let seq = self.seq;
        self.seq += 1;
        let fate = self.faults.next_fate();
        let mut hold_events = fate.reorder;
        let kind = match sender.qp_type {
            QpType::Ud => {
                sender.push(
                    DeviceCompletion::new(wr.wr_id, Status::Success, Opcode::Send, len),
                    wake,
                );
                if fate.drop {
                    inc(&c.faults_dropped);
                    return;
                }
                let copies = if fate.duplicate {
                    inc(&c.faults_duplicated);
                    2
                } else {
                    1
                };
                Kind::Ud { copies }
            }
            QpType::Srd => {
                hold_events = srd_faults(&fate, c);
                Kind::Srd(SrdSend {
                    sender: sender.clone(),
                    wr_id: wr.wr_id,
                    rnr_retries: 0,
                    doom: None,
                    dup: fate.duplicate,
                })
            }
        };
        let flight = Flight {
            seq,
            dg: Datagram {
                src: sender.source(),
                dest: wr.dest,
                qp_type: sender.qp_type,
                hdr: wr.hdr,
                payload: wr.payload,
                imm: wr.imm,
            },
            kind,
        };
        self.place(now, &fate, hold_events, flight, c, wake);
    }

    /// Puts one RDMA operation of `sender` on the wire with SRD semantics: a fault may only delay
    /// or reorder it ("dropped" means retransmitted later, "duplicated" means suppressed at the
    /// target); it is applied exactly once.
    #[allow(clippy::too_many_arguments)]
    fn transmit_rdma(
        &mut self,
        now: Duration,
        sender: &Arc<QpShared>,
        dest: RawAddr,
        payload: Bytes,
        imm: Option<u32>,
        mut op: RdmaOp,
        wake: &mut Wake,
    ) {
        let c = &sender.dev.counters;
        let seq = self.seq;
        self.seq += 1;
        let fate = self.faults.next_fate();
        let hold_events = srd_faults(&fate, c);
        op.dup |= fate.duplicate;
        let flight = Flight {
            seq,
            dg: Datagram {
                src: sender.source(),
                dest,
                qp_type: QpType::Srd,
                hdr: Bytes::new(),
                payload,
                imm,
            },
            kind: Kind::Rdma(Box::new(op)),
        };
        self.place(now, &fate, hold_events, flight, c, wake);
    }

    /// Holds a freshly transmitted `flight` as its fate says (counting a reorder or delay on
    /// `counters`, the sender's), or attempts it at once.
    fn place(
        &mut self,
        now: Duration,
        fate: &Fate,
        hold_events: bool,
        flight: Flight,
        counters: &DeviceCounters,
        wake: &mut Wake,
    ) {
        if fate.reorder || !fate.delay.is_zero() {
            inc(&counters.faults_reordered);
        }
        let seq = flight.seq;
        if !fate.delay.is_zero() {
            self.by_time.insert((now + fate.delay, seq), flight);
        } else if hold_events {
            let k = 1 + self.faults.rng().below(MAX_HOLD_EVENTS);
            self.by_event.insert((self.event + k, seq), flight);
        } else {
            self.attempt(now, flight, wake);
        }
    }

    /// Holds again an RDMA operation that could not be applied: until the next network event when
    /// its region was busy; for an RNR retry (or its final `RnrRetryExceeded`) when the target had
    /// no receive buffer for its immediate data.
    fn hold_again(&mut self, now: Duration, a: Applied, wake: &mut Wake) {
        match a {
            Applied::Done => {}
            Applied::Busy(d) => {
                let Deferred { seq, dg, op, .. } = d;
                let kind = Kind::Rdma(op);
                self.by_event
                    .insert((self.event, seq), Flight { seq, dg, kind });
            }
            Applied::NotReady(d) => {
                let Deferred {
                    seq, dg, mut op, ..
                } = d;
                let dev = op.initiator.dev.clone();
                inc(&dev.counters.rnr_naks_received);
                let limit = op.initiator.rnr_retry;
                if limit != RNR_INFINITE && op.rnr_retries >= limit {
                    tracing::debug!(src = ?dg.src, dest = %dg.dest, "loopback: RDMA write RNR retries exceeded");
                    op.complete(Status::RnrRetryExceeded, wake);
                } else {
                    op.rnr_retries = op.rnr_retries.saturating_add(1);
                    let at = now + dev.cfg.rnr_retry_interval;
                    let kind = Kind::Rdma(op);
                    self.by_time.insert((at, seq), Flight { seq, dg, kind });
                }
            }
        }
    }

    /// One network event: releases, in transmission order, every held datagram whose event number
    /// or time has come. Returns how many.
    fn progress(&mut self, now: Duration, wake: &mut Wake) -> usize {
        let mut due = Vec::new();
        while let Some(e) = self.by_event.first_entry() {
            if e.key().0 > self.event {
                break;
            }
            due.push(e.remove());
        }
        while let Some(e) = self.by_time.first_entry() {
            if e.key().0 > now {
                break;
            }
            due.push(e.remove());
        }
        self.event += 1;
        due.sort_unstable_by_key(|f| f.seq);
        let n = due.len();
        for f in due {
            self.attempt(now, f, wake);
        }
        n
    }

    /// Tries to deliver a released (or unheld) datagram and settles its SRD send.
    fn attempt(&mut self, now: Duration, f: Flight, wake: &mut Wake) {
        let Flight { seq, dg, kind } = f;
        let mut s = match kind {
            Kind::Ud { copies } => {
                for _ in 0..copies {
                    self.deliver(&dg, false, wake);
                }
                return;
            }
            Kind::Srd(s) => s,
            Kind::Rdma(op) => return self.attempt_rdma(now, seq, dg, op, wake),
        };
        let len = dg.len();
        if let Some(status) = s.doom {
            return complete(&s, status, len, wake);
        }
        let cfg = &s.sender.dev.cfg;
        let (rnr_interval, timeout) = (cfg.rnr_retry_interval, cfg.unresponsive_timeout);
        match self.deliver(&dg, s.dup, wake) {
            Outcome::Delivered => complete(&s, Status::Success, len, wake),
            Outcome::BadLength => complete(&s, Status::RemoteBadLength, len, wake),
            Outcome::NotReady => {
                inc(&s.sender.dev.counters.rnr_naks_received);
                let limit = s.sender.rnr_retry;
                if limit != RNR_INFINITE && s.rnr_retries >= limit {
                    tracing::debug!(src = ?dg.src, dest = %dg.dest, "loopback: RNR retries exceeded");
                    complete(&s, Status::RnrRetryExceeded, len, wake);
                } else {
                    s.rnr_retries = s.rnr_retries.saturating_add(1);
                    let at = now + rnr_interval;
                    let kind = Kind::Srd(s);
                    self.by_time.insert((at, seq), Flight { seq, dg, kind });
                }
            }
            Outcome::Gone(status) => {
                if timeout.is_zero() {
                    complete(&s, status, len, wake);
                } else {
                    s.doom = Some(status);
                    let kind = Kind::Srd(s);
                    self.by_time
                        .insert((now + timeout, seq), Flight { seq, dg, kind });
                }
            }
        }
    }

    /// Routes a released RDMA operation: to be applied once the network lock is released, or
    /// failed (after the unresponsive timeout) when its destination is not there.
    fn attempt_rdma(
        &mut self,
        now: Duration,
        seq: u64,
        dg: Datagram,
        mut op: Box<RdmaOp>,
        wake: &mut Wake,
    ) {
        if let Some(status) = op.doom {
            return op.complete(status, wake);
        }
        match self.route(&dg) {
            Ok(target) => {
                let target = target.clone();
                wake.defer(Deferred {
                    seq,
                    dg,
                    op,
                    target,
                });
            }
            Err(status) => {
                let timeout = op.initiator.dev.cfg.unresponsive_timeout;
                if timeout.is_zero() {
                    op.complete(status, wake);
                } else {
                    op.doom = Some(status);
                    let kind = Kind::Rdma(op);
                    self.by_time
                        .insert((now + timeout, seq), Flight { seq, dg, kind });
                }
            }
        }
    }

    /// The queue pair `dg` is for, or the status of a destination that is not there (counted on
    /// the receiving device).
    fn route(&self, dg: &Datagram) -> Result<&Arc<QpShared>, Status> {
        let Some(t) = self.qps.get(&(dg.dest.gid, dg.dest.qpn)) else {
            return match self.devices.get(&dg.dest.gid).and_then(Weak::upgrade) {
                Some(dev) => {
                    inc(&dev.counters.malformed_dropped);
                    Err(Status::UnresponsiveRemote)
                }
                None => Err(Status::UnreachableRemote),
            };
        };
        let c = &t.dev.counters;
        if t.qp_type != dg.qp_type {
            inc(&c.malformed_dropped);
            return Err(Status::UnresponsiveRemote);
        }
        if t.addr.qkey != dg.dest.qkey {
            inc(&c.stale_dropped);
            return Err(Status::UnresponsiveRemote);
        }
        Ok(t)
    }

    /// Hands `dg` to its destination queue pair, counting on the receiving device.
    fn deliver(&self, dg: &Datagram, dup: bool, wake: &mut Wake) -> Outcome {
        let t = match self.route(dg) {
            Ok(t) => t,
            Err(status) => return Outcome::Gone(status),
        };
        let c = &t.dev.counters;
        let len = dg.len();
        let mut st = t.state.lock();
        let Some((wr_id, mut buf)) = st.recvs.pop_front() else {
            inc(&c.rnr_events);
            return Outcome::NotReady;
        };
        buf.clear();
        let fits = len <= buf.capacity();
        let status = if fits {
            buf.extend_from_slice(&dg.hdr);
            buf.extend_from_slice(&dg.payload);
            inc(&c.rx_pkts);
            add(&c.rx_bytes, len as u64);
            if dup {
                inc(&c.duplicates_dropped);
            }
            Status::Success
        } else {
            Status::LocalBadLength
        };
        st.comps.push(DeviceCompletion {
            wr_id,
            status,
            opcode: Opcode::Recv,
            byte_len: len,
            src: Some(dg.src),
            imm: dg.imm,
            buf: Some(buf),
        });
        t.pending.fetch_add(1, std::sync::atomic::Ordering::Release);
        drop(st);
        wake.add(&t.notifier);
        if fits {
            Outcome::Delivered
        } else {
            Outcome::BadLength
        }
    }
}

/// Completes an SRD send with `status`.
fn complete(s: &SrdSend, status: Status, len: usize, wake: &mut Wake) {
    if !status.is_ok() {
        inc(&s.sender.dev.counters.send_errors);
    }
    s.sender.push(
        DeviceCompletion::new(s.wr_id, status, Opcode::Send, len),
        wake,
    );
}

/// Counts the faults `fate` deals an SRD transfer, which the device hides: a drop is lost on
/// the wire and retransmitted later, a duplicate is suppressed at the target. True when the
/// transfer's events wait (reordered, or retransmitted).
fn srd_faults(fate: &Fate, c: &DeviceCounters) -> bool {
    if fate.drop {
        inc(&c.faults_dropped);
        inc(&c.retransmits);
    }
    if fate.duplicate {
        inc(&c.faults_duplicated);
    }
    fate.reorder || fate.drop
}

/// Moves the flights of `map` that `mine` selects to `taken`.
fn take_flights<K: Ord + Copy>(
    map: &mut BTreeMap<K, Flight>,
    mine: impl Fn(&Flight) -> bool,
    taken: &mut Vec<Flight>,
) {
    let keys: Vec<K> = map
        .iter()
        .filter(|(_, f)| mine(f))
        .map(|(k, _)| *k)
        .collect();
    taken.extend(keys.iter().filter_map(|k| map.remove(k)));
}
