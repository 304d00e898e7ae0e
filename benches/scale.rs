//! Scale: what one RDM endpoint (the hub) pays per peer, with 1, 256, 4 096 and 16 384 peers on
//! the loopback device (issue 29, point 5).
//!
//! * **Memory per peer**: the peers are bare queue pairs of the device, each of which sends the
//!   hub one eager message with its raw address (the first message of any new peer, v4 wire
//!   format). The hub receives them all; the heap bytes still allocated afterwards (a counting
//!   allocator: allocations minus frees, every thread), divided by the number of peers, are
//!   the hub's state per peer that has sent one message (peer table, reorder window, address
//!   bookkeeping, and its handshake to the peer). The process's resident memory growth is
//!   printed beside it.
//! * **Latency with that many peers**: then the hub ping-pongs 64-byte messages with one more
//!   peer, a full endpoint, and the one-way latency's p50 and p99 (each round trip timed, halved)
//!   show what the size of the peer table costs per message.
//!
//! `cargo bench --bench scale` (prints a table; no criterion). `EFA_SCALE_PEERS=1,256` picks the
//! peer counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::loopback::{LoopbackConfig, LoopbackDevice, LoopbackNetwork};
use efa::device::{Device, QpAttr, QpType, QueuePair, SendWr};
use efa::fault::FaultConfig;
use efa::notify::Notifier;
use efa::proto::wire::{Packet, ReqOpt, Sender};
use efa::{
    AddressVector, Completion, CompletionFlags, CompletionQueue, Config, Domain, Endpoint, Rdm,
};

/// Counts the heap bytes in use, for the memory per peer.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call forwards to the system allocator with the same arguments; the counter is
// only arithmetic beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.alloc(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as i64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.dealloc(p, l) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as i64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.alloc_zeroed(l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as i64 - l.size() as i64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const SIZE: usize = 64;
/// Raw peers that send at once: well below the hub's receive queue.
const WAVE: usize = 512;
/// Timed round trips per peer count.
const ROUND_TRIPS: usize = 20_000;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

struct Row {
    peers: usize,
    bytes_per_peer: f64,
    rss_per_peer: f64,
    p50: Duration,
    p99: Duration,
}

fn wait_recvs(cq: &CompletionQueue, n: usize, out: &mut Vec<Completion>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut got = 0;
    while got < n {
        out.clear();
        cq.poll(out, 256).expect("hub poll");
        got += out
            .iter()
            .filter(|c| c.flags.contains(CompletionFlags::RECV))
            .count();
        assert!(Instant::now() < deadline, "hub received {got} of {n}");
    }
    got
}

fn run(peers: usize) -> Row {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let dev = LoopbackDevice::open(&net, LoopbackConfig::default()).expect("loopback device");
    let d = Domain::with_device(dev.clone(), Config::default());
    let hub_cq = CompletionQueue::new(&d, 1 << 16).expect("cq");
    let hub_av = AddressVector::new(&d);
    let hub = Endpoint::<Rdm>::builder(&d)
        .cq(&hub_cq)
        .av(&hub_av)
        .build()
        .expect("hub");
    let n = Arc::new(Notifier::new());
    // The peers: bare queue pairs, each with a buffer for the hub's handshake.
    let mut raw: Vec<Box<dyn QueuePair>> = (0..peers)
        .map(|_| {
            let mut a = QpAttr::new(QpType::Srd);
            a.notifier = n.clone();
            a.send_depth = 4;
            a.recv_depth = 4;
            let mut q = dev.create_qp(a).expect("peer queue pair");
            for i in 0..2 {
                q.post_recv(i, BytesMut::with_capacity(256))
                    .expect("peer recv");
            }
            q
        })
        .collect();
    let payload = vec![7u8; SIZE];
    let hdrs: Vec<Bytes> = raw
        .iter()
        .map(|q| {
            let p = Packet::EagerRtm {
                opt: ReqOpt {
                    sender: Sender::RawAddr(q.addr()),
                    cq_data: None,
                },
                msg_id: 0,
                tag: None,
                dc_send_id: None,
            };
            Bytes::from(p.to_vec(&[]).expect("encode"))
        })
        .collect();
    let body = Bytes::from(payload);
    let mut bufs: Vec<BytesMut> = (0..peers).map(|_| BytesMut::with_capacity(SIZE)).collect();
    let mut out = Vec::with_capacity(1024);
    let mut scratch = Vec::new();
    let (live0, rss0) = (LIVE.load(Ordering::Relaxed), rss_bytes());
    for (w, wave) in raw.chunks_mut(WAVE).enumerate() {
        for _ in 0..wave.len() {
            hub.recv(bufs.pop().expect("buffer"), 0).expect("hub recv");
        }
        for (i, q) in wave.iter_mut().enumerate() {
            let k = w * WAVE + i;
            q.post_send(SendWr {
                wr_id: k as u64,
                dest: hub.addr(),
                hdr: hdrs[k].clone(),
                payload: body.clone(),
                imm: None,
            })
            .expect("peer send");
        }
        wait_recvs(&hub_cq, wave.len(), &mut out);
        for q in wave.iter_mut() {
            scratch.clear();
            q.poll(&mut scratch, 8);
        }
    }
    // Let the hub settle (acknowledgements, handshakes), then count.
    for _ in 0..64 {
        out.clear();
        hub_cq.poll(&mut out, 256).expect("hub poll");
    }
    drop(hdrs);
    let live = LIVE.load(Ordering::Relaxed) - live0;
    let rss = rss_bytes().saturating_sub(rss0);

    // One full peer and timed round trips.
    let p_cq = CompletionQueue::new(&d, 1024).expect("cq");
    let p_av = AddressVector::new(&d);
    let p = Endpoint::<Rdm>::builder(&d)
        .cq(&p_cq)
        .av(&p_av)
        .build()
        .expect("peer");
    let to_hub = p_av.insert(hub.addr()).expect("insert");
    let to_p = hub_av.insert(p.addr()).expect("insert");
    let msg = vec![1u8; SIZE];
    let mut times = Vec::with_capacity(ROUND_TRIPS);
    let mut hb = BytesMut::with_capacity(SIZE);
    let mut pb = BytesMut::with_capacity(SIZE);
    for i in 0..ROUND_TRIPS + 1000 {
        let t = Instant::now();
        p.recv(pb, 0).expect("recv");
        hub.recv(hb, 0).expect("recv");
        hub.inject(to_p, &msg).expect("inject");
        pb = take_recv(&p_cq, &mut out);
        p.inject(to_hub, &msg).expect("inject");
        hb = take_recv(&hub_cq, &mut out);
        if i >= 1000 {
            times.push(t.elapsed() / 2);
        }
    }
    times.sort();
    drop(raw);
    Row {
        peers,
        bytes_per_peer: live as f64 / peers as f64,
        rss_per_peer: rss as f64 / peers as f64,
        p50: times[times.len() / 2],
        p99: times[times.len() * 99 / 100],
    }
}

fn take_recv(cq: &CompletionQueue, out: &mut Vec<Completion>) -> BytesMut {
    loop {
        out.clear();
        cq.poll(out, 16).expect("poll");
        if let Some(c) = out
            .drain(..)
            .find(|c| c.flags.contains(CompletionFlags::RECV))
        {
            let mut b = c.buf.into_recv().expect("receive buffer");
            b.clear();
            return b;
        }
    }
}

fn main() {
    // `cargo test --benches` runs bench targets with `--bench` absent: do nothing then.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let counts: Vec<usize> = std::env::var("EFA_SCALE_PEERS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 256, 4096, 16384]);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    println!("# scale: one RDM endpoint (hub) on the loopback device; CPU {cpu}");
    println!(
        "{:>8} {:>16} {:>16} {:>12} {:>12}",
        "peers", "heap B/peer", "RSS B/peer", "p50 one-way", "p99 one-way"
    );
    for n in counts {
        let r = run(n);
        println!(
            "{:>8} {:>16.0} {:>16.0} {:>12.2?} {:>12.2?}",
            r.peers, r.bytes_per_peer, r.rss_per_peer, r.p50, r.p99
        );
    }
}
