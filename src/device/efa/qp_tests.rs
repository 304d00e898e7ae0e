//! Tests of [`EfaQp`](super::EfaQp) against the fake NIC.
use super::super::ah::test_gid as gid;
use super::super::fake::FakeNic;
use super::*;
use crate::addr::Gid;
use rdma_sys::ibv_wc_status::{IBV_WC_GENERAL_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_SUCCESS};

const MTU: usize = 256;

fn limits(caps: DeviceCaps) -> QpLimits {
    QpLimits {
        mtu: MTU,
        inline_size: 32,
        send_depth: 4,
        recv_depth: 4,
        caps,
        max_rdma_size: 1 << 20,
        huge_pages: false,
    }
}

fn qp_with(qp_type: QpType, caps: DeviceCaps) -> EfaQp<FakeNic> {
    EfaQp::new(
        FakeNic::new(qp_type),
        RawAddr::new(gid(1), 7, 0x1234),
        qp_type,
        limits(caps),
        Arc::new(Notifier::new()),
        Arc::new(DeviceCounters::default()),
        Arc::new(AtomicU64::new(0)),
    )
    .unwrap()
}

fn qp(qp_type: QpType) -> EfaQp<FakeNic> {
    qp_with(qp_type, DeviceCaps::default())
}

fn rdma() -> DeviceCaps {
    DeviceCaps {
        rdma_read: true,
        rdma_write: true,
        ..DeviceCaps::default()
    }
}

fn send(wr_id: u64, dest: RawAddr, hdr: &'static [u8], payload: &'static [u8]) -> SendWr {
    SendWr {
        wr_id,
        dest,
        hdr: Bytes::from_static(hdr),
        payload: Bytes::from_static(payload),
        imm: None,
    }
}

fn poll_all(q: &mut EfaQp<FakeNic>) -> Vec<DeviceCompletion> {
    let mut out = Vec::new();
    while q.poll(&mut out, 16) > 0 {}
    out
}

#[test]
fn ud_receive_strips_the_grh() {
    let mut q = qp(QpType::Ud);
    q.post_recv(7, BytesMut::with_capacity(100)).unwrap();
    let sender = gid(9);
    let ahn = q.nic_mut().ahn_for(&sender);
    // The posted slot has room for the GRH and an MTU.
    assert_eq!(q.nic_mut().recvs[0].1.len as usize, MTU + GRH_LEN);
    q.nic_mut()
        .arrive(b"hello", u32::from(ahn), 33, Some(0xabcd))
        .unwrap();
    let c = poll_all(&mut q);
    assert_eq!(c.len(), 1);
    let c = &c[0];
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (7, Status::Success, Opcode::Recv)
    );
    assert_eq!(c.byte_len, 5, "byte_len excludes the GRH");
    let buf = c.buf.as_ref().unwrap();
    assert_eq!(&buf[..], b"hello");
    assert_eq!(buf.capacity(), 100, "the caller's buffer, not reallocated");
    assert_eq!(
        c.src,
        Some(Source {
            gid: sender,
            qpn: 33
        })
    );
    assert_eq!(c.imm, Some(0xabcd));
    assert_eq!(q.counters.snapshot().rx_bytes, 5);
}

/// Bounce pools are page-aligned and a whole number of pages long, so fork support's
/// MADV_DONTFORK on their pages catches no unrelated heap data (issue 16, defect 9).
#[test]
fn bounce_pools_are_whole_pages() {
    let q = qp(QpType::Ud);
    // SAFETY: sysconf has no preconditions.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize).max(4096);
    for p in [q.send_pool.as_ref().unwrap(), q.recv_pool.as_ref().unwrap()] {
        let sge = p.sge(0, 0);
        assert_eq!(sge.addr as usize % page, 0, "page-aligned");
        assert_eq!(
            p.len_bytes() % page,
            0,
            "whole pages: {} bytes",
            p.len_bytes()
        );
        assert!(p.len_bytes() >= p.slot_size());
    }
}

/// `FI_EFA_USE_HUGE_PAGE`: pools go on huge pages when the system has them reserved, else on
/// ordinary pages with a fallback counted; either way they work the same.
#[test]
fn huge_page_pools_or_a_counted_fallback() {
    let mut l = limits(DeviceCaps::default());
    l.huge_pages = true;
    let counters = Arc::new(DeviceCounters::default());
    let mut q = EfaQp::new(
        FakeNic::new(QpType::Srd),
        RawAddr::new(gid(1), 7, 0x1234),
        QpType::Srd,
        l,
        Arc::new(Notifier::new()),
        counters.clone(),
        Arc::new(AtomicU64::new(0)),
    )
    .unwrap();
    let s = counters.snapshot();
    let huge = q.send_pool.as_ref().unwrap().is_huge();
    eprintln!("bounce pools on huge pages: {huge}");
    if huge {
        assert!(s.huge_page_bytes >= 2 << 20, "{s:?}");
        assert_eq!(q.send_pool.as_ref().unwrap().len_bytes() % (2 << 20), 0);
    } else {
        assert_eq!((s.huge_page_bytes, s.huge_page_fallbacks), (0, 2), "{s:?}");
    }
    // The pools work either way.
    q.post_recv(1, BytesMut::with_capacity(16)).unwrap();
    q.nic_mut()
        .arrive(b"huge", super::super::verbs::AHN_UNKNOWN, 5, None)
        .unwrap();
    let c = poll_all(&mut q);
    assert_eq!(&c[0].buf.as_ref().unwrap()[..], b"huge");
}

#[test]
fn srd_receive_has_no_grh_and_truncates_into_small_buffers() {
    let mut q = qp(QpType::Srd);
    assert_eq!(q.recv_pool.as_ref().unwrap().slot_size(), MTU);
    q.post_recv(1, BytesMut::with_capacity(3)).unwrap();
    q.post_recv(2, BytesMut::with_capacity(64)).unwrap();
    let n = q.nic_mut();
    n.arrive(b"hello", super::super::verbs::AHN_UNKNOWN, 5, None)
        .unwrap();
    n.arrive(b"", super::super::verbs::AHN_UNKNOWN, 5, None)
        .unwrap();
    let c = poll_all(&mut q);
    assert_eq!(c[0].status, Status::LocalBadLength);
    assert_eq!(c[0].byte_len, 5);
    assert_eq!(&c[0].buf.as_ref().unwrap()[..], b"hel");
    assert_eq!(c[1].status, Status::Success);
    assert_eq!(c[1].byte_len, 0);
    // Unknown AHN and no SGID: the queue pair number only (the engine then identifies the
    // sender by its REQ's raw address header).
    assert_eq!(
        c[1].src,
        Some(Source {
            gid: crate::Gid::UNKNOWN,
            qpn: 5
        })
    );
}

#[test]
fn grh_payload_and_impossible_lengths() {
    let slot: Vec<u8> = (0..100u8).collect();
    assert_eq!(recv_payload(QpType::Ud, &slot, 45), Some(&slot[40..45]));
    assert_eq!(recv_payload(QpType::Ud, &slot, 40), Some(&slot[40..40]));
    assert_eq!(recv_payload(QpType::Ud, &slot, 39), None);
    assert_eq!(recv_payload(QpType::Ud, &slot, 101), None);
    assert_eq!(recv_payload(QpType::Srd, &slot, 5), Some(&slot[..5]));
    assert_eq!(recv_payload(QpType::Srd, &slot, 101), None);
    // A UD completion shorter than a GRH is an internal error, the buffer comes back.
    let mut q = qp(QpType::Ud);
    q.post_recv(3, BytesMut::with_capacity(8)).unwrap();
    let token = q.nic_mut().recvs[0].0;
    q.nic_mut().recvs.clear();
    q.nic_mut().cq.push_back(RawWc {
        wr_id: token,
        opcode: rdma_sys::ibv_wc_opcode::IBV_WC_RECV,
        byte_len: 12,
        ..RawWc::default()
    });
    let c = poll_all(&mut q);
    assert_eq!(c[0].status, Status::LocalQpInternalError);
    assert!(c[0].buf.as_ref().unwrap().is_empty());
}

#[test]
fn source_from_sgid_when_the_sender_has_no_handle() {
    let mut q = qp(QpType::Srd);
    q.post_recv(1, BytesMut::with_capacity(16)).unwrap();
    let token = q.nic_mut().recvs.pop_front().unwrap().0;
    q.nic_mut().cq.push_back(RawWc {
        wr_id: token,
        opcode: rdma_sys::ibv_wc_opcode::IBV_WC_RECV,
        byte_len: 0,
        slid: super::super::verbs::AHN_UNKNOWN,
        src_qp: 12,
        sgid: Some(gid(42)),
        ..RawWc::default()
    });
    let c = poll_all(&mut q);
    assert_eq!(
        c[0].src,
        Some(Source {
            gid: gid(42),
            qpn: 12
        })
    );
    // The device made an AH for the new sender (libfabric's implicit insertion): its RDMA to
    // us is accepted and its next packets name it by AHN (issue 16, defect 5).
    assert!(q.nic_mut().ahn_of(&gid(42)).is_some());
}

#[test]
fn sends_copy_into_registered_slots_or_go_inline() {
    let mut q = qp(QpType::Srd);
    let dest = RawAddr::new(gid(2), 11, 0x5555);
    let long: &'static [u8] = &[7u8; 100];
    q.post_send(send(1, dest, b"HDR:", long)).unwrap();
    q.post_send(send(2, dest, b"hi", b" there")).unwrap();
    let mut w = send(3, dest, b"", b"");
    w.imm = Some(99);
    q.post_send(w).unwrap();
    let n = q.nic_mut();
    assert_eq!(n.sends.len(), 3);
    let s = &n.sends[0];
    assert!(!s.inline);
    let sge = s.sge.unwrap();
    assert_eq!(sge.len, 104);
    assert_ne!(sge.lkey, 0);
    assert_eq!(&s.data[..4], b"HDR:");
    assert_eq!(&s.data[4..], long);
    assert_eq!((s.gid, s.qpn, s.qkey), (gid(2), 11, 0x5555));
    assert!(n.sends[1].inline);
    assert_eq!(n.sends[1].data, b"hi there");
    assert_eq!(n.sends[2].op, SendOp::Send { imm: Some(99) });
    assert!(n.sends[2].data.is_empty());
    // One address handle for the destination, shared.
    assert_eq!(
        q.send_pool.as_ref().unwrap().available(),
        3,
        "only the long send took a slot"
    );
    for i in 0..3 {
        q.nic_mut().complete_send(i, IBV_WC_SUCCESS, 0);
    }
    let c = poll_all(&mut q);
    let ids: Vec<(u64, Status, usize)> =
        c.iter().map(|c| (c.wr_id, c.status, c.byte_len)).collect();
    assert_eq!(
        ids,
        [
            (1, Status::Success, 104),
            (2, Status::Success, 8),
            (3, Status::Success, 0)
        ]
    );
    assert!(
        c.iter()
            .all(|c| c.opcode == Opcode::Send && c.buf.is_none())
    );
    assert_eq!(q.send_pool.as_ref().unwrap().available(), 4);
    assert_eq!(q.counters.snapshot().tx_pkts, 3);
}

#[test]
fn limits_are_enforced() {
    let mut q = qp(QpType::Srd);
    let dest = RawAddr::new(gid(2), 11, 1);
    let big: &'static [u8] = &[0u8; MTU + 1];
    assert_eq!(
        q.post_send(send(1, dest, b"", big)).unwrap_err().kind(),
        ErrorKind::MsgSize
    );
    for i in 0..4 {
        q.post_send(send(i, dest, b"x", b"")).unwrap();
    }
    assert_eq!(
        q.post_send(send(9, dest, b"x", b"")).unwrap_err().kind(),
        ErrorKind::Again
    );
    for i in 0..4 {
        q.post_recv(i, BytesMut::new()).unwrap();
    }
    assert_eq!(
        q.post_recv(9, BytesMut::new()).unwrap_err().kind(),
        ErrorKind::Again
    );
    // RDMA without the capability.
    let r = RemoteIov {
        addr: 0,
        len: 4,
        key: 1,
    };
    assert_eq!(
        q.post_read(1, dest, BytesMut::with_capacity(4), r)
            .unwrap_err()
            .kind(),
        ErrorKind::NotSupported
    );
    assert_eq!(
        q.post_write(1, dest, Bytes::from_static(b"abcd"), r, None)
            .unwrap_err()
            .kind(),
        ErrorKind::NotSupported
    );
    // An address handle the device refuses.
    let mut q = qp(QpType::Srd);
    let bad = RawAddr::new(Gid([0xff; 16]), 1, 1);
    assert_eq!(
        q.post_send(send(1, bad, b"x", b"")).unwrap_err().kind(),
        ErrorKind::Unreachable
    );
    assert_eq!(q.table.len(), 0);
}

#[test]
fn refused_posts_release_everything() {
    let mut q = qp(QpType::Srd);
    let dest = RawAddr::new(gid(2), 11, 1);
    let long: &'static [u8] = &[1u8; 64];
    q.nic_mut().fail_send = Some(12);
    let e = q.post_send(send(1, dest, b"", long)).unwrap_err();
    assert_eq!(
        e.kind(),
        ErrorKind::Again,
        "ENOMEM from the device queue is Again"
    );
    q.nic_mut().fail_send = Some(22);
    let e = q.post_send(send(1, dest, b"", long)).unwrap_err();
    assert_eq!(
        (e.kind(), e.op()),
        (ErrorKind::InvalidArgument, "ibv_wr_send")
    );
    q.nic_mut().fail_recv = Some(12);
    assert_eq!(
        q.post_recv(1, BytesMut::new()).unwrap_err().kind(),
        ErrorKind::Again
    );
    assert!(q.table.is_empty());
    assert_eq!(q.send_pool.as_ref().unwrap().available(), 4);
    assert_eq!(q.recv_pool.as_ref().unwrap().available(), 4);
    assert_eq!((q.sends, q.recvs), (0, 0));
    // A refused RDMA read deregisters its buffer.
    let mut q = qp_with(QpType::Srd, rdma());
    let regs = q.nic_mut().live_regs();
    q.nic_mut().fail_send = Some(22);
    let r = RemoteIov {
        addr: 0x1000,
        len: 8,
        key: 5,
    };
    assert!(q.post_read(1, dest, BytesMut::with_capacity(8), r).is_err());
    assert_eq!(q.nic_mut().live_regs(), regs);
}

#[test]
fn every_work_request_completes_once_stale_and_unknown_ignored() {
    let mut q = qp(QpType::Srd);
    let dest = RawAddr::new(gid(2), 11, 1);
    q.post_send(send(10, dest, b"a", b"")).unwrap();
    q.post_send(send(11, dest, b"b", b"")).unwrap();
    q.post_recv(20, BytesMut::with_capacity(8)).unwrap();
    let n = q.nic_mut();
    n.complete_send(1, IBV_WC_RNR_RETRY_EXC_ERR, 10);
    n.complete_send(0, IBV_WC_SUCCESS, 0);
    // The device reports send 0 twice, and a token nobody posted.
    n.complete_send(0, IBV_WC_SUCCESS, 0);
    n.cq.push_back(RawWc {
        wr_id: 0x7777_0000_0042,
        ..RawWc::default()
    });
    let c = poll_all(&mut q);
    let got: Vec<(u64, Status)> = c.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(got, [(11, Status::RnrRetryExceeded), (10, Status::Success)]);
    assert_eq!(c[0].byte_len, 0, "no bytes for a failed send");
    assert_eq!((q.table.stale(), q.table.unknown()), (0, 2));
    assert_eq!(q.strays.load(Ordering::Relaxed), 2);
    let s = q.counters.snapshot();
    assert_eq!((s.send_errors, s.rnr_events), (1, 1));
    // Reuse a slot, then the old token again: stale.
    q.post_send(send(12, dest, b"c", b"")).unwrap();
    let old = q.nic_mut().sends[0].wr_id;
    q.nic_mut().cq.push_back(RawWc {
        wr_id: old,
        ..RawWc::default()
    });
    assert!(poll_all(&mut q).is_empty());
    assert_eq!(q.table.stale(), 1);
    // Close: the receive and the third send are flushed, with the receive buffer back.
    q.close();
    let c = poll_all(&mut q);
    let got: Vec<(u64, Status, Opcode)> = c.iter().map(|c| (c.wr_id, c.status, c.opcode)).collect();
    assert_eq!(
        got,
        [
            (20, Status::Flushed, Opcode::Recv),
            (12, Status::Flushed, Opcode::Send)
        ]
    );
    assert_eq!(c[0].buf.as_ref().unwrap().capacity(), 8);
    assert!(q.nic_mut().destroyed);
    // Nothing more, ever; posts are refused.
    assert!(poll_all(&mut q).is_empty());
    assert_eq!(
        q.post_recv(1, BytesMut::new()).unwrap_err().kind(),
        ErrorKind::Closed
    );
    assert_eq!(
        q.post_send(send(1, dest, b"", b"")).unwrap_err().kind(),
        ErrorKind::Closed
    );
    q.close();
    assert!(poll_all(&mut q).is_empty());
}

#[test]
fn close_collects_device_flushes_first() {
    let mut q = qp(QpType::Ud);
    q.nic_mut().flush_on_error = true;
    for i in 0..3 {
        q.post_recv(i, BytesMut::with_capacity(4)).unwrap();
    }
    q.close();
    assert!(q.nic_mut().errored);
    let c = poll_all(&mut q);
    assert_eq!(c.len(), 3);
    assert!(
        c.iter()
            .all(|c| c.status == Status::Flushed && c.buf.is_some())
    );
    let mut ids: Vec<u64> = c.iter().map(|c| c.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2]);
    assert_eq!(q.strays.load(Ordering::Relaxed), 0);
}

/// A zero-byte RDMA write or read (a write with immediate data only, say) carries one
/// zero-length SGE in registered memory, as libfabric posts it, never an empty SGE list
/// (issue 16, defect 7); nothing is registered for it.
#[test]
fn zero_byte_rdma_posts_one_zero_length_registered_sge() {
    let mut q = qp_with(QpType::Srd, rdma());
    let base = q.nic_mut().live_regs();
    let dest = RawAddr::new(gid(3), 4, 5);
    let r = RemoteIov {
        addr: 0x10_0000,
        len: 0,
        key: 0x42,
    };
    q.post_write(1, dest, Bytes::new(), r, Some(9)).unwrap();
    q.post_read(2, dest, BytesMut::new(), r).unwrap();
    assert_eq!(
        q.nic_mut().live_regs(),
        base,
        "no registration for zero bytes"
    );
    let pool_lkey = q.send_pool.as_ref().unwrap().sge(0, 0).lkey;
    for s in &q.nic_mut().sends {
        let sge = s.sge.expect("one SGE");
        assert_eq!(sge.len, 0);
        assert_eq!(sge.lkey, pool_lkey);
        assert_ne!(sge.addr, 0);
    }
}

#[test]
fn rdma_read_and_write_register_for_the_operation_only() {
    let mut q = qp_with(QpType::Srd, rdma());
    let base = q.nic_mut().live_regs();
    assert_eq!(base, 2, "the two bounce pools");
    let dest = RawAddr::new(gid(3), 4, 5);
    let r = RemoteIov {
        addr: 0x10_0000,
        len: 6,
        key: 0x42,
    };
    q.post_read(1, dest, BytesMut::with_capacity(10), r)
        .unwrap();
    q.post_write(
        2,
        dest,
        Bytes::from_static(b"written"),
        RemoteIov { len: 7, ..r },
        Some(3),
    )
    .unwrap();
    assert_eq!(q.nic_mut().live_regs(), base + 2);
    let n = q.nic_mut();
    assert_eq!(
        n.sends[0].op,
        SendOp::Read {
            rkey: 0x42,
            raddr: 0x10_0000
        }
    );
    assert_eq!(
        n.sends[1].op,
        SendOp::Write {
            rkey: 0x42,
            raddr: 0x10_0000,
            imm: Some(3)
        }
    );
    assert_eq!(n.sends[1].data, b"written");
    n.fill_read(0, b"remote");
    n.complete_send(0, IBV_WC_SUCCESS, 0);
    n.complete_send(1, IBV_WC_SUCCESS, 0);
    let c = poll_all(&mut q);
    assert_eq!(q.nic_mut().live_regs(), base, "deregistered at completion");
    assert_eq!(
        (c[0].opcode, c[0].status, c[0].byte_len),
        (Opcode::RdmaRead, Status::Success, 6)
    );
    assert_eq!(&c[0].buf.as_ref().unwrap()[..], b"remote");
    assert_eq!((c[1].opcode, c[1].byte_len), (Opcode::RdmaWrite, 7));
    assert_eq!(q.counters.snapshot().rdma_bytes, 13);
    // A failed read hands the buffer back empty.
    q.post_read(3, dest, BytesMut::with_capacity(10), r)
        .unwrap();
    q.nic_mut().complete_send(2, IBV_WC_GENERAL_ERR, 7);
    let c = poll_all(&mut q);
    assert_eq!(c[0].status, Status::RemoteBadAddress);
    assert!(c[0].buf.as_ref().unwrap().is_empty());
    // Bad arguments.
    let e = q
        .post_read(4, dest, BytesMut::with_capacity(2), r)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = q
        .post_read(
            4,
            dest,
            BytesMut::with_capacity(8),
            RemoteIov { key: 1 << 40, ..r },
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let huge = RemoteIov { len: 2 << 20, ..r };
    let e = q
        .post_read(4, dest, BytesMut::with_capacity(2 << 20), huge)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::MsgSize);
    // RDMA is SRD only.
    let mut ud = qp_with(QpType::Ud, rdma());
    assert_eq!(
        ud.post_read(1, dest, BytesMut::with_capacity(8), r)
            .unwrap_err()
            .kind(),
        ErrorKind::NotSupported
    );
}

/// Region RDMA names the region's own registration: no registration per operation, the data
/// goes straight to and from the region's memory, and a slice outside a live registration (or
/// of a revoked key) is refused before anything is posted.
#[test]
fn region_rdma_uses_the_regions_registration() {
    use super::super::mr::{LocalKey, LocalKeys};
    use crate::mem::{RegionMem, RegionSlice};
    let mut q = qp_with(QpType::Srd, rdma());
    let mut buf = BytesMut::zeroed(64);
    buf[..7].copy_from_slice(b"region!");
    let mem = RegionMem::new(buf);
    // SAFETY: the region's buffer outlives the registration (dropped at the end of the test).
    let mr = unsafe {
        q.nic_mut()
            .register(mem.addr() as usize as *mut u8, mem.len(), 1)
    }
    .unwrap();
    let live = LocalKey {
        lkey: mr.lkey(),
        addr: mem.addr(),
        len: mem.len(),
    };
    let keys = Arc::new(LocalKeys::default());
    keys.0.lock().insert(77, live);
    q.set_local_keys(keys.clone());
    assert!(q.region_rdma());
    let base = q.nic_mut().live_regs();
    let dest = RawAddr::new(gid(3), 4, 5);
    let r = RemoteIov {
        addr: 0x10_0000,
        len: 7,
        key: 0x42,
    };
    let whole = RegionSlice {
        mem: mem.clone(),
        key: 77,
        addr: mem.addr(),
        len: mem.len(),
    };
    q.post_write_region(1, dest, whole.sub(0, 7).unwrap(), r, Some(5))
        .unwrap();
    q.post_read_region(
        2,
        dest,
        whole.sub(32, 6).unwrap(),
        RemoteIov { len: 6, ..r },
    )
    .unwrap();
    assert_eq!(
        q.nic_mut().live_regs(),
        base,
        "no registration per operation"
    );
    let n = q.nic_mut();
    assert_eq!(n.sends[0].data, b"region!");
    for (s, off) in n.sends.iter().zip([0u64, 32]) {
        let sge = s.sge.expect("one SGE");
        assert_eq!((sge.lkey, sge.addr), (mr.lkey(), mem.addr() + off));
    }
    n.fill_read(1, b"remote");
    n.complete_send(0, IBV_WC_SUCCESS, 0);
    n.complete_send(1, IBV_WC_SUCCESS, 0);
    let c = poll_all(&mut q);
    assert_eq!(
        c.iter()
            .map(|c| (c.wr_id, c.opcode, c.status, c.byte_len, c.buf.is_some()))
            .collect::<Vec<_>>(),
        [
            (1, Opcode::RdmaWrite, Status::Success, 7, false),
            (2, Opcode::RdmaRead, Status::Success, 6, false)
        ]
    );
    let mut got = BytesMut::new();
    mem.read_into(mem.addr() + 32, 6, &mut got).unwrap();
    assert_eq!(&got[..], b"remote", "the read landed in the region");
    // Refusals: past the registration, an unknown key, a revoked key; nothing posted.
    let past = RegionSlice {
        addr: mem.addr() + 60,
        len: 7,
        ..whole.clone()
    };
    let e = q.post_write_region(3, dest, past, r, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let unknown = RegionSlice {
        key: 78,
        ..whole.sub(0, 7).unwrap()
    };
    let e = q.post_write_region(3, dest, unknown, r, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    keys.0.lock().remove(&77);
    let e = q
        .post_read_region(3, dest, whole.sub(0, 7).unwrap(), r)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(q.nic_mut().sends.len(), 2, "nothing more was posted");
    // A read longer than the slice is refused; UD has no RDMA.
    keys.0.lock().insert(77, live);
    let e = q
        .post_read_region(3, dest, whole.sub(0, 4).unwrap(), r)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut ud = qp_with(QpType::Ud, rdma());
    ud.set_local_keys(keys);
    assert!(!ud.region_rdma());
    let e = ud
        .post_read_region(1, dest, whole.sub(0, 7).unwrap(), r)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotSupported);
    drop(mr);
}

/// A list of work requests (RDMA or sends) rings one doorbell; the first that cannot be taken ends the
/// list (those before it are posted, the rest stay with the caller); a list the NIC refuses
/// whole is posted one by one, and none is lost.
#[test]
fn a_list_rings_one_doorbell() {
    use crate::device::{RdmaKind, RdmaWr};
    let mut q = qp_with(QpType::Srd, rdma());
    let dest = RawAddr::new(gid(3), 4, 5);
    let r = |addr| RemoteIov {
        addr,
        len: 4,
        key: 0x42,
    };
    let write = |wr_id: u64, data: &'static [u8]| RdmaWr {
        wr_id,
        dest,
        kind: RdmaKind::Write {
            local: Bytes::from_static(data),
            remote: r(0x1000 * wr_id),
            imm: None,
        },
    };
    let read = |wr_id: u64| RdmaWr {
        wr_id,
        dest,
        kind: RdmaKind::Read {
            local: BytesMut::with_capacity(4),
            remote: r(0x1000 * wr_id),
        },
    };
    let mut wrs: VecDeque<RdmaWr> = [write(1, b"aaaa"), read(2), write(3, b"cccc")].into();
    q.post_rdma_list(&mut wrs).unwrap();
    assert!(wrs.is_empty());
    assert_eq!(
        q.nic_mut().doorbells,
        1,
        "three work requests, one doorbell"
    );
    assert_eq!(q.nic_mut().sends.len(), 3);
    // The send queue holds 4: the fifth work request is refused with Again, the fourth posted
    // with the doorbell, the sixth stays in the list.
    let mut wrs: VecDeque<RdmaWr> =
        [write(4, b"dddd"), write(5, b"eeee"), write(6, b"ffff")].into();
    let (wr_id, e) = q.post_rdma_list(&mut wrs).unwrap_err();
    assert_eq!((wr_id, e.kind()), (5, ErrorKind::Again));
    assert_eq!(wrs.len(), 1);
    assert_eq!(q.nic_mut().doorbells, 2);
    assert_eq!(q.nic_mut().sends.len(), 4);
    for i in 0..4 {
        q.nic_mut().complete_send(i, IBV_WC_SUCCESS, 0);
    }
    assert_eq!(
        poll_all(&mut q).iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    // The NIC refuses the session: each goes alone, and every one completes once.
    q.nic_mut().fail_send = Some(22);
    let mut wrs: VecDeque<RdmaWr> = [write(7, b"gggg"), read(8)].into();
    q.post_rdma_list(&mut wrs).unwrap();
    assert_eq!(q.nic_mut().doorbells, 4, "one each after the refused list");
    assert_eq!(q.nic_mut().sends.len(), 6);
    q.nic_mut().complete_send(4, IBV_WC_SUCCESS, 0);
    q.nic_mut().complete_send(5, IBV_WC_SUCCESS, 0);
    let c = poll_all(&mut q);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(7, Status::Success), (8, Status::Success)]
    );
    assert_eq!(
        q.nic_mut().live_regs(),
        2,
        "only the bounce pools stay registered"
    );
}

/// The MR cache: writing the same buffer again reuses its registration (kept alive with the
/// buffer until evicted, least recently used first); a disabled cache registers per operation.
#[test]
fn the_mr_cache_registers_a_written_buffer_once() {
    use super::super::mr::{MrCache, MrCacheLimits};
    let dest = RawAddr::new(gid(3), 4, 5);
    let remote = |len: usize| RemoteIov {
        addr: 0x10_0000,
        len: len as u64,
        key: 0x42,
    };
    let run = |limits: MrCacheLimits| {
        let mut q = qp_with(QpType::Srd, rdma());
        let cache = Arc::new(MrCache::new(limits));
        q.set_mr_cache(cache.clone());
        let base = q.nic_mut().live_regs();
        let bufs: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i; 100])).collect();
        let mut wr = 0;
        // a, a, b, a, c, b: with room for two entries, c evicts b (a was used after b).
        for i in [0, 0, 1, 0, 2, 1] {
            wr += 1;
            q.post_write(wr, dest, bufs[i].clone(), remote(100), None)
                .unwrap();
            let n = q.nic_mut().sends.len() - 1;
            assert_eq!(q.nic_mut().sends[n].data, vec![i as u8; 100]);
            q.nic_mut().complete_send(n, IBV_WC_SUCCESS, 0);
            let c = poll_all(&mut q);
            assert_eq!((c[0].wr_id, c[0].status), (wr, Status::Success));
        }
        let s = q.counters.snapshot();
        let live = q.nic_mut().live_regs() - base;
        (s.mr_registrations, s.mr_cache_hits, live, cache.usage())
    };
    let two = MrCacheLimits {
        count: 2,
        bytes: 1 << 20,
    };
    assert_eq!(run(two), (4, 2, 2, (2, 200)));
    // Bounded by bytes as well: room for one buffer only.
    let one = MrCacheLimits {
        count: 100,
        bytes: 150,
    };
    assert_eq!(run(one), (5, 1, 1, (1, 100)));
    let off = MrCacheLimits { count: 0, bytes: 0 };
    assert_eq!(run(off), (6, 0, 0, (0, 0)));
}

#[test]
fn write_with_immediate_at_the_target() {
    let mut q = qp_with(QpType::Srd, rdma());
    // Solicited: consumes a posted receive, whose buffer comes back empty.
    q.post_recv(5, BytesMut::with_capacity(16)).unwrap();
    let token = q.nic_mut().recvs.pop_front().unwrap().0;
    q.nic_mut().cq.push_back(RawWc {
        wr_id: token,
        opcode: rdma_sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
        byte_len: 4096,
        imm: Some(77),
        ..RawWc::default()
    });
    // Unsolicited: no receive.
    q.nic_mut().cq.push_back(RawWc {
        wr_id: 0,
        opcode: rdma_sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
        byte_len: 64,
        imm: Some(78),
        unsolicited: true,
        ..RawWc::default()
    });
    let c = poll_all(&mut q);
    assert_eq!(
        (c[0].wr_id, c[0].opcode, c[0].byte_len, c[0].imm),
        (5, Opcode::RecvRdmaWithImm, 4096, Some(77))
    );
    assert!(c[0].buf.as_ref().unwrap().is_empty());
    assert_eq!(
        (c[1].wr_id, c[1].opcode, c[1].imm),
        (UNSOLICITED_WR_ID, Opcode::RecvRdmaWithImm, Some(78))
    );
    assert!(c[1].buf.is_none());
}

#[test]
fn drop_releases_every_registration() {
    let regs;
    {
        let mut q = qp_with(QpType::Srd, rdma());
        regs = q.nic_mut().regs.clone();
        let dest = RawAddr::new(gid(3), 4, 5);
        q.post_read(
            1,
            dest,
            BytesMut::with_capacity(8),
            RemoteIov {
                addr: 0,
                len: 8,
                key: 1,
            },
        )
        .unwrap();
        q.post_recv(2, BytesMut::with_capacity(8)).unwrap();
        assert_eq!(regs.load(Ordering::SeqCst), 3);
    }
    assert_eq!(regs.load(Ordering::SeqCst), 0);
}

#[test]
fn a_failed_destroy_leaks_instead_of_freeing() {
    let regs;
    {
        let mut q = qp_with(QpType::Srd, rdma());
        regs = q.nic_mut().regs.clone();
        q.nic_mut().destroy_fails = true;
        q.post_recv(2, BytesMut::with_capacity(8)).unwrap();
        q.close();
        let c = poll_all(&mut q);
        assert_eq!(c[0].status, Status::Flushed);
        assert!(
            c[0].buf.is_none(),
            "the NIC may still write it: not handed back"
        );
    }
    assert_eq!(
        regs.load(Ordering::SeqCst),
        2,
        "pool registrations kept alive"
    );
}

/// Completions signal the notifier, empty polls do not. (Polling never arms the CQ: only a
/// waiter about to sleep does, `cq::Armer`, so a busy-polling program gets no completion
/// events.)
#[test]
fn polling_never_arms_and_completions_notify() {
    let notifier = Arc::new(Notifier::new());
    let mut q = EfaQp::new(
        FakeNic::new(QpType::Srd),
        RawAddr::new(gid(1), 7, 1),
        QpType::Srd,
        limits(DeviceCaps::default()),
        notifier.clone(),
        Arc::new(DeviceCounters::default()),
        Arc::new(AtomicU64::new(0)),
    )
    .unwrap();
    let g0 = notifier.generation();
    let mut out = Vec::new();
    for _ in 0..10 {
        assert_eq!(q.poll(&mut out, 8), 0);
    }
    assert_eq!(notifier.generation(), g0, "nothing found, no signal");
    q.post_recv(1, BytesMut::with_capacity(8)).unwrap();
    q.nic_mut().arrive(b"x", 0, 0, None);
    assert_eq!(q.poll(&mut out, 8), 1);
    assert!(notifier.generation() > g0);
}

#[test]
fn fill_recv_never_reallocates() {
    let mut b = BytesMut::with_capacity(4);
    b.extend_from_slice(b"zz");
    assert_eq!(fill_recv(&mut b, b"abcdef"), Status::LocalBadLength);
    assert_eq!(&b[..], b"abcd");
    assert_eq!(b.capacity(), 4);
    assert_eq!(fill_recv(&mut b, b"ab"), Status::Success);
    assert_eq!(&b[..], b"ab");
}

/// A registration the NIC refuses to release leaks the memory it covers instead of handing it
/// back or freeing it (issue 30, point 12): a read completes in error without its buffer, a
/// written buffer is never freed, a region's memory is never handed back by `close`.
#[test]
fn a_refused_deregistration_leaks_the_memory() {
    use std::sync::atomic::AtomicBool;

    /// A buffer that says when it is freed.
    struct Tracked(Vec<u8>, Arc<AtomicBool>);
    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Tracked {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    let mut q = qp_with(QpType::Srd, rdma());
    let dest = RawAddr::new(gid(3), 4, 5);
    let r = RemoteIov {
        addr: 0x10_0000,
        len: 4,
        key: 0x42,
    };
    let freed = Arc::new(AtomicBool::new(false));
    let written = Bytes::from_owner(Tracked(b"data".to_vec(), freed.clone()));
    q.post_write(1, dest, written, r, None).unwrap();
    q.post_read(2, dest, BytesMut::with_capacity(4), r).unwrap();
    let base = q.nic_mut().live_regs();
    q.nic_mut().fail_dereg.store(true, Ordering::SeqCst);
    q.nic_mut().fill_read(1, b"back");
    q.nic_mut().complete_send(0, IBV_WC_SUCCESS, 0);
    q.nic_mut().complete_send(1, IBV_WC_SUCCESS, 0);
    let c = poll_all(&mut q);
    assert_eq!(
        (c[0].wr_id, c[0].status),
        (1, Status::Success),
        "the write went"
    );
    assert_eq!(
        (c[1].wr_id, c[1].status, c[1].buf.is_none()),
        (2, Status::LocalQpInternalError, true),
        "the read's buffer is not handed back"
    );
    assert!(
        !freed.load(Ordering::SeqCst),
        "the written buffer is never freed"
    );
    assert_eq!(q.nic_mut().live_regs(), base, "both registrations stay");
    // A region: its memory stays, and closing hands back nothing.
    let mem = crate::mem::RegionMem::new(BytesMut::from(&b"region"[..]));
    let other = mem.clone();
    super::super::release_region(super::super::fake::FakeMr::detached(9, true), mem);
    assert!(other.take().is_empty());
    assert_eq!(Arc::strong_count(&other), 2, "one reference leaked");
    let mem = crate::mem::RegionMem::new(BytesMut::from(&b"region"[..]));
    let other = mem.clone();
    super::super::release_region(super::super::fake::FakeMr::detached(9, false), mem);
    assert_eq!(&other.take()[..], b"region", "released normally");
}
