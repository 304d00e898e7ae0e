//! Slices of one registered region (issue 27): many operations at once on disjoint slices, each
//! at its own offset, handed back in its completion; slices rejoin; no registration per
//! operation; the key's life follows the region, not a slice.

use super::*;
use efa::fault::Rng;

/// Posts an operation that takes a region slice, retrying on `Again` with the slice the refusal
/// hands back.
fn post_slice(
    p: &Pair,
    slice: MemoryRegion,
    what: &str,
    mut post: impl FnMut(MemoryRegion) -> Result<(), efa::PostError>,
) {
    let deadline = Instant::now() + DEADLINE;
    let mut slice = Some(slice);
    loop {
        let Some(s) = slice.take() else {
            panic!("{what}: the refusal kept the slice")
        };
        match post(s) {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::Again => {
                slice = e.buf.into_region();
                p.a.ep.progress();
                p.b.ep.progress();
                assert!(Instant::now() < deadline, "{what}: kept getting Again");
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

/// The slices handed back by completions, rejoined into one region in offset order.
fn rejoin(mut slices: Vec<MemoryRegion>) -> MemoryRegion {
    slices.sort_by_key(|s| s.offset());
    let mut it = slices.into_iter();
    let mut whole = it.next().expect("at least one slice");
    for s in it {
        whole.unsplit(s).expect("adjacent slices of one region");
    }
    whole
}

/// A permutation of `0..n` from `rng`.
fn shuffled(rng: &mut Rng, n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

/// Writes every page of one source region to a scattered page of the target's region at once
/// (half with immediate data), then reads every target page back into pages of another region:
/// each operation completes once and hands back its own slice, the data lands where it was
/// sent, the slices rejoin into the whole region, and no operation registers memory.
fn pages_of_one_region(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let mut rng = Rng::new(seed);
    let page = [4096usize, 5000, 16 << 10, 64 << 10][rng.below(4) as usize];
    let n = 48;
    let len = page * n;
    let src_data = payload(seed, 0, len);
    let dom_a = p.a.ep.domain().clone();
    let (target, rk) = target_region(&p, len, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let src = dom_a
        .register(
            src_data.to_vec(),
            Access::WRITE | Access::READ | Access::REMOTE_READ,
        )
        .unwrap();
    let key = src.key();
    let regs_before = (dom_a.device_stats(), p.b.ep.domain().device_stats());
    let pages = src.chunks(page).unwrap();
    assert_eq!(pages.len(), n);
    // Page i goes to target page dest[i].
    let dest = shuffled(&mut rng, n);
    for (i, pg) in pages.into_iter().enumerate() {
        assert_eq!((pg.offset(), pg.len(), pg.key()), (i * page, page, key));
        let to = rk.at((dest[i] * page) as u64);
        post_slice(&p, pg, "write", |s| {
            if i % 2 == 0 {
                p.a.ep.write(p.peer_b, s, to, i as u64)
            } else {
                p.a.ep.write_data(p.peer_b, s, to, i as u32, i as u64)
            }
        });
    }
    let (done, errs) = gather(&p, true, n, CompletionFlags::WRITE, "writes");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let (notes, errs) = gather(&p, false, n / 2, CompletionFlags::REMOTE_WRITE, "notes");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut data: Vec<u32> = notes.iter().filter_map(|c| c.data).collect();
    data.sort_unstable();
    let odd: Vec<u32> = (0..n as u32).filter(|i| i % 2 == 1).collect();
    assert_eq!(
        data, odd,
        "{setup:?} seed {seed}: each immediate exactly once"
    );
    let mut back = Vec::new();
    let mut seen = HashSet::new();
    for c in done {
        let i = c.context as usize;
        assert!(seen.insert(i), "{setup:?} seed {seed}: write {i} twice");
        assert_eq!(c.len, page, "{setup:?} seed {seed}: write {i}");
        let s = c.buf.into_region().expect("the slice comes back");
        assert_eq!(s.offset(), i * page, "{setup:?} seed {seed}: its own slice");
        back.push(s);
    }
    {
        let t = target.read();
        for i in 0..n {
            let d = dest[i] * page;
            assert!(
                t[d..d + page] == src_data[i * page..(i + 1) * page],
                "{setup:?} seed {seed}: page {i} landed wrong"
            );
        }
    }
    let src = rejoin(back);
    assert_eq!((src.offset(), src.len()), (0, len));
    // Read every target page back into the pages of a second region, in another order.
    let out = dom_a.register(vec![0u8; len], Access::READ).unwrap();
    for (i, pg) in out.chunks(page).unwrap().into_iter().enumerate() {
        let from = rk.at((dest[i] * page) as u64);
        post_slice(&p, pg, "read", |s| {
            p.a.ep.read(p.peer_b, s, page, from, 1000 + i as u64)
        });
    }
    let (done, errs) = gather(&p, true, n, CompletionFlags::READ, "reads");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let slices: Vec<MemoryRegion> = done
        .into_iter()
        .map(|c| {
            let s = c.buf.into_region().expect("the slice comes back");
            assert_eq!(s.offset(), (c.context as usize - 1000) * page);
            s
        })
        .collect();
    let out = rejoin(slices);
    assert!(
        out.read()[..] == src_data[..],
        "{setup:?} seed {seed}: read back what was written"
    );
    let regs_after = (dom_a.device_stats(), p.b.ep.domain().device_stats());
    // The second region registered once; no operation registered anything.
    assert!(
        regs_after.0.mem_registrations <= regs_before.0.mem_registrations + 1,
        "{setup:?} seed {seed}: {:?} -> {:?}",
        regs_before.0,
        regs_after.0
    );
    assert_eq!(
        regs_after.0.mr_registrations, regs_before.0.mr_registrations,
        "{setup:?} seed {seed}: registrations per operation"
    );
    assert_eq!(
        regs_after.1.mem_registrations, regs_before.1.mem_registrations,
        "{setup:?} seed {seed}: the target registered nothing"
    );
    assert_eq!(src.close(), src_data[..], "{setup:?} seed {seed}");
}

#[test]
fn many_operations_on_pages_of_one_region() {
    for s in setups() {
        pages_of_one_region(s);
    }
}

/// Messages between slices: sends from pages of one region, receives into pages of another
/// (tagged and untagged), a short message into a long slice (only its bytes change) and a long
/// message into a short slice (truncated, the rest of the region untouched).
fn messages_between_slices(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let sizes = [1usize, 100, 4096, 9000, 70_000, 300_000];
    let room = 300_000 + 4096;
    let src = p.a.ep.domain().register(
        vec![0u8; sizes.iter().sum()],
        Access::SEND | Access::REMOTE_READ,
    );
    let mut src = src.unwrap();
    let dst =
        p.b.ep
            .domain()
            .register(vec![0xeeu8; room * sizes.len()], Access::RECV)
            .unwrap();
    let mut dst_pages = dst.chunks(room).unwrap().into_iter();
    let mut sent = Vec::new();
    for (i, &len) in sizes.iter().enumerate() {
        let mut s = src.split_to(len).unwrap();
        let data = payload(seed, i, len);
        s.write().copy_from_slice(&data);
        sent.push(data);
        let tagged = i % 2 == 1;
        let r = dst_pages.next().unwrap();
        post_slice(&p, r, "recv", |r| {
            if tagged {
                p.b.ep.trecv(r, 7, 0, i as u64)
            } else {
                p.b.ep.recv(r, i as u64)
            }
        });
        post_slice(&p, s, "send", |s| {
            if tagged {
                p.a.ep.tsend(p.peer_b, s, 7, i as u64)
            } else {
                p.a.ep.send(p.peer_b, s, i as u64)
            }
        });
    }
    let n = sizes.len();
    let (done, errs) = gather(&p, true, n, CompletionFlags::SEND, "sends");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut back: Vec<MemoryRegion> = done
        .into_iter()
        .map(|c| c.buf.into_region().unwrap())
        .collect();
    back.push(src);
    let src = rejoin(back);
    assert_eq!(src.len(), sizes.iter().sum::<usize>());
    let (got, errs) = gather(&p, false, n, CompletionFlags::RECV, "receives");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    for c in got {
        let i = c.context as usize;
        let len = sizes[i];
        assert_eq!(c.len, len, "{setup:?} seed {seed}: message {i}");
        let r = c.buf.as_region().expect("the slice comes back");
        assert_eq!((r.offset(), r.len()), (i * room, room));
        let b = r.read();
        assert!(
            b[..len] == sent[i][..],
            "{setup:?} seed {seed}: message {i} intact"
        );
        assert!(
            b[len..].iter().all(|&x| x == 0xee),
            "{setup:?} seed {seed}: message {i} wrote past its length"
        );
    }
    // A long message into a short slice: truncated to the slice, nothing beyond it touched.
    let mut dst =
        p.b.ep
            .domain()
            .register(vec![0xeeu8; 3 * 4096], Access::RECV)
            .unwrap();
    let short = dst.split_off(4096).unwrap();
    let mut short_rest = short;
    let short = short_rest.split_to(100).unwrap();
    post_slice(&p, short, "recv", |r| p.b.ep.recv(r, 99));
    let long = payload(seed, 99, 5000);
    retry(&p, || p.a.ep.send(p.peer_b, long.clone(), 99), "send");
    let (_, errs) = gather(&p, false, 1, CompletionFlags::RECV, "truncated");
    assert_eq!(errs.len(), 1, "{setup:?} seed {seed}: one truncation error");
    assert_eq!(errs[0].error.kind(), ErrorKind::Truncated);
    let short = errs.into_iter().next().unwrap().buf.into_region().unwrap();
    assert!(short.read()[..] == long[..100], "{setup:?} seed {seed}");
    assert!(dst.read().iter().all(|&x| x == 0xee));
    assert!(short_rest.read().iter().all(|&x| x == 0xee));
    let _ = gather(&p, true, 1, CompletionFlags::SEND, "truncated send");
}

#[test]
fn messages_between_slices_of_regions() {
    for s in setups() {
        messages_between_slices(s);
    }
}

/// A slice's remote key names the slice; atomics and writes through it land at its offset. A
/// dropped slice leaves the key live for the others; closing any slice revokes it for all.
#[test]
fn keys_follow_the_region_not_the_slice() {
    let seed = test_seed();
    let setup = if common::on_efa() {
        Setup::Udp
    } else {
        Setup::Loopback
    };
    let p = pair(setup, seed);
    let mut whole =
        p.b.ep
            .domain()
            .register(
                vec![0u8; 3 * 4096],
                Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap();
    let first = whole.split_to(4096).unwrap();
    let mut middle = whole.split_to(4096).unwrap();
    let last = whole;
    let rk = middle.remote_key().unwrap();
    assert_eq!((rk.len, rk.key), (4096, first.key()));
    assert_eq!(rk.addr, first.remote_key().unwrap().addr + 4096);
    let req = AtomicRequest {
        op: AtomicOp::Sum,
        datatype: AtomicType::U64,
        operand: Bytes::copy_from_slice(&5u64.to_le_bytes()),
        compare: None,
    };
    retry(
        &p,
        || p.a.ep.atomic(p.peer_b, req.clone(), rk.at(8), 1),
        "atomic",
    );
    let (_, errs) = gather(&p, true, 1, CompletionFlags::ATOMIC, "atomic");
    assert!(errs.is_empty(), "{errs:?}");
    assert_eq!(&middle.read()[8..16], &5u64.to_le_bytes());
    assert!(first.read().iter().all(|&x| x == 0) && last.read().iter().all(|&x| x == 0));
    // Dropping a slice revokes nothing.
    drop(first);
    retry(
        &p,
        || {
            p.a.ep
                .write(p.peer_b, Bytes::from_static(b"x"), rk.at(0), 2)
        },
        "write",
    );
    let (_, errs) = gather(&p, true, 1, CompletionFlags::WRITE, "write after a drop");
    assert!(errs.is_empty(), "{errs:?}");
    assert_eq!(middle.read()[0], b'x');
    middle.write()[0] = 0;
    // Closing a slice revokes the region's key: a write to another slice fails, changes nothing.
    assert!(
        last.close().is_empty(),
        "a slice's close gives no buffer back"
    );
    retry(
        &p,
        || {
            p.a.ep
                .write(p.peer_b, Bytes::from_static(b"y"), rk.at(0), 3)
        },
        "write",
    );
    let (_, errs) = gather(&p, true, 1, CompletionFlags::WRITE, "write after close");
    assert_eq!(errs.len(), 1, "seed {seed}");
    assert_eq!(errs[0].error.kind(), ErrorKind::RemoteAccess);
    assert_eq!(middle.read()[0], 0);
}

/// Splits out of range are refused, slices of other regions or with a gap do not join, and
/// the refused slice comes back whole.
#[test]
fn splits_and_joins_refuse_what_does_not_fit() {
    let p = pair(Setup::Loopback, 1);
    let d = p.a.ep.domain();
    let mut a = d.register(vec![1u8; 100], Access::SEND).unwrap();
    assert_eq!(
        a.split_to(101).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        a.split_off(101).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let none = a.split_to(0).unwrap();
    assert_eq!(
        none.chunks(0).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let mut head = a.split_to(10).unwrap();
    let mid = a.split_to(10).unwrap();
    let other = d.register(vec![2u8; 10], Access::SEND).unwrap();
    let other = head.unsplit(other).expect_err("another region");
    assert_eq!(other.len(), 10);
    let tail = head.unsplit(a).expect_err("a gap between");
    assert_eq!((tail.offset(), tail.len()), (20, 80));
    head.unsplit(mid).unwrap();
    head.unsplit(tail).unwrap();
    assert_eq!((head.offset(), head.len()), (0, 100));
    let mut empty = head.split_to(0).unwrap();
    assert!(empty.is_empty());
    empty.unsplit(head).unwrap();
    assert_eq!(empty.close(), vec![1u8; 100]);
}

/// A write from one slice while the application holds the other slice of the same region
/// locked for writing, into one half of the target's region while the target's application
/// holds the other half locked: the lock is by byte range, so the write completes, exact, while
/// both guards are alive (a device that copies the slice when the write is posted, in the
/// posting thread, no longer waits for the guard that thread holds), and what the guards
/// changed stays.
fn write_beside_a_locked_slice(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let page = 64 << 10;
    let data = payload(seed, 1, 2 * page);
    let (mut target, rk) = target_region(&p, 2 * page, Access::REMOTE_WRITE);
    let mut target_second = target.split_off(page).unwrap();
    let mut whole =
        p.a.ep
            .domain()
            .register(data.to_vec(), Access::WRITE)
            .unwrap();
    let mut second = whole.split_off(page).unwrap();
    let first = whole;
    let mut done = {
        let mut guard = second.write();
        let mut target_guard = target_second.write();
        guard[0] ^= 0xff;
        target_guard[..4].copy_from_slice(b"kept");
        post_slice(&p, first, "write", |s| {
            p.a.ep.write(p.peer_b, s, rk.at(0), 1)
        });
        let (done, errs) = gather(&p, true, 1, CompletionFlags::WRITE, "write");
        assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
        guard[0] ^= 0xff;
        done
    };
    let c = done.remove(0);
    let mut first = c.buf.into_region().expect("the slice comes back");
    assert_eq!(first.offset(), 0, "{setup:?} seed {seed}");
    assert!(
        target.read()[..] == data[..page],
        "{setup:?} seed {seed}: the target differs"
    );
    assert_eq!(&target_second.read()[..4], b"kept", "{setup:?} seed {seed}");
    assert!(target_second.read()[4..].iter().all(|b| *b == 0));
    first.unsplit(second).expect("the slices rejoin");
    assert!(first.read()[..] == data[..], "{setup:?} seed {seed}");
    target
        .unsplit(target_second)
        .expect("the target's halves rejoin");
}

/// On every device and protocol: the region's lock is by byte range (issue 27).
#[test]
fn a_write_beside_locked_slices_completes_while_they_are_locked() {
    for setup in setups() {
        write_beside_a_locked_slice(setup);
    }
}

/// Atomics fetch into slices of one registered region (issue 27): eight fetch-and-adds on eight
/// u64 counters of the target, each fetching into its own 8-byte slice of one result region, at
/// once; then a compare-and-swap into a slice. Each completion hands its slice back holding the
/// counter's previous value, the counters moved, and a result slice too short, or without
/// `READ` access, is refused with `InvalidArgument` and handed back.
fn atomics_fetch_into_slices(setup: Setup) {
    let seed = test_seed();
    let p = pair(setup, seed);
    let n = 8usize;
    let start: Vec<u64> = (0..n as u64).map(|i| 1000 * i + 7).collect();
    let init: Vec<u8> = start.iter().flat_map(|v| v.to_le_bytes()).collect();
    let target =
        p.b.ep
            .domain()
            .register(init, Access::REMOTE_WRITE | Access::REMOTE_READ)
            .unwrap();
    let rk = target.remote_key().unwrap();
    let dom = p.a.ep.domain().clone();
    let results = dom
        .register(vec![0xeeu8; 8 * n], Access::READ | Access::WRITE)
        .unwrap();
    let add = |i: usize| AtomicRequest {
        op: AtomicOp::Sum,
        datatype: AtomicType::U64,
        operand: Bytes::copy_from_slice(&(i as u64 + 1).to_le_bytes()),
        compare: None,
    };
    for (i, slot) in results.chunks(8).unwrap().into_iter().enumerate() {
        post_slice(&p, slot, "fetch_atomic", |s| {
            p.a.ep
                .fetch_atomic(p.peer_b, add(i), s, rk.at(8 * i as u64), i as u64)
        });
    }
    let (done, errs) = gather(&p, true, n, CompletionFlags::ATOMIC, "fetch_atomic");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let mut slots = Vec::new();
    for c in done {
        let slot = c.buf.into_region().expect("the slice comes back");
        let i = c.context as usize;
        assert_eq!(slot.offset(), 8 * i, "{setup:?} seed {seed}");
        assert_eq!(
            slot.read()[..],
            start[i].to_le_bytes(),
            "{setup:?} seed {seed}: counter {i}'s previous value"
        );
        slots.push(slot);
    }
    let mut whole = rejoin(slots);
    let counters: Vec<u64> = target
        .read()
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want: Vec<u64> = (0..n).map(|i| start[i] + i as u64 + 1).collect();
    assert_eq!(counters, want, "{setup:?} seed {seed}");
    // A compare-and-swap of counter 0 fetching into the region's second 8 bytes.
    let rest = whole.split_off(8).unwrap();
    let mut slot = rest;
    let tail = slot.split_off(8).unwrap();
    let cas = AtomicRequest {
        op: AtomicOp::Cswap,
        datatype: AtomicType::U64,
        operand: Bytes::copy_from_slice(&5u64.to_le_bytes()),
        compare: Some(Bytes::copy_from_slice(&want[0].to_le_bytes())),
    };
    post_slice(&p, slot, "compare_atomic", |s| {
        p.a.ep.fetch_atomic(p.peer_b, cas.clone(), s, rk.at(0), 99)
    });
    let (mut done, errs) = gather(&p, true, 1, CompletionFlags::ATOMIC, "cswap");
    assert!(errs.is_empty(), "{setup:?} seed {seed}: {errs:?}");
    let slot = done.remove(0).buf.into_region().unwrap();
    assert_eq!(
        slot.read()[..],
        want[0].to_le_bytes(),
        "{setup:?} seed {seed}"
    );
    assert_eq!(
        target.read()[..8],
        5u64.to_le_bytes(),
        "{setup:?} seed {seed}"
    );
    // Refusals hand the slice back: too short, and without READ access.
    let mut short = whole;
    let _ = short.split_off(4).unwrap();
    let e =
        p.a.ep
            .fetch_atomic(p.peer_b, add(0), short, rk.at(0), 100)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{setup:?}");
    assert!(e.buf.as_region().is_some());
    let no_read = dom.register(vec![0u8; 8], Access::WRITE).unwrap();
    let e =
        p.a.ep
            .fetch_atomic(p.peer_b, add(0), no_read, rk.at(0), 101)
            .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{setup:?}");
    assert!(e.buf.as_region().is_some());
    drop((slot, tail));
}

#[test]
fn atomics_fetch_into_slices_of_one_region() {
    for setup in setups() {
        atomics_fetch_into_slices(setup);
    }
}
