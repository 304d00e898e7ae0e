//! What every software queue pair keeps the same way: how many work requests each queue has
//! outstanding against its depth (a full queue says `Again`, a polled completion frees its
//! slot), and the flush of the posted receive buffers at close.

use std::collections::VecDeque;

use bytes::BytesMut;

use super::{DeviceCompletion, Opcode, Status};
use crate::error::{Error, ErrorKind, Result};

/// Outstanding work requests of a queue pair's send queue (sends and one-sided RDMA) and
/// receive queue, against their depths. A work request holds its slot from its post until its
/// completion is polled.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WrSlots {
    send_depth: usize,
    recv_depth: usize,
    sends: usize,
    recvs: usize,
}

impl WrSlots {
    pub(crate) fn new(send_depth: usize, recv_depth: usize) -> WrSlots {
        WrSlots {
            send_depth,
            recv_depth,
            sends: 0,
            recvs: 0,
        }
    }

    /// `Again` (naming `op`) when the send queue is full.
    pub(crate) fn send_room(&self, op: &'static str) -> Result<()> {
        if self.sends >= self.send_depth {
            return Err(Error::new(ErrorKind::Again, op).with_detail(format!(
                "send queue full ({} work requests)",
                self.send_depth
            )));
        }
        Ok(())
    }

    /// Takes a send-queue slot; `Again` (naming `op`) when the queue is full.
    pub(crate) fn take_send(&mut self, op: &'static str) -> Result<()> {
        self.send_room(op)?;
        self.sends += 1;
        Ok(())
    }

    /// Gives back a send-queue slot taken for a work request that was not posted after all.
    pub(crate) fn release_send(&mut self) {
        self.sends = self.sends.saturating_sub(1);
    }

    /// Takes a receive-queue slot; `Again` when the queue is full.
    pub(crate) fn take_recv(&mut self) -> Result<()> {
        if self.recvs >= self.recv_depth {
            return Err(
                Error::new(ErrorKind::Again, "post_recv").with_detail(format!(
                    "receive queue full ({} work requests)",
                    self.recv_depth
                )),
            );
        }
        self.recvs += 1;
        Ok(())
    }

    /// Frees the slot of a completion the application polled. A write with immediate data
    /// that arrived without consuming a receive buffer (unsolicited write-recv) held none.
    pub(crate) fn polled(&mut self, c: &DeviceCompletion) {
        match c.opcode {
            Opcode::Send | Opcode::RdmaWrite | Opcode::RdmaRead => {
                self.sends = self.sends.saturating_sub(1);
            }
            Opcode::RecvRdmaWithImm if c.buf.is_none() => {}
            Opcode::Recv | Opcode::RecvRdmaWithImm => {
                self.recvs = self.recvs.saturating_sub(1);
            }
        }
    }

    /// Send-queue work requests outstanding.
    pub(crate) fn sends(&self) -> usize {
        self.sends
    }

    /// Receive-queue work requests outstanding.
    pub(crate) fn recvs(&self) -> usize {
        self.recvs
    }
}

/// Hands every posted receive buffer back, in order, as a `Flushed` completion.
pub(crate) fn flush_recvs(
    recvs: &mut VecDeque<(u64, BytesMut)>,
    mut complete: impl FnMut(DeviceCompletion),
) {
    for (wr_id, buf) in recvs.drain(..) {
        let mut c = DeviceCompletion::new(wr_id, Status::Flushed, Opcode::Recv, 0);
        c.buf = Some(buf);
        complete(c);
    }
}

/// Copies a received datagram into a posted receive buffer: `Success`, or `LocalBadLength`
/// when it is longer than the buffer's capacity (the buffer then holds what fits). Never
/// reallocates.
#[inline]
pub(crate) fn fill_recv(buf: &mut BytesMut, data: &[u8]) -> Status {
    buf.clear();
    let cap = buf.capacity();
    if data.len() > cap {
        buf.extend_from_slice(data.get(..cap).unwrap_or_default());
        Status::LocalBadLength
    } else {
        crate::mem::copy::extend(buf, data);
        Status::Success
    }
}

/// Moves up to `max` completions from the front of `q` into `out`, in order; returns how many.
#[inline]
pub(crate) fn drain_into(
    q: &mut VecDeque<DeviceCompletion>,
    out: &mut Vec<DeviceCompletion>,
    max: usize,
) -> usize {
    let n = max.min(q.len());
    // An empty queue is the common case of a poll: no drain to build and drop.
    if n > 0 {
        out.extend(q.drain(..n));
    }
    n
}

/// A software queue pair's completion queue: completions in the order they happened, and
/// whether any came since the waiters were last woken.
#[derive(Debug, Default)]
pub(crate) struct Completions {
    q: VecDeque<DeviceCompletion>,
    new: bool,
}

impl Completions {
    /// Queues a completion (the waiters are to be woken).
    pub(crate) fn push(&mut self, c: DeviceCompletion) {
        self.q.push_back(c);
        self.new = true;
    }

    pub(crate) fn len(&self) -> usize {
        self.q.len()
    }

    /// The queued completions, oldest first (to amend one before it is polled).
    pub(crate) fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut DeviceCompletion> {
        self.q.iter_mut()
    }

    /// Moves up to `max` completions into `out`, freeing their work requests' slots; returns
    /// how many. When the queue is left empty the poller holds every completion, so nobody is
    /// to be woken for them.
    pub(crate) fn poll_into(
        &mut self,
        slots: &mut WrSlots,
        out: &mut Vec<DeviceCompletion>,
        max: usize,
    ) -> usize {
        let n = max.min(self.q.len());
        for c in self.q.drain(..n) {
            slots.polled(&c);
            out.push(c);
        }
        if self.q.is_empty() {
            self.new = false;
        }
        n
    }

    /// Whether completions came since the last call (the caller then wakes the waiters).
    pub(crate) fn take_new(&mut self) -> bool {
        std::mem::take(&mut self.new)
    }
}
