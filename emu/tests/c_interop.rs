//! Live interoperation with libfabric 1.17's EFA provider (issue 16): `c/peer.c`, built here
//! with `cc` against Debian's libfabric-dev, runs on an emulated EFA NIC and talks to a Rust peer
//! that uses the efa crate (`c/rust_peer.rs`, on the crate's `udp` device, which speaks the
//! emulator's SRD over UDP). They cover tagged messages with ignore bits, delivery-complete
//! messages with remote CQ data, RMA both ways (write, read, writedata into regions the other
//! side registered), atomics both ways and a restart of the Rust peer, at sizes from eager to
//! long-CTS and long-read. `docs/protocol.md`, "Interoperation with libfabric: what is tested".
//!
//! Out of band, each side's stdout lines that start with `@` go to the other side's stdin
//! (this harness relays them); `RESULT` lines are each side's summary, checked here. When the
//! first Rust peer exits, the harness starts the second one (new address, new connid).
//!
//! They need `cc`, libfabric-dev (headers and `-lfabric`) and the emulator, so they are
//! `#[ignore]`d; `.ci/run` runs them with `--ignored`. `C_INTEROP_SEED` replays a seed.

#[path = "c/rust_peer.rs"]
mod rust_peer;

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Sender, channel};
use std::time::{Duration, Instant};

const EMU: &str = env!("CARGO_BIN_EXE_efa-emu");
/// Eager (16 B, 4 KiB), medium (64 KiB), long-CTS (256 KiB), and long-CTS or, with device
/// RDMA read, long-read (1 MiB and 4 MiB: libfabric's `FI_EFA_INTER_MIN_READ_MESSAGE_SIZE`).
const SIZES: &str = "16,4096,65536,262144,1048576,4194304";

/// The entry point of the Rust peer: the harness runs this test binary again with
/// `C_INTEROP_PEER=<incarnation>`; otherwise it does nothing.
#[test]
#[ignore = "the Rust peer of the c_interop tests; started by them"]
fn rust_peer_main() {
    let Ok(inc) = std::env::var("C_INTEROP_PEER") else {
        return;
    };
    let inc: u32 = inc.parse().expect("C_INTEROP_PEER: an incarnation number");
    if let Err(e) = rust_peer::run(inc) {
        let seed = std::env::var("C_INTEROP_SEED").unwrap_or_default();
        println!("FAIL seed={seed}: {e}");
        std::io::stdout().flush().ok();
        std::process::exit(1);
    }
    std::io::stdout().flush().ok();
    // Leave at once: the harness's relay reads our exit as "start the next incarnation".
    std::process::exit(0);
}

/// Builds `c/peer.c` into a fresh temporary directory.
fn build_c_peer(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/peer.c");
    let exe = dir.join("peer");
    let o = Command::new("cc")
        .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-lfabric")
        .output()
        .expect("run cc (the C compiler is needed for this test)");
    assert!(
        o.status.success(),
        "cc {} failed (is libfabric-dev installed?):\n{}",
        src.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

enum Ev {
    Line(Who, String),
    Eof(Who),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    C,
    Rust(u32),
}

fn pump(who: Who, out: impl std::io::Read + Send + 'static, tx: Sender<Ev>) {
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send(Ev::Line(who, l)).is_err() {
                return;
            }
        }
        let _ = tx.send(Ev::Eof(who));
    });
}

/// One run: how to start each side.
struct Case {
    /// `efa-emu run` options for the C side (its NIC address is added).
    emu_args: Vec<&'static str>,
    /// Device RDMA (read and write) on the crate's udp device.
    rust_rdma: bool,
    /// Distinguishes the addresses of concurrent cases.
    index: u8,
    /// The Rust peer on the crate's efa device: the `c-interop-peer` example's path.
    efa_peer: Option<PathBuf>,
}

struct Outcome {
    c_status: ExitStatus,
    rust_status: Vec<ExitStatus>,
    c_lines: Vec<String>,
    rust_lines: Vec<Vec<String>>,
    c_stderr: String,
    rust_stderr: Vec<String>,
    seed: u64,
}

impl Outcome {
    fn dump(&self) -> String {
        let mut s = format!(
            "seed {} (replay with C_INTEROP_SEED={})\n== C side: {:?}\n",
            self.seed, self.seed, self.c_status
        );
        for l in &self.c_lines {
            s += &format!("  {l}\n");
        }
        s += &format!("-- C stderr (tail)\n{}\n", tail(&self.c_stderr, 40));
        for (i, lines) in self.rust_lines.iter().enumerate() {
            s += &format!("== Rust peer {}: {:?}\n", i + 1, self.rust_status.get(i));
            for l in lines {
                s += &format!("  {l}\n");
            }
            s += &format!(
                "-- Rust peer {} stderr (tail)\n{}\n",
                i + 1,
                tail(
                    self.rust_stderr.get(i).map(String::as_str).unwrap_or(""),
                    40
                )
            );
        }
        s
    }

    fn result(&self, lines: &[String], key: &str) -> bool {
        lines
            .iter()
            .any(|l| l.starts_with("RESULT ") && l.contains(key))
    }

    /// A counter of the C side's emulated NIC (`EFA_EMU_STATS`).
    fn c_nic_counter(&self, name: &str) -> u64 {
        let line = self
            .c_stderr
            .lines()
            .find(|l| l.starts_with("efa-emu stats:"))
            .unwrap_or_else(|| panic!("no emulator stats line\n{}", self.dump()));
        let key = format!("{name}: ");
        let at = line.find(&key).expect("counter") + key.len();
        line[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|n| n.parse().ok())
            .expect("a number")
    }
}

fn tail(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(n)..].join("\n")
}

fn seed() -> u64 {
    match std::env::var("C_INTEROP_SEED") {
        Ok(s) => s.parse().expect("C_INTEROP_SEED: a number"),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
            t ^ (u64::from(std::process::id()) << 32)
        }
    }
}

/// How the Rust peer runs: inside this test binary on the `udp` device, or as
/// `examples/c-interop-peer` (built with the `efa` feature) on the crate's `efa` device under
/// an emulated NIC of its own.
enum Launcher {
    TestBinary,
    Efa { exe: PathBuf, addr: String },
}

fn spawn_rust(
    inc: u32,
    how: &Launcher,
    emu_args: &[&str],
    env: &[(String, String)],
    dir: &Path,
    tx: &Sender<Ev>,
) -> Child {
    let err = File::create(dir.join(format!("rust{inc}.err"))).expect("stderr file");
    let mut c = match how {
        Launcher::TestBinary => {
            let mut c = Command::new(std::env::current_exe().expect("the test binary"));
            c.args([
                "rust_peer_main",
                "--exact",
                "--ignored",
                "--nocapture",
                "-q",
            ]);
            c
        }
        Launcher::Efa { exe, addr } => {
            let mut c = Command::new(EMU);
            c.args(["run", "--addr", addr])
                .args(emu_args)
                .arg("--")
                .arg(exe)
                .env("C_INTEROP_DEVICE", "efa")
                .env("FI_EFA_ENABLE_SHM_TRANSFER", "0")
                .env("EFA_EMU_STATS", "1");
            c
        }
    };
    c.env("C_INTEROP_PEER", inc.to_string())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(err);
    let mut child = c.spawn().expect("start the Rust peer");
    pump(
        Who::Rust(inc),
        child.stdout.take().expect("stdout"),
        tx.clone(),
    );
    child
}

fn run(case: Case) -> Outcome {
    let dir = tempfile::tempdir().expect("temporary directory");
    let c_exe = build_c_peer(dir.path());
    let seed = seed();
    // Addresses unique to this process and case: concurrent runs do not meet.
    let pid = std::process::id();
    let net = format!("127.{}.{}", 100 + pid % 100, 1 + (pid / 100) % 250);
    let c_addr = format!("{net}.{}", case.index);
    let rust_bind = format!("{net}.{}", 100 + case.index);
    let how = match &case.efa_peer {
        None => Launcher::TestBinary,
        Some(exe) => Launcher::Efa {
            exe: exe.clone(),
            addr: rust_bind.clone(),
        },
    };
    let env: Vec<(String, String)> = vec![
        ("C_INTEROP_SEED".into(), seed.to_string()),
        ("C_INTEROP_SIZES".into(), SIZES.into()),
        ("C_INTEROP_BIND".into(), rust_bind),
        (
            "C_INTEROP_RDMA".into(),
            if case.rust_rdma { "1" } else { "0" }.into(),
        ),
    ];

    let (tx, rx) = channel();
    let c_err = dir.path().join("c.err");
    let mut c = Command::new(EMU);
    c.arg("run")
        .args(["--addr", &c_addr])
        .args(&case.emu_args)
        .arg("--")
        .arg(&c_exe)
        .arg(seed.to_string())
        .arg(SIZES)
        .env("FI_PROVIDER", "efa")
        .env("FI_EFA_ENABLE_SHM_TRANSFER", "0")
        .env("EFA_EMU_STATS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(File::create(&c_err).expect("stderr file"));
    let mut c_child = c.spawn().expect("start the C peer under efa-emu");
    let mut c_in: Option<ChildStdin> = c_child.stdin.take();
    pump(Who::C, c_child.stdout.take().expect("stdout"), tx.clone());

    let mut rust: Vec<Child> = vec![spawn_rust(1, &how, &case.emu_args, &env, dir.path(), &tx)];
    let mut rust_in: Option<ChildStdin> = rust[0].stdin.take();
    let mut c_lines = Vec::new();
    let mut rust_lines = vec![Vec::new()];
    let mut c_done = false;
    let mut rust_done = false;
    let deadline = Instant::now() + Duration::from_secs(240);
    while !(c_done && rust_done) {
        let ev = match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(ev) => ev,
            Err(_) if Instant::now() > deadline => {
                c_lines.push("(killed after 240 s)".into());
                let _ = c_child.kill();
                for r in &mut rust {
                    let _ = r.kill();
                }
                break;
            }
            Err(_) => continue,
        };
        match ev {
            Ev::Line(Who::C, l) => {
                if let Some(m) = l.strip_prefix('@') {
                    if let Some(w) = rust_in.as_mut() {
                        let _ = writeln!(w, "{m}");
                    }
                }
                c_lines.push(l);
            }
            Ev::Line(Who::Rust(i), l) => {
                if let Some(m) = l.strip_prefix('@') {
                    if let Some(w) = c_in.as_mut() {
                        let _ = writeln!(w, "{m}");
                    }
                }
                rust_lines[i as usize - 1].push(l);
            }
            Ev::Eof(Who::C) => {
                c_done = true;
                c_in = None;
                rust_in = None;
                // The C side is gone: a Rust peer waiting for it has no one to talk to.
                if !rust_done {
                    std::thread::sleep(Duration::from_millis(500));
                    for r in &mut rust {
                        let _ = r.kill();
                    }
                }
            }
            Ev::Eof(Who::Rust(i)) => {
                let st = rust[i as usize - 1].wait().expect("wait for the Rust peer");
                if i == 1 && st.success() && !c_done {
                    // The restart: a new process, a new address and connid.
                    let mut r = spawn_rust(2, &how, &case.emu_args, &env, dir.path(), &tx);
                    rust_in = r.stdin.take();
                    rust.push(r);
                    rust_lines.push(Vec::new());
                } else {
                    rust_done = true;
                    rust_in = None;
                    if !c_done && !st.success() {
                        std::thread::sleep(Duration::from_millis(500));
                        let _ = c_child.kill();
                    }
                }
            }
        }
    }
    drop(c_in);
    let c_status = c_child.wait().expect("wait for the C side");
    let rust_status: Vec<ExitStatus> = rust
        .iter_mut()
        .map(|r| r.wait().expect("wait for the Rust peer"))
        .collect();
    let rust_stderr = (1..=rust.len())
        .map(|i| {
            std::fs::read_to_string(dir.path().join(format!("rust{i}.err"))).unwrap_or_default()
        })
        .collect();
    Outcome {
        c_status,
        rust_status,
        c_lines,
        rust_lines,
        c_stderr: std::fs::read_to_string(&c_err).unwrap_or_default(),
        rust_stderr,
        seed,
    }
}

/// Both sides finished every phase, each checking what it received.
fn check_all_phases(o: &Outcome) {
    assert!(
        o.c_status.success()
            && o.rust_status.len() == 2
            && o.rust_status.iter().all(|s| s.success()),
        "a side failed\n{}",
        o.dump()
    );
    let k = SIZES.split(',').count();
    let n = k * rust_peer::GROUPS;
    let c_phases = [
        format!("phase=1 tagged_recv count={n}"),
        format!("phase=2 tagged_send count={n}"),
        format!("phase=3 dc_recv count={k}"),
        format!("phase=4 dc_send count={k}"),
        format!("phase=5 rma_initiator sizes={k}"),
        format!("phase=6 rma_target sizes={k}"),
        "phase=7 atomic_initiator ops=3".into(),
        "phase=8 atomic_target elements=8".into(),
        "phase=9 stale_sent count=3".into(),
        format!("phase=10 tagged_send count={n}"),
        format!("phase=11 tagged_recv count={n}"),
        "done ".into(),
    ];
    for p in &c_phases {
        assert!(
            o.result(&o.c_lines, p),
            "C side: no RESULT {p}\n{}",
            o.dump()
        );
    }
    let rust1 = [
        format!("phase=1 tagged_send count={n}"),
        format!("phase=2 tagged_recv count={n}"),
        format!("phase=3 dc_send count={k}"),
        format!("phase=4 dc_recv count={k}"),
        format!("phase=5 rma_target sizes={k}"),
        format!("phase=6 rma_initiator sizes={k}"),
        "phase=7 atomic_target elements=8".into(),
        "phase=8 atomic_initiator ops=3".into(),
        "incarnation=1 ".into(),
    ];
    for p in &rust1 {
        assert!(
            o.result(&o.rust_lines[0], p),
            "Rust peer 1: no RESULT {p}\n{}",
            o.dump()
        );
    }
    // Every packet libfabric sent decoded and was used: a wire difference shows here first.
    for (i, lines) in o.rust_lines.iter().enumerate() {
        let stats = lines
            .iter()
            .find(|l| l.starts_with("STATS "))
            .unwrap_or_else(|| panic!("Rust peer {}: no STATS line\n{}", i + 1, o.dump()));
        for zero in ["dropped_pkts=0 ", "malformed_dropped=0"] {
            assert!(
                stats.contains(zero),
                "Rust peer {}: {stats}\n{}",
                i + 1,
                o.dump()
            );
        }
    }
    for p in [
        format!("phase=10 fresh_recv count={n}"),
        format!("phase=11 tagged_send count={n}"),
        "incarnation=2 ".into(),
    ] {
        assert!(
            o.result(&o.rust_lines[1], &p),
            "Rust peer 2: no RESULT {p}\n{}",
            o.dump()
        );
    }
}

/// Device RDMA read on both NICs: libfabric reads the crate's region sends (long-read) and
/// serves fi_read by RDMA; the crate reads libfabric's long-read sends. libfabric 1.17 has no
/// RDMA write, so writes are emulated (or LONGREAD_RTW) both ways.
#[test]
#[ignore = "needs cc, libfabric-dev and the emulator; run by .ci/run"]
fn libfabric_and_the_crate_with_device_rdma_read() {
    let o = run(Case {
        emu_args: vec![],
        rust_rdma: true,
        index: 1,
        efa_peer: None,
    });
    check_all_phases(&o);
    let reads = o.c_nic_counter("rdma_reads_posted");
    assert!(
        reads > 0,
        "long-read expected on the C side's NIC\n{}",
        o.dump()
    );
    println!("{}", o.dump());
}

/// No device RDMA on either side: long-CTS messages, emulated RMA (RTW/RTR) both ways.
#[test]
#[ignore = "needs cc, libfabric-dev and the emulator; run by .ci/run"]
fn libfabric_and_the_crate_without_device_rdma() {
    let o = run(Case {
        emu_args: vec!["--caps", "rnr_retry"],
        rust_rdma: false,
        index: 2,
        efa_peer: None,
    });
    check_all_phases(&o);
    assert_eq!(o.c_nic_counter("rdma_reads_posted"), 0, "{}", o.dump());
    println!("{}", o.dump());
}

/// The C side's NIC drops, duplicates and reorders its datagrams (seeded): SRD hides the loss,
/// but libfabric's packets reach the crate out of order (reorder window, medium segments,
/// CTSDATA windows) and the crate's acknowledgements and retransmissions meet the emulator's.
#[test]
#[ignore = "needs cc, libfabric-dev and the emulator; run by .ci/run"]
fn libfabric_and_the_crate_under_loss_and_reordering() {
    let o = run(Case {
        emu_args: vec!["--faults", "seed=5,drop=0.02,dup=0.02,reorder=0.05"],
        rust_rdma: true,
        index: 5,
        efa_peer: None,
    });
    check_all_phases(&o);
    println!("{}", o.dump());
}

fn efa_peer() -> PathBuf {
    PathBuf::from(std::env::var("C_INTEROP_EFA_PEER").expect(
        "C_INTEROP_EFA_PEER: the path of examples/c-interop-peer built with --features efa",
    ))
}

/// A counter from a Rust peer's `STATS` line.
fn rust_counter(o: &Outcome, incarnation: usize, name: &str) -> u64 {
    let key = format!("{name}=");
    o.rust_lines[incarnation - 1]
        .iter()
        .filter(|l| l.starts_with("STATS "))
        .flat_map(|l| l.split_whitespace())
        .find_map(|w| w.strip_prefix(&key)?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} counter\n{}", o.dump()))
}

/// The crate's efa device (the hardware path) on an emulated NIC of its own, against libfabric
/// on another: `C_INTEROP_EFA_PEER` names `examples/c-interop-peer` built with the `efa`
/// feature (`.ci/run` builds it). Both NICs serve RDMA reads: each side reads the other's
/// long-read messages, and both read the other's memory (fi_read, `Endpoint::read`).
#[test]
#[ignore = "needs cc, libfabric-dev, the emulator and C_INTEROP_EFA_PEER; run by .ci/run"]
fn libfabric_and_the_crate_on_its_efa_device() {
    let o = run(Case {
        emu_args: vec![],
        rust_rdma: true,
        index: 3,
        efa_peer: Some(efa_peer()),
    });
    check_all_phases(&o);
    assert!(o.c_nic_counter("rdma_reads_posted") > 0, "{}", o.dump());
    assert!(rust_counter(&o, 1, "rdma_ops") > 0, "{}", o.dump());
    assert!(rust_counter(&o, 2, "rdma_ops") > 0, "{}", o.dump());
    println!("{}", o.dump());
}

/// The same on NICs without RDMA: long-CTS messages, emulated RMA.
#[test]
#[ignore = "needs cc, libfabric-dev, the emulator and C_INTEROP_EFA_PEER; run by .ci/run"]
fn libfabric_and_the_crate_on_its_efa_device_without_device_rdma() {
    let o = run(Case {
        emu_args: vec!["--caps", "rnr_retry"],
        rust_rdma: false,
        index: 4,
        efa_peer: Some(efa_peer()),
    });
    check_all_phases(&o);
    assert_eq!(o.c_nic_counter("rdma_reads_posted"), 0, "{}", o.dump());
    assert_eq!(rust_counter(&o, 1, "rdma_ops"), 0, "{}", o.dump());
    println!("{}", o.dump());
}
