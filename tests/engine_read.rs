//! Device RDMA and the read-based protocols in the simulator: device RMA write/read (split at
//! `max_rdma_size`, immediate data, bad keys, a target that never polls), the HANDSHAKE bits
//! and what they allow, RMA before the HANDSHAKE, long-read / runting-read / long-CTS messages
//! chosen by thresholds, READ_NACK fallbacks, LONGREAD_RTW, close and peer failure. Seeds come
//! from `EFA_TEST_SEED` (printed in every assertion message).
//!
//! Where an operation must be emulated these tests mostly check that it did not go to the
//! device and completed once (or was refused at once); the emulation's long-CTS protocols have
//! their own tests (`engine_read/longcts.rs`), the eager ones are in
//! `emulated_writes_reads_and_atomics_under_faults`.

use bytes::{Bytes, BytesMut};
use efa::atomic::AtomicArgs;
use efa::device::{RemoteIov, Source, Status};
use efa::fault::{Rng, test_seed};
use efa::proto::engine::{
    Event, RecvDone, RemoteWriteDone, Resources, RmaBuf, RmaDone, RmaKind, RmaMemory, RmaOp,
    RmaPath, SendDone, SendOp, TransmitKind,
};
use efa::proto::sim::{Sim, SimConfig, pattern, recv_op, send_op};
use efa::proto::wire::{self, ExtraFeature, ExtraInfo, Handshake, Packet, PacketType};
use efa::{AtomicOp, AtomicType, Error, ErrorKind, RawAddr};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[path = "engine_read/counting.rs"]
mod counting;
#[path = "engine_read/longcts.rs"]
mod longcts;
#[path = "engine_read/region_send.rs"]
mod region_send;

// ---- a registered memory for the simulated nodes ----

#[derive(Debug)]
struct Region {
    base: u64,
    data: Vec<u8>,
    read: bool,
    write: bool,
}

/// Regions by key, checked like a NIC checks them (key, bounds, rights).
#[derive(Debug, Default)]
struct Mem {
    regions: Mutex<HashMap<u64, Region>>,
    /// The next this many non-empty writes find the region locked by the application (`Again`).
    busy: AtomicU32,
    /// Bytes read so far (by the device's RDMA reads and the engine's).
    read_bytes: AtomicU64,
}

fn refused(why: &'static str) -> Error {
    Error::new(ErrorKind::RemoteAccess, "mem").with_detail(why)
}

impl Mem {
    fn add(&self, key: u64, base: u64, data: Vec<u8>, read: bool, write: bool) {
        let r = Region {
            base,
            data,
            read,
            write,
        };
        self.regions.lock().unwrap().insert(key, r);
    }

    fn remove(&self, key: u64) {
        self.regions.lock().unwrap().remove(&key);
    }

    fn bytes(&self, key: u64) -> Vec<u8> {
        self.regions.lock().unwrap()[&key].data.clone()
    }

    fn range(r: &Region, addr: u64, len: u64) -> efa::Result<(usize, usize)> {
        let off = addr.checked_sub(r.base).ok_or_else(|| refused("below"))?;
        let end = off.checked_add(len).ok_or_else(|| refused("overflow"))?;
        if end > r.data.len() as u64 {
            return Err(refused("beyond"));
        }
        Ok((off as usize, end as usize))
    }
}

impl RmaMemory for Mem {
    fn write(&self, key: u64, addr: u64, data: &[u8]) -> efa::Result<()> {
        let busy = self.busy.load(Ordering::Relaxed);
        if !data.is_empty() && busy > 0 {
            self.busy.store(busy - 1, Ordering::Relaxed);
            return Err(Error::new(ErrorKind::Again, "mem"));
        }
        let mut g = self.regions.lock().unwrap();
        let r = g.get_mut(&key).ok_or_else(|| refused("key"))?;
        if !r.write {
            return Err(refused("no write right"));
        }
        let (a, b) = Mem::range(r, addr, data.len() as u64)?;
        r.data[a..b].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, key: u64, addr: u64, len: u64) -> efa::Result<Bytes> {
        let g = self.regions.lock().unwrap();
        let r = g.get(&key).ok_or_else(|| refused("key"))?;
        if !r.read {
            return Err(refused("no read right"));
        }
        let (a, b) = Mem::range(r, addr, len)?;
        self.read_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(Bytes::copy_from_slice(&r.data[a..b]))
    }

    fn check(&self, key: u64, addr: u64, len: u64, write: bool) -> efa::Result<()> {
        let g = self.regions.lock().unwrap();
        let r = g.get(&key).ok_or_else(|| refused("key"))?;
        if !(if write { r.write } else { r.read }) {
            return Err(refused("right not granted"));
        }
        Mem::range(r, addr, len).map(|_| ())
    }

    fn atomic(&self, key: u64, addr: u64, x: AtomicArgs<'_>) -> efa::Result<Bytes> {
        let mut g = self.regions.lock().unwrap();
        let r = g.get_mut(&key).ok_or_else(|| refused("key"))?;
        if !r.write {
            return Err(refused("no write right"));
        }
        let (a, b) = Mem::range(r, addr, x.operand.len() as u64)?;
        let old = Bytes::copy_from_slice(&r.data[a..b]);
        efa::atomic::apply(x.op, x.datatype, &mut r.data[a..b], x.operand, x.compare)?;
        Ok(old)
    }
}

// ---- set-up ----

/// Target region of node 1: key, base address, size.
const TKEY: u64 = 0x7a;
const TBASE: u64 = 0x10_0000;
const TLEN: usize = 4 << 20;
/// Source regions of node 0 (registered send / write buffers): key `SKEY + n`.
const SKEY: u64 = 0x5000;
const SBASE: u64 = 0x800_0000;

/// Two nodes; node `i` has RDMA read `caps[i].0` and write `caps[i].1`; both have memory, node
/// 1 the writable and readable region `TKEY`.
fn two(mut c: SimConfig, caps: [(bool, bool); 2]) -> (Sim, [Arc<Mem>; 2]) {
    if c.engine.max_rdma_size == 0 {
        c.engine.max_rdma_size = 1 << 20;
    }
    let mut sim = Sim::new(c.clone(), 0);
    for (r, w) in caps {
        let mut e = c.engine.clone();
        e.device_rdma_read = r;
        e.device_rdma_write = w;
        sim.add_node(e);
    }
    let mems = [Arc::new(Mem::default()), Arc::new(Mem::default())];
    for (i, m) in mems.iter().enumerate() {
        sim.set_device_memory(i, m.clone());
    }
    mems[1].add(TKEY, TBASE, vec![0; TLEN], true, true);
    sim.set_tap(true);
    (sim, mems)
}

fn all(c: SimConfig) -> (Sim, [Arc<Mem>; 2]) {
    two(c, [(true, true); 2])
}

/// Exchanges a message each way, so that both HANDSHAKEs are in.
fn connect(sim: &mut Sim, seed: u64) {
    for (a, b) in [(0, 1), (1, 0)] {
        sim.post_recv(b, recv_op(16, 900)).unwrap();
        let dest = sim.addr(b);
        sim.send(a, send_op(dest, Bytes::from_static(b"hi"), 901))
            .unwrap();
    }
    assert!(sim.run(), "seed {seed}");
    for i in 0..2 {
        let ev = sim.take_events(i);
        assert_eq!(ev.len(), 2, "seed {seed}: {ev:?}");
    }
    sim.take_tap();
}

fn write_op(dest: RawAddr, addr: u64, data: Bytes, imm: Option<u32>, context: u64) -> RmaOp {
    RmaOp {
        dest,
        remote: RemoteIov {
            addr,
            len: data.len() as u64,
            key: TKEY,
        },
        kind: RmaKind::Write {
            buf: data,
            data: imm,
        },
        local_key: None,
        delivery_complete: false,
        context,
        local_region: None,
    }
}

fn read_op(dest: RawAddr, addr: u64, len: usize, context: u64) -> RmaOp {
    RmaOp {
        dest,
        remote: RemoteIov {
            addr,
            len: len as u64,
            key: TKEY,
        },
        kind: RmaKind::Read {
            buf: BytesMut::with_capacity(len),
        },
        local_key: None,
        delivery_complete: false,
        context,
        local_region: None,
    }
}

#[derive(Debug, Default)]
struct Events {
    sends: Vec<SendDone>,
    recvs: Vec<RecvDone>,
    rmas: Vec<RmaDone>,
    writes: Vec<RemoteWriteDone>,
}

fn events(sim: &mut Sim, i: usize) -> Events {
    let mut e = Events::default();
    for ev in sim.take_events(i) {
        match ev {
            Event::Send(x) => e.sends.push(x),
            Event::Recv(x) => e.recvs.push(x),
            Event::Rma(x) => e.rmas.push(x),
            Event::RemoteWrite(x) => e.writes.push(x),
        }
    }
    e
}

/// Runs `op` on node `i`: refused at once (its error kind) or its one completion.
fn run_rma(sim: &mut Sim, i: usize, op: RmaOp, seed: u64) -> Result<RmaDone, ErrorKind> {
    let ctx = op.context;
    if let Err((e, _)) = sim.rma(i, op) {
        return Err(e.kind());
    }
    assert!(sim.run(), "seed {seed}");
    let mut ev = events(sim, i);
    assert_eq!(ev.rmas.len(), 1, "seed {seed}: one completion");
    let d = ev.rmas.pop().unwrap();
    assert_eq!(d.context, ctx, "seed {seed}");
    Ok(d)
}

/// The operation did not go to the device, and ended once (emulated, or refused by an engine
/// without the emulation).
fn assert_not_device(out: Result<RmaDone, ErrorKind>, rdma_before: u64, sim: &Sim, seed: u64) {
    match out {
        Ok(d) => assert_eq!(d.path, RmaPath::Emulated, "seed {seed}: {d:?}"),
        Err(k) => assert_eq!(k, ErrorKind::NotSupported, "seed {seed}"),
    }
    assert_eq!(sim.stats.rdma_ops, rdma_before, "seed {seed}: no RDMA");
}

fn packet_types(sim: &mut Sim) -> HashMap<PacketType, usize> {
    let mut m = HashMap::new();
    for d in sim.take_tap() {
        let (p, _) = wire::decode(&d.bytes).expect("engine packets decode");
        *m.entry(p.packet_type()).or_insert(0) += 1;
    }
    m
}

fn count(m: &HashMap<PacketType, usize>, t: PacketType) -> usize {
    m.get(&t).copied().unwrap_or(0)
}

fn baseline(sim: &mut Sim, seed: u64) {
    for i in 0..sim.len() {
        assert_eq!(
            sim.engine(i).resources(),
            Resources {
                peers: 1,
                ..Default::default()
            },
            "seed {seed}: node {i}"
        );
    }
}

// ---- HANDSHAKE ----

#[test]
fn handshake_advertises_what_the_device_and_config_allow() {
    let seed = test_seed();
    for (r, w, unsol) in [
        (false, false, false),
        (true, false, false),
        (false, true, false),
        (true, true, true),
    ] {
        let (mut sim, _) = two(SimConfig::clean(seed), [(r, w), (false, false)]);
        sim.engine(0).set_unsolicited_write_recv(unsol);
        connect(&mut sim, seed);
        sim.set_tap(true);
        // A fresh peer: node 0 restarts its view by a new node 2 talking to it.
        let mut e = sim.engine(0).config().clone();
        e.device_rdma_read = false;
        let n2 = sim.add_node(e);
        sim.post_recv(0, recv_op(8, 1)).unwrap();
        let a0 = sim.addr(0);
        sim.send(n2, send_op(a0, Bytes::from_static(b"x"), 2))
            .unwrap();
        assert!(sim.run(), "seed {seed}");
        let hs: Vec<Handshake> = sim
            .take_tap()
            .iter()
            .filter(|d| d.from == 0)
            .filter_map(|d| match wire::decode(&d.bytes).unwrap().0 {
                Packet::Handshake(h) => Some(h),
                _ => None,
            })
            .collect();
        assert_eq!(hs.len(), 1, "seed {seed}");
        let f = hs[0].extra_info;
        assert_eq!(f.has(ExtraFeature::RdmaRead), r, "seed {seed}");
        assert_eq!(f.has(ExtraFeature::RdmaWrite), w, "seed {seed}");
        assert_eq!(f.has(ExtraFeature::UnsolicitedWriteRecv), w && unsol);
        for b in [
            ExtraFeature::DeliveryComplete,
            ExtraFeature::RequestConnidHeader,
            ExtraFeature::Runt,
            ExtraFeature::ReadNack,
        ] {
            assert!(f.has(b), "seed {seed}: {b:?}");
        }
        assert!(!f.has(ExtraFeature::PeerError), "not implemented");
        assert_eq!(hs[0].p2p, Some(true), "host memory is always reachable");
    }
}

#[test]
fn device_rdma_only_when_both_sides_advertise_it() {
    let seed = test_seed();
    let bools = [false, true];
    for r0 in bools {
        for w0 in bools {
            for r1 in bools {
                for w1 in bools {
                    let caps = [(r0, w0), (r1, w1)];
                    let (mut sim, mems) = two(SimConfig::clean(seed), caps);
                    connect(&mut sim, seed);
                    let a1 = sim.addr(1);
                    let data = pattern(seed, 5000);
                    let before = sim.stats.rdma_ops;
                    let out = run_rma(
                        &mut sim,
                        0,
                        write_op(a1, TBASE, data.clone(), None, 1),
                        seed,
                    );
                    if w0 && w1 {
                        let d = out.unwrap();
                        assert!(d.error.is_none(), "seed {seed} {caps:?}: {d:?}");
                        assert_eq!(d.path, RmaPath::Device);
                        assert_eq!(&mems[1].bytes(TKEY)[..5000], &data[..], "seed {seed}");
                    } else {
                        assert_not_device(out, before, &sim, seed);
                    }
                    let before = sim.stats.rdma_ops;
                    let out = run_rma(&mut sim, 0, read_op(a1, TBASE, 5000, 2), seed);
                    if r0 && r1 {
                        let d = out.unwrap();
                        assert!(d.error.is_none(), "seed {seed} {caps:?}: {d:?}");
                        assert_eq!(d.path, RmaPath::Device);
                    } else {
                        assert_not_device(out, before, &sim, seed);
                    }
                    // Atomics are always emulated.
                    let before = sim.stats.rdma_ops;
                    let op = RmaOp {
                        dest: a1,
                        remote: RemoteIov {
                            addr: TBASE,
                            len: 8,
                            key: TKEY,
                        },
                        kind: RmaKind::Atomic {
                            op: AtomicOp::Sum,
                            datatype: AtomicType::U64,
                            operand: Bytes::from_static(&[1, 0, 0, 0, 0, 0, 0, 0]),
                            compare: None,
                            fetch: None,
                        },
                        local_key: None,
                        delivery_complete: false,
                        context: 3,
                        local_region: None,
                    };
                    assert_not_device(run_rma(&mut sim, 0, op, seed), before, &sim, seed);
                }
            }
        }
    }
}

#[test]
fn handshake_mismatch_goes_emulated() {
    let seed = test_seed();
    // Node 1 claims RDMA write but no p2p, then unsolicited write-recv that differs from ours.
    let (mut sim, _) = all(SimConfig::clean(seed));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let src1 = sim.source(1);
    let fake = |p2p: bool, unsolicited: bool| {
        let mut f = ExtraInfo::with_features(&[
            ExtraFeature::RdmaRead,
            ExtraFeature::RdmaWrite,
            ExtraFeature::DeliveryComplete,
        ]);
        if unsolicited {
            f.set(ExtraFeature::UnsolicitedWriteRecv);
        }
        Packet::Handshake(Handshake {
            extra_info: f,
            connid: Some(a1.qkey),
            host_id: None,
            device_version: None,
            user_recv_qp: None,
            p2p: Some(p2p),
        })
        .to_vec(&[])
        .unwrap()
    };
    sim.inject(0, src1, &fake(false, false));
    let before = sim.stats.rdma_ops;
    let out = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(1, 100), None, 1),
        seed,
    );
    assert_not_device(out, before, &sim, seed);
    // p2p again, but a write with immediate data needs equal unsolicited write-recv.
    sim.inject(0, src1, &fake(true, true));
    let before = sim.stats.rdma_ops;
    let out = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(1, 100), Some(7), 2),
        seed,
    );
    assert_not_device(out, before, &sim, seed);
    // Without immediate data the device is used.
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(1, 100), None, 3),
        seed,
    )
    .unwrap();
    assert_eq!(
        (d.path, d.error.is_none()),
        (RmaPath::Device, true),
        "seed {seed}"
    );
    // With the same setting on both sides, immediate data goes to the device too.
    sim.engine(0).set_unsolicited_write_recv(true);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(1, 100), Some(8), 4),
        seed,
    )
    .unwrap();
    assert_eq!(
        (d.path, d.error.is_none()),
        (RmaPath::Device, true),
        "seed {seed}"
    );
    // The emulated write with immediate data 7 and the device one with 8 each arrived once.
    let mut w: Vec<_> = events(&mut sim, 1)
        .writes
        .iter()
        .map(|w| (w.data, w.len, w.src))
        .collect();
    w.sort_unstable_by_key(|x| x.0);
    assert_eq!(
        w,
        vec![(7, 100, sim.addr(0)), (8, 100, sim.addr(0))],
        "seed {seed}"
    );
}

// ---- device RMA ----

#[test]
fn rma_before_the_handshake_waits_for_it() {
    let seed = test_seed();
    let (mut sim, mems) = all(SimConfig::clean(seed));
    let a1 = sim.addr(1);
    // Node 1 does not answer yet: operations wait (16 at most), the 17th is Again.
    sim.freeze(1, true);
    for k in 0..16u64 {
        let op = write_op(a1, TBASE + k * 100, pattern(k, 100), None, k);
        sim.rma(0, op).unwrap();
    }
    let (e, op) = sim
        .rma(0, write_op(a1, TBASE, pattern(99, 100), None, 99))
        .unwrap_err();
    assert_eq!(
        (e.kind(), op.context),
        (ErrorKind::Again, 99),
        "seed {seed}"
    );
    sim.run();
    assert_eq!(
        sim.stats.rdma_ops, 0,
        "seed {seed}: nothing before the handshake"
    );
    assert!(events(&mut sim, 0).rmas.is_empty(), "seed {seed}");
    // What went out: one 0-byte EAGER_RTW with our raw address (the trigger).
    let tap = sim.take_tap();
    assert_eq!(tap.len(), 1, "seed {seed}: {tap:?}");
    match wire::decode(&tap[0].bytes).unwrap() {
        (Packet::EagerRtw { opt, rma_iov, .. }, data) => {
            assert!(rma_iov.is_empty() && data.is_empty(), "seed {seed}");
            assert_eq!(opt.connid(), Some(sim.addr(0).qkey));
        }
        (p, _) => panic!("seed {seed}: {p:?}"),
    }
    sim.freeze(1, false);
    assert!(sim.run(), "seed {seed}");
    let ev = events(&mut sim, 0);
    assert_eq!(ev.rmas.len(), 16, "seed {seed}");
    let mut ctx: Vec<u64> = ev.rmas.iter().map(|d| d.context).collect();
    ctx.sort_unstable();
    assert_eq!(ctx, (0..16).collect::<Vec<_>>(), "seed {seed}");
    for d in &ev.rmas {
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
        assert_eq!(d.path, RmaPath::Device, "seed {seed}");
    }
    let m = mems[1].bytes(TKEY);
    for k in 0..16u64 {
        let a = (k * 100) as usize;
        assert_eq!(&m[a..a + 100], &pattern(k, 100)[..], "seed {seed}");
    }
    // The trigger made no completion at the target.
    assert!(events(&mut sim, 1).writes.is_empty(), "seed {seed}");
    assert_eq!(sim.engine(1).stats().dropped_pkts, 0, "seed {seed}");
    baseline(&mut sim, seed);
}

#[test]
fn writes_and_reads_split_at_max_rdma_size() {
    let seed = test_seed();
    let mut c = SimConfig::clean(seed);
    c.engine.max_outstanding_tx = 3;
    c.engine.max_rdma_size = 4096;
    let (mut sim, mems) = all(c);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    for (k, len) in [0usize, 1, 4095, 4096, 4097, 10_000, 3 * 4096]
        .into_iter()
        .enumerate()
    {
        let pieces = len.div_ceil(4096).max(1) as u64;
        let addr = TBASE + 20_000 * k as u64;
        let data = pattern(seed ^ k as u64, len);
        let before = sim.stats.rdma_ops;
        let d = run_rma(
            &mut sim,
            0,
            write_op(a1, addr, data.clone(), Some(k as u32), 1),
            seed,
        )
        .unwrap();
        assert!(d.error.is_none(), "seed {seed} len {len}: {d:?}");
        assert_eq!((d.len, d.path), (len, RmaPath::Device), "seed {seed}");
        assert_eq!(sim.stats.rdma_ops - before, pieces, "seed {seed} len {len}");
        let w = events(&mut sim, 1).writes;
        assert_eq!(w.len(), 1, "seed {seed} len {len}: one event per write");
        let last = if len == 0 {
            0
        } else {
            len - (pieces as usize - 1) * 4096
        };
        assert_eq!((w[0].data, w[0].len), (k as u32, last), "seed {seed}");
        let a = addr as usize - TBASE as usize;
        assert_eq!(&mems[1].bytes(TKEY)[a..a + len], &data[..], "seed {seed}");
        let before = sim.stats.rdma_ops;
        let d = run_rma(&mut sim, 0, read_op(a1, addr, len, 2), seed).unwrap();
        assert!(d.error.is_none(), "seed {seed} len {len}: {d:?}");
        assert_eq!(sim.stats.rdma_ops - before, pieces, "seed {seed} len {len}");
        let RmaBuf::Read(b) = d.buf else {
            panic!("seed {seed}")
        };
        assert_eq!(&b[..], &data[..], "seed {seed} len {len}");
        assert!(
            b.capacity() >= len,
            "seed {seed}: the buffer comes back whole"
        );
    }
    assert_eq!(sim.stats.over_depth, 0, "seed {seed}: max_outstanding_tx");
    let st = sim.engine(0).stats();
    let total: usize = [0usize, 1, 4095, 4096, 4097, 10_000, 3 * 4096].iter().sum();
    assert_eq!(st.device_rma_bytes, 2 * total as u64, "seed {seed}");
    baseline(&mut sim, seed);
}

/// The local side in a region (`RmaOp::local_region`): with device RDMA on both sides the
/// writes read the region and the reads land in it (`RmaBuf::InRegion`, no buffer of their
/// own), split at `max_rdma_size`, under loss and reordering; towards a peer without the
/// device operation the engine copies the region's bytes out (writes) or gives the read a
/// buffer (the endpoint copies it into the region), and the data is the same.
#[test]
fn region_rdma_moves_data_straight_between_regions() {
    use efa::mem::{RegionMem, RegionSlice};
    let base = test_seed();
    for k in 0..3u64 {
        let seed = base.wrapping_add(k);
        for peer_caps in [(true, true), (false, false)] {
            let mut c = SimConfig::faulty(seed);
            c.engine.max_rdma_size = 4096;
            let (mut sim, mems) = two(c, [(true, true), peer_caps]);
            connect(&mut sim, seed);
            let a1 = sim.addr(1);
            let device = peer_caps.0;
            for (j, len) in [1usize, 4096, 10_000].into_iter().enumerate() {
                let data = pattern(seed ^ j as u64, len);
                let src = RegionMem::new(BytesMut::from(&data[..]));
                let slice = RegionSlice {
                    key: 7,
                    addr: src.addr(),
                    len,
                    mem: src.clone(),
                };
                let addr = TBASE + 20_000 * j as u64;
                let mut op = write_op(a1, addr, Bytes::new(), None, 1);
                op.remote.len = len as u64;
                op.local_region = Some(slice);
                let d = run_rma(&mut sim, 0, op, seed).unwrap();
                assert!(d.error.is_none(), "seed {seed} len {len}: {d:?}");
                let path = if device {
                    RmaPath::Device
                } else {
                    RmaPath::Emulated
                };
                assert_eq!((d.len, d.path), (len, path), "seed {seed} len {len}");
                let a = addr as usize - TBASE as usize;
                assert_eq!(&mems[1].bytes(TKEY)[a..a + len], &data[..], "seed {seed}");
                // Read it back into (the middle of) another region.
                let dst = RegionMem::new(BytesMut::zeroed(len + 64));
                let into = RegionSlice {
                    key: 8,
                    addr: dst.addr() + 32,
                    len,
                    mem: dst.clone(),
                };
                let mut op = read_op(a1, addr, len, 2);
                op.kind = RmaKind::Read {
                    buf: BytesMut::new(),
                };
                op.local_region = Some(into);
                let d = run_rma(&mut sim, 0, op, seed).unwrap();
                assert!(d.error.is_none(), "seed {seed} len {len}: {d:?}");
                let mut got = BytesMut::new();
                if device {
                    assert!(matches!(d.buf, RmaBuf::InRegion), "seed {seed}: {d:?}");
                    dst.read_into(dst.addr(), (len + 64) as u64, &mut got)
                        .unwrap();
                    assert_eq!(&got[32..32 + len], &data[..], "seed {seed} len {len}");
                    assert!(got[..32].iter().chain(&got[32 + len..]).all(|&b| b == 0));
                } else {
                    let RmaBuf::Read(b) = d.buf else {
                        panic!("seed {seed}: {d:?}")
                    };
                    assert_eq!(&b[..], &data[..], "seed {seed} len {len}");
                }
            }
            baseline(&mut sim, seed);
        }
    }
}

#[test]
fn writes_with_immediate_data_give_exactly_one_event_each_under_faults() {
    let base = test_seed();
    for k in 0..4u64 {
        let seed = base.wrapping_add(k);
        let mut c = SimConfig::faulty(seed);
        c.engine.max_outstanding_tx = 16;
        c.engine.max_rdma_size = 2048;
        let (mut sim, mems) = all(c);
        connect(&mut sim, seed);
        let a1 = sim.addr(1);
        let mut rng = Rng::new(seed);
        const N: u32 = 150;
        const SLOT: usize = 8192;
        let datas: Vec<Bytes> = (0..N)
            .map(|i| pattern(seed ^ u64::from(i), 1 + rng.below(3 * 2048) as usize))
            .collect();
        let mut next = 0u32;
        let mut seen = HashSet::new();
        let mut done = 0;
        let mem1 = mems[1].clone();
        let ok = sim.run_until(|sim| {
            while next < N {
                let i = next as usize;
                let op = write_op(
                    a1,
                    TBASE + (i * SLOT) as u64,
                    datas[i].clone(),
                    Some(next),
                    u64::from(next),
                );
                match sim.rma(0, op) {
                    Ok(()) => next += 1,
                    Err((e, _)) => {
                        assert_eq!(e.kind(), ErrorKind::Again, "seed {seed}");
                        break;
                    }
                }
            }
            let ev = events(sim, 1);
            let m = mem1.bytes(TKEY);
            for w in ev.writes {
                let i = w.data as usize;
                assert!(seen.insert(w.data), "seed {seed}: write {i} reported twice");
                // All of the write is in place when its event comes.
                let a = i * SLOT;
                assert!(
                    m[a..a + datas[i].len()] == datas[i][..],
                    "seed {seed}: write {i} not all in place at its event"
                );
            }
            for d in events(sim, 0).rmas {
                assert!(d.error.is_none(), "seed {seed}: {d:?}");
                assert_eq!(d.path, RmaPath::Device, "seed {seed}");
                done += 1;
            }
            done == N && seen.len() == N as usize
        });
        assert!(ok, "seed {seed}: {done} done, {} events", seen.len());
        assert!(sim.run(), "seed {seed}");
        assert!(
            events(&mut sim, 1).writes.is_empty(),
            "seed {seed}: no extra event"
        );
        assert!(sim.stats.lost > 0, "seed {seed}: faults happened");
        baseline(&mut sim, seed);
    }
}

#[test]
fn bad_keys_are_refused_and_touch_nothing() {
    let seed = test_seed();
    let (mut sim, mems) = all(SimConfig::clean(seed));
    mems[1].add(TKEY + 1, 0x9000, vec![7; 100], true, false);
    mems[1].add(TKEY + 2, 0xa000, vec![8; 100], false, true);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let before = mems[1].bytes(TKEY);
    let cases: Vec<(RmaOp, &str)> = vec![
        (
            {
                let mut op = write_op(a1, TBASE, pattern(1, 64), Some(1), 1);
                op.remote.key = 0xdead;
                op
            },
            "unknown key",
        ),
        (
            write_op(a1, TBASE + TLEN as u64 - 10, pattern(1, 64), None, 2),
            "beyond the region",
        ),
        (write_op(a1, TBASE - 8, pattern(1, 64), None, 3), "below"),
        (
            {
                let mut op = write_op(a1, 0x9000, pattern(1, 64), None, 4);
                op.remote.key = TKEY + 1;
                op
            },
            "read-only",
        ),
        (
            {
                let mut op = read_op(a1, 0xa000, 64, 5);
                op.remote.key = TKEY + 2;
                op
            },
            "write-only",
        ),
        (
            {
                let mut op = read_op(a1, TBASE, 64, 6);
                op.remote.key = 0xbeef;
                op
            },
            "read with an unknown key",
        ),
    ];
    for (op, what) in cases {
        let d = run_rma(&mut sim, 0, op, seed).unwrap();
        let e = d
            .error
            .as_ref()
            .unwrap_or_else(|| panic!("seed {seed}: {what}"));
        assert_eq!(e.kind(), ErrorKind::RemoteAccess, "seed {seed}: {what}");
        assert_eq!(
            d.status,
            Some(Status::RemoteBadAddress),
            "seed {seed}: {what}"
        );
        assert_eq!((d.len, d.path), (0, RmaPath::Device), "seed {seed}: {what}");
    }
    assert_eq!(mems[1].bytes(TKEY), before, "seed {seed}: target unchanged");
    assert_eq!(mems[1].bytes(TKEY + 1), vec![7; 100], "seed {seed}");
    assert!(
        events(&mut sim, 1).writes.is_empty(),
        "seed {seed}: no event"
    );
    assert_eq!(sim.engine(0).stats().errors, 6, "seed {seed}");
    assert_eq!(sim.engine(0).stats().device_rma_bytes, 0, "seed {seed}");
    // A write whose second piece is refused: the piece with immediate data is never posted.
    let mut c = SimConfig::clean(seed);
    c.engine.max_rdma_size = 64;
    let (mut sim, _) = all(c);
    connect(&mut sim, seed);
    let op = write_op(a1, TBASE + TLEN as u64 - 100, pattern(2, 192), Some(5), 7);
    let d = run_rma(&mut sim, 0, op, seed).unwrap();
    assert_eq!(d.status, Some(Status::RemoteBadAddress), "seed {seed}");
    assert!(events(&mut sim, 1).writes.is_empty(), "seed {seed}");
}

#[test]
fn device_rdma_completes_while_the_target_never_polls() {
    let seed = test_seed();
    let (mut sim, mems) = all(SimConfig::clean(seed));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    sim.freeze(1, true);
    let stats1 = sim.engine(1).stats();
    let res1 = sim.engine(1).resources();
    let data = pattern(seed, 3 << 20);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, data.clone(), None, 1),
        seed,
    )
    .unwrap();
    assert!(d.error.is_none(), "seed {seed}: {d:?}");
    let d = run_rma(&mut sim, 0, read_op(a1, TBASE + 5, 1 << 20, 2), seed).unwrap();
    let RmaBuf::Read(b) = d.buf else { panic!() };
    assert_eq!(&b[..], &data[5..5 + (1 << 20)], "seed {seed}");
    // A write with immediate data completes at the initiator; the target's completion waits
    // for its application.
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, pattern(3, 10), Some(9), 3),
        seed,
    )
    .unwrap();
    assert!(d.error.is_none(), "seed {seed}");
    assert_eq!(
        sim.engine(1).stats(),
        stats1,
        "seed {seed}: target engine untouched"
    );
    assert_eq!(sim.engine(1).resources(), res1, "seed {seed}");
    assert_eq!(
        &mems[1].bytes(TKEY)[..10],
        &pattern(3, 10)[..],
        "seed {seed}"
    );
    sim.freeze(1, false);
    assert!(sim.run(), "seed {seed}");
    let w = events(&mut sim, 1).writes;
    assert_eq!(w.len(), 1, "seed {seed}");
    assert_eq!(w[0].data, 9, "seed {seed}");
}

/// A target whose NIC dropped its AH for the initiator refuses the initiator's RDMA with
/// status 14 (EFA evicts AHs). The initiator introduces itself (a datagram with its raw
/// address, after which the target holds an AH again), backs off and posts the work requests
/// again: writes, writes with immediate data and reads complete once and intact, the peer is
/// not failed, and messages keep flowing (issue 16, defect 5).
#[test]
fn rdma_refused_for_want_of_an_ah_is_retried_after_an_introduction() {
    let seed = test_seed();
    let (mut sim, mems) = all(SimConfig::clean(seed));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let data = pattern(seed, 100_000);
    sim.forget_ah(1, 0);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, data.clone(), Some(5), 1),
        seed,
    )
    .unwrap();
    assert!(d.error.is_none(), "seed {seed}: {:?}", d.error);
    assert_eq!(d.path, RmaPath::Device, "seed {seed}");
    assert_eq!(&mems[1].bytes(TKEY)[..data.len()], &data[..], "seed {seed}");
    assert!(
        sim.stats.rdma_no_ah >= 1,
        "seed {seed}: the target refused first"
    );
    let w = events(&mut sim, 1).writes;
    assert_eq!(w.len(), 1, "seed {seed}: one write event");
    sim.forget_ah(1, 0);
    let before = sim.stats.rdma_no_ah;
    let d = run_rma(&mut sim, 0, read_op(a1, TBASE + 7, 5000, 2), seed).unwrap();
    assert!(d.error.is_none(), "seed {seed}: {:?}", d.error);
    let RmaBuf::Read(b) = d.buf else { panic!() };
    assert_eq!(&b[..], &data[7..5007], "seed {seed}");
    assert!(sim.stats.rdma_no_ah > before, "seed {seed}");
    // The peer lives on: a message each way.
    connect(&mut sim, seed);
}

#[test]
fn close_and_peer_failure_complete_device_rma_once() {
    let seed = test_seed();
    let mut c = SimConfig::clean(seed);
    c.engine.max_rdma_size = 1000;
    c.engine.max_outstanding_tx = 4;
    let (mut sim, _) = all(c);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    for k in 0..10u64 {
        let op = if k % 2 == 0 {
            write_op(a1, TBASE + k * 4000, pattern(k, 3500), Some(k as u32), k)
        } else {
            read_op(a1, TBASE + k * 4000, 3500, k)
        };
        sim.rma(0, op).unwrap();
    }
    sim.run_for(Duration::from_micros(3));
    let mid = events(&mut sim, 0).rmas;
    sim.engine(0).close();
    let mut after = events(&mut sim, 0).rmas;
    assert!(sim.run(), "seed {seed}");
    assert!(
        events(&mut sim, 0).rmas.is_empty(),
        "seed {seed}: nothing after close"
    );
    after.extend(mid);
    let mut ctx: Vec<u64> = after.iter().map(|d| d.context).collect();
    ctx.sort_unstable();
    assert_eq!(ctx, (0..10).collect::<Vec<_>>(), "seed {seed}: each once");
    assert!(
        after.iter().any(|d| d
            .error
            .as_ref()
            .is_some_and(|e| e.kind() == ErrorKind::Canceled)),
        "seed {seed}: some were in flight"
    );
    for d in &after {
        if let RmaBuf::Read(b) = &d.buf {
            if d.error.is_some() {
                assert!(b.is_empty(), "seed {seed}");
            }
        }
    }

    // Peer failure: the target vanishes; operations on the device and waiting for a
    // handshake fail once.
    let (mut sim, _) = all(SimConfig::clean(seed));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    sim.vanish(1);
    sim.rma(0, write_op(a1, TBASE, pattern(1, 100), None, 1))
        .unwrap();
    sim.rma(0, read_op(a1, TBASE, 100, 2)).unwrap();
    let mut c = SimConfig::clean(seed).engine;
    c.device_rdma_write = true;
    let n2 = sim.add_node(c);
    let a2 = sim.addr(n2);
    sim.vanish(n2);
    sim.rma(0, write_op(a2, TBASE, pattern(1, 100), None, 3))
        .unwrap();
    assert!(sim.run(), "seed {seed}");
    let ev = events(&mut sim, 0).rmas;
    let mut ctx: Vec<u64> = ev.iter().map(|d| d.context).collect();
    ctx.sort_unstable();
    assert_eq!(ctx, vec![1, 2, 3], "seed {seed}");
    for d in &ev {
        let e = d.error.as_ref().expect("failed");
        assert_eq!(e.kind(), ErrorKind::ConnectionAborted, "seed {seed}: {d:?}");
    }
    assert_eq!(sim.engine(0).resources().tx_ops, 0, "seed {seed}");
}

#[test]
fn invalid_rma_is_refused() {
    let seed = test_seed();
    let (mut sim, _) = all(SimConfig::clean(seed));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let mut op = write_op(a1, TBASE, pattern(1, 100), None, 1);
    op.remote.len = 99;
    let (e, _) = sim.rma(0, op).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "seed {seed}");
    let mut op = read_op(a1, TBASE, 100, 2);
    op.remote.len = 200;
    let (e, _) = sim.rma(0, op).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "seed {seed}");
    sim.engine(0).close();
    let (e, _) = sim.rma(0, read_op(a1, TBASE, 100, 3)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed, "seed {seed}");
}

// ---- read-based messages ----

/// Two nodes with RDMA read (no write), thresholds for the read protocols.
fn msg_sim(seed: u64, runt: usize, faulty: bool) -> (Sim, [Arc<Mem>; 2]) {
    let mut c = if faulty {
        SimConfig::faulty(seed)
    } else {
        SimConfig::clean(seed)
    };
    c.engine.inter_min_read_message_size = 100_000;
    c.engine.runt_size = runt;
    c.engine.inter_read_segment_size = 64 * 1024;
    let (mut sim, m) = two(c, [(true, false), (true, false)]);
    connect(&mut sim, seed);
    (sim, m)
}

/// A send of `len` pattern bytes from a registered buffer (key `SKEY + n`) of node 0.
fn reg_send(sim: &Sim, mem0: &Mem, n: u64, len: usize, seed: u64) -> (SendOp, Bytes) {
    let data = pattern(seed ^ (n << 20), len);
    let key = SKEY + n;
    mem0.add(key, SBASE, data.to_vec(), true, false);
    let mut op = send_op(sim.addr(1), data.clone(), n);
    op.read_key = Some((key, SBASE));
    (op, data)
}

fn check_msg(sim: &mut Sim, want: &[(u64, Bytes)], seed: u64) {
    let s = events(sim, 0).sends;
    let r = events(sim, 1).recvs;
    assert_eq!(s.len(), want.len(), "seed {seed}: {s:?}");
    assert_eq!(r.len(), want.len(), "seed {seed}");
    for d in &s {
        assert!(d.error.is_none(), "seed {seed}: {d:?}");
    }
    for (ctx, data) in want {
        let rd = r.iter().find(|x| x.context == *ctx).expect("received");
        assert!(rd.error.is_none(), "seed {seed}: {:?}", rd.error);
        assert_eq!(rd.len, data.len(), "seed {seed}");
        assert!(rd.buf[..] == data[..], "seed {seed}: message {ctx} intact");
    }
}

#[test]
fn protocol_by_size_key_and_handshake() {
    let seed = test_seed();
    // Long read (runt_size 0): one LONGREAD_RTM, the receiver reads in segments, EOR.
    let (mut sim, mems) = msg_sim(seed, 0, false);
    let (op, data) = reg_send(&sim, &mems[0], 1, 300_000, seed);
    sim.post_recv(1, recv_op(300_000, 1)).unwrap();
    let before = sim.stats.rdma_ops;
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongReadMsgRtm),
        1,
        "seed {seed}: {t:?}"
    );
    assert_eq!(count(&t, PacketType::Eor), 1, "seed {seed}");
    assert_eq!(
        sim.stats.rdma_ops - before,
        5,
        "seed {seed}: 64 KiB segments"
    );
    check_msg(&mut sim, &[(1, data)], seed);

    // Below the threshold, without a key, or tagged with delivery complete.
    let (op, data) = reg_send(&sim, &mems[0], 2, 99_999, seed);
    sim.post_recv(1, recv_op(100_000, 2)).unwrap();
    sim.send(0, op).unwrap();
    let (mut op3, data3) = reg_send(&sim, &mems[0], 3, 200_000, seed);
    op3.read_key = None;
    sim.post_recv(1, recv_op(200_000, 3)).unwrap();
    sim.send(0, op3).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongCtsMsgRtm),
        2,
        "seed {seed}: {t:?}"
    );
    assert_eq!(count(&t, PacketType::LongReadMsgRtm), 0, "seed {seed}");
    check_msg(&mut sim, &[(2, data), (3, data3)], seed);

    let (mut op, data) = reg_send(&sim, &mems[0], 4, 150_000, seed);
    op.tag = Some(0x44);
    op.delivery_complete = true;
    op.data = Some(77);
    let mut r = recv_op(150_000, 4);
    r.tag = Some((0x44, 0));
    sim.post_recv(1, r).unwrap();
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongReadTagRtm),
        1,
        "seed {seed}: {t:?}"
    );
    assert_eq!(
        count(&t, PacketType::Receipt),
        0,
        "seed {seed}: EOR is enough"
    );
    let r = events(&mut sim, 1).recvs;
    assert_eq!((r[0].tag, r[0].data), (Some(0x44), Some(77)), "seed {seed}");
    assert!(r[0].buf[..] == data[..], "seed {seed}");
    assert!(events(&mut sim, 0).sends[0].error.is_none(), "seed {seed}");

    // Before the handshake the size decides (long-CTS), even with a key.
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_message_size = 100_000;
    let (mut sim, mems) = two(c, [(true, false), (true, false)]);
    let (op, data) = reg_send(&sim, &mems[0], 5, 200_000, seed);
    sim.post_recv(1, recv_op(200_000, 5)).unwrap();
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongCtsMsgRtm),
        1,
        "seed {seed}: {t:?}"
    );
    check_msg(&mut sim, &[(5, data)], seed);

    // The receiver without RDMA read does not advertise it: long-CTS.
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_message_size = 100_000;
    let (mut sim, mems) = two(c, [(true, false), (false, false)]);
    connect(&mut sim, seed);
    let (op, data) = reg_send(&sim, &mems[0], 6, 200_000, seed);
    sim.post_recv(1, recv_op(200_000, 6)).unwrap();
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongCtsMsgRtm),
        1,
        "seed {seed}: {t:?}"
    );
    check_msg(&mut sim, &[(6, data)], seed);
}

#[test]
fn runting_read_and_long_read_by_runt_size_and_reads_in_flight() {
    let seed = test_seed();
    let (mut sim, mems) = msg_sim(seed, 20_004, false);
    // Runt 20_000 (aligned down to 8) in packets, the rest read; a second message while the
    // first reads is a long read (libfabric: runting only when no read message is in flight).
    let (op1, d1) = reg_send(&sim, &mems[0], 1, 300_000, seed);
    let (op2, d2) = reg_send(&sim, &mems[0], 2, 200_000, seed);
    sim.post_recv(1, recv_op(300_000, 1)).unwrap();
    sim.post_recv(1, recv_op(200_000, 2)).unwrap();
    sim.send(0, op1).unwrap();
    sim.send(0, op2).unwrap();
    assert!(sim.run(), "seed {seed}");
    let mut runt_bytes = 0;
    let mut t = HashMap::new();
    for d in sim.take_tap() {
        let (p, data) = wire::decode(&d.bytes).unwrap();
        if let Packet::RuntReadRtm { runt_length, .. } = p {
            assert_eq!(runt_length, 20_000, "seed {seed}");
            runt_bytes += data.len();
        }
        *t.entry(p.packet_type()).or_insert(0) += 1;
    }
    assert_eq!(runt_bytes, 20_000, "seed {seed}");
    assert_eq!(
        count(&t, PacketType::RuntReadMsgRtm),
        3,
        "seed {seed}: {t:?}"
    );
    assert_eq!(count(&t, PacketType::LongReadMsgRtm), 1, "seed {seed}");
    assert_eq!(count(&t, PacketType::Eor), 2, "seed {seed}");
    check_msg(&mut sim, &[(1, d1), (2, d2)], seed);

    // All of a message fits in the runt: no read, no EOR.
    let (mut sim, mems) = msg_sim(seed, 1 << 20, false);
    let (op, d) = reg_send(&sim, &mems[0], 3, 150_000, seed);
    sim.post_recv(1, recv_op(150_000, 3)).unwrap();
    let before = sim.stats.rdma_ops;
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(count(&t, PacketType::Eor), 0, "seed {seed}: {t:?}");
    assert!(count(&t, PacketType::RuntReadMsgRtm) >= 19, "seed {seed}");
    assert_eq!(sim.stats.rdma_ops, before, "seed {seed}");
    check_msg(&mut sim, &[(3, d)], seed);
    baseline(&mut sim, seed);
}

/// A receive into a region (`RecvOp::local_region`): the read part of long-read and runting-read
/// messages lands in the region (the completion says from where, `RecvDone::in_region`), the
/// runt and nothing else in the buffer; expected and unexpected, under faults. Where the message
/// is not read (it fits the runt, or long-CTS), everything is in the buffer and `in_region` is
/// `None`.
#[test]
fn read_messages_land_in_receive_regions() {
    use efa::mem::{RegionMem, RegionSlice};
    let base = test_seed();
    for k in 0..3u64 {
        let seed = base.wrapping_add(k);
        for runt in [0usize, 16_384] {
            let (mut sim, mems) = msg_sim(seed, runt, true);
            let mut rng = Rng::new(seed);
            let mut regions = Vec::new();
            for n in 0..6u64 {
                let len = if n == 5 {
                    50_000 // below the read threshold: eager/medium, all in the buffer
                } else {
                    100_000 + rng.below(300_000) as usize
                };
                let (op, d) = reg_send(&sim, &mems[0], n, len, seed);
                let mem = RegionMem::new(BytesMut::zeroed(len + 16));
                let mut r = recv_op(len + 16, n);
                r.local_region = Some(RegionSlice {
                    key: 40 + n,
                    addr: mem.addr(),
                    len: len + 16,
                    mem: mem.clone(),
                });
                if n % 2 == 0 {
                    sim.post_recv(1, r).unwrap();
                    sim.send(0, op).unwrap();
                } else {
                    sim.send(0, op).unwrap();
                    sim.run_for(Duration::from_millis(1));
                    sim.post_recv(1, r).unwrap();
                }
                regions.push((n, d, mem));
            }
            assert!(sim.run(), "seed {seed} runt {runt}");
            let recvs = events(&mut sim, 1).recvs;
            assert_eq!(recvs.len(), 6, "seed {seed} runt {runt}");
            for (n, d, mem) in &regions {
                let r = recvs.iter().find(|r| r.context == *n).unwrap();
                assert!(r.error.is_none(), "seed {seed}: {:?}", r.error);
                assert_eq!(r.len, d.len(), "seed {seed}");
                let mut got = BytesMut::new();
                mem.read_into(mem.addr(), d.len() as u64 + 16, &mut got)
                    .unwrap();
                match r.in_region {
                    Some(from) => {
                        assert!(*n < 5, "seed {seed}: message {n} was not read");
                        // A runting read, or a long read while another read is in flight.
                        assert!(from == 0 || from == runt / 8 * 8, "seed {seed} runt {runt}");
                        assert_eq!(
                            r.buf.len(),
                            from,
                            "seed {seed}: only the runt in the buffer"
                        );
                        assert!(r.buf[..] == d[..from], "seed {seed}: runt intact");
                        assert!(got[from..d.len()] == d[from..], "seed {seed}: read part");
                        assert!(got[..from].iter().all(|&b| b == 0), "seed {seed}");
                    }
                    None => {
                        assert_eq!(*n, 5, "seed {seed} runt {runt}: message {n} not in region");
                        assert!(r.buf[..] == d[..], "seed {seed}: all in the buffer");
                        assert!(got.iter().all(|&b| b == 0), "seed {seed}");
                    }
                }
                assert!(
                    got[d.len()..].iter().all(|&b| b == 0),
                    "seed {seed}: no overrun"
                );
            }
            let froms: Vec<usize> = recvs.iter().filter_map(|r| r.in_region).collect();
            assert_eq!(froms.len(), 5, "seed {seed} runt {runt}: {froms:?}");
            if runt > 0 {
                assert!(froms.iter().any(|&f| f > 0), "seed {seed}: a runting read");
            }
            assert_eq!(events(&mut sim, 0).sends.len(), 6, "seed {seed}");
            baseline(&mut sim, seed);
        }
    }
}

#[test]
fn read_messages_unexpected_truncated_and_under_faults() {
    let base = test_seed();
    for k in 0..3u64 {
        let seed = base.wrapping_add(k);
        for runt in [0, 16_384] {
            let (mut sim, mems) = msg_sim(seed, runt, true);
            let mut want = Vec::new();
            let mut rng = Rng::new(seed);
            // Half the receives are posted after the messages arrived (tagged: each message
            // finds its own buffer).
            let trecv = |len: usize, n: u64| {
                let mut r = recv_op(len, n);
                r.tag = Some((n, 0));
                r
            };
            for n in 0..8u64 {
                let len = 100_000 + rng.below(400_000) as usize;
                let (mut op, d) = reg_send(&sim, &mems[0], n, len, seed);
                op.tag = Some(n);
                if n % 2 == 0 {
                    sim.post_recv(1, trecv(len, n)).unwrap();
                }
                sim.send(0, op).unwrap();
                want.push((n, d));
            }
            sim.run_for(Duration::from_millis(1));
            for n in (1..8).step_by(2) {
                sim.post_recv(1, trecv(want[n].1.len(), n as u64)).unwrap();
            }
            assert!(sim.run(), "seed {seed} runt {runt}");
            let t = packet_types(&mut sim);
            let read_msgs = count(&t, PacketType::LongReadTagRtm)
                + usize::from(count(&t, PacketType::RuntReadTagRtm) > 0);
            assert!(read_msgs >= 4, "seed {seed} runt {runt}: {t:?}");
            assert_eq!(count(&t, PacketType::Eor), 8, "seed {seed} runt {runt}");
            assert!(sim.engine(1).stats().unexpected_msgs >= 4, "seed {seed}");
            check_msg(&mut sim, &want, seed);
            // Truncated: the receiver reads what fits, the sender completes normally.
            let (op, d) = reg_send(&sim, &mems[0], 9, 300_000, seed);
            sim.post_recv(1, recv_op(123_456, 9)).unwrap();
            sim.send(0, op).unwrap();
            assert!(sim.run(), "seed {seed}");
            let s = events(&mut sim, 0).sends;
            assert!(s[0].error.is_none(), "seed {seed}: {s:?}");
            let r = events(&mut sim, 1).recvs;
            let e = r[0].error.as_ref().expect("truncated");
            assert_eq!(e.kind(), ErrorKind::Truncated, "seed {seed}");
            assert_eq!((r[0].len, r[0].olen), (123_456, 300_000 - 123_456));
            assert!(r[0].buf[..] == d[..123_456], "seed {seed}");
            baseline(&mut sim, seed);
        }
    }
}

#[test]
fn read_nack_falls_back_to_long_cts() {
    let seed = test_seed();
    for (runt, dc) in [(0, false), (20_000, false), (0, true)] {
        // The sender's key is bad: the receiver's read fails, it NACKs, the rest is long-CTS.
        let (mut sim, mems) = msg_sim(seed, runt, false);
        let (mut op, d) = reg_send(&sim, &mems[0], 1, 250_000, seed);
        op.read_key = Some((0xbad, SBASE));
        op.delivery_complete = dc;
        sim.post_recv(1, recv_op(250_000, 1)).unwrap();
        sim.send(0, op).unwrap();
        assert!(sim.run(), "seed {seed}");
        let mut nack_req = 0;
        let mut t = HashMap::new();
        for dg in sim.take_tap() {
            let (p, data) = wire::decode(&dg.bytes).unwrap();
            if let Packet::LongCtsRtm { read_nack, .. } = p {
                assert!(read_nack && data.is_empty(), "seed {seed}");
                nack_req += 1;
            }
            *t.entry(p.packet_type()).or_insert(0) += 1;
        }
        assert_eq!(count(&t, PacketType::ReadNack), 1, "seed {seed}: {t:?}");
        assert_eq!(nack_req, 1, "seed {seed}: {t:?}");
        assert_eq!(count(&t, PacketType::Eor), 0, "seed {seed}");
        assert!(count(&t, PacketType::CtsData) > 0, "seed {seed}");
        assert_eq!(
            count(&t, PacketType::Receipt),
            usize::from(dc),
            "seed {seed}"
        );
        check_msg(&mut sim, &[(1, d)], seed);
        baseline(&mut sim, seed);
    }

    // The receiver has no RDMA read but the sender was told otherwise: NACK at once.
    let (mut sim, mems) = region_send::nack_sim(seed, 0);
    let (op, d) = reg_send(&sim, &mems[0], 2, 180_000, seed);
    sim.post_recv(1, recv_op(180_000, 2)).unwrap();
    let before = sim.stats.rdma_ops;
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    let t = packet_types(&mut sim);
    assert_eq!(
        count(&t, PacketType::LongReadMsgRtm),
        1,
        "seed {seed}: {t:?}"
    );
    assert_eq!(count(&t, PacketType::ReadNack), 1, "seed {seed}");
    assert_eq!(sim.stats.rdma_ops, before, "seed {seed}: nothing read");
    check_msg(&mut sim, &[(2, d)], seed);
}

// ---- LONGREAD_RTW ----

#[test]
fn long_writes_from_registered_buffers_are_read_by_the_target() {
    let seed = test_seed();
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_write_size = 65_536;
    c.engine.inter_read_segment_size = 100_000;
    let (mut sim, mems) = two(c, [(true, false), (true, false)]);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let data = pattern(seed, 2_500_000);
    mems[0].add(SKEY, SBASE, data.to_vec(), true, false);
    let mut op = write_op(a1, TBASE + 3, data.clone(), Some(0x1234), 1);
    op.local_key = Some((SKEY, SBASE));
    let before = sim.stats.rdma_ops;
    let d = run_rma(&mut sim, 0, op, seed).unwrap();
    assert!(d.error.is_none(), "seed {seed}: {d:?}");
    assert_eq!(
        (d.len, d.path),
        (data.len(), RmaPath::Emulated),
        "seed {seed}"
    );
    let reads = sim.stats.rdma_ops - before;
    assert_eq!(reads, 25, "seed {seed}: 100 000-byte reads");
    let t = packet_types(&mut sim);
    assert_eq!(count(&t, PacketType::LongReadRtw), 1, "seed {seed}: {t:?}");
    assert_eq!(count(&t, PacketType::Eor), 1, "seed {seed}");
    assert_eq!(
        &mems[1].bytes(TKEY)[3..3 + data.len()],
        &data[..],
        "seed {seed}"
    );
    let w = events(&mut sim, 1).writes;
    assert_eq!(w.len(), 1, "seed {seed}");
    assert_eq!(
        (w[0].data, w[0].len, w[0].src),
        (0x1234, data.len(), sim.addr(0))
    );
    assert_eq!(sim.engine(0).stats().emulated_rma_bytes, data.len() as u64);

    // Below the threshold or without a registered buffer: not LONGREAD_RTW.
    let mut op = write_op(a1, TBASE, pattern(1, 65_535), None, 2);
    op.local_key = Some((SKEY, SBASE));
    let before = sim.stats.rdma_ops;
    assert_not_device(run_rma(&mut sim, 0, op, seed), before, &sim, seed);
    let op = write_op(a1, TBASE, pattern(1, 100_000), None, 3);
    assert_not_device(run_rma(&mut sim, 0, op, seed), before, &sim, seed);
    assert_eq!(count(&packet_types(&mut sim), PacketType::LongReadRtw), 0);

    // A bad target key: the target NACKs before reading, the write is emulated (and refused
    // there); the target memory is unchanged.
    let before_mem = mems[1].bytes(TKEY);
    let mut op = write_op(a1, TBASE, data.slice(..100_000), None, 4);
    op.local_key = Some((SKEY, SBASE));
    op.remote.key = 0xdead;
    let before = sim.stats.rdma_ops;
    let out = run_rma(&mut sim, 0, op, seed);
    match out {
        Ok(d) => assert_eq!(d.path, RmaPath::Emulated, "seed {seed}"),
        Err(k) => panic!("seed {seed}: refused at once: {k:?}"),
    }
    assert_eq!(sim.stats.rdma_ops, before, "seed {seed}: nothing read");
    let t = packet_types(&mut sim);
    assert_eq!(count(&t, PacketType::ReadNack), 1, "seed {seed}: {t:?}");
    assert_eq!(mems[1].bytes(TKEY), before_mem, "seed {seed}");
    // A bad source key: the reads fail, NACK, emulated.
    let mut op = write_op(a1, TBASE, data.slice(..100_000), None, 5);
    op.local_key = Some((0xbad, SBASE));
    let out = run_rma(&mut sim, 0, op, seed);
    assert_eq!(
        out.map(|d| d.path).ok(),
        Some(RmaPath::Emulated),
        "seed {seed}"
    );
    assert_eq!(count(&packet_types(&mut sim), PacketType::ReadNack), 1);
}

// ---- robustness ----

#[test]
fn crafted_read_packets_never_harm() {
    use efa::Gid;
    use efa::proto::wire::{IovList, ReqOpt, Sender};
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    let (mut sim, mems) = msg_sim(seed, 16_384, false);
    let a0 = sim.addr(0);
    let src0 = sim.source(0);
    // A peer that exists only in these packets.
    let fake = RawAddr::new(Gid::from(std::net::Ipv4Addr::new(10, 9, 9, 9)), 4242, 77);
    let fsrc = Source {
        gid: fake.gid,
        qpn: fake.qpn,
    };
    let mut fake_next = 0u32;
    for round in 0..400u32 {
        let iovs = [
            RemoteIov {
                addr: rng.next_u64() % 4096,
                len: rng.below(1 << 20),
                key: if rng.chance(0.5) {
                    SKEY
                } else {
                    rng.next_u64()
                },
            },
            RemoteIov {
                addr: SBASE,
                len: rng.next_u64(),
                key: SKEY,
            },
        ];
        let n_iov = 1 + rng.below(2) as usize;
        let iov = IovList::new(&iovs[..n_iov]);
        let id = if rng.chance(0.5) {
            rng.below(8) as u32
        } else {
            rng.next_u64() as u32
        };
        let len = if rng.chance(0.5) {
            rng.below(400_000)
        } else {
            rng.next_u64()
        };
        let (opt, src) = if rng.chance(0.5) {
            let o = ReqOpt {
                sender: Sender::Connid(a0.qkey),
                cq_data: None,
            };
            (o, src0)
        } else {
            let o = ReqOpt {
                sender: Sender::RawAddr(fake),
                cq_data: Some(5),
            };
            (o, fsrc)
        };
        let connid = Some(opt.connid().unwrap_or(0));
        let mut msg_id = || {
            if src == fsrc {
                fake_next += 1;
                fake_next - 1
            } else {
                1000 + id
            }
        };
        let payload = pattern(u64::from(round), 1 + rng.below(300) as usize);
        let pkt = match rng.below(6) {
            0 => Packet::Eor {
                connid,
                send_id: id,
                recv_id: id,
            },
            1 => Packet::ReadNack {
                connid,
                send_id: id,
                recv_id: id,
            },
            2 => Packet::LongCtsRtm {
                opt,
                msg_id: id,
                msg_length: len,
                send_id: id,
                credit_request: 1,
                tag: None,
                dc: rng.chance(0.5),
                read_nack: true,
            },
            3 => Packet::LongReadRtw {
                opt,
                msg_length: len,
                send_id: id,
                rma_iov: IovList::new(&iovs[..1]),
                read_iov: iov,
            },
            // The fake peer's messages are well formed (so that its window moves and they are
            // matched and read: from nowhere), node 0's are garbage.
            4 if src == fsrc => Packet::RuntReadRtm {
                opt,
                msg_id: msg_id(),
                msg_length: payload.len() as u64 + rng.below(300_000),
                send_id: id,
                seg_offset: 0,
                runt_length: payload.len() as u64,
                tag: None,
                read_iov: iov,
            },
            4 => Packet::RuntReadRtm {
                opt,
                msg_id: msg_id(),
                msg_length: len,
                send_id: id,
                seg_offset: rng.below(400_000),
                runt_length: rng.below(400_000),
                tag: None,
                read_iov: iov,
            },
            _ => Packet::LongReadRtm {
                opt,
                msg_id: msg_id(),
                msg_length: if src == fsrc { len % 400_000 } else { len },
                send_id: id,
                tag: None,
                read_iov: iov,
            },
        };
        let long = matches!(pkt, Packet::LongReadRtm { .. });
        let data = if long && src == fsrc {
            &payload[..0]
        } else {
            &payload[..]
        };
        let bytes = pkt.to_vec(data).unwrap();
        sim.inject(1, src, &bytes);
        if round % 50 == 0 {
            sim.post_recv(
                1,
                recv_op(rng.below(300_000) as usize, 5000 + u64::from(round)),
            )
            .unwrap();
        }
        if round % 20 == 0 {
            sim.run_for(Duration::from_micros(50));
        }
    }
    assert!(sim.run(), "seed {seed}");
    assert!(sim.engine(1).stats().dropped_pkts > 0, "seed {seed}");
    let t = packet_types(&mut sim);
    assert!(count(&t, PacketType::ReadNack) > 0, "seed {seed}: {t:?}");
    // Crafted messages were processed (matched or unexpected), not only dropped.
    let fake_recvs = events(&mut sim, 1).recvs.len() as u64;
    assert!(
        sim.engine(1).stats().unexpected_msgs + fake_recvs > 0,
        "seed {seed}"
    );
    sim.take_events(0);
    // Real traffic still works (tagged, so that the crafted messages do not take it).
    let mut want = Vec::new();
    for n in 0..3u64 {
        let (mut op, d) = reg_send(&sim, &mems[0], 100 + n, 150_000 + 1000 * n as usize, seed);
        op.tag = Some(n);
        let mut r = recv_op(d.len(), 100 + n);
        r.tag = Some((n, 0));
        sim.post_recv(1, r).unwrap();
        sim.send(0, op).unwrap();
        want.push((100 + n, d));
    }
    assert!(sim.run(), "seed {seed}");
    let s = events(&mut sim, 0).sends;
    assert_eq!(s.len(), 3, "seed {seed}");
    assert!(s.iter().all(|d| d.error.is_none()), "seed {seed}: {s:?}");
    let r: Vec<RecvDone> = events(&mut sim, 1)
        .recvs
        .into_iter()
        .filter(|r| r.context >= 100 && r.context < 5000)
        .collect();
    for (ctx, d) in &want {
        let x = r.iter().find(|x| x.context == *ctx).expect("received");
        assert!(x.error.is_none() && x.buf[..] == d[..], "seed {seed}");
    }
}

#[test]
fn memory_locked_by_the_application_is_retried() {
    let seed = test_seed();
    let mut c = SimConfig::clean(seed);
    c.engine.inter_min_read_write_size = 65_536;
    c.engine.inter_read_segment_size = 50_000;
    let (mut sim, mems) = two(c, [(true, false), (true, false)]);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let data = pattern(seed, 300_000);
    mems[0].add(SKEY, SBASE, data.to_vec(), true, false);
    mems[1].busy.store(4, Ordering::Relaxed);
    let mut op = write_op(a1, TBASE, data.clone(), None, 1);
    op.local_key = Some((SKEY, SBASE));
    let d = run_rma(&mut sim, 0, op, seed).unwrap();
    assert!(d.error.is_none(), "seed {seed}: {d:?}");
    assert_eq!(
        mems[1].busy.load(Ordering::Relaxed),
        0,
        "seed {seed}: it was locked"
    );
    assert_eq!(&mems[1].bytes(TKEY)[..data.len()], &data[..], "seed {seed}");
    baseline(&mut sim, seed);
    // The same for a device write (the NIC waits).
    let (mut sim, mems) = all(SimConfig::clean(seed));
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    mems[1].busy.store(3, Ordering::Relaxed);
    let d = run_rma(
        &mut sim,
        0,
        write_op(a1, TBASE, data.clone(), None, 1),
        seed,
    )
    .unwrap();
    assert!(d.error.is_none(), "seed {seed}: {d:?}");
    assert_eq!(&mems[1].bytes(TKEY)[..data.len()], &data[..], "seed {seed}");
}

#[test]
fn a_receive_whose_reads_are_on_the_device_does_not_stall() {
    let seed = test_seed();
    let mut c = SimConfig::clean(seed);
    c.latency = Duration::from_micros(200);
    c.engine.rx_stall_timeout = Duration::from_micros(50);
    c.engine.inter_min_read_message_size = 100_000;
    c.engine.runt_size = 0;
    c.engine.max_outstanding_tx = 2;
    c.engine.inter_read_segment_size = 16_384;
    let (mut sim, mems) = two(c, [(true, false), (true, false)]);
    connect(&mut sim, seed);
    let (op, d) = reg_send(&sim, &mems[0], 1, 200_000, seed);
    sim.post_recv(1, recv_op(200_000, 1)).unwrap();
    sim.send(0, op).unwrap();
    assert!(sim.run(), "seed {seed}");
    check_msg(&mut sim, &[(1, d)], seed);
}

// ---- emulated RMA (no device RDMA on either side) ----

#[test]
fn emulated_writes_reads_and_atomics_under_faults() {
    let base = test_seed();
    for k in 0..4u64 {
        let seed = base.wrapping_add(k);
        let mut c = SimConfig::faulty(seed);
        c.engine.max_outstanding_tx = 16;
        let (mut sim, mems) = two(c, [(false, false); 2]);
        connect(&mut sim, seed);
        let a1 = sim.addr(1);
        let mut rng = Rng::new(seed);
        const N: u32 = 60;
        const SLOT: usize = 32 * 1024;
        // Up to three packets' worth (MTU 8192): eager and multi-packet trains.
        let datas: Vec<Bytes> = (0..N)
            .map(|i| pattern(seed ^ u64::from(i), 1 + rng.below(24_000) as usize))
            .collect();
        let mut next = 0u32;
        let mut seen = HashSet::new();
        let mut done = 0;
        let mem1 = mems[1].clone();
        let ok = sim.run_until(|sim| {
            while next < N {
                let i = next as usize;
                let imm = (i.is_multiple_of(2)).then_some(next);
                let op = write_op(
                    a1,
                    TBASE + (i * SLOT) as u64,
                    datas[i].clone(),
                    imm,
                    u64::from(next),
                );
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
                assert!(seen.insert(w.data), "seed {seed}: write {i} reported twice");
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
                done += 1;
            }
            done == N && seen.len() == N.div_ceil(2) as usize
        });
        assert!(ok, "seed {seed}: {done} done, {} events", seen.len());
        assert_eq!(sim.stats.rdma_ops, 0, "seed {seed}: nothing on the device");
        // Every write completed only once its data was in place (emulated writes are
        // delivery-complete): read them all back.
        for (i, d) in datas.iter().enumerate() {
            let got = run_rma(
                &mut sim,
                0,
                read_op(a1, TBASE + (i * SLOT) as u64, d.len(), 1000 + i as u64),
                seed,
            )
            .unwrap();
            assert!(got.error.is_none(), "seed {seed}: {got:?}");
            let RmaBuf::Read(b) = got.buf else {
                panic!("seed {seed}: read buffer")
            };
            assert!(b[..] == d[..], "seed {seed}: read {i}");
        }
        // 40 fetch-adds in a row on one counter: each sees the sum of those before it.
        let counter = TBASE + (TLEN - 8) as u64;
        let mut expect = 0u64;
        for j in 1..=40u64 {
            let op = RmaOp {
                dest: a1,
                remote: RemoteIov {
                    addr: counter,
                    len: 8,
                    key: TKEY,
                },
                kind: RmaKind::Atomic {
                    op: AtomicOp::Sum,
                    datatype: AtomicType::U64,
                    operand: Bytes::copy_from_slice(&j.to_le_bytes()),
                    compare: None,
                    fetch: Some(BytesMut::new()),
                },
                local_key: None,
                delivery_complete: false,
                context: 5000 + j,
                local_region: None,
            };
            let d = run_rma(&mut sim, 0, op, seed).unwrap();
            let RmaBuf::Atomic { fetch: Some(f), .. } = d.buf else {
                panic!("seed {seed}: fetch buffer")
            };
            assert_eq!(
                u64::from_le_bytes(f[..8].try_into().unwrap()),
                expect,
                "seed {seed}"
            );
            expect += j;
        }
        let m = mem1.bytes(TKEY);
        assert_eq!(
            u64::from_le_bytes(m[TLEN - 8..].try_into().unwrap()),
            expect
        );
        // A wrong key: refused, memory untouched.
        let before = mem1.bytes(TKEY);
        let mut bad = write_op(a1, TBASE, pattern(seed, 20_000), Some(1), 9000);
        bad.remote.key = TKEY + 1;
        let d = run_rma(&mut sim, 0, bad, seed).unwrap();
        assert_eq!(
            d.error.as_ref().map(|e| e.kind()),
            Some(ErrorKind::RemoteAccess),
            "seed {seed}"
        );
        assert_eq!(d.status, Some(Status::RemoteBadAddress), "seed {seed}");
        assert!(mem1.bytes(TKEY) == before, "seed {seed}: memory changed");
        assert!(events(&mut sim, 1).writes.is_empty(), "seed {seed}");
        assert!(sim.stats.lost > 0, "seed {seed}: faults happened");
        baseline(&mut sim, seed);
    }
}

/// A peer that fails (here: a packet to it comes back unresponsive, as when the target exits
/// right after its device acknowledged our write) does not turn RDMA work requests already on
/// the device into errors: a write the device then completes successfully succeeded, a read
/// hands its buffer back only with its completion, and what was still queued fails, once.
#[test]
fn peer_failure_leaves_rdma_on_the_device_to_its_completions() {
    let seed = test_seed();
    let mut c = SimConfig::clean(seed);
    c.engine.max_rdma_size = 1000;
    let (mut sim, _) = all(c);
    connect(&mut sim, seed);
    let a1 = sim.addr(1);
    let now = sim.now();
    // Context 1: one work request. 2: a read of one piece. 3: three pieces, of which we post one.
    sim.engine(0)
        .rma(now, write_op(a1, TBASE, pattern(seed, 500), None, 1))
        .unwrap();
    sim.engine(0).rma(now, read_op(a1, TBASE, 500, 2)).unwrap();
    sim.engine(0)
        .rma(now, write_op(a1, TBASE, pattern(seed, 2500), None, 3))
        .unwrap();
    sim.engine(0)
        .send(now, send_op(a1, Bytes::from_static(b"lost"), 4))
        .unwrap();
    let (mut writes, mut reads, mut packets) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(t) = sim.engine(0).poll_transmit(now) {
        match t.kind {
            TransmitKind::RdmaWrite { .. } => writes.push(t.wr_id),
            TransmitKind::RdmaRead { buf, .. } => reads.push((t.wr_id, buf)),
            _ => packets.push(t.wr_id),
        }
        if writes.len() == 2 && !reads.is_empty() && !packets.is_empty() {
            break;
        }
    }
    assert_eq!((writes.len(), reads.len()), (2, 1), "seed {seed}");
    let e = sim.engine(0);
    // The message's packet: the peer is unresponsive.
    e.handle_send_completion(now, packets[0], Status::UnresponsiveRemote);
    let mut done: Vec<Event> = std::iter::from_fn(|| e.poll_event()).collect();
    assert!(
        done.iter().all(|ev| !matches!(ev, Event::Rma(_))),
        "seed {seed}: no RMA completes before its work requests: {done:?}"
    );
    // The device completes what it had: both writes' first work requests and the read.
    for w in &writes {
        e.handle_rdma_completion(now, *w, Status::Success, None);
    }
    let (rid, mut rbuf) = reads.pop().unwrap();
    rbuf.extend_from_slice(&[7; 500]);
    e.handle_rdma_completion(now, rid, Status::Success, Some(rbuf));
    done.extend(std::iter::from_fn(|| e.poll_event()));
    let mut rmas: Vec<RmaDone> = done
        .into_iter()
        .filter_map(|ev| match ev {
            Event::Rma(d) => Some(d),
            _ => None,
        })
        .collect();
    rmas.sort_by_key(|d| d.context);
    let ctx: Vec<u64> = rmas.iter().map(|d| d.context).collect();
    assert_eq!(ctx, vec![1, 2, 3], "seed {seed}: each once");
    assert!(rmas[0].error.is_none(), "seed {seed}: {:?}", rmas[0]);
    assert!(rmas[1].error.is_none(), "seed {seed}: {:?}", rmas[1]);
    assert!(
        matches!(&rmas[1].buf, RmaBuf::Read(b) if b[..] == [7; 500][..]),
        "seed {seed}"
    );
    let e3 = rmas[2]
        .error
        .as_ref()
        .expect("its queued pieces were withdrawn");
    assert_eq!(e3.kind(), ErrorKind::ConnectionAborted, "seed {seed}");
    assert_eq!(sim.engine(0).resources().tx_ops, 0, "seed {seed}");
}
