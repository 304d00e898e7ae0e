//! KV-cache transfer in the manner of pplx-garden and NIXL: each side registers ONE large region
//! and cuts it into pages with [`MemoryRegion::chunks`]; the sender (the client) keeps many RMA
//! writes in flight from scattered page slices of its region to scattered pages of the
//! receiver's (the server's), and tells the receiver each finished batch of pages with one small
//! write with immediate data. It is the proof of the slices API: no registration after
//! start-up, every write moves one page slice that its completion hands back for the next one.
//!
//! ```text
//! cargo run --release --example kv-transfer                         # both ends in this process (udp)
//! cargo run --release --example kv-transfer -- -M 1g -S 16k -b 64   # 1 GiB of 16 KiB pages
//! cargo run --release --example kv-transfer -- -l                   # receiver (server)
//! cargo run --release --example kv-transfer -- 127.0.0.1           # sender (client)
//! FI_EFA_USE_DEVICE_RDMA=0 cargo run --release --example kv-transfer   # the emulated protocols
//! cargo build -p efa-emu && cargo build --release --features efa --example kv-transfer
//! target/debug/efa-emu run -- target/release/examples/kv-transfer -p efa   # efa device, emulated NIC
//! ```
//!
//! The connection options are ping-pong's (`-p` device, `-l`/`-B` server, `-P` and the server's
//! address for the client); with neither `-l` nor an address both ends run in this process.
//! Two processes on one host (the default device, `udp`) reach each other's endpoints over the
//! same-host path for messages, but one-sided RDMA always goes over the device itself (its
//! keys), so the page writes take the udp device's RDMA either way.
//!
//! How it goes:
//!
//! * The client sends the plan (`-M` region, `-S` page, `-W` window, `-b` batch, `-I` rounds,
//!   `--seed`) as a JSON line on the out-of-band connection; both sides register one region of
//!   `-M` bytes plus a doorbell area of 8 bytes per batch (see below), and cut the `-M` bytes
//!   into pages with `chunks(page)`.
//! * The receiver sends its page table: its region's `RemoteKey`, the page size, the offsets of
//!   its pages in a seeded random order, and where its doorbell area starts (JSON, as rma-bw
//!   sends its key). Transfer page `j` lands at the `j`-th offset of that table.
//! * The sender's pages hold their content from start-up on, as a KV cache is there before it
//!   moves: page `p` gets the examples' `fill_pattern` of message `p` once. Each round moves
//!   every page once: transfer page `j` of round `r` comes from the sender's page
//!   `(perm[j] + r) mod n`, `perm` another seeded random order that both sides compute, so each
//!   page of the receiver gets another content each round than the round before (they differ at
//!   every byte: a page half overwritten cannot pass). The sender writes the page's 16-byte
//!   header (bytes 0..8: `j`, 8..16: the round, both little-endian) and writes the page with
//!   `WriteOptions::default().with_delivery_complete(true)`, at most `-W` writes in flight. A completion
//!   hands the page slice back; it is used again next round.
//! * Pages `j` go in batches of `-b`: batch `k` of round `r` is global batch number
//!   `b = r * batches_per_round + k`. When the last write of a batch has completed at the
//!   sender, it posts one `write_data` of an 8-byte record (the global batch number) from its
//!   own doorbell slot `k` to the receiver's doorbell slot `k`, with immediate data `b`.
//!   Delivery complete is what makes the notification a promise: a completed data write is in
//!   the receiver's memory before the doorbell is posted.
//! * The receiver counts its `REMOTE_WRITE | REMOTE_CQ_DATA` completions: each batch number must
//!   come exactly once, belong to the round in progress, and find its record in its doorbell
//!   slot; then every page of the batch is compared with its pattern. When a round's batches
//!   are all in and checked, it tells the sender on the out-of-band connection, and only then
//!   does the next round overwrite the pages. Wrong contents, a duplicate, out-of-range or early
//!   notification, a missing one (nothing for `--timeout-secs`, 60) end both sides with an
//!   error (tests inject each with the hidden `--fault corrupt|duplicate|skip`).
//! * No registration after start-up: both sides read `mem_registrations` (regions the device
//!   registered) and `mr_registrations` (registrations per operation, efa device) of
//!   `Domain::device_stats` before and after the transfer and fail if either grew (`-v` prints
//!   them). The region's memory is touched at start-up, so the transfer does not time the
//!   kernel's first-touch page faults either.
//!
//! Output: fabtests' columns (`bytes` is the page size, `iters` the pages moved), then a line
//! with GB/sec and pages/sec. Both sides print (only the sender when both run in this process).
//! Delivery complete costs nothing extra on device RDMA (a device write completes when the
//! target acknowledged the bytes in its memory) and the emulated writes are always delivery
//! complete (docs/rma.md).
//!
//! Against `rma-bw -o write -S 64k` this does more per byte: the sender writes a header into
//! every page, the receiver compares every page, and the memory is 256 MiB of distinct pages
//! instead of one buffer that stays in the cache (`rma-bw --span 256m` moves its writes through
//! as much memory, one write at a time). The udp and `efa` devices write from the region's
//! registration, with no copy at posting.

mod common;

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use common::{
    Conn, MAX_SIZE, Oob, RdmPeer, Role, Side, check_pattern, cnt_str, fill_pattern, launch,
    parse_size, perf_header, perf_row, poll_cq, rdm_peer, size_str,
};
use efa::{
    Access, Completion, CompletionFlags, CompletionQueue, Domain, Endpoint, ErrorKind,
    MemoryRegion, PeerId, Rdm, RemoteKey, WriteOptions,
};

#[derive(Parser, Debug, Clone)]
#[command(about = "KV-cache transfer (pages of one registered region, batch notifications)")]
struct Args {
    /// Region size of each side (its pages; 8 bytes per batch more for the doorbells).
    #[arg(short = 'M', default_value = "256m")]
    region: String,
    /// Page size, 16k to 256k; the region must be a whole number of pages.
    #[arg(short = 'S', default_value = "64k")]
    page: String,
    /// Page writes in flight at the sender.
    #[arg(short = 'W', default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    window: u32,
    /// Pages per batch (one notification each).
    #[arg(short = 'b', default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    batch: u32,
    /// Rounds: each moves every page of the region once.
    #[arg(short = 'I', default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Seed of both page permutations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Give up after this many seconds without a completion (sender) or notification
    /// (receiver).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    timeout_secs: u64,
    /// For tests: the sender corrupts a page, notifies a batch twice or skips a notification.
    #[arg(long, hide = true)]
    fault: Option<Fault>,
    /// Print the registration counters before and after, the endpoint's and the device's
    /// counters.
    #[arg(short = 'v')]
    verbose: bool,
    #[command(flatten)]
    conn: Conn,
}

type Res<T> = Result<T, String>;

/// The smallest and largest page sizes.
const MIN_PAGE: usize = 16 << 10;
const MAX_PAGE: usize = 256 << 10;

/// Bytes of a doorbell record (the global batch number, little-endian).
const BELL: usize = 8;

/// Bytes of a page's header: the transfer page number and the round.
const HDR: usize = 16;

/// Context bit of the doorbell writes (the rest is the batch within the round); data writes
/// carry the transfer page number.
const BELL_CTX: u64 = 1 << 63;

/// A fault the sender injects in round 0 (`--fault`, for the tests of the receiver's checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Fault {
    /// One byte of transfer page 1 is flipped after the fill.
    Corrupt,
    /// Batch 0 is notified twice.
    Duplicate,
    /// The last batch is not notified.
    Skip,
}

/// What the sender (client) asks for.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Plan {
    region: usize,
    page: usize,
    window: usize,
    batch: usize,
    rounds: usize,
    seed: u64,
}

impl Plan {
    fn pages(&self) -> usize {
        self.region / self.page
    }

    fn batches_per_round(&self) -> usize {
        self.pages().div_ceil(self.batch)
    }

    /// The transfer pages of batch `k`.
    fn batch_pages(&self, k: usize) -> std::ops::Range<usize> {
        k * self.batch..((k + 1) * self.batch).min(self.pages())
    }

    /// Bytes of the doorbell area behind the pages: one record per batch of a round.
    fn bell_bytes(&self) -> usize {
        self.batches_per_round() * BELL
    }

    /// The options' limits (the receiver checks the plan it is sent, too).
    fn check(&self) -> Res<()> {
        if !(MIN_PAGE..=MAX_PAGE).contains(&self.page) {
            return Err(format!(
                "-S {}: pages are 16k to 256k",
                size_str(self.page as u64)
            ));
        }
        if self.region < 2 * self.page
            || !self.region.is_multiple_of(self.page)
            || self.region > MAX_SIZE
        {
            return Err(format!(
                "-M {}: the region must be a whole number (at least two) of {}-byte pages, at \
                 most 1 GiB",
                size_str(self.region as u64),
                self.page
            ));
        }
        if self.window == 0 || self.batch == 0 || self.rounds == 0 {
            return Err("-W, -b and -I must be at least 1".into());
        }
        // The immediate data is the global batch number: 32 bits.
        if (self.rounds as u64) * (self.batches_per_round() as u64) > u32::MAX as u64 {
            return Err("-I: too many batches for 32-bit immediate data".into());
        }
        Ok(())
    }
}

/// What the receiver hands the sender: where the pages are, in the order they are written.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct PageTable {
    /// The whole registration (the key grants all of it; addresses are `key.at(offset)`).
    key: RemoteKey,
    page: usize,
    /// Offsets of the receiver's pages in its region: transfer page `j` goes to `offsets[j]`.
    offsets: Vec<u64>,
    /// Offset of the doorbell area (record `k` at `doorbell + 8 k`).
    doorbell: u64,
}

fn main() -> ExitCode {
    common::init_tracing();
    let args = Args::parse();
    let conn = args.conn.clone();
    match launch(&conn, move |side| session(&args, side)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv-transfer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn plan_of(args: &Args) -> Res<Plan> {
    let plan = Plan {
        region: parse_size(&args.region).map_err(|e| format!("-M: {e}"))?,
        page: parse_size(&args.page).map_err(|e| format!("-S: {e}"))?,
        window: args.window as usize,
        batch: args.batch as usize,
        rounds: args.rounds as usize,
        seed: args.seed,
    };
    plan.check()?;
    Ok(plan)
}

/// A seeded permutation of `0..n` (splitmix64, Fisher-Yates).
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// Which page of the sender transfer page `j` comes from in round 0 (both sides know it).
fn sources(plan: &Plan) -> Vec<usize> {
    permutation(plan.pages(), plan.seed ^ 0x5eed_5eed_5eed_5eed)
}

/// The sender's page that transfer page `j` comes from in `round`: `src` (a seeded
/// permutation both sides compute) turned by one page each round, so that every page of the
/// receiver gets, each round, another page than the round before.
fn source_of(src: &[usize], j: usize, round: usize) -> usize {
    (src[j] + round) % src.len()
}

/// The pattern's sequence number of the bytes after the header of the sender's page `p` (of
/// `n`), written once at start-up. Two pages one apart (`p`, `p + 1 mod n`: what one receiver
/// page gets in two rounds in a row) differ mod 251, so their bytes differ at every offset: a
/// page half written over last round's content cannot pass its check.
fn body_seq(p: usize, n: usize) -> u64 {
    if p == n - 1 && (n - 1).is_multiple_of(251) {
        // n - 1 ≡ 0 would repeat page 0's bytes; page n - 2 has 250.
        1
    } else {
        p as u64
    }
}

/// The examples' `fill_pattern` bytes at memory speed: byte `i` of message `seq` is
/// `(31 seq + 7 i) mod 251`, which is byte `i + 112 seq mod 251` of message 0 (`7 * 112` is 31
/// modulo 251), so every message's bytes are one slice of a buffer of message 0's bytes: a page
/// is filled with one `memcpy` and checked with one `memcmp`.
struct Pattern {
    base: Vec<u8>,
}

impl Pattern {
    fn new(len: usize) -> Res<Pattern> {
        let mut base = vec![0u8; len + 251];
        fill_pattern(&mut base, 0);
        let p = Pattern { base };
        // The same bytes as fill_pattern (a few messages, once).
        for s in [1u64, 7, 250, 251, 1000] {
            let n = len.min(4096);
            let mut want = vec![0u8; n];
            fill_pattern(&mut want, s);
            if p.of(s, n) != &want[..] {
                return Err(format!(
                    "pattern of message {s} differs from fill_pattern's"
                ));
            }
        }
        Ok(p)
    }

    /// The first `len` bytes of message `seq`.
    fn of(&self, seq: u64, len: usize) -> &[u8] {
        let k = ((seq % 251) * 112 % 251) as usize;
        &self.base[k..k + len]
    }

    /// The bytes after the header of a page whose body is message `seq`.
    fn fill_body(&self, buf: &mut [u8], seq: u64) {
        let body = &mut buf[HDR..];
        body.copy_from_slice(self.of(seq, body.len()));
    }

    /// The header of transfer page `j` in `round`.
    fn fill_header(buf: &mut [u8], j: usize, round: usize) {
        buf[..8].copy_from_slice(&(j as u64).to_le_bytes());
        buf[8..HDR].copy_from_slice(&(round as u64).to_le_bytes());
    }

    /// Transfer page `j` of `round`, whose body is message `seq`.
    fn check_page(&self, buf: &[u8], j: usize, round: usize, seq: u64) -> Res<()> {
        let word = |i: usize| u64::from_le_bytes(buf[i..i + 8].try_into().expect("8 bytes"));
        let (got_j, got_r) = (word(0), word(8));
        if (got_j, got_r) != (j as u64, round as u64) {
            return Err(format!(
                "header says page {got_j} of round {got_r}, want page {j} of round {round}"
            ));
        }
        let body = &buf[HDR..];
        if body == self.of(seq, body.len()) {
            return Ok(());
        }
        // Where, and what: check_pattern says it.
        check_pattern(body, seq).map_err(|e| format!("{e} (after the header)"))?;
        Err("data mismatch".into())
    }
}

/// The registration counters that must not grow after start-up.
fn registrations(domain: &Domain) -> (u64, u64) {
    let s = domain.device_stats();
    (s.mem_registrations, s.mr_registrations)
}

fn session(args: &Args, side: Side) -> Res<()> {
    let Side {
        role,
        mut oob,
        print,
        bind,
    } = side;
    // The client's plan rules; the server follows.
    let plan: Plan = match role {
        Role::Client => {
            let plan = plan_of(args)?;
            let line = serde_json::to_string(&plan).map_err(|e| e.to_string())?;
            oob.send_line(&line).map_err(|e| e.to_string())?;
            plan
        }
        Role::Server => {
            let line = oob.recv_line().map_err(|e| format!("plan: {e}"))?;
            let plan: Plan = serde_json::from_str(&line).map_err(|e| format!("plan: {e}"))?;
            plan.check()
                .map_err(|e| format!("the sender's plan: {e}"))?;
            plan
        }
    };
    let cq_size = 2 * plan.window + plan.batches_per_round() + 64;
    let RdmPeer {
        domain,
        cq,
        ep,
        peer,
        ..
    } = rdm_peer(&args.conn, bind, &mut oob, cq_size, |b| b)?;
    let who = match role {
        Role::Client => "sender",
        Role::Server => "receiver",
    };
    let mut k = Kv {
        plan: &plan,
        stall: Duration::from_secs(args.timeout_secs),
        fault: args.fault,
        ep: &ep,
        cq: &cq,
        peer,
        done: Vec::new(),
    };
    // One registration: the pages, then the doorbell records.
    let access = match role {
        Role::Client => Access::WRITE,
        Role::Server => Access::REMOTE_WRITE,
    };
    let mut region = domain
        .register(vec![0u8; plan.region + plan.bell_bytes()], access)
        .map_err(|e| format!("register {} bytes: {e}", plan.region + plan.bell_bytes()))?;
    // Touch every page of the memory now (a zeroed allocation is mapped lazily): a KV cache is
    // resident, and the transfer should not time the kernel's first-touch page faults.
    region.write().fill(0xa5);
    let result = match role {
        Role::Server => {
            let key = region.remote_key().map_err(|e| e.to_string())?;
            let bells = region.split_off(plan.region).map_err(|e| e.to_string())?;
            let pages = region.chunks(plan.page).map_err(|e| e.to_string())?;
            let order = permutation(pages.len(), plan.seed);
            let table = PageTable {
                key,
                page: plan.page,
                offsets: order.iter().map(|&p| pages[p].offset() as u64).collect(),
                doorbell: bells.offset() as u64,
            };
            let line = serde_json::to_string(&table).map_err(|e| e.to_string())?;
            oob.send_line(&line).map_err(|e| e.to_string())?;
            let before = registrations(&domain);
            let r = k.receive(&mut oob, &pages, &order, &bells);
            // Tell the sender why, so both ends say it.
            if let Err(e) = &r {
                let _ = oob.send_line(&format!("fail {e}"));
            }
            r.map(|t| (t, before))
        }
        Role::Client => {
            let line = oob.recv_line().map_err(|e| format!("page table: {e}"))?;
            let table: PageTable =
                serde_json::from_str(&line).map_err(|e| format!("page table: {e}"))?;
            check_table(&plan, &table)?;
            let bells = region.split_off(plan.region).map_err(|e| e.to_string())?;
            let pages = region.chunks(plan.page).map_err(|e| e.to_string())?;
            let bells = bells.chunks(BELL).map_err(|e| e.to_string())?;
            if print {
                let e = ep.rma_emulation();
                println!(
                    "# kv-transfer: {} region, {} pages of {}, {} writes in flight, batches of {} \
                     pages ({} notifications a round), {} rounds; writes {}",
                    size_str(plan.region as u64),
                    plan.pages(),
                    size_str(plan.page as u64),
                    plan.window,
                    plan.batch,
                    plan.batches_per_round(),
                    plan.rounds,
                    if e.write {
                        "emulated"
                    } else {
                        "device RDMA (towards peers with it)"
                    }
                );
            }
            let before = registrations(&domain);
            k.send(&mut oob, pages, bells, &table).map(|t| (t, before))
        }
    };
    let (elapsed, before) = result?;
    let after = registrations(&domain);
    // One print of the whole report: with both ends in this process, their lines do not mix.
    let mut out = String::new();
    if args.verbose {
        out += &format!(
            "# {who}: mem_registrations {} -> {}, mr_registrations {} -> {}\n",
            before.0, after.0, before.1, after.1
        );
    }
    if print {
        let moved = plan.pages() * plan.rounds;
        let secs = elapsed.as_secs_f64();
        let s = ep.stats();
        out += &format!(
            "# {who}:\n{}\n{}\n# {who}: {:.2} GB/sec, {} pages/sec, {} notifications, {} \
             registrations after start-up\n# {who}: rma bytes on the device {}, emulated {}; \
             messages to the peer: {}\n",
            perf_header(),
            perf_row(plan.page, moved, 1, elapsed),
            (moved * plan.page) as f64 / secs / 1e9,
            cnt_str((moved as f64 / secs) as u64),
            plan.batches_per_round() * plan.rounds,
            after.0.saturating_sub(before.0) + after.1.saturating_sub(before.1),
            s.device_rma_bytes,
            s.emulated_rma_bytes,
            common::path_taken(Some(&s), ep.domain().device())
        );
    }
    if args.verbose {
        out += &format!(
            "# {who} endpoint: {:?}\n# {who} device: {:?}\n",
            ep.stats(),
            domain.device_stats()
        );
    }
    print!("{out}");
    if after != before {
        return Err(format!(
            "{who}: registrations grew during the transfer: mem_registrations {} -> {}, \
             mr_registrations {} -> {}",
            before.0, after.0, before.1, after.1
        ));
    }
    // The end: nothing may come after the last round (a late duplicate notification).
    oob.sync().map_err(|e| format!("final sync: {e}"))?;
    if role == Role::Server {
        k.no_more_notifications(Duration::from_millis(50))?;
    }
    Ok(())
}

/// The receiver's page table must name the plan's pages, each once, inside the region.
fn check_table(plan: &Plan, t: &PageTable) -> Res<()> {
    let bad = |why: String| Err(format!("page table: {why}"));
    if t.page != plan.page || t.offsets.len() != plan.pages() {
        return bad(format!(
            "{} pages of {} bytes, the plan has {} of {}",
            t.offsets.len(),
            t.page,
            plan.pages(),
            plan.page
        ));
    }
    let mut seen = vec![false; plan.pages()];
    for &o in &t.offsets {
        let o = o as usize;
        if !o.is_multiple_of(plan.page)
            || o / plan.page >= plan.pages()
            || std::mem::replace(&mut seen[o / plan.page], true)
        {
            return bad(format!("offset {o} is not a distinct page of the region"));
        }
    }
    if t.doorbell as usize != plan.region || (t.key.len as usize) < plan.region + plan.bell_bytes()
    {
        return bad("the doorbell area is not behind the pages".into());
    }
    Ok(())
}

/// One side of the transfer.
struct Kv<'a> {
    plan: &'a Plan,
    /// How long to wait without progress before giving up.
    stall: Duration,
    fault: Option<Fault>,
    ep: &'a Endpoint<Rdm>,
    cq: &'a CompletionQueue,
    peer: PeerId,
    done: Vec<Completion>,
}

impl Kv<'_> {
    fn poll(&mut self) -> Res<usize> {
        poll_cq(self.cq, &mut self.done, 64)
    }

    /// The sender: every round writes every page, notifies each batch once its writes
    /// completed, and waits for the receiver to have checked the round. When something fails
    /// because the receiver failed first (its region gone: `RemoteAccess`), the receiver's own
    /// report is the error.
    fn send(
        &mut self,
        oob: &mut Oob,
        pages: Vec<MemoryRegion>,
        bells: Vec<MemoryRegion>,
        table: &PageTable,
    ) -> Res<Duration> {
        let r = self.send_rounds(oob, pages, bells, table);
        if r.is_err()
            && let Ok(w) = oob.watch()
        {
            let until = Instant::now() + Duration::from_millis(500);
            while !w.has_news() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            if w.has_news()
                && let Ok(line) = oob.recv_line()
                && let Some(why) = line.strip_prefix("fail ")
            {
                return Err(format!("the receiver failed: {why}"));
            }
        }
        r
    }

    fn send_rounds(
        &mut self,
        oob: &mut Oob,
        pages: Vec<MemoryRegion>,
        bells: Vec<MemoryRegion>,
        table: &PageTable,
    ) -> Res<Duration> {
        let plan = self.plan;
        let n = plan.pages();
        let bpr = plan.batches_per_round();
        let pattern = Pattern::new(plan.page - HDR)?;
        // Transfer page j of round r comes from page source_of(&src, j, r) of this side. The
        // pages hold their content from start-up on (a KV cache is there before it moves);
        // each round only their 16-byte headers are written.
        let src = sources(plan);
        let mut pages: Vec<Option<MemoryRegion>> = pages.into_iter().map(Some).collect();
        for (p, page) in pages.iter_mut().enumerate() {
            if let Some(page) = page {
                pattern.fill_body(&mut page.write(), body_seq(p, n));
            }
        }
        let mut bells: Vec<Option<MemoryRegion>> = bells.into_iter().map(Some).collect();
        // Delivery complete: a page write completes only once its bytes are in the receiver's
        // memory, so the batch's doorbell, posted after its writes completed, never overtakes
        // them. Both paths give it (docs/rma.md): the emulated writes are delivery complete
        // always (DC_EAGER_RTW / DC_LONGCTS_RTW, RECEIPT), and a device RDMA write completes
        // when the target's device acknowledged its bytes in memory (the engine passes the
        // flag on to nothing there: there is nothing to add).
        let data_opts = WriteOptions::default().with_delivery_complete(true);
        let watch = oob.watch().ok();
        let mut spins = 0u32;
        let mut twice = false; // --fault duplicate: batch 0 notified a second time
        oob.sync().map_err(|e| e.to_string())?;
        let start = Instant::now();
        for round in 0..plan.rounds {
            let mut next = 0; // the next transfer page to write
            let mut in_flight = 0;
            let mut left_in_batch: Vec<usize> =
                (0..bpr).map(|k| plan.batch_pages(k).len()).collect();
            let mut ring: VecDeque<usize> = VecDeque::new(); // batches ready to notify
            let mut bells_done = 0;
            let mut checked = false; // the receiver said "ok" for this round
            let mut last_progress = Instant::now();
            while bells_done < bpr {
                // The receiver says nothing during a round but why it failed, or its "ok" for
                // the round (which may come before the last doorbells' completions do).
                spins = spins.wrapping_add(1);
                if !checked
                    && spins.is_multiple_of(4096)
                    && watch.as_ref().is_some_and(|w| w.has_news())
                {
                    self.round_checked(oob, round)?;
                    checked = true;
                }
                // Page writes, up to the window.
                while next < n && in_flight < plan.window {
                    let j = next;
                    let p = source_of(&src, j, round);
                    let mut page = pages[p].take().ok_or_else(|| {
                        format!("page {p} is still in flight from the last round")
                    })?;
                    Pattern::fill_header(&mut page.write(), j, round);
                    if self.fault == Some(Fault::Corrupt) && round == 0 && j == 1 {
                        page.write()[HDR + 100] ^= 0xff;
                    }
                    let to = table.key.at(table.offsets[j]);
                    match self.ep.write_with(self.peer, page, to, data_opts, j as u64) {
                        Ok(()) => {
                            in_flight += 1;
                            next += 1;
                        }
                        Err(e) if e.kind() == ErrorKind::Again => {
                            pages[p] = e.into_buffer().into_region();
                            break;
                        }
                        Err(e) => return Err(format!("write of page {j}: {e}")),
                    }
                }
                // Notifications of the batches whose writes all completed.
                while let Some(&kb) = ring.front() {
                    if self.fault == Some(Fault::Skip) && round == 0 && kb == bpr - 1 {
                        ring.pop_front();
                        bells_done += 1;
                        continue;
                    }
                    let mut bell = bells[kb].take().ok_or("doorbell slot in use")?;
                    let number = (round * bpr + kb) as u64;
                    bell.write().copy_from_slice(&number.to_le_bytes());
                    let to = table.key.at(table.doorbell + (kb * BELL) as u64);
                    match self.ep.write_data(
                        self.peer,
                        bell,
                        to,
                        number as u32,
                        BELL_CTX | kb as u64,
                    ) {
                        Ok(()) => {
                            ring.pop_front();
                        }
                        Err(e) if e.kind() == ErrorKind::Again => {
                            bells[kb] = e.into_buffer().into_region();
                            break;
                        }
                        Err(e) => return Err(format!("notification of batch {number}: {e}")),
                    }
                }
                if self.poll()? == 0 {
                    if last_progress.elapsed() > self.stall {
                        return Err(format!(
                            "round {round}: no completion for {}s ({in_flight} writes in flight, \
                             {bells_done} of {bpr} notifications done)",
                            self.stall.as_secs()
                        ));
                    }
                    continue;
                }
                last_progress = Instant::now();
                for c in self.done.drain(..) {
                    if !c
                        .flags
                        .contains(CompletionFlags::RMA | CompletionFlags::WRITE)
                    {
                        return Err(format!("unexpected completion {:?}", c.flags));
                    }
                    let slice = c
                        .buf
                        .into_region()
                        .ok_or("a write's completion without its slice")?;
                    if c.context & BELL_CTX != 0 {
                        let kb = (c.context & !BELL_CTX) as usize;
                        bells[kb] = Some(slice);
                        if self.fault == Some(Fault::Duplicate) && round == 0 && kb == 0 && !twice {
                            twice = true;
                            ring.push_back(kb);
                        } else {
                            bells_done += 1;
                        }
                    } else {
                        let j = c.context as usize;
                        let p = slice.offset() / plan.page;
                        if p != source_of(&src, j, round) || slice.len() != plan.page {
                            return Err(format!(
                                "write of page {j} handed back the slice at {} ({} bytes)",
                                slice.offset(),
                                slice.len()
                            ));
                        }
                        pages[p] = Some(slice);
                        in_flight -= 1;
                        let kb = j / plan.batch;
                        left_in_batch[kb] -= 1;
                        if left_in_batch[kb] == 0 {
                            ring.push_back(kb);
                        }
                    }
                }
            }
            // The receiver checked the round: the pages may be written again.
            if !checked {
                self.round_checked(oob, round)?;
            }
        }
        Ok(start.elapsed())
    }

    /// Reads the receiver's word on `round`: `ok` once it checked all of it.
    fn round_checked(&self, oob: &mut Oob, round: usize) -> Res<()> {
        let line = oob.recv_line().map_err(|e| format!("round {round}: {e}"))?;
        if let Some(why) = line.strip_prefix("fail ") {
            return Err(format!("the receiver failed: {why}"));
        }
        if line != format!("ok {round}") {
            return Err(format!("round {round}: the receiver said {line:?}"));
        }
        Ok(())
    }

    /// The receiver: counts the notifications of each round, checks every notified batch's
    /// doorbell record and pages, and tells the sender when a round is complete.
    fn receive(
        &mut self,
        oob: &mut Oob,
        pages: &[MemoryRegion],
        order: &[usize],
        bells: &MemoryRegion,
    ) -> Res<Duration> {
        let plan = self.plan;
        let bpr = plan.batches_per_round();
        let total = bpr * plan.rounds;
        let pattern = Pattern::new(plan.page - HDR)?;
        let src = sources(plan);
        let n = plan.pages();
        let mut seen = vec![false; total];
        let watch = oob.watch().ok();
        oob.sync().map_err(|e| e.to_string())?;
        let start = Instant::now();
        for round in 0..plan.rounds {
            let mut got = 0;
            let mut last_progress = Instant::now();
            let mut spins = 0u32;
            while got < bpr {
                // (Completions may also have come while the last batch was checked.)
                self.poll()?;
                if self.done.is_empty() {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(1024) && last_progress.elapsed() > self.stall {
                        let missing: Vec<usize> = (round * bpr..(round + 1) * bpr)
                            .filter(|&b| !seen[b])
                            .take(8)
                            .collect();
                        return Err(format!(
                            "round {round}: missing notifications: {got} of {bpr} in {}s \
                             (missing batches {missing:?}...)",
                            self.stall.as_secs()
                        ));
                    }
                    if spins.is_multiple_of(64 << 10) && watch.as_ref().is_some_and(|w| w.gone()) {
                        return Err("the sender closed the out-of-band connection".into());
                    }
                    continue;
                }
                last_progress = Instant::now();
                for c in std::mem::take(&mut self.done) {
                    let b = self.notification(&c, total)?;
                    if std::mem::replace(&mut seen[b], true) {
                        return Err(format!("duplicate notification of batch {b}"));
                    }
                    if b / bpr != round {
                        return Err(format!(
                            "notification of batch {b} (round {}) while round {round} is not \
                             complete",
                            b / bpr
                        ));
                    }
                    let kb = b % bpr;
                    let record = {
                        let g = bells.read();
                        u64::from_le_bytes(g[kb * BELL..(kb + 1) * BELL].try_into().expect("8"))
                    };
                    if record != b as u64 {
                        return Err(format!(
                            "batch {b}: its doorbell record says {record}, want {b}"
                        ));
                    }
                    // Every page of the batch, one guard at a time (the lock is the region's:
                    // a guard held long would hold off the sender's writes to other pages;
                    // the software devices answer them receiver-not-ready). Between pages the
                    // endpoint is polled, so that the device's acknowledgements and placements
                    // (driven by this thread) do not wait for the whole batch's check: without
                    // it the sender's device retransmits (timeouts) and meets RNR.
                    for j in plan.batch_pages(kb) {
                        self.poll()?;
                        let p = &pages[order[j]];
                        let seq = body_seq(source_of(&src, j, round), n);
                        pattern.check_page(&p.read(), j, round, seq).map_err(|e| {
                            format!(
                                "round {round}, batch {b}: page {j} at offset {}: {e}",
                                p.offset()
                            )
                        })?;
                    }
                    got += 1;
                }
            }
            oob.send_line(&format!("ok {round}"))
                .map_err(|e| format!("round {round}: {e}"))?;
        }
        Ok(start.elapsed())
    }

    /// The batch number of a notification; anything else is an error.
    fn notification(&self, c: &Completion, total: usize) -> Res<usize> {
        let want = CompletionFlags::REMOTE_WRITE | CompletionFlags::REMOTE_CQ_DATA;
        if !c.flags.contains(want) {
            return Err(format!("unexpected completion {:?}", c.flags));
        }
        let b = c.data.ok_or("a notification without its immediate data")? as usize;
        if b >= total {
            return Err(format!(
                "notification of batch {b}: there are {total} batches"
            ));
        }
        if c.len != BELL {
            return Err(format!(
                "notification of batch {b} wrote {} bytes, want {BELL}",
                c.len
            ));
        }
        Ok(b)
    }

    /// After the last round: any notification is one too many.
    fn no_more_notifications(&mut self, wait: Duration) -> Res<()> {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            self.poll()?;
            if let Some(c) = self.done.first() {
                return Err(format!(
                    "a notification after the last round (batch {:?}): duplicate",
                    c.data
                ));
            }
        }
        Ok(())
    }
}
