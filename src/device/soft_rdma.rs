//! One-sided RDMA for the software devices (`udp`, `shm`): read, write and write with immediate
//! data, served by the target's device (its NIC thread, or whichever thread polls) without the
//! target application.
//!
//! RDMA messages ride on the device's reliable SRD path (the udp device's sequence numbers and
//! acks, the shm device's ring and acknowledgement words) as datagrams flagged as RDMA (udp
//! `FLAG_RDMA`, shm `F_RDMA`); their payload starts with a 48-byte header:
//!
//! | bytes | WRITE (1) | READ_REQ (2) | READ_RESP (3) |
//! |---|---|---|---|
//! | 0 | op | op | op |
//! | 1 | flags (1: last chunk, carries the immediate data) | 0 | 0 |
//! | 8..16 | tag | tag | tag |
//! | 16..24 | key | key | 0 |
//! | 24..32 | first byte of the whole write | address | 0 |
//! | 32..40 | total length | length | total length |
//! | 40..48 | this chunk's offset | 0 | this chunk's offset |
//!
//! * A WRITE chunk is checked against the key, the right and the **whole** write's range before
//!   a byte is placed: a refused write places nothing, and its chunks are answered with a NAK
//!   (udp: a `BadAddress` NAK; shm: the acknowledgement's status) that completes the initiator's
//!   work request with `RemoteBadAddress`. The
//!   SRD acknowledgement of a chunk means it is in the target's memory, so the initiator's write
//!   completes when every chunk is acknowledged. With immediate data the last chunk goes only
//!   after the others are acknowledged; it consumes a posted receive buffer (or none, with
//!   unsolicited write-recv) and produces the target's one `RecvRdmaWithImm` completion.
//! * A READ_REQ is checked the same way; the target answers with READ_RESP chunks.
//! * **Single-copy reads (shm, cross-memory attach).** When the initiator's device can copy
//!   from the target's process itself (`process_vm_readv`), its READ_REQ carries flag 2
//!   (`F_CMA`). A target whose device grants such reads checks key, right, range and lock as
//!   above and answers with one header-only READ_RESP flagged `F_CMA` (a *grant*; its key field
//!   holds an identity cookie and its address field where the cookie lives in the target).
//!   The initiator reads the cookie from the process it believes is the target: on a match it
//!   copies the whole range straight into the read's buffer, then sends READ_DONE (4; tag, key,
//!   address, length). The target checks the key once more: the read completes with the status
//!   of READ_DONE's acknowledgement, `Success` when the same registration is live before and
//!   after the copy, else `RemoteBadAddress`. Keys may come back (random keys may repeat, a NIC
//!   recycles its indices), so the grant's last field names the registration (its
//!   `RegionMem::id`), READ_DONE echoes it, and the target confirms only that registration (an
//!   echo of 0, from an older initiator, checks the key alone). On a cookie mismatch or a failed copy the initiator asks again without
//!   `F_CMA` (chunks through the device). Targets that do not know `F_CMA` ignore it.
//! * A region the application holds locked (`Again`) is treated like a missing receive buffer:
//!   receiver-not-ready, retried by the sender's SRD layer.

use foldhash::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;

use crate::addr::{Gid, RawAddr};
use crate::device::{
    DeviceCompletion, Opcode, RemoteIov, SendWr, Source, Status, UNSOLICITED_WR_ID,
};
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{self, Access, RegionMem, RegionSlice, TryAccess};
use crate::stats::{self, DeviceCounters};

/// What a device does with an RDMA message it received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// Done (placed, answered, or consumed).
    Ok,
    /// Not now: no receive buffer for the immediate data, or the region is locked by the
    /// application. The device treats it as receiver-not-ready.
    NotReady,
    /// Refused: bad key, range or right (or malformed): `RemoteBadAddress` to the sender.
    Denied,
    /// Refused by the key's admission rule ([`Admit`]): the target holds no address handle for
    /// the initiator, `UnknownPeer` (EFA status 14) to the sender.
    NoAh,
}

/// Who may reach a key by RDMA: `(key, initiator GID)` → allowed. An emulated EFA NIC refuses
/// initiators the key's protection domain holds no address handle for, as EFA does.
pub type Admit = Arc<dyn Fn(u64, crate::Gid) -> bool + Send + Sync>;

/// The outcome of [`RdmaHost::cma_copy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CmaCopy {
    /// All bytes copied.
    Copied,
    /// Not the process that granted (cookie mismatch), or no permission: stop trying it.
    WrongProcess,
    /// The copy failed part-way (the range is no longer mapped).
    Failed,
}

/// The device around the RDMA logic: its completion queue, receive queue and counters.
pub(crate) trait RdmaHost {
    /// The queue pair's RDMA state.
    fn rdma(&mut self) -> &mut Rdma;
    /// Queues a completion for the application.
    fn complete(&mut self, c: DeviceCompletion);
    /// The posted receive buffers, oldest first.
    fn recvs(&mut self) -> &mut std::collections::VecDeque<(u64, BytesMut)>;
    /// Takes the posted receive buffer at the head.
    fn take_recv(&mut self) -> Option<(u64, BytesMut)> {
        self.recvs().pop_front()
    }
    /// Puts it back.
    fn untake_recv(&mut self, r: (u64, BytesMut)) {
        self.recvs().push_front(r);
    }
    /// The device's counters.
    fn counters(&self) -> &DeviceCounters;
    /// Largest datagram (header + payload).
    fn mtu(&self) -> usize;
    /// The pid of the process behind `dest` when this device copies a read of `len` bytes from
    /// it directly (cross-memory attach); `None` (the default) when reads go through the
    /// device's datagrams.
    fn cma_pid(&mut self, dest: &RawAddr, len: usize) -> Option<u32> {
        let _ = (dest, len);
        None
    }
    /// A direct copy from `dest` reached the wrong process or was refused: stop trying it.
    fn cma_failed(&mut self, dest: &RawAddr) {
        let _ = dest;
    }
    /// Copies `len` bytes at `addr` of process `pid` into `buf` (replacing its contents), after
    /// checking that the process holds the identity cookie `(address, value)`.
    fn cma_copy(
        &mut self,
        pid: u32,
        cookie: (u64, u64),
        addr: u64,
        len: usize,
        buf: &mut BytesMut,
    ) -> CmaCopy {
        let _ = (pid, cookie, addr, len, buf);
        CmaCopy::WrongProcess
    }
    /// Where this process keeps its identity cookie and its value, when this device lets
    /// peers copy from its registered regions directly; `None` (the default) otherwise.
    fn cma_cookie(&self) -> Option<(u64, u64)> {
        None
    }
}

/// Bytes of the RDMA header.
pub(crate) const HDR: usize = 48;
const OP_WRITE: u8 = 1;
const OP_READ_REQ: u8 = 2;
const OP_READ_RESP: u8 = 3;
const OP_READ_DONE: u8 = 4;
const F_LAST_IMM: u8 = 1;
/// READ_REQ: the initiator can read the target with CMA; READ_RESP: a grant to do so.
const F_CMA: u8 = 2;
/// `wr_id`s of the device's own sends: never reported to the application.
pub(crate) const INTERNAL: u64 = 1 << 63;
/// ... and among them, the target's READ_RESP chunks (nobody waits for them).
const REPLY: u64 = 1 << 62;
/// ... and among them, an initiator's READ_DONE (its acknowledgement completes the read).
const DONE: u64 = 1 << 61;
const TAG_MASK: u64 = (1 << 48) - 1;

/// Where an RDMA message came from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Src {
    /// The sender's queue pair.
    pub(crate) source: Source,
    /// Its udp socket address (`None` on shm).
    pub(crate) sock: Option<SocketAddr>,
}

impl Src {
    /// The source of a udp datagram.
    pub(crate) fn udp(a: SocketAddr) -> Src {
        Src {
            source: Source {
                gid: Gid::from_ip(a.ip()),
                qpn: a.port(),
            },
            sock: Some(a),
        }
    }
}

/// The registered regions of one device, by key (shared by its queue pairs).
#[derive(Default)]
pub(crate) struct Keys {
    live: mem::KeyTable,
    /// The admission rule, if any (every initiator is admitted without).
    admit: Option<Admit>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("live", &self.live.len())
            .field("admit", &self.admit.is_some())
            .finish()
    }
}

/// A device's key table.
pub(crate) type KeyTable = Arc<Mutex<Keys>>;

impl Keys {
    /// Registers `mem` under 32 random bits from the kernel's CSPRNG (not 0, not a live key):
    /// a peer holding one key learns nothing about the others.
    ///
    /// Keys are 32 bits, as an EFA NIC's rkeys: a libfabric peer puts the key of a read or
    /// write into the 32-bit rkey of its work request (`ibv_wr_rdma_read`), so a wider key would
    /// reach this device truncated and be refused.
    pub(crate) fn register(&mut self, mem: &Arc<RegionMem>, access: Access) -> u64 {
        self.live.insert_random(mem, access, 0xffff_ffff, 0)
    }

    /// Registers `mem` under `key`, a key its caller chose (an emulated NIC hands out 32-bit
    /// keys of its own). False, and nothing registered, when `key` is live.
    #[cfg(any(test, feature = "emu-hooks"))]
    pub(crate) fn register_as(&mut self, mem: &Arc<RegionMem>, access: Access, key: u64) -> bool {
        self.live.insert_as(key, mem, access)
    }

    /// Sets the rule that admits initiators (see [`Admit`]).
    #[cfg(any(test, feature = "emu-hooks"))]
    pub(crate) fn set_admit(&mut self, admit: Option<Admit>) {
        self.admit = admit;
    }

    /// The region an RDMA access from `from` may reach ([`Keys::check`]), or why it is refused:
    /// `Denied` for a bad key, range or right, `NoAh` when the admission rule turns the
    /// initiator away.
    fn serve(
        &self,
        key: u64,
        need: Access,
        addr: u64,
        len: u64,
        from: crate::device::Source,
    ) -> Result<Arc<RegionMem>, Served> {
        let Some(mem) = self.check(key, need, addr, len) else {
            tracing::debug!(src = ?from, key, ?need, "RDMA access refused (key, range or right)");
            return Err(Served::Denied);
        };
        if self.admit.as_ref().is_some_and(|a| !a(key, from.gid)) {
            tracing::debug!(src = ?from, key, "RDMA access refused: no address handle for the initiator");
            return Err(Served::NoAh);
        }
        Ok(mem)
    }

    /// Whether `slice` lies inside the live registration its key names (the same memory, not
    /// another registration a recycled key names now).
    pub(crate) fn holds(&self, slice: &RegionSlice) -> bool {
        self.check(slice.key, Access::empty(), slice.addr, slice.len as u64)
            .is_some_and(|m| m.id() == slice.mem.id())
    }

    /// Revokes `key`.
    pub(crate) fn deregister(&mut self, key: u64) {
        self.live.remove(key);
    }

    /// The region `key` names if it grants `need` and `addr..addr+len` lies inside it
    /// ([`mem::KeyTable::check`], the one check of every remote access).
    fn check(&self, key: u64, need: Access, addr: u64, len: u64) -> Option<Arc<RegionMem>> {
        self.live.check(key, need, addr, len).ok()
    }
}

/// An RDMA operation this queue pair started.
#[derive(Debug)]
enum Op {
    Write {
        wr_id: u64,
        total: usize,
        /// Chunks not yet acknowledged.
        remaining: usize,
        /// The chunk with the immediate data, held back until the others are in place.
        last: Option<(Option<SocketAddr>, SendWr, Option<RegionSlice>)>,
        failed: Option<Status>,
    },
    Read {
        wr_id: u64,
        buf: BytesMut,
        total: usize,
        got: usize,
        /// Where the read goes (to ask again without CMA).
        dest: RawAddr,
        to: Option<SocketAddr>,
        remote: RemoteIov,
        /// The target's pid while a direct (CMA) copy is asked for.
        cma: Option<u32>,
        /// The data is in `buf` (copied directly); READ_DONE's acknowledgement completes it.
        verifying: bool,
    },
}

/// The RDMA state of one queue pair.
#[derive(Debug, Default)]
pub(crate) struct Rdma {
    /// The device's regions (`None`: the device's RDMA is off).
    pub(crate) keys: Option<KeyTable>,
    /// Writes with immediate data consume no receive buffer.
    pub(crate) unsolicited: bool,
    next_tag: u64,
    ops: HashMap<u64, Op>,
    /// RDMA messages to put on the SRD path (the queue pair posts them after each step), with
    /// the udp socket address they go to (unused by shm), and the region bytes that follow the
    /// message's header when a write is sent from a region ([`Local::Region`]; only the udp
    /// device starts such writes).
    pub(crate) outbox: Vec<(Option<SocketAddr>, SendWr, Option<RegionSlice>)>,
}

fn header(op: u8, flags: u8, tag: u64, key: u64, a: u64, b: u64, c: u64) -> Bytes {
    let mut h = Vec::with_capacity(HDR);
    h.push(op);
    h.push(flags);
    h.extend_from_slice(&[0; 6]);
    for v in [tag, key, a, b, c] {
        h.extend_from_slice(&v.to_le_bytes());
    }
    Bytes::from(h)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

impl Rdma {
    /// The state of a queue pair of a device with `keys` (`None`: no RDMA).
    pub(crate) fn new(keys: Option<KeyTable>, unsolicited: bool) -> Rdma {
        Rdma {
            keys,
            unsolicited,
            ..Rdma::default()
        }
    }

    fn tag(&mut self) -> u64 {
        self.next_tag = (self.next_tag + 1) & TAG_MASK;
        self.next_tag
    }
}

/// The local side of an RDMA write.
pub(crate) enum Local {
    /// Bytes the operation owns.
    Bytes(Bytes),
    /// A slice of a region the device registered: each chunk is read from the region when it is
    /// transmitted (and again for a retransmission), as a NIC reads by DMA, with no copy at
    /// posting and no allocation.
    Region(RegionSlice),
}

impl Local {
    fn len(&self) -> usize {
        match self {
            Local::Bytes(b) => b.len(),
            Local::Region(r) => r.len,
        }
    }
}

/// The RDMA logic, for any [`RdmaHost`].
pub(crate) trait RdmaOps: RdmaHost {
    /// Starts an RDMA write of `local` to `remote` at `dest` (socket `to`), in chunks of at most
    /// `chunk` bytes.
    #[allow(clippy::too_many_arguments)]
    fn rdma_write(
        &mut self,
        wr_id: u64,
        to: Option<SocketAddr>,
        dest: RawAddr,
        local: Local,
        remote: RemoteIov,
        imm: Option<u32>,
        chunk: usize,
    ) -> Result<()> {
        if remote.len != local.len() as u64 {
            return Err(Error::new(ErrorKind::InvalidArgument, "post_write")
                .with_detail("remote length differs from the local buffer's"));
        }
        let tag = self.rdma().tag();
        let total = local.len();
        let n = total.div_ceil(chunk).max(1);
        let mut wrs = Vec::with_capacity(n);
        for i in 0..n {
            let (a, b) = (i * chunk, ((i + 1) * chunk).min(total));
            let last = i + 1 == n;
            let flags = if last && imm.is_some() { F_LAST_IMM } else { 0 };
            let wr = SendWr {
                wr_id: INTERNAL | tag,
                dest,
                hdr: header(
                    OP_WRITE,
                    flags,
                    tag,
                    remote.key,
                    remote.addr,
                    total as u64,
                    a as u64,
                ),
                payload: match &local {
                    Local::Bytes(bytes) => bytes.slice(a..b),
                    Local::Region(_) => Bytes::new(),
                },
                imm: if flags != 0 { imm } else { None },
            };
            let region = match &local {
                Local::Bytes(_) => None,
                Local::Region(r) => r.sub(a, b - a),
            };
            wrs.push((to, wr, region));
        }
        let last = if imm.is_some() && n > 1 {
            wrs.pop()
        } else {
            None
        };
        self.rdma().ops.insert(
            tag,
            Op::Write {
                wr_id,
                total,
                remaining: wrs.len(),
                last,
                failed: None,
            },
        );
        self.rdma().outbox.extend(wrs);
        Ok(())
    }

    /// Starts an RDMA read of `remote` at `dest` into `local`.
    fn rdma_read(
        &mut self,
        wr_id: u64,
        to: Option<SocketAddr>,
        dest: RawAddr,
        mut local: BytesMut,
        remote: RemoteIov,
    ) -> Result<()> {
        let total = usize::try_from(remote.len)
            .ok()
            .filter(|&n| n <= isize::MAX as usize / 2)
            .ok_or_else(|| Error::new(ErrorKind::MsgSize, "post_read"))?;
        let tag = self.rdma().tag();
        let cma = if total > 0 {
            self.cma_pid(&dest, total)
        } else {
            None
        };
        local.clear();
        if cma.is_none() {
            local.resize(total, 0);
        }
        self.rdma().ops.insert(
            tag,
            Op::Read {
                wr_id,
                buf: local,
                total,
                got: 0,
                dest,
                to,
                remote,
                cma,
                verifying: false,
            },
        );
        let flags = if cma.is_some() { F_CMA } else { 0 };
        self.rdma()
            .outbox
            .push((to, read_req(tag, dest, &remote, flags), None));
        Ok(())
    }

    /// The SRD layer finished one of the device's own sends.
    fn rdma_send_done(&mut self, wr_id: u64, status: Status) {
        if wr_id & REPLY != 0 {
            if !status.is_ok() {
                tracing::debug!(%status, "udp: an RDMA read response was not delivered");
            }
            return;
        }
        let tag = wr_id & TAG_MASK;
        let Some(op) = self.rdma().ops.get_mut(&tag) else {
            return;
        };
        match op {
            Op::Write {
                remaining,
                last,
                failed,
                ..
            } => {
                if !status.is_ok() {
                    failed.get_or_insert(status);
                    *last = None;
                }
                *remaining = remaining.saturating_sub(1);
                if *remaining > 0 {
                    return;
                }
                if let Some(l) = last.take() {
                    *remaining = 1;
                    self.rdma().outbox.push(l);
                    return;
                }
            }
            Op::Read {
                total,
                got,
                verifying,
                ..
            } => {
                let done_ack = wr_id & DONE != 0;
                if !done_ack && status.is_ok() && (*got < *total || *verifying) {
                    // The request was delivered: wait for the data (or, copied directly, for
                    // READ_DONE's verdict). A zero-length read is done.
                    return;
                }
                if done_ack && !*verifying {
                    return;
                }
                if status.is_ok() {
                    // Zero bytes: complete below with success.
                } else {
                    let Some(Op::Read { wr_id, mut buf, .. }) = self.rdma().ops.remove(&tag) else {
                        return;
                    };
                    buf.clear();
                    let mut c = DeviceCompletion::new(wr_id, status, Opcode::RdmaRead, 0);
                    c.buf = Some(buf);
                    self.complete(c);
                    return;
                }
            }
        }
        self.rdma_finish(tag);
    }

    fn rdma_finish(&mut self, tag: u64) {
        match self.rdma().ops.remove(&tag) {
            Some(Op::Write {
                wr_id,
                total,
                failed,
                ..
            }) => {
                let status = failed.unwrap_or(Status::Success);
                let n = if status.is_ok() { total } else { 0 };
                if status.is_ok() {
                    // The packets that carried it counted themselves in `tx_pkts`/`tx_bytes`.
                    stats::inc(&self.counters().rdma_ops);
                    stats::add(&self.counters().rdma_bytes, total as u64);
                }
                self.complete(DeviceCompletion::new(wr_id, status, Opcode::RdmaWrite, n));
            }
            Some(Op::Read {
                wr_id, buf, got, ..
            }) => {
                stats::inc(&self.counters().rdma_ops);
                stats::add(&self.counters().rdma_bytes, got as u64);
                let mut c = DeviceCompletion::new(wr_id, Status::Success, Opcode::RdmaRead, got);
                c.buf = Some(buf);
                self.complete(c);
            }
            None => {}
        }
    }

    /// Completes every RDMA operation with `Flushed` (the queue pair closes).
    fn rdma_flush(&mut self) {
        let tags: Vec<u64> = self.rdma().ops.keys().copied().collect();
        for tag in tags {
            match self.rdma().ops.remove(&tag) {
                Some(Op::Write { wr_id, .. }) => {
                    self.complete(DeviceCompletion::new(
                        wr_id,
                        Status::Flushed,
                        Opcode::RdmaWrite,
                        0,
                    ));
                }
                Some(Op::Read { wr_id, mut buf, .. }) => {
                    buf.clear();
                    let mut c = DeviceCompletion::new(wr_id, Status::Flushed, Opcode::RdmaRead, 0);
                    c.buf = Some(buf);
                    self.complete(c);
                }
                None => {}
            }
        }
        self.rdma().outbox.clear();
    }

    /// An RDMA message arrived (exactly once, from the SRD layer).
    fn deliver_rdma(&mut self, src: Src, src_qkey: u32, imm: Option<u32>, data: &[u8]) -> Served {
        if data.len() < HDR {
            stats::inc(&self.counters().malformed_dropped);
            return Served::Denied;
        }
        let (op, flags) = (data[0], data[1]);
        let tag = u64_at(data, 8);
        let key = u64_at(data, 16);
        let (a, b, c) = (u64_at(data, 24), u64_at(data, 32), u64_at(data, 40));
        let body = &data[HDR..];
        match op {
            OP_WRITE => self.serve_write(src, flags, key, a, b, c, imm, body),
            OP_READ_REQ => self.serve_read(src, src_qkey, flags, tag, key, a, b),
            OP_READ_RESP if flags & F_CMA != 0 => {
                self.read_grant(tag, b, key, a, c);
                Served::Ok
            }
            OP_READ_RESP => {
                self.read_resp(tag, b, c, body);
                Served::Ok
            }
            OP_READ_DONE => {
                let Some(keys) = self.rdma().keys.clone() else {
                    return Served::Denied;
                };
                // Still registered, and (when the grant said which) the same registration: a
                // key may have come back for another region at the same address meanwhile.
                let same = keys
                    .lock()
                    .check(key, Access::REMOTE_READ, a, b)
                    .is_some_and(|m| c == 0 || m.id() == c);
                if same { Served::Ok } else { Served::Denied }
            }
            _ => {
                stats::inc(&self.counters().malformed_dropped);
                Served::Denied
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn serve_write(
        &mut self,
        src: Src,
        flags: u8,
        key: u64,
        start: u64,
        total: u64,
        offset: u64,
        imm: Option<u32>,
        body: &[u8],
    ) -> Served {
        let Some(keys) = self.rdma().keys.clone() else {
            return Served::Denied;
        };
        let in_range = offset
            .checked_add(body.len() as u64)
            .is_some_and(|e| e <= total);
        let mem = match keys
            .lock()
            .serve(key, Access::REMOTE_WRITE, start, total, src.source)
        {
            Ok(m) if in_range => m,
            Ok(_) => return Served::Denied,
            Err(refused) => return refused,
        };
        let with_imm = flags & F_LAST_IMM != 0;
        let recv = if with_imm && !self.rdma().unsolicited {
            match self.take_recv() {
                Some(r) => Some(r),
                None => return Served::NotReady,
            }
        } else {
            None
        };
        let at = start.wrapping_add(offset);
        match mem.try_write_with(at, body, None, || Some(())) {
            TryAccess::Done(_) => {}
            TryAccess::Busy => {
                if let Some(r) = recv {
                    self.untake_recv(r);
                }
                return Served::NotReady;
            }
            TryAccess::OutOfRange => {
                if let Some(r) = recv {
                    self.untake_recv(r);
                }
                return Served::Denied;
            }
        }
        stats::inc(&self.counters().rx_pkts);
        stats::add(&self.counters().rx_bytes, body.len() as u64);
        if with_imm {
            let (wr_id, buf) = match recv {
                Some((w, mut b)) => {
                    b.clear();
                    (w, Some(b))
                }
                None => (UNSOLICITED_WR_ID, None),
            };
            self.complete(DeviceCompletion {
                wr_id,
                status: Status::Success,
                opcode: Opcode::RecvRdmaWithImm,
                byte_len: usize::try_from(total).unwrap_or(usize::MAX),
                src: Some(src.source),
                imm,
                buf,
            });
        }
        Served::Ok
    }

    #[allow(clippy::too_many_arguments)]
    fn serve_read(
        &mut self,
        src: Src,
        src_qkey: u32,
        flags: u8,
        tag: u64,
        key: u64,
        addr: u64,
        len: u64,
    ) -> Served {
        let Some(keys) = self.rdma().keys.clone() else {
            return Served::Denied;
        };
        let mem = match keys
            .lock()
            .serve(key, Access::REMOTE_READ, addr, len, src.source)
        {
            Ok(m) => m,
            Err(refused) => return refused,
        };
        let dest = RawAddr::new(src.source.gid, src.source.qpn, src_qkey);
        let cookie = self.cma_cookie().filter(|_| flags & F_CMA != 0 && len > 0);
        let mut out = BytesMut::new();
        // A grant copies nothing here: the bytes' lock is only tried (bytes the application
        // holds locked are not granted, as they are not read).
        let tried = if cookie.is_some() {
            mem.try_probe_read(addr, len, None)
        } else {
            mem.try_read_into(addr, len, &mut out, None)
        };
        match tried {
            TryAccess::Done(()) => {}
            TryAccess::Busy => return Served::NotReady,
            TryAccess::OutOfRange => return Served::Denied,
        }
        if let Some((at, value)) = cookie {
            let wr = SendWr {
                wr_id: INTERNAL | REPLY | tag,
                dest,
                // The region's identity travels back in READ_DONE: a key recycled meanwhile
                // for another registration at the same address does not confirm the read.
                hdr: header(OP_READ_RESP, F_CMA, tag, value, at, len, mem.id()),
                payload: Bytes::new(),
                imm: None,
            };
            self.rdma().outbox.push((src.sock, wr, None));
            return Served::Ok;
        }
        let data = out.freeze();
        let chunk = self.mtu().saturating_sub(HDR).max(1);
        let total = data.len();
        let n = total.div_ceil(chunk).max(1);
        for i in 0..n {
            let (a, b) = (i * chunk, ((i + 1) * chunk).min(total));
            let wr = SendWr {
                wr_id: INTERNAL | REPLY | tag,
                dest,
                hdr: header(OP_READ_RESP, 0, tag, 0, 0, total as u64, a as u64),
                payload: data.slice(a..b),
                imm: None,
            };
            self.rdma().outbox.push((src.sock, wr, None));
        }
        Served::Ok
    }

    fn read_resp(&mut self, tag: u64, total: u64, offset: u64, body: &[u8]) {
        let Some(Op::Read {
            buf,
            total: want,
            got,
            verifying,
            ..
        }) = self.rdma().ops.get_mut(&tag)
        else {
            stats::inc(&self.counters().stale_dropped);
            return;
        };
        if *verifying {
            // Copied directly already: a late chunk of an earlier request.
            stats::inc(&self.counters().stale_dropped);
            return;
        }
        if buf.len() < *want {
            // A direct copy was asked for, but the target sends the data.
            buf.clear();
            buf.resize(*want, 0);
        }
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        let fits =
            total == *want as u64 && off.checked_add(body.len()).is_some_and(|e| e <= buf.len());
        if !fits {
            stats::inc(&self.counters().malformed_dropped);
            return;
        }
        crate::mem::copy::copy(&mut buf[off..off + body.len()], body);
        *got += body.len();
        if *got >= *want {
            self.rdma_finish(tag);
        }
    }

    /// The target granted a direct copy (`F_CMA` READ_RESP): check the cookie, copy, then ask
    /// the target to confirm the region is still registered (READ_DONE). Any failure asks again
    /// without CMA.
    fn read_grant(&mut self, tag: u64, total: u64, cookie: u64, cookie_at: u64, region: u64) {
        let Some(Op::Read {
            buf,
            total: want,
            dest,
            to,
            remote,
            cma,
            verifying,
            ..
        }) = self.rdma().ops.get_mut(&tag)
        else {
            stats::inc(&self.counters().stale_dropped);
            return;
        };
        let Some(pid) = *cma else {
            // Not asked for (or already given up): the data comes in chunks.
            stats::inc(&self.counters().malformed_dropped);
            return;
        };
        if total != *want as u64 || *verifying {
            stats::inc(&self.counters().malformed_dropped);
            return;
        }
        let (dest, to, remote, want) = (*dest, *to, *remote, *want);
        let mut data = std::mem::take(buf);
        let outcome = self.cma_copy(pid, (cookie_at, cookie), remote.addr, want, &mut data);
        let Some(Op::Read {
            buf,
            got,
            cma,
            verifying,
            ..
        }) = self.rdma().ops.get_mut(&tag)
        else {
            return;
        };
        *buf = data;
        if outcome == CmaCopy::Copied {
            *got = want;
            *verifying = true;
            stats::inc(&self.counters().rx_pkts);
            stats::add(&self.counters().rx_bytes, want as u64);
            let wr = SendWr {
                wr_id: INTERNAL | DONE | tag,
                dest,
                hdr: header(
                    OP_READ_DONE,
                    0,
                    tag,
                    remote.key,
                    remote.addr,
                    remote.len,
                    region,
                ),
                payload: Bytes::new(),
                imm: None,
            };
            self.rdma().outbox.push((to, wr, None));
            return;
        }
        tracing::debug!(
            pid,
            ?outcome,
            "soft RDMA: direct read failed; asking for the data instead"
        );
        *cma = None;
        buf.clear();
        buf.resize(want, 0);
        if outcome == CmaCopy::WrongProcess {
            self.cma_failed(&dest);
        }
        self.rdma()
            .outbox
            .push((to, read_req(tag, dest, &remote, 0), None));
    }
}

/// A READ_REQ work request.
fn read_req(tag: u64, dest: RawAddr, remote: &RemoteIov, flags: u8) -> SendWr {
    SendWr {
        wr_id: INTERNAL | tag,
        dest,
        hdr: header(
            OP_READ_REQ,
            flags,
            tag,
            remote.key,
            remote.addr,
            remote.len,
            0,
        ),
        payload: Bytes::new(),
        imm: None,
    }
}

impl<T: RdmaHost + ?Sized> RdmaOps for T {}

#[cfg(test)]
mod tests;
