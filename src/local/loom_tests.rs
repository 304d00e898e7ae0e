//! Model checks of the same-host path's channel (`super::chan`): its ring's publication and
//! consumption, and the doorbell handshake between a sender and the owner's waiter thread
//! (`Doorbell::sleep_unless` against `PeerChan::ring_bell_if_asleep`), on model shared memory
//! (`crate::shmem::model`), where a lost wake-up is a sleep nobody ends: a deadlock loom reports.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib loom`.

use std::time::Duration;

use bytes::BytesMut;
use loom::thread;

use super::chan::{self, Geometry, OwnChan};
use super::ring::{ADDR_LEN, Head, K_MSG, SlotHdr};
use crate::shmem::model::check;

fn hdr(tag: u64) -> SlotHdr {
    SlotHdr {
        kind: K_MSG,
        flags: 0,
        len: 0,
        tag,
        word: tag * 3,
        data: tag as u32 + 1,
        token: 0,
    }
}

/// The data of message `tag` from sender `s`.
fn data(s: u8, tag: u64) -> [u8; 4] {
    [s, tag as u8, s, !(tag as u8)]
}

/// Checks the head slot against what sender `s` wrote for its tag, copies it, frees it.
fn take(own: &OwnChan, h: &Head) -> (u8, u64) {
    let src = h.src.expect("a well-formed slot");
    let s = src.qpn as u8;
    let tag = h.hdr.tag;
    assert_eq!(
        h.hdr,
        SlotHdr { len: 4, ..hdr(tag) },
        "every field as written"
    );
    let mut buf = BytesMut::with_capacity(4);
    assert!(own.copy(h, 4, &mut buf));
    assert_eq!(&buf[..], &data(s, tag), "the data as written");
    own.pop();
    (s, tag)
}

fn src(s: u8) -> [u8; ADDR_LEN] {
    let mut a = [0; ADDR_LEN];
    a[4] = s; // qpn
    a
}

/// A channel of two slots of 64 bytes.
fn pair() -> (OwnChan, chan::PeerChan) {
    chan::model_pair(Geometry::new(2, 64).expect("a small geometry"))
}

#[test]
fn loom_a_push_wakes_the_sleeping_waiter() {
    check(|| {
        let (own, peer) = pair();
        let sender = thread::spawn(move || {
            assert_eq!(peer.push(&hdr(1), &src(1), &data(1, 1)), Some(0));
            peer.ring_bell_if_asleep();
        });
        // The waiter thread's loop: sleep unless there is work, look again once woken.
        let ring = own.ring().clone();
        let door = ring.bell().expect("a doorbell");
        while !ring.ready() {
            door.sleep_unless(|| ring.ready(), || Duration::from_secs(1));
        }
        let h = own.peek().expect("the published slot");
        assert_eq!(take(&own, &h), (1, 1));
        sender.join().unwrap();
    });
}

#[test]
fn loom_two_senders_each_message_once_intact() {
    check(|| {
        let (own, peer) = pair();
        let peer = std::sync::Arc::new(peer);
        let senders: Vec<_> = (1..=2u8)
            .map(|s| {
                let peer = peer.clone();
                thread::spawn(move || {
                    peer.push(&hdr(u64::from(s)), &src(s), &data(s, u64::from(s)))
                        .expect("room")
                })
            })
            .collect();
        let mut got = Vec::new();
        while got.len() < 2 {
            match own.peek() {
                Some(h) => got.push(take(&own, &h)),
                None => thread::yield_now(),
            }
        }
        for (s, p) in senders.into_iter().enumerate() {
            let s = s as u8 + 1;
            let pos = p.join().unwrap();
            assert_eq!(got[pos as usize], (s, u64::from(s)), "in reservation order");
            assert!(peer.consumed(pos));
        }
    });
}

#[test]
fn loom_a_channel_of_two_slots_laps_and_the_sender_sees_consumption() {
    check(|| {
        let (own, peer) = pair();
        let sender = thread::spawn(move || {
            for tag in 0..3u64 {
                let pos = loop {
                    if let Some(p) = peer.push(&hdr(tag), &src(7), &data(7, tag)) {
                        break p;
                    }
                    thread::yield_now();
                };
                assert_eq!(pos, tag);
            }
            // The first lap's slots were consumed (the third push found the first free).
            assert!(peer.consumed(0));
        });
        for tag in 0..3u64 {
            let h = loop {
                if let Some(h) = own.peek() {
                    break h;
                }
                thread::yield_now();
            };
            assert_eq!(take(&own, &h), (7, tag), "in order");
        }
        sender.join().unwrap();
    });
}
