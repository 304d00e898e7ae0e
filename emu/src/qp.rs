//! Queue pairs: SRD (`efadv_create_qp_ex`) and UD (`ibv_create_qp`), each over one queue pair of
//! the udp device. Posting copies the program's scatter/gather lists into owned buffers (after
//! checking every lkey, as the NIC's DMA engine would); completions copy received data back into
//! the posted buffers and become EFA work completions in the queue pair's CQs.

use std::collections::VecDeque;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::{
    DeviceCompletion, Opcode, QpType, QueuePair, RdmaKind, RdmaWr, RemoteIov, SendWr, Status,
    UNSOLICITED_WR_ID,
};
use efa::{Gid, RawAddr};
use parking_lot::Mutex;
use slab::Slab;

use crate::abi::*;
use crate::cq::{CqCore, Cqe};
use crate::nic::Nic;

/// Bytes of the global route header slot at the head of every UD receive buffer.
pub const GRH_LEN: usize = 40;

/// A posted work request waiting for its device completion.
pub enum Pending {
    /// A send or an RDMA write: nothing to copy back.
    Send { wr_id: u64 },
    /// An RDMA read: the data goes to these buffers (`sges`: where in this process; `named`:
    /// as the program named them, lkey and iova, checked again when the data arrives).
    Read {
        wr_id: u64,
        sges: Vec<ibv_sge>,
        named: Vec<ibv_sge>,
    },
    /// A receive: the data goes to these buffers (after the GRH slot on UD).
    Recv { wr_id: u64, sges: Vec<ibv_sge> },
}

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug)]
pub enum SendOp {
    Send {
        imm: Option<u32>,
    },
    Read {
        rkey: u32,
        addr: u64,
    },
    Write {
        rkey: u32,
        addr: u64,
        imm: Option<u32>,
    },
}

/// One send-queue work request, as built by `ibv_post_send` or the `ibv_wr_*` calls.
#[derive(Clone, Debug)]
pub struct SendReq {
    pub wr_id: u64,
    pub op: SendOp,
    /// Destination: AH's GID, QPN, QKEY.
    pub dest: Option<(Gid, u32, u32)>,
    pub sges: Vec<ibv_sge>,
    /// Inline data (copied at the `wr_set_inline_data*` call).
    pub inline: Option<Vec<u8>>,
}

impl std::fmt::Debug for ibv_sge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sge({:#x}+{}, lkey {:#x})",
            self.addr, self.length, self.lkey
        )
    }
}

/// The state every handle of one queue pair shares.
pub struct QpCore {
    pub nic: Arc<Nic>,
    pub qp_type: QpType,
    pub qp_num: u32,
    /// The protection domain (its address): lkeys must belong to it.
    pub pd: usize,
    pub send_cq: Arc<CqCore>,
    pub recv_cq: Arc<CqCore>,
    pub max_send_sge: usize,
    pub max_recv_sge: usize,
    pub max_inline: usize,
    dev: Mutex<Box<dyn QueuePair>>,
    pending: Mutex<Slab<Pending>>,
    /// `ibv_qp_state`.
    pub state: Mutex<c_int>,
    scratch: Mutex<Vec<DeviceCompletion>>,
}

fn status_of(s: Status) -> (c_int, u32) {
    let code = u32::from(s.code());
    let st = match s {
        Status::Success => IBV_WC_SUCCESS,
        Status::Flushed => IBV_WC_WR_FLUSH_ERR,
        Status::LocalQpInternalError | Status::UnsupportedOp | Status::InvalidAh => {
            IBV_WC_LOC_QP_OP_ERR
        }
        Status::InvalidLkey => IBV_WC_LOC_PROT_ERR,
        Status::LocalBadLength => IBV_WC_LOC_LEN_ERR,
        Status::RemoteAbort => IBV_WC_REM_ABORT_ERR,
        Status::RnrRetryExceeded => IBV_WC_RNR_RETRY_EXC_ERR,
        Status::BadDestQpn => IBV_WC_REM_INV_RD_REQ_ERR,
        Status::RemoteBadStatus => IBV_WC_BAD_RESP_ERR,
        Status::RemoteBadLength => IBV_WC_REM_INV_REQ_ERR,
        Status::UnresponsiveRemote | Status::UnreachableRemote => IBV_WC_RESP_TIMEOUT_ERR,
        Status::RemoteBadAddress => IBV_WC_REM_ACCESS_ERR,
        Status::UnknownPeer => IBV_WC_REM_OP_ERR,
        Status::FeatureMismatch => IBV_WC_REM_INV_REQ_ERR,
        _ => IBV_WC_GENERAL_ERR,
    };
    (st, code)
}

/// A checked send-queue request as the device takes it.
pub enum Prepared {
    Send {
        wr_id: u64,
        dest: RawAddr,
        src: Source,
        imm: Option<u32>,
    },
    Write {
        wr_id: u64,
        dest: RawAddr,
        src: Source,
        remote: RemoteIov,
        imm: Option<u32>,
    },
    Read {
        wr_id: u64,
        pending: Pending,
        dest: RawAddr,
        remote: RemoteIov,
    },
}

/// Where the bytes of a send or an RDMA write are: inline data (copied when posted, as a NIC
/// copies it into the work queue entry), or registered buffers, which the NIC reads by DMA
/// when it sends: the bytes there then, not at the post, go out.
pub enum Source {
    Inline(Bytes),
    Sges {
        /// Where in this process (translated when posted).
        sges: Vec<ibv_sge>,
        /// As the program named them (lkey and iova), checked again when read late.
        named: Vec<ibv_sge>,
    },
}

impl Source {
    fn len(&self) -> usize {
        match self {
            Source::Inline(b) => b.len(),
            Source::Sges { sges, .. } => total(sges),
        }
    }
}

impl Prepared {
    /// The program's work request id.
    pub fn wr_id(&self) -> u64 {
        match self {
            Prepared::Send { wr_id, .. }
            | Prepared::Write { wr_id, .. }
            | Prepared::Read { wr_id, .. } => *wr_id,
        }
    }

    /// The payload bytes it moves (what the bandwidth cap charges).
    pub fn bytes(&self) -> u64 {
        match self {
            Prepared::Send { src, .. } | Prepared::Write { src, .. } => src.len() as u64,
            Prepared::Read { remote, .. } => remote.len,
        }
    }
}

/// `prepare`'s "too long" (completed with `LOCAL_ERROR_BAD_LENGTH`, not refused).
const EBADLEN: i32 = -1;

/// Requests of one post on their way to the device as lists, with the request index and the
/// pending record of each.
#[derive(Default)]
struct DeviceList {
    sends: VecDeque<SendWr>,
    rdma: VecDeque<RdmaWr>,
    keys: Vec<(usize, u64)>,
}

/// Total bytes of a scatter/gather list.
fn total(sges: &[ibv_sge]) -> usize {
    sges.iter().map(|s| s.length as usize).sum()
}

/// Copies `data` into the buffers of `sges` (checked when posted), skipping the first `skip`
/// bytes of room.
fn scatter(sges: &[ibv_sge], mut skip: usize, mut data: &[u8]) {
    for s in sges {
        let room = s.length as usize;
        if skip >= room {
            skip -= room;
            continue;
        }
        let n = (room - skip).min(data.len());
        if n > 0 {
            // SAFETY: the range lies inside a live registration with local write access
            // (`post_recv` / `post_send` checked the lkey); the program lent it to the NIC until
            // this completion.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), (s.addr as usize + skip) as *mut u8, n)
            };
        }
        data = &data[n..];
        skip = 0;
        if data.is_empty() {
            break;
        }
    }
}

impl QpCore {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        nic: Arc<Nic>,
        dev: Box<dyn QueuePair>,
        pd: usize,
        send_cq: Arc<CqCore>,
        recv_cq: Arc<CqCore>,
        cap: &ibv_qp_cap,
    ) -> Arc<QpCore> {
        let qp_type = dev.qp_type();
        let qp_num = u32::from(dev.addr().qpn);
        let max_inline = nic.cfg.inline_size as usize;
        let core = Arc::new(QpCore {
            max_send_sge: (cap.max_send_sge as usize).max(1),
            max_recv_sge: (cap.max_recv_sge as usize).max(1),
            max_inline,
            nic,
            qp_type,
            qp_num,
            pd,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            dev: Mutex::new(dev),
            pending: Mutex::new(Slab::new()),
            state: Mutex::new(IBV_QPS_RESET),
            scratch: Mutex::new(Vec::new()),
        });
        send_cq.attach(&core);
        if !Arc::ptr_eq(&send_cq, &recv_cq) {
            recv_cq.attach(&core);
        }
        core
    }

    pub fn modify(&self, m: efa::device::QpModify) -> Result<(), i32> {
        self.dev.lock().modify(m).map_err(|_| libc::EINVAL)
    }

    pub fn qkey(&self) -> u32 {
        self.dev.lock().addr().qkey
    }

    /// Posts receives; the first refused one is returned with its errno.
    ///
    /// # Safety
    ///
    /// `wr` is a valid list of receive work requests.
    pub unsafe fn post_recv(&self, mut wr: *const ibv_recv_wr) -> Result<(), (usize, i32)> {
        let st = *self.state.lock();
        if st == IBV_QPS_RESET || st == IBV_QPS_ERR {
            return Err((wr as usize, libc::EINVAL));
        }
        while !wr.is_null() {
            // SAFETY: the caller's list is valid.
            let w = unsafe { &*wr };
            let n = usize::try_from(w.num_sge).unwrap_or(usize::MAX);
            if n > self.max_recv_sge || (n > 0 && w.sg_list.is_null()) {
                return Err((wr as usize, libc::EINVAL));
            }
            // SAFETY: `num_sge` entries at `sg_list`, as the caller promises.
            let mut sges = if n == 0 {
                Vec::new()
            } else {
                unsafe { std::slice::from_raw_parts(w.sg_list, n) }.to_vec()
            };
            if !self.translate(&mut sges, true) {
                return Err((wr as usize, libc::EINVAL));
            }
            let room = total(&sges);
            let room = if self.qp_type == QpType::Ud {
                room.saturating_sub(GRH_LEN)
            } else {
                room
            };
            self.post_tracked(
                Pending::Recv {
                    wr_id: w.wr_id,
                    sges,
                },
                |dev, key| dev.post_recv(key, BytesMut::with_capacity(room)),
            )
            .map_err(|e| (wr as usize, e))?;
            wr = w.next;
        }
        Ok(())
    }

    /// Where a send's or write's bytes are, checked against the limits on inline data and
    /// scatter/gather entries (the entries were checked against their lkeys by `post_sends`).
    fn source(&self, r: &SendReq, named: Vec<ibv_sge>) -> Result<Source, i32> {
        if let Some(d) = &r.inline {
            if d.len() > self.max_inline {
                return Err(libc::EINVAL);
            }
            return Ok(Source::Inline(Bytes::copy_from_slice(d)));
        }
        if r.sges.len() > self.max_send_sge {
            return Err(libc::EINVAL);
        }
        Ok(Source::Sges {
            sges: r.sges.clone(),
            named,
        })
    }

    /// Reads a send's or write's bytes, as the NIC's DMA engine does when it sends. `late`: the
    /// request waited (for the bandwidth cap) since it was posted, so its buffers must still be
    /// registered as they were; if not (the program deregistered, and maybe freed, them), nothing
    /// is read and the request completes with LOCAL_ERROR_INVALID_LKEY (5): `None`.
    fn fetch(&self, wr_id: u64, src: Source, late: bool) -> Option<Bytes> {
        let (sges, named) = match src {
            Source::Inline(b) => return Some(b),
            Source::Sges { sges, named } => (sges, named),
        };
        if late && !self.still_registered(named, &sges, false) {
            self.complete_local(wr_id, Status::InvalidLkey);
            return None;
        }
        let mut v = Vec::with_capacity(total(&sges));
        for s in &sges {
            if s.length > 0 {
                // SAFETY: the range lies inside a live registration the program lent the NIC
                // (checked when posted and, for a late read, again just now).
                v.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
                });
            }
        }
        Some(Bytes::from(v))
    }

    /// Checks a whole list of send requests, so that a refused list posts nothing.
    pub fn validate(&self, reqs: &[SendReq]) -> Result<(), (usize, i32)> {
        if *self.state.lock() != IBV_QPS_RTS {
            return Err((0, libc::EINVAL));
        }
        for (i, r) in reqs.iter().enumerate() {
            let ok = match r.op {
                SendOp::Send { .. } => true,
                SendOp::Read { .. } => {
                    self.qp_type == QpType::Srd && self.nic.cfg.caps.rdma_read && r.inline.is_none()
                }
                SendOp::Write { .. } => self.qp_type == QpType::Srd && self.nic.cfg.caps.rdma_write,
            };
            if !ok || r.dest.is_none() {
                return Err((i, libc::EINVAL));
            }
        }
        Ok(())
    }

    /// True when the entries `named` as the program posted them still lie in live registrations
    /// (with local write access when `write`) that put them where they were when posted
    /// (`sges`, translated then): DMA that comes later touches only such memory.
    fn still_registered(&self, mut named: Vec<ibv_sge>, sges: &[ibv_sge], write: bool) -> bool {
        self.translate(&mut named, write) && named.iter().zip(sges).all(|(n, s)| n.addr == s.addr)
    }

    /// Checks every scatter/gather entry against its registration (local write access when
    /// `write`) and replaces its address (in the registration's iova space) by where the bytes
    /// are in this process. False, and the list half translated, when one fails.
    fn translate(&self, sges: &mut [ibv_sge], write: bool) -> bool {
        sges.iter_mut().all(|s| {
            match self
                .nic
                .local_addr(self.pd, s.lkey, s.addr, u64::from(s.length), write)
            {
                Some(a) => {
                    s.addr = a;
                    true
                }
                None => false,
            }
        })
    }

    /// Posts checked send requests in order; the index and errno of the first refused one.
    ///
    /// As a NIC, a request whose scatter/gather entries name no live registration of the queue
    /// pair's PD (a bad lkey, a range outside it, a read into memory without local write) is
    /// taken and completes with status 5 (`LOCAL_ERROR_INVALID_LKEY`), and one too long for the
    /// port or for RDMA with status 6 (`LOCAL_ERROR_BAD_LENGTH`): errors the NIC finds when it
    /// processes the work request are completions, not refusals of the post.
    pub fn post_sends(self: &Arc<Self>, mut reqs: Vec<SendReq>) -> Result<(), (usize, i32)> {
        self.validate(&reqs)?;
        let mut named = Vec::with_capacity(reqs.len());
        let mut good = Vec::with_capacity(reqs.len());
        for r in reqs.iter_mut() {
            // A read writes its local buffers; sends and writes read them.
            let write = matches!(r.op, SendOp::Read { .. });
            named.push(r.sges.clone());
            good.push(r.inline.is_some() || self.translate(&mut r.sges, write));
        }
        // One doorbell, one list for the device: runs of sends, and of RDMA operations, each
        // posted as one list (one system call on the udp device), in the order posted; under a
        // bandwidth cap, those the cap lets go now.
        let mut list = DeviceList::default();
        for (i, ((r, ok), named)) in reqs.into_iter().zip(good).zip(named).enumerate() {
            if !ok {
                self.complete_local(r.wr_id, Status::InvalidLkey);
                continue;
            }
            let wr_id = r.wr_id;
            let p = match self.prepare(r, named) {
                Ok(Some(p)) => p,
                Ok(None) => continue,
                Err(e) if e == EBADLEN => {
                    self.complete_local(wr_id, Status::LocalBadLength);
                    continue;
                }
                Err(e) => {
                    self.post_list(&mut list)?;
                    return Err((i, e));
                }
            };
            let Some(p) = self.pace(p) else {
                continue;
            };
            self.add_to_list(&mut list, i, p, false)?;
        }
        self.post_list(&mut list)
    }

    /// Adds a prepared request to `list` (request `i` of the post), reading its bytes now
    /// (`late`: it waited since it was posted; see [`Self::fetch`]); a run of the other kind is
    /// posted first.
    fn add_to_list(
        &self,
        list: &mut DeviceList,
        i: usize,
        p: Prepared,
        late: bool,
    ) -> Result<(), (usize, i32)> {
        use std::sync::atomic::Ordering::Relaxed;
        let send = matches!(p, Prepared::Send { .. });
        if (send && !list.rdma.is_empty()) || (!send && !list.sends.is_empty()) {
            self.post_list(list)?;
        }
        match p {
            Prepared::Send {
                wr_id,
                dest,
                src,
                imm,
            } => {
                let Some(payload) = self.fetch(wr_id, src, late) else {
                    return Ok(());
                };
                let key = self.pending.lock().insert(Pending::Send { wr_id }) as u64;
                list.keys.push((i, key));
                list.sends.push_back(SendWr {
                    wr_id: key,
                    dest,
                    hdr: Bytes::new(),
                    payload,
                    imm,
                });
            }
            Prepared::Write {
                wr_id,
                dest,
                src,
                remote,
                imm,
            } => {
                let Some(local) = self.fetch(wr_id, src, late) else {
                    return Ok(());
                };
                self.nic.rdma_writes.fetch_add(1, Relaxed);
                let key = self.pending.lock().insert(Pending::Send { wr_id }) as u64;
                list.keys.push((i, key));
                list.rdma.push_back(RdmaWr {
                    wr_id: key,
                    dest,
                    kind: RdmaKind::Write { local, remote, imm },
                });
            }
            Prepared::Read {
                pending,
                dest,
                remote,
                ..
            } => {
                self.nic.rdma_reads.fetch_add(1, Relaxed);
                let key = self.pending.lock().insert(pending) as u64;
                list.keys.push((i, key));
                list.rdma.push_back(RdmaWr {
                    wr_id: key,
                    dest,
                    kind: RdmaKind::Read {
                        local: BytesMut::with_capacity(remote.len as usize),
                        remote,
                    },
                });
            }
        }
        Ok(())
    }

    /// Posts what `list` holds. The device stops a list at its first refusal: that request and
    /// the ones after it are not posted (their records are dropped), and the refusal names the
    /// request's index in the post.
    fn post_list(&self, list: &mut DeviceList) -> Result<(), (usize, i32)> {
        let res = {
            let mut dev = self.dev.lock();
            if !list.sends.is_empty() {
                dev.post_send_list(&mut list.sends)
            } else if !list.rdma.is_empty() {
                dev.post_rdma_list(&mut list.rdma)
            } else {
                Ok(())
            }
        };
        let keys = std::mem::take(&mut list.keys);
        let Err((failed, e)) = res else {
            return Ok(());
        };
        let mut pending = self.pending.lock();
        let first = keys.iter().position(|&(_, k)| k == failed).unwrap_or(0);
        for &(_, k) in &keys[first..] {
            pending.try_remove(k as usize);
        }
        list.sends.clear();
        list.rdma.clear();
        Err((keys.get(first).map_or(0, |&(i, _)| i), errno_of(&e)))
    }

    /// A prepared request the device may be given now: on a device with a bandwidth cap whose
    /// bucket cannot pay its bytes now, `None`: it waits for the device's pacing thread, which
    /// reads its data only then (as a NIC's DMA engine reads a send's buffers when it sends
    /// them) and posts it ([`Self::submit_paced`]).
    fn pace(self: &Arc<Self>, p: Prepared) -> Option<Prepared> {
        let Some(pacer) = &self.nic.pacer else {
            return Some(p);
        };
        let owner = Arc::as_ptr(self) as usize;
        pacer
            .admit(p.bytes(), owner, (self.clone(), p))
            .map(|(_, p)| p)
    }

    /// Turns a request into what the device is given: the bytes of a send or write, the
    /// destination and remote range. `None` when it completed already (a destination that
    /// cannot exist).
    fn prepare(&self, r: SendReq, named: Vec<ibv_sge>) -> Result<Option<Prepared>, i32> {
        let Some((gid, qpn, qkey)) = r.dest else {
            return Err(libc::EINVAL);
        };
        let dest_qpn = u16::try_from(qpn);
        let dest = RawAddr::new(gid, dest_qpn.unwrap_or(0), qkey);
        Ok(Some(match r.op {
            SendOp::Send { imm } => {
                let src = self.source(&r, named)?;
                if src.len() > self.nic.cfg.mtu {
                    return Err(EBADLEN);
                }
                if dest_qpn.is_err() {
                    // No such queue pair anywhere: the device reports a bad destination.
                    self.complete_local(r.wr_id, Status::BadDestQpn);
                    return Ok(None);
                }
                Prepared::Send {
                    wr_id: r.wr_id,
                    dest,
                    src,
                    imm,
                }
            }
            SendOp::Write { rkey, addr, imm } => {
                let src = self.source(&r, named)?;
                if src.len() as u64 > u64::from(self.nic.cfg.max_rdma_size) {
                    return Err(EBADLEN);
                }
                let remote = RemoteIov {
                    addr,
                    len: src.len() as u64,
                    key: u64::from(rkey),
                };
                Prepared::Write {
                    wr_id: r.wr_id,
                    dest,
                    src,
                    remote,
                    imm,
                }
            }
            SendOp::Read { rkey, addr } => {
                let len = total(&r.sges);
                if len as u64 > u64::from(self.nic.cfg.max_rdma_size) {
                    return Err(EBADLEN);
                }
                let remote = RemoteIov {
                    addr,
                    len: len as u64,
                    key: u64::from(rkey),
                };
                let pending = Pending::Read {
                    wr_id: r.wr_id,
                    sges: r.sges,
                    named,
                };
                Prepared::Read {
                    wr_id: r.wr_id,
                    pending,
                    dest,
                    remote,
                }
            }
        }))
    }

    /// Gives a prepared request to the device, reading its bytes now (`late`: it waited since
    /// it was posted; see [`Self::fetch`]).
    fn submit(&self, p: Prepared, late: bool) -> Result<(), i32> {
        let mut list = DeviceList::default();
        self.add_to_list(&mut list, 0, p, late)
            .and_then(|()| self.post_list(&mut list))
            .map_err(|(_, e)| e)
    }

    /// Posts a request that waited for the bandwidth cap (on the pacing thread); a refusal
    /// now (the queue pair closed meanwhile) is a flushed completion.
    pub fn submit_paced(&self, p: Prepared) {
        let wr_id = p.wr_id();
        if let Err(e) = self.submit(p, true) {
            tracing::debug!(
                wr_id,
                errno = e,
                "efa-emu: a paced post was refused; flushed"
            );
            self.complete_local(wr_id, Status::Flushed);
        }
    }

    /// Records `p` under a fresh key, posts with that key as the device's `wr_id`, and forgets
    /// the record again when the device refuses the post.
    fn post_tracked(
        &self,
        p: Pending,
        post: impl FnOnce(&mut dyn QueuePair, u64) -> efa::Result<()>,
    ) -> Result<(), i32> {
        let key = self.pending.lock().insert(p);
        let res = post(&mut **self.dev.lock(), key as u64);
        res.map_err(|e| {
            self.pending.lock().remove(key);
            errno_of(&e)
        })
    }

    /// A send-queue completion the NIC makes up without the device (a destination that cannot
    /// exist).
    fn complete_local(&self, wr_id: u64, s: Status) {
        let (status, vendor_err) = status_of(s);
        self.send_cq.push(Cqe {
            wr_id,
            status,
            vendor_err,
            opcode: IBV_WC_SEND,
            qp_num: self.qp_num,
            ..Cqe::default()
        });
    }

    /// Moves the device's ready completions into the CQs.
    pub fn drain(&self) {
        let mut scratch = self.scratch.lock();
        loop {
            scratch.clear();
            let n = self.dev.lock().poll(&mut scratch, 64);
            for c in scratch.drain(..) {
                self.complete(c);
            }
            if n < 64 {
                break;
            }
        }
    }

    fn complete(&self, c: DeviceCompletion) {
        let (status, vendor_err) = status_of(c.status);
        let mut e = Cqe {
            status,
            vendor_err,
            qp_num: self.qp_num,
            ..Cqe::default()
        };
        match c.opcode {
            Opcode::Send | Opcode::RdmaWrite | Opcode::RdmaRead => {
                let Some(p) = self.pending.lock().try_remove(c.wr_id as usize) else {
                    tracing::debug!(wr_id = c.wr_id, "efa-emu: completion of an unknown send");
                    return;
                };
                // As rdma-core (v46 on) reads EFA's completions: an RDMA write is
                // `IBV_WC_RDMA_WRITE`, every other send-queue completion a send (RDMA reads
                // too); no length.
                e.opcode = if c.opcode == Opcode::RdmaWrite {
                    IBV_WC_RDMA_WRITE
                } else {
                    IBV_WC_SEND
                };
                match p {
                    Pending::Send { wr_id } => e.wr_id = wr_id,
                    Pending::Read { wr_id, sges, named } => {
                        e.wr_id = wr_id;
                        if c.status.is_ok() {
                            // The data lands by DMA when it arrives: only into memory that is
                            // still registered (the program may have deregistered, and freed,
                            // it meanwhile); otherwise nothing is written and the read fails
                            // with LOCAL_ERROR_INVALID_LKEY (5).
                            if !self.still_registered(named, &sges, true) {
                                let (status, vendor_err) = status_of(Status::InvalidLkey);
                                e.status = status;
                                e.vendor_err = vendor_err;
                            } else if let Some(buf) = &c.buf {
                                scatter(&sges, 0, buf);
                            }
                        }
                    }
                    Pending::Recv { wr_id, .. } => e.wr_id = wr_id,
                }
                self.send_cq.push(e);
            }
            Opcode::Recv | Opcode::RecvRdmaWithImm => {
                let with_imm = c.opcode == Opcode::RecvRdmaWithImm;
                if with_imm && c.wr_id == UNSOLICITED_WR_ID && c.buf.is_none() {
                    e.unsolicited = true;
                } else {
                    let Some(p) = self.pending.lock().try_remove(c.wr_id as usize) else {
                        tracing::debug!(
                            wr_id = c.wr_id,
                            "efa-emu: completion of an unknown receive"
                        );
                        return;
                    };
                    let Pending::Recv { wr_id, sges } = p else {
                        return;
                    };
                    e.wr_id = wr_id;
                    if !with_imm && c.status.is_ok() {
                        if let Some(buf) = &c.buf {
                            let skip = if self.qp_type == QpType::Ud {
                                GRH_LEN
                            } else {
                                0
                            };
                            scatter(&sges, skip, buf);
                        }
                    }
                }
                e.opcode = if with_imm {
                    IBV_WC_RECV_RDMA_WITH_IMM
                } else {
                    IBV_WC_RECV
                };
                e.byte_len = c.byte_len as u32;
                if self.qp_type == QpType::Ud && !with_imm && c.status.is_ok() {
                    e.byte_len += GRH_LEN as u32;
                }
                e.imm = c.imm;
                if let Some(src) = c.src {
                    e.src_qp = u32::from(src.qpn);
                    match self.nic.ahn_of(self.pd, src.gid) {
                        Some(ahn) => e.slid = ahn,
                        None => {
                            e.slid = 0xffff;
                            e.sgid = Some(src.gid.0);
                        }
                    }
                } else {
                    e.slid = 0xffff;
                }
                self.recv_cq.push(e);
            }
        }
    }

    /// Before an SRD queue pair is destroyed: keeps it serving while its peer is still
    /// retransmitting to it (an acknowledgement of ours lost on the emulated network), until
    /// nothing has arrived for `LINGER_QUIET` (more than the longest retransmission backoff),
    /// at most `LINGER_MAX`. A program that exits right after its last receive (fi_pingpong's
    /// server) would otherwise leave its peer's last send to fail as unresponsive, since an
    /// emulated NIC dies with its process; a NIC's firmware acknowledges within microseconds.
    pub fn linger(&self) {
        const LINGER_QUIET: Duration = Duration::from_millis(60);
        const LINGER_MAX: Duration = Duration::from_secs(1);
        if self.qp_type != QpType::Srd {
            return;
        }
        let arrivals = || {
            let s = efa::device::Device::stats(&*self.nic.dev);
            s.rx_pkts + s.duplicates_dropped + s.rnr_events
        };
        let start = Instant::now();
        let (mut seen, mut last) = (arrivals(), start);
        while last.elapsed() < LINGER_QUIET && start.elapsed() < LINGER_MAX {
            std::thread::sleep(Duration::from_millis(5));
            let now = arrivals();
            if now != seen {
                (seen, last) = (now, Instant::now());
            }
        }
    }

    /// Moves the queue pair to the error state: outstanding work completes as flushed (work
    /// waiting for the bandwidth cap too).
    pub fn close(&self) {
        self.dev.lock().close();
        if let Some(pacer) = &self.nic.pacer {
            for (_, p) in pacer.take_owned_by(self as *const QpCore as usize) {
                self.complete_local(p.wr_id(), Status::Flushed);
            }
        }
        self.drain();
    }
}

impl Drop for QpCore {
    fn drop(&mut self) {
        self.dev.get_mut().close();
        self.send_cq
            .users
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.recv_cq
                .users
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

/// The errno a verbs call returns for a device error.
pub fn errno_of(e: &efa::Error) -> i32 {
    use efa::ErrorKind;
    match e.kind() {
        ErrorKind::Again => libc::ENOMEM,
        ErrorKind::MsgSize | ErrorKind::InvalidArgument => libc::EINVAL,
        ErrorKind::NotSupported => libc::EOPNOTSUPP,
        ErrorKind::Closed => libc::EINVAL,
        _ => libc::EIO,
    }
}
