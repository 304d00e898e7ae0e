//! [`Hints`]: what the application asks `getinfo` for.

use super::*;

// Hints
// ---------------------------------------------------------------------------------------------

/// What the application wants (`fi_getinfo` hints), built with chained calls.
///
/// ```
/// use efa::{Caps, EpType, Hints};
/// let hints = Hints::new()
///     .provider("udp")
///     .ep_type(EpType::Dgram)
///     .caps(Caps::MSG | Caps::SOURCE)
///     .addr("127.0.0.1".parse().unwrap());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Hints {
    pub(super) provider: Option<String>,
    pub(super) ep_type: Option<EpType>,
    pub(super) caps: Caps,
    pub(super) mode: Mode,
    pub(super) addr: Option<IpAddr>,
    pub(super) config: Option<Config>,
    pub(super) domain: Option<String>,
    pub(super) near: Option<Near>,
    pub(super) max_distance: Option<Distance>,
    pub(super) topology: Option<Arc<Topology>>,
}

builder_setters! {
    Hints {
        /// Only this endpoint type.
        ep_type: EpType => Some;
        /// Capabilities the application needs; entries lacking any of them are left out.
        caps: Caps;
        /// Modes the application supports. With [`Mode::MSG_PREFIX`], DGRAM entries ask for a
        /// [`DGRAM_MSG_PREFIX_SIZE`]-byte prefix in every buffer as libfabric's EFA does; without it
        /// (the default), they need none.
        mode: Mode;
        /// Local IP address the `udp` device binds (default `127.0.0.1`).
        addr: IpAddr => Some;
        /// Use this configuration instead of reading `FI_EFA_*` from the environment.
        config: Config => Some;
        /// Order the NICs by their distance from the target given (a GPU's PCI bus id, or a NUMA node),
        /// nearest first, as [`Topology::nics_near`] ranks them; each listed NIC's
        /// [`Info::distance`] says how far it is. Devices without a PCI location (`udp`, `shm`,
        /// `loopback`) keep their order after the NICs, with no distance. The topology is read
        /// from sysfs ([`Topology::detect`]) unless [`Hints::topology`] gives one; a target it
        /// does not have is a `NoData` error.
        ///
        /// ```no_run
        /// use efa::topo::Near;
        /// let gpu = "0000:53:00.0".parse()?;
        /// let infos = efa::getinfo(&efa::Hints::new().provider("efa").near(Near::Device(gpu)))?;
        /// let nearest = &infos[0]; // the NIC closest to that GPU
        /// # Ok::<(), efa::Error>(())
        /// ```
        near: Near => Some;
        /// With [`Hints::near`]: leave out NICs farther from the target than the distance given (only the
        /// NICs under the GPU's own PCI switch with [`Distance::Pix`]); devices without a PCI
        /// location are kept.
        max_distance: Distance => Some;
    }
}

impl Hints {
    /// No constraints: every device and endpoint type, configuration from the environment.
    pub fn new() -> Hints {
        Hints::default()
    }

    /// Only this provider (device kind): `efa`, `udp`, `shm` or `loopback` (case-insensitive).
    pub fn provider(mut self, name: &str) -> Hints {
        self.provider = Some(name.to_string());
        self
    }

    /// Only the device with this name (`udp-127.0.0.1`) or domain name (`udp-127.0.0.1-dgrm`),
    /// as `fi_info -d`.
    pub fn domain(mut self, name: &str) -> Hints {
        self.domain = Some(name.to_string());
        self
    }

    /// The host topology [`Hints::near`] ranks by, instead of reading sysfs.
    pub fn topology(mut self, topology: Topology) -> Hints {
        self.topology = Some(Arc::new(topology));
        self
    }

    /// Orders `out` by distance from [`Hints::near`]'s target (when set), filling in
    /// [`Info::distance`] and leaving out NICs beyond [`Hints::max_distance`].
    pub(super) fn rank(&self, out: &mut Vec<Info>) -> Result<()> {
        let Some(target) = &self.near else {
            return Ok(());
        };
        let detected;
        let topo = match &self.topology {
            Some(t) => &**t,
            None => {
                detected = Topology::detect()?;
                &detected
            }
        };
        // The target must exist (this also checks a NUMA node).
        topo.nics_near(target)?;
        for info in out.iter_mut() {
            let by_addr = info
                .device
                .pci_addr
                .as_deref()
                .and_then(|a| a.parse().ok())
                .and_then(|a| topo.nics().iter().find(|n| n.addr == a));
            let nic = by_addr.or_else(|| topo.nic(&info.device.name));
            info.distance = nic.and_then(|n| topo.distance(n, target));
        }
        if let Some(max) = self.max_distance {
            out.retain(|i| i.distance.is_none_or(|d| d <= max));
        }
        // Stable: equally far NICs, and the devices without a distance, keep their order.
        out.sort_by_key(|i| (i.distance.is_none(), i.distance));
        Ok(())
    }

    pub(super) fn describe(&self, config: &Config) -> String {
        let mut parts = Vec::new();
        if let Some(p) = &self.provider {
            parts.push(format!("provider {p}"));
        }
        if let Some(t) = self.ep_type {
            parts.push(format!("endpoint type {t}"));
        }
        if !self.caps.is_empty() {
            parts.push(format!("caps {}", self.caps));
        }
        if let Some(d) = &self.domain {
            parts.push(format!("domain {d}"));
        }
        if let (Some(n), Some(d)) = (&self.near, self.max_distance) {
            parts.push(format!("within {d} of {n}"));
        }
        if config.iface.trim() != "all" {
            parts.push(format!("FI_EFA_IFACE={}", config.iface));
        }
        if parts.is_empty() {
            "no device found".to_string()
        } else {
            format!("nothing matches {}", parts.join(", "))
        }
    }
}

// ---------------------------------------------------------------------------------------------
