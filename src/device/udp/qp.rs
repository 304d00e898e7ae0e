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

use bytes::{Bytes, BytesMut};
use mio::net::UdpSocket;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::Mutex;

use super::mmsg;
use super::srd::Srd;
use super::wire::{self, Packet};
use super::{UdpConfig, sockaddr_for};
use crate::addr::{Gid, RawAddr};
use crate::device::queues::{Completions, WrSlots, flush_recvs};
use crate::device::soft_rdma::{self as rdma, KeyTable, Rdma, RdmaHost, RdmaOps, Served, Src};
use crate::device::{
    DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, SendWr, Source, Status, random_qkey,
};
use crate::error::{Error, ErrorKind, Result};
use crate::fault::FaultInjector;
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
/// How long a datagram held back for reordering waits for a later one, when `max_delay` is zero.
const DEFAULT_REORDER_HOLD: Duration = Duration::from_millis(1);
/// User bytes up to this size are copied behind the device header and sent with `sendto`;
/// larger ones are gathered by the kernel from their buffers (`sendmsg`), without a copy here.
const GATHER_MIN: usize = 2048;
/// After an application poll read datagrams and emptied the socket, its polls leave the socket
/// alone this long: the application is busy with what arrived (and its reply should not wait
/// for a few more empty reads), and the next datagram is unlikely to be there already.
const RX_QUIET: Duration = Duration::from_micros(4);
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

/// The socket and the fault layer every outgoing datagram goes through.
pub(super) struct Io {
    pub sock: UdpSocket,
    /// The socket is IPv6 (IPv4 destinations are sent as IPv4-mapped addresses).
    pub v6: bool,
    /// Scratch buffer of the datagram being sent.
    pub tx: Vec<u8>,
    pub faults: Option<Faults>,
    pub counters: Arc<DeviceCounters>,
    /// Datagrams held for one `sendmmsg` while a batch is open ([`Io::begin_batch`]).
    out: TxBatch,
    /// Unit tests: `(errno, n)` makes every `n`-th datagram's send fail with `errno`, as if the
    /// kernel had refused it.
    #[cfg(test)]
    pub inject: Option<(i32, u64, u64)>,
}

/// Whom a datagram sent in a batch belongs to, so that a permanent failure the kernel reports
/// only when the batch goes out reaches the right work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tag {
    /// Acknowledgements, NAKs and other datagrams no work request waits for.
    None,
    /// The UD send with this work request id.
    Ud(u64),
    /// The SRD packet `seq` towards connection `conn`.
    Srd { conn: u32, seq: u64 },
}

/// One datagram waiting in a batch: its device header (and, when small, everything) in the
/// batch's arena, and the user's segments, sent from where they are.
struct Queued {
    dest: socket2::SockAddr,
    head: std::ops::Range<usize>,
    hdr: Bytes,
    payload: Bytes,
    tag: Tag,
}

/// The datagrams of an open batch.
struct TxBatch {
    open: bool,
    arena: Vec<u8>,
    queued: Vec<Queued>,
    /// Datagrams of flushed batches the kernel refused for good (not a transient loss).
    failed: Vec<Tag>,
    /// The messages of a flush: ranges of `queued` (several datagrams: one GSO message).
    groups: Vec<std::ops::Range<usize>>,
    scratch: mmsg::SendScratch,
    /// Largest datagram sent in GSO messages (`UDP_SEGMENT`); 0: GSO off. Lowered when the
    /// kernel refuses a GSO message.
    gso_limit: usize,
}

impl TxBatch {
    fn new(gso: bool) -> TxBatch {
        TxBatch {
            open: false,
            arena: Vec::new(),
            queued: Vec::new(),
            failed: Vec::new(),
            groups: Vec::new(),
            scratch: mmsg::SendScratch::default(),
            gso_limit: if gso { mmsg::GSO_MAX_BYTES } else { 0 },
        }
    }
}

/// Fault-injection state: the seeded injector and the datagrams it holds back.
pub(super) struct Faults {
    inj: FaultInjector,
    hold: Duration,
    held: Vec<(SocketAddr, Vec<u8>, Instant)>,
    delayed: Vec<(Instant, SocketAddr, Vec<u8>)>,
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

/// One `sendto`: transient failures count as a loss on the wire.
fn raw_send(sock: &UdpSocket, buf: &[u8], dest: SocketAddr) -> io::Result<()> {
    lost_if_transient(sock.send_to(buf, dest), dest)
}

/// One `sendto` (one `sendmsg` gathering the parts when there are several, so that user bytes
/// are not copied into a staging buffer): transient failures count as a loss on the wire.
fn raw_send_parts(
    sock: &UdpSocket,
    head: &mut Vec<u8>,
    hdr: &[u8],
    payload: &[u8],
    dest: SocketAddr,
) -> io::Result<()> {
    let r = if hdr.len() + payload.len() <= GATHER_MIN {
        // Small: one copy is cheaper than the kernel importing three segments.
        head.extend_from_slice(hdr);
        head.extend_from_slice(payload);
        sock.send_to(head, dest)
    } else {
        let parts = [
            io::IoSlice::new(head),
            io::IoSlice::new(hdr),
            io::IoSlice::new(payload),
        ];
        socket2::SockRef::from(sock).send_to_vectored(&parts, &dest.into())
    };
    lost_if_transient(r, dest)
}

/// Sends one queued datagram by itself (`sendmsg` gathering its parts); transient failures are
/// losses, an error is permanent.
fn send_one(sock: &UdpSocket, head: &[u8], q: &Queued) -> io::Result<()> {
    let parts = [
        io::IoSlice::new(head),
        io::IoSlice::new(&q.hdr),
        io::IoSlice::new(&q.payload),
    ];
    let r = socket2::SockRef::from(sock).send_to_vectored(&parts, &q.dest);
    match q.dest.as_socket() {
        Some(dest) => lost_if_transient(r, dest),
        None => r.map(|_| ()),
    }
}

impl Io {
    /// Sends the datagram in `self.tx` to `dest` through the fault layer. An error is a permanent
    /// failure of the first copy (e.g. an address of the wrong family); transient ones are losses.
    pub fn emit(&mut self, dest: SocketAddr, now: Instant) -> io::Result<()> {
        self.emit_parts(dest, now, &Bytes::new(), &Bytes::new(), Tag::None)
    }

    /// Sends the datagram `self.tx` + `hdr` + `payload` to `dest` through the fault layer, as
    /// [`Io::emit`]; the parts are gathered by the kernel, not copied here (unless a fault holds
    /// the datagram back). While a batch is open the datagram waits for
    /// [`Io::end_batch`], and a permanent failure is reported then, with `tag`.
    pub fn emit_parts(
        &mut self,
        dest: SocketAddr,
        now: Instant,
        hdr: &Bytes,
        payload: &Bytes,
        tag: Tag,
    ) -> io::Result<()> {
        let Some(f) = self.faults.as_mut() else {
            return self.out(dest, hdr, payload, tag);
        };
        let fate = f.inj.next_fate();
        if fate.drop {
            stats::inc(&self.counters.faults_dropped);
            return Ok(());
        }
        let copies = if fate.duplicate {
            stats::inc(&self.counters.faults_duplicated);
            2
        } else {
            1
        };
        let whole = || [&self.tx[..], hdr, payload].concat();
        if fate.reorder {
            stats::inc(&self.counters.faults_reordered);
            for _ in 0..copies {
                f.held.push((dest, whole(), now + f.hold));
            }
            return Ok(());
        }
        if !fate.delay.is_zero() {
            stats::inc(&self.counters.faults_reordered);
            for _ in 0..copies {
                f.delayed.push((now + fate.delay, dest, whole()));
            }
            return Ok(());
        }
        let held = std::mem::take(&mut f.held);
        let head = self.tx.len();
        let r = self.out(dest, hdr, payload, tag);
        if copies > 1 {
            self.tx.truncate(head);
            let _ = self.out(dest, hdr, payload, Tag::None);
        }
        // Held-back datagrams go out after this later one: that is the reordering.
        for (d, b, _) in held {
            let _ = self.out_owned(d, &b, Tag::None);
        }
        r
    }

    /// Sends (or, in a batch, queues) the datagram `self.tx` + `hdr` + `payload`.
    fn out(&mut self, dest: SocketAddr, hdr: &Bytes, payload: &Bytes, tag: Tag) -> io::Result<()> {
        #[cfg(test)]
        if let Some((errno, every, count)) = self.inject.as_mut() {
            *count += 1;
            if *count % *every == 0 {
                return lost_if_transient(Err(io::Error::from_raw_os_error(*errno)), dest);
            }
        }
        if !self.out.open {
            return raw_send_parts(&self.sock, &mut self.tx, hdr, payload, dest);
        }
        let b = &mut self.out;
        let start = b.arena.len();
        b.arena.extend_from_slice(&self.tx);
        let (hdr, payload) = if hdr.len() + payload.len() <= GATHER_MIN {
            b.arena.extend_from_slice(hdr);
            b.arena.extend_from_slice(payload);
            (Bytes::new(), Bytes::new())
        } else {
            (hdr.clone(), payload.clone())
        };
        b.queued.push(Queued {
            dest: dest.into(),
            head: start..b.arena.len(),
            hdr,
            payload,
            tag,
        });
        if b.queued.len() >= mmsg::MAX_BATCH {
            self.send_queued();
        }
        Ok(())
    }

    /// [`Io::out`] for a datagram the fault layer built in one piece.
    fn out_owned(&mut self, dest: SocketAddr, whole: &[u8], tag: Tag) -> io::Result<()> {
        if !self.out.open {
            return raw_send(&self.sock, whole, dest);
        }
        let tx = std::mem::take(&mut self.tx);
        self.tx.extend_from_slice(whole);
        let r = self.out(dest, &Bytes::new(), &Bytes::new(), tag);
        self.tx = tx;
        r
    }

    /// From now on datagrams wait, to leave together at [`Io::end_batch`] (`sendmmsg`).
    pub fn begin_batch(&mut self) {
        self.out.open = true;
    }

    /// Sends the datagrams of the open batch and closes it. Returns the datagrams the kernel
    /// refused for good, for their owners to fail (transient refusals are losses on the wire).
    pub fn end_batch(&mut self) -> Vec<Tag> {
        self.send_queued();
        self.out.open = false;
        std::mem::take(&mut self.out.failed)
    }

    /// Sends what the batch holds: one `sendmmsg` per [`mmsg::MAX_BATCH`] messages (a plain
    /// `sendmsg` for a lone datagram).
    fn send_queued(&mut self) {
        let TxBatch {
            arena,
            queued,
            failed,
            groups,
            scratch,
            gso_limit,
            ..
        } = &mut self.out;
        if let [q] = &queued[..] {
            let head = arena.get(q.head.clone()).unwrap_or_default();
            if let Err(e) = send_one(&self.sock, head, q) {
                tracing::debug!(error = %e, "udp: send failed");
                failed.push(q.tag);
            }
            queued.clear();
            arena.clear();
            return;
        }
        let len_of = |q: &Queued| q.head.len() + q.hdr.len() + q.payload.len();
        // Messages: runs of datagrams to one address, all of one size but the last (which
        // may be shorter), become one GSO message the kernel cuts; the others go alone.
        groups.clear();
        let mut i = 0;
        while i < queued.len() {
            let first = &queued[i];
            let seg = len_of(first);
            let mut end = i + 1;
            let mut total = seg;
            if seg <= *gso_limit {
                while let Some(q) = queued.get(end) {
                    let len = len_of(q);
                    let prev_full = queued.get(end - 1).is_some_and(|p| len_of(p) == seg);
                    if q.dest != first.dest
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
            let Some(first) = queued.get(g.start) else {
                continue;
            };
            let seg = (g.len() > 1).then(|| len_of(first) as u16);
            batch.message(&first.dest, seg);
            for q in queued.get(g.clone()).unwrap_or_default() {
                batch.part(arena.get(q.head.clone()).unwrap_or_default());
                batch.part(&q.hdr);
                batch.part(&q.payload);
            }
        }
        let mut m = 0;
        let mut calls = 0;
        while m < batch.len() {
            calls += 1;
            match batch.send(&self.sock, m) {
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
                        let seg = queued.get(g.start).map_or(0, len_of);
                        tracing::debug!(error = %e, seg, "udp: GSO refused, sending one by one");
                        *gso_limit = (*gso_limit).min(seg.saturating_sub(1));
                        for q in queued.get(g).unwrap_or_default() {
                            let head = arena.get(q.head.clone()).unwrap_or_default();
                            if send_one(&self.sock, head, q).is_err() {
                                failed.push(q.tag);
                            }
                        }
                    } else {
                        tracing::debug!(error = %e, "udp: send failed");
                        failed.extend(queued.get(g.start).map(|q| q.tag));
                    }
                    m += 1;
                }
            }
        }
        if queued.len() > 1 {
            stats::add(&self.counters.tx_batches, calls);
        }
        queued.clear();
        arena.clear();
    }

    /// Sends held-back and delayed datagrams whose time has come.
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
            let _ = self.out_owned(d, &b, Tag::None);
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
    pub io: Io,
    pub cfg: Arc<UdpConfig>,
    pub qkey: u32,
    pub rnr_retry: u8,
    cq: Completions,
    recvs: VecDeque<(u64, BytesMut)>,
    /// One-sided RDMA (`rdma.rs`).
    pub rdma: Rdma,
    /// Senders held back ([`QueuePair::hold_source`]): their new messages get RNR.
    held: Vec<Source>,
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
        &self.io.counters
    }
    fn mtu(&self) -> usize {
        self.cfg.mtu
    }
}

impl Ctx {
    pub fn counters(&self) -> &DeviceCounters {
        &self.io.counters
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
            stats::inc(&self.io.counters.send_errors);
        }
        self.complete(DeviceCompletion::new(wr_id, status, Opcode::Send, byte_len));
    }

    /// A UD send completed `Success` when it was queued in a batch, and the kernel refused it
    /// for good when the batch went out: its completion (still queued, as the lock was held
    /// throughout) becomes `UnreachableRemote`.
    fn fail_batched_ud(&mut self, wr_id: u64) {
        let c = self
            .cq
            .iter_mut()
            .rev()
            .find(|c| c.wr_id == wr_id && c.opcode == Opcode::Send && c.status.is_ok());
        if let Some(c) = c {
            c.status = Status::UnreachableRemote;
            c.byte_len = 0;
            stats::inc(&self.io.counters.send_errors);
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
        let cap = buf.capacity();
        buf.clear();
        let (status, res) = if data.len() > cap {
            buf.extend_from_slice(data.get(..cap).unwrap_or_default());
            (Status::LocalBadLength, Delivery::BadLength)
        } else {
            buf.extend_from_slice(data);
            stats::inc(&self.io.counters.rx_pkts);
            stats::add(&self.io.counters.rx_bytes, data.len() as u64);
            (Status::Success, Delivery::Ok)
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

/// Everything behind the queue pair's lock.
pub(super) struct State {
    ctx: Ctx,
    qp_type: QpType,
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
    srd: Srd,
    /// When the NIC thread will wake up by itself (`None`: only on a datagram or a wake-up).
    thread_deadline: Option<Instant>,
    /// The application's polls do not read the socket before this (see [`RX_QUIET`]).
    quiet_until: Option<Instant>,
    /// The last read of the socket found it empty.
    idle: bool,
}

impl State {
    /// Reads up to `budget` datagrams; true when more may be waiting. `nic`: called by the NIC
    /// thread (the application is not polling), so acknowledgements go out at once instead of
    /// waiting briefly for a data packet to ride on.
    fn drain(&mut self, budget: usize, now: Instant, nic: bool) -> bool {
        if !nic && self.quiet_until.is_some_and(|q| now < q) {
            return false;
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
                mmsg::recv_batch(&self.ctx.io.sock, b, want)
            } else {
                b.recv_plain(&self.ctx.io.sock)
            };
            match r {
                Ok(k) => {
                    reads += k;
                    if k > 1 {
                        stats::inc(&self.ctx.counters().rx_batches);
                    }
                    for i in 0..k {
                        let Some(m) = b.got.get(i).copied() else {
                            break;
                        };
                        let Some(src) = m.src.filter(|_| !m.truncated) else {
                            n += 1;
                            stats::inc(&self.ctx.counters().malformed_dropped);
                            tracing::debug!(?m, "udp: dropped a cut-off or non-IP datagram");
                            continue;
                        };
                        if m.seg != 0 {
                            stats::inc(&self.ctx.counters().rx_batches);
                        }
                        for d in b.datagrams(i) {
                            n += 1;
                            self.handle(d, src, now);
                            if n % ACK_BATCH == 0 && self.qp_type == QpType::Srd {
                                self.srd.flush_acks(&mut self.ctx, now, nic);
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
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
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
        if self.qp_type == QpType::Srd {
            self.srd.flush_acks(&mut self.ctx, now, nic);
        }
        self.idle = n == 0;
        self.quiet_until = (n > 0 && !more).then(|| now + RX_QUIET);
        more || (lone && n > 0)
    }

    /// Handles one datagram from `src`.
    fn handle(&mut self, data: &[u8], src: SocketAddr, now: Instant) {
        let (dst_qkey, pkt) = match wire::decode(data) {
            Ok(x) => x,
            Err(why) => {
                stats::inc(&self.ctx.counters().malformed_dropped);
                tracing::debug!(%src, len = data.len(), why, "udp: dropped malformed datagram");
                return;
            }
        };
        let srd = self.qp_type == QpType::Srd;
        if srd == matches!(pkt, Packet::Ud { .. }) {
            stats::inc(&self.ctx.counters().malformed_dropped);
            tracing::debug!(%src, "udp: dropped a datagram of the other queue pair type");
            return;
        }
        if dst_qkey != self.ctx.qkey {
            stats::inc(&self.ctx.counters().stale_dropped);
            tracing::trace!(%src, dst_qkey, qkey = self.ctx.qkey, "udp: dropped datagram with a stale QKEY");
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
        self.flush_rdma(now);
    }

    /// Puts the RDMA messages the last step produced on the SRD path.
    fn flush_rdma(&mut self, now: Instant) {
        while !self.ctx.rdma.outbox.is_empty() {
            let batch = std::mem::take(&mut self.ctx.rdma.outbox);
            for (to, wr) in batch {
                let to =
                    to.unwrap_or_else(|| sockaddr_for(&wr.dest.gid, wr.dest.qpn, self.ctx.io.v6));
                self.srd.post_flagged(&mut self.ctx, to, wr, now, true);
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
        if self.qp_type != QpType::Srd || self.ctx.rdma.keys.is_none() {
            return Err(Error::new(ErrorKind::NotSupported, op)
                .with_detail("RDMA needs an SRD queue pair on a device with RDMA"));
        }
        self.slots.take_send(op)?;
        let to = sockaddr_for(&dest.gid, dest.qpn, self.ctx.io.v6);
        let chunk = self.ctx.cfg.mtu.saturating_sub(rdma::HDR).max(1);
        if let Err(e) = start(&mut self.ctx, Some(to), chunk) {
            self.slots.release_send();
            return Err(e);
        }
        self.flush_rdma(now);
        Ok(())
    }

    /// Opens a batch: datagrams wait to leave together ([`State::end_batch`]).
    fn begin_batch(&mut self) {
        self.ctx.io.begin_batch();
    }

    /// Sends the open batch and fails the work requests whose datagrams the kernel refused.
    fn end_batch(&mut self) {
        for tag in self.ctx.io.end_batch() {
            match tag {
                Tag::None => {}
                Tag::Ud(wr_id) => self.ctx.fail_batched_ud(wr_id),
                Tag::Srd { conn, seq } => self.srd.send_failed(&mut self.ctx, conn, seq),
            }
        }
    }

    fn run_timers(&mut self, now: Instant) {
        self.ctx.io.run_timers(now);
        if self.qp_type == QpType::Srd {
            self.srd.run_timers(&mut self.ctx, now);
            self.flush_rdma(now);
        }
    }

    fn next_deadline(&mut self) -> Option<Instant> {
        min_opt(self.ctx.io.next_deadline(), self.srd.next_deadline())
    }

    /// Completes every outstanding work request with `Flushed`.
    fn flush(&mut self) {
        let ctx = &mut self.ctx;
        let mut recvs = std::mem::take(&mut ctx.recvs);
        flush_recvs(&mut recvs, |c| ctx.complete(c));
        // Acknowledgements still held back (delayed, to ride on data) go now: a peer whose
        // last packet we received must not wait for an ack that never comes.
        if self.qp_type == QpType::Srd {
            self.srd.flush_acks(&mut self.ctx, Instant::now(), true);
        }
        self.srd.flush(&mut self.ctx);
        self.ctx.rdma_flush();
        if let Some(f) = self.ctx.io.faults.as_mut() {
            f.held.clear();
            f.delayed.clear();
        }
    }

    fn post_send(&mut self, wr: SendWr, now: Instant) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "post_send"));
        }
        let len = wr.len();
        if len > self.ctx.cfg.mtu {
            return Err(Error::new(ErrorKind::MsgSize, "post_send")
                .with_detail(format!("{len} bytes > MTU {}", self.ctx.cfg.mtu)));
        }
        self.slots.take_send("post_send")?;
        let dest = sockaddr_for(&wr.dest.gid, wr.dest.qpn, self.ctx.io.v6);
        if dest.is_ipv6() && !self.ctx.io.v6 {
            tracing::debug!(%dest, "udp: IPv6 destination on an IPv4 device");
            self.ctx
                .complete_send(wr.wr_id, Status::UnreachableRemote, 0);
            return Ok(());
        }
        match self.qp_type {
            QpType::Ud => {
                wire::encode_ud(&mut self.ctx.io.tx, wr.dest.qkey, wr.imm, &[], &[]);
                let tag = Tag::Ud(wr.wr_id);
                let status = match self.ctx.io.emit_parts(dest, now, &wr.hdr, &wr.payload, tag) {
                    Ok(()) => {
                        stats::inc(&self.ctx.counters().tx_pkts);
                        stats::add(&self.ctx.counters().tx_bytes, len as u64);
                        Status::Success
                    }
                    Err(e) => {
                        tracing::debug!(%dest, error = %e, "udp: send failed");
                        Status::UnreachableRemote
                    }
                };
                let n = if status.is_ok() { len } else { 0 };
                self.ctx.complete_send(wr.wr_id, status, n);
            }
            QpType::Srd => self.srd.post(&mut self.ctx, dest, wr, now),
        }
        Ok(())
    }
}

/// What the application handle and the NIC thread share.
pub(super) struct Shared {
    state: Mutex<State>,
    stop: Arc<AtomicBool>,
    waker: Waker,
    notifier: Arc<Notifier>,
    busy: Busy,
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
        st.begin_batch();
        let more = st.drain(budget, now, nic);
        st.run_timers(now);
        st.end_batch();
        let acks_left = st.srd.acks_delayed();
        let notify = st.ctx.cq.take_new();
        drop(st);
        if notify {
            self.notifier.notify();
        }
        (more, acks_left)
    }

    /// After the application changed the state: wake the NIC thread if a timer now falls before
    /// its planned wake-up, and the waiters if completions became ready.
    fn after_post(&self, mut st: parking_lot::MutexGuard<'_, State>) {
        let mut wake = false;
        // A parked NIC thread leaves the timers to the polling application.
        if !st.closed && !self.busy.parked.load(Ordering::Relaxed) {
            if let Some(next) = st.next_deadline() {
                if st.thread_deadline.is_none_or(|d| next < d) {
                    st.thread_deadline = Some(next);
                    wake = true;
                }
            }
        }
        let notify = st.ctx.cq.take_new();
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
fn nic_thread(shared: Arc<Shared>, mut poll: Poll) {
    let mut events = Events::with_capacity(16);
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let now = Instant::now();
        if let Some(until) = shared.busy.busy_until(now) {
            // The application polls: stand aside until it stops or goes to sleep.
            shared.busy.parked.store(true, Ordering::SeqCst);
            if shared.busy.busy_until(now).is_some() && !shared.stop.load(Ordering::Acquire) {
                std::thread::park_timeout(until.saturating_duration_since(now));
            }
            shared.busy.parked.store(false, Ordering::SeqCst);
            continue;
        }
        let (more, _) = shared.progress(NIC_BUDGET, true, now);
        let timeout = if more {
            Some(Duration::ZERO)
        } else {
            let mut st = shared.state.lock();
            if st.closed {
                break;
            }
            let d = st.next_deadline();
            st.thread_deadline = d;
            d.map(|d| d.saturating_duration_since(Instant::now()))
        };
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!(error = %e, "udp: NIC thread poll failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// A queue pair of the udp device.
pub(crate) struct UdpQp {
    shared: Arc<Shared>,
    /// Registered (weakly) on the notifier; lives as long as the queue pair.
    _hook: Arc<dyn SleepHook>,
    thread: Background,
    addr: RawAddr,
    qp_type: QpType,
}

impl fmt::Debug for UdpQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdpQp")
            .field("addr", &self.addr)
            .field("qp_type", &self.qp_type)
            .finish_non_exhaustive()
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
        let faults = (!cfg.faults.is_none()).then(|| Faults {
            inj: FaultInjector::new(cfg.faults.clone()),
            hold: if cfg.faults.max_delay.is_zero() {
                DEFAULT_REORDER_HOLD
            } else {
                cfg.faults.max_delay
            },
            held: Vec::new(),
            delayed: Vec::new(),
        });
        let addr = RawAddr::new(Gid::from_ip(cfg.bind), local.port(), qkey);
        let state = State {
            ctx: Ctx {
                io: Io {
                    sock,
                    v6: local.is_ipv6(),
                    tx: Vec::with_capacity(cfg.mtu + wire::MAX_OVERHEAD),
                    faults,
                    counters,
                    out: TxBatch::new(cfg.gso),
                    #[cfg(test)]
                    inject: None,
                },
                cfg: cfg.clone(),
                qkey,
                rnr_retry: attr.rnr_retry,
                cq: Completions::default(),
                recvs: VecDeque::new(),
                held: Vec::new(),
                rdma: Rdma::new(
                    keys,
                    cfg.unsolicited_write_recv && attr.unsolicited_write_recv.unwrap_or(true),
                ),
            },
            qp_type: attr.qp_type,
            closed: false,
            slots: WrSlots::new(
                attr.send_depth.clamp(1, cfg.max_send_wr),
                attr.recv_depth.clamp(1, cfg.max_recv_wr),
            ),
            gro,
            rx: Some(mmsg::RxBatch::new(RX_SCRATCH, 1)),
            rx_batch: None,
            srd: Srd::new(Instant::now(), &cfg),
            thread_deadline: None,
            quiet_until: None,
            idle: true,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
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
        })
    }
}

impl QueuePair for UdpQp {
    fn addr(&self) -> RawAddr {
        self.addr
    }

    fn post_write(
        &mut self,
        wr_id: u64,
        dest: RawAddr,
        local: bytes::Bytes,
        remote: crate::device::RemoteIov,
        imm: Option<u32>,
    ) -> Result<()> {
        let mut st = self.shared.state.lock();
        let now = Instant::now();
        st.post_rdma(
            now,
            |cx, to, chunk| cx.rdma_write(wr_id, to, dest, local, remote, imm, chunk),
            &dest,
            "post_write",
        )?;
        self.shared.after_post(st);
        Ok(())
    }

    fn post_read(
        &mut self,
        wr_id: u64,
        dest: RawAddr,
        local: BytesMut,
        remote: crate::device::RemoteIov,
    ) -> Result<()> {
        let mut st = self.shared.state.lock();
        let now = Instant::now();
        st.post_rdma(
            now,
            |cx, to, _| cx.rdma_read(wr_id, to, dest, local, remote),
            &dest,
            "post_read",
        )?;
        self.shared.after_post(st);
        Ok(())
    }

    fn qp_type(&self) -> QpType {
        self.qp_type
    }

    fn unsolicited_write_recv(&self) -> bool {
        self.shared.state.lock().ctx.rdma.unsolicited
    }

    fn hold_source(&mut self, src: Source, hold: bool) -> bool {
        let mut st = self.shared.state.lock();
        if st.qp_type != QpType::Srd {
            return false;
        }
        let held = &mut st.ctx.held;
        held.retain(|s| *s != src);
        if hold {
            held.push(src);
        }
        true
    }

    fn modify(&mut self, m: crate::device::QpModify) -> Result<()> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "modify_qp"));
        }
        if let Some(qkey) = m.qkey {
            st.ctx.qkey = qkey;
            self.addr = RawAddr::new(self.addr.gid, self.addr.qpn, qkey);
        }
        if let Some(r) = m.rnr_retry {
            st.ctx.rnr_retry = r;
        }
        Ok(())
    }

    fn post_send(&mut self, wr: SendWr) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.post_send(wr, Instant::now())?;
        self.shared.after_post(st);
        Ok(())
    }

    fn post_send_list(
        &mut self,
        wrs: &mut VecDeque<SendWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut st = self.shared.state.lock();
        let now = Instant::now();
        st.begin_batch();
        let mut r = Ok(());
        while let Some(wr) = wrs.pop_front() {
            let wr_id = wr.wr_id;
            if let Err(e) = st.post_send(wr, now) {
                r = Err((wr_id, e));
                break;
            }
        }
        st.end_batch();
        self.shared.after_post(st);
        r
    }

    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()> {
        let mut st = self.shared.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "post_recv"));
        }
        st.slots.take_recv()?;
        st.ctx.recvs.push_back((wr_id, buf));
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        let now = Instant::now();
        let (_, acks_left) = self.shared.progress(APP_BUDGET, false, now);
        self.shared.busy.polled(now, acks_left);
        let mut st = self.shared.state.lock();
        let st = &mut *st;
        st.ctx.cq.poll_into(&mut st.slots, out, max)
    }

    fn close(&mut self) {
        {
            let mut st = self.shared.state.lock();
            if !st.closed {
                st.closed = true;
                st.flush();
                tracing::debug!(addr = %self.addr, "udp: queue pair closed");
            }
            st.ctx.cq.take_new();
        }
        self.thread.stop();
        self.shared.notifier.notify();
    }
}

impl Drop for UdpQp {
    fn drop(&mut self) {
        // As `close`: held-back acknowledgements go out before the socket does.
        let mut st = self.shared.state.lock();
        if !st.closed && st.qp_type == QpType::Srd {
            let now = Instant::now();
            let st = &mut *st;
            st.srd.flush_acks(&mut st.ctx, now, true);
        }
        drop(st);
        self.thread.stop();
    }
}

#[cfg(test)]
mod tests;
