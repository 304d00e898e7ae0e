//! The engine's steady state allocates nothing per message: eager messages (untagged, tagged,
//! with CQ data, delivery complete; receives posted first) go send → packet → receive →
//! completion between two engines joined by a minimal in-test loop, under a counting global
//! allocator. Busy-polling the completion queues of idle endpoints allocates nothing either.
//!
//! Only allocations made by the test's own thread while its counting window is open are counted
//! (a thread-local switch), so the other tests of this binary, running in parallel, cannot
//! perturb the figures. The loop itself recycles its receive buffers and sends a static payload,
//! so every allocation counted is the engine's.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use efa::RawAddr;
use efa::device::{Source, Status};
use efa::proto::engine::{Engine, EngineConfig, Event, RecvOp, SendOp};
use efa::proto::sim::SimConfig;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn counting() -> bool {
    COUNTING.try_with(Cell::get).unwrap_or(false)
}

// SAFETY: every call is forwarded unchanged to `System`; the wrapper only counts.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counting() {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if counting() {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if counting() {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations (including reallocations) made by this thread while `f` runs.
fn allocations(f: impl FnOnce()) -> u64 {
    let before = ALLOCS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCS.load(Ordering::Relaxed) - before
}

/// What each message carries.
#[derive(Clone, Copy, Debug)]
struct Kind {
    tagged: bool,
    cq_data: bool,
    dc: bool,
}

/// Two engines and the loop between them: every packet is delivered (copied into one reused
/// datagram buffer) and its send completes at once.
struct Pair {
    e: [Engine; 2],
    addr: [RawAddr; 2],
    now: Instant,
    wire: Vec<u8>,
    /// Receive buffers handed back by completions, posted again.
    bufs: Vec<BytesMut>,
    payload: Bytes,
    size: usize,
}

impl Pair {
    fn new(size: usize, batch: usize) -> Pair {
        let mut cfg: EngineConfig = SimConfig::default_engine();
        cfg.max_tx_ops = 4096;
        cfg.max_rx_ops = 4096;
        let sim = efa::proto::sim::Sim::new(SimConfig::clean(7), 2);
        let addr = [sim.addr(0), sim.addr(1)];
        let now = Instant::now();
        static DATA: [u8; 4096] = [0x5a; 4096];
        Pair {
            e: [
                Engine::new(cfg.clone(), addr[0], now),
                Engine::new(cfg, addr[1], now),
            ],
            addr,
            now,
            wire: Vec::with_capacity(cfg_mtu()),
            bufs: (0..batch).map(|_| BytesMut::with_capacity(size)).collect(),
            payload: Bytes::from_static(&DATA[..size]),
            size,
        }
    }

    fn source(&self, i: usize) -> Source {
        Source {
            gid: self.addr[i].gid,
            qpn: self.addr[i].qpn,
        }
    }

    /// Moves packets both ways until neither engine has any.
    fn pump(&mut self) {
        loop {
            let mut busy = false;
            for i in 0..2 {
                let j = 1 - i;
                while let Some(t) = self.e[i].poll_transmit(self.now) {
                    busy = true;
                    self.wire.clear();
                    self.wire.extend_from_slice(&t.hdr);
                    self.wire.extend_from_slice(&t.payload);
                    let src = self.source(i);
                    self.e[j].handle_recv(self.now, src, &self.wire);
                    self.e[i].handle_send_completion(self.now, t.wr_id, Status::Success);
                }
            }
            if !busy {
                return;
            }
        }
    }

    /// `n` messages 0 → 1 in batches of `self.bufs` receives; checks every completion.
    fn run(&mut self, n: usize, kind: Kind) {
        let batch = self.bufs.len();
        let mut done = 0;
        while done < n {
            let k = batch.min(n - done);
            for m in 0..k {
                let Some(mut buf) = self.bufs.pop() else {
                    panic!("out of receive buffers");
                };
                buf.clear();
                let ctx = (done + m) as u64;
                let r = RecvOp {
                    buf,
                    tag: kind.tagged.then_some((ctx, 0)),
                    src: None,
                    multi_recv: None,
                    context: ctx,
                    local_region: None,
                    room: None,
                };
                if self.e[1].post_recv(self.now, r).is_err() {
                    panic!("post_recv refused");
                }
                let s = SendOp {
                    dest: self.addr[1],
                    buf: self.payload.clone(),
                    tag: kind.tagged.then_some(ctx),
                    data: kind.cq_data.then_some(ctx as u32),
                    delivery_complete: kind.dc,
                    context: ctx,
                    read_key: None,
                    region_len: None,
                };
                if self.e[0].send(self.now, s).is_err() {
                    panic!("send refused");
                }
            }
            self.pump();
            let (mut sends, mut recvs) = (0, 0);
            for i in 0..2 {
                while let Some(ev) = self.e[i].poll_event() {
                    match ev {
                        Event::Send(s) => {
                            assert!(s.error.is_none(), "{:?}", s.error);
                            assert_eq!(s.len, self.size);
                            sends += 1;
                        }
                        Event::Recv(r) => {
                            assert!(r.error.is_none(), "{:?}", r.error);
                            assert_eq!(r.len, self.size);
                            assert_eq!(r.src, Some(self.addr[0]));
                            assert_eq!(r.tag, kind.tagged.then_some(r.context));
                            assert_eq!(r.data, kind.cq_data.then_some(r.context as u32));
                            recvs += 1;
                            self.bufs.push(r.buf);
                        }
                        other => panic!("unexpected event {other:?}"),
                    }
                }
            }
            assert_eq!((sends, recvs), (k, k), "{kind:?}");
            done += k;
        }
    }
}

fn cfg_mtu() -> usize {
    SimConfig::default_engine().mtu
}

/// Allocations for `n` messages after a warm-up, and for `2n`.
fn measure(size: usize, batch: usize, kind: Kind, n: usize) -> (u64, u64) {
    let mut p = Pair::new(size, batch);
    // Warm-up: peers, handshakes, tables and queues reach their working size.
    p.run(4 * n, kind);
    let a = allocations(|| p.run(n, kind));
    let b = allocations(|| p.run(2 * n, kind));
    assert_eq!(p.e[0].resources().tx_ops, 0);
    assert_eq!(p.e[1].resources().rx_ops, 0);
    (a, b)
}

#[test]
fn eager_messages_allocate_nothing_in_steady_state() {
    let n = 5000;
    let mut report = Vec::new();
    let mut failed = Vec::new();
    for size in [8usize, 64, 1024] {
        for batch in [1usize, 64] {
            for (tagged, cq_data, dc) in [
                (false, false, false),
                (true, false, false),
                (false, true, false),
                (true, true, true),
            ] {
                let kind = Kind {
                    tagged,
                    cq_data,
                    dc,
                };
                let (a, b) = measure(size, batch, kind, n);
                report.push(format!(
                    "{size:>5} B, batch {batch:>2}, {kind:?}: {a} allocations for {n} messages, {b} for {}",
                    2 * n
                ));
                // Not growing with the number of messages: at most a few (a table that happened
                // to rehash, say) per measured run, never one per message or per packet.
                if a > 2 || b > 2 {
                    failed.push(report.len() - 1);
                }
            }
        }
    }
    for line in &report {
        println!("{line}");
    }
    assert!(
        failed.is_empty(),
        "allocations grow with the number of messages in {} of {} cases (above)",
        failed.len(),
        report.len()
    );
}

/// Busy-polling a completion queue (as a ping-pong waiting for its next message does) allocates
/// nothing: the queue drives its endpoints without collecting them into a new vector.
#[test]
fn busy_polling_a_completion_queue_allocates_nothing() {
    let net = efa::device::loopback::LoopbackNetwork::new(efa::fault::FaultConfig::default());
    let a = common::Node::new(&common::loopback_domain(&net));
    let b = common::Node::new(&common::loopback_domain(&net));
    let peer = a.insert(b.ep.addr());
    b.insert(a.ep.addr());
    // A first exchange: the peers know each other, the queues have their steady size.
    b.ep.recv(BytesMut::with_capacity(64), 1).unwrap();
    a.ep.send(peer, Bytes::from_static(b"warm"), 2).unwrap();
    b.collect(1, "receive");
    a.collect(1, "send");
    let mut out = Vec::with_capacity(64);
    let n = allocations(|| {
        for _ in 0..10_000 {
            a.cq.poll(&mut out, 64).unwrap();
            b.cq.poll(&mut out, 64).unwrap();
        }
    });
    assert!(out.is_empty(), "nothing was pending: {out:?}");
    assert_eq!(n, 0, "allocations in 20 000 polls of idle queues");
}
