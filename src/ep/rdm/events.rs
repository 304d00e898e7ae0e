//! Engine events to completions: each event goes to its operation's sink (a completion queue,
//! a future, or the completion a poller is waiting for).

use super::*;

impl RdmCore {
    /// Routes one engine event; returns true when it went into a completion queue (not to the
    /// thread polling: see [`push_ok`]), so that its waiters must be woken.
    pub(super) fn deliver(
        &self,
        ops: &mut Slab<OpState>,
        cache: &mut SrcCache,
        ev: Event,
        direct: &mut Option<&mut Direct<'_>>,
    ) -> bool {
        // The usual cases first: a send, or a receive that is not a multi-receive buffer's,
        // completing into its queue.
        let key = match &ev {
            Event::Send(s) => s.context as usize,
            Event::Recv(r) if !r.multi_recv_done => r.context as usize,
            _ => return self.deliver_other(ops, cache, ev),
        };
        if !ops
            .get(key)
            .is_some_and(|o| matches!(o.sink, Sink::Cq(_)) && !o.multi)
        {
            return self.deliver_other(ops, cache, ev);
        }
        self.count(&ev, None);
        let Some(OpState {
            sink: Sink::Cq(ctx),
            target,
            keep,
            ..
        }) = ops.try_remove(key)
        else {
            return false;
        };
        match ev {
            Event::Send(s) => match self.send_completion(s, ctx, keep) {
                Ok(c) => push_ok(&self.parts.tx_cq, c, direct),
                Err(e) => {
                    self.parts.tx_cq.push_err(e);
                    true
                }
            },
            Event::Recv(r) => match self.recv_completion(r, ctx, target, cache) {
                Ok(c) => push_ok(&self.parts.rx_cq, c, direct),
                Err(e) => {
                    self.parts.rx_cq.push_err(e);
                    true
                }
            },
            _ => false,
        }
    }

    /// [`Self::deliver`] for the rest: multi-receive pieces, futures, RMA, remote writes.
    #[inline(never)]
    pub(super) fn deliver_other(
        &self,
        ops: &mut Slab<OpState>,
        cache: &mut SrcCache,
        ev: Event,
    ) -> bool {
        let (key, is_send) = match &ev {
            Event::Send(s) => (s.context as usize, true),
            Event::Recv(r) => (r.context as usize, false),
            Event::Rma(r) => (r.context as usize, true),
            Event::RemoteWrite(w) => {
                let c = self.remote_write_completion(*w);
                self.parts.rx_cq.push(c);
                return true;
            }
        };
        // A multi-receive buffer completes once per message (each with its own part of the
        // buffer) and is only retired by its final `multi_recv_done` completion.
        if let Event::Recv(r) = &ev {
            if !r.multi_recv_done && ops.get(key).is_some_and(|o| o.multi) {
                let Some(Sink::Cq(ctx)) = ops.get(key).map(|o| &o.sink) else {
                    return false;
                };
                let ctx = *ctx;
                self.count(&ev, None);
                let Event::Recv(r) = ev else { return false };
                match self.recv_completion(r, ctx, None, cache) {
                    Ok(c) => self.parts.rx_cq.push(c),
                    Err(e) => self.parts.rx_cq.push_err(e),
                }
                return true;
            }
        }
        let Some(op) = ops.try_remove(key) else {
            tracing::warn!(key, "engine completion for an unknown operation");
            return false;
        };
        // The usual cases, straight into the queue.
        if let (&Sink::Cq(ctx), true) = (&op.sink, matches!(ev, Event::Send(_) | Event::Recv(_))) {
            self.count(&ev, None);
            match ev {
                Event::Send(s) => match self.send_completion(s, ctx, op.keep) {
                    Ok(c) => self.parts.tx_cq.push(c),
                    Err(e) => self.parts.tx_cq.push_err(e),
                },
                Event::Recv(r) => match self.recv_completion(r, ctx, op.target, cache) {
                    Ok(c) => self.parts.rx_cq.push(c),
                    Err(e) => self.parts.rx_cq.push_err(e),
                },
                _ => return false,
            }
            return true;
        }
        let user_ctx = match &op.sink {
            Sink::Cq(c) => *c,
            Sink::Future(_) | Sink::Inject => 0,
        };
        if let (Sink::Future(slot), Event::Recv(r)) = (&op.sink, &ev) {
            if r.error.is_none() && slot.orphaned.load(Ordering::Acquire) {
                // Its future is gone: the message is the next receive's.
                if let Event::Recv(r) = ev {
                    self.orphans.push(r);
                }
                return false;
            }
            *slot.src.lock() = r.src;
        }
        self.count(&ev, op.rma);
        let (sink, result) = match ev {
            Event::Send(s) => (op.sink, self.send_completion(s, user_ctx, op.keep)),
            Event::Recv(r) => (op.sink, self.recv_completion(r, user_ctx, op.target, cache)),
            Event::Rma(r) => {
                let OpState {
                    sink,
                    target,
                    keep,
                    multi,
                    rma,
                } = op;
                let rest = OpState {
                    sink: Sink::Cq(0),
                    target,
                    keep,
                    multi,
                    rma,
                };
                (sink, self.rma_completion(r, user_ctx, rest))
            }
            Event::RemoteWrite(_) => return false,
        };
        match sink {
            Sink::Cq(_) => {
                let cq = if is_send {
                    &self.parts.tx_cq
                } else {
                    &self.parts.rx_cq
                };
                match result {
                    Ok(c) => cq.push(c),
                    Err(e) => cq.push_err(e),
                }
                true
            }
            Sink::Inject => match result {
                Ok(_) => false,
                Err(e) => {
                    self.parts.tx_cq.push_err(e);
                    true
                }
            },
            Sink::Future(slot) => {
                let waker = {
                    let mut d = slot.done.lock();
                    d.0 = Some(result);
                    d.1.take()
                };
                if let Some(w) = waker {
                    w.wake();
                }
                false
            }
        }
    }

    /// Counts an operation's end on the bound counters: its kind from the event (an RMA's
    /// from its flags: reads and fetching atomics are reads). The release of a multi-receive
    /// buffer is no message: counted only when it is an error. Peers' accesses are counted
    /// by the engine (`Engine::take_target_counts`), not here.
    fn count(&self, ev: &Event, rma: Option<CompletionFlags>) {
        let (kind, ok) = match ev {
            Event::Send(s) => (CntrKind::Send, s.error.is_none()),
            Event::Recv(r) if r.multi_recv_done && r.error.is_none() => return,
            Event::Recv(r) => (CntrKind::Recv, r.error.is_none()),
            Event::Rma(r) => {
                let read = rma.is_some_and(|f| f.contains(CompletionFlags::READ));
                let kind = if read {
                    CntrKind::Read
                } else {
                    CntrKind::Write
                };
                (kind, r.error.is_none())
            }
            Event::RemoteWrite(_) => return,
        };
        self.parts.counters.hit(kind, ok);
    }

    /// Counts peers' accesses the engine served since the last call, and wakes the waiters of
    /// the counters when anything was counted in this pass (`events`).
    pub(super) fn count_pass(&self, t: TargetCounts, events: bool) {
        if self.parts.counters.is_empty() {
            return;
        }
        if !t.is_empty() {
            self.parts
                .counters
                .hit_n(CntrKind::RemoteWrite, t.writes, t.write_errors);
            self.parts
                .counters
                .hit_n(CntrKind::RemoteRead, t.reads, t.read_errors);
        }
        if events {
            self.parts.counters.signal();
        }
    }

    pub(super) fn send_completion(
        &self,
        s: SendDone,
        context: u64,
        keep: Option<Buffer>,
    ) -> std::result::Result<Completion, CompletionError> {
        let flags = CompletionFlags::SEND | msg_kind(s.tag.is_some());
        let buf = keep.unwrap_or(Buffer::Send(s.buf));
        let tag = s.tag.unwrap_or(0);
        local_completion(context, flags, tag, s.len, s.error, s.status, buf)
    }

    pub(super) fn recv_completion(
        &self,
        r: RecvDone,
        context: u64,
        target: Option<RecvTarget>,
        cache: &mut SrcCache,
    ) -> std::result::Result<Completion, CompletionError> {
        let mut flags = CompletionFlags::RECV | msg_kind(r.tag.is_some());
        if r.data.is_some() {
            flags |= CompletionFlags::REMOTE_CQ_DATA;
        }
        if r.multi_recv_done {
            flags |= CompletionFlags::MULTI_RECV;
        }
        let source = r.src.and_then(|a| {
            let generation = self.parts.av.generation();
            match cache.0 {
                Some((addr, peer, g)) if addr == a && g == generation => peer,
                _ => {
                    let peer = self
                        .parts
                        .av
                        .find(&a)
                        .or_else(|| self.parts.av.reverse_lookup(a.gid, a.qpn));
                    cache.0 = Some((a, peer, generation));
                    peer
                }
            }
        });
        let filled = r.error.is_none()
            || r.error
                .as_ref()
                .is_some_and(|e| e.kind() == ErrorKind::Truncated);
        // A device-only region takes no bytes the CPU would have to copy in: such a message
        // completes the receive with the refusal instead.
        let refused = target
            .as_ref()
            .filter(|_| filled)
            .and_then(|t| t.cpu_copy_refused(r.buf.len(), r.in_region, "recv"));
        // Nothing was placed: the whole message is what did not fit.
        let (filled, error, len, olen) = match refused {
            Some(e) => (false, Some(e), 0, r.len),
            None => (filled, r.error, r.len, r.olen),
        };
        let buf = match target {
            Some(t) => t.finish_split(r.buf, filled, r.in_region),
            None => Buffer::Recv(r.buf),
        };
        match error {
            None => Ok(Completion {
                context,
                flags,
                len,
                data: r.data,
                tag: r.tag.unwrap_or(0),
                source,
                source_addr: r.src.filter(|_| source.is_none()),
                buf,
            }),
            Some(error) => Err(CompletionError {
                context,
                flags,
                error,
                len,
                olen,
                status: None,
                data: r.data,
                tag: r.tag.unwrap_or(0),
                buf,
            }),
        }
    }
}

/// `FI_TAGGED` for a tagged message, `FI_MSG` for another.
#[inline]
fn msg_kind(tagged: bool) -> CompletionFlags {
    if tagged {
        CompletionFlags::TAGGED
    } else {
        CompletionFlags::MSG
    }
}

/// The completion of an operation this endpoint started (a send, an RMA or atomic operation):
/// `len` bytes done, or else `error` with the device's `status`. It carries no remote CQ data
/// and no source.
pub(crate) fn local_completion(
    context: u64,
    flags: CompletionFlags,
    tag: u64,
    len: usize,
    error: Option<Error>,
    status: Option<Status>,
    buf: Buffer,
) -> std::result::Result<Completion, CompletionError> {
    match error {
        None => Ok(Completion {
            context,
            flags,
            len,
            data: None,
            tag,
            source: None,
            source_addr: None,
            buf,
        }),
        Some(error) => Err(CompletionError {
            context,
            flags,
            error,
            len: 0,
            olen: 0,
            status,
            data: None,
            tag,
            buf,
        }),
    }
}
