//! Progress: what the threads that drive the crate's work have in common (the RDM endpoint's
//! progress thread, the same-host path's waiter, the shm device's thread, the udp device's NIC
//! thread), and the pass clock of the code they drive.

use std::time::Instant;

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
