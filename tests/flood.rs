//! Issue 17, defect 2: one peer floods unexpected messages while another exchanges normally.
//! The flooder is held back at the device once it holds more than its share (half) of the
//! receiver's buffering budget, so the normal peer's messages keep flowing (before, the whole
//! budget filled and every sender met receiver-not-ready, the normal one for ever); memory stays
//! under the budget; once the receiver posts receives for them, every flooded message arrives
//! exactly once, intact and in order. Latencies of the normal exchange without and with the
//! flood are printed (3 alternated rounds), never asserted.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::*;
use efa::ErrorKind;
use efa::fault::{FaultConfig, test_seed};
use efa::proto::engine::EngineLimits;

const FLOOD: usize = 100_000;
const FLOOD_TAG: u64 = 0xf100d;
const PING_TAG: u64 = 0x9;
const LEN: usize = 64;
const ROUND_TRIPS: usize = 2_000;

/// Posts `f` until it is not `Again`, making progress on `n` meanwhile.
fn retry(n: &Node, what: &str, mut f: impl FnMut() -> efa::Result<()>) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match f() {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::Again => n.ep.progress(),
            Err(e) => panic!("{what}: {e}"),
        }
        assert!(Instant::now() < deadline, "{what}: kept getting Again");
    }
}

/// `ROUND_TRIPS` ping-pongs from `n` to `r`, both driven here; the median round trip.
fn ping_pong(n: &Node, r: &Node, to_r: efa::PeerId, to_n: efa::PeerId, seed: u64) -> Duration {
    let mut times = Vec::with_capacity(ROUND_TRIPS);
    let deadline = Instant::now() + DEADLINE;
    for i in 0..ROUND_TRIPS {
        let start = Instant::now();
        r.ep.trecv(BytesMut::with_capacity(LEN), PING_TAG, 0, 1)
            .unwrap();
        n.ep.trecv(BytesMut::with_capacity(LEN), PING_TAG, 0, 1)
            .unwrap();
        let ping = payload(seed, i, LEN);
        retry(n, "ping", || {
            n.ep.tsend(to_r, ping.clone(), PING_TAG, 2)
                .map_err(|e| e.error)
        });
        let (mut at_n, mut at_r) = (Vec::new(), Vec::new());
        // r: the ping's receive; then the pong back; n: its send, the pong.
        while !at_r.iter().any(|c: &efa::Completion| c.context == 1) {
            n.poll_ok(&mut at_n, &format_args!("seed {seed}: ping {i} at n"));
            r.poll_ok(&mut at_r, &format_args!("seed {seed}: ping {i} at r"));
            assert!(
                Instant::now() < deadline,
                "seed {seed}: ping {i} never arrived"
            );
        }
        let got = at_r.iter().find(|c| c.context == 1).unwrap();
        assert_eq!(
            got.buf.as_recv().unwrap(),
            &ping[..],
            "seed {seed}: ping {i}"
        );
        retry(r, "pong", || {
            r.ep.tsend(to_n, ping.clone(), PING_TAG, 2)
                .map_err(|e| e.error)
        });
        while at_n
            .iter()
            .filter(|c| c.context == 1 || c.context == 2)
            .count()
            < 2
            || !at_r.iter().any(|c| c.context == 2)
        {
            n.poll_ok(&mut at_n, &format_args!("seed {seed}: pong {i} at n"));
            r.poll_ok(&mut at_r, &format_args!("seed {seed}: pong {i} at r"));
            assert!(
                Instant::now() < deadline,
                "seed {seed}: pong {i} never arrived"
            );
        }
        times.push(start.elapsed());
    }
    times.sort_unstable();
    times[times.len() / 2]
}

#[test]
fn a_flooding_peer_is_held_back_and_the_others_go_on() {
    let seed = test_seed();
    let ip = "127.0.0.1".parse().unwrap();
    let r = Node::new(&udp_domain(ip, FaultConfig::default()));
    let n = Node::new(&udp_domain(ip, FaultConfig::default()));
    let (to_r, to_n) = (n.insert(r.ep.addr()), r.insert(n.ep.addr()));
    let limits = EngineLimits::default();
    let mut figures = Vec::new();
    for round in 0..3 {
        let base = ping_pong(&n, &r, to_r, to_n, seed);
        // The flooder, in its own thread, on its own device.
        let f = Arc::new(Node::new(&udp_domain(ip, FaultConfig::default())));
        let (to_rf, from_f) = (f.insert(r.ep.addr()), r.insert(f.ep.addr()));
        let flooder = {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut done = 0;
                let mut out = Vec::new();
                for i in 0..FLOOD {
                    let m = payload(seed ^ round, i, LEN);
                    retry(&f, "flood", || {
                        f.ep.tsend(to_rf, m.clone(), FLOOD_TAG, i as u64)
                            .map_err(|e| e.error)
                    });
                }
                let deadline = Instant::now() + DEADLINE * 2;
                while done < FLOOD {
                    out.clear();
                    match f.cq.wait(&mut out, 256, Some(Duration::from_millis(50))) {
                        Ok(_) => {
                            for c in &out {
                                assert!(c.flags.contains(efa::CompletionFlags::SEND));
                            }
                            done += out.len();
                        }
                        Err(e) if e.kind() == ErrorKind::TimedOut => {}
                        Err(e) => panic!("seed {seed}: flooder: {e}"),
                    }
                    assert!(
                        Instant::now() < deadline,
                        "seed {seed}: flooder: {done} of {FLOOD} completed"
                    );
                }
                done
            })
        };
        // The receiver takes the flood until the flooder holds its share of the budget.
        let share = limits.max_buffered_msgs / 2;
        let deadline = Instant::now() + DEADLINE;
        while r.ep.resources().buffered_msgs < share {
            r.ep.progress();
            assert!(
                Instant::now() < deadline,
                "seed {seed}: the flood stalled at {} held",
                r.ep.resources().buffered_msgs
            );
            std::thread::yield_now();
        }
        let (rnr0, t0) = (r.ep.domain().device_stats().rnr_events, Instant::now());
        let flooded = ping_pong(&n, &r, to_r, to_n, seed ^ 7);
        let rnr = r.ep.domain().device_stats().rnr_events - rnr0;
        eprintln!(
            "rnr refusals during the flooded ping-pong: {rnr} in {:?}",
            t0.elapsed()
        );
        let held = r.ep.resources().buffered_msgs;
        assert!(
            held <= limits.max_buffered_msgs,
            "seed {seed}: {held} messages held, over the budget"
        );
        // Now the receiver takes every flooded message: once each, intact, in order.
        let mut got = 0usize;
        let mut posted = 0usize;
        let mut out = Vec::new();
        let deadline = Instant::now() + DEADLINE;
        while got < FLOOD {
            while posted < FLOOD {
                match r
                    .ep
                    .trecv(BytesMut::with_capacity(LEN), FLOOD_TAG, 0, posted as u64)
                {
                    Ok(()) => posted += 1,
                    Err(e) if e.kind() == ErrorKind::Again => break,
                    Err(e) => panic!("seed {seed}: {e}"),
                }
            }
            out.clear();
            r.poll_ok(&mut out, &format_args!("seed {seed}: draining"));
            for c in &out {
                assert_eq!(c.context as usize, got, "seed {seed}: in order");
                assert_eq!(c.tag, FLOOD_TAG, "seed {seed}");
                assert_eq!(
                    c.buf.as_recv().unwrap(),
                    &payload(seed ^ round, got, LEN)[..],
                    "seed {seed}: flooded message {got}"
                );
                got += 1;
            }
            assert!(
                Instant::now() < deadline,
                "seed {seed}: {got} of {FLOOD} flooded messages"
            );
        }
        let sent = flooder.join().expect("the flooder");
        assert_eq!(
            sent, FLOOD,
            "seed {seed}: every flooded send completed once"
        );
        r.av.remove(from_f).ok();
        figures.push((base, flooded, held));
    }
    for (i, (base, flooded, held)) in figures.iter().enumerate() {
        eprintln!(
            "round {i}: normal peer's median round trip {base:?} alone, {flooded:?} beside a flood held at {held} messages ({:.2}x)",
            flooded.as_secs_f64() / base.as_secs_f64()
        );
    }
}
