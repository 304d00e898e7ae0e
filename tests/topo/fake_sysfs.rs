//! Fake sysfs trees in a temporary directory, laid out as Linux lays out the real one: PCI
//! functions under `devices/pci<domain>:<bus>/<bridge>/.../<function>` with `numa_node`,
//! `local_cpulist`, `class`, `vendor`, `device` and a `driver` link; `bus/pci/devices/<addr>`
//! links to every function; `class/infiniband/<name>/device` links to each NIC's function;
//! `devices/system/node/node<N>/cpulist`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A fake tree, removed when dropped.
pub struct FakeSysfs {
    dir: tempfile::TempDir,
}

/// Where a device sits: its root complex, the bridges down to it, and its bus id.
#[derive(Clone, Debug)]
pub struct Place {
    pub rc: String,
    pub chain: Vec<String>,
}

impl Place {
    pub fn new(rc: &str, chain: &[String]) -> Place {
        Place {
            rc: rc.to_string(),
            chain: chain.to_vec(),
        }
    }

    /// The bus id of the device itself (the last of the chain).
    pub fn addr(&self) -> &str {
        self.chain.last().expect("a device")
    }
}

pub fn bdf(bus: u32, dev: u32) -> String {
    format!("0000:{bus:02x}:{dev:02x}.0")
}

impl FakeSysfs {
    pub fn new() -> FakeSysfs {
        FakeSysfs {
            dir: tempfile::Builder::new()
                .prefix("efa-topo-")
                .tempdir()
                .expect("a temporary directory"),
        }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    fn write(&self, path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    pub fn link(&self, target: &Path, link: &Path) {
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        let _ = std::fs::remove_file(link);
        std::os::unix::fs::symlink(target, link).unwrap();
    }

    /// The directory of a function at `place` (and of every bridge above it, each a PCI
    /// bridge of class 0x060400 listed in `bus/pci/devices`).
    pub fn function(&self, place: &Place, files: &[(&str, String)]) -> PathBuf {
        let mut dir = self.root().join("devices").join(&place.rc);
        for (i, a) in place.chain.iter().enumerate() {
            dir.push(a);
            std::fs::create_dir_all(&dir).unwrap();
            let link = self.root().join("bus/pci/devices").join(a);
            if std::fs::symlink_metadata(&link).is_err() {
                self.link(&dir, &link);
            }
            if i + 1 < place.chain.len() && !dir.join("class").exists() {
                self.write(&dir.join("class"), "0x060400\n");
                self.write(&dir.join("vendor"), "0x1000\n");
                self.write(&dir.join("device"), "0xc030\n");
            }
        }
        for (name, text) in files {
            self.write(&dir.join(name), text);
        }
        dir
    }

    fn placed(
        &self,
        place: &Place,
        (class, vendor, device): (u32, u16, u16),
        driver: &str,
        numa: i32,
        cpus: Option<&str>,
    ) -> PathBuf {
        let mut files = vec![
            ("class", format!("{class:#08x}\n")),
            ("vendor", format!("{vendor:#06x}\n")),
            ("device", format!("{device:#06x}\n")),
            ("numa_node", format!("{numa}\n")),
        ];
        if let Some(c) = cpus {
            files.push(("local_cpulist", format!("{c}\n")));
        }
        let dir = self.function(place, &files);
        self.link(
            &self.root().join("bus/pci/drivers").join(driver),
            &dir.join("driver"),
        );
        std::fs::create_dir_all(self.root().join("bus/pci/drivers").join(driver)).unwrap();
        dir
    }

    /// An EFA NIC named `name` at `place`.
    pub fn nic(&self, name: &str, place: &Place, numa: i32, cpus: Option<&str>) {
        let dir = self.placed(place, (0x020000, 0x1d0f, 0xefa1), "efa", numa, cpus);
        self.link(
            &dir,
            &self
                .root()
                .join("class/infiniband")
                .join(name)
                .join("device"),
        );
    }

    /// An NVIDIA H100 (3D controller) at `place`.
    pub fn gpu(&self, place: &Place, numa: i32, cpus: Option<&str>) {
        self.placed(place, (0x030200, 0x10de, 0x2330), "nvidia", numa, cpus);
    }

    /// A Neuron device (processing accelerator) at `place`.
    pub fn neuron(&self, place: &Place, numa: i32, cpus: Option<&str>) {
        self.placed(place, (0x120000, 0x1d0f, 0x7164), "neuron", numa, cpus);
    }

    /// Any other function (class `class`, vendor `vendor`) at `place`.
    pub fn other(&self, place: &Place, class: u32, vendor: u16) {
        self.placed(place, (class, vendor, 0x0001), "other", -1, None);
    }

    /// NUMA node `n` with CPUs `cpus`.
    pub fn node(&self, n: u32, cpus: &str) {
        self.write(
            &self
                .root()
                .join(format!("devices/system/node/node{n}/cpulist")),
            &format!("{cpus}\n"),
        );
    }
}

/// The CPUs of NUMA node `n` in the p5-like tree.
pub fn p5_cpus(n: u32) -> &'static str {
    if n == 0 {
        "0-47,96-143"
    } else {
        "48-95,144-191"
    }
}

/// A p5-like host: 2 NUMA nodes, 4 root complexes (2 per node), 2 PCI switches per root complex
/// (each under its own root port), and under each switch one H100 and 4 EFA NICs: 8 GPUs, 32
/// NICs. Switch `s` (0..8) holds GPU `s` and NICs `4s..4s+4`, all on NUMA node `s / 4`. NIC
/// names follow EFA's (`rdmap<bus>s0`, the bus in decimal), so name order differs from bus order.
pub fn p5() -> FakeSysfs {
    let t = FakeSysfs::new();
    t.node(0, p5_cpus(0));
    t.node(1, p5_cpus(1));
    for s in 0..8u32 {
        let r = s / 2;
        let rb = 0x20 + 0x30 * r;
        let ub = rb + 1 + 0x10 * (s % 2);
        let rc = format!("pci0000:{rb:02x}");
        let numa = (s / 4) as i32;
        let cpus = Some(p5_cpus(s / 4));
        let up = vec![bdf(rb, 1 + s % 2), bdf(ub, 0)];
        for k in 0..5u32 {
            let mut chain = up.clone();
            chain.push(bdf(ub + 1, k));
            chain.push(bdf(ub + 2 + k, 0));
            let place = Place::new(&rc, &chain);
            if k == 0 {
                t.gpu(&place, numa, cpus);
            } else {
                t.nic(&format!("rdmap{}s0", ub + 2 + k), &place, numa, cpus);
            }
        }
    }
    t
}

/// The bus id of p5-like GPU `g` and of its switch's NIC `k` (0..4).
pub fn p5_gpu(g: u32) -> String {
    bdf(0x20 + 0x30 * (g / 2) + 1 + 0x10 * (g % 2) + 2, 0)
}
pub fn p5_nic(g: u32, k: u32) -> String {
    bdf(0x20 + 0x30 * (g / 2) + 1 + 0x10 * (g % 2) + 3 + k, 0)
}

/// A trn1-like host: 2 NUMA nodes, one root complex each, a PCI switch under its root port and
/// below it two switches, each holding 4 Neuron devices and 2 EFA NICs: 16 accelerators, 8
/// NICs. NIC `2h + i` (h = half 0..4: node `h / 2`, lower switch `h % 2`) sits beside Neuron
/// devices `4h..4h+4`.
pub fn trn1() -> FakeSysfs {
    let t = FakeSysfs::new();
    t.node(0, "0-31,64-95");
    t.node(1, "32-63,96-127");
    let mut nic = 0;
    for node in 0..2u32 {
        let rb = 0x10 + 0x80 * node;
        let rc = format!("pci0000:{rb:02x}");
        let top = vec![bdf(rb, 1), bdf(rb + 1, 0)];
        let cpus = Some(if node == 0 {
            "0-31,64-95"
        } else {
            "32-63,96-127"
        });
        for half in 0..2u32 {
            let sb = rb + 3 + 0x20 * half;
            let mut sw = top.clone();
            sw.push(bdf(rb + 2, half));
            sw.push(bdf(sb, 0));
            for k in 0..6u32 {
                let mut chain = sw.clone();
                chain.push(bdf(sb + 1, k));
                chain.push(bdf(sb + 2 + k, 0));
                let place = Place::new(&rc, &chain);
                if k < 4 {
                    t.neuron(&place, node as i32, cpus);
                } else {
                    t.nic(&format!("rdmap{}s0", sb + 2 + k), &place, node as i32, cpus);
                    nic += 1;
                }
            }
        }
    }
    assert_eq!(nic, 8);
    t
}

/// A virtual machine without GPU: one EFA NIC and an ENA right on the root complex, no NUMA
/// information (`numa_node` -1, no `local_cpulist`, no node directory), a BMC-style VGA
/// adapter (ASPEED) and an NVMe drive, which are no GPUs.
pub fn no_gpu() -> FakeSysfs {
    let t = FakeSysfs::new();
    let rc = "pci0000:00";
    t.nic("efa_0", &Place::new(rc, &[bdf(0, 6)]), -1, None);
    t.other(&Place::new(rc, &[bdf(0, 5)]), 0x020000, 0x1d0f);
    t.other(&Place::new(rc, &[bdf(0, 2)]), 0x030000, 0x1a03);
    t.other(&Place::new(rc, &[bdf(0, 4)]), 0x010802, 0x1d0f);
    t
}
