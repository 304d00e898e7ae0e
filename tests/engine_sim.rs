//! The protocol engine in the simulator.

use bytes::{Bytes, BytesMut};
use efa::proto::engine::{Event, RecvDone, RecvOp, SendDone, SendOp};
use efa::proto::sim::{Sim, SimConfig};
use efa::RawAddr;

fn pattern(seed: u64, len: usize) -> Bytes {
    let mut v = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

fn sop(dest: RawAddr, buf: Bytes, context: u64) -> SendOp {
    SendOp { dest, buf, tag: None, data: None, delivery_complete: false, context }
}

fn rop(cap: usize, context: u64) -> RecvOp {
    RecvOp { buf: BytesMut::with_capacity(cap), tag: None, src: None, multi_recv: None, context }
}

fn split(events: Vec<Event>) -> (Vec<SendDone>, Vec<RecvDone>) {
    let mut s = Vec::new();
    let mut r = Vec::new();
    for e in events {
        match e {
            Event::Send(x) => s.push(x),
            Event::Recv(x) => r.push(x),
        }
    }
    (s, r)
}

#[test]
fn smoke_sizes() {
    let seed = efa::fault::test_seed();
    for (k, len) in [0usize, 1, 100, 8000, 8200, 30_000, 65_536, 70_000, 1 << 20].into_iter().enumerate() {
        for dc in [false, true] {
            let mut sim = Sim::new(SimConfig::clean(seed), 2);
            let data = pattern(k as u64, len);
            sim.post_recv(1, rop(len, 5)).unwrap();
            let mut op = sop(sim.addr(1), data.clone(), 9);
            op.delivery_complete = dc;
            sim.send(0, op).unwrap();
            assert!(sim.run(), "seed {seed} len {len}");
            let (s, _) = split(sim.take_events(0));
            let (_, r) = split(sim.take_events(1));
            assert_eq!(s.len(), 1, "seed {seed} len {len} dc {dc}");
            assert!(s[0].error.is_none(), "seed {seed} len {len}: {:?}", s[0].error);
            assert_eq!(r.len(), 1, "seed {seed} len {len} dc {dc}");
            assert!(r[0].error.is_none(), "seed {seed} len {len}: {:?}", r[0].error);
            assert_eq!(r[0].len, len);
            assert!(r[0].buf[..] == data[..], "seed {seed} len {len}");
            assert_eq!(r[0].src, Some(sim.addr(0)));
            for i in 0..2 {
                let res = sim.engine(i).resources();
                assert_eq!(res, efa::proto::engine::Resources { peers: 1, ..Default::default() }, "seed {seed} len {len} node {i}");
            }
        }
    }
}
