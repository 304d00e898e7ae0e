//! Loopback queue pairs and the per-device QPN table.

use crate::device::queues::Completions;
use crate::device::queues::{WrSlots, flush_recvs};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;

use super::DevShared;
use super::rdma::RdmaOp;
use super::wire::Wake;
use crate::addr::RawAddr;
use crate::device::{
    DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, RdmaKind, RdmaWr, SendWr, Source,
    random_qkey, rdma_posts_by_wr,
};
use crate::error::{Error, ErrorKind, Result};
use crate::notify::Notifier;
use crate::stats::inc;

/// Queue pair numbers of one device: handed out upwards from 1, a freed number is reused only
/// after the counter wraps, and a reused number never gets the QKEY it had before (unless asked).
pub(super) struct QpnTable {
    next: u16,
    used: HashSet<u16>,
    last_qkey: HashMap<u16, u32>,
}

impl QpnTable {
    pub(super) fn new() -> QpnTable {
        QpnTable {
            next: 1,
            used: HashSet::new(),
            last_qkey: HashMap::new(),
        }
    }

    /// The next free QPN and its QKEY (`requested`, or a fresh random one).
    fn alloc(&mut self, requested: Option<u32>) -> Option<(u16, u32)> {
        for _ in 0..u16::MAX {
            let qpn = self.next;
            self.next = if self.next == u16::MAX {
                1
            } else {
                self.next + 1
            };
            if self.used.insert(qpn) {
                let last = self.last_qkey.get(&qpn).copied();
                let qkey = requested.unwrap_or_else(|| {
                    loop {
                        let k = random_qkey();
                        if Some(k) != last {
                            break k;
                        }
                    }
                });
                self.last_qkey.insert(qpn, qkey);
                return Some((qpn, qkey));
            }
        }
        None
    }

    fn release(&mut self, qpn: u16) {
        self.used.remove(&qpn);
    }
}

/// What the network sees of a queue pair.
pub(super) struct QpShared {
    pub(super) addr: RawAddr,
    pub(super) qp_type: QpType,
    pub(super) rnr_retry: u8,
    pub(super) notifier: Arc<Notifier>,
    pub(super) dev: Arc<DevShared>,
    pub(super) state: Mutex<QpState>,
    /// Completions waiting in `state.comps`, readable without the lock so that an application
    /// busy-polling an idle queue pair never takes the lock a sender needs to deliver to it
    /// (a spinning poller that keeps re-taking it would starve the sender).
    pub(super) pending: AtomicUsize,
}

/// Receive buffers and completions of one queue pair.
#[derive(Default)]
pub(super) struct QpState {
    /// Posted receive buffers, consumed in posting order.
    pub(super) recvs: VecDeque<(u64, BytesMut)>,
    /// Completions not yet polled.
    pub(super) comps: Completions,
}

impl QpShared {
    /// What a receiver sees of this queue pair.
    pub(super) fn source(&self) -> Source {
        Source {
            gid: self.addr.gid,
            qpn: self.addr.qpn,
        }
    }

    /// Queues a completion and schedules the notifier.
    pub(super) fn push(&self, c: DeviceCompletion, wake: &mut Wake) {
        self.state.lock().comps.push(c);
        self.pending.fetch_add(1, Ordering::Release);
        wake.add(&self.notifier);
    }
}

/// A loopback queue pair (the handle `create_qp` returns).
pub(super) struct LoopbackQp {
    shared: Arc<QpShared>,
    /// Work requests posted whose completion has not been polled yet, against the depths.
    slots: WrSlots,
    closed: bool,
}

impl LoopbackQp {
    pub(super) fn create(dev: &Arc<DevShared>, attr: QpAttr) -> Result<LoopbackQp> {
        attr.check()?;
        let (qpn, qkey) = dev.qpns.lock().alloc(attr.qkey).ok_or_else(|| {
            Error::new(ErrorKind::NoMemory, "create_qp").with_detail("every QPN is in use")
        })?;
        let shared = Arc::new(QpShared {
            addr: RawAddr::new(dev.gid, qpn, qkey),
            qp_type: attr.qp_type,
            rnr_retry: attr.rnr_retry,
            notifier: attr.notifier,
            dev: dev.clone(),
            state: Mutex::new(QpState::default()),
            pending: AtomicUsize::new(0),
        });
        dev.net.wire.state.lock().attach_qp(shared.clone());
        tracing::trace!(addr = %shared.addr, qp_type = ?attr.qp_type, "loopback queue pair created");
        Ok(LoopbackQp {
            shared,
            slots: WrSlots::new(
                attr.send_depth.min(dev.cfg.max_send_wr),
                attr.recv_depth.min(dev.cfg.max_recv_wr),
            ),
            closed: false,
        })
    }

    fn check_open(&self, op: &'static str) -> Result<()> {
        if self.closed {
            Err(Error::new(ErrorKind::Closed, op).with_detail("queue pair closed"))
        } else {
            Ok(())
        }
    }

    /// The checks every RDMA post makes before it is accepted.
    fn check_rdma(&self, op: &'static str, len: u64) -> Result<()> {
        self.check_open(op)?;
        let cfg = &self.shared.dev.cfg;
        if !cfg.rdma {
            return Err(Error::new(ErrorKind::NotSupported, op)
                .with_detail("the loopback device was opened with rdma: false"));
        }
        if self.shared.qp_type != QpType::Srd {
            return Err(Error::new(ErrorKind::NotSupported, op)
                .with_detail("one-sided RDMA needs an SRD queue pair"));
        }
        if len > cfg.max_rdma_size {
            return Err(Error::new(ErrorKind::MsgSize, op)
                .with_detail(format!("{len} bytes > max_rdma_size {}", cfg.max_rdma_size)));
        }
        self.slots.send_room(op)
    }

    /// One one-sided work request: a read (`local.capacity()` must hold `remote.len` bytes) or a
    /// write (`remote.len` must equal `local.len()`), else `InvalidArgument`. Region reads and
    /// writes are not supported.
    fn post_one_rdma(&mut self, RdmaWr { wr_id, dest, kind }: RdmaWr) -> Result<()> {
        let (op, remote, into, data, imm) = match kind {
            RdmaKind::Read { local, remote } => {
                const OP: &str = "post_read";
                self.check_rdma(OP, remote.len)?;
                if (local.capacity() as u64) < remote.len {
                    return Err(
                        Error::new(ErrorKind::InvalidArgument, OP).with_detail(format!(
                            "local buffer capacity {} < remote length {}",
                            local.capacity(),
                            remote.len
                        )),
                    );
                }
                (OP, remote, Some(local), Bytes::new(), None)
            }
            RdmaKind::Write { local, remote, imm } => {
                const OP: &str = "post_write";
                self.check_rdma(OP, local.len() as u64)?;
                if remote.len != local.len() as u64 {
                    return Err(
                        Error::new(ErrorKind::InvalidArgument, OP).with_detail(format!(
                            "remote length {} differs from local length {}",
                            remote.len,
                            local.len()
                        )),
                    );
                }
                (OP, remote, None, local, imm)
            }
            kind => return Err(kind.not_supported()),
        };
        self.slots.take_send(op)?;
        let rdma = RdmaOp::new(self.shared.clone(), wr_id, remote, into);
        let wire = &self.shared.dev.net.wire;
        wire.rdma(&self.shared, dest, data, imm, rdma);
        Ok(())
    }
}

impl fmt::Debug for LoopbackQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackQp")
            .field("addr", &self.shared.addr)
            .field("qp_type", &self.shared.qp_type)
            .field("sends_out", &self.slots.sends())
            .field("recvs_out", &self.slots.recvs())
            .field("closed", &self.closed)
            .finish()
    }
}

impl QueuePair for LoopbackQp {
    fn addr(&self) -> RawAddr {
        self.shared.addr
    }

    fn unsolicited_write_recv(&self) -> bool {
        self.shared.qp_type == QpType::Srd && self.shared.dev.cfg.unsolicited_write_recv
    }

    fn qp_type(&self) -> QpType {
        self.shared.qp_type
    }

    fn post_send(&mut self, wr: SendWr) -> Result<()> {
        self.check_open("post_send")?;
        let mtu = self.shared.dev.cfg.mtu;
        if wr.len() > mtu {
            return Err(Error::new(ErrorKind::MsgSize, "post_send")
                .with_detail(format!("{} bytes > MTU {mtu}", wr.len())));
        }
        self.slots.take_send("post_send")?;
        self.shared.dev.net.wire.send(&self.shared, wr);
        Ok(())
    }

    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()> {
        self.check_open("post_recv")?;
        self.slots.take_recv()?;
        self.shared.state.lock().recvs.push_back((wr_id, buf));
        Ok(())
    }

    rdma_posts_by_wr!(post_read, post_write);

    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize {
        let wire = &self.shared.dev.net.wire;
        if wire.in_flight() > 0 {
            wire.pump();
        }
        if self.shared.pending.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut st = self.shared.state.lock();
        let n = st.comps.poll_into(&mut self.slots, out, max);
        self.shared.pending.fetch_sub(n, Ordering::AcqRel);
        n
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let shared = &self.shared;
        let flushed = shared
            .dev
            .net
            .wire
            .with_state(|st, _, _| st.detach_qp(shared));
        {
            let mut guard = shared.state.lock();
            let st = &mut *guard;
            for c in flushed {
                if c.opcode == Opcode::Send {
                    inc(&shared.dev.counters.send_errors);
                }
                st.comps.push(c);
                shared.pending.fetch_add(1, Ordering::Release);
            }
            let comps = &mut st.comps;
            flush_recvs(&mut st.recvs, |c| {
                comps.push(c);
                shared.pending.fetch_add(1, Ordering::Release);
            });
        }
        shared.notifier.notify();
        shared.dev.qpns.lock().release(shared.addr.qpn);
        tracing::trace!(addr = %shared.addr, "loopback queue pair closed");
    }
}

impl Drop for LoopbackQp {
    fn drop(&mut self) {
        self.close();
    }
}
