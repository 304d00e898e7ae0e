//! The crate's `examples/ping-pong` against libfabric's unmodified `fi_pingpong -p efa` on the
//! emulated NIC, each as server and as client: RDM messages, RDM tagged messages and datagrams,
//! every `-S all` size with data checks (`-c`), with our `efa` device on an emulated NIC of its
//! own and with our `udp` device (no emulator: it speaks the emulator's SRD over UDP).
//!
//! These need `fi_pingpong` on the PATH and the example built with the `efa` feature in the same
//! profile as the tests, so they are `#[ignore]`d; `.ci/run` runs them with `--ignored`:
//!
//! ```text
//! cargo build --release --features efa --example ping-pong
//! cargo test --release -p efa-emu --test pingpong_interop -- --ignored
//! ```
//!
//! `PING_PONG` names another ping-pong binary. Ports are ephemeral and every emulated NIC gets
//! an address of its own (from the process id and a counter), so parallel runs do not meet.

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{emu_cmd, finish, free_port, out_text};

/// Round trips per size: enough to see each size work, little enough for CI.
const ITERS: &str = "10";

/// The largest size fi_pingpong's `-S all` reaches on RDM (4 MiB + 2 MiB) and on DGRAM (the
/// emulated NIC's MTU).
const RDM_MAX: usize = (1 << 22) + (1 << 21);
const DGRAM_MAX: usize = 8928;

/// The ping-pong example, built in this profile (`target/<profile>/examples/ping-pong`).
fn ping_pong() -> String {
    if let Some(p) = std::env::var_os("PING_PONG") {
        return p.to_string_lossy().into_owned();
    }
    let exe = std::env::current_exe().expect("test executable");
    let bin: PathBuf = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>")
        .join("examples")
        .join("ping-pong");
    assert!(
        bin.exists(),
        "{} is missing: cargo build [--release] --features efa --example ping-pong",
        bin.display()
    );
    bin.to_string_lossy().into_owned()
}

/// An emulated NIC address no other test or run uses: `127.a.b.c` from the process id and a
/// counter.
fn nic_addr() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    format!(
        "127.{}.{}.{}",
        16 + (pid >> 8) % 200,
        pid & 0xff,
        1 + n % 250
    )
}

/// Which of our devices faces libfabric.
#[derive(Clone, Copy, Debug)]
enum Ours {
    /// The `efa` device on an emulated NIC of its own.
    Efa,
    /// The `udp` device with the emulated NIC's MTU.
    Udp,
}

/// fi_pingpong's `-S all` sizes up to `max`, as its first output column prints them.
fn all_sizes(max: usize) -> Vec<String> {
    let mut v = vec![0, 1];
    let mut p = 2;
    while p <= max {
        v.push(p);
        if p + p / 2 > max {
            break;
        }
        v.push(p + p / 2);
        p *= 2;
    }
    v.into_iter().map(size_str).collect()
}

/// fi_pingpong's `size_str`: 64, 1k, 1.5k, 6m.
fn size_str(size: usize) -> String {
    let (base, mag) = match size {
        s if s >= 1 << 20 => (1 << 20, "m"),
        s if s >= 1 << 10 => (1 << 10, "k"),
        _ => (1, ""),
    };
    let fraction = if size / base < 10 {
        (size % base) * 10 / base
    } else {
        0
    };
    if fraction > 0 {
        format!("{}.{}{}", size / base, fraction, mag)
    } else {
        format!("{}{}", size / base, mag)
    }
}

/// Checks that `out` has fi_pingpong's header and one row per size of `sizes`, in order, each
/// with every round trip acknowledged (`=10`).
fn check_rows(who: &str, out: &Output, sizes: &[String]) {
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines().skip_while(|l| !l.starts_with("bytes"));
    let header = lines.next().unwrap_or_default();
    assert!(
        header.split_whitespace().collect::<Vec<_>>()
            == [
                "bytes",
                "#sent",
                "#ack",
                "total",
                "time",
                "MB/sec",
                "usec/xfer",
                "Mxfers/sec"
            ],
        "{who}: no fi_pingpong header\n{}",
        out_text(out)
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split_whitespace().collect()).collect();
    let got: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(got, sizes, "{who}: sizes\n{}", out_text(out));
    for r in &rows {
        assert!(
            r.len() == 8 && r[1] == ITERS && r[2] == format!("={ITERS}"),
            "{who}: row {r:?}\n{}",
            out_text(out)
        );
    }
}

/// The command that runs our ping-pong with `args`.
fn ours_cmd(dev: Ours, args: &[&str]) -> Command {
    let pp = ping_pong();
    match dev {
        Ours::Efa => {
            let addr = nic_addr();
            let mut prog = vec![pp.as_str(), "-p", "efa"];
            prog.extend_from_slice(args);
            emu_cmd(None, &["--addr", &addr], &prog)
        }
        Ours::Udp => {
            let mut c = Command::new(pp);
            c.args(["-p", "udp", "--mtu", &DGRAM_MAX.to_string()]);
            c.args(args);
            c.env("FI_EFA_ENABLE_SHM_TRANSFER", "0");
            c
        }
    }
}

/// The command that runs `fi_pingpong -p efa` with `args` on an emulated NIC.
fn theirs_cmd(args: &[&str]) -> Command {
    let addr = nic_addr();
    let mut prog = vec!["fi_pingpong", "-p", "efa"];
    prog.extend_from_slice(args);
    emu_cmd(None, &["--addr", &addr], &prog)
}

/// Runs one pair (ours as the server when `ours_serves`) with the test options `args`; checks
/// both exit codes and every size's row on both sides.
fn pair(dev: Ours, ours_serves: bool, args: &[&str], sizes: &[String]) {
    let port = free_port().to_string();
    let mut sargs = vec!["-B", port.as_str()];
    sargs.extend_from_slice(args);
    let mut cargs = vec!["-P", port.as_str()];
    cargs.extend_from_slice(args);
    cargs.push("127.0.0.1");
    let (mut server, mut client) = if ours_serves {
        sargs.insert(0, "-l");
        (ours_cmd(dev, &sargs), theirs_cmd(&cargs))
    } else {
        (theirs_cmd(&sargs), ours_cmd(dev, &cargs))
    };
    let what = format!(
        "{dev:?} {} {args:?}",
        if ours_serves {
            "ours serves"
        } else {
            "libfabric serves"
        }
    );
    let server = server
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the server");
    // fi_pingpong's client does not retry its connection: start it once the server listens.
    assert!(
        common::wait_listening(port.parse().expect("port"), Duration::from_secs(30)),
        "{what}: the server never listened on {port}"
    );
    let client = client
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the client");
    let client = finish(client, &cargs);
    let server = finish(server, &sargs);
    assert!(
        client.status.success() && server.status.success(),
        "{what} failed\n== client {}\n== server {}",
        out_text(&client),
        out_text(&server)
    );
    check_rows(&format!("{what}, client"), &client, sizes);
    check_rows(&format!("{what}, server"), &server, sizes);
}

/// Both directions of one kind of test.
fn both_ways(dev: Ours, args: &[&str], max: usize) {
    let sizes = all_sizes(max);
    let mut all = vec!["-S", "all", "-c", "-I", ITERS];
    all.extend_from_slice(args);
    pair(dev, true, &all, &sizes);
    pair(dev, false, &all, &sizes);
}

#[test]
fn size_list_is_fi_pingpongs() {
    let rdm = all_sizes(RDM_MAX);
    assert_eq!(rdm.len(), 46);
    assert_eq!(rdm[..8], ["0", "1", "2", "3", "4", "6", "8", "12"]);
    assert_eq!(rdm.last().map(String::as_str), Some("6m"));
    assert_eq!(all_sizes(DGRAM_MAX).last().map(String::as_str), Some("8k"));
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong) and the ping-pong example (--features efa); run by .ci/run"]
fn efa_device_rdm_msg() {
    both_ways(Ours::Efa, &["-e", "rdm"], RDM_MAX);
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong) and the ping-pong example (--features efa); run by .ci/run"]
fn efa_device_rdm_tagged() {
    both_ways(Ours::Efa, &["-e", "rdm", "-m", "tagged"], RDM_MAX);
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong) and the ping-pong example (--features efa); run by .ci/run"]
fn efa_device_dgram() {
    both_ways(Ours::Efa, &["-e", "dgram"], DGRAM_MAX);
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong) and the ping-pong example; run by .ci/run"]
fn udp_device_rdm_msg() {
    both_ways(Ours::Udp, &["-e", "rdm"], RDM_MAX);
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong) and the ping-pong example; run by .ci/run"]
fn udp_device_rdm_tagged() {
    both_ways(Ours::Udp, &["-e", "rdm", "-m", "tagged"], RDM_MAX);
}

#[test]
#[ignore = "needs libfabric-bin (fi_pingpong) and the ping-pong example; run by .ci/run"]
fn udp_device_dgram() {
    both_ways(Ours::Udp, &["-e", "dgram"], DGRAM_MAX);
}
