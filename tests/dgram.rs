//! Endpoint<Dgram> over the udp and loopback devices: data intact, immediate data, FI_SOURCE,
//! errors of the right kind, buffers handed back, and two processes over udp.

mod common;

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::{
    Access, AddressVector, Buffer, Completion, CompletionFlags, CompletionQueue, Dgram, Domain,
    Endpoint, EpType, ErrorKind, Hints, getinfo,
};

const WAIT: Duration = Duration::from_secs(20);

/// A domain of `provider`; with `EFA_TEST_DEVICE=efa` the udp tests run on the `efa` device
/// (under the emulated NIC) instead.
fn domain(provider: &str, mut addr: Option<IpAddr>) -> Domain {
    let mut provider = provider;
    if provider == "udp" && common::on_efa() {
        provider = "efa";
        addr = None;
    }
    let mut h = Hints::new().provider(provider).ep_type(EpType::Dgram);
    if let Some(a) = addr {
        h = h.addr(a);
    }
    let info = getinfo(&h).expect("getinfo").remove(0);
    Domain::open(&info).expect("domain")
}

struct Pair {
    cq: CompletionQueue,
    av: AddressVector,
    a: Endpoint<Dgram>,
    b: Endpoint<Dgram>,
}

fn pair(d: &Domain) -> Pair {
    let cq = CompletionQueue::new(d, 4096).unwrap();
    let av = AddressVector::new(d);
    let a = Endpoint::<Dgram>::builder(d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let b = Endpoint::<Dgram>::builder(d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    Pair { cq, av, a, b }
}

/// Reads completions until `n` arrived (errors fail the test).
fn collect(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < n {
        let want = n - out.len();
        match cq.wait(&mut out, want, Some(Duration::from_millis(100))) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::TimedOut => {}
            Err(e) => panic!("cq error: {e} / {:?}", cq.read_err()),
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} completions arrived",
            out.len()
        );
    }
    out
}

fn providers() -> Vec<(&'static str, Option<IpAddr>)> {
    vec![
        ("loopback", None),
        ("udp", Some(IpAddr::V4(Ipv4Addr::LOCALHOST))),
        ("udp", Some(IpAddr::V6(Ipv6Addr::LOCALHOST))),
    ]
}

#[test]
fn datagrams_arrive_intact_with_data_and_source() {
    for (p, addr) in providers() {
        let d = domain(p, addr);
        let t = pair(&d);
        let pb = t.av.insert(t.b.addr()).unwrap();
        let pa = t.av.insert(t.a.addr()).unwrap();
        let n = 64usize;
        for i in 0..n {
            t.b.recv(BytesMut::with_capacity(d.attr().mtu), 1000 + i as u64)
                .unwrap();
        }
        let mut sent = HashSet::new();
        for i in 0..n {
            let len = (i * 131) % (d.attr().mtu + 1);
            let msg: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
            sent.insert(msg.clone());
            t.a.send_data(pb, msg, i as u32, i as u64).unwrap();
        }
        let done = collect(&t.cq, 2 * n);
        let mut got = HashSet::new();
        let mut sends = 0;
        for c in done {
            if c.flags.contains(CompletionFlags::SEND) {
                sends += 1;
                assert!(c.buf.as_send().is_some(), "{p}: send buffer handed back");
                continue;
            }
            assert!(
                c.flags
                    .contains(CompletionFlags::RECV | CompletionFlags::REMOTE_CQ_DATA),
                "{p}"
            );
            assert_eq!(c.source, Some(pa), "{p}: FI_SOURCE names the sender");
            let data = c.buf.as_recv().unwrap().to_vec();
            assert_eq!(c.len, data.len());
            let i = c.data.unwrap() as usize;
            assert_eq!(
                data.len(),
                (i * 131) % (d.attr().mtu + 1),
                "{p}: length of message {i}"
            );
            assert!(
                data.iter().enumerate().all(|(j, &b)| b == (i + j) as u8),
                "{p}: payload of {i}"
            );
            assert!(got.insert(data), "{p}: message {i} delivered twice");
        }
        assert_eq!(sends, n, "{p}: every send completes once");
        assert_eq!(
            got, sent,
            "{p}: every datagram arrives once (no loss on an idle local link)"
        );
        assert_eq!(t.a.stats().tx_msgs, n as u64);
        assert_eq!(t.b.stats().rx_msgs, n as u64);
    }
}

#[test]
fn oversize_is_msgsize_and_hands_the_buffer_back() {
    for (p, addr) in providers() {
        let d = domain(p, addr);
        let t = pair(&d);
        let pb = t.av.insert(t.b.addr()).unwrap();
        let big = Bytes::from(vec![7u8; t.a.max_msg_size() + 1]);
        let e = t.a.send(pb, big.clone(), 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MsgSize, "{p}");
        assert_eq!(e.into_buffer().as_send(), Some(&big), "{p}: nothing lost");
    }
}

#[test]
fn unknown_or_removed_peer_is_refused() {
    let d = domain("loopback", None);
    let t = pair(&d);
    let pb = t.av.insert(t.b.addr()).unwrap();
    t.av.remove(pb).unwrap();
    let e = t.a.send(pb, Bytes::from_static(b"x"), 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnknownPeer);
    // A reused slot does not revive the old id.
    let pb2 = t.av.insert(t.b.addr()).unwrap();
    assert_eq!(pb2.index(), pb.index());
    assert_eq!(
        t.a.send(pb, Bytes::from_static(b"x"), 1)
            .unwrap_err()
            .kind(),
        ErrorKind::UnknownPeer
    );
    t.a.send(pb2, Bytes::from_static(b"x"), 1).unwrap();
}

#[test]
fn full_queues_say_again() {
    let d = domain("loopback", None);
    let cq = CompletionQueue::new(&d, 64).unwrap();
    let av = AddressVector::new(&d);
    let a = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .rx_size(4)
        .tx_size(4)
        .build()
        .unwrap();
    for i in 0..4 {
        a.recv(BytesMut::with_capacity(16), i).unwrap();
    }
    let e = a.recv(BytesMut::with_capacity(16), 9).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Again);
    assert_eq!(
        e.into_buffer().into_recv().map(|b| b.capacity() >= 16),
        Some(true)
    );
    assert!(a.stats().again >= 1);
}

#[test]
fn short_buffer_gives_truncated_error_completion() {
    for (p, addr) in providers() {
        let d = domain(p, addr);
        let t = pair(&d);
        let pb = t.av.insert(t.b.addr()).unwrap();
        t.b.recv(BytesMut::with_capacity(8), 77).unwrap();
        t.a.send(pb, vec![1u8; 100], 1).unwrap();
        let deadline = Instant::now() + WAIT;
        let err = loop {
            let mut v = Vec::new();
            match t.cq.poll(&mut v, 8) {
                Err(e) if e.kind() == ErrorKind::ErrorAvailable => {
                    // What `?` would print says which operation failed and why.
                    let text = e.to_string();
                    assert!(text.contains("context 77"), "{p}: {text}");
                    assert!(text.to_lowercase().contains("trunc"), "{p}: {text}");
                    break t.cq.read_err().unwrap();
                }
                _ => assert!(Instant::now() < deadline, "{p}: no error completion"),
            }
        };
        assert_eq!(err.context, 77, "{p}");
        assert_eq!(err.error.kind(), ErrorKind::Truncated, "{p}");
        assert_eq!(err.olen, 92, "{p}: the overflow length");
        assert!(
            matches!(err.buf, Buffer::Recv(_)),
            "{p}: buffer handed back"
        );
    }
}

#[test]
fn closing_an_endpoint_cancels_its_receives_once() {
    for (p, addr) in providers() {
        let d = domain(p, addr);
        let cq = CompletionQueue::new(&d, 64).unwrap();
        let av = AddressVector::new(&d);
        let a = Endpoint::<Dgram>::builder(&d)
            .cq(&cq)
            .av(&av)
            .build()
            .unwrap();
        for i in 0..5 {
            a.recv(BytesMut::with_capacity(32), i).unwrap();
        }
        drop(a);
        let mut ctxs = Vec::new();
        while let Some(e) = cq.read_err() {
            assert_eq!(e.error.kind(), ErrorKind::Canceled, "{p}");
            assert!(e.buf.into_recv().is_some(), "{p}: buffer handed back");
            ctxs.push(e.context);
        }
        ctxs.sort_unstable();
        assert_eq!(ctxs, vec![0, 1, 2, 3, 4], "{p}: one completion per receive");
        assert!(cq.is_empty());
    }
}

#[test]
fn msg_prefix_mode_reserves_forty_bytes() {
    let d = domain("loopback", None);
    let cq = CompletionQueue::new(&d, 64).unwrap();
    let av = AddressVector::new(&d);
    let a = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .msg_prefix(true)
        .build()
        .unwrap();
    let b = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .msg_prefix(true)
        .build()
        .unwrap();
    let pb = av.insert(b.addr()).unwrap();
    assert_eq!(
        a.send(pb, vec![0u8; 39], 1).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    b.recv(BytesMut::with_capacity(40 + 16), 5).unwrap();
    let mut msg = vec![0xAAu8; 40];
    msg.extend_from_slice(b"payload");
    a.send(pb, msg, 6).unwrap();
    let done = collect(&cq, 2);
    let r = done.iter().find(|c| c.context == 5).unwrap();
    assert_eq!(r.len, 40 + 7);
    let buf = r.buf.as_recv().unwrap();
    assert_eq!(&buf[40..], b"payload");
    assert!(buf[..40].iter().all(|&x| x == 0));
}

#[test]
fn registered_regions_are_sent_and_received() {
    let d = domain("loopback", None);
    let t = pair(&d);
    let pb = t.av.insert(t.b.addr()).unwrap();
    let rx = d.register(vec![0u8; 64], Access::RECV).unwrap();
    t.b.recv(rx, 1).unwrap();
    let mut tx = d.register(vec![0u8; 16], Access::SEND).unwrap();
    tx.write().copy_from_slice(b"0123456789abcdef");
    t.a.send(pb, tx, 2).unwrap();
    let done = collect(&t.cq, 2);
    let r = done.into_iter().find(|c| c.context == 1).unwrap();
    assert_eq!(r.len, 16);
    assert!(
        r.buf.as_recv().is_none(),
        "a region is read through its guard"
    );
    let region = r.buf.into_region().unwrap();
    assert_eq!(&region.read()[..16], b"0123456789abcdef");
    // A region without RECV access is refused and handed back.
    let wrong = d.register(vec![0u8; 8], Access::SEND).unwrap();
    let e = t.b.recv(wrong, 3).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.into_buffer().into_region().is_some());
}

#[test]
fn separate_tx_and_rx_queues_and_blocking_wait() {
    let d = domain("udp", Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    let tx = CompletionQueue::new(&d, 16).unwrap();
    let rx = CompletionQueue::new(&d, 16).unwrap();
    let av = AddressVector::new(&d);
    let a = Endpoint::<Dgram>::builder(&d)
        .tx_cq(&tx)
        .rx_cq(&rx)
        .av(&av)
        .build()
        .unwrap();
    let b = Endpoint::<Dgram>::builder(&d)
        .tx_cq(&tx)
        .rx_cq(&rx)
        .av(&av)
        .build()
        .unwrap();
    let pb = av.insert(b.addr()).unwrap();
    let mut out = Vec::new();
    let e = rx
        .wait(&mut out, 1, Some(Duration::from_millis(20)))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    b.recv(BytesMut::with_capacity(64), 1).unwrap();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        a.send(pb, Bytes::from_static(b"wake up"), 2).unwrap();
        a
    });
    let start = std::time::Instant::now();
    let n = rx.wait(&mut out, 1, Some(WAIT)).unwrap();
    // Woken by the arrival, not by the deadline (on the efa device without CQ notifications,
    // the device's polling tick wakes it: issue 30, point 3).
    assert!(
        start.elapsed() < WAIT / 2,
        "the wait returned only at its deadline: nothing woke it"
    );
    assert_eq!(n, 1);
    assert_eq!(out[0].buf.as_recv().unwrap(), b"wake up");
    let _a = sender.join().unwrap();
    let sends = collect(&tx, 1);
    assert_eq!(sends[0].context, 2);
}

/// A minimal executor: proves the async wait needs no particular runtime.
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
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

#[test]
fn async_wait_without_a_runtime_and_with_tokio() {
    for (p, addr) in providers() {
        let d = domain(p, addr);
        let t = pair(&d);
        let pb = t.av.insert(t.b.addr()).unwrap();
        t.b.recv(BytesMut::with_capacity(64), 1).unwrap();
        let a = t.a;
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            a.send(pb, Bytes::from_static(b"async"), 2).unwrap();
            a
        });
        let mut out = Vec::new();
        while !out.iter().any(|c: &Completion| c.context == 1) {
            block_on(t.cq.next_batch(&mut out, 8)).unwrap();
        }
        let _a = sender.join().unwrap();

        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        t.b.recv(BytesMut::with_capacity(64), 3).unwrap();
        let a2 = Endpoint::<Dgram>::builder(&d)
            .cq(&t.cq)
            .av(&t.av)
            .build()
            .unwrap();
        let got = rt.block_on(async {
            let cq = t.cq.clone();
            let wait = async move {
                let mut out = Vec::new();
                while !out.iter().any(|c: &Completion| c.context == 3) {
                    cq.next_batch(&mut out, 8).await.unwrap();
                }
                out
            };
            let send = async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                a2.send(pb, Bytes::from_static(b"tokio"), 4).unwrap();
            };
            let (out, ()) = tokio::join!(tokio::time::timeout(WAIT, wait), send);
            out.expect("async wait timed out")
        });
        let r = got.into_iter().find(|c| c.context == 3).unwrap();
        assert_eq!(r.buf.as_recv().unwrap(), b"tokio", "{p}");
    }
}

#[test]
fn garbage_on_the_udp_socket_is_dropped_and_counted() {
    // The udp device itself (its socket and counters), whatever EFA_TEST_DEVICE says.
    let info = getinfo(
        &Hints::new()
            .provider("udp")
            .ep_type(EpType::Dgram)
            .addr(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    )
    .expect("getinfo")
    .remove(0);
    let d = Domain::open(&info).expect("domain");
    let t = pair(&d);
    let pb = t.av.insert(t.b.addr()).unwrap();
    let seed = efa::fault::test_seed();
    let mut rng = efa::fault::Rng::new(seed);
    let sock = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let target = (Ipv4Addr::LOCALHOST, t.b.addr().qpn);
    for _ in 0..500 {
        let len = rng.below(200) as usize;
        let junk: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        sock.send_to(&junk, target).unwrap();
    }
    t.b.recv(BytesMut::with_capacity(64), 1).unwrap();
    // Garbage may only be recognised as such; a real datagram still arrives intact.
    let deadline = Instant::now() + WAIT;
    while d.device_stats().malformed_dropped < 400 {
        t.cq.poll(&mut Vec::new(), 0).ok();
        assert!(
            Instant::now() < deadline,
            "seed {seed}: garbage not counted: {:?}",
            d.device_stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    t.a.send(pb, Bytes::from_static(b"still works"), 2).unwrap();
    let done = collect(&t.cq, 2);
    let r = done.iter().find(|c| c.context == 1).unwrap();
    assert_eq!(r.buf.as_recv().unwrap(), b"still works", "seed {seed}");
}

/// Runs in a child process: echoes datagrams back to the parent over udp.
#[test]
#[ignore = "helper run by two_processes_exchange_datagrams_over_udp in a child process"]
fn child_echo() {
    let Ok(parent) = std::env::var("EFA_TEST_PARENT_ADDR") else {
        return;
    };
    let d = domain("udp", Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    let cq = CompletionQueue::new(&d, 256).unwrap();
    let av = AddressVector::new(&d);
    let ep = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let parent = av.insert(parent.parse().unwrap()).unwrap();
    for i in 0..32 {
        ep.recv(BytesMut::with_capacity(2048), i).unwrap();
    }
    // Announce our address on stdout, then echo every datagram until "quit".
    println!("CHILD_ADDR {}", ep.addr());
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "child: no quit; device {:?}",
            d.device_stats()
        );
        let mut out = Vec::new();
        let _ = cq.wait(&mut out, 16, Some(Duration::from_millis(100)));
        for c in out {
            if c.flags.contains(CompletionFlags::RECV) {
                let buf = c.buf.into_recv().unwrap();
                if &buf[..] == b"quit" {
                    return;
                }
                ep.send(parent, Bytes::copy_from_slice(&buf), 0).unwrap();
                ep.recv(buf, 0).unwrap();
            }
        }
    }
}

#[test]
fn two_processes_exchange_datagrams_over_udp() {
    use std::io::{BufRead, BufReader};
    let d = domain("udp", Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    let cq = CompletionQueue::new(&d, 256).unwrap();
    let av = AddressVector::new(&d);
    let ep = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    for i in 0..32 {
        ep.recv(BytesMut::with_capacity(2048), i).unwrap();
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_echo",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("EFA_TEST_PARENT_ADDR", ep.addr().to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let child_addr = loop {
        let l = lines
            .next()
            .expect("child exited before announcing its address")
            .unwrap();
        // libtest may print "test child_echo ... " in front of it on the same line.
        if let Some((_, a)) = l.split_once("CHILD_ADDR ") {
            break a.parse().unwrap();
        }
    };
    let peer = av.insert(child_addr).unwrap();
    let mut got = HashSet::new();
    let deadline = Instant::now() + WAIT;
    // One datagram at a time; UD may drop, so a datagram whose echo is late is sent again
    // (distinct payloads make any duplicate visible).
    for i in 0..100 {
        let msg = format!("datagram {i}");
        'resend: loop {
            assert!(
                Instant::now() < deadline,
                "only {} of 100 echoes",
                got.len()
            );
            ep.send(peer, Bytes::from(msg.clone().into_bytes()), 0)
                .unwrap();
            let wait_until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < wait_until {
                let mut out = Vec::new();
                let _ = cq.wait(&mut out, 16, Some(Duration::from_millis(10)));
                for c in out {
                    if c.flags.contains(CompletionFlags::RECV) {
                        assert_eq!(c.source, Some(peer), "FI_SOURCE names the child");
                        let buf = c.buf.into_recv().unwrap();
                        let echo = String::from_utf8(buf.to_vec()).unwrap();
                        ep.recv(buf, 0).unwrap();
                        if echo == msg {
                            got.insert(echo);
                            break 'resend;
                        }
                    }
                }
            }
        }
    }
    for _ in 0..3 {
        ep.send(peer, Bytes::from_static(b"quit"), 0).unwrap();
    }
    let expected: HashSet<String> = (0..100).map(|i| format!("datagram {i}")).collect();
    assert_eq!(got, expected);
    assert!(child.wait().unwrap().success(), "child failed");
}

/// `inject`: the bytes are copied before the call returns (the buffer is overwritten at once),
/// every datagram arrives intact with its immediate data, and no send completion is written.
#[test]
fn injected_datagrams_arrive_without_send_completions() {
    for (p, addr) in providers() {
        let d = domain(p, addr);
        let t = pair(&d);
        let pb = t.av.insert(t.b.addr()).unwrap();
        let max = t.a.inject_size();
        assert!(max > 0, "{p}: inject_size");
        let n = 48usize;
        for i in 0..n {
            t.b.recv(BytesMut::with_capacity(max), i as u64).unwrap();
        }
        let mut buf = Vec::new();
        for i in 0..n {
            buf.clear();
            buf.extend((0..i % (max + 1)).map(|j| (i * 7 + j) as u8));
            t.a.inject_data(pb, &buf, i as u32).unwrap();
            buf.iter_mut().for_each(|x| *x = !*x);
        }
        let done = collect(&t.cq, n);
        let mut seen = HashSet::new();
        for c in &done {
            assert!(
                c.flags.contains(CompletionFlags::RECV),
                "{p}: a send completed"
            );
            let i = c.data.unwrap() as usize;
            let data = c.buf.as_recv().unwrap();
            assert_eq!(data.len(), i % (max + 1), "{p}: length of {i}");
            assert!(
                data.iter()
                    .enumerate()
                    .all(|(j, &b)| b == (i * 7 + j) as u8),
                "{p}: payload of {i}"
            );
            assert!(seen.insert(i), "{p}: datagram {i} twice");
        }
        // Nothing more comes: no send completions.
        let mut out = Vec::new();
        let until = Instant::now() + Duration::from_millis(20);
        while Instant::now() < until {
            t.cq.poll(&mut out, 16).unwrap();
        }
        assert!(out.is_empty(), "{p}: injects completed: {}", out.len());
        assert_eq!(t.a.stats().tx_msgs, n as u64, "{p}");
        // Refusals: too long, unknown peer.
        let e = t.a.inject(pb, &vec![0u8; max + 1]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{p}: {e}");
        let gone = t.av.insert(t.a.addr()).unwrap();
        t.av.remove(gone).unwrap();
        let e = t.a.inject(gone, b"x").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnknownPeer, "{p}: {e}");
    }
}

/// Many addresses at once (`fi_av_insert` with a count, issue 28): ids in order, lookups agree,
/// a known address keeps its id; an invalid one refuses the whole list with nothing inserted.
#[test]
fn insert_many_is_in_order_and_all_or_nothing() {
    let d = domain("loopback", None);
    let av = AddressVector::new(&d);
    let gid = efa::Gid::default();
    let first = av.insert(efa::RawAddr::new(gid, 9, 1)).unwrap();
    let addrs: Vec<efa::RawAddr> = (7..=10).map(|q| efa::RawAddr::new(gid, q, 1)).collect();
    let ids = av.insert_many(&addrs).unwrap();
    assert_eq!(ids.len(), 4);
    for (id, a) in ids.iter().zip(&addrs) {
        assert_eq!(av.lookup(*id).unwrap(), *a);
    }
    assert_eq!(ids[2], first, "an address already there keeps its id");
    assert_eq!(av.len(), 4);
    let bad = [efa::RawAddr::new(gid, 20, 1), efa::RawAddr::new(gid, 0, 1)];
    let e = av.insert_many(&bad).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(av.len(), 4, "nothing inserted");
}
