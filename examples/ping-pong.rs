//! Ping-pong latency and bandwidth in the manner of fabtests' `fi_rdm_pingpong` /
//! `fi_dgram_pingpong`, with the same command line and output columns.
//!
//! ```text
//! cargo run --release --example ping-pong -- -e dgram            # both ends in this process
//! cargo run --release --example ping-pong -- -e dgram -l          # server
//! cargo run --release --example ping-pong -- -e dgram 127.0.0.1   # client
//! ```
//!
//! A small TCP connection (port `-B` on the server, `-P` on the client, default 47592) exchanges
//! the endpoints' raw addresses and the test parameters (the client's `-S`, `-I`, `-w`, `-c`
//! decide; the server follows), and synchronises start and finish of every size.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{Oob, all_sizes, check_pattern, fill_pattern, parse_size, print_header, print_row};
use efa::{
    AddressVector, Completion, CompletionFlags, CompletionQueue, Dgram, Domain, Endpoint, EpType,
    ErrorKind, Hints, PeerId, getinfo,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "Ping-pong latency test (fabtests style) over efa endpoints")]
struct Args {
    /// Device (provider): udp or loopback (loopback: both ends in this process only).
    #[arg(short = 'p', default_value = "udp")]
    provider: String,
    /// Endpoint type: dgram (rdm comes with the RDM protocol engine).
    #[arg(short = 'e', default_value = "dgram")]
    ep_type: String,
    /// Message size (64, 1k, 64k, 1m) or `all`.
    #[arg(short = 'S', default_value = "all")]
    size: String,
    /// Iterations per size (default 1000; 100 for sizes of 1 MiB and more).
    #[arg(short = 'I')]
    iters: Option<usize>,
    /// Warm-up iterations per size.
    #[arg(short = 'w', default_value_t = 10)]
    warmup: usize,
    /// Verify the data of every message.
    #[arg(short = 'c')]
    verify: bool,
    /// Message kind: msg or tagged (tagged needs -e rdm).
    #[arg(short = 'm', default_value = "msg")]
    mode: String,
    /// Run as the server (listen for one client).
    #[arg(short = 'l')]
    listen: bool,
    /// Server: out-of-band port to listen on.
    #[arg(short = 'B')]
    bind_port: Option<u16>,
    /// Client: the server's out-of-band port.
    #[arg(short = 'P')]
    port: Option<u16>,
    /// Local address to bind (server default: all addresses; client default: the local address
    /// that reaches the server).
    #[arg(short = 's')]
    src_addr: Option<IpAddr>,
    /// Give up when a reply takes longer than this many milliseconds (datagrams can be lost).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Server address (client mode). With neither this nor -l, both ends run in this process.
    server: Option<String>,
}

/// What the client tells the server.
#[derive(Debug, Clone)]
struct Params {
    sizes: Vec<usize>,
    iters: Option<usize>,
    warmup: usize,
    verify: bool,
}

impl Params {
    fn encode(&self) -> String {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        format!(
            "params {} {} {} {}",
            sizes.join(","),
            self.iters.map_or("-".to_string(), |i| i.to_string()),
            self.warmup,
            u8::from(self.verify)
        )
    }

    fn decode(line: &str) -> Result<Params, String> {
        let bad = || format!("bad parameter line from client: {line:?}");
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 5 || f[0] != "params" {
            return Err(bad());
        }
        let sizes = f[1]
            .split(',')
            .map(|s| s.parse().map_err(|_| bad()))
            .collect::<Result<Vec<usize>, _>>()?;
        let iters = if f[2] == "-" {
            None
        } else {
            Some(f[2].parse().map_err(|_| bad())?)
        };
        Ok(Params {
            sizes,
            iters,
            warmup: f[3].parse().map_err(|_| bad())?,
            verify: f[4] == "1",
        })
    }

    fn iters_for(&self, size: usize) -> usize {
        self.iters
            .unwrap_or(if size >= 1 << 20 { 100 } else { 1000 })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Server,
    Client,
}

type Res<T> = Result<T, String>;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ping-pong: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Res<()> {
    let ep_type: EpType = match args.ep_type.as_str() {
        "dgram" => EpType::Dgram,
        "rdm" => {
            return Err("-e rdm needs the RDM protocol engine, which this release does not have yet; use -e dgram"
                .into());
        }
        other => return Err(format!("unknown endpoint type {other:?} (rdm|dgram)")),
    };
    if args.mode != "msg" {
        return Err(format!(
            "-m {}: DGRAM endpoints carry untagged messages only (-m msg)",
            args.mode
        ));
    }
    if args.listen && args.server.is_some() {
        return Err("give either -l (server) or a server address (client), not both".into());
    }
    let in_process = !args.listen && args.server.is_none();
    if args.provider == "loopback" && !in_process {
        return Err(
            "the loopback device is in-process: run without -l and without a server address".into(),
        );
    }
    if in_process {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .map_err(|e| format!("oob bind: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let server_args = args.clone();
        let server = std::thread::spawn(move || -> Res<()> {
            let (s, _) = listener.accept().map_err(|e| format!("oob accept: {e}"))?;
            drop(listener);
            let oob = Oob::from_accepted(s).map_err(|e| format!("oob: {e}"))?;
            session(
                &server_args,
                ep_type,
                Role::Server,
                oob,
                Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                false,
            )
        });
        let oob = Oob::connect("127.0.0.1", port).map_err(|e| format!("oob connect: {e}"))?;
        let bind = args.src_addr.or(Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let client = session(&args, ep_type, Role::Client, oob, bind, true);
        let server = server
            .join()
            .map_err(|_| "server thread panicked".to_string())?;
        client.and(server)
    } else if args.listen {
        let bind = args.src_addr.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let port = args.bind_port.unwrap_or(common::DEFAULT_OOB_PORT);
        let oob =
            Oob::accept(bind, port).map_err(|e| format!("oob listen on {bind}:{port}: {e}"))?;
        session(&args, ep_type, Role::Server, oob, Some(bind), true)
    } else {
        let server = args.server.clone().unwrap_or_default();
        let port = args.port.unwrap_or(common::DEFAULT_OOB_PORT);
        let oob = Oob::connect(&server, port)
            .map_err(|e| format!("oob connect to {server}:{port}: {e}"))?;
        let bind = args.src_addr.or(oob.local_ip().ok());
        session(&args, ep_type, Role::Client, oob, bind, true)
    }
}

/// One side of the test.
fn session(
    args: &Args,
    ep_type: EpType,
    role: Role,
    mut oob: Oob,
    bind: Option<IpAddr>,
    print: bool,
) -> Res<()> {
    let mut hints = Hints::new().provider(&args.provider).ep_type(ep_type);
    if let Some(ip) = bind {
        hints = hints.addr(ip);
    }
    let info = getinfo(&hints)
        .map_err(|e| e.to_string())?
        .into_iter()
        .next()
        .ok_or("no device")?;
    let domain = Domain::open(&info).map_err(|e| e.to_string())?;
    let cq = CompletionQueue::new(&domain, 1024).map_err(|e| e.to_string())?;
    let av = AddressVector::new(&domain);
    let ep = Endpoint::<Dgram>::builder(&domain)
        .cq(&cq)
        .av(&av)
        .build()
        .map_err(|e| e.to_string())?;
    let max = ep.max_msg_size();

    let params = match role {
        Role::Client => {
            let sizes = if args.size == "all" {
                all_sizes(max)
            } else {
                vec![parse_size(&args.size)?]
            };
            if let Some(&s) = sizes.iter().find(|&&s| s > max) {
                return Err(format!(
                    "size {s} exceeds the endpoint's max_msg_size {max}"
                ));
            }
            let p = Params {
                sizes,
                iters: args.iters,
                warmup: args.warmup,
                verify: args.verify,
            };
            oob.send_line(&p.encode()).map_err(|e| e.to_string())?;
            p
        }
        Role::Server => Params::decode(&oob.recv_line().map_err(|e| e.to_string())?)?,
    };
    let peer_addr = oob
        .exchange_addr(ep.addr())
        .map_err(|e| format!("address exchange: {e}"))?;
    let peer = av.insert(peer_addr).map_err(|e| e.to_string())?;
    if print {
        eprintln!(
            "{:?} {} -> {}",
            if role == Role::Client {
                "client"
            } else {
                "server"
            },
            ep.addr(),
            peer_addr
        );
        print_header();
    }
    let timeout = Duration::from_millis(args.timeout_ms);
    let mut pp = PingPong {
        ep: &ep,
        cq: &cq,
        peer,
        timeout,
        done: Vec::with_capacity(16),
    };
    for &size in &params.sizes {
        let mut msg = vec![0u8; size];
        fill_pattern(&mut msg, size as u64);
        let msg = Bytes::from(msg);
        pp.post_recv(BytesMut::with_capacity(size.max(1)))?;
        oob.sync().map_err(|e| e.to_string())?;
        let iters = params.iters_for(size);
        let mut start = Instant::now();
        let total = params.warmup + iters;
        for i in 0..total {
            if i == params.warmup {
                start = Instant::now();
            }
            // Keep one receive posted, except after the last message of this size.
            let repost = i + 1 < total;
            if role == Role::Client {
                pp.send(&msg)?;
                pp.wait_recv(size, params.verify, repost)?;
            } else {
                pp.wait_recv(size, params.verify, repost)?;
                pp.send(&msg)?;
            }
        }
        let elapsed = start.elapsed();
        pp.drain_sends()?;
        oob.sync().map_err(|e| e.to_string())?;
        if print {
            print_row(size, iters, 2, elapsed);
        }
    }
    Ok(())
}

struct PingPong<'a> {
    ep: &'a Endpoint<Dgram>,
    cq: &'a CompletionQueue,
    peer: PeerId,
    timeout: Duration,
    done: Vec<Completion>,
}

impl PingPong<'_> {
    fn post_recv(&mut self, buf: BytesMut) -> Res<()> {
        self.ep.recv(buf, 1).map_err(|e| format!("recv: {e}"))
    }

    fn send(&mut self, msg: &Bytes) -> Res<()> {
        loop {
            match self.ep.send(self.peer, msg.clone(), 2) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Again => {
                    self.poll_once()?;
                }
                Err(e) => return Err(format!("send: {e}")),
            }
        }
    }

    fn poll_once(&mut self) -> Res<usize> {
        match self.cq.poll(&mut self.done, 16) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == ErrorKind::ErrorAvailable => {
                let err = self
                    .cq
                    .read_err()
                    .map(|c| c.error.to_string())
                    .unwrap_or_default();
                Err(format!("error completion: {err}"))
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Spins until the receive completes, reposting its buffer at once when asked.
    fn wait_recv(&mut self, size: usize, verify: bool, repost: bool) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            self.poll_once()?;
            let mut got = None;
            for c in self.done.drain(..) {
                if c.flags.contains(CompletionFlags::RECV) {
                    got = Some(c);
                }
            }
            if let Some(c) = got {
                if c.len != size {
                    return Err(format!("received {} bytes, expected {size}", c.len));
                }
                let buf = c
                    .buf
                    .into_recv()
                    .ok_or("receive completion without its buffer")?;
                if verify {
                    check_pattern(&buf, size as u64)?;
                }
                return if repost { self.post_recv(buf) } else { Ok(()) };
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "no reply within {:?} (datagram lost?)",
                    self.timeout
                ));
            }
            std::hint::spin_loop();
        }
    }

    fn drain_sends(&mut self) -> Res<()> {
        self.poll_once()?;
        self.done
            .retain(|c| !c.flags.contains(CompletionFlags::SEND));
        Ok(())
    }
}
