//! Pinning an endpoint's progress thread to a CPU, near the NIC when its NUMA node is known.

use std::path::Path;

use crate::error::{Error, ErrorKind, Result};

/// Where an RDM endpoint's progress thread runs
/// ([`EndpointBuilder::progress_cpu`](crate::EndpointBuilder::progress_cpu)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ProgressCpu {
    /// Wherever the scheduler puts it (the default).
    #[default]
    Unpinned,
    /// On this CPU (as numbered by Linux).
    Cpu(usize),
    /// On the last CPU of the device's NUMA node (the first CPUs usually take the interrupts
    /// and the application's main thread); unpinned when the device has no NUMA node (software
    /// devices) or the node lists no CPU.
    NearDevice,
}

/// The CPUs of a NUMA node, from `/sys/devices/system/node/node<N>/cpulist` (`0-3,8-11`).
pub(crate) fn node_cpus(node: i32) -> Vec<usize> {
    let p = format!("/sys/devices/system/node/node{node}/cpulist");
    std::fs::read_to_string(Path::new(&p))
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default()
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

/// The CPU `choice` names for a device on `numa_node`, `None` for no pinning.
pub(crate) fn resolve(choice: ProgressCpu, numa_node: Option<i32>) -> Option<usize> {
    match choice {
        ProgressCpu::Unpinned => None,
        ProgressCpu::Cpu(c) => Some(c),
        ProgressCpu::NearDevice => {
            let cpus = numa_node.map(node_cpus).unwrap_or_default();
            if cpus.is_empty() {
                tracing::debug!(
                    ?numa_node,
                    "progress thread: no NUMA CPUs known, not pinned"
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

    #[test]
    fn choices() {
        assert_eq!(resolve(ProgressCpu::Unpinned, Some(0)), None);
        assert_eq!(resolve(ProgressCpu::Cpu(3), None), Some(3));
        assert_eq!(resolve(ProgressCpu::NearDevice, None), None);
        assert_eq!(resolve(ProgressCpu::NearDevice, Some(9999)), None);
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
