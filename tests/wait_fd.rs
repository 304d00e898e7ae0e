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
            let deadline = Instant::now() + DEADLINE;
            while out.is_empty() && Instant::now() < deadline {
                let _ = b.cq.poll(&mut out, 8);
            }
            let c = out
                .first()
                .unwrap_or_else(|| panic!("{name}: no completion"));
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
