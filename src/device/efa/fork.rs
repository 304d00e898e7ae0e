//! `fork()` and registered memory.
//!
//! Memory registered with an RDMA NIC is pinned. On Linux before 5.13 a child created by
//! `fork()` shares those pages copy-on-write with the parent, and the first write by either
//! moves the parent's copy away from the page the NIC uses: data silently goes to the wrong
//! place. rdma-core's `ibv_fork_init` avoids this (`madvise(MADV_DONTFORK)` on registered
//! ranges: the child does not get them at all) and must run before the first registration;
//! from 5.13 the kernel copies pinned pages at fork and nothing is needed
//! (`ibv_is_fork_initialized` says `IBV_FORK_UNNEEDED`).
//!
//! As libfabric's EFA provider: when the kernel does not make fork safe, fork support is turned
//! on if `FI_EFA_FORK_SAFE=1`, `RDMAV_FORK_SAFE` or `IBV_FORK_SAFE` asks for it; otherwise a
//! warning says that `fork()` after opening the device is unsafe. (libfabric also aborts a
//! child created by `fork()` in that state; this crate only warns.) With fork support on,
//! `MADV_DONTFORK` applies to whole pages, so the device's bounce pools are page-aligned
//! allocations rounded up to whole pages, sharing no page with other heap data.

use parking_lot::Mutex;

/// The process's fork support, as the device found it at open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkSupport {
    /// The kernel copies pinned pages at `fork()` (Linux 5.13+): nothing to do.
    Unneeded,
    /// `ibv_fork_init` ran: registered ranges are not inherited by children.
    Enabled,
    /// Neither: a child created by `fork()` while memory is registered may corrupt the
    /// parent's RDMA data.
    Disabled,
}

static STATUS: Mutex<Option<ForkSupport>> = Mutex::new(None);

/// Whether the environment asks for fork support (`RDMAV_FORK_SAFE`, `IBV_FORK_SAFE`, which
/// rdma-core itself reads, or `FI_EFA_FORK_SAFE` as `requested`).
fn asked(requested: bool) -> bool {
    requested
        || std::env::var_os("RDMAV_FORK_SAFE").is_some()
        || std::env::var_os("IBV_FORK_SAFE").is_some()
}

/// Finds (and, when asked and still possible, turns on) fork support; called when a device
/// opens, before it registers anything. `requested` is `FI_EFA_FORK_SAFE`.
pub fn prepare(requested: bool) -> ForkSupport {
    let mut st = STATUS.lock();
    if let Some(s) = *st {
        if s != ForkSupport::Disabled || !asked(requested) {
            return s;
        }
    }
    // SAFETY: plain calls into libibverbs with no arguments.
    let now = unsafe { rdma_sys::ibv_is_fork_initialized() };
    let s = match now {
        rdma_sys::IBV_FORK_UNNEEDED => ForkSupport::Unneeded,
        rdma_sys::IBV_FORK_ENABLED => ForkSupport::Enabled,
        _ if asked(requested) => {
            // SAFETY: as above; it fails (EINVAL) if memory was registered already.
            match unsafe { rdma_sys::ibv_fork_init() } {
                0 => ForkSupport::Enabled,
                e => {
                    tracing::warn!(
                        errno = e,
                        "efa: fork support was asked for (FI_EFA_FORK_SAFE / RDMAV_FORK_SAFE) but \
                         ibv_fork_init failed (memory was registered before the first device \
                         opened?); fork() while memory is registered is unsafe"
                    );
                    ForkSupport::Disabled
                }
            }
        }
        _ => {
            tracing::warn!(
                "efa: this kernel does not make registered memory safe across fork() (Linux \
                 5.13+ does) and fork support is off: a child created by fork() may corrupt \
                 RDMA data. Set FI_EFA_FORK_SAFE=1 (or RDMAV_FORK_SAFE=1) if the program forks"
            );
            ForkSupport::Disabled
        }
    };
    *st = Some(s);
    s
}

/// The fork support found so far (`None` before a device opened).
pub fn status() -> Option<ForkSupport> {
    *STATUS.lock()
}
