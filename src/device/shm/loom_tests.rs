//! Model checks of the shm device's receive ring (`super::ring`, over the ring core of
//! `crate::shmem::file`): every interleaving of two producers and the consumer, up to the
//! preemption bound, on model shared memory (`crate::shmem::model`).
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib loom`
//! (docs/architecture.md). Each test fails when an ordering of the ring is weakened: a slot's
//! fields read stale (the assertions) or its data copied without the publication or the
//! release ordering it (a data race loom reports on the model's byte cells).

use bytes::BytesMut;
use loom::thread;

use super::ring::{Meta, Peek, Ring, ST_CANCELLED, ST_PUBLISHED, ST_TAKEN};
use super::segment::Geometry;
use crate::device::QpType;
use crate::shmem::map::Mapping;
use crate::shmem::model::check;

/// A segment of `slots` slots of 8-byte datagrams, slots initialised as a new segment's are.
fn segment(slots: u32) -> (Mapping, Geometry) {
    let g = Geometry::new(QpType::Srd, slots, 8, 0).expect("a small geometry");
    let m = Mapping::new(g.total);
    for i in 0..u64::from(slots) {
        m.store64(g.slot(i), i);
    }
    (m, g)
}

fn meta(writer: u32, n: u8) -> Meta {
    Meta {
        writer,
        len: 4,
        qkey: 7,
        imm: u32::from(n),
        flags: 0,
        src_qkey: writer * 100,
        token: u64::from(writer) << 32 | u64::from(n),
    }
}

/// Reserves (waiting while the ring is full) and publishes datagram `n` of `writer`: its data
/// is `[writer, n, writer, n]`. Returns the position.
fn send(r: &Ring<'_>, writer: u32, n: u8) -> u64 {
    let pos = loop {
        if let Some(p) = r.reserve(writer) {
            break p;
        }
        thread::yield_now();
    };
    let w = writer as u8;
    r.publish(pos, &meta(writer, n), &[w, n], &[w, n]);
    pos
}

/// The consumer: waits for the head's publication, checks the slot's fields and data against
/// what its writer wrote, frees it. Returns (writer, n).
fn receive(r: &Ring<'_>, head: u64) -> (u32, u8) {
    loop {
        match r.peek(head) {
            Peek::Ready(st, m) => {
                assert_eq!(st, ST_PUBLISHED, "state of a published slot");
                assert_eq!(r.writer(head), m.writer, "the writer word");
                let n = m.imm as u8;
                assert_eq!(
                    fields(&m),
                    fields(&meta(m.writer, n)),
                    "every field as written"
                );
                let mut buf = BytesMut::with_capacity(8);
                assert!(r.read_data(head, m.len as usize, &mut buf));
                let w = m.writer as u8;
                assert_eq!(&buf[..], &[w, n, w, n], "the data as written");
                r.free(head);
                return (m.writer, n);
            }
            Peek::Empty | Peek::Reserved => thread::yield_now(),
            Peek::Garbage => panic!("garbage at position {head}"),
        }
    }
}

/// A slot's fields, to compare.
fn fields(m: &Meta) -> (u32, u32, u32, u32, u32, u32, u64) {
    (m.writer, m.len, m.qkey, m.imm, m.flags, m.src_qkey, m.token)
}

#[test]
fn loom_two_producers_one_consumer_each_datagram_once_intact() {
    check(|| {
        let (m, g) = segment(2);
        let producers: Vec<_> = (1..=2u32)
            .map(|w| {
                let m = m.clone();
                thread::spawn(move || send(&Ring::new(&m, &g), w, 0))
            })
            .collect();
        let r = Ring::new(&m, &g);
        let got = [receive(&r, 0), receive(&r, 1)];
        let pos: Vec<u64> = producers.into_iter().map(|p| p.join().unwrap()).collect();
        // Each datagram once, at the position its producer reserved.
        for (w, p) in (1..=2u32).zip(&pos) {
            assert_eq!(got[*p as usize], (w, 0));
        }
        assert!(matches!(r.peek(2), Peek::Empty));
    });
}

#[test]
fn loom_a_ring_of_two_slots_laps_in_order() {
    check(|| {
        let (m, g) = segment(2);
        let m2 = m.clone();
        let producer = thread::spawn(move || {
            let r = Ring::new(&m2, &g);
            for n in 0..3 {
                assert_eq!(send(&r, 5, n), u64::from(n));
            }
        });
        let r = Ring::new(&m, &g);
        for n in 0..3u8 {
            assert_eq!(receive(&r, u64::from(n)), (5, n));
        }
        producer.join().unwrap();
    });
}

#[test]
fn loom_a_slot_is_taken_back_or_taken_never_both() {
    check(|| {
        let (m, g) = segment(2);
        let m2 = m.clone();
        // The sender publishes, then gives up on it (an unresponsive receiver).
        let sender = thread::spawn(move || {
            let r = Ring::new(&m2, &g);
            let pos = send(&r, 3, 9);
            r.transition(pos, ST_PUBLISHED, ST_CANCELLED)
        });
        let r = Ring::new(&m, &g);
        let taken = loop {
            match r.peek(0) {
                Peek::Ready(ST_CANCELLED, _) => break false,
                Peek::Ready(st, m) => {
                    if r.transition(0, st, ST_TAKEN) {
                        let mut buf = BytesMut::with_capacity(8);
                        assert!(r.read_data(0, m.len as usize, &mut buf));
                        assert_eq!(&buf[..], &[3, 9, 3, 9]);
                        break true;
                    }
                }
                Peek::Empty | Peek::Reserved => thread::yield_now(),
                Peek::Garbage => panic!("garbage"),
            }
        };
        r.free(0);
        let cancelled = sender.join().unwrap();
        assert_ne!(
            taken, cancelled,
            "exactly one of the two sides has the datagram"
        );
    });
}
