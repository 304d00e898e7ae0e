//! The emulated NICs of this process (`EFA_EMU_DEVICES`, one by default), each with its
//! configuration, the udp device that carries its datagrams (the efa crate's SRD over UDP, on
//! its own address), its address handles, its memory registrations and its bandwidth cap.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use efa::device::udp::{UdpConfig, UdpDevice};
use efa::mr::{Access, RegionMem};
use efa::{Gid, device::Device};
use parking_lot::Mutex;

use crate::config::EmuConfig;
use crate::pace::Pacer;
use crate::qp::{Prepared, QpCore};

/// What waits for a device's bandwidth cap: a request and its queue pair.
pub type Paced = (Arc<QpCore>, Prepared);

/// Address handle numbers (AHN) handed out per protection domain and GID, with reference
/// counts, as the EFA device keeps them: one AHN per destination GID in a PD however many AHs
/// name it. A receive reports the sender's AHN only if the receiving queue pair's PD holds an
/// AH for it (another PD's AH, say another process's, tells it nothing).
#[derive(Default)]
struct Ahs {
    by_gid: HashMap<(usize, Gid), (u16, usize)>,
    free: Vec<u16>,
    next: u16,
}

/// One memory registration.
pub struct MrEntry {
    /// First byte, as the program addresses it.
    pub addr: u64,
    pub len: u64,
    /// The I/O virtual address remote accesses name the first byte by.
    pub iova: u64,
    pub access: i32,
    /// The protection domain (its address) the registration belongs to.
    pub pd: usize,
    pub rkey: u32,
    /// The region the device serves remote accesses from (None without remote rights).
    pub mem: Option<Arc<RegionMem>>,
    /// Bytes counted against the memlock limit.
    pub pinned: u64,
}

#[derive(Default)]
struct Mrs {
    by_lkey: HashMap<u32, MrEntry>,
    /// Every key ever handed out (with `EFA_EMU_KEYS=unique`: never reused in the process).
    used: HashSet<u32>,
    /// The lkeys and rkeys of live registrations.
    live: HashSet<u32>,
    pinned: u64,
}

/// A registration was attempted in this process (`ibv_fork_init` refuses to start after one).
pub static REGISTERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The NIC.
pub struct Nic {
    pub cfg: EmuConfig,
    pub dev: Arc<UdpDevice>,
    pub gid: Gid,
    ahs: Arc<Mutex<Ahs>>,
    /// The protection domain of each remotely accessible registration, by rkey: RDMA from an
    /// initiator that PD holds no AH for is refused with status 14, as EFA refuses it.
    rkey_pd: Arc<Mutex<HashMap<u32, usize>>>,
    mrs: Mutex<Mrs>,
    rng: Mutex<efa::fault::Rng>,
    /// Bytes registrations may pin (`None`: no limit), found once at open.
    memlock: Option<u64>,
    /// RDMA reads and writes this NIC's queue pairs posted (`EFA_EMU_STATS`).
    pub rdma_reads: std::sync::atomic::AtomicU64,
    pub rdma_writes: std::sync::atomic::AtomicU64,
    /// The bandwidth cap (`EFA_EMU_BANDWIDTH`) its queue pairs' sends, writes and reads pay.
    pub pacer: Option<Pacer<Paced>>,
}

static NICS: OnceLock<Result<Vec<Arc<Nic>>, String>> = OnceLock::new();

/// The process's NICs (`EFA_EMU_DEVICES` of them), opened on first use; the error says why
/// there are none. With `EFA_EMU_STATS` set, their counters are printed to stderr when the
/// process exits.
pub fn nics() -> Result<&'static [Arc<Nic>], &'static str> {
    NICS.get_or_init(|| {
        let cfg = EmuConfig::from_env()?;
        let nics = cfg
            .all_devices()
            .into_iter()
            .map(|c| Nic::open(c).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        if std::env::var_os("EFA_EMU_STATS").is_some() {
            // SAFETY: registers a plain function of this library, which stays loaded until exit.
            unsafe { libc::atexit(print_stats) };
        }
        Ok(nics)
    })
    .as_ref()
    .map(Vec::as_slice)
    .map_err(|e| e.as_str())
}

/// The process's first NIC (`efa_0`).
pub fn nic() -> Result<&'static Arc<Nic>, &'static str> {
    nics().and_then(|n| n.first().ok_or("no device"))
}

/// Prints the NICs' counters (`EFA_EMU_STATS`): datagrams, retransmissions, RNR, RDMA
/// operations served, ... so a test can tell which protocol a program used. One line per
/// device; with one device the line is as it always was.
extern "C" fn print_stats() {
    if let Some(Ok(nics)) = NICS.get() {
        use std::sync::atomic::Ordering::Relaxed;
        for n in nics {
            let name = if nics.len() > 1 {
                format!(" {}", n.cfg.device)
            } else {
                String::new()
            };
            eprintln!(
                "efa-emu stats{name}: rdma_reads_posted: {}, rdma_writes_posted: {}, cq_lost: {}, device: {:?}",
                n.rdma_reads.load(Relaxed),
                n.rdma_writes.load(Relaxed),
                crate::cq::CQ_LOST.load(Relaxed),
                n.dev.stats()
            );
        }
    }
}

/// A seed nobody can predict from outside the process.
fn entropy() -> u64 {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        if f.read_exact(&mut b).is_ok() {
            return u64::from_ne_bytes(b);
        }
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

/// True when the process may lock memory without limit (`CAP_IPC_LOCK` in its effective set).
fn has_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// The memlock limit registrations count against, if any.
fn memlock_limit(cfg: &EmuConfig) -> Option<u64> {
    if let Some(m) = cfg.memlock {
        return Some(m);
    }
    if has_ipc_lock() {
        return None;
    }
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `r`.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    (rc == 0 && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// Why a registration is refused: an errno value.
pub type Errno = i32;

impl Nic {
    /// Opens a NIC with `cfg` (the process's NIC is [`nic`]; tests open others).
    pub fn open(cfg: EmuConfig) -> Result<Nic, String> {
        let mut u = UdpConfig::new(cfg.addr);
        u.mtu = cfg.mtu;
        u.max_send_wr = cfg.max_sq_wr as usize;
        u.max_recv_wr = cfg.max_rq_wr as usize;
        u.faults = cfg.faults.clone();
        u.rdma = true;
        u.unsolicited_write_recv = cfg.caps.unsolicited_write_recv;
        u.unresponsive_timeout = cfg.unresponsive;
        u.peer_idle_timeout = u.peer_idle_timeout.max(cfg.unresponsive * 2);
        let dev = UdpDevice::open(u).map_err(|e| format!("efa-emu: cannot open the NIC: {e}"))?;
        let gid = dev.attr().gid;
        let ahs = Arc::new(Mutex::new(Ahs::default()));
        let rkey_pd: Arc<Mutex<HashMap<u32, usize>>> = Arc::default();
        {
            let (ahs, rkey_pd) = (ahs.clone(), rkey_pd.clone());
            dev.set_rdma_admission(Some(Arc::new(move |key: u64, initiator: Gid| {
                let pd = u32::try_from(key)
                    .ok()
                    .and_then(|k| rkey_pd.lock().get(&k).copied());
                pd.is_none_or(|pd| ahs.lock().by_gid.contains_key(&(pd, initiator)))
            })));
        }
        tracing::debug!(addr = %cfg.addr, device = %cfg.device, "efa-emu: NIC up");
        let pacer = cfg.bandwidth.map(|rate| {
            Pacer::new(rate, |(qp, p): Paced| {
                qp.submit_paced(p);
            })
        });
        Ok(Nic {
            pacer,
            memlock: memlock_limit(&cfg),
            cfg,
            dev,
            gid,
            ahs,
            rkey_pd,
            mrs: Mutex::new(Mrs::default()),
            rng: Mutex::new(efa::fault::Rng::new(entropy())),
            rdma_reads: Default::default(),
            rdma_writes: Default::default(),
        })
    }

    /// The AHN for `gid` in protection domain `pd` (a new one on first use).
    pub fn ah_get(&self, pd: usize, gid: Gid) -> Option<u16> {
        let mut a = self.ahs.lock();
        if let Some((ahn, n)) = a.by_gid.get_mut(&(pd, gid)) {
            *n += 1;
            return Some(*ahn);
        }
        let ahn = match a.free.pop() {
            Some(x) => x,
            None if a.next < 0xfffe => {
                a.next += 1;
                a.next - 1
            }
            None => return None,
        };
        a.by_gid.insert((pd, gid), (ahn, 1));
        Some(ahn)
    }

    /// Drops one reference to `gid`'s AH in `pd`.
    pub fn ah_put(&self, pd: usize, gid: Gid) {
        let mut a = self.ahs.lock();
        if let Some((ahn, n)) = a.by_gid.get_mut(&(pd, gid)) {
            *n -= 1;
            if *n == 0 {
                let ahn = *ahn;
                a.by_gid.remove(&(pd, gid));
                a.free.push(ahn);
            }
        }
    }

    /// The AHN protection domain `pd` holds for `gid`, if any (a receive's `slid`).
    pub fn ahn_of(&self, pd: usize, gid: Gid) -> Option<u16> {
        self.ahs.lock().by_gid.get(&(pd, gid)).map(|(ahn, _)| *ahn)
    }

    /// A key for a new registration. As a NIC (`EFA_EMU_KEYS=recycle`, the default): the
    /// smallest index no live registration holds, so a key of a closed region comes back for
    /// the next one, as EFA's lkey/rkey indices do. With `unique`: random, never reused in the
    /// process.
    /// The key is not `other` (the registration's lkey, when this is its rkey); with `unique`
    /// it is recorded in `m.used`.
    fn fresh_key(&self, m: &mut Mrs, other: Option<u32>) -> u32 {
        let free = |k: &u32| *k != 0 && Some(*k) != other;
        if self.cfg.recycle_keys {
            return (1..=u32::MAX)
                .find(|k| free(k) && !m.live.contains(k))
                .unwrap_or(0);
        }
        let mut rng = self.rng.lock();
        loop {
            let k = rng.next_u64() as u32;
            if free(&k) && m.used.insert(k) {
                return k;
            }
        }
    }

    /// Registers `len` bytes at `ptr`, named `iova` by remote accesses; returns (lkey, rkey).
    ///
    /// # Safety
    ///
    /// With remote access rights, the memory must stay valid until [`Nic::dereg`] of the lkey.
    pub unsafe fn reg(
        &self,
        pd: usize,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: i32,
    ) -> Result<(u32, u32), Errno> {
        use crate::abi::*;
        REGISTERED.store(true, std::sync::atomic::Ordering::Relaxed);
        let known = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        let mut supported = IBV_ACCESS_LOCAL_WRITE;
        if self.cfg.caps.rdma_read {
            supported |= IBV_ACCESS_REMOTE_READ;
        }
        if self.cfg.caps.rdma_write {
            supported |= IBV_ACCESS_REMOTE_WRITE;
        }
        // Optional flags (relaxed ordering and above) are ignored, as the kernel does.
        let required = access & (IBV_ACCESS_OPTIONAL_FIRST - 1);
        if required & !supported != 0 {
            tracing::debug!(
                access,
                supported,
                "efa-emu: reg_mr refused: access flags the device lacks"
            );
            return Err(if required & !known != 0 {
                libc::EINVAL
            } else {
                libc::EOPNOTSUPP
            });
        }
        if ptr.is_null() || len == 0 {
            return Err(libc::EINVAL);
        }
        if required & IBV_ACCESS_REMOTE_WRITE != 0 && required & IBV_ACCESS_LOCAL_WRITE == 0 {
            // verbs: remote write requires local write.
            return Err(libc::EINVAL);
        }
        let page = 4096u64;
        let start = (ptr as u64) & !(page - 1);
        let end = (ptr as u64)
            .checked_add(len as u64)
            .ok_or(libc::EINVAL)?
            .div_ceil(page)
            * page;
        let pinned = end - start;
        let mut m = self.mrs.lock();
        if let Some(limit) = self.memlock {
            if m.pinned + pinned > limit {
                tracing::warn!(
                    limit,
                    pinned = m.pinned,
                    asked = pinned,
                    "efa-emu: reg_mr refused: RLIMIT_MEMLOCK reached"
                );
                return Err(libc::ENOMEM);
            }
        }
        let lkey = self.fresh_key(&mut m, None);
        let remote = required & (IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE) != 0;
        let rkey = if remote {
            self.fresh_key(&mut m, Some(lkey))
        } else {
            lkey
        };
        let mem = if remote {
            // SAFETY: the caller keeps the memory valid until `dereg`, which closes the region.
            let mem = unsafe { RegionMem::foreign(ptr, len, iova) }.ok_or(libc::EINVAL)?;
            let mut a = Access::empty();
            if required & IBV_ACCESS_REMOTE_READ != 0 {
                a |= Access::REMOTE_READ;
            }
            if required & IBV_ACCESS_REMOTE_WRITE != 0 {
                a |= Access::REMOTE_WRITE;
            }
            self.dev
                .register_mem_as(&mem, a, u64::from(rkey))
                .map_err(|_| libc::EINVAL)?;
            self.rkey_pd.lock().insert(rkey, pd);
            Some(mem)
        } else {
            None
        };
        m.pinned += pinned;
        m.live.insert(lkey);
        m.live.insert(rkey);
        m.by_lkey.insert(
            lkey,
            MrEntry {
                addr: ptr as u64,
                len: len as u64,
                iova,
                access: required,
                pd,
                rkey,
                mem,
                pinned,
            },
        );
        Ok((lkey, rkey))
    }

    /// Revokes a registration: remote accesses fail from now on, and none is in progress when
    /// this returns.
    pub fn dereg(&self, lkey: u32) -> Result<(), Errno> {
        let e = {
            let mut m = self.mrs.lock();
            let e = m.by_lkey.remove(&lkey).ok_or(libc::EINVAL)?;
            m.pinned -= e.pinned;
            m.live.remove(&lkey);
            m.live.remove(&e.rkey);
            e
        };
        if let Some(mem) = &e.mem {
            self.dev.deregister_mem(u64::from(e.rkey));
            self.rkey_pd.lock().remove(&e.rkey);
            mem.close_foreign();
        }
        Ok(())
    }

    /// Where the `len` bytes at `addr` of the registration `lkey` of protection domain `pd`
    /// are in this process, `LOCAL_WRITE` needed when `write`; `None` when they are not all in
    /// it. A scatter/gather address is in the registration's I/O virtual address space (as a
    /// NIC reads it): the same as the pointer for `ibv_reg_mr`, the iova the program chose for
    /// `ibv_reg_mr_iova2` and `ibv_reg_dmabuf_mr`.
    pub fn local_addr(
        &self,
        pd: usize,
        lkey: u32,
        addr: u64,
        len: u64,
        write: bool,
    ) -> Option<u64> {
        let m = self.mrs.lock();
        let e = m.by_lkey.get(&lkey)?;
        let off = addr.checked_sub(e.iova)?;
        let end = off.checked_add(len)?;
        (e.pd == pd
            && end <= e.len
            && (!write || e.access & crate::abi::IBV_ACCESS_LOCAL_WRITE != 0))
            .then(|| e.addr + off)
    }
}
