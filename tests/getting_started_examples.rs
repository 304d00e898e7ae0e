//! The three getting-started programs (`examples/getting-started-*.rs`, issue 18 point 8) run as
//! two processes, as a user runs them: the server prints its address (and key), the client gets
//! them on its command line. Over udp through the same-host path (the default), over udp alone
//! (`FI_EFA_ENABLE_SHM_TRANSFER=0`) and over shm; the tagged and tokio programs also talk to each
//! other. The examples are built by `cargo test`; a test is skipped if one is missing.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The device settings every program pair runs with.
const SETTINGS: [(&str, &str, &str); 3] = [
    ("udp", "EFA_PROVIDER", "udp"),
    ("udp without shm", "FI_EFA_ENABLE_SHM_TRANSFER", "0"),
    ("shm", "EFA_PROVIDER", "shm"),
];

/// Waits for `child` for at most 60 s (killing it then); its output.
fn finish(mut child: Child, what: &str) -> Output {
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("{what} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Runs `server` then `client` with the server's first `lines` output lines (after their
/// `name: ` prefix) as arguments; both must succeed. Returns (server stdout, client stdout).
fn run_pair(
    server: &str,
    client: &str,
    lines: usize,
    env: (&str, &str),
) -> Option<(String, String)> {
    let (server_bin, client_bin) = (common::example_bin(server)?, common::example_bin(client)?);
    let mut srv = Command::new(server_bin)
        .env(env.0, env.1)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(srv.stdout.take().unwrap());
    let mut args = Vec::new();
    let mut head = String::new();
    for _ in 0..lines {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        head.push_str(&line);
        let (_, value) = line.trim_end().split_once(": ").unwrap_or_else(|| {
            srv.kill().ok();
            panic!("{server}: unexpected first lines {head:?}")
        });
        args.push(value.to_string());
    }
    let cli = Command::new(client_bin)
        .env(env.0, env.1)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let cli = finish(cli, client);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let srv = finish(srv, server);
    for (what, o) in [(server, &srv), (client, &cli)] {
        assert!(
            o.status.success(),
            "{what} ({}={}) failed: {}\n{}",
            env.0,
            env.1,
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Some((
        head + &rest,
        String::from_utf8_lossy(&cli.stdout).into_owned(),
    ))
}

fn tagged_pair(server: &str, client: &str) {
    for (name, var, value) in SETTINGS {
        let Some((srv, cli)) = run_pair(server, client, 1, (var, value)) else {
            return;
        };
        for i in 1..=3 {
            assert!(
                srv.contains(&format!("tag {:#x}: message {i} of 3\n", 0x4200 + i)),
                "{name}: {srv}"
            );
        }
        assert_eq!(cli, "reply: server got 3 messages, 42 bytes\n", "{name}");
    }
}

#[test]
fn tagged_messages_across_two_processes() {
    tagged_pair("getting-started-tagged", "getting-started-tagged");
}

#[test]
fn the_same_under_tokio() {
    tagged_pair("getting-started-tokio", "getting-started-tokio");
}

#[test]
fn the_blocking_and_the_async_programs_talk_to_each_other() {
    tagged_pair("getting-started-tagged", "getting-started-tokio");
    tagged_pair("getting-started-tokio", "getting-started-tagged");
}

#[test]
fn an_rma_write_with_immediate_data_and_a_serde_remote_key() {
    for (name, var, value) in SETTINGS {
        let Some((srv, cli)) = run_pair(
            "getting-started-rma",
            "getting-started-rma",
            2,
            (var, value),
        ) else {
            return;
        };
        assert!(srv.contains("\nkey: {\"addr\":"), "{name}: {srv}");
        assert!(
            srv.ends_with(
                "immediate data Some(7), 21 bytes at offset 100: written by the client\n"
            ),
            "{name}: {srv}"
        );
        assert_eq!(cli, "wrote 21 bytes with immediate data 7\n", "{name}");
    }
}
