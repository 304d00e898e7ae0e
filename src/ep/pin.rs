//! Pinning an endpoint's progress thread to a CPU, near the NIC: on its local CPUs when sysfs
//! lists them, else on its NUMA node's.

use crate::device::DeviceAttr;
use crate::error::{Error, ErrorKind, Result};
use crate::topo::{CpuList, NumaNode, PciDevice, sysfs_root};

/// Where an RDM endpoint's progress thread runs
/// ([`EndpointBuilder::progress_cpu`](crate::EndpointBuilder::progress_cpu)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ProgressCpu {
    /// Wherever the scheduler puts it (the default).
    #[default]
    Unpinned,
    /// On this CPU (as numbered by Linux).
    Cpu(usize),
    /// On the last of the NIC's local CPUs (`local_cpulist` of its PCI function), else of its
    /// NUMA node's CPUs (the first CPUs usually take the interrupts and the application's
    /// main thread); unpinned when the device has neither (software devices) or they list no
    /// CPU. sysfs is read under `SYSFS_PATH` when set ([`crate::topo::sysfs_root`]).
    NearDevice,
}

/// The CPUs of a NUMA node, from `<sysfs>/devices/system/node/node<N>/cpulist` (`0-3,8-11`).
pub(crate) fn node_cpus(node: i32) -> Vec<usize> {
    let p = sysfs_root().join(format!("devices/system/node/node{node}/cpulist"));
    std::fs::read_to_string(p)
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default()
}

/// The local CPUs of the device's PCI function, when sysfs lists them.
fn local_cpus(attr: &DeviceAttr) -> Option<CpuList> {
    let addr = attr.pci_addr.as_deref()?.parse().ok()?;
    match PciDevice::read(&sysfs_root(), addr) {
        Ok(d) => d.cpus.filter(|c| !c.is_empty()),
        Err(e) => {
            tracing::debug!(%addr, error = %e, "progress thread: no local CPUs of the NIC");
            None
        }
    }
}

/// The CPUs near the device: its local CPUs, else its NUMA node's.
pub(crate) fn device_cpus(attr: &DeviceAttr) -> Vec<usize> {
    if let Some(c) = local_cpus(attr) {
        return c.cpus().to_vec();
    }
    let node = attr
        .numa_node
        .and_then(|n| u32::try_from(n).ok())
        .map(NumaNode);
    node.map(|n| node_cpus(n.0 as i32)).unwrap_or_default()
}

/// Parses a Linux CPU list (`0-3,8,10-11`); malformed parts are skipped.
pub(crate) fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    if a <= b && b - a < 1 << 16 {
                        out.extend(a..=b);
                    }
                }
            }
            None => {
                if let Ok(c) = part.trim().parse() {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// The CPU `choice` names for device `attr`, `None` for no pinning.
pub(crate) fn resolve(choice: ProgressCpu, attr: &DeviceAttr) -> Option<usize> {
    match choice {
        ProgressCpu::Unpinned => None,
        ProgressCpu::Cpu(c) => Some(c),
        ProgressCpu::NearDevice => {
            let cpus = device_cpus(attr);
            if cpus.is_empty() {
                tracing::debug!(
                    pci = ?attr.pci_addr,
                    numa = ?attr.numa_node,
                    "progress thread: no local or NUMA CPUs known, not pinned"
                );
            }
            cpus.last().copied()
        }
    }
}

/// Pins the calling thread to `cpu`.
#[cfg(target_os = "linux")]
pub(crate) fn pin_current(cpu: usize) -> Result<()> {
    use nix::sched::{CpuSet, sched_setaffinity};
    use nix::unistd::Pid;
    let mut set = CpuSet::new();
    set.set(cpu).map_err(|e| {
        Error::new(ErrorKind::InvalidArgument, "progress_cpu")
            .with_detail(format!("CPU {cpu}: {e}"))
    })?;
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| {
        Error::new(ErrorKind::InvalidArgument, "progress_cpu")
            .with_detail(format!("cannot run on CPU {cpu}: {e}"))
    })
}

/// Pinning needs Linux.
#[cfg(not(target_os = "linux"))]
pub(crate) fn pin_current(_cpu: usize) -> Result<()> {
    Err(Error::new(ErrorKind::NotSupported, "progress_cpu"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
        assert_eq!(parse_cpulist("x,2,5-3,7"), vec![2, 7]);
    }

    fn attr(pci: Option<&str>, numa: Option<i32>) -> DeviceAttr {
        let mut a = DeviceAttr::software(
            crate::device::DeviceKind::Loopback,
            "t".into(),
            crate::addr::Gid::default(),
            1024,
            16,
            16,
        );
        a.pci_addr = pci.map(str::to_string);
        a.numa_node = numa;
        a
    }

    #[test]
    fn choices() {
        assert_eq!(resolve(ProgressCpu::Unpinned, &attr(None, Some(0))), None);
        assert_eq!(resolve(ProgressCpu::Cpu(3), &attr(None, None)), Some(3));
        assert_eq!(resolve(ProgressCpu::NearDevice, &attr(None, None)), None);
        assert_eq!(
            resolve(ProgressCpu::NearDevice, &attr(None, Some(9999))),
            None
        );
        // A PCI function sysfs does not have: the NUMA node decides (none here).
        assert_eq!(
            resolve(
                ProgressCpu::NearDevice,
                &attr(Some("ffff:ff:1f.7"), Some(9999))
            ),
            None
        );
    }

    #[test]
    fn pinning_to_an_impossible_cpu_is_refused() {
        let e = std::thread::spawn(|| pin_current(1 << 20)).join().unwrap();
        assert_eq!(e.unwrap_err().kind(), ErrorKind::InvalidArgument);
        std::thread::spawn(|| pin_current(0).unwrap())
            .join()
            .unwrap();
    }
}
