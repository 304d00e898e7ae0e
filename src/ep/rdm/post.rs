//! Posting: sends (prepared, queued, batched, injected) and receives (plain, multi, claimed)
//! into the engine, and cancel.

use super::*;

impl RdmCore {
    pub(super) fn resolve_src(&self, from: Option<PeerId>) -> Result<Option<RawAddr>> {
        from.map(|p| self.parts.av.lookup(p)).transpose()
    }

    /// Posts a send of `buf` (the gathered bytes of `iov` when it is given: the completion
    /// hands `iov` back instead).
    pub(super) fn post_send(
        &self,
        peer: PeerId,
        buf: SendBuf,
        iov: Option<Vec<Buffer>>,
        o: SendOptions,
        sink: Sink,
    ) -> Result<(), PostError> {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        let prepared = match self.prepare_send(&mut st.dest_cache, peer, buf) {
            Ok(p) => PreparedSend { iov, ..p },
            Err(e) => return Err(refuse(e.error, iov.map_or(e.buf, Buffer::Iov))),
        };
        self.enqueue_send(&mut st, &mut clock, prepared, o, sink)?;
        // A send on the local path is in the peer's ring (or queued for it) already; only the
        // engine's sends need a pass to reach the device.
        if st.engine.transmit_pending() || st.engine.has_events() {
            self.pump_with(&mut st, &mut clock);
        }
        Ok(())
    }

    /// An inject: straight into a local peer's ring when it has room, else a copy of the bytes
    /// sent like any message, whose completion only reports a failure.
    pub(super) fn post_inject(&self, peer: PeerId, data: &[u8], o: SendOptions) -> Result<()> {
        if o.delivery_complete {
            return Err(Error::new(ErrorKind::InvalidArgument, "inject")
                .with_detail("an inject has no completion to deliver: use send_with"));
        }
        crate::ep::buf::check_inject(data.len(), self.inject_size)?;
        if data.len() > self.options.max_msg_size() {
            return Err(
                Error::new(ErrorKind::MsgSize, "inject").with_detail(format!(
                    "{} bytes is more than the endpoint's max_msg_size {}",
                    data.len(),
                    self.options.max_msg_size()
                )),
            );
        }
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        if st.closed {
            return Err(Error::new(ErrorKind::Closed, "inject"));
        }
        let dest = self.dest(&mut st.dest_cache, peer)?;
        let st = &mut *st;
        if let Some(l) = st.local.as_mut() {
            if let Some(p) = l.route(&mut st.engine, &dest) {
                if l.inject(p, o.tag, o.data, data) {
                    // In the peer's ring: done, and no event follows to count it by.
                    if self.parts.counters.hit(CntrKind::Send, true) {
                        self.parts.counters.signal();
                    }
                    return Ok(());
                }
            }
        }
        let prepared = PreparedSend {
            dest,
            data: Bytes::copy_from_slice(data),
            region: None,
            iov: None,
            read_key: None,
            region_len: None,
            copy_region: false,
        };
        self.enqueue_send(st, &mut clock, prepared, o, Sink::Inject)
            .map_err(|e| e.error)?;
        if st.engine.transmit_pending() || st.engine.has_events() {
            self.pump_with(st, &mut clock);
        }
        Ok(())
    }

    /// A peer's address, through the one-entry cache of the last destination.
    pub(super) fn dest(&self, cache: &mut DestCache, peer: PeerId) -> Result<RawAddr> {
        let generation = self.parts.av.generation();
        match cache.0 {
            Some((p, g, a)) if p == peer && g == generation => Ok(a),
            _ => {
                let a = self.parts.av.lookup(peer)?;
                cache.0 = Some((peer, generation, a));
                Ok(a)
            }
        }
    }

    /// The checks of a send: destination and bytes.
    pub(super) fn prepare_send(
        &self,
        cache: &mut DestCache,
        peer: PeerId,
        buf: SendBuf,
    ) -> Result<PreparedSend, PostError> {
        let dest = match self.dest(cache, peer) {
            Ok(a) => a,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        // A region peers may read lets the engine use the read-based message protocols; at
        // the read-message threshold its bytes are not copied (the engine reads what it sends).
        // A device-only region goes by the long-read protocol alone, at any size: its bytes
        // cannot go in packets.
        let (data, read_key, region_len) = match &buf {
            SendBuf::Region(r) if r.is_device_only() => {
                let read_key = r.device_read_key();
                let data = r
                    .check_local(&self.domain, crate::mem::Access::SEND, "send")
                    .and_then(|()| {
                        if read_key.is_some() && self.region_send_min != usize::MAX {
                            return Ok(Bytes::new());
                        }
                        Err(crate::mem::device_only_error("send").with_detail(
                            "a device-only region is sent only by the long-read protocol (the \
                             receiver's NIC reads it): it needs REMOTE_READ access, and device \
                             RDMA read on this endpoint (FI_EFA_USE_DEVICE_RDMA)",
                        ))
                    });
                (data, read_key, Some(r.len()))
            }
            SendBuf::Region(r) => {
                let read_key = r.device_read_key();
                if read_key.is_some() && r.len() >= self.region_send_min {
                    let data = r
                        .check_local(&self.domain, crate::mem::Access::SEND, "send")
                        .map(|()| Bytes::new());
                    (data, read_key, Some(r.len()))
                } else {
                    let data = r
                        .check_local(&self.domain, crate::mem::Access::SEND, "send")
                        .map(|()| Bytes::new());
                    (data, read_key, None)
                }
            }
            SendBuf::Bytes(_) => (Ok(Bytes::new()), None, None),
        };
        let copy_region = matches!(buf, SendBuf::Region(_)) && region_len.is_none();
        let data = match data {
            Ok(d) => d,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        let (data, region) = match buf {
            SendBuf::Region(r) => (data, Some(r)),
            SendBuf::Bytes(b) => (b, None),
        };
        Ok(PreparedSend {
            dest,
            data,
            region,
            iov: None,
            read_key,
            region_len,
            copy_region,
        })
    }

    /// Hands a prepared send to the engine (the caller pumps).
    pub(super) fn enqueue_send(
        &self,
        st: &mut State,
        clock: &mut Clock,
        p: PreparedSend,
        o: SendOptions,
        sink: Sink,
    ) -> Result<(), PostError> {
        let PreparedSend {
            dest,
            mut data,
            region,
            iov,
            read_key,
            region_len,
            copy_region,
        } = p;
        // What the completion (or a refusal) hands back instead of `data`.
        let keep = iov.map(Buffer::Iov).or(region.map(Buffer::Region));
        if st.closed {
            let b = keep.unwrap_or(Buffer::Send(data));
            return Err(refuse(Error::new(ErrorKind::Closed, "send"), b));
        }
        // A peer on this host goes through the local path (which reads a region's bytes from
        // the region itself); anyone else through the engine.
        let local = match st.local.as_mut() {
            Some(l) => l
                .route(&mut st.engine, &dest)
                .map(|peer| (peer, l.has_room())),
            None => None,
        };
        let device_only = matches!(&keep, Some(Buffer::Region(r)) if r.is_device_only());
        if local.is_some() && device_only {
            let b = keep.unwrap_or(Buffer::Send(data));
            let e = crate::mem::device_only_error("send").with_detail(
                "the destination is on this host, and the same-host path copies messages with \
                 the CPU: send device-only regions from an endpoint built with local_path(false) \
                 (the NIC then reads them)",
            );
            return Err(refuse(e, b));
        }
        if let Some((_, false)) = local {
            let b = keep.unwrap_or(Buffer::Send(data));
            let e =
                Error::new(ErrorKind::Again, "send").with_detail("tx_size local sends in flight");
            return Err(refuse(e, b));
        }
        let region = match &keep {
            Some(Buffer::Region(r)) => Some(r),
            _ => None,
        };
        if local.is_none() && copy_region {
            if let Some(r) = region {
                data = Bytes::copy_from_slice(&r.read());
            }
        }
        let len = match region {
            Some(r) if copy_region || region_len.is_some() => r.len(),
            _ => data.len(),
        };
        let max = self.options.max_msg_size();
        if len > max {
            let b = keep.unwrap_or(Buffer::Send(data));
            let e = Error::new(ErrorKind::MsgSize, "send").with_detail(format!(
                "{len} bytes is more than the endpoint's max_msg_size {max}"
            ));
            return Err(refuse(e, b));
        }
        // The local path reads a region's bytes from its slice.
        let slice = local.and(region).map(crate::mr::MemoryRegion::as_slice);
        let key = st.ops.insert(OpState {
            sink,
            target: None,
            keep,
            multi: false,
            rma: None,
        });
        if let (Some((peer, _)), Some(l)) = (local, st.local.as_mut()) {
            l.send(
                peer,
                LocalSend {
                    context: key as u64,
                    tag: o.tag,
                    data: o.data,
                    delivery_complete: o.delivery_complete,
                    buf: data,
                    region: slice,
                    len,
                },
            );
            return Ok(());
        }
        let op = SendOp {
            dest,
            buf: data,
            tag: o.tag,
            data: o.data,
            delivery_complete: o.delivery_complete,
            context: key as u64,
            read_key,
            region_len,
        };
        match st.engine.send(clock.now(), op) {
            Ok(()) => Ok(()),
            Err((e, op)) => {
                let s = st.ops.remove(key);
                Err(refuse(e, s.keep.unwrap_or(Buffer::Send(op.buf))))
            }
        }
    }

    /// Posts the requests at the front of `reqs` (sends, writes or reads) under one lock and
    /// one progress pass; `Again` leaves the refused request and the rest in `reqs`, any other
    /// refusal stops the batch with that request's buffer.
    pub(in crate::ep) fn post_batch<R: BatchRequest>(
        &self,
        reqs: &mut VecDeque<R>,
    ) -> Result<usize, BatchError> {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        let mut posted = 0;
        let mut failure = None;
        while let Some(r) = reqs.pop_front() {
            let meta = r.meta();
            match r.post(self, &mut st, &mut clock) {
                Ok(()) => posted += 1,
                Err(e) if e.kind() == ErrorKind::Again => {
                    // Full: leave it (and the rest) for the caller to post later.
                    reqs.push_front(R::rebuild(meta, e.buf));
                    break;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if posted > 0 {
            self.pump_with(&mut st, &mut clock);
        }
        match failure {
            None => Ok(posted),
            Some(error) => Err(BatchError { posted, error }),
        }
    }

    pub(super) fn post_recv(
        &self,
        buf: RecvBuf,
        o: RecvOptions,
        sink: Sink,
    ) -> Result<(), PostError> {
        let src = match self.resolve_src(o.from) {
            Ok(s) => s,
            Err(e) => return Err(refuse(e, buf.into_buffer())),
        };
        if o.multi_recv.is_some()
            && let Some(why) = multi_recv_refusal(&buf, &o, &sink)
        {
            return Err(refuse(
                Error::new(ErrorKind::InvalidArgument, "recv").with_detail(why),
                buf.into_buffer(),
            ));
        }
        let (down, target) = RecvTarget::prepare(buf, &self.domain, 0, true, "recv")?;
        self.post_recv_target(down, target, o, sink, src)
    }

    /// Posts a scatter receive (`recv_iov`).
    pub(super) fn post_recv_iov(
        &self,
        iov: Vec<RecvBuf>,
        o: RecvOptions,
        context: u64,
    ) -> Result<(), PostError> {
        let limit = crate::info::RDM_IOV_LIMIT;
        let target =
            RecvTarget::prepare_iov(iov, &self.domain, crate::mem::Access::RECV, limit, "recvv")?;
        let src = if o.multi_recv.is_some() {
            Err(Error::new(ErrorKind::InvalidArgument, "recvv").with_detail(
                "a multi-receive buffer must be one BytesMut (FI_MULTI_RECV), not an iov",
            ))
        } else {
            self.resolve_src(o.from)
        };
        match src {
            Ok(src) => self.post_recv_target(BytesMut::new(), target, o, Sink::Cq(context), src),
            Err(e) => Err(refuse(e, target.abandon())),
        }
    }

    /// Posts a receive of `down` into `target`.
    fn post_recv_target(
        &self,
        down: BytesMut,
        target: RecvTarget,
        o: RecvOptions,
        sink: Sink,
        src: Option<RawAddr>,
    ) -> Result<(), PostError> {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        if st.closed {
            return Err(refuse(
                Error::new(ErrorKind::Closed, "recv"),
                target.finish(down, false),
            ));
        }
        let room = target.room();
        let key = st.ops.insert(OpState {
            sink,
            target: Some(target),
            keep: None,
            multi: o.multi_recv.is_some(),
            rma: None,
        });
        let op = RecvOp {
            buf: down,
            tag: o.tag,
            src,
            multi_recv: o.multi_recv,
            context: key as u64,
            local_region: self.recv_region(&st, key),
            room,
        };
        // The engine needs the time only to match an unexpected message; otherwise no clock.
        let now = if st.engine.has_unexpected() {
            clock.now()
        } else {
            clock.cached().unwrap_or(st.created)
        };
        match st.engine.post_recv(now, op) {
            Ok(()) => {
                // Only a receive that matched an unexpected message has something to move.
                if st.engine.transmit_pending() || st.engine.has_events() {
                    self.pump_with(&mut st, &mut clock);
                }
                Ok(())
            }
            Err((e, op)) => Err(Self::refused_recv(&mut st, key, e, op)),
        }
    }

    /// The region slice a receive's message may be read into by the device (region RDMA on,
    /// the receive a device-registered region).
    fn recv_region(&self, st: &State, key: usize) -> Option<crate::mem::RegionSlice> {
        if !self.region_rdma {
            return None;
        }
        st.ops.get(key)?.target.as_ref()?.device_slice()
    }

    pub(super) fn post_claimed(
        &self,
        claim: u64,
        buf: RecvBuf,
        context: u64,
    ) -> Result<(), PostError> {
        let (down, target) = RecvTarget::prepare(buf, &self.domain, 0, true, "recv_claimed")?;
        let now = Instant::now();
        let mut st = self.state.lock();
        if !st.pending.remove(&claim) {
            let e =
                Error::new(ErrorKind::InvalidArgument, "recv_claimed").with_detail("unknown claim");
            return Err(refuse(e, target.finish(down, false)));
        }
        let room = target.room();
        let key = st.ops.insert(OpState {
            sink: Sink::Cq(context),
            target: Some(target),
            keep: None,
            multi: false,
            rma: None,
        });
        let op = RecvOp {
            buf: down,
            tag: None,
            src: None,
            multi_recv: None,
            context: key as u64,
            local_region: self.recv_region(&st, key),
            room,
        };
        match st.engine.recv_claimed(now, claim, op) {
            Ok(()) => {
                self.pump(&mut st, now);
                Ok(())
            }
            Err((e, op)) => Err(Self::refused_recv(&mut st, key, e, op)),
        }
    }

    /// Puts the messages of dropped `recv_async` futures back into matching, as whole local
    /// messages from their sender: a posted receive takes each, or it waits unexpected.
    pub(super) fn rematch_orphans(&self, st: &mut State, clock: &mut Clock) {
        let orphans = self.orphans.take();
        for r in orphans {
            let Some(src) = r.src else { continue };
            let n = r.len.min(r.buf.len());
            let m = LocalMsg {
                tag: r.tag,
                data: r.data,
                dc_token: None,
                msg_len: n,
            };
            let mut at = 0;
            let mut copy = |out: &mut BytesMut, k: usize| {
                let end = (at + k).min(r.buf.len());
                out.extend_from_slice(r.buf.get(at..end).unwrap_or_default());
                at = end;
            };
            let _ = st
                .engine
                .same_host()
                .first(&mut || clock.now(), src, &m, n, &mut copy);
        }
    }

    pub(super) fn cancel(&self, context: u64) -> Result<()> {
        let now = Instant::now();
        let mut st = self.state.lock();
        let key = st
            .ops
            .iter()
            .find(|(_, o)| matches!(o.sink, Sink::Cq(c) if c == context) && o.target.is_some())
            .map(|(k, _)| k);
        let found = key.is_some_and(|k| st.engine.cancel_recv(k as u64));
        if !found {
            return Err(Error::new(ErrorKind::NoMessage, "cancel")
                .with_detail(format!("no pending receive {context}")));
        }
        self.pump(&mut st, now);
        Ok(())
    }

    /// A receive the engine refused: its operation entry goes, and the buffer goes back whole
    /// (the engine hands back what went down).
    fn refused_recv(st: &mut State, key: usize, e: Error, op: RecvOp) -> PostError {
        let s = st.ops.remove(key);
        let b = match s.target {
            Some(t) => t.finish(op.buf, false),
            None => Buffer::Recv(op.buf),
        };
        refuse(e, b)
    }
}

/// Why a multi-receive buffer `buf` posted with `o` into `sink` is refused (`None`: it is
/// taken): it takes untagged messages only, into a `BytesMut`, and completes many times (no
/// future). Kept out of line: the common receive path does not need it.
#[inline(never)]
fn multi_recv_refusal(buf: &RecvBuf, o: &RecvOptions, sink: &Sink) -> Option<&'static str> {
    if o.tag.is_some() {
        Some("multi-receive buffers take untagged messages only (FI_MULTI_RECV)")
    } else if matches!(buf, RecvBuf::Region(_)) {
        Some("a multi-receive buffer must be a BytesMut, not a memory region")
    } else if matches!(sink, Sink::Future(_)) {
        Some("a multi-receive buffer completes many times: post it with recv_with, not recv_async")
    } else {
        None
    }
}

/// A request of a batch ([`RdmCore::post_batch`]): posted under the endpoint's lock, and
/// rebuilt from the buffer a refusal hands back.
pub(in crate::ep) trait BatchRequest: Sized {
    /// The request without its buffer.
    type Meta: Copy;
    fn meta(&self) -> Self::Meta;
    /// Hands the request to the engine (the batch makes progress once at its end).
    fn post(self, core: &RdmCore, st: &mut State, clock: &mut Clock) -> Result<(), PostError>;
    /// The request again, with the buffer a refusal handed back.
    fn rebuild(meta: Self::Meta, buf: Buffer) -> Self;
}

impl BatchRequest for SendRequest {
    type Meta = (PeerId, SendOptions, u64);
    fn meta(&self) -> Self::Meta {
        (self.peer, self.options, self.context)
    }
    fn post(self, core: &RdmCore, st: &mut State, clock: &mut Clock) -> Result<(), PostError> {
        let prepared = core.prepare_send(&mut st.dest_cache, self.peer, self.buf)?;
        core.enqueue_send(st, clock, prepared, self.options, Sink::Cq(self.context))
    }
    fn rebuild((peer, options, context): Self::Meta, buf: Buffer) -> Self {
        SendRequest {
            peer,
            buf: SendBuf::from_returned(buf),
            options,
            context,
        }
    }
}
