//! Shared-memory files, the core that the shm device (`device::shm`: segments and rings), the
//! same-host path (`local`: message channels) and the routing device's directory
//! (`device::route`) build on: bounds-checked mappings and futexes ([`map`]), the common file
//! header, owner liveness and ring reservation ([`file`]), and the directory ([`dir`]): every
//! kind of file's name and the sweep of stale ones.
//!
//! It is a leaf: it knows nothing of devices, endpoints or the engine.

pub(crate) mod dir;
pub(crate) mod file;
pub(crate) mod map;
#[cfg(loom)]
pub(crate) mod model;
pub(crate) mod sync;

/// The identity of this process's network namespace (`net:[4026531840]`), empty if unknown.
/// Addresses of software devices (IP and port) only mean the same thing inside one namespace.
pub fn netns() -> String {
    std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}
