//! Helpers shared by the examples: fabtests-style size lists and performance rows, and the small
//! TCP out-of-band channel that exchanges raw addresses and synchronises both sides.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use efa::RawAddr;

/// fabtests' default out-of-band port.
pub const DEFAULT_OOB_PORT: u16 = 47592;

/// fabtests' `size_str`: 64, 1k, 1.5k, 64k, 1m.
pub fn size_str(size: u64) -> String {
    let (base, mag) = if size >= 1 << 30 {
        (1u64 << 30, "g")
    } else if size >= 1 << 20 {
        (1 << 20, "m")
    } else if size >= 1 << 10 {
        (1 << 10, "k")
    } else {
        (1, "")
    };
    let fraction = if size / base < 10 {
        (size % base) * 10 / base
    } else {
        0
    };
    if fraction > 0 {
        format!("{}.{}{}", size / base, fraction, mag)
    } else {
        format!("{}{}", size / base, mag)
    }
}

/// fabtests' `cnt_str`: 1000 -> 1k, 1000000 -> 1m.
pub fn cnt_str(n: u64) -> String {
    let (base, mag) = if n >= 1_000_000_000 {
        (1_000_000_000u64, "b")
    } else if n >= 1_000_000 {
        (1_000_000, "m")
    } else if n >= 1_000 {
        (1_000, "k")
    } else {
        (1, "")
    };
    let fraction = if n / base < 10 {
        (n % base) * 10 / base
    } else {
        0
    };
    if fraction > 0 {
        format!("{}.{}{}", n / base, fraction, mag)
    } else {
        format!("{}{}", n / base, mag)
    }
}

/// Parses `64`, `1k`, `64k`, `1m`, `1g` (binary multiples).
/// The largest message size the examples accept: 1 GiB (each side allocates a few buffers of the
/// size; larger sizes are a typo more often than a test).
pub const MAX_SIZE: usize = 1 << 30;

pub fn parse_size(s: &str) -> Result<usize, String> {
    let n = parse_size_any(s)?;
    if n > MAX_SIZE {
        return Err(format!(
            "size {s}: larger than the examples' limit of 1 GiB ({MAX_SIZE} bytes)"
        ));
    }
    Ok(n)
}

fn parse_size_any(s: &str) -> Result<usize, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mult) = match s.chars().last() {
        Some('k') => (&s[..s.len() - 1], 1usize << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        _ => (&s[..], 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}: expected a number with optional k/m/g"))
}

/// fabtests' `-S all` list (powers of two and the midpoints between them) up to `max`.
pub fn all_sizes(max: usize) -> Vec<usize> {
    let mut v = vec![1usize];
    let mut p = 2usize;
    while p <= max {
        v.push(p);
        if p + p / 2 <= max && p >= 2 {
            v.push(p + p / 2);
        }
        p *= 2;
        if p > 1 << 30 {
            break;
        }
    }
    v.sort_unstable();
    v.dedup();
    v.retain(|&s| s <= max);
    v
}

/// The header of fabtests' `show_perf`.
pub fn print_header() {
    println!("{}", perf_header());
}

/// [`print_header`]'s line, without printing it.
pub fn perf_header() -> String {
    format!(
        "{:<8}{:<8}{:<8}{:>8} {:>10}{:>13}{:>13}",
        "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
    )
}

/// One row of fabtests' `show_perf`: `xfers_per_iter` is 2 for ping-pong (so usec/xfer is the
/// one-way latency) and 1 for bandwidth tests.
pub fn print_row(size: usize, iters: usize, xfers_per_iter: usize, elapsed: Duration) {
    println!("{}", perf_row(size, iters, xfers_per_iter, elapsed));
}

/// [`print_row`]'s line, without printing it.
pub fn perf_row(size: usize, iters: usize, xfers_per_iter: usize, elapsed: Duration) -> String {
    let usec = elapsed.as_secs_f64() * 1e6;
    let total = (size * iters * xfers_per_iter) as u64;
    let xfers = (iters * xfers_per_iter) as f64;
    format!(
        "{:<8}{:<8}{:<8}{:>8.2}s{:>10.2}{:>11.2}{:>11.2}",
        size_str(size as u64),
        cnt_str(iters as u64),
        size_str(total),
        usec / 1e6,
        total as f64 / usec,
        usec / xfers,
        xfers / usec
    )
}

/// A deterministic pattern for data verification (`-c`): byte `i` of message `seq`.
pub fn fill_pattern(buf: &mut [u8], seq: u64) {
    let period = pattern_period(seq);
    for chunk in buf.chunks_mut(PERIOD) {
        chunk.copy_from_slice(&period[..chunk.len()]);
    }
}

/// The pattern repeats every 251 bytes (`7 i mod 251` has period 251).
const PERIOD: usize = 251;

/// One period of [`fill_pattern`]'s bytes for message `seq`: byte `i` of a message is
/// `(31 seq + 7 i) mod 251`.
fn pattern_period(seq: u64) -> [u8; PERIOD] {
    let mut p = [0u8; PERIOD];
    for (i, b) in p.iter_mut().enumerate() {
        *b = (seq.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8;
    }
    p
}

/// Checks a buffer against [`fill_pattern`] (at memory speed: one period compared at a time).
pub fn check_pattern(buf: &[u8], seq: u64) -> Result<(), String> {
    let period = pattern_period(seq);
    for (k, chunk) in buf.chunks(PERIOD).enumerate() {
        if chunk != &period[..chunk.len()] {
            let j = chunk
                .iter()
                .zip(period.iter())
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            return Err(format!(
                "data mismatch in message {seq} at byte {}: got {:#04x}, want {:#04x}",
                k * PERIOD + j,
                chunk[j],
                period[j]
            ));
        }
    }
    Ok(())
}

/// The out-of-band TCP connection (fabtests' `oob_sock`).
pub struct Oob {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Oob {
    /// Server side: listens on `bind:port` and accepts one client. `::` listens on IPv6 and
    /// IPv4 (dual stack, as Linux binds it by default), falling back to `0.0.0.0` on a host
    /// without IPv6.
    pub fn accept(bind: IpAddr, port: u16) -> std::io::Result<Oob> {
        let l = match TcpListener::bind(SocketAddr::new(bind, port)) {
            Err(_) if bind == IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED) => TcpListener::bind(
                SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), port),
            )?,
            r => r?,
        };
        let (s, peer) = l.accept()?;
        eprintln!("oob: client connected from {peer}");
        Oob::from_stream(s)
    }

    /// Client side: connects to the server, retrying for a few seconds while it starts.
    pub fn connect(server: &str, port: u16) -> std::io::Result<Oob> {
        Oob::connect_from(server, port, None)
    }

    /// [`Oob::connect`] from local port `src_port` when given (fi_pingpong's client `-B`).
    pub fn connect_from(server: &str, port: u16, src_port: Option<u16>) -> std::io::Result<Oob> {
        use std::net::ToSocketAddrs;
        let target = if server.contains(':') && !server.starts_with('[') {
            format!("[{server}]:{port}")
        } else {
            format!("{server}:{port}")
        };
        // Retries while the server starts, for at most CONNECT_FOR in all: an address nothing
        // answers (unroutable, filtered) fails within that instead of the kernel's minutes.
        const CONNECT_FOR: Duration = Duration::from_secs(10);
        let deadline = std::time::Instant::now() + CONNECT_FOR;
        let mut last = None;
        while std::time::Instant::now() < deadline {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let attempt = target.to_socket_addrs().and_then(|mut addrs| {
                let addr = addrs.next().ok_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no address")
                })?;
                match src_port {
                    None => TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(10))),
                    Some(p) => connect_bound(addr, p),
                }
            });
            match attempt {
                Ok(s) => return Oob::from_stream(s),
                Err(e) => {
                    last = Some(e);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        let e = last.unwrap_or_else(|| std::io::Error::other("connect failed"));
        Err(std::io::Error::new(
            e.kind(),
            format!(
                "{e} (for {}s; is the server running, and reachable?)",
                CONNECT_FOR.as_secs()
            ),
        ))
    }

    /// Wraps a connection accepted elsewhere.
    pub fn from_accepted(s: TcpStream) -> std::io::Result<Oob> {
        Oob::from_stream(s)
    }

    fn from_stream(s: TcpStream) -> std::io::Result<Oob> {
        s.set_nodelay(true)?;
        Ok(Oob {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        })
    }

    /// The end of a run, in the manner of TCP's orderly close: says "nothing more from me"
    /// (shuts down this side's writing) and keeps the fabric endpoint driven (`progress`) until
    /// the peer has said the same (end of file) or `linger` ran out. A side whose last message
    /// has arrived may not close its endpoint at once: the peer's device may still wait for
    /// the acknowledgement of that message, and an acknowledgement lost just before the close
    /// would leave the peer's send without an answer until its unresponsive-peer timeout fails
    /// it (issue 30, point 15). A peer that never shuts down (`fi_pingpong`) ends the wait when
    /// it exits.
    pub fn close_linger(
        &mut self,
        linger: Duration,
        mut progress: impl FnMut() -> Result<(), String>,
    ) -> Result<(), String> {
        let _ = self.writer.shutdown(std::net::Shutdown::Write);
        let watch = self.watch().map_err(|e| format!("oob: {e}"))?;
        let deadline = Instant::now() + linger;
        let mut spins = 0u32;
        loop {
            progress()?;
            spins = spins.wrapping_add(1);
            // The peer's end costs three system calls to look at: every 256 passes.
            if spins.is_multiple_of(256) {
                if watch.gone() {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    tracing::debug!(?linger, "the peer did not end the run in time; closing");
                    return Ok(());
                }
            }
            std::hint::spin_loop();
        }
    }

    /// A handle that tells whether the peer closed the connection ([`PeerWatch::gone`]), for
    /// loops that wait on the fabric: a vanished peer is reported instead of a timeout.
    pub fn watch(&self) -> std::io::Result<PeerWatch> {
        Ok(PeerWatch(self.writer.try_clone()?))
    }

    /// This side's address of the TCP connection (the local address that reaches the peer).
    pub fn local_ip(&self) -> std::io::Result<IpAddr> {
        // An IPv4 client of a dual-stack listener is `::ffff:a.b.c.d` here: its IPv4 form.
        Ok(self.writer.local_addr()?.ip().to_canonical())
    }

    /// The peer's address of the TCP connection.
    pub fn peer_ip(&self) -> std::io::Result<IpAddr> {
        Ok(self.writer.peer_addr()?.ip().to_canonical())
    }

    /// Sends one line.
    pub fn send_line(&mut self, line: &str) -> std::io::Result<()> {
        self.writer.write_all(line.as_bytes())?;
        self.writer.write_all(b"\n")?;
        self.writer.flush()
    }

    /// Receives one line (without its newline).
    pub fn recv_line(&mut self) -> std::io::Result<String> {
        let mut s = String::new();
        if self.reader.read_line(&mut s)? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "peer closed the oob connection",
            ));
        }
        Ok(s.trim_end().to_string())
    }

    /// Exchanges raw addresses. A peer that bound an unspecified address (`0.0.0.0`, `::`) gets
    /// the address its TCP connection came from instead.
    pub fn exchange_addr(&mut self, mine: RawAddr) -> std::io::Result<RawAddr> {
        self.send_line(&mine.to_string())?;
        let line = self.recv_line()?;
        let mut peer: RawAddr = line
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{e}")))?;
        if peer.gid.to_ip().is_unspecified() {
            peer.gid = self.peer_ip()?.into();
        }
        Ok(peer)
    }

    /// Both sides wait for each other (fabtests' `ft_sync`).
    pub fn sync(&mut self) -> std::io::Result<()> {
        self.send_line("sync")?;
        let l = self.recv_line()?;
        if l != "sync" {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("expected sync, got {l:?}"),
            ));
        }
        Ok(())
    }
}

/// A TCP connection to `addr` from local port `src_port` on every address.
fn connect_bound(addr: SocketAddr, src_port: u16) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    let any: IpAddr = if addr.is_ipv4() {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    };
    s.bind(&SocketAddr::new(any, src_port).into())?;
    s.connect(&addr.into())?;
    Ok(s.into())
}

/// `addr_format` of an EFA address (`FI_ADDR_EFA` in libfabric's `enum` of address formats).
pub const FI_ADDR_EFA: u32 = 12;

/// The longest endpoint name fi_pingpong accepts from its peer.
pub const MAX_NAME_LEN: usize = 1024;

/// fi_pingpong's control exchange on the out-of-band connection (see docs/protocol.md,
/// "fi_pingpong's control exchange"). Every message is written with one `write` (fi_pingpong reads
/// each with a single `recv`) and read in full.
impl Oob {
    fn write_msg(&mut self, msg: &[u8]) -> std::io::Result<()> {
        self.writer.write_all(msg)?;
        self.writer.flush()
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        use std::io::Read;
        self.reader.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                std::io::Error::new(e.kind(), "peer closed the oob connection")
            } else {
                e
            }
        })
    }

    /// Sends an endpoint name: its length (4 bytes, big-endian), the address format (4 bytes, in
    /// this host's byte order, as fi_pingpong writes its `uint32_t`) and the name itself.
    pub fn send_name(&mut self, name: &[u8], addr_format: u32) -> std::io::Result<()> {
        let mut msg = Vec::with_capacity(8 + name.len());
        msg.extend_from_slice(&(name.len() as u32).to_be_bytes());
        msg.extend_from_slice(&addr_format.to_ne_bytes());
        msg.extend_from_slice(name);
        self.write_msg(&msg)
    }

    /// Receives what [`Oob::send_name`] sends: `(addr_format, name)`.
    pub fn recv_name(&mut self) -> std::io::Result<(u32, Vec<u8>)> {
        let mut head = [0u8; 8];
        self.read_exact(&mut head)?;
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len > MAX_NAME_LEN {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("peer's endpoint name is {len} bytes (at most {MAX_NAME_LEN})"),
            ));
        }
        let format = u32::from_ne_bytes([head[4], head[5], head[6], head[7]]);
        let mut name = vec![0u8; len];
        self.read_exact(&mut name)?;
        Ok((format, name))
    }

    /// Sends this endpoint's raw address as an `FI_ADDR_EFA` name.
    pub fn send_addr(&mut self, mine: RawAddr) -> std::io::Result<()> {
        self.send_name(&mine.to_bytes(), FI_ADDR_EFA)
    }

    /// Receives the peer's raw address (an `FI_ADDR_EFA` name of 32 bytes). A peer that bound an
    /// unspecified address (`0.0.0.0`, `::`) gets the address its TCP connection came from.
    pub fn recv_addr(&mut self) -> std::io::Result<RawAddr> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let (format, name) = self.recv_name()?;
        if format != FI_ADDR_EFA {
            return Err(bad(format!(
                "peer's address format is {format}, not FI_ADDR_EFA ({FI_ADDR_EFA})"
            )));
        }
        let mut peer = RawAddr::from_bytes(&name).map_err(|e| bad(e.to_string()))?;
        if peer.gid.to_ip().is_unspecified() {
            peer.gid = self.peer_ip()?.into();
        }
        Ok(peer)
    }

    /// fi_pingpong's per-size synchronisation: the client sends `"q\0"` and waits for `"a\0"`; the
    /// server waits for `"q\0"` and answers `"a\0"`.
    pub fn pp_sync(&mut self, role: Role) -> std::io::Result<()> {
        let (send, want): (&[u8; 2], &[u8; 2]) = match role {
            Role::Client => (b"q\0", b"a\0"),
            Role::Server => (b"a\0", b"q\0"),
        };
        if role == Role::Client {
            self.write_msg(send)?;
        }
        let mut got = [0u8; 2];
        self.read_exact(&mut got)?;
        if &got != want {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("sync: expected {want:?}, got {got:?}"),
            ));
        }
        if role == Role::Server {
            self.write_msg(send)?;
        }
        Ok(())
    }

    /// fi_pingpong's message count after each size: the client sends the number of messages it
    /// received as decimal text in a 10-byte NUL-padded field and waits for `"cnt ok\0"`; the
    /// server reads the field and answers. Both return the client's count.
    pub fn pp_count(&mut self, role: Role, received: u64) -> std::io::Result<u64> {
        const FIELD: usize = 10;
        const OK: &[u8; 7] = b"cnt ok\0";
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        match role {
            Role::Client => {
                let text = received.to_string();
                if text.len() > FIELD {
                    return Err(bad(format!("count {received} does not fit {FIELD} digits")));
                }
                let mut field = [0u8; FIELD];
                field[..text.len()].copy_from_slice(text.as_bytes());
                self.write_msg(&field)?;
                let mut ok = [0u8; 7];
                self.read_exact(&mut ok)?;
                if &ok != OK {
                    return Err(bad(format!("count: expected \"cnt ok\", got {ok:?}")));
                }
                Ok(received)
            }
            Role::Server => {
                let mut field = [0u8; FIELD];
                self.read_exact(&mut field)?;
                let end = field.iter().position(|&b| b == 0).unwrap_or(FIELD);
                let count = std::str::from_utf8(&field[..end])
                    .ok()
                    .and_then(|t| t.parse::<u64>().ok())
                    .ok_or_else(|| bad(format!("count: bad field {field:?}")))?;
                self.write_msg(OK)?;
                Ok(count)
            }
        }
    }
}

/// Watches the out-of-band connection for the peer's end (see [`Oob::watch`]).
pub struct PeerWatch(TcpStream);

impl PeerWatch {
    /// True when the peer closed the connection (it exited, or failed): a read would return
    /// end-of-file. Reads nothing; costs two `fcntl`s and a `recv(MSG_PEEK)`.
    pub fn gone(&self) -> bool {
        if self.0.set_nonblocking(true).is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        let r = self.0.peek(&mut b);
        let _ = self.0.set_nonblocking(false);
        matches!(r, Ok(0))
            || matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
    }

    /// True when the peer sent something (a line waits to be read) or closed the connection:
    /// for a side that expects nothing from the peer for a while, so that a peer's failure
    /// report is read at once. Reads nothing.
    pub fn has_news(&self) -> bool {
        if self.0.set_nonblocking(true).is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        let r = self.0.peek(&mut b);
        let _ = self.0.set_nonblocking(false);
        match r {
            Ok(_) => true,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

/// The connection options every example shares (fabtests' `-p -l -B -P -s <server>`).
#[derive(clap::Args, Debug, Clone)]
pub struct Conn {
    /// Device (provider): udp, shm, efa (cargo feature `efa`) or loopback (loopback: both ends
    /// in this process only).
    #[arg(short = 'p', default_value = "udp")]
    pub provider: String,
    /// Run as the server (listen for one client).
    #[arg(short = 'l')]
    pub listen: bool,
    /// Server: out-of-band port to listen on (default 47592, as fabtests); client: the local
    /// port to connect from.
    #[arg(short = 'B')]
    pub bind_port: Option<u16>,
    /// Client: the server's out-of-band port (default 47592).
    #[arg(short = 'P')]
    pub port: Option<u16>,
    /// Local address to bind (server default: all addresses; client default: the local address
    /// that reaches the server).
    #[arg(short = 's')]
    pub src_addr: Option<IpAddr>,
    /// udp device: its MTU (largest datagram, header included; default automatic: 65,000 on
    /// loopback). Give the peer's MTU when the peer is libfabric on an emulated EFA NIC (8928), which
    /// posts receive buffers of its own MTU.
    #[arg(long)]
    pub mtu: Option<usize>,
    /// udp device, for tests: it loses this share of the datagrams it sends, in percent
    /// (`FaultConfig::drop`, seeded with `--udp-seed`).
    #[arg(long, hide = true)]
    pub udp_loss: Option<f64>,
    /// udp device, for tests: the seed of `--udp-loss`'s decisions.
    #[arg(long, hide = true, default_value_t = 1)]
    pub udp_seed: u64,
    /// Server address (client mode). With neither this nor -l, both ends run in this process.
    pub server: Option<String>,
}

impl Conn {
    /// True when both ends run in this process.
    pub fn in_process(&self) -> bool {
        !self.listen && self.server.is_none()
    }
}

/// Which end of a test this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Listens.
    Server,
    /// Connects.
    Client,
}

/// One end of a test: its role, the out-of-band connection, the local address to bind and
/// whether it prints the results.
pub struct Side {
    /// Server or client.
    pub role: Role,
    /// The out-of-band connection to the other end.
    pub oob: Oob,
    /// The local address the device binds.
    pub bind: Option<IpAddr>,
    /// Print the table (both ends of a two-process run; the client only in one process).
    pub print: bool,
}

/// Runs `end` as a server (`-l`), a client (server address), or both in this process (neither),
/// joined by the out-of-band TCP connection.
pub fn launch<F>(conn: &Conn, end: F) -> Result<(), String>
where
    F: Fn(Side) -> Result<(), String> + Send + Sync + 'static,
{
    use std::net::Ipv4Addr;
    if conn.listen && conn.server.is_some() {
        return Err("give either -l (server) or a server address (client), not both".into());
    }
    if conn.provider == "loopback" && !conn.in_process() {
        return Err(
            "the loopback device is in-process: run without -l and without a server address".into(),
        );
    }
    if conn.in_process() {
        let end = std::sync::Arc::new(end);
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("oob bind: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let server_end = end.clone();
        let server = std::thread::spawn(move || -> Result<(), String> {
            let (s, _) = listener.accept().map_err(|e| format!("oob accept: {e}"))?;
            drop(listener);
            let oob = Oob::from_accepted(s).map_err(|e| format!("oob: {e}"))?;
            let bind = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
            server_end(Side {
                role: Role::Server,
                oob,
                bind,
                print: false,
            })
        });
        let oob = Oob::connect("127.0.0.1", port).map_err(|e| format!("oob connect: {e}"))?;
        let bind = conn.src_addr.or(Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        let client = end(Side {
            role: Role::Client,
            oob,
            bind,
            print: true,
        });
        let server = server
            .join()
            .map_err(|_| "server thread panicked".to_string())?;
        client.and(server)
    } else if conn.listen {
        let listen = conn
            .src_addr
            .unwrap_or(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED));
        let port = conn.bind_port.unwrap_or(DEFAULT_OOB_PORT);
        let oob =
            Oob::accept(listen, port).map_err(|e| format!("oob listen on {listen}:{port}: {e}"))?;
        // The listener takes every address; the endpoint binds the one this client reached, so
        // that its raw address names a routable GID (an RDM peer checks the address it is sent).
        let bind = conn.src_addr.or(oob.local_ip().ok());
        end(Side {
            role: Role::Server,
            oob,
            bind,
            print: true,
        })
    } else {
        let server = conn.server.clone().unwrap_or_default();
        let port = conn.port.unwrap_or(DEFAULT_OOB_PORT);
        let oob = Oob::connect_from(&server, port, conn.bind_port)
            .map_err(|e| format!("oob connect to {server}:{port}: {e}"))?;
        let bind = conn.src_addr.or(oob.local_ip().ok());
        end(Side {
            role: Role::Client,
            oob,
            bind,
            print: true,
        })
    }
}

/// An RDM endpoint, its completion queue and address vector, and the peer met through the
/// out-of-band address exchange ([`rdm_peer`]).
pub struct RdmPeer {
    pub domain: efa::Domain,
    pub cq: efa::CompletionQueue,
    pub av: efa::AddressVector,
    pub ep: efa::Endpoint<efa::Rdm>,
    pub peer: efa::PeerId,
}

/// Opens `conn`'s device bound to `bind`, makes an RDM endpoint with a completion queue of
/// `cq_size` entries (`tune` sets other builder options), and exchanges addresses over `oob`.
pub fn rdm_peer(
    conn: &Conn,
    bind: Option<IpAddr>,
    oob: &mut Oob,
    cq_size: usize,
    tune: impl FnOnce(efa::EndpointBuilder<efa::Rdm>) -> efa::EndpointBuilder<efa::Rdm>,
) -> Result<RdmPeer, String> {
    let domain = open_domain(conn, efa::EpType::Rdm, bind)?;
    let cq = efa::CompletionQueue::new(&domain, cq_size).map_err(|e| e.to_string())?;
    let av = efa::AddressVector::new(&domain);
    let ep = tune(efa::Endpoint::<efa::Rdm>::builder(&domain).cq(&cq).av(&av))
        .build()
        .map_err(|e| e.to_string())?;
    let peer_addr = oob
        .exchange_addr(ep.addr())
        .map_err(|e| format!("address exchange: {e}"))?;
    let peer = av.insert(peer_addr).map_err(|e| e.to_string())?;
    Ok(RdmPeer {
        domain,
        cq,
        av,
        ep,
        peer,
    })
}

/// Opens the device `conn.provider` for `ep_type`, bound to `bind` (a `udp` device with
/// `conn.mtu`'s MTU when given).
pub fn open_domain(
    conn: &Conn,
    ep_type: efa::EpType,
    bind: Option<IpAddr>,
) -> Result<efa::Domain, String> {
    if conn.provider == "udp" && (conn.mtu.is_some() || conn.udp_loss.is_some()) {
        use efa::device::udp::{UdpConfig, UdpDevice};
        let config = efa::Config::from_env().map_err(|e| e.to_string())?;
        let mut udp = UdpConfig::default();
        if let Some(mtu) = conn.mtu {
            udp.mtu = mtu;
        }
        if let Some(pct) = conn.udp_loss {
            if !(0.0..=100.0).contains(&pct) {
                return Err(format!("--udp-loss {pct}: a share in percent, 0 to 100"));
            }
            udp.faults = efa::FaultConfig::seeded(conn.udp_seed).drop(pct / 100.0);
        }
        if let Some(ip) = bind {
            udp.bind = ip;
        }
        let mut device: std::sync::Arc<dyn efa::device::Device> =
            UdpDevice::open(udp).map_err(|e| e.to_string())?;
        if ep_type == efa::EpType::Rdm {
            device = efa::device::route::for_rdm(device, config.enable_shm_transfer);
        }
        return Ok(efa::Domain::with_device(device, config));
    }
    let mut hints = efa::Hints::new().provider(&conn.provider).ep_type(ep_type);
    if let Some(ip) = bind {
        hints = hints.addr(ip);
    }
    let info = efa::getinfo(&hints)
        .map_err(|e| e.to_string())?
        .into_iter()
        .next()
        .ok_or("no device")?;
    efa::Domain::open(&info).map_err(|e| e.to_string())
}

/// Polls `cq` once; an error completion becomes the error text.
pub fn poll_cq(
    cq: &efa::CompletionQueue,
    out: &mut Vec<efa::Completion>,
    max: usize,
) -> Result<usize, String> {
    match cq.poll(out, max) {
        Ok(n) => Ok(n),
        Err(e) if e.kind() == efa::ErrorKind::ErrorAvailable => {
            let err = cq
                .read_err()
                .map(|c| c.error.to_string())
                .unwrap_or_default();
            Err(format!("error completion: {err}"))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Sends the library's `tracing` events to stderr: `RUST_LOG` chooses (for example
/// `RUST_LOG=efa=debug`); without it, warnings and errors of the `efa` crate show (a clamped
/// configuration value, a device that could not be opened), so they are seen where a user looks.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("efa=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Which path messages to the peer took, from the counters: the RDM local channel (two
/// processes on one host, `FI_EFA_ENABLE_SHM_TRANSFER`), the shm route of a `udp` or `efa`
/// device, or the device itself.
pub fn path_taken(
    ep: Option<&efa::EndpointStats>,
    device: &std::sync::Arc<dyn efa::device::Device>,
) -> String {
    let d = device.stats();
    let kind = device.attr().kind;
    if ep.is_some_and(|s| s.local_tx_msgs + s.local_rx_msgs > 0) {
        "local channel (shared memory, same host; FI_EFA_ENABLE_SHM_TRANSFER=0 to use the device)"
            .into()
    } else if d.shm_route_tx_pkts + d.shm_route_rx_pkts > 0 {
        format!("shm route of the {} device (same host)", kind.name())
    } else {
        format!("{} device", kind.name())
    }
}
