//! Completion queues: `ibv_cq` / `ibv_cq_ex` with EFA's `efadv_cq`, and completion channels.
//!
//! A CQ owns a queue of finished work completions ([`Cqe`]). Polling an empty CQ first drains the
//! device queue pairs bound to it (each queue pair's completions go to its send or receive CQ),
//! which is also what makes the udp device progress on the application's thread.

use std::collections::VecDeque;
use std::os::raw::c_int;
use std::sync::{Arc, Weak};

use efa::notify::Notifier;
use parking_lot::Mutex;

use crate::qp::QpCore;

/// One work completion, as the EFA device reports it.
#[derive(Clone, Debug, Default)]
pub struct Cqe {
    pub wr_id: u64,
    pub status: c_int,
    pub vendor_err: u32,
    pub opcode: c_int,
    pub byte_len: u32,
    /// Immediate data (host order).
    pub imm: Option<u32>,
    pub qp_num: u32,
    pub src_qp: u32,
    /// The receiver's AHN for the sender, 0xffff when it has none.
    pub slid: u16,
    /// The sender's GID, for receives from senders without an AH.
    pub sgid: Option<[u8; 16]>,
    /// A write with immediate data that consumed no receive buffer.
    pub unsolicited: bool,
}

#[derive(Default)]
struct CqState {
    queue: VecDeque<Cqe>,
    /// The completion `read_*` describe (between `start_poll` and `end_poll`).
    cur: Option<Cqe>,
    /// Armed by `ibv_req_notify_cq`.
    armed: bool,
    /// Lost completions (the queue was full): reported as an overrun, never silently.
    overrun: bool,
}

/// Completions lost to full CQs, process-wide (`EFA_EMU_STATS`).
pub static CQ_LOST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The shared part of a CQ.
pub struct CqCore {
    state: Mutex<CqState>,
    /// The queue pairs that complete into this CQ.
    qps: Mutex<Vec<Weak<QpCore>>>,
    /// Signalled by the queue pairs' devices when completions become ready.
    pub notifier: Arc<Notifier>,
    pub capacity: usize,
    /// The completion channel, if any.
    pub channel: Option<Arc<ChannelCore>>,
    /// Whether `efadv_wc_read_sgid` reports source GIDs.
    pub with_sgid: bool,
    /// Queue pairs using this CQ (destroying it is refused while any does).
    pub users: std::sync::atomic::AtomicUsize,
    /// The address of the `ibv_cq` the application holds (what `ibv_get_cq_event` returns).
    pub ibv: std::sync::atomic::AtomicUsize,
}

impl CqCore {
    pub fn new(capacity: usize, channel: Option<Arc<ChannelCore>>, with_sgid: bool) -> CqCore {
        let notifier = match &channel {
            Some(ch) => Arc::new(Notifier::forwarding(vec![ch.notifier.clone()])),
            None => Arc::new(Notifier::new()),
        };
        CqCore {
            state: Mutex::new(CqState::default()),
            qps: Mutex::new(Vec::new()),
            notifier,
            capacity,
            channel,
            with_sgid,
            users: std::sync::atomic::AtomicUsize::new(0),
            ibv: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Binds a queue pair (its completions are drained by polls of this CQ).
    pub fn attach(&self, qp: &Arc<QpCore>) {
        let mut q = self.qps.lock();
        q.retain(|w| w.strong_count() > 0);
        q.push(Arc::downgrade(qp));
    }

    /// Adds a finished completion.
    pub fn push(&self, c: Cqe) {
        let mut st = self.state.lock();
        if st.queue.len() >= self.capacity {
            // A full CQ overruns as a NIC's does: the completion is lost (the program's
            // buffers and work requests it stood for are never reported). Counted
            // (`EFA_EMU_STATS`: cq_lost) and said once per CQ.
            CQ_LOST.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if !st.overrun {
                tracing::warn!(
                    capacity = self.capacity,
                    "efa-emu: completion queue overrun (more completions than its depth): completions are lost"
                );
                st.overrun = true;
            }
            return;
        }
        st.queue.push_back(c);
        let fire = st.armed;
        if fire {
            st.armed = false;
        }
        drop(st);
        if fire {
            if let Some(ch) = &self.channel {
                ch.fire(self.ibv.load(std::sync::atomic::Ordering::Relaxed));
            }
        }
    }

    /// Moves ready completions of the bound queue pairs into their CQs.
    pub fn drain_qps(&self) {
        let qps: Vec<Arc<QpCore>> = self.qps.lock().iter().filter_map(Weak::upgrade).collect();
        for qp in qps {
            qp.drain();
        }
    }

    /// Takes the next completion, draining the devices when the queue is empty.
    pub fn pop(&self) -> Option<Cqe> {
        if let Some(c) = self.state.lock().queue.pop_front() {
            return Some(c);
        }
        self.drain_qps();
        self.state.lock().queue.pop_front()
    }

    pub fn set_cur(&self, c: Option<Cqe>) {
        self.state.lock().cur = c;
    }

    pub fn cur<R>(&self, f: impl FnOnce(&Cqe) -> R) -> Option<R> {
        self.state.lock().cur.as_ref().map(f)
    }

    /// `ibv_req_notify_cq`: the channel hears of the next completion (at once if one waits).
    pub fn arm(self: &Arc<CqCore>) {
        let mut st = self.state.lock();
        if st.queue.is_empty() {
            st.armed = true;
            drop(st);
            // The channel's watcher drains the devices and fires when something arrives.
            if let Some(ch) = &self.channel {
                ch.watch(self);
            }
        } else {
            drop(st);
            if let Some(ch) = &self.channel {
                ch.fire(self.ibv.load(std::sync::atomic::Ordering::Relaxed));
            }
        }
    }

    fn is_armed(&self) -> bool {
        self.state.lock().armed
    }
}

/// A completion channel: a pipe the application waits on, and a watcher thread that drains
/// the devices of armed CQs while the application sleeps.
pub struct ChannelCore {
    pub notifier: Arc<Notifier>,
    /// Read end (the application's `fd`) and write end.
    pub fds: (c_int, c_int),
    /// Events: the `ibv_cq` addresses, in order.
    pub events: Mutex<VecDeque<usize>>,
    /// Armed CQs the watcher polls (weak: a CQ destroyed while armed just drops out).
    watched: Mutex<Vec<(usize, Weak<CqCore>)>>,
    /// Signalled when a CQ is armed: with none armed the watcher sleeps on this, not on the
    /// devices' completions (a program that polls without arming costs no wake-ups, as on a NIC).
    arming: Notifier,
    stop: std::sync::atomic::AtomicBool,
}

impl ChannelCore {
    pub fn new() -> Result<Arc<ChannelCore>, i32> {
        let mut fds = [0 as c_int; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EMFILE));
        }
        let ch = Arc::new(ChannelCore {
            notifier: Arc::new(Notifier::new()),
            fds: (fds[0], fds[1]),
            events: Mutex::new(VecDeque::new()),
            watched: Mutex::new(Vec::new()),
            arming: Notifier::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
        });
        let w = Arc::downgrade(&ch);
        std::thread::Builder::new()
            .name("efa-emu-channel".into())
            .spawn(move || watcher(w))
            .map_err(|_| libc::EAGAIN)?;
        Ok(ch)
    }

    /// Queues an event for the CQ at `cq` and wakes the reader.
    pub fn fire(&self, cq: usize) {
        self.events.lock().push_back(cq);
        let b = [1u8];
        // SAFETY: writes one byte from `b` to our own pipe; a full pipe (EAGAIN) cannot happen
        // with a blocking write, and an error loses nothing the event queue does not keep.
        let _ = unsafe { libc::write(self.fds.1, b.as_ptr().cast(), 1) };
    }

    fn watch(&self, cq: &Arc<CqCore>) {
        let key = Arc::as_ptr(cq) as usize;
        let mut w = self.watched.lock();
        if !w.iter().any(|(k, _)| *k == key) {
            w.push((key, Arc::downgrade(cq)));
        }
        drop(w);
        self.arming.notify();
        self.notifier.notify();
    }

    pub fn close(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.arming.notify();
        self.notifier.notify();
    }
}

impl Drop for ChannelCore {
    fn drop(&mut self) {
        // SAFETY: both descriptors are ours and closed once.
        unsafe {
            libc::close(self.fds.0);
            libc::close(self.fds.1);
        }
    }
}

/// Drains the devices of armed CQs whenever their queue pairs signal, so a program blocked on
/// the channel hears of completions (the udp device's own thread keeps the protocol going).
fn watcher(ch: Weak<ChannelCore>) {
    loop {
        let Some(c) = ch.upgrade() else { return };
        if c.stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let seen = c.notifier.generation();
        let seen_arming = c.arming.generation();
        let cqs: Vec<Arc<CqCore>> = {
            let mut w = c.watched.lock();
            w.retain(|(_, weak)| weak.upgrade().is_some_and(|cq| cq.is_armed()));
            w.iter().filter_map(|(_, weak)| weak.upgrade()).collect()
        };
        for cq in &cqs {
            // Completions land in their CQs; `push` fires armed ones.
            cq.drain_qps();
        }
        let idle = cqs.is_empty();
        let notifier = c.notifier.clone();
        drop(cqs);
        let deadline = Some(std::time::Instant::now() + std::time::Duration::from_millis(50));
        if idle {
            // Nothing armed: wait for an arming, not for completions nobody waits for.
            c.arming.wait_until(seen_arming, deadline);
        } else {
            drop(c);
            notifier.wait_until(seen, deadline);
        }
    }
}
