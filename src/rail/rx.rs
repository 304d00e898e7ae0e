//! The target's side: control messages from peers, the application's receives, and the order
//! in which messages and write notifications from one peer are delivered.
//!
//! Every peer numbers its messages and notifications to this group (`seq`). Whatever rail
//! carried them, they are matched and delivered in that order: one that arrives early waits in
//! `early` until the ones before it came; a message with no posted receive holds its peer's
//! later ones back (the peer waits in line for the next receive). Completions leave in the same
//! order, so a large message still being written holds back the notifications behind it.

use std::collections::{BTreeMap, VecDeque};

use bytes::BytesMut;

use super::region::RailRegion;
use super::state::State;
use super::wire::Ctrl;
use super::{RailCompletion, RailOp, RailPeer};
use crate::cq::Buffer;
use crate::domain::Domain;
use crate::error::{Error, ErrorKind};
use crate::mem::Access;

/// The most messages and notifications of one peer held ahead of their turn; beyond, later
/// ones are dropped (a peer that runs that far ahead is not one of ours).
const MAX_EARLY: usize = 1 << 16;

/// What one peer's messages to this group wait for.
#[derive(Default)]
pub(super) struct RxPeer {
    /// The sequence number of the next message or notification to deliver.
    next: u64,
    /// Those that came before their turn, or whose turn came without a posted receive.
    early: BTreeMap<u64, Ctrl>,
    /// In [`State::waiting`] for a receive.
    blocked: bool,
    /// Matched messages and notifications, in order, waiting to be completed.
    active: VecDeque<Entry>,
}

enum Entry {
    Done(RailCompletion),
    /// A large message being written into `mem` (a region on every rail, or the bare buffer
    /// when it takes no byte).
    AwaitFin {
        seq: u64,
        context: u64,
        mem: Mem,
    },
}

enum Mem {
    Region(RailRegion),
    Empty(BytesMut),
}

impl Mem {
    fn into_buf(self) -> BytesMut {
        match self {
            Mem::Region(r) => r.close(),
            Mem::Empty(b) => b,
        }
    }
}

impl State {
    /// A control message from `peer`.
    pub fn on_ctrl(&mut self, peer: usize, raw: &[u8]) {
        let Some(c) = Ctrl::decode(raw) else {
            self.ctrl_dropped += 1;
            tracing::debug!(peer, len = raw.len(), "malformed control message dropped");
            return;
        };
        let seq = c.seq();
        if let Ctrl::Ack { kind, .. } = c {
            return self.on_ack(peer, (kind, seq));
        }
        self.ack(peer, &c);
        match c {
            Ctrl::Ack { .. } => {}
            Ctrl::Cts { key, .. } => self.on_cts(peer, seq, key),
            Ctrl::Refuse { .. } => self.on_refuse(peer, seq),
            Ctrl::Fin { len, .. } => self.on_fin(peer, seq, Ok(len)),
            Ctrl::Abort { .. } if self.awaits_fin(peer, seq) => {
                let e = Error::new(ErrorKind::PeerAborted, "rail_recv")
                    .with_detail("the sender gave the message up (no rail to this group left)");
                self.on_fin(peer, seq, Err(e));
            }
            c => {
                let rx = &mut self.peers[peer].rx;
                if seq < rx.next || rx.early.len() >= MAX_EARLY {
                    self.ctrl_dropped += 1;
                    return;
                }
                if matches!(c, Ctrl::Abort { .. }) {
                    rx.early.insert(seq, c);
                } else {
                    rx.early.entry(seq).or_insert(c);
                }
                if rx.blocked && seq == rx.next {
                    // The item its peer waited with is replaced by a skip: no receive needed.
                    rx.blocked = false;
                    self.waiting.retain(|&p| p != peer);
                }
                if !self.peers[peer].rx.blocked {
                    self.advance(peer);
                }
            }
        }
    }

    fn awaits_fin(&self, peer: usize, seq: u64) -> bool {
        self.peers[peer]
            .rx
            .active
            .iter()
            .any(|e| matches!(e, Entry::AwaitFin { seq: s, .. } if *s == seq))
    }

    /// Posts an application receive, and gives it to the first peer waiting for one.
    pub fn post_recv(&mut self, buf: BytesMut, context: u64) {
        self.posted.push_back((context, buf));
        while !self.posted.is_empty() {
            let Some(p) = self.waiting.pop_front() else {
                break;
            };
            self.peers[p].rx.blocked = false;
            self.advance(p);
        }
    }

    /// Delivers `peer`'s messages and notifications whose turn has come, as far as receives
    /// allow.
    fn advance(&mut self, peer: usize) {
        loop {
            let rx = &mut self.peers[peer].rx;
            let Some(c) = rx.early.remove(&rx.next) else {
                break;
            };
            match c {
                Ctrl::Notify { data, len, .. } => {
                    rx.active.push_back(Entry::Done(RailCompletion {
                        context: 0,
                        op: RailOp::RemoteWrite,
                        peer: Some(RailPeer(peer as u32)),
                        len: len as usize,
                        data: Some(data),
                        result: Ok(()),
                        buf: Buffer::None,
                    }))
                }
                Ctrl::Msg { .. } | Ctrl::Rts { .. } => {
                    let Some((context, buf)) = self.posted.pop_front() else {
                        rx.early.insert(rx.next, c);
                        rx.blocked = true;
                        self.waiting.push_back(peer);
                        break;
                    };
                    let seq = rx.next;
                    self.take_message(peer, seq, c, context, buf);
                }
                // Abort: the sender gave this one up before it was matched; skip it.
                _ => {}
            }
            self.peers[peer].rx.next += 1;
        }
        self.flush(peer);
    }

    /// Matches message `seq` of `peer` with the receive `(context, buf)`.
    fn take_message(&mut self, peer: usize, seq: u64, c: Ctrl, context: u64, mut buf: BytesMut) {
        let cap = buf.capacity();
        match c {
            Ctrl::Msg { data, .. } => {
                buf.clear();
                let n = data.len().min(cap);
                crate::mem::copy::extend(&mut buf, &data[..n]);
                let result = truncated(data.len(), cap);
                let done = recv_done(peer, context, n, result, buf);
                self.peers[peer].rx.active.push_back(Entry::Done(done));
            }
            Ctrl::Rts { len, .. } => {
                let take = (len.min(cap as u64)) as usize;
                buf.clear();
                let mem = if take == 0 {
                    Mem::Empty(buf)
                } else {
                    buf.resize(take, 0);
                    let domains: Vec<&Domain> = self.rails.iter().map(|r| &r.domain).collect();
                    match RailRegion::register_on(&domains, buf, Access::REMOTE_WRITE) {
                        Ok(r) => Mem::Region(r),
                        Err(e) => {
                            tracing::warn!(peer, error = %e, "a message's buffer did not register");
                            let done = recv_done(peer, context, 0, Err(e), BytesMut::new());
                            self.peers[peer].rx.active.push_back(Entry::Done(done));
                            self.send_ctrl(peer, Ctrl::Refuse { seq }, None);
                            return;
                        }
                    }
                };
                let key = match &mem {
                    Mem::Region(r) => r.remote_key().expect("registered with REMOTE_WRITE"),
                    Mem::Empty(_) => super::addr::RailRemoteKey {
                        addr: 0,
                        len: 0,
                        keys: vec![0; self.rails.len()],
                    },
                };
                self.peers[peer]
                    .rx
                    .active
                    .push_back(Entry::AwaitFin { seq, context, mem });
                self.send_ctrl(peer, Ctrl::Cts { seq, key }, None);
            }
            _ => unreachable!("only messages are matched"),
        }
    }

    /// The sender of message `seq` finished writing it (`Ok` with its full length) or gave it
    /// up.
    fn on_fin(&mut self, peer: usize, seq: u64, how: Result<u64, Error>) {
        let rx = &mut self.peers[peer].rx;
        let Some(i) = rx
            .active
            .iter()
            .position(|e| matches!(e, Entry::AwaitFin { seq: s, .. } if *s == seq))
        else {
            self.ctrl_dropped += 1;
            return;
        };
        let placeholder = Entry::Done(recv_done(peer, 0, 0, Ok(()), BytesMut::new()));
        let (context, mem) = match std::mem::replace(&mut rx.active[i], placeholder) {
            Entry::AwaitFin { context, mem, .. } => (context, mem),
            other => {
                rx.active[i] = other;
                return;
            }
        };
        // Every rail's key is revoked before the application gets the bytes.
        let buf = mem.into_buf();
        let (n, result) = match how {
            Ok(len) => (buf.len(), truncated(len as usize, buf.len())),
            Err(e) => (0, Err(e)),
        };
        rx.active[i] = Entry::Done(recv_done(peer, context, n, result, buf));
        self.flush(peer);
    }

    /// Completes `peer`'s finished entries from the front, in order.
    fn flush(&mut self, peer: usize) {
        let mut out = Vec::new();
        let active = &mut self.peers[peer].rx.active;
        while matches!(active.front(), Some(Entry::Done(_))) {
            if let Some(Entry::Done(c)) = active.pop_front() {
                out.push(c);
            }
        }
        for c in out {
            self.finish(c);
        }
    }
}

/// `Truncated` when a message of `len` bytes met a buffer of `cap`.
fn truncated(len: usize, cap: usize) -> crate::Result<()> {
    if len > cap {
        Err(Error::new(ErrorKind::Truncated, "rail_recv")
            .with_detail(format!("a message of {len} bytes for a buffer of {cap}")))
    } else {
        Ok(())
    }
}

fn recv_done(
    peer: usize,
    context: u64,
    len: usize,
    result: crate::Result<()>,
    buf: BytesMut,
) -> RailCompletion {
    RailCompletion {
        context,
        op: RailOp::Recv,
        peer: Some(RailPeer(peer as u32)),
        len,
        data: None,
        result,
        buf: Buffer::Recv(buf),
    }
}
