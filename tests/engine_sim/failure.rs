//! RNR and backoff, unresponsive and vanishing peers, close.

use super::*;

#[test]
fn rnr_resends_at_once_then_backs_off_exponentially() {
    let t0 = Instant::now();
    let (a, b) = (addr(1, 0x111), addr(2, 0x222));
    let mut e = Engine::new(engine_cfg(), a, t0);
    e.send(t0, sop(b, pattern(1, 100), 1)).unwrap();
    let t1 = e.poll_transmit(t0).unwrap();
    e.handle_send_completion(t0, t1.wr_id, Status::RnrRetryExceeded);
    assert_eq!(e.poll_timeout(), None, "first RNR of a packet: no backoff");
    let t2 = e.poll_transmit(t0).expect("resent at once");
    assert_eq!(
        (t2.hdr.clone(), t2.payload.clone()),
        (t1.hdr.clone(), t1.payload.clone())
    );
    e.handle_send_completion(t0, t2.wr_id, Status::RnrRetryExceeded);
    let ms = Duration::from_millis;
    assert_eq!(
        e.poll_timeout(),
        Some(t0 + ms(1)),
        "second RNR: backoff of timeout_interval"
    );
    assert!(e.poll_transmit(t0 + ms(0)).is_none());
    let (err, _) = e.send(t0, sop(b, pattern(2, 10), 2)).unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::Again,
        "no new work for a peer in backoff"
    );
    e.handle_timeout(t0 + Duration::from_micros(500));
    assert!(
        e.poll_transmit(t0 + Duration::from_micros(500)).is_none(),
        "backoff honoured"
    );
    e.handle_timeout(t0 + ms(1));
    let t3 = e
        .poll_transmit(t0 + ms(1))
        .expect("resent after the backoff");
    e.handle_send_completion(t0 + ms(1), t3.wr_id, Status::RnrRetryExceeded);
    assert_eq!(e.poll_timeout(), Some(t0 + ms(3)), "next episode doubles");
    e.handle_timeout(t0 + ms(3));
    let t4 = e.poll_transmit(t0 + ms(3)).unwrap();
    e.handle_send_completion(t0 + ms(3), t4.wr_id, Status::RnrRetryExceeded);
    assert_eq!(e.poll_timeout(), Some(t0 + ms(6)), "capped by max_timeout");
    e.handle_timeout(t0 + ms(6));
    let t5 = e.poll_transmit(t0 + ms(6)).unwrap();
    e.handle_send_completion(t0 + ms(6), t5.wr_id, Status::Success);
    let Some(Event::Send(s)) = e.poll_event() else {
        panic!("send completes")
    };
    assert!(s.error.is_none());
    let st = e.stats();
    assert_eq!((st.rnr, st.retransmits, st.again), (4, 4, 1));

    // Without FI_EFA_TIMEOUT_INTERVAL the first backoff is random in 40..120 µs.
    for seed in 0..20 {
        let mut cfg = engine_cfg();
        cfg.timeout_interval = Duration::ZERO;
        cfg.seed = seed;
        let mut e = Engine::new(cfg, a, t0);
        e.send(t0, sop(b, pattern(1, 100), 1)).unwrap();
        for _ in 0..2 {
            let t = e.poll_transmit(t0).unwrap();
            e.handle_send_completion(t0, t.wr_id, Status::RnrRetryExceeded);
        }
        let wait = e.poll_timeout().unwrap() - t0;
        assert!(
            wait >= Duration::from_micros(40) && wait < Duration::from_micros(120),
            "{wait:?}"
        );
    }
}

#[test]
fn rnr_under_a_slow_receiver_still_delivers_everything_in_order() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.rx_buffers = 2;
    cfg.rx_repost_delay = Duration::from_micros(100);
    cfg.rnr_retry = 0;
    let mut sim = Sim::new(cfg, 2);
    let a1 = sim.addr(1);
    let n = 60u64;
    for k in 0..n {
        sim.post_recv(1, rop(70_000, k)).unwrap();
    }
    for k in 0..n {
        let len = if k % 10 == 9 { 60_000 } else { 2000 };
        sim.send(0, sop(a1, pattern(k, len), k)).unwrap();
    }
    let mut saw_again = false;
    assert!(sim.run_until(|s| {
        if !saw_again && s.engine(0).poll_timeout().is_some() {
            let (e, _) = s.send(0, sop(a1, Bytes::new(), 99)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Again, "seed {seed}");
            saw_again = true;
        }
        s.engine(1).resources().rx_ops == 0 && s.engine(0).resources().tx_ops == 0
    }));
    assert!(saw_again, "seed {seed}: the sender backed off");
    let mut r = recv_events(&mut sim, 1);
    r.sort_by_key(|d| d.context);
    assert_eq!(r.len(), n as usize);
    for (k, d) in r.iter().enumerate() {
        let len = if k % 10 == 9 { 60_000 } else { 2000 };
        assert!(
            d.error.is_none() && d.buf[..] == pattern(k as u64, len)[..],
            "seed {seed}: message {k}"
        );
    }
    let st = sim.engine(0).stats();
    assert!(
        st.rnr > 0 && st.retransmits >= st.rnr,
        "seed {seed}: {st:?}"
    );
    assert_eq!(send_events(&mut sim, 0).len(), n as usize);
    assert!(sim.run());
    baseline(&mut sim, seed);
}

#[test]
fn unresponsive_peer_fails_operations_instead_of_hanging() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.unresponsive_after = Duration::from_millis(1);
    let mut sim = Sim::new(cfg, 3);
    let (a1, a2) = (sim.addr(1), sim.addr(2));
    // Node 2 is gone: everything to it fails; traffic to node 1 is unaffected.
    sim.vanish(2);
    for (k, len) in [100usize, 30_000, 300_000, 10].into_iter().enumerate() {
        let mut op = sop(a2, pattern(k as u64, len), k as u64);
        op.delivery_complete = k == 3;
        sim.send(0, op).unwrap();
        sim.post_recv(1, rop(len, k as u64)).unwrap();
        sim.send(0, sop(a1, pattern(k as u64, len), 10 + k as u64))
            .unwrap();
    }
    assert!(sim.run());
    let mut s = send_events(&mut sim, 0);
    s.sort_by_key(|s| s.context);
    assert_eq!(s.len(), 8, "seed {seed}");
    for d in &s[..4] {
        assert_eq!(
            d.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::ConnectionAborted),
            "seed {seed}"
        );
        assert_eq!(d.status, Some(Status::UnresponsiveRemote));
    }
    assert!(s[4..].iter().all(|d| d.error.is_none()), "seed {seed}");
    assert_eq!(recv_events(&mut sim, 1).len(), 4);
    assert_eq!(
        sim.engine(0).resources().peers,
        1,
        "seed {seed}: the dead peer is forgotten"
    );

    // A sender that vanishes in the middle of a long message: the receive fails after
    // rx_stall_timeout (the CTS to it takes longer to fail here).
    let mut cfg = SimConfig::clean(seed);
    cfg.unresponsive_after = Duration::from_secs(60);
    let mut sim = Sim::new(cfg, 3);
    let (a1, a2) = (sim.addr(1), sim.addr(2));
    sim.post_recv(1, rop(4 << 20, 1)).unwrap();
    sim.send(2, sop(a1, pattern(1, 4 << 20), 1)).unwrap();
    sim.run_until(|s| s.stats.delivered_bytes > 1 << 20);
    sim.vanish(2);
    let t = sim.elapsed();
    sim.run_until(|s| !s.node(1).events.is_empty() || s.engine(1).resources().rx_ops == 0);
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert_eq!(
        r[0].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::ConnectionAborted),
        "seed {seed}"
    );
    assert_eq!(r[0].src, Some(a2));
    let waited = sim.elapsed() - t;
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(7),
        "seed {seed}: {waited:?}"
    );
    assert!(sim.run());
    assert!(
        recv_events(&mut sim, 1).is_empty(),
        "seed {seed}: one completion only"
    );
    baseline(&mut sim, seed);
    // A new incarnation at the same place works.
    sim.restart(2);
    sim.post_recv(1, rop(100, 2)).unwrap();
    sim.send(2, sop(a1, pattern(2, 100), 2)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert!(
        r.len() == 1 && r[0].error.is_none() && r[0].src == Some(sim.addr(2)),
        "seed {seed}"
    );
}

#[test]
fn close_completes_every_operation_once() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (a1, _) = (sim.addr(1), sim.addr(0));
    sim.post_recv(1, rop(100, 1)).unwrap();
    let mut m = rop(10_000, 2);
    m.multi_recv = Some(100);
    sim.post_recv(1, m).unwrap();
    sim.post_recv(1, trop(100, 0x1, 0, None, 3)).unwrap();
    sim.post_recv(1, trop(2 << 20, 0x2, 0, None, 4)).unwrap();
    sim.send(0, tsop(a1, pattern(10, 2 << 20), 0x2, 10))
        .unwrap();
    let mut dc = tsop(a1, pattern(11, 100), 0x77, 11);
    dc.delivery_complete = true;
    sim.send(0, dc).unwrap();
    sim.send(0, sop(a1, pattern(12, 100), 12)).unwrap();
    sim.send(0, tsop(a1, pattern(13, 300_000), 0x78, 13))
        .unwrap();
    sim.run_until(|s| s.stats.delivered_bytes > 200_000);
    sim.engine(0).close();
    sim.engine(1).close();
    sim.engine(1).close();
    assert!(sim.run());
    let mut s: Vec<(u64, Option<ErrorKind>)> = send_events(&mut sim, 0)
        .iter()
        .map(|d| (d.context, d.error.as_ref().map(|e| e.kind())))
        .collect();
    s.sort_by_key(|x| x.0);
    assert_eq!(
        s,
        vec![
            (10, Some(ErrorKind::Canceled)),
            (11, Some(ErrorKind::Canceled)),
            (12, None),
            (13, Some(ErrorKind::Canceled))
        ],
        "seed {seed}"
    );
    let mut r: Vec<(u64, Option<ErrorKind>, bool)> = recv_events(&mut sim, 1)
        .iter()
        .map(|d| {
            (
                d.context,
                d.error.as_ref().map(|e| e.kind()),
                d.multi_recv_done,
            )
        })
        .collect();
    r.sort_by_key(|x| x.0);
    assert_eq!(
        r,
        vec![
            (1, None, false),
            (2, Some(ErrorKind::Canceled), true),
            (3, Some(ErrorKind::Canceled), false),
            (4, Some(ErrorKind::Canceled), false)
        ],
        "seed {seed}"
    );
    let now = sim.now();
    let e = sim.engine(0);
    assert_eq!(
        e.send(now, sop(a1, Bytes::new(), 1)).unwrap_err().0.kind(),
        ErrorKind::Closed
    );
    assert_eq!(
        e.post_recv(now, rop(1, 1)).unwrap_err().0.kind(),
        ErrorKind::Closed
    );
    e.handle_send_completion(now, 1 << 32, Status::Success);
    assert!(
        e.poll_event().is_none() && e.poll_timeout().is_none() && e.poll_transmit(now).is_none()
    );
    baseline(&mut sim, seed);
}
