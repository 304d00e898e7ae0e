//! Ping-pong latency and bandwidth that interoperates with libfabric's `fi_pingpong`: the same
//! command line, the same out-of-band control exchange byte for byte, the same message sequence,
//! data pattern and output, so either end may be `fi_pingpong` (docs/protocol.md, "fi_pingpong's
//! control exchange").
//!
//! ```text
//! cargo run --release --example ping-pong -- -e rdm -S all           # RDM, both ends in this process
//! cargo run --release --example ping-pong -- -e rdm -l               # server
//! cargo run --release --example ping-pong -- -e rdm 127.0.0.1       # client
//! cargo run --release --example ping-pong -- -e dgram -S 1024 -c     # datagrams
//! fi_pingpong -p efa -e rdm -m tagged -S all -c  +  ping-pong -p efa -e rdm -m tagged -S all -c <server>
//! ```
//!
//! As with `fi_pingpong`, both ends must be given the same options: nothing but the endpoint
//! names is exchanged. The defaults are fi_pingpong's: `-e dgram`, `-I 10`, and without `-S` the
//! sizes 64, 256, 1k, 4k, 64k and 1m. `-S all` is 0, 1, 2, 3, 4, 6, 8, 12, ... (every power of
//! two and 1.5 times it) up to 6 MiB on RDM and up to the MTU on DGRAM; `-S N` is N bytes. `-c`
//! fills every message with fi_pingpong's pattern and checks every message received (give it to
//! both ends). `-m tagged` sends tagged messages with fi_pingpong's tag, 1234. There is no
//! warm-up. Differences: the server is `-l` (fi_pingpong: no address), a lost datagram ends the
//! test with an error after `--timeout-ms` (fi_pingpong waits forever), and with neither `-l`
//! nor a server address both ends run in this process and every message is verified.
//!
//! The TCP connection (port `-B` on the server, `-P` on the client, default 47592): the server
//! sends its endpoint name (length, address format, the 32-byte EFA address), the client its own;
//! before each size the client sends `q` and the server answers `a`; after it the client sends
//! how many messages it received and the server answers `cnt ok`. The endpoints then exchange one
//! `fin` message over the fabric and close.
//!
//! With `--mr-min SIZE`, RDM messages of at least SIZE bytes are sent from registered memory
//! regions that peers may read (as fabtests register their buffers), so the protocol engine may
//! use its read-based protocols for them (`FI_EFA_INTER_MIN_READ_MESSAGE_SIZE`, 1 MiB by
//! default). The default, `auto`, is that threshold on `-p shm`, whose RDMA reads copy once
//! (CMA), and on `-p efa`, whose NIC reads (as `fi_pingpong`'s registered buffers let libfabric
//! use long-read from 1 MiB), and `never` on `udp` (its RDMA reads are slower than its long-CTS
//! messages).
//!
//! At the end each side prints, on stderr, the path its messages took (`# path to the peer:`
//! the RDM local channel between processes of one host, the shm route of a `udp`/`efa` device,
//! or the device itself); `-v` adds the endpoint's and the device's counters, `PP_STATS=1`
//! prints them after each size.
//!
//! `FI_EFA_*` variables apply. RDM endpoints on `-p udp` reach a peer on the same host over
//! shared memory (`FI_EFA_ENABLE_SHM_TRANSFER`, on by default as in libfabric); set
//! `FI_EFA_ENABLE_SHM_TRANSFER=0` on both sides to measure the udp path.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{Conn, Role, Side, launch, open_domain, parse_size, poll_cq, size_str};
use efa::{
    Access, AddressVector, Buffer, Completion, CompletionFlags, CompletionQueue, Dgram, Domain,
    Endpoint, EpType, ErrorKind, MemoryRegion, PeerId, PostError, RawAddr, Rdm, SendBuf,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "Ping-pong latency test, interoperable with libfabric's fi_pingpong")]
struct Args {
    /// Endpoint type: rdm or dgram (fi_pingpong's default: dgram).
    #[arg(short = 'e', default_value = "dgram")]
    ep_type: String,
    /// Message size in bytes (also 1k, 1m) or `all`; without it 64, 256, 1k, 4k, 64k and 1m.
    #[arg(short = 'S')]
    size: Option<String>,
    /// Round trips per size.
    #[arg(short = 'I', default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Fill every message with fi_pingpong's pattern and check every message received.
    #[arg(short = 'c')]
    verify: bool,
    /// Message kind: msg or tagged (tagged needs -e rdm).
    #[arg(short = 'm', default_value = "msg")]
    mode: String,
    /// Give up when a reply takes longer than this many milliseconds (datagrams can be lost).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// RDM messages of at least this size go from registered regions peers may read, which
    /// lets the engine pick its read-based protocols (`never`; `auto`: the long-read threshold
    /// on shm and efa, never on udp).
    #[arg(long, default_value = "auto")]
    mr_min: String,
    /// Always use `send` (each message gets a send completion). By default messages up to the
    /// endpoint's inject size go with `inject`, which has no send completion, as fi_pingpong's
    /// `fi_inject`.
    #[arg(long)]
    no_inject: bool,
    /// Print the endpoint's and the device's counters at the end (on stderr).
    #[arg(short = 'v')]
    verbose: bool,
    #[command(flatten)]
    conn: Conn,
}

/// fi_pingpong's buffer size when no `-S N` gives one: 4 MiB + 2 MiB, the largest `-S all` size.
const PP_MAX_DATA_MSG: usize = (1 << 22) + (1 << 21);

/// fi_pingpong's smallest receive buffer (room for its control messages).
const PP_MAX_CTRL_MSG: usize = 64;

/// fi_pingpong's sizes without `-S`.
const DEFAULT_SIZES: [usize; 6] = [64, 256, 1024, 4096, 65536, 1048576];

/// The tag of every message with `-m tagged` (fi_pingpong's `TAG`).
const TAG: u64 = 1234;

/// Which sizes `-S` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SizeSel {
    /// No `-S`: [`DEFAULT_SIZES`].
    Default,
    /// `-S all`.
    All,
    /// `-S N`.
    One(usize),
}

impl SizeSel {
    fn parse(s: Option<&str>) -> Res<SizeSel> {
        Ok(match s {
            None => SizeSel::Default,
            Some(a) if a.eq_ignore_ascii_case("all") => SizeSel::All,
            Some(n) => SizeSel::One(parse_size(n)?),
        })
    }

    /// The message buffer size (fi_pingpong's `tx_size`): the one size asked for, else
    /// [`PP_MAX_DATA_MSG`], capped at the endpoint's largest message.
    fn buffer_size(self, max_msg_size: usize) -> usize {
        match self {
            SizeSel::One(n) => n,
            _ => PP_MAX_DATA_MSG,
        }
        .min(max_msg_size)
    }

    /// The sizes to test with a buffer of `tx_size` bytes, as fi_pingpong generates them.
    fn sizes(self, tx_size: usize) -> Vec<usize> {
        match self {
            SizeSel::One(n) if n <= tx_size => vec![n],
            SizeSel::One(_) => Vec::new(),
            SizeSel::Default => DEFAULT_SIZES
                .into_iter()
                .take_while(|&s| s <= tx_size)
                .collect(),
            SizeSel::All => {
                let mut v = Vec::new();
                for i in 0..usize::BITS - 1 {
                    let (pow, half) = if i == 0 {
                        (0, 1)
                    } else {
                        (1usize << i, (1usize << i) + (1usize << (i - 1)))
                    };
                    if pow > tx_size {
                        break;
                    }
                    v.push(pow);
                    if half > tx_size {
                        break;
                    }
                    v.push(half);
                }
                v
            }
        }
    }
}

/// fi_pingpong's data pattern: message `k` (counted from 0 over the whole run, separately for
/// messages sent and received) is the alphanumeric alphabet from index `7 k mod 62`, repeated.
#[derive(Debug, Default)]
struct Pattern {
    next: u32,
}

/// The alphabet twice, so that any 62-byte period is one slice.
const ALPHABET2: &[u8; 124] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\
0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
const ALPHABET_LEN: usize = 62;

impl Pattern {
    /// The period of the next message (and counts it).
    fn take(&mut self) -> &'static [u8] {
        let start = (self.next.wrapping_mul(7) as usize) % ALPHABET_LEN;
        self.next = self.next.wrapping_add(1);
        &ALPHABET2[start..start + ALPHABET_LEN]
    }

    fn fill(&mut self, buf: &mut [u8]) {
        let period = self.take();
        for chunk in buf.chunks_mut(ALPHABET_LEN) {
            chunk.copy_from_slice(&period[..chunk.len()]);
        }
    }

    fn check(&mut self, buf: &[u8]) -> Res<()> {
        let msg = self.next;
        let period = self.take();
        for (k, chunk) in buf.chunks(ALPHABET_LEN).enumerate() {
            if let Some(j) = chunk.iter().zip(period).position(|(a, b)| a != b) {
                return Err(format!(
                    "data check: message {msg} of {} bytes differs at byte {}: got {:#04x}, want {:#04x}",
                    buf.len(),
                    k * ALPHABET_LEN + j,
                    chunk[j],
                    period[j]
                ));
            }
        }
        Ok(())
    }
}

/// fi_pingpong's `cnt_str`: 1000 -> 1k (no fraction).
fn cnt_str(n: u64) -> String {
    match n {
        1_000_000_000.. => format!("{}b", n / 1_000_000_000),
        1_000_000.. => format!("{}m", n / 1_000_000),
        1_000.. => format!("{}k", n / 1_000),
        _ => n.to_string(),
    }
}

/// fi_pingpong's header.
fn print_header() {
    println!(
        "{:<8}{:<8}{:<9}{:<8}{:>8} {:>10}{:>13}{:>13}",
        "bytes", "#sent", "#ack", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
    );
}

/// One row of fi_pingpong's output: `sent` round trips, `acked` messages the client received,
/// `usec` whole microseconds.
fn print_row(size: usize, sent: u64, acked: u64, usec: u64) {
    let bytes = sent * size as u64 * 2;
    let ack = if sent == acked {
        format!("={}", cnt_str(acked))
    } else if sent < acked {
        format!("-{}", cnt_str(acked - sent))
    } else {
        format!("+{}", cnt_str(sent - acked))
    };
    let per_xfer = usec as f32 / sent as f32 / 2.0;
    println!(
        "{:<8}{:<8}{:<9}{:<8}{:>8.2}s{:>10.2}{:>11.2}{:>11.2}",
        size_str(size as u64),
        cnt_str(sent),
        ack,
        size_str(bytes),
        usec as f64 / 1e6,
        bytes as f64 / usec as f64,
        per_xfer,
        1.0 / per_xfer
    );
}

type Res<T> = Result<T, String>;

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ping-pong: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Res<()> {
    let ep_type: EpType = match args.ep_type.as_str() {
        "dgram" => EpType::Dgram,
        "rdm" => EpType::Rdm,
        other => return Err(format!("unknown endpoint type {other:?} (rdm|dgram)")),
    };
    match (args.mode.as_str(), ep_type) {
        ("msg", _) | ("tagged", EpType::Rdm) => {}
        ("tagged", _) => {
            return Err("-m tagged: DGRAM endpoints carry untagged messages only".into());
        }
        (m, _) => return Err(format!("unknown message kind {m:?} (msg|tagged)")),
    }
    SizeSel::parse(args.size.as_deref())?;
    let conn = args.conn.clone();
    launch(&conn, move |side| session(&args, ep_type, side))
}

/// What the ping-pong loop needs from an endpoint (both kinds have it).
trait PingEp {
    fn addr(&self) -> RawAddr;
    /// The domain to register send regions with (`None`: this kind sends `Bytes` only).
    fn region_domain(&self) -> Option<&Domain>;
    fn stats_line(&self) -> String {
        String::new()
    }
    /// The path messages took (`common::path_taken`).
    fn path(&self) -> String;
    fn post_send(&self, peer: PeerId, msg: SendBuf, tagged: bool) -> Result<(), PostError>;
    fn post_recv(&self, buf: BytesMut, tagged: bool) -> Result<(), PostError>;
    /// Messages shorter than this go with [`PingEp::inject`].
    fn inject_size(&self) -> usize;
    fn inject(&self, peer: PeerId, msg: &[u8], tagged: bool) -> efa::Result<()>;
}

impl PingEp for Endpoint<Dgram> {
    fn addr(&self) -> RawAddr {
        Endpoint::<Dgram>::addr(self)
    }
    fn region_domain(&self) -> Option<&Domain> {
        None
    }
    fn path(&self) -> String {
        common::path_taken(None, self.domain().device())
    }
    fn post_send(&self, peer: PeerId, msg: SendBuf, _tagged: bool) -> Result<(), PostError> {
        self.send(peer, msg, 2)
    }
    fn post_recv(&self, buf: BytesMut, _tagged: bool) -> Result<(), PostError> {
        self.recv(buf, 1)
    }
    fn inject_size(&self) -> usize {
        Endpoint::<Dgram>::inject_size(self)
    }
    fn inject(&self, peer: PeerId, msg: &[u8], _tagged: bool) -> efa::Result<()> {
        Endpoint::<Dgram>::inject(self, peer, msg)
    }
}

impl PingEp for Endpoint<Rdm> {
    fn addr(&self) -> RawAddr {
        Endpoint::<Rdm>::addr(self)
    }
    fn region_domain(&self) -> Option<&Domain> {
        Some(self.domain())
    }
    fn path(&self) -> String {
        common::path_taken(Some(&self.stats()), self.domain().device())
    }
    fn stats_line(&self) -> String {
        format!(
            "ep {:?}\ndev {:?}",
            self.stats(),
            self.domain().device().stats()
        )
    }
    fn post_send(&self, peer: PeerId, msg: SendBuf, tagged: bool) -> Result<(), PostError> {
        if tagged {
            self.tsend(peer, msg, TAG, 2)
        } else {
            self.send(peer, msg, 2)
        }
    }
    fn post_recv(&self, buf: BytesMut, tagged: bool) -> Result<(), PostError> {
        if tagged {
            self.trecv(buf, TAG, 0, 1)
        } else {
            self.recv(buf, 1)
        }
    }
    fn inject_size(&self) -> usize {
        Endpoint::<Rdm>::inject_size(self)
    }
    fn inject(&self, peer: PeerId, msg: &[u8], tagged: bool) -> efa::Result<()> {
        if tagged {
            self.tinject(peer, msg, TAG)
        } else {
            Endpoint::<Rdm>::inject(self, peer, msg)
        }
    }
}

/// One side of the test: opens the device and the endpoint of the asked kind.
fn session(args: &Args, ep_type: EpType, side: Side) -> Res<()> {
    let domain = open_domain(&args.conn, ep_type, side.bind)?;
    let cq = CompletionQueue::new(&domain, 1024).map_err(|e| e.to_string())?;
    let av = AddressVector::new(&domain);
    match ep_type {
        EpType::Dgram => {
            let ep = Endpoint::<Dgram>::builder(&domain)
                .cq(&cq)
                .av(&av)
                .build()
                .map_err(|e| e.to_string())?;
            let max = ep.max_msg_size();
            // fi_pingpong keeps two receives posted on DGRAM endpoints.
            pingpong(args, side, &ep, &cq, &av, max, 2)
        }
        _ => {
            let ep = Endpoint::<Rdm>::builder(&domain)
                .cq(&cq)
                .av(&av)
                .build()
                .map_err(|e| e.to_string())?;
            pingpong(args, side, &ep, &cq, &av, usize::MAX, 1)
        }
    }
}

/// The test, in fi_pingpong's order: names (the server's first), then for each size a sync, the
/// round trips and the count, then one `fin` message each way.
#[allow(clippy::too_many_arguments)]
fn pingpong<E: PingEp>(
    args: &Args,
    side: Side,
    ep: &E,
    cq: &CompletionQueue,
    av: &AddressVector,
    max_msg_size: usize,
    receives: usize,
) -> Res<()> {
    let Side {
        role,
        mut oob,
        print,
        ..
    } = side;
    let sel = SizeSel::parse(args.size.as_deref())?;
    let tx_size = sel.buffer_size(max_msg_size);
    let sizes = sel.sizes(tx_size);
    let verify = args.verify || args.conn.in_process();
    let tagged = args.mode == "tagged";
    let mr_min = match args.mr_min.as_str() {
        // From the engine's long-read threshold: below it a region only costs the copy the
        // endpoint makes of it (the message goes in packets either way).
        "auto" if matches!(args.conn.provider.as_str(), "shm" | "efa") => efa::Config::from_env()
            .map(|c| c.inter_min_read_message_size)
            .map_err(|e| e.to_string())?,
        "never" | "auto" => usize::MAX,
        s => parse_size(s)?,
    };
    let watch = oob.watch().ok();
    let mut pp = PingPong {
        ep,
        cq,
        peer: None,
        timeout: Duration::from_millis(args.timeout_ms),
        reliable: args.ep_type != "dgram",
        watch,
        tagged,
        done: Vec::with_capacity(16),
        sends_posted: 0,
        sends_done: 0,
        use_regions: false,
        regions: Vec::new(),
        inject: false,
        verify,
        tx_pattern: Pattern::default(),
        rx_pattern: Pattern::default(),
        scratch: Vec::new(),
        zeros: Bytes::new(),
    };
    // As fi_pingpong: receives for the largest message are posted before the names go out, and
    // one is reposted as soon as one completes.
    for _ in 0..receives {
        pp.post_recv(BytesMut::with_capacity(tx_size.max(PP_MAX_CTRL_MSG)))?;
    }
    let peer_addr = match role {
        Role::Server => {
            oob.send_addr(ep.addr())
                .map_err(|e| format!("sending our name: {e}"))?;
            oob.recv_addr().map_err(|e| format!("peer's name: {e}"))?
        }
        Role::Client => {
            let a = oob.recv_addr().map_err(|e| format!("peer's name: {e}"))?;
            oob.send_addr(ep.addr())
                .map_err(|e| format!("sending our name: {e}"))?;
            a
        }
    };
    pp.peer = Some(av.insert(peer_addr).map_err(|e| e.to_string())?);
    if print {
        let who = if role == Role::Client {
            "client"
        } else {
            "server"
        };
        eprintln!(
            "{who} {} -> {peer_addr}{}",
            ep.addr(),
            if verify { " (verifying data)" } else { "" }
        );
    }
    let mut header = print;
    for &size in &sizes {
        pp.prepare_size(size, mr_min, args.no_inject)?;
        oob.pp_sync(role).map_err(|e| e.to_string())?;
        let mut received = 0u64;
        let start = Instant::now();
        for _ in 0..args.iters {
            if role == Role::Client {
                pp.send(size)?;
                pp.wait_recv(Some(size))?;
            } else {
                pp.wait_recv(Some(size))?;
                pp.send(size)?;
            }
            received += 1;
        }
        // As fi_pingpong, whose last send has completed when its loop ends.
        pp.drain_sends()?;
        let usec = start.elapsed().as_micros() as u64;
        if std::env::var_os("PP_STATS").is_some() {
            eprintln!("{}", ep.stats_line());
        }
        let acked = oob.pp_count(role, received).map_err(|e| e.to_string())?;
        if print && args.iters > 0 {
            if header {
                print_header();
                header = false;
            }
            print_row(size, args.iters, acked, usec.max(1));
        }
    }
    pp.finalize()?;
    // Our last message's acknowledgement may still be owed to the peer: answer until it ends too.
    oob.close_linger(pp.timeout, || pp.poll_once().map(|_| ()))?;
    // On stderr: stdout stays fi_pingpong's.
    eprintln!("# path to the peer: {}", ep.path());
    if args.verbose {
        eprintln!("{}", ep.stats_line());
    }
    Ok(())
}

struct PingPong<'a, E: PingEp> {
    ep: &'a E,
    cq: &'a CompletionQueue,
    /// The peer, once its name came.
    peer: Option<PeerId>,
    timeout: Duration,
    /// RDM: nothing is lost, so a silence means the peer stopped, not a lost datagram.
    reliable: bool,
    /// The out-of-band connection: a peer that exits closes it.
    watch: Option<common::PeerWatch>,
    tagged: bool,
    done: Vec<Completion>,
    sends_posted: u64,
    sends_done: u64,
    /// This size is sent from registered regions.
    use_regions: bool,
    /// Registered copies of the message not in use by a send.
    regions: Vec<MemoryRegion>,
    /// This size is sent with `inject`.
    inject: bool,
    /// `-c`: fill what is sent, check what is received.
    verify: bool,
    tx_pattern: Pattern,
    rx_pattern: Pattern,
    /// The bytes of the next inject.
    scratch: Vec<u8>,
    /// A message of this size's zeros (sent when not verifying, as fi_pingpong's untouched buffer).
    zeros: Bytes,
}

impl<E: PingEp> PingPong<'_, E> {
    fn peer(&self) -> PeerId {
        self.peer
            .expect("the peer is inserted before the first message")
    }

    /// Sets up the buffers the messages of `size` bytes go from.
    fn prepare_size(&mut self, size: usize, mr_min: usize, no_inject: bool) -> Res<()> {
        self.regions.clear();
        self.use_regions = false;
        self.zeros = Bytes::from(vec![0u8; size]);
        self.scratch = vec![0u8; size];
        if let Some(domain) = self
            .ep
            .region_domain()
            .filter(|_| size >= mr_min && size > 0)
        {
            // A few, as a send hands its region back only when it completes.
            for _ in 0..4 {
                let r = domain
                    .register(vec![0u8; size], Access::SEND | Access::REMOTE_READ)
                    .map_err(|e| format!("register: {e}"))?;
                self.regions.push(r);
            }
            self.use_regions = true;
        }
        // As fi_pingpong: below the inject size, no send completions.
        self.inject = !no_inject && size < self.ep.inject_size();
        Ok(())
    }

    fn post_recv(&mut self, mut buf: BytesMut) -> Res<()> {
        buf.clear();
        self.ep
            .post_recv(buf, self.tagged)
            .map_err(|e| format!("recv: {e}"))
    }

    /// Sends the next message of `size` bytes (with the pattern when verifying).
    fn send(&mut self, size: usize) -> Res<()> {
        if self.inject {
            let mut msg = std::mem::take(&mut self.scratch);
            if self.verify {
                self.tx_pattern.fill(&mut msg);
            }
            let r = self.inject_bytes(&msg);
            self.scratch = msg;
            return r;
        }
        if self.use_regions {
            return self.send_region();
        }
        let msg = if self.verify {
            let mut v = vec![0u8; size];
            self.tx_pattern.fill(&mut v);
            Bytes::from(v)
        } else {
            self.zeros.clone()
        };
        self.send_buf(SendBuf::from(msg))
    }

    /// Sends from a registered region, waiting for one to come back from an earlier send.
    fn send_region(&mut self) -> Res<()> {
        let mut deadline = None;
        let mut region = loop {
            if let Some(r) = self.regions.pop() {
                break r;
            }
            self.poll_once()?;
            let d = *deadline.get_or_insert_with(|| Instant::now() + self.timeout);
            if Instant::now() > d {
                return Err("no send completion hands a region back".into());
            }
        };
        if self.verify {
            self.tx_pattern.fill(&mut region.write());
        }
        self.send_buf(SendBuf::from(region))
    }

    /// Posts one send, polling while the endpoint says `Again`.
    fn send_buf(&mut self, mut buf: SendBuf) -> Res<()> {
        let peer = self.peer();
        loop {
            match self.ep.post_send(peer, buf, self.tagged) {
                Ok(()) => {
                    self.sends_posted += 1;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Again => {
                    buf = match e.buf {
                        Buffer::Send(b) => SendBuf::Bytes(b),
                        Buffer::Region(r) => SendBuf::Region(r),
                        _ => return Err("send: the buffer did not come back".into()),
                    };
                    self.poll_once()?;
                }
                Err(e) => return Err(format!("send: {e}")),
            }
        }
    }

    /// Injects `msg` (no completion to count), polling while the endpoint says `Again`.
    fn inject_bytes(&mut self, msg: &[u8]) -> Res<()> {
        let peer = self.peer();
        let mut deadline = None;
        loop {
            match self.ep.inject(peer, msg, self.tagged) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Again => {
                    self.poll_once()?;
                    let d = *deadline.get_or_insert_with(|| Instant::now() + self.timeout);
                    if Instant::now() > d {
                        return Err("inject: the endpoint stays full".into());
                    }
                }
                Err(e) => return Err(format!("inject: {e}")),
            }
        }
    }

    fn poll_once(&mut self) -> Res<usize> {
        let before = self.done.len();
        let n = poll_cq(self.cq, &mut self.done, 16)?;
        // Count send completions here and keep only receives for `wait_recv`.
        let mut k = before;
        while k < self.done.len() {
            if self.done[k].flags.contains(CompletionFlags::SEND) {
                let c = self.done.swap_remove(k);
                if let Some(r) = c.buf.into_region() {
                    self.regions.push(r);
                }
                self.sends_done += 1;
            } else {
                k += 1;
            }
        }
        Ok(n)
    }

    /// Spins until a receive completes, checks it (`size`: the message expected, `None`: any
    /// message, unchecked) and reposts its buffer at once.
    fn wait_recv(&mut self, size: Option<usize>) -> Res<()> {
        // Set at the first clock read (after 1024 polls): a quick reply needs none.
        let mut deadline = None;
        let mut spins = 0u32;
        loop {
            if self.done.is_empty() {
                self.poll_once()?;
            }
            let got = self
                .done
                .iter()
                .position(|c| c.flags.contains(CompletionFlags::RECV))
                .map(|k| self.done.remove(k));
            if let Some(c) = got {
                let len = c.len;
                let buf = c
                    .buf
                    .into_recv()
                    .ok_or("receive completion without its buffer")?;
                if let Some(size) = size {
                    if len != size {
                        return Err(format!("received {len} bytes, expected {size}"));
                    }
                    if self.verify {
                        self.rx_pattern.check(&buf[..size])?;
                    }
                }
                return self.post_recv(buf);
            }
            self.done
                .retain(|c| c.flags.contains(CompletionFlags::RECV));
            // The clock only every 1024 polls: a clock read costs as much as an idle poll; the
            // out-of-band connection (three system calls) every 64 Ki polls.
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64 << 10) && self.watch.as_ref().is_some_and(|w| w.gone()) {
                return Err(
                    "the peer closed the out-of-band connection: it exited or failed".into(),
                );
            }
            if spins.is_multiple_of(1024)
                && Instant::now() > *deadline.get_or_insert_with(|| Instant::now() + self.timeout)
            {
                return Err(if self.reliable {
                    format!(
                        "no reply within {:?}: the peer stopped answering (--timeout-ms)",
                        self.timeout
                    )
                } else {
                    format!("no reply within {:?} (datagram lost?)", self.timeout)
                });
            }
            std::hint::spin_loop();
        }
    }

    /// Waits until every send posted so far has completed. With manual progress this keeps the
    /// endpoint driven until its last message is through (a long message needs the peer's
    /// clear-to-send answered) before the out-of-band exchange stops polling.
    fn drain_sends(&mut self) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        while self.sends_done < self.sends_posted {
            self.poll_once()?;
            if Instant::now() > deadline {
                return Err(format!(
                    "{} sends still not complete",
                    self.sends_posted - self.sends_done
                ));
            }
        }
        Ok(())
    }

    /// fi_pingpong's finalize: each side sends `"fin\0"`, waits for that send to complete and
    /// for the peer's message (whose contents fi_pingpong does not check either).
    fn finalize(&mut self) -> Res<()> {
        self.send_buf(SendBuf::from(Bytes::from_static(b"fin\0")))?;
        self.drain_sends()?;
        self.wait_recv(None)
    }
}
