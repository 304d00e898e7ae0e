//! Peers' accesses this side serves, counted for the endpoint's remote-write and remote-read
//! counters, and the HANDSHAKE choice that makes every such access reach the engine.

#[cfg(doc)]
use super::Engine;

/// Peers' RMA and atomics this side served since the last [`Engine::take_target_counts`]: what
/// an endpoint's remote-write and remote-read counters count (`FI_REMOTE_WRITE`,
/// `FI_REMOTE_READ`). An atomic that may change memory counts as a write, a read-only atomic as
/// a read; a request refused here (bad key or range, too much work) counts as an error.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TargetCounts {
    /// Writes (and atomics) placed in this side's memory.
    pub writes: u64,
    /// Reads (and read-only atomics) served from it.
    pub reads: u64,
    /// Writes (and atomics) refused.
    pub write_errors: u64,
    /// Reads refused.
    pub read_errors: u64,
}

impl TargetCounts {
    /// Nothing counted.
    pub fn is_empty(&self) -> bool {
        *self == TargetCounts::default()
    }

    /// Counts one write (`write`) or read, successful or refused.
    pub(crate) fn count(&mut self, write: bool, ok: bool) {
        let n = match (write, ok) {
            (true, true) => &mut self.writes,
            (false, true) => &mut self.reads,
            (true, false) => &mut self.write_errors,
            (false, false) => &mut self.read_errors,
        };
        *n += 1;
    }
}
