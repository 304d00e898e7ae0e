//! libfabric's own EFA provider on the emulated NIC: `fi_info` and `fi_pingpong` from Debian's
//! `libfabric-bin`, unmodified, with the emulator in place of rdma-core.
//!
//! These need `fi_info` and `fi_pingpong` on the PATH, so they are `#[ignore]`d; `.ci/run`
//! installs `libfabric-bin` and runs them with `--ignored`. The namespace test needs root.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{EMU, emu_cmd, finish, free_port, out_text};

/// Runs a fi_pingpong server and client; returns the client's stdout after checking both.
fn pingpong(
    server_ns: Option<&str>,
    client_ns: Option<&str>,
    server_emu: &[&str],
    client_emu: &[&str],
    server_addr: &str,
    args: &[&str],
) -> String {
    let (client, _) = pingpong_outputs(
        server_ns,
        client_ns,
        server_emu,
        client_emu,
        server_addr,
        args,
    );
    String::from_utf8_lossy(&client.stdout).into_owned()
}

/// Runs a fi_pingpong server and client and checks that both succeed; their outputs.
fn pingpong_outputs(
    server_ns: Option<&str>,
    client_ns: Option<&str>,
    server_emu: &[&str],
    client_emu: &[&str],
    server_addr: &str,
    args: &[&str],
) -> (Output, Output) {
    let port = free_port().to_string();
    let mut sargs = vec!["fi_pingpong", "-p", "efa", "-B", &port];
    sargs.extend_from_slice(args);
    let server = emu_cmd(server_ns, server_emu, &sargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the fi_pingpong server");
    std::thread::sleep(Duration::from_millis(500));
    let mut cargs = vec!["fi_pingpong", "-p", "efa", "-P", &port];
    cargs.extend_from_slice(args);
    cargs.push(server_addr);
    let client = emu_cmd(client_ns, client_emu, &cargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the fi_pingpong client");
    let client = finish(client, args);
    let server = finish(server, args);
    assert!(
        client.status.success() && server.status.success(),
        "fi_pingpong {args:?} failed\n== client {}\n== server {}",
        out_text(&client),
        out_text(&server)
    );
    (client, server)
}

/// fi_pingpong's `-S all` ran every size up to one with the unit `unit` (`m` for RDM, whose
/// largest is a few MiB; `k` for DGRAM, whose largest is the MTU) and reported each.
fn check_all_sizes(out: &str, unit: &str) {
    let rows: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("bytes"))
        .skip(1)
        .collect();
    assert!(rows.len() > 20, "too few sizes:\n{out}");
    assert!(
        rows[0].starts_with("1 ") || rows[0].starts_with("0 "),
        "{out}"
    );
    let last = rows
        .last()
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_default();
    assert!(
        last.ends_with(unit),
        "did not reach the {unit} sizes:\n{out}"
    );
}

fn local(a: &str) -> [&str; 2] {
    ["--addr", a]
}

#[test]
#[ignore = "needs libfabric-bin (fi_info); run by .ci/run"]
fn fi_info_lists_rdm_and_dgram_domains() {
    let o = emu_cmd(None, &local("127.0.7.1"), &["fi_info", "-p", "efa", "-v"])
        .output()
        .expect("run fi_info");
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", out_text(&o));
    assert!(s.contains("efa_0-rdm") && s.contains("FI_EP_RDM"), "{s}");
    assert!(s.contains("efa_0-dgrm") && s.contains("FI_EP_DGRAM"), "{s}");
    // The attributes libfabric derives from the device: MTU, part id, PCI function.
    assert!(s.contains("max_msg_size: 8928"), "{s}");
    assert!(s.contains("device_id: 0xefa2"), "{s}");
    assert!(s.contains("bus_id: 0") && s.contains("device_id: 6"), "{s}");
}

#[test]
#[ignore = "needs libfabric-bin (fi_info); run by .ci/run"]
fn fi_info_hides_nothing_with_a_bad_configuration_but_says_why() {
    let o = emu_cmd(None, &[], &["fi_info", "-p", "efa"])
        .env("EFA_EMU_MTU", "12")
        .output()
        .expect("run the launcher");
    // The launcher refuses the configuration before the program runs.
    assert_eq!(o.status.code(), Some(2), "{}", out_text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("EFA_EMU_MTU"));
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong); run by .ci/run"]
fn fi_pingpong_rdm_msg_all_sizes() {
    let out = pingpong(
        None,
        None,
        &local("127.0.7.2"),
        &local("127.0.7.3"),
        "127.0.0.1",
        &["-e", "rdm", "-S", "all", "-c", "-I", "20"],
    );
    check_all_sizes(&out, "m");
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong); run by .ci/run"]
fn fi_pingpong_rdm_tagged_all_sizes() {
    let out = pingpong(
        None,
        None,
        &local("127.0.7.4"),
        &local("127.0.7.5"),
        "127.0.0.1",
        &["-e", "rdm", "-m", "tagged", "-S", "all", "-c", "-I", "20"],
    );
    check_all_sizes(&out, "m");
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong); run by .ci/run"]
fn fi_pingpong_dgram_all_sizes() {
    let out = pingpong(
        None,
        None,
        &local("127.0.7.6"),
        &local("127.0.7.7"),
        "127.0.0.1",
        &["-e", "dgram", "-S", "all", "-c", "-I", "20"],
    );
    check_all_sizes(&out, "k");
}

/// The RDMA reads a NIC posted, from its `EFA_EMU_STATS` line.
fn rdma_ops(stderr: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("efa-emu stats:"))
        .unwrap_or_else(|| panic!("no stats line in:\n{stderr}"));
    let key = "rdma_reads_posted: ";
    let at = line.find(key).expect("rdma_reads_posted counter") + key.len();
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a number")
}

/// Without RDMA read the provider moves long messages with long-CTS (no RDMA on either NIC);
/// with it, with long-read (the NICs serve RDMA reads).
#[test]
#[ignore = "needs libfabric-bin (fi_pingpong); run by .ci/run"]
fn fi_pingpong_rdm_with_and_without_device_rdma_read() {
    for (caps, reads) in [
        ("rnr_retry", false),
        ("rdma_read,rdma_write,rnr_retry", true),
    ] {
        let (client, server) = pingpong_outputs(
            None,
            None,
            &["--addr", "127.0.7.8", "--caps", caps],
            &["--addr", "127.0.7.9", "--caps", caps],
            "127.0.0.1",
            &["-e", "rdm", "-S", "1048576", "-c", "-I", "20"],
        );
        let out = String::from_utf8_lossy(&client.stdout);
        assert!(
            out.lines().last().unwrap_or_default().starts_with("1m"),
            "{caps}: {out}"
        );
        let served = rdma_ops(&String::from_utf8_lossy(&client.stderr))
            + rdma_ops(&String::from_utf8_lossy(&server.stderr));
        if reads {
            assert!(
                served >= 20,
                "{caps}: long-read expected, {served} RDMA reads"
            );
        } else {
            assert_eq!(served, 0, "{caps}: long-CTS expected, no RDMA");
        }
    }
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong); run by .ci/run"]
fn fi_pingpong_rdm_under_loss_and_reordering() {
    let faults = ["--faults", "seed=11,drop=0.05,reorder=0.05"];
    let s: Vec<&str> = local("127.0.7.10").into_iter().chain(faults).collect();
    let faults_c = ["--faults", "seed=12,drop=0.05,reorder=0.05"];
    let c: Vec<&str> = local("127.0.7.11").into_iter().chain(faults_c).collect();
    let out = pingpong(
        None,
        None,
        &s,
        &c,
        "127.0.0.1",
        &["-e", "rdm", "-S", "all", "-c", "-I", "10"],
    );
    check_all_sizes(&out, "m");
}

/// A device's packets sent, from its `EFA_EMU_STATS` line (`efa-emu stats <device>: ...`).
fn tx_pkts(stderr: &str, device: &str) -> u64 {
    let head = format!("efa-emu stats {device}:");
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&head))
        .unwrap_or_else(|| panic!("no stats line of {device} in:\n{stderr}"));
    let key = "tx_pkts: ";
    let at = line.find(key).expect("tx_pkts counter") + key.len();
    line[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a number")
}

/// With four devices, `fi_info` lists four RDM and four DGRAM domains, each on its own PCI
/// function; `fi_pingpong` runs on any one of them (`-d efa_2-rdm`), and only that device
/// carries its packets.
#[test]
#[ignore = "needs libfabric-bin (fi_info, fi_pingpong); run by .ci/run"]
fn fi_info_lists_every_device_and_fi_pingpong_runs_on_any() {
    let four = ["--devices", "4", "--addr", "127.0.9.1"];
    let o = emu_cmd(None, &four, &["fi_info", "-p", "efa", "-v"])
        .output()
        .expect("run fi_info");
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", out_text(&o));
    for i in 0..4 {
        for t in ["rdm", "dgrm"] {
            let want = format!("name: efa_{i}-{t}");
            assert!(s.contains(&want), "{want}:\n{s}");
        }
    }
    let buses: std::collections::BTreeSet<&str> = s
        .lines()
        .filter(|l| l.trim_start().starts_with("bus_id:"))
        .collect();
    assert_eq!(buses.len(), 4, "a PCI function each: {buses:?}");
    let (client, server) = pingpong_outputs(
        None,
        None,
        &["--devices", "4", "--addr", "127.0.9.10"],
        &["--devices", "4", "--addr", "127.0.9.20"],
        "127.0.0.1",
        &[
            "-e",
            "rdm",
            "-d",
            "efa_2-rdm",
            "-S",
            "1024",
            "-c",
            "-I",
            "50",
        ],
    );
    for (who, o) in [("client", &client), ("server", &server)] {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(tx_pkts(&err, "efa_2") >= 50, "{who} on efa_2:\n{err}");
        for other in ["efa_0", "efa_1", "efa_3"] {
            assert_eq!(tx_pkts(&err, other), 0, "{who}: {other} idle:\n{err}");
        }
    }
}

/// Two hosts: network namespaces joined by a veth pair, each with its own emulated NIC.
#[test]
#[ignore = "needs root (ip netns) and libfabric-bin; run by .ci/run"]
fn fi_pingpong_across_two_namespaces() {
    let tag = format!("{}", std::process::id() % 100_000);
    let (a, b) = (format!("emuA{tag}"), format!("emuB{tag}"));
    let (va, vb) = (format!("ea{tag}"), format!("eb{tag}"));
    let sh = |cmd: &str| {
        let st = Command::new("sh").arg("-c").arg(cmd).status().expect("sh");
        assert!(st.success(), "failed: {cmd}");
    };
    struct Cleanup(String, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
            let _ = Command::new("ip").args(["netns", "del", &self.1]).status();
        }
    }
    sh(&format!("ip netns add {a} && ip netns add {b}"));
    let _c = Cleanup(a.clone(), b.clone());
    sh(&format!(
        "ip link add {va} type veth peer name {vb} && ip link set {va} netns {a} && ip link set {vb} netns {b} \
         && ip -n {a} addr add 10.77.0.1/24 dev {va} && ip -n {b} addr add 10.77.0.2/24 dev {vb} \
         && ip -n {a} link set {va} up && ip -n {b} link set {vb} up \
         && ip -n {a} link set lo up && ip -n {b} link set lo up"
    ));
    for args in [
        &["-e", "rdm", "-S", "all", "-c", "-I", "10"][..],
        &["-e", "dgram", "-S", "all", "-c", "-I", "10"][..],
    ] {
        let out = pingpong(
            Some(&a),
            Some(&b),
            &local("10.77.0.1"),
            &local("10.77.0.2"),
            "10.77.0.1",
            args,
        );
        check_all_sizes(&out, if args[1] == "rdm" { "m" } else { "k" });
    }
}

/// `(symbol, version)` pairs a shared object imports (`UND`) or defines, from `objdump -T`.
fn dynsyms(path: &str, undefined: bool) -> Vec<(String, String)> {
    let o = Command::new("objdump")
        .args(["-T", path])
        .output()
        .expect("objdump (binutils) is needed for this test");
    assert!(o.status.success(), "objdump -T {path}: {}", out_text(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.contains("*UND*") == undefined)
        .filter_map(|l| {
            let mut w = l.split_whitespace().rev();
            let name = w.next()?.to_string();
            let ver = w.next()?.trim_matches(|c| c == '(' || c == ')').to_string();
            (ver.starts_with("IBVERBS_") || ver.starts_with("EFA_")).then_some((name, ver))
        })
        .collect()
}

/// Every verbs and efadv symbol libfabric and librdmacm import (they are linked "bind now":
/// one missing pair and nothing loads) is defined, with its version, by the emulator library.
#[test]
#[ignore = "needs libfabric1 and librdmacm1 installed; run by .ci/run"]
fn every_symbol_libfabric_and_librdmacm_import_is_defined() {
    let dir = std::path::Path::new(EMU)
        .parent()
        .expect("target directory");
    // The library the launcher runs: the newer of the uplifted one and the one tests build.
    let lib = [dir.join("libefa_emu.so"), dir.join("deps/libefa_emu.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
        .expect("libefa_emu.so built");
    let defined = dynsyms(lib.to_str().expect("utf-8 path"), false);
    let mut checked = 0;
    for consumer in [
        "/usr/lib/x86_64-linux-gnu/libfabric.so.1",
        "/usr/lib/x86_64-linux-gnu/librdmacm.so.1",
    ] {
        for (name, ver) in dynsyms(consumer, true) {
            assert!(
                defined.iter().any(|(n, v)| *n == name && *v == ver),
                "{consumer} imports {name}@{ver}, which the emulator does not define"
            );
            checked += 1;
        }
    }
    assert!(
        checked > 40,
        "only {checked} imports found: wrong libraries?"
    );
}
