//! The driver loop: one progress pass moves the local path, device completions, receive
//! buffers, timers and transmissions; the background progress source; teardown.

use super::*;

impl RdmCore {
    /// One progress pass; returns the time until the engine's next timer.
    pub(super) fn progress_once(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut st = self.state.lock();
        self.pump(&mut st, now);
        let local = st.local.as_ref().and_then(LocalPath::next_timer);
        let next = match (st.engine.poll_timeout(), local) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        next.map(|t| t.saturating_duration_since(now))
    }

    /// Moves everything that is ready: device completions into the engine, the engine's packets
    /// onto the device, the engine's completions into queues and futures.
    pub(in crate::ep) fn pump(&self, st: &mut State, now: Instant) {
        self.pump_with(st, &mut Clock::at(now))
    }

    /// A progress pass for a caller that polls: no clock read unless something needs it.
    pub(super) fn progress_quick(&self) {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        self.pump_with(&mut st, &mut clock);
    }

    /// [`Self::pump`] with a clock read only when needed.
    pub(in crate::ep) fn pump_with(&self, st: &mut State, clock: &mut Clock) {
        self.pump_into(st, clock, None);
    }

    /// [`Self::pump_with`] for a poll of an empty completion queue: successful completions for
    /// it go straight to the poller (`direct`).
    pub(super) fn pump_into(
        &self,
        st: &mut State,
        clock: &mut Clock,
        mut direct: Option<&mut Direct<'_>>,
    ) {
        loop {
            let mut busy = false;
            if !self.orphans.is_empty() {
                busy = true;
                self.rematch_orphans(st, clock);
            }
            if let Some(l) = st.local.as_mut() {
                busy |= l.progress(&mut st.engine, clock);
            }
            // A pass that took local messages delivers them first and leaves the device to the
            // next pass (at most a few passes in a row).
            let n = if busy && st.device_skips < MAX_DEVICE_SKIPS {
                st.device_skips += 1;
                0
            } else {
                st.device_skips = 0;
                self.poll_device(st, clock)
            };
            busy |= n > 0;
            Self::repost_rx(st);
            if let Some(t) = st.engine.poll_timeout() {
                let now = clock.now();
                if t <= now {
                    st.engine.handle_timeout(now);
                }
            }
            if !st.engine.transmit_pending() && !st.engine.has_events() {
                let idle = st.local.as_ref().is_none_or(|l| !l.has_events());
                if idle && !busy {
                    // (Peers' accesses served by this pass's timers are counted still.)
                    self.count_pass(st.engine.take_target_counts(), false);
                    break;
                }
            }
            if st.engine.transmit_pending() {
                busy |= Self::transmit(st, clock);
            }
            // Completions put into a queue (not handed to the polling thread): its waiters wake.
            let mut delivered = false;
            let mut events = false;
            while st.engine.has_events()
                && self.parts.tx_cq.room() > 0
                && self.parts.rx_cq.room() > 0
            {
                let Some(ev) = st.engine.poll_event() else {
                    break;
                };
                events = true;
                delivered |= self.deliver(&mut st.ops, &mut st.src_cache, ev, &mut direct);
            }
            if let Some(l) = st.local.as_mut() {
                while l.has_events() && self.parts.tx_cq.room() > 0 {
                    let Some(ev) = l.pop_event() else {
                        break;
                    };
                    events = true;
                    delivered |= self.deliver(&mut st.ops, &mut st.src_cache, ev, &mut direct);
                }
            }
            busy |= events;
            self.count_pass(st.engine.take_target_counts(), events);
            if delivered {
                self.parts.tx_cq.signal();
                if !self.parts.rx_cq.same(&self.parts.tx_cq) {
                    self.parts.rx_cq.signal();
                }
            }
            // One pass moves what is ready; another only when a batch limit left more behind
            // (what this pass set off, such as send completions, shows at the next poll).
            let more = n >= st.cq_read_size || st.local.as_ref().is_some_and(LocalPath::more);
            if !busy || !more {
                break;
            }
        }
    }

    /// Hands the engine's output to the device: datagrams as one post list and one-sided
    /// operations as another (one doorbell each; one system call each on the udp device). True
    /// when anything went.
    #[inline(never)]
    pub(super) fn transmit(st: &mut State, clock: &mut Clock) -> bool {
        let mut busy = false;
        let now = clock.now();
        let mut sends = std::mem::take(&mut st.sends);
        let mut rdma = std::mem::take(&mut st.rdma);
        while let Some(t) = st.engine.poll_transmit(now) {
            busy = true;
            let (wr_id, dest) = (t.wr_id, t.dest);
            let kind = match t.kind {
                TransmitKind::Send => {
                    sends.push_back(SendWr {
                        wr_id,
                        dest,
                        hdr: t.hdr,
                        payload: t.payload,
                        imm: None,
                    });
                    continue;
                }
                TransmitKind::RdmaWrite { remote, imm } => RdmaKind::Write {
                    local: t.payload,
                    remote,
                    imm,
                },
                TransmitKind::RdmaRead { remote, buf } => RdmaKind::Read { local: buf, remote },
                TransmitKind::RdmaWriteRegion { remote, imm, local } => {
                    RdmaKind::WriteRegion { local, remote, imm }
                }
                TransmitKind::RdmaReadRegion { remote, local } => {
                    RdmaKind::ReadRegion { local, remote }
                }
            };
            rdma.push_back(RdmaWr { wr_id, dest, kind });
        }
        Self::post_sends(st, now, &mut sends);
        while !rdma.is_empty() {
            if let Err((wr_id, e)) = st.qp.post_rdma_list(&mut rdma) {
                tracing::warn!(error = %e, "device refused a work request");
                st.engine
                    .handle_rdma_completion(now, wr_id, refused_status(&e), None);
            }
        }
        st.sends = sends;
        st.rdma = rdma;
        busy
    }

    /// Takes the device's completions into the engine; returns how many.
    pub(super) fn poll_device(&self, st: &mut State, clock: &mut Clock) -> usize {
        let n = st.qp.poll(&mut st.scratch, st.cq_read_size);
        // (An empty poll, the common case, moves no vector in and out of the state.)
        if n > 0 {
            let mut batch = std::mem::take(&mut st.scratch);
            let now = clock.now();
            for c in batch.drain(..) {
                self.device_completion(st, now, c);
            }
            st.scratch = batch;
        }
        n
    }

    /// Posts `sends` as one list; a send the device refuses fails in the engine.
    pub(super) fn post_sends(st: &mut State, now: Instant, sends: &mut VecDeque<SendWr>) {
        while !sends.is_empty() {
            if let Err((wr_id, e)) = st.qp.post_send_list(sends) {
                tracing::warn!(error = %e, "device refused a work request");
                st.engine
                    .handle_send_completion(now, wr_id, refused_status(&e));
            }
        }
    }

    pub(super) fn device_completion(&self, st: &mut State, now: Instant, c: DeviceCompletion) {
        match c.opcode {
            Opcode::Recv => {
                let Some(mut buf) = c.buf else { return };
                if c.status.is_ok() {
                    match c.src {
                        Some(src) => {
                            st.engine
                                .handle_recv(now, src, &buf[..c.byte_len.min(buf.len())])
                        }
                        None => st.engine.count_dropped("a receive with no source"),
                    }
                } else if c.status == Status::Flushed {
                    return;
                } else {
                    tracing::debug!(status = %c.status, "receive error on the device; packet dropped");
                }
                buf.clear();
                st.rx_posted -= 1;
                st.rx_free.push((c.wr_id, buf));
            }
            Opcode::RdmaRead | Opcode::RdmaWrite => st
                .engine
                .handle_rdma_completion(now, c.wr_id, c.status, c.buf),
            Opcode::RecvRdmaWithImm => {
                if c.status.is_ok() {
                    if let (Some(src), Some(imm)) = (c.src, c.imm) {
                        st.engine.handle_remote_write(now, src, imm, c.byte_len);
                    }
                } else if c.status != Status::Flushed {
                    tracing::debug!(status = %c.status, "write-with-immediate error on the device");
                }
                // The write consumed a posted receive buffer (devices without unsolicited
                // write-recv): it comes back untouched.
                if let Some(mut buf) = c.buf {
                    if c.status == Status::Flushed {
                        return;
                    }
                    buf.clear();
                    st.rx_posted -= 1;
                    st.rx_free.push((c.wr_id, buf));
                }
            }
            Opcode::Send => st.engine.handle_send_completion(now, c.wr_id, c.status),
        }
    }

    /// Reposts free device receive buffers, as many as the engine could buffer if every one of
    /// them brought an unexpected message: beyond that the device refuses packets with
    /// receiver-not-ready, the senders back off, and nothing a peer sent is dropped for lack of
    /// memory (the engine's `EngineLimits` cap what it holds for messages without a receive).
    pub(super) fn repost_rx(st: &mut State) {
        // Peers over their share of the buffering budget are held back at the device (where it
        // can: others go on), before the budget as a whole holds every sender back.
        while let Some((peer, hold)) = st.engine.poll_hold() {
            let src = crate::device::Source {
                gid: peer.gid,
                qpn: peer.qpn,
            };
            // A device that cannot (false) leaves it to the whole budget below.
            st.qp.hold_source(src, hold);
        }
        if st.rx_free.is_empty() || st.engine.remote_writes_full() {
            // (Too many completions of peers' writes with immediate data wait for the
            // application: a device that takes a receive buffer per such write is held back.)
            return;
        }
        let lim = st.engine.limits();
        let (msgs, bytes) = st.engine.buffered();
        let by_msgs = lim.max_buffered_msgs.saturating_sub(msgs);
        let by_bytes = lim.max_buffered_bytes.saturating_sub(bytes) / st.rx_buf_size.max(1);
        let allowed = by_msgs.min(by_bytes).saturating_sub(st.rx_posted);
        // Repost in bulk (FI_EFA_INTERNAL_RX_REFILL_THRESHOLD), unless the device has none.
        if st.rx_posted > 0 && st.rx_free.len().min(allowed) < st.rx_refill_threshold {
            return;
        }
        for _ in 0..allowed.min(st.rx_free.len()) {
            let Some((wr_id, buf)) = st.rx_free.pop() else {
                break;
            };
            match st.qp.post_recv(wr_id, buf) {
                Ok(()) => st.rx_posted += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "could not repost a receive buffer");
                    break;
                }
            }
        }
    }
}

impl RdmCore {
    /// The application's handle goes: unless operations in flight (futures) keep the endpoint,
    /// its thread is to drop the last reference, so the endpoint closes there and then (its
    /// local channel file removed before the application goes on), not later on the local
    /// waiter's thread.
    pub(in crate::ep) fn handle_dropped(core: &Arc<RdmCore>) {
        let gate = core.state.lock().local.as_ref().and_then(LocalPath::gate);
        if let Some(g) = gate {
            g.pause();
            if Arc::strong_count(core) > 1 {
                // Futures still hold the endpoint: the waiter goes on driving it for them.
                g.resume();
            }
        }
    }
}

impl ProgressSource for RdmCore {
    fn progress(&self) {
        self.progress_quick();
    }

    fn progress_into(&self, direct: &mut Direct<'_>) {
        let mut clock = Clock::default();
        let mut st = self.state.lock();
        self.pump_into(&mut st, &mut clock, Some(direct));
    }
}

/// A successful completion into `cq`, or straight to the thread polling it. True when it went
/// into the queue (its waiters must hear of it); a completion the polling thread took wakes
/// nobody, as nobody else could find it.
pub(super) fn push_ok(
    cq: &CompletionQueue,
    c: Completion,
    direct: &mut Option<&mut Direct<'_>>,
) -> bool {
    let c = match direct {
        Some(d) => match d.offer(cq, c) {
            Some(c) => c,
            None => return false,
        },
        None => c,
    };
    cq.push(c);
    true
}

impl Drop for RdmCore {
    fn drop(&mut self) {
        if let Some(mut t) = self.thread.get_mut().take() {
            t.stop();
        }
        let now = Instant::now();
        let st = self.state.get_mut();
        st.closed = true;
        st.engine.close();
        st.qp.close();
        let mut local_events = Vec::new();
        if let Some(l) = st.local.as_mut() {
            l.close();
            local_events.extend(std::iter::from_fn(|| l.pop_event()));
        }
        let mut batch = Vec::new();
        while st.qp.poll(&mut batch, usize::MAX) > 0 {}
        for c in batch {
            if c.opcode != Opcode::Recv {
                st.engine.handle_send_completion(now, c.wr_id, c.status);
            }
        }
        let mut events = local_events;
        while let Some(ev) = st.engine.poll_event() {
            events.push(ev);
        }
        let mut ops = std::mem::take(&mut st.ops);
        let mut cache = SrcCache::default();
        let any = !events.is_empty();
        let served = st.engine.take_target_counts();
        for ev in events {
            self.deliver(&mut ops, &mut cache, ev, &mut None);
        }
        self.count_pass(served, any);
        self.parts.tx_cq.signal();
        self.parts.rx_cq.signal();
        tracing::debug!(addr = %self.addr, "rdm_ep_close");
    }
}

/// The completion status of a work request the device refused to post.
pub(super) fn refused_status(e: &Error) -> Status {
    if e.kind() == ErrorKind::Closed {
        Status::Flushed
    } else {
        Status::LocalQpInternalError
    }
}
