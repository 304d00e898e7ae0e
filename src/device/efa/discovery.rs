//! What discovery learns about an EFA device, as plain values, and how it becomes the seam's
//! [`DeviceAttr`].
//!
//! [`verbs::query_device`](super::verbs) fills a [`QueriedDevice`] from `ibv_query_device`,
//! `ibv_query_port` (port 1), `efadv_query_device`, `ibv_query_gid` (port 1, index 0) and sysfs;
//! [`QueriedDevice::device_attr`] converts it. The conversion is a pure function, tested here with
//! attributes like those of real instances.

use std::path::Path;

use crate::addr::Gid;
use crate::device::{DeviceAttr, DeviceCaps, DeviceKind};
use crate::error::{Error, ErrorKind, Result};

use super::ffi;

/// Where rdma-core devices appear in sysfs by default; discovery reads
/// `<SYSFS_PATH>/class/infiniband` when `SYSFS_PATH` is set, as rdma-core does
/// ([`crate::topo::sysfs_root`]).
pub const SYSFS_CLASS: &str = "/sys/class/infiniband";

/// The parts of `struct ibv_device_attr` discovery keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct IbvDeviceAttrs {
    /// Firmware version.
    pub fw_ver: String,
    /// PCI vendor id (`0x1d0f`, Amazon).
    pub vendor_id: u32,
    /// PCI device id (`0xefa0`, `0xefa1`, `0xefa2`, `0xefa3`, ... by generation).
    pub vendor_part_id: u32,
    /// Queue pairs the device supports.
    pub max_qp: u32,
    /// Largest queue depth (generic; EFA's per-queue limits are in [`EfadvAttrs`]).
    pub max_qp_wr: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Largest completion queue.
    pub max_cqe: u32,
    /// Largest memory registration, bytes.
    pub max_mr_size: u64,
    /// Address handles.
    pub max_ah: u32,
    /// Ports (1 on EFA).
    pub phys_port_cnt: u8,
}

/// The parts of `struct ibv_port_attr` (port 1) discovery keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PortAttrs {
    /// `ibv_port_state` (4 = active).
    pub state: u32,
    /// Largest message on the port: on EFA, the MTU (largest datagram).
    pub max_msg_sz: u32,
    /// Link layer (EFA reports "unspecified", 0).
    pub link_layer: u8,
}

/// `ibv_port_state::IBV_PORT_ACTIVE`.
pub const PORT_ACTIVE: u32 = 4;

/// `struct efadv_device_attr`, as `efadv_query_device` fills it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EfadvAttrs {
    /// Send queue depth.
    pub max_sq_wr: u32,
    /// Receive queue depth.
    pub max_rq_wr: u32,
    /// Scatter/gather entries per send.
    pub max_sq_sge: u16,
    /// Scatter/gather entries per receive.
    pub max_rq_sge: u16,
    /// Largest inline send, bytes.
    pub inline_buf_size: u16,
    /// `EFADV_DEVICE_ATTR_CAPS_*` bits.
    pub device_caps: u32,
    /// Largest RDMA read/write, bytes.
    pub max_rdma_size: u32,
}

impl EfadvAttrs {
    /// The capabilities the hardware has.
    pub fn hw_caps(&self) -> DeviceCaps {
        let has = |bit: u32| self.device_caps & bit != 0;
        DeviceCaps {
            rdma_read: has(ffi::CAPS_RDMA_READ),
            rdma_write: has(ffi::CAPS_RDMA_WRITE),
            unsolicited_write_recv: has(ffi::CAPS_UNSOLICITED_WRITE_RECV),
            rnr_retry: has(ffi::CAPS_RNR_RETRY),
        }
    }

    /// The device can report the GID of a sender it has no address handle for.
    pub fn cq_with_sgid(&self) -> bool {
        self.device_caps & ffi::CAPS_CQ_WITH_SGID != 0
    }
}

/// Everything discovery learns about one EFA device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct QueriedDevice {
    /// rdma-core device name, e.g. `rdmap0s6` or `efa_0`.
    pub name: String,
    /// `ibv_query_device`.
    pub device: IbvDeviceAttrs,
    /// `ibv_query_port(1)`.
    pub port: PortAttrs,
    /// `efadv_query_device`.
    pub efa: EfadvAttrs,
    /// `ibv_query_gid(1, 0)`.
    pub gid: Gid,
    /// PCI address from sysfs (`0000:00:06.0`).
    pub pci_addr: Option<String>,
    /// NUMA node from sysfs (`None` when the kernel reports -1 or nothing).
    pub numa_node: Option<i32>,
}

impl QueriedDevice {
    /// The seam's attributes of this device, with device RDMA as `FI_EFA_USE_DEVICE_RDMA`
    /// (`use_device_rdma`) allows: see [`apply_use_device_rdma`].
    ///
    /// Errors: `Config` when `use_device_rdma` is `Some(true)` on a device without RDMA read;
    /// `NotSupported` when the device reports no MTU or no queue depth.
    pub fn device_attr(&self, use_device_rdma: Option<bool>) -> Result<DeviceAttr> {
        let bad = |d: String| {
            Error::new(ErrorKind::NotSupported, "efa_device_attr")
                .with_detail(format!("{}: {d}", self.name))
        };
        if self.port.max_msg_sz == 0 {
            return Err(bad("port 1 reports max_msg_sz 0".into()));
        }
        if self.efa.max_sq_wr == 0 || self.efa.max_rq_wr == 0 {
            return Err(bad(format!(
                "queue depths {}/{}",
                self.efa.max_sq_wr, self.efa.max_rq_wr
            )));
        }
        let caps = apply_use_device_rdma(self.efa.hw_caps(), use_device_rdma)?;
        let max_rdma_size = if caps.rdma_read || caps.rdma_write {
            u64::from(self.efa.max_rdma_size)
        } else {
            0
        };
        Ok(DeviceAttr {
            name: self.name.clone(),
            kind: DeviceKind::Efa,
            gid: self.gid,
            mtu: self.port.max_msg_sz as usize,
            max_send_wr: self.efa.max_sq_wr as usize,
            max_recv_wr: self.efa.max_rq_wr as usize,
            max_sge: usize::from(self.efa.max_sq_sge.min(self.efa.max_rq_sge)),
            inline_size: usize::from(self.efa.inline_buf_size),
            max_rdma_size,
            caps,
            pci_addr: self.pci_addr.clone(),
            numa_node: self.numa_node,
            policy: crate::device::DevicePolicy {
                pins_queue_buffers: true,
                same_host_route: true,
            },
        })
    }
}

/// The capabilities a device advertises given `FI_EFA_USE_DEVICE_RDMA`, as libfabric decides
/// (`efa_rdm_get_use_device_rdma`):
///
/// * unset: what the hardware has;
/// * `0`: no RDMA read, write or unsolicited write-recv (everything is emulated in software);
/// * `1`: what the hardware has, which must include RDMA read — otherwise a `Config` error
///   (libfabric aborts the process).
///
/// (The decision keys on RDMA read, as libfabric's does: a p4d has RDMA read but not write.)
pub fn apply_use_device_rdma(hw: DeviceCaps, use_device_rdma: Option<bool>) -> Result<DeviceCaps> {
    match use_device_rdma {
        None => Ok(hw),
        Some(false) => Ok(DeviceCaps {
            rdma_read: false,
            rdma_write: false,
            unsolicited_write_recv: false,
            ..hw
        }),
        Some(true) if hw.rdma_read => Ok(hw),
        Some(true) => Err(
            Error::new(ErrorKind::Config, "FI_EFA_USE_DEVICE_RDMA").with_detail(
                "is 1 but the EFA device has no RDMA read capability; unset it or set it to 0",
            ),
        ),
    }
}

/// True for a PCI address `dddd:bb:dd.f` (hexadecimal).
pub fn is_pci_addr(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b.get(r)
            .is_some_and(|x| x.iter().all(u8::is_ascii_hexdigit))
    };
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && hex(11..12)
}

/// The PCI address and NUMA node of rdma-core device `name`, from
/// `<class_dir>/<name>/device` (a symlink to the PCI function) and its `numa_node` file.
pub fn sysfs_location(class_dir: &Path, name: &str) -> (Option<String>, Option<i32>) {
    let dev = class_dir.join(name).join("device");
    let pci = std::fs::read_link(&dev)
        .ok()
        .and_then(|p| p.file_name().and_then(|f| f.to_str()).map(str::to_string))
        .filter(|s| is_pci_addr(s));
    let numa = std::fs::read_to_string(dev.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|n| *n >= 0);
    (pci, numa)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A p5-like device: 8928-byte MTU, 4096-deep queues, 32-byte inline, RDMA read and write,
    /// 1 GiB RDMA, RNR retry, unsolicited write-recv.
    pub(crate) fn p5() -> QueriedDevice {
        QueriedDevice {
            name: "rdmap79s0".into(),
            device: IbvDeviceAttrs {
                fw_ver: "0.0.0.0".into(),
                vendor_id: 0x1d0f,
                vendor_part_id: 0xefa2,
                max_qp: 256,
                max_qp_wr: 4096,
                max_cq: 512,
                max_cqe: 32768,
                max_mr_size: 1 << 39,
                max_ah: 1024,
                phys_port_cnt: 1,
            },
            port: PortAttrs {
                state: PORT_ACTIVE,
                max_msg_sz: 8928,
                link_layer: 0,
            },
            efa: EfadvAttrs {
                max_sq_wr: 4096,
                max_rq_wr: 32768,
                max_sq_sge: 2,
                max_rq_sge: 3,
                inline_buf_size: 32,
                device_caps: ffi::CAPS_RDMA_READ
                    | ffi::CAPS_RNR_RETRY
                    | ffi::CAPS_CQ_WITH_SGID
                    | ffi::CAPS_RDMA_WRITE
                    | ffi::CAPS_UNSOLICITED_WRITE_RECV,
                max_rdma_size: 1 << 30,
            },
            gid: Gid([
                0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x04, 0x8a, 0x1c, 0xff, 0xfe, 0x2b, 0x3c, 0x4d,
            ]),
            pci_addr: Some("0000:4f:00.0".into()),
            numa_node: Some(1),
        }
    }

    #[test]
    fn p5_attributes() {
        let q = p5();
        let a = q.device_attr(None).unwrap();
        assert_eq!(a.name, "rdmap79s0");
        assert_eq!(a.kind, DeviceKind::Efa);
        assert_eq!(a.gid, q.gid);
        assert_eq!(a.mtu, 8928);
        assert_eq!(a.max_send_wr, 4096);
        assert_eq!(a.max_recv_wr, 32768);
        assert_eq!(a.max_sge, 2);
        assert_eq!(a.inline_size, 32);
        assert_eq!(a.max_rdma_size, 1 << 30);
        assert_eq!(
            a.caps,
            DeviceCaps {
                rdma_read: true,
                rdma_write: true,
                unsolicited_write_recv: true,
                rnr_retry: true,
            }
        );
        assert_eq!(a.pci_addr.as_deref(), Some("0000:4f:00.0"));
        assert_eq!(a.numa_node, Some(1));
        assert!(q.efa.cq_with_sgid());
        // The discovery result serializes (for `info --json`-like tools).
        let j = serde_json::to_value(&q).unwrap();
        assert_eq!(j["efa"]["max_rdma_size"], 1 << 30);
    }

    #[test]
    fn use_device_rdma_off_hides_rdma() {
        let a = p5().device_attr(Some(false)).unwrap();
        assert!(!a.caps.rdma_read && !a.caps.rdma_write && !a.caps.unsolicited_write_recv);
        assert!(a.caps.rnr_retry, "RNR retry is not RDMA");
        assert_eq!(a.max_rdma_size, 0);
        let on = p5().device_attr(Some(true)).unwrap();
        assert_eq!(on, p5().device_attr(None).unwrap());
    }

    #[test]
    fn use_device_rdma_forced_without_support_is_a_config_error() {
        // A first-generation device (c5n-like): no RDMA at all.
        let mut q = p5();
        q.efa.device_caps = ffi::CAPS_RNR_RETRY;
        q.efa.max_rdma_size = 0;
        let a = q.device_attr(None).unwrap();
        assert_eq!(
            a.caps,
            DeviceCaps {
                rnr_retry: true,
                ..DeviceCaps::default()
            }
        );
        assert_eq!(a.max_rdma_size, 0);
        assert_eq!(q.device_attr(Some(false)).unwrap(), a);
        let e = q.device_attr(Some(true)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(e.op(), "FI_EFA_USE_DEVICE_RDMA");
        assert!(e.to_string().contains("no RDMA read"), "{e}");
    }

    #[test]
    fn read_only_rdma_device() {
        // p4d-like: RDMA read, no write.
        let mut q = p5();
        q.efa.device_caps = ffi::CAPS_RDMA_READ | ffi::CAPS_RNR_RETRY;
        let a = q.device_attr(Some(true)).unwrap();
        assert!(a.caps.rdma_read && !a.caps.rdma_write);
        assert_eq!(a.max_rdma_size, 1 << 30);
    }

    #[test]
    fn broken_reports_are_errors() {
        let mut q = p5();
        q.port.max_msg_sz = 0;
        assert_eq!(
            q.device_attr(None).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
        let mut q = p5();
        q.efa.max_sq_wr = 0;
        assert_eq!(
            q.device_attr(None).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
    }

    #[test]
    fn pci_addresses() {
        assert!(is_pci_addr("0000:00:06.0"));
        assert!(is_pci_addr("0000:4f:00.7"));
        assert!(!is_pci_addr("00:06.0"));
        assert!(!is_pci_addr("0000:00:06.g"));
        assert!(!is_pci_addr("virtio0"));
        assert!(!is_pci_addr(""));
    }

    #[test]
    fn sysfs_pci_and_numa() {
        let root = tempfile::tempdir().unwrap();
        let class = root.path().join("class/infiniband");
        let pci = root.path().join("devices/pci0000:00/0000:00:06.0");
        std::fs::create_dir_all(&pci).unwrap();
        std::fs::write(pci.join("numa_node"), "0\n").unwrap();
        std::fs::create_dir_all(class.join("rdmap0s6")).unwrap();
        std::os::unix::fs::symlink(&pci, class.join("rdmap0s6/device")).unwrap();
        assert_eq!(
            sysfs_location(&class, "rdmap0s6"),
            (Some("0000:00:06.0".to_string()), Some(0))
        );
        // -1: no NUMA affinity.
        std::fs::write(pci.join("numa_node"), "-1\n").unwrap();
        assert_eq!(sysfs_location(&class, "rdmap0s6").1, None);
        // A device without sysfs entries.
        assert_eq!(sysfs_location(&class, "nothere"), (None, None));
    }
}
