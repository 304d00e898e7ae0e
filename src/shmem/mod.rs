//! Shared-memory files, the core that the shm device (`device::shm`: segments and rings), the
//! same-host path (`local`: message channels) and the routing device's directory
//! (`device::route`) build on: bounds-checked mappings and futexes ([`map`]), the common file
//! header, owner liveness and ring reservation ([`file`]), and the names and sweep of the files
//! that belong to no single device.
//!
//! It is a leaf: it knows nothing of devices, endpoints or the engine.

pub(crate) mod file;
pub(crate) mod map;
#[cfg(loom)]
pub(crate) mod model;
pub(crate) mod sync;

use std::path::Path;

/// Name prefix of the same-host path's channel files (`efa-chan-<uid>-...`, see
/// `local::chan`).
pub(crate) const CHAN_PREFIX: &str = "efa-chan-";

/// The identity of this process's network namespace (`net:[4026531840]`), empty if unknown.
/// Addresses of software devices (IP and port) only mean the same thing inside one namespace.
pub fn netns() -> String {
    std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Removes user `uid`'s stale channel files from `dir`: channels whose lock is free (owner
/// gone) and temporary files of processes that no longer exist. Returns how many.
pub(crate) fn sweep_chans(dir: &Path, uid: u32) -> usize {
    map::sweep_dir(dir, &format!("{CHAN_PREFIX}{uid}-"), |path, rest| {
        map::remove_tmp_of_dead(path, rest).unwrap_or_else(|| map::remove_if_stale(path))
    })
}
