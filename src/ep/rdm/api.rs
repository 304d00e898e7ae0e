//! The public operations of `Endpoint<Rdm>`: sends, injects, receives, batches, claims, cancel,
//! progress and statistics.

use super::*;

impl Endpoint<Rdm> {
    /// This endpoint's raw address.
    #[doc(alias = "fi_getname")]
    pub fn addr(&self) -> RawAddr {
        self.core.addr
    }

    /// The domain.
    pub fn domain(&self) -> &Domain {
        &self.core.domain
    }

    /// Sends a message of any size to `peer`; the buffer is handed back in the completion.
    #[doc(alias = "fi_send")]
    pub fn send(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_send(
            peer,
            buf.into(),
            None,
            SendOptions::default(),
            Sink::Cq(context),
        )
    }

    /// Sends a message with 4 bytes of remote CQ data (`fi_senddata`).
    #[doc(alias = "fi_senddata")]
    pub fn send_data(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        data: u32,
        context: u64,
    ) -> Result<(), PostError> {
        let o = SendOptions {
            data: Some(data),
            ..Default::default()
        };
        self.core
            .post_send(peer, buf.into(), None, o, Sink::Cq(context))
    }

    /// Sends a tagged message (`fi_tsend`).
    #[doc(alias = "fi_tsend")]
    pub fn tsend(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        tag: u64,
        context: u64,
    ) -> Result<(), PostError> {
        let o = SendOptions {
            tag: Some(tag),
            ..Default::default()
        };
        self.core
            .post_send(peer, buf.into(), None, o, Sink::Cq(context))
    }

    /// Sends with explicit options (`fi_sendmsg` / `fi_tsendmsg`).
    #[doc(alias = "fi_sendmsg")]
    #[doc(alias = "fi_tsenddata")]
    #[doc(alias = "fi_tsendmsg")]
    pub fn send_with(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        options: SendOptions,
        context: u64,
    ) -> Result<(), PostError> {
        self.core
            .post_send(peer, buf.into(), None, options, Sink::Cq(context))
    }

    /// Sends the parts of `iov` as one message (`fi_sendv`, `fi_tsendv` and `fi_sendmsg` with
    /// several iovs: `options` carries the tag and remote CQ data): each part is `Bytes` or a
    /// region (slice) with `SEND` access, at most [`iov_limit`](crate::info::TxAttr::iov_limit) (4)
    /// of them (`InvalidArgument` beyond). The parts are gathered into one buffer (a copy, as
    /// libfabric's EFA provider copies iovs into its packets); the completion hands them back
    /// as [`Buffer::Iov`], in order.
    ///
    /// ```
    /// # use bytes::{Bytes, BytesMut};
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, Access, RecvOptions, SendOptions};
    /// # fn main() -> efa::Result<()> {
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let tx = CompletionQueue::new(&domain, 64)?;
    /// # let rx = CompletionQueue::new(&domain, 64)?;
    /// # let av = AddressVector::new(&domain);
    /// # let a = Endpoint::<Rdm>::builder(&domain).cq(&tx).av(&av).build()?;
    /// # let b = Endpoint::<Rdm>::builder(&domain).cq(&rx).av(&av).build()?;
    /// let peer = av.insert(b.addr())?;
    /// // A header in a registered page, a body as bytes, one message; a scatter receive.
    /// let mut header = domain.register(vec![0u8; 4], Access::SEND)?;
    /// header.write().copy_from_slice(b"HEAD");
    /// let body = Bytes::from_static(b"the body");
    /// b.recv_iov(vec![BytesMut::with_capacity(4).into(), BytesMut::with_capacity(64).into()],
    ///     RecvOptions::default(), 2)?;
    /// a.send_iov(peer, vec![header.into(), body.into()], SendOptions::default(), 1)?;
    /// let mut got = Vec::new();
    /// while got.is_empty() {
    ///     a.progress();
    ///     rx.poll(&mut got, 1)?;
    /// }
    /// assert_eq!(got[0].len, 12);
    /// let parts = got.remove(0).buf.into_iov().unwrap();
    /// assert_eq!(parts[0].as_recv(), Some(&b"HEAD"[..]));
    /// assert_eq!(parts[1].as_recv(), Some(&b"the body"[..]));
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_sendv")]
    #[doc(alias = "fi_tsendv")]
    pub fn send_iov(
        &self,
        peer: PeerId,
        iov: Vec<SendBuf>,
        options: SendOptions,
        context: u64,
    ) -> Result<(), PostError> {
        let limit = crate::info::RDM_IOV_LIMIT;
        let (data, parts) = crate::ep::buf::gather(
            iov,
            &self.core.domain,
            crate::mem::Access::SEND,
            limit,
            "sendv",
        )?;
        let buf = SendBuf::Bytes(data);
        self.core
            .post_send(peer, buf, Some(parts), options, Sink::Cq(context))
    }

    /// Receives one message into the parts of `iov`, one after another (`fi_recvv`,
    /// `fi_trecvv`, `fi_recvmsg` with several iovs; `options` carries the tag and the source):
    /// a `BytesMut` offers its capacity, a region (slice) with `RECV` access its length, at most
    /// 4 parts. The message fills them in order (a longer one is truncated at their total); the
    /// completion hands them back as [`Buffer::Iov`], each holding its part
    /// (a `BytesMut` as long as its part, a region its part in its first bytes). Not a
    /// multi-receive buffer (`InvalidArgument`).
    #[doc(alias = "fi_recvv")]
    #[doc(alias = "fi_trecvv")]
    pub fn recv_iov(
        &self,
        iov: Vec<RecvBuf>,
        options: RecvOptions,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_recv_iov(iov, options, context)
    }

    /// Sends a small message and forgets it (`fi_inject`): the bytes are copied before this
    /// returns, and a send that succeeds writes no completion. A send that fails later writes an
    /// error completion with context 0 to the transmit queue.
    ///
    /// `data` may be at most `tx_attr.inject_size` bytes ([`Self::inject_size`]); longer is
    /// `InvalidArgument`. `Again` when `tx_size` sends are in flight.
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, CompletionQueue, AddressVector};
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 64)?;
    /// # let av = AddressVector::new(&domain);
    /// # let ep = Endpoint::<efa::Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// let me = av.insert(ep.addr())?;
    /// ep.recv(bytes::BytesMut::with_capacity(64), 1).map_err(efa::Error::from)?;
    /// ep.inject(me, b"hello")?; // the slice is free again at once
    /// let mut out = Vec::new();
    /// while out.is_empty() {
    ///     cq.poll(&mut out, 8)?;
    /// }
    /// assert_eq!(out[0].buf.as_recv(), Some(&b"hello"[..]));
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_inject")]
    pub fn inject(&self, peer: PeerId, data: &[u8]) -> Result<()> {
        self.core.post_inject(peer, data, SendOptions::default())
    }

    /// A tagged [`inject`](Self::inject) (`fi_tinject`).
    #[doc(alias = "fi_tinject")]
    pub fn tinject(&self, peer: PeerId, data: &[u8], tag: u64) -> Result<()> {
        let o = SendOptions {
            tag: Some(tag),
            ..Default::default()
        };
        self.core.post_inject(peer, data, o)
    }

    /// An [`inject`](Self::inject) with 4 bytes of remote CQ data (`fi_injectdata`).
    #[doc(alias = "fi_injectdata")]
    pub fn inject_data(&self, peer: PeerId, data: &[u8], imm: u32) -> Result<()> {
        let o = SendOptions {
            data: Some(imm),
            ..Default::default()
        };
        self.core.post_inject(peer, data, o)
    }

    /// An [`inject`](Self::inject) with a tag and/or remote CQ data (`fi_tinjectdata`).
    /// `delivery_complete` is `InvalidArgument`: an inject reports no completion to wait for.
    #[doc(alias = "fi_tinjectdata")]
    pub fn inject_with(&self, peer: PeerId, data: &[u8], options: SendOptions) -> Result<()> {
        self.core.post_inject(peer, data, options)
    }

    /// The largest message [`inject`](Self::inject) takes (`tx_attr.inject_size`).
    pub fn inject_size(&self) -> usize {
        self.core.inject_size
    }

    /// Posts the sends at the front of `reqs` together, like a chain of `fi_sendmsg` calls with
    /// `FI_MORE` ending in one without: the endpoint is locked once, the engine takes them all,
    /// and one progress pass hands their packets to the device back to back (the device can
    /// then push them out with one system call or doorbell). Posted requests are removed from
    /// the front of `reqs`; when the endpoint is full (`Again`) the rest stay there, to be posted
    /// again after completions. Returns how many were posted; another refusal stops the batch
    /// with a [`BatchError`] that hands that send's buffer back.
    ///
    /// ```
    /// # use std::collections::VecDeque;
    /// # use bytes::{Bytes, BytesMut};
    /// # use efa::{getinfo, Hints, EpType, Domain, Endpoint, Rdm, CompletionQueue, AddressVector, SendRequest, SendOptions};
    /// # fn main() -> efa::Result<()> {
    /// # let info = getinfo(&Hints::new().provider("loopback").ep_type(EpType::Rdm))?.remove(0);
    /// # let domain = Domain::open(&info)?;
    /// # let cq = CompletionQueue::new(&domain, 256)?;
    /// # let av = AddressVector::new(&domain);
    /// # let a = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// # let b = Endpoint::<Rdm>::builder(&domain).cq(&cq).av(&av).build()?;
    /// let peer = av.insert(b.addr())?;
    /// for i in 0..16 {
    ///     b.recv(BytesMut::with_capacity(64), 100 + i)?;
    /// }
    /// let mut reqs: VecDeque<SendRequest> = (0..16)
    ///     .map(|i| SendRequest {
    ///         peer,
    ///         buf: Bytes::from(vec![i as u8; 64]).into(),
    ///         options: SendOptions::default(),
    ///         context: i,
    ///     })
    ///     .collect();
    /// let mut posted = 0;
    /// while !reqs.is_empty() {
    ///     posted += a.send_batch(&mut reqs).map_err(|e| e.error.error)?;
    ///     a.progress();
    /// }
    /// assert_eq!(posted, 16);
    /// let mut done = Vec::new();
    /// while done.len() < 32 {
    ///     cq.wait(&mut done, 32, Some(std::time::Duration::from_secs(5)))?;
    /// }
    /// # Ok(()) }
    /// ```
    #[doc(alias = "FI_MORE")]
    pub fn send_batch(&self, reqs: &mut VecDeque<SendRequest>) -> Result<usize, BatchError> {
        self.core.post_batch(reqs)
    }

    /// Posts a receive for an untagged message from any peer.
    ///
    /// ```compile_fail
    /// # fn f(ep: &efa::Endpoint<efa::Rdm>) {
    /// let buf = bytes::BytesMut::with_capacity(1024);
    /// ep.recv(buf, 7).unwrap();
    /// buf.len(); // error[E0382]: borrow of moved value: `buf`
    /// # }
    /// ```
    #[doc(alias = "fi_recv")]
    pub fn recv(&self, buf: impl Into<RecvBuf>, context: u64) -> Result<(), PostError> {
        self.core
            .post_recv(buf.into(), RecvOptions::default(), Sink::Cq(context))
    }

    /// Posts a tagged receive: matches messages whose tag equals `tag` on every bit not set in
    /// `ignore` (`fi_trecv`).
    #[doc(alias = "fi_trecv")]
    pub fn trecv(
        &self,
        buf: impl Into<RecvBuf>,
        tag: u64,
        ignore: u64,
        context: u64,
    ) -> Result<(), PostError> {
        let o = RecvOptions {
            tag: Some((tag, ignore)),
            ..Default::default()
        };
        self.core.post_recv(buf.into(), o, Sink::Cq(context))
    }

    /// Posts a receive with explicit options (`fi_recvmsg` / `fi_trecvmsg`).
    #[doc(alias = "fi_recvmsg")]
    #[doc(alias = "fi_trecvmsg")]
    pub fn recv_with(
        &self,
        buf: impl Into<RecvBuf>,
        options: RecvOptions,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_recv(buf.into(), options, Sink::Cq(context))
    }

    /// Cancels the oldest posted receive with `context` (`fi_cancel`): it completes with a
    /// `Canceled` error completion that hands its buffer back. `NoMessage` if none is pending.
    #[doc(alias = "fi_cancel")]
    pub fn cancel(&self, context: u64) -> Result<()> {
        self.core.cancel(context)
    }

    /// Looks for an unexpected tagged message (`FI_PEEK`); with `claim`, reserves it for
    /// [`Endpoint::recv_claimed`] (`FI_CLAIM`). `NoMessage` when none matches.
    #[doc(alias = "FI_PEEK")]
    pub fn peek(&self, tag: u64, ignore: u64, from: Option<PeerId>, claim: bool) -> Result<Peeked> {
        let src = self.core.resolve_src(from)?;
        let mut st = self.core.state.lock();
        let p = st.engine.peek(tag, ignore, src, claim)?;
        if let Some(t) = p.claim {
            st.pending.insert(t);
        }
        Ok(p)
    }

    /// Receives a message claimed by [`Endpoint::peek`].
    #[doc(alias = "FI_CLAIM")]
    pub fn recv_claimed(
        &self,
        claim: u64,
        buf: impl Into<RecvBuf>,
        context: u64,
    ) -> Result<(), PostError> {
        self.core.post_claimed(claim, buf.into(), context)
    }

    /// Discards an unexpected tagged message (`FI_DISCARD`). `NoMessage` when none matches.
    #[doc(alias = "FI_DISCARD")]
    pub fn discard(&self, tag: u64, ignore: u64, from: Option<PeerId>) -> Result<Peeked> {
        let src = self.core.resolve_src(from)?;
        self.core.state.lock().engine.discard(tag, ignore, src)
    }

    /// Sends and awaits the completion. Cancel-safe: dropping the future leaves the operation
    /// running; its buffer stays owned by the endpoint until the device is done with it.
    pub fn send_async(
        &self,
        peer: PeerId,
        buf: impl Into<SendBuf>,
        options: SendOptions,
    ) -> OpFuture {
        OpFuture::post(&self.core, false, |sink| {
            self.core.post_send(peer, buf.into(), None, options, sink)
        })
    }

    /// Posts a receive and awaits the completion. Cancel-safe: dropping the future before it
    /// resolved (`tokio::time::timeout`, `select!`) cancels the receive, and the buffer is
    /// released once the endpoint no longer needs it; if a message had already matched it, that
    /// message is not lost but goes back into matching for the next receive (it lands behind
    /// messages from the same sender that are already waiting unexpected).
    pub fn recv_async(&self, buf: impl Into<RecvBuf>, options: RecvOptions) -> OpFuture {
        OpFuture::post(&self.core, true, |sink| {
            self.core.post_recv(buf.into(), options, sink)
        })
    }

    /// Drives the endpoint once (polling a bound completion queue does this too).
    #[doc(alias = "FI_PROGRESS_MANUAL")]
    pub fn progress(&self) {
        self.core.progress_once();
    }

    /// Counters.
    pub fn stats(&self) -> EndpointStats {
        let st = self.core.state.lock();
        let mut s = st.engine.stats();
        if let Some(l) = &st.local {
            l.add_stats(&mut s);
        }
        s
    }

    /// What the protocol engine holds now (for leak checks).
    pub fn resources(&self) -> crate::proto::engine::Resources {
        self.core.state.lock().engine.resources()
    }
}
