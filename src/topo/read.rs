//! Reading the sysfs tree: NICs, GPU-class functions, NUMA nodes, and one PCI function's files.

use std::io;
use std::path::{Path, PathBuf};

use super::{CpuList, DeviceClass, NumaNode, PciAddr, PciDevice};
use crate::error::{Error, ErrorKind, Result};

const OP: &str = "topology";

/// A broken tree: an I/O error at `path`.
fn io_err(path: &Path, e: io::Error) -> Error {
    let detail = format!("{}: {e}", path.display());
    Error::io(OP, e).with_detail(detail)
}

/// A broken tree: `path` holds something that is not what sysfs writes there.
fn garbage(path: &Path, what: &str, text: &str) -> Error {
    Error::new(ErrorKind::Io, OP).with_detail(format!(
        "{}: {what}, found {:?}",
        path.display(),
        text.trim()
    ))
}

/// The entries of directory `dir`, sorted by name; none when it does not exist.
fn entries(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir, e)),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| io_err(dir, e))?;
        out.push((e.file_name().to_string_lossy().into_owned(), e.path()));
    }
    out.sort();
    Ok(out)
}

/// The contents of file `path`; `None` when it does not exist.
fn optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path, e)),
    }
}

/// A hexadecimal sysfs number (`0x1d0f`) in file `path`, if the file exists.
fn hex_file(path: &Path) -> Result<Option<u32>> {
    let Some(s) = optional(path)? else {
        return Ok(None);
    };
    let t = s.trim();
    let digits = t.strip_prefix("0x").unwrap_or(t);
    u32::from_str_radix(digits, 16)
        .map(Some)
        .map_err(|_| garbage(path, "expected a hexadecimal number", &s))
}

/// Every RDMA device under `<root>/class/infiniband` that is a PCI function, as a NIC, in bus
/// id order (then by name). A device without a `device` link is not a PCI function (a software
/// RDMA device) and is left out.
pub(super) fn nics(root: &Path) -> Result<Vec<PciDevice>> {
    let mut out = Vec::new();
    for (name, path) in entries(&root.join("class/infiniband"))? {
        let link = path.join("device");
        match std::fs::symlink_metadata(&link) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&link, e)),
            Ok(_) => {}
        }
        if let Some(mut d) = function(root, &link)? {
            d.class = DeviceClass::Nic;
            d.name = Some(name);
            out.push(d);
        }
    }
    out.sort_by(|a, b| (a.addr, &a.name).cmp(&(b.addr, &b.name)));
    Ok(out)
}

/// Every GPU-class function under `<root>/bus/pci/devices`, in bus id order.
pub(super) fn gpus(root: &Path) -> Result<Vec<PciDevice>> {
    let mut out = Vec::new();
    for (_, path) in entries(&root.join("bus/pci/devices"))? {
        let Some(mut d) = function(root, &path)? else {
            continue;
        };
        d.class = d
            .class_code
            .map_or(DeviceClass::Other, DeviceClass::of_code);
        // A BMC's display adapter (ASPEED, Matrox) on a bare-metal host is no GPU.
        let bmc = matches!(d.vendor, Some(0x1a03 | 0x102b));
        if matches!(d.class, DeviceClass::Gpu | DeviceClass::Accelerator) && !bmc {
            out.push(d);
        }
    }
    out.sort_by_key(|d| d.addr);
    Ok(out)
}

/// The NUMA nodes under `<root>/devices/system/node` (`node<N>/cpulist`), by number.
pub(super) fn nodes(root: &Path) -> Result<Vec<(NumaNode, CpuList)>> {
    let mut out = Vec::new();
    for (name, path) in entries(&root.join("devices/system/node"))? {
        let Some(n) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let file = path.join("cpulist");
        let cpus = match optional(&file)? {
            Some(s) => s
                .parse::<CpuList>()
                .map_err(|_| garbage(&file, "expected a CPU list", &s))?,
            None => CpuList::default(),
        };
        out.push((NumaNode(n), cpus));
    }
    out.sort_by_key(|(n, _)| *n);
    Ok(out)
}

/// The PCI function `link` resolves to (a `device` link, or an entry of `bus/pci/devices`);
/// `None` when it is not a PCI function (a platform or virtual device). Errors: a dangling
/// link, a link out of `<root>/devices`, unreadable or unparsable files.
pub(super) fn function(root: &Path, link: &Path) -> Result<Option<PciDevice>> {
    let real = std::fs::canonicalize(link).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            let to = std::fs::read_link(link)
                .map(|t| format!(" (to {})", t.display()))
                .unwrap_or_default();
            Error::io(OP, e).with_detail(format!("{}: dangling link{to}", link.display()))
        } else {
            io_err(link, e)
        }
    })?;
    let devices = root.join("devices");
    let devices = std::fs::canonicalize(&devices).map_err(|e| io_err(&devices, e))?;
    let rel = real.strip_prefix(&devices).map_err(|_| {
        Error::new(ErrorKind::Io, OP).with_detail(format!(
            "{}: resolves to {}, outside {}",
            link.display(),
            real.display(),
            devices.display()
        ))
    })?;
    let comps: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let Some((rc, below)) = comps.split_first() else {
        return Ok(None);
    };
    if !rc.starts_with("pci") {
        return Ok(None);
    }
    // A host bridge inside the tree (an Intel VMD domain, `pci10000:e0`) is a step of the path
    // with no bus id of its own.
    let Ok(chain) = below
        .iter()
        .filter(|c| !c.starts_with("pci"))
        .map(|c| c.parse::<PciAddr>())
        .collect::<Result<Vec<PciAddr>>>()
    else {
        return Ok(None);
    };
    let Some((&addr, bridges)) = chain.split_last() else {
        return Ok(None);
    };

    let file = |name: &str| real.join(name);
    let numa = match optional(&file("numa_node"))? {
        None => None,
        Some(s) => match s.trim().parse::<i64>() {
            Ok(n) if n < 0 => None,
            Ok(n) => Some(NumaNode(u32::try_from(n).map_err(|_| {
                garbage(&file("numa_node"), "expected a NUMA node number", &s)
            })?)),
            Err(_) => {
                return Err(garbage(
                    &file("numa_node"),
                    "expected a NUMA node number or -1",
                    &s,
                ));
            }
        },
    };
    let cpus = match optional(&file("local_cpulist"))? {
        None => None,
        Some(s) => Some(
            s.parse::<CpuList>()
                .map_err(|_| garbage(&file("local_cpulist"), "expected a CPU list", &s))?,
        ),
    };
    let id16 = |name: &str| -> Result<Option<u16>> {
        match hex_file(&file(name))? {
            Some(v) => u16::try_from(v)
                .map(Some)
                .map_err(|_| garbage(&file(name), "expected a 16-bit id", &format!("{v:#x}"))),
            None => Ok(None),
        }
    };
    let driver = match std::fs::read_link(file("driver")) {
        Ok(t) => t.file_name().map(|f| f.to_string_lossy().into_owned()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_err(&file("driver"), e)),
    };
    Ok(Some(PciDevice {
        class: DeviceClass::Other,
        name: None,
        addr,
        root_complex: rc.clone(),
        bridges: bridges.to_vec(),
        numa,
        cpus,
        vendor: id16("vendor")?,
        device: id16("device")?,
        class_code: hex_file(&file("class"))?,
        driver,
    }))
}
