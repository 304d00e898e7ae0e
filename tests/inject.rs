//! `inject` (`fi_inject`): the bytes are copied before the call returns, a successful inject
//! writes no completion, a failed one writes an error completion with context 0. On the shm
//! device's local path, through the engine on a routed udp device, and on loopback.

mod common;

use std::time::Instant;

use bytes::BytesMut;
use common::*;
use efa::device::loopback::LoopbackNetwork;
use efa::fault::{FaultConfig, Rng, test_seed};
use efa::{ErrorKind, PeerId, SendOptions};

/// `n` messages of up to `max` bytes, untagged, tagged and with CQ data (no delivery complete:
/// an inject has no completion to wait for).
fn inject_msgs(seed: u64, n: usize, max: usize) -> Vec<Msg> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|i| Msg {
            len: match i % 5 {
                0 => 0,
                1 => max,
                _ => r.below(max as u64 + 1) as usize,
            },
            tag: (i % 3 == 1).then(|| r.next_u64()),
            data: (i % 4 == 2).then(|| r.next_u64() as u32),
            dc: false,
        })
        .collect()
}

/// Injects the mix from one reused buffer, overwritten after every call (the endpoint must have
/// copied it), retrying on `Again` while both sides make progress.
fn inject_mix(a: &Node, b: &Node, peer: PeerId, seed: u64, msgs: &[Msg]) {
    let deadline = Instant::now() + DEADLINE;
    let mut buf = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        buf.clear();
        buf.extend_from_slice(&payload(seed, i, m.len));
        let mut o = SendOptions::default();
        o.tag = m.tag;
        o.data = m.data;
        loop {
            match a.ep.inject_with(peer, &buf, o) {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Again => {
                    a.ep.progress();
                    b.ep.progress();
                    assert!(
                        Instant::now() < deadline,
                        "seed {seed}: inject {i} kept getting Again"
                    );
                }
                Err(e) => panic!("seed {seed}: inject {i}: {e}"),
            }
        }
        buf.iter_mut().for_each(|x| *x = !*x);
    }
}

/// Injects `n` messages from `a` to `b` before `b` posts a single receive (so that a local
/// ring fills and the rest wait as copies), then checks every message arrived once, intact and
/// in order, and that `a` saw no completion at all.
fn inject_and_check(a: &Node, b: &Node, n: usize, seed: u64) {
    let pa = b.insert(a.ep.addr());
    let pb = a.insert(b.ep.addr());
    let max = a.ep.inject_size();
    assert!(max >= 64, "inject_size {max}");
    let m = inject_msgs(seed, n, max);
    inject_mix(a, b, pb, seed, &m);
    post_mix(b, Some(pa), seed, &m, 0);
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::new();
    let mut sent = Vec::new();
    while got.len() < m.len() {
        a.poll_ok(&mut sent, &format_args!("seed {seed}"));
        b.poll_ok(&mut got, &format_args!("seed {seed}"));
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {} of {} injects arrived",
            got.len(),
            m.len()
        );
    }
    // Receives were posted in order with exact sizes: a reordering fails a length.
    check_mix(&got, seed, &m, 0, Some(pa));
    for c in &got {
        assert_eq!(
            c.context,
            got.iter().position(|x| x.context == c.context).unwrap() as u64
        );
    }
    // The sender's acknowledgements have time to come back; still no completion.
    let until = Instant::now() + std::time::Duration::from_millis(50);
    while Instant::now() < until {
        a.poll_ok(&mut sent, &format_args!("seed {seed}"));
        b.ep.progress();
    }
    assert!(sent.is_empty(), "seed {seed}: injects completed: {sent:?}");
    assert!(a.cq.is_empty());
    assert_eq!(a.ep.stats().errors, 0);
}

#[test]
fn injects_on_the_local_path_arrive_once_in_order_without_completions() {
    let seed = test_seed();
    let dir = shm_test_dir("efa-inject-test-");
    let (d, _) = shm_domain(dir.path());
    let (a, b) = (Node::new(&d), Node::new(&d));
    // More than the ring's 256 slots: the rest wait in the sender as copies.
    inject_and_check(&a, &b, 700, seed);
    assert_eq!(a.ep.stats().local_tx_msgs, 700);
    assert_eq!(b.ep.stats().local_rx_msgs, 700);
}

#[test]
fn injects_through_the_engine_arrive_once_in_order_without_completions() {
    let seed = test_seed();
    let dir = shm_test_dir("efa-inject-test-");
    let (d, _) = routed_domain(dir.path());
    let (a, b) = (Node::device_path(&d), Node::device_path(&d));
    inject_and_check(&a, &b, 300, seed);
    assert_eq!(a.ep.stats().local_tx_msgs, 0);
    // A lossy network: the engine retransmits what an inject sent.
    let net = faulty_net(seed);
    let d = loopback_domain(&net);
    let (a, b) = (Node::new(&d), Node::new(&d));
    inject_and_check(&a, &b, 300, seed ^ 1);
}

#[test]
fn oversized_and_delivery_complete_injects_are_refused() {
    let net = LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let a = Node::new(&d);
    let me = a.insert(a.ep.addr());
    let max = a.ep.inject_size();
    let big = vec![0u8; max + 1];
    let e = a.ep.inject(me, &big).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let o = SendOptions::default().with_delivery_complete(true);
    let e = a.ep.inject_with(me, b"x", o).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let gone = a.insert(efa::RawAddr {
        qpn: 4242,
        ..a.ep.addr()
    });
    a.av.remove(gone).unwrap();
    let e = a.ep.inject(gone, b"x").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownPeer, "{e}");
    // The largest allowed one goes.
    a.ep.recv(BytesMut::with_capacity(max), 7).unwrap();
    a.ep.inject(me, &big[..max]).unwrap();
    let c = a.collect(1, "inject to self");
    assert_eq!((c[0].context, c[0].len), (7, max));
}

/// An inject to a peer that closed its endpoint fails with an error completion of context 0,
/// as a send would with its own context.
#[test]
fn an_inject_to_a_closed_peer_reports_an_error_completion() {
    let dir = shm_test_dir("efa-inject-test-");
    let (d, _) = shm_domain(dir.path());
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    b.ep.recv(BytesMut::with_capacity(8), 1).unwrap();
    a.ep.inject(pb, b"hello").unwrap();
    b.collect(1, "first receive");
    drop(b);
    a.ep.inject_data(pb, b"bye", 9).unwrap();
    let err = a.expect_err(DEADLINE, "an inject to a closed peer");
    assert_eq!(err.context, 0);
    assert_eq!(
        err.error.kind(),
        ErrorKind::ConnectionAborted,
        "{}",
        err.error
    );
}
