//! Multi-receive, peek/claim/discard, cancel, truncation, delivery complete, `Again`.

use super::*;

#[test]
fn multi_recv_buffers_hand_out_pieces_then_retire() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let a1 = sim.addr(1);
    let mut mop = rop(10_000, 7);
    mop.multi_recv = Some(1500);
    let base = mop.buf.as_ptr() as usize;
    sim.post_recv(1, mop).unwrap();
    for k in 0..12u64 {
        sim.send(0, sop(a1, pattern(k, 1000), k)).unwrap();
    }
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    // 9 messages fit (1000 bytes left < 1500 after the 9th), then the retiring completion.
    assert_eq!(r.len(), 10, "seed {seed}");
    for (k, d) in r[..9].iter().enumerate() {
        assert_eq!(
            (d.context, d.len, d.multi_recv_done),
            (7, 1000, false),
            "seed {seed}"
        );
        assert!(
            d.buf[..] == pattern(k as u64, 1000)[..],
            "seed {seed}: piece {k}"
        );
        assert_eq!(
            d.buf.as_ptr() as usize,
            base + 1000 * k,
            "seed {seed}: pieces share the buffer"
        );
    }
    let last = &r[9];
    assert!(
        last.multi_recv_done && last.error.is_none() && last.len == 0,
        "seed {seed}: {last:?}"
    );
    assert_eq!(last.buf.capacity(), 1000);
    // The other 3 wait as unexpected; a new buffer takes them at once, and a medium message.
    assert_eq!(sim.engine(1).resources().unexpected_msgs, 3);
    let mut mop = rop(64 * 1024, 8);
    mop.multi_recv = Some(100);
    sim.post_recv(1, mop).unwrap();
    sim.send(0, sop(a1, pattern(100, 30_000), 100)).unwrap();
    sim.send(0, sop(a1, pattern(101, 40_000), 101)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    let lens: Vec<(usize, usize, bool)> = r
        .iter()
        .map(|d| (d.len, d.olen, d.multi_recv_done))
        .collect();
    // 3 x 1000 + 30 000 leave 32 536 bytes: the 40 000-byte message is truncated into it.
    assert_eq!(
        lens,
        vec![
            (1000, 0, false),
            (1000, 0, false),
            (1000, 0, false),
            (30_000, 0, false),
            (32_536, 7464, false),
            (0, 0, true)
        ],
        "seed {seed}"
    );
    assert!(r[3].buf[..] == pattern(100, 30_000)[..], "seed {seed}");
    assert_eq!(
        r[4].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::Truncated)
    );
    assert!(
        r[4].buf[..] == pattern(101, 40_000)[..32_536],
        "seed {seed}"
    );
    // Cancelling a multi-receive buffer retires it with Canceled.
    let mut mop = rop(4096, 9);
    mop.multi_recv = Some(100);
    sim.post_recv(1, mop).unwrap();
    assert!(sim.engine(1).cancel_recv(9));
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1);
    assert!(r[0].multi_recv_done && r[0].buf.capacity() == 4096);
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::Canceled)
    );
    assert_eq!(send_events(&mut sim, 0).len(), 14);
    baseline(&mut sim, seed);
}

#[test]
fn peek_claim_and_discard_unexpected_messages() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.jitter = Duration::from_micros(10);
    let mut sim = Sim::new(cfg, 2);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    let mut long_dc = tsop(a1, pattern(2, 300_000), 0x11, 2);
    long_dc.delivery_complete = true;
    let mut with_data = tsop(a1, pattern(1, 100), 0x10, 1);
    with_data.data = Some(0xfeed);
    sim.send(0, with_data).unwrap();
    sim.send(0, long_dc).unwrap();
    sim.send(0, tsop(a1, pattern(3, 20_000), 0x12, 3)).unwrap();
    assert!(sim.run());
    let e = sim.engine(1);
    assert_eq!(
        e.peek(0x99, 0, None, false).unwrap_err().kind(),
        ErrorKind::NoMessage
    );
    let p = e.peek(0x10, 0, None, false).unwrap();
    assert_eq!(
        (p.len, p.tag, p.data, p.src, p.claim),
        (100, 0x10, Some(0xfeed), a0, None)
    );
    assert_eq!(
        e.peek(0x13, 0x3, Some(a0), false).unwrap().tag,
        0x10,
        "ignore bits: oldest match"
    );
    let c = e.peek(0x12, 0, Some(a0), true).unwrap();
    let token = c.claim.expect("claimed");
    assert_eq!(c.len, 20_000);
    assert_eq!(
        e.peek(0x12, 0, None, false).unwrap_err().kind(),
        ErrorKind::NoMessage,
        "claimed is hidden"
    );
    let d = e.discard(0x11, 0, None).unwrap();
    assert_eq!(d.len, 300_000);
    let now = sim.now();
    sim.engine(1)
        .recv_claimed(now, token, rop(20_000, 30))
        .unwrap();
    assert_eq!(
        sim.engine(1)
            .recv_claimed(now, token, rop(1, 31))
            .unwrap_err()
            .0
            .kind(),
        ErrorKind::NoMessage
    );
    sim.post_recv(1, trop(100, 0x10, 0, None, 10)).unwrap();
    assert!(sim.run());
    let mut r = recv_events(&mut sim, 1);
    r.sort_by_key(|d| d.context);
    assert_eq!(
        r.len(),
        2,
        "seed {seed}: the discarded message has no completion"
    );
    assert!(r[0].context == 10 && r[0].buf[..] == pattern(1, 100)[..] && r[0].data == Some(0xfeed));
    assert!(r[1].context == 30 && r[1].buf[..] == pattern(3, 20_000)[..]);
    let s = send_events(&mut sim, 0);
    assert_eq!(
        s.len(),
        3,
        "seed {seed}: the discarded (DC, long) send completes normally"
    );
    assert!(s.iter().all(|s| s.error.is_none()));
    baseline(&mut sim, seed);
}

#[test]
fn cancel_a_posted_receive_but_not_one_that_started() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let a1 = sim.addr(1);
    sim.post_recv(1, rop(4096, 1)).unwrap();
    assert!(sim.engine(1).cancel_recv(1));
    assert!(!sim.engine(1).cancel_recv(1));
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1);
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::Canceled)
    );
    assert!(r[0].buf.capacity() >= 4096 && r[0].src.is_none());
    sim.post_recv(1, rop(1 << 20, 2)).unwrap();
    sim.send(0, sop(a1, pattern(1, 1 << 20), 1)).unwrap();
    sim.run_until(|s| s.engine(1).resources().rx_ops == 1 && s.stats.delivered > 3);
    assert!(
        !sim.engine(1).cancel_recv(2),
        "seed {seed}: matching started"
    );
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert!(
        r.len() == 1 && r[0].error.is_none() && r[0].buf[..] == pattern(1, 1 << 20)[..],
        "seed {seed}"
    );
    assert_eq!(sim.engine(1).stats().canceled, 1);
    baseline(&mut sim, seed);
}

#[test]
fn truncation_of_eager_medium_and_long_cts_messages() {
    let seed = efa::fault::test_seed();
    for (len, cap) in [
        (1000, 100),
        (30_000, 10_000),
        (500_000, 100_000),
        (200_000, 0),
        (8000, 7999),
    ] {
        for dc in [false, true] {
            let mut sim = Sim::new(SimConfig::faulty(seed), 2);
            let a1 = sim.addr(1);
            let data = pattern(len as u64, len);
            sim.post_recv(1, rop(cap, 1)).unwrap();
            let mut op = sop(a1, data.clone(), 1);
            op.delivery_complete = dc;
            sim.send(0, op).unwrap();
            assert!(sim.run(), "seed {seed}");
            let r = recv_events(&mut sim, 1);
            assert_eq!(r.len(), 1, "seed {seed} {len} {cap}");
            assert_eq!(
                r[0].error.as_ref().map(|e| e.kind()),
                Some(ErrorKind::Truncated),
                "seed {seed}"
            );
            assert_eq!((r[0].len, r[0].olen), (cap, len - cap), "seed {seed}");
            assert!(r[0].buf[..] == data[..cap], "seed {seed} {len} {cap}");
            let s = send_events(&mut sim, 0);
            assert!(
                s.len() == 1 && s[0].error.is_none(),
                "seed {seed} {len} {cap} dc {dc}: the sender completes normally"
            );
            assert_eq!(sim.engine(1).stats().truncated, 1);
            baseline(&mut sim, seed);
        }
    }
}

#[test]
fn delivery_complete_waits_for_the_receipt() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let a1 = sim.addr(1);
    for (k, len) in [100usize, 30_000, 300_000].into_iter().enumerate() {
        let mut op = sop(a1, pattern(k as u64, len), k as u64);
        op.delivery_complete = true;
        sim.send(0, op).unwrap();
        sim.send(0, sop(a1, pattern(10 + k as u64, len), 10 + k as u64))
            .unwrap();
    }
    assert!(sim.run());
    // Transmit complete: the eager and medium sends without DC are done; nothing with DC is.
    let mut s: Vec<u64> = send_events(&mut sim, 0).iter().map(|s| s.context).collect();
    s.sort_unstable();
    assert_eq!(s, vec![10, 11], "seed {seed}");
    let res = sim.engine(0).resources();
    assert_eq!(
        (res.tx_ops, res.outstanding_pkts),
        (4, 0),
        "seed {seed}: every packet completed, still waiting"
    );
    for k in 0..6 {
        sim.post_recv(1, rop(300_000, k)).unwrap();
    }
    assert!(sim.run());
    let mut s: Vec<u64> = send_events(&mut sim, 0).iter().map(|s| s.context).collect();
    s.sort_unstable();
    assert_eq!(s, vec![0, 1, 2, 12], "seed {seed}");
    assert_eq!(recv_events(&mut sim, 1).len(), 6);
    baseline(&mut sim, seed);
}

#[test]
fn again_when_operation_queues_are_full() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.engine.max_tx_ops = 4;
    cfg.engine.max_rx_ops = 2;
    let mut sim = Sim::new(cfg, 2);
    let a1 = sim.addr(1);
    for k in 0..4 {
        sim.send(0, sop(a1, pattern(k, 10), k)).unwrap();
    }
    let (e, op) = sim.send(0, sop(a1, pattern(4, 10), 4)).unwrap_err();
    assert_eq!(
        (e.kind(), op.context, op.buf.len()),
        (ErrorKind::Again, 4, 10)
    );
    sim.post_recv(1, rop(10, 1)).unwrap();
    sim.post_recv(1, rop(10, 2)).unwrap();
    let (e, op) = sim.post_recv(1, rop(10, 3)).unwrap_err();
    assert_eq!((e.kind(), op.context), (ErrorKind::Again, 3));
    assert!(sim.run());
    assert_eq!(send_events(&mut sim, 0).len(), 4);
    sim.send(0, op_again(a1)).unwrap();
    assert_eq!(sim.engine(0).stats().again, 1);
    assert_eq!(sim.engine(1).stats().again, 1);
    fn op_again(a: RawAddr) -> SendOp {
        sop(a, pattern(4, 10), 4)
    }
}

/// Issue 17, defect 2: a flood of unexpected messages far beyond the engine's buffering budget,
/// in any order (jitter makes REQs overtake each other), loses nothing: every message the
/// device delivered is held (the endpoint keeps the bound by not reposting device receives),
/// and once receives are posted all arrive intact and in order, every send succeeded once.
#[test]
fn a_flood_beyond_the_budget_loses_nothing() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.jitter = Duration::from_micros(300);
    let mut sim = Sim::new(cfg, 2);
    sim.engine(1).set_limits(efa::proto::engine::EngineLimits {
        max_peers: 16,
        max_buffered_msgs: 8,
        max_buffered_bytes: 32 << 10,
    });
    let a1 = sim.addr(1);
    let mut rng = Rng::new(seed);
    let n = 300u64;
    let lens: Vec<usize> = (0..n).map(|_| rng.below(20_000) as usize).collect();
    for k in 0..n {
        sim.send(0, sop(a1, pattern(k, lens[k as usize]), k))
            .unwrap();
    }
    assert!(sim.run(), "seed {seed}");
    for k in 0..n {
        sim.post_recv(1, rop(20_000, k)).unwrap();
    }
    assert!(sim.run(), "seed {seed}");
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), n as usize, "seed {seed}: messages lost");
    for d in &r {
        let k = d.context;
        assert!(
            d.error.is_none() && d.buf[..] == pattern(k, lens[k as usize])[..],
            "seed {seed}: message {k} lost, corrupted or out of order"
        );
    }
    let s = send_events(&mut sim, 0);
    assert!(
        s.len() == n as usize && s.iter().all(|d| d.error.is_none()),
        "seed {seed}: sends"
    );
    assert_eq!(sim.engine(1).stats().dropped_pkts, 0, "seed {seed}");
    assert_eq!(sim.engine(1).resources().buffered_bytes, 0, "seed {seed}");
}
