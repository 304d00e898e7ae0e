//! RDM message mixes over the udp device between two processes, and between two hosts: two
//! network namespaces joined by a veth pair (needs root; `.ci/run` runs it as root).
//!
//! Both tests start this test binary again as child processes running `host_role`; the parent
//! relays the children's raw addresses between them over their stdin/stdout.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::*;
use efa::fault::{FaultConfig, Rng, test_seed};
use efa::{CompletionFlags, ErrorKind, PeerId, RawAddr, RecvOptions, SendOptions};

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

/// Message sizes of the firewall ping-pong: every power of two up to 4 MiB, and one byte either
/// side of each from 64 bytes on (eager, medium and long-CTS boundaries all fall in between).
fn every_size() -> Vec<usize> {
    let mut v = vec![0];
    let mut s = 1usize;
    while s <= 4 << 20 {
        if s >= 64 {
            v.push(s - 1);
        }
        v.push(s);
        if s >= 64 {
            v.push(s + 1);
        }
        s <<= 1;
    }
    v
}

/// Polls `a` and `b` until `a` has `na` and `b` has `nb` completions (an error completion fails
/// the test; a deadline turns a hang into a failure).
fn both(
    a: &Node,
    b: &Node,
    at_a: &mut Vec<efa::Completion>,
    at_b: &mut Vec<efa::Completion>,
    na: usize,
    nb: usize,
    ctx: &str,
) {
    let deadline = Instant::now() + DEADLINE;
    while at_a.len() < na || at_b.len() < nb {
        a.poll_ok(at_a, &format_args!("{ctx} at a"));
        b.poll_ok(at_b, &format_args!("{ctx} at b"));
        assert!(
            Instant::now() < deadline,
            "{ctx}: {}/{na} completions at a, {}/{nb} at b",
            at_a.len(),
            at_b.len()
        );
    }
}

/// Ping-pong between two RDM endpoints over udp in this process, through every size of
/// [`every_size`], each message checked byte for byte; run in a network namespace whose
/// firewall drops 5% of outgoing UDP (`EFA_FW_SEED`), where `sendmsg` fails with `EPERM`.
#[test]
#[ignore = "run in a child process by firewall_drops_outgoing_udp_ping_pong_every_size"]
fn firewall_role() {
    let Ok(seed) = std::env::var("EFA_FW_SEED") else {
        return;
    };
    let seed: u64 = seed.parse().unwrap();
    let a = Node::new(&udp_domain(LOCAL4, FaultConfig::default()));
    let b = Node::new(&udp_domain(LOCAL4, FaultConfig::default()));
    let pb = a.insert(b.ep.addr());
    let pa = b.insert(a.ep.addr());
    let run = std::panic::AssertUnwindSafe(|| {
        let mut i = 0usize;
        for len in every_size() {
            let rounds = if len <= 64 << 10 { 8 } else { 2 };
            for _ in 0..rounds {
                let ping = payload(seed, i, len);
                b.ep.recv(BytesMut::with_capacity(len), i as u64).unwrap();
                a.ep.recv(BytesMut::with_capacity(len), i as u64).unwrap();
                a.ep.send(pb, ping.clone(), i as u64).unwrap();
                // b receives the ping and sends it back; a receives the pong. Both ends are
                // polled throughout (progress is manual: a long-CTS sender must see the CTS).
                let ctx = format!("seed {seed}: ping {i} ({len} B)");
                let (mut at_a, mut at_b) = (Vec::new(), Vec::new());
                both(&a, &b, &mut at_a, &mut at_b, 1, 1, &ctx);
                assert!(at_a[0].flags.contains(CompletionFlags::SEND), "{ctx}");
                let data = at_b[0].buf.as_recv().unwrap().to_vec();
                assert!(data == ping[..], "{ctx}: corrupted at b");
                b.ep.send(pa, Bytes::from(data), i as u64).unwrap();
                at_a.clear();
                at_b.clear();
                both(&a, &b, &mut at_a, &mut at_b, 1, 1, &ctx);
                let pong = at_a[0].buf.as_recv().expect("a receive completion at a");
                assert!(pong == &ping[..], "{ctx}: pong corrupted at a");
                assert!(at_b[0].flags.contains(CompletionFlags::SEND), "{ctx}");
                i += 1;
            }
        }
        i
    });
    let i = match std::panic::catch_unwind(run) {
        Ok(i) => i,
        Err(e) => {
            eprintln!(
                "seed {seed}: device a {:?}\nendpoint a {:?}\ndevice b {:?}\nendpoint b {:?}",
                a.ep.domain().device_stats(),
                a.ep.stats(),
                b.ep.domain().device_stats(),
                b.ep.stats()
            );
            std::panic::resume_unwind(e)
        }
    };
    let sa = a.ep.domain().device_stats();
    println!("\nOK {i} round trips; device a: {sa:?}");
}

/// Defect 3 of issue 17: a firewall dropping 5% of outgoing UDP makes `sendmsg` fail with
/// `EPERM`; SRD must treat that as a loss and retransmit, so RDM ping-pong over udp completes
/// every size with every message intact (it used to fail at once with "unreachable").
#[test]
#[ignore = "needs root for a network namespace and nftables: .ci/run runs it"]
fn firewall_drops_outgoing_udp_ping_pong_every_size() {
    assert!(
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout == b"0\n")
            .unwrap_or(false),
        "this test needs root (it creates a network namespace with a firewall)"
    );
    let seed = test_seed();
    let ns = format!("efa-fw-{}", std::process::id());
    struct Ns(String);
    impl Drop for Ns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    ip(&["netns", "add", &ns]);
    let _ns = Ns(ns.clone());
    ip(&["-n", &ns, "link", "set", "lo", "up"]);
    let rules = "table inet efa_fw {\n chain out {\n  type filter hook output priority 0; policy accept;\n  meta l4proto udp numgen random mod 100 < 5 counter drop\n }\n}\n";
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft (the nftables package)");
    nft.stdin
        .take()
        .unwrap()
        .write_all(rules.as_bytes())
        .unwrap();
    assert!(nft.wait().unwrap().success(), "nft refused the rule set");
    let exe = std::env::current_exe().unwrap();
    let start = Instant::now();
    let out = Command::new("ip")
        .args(["netns", "exec", &ns])
        .arg(&exe)
        .args([
            "--exact",
            "firewall_role",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("EFA_FW_SEED", seed.to_string())
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("\nOK "),
        "seed {seed}: ping-pong behind a lossy firewall failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dropped = Command::new("ip")
        .args(["netns", "exec", &ns, "nft", "list", "ruleset"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let dropped = dropped
        .lines()
        .find(|l| l.contains("counter"))
        .unwrap_or("")
        .trim();
    eprintln!(
        "seed {seed}: every size in {:?}; firewall: {dropped}; {}",
        start.elapsed(),
        stdout.lines().find(|l| l.starts_with("OK ")).unwrap_or("")
    );
}

// ---------------------------------------------------------------------------------------------
// Eight hosts, all to all, behind lossy firewalls (issue 17, "Hostile and overloaded peers").

/// Hosts of the all-to-all test.
const EIGHT: usize = 8;
/// Messages each host sends each other host.
const PER_PAIR: usize = 1000;
/// Sends in flight towards one peer.
const SEND_WINDOW: usize = 16;
/// Receives posted ahead for one sender.
const RECV_WINDOW: usize = 64;
/// One host's whole exchange must finish within this (the parent allows a little more).
const HOST_DEADLINE: Duration = Duration::from_secs(100);
/// Marks a send's context (the low byte is the peer's host number, the rest the index).
const SEND_CTX: u64 = 1 << 63;

/// The seed of what host `from` sends host `to`.
fn pair_seed(seed: u64, from: usize, to: usize) -> u64 {
    seed ^ ((from * EIGHT + to + 1) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)
}

/// The sizes of the [`PER_PAIR`] messages host `from` sends host `to`: 65% up to 8000 bytes
/// (eager; 0 included), 27% up to 64 KiB (medium), 8% up to 256 KiB (long-CTS).
fn pair_sizes(seed: u64, from: usize, to: usize) -> Vec<usize> {
    let mut r = Rng::new(pair_seed(seed, from, to) ^ 0x51_2E5);
    (0..PER_PAIR)
        .map(|_| match r.below(100) {
            0..=64 => r.below(8_001) as usize,
            65..=91 => 8_001 + r.below(65_536 - 8_000) as usize,
            _ => 65_537 + r.below(262_144 - 65_536) as usize,
        })
        .collect()
}

/// One host of [`eight_hosts_all_to_all_over_udp_with_loss_both_ways`], run in its network
/// namespace: `EFA_HOST8` = its number, `EFA_BIND`, `EFA_SEED`. Prints `ADDR <raw address>`,
/// reads the eight addresses (one line, in host order), sends [`PER_PAIR`] messages to each
/// other host (untagged, CQ data = index) while receiving theirs through directed receives
/// posted in order, each receive exactly the size of the message it is meant for. Checks every
/// completion as it arrives, prints `STATS key=value ...` and `OK`, and keeps its endpoint
/// until the parent writes a line (the others may still need its acknowledgements).
#[test]
#[ignore = "run in child processes by eight_hosts_all_to_all_over_udp_with_loss_both_ways"]
fn eight_hosts_role() {
    let (Ok(me), Ok(bind), Ok(seed)) = (
        std::env::var("EFA_HOST8"),
        std::env::var("EFA_BIND"),
        std::env::var("EFA_SEED"),
    ) else {
        return;
    };
    let me: usize = me.parse().unwrap();
    let seed: u64 = seed.parse().unwrap();
    let bind: IpAddr = bind.parse().unwrap();
    // `Domain::with_device` never routes over shm, and the endpoint takes no local path: every
    // message crosses the bridge (the figures below check it).
    let d = udp_domain(bind, FaultConfig::default());
    let node = Node::device_path(&d);
    println!("\nADDR {}", node.ep.addr());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let addrs: Vec<RawAddr> = line
        .split_whitespace()
        .map(|a| a.parse().unwrap())
        .collect();
    assert_eq!(
        addrs.len(),
        EIGHT,
        "seed {seed}: host {me}: addresses {line}"
    );
    assert_eq!(addrs[me], node.ep.addr(), "seed {seed}: host {me}");
    let peers: Vec<Option<PeerId>> = (0..EIGHT)
        .map(|j| (j != me).then(|| node.insert(addrs[j])))
        .collect();
    let others: Vec<usize> = (0..EIGHT).filter(|&j| j != me).collect();
    let none = || vec![Vec::new(); EIGHT];
    let (mut out_sizes, mut in_sizes) = (none(), none());
    for &j in &others {
        out_sizes[j] = pair_sizes(seed, me, j);
        in_sizes[j] = pair_sizes(seed, j, me);
    }
    // The parent's "exit" line, read beside the exchange so that the endpoint keeps going.
    let exit = Arc::new(AtomicBool::new(false));
    let exit2 = exit.clone();
    std::thread::spawn(move || {
        let mut l = String::new();
        let _ = std::io::stdin().read_line(&mut l);
        exit2.store(true, Ordering::Release);
    });

    let start = Instant::now();
    let deadline = start + HOST_DEADLINE;
    let (mut next_send, mut sends_done) = (vec![0usize; EIGHT], vec![0usize; EIGHT]);
    let (mut next_recv, mut recvs_done) = (vec![0usize; EIGHT], vec![0usize; EIGHT]);
    let mut sent = vec![vec![false; PER_PAIR]; EIGHT];
    let mut received = vec![vec![false; PER_PAIR]; EIGHT];
    // Highest index completed per sender; a receive completing below it completed late
    // (allowed: messages match in order, their completions may not be; counted for the report).
    let mut highest: Vec<Option<usize>> = vec![None; EIGHT];
    let mut late = 0u64;
    let mut refused: Vec<Option<Bytes>> = vec![None; EIGHT];
    let (mut again, mut bytes_out, mut bytes_in) = (0u64, 0u64, 0u64);
    let total = others.len() * PER_PAIR;
    let (mut sends_total, mut recvs_total) = (0usize, 0usize);
    let mut out = Vec::with_capacity(256);
    while sends_total < total || recvs_total < total {
        // Receives: up to RECV_WINDOW ahead per sender, in order.
        'recv: for &s in &others {
            while next_recv[s] < PER_PAIR && next_recv[s] - recvs_done[s] < RECV_WINDOW {
                let k = next_recv[s];
                let mut o = RecvOptions::default();
                o.from = peers[s];
                let buf = BytesMut::with_capacity(in_sizes[s][k].max(1));
                match node.ep.recv_with(buf, o, ((k as u64) << 8) | s as u64) {
                    Ok(()) => next_recv[s] += 1,
                    Err(e) if e.kind() == ErrorKind::Again => {
                        again += 1;
                        break 'recv;
                    }
                    Err(e) => panic!("seed {seed}: host {me}: receive {k} from host {s}: {e}"),
                }
            }
        }
        // Sends: round robin over the peers, up to SEND_WINDOW in flight towards each.
        'send: loop {
            let mut posted = false;
            for &j in &others {
                let k = next_send[j];
                if k == PER_PAIR || k - sends_done[j] >= SEND_WINDOW {
                    continue;
                }
                let buf = refused[j]
                    .take()
                    .unwrap_or_else(|| payload(pair_seed(seed, me, j), k, out_sizes[j][k]));
                let o = SendOptions::default()
                    .with_data(k as u32)
                    .with_delivery_complete(false);
                match node.ep.send_with(
                    peers[j].unwrap(),
                    buf,
                    o,
                    SEND_CTX | (k as u64) << 8 | j as u64,
                ) {
                    Ok(()) => {
                        next_send[j] += 1;
                        posted = true;
                    }
                    Err(e) if e.kind() == ErrorKind::Again => {
                        again += 1;
                        refused[j] = e.into_buffer().as_send().cloned();
                        break 'send;
                    }
                    Err(e) => panic!("seed {seed}: host {me}: send {k} to host {j}: {e}"),
                }
            }
            if !posted {
                break;
            }
        }
        out.clear();
        match node.cq.wait(&mut out, 256, Some(Duration::from_millis(5))) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::TimedOut => {}
            Err(e) => panic!(
                "seed {seed}: host {me}: error completion: {e}: {:?}",
                node.cq.read_err()
            ),
        }
        for c in out.drain(..) {
            let (k, p) = (
                ((c.context & !SEND_CTX) >> 8) as usize,
                (c.context & 0xff) as usize,
            );
            assert!(
                p < EIGHT && p != me && k < PER_PAIR,
                "seed {seed}: host {me}: a completion with unknown context {:#x}",
                c.context
            );
            if c.context & SEND_CTX != 0 {
                assert!(
                    c.flags.contains(CompletionFlags::SEND),
                    "seed {seed}: host {me}: send {k} to host {p}: flags {:?}",
                    c.flags
                );
                assert!(
                    !sent[p][k],
                    "seed {seed}: host {me}: send {k} to host {p} completed twice"
                );
                sent[p][k] = true;
                sends_done[p] += 1;
                sends_total += 1;
                let len = c.buf.as_send().map(|b| b.len());
                assert_eq!(
                    len,
                    Some(out_sizes[p][k]),
                    "seed {seed}: host {me}: send {k} to host {p}"
                );
                bytes_out += out_sizes[p][k] as u64;
            } else {
                let what = format!("seed {seed}: host {me}: message {k} from host {p}");
                assert!(
                    c.flags.contains(CompletionFlags::RECV),
                    "{what}: flags {:?}",
                    c.flags
                );
                assert!(!received[p][k], "{what}: its receive completed twice");
                received[p][k] = true;
                recvs_done[p] += 1;
                recvs_total += 1;
                assert_eq!(c.source, peers[p], "{what}: FI_SOURCE");
                // Receive k from host p is the k-th posted for p: it must get p's k-th message.
                assert_eq!(
                    c.data,
                    Some(k as u32),
                    "{what}: the receive got another message (CQ data = the sender's index): out of order"
                );
                let want = payload(pair_seed(seed, p, me), k, in_sizes[p][k]);
                assert_eq!(c.len, want.len(), "{what}: length");
                let got = c.buf.as_recv().expect("a receive buffer");
                assert!(
                    got[..] == want[..],
                    "{what}: corrupted ({} bytes)",
                    want.len()
                );
                bytes_in += want.len() as u64;
                if highest[p].is_some_and(|h| h > k) {
                    late += 1;
                }
                highest[p] = highest[p].max(Some(k));
            }
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: host {me}: after {:?}, {sends_total} of {total} sends and {recvs_total} of {total} receives completed; device {:?}; endpoint {:?}",
            start.elapsed(),
            d.device_stats(),
            node.ep.stats()
        );
    }
    let elapsed = start.elapsed();
    let (dev, es) = (d.device_stats(), node.ep.stats());
    let what = format!("seed {seed}: host {me}");
    assert_eq!(es.tx_msgs, total as u64, "{what}: {es:?}");
    assert_eq!(es.rx_msgs, total as u64, "{what}: {es:?}");
    assert_eq!(es.errors, 0, "{what}: {es:?}");
    assert_eq!(dev.send_errors, 0, "{what}: {dev:?}");
    // The udp path ran, shared memory did not.
    assert!(
        dev.tx_pkts >= total as u64 && dev.rx_pkts >= total as u64,
        "{what}: {dev:?}"
    );
    assert_eq!(es.local_tx_msgs + es.local_rx_msgs, 0, "{what}: {es:?}");
    assert_eq!(
        dev.shm_route_tx_pkts + dev.shm_route_rx_pkts,
        0,
        "{what}: {dev:?}"
    );
    let sizes = || in_sizes.iter().chain(&out_sizes).flatten();
    println!(
        "\nSTATS host={me} elapsed_ms={} msgs_out={sends_total} msgs_in={recvs_total} bytes_out={bytes_out} bytes_in={bytes_in} \
         eager={} medium={} long={} dev_tx_pkts={} dev_rx_pkts={} dev_retransmits={} dev_rnr={} dev_dups={} \
         ep_retransmits={} ep_rnr={} ep_unexpected={} ep_reorder_buffered={} ep_dropped={} again={again} late={late}",
        elapsed.as_millis(),
        sizes().filter(|&&l| l <= 8_000).count(),
        sizes().filter(|&&l| l > 8_000 && l <= 65_536).count(),
        sizes().filter(|&&l| l > 65_536).count(),
        dev.tx_pkts,
        dev.rx_pkts,
        dev.retransmits,
        dev.rnr_events,
        dev.duplicates_dropped,
        es.retransmits,
        es.rnr,
        es.unexpected_msgs,
        es.reorder_buffered,
        es.dropped_pkts,
    );
    println!("\nOK {me}");
    // Keep the endpoint until every host is done: nothing more may complete here.
    let linger = deadline + Duration::from_secs(10);
    while !exit.load(Ordering::Acquire) {
        out.clear();
        match node.cq.wait(&mut out, 16, Some(Duration::from_millis(10))) {
            Ok(_) => panic!(
                "{what}: a completion after all were done: {:?}",
                out[0].context
            ),
            Err(e) if e.kind() == ErrorKind::TimedOut => {}
            Err(e) => panic!(
                "{what}: error completion after all were done: {e}: {:?}",
                node.cq.read_err()
            ),
        }
        assert!(
            Instant::now() < linger,
            "{what}: the parent never said exit"
        );
    }
}

/// Eight network namespaces, each with one veth pair into a ninth that holds a bridge, and a
/// firewall in each of the eight dropping 5% of UDP datagrams on the way out and 5% on the way
/// in. Names carry the process id; everything is removed on drop.
struct Lan {
    bridge: String,
    hosts: Vec<String>,
    ips: Vec<String>,
}

impl Lan {
    fn new() -> Lan {
        let id = std::process::id();
        let lan = Lan {
            bridge: format!("efa8-br-{id}"),
            hosts: (0..EIGHT).map(|i| format!("efa8-h{i}-{id}")).collect(),
            ips: (0..EIGHT).map(|i| format!("10.88.0.{}", i + 1)).collect(),
        };
        ip(&["netns", "add", &lan.bridge]);
        ip(&["-n", &lan.bridge, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &lan.bridge, "link", "set", "br0", "up"]);
        let rules = "table inet efa_loss {\n chain out {\n  type filter hook output priority 0; policy accept;\n  meta l4proto udp numgen random mod 100 < 5 counter drop\n }\n chain in {\n  type filter hook input priority 0; policy accept;\n  meta l4proto udp numgen random mod 100 < 5 counter drop\n }\n}\n";
        for (i, (ns, addr)) in lan.hosts.iter().zip(&lan.ips).enumerate() {
            let port = format!("h{i}");
            ip(&["netns", "add", ns]);
            // Created in place: the names only have to be unique inside the two namespaces.
            ip(&[
                "-n",
                &lan.bridge,
                "link",
                "add",
                &port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            ]);
            ip(&[
                "-n",
                &lan.bridge,
                "link",
                "set",
                &port,
                "master",
                "br0",
                "up",
            ]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ]);
            ip(&["-n", ns, "link", "set", "eth0", "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            let mut nft = Command::new("ip")
                .args(["netns", "exec", ns, "nft", "-f", "-"])
                .stdin(Stdio::piped())
                .spawn()
                .expect("nft (the nftables package)");
            nft.stdin
                .take()
                .unwrap()
                .write_all(rules.as_bytes())
                .unwrap();
            assert!(nft.wait().unwrap().success(), "nft refused the rule set");
        }
        lan
    }

    /// Datagrams host `i`'s firewall dropped in `chain` (`out` or `in`).
    fn dropped(&self, i: usize, chain: &str) -> u64 {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.hosts[i],
                "nft",
                "list",
                "chain",
                "inet",
                "efa_loss",
                chain,
            ])
            .output()
            .expect("nft");
        let text = String::from_utf8_lossy(&out.stdout);
        text.split_whitespace()
            .skip_while(|w| *w != "packets")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for ns in self.hosts.iter().chain([&self.bridge]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// The host processes; any still running on drop (a failed test) are killed.
struct Hosts8(Vec<Child>);

impl Drop for Hosts8 {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Issue 17: eight hosts (network namespaces on one bridge) exchange 1 000 messages of mixed
/// sizes (eager, medium, long-CTS) per ordered pair, all to all, over the udp device, each
/// host's firewall dropping 5% of UDP out and 5% in (a dropped send is `EPERM`, a loss to
/// SRD). Every message arrives exactly once, intact and in order per pair; every send
/// completes once, successfully; no error completion anywhere.
#[test]
#[ignore = "needs root for network namespaces, a bridge and nftables: .ci/run runs it"]
fn eight_hosts_all_to_all_over_udp_with_loss_both_ways() {
    assert!(
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout == b"0\n")
            .unwrap_or(false),
        "this test needs root (it creates network namespaces, a bridge and firewalls)"
    );
    let seed = test_seed();
    let lan = Lan::new();
    let exe = std::env::current_exe().unwrap();
    let (tx, rx) = mpsc::channel::<(usize, Option<String>)>();
    let mut kids = Hosts8(Vec::new());
    let mut stdins = Vec::new();
    for (i, (ns, addr)) in lan.hosts.iter().zip(&lan.ips).enumerate() {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(&exe)
            .args([
                "--exact",
                "eight_hosts_role",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("EFA_HOST8", i.to_string())
            .env("EFA_BIND", addr)
            .env("EFA_SEED", seed.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a host");
        stdins.push(child.stdin.take().unwrap());
        let stdout = BufReader::new(child.stdout.take().unwrap());
        kids.0.push(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in stdout.lines() {
                let Ok(l) = l else { break };
                if tx.send((i, Some(l))).is_err() {
                    return;
                }
            }
            let _ = tx.send((i, None));
        });
    }
    let start = Instant::now();
    let deadline = start + HOST_DEADLINE + Duration::from_secs(15);
    // Every host's next line starting with `tag` (in host order).
    let mut stats = vec![String::new(); EIGHT];
    let mut gather = |tag: &str| -> Vec<String> {
        let mut got: Vec<Option<String>> = vec![None; EIGHT];
        while got.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            let (i, l) = rx.recv_timeout(left).unwrap_or_else(|_| {
                panic!(
                    "seed {seed}: no {tag}from every host within {:?}",
                    start.elapsed()
                )
            });
            let Some(l) = l else {
                panic!("seed {seed}: host {i} exited before printing {tag}");
            };
            if let Some(rest) = l.strip_prefix("STATS ") {
                stats[i] = rest.to_string();
            } else if let Some(rest) = l.strip_prefix(tag) {
                got[i] = Some(rest.trim().to_string());
            }
        }
        got.into_iter().map(Option::unwrap).collect()
    };
    let addrs = gather("ADDR ").join(" ");
    for s in &mut stdins {
        writeln!(s, "{addrs}").unwrap();
    }
    let ok = gather("OK ");
    assert_eq!(
        ok,
        (0..EIGHT).map(|i| i.to_string()).collect::<Vec<_>>(),
        "seed {seed}"
    );
    let elapsed = start.elapsed();
    for s in &mut stdins {
        let _ = writeln!(s, "exit");
    }
    for (i, c) in kids.0.iter_mut().enumerate() {
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                assert!(st.success(), "seed {seed}: host {i} failed: {st}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: host {i} did not exit"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // Figures: each host's line, then the sums.
    let mut sums: std::collections::BTreeMap<String, u64> = Default::default();
    for (i, s) in stats.iter().enumerate() {
        eprintln!("seed {seed}: host {i}: {s}");
        for kv in s.split_whitespace() {
            if let Some((k, v)) = kv.split_once('=') {
                if k != "host" && k != "elapsed_ms" {
                    *sums.entry(k.to_string()).or_default() += v.parse::<u64>().unwrap_or(0);
                }
            }
        }
    }
    let (out, inn): (u64, u64) = (0..EIGHT)
        .map(|i| (lan.dropped(i, "out"), lan.dropped(i, "in")))
        .fold((0, 0), |(a, b), (x, y)| (a + x, b + y));
    let msgs = (EIGHT * (EIGHT - 1) * PER_PAIR) as u64;
    assert_eq!(sums.get("msgs_in"), Some(&msgs), "seed {seed}: {sums:?}");
    assert_eq!(sums.get("msgs_out"), Some(&msgs), "seed {seed}: {sums:?}");
    assert_eq!(
        sums.get("bytes_in"),
        sums.get("bytes_out"),
        "seed {seed}: {sums:?}"
    );
    assert!(
        out > 0 && inn > 0,
        "seed {seed}: the firewalls dropped {out} out, {inn} in"
    );
    eprintln!(
        "seed {seed}: {EIGHT} hosts, all to all, {msgs} messages in {elapsed:?}; firewalls dropped {out} datagrams out, {inn} in; sums {sums:?}"
    );
}
