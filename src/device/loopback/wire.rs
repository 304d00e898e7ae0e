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
use crate::addr::{Gid, RawAddr};
use crate::device::{DeviceCompletion, Opcode, QpType, SendWr, Source, Status};
use crate::fault::{FaultConfig, FaultInjector};
use crate::notify::Notifier;
use crate::stats::{add, inc};

/// A reordered or retransmitted datagram is held for `1..=MAX_HOLD_EVENTS` network events.
pub(super) const MAX_HOLD_EVENTS: u64 = 16;
/// The RNR retry count that means "retry forever", as on EFA.
pub(super) const RNR_INFINITE: u8 = 7;

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

    /// Runs `f` under the network lock with the current time, then publishes the held count and
    /// signals the notifiers `f` collected, after the lock is released.
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
}

/// Notifiers to signal once the locks are released.
#[derive(Default)]
pub(super) struct Wake(Vec<Arc<Notifier>>);

impl Wake {
    pub(super) fn add(&mut self, n: &Arc<Notifier>) {
        if !self.0.iter().any(|x| Arc::ptr_eq(x, n)) {
            self.0.push(n.clone());
        }
    }

    pub(super) fn notify(self) {
        for n in self.0 {
            n.notify();
        }
    }
}

/// One datagram on the wire.
struct Datagram {
    src: Source,
    dest: RawAddr,
    qp_type: QpType,
    hdr: Bytes,
    payload: Bytes,
    imm: Option<u32>,
}

impl Datagram {
    fn len(&self) -> usize {
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

    /// Removes `qp` from the routing table and takes back its SRD sends still held by the network;
    /// returns their `(wr_id, byte_len)` in transmission order, for `Flushed` completions.
    pub(super) fn detach_qp(&mut self, qp: &Arc<QpShared>) -> Vec<(u64, usize)> {
        let key = (qp.addr.gid, qp.addr.qpn);
        if self.qps.get(&key).is_some_and(|e| Arc::ptr_eq(e, qp)) {
            self.qps.remove(&key);
        }
        let mut taken = Vec::new();
        let mut keep = |f: &Flight| match &f.kind {
            Kind::Srd(s) if Arc::ptr_eq(&s.sender, qp) => {
                taken.push((f.seq, s.wr_id, f.dg.len()));
                false
            }
            _ => true,
        };
        self.by_event.retain(|_, f| keep(f));
        self.by_time.retain(|_, f| keep(f));
        taken.sort_unstable_by_key(|t| t.0);
        taken.into_iter().map(|(_, w, l)| (w, l)).collect()
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
                if fate.drop {
                    // Lost on the wire; the device's retransmission arrives later.
                    inc(&c.faults_dropped);
                    inc(&c.retransmits);
                    hold_events = true;
                }
                if fate.duplicate {
                    inc(&c.faults_duplicated);
                }
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
                src: Source {
                    gid: sender.addr.gid,
                    qpn: sender.addr.qpn,
                },
                dest: wr.dest,
                qp_type: sender.qp_type,
                hdr: wr.hdr,
                payload: wr.payload,
                imm: wr.imm,
            },
            kind,
        };
        if fate.reorder || !fate.delay.is_zero() {
            inc(&c.faults_reordered);
        }
        if !fate.delay.is_zero() {
            self.by_time.insert((now + fate.delay, seq), flight);
        } else if hold_events {
            let k = 1 + self.faults.rng().below(MAX_HOLD_EVENTS);
            self.by_event.insert((self.event + k, seq), flight);
        } else {
            self.attempt(now, flight, wake);
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

    /// Hands `dg` to its destination queue pair, counting on the receiving device.
    fn deliver(&self, dg: &Datagram, dup: bool, wake: &mut Wake) -> Outcome {
        let Some(t) = self.qps.get(&(dg.dest.gid, dg.dest.qpn)) else {
            return match self.devices.get(&dg.dest.gid).and_then(Weak::upgrade) {
                Some(dev) => {
                    inc(&dev.counters.malformed_dropped);
                    Outcome::Gone(Status::UnresponsiveRemote)
                }
                None => Outcome::Gone(Status::UnreachableRemote),
            };
        };
        let c = &t.dev.counters;
        if t.qp_type != dg.qp_type {
            inc(&c.malformed_dropped);
            return Outcome::Gone(Status::UnresponsiveRemote);
        }
        if t.addr.qkey != dg.dest.qkey {
            inc(&c.stale_dropped);
            return Outcome::Gone(Status::UnresponsiveRemote);
        }
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
        st.comps.push_back(DeviceCompletion {
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
