//! The emulated NIC, driven through its C ABI in-process, against the efa crate's `udp` device:
//! SRD sends both ways, RDMA read of an emulated registration, unknown-sender reporting (slid
//! 0xffff and the source GID), and garbage datagrams that must change nothing.

use std::net::UdpSocket;
use std::os::raw::c_void;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use efa::device::udp::{UdpConfig, UdpDevice};
use efa::device::{Device, DeviceCompletion, QpAttr, QpType, QueuePair, RemoteIov, SendWr};
use efa::{Gid, RawAddr};
use efa_emu::abi::*;
use efa_emu::efadv::*;
use efa_emu::verbs::*;

/// A completion as read: (wr_id, status, opcode, byte_len, slid, src_qp, sgid, imm).
type Wc = (u64, i32, i32, u32, u32, u32, Option<[u8; 16]>, u32);

/// One emulated SRD queue pair with its CQ and a registered buffer.
struct EmuQp {
    pd: *mut ibv_pd,
    cq: *mut ibv_cq_ex,
    dv: *mut efadv_cq,
    qp: *mut ibv_qp,
    qpx: *mut ibv_qp_ex,
    buf: Vec<u8>,
    mr: *mut ibv_mr,
    gid: Gid,
    qkey: u32,
    /// `wc_is_unsolicited` of the last polled completion.
    last_unsolicited: std::cell::Cell<bool>,
}

fn emu_qp() -> EmuQp {
    emu_qp_with(Opts::default())
}

/// How to make an emulated queue pair.
#[derive(Default)]
struct Opts {
    /// A completion channel for the CQ.
    channel: bool,
    /// `EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV`.
    unsolicited: bool,
}

fn emu_qp_with(o: Opts) -> EmuQp {
    // SAFETY: the calls follow the verbs API; every pointer comes from the previous call.
    unsafe {
        let mut n = 0;
        let list = emu_ibv_get_device_list(&mut n);
        assert_eq!(n, 1, "one emulated device");
        let ctx = emu_ibv_open_device(*list);
        emu_ibv_free_device_list(list);
        assert!(!ctx.is_null());
        let mut gid = ibv_gid::default();
        assert_eq!(emu_ibv_query_gid(ctx, 1, 0, &mut gid), 0);
        let pd = emu_ibv_alloc_pd(ctx);
        let mut cq_attr: ibv_cq_init_attr_ex = std::mem::zeroed();
        cq_attr.cqe = 256;
        if o.channel {
            cq_attr.channel = emu_ibv_create_comp_channel(ctx);
            assert!(!cq_attr.channel.is_null());
        }
        cq_attr.wc_flags = IBV_WC_STANDARD_FLAGS;
        let mut efa_cq = efadv_cq_init_attr {
            comp_mask: 0,
            wc_flags: EFADV_WC_EX_WITH_SGID | EFADV_WC_EX_WITH_IS_UNSOLICITED,
        };
        let cq = emu_efadv_create_cq(
            ctx,
            &mut cq_attr,
            &mut efa_cq,
            std::mem::size_of::<efadv_cq_init_attr>() as u32,
        );
        assert!(!cq.is_null());
        let dv = emu_efadv_cq_from_ibv_cq_ex(cq);
        let mut qa: ibv_qp_init_attr_ex = std::mem::zeroed();
        qa.send_cq = cq as *mut ibv_cq;
        qa.recv_cq = cq as *mut ibv_cq;
        qa.cap = ibv_qp_cap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        qa.qp_type = IBV_QPT_DRIVER;
        qa.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        qa.pd = pd;
        qa.send_ops_flags = IBV_QP_EX_WITH_SEND
            | IBV_QP_EX_WITH_SEND_WITH_IMM
            | IBV_QP_EX_WITH_RDMA_READ
            | IBV_QP_EX_WITH_RDMA_WRITE
            | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
        let mut ea = efadv_qp_init_attr {
            comp_mask: 0,
            driver_qp_type: EFADV_QP_DRIVER_TYPE_SRD,
            flags: if o.unsolicited {
                EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV
            } else {
                0
            },
            sl: 0,
            reserved: 0,
        };
        let qp = emu_efadv_create_qp_ex(
            ctx,
            &mut qa,
            &mut ea,
            std::mem::size_of::<efadv_qp_init_attr>() as u32,
        );
        assert!(!qp.is_null());
        let qkey = 0x1234_5678 & 0x7fff_ffff;
        for (state, mask) in [
            (
                IBV_QPS_INIT,
                IBV_QP_STATE | IBV_QP_QKEY | IBV_QP_PORT | IBV_QP_PKEY_INDEX,
            ),
            (IBV_QPS_RTR, IBV_QP_STATE),
            (IBV_QPS_RTS, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RNR_RETRY),
        ] {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = state;
            a.qkey = qkey;
            a.port_num = 1;
            a.rnr_retry = 7;
            assert_eq!(emu_ibv_modify_qp(qp, &mut a, mask), 0, "to state {state}");
        }
        let mut buf = vec![0u8; 1 << 16];
        let mr = emu_ibv_reg_mr(
            pd,
            buf.as_mut_ptr() as *mut c_void,
            buf.len(),
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE,
        );
        assert!(!mr.is_null());
        EmuQp {
            pd,
            cq,
            dv,
            qp,
            qpx: emu_ibv_qp_to_qp_ex(qp),
            buf,
            mr,
            gid: Gid(gid.raw),
            qkey,
            last_unsolicited: std::cell::Cell::new(false),
        }
    }
}

impl EmuQp {
    fn qpn(&self) -> u16 {
        // SAFETY: our queue pair.
        unsafe { (*self.qp).qp_num as u16 }
    }

    fn addr(&self) -> RawAddr {
        RawAddr::new(self.gid, self.qpn(), self.qkey)
    }

    /// Posts a receive into `buf[off..off + len]`.
    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) {
        // SAFETY: the buffer is registered and outlives the queue pair's use of it.
        unsafe {
            let mut sge = ibv_sge {
                addr: self.buf.as_mut_ptr().add(off) as u64,
                length: len,
                lkey: (*self.mr).lkey,
            };
            let mut wr = ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: &mut sge,
                num_sge: 1,
            };
            let mut bad = std::ptr::null_mut();
            let post = (*(*self.qp).context).ops.post_recv.expect("post_recv");
            assert_eq!(post(self.qp, &mut wr, &mut bad), 0);
        }
    }

    /// The next completion: (wr_id, status, opcode, byte_len, slid, src_qp, sgid, imm).
    fn poll(&self) -> Option<Wc> {
        // SAFETY: our CQ; the read_* calls sit between start_poll and end_poll.
        unsafe {
            let cq = &*self.cq;
            let mut attr = ibv_poll_cq_attr { comp_mask: 0 };
            if cq.start_poll.unwrap()(self.cq, &mut attr) != 0 {
                return None;
            }
            let mut g = ibv_gid::default();
            let sgid = ((*self.dv).wc_read_sgid.unwrap()(self.dv, &mut g) == 0).then_some(g.raw);
            self.last_unsolicited
                .set((*self.dv).wc_is_unsolicited.unwrap()(self.dv));
            let r = (
                cq.wr_id,
                cq.status,
                cq.read_opcode.unwrap()(self.cq),
                cq.read_byte_len.unwrap()(self.cq),
                cq.read_slid.unwrap()(self.cq),
                cq.read_src_qp.unwrap()(self.cq),
                sgid,
                u32::from_be(cq.read_imm_data.unwrap()(self.cq)),
            );
            cq.end_poll.unwrap()(self.cq);
            Some(r)
        }
    }

    fn poll_until(&self, what: &str) -> Wc {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(c) = self.poll() {
                return c;
            }
            assert!(Instant::now() < deadline, "no completion: {what}");
            std::thread::yield_now();
        }
    }
}

fn udp_qp() -> (std::sync::Arc<UdpDevice>, Box<dyn QueuePair>) {
    let dev = UdpDevice::open(UdpConfig::default()).expect("udp device");
    let qp = dev.create_qp(QpAttr::new(QpType::Srd)).expect("udp qp");
    (dev, qp)
}

fn udp_wait(qp: &mut Box<dyn QueuePair>, what: &str) -> DeviceCompletion {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    loop {
        if qp.poll(&mut out, 1) == 1 {
            return out.pop().expect("one completion");
        }
        assert!(Instant::now() < deadline, "no udp completion: {what}");
        std::thread::yield_now();
    }
}

/// An AH for `gid` in `pd`, and its AHN (`efadv_query_ah`).
fn create_ah(pd: *mut ibv_pd, gid: Gid) -> (*mut ibv_ah, u16) {
    // SAFETY: the verbs API as libfabric uses it.
    unsafe {
        let mut attr: ibv_ah_attr = std::mem::zeroed();
        attr.is_global = 1;
        attr.port_num = 1;
        attr.grh.dgid.raw = gid.0;
        let ah = emu_ibv_create_ah(pd, &mut attr);
        assert!(!ah.is_null());
        let mut a = efadv_ah_attr {
            comp_mask: 0,
            ahn: 0,
            reserved: [0; 6],
        };
        assert_eq!(emu_efadv_query_ah(ah, &mut a, 16), 0);
        (ah, a.ahn)
    }
}

#[test]
fn udp_device_and_emulated_nic_exchange_both_ways() {
    let mut e = emu_qp();
    let (_dev, mut u) = udp_qp();

    // udp -> emulated NIC, with immediate data, from a sender the NIC has no AH for.
    e.post_recv(7, 0, 4096);
    let msg: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    u.post_send(SendWr {
        wr_id: 1,
        dest: e.addr(),
        hdr: Bytes::from_static(b"head"),
        payload: Bytes::from(msg.clone()),
        imm: Some(0xabcd),
    })
    .expect("udp send");
    let (wr_id, status, opcode, len, slid, src_qp, sgid, imm) = e.poll_until("emu receive");
    assert_eq!((wr_id, status, opcode), (7, IBV_WC_SUCCESS, IBV_WC_RECV));
    assert_eq!(len as usize, 4 + msg.len());
    assert_eq!(&e.buf[..4], b"head");
    assert_eq!(&e.buf[4..4 + msg.len()], &msg[..]);
    assert_eq!(imm, 0xabcd);
    assert_eq!(slid, 0xffff, "no AH for the sender yet");
    assert_eq!(src_qp, u32::from(u.addr().qpn));
    assert_eq!(
        sgid,
        Some(u.addr().gid.0),
        "the source GID of an unknown sender"
    );
    let c = udp_wait(&mut u, "udp send completion");
    assert!(c.status.is_ok(), "{c:?}");

    // emulated NIC -> udp, through an AH (now the sender is known: slid is its AHN).
    // SAFETY: the verbs API as libfabric uses it.
    let (ah, ahn) = create_ah(e.pd, u.addr().gid);
    unsafe {
        u.post_recv(9, BytesMut::with_capacity(8192))
            .expect("udp recv");
        for (i, b) in e.buf[8192..8192 + 5000].iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let q = &*e.qpx;
        q.wr_start.unwrap()(e.qpx);
        (*e.qpx).wr_id = 77;
        q.wr_send_imm.unwrap()(e.qpx, 0x1122_3344u32.to_be());
        q.wr_set_ud_addr.unwrap()(e.qpx, ah, u32::from(u.addr().qpn), u.addr().qkey);
        q.wr_set_sge.unwrap()(e.qpx, (*e.mr).lkey, e.buf.as_ptr().add(8192) as u64, 5000);
        assert_eq!(q.wr_complete.unwrap()(e.qpx), 0);
    }
    let c = udp_wait(&mut u, "udp receive");
    assert!(c.status.is_ok());
    assert_eq!(c.imm, Some(0x1122_3344));
    assert_eq!(c.src.map(|s| s.qpn), Some(e.qpn()));
    let got = c.buf.expect("buffer back");
    assert_eq!(&got[..], &e.buf[8192..8192 + 5000]);
    let (wr_id, status, opcode, len, ..) = e.poll_until("emu send completion");
    assert_eq!(
        (wr_id, status, opcode, len),
        (77, IBV_WC_SUCCESS, IBV_WC_SEND, 0)
    );

    // Known sender now: slid is the AHN, and no source GID is reported.
    e.post_recv(8, 0, 64);
    u.post_send(SendWr {
        wr_id: 2,
        dest: e.addr(),
        hdr: Bytes::new(),
        payload: Bytes::from_static(b"again"),
        imm: None,
    })
    .expect("udp send");
    let (_, status, _, _, slid, _, sgid, _) = e.poll_until("second receive");
    assert_eq!(status, IBV_WC_SUCCESS);
    assert_eq!(slid, u32::from(ahn));
    assert_eq!(sgid, None);
    udp_wait(&mut u, "second send completion");

    // One-sided: the udp device reads an emulated registration by its rkey, with no polling by
    // the emulated side; a wrong key is refused with remote bad address (7).
    // SAFETY: reading the registration's fields.
    let (rkey, base) = unsafe { ((*e.mr).rkey, (*e.mr).addr as u64) };
    u.post_read(
        3,
        e.addr(),
        BytesMut::with_capacity(1000),
        RemoteIov {
            addr: base + 8192,
            len: 1000,
            key: u64::from(rkey),
        },
    )
    .expect("post read");
    let c = udp_wait(&mut u, "rdma read");
    assert!(c.status.is_ok(), "{c:?}");
    assert_eq!(&c.buf.expect("read buffer")[..], &e.buf[8192..9192]);
    u.post_read(
        4,
        e.addr(),
        BytesMut::with_capacity(8),
        RemoteIov {
            addr: base,
            len: 8,
            key: u64::from(rkey ^ 1),
        },
    )
    .expect("post read");
    let c = udp_wait(&mut u, "refused read");
    assert_eq!(c.status.code(), 7);
}

#[test]
fn garbage_datagrams_change_nothing() {
    let seed = efa::fault::test_seed();
    eprintln!("garbage_datagrams_change_nothing: seed {seed} (EFA_TEST_SEED to replay)");
    let mut rng = efa::fault::Rng::new(seed);
    let mut e = emu_qp();
    let (_dev, mut u) = udp_qp();
    let target = std::net::SocketAddr::new(e.gid.to_ip(), e.qpn());
    let sock = UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0)).expect("attacker socket");
    let mut pkt = Vec::new();
    for i in 0..20_000u32 {
        let len = rng.below(9000) as usize;
        pkt.clear();
        pkt.extend((0..len).map(|_| rng.next_u64() as u8));
        // Half of them look like the SRD framing (magic, version, a type) to get past the first
        // checks.
        if i % 2 == 0 && len >= 4 {
            pkt[..4].copy_from_slice(&[0xEF, 0xA5, 1, (1 + rng.below(4)) as u8]);
        }
        let _ = sock.send_to(&pkt, target);
        if i % 1000 == 0 {
            assert!(
                e.poll().is_none(),
                "garbage completed something (seed {seed})"
            );
        }
    }
    // Nothing completed, and the queue pair still works.
    assert!(
        e.poll().is_none(),
        "garbage completed something (seed {seed})"
    );
    e.post_recv(1, 0, 128);
    u.post_send(SendWr {
        wr_id: 5,
        dest: e.addr(),
        hdr: Bytes::new(),
        payload: Bytes::from_static(b"still here"),
        imm: None,
    })
    .expect("udp send");
    let (wr_id, status, _, len, ..) = e.poll_until("receive after garbage");
    assert_eq!((wr_id, status, len), (1, IBV_WC_SUCCESS, 10));
    assert_eq!(&e.buf[..10], b"still here");
}

/// An RDMA write with immediate data into an emulated registration: it consumes a posted
/// receive (completing as RECV_RDMA_WITH_IMM with the receive's wr_id), or none on a queue
/// pair made with `EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV`.
#[test]
fn write_with_immediate_solicited_and_unsolicited() {
    for unsolicited in [false, true] {
        let mut e = emu_qp_with(Opts {
            unsolicited,
            ..Opts::default()
        });
        let (_dev, mut u) = udp_qp();
        // EFA serves RDMA only from initiators the target's PD holds an AH for.
        let _ah = create_ah(e.pd, u.addr().gid);
        if !unsolicited {
            e.post_recv(42, 0, 16);
        }
        // SAFETY: reading the registration's fields.
        let (rkey, base) = unsafe { ((*e.mr).rkey, (*e.mr).addr as u64) };
        let data: Vec<u8> = (0..2000u32).map(|i| (i % 253) as u8).collect();
        u.post_write(
            1,
            e.addr(),
            Bytes::from(data.clone()),
            RemoteIov {
                addr: base + 20_000,
                len: data.len() as u64,
                key: u64::from(rkey),
            },
            Some(0x5151),
        )
        .expect("post write");
        let c = udp_wait(&mut u, "write completion");
        assert!(c.status.is_ok(), "{c:?}");
        let (wr_id, status, opcode, len, _, _, _, imm) = e.poll_until("target completion");
        assert_eq!(status, IBV_WC_SUCCESS);
        assert_eq!(opcode, IBV_WC_RECV_RDMA_WITH_IMM);
        assert_eq!((len, imm), (2000, 0x5151));
        assert_eq!(&e.buf[20_000..22_000], &data[..]);
        assert_eq!(e.last_unsolicited.get(), unsolicited);
        if !unsolicited {
            assert_eq!(wr_id, 42, "the posted receive was consumed");
        }
        assert!(e.poll().is_none(), "one completion per write");
    }
}

/// A program blocked on a completion channel hears of a receive: the channel's descriptor
/// becomes readable and `ibv_get_cq_event` names the CQ.
#[test]
fn completion_channel_wakes_a_blocked_program() {
    let mut e = emu_qp_with(Opts {
        channel: true,
        ..Opts::default()
    });
    let (_dev, mut u) = udp_qp();
    e.post_recv(3, 0, 64);
    // SAFETY: the verbs API; the CQ has a channel.
    let (ch, fd) = unsafe {
        let ch = (*e.cq).channel;
        let req = (*(*e.cq).context).ops.req_notify_cq.expect("req_notify_cq");
        assert_eq!(req(e.cq as *mut ibv_cq, 0), 0);
        (ch, (*ch).fd)
    };
    u.post_send(SendWr {
        wr_id: 1,
        dest: e.addr(),
        hdr: Bytes::new(),
        payload: Bytes::from_static(b"wake up"),
        imm: None,
    })
    .expect("udp send");
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd; the program does not poll the CQ meanwhile.
    let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(n, 1, "the channel did not become readable within 10 s");
    let mut cq = std::ptr::null_mut();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: our channel and out-parameters.
    assert_eq!(unsafe { emu_ibv_get_cq_event(ch, &mut cq, &mut ctx) }, 0);
    assert_eq!(cq, e.cq as *mut ibv_cq);
    // SAFETY: acknowledging the event we took.
    unsafe { emu_ibv_ack_cq_events(cq, 1) };
    let (wr_id, status, ..) = e.poll_until("the receive the event announced");
    assert_eq!((wr_id, status), (3, IBV_WC_SUCCESS));
    assert_eq!(&e.buf[..7], b"wake up");
}

/// dmabuf registration of a memfd (standing in for GPU memory): remote reads name it by its
/// I/O virtual address and see what was written through the descriptor.
/// The kernel registers only dma-bufs: a plain memfd (or any other file) is refused with
/// `EINVAL`, as `dma_buf_get` refuses it (issue 30, point 2).
#[test]
fn dmabuf_registration_refuses_what_is_not_a_dmabuf() {
    let e = emu_qp();
    // SAFETY: a fresh memfd.
    let fd = unsafe { libc::memfd_create(c"not-a-dmabuf".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: our descriptor; the verbs API.
    unsafe {
        assert_eq!(libc::ftruncate(fd, 8192), 0);
        let mr = emu_ibv_reg_dmabuf_mr(e.pd, 0, 4096, 0x1000, fd, IBV_ACCESS_LOCAL_WRITE);
        assert!(mr.is_null());
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EINVAL)
        );
        libc::close(fd);
    }
}

/// The stand-in (a memfd named `efa-emu-dmabuf-stand-in...`, which only the emulated NIC takes
/// for a dma-buf) is registered by its I/O virtual address.
#[test]
fn dmabuf_registration_of_a_memfd() {
    let e = emu_qp();
    let (_dev, mut u) = udp_qp();
    let len = 1 << 16;
    // SAFETY: a fresh memfd, sized and filled through its descriptor.
    let fd = unsafe {
        libc::memfd_create(
            c"efa-emu-dmabuf-stand-in-interop".as_ptr(),
            libc::MFD_CLOEXEC,
        )
    };
    assert!(fd >= 0);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 256) as u8).collect();
    // SAFETY: our descriptor and buffer.
    unsafe {
        assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
        assert_eq!(
            libc::pwrite(fd, data.as_ptr().cast(), data.len(), 8192),
            data.len() as isize
        );
    }
    let iova = 0x7700_0000_0000u64;
    // SAFETY: the verbs API; the descriptor stays open until deregistration.
    let mr = unsafe {
        emu_ibv_reg_dmabuf_mr(
            e.pd,
            4096,
            len - 4096,
            iova,
            fd,
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
        )
    };
    assert!(!mr.is_null());
    // SAFETY: reading the registration.
    let (rkey, addr) = unsafe { ((*mr).rkey, (*mr).addr as u64) };
    assert_eq!(addr, iova, "the program sees the I/O virtual address");
    let _ah = create_ah(e.pd, u.addr().gid);
    u.post_read(
        1,
        e.addr(),
        BytesMut::with_capacity(4096),
        RemoteIov {
            addr: iova + 4096,
            len: 4096,
            key: u64::from(rkey),
        },
    )
    .expect("post read");
    let c = udp_wait(&mut u, "read of the dmabuf");
    assert!(c.status.is_ok(), "{c:?}");
    assert_eq!(&c.buf.expect("buffer")[..], &data[..]);
    // SAFETY: ours, given back once.
    unsafe {
        assert_eq!(emu_ibv_dereg_mr(mr), 0);
        libc::close(fd);
    }
    // After deregistration the key is refused.
    u.post_read(
        2,
        e.addr(),
        BytesMut::with_capacity(8),
        RemoteIov {
            addr: iova + 4096,
            len: 8,
            key: u64::from(rkey),
        },
    )
    .expect("post read");
    assert_eq!(udp_wait(&mut u, "read after dereg").status.code(), 7);
}

/// Registration counts against the memlock limit, remote rights the device lacks are refused
/// as the kernel refuses them, and keys are never reused.
#[test]
fn registration_limits_and_rights() {
    let mut cfg = efa_emu::config::EmuConfig::from_lookup(|k| match k {
        "EFA_EMU_ADDR" => Some("127.0.0.1".into()),
        "EFA_EMU_CAPS" => Some("rdma_read,rnr_retry".into()),
        "EFA_EMU_MEMLOCK" => Some("16384".into()),
        _ => None,
    })
    .expect("config");
    cfg.device = "efa_test".into();
    let nic = efa_emu::nic::Nic::open(cfg).expect("a NIC");
    let mut buf = vec![0u8; 1 << 16];
    let p = buf.as_mut_ptr();
    // SAFETY: `buf` outlives every registration below (each is deregistered).
    unsafe {
        let w = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        assert_eq!(
            nic.reg(1, p, 4096, p as u64, w),
            Err(libc::EOPNOTSUPP),
            "no write cap"
        );
        let r = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
        let (a, _) = nic.reg(1, p, 8192, p as u64, r).expect("within the limit");
        // At most three pages more can be pinned (the first may straddle two pages).
        assert_eq!(
            nic.reg(1, p, 32768, p as u64, r),
            Err(libc::ENOMEM),
            "over memlock"
        );
        nic.dereg(a).expect("dereg");
        let (b, rb) = nic.reg(1, p, 8192, p as u64, r).expect("room again");
        assert_eq!(
            a, b,
            "keys come back, as a NIC's indices do (EFA_EMU_KEYS=recycle)"
        );
        assert_ne!(b, rb);
        nic.dereg(b).expect("dereg");
        assert_eq!(nic.dereg(b), Err(libc::EINVAL), "twice");
    }
}

/// AHs belong to a protection domain: a receive reports the sender's AHN only when the receiving
/// queue pair's PD holds an AH for it; an AH in another PD (another context, another process on
/// a real NIC) leaves the sender unknown, so its GID is reported instead.
#[test]
fn an_ah_in_another_protection_domain_leaves_the_sender_unknown() {
    let other = emu_qp();
    let mut e = emu_qp();
    let (_dev, mut u) = udp_qp();
    let (_ah, ahn) = create_ah(other.pd, u.addr().gid);
    e.post_recv(1, 0, 64);
    u.post_send(SendWr {
        wr_id: 1,
        dest: e.addr(),
        hdr: Bytes::new(),
        payload: Bytes::from_static(b"who"),
        imm: None,
    })
    .expect("udp send");
    let (_, status, _, _, slid, _, sgid, _) = e.poll_until("receive");
    assert_eq!(status, IBV_WC_SUCCESS);
    assert_eq!(slid, 0xffff, "AHN {ahn} belongs to another PD");
    assert_eq!(sgid, Some(u.addr().gid.0));
    udp_wait(&mut u, "send completion");
    // The same GID in this PD: now the sender is known by this PD's AHN.
    let (_ah2, ahn2) = create_ah(e.pd, u.addr().gid);
    e.post_recv(2, 0, 64);
    u.post_send(SendWr {
        wr_id: 2,
        dest: e.addr(),
        hdr: Bytes::new(),
        payload: Bytes::from_static(b"me"),
        imm: None,
    })
    .expect("udp send");
    let (_, status, _, _, slid, _, sgid, _) = e.poll_until("second receive");
    assert_eq!(status, IBV_WC_SUCCESS);
    assert_eq!(slid, u32::from(ahn2));
    assert_eq!(sgid, None);
    udp_wait(&mut u, "second send completion");
}

/// EFA serves one-sided RDMA only from an initiator the target's protection domain holds an AH
/// for; others get status 14 (unknown peer), as the emulated NIC now refuses them (issue 16,
/// defect 5: the crate's engine retries after introducing itself).
#[test]
fn rdma_from_an_initiator_without_an_ah_is_refused_with_14() {
    let e = emu_qp();
    let (_dev, mut u) = udp_qp();
    // SAFETY: reading the registration's fields.
    let (rkey, base) = unsafe { ((*e.mr).rkey, (*e.mr).addr as u64) };
    let read = |u: &mut Box<dyn QueuePair>, wr_id| {
        u.post_read(
            wr_id,
            e.addr(),
            BytesMut::with_capacity(16),
            RemoteIov {
                addr: base,
                len: 16,
                key: u64::from(rkey),
            },
        )
        .expect("post read");
        udp_wait(u, "read")
    };
    let c = read(&mut u, 1);
    assert_eq!(c.status.code(), 14, "{c:?}");
    let _ah = create_ah(e.pd, u.addr().gid);
    let c = read(&mut u, 2);
    assert!(c.status.is_ok(), "{c:?}");
}

/// What [`post_one`] posts.
#[derive(Clone, Copy)]
enum Wr {
    Send,
    Write { rkey: u32, raddr: u64 },
    Read { rkey: u32, raddr: u64 },
}

/// Posts one work request (`wr_id` 9) of `len` bytes at the start of `from`'s buffer, named by
/// `lkey`, to `to` through `ah`, in one `ibv_wr_*` session; `ibv_wr_complete`'s answer.
fn post_one(from: &EmuQp, ah: *mut ibv_ah, to: &EmuQp, wr: Wr, lkey: u32, len: u32) -> i32 {
    // SAFETY: our queue pair and an AH for the target; the SGE names our buffer (a bad lkey is
    // the NIC's to report).
    unsafe {
        let q = &*from.qpx;
        q.wr_start.unwrap()(from.qpx);
        (*from.qpx).wr_id = 9;
        match wr {
            Wr::Send => q.wr_send.unwrap()(from.qpx),
            Wr::Write { rkey, raddr } => q.wr_rdma_write.unwrap()(from.qpx, rkey, raddr),
            Wr::Read { rkey, raddr } => q.wr_rdma_read.unwrap()(from.qpx, rkey, raddr),
        }
        q.wr_set_ud_addr.unwrap()(from.qpx, ah, u32::from(to.qpn()), to.qkey);
        q.wr_set_sge.unwrap()(from.qpx, lkey, from.buf.as_ptr() as u64, len);
        q.wr_complete.unwrap()(from.qpx)
    }
}

/// [`post_one`] of 8 bytes under `from`'s own lkey, which must be taken.
fn post_rdma(from: &EmuQp, ah: *mut ibv_ah, to: &EmuQp, wr: Wr) {
    // SAFETY: reading our registration's fields.
    let lkey = unsafe { (*from.mr).lkey };
    assert_eq!(post_one(from, ah, to, wr, lkey, 8), 0);
}

/// As rdma-core reads EFA's completions (issue 30, point 8): an RDMA write completes as
/// `IBV_WC_RDMA_WRITE` (rdma-core 46 on), a read as a send; a bad remote address (EFA status 7)
/// is `IBV_WC_REM_ACCESS_ERR`, not `IBV_WC_GENERAL_ERR`.
#[test]
fn rdma_opcodes_and_statuses_as_rdma_core_reports_them() {
    let a = emu_qp();
    let b = emu_qp();
    let (ah, _) = create_ah(a.pd, b.gid);
    let _back = create_ah(b.pd, a.gid);
    // SAFETY: reading the registration's fields.
    let (rkey, base) = unsafe { ((*b.mr).rkey, (*b.mr).addr as u64) };
    post_rdma(&a, ah, &b, Wr::Write { rkey, raddr: base });
    let (_, status, opcode, ..) = a.poll_until("write");
    assert_eq!((status, opcode), (IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE));
    post_rdma(&a, ah, &b, Wr::Read { rkey, raddr: base });
    let (_, status, opcode, ..) = a.poll_until("read");
    assert_eq!((status, opcode), (IBV_WC_SUCCESS, IBV_WC_SEND));
    post_rdma(
        &a,
        ah,
        &b,
        Wr::Write {
            rkey: rkey ^ 0x0100_0000,
            raddr: base,
        },
    );
    let (_, status, ..) = a.poll_until("bad key");
    assert_eq!(
        status, IBV_WC_REM_ACCESS_ERR,
        "EFA status 7, remote bad address"
    );
}

/// What libefa and the EFA kernel driver refuse, the emulated NIC refuses (issue 30, point 8):
/// a `comp_mask`, a short `inlen` or an unknown non-zero tail in the efadv attributes, a
/// `ibv_modify_qp` mask a transition does not take; a CQ's depth is rounded up to a power of two.
#[test]
fn create_and_modify_refuse_what_libefa_and_the_kernel_refuse() {
    let errno = || std::io::Error::last_os_error().raw_os_error();
    // SAFETY: the verbs API; every pointer comes from the previous call.
    unsafe {
        let mut n = 0;
        let list = emu_ibv_get_device_list(&mut n);
        let ctx = emu_ibv_open_device(*list);
        emu_ibv_free_device_list(list);
        let pd = emu_ibv_alloc_pd(ctx);
        let mut cq_attr: ibv_cq_init_attr_ex = std::mem::zeroed();
        cq_attr.cqe = 200;
        cq_attr.wc_flags = IBV_WC_STANDARD_FLAGS;
        let size = std::mem::size_of::<efadv_cq_init_attr>() as u32;
        let mut e = efadv_cq_init_attr {
            comp_mask: 1,
            wc_flags: 0,
        };
        assert!(emu_efadv_create_cq(ctx, &mut cq_attr, &mut e, size).is_null());
        assert_eq!(errno(), Some(libc::EINVAL), "comp_mask");
        e.comp_mask = 0;
        assert!(emu_efadv_create_cq(ctx, &mut cq_attr, &mut e, 8).is_null());
        assert_eq!(errno(), Some(libc::EINVAL), "inlen short of wc_flags");
        let mut longer = [0u64; 3];
        longer[2] = 1;
        assert!(emu_efadv_create_cq(ctx, &mut cq_attr, longer.as_mut_ptr().cast(), 24).is_null());
        assert_eq!(errno(), Some(libc::EINVAL), "an unknown non-zero tail");
        let cq = emu_efadv_create_cq(ctx, &mut cq_attr, &mut e, size);
        assert!(!cq.is_null());
        assert_eq!((*cq).cqe, 256, "rounded up to a power of two");
        let mut qa: ibv_qp_init_attr_ex = std::mem::zeroed();
        qa.send_cq = cq as *mut ibv_cq;
        qa.recv_cq = cq as *mut ibv_cq;
        qa.cap = ibv_qp_cap {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        qa.qp_type = IBV_QPT_DRIVER;
        qa.comp_mask = IBV_QP_INIT_ATTR_PD;
        qa.pd = pd;
        let qsize = std::mem::size_of::<efadv_qp_init_attr>() as u32;
        let mut ea = efadv_qp_init_attr {
            comp_mask: 1,
            driver_qp_type: EFADV_QP_DRIVER_TYPE_SRD,
            flags: 0,
            sl: 0,
            reserved: 0,
        };
        assert!(emu_efadv_create_qp_ex(ctx, &mut qa, &mut ea, qsize).is_null());
        assert_eq!(errno(), Some(libc::EINVAL), "comp_mask");
        ea.comp_mask = 0;
        ea.reserved = 1;
        assert!(emu_efadv_create_qp_ex(ctx, &mut qa, &mut ea, qsize).is_null());
        assert_eq!(errno(), Some(libc::EINVAL), "reserved");
        ea.reserved = 0;
        qa.comp_mask = IBV_QP_INIT_ATTR_PD | 1 << 1;
        assert!(emu_efadv_create_qp_ex(ctx, &mut qa, &mut ea, qsize).is_null());
        assert_eq!(
            errno(),
            Some(libc::EOPNOTSUPP),
            "an init attribute EFA does not take"
        );
        qa.comp_mask = IBV_QP_INIT_ATTR_PD;
        let qp = emu_efadv_create_qp_ex(ctx, &mut qa, &mut ea, qsize);
        assert!(!qp.is_null());
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = IBV_QPS_INIT;
        a.qkey = 0x11;
        a.port_num = 1;
        assert_eq!(
            emu_ibv_modify_qp(qp, &mut a, IBV_QP_STATE | IBV_QP_QKEY),
            libc::EINVAL,
            "RESET to INIT needs PKEY_INDEX, PORT and QKEY"
        );
        assert_eq!(
            emu_ibv_modify_qp(
                qp,
                &mut a,
                IBV_QP_STATE | IBV_QP_QKEY | IBV_QP_PORT | IBV_QP_PKEY_INDEX | 1 << 7
            ),
            libc::EOPNOTSUPP,
            "IBV_QP_AV: EFA takes no address vector"
        );
        let init = IBV_QP_STATE | IBV_QP_QKEY | IBV_QP_PORT | IBV_QP_PKEY_INDEX;
        assert_eq!(emu_ibv_modify_qp(qp, &mut a, init), 0);
        a.qp_state = IBV_QPS_RTR;
        assert_eq!(
            emu_ibv_modify_qp(qp, &mut a, IBV_QP_STATE | IBV_QP_PORT),
            libc::EINVAL
        );
        assert_eq!(emu_ibv_modify_qp(qp, &mut a, IBV_QP_STATE), 0);
        a.qp_state = IBV_QPS_RTS;
        assert_eq!(
            emu_ibv_modify_qp(qp, &mut a, IBV_QP_STATE),
            libc::EINVAL,
            "RTR to RTS needs SQ_PSN"
        );
        assert_eq!(
            emu_ibv_modify_qp(qp, &mut a, IBV_QP_STATE | IBV_QP_SQ_PSN),
            0
        );
        assert_eq!(emu_ibv_destroy_qp(qp), 0);
    }
}

/// Errors a NIC finds while processing a work request are completions, not refused posts
/// (issue 30, point 7): a bad lkey completes with EFA status 5 (`IBV_WC_LOC_PROT_ERR`), a send
/// longer than the MTU with 6 (`IBV_WC_LOC_LEN_ERR`); and the data of an RDMA read lands only
/// in memory still registered when it arrives: deregistered meanwhile, nothing is written and
/// the read fails with status 5.
#[test]
fn processing_errors_complete_and_reads_need_a_live_registration() {
    let mut a = emu_qp();
    let b = emu_qp();
    let (ah, _) = create_ah(a.pd, b.gid);
    let _back = create_ah(b.pd, a.gid);
    let post = |from: &EmuQp, lkey: u32, len: u32, wr: Wr| post_one(from, ah, &b, wr, lkey, len);
    // SAFETY: reading our registration's fields.
    let lkey = unsafe { (*a.mr).lkey };
    assert_eq!(post(&a, lkey ^ 0x00ff_0000, 8, Wr::Send), 0, "taken");
    let (wr_id, status, ..) = a.poll_until("bad lkey");
    assert_eq!((wr_id, status), (9, IBV_WC_LOC_PROT_ERR));
    assert_eq!(post(&a, lkey, 9000, Wr::Send), 0, "taken");
    let (_, status, ..) = a.poll_until("too long");
    assert_eq!(status, IBV_WC_LOC_LEN_ERR);
    // A read whose local registration goes before the data arrives.
    // SAFETY: reading the target registration's fields.
    let (rkey, base) = unsafe { ((*b.mr).rkey, (*b.mr).addr as u64) };
    a.buf[..8].copy_from_slice(b"untouch!");
    assert_eq!(post(&a, lkey, 8, Wr::Read { rkey, raddr: base }), 0);
    // SAFETY: our registration, deregistered once (the read's data has not been taken yet: a
    // completion is only taken when the CQ is polled).
    assert_eq!(unsafe { emu_ibv_dereg_mr(a.mr) }, 0);
    a.mr = std::ptr::null_mut();
    let (_, status, ..) = a.poll_until("read into a deregistered buffer");
    assert_eq!(status, IBV_WC_LOC_PROT_ERR);
    assert_eq!(
        &a.buf[..8],
        b"untouch!",
        "nothing written after deregistration"
    );
}

/// A completion channel counts the CQs using it atomically: CQs made and destroyed from many
/// threads at once leave the count at 0, so the channel can then be destroyed (issue 30, point
/// 13: the count was updated with a plain read and write).
#[test]
fn a_channel_counts_its_cqs_across_threads() {
    struct Ptr<T>(*mut T);
    // SAFETY: the pointers are used through the thread-safe verbs calls only.
    unsafe impl<T> Send for Ptr<T> {}
    unsafe impl<T> Sync for Ptr<T> {}
    // SAFETY: the verbs API; every pointer comes from the previous call.
    unsafe {
        let mut n = 0;
        let list = emu_ibv_get_device_list(&mut n);
        let ctx = emu_ibv_open_device(*list);
        emu_ibv_free_device_list(list);
        let ch = emu_ibv_create_comp_channel(ctx);
        assert!(!ch.is_null());
        let (ctx, ch) = (Ptr(ctx), Ptr(ch));
        let (c, h) = (&ctx, &ch);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(move || {
                    for _ in 0..300 {
                        let mut a: ibv_cq_init_attr_ex = std::mem::zeroed();
                        a.cqe = 4;
                        a.channel = h.0;
                        a.wc_flags = IBV_WC_STANDARD_FLAGS;
                        let mut e = efadv_cq_init_attr {
                            comp_mask: 0,
                            wc_flags: 0,
                        };
                        let cq = emu_efadv_create_cq(c.0, &mut a, &mut e, 16);
                        assert!(!cq.is_null());
                        assert_eq!(emu_ibv_destroy_cq(cq as *mut ibv_cq), 0);
                    }
                });
            }
        });
        assert_eq!((*ch.0).refcnt, 0, "every CQ counted in and out");
        assert_eq!(emu_ibv_destroy_comp_channel(ch.0), 0);
    }
}

/// Posts a send (`wr_id`) of `len` bytes at `addr`, named by `lkey`, to `to` through `ah`.
fn post_send_at(
    from: &EmuQp,
    ah: *mut ibv_ah,
    to: &EmuQp,
    wr_id: u64,
    lkey: u32,
    addr: u64,
    len: u32,
) {
    // SAFETY: our queue pair and an AH for the target; the SGE names registered memory of the
    // caller's (or memory whose registration the test takes away: the NIC's to report).
    unsafe {
        let q = &*from.qpx;
        q.wr_start.unwrap()(from.qpx);
        (*from.qpx).wr_id = wr_id;
        q.wr_send.unwrap()(from.qpx);
        q.wr_set_ud_addr.unwrap()(from.qpx, ah, u32::from(to.qpn()), to.qkey);
        q.wr_set_sge.unwrap()(from.qpx, lkey, addr, len);
        assert_eq!(q.wr_complete.unwrap()(from.qpx), 0, "send {wr_id} taken");
    }
}

/// A NIC reads a send's buffer by DMA when it sends it, not when it is posted (issue 30, point
/// 7): on a device whose bandwidth cap holds a send back, the bytes in the buffer when it goes
/// are the ones that arrive, and a send whose registration is taken away meanwhile reads
/// nothing and completes with EFA status 5 (`IBV_WC_LOC_PROT_ERR`). Runs in a child process
/// with the cap set (the emulated NIC reads its configuration once per process).
#[test]
fn sends_read_their_buffers_when_sent() {
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "late_read_child", "--ignored", "--nocapture"])
        .env("EFA_EMU_BANDWIDTH", "100k")
        .env("EFA_EMU_FAULTS", "none")
        .output()
        .expect("run the child test");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

/// The body of [`sends_read_their_buffers_when_sent`], under a 100 kB/s cap.
#[test]
#[ignore = "run by sends_read_their_buffers_when_sent with the bandwidth cap set"]
fn late_read_child() {
    assert_eq!(std::env::var("EFA_EMU_BANDWIDTH").as_deref(), Ok("100k"));
    let mut a = emu_qp();
    let mut b = emu_qp();
    let (ah, _) = create_ah(a.pd, b.gid);
    let _back = create_ah(b.pd, a.gid);
    for i in 0..3 {
        b.post_recv(100 + i, i as usize * 8192, 4096);
    }
    // SAFETY: reading our registration's fields.
    let lkey = unsafe { (*a.mr).lkey };
    let base = a.buf.as_ptr() as u64;
    // A second buffer under a registration of its own, taken away while its send waits.
    let mut extra = vec![b'C'; 4096];
    // SAFETY: the buffer outlives the registration (deregistered below, dropped at the end).
    let (extra_mr, extra_lkey) = unsafe {
        let mr = emu_ibv_reg_mr(
            a.pd,
            extra.as_mut_ptr() as *mut c_void,
            extra.len(),
            IBV_ACCESS_LOCAL_WRITE,
        );
        assert!(!mr.is_null());
        (mr, (*mr).lkey)
    };
    a.buf[..4000].fill(b'A');
    a.buf[8192..8192 + 4000].fill(b'B');
    // The first send overdraws the bucket (4 000 bytes at 100 kB/s: about 40 ms of debt), so
    // the next two wait on the pacing thread.
    post_send_at(&a, ah, &b, 1, lkey, base, 4000);
    post_send_at(&a, ah, &b, 2, lkey, base + 8192, 4000);
    post_send_at(&a, ah, &b, 3, extra_lkey, extra.as_ptr() as u64, 4000);
    // Changed after the post, before the NIC sends it: the new bytes go.
    a.buf[8192..8192 + 4000].fill(b'Z');
    // SAFETY: our registration, deregistered once while its send waits.
    assert_eq!(unsafe { emu_ibv_dereg_mr(extra_mr) }, 0);
    let mut sent = std::collections::HashMap::new();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while sent.len() < 3 || got.len() < 2 {
        if let Some((wr_id, status, ..)) = a.poll() {
            sent.insert(wr_id, status);
        }
        if let Some((wr_id, status, _, len, ..)) = b.poll() {
            assert_eq!(status, IBV_WC_SUCCESS, "receive {wr_id}");
            got.push((wr_id, len));
        }
        assert!(Instant::now() < deadline, "sent {sent:?}, received {got:?}");
        std::thread::yield_now();
    }
    assert_eq!(sent[&1], IBV_WC_SUCCESS);
    assert_eq!(sent[&2], IBV_WC_SUCCESS);
    assert_eq!(
        sent[&3], IBV_WC_LOC_PROT_ERR,
        "a send from a deregistered buffer"
    );
    got.sort();
    assert_eq!(got, vec![(100, 4000), (101, 4000)]);
    assert!(b.buf[..4000].iter().all(|&x| x == b'A'));
    assert!(
        b.buf[8192..8192 + 4000].iter().all(|&x| x == b'Z'),
        "the bytes in the buffer when the NIC sent it"
    );
    // Nothing more arrives (the third send read nothing).
    std::thread::sleep(Duration::from_millis(100));
    assert!(b.poll().is_none());
    drop(extra);
}
