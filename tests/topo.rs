//! Host topology (`efa::topo`) on fake sysfs trees: a p5-like host (8 GPUs, 32 NICs), a
//! trn1-like host (16 Neuron devices, 8 NICs, nested switches), a host without GPU, and broken
//! trees, which are clear errors.

#[path = "topo/fake_sysfs.rs"]
mod fake_sysfs;

use efa::topo::{CpuList, DeviceClass, Distance, Near, NumaNode, PciAddr, PciDevice, Topology};
use efa::{ErrorKind, Hints, getinfo};
use fake_sysfs::{FakeSysfs, Place, bdf, p5_cpus, p5_gpu, p5_nic};

fn addr(s: &str) -> PciAddr {
    s.parse().unwrap()
}

fn names(v: &[(&PciDevice, Distance)]) -> Vec<String> {
    v.iter().map(|(d, _)| d.name.clone().unwrap()).collect()
}

#[test]
fn p5_like_host() {
    let t = fake_sysfs::p5();
    let topo = Topology::from_root(t.root()).unwrap();
    assert_eq!(topo.gpus().len(), 8);
    assert_eq!(topo.nics().len(), 32);
    assert!(topo.gpus().iter().all(|g| g.class == DeviceClass::Gpu));
    assert!(topo.nics().iter().all(|n| n.class == DeviceClass::Nic));
    // Bus id order.
    let bus: Vec<PciAddr> = topo.nics().iter().map(|n| n.addr).collect();
    let mut sorted = bus.clone();
    sorted.sort();
    assert_eq!(bus, sorted);
    assert_eq!(
        topo.gpus().iter().map(|g| g.addr).collect::<Vec<_>>(),
        (0..8).map(|g| addr(&p5_gpu(g))).collect::<Vec<_>>()
    );
    // Every field of one NIC.
    let nic = topo.nic("rdmap38s0").expect("rdmap38s0");
    assert_eq!(nic.addr, addr("0000:26:00.0"));
    assert_eq!(nic.addr, addr(&p5_nic(0, 2)));
    assert_eq!(nic.root_complex, "pci0000:20");
    assert_eq!(
        nic.bridges,
        vec![
            addr("0000:20:01.0"),
            addr("0000:21:00.0"),
            addr("0000:22:03.0")
        ]
    );
    assert_eq!(
        nic.pci_path(),
        "pci0000:20/0000:20:01.0/0000:21:00.0/0000:22:03.0/0000:26:00.0"
    );
    assert_eq!(nic.numa, Some(NumaNode(0)));
    assert_eq!(nic.cpus.as_ref().unwrap().to_string(), p5_cpus(0));
    assert_eq!((nic.vendor, nic.device), (Some(0x1d0f), Some(0xefa1)));
    assert_eq!(nic.driver.as_deref(), Some("efa"));
    assert_eq!(nic.class_code, Some(0x020000));
    assert_eq!(
        topo.numa_nodes().map(|(n, _)| n).collect::<Vec<_>>(),
        vec![NumaNode(0), NumaNode(1)]
    );
    assert_eq!(topo.node_cpus(NumaNode(1)).unwrap().cpus().len(), 96);

    // Distances from GPU 2 (switch 2: root complex 1, NUMA node 0).
    let g2 = topo.device(addr(&p5_gpu(2))).unwrap();
    let expect = |g: u32| match g {
        2 => Distance::Pix,
        3 => Distance::Phb,
        0 | 1 => Distance::Node,
        _ => Distance::Sys,
    };
    for g in 0..8 {
        for k in 0..4 {
            let n = topo.device(addr(&p5_nic(g, k))).unwrap();
            assert_eq!(g2.distance(n), expect(g), "GPU2 to NIC {k} of switch {g}");
            assert_eq!(n.distance(g2), expect(g), "symmetric");
        }
        let other = topo.device(addr(&p5_gpu(g))).unwrap();
        assert_eq!(g2.distance(other), expect(g), "GPU2 to GPU{g}");
    }

    // The NICs nearest GPU 2: its 4, then its root complex's, its node's, the other node's.
    let near = topo.nics_near(&Near::Device(g2.addr)).unwrap();
    assert_eq!(near.len(), 32);
    let ds: Vec<Distance> = near.iter().map(|(_, d)| *d).collect();
    let mut want = vec![Distance::Pix; 4];
    want.extend([Distance::Phb; 4]);
    want.extend([Distance::Node; 8]);
    want.extend([Distance::Sys; 16]);
    assert_eq!(ds, want);
    let first: Vec<PciAddr> = near[..4].iter().map(|(d, _)| d.addr).collect();
    assert_eq!(
        first,
        (0..4).map(|k| addr(&p5_nic(2, k))).collect::<Vec<_>>()
    );
    // Near NUMA node 1: its 16 NICs first (through the host bridge), in bus order.
    let near = topo.nics_near(&Near::Node(NumaNode(1))).unwrap();
    assert!(
        near[..16]
            .iter()
            .all(|(n, d)| n.numa == Some(NumaNode(1)) && *d == Distance::Phb)
    );
    assert!(near[16..].iter().all(|(_, d)| *d == Distance::Sys));
    // Unknown targets are errors, not guesses.
    let e = topo
        .nics_near(&Near::Device(addr("0000:ff:1f.7")))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoData, "{e}");
    assert!(e.to_string().contains("0000:ff:1f.7"), "{e}");
    let e = topo.nics_near(&Near::Node(NumaNode(7))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoData, "{e}");
    // A target that is neither NIC nor GPU, read on demand: the switch's downstream port
    // above NIC 0 of switch 0.
    let near = topo.nics_near(&Near::Device(addr("0000:22:01.0"))).unwrap();
    assert_eq!(
        near[0],
        (topo.device(addr(&p5_nic(0, 0))).unwrap(), Distance::Pix)
    );
    assert_eq!(near[3].1, Distance::Pix);
    assert_eq!(near[4].1, Distance::Phb);
}

#[test]
fn p5_like_table_and_tree() {
    let t = fake_sysfs::p5();
    let topo = Topology::from_root(t.root()).unwrap();
    let table = topo.matrix().to_string();
    println!("{table}");
    let lines: Vec<&str> = table.lines().collect();
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header[..8],
        [
            "GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "GPU6", "GPU7"
        ]
    );
    assert_eq!(header[8..], ["NUMA", "CPUs"]);
    let row = |label: &str| -> Vec<String> {
        let l = lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some(label))
            .unwrap_or_else(|| panic!("no row {label} in\n{table}"));
        l.split_whitespace().skip(1).map(str::to_string).collect()
    };
    assert_eq!(
        row("GPU2"),
        [
            "NODE",
            "NODE",
            "X",
            "PHB",
            "SYS",
            "SYS",
            "SYS",
            "SYS",
            "0",
            p5_cpus(0)
        ]
    );
    // NIC8 is the first NIC of switch 2 in bus order.
    assert_eq!(
        row("NIC8"),
        [
            "NODE",
            "NODE",
            "PIX",
            "PHB",
            "SYS",
            "SYS",
            "SYS",
            "SYS",
            "0",
            p5_cpus(0)
        ]
    );
    assert_eq!(
        row("NIC31")[..8],
        ["SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "PHB", "PIX"]
    );
    assert!(table.contains("rdmap38s0"), "{table}");
    let tree = topo.tree().to_string();
    assert!(tree.contains("NUMA node 1: CPUs 48-95,144-191"), "{tree}");
    // Each device line is indented under its bridges.
    let nic = tree
        .lines()
        .find(|l| l.contains("rdmap38s0"))
        .expect("the NIC in the tree");
    assert!(nic.starts_with(&" ".repeat(8)) && nic.trim_start().starts_with("0000:26:00.0"));
    assert_eq!(
        tree.lines()
            .filter(|l| l.trim_start().starts_with("pci0000:"))
            .count(),
        4
    );
}

#[test]
fn trn1_like_host_with_nested_switches() {
    let t = fake_sysfs::trn1();
    let topo = Topology::from_root(t.root()).unwrap();
    assert_eq!(topo.nics().len(), 8);
    assert_eq!(topo.gpus().len(), 16);
    assert!(
        topo.gpus()
            .iter()
            .all(|g| g.class == DeviceClass::Accelerator && g.driver.as_deref() == Some("neuron"))
    );
    // Neuron 0 is under the first lower switch of node 0 with NICs 0 and 1.
    let n0 = &topo.gpus()[0];
    let near = topo.nics_near(&Near::Device(n0.addr)).unwrap();
    let ds: Vec<Distance> = near.iter().map(|(_, d)| *d).collect();
    assert_eq!(
        ds,
        [
            Distance::Pix,
            Distance::Pix,
            Distance::Pxb,
            Distance::Pxb,
            Distance::Sys,
            Distance::Sys,
            Distance::Sys,
            Distance::Sys
        ]
    );
    assert_eq!(
        near[..2].iter().map(|(d, _)| d.addr).collect::<Vec<_>>(),
        [addr(&bdf(0x19, 0)), addr(&bdf(0x1a, 0))]
    );
    assert_eq!(names(&near[..2]), ["rdmap25s0", "rdmap26s0"]);
    // Two Neuron devices of one lower switch are PIX, of the two switches of a node PXB.
    assert_eq!(n0.distance(&topo.gpus()[3]), Distance::Pix);
    assert_eq!(n0.distance(&topo.gpus()[4]), Distance::Pxb);
    assert_eq!(n0.distance(&topo.gpus()[8]), Distance::Sys);
    let table = topo.matrix().to_string();
    assert!(table.lines().next().unwrap().contains("ACC15"), "{table}");
}

#[test]
fn a_host_without_gpu() {
    let t = fake_sysfs::no_gpu();
    let topo = Topology::from_root(t.root()).unwrap();
    assert!(
        topo.gpus().is_empty(),
        "the BMC's VGA and the NVMe drive are no GPUs"
    );
    assert_eq!(topo.numa_nodes().count(), 0);
    let [nic] = topo.nics() else {
        panic!("one NIC: {:?}", topo.nics())
    };
    assert_eq!(nic.name.as_deref(), Some("efa_0"));
    assert_eq!(nic.addr, addr("0000:00:06.0"));
    assert!(nic.bridges.is_empty());
    assert_eq!((nic.numa, nic.cpus.clone()), (None, None));
    // No NUMA information: any node is as far as any other.
    let near = topo.nics_near(&Near::Node(NumaNode(0))).unwrap();
    assert_eq!(near[0].1, Distance::Sys);
    // Devices on one root complex: through the host bridge; the ENA beside the NIC is no GPU
    // but can be a target.
    let near = topo.nics_near(&Near::Device(addr("0000:00:05.0"))).unwrap();
    assert_eq!(near[0].1, Distance::Phb);
    let table = topo.matrix().to_string();
    assert!(table.contains("NIC0") && table.contains("efa_0"), "{table}");
    // An empty tree is an empty topology.
    let empty = FakeSysfs::new();
    let topo = Topology::from_root(empty.root()).unwrap();
    assert!(topo.nics().is_empty() && topo.gpus().is_empty());
    assert!(topo.matrix().to_string().contains("no NIC or GPU"));
}

/// Builds a small good tree, breaks it with `f`, and returns the error's text (after checking
/// its kind).
fn broken(f: impl FnOnce(&FakeSysfs)) -> String {
    let t = FakeSysfs::new();
    t.node(0, "0-3");
    let rc = "pci0000:00";
    t.nic(
        "efa_0",
        &Place::new(rc, &[bdf(0, 1), bdf(1, 0)]),
        0,
        Some("0-3"),
    );
    t.gpu(&Place::new(rc, &[bdf(0, 1), bdf(2, 0)]), 0, Some("0-3"));
    assert!(Topology::from_root(t.root()).is_ok());
    f(&t);
    let e = Topology::from_root(t.root()).expect_err("a broken tree is an error");
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    e.to_string()
}

#[test]
fn broken_trees_are_clear_errors() {
    // A NIC whose device link leads nowhere.
    let text = broken(|t| {
        t.link(
            &t.root().join("devices/pci0000:00/0000:00:09.0"),
            &t.root().join("class/infiniband/efa_1/device"),
        )
    });
    assert!(
        text.contains("class/infiniband/efa_1/device") && text.contains("dangling"),
        "{text}"
    );
    // A dangling entry in bus/pci/devices.
    let text = broken(|t| {
        t.link(
            &t.root().join("devices/pci0000:00/gone"),
            &t.root().join("bus/pci/devices/0000:07:00.0"),
        )
    });
    assert!(text.contains("bus/pci/devices/0000:07:00.0"), "{text}");
    // Garbage in numa_node, local_cpulist, class; a cpulist that runs backwards.
    for (file, junk) in [
        ("numa_node", "zero\n"),
        ("local_cpulist", "0-3,x\n"),
        ("local_cpulist", "7-2\n"),
        ("class", "0xgpu\n"),
        ("vendor", "0x123456\n"),
    ] {
        let text = broken(|t| {
            std::fs::write(
                t.root()
                    .join("devices/pci0000:00/0000:00:01.0/0000:01:00.0")
                    .join(file),
                junk,
            )
            .unwrap()
        });
        assert!(
            text.contains(&format!("0000:01:00.0/{file}")) && text.contains(junk.trim()),
            "{file}: {text}"
        );
    }
    // An unreadable file (a directory where sysfs has a file; permissions do not stop root).
    let text = broken(|t| {
        let f = t
            .root()
            .join("devices/pci0000:00/0000:00:01.0/0000:02:00.0/numa_node");
        std::fs::remove_file(&f).unwrap();
        std::fs::create_dir(&f).unwrap();
    });
    assert!(text.contains("0000:02:00.0/numa_node"), "{text}");
    // A node's CPU list that is garbage.
    let text = broken(|t| t.node(1, "many"));
    assert!(text.contains("node1/cpulist"), "{text}");
    // A link out of the tree.
    let elsewhere = tempfile::tempdir().unwrap();
    let text = broken(|t| {
        t.link(
            elsewhere.path(),
            &t.root().join("class/infiniband/efa_9/device"),
        )
    });
    assert!(text.contains("outside"), "{text}");
}

#[test]
fn missing_optional_files_are_absent_fields() {
    let t = FakeSysfs::new();
    let place = Place::new("pci0000:00", &[bdf(0, 3)]);
    t.function(&place, &[]);
    t.link(
        &t.root().join("devices/pci0000:00/0000:00:03.0"),
        &t.root().join("class/infiniband/efa_0/device"),
    );
    // A software RDMA device: no device link, not a PCI NIC.
    std::fs::create_dir_all(t.root().join("class/infiniband/rxe0")).unwrap();
    let topo = Topology::from_root(t.root()).unwrap();
    let [nic] = topo.nics() else {
        panic!("{:?}", topo.nics())
    };
    assert_eq!(
        (nic.numa, &nic.cpus, nic.vendor, nic.class_code, &nic.driver),
        (None, &None, None, None, &None)
    );
}

#[test]
fn ids_parse_and_print() {
    assert_eq!(addr("10000:00:1f.7").to_string(), "10000:00:1f.7");
    for bad in [
        "",
        "0000:00:00",
        "0000:00:00.8",
        "0000:0g:00.0",
        "0000:000:00.0",
        "x",
    ] {
        let e = bad.parse::<PciAddr>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}");
    }
    assert_eq!("node1".parse::<Near>().unwrap(), Near::Node(NumaNode(1)));
    assert_eq!(
        "4f:00.0".parse::<Near>().unwrap(),
        Near::Device(addr("0000:4f:00.0"))
    );
    assert!("nodex".parse::<Near>().is_err());
    assert_eq!(CpuList::from_cpus([3, 1, 2, 1]).to_string(), "1-3");
    assert_eq!("".parse::<CpuList>().unwrap(), CpuList::default());
    assert!("99999999".parse::<CpuList>().is_err());
    let json = serde_json::to_string(&addr("0000:4f:00.0")).unwrap();
    assert_eq!(json, "\"0000:4f:00.0\"");
}

/// `Hints::near` orders what `getinfo` lists by distance; software devices, which have no PCI
/// location, keep their order after the NICs, with no distance.
#[test]
fn getinfo_near_a_gpu_keeps_software_devices_after() {
    let t = fake_sysfs::p5();
    let topo = Topology::from_root(t.root()).unwrap();
    let g = addr(&p5_gpu(0));
    let plain = getinfo(&Hints::new()).unwrap();
    let near = getinfo(&Hints::new().near(Near::Device(g)).topology(topo.clone())).unwrap();
    // (Each loopback device gets a fresh name: compare kinds and endpoint types.)
    let kinds = |v: &[efa::Info]| {
        v.iter()
            .filter(|i| i.provider != efa::DeviceKind::Efa)
            .map(|i| (i.provider, i.ep_type))
            .collect::<Vec<_>>()
    };
    let soft = kinds(&plain);
    assert!(!soft.is_empty());
    assert_eq!(kinds(&near[near.len() - soft.len()..]), soft);
    assert!(
        near[near.len() - soft.len()..]
            .iter()
            .all(|i| i.distance.is_none())
    );
    // A GPU the tree does not have is an error that names it.
    let e = getinfo(
        &Hints::new()
            .near(Near::Device(addr("0000:ee:00.0")))
            .topology(topo),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoData, "{e}");
    assert!(e.to_string().contains("0000:ee:00.0"), "{e}");
}
