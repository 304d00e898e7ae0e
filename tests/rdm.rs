//! Endpoint<Rdm> over the loopback and udp devices: message mixes of every protocol size,
//! exactly once, intact and in order, under faults; tagged matching; the async API with and
//! without a runtime; the progress thread; cancel, truncation and peek.

mod common;

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::*;
use efa::fault::{FaultConfig, test_seed};
use efa::{CompletionFlags, Endpoint, ErrorKind, OpOutcome, Rdm, RecvOptions, SendOptions};

fn run_mix(a: &Node, b: &Node, seed: u64, n: usize, max: usize) {
    let pb = a.insert(b.ep.addr());
    let pa = b.insert(a.ep.addr());
    let msgs = mix(seed, n, max);
    // Half of the receives before the messages arrive, half after (the unexpected path).
    let half = msgs.len() / 2;
    post_mix(b, Some(pa), seed, &msgs[..half], 0);
    send_mix(a, pb, seed, &msgs);
    post_mix(b, Some(pa), seed, &msgs[half..], half as u64);
    let recvs = {
        let deadline = Instant::now() + DEADLINE;
        let mut out = Vec::new();
        let mut sends = 0;
        while out.len() < msgs.len() || sends < msgs.len() {
            for c in a.collect_some() {
                assert!(c.flags.contains(CompletionFlags::SEND), "seed {seed}");
                sends += 1;
            }
            out.extend(b.collect_some());
            assert!(
                Instant::now() < deadline,
                "seed {seed}: {} recvs, {sends} sends of {}",
                out.len(),
                msgs.len()
            );
        }
        assert_eq!(sends, msgs.len(), "seed {seed}: every send completes once");
        out
    };
    check_mix(&recvs, seed, &msgs, 0, Some(pa));
    assert_eq!(a.ep.resources().tx_ops, 0, "seed {seed}");
    assert_eq!(b.ep.resources().rx_ops, 0, "seed {seed}");
    assert_eq!(b.ep.resources().unexpected_msgs, 0, "seed {seed}");
}

#[test]
fn message_mix_over_loopback_with_faults() {
    let seed = test_seed();
    for s in [seed, seed.wrapping_add(1)] {
        let net = faulty_net(s);
        let d = loopback_domain(&net);
        let (a, b) = (Node::new(&d), Node::new(&d));
        run_mix(&a, &b, s, 150, 4 << 20);
    }
}

#[test]
fn message_mix_over_udp_with_faults() {
    let seed = test_seed();
    let faults = FaultConfig::seeded(seed)
        .drop(0.1)
        .duplicate(0.1)
        .reorder(0.1);
    let d = udp_domain(LOCAL4, faults);
    let (a, b) = (Node::new(&d), Node::new(&d));
    run_mix(&a, &b, seed, 120, 4 << 20);
}

#[test]
fn several_senders_to_one_receiver_keep_per_sender_order() {
    let seed = test_seed();
    let net = faulty_net(seed);
    let d = loopback_domain(&net);
    let rx = Node::new(&d);
    let senders: Vec<Node> = (0..3).map(|_| Node::new(&d)).collect();
    let mut all = Vec::new();
    for (k, s) in senders.iter().enumerate() {
        let ks = seed.wrapping_add(k as u64 * 1000);
        let msgs = mix(ks, 60, 300_000);
        let from = rx.insert(s.ep.addr());
        post_mix(&rx, Some(from), ks, &msgs, (k as u64) << 32);
        all.push((ks, msgs, from));
    }
    for (k, s) in senders.iter().enumerate() {
        let to = s.insert(rx.ep.addr());
        send_mix(s, to, all[k].0, &all[k].1);
    }
    let total: usize = all.iter().map(|(_, m, _)| m.len()).sum();
    // Progress is manual: the senders are driven while the receiver collects.
    let deadline = Instant::now() + DEADLINE;
    let mut done = Vec::new();
    while done.len() < total {
        for s in &senders {
            s.ep.progress();
        }
        done.extend(rx.collect_some());
        assert!(
            Instant::now() < deadline,
            "seed {seed}: {} of {total}",
            done.len()
        );
    }
    for (k, (ks, msgs, from)) in all.iter().enumerate() {
        let mine: Vec<_> = done
            .iter()
            .filter(|c| c.context >> 32 == k as u64)
            .map(|c| c.context)
            .collect();
        assert_eq!(mine.len(), msgs.len(), "seed {seed}: sender {k}");
        let subset: Vec<&efa::Completion> = done
            .iter()
            .filter(|c| c.context >> 32 == k as u64)
            .collect();
        for c in subset {
            let i = (c.context & 0xffff_ffff) as usize;
            assert_eq!(c.len, msgs[i].len, "seed {ks}: sender {k} message {i}");
            assert!(
                c.buf.as_recv().unwrap()[..] == payload(*ks, i, msgs[i].len)[..],
                "seed {ks}: data {k}/{i}"
            );
            assert_eq!(c.source, Some(*from));
        }
    }
    for s in &senders {
        s.collect(all[0].1.len(), "sender");
    }
}

#[test]
fn tagged_matching_with_ignore_bits_and_any_source() {
    let net = efa::device::loopback::LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    // Receives for tags 0x1?? (low byte ignored) and exactly 0x2001.
    b.ep.trecv(BytesMut::with_capacity(16), 0x2001, 0, 1)
        .unwrap();
    b.ep.trecv(BytesMut::with_capacity(16), 0x1000, 0xff, 2)
        .unwrap();
    a.ep.tsend(pb, Bytes::from_static(b"first-1xx"), 0x10ab, 10)
        .unwrap();
    a.ep.tsend(pb, Bytes::from_static(b"exact"), 0x2001, 11)
        .unwrap();
    a.ep.tsend(pb, Bytes::from_static(b"unmatched"), 0x3000, 12)
        .unwrap();
    let done = b.collect(2, "receiver");
    let by = |ctx| done.iter().find(|c| c.context == ctx).unwrap();
    assert_eq!(by(1).buf.as_recv().unwrap(), b"exact");
    assert_eq!(by(2).buf.as_recv().unwrap(), b"first-1xx");
    assert_eq!(by(2).tag, 0x10ab);
    // The unmatched one waits as unexpected: peek sees it, a later receive takes it.
    let deadline = Instant::now() + DEADLINE;
    let p = loop {
        match b.ep.peek(0x3000, 0, None, false) {
            Ok(p) => break p,
            Err(e) if e.kind() == ErrorKind::NoMessage => {
                b.ep.progress();
                assert!(Instant::now() < deadline);
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(p.len, 9);
    assert_eq!(
        b.ep.peek(0x4000, 0, None, false).unwrap_err().kind(),
        ErrorKind::NoMessage
    );
    b.ep.trecv(BytesMut::with_capacity(16), 0x3000, 0, 3)
        .unwrap();
    let done = b.collect(1, "receiver");
    assert_eq!(done[0].buf.as_recv().unwrap(), b"unmatched");
    assert_eq!(a.collect(3, "sender").len(), 3);
}

#[test]
fn truncation_cancel_and_errors_of_the_right_kind() {
    let net = efa::device::loopback::LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    for (k, len) in [100usize, 20_000, 200_000].into_iter().enumerate() {
        b.ep.recv(BytesMut::with_capacity(10), k as u64).unwrap();
        a.ep.send(pb, payload(1, k, len), k as u64).unwrap();
        let deadline = Instant::now() + DEADLINE;
        let err = loop {
            if let Some(e) = b.cq.read_err() {
                break e;
            }
            let _ = b.cq.poll(&mut Vec::new(), 0);
            a.ep.progress();
            assert!(Instant::now() < deadline, "no truncation error for {len}");
        };
        assert_eq!(err.error.kind(), ErrorKind::Truncated, "{len}");
        assert_eq!(err.len, 10, "{len}");
        assert_eq!(err.olen, len - 10, "{len}");
        assert_eq!(&err.buf.as_recv().unwrap()[..10], &payload(1, k, len)[..10]);
        // The sender still completes normally.
        assert!(
            a.collect(1, "sender")[0]
                .flags
                .contains(CompletionFlags::SEND)
        );
    }
    // Cancel hands the buffer back once.
    b.ep.recv(BytesMut::with_capacity(64), 77).unwrap();
    b.ep.cancel(77).unwrap();
    assert_eq!(b.ep.cancel(77).unwrap_err().kind(), ErrorKind::NoMessage);
    let mut e = None;
    for _ in 0..100 {
        e = b.cq.read_err();
        if e.is_some() {
            break;
        }
        b.ep.progress();
    }
    let e = e.expect("a Canceled completion");
    assert_eq!(e.error.kind(), ErrorKind::Canceled);
    assert_eq!(e.context, 77);
    assert!(e.buf.into_recv().is_some());
    // Unknown peer.
    let gone = a.insert("efa://[::1]:9:00000009".parse().unwrap());
    a.av.remove(gone).unwrap();
    let e = a.ep.send(gone, Bytes::from_static(b"x"), 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownPeer);
    assert_eq!(e.into_buffer().as_send().map(|b| &b[..]), Some(&b"x"[..]));
}

#[test]
fn closing_completes_everything_once() {
    let net = efa::device::loopback::LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let b = Node::new(&d);
    for i in 0..10 {
        b.ep.recv(BytesMut::with_capacity(64), i).unwrap();
    }
    let Node { cq, av: _av, ep } = b;
    drop(ep);
    let mut ctxs = Vec::new();
    while let Some(e) = cq.read_err() {
        assert_eq!(e.error.kind(), ErrorKind::Canceled);
        ctxs.push(e.context);
    }
    ctxs.sort_unstable();
    assert_eq!(ctxs, (0..10).collect::<Vec<_>>());
}

/// A minimal executor: the async API needs no particular runtime.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Arc::new(Unpark(std::thread::current())).into();
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

#[test]
fn async_send_and_recv_without_a_runtime_and_with_tokio() {
    let d = udp_domain(LOCAL4, FaultConfig::default());
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    let big = payload(7, 0, 300_000);
    let recv =
        b.ep.recv_async(BytesMut::with_capacity(300_000), RecvOptions::default());
    let send = a.ep.send_async(pb, big.clone(), SendOptions::default());
    // Both ends make progress at once (a long-CTS message needs the receiver's CTS): the receive
    // is awaited on another thread, each with the ten-line executor.
    let got = std::thread::scope(|s| {
        let r = s.spawn(|| block_on(recv));
        let sent = block_on(send).into_result().unwrap();
        assert_eq!(sent.len, 300_000);
        r.join().unwrap()
    });
    let got = got.into_result().unwrap();
    assert!(got.buf.as_recv().unwrap()[..] == big[..]);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let r = b.ep.recv_async(
            BytesMut::with_capacity(64),
            RecvOptions::default().with_tag(5, 0),
        );
        let s = a.ep.send_async(
            pb,
            Bytes::from_static(b"tokio"),
            SendOptions::default().with_tag(5),
        );
        let (r, s) = tokio::time::timeout(DEADLINE, async { tokio::join!(r, s) })
            .await
            .expect("timed out");
        assert!(matches!(s, OpOutcome::Done(_)));
        assert_eq!(r.into_result().unwrap().buf.as_recv().unwrap(), b"tokio");
    });
}

#[test]
fn dropping_a_receive_future_loses_no_message() {
    let d = udp_domain(LOCAL4, FaultConfig::default());
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    // Issue 17, defect 8: a receive future dropped before any message came is cancelled, so the
    // next receive gets the first message (it used to vanish into the dropped receive).
    drop(b.ep.recv_async(BytesMut::with_capacity(64), RecvOptions::default()));
    a.ep.send(pb, Bytes::from_static(b"one"), 1).unwrap();
    a.ep.send(pb, Bytes::from_static(b"two"), 2).unwrap();
    let r = block_on(b.ep.recv_async(BytesMut::with_capacity(64), RecvOptions::default()));
    assert_eq!(r.into_result().unwrap().buf.as_recv().unwrap(), b"one");
    let r = block_on(b.ep.recv_async(BytesMut::with_capacity(64), RecvOptions::default()));
    assert_eq!(r.into_result().unwrap().buf.as_recv().unwrap(), b"two");
    assert_eq!(a.collect(2, "sender").len(), 2);
    // A future dropped after its message arrived (never polled to the end): the message goes
    // back to matching and the next receive gets it.
    let f =
        b.ep.recv_async(BytesMut::with_capacity(64), RecvOptions::default());
    a.ep.send(pb, Bytes::from_static(b"three"), 3).unwrap();
    a.collect(1, "sender");
    let until = Instant::now() + Duration::from_millis(50);
    while Instant::now() < until {
        b.ep.progress();
    }
    drop(f);
    a.ep.send(pb, Bytes::from_static(b"four"), 4).unwrap();
    for want in [&b"three"[..], b"four"] {
        let r = block_on(b.ep.recv_async(BytesMut::with_capacity(64), RecvOptions::default()));
        assert_eq!(r.into_result().unwrap().buf.as_recv().unwrap(), want);
    }
    assert_eq!(b.ep.resources().unexpected_msgs, 0);
}

/// Issue 17, defect 8: receives under `tokio::time::timeout` and `select!` that lose the race
/// are dropped; every message still arrives, once and in order.
#[test]
fn tokio_timeout_and_select_lose_no_message() {
    let seed = efa::fault::test_seed();
    let d = udp_domain(LOCAL4, FaultConfig::default());
    let (a, b) = (Node::new(&d), Node::new(&d));
    let pb = a.insert(b.ep.addr());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let n = 200usize;
    let mut rng = efa::fault::Rng::new(seed);
    let got = rt.block_on(async {
        let mut got = Vec::new();
        let mut sent = 0usize;
        let deadline = Instant::now() + DEADLINE;
        while got.len() < n {
            assert!(
                Instant::now() < deadline,
                "seed {seed}: {} of {n}",
                got.len()
            );
            // Sometimes a message is on its way, sometimes not; the receive races a short
            // timer, and loses sometimes.
            if sent < n && rng.chance(0.5) {
                a.ep.send(pb, Bytes::from((sent as u32).to_le_bytes().to_vec()), 0)
                    .unwrap();
                sent += 1;
            }
            let r =
                b.ep.recv_async(BytesMut::with_capacity(8), RecvOptions::default());
            let out = if rng.chance(0.5) {
                tokio::time::timeout(Duration::from_micros(rng.below(300)), r)
                    .await
                    .ok()
            } else {
                tokio::select! {
                    o = r => Some(o),
                    _ = tokio::time::sleep(Duration::from_micros(rng.below(300))) => None,
                }
            };
            if let Some(o) = out {
                let c = o.into_result().unwrap();
                let v = c.buf.as_recv().unwrap();
                got.push(u32::from_le_bytes(v[..4].try_into().unwrap()) as usize);
            }
            let mut out = Vec::new();
            let _ = a.cq.poll(&mut out, 64);
        }
        got
    });
    assert_eq!(
        got,
        (0..n).collect::<Vec<_>>(),
        "seed {seed}: every message once, in order"
    );
}

#[test]
fn progress_thread_moves_data_while_nobody_polls() {
    let d = udp_domain(LOCAL4, FaultConfig::default());
    // One progress thread pinned to CPU 0, one "near the device" (a software device has no
    // NUMA node: unpinned).
    let mk = |cpu| {
        let cq = efa::CompletionQueue::new(&d, 256).unwrap();
        let av = efa::AddressVector::new(&d);
        let ep = Endpoint::<Rdm>::builder(&d)
            .cq(&cq)
            .av(&av)
            .progress_thread(true)
            .progress_cpu(cpu)
            .build()
            .unwrap();
        Node { cq, av, ep }
    };
    let (a, b) = (
        mk(efa::ProgressCpu::Cpu(0)),
        mk(efa::ProgressCpu::NearDevice),
    );
    let pb = a.insert(b.ep.addr());
    b.ep.recv(BytesMut::with_capacity(1 << 20), 1).unwrap();
    let msg = payload(3, 0, 1 << 20);
    a.ep.send(pb, msg.clone(), 2).unwrap();
    // Neither side polls: the progress threads must carry the long-CTS exchange to the end.
    let deadline = Instant::now() + DEADLINE;
    while b.cq.is_empty() || a.cq.is_empty() {
        assert!(
            Instant::now() < deadline,
            "progress thread did not complete the transfer"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let got = b.collect(1, "receiver");
    assert!(got[0].buf.as_recv().unwrap()[..] == msg[..]);
}

#[test]
fn progress_thread_on_an_impossible_cpu_is_refused() {
    let d = udp_domain(LOCAL4, FaultConfig::default());
    let cq = efa::CompletionQueue::new(&d, 16).unwrap();
    let e = Endpoint::<Rdm>::builder(&d)
        .cq(&cq)
        .progress_cpu(efa::ProgressCpu::Cpu(1 << 20))
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn rdm_endpoint_is_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<Endpoint<Rdm>>();
}

#[test]
fn multi_recv_directed_and_delivery_complete() {
    let net = efa::device::loopback::LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let (a, b, c) = (Node::new(&d), Node::new(&d), Node::new(&d));
    let (pa, pc) = (b.insert(a.ep.addr()), b.insert(c.ep.addr()));
    let pb_a = a.insert(b.ep.addr());
    let pb_c = c.insert(b.ep.addr());
    // Directed: the receive for c's message is posted first but only takes c's.
    b.ep.recv_with(
        BytesMut::with_capacity(16),
        RecvOptions::default().with_from(pc),
        1,
    )
    .unwrap();
    b.ep.recv_with(
        BytesMut::with_capacity(16),
        RecvOptions::default().with_from(pa),
        2,
    )
    .unwrap();
    a.ep.send_with(
        pb_a,
        Bytes::from_static(b"from a"),
        SendOptions::default().with_delivery_complete(true),
        10,
    )
    .unwrap();
    let done = b.collect(1, "receiver");
    assert_eq!(done[0].context, 2);
    assert_eq!(done[0].source, Some(pa));
    // Delivery complete: the sender's completion comes after the RECEIPT.
    assert_eq!(a.collect(1, "sender")[0].context, 10);
    c.ep.send(pb_c, Bytes::from_static(b"from c"), 11).unwrap();
    let done = b.collect(1, "receiver");
    assert_eq!((done[0].context, done[0].source), (1, Some(pc)));
    c.collect(1, "sender c");

    // Multi-receive: one 1 KiB buffer takes messages until less than 200 bytes remain.
    let o = RecvOptions::default().with_multi_recv(200);
    b.ep.recv_with(BytesMut::with_capacity(1024), o, 50)
        .unwrap();
    for i in 0..4u8 {
        a.ep.send(pb_a, Bytes::from(vec![i; 250]), 20 + u64::from(i))
            .unwrap();
    }
    // 1024 bytes take four 250-byte messages; the 24 left are below 200, so a fifth completion
    // retires the buffer.
    let done = b.collect(5, "multi-recv");
    let parts: Vec<_> = done.iter().filter(|c| c.len == 250).collect();
    assert_eq!(parts.len(), 4, "{done:?}");
    for (i, p) in parts.iter().enumerate() {
        assert_eq!(p.context, 50);
        assert!(p.buf.as_recv().unwrap().iter().all(|&x| x == i as u8));
    }
    assert!(
        done.iter()
            .any(|c| c.flags.contains(efa::CompletionFlags::MULTI_RECV)),
        "the buffer is retired"
    );
    // A tagged multi-receive is refused and handed back.
    let o = RecvOptions::default().with_multi_recv(10).with_tag(1, 0);
    let e =
        b.ep.recv_with(BytesMut::with_capacity(64), o, 51)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.into_buffer().into_recv().is_some());
}

#[test]
fn rdm_needs_a_routable_device_address() {
    let dev = efa::device::udp::UdpDevice::open(
        efa::device::udp::UdpConfig::default().with_bind("0.0.0.0".parse().unwrap()),
    )
    .unwrap();
    let d = efa::Domain::with_device(dev, efa::Config::default());
    let cq = efa::CompletionQueue::new(&d, 8).unwrap();
    let av = efa::AddressVector::new(&d);
    let e = Endpoint::<Rdm>::builder(&d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("routable"), "{e}");
}

/// A sender that runs far ahead of its receiver (more unexpected data than the engine may
/// hold) is slowed by receiver-not-ready, never by dropping what it sent.
#[test]
fn flooding_sender_is_throttled_not_dropped() {
    let net = efa::device::loopback::LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    let (a, b) = (Node::new(&d), Node::new(&d));
    flood_then_receive(&a, &b, None);
}

#[test]
fn a_refused_receive_hands_its_own_buffer_back() {
    // Regression: a receive refused by the engine (`Again` on a full receive queue) used to hand
    // back an empty buffer instead of the one posted, so a retry posted a zero-byte buffer and
    // the message completed `Truncated`.
    let d = udp_domain(LOCAL4, FaultConfig::default());
    let cq = efa::CompletionQueue::new(&d, 64).unwrap();
    let av = efa::AddressVector::new(&d);
    let ep = Endpoint::<Rdm>::builder(&d)
        .cq(&cq)
        .av(&av)
        .rx_size(4)
        .build()
        .unwrap();
    let mut refused = None;
    for i in 0..16 {
        let mut b = BytesMut::with_capacity(5000);
        b.extend_from_slice(b"old contents");
        match ep.recv(b, i) {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Again);
                refused = Some(e.into_buffer().into_recv().expect("the BytesMut back"));
                break;
            }
        }
    }
    let b = refused.expect("a receive queue of 4 refuses the fifth receive");
    assert!(b.capacity() >= 5000, "capacity {}", b.capacity());
    assert_eq!(&b[..], b"old contents");
}

/// Sends `n` messages from `a` to `b` over one completion queue shared by both, polled `max` at a
/// time: every send and every receive completes once, the receives in their posting order
/// (completions that go straight to the polling thread and those queued keep one order).
fn shared_queue_in_order(d: &efa::Domain, local_path: bool, max: usize) {
    let cq = efa::CompletionQueue::new(d, 64).unwrap();
    let av = efa::AddressVector::new(d);
    let ep = |on| {
        Endpoint::<Rdm>::builder(d)
            .cq(&cq)
            .av(&av)
            .local_path(on)
            .build()
            .unwrap()
    };
    let (a, b) = (ep(local_path), ep(local_path));
    let pb = av.insert(b.addr()).unwrap();
    let n = 300u64;
    let (mut recvs, mut sends) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    let sort = |out: &mut Vec<efa::Completion>, recvs: &mut Vec<u64>, sends: &mut Vec<u64>| {
        for c in out.drain(..) {
            if c.flags.contains(CompletionFlags::RECV) {
                assert_eq!(c.len, 8);
                recvs.push(c.context);
            } else {
                sends.push(c.context);
            }
        }
    };
    for i in 0..n {
        b.recv(BytesMut::with_capacity(8), 1000 + i).unwrap();
        loop {
            match a.send(pb, Bytes::copy_from_slice(&i.to_le_bytes()), i) {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Again => {
                    cq.poll(&mut out, max).unwrap();
                    sort(&mut out, &mut recvs, &mut sends);
                }
                Err(e) => panic!("send {i}: {e}"),
            }
        }
        // Leave some in flight between polls.
        if i % 3 == 0 {
            let k = cq.poll(&mut out, max).unwrap();
            assert!(k <= max);
            sort(&mut out, &mut recvs, &mut sends);
        }
    }
    while recvs.len() < n as usize || sends.len() < n as usize {
        let k = cq.poll(&mut out, max).unwrap();
        assert!(k <= max && out.len() == k, "{k} of at most {max}");
        sort(&mut out, &mut recvs, &mut sends);
        assert!(
            Instant::now() < deadline,
            "{} recvs, {} sends",
            recvs.len(),
            sends.len()
        );
    }
    // Eager messages matched in posting order complete in that order; sends complete as the
    // device acknowledges them (no order is promised, as in libfabric), each once.
    assert_eq!(
        recvs,
        (1000..1000 + n).collect::<Vec<_>>(),
        "receives once, in order"
    );
    sends.sort_unstable();
    assert_eq!(
        sends,
        (0..n).collect::<Vec<_>>(),
        "every send completes once"
    );
    assert!(cq.is_empty());
}

#[test]
fn a_shared_queue_polled_a_few_at_a_time_keeps_each_order() {
    let net = efa::device::loopback::LoopbackNetwork::new(FaultConfig::default());
    let d = loopback_domain(&net);
    for max in [1, 2, 7] {
        shared_queue_in_order(&d, true, max);
    }
    let dir = shm_test_dir("efa-rdm-test-");
    let (d, _) = shm_domain(dir.path());
    for (on, max) in [(true, 1), (true, 3), (false, 1), (false, 5)] {
        shared_queue_in_order(&d, on, max);
    }
}

/// A server that never inserted its client (it learns of it from the first packet) gets every
/// message, eager, medium and long-CTS, intact and in order, with no `FI_SOURCE`; its replies
/// reach the client once it inserts the address. On the efa device (`EFA_TEST_DEVICE=efa`) under
/// an emulated NIC without `cq_with_sgid`, the receiver's device knows only the sender's queue
/// pair number: the engine identifies it by the raw address header of its REQ packets.
#[test]
fn a_server_gets_messages_from_a_client_it_never_inserted() {
    let d = udp_domain(LOCAL4, FaultConfig::default());
    let server = Node::new(&d);
    let client = Node::new(&udp_domain(LOCAL4, FaultConfig::default()));
    let to_server = client.insert(server.ep.addr());
    let sizes = [100usize, 20_000, 200_000, 7];
    for (i, _) in sizes.iter().enumerate() {
        server
            .ep
            .recv(BytesMut::with_capacity(256 << 10), i as u64)
            .unwrap();
    }
    for (i, &n) in sizes.iter().enumerate() {
        client
            .ep
            .send(to_server, payload(5, i, n), 100 + i as u64)
            .unwrap();
    }
    let mut got = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while got.len() < sizes.len() {
        client.ep.progress();
        got.extend(server.collect_some());
        assert!(
            Instant::now() < deadline,
            "{} of {} arrived; server {:?}",
            got.len(),
            sizes.len(),
            server.ep.stats()
        );
    }
    for c in &got {
        let i = c.context as usize;
        assert_eq!(
            c.buf.as_recv().unwrap()[..],
            payload(5, i, sizes[i])[..],
            "message {i}"
        );
        assert_eq!(
            c.source, None,
            "the client is not in the server's address vector"
        );
    }
    client.collect(sizes.len(), "client sends");
    // The server inserts the client (as a program would after reading its address) and replies.
    let to_client = server.insert(client.ep.addr());
    client.ep.recv(BytesMut::with_capacity(64), 9).unwrap();
    server
        .ep
        .send(to_client, Bytes::from_static(b"reply"), 10)
        .unwrap();
    let mut back = Vec::new();
    while !back.iter().any(|c: &efa::Completion| c.context == 9) {
        server.ep.progress();
        back.extend(client.collect_some());
        assert!(Instant::now() < deadline, "no reply");
    }
    let r = back.iter().find(|c| c.context == 9).unwrap();
    assert_eq!(r.buf.as_recv().unwrap(), &b"reply"[..]);
}

/// A message from a sender the receiver's address vector does not hold carries the sender's raw
/// address (`Completion::source_addr`, `FI_SOURCE_ERR`); once inserted, its messages carry the
/// `PeerId` instead (issue 28).
#[test]
fn a_message_from_an_unknown_sender_carries_its_address() {
    let net = faulty_net(test_seed());
    let d = loopback_domain(&net);
    for local_path in [true, false] {
        let a = Node::with_local_path(&d, local_path);
        let b = Node::with_local_path(&d, local_path);
        let pb = a.av.insert(b.ep.addr()).unwrap();
        b.ep.recv(BytesMut::with_capacity(16), 1).unwrap();
        a.ep.send(pb, Bytes::from_static(b"who am I"), 2).unwrap();
        let got = wait_recv(&b, &a, 1);
        assert_eq!(got.source, None, "local_path {local_path}");
        assert_eq!(
            got.source_addr,
            Some(a.ep.addr()),
            "local_path {local_path}"
        );
        let pa = b.av.insert(got.source_addr.unwrap()).unwrap();
        b.ep.recv(BytesMut::with_capacity(16), 3).unwrap();
        a.ep.send(pb, Bytes::from_static(b"known now"), 4).unwrap();
        let got = wait_recv(&b, &a, 3);
        assert_eq!((got.source, got.source_addr), (Some(pa), None));
    }
}

/// The receive completion of context `ctx` at `b`, progressing `a` meanwhile.
fn wait_recv(b: &Node, a: &Node, ctx: u64) -> efa::Completion {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    loop {
        let _ = a.cq.poll(&mut out, 16);
        let _ = b.cq.poll(&mut out, 16);
        if let Some(i) = out
            .iter()
            .position(|c| c.context == ctx && c.flags.contains(CompletionFlags::RECV))
        {
            return out.swap_remove(i);
        }
        assert!(Instant::now() < deadline, "no receive completion {ctx}");
    }
}
