//! Async operations: `OpFuture` and `OpOutcome`.

use super::*;

/// The future of an async operation: resolves to its completion or error completion.
pub struct OpFuture {
    pub(super) core: Arc<RdmCore>,
    pub(super) slot: Arc<Slot>,
    pub(super) early: Option<PostError>,
    /// A receive (`recv_async`): dropping it unfinished cancels it.
    pub(super) recv: bool,
    /// It resolved.
    pub(super) finished: bool,
}

impl OpFuture {
    /// Posts an operation whose completion goes to a fresh slot (`post` gets the slot's sink)
    /// and returns the future that awaits it; a refused post makes it resolve to that error.
    /// `recv`: a receive, which dropping the future unfinished cancels.
    pub(in crate::ep) fn post(
        core: &Arc<RdmCore>,
        recv: bool,
        post: impl FnOnce(Sink) -> Result<(), PostError>,
    ) -> OpFuture {
        let slot = Arc::new(Slot::default());
        let early = post(Sink::Future(slot.clone())).err();
        OpFuture {
            core: core.clone(),
            slot,
            early,
            recv,
            finished: false,
        }
    }
}

impl Drop for OpFuture {
    /// A receive dropped before it resolved: cancel it if no message matched it yet; else its
    /// message goes back into matching for the next receive (now if it is complete, when it
    /// completes otherwise). Sends, RMA and atomics keep running (their buffers stay with the
    /// endpoint until the device is done).
    fn drop(&mut self) {
        if !self.recv || self.finished || self.early.is_some() {
            return;
        }
        let now = Instant::now();
        let mut st = self.core.state.lock();
        let key = st
            .ops
            .iter()
            .find(|(_, o)| matches!(&o.sink, Sink::Future(s) if Arc::ptr_eq(s, &self.slot)))
            .map(|(k, _)| k);
        match key {
            Some(k) => {
                if !st.engine.cancel_recv(k as u64) {
                    // Matched and in progress: its completion is re-matched when it comes.
                    self.slot.orphaned.store(true, Ordering::Release);
                }
            }
            None => {
                // Completed, not yet taken: put the message back now.
                let done = self.slot.done.lock().0.take();
                let src = self.slot.src.lock().take();
                if let (Some(Ok(c)), Some(src)) = (done, src) {
                    if let Buffer::Recv(buf) = c.buf {
                        self.core.orphans.push(RecvDone {
                            context: 0,
                            len: c.len,
                            olen: 0,
                            tag: c.flags.contains(CompletionFlags::TAGGED).then_some(c.tag),
                            data: c.data,
                            src: Some(src),
                            multi_recv_done: false,
                            error: None,
                            buf,
                            in_region: None,
                        });
                    }
                }
            }
        }
        self.core.pump(&mut st, now);
    }
}

impl fmt::Debug for OpFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpFuture").finish()
    }
}

/// How an async operation ended.
#[derive(Debug)]
pub enum OpOutcome {
    /// It completed.
    Done(Completion),
    /// It completed with an error.
    Failed(CompletionError),
    /// It was refused when posted.
    Refused(PostError),
}

impl OpOutcome {
    /// The completion, or the error as [`Error`].
    pub fn into_result(self) -> Result<Completion> {
        match self {
            OpOutcome::Done(c) => Ok(c),
            OpOutcome::Failed(e) => Err(e.error),
            OpOutcome::Refused(e) => Err(e.error),
        }
    }
}

impl Future for OpFuture {
    type Output = OpOutcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<OpOutcome> {
        if let Some(e) = self.early.take() {
            self.finished = true;
            return Poll::Ready(OpOutcome::Refused(e));
        }
        loop {
            let done = self.slot.done.lock().0.take();
            if let Some(r) = done {
                self.finished = true;
                return Poll::Ready(match r {
                    Ok(c) => OpOutcome::Done(c),
                    Err(e) => OpOutcome::Failed(e),
                });
            }
            let seen = self.core.notifier.generation();
            self.core.progress_once();
            {
                let mut d = self.slot.done.lock();
                if d.0.is_some() {
                    continue;
                }
                d.1 = Some(cx.waker().clone());
            }
            if !self.core.notifier.register(seen, cx.waker()) {
                return Poll::Pending;
            }
        }
    }
}
