//! The device registry: every device kind this build offers, in `getinfo`'s listing order (NICs
//! first), each declared by its own module as a [`Provider`]. `getinfo` iterates it; adding a
//! device is a folder under `src/device/` with its `PROVIDER`, one line in [`PROVIDERS`] and a
//! [`DeviceKind`] variant (docs/architecture.md, "Where to find").

use std::net::IpAddr;
use std::sync::Arc;

use crate::config::Config;
use crate::device::spec::DeviceSpec;
use crate::device::{Device, DeviceKind};
use crate::error::Error;

/// What `getinfo` asks a provider for.
pub(crate) struct Query<'a> {
    /// The address to bind a device that takes one (udp), from the hints or loopback.
    pub bind: IpAddr,
    /// The configuration `getinfo` runs with.
    #[cfg_attr(
        not(feature = "efa"),
        allow(dead_code, reason = "the efa provider reads it")
    )]
    pub config: &'a Config,
}

/// A provider's answer.
#[cfg_attr(
    not(feature = "efa"),
    allow(
        dead_code,
        reason = "only the efa provider finds nothing or fails for good"
    )
)]
pub(crate) enum Discovery {
    /// The devices found, opened, each with the spec that opens it again.
    Found(Vec<(DeviceSpec, Arc<dyn Device>)>),
    /// None: why, for `getinfo`'s `NoData` error if nothing else is found.
    Nothing(&'static str),
    /// The device could not be opened: skipped with a warning (the first such error is
    /// `getinfo`'s if nothing else is found).
    Unavailable(Error),
    /// A configuration error (say `FI_EFA_USE_DEVICE_RDMA=1` without RDMA): `getinfo` fails, as
    /// libfabric's does.
    Fatal(Error),
}

/// One device kind: its identity and how its devices are found.
pub(crate) struct Provider {
    pub kind: DeviceKind,
    pub discover: fn(&Query<'_>) -> Discovery,
}

/// Every device kind of this build, in listing order.
pub(crate) const PROVIDERS: &[Provider] = &[
    #[cfg(feature = "efa")]
    crate::device::efa::PROVIDER,
    crate::device::udp::PROVIDER,
    #[cfg(target_os = "linux")]
    crate::device::shm::PROVIDER,
    crate::device::loopback::PROVIDER,
];

/// The provider of `kind`, if this build has it.
pub(crate) fn provider(kind: DeviceKind) -> Option<&'static Provider> {
    PROVIDERS.iter().find(|p| p.kind == kind)
}

/// A software device's discovery: the one device `spec` opens.
pub(crate) fn open_one(spec: DeviceSpec) -> Discovery {
    match spec.open() {
        Ok(d) => Discovery::Found(vec![(spec, d)]),
        Err(e) => Discovery::Unavailable(e),
    }
}
