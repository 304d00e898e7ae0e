//! The emulation's long-CTS protocols (DC_LONGCTS_RTW, LONGCTS_RTR) in the simulator: chosen by
//! size when device RDMA is off, several CTS windows (small `tx_min_credits`), loss, duplicates
//! and reordering, immediate data reported exactly once with the whole length, refusals before
//! any data moves, a region revoked midway, locked memory, plain LONGCTS_RTW from another
//! implementation, and crafted packets.

use super::*;

/// Two nodes without device RDMA, windows of `credits` packets.
fn emulated(c: SimConfig, credits: usize) -> (Sim, [Arc<Mem>; 2]) {
    let mut c = c;
    c.engine.tx_min_credits = credits;
    two(c, [(false, false); 2])
}

/// The largest write (with immediate data when `imm`, which takes a CQ-data header) that goes as
/// one DC_EAGER_RTW to `dest` (after the HANDSHAKE): found by asking the engine, through the
/// packets it sends.
fn eager_room(seed: u64, imm: bool) -> usize {
    let (mut sim, _) = emulated(SimConfig::clean(seed), 4);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let mut lo = 1usize;
    let mut hi = 9000usize;
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        run_rma(
            &mut sim,
            0,
            write_op(a1, TBASE, pattern(seed, mid), imm.then_some(7), 1),
            seed,
        )
        .unwrap();
        let t = packet_types(&mut sim);
        if count(&t, PacketType::DcEagerRtw) == 1 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[test]
fn long_writes_and_reads_go_long_cts_in_windows_under_faults() {
    let base = test_seed();
    let room = eager_room(base, false);
    let room_imm = eager_room(base, true);
    assert!(room_imm < room, "the CQ-data header takes room");
    for k in 0..4u64 {
        let seed = base.wrapping_add(k);
        let mut c = SimConfig::faulty(seed);
        c.engine.max_outstanding_tx = 16;
        let (mut sim, mems) = emulated(c, 2 + k as usize);
        connect(&mut sim, seed);
        let a1 = sim.addr(1);
        let mut rng = Rng::new(seed);
        const SLOT: usize = 160 * 1024;
        // Around the one-packet boundary, then up to many windows.
        let mut sizes = vec![room, room + 1, room + 2, 2 * room, 8192 * 2 + 1];
        while sizes.len() < 24 {
            sizes.push(1 + rng.below(150_000) as usize);
        }
        let datas: Vec<Bytes> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| pattern(seed ^ (i as u64) << 8, n))
            .collect();
        let n = datas.len();
        let mut next = 0usize;
        let mut seen = HashSet::new();
        let mut done = 0;
        let mem1 = mems[1].clone();
        let ok = sim.run_until(|sim| {
            while next < n {
                let imm = (!next.is_multiple_of(3)).then_some(next as u32);
                let addr = TBASE + (next * SLOT) as u64;
                let op = write_op(a1, addr, datas[next].clone(), imm, next as u64);
                match sim.rma(0, op) {
                    Ok(()) => next += 1,
                    Err((e, _)) => {
                        assert_eq!(e.kind(), ErrorKind::Again, "seed {seed}");
                        break;
                    }
                }
            }
            let m = mem1.bytes(TKEY);
            for w in events(sim, 1).writes {
                let i = w.data as usize;
                assert!(seen.insert(i), "seed {seed}: write {i} reported twice");
                assert_eq!(w.len, datas[i].len(), "seed {seed}: length of write {i}");
                let a = i * SLOT;
                assert!(
                    m[a..a + datas[i].len()] == datas[i][..],
                    "seed {seed}: write {i} not all in place at its event"
                );
            }
            for d in events(sim, 0).rmas {
                assert!(d.error.is_none(), "seed {seed}: {d:?}");
                assert_eq!(d.path, RmaPath::Emulated, "seed {seed}");
                assert_eq!(d.len, datas[d.context as usize].len(), "seed {seed}");
                // Delivery complete: in place when the initiator hears of it.
                let (i, a) = (d.context as usize, d.context as usize * SLOT);
                assert!(
                    mem1.bytes(TKEY)[a..a + datas[i].len()] == datas[i][..],
                    "seed {seed}: write {i} completed before it was in place"
                );
                done += 1;
            }
            done == n && seen.len() == (0..n).filter(|i| i % 3 != 0).count()
        });
        assert!(ok, "seed {seed}: {done} done, {} events", seen.len());
        let t = packet_types(&mut sim);
        // Writes with immediate data (every index not divisible by 3) have less room.
        let long = (0..n)
            .filter(|&i| sizes[i] > if i % 3 != 0 { room_imm } else { room })
            .count();
        assert!(
            count(&t, PacketType::DcLongCtsRtw) >= long,
            "seed {seed}: {t:?}"
        );
        assert!(
            count(&t, PacketType::DcEagerRtw) >= n - long,
            "seed {seed}: {t:?}"
        );
        assert!(
            count(&t, PacketType::Cts) > n,
            "seed {seed}: several windows: {t:?}"
        );
        assert!(count(&t, PacketType::CtsData) > 0, "seed {seed}: {t:?}");
        assert!(count(&t, PacketType::Receipt) >= n, "seed {seed}: {t:?}");
        assert_eq!(
            count(&t, PacketType::LongCtsRtw),
            0,
            "seed {seed}: always DC"
        );
        // Read everything back, several reads in flight.
        let mut pending: HashMap<u64, usize> = HashMap::new();
        for (i, d) in datas.iter().enumerate() {
            let op = read_op(a1, TBASE + (i * SLOT) as u64, d.len(), 100 + i as u64);
            sim.rma(0, op).map_err(|(e, _)| e).unwrap();
            pending.insert(100 + i as u64, i);
        }
        let ok = sim.run_until(|sim| {
            for d in events(sim, 0).rmas {
                assert!(d.error.is_none(), "seed {seed}: {d:?}");
                let i = pending.remove(&d.context).expect("one completion per read");
                let RmaBuf::Read(b) = d.buf else {
                    panic!("seed {seed}: read buffer")
                };
                assert_eq!(d.len, datas[i].len(), "seed {seed}");
                assert!(b[..] == datas[i][..], "seed {seed}: read {i}");
            }
            pending.is_empty()
        });
        assert!(ok, "seed {seed}: {} reads left", pending.len());
        let t = packet_types(&mut sim);
        assert!(count(&t, PacketType::LongCtsRtr) > 0, "seed {seed}: {t:?}");
        assert!(count(&t, PacketType::ShortRtr) > 0, "seed {seed}: {t:?}");
        assert!(count(&t, PacketType::ReadRsp) >= n, "seed {seed}: {t:?}");
        assert!(count(&t, PacketType::CtsData) > 0, "seed {seed}: {t:?}");
        assert_eq!(sim.stats.rdma_ops, 0, "seed {seed}: nothing on the device");
        assert!(sim.stats.lost > 0, "seed {seed}: faults happened");
        assert!(sim.run(), "seed {seed}");
        baseline(&mut sim, seed);
    }
}

#[test]
fn long_cts_refusals_move_no_data() {
    let seed = test_seed();
    let (mut sim, mems) = emulated(SimConfig::clean(seed), 4);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    mems[1].add(TKEY + 1, 0x900_0000, vec![7; 100_000], true, false);
    mems[1].add(TKEY + 2, 0xa00_0000, vec![7; 100_000], false, true);
    let before = mems[1].bytes(TKEY);
    let data = pattern(seed, 90_000);
    let cases: [(u64, u64, usize); 4] = [
        (TKEY + 9, TBASE, data.len()),            // unknown key
        (TKEY, TBASE + TLEN as u64 - 10, 90_000), // beyond the region
        (TKEY + 1, 0x900_0000, 90_000),           // no write right
        (TKEY, TBASE - 1, 90_000),                // below the region
    ];
    for (j, &(key, addr, len)) in cases.iter().enumerate() {
        let mut op = write_op(a1, addr, data.slice(..len), Some(j as u32), j as u64);
        op.remote.key = key;
        let d = run_rma(&mut sim, 0, op, seed).unwrap();
        assert_eq!(
            d.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::RemoteAccess),
            "seed {seed}: case {j}"
        );
        assert_eq!(d.status, Some(Status::RemoteBadAddress), "seed {seed}");
        let t = packet_types(&mut sim);
        assert_eq!(count(&t, PacketType::DcLongCtsRtw), 1, "seed {seed}: {t:?}");
        assert_eq!(count(&t, PacketType::CtsData), 0, "seed {seed}: {t:?}");
        assert_eq!(count(&t, PacketType::PeerError), 1, "seed {seed}: {t:?}");
    }
    assert!(mems[1].bytes(TKEY) == before, "seed {seed}: memory changed");
    assert!(events(&mut sim, 1).writes.is_empty(), "seed {seed}");
    // Reads: unknown key, beyond, no read right.
    for (j, (key, addr)) in [
        (TKEY + 9, TBASE),
        (TKEY, TBASE + TLEN as u64 - 5),
        (TKEY + 2, 0xa00_0000),
    ]
    .into_iter()
    .enumerate()
    {
        let mut op = read_op(a1, addr, 50_000, 50 + j as u64);
        op.remote.key = key;
        let d = run_rma(&mut sim, 0, op, seed).unwrap();
        assert_eq!(
            d.status,
            Some(Status::RemoteBadAddress),
            "seed {seed}: read {j}"
        );
        let t = packet_types(&mut sim);
        assert_eq!(count(&t, PacketType::LongCtsRtr), 1, "seed {seed}: {t:?}");
        assert_eq!(count(&t, PacketType::ReadRsp), 0, "seed {seed}: {t:?}");
    }
    baseline(&mut sim, seed);
}

#[test]
fn a_region_revoked_midway_fails_the_write_once() {
    let seed = test_seed();
    let (mut sim, mems) = emulated(SimConfig::clean(seed), 2);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let data = pattern(seed, 1 << 20);
    sim.rma(0, write_op(a1, TBASE, data.clone(), Some(3), 7))
        .map_err(|(e, _)| e)
        .unwrap();
    // Until the target has placed some windows.
    let ok = sim.run_until(|sim| {
        let t = sim.take_tap();
        t.iter()
            .any(|d| wire::decode(&d.bytes).is_ok_and(|(p, _)| p.packet_type() == PacketType::Cts))
    });
    assert!(ok, "seed {seed}");
    mems[1].remove(TKEY);
    assert!(sim.run(), "seed {seed}");
    let mut ev = events(&mut sim, 0);
    assert_eq!(ev.rmas.len(), 1, "seed {seed}: one completion");
    let d = ev.rmas.pop().unwrap();
    assert_eq!(
        d.status,
        Some(Status::RemoteBadAddress),
        "seed {seed}: {d:?}"
    );
    assert!(
        events(&mut sim, 1).writes.is_empty(),
        "seed {seed}: no event"
    );
    baseline(&mut sim, seed);
}

#[test]
fn locked_memory_delays_long_cts_without_loss() {
    let seed = test_seed();
    let (mut sim, mems) = emulated(SimConfig::clean(seed), 2);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let data = pattern(seed, 300_000);
    mems[1].busy.store(6, Ordering::Relaxed);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, data.clone(), Some(9), 1),
        seed,
    )
    .unwrap();
    assert!(d.error.is_none(), "seed {seed}: {d:?}");
    assert_eq!(
        mems[1].busy.load(Ordering::Relaxed),
        0,
        "seed {seed}: it was locked"
    );
    let w = events(&mut sim, 1).writes;
    assert_eq!(w.len(), 1, "seed {seed}");
    assert_eq!((w[0].data, w[0].len), (9, data.len()), "seed {seed}");
    assert_eq!(&mems[1].bytes(TKEY)[..data.len()], &data[..], "seed {seed}");
    let d = run_rma(&mut sim, 0, read_op(a1, TBASE, data.len(), 2), seed).unwrap();
    let RmaBuf::Read(b) = d.buf else {
        panic!("seed {seed}: read buffer")
    };
    assert!(b[..] == data[..], "seed {seed}");
    baseline(&mut sim, seed);
}

/// A plain LONGCTS_RTW, as libfabric sends it without delivery complete, over two ranges: the
/// target places it, grants windows and reports the immediate data, without a RECEIPT.
#[test]
fn plain_longcts_rtw_from_another_implementation() {
    use efa::proto::wire::{IovList, ReqOpt, Sender};
    let seed = test_seed();
    let (mut sim, mems) = emulated(SimConfig::clean(seed), 2);
    connect(&mut sim, seed);
    let a0 = sim.addr(0);
    let src0 = sim.source(0);
    let data = pattern(seed, 40_000);
    let iovs = [
        RemoteIov {
            addr: TBASE + 100,
            len: 15_000,
            key: TKEY,
        },
        RemoteIov {
            addr: TBASE + 200_000,
            len: 25_000,
            key: TKEY,
        },
    ];
    let send_id = 0xabcd;
    let req = Packet::LongCtsRtw {
        opt: ReqOpt {
            sender: Sender::Connid(a0.qkey),
            cq_data: Some(77),
        },
        msg_length: data.len() as u64,
        send_id,
        credit_request: 2,
        dc: false,
        read_nack: false,
        rma_iov: IovList::new(&iovs),
    };
    let mut bytes = Vec::new();
    req.encode_header(&mut bytes).unwrap();
    let first = 3000;
    bytes.extend_from_slice(&data[..first]);
    sim.inject(1, src0, &bytes);
    // Answer every CTS with its window, as the initiator would.
    let mut sent = first;
    let mut ctss = 0;
    let mut writes = Vec::new();
    let ok = sim.run_until(|sim| {
        for d in sim.take_tap() {
            let Ok((
                Packet::Cts {
                    send_id: s,
                    recv_id,
                    recv_length,
                    read_req: false,
                    ..
                },
                _,
            )) = wire::decode(&d.bytes)
            else {
                continue;
            };
            assert_eq!(s, send_id, "seed {seed}");
            ctss += 1;
            let end = sent + recv_length as usize;
            assert!(end <= data.len(), "seed {seed}: window beyond the write");
            while sent < end {
                let n = 5000.min(end - sent);
                let h = Packet::CtsData {
                    connid: Some(a0.qkey),
                    recv_id,
                    seg_length: n as u64,
                    seg_offset: sent as u64,
                };
                let mut b = Vec::new();
                h.encode_header(&mut b).unwrap();
                b.extend_from_slice(&data[sent..sent + n]);
                // Every packet twice: the second is a duplicate, dropped.
                sim.inject(1, src0, &b);
                sim.inject(1, src0, &b);
                sent += n;
            }
        }
        writes.extend(events(sim, 1).writes);
        sent == data.len() && !writes.is_empty()
    });
    assert!(ok, "seed {seed}: {sent} sent");
    assert!(ctss >= 2, "seed {seed}: {ctss} windows");
    sim.run_for(Duration::from_millis(5));
    writes.extend(events(&mut sim, 1).writes);
    assert_eq!(writes.len(), 1, "seed {seed}: {writes:?}");
    assert_eq!(
        (writes[0].data, writes[0].len),
        (77, data.len()),
        "seed {seed}"
    );
    let m = mems[1].bytes(TKEY);
    assert_eq!(&m[100..15_100], &data[..15_000], "seed {seed}");
    assert_eq!(&m[200_000..225_000], &data[15_000..], "seed {seed}");
    assert!(
        sim.engine(1).stats().dropped_pkts > 0,
        "seed {seed}: duplicates dropped"
    );
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::Receipt),
        0,
        "seed {seed}: not delivery complete"
    );
    assert_eq!(sim.engine(1).resources().target_ops, 0, "seed {seed}");
}

#[test]
fn crafted_long_cts_packets_never_harm() {
    use efa::proto::wire::{IovList, ReqOpt, Sender};
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    let (mut sim, mems) = emulated(SimConfig::clean(seed), 2);
    connect(&mut sim, seed);
    let a0 = sim.addr(0);
    let src0 = sim.source(0);
    let before = mems[1].bytes(TKEY);
    for round in 0..600u32 {
        let iovs = [
            RemoteIov {
                addr: TBASE + rng.below(TLEN as u64 * 2),
                len: if rng.chance(0.5) {
                    rng.below(1 << 21)
                } else {
                    rng.next_u64()
                },
                key: if rng.chance(0.7) {
                    TKEY
                } else {
                    rng.next_u64()
                },
            },
            RemoteIov {
                addr: rng.next_u64(),
                len: rng.next_u64(),
                key: TKEY,
            },
        ];
        let n_iov = 1 + rng.below(2) as usize;
        let iov = IovList::new(&iovs[..n_iov]);
        let id = if rng.chance(0.5) {
            rng.below(16) as u32
        } else {
            rng.next_u64() as u32
        };
        let len = if rng.chance(0.5) {
            iovs[0].len
        } else {
            rng.next_u64()
        };
        let opt = ReqOpt {
            sender: Sender::Connid(a0.qkey),
            cq_data: rng.chance(0.5).then_some(1),
        };
        let connid = Some(a0.qkey);
        let pkt = match rng.below(5) {
            0 => Packet::LongCtsRtw {
                opt,
                msg_length: len,
                send_id: id,
                credit_request: 1,
                dc: rng.chance(0.5),
                read_nack: rng.chance(0.2),
                rma_iov: iov,
            },
            1 => Packet::LongCtsRtr {
                opt,
                msg_length: len,
                recv_id: id,
                recv_length: rng.next_u64() as u32,
                rma_iov: iov,
            },
            2 => Packet::Cts {
                connid,
                send_id: id,
                recv_id: id,
                recv_length: if rng.chance(0.5) {
                    rng.below(1 << 20)
                } else {
                    rng.next_u64()
                },
                read_req: rng.chance(0.5),
            },
            3 => Packet::CtsData {
                connid,
                recv_id: id,
                seg_length: 0,
                seg_offset: if rng.chance(0.5) {
                    rng.below(1 << 20)
                } else {
                    rng.next_u64()
                },
            },
            _ => Packet::ReadRsp {
                connid,
                recv_id: id,
                send_id: id,
                seg_length: 0,
            },
        };
        let mut bytes = Vec::new();
        if pkt.encode_header(&mut bytes).is_err() {
            continue;
        }
        let pay = pattern(u64::from(round), rng.below(600) as usize);
        bytes.extend_from_slice(&pay);
        sim.inject(1, src0, &bytes);
        if round % 50 == 0 {
            sim.run_for(Duration::from_millis(1));
        }
    }
    sim.run_for(Duration::from_millis(20));
    // Nothing outside the target region changed; the node still works.
    let _ = sim.take_events(0);
    let _ = sim.take_events(1);
    let after = mems[1].bytes(TKEY);
    assert_eq!(after.len(), before.len(), "seed {seed}");
    let data = pattern(seed, 100_000);
    let a1 = sim.addr(1);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, data.clone(), None, 1),
        seed,
    );
    assert!(d.unwrap().error.is_none(), "seed {seed}");
    assert_eq!(&mems[1].bytes(TKEY)[..data.len()], &data[..], "seed {seed}");
}

/// Work waiting for a region the application holds is bounded: beyond `max_buffered_bytes`
/// further requests are refused (the initiator's operation fails with `RemoteAbort`), the
/// accepted ones complete once the region is free, and nothing is left behind.
#[test]
fn work_waiting_for_a_locked_region_is_bounded() {
    let seed = test_seed();
    let (mut sim, mems) = emulated(SimConfig::clean(seed), 2);
    connect(&mut sim, seed);
    sim.engine(1).set_limits(efa::proto::engine::EngineLimits {
        max_buffered_bytes: 10_000,
        ..Default::default()
    });
    let a1 = sim.addr(1);
    // Locked "for ever" (until released below).
    mems[1].busy.store(u32::MAX, Ordering::Relaxed);
    let n = 8u64;
    for k in 0..n {
        let data = pattern(seed ^ k, 3000);
        let addr = TBASE + k * 4096;
        sim.rma(0, write_op(a1, addr, data, None, k))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    sim.run_for(Duration::from_millis(5));
    let refused: Vec<RmaDone> = events(&mut sim, 0).rmas;
    assert!(!refused.is_empty(), "seed {seed}: some refused");
    for d in &refused {
        assert_eq!(d.status, Some(Status::RemoteAbort), "seed {seed}: {d:?}");
    }
    mems[1].busy.store(0, Ordering::Relaxed);
    assert!(sim.run(), "seed {seed}");
    let done = events(&mut sim, 0).rmas;
    assert_eq!(
        done.len() + refused.len(),
        n as usize,
        "seed {seed}: each once"
    );
    let m = mems[1].bytes(TKEY);
    for d in &done {
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
        let k = d.context;
        let a = (k * 4096) as usize;
        assert_eq!(&m[a..a + 3000], &pattern(seed ^ k, 3000)[..], "seed {seed}");
    }
    baseline(&mut sim, seed);
}
