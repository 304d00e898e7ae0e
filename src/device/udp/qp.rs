//! A udp queue pair: its socket, its shared state, its background "NIC" thread and the
//! [`QueuePair`] handle.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;

use crate::progress::Background;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use mio::net::UdpSocket;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;

use super::UdpConfig;
use super::link::{Ctx, Link, LinkAttr, Outbox, Queued, Tag};
use super::mmsg;
use crate::addr::{Gid, RawAddr};
use crate::device::queues::WrSlots;
use crate::device::soft_rdma::{KeyTable, Local, RdmaOps};
use crate::device::{
    DeviceCompletion, QpAttr, QpType, QueuePair, RdmaKind, RdmaWr, SendWr, Source, fmt_qp,
    random_qkey, rdma_posts_by_wr,
};
use crate::error::{Error, ErrorKind, Result};
use crate::notify::{Notifier, SleepHook};
use crate::stats::{self, DeviceCounters};

const SOCK: Token = Token(0);
const WAKE: Token = Token(1);
/// Receive scratch buffer: large enough for any UDP datagram.
const RX_SCRATCH: usize = 65_536;
/// Datagrams one `recvmmsg` reads at most (each in a buffer of [`RX_SCRATCH`] bytes).
const RX_BATCH: usize = 8;
/// Datagrams one application `poll` reads at most.
const APP_BUDGET: usize = 64;
/// Datagrams the NIC thread reads before it looks at its timers again.
const NIC_BUDGET: usize = 1024;
/// Datagrams read before pending SRD acknowledgements go out, within one batch.
const ACK_BATCH: usize = 32;
/// After an application poll read datagrams and emptied the socket, its polls leave the socket
/// alone this long: the application is busy with what arrived (and its reply should not wait
/// for a few more empty reads), and the next datagram is unlikely to be there already.
const RX_QUIET: Duration = Duration::from_micros(4);
/// A queue pair whose socket brought nothing for this long, with nothing of its own in flight
/// (no unacknowledged packet, no delayed acknowledgement, no RDMA), is cold: the application's
/// polls read its socket only every [`COLD_READ_EVERY`]. An empty read is a system call (about
/// half a microsecond), which a routed queue pair would otherwise pay on every poll although its
/// same-host peers never use the socket.
const COLD_AFTER: Duration = Duration::from_micros(200);
/// How often the application's polls read a cold queue pair's socket: what a datagram to an idle
/// queue pair may wait at most (the NIC thread, when the application sleeps, waits on the
/// socket itself and is never late).
const COLD_READ_EVERY: Duration = Duration::from_micros(5);
/// Of the application's polls of a cold queue pair, one in this many runs its progress (reads
/// the clock, runs timers, maybe reads the socket); the others only take completions.
const COLD_POLLS: u32 = 16;
/// The application counts as busy-polling for this long after its last `poll`: meanwhile the NIC
/// thread stands aside (parked, not waiting on the socket), and takes over when it passes or when
/// the application goes to sleep on its notifier. Every check costs the NIC thread a wake-up
/// (which, on a small machine, preempts a busy-polling thread), so it is long; it bounds how late
/// progress resumes when an application stops polling without waiting on its notifier (the NIC
/// thread's timers had millisecond granularity before too).
const BUSY_WINDOW: Duration = Duration::from_millis(1);
/// As [`BUSY_WINDOW`] when the application's last poll left delayed acknowledgements behind:
/// short enough that they reach the peer before its smallest retransmission timeout (300 µs by
/// default) even if the application stopped polling right then.
const ACK_GUARD_WINDOW: Duration = Duration::from_micros(150);

/// What sends an outbox's datagrams on the socket: GSO and `sendmmsg` batching, and the
/// failures the kernel reports.
pub(super) struct Sender {
    /// The messages of a send: ranges of the outbox's datagrams (several datagrams: one GSO
    /// message).
    groups: Vec<std::ops::Range<usize>>,
    /// The destinations of the datagrams, as socket addresses.
    dests: Vec<socket2::SockAddr>,
    scratch: mmsg::SendScratch,
    /// Largest datagram sent in GSO messages (`UDP_SEGMENT`); 0: GSO off. Lowered when the
    /// kernel refuses a GSO message.
    gso_limit: usize,
    /// Datagrams the kernel refused for good (not a transient loss), for their owners to fail.
    failed: Vec<Tag>,
    /// Unit tests: `(errno, n)` makes every `n`-th datagram's send fail with `errno`, as if the
    /// kernel had refused it.
    #[cfg(test)]
    pub inject: Option<(i32, u64, u64)>,
}

/// A send failure that is a loss on the wire, for SRD to recover from by retransmission (until
/// the unresponsive-peer timeout), never a failed work request: a full socket buffer (`EAGAIN`,
/// `ENOBUFS`, `ENOMEM`), a firewall dropping the datagram on its way out (`EPERM`), and errors
/// an earlier ICMP message left on the socket or a route that is down for now (`ECONNREFUSED`,
/// `EHOSTUNREACH`, `ENETUNREACH`, `EHOSTDOWN`, `ENETDOWN`, `ECONNRESET`). Permanent ones —
/// an address of the wrong family, a broadcast address without `SO_BROADCAST` (`EACCES`), a
/// datagram too large — fail the work request.
pub(super) fn transient(e: &io::Error) -> bool {
    if matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted | io::ErrorKind::OutOfMemory
    ) {
        return true;
    }
    matches!(
        e.raw_os_error(),
        Some(
            libc::EAGAIN
                | libc::EINTR
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::EPERM
                | libc::ECONNREFUSED
                | libc::EHOSTUNREACH
                | libc::ENETUNREACH
                | libc::EHOSTDOWN
                | libc::ENETDOWN
                | libc::ECONNRESET
        )
    )
}

/// A transient send failure (full socket buffer, ...) counts as a loss on the wire.
fn lost_if_transient(r: io::Result<usize>, dest: SocketAddr) -> io::Result<()> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if transient(&e) => {
            tracing::trace!(%dest, error = %e, "udp: datagram lost in the local stack");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// One datagram by itself: a plain `sendto` when it is in one piece, else one `sendmsg`
/// gathering its parts (so that user bytes are not copied into a staging buffer). Transient
/// failures are losses on the wire; an error is permanent.
fn send_one(sock: &UdpSocket, head: &[u8], q: &Queued) -> io::Result<()> {
    let region = match &q.region {
        None => None,
        Some(r) => match r.try_read() {
            Some(g) => Some(g),
            None => {
                // Locked for writing right now: a loss on the wire, which SRD repairs.
                tracing::trace!(dest = %q.dest, "udp: region locked, datagram lost");
                return Ok(());
            }
        },
    };
    let r = if q.hdr.is_empty() && q.payload.is_empty() && region.is_none() {
        sock.send_to(head, q.dest)
    } else {
        let parts = [
            io::IoSlice::new(head),
            io::IoSlice::new(&q.hdr),
            io::IoSlice::new(&q.payload),
            io::IoSlice::new(region.as_deref().unwrap_or_default()),
        ];
        socket2::SockRef::from(sock).send_to_vectored(&parts, &q.dest.into())
    };
    lost_if_transient(r, q.dest)
}

impl Sender {
    fn new(gso: bool) -> Sender {
        Sender {
            groups: Vec::new(),
            dests: Vec::new(),
            scratch: mmsg::SendScratch::default(),
            gso_limit: if gso { mmsg::GSO_MAX_BYTES } else { 0 },
            failed: Vec::new(),
            #[cfg(test)]
            inject: None,
        }
    }

    /// Sends every datagram of `out` and empties it: a lone one with one system call, more with
    /// one `sendmmsg` per [`mmsg::MAX_BATCH`] messages. Returns the datagrams the kernel refused
    /// for good, for their owners to fail (transient refusals are losses on the wire).
    fn send(&mut self, sock: &UdpSocket, out: &mut Outbox) -> Vec<Tag> {
        #[cfg(test)]
        if self.inject.is_some() {
            self.send_injected(sock, out);
            out.clear();
            return std::mem::take(&mut self.failed);
        }
        match out.queued() {
            [] => {}
            [q] => {
                if let Err(e) = send_one(sock, out.head(q), q) {
                    tracing::debug!(dest = %q.dest, error = %e, "udp: send failed");
                    self.failed.extend_from_slice(out.tags(q));
                }
            }
            _ => self.send_batch(sock, out),
        }
        out.clear();
        std::mem::take(&mut self.failed)
    }

    /// Unit tests: [`Sender::send`], one datagram at a time, every `n`-th refused as if by the
    /// kernel (see [`Sender::inject`]).
    #[cfg(test)]
    fn send_injected(&mut self, sock: &UdpSocket, out: &Outbox) {
        for q in out.queued() {
            if let Some((errno, every, count)) = self.inject.as_mut() {
                *count += 1;
                if *count % *every == 0 {
                    let e = io::Error::from_raw_os_error(*errno);
                    if !transient(&e) {
                        self.failed.extend_from_slice(out.tags(q));
                    }
                    continue;
                }
            }
            if send_one(sock, out.head(q), q).is_err() {
                self.failed.extend_from_slice(out.tags(q));
            }
        }
    }

    /// Sends several datagrams: runs of datagrams to one address, all of one size but the last
    /// (which may be shorter), become one GSO message the kernel cuts; the others go alone.
    fn send_batch(&mut self, sock: &UdpSocket, out: &Outbox) {
        let Sender {
            groups,
            dests,
            scratch,
            gso_limit,
            failed,
            ..
        } = self;
        let queued = out.queued();
        dests.clear();
        dests.extend(queued.iter().map(|q| socket2::SockAddr::from(q.dest)));
        // Region bytes are read under the region's read lock, held until the kernel copied them
        // (the end of this function): no writer can touch them meanwhile. A region locked for
        // writing right now makes its datagram a loss on the wire (SRD repairs it).
        let regions: Vec<Option<Option<crate::mem::ReadGuard<'_>>>> = queued
            .iter()
            .map(|q| q.region.as_ref().map(|r| r.try_read()))
            .collect();
        let locked = |i: usize| matches!(regions.get(i), Some(Some(None)));
        groups.clear();
        let mut i = 0;
        while i < queued.len() {
            if locked(i) {
                tracing::trace!("udp: region locked, datagram lost");
                i += 1;
                continue;
            }
            let first = &queued[i];
            let seg = first.len();
            let mut end = i + 1;
            let mut total = seg;
            if seg <= *gso_limit {
                while let Some(q) = queued.get(end) {
                    let len = q.len();
                    let prev_full = queued.get(end - 1).is_some_and(|p| p.len() == seg);
                    if q.dest != first.dest
                        || locked(end)
                        || !prev_full
                        || len > seg
                        || end - i >= mmsg::GSO_MAX_SEGS
                        || total + len > mmsg::GSO_MAX_BYTES
                    {
                        break;
                    }
                    total += len;
                    end += 1;
                }
            }
            groups.push(i..end);
            i = end;
        }
        let mut batch = scratch.batch();
        for g in groups.iter() {
            let (Some(first), Some(dest)) = (queued.get(g.start), dests.get(g.start)) else {
                continue;
            };
            let seg = (g.len() > 1).then(|| first.len() as u16);
            batch.message(dest, seg);
            for (k, q) in g.clone().zip(queued.get(g.clone()).unwrap_or_default()) {
                batch.part(out.head(q));
                batch.part(&q.hdr);
                batch.part(&q.payload);
                if let Some(Some(Some(r))) = regions.get(k) {
                    batch.part(r);
                }
            }
        }
        let mut m = 0;
        let mut calls = 0;
        while m < batch.len() {
            calls += 1;
            match batch.send(sock, m) {
                Ok(k) => m += k.max(1),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The socket buffer is full: what is left is lost on the wire.
                    tracing::trace!(left = batch.len() - m, "udp: batch lost in the local stack");
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let g = groups.get(m).cloned().unwrap_or_default();
                    if transient(&e) {
                        tracing::trace!(error = %e, "udp: datagram lost in the local stack");
                    } else if g.len() > 1 {
                        // The kernel (or the route's MTU) refuses GSO messages this large: no
                        // more of them, and these datagrams go one by one.
                        let seg = queued.get(g.start).map_or(0, Queued::len);
                        tracing::debug!(error = %e, seg, "udp: GSO refused, sending one by one");
                        *gso_limit = (*gso_limit).min(seg.saturating_sub(1));
                        for q in queued.get(g).unwrap_or_default() {
                            if send_one(sock, out.head(q), q).is_err() {
                                failed.extend_from_slice(out.tags(q));
                            }
                        }
                    } else {
                        tracing::debug!(error = %e, "udp: send failed");
                        if let Some(q) = queued.get(g.start) {
                            failed.extend_from_slice(out.tags(q));
                        }
                    }
                    m += 1;
                }
            }
        }
        stats::add(&out.counters.tx_batches, calls);
    }
}

/// Everything behind the queue pair's lock: the protocol state and the socket it runs on.
pub(super) struct State {
    link: Link,
    sock: UdpSocket,
    sender: Sender,
    closed: bool,
    /// Work requests posted and not yet reaped by `poll`, against the depths.
    slots: WrSlots,
    /// The socket takes coalesced datagrams (`UDP_GRO`): every read needs its control message.
    gro: bool,
    /// The receive buffer of single reads (taken out while a drain runs).
    rx: Option<mmsg::RxBatch>,
    /// Receive buffers for `recvmmsg`, allocated when the first burst arrives (a queue pair
    /// that only ever sees one datagram at a time does not pay for them).
    rx_batch: Option<mmsg::RxBatch>,
    /// When the NIC thread will wake up by itself (`None`: only on a datagram or a wake-up).
    thread_deadline: Option<Instant>,
    /// The application's polls do not read the socket before this (see [`RX_QUIET`]).
    quiet_until: Option<Instant>,
    /// The last read of the socket found it empty.
    idle: bool,
    /// [`COLD_AFTER`] after a datagram was last read or work was last posted (kept as the
    /// instant itself: every poll compares, and a comparison costs less than a subtraction).
    cold_at: Instant,
    /// The application's polls do not read a cold socket before this (see [`COLD_READ_EVERY`]).
    cold_next: Option<Instant>,
}

impl State {
    /// Reads up to `budget` datagrams; true when more may be waiting. `nic`: called by the NIC
    /// thread (the application is not polling), so acknowledgements go out at once instead of
    /// waiting briefly for a data packet to ride on.
    ///
    /// A cold queue pair's socket is read every [`COLD_READ_EVERY`], or, while the NIC thread
    /// watches it for the application (`watch`), only once the thread saw it readable.
    fn drain(&mut self, budget: usize, now: Instant, nic: bool, watch: &ColdWatch) -> bool {
        if !nic && self.quiet_until.is_some_and(|q| now < q) {
            return false;
        }
        if !nic && self.cold(now) {
            let ready = watch.ready.load(Ordering::Acquire);
            if !ready
                && (watch.watching.load(Ordering::Acquire)
                    || self.cold_next.is_some_and(|t| now < t))
            {
                self.cold_next.get_or_insert(now + COLD_READ_EVERY);
                return false;
            }
            self.cold_next = Some(now + COLD_READ_EVERY);
        } else {
            self.cold_next = None;
        }
        // What the NIC thread saw is read now (a datagram after this store raises it again).
        if watch.ready.load(Ordering::Relaxed) {
            watch.ready.store(false, Ordering::Release);
        }
        let mut one = self.rx.take();
        let mut burst = self.rx_batch.take();
        let mut n = 0;
        let mut more = false;
        // A datagram after an empty socket is most likely a request or a reply by itself: the
        // application gets it at once, without another (empty) read first; a burst is read on
        // after the quiet time. (The NIC thread always reads until the socket is empty, as its
        // edge-triggered wait needs.)
        let lone = !nic && self.idle;
        let mut reads = 0;
        loop {
            if n >= budget {
                more = true;
                break;
            }
            // Bursts are read with one `recvmmsg` per `RX_BATCH` datagrams, once one came;
            // single datagrams into the one buffer.
            let use_burst = !lone && burst.is_some();
            let b = if use_burst {
                burst.as_mut()
            } else {
                one.as_mut()
            };
            let Some(b) = b else {
                break;
            };
            let want = (budget - n).min(b.slots());
            // Without `UDP_GRO` a single read is a plain `recvfrom` (cheaper than a
            // `recvmmsg` of one, which the latency of a lone datagram feels).
            let r = if use_burst || self.gro {
                mmsg::recv_batch(&self.sock, b, want)
            } else {
                b.recv_plain(&self.sock)
            };
            match r {
                Ok(k) => {
                    reads += k;
                    if k > 1 {
                        stats::inc(&self.link.ctx.counters().rx_batches);
                    }
                    for i in 0..k {
                        let Some(m) = b.got.get(i).copied() else {
                            break;
                        };
                        let Some(src) = m.src.filter(|_| !m.truncated) else {
                            n += 1;
                            stats::inc(&self.link.ctx.counters().malformed_dropped);
                            tracing::debug!(?m, "udp: dropped a cut-off or non-IP datagram");
                            continue;
                        };
                        if m.seg != 0 {
                            stats::inc(&self.link.ctx.counters().rx_batches);
                        }
                        for d in b.datagrams(i) {
                            n += 1;
                            self.link.handle(d, src, now);
                            if n % ACK_BATCH == 0 {
                                self.link.flush_acks(now, nic);
                            }
                            if self.link.ctx.out.len() >= mmsg::MAX_BATCH {
                                self.send_out(now);
                            }
                        }
                    }
                    if lone || k < want {
                        // One read for a lone datagram; fewer than asked: the socket is empty.
                        break;
                    }
                    if reads >= 2 && burst.is_none() {
                        // Bursts come to this queue pair: read them in batches from now on.
                        burst = Some(mmsg::RxBatch::new(RX_SCRATCH, RX_BATCH));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if reads == 0 {
                        stats::inc(&self.link.ctx.counters().rx_empty_reads);
                    }
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // E.g. a queued ICMP error; it is consumed by reading it.
                    n += 1;
                    tracing::debug!(error = %e, "udp: receive error");
                }
            }
        }
        self.rx = one;
        self.rx_batch = burst;
        self.link.flush_acks(now, nic);
        self.idle = n == 0;
        if n > 0 {
            self.cold_at = now + COLD_AFTER;
        }
        self.quiet_until = (n > 0 && !more).then(|| now + RX_QUIET);
        more || (lone && n > 0)
    }

    /// Work was posted at `now`: the queue pair is warm.
    fn warm(&mut self, now: Instant) {
        self.cold_at = now + COLD_AFTER;
        self.cold_next = None;
    }

    /// True when nothing came for [`COLD_AFTER`] and nothing of this queue pair is in flight.
    fn cold(&mut self, now: Instant) -> bool {
        now >= self.cold_at && self.link.next_deadline().is_none()
    }

    /// Sends what the protocol queued, and fails the work requests whose datagrams the kernel
    /// refused for good (which may queue more: the next pending sends).
    fn send_out(&mut self, now: Instant) {
        while !self.link.ctx.out.is_empty() {
            for tag in self.sender.send(&self.sock, &mut self.link.ctx.out) {
                self.link.send_failed(tag, now);
            }
        }
    }

    /// Starts an RDMA write or read (`post_write` / `post_read`).
    fn post_rdma(
        &mut self,
        now: Instant,
        start: impl FnOnce(&mut Ctx, Option<SocketAddr>, usize) -> Result<()>,
        dest: &RawAddr,
        op: &'static str,
    ) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, op));
        }
        if self.link.qp_type != QpType::Srd || self.link.ctx.rdma.keys.is_none() {
            return Err(Error::new(ErrorKind::NotSupported, op)
                .with_detail("RDMA needs an SRD queue pair on a device with RDMA"));
        }
        self.slots.take_send(op)?;
        self.warm(now);
        if let Err(e) = self.link.start_rdma(now, start, dest) {
            self.slots.release_send();
            return Err(e);
        }
        Ok(())
    }

    /// Starts one RDMA operation of a list (its datagrams go out at the caller's
    /// [`State::send_out`]).
    fn post_rdma_wr(&mut self, now: Instant, wr: RdmaWr) -> Result<()> {
        let RdmaWr { wr_id, dest, kind } = wr;
        match kind {
            RdmaKind::Write { local, remote, imm } => self.post_rdma(
                now,
                |cx, to, chunk| {
                    cx.rdma_write(wr_id, to, dest, Local::Bytes(local), remote, imm, chunk)
                },
                &dest,
                "post_write",
            ),
            RdmaKind::WriteRegion { local, remote, imm } => {
                let held = self
                    .link
                    .ctx
                    .rdma
                    .keys
                    .as_ref()
                    .is_some_and(|k| k.lock().holds(&local));
                if !held {
                    return Err(Error::new(ErrorKind::InvalidArgument, "post_write_region")
                        .with_detail("the slice is not inside a live registration of its key"));
                }
                self.post_rdma(
                    now,
                    |cx, to, chunk| {
                        cx.rdma_write(wr_id, to, dest, Local::Region(local), remote, imm, chunk)
                    },
                    &dest,
                    "post_write_region",
                )
            }
            RdmaKind::Read { local, remote } => self.post_rdma(
                now,
                |cx, to, _| cx.rdma_read(wr_id, to, dest, local, remote),
                &dest,
                "post_read",
            ),
            RdmaKind::ReadRegion { .. } => {
                Err(Error::new(ErrorKind::NotSupported, "post_rdma_list")
                    .with_detail("the udp device reads into bytes, not into regions"))
            }
        }
    }

    /// Checks and takes the slot of a send, and hands it to the protocol; what it queues goes
    /// out at the caller's [`State::send_out`].
    fn post_send(&mut self, wr: SendWr, now: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "post_send"));
        }
        // A reply may follow (a datagram queue pair has no acknowledgement to keep it warm).
        self.warm(now);
        let len = wr.len();
        let mtu = self.link.ctx.cfg.mtu;
        if len > mtu {
            return Err(Error::new(ErrorKind::MsgSize, "post_send")
                .with_detail(format!("{len} bytes > MTU {mtu}")));
        }
        self.slots.take_send("post_send")?;
        self.link.post_send(wr, now);
        Ok(())
    }

    /// Completes every outstanding work request with `Flushed` (held-back acknowledgements
    /// go out first).
    fn flush(&mut self, now: Instant) {
        self.link.flush(now);
        self.send_out(now);
    }
}

/// What the application handle and the NIC thread share.
pub(super) struct Shared {
    state: Mutex<State>,
    /// Cold (see [`COLD_AFTER`]) with no completion queued, as of the last look under the lock:
    /// the polls that skip progress then have nothing to take and need not take the lock.
    quiet: AtomicBool,
    /// The NIC thread's watch of a cold queue pair's socket for the busy-polling application.
    cold: ColdWatch,
    stop: Arc<AtomicBool>,
    waker: Waker,
    notifier: Arc<Notifier>,
    busy: Busy,
}

/// While the application busy-polls a quiet queue pair (cold, nothing queued), the NIC thread
/// waits on its socket instead of standing aside, and tells the application when a datagram
/// came: the application's polls then read nothing (no empty `recvfrom` every
/// [`COLD_READ_EVERY`], which a queue pair routed beside the same-host path paid while all its
/// traffic went over shared memory). The first datagram wakes the thread once; it raises
/// `ready`, the next poll reads the socket, and the queue pair is warm again (its socket then
/// leaves the thread's set, see [`nic_thread`]).
#[derive(Debug, Default)]
struct ColdWatch {
    /// The socket is in the NIC thread's epoll set: the thread sees every datagram that comes
    /// (and reads it itself, or raises `ready` while the application polls).
    watching: AtomicBool,
    /// The NIC thread saw the socket readable since the application last read it.
    ready: AtomicBool,
}

/// The busy-poll hand-off: while the application polls, it makes all progress on its own thread
/// and the NIC thread is parked (so arriving datagrams wake nobody and nothing contends for the
/// lock); the NIC thread takes over when the application stops polling for [`BUSY_WINDOW`]
/// ([`ACK_GUARD_WINDOW`] if acknowledgements wait) or is
/// about to sleep on its notifier ([`SleepHook`]).
struct Busy {
    /// Origin of `last_poll`.
    epoch: Instant,
    /// Nanoseconds from `epoch` to the end of the application's last `poll`; 0 = never.
    last_poll: AtomicU64,
    /// The last `poll` left delayed acknowledgements behind.
    acks_left: AtomicBool,
    /// A waiter on the notifier is about to sleep: the application is not polling.
    sleeping: AtomicBool,
    /// The NIC thread is parked (not waiting on the socket).
    parked: AtomicBool,
    /// The NIC thread, to unpark it.
    nic: std::sync::OnceLock<Thread>,
}

impl Busy {
    fn new() -> Busy {
        Busy {
            epoch: Instant::now(),
            last_poll: AtomicU64::new(0),
            acks_left: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            nic: std::sync::OnceLock::new(),
        }
    }

    /// The application polled at `now`, leaving delayed acknowledgements behind or not.
    fn polled(&self, now: Instant, acks_left: bool) {
        let ns = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.last_poll.store(ns.max(1), Ordering::Relaxed);
        if self.acks_left.load(Ordering::Relaxed) != acks_left {
            self.acks_left.store(acks_left, Ordering::Relaxed);
        }
        if self.sleeping.load(Ordering::Relaxed) {
            self.sleeping.store(false, Ordering::Relaxed);
        }
    }

    /// Until when the application counts as busy-polling, if it does at `now`.
    fn busy_until(&self, now: Instant) -> Option<Instant> {
        let last = self.last_poll.load(Ordering::Relaxed);
        if last == 0 || self.sleeping.load(Ordering::SeqCst) {
            return None;
        }
        let window = if self.acks_left.load(Ordering::Relaxed) {
            ACK_GUARD_WINDOW
        } else {
            BUSY_WINDOW
        };
        let until = self.epoch + Duration::from_nanos(last) + window;
        (until > now).then_some(until)
    }

    fn unpark(&self) {
        if let Some(t) = self.nic.get() {
            t.unpark();
        }
    }
}

/// Tells the NIC thread that the application goes to sleep (registered on the notifier).
struct NicHook(std::sync::Weak<Shared>);

impl SleepHook for NicHook {
    fn before_sleep(&self) {
        if let Some(s) = self.0.upgrade() {
            s.busy.sleeping.store(true, Ordering::SeqCst);
            if s.busy.parked.load(Ordering::SeqCst) {
                s.busy.unpark();
            }
            if s.cold.watching.load(Ordering::SeqCst) {
                let _ = s.waker.wake();
            }
        }
    }
}

impl Shared {
    /// Reads datagrams and runs due timers; true when more datagrams may be waiting. `nic`: the
    /// NIC thread calls (see [`State::drain`]).
    /// Also returns whether delayed acknowledgements are left.
    fn progress(&self, budget: usize, nic: bool, now: Instant) -> (bool, bool) {
        let mut st = self.state.lock();
        if st.closed {
            return (false, false);
        }
        // What this pass sends (acknowledgements, packets an acknowledgement let go,
        // retransmissions) leaves together.
        let more = st.drain(budget, now, nic, &self.cold);
        st.link.run_timers(now);
        st.send_out(now);
        self.note_quiet(&st);
        let acks_left = st.link.srd.acks_delayed();
        let notify = st.link.ctx.cq.take_new();
        drop(st);
        if notify {
            self.notifier.notify();
        }
        (more, acks_left)
    }

    /// Adds the socket to the NIC thread's epoll set (`on`) or takes it out; true when it is in
    /// the set afterwards. A failure to take it out leaves it in (it costs time, not datagrams);
    /// a failure to add it is reported, and the thread's waits fall back to its timers.
    ///
    /// [`ColdWatch::watching`] follows: it is lowered before the socket leaves the set (the
    /// datagrams the set reported and nobody took are then read by the polls' own reads) and
    /// raised once it is in (a datagram already there is reported by the set at once).
    fn watch_socket(&self, poll: &Poll, on: bool) -> bool {
        if !on {
            self.cold.watching.store(false, Ordering::SeqCst);
        }
        let mut st = self.state.lock();
        let r = if on {
            poll.registry()
                .register(&mut st.sock, SOCK, Interest::READABLE)
        } else {
            poll.registry().deregister(&mut st.sock)
        };
        let watching = match r {
            Ok(()) => on,
            Err(e) => {
                tracing::debug!(error = %e, on, "udp: cannot change the NIC thread's epoll set");
                !on
            }
        };
        if watching {
            self.cold.watching.store(true, Ordering::SeqCst);
        }
        watching
    }

    /// The NIC thread's wait on its epoll set; a readable socket raises [`ColdWatch::ready`]
    /// (whoever reads next, the thread or a polling application, reads it: the edge-triggered
    /// set reports it only once).
    fn wait(&self, poll: &mut Poll, events: &mut Events, timeout: Option<Duration>) {
        if let Err(e) = poll.poll(events, timeout) {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!(error = %e, "udp: NIC thread poll failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if events.iter().any(|e| e.token() == SOCK) {
            self.cold.ready.store(true, Ordering::Release);
            self.quiet.store(false, Ordering::Release);
        }
    }

    /// Records whether the queue pair is quiet (see [`Shared::quiet`]), under its lock.
    fn note_quiet(&self, st: &State) {
        let quiet = st.cold_next.is_some() && st.link.ctx.cq.len() == 0;
        self.quiet.store(quiet, Ordering::Release);
    }

    /// After the application changed the state: wake the NIC thread if a timer now falls before
    /// its planned wake-up, and the waiters if completions became ready.
    fn after_post(&self, mut st: parking_lot::MutexGuard<'_, State>) {
        self.quiet.store(false, Ordering::Release);
        let mut wake = false;
        // A parked NIC thread leaves the timers to the polling application.
        if !st.closed && !self.busy.parked.load(Ordering::Relaxed) {
            if let Some(next) = st.link.next_deadline() {
                if st.thread_deadline.is_none_or(|d| next < d) {
                    st.thread_deadline = Some(next);
                    wake = true;
                }
            }
        }
        let notify = st.link.ctx.cq.take_new();
        drop(st);
        if wake {
            let _ = self.waker.wake();
        }
        if notify {
            self.notifier.notify();
        }
    }
}

/// The background "NIC": waits for datagrams or the next timer and makes progress.
///
/// While the application busy-polls, the socket leaves the thread's epoll set: every datagram
/// delivered to a socket in an epoll set runs epoll's wake-up callback inside the sender's
/// system call (about 0.2 µs a datagram on loopback), for a thread that is not waiting. The
/// socket rejoins before the thread reads it and waits again (epoll reports it at once if a
/// datagram came meanwhile), so nothing is missed.
fn nic_thread(shared: Arc<Shared>, mut poll: Poll) {
    let mut events = Events::with_capacity(16);
    let mut watching = true;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let now = Instant::now();
        if let Some(until) = shared.busy.busy_until(now) {
            // The application polls. A quiet queue pair's socket is watched for it (see
            // `ColdWatch`); otherwise the socket leaves the set and the thread stands aside.
            // Either way until a datagram comes, the application stops or goes to sleep.
            let watch =
                shared.quiet.load(Ordering::Acquire) && !shared.cold.ready.load(Ordering::Acquire);
            if watching != watch {
                watching = shared.watch_socket(&poll, watch);
            }
            shared.busy.parked.store(true, Ordering::SeqCst);
            if shared.busy.busy_until(now).is_some() && !shared.stop.load(Ordering::Acquire) {
                let wait = until.saturating_duration_since(now);
                if watch && watching {
                    shared.wait(&mut poll, &mut events, Some(wait));
                } else {
                    std::thread::park_timeout(wait);
                }
            }
            shared.busy.parked.store(false, Ordering::SeqCst);
            continue;
        }
        if !watching {
            watching = shared.watch_socket(&poll, true);
        }
        let (more, _) = shared.progress(NIC_BUDGET, true, now);
        let timeout = if more {
            Some(Duration::ZERO)
        } else {
            let mut st = shared.state.lock();
            if st.closed {
                break;
            }
            let d = st.link.next_deadline();
            st.thread_deadline = d;
            d.map(|d| d.saturating_duration_since(Instant::now()))
        };
        // (A socket the set could not take back is read every millisecond.)
        let timeout = if watching {
            timeout
        } else {
            Some(timeout.map_or(Duration::from_millis(1), |t| {
                t.min(Duration::from_millis(1))
            }))
        };
        shared.wait(&mut poll, &mut events, timeout);
    }
    shared.cold.watching.store(false, Ordering::SeqCst);
}

/// A queue pair of the udp device.
pub(crate) struct UdpQp {
    shared: Arc<Shared>,
    /// Registered (weakly) on the notifier; lives as long as the queue pair.
    _hook: Arc<dyn SleepHook>,
    thread: Background,
    addr: RawAddr,
    qp_type: QpType,
    /// Polls in a row that only took completions of a cold queue pair (see [`COLD_POLLS`]).
    cold_skips: u32,
}

impl fmt::Debug for UdpQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt_qp(f, "UdpQp", self.addr, self.qp_type)
    }
}

/// The queue pair's socket, and whether it takes coalesced datagrams (`UDP_GRO`).
fn open_socket(cfg: &UdpConfig) -> io::Result<(std::net::UdpSocket, bool)> {
    use socket2::{Domain, Protocol, Socket, Type};
    let bind = SocketAddr::new(cfg.bind, 0);
    let sock = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    if cfg.bind.is_ipv6() && cfg.bind.is_unspecified() {
        // `::` serves IPv4 peers too (as IPv4-mapped addresses), where the system allows it.
        let _ = sock.set_only_v6(false);
    }
    if cfg.socket_buffer > 0 {
        if let Err(e) = sock.set_recv_buffer_size(cfg.socket_buffer) {
            tracing::debug!(error = %e, "udp: cannot set the receive buffer size");
        }
        if let Err(e) = sock.set_send_buffer_size(cfg.socket_buffer) {
            tracing::debug!(error = %e, "udp: cannot set the send buffer size");
        }
    }
    sock.set_nonblocking(true)?;
    let gro = cfg.gso && mmsg::enable_gro(&sock);
    if cfg.gso && !gro {
        tracing::debug!("udp: the kernel offers no UDP_GRO; datagrams are read one by one");
    }
    sock.bind(&bind.into())?;
    Ok((sock.into(), gro))
}

impl UdpQp {
    pub(super) fn create(
        cfg: Arc<UdpConfig>,
        counters: Arc<DeviceCounters>,
        attr: QpAttr,
        keys: Option<KeyTable>,
    ) -> Result<UdpQp> {
        attr.check()?;
        let (std_sock, gro) = open_socket(&cfg).map_err(|e| Error::io("create_qp", e))?;
        let local = std_sock
            .local_addr()
            .map_err(|e| Error::io("create_qp", e))?;
        let mut sock = UdpSocket::from_std(std_sock);
        let poll = Poll::new().map_err(|e| Error::io("create_qp", e))?;
        poll.registry()
            .register(&mut sock, SOCK, Interest::READABLE)
            .map_err(|e| Error::io("create_qp", e))?;
        let waker = Waker::new(poll.registry(), WAKE).map_err(|e| Error::io("create_qp", e))?;
        let qkey = attr.qkey.unwrap_or_else(random_qkey);
        let addr = RawAddr::new(Gid::from_ip(cfg.bind), local.port(), qkey);
        let link = Link::new(
            cfg.clone(),
            counters,
            LinkAttr {
                qp_type: attr.qp_type,
                qkey,
                rnr_retry: attr.rnr_retry,
                v6: local.is_ipv6(),
                keys,
                unsolicited_write_recv: cfg.unsolicited_write_recv
                    && attr.unsolicited_write_recv.unwrap_or(true),
            },
            Instant::now(),
        );
        let state = State {
            link,
            sock,
            sender: Sender::new(cfg.gso),
            closed: false,
            slots: WrSlots::new(
                attr.send_depth.clamp(1, cfg.max_send_wr),
                attr.recv_depth.clamp(1, cfg.max_recv_wr),
            ),
            gro,
            rx: Some(mmsg::RxBatch::new(RX_SCRATCH, 1)),
            rx_batch: None,
            thread_deadline: None,
            quiet_until: None,
            idle: true,
            cold_at: Instant::now() + COLD_AFTER,
            cold_next: None,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            quiet: AtomicBool::new(false),
            // (The socket is in the NIC thread's set from the start.)
            cold: ColdWatch {
                watching: AtomicBool::new(true),
                ready: AtomicBool::new(false),
            },
            stop: Arc::new(AtomicBool::new(false)),
            waker,
            notifier: attr.notifier,
            busy: Busy::new(),
        });
        let hook: Arc<dyn SleepHook> = Arc::new(NicHook(Arc::downgrade(&shared)));
        shared.notifier.add_sleep_hook(Arc::downgrade(&hook));
        let (s2, s3) = (shared.clone(), shared.clone());
        let thread = Background::spawn(
            format!("efa-udp-{}", local.port()),
            &shared.stop,
            move || {
                let _ = s3.waker.wake();
                s3.busy.unpark();
            },
            move || nic_thread(s2, poll),
        )
        .map_err(|e| Error::io("create_qp", e))?;
        if let Some(t) = thread.thread() {
            let _ = shared.busy.nic.set(t.clone());
        }
        tracing::debug!(%addr, %local, qp_type = ?attr.qp_type, "udp: queue pair created");
        Ok(UdpQp {
            shared,
            _hook: hook,
            thread,
            addr,
            qp_type: attr.qp_type,
            cold_skips: 0,
        })
    }
}

impl QueuePair for UdpQp {
    fn addr(&self) -> RawAddr {
        self.addr
    }

    rdma_posts_by_wr!(post_write, post_read, post_write_region);

    /// SRD queue pairs of a device with RDMA send writes straight from the registered region:
    /// each chunk is read under the region's read lock when it goes out (and again for a
    /// retransmission), so posting copies and allocates nothing.
    fn region_rdma_write(&self) -> bool {
        let st = self.shared.state.lock();
        st.link.qp_type == QpType::Srd && st.link.ctx.rdma.keys.is_some()
    }

    /// One system call (or as few as the socket allows) for the whole list ([`Self::post_list`]).
    fn post_rdma_list(
        &mut self,
        wrs: &mut VecDeque<RdmaWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        self.post_list(wrs, |w| w.wr_id, |st, now, wr| st.post_rdma_wr(now, wr))
    }

    fn qp_type(&self) -> QpType {
        self.qp_type
    }

    fn unsolicited_write_recv(&self) -> bool {
        self.shared.state.lock().link.ctx.rdma.unsolicited
    }

    fn hold_source(&mut self, src: Source, hold: bool) -> bool {
        let mut st = self.shared.state.lock();
        if st.link.qp_type != QpType::Srd {
            return false;
        }
        let held = &mut st.link.ctx.held;
        held.retain(|s| *s != src);
        if hold {
            held.push(src);
        }
        true
    }

    #[cfg(any(test, feature = "emu-hooks"))]
    fn modify(&mut self, m: crate::device::QpModify) -> Result<()> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "modify_qp"));
        }
        if let Some(qkey) = m.qkey {
            st.link.set_qkey(qkey);
            self.addr = RawAddr::new(self.addr.gid, self.addr.qpn, qkey);
        }
        if let Some(r) = m.rnr_retry {
            st.link.ctx.rnr_retry = r;
        }
        Ok(())
    }

    fn post_send(&mut self, wr: SendWr) -> Result<()> {
        let mut st = self.shared.state.lock();
        let now = Instant::now();
        st.post_send(wr, now)?;
        st.send_out(now);
        self.shared.after_post(st);
        Ok(())
    }

    fn post_send_list(
        &mut self,
        wrs: &mut VecDeque<SendWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        self.post_list(wrs, |w| w.wr_id, |st, now, wr| st.post_send(wr, now))
    }

    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "post_recv"));
        }
        st.slots.take_recv()?;
        st.link.ctx.recvs.push_back((wr_id, buf));
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        if !self.shared.busy.sleeping.load(Ordering::Relaxed)
            && self.shared.quiet.load(Ordering::Acquire)
            && self.shared.cold.watching.load(Ordering::Acquire)
        {
            // Quiet, and the NIC thread watches the socket: nothing to read, no timers to run
            // (a datagram clears `quiet`); only the busy-poll mark is kept fresh now and then.
            self.cold_skips += 1;
            if self.cold_skips >= COLD_POLLS {
                self.cold_skips = 0;
                self.shared.busy.polled(Instant::now(), false);
            }
            return 0;
        }
        if self.cold_skips + 1 < COLD_POLLS && !self.shared.busy.sleeping.load(Ordering::Relaxed) {
            if self.shared.quiet.load(Ordering::Acquire) {
                self.cold_skips += 1;
                return 0;
            }
            let mut st = self.shared.state.lock();
            // Cold at the last progress, and nothing posted since.
            if st.cold_next.is_some() {
                self.cold_skips += 1;
                let st = &mut *st;
                let n = st.link.ctx.cq.poll_into(&mut st.slots, out, max);
                self.shared.note_quiet(st);
                return n;
            }
        }
        self.cold_skips = 0;
        let now = Instant::now();
        let (_, acks_left) = self.shared.progress(APP_BUDGET, false, now);
        self.shared.busy.polled(now, acks_left);
        let mut st = self.shared.state.lock();
        let st = &mut *st;
        let n = st.link.ctx.cq.poll_into(&mut st.slots, out, max);
        self.shared.note_quiet(st);
        n
    }

    fn close(&mut self) {
        {
            let mut st = self.shared.state.lock();
            if !st.closed {
                st.closed = true;
                st.flush(Instant::now());
                tracing::debug!(addr = %self.addr, "udp: queue pair closed");
            }
            st.link.ctx.cq.take_new();
            self.shared.quiet.store(false, Ordering::Release);
        }
        self.thread.stop();
        self.shared.notifier.notify();
    }
}

impl UdpQp {
    fn post_one_rdma(&mut self, wr: RdmaWr) -> Result<()> {
        let mut st = self.shared.state.lock();
        let now = Instant::now();
        let r = st.post_rdma_wr(now, wr);
        if r.is_ok() {
            st.send_out(now);
        }
        self.shared.after_post(st);
        r
    }

    /// Posts the work requests at the front of `wrs` (popping each) under one lock until one is
    /// refused, then sends what they queued with one `send_out` (one system call, or as few as
    /// the socket allows); the refused one's `wr_id` (by `id`) and error come back, the rest stay
    /// in `wrs`.
    fn post_list<W>(
        &mut self,
        wrs: &mut VecDeque<W>,
        id: impl Fn(&W) -> u64,
        mut post: impl FnMut(&mut State, Instant, W) -> Result<()>,
    ) -> std::result::Result<(), (u64, Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut st = self.shared.state.lock();
        let now = Instant::now();
        let mut r = Ok(());
        while let Some(wr) = wrs.pop_front() {
            let wr_id = id(&wr);
            if let Err(e) = post(&mut st, now, wr) {
                r = Err((wr_id, e));
                break;
            }
        }
        st.send_out(now);
        self.shared.after_post(st);
        r
    }
}

impl Drop for UdpQp {
    fn drop(&mut self) {
        // As `close`: held-back acknowledgements go out before the socket does.
        let mut st = self.shared.state.lock();
        if !st.closed {
            let now = Instant::now();
            st.link.flush_acks(now, true);
            st.send_out(now);
        }
        drop(st);
        self.thread.stop();
    }
}

#[cfg(test)]
mod tests;
