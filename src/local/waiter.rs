//! The same-host path's waiter thread: while the application does not poll, it sleeps on the
//! own channel's doorbell and drives the endpoint when a chunk arrives or sends wait, so
//! completions come and completion queues wake as they would with the device path.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use super::chan::OwnRing;
use crate::cq::ProgressSource;
use crate::notify::{Notifier, SleepHook};
use crate::progress::{Background, PollMark, Polls};
use crate::shmem::map;

/// How long the waiter stays aside while the application busy-polls before it looks again
/// (the application going to sleep on a completion queue wakes it at once, `WaiterHook`).
const BUSY_WINDOW: Duration = Duration::from_millis(20);
/// How long the waiter sleeps on the doorbell when nothing waits (peers ring it when they write;
/// the application's busy polls quiet the doorbell themselves): a bound on a lost wake-up and on
/// noticing a stuck slot. Every wake-up of an idle endpoint costs CPU, so it is long.
const IDLE_NAP: Duration = Duration::from_millis(200);

/// What the path and whatever drives it besides the application (the waiter thread; the
/// simulator) share.
#[derive(Default)]
pub(super) struct Pace {
    /// Progress passes so far (the waiter's busy-poll detector).
    pub(super) polls: Polls,
    /// Sends wait for room or for the peer, or a message is partly here (the waiter progresses
    /// the endpoint every millisecond).
    pub(super) waiting: AtomicBool,
    /// The application busy-polls (the waiter's finding).
    pub(super) app_polls: AtomicBool,
    /// A thread is about to sleep on the endpoint's completion queues (the sleep hook).
    sleeping: AtomicBool,
    stop: Arc<AtomicBool>,
    /// The endpoint, which the waiter drives while the application does not poll.
    source: OnceLock<Weak<dyn ProgressSource>>,
    /// The waiter holds the endpoint (a strong reference) for a progress pass.
    pub(super) driving: AtomicBool,
    /// The application's handle is being dropped: the waiter takes no strong reference.
    paused: AtomicBool,
}

impl Pace {
    /// One progress pass of the endpoint from the waiter, unless the handle is being dropped.
    /// (Otherwise the waiter could end up with the last reference, and the endpoint would be
    /// closed on its thread, after the application's thread went on — maybe out of `main`,
    /// with the channel file still there.)
    fn drive(&self) {
        self.driving.store(true, Ordering::SeqCst);
        if !self.paused.load(Ordering::SeqCst) {
            if let Some(src) = self.source.get().and_then(Weak::upgrade) {
                src.progress();
            }
        }
        self.driving.store(false, Ordering::SeqCst);
    }
}

/// Lets the application's handle keep the waiter from holding the endpoint while it drops it.
pub(crate) struct WaiterGate(Arc<Pace>);

impl WaiterGate {
    /// Stops the waiter from taking the endpoint and waits for a pass it is in to end.
    pub(crate) fn pause(&self) {
        self.0.paused.store(true, Ordering::SeqCst);
        while self.0.driving.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }

    /// Lets the waiter drive the endpoint again.
    pub(crate) fn resume(&self) {
        self.0.paused.store(false, Ordering::SeqCst);
    }
}

/// The waiter thread of one path.
pub(super) struct Waiter {
    pace: Arc<Pace>,
    /// Registered on the endpoint's notifier (kept alive here).
    _hook: Arc<dyn SleepHook>,
    thread: Background,
}

impl Waiter {
    /// Starts the waiter of the channel `ring` (named after `qpn`).
    pub(super) fn start(
        pace: &Arc<Pace>,
        ring: &Arc<OwnRing>,
        qpn: u16,
        notifier: &Notifier,
    ) -> std::io::Result<Waiter> {
        let (p, r) = (pace.clone(), ring.clone());
        let bell = ring.clone();
        let thread = Background::spawn(
            format!("efa-local-{qpn}"),
            &pace.stop,
            move || {
                if let Some(d) = bell.bell() {
                    d.wake();
                }
            },
            move || run(&p, &r),
        )?;
        let hook: Arc<dyn SleepHook> = Arc::new(WaiterHook {
            pace: Arc::downgrade(pace),
            ring: ring.clone(),
        });
        notifier.add_sleep_hook(Arc::downgrade(&hook));
        if let Some(fd) = ring.wake_fd() {
            notifier.watch(fd);
        }
        Ok(Waiter {
            pace: pace.clone(),
            _hook: hook,
            thread,
        })
    }

    /// The handle that keeps the waiter from the endpoint while the application drops it.
    pub(super) fn gate(&self) -> WaiterGate {
        WaiterGate(self.pace.clone())
    }

    /// The endpoint the waiter drives while the application does not poll.
    pub(super) fn set_source(&self, source: Weak<dyn ProgressSource>) {
        let _ = self.pace.source.set(source);
    }

    /// Stops the thread and waits for it (unless this is it).
    pub(super) fn stop(&mut self) {
        self.thread.stop();
    }
}

/// Tells the waiter that the application is about to sleep on a completion queue: it takes
/// over at once instead of at the end of its busy window.
struct WaiterHook {
    pace: Weak<Pace>,
    ring: Arc<OwnRing>,
}

impl WaiterHook {
    /// The waiter stood aside while the application polled: it takes over now.
    fn take_over(&self) {
        if let Some(s) = self.pace.upgrade() {
            if s.app_polls.load(Ordering::Relaxed) {
                s.sleeping.store(true, Ordering::SeqCst);
                if let Some(d) = self.ring.bell() {
                    d.wake();
                }
            }
        }
    }
}

impl SleepHook for WaiterHook {
    /// A blocking or async wait: senders ring the waiter's futex (not the wake pipe, which no
    /// one waits on now), and a chunk a sender announced through the pipe meanwhile wakes the
    /// waiter.
    fn before_sleep(&self) {
        if self.ring.disarm_fd_wait() {
            if let Some(d) = self.ring.bell() {
                d.wake();
            }
        }
        self.take_over();
    }

    /// A wait on the completion queue's descriptor, whose epoll set holds the channel's wake
    /// pipe: senders write the pipe, so the program wakes with no thread in between (the
    /// waiter goes on sleeping; it still serves waiting sends and stuck slots).
    fn before_fd_sleep(&self) -> bool {
        let ready = self.ring.arm_fd_wait();
        self.take_over();
        ready
    }
}

/// The waiter thread: stands aside while the application polls; otherwise sleeps on the
/// channel's doorbell (as a sleeper, so peers ring it when they write to the ring or consume
/// what this endpoint sent) and drives the endpoint when there is something to do, as the shm
/// device's thread does for the device path: chunks are consumed, sends complete, completion
/// queues are woken. While sends wait it looks every millisecond.
fn run(s: &Pace, ring: &OwnRing) {
    let Some(door) = ring.bell() else {
        return;
    };
    let bell = door.bell;
    let mut mark = PollMark::new(&s.polls);
    while !s.stop.load(Ordering::Acquire) {
        // While the application busy-polls, stand aside a window at a time; otherwise go
        // straight to sleep as a sleeper (the nap below tells whether it began to poll).
        if s.app_polls.load(Ordering::Relaxed) {
            let seen = bell.load(Ordering::Acquire);
            map::futex_wait(bell, seen, BUSY_WINDOW);
            let busy = mark.judge(&s.polls) && !s.sleeping.swap(false, Ordering::SeqCst);
            if !busy {
                s.app_polls.store(false, Ordering::Relaxed);
            }
            if busy || s.stop.load(Ordering::Acquire) {
                continue;
            }
        }
        let seen = door.sleep_unless(
            || ring.ready(),
            || {
                if s.waiting.load(Ordering::Relaxed) {
                    Duration::from_millis(1)
                } else {
                    IDLE_NAP
                }
            },
        );
        // The application polled at the busy-poll rate meanwhile: stand aside from now on.
        if mark.judge(&s.polls) && !s.sleeping.swap(false, Ordering::SeqCst) {
            s.app_polls.store(true, Ordering::Relaxed);
        }
        if s.stop.load(Ordering::Acquire) {
            return;
        }
        if ring.ready()
            || s.waiting.load(Ordering::Relaxed)
            || bell.load(Ordering::Acquire) != seen
            || ring.stuck().is_some()
        {
            s.drive();
        }
    }
}
