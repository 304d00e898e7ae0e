//! The atomics of the lock-free shared-memory code: the standard library's, or, under
//! `--cfg loom`, the model checker's (as tokio and crossbeam do it). Only re-exports, so a normal
//! build runs exactly the code it would with `std::sync::atomic` named directly.
//!
//! Under loom, [`Mapping`](super::map::Mapping) is a model of the shared memory (ordinary
//! loom-visible atomics and cells instead of a file mapping), and the futex calls wait on a
//! model of the kernel's futex; see `shmem::model`.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, fence};
pub(crate) use std::sync::atomic::Ordering;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, fence};
