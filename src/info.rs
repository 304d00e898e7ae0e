//! Discovery (placeholder being written).
use std::sync::Arc;

use crate::config::Config;
use crate::device::{Device, DeviceKind};
use crate::error::{Error, ErrorKind, Result};

/// Endpoint type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum EpType {
    /// Reliable datagram.
    Rdm,
    /// Datagram.
    Dgram,
}

/// Capabilities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Caps(pub u64);

/// Hints.
#[derive(Clone, Debug, Default)]
pub struct Hints {
    provider: Option<String>,
    ep_type: Option<EpType>,
}

impl Hints {
    /// No constraints.
    pub fn new() -> Hints {
        Hints::default()
    }
    /// Only this provider.
    pub fn provider(mut self, p: &str) -> Hints {
        self.provider = Some(p.to_string());
        self
    }
    /// Only this endpoint type.
    pub fn ep_type(mut self, t: EpType) -> Hints {
        self.ep_type = Some(t);
        self
    }
}

/// One usable (device, endpoint type).
#[derive(Clone, Debug)]
pub struct Info {
    /// Provider.
    pub provider: DeviceKind,
    /// Endpoint type.
    pub ep_type: EpType,
    /// Configuration.
    pub config: Config,
}

impl Info {
    /// Opens the device.
    pub fn open_device(&self) -> Result<Arc<dyn Device>> {
        match self.provider {
            DeviceKind::Loopback => Ok(crate::device::loopback::LoopbackDevice::open(
                &crate::device::loopback::LoopbackNetwork::global(),
                crate::device::loopback::LoopbackConfig::default(),
            )?),
            DeviceKind::Udp => Ok(crate::device::udp::UdpDevice::open(
                crate::device::udp::UdpConfig::default(),
            )?),
            _ => Err(Error::new(ErrorKind::NoData, "open_device")),
        }
    }
}

/// Discovery.
pub fn getinfo(hints: &Hints) -> Result<Vec<Info>> {
    let mut v = Vec::new();
    for p in [DeviceKind::Udp, DeviceKind::Loopback] {
        for t in [EpType::Rdm, EpType::Dgram] {
            if hints.provider.as_deref().is_some_and(|x| x != p.name())
                || hints.ep_type.is_some_and(|x| x != t)
            {
                continue;
            }
            v.push(Info {
                provider: p,
                ep_type: t,
                config: Config::default(),
            });
        }
    }
    if v.is_empty() {
        return Err(Error::new(ErrorKind::NoData, "getinfo"));
    }
    Ok(v)
}
