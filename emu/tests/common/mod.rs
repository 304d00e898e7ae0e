//! Helpers shared by the tests that run programs on the emulated NIC (`libfabric.rs`,
//! `pingpong_interop.rs`).
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::Duration;

/// The launcher, built with the tests.
pub const EMU: &str = env!("CARGO_BIN_EXE_efa-emu");

/// A TCP port free right now, for a ping-pong's out-of-band connection.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral port")
}

/// `efa-emu run [emu args] -- prog args`, optionally inside a network namespace.
pub fn emu_cmd(netns: Option<&str>, emu_args: &[&str], prog: &[&str]) -> Command {
    let mut c = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, EMU]);
            c
        }
        None => Command::new(EMU),
    };
    c.arg("run").args(emu_args).arg("--").args(prog);
    c.env("FI_EFA_ENABLE_SHM_TRANSFER", "0");
    // Each NIC prints its counters at exit (stderr), for the tests that read them.
    c.env("EFA_EMU_STATS", "1");
    c
}

/// A process's status and output, for an assertion message.
pub fn out_text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Waits for a process, killing it after four minutes (a hang fails the test, not CI's clock).
pub fn finish(mut child: std::process::Child, args: &[&str]) -> Output {
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while child.try_wait().ok().flatten().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            eprintln!("{args:?}: killed after 240 s");
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("collect the output")
}

/// Waits until something in this network namespace listens on TCP `port` (from `/proc/net/tcp`
/// and `tcp6`, without connecting: a ping-pong server accepts exactly one connection), at most
/// `limit`; false if nothing does.
pub fn wait_listening(port: u16, limit: Duration) -> bool {
    let want = format!(":{port:04X} ");
    let deadline = std::time::Instant::now() + limit;
    loop {
        let listening = ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
            std::fs::read_to_string(f).is_ok_and(|t| {
                t.lines().skip(1).any(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    cols.len() > 3 && format!("{} ", cols[1]).ends_with(&want) && cols[3] == "0A"
                })
            })
        });
        if listening {
            return true;
        }
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
