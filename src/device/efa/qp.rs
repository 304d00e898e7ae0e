//! [`EfaQp`]: the seam's [`QueuePair`] on a [`Nic`] — bounce-buffer copies, work-request
//! bookkeeping, completion matching, UD GRH stripping, close and flush.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::mr::{ACCESS_LOCAL_WRITE, LocalKey, LocalKeys, MrCache, SlotPool};
use super::nic::{Nic, Payload, RawWc, Registration, SendOp, SendWqe, release_or_leak};
use super::status::status_from_wc;
use super::verbs_error;
use super::wr::WrTable;
use super::{GRH_LEN, UNSOLICITED_WR_ID};
use crate::addr::RawAddr;
use crate::device::queues::{drain_into, fill_recv};
use crate::device::{
    DeviceCaps, DeviceCompletion, Opcode, QpType, QueuePair, RdmaKind, RdmaWr, RemoteIov, SendWr,
    Source, Status, rdma_posts_by_wr,
};
use crate::error::{Error, ErrorKind, Result};
use crate::mem::RegionSlice;
use crate::notify::Notifier;
use crate::stats::{self, DeviceCounters};

/// Device completions read per `poll` call at most.
const POLL_BATCH: usize = 64;
/// On close, how long to wait for outstanding sends to complete before the queue pair is destroyed.
const CLOSE_DRAIN: Duration = Duration::from_millis(50);
/// On close, stop waiting after this long without any completion.
const CLOSE_QUIET: Duration = Duration::from_millis(2);

/// What an outstanding work request owns, released at its completion.
enum Res<N: Nic> {
    Send {
        /// Send slot (`None`: the data went inline).
        slot: Option<u32>,
        _ah: Arc<N::Ah>,
        len: usize,
    },
    Recv {
        slot: u32,
        buf: BytesMut,
    },
    Read {
        /// Deregistered before `buf` is handed back.
        mr: Option<N::Mr>,
        buf: BytesMut,
        _ah: Arc<N::Ah>,
        len: usize,
    },
    Write {
        /// Dropped before `src` (deregistered then, unless the MR cache holds it too).
        mr: Option<Arc<N::Mr>>,
        src: Bytes,
        _ah: Arc<N::Ah>,
        len: usize,
    },
    /// An RDMA read into, or write from, region memory under the region's own registration.
    Region {
        _local: RegionSlice,
        _ah: Arc<N::Ah>,
        len: usize,
        read: bool,
    },
}

/// Limits and capabilities a queue pair enforces.
#[derive(Clone, Copy, Debug)]
pub struct QpLimits {
    /// Largest datagram.
    pub mtu: usize,
    /// Largest inline send (0: never inline).
    pub inline_size: usize,
    /// Send queue depth (sends, reads and writes).
    pub send_depth: usize,
    /// Receive queue depth.
    pub recv_depth: usize,
    /// RDMA capabilities.
    pub caps: DeviceCaps,
    /// Largest RDMA read/write.
    pub max_rdma_size: u64,
    /// Put the bounce pools on huge pages when the system has them (`FI_EFA_USE_HUGE_PAGE`).
    pub huge_pages: bool,
}

/// The payload a receive slot holds: for UD the NIC put a 40-byte GRH in front of the datagram,
/// which is stripped; for SRD the datagram starts the slot. `None` when `byte_len` is impossible
/// (shorter than the GRH, or longer than the slot).
pub fn recv_payload(qp_type: QpType, slot: &[u8], byte_len: u32) -> Option<&[u8]> {
    let len = byte_len as usize;
    match qp_type {
        QpType::Ud if len < GRH_LEN => None,
        QpType::Ud => slot.get(GRH_LEN..len),
        QpType::Srd => slot.get(..len),
    }
}

/// A queue pair of the efa device: the seam on top of a [`Nic`].
pub struct EfaQp<N: Nic> {
    nic: N,
    addr: RawAddr,
    qp_type: QpType,
    limits: QpLimits,
    table: WrTable<Res<N>>,
    /// `None` only after being leaked (a failed destroy).
    send_pool: Option<SlotPool<N::Mr>>,
    recv_pool: Option<SlotPool<N::Mr>>,
    sends: usize,
    /// RDMA work requests recorded for a list not yet posted (they hold send-queue places).
    staged: usize,
    recvs: usize,
    pending: VecDeque<DeviceCompletion>,
    raw: Vec<RawWc>,
    closed: bool,
    destroyed: bool,
    /// The QP could not be destroyed: never free what it was given.
    leak: bool,
    notifier: Arc<Notifier>,
    counters: Arc<DeviceCounters>,
    /// Completions matching no outstanding work request (device-wide).
    strays: Arc<AtomicU64>,
    /// The device's region registrations (`post_*_region`).
    local_keys: Arc<LocalKeys>,
    /// The device's cache of write-buffer registrations (`None`: register per operation).
    mr_cache: Option<Arc<MrCache<N::Mr>>>,
}

impl<N: Nic> fmt::Debug for EfaQp<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EfaQp")
            .field("addr", &self.addr)
            .field("qp_type", &self.qp_type)
            .field("outstanding", &self.table.len())
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl<N: Nic> EfaQp<N> {
    /// Wraps a NIC whose queue pair is ready (RTS): allocates and registers the bounce pools
    /// (`send_depth` slots of MTU bytes, `recv_depth` of MTU bytes plus the GRH for UD).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        nic: N,
        addr: RawAddr,
        qp_type: QpType,
        limits: QpLimits,
        notifier: Arc<Notifier>,
        counters: Arc<DeviceCounters>,
        strays: Arc<AtomicU64>,
    ) -> Result<EfaQp<N>> {
        let recv_slot = match qp_type {
            QpType::Ud => limits.mtu + GRH_LEN,
            QpType::Srd => limits.mtu,
        };
        let huge = limits.huge_pages;
        let send_pool = SlotPool::new(&nic, limits.mtu.max(1), limits.send_depth.max(1), huge)?;
        let recv_pool = SlotPool::new(&nic, recv_slot, limits.recv_depth.max(1), huge)?;
        for p in [&send_pool, &recv_pool] {
            if p.is_huge() {
                stats::add(&counters.huge_page_bytes, p.len_bytes() as u64);
            } else if huge {
                stats::inc(&counters.huge_page_fallbacks);
            }
        }
        Ok(EfaQp {
            nic,
            addr,
            qp_type,
            limits,
            table: WrTable::new(),
            send_pool: Some(send_pool),
            recv_pool: Some(recv_pool),
            sends: 0,
            staged: 0,
            recvs: 0,
            pending: VecDeque::new(),
            raw: Vec::with_capacity(POLL_BATCH),
            closed: false,
            destroyed: false,
            leak: false,
            notifier,
            counters,
            strays,
            local_keys: Arc::default(),
            mr_cache: None,
        })
    }

    /// Shares the device's MR cache with this queue pair: RDMA writes reuse the registrations
    /// of buffers written before.
    pub fn set_mr_cache(&mut self, cache: Arc<MrCache<N::Mr>>) {
        self.mr_cache = Some(cache);
    }

    /// Shares the device's region registrations with this queue pair, for
    /// [`QueuePair::post_read_region`] and [`QueuePair::post_write_region`].
    pub fn set_local_keys(&mut self, keys: Arc<LocalKeys>) {
        self.local_keys = keys;
    }

    /// The NIC (tests).
    #[cfg(test)]
    pub(crate) fn nic_mut(&mut self) -> &mut N {
        &mut self.nic
    }

    fn check_open(&self, op: &'static str) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, op));
        }
        Ok(())
    }

    fn send_room(&self, op: &'static str) -> Result<()> {
        if self.sends + self.staged >= self.limits.send_depth {
            return Err(Error::new(ErrorKind::Again, op).with_detail(format!(
                "send queue full ({} work requests)",
                self.limits.send_depth
            )));
        }
        Ok(())
    }

    /// Posts `wqe` (already recorded under `wqe.wr_id`); on refusal takes the record back and
    /// releases what it owned.
    fn post(&mut self, wqe: &SendWqe<'_, N::Ah>, verb: &'static str) -> Result<()> {
        match self.nic.post_send(wqe) {
            Ok(()) => {
                self.sends += 1;
                Ok(())
            }
            Err(errno) => {
                if let Some((_, res)) = self.table.cancel(wqe.wr_id) {
                    self.release(res);
                }
                Err(post_error(verb, errno))
            }
        }
    }

    /// Releases what a work request owned without reporting it (posting failed).
    fn release(&mut self, res: Res<N>) {
        match res {
            Res::Send { slot: Some(s), .. } => {
                if let Some(p) = self.send_pool.as_mut() {
                    p.release(s);
                }
            }
            Res::Recv { slot, .. } => {
                if let Some(p) = self.recv_pool.as_mut() {
                    p.release(slot);
                }
            }
            Res::Read { mr, buf, .. } => {
                if deregistered(mr) {
                    drop(buf);
                } else {
                    std::mem::forget(buf);
                }
            }
            Res::Write { mr, src, .. } => {
                if let Some(mr) = mr {
                    release_or_leak(mr, src);
                }
            }
            Res::Send { slot: None, .. } | Res::Region { .. } => {}
        }
    }

    fn source(&self, raw: &RawWc) -> Option<Source> {
        let by_ahn = u16::try_from(raw.slid)
            .ok()
            .filter(|a| u32::from(*a) != super::verbs::AHN_UNKNOWN)
            .and_then(|a| self.nic.gid_of_ahn(a));
        let qpn = u16::try_from(raw.src_qp).ok()?;
        if let (None, Some(g)) = (by_ahn, raw.sgid) {
            // A sender we hold no AH for: make one now, as libfabric's implicit AV insertion
            // does, so that its RDMA to us is accepted (EFA refuses RDMA from initiators the
            // target has no AH for, status 14) and its next packets name it by AHN.
            if let Err(e) = self.nic.address_handle(&g) {
                tracing::debug!(gid = %g, error = %e, "efa: no AH for a new sender");
            }
        }
        // No AH for the sender and no source GID from the CQ: the queue pair number is all the
        // device tells; the engine identifies the sender by its REQ's raw address header.
        let gid = by_ahn.or(raw.sgid).unwrap_or(crate::Gid::UNKNOWN);
        Some(Source { gid, qpn })
    }

    /// Turns one device completion into the seam's, releasing what its work request owned.
    /// `None` for a completion that matches no outstanding work request.
    fn complete(&mut self, raw: &RawWc) -> Option<DeviceCompletion> {
        let status = status_from_wc(raw.status, raw.vendor_err);
        if raw.unsolicited {
            return Some(DeviceCompletion {
                wr_id: UNSOLICITED_WR_ID,
                status,
                opcode: Opcode::RecvRdmaWithImm,
                byte_len: raw.byte_len as usize,
                src: if status.is_ok() {
                    self.source(raw)
                } else {
                    None
                },
                imm: raw.imm,
                buf: None,
            });
        }
        let (wr_id, res) = match self.table.take(raw.wr_id) {
            Ok(x) => x,
            Err(miss) => {
                self.strays.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(token = raw.wr_id, ?miss, status = ?status, "efa: completion for no outstanding work request; ignored");
                return None;
            }
        };
        Some(self.finish(wr_id, res, status, raw))
    }

    fn finish(&mut self, wr_id: u64, res: Res<N>, status: Status, raw: &RawWc) -> DeviceCompletion {
        let ok = status.is_ok();
        let c = &self.counters;
        match res {
            Res::Send { slot, len, .. } => {
                self.sends = self.sends.saturating_sub(1);
                if let (Some(s), Some(p)) = (slot, self.send_pool.as_mut()) {
                    p.release(s);
                }
                if ok {
                    stats::inc(&c.tx_pkts);
                    stats::add(&c.tx_bytes, len as u64);
                } else if status != Status::Flushed {
                    stats::inc(&c.send_errors);
                    if status == Status::RnrRetryExceeded {
                        stats::inc(&c.rnr_events);
                    }
                }
                DeviceCompletion::new(wr_id, status, Opcode::Send, if ok { len } else { 0 })
            }
            Res::Recv { slot, mut buf } => {
                self.recvs = self.recvs.saturating_sub(1);
                let mut out = DeviceCompletion::new(wr_id, status, Opcode::Recv, 0);
                if ok && raw.opcode == rdma_sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    // The target side of an RDMA write with immediate data: the data went to the
                    // registered target region; this buffer only carried the notification.
                    buf.clear();
                    out.opcode = Opcode::RecvRdmaWithImm;
                    out.byte_len = raw.byte_len as usize;
                } else if ok {
                    let data = self.recv_pool.as_ref().and_then(|p| {
                        // SAFETY: the work request completed, so the NIC no longer writes the slot.
                        let bytes = unsafe { p.slot(slot) };
                        recv_payload(self.qp_type, bytes, raw.byte_len)
                    });
                    match data {
                        Some(d) => {
                            out.status = fill_recv(&mut buf, d);
                            out.byte_len = d.len();
                            stats::inc(&c.rx_pkts);
                            stats::add(&c.rx_bytes, d.len() as u64);
                        }
                        None => {
                            tracing::warn!(byte_len = raw.byte_len, qp_type = ?self.qp_type, "efa: receive completion with an impossible length");
                            buf.clear();
                            out.status = Status::LocalQpInternalError;
                        }
                    }
                } else {
                    buf.clear();
                }
                if let Some(p) = self.recv_pool.as_mut() {
                    p.release(slot);
                }
                if out.status.is_ok() || out.status == Status::LocalBadLength {
                    out.src = self.source(raw);
                    out.imm = raw.imm;
                }
                out.buf = Some(buf);
                out
            }
            Res::Read {
                mr, mut buf, len, ..
            } => {
                self.sends = self.sends.saturating_sub(1);
                // Deregister before the buffer is handed back: after this the NIC cannot write it.
                if !deregistered(mr) {
                    // The NIC may still write the buffer: it is never handed back or freed.
                    std::mem::forget(buf);
                    return DeviceCompletion::new(
                        wr_id,
                        Status::LocalQpInternalError,
                        Opcode::RdmaRead,
                        0,
                    );
                }
                if ok {
                    // SAFETY: a successful read wrote exactly `len` bytes at the start of the
                    // buffer's capacity (`len <= capacity` was checked at posting), so they are
                    // initialized; the registration is gone.
                    unsafe { buf.set_len(len) };
                    stats::inc(&c.rdma_ops);
                    stats::add(&c.rdma_bytes, len as u64);
                } else {
                    buf.clear();
                }
                let mut out = DeviceCompletion::new(
                    wr_id,
                    status,
                    Opcode::RdmaRead,
                    if ok { len } else { 0 },
                );
                out.buf = Some(buf);
                out
            }
            Res::Write { mr, src, len, .. } => {
                self.sends = self.sends.saturating_sub(1);
                // The last reference deregisters; a refusal leaks the buffer (the NIC may
                // still read it) and the write completes all the same: its data went or not.
                if let Some(mr) = mr {
                    release_or_leak(mr, src);
                }
                if ok {
                    stats::inc(&c.rdma_ops);
                    stats::add(&c.rdma_bytes, len as u64);
                }
                DeviceCompletion::new(wr_id, status, Opcode::RdmaWrite, if ok { len } else { 0 })
            }
            Res::Region { len, read, .. } => {
                self.sends = self.sends.saturating_sub(1);
                if ok {
                    stats::inc(&c.rdma_ops);
                    stats::add(&c.rdma_bytes, len as u64);
                }
                let opcode = if read {
                    Opcode::RdmaRead
                } else {
                    Opcode::RdmaWrite
                };
                DeviceCompletion::new(wr_id, status, opcode, if ok { len } else { 0 })
            }
        }
    }

    /// Reads up to `max` device completions and queues the seam's in `pending`; returns how many
    /// device completions were read.
    fn reap(&mut self, max: usize) -> usize {
        if self.destroyed || max == 0 {
            return 0;
        }
        let mut raw = std::mem::take(&mut self.raw);
        raw.clear();
        if let Err(errno) = self.nic.poll(max.min(POLL_BATCH), &mut raw) {
            tracing::warn!(errno, "efa: polling the completion queue failed");
        }
        let n = raw.len();
        for r in &raw {
            if let Some(c) = self.complete(r) {
                self.pending.push_back(c);
            }
        }
        self.raw = raw;
        n
    }

    /// Destroys the QP (the NIC stops touching every buffer), remembering a failure.
    fn destroy_nic(&mut self) {
        if !self.destroyed {
            self.destroyed = true;
            if !self.nic.destroy() {
                self.leak = true;
            }
        }
    }

    /// Completes every outstanding work request with `Flushed`; the QP must be destroyed.
    fn flush_all(&mut self) {
        debug_assert!(self.destroyed);
        for (wr_id, res) in self.table.drain() {
            let c = if self.leak {
                // The NIC may still write these buffers: never release them.
                let opcode = match &res {
                    Res::Send { .. } => Opcode::Send,
                    Res::Recv { .. } => Opcode::Recv,
                    Res::Read { .. } => Opcode::RdmaRead,
                    Res::Write { .. } | Res::Region { read: false, .. } => Opcode::RdmaWrite,
                    Res::Region { read: true, .. } => Opcode::RdmaRead,
                };
                std::mem::forget(res);
                DeviceCompletion::new(wr_id, Status::Flushed, opcode, 0)
            } else {
                let raw = RawWc::default();
                self.finish(wr_id, res, Status::Flushed, &raw)
            };
            self.pending.push_back(c);
        }
        self.sends = 0;
        self.recvs = 0;
    }
}

/// The error of a refused post: a full queue is `Again`, anything else names the verb.
fn post_error(verb: &'static str, errno: i32) -> Error {
    if super::verbs_nic::is_queue_full(errno) {
        Error::new(ErrorKind::Again, verb)
            .with_detail(format!("the device queue is full (errno {errno})"))
    } else {
        verbs_error(verb, errno)
    }
}

/// A free slot of a bounce-buffer pool for `op`: `Closed` once the pool is gone (the queue pair
/// is closed), `Again` with `none_free` when every slot is in use.
fn take_slot<'p, M: Registration>(
    pool: &'p mut Option<SlotPool<M>>,
    op: &'static str,
    none_free: &'static str,
) -> Result<(&'p mut SlotPool<M>, u32)> {
    let pool = pool
        .as_mut()
        .ok_or_else(|| Error::new(ErrorKind::Closed, op))?;
    let slot = pool
        .alloc()
        .ok_or_else(|| Error::new(ErrorKind::Again, op).with_detail(none_free))?;
    Ok((pool, slot))
}

impl<N: Nic> QueuePair for EfaQp<N> {
    fn addr(&self) -> RawAddr {
        self.addr
    }

    fn unsolicited_write_recv(&self) -> bool {
        self.limits.caps.unsolicited_write_recv
    }

    fn qp_type(&self) -> QpType {
        self.qp_type
    }

    fn post_send(&mut self, wr: SendWr) -> Result<()> {
        let wr = self.stage_send(wr)?;
        self.post_staged(wr)
    }

    /// One doorbell for the list, as [`post_rdma_list`](QueuePair::post_rdma_list) does.
    fn post_send_list(
        &mut self,
        wrs: &mut VecDeque<SendWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        self.post_list(wrs, |w| w.wr_id, Self::stage_send)
    }

    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()> {
        self.check_open("post_recv")?;
        if self.recvs >= self.limits.recv_depth {
            return Err(
                Error::new(ErrorKind::Again, "post_recv").with_detail(format!(
                    "receive queue full ({} work requests)",
                    self.limits.recv_depth
                )),
            );
        }
        let (pool, slot) = take_slot(&mut self.recv_pool, "post_recv", "no free receive buffer")?;
        let sge = pool.sge(slot, pool.slot_size());
        let token = self.table.insert(wr_id, Res::Recv { slot, buf });
        match self.nic.post_recv(token, sge) {
            Ok(()) => {
                self.recvs += 1;
                Ok(())
            }
            Err(errno) => {
                if let Some((_, res)) = self.table.cancel(token) {
                    self.release(res);
                }
                Err(post_error("ibv_post_recv", errno))
            }
        }
    }

    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        if self.pending.len() < max {
            // The CQ is armed only by a waiter about to sleep (`cq::Armer`), never here: a
            // busy-polling program gets no completion events.
            self.reap(max - self.pending.len());
        }
        let n = drain_into(&mut self.pending, out, max);
        if n > 0 {
            self.notifier.notify();
        }
        n
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if !self.destroyed {
            if let Err(e) = self.nic.to_error() {
                tracing::debug!(error = %e, "efa: moving the queue pair to ERR failed");
            }
            // Give outstanding sends (and whatever the device flushes) a moment to complete;
            // receives alone are not waited for beyond a short quiet period.
            let start = Instant::now();
            let mut last = start;
            while !self.table.is_empty() && start.elapsed() < CLOSE_DRAIN {
                if self.sends == 0 && last.elapsed() >= CLOSE_QUIET {
                    break;
                }
                if self.reap(POLL_BATCH) > 0 {
                    last = Instant::now();
                } else {
                    std::thread::yield_now();
                }
            }
            self.destroy_nic();
        }
        self.flush_all();
        tracing::debug!(addr = %self.addr, "efa: queue pair closed");
        self.notifier.notify();
    }

    rdma_posts_by_wr!(post_read, post_write, post_read_region, post_write_region);

    /// One doorbell for the list: every work request is checked and recorded, then all go to
    /// the NIC in one `ibv_wr_start` .. `ibv_wr_complete` session. The first that cannot be
    /// recorded ends the list (its error comes back; those before it are posted). Should the
    /// NIC refuse the whole session, each is posted alone and one it refuses then completes
    /// with an error: none is lost.
    fn post_rdma_list(
        &mut self,
        wrs: &mut VecDeque<RdmaWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        // Region work requests name their registration's key: the device's key table stays
        // locked until the NIC has them, so no registration goes away in between.
        let keys = self.local_keys.clone();
        let mut table = None;
        let r = self.post_list(
            wrs,
            |w| w.wr_id,
            |qp, RdmaWr { wr_id, dest, kind }| match kind {
                RdmaKind::Write { local, remote, imm } => {
                    qp.stage_write(wr_id, dest, local, remote, imm)
                }
                RdmaKind::Read { local, remote } => qp.stage_read(wr_id, dest, local, remote),
                RdmaKind::WriteRegion { local, remote, imm } => {
                    let t = table.get_or_insert_with(|| keys.0.lock());
                    qp.stage_region(t, wr_id, dest, local, remote, Some(imm))
                }
                RdmaKind::ReadRegion { local, remote } => {
                    let t = table.get_or_insert_with(|| keys.0.lock());
                    qp.stage_region(t, wr_id, dest, local, remote, None)
                }
            },
        );
        drop(table);
        r
    }

    fn region_rdma(&self) -> bool {
        self.qp_type == QpType::Srd && (self.limits.caps.rdma_read || self.limits.caps.rdma_write)
    }
}

impl<N: Nic> EfaQp<N> {
    /// One one-sided work request (`post_read`, `post_write`, `post_read_region`,
    /// `post_write_region`): checked, recorded and posted alone.
    fn post_one_rdma(&mut self, RdmaWr { wr_id, dest, kind }: RdmaWr) -> Result<()> {
        let wr = match kind {
            RdmaKind::Write { local, remote, imm } => {
                self.stage_write(wr_id, dest, local, remote, imm)?
            }
            RdmaKind::Read { local, remote } => self.stage_read(wr_id, dest, local, remote)?,
            RdmaKind::WriteRegion { local, remote, imm } => {
                return self.post_region(wr_id, dest, local, remote, Some(imm));
            }
            RdmaKind::ReadRegion { local, remote } => {
                return self.post_region(wr_id, dest, local, remote, None);
            }
        };
        self.post_staged(wr)
    }

    /// `post_read_region` (`write` is `None`) and `post_write_region` (`Some(imm)`): the work
    /// request names the region's own registration, looked up and posted under the lock of the
    /// device's key table, so the registration cannot go away in between.
    fn post_region(
        &mut self,
        wr_id: u64,
        dest: RawAddr,
        local: RegionSlice,
        remote: RemoteIov,
        write: Option<Option<u32>>,
    ) -> Result<()> {
        let keys = self.local_keys.clone();
        let table = keys.0.lock();
        let wr = self.stage_region(&table, wr_id, dest, local, remote, write)?;
        let r = self.post_staged(wr);
        drop(table);
        r
    }

    /// Checks a send and records it: copied into a registered bounce slot, or kept for inline
    /// posting when it fits the inline size.
    fn stage_send(&mut self, wr: SendWr) -> Result<Staged<N::Ah>> {
        self.check_open("post_send")?;
        let len = wr.len();
        if len > self.limits.mtu {
            return Err(Error::new(ErrorKind::MsgSize, "post_send")
                .with_detail(format!("{len} bytes > MTU {}", self.limits.mtu)));
        }
        self.send_room("post_send")?;
        let ah = self.nic.address_handle(&wr.dest.gid)?;
        let slot = if len <= self.limits.inline_size {
            None
        } else {
            let (pool, s) = take_slot(&mut self.send_pool, "post_send", "no free send buffer")?;
            // SAFETY: a free slot is posted to nothing.
            let bytes = unsafe { pool.slot_mut(s) };
            let (h, p) = (wr.hdr.len(), wr.payload.len());
            if let Some(dst) = bytes.get_mut(..h + p) {
                let (dh, dp) = dst.split_at_mut(h);
                dh.copy_from_slice(&wr.hdr);
                dp.copy_from_slice(&wr.payload);
            }
            Some(s)
        };
        let (payload, inline) = match (slot, self.send_pool.as_ref()) {
            (Some(s), Some(p)) => (Payload::Sge(p.sge(s, len)), None),
            _ => (Payload::Empty, Some([wr.hdr, wr.payload])),
        };
        let res = Res::Send {
            slot,
            _ah: ah.clone(),
            len,
        };
        let op = SendOp::Send { imm: wr.imm };
        let mut staged = self.stage(wr.wr_id, res, op, ah, wr.dest, payload, "ibv_wr_send");
        staged.inline = inline;
        Ok(staged)
    }

    /// Checks an RDMA read into `local` (registered here for the operation) and records it.
    fn stage_read(
        &mut self,
        wr_id: u64,
        dest: RawAddr,
        mut local: BytesMut,
        remote: RemoteIov,
    ) -> Result<Staged<N::Ah>> {
        self.rdma_allowed("post_read", false)?;
        let len = self.rdma_len("post_read", remote, local.capacity() as u64)?;
        let (rkey, ah) = self.rdma_target("post_read", remote, &dest)?;
        local.clear();
        let mr = if len > 0 {
            let ptr = local.spare_capacity_mut().as_mut_ptr().cast::<u8>();
            // SAFETY: the buffer's capacity (≥ len) stays allocated and in place while the
            // work request owns it; nothing reads or writes it until its completion, which
            // deregisters before handing it back.
            let mr = unsafe { self.nic.register(ptr, len, ACCESS_LOCAL_WRITE) }?;
            stats::inc(&self.counters.mr_registrations);
            Some(mr)
        } else {
            None
        };
        let addr = local.spare_capacity_mut().as_mut_ptr() as u64;
        let payload = self.local_sge(mr.as_ref(), addr, len);
        let op = SendOp::Read {
            rkey,
            raddr: remote.addr,
        };
        let res = Res::Read {
            mr,
            buf: local,
            _ah: ah.clone(),
            len,
        };
        Ok(self.stage(wr_id, res, op, ah, dest, payload, "ibv_wr_rdma_read"))
    }

    /// Checks an RDMA write of `local` (registered through the MR cache) and records it.
    fn stage_write(
        &mut self,
        wr_id: u64,
        dest: RawAddr,
        local: Bytes,
        remote: RemoteIov,
        imm: Option<u32>,
    ) -> Result<Staged<N::Ah>> {
        self.rdma_allowed("post_write", true)?;
        let len = local.len();
        if len as u64 > remote.len {
            return Err(Error::new(ErrorKind::InvalidArgument, "post_write")
                .with_detail(format!("{len} bytes into a remote range of {}", remote.len)));
        }
        self.rdma_len(
            "post_write",
            RemoteIov {
                len: len as u64,
                ..remote
            },
            len as u64,
        )?;
        let (rkey, ah) = self.rdma_target("post_write", remote, &dest)?;
        let mr = if len > 0 {
            // SAFETY: `local` is kept by the work request until its completion, which drops
            // the registration (deregistering it unless the MR cache keeps it, together with
            // a clone of `local`) before dropping `local`; the NIC only reads it.
            let register = || unsafe { self.nic.register(local.as_ptr().cast_mut(), len, 0) };
            let (mr, hit) = match &self.mr_cache {
                Some(cache) => cache.get(&local, register)?,
                None => (Arc::new(register()?), false),
            };
            stats::inc(if hit {
                &self.counters.mr_cache_hits
            } else {
                &self.counters.mr_registrations
            });
            Some(mr)
        } else {
            None
        };
        let payload = self.local_sge(mr.as_deref(), local.as_ptr() as u64, len);
        let op = SendOp::Write {
            rkey,
            raddr: remote.addr,
            imm,
        };
        let res = Res::Write {
            mr,
            src: local,
            _ah: ah.clone(),
            len,
        };
        Ok(self.stage(wr_id, res, op, ah, dest, payload, "ibv_wr_rdma_write"))
    }

    /// Checks a region read (`write` is `None`) or write (`Some(imm)`) against the device's key
    /// `table` (locked by the caller until the work request is posted) and records it.
    #[allow(clippy::too_many_arguments)]
    fn stage_region(
        &mut self,
        table: &HashMap<u64, LocalKey>,
        wr_id: u64,
        dest: RawAddr,
        local: RegionSlice,
        remote: RemoteIov,
        write: Option<Option<u32>>,
    ) -> Result<Staged<N::Ah>> {
        let (op, verb) = match write {
            None => ("post_read_region", "ibv_wr_rdma_read"),
            Some(_) => ("post_write_region", "ibv_wr_rdma_write"),
        };
        self.rdma_allowed(op, write.is_some())?;
        let len = match write {
            None => self.rdma_len(op, remote, local.len as u64)?,
            Some(_) if remote.len != local.len as u64 => {
                return Err(
                    Error::new(ErrorKind::InvalidArgument, op).with_detail(format!(
                        "{} bytes into a remote range of {}",
                        local.len, remote.len
                    )),
                );
            }
            Some(_) => self.rdma_len(op, remote, local.len as u64)?,
        };
        let (rkey, ah) = self.rdma_target(op, remote, &dest)?;
        let lkey = table
            .get(&local.key)
            .and_then(|k| k.covering(local.addr, len))
            .filter(|_| local.in_bounds())
            .ok_or_else(|| {
                Error::new(ErrorKind::InvalidArgument, op).with_detail(format!(
                    "{len} bytes at {:#x} are not inside a live registration of key {}",
                    local.addr, local.key
                ))
            })?;
        let payload = if len > 0 {
            Payload::Sge(super::nic::Sge {
                addr: local.addr,
                len: len as u32,
                lkey,
            })
        } else {
            self.empty_sge()
        };
        let send_op = match write {
            None => SendOp::Read {
                rkey,
                raddr: remote.addr,
            },
            Some(imm) => SendOp::Write {
                rkey,
                raddr: remote.addr,
                imm,
            },
        };
        let res = Res::Region {
            _local: local,
            _ah: ah.clone(),
            len,
            read: write.is_none(),
        };
        Ok(self.stage(wr_id, res, send_op, ah, dest, payload, verb))
    }

    /// Records a checked RDMA work request; it holds a place in the send queue from now on.
    #[allow(clippy::too_many_arguments)]
    fn stage(
        &mut self,
        wr_id: u64,
        res: Res<N>,
        op: SendOp,
        ah: Arc<N::Ah>,
        dest: RawAddr,
        payload: Payload<'static>,
        verb: &'static str,
    ) -> Staged<N::Ah> {
        let token = self.table.insert(wr_id, res);
        self.staged += 1;
        Staged {
            token,
            op,
            ah,
            dest,
            payload,
            inline: None,
            verb,
        }
    }

    /// A list of `post_send_list` / `post_rdma_list`: stages the work requests at the front of
    /// `wrs` (popping each) until one is refused, posts those staged behind one doorbell, and
    /// returns the refused one's `wr_id` (by `id`) and error; the rest stay in `wrs`.
    fn post_list<W>(
        &mut self,
        wrs: &mut VecDeque<W>,
        id: impl Fn(&W) -> u64,
        mut stage: impl FnMut(&mut Self, W) -> Result<Staged<N::Ah>>,
    ) -> std::result::Result<(), (u64, Error)> {
        let mut staged = Vec::with_capacity(wrs.len());
        let mut refused = None;
        while let Some(wr) = wrs.pop_front() {
            let wr_id = id(&wr);
            match stage(self, wr) {
                Ok(w) => staged.push(w),
                Err(e) => {
                    refused = Some((wr_id, e));
                    break;
                }
            }
        }
        self.post_staged_list(staged);
        refused.map_or(Ok(()), Err)
    }

    /// Posts one staged work request; a refusal takes its record back and is the error.
    fn post_staged(&mut self, wr: Staged<N::Ah>) -> Result<()> {
        self.staged = 0;
        let segs = wr.segs();
        let wqe = wr.wqe(&segs);
        self.post(&wqe, wr.verb)
    }

    /// Posts staged work requests behind one doorbell. Should the NIC refuse the session, each
    /// is posted alone, and one refused then completes with an error (`pending`).
    fn post_staged_list(&mut self, list: Vec<Staged<N::Ah>>) {
        self.staged = 0;
        if list.is_empty() {
            return;
        }
        let segs: Vec<[&[u8]; 2]> = list.iter().map(Staged::segs).collect();
        let wqes: Vec<SendWqe<'_, N::Ah>> = list.iter().zip(&segs).map(|(w, g)| w.wqe(g)).collect();
        match self.nic.post_send_list(&wqes) {
            Ok(()) => {
                self.sends += wqes.len();
                if wqes.len() > 1 {
                    stats::inc(&self.counters.tx_batches);
                }
                return;
            }
            Err(errno) => tracing::debug!(
                errno,
                n = wqes.len(),
                "efa: a list post failed, posting one by one"
            ),
        }
        for wqe in &wqes {
            self.sends += 1;
            if let Err(errno) = self.nic.post_send(wqe) {
                tracing::warn!(errno, "efa: the NIC refused an RDMA work request");
                if let Some((wr_id, res)) = self.table.cancel(wqe.wr_id) {
                    // Completes it (handing back its buffer) and counts it out of the queue.
                    let c =
                        self.finish(wr_id, res, Status::LocalQpInternalError, &RawWc::default());
                    self.pending.push_back(c);
                }
            }
        }
    }

    /// The first checks of every RDMA post: the queue pair is open, SRD, and its device does
    /// this kind of RDMA (`write` or read).
    fn rdma_allowed(&self, op: &'static str, write: bool) -> Result<()> {
        self.check_open(op)?;
        let (can, what) = if write {
            (self.limits.caps.rdma_write, "write")
        } else {
            (self.limits.caps.rdma_read, "read")
        };
        if !can || self.qp_type != QpType::Srd {
            return Err(Error::new(ErrorKind::NotSupported, op)
                .with_detail(format!("no device RDMA {what} on this queue pair")));
        }
        Ok(())
    }

    /// The far side of an RDMA post, after its length checks: the remote key, room in the send
    /// queue, the address handle of `dest`.
    fn rdma_target(
        &self,
        op: &'static str,
        remote: RemoteIov,
        dest: &RawAddr,
    ) -> Result<(u32, Arc<N::Ah>)> {
        let rkey = rkey_of(op, remote.key)?;
        self.send_room(op)?;
        let ah = self.nic.address_handle(&dest.gid)?;
        Ok((rkey, ah))
    }

    /// The payload of a zero-byte RDMA operation: one zero-length SGE in the registered send
    /// pool, as libfabric posts (a work request with no SGE at all is not what EFA expects).
    fn empty_sge(&self) -> Payload<'static> {
        match self.send_pool.as_ref() {
            Some(p) => Payload::Sge(p.sge(0, 0)),
            None => Payload::Empty,
        }
    }

    /// The payload of an RDMA operation on the `len` local bytes at `addr`, registered as `mr`
    /// (`None`: a zero-byte operation, [`empty_sge`](Self::empty_sge)).
    fn local_sge(&self, mr: Option<&N::Mr>, addr: u64, len: usize) -> Payload<'static> {
        match mr {
            Some(m) => Payload::Sge(super::nic::Sge {
                addr,
                len: len as u32,
                lkey: m.lkey(),
            }),
            None => self.empty_sge(),
        }
    }

    /// The length of an RDMA operation on `remote` with `room` local bytes.
    fn rdma_len(&self, op: &'static str, remote: RemoteIov, room: u64) -> Result<usize> {
        if remote.len > room {
            return Err(
                Error::new(ErrorKind::InvalidArgument, op).with_detail(format!(
                    "remote range of {} bytes, local room {room}",
                    remote.len
                )),
            );
        }
        if remote.len > self.limits.max_rdma_size || remote.len > u64::from(u32::MAX) {
            return Err(Error::new(ErrorKind::MsgSize, op).with_detail(format!(
                "{} bytes > max_rdma_size {}",
                remote.len, self.limits.max_rdma_size
            )));
        }
        Ok(remote.len as usize)
    }
}

/// A work request checked and recorded (under `token`), not yet given to the NIC.
struct Staged<A> {
    token: u64,
    op: SendOp,
    ah: Arc<A>,
    dest: RawAddr,
    payload: Payload<'static>,
    /// A send posted inline: its header and payload (copied by the NIC at posting).
    inline: Option<[Bytes; 2]>,
    verb: &'static str,
}

impl<A> Staged<A> {
    /// The inline segments (empty unless `inline`).
    fn segs(&self) -> [&[u8]; 2] {
        match &self.inline {
            Some([h, p]) => [h, p],
            None => [&[], &[]],
        }
    }

    /// The work queue entry; `segs` is [`segs`](Staged::segs) of `self`.
    fn wqe<'a>(&'a self, segs: &'a [&'a [u8]; 2]) -> SendWqe<'a, A> {
        SendWqe {
            wr_id: self.token,
            op: self.op,
            ah: &self.ah,
            remote_qpn: u32::from(self.dest.qpn),
            remote_qkey: self.dest.qkey,
            payload: match self.inline {
                Some(_) => Payload::Inline(segs),
                None => self.payload,
            },
        }
    }
}

/// Deregisters a read buffer's own registration (if it has one): false when the NIC refused,
/// and the buffer must then be leaked.
fn deregistered<M: Registration>(mr: Option<M>) -> bool {
    mr.is_none_or(|mut m| m.deregister())
}

fn rkey_of(op: &'static str, key: u64) -> Result<u32> {
    u32::try_from(key).map_err(|_| {
        Error::new(ErrorKind::InvalidArgument, op)
            .with_detail(format!("remote key {key:#x} is not an EFA rkey"))
    })
}

impl<N: Nic> Drop for EfaQp<N> {
    fn drop(&mut self) {
        self.destroy_nic();
        // Release (or, after a failed destroy, leak) what outstanding work requests own; the
        // completions are not reported to anyone.
        self.flush_all();
        self.pending.clear();
        if self.leak {
            std::mem::forget(self.send_pool.take());
            std::mem::forget(self.recv_pool.take());
        }
    }
}

#[cfg(test)]
#[path = "qp_tests.rs"]
mod tests;
