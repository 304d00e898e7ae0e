//! Device-level tests of the `shm` software device, through the `Device` / `QueuePair` traits.
//!
//! Every test opens its devices on its own temporary directory (under `/dev/shm` where it
//! exists), so parallel runs never share segment files. Randomised tests take `test_seed()` (set
//! `EFA_TEST_SEED` to replay) and print it in their assertion messages. There are no timing
//! assertions: deadlines only turn a hang into a failure.
//!
//! Tests named `child_*` are helpers the parent tests run in a child process (the test binary
//! re-executed with `--exact <name> --ignored`); they do nothing when run on their own.

#[allow(dead_code)]
#[path = "common/seam.rs"]
mod seam;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::shm::{ShmConfig, ShmDevice, cma};
use efa::device::{Device, DeviceKind, Opcode, QpAttr, QpType, QueuePair, SendWr, Status};
use efa::fault::{Rng, test_seed};
use efa::notify::Notifier;
use efa::{ErrorKind, Gid, RawAddr};
use seam::{attr, poll_for, poll_until, wr};

/// Overall deadline of one wait: generous, only there to fail instead of hanging.
const DEADLINE: Duration = Duration::from_secs(60);

/// A private directory for one test's segments.
fn test_dir() -> tempfile::TempDir {
    let base = Path::new("/dev/shm");
    let b = tempfile::Builder::new()
        .prefix("efa-shm-test-")
        .tempdir_in(if base.is_dir() {
            base.to_path_buf()
        } else {
            std::env::temp_dir()
        });
    b.expect("create a temporary directory")
}

fn small_cfg(dir: &Path) -> ShmConfig {
    ShmConfig::in_dir(dir).with_mtu(8192).with_ring_slots(64)
}

fn open(cfg: ShmConfig) -> Arc<ShmDevice> {
    ShmDevice::open(cfg).expect("open shm device")
}

fn qp(dev: &ShmDevice, ty: QpType, n: &Arc<Notifier>) -> Box<dyn QueuePair> {
    dev.create_qp(attr(ty, n)).expect("create qp")
}

fn segment_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(efa::device::shm::FILE_PREFIX))
        .collect();
    v.sort();
    v
}

// ------------------------------------------------------------------------------------------
// 1. Datagrams in one process
// ------------------------------------------------------------------------------------------

#[test]
fn attributes_and_addressing() {
    let dir = test_dir();
    let dev = open(ShmConfig::in_dir(dir.path()));
    let a = dev.attr();
    assert_eq!(a.kind, DeviceKind::Shm);
    assert_eq!(a.name, "shm");
    assert_eq!(a.mtu, 64 << 10);
    assert_eq!(a.max_sge, 2);
    assert!(a.caps.rnr_retry);
    assert_eq!(&a.gid.0[..4], &[0xfd, 0, 0, 5]);
    let n = Arc::new(Notifier::new());
    let q = qp(&dev, QpType::Srd, &n);
    let addr = q.addr();
    assert_eq!(addr.gid, a.gid);
    assert_ne!(addr.qpn, 0);
    // The string form round-trips, and the segment is where the QPN says.
    assert_eq!(addr.to_string().parse::<RawAddr>().unwrap(), addr);
    assert!(dev.segment_path(addr.qpn).exists());
    // A second device on the same directory has the same GID; another directory does not.
    let dev2 = open(ShmConfig::in_dir(dir.path()));
    assert_eq!(dev2.attr().gid, a.gid);
    let other = test_dir();
    assert_ne!(open(ShmConfig::in_dir(other.path())).attr().gid, a.gid);
    // QPNs are unique in the directory across devices.
    let q2 = qp(&dev2, QpType::Ud, &n);
    assert_ne!(q2.addr().qpn, addr.qpn);
    assert_eq!(segment_files(dir.path()).len(), 2);
}

#[test]
fn srd_to_itself() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    let mut a = qp(&dev, QpType::Srd, &n);
    a.post_recv(1, BytesMut::with_capacity(16)).unwrap();
    a.post_send(wr(2, a.addr(), b"", b"me", None)).unwrap();
    let got = poll_until(&mut [&mut a], &n, "self", |c| c.len() >= 2);
    assert!(
        got.iter().all(|(_, c)| c.status == Status::Success),
        "{got:?}"
    );
}

/// The payload of datagram `i` of sender `s`: its identity, then bytes derived from it.
fn datagram(seed: u64, s: u64, i: u64, mtu: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ (s << 40) ^ i.wrapping_mul(0x9e37_79b9));
    let len = 16 + rng.below((mtu - 16) as u64 + 1) as usize;
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&s.to_le_bytes());
    v.extend_from_slice(&i.to_le_bytes());
    v.extend((16..len).map(|k| (k as u64 ^ i ^ (s << 3)) as u8));
    v
}

#[test]
fn srd_many_senders_exactly_once() {
    let seed = test_seed();
    let dir = test_dir();
    let cfg = ShmConfig::in_dir(dir.path())
        .with_mtu(16 << 10)
        .with_ring_slots(32);
    let mtu = cfg.mtu;
    let dev = open(cfg);
    const SENDERS: u64 = 4;
    const COUNT: u64 = 1000;
    let rx_n = Arc::new(Notifier::new());
    let mut rx = qp(&dev, QpType::Srd, &rx_n);
    for i in 0..256 {
        rx.post_recv(i, BytesMut::with_capacity(mtu)).unwrap();
    }
    let dest = rx.addr();
    let mut threads = Vec::new();
    for s in 0..SENDERS {
        let dev = dev.clone();
        threads.push(std::thread::spawn(move || {
            let n = Arc::new(Notifier::new());
            let mut a = attr(QpType::Srd, &n);
            a.rnr_retry = 7;
            a.send_depth = 64;
            let mut tx = dev.create_qp(a).unwrap();
            let mut next = 0;
            let mut done = 0;
            let mut out = Vec::new();
            let deadline = Instant::now() + DEADLINE;
            while done < COUNT {
                assert!(
                    Instant::now() < deadline,
                    "seed {seed}: sender {s} stuck at {done}"
                );
                while next < COUNT {
                    let d = datagram(seed, s, next, mtu);
                    let (h, p) = d.split_at(16);
                    let w = wr(next, dest, h, p, Some(next as u32));
                    match tx.post_send(w) {
                        Ok(()) => next += 1,
                        Err(e) if e.kind() == ErrorKind::Again => break,
                        Err(e) => panic!("seed {seed}: {e}"),
                    }
                }
                let seen = n.generation();
                out.clear();
                if tx.poll(&mut out, 64) == 0 {
                    n.wait_until(seen, Some(Instant::now() + Duration::from_millis(5)));
                }
                for c in &out {
                    assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
                    done += 1;
                }
            }
        }));
    }
    let mut seen = HashSet::new();
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while seen.len() < (SENDERS * COUNT) as usize {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: only {} datagrams",
            seen.len()
        );
        let g = rx_n.generation();
        out.clear();
        if rx.poll(&mut out, 64) == 0 {
            rx_n.wait_until(g, Some(Instant::now() + Duration::from_millis(5)));
        }
        for c in out.drain(..) {
            assert_eq!(c.status, Status::Success, "seed {seed}: {c:?}");
            let buf = c.buf.unwrap();
            let s = u64::from_le_bytes(buf[..8].try_into().unwrap());
            let i = u64::from_le_bytes(buf[8..16].try_into().unwrap());
            assert_eq!(
                &buf[..],
                &datagram(seed, s, i, mtu)[..],
                "seed {seed}: {s}/{i}"
            );
            assert_eq!(c.imm, Some(i as u32));
            assert!(seen.insert((s, i)), "seed {seed}: duplicate {s}/{i}");
            rx.post_recv(c.wr_id, buf).unwrap();
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    // Nothing more arrives.
    assert!(poll_for(&mut [&mut rx], Duration::from_millis(50)).is_empty());
    let s = dev.stats();
    assert_eq!(s.rx_pkts, SENDERS * COUNT, "seed {seed}: {s:?}");
    assert_eq!(s.malformed_dropped, 0, "seed {seed}: {s:?}");
}

#[test]
fn ud_full_ring_drops_and_counts() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()).with_ring_slots(4));
    let n = Arc::new(Notifier::new());
    let mut a = qp(&dev, QpType::Ud, &n);
    let b_n = Arc::new(Notifier::new());
    let mut b = qp(&dev, QpType::Ud, &b_n);
    // No receive buffers: UD datagrams are dropped (counted), sends still succeed.
    for i in 0..20 {
        a.post_send(wr(i, b.addr(), b"", b"lost", None)).unwrap();
    }
    let got = poll_until(&mut [&mut a], &n, "UD sends", |c| c.len() >= 20);
    assert!(got.iter().all(|(_, c)| c.status == Status::Success));
    let late = poll_for(&mut [&mut b], Duration::from_millis(30));
    assert!(late.is_empty(), "{late:?}");
    assert!(dev.stats().rnr_events >= 20, "{:?}", dev.stats());
}

// ------------------------------------------------------------------------------------------
// 2. Two processes
// ------------------------------------------------------------------------------------------

const DIR_ENV: &str = "EFA_SHM_TEST_DIR";

/// Spawns this test binary running the ignored test `name`, with `dir` in the environment.
fn spawn_child(name: &str, dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(DIR_ENV, dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child test process")
}

/// Reads the child's stdout until a line carries `marker`; returns what follows it.
fn expect_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, marker: &str) -> String {
    loop {
        let l = lines
            .next()
            .unwrap_or_else(|| panic!("child exited before printing {marker}"))
            .unwrap();
        // libtest may print "test child_x ... " in front of it on the same line.
        if let Some((_, rest)) = l.split_once(marker) {
            return rest.trim().to_string();
        }
    }
}

fn child_dir() -> Option<PathBuf> {
    std::env::var_os(DIR_ENV).map(PathBuf::from)
}

/// Child: echoes every datagram on an SRD and a UD queue pair back to the parent's queue pair
/// of the same type (addresses read from stdin), until the parent closes stdin. It sleeps on its
/// notifier between polls (so its NIC thread delivers and wakes it), or busy-polls when
/// `EFA_SHM_BUSY` is set (the environment is inherited from the parent test).
#[test]
#[ignore = "helper run by two_processes_exchange_datagrams in a child process"]
fn child_echo() {
    let Some(dir) = child_dir() else { return };
    let dev = open(small_cfg(&dir));
    let n = Arc::new(Notifier::new());
    let mut srd = {
        let mut a = attr(QpType::Srd, &n);
        a.rnr_retry = 7;
        dev.create_qp(a).unwrap()
    };
    let mut ud = qp(&dev, QpType::Ud, &n);
    for i in 0..64 {
        srd.post_recv(i, BytesMut::with_capacity(8192)).unwrap();
        ud.post_recv(i, BytesMut::with_capacity(8192)).unwrap();
    }
    println!("SHM_CHILD {} {}", srd.addr(), ud.addr());
    let mut lines = BufReader::new(std::io::stdin()).lines();
    let parent = lines.next().unwrap().unwrap();
    let (p_srd, p_ud) = parent.split_once(' ').unwrap();
    let p_srd: RawAddr = p_srd.parse().unwrap();
    let p_ud: RawAddr = p_ud.parse().unwrap();
    // Stdin closing tells us to stop.
    let (stop_tx, stop_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for _ in lines {}
        let _ = stop_tx.send(());
    });
    let deadline = Instant::now() + DEADLINE * 2;
    let mut out = Vec::new();
    while stop_rx.try_recv().is_err() {
        assert!(Instant::now() < deadline, "child: parent never finished");
        let seen = n.generation();
        let mut got = 0;
        for (q, dest) in [(&mut srd, p_srd), (&mut ud, p_ud)] {
            out.clear();
            got += q.poll(&mut out, 64);
            for c in out.drain(..) {
                assert!(c.status.is_ok(), "child: {c:?}");
                if c.opcode != Opcode::Recv {
                    continue;
                }
                let buf = c.buf.unwrap();
                q.post_send(SendWr {
                    wr_id: 0,
                    dest,
                    hdr: Bytes::new(),
                    payload: Bytes::copy_from_slice(&buf),
                    imm: c.imm,
                })
                .unwrap();
                q.post_recv(c.wr_id, buf).unwrap();
            }
        }
        if got == 0 && std::env::var_os("EFA_SHM_BUSY").is_none() {
            n.wait_until(seen, Some(Instant::now() + Duration::from_millis(10)));
        }
    }
}

#[test]
fn two_processes_exchange_datagrams() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    let mut srd = {
        let mut a = attr(QpType::Srd, &n);
        a.rnr_retry = 7;
        dev.create_qp(a).unwrap()
    };
    let mut ud = qp(&dev, QpType::Ud, &n);
    for i in 0..64 {
        srd.post_recv(i, BytesMut::with_capacity(8192)).unwrap();
        ud.post_recv(i, BytesMut::with_capacity(8192)).unwrap();
    }
    let mut child = spawn_child("child_echo", dir.path());
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addrs = expect_line(&mut lines, "SHM_CHILD ");
    let (c_srd, c_ud) = addrs.split_once(' ').unwrap();
    let c_srd: RawAddr = c_srd.parse().unwrap();
    let c_ud: RawAddr = c_ud.parse().unwrap();
    let mut stdin: ChildStdin = child.stdin.take().unwrap();
    writeln!(stdin, "{} {}", srd.addr(), ud.addr()).unwrap();
    stdin.flush().unwrap();

    // SRD: 200 datagrams of various sizes, each echoed exactly once.
    let mut echoed = HashMap::new();
    let mut out = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    let mut next = 0u64;
    while echoed.len() < 200 {
        assert!(Instant::now() < deadline, "SRD echoes: {}", echoed.len());
        while next < 200 && next < echoed.len() as u64 + 32 {
            let p = vec![next as u8; 1 + (next as usize * 37) % 8000];
            srd.post_send(wr(next, c_srd, &next.to_le_bytes(), &p, Some(next as u32)))
                .unwrap();
            next += 1;
        }
        let seen = n.generation();
        out.clear();
        if srd.poll(&mut out, 64) == 0 {
            n.wait_until(seen, Some(Instant::now() + Duration::from_millis(5)));
        }
        for c in out.drain(..) {
            assert!(c.status.is_ok(), "{c:?}");
            if c.opcode == Opcode::Recv {
                let buf = c.buf.unwrap();
                let i = u64::from_le_bytes(buf[..8].try_into().unwrap());
                assert_eq!(buf.len(), 8 + 1 + (i as usize * 37) % 8000);
                assert!(buf[8..].iter().all(|b| *b == i as u8));
                assert_eq!(c.imm, Some(i as u32));
                assert_eq!(c.src.unwrap().qpn, c_srd.qpn, "source names the child");
                assert!(echoed.insert(i, ()).is_none(), "duplicate echo {i}");
                srd.post_recv(c.wr_id, buf).unwrap();
            }
        }
    }

    // Ping-pong of 64-byte SRD datagrams: one in flight at a time.
    let rounds = 2000;
    let msg = [7u8; 64];
    let start = Instant::now();
    for r in 0..rounds {
        srd.post_send(wr(r, c_srd, b"", &msg, None)).unwrap();
        'wait: loop {
            out.clear();
            srd.poll(&mut out, 16);
            for c in out.drain(..) {
                if c.opcode == Opcode::Recv {
                    srd.post_recv(c.wr_id, c.buf.unwrap()).unwrap();
                    break 'wait;
                }
            }
            assert!(start.elapsed() < DEADLINE, "ping-pong stalled at {r}");
        }
    }
    let rtt = start.elapsed() / rounds as u32;
    println!(
        "shm SRD ping-pong, 64 B, two processes: {:.2} us round trip, {:.2} us one way",
        rtt.as_secs_f64() * 1e6,
        rtt.as_secs_f64() * 1e6 / 2.0
    );

    // UD: may drop in principle, so resend until echoed (shared memory does not lose while
    // buffers are posted).
    for i in 0..50u64 {
        let id = 1000 + i;
        'resend: loop {
            ud.post_send(wr(id, c_ud, &id.to_le_bytes(), b"ud", None))
                .unwrap();
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until {
                out.clear();
                ud.poll(&mut out, 16);
                for c in out.drain(..) {
                    if c.opcode == Opcode::Recv {
                        let buf = c.buf.unwrap();
                        let got = u64::from_le_bytes(buf[..8].try_into().unwrap());
                        ud.post_recv(c.wr_id, buf).unwrap();
                        if got == id {
                            break 'resend;
                        }
                    }
                }
            }
            assert!(start.elapsed() < DEADLINE * 2, "UD echo {i}");
        }
    }
    drop(stdin);
    assert!(child.wait().unwrap().success(), "child failed");
    // The child closed its queue pairs: its segments are gone.
    let mine: HashSet<String> = [srd.addr().qpn, ud.addr().qpn]
        .iter()
        .map(|q| {
            dev.segment_path(*q)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let left: HashSet<String> = segment_files(dir.path()).into_iter().collect();
    assert_eq!(left, mine);
}

// ------------------------------------------------------------------------------------------
// 3. RNR
// ------------------------------------------------------------------------------------------

#[test]
fn progress_without_polling() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let rx_n = Arc::new(Notifier::new());
    let tx_n = Arc::new(Notifier::new());
    let mut rx = qp(&dev, QpType::Srd, &rx_n);
    let mut tx = qp(&dev, QpType::Srd, &tx_n);
    for i in 0..20 {
        rx.post_recv(i, BytesMut::with_capacity(64)).unwrap();
    }
    let tx_seen = tx_n.generation();
    for i in 0..20 {
        tx.post_send(wr(i, rx.addr(), b"", &[i as u8; 32], None))
            .unwrap();
    }
    // A sender with rnr_retry 1 to a queue pair without buffers: the RNR timeout runs too.
    let lone_n = Arc::new(Notifier::new());
    let mut lone = qp(&dev, QpType::Srd, &Arc::new(Notifier::new()));
    let mut rnr_tx = {
        let mut a = attr(QpType::Srd, &lone_n);
        a.rnr_retry = 1;
        dev.create_qp(a).unwrap()
    };
    let lone_seen = lone_n.generation();
    rnr_tx
        .post_send(wr(1, lone.addr(), b"", b"x", None))
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(Instant::now() < deadline, "no progress without polling");
        tx_n.wait_until(tx_seen, Some(Instant::now() + Duration::from_millis(100)));
        if tx_n.generation() != tx_seen
            && rx_n.generation() != 0
            && lone_n.generation() != lone_seen
        {
            break;
        }
    }
    let n2 = Notifier::new();
    let got = poll_until(&mut [&mut tx, &mut rx], &n2, "all", |c| c.len() >= 40);
    assert!(
        got.iter().all(|(_, c)| c.status == Status::Success),
        "{got:?}"
    );
    let got = poll_until(&mut [&mut rnr_tx, &mut lone], &n2, "rnr", |c| !c.is_empty());
    assert_eq!(got[0].1.status, Status::RnrRetryExceeded);
}

// ------------------------------------------------------------------------------------------
// 4. Contract
// ------------------------------------------------------------------------------------------

#[test]
fn unreachable_hosts_gone_qpns_and_wrong_types() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    for ty in [QpType::Ud, QpType::Srd] {
        let mut a = qp(&dev, ty, &n);
        let mut b = qp(&dev, ty, &n);
        // Another GID (another host or directory) is unreachable; a QPN nobody has is gone.
        let mut far = b.addr();
        far.gid = Gid::from_ip("::1".parse().unwrap());
        a.post_send(wr(4, far, b"", b"far", None)).unwrap();
        let mut nobody = b.addr();
        nobody.qpn = if nobody.qpn == 1 { 2 } else { nobody.qpn - 1 };
        if nobody.qpn == a.addr().qpn {
            nobody.qpn = nobody.qpn.wrapping_sub(1).max(1);
        }
        a.post_send(wr(5, nobody, b"", b"none", None)).unwrap();
        let got = poll_until(&mut [&mut a], &n, "far", |c| c.len() >= 2);
        let st: HashMap<u64, Status> = got.iter().map(|(_, c)| (c.wr_id, c.status)).collect();
        assert_eq!(st[&4], Status::UnreachableRemote, "{ty:?}");
        let gone = if ty == QpType::Ud {
            Status::Success
        } else {
            Status::UnresponsiveRemote
        };
        assert_eq!(st[&5], gone, "{ty:?}");
        // b itself is reachable.
        b.post_recv(1, BytesMut::with_capacity(64)).unwrap();
        a.post_send(wr(6, b.addr(), b"", b"fresh", None)).unwrap();
        let got = poll_until(&mut [&mut a, &mut b], &n, "fresh", |c| c.len() >= 2);
        assert!(
            got.iter().all(|(_, c)| c.status == Status::Success),
            "{got:?}"
        );
    }
    // SRD to a UD queue pair: dropped as foreign.
    let mut s = qp(&dev, QpType::Srd, &n);
    let mut u = qp(&dev, QpType::Ud, &n);
    u.post_recv(1, BytesMut::with_capacity(64)).unwrap();
    s.post_send(wr(1, u.addr(), b"", b"x", None)).unwrap();
    let got = poll_until(&mut [&mut s, &mut u], &n, "type", |c| !c.is_empty());
    assert_eq!(got[0].0, 0);
    assert_eq!(got[0].1.status, Status::UnresponsiveRemote);
}

#[test]
fn srd_closed_peer_is_unresponsive() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    let mut tx = {
        let mut a = attr(QpType::Srd, &n);
        a.rnr_retry = 7;
        dev.create_qp(a).unwrap()
    };
    let rx = qp(&dev, QpType::Srd, &n);
    // Outstanding sends (RNR forever), then the receiver closes.
    for i in 0..3 {
        tx.post_send(wr(i, rx.addr(), b"", b"x", None)).unwrap();
    }
    let early = poll_for(&mut [&mut tx], Duration::from_millis(20));
    assert!(early.is_empty(), "{early:?}");
    let dead = rx.addr();
    drop(rx);
    tx.post_send(wr(3, dead, b"", b"after", None)).unwrap();
    let got = poll_until(&mut [&mut tx], &n, "unresponsive", |c| c.len() >= 4);
    for (_, c) in &got {
        assert_eq!(c.status, Status::UnresponsiveRemote, "{c:?}");
        assert_eq!(c.status.error_kind(), ErrorKind::ConnectionAborted);
    }
    assert!(segment_files(dir.path()).len() == 1);
}

// ------------------------------------------------------------------------------------------
// 5. Dead peers
// ------------------------------------------------------------------------------------------

/// Child: opens an SRD queue pair without receive buffers, announces it, and waits to be killed.
#[test]
#[ignore = "helper run by dead_peer_* in a child process"]
fn child_sleeper() {
    let Some(dir) = child_dir() else { return };
    let dev = open(small_cfg(&dir));
    let n = Arc::new(Notifier::new());
    let q = qp(&dev, QpType::Srd, &n);
    println!("SHM_SLEEPER {}", q.addr());
    // Parent kills us; stop by ourselves in the end anyway (stdin closes when the parent dies).
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    std::thread::sleep(Duration::from_secs(1));
}

fn spawn_sleeper(dir: &Path) -> (Child, RawAddr) {
    let mut child = spawn_child("child_sleeper", dir);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr: RawAddr = expect_line(&mut lines, "SHM_SLEEPER ").parse().unwrap();
    (child, addr)
}

#[test]
fn dead_peer_fails_sends_and_is_cleaned_up() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    let (mut child, child_addr) = spawn_sleeper(dir.path());
    let seg = dev.segment_path(child_addr.qpn);
    assert!(seg.exists());
    let mut tx = {
        let mut a = attr(QpType::Srd, &n);
        a.rnr_retry = 7;
        dev.create_qp(a).unwrap()
    };
    for i in 0..5 {
        tx.post_send(wr(i, child_addr, b"", b"are you there", None))
            .unwrap();
    }
    // The child's device refuses them (no buffers): wait until the sender has seen RNR.
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while dev.stats().rnr_naks_received == 0 {
        assert!(Instant::now() < deadline, "no RNR from the child");
        tx.poll(&mut out, 8);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(out.is_empty(), "{out:?}");
    child.kill().unwrap(); // SIGKILL: no cleanup in the child
    child.wait().unwrap();
    let got = poll_until(&mut [&mut tx], &n, "dead peer", |c| c.len() >= 5);
    for (_, c) in &got {
        assert_eq!(c.status, Status::UnresponsiveRemote, "{c:?}");
    }
    assert!(!seg.exists(), "the dead peer's segment was removed");
    // Later sends to it fail at once.
    tx.post_send(wr(9, child_addr, b"", b"hello?", None))
        .unwrap();
    let got = poll_until(&mut [&mut tx], &n, "gone", |c| !c.is_empty());
    assert_eq!(got[0].1.status, Status::UnresponsiveRemote);
    // Only our own segment is left.
    assert_eq!(
        segment_files(dir.path()).len(),
        1,
        "{:?}",
        segment_files(dir.path())
    );
}

#[test]
fn dead_peer_segment_is_swept_on_open() {
    let dir = test_dir();
    let (mut child, child_addr) = spawn_sleeper(dir.path());
    // A live child's segment survives a sweep.
    let dev = open(small_cfg(dir.path()));
    let seg = dev.segment_path(child_addr.qpn);
    assert_eq!(dev.sweep(), 0);
    assert!(seg.exists());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(seg.exists(), "nobody noticed yet");
    // A half-created file of a dead process is swept too (pid 0x7fff_fff0 does not exist).
    let uid = std::fs::metadata(&seg).map(|m| {
        use std::os::unix::fs::MetadataExt;
        m.uid()
    });
    let tmp = dir
        .path()
        .join(format!("efa-shm-{}-tmp-2147483632-0", uid.unwrap()));
    std::fs::write(&tmp, b"half").unwrap();
    let dev2 = open(small_cfg(dir.path()));
    assert!(
        !seg.exists(),
        "opening a device sweeps a dead process's segment"
    );
    assert!(!tmp.exists(), "and its half-created files");
    assert_eq!(dev2.sweep(), 0);
    // A foreign file is left alone.
    let foreign = dir.path().join("not-ours");
    std::fs::write(&foreign, b"x").unwrap();
    assert_eq!(dev2.sweep(), 0);
    assert!(foreign.exists());
}

// ------------------------------------------------------------------------------------------
// 6. Garbage in shared memory
// ------------------------------------------------------------------------------------------

fn scribble(path: &Path, rng: &mut Rng, at_most: usize) {
    use std::os::unix::fs::FileExt;
    let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) else {
        return;
    };
    let len = f.metadata().unwrap().len().max(1);
    for _ in 0..1 + rng.below(at_most as u64) {
        // Half the writes go to the first 4 KiB (header, acks, first slots).
        let off = if rng.chance(0.5) {
            rng.below(4096.min(len))
        } else {
            rng.below(len)
        };
        let n = 1 + rng.below(64) as usize;
        let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
        let _ = f.write_at(&bytes, off);
    }
}

#[test]
fn garbage_in_segments_is_dropped_and_counted() {
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    let dir = test_dir();
    let dev = open(
        small_cfg(dir.path())
            .with_ring_slots(8)
            .with_unresponsive_timeout(Duration::from_millis(200)),
    );
    let n = Arc::new(Notifier::new());
    for round in 0..6 {
        let ty = if round % 2 == 0 {
            QpType::Srd
        } else {
            QpType::Ud
        };
        let mut rx = qp(&dev, ty, &n);
        let mut tx = {
            let mut a = attr(ty, &n);
            a.rnr_retry = 2;
            dev.create_qp(a).unwrap()
        };
        for i in 0..16 {
            rx.post_recv(i, BytesMut::with_capacity(128)).unwrap();
        }
        let rx_path = dev.segment_path(rx.addr().qpn);
        let tx_path = dev.segment_path(tx.addr().qpn);
        let mut sent = 0u64;
        let mut completed = 0;
        let end = Instant::now() + Duration::from_millis(300);
        let mut out = Vec::new();
        while Instant::now() < end {
            scribble(&rx_path, &mut rng, 8);
            if rng.chance(0.3) {
                scribble(&tx_path, &mut rng, 4);
            }
            for _ in 0..4 {
                if tx
                    .post_send(wr(sent, rx.addr(), b"", &[sent as u8; 100], None))
                    .is_ok()
                {
                    sent += 1;
                }
            }
            out.clear();
            tx.poll(&mut out, 64);
            completed += out.len();
            out.clear();
            rx.poll(&mut out, 64);
            for c in out.drain(..) {
                if let Some(b) = c.buf {
                    let _ = rx.post_recv(c.wr_id, b);
                }
            }
        }
        // Every send completes (whatever its status) within the deadline: nothing hangs.
        let deadline = Instant::now() + DEADLINE;
        while completed < sent as usize {
            assert!(
                Instant::now() < deadline,
                "seed {seed} round {round}: {completed} of {sent} sends completed"
            );
            out.clear();
            let seen = n.generation();
            if tx.poll(&mut out, 64) == 0 {
                n.wait_until(seen, Some(Instant::now() + Duration::from_millis(5)));
            }
            completed += out.len();
            out.clear();
            rx.poll(&mut out, 64);
        }
        drop(tx);
        drop(rx);
    }
    let s = dev.stats();
    assert!(
        s.malformed_dropped > 0,
        "seed {seed}: garbage not counted: {s:?}"
    );
    // A fresh pair still works.
    let mut a = qp(&dev, QpType::Srd, &n);
    let mut b = qp(&dev, QpType::Srd, &n);
    b.post_recv(1, BytesMut::with_capacity(64)).unwrap();
    a.post_send(wr(2, b.addr(), b"", b"still works", None))
        .unwrap();
    let got = poll_until(&mut [&mut a, &mut b], &n, "fresh pair", |c| c.len() >= 2);
    assert!(
        got.iter().all(|(_, c)| c.status == Status::Success),
        "seed {seed}: {got:?}"
    );
}

#[test]
fn forged_segment_files_are_refused() {
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    let mut tx = qp(&dev, QpType::Srd, &n);
    let mut udp_like = qp(&dev, QpType::Ud, &n);
    // A real segment to copy a valid header from.
    let real = qp(&dev, QpType::Srd, &n);
    let real_bytes = std::fs::read(dev.segment_path(real.addr().qpn)).unwrap();
    let gid = dev.attr().gid;
    let mut forged: Vec<(u16, Vec<u8>)> = vec![
        (40_001, Vec::new()),                                        // empty file
        (40_002, real_bytes[..100].to_vec()),                        // shorter than a header
        (40_003, real_bytes[..4096].to_vec()), // header says more than the file holds
        (40_004, vec![0xff; 8192]),            // no magic
        (40_005, (0..8192).map(|_| rng.next_u64() as u8).collect()), // noise
    ];
    // Valid magic, absurd geometry.
    let mut absurd = real_bytes[..256].to_vec();
    absurd[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    absurd.resize(8192, 0);
    forged.push((40_006, absurd));
    // A whole valid-looking segment whose owner holds no lock (nobody lives there).
    forged.push((40_007, real_bytes.clone()));
    for (qpn, bytes) in &forged {
        let mut b = bytes.clone();
        if *qpn == 40_007 {
            b[32..36].copy_from_slice(&u32::from(*qpn).to_le_bytes());
        }
        std::fs::write(dev.segment_path(*qpn), &b).unwrap();
        // Mode 0600 like a real segment, so the checks behind the mode are the ones tried
        // (another mode alone is refused: tests/hostile_shm.rs, segment.rs).
        std::fs::set_permissions(
            dev.segment_path(*qpn),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
    }
    let qkey = real.addr().qkey;
    for (i, (qpn, _)) in forged.iter().enumerate() {
        let dest = RawAddr::new(gid, *qpn, qkey);
        tx.post_send(wr(i as u64, dest, b"", b"forged?", None))
            .unwrap();
        udp_like
            .post_send(wr(i as u64, dest, b"", b"forged?", None))
            .unwrap();
    }
    let k = forged.len();
    let got = poll_until(&mut [&mut tx, &mut udp_like], &n, "forged", |c| {
        c.len() >= 2 * k
    });
    for (q, c) in &got {
        if *q == 0 {
            assert_eq!(c.status, Status::UnresponsiveRemote, "seed {seed}: {c:?}");
        } else {
            assert_eq!(c.status, Status::Success, "UD loses silently: {c:?}");
        }
    }
    assert!(dev.stats().malformed_dropped >= 6, "{:?}", dev.stats());
    // The lock-less copy is noticed as dead and removed.
    assert!(!dev.segment_path(40_007).exists());
}

#[test]
fn slot_reserved_by_a_dead_writer_is_skipped() {
    use std::os::unix::fs::FileExt;
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    // A UD receiver: no acknowledgement table, so its ring starts right after the 256-byte
    // header (docs/shm-device.md).
    let mut rx = qp(&dev, QpType::Ud, &n);
    let mut tx = qp(&dev, QpType::Ud, &n);
    rx.post_recv(1, BytesMut::with_capacity(64)).unwrap();
    // Forge what a writer that died between reserving slot 0 and publishing it leaves: the
    // tail moved to 1, slot 0 names a writer whose segment does not exist.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dev.segment_path(rx.addr().qpn))
        .unwrap();
    f.write_at(&1u64.to_le_bytes(), 192).unwrap();
    f.write_at(&40_000u32.to_le_bytes(), 256 + 16).unwrap();
    tx.post_send(wr(1, rx.addr(), b"", b"behind the hole", None))
        .unwrap();
    let got = poll_until(&mut [&mut tx, &mut rx], &n, "skip", |c| {
        c.iter().any(|(q, _)| *q == 1)
    });
    let r = got.iter().find(|(q, _)| *q == 1).unwrap();
    assert_eq!(r.1.status, Status::Success);
    assert_eq!(&r.1.buf.as_ref().unwrap()[..], b"behind the hole");
    assert!(dev.stats().malformed_dropped >= 1, "{:?}", dev.stats());
}

// ------------------------------------------------------------------------------------------
// 7. Cross-memory attach
// ------------------------------------------------------------------------------------------

#[test]
fn cma_probe_reports_permission_or_a_clear_error() {
    // Our own process: always permitted where the kernel has CMA.
    match cma::probe(std::process::id()) {
        Ok(()) => {
            let src = *b"0123456789";
            let mut dst = [0u8; 10];
            let n = cma::read_remote(std::process::id(), src.as_ptr() as u64, &mut dst).unwrap();
            assert_eq!((n, dst), (10, src));
        }
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::NotSupported, "{e}");
            println!("CMA not available: {e}");
        }
    }
    // A child: permitted, or an error that names the fix.
    let mut child = Command::new("sleep").arg("10").spawn().unwrap();
    match cma::probe(child.id()) {
        Ok(()) => println!(
            "CMA towards a child permitted (ptrace_scope {:?})",
            cma::ptrace_scope()
        ),
        Err(e) => {
            let text = e.to_string();
            println!("CMA towards a child refused: {text}");
            match e.kind() {
                ErrorKind::RemoteAccess => {
                    assert!(text.contains("ptrace_scope"), "{text}");
                    assert!(text.contains("PR_SET_PTRACER"), "{text}");
                }
                k => assert_eq!(k, ErrorKind::NotSupported, "{text}"),
            }
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // A process that does not exist.
    let e = cma::probe(0x7fff_fff0).unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::NotConnected | ErrorKind::NotSupported),
        "{e}"
    );
    let e = cma::probe(0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotConnected, "{e}");
}

// ------------------------------------------------------------------------------------------
// Resources
// ------------------------------------------------------------------------------------------

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn dropping_a_queue_pair_stops_its_thread_and_removes_its_segment() {
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let n = Arc::new(Notifier::new());
    let q = qp(&dev, QpType::Srd, &n);
    // QPNs are unique per directory, so another test's thread may carry the same name: count.
    let name = format!("efa-shm-{}", q.addr().qpn);
    let count = || thread_names().iter().filter(|t| **t == name).count();
    let deadline = Instant::now() + DEADLINE;
    while count() == 0 {
        assert!(Instant::now() < deadline, "{:?}", thread_names());
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = count();
    let path = dev.segment_path(q.addr().qpn);
    drop(q);
    // A joined thread stays listed in /proc/self/task for a moment, until the kernel reaps it.
    let deadline = Instant::now() + DEADLINE;
    while count() >= before {
        assert!(Instant::now() < deadline, "the thread was not joined");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!path.exists());
    assert!(segment_files(dir.path()).is_empty());
}

#[test]
fn open_refuses_a_missing_directory_and_bad_config() {
    let e = ShmDevice::open(ShmConfig::in_dir("/nonexistent/efa-shm")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    let e = ShmDevice::open(ShmConfig::default().with_mtu(10)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let dir = test_dir();
    let dev = open(small_cfg(dir.path()));
    let mut a = QpAttr::new(QpType::Srd);
    a.rnr_retry = 8;
    assert_eq!(
        dev.create_qp(a).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}
