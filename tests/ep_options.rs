//! Endpoint options (`fi_setopt`/`fi_getopt`, issue 28): set on the builder, read back, the
//! live ones changed on a running endpoint, each with its effect, on every device this run tests
//! (loopback, udp or the efa device with `EFA_TEST_DEVICE=efa`, shm) and on the routing device.

mod common;

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{Node, device_domains, on_efa};
use efa::{Access, CompletionFlags, ErrorKind};

/// Every option reads back as set, the defaults are libfabric's, and what no device here
/// guarantees (in-order 128-byte writes) or what the device cannot do is refused at build.
#[test]
fn options_read_back_and_refusals() {
    for (name, d, _keep) in device_domains("efa-opts-a") {
        let attr = d.attr().clone();
        let n = Node::build(&d, |b| b).unwrap();
        let o = n.ep.options();
        assert_eq!(o.rnr_retry, 3, "{name}");
        assert!(o.shared_memory_permitted, "{name}");
        assert_eq!(o.max_msg_size, usize::MAX, "{name}");
        assert_eq!(o.inject_rma_size, n.ep.inject_size(), "{name}");
        assert_eq!(o.min_multi_recv, attr.mtu - 168, "{name}");
        assert!(o.emulated_atomics, "{name}");
        let rdma = attr.caps.rdma_read && attr.caps.rdma_write;
        assert_eq!(o.emulated_write, !(o.use_device_rdma && rdma), "{name}");
        assert_eq!(n.ep.rma_emulation().write, o.emulated_write, "{name}");

        let n = Node::build(&d, |b| {
            b.rnr_retry(7)
                .sendrecv_in_order_aligned_128_bytes(true)
                .min_multi_recv(300)
                .max_msg_size(5000)
                .inject_rma_size(8)
        })
        .unwrap();
        let o = n.ep.options();
        assert_eq!(
            (
                o.rnr_retry,
                o.min_multi_recv,
                o.max_msg_size,
                o.inject_rma_size
            ),
            (7, 300, 5000, 8),
            "{name}"
        );
        assert!(o.sendrecv_in_order_aligned_128_bytes, "{name}");
        assert_eq!(n.ep.inject_rma_size(), 8, "{name}");

        let kind = |r: efa::Result<Node>| r.map(|_| ()).unwrap_err().kind();
        assert_eq!(
            kind(Node::build(&d, |b| b.rnr_retry(8))),
            ErrorKind::InvalidArgument,
            "{name}"
        );
        assert_eq!(
            kind(Node::build(&d, |b| b.write_in_order_aligned_128_bytes(true))),
            ErrorKind::NotSupported,
            "{name}"
        );
        let too_big = n.ep.inject_size() + 1;
        assert_eq!(
            kind(Node::build(&d, |b| b.inject_rma_size(too_big))),
            ErrorKind::InvalidArgument,
            "{name}"
        );
        if !rdma {
            assert_eq!(
                kind(Node::build(&d, |b| b.use_device_rdma(true))),
                ErrorKind::NotSupported,
                "{name}: device RDMA on a device without it"
            );
        }
    }
}

/// `max_msg_size`: a longer send or inject is refused with `MsgSize` and its buffer handed back;
/// one at the limit arrives; lowering it on the live endpoint applies to the next send.
#[test]
fn max_msg_size_refuses_longer_messages() {
    for (name, d, _keep) in device_domains("efa-opts-b") {
        let a = Node::build(&d, |b| b.max_msg_size(3000)).unwrap();
        let b = Node::new(&d);
        let to_b = a.insert(b.ep.addr());
        let e =
            a.ep.send(to_b, Bytes::from(vec![1u8; 3001]), 1)
                .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MsgSize, "{name}");
        assert_eq!(
            e.buf.as_send().map(|b| b.len()),
            Some(3001),
            "{name}: the buffer comes back"
        );
        b.ep.recv(BytesMut::with_capacity(4000), 7).unwrap();
        a.ep.send(to_b, Bytes::from(vec![2u8; 3000]), 2).unwrap();
        let got = b.collect(1, "the message at the limit");
        assert_eq!(got[0].len, 3000, "{name}");
        a.collect(1, "its send");
        a.ep.set_max_msg_size(16).unwrap();
        assert_eq!(
            a.ep.inject(to_b, &[3u8; 17]).unwrap_err().kind(),
            ErrorKind::MsgSize,
            "{name}"
        );
        assert_eq!(
            a.ep.set_max_msg_size(0).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
    }
}

/// `use_device_rdma(false)`: one-sided writes go as messages (emulated), where the device has
/// RDMA; the data lands either way.
#[test]
fn device_rdma_off_emulates_writes() {
    for (name, d, _keep) in device_domains("efa-opts-c") {
        if !(d.attr().caps.rdma_write && d.attr().caps.rdma_read) {
            continue;
        }
        for on in [true, false] {
            let a = Node::build(&d, |b| b.use_device_rdma(on)).unwrap();
            let b = Node::new(&d);
            assert_eq!(a.ep.options().use_device_rdma, on, "{name}");
            assert_eq!(a.ep.options().emulated_write, !on, "{name}");
            let to_b = a.insert(b.ep.addr());
            let mr = d.register(vec![0u8; 4096], Access::REMOTE_WRITE).unwrap();
            let rk = mr.remote_key().unwrap();
            let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
            a.ep.write(to_b, Bytes::from(data.clone()), rk.start(), 1)
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut done = Vec::new();
            while done.is_empty() {
                a.poll_ok(&mut done, &name);
                b.collect_some();
                assert!(
                    Instant::now() < deadline,
                    "{name}: the write never completed"
                );
            }
            assert_eq!(&mr.read()[..], &data[..], "{name}, device RDMA {on}");
            let s = a.ep.stats();
            if on {
                assert!(
                    s.device_rma_bytes > 0 && s.emulated_rma_bytes == 0,
                    "{name}: {s:?}"
                );
            } else {
                assert!(
                    s.emulated_rma_bytes > 0 && s.device_rma_bytes == 0,
                    "{name}: {s:?}"
                );
            }
        }
    }
}

/// `min_multi_recv` (`recv_multi`): a 1000-byte multi-receive buffer takes 200-byte messages
/// until less than the minimum (300) remains: after three (400 left) it stays, after the fourth
/// (200 left) a final `MULTI_RECV` completion retires it.
#[test]
fn min_multi_recv_retires_the_buffer() {
    for (name, d, _keep) in device_domains("efa-opts-d") {
        let a = Node::new(&d);
        let b = Node::build(&d, |b| b.min_multi_recv(300)).unwrap();
        let to_b = a.insert(b.ep.addr());
        b.ep.recv_multi(BytesMut::with_capacity(1000), 5).unwrap();
        let send = |i: u8| {
            a.ep.send(to_b, Bytes::from(vec![i; 200]), u64::from(i))
                .unwrap()
        };
        for i in 0..3u8 {
            send(i);
        }
        let mut got = b.collect(3, "three messages into one buffer");
        let end = Instant::now() + Duration::from_millis(50);
        while Instant::now() < end {
            got.extend(b.collect_some());
        }
        assert_eq!(got.len(), 3, "{name}: 400 bytes left, not retired: {got:?}");
        send(3);
        got.extend(b.collect(2, "the fourth message and the retirement"));
        for (i, c) in got[..4].iter().enumerate() {
            assert_eq!((c.len, c.context), (200, 5), "{name}");
            assert!(!c.flags.contains(CompletionFlags::MULTI_RECV), "{name}");
            let buf = c.buf.as_recv().expect("its part of the buffer");
            assert!(buf.iter().all(|&x| x == i as u8), "{name}: message {i}");
        }
        assert!(
            got[4].flags.contains(CompletionFlags::MULTI_RECV),
            "{name}: {got:?}"
        );
        assert_eq!((got[4].len, got[4].context), (0, 5), "{name}");
        b.ep.set_min_multi_recv(100);
        assert_eq!(b.ep.options().min_multi_recv, 100);
        a.collect(4, "sends");
    }
}

/// `shared_memory_permitted(false)` on the default same-host path (a udp domain routed over
/// shm): messages between two endpoints of this host go over the udp device, not over shared
/// memory; permitted (the default), over the local channel.
#[test]
fn shared_memory_not_permitted_keeps_same_host_peers_on_the_device() {
    if on_efa() {
        return; // the routing device under test is udp's
    }
    let dir = common::shm_test_dir("efa-opts-e");
    for permitted in [true, false] {
        let (d, dev) = common::routed_domain(dir.path());
        let a = Node::build(&d, |b| b.shared_memory_permitted(permitted)).unwrap();
        let b = Node::build(&d, |b| b.shared_memory_permitted(permitted)).unwrap();
        let to_b = a.insert(b.ep.addr());
        let before = efa::device::Device::stats(&*dev);
        for i in 0..8u64 {
            b.ep.recv(BytesMut::with_capacity(64), i).unwrap();
            a.ep.send(to_b, Bytes::from(vec![i as u8; 64]), i).unwrap();
        }
        b.collect(8, "messages");
        a.collect(8, "sends");
        let s = a.ep.stats();
        let dev_s = efa::device::Device::stats(&*dev);
        if permitted {
            assert_eq!(s.local_tx_msgs, 8, "over the local channel: {s:?}");
        } else {
            assert_eq!(s.local_tx_msgs, 0, "{s:?}");
            assert_eq!(
                dev_s.shm_route_tx_pkts, before.shm_route_tx_pkts,
                "no shm route"
            );
            assert!(dev_s.tx_pkts >= before.tx_pkts + 8, "over udp: {dev_s:?}");
        }
    }
}

/// `rnr_retry`: with 0 retries the queue pair reports a receiver that is not ready to the
/// protocol at once (which counts it and resends later); with 7 the device retries for ever and
/// the protocol never hears of it. The receiver is a bare queue pair that posts no buffer.
#[test]
fn rnr_retry_decides_who_retries() {
    for (name, d, _keep) in device_domains("efa-opts-f") {
        if !d.attr().caps.rnr_retry {
            continue;
        }
        let mut rnr = Vec::new();
        for retry in [0u8, 7] {
            let a = Node::build(&d, |b| b.rnr_retry(retry)).unwrap();
            let mut attr = efa::device::QpAttr::new(efa::device::QpType::Srd);
            attr.recv_depth = 1;
            let sink = d.device().create_qp(attr).unwrap();
            let to = a.insert(sink.addr());
            a.ep.send(to, Bytes::from_static(b"nobody listens"), 1)
                .unwrap();
            let end = Instant::now() + Duration::from_millis(300);
            while Instant::now() < end {
                a.collect_some();
            }
            rnr.push(a.ep.stats().rnr);
            drop(sink);
        }
        assert!(
            rnr[0] > 0,
            "{name}: 0 retries: RNR reaches the protocol: {rnr:?}"
        );
        assert_eq!(rnr[1], 0, "{name}: the device retries for ever: {rnr:?}");
    }
}
