//! RDM message mixes over the udp device between two processes, and between two hosts: two
//! network namespaces joined by a veth pair (needs root; `.ci/run` runs it as root).
//!
//! Both tests start this test binary again as child processes running `host_role`; the parent
//! relays the children's raw addresses between them over their stdin/stdout.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use common::*;
use efa::fault::{FaultConfig, test_seed};
use efa::{CompletionFlags, RawAddr};

const MESSAGES: usize = 120;
const BYE_TAG: u64 = u64::MAX;

/// One end, run in a child process: `EFA_ROLE` = send | recv, `EFA_BIND`, `EFA_SEED`.
#[test]
#[ignore = "run in child processes by the tests below"]
fn host_role() {
    let (Ok(role), Ok(bind), Ok(seed)) = (
        std::env::var("EFA_ROLE"),
        std::env::var("EFA_BIND"),
        std::env::var("EFA_SEED"),
    ) else {
        return;
    };
    let seed: u64 = seed.parse().unwrap();
    let bind: IpAddr = bind.parse().unwrap();
    let faults = FaultConfig::seeded(seed)
        .drop(0.05)
        .duplicate(0.05)
        .reorder(0.05);
    let d = udp_domain(bind, faults);
    let node = Node::new(&d);
    println!("\nADDR {}", node.ep.addr());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let peer_addr: RawAddr = line.trim().parse().unwrap();
    let peer = node.insert(peer_addr);
    let msgs = mix(seed, MESSAGES, 4 << 20);
    match role.as_str() {
        "send" => {
            node.ep
                .trecv(BytesMut::with_capacity(8), BYE_TAG, 0, u64::MAX)
                .unwrap();
            send_mix(&node, peer, seed, &msgs);
            let done = node.collect(msgs.len() + 1, "sender");
            assert_eq!(
                done.iter()
                    .filter(|c| c.flags.contains(CompletionFlags::SEND))
                    .count(),
                msgs.len()
            );
        }
        "recv" => {
            let half = msgs.len() / 2;
            post_mix(&node, Some(peer), seed, &msgs[..half], 0);
            let mut done = node.collect(half.min(10), "receiver");
            post_mix(&node, Some(peer), seed, &msgs[half..], half as u64);
            done.extend(node.collect(msgs.len() - done.len(), "receiver"));
            check_mix(&done, seed, &msgs, 0, Some(peer));
            node.ep
                .tsend(peer, Bytes::from_static(b"bye"), BYE_TAG, 0)
                .unwrap();
            node.collect(1, "receiver bye");
        }
        other => panic!("unknown role {other}"),
    }
    println!("\nOK {role}");
    // Keep the endpoint (and its device, which acknowledges) until the parent says the other
    // end is done too: the last acknowledgement may be lost and its packet sent again.
    line.clear();
    let _ = std::io::stdin().read_line(&mut line);
}

struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

fn spawn(prefix: &[&str], role: &str, bind: &str, seed: u64) -> Proc {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = if prefix.is_empty() {
        Command::new(&exe)
    } else {
        let mut c = Command::new(prefix[0]);
        c.args(&prefix[1..]).arg(&exe);
        c
    };
    let mut child = cmd
        .args([
            "--exact",
            "host_role",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("EFA_ROLE", role)
        .env("EFA_BIND", bind)
        .env("EFA_SEED", seed.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let stdin = child.stdin.take().unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    Proc {
        child,
        stdin,
        lines,
    }
}

fn read_tagged(p: &mut Proc, tag: &str) -> String {
    for l in p.lines.by_ref() {
        let l = l.unwrap();
        if let Some(rest) = l.strip_prefix(tag) {
            return rest.trim().to_string();
        }
    }
    panic!("child exited before printing {tag}");
}

fn run_pair(prefix_send: &[&str], send_ip: &str, prefix_recv: &[&str], recv_ip: &str, seed: u64) {
    let mut s = spawn(prefix_send, "send", send_ip, seed);
    let mut r = spawn(prefix_recv, "recv", recv_ip, seed);
    let sa = read_tagged(&mut s, "ADDR ");
    let ra = read_tagged(&mut r, "ADDR ");
    writeln!(s.stdin, "{ra}").unwrap();
    writeln!(r.stdin, "{sa}").unwrap();
    let start = Instant::now();
    assert_eq!(read_tagged(&mut r, "OK "), "recv", "seed {seed}: receiver");
    assert_eq!(read_tagged(&mut s, "OK "), "send", "seed {seed}: sender");
    // Both are done: let them go.
    writeln!(r.stdin, "exit").unwrap();
    writeln!(s.stdin, "exit").unwrap();
    assert!(
        r.child.wait().unwrap().success(),
        "seed {seed}: receiver failed"
    );
    assert!(
        s.child.wait().unwrap().success(),
        "seed {seed}: sender failed"
    );
    eprintln!("seed {seed}: {MESSAGES} messages in {:?}", start.elapsed());
}

#[test]
fn two_processes_message_mix_over_udp() {
    let seed = test_seed();
    run_pair(&[], "127.0.0.1", &[], "127.0.0.1", seed);
}

/// Two network namespaces joined by a veth pair, removed again on drop.
struct Hosts {
    a: String,
    b: String,
    ip_a: String,
    ip_b: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("the ip command (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Hosts {
    fn new() -> Hosts {
        let id = std::process::id();
        let (a, b) = (format!("efa-a-{id}"), format!("efa-b-{id}"));
        let (va, vb) = (
            format!("efa{}a", id % 100_000),
            format!("efa{}b", id % 100_000),
        );
        let net = format!("10.{}.{}", 100 + (id / 250) % 150, id % 250);
        let hosts = Hosts {
            a,
            b,
            ip_a: format!("{net}.1"),
            ip_b: format!("{net}.2"),
        };
        ip(&["netns", "add", &hosts.a]);
        ip(&["netns", "add", &hosts.b]);
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &hosts.a]);
        ip(&["link", "set", &vb, "netns", &hosts.b]);
        for (ns, dev, addr) in [(&hosts.a, &va, &hosts.ip_a), (&hosts.b, &vb, &hosts.ip_b)] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

#[test]
#[ignore = "needs root for network namespaces: .ci/run runs it"]
fn two_hosts_message_mix_over_udp_in_network_namespaces() {
    assert!(
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout == b"0\n")
            .unwrap_or(false),
        "this test needs root (it creates network namespaces and a veth pair)"
    );
    let seed = test_seed();
    let h = Hosts::new();
    let pa = ["ip", "netns", "exec", h.a.as_str()];
    let pb = ["ip", "netns", "exec", h.b.as_str()];
    run_pair(&pa, &h.ip_a, &pb, &h.ip_b, seed);
}
