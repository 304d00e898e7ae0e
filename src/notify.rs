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
    /// The descriptor programs wait on with epoll, mio or an async runtime's fd readiness: an
    /// epoll set holding an eventfd, which the next notification writes once armed
    /// ([`Notifier::arm_fd`]), and the wake pipes of the same-host path's channels, which
    /// senders in other threads and processes write themselves ([`Notifier::watch`]).
    fd: std::sync::OnceLock<WaitFd>,
    fd_armed: std::sync::atomic::AtomicBool,
}

/// Something that must know when a waiter goes to sleep on a notifier: a device whose background
/// thread stands aside while the application busy-polls, and must take over the progress as soon
/// as the application blocks instead.
pub trait SleepHook: Send + Sync {
    /// A waiter is about to sleep (blocking or async); called without any notifier lock held.
    fn before_sleep(&self);

    /// A program is about to sleep on the notifier's descriptor ([`Notifier::arm_fd`]). True
    /// when something is ready already (the program should poll instead). By default the same
    /// as [`before_sleep`](SleepHook::before_sleep).
    fn before_fd_sleep(&self) -> bool {
        self.before_sleep();
        false
    }
}

/// A notifier's descriptor: an epoll set (what programs wait on) with the eventfd the notifier
/// writes in it.
#[derive(Debug)]
struct WaitFd {
    epoll: std::os::fd::OwnedFd,
    event: std::os::fd::OwnedFd,
}

impl WaitFd {
    fn new() -> std::io::Result<WaitFd> {
        let epoll = new_epoll()?;
        let event = new_eventfd()?;
        use std::os::fd::AsFd;
        epoll_add(&epoll, event.as_fd())?;
        Ok(WaitFd { epoll, event })
    }
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

    /// This notifier's descriptor (made on first use; an epoll set): readable once a
    /// notification came after [`arm_fd`](Notifier::arm_fd), or a watched descriptor became
    /// readable. `None` when the system has no epoll or eventfd to give.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        if let Some(f) = self.fd.get() {
            return Some(f.epoll.as_fd());
        }
        // A racing creator's descriptors are dropped.
        let _ = self.fd.set(WaitFd::new().ok()?);
        self.fd.get().map(|f| f.epoll.as_fd())
    }

    /// Adds `fd` to the descriptor of this notifier (if it has made one) and of every notifier
    /// it forwards to: they become readable when `fd` is. A sleep hook empties `fd` in
    /// [`before_fd_sleep`](SleepHook::before_fd_sleep). The set forgets `fd` when it is closed.
    pub(crate) fn watch(&self, fd: std::os::fd::BorrowedFd<'_>) {
        if let Some(w) = self.fd.get() {
            if let Err(e) = epoll_add(&w.epoll, fd) {
                tracing::debug!(error = %e, "notifier: cannot watch a descriptor");
            }
        }
        for t in &self.forward {
            t.watch(fd);
        }
    }

    /// Prepares the eventfd for a program about to block on it (libfabric's `fi_trywait`):
    /// empties it, arms it to be written at the next notification, and tells the sleep hooks
    /// (devices hand their progress to their threads). True when the generation moved past
    /// `seen` meanwhile: something happened, poll again instead of blocking.
    #[allow(unsafe_code)]
    pub fn arm_fd(&self, seen: u64) -> bool {
        use std::os::fd::AsRawFd;
        if self.fd().is_none() {
            return true;
        }
        let Some(fd) = self.fd.get().map(|f| f.event.as_raw_fd()) else {
            return true;
        };
        let mut v = 0u64;
        // SAFETY: an 8-byte read from our non-blocking eventfd (EAGAIN when already empty).
        unsafe { libc::read(fd, (&raw mut v).cast(), 8) };
        if self.generation() != seen {
            return true;
        }
        if self.before_fd_sleep() {
            return true;
        }
        self.fd_armed.store(true, Ordering::SeqCst);
        self.generation() != seen
    }

    /// The hooks' [`before_fd_sleep`](SleepHook::before_fd_sleep): true when one found
    /// something ready.
    fn before_fd_sleep(&self) -> bool {
        let hooks: Vec<_> = {
            let h = self.hooks.lock();
            if h.is_empty() {
                return false;
            }
            h.iter().filter_map(Weak::upgrade).collect()
        };
        let mut ready = false;
        for h in hooks {
            ready |= h.before_fd_sleep();
        }
        ready
    }

    fn signal_fd(&self) {
        if let Some(f) = self.fd.get() {
            signal_eventfd(&f.event);
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

/// A new close-on-exec epoll set.
#[allow(unsafe_code)]
fn new_epoll() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: epoll_create1 with a valid flag.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) })
}

/// Adds `fd` to the epoll set `epoll`, level-triggered for reading.
#[allow(unsafe_code)]
fn epoll_add(epoll: &std::os::fd::OwnedFd, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: fd.as_raw_fd() as u64,
    };
    // SAFETY: both descriptors are live; the event is a valid local.
    let r = unsafe {
        libc::epoll_ctl(
            epoll.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            &mut ev,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the eventfd `fd` readable (adds 1 to its counter).
#[allow(unsafe_code)]
pub(crate) fn signal_eventfd(fd: &impl std::os::fd::AsRawFd) {
    let one = 1u64;
    // SAFETY: an 8-byte write of a live u64 to an eventfd.
    unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
}
