//! Progress: what the threads that drive the crate's work have in common (the RDM endpoint's
//! progress thread, the same-host path's waiter, the shm device's thread, the udp device's NIC
//! thread), and the pass clock of the code they drive.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The time of one progress pass, read from the system clock only if something needs it (an
/// idle busy poll then reads no clock at all). [`Clock::at`] gives a pass a time already read,
/// or a virtual one (the simulator): code that takes a `Clock` never reads the system clock by
/// itself.
#[derive(Default)]
pub(crate) struct Clock(Option<Instant>);

impl Clock {
    /// A clock already read.
    pub(crate) fn at(now: Instant) -> Clock {
        Clock(Some(now))
    }

    /// The time if it was read already.
    pub(crate) fn cached(&self) -> Option<Instant> {
        self.0
    }

    /// The pass's time (read once, at the first call).
    pub(crate) fn now(&mut self) -> Instant {
        *self.0.get_or_insert_with(Instant::now)
    }
}

/// Application polls per millisecond from which it counts as busy-polling: its polls then make
/// all the progress, and the background threads stand aside (and peers need not wake them). A
/// thread that polls once and then sleeps on its notifier polls a few times per completion,
/// far below this.
pub(crate) const BUSY_POLLS_PER_MS: u64 = 256;

/// Whether `polls` polls in `elapsed` come at the busy-poll rate, [`BUSY_POLLS_PER_MS`] per
/// millisecond. (A judgement needs a sample of some size: [`PollMark::judge`] asks for a
/// millisecond's worth of polls at least.)
pub(crate) fn busy_polling(polls: u64, elapsed: Duration) -> bool {
    u128::from(polls) * 1_000_000 >= u128::from(BUSY_POLLS_PER_MS) * elapsed.as_nanos()
}

/// An application's polls, counted by the polling thread (one at a time) for a background
/// thread that judges whether it busy-polls ([`PollMark`]).
#[derive(Debug, Default)]
pub(crate) struct Polls(AtomicU64);

impl Polls {
    /// Counts one poll; returns the count before it.
    #[inline]
    pub(crate) fn count(&self) -> u64 {
        let n = self.0.load(Ordering::Relaxed);
        self.0.store(n.wrapping_add(1), Ordering::Relaxed);
        n
    }

    /// Polls so far.
    #[inline]
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A background thread's last look at [`Polls`]: the count and the time.
pub(crate) struct PollMark {
    polls: u64,
    at: Instant,
}

impl PollMark {
    pub(crate) fn new(p: &Polls) -> PollMark {
        PollMark {
            polls: p.get(),
            at: Instant::now(),
        }
    }

    /// When the last look was.
    pub(crate) fn at(&self) -> Instant {
        self.at
    }

    /// Whether the application busy-polled since the last look (at least
    /// [`BUSY_POLLS_PER_MS`] polls, at that rate); looks again.
    pub(crate) fn judge(&mut self, p: &Polls) -> bool {
        let now = p.get();
        let n = now.wrapping_sub(self.polls);
        let busy = n >= BUSY_POLLS_PER_MS && busy_polling(n, self.at.elapsed());
        *self = PollMark {
            polls: now,
            at: Instant::now(),
        };
        busy
    }
}

/// A thread that does a part's work in the background (the udp device's NIC thread, the shm
/// device's thread, the same-host path's waiter, the RDM endpoint's progress thread, the efa
/// device's completion-channel thread) until it is stopped: [`Background::stop`] (or dropping
/// it) sets the stop flag the thread watches, wakes it and joins it, unless it runs on the
/// thread itself (which then ends by itself).
pub(crate) struct Background {
    stop: Arc<AtomicBool>,
    wake: Box<dyn Fn() + Send + Sync>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
    /// Starts `body` on a thread named `name`; it is to return soon after `stop` is set and
    /// `wake` called.
    pub(crate) fn spawn(
        name: String,
        stop: &Arc<AtomicBool>,
        wake: impl Fn() + Send + Sync + 'static,
        body: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Background> {
        let thread = std::thread::Builder::new().name(name).spawn(body)?;
        Ok(Background {
            stop: stop.clone(),
            wake: Box::new(wake),
            thread: Some(thread),
        })
    }

    /// The thread (to unpark it).
    pub(crate) fn thread(&self) -> Option<&std::thread::Thread> {
        self.thread.as_ref().map(JoinHandle::thread)
    }

    /// Stops the thread and waits for it (unless this is it); idempotent.
    pub(crate) fn stop(&mut self) {
        let Some(t) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::Release);
        (self.wake)();
        if t.thread().id() != std::thread::current().id() {
            let _ = t.join();
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_polling_is_a_rate() {
        assert!(busy_polling(64, Duration::from_micros(250)));
        assert!(!busy_polling(64, Duration::from_micros(251)));
        assert!(busy_polling(2560, Duration::from_millis(10)));
        assert!(!busy_polling(2559, Duration::from_millis(10)));
        let p = Polls::default();
        let mut m = PollMark::new(&p);
        for _ in 0..255 {
            p.count();
        }
        assert!(
            !m.judge(&p),
            "fewer than a millisecond's worth is no sample"
        );
        for _ in 0..300 {
            p.count();
        }
        assert!(m.judge(&p) || m.at().elapsed() > Duration::from_millis(1));
    }

    #[test]
    fn a_background_thread_stops_once_and_joins() {
        let stop = Arc::new(AtomicBool::new(false));
        let woken = Arc::new(AtomicU64::new(0));
        let (s, w) = (stop.clone(), woken.clone());
        let mut b = Background::spawn(
            "efa-test".into(),
            &stop,
            move || {
                w.fetch_add(1, Ordering::Relaxed);
            },
            move || {
                while !s.load(Ordering::Acquire) {
                    std::thread::park_timeout(Duration::from_millis(1));
                }
            },
        )
        .unwrap();
        assert_eq!(b.thread().and_then(|t| t.name()), Some("efa-test"));
        b.stop();
        b.stop();
        drop(b);
        assert!(stop.load(Ordering::Acquire));
        assert_eq!(woken.load(Ordering::Relaxed), 1, "woken once");
    }
}
