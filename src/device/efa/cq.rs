//! The completion queue of a queue pair (an extended CQ, polled with `ibv_start_poll` /
//! `ibv_next_poll` / `ibv_end_poll`) and its optional completion channel.

use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rdma_sys::{
    ibv_comp_channel, ibv_cq, ibv_cq_ex, ibv_cq_init_attr_ex, ibv_gid, ibv_poll_cq_attr,
};

use super::ah::gid_from_ibv;
use super::ffi::{self, CqFns, EINVAL, ENOENT, EOPNOTSUPP, errno};
use super::nic::RawWc;
use super::verbs::{AHN_UNKNOWN, Context};
use super::verbs_error;
use crate::error::{Error, ErrorKind, Result};
use crate::notify::{Notifier, SleepHook};

// ---------------------------------------------------------------------------------------------
// Completion channel
// ---------------------------------------------------------------------------------------------

/// A completion channel and the thread that turns its events into [`Notifier`] signals, so that
/// blocking waits on a completion queue wake up without anyone polling.
///
/// The thread only reads and acknowledges events (`ibv_get_cq_event`, `ibv_ack_cq_events`); the
/// CQ is armed (`ibv_req_notify_cq`) by a waiter about to sleep ([`Armer`]), which then polls once
/// more — so no completion can slip between the last poll and the arming.
struct Channel {
    ch: NonNull<ibv_comp_channel>,
    stop: Arc<AtomicBool>,
    /// The CQ is armed; the thread clears it on each event.
    armed: Arc<AtomicBool>,
    thread: Option<crate::progress::Background>,
    _ctx: Arc<Context>,
}

// SAFETY: the channel is used by its thread (reads) and destroyed in `Drop` after the thread ended.
unsafe impl Send for Channel {}

struct ChannelPtr(*mut ibv_comp_channel);
// SAFETY: the pointer is only used by the channel thread while `Channel` (which joins it before
// destroying the channel) lives.
unsafe impl Send for ChannelPtr {}

impl Channel {
    fn create(ctx: &Arc<Context>) -> Result<Channel> {
        // SAFETY: valid context.
        let ch = unsafe { rdma_sys::ibv_create_comp_channel(ctx.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(|| verbs_error("ibv_create_comp_channel", errno()))?;
        // SAFETY: the channel is live; `fd` is its file descriptor.
        let fd = unsafe { ch.as_ref().fd };
        // SAFETY: fcntl on a valid descriptor with integer arguments.
        let nonblocking = unsafe {
            let fl = ffi::fcntl(fd, ffi::F_GETFL);
            fl >= 0 && ffi::fcntl(fd, ffi::F_SETFL, fl | ffi::O_NONBLOCK) == 0
        };
        if !nonblocking {
            let e = errno();
            // SAFETY: created above, no CQ uses it.
            unsafe { rdma_sys::ibv_destroy_comp_channel(ch.as_ptr()) };
            return Err(verbs_error("fcntl(O_NONBLOCK)", e));
        }
        Ok(Channel {
            ch,
            stop: Arc::new(AtomicBool::new(false)),
            armed: Arc::new(AtomicBool::new(false)),
            thread: None,
            _ctx: ctx.clone(),
        })
    }

    /// Starts the thread that signals `notifier` on every completion event. It sleeps in
    /// `poll(2)` on the channel and an eventfd with no timeout: an idle queue pair wakes it never
    /// (it looked at its stop flag every 20 ms before, 50 wake-ups a second per queue pair);
    /// stopping writes the eventfd.
    fn start(&mut self, notifier: Arc<Notifier>, name: String) -> Result<()> {
        let ch = ChannelPtr(self.ch.as_ptr());
        let stop = self.stop.clone();
        let armed = self.armed.clone();
        let efd = Arc::new(crate::notify::new_eventfd().map_err(|e| Error::io("eventfd", e))?);
        let waker = efd.clone();
        let t = crate::progress::Background::spawn(
            name,
            &self.stop,
            move || crate::notify::signal_eventfd(&*waker),
            move || channel_thread(ch, stop, armed, notifier, &efd),
        )
        .map_err(|e| Error::io("efa_completion_thread", e))?;
        self.thread = Some(t);
        Ok(())
    }

    fn stop_thread(&mut self) {
        if let Some(mut t) = self.thread.take() {
            t.stop();
        }
    }
}

fn channel_thread(
    ch: ChannelPtr,
    stop: Arc<AtomicBool>,
    armed: Arc<AtomicBool>,
    notifier: Arc<Notifier>,
    efd: &std::os::fd::OwnedFd,
) {
    use std::os::fd::AsRawFd;
    let ch = ch.0;
    // SAFETY: the channel outlives this thread (see `Channel`).
    let fd = unsafe { (*ch).fd };
    while !stop.load(Ordering::Acquire) {
        let mut p = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: efd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds; no timeout: an event or the stop wakes it.
        let rc = unsafe { libc::poll(p.as_mut_ptr(), 2, -1) };
        if rc <= 0 || p[0].revents == 0 {
            continue;
        }
        let mut got = false;
        loop {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut cq_ctx: *mut std::os::raw::c_void = ptr::null_mut();
            // SAFETY: live channel (non-blocking); out-pointers valid.
            let rc = unsafe { rdma_sys::ibv_get_cq_event(ch, &mut cq, &mut cq_ctx) };
            if rc != 0 || cq.is_null() {
                break;
            }
            // SAFETY: `cq` is the CQ the event was for; it cannot be destroyed before its events
            // are acknowledged (`ibv_destroy_cq` waits for that), which this does at once.
            unsafe { rdma_sys::ibv_ack_cq_events(cq, 1) };
            got = true;
        }
        if got {
            // The event disarmed the CQ; the next waiter about to sleep arms it again.
            armed.store(false, Ordering::Release);
            notifier.notify();
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.stop_thread();
        // SAFETY: the thread has ended and the CQ using the channel was destroyed before (the
        // `Cq` owning this channel destroys its CQ first).
        let rc = unsafe { rdma_sys::ibv_destroy_comp_channel(self.ch.as_ptr()) };
        if rc != 0 {
            tracing::error!(rc, "efa: ibv_destroy_comp_channel failed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Completion queue
// ---------------------------------------------------------------------------------------------

/// An extended completion queue, destroyed on drop.
pub(super) struct Cq {
    cq: NonNull<ibv_cq_ex>,
    fns: CqFns,
    /// The EFA view of the CQ (null when made by plain `ibv_create_cq_ex`).
    efa_cq: *mut ffi::efadv_cq,
    /// `efadv_wc_read_sgid` is available.
    sgid: bool,
    /// `efadv_wc_is_unsolicited` is available.
    pub(super) unsolicited: bool,
    /// Arms the CQ when a waiter is about to sleep (registered on the queue pair's notifier).
    armer: Option<Arc<Armer>>,
    /// Dropped after the CQ (field order).
    channel: Option<Channel>,
    /// The wake source when there is no channel.
    ticker: Option<Ticker>,
    _ctx: Arc<Context>,
}

/// Arms a CQ for a completion event when a waiter on its queue pair's notifier is about to
/// sleep (a [`SleepHook`]), and only then: a program that busy-polls never arms it, so its
/// completions raise no events (no channel-thread wake-up, no context switch per message on a
/// NIC or the emulated NIC), as libfabric without `FI_WAIT`.
///
/// No completion slips between a waiter's last poll and the arming: having armed, the hook
/// signals the notifier, so the waiter polls once more before it sleeps; completions after the
/// arming raise an event.
pub(super) struct Armer {
    /// The CQ, until it is destroyed (`None` then: the hook does nothing).
    cq: parking_lot::Mutex<Option<CqPtr>>,
    /// Shared with the channel thread, which clears it on each event.
    armed: Arc<AtomicBool>,
    notifier: Arc<Notifier>,
}

struct CqPtr(*mut ibv_cq);
// SAFETY: the pointer is only used under `Armer::cq`'s lock, which `Cq::drop` takes to clear
// it before destroying the CQ.
unsafe impl Send for CqPtr {}

impl SleepHook for Armer {
    fn before_sleep(&self) {
        if self.armed.swap(true, Ordering::AcqRel) {
            return;
        }
        let g = self.cq.lock();
        let Some(cq) = g.as_ref() else {
            return;
        };
        let cq = cq.0;
        // SAFETY: live CQ (cleared under this lock before it is destroyed); rdma-core's
        // `req_notify_cq` may run beside a poll of the same CQ.
        let rc = unsafe {
            match (*(*cq).context).ops.req_notify_cq {
                Some(f) => f(cq, 0),
                None => EOPNOTSUPP,
            }
        };
        drop(g);
        if rc != 0 {
            tracing::debug!(rc, "efa: ibv_req_notify_cq failed; waiting is by polling");
            return;
        }
        // Completions that came before the arming raise no event: the waiter polls once more.
        self.notifier.notify();
    }
}

/// How often a CQ without completion events wakes a sleeping waiter to poll again.
pub(super) const POLL_TICK: std::time::Duration = std::time::Duration::from_millis(1);

/// The wake source of a CQ without completion events (a device without CQ notifications, whose
/// libefa refuses a completion channel): nothing would wake a waiter on the queue pair's
/// notifier, so while one is about to sleep (a [`SleepHook`]) a thread signals the notifier
/// after [`POLL_TICK`], and the waiter polls again. A program that busy-polls never arms it.
pub(super) struct Ticker {
    /// The hook (the notifier holds it weakly: it goes with the ticker).
    _state: Arc<TickState>,
    thread: Option<crate::progress::Background>,
}

struct TickState {
    armed: parking_lot::Mutex<bool>,
    cond: parking_lot::Condvar,
    stop: Arc<AtomicBool>,
    notifier: std::sync::Weak<Notifier>,
}

impl SleepHook for TickState {
    fn before_sleep(&self) {
        let mut a = self.armed.lock();
        if !*a {
            *a = true;
            self.cond.notify_one();
        }
    }
}

impl Ticker {
    /// Starts the thread and registers the hook on `notifier`.
    fn start(notifier: &Arc<Notifier>, name: String) -> Result<Ticker> {
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(TickState {
            armed: parking_lot::Mutex::new(false),
            cond: parking_lot::Condvar::new(),
            stop: stop.clone(),
            notifier: Arc::downgrade(notifier),
        });
        let (s, w) = (state.clone(), state.clone());
        let thread = crate::progress::Background::spawn(
            name,
            &stop,
            move || {
                let _g = w.armed.lock();
                w.cond.notify_one();
            },
            move || tick_thread(&s),
        )
        .map_err(|e| Error::io("efa_poll_tick_thread", e))?;
        let hook: std::sync::Weak<dyn SleepHook> = Arc::downgrade(&state) as _;
        notifier.add_sleep_hook(hook);
        Ok(Ticker {
            _state: state,
            thread: Some(thread),
        })
    }
}

fn tick_thread(s: &TickState) {
    loop {
        {
            let mut a = s.armed.lock();
            while !*a && !s.stop.load(Ordering::Acquire) {
                s.cond.wait(&mut a);
            }
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            *a = false;
        }
        std::thread::sleep(POLL_TICK);
        match s.notifier.upgrade() {
            Some(n) => n.notify(),
            None => return,
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        if let Some(mut t) = self.thread.take() {
            t.stop();
        }
    }
}

// SAFETY: the CQ is used by one queue pair (`&mut self` on every poll) and destroyed in `Drop`.
unsafe impl Send for Cq {}

/// Completion fields the device fills (`IBV_WC_EX_WITH_*`).
fn wc_flags() -> u64 {
    use rdma_sys::ibv_create_cq_wc_flags as f;
    u64::from(
        (f::IBV_WC_EX_WITH_BYTE_LEN
            | f::IBV_WC_EX_WITH_IMM
            | f::IBV_WC_EX_WITH_QP_NUM
            | f::IBV_WC_EX_WITH_SRC_QP
            | f::IBV_WC_EX_WITH_SLID)
            .0,
    )
}

impl Cq {
    /// A CQ of `depth` entries. With `sgid` / `unsolicited`, asks libefa for the sender GID of
    /// unknown senders and for unsolicited write-recv completions; if `efadv_create_cq` refuses,
    /// falls back to a plain `ibv_create_cq_ex` without them. With a channel, completion events
    /// signal `notifier`; a device without CQ notifications gets a CQ without a channel.
    pub(super) fn create(
        ctx: &Arc<Context>,
        depth: u32,
        sgid: bool,
        unsolicited: bool,
        notifier: &Arc<Notifier>,
        thread_name: String,
    ) -> Result<Cq> {
        let mut channel = match Channel::create(ctx) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::debug!(error = %e, "efa: no completion channel; waiting is by polling");
                None
            }
        };
        let mut cq = Cq::create_inner(ctx, depth, sgid, unsolicited, channel.as_ref());
        if cq.is_err() && channel.is_some() {
            // Older devices have no CQ notifications (`EOPNOTSUPP` with a channel).
            tracing::debug!("efa: CQ with a completion channel refused; waiting is by polling");
            channel = None;
            cq = Cq::create_inner(ctx, depth, sgid, unsolicited, None);
        }
        let mut cq = cq?;
        if let Some(mut ch) = channel {
            ch.start(notifier.clone(), thread_name)?;
            let armer = Arc::new(Armer {
                cq: parking_lot::Mutex::new(Some(CqPtr(cq.as_cq()))),
                armed: ch.armed.clone(),
                notifier: notifier.clone(),
            });
            let hook: std::sync::Weak<dyn SleepHook> = Arc::downgrade(&armer) as _;
            notifier.add_sleep_hook(hook);
            cq.armer = Some(armer);
            cq.channel = Some(ch);
        } else {
            cq.ticker = Some(Ticker::start(notifier, format!("{thread_name}-tick"))?);
        }
        Ok(cq)
    }

    fn create_inner(
        ctx: &Arc<Context>,
        depth: u32,
        sgid: bool,
        unsolicited: bool,
        channel: Option<&Channel>,
    ) -> Result<Cq> {
        // SAFETY: plain data; all-zero is valid (no parent domain, no flags).
        let mut init: ibv_cq_init_attr_ex = unsafe { MaybeUninit::zeroed().assume_init() };
        init.cqe = depth.max(1);
        init.wc_flags = wc_flags();
        init.channel = channel.map_or(ptr::null_mut(), |c| c.ch.as_ptr());
        let mut efa = ffi::efadv_cq_init_attr {
            comp_mask: 0,
            wc_flags: if sgid { ffi::WC_EX_WITH_SGID } else { 0 }
                | if unsolicited {
                    ffi::WC_EX_WITH_IS_UNSOLICITED
                } else {
                    0
                },
        };
        // SAFETY: valid context and attribute structs of the sizes passed.
        let mut raw = unsafe {
            ffi::efadv_create_cq(
                ctx.as_ptr(),
                &mut init,
                &mut efa,
                std::mem::size_of_val(&efa) as u32,
            )
        };
        let (mut sgid_ok, mut uns_ok) = (sgid, unsolicited);
        if raw.is_null() {
            let e = errno();
            tracing::debug!(
                errno = e,
                "efa: efadv_create_cq failed; trying ibv_create_cq_ex"
            );
            // SAFETY: as above (rdma-sys's inline helper is broken on 64-bit: ffi::create_cq_ex).
            raw = unsafe { ffi::create_cq_ex(ctx.as_ptr(), &mut init) };
            sgid_ok = false;
            uns_ok = false;
            if raw.is_null() {
                return Err(verbs_error("ibv_create_cq_ex", errno())
                    .with_detail(format!("{} entries (efadv_create_cq: errno {e})", init.cqe)));
            }
        }
        let cq = NonNull::new(raw).ok_or_else(|| verbs_error("ibv_create_cq_ex", EINVAL))?;
        let destroy = || {
            // SAFETY: created above, no QP uses it yet.
            unsafe { rdma_sys::ibv_destroy_cq(rdma_sys::ibv_cq_ex_to_cq(cq.as_ptr())) };
        };
        // SAFETY: the CQ is live.
        let fns = match unsafe { CqFns::of(cq.as_ptr()) } {
            Ok(f) => f,
            Err(missing) => {
                destroy();
                return Err(Error::new(ErrorKind::NotSupported, "ibv_create_cq_ex")
                    .with_detail(format!("the CQ has no {missing} function")));
            }
        };
        let efa_cq = if sgid_ok || uns_ok {
            // SAFETY: the CQ was made by `efadv_create_cq`.
            unsafe { ffi::efadv_cq_from_ibv_cq_ex(cq.as_ptr()) }
        } else {
            ptr::null_mut()
        };
        if efa_cq.is_null() {
            sgid_ok = false;
            uns_ok = false;
        } else {
            // SAFETY: non-null EFA view of a live CQ; the v2 layout is only read when the CQ was
            // created with the unsolicited flag, which only a libefa that has the field accepts.
            unsafe {
                sgid_ok = sgid_ok && (*efa_cq).wc_read_sgid.is_some();
                uns_ok = uns_ok
                    && (*efa_cq.cast::<ffi::efadv_cq_v2>())
                        .wc_is_unsolicited
                        .is_some();
            }
        }
        Ok(Cq {
            cq,
            fns,
            efa_cq,
            sgid: sgid_ok,
            unsolicited: uns_ok,
            armer: None,
            ticker: None,
            channel: None,
            _ctx: ctx.clone(),
        })
    }

    pub(super) fn as_cq(&self) -> *mut ibv_cq {
        // SAFETY: an `ibv_cq_ex` starts with the fields of an `ibv_cq` (verbs ABI); this is a cast.
        unsafe { rdma_sys::ibv_cq_ex_to_cq(self.cq.as_ptr()) }
    }

    /// Reads the completion the CQ currently points at (between start/next_poll and end_poll).
    fn read_current(&self) -> RawWc {
        use rdma_sys::ibv_wc_opcode::{IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM};
        let cq = self.cq.as_ptr();
        let f = &self.fns;
        // SAFETY: called only while a poll session points at a valid completion; the functions
        // were checked at creation.
        unsafe {
            let status = (*cq).status;
            let opcode = (f.read_opcode)(cq);
            let mut wc = RawWc {
                wr_id: (*cq).wr_id,
                status,
                vendor_err: (f.read_vendor_err)(cq),
                opcode,
                byte_len: (f.read_byte_len)(cq),
                ..RawWc::default()
            };
            if (f.read_wc_flags)(cq) & rdma_sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
                wc.imm = Some(u32::from_be((f.read_imm_data)(cq)));
            }
            let is_recv = opcode == IBV_WC_RECV || opcode == IBV_WC_RECV_RDMA_WITH_IMM;
            if is_recv && status == rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
                wc.src_qp = (f.read_src_qp)(cq);
                wc.slid = (f.read_slid)(cq);
                if self.sgid && wc.slid == AHN_UNKNOWN {
                    if let Some(read_sgid) = (*self.efa_cq).wc_read_sgid {
                        let mut g = ibv_gid { raw: [0; 16] };
                        if read_sgid(self.efa_cq, &mut g) == 0 {
                            wc.sgid = Some(gid_from_ibv(&g));
                        }
                    }
                }
            }
            if self.unsolicited && opcode == IBV_WC_RECV_RDMA_WITH_IMM {
                if let Some(is_uns) = (*self.efa_cq.cast::<ffi::efadv_cq_v2>()).wc_is_unsolicited {
                    wc.unsolicited = is_uns(self.efa_cq);
                }
            }
            wc
        }
    }

    pub(super) fn poll(
        &mut self,
        max: usize,
        out: &mut Vec<RawWc>,
    ) -> std::result::Result<(), i32> {
        if max == 0 {
            return Ok(());
        }
        let cq = self.cq.as_ptr();
        let mut attr = ibv_poll_cq_attr { comp_mask: 0 };
        // SAFETY: live CQ, checked functions; every successful start is ended below.
        let rc = unsafe { (self.fns.start_poll)(cq, &mut attr) };
        if rc == ENOENT {
            return Ok(());
        }
        if rc != 0 {
            return Err(rc);
        }
        let mut n = 0;
        let mut res = Ok(());
        loop {
            out.push(self.read_current());
            n += 1;
            if n >= max {
                break;
            }
            // SAFETY: inside the poll session started above.
            let rc = unsafe { (self.fns.next_poll)(cq) };
            if rc == ENOENT {
                break;
            }
            if rc != 0 {
                res = Err(rc);
                break;
            }
        }
        // SAFETY: ends the session started above.
        unsafe { (self.fns.end_poll)(cq) };
        res
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // No more arming by waiters (a hook that runs now waits for this lock).
        if let Some(a) = self.armer.take() {
            *a.cq.lock() = None;
        }
        // The event thread first, so nothing acknowledges events of a CQ being destroyed.
        if let Some(ch) = self.channel.as_mut() {
            ch.stop_thread();
        }
        // SAFETY: created in `create_inner`; the QP using it was destroyed before (`VerbsNic`
        // destroys its QP first); events were acknowledged by the channel thread.
        let rc = unsafe { rdma_sys::ibv_destroy_cq(self.as_cq()) };
        if rc != 0 {
            tracing::error!(rc, "efa: ibv_destroy_cq failed");
        }
        // The channel (if any) is dropped after this, as a field.
    }
}
