//! Batches, scatter-gather and inject (issue 27): `write_batch` / `read_batch`, the iov forms
//! of writes, reads, sends and receives, `inject_write` / `inject_write_data`.

use std::collections::VecDeque;

use super::*;
use efa::{Buffer, ReadRequest, RecvOptions, SendOptions, WriteRequest};

/// Posts every request of `reqs` with `post` (a batch call), progressing both ends while the
/// endpoint is full; returns how many batch calls it took.
fn post_all<R>(
    p: &Pair,
    reqs: &mut VecDeque<R>,
    what: &str,
    post: impl Fn(&mut VecDeque<R>) -> Result<usize, efa::BatchError>,
) -> usize {
    let deadline = Instant::now() + DEADLINE;
    let mut calls = 0;
    while !reqs.is_empty() {
        calls += 1;
        let n = post(reqs).unwrap_or_else(|e| panic!("{what}: {e}"));
        if n == 0 {
            p.a.ep.progress();
            p.b.ep.progress();
            assert!(Instant::now() < deadline, "{what}: kept getting Again");
        }
    }
    calls
}

/// 96 writes of mixed sizes (from pages of one region and from `Bytes`) posted in batches of
/// 32, then read back in batches into `BytesMut`s and slices: each completes exactly once and
/// hands back its own buffer, the data is where it was written.
fn batches(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let sizes: Vec<usize> = (0..96)
        .map(|i| [1, 64, 4096, 9000, 70_000][i % 5])
        .collect();
    let stride = 70_000 + 16;
    let (target, rk) = target_region(
        &p,
        stride * sizes.len(),
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let dom = p.a.ep.domain().clone();
    let mut src = dom
        .register(vec![0u8; stride * sizes.len()], Access::WRITE)
        .unwrap();
    let mut reqs = VecDeque::new();
    for (i, &len) in sizes.iter().enumerate() {
        let data = payload(seed, i, len);
        let mut page = src.split_to(stride).unwrap();
        let buf = if i % 2 == 0 {
            let _rest = page.split_off(len).unwrap();
            page.write().copy_from_slice(&data);
            page.into()
        } else {
            data.into()
        };
        let mut options = WriteOptions::default().with_delivery_complete(i % 7 == 0);
        options.data = (i % 3 == 0).then_some(i as u32);
        reqs.push_back(WriteRequest {
            peer: p.peer_b,
            buf,
            to: rk.at((i * stride) as u64),
            options,
            context: i as u64,
        });
        if reqs.len() == 32 {
            post_all(&p, &mut reqs, "write_batch", |r| p.a.ep.write_batch(r));
        }
    }
    post_all(&p, &mut reqs, "write_batch", |r| p.a.ep.write_batch(r));
    let (done, errs) = gather(&p, true, sizes.len(), CompletionFlags::WRITE, "writes");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut seen = HashSet::new();
    for c in &done {
        let i = c.context as usize;
        assert!(seen.insert(i), "{setup:?} seed {seed}: write {i} twice");
        assert_eq!(c.len, sizes[i], "{setup:?} seed {seed}: write {i}");
        match &c.buf {
            Buffer::Region(r) => assert_eq!((r.offset(), r.len()), (i * stride, sizes[i])),
            Buffer::Send(b) => assert_eq!(b.len(), sizes[i]),
            other => panic!("{setup:?} seed {seed}: write {i} handed back {other:?}"),
        }
    }
    let notes = sizes.iter().enumerate().filter(|(i, _)| i % 3 == 0).count();
    let (got, errs) = gather(&p, false, notes, CompletionFlags::REMOTE_CQ_DATA, "notes");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut data: Vec<u32> = got.iter().filter_map(|c| c.data).collect();
    data.sort_unstable();
    let want: Vec<u32> = (0..sizes.len() as u32).filter(|i| i % 3 == 0).collect();
    assert_eq!(data, want, "{setup:?} seed {seed}: each immediate once");
    {
        let t = target.read();
        for (i, &len) in sizes.iter().enumerate() {
            let o = i * stride;
            assert!(
                t[o..o + len] == payload(seed, i, len)[..],
                "{setup:?} seed {seed}: write {i}"
            );
        }
    }
    // Read them back in batches, into BytesMut and into slices of one region.
    let mut out = dom
        .register(vec![0u8; stride * sizes.len()], Access::READ)
        .unwrap();
    let mut reqs = VecDeque::new();
    for (i, &len) in sizes.iter().enumerate() {
        let page = out.split_to(stride).unwrap();
        let buf = if i % 2 == 0 {
            BytesMut::new().into()
        } else {
            page.into()
        };
        reqs.push_back(ReadRequest {
            peer: p.peer_b,
            buf,
            len,
            from: rk.at((i * stride) as u64),
            context: 1000 + i as u64,
        });
    }
    post_all(&p, &mut reqs, "read_batch", |r| p.a.ep.read_batch(r));
    let (done, errs) = gather(&p, true, sizes.len(), CompletionFlags::READ, "reads");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    assert_eq!(done.len(), sizes.len());
    for c in done {
        let i = c.context as usize - 1000;
        let want = payload(seed, i, sizes[i]);
        match c.buf {
            Buffer::Recv(b) => assert!(b[..] == want[..], "{setup:?} seed {seed}: read {i}"),
            Buffer::Region(r) => {
                assert_eq!(r.offset(), i * stride);
                assert!(
                    r.read()[..sizes[i]] == want[..],
                    "{setup:?} seed {seed}: read {i}"
                );
            }
            other => panic!("{setup:?} seed {seed}: read {i} handed back {other:?}"),
        }
    }
}

#[test]
fn writes_and_reads_in_batches() {
    for s in setups() {
        batches(s);
    }
}

/// The iov forms: a write gathered from three parts, a read scattered into three, a message
/// gathered and scattered (tagged and not); more parts than `iov_limit` is refused with every
/// part handed back.
fn iov_forms(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let (target, rk) = target_region(&p, 200_000, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let dom = p.a.ep.domain().clone();
    let whole = payload(seed, 0, 100_000);
    let mut region = dom
        .register(
            whole[10..90_010].to_vec(),
            Access::WRITE | Access::READ | Access::SEND | Access::RECV,
        )
        .unwrap();
    let mid = region.split_to(90_000).unwrap();
    let parts: Vec<efa::SendBuf> = vec![
        whole.slice(..10).into(),
        mid.into(),
        whole.slice(90_010..).into(),
    ];
    p.a.ep
        .write_iov(p.peer_b, parts, rk.at(5), WriteOptions::default(), 1)
        .unwrap();
    let (done, errs) = gather(&p, true, 1, CompletionFlags::WRITE, "write_iov");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    assert_eq!(done[0].len, 100_000);
    let back = done
        .into_iter()
        .next()
        .unwrap()
        .buf
        .into_iov()
        .expect("the parts come back");
    assert_eq!(back.len(), 3);
    let mid = back
        .into_iter()
        .nth(1)
        .unwrap()
        .into_region()
        .expect("the slice in the middle");
    assert_eq!(mid.len(), 90_000);
    assert!(
        target.read()[5..100_005] == whole[..],
        "{setup:?} seed {seed}: gathered write"
    );
    // Scatter the same bytes back: 7 into a BytesMut, 90 000 into the slice, the rest into another.
    let small = dom.register(vec![0u8; 9993], Access::READ).unwrap();
    let iov: Vec<efa::RecvBuf> = vec![BytesMut::with_capacity(7).into(), mid.into(), small.into()];
    p.a.ep.read_iov(p.peer_b, iov, rk.at(5), 2).unwrap();
    let (done, errs) = gather(&p, true, 1, CompletionFlags::READ, "read_iov");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let back = done.into_iter().next().unwrap().buf.into_iov().unwrap();
    assert_eq!(back[0].as_recv(), Some(&whole[..7]));
    assert!(back[1].as_region().unwrap().read()[..] == whole[7..90_007]);
    assert!(back[2].as_region().unwrap().read()[..] == whole[90_007..]);
    // Messages: gathered from a slice and bytes, scattered into a BytesMut and a slice.
    for (k, tag) in [(0u64, None), (1, Some(9u64))] {
        let mut s =
            p.b.ep
                .domain()
                .register(vec![0u8; 70_000], Access::RECV)
                .unwrap();
        let room = s.split_to(60_000).unwrap();
        let recv_parts: Vec<efa::RecvBuf> = vec![BytesMut::with_capacity(1000).into(), room.into()];
        let mut o = RecvOptions::default();
        o.tag = tag.map(|t| (t, 0));
        p.b.ep.recv_iov(recv_parts, o, 10 + k).unwrap();
        let msg = payload(seed, 5 + k as usize, 50_000);
        let head = dom.register(msg[..300].to_vec(), Access::SEND).unwrap();
        let mut so = SendOptions::default();
        so.tag = tag;
        let send_parts = vec![head.into(), msg.slice(300..).into()];
        p.a.ep.send_iov(p.peer_b, send_parts, so, 20 + k).unwrap();
        let (got, errs) = gather(&p, false, 1, CompletionFlags::RECV, "recv_iov");
        assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
        assert_eq!(got[0].len, 50_000);
        let parts = got.into_iter().next().unwrap().buf.into_iov().unwrap();
        assert_eq!(parts[0].as_recv(), Some(&msg[..1000]));
        let r = parts[1].as_region().unwrap();
        assert!(
            r.read()[..49_000] == msg[1000..],
            "{setup:?} seed {seed}: scattered message"
        );
        assert!(r.read()[49_000..].iter().all(|&x| x == 0));
        let (sent, _) = gather(&p, true, 1, CompletionFlags::SEND, "send_iov");
        assert_eq!(sent[0].buf.as_iov().map(<[Buffer]>::len), Some(2));
    }
    // Five parts: refused, all five handed back.
    let five: Vec<efa::SendBuf> = (0..5).map(|_| Bytes::from_static(b"x").into()).collect();
    let e =
        p.a.ep
            .write_iov(p.peer_b, five, rk.at(0), WriteOptions::default(), 3)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.buf.as_iov().map(<[Buffer]>::len), Some(5));
    let five: Vec<efa::RecvBuf> = (0..5).map(|_| BytesMut::with_capacity(1).into()).collect();
    let e =
        p.b.ep
            .recv_iov(five, RecvOptions::default(), 4)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert_eq!(e.buf.as_iov().map(<[Buffer]>::len), Some(5));
}

#[test]
fn scatter_gather_writes_reads_and_messages() {
    for s in setups() {
        iov_forms(s);
    }
}

/// Injected writes land without an initiator completion; with immediate data the target gets
/// one completion each; beyond `inject_rma_size` they are refused.
fn injects(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let max = p.a.ep.inject_rma_size();
    assert!(max >= 64, "{setup:?}: inject_rma_size {max}");
    let (target, rk) = target_region(&p, 64 * max, Access::REMOTE_WRITE);
    let n = 32;
    for i in 0..n {
        let data = payload(seed, i, max);
        let to = rk.at((i * max) as u64);
        let deadline = Instant::now() + DEADLINE;
        loop {
            let r = if i % 2 == 0 {
                p.a.ep.inject_write(p.peer_b, &data, to)
            } else {
                p.a.ep.inject_write_data(p.peer_b, &data, to, i as u32)
            };
            match r {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::Again => {
                    p.a.ep.progress();
                    p.b.ep.progress();
                    assert!(
                        Instant::now() < deadline,
                        "inject_write: kept getting Again"
                    );
                }
                Err(e) => panic!("{setup:?} seed {seed}: inject_write {i}: {e}"),
            }
        }
    }
    let (got, errs) = gather(&p, false, n / 2, CompletionFlags::REMOTE_CQ_DATA, "notes");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut data: Vec<u32> = got.iter().filter_map(|c| c.data).collect();
    data.sort_unstable();
    assert_eq!(
        data,
        (0..n as u32).filter(|i| i % 2 == 1).collect::<Vec<_>>()
    );
    // The plain injects land too (no completion tells when: wait for the bytes).
    let deadline = Instant::now() + DEADLINE;
    loop {
        let done =
            (0..n).all(|i| target.read()[i * max..(i + 1) * max] == payload(seed, i, max)[..]);
        if done {
            break;
        }
        p.a.ep.progress();
        p.b.ep.progress();
        assert!(
            Instant::now() < deadline,
            "{setup:?} seed {seed}: injected writes never landed"
        );
    }
    let e =
        p.a.ep
            .inject_write(p.peer_b, &vec![0u8; max + 1], rk.at(0))
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    // No initiator completion for a successful inject.
    for _ in 0..10 {
        p.b.ep.progress();
    }
    assert!(
        p.a.collect_some().is_empty(),
        "{setup:?} seed {seed}: an inject completed"
    );
}

#[test]
fn injected_writes_land_without_a_completion() {
    for s in setups() {
        injects(s);
    }
}

/// On the udp device the packets of a batch of 32 small writes leave packed in one or two
/// datagrams, in one or two system calls, where 32 calls of `write` make 32 of each.
#[test]
fn a_write_batch_is_one_system_call_or_one_doorbell() {
    let a = Node::new(&common::udp_domain(LOCAL4, efa::FaultConfig::default()));
    let b = Node::new(&common::udp_domain(LOCAL4, efa::FaultConfig::default()));
    let peer = a.insert(b.ep.addr());
    b.insert(a.ep.addr());
    let mr =
        b.ep.domain()
            .register(vec![0u8; 64 * 33], Access::REMOTE_WRITE)
            .unwrap();
    let rk = mr.remote_key().unwrap();
    // A first write makes the handshake.
    a.ep.write(peer, Bytes::from_static(b"hi"), rk.at(64 * 32), 99)
        .unwrap();
    let _ = both(&a, &b, 1);
    let before = a.ep.domain().device_stats();
    let mut reqs: VecDeque<WriteRequest> = (0..32)
        .map(|i| WriteRequest {
            peer,
            buf: Bytes::from(vec![i as u8; 64]).into(),
            to: rk.at(64 * i),
            options: WriteOptions::default(),
            context: i,
        })
        .collect();
    assert_eq!(a.ep.write_batch(&mut reqs).unwrap(), 32);
    let after = a.ep.domain().device_stats();
    // What SRD's congestion window lets out goes at once (all 32 on a quiet start; after a loss
    // the window, at least 2, holds the rest back until acknowledgements come), packed into one
    // or two datagrams (the peer said it unpacks during the first write), in one or two system
    // calls, where 32 `write` calls make one datagram and one call each.
    let (sent, calls, datagrams) = (
        after.tx_pkts - before.tx_pkts,
        after.tx_batches - before.tx_batches,
        after.tx_datagrams - before.tx_datagrams,
    );
    if common::on_efa() {
        // The efa device posts the list in one `ibv_wr_start` .. `ibv_wr_complete` session: one
        // doorbell (the NIC's SRD does the congestion control).
        assert_eq!(calls, 1, "{before:?} -> {after:?}");
    } else {
        assert!(
            (2..=32).contains(&sent) && calls <= 2 && (1..=2).contains(&datagrams),
            "{before:?} -> {after:?}"
        );
        assert!(
            after.tx_packed > before.tx_packed,
            "{before:?} -> {after:?}"
        );
    }
    let done = both(&a, &b, 32);
    assert_eq!(done.len(), 32);
    assert!((0..32).all(|i| mr.read()[64 * i] == i as u8));
}

/// `a`'s next `n` completions, progressing `b` meanwhile (it answers the handshake).
fn both(a: &Node, b: &Node, n: usize) -> Vec<efa::Completion> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while out.len() < n {
        b.ep.progress();
        out.extend(a.collect_some());
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            out.len()
        );
    }
    out
}
