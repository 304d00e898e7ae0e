//! A simulated network for the udp device's protocol side ([`Link`]): hosts whose queue pairs
//! have no socket and no thread, a seeded network that drops, duplicates, delays and reorders
//! datagrams, and virtual time. As `proto::sim` does for the engine, it lets the SRD rules
//! (acknowledgements, retransmission, RNR, the unresponsive-peer timeout, one-sided RDMA over
//! them) be tested under faults, quickly and the same way every run of a seed.
//!
//! A host's link is driven as the queue pair drives it: datagrams are handed to
//! [`Link::handle`], then the due acknowledgements are flushed (at random either as the polling
//! application does, which lets them wait briefly for data to ride on, or as the NIC thread
//! does, at once), and timers run when due. What a link queues goes on the network at the next
//! step; the network never refuses a datagram (the socket side's refusals are tested in
//! `qp/tests.rs`). The links draw their SRD connection numbers from the seed too, so a seed
//! replays a run exactly.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::UdpConfig;
use super::link::{Link, LinkAttr};
use crate::addr::{Gid, RawAddr};
use crate::device::queues::WrSlots;
use crate::device::soft_rdma::{KeyTable, Local, RdmaOps};
use crate::device::{DeviceCompletion, QpType, RemoteIov, SendWr};
use crate::error::Result;
use crate::fault::Rng;
use crate::mem::RegionSlice;
use crate::stats::DeviceCounters;

/// The network's behaviour: every datagram is dropped with probability `drop`, else sent
/// twice with probability `duplicate`, and each copy arrives `latency` plus a random share of
/// `jitter` later (copies whose delays cross arrive reordered).
#[derive(Clone, Debug)]
pub(super) struct NetConfig {
    pub seed: u64,
    pub drop: f64,
    pub duplicate: f64,
    pub latency: Duration,
    pub jitter: Duration,
}

impl NetConfig {
    /// A network that loses, duplicates and reorders nothing.
    pub fn clean(seed: u64) -> NetConfig {
        NetConfig {
            seed,
            drop: 0.0,
            duplicate: 0.0,
            latency: Duration::from_micros(20),
            jitter: Duration::ZERO,
        }
    }

    /// A network that loses a tenth of the datagrams, duplicates one in twenty and reorders
    /// many (the jitter is ten times the latency).
    pub fn faulty(seed: u64) -> NetConfig {
        NetConfig {
            seed,
            drop: 0.1,
            duplicate: 0.05,
            latency: Duration::from_micros(20),
            jitter: Duration::from_micros(200),
        }
    }
}

/// What the network did, over the whole run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct NetStats {
    /// Datagrams the links put on the network.
    pub sent: u64,
    pub dropped: u64,
    pub duplicated: u64,
    /// Copies handed to a link.
    pub delivered: u64,
    /// Copies for an address no live host has.
    pub lost: u64,
}

/// A one-sided operation ([`Net::rdma`]).
pub(super) enum RdmaOp {
    /// `(wr_id, local bytes, remote range, immediate data)`.
    Write(u64, Bytes, RemoteIov, Option<u32>),
    /// `(wr_id, local buffer, remote range)`.
    Read(u64, BytesMut, RemoteIov),
    /// `(wr_id, local slice of a registered region, remote range, immediate data)`: sent from
    /// the region as it goes out.
    WriteRegion(u64, RegionSlice, RemoteIov, Option<u32>),
}

/// A datagram on its way.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Flight {
    at: Duration,
    /// Tie-break: the order copies were put on the network.
    n: u64,
    to: SocketAddr,
    from: SocketAddr,
    bytes: Vec<u8>,
}

/// One simulated queue pair.
pub(super) struct Host {
    pub link: Link,
    pub addr: SocketAddr,
    pub counters: Arc<DeviceCounters>,
    slots: WrSlots,
    /// A vanished host neither sends nor receives.
    up: bool,
    /// The network loses this many of the host's next datagrams ([`Net::lose_next`]).
    lose: usize,
    /// Descheduled until then ([`Net::pause`]): it handles nothing, its datagrams wait.
    paused_until: Duration,
}

/// The network, its hosts and the virtual clock.
pub(super) struct Net {
    cfg: NetConfig,
    rng: Rng,
    start: Instant,
    now: Duration,
    hosts: Vec<Host>,
    air: BinaryHeap<Reverse<Flight>>,
    n: u64,
    pub stats: NetStats,
}

impl Net {
    pub fn new(cfg: NetConfig) -> Net {
        Net {
            rng: Rng::new(cfg.seed),
            cfg,
            start: Instant::now(),
            now: Duration::ZERO,
            hosts: Vec::new(),
            air: BinaryHeap::new(),
            n: 0,
            stats: NetStats::default(),
        }
    }

    /// Adds a host with a queue pair of `qp_type` on a device configured by `udp` (its bind
    /// address and fault layer are ignored: every host is `127.0.0.1`, on its own port, and
    /// the network makes the faults). Returns its index.
    pub fn add(&mut self, udp: &UdpConfig, qp_type: QpType, rnr_retry: u8) -> usize {
        self.add_host(udp, qp_type, rnr_retry, None)
    }

    /// Adds a host with an SRD queue pair that serves RDMA on the regions of `keys` (and
    /// retries receiver-not-ready forever); returns its index.
    pub fn add_rdma(&mut self, udp: &UdpConfig, keys: KeyTable) -> usize {
        self.add_host(udp, QpType::Srd, 7, Some(keys))
    }

    fn add_host(
        &mut self,
        udp: &UdpConfig,
        qp_type: QpType,
        rnr_retry: u8,
        keys: Option<KeyTable>,
    ) -> usize {
        let i = self.hosts.len();
        let mut udp = udp.clone();
        udp.faults = Default::default();
        let counters = Arc::new(DeviceCounters::default());
        let mut link = Link::new(
            Arc::new(udp.clone()),
            counters.clone(),
            LinkAttr {
                qp_type,
                qkey: 0x1000 + i as u32,
                rnr_retry,
                v6: false,
                keys,
                unsolicited_write_recv: false,
            },
            self.now(),
        );
        link.srd.seed_ids(self.cfg.seed ^ (i as u64 + 1));
        self.hosts.push(Host {
            link,
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10_000 + i as u16),
            counters,
            slots: WrSlots::new(udp.max_send_wr, udp.max_recv_wr),
            up: true,
            lose: 0,
            paused_until: Duration::ZERO,
        });
        i
    }

    /// The virtual time.
    pub fn now(&self) -> Instant {
        self.start + self.now
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now
    }

    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// The address other hosts send to, to reach host `i`.
    pub fn addr(&self, i: usize) -> RawAddr {
        let h = &self.hosts[i];
        RawAddr::new(Gid::from_ip(h.addr.ip()), h.addr.port(), h.link.ctx.qkey)
    }

    /// Posts a send on host `i`, as the queue pair's `post_send` does.
    pub fn post_send(&mut self, i: usize, wr: SendWr) -> Result<()> {
        let now = self.now();
        let h = &mut self.hosts[i];
        h.slots.take_send("post_send")?;
        h.link.post_send(wr, now);
        Ok(())
    }

    /// Starts an RDMA operation towards `dest` on host `i`, as the queue pair's `post_write`
    /// and `post_read` do.
    pub fn rdma(&mut self, i: usize, dest: RawAddr, op: RdmaOp) -> Result<()> {
        let now = self.now();
        let h = &mut self.hosts[i];
        h.slots.take_send("post_rdma")?;
        let r = h.link.start_rdma(
            now,
            |cx, to, chunk| match op {
                RdmaOp::Write(wr_id, local, remote, imm) => {
                    cx.rdma_write(wr_id, to, dest, Local::Bytes(local), remote, imm, chunk)
                }
                RdmaOp::Read(wr_id, local, remote) => cx.rdma_read(wr_id, to, dest, local, remote),
                RdmaOp::WriteRegion(wr_id, local, remote, imm) => {
                    cx.rdma_write(wr_id, to, dest, Local::Region(local), remote, imm, chunk)
                }
            },
            &dest,
        );
        if r.is_err() {
            h.slots.release_send();
        }
        r
    }

    /// Posts a receive buffer on host `i`.
    pub fn post_recv(&mut self, i: usize, wr_id: u64, buf: BytesMut) -> Result<()> {
        let h = &mut self.hosts[i];
        h.slots.take_recv()?;
        h.link.ctx.recvs.push_back((wr_id, buf));
        Ok(())
    }

    /// Takes host `i`'s completions.
    pub fn poll(&mut self, i: usize) -> Vec<DeviceCompletion> {
        let h = &mut self.hosts[i];
        let mut out = Vec::new();
        h.link.ctx.cq.poll_into(&mut h.slots, &mut out, usize::MAX);
        out
    }

    /// Host `i` speaks the wire from before packed datagrams: it drops them as an unknown type
    /// and never sends one (nor asks whether its peers unpack).
    pub fn old_wire(&mut self, i: usize) {
        let h = &mut self.hosts[i];
        h.link.old_wire = true;
        let mut cfg = (*h.link.ctx.cfg).clone();
        cfg.pack = false;
        h.link.ctx.cfg = Arc::new(cfg);
    }

    /// Host `i` vanishes: it stops sending, receiving and running timers, without a word.
    pub fn vanish(&mut self, i: usize) {
        self.hosts[i].up = false;
        self.hosts[i].link.ctx.out.clear();
    }

    /// Host `i`'s queue pair takes QKEY `qkey` (as `modify_qp` does on the emulated NIC).
    pub fn set_qkey(&mut self, i: usize, qkey: u32) {
        self.hosts[i].link.set_qkey(qkey);
    }

    /// The network loses the next `n` datagrams host `i` sends (besides its random losses).
    pub fn lose_next(&mut self, i: usize, n: usize) {
        self.hosts[i].lose = n;
    }

    /// Host `i` is descheduled for `d` (a busy machine): it handles no datagram and runs no
    /// timer until then; what arrives meanwhile waits (in its socket buffer) and is handled,
    /// in order, when it runs again.
    pub fn pause(&mut self, i: usize, d: Duration) {
        self.hosts[i].paused_until = self.now + d;
    }

    /// Hands `bytes` to host `i` as if they came from `from` (a hostile or broken peer).
    pub fn inject(&mut self, i: usize, from: SocketAddr, bytes: &[u8]) {
        let now = self.now();
        self.hosts[i].link.handle(bytes, from, now);
    }

    /// Puts what the links queued on the network.
    fn launch(&mut self) {
        for h in &mut self.hosts {
            let out = &mut h.link.ctx.out;
            for q in out.queued() {
                self.stats.sent += 1;
                if h.lose > 0 {
                    h.lose -= 1;
                    self.stats.dropped += 1;
                    continue;
                }
                if self.rng.chance(self.cfg.drop) {
                    self.stats.dropped += 1;
                    continue;
                }
                let copies = if self.rng.chance(self.cfg.duplicate) {
                    self.stats.duplicated += 1;
                    2
                } else {
                    1
                };
                let mut bytes = [out.head(q), &q.hdr[..], &q.payload[..]].concat();
                if let Some(r) = &q.region {
                    // Read at transmission, as the queue pair's sender does; locked: lost.
                    let Some(g) = r.try_read() else {
                        self.stats.dropped += 1;
                        continue;
                    };
                    bytes.extend_from_slice(&g);
                }
                for _ in 0..copies {
                    let jitter = self.cfg.jitter.as_nanos() as u64;
                    let extra = if jitter == 0 {
                        0
                    } else {
                        self.rng.below(jitter)
                    };
                    self.n += 1;
                    self.air.push(Reverse(Flight {
                        at: self.now + self.cfg.latency + Duration::from_nanos(extra),
                        n: self.n,
                        to: q.dest,
                        from: h.addr,
                        bytes: bytes.clone(),
                    }));
                }
            }
            out.clear();
        }
    }

    /// When the next thing happens: a datagram arrives or a live host's timer is due.
    fn next_event(&mut self) -> Option<Duration> {
        let mut next = self.air.peek().map(|f| f.0.at);
        for h in self.hosts.iter_mut().filter(|h| h.up) {
            if let Some(d) = h.link.next_deadline() {
                let d = d
                    .saturating_duration_since(self.start)
                    .max(self.now)
                    .max(h.paused_until);
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        next
    }

    /// Advances to the next event and handles everything due then; false when nothing is left
    /// to happen.
    pub fn step(&mut self) -> bool {
        self.launch();
        let Some(at) = self.next_event() else {
            return false;
        };
        self.now = self.now.max(at);
        let now = self.now();
        let mut touched = vec![false; self.hosts.len()];
        let mut waiting = Vec::new();
        while self.air.peek().is_some_and(|f| f.0.at <= self.now) {
            let Some(Reverse(f)) = self.air.pop() else {
                break;
            };
            let to = self.hosts.iter().position(|h| h.up && h.addr == f.to);
            let Some(to) = to else {
                self.stats.lost += 1;
                continue;
            };
            if self.hosts[to].paused_until > self.now {
                // Queued in the socket until the host runs (keeping its place: `n`).
                waiting.push(Flight {
                    at: self.hosts[to].paused_until,
                    ..f
                });
                continue;
            }
            self.stats.delivered += 1;
            self.hosts[to].link.handle(&f.bytes, f.from, now);
            touched[to] = true;
        }
        self.air.extend(waiting.into_iter().map(Reverse));
        for (i, h) in self.hosts.iter_mut().enumerate() {
            if !h.up || h.paused_until > self.now {
                continue;
            }
            if touched[i] {
                let as_nic = self.rng.chance(0.5);
                h.link.flush_acks(now, as_nic);
            }
            if h.link.next_deadline().is_some_and(|d| d <= now) {
                h.link.run_timers(now);
            }
        }
        true
    }

    /// Steps until `done` holds (true) or `limit` of virtual time passed or nothing is left to
    /// happen (false).
    pub fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&mut Net) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            if done(self) {
                return true;
            }
            if self.now >= end || !self.step() {
                return done(self);
            }
        }
    }
}

#[cfg(test)]
mod tests;
