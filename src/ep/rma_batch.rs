//! RMA in batches, scatter-gather and inject: `write_batch` / `read_batch` (chains of
//! `fi_writemsg` / `fi_readmsg` with `FI_MORE`), `write_iov` / `read_iov` (`fi_writev`,
//! `fi_readv`), `inject_write` / `inject_write_data` (`fi_inject_write`,
//! `fi_inject_writedata`).

use std::collections::VecDeque;

use bytes::Bytes;

use super::Endpoint;
use super::buf::{RecvTarget, gather};
use super::rdm::{BatchError, BatchRequest, Clock, RdmCore, Sink, State};
use super::rma::{ReadInto, RmaAddr, WriteOptions};
use crate::Rdm;
use crate::av::PeerId;
use crate::cq::{Buffer, PostError, RecvBuf, SendBuf};
use crate::error::{Error, ErrorKind, Result};
use crate::info::RDM_IOV_LIMIT;
use crate::mr::Access;

/// One write of a batch ([`Endpoint::write_batch`]).
#[derive(Debug)]
pub struct WriteRequest {
    /// The target.
    pub peer: PeerId,
    /// The data: `Bytes`, or a region (slice) with `WRITE` access.
    pub buf: SendBuf,
    /// Where it lands.
    pub to: RmaAddr,
    /// Immediate data, delivery complete.
    pub options: WriteOptions,
    /// Returned in the completion.
    pub context: u64,
}

/// One read of a batch ([`Endpoint::read_batch`]).
#[derive(Debug)]
pub struct ReadRequest {
    /// The target.
    pub peer: PeerId,
    /// Where the bytes land: a `BytesMut` or a region (slice) with `READ` access.
    pub buf: RecvBuf,
    /// How many bytes.
    pub len: usize,
    /// Where they come from.
    pub from: RmaAddr,
    /// Returned in the completion.
    pub context: u64,
}

impl Endpoint<Rdm> {
    /// Posts the writes at the front of `reqs` together, like a chain of `fi_writemsg` calls
    /// with `FI_MORE` ending in one without: the endpoint is locked once, the engine takes them
    /// all, and one progress pass hands their work requests to the device as one list (one
    /// doorbell; one system call on the udp device where the socket takes the datagrams).
    /// Posted requests are removed from the front of `reqs`; when the endpoint is full
    /// (`Again`) the rest stay there, to be posted again after completions. Returns how many
    /// were posted; another refusal stops the batch with a [`BatchError`] that hands that
    /// write's buffer back. Each write completes on its own, as [`write_with`](Self::write_with)
    /// does.
    ///
    /// ```
    /// # use std::collections::VecDeque;
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, Access, WriteRequest, WriteOptions};
    /// # fn main() -> efa::Result<()> {
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 64)?;
    /// # let av = AddressVector::new(&domain);
    /// # let a = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// # let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// let target = domain.register(vec![0u8; 4 * 4096], Access::REMOTE_WRITE)?;
    /// let rk = target.remote_key()?;
    /// let peer = av.insert(b.addr())?;
    /// // Four pages of one region, each to the page after it at the target.
    /// let mut source = domain.register(vec![7u8; 4 * 4096], Access::WRITE)?;
    /// source.write()[4096..].fill(8);
    /// let mut reqs: VecDeque<WriteRequest> = source
    ///     .chunks(4096)?
    ///     .into_iter()
    ///     .enumerate()
    ///     .map(|(i, page)| WriteRequest {
    ///         peer,
    ///         buf: page.into(),
    ///         to: rk.at(((i + 1) % 4 * 4096) as u64),
    ///         options: WriteOptions::default(),
    ///         context: i as u64,
    ///     })
    ///     .collect();
    /// assert_eq!(a.write_batch(&mut reqs).map_err(|e| e.error)?, 4);
    /// let mut done = Vec::new();
    /// while done.len() < 4 {
    ///     cq.wait(&mut done, 8, Some(std::time::Duration::from_secs(5)))?;
    /// }
    /// assert_eq!(target.read()[4095], 8); // page 3 went to page 0
    /// assert_eq!(target.read()[4096], 7); // page 0 to page 1
    /// # Ok(()) }
    /// ```
    #[doc(alias = "FI_MORE")]
    pub fn write_batch(&self, reqs: &mut VecDeque<WriteRequest>) -> Result<usize, BatchError> {
        self.core.post_batch(reqs)
    }

    /// Posts the reads at the front of `reqs` together, as [`write_batch`](Self::write_batch)
    /// posts writes. Each read completes on its own, as [`read`](Self::read) does.
    #[doc(alias = "FI_MORE")]
    pub fn read_batch(&self, reqs: &mut VecDeque<ReadRequest>) -> Result<usize, BatchError> {
        self.core.post_batch(reqs)
    }

    /// Writes the parts of `iov` one after another to the peer's memory at `to` (`fi_writev`):
    /// each part is `Bytes` or a region (slice) with `WRITE` access, at most
    /// [`iov_limit`](crate::info::TxAttr::iov_limit) (4) of them. The parts are gathered into one
    /// buffer (a copy) and written as one operation; the completion hands them back as
    /// [`Buffer::Iov`], in order. To move several slices without a copy, write each one
    /// ([`write_batch`](Self::write_batch)).
    #[doc(alias = "fi_writev")]
    pub fn write_iov(
        &self,
        peer: PeerId,
        iov: Vec<SendBuf>,
        to: RmaAddr,
        options: WriteOptions,
        context: u64,
    ) -> Result<(), PostError> {
        let (data, parts) = gather(
            iov,
            &self.core.domain,
            Access::WRITE,
            RDM_IOV_LIMIT,
            "writev",
        )?;
        let sink = Sink::Cq(context);
        let p = self
            .core
            .write_op(peer, SendBuf::Bytes(data), Some(parts), to, options, sink)?;
        self.core.start_rma(p)
    }

    /// Reads the peer's memory at `from` into the parts of `iov` one after another
    /// (`fi_readv`): as many bytes as the parts hold (a `BytesMut` its capacity, a region (slice)
    /// with `READ` access its length), at most 4 parts. The completion hands them back as
    /// [`Buffer::Iov`], in order, each with its part of the data.
    ///
    /// ```
    /// # use bytes::BytesMut;
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, Access};
    /// # fn main() -> efa::Result<()> {
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 64)?;
    /// # let av = AddressVector::new(&domain);
    /// # let a = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// # let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// let source = domain.register(b"headbody".to_vec(), Access::REMOTE_READ)?;
    /// let rk = source.remote_key()?;
    /// let peer = av.insert(b.addr())?;
    /// let page = domain.register(vec![0u8; 4], Access::READ)?;
    /// a.read_iov(peer, vec![page.into(), BytesMut::with_capacity(4).into()], rk.start(), 1)?;
    /// let mut done = Vec::new();
    /// while done.is_empty() {
    ///     cq.wait(&mut done, 8, Some(std::time::Duration::from_secs(5)))?;
    /// }
    /// let parts = done.remove(0).buf.into_iov().unwrap();
    /// assert_eq!(&parts[0].as_region().unwrap().read()[..], b"head");
    /// assert_eq!(parts[1].as_recv(), Some(&b"body"[..]));
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_readv")]
    #[doc(alias = "fi_readmsg")]
    pub fn read_iov(
        &self,
        peer: PeerId,
        iov: Vec<RecvBuf>,
        from: RmaAddr,
        context: u64,
    ) -> Result<(), PostError> {
        let target =
            RecvTarget::prepare_iov(iov, &self.core.domain, Access::READ, RDM_IOV_LIMIT, "readv")?;
        let room = target.room().unwrap_or(0);
        let into = ReadInto::Scatter(target);
        let p = self
            .core
            .read_op(peer, into, room, from, Sink::Cq(context))?;
        self.core.start_rma(p)
    }

    /// Writes `data` to the peer's memory at `to` and forgets it (`fi_inject_write`): the bytes
    /// are copied before this returns, and a write that succeeds writes no completion; one that
    /// fails later writes an error completion with context 0. At most
    /// [`inject_rma_size`](Self::inject_rma_size) bytes (`InvalidArgument` beyond); `Again`
    /// when the endpoint is full.
    #[doc(alias = "fi_inject_write")]
    pub fn inject_write(&self, peer: PeerId, data: &[u8], to: RmaAddr) -> Result<()> {
        self.inject_write_with(peer, data, to, None)
    }

    /// [`inject_write`](Self::inject_write) with 4 bytes of immediate data
    /// (`fi_inject_writedata`): the target gets one completion carrying `imm`.
    #[doc(alias = "fi_inject_writedata")]
    pub fn inject_write_data(
        &self,
        peer: PeerId,
        data: &[u8],
        to: RmaAddr,
        imm: u32,
    ) -> Result<()> {
        self.inject_write_with(peer, data, to, Some(imm))
    }

    /// The largest [`inject_write`](Self::inject_write) (libfabric's `inject_rma_size`): the
    /// endpoint's [`inject_size`](Self::inject_size) unless set lower
    /// ([`EndpointOptions::inject_rma_size`](crate::EndpointOptions::inject_rma_size)).
    pub fn inject_rma_size(&self) -> usize {
        self.core.options.inject_rma_size()
    }

    fn inject_write_with(
        &self,
        peer: PeerId,
        data: &[u8],
        to: RmaAddr,
        imm: Option<u32>,
    ) -> Result<()> {
        if data.len() > self.inject_rma_size() {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "inject_write").with_detail(format!(
                    "{} bytes is more than inject_rma_size {}",
                    data.len(),
                    self.inject_rma_size()
                )),
            );
        }
        let o = WriteOptions {
            data: imm,
            delivery_complete: false,
        };
        let buf = SendBuf::Bytes(Bytes::copy_from_slice(data));
        self.core
            .post_write(peer, buf, to, o, Sink::Inject)
            .map_err(|e| e.error)
    }
}

impl BatchRequest for WriteRequest {
    type Meta = (PeerId, RmaAddr, WriteOptions, u64);
    fn meta(&self) -> Self::Meta {
        (self.peer, self.to, self.options, self.context)
    }
    fn post(self, core: &RdmCore, st: &mut State, clock: &mut Clock) -> Result<(), PostError> {
        let sink = Sink::Cq(self.context);
        let p = core.write_op(self.peer, self.buf, None, self.to, self.options, sink)?;
        core.start_rma_locked(st, clock.now(), p)
    }
    fn rebuild((peer, to, options, context): Self::Meta, buf: Buffer) -> Self {
        WriteRequest {
            peer,
            buf: SendBuf::from_returned(buf),
            to,
            options,
            context,
        }
    }
}

impl BatchRequest for ReadRequest {
    type Meta = (PeerId, usize, RmaAddr, u64);
    fn meta(&self) -> Self::Meta {
        (self.peer, self.len, self.from, self.context)
    }
    fn post(self, core: &RdmCore, st: &mut State, clock: &mut Clock) -> Result<(), PostError> {
        let sink = Sink::Cq(self.context);
        let p = core.read_op(
            self.peer,
            ReadInto::Buf(self.buf),
            self.len,
            self.from,
            sink,
        )?;
        core.start_rma_locked(st, clock.now(), p)
    }
    fn rebuild((peer, len, from, context): Self::Meta, buf: Buffer) -> Self {
        ReadRequest {
            peer,
            buf: RecvBuf::from_returned(buf),
            len,
            from,
            context,
        }
    }
}
