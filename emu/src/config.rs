//! The emulated NIC's configuration, read once from the environment (`EFA_EMU_*`).
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `EFA_EMU_ADDR` | `127.a.b.c` from the process id | IP address of this NIC: its GID and the address its queue pairs bind to |
//! | `EFA_EMU_DEVICE` | `efa_0` | device name (libfabric's domain is `<name>-rdm` / `<name>-dgrm`); only with one device |
//! | `EFA_EMU_DEVICES` | 1 | number of devices, 1..=32: `efa_0`..`efa_<N-1>`, each with its own address, PCI function and NUMA node (see `sysfs`) |
//! | `EFA_EMU_BANDWIDTH` | unset | cap each device's send path at this many bytes per second (a token bucket; `k`, `m`, `g` suffixes are powers of 1000) |
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
//! | `EFA_EMU_DMABUF` | `mappable` | `unmappable`: device memory as a GPU's: once the NIC has registered a dma-buf stand-in (`ibv_reg_dmabuf_mr`), the program can no longer map it for writing (the memfd is sealed with `F_SEAL_FUTURE_WRITE`, after the NIC's own mapping exists), so only the NIC reaches its bytes; see `dmabuf` |
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
    /// This device's address (device 0's when read from the environment).
    pub addr: IpAddr,
    /// This device's name.
    pub device: String,
    /// How many devices the process has (`EFA_EMU_DEVICES`).
    pub devices: usize,
    /// Which one this is (0 when read from the environment; see [`EmuConfig::for_device`]).
    pub index: usize,
    /// Bytes per second each device sends at most (`EFA_EMU_BANDWIDTH`).
    pub bandwidth: Option<u64>,
    /// The address was given (`EFA_EMU_ADDR`): the other devices count up from it.
    addr_given: bool,
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
    /// Registered dma-buf stand-ins become unmappable by the program (`EFA_EMU_DMABUF`).
    pub dmabuf_unmappable: bool,
    pub memlock: Option<u64>,
    pub unresponsive: Duration,
}

/// The most devices a process may have (as many as a p5 has).
pub const MAX_DEVICES: usize = 32;

/// A per-process loopback address for device `index`, so that two processes on one host are
/// two NICs with different GIDs (libfabric sends same-GID peers through its shm provider
/// instead). Device 0: `127.(1 + pid / 2^16 % 254).(pid / 2^8).(pid)`, as with one device;
/// device `i` > 0: `127.(128 + i).(pid / 2^8).(pid)`, distinct from every device 0 (whose
/// second byte stays below 128 for any process id Linux hands out) and from the process's
/// other devices; it is shared only by processes whose ids agree modulo 2^16.
fn default_addr(index: usize) -> IpAddr {
    let pid = std::process::id();
    let second = if index == 0 {
        1 + ((pid >> 16) % 254) as u8
    } else {
        128 + index as u8
    };
    IpAddr::V4(Ipv4Addr::new(
        127,
        second,
        (pid >> 8) as u8,
        (pid as u8).max(1),
    ))
}

/// `addr + n`, if that is still an address of the same family.
fn add_to(addr: IpAddr, n: usize) -> Option<IpAddr> {
    match addr {
        IpAddr::V4(a) => u32::from(a)
            .checked_add(u32::try_from(n).ok()?)
            .map(|v| IpAddr::V4(v.into())),
        IpAddr::V6(a) => u128::from(a)
            .checked_add(n as u128)
            .map(|v| IpAddr::V6(v.into())),
    }
}

/// Bytes per second: a number with an optional `k`, `m` or `g` suffix (powers of 1000).
fn parse_rate(name: &str, v: &str) -> Result<u64, String> {
    let t = v.trim().to_ascii_lowercase();
    let (digits, mult) = match t.char_indices().last() {
        Some((i, 'k')) => (&t[..i], 1_000),
        Some((i, 'm')) => (&t[..i], 1_000_000),
        Some((i, 'g')) => (&t[..i], 1_000_000_000),
        _ => (&t[..], 1),
    };
    let n: u64 = num(name, digits)?;
    match n.checked_mul(mult) {
        Some(r) if r > 0 => Ok(r),
        _ => Err(format!(
            "{name}={v:?}: not a positive rate in bytes per second"
        )),
    }
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
            "seed" => {
                let mut o = f;
                o.seed = num("EFA_EMU_FAULTS seed", val)?;
                o
            }
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
        let addr_given = get("EFA_EMU_ADDR").is_some();
        let addr = match get("EFA_EMU_ADDR") {
            Some(v) => v
                .trim()
                .parse()
                .map_err(|_| format!("EFA_EMU_ADDR={v:?}: not an IP address"))?,
            None => default_addr(0),
        };
        let devices = n("EFA_EMU_DEVICES", 1)?;
        if !(1..=MAX_DEVICES as u64).contains(&devices) {
            return Err(format!(
                "EFA_EMU_DEVICES={devices}: outside 1..={MAX_DEVICES}"
            ));
        }
        let devices = devices as usize;
        if devices > 1 && get("EFA_EMU_DEVICE").is_some() {
            return Err(format!(
                "EFA_EMU_DEVICE names the one device; with EFA_EMU_DEVICES={devices} they are efa_0..efa_{}",
                devices - 1
            ));
        }
        if addr_given && add_to(addr, devices - 1).is_none() {
            return Err(format!(
                "EFA_EMU_ADDR={addr}: no room for {devices} consecutive addresses"
            ));
        }
        let bandwidth = get("EFA_EMU_BANDWIDTH")
            .map(|v| parse_rate("EFA_EMU_BANDWIDTH", &v))
            .transpose()?;
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
        let dmabuf_unmappable = match get("EFA_EMU_DMABUF").as_deref().map(str::trim) {
            None | Some("mappable") => false,
            Some("unmappable") => true,
            Some(other) => {
                return Err(format!("EFA_EMU_DMABUF={other:?}: mappable or unmappable"));
            }
        };
        Ok(EmuConfig {
            recycle_keys,
            dmabuf_unmappable,
            addr,
            addr_given,
            devices,
            index: 0,
            bandwidth,
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

    /// The configuration of device `index` (`0..devices`): named `efa_<index>` (with one
    /// device, `EFA_EMU_DEVICE`'s name), at `EFA_EMU_ADDR + index` when the address was given,
    /// else at its own per-process loopback address.
    pub fn for_device(&self, index: usize) -> EmuConfig {
        let mut c = self.clone();
        c.index = index;
        if self.devices > 1 {
            c.device = format!("efa_{index}");
        }
        c.addr = if self.addr_given {
            add_to(self.addr, index).unwrap_or(self.addr)
        } else if index == 0 {
            self.addr
        } else {
            default_addr(index)
        };
        c
    }

    /// Every device's configuration, in order.
    pub fn all_devices(&self) -> Vec<EmuConfig> {
        (0..self.devices).map(|i| self.for_device(i)).collect()
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
    fn the_dmabuf_switch_takes_two_values() {
        assert!(!cfg(&[]).unwrap().dmabuf_unmappable);
        assert!(
            !cfg(&[("EFA_EMU_DMABUF", "mappable")])
                .unwrap()
                .dmabuf_unmappable
        );
        assert!(
            cfg(&[("EFA_EMU_DMABUF", "unmappable")])
                .unwrap()
                .dmabuf_unmappable
        );
        let e = cfg(&[("EFA_EMU_DMABUF", "gpu")]).unwrap_err();
        assert!(e.contains("EFA_EMU_DMABUF"), "{e}");
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
    fn several_devices_have_their_own_names_and_addresses() {
        let one = cfg(&[]).unwrap();
        assert_eq!(one.devices, 1);
        assert_eq!(one.all_devices()[0].device, "efa_0");
        assert_eq!(one.all_devices()[0].addr, one.addr);
        let named = cfg(&[("EFA_EMU_DEVICE", "rdmap0s6")]).unwrap();
        assert_eq!(named.all_devices()[0].device, "rdmap0s6");
        let four = cfg(&[("EFA_EMU_DEVICES", "4")]).unwrap();
        let devs = four.all_devices();
        assert_eq!(
            devs.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(),
            ["efa_0", "efa_1", "efa_2", "efa_3"]
        );
        assert_eq!(
            devs.iter().map(|d| d.index).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        let mut addrs: Vec<IpAddr> = devs.iter().map(|d| d.addr).collect();
        assert!(addrs.iter().all(|a| a.is_loopback()));
        addrs.dedup();
        assert_eq!(addrs.len(), 4, "distinct addresses: {addrs:?}");
        let given = cfg(&[("EFA_EMU_DEVICES", "3"), ("EFA_EMU_ADDR", "10.0.0.254")]).unwrap();
        assert_eq!(
            given
                .all_devices()
                .iter()
                .map(|d| d.addr.to_string())
                .collect::<Vec<_>>(),
            ["10.0.0.254", "10.0.0.255", "10.0.1.0"]
        );
        assert!(cfg(&[("EFA_EMU_DEVICES", "0")]).is_err());
        assert!(cfg(&[("EFA_EMU_DEVICES", "33")]).is_err());
        assert!(cfg(&[("EFA_EMU_DEVICES", "2"), ("EFA_EMU_DEVICE", "x")]).is_err());
        assert!(
            cfg(&[
                ("EFA_EMU_DEVICES", "2"),
                ("EFA_EMU_ADDR", "255.255.255.255")
            ])
            .is_err()
        );
    }

    #[test]
    fn bandwidth_parses_with_suffixes() {
        assert_eq!(cfg(&[]).unwrap().bandwidth, None);
        let b = |v: &str| cfg(&[("EFA_EMU_BANDWIDTH", v)]).map(|c| c.bandwidth);
        assert_eq!(b("1000").unwrap(), Some(1000));
        assert_eq!(b("25m").unwrap(), Some(25_000_000));
        assert_eq!(b("2G").unwrap(), Some(2_000_000_000));
        assert!(b("0").is_err());
        assert!(b("fast").unwrap_err().contains("EFA_EMU_BANDWIDTH"));
    }

    #[test]
    fn faults_parse() {
        let f = parse_faults("seed=7,drop=0.05,reorder=0.1,delay=0.01:200").unwrap();
        assert_eq!(f.seed, 7);
        assert!(!f.is_none());
    }
}
