//! Handshake and connid, stale and restarted peers, reordering, tag matching.

use super::*;

#[test]
fn handshake_advertises_dc_and_connid_and_reqs_switch_to_connid() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    sim.set_tap(true);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    for k in 0..3 {
        sim.post_recv(1, rop(100_000, k)).unwrap();
    }
    sim.send(0, sop(a1, pattern(1, 10), 1)).unwrap();
    assert!(sim.run());
    sim.send(0, sop(a1, pattern(2, 10), 2)).unwrap();
    sim.send(0, sop(a1, pattern(3, 90_000), 3)).unwrap();
    assert!(sim.run());
    assert_eq!(recv_events(&mut sim, 1).len(), 3, "seed {seed}");
    let tap = sim.take_tap();
    let mut reqs = Vec::new();
    let mut handshakes = [0, 0];
    for d in &tap {
        let (pkt, _) = wire::decode(&d.bytes).expect("engine packets decode");
        match pkt {
            Packet::Handshake(h) => {
                handshakes[d.from] += 1;
                let feats: Vec<ExtraFeature> = h.extra_info.features().collect();
                assert_eq!(
                    feats,
                    vec![
                        ExtraFeature::DeliveryComplete,
                        ExtraFeature::RequestConnidHeader,
                        ExtraFeature::Runt,
                        ExtraFeature::ReadNack,
                    ],
                    "seed {seed}"
                );
                assert_eq!(h.connid, Some(sim.addr(d.from).qkey), "seed {seed}");
            }
            Packet::CtsData { connid, .. } => assert_eq!(connid, Some(a0.qkey), "seed {seed}"),
            Packet::Cts { connid, .. } => assert_eq!(connid, Some(a1.qkey), "seed {seed}"),
            p if p.req_opt().is_some() => reqs.push(*p.req_opt().unwrap()),
            _ => {}
        }
    }
    assert_eq!(handshakes, [1, 1], "seed {seed}: one HANDSHAKE each way");
    assert_eq!(
        reqs[0].sender,
        Sender::RawAddr(a0),
        "seed {seed}: first REQ carries the raw address"
    );
    assert_eq!(
        reqs.last().unwrap().sender,
        Sender::Connid(a0.qkey),
        "seed {seed}: REQs after the handshake carry the connid"
    );
}

#[test]
fn ctsdata_waits_for_the_peer_handshake() {
    let now = Instant::now();
    let (a, b) = (addr(1, 0x111), addr(2, 0x222));
    let mut e = Engine::new(engine_cfg(), a, now);
    let len = 200_000;
    e.send(now, sop(b, pattern(5, len), 9)).unwrap();
    let t = e.poll_transmit(now).unwrap();
    let mut bytes = t.hdr.to_vec();
    bytes.extend_from_slice(&t.payload);
    let (
        Packet::LongCtsRtm {
            send_id,
            msg_length,
            opt,
            ..
        },
        first,
    ) = wire::decode(&bytes).unwrap()
    else {
        panic!("expected a LONGCTS RTM");
    };
    assert_eq!(msg_length, len as u64);
    assert_eq!(opt.sender, Sender::RawAddr(a));
    let first = first.len();
    e.handle_send_completion(now, t.wr_id, Status::Success);
    let cts = Packet::Cts {
        connid: Some(b.qkey),
        send_id,
        recv_id: 77,
        recv_length: 100_000,
        read_req: false,
    };
    e.handle_recv(now, src_of(b), &cts.to_vec(&[]).unwrap());
    while let Some(t) = e.poll_transmit(now) {
        let bytes = [&t.hdr[..], &t.payload[..]].concat();
        let (p, _) = wire::decode(&bytes).unwrap();
        assert!(
            matches!(p, Packet::Handshake(_)),
            "only our HANDSHAKE may go before the peer's: {p:?}"
        );
        e.handle_send_completion(now, t.wr_id, Status::Success);
    }
    let hs = Handshake {
        connid: Some(b.qkey),
        ..Default::default()
    };
    e.handle_recv(now, src_of(b), &Packet::Handshake(hs).to_vec(&[]).unwrap());
    let mut next = first;
    while let Some(t) = e.poll_transmit(now) {
        let bytes = [&t.hdr[..], &t.payload[..]].concat();
        let (
            Packet::CtsData {
                connid,
                recv_id,
                seg_offset,
                seg_length,
            },
            _,
        ) = wire::decode(&bytes).unwrap()
        else {
            panic!("expected CTSDATA");
        };
        assert_eq!(
            (connid, recv_id, seg_offset),
            (Some(a.qkey), 77, next as u64)
        );
        assert!(t.hdr.len() + t.payload.len() <= e.config().mtu);
        assert_eq!(seg_length as usize, t.payload.len());
        next += t.payload.len();
        e.handle_send_completion(now, t.wr_id, Status::Success);
    }
    assert_eq!(next, first + 100_000, "exactly the window");
    assert!(
        e.poll_event().is_none(),
        "not complete before the rest is granted"
    );
}

#[test]
fn stale_connid_and_unidentifiable_packets_are_dropped() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    sim.post_recv(1, rop(64, 1)).unwrap();
    sim.send(0, sop(a1, pattern(1, 10), 1)).unwrap();
    assert!(sim.run());
    assert_eq!(recv_events(&mut sim, 1).len(), 1);
    sim.post_recv(1, rop(64, 2)).unwrap();
    let before = sim.engine(1).stats().dropped_pkts;
    let stale = |sender| Packet::EagerRtm {
        opt: ReqOpt {
            sender,
            cq_data: None,
        },
        msg_id: 1,
        tag: None,
        dc_send_id: None,
    };
    let wrong = a0.qkey ^ 0x55;
    let pkts = [
        stale(Sender::Connid(wrong)).to_vec(b"stale").unwrap(),
        stale(Sender::RawAddr(addr(3, 1)))
            .to_vec(b"spoofed raw address")
            .unwrap(),
        Packet::Cts {
            connid: Some(wrong),
            send_id: 1,
            recv_id: 1,
            recv_length: 10,
            read_req: false,
        }
        .to_vec(&[])
        .unwrap(),
        Packet::Receipt {
            connid: Some(wrong),
            send_id: 1,
            msg_id: 0,
        }
        .to_vec(&[])
        .unwrap(),
    ];
    for p in &pkts {
        sim.inject(1, src_of(a0), p);
    }
    // A REQ from an unknown source with only a connid cannot be attributed.
    sim.inject(
        1,
        src_of(addr(4, 4)),
        &stale(Sender::Connid(4)).to_vec(b"x").unwrap(),
    );
    assert!(sim.run());
    assert_eq!(
        sim.engine(1).stats().dropped_pkts - before,
        pkts.len() as u64 + 1,
        "seed {seed}"
    );
    assert!(
        recv_events(&mut sim, 1).is_empty(),
        "seed {seed}: nothing stale was delivered"
    );
    // The real peer still gets through.
    sim.send(0, sop(a1, pattern(2, 10), 2)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert!(r[0].buf[..] == pattern(2, 10)[..], "seed {seed}");
}

#[test]
fn restarted_peer_with_a_new_qkey_is_a_new_peer() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (old0, a1) = (sim.addr(0), sim.addr(1));
    for k in 0..3 {
        sim.send(0, sop(a1, pattern(k, 100), k)).unwrap();
    }
    assert!(sim.run());
    assert_eq!(sim.engine(1).resources().unexpected_msgs, 3, "seed {seed}");
    // The old incarnation falls silent for longer than rx_stall_timeout (5 s in the simulator):
    // only then does a new one at its place replace it (a live one stays, see below).
    sim.run_for(Duration::from_secs(6));
    let new0 = sim.restart(0);
    assert_ne!(new0.qkey, old0.qkey);
    sim.send(0, sop(a1, pattern(10, 100), 10)).unwrap();
    assert!(sim.run());
    let res = sim.engine(1).resources();
    assert_eq!(
        (res.unexpected_msgs, res.peers),
        (1, 1),
        "seed {seed}: the old incarnation's state is gone"
    );
    sim.post_recv(1, rop(1000, 1)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 1);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].src, Some(new0), "seed {seed}");
    assert!(r[0].buf[..] == pattern(10, 100)[..], "seed {seed}");
    // A late packet of the old incarnation is stale.
    let before = sim.engine(1).stats().dropped_pkts;
    let old = Packet::EagerRtm {
        opt: ReqOpt {
            sender: Sender::RawAddr(old0),
            cq_data: None,
        },
        msg_id: 3,
        tag: None,
        dc_send_id: None,
    };
    sim.inject(1, src_of(old0), &old.to_vec(b"late").unwrap());
    assert_eq!(
        sim.engine(1).stats().dropped_pkts,
        before + 1,
        "seed {seed}"
    );
    // Both ways work with the new incarnation; the old address is gone.
    sim.post_recv(0, rop(5000, 5)).unwrap();
    sim.send(1, sop(new0, pattern(11, 5000), 1)).unwrap();
    sim.send(1, sop(old0, pattern(12, 5000), 2)).unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 0);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert!(
        r[0].error.is_none() && r[0].buf[..] == pattern(11, 5000)[..],
        "seed {seed}"
    );
    let mut s = send_events(&mut sim, 1);
    s.sort_by_key(|s| s.context);
    assert!(s[0].error.is_none(), "seed {seed}");
    assert_eq!(
        s[1].error.as_ref().map(|e| e.kind()),
        Some(ErrorKind::ConnectionAborted),
        "seed {seed}"
    );
    assert_eq!(s[1].status, Some(Status::UnresponsiveRemote));
    baseline(&mut sim, seed);
}

/// Issue 17, defect 5: a REQ claiming a new QKEY at a live peer's GID and QPN (what a host that
/// forges the source address can send) must not abort the live peer: its unexpected messages stay
/// and arrive intact, and it keeps talking.
#[test]
fn forged_req_with_a_new_qkey_does_not_abort_a_live_peer() {
    let seed = efa::fault::test_seed();
    let mut sim = Sim::new(SimConfig::clean(seed), 2);
    let (a0, a1) = (sim.addr(0), sim.addr(1));
    for k in 0..3 {
        sim.send(0, sop(a1, pattern(k, 100), k)).unwrap();
    }
    assert!(sim.run());
    assert_eq!(sim.engine(1).resources().unexpected_msgs, 3, "seed {seed}");
    let forged_addr = RawAddr {
        qkey: a0.qkey ^ 0x5a5a,
        ..a0
    };
    let forged = Packet::EagerRtm {
        opt: ReqOpt {
            sender: Sender::RawAddr(forged_addr),
            cq_data: None,
        },
        msg_id: 0,
        tag: None,
        dc_send_id: None,
    };
    sim.inject(1, src_of(a0), &forged.to_vec(b"forged").unwrap());
    assert!(sim.run());
    // (The forged incarnation's own message may go too: its handshake finds nobody.)
    let held = sim.engine(1).resources().unexpected_msgs;
    assert!(
        held >= 3,
        "seed {seed}: the live peer's messages were dropped ({held} held)"
    );
    sim.send(0, sop(a1, pattern(3, 100), 3)).unwrap();
    for k in 0..4 {
        let mut r = rop(1000, k);
        r.src = Some(a0);
        sim.post_recv(1, r).unwrap();
    }
    assert!(sim.run());
    let mut r = recv_events(&mut sim, 1);
    r.sort_by_key(|r| r.context);
    assert_eq!(r.len(), 4, "seed {seed}");
    for (k, d) in r.iter().enumerate() {
        assert!(
            d.error.is_none() && d.src == Some(a0) && d.buf[..] == pattern(k as u64, 100)[..],
            "seed {seed}: message {k}: {d:?}"
        );
    }
    let s = send_events(&mut sim, 0);
    assert!(
        s.len() == 4 && s.iter().all(|d| d.error.is_none()),
        "seed {seed}: {s:?}"
    );
}

#[test]
fn reorder_window_overflow_keeps_order() {
    let seed = efa::fault::test_seed();
    for win in [1usize, 16] {
        let mut cfg = SimConfig::clean(seed);
        cfg.engine.recvwin_size = win;
        cfg.jitter = Duration::from_micros(400);
        let mut sim = Sim::new(cfg, 2);
        let a1 = sim.addr(1);
        let n = 400u64;
        for k in 0..n {
            let len = (k as usize * 37) % 300 + if k % 50 == 0 { 20_000 } else { 0 };
            sim.send(0, sop(a1, pattern(k, len), k)).unwrap();
        }
        let mut max_held = 0;
        sim.run_until(|s| {
            max_held = max_held.max(s.engine(1).resources().reorder_held);
            false
        });
        assert!(
            max_held > win,
            "seed {seed} win {win}: overflow list used (held at most {max_held})"
        );
        for k in 0..n {
            sim.post_recv(1, rop(30_000, k)).unwrap();
        }
        assert!(sim.run());
        let mut r = recv_events(&mut sim, 1);
        r.sort_by_key(|r| r.context);
        assert_eq!(r.len(), n as usize, "seed {seed}");
        for (k, d) in r.iter().enumerate() {
            let len = (k * 37) % 300 + if k % 50 == 0 { 20_000 } else { 0 };
            assert!(
                d.buf[..] == pattern(k as u64, len)[..],
                "seed {seed} win {win}: message {k} out of order"
            );
        }
        assert!(sim.engine(1).stats().reorder_buffered > 0, "seed {seed}");
        assert_eq!(send_events(&mut sim, 0).len(), n as usize);
        baseline(&mut sim, seed);
    }
}

#[test]
fn tag_matching_with_ignore_bits_and_directed_receives() {
    let seed = efa::fault::test_seed();
    let mut cfg = SimConfig::clean(seed);
    cfg.jitter = Duration::from_micros(20);
    let mut sim = Sim::new(cfg, 4);
    let a: Vec<RawAddr> = (0..4).map(|i| sim.addr(i)).collect();
    sim.post_recv(0, trop(100, 0x100, 0x0ff, None, 1)).unwrap();
    sim.post_recv(0, trop(100, 0x200, 0, Some(a[2]), 2))
        .unwrap();
    sim.post_recv(0, trop(100, 0x200, 0, None, 3)).unwrap();
    sim.post_recv(0, rop(100, 4)).unwrap();
    sim.send(1, tsop(a[0], pattern(1, 10), 0x200, 1)).unwrap();
    sim.send(2, tsop(a[0], pattern(2, 20), 0x200, 1)).unwrap();
    sim.send(3, tsop(a[0], pattern(3, 30), 0x1ab, 1)).unwrap();
    sim.send(3, sop(a[0], pattern(4, 40), 2)).unwrap();
    sim.send(1, tsop(a[0], pattern(5, 50), 0x3cd, 2)).unwrap();
    assert!(sim.run());
    let mut r = recv_events(&mut sim, 0);
    r.sort_by_key(|r| r.context);
    let got: Vec<(u64, Option<u64>, Option<RawAddr>, usize)> =
        r.iter().map(|d| (d.context, d.tag, d.src, d.len)).collect();
    assert_eq!(
        got,
        vec![
            (1, Some(0x1ab), Some(a[3]), 30),
            (2, Some(0x200), Some(a[2]), 20),
            (3, Some(0x200), Some(a[1]), 10),
            (4, None, Some(a[3]), 40),
        ],
        "seed {seed}"
    );
    // 0x3cd matched nothing: it waits as unexpected until a receive ignoring the low byte.
    assert_eq!(sim.engine(0).resources().unexpected_msgs, 1);
    sim.post_recv(0, trop(100, 0x3ff, 0xf0, Some(a[2]), 5))
        .unwrap();
    sim.post_recv(0, trop(100, 0x3ff, 0xf2, Some(a[1]), 6))
        .unwrap();
    assert!(sim.run());
    let r = recv_events(&mut sim, 0);
    assert_eq!(r.len(), 1, "seed {seed}");
    assert_eq!((r[0].context, r[0].tag), (6, Some(0x3cd)));
    assert!(sim.engine(0).cancel_recv(5));
    assert_eq!(recv_events(&mut sim, 0).len(), 1);
    baseline(&mut sim, seed);
}
