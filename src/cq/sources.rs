//! The endpoints a completion queue or a counter drives when it is polled or waited on.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::ProgressSource;

/// The endpoints a completion queue or a counter drives, held weakly (neither keeps an endpoint
/// alive).
#[derive(Default)]
pub(crate) struct Sources(Mutex<Vec<Weak<dyn ProgressSource>>>);

impl Sources {
    /// Adds `source` (and forgets dropped ones).
    pub(crate) fn bind(&self, source: Weak<dyn ProgressSource>) {
        let mut s = self.0.lock();
        s.retain(|w| w.strong_count() > 0);
        s.push(source);
    }

    /// Calls `f` on every live source, outside the lock (driving one may bind or unbind). One
    /// source (the usual case) is taken alone; more stay on the stack up to a few: a busy poll
    /// allocates nothing.
    pub(crate) fn drive(&self, mut f: impl FnMut(&Arc<dyn ProgressSource>)) {
        const INLINE: usize = 4;
        let single = {
            let s = self.0.lock();
            match s.as_slice() {
                [] => return,
                [one] => Some(one.upgrade()),
                _ => None,
            }
        };
        if let Some(one) = single {
            if let Some(src) = one {
                f(&src);
            }
            return;
        }
        let mut first: [Option<Arc<dyn ProgressSource>>; INLINE] = Default::default();
        let mut rest = Vec::new();
        for (i, s) in self.0.lock().iter().filter_map(Weak::upgrade).enumerate() {
            match first.get_mut(i) {
                Some(slot) => *slot = Some(s),
                None => rest.push(s),
            }
        }
        for s in first.iter().flatten().chain(&rest) {
            f(s);
        }
    }
}
