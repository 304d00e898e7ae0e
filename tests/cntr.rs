//! Completion counters (`efa::Counter`, libfabric's `fi_cntr`, issue 28) on every device:
//! sends and receives counted (injects too, which write no completion), writes and reads at the
//! initiator, peers' writes and reads at a target that has no completion queue at all, errors
//! in `read_err` (a write and a read with a bad range, counted at both ends), blocking waits
//! (threshold, timeout, early return on an error), the async wait, the descriptor readable in
//! poll(2), `add`/`set`, several counters per endpoint and one counter on several endpoints,
//! DGRAM endpoints, and what binding refuses.

mod common;

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use common::{DEADLINE, Node};
use efa::{
    Access, AddressVector, AtomicOp, AtomicRequest, AtomicType, CompletionQueue, Counter,
    CounterEvents, Dgram, Domain, Endpoint, ErrorKind, Rdm,
};

fn setups() -> Vec<(&'static str, Domain, Box<dyn std::any::Any>)> {
    common::device_domains("efa-cntr-")
}

/// An RDM endpoint bound to `av` and the given counters only: no completion queue.
fn counted_only(
    d: &Domain,
    av: &AddressVector,
    counters: &[(&Counter, CounterEvents)],
) -> Endpoint<Rdm> {
    let mut b = Endpoint::<Rdm>::builder(d).av(av);
    for (c, ev) in counters {
        b = b.counter(c, *ev);
    }
    b.build().unwrap()
}

/// Waits until `c` counts `n` (failing the test with `name` otherwise); returns the count.
fn reach(c: &Counter, n: u64, name: &str) -> u64 {
    c.wait(n, Some(DEADLINE))
        .unwrap_or_else(|e| panic!("{name}: {e} (errors: {})", c.read_err()))
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

/// Keeps driving a target (through `c`) from another thread until the returned flag is set:
/// a one-sided target's engine must run for peers' emulated operations to land.
fn drive<'s>(s: &'s std::thread::Scope<'s, '_>, c: &'s Counter, stop: &'s AtomicBool) {
    s.spawn(move || {
        // (Bounded, so that a failing test ends instead of hanging in its scope.)
        let end = Instant::now() + DEADLINE;
        while !stop.load(Ordering::Acquire) && Instant::now() < end {
            let _ = c.wait(u64::MAX, Some(Duration::from_millis(2)));
        }
    });
}

#[test]
fn sends_and_receives_are_counted_with_or_without_completions() {
    for (name, d, _keep) in setups() {
        let sent = Counter::new(&d).unwrap();
        let got = Counter::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 256).unwrap();
        let av = AddressVector::new(&d);
        let a = Endpoint::<Rdm>::builder(&d)
            .cq(&cq)
            .av(&av)
            .counter(&sent, CounterEvents::SEND)
            .build()
            .unwrap();
        let b = Endpoint::<Rdm>::builder(&d)
            .cq(&cq)
            .av(&av)
            .counter(&got, CounterEvents::RECV)
            .build()
            .unwrap();
        let pb = av.insert(b.addr()).unwrap();
        const N: u64 = 10;
        for i in 0..N {
            b.recv(BytesMut::with_capacity(100_000), i).unwrap();
        }
        // Eight sends (one long-CTS) with completions, two injects without.
        for i in 0..8u64 {
            let len = if i == 3 { 90_000 } else { 32 };
            a.send(pb, Bytes::from(vec![i as u8; len]), 100 + i)
                .unwrap();
        }
        let deadline = Instant::now() + DEADLINE;
        for i in 0..2u8 {
            while let Err(e) = a.inject(pb, &[i; 8]) {
                assert_eq!(e.kind(), ErrorKind::Again, "{name}: {e}");
                assert!(Instant::now() < deadline, "{name}: inject stays refused");
                sent.read();
            }
        }
        // Each side drives its endpoint while the other waits (a long-CTS send needs the
        // receiver's CTS; an inject completes when taken and leaves later).
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            drive(s, &sent, &stop);
            drive(s, &got, &stop);
            assert_eq!(reach(&sent, N, name), N, "{name}");
            assert_eq!(reach(&got, N, name), N, "{name}");
            stop.store(true, Ordering::Release);
        });
        assert_eq!((sent.read_err(), got.read_err()), (0, 0), "{name}");
        // The completion queue holds the eight sends and ten receives; the injects wrote none.
        let mut out = Vec::new();
        while out.len() < 18 {
            cq.wait(&mut out, 64, Some(DEADLINE)).unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        cq.poll(&mut out, 64).unwrap();
        assert_eq!(out.len(), 18, "{name}");
        // Neither counter counted the other kind.
        assert_eq!((sent.read(), got.read()), (N, N), "{name}");
    }
}

#[test]
fn rma_is_counted_at_the_initiator_and_at_a_target_without_a_completion_queue() {
    for (name, d, _keep) in setups() {
        let (w, r) = (Counter::new(&d).unwrap(), Counter::new(&d).unwrap());
        let (rw, rr) = (Counter::new(&d).unwrap(), Counter::new(&d).unwrap());
        let a = Node::new(&d);
        let a_ep = Endpoint::<Rdm>::builder(&d)
            .cq(&a.cq)
            .av(&a.av)
            .counter(&w, CounterEvents::WRITE)
            .counter(&r, CounterEvents::READ)
            .build()
            .unwrap();
        let b = counted_only(
            &d,
            &a.av,
            &[
                (&rw, CounterEvents::REMOTE_WRITE),
                (&rr, CounterEvents::REMOTE_READ),
            ],
        );
        let pb = a.av.insert(b.addr()).unwrap();
        let region = d.register(vec![0u8; 1 << 20], Access::REMOTE).unwrap();
        let rk = region.remote_key().unwrap();
        // Plain writes of every protocol size, one from a registered region (LONGREAD_RTW where
        // the device reads), two reads, an atomic and a fetching atomic.
        let sizes = [1usize, 100, 9000, 70_000, 300_000];
        let mut at = 0u64;
        let mut expect = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let data = common::payload(7, i, n);
            a_ep.write(pb, data.clone(), rk.at(at), i as u64).unwrap();
            expect.push((at, data));
            at += n as u64;
        }
        let src_data = common::payload(7, 99, 200_000);
        let src = d
            .register(src_data.to_vec(), Access::WRITE | Access::REMOTE_READ)
            .unwrap();
        a_ep.write(pb, src, rk.at(at), 50).unwrap();
        expect.push((at, src_data));
        let counter_at = 1_000_000u64;
        let one = Bytes::from(1u64.to_le_bytes().to_vec());
        let add = |op| AtomicRequest {
            op,
            datatype: AtomicType::U64,
            operand: one.clone(),
            compare: None,
        };
        a_ep.atomic(pb, add(AtomicOp::Sum), rk.at(counter_at), 60)
            .unwrap();
        a_ep.fetch_atomic(
            pb,
            add(AtomicOp::Sum),
            BytesMut::with_capacity(8),
            rk.at(counter_at),
            61,
        )
        .unwrap();
        // The target blocks on its counters (which drive it); the initiator on its own, then
        // reads what it wrote.
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let target = s.spawn(|| {
                let writes = rw.wait(8, Some(DEADLINE));
                let reads = rr.wait(2, Some(DEADLINE));
                drive(s, &rw, &stop);
                (writes, reads)
            });
            assert_eq!(reach(&w, 7, name), 7, "{name}: writes");
            a_ep.read(pb, BytesMut::new(), 100, rk.at(1), 70).unwrap();
            a_ep.read(pb, BytesMut::new(), 70_000, rk.at(9101), 71)
                .unwrap();
            assert_eq!(reach(&r, 3, name), 3, "{name}: reads");
            let (writes, reads) = target.join().unwrap();
            stop.store(true, Ordering::Release);
            assert_eq!(
                writes.unwrap(),
                8,
                "{name}: remote writes (6 writes, 2 atomics)"
            );
            assert_eq!(reads.unwrap(), 2, "{name}: remote reads");
        });
        assert_eq!((w.read_err(), r.read_err()), (0, 0), "{name}");
        assert_eq!((rw.read_err(), rr.read_err()), (0, 0), "{name}");
        {
            let mem = region.read();
            for (at, data) in &expect {
                let at = *at as usize;
                assert!(mem[at..at + data.len()] == data[..], "{name}: data at {at}");
            }
            let v = u64::from_le_bytes(mem[counter_at as usize..][..8].try_into().unwrap());
            assert_eq!(v, 2, "{name}: both atomics applied once");
        }
        // The reads came back intact.
        let c = a.collect(10, name);
        for (ctx, i) in [(70, 1), (71, 3)] {
            let read = c.iter().find(|c| c.context == ctx).unwrap();
            assert!(read.buf.as_recv().unwrap() == &expect[i].1[..], "{name}");
        }
        // Device RDMA would have bypassed the target's engine: none was used towards it.
        assert_eq!(a_ep.stats().device_rma_bytes, 0, "{name}");
    }
}

#[test]
fn errors_are_counted_in_read_err_at_both_ends_and_end_waits() {
    for (name, d, _keep) in setups() {
        let (w, r) = (Counter::new(&d).unwrap(), Counter::new(&d).unwrap());
        let rw = Counter::new(&d).unwrap();
        let a = Node::new(&d);
        let a_ep = Endpoint::<Rdm>::builder(&d)
            .cq(&a.cq)
            .av(&a.av)
            .counter(&w, CounterEvents::WRITE)
            .counter(&r, CounterEvents::READ)
            .build()
            .unwrap();
        let b = counted_only(
            &d,
            &a.av,
            &[(
                &rw,
                CounterEvents::REMOTE_WRITE | CounterEvents::REMOTE_READ,
            )],
        );
        let pb = a.av.insert(b.addr()).unwrap();
        let region = d.register(vec![0u8; 4096], Access::REMOTE).unwrap();
        let rk = region.remote_key().unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            drive(s, &rw, &stop);
            // A good write first (the handshake), then one past the region's end.
            a_ep.write(pb, &b"fine"[..], rk.at(0), 1).unwrap();
            assert_eq!(reach(&w, 1, name), 1, "{name}");
            a.collect(1, name);
            a_ep.write(pb, Bytes::from(vec![9u8; 64]), rk.at(4090), 2)
                .unwrap();
            let e = w.wait(2, Some(DEADLINE)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ErrorAvailable, "{name}: {e}");
            assert_eq!((w.read(), w.read_err()), (1, 1), "{name}");
            let ce = a.expect_err(DEADLINE, "the write past the end");
            assert_eq!(ce.error.kind(), ErrorKind::RemoteAccess, "{name}");
            assert_eq!(ce.context, 2);
            // A read past the end: the read counter's error.
            a_ep.read(pb, BytesMut::new(), 16, rk.at(4095), 3).unwrap();
            let e = r.wait(1, Some(DEADLINE)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ErrorAvailable, "{name}: {e}");
            assert_eq!((r.read(), r.read_err()), (0, 1), "{name}");
            a.expect_err(DEADLINE, "the read past the end");
            // The target counted the good write and both refusals.
            let deadline = Instant::now() + DEADLINE;
            while rw.read_err() < 2 {
                assert!(Instant::now() < deadline, "{name}: target errors");
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!((rw.read(), rw.read_err()), (1, 2), "{name}");
            stop.store(true, Ordering::Release);
        });
        assert_eq!(&region.read()[..4], b"fine", "{name}");
        assert!(region.read()[4090..].iter().all(|&x| x == 0), "{name}");
    }
}

#[test]
fn wait_reaches_the_threshold_times_out_and_stops_at_an_error() {
    let (_, d, _keep) = setups().remove(0);
    let c = Counter::new(&d).unwrap();
    let start = Instant::now();
    let e = c.wait(1, Some(Duration::from_millis(30))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert!(e.to_string().contains("threshold 1"), "{e}");
    assert!(start.elapsed() >= Duration::from_millis(30));
    // Already there: at once, whatever the timeout.
    c.set(5);
    assert_eq!(c.wait(5, Some(Duration::ZERO)).unwrap(), 5);
    std::thread::scope(|s| {
        // A blocked waiter wakes at the adds that reach its threshold...
        let w = s.spawn(|| c.wait(8, Some(DEADLINE)));
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(10));
            c.add(1);
        }
        assert_eq!(w.join().unwrap().unwrap(), 8);
        // ... and at an error, before the threshold. Only an error after the wait began ends
        // it, and a loaded machine may start the waiter late: errors come until it returns.
        let w = s.spawn(|| c.wait(100, Some(DEADLINE)));
        while !w.is_finished() {
            c.add_err(1);
            std::thread::sleep(Duration::from_millis(10));
        }
        let e = w.join().unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ErrorAvailable, "{e}");
    });
    assert!(start.elapsed() < DEADLINE);
    // An error count that moved before the wait began does not end it.
    assert_eq!(c.wait(8, None).unwrap(), 8);
    c.set_err(0);
    assert_eq!((c.read(), c.read_err()), (8, 0));
}

#[test]
fn async_wait_resolves_as_peers_write() {
    for (name, d, _keep) in setups() {
        let rw = Counter::new(&d).unwrap();
        let a = Node::new(&d);
        let b = counted_only(&d, &a.av, &[(&rw, CounterEvents::REMOTE_WRITE)]);
        let pb = a.av.insert(b.addr()).unwrap();
        let region = d.register(vec![0u8; 4096], Access::REMOTE_WRITE).unwrap();
        let rk = region.remote_key().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                for i in 0..4u64 {
                    a.ep.write(pb, Bytes::from(vec![i as u8 + 1; 8]), rk.at(i * 8), i)
                        .unwrap();
                }
                a.collect(4, name);
            });
            let n = rt
                .block_on(async { tokio::time::timeout(DEADLINE, rw.wait_async(4)).await })
                .unwrap_or_else(|_| panic!("{name}: the async wait never resolved"))
                .unwrap();
            assert_eq!(n, 4, "{name}");
        });
        assert_eq!(region.read()[24], 4, "{name}");
        // An error resolves it early.
        let fut = rw.wait_async(10);
        rw.add_err(1);
        let e = rt.block_on(fut).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ErrorAvailable, "{name}");
    }
}

#[test]
fn the_descriptor_wakes_a_target_blocked_in_poll() {
    for (name, d, _keep) in setups() {
        let rw = Counter::new(&d).unwrap();
        let a = Node::new(&d);
        let b = counted_only(&d, &a.av, &[(&rw, CounterEvents::REMOTE_WRITE)]);
        let pb = a.av.insert(b.addr()).unwrap();
        let region = d.register(vec![0u8; 4096], Access::REMOTE_WRITE).unwrap();
        let rk = region.remote_key().unwrap();
        let fd = rw.wait_fd().as_raw_fd();
        assert_eq!(fd, rw.as_raw_fd());
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                a.ep.write(pb, &b"wake"[..], rk.at(0), 1).unwrap();
                a.collect(1, name);
            });
            // The target only ever blocks in poll(2), reading the counter when woken.
            let deadline = Instant::now() + DEADLINE;
            let mut blocks = 0;
            while rw.read() < 1 {
                assert!(Instant::now() < deadline, "{name}: never counted");
                if rw.trywait().is_ok() {
                    blocks += 1;
                    assert!(
                        readable(fd, DEADLINE),
                        "{name}: the descriptor never became readable"
                    );
                }
            }
            assert!(blocks > 0, "{name}: trywait never let the target block");
        });
        assert_eq!(&region.read()[..4], b"wake", "{name}");
        // The count moved since the last read: trywait says so until it is read.
        rw.add(1);
        assert_eq!(rw.trywait().unwrap_err().kind(), ErrorKind::Again, "{name}");
        assert_eq!(rw.read(), 2, "{name}");
        rw.add_err(1);
        assert_eq!(rw.trywait().unwrap_err().kind(), ErrorKind::Again, "{name}");
        assert_eq!(rw.read_err(), 1, "{name}");
        let mut tries = 0;
        while rw.trywait().is_err() {
            tries += 1;
            assert!(tries < 1000, "{name}: trywait never lets the target block");
        }
    }
}

#[test]
fn counters_bind_many_to_many() {
    for (name, d, _keep) in setups() {
        let shared = Counter::new(&d).unwrap();
        let own = Counter::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 256).unwrap();
        let av = AddressVector::new(&d);
        let ep = |counters: &[(&Counter, CounterEvents)]| {
            let mut b = Endpoint::<Rdm>::builder(&d).cq(&cq).av(&av);
            for (c, ev) in counters {
                b = b.counter(c, *ev);
            }
            b.build().unwrap()
        };
        let all = CounterEvents::SEND | CounterEvents::RECV;
        // `shared` counts the sends of a1 and a2 and the receives of b; `own` only a1's sends.
        let a1 = ep(&[(&shared, CounterEvents::SEND), (&own, CounterEvents::SEND)]);
        let a2 = ep(&[(&shared, CounterEvents::SEND)]);
        let b = ep(&[(&shared, all)]);
        let pb = av.insert(b.addr()).unwrap();
        for i in 0..5 {
            b.recv(BytesMut::with_capacity(64), i).unwrap();
        }
        for i in 0..3 {
            a1.send(pb, &b"one"[..], 10 + i).unwrap();
        }
        for i in 0..2 {
            a2.send(pb, &b"two"[..], 20 + i).unwrap();
        }
        assert_eq!(reach(&shared, 10, name), 10, "{name}");
        assert_eq!(reach(&own, 3, name), 3, "{name}");
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!((shared.read(), own.read()), (10, 3), "{name}");
    }
}

#[test]
fn dgram_sends_and_receives_are_counted() {
    for (name, d, _keep) in setups() {
        let (sent, got) = (Counter::new(&d).unwrap(), Counter::new(&d).unwrap());
        let cq = CompletionQueue::new(&d, 256).unwrap();
        let av = AddressVector::new(&d);
        let a = Endpoint::<Dgram>::builder(&d)
            .cq(&cq)
            .av(&av)
            .counter(&sent, CounterEvents::SEND)
            .build()
            .unwrap();
        // The receiver has no completion queue: its receives are only counted.
        let b = Endpoint::<Dgram>::builder(&d)
            .av(&av)
            .counter(&got, CounterEvents::RECV)
            .build()
            .unwrap();
        let pb = av.insert(b.addr()).unwrap();
        for i in 0..4 {
            b.recv(BytesMut::with_capacity(256), i).unwrap();
        }
        for i in 0..4 {
            a.send(pb, &b"datagram"[..], i).unwrap();
        }
        assert_eq!(reach(&sent, 4, name), 4, "{name}");
        assert_eq!(reach(&got, 4, name), 4, "{name}");
        // RMA events on a DGRAM endpoint are refused.
        let e = Endpoint::<Dgram>::builder(&d)
            .cq(&cq)
            .av(&av)
            .counter(&got, CounterEvents::REMOTE_WRITE)
            .build()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotSupported, "{name}: {e}");
        assert_eq!((sent.read_err(), got.read_err()), (0, 0), "{name}");
    }
}

#[test]
fn binding_refuses_what_cannot_work() {
    let mut s = setups();
    let (_, d, _k) = s.remove(0);
    let (_, other, _k2) = s.remove(0);
    let av = AddressVector::new(&d);
    let foreign = Counter::new(&other).unwrap();
    let e = Endpoint::<Rdm>::builder(&d)
        .av(&av)
        .counter(&foreign, CounterEvents::SEND)
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let c = Counter::new(&d).unwrap();
    let e = Endpoint::<Rdm>::builder(&d)
        .av(&av)
        .counter(&c, CounterEvents::empty())
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // Without a counter, a completion queue stays required.
    let e = Endpoint::<Rdm>::builder(&d).av(&av).build().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(
        format!("{:?}", CounterEvents::SEND | CounterEvents::REMOTE_WRITE),
        "[FI_SEND | FI_REMOTE_WRITE]"
    );
}
