//! The floor under every udp figure: a ping-pong of plain UDP datagrams between two busy-polling
//! sockets (non-blocking `send_to` / `recv_from` in a loop), without this crate. The latency of
//! `ping-pong -p udp` minus this is what the device, the endpoint and the protocol engine cost.
//!
//! ```text
//! cargo run --release --example udp-floor                    # both ends in this process
//! cargo run --release --example udp-floor -- -l -B 47700     # server
//! cargo run --release --example udp-floor -- -P 47700 127.0.0.1
//! ```
//!
//! The output is fabtests' table (one-way latency in `usec/xfer`), like `ping-pong`'s.

mod common;

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use common::{Conn, Role, Side, launch, parse_size, print_header, print_row};

#[derive(Parser, Debug, Clone)]
#[command(about = "Busy-polling ping-pong of plain UDP datagrams (the floor of the udp figures)")]
struct Args {
    /// Message sizes, comma-separated (at most 65000 bytes).
    #[arg(short = 'S', default_value = "64")]
    size: String,
    /// Iterations per size.
    #[arg(short = 'I', default_value_t = 10_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', default_value_t = 100)]
    warmup: usize,
    #[command(flatten)]
    conn: Conn,
}

type Res<T> = Result<T, String>;

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let conn = args.conn.clone();
    match launch(&conn, move |side| session(&args, side)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("udp-floor: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn session(args: &Args, side: Side) -> Res<()> {
    let Side {
        role,
        mut oob,
        bind,
        print,
    } = side;
    let ip = bind.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let sock = UdpSocket::bind(SocketAddr::new(ip, 0)).map_err(|e| format!("bind: {e}"))?;
    sock.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mine = sock.local_addr().map_err(|e| e.to_string())?;
    oob.send_line(&mine.to_string())
        .map_err(|e| e.to_string())?;
    let peer: SocketAddr = oob
        .recv_line()
        .map_err(|e| e.to_string())?
        .trim()
        .parse()
        .map_err(|e| format!("peer address: {e}"))?;
    let sizes: Vec<usize> = args.size.split(',').map(parse_size).collect::<Res<_>>()?;
    if print {
        print_header();
    }
    let mut buf = vec![0u8; 65_536];
    for size in sizes {
        if size > 65_000 {
            return Err(format!("{size} bytes do not fit one datagram"));
        }
        let msg = vec![0x5au8; size];
        oob.sync().map_err(|e| e.to_string())?;
        let mut start = Instant::now();
        for i in 0..args.warmup + args.iters {
            if i == args.warmup {
                start = Instant::now();
            }
            if role == Role::Client {
                send(&sock, &msg, peer)?;
                recv(&sock, &mut buf)?;
            } else {
                recv(&sock, &mut buf)?;
                send(&sock, &msg, peer)?;
            }
        }
        let elapsed = start.elapsed();
        if print {
            print_row(size, args.iters, 2, elapsed);
        }
    }
    oob.sync().map_err(|e| e.to_string())
}

fn send(sock: &UdpSocket, msg: &[u8], to: SocketAddr) -> Res<()> {
    loop {
        match sock.send_to(msg, to) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
            Err(e) => return Err(format!("send: {e}")),
        }
    }
}

/// Busy-polls for one datagram (gives up after 5 s: a lost datagram would hang the test).
fn recv(sock: &UdpSocket, buf: &mut [u8]) -> Res<usize> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut spins = 0u32;
    loop {
        match sock.recv_from(buf) {
            Ok((n, _)) => return Ok(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(4096) && Instant::now() > deadline {
                    return Err("no reply within 5 s (datagram lost?)".into());
                }
            }
            Err(e) => return Err(format!("recv: {e}")),
        }
    }
}
