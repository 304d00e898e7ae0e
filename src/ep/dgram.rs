//! `Endpoint<Dgram>`: datagrams of at most one MTU straight on the device's UD queue pair.

use std::fmt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use slab::Slab;

use super::buf::RecvTarget;
use super::{Dgram, Endpoint, EndpointBuilder};
use crate::addr::RawAddr;
use crate::av::PeerId;
use crate::cntr::Kind as CntrKind;
use crate::cq::{
    Buffer, Completion, CompletionError, CompletionFlags, CompletionQueue, PostError,
    ProgressSource, RecvBuf, SendBuf,
};
use crate::device::{DeviceCompletion, Opcode, QpAttr, QpType, QueuePair, SendWr, Status};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::stats::{self, EndpointCounters, EndpointStats};

/// The QKEY of every DGRAM endpoint's UD queue pair: libfabric's `EFA_DGRAM_CONNID`, 0. The EFA
/// provider gives all its DGRAM endpoints this QKEY (and its DGRAM address vectors put it in every
/// address inserted), so a DGRAM peer sends to QKEY 0 whatever our address says; a random QKEY
/// here would have the device drop its datagrams.
pub(crate) const DGRAM_QKEY: u32 = 0;

/// Size of EFA's `FI_MSG_PREFIX` area for DGRAM endpoints (the UD global route header).
pub const MSG_PREFIX_SIZE: usize = 40;

/// Largest batch of device completions taken per progress pass.
const POLL_BATCH: usize = 64;

builder_setters! {
    EndpointBuilder<Dgram> {
        /// `FI_MSG_PREFIX` mode, as EFA's DGRAM endpoints require: every send buffer starts with
        /// [`MSG_PREFIX_SIZE`] bytes the endpoint skips, and every receive places the datagram after a
        /// [`MSG_PREFIX_SIZE`]-byte area (zeroed) with `len` counting the prefix. Off by default: the
        /// crate reports the source in the completion instead, so buffers hold only data.
        msg_prefix: bool;
    }
}

impl EndpointBuilder<Dgram> {
    /// Creates the endpoint and its UD queue pair.
    ///
    /// Errors: `InvalidArgument` when a completion queue or the address vector is missing or
    /// belongs to another domain, or a queue size exceeds the device's; device errors.
    pub fn build(self) -> Result<Endpoint<Dgram>> {
        let parts = self.parts()?;
        let attr = self.domain.attr().clone();
        let (send_depth, recv_depth) = self.qp_depths(&attr)?;
        let notifier = Self::qp_notifier(&parts, None);
        let qp = self.domain.device().create_qp(QpAttr {
            qp_type: QpType::Ud,
            send_depth,
            recv_depth,
            rnr_retry: 0,
            qkey: Some(DGRAM_QKEY),
            notifier,
            unsolicited_write_recv: None,
            same_host_route: true,
        })?;
        let addr = qp.addr();
        tracing::debug!(%addr, send_depth, recv_depth, "dgram_ep_open");
        let core = Arc::new(DgramCore {
            domain: self.domain.clone(),
            parts,
            addr,
            mtu: attr.mtu,
            inject_size: attr.inline_size,
            prefix: self.msg_prefix,
            stats: EndpointCounters::default(),
            state: Mutex::new(State {
                qp,
                ops: Slab::new(),
                scratch: Vec::new(),
                sends: 0,
                recvs: 0,
            }),
            send_depth,
            recv_depth,
        });
        core.parts.bind(Arc::downgrade(&core) as _);
        Ok(Endpoint::from_core(core))
    }
}

enum Op {
    /// `context: None`: an inject (no completion unless it fails).
    Send {
        context: Option<u64>,
        buf: Buffer,
        len: usize,
    },
    Recv {
        context: u64,
        target: RecvTarget,
    },
}

struct State {
    qp: Box<dyn QueuePair>,
    ops: Slab<Op>,
    scratch: Vec<DeviceCompletion>,
    /// Sends and receives in flight, checked against the depths before posting so that a full
    /// queue is refused with `Again` while the caller still holds the buffer.
    sends: usize,
    recvs: usize,
}

/// Shared state of a DGRAM endpoint.
pub struct DgramCore {
    domain: Domain,
    /// The completion queues, address vector and counters (sends and receives) it is bound to.
    parts: super::Parts,
    addr: RawAddr,
    mtu: usize,
    /// Largest inject (`tx_attr.inject_size`: the device's inline size).
    inject_size: usize,
    prefix: bool,
    stats: EndpointCounters,
    state: Mutex<State>,
    send_depth: usize,
    recv_depth: usize,
}

impl fmt::Debug for DgramCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DgramCore")
            .field("addr", &self.addr)
            .field("mtu", &self.mtu)
            .finish()
    }
}

impl Endpoint<Dgram> {
    /// This endpoint's raw address; give it to peers (they insert it into their address vector).
    #[doc(alias = "fi_getname")]
    pub fn addr(&self) -> RawAddr {
        self.core.addr
    }

    /// The largest datagram payload (the device MTU).
    pub fn max_msg_size(&self) -> usize {
        self.core.mtu
    }

    /// The domain.
    pub fn domain(&self) -> &Domain {
        &self.core.domain
    }

    /// Sends one datagram to `peer`. The buffer is moved in and handed back in the completion.
    ///
    /// Errors (the buffer comes back inside [`PostError`]): `UnknownPeer` when `peer` is not in the
    /// address vector, `MsgSize` when the datagram exceeds the MTU, `Again` when the send queue is
    /// full (poll the completion queue and retry), `InvalidArgument` for a region without `SEND`
    /// access or a prefix-mode buffer shorter than the prefix.
    #[doc(alias = "fi_send")]
    pub fn send(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_send(peer, buf.into(), None, context)
    }

    /// Sends one datagram carrying 4 bytes of immediate data (`fi_senddata`); the receiver's
    /// completion has `data: Some(data)` and the `REMOTE_CQ_DATA` flag.
    #[doc(alias = "fi_senddata")]
    pub fn send_data(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        data: u32,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_send(peer, buf.into(), Some(data), context)
    }

    /// Sends one small datagram and forgets it (`fi_inject`): the bytes are copied before this
    /// returns, and a send that succeeds writes no completion; one that fails writes an error
    /// completion with context 0. At most [`Self::inject_size`] bytes (`InvalidArgument`
    /// beyond; in prefix mode, not counting the prefix `data` starts with).
    ///
    /// Errors: as [`Self::send`].
    #[doc(alias = "fi_inject")]
    pub fn inject(&self, peer: PeerId, data: &[u8]) -> Result<()> {
        self.core.post_inject(peer, data, None)
    }

    /// An [`inject`](Self::inject) with 4 bytes of immediate data (`fi_injectdata`).
    pub fn inject_data(&self, peer: PeerId, data: &[u8], imm: u32) -> Result<()> {
        self.core.post_inject(peer, data, Some(imm))
    }

    /// The largest datagram [`inject`](Self::inject) takes (`tx_attr.inject_size`).
    pub fn inject_size(&self) -> usize {
        self.core.inject_size
    }

    /// Posts a receive buffer. It is moved in and handed back in the completion.
    ///
    /// The buffer cannot be touched while the receive is in flight — it has been moved:
    ///
    /// ```compile_fail
    /// # fn f(ep: &efa::Endpoint<efa::Dgram>) {
    /// let buf = bytes::BytesMut::with_capacity(1024);
    /// ep.recv(buf, 7).unwrap();
    /// println!("{}", buf.len()); // error[E0382]: borrow of moved value: `buf`
    /// # }
    /// ```
    ///
    /// Errors (the buffer comes back inside [`PostError`]): `Again` when the receive queue is full,
    /// `InvalidArgument` for a region without `RECV` access or a prefix-mode buffer with less
    /// capacity than the prefix.
    #[doc(alias = "fi_recv")]
    pub fn recv(&self, buf: impl Into<RecvBuf>, context: u64) -> Result<(), PostError> {
        self.core.post_recv(buf.into(), context)
    }

    /// Drives the endpoint: moves ready device completions into its completion queues. Polling a
    /// completion queue does this for every endpoint bound to it.
    pub fn progress(&self) {
        self.core.progress();
    }

    /// This endpoint's counters.
    pub fn stats(&self) -> EndpointStats {
        self.core.stats.snapshot()
    }
}

fn refuse(error: Error, buf: Buffer) -> PostError {
    PostError { error, buf }
}

impl DgramCore {
    fn post_send(
        &self,
        peer: PeerId,
        buf: SendBuf,
        imm: Option<u32>,
        context: u64,
    ) -> Result<(), PostError> {
        let data = match super::buf::send_bytes(&buf, &self.domain, "send") {
            Ok(d) => d,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        self.post_datagram(peer, data, imm, Some(context), buf.into_buffer(), "send")
            .map_err(|(e, b)| refuse(e, b))
    }

    fn post_inject(&self, peer: PeerId, data: &[u8], imm: Option<u32>) -> Result<()> {
        let payload = if self.prefix {
            data.get(crate::ep::MSG_PREFIX_SIZE..).unwrap_or_default()
        } else {
            data
        };
        super::buf::check_inject(payload.len(), self.inject_size)?;
        let data = Bytes::copy_from_slice(data);
        self.post_datagram(peer, data, imm, None, Buffer::None, "inject")
            .map_err(|(e, _)| e)
    }

    /// Checks `data` (the whole buffer, prefix included in prefix mode) and posts it as one
    /// datagram; `context: None` is an inject. Refusals hand `buf` back.
    fn post_datagram(
        &self,
        peer: PeerId,
        data: Bytes,
        imm: Option<u32>,
        context: Option<u64>,
        buf: Buffer,
        op: &'static str,
    ) -> Result<(), (Error, Buffer)> {
        let dest = match self.parts.av.lookup(peer) {
            Ok(a) => a,
            Err(e) => return Err((e, buf)),
        };
        let payload = if self.prefix {
            if data.len() < crate::ep::MSG_PREFIX_SIZE {
                let e = Error::new(ErrorKind::InvalidArgument, op).with_detail(format!(
                    "prefix mode: buffer of {} bytes is shorter than the prefix",
                    data.len()
                ));
                return Err((e, buf));
            }
            data.slice(crate::ep::MSG_PREFIX_SIZE..)
        } else {
            data
        };
        if payload.len() > self.mtu {
            let e = Error::new(ErrorKind::MsgSize, op).with_detail(format!(
                "{} bytes > max_msg_size {}",
                payload.len(),
                self.mtu
            ));
            return Err((e, buf));
        }
        let len = payload.len();
        let mut st = self.state.lock();
        if st.sends >= self.send_depth {
            stats::inc(&self.stats.again);
            let e = Error::new(ErrorKind::Again, op).with_detail("send queue full");
            return Err((e, buf));
        }
        let entry = st.ops.vacant_entry();
        let wr = SendWr {
            wr_id: entry.key() as u64,
            dest,
            hdr: Bytes::new(),
            payload,
            imm,
        };
        match st.qp.post_send(wr) {
            Ok(()) => {
                st.ops.insert(Op::Send { context, buf, len });
                st.sends += 1;
                Ok(())
            }
            Err(e) => {
                if e.kind() == ErrorKind::Again {
                    stats::inc(&self.stats.again);
                }
                Err((e, buf))
            }
        }
    }

    fn post_recv(&self, buf: RecvBuf, context: u64) -> Result<(), PostError> {
        if self.state.lock().recvs >= self.recv_depth {
            stats::inc(&self.stats.again);
            let e = Error::new(ErrorKind::Again, "recv").with_detail("receive queue full");
            return Err(refuse(e, buf.into_buffer()));
        }
        let prefix = if self.prefix {
            crate::ep::MSG_PREFIX_SIZE
        } else {
            0
        };
        let (device_buf, target) = RecvTarget::prepare(buf, &self.domain, prefix, false, "recv")?;
        let mut st = self.state.lock();
        let key = st.ops.vacant_entry().key() as u64;
        match st.qp.post_recv(key, device_buf) {
            Ok(()) => {
                st.ops.insert(Op::Recv { context, target });
                st.recvs += 1;
                Ok(())
            }
            Err(e) => {
                if e.kind() == ErrorKind::Again {
                    stats::inc(&self.stats.again);
                }
                // The queue had room, so the device refused for another reason (closed, failed)
                // and kept the buffer it was given; hand back what the endpoint still holds.
                Err(refuse(e, target.abandon()))
            }
        }
    }

    fn complete(&self, st: &mut State, c: DeviceCompletion) {
        let Some(op) = st.ops.try_remove(c.wr_id as usize) else {
            tracing::warn!(
                wr_id = c.wr_id,
                "device completion for an unknown work request; dropped"
            );
            return;
        };
        match op {
            Op::Send { context, buf, len } => {
                st.sends -= 1;
                self.parts.counters.hit(CntrKind::Send, c.status.is_ok());
                let flags = CompletionFlags::SEND | CompletionFlags::MSG;
                if c.status.is_ok() {
                    stats::inc(&self.stats.tx_msgs);
                    stats::add(&self.stats.tx_bytes, len as u64);
                    // An inject completes silently.
                    let Some(context) = context else { return };
                    self.parts.tx_cq.push(Completion {
                        context,
                        flags,
                        len,
                        data: None,
                        tag: 0,
                        source: None,
                        source_addr: None,
                        buf,
                    });
                } else {
                    self.push_error(
                        &self.parts.tx_cq,
                        context.unwrap_or(0),
                        flags,
                        c.status,
                        0,
                        0,
                        None,
                        buf,
                        "send",
                    );
                }
            }
            Op::Recv { context, target } => {
                st.recvs -= 1;
                self.parts.counters.hit(CntrKind::Recv, c.status.is_ok());
                self.complete_recv(c, context, target)
            }
        }
    }

    fn complete_recv(&self, c: DeviceCompletion, context: u64, target: RecvTarget) {
        let mut flags = CompletionFlags::RECV | CompletionFlags::MSG;
        let source = c
            .src
            .and_then(|s| self.parts.av.reverse_lookup(s.gid, s.qpn));
        let device_buf = c.buf.unwrap_or_default();
        let room = device_buf.capacity();
        let prefix = target.prefix();
        let buf = target.finish(device_buf, c.status.is_ok());
        match c.status {
            Status::Success => {
                if c.imm.is_some() {
                    flags |= CompletionFlags::REMOTE_CQ_DATA;
                }
                stats::inc(&self.stats.rx_msgs);
                stats::add(&self.stats.rx_bytes, c.byte_len as u64);
                let len = c.byte_len + prefix;
                self.parts.rx_cq.push(Completion {
                    context,
                    flags,
                    len,
                    data: c.imm,
                    tag: 0,
                    source,
                    source_addr: None,
                    buf,
                });
            }
            Status::LocalBadLength => {
                stats::inc(&self.stats.truncated);
                stats::inc(&self.stats.errors);
                let olen = c.byte_len.saturating_sub(room);
                self.parts.rx_cq.push_err(CompletionError {
                    context,
                    flags,
                    error: Error::new(ErrorKind::Truncated, "recv").with_detail(format!(
                        "datagram of {} bytes, buffer of {room}",
                        c.byte_len
                    )),
                    len: 0,
                    olen,
                    status: Some(c.status),
                    data: c.imm,
                    tag: 0,
                    buf,
                });
            }
            s => self.push_error(
                &self.parts.rx_cq,
                context,
                flags,
                s,
                0,
                0,
                c.imm,
                buf,
                "recv",
            ),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push_error(
        &self,
        cq: &CompletionQueue,
        context: u64,
        flags: CompletionFlags,
        status: Status,
        len: usize,
        olen: usize,
        data: Option<u32>,
        buf: Buffer,
        op: &'static str,
    ) {
        let kind = status.error_kind();
        if kind == ErrorKind::Canceled {
            stats::inc(&self.stats.canceled);
        } else {
            stats::inc(&self.stats.errors);
        }
        let error = Error::new(kind, op).with_detail(format!("device status {status}"));
        cq.push_err(CompletionError {
            context,
            flags,
            error,
            len,
            olen,
            status: Some(status),
            data,
            tag: 0,
            buf,
        });
    }

    fn progress_locked(&self, st: &mut State) -> usize {
        let mut total = 0;
        loop {
            let room = self
                .parts
                .tx_cq
                .room()
                .min(self.parts.rx_cq.room())
                .min(POLL_BATCH);
            if room == 0 {
                break;
            }
            let mut batch = std::mem::take(&mut st.scratch);
            let n = st.qp.poll(&mut batch, room);
            for c in batch.drain(..) {
                self.complete(st, c);
            }
            st.scratch = batch;
            if n > 0 {
                self.parts.counters.signal();
            }
            total += n;
            if n < room {
                break;
            }
        }
        total
    }
}

impl ProgressSource for DgramCore {
    fn progress(&self) {
        let mut st = self.state.lock();
        self.progress_locked(&mut st);
    }
}

impl Drop for DgramCore {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        st.qp.close();
        let mut batch = Vec::new();
        loop {
            let n = st.qp.poll(&mut batch, usize::MAX);
            if n == 0 {
                break;
            }
        }
        let mut st = std::mem::replace(
            st,
            State {
                qp: Box::new(ClosedQp(self.addr)),
                ops: Slab::new(),
                scratch: Vec::new(),
                sends: 0,
                recvs: 0,
            },
        );
        for c in batch {
            self.complete(&mut st, c);
        }
        // A device that lost track of a work request still owes its operation one completion.
        for op in st.ops.drain() {
            let kind = match op {
                Op::Send { .. } => CntrKind::Send,
                Op::Recv { .. } => CntrKind::Recv,
            };
            self.parts.counters.hit(kind, false);
            let (cq, context, flags, buf) = match op {
                Op::Send { context, buf, .. } => (
                    &self.parts.tx_cq,
                    context.unwrap_or(0),
                    CompletionFlags::SEND | CompletionFlags::MSG,
                    buf,
                ),
                Op::Recv { context, target } => {
                    let buf = target.abandon();
                    (
                        &self.parts.rx_cq,
                        context,
                        CompletionFlags::RECV | CompletionFlags::MSG,
                        buf,
                    )
                }
            };
            self.push_error(
                cq,
                context,
                flags,
                Status::Flushed,
                0,
                0,
                None,
                buf,
                "ep_close",
            );
        }
        self.parts.tx_cq.signal();
        self.parts.rx_cq.signal();
        self.parts.counters.signal();
        tracing::debug!(addr = %self.addr, "dgram_ep_close");
    }
}

/// Stand-in queue pair while an endpoint is being torn down.
#[derive(Debug)]
struct ClosedQp(RawAddr);

impl QueuePair for ClosedQp {
    fn addr(&self) -> RawAddr {
        self.0
    }
    fn qp_type(&self) -> QpType {
        QpType::Ud
    }
    fn post_send(&mut self, _wr: SendWr) -> Result<()> {
        Err(Error::new(ErrorKind::Closed, "post_send"))
    }
    fn post_recv(&mut self, _wr_id: u64, _buf: BytesMut) -> Result<()> {
        Err(Error::new(ErrorKind::Closed, "post_recv"))
    }
    fn poll(&mut self, _out: &mut Vec<DeviceCompletion>, _max: usize) -> usize {
        0
    }
    fn close(&mut self) {}
}

#[allow(dead_code)]
fn _assert_kinds() {
    fn send<T: Send>() {}
    send::<Endpoint<Dgram>>();
    let _ = Opcode::Send;
}
