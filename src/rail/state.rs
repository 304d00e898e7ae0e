//! The group's state: its rails, peers, the rail operations in flight, and the routing of each
//! rail's completions to the stripe, control message or control receive they belong to.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use slab::Slab;

use super::addr::RailAddr;
use super::rx::RxPeer;
use super::tx::{Op, Stripe};
use super::{RailCompletion, RailGroupStats, RailPeer, RailStats, Settings};
use crate::av::{AddressVector, PeerId};
use crate::cq::{Buffer, Completion, CompletionError, CompletionFlags, CompletionQueue};
use crate::domain::Domain;
use crate::ep::{Endpoint, ProgressCpu, Rdm};
use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;

/// One rail: an RDM endpoint on one domain (NIC), with its queue and address vector.
pub(super) struct Rail {
    /// `None` once disabled.
    pub ep: Option<Endpoint<Rdm>>,
    pub cq: CompletionQueue,
    pub av: AddressVector,
    pub domain: Domain,
    /// The endpoint's address (kept after it is disabled, for the bundle).
    pub addr: crate::addr::RawAddr,
    /// Stripes in flight on it.
    pub in_flight: usize,
    pub stats: RailStats,
}

/// A peer group.
pub(super) struct Peer {
    /// The peer's endpoint on path `i` (our rail `i` to its rail `i`), in rail `i`'s address
    /// vector.
    pub paths: Vec<PeerId>,
    /// Why path `i` is given up (`None` while it works).
    pub dead: Vec<Option<Error>>,
    /// The next sequence number of this group's messages and notifications to the peer.
    pub tx_seq: u64,
    /// Large sends waiting for the peer's buffer, by sequence number.
    pub await_cts: HashMap<u64, usize>,
    /// Control messages sent and not yet acknowledged.
    pub unacked: HashMap<super::ctrl::CtrlKey, super::ctrl::Unacked>,
    pub rx: RxPeer,
}

/// A rail operation in flight; its rail-level context is its key plus one (0 is never used,
/// so a completion without a context of ours is never taken for one).
pub(super) enum Work {
    /// A stripe of a group operation.
    Stripe { rail: usize, stripe: Stripe },
    /// A control message to `peer`: one that waits for its acknowledgement (`key`), or an
    /// acknowledgement.
    Ctrl {
        rail: usize,
        peer: usize,
        msg: Bytes,
        key: Option<super::ctrl::CtrlKey>,
    },
    /// A posted control receive.
    CtrlRecv { rail: usize },
}

pub(super) struct State {
    pub rails: Vec<Rail>,
    pub peers: Vec<Peer>,
    /// The group peer behind an endpoint of a rail's address vector.
    pub by_src: HashMap<(usize, PeerId), usize>,
    pub ops: Slab<Op>,
    pub work: Slab<Work>,
    /// Stripes waiting for a rail with room.
    pub queue: VecDeque<Stripe>,
    /// Control messages a rail refused for lack of room (`Again`), to post again.
    pub ctrl_backlog: VecDeque<(usize, Bytes, Option<super::ctrl::CtrlKey>)>,
    /// Control receive buffers to post again once a rail has room.
    pub idle_recvs: Vec<(usize, BytesMut)>,
    /// The application's posted receives, oldest first.
    pub posted: VecDeque<(u64, BytesMut)>,
    /// Peers whose next message waits for a posted receive, in the order they started waiting.
    pub waiting: VecDeque<usize>,
    pub done: VecDeque<RailCompletion>,
    pub set: Settings,
    pub completed: u64,
    pub failed: u64,
    pub ctrl_dropped: u64,
}

/// Errors after which a stripe or control message is worth trying on another rail: the rail or
/// the peer's endpoint on it failed, not the request.
pub(super) fn rail_failure(kind: ErrorKind) -> bool {
    !matches!(
        kind,
        ErrorKind::RemoteAccess
            | ErrorKind::InvalidArgument
            | ErrorKind::MsgSize
            | ErrorKind::Truncated
            | ErrorKind::NotSupported
            | ErrorKind::NoMemory
            | ErrorKind::Config
    )
}

impl State {
    pub fn open(domains: &[Domain], set: Settings, thread: bool, cq_size: usize) -> Result<State> {
        let mut rails = Vec::with_capacity(domains.len());
        for d in domains {
            let cq = CompletionQueue::new(d, cq_size)?;
            let av = AddressVector::new(d);
            let mut b = Endpoint::<Rdm>::builder(d).cq(&cq).av(&av);
            if thread {
                b = b
                    .progress_thread(true)
                    .progress_cpu(ProgressCpu::NearDevice);
            }
            let ep = b.build()?;
            rails.push(Rail {
                addr: ep.addr(),
                ep: Some(ep),
                cq,
                av,
                domain: d.clone(),
                in_flight: 0,
                stats: RailStats {
                    device: d.attr().name.clone(),
                    enabled: true,
                    ..Default::default()
                },
            });
        }
        let mut st = State {
            rails,
            peers: Vec::new(),
            by_src: HashMap::new(),
            ops: Slab::new(),
            work: Slab::new(),
            queue: VecDeque::new(),
            ctrl_backlog: VecDeque::new(),
            idle_recvs: Vec::new(),
            posted: VecDeque::new(),
            waiting: VecDeque::new(),
            done: VecDeque::new(),
            set,
            completed: 0,
            failed: 0,
            ctrl_dropped: 0,
        };
        let cap = super::wire::MAX_CTRL_LEN + set.inline_size;
        for r in 0..st.rails.len() {
            for _ in 0..set.ctrl_recvs {
                st.post_ctrl_recv(r, BytesMut::with_capacity(cap));
            }
        }
        Ok(st)
    }

    pub fn addr(&self) -> RailAddr {
        RailAddr::new(self.rails.iter().map(|r| r.addr).collect())
            .expect("a group has 1 to MAX_RAILS rails (checked by the builder)")
    }

    pub fn insert(&mut self, addr: &RailAddr) -> Result<RailPeer> {
        let n = self.rails.len().min(addr.addrs().len());
        let mut paths = Vec::with_capacity(n);
        for (i, a) in addr.addrs()[..n].iter().enumerate() {
            paths.push(self.rails[i].av.insert(*a)?);
        }
        let id = self.peers.len();
        for (i, p) in paths.iter().enumerate() {
            self.by_src.insert((i, *p), id);
        }
        self.peers.push(Peer {
            dead: vec![None; n],
            paths,
            tx_seq: 0,
            await_cts: HashMap::new(),
            unacked: HashMap::new(),
            rx: RxPeer::default(),
        });
        Ok(RailPeer(id as u32))
    }

    /// The group peer `peer` names, or `InvalidArgument`.
    pub fn peer_index(&self, peer: RailPeer, op: &'static str) -> Result<usize> {
        let i = peer.index();
        if i < self.peers.len() {
            Ok(i)
        } else {
            Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail(format!("{peer:?} was never inserted")))
        }
    }

    /// True when path `rail` to `peer` can carry traffic.
    pub fn live(&self, peer: usize, rail: usize) -> bool {
        let p = &self.peers[peer];
        rail < p.paths.len() && p.dead[rail].is_none() && self.rails[rail].ep.is_some()
    }

    /// The number of paths to `peer` that work.
    pub fn live_paths(&self, peer: usize) -> usize {
        (0..self.peers[peer].paths.len())
            .filter(|&r| self.live(peer, r))
            .count()
    }

    /// Gives path `rail` to `peer` up after `e` (logged once).
    pub fn kill_path(&mut self, peer: usize, rail: usize, e: &Error) {
        if let Some(d) = self.peers[peer].dead.get_mut(rail) {
            if d.is_none() {
                tracing::warn!(peer, rail, error = %e, "rail to peer failed; its work moves to the other rails");
                *d = Some(e.clone());
            }
        }
    }

    /// The error of an operation to `peer` that no rail can carry any more: the kind of the
    /// last failure, and every path's reason.
    pub fn no_rail_error(&self, peer: usize, op: &'static str) -> Error {
        let p = &self.peers[peer];
        let mut kind = ErrorKind::Unreachable;
        let reasons: Vec<String> = (0..p.paths.len())
            .map(|r| match (&p.dead[r], self.rails[r].ep.is_some()) {
                (Some(e), _) => {
                    kind = e.kind();
                    format!("rail {r}: {e}")
                }
                (None, false) => format!("rail {r}: disabled here"),
                (None, true) => format!("rail {r}: usable"),
            })
            .collect();
        Error::new(kind, op).with_detail(format!(
            "no rail to the peer is left ({})",
            reasons.join("; ")
        ))
    }

    /// Posts a control receive buffer on `rail` (kept for later when the rail is full).
    pub fn post_ctrl_recv(&mut self, rail: usize, mut buf: BytesMut) {
        let Some(ep) = self.rails[rail].ep.as_ref() else {
            return;
        };
        buf.clear();
        let key = self.work.insert(Work::CtrlRecv { rail });
        if let Err(e) = ep.recv(buf, key as u64 + 1) {
            self.work.remove(key);
            if e.kind() == ErrorKind::Again {
                if let Buffer::Recv(b) = e.buf {
                    self.idle_recvs.push((rail, b));
                }
            } else {
                tracing::warn!(rail, error = %e.error, "rail refused a control receive");
            }
        }
    }

    /// The notifiers of the rails' completion queues (for [`super::RailGroup::wait`]).
    pub fn notifiers(&self) -> Vec<Arc<Notifier>> {
        self.rails.iter().map(|r| r.cq.notifier().clone()).collect()
    }

    /// Drives the rails, routes their completions, moves waiting work on, and hands out up to
    /// `max` group completions.
    pub fn poll(&mut self, out: &mut Vec<RailCompletion>, max: usize) -> Result<usize> {
        let mut batch = Vec::new();
        for rail in 0..self.rails.len() {
            loop {
                batch.clear();
                match self.rails[rail].cq.poll(&mut batch, 64) {
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::ErrorAvailable => {}
                    Err(e) => return Err(e),
                }
                let mut any = !batch.is_empty();
                for c in batch.drain(..) {
                    self.on_rail_ok(rail, c);
                }
                while let Some(e) = self.rails[rail].cq.read_err() {
                    any = true;
                    self.on_rail_err(rail, e);
                }
                if !any {
                    break;
                }
            }
        }
        for (rail, buf) in std::mem::take(&mut self.idle_recvs) {
            self.post_ctrl_recv(rail, buf);
        }
        for (peer, msg, key) in std::mem::take(&mut self.ctrl_backlog) {
            self.transmit(peer, msg, key, None);
        }
        self.resend_overdue(std::time::Instant::now());
        self.dispatch();
        let n = max.min(self.done.len());
        out.extend(self.done.drain(..n));
        Ok(n)
    }

    fn on_rail_ok(&mut self, rail: usize, c: Completion) {
        if c.flags.contains(CompletionFlags::REMOTE_WRITE) || c.context == 0 {
            return;
        }
        let Some(w) = self.work.try_remove(c.context as usize - 1) else {
            return;
        };
        self.rails[rail].stats.ops += 1;
        match w {
            Work::Stripe { rail, stripe } => self.stripe_done(rail, stripe, Ok(()), c.buf),
            // Done when acknowledged.
            Work::Ctrl { .. } => {}
            Work::CtrlRecv { rail } => {
                let src = c.source;
                if let Buffer::Recv(buf) = c.buf {
                    match src.and_then(|s| self.by_src.get(&(rail, s)).copied()) {
                        Some(peer) => self.on_ctrl(peer, &buf),
                        None => {
                            self.ctrl_dropped += 1;
                            tracing::debug!(
                                rail,
                                "control message from a peer never inserted dropped"
                            );
                        }
                    }
                    self.post_ctrl_recv(rail, buf);
                }
            }
        }
    }

    fn on_rail_err(&mut self, rail: usize, e: CompletionError) {
        if e.context == 0 {
            return;
        }
        let Some(w) = self.work.try_remove(e.context as usize - 1) else {
            return;
        };
        self.rails[rail].stats.errors += 1;
        match w {
            Work::Stripe { rail, stripe } => self.stripe_done(rail, stripe, Err(e.error), e.buf),
            Work::Ctrl {
                rail,
                peer,
                msg,
                key,
            } => self.ctrl_failed(rail, peer, msg, key, e.error),
            Work::CtrlRecv { rail } => {
                if let Buffer::Recv(buf) = e.buf {
                    // Canceled when the rail closes (then not posted again); a message too long
                    // for a control buffer is no control message of ours.
                    if self.rails[rail].ep.is_some() && e.error.kind() != ErrorKind::Canceled {
                        self.ctrl_dropped += 1;
                        self.post_ctrl_recv(rail, buf);
                    }
                }
            }
        }
    }

    pub fn disable_rail(&mut self, rail: usize) -> Result<()> {
        let Some(r) = self.rails.get_mut(rail) else {
            return Err(Error::new(ErrorKind::InvalidArgument, "rail_disable")
                .with_detail(format!("rail {rail} of {}", self.rails.len())));
        };
        r.stats.enabled = false;
        // Closing the endpoint fails everything in flight on it with `Canceled` into its queue;
        // the next poll moves that work to the other rails.
        drop(r.ep.take());
        tracing::info!(rail, device = %r.stats.device, "rail disabled");
        Ok(())
    }

    pub fn stats(&self) -> RailGroupStats {
        RailGroupStats {
            rails: self.rails.iter().map(|r| r.stats.clone()).collect(),
            completed: self.completed,
            failed: self.failed,
            ctrl_dropped: self.ctrl_dropped,
        }
    }

    /// Queues a finished group completion and counts it.
    pub fn finish(&mut self, c: RailCompletion) {
        if c.result.is_ok() {
            self.completed += 1;
        } else {
            self.failed += 1;
        }
        self.done.push_back(c);
    }
}
