//! A fake [`Nic`] for tests: it records what is posted, copies send data out of the posted memory
//! at posting, writes received datagrams (with a GRH on UD) into the posted receive memory like
//! the NIC's DMA would, and completes whatever the test says.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::GRH_LEN;
use super::ah::{AhCache, AhFactory};
use super::nic::{Nic, Payload, RawWc, Registration, SendOp, SendWqe, Sge};
use crate::addr::Gid;
use crate::device::QpType;
use crate::error::{Error, ErrorKind, Result};

/// A fake registration: counts live registrations.
pub struct FakeMr {
    key: u32,
    live: Arc<AtomicUsize>,
    /// Deregistrations fail while set (the registration stays counted live).
    fail: Arc<AtomicBool>,
    dereg: Option<bool>,
}

impl FakeMr {
    /// A registration of its own (not counted by any NIC), failing to deregister when `fail`.
    pub fn detached(key: u32, fail: bool) -> FakeMr {
        FakeMr {
            key,
            live: Arc::new(AtomicUsize::new(1)),
            fail: Arc::new(AtomicBool::new(fail)),
            dereg: None,
        }
    }
}

impl Registration for FakeMr {
    fn lkey(&self) -> u32 {
        self.key
    }

    fn deregister(&mut self) -> bool {
        if let Some(ok) = self.dereg {
            return ok;
        }
        let ok = !self.fail.load(Ordering::SeqCst);
        if ok {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
        self.dereg = Some(ok);
        ok
    }
}

impl Drop for FakeMr {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// A fake address handle.
#[derive(Debug)]
pub struct FakeAh {
    pub gid: Gid,
}

struct Factory {
    next: Mutex<u16>,
}

impl AhFactory for Factory {
    type Ah = FakeAh;
    fn create_ah(&self, gid: &Gid) -> Result<(FakeAh, u16)> {
        if gid.0 == [0xff; 16] {
            return Err(Error::new(ErrorKind::Unreachable, "ibv_create_ah"));
        }
        let mut n = self.next.lock();
        *n += 1;
        Ok((FakeAh { gid: *gid }, *n))
    }
}

/// A posted send as the fake saw it.
#[derive(Clone, Debug)]
pub struct PostedSend {
    pub wr_id: u64,
    pub op: SendOp,
    pub gid: Gid,
    pub qpn: u32,
    pub qkey: u32,
    pub inline: bool,
    pub sge: Option<Sge>,
    /// The data (copied from the SGE or the inline list at posting).
    pub data: Vec<u8>,
}

/// The fake NIC.
pub struct FakeNic {
    pub qp_type: QpType,
    pub sends: Vec<PostedSend>,
    pub recvs: VecDeque<(u64, Sge)>,
    pub cq: VecDeque<RawWc>,
    pub regs: Arc<AtomicUsize>,
    next_key: u32,
    ahs: Mutex<AhCache<FakeAh>>,
    factory: Factory,
    /// Fail the next post_send / post_recv with this errno.
    pub fail_send: Option<i32>,
    /// Doorbells rung: send lists (of one or more work requests) posted.
    pub doorbells: usize,
    /// Deregistrations fail while set.
    pub fail_dereg: Arc<AtomicBool>,
    pub fail_recv: Option<i32>,
    /// On `to_error`, complete every posted work request with a flush.
    pub flush_on_error: bool,
    pub errored: bool,
    pub destroyed: bool,
    /// `destroy` fails.
    pub destroy_fails: bool,
}

impl FakeNic {
    pub fn new(qp_type: QpType) -> FakeNic {
        FakeNic {
            qp_type,
            sends: Vec::new(),
            recvs: VecDeque::new(),
            cq: VecDeque::new(),
            regs: Arc::new(AtomicUsize::new(0)),
            next_key: 1,
            ahs: Mutex::new(AhCache::new(16)),
            factory: Factory {
                next: Mutex::new(0),
            },
            fail_send: None,
            doorbells: 0,
            fail_dereg: Arc::default(),
            fail_recv: None,
            flush_on_error: false,
            errored: false,
            destroyed: false,
            destroy_fails: false,
        }
    }

    /// Records one posted send work request.
    fn push_send(&mut self, wqe: &SendWqe<'_, FakeAh>) {
        let (inline, sge, data) = match wqe.payload {
            Payload::Inline(segs) => (true, None, segs.concat()),
            Payload::Sge(s) => {
                let mut v = vec![0u8; s.len as usize];
                if !matches!(wqe.op, SendOp::Read { .. }) {
                    // SAFETY: the SGE names registered memory owned by the work request.
                    unsafe {
                        std::ptr::copy_nonoverlapping(s.addr as *const u8, v.as_mut_ptr(), v.len())
                    };
                }
                (false, Some(s), v)
            }
            Payload::Empty => (false, None, Vec::new()),
        };
        self.next_key += 1;
        self.sends.push(PostedSend {
            wr_id: wqe.wr_id,
            op: wqe.op,
            gid: wqe.ah.gid,
            qpn: wqe.remote_qpn,
            qkey: wqe.remote_qkey,
            inline,
            sge,
            data,
        });
    }

    /// Live registrations.
    pub fn live_regs(&self) -> usize {
        self.regs.load(Ordering::SeqCst)
    }

    /// The AHN the fake gave `gid`'s handle (creating one, as a prior send would).
    pub fn ahn_for(&self, gid: &Gid) -> u16 {
        let mut c = self.ahs.lock();
        drop(c.get(gid, &self.factory).unwrap());
        c.ahn_of(gid).unwrap()
    }

    /// "DMA": writes `data` into the oldest posted receive (after a GRH on UD) and queues its
    /// completion. Returns the token, or `None` when no receive is posted.
    /// The AHN the NIC's AH cache holds for `gid`.
    pub fn ahn_of(&self, gid: &Gid) -> Option<u16> {
        self.ahs.lock().ahn_of(gid)
    }

    pub fn arrive(&mut self, data: &[u8], slid: u32, src_qp: u32, imm: Option<u32>) -> Option<u64> {
        let (wr_id, sge) = self.recvs.pop_front()?;
        let grh = if self.qp_type == QpType::Ud {
            GRH_LEN
        } else {
            0
        };
        let total = grh + data.len();
        assert!(
            total <= sge.len as usize,
            "datagram larger than the posted slot"
        );
        let mut frame = vec![0xee_u8; grh];
        frame.extend_from_slice(data);
        // SAFETY: the SGE names registered memory of the queue pair's receive pool, at least
        // `total` bytes long (asserted), which no Rust reference covers while it is posted.
        unsafe {
            std::ptr::copy_nonoverlapping(frame.as_ptr(), sge.addr as *mut u8, total);
        }
        self.cq.push_back(RawWc {
            wr_id,
            opcode: rdma_sys::ibv_wc_opcode::IBV_WC_RECV,
            byte_len: total as u32,
            src_qp,
            slid,
            imm,
            ..RawWc::default()
        });
        Some(wr_id)
    }

    /// "DMA" for an RDMA read: writes `data` into the local SGE of posted send `i`.
    pub fn fill_read(&mut self, i: usize, data: &[u8]) {
        let sge = self.sends[i].sge.expect("read without SGE");
        assert!(data.len() <= sge.len as usize);
        // SAFETY: the SGE names the registered capacity of the read's buffer, owned by the work
        // request; no Rust reference covers it while it is posted.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), sge.addr as *mut u8, data.len()) };
    }

    /// Queues the completion of posted send `i` with verbs status / vendor code.
    /// Completes send-queue entry `i` as rdma-core's EFA provider reports it: opcode
    /// `IBV_WC_SEND` for sends and RDMA reads alike (rdma-core 44, Debian 12, reports every
    /// send-queue completion so; later versions tell RDMA writes apart as `IBV_WC_RDMA_WRITE`)
    /// and `byte_len` 0 (the device reports a length for receives only), so the device must
    /// know an operation by its work request, never by the completion's opcode or length.
    pub fn complete_send(&mut self, i: usize, status: u32, vendor_err: u32) {
        let s = &self.sends[i];
        self.cq.push_back(RawWc {
            wr_id: s.wr_id,
            status,
            vendor_err,
            opcode: rdma_sys::ibv_wc_opcode::IBV_WC_SEND,
            byte_len: 0,
            ..RawWc::default()
        });
    }
}

impl Nic for FakeNic {
    type Ah = FakeAh;
    type Mr = FakeMr;

    unsafe fn register(&self, ptr: *mut u8, len: usize, _access: u32) -> Result<FakeMr> {
        assert!(!ptr.is_null() && len > 0);
        self.regs.fetch_add(1, Ordering::SeqCst);
        // Keys need only be distinct per registration for the tests.
        let key = (ptr as usize as u32) ^ (len as u32);
        Ok(FakeMr {
            key,
            live: self.regs.clone(),
            fail: self.fail_dereg.clone(),
            dereg: None,
        })
    }

    fn address_handle(&self, gid: &Gid) -> Result<Arc<FakeAh>> {
        super::ah::get_shared(&self.ahs, gid, &self.factory)
    }

    fn gid_of_ahn(&self, ahn: u16) -> Option<Gid> {
        self.ahs.lock().gid_of(ahn)
    }

    fn post_send_list(&mut self, wqes: &[SendWqe<'_, FakeAh>]) -> std::result::Result<(), i32> {
        assert!(!self.destroyed, "post after destroy");
        if let Some(e) = self.fail_send.take() {
            return Err(e);
        }
        self.doorbells += 1;
        for wqe in wqes {
            self.push_send(wqe);
        }
        Ok(())
    }
    fn post_recv(&mut self, wr_id: u64, sge: Sge) -> std::result::Result<(), i32> {
        assert!(!self.destroyed, "post after destroy");
        if let Some(e) = self.fail_recv.take() {
            return Err(e);
        }
        self.recvs.push_back((wr_id, sge));
        Ok(())
    }

    fn poll(&mut self, max: usize, out: &mut Vec<RawWc>) -> std::result::Result<(), i32> {
        assert!(!self.destroyed, "poll after destroy");
        for _ in 0..max {
            match self.cq.pop_front() {
                Some(c) => out.push(c),
                None => break,
            }
        }
        Ok(())
    }

    fn to_error(&mut self) -> Result<()> {
        self.errored = true;
        if self.flush_on_error {
            let flush = |wr_id| RawWc {
                wr_id,
                status: rdma_sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                vendor_err: 1,
                ..RawWc::default()
            };
            let recvs: Vec<u64> = self.recvs.drain(..).map(|(w, _)| w).collect();
            for w in recvs {
                self.cq.push_back(flush(w));
            }
        }
        Ok(())
    }

    fn destroy(&mut self) -> bool {
        self.destroyed = true;
        !self.destroy_fails
    }
}
