//! Several EFA NICs on one host (cargo feature `efa`): discovery lists every one with its PCI
//! location and NUMA node, `Hints::near` ranks them by distance from a GPU, two NICs of one
//! host talk to each other as two hosts' would, and a NIC's bandwidth cap holds.
//!
//! Every test needs at least two EFA devices and fails, saying so, without them; they are
//! `#[ignore]`d and run by `.ci/run` on the emulated NIC with four devices and a bandwidth cap:
//!
//! ```text
//! EFA_EMU_BANDWIDTH=20m target/debug/efa-emu run --devices 4 -- \
//!     cargo test --features efa --test efa_multi -- --ignored --test-threads=1
//! ```
//!
//! On an EFA instance with several NICs (p4d, p5, trn1) the topology tests run as they are;
//! the bandwidth test needs the emulator's cap.
#![cfg(feature = "efa")]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::efa::EfaDevice;
use efa::device::{Device, DeviceCompletion, DeviceKind, Opcode, QpAttr, QpType, SendWr, Status};
use efa::topo::{Distance, Near, Topology};
use efa::{Config, Hints, getinfo};

/// The EFA devices, at least two.
fn devices() -> Vec<Arc<EfaDevice>> {
    let d = EfaDevice::open_all(&Config::default()).expect("discovery");
    assert!(
        d.len() >= 2,
        "this test needs several EFA devices (under the emulator: efa-emu run --devices 4), found {}",
        d.len()
    );
    d
}

/// `EFA_EMU_DEVICES` when the emulator runs this process.
fn emulated_devices() -> Option<usize> {
    std::env::var("EFA_EMU_DEVICES").ok()?.parse().ok()
}

#[test]
#[ignore = "needs several EFA devices; run by .ci/run under efa-emu run --devices 4"]
fn hw_multi_getinfo_lists_every_device_with_its_topology() {
    let devs = devices();
    if let Some(n) = emulated_devices() {
        assert_eq!(devs.len(), n);
    }
    let infos = getinfo(&Hints::new().provider("efa")).unwrap();
    let names: BTreeSet<&str> = infos.iter().map(|i| i.device.name.as_str()).collect();
    assert_eq!(names.len(), devs.len(), "{names:?}");
    assert!(infos.iter().all(|i| i.provider == DeviceKind::Efa));
    // Every device has its own PCI function, found in the topology under its name.
    let topo = Topology::detect().unwrap();
    let mut addrs = BTreeSet::new();
    for d in &devs {
        let a = d.attr();
        let pci = a.pci_addr.as_deref().expect("a PCI address");
        let nic = topo.nic(&a.name).expect("the NIC in the topology");
        assert_eq!(nic.addr.to_string(), pci);
        assert_eq!(nic.numa.map(|n| n.0 as i32), a.numa_node, "{}", a.name);
        addrs.insert(pci.to_string());
    }
    assert_eq!(addrs.len(), devs.len(), "distinct PCI functions: {addrs:?}");
    println!("{}", topo.matrix());
    // Near the last GPU: its NICs first, at PIX, and every efa entry carries its distance.
    let Some(gpu) = topo.gpus().last() else {
        assert!(
            emulated_devices().is_none(),
            "the emulator places a GPU beside its NICs"
        );
        return;
    };
    let near = getinfo(&Hints::new().provider("efa").near(Near::Device(gpu.addr))).unwrap();
    let ds: Vec<Distance> = near.iter().map(|i| i.distance.unwrap()).collect();
    let mut sorted = ds.clone();
    sorted.sort();
    assert_eq!(ds, sorted, "nearest first");
    assert_eq!(ds[0], Distance::Pix);
    let first = topo.nic(&near[0].device.name).unwrap();
    assert_eq!(first.distance(gpu), Distance::Pix);
    // Only the PIX ones.
    let pix = getinfo(
        &Hints::new()
            .provider("efa")
            .near(Near::Device(gpu.addr))
            .max_distance(Distance::Pix),
    )
    .unwrap();
    assert!(!pix.is_empty() && pix.len() < near.len());
    assert!(pix.iter().all(|i| i.distance == Some(Distance::Pix)));
}

/// Polls until `n` completions arrived on `qp` (or the deadline passed).
fn collect(
    qp: &mut Box<dyn efa::device::QueuePair>,
    n: usize,
    limit: Duration,
) -> Vec<DeviceCompletion> {
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        qp.poll(&mut got, 64);
    }
    got
}

/// The last device sends to the first: two NICs of one host, each with its own address.
#[test]
#[ignore = "needs several EFA devices; run by .ci/run under efa-emu run --devices 4"]
fn hw_multi_devices_are_independent_nics() {
    let devs = devices();
    let (a, b) = (devs.last().unwrap(), &devs[0]);
    assert_ne!(
        a.attr().gid,
        b.attr().gid,
        "each device has its own address"
    );
    let mut tx = a.create_qp(QpAttr::new(QpType::Srd)).unwrap();
    let mut rx = b.create_qp(QpAttr::new(QpType::Srd)).unwrap();
    assert_eq!(tx.addr().gid, a.attr().gid);
    assert_eq!(rx.addr().gid, b.attr().gid);
    let n = 32u64;
    for i in 0..n {
        rx.post_recv(i, BytesMut::with_capacity(4096)).unwrap();
    }
    for i in 0..n {
        let payload: Vec<u8> = (0..1000 + i as usize)
            .map(|j| (j as u64 * 3 + i) as u8)
            .collect();
        tx.post_send(SendWr {
            wr_id: i,
            dest: rx.addr(),
            hdr: Bytes::new(),
            payload: Bytes::from(payload),
            imm: Some(i as u32),
        })
        .unwrap();
    }
    let sent = collect(&mut tx, n as usize, Duration::from_secs(30));
    assert_eq!(sent.len(), n as usize, "{sent:?}");
    assert!(sent.iter().all(|c| c.status == Status::Success), "{sent:?}");
    let got = collect(&mut rx, n as usize, Duration::from_secs(30));
    assert_eq!(got.len(), n as usize);
    let mut seen = BTreeSet::new();
    for c in &got {
        assert_eq!(
            (c.status, c.opcode),
            (Status::Success, Opcode::Recv),
            "{c:?}"
        );
        let i = u64::from(c.imm.unwrap());
        assert!(seen.insert(i), "{i} twice");
        let want: Vec<u8> = (0..1000 + i as usize)
            .map(|j| (j as u64 * 3 + i) as u8)
            .collect();
        assert_eq!(&c.buf.as_ref().unwrap()[..], &want[..]);
        assert_eq!(c.src.unwrap().gid, a.attr().gid, "from the other NIC");
    }
    tx.close();
    rx.close();
}

/// A device capped at `EFA_EMU_BANDWIDTH` bytes per second takes at least N / rate (less the
/// bucket's 1 ms burst) to send N bytes; the data arrives intact.
#[test]
#[ignore = "needs the emulated NIC with EFA_EMU_BANDWIDTH; run by .ci/run"]
fn hw_multi_a_capped_device_sends_no_faster_than_its_cap() {
    let rate: f64 = std::env::var("EFA_EMU_BANDWIDTH")
        .ok()
        .and_then(|v| {
            let v = v.trim().to_ascii_lowercase();
            let (d, m) = match v.as_bytes().last() {
                Some(b'k') => (&v[..v.len() - 1], 1e3),
                Some(b'm') => (&v[..v.len() - 1], 1e6),
                Some(b'g') => (&v[..v.len() - 1], 1e9),
                _ => (&v[..], 1.0),
            };
            d.parse::<f64>().ok().map(|x| x * m)
        })
        .expect("this test needs the emulated NIC with EFA_EMU_BANDWIDTH set");
    let devs = devices();
    let (a, b) = (&devs[1], &devs[0]);
    let mtu = a.attr().mtu;
    let mut attr = QpAttr::new(QpType::Srd);
    (attr.send_depth, attr.recv_depth) = (2048, 2048);
    let mut tx = a.create_qp(attr.clone()).unwrap();
    let mut rx = b.create_qp(attr).unwrap();
    // About half a second's worth at the cap, in MTU-sized sends.
    let n = ((rate * 0.5) as usize / mtu).clamp(8, 2000);
    for i in 0..n {
        rx.post_recv(i as u64, BytesMut::with_capacity(mtu))
            .unwrap();
    }
    let start = Instant::now();
    for i in 0..n {
        tx.post_send(SendWr {
            wr_id: i as u64,
            dest: rx.addr(),
            hdr: Bytes::new(),
            payload: Bytes::from(vec![i as u8; mtu]),
            imm: Some(i as u32),
        })
        .unwrap();
    }
    let posted = start.elapsed();
    let got = collect(&mut rx, n, Duration::from_secs(120));
    let took = start.elapsed();
    assert_eq!(got.len(), n, "every send arrived");
    for c in &got {
        assert_eq!(c.status, Status::Success, "{c:?}");
        let i = c.imm.unwrap() as usize;
        assert!(c.buf.as_ref().unwrap().iter().all(|x| *x == i as u8));
    }
    let sent = collect(&mut tx, n, Duration::from_secs(30));
    assert_eq!(sent.len(), n);
    // The first send's bytes ride the burst; every later one waits for the cap.
    let least = Duration::from_secs_f64(((n - 1) * mtu) as f64 / rate) - Duration::from_millis(1);
    println!("{n} x {mtu} bytes at {rate} B/s: posted in {posted:?}, received in {took:?}");
    assert!(took >= least, "{took:?} < {least:?}: faster than the cap");
    assert!(
        posted < least,
        "posting does not wait for the cap ({posted:?})"
    );
    tx.close();
    rx.close();
}

/// The CPUs thread `name*` of this process may run on (`Cpus_allowed_list`), if there is one.
fn thread_cpus(prefix: &str) -> Option<String> {
    for t in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim().starts_with(prefix) {
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|s| s.trim().to_string());
        }
    }
    None
}

/// An RDM endpoint's progress thread pinned `NearDevice` runs on the last of its NIC's local
/// CPUs (`local_cpulist`), for each NIC.
#[test]
#[ignore = "needs several EFA devices; run by .ci/run under efa-emu run --devices 4"]
fn hw_multi_progress_threads_run_on_their_nics_local_cpus() {
    let devs = devices();
    let topo = Topology::detect().unwrap();
    let infos = getinfo(&Hints::new().provider("efa").ep_type(efa::EpType::Rdm)).unwrap();
    assert_eq!(infos.len(), devs.len());
    for info in &infos {
        let nic = topo
            .nic(&info.device.name)
            .expect("the NIC in the topology");
        let Some(want) = nic.cpus.as_ref().and_then(|c| c.cpus().last().copied()) else {
            panic!("{} has no local CPUs in sysfs", info.device.name);
        };
        let d = efa::Domain::open(info).unwrap();
        let cq = efa::CompletionQueue::new(&d, 16).unwrap();
        let av = efa::AddressVector::new(&d);
        let ep = efa::Endpoint::<efa::Rdm>::builder(&d)
            .cq(&cq)
            .av(&av)
            .local_path(false)
            .progress_thread(true)
            .progress_cpu(efa::ProgressCpu::NearDevice)
            .build()
            .unwrap();
        let got = thread_cpus("efa-progress").expect("the progress thread");
        assert_eq!(got, want.to_string(), "{}", info.device.name);
        drop(ep);
        // Wait for the thread to end, so the next device's is the only one.
        let deadline = Instant::now() + Duration::from_secs(10);
        while thread_cpus("efa-progress").is_some() {
            assert!(Instant::now() < deadline, "the progress thread did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A multi-rail group on the four NICs (`efa::rail`): a striped write with immediate data, a
/// read and a message, content checked, every NIC carrying a share; then one NIC of the target
/// closes mid-run and its stripes move to the others, every operation completing intact once.
#[test]
#[ignore = "needs several EFA devices; run by .ci/run under efa-emu run --devices 4"]
fn hw_multi_rail_group_stripes_over_every_nic_and_survives_one_closing() {
    use efa::rail::{RailGroup, RailOp};
    use efa::{Access, Domain};
    let devs = devices();
    let n = devs.len();
    let domain =
        |i: usize| Domain::with_device(devs[i % n].clone() as Arc<dyn Device>, Config::default());
    // Rail i of one group talks to rail i of the other, on another NIC.
    let a = RailGroup::builder((0..n).map(domain).collect())
        .build()
        .unwrap();
    let b = RailGroup::builder((1..=n).map(domain).collect())
        .build()
        .unwrap();
    let to_b = a.insert(&b.addr()).unwrap();
    b.insert(&a.addr()).unwrap();
    let len = 8 << 20;
    let data = Bytes::from((0..len).map(|i| (i * 7 % 251) as u8).collect::<Vec<u8>>());
    let region = b
        .register(vec![0u8; len], Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    let rk = region.remote_key().unwrap();
    let drive = |na: usize, nb: usize| {
        let (mut ca, mut cb) = (Vec::new(), Vec::new());
        let deadline = Instant::now() + Duration::from_secs(120);
        while ca.len() < na || cb.len() < nb {
            a.poll(&mut ca, 16).unwrap();
            b.poll(&mut cb, 16).unwrap();
            assert!(Instant::now() < deadline, "{:?} {:?}", a.stats(), b.stats());
        }
        (ca, cb)
    };
    a.write_data(to_b, data.clone(), &rk, 0, 5, 1).unwrap();
    let (ca, cb) = drive(1, 1);
    assert!(ca[0].result.is_ok(), "{:?}", ca[0]);
    assert_eq!(
        (cb[0].op, cb[0].data, cb[0].len),
        (RailOp::RemoteWrite, Some(5), len)
    );
    assert!(region.read()[..] == data[..]);
    a.read(to_b, BytesMut::new(), len, &rk, 0, 2).unwrap();
    b.recv(BytesMut::with_capacity(len), 3).unwrap();
    a.send(to_b, data.clone(), 4).unwrap();
    let (ca, cb) = drive(2, 1);
    assert!(ca.iter().all(|c| c.result.is_ok()), "{ca:?}");
    let read = ca.iter().find(|c| c.context == 2).unwrap();
    assert!(read.buf.as_recv().unwrap() == &data[..]);
    assert!(cb[0].buf.as_recv().unwrap() == &data[..]);
    let st = a.stats();
    println!("{st:?}");
    assert!(st.rails.iter().all(|r| r.bytes > 0), "{st:?}");
    // B's rail 1 closes while writes are in flight.
    for i in 0..4u64 {
        a.write(
            to_b,
            data.slice(..len / 4),
            &rk,
            i * (len as u64 / 4),
            10 + i,
        )
        .unwrap();
    }
    b.disable_rail(1).unwrap();
    let (ca, _) = drive(4, 0);
    assert!(ca.iter().all(|c| c.result.is_ok()), "{ca:?}");
    for i in 0..4 {
        assert!(region.read()[i * len / 4..(i + 1) * len / 4] == data[..len / 4]);
    }
    println!("{:?}", a.stats());
}
