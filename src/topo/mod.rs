//! Host topology: the NICs and GPU-class devices of this host, where they sit in the PCI tree,
//! their NUMA nodes and local CPUs, and how far apart any two are, read from sysfs.
//!
//! A [`Topology`] lists every RDMA NIC (`<root>/class/infiniband/*`, through its `device` link
//! to the PCI function) and every GPU-class PCI function (`<root>/bus/pci/devices/*` of class
//! 0x0300 VGA or 0x0302 3D controller, and accelerators: 0x1200 processing accelerators such as
//! AWS Neuron devices and 0x0b40 co-processors, as hwloc counts them), each as a [`PciDevice`]:
//! bus id, the chain of bridges from its root complex, NUMA node and local CPUs. The root is
//! `SYSFS_PATH` (as libibverbs and the emulated NIC read it), else `/sys`;
//! [`Topology::from_root`] reads any other tree (tests build fake ones).
//!
//! [`PciDevice::distance`] classifies the path between two devices as NCCL and
//! `nvidia-smi topo -m` do ([`Distance`]: PIX < PXB < PHB < NODE < SYS), and
//! [`Topology::nics_near`] orders the NICs by their distance to a GPU or a NUMA node — what
//! [`Hints::near`](crate::Hints::near) asks of [`getinfo`](crate::getinfo).
//!
//! ```no_run
//! use efa::topo::{Near, Topology};
//!
//! let topo = Topology::detect()?;
//! if let Some(gpu) = topo.gpus().first() {
//!     for (nic, d) in topo.nics_near(&Near::Device(gpu.addr))? {
//!         println!("{} {} {d}", nic.name.as_deref().unwrap_or("?"), nic.addr);
//!     }
//! }
//! print!("{}", topo.matrix());
//! # Ok::<(), efa::Error>(())
//! ```

mod read;
mod show;
mod types;

use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

pub use show::{Matrix, Tree};
pub use types::{CpuList, DeviceClass, Distance, NumaNode, PciAddr};

/// The sysfs root: `SYSFS_PATH` when set and not empty (trailing `/` removed), else `/sys`.
pub fn sysfs_root() -> PathBuf {
    match std::env::var_os("SYSFS_PATH") {
        Some(p) if !p.is_empty() => {
            let s = p.to_string_lossy();
            let t = s.trim_end_matches('/');
            PathBuf::from(if t.is_empty() { "/" } else { t })
        }
        _ => PathBuf::from("/sys"),
    }
}

/// One PCI function of interest: a NIC or a GPU-class device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PciDevice {
    /// What it is.
    pub class: DeviceClass,
    /// The RDMA device name of a NIC (`rdmap79s0`, `efa_0`); `None` for other devices.
    pub name: Option<String>,
    /// Its PCI bus id.
    pub addr: PciAddr,
    /// Its root complex, as sysfs names it (`pci0000:00`).
    pub root_complex: String,
    /// The bridges between the root complex and the device, top first (root port, switch
    /// ports, ...); empty for a device right on the root complex.
    pub bridges: Vec<PciAddr>,
    /// The NUMA node it is attached to (`numa_node`; -1 is none).
    pub numa: Option<NumaNode>,
    /// Its local CPUs (`local_cpulist`), when sysfs gives them.
    pub cpus: Option<CpuList>,
    /// PCI vendor id.
    pub vendor: Option<u16>,
    /// PCI device id.
    pub device: Option<u16>,
    /// PCI class code (`0x030200`: 3D controller).
    pub class_code: Option<u32>,
    /// The kernel driver bound to it (`efa`, `nvidia`, `neuron`), when one is.
    pub driver: Option<String>,
}

impl PciDevice {
    /// Reads PCI function `addr` from the tree at `root` (`<root>/bus/pci/devices/<addr>`),
    /// classed by its class code (a function that is no GPU-class device is an
    /// [`DeviceClass::Other`]).
    pub fn read(root: &Path, addr: PciAddr) -> Result<PciDevice> {
        let link = root.join("bus/pci/devices").join(addr.to_string());
        if std::fs::symlink_metadata(&link).is_err() {
            return Err(
                Error::new(ErrorKind::NoData, "topology").with_detail(format!(
                    "no PCI function {addr} ({} is missing)",
                    link.display()
                )),
            );
        }
        let mut d = read::function(root, &link)?.ok_or_else(|| {
            Error::new(ErrorKind::NoData, "topology")
                .with_detail(format!("{} is not a PCI function", link.display()))
        })?;
        d.class = d
            .class_code
            .map_or(DeviceClass::Other, DeviceClass::of_code);
        Ok(d)
    }

    /// The path from the root complex down to the device:
    /// `pci0000:00/0000:00:01.0/0000:01:00.0`.
    pub fn pci_path(&self) -> String {
        let mut s = self.root_complex.clone();
        for b in self.bridges.iter().chain([&self.addr]) {
            s.push('/');
            s.push_str(&b.to_string());
        }
        s
    }

    /// How far `other` is, as NCCL classifies the path between two PCI devices: under one
    /// PCI switch (or bridge) [`Pix`](Distance::Pix); under several switches below a common
    /// one [`Pxb`](Distance::Pxb); through their common root complex
    /// [`Phb`](Distance::Phb); across root complexes of one NUMA node
    /// [`Node`](Distance::Node); on another NUMA node [`Sys`](Distance::Sys). A device is
    /// [`Pix`](Distance::Pix) from itself. Devices whose NUMA node is unknown are on one node
    /// together (a host without NUMA information) and on another node than any known one.
    pub fn distance(&self, other: &PciDevice) -> Distance {
        if self.addr == other.addr {
            return Distance::Pix;
        }
        if self.root_complex != other.root_complex {
            return if self.numa == other.numa {
                Distance::Node
            } else {
                Distance::Sys
            };
        }
        // Each side's chain from the root complex down to the device itself; below their
        // deepest common element each side passes at most one more bridge (its own port of
        // the common switch) when they are one switch apart. A bridge as a target is its own
        // chain's end.
        let chain = |d: &PciDevice| {
            d.bridges
                .iter()
                .chain([&d.addr])
                .copied()
                .collect::<Vec<_>>()
        };
        let (a, b) = (chain(self), chain(other));
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        if common == 0 {
            return Distance::Phb;
        }
        let below = |c: &[PciAddr]| c.len().saturating_sub(common + 1);
        if below(&a) <= 1 && below(&b) <= 1 {
            Distance::Pix
        } else {
            Distance::Pxb
        }
    }

    /// How far NUMA node `node`'s CPUs are: [`Phb`](Distance::Phb) (through the host bridge)
    /// when the device is on that node, else [`Sys`](Distance::Sys).
    pub fn distance_to_node(&self, node: NumaNode) -> Distance {
        if self.numa == Some(node) {
            Distance::Phb
        } else {
            Distance::Sys
        }
    }
}

/// What to choose NICs near: a PCI device (a GPU by bus id) or a NUMA node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum Near {
    /// The PCI function at this bus id (usually a GPU).
    Device(PciAddr),
    /// This NUMA node's CPUs.
    Node(NumaNode),
}

impl std::fmt::Display for Near {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Near::Device(a) => write!(f, "{a}"),
            Near::Node(n) => write!(f, "NUMA node {n}"),
        }
    }
}

impl std::str::FromStr for Near {
    type Err = Error;

    /// A PCI bus id (`0000:4f:00.0`, or `4f:00.0` in domain 0) or a NUMA node (`node1` or
    /// `numa1`).
    fn from_str(s: &str) -> Result<Near> {
        let t = s.trim();
        let node = t.strip_prefix("node").or_else(|| t.strip_prefix("numa"));
        match node {
            Some(n) => n
                .parse::<u32>()
                .map(|n| Near::Node(NumaNode(n)))
                .map_err(|_| {
                    Error::new(ErrorKind::InvalidArgument, "Near::from_str")
                        .with_detail(format!("{s:?}: expected nodeN"))
                }),
            None => t.parse().map(Near::Device),
        }
    }
}

/// A host's NICs and GPU-class devices, their NUMA nodes and CPUs; see the [module](self).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Topology {
    root: PathBuf,
    nics: Vec<PciDevice>,
    gpus: Vec<PciDevice>,
    nodes: Vec<(NumaNode, CpuList)>,
}

impl Topology {
    /// This host's topology, from [`sysfs_root`] (`SYSFS_PATH`, else `/sys`).
    pub fn detect() -> Result<Topology> {
        Topology::from_root(sysfs_root())
    }

    /// The topology of the sysfs tree at `root`.
    ///
    /// Missing parts are empty (no `class/infiniband`: no NIC; no `bus/pci/devices`: no GPU;
    /// no `devices/system/node`: no NUMA node), as are missing optional files (absent fields).
    /// A broken tree is an error naming the path: a dangling link, an unreadable file, a
    /// `numa_node`, `local_cpulist`, `class`, `vendor` or `device` that does not parse, a link
    /// out of the tree. NICs are in PCI bus id order (then by name), GPU-class devices in bus
    /// id order, NUMA nodes by number.
    pub fn from_root(root: impl AsRef<Path>) -> Result<Topology> {
        let root = root.as_ref().to_path_buf();
        let nics = read::nics(&root)?;
        let gpus = read::gpus(&root)?;
        let nodes = read::nodes(&root)?;
        Ok(Topology {
            root,
            nics,
            gpus,
            nodes,
        })
    }

    /// The sysfs root it was read from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The RDMA NICs that are PCI functions, in bus id order.
    pub fn nics(&self) -> &[PciDevice] {
        &self.nics
    }

    /// The GPU-class devices (GPUs and accelerators), in bus id order.
    pub fn gpus(&self) -> &[PciDevice] {
        &self.gpus
    }

    /// The NUMA nodes with their CPUs, by number.
    pub fn numa_nodes(&self) -> impl Iterator<Item = (NumaNode, &CpuList)> {
        self.nodes.iter().map(|(n, c)| (*n, c))
    }

    /// The CPUs of NUMA node `node`, if sysfs lists it.
    pub fn node_cpus(&self, node: NumaNode) -> Option<&CpuList> {
        self.nodes.iter().find(|(n, _)| *n == node).map(|(_, c)| c)
    }

    /// The NIC with RDMA device name `name`.
    pub fn nic(&self, name: &str) -> Option<&PciDevice> {
        self.nics.iter().find(|n| n.name.as_deref() == Some(name))
    }

    /// The NIC or GPU-class device at bus id `addr`.
    pub fn device(&self, addr: PciAddr) -> Option<&PciDevice> {
        self.nics.iter().chain(&self.gpus).find(|d| d.addr == addr)
    }

    /// How far NIC or device `dev` is from `target` (`None` when `target` names a PCI
    /// function this tree does not have).
    pub fn distance(&self, dev: &PciDevice, target: &Near) -> Option<Distance> {
        match target {
            Near::Node(n) => Some(dev.distance_to_node(*n)),
            Near::Device(a) => match self.device(*a) {
                Some(t) => Some(dev.distance(t)),
                None => PciDevice::read(&self.root, *a)
                    .ok()
                    .map(|t| dev.distance(&t)),
            },
        }
    }

    /// Every NIC with its distance from `target`, nearest first (NICs equally far in bus id
    /// order). An error (`NoData`) when `target` is a PCI function the tree does not have, or
    /// a NUMA node it does not list (when it lists any).
    pub fn nics_near(&self, target: &Near) -> Result<Vec<(&PciDevice, Distance)>> {
        let missing = |what: String| {
            Error::new(ErrorKind::NoData, "nics_near")
                .with_detail(format!("{what} not found under {}", self.root.display()))
        };
        let t = match target {
            Near::Node(n) => {
                if !self.nodes.is_empty() && self.node_cpus(*n).is_none() {
                    return Err(missing(format!("NUMA node {n}")));
                }
                None
            }
            Near::Device(a) => Some(match self.device(*a) {
                Some(d) => d.clone(),
                None => PciDevice::read(&self.root, *a)
                    .map_err(|e| missing(format!("PCI device {a} ({e})")))?,
            }),
        };
        let mut out: Vec<(&PciDevice, Distance)> = self
            .nics
            .iter()
            .map(|n| {
                let d = match (&t, target) {
                    (Some(t), _) => n.distance(t),
                    (None, Near::Node(node)) => n.distance_to_node(*node),
                    (None, Near::Device(_)) => Distance::Sys,
                };
                (n, d)
            })
            .collect();
        out.sort_by_key(|(_, d)| *d);
        Ok(out)
    }

    /// The NICs × GPUs distance table with NUMA nodes and CPUs, like `nvidia-smi topo -m`.
    pub fn matrix(&self) -> Matrix<'_> {
        Matrix(self)
    }

    /// The PCI tree of every NIC and GPU-class device, from the root complexes down.
    pub fn tree(&self) -> Tree<'_> {
        Tree(self)
    }
}
