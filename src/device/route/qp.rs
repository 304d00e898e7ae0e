//! The routed queue pair: a primary queue pair (its address is the address) and an shm queue pair
//! for peers on this host, behind one [`QueuePair`].

use std::collections::VecDeque;

use foldhash::{HashMap, HashMapExt};
use std::fmt;
use std::sync::Arc;

use bytes::{Buf, BufMut, BytesMut};

use super::dir::{self, Entry, Lookup};
use super::{BASE_RECV, HDR_LEN, HDR_MAGIC, RouteShared};
use crate::addr::{Gid, RawAddr};
use crate::device::queues::drain_into;
use crate::device::{
    DeviceCompletion, Opcode, QpType, QueuePair, RdmaWr, SendWr, Source, Status, UNSOLICITED_WR_ID,
    post_rdma_wr, rdma_posts_by_wr,
};
use crate::error::{Error, ErrorKind, Result};
use crate::stats;

/// Which queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Primary,
    Shm,
}

/// How a destination is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// Over the primary queue pair.
    Primary,
    /// Over shm, to this shm queue pair.
    Shm(RawAddr),
    /// Its owner is known to have died (its entry was stale after a send failed): sends
    /// complete with `UnresponsiveRemote` at once instead of timing out on the primary path.
    Dead,
}

/// The local (shm) side of a routed queue pair.
pub(super) struct Local {
    pub qp: Box<dyn QueuePair>,
    /// Our published directory entry (removed when dropped); `None` if the name was taken.
    pub entry: Option<Entry>,
    /// How each destination (primary address) was found to be reached.
    routes: HashMap<RawAddr, Route>,
    /// Primary destination of every shm send in flight, by `wr_id`.
    inflight: HashMap<u64, RawAddr>,
    /// Paths whose receive buffers came back: the next posted buffers go there.
    refill: VecDeque<Path>,
    /// Receive buffers posted to each path.
    posted: [usize; 2],
    /// Receive buffers posted to the routed queue pair but to neither path yet: a path that
    /// consumes a buffer takes one from here, so buffers go where the traffic is.
    spare: VecDeque<(u64, BytesMut)>,
    /// Receive buffers each path gets before further ones are kept spare.
    base: usize,
    /// The header every shm datagram starts with (magic, our primary GID and QPN).
    hdr: [u8; HDR_LEN],
}

impl Local {
    /// Posts a receive buffer to `path`. A failed post drops the buffer (as the seam does).
    fn post_to(
        &mut self,
        primary: &mut dyn QueuePair,
        path: Path,
        wr_id: u64,
        mut buf: BytesMut,
    ) -> Result<()> {
        if path == Path::Shm {
            // Room for the routing header in front of the same datagram room: a buffer that
            // came back from the shm path has it in front (reclaimed without copying); another
            // one is replaced by a buffer of the right size.
            buf.clear();
            let room = buf.capacity();
            if !buf.try_reclaim(room + HDR_LEN) {
                buf = BytesMut::with_capacity(room + HDR_LEN);
            }
            self.qp.post_recv(wr_id, buf)?;
        } else {
            primary.post_recv(wr_id, buf)?;
        }
        self.posted[idx(path)] += 1;
        Ok(())
    }

    /// A receive buffer of `path` came back: the next posted buffer goes there, and a spare
    /// one goes there at once.
    fn consumed(
        &mut self,
        primary: &mut dyn QueuePair,
        path: Path,
        failed: &mut VecDeque<DeviceCompletion>,
    ) {
        self.refill.push_back(path);
        if let Some((wr_id, buf)) = self.spare.pop_front() {
            if let Err(e) = self.post_to(primary, path, wr_id, buf) {
                // Cannot happen while open (each path's depth is the whole queue's); the work
                // request still completes once, without its buffer.
                tracing::warn!(error = %e, "shm route: could not post a spare receive buffer");
                failed.push_back(DeviceCompletion::new(
                    wr_id,
                    Status::LocalQpInternalError,
                    Opcode::Recv,
                    0,
                ));
            }
        }
    }

    pub(super) fn new(
        qp: Box<dyn QueuePair>,
        entry: Option<Entry>,
        me: &RawAddr,
        recv_depth: usize,
    ) -> Local {
        let mut hdr = [0u8; HDR_LEN];
        hdr[..4].copy_from_slice(&HDR_MAGIC);
        hdr[4..20].copy_from_slice(&me.gid.0);
        hdr[20..22].copy_from_slice(&me.qpn.to_le_bytes());
        Local {
            qp,
            entry,
            routes: HashMap::new(),
            inflight: HashMap::new(),
            refill: VecDeque::new(),
            posted: [0; 2],
            spare: VecDeque::new(),
            base: (recv_depth / 8).max(BASE_RECV),
            hdr,
        }
    }
}

/// A queue pair of a [`RoutedDevice`](super::RoutedDevice).
pub(super) struct RoutedQp {
    pub(super) shared: Arc<RouteShared>,
    pub(super) primary: Box<dyn QueuePair>,
    pub(super) local: Option<Local>,
    pub(super) addr: RawAddr,
    pub(super) mtu: usize,
    pub(super) shm_first: bool,
    /// Sends to dead peers, completed without reaching a queue pair.
    pub(super) failed: VecDeque<DeviceCompletion>,
    pub(super) closed: bool,
    /// The receive queue depth (posted to either path or spare).
    pub(super) recv_depth: usize,
    /// RDMA work requests on the primary to peers reached over shm, by `wr_id`: their target.
    pub(super) rdma_to_local: std::collections::HashMap<u64, RawAddr>,
    /// Peers reached over shm whose primary NIC refused our RDMA for want of an address handle
    /// for us (EFA status 14): the next datagram to each goes over the primary, so that their
    /// NIC learns us (the engine sends an introduction right after the refusal).
    pub(super) introduce: std::collections::HashSet<RawAddr>,
}

impl fmt::Debug for RoutedQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RoutedQp")
            .field("addr", &self.addr)
            .field("shm", &self.local.as_ref().map(|l| l.qp.addr()))
            .finish_non_exhaustive()
    }
}

fn idx(p: Path) -> usize {
    match p {
        Path::Primary => 0,
        Path::Shm => 1,
    }
}

impl RoutedQp {
    /// How `dest` is reached: looked up in the directory the first time.
    fn route(&mut self, dest: &RawAddr) -> Route {
        if *dest == self.addr {
            return Route::Primary;
        }
        let sh = &self.shared;
        let Some(local) = self.local.as_mut() else {
            return Route::Primary;
        };
        if let Some(r) = local.routes.get(dest) {
            return *r;
        }
        let r = match dir::lookup(&sh.dir, sh.uid, &sh.netns, &sh.shm_gid, dest) {
            Lookup::Local(shm) => Route::Shm(shm),
            Lookup::Remote => Route::Primary,
        };
        // Kept for the queue pair's life (one small entry per destination, as the local path
        // keeps its answers): a route that changed mid-stream would let a datagram overtake
        // the ones before it on the other path.
        local.routes.insert(*dest, r);
        tracing::debug!(%dest, route = ?r, "shm route: destination looked up");
        r
    }

    /// Turns one completion of the shm queue pair into what the layer above expects.
    /// (In place: the completions stay where the shm queue pair's poll put them.)
    fn take_shm(&mut self, c: &mut DeviceCompletion) {
        let sh = &self.shared;
        let Some(local) = self.local.as_mut() else {
            return;
        };
        match c.opcode {
            Opcode::Send => {
                if let Some(dest) = local.inflight.remove(&c.wr_id) {
                    if matches!(
                        c.status,
                        Status::UnresponsiveRemote
                            | Status::UnreachableRemote
                            | Status::BadDestQpn
                            | Status::UnknownPeer
                    ) {
                        // The peer may be gone. If its entry is stale, its owner died (and
                        // with it the primary address): later sends fail at once. Otherwise
                        // the route stays (it never changes while the peer lives).
                        if dir::forget_if_stale(&sh.dir, sh.uid, &dest) {
                            local.routes.insert(dest, Route::Dead);
                        }
                    }
                }
            }
            Opcode::Recv => {
                local.posted[idx(Path::Shm)] = local.posted[idx(Path::Shm)].saturating_sub(1);
                if c.status == Status::Flushed {
                    // Handed back with the room it was posted with: the routing header's room
                    // in front goes (the buffer is empty).
                    if let Some(b) = c.buf.as_mut() {
                        if b.is_empty() && b.capacity() >= HDR_LEN {
                            *b = b.split_off(HDR_LEN);
                        }
                    }
                    return;
                }
                let has_data = matches!(c.status, Status::Success | Status::LocalBadLength);
                if has_data {
                    let parsed = c.buf.as_ref().and_then(|b| parse_hdr(b, self.addr.qpn));
                    match parsed {
                        Some(src) => {
                            if let Some(b) = c.buf.as_mut() {
                                // O(1): the header's room is reclaimed when the buffer is
                                // posted to the shm queue pair again.
                                b.advance(HDR_LEN.min(b.len()));
                            }
                            c.byte_len = c.byte_len.saturating_sub(HDR_LEN);
                            c.src = Some(src);
                            if c.status.is_ok() {
                                stats::inc(&sh.counters.shm_route_rx_pkts);
                                stats::add(&sh.counters.shm_route_rx_bytes, c.byte_len as u64);
                            }
                        }
                        None => {
                            // Not from a routed peer: dropped. The buffer goes back to the layer
                            // above with an error status (it reposts it), so the work request
                            // still completes exactly once.
                            stats::inc(&sh.counters.malformed_dropped);
                            tracing::debug!(src = ?c.src, "shm route: datagram without a routing header dropped");
                            if let Some(b) = c.buf.as_mut() {
                                b.clear();
                            }
                            c.status = Status::LocalQpInternalError;
                            c.byte_len = 0;
                            c.src = None;
                        }
                    }
                } else {
                    c.src = None;
                }
                local.consumed(self.primary.as_mut(), Path::Shm, &mut self.failed);
            }
            _ => {}
        }
    }
}

/// The primary source a routing header names, if it is one addressed to `me_qpn`.
fn parse_hdr(b: &[u8], me_qpn: u16) -> Option<Source> {
    if b.len() < HDR_LEN || b[..4] != HDR_MAGIC {
        return None;
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[4..20]);
    let qpn = u16::from_le_bytes([b[20], b[21]]);
    let dest_qpn = u16::from_le_bytes([b[22], b[23]]);
    (dest_qpn == me_qpn).then_some(Source { gid: Gid(gid), qpn })
}

impl QueuePair for RoutedQp {
    fn addr(&self) -> RawAddr {
        self.addr
    }

    fn unsolicited_write_recv(&self) -> bool {
        self.primary.unsolicited_write_recv()
    }

    fn hold_source(&mut self, src: Source, hold: bool) -> bool {
        self.primary.hold_source(src, hold)
    }

    fn qp_type(&self) -> QpType {
        QpType::Srd
    }

    fn post_send(&mut self, wr: SendWr) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "post_send").with_detail("queue pair closed"));
        }
        if wr.len() > self.mtu {
            return Err(
                Error::new(ErrorKind::MsgSize, "post_send").with_detail(format!(
                    "{} bytes exceed the mtu of {}",
                    wr.len(),
                    self.mtu
                )),
            );
        }
        if self.introduce.remove(&wr.dest) {
            // Over the primary: the peer's NIC must hold an address handle for us to serve our
            // RDMA, and only a datagram that reaches it there makes one.
            return self.primary.post_send(wr);
        }
        let shm_dest = match self.route(&wr.dest) {
            Route::Primary => return self.primary.post_send(wr),
            Route::Shm(a) => a,
            Route::Dead => {
                stats::inc(&self.shared.counters.send_errors);
                self.failed.push_back(DeviceCompletion::new(
                    wr.wr_id,
                    Status::UnresponsiveRemote,
                    Opcode::Send,
                    0,
                ));
                return Ok(());
            }
        };
        let sh = self.shared.clone();
        let Some(local) = self.local.as_mut() else {
            return self.primary.post_send(wr);
        };
        let mut hdr = BytesMut::with_capacity(HDR_LEN + wr.hdr.len());
        hdr.put_slice(&local.hdr);
        hdr[22..24].copy_from_slice(&wr.dest.qpn.to_le_bytes());
        hdr.put_slice(&wr.hdr);
        let len = wr.len() as u64;
        let (wr_id, dest) = (wr.wr_id, wr.dest);
        local.qp.post_send(SendWr {
            wr_id,
            dest: shm_dest,
            hdr: hdr.freeze(),
            payload: wr.payload,
            imm: wr.imm,
        })?;
        local.inflight.insert(wr_id, dest);
        stats::inc(&sh.counters.shm_route_tx_pkts);
        stats::add(&sh.counters.shm_route_tx_bytes, len);
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()> {
        if self.closed {
            return Err(Error::new(ErrorKind::Closed, "post_recv").with_detail("queue pair closed"));
        }
        let Some(local) = self.local.as_mut() else {
            return self.primary.post_recv(wr_id, buf);
        };
        // Buffers follow the traffic: one that comes back from a path is reposted there; each
        // path gets `base` first; the rest wait spare until a path consumes one.
        let [p, s] = local.posted;
        if local.spare.len() + p + s >= self.recv_depth {
            return Err(
                Error::new(ErrorKind::Again, "post_recv").with_detail(format!(
                    "receive queue full ({} work requests)",
                    self.recv_depth
                )),
            );
        }
        let path = match local.refill.pop_front() {
            Some(path) => path,
            None if p.min(s) < local.base => {
                if s < p {
                    Path::Shm
                } else {
                    Path::Primary
                }
            }
            None => {
                local.spare.push_back((wr_id, buf));
                return Ok(());
            }
        };
        local.post_to(self.primary.as_mut(), path, wr_id, buf)
    }

    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        if self.local.is_none() {
            return self.primary.poll(out, max);
        }
        let mut n = drain_into(&mut self.failed, out, max);
        // The two paths take turns at going first.
        self.shm_first = !self.shm_first;
        if self.shm_first {
            n += self.poll_shm(out, max - n);
            if n < max {
                n += self.poll_primary(out, max - n);
            }
        } else {
            n += self.poll_primary(out, max - n);
            if n < max {
                n += self.poll_shm(out, max - n);
            }
        }
        n
    }

    fn close(&mut self) {
        self.closed = true;
        if let Some(local) = self.local.as_mut() {
            // Unpublish first, so no peer picks the shm path any more.
            local.entry = None;
            local.qp.close();
            local.refill.clear();
            // Spare buffers were posted to the routed queue pair: they come back flushed.
            while let Some((wr_id, buf)) = local.spare.pop_front() {
                let mut c = DeviceCompletion::new(wr_id, Status::Flushed, Opcode::Recv, 0);
                c.buf = Some(buf);
                self.failed.push_back(c);
            }
        }
        self.primary.close();
    }

    rdma_posts_by_wr!(post_read, post_write, post_read_region, post_write_region);

    fn region_rdma(&self) -> bool {
        self.primary.region_rdma()
    }

    fn region_rdma_write(&self) -> bool {
        self.primary.region_rdma_write()
    }

    fn post_rdma_list(
        &mut self,
        wrs: &mut VecDeque<RdmaWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        let targets: Vec<(u64, RawAddr)> = wrs.iter().map(|w| (w.wr_id, w.dest)).collect();
        let r = self.primary.post_rdma_list(wrs);
        // Posted: those no longer in the list, but for a refused one.
        let posted = targets.len() - wrs.len() - usize::from(r.is_err());
        for &(wr_id, dest) in &targets[..posted] {
            self.note_rdma(wr_id, dest);
        }
        r
    }
}

impl RoutedQp {
    /// Polls the primary queue pair into `out`; its consumed receives are counted (and
    /// refilled) and the RDMA targets of its finished one-sided requests forgotten.
    fn poll_primary(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        let start = out.len();
        let got = self.primary.poll(out, max);
        if got == 0 {
            return 0;
        }
        if !self.rdma_to_local.is_empty() {
            for c in &out[start..] {
                if !matches!(c.opcode, Opcode::RdmaRead | Opcode::RdmaWrite) {
                    continue;
                }
                if let Some(dest) = self.rdma_to_local.remove(&c.wr_id) {
                    if c.status == Status::UnknownPeer {
                        self.introduce.insert(dest);
                    }
                }
            }
        }
        if let Some(local) = self.local.as_mut() {
            for c in &out[start..] {
                let consumed = c.opcode == Opcode::Recv
                    || (c.opcode == Opcode::RecvRdmaWithImm && c.wr_id != UNSOLICITED_WR_ID);
                if consumed {
                    let p = &mut local.posted[idx(Path::Primary)];
                    *p = p.saturating_sub(1);
                    if c.status != Status::Flushed {
                        local.consumed(self.primary.as_mut(), Path::Primary, &mut self.failed);
                    }
                }
            }
        }
        got
    }

    /// Polls the shm queue pair into `out`, each completion turned into the layer above's.
    fn poll_shm(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        let start = out.len();
        let got = match self.local.as_mut() {
            Some(local) => local.qp.poll(out, max),
            None => 0,
        };
        for c in &mut out[start..] {
            self.take_shm(c);
        }
        got
    }

    /// One one-sided work request: always over the primary, whose keys the regions carry.
    fn post_one_rdma(&mut self, wr: RdmaWr) -> Result<()> {
        let (wr_id, dest) = (wr.wr_id, wr.dest);
        post_rdma_wr(self.primary.as_mut(), wr)?;
        self.note_rdma(wr_id, dest);
        Ok(())
    }

    /// Remembers the target of an RDMA work request to a peer reached over shm (RDMA always
    /// goes over the primary, whose keys the regions carry).
    fn note_rdma(&mut self, wr_id: u64, dest: RawAddr) {
        if self.local.is_some() && matches!(self.route(&dest), Route::Shm(_)) {
            self.rdma_to_local.insert(wr_id, dest);
        }
    }
}

impl Drop for RoutedQp {
    fn drop(&mut self) {
        if let Some(local) = self.local.as_mut() {
            local.entry = None;
        }
    }
}
