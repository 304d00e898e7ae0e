//! A wake-up signal shared between a device (which knows when completions are ready) and the
//! completion queues that wait for them, for both blocking and runtime-independent async waits.

use std::sync::Weak;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::Waker;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// A level of "something happened" with a generation number: waiters remember the generation they
/// saw before polling and sleep only while it is unchanged, so no signal is ever lost.
#[derive(Debug, Default)]
pub struct Notifier {
    generation: AtomicU64,
    /// Threads inside [`Notifier::wait_until`] plus registered wakers: a notification with
    /// nobody waiting takes no lock.
    waiting: AtomicUsize,
    lock: Mutex<Vec<Waker>>,
    cond: Condvar,
    forward: Vec<std::sync::Arc<Notifier>>,
    /// Told when a waiter is about to sleep (see [`Notifier::add_sleep_hook`]).
    hooks: Mutex<Vec<Weak<dyn SleepHook>>>,
    /// An eventfd made readable by the next notification once armed ([`Notifier::arm_fd`]),
    /// for programs that wait with epoll, mio or an async runtime's fd readiness.
    fd: std::sync::OnceLock<std::os::fd::OwnedFd>,
    fd_armed: std::sync::atomic::AtomicBool,
}

/// Something that must know when a waiter goes to sleep on a notifier: a device whose background
/// thread stands aside while the application busy-polls, and must take over the progress as soon
/// as the application blocks instead.
pub trait SleepHook: Send + Sync {
    /// A waiter is about to sleep (blocking or async); called without any notifier lock held.
    fn before_sleep(&self);
}

impl Notifier {
    /// A new notifier.
    pub fn new() -> Notifier {
        Notifier::default()
    }

    /// A notifier that also signals each of `targets` whenever it is signalled (an endpoint whose
    /// send and receive completions go to two different completion queues uses one).
    ///
    /// Used inside the crate and by the emulated EFA NIC (feature `emu-hooks`, where it is
    /// documented); not for applications.
    #[cfg_attr(not(feature = "emu-hooks"), doc(hidden))]
    pub fn forwarding(targets: Vec<std::sync::Arc<Notifier>>) -> Notifier {
        Notifier {
            forward: targets,
            ..Notifier::default()
        }
    }

    /// The current generation; pass it to [`Notifier::wait_until`] after polling found nothing.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Signals every waiter (blocking and async).
    pub fn notify(&self) {
        // Paired with the waiters' increment of `waiting` before they look at the generation
        // (both sequentially consistent): either the waiter sees the new generation, or this
        // sees the waiter.
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.fd_armed.load(Ordering::SeqCst) && self.fd_armed.swap(false, Ordering::SeqCst) {
            self.signal_fd();
        }
        if self.waiting.load(Ordering::SeqCst) != 0 {
            let wakers = {
                let mut w = self.lock.lock();
                self.cond.notify_all();
                let taken = std::mem::take(&mut *w);
                self.waiting.fetch_sub(taken.len(), Ordering::SeqCst);
                taken
            };
            for w in wakers {
                w.wake();
            }
        }
        for t in &self.forward {
            t.notify();
        }
    }

    /// Registers `hook` on this notifier and on every notifier it forwards to, so that a waiter
    /// on any of them calls it before sleeping. Dropped hooks are forgotten.
    pub fn add_sleep_hook(&self, hook: Weak<dyn SleepHook>) {
        {
            let mut h = self.hooks.lock();
            h.retain(|w| w.strong_count() > 0);
            h.push(hook.clone());
        }
        for t in &self.forward {
            t.add_sleep_hook(hook.clone());
        }
    }

    fn before_sleep(&self) {
        let hooks: Vec<_> = {
            let h = self.hooks.lock();
            if h.is_empty() {
                return;
            }
            h.iter().filter_map(Weak::upgrade).collect()
        };
        for h in hooks {
            h.before_sleep();
        }
    }

    /// Blocks until the generation differs from `seen` or `deadline` passes (`None`: no deadline).
    /// Returns false on timeout.
    pub fn wait_until(&self, seen: u64, deadline: Option<Instant>) -> bool {
        if self.generation() != seen {
            return true;
        }
        self.before_sleep();
        let mut g = self.lock.lock();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let moved = loop {
            if self.generation() != seen {
                break true;
            }
            match deadline {
                Some(d) => {
                    if self.cond.wait_until(&mut g, d).timed_out() {
                        break self.generation() != seen;
                    }
                }
                None => self.cond.wait(&mut g),
            }
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        moved
    }

    /// This notifier's eventfd (made on first use): readable once a notification came after
    /// [`arm_fd`](Notifier::arm_fd). `None` when the system has no eventfd to give.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        if let Some(f) = self.fd.get() {
            return Some(f.as_fd());
        }
        // A racing creator's descriptor is dropped.
        let _ = self.fd.set(new_eventfd().ok()?);
        self.fd.get().map(AsFd::as_fd)
    }

    /// Prepares the eventfd for a program about to block on it (libfabric's `fi_trywait`):
    /// empties it, arms it to be written at the next notification, and tells the sleep hooks
    /// (devices hand their progress to their threads). True when the generation moved past
    /// `seen` meanwhile: something happened, poll again instead of blocking.
    #[allow(unsafe_code)]
    pub fn arm_fd(&self, seen: u64) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = self.fd().map(|f| f.as_raw_fd()) else {
            return true;
        };
        let mut v = 0u64;
        // SAFETY: an 8-byte read from our non-blocking eventfd (EAGAIN when already empty).
        unsafe { libc::read(fd, (&raw mut v).cast(), 8) };
        if self.generation() != seen {
            return true;
        }
        self.before_sleep();
        self.fd_armed.store(true, Ordering::SeqCst);
        self.generation() != seen
    }

    fn signal_fd(&self) {
        if let Some(f) = self.fd.get() {
            signal_eventfd(f);
        }
    }

    /// Registers `waker` to be woken at the next notification unless the generation already moved
    /// past `seen`; returns true when it has (the caller should poll again instead of sleeping).
    pub fn register(&self, seen: u64, waker: &Waker) -> bool {
        if self.generation() != seen {
            return true;
        }
        self.before_sleep();
        let mut w = self.lock.lock();
        if w.iter().any(|x| x.will_wake(waker)) {
            return self.generation() != seen;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        if self.generation() != seen {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return true;
        }
        w.push(waker.clone());
        false
    }
}

/// A new non-blocking, close-on-exec eventfd.
#[allow(unsafe_code)]
pub(crate) fn new_eventfd() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: eventfd with valid flags.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) })
}

/// Makes the eventfd `fd` readable (adds 1 to its counter).
#[allow(unsafe_code)]
pub(crate) fn signal_eventfd(fd: &impl std::os::fd::AsRawFd) {
    let one = 1u64;
    // SAFETY: an 8-byte write of a live u64 to an eventfd.
    unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
}
