//! Region sends (`SendOp::region_len`): the message stays in the sender's registered region and
//! the engine reads, through its memory, only the bytes that go in packets. Long read reads
//! none, runting read its runt, every other protocol (peer without RDMA read, before the
//! HANDSHAKE, after a READ_NACK) the whole message; data arrives intact under faults; bad use
//! is refused and a failure after a READ_NACK fails the send once.

use super::*;

/// A region send of `len` pattern bytes from node 0's region `SKEY + n`: `buf` stays empty.
fn region_send(sim: &Sim, mem0: &Mem, n: u64, len: usize, seed: u64) -> (SendOp, Bytes) {
    let (mut op, data) = reg_send(sim, mem0, n, len, seed);
    op.buf = Bytes::new();
    op.region_len = Some(len);
    (op, data)
}

/// Bytes read from node 0's memory (device reads by the peer and the engine's own) during `f`.
fn reads(mem0: &Mem, f: impl FnOnce()) -> u64 {
    let before = mem0.read_bytes.load(Ordering::Relaxed);
    f();
    mem0.read_bytes.load(Ordering::Relaxed) - before
}

#[test]
fn region_sends_read_only_what_goes_in_packets() {
    let seed = test_seed();
    // Long read: the receiver's device reads the message once, the engine reads nothing.
    let (mut sim, mems) = msg_sim(seed, 0, false);
    let (op, data) = region_send(&sim, &mems[0], 1, 300_000, seed);
    sim.post_recv(1, recv_op(300_000, 1)).unwrap();
    let n = reads(&mems[0], || {
        sim.send(0, op).unwrap();
        assert!(sim.run(), "seed {seed}");
    });
    assert_eq!(n, 300_000, "seed {seed}: read once, by the receiver");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongReadMsgRtm),
        1,
        "seed {seed}: {t:?}"
    );
    let s = events(&mut sim, 0).sends;
    assert_eq!((s.len(), s[0].len), (1, 300_000), "seed {seed}: {s:?}");
    let r = events(&mut sim, 1).recvs;
    assert!(
        r[0].error.is_none() && r[0].buf[..] == data[..],
        "seed {seed}"
    );

    // Runting read: the engine reads the runt (sent in packets), the receiver the rest.
    let (mut sim, mems) = msg_sim(seed, 20_004, false);
    let (op, data) = region_send(&sim, &mems[0], 2, 300_000, seed);
    sim.post_recv(1, recv_op(300_000, 2)).unwrap();
    let n = reads(&mems[0], || {
        sim.send(0, op).unwrap();
        assert!(sim.run(), "seed {seed}");
    });
    assert_eq!(
        n, 300_000,
        "seed {seed}: 20 000 by the engine, the rest by the receiver"
    );
    let mut runt = Vec::new();
    for d in sim.take_tap() {
        let (p, payload) = wire::decode(&d.bytes).unwrap();
        if let Packet::RuntReadRtm { seg_offset, .. } = p {
            runt.push((seg_offset as usize, payload.to_vec()));
        }
    }
    runt.sort();
    let runt: Vec<u8> = runt.into_iter().flat_map(|(_, p)| p).collect();
    assert!(runt[..] == data[..20_000], "seed {seed}: the runt's bytes");
    check_msg(&mut sim, &[(2, data)], seed);

    // No read protocol (the receiver cannot read; before the HANDSHAKE): read once, whole.
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_message_size = 100_000;
    let (mut sim, mems) = two(c.clone(), [(true, false), (false, false)]);
    connect(&mut sim, seed);
    let (op, data) = region_send(&sim, &mems[0], 3, 200_000, seed);
    sim.post_recv(1, recv_op(200_000, 3)).unwrap();
    let n = reads(&mems[0], || {
        sim.send(0, op).unwrap();
        assert!(sim.run(), "seed {seed}");
    });
    assert_eq!(n, 200_000, "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongCtsMsgRtm),
        1,
        "seed {seed}: {t:?}"
    );
    check_msg(&mut sim, &[(3, data)], seed);
    baseline(&mut sim, seed);

    let (mut sim, mems) = two(c, [(true, false), (true, false)]);
    let (op, data) = region_send(&sim, &mems[0], 4, 150_000, seed);
    sim.post_recv(1, recv_op(150_000, 4)).unwrap();
    let n = reads(&mems[0], || {
        sim.send(0, op).unwrap();
        assert!(sim.run(), "seed {seed}");
    });
    assert_eq!(n, 150_000, "seed {seed}");
    check_msg(&mut sim, &[(4, data)], seed);
}

/// Node 0 believes node 1 can RDMA-read, but node 1 cannot: every read message is NACKed.
pub(super) fn nack_sim(seed: u64, runt: usize) -> (Sim, [Arc<Mem>; 2]) {
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_message_size = 100_000;
    c.engine.runt_size = runt;
    let (mut sim, mems) = two(c, [(true, false), (false, false)]);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let hs = Packet::Handshake(Handshake {
        extra_info: ExtraInfo::with_features(&[ExtraFeature::RdmaRead]),
        connid: Some(a1.qkey),
        host_id: None,
        device_version: None,
        user_recv_qp: None,
        p2p: Some(true),
    })
    .to_vec(&[])
    .unwrap();
    let src1: Source = sim.source(1);
    sim.inject(0, src1, &hs);
    (sim, mems)
}

#[test]
fn a_nacked_region_send_reads_the_rest_and_goes_long_cts() {
    let seed = test_seed();
    for (runt, dc) in [(0, false), (20_000, false), (20_000, true)] {
        let (mut sim, mems) = nack_sim(seed, runt);
        let (mut op, data) = region_send(&sim, &mems[0], 1, 180_000, seed);
        op.delivery_complete = dc;
        sim.post_recv(1, recv_op(180_000, 1)).unwrap();
        sim.send(0, op).unwrap();
        assert!(sim.run(), "seed {seed} runt {runt}");
        let t = packet_types(&mut sim);
        assert_eq!(count(&t, PacketType::ReadNack), 1, "seed {seed}: {t:?}");
        assert!(count(&t, PacketType::CtsData) > 0, "seed {seed}: {t:?}");
        check_msg(&mut sim, &[(1, data)], seed);
        baseline(&mut sim, seed);
    }

    // The region is gone when the NACK comes: the send fails once, with the memory's error.
    let (mut sim, mems) = nack_sim(seed, 0);
    let (op, _) = region_send(&sim, &mems[0], 2, 180_000, seed);
    sim.post_recv(1, recv_op(180_000, 2)).unwrap();
    sim.send(0, op).unwrap();
    mems[0].remove(SKEY + 2);
    let mut sends = Vec::new();
    sim.run_until(|sim| {
        sends.extend(events(sim, 0).sends);
        !sends.is_empty()
    });
    sim.run_for(Duration::from_millis(5));
    sends.extend(events(&mut sim, 0).sends);
    assert_eq!(sends.len(), 1, "seed {seed}: {sends:?}");
    let e = sends[0].error.as_ref().expect("the send fails");
    assert_eq!(e.kind(), ErrorKind::RemoteAccess, "seed {seed}");
}

#[test]
fn region_sends_arrive_intact_under_faults() {
    let base = test_seed();
    for k in 0..3u64 {
        let seed = base.wrapping_add(k);
        for runt in [0, 16_384] {
            let (mut sim, mems) = msg_sim(seed, runt, true);
            let mut rng = Rng::new(seed);
            let mut want = Vec::new();
            for n in 0..8u64 {
                // Some below the read threshold: those are read whole and go as long-CTS.
                let len = 50_000 + rng.below(300_000) as usize;
                let (op, d) = region_send(&sim, &mems[0], n, len, seed);
                sim.post_recv(1, recv_op(len, n)).unwrap();
                sim.send(0, op).unwrap();
                want.push((n, d));
            }
            assert!(sim.run(), "seed {seed} runt {runt}");
            check_msg(&mut sim, &want, seed);
            baseline(&mut sim, seed);
        }
    }
}

#[test]
fn region_len_without_a_key_or_a_memory_is_refused() {
    let seed = test_seed();
    let (mut sim, mems) = msg_sim(seed, 0, false);
    let (mut op, _) = region_send(&sim, &mems[0], 1, 200_000, seed);
    op.read_key = None;
    let (e, back) = sim.send(0, op).expect_err("no key");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "seed {seed}");
    assert_eq!(back.region_len, Some(200_000));

    // A bad key where the bytes must be read at once (the peer cannot read): refused, not sent.
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_message_size = 100_000;
    let (mut sim, mems) = two(c, [(true, false), (false, false)]);
    connect(&mut sim, seed);
    let (mut op, _) = region_send(&sim, &mems[0], 2, 200_000, seed);
    op.read_key = Some((0xbad, SBASE));
    let (e, _) = sim.send(0, op).expect_err("bad key");
    assert_eq!(e.kind(), ErrorKind::RemoteAccess, "seed {seed}");
    assert!(sim.run(), "seed {seed}");
    assert!(
        events(&mut sim, 0).sends.is_empty(),
        "seed {seed}: no completion"
    );
    baseline(&mut sim, seed);
}
