//! How to open one device ([`DeviceSpec`]): what an [`Info`](crate::Info) carries, and what each
//! device's provider (`device::registry`) hands `getinfo`.

use std::net::IpAddr;
use std::sync::Arc;

use crate::config::Config;
use crate::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
#[cfg(target_os = "linux")]
use crate::device::shm::{ShmConfig, ShmDevice};
use crate::device::udp::{UdpConfig, UdpDevice};
use crate::device::{Device, DeviceKind};
use crate::error::Result;

/// How to open the device an [`Info`](crate::Info) describes.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum DeviceSpec {
    /// A `udp` device with this configuration.
    Udp(UdpConfig),
    /// An `shm` device (processes on one host) with this configuration.
    #[cfg(target_os = "linux")]
    Shm(ShmConfig),
    /// A `loopback` device on [`LoopbackNetwork::global()`].
    Loopback(LoopbackConfig),
    /// An `efa` NIC (cargo feature `efa`).
    #[cfg(feature = "efa")]
    Efa {
        /// rdma-core device name, e.g. `rdmap0s6`.
        name: String,
        /// `FI_EFA_USE_DEVICE_RDMA` when it was discovered (decides the RDMA capabilities).
        use_device_rdma: Option<bool>,
    },
}

impl DeviceSpec {
    /// The kind of device this opens.
    pub fn kind(&self) -> DeviceKind {
        match self {
            DeviceSpec::Udp(_) => DeviceKind::Udp,
            #[cfg(target_os = "linux")]
            DeviceSpec::Shm(_) => DeviceKind::Shm,
            DeviceSpec::Loopback(_) => DeviceKind::Loopback,
            #[cfg(feature = "efa")]
            DeviceSpec::Efa { .. } => DeviceKind::Efa,
        }
    }

    /// Opens the device (cheap for software devices: no sockets until a queue pair is created;
    /// an `efa` NIC is opened and queried, and gets its protection domain).
    pub fn open(&self) -> Result<Arc<dyn Device>> {
        self.open_configured(&Config::from_env().unwrap_or_default())
    }

    /// [`DeviceSpec::open`] with `config` for what the device reads of it (`efa`: fork safety
    /// and huge pages); [`Info::open_device`](crate::Info::open_device) passes the `Info`'s configuration.
    #[cfg_attr(
        not(feature = "efa"),
        allow(unused_variables, reason = "the efa arm reads it")
    )]
    pub fn open_configured(&self, config: &Config) -> Result<Arc<dyn Device>> {
        Ok(match self {
            DeviceSpec::Udp(c) => UdpDevice::open(c.clone())?,
            #[cfg(target_os = "linux")]
            DeviceSpec::Shm(c) => ShmDevice::open(c.clone())?,
            DeviceSpec::Loopback(c) => LoopbackDevice::open(&LoopbackNetwork::global(), c.clone())?,
            #[cfg(feature = "efa")]
            DeviceSpec::Efa {
                name,
                use_device_rdma,
            } => crate::device::efa::EfaDevice::open_configured(name, *use_device_rdma, config)?,
        })
    }

    /// The spec of a `udp` device bound to `bind`.
    pub fn udp(bind: IpAddr) -> DeviceSpec {
        DeviceSpec::Udp(udp_config(bind))
    }

    /// The spec of an `shm` device with its default configuration (segments in `/dev/shm`).
    #[cfg(target_os = "linux")]
    pub fn shm() -> DeviceSpec {
        DeviceSpec::Shm(ShmConfig::default())
    }

    /// The spec of a `loopback` device with its default configuration.
    // The allow is for the device placeholder (a unit struct); harmless afterwards.
    pub fn loopback() -> DeviceSpec {
        DeviceSpec::Loopback(LoopbackConfig::default())
    }
}

/// A `UdpConfig` bound to `bind`.
fn udp_config(bind: IpAddr) -> UdpConfig {
    UdpConfig {
        bind,
        ..UdpConfig::default()
    }
}
