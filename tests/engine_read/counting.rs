//! Peers' accesses counted at the target (`Engine::set_remote_events`, `take_target_counts`:
//! what `FI_REMOTE_WRITE` / `FI_REMOTE_READ` counters count, issue 28): a target counting them
//! leaves device RDMA out of its HANDSHAKE, so even a peer whose device could write or read it
//! one-sidedly emulates, and each access is counted exactly once, under loss and duplicates too;
//! refusals count as errors; without counting, device RDMA goes on as before.

use super::*;

/// Two nodes whose devices both do RDMA read and write; node 1 counts peers' writes and reads
/// as `events` says (set before any HANDSHAKE goes out).
fn counting(c: SimConfig, events: (bool, bool)) -> (Sim, [Arc<Mem>; 2]) {
    let (mut sim, mems) = all(c);
    sim.engine(1).set_remote_events(events.0, events.1);
    (sim, mems)
}

/// Node 1's HANDSHAKE as node 0 received it.
fn handshake_of_1(sim: &mut Sim) -> Handshake {
    let hs: Vec<Handshake> = sim
        .take_tap()
        .iter()
        .filter(|d| d.from == 1)
        .filter_map(|d| match wire::decode(&d.bytes).ok()?.0 {
            Packet::Handshake(h) => Some(h),
            _ => None,
        })
        .collect();
    assert_eq!(hs.len(), 1);
    hs[0]
}

fn atomic_op(dest: RawAddr, op: AtomicOp, fetch: bool, context: u64) -> RmaOp {
    RmaOp {
        dest,
        remote: RemoteIov {
            addr: TBASE + 8192,
            len: 8,
            key: TKEY,
        },
        kind: RmaKind::Atomic {
            op,
            datatype: AtomicType::U64,
            operand: Bytes::from_static(&[1, 0, 0, 0, 0, 0, 0, 0]),
            compare: None,
            fetch: fetch.then(|| BytesMut::with_capacity(8)),
        },
        local_key: None,
        delivery_complete: false,
        context,
        local_region: None,
    }
}

#[test]
fn a_counting_target_is_written_and_read_only_through_its_engine() {
    let seed = test_seed();
    let (mut sim, mems) = counting(SimConfig::clean(seed), (true, true));
    sim.set_tap(true);
    connect_keeping_tap(&mut sim, seed);
    let f = handshake_of_1(&mut sim).extra_info;
    assert!(!f.has(ExtraFeature::RdmaWrite), "seed {seed}");
    assert!(!f.has(ExtraFeature::RdmaRead), "seed {seed}");
    let a1 = sim.addr(1);
    let before = sim.stats.rdma_ops;
    // An eager write, a long-CTS write, one with immediate data, a short and a long read, an
    // atomic and a fetching one, a read-only atomic.
    let mut writes = 0;
    for (i, (len, imm)) in [(100, None), (300_000, None), (5000, Some(9))]
        .into_iter()
        .enumerate()
    {
        let data = pattern(seed + i as u64, len);
        let d = run_rma(&mut sim, 0, write_op(a1, TBASE, data.clone(), imm, 1), seed).unwrap();
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
        assert_eq!(d.path, RmaPath::Emulated, "seed {seed}");
        assert_eq!(&mems[1].bytes(TKEY)[..len], &data[..], "seed {seed}");
        writes += 1;
    }
    for len in [64, 200_000] {
        let d = run_rma(&mut sim, 0, read_op(a1, TBASE, len, 2), seed).unwrap();
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
        assert_eq!(d.path, RmaPath::Emulated, "seed {seed}");
    }
    for (op, fetch) in [
        (AtomicOp::Sum, false),
        (AtomicOp::Sum, true),
        (AtomicOp::Read, true),
    ] {
        let d = run_rma(&mut sim, 0, atomic_op(a1, op, fetch, 3), seed).unwrap();
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
    }
    assert_eq!(sim.stats.rdma_ops, before, "seed {seed}: no device RDMA");
    let t = sim.engine(1).take_target_counts();
    assert_eq!(
        (t.writes, t.reads, t.write_errors, t.read_errors),
        (writes + 2, 3, 0, 0),
        "seed {seed}: {t:?}"
    );
    assert!(sim.engine(1).take_target_counts().is_empty(), "taken once");
    // Refused accesses (past the region's end) count as errors.
    let end = TBASE + TLEN as u64 - 10;
    run_rma(
        &mut sim,
        0,
        write_op(a1, end, pattern(1, 64), None, 4),
        seed,
    )
    .unwrap();
    run_rma(
        &mut sim,
        0,
        write_op(a1, end, pattern(1, 90_000), None, 5),
        seed,
    )
    .unwrap();
    run_rma(&mut sim, 0, read_op(a1, end, 64, 6), seed).unwrap();
    let t = sim.engine(1).take_target_counts();
    assert_eq!(
        (t.writes, t.reads, t.write_errors, t.read_errors),
        (0, 0, 2, 1),
        "seed {seed}: {t:?}"
    );
}

#[test]
fn counting_writes_only_leaves_device_reads_alone() {
    let seed = test_seed();
    let (mut sim, _) = counting(SimConfig::clean(seed), (true, false));
    sim.set_tap(true);
    connect_keeping_tap(&mut sim, seed);
    let f = handshake_of_1(&mut sim).extra_info;
    assert!(!f.has(ExtraFeature::RdmaWrite) && f.has(ExtraFeature::RdmaRead));
    let a1 = sim.addr(1);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(3, 5000), None, 1),
        seed,
    )
    .unwrap();
    assert_eq!(d.path, RmaPath::Emulated, "seed {seed}");
    let d = run_rma(&mut sim, 0, read_op(a1, TBASE, 5000, 2), seed).unwrap();
    assert_eq!(d.path, RmaPath::Device, "seed {seed}");
    // The device read is the NIC's: nothing for the target to count.
    let t = sim.engine(1).take_target_counts();
    assert_eq!((t.writes, t.reads), (1, 0), "seed {seed}: {t:?}");
    // Without counting, both go to the device and nothing is counted.
    let (mut sim, _) = counting(SimConfig::clean(seed), (false, false));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(3, 5000), None, 1),
        seed,
    )
    .unwrap();
    assert_eq!(d.path, RmaPath::Device, "seed {seed}");
    assert!(sim.engine(1).take_target_counts().is_empty());
}

#[test]
fn each_access_is_counted_once_under_loss_and_duplicates() {
    let seed = test_seed();
    let (mut sim, _) = counting(SimConfig::faulty(seed), (true, true));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let mut rng = Rng::new(seed);
    let (mut writes, mut reads) = (0u64, 0u64);
    for i in 0..40u64 {
        let len = 1 + rng.below(120_000) as usize;
        let op = if rng.chance(0.5) {
            writes += 1;
            write_op(
                a1,
                TBASE,
                pattern(seed ^ i, len),
                rng.chance(0.3).then_some(i as u32),
                i,
            )
        } else {
            reads += 1;
            read_op(a1, TBASE, len, i)
        };
        let d = run_rma(&mut sim, 0, op, seed).unwrap();
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
    }
    let t = sim.engine(1).take_target_counts();
    assert_eq!(
        (t.writes, t.reads, t.write_errors, t.read_errors),
        (writes, reads, 0, 0),
        "seed {seed}: {t:?}"
    );
}

/// [`connect`] without emptying the tap (the HANDSHAKEs stay to be looked at).
fn connect_keeping_tap(sim: &mut Sim, seed: u64) {
    for (a, b) in [(0, 1), (1, 0)] {
        sim.post_recv(b, recv_op(16, 900)).unwrap();
        let dest = sim.addr(b);
        sim.send(a, send_op(dest, Bytes::from_static(b"hi"), 901))
            .unwrap();
    }
    assert!(sim.run(), "seed {seed}");
    for i in 0..2 {
        assert_eq!(sim.take_events(i).len(), 2, "seed {seed}");
    }
}
