//! The emulated NIC's configuration, read once from the environment (`EFA_EMU_*`).
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `EFA_EMU_ADDR` | `127.a.b.c` from the process id | IP address of this NIC: its GID and the address its queue pairs bind to |
//! | `EFA_EMU_DEVICE` | `efa_0` | device name (libfabric's domain is `<name>-rdm` / `<name>-dgrm`) |
//! | `EFA_EMU_CAPS` | `rdma_read,rdma_write,rnr_retry,unsolicited_write_recv,cq_with_sgid,cq_notifications` | `device_caps`, comma-separated; `none` for none (without `cq_with_sgid`, CQs cannot report unknown senders' GIDs, as on older kernels; without `cq_notifications`, a CQ with a completion channel is refused with `EOPNOTSUPP`, as on kernels without event queues) |
//! | `EFA_EMU_MTU` | 8928 | port MTU = largest send |
//! | `EFA_EMU_INLINE` | 32 | `inline_buf_size` |
//! | `EFA_EMU_MAX_SQ_WR` / `EFA_EMU_MAX_RQ_WR` | 4096 / 32768 | queue depths |
//! | `EFA_EMU_MAX_SQ_SGE` / `EFA_EMU_MAX_RQ_SGE` | 2 / 3 | scatter/gather entries per work request |
//! | `EFA_EMU_MAX_RDMA_SIZE` | 1 GiB | largest RDMA read or write |
//! | `EFA_EMU_VENDOR_PART_ID` | `0xefa2` | `vendor_part_id` (libfabric 1.17 uses device RDMA only above 0xefa1) |
//! | `EFA_EMU_FAULTS` | `seed=1,reorder=0.01` | seeded faults on every outgoing datagram: `seed=N,drop=P,dup=P,reorder=P,delay=P:MICROS`, or `none` (SRD keeps no order, so by default 1% are held back behind a later datagram) |
//! | `EFA_EMU_MEMLOCK` | `RLIMIT_MEMLOCK` | bytes a process may register; enforced even with `CAP_IPC_LOCK` when set |
//! | `EFA_EMU_UNRESPONSIVE_MS` | 5000 | a peer silent this long fails sends with "unresponsive remote" (13) |
//! | `EFA_EMU_STATS` | unset | print the NIC's counters to stderr at exit |
//! | `EFA_EMU_KEYS` | `recycle` | `recycle`: a registration's keys are the smallest indices no live registration holds, so a closed region's keys come back (as EFA's); `unique`: random, never reused in the process |
//! | `EFA_EMU_FORK` | `unneeded` | `disabled`: fork support as on kernels before 5.13 (`ibv_fork_init` needed, before any registration) |

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use efa::FaultConfig;

/// Device capabilities (`efadv_device_attr.device_caps`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub rdma_read: bool,
    pub rdma_write: bool,
    pub rnr_retry: bool,
    pub unsolicited_write_recv: bool,
    /// CQs may report the GID of a sender the receiver holds no AH for.
    pub cq_with_sgid: bool,
    /// CQs may have a completion channel (the kernel's `EFA_QUERY_DEVICE_CAPS_CQ_NOTIFICATIONS`,
    /// reported only by kernels with event queues; not an `efadv` bit: libefa refuses a CQ with
    /// a channel with `EOPNOTSUPP` without it).
    pub cq_notifications: bool,
}

/// `EFA_EMU_CAPS` when unset: everything.
const ALL_CAPS: &str =
    "rdma_read,rdma_write,rnr_retry,unsolicited_write_recv,cq_with_sgid,cq_notifications";

impl Caps {
    /// The `EFADV_DEVICE_ATTR_CAPS_*` bits.
    pub fn bits(&self) -> u32 {
        use crate::abi::*;
        let mut b = 0;
        if self.cq_with_sgid {
            b |= EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID;
        }
        if self.rdma_read {
            b |= EFADV_DEVICE_ATTR_CAPS_RDMA_READ;
        }
        if self.rdma_write {
            b |= EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE;
        }
        if self.rnr_retry {
            b |= EFADV_DEVICE_ATTR_CAPS_RNR_RETRY;
        }
        if self.unsolicited_write_recv {
            b |= EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV;
        }
        b
    }
}

/// Everything the environment configures.
#[derive(Clone, Debug)]
pub struct EmuConfig {
    pub addr: IpAddr,
    pub device: String,
    pub caps: Caps,
    pub mtu: usize,
    pub inline_size: u16,
    pub max_sq_wr: u32,
    pub max_rq_wr: u32,
    pub max_sq_sge: u16,
    pub max_rq_sge: u16,
    pub max_rdma_size: u32,
    pub vendor_part_id: u32,
    pub faults: FaultConfig,
    /// Keys of closed regions come back (`EFA_EMU_KEYS=recycle`, the default).
    pub recycle_keys: bool,
    pub memlock: Option<u64>,
    pub unresponsive: Duration,
}

/// A per-process loopback address, so that two processes on one host are two NICs with
/// different GIDs (libfabric sends same-GID peers through its shm provider instead).
fn default_addr() -> IpAddr {
    let pid = std::process::id();
    IpAddr::V4(Ipv4Addr::new(
        127,
        1 + ((pid >> 16) % 254) as u8,
        (pid >> 8) as u8,
        (pid as u8).max(1),
    ))
}

fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
    let v = v.trim();
    let parsed = if let Some(hex) = v.strip_prefix("0x") {
        u64::from_str_radix(hex, 16)
            .ok()
            .and_then(|n| n.to_string().parse().ok())
    } else {
        v.parse().ok()
    };
    parsed.ok_or_else(|| format!("{name}={v:?}: not a number in range"))
}

fn parse_caps(v: &str) -> Result<Caps, String> {
    let mut c = Caps {
        rdma_read: false,
        rdma_write: false,
        rnr_retry: false,
        unsolicited_write_recv: false,
        cq_with_sgid: false,
        cq_notifications: false,
    };
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match item {
            "none" => {}
            "rdma_read" => c.rdma_read = true,
            "rdma_write" => c.rdma_write = true,
            "rnr_retry" => c.rnr_retry = true,
            "unsolicited_write_recv" => c.unsolicited_write_recv = true,
            "cq_with_sgid" => c.cq_with_sgid = true,
            "cq_notifications" => c.cq_notifications = true,
            other => {
                return Err(format!(
                    "EFA_EMU_CAPS: unknown capability {other:?} ({}, none)",
                    ALL_CAPS.replace(',', ", ")
                ));
            }
        }
    }
    Ok(c)
}

/// `EFA_EMU_FAULTS` when unset: SRD (and UD) keep no order, so 1% of datagrams are held back
/// behind a later one (seeded; `EFA_EMU_FAULTS=none` for none).
pub const DEFAULT_FAULTS: &str = "seed=1,reorder=0.01";

/// `seed=N,drop=P,dup=P,reorder=P,delay=P:MICROS`.
pub fn parse_faults(v: &str) -> Result<FaultConfig, String> {
    let mut f = FaultConfig::seeded(0);
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, val) = item
            .split_once('=')
            .ok_or_else(|| format!("EFA_EMU_FAULTS: {item:?} is not key=value"))?;
        let p = |s: &str| -> Result<f64, String> {
            let p: f64 = s
                .parse()
                .map_err(|_| format!("EFA_EMU_FAULTS: {k}={s:?} is not a probability"))?;
            if (0.0..=1.0).contains(&p) {
                Ok(p)
            } else {
                Err(format!("EFA_EMU_FAULTS: {k}={s} is not in 0..=1"))
            }
        };
        f = match k {
            "seed" => FaultConfig {
                seed: num("EFA_EMU_FAULTS seed", val)?,
                ..f
            },
            "drop" => f.drop(p(val)?),
            "dup" => f.duplicate(p(val)?),
            "reorder" => f.reorder(p(val)?),
            "delay" => {
                let (pr, us) = val
                    .split_once(':')
                    .ok_or_else(|| "EFA_EMU_FAULTS: delay=P:MICROS".to_string())?;
                f.delay(p(pr)?, Duration::from_micros(num("delay", us)?))
            }
            other => return Err(format!("EFA_EMU_FAULTS: unknown key {other:?}")),
        };
    }
    f.validate().map_err(|e| format!("EFA_EMU_FAULTS: {e}"))?;
    Ok(f)
}

impl EmuConfig {
    /// Reads the `EFA_EMU_*` variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<EmuConfig, String> {
        let n = |name: &str, default: u64| -> Result<u64, String> {
            get(name).map_or(Ok(default), |v| num(name, &v))
        };
        let addr = match get("EFA_EMU_ADDR") {
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| format!("EFA_EMU_ADDR={v:?}: not an IP address"))?,
            None => default_addr(),
        };
        let caps = parse_caps(&get("EFA_EMU_CAPS").unwrap_or_else(|| ALL_CAPS.into()))?;
        let mtu = n("EFA_EMU_MTU", 8928)?;
        if !(efa::device::udp::MIN_MTU as u64..=efa::device::udp::MAX_MTU as u64).contains(&mtu) {
            return Err(format!(
                "EFA_EMU_MTU={mtu}: outside {}..={}",
                efa::device::udp::MIN_MTU,
                efa::device::udp::MAX_MTU
            ));
        }
        let small = |name: &str, default: u64, max: u64| -> Result<u64, String> {
            let v = n(name, default)?;
            if v == 0 || v > max {
                Err(format!("{name}={v}: outside 1..={max}"))
            } else {
                Ok(v)
            }
        };
        let faults = match get("EFA_EMU_FAULTS") {
            Some(v) if v.trim() == "none" => FaultConfig::default(),
            Some(v) => parse_faults(&v)?,
            // SRD delivers in any order: a little reordering unless told otherwise, so that
            // nothing comes to rely on an order a NIC does not keep.
            None => parse_faults(DEFAULT_FAULTS)?,
        };
        let recycle_keys = match get("EFA_EMU_KEYS").as_deref().map(str::trim) {
            None | Some("recycle") => true,
            Some("unique") => false,
            Some(other) => {
                return Err(format!("EFA_EMU_KEYS={other:?}: recycle or unique"));
            }
        };
        Ok(EmuConfig {
            recycle_keys,
            addr,
            device: get("EFA_EMU_DEVICE").unwrap_or_else(|| "efa_0".into()),
            caps,
            mtu: mtu as usize,
            inline_size: small("EFA_EMU_INLINE", 32, 4096)? as u16,
            max_sq_wr: small("EFA_EMU_MAX_SQ_WR", 4096, 1 << 20)? as u32,
            max_rq_wr: small("EFA_EMU_MAX_RQ_WR", 32768, 1 << 20)? as u32,
            max_sq_sge: small("EFA_EMU_MAX_SQ_SGE", 2, 16)? as u16,
            max_rq_sge: small("EFA_EMU_MAX_RQ_SGE", 3, 16)? as u16,
            max_rdma_size: small("EFA_EMU_MAX_RDMA_SIZE", 1 << 30, 1 << 30)? as u32,
            vendor_part_id: n("EFA_EMU_VENDOR_PART_ID", 0xefa2)? as u32,
            faults,
            memlock: get("EFA_EMU_MEMLOCK")
                .map(|v| num("EFA_EMU_MEMLOCK", &v))
                .transpose()?,
            unresponsive: Duration::from_millis(small(
                "EFA_EMU_UNRESPONSIVE_MS",
                5000,
                86_400_000,
            )?),
        })
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<EmuConfig, String> {
        EmuConfig::from_lookup(|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Result<EmuConfig, String> {
        EmuConfig::from_lookup(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn defaults_are_a_p5_class_device() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.mtu, 8928);
        assert_eq!(c.inline_size, 32);
        assert_eq!(c.vendor_part_id, 0xefa2);
        assert!(c.caps.rdma_read && c.caps.rdma_write && c.caps.rnr_retry);
        assert!(c.addr.is_loopback());
        assert!(
            !c.faults.is_none() && c.faults.reorder > 0.0,
            "a little reordering"
        );
        assert_eq!(c.faults.drop, 0.0);
        assert!(cfg(&[("EFA_EMU_FAULTS", "none")]).unwrap().faults.is_none());
    }

    #[test]
    fn caps_switch_off_one_by_one() {
        let c = cfg(&[("EFA_EMU_CAPS", "rdma_read")]).unwrap();
        assert_eq!(
            c.caps.bits() & crate::abi::EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE,
            0
        );
        assert_ne!(
            c.caps.bits() & crate::abi::EFADV_DEVICE_ATTR_CAPS_RDMA_READ,
            0
        );
        let c = cfg(&[("EFA_EMU_CAPS", "none")]).unwrap();
        assert_eq!(c.caps.bits(), 0);
        let c = cfg(&[]).unwrap();
        assert_ne!(
            c.caps.bits() & crate::abi::EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID,
            0
        );
        assert!(cfg(&[("EFA_EMU_CAPS", "rdma_teleport")]).is_err());
    }

    #[test]
    fn bad_values_are_clear_errors() {
        assert!(
            cfg(&[("EFA_EMU_MTU", "12")])
                .unwrap_err()
                .contains("EFA_EMU_MTU")
        );
        assert!(
            cfg(&[("EFA_EMU_ADDR", "nope")])
                .unwrap_err()
                .contains("EFA_EMU_ADDR")
        );
        assert!(cfg(&[("EFA_EMU_MAX_RQ_SGE", "0")]).is_err());
        assert!(cfg(&[("EFA_EMU_FAULTS", "drop=2")]).is_err());
        assert!(
            cfg(&[("EFA_EMU_VENDOR_PART_ID", "0xefa1")])
                .unwrap()
                .vendor_part_id
                == 0xefa1
        );
    }

    #[test]
    fn faults_parse() {
        let f = parse_faults("seed=7,drop=0.05,reorder=0.1,delay=0.01:200").unwrap();
        assert_eq!(f.seed, 7);
        assert!(!f.is_none());
    }
}
