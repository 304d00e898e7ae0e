//! RMA and atomics between two processes, over the udp device (with faults) and the shm device:
//! the target registers a region and hands its key to the initiator (through the parent, as an
//! application would out of band); the initiator writes, writes with immediate data, reads back
//! and adds atomically; the target checks every immediate value arrived once and its memory.
//!
//! The test starts this test binary again as two child processes running `rma_role`.

mod common;

use std::io::{BufRead, Write};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use common::*;
use efa::device::Device;
use efa::device::shm::{ShmConfig, ShmDevice};
use efa::fault::{FaultConfig, test_seed};
use efa::{
    Access, AtomicOp, AtomicRequest, AtomicType, CompletionFlags, Config, Domain, RawAddr,
    RemoteKey,
};

const WRITES: usize = 64;
const ADDS: u64 = 50;
const LEN: usize = 200_000;
const BYE_TAG: u64 = 0xb7e;

fn domain(dev: &str, seed: u64) -> Domain {
    let d: Arc<dyn Device> = match dev {
        "udp" => {
            let faults = FaultConfig::seeded(seed)
                .drop(0.05)
                .duplicate(0.05)
                .reorder(0.05);
            return udp_domain(LOCAL4, faults);
        }
        "shm" => {
            let dir = std::env::var("EFA_SHM_DIR").expect("EFA_SHM_DIR");
            ShmDevice::open(ShmConfig::in_dir(dir)).expect("shm device")
        }
        other => panic!("unknown device {other}"),
    };
    Domain::with_device(d, Config::default())
}

/// The region's layout: WRITES slots of LEN/WRITES bytes, then a u64 counter.
fn slot(i: usize) -> (usize, usize) {
    let n = LEN / WRITES;
    (i * n, n)
}

/// One end, run in a child process: `EFA_ROLE` = target | initiator, `EFA_DEV`, `EFA_SEED`.
#[test]
#[ignore = "run in child processes by the tests below"]
fn rma_role() {
    let (Ok(role), Ok(dev), Ok(seed)) = (
        std::env::var("EFA_ROLE"),
        std::env::var("EFA_DEV"),
        std::env::var("EFA_SEED"),
    ) else {
        return;
    };
    let seed: u64 = seed.parse().unwrap();
    let d = domain(&dev, seed);
    let node = Node::new(&d);
    println!("\nADDR {}", node.ep.addr());
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line).unwrap();
    let peer = node.insert(line.trim().parse::<RawAddr>().unwrap());
    match role.as_str() {
        "target" => {
            let mr = d
                .register(
                    vec![0u8; LEN + 8],
                    Access::REMOTE_WRITE | Access::REMOTE_READ,
                )
                .unwrap();
            println!(
                "\nKEY {}",
                serde_json::to_string(&mr.remote_key().unwrap()).unwrap()
            );
            node.ep
                .trecv(BytesMut::with_capacity(8), BYE_TAG, 0, 1)
                .unwrap();
            // WRITES writes with immediate data, then the initiator's bye.
            let done = node.collect(WRITES + 1, "target");
            let mut seen = [false; WRITES];
            for c in &done {
                if c.flags.contains(CompletionFlags::REMOTE_WRITE) {
                    let i = c.data.unwrap() as usize;
                    assert!(!seen[i], "seed {seed}: imm {i} twice");
                    seen[i] = true;
                    assert_eq!(c.len, slot(i).1);
                    assert_eq!(c.source, Some(peer));
                }
            }
            assert!(seen.iter().all(|&s| s), "seed {seed}: an imm is missing");
            let m = mr.read();
            for i in 0..WRITES {
                let (o, n) = slot(i);
                assert!(
                    m[o..o + n] == payload(seed, i, n)[..],
                    "seed {seed}: slot {i}"
                );
            }
            let sum = u64::from_le_bytes(m[LEN..LEN + 8].try_into().unwrap());
            assert_eq!(sum, ADDS * (ADDS + 1) / 2, "seed {seed}: atomic sum");
        }
        "initiator" => {
            line.clear();
            stdin.read_line(&mut line).unwrap();
            let rk: RemoteKey = serde_json::from_str(line.trim()).unwrap();
            for i in 0..WRITES {
                let (o, n) = slot(i);
                let data = payload(seed, i, n);
                loop {
                    match node.ep.write_data(
                        peer,
                        data.clone(),
                        rk.at(o as u64),
                        i as u32,
                        i as u64,
                    ) {
                        Ok(()) => break,
                        Err(e) if e.kind() == efa::ErrorKind::Again => node.ep.progress(),
                        Err(e) => panic!("seed {seed}: write {i}: {e}"),
                    }
                }
            }
            for k in 1..=ADDS {
                let req = AtomicRequest {
                    op: AtomicOp::Sum,
                    datatype: AtomicType::U64,
                    operand: Bytes::copy_from_slice(&k.to_le_bytes()),
                    compare: None,
                };
                loop {
                    match node
                        .ep
                        .atomic(peer, req.clone(), rk.at(LEN as u64), 1000 + k)
                    {
                        Ok(()) => break,
                        Err(e) if e.kind() == efa::ErrorKind::Again => node.ep.progress(),
                        Err(e) => panic!("seed {seed}: atomic {k}: {e}"),
                    }
                }
            }
            node.collect(WRITES + ADDS as usize, "initiator writes");
            // Read everything back in one go.
            node.ep
                .read(peer, BytesMut::new(), LEN, rk.start(), 7)
                .unwrap();
            let got = node.collect(1, "read");
            let b = got[0].buf.as_recv().unwrap();
            for i in 0..WRITES {
                let (o, n) = slot(i);
                assert!(
                    b[o..o + n] == payload(seed, i, n)[..],
                    "seed {seed}: read {i}"
                );
            }
            node.ep
                .tsend(peer, Bytes::from_static(b"bye"), BYE_TAG, 8)
                .unwrap();
            node.collect(1, "bye");
        }
        other => panic!("unknown role {other}"),
    }
    println!("\nOK {role}");
    // Keep the device (which acknowledges) until the parent says the other end is done too.
    line.clear();
    let _ = stdin.read_line(&mut line);
}

fn spawn(role: &str, dev: &str, seed: u64, shm_dir: &str) -> Proc {
    let seed = seed.to_string();
    spawn_test(
        "rma_role",
        &[
            ("EFA_ROLE", role.as_ref()),
            ("EFA_DEV", dev.as_ref()),
            ("EFA_SEED", seed.as_ref()),
            ("EFA_SHM_DIR", shm_dir.as_ref()),
        ],
    )
}

fn run(dev: &str) {
    let seed = test_seed();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let mut t = spawn("target", dev, seed, d);
    let mut i = spawn("initiator", dev, seed, d);
    let ta = read_tagged(&mut t, "ADDR ");
    let ia = read_tagged(&mut i, "ADDR ");
    writeln!(t.stdin, "{ia}").unwrap();
    writeln!(i.stdin, "{ta}").unwrap();
    let key = read_tagged(&mut t, "KEY ");
    writeln!(i.stdin, "{key}").unwrap();
    assert_eq!(read_tagged(&mut i, "OK "), "initiator", "{dev} seed {seed}");
    assert_eq!(read_tagged(&mut t, "OK "), "target", "{dev} seed {seed}");
    writeln!(i.stdin, "exit").unwrap();
    writeln!(t.stdin, "exit").unwrap();
    assert!(i.child.wait().unwrap().success(), "{dev} seed {seed}");
    assert!(t.child.wait().unwrap().success(), "{dev} seed {seed}");
}

#[test]
fn rma_between_two_processes_over_udp() {
    run("udp");
}

#[test]
fn rma_between_two_processes_over_shm() {
    run("shm");
}
