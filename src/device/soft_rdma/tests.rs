//! The direct-read (CMA) exchange of `soft_rdma` between two hosts driven by hand, so that a
//! region can be revoked between the copy and READ_DONE, and the copy can fail, at exactly the
//! step the test chooses.

use std::sync::Arc;

use bytes::BytesMut;

use super::*;
use crate::addr::Gid;
use crate::device::RemoteIov;

struct Host {
    rdma: Rdma,
    comps: Vec<DeviceCompletion>,
    counters: DeviceCounters,
    /// What `cma_pid` answers.
    pid: Option<u32>,
    /// What `cma_copy` does (copies from `memory` when `Copied`).
    copy: CmaCopy,
    memory: Vec<u8>,
    base: u64,
    failed: bool,
    /// No receive buffers are ever posted.
    no_recvs: std::collections::VecDeque<(u64, BytesMut)>,
    cookie: Option<(u64, u64)>,
}

impl Host {
    fn new(keys: Option<KeyTable>) -> Host {
        Host {
            rdma: Rdma::new(keys, false),
            comps: Vec::new(),
            counters: DeviceCounters::default(),
            pid: None,
            copy: CmaCopy::Copied,
            memory: Vec::new(),
            base: 0,
            failed: false,
            no_recvs: Default::default(),
            cookie: None,
        }
    }

    /// Takes the queued messages as (wr_id, bytes).
    fn sent(&mut self) -> Vec<(u64, Vec<u8>)> {
        std::mem::take(&mut self.rdma.outbox)
            .into_iter()
            .map(|(_, wr, _)| {
                let mut b = wr.hdr.to_vec();
                b.extend_from_slice(&wr.payload);
                (wr.wr_id, b)
            })
            .collect()
    }
}

impl RdmaHost for Host {
    fn rdma(&mut self) -> &mut Rdma {
        &mut self.rdma
    }
    fn complete(&mut self, c: DeviceCompletion) {
        self.comps.push(c);
    }
    fn recvs(&mut self) -> &mut std::collections::VecDeque<(u64, BytesMut)> {
        &mut self.no_recvs
    }
    fn counters(&self) -> &DeviceCounters {
        &self.counters
    }
    fn mtu(&self) -> usize {
        4096
    }
    fn cma_pid(&mut self, _dest: &RawAddr, _len: usize) -> Option<u32> {
        self.pid
    }
    fn cma_failed(&mut self, _dest: &RawAddr) {
        self.failed = true;
    }
    fn cma_copy(
        &mut self,
        _pid: u32,
        _cookie: (u64, u64),
        addr: u64,
        len: usize,
        buf: &mut BytesMut,
    ) -> CmaCopy {
        if self.copy == CmaCopy::Copied {
            let at = (addr - self.base) as usize;
            buf.clear();
            buf.extend_from_slice(&self.memory[at..at + len]);
        }
        self.copy
    }
    fn cma_cookie(&self) -> Option<(u64, u64)> {
        self.cookie
    }
}

fn src(qpn: u16) -> Src {
    Src {
        source: Source {
            gid: Gid([0; 16]),
            qpn,
        },
        sock: None,
    }
}

/// An initiator that copies directly, a target with one readable region of `len` bytes.
fn setup(len: usize) -> (Host, Host, Arc<RegionMem>, u64, RemoteIov) {
    let keys = KeyTable::default();
    let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
    let mem = RegionMem::new(BytesMut::from(&data[..]));
    let key = keys.lock().register(&mem, Access::REMOTE_READ);
    let remote = RemoteIov {
        addr: mem.addr(),
        len: len as u64,
        key,
    };
    let mut a = Host::new(Some(KeyTable::default()));
    a.pid = Some(4242);
    a.memory = data;
    a.base = mem.addr();
    let mut b = Host::new(Some(keys));
    b.cookie = Some((0x1000, 0xfeed));
    (a, b, mem, key, remote)
}

/// `a` starts a read of `remote` from `b` (queue pair 2, QKEY 7); returns what it sent.
fn read_request(a: &mut Host, remote: RemoteIov) -> Vec<(u64, Vec<u8>)> {
    let dest = RawAddr::new(Gid([0; 16]), 2, 7);
    a.rdma_read(9, None, dest, BytesMut::new(), remote).unwrap();
    a.sent()
}

/// Runs the exchange up to the READ_DONE the initiator sends; returns its bytes and wr_id.
fn until_done(a: &mut Host, b: &mut Host, remote: RemoteIov) -> (u64, Vec<u8>) {
    let req = read_request(a, remote);
    assert_eq!(req.len(), 1);
    assert_eq!(req[0].1[1], F_CMA, "the request asks for a direct copy");
    assert_eq!(b.deliver_rdma(src(1), 7, None, &req[0].1), Served::Ok);
    let grant = b.sent();
    assert_eq!(grant.len(), 1);
    assert_eq!(grant[0].1.len(), HDR, "a grant carries no data");
    // The request's acknowledgement arrives: the read waits for the data.
    a.rdma_send_done(req[0].0, Status::Success);
    assert!(a.comps.is_empty());
    assert_eq!(a.deliver_rdma(src(2), 7, None, &grant[0].1), Served::Ok);
    let done = a.sent();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].1[0], OP_READ_DONE);
    assert!(a.comps.is_empty(), "complete only once the target confirms");
    done.into_iter().next().unwrap()
}

#[test]
fn a_direct_read_completes_when_the_target_confirms_the_key() {
    let (mut a, mut b, _mem, _key, remote) = setup(10_000);
    let (wr_id, done) = until_done(&mut a, &mut b, remote);
    assert_eq!(b.deliver_rdma(src(1), 7, None, &done), Served::Ok);
    a.rdma_send_done(wr_id, Status::Success);
    assert_eq!(a.comps.len(), 1);
    let c = &a.comps[0];
    assert_eq!(
        (c.wr_id, c.status, c.byte_len),
        (9, Status::Success, 10_000)
    );
    assert!(c.buf.as_deref() == Some(&a.memory[..]));
}

#[test]
fn a_region_revoked_during_the_copy_fails_the_read() {
    let (mut a, mut b, _mem, key, remote) = setup(10_000);
    let (wr_id, done) = until_done(&mut a, &mut b, remote);
    b.rdma.keys.as_ref().unwrap().lock().deregister(key);
    assert_eq!(b.deliver_rdma(src(1), 7, None, &done), Served::Denied);
    a.rdma_send_done(wr_id, Status::RemoteBadAddress);
    assert_eq!(a.comps.len(), 1);
    let c = &a.comps[0];
    assert_eq!((c.status, c.byte_len), (Status::RemoteBadAddress, 0));
    assert!(
        c.buf.as_ref().is_some_and(|b| b.is_empty()),
        "no bytes handed out"
    );
}

/// Keys come back (a NIC recycles its indices; random keys may repeat): a region revoked during
/// the copy and another registered meanwhile under the same key at the same address must not
/// confirm the read (the grant names the registration it was for; issue 30, point 5).
#[test]
#[allow(unsafe_code)]
fn a_key_recycled_during_the_copy_fails_the_read() {
    let (mut a, mut b, mem, key, remote) = setup(10_000);
    let (wr_id, done) = until_done(&mut a, &mut b, remote);
    let keys = b.rdma.keys.clone().unwrap();
    keys.lock().deregister(key);
    let mut other = vec![0u8; 10_000];
    // SAFETY: `other` outlives the registration (dropped at the end of the test).
    let newer = unsafe { RegionMem::foreign(other.as_mut_ptr(), other.len(), mem.addr()) }.unwrap();
    assert!(keys.lock().register_as(&newer, Access::REMOTE_READ, key));
    assert_eq!(b.deliver_rdma(src(1), 7, None, &done), Served::Denied);
    a.rdma_send_done(wr_id, Status::RemoteBadAddress);
    assert_eq!(a.comps[0].status, Status::RemoteBadAddress);
    newer.close_foreign();
    drop(other);
}

#[test]
fn a_failed_or_misdirected_copy_asks_again_for_the_data() {
    for outcome in [CmaCopy::WrongProcess, CmaCopy::Failed] {
        let (mut a, mut b, _mem, _key, remote) = setup(10_000);
        a.copy = outcome;
        let req = read_request(&mut a, remote);
        assert_eq!(b.deliver_rdma(src(1), 7, None, &req[0].1), Served::Ok);
        let grant = b.sent();
        a.deliver_rdma(src(2), 7, None, &grant[0].1);
        assert_eq!(a.failed, outcome == CmaCopy::WrongProcess);
        let again = a.sent();
        assert_eq!(again.len(), 1);
        assert_eq!(
            (again[0].1[0], again[0].1[1]),
            (OP_READ_REQ, 0),
            "plain request"
        );
        // The target answers it with chunks; the read completes with the data.
        assert_eq!(b.deliver_rdma(src(1), 7, None, &again[0].1), Served::Ok);
        for (_, chunk) in b.sent() {
            a.deliver_rdma(src(2), 7, None, &chunk);
        }
        a.rdma_send_done(req[0].0, Status::Success);
        a.rdma_send_done(again[0].0, Status::Success);
        assert_eq!(a.comps.len(), 1, "{outcome:?}");
        let c = &a.comps[0];
        assert_eq!(c.status, Status::Success);
        assert!(c.buf.as_deref() == Some(&a.memory[..]));
    }
}

#[test]
fn a_target_without_cma_answers_a_direct_request_with_chunks() {
    let (mut a, mut b, _mem, _key, remote) = setup(10_000);
    b.cookie = None;
    let req = read_request(&mut a, remote);
    assert_eq!(b.deliver_rdma(src(1), 7, None, &req[0].1), Served::Ok);
    let chunks = b.sent();
    assert!(chunks.len() >= 3, "10000 bytes in 4048-byte chunks");
    for (_, chunk) in chunks {
        a.deliver_rdma(src(2), 7, None, &chunk);
    }
    a.rdma_send_done(req[0].0, Status::Success);
    assert_eq!(a.comps.len(), 1);
    assert!(a.comps[0].buf.as_deref() == Some(&a.memory[..]));
}

/// Keys fit an EFA rkey (32 bits): a libfabric peer's RDMA read or write carries only those
/// (issue 16: libfabric's long-read of a region the udp device registered was refused when
/// keys had 48 bits). Never 0, and distinct from every live key. (A revoked key's bits may be
/// drawn again: keys are random, and 10 000 draws of 32 bits repeat one about once in 90 runs,
/// which made the earlier form of this test, registering and revoking one key at a time, flaky.)
#[test]
fn keys_are_32_bit_and_distinct() {
    let mut keys = Keys::default();
    let mem = RegionMem::new(BytesMut::zeroed(64));
    let mut live = std::collections::HashSet::new();
    for _ in 0..10_000 {
        let k = keys.register(&mem, Access::REMOTE_READ);
        assert!(k != 0 && k <= u64::from(u32::MAX), "key {k:#x}");
        assert!(live.insert(k), "key {k:#x} handed out while live");
    }
    for k in live {
        keys.deregister(k);
    }
}

/// Issue 17: hostile RDMA messages (random bytes, and valid headers with random fields and
/// flipped bytes) fed to a target: nothing panics, a region changes only by a WRITE that names
/// its key and lies inside it (checked against a model), reads answer with at most what was
/// asked, and an initiator ignores responses to reads it never made.
#[test]
fn hostile_rdma_messages_write_only_what_a_key_allows() {
    use crate::fault::{Rng, test_seed};
    let seed = test_seed();
    let mut rng = Rng::new(seed);
    const LEN: usize = 256;
    let keys = KeyTable::default();
    let mem = RegionMem::new(BytesMut::from(&[0u8; LEN][..]));
    let key = keys
        .lock()
        .register(&mem, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let base = mem.addr();
    let mut b = Host::new(Some(keys));
    let mut a = Host::new(Some(KeyTable::default()));
    let mut model = vec![0u8; LEN];
    let mut landed = 0;
    let pick = |rng: &mut Rng, near: u64| match rng.below(4) {
        0 => near,
        1 => near
            .wrapping_add(rng.below(2 * LEN as u64))
            .wrapping_sub(LEN as u64 / 2),
        2 => rng.below(LEN as u64 + 8),
        _ => rng.next_u64(),
    };
    for i in 0..20_000u32 {
        let mut msg = if rng.chance(0.25) {
            // A write inside the region (mutated below sometimes).
            let s = rng.below(LEN as u64);
            let total = 1 + rng.below(LEN as u64 - s);
            let off = rng.below(total);
            let body = 1 + rng.below(total - off);
            let mut m = header(OP_WRITE, 0, rng.below(8), key, base + s, total, off).to_vec();
            m.extend((0..body).map(|_| rng.next_u64() as u8));
            if rng.chance(0.2) {
                let at = rng.below(m.len() as u64) as usize;
                m[at] ^= 1 << rng.below(8);
            }
            m
        } else if rng.chance(0.2) {
            let n = rng.below(2 * HDR as u64) as usize;
            (0..n).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>()
        } else {
            let op = rng.below(6) as u8;
            let flags = rng.below(4) as u8;
            let k = if rng.chance(0.7) { key } else { rng.next_u64() };
            let (s, total, off) = (pick(&mut rng, base), pick(&mut rng, 16), pick(&mut rng, 0));
            let mut m = header(op, flags, rng.below(8), k, s, total, off).to_vec();
            let body = rng.below(40) as usize;
            m.extend((0..body).map(|_| rng.next_u64() as u8));
            if rng.chance(0.2) {
                let at = rng.below(m.len() as u64) as usize;
                m[at] ^= 1 << rng.below(8);
            }
            m
        };
        // What the model lets through: a WRITE without immediate data (no receive buffer is
        // posted), with the key, its whole range inside the region, the chunk inside the write.
        if msg.len() >= HDR && msg[0] == OP_WRITE && msg[1] & F_LAST_IMM == 0 {
            let (k, s, total, off) = (
                u64_at(&msg, 16),
                u64_at(&msg, 24),
                u64_at(&msg, 32),
                u64_at(&msg, 40),
            );
            let body = &msg[HDR..];
            let inside = k == key
                && s >= base
                && s.checked_add(total).is_some_and(|e| e <= base + LEN as u64)
                && off
                    .checked_add(body.len() as u64)
                    .is_some_and(|e| e <= total);
            if inside {
                let at = (s - base + off) as usize;
                model[at..at + body.len()].copy_from_slice(body);
                landed += 1;
            }
        }
        let served = b.deliver_rdma(src(1), 7, None, &msg);
        let _ = served;
        let mut now = BytesMut::new();
        mem.read_into(base, LEN as u64, &mut now).unwrap();
        assert_eq!(&now[..], &model[..], "seed {seed}: message {i}: {msg:?}");
        for (_, out) in b.sent() {
            assert!(out.len() <= HDR + 4096, "seed {seed}: message {i}");
        }
        assert!(
            b.comps.is_empty(),
            "seed {seed}: message {i}: no completion without imm"
        );
        // The same bytes at an initiator with no reads in flight: nothing completes.
        msg.truncate(msg.len().min(HDR + 64));
        let _ = a.deliver_rdma(src(2), 7, None, &msg);
        assert!(
            a.comps.is_empty(),
            "seed {seed}: message {i}: {:?}",
            a.comps
        );
        a.sent();
    }
    assert!(
        landed > 100,
        "seed {seed}: only {landed} writes were allowed"
    );
    assert!(
        b.counters
            .malformed_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}
