//! The topology's value types: PCI bus ids, NUMA nodes, CPU lists, device classes, distances.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, ErrorKind, Result};

/// A PCI function's bus id, `dddd:bb:dd.f` (domain, bus, device, function), as sysfs and
/// `lspci -D` print it.
///
/// ```
/// use efa::topo::PciAddr;
/// let a: PciAddr = "0000:4f:00.1".parse()?;
/// assert_eq!((a.domain(), a.bus(), a.device(), a.function()), (0, 0x4f, 0, 1));
/// assert_eq!(a.to_string(), "0000:4f:00.1");
/// assert_eq!("4f:00.1".parse::<PciAddr>()?, a); // domain 0 when left out
/// assert!("0000:4f:20.0".parse::<PciAddr>().is_err()); // devices are 0..=0x1f
/// # Ok::<(), efa::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddr {
    domain: u32,
    bus: u8,
    device: u8,
    function: u8,
}

impl PciAddr {
    /// The bus id `domain:bus:device.function`; `None` when the device is above 0x1f or the
    /// function above 7.
    pub fn new(domain: u32, bus: u8, device: u8, function: u8) -> Option<PciAddr> {
        (device < 32 && function < 8).then_some(PciAddr {
            domain,
            bus,
            device,
            function,
        })
    }

    /// PCI domain (segment).
    pub fn domain(self) -> u32 {
        self.domain
    }

    /// Bus number.
    pub fn bus(self) -> u8 {
        self.bus
    }

    /// Device number (0..=0x1f).
    pub fn device(self) -> u8 {
        self.device
    }

    /// Function number (0..=7).
    pub fn function(self) -> u8 {
        self.function
    }
}

impl fmt::Display for PciAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl FromStr for PciAddr {
    type Err = Error;

    /// `dddd:bb:dd.f` (hexadecimal; the domain may be longer, as VMD domains are) or `bb:dd.f`.
    fn from_str(s: &str) -> Result<PciAddr> {
        let bad = || {
            Error::new(ErrorKind::InvalidArgument, "PciAddr::from_str")
                .with_detail(format!("{s:?} is not a PCI bus id (dddd:bb:dd.f)"))
        };
        let hex = |t: &str, max_len: usize| -> Result<u32> {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(t, 16).map_err(|_| bad())
        };
        let (rest, func) = s.trim().rsplit_once('.').ok_or_else(bad)?;
        let mut parts: Vec<&str> = rest.split(':').collect();
        let domain = match parts.len() {
            3 => hex(parts.remove(0), 8)?,
            2 => 0,
            _ => return Err(bad()),
        };
        let bus = hex(parts[0], 2)? as u8;
        let dev = hex(parts[1], 2)? as u8;
        let func = hex(func, 1)? as u8;
        PciAddr::new(domain, bus, dev, func).ok_or_else(bad)
    }
}

impl serde::Serialize for PciAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PciAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<PciAddr, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A NUMA node, numbered as Linux numbers them.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct NumaNode(pub u32);

impl fmt::Display for NumaNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A set of CPUs (as Linux numbers them), sorted; parsed from and printed as a Linux CPU list.
///
/// ```
/// use efa::topo::CpuList;
/// let c: CpuList = "0-3,8,10-11\n".parse()?;
/// assert_eq!(c.cpus(), &[0, 1, 2, 3, 8, 10, 11]);
/// assert_eq!(c.to_string(), "0-3,8,10-11");
/// assert!("1-x".parse::<CpuList>().is_err());
/// # Ok::<(), efa::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuList(Vec<usize>);

/// More CPUs than any machine has: a range beyond it is garbage.
const MAX_CPUS: usize = 1 << 16;

impl CpuList {
    /// The CPUs, ascending.
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }

    /// True when it holds no CPU.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The list of these CPUs (sorted, duplicates removed).
    pub fn from_cpus(cpus: impl IntoIterator<Item = usize>) -> CpuList {
        let mut v: Vec<usize> = cpus.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        CpuList(v)
    }
}

impl FromStr for CpuList {
    type Err = Error;

    /// `0-3,8,10-11` (whitespace around it ignored; empty is no CPU).
    fn from_str(s: &str) -> Result<CpuList> {
        let bad = |why: &str| {
            Error::new(ErrorKind::InvalidArgument, "CpuList::from_str")
                .with_detail(format!("{s:?}: {why}"))
        };
        let num = |t: &str| -> Result<usize> {
            t.trim()
                .parse::<usize>()
                .ok()
                .filter(|c| *c < MAX_CPUS)
                .ok_or_else(|| bad("not a CPU number"))
        };
        let mut v = Vec::new();
        for part in s.trim().split(',').filter(|p| !p.trim().is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (num(a)?, num(b)?);
                    if a > b {
                        return Err(bad("a range that runs backwards"));
                    }
                    v.extend(a..=b);
                }
                None => v.push(num(part)?),
            }
        }
        Ok(CpuList::from_cpus(v))
    }
}

impl fmt::Display for CpuList {
    /// Ranges as Linux prints them (`0-3,8,10-11`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut i = 0;
        let v = &self.0;
        while i < v.len() {
            let mut j = i;
            while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
                j += 1;
            }
            if i > 0 {
                f.write_str(",")?;
            }
            if j > i {
                write!(f, "{}-{}", v[i], v[j])?;
            } else {
                write!(f, "{}", v[i])?;
            }
            i = j + 1;
        }
        Ok(())
    }
}

impl serde::Serialize for CpuList {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// What a [`PciDevice`](super::PciDevice) is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
pub enum DeviceClass {
    /// An RDMA NIC (listed under `class/infiniband`).
    Nic,
    /// A GPU: PCI class 0x0300 (VGA-compatible) or 0x0302 (3D controller).
    Gpu,
    /// An accelerator: PCI class 0x1200 (processing accelerator, such as AWS Neuron devices)
    /// or 0x0b40 (co-processor).
    Accelerator,
    /// Any other PCI function.
    Other,
}

impl DeviceClass {
    /// The class of a PCI class code (`class` in sysfs: `0x030200`).
    pub fn of_code(code: u32) -> DeviceClass {
        match code >> 8 {
            0x0300 | 0x0302 => DeviceClass::Gpu,
            0x1200 | 0x0b40 => DeviceClass::Accelerator,
            _ => DeviceClass::Other,
        }
    }

    /// `NIC`, `GPU`, `ACC` or `PCI`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceClass::Nic => "NIC",
            DeviceClass::Gpu => "GPU",
            DeviceClass::Accelerator => "ACC",
            DeviceClass::Other => "PCI",
        }
    }
}

impl fmt::Display for DeviceClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How far apart two devices are, nearest first, as NCCL and `nvidia-smi topo -m` classify
/// the path between them.
///
/// ```
/// use efa::topo::Distance;
/// assert!(Distance::Pix < Distance::Pxb && Distance::Phb < Distance::Node);
/// assert_eq!(Distance::Node.to_string(), "NODE");
/// assert_eq!("sys".parse::<Distance>()?, Distance::Sys);
/// # Ok::<(), efa::Error>(())
/// ```
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum Distance {
    /// Under one PCI switch (or bridge): the path crosses at most that switch.
    Pix,
    /// Under several PCI switches below a common one, not through the root complex.
    Pxb,
    /// Through their common PCI host bridge (root complex).
    Phb,
    /// Across root complexes of one NUMA node.
    Node,
    /// Across NUMA nodes (the interconnect between sockets).
    Sys,
}

impl Distance {
    /// `PIX`, `PXB`, `PHB`, `NODE` or `SYS`.
    pub fn as_str(self) -> &'static str {
        match self {
            Distance::Pix => "PIX",
            Distance::Pxb => "PXB",
            Distance::Phb => "PHB",
            Distance::Node => "NODE",
            Distance::Sys => "SYS",
        }
    }

    /// Every distance, nearest first.
    pub const ALL: [Distance; 5] = [
        Distance::Pix,
        Distance::Pxb,
        Distance::Phb,
        Distance::Node,
        Distance::Sys,
    ];
}

impl fmt::Display for Distance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl FromStr for Distance {
    type Err = Error;

    /// `PIX`, `PXB`, `PHB`, `NODE` or `SYS`, case-insensitive.
    fn from_str(s: &str) -> Result<Distance> {
        Distance::ALL
            .into_iter()
            .find(|d| d.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                Error::new(ErrorKind::InvalidArgument, "Distance::from_str")
                    .with_detail(format!("{s:?}: expected PIX, PXB, PHB, NODE or SYS"))
            })
    }
}
