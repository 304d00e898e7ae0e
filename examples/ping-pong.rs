//! Ping-pong latency and bandwidth in the manner of fabtests' `fi_rdm_pingpong` /
//! `fi_dgram_pingpong`, with the same command line and output columns.
//!
//! ```text
//! cargo run --release --example ping-pong                         # RDM, all sizes, verified, one process
//! cargo run --release --example ping-pong -- -l                   # server
//! cargo run --release --example ping-pong -- 127.0.0.1            # client
//! cargo run --release --example ping-pong -- -e dgram -m msg      # datagrams
//! ```
//!
//! Run with neither `-l` nor a server address, both ends run in this process and every message
//! is verified (as with `-c`).
//!
//! With `--mr-min SIZE`, RDM messages of at least SIZE bytes are sent from registered memory
//! regions that peers may read (as fabtests register their buffers), so the protocol engine may
//! use its read-based protocols for them (`FI_EFA_INTER_MIN_READ_MESSAGE_SIZE`, 1 MiB by
//! default). The default, `auto`, is that threshold on `-p shm`, whose RDMA reads copy once
//! (CMA), and `never` elsewhere (the udp device's RDMA reads are slower than its long-CTS
//! messages).
//!
//! `PP_STATS=1` prints the RDM endpoint's and the device's counters after each size.
//!
//! `FI_EFA_*` variables apply. RDM endpoints on `-p udp` reach a peer on the same host over
//! shared memory (`FI_EFA_ENABLE_SHM_TRANSFER`, on by default as in libfabric); set
//! `FI_EFA_ENABLE_SHM_TRANSFER=0` on both sides to measure the udp path.
//!
//! A small TCP connection (port `-B` on the server, `-P` on the client, default 47592) exchanges
//! the endpoints' raw addresses and the test parameters (the client's `-S`, `-I`, `-w`, `-c`
//! decide; the server follows), and synchronises start and finish of every size.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use clap::Parser;
use common::{
    Conn, Role, Side, all_sizes, check_pattern, fill_pattern, launch, open_domain, parse_size,
    poll_cq, print_header, print_row,
};
use efa::{
    Access, AddressVector, Completion, CompletionFlags, CompletionQueue, Dgram, Domain, Endpoint,
    EpType, ErrorKind, MemoryRegion, PeerId, PostError, RawAddr, Rdm, SendBuf,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "Ping-pong latency test (fabtests style) over efa endpoints")]
struct Args {
    /// Endpoint type: rdm or dgram.
    #[arg(short = 'e', default_value = "rdm")]
    ep_type: String,
    /// Message size (64, 1k, 64k, 1m) or `all`.
    #[arg(short = 'S', default_value = "all")]
    size: String,
    /// Iterations per size (default 1000; 100 from 1 MiB on).
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
    /// Give up when a reply takes longer than this many milliseconds (datagrams can be lost).
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// RDM messages of at least this size go from registered regions peers may read, which
    /// lets the engine pick its read-based protocols (`never`; `auto`: the long-read threshold
    /// on shm, never elsewhere).
    #[arg(long, default_value = "auto")]
    mr_min: String,
    /// Send messages shorter than the endpoint's inject size with `inject` (no send
    /// completion), as fi_pingpong does with `fi_inject`; `--no-inject` always uses `send`.
    #[arg(long)]
    no_inject: bool,
    #[command(flatten)]
    conn: Conn,
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
    fn post_send(&self, peer: PeerId, msg: SendBuf, tagged: bool) -> Result<(), PostError>;
    fn post_recv(&self, buf: BytesMut, tagged: bool) -> Result<(), PostError>;
    /// Messages shorter than this go with [`PingEp::inject`].
    fn inject_size(&self) -> usize;
    fn inject(&self, peer: PeerId, msg: &[u8], tagged: bool) -> efa::Result<()>;
}

/// The tag ping-pong messages carry with `-m tagged`.
const TAG: u64 = 0x5151;

impl PingEp for Endpoint<Dgram> {
    fn addr(&self) -> RawAddr {
        Endpoint::<Dgram>::addr(self)
    }
    fn region_domain(&self) -> Option<&Domain> {
        None
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

/// The largest size `-S all` goes to on RDM endpoints.
const RDM_ALL_MAX: usize = 1 << 20;

/// One side of the test: opens the device and the endpoint of the asked kind.
fn session(args: &Args, ep_type: EpType, side: Side) -> Res<()> {
    let domain = open_domain(&args.conn.provider, ep_type, side.bind)?;
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
            pingpong(args, side, &ep, &cq, &av, max)
        }
        _ => {
            let ep = Endpoint::<Rdm>::builder(&domain)
                .cq(&cq)
                .av(&av)
                .build()
                .map_err(|e| e.to_string())?;
            pingpong(args, side, &ep, &cq, &av, RDM_ALL_MAX)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn pingpong<E: PingEp>(
    args: &Args,
    side: Side,
    ep: &E,
    cq: &CompletionQueue,
    av: &AddressVector,
    max: usize,
) -> Res<()> {
    let Side {
        role,
        mut oob,
        print,
        ..
    } = side;
    let params = match role {
        Role::Client => {
            let sizes = if args.size == "all" {
                all_sizes(max)
            } else {
                vec![parse_size(&args.size)?]
            };
            if args.ep_type == "dgram" {
                if let Some(&s) = sizes.iter().find(|&&s| s > max) {
                    return Err(format!(
                        "size {s} exceeds the endpoint's max_msg_size {max}"
                    ));
                }
            }
            let verify = args.verify || args.conn.in_process();
            let p = Params {
                sizes,
                iters: args.iters,
                warmup: args.warmup,
                verify,
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
        let who = if role == Role::Client {
            "client"
        } else {
            "server"
        };
        eprintln!(
            "{who} {} -> {peer_addr}{}",
            ep.addr(),
            if params.verify {
                " (verifying data)"
            } else {
                ""
            }
        );
        print_header();
    }
    let tagged = args.mode == "tagged";
    let timeout = Duration::from_millis(args.timeout_ms);
    let mr_min = match args.mr_min.as_str() {
        // From the engine's long-read threshold: below it a region only costs the copy the
        // endpoint makes of it (the message goes in packets either way).
        "auto" if args.conn.provider == "shm" => efa::Config::from_env()
            .map(|c| c.inter_min_read_message_size)
            .map_err(|e| e.to_string())?,
        "never" | "auto" => usize::MAX,
        s => parse_size(s)?,
    };
    let mut pp = PingPong {
        ep,
        cq,
        peer,
        timeout,
        tagged,
        done: Vec::with_capacity(16),
        sends_posted: 0,
        sends_done: 0,
        use_regions: false,
        regions: Vec::new(),
        inject: false,
    };
    for &size in &params.sizes {
        let mut msg = vec![0u8; size];
        fill_pattern(&mut msg, size as u64);
        pp.regions.clear();
        pp.use_regions = false;
        if let Some(domain) = ep.region_domain().filter(|_| size >= mr_min && size > 0) {
            // A few, as a send hands its region back only when it completes.
            for _ in 0..4 {
                let r = domain
                    .register(msg.clone(), Access::SEND | Access::REMOTE_READ)
                    .map_err(|e| format!("register: {e}"))?;
                pp.regions.push(r);
            }
            pp.use_regions = true;
        }
        let msg = Bytes::from(msg);
        // As fi_pingpong: below the inject size, no send completions.
        pp.inject = !args.no_inject && size < ep.inject_size();
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
        if std::env::var_os("PP_STATS").is_some() {
            eprintln!("{}", ep.stats_line());
        }
        oob.sync().map_err(|e| e.to_string())?;
        if print {
            print_row(size, iters, 2, elapsed);
        }
    }
    Ok(())
}

struct PingPong<'a, E: PingEp> {
    ep: &'a E,
    cq: &'a CompletionQueue,
    peer: PeerId,
    timeout: Duration,
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
}

impl<E: PingEp> PingPong<'_, E> {
    fn post_recv(&mut self, buf: BytesMut) -> Res<()> {
        self.ep
            .post_recv(buf, self.tagged)
            .map_err(|e| format!("recv: {e}"))
    }

    fn send(&mut self, msg: &Bytes) -> Res<()> {
        if self.inject {
            return self.inject(msg);
        }
        let from_region = self.use_regions;
        let mut deadline = None;
        loop {
            let buf = if from_region {
                match self.regions.pop() {
                    Some(r) => SendBuf::from(r),
                    None => {
                        // Every region is still in a send: wait for one to come back.
                        self.poll_once()?;
                        let d = *deadline.get_or_insert_with(|| Instant::now() + self.timeout);
                        if Instant::now() > d {
                            return Err("no send completion hands a region back".into());
                        }
                        continue;
                    }
                }
            } else {
                SendBuf::from(msg.clone())
            };
            match self.ep.post_send(self.peer, buf, self.tagged) {
                Ok(()) => {
                    self.sends_posted += 1;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Again => {
                    if let Some(r) = e.buf.into_region() {
                        self.regions.push(r);
                    }
                    self.poll_once()?;
                }
                Err(e) => return Err(format!("send: {e}")),
            }
        }
    }

    /// Injects `msg` (no completion to count), polling while the endpoint says `Again`.
    fn inject(&mut self, msg: &[u8]) -> Res<()> {
        let mut deadline = None;
        loop {
            match self.ep.inject(self.peer, msg, self.tagged) {
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

    /// Spins until the receive completes, reposting its buffer at once when asked.
    fn wait_recv(&mut self, size: usize, verify: bool, repost: bool) -> Res<()> {
        // Set at the first clock read (after 1024 polls): a quick reply needs none.
        let mut deadline = None;
        let mut spins = 0u32;
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
            // The clock only every 1024 polls: a clock read costs as much as an idle poll.
            spins += 1;
            if spins % 1024 == 0
                && Instant::now() > *deadline.get_or_insert_with(|| Instant::now() + self.timeout)
            {
                return Err(format!(
                    "no reply within {:?} (datagram lost?)",
                    self.timeout
                ));
            }
            std::hint::spin_loop();
        }
    }

    /// Waits until every send posted so far has completed. With manual progress this keeps the
    /// endpoint driven until its last message is through (a long message needs the peer's
    /// clear-to-send answered) before the out-of-band sync stops polling.
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
}
