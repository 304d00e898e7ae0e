//! Waiting on a completion queue's descriptor (`CompletionQueue::wait_fd`, `trywait`: libfabric's
//! `FI_WAIT_FD` and `fi_trywait`), as an epoll, mio or tokio program does: after `trywait` says
//! `Ok` the descriptor becomes readable when a message arrives, with nobody polling meanwhile;
//! `trywait` says `Again` while completions are ready (issue 28).

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::Node;
use efa::{Domain, ErrorKind};

/// How long a readable descriptor may take at most (a deadline, far above the milliseconds it
/// takes: a descriptor nothing makes readable runs into it).
const DEADLINE: Duration = Duration::from_secs(20);

fn setups() -> Vec<(&'static str, Domain, Box<dyn std::any::Any>)> {
    common::device_domains("efa-wait-fd-")
}

/// Blocks in poll(2) on `fd` until readable or `limit`; true when readable.
/// Polls `cq` into `out` until a completion is there (progress may take a pass or two after the
/// descriptor turned readable); the first one.
fn first_completion<'a>(
    cq: &efa::CompletionQueue,
    out: &'a mut Vec<efa::Completion>,
    name: &str,
) -> &'a efa::Completion {
    let deadline = Instant::now() + DEADLINE;
    while out.is_empty() && Instant::now() < deadline {
        let _ = cq.poll(out, 8);
    }
    out.first()
        .unwrap_or_else(|| panic!("{name}: no completion"))
}

fn readable(fd: i32, limit: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut p, 1, limit.as_millis() as i32) };
    rc == 1 && p.revents & libc::POLLIN != 0
}

#[test]
fn the_descriptor_wakes_a_program_blocked_in_poll() {
    for (name, d, _keep) in setups() {
        let a = Node::new(&d);
        let b = Node::new(&d);
        let pb = a.av.insert(b.ep.addr()).unwrap();
        let _pa = b.av.insert(a.ep.addr()).unwrap();
        b.ep.recv(BytesMut::with_capacity(64), 1).unwrap();
        let fd = b.cq.wait_fd().as_raw_fd();
        assert_eq!(fd, b.cq.as_raw_fd());
        // A first message makes the handshake; then the measured one.
        for (i, msg) in [&b"hello"[..], b"again"].into_iter().enumerate() {
            if i == 1 {
                b.ep.recv(BytesMut::with_capacity(64), 2).unwrap();
            }
            let mut out = Vec::new();
            let _ = b.cq.poll(&mut out, 8);
            assert!(out.is_empty());
            // Nothing ready: the program may block.
            let mut tries = 0;
            while b.cq.trywait().is_err() {
                let _ = b.cq.poll(&mut out, 8);
                tries += 1;
                assert!(tries < 1000, "{name}: trywait never lets the program block");
            }
            let ep = &a.ep;
            let start = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    ep.send(pb, Bytes::copy_from_slice(msg), 10 + i as u64)
                        .unwrap();
                    // The sender's own progress (its send completion, the handshake's answer).
                    let deadline = Instant::now() + DEADLINE;
                    let mut done = Vec::new();
                    while done.is_empty() && Instant::now() < deadline {
                        let _ = a.cq.wait(&mut done, 8, Some(Duration::from_millis(10)));
                    }
                });
                assert!(
                    readable(fd, DEADLINE),
                    "{name}: the descriptor never became readable"
                );
            });
            assert!(start.elapsed() < DEADLINE / 2, "{name}");
            // Readable: the message is there to poll (progress may take a pass or two).
            let c = first_completion(&b.cq, &mut out, name);
            assert_eq!(c.buf.as_recv().unwrap(), msg, "{name}");
        }
    }
}

#[test]
fn trywait_says_again_while_completions_are_ready() {
    for (name, d, _keep) in setups() {
        let a = Node::new(&d);
        let me = a.av.insert(a.ep.addr()).unwrap();
        a.ep.recv(BytesMut::with_capacity(8), 1).unwrap();
        a.ep.send(me, Bytes::from_static(b"self"), 2).unwrap();
        let deadline = Instant::now() + DEADLINE;
        while a.cq.len() < 2 && Instant::now() < deadline {
            let _ = a.cq.trywait();
        }
        let e = a.cq.trywait().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Again, "{name}");
        let mut out = Vec::new();
        assert_eq!(a.cq.poll(&mut out, 8).unwrap(), 2, "{name}");
    }
}

/// The same-host path (shm, and udp's routing device): a message to an endpoint whose program
/// sleeps on its queue's descriptor makes the descriptor readable with no thread of the
/// receiver in between. The sender writes the receiver's wake pipe, which is in the queue's
/// epoll set; the receiver's waiter thread stays asleep, so when the descriptor turns readable
/// nothing has progressed the receiver yet: its queue is still empty until the program polls.
#[test]
fn a_same_host_sender_makes_the_descriptor_readable_itself() {
    for (name, d, _keep) in setups() {
        if name == "loopback" {
            continue; // no shared-memory directory, no same-host path
        }
        let a = Node::new(&d);
        let b = Node::new(&d);
        let pb = a.av.insert(b.ep.addr()).unwrap();
        let _pa = b.av.insert(a.ep.addr()).unwrap();
        let fd = b.cq.as_raw_fd();
        for round in 0..5u8 {
            b.ep.recv(BytesMut::with_capacity(64), u64::from(round))
                .unwrap();
            let mut out = Vec::new();
            let mut tries = 0;
            while b.cq.trywait().is_err() {
                let _ = b.cq.poll(&mut out, 8);
                tries += 1;
                assert!(tries < 1000, "{name}: trywait never lets the program block");
            }
            assert!(out.is_empty(), "{name}");
            // Long enough for the receiver's waiter thread to be asleep on its futex.
            std::thread::sleep(Duration::from_millis(30));
            let msg = [round; 40];
            a.ep.inject(pb, &msg).unwrap();
            assert!(readable(fd, DEADLINE), "{name}: never readable");
            assert_eq!(
                b.cq.len(),
                0,
                "{name}, round {round}: a thread progressed the receiver before the program"
            );
            let c = first_completion(&b.cq, &mut out, name);
            assert_eq!(c.buf.as_recv().unwrap(), &msg[..], "{name}");
            assert_eq!(c.context, u64::from(round));
        }
    }
}

/// Seeded stress: a sender sends at random moments (bursts, pauses, yields) while the receiver
/// sleeps on its queue's descriptor whenever `trywait` lets it; every message arrives once, in
/// order, and every sleep ends. (Here the receiver's waiter thread would end a sleep whose
/// wake-up was lost at its next nap; `local::chan`'s unit test `descriptor_wake_ups_are_never_lost`
/// runs the same handshake with no such thread, where a lost wake-up hangs.)
#[test]
fn descriptor_sleeps_lose_no_message_under_random_sends() {
    let seed = efa::fault::test_seed();
    println!("seed {seed}");
    for (name, d, _keep) in setups() {
        if name == "loopback" {
            continue;
        }
        let a = Node::new(&d);
        let b = Node::new(&d);
        let pb = a.av.insert(b.ep.addr()).unwrap();
        let _pa = b.av.insert(a.ep.addr()).unwrap();
        const N: u64 = 400;
        for i in 0..32 {
            b.ep.recv(BytesMut::with_capacity(16), i).unwrap();
        }
        let fd = b.cq.as_raw_fd();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut rng = efa::fault::Rng::new(seed);
                let mut i = 0u64;
                while i < N {
                    match rng.below(5) {
                        0 => std::thread::sleep(Duration::from_micros(rng.below(3000))),
                        1 => std::thread::yield_now(),
                        _ => {}
                    }
                    match a.ep.inject(pb, &i.to_le_bytes()) {
                        Ok(()) => i += 1,
                        Err(e) if e.kind() == ErrorKind::Again => {
                            let _ = a.cq.poll(&mut Vec::new(), 8);
                        }
                        Err(e) => panic!("{name}, seed {seed}: inject: {e}"),
                    }
                }
            });
            let (mut next, mut posted, mut out) = (0u64, 32u64, Vec::new());
            let mut sleeps = 0;
            while next < N {
                out.clear();
                let _ = b.cq.poll(&mut out, 32);
                for c in &out {
                    let got = u64::from_le_bytes(c.buf.as_recv().unwrap().try_into().unwrap());
                    assert_eq!(got, next, "{name}, seed {seed}: once, in order");
                    next += 1;
                    if posted < N {
                        b.ep.recv(BytesMut::with_capacity(16), posted).unwrap();
                        posted += 1;
                    }
                }
                if out.is_empty() && b.cq.trywait().is_ok() {
                    sleeps += 1;
                    assert!(
                        readable(fd, Duration::from_secs(10)),
                        "{name}, seed {seed}: a sleep never ended after {next} messages"
                    );
                }
            }
            assert!(sleeps > 0, "{name}, seed {seed}: the receiver never slept");
        });
    }
}
