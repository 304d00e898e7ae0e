//! The examples' command line against bad input and vanished peers (issue 18, point 5): sizes
//! beyond the limit are a clear error, an unreachable server fails within seconds, the server
//! listens on IPv6 and IPv4, and an RDM server whose client died says so instead of waiting out
//! its timeout. The examples are built by `cargo test`; a test is skipped if one is missing.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A TCP port nothing listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn sizes_beyond_the_limit_are_refused_clearly() {
    let Some(pp) = common::example_bin("ping-pong") else {
        return;
    };
    let out = Command::new(pp).args(["-S", "100g"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("limit of 1 GiB"), "{err}");
}

#[test]
fn a_server_nobody_answers_for_fails_within_seconds() {
    let Some(pp) = common::example_bin("ping-pong") else {
        return;
    };
    let start = Instant::now();
    // 127.0.0.1 with no server: refused at once, retried until the connect deadline.
    let out = Command::new(pp)
        .args(["-P", &free_port().to_string(), "127.0.0.1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is the server running"), "{err}");
}

#[test]
fn the_server_takes_ipv6_and_ipv4_clients_and_notices_a_vanished_one() {
    let Some(pp) = common::example_bin("ping-pong") else {
        return;
    };
    let have_v6 = std::net::TcpListener::bind(("::1", 0)).is_ok();
    // An IPv6 client (when the host has IPv6), to a server on its default address.
    if have_v6 {
        let port = free_port().to_string();
        let mut server = Command::new(&pp)
            .args(["-l", "-B", &port, "-e", "rdm", "-S", "64", "-I", "5"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let out = Command::new(&pp)
            .args(["-P", &port, "-e", "rdm", "-S", "64", "-I", "5", "::1"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert!(server.wait().unwrap().success());
    }
    // A client killed mid-run: the server reports it long before its 10-minute timeout.
    let port = free_port().to_string();
    let server = Command::new(&pp)
        .args([
            "-l",
            "-B",
            &port,
            "-e",
            "rdm",
            "-S",
            "64",
            "-I",
            "100000000",
        ])
        .args(["--timeout-ms", "600000"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut client = Command::new(&pp)
        .args([
            "-P",
            &port,
            "-e",
            "rdm",
            "-S",
            "64",
            "-I",
            "100000000",
            "127.0.0.1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let start = Instant::now();
    client.kill().unwrap();
    let _ = client.wait();
    let out = server.wait_with_output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // In the fabric loop ("closed the out-of-band connection") or, on a slow machine, still
    // in the control exchange ("closed the oob connection").
    assert!(err.contains("closed the"), "{err}");
}

/// examples/wait-fd, small, on each software device: every task gets its messages while blocked on
/// its queue's descriptor, and the program does not busy-poll while idle (it fails itself past
/// half a CPU).
#[test]
fn wait_fd_delivers_to_tasks_blocked_on_descriptors() {
    let Some(bin) = common::example_bin("wait-fd") else {
        return;
    };
    for p in ["udp", "shm", "loopback"] {
        let out = Command::new(&bin)
            .args(["-p", p, "-n", "4", "-m", "20", "--idle-secs", "0.5"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{p}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("80 messages of 80 delivered"), "{p}: {text}");
        assert!(text.contains("idle CPU"), "{p}: {text}");
    }
}

/// examples/counters, small, on each software device and with each way of waiting: the target,
/// with no completion queue, counts every one-sided write on its remote-write counter and finds
/// every chunk intact.
#[test]
fn counters_count_one_sided_writes_at_the_target() {
    let Some(bin) = common::example_bin("counters") else {
        return;
    };
    for p in ["udp", "shm", "loopback"] {
        for w in ["block", "async", "fd"] {
            let out = Command::new(&bin)
                .args(["-p", p, "-w", w, "-n", "200", "-s", "1000"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{p} {w}: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                text.contains("counted 200 of 200, 0 errors"),
                "{p} {w}: {text}"
            );
            assert!(text.contains("data intact: 0 of 200"), "{p} {w}: {text}");
        }
    }
    // A bad option is refused with a clear message.
    let out = Command::new(&bin).args(["-w", "spin"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("block, async or fd"),
        "{out:?}"
    );
}

/// examples/kv-transfer, small: both ends in one process, then in two processes (the same-host
/// path), with the receiver's checks (a corrupted page, a duplicate or missing notification
/// fail both sides with a clear message) and its option checks.
#[test]
fn kv_transfer_moves_pages_and_reports_what_went_wrong() {
    let Some(kv) = common::example_bin("kv-transfer") else {
        return;
    };
    let small = ["-M", "4m", "-I", "2", "-S", "64k", "-b", "8"];
    let out = Command::new(&kv).args(small).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MB/sec") && text.contains("pages/sec"),
        "{text}"
    );
    assert!(text.contains("0 registrations after start-up"), "{text}");

    let port = free_port().to_string();
    let server = Command::new(&kv)
        .args(["-l", "-B", &port])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let client = Command::new(&kv)
        .args(small)
        .args(["-P", &port, "127.0.0.1"])
        .output()
        .unwrap();
    assert!(client.status.success(), "{client:?}");
    let server = server.wait_with_output().unwrap();
    assert!(server.status.success(), "{server:?}");
    assert!(String::from_utf8_lossy(&server.stdout).contains("# receiver:"));

    for (fault, says) in [
        ("corrupt", "data mismatch"),
        ("duplicate", "duplicate notification of batch 0"),
        ("skip", "missing notifications"),
    ] {
        let out = Command::new(&kv)
            .args(small)
            .args(["--timeout-secs", "2", "--fault", fault])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{fault}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{fault}: {err}");
    }

    let out = Command::new(&kv).args(["-S", "4k"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("16k to 256k"));
}
