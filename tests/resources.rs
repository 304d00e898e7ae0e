//! Misuse of memory regions, address vectors, completion queues and endpoint builders returns
//! the documented errors.

use bytes::BytesMut;
use efa::{
    Access, AddressVector, CompletionQueue, Dgram, Domain, Endpoint, EpType, ErrorKind, Hints,
    RawAddr, getinfo,
};

fn domain() -> Domain {
    Domain::open(&getinfo(&Hints::new().provider("loopback").ep_type(EpType::Dgram)).unwrap()[0])
        .unwrap()
}

#[test]
fn memory_region_misuse() {
    let d = domain();
    assert_eq!(
        d.register(Vec::new(), Access::SEND).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        d.register(vec![0u8; 8], Access::empty())
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let local = d
        .register(vec![0u8; 8], Access::SEND | Access::RECV)
        .unwrap();
    assert_eq!(
        local.remote_key().unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );

    let mr = d.register(vec![0u8; 4096], Access::REMOTE_READ).unwrap();
    let rk = mr.remote_key().unwrap();
    d.verify_remote(rk.key, rk.addr, rk.len, Access::REMOTE_READ)
        .unwrap();
    d.verify_remote(rk.key, rk.addr + 100, 10, Access::REMOTE_READ)
        .unwrap();
    let kind = |r: efa::Result<()>| r.unwrap_err().kind();
    assert_eq!(
        kind(d.verify_remote(rk.key, rk.addr, rk.len + 1, Access::REMOTE_READ)),
        ErrorKind::RemoteAccess
    );
    assert_eq!(
        kind(d.verify_remote(rk.key, rk.addr - 1, 1, Access::REMOTE_READ)),
        ErrorKind::RemoteAccess
    );
    assert_eq!(
        kind(d.verify_remote(rk.key, u64::MAX, 2, Access::REMOTE_READ)),
        ErrorKind::RemoteAccess
    );
    assert_eq!(
        kind(d.verify_remote(rk.key, rk.addr, 8, Access::REMOTE_WRITE)),
        ErrorKind::RemoteAccess
    );
    assert_eq!(
        kind(d.verify_remote(rk.key + 999, rk.addr, 8, Access::REMOTE_READ)),
        ErrorKind::RemoteAccess
    );
    // Closing revokes the key before the memory is handed back.
    let buf = mr.close();
    assert_eq!(buf.len(), 4096);
    assert_eq!(
        kind(d.verify_remote(rk.key, rk.addr, 8, Access::REMOTE_READ)),
        ErrorKind::RemoteAccess
    );
    // Dropping revokes too, and keys are never reused.
    let mr2 = d.register(vec![0u8; 16], Access::REMOTE_WRITE).unwrap();
    let rk2 = mr2.remote_key().unwrap();
    assert_ne!(rk2.key, rk.key);
    drop(mr2);
    assert_eq!(
        kind(d.verify_remote(rk2.key, rk2.addr, 8, Access::REMOTE_WRITE)),
        ErrorKind::RemoteAccess
    );
}

#[test]
fn region_of_another_domain_is_refused() {
    let d1 = domain();
    let d2 = domain();
    let cq = CompletionQueue::new(&d1, 8).unwrap();
    let av = AddressVector::new(&d1);
    let ep = Endpoint::<Dgram>::builder(&d1)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let foreign = d2.register(vec![0u8; 64], Access::RECV).unwrap();
    let e = ep.recv(foreign, 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.into_buffer().into_region().is_some(),
        "region handed back"
    );
}

#[test]
fn address_vector_misuse() {
    let d = domain();
    let av = AddressVector::new(&d);
    assert_eq!(
        av.insert_bytes(&[0u8; 31]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let zero_qpn: RawAddr = "efa://[::1]:0:00000001".parse().unwrap();
    assert_eq!(
        av.insert(zero_qpn).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        "not an address".parse::<RawAddr>().unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );

    let a: RawAddr = "efa://[::1]:5:00000001".parse().unwrap();
    let p = av.insert(a).unwrap();
    assert_eq!(
        av.insert(a).unwrap(),
        p,
        "inserting the same address again gives the same peer"
    );
    assert_eq!(av.insert_bytes(&a.to_bytes()).unwrap(), p);
    // A restarted peer (same GID and QPN, new QKEY) is a new peer and wins reverse lookups.
    let restarted = RawAddr { qkey: 2, ..a };
    let p2 = av.insert(restarted).unwrap();
    assert_ne!(p2, p);
    assert_eq!(av.reverse_lookup(a.gid, a.qpn), Some(p2));
    av.remove(p2).unwrap();
    assert_eq!(
        av.reverse_lookup(a.gid, a.qpn),
        Some(p),
        "falls back to the older entry"
    );
    assert_eq!(av.remove(p2).unwrap_err().kind(), ErrorKind::UnknownPeer);
    assert_eq!(av.lookup(p2).unwrap_err().kind(), ErrorKind::UnknownPeer);
    assert_eq!(av.len(), 1);
    av.remove(p).unwrap();
    assert!(av.is_empty());
    assert_eq!(av.reverse_lookup(a.gid, a.qpn), None);
}

#[test]
fn completion_queue_and_builder_misuse() {
    let d = domain();
    let other = domain();
    assert_eq!(
        CompletionQueue::new(&d, 0).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let cq = CompletionQueue::new(&d, 8).unwrap();
    let av = AddressVector::new(&d);
    let foreign_cq = CompletionQueue::new(&other, 8).unwrap();
    let foreign_av = AddressVector::new(&other);
    let err = |r: efa::Result<Endpoint<Dgram>>| r.unwrap_err().kind();
    assert_eq!(
        err(Endpoint::<Dgram>::builder(&d).av(&av).build()),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        err(Endpoint::<Dgram>::builder(&d).cq(&cq).build()),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        err(Endpoint::<Dgram>::builder(&d)
            .cq(&foreign_cq)
            .av(&av)
            .build()),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        err(Endpoint::<Dgram>::builder(&d)
            .cq(&cq)
            .av(&foreign_av)
            .build()),
        ErrorKind::InvalidArgument
    );
    let too_deep = d.attr().max_recv_wr + 1;
    assert_eq!(
        err(Endpoint::<Dgram>::builder(&d)
            .cq(&cq)
            .av(&av)
            .rx_size(too_deep)
            .build()),
        ErrorKind::InvalidArgument
    );
    // Capabilities a DGRAM endpoint lacks are refused; the ones it has are fine.
    let e = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .caps(efa::Caps::TAGGED)
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    assert!(e.to_string().contains("FI_TAGGED"), "{e}");
    Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .caps(efa::Caps::MSG | efa::Caps::SOURCE)
        .build()
        .unwrap();
    // Reading an empty queue is not an error; waiting on it times out.
    let mut out = Vec::new();
    assert_eq!(cq.poll(&mut out, 8).unwrap(), 0);
    assert!(cq.read_err().is_none());
    assert_eq!(
        cq.wait(&mut out, 8, Some(std::time::Duration::from_millis(10)))
            .unwrap_err()
            .kind(),
        ErrorKind::TimedOut
    );
}

#[test]
fn completion_queue_full_leaves_completions_in_the_device() {
    let d = domain();
    let cq = CompletionQueue::new(&d, 4).unwrap();
    let av = AddressVector::new(&d);
    let ep = Endpoint::<Dgram>::builder(&d)
        .cq(&cq)
        .av(&av)
        .build()
        .unwrap();
    let me = av.insert(ep.addr()).unwrap();
    for i in 0..10 {
        ep.recv(BytesMut::with_capacity(8), 100 + i).unwrap();
    }
    for i in 0..10 {
        ep.send(me, vec![i as u8], i).unwrap();
    }
    let mut out = Vec::new();
    let mut seen = 0;
    for _ in 0..100 {
        ep.progress();
        assert!(
            cq.len() <= 4,
            "a completion queue never holds more than its capacity"
        );
        seen += cq.poll(&mut out, 2).unwrap();
        if seen == 20 {
            break;
        }
    }
    assert_eq!(seen, 20, "every operation completes once the queue is read");
}

#[test]
fn dgram_endpoint_is_send_not_sync() {
    fn is_send<T: Send>() {}
    is_send::<Endpoint<Dgram>>();
    // `Endpoint<Dgram>: !Sync` is checked by the compile-fail doctest in `src/ep/mod.rs`.
}

/// Remote keys are unpredictable bits from the kernel's CSPRNG on every software device (32, an
/// EFA rkey's width, which libfabric peers truncate to; 63 for the domain's own keys, which have
/// bit 63 set so that peers emulate RMA to them): no counter a peer could step through to reach
/// another region (issue 17, defect 6).
#[test]
fn remote_keys_are_unpredictable() {
    for (p, ep, bits) in [
        ("loopback", EpType::Dgram, 32),
        ("udp", EpType::Dgram, 32),
        ("loopback", EpType::Rdm, 32),
    ] {
        let d = Domain::open(&getinfo(&Hints::new().provider(p).ep_type(ep)).unwrap()[0]).unwrap();
        let regions: Vec<_> = (0..64)
            .map(|_| d.register(vec![0u8; 64], Access::REMOTE_READ).unwrap())
            .collect();
        let keys: Vec<u64> = regions.iter().map(|r| r.key()).collect();
        let distinct: std::collections::HashSet<u64> = keys.iter().copied().collect();
        assert_eq!(distinct.len(), keys.len(), "{p}");
        // Device keys are 32 bits (an EFA rkey: libfabric peers truncate to it), spread over
        // the whole range all the same.
        // No two consecutive keys within `near` of each other (a counter, or a counter with
        // small random steps). For random 32-bit keys two land within 2^20 with probability
        // 2^-11 per pair (about 3% of runs over 63 pairs): there the window is 2^8, a false
        // alarm once in about 130 000 runs.
        let near: u64 = if bits == 32 { 1 << 8 } else { 1 << 20 };
        let steps = keys
            .windows(2)
            .filter(|w| w[1].abs_diff(w[0]) < near)
            .count();
        assert_eq!(steps, 0, "{p}: keys close to each other: {keys:x?}");
        let high = keys.iter().filter(|k| **k >> (bits - 8) != 0).count();
        assert!(high >= 60, "{p}: keys use the top byte: {keys:x?}");
        if bits == 32 {
            assert!(
                keys.iter().all(|k| *k >> 32 == 0),
                "{p}: 32-bit keys: {keys:x?}"
            );
        }
    }
}
