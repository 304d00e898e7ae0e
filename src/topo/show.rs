//! Printing a topology: the distance table (`nvidia-smi topo -m` style) and the PCI tree.

use std::collections::BTreeMap;
use std::fmt;

use super::{PciDevice, Topology};

/// Each of `devs` with its [`label`].
fn labelled(devs: &[PciDevice]) -> Vec<(String, &PciDevice)> {
    devs.iter()
        .enumerate()
        .map(|(i, d)| (label(d, i), d))
        .collect()
}

/// The label of GPU-class device `i` (`GPU0`, `ACC3`) or NIC `i` (`NIC0`).
fn label(d: &PciDevice, i: usize) -> String {
    format!("{}{i}", d.class)
}

fn opt<T: fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".to_string(), T::to_string)
}

/// The NICs × GPUs distance table of a [`Topology`], with each device's NUMA node and local
/// CPUs, and a legend; from [`Topology::matrix`].
///
/// ```text
///        GPU0  GPU1  NUMA  CPUs
/// GPU0      X  NODE  0     0-47
/// GPU1   NODE     X  0     0-47
/// NIC0    PIX  NODE  0     0-47
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a>(pub(super) &'a Topology);

impl fmt::Display for Matrix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0;
        let (gpus, nics) = (labelled(&t.gpus), labelled(&t.nics));
        let rows: Vec<&(String, &PciDevice)> = gpus.iter().chain(&nics).collect();
        if rows.is_empty() {
            return writeln!(f, "no NIC or GPU under {}", t.root.display());
        }
        let w = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(4).max(4) + 2;
        let col = gpus.iter().map(|(l, _)| l.len()).max().unwrap_or(4).max(4) + 2;
        write!(f, "{:w$}", "")?;
        for (l, _) in &gpus {
            write!(f, "{l:>col$}")?;
        }
        writeln!(f, "  NUMA  CPUs")?;
        for (l, d) in &rows {
            write!(f, "{l:w$}")?;
            for (_, g) in &gpus {
                if std::ptr::eq(*d, *g) {
                    write!(f, "{:>col$}", "X")?;
                } else {
                    write!(f, "{:>col$}", d.distance(g))?;
                }
            }
            writeln!(f, "  {:<4}  {}", opt(&d.numa), opt(&d.cpus))?;
        }
        writeln!(f)?;
        writeln!(f, "Devices:")?;
        for (l, d) in &rows {
            let what = match (&d.name, d.vendor, d.device) {
                (Some(n), _, _) => n.clone(),
                (None, Some(v), Some(id)) => format!("[{v:04x}:{id:04x}]"),
                _ => String::new(),
            };
            writeln!(f, "  {l:w$}{}  {what}", d.addr)?;
        }
        writeln!(f)?;
        writeln!(f, "Legend:")?;
        writeln!(f, "  X    = self")?;
        writeln!(
            f,
            "  SYS  = across NUMA nodes (the interconnect between sockets)"
        )?;
        writeln!(f, "  NODE = across PCIe host bridges within one NUMA node")?;
        writeln!(f, "  PHB  = through one PCIe host bridge (root complex)")?;
        writeln!(
            f,
            "  PXB  = through several PCIe switches, not the host bridge"
        )?;
        write!(f, "  PIX  = through at most one PCIe switch")?;
        writeln!(f)
    }
}

/// The PCI tree of a [`Topology`]'s devices, from each root complex down through its bridges,
/// with the NUMA nodes and their CPUs; from [`Topology::tree`].
#[derive(Clone, Copy, Debug)]
pub struct Tree<'a>(pub(super) &'a Topology);

impl fmt::Display for Tree<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0;
        writeln!(f, "sysfs: {}", t.root.display())?;
        for (n, cpus) in &t.nodes {
            writeln!(f, "NUMA node {n}: CPUs {cpus}")?;
        }
        // Every prefix of every device's path, in path order (a depth-first walk).
        let mut nodes: BTreeMap<Vec<String>, Option<String>> = BTreeMap::new();
        let labelled = t
            .gpus
            .iter()
            .enumerate()
            .chain(t.nics.iter().enumerate())
            .map(|(i, d)| (label(d, i), d));
        for (l, d) in labelled {
            let mut path = vec![d.root_complex.clone()];
            for b in &d.bridges {
                nodes.entry(path.clone()).or_insert(None);
                path.push(b.to_string());
            }
            nodes.entry(path.clone()).or_insert(None);
            path.push(d.addr.to_string());
            let mut text = l;
            if let Some(n) = &d.name {
                text.push_str(&format!(" {n}"));
            }
            if let (Some(v), Some(id)) = (d.vendor, d.device) {
                text.push_str(&format!(" [{v:04x}:{id:04x}]"));
            }
            if let Some(drv) = &d.driver {
                text.push_str(&format!(" driver {drv}"));
            }
            text.push_str(&format!(" NUMA {} CPUs {}", opt(&d.numa), opt(&d.cpus)));
            nodes.insert(path, Some(text));
        }
        for (path, text) in &nodes {
            let indent = 2 * (path.len() - 1);
            let name = path.last().map_or("", String::as_str);
            match text {
                Some(t) => writeln!(f, "{:indent$}{name}  {t}", "")?,
                None => writeln!(f, "{:indent$}{name}", "")?,
            }
        }
        Ok(())
    }
}
