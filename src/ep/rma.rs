//! RMA and atomics on RDM endpoints: `fi_write`, `fi_writedata`, `fi_read`, `fi_atomic`,
//! `fi_fetch_atomic`, `fi_compare_atomic`.
//!
//! An operation names the peer's memory by an [`RmaAddr`] (an address in the space of the
//! region's key, and the key), which the peer hands out as a [`RemoteKey`]. The local buffer is
//! moved into the operation and handed back in its completion, as for sends and receives.
//!
//! Whether an operation runs as one-sided device RDMA or is emulated by the protocol engine
//! (RTW / RTR / RTA packets) is decided per operation: device RDMA when both sides' devices have
//! it and `FI_EFA_USE_DEVICE_RDMA` allows it; atomics are always emulated.
//! [`Endpoint::rma_emulation`] tells which, like libfabric's `FI_OPT_EFA_EMULATED_READ`,
//! `_WRITE` and `_ATOMICS`; [`EndpointStats`](crate::EndpointStats) counts device and emulated
//! bytes apart. See `docs/rma.md`.

use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::Endpoint;
use super::rdm::{OpFuture, OpState, RdmCore, Sink, local_completion, refuse};
use crate::atomic::{AtomicOp, AtomicType};
use crate::av::PeerId;
use crate::cq::{
    Buffer, Completion, CompletionError, CompletionFlags, PostError, RecvBuf, SendBuf,
};
use crate::device::RemoteIov;
use crate::error::{Error, ErrorKind};
use crate::mr::{Access, MemoryRegion, RemoteKey};
use crate::proto::engine::{RemoteWriteDone, RmaBuf, RmaDone, RmaKind, RmaOp};
use crate::{Rdm, Result};

/// Where an RMA operation lands in, or reads from, a peer's memory: an address in the address
/// space of the peer's region key (`FI_MR_VIRT_ADDR`: the region's own address plus an offset),
/// and the key. Get one from the [`RemoteKey`] the peer handed out:
///
/// ```
/// # use efa::{RemoteKey, RmaAddr};
/// let rk = RemoteKey { addr: 0x1000, len: 4096, key: 7 };
/// assert_eq!(rk.at(16), RmaAddr { addr: 0x1010, key: 7 });
/// assert_eq!(rk.start(), rk.at(0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RmaAddr {
    /// Address in the region key's address space.
    pub addr: u64,
    /// The region key.
    pub key: u64,
}

impl RemoteKey {
    /// The address `offset` bytes into the region (not checked here: the target refuses an
    /// access outside the region with `RemoteAccess`).
    pub fn at(&self, offset: u64) -> RmaAddr {
        RmaAddr {
            addr: self.addr.wrapping_add(offset),
            key: self.key,
        }
    }

    /// The region's first byte.
    pub fn start(&self) -> RmaAddr {
        self.at(0)
    }
}

/// Options of one RMA write (`fi_writemsg` flags).
///
/// `#[non_exhaustive]`: build it from [`WriteOptions::default`] with the `with_*` methods, or
/// assign its public fields (docs/api-conventions.md).
///
/// ```
/// let o = efa::WriteOptions::default().with_data(9).with_delivery_complete(true);
/// assert_eq!((o.data, o.delivery_complete), (Some(9), true));
/// ```
///
/// ```compile_fail,E0639
/// let o = efa::WriteOptions { data: Some(9), delivery_complete: false };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WriteOptions {
    /// 4 bytes of immediate data (`fi_writedata`): the target gets one completion carrying them
    /// (`FI_REMOTE_WRITE | FI_REMOTE_CQ_DATA`) once all the bytes are in its memory.
    pub data: Option<u32>,
    /// Complete only once the data is in the target's memory (`FI_DELIVERY_COMPLETE`). A
    /// device RDMA write completes that way anyway (its completion comes after the target's
    /// device placed the bytes), and so does an emulated write; the flag changes nothing there
    /// and is kept for libfabric's meaning.
    pub delivery_complete: bool,
}

with_setters! {
    WriteOptions { with_delivery_complete => delivery_complete: bool }
    some { with_data => data: u32 }
}

/// Which operations of an endpoint run emulated by the protocol engine rather than as device
/// RDMA (`FI_OPT_EFA_EMULATED_READ`, `_WRITE`, `_ATOMICS`). Towards a peer whose device lacks
/// RDMA, operations are emulated even when this says `false`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct RmaEmulation {
    /// RMA reads are emulated (SHORT_RTR / LONGCTS_RTR).
    pub read: bool,
    /// RMA writes are emulated (EAGER_RTW / LONGCTS_RTW / LONGREAD_RTW).
    pub write: bool,
    /// Atomics are emulated (always, as on EFA).
    pub atomics: bool,
}

/// An atomic operation's description: what to apply to the target's elements.
#[derive(Clone, Debug)]
pub struct AtomicRequest {
    /// The operation.
    pub op: AtomicOp,
    /// The element type.
    pub datatype: AtomicType,
    /// Operand elements, little-endian; their count is the operation's element count (for
    /// [`AtomicOp::Read`], a buffer of the length to fetch, whose contents are ignored).
    pub operand: Bytes,
    /// Compare elements (compare operations only), as many as the operand's.
    pub compare: Option<Bytes>,
}

impl Endpoint<Rdm> {
    /// Writes `buf` to the peer's memory at `to` (`fi_write`). The completion (`FI_RMA |
    /// FI_WRITE`) hands `buf` back. A region must have `WRITE` access.
    ///
    /// ```
    /// # use bytes::Bytes;
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, Access};
    /// # fn main() -> efa::Result<()> {
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 64)?;
    /// # let av = AddressVector::new(&domain);
    /// # let a = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// # let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// // The target registers memory for remote writes and hands out its key.
    /// let region = domain.register(vec![0u8; 4096], Access::REMOTE_WRITE | Access::REMOTE_READ)?;
    /// let rk = region.remote_key()?;
    /// let peer_b = av.insert(b.addr())?;
    /// a.write(peer_b, Bytes::from_static(b"hello"), rk.at(100), 1)?;
    /// let mut done = Vec::new();
    /// while done.is_empty() {
    ///     cq.wait(&mut done, 8, Some(std::time::Duration::from_secs(5)))?;
    /// }
    /// assert_eq!(done[0].context, 1);
    /// assert_eq!(&region.read()[100..105], b"hello");
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_write")]
    pub fn write(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        to: RmaAddr,
        context: u64,
    ) -> Result<(), PostError> {
        self.write_with(peer, buf, to, WriteOptions::default(), context)
    }

    /// Writes `buf` with 4 bytes of immediate data (`fi_writedata`): the target gets exactly one
    /// completion carrying `data` once all the bytes are in its memory.
    #[doc(alias = "fi_writedata")]
    pub fn write_data(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        to: RmaAddr,
        data: u32,
        context: u64,
    ) -> Result<(), PostError> {
        let o = WriteOptions {
            data: Some(data),
            ..WriteOptions::default()
        };
        self.write_with(peer, buf, to, o, context)
    }

    /// Writes with options (`fi_writemsg`).
    #[doc(alias = "fi_writemsg")]
    pub fn write_with(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        to: RmaAddr,
        options: WriteOptions,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_write(peer, buf.into(), to, options, Sink::Cq(context))
    }

    /// Reads `len` bytes of the peer's memory at `from` into `buf` (`fi_read`): a `BytesMut`
    /// whose contents are replaced (its capacity grows if needed), or a region with `READ`
    /// access whose first `len` bytes are replaced. The completion (`FI_RMA | FI_READ`) hands
    /// `buf` back.
    #[doc(alias = "fi_read")]
    pub fn read(
        &self,
        peer: PeerId,
        buf: impl Into<RecvBuf>,
        len: usize,
        from: RmaAddr,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_read(peer, buf.into(), len, from, Sink::Cq(context))
    }

    /// Applies an atomic to the peer's elements at `to` (`fi_atomic`); the completion
    /// (`FI_ATOMIC | FI_WRITE`) hands the operand back.
    #[doc(alias = "fi_atomic")]
    pub fn atomic(
        &self,
        peer: PeerId,
        req: AtomicRequest,
        to: RmaAddr,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_atomic(peer, req, None, to, false, Sink::Cq(context))
    }

    /// Applies an atomic and fetches the elements' previous values into `result`
    /// (`fi_fetch_atomic`, `fi_compare_atomic` when `req.op` is a compare operation): a
    /// `BytesMut` whose contents are replaced, or a region slice with `READ` access whose first
    /// bytes are (it must hold the operand's length). The completion (`FI_ATOMIC | FI_READ`)
    /// hands `result` back filled.
    #[doc(alias = "fi_fetch_atomic")]
    #[doc(alias = "fi_compare_atomic")]
    pub fn fetch_atomic(
        &self,
        peer: PeerId,
        req: AtomicRequest,
        result: impl Into<RecvBuf>,
        to: RmaAddr,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_atomic(peer, req, Some(result.into()), to, false, Sink::Cq(context))
    }

    /// Writes and awaits the completion; cancel-safe like [`Endpoint::send_async`].
    pub fn write_async(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        to: RmaAddr,
        options: WriteOptions,
    ) -> OpFuture {
        OpFuture::post(&self.core, false, |sink| {
            self.core.post_write(peer, buf.into(), to, options, sink)
        })
    }

    /// Reads and awaits the completion; cancel-safe like [`Endpoint::send_async`].
    pub fn read_async(
        &self,
        peer: PeerId,
        buf: impl Into<RecvBuf>,
        len: usize,
        from: RmaAddr,
    ) -> OpFuture {
        OpFuture::post(&self.core, false, |sink| {
            self.core.post_read(peer, buf.into(), len, from, sink)
        })
    }

    /// Which operations run emulated (see [`RmaEmulation`]).
    pub fn rma_emulation(&self) -> RmaEmulation {
        let st = self.core.state.lock();
        let cfg = st.engine.config();
        RmaEmulation {
            read: !cfg.device_rdma_read,
            write: !cfg.device_rdma_write,
            atomics: true,
        }
    }
}

/// The bytes of a write's source (a region needs `WRITE` access; its bytes are copied, which a
/// device-only region refuses).
fn write_bytes(buf: &SendBuf, core: &RdmCore) -> Result<Bytes> {
    match buf {
        SendBuf::Bytes(b) => Ok(b.clone()),
        SendBuf::Region(r) => {
            r.check_local(&core.domain, Access::WRITE, "write")?;
            r.check_cpu("write")?;
            Ok(Bytes::copy_from_slice(&r.read()))
        }
    }
}

/// A region a read or a fetching atomic puts its result in: it grants `READ` and holds `len`
/// bytes (`InvalidArgument` otherwise).
fn result_region(
    r: &MemoryRegion,
    domain: &crate::domain::Domain,
    len: usize,
    op: &'static str,
) -> Result<()> {
    r.check_local(domain, Access::READ, op)?;
    if r.len() < len {
        return Err(Error::new(ErrorKind::InvalidArgument, op)
            .with_detail(format!("region of {} bytes cannot hold {len}", r.len())));
    }
    Ok(())
}

/// The key and address peers can read a region by (it has `REMOTE_READ`), for the read-based
/// protocols.
fn readable(r: &MemoryRegion) -> Option<(u64, u64)> {
    r.device_read_key()
}

/// An RMA operation checked and ready for the engine: what the endpoint tracks, and what the
/// engine gets.
pub(super) struct PreparedRma {
    state: OpState,
    op: RmaOp,
    name: &'static str,
}

impl RdmCore {
    pub(super) fn post_write(
        &self,
        peer: PeerId,
        buf: SendBuf,
        to: RmaAddr,
        o: WriteOptions,
        sink: Sink,
    ) -> Result<(), PostError> {
        let p = self.write_op(peer, buf, None, to, o, sink)?;
        self.start_rma(p)
    }

    /// The checks of a write of `buf` (the gathered bytes of `iov` when it is given: the
    /// completion hands `iov` back instead).
    pub(super) fn write_op(
        &self,
        peer: PeerId,
        buf: SendBuf,
        iov: Option<Vec<Buffer>>,
        to: RmaAddr,
        o: WriteOptions,
        sink: Sink,
    ) -> Result<PreparedRma, PostError> {
        let give = |buf: SendBuf, iov: Option<Vec<Buffer>>| match iov {
            Some(v) => Buffer::Iov(v),
            None => buf.into_buffer(),
        };
        let dest = match self.parts.av.lookup(peer) {
            Ok(a) => a,
            Err(e) => return Err(refuse(e, give(buf, iov))),
        };
        // A device-registered region goes to the device as it is (no copy); the engine copies
        // it only if the write is emulated.
        let local_region = match &buf {
            SendBuf::Region(r) if self.region_write => r.device_slice(),
            _ => None,
        };
        let data = match (&buf, &local_region) {
            (SendBuf::Region(r), Some(_)) => r
                .check_local(&self.domain, Access::WRITE, "write")
                .map(|()| Bytes::new()),
            _ => write_bytes(&buf, self),
        };
        let data = match data {
            Ok(d) => d,
            Err(e) => return Err(refuse(e, give(buf, iov))),
        };
        let len = local_region.as_ref().map_or(data.len(), |r| r.len);
        let (region, local_key) = match buf {
            SendBuf::Region(r) => {
                let k = readable(&r);
                (Some(r), k)
            }
            SendBuf::Bytes(_) => (None, None),
        };
        let remote = RemoteIov {
            addr: to.addr,
            len: len as u64,
            key: to.key,
        };
        let state = OpState {
            sink,
            target: None,
            keep: iov.map(Buffer::Iov).or(region.map(Buffer::Region)),
            multi: false,
            rma: Some(CompletionFlags::RMA | CompletionFlags::WRITE),
        };
        let op = RmaOp {
            dest,
            remote,
            kind: RmaKind::Write {
                buf: data,
                data: o.data,
            },
            local_key,
            delivery_complete: o.delivery_complete,
            context: 0,
            local_region,
        };
        Ok(PreparedRma {
            state,
            op,
            name: "write",
        })
    }

    pub(super) fn post_read(
        &self,
        peer: PeerId,
        buf: RecvBuf,
        len: usize,
        from: RmaAddr,
        sink: Sink,
    ) -> Result<(), PostError> {
        let p = self.read_op(peer, ReadInto::Buf(buf), len, from, sink)?;
        self.start_rma(p)
    }

    /// The checks of a read of `len` bytes into `into`.
    pub(super) fn read_op(
        &self,
        peer: PeerId,
        into: ReadInto,
        len: usize,
        from: RmaAddr,
        sink: Sink,
    ) -> Result<PreparedRma, PostError> {
        let dest = match self.parts.av.lookup(peer) {
            Ok(a) => a,
            Err(e) => return Err(refuse(e, into.into_buffer())),
        };
        let mut local_region = None;
        let (down, target) = match into {
            // A scatter reads into one buffer that is cut into the parts at completion.
            ReadInto::Scatter(t) => (BytesMut::with_capacity(len), Some(t)),
            ReadInto::Buf(RecvBuf::Bytes(mut b)) => {
                b.clear();
                b.reserve(len);
                (b, None)
            }
            ReadInto::Buf(RecvBuf::Region(r)) => {
                if let Err(e) = result_region(&r, &self.domain, len, "read") {
                    return Err(refuse(e, Buffer::Region(r)));
                }
                let target = super::buf::RecvTarget::Region {
                    region: r,
                    offset: 0,
                };
                // A device-registered region gets the data from the device itself.
                local_region = self
                    .region_rdma
                    .then(|| target.device_slice().and_then(|s| s.sub(0, len)))
                    .flatten();
                if local_region.is_none() {
                    if let super::buf::RecvTarget::Region { region, .. } = &target {
                        if let Err(e) = region.check_cpu("read") {
                            let e = e.with_detail(
                                "a read into a device-only region needs device RDMA into it \
                                 (this endpoint's queue pair cannot read into region memory)",
                            );
                            return Err(refuse(e, target.abandon()));
                        }
                    }
                }
                let room = if local_region.is_some() { 0 } else { len };
                (BytesMut::with_capacity(room), Some(target))
            }
        };
        let remote = RemoteIov {
            addr: from.addr,
            len: len as u64,
            key: from.key,
        };
        let state = OpState {
            sink,
            target,
            keep: None,
            multi: false,
            rma: Some(CompletionFlags::RMA | CompletionFlags::READ),
        };
        let op = RmaOp {
            dest,
            remote,
            kind: RmaKind::Read { buf: down },
            local_key: None,
            delivery_complete: false,
            context: 0,
            local_region,
        };
        Ok(PreparedRma {
            state,
            op,
            name: "read",
        })
    }

    fn post_atomic(
        &self,
        peer: PeerId,
        req: AtomicRequest,
        fetch: Option<RecvBuf>,
        to: RmaAddr,
        delivery_complete: bool,
        sink: Sink,
    ) -> Result<(), PostError> {
        let give_back = |fetch: Option<RecvBuf>, operand: Bytes| match fetch {
            Some(f) => f.into_buffer(),
            None => Buffer::Send(operand),
        };
        let dest = match self.parts.av.lookup(peer) {
            Ok(a) => a,
            Err(e) => return Err(refuse(e, give_back(fetch, req.operand))),
        };
        let size = req.datatype.size();
        let n = req.operand.len();
        let why = if n == 0 || !n.is_multiple_of(size) {
            Some(format!(
                "operand of {n} bytes is not a whole, non-zero number of {:?} elements",
                req.datatype
            ))
        } else if req.op.is_compare() != req.compare.is_some() {
            Some(format!(
                "{:?} {} a compare operand",
                req.op,
                if req.op.is_compare() {
                    "needs"
                } else {
                    "takes no"
                }
            ))
        } else if req.compare.as_ref().is_some_and(|c| c.len() != n) {
            Some("compare operand and operand differ in length".to_string())
        } else if fetch.is_none() && (req.op == AtomicOp::Read || req.op.is_compare()) {
            Some(format!(
                "{:?} returns the previous values: use fetch_atomic",
                req.op
            ))
        } else if req.datatype.is_float()
            && matches!(
                req.op,
                AtomicOp::Bor | AtomicOp::Band | AtomicOp::Bxor | AtomicOp::Mswap
            )
        {
            Some(format!("{:?} is not defined on {:?}", req.op, req.datatype))
        } else {
            None
        };
        if let Some(why) = why {
            let e = Error::new(ErrorKind::InvalidArgument, "atomic").with_detail(why);
            return Err(refuse(e, give_back(fetch, req.operand)));
        }
        // A region slice gets the previous values copied in at completion, from a buffer of
        // the operand's length.
        let (fetch, target) = match fetch {
            None => (None, None),
            Some(RecvBuf::Bytes(mut f)) => {
                f.clear();
                f.reserve(n);
                (Some(f), None)
            }
            Some(RecvBuf::Region(r)) => {
                let checked = result_region(&r, &self.domain, n, "fetch_atomic")
                    .and_then(|()| r.check_cpu("fetch_atomic"));
                if let Err(e) = checked {
                    return Err(refuse(e, Buffer::Region(r)));
                }
                let t = super::buf::RecvTarget::Region {
                    region: r,
                    offset: 0,
                };
                (Some(BytesMut::with_capacity(n)), Some(t))
            }
        };
        let mut flags = CompletionFlags::ATOMIC;
        flags |= if fetch.is_some() {
            CompletionFlags::READ
        } else {
            CompletionFlags::WRITE
        };
        let state = OpState {
            sink,
            target,
            keep: None,
            multi: false,
            rma: Some(flags),
        };
        let op = RmaOp {
            dest,
            remote: RemoteIov {
                addr: to.addr,
                len: n as u64,
                key: to.key,
            },
            kind: RmaKind::Atomic {
                op: req.op,
                datatype: req.datatype,
                operand: req.operand,
                compare: req.compare,
                fetch,
            },
            local_key: None,
            delivery_complete,
            context: 0,
            local_region: None,
        };
        self.start_rma(PreparedRma {
            state,
            op,
            name: "atomic",
        })
    }

    /// Hands an RMA operation to the engine, tracking its state under the operation's context,
    /// and makes progress.
    pub(super) fn start_rma(&self, p: PreparedRma) -> Result<(), PostError> {
        let now = Instant::now();
        let mut st = self.state.lock();
        self.start_rma_locked(&mut st, now, p)?;
        self.pump(&mut st, now);
        Ok(())
    }

    /// [`Self::start_rma`] under the caller's lock, without progress (the caller pumps).
    pub(super) fn start_rma_locked(
        &self,
        st: &mut super::rdm::State,
        now: Instant,
        p: PreparedRma,
    ) -> Result<(), PostError> {
        let PreparedRma {
            state,
            mut op,
            name,
        } = p;
        if st.closed {
            let b = give_back(state, RmaBuf::from_kind(op.kind));
            return Err(refuse(Error::new(ErrorKind::Closed, name), b));
        }
        let key = st.ops.insert(state);
        op.context = key as u64;
        match st.engine.rma(now, op) {
            Ok(()) => Ok(()),
            Err((e, op)) => {
                let s = st.ops.remove(key);
                Err(refuse(e, give_back(s, RmaBuf::from_kind(op.kind))))
            }
        }
    }

    /// The completion of an RMA operation this side started.
    pub(super) fn rma_completion(
        &self,
        r: RmaDone,
        context: u64,
        op: OpState,
    ) -> std::result::Result<Completion, CompletionError> {
        let flags = op.rma.unwrap_or(CompletionFlags::RMA);
        let ok = r.error.is_none();
        let buf = match (r.buf, op.target, op.keep) {
            (RmaBuf::InRegion, Some(t), _) => t.finish(BytesMut::new(), false),
            (RmaBuf::InRegion, None, Some(keep)) => keep,
            (RmaBuf::InRegion, None, None) => Buffer::None,
            (RmaBuf::Read(b), Some(t), _) => t.finish(b, ok),
            (RmaBuf::Read(b), None, _) => Buffer::Recv(b),
            (RmaBuf::Write(_), _, Some(keep)) => keep,
            (RmaBuf::Write(b), _, None) => Buffer::Send(b),
            (RmaBuf::Atomic { fetch: Some(f), .. }, Some(t), _) => t.finish(f, ok),
            (RmaBuf::Atomic { fetch: Some(f), .. }, None, _) => Buffer::Recv(f),
            (RmaBuf::Atomic { operand, .. }, _, _) => Buffer::Send(operand),
        };
        local_completion(context, flags, 0, r.len, r.error, r.status, buf)
    }

    /// The target-side completion of a peer's write with immediate data.
    pub(super) fn remote_write_completion(&self, w: RemoteWriteDone) -> Completion {
        let source = self
            .parts
            .av
            .find(&w.src)
            .or_else(|| self.parts.av.reverse_lookup(w.src.gid, w.src.qpn));
        Completion {
            context: 0,
            flags: CompletionFlags::RMA
                | CompletionFlags::REMOTE_WRITE
                | CompletionFlags::REMOTE_CQ_DATA,
            len: w.len,
            data: Some(w.data),
            tag: 0,
            source_addr: Some(w.src).filter(|_| source.is_none()),
            source,
            buf: Buffer::None,
        }
    }
}

/// Where a read lands: one buffer, or a scatter over several (`read_iov`).
pub(super) enum ReadInto {
    Buf(RecvBuf),
    Scatter(super::buf::RecvTarget),
}

impl ReadInto {
    fn into_buffer(self) -> Buffer {
        match self {
            ReadInto::Buf(b) => b.into_buffer(),
            ReadInto::Scatter(t) => t.abandon(),
        }
    }
}

/// The user's buffer of a refused RMA operation.
fn give_back(state: OpState, buf: RmaBuf) -> Buffer {
    match (buf, state.target, state.keep) {
        (_, Some(t), _) => t.abandon(),
        (_, None, Some(keep)) => keep,
        (RmaBuf::Write(b), None, None) => Buffer::Send(b),
        (RmaBuf::Read(b), None, None) => Buffer::Recv(b),
        (RmaBuf::Atomic { fetch: Some(f), .. }, None, None) => Buffer::Recv(f),
        (RmaBuf::Atomic { operand, .. }, None, None) => Buffer::Send(operand),
        (RmaBuf::InRegion, None, None) => Buffer::None,
    }
}

/// Peers' emulated RMA and atomics reach the domain's registered regions through this (the RDM
/// endpoint hands its domain to its protocol engine). Every access is checked against the key,
/// the range and the rights, and never blocks on a region the application holds (`Again`).
impl crate::proto::engine::RmaMemory for crate::domain::Domain {
    fn write(&self, key: u64, addr: u64, data: &[u8]) -> Result<()> {
        self.remote_write(key, addr, data)
    }

    fn read(&self, key: u64, addr: u64, len: u64) -> Result<Bytes> {
        self.remote_read(key, addr, len)
    }

    fn check(&self, key: u64, addr: u64, len: u64, write: bool) -> Result<()> {
        crate::mem::remote_check(self.mr_table(), key, addr, len, write)
    }

    fn atomic(&self, key: u64, addr: u64, a: crate::atomic::AtomicArgs<'_>) -> Result<Bytes> {
        crate::mem::remote_atomic(self.mr_table(), key, addr, a)
    }

    fn device_only(&self, key: u64) -> bool {
        self.mr_table().lock().is_device_only(key)
    }
}
