//! The device seam: what a NIC (or a software device that behaves like one) offers the layers above.
//!
//! It is modelled on the EFA device so that the protocol engine runs unchanged on real hardware:
//!
//! * a queue pair is either [`QpType::Srd`] (reliable datagrams of at most one MTU, delivered
//!   **exactly once, in any order**) or [`QpType::Ud`] (unreliable datagrams, may drop);
//! * [`QueuePair::post_send`] sends one datagram of at most two segments (header and payload),
//!   optionally with 4 bytes of immediate data;
//! * [`QueuePair::post_recv`] posts a receive buffer; a datagram that arrives at an SRD queue pair
//!   with no posted buffer is refused with receiver-not-ready, and after `rnr_retry` retries the
//!   sender's completion carries [`Status::RnrRetryExceeded`];
//! * [`QueuePair::poll`] returns completions, each with its `wr_id`, an EFA [`Status`], the opcode,
//!   the byte count, the source queue pair and the immediate data;
//! * one-sided RDMA read and write ([`QueuePair::post_read`], [`QueuePair::post_write`]) where
//!   [`DeviceCaps`] says the device has them. They complete **without the target application
//!   polling**, against memory the target registered with [`Device::register_mem`]; every access
//!   is checked against the key, the bounds and the access rights and fails with
//!   [`Status::RemoteBadAddress`], never touching other memory.
//!
//! Buffers are owned: a send keeps a reference-counted [`Bytes`] until its completion, a receive
//! buffer ([`BytesMut`]) is handed back inside its completion. Nothing here borrows.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::addr::{Gid, RawAddr};
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{Access, RegionMem, RegionSlice};
use crate::notify::Notifier;
use crate::stats::DeviceStats;

#[cfg(feature = "efa")]
#[cfg_attr(docsrs, doc(cfg(feature = "efa")))]
pub mod efa;
pub mod loopback;
pub(crate) mod queues;
pub(crate) mod registry;
#[cfg(target_os = "linux")]
#[cfg_attr(docsrs, doc(cfg(target_os = "linux")))]
pub mod route;
#[cfg(target_os = "linux")]
#[cfg_attr(docsrs, doc(cfg(target_os = "linux")))]
pub mod shm;
#[cfg(target_os = "linux")]
pub(crate) mod soft_rdma;
pub mod spec;
pub mod udp;

/// The `wr_id` of an unsolicited write-recv completion: the target side of an RDMA write with
/// immediate data that consumed no receive buffer (opcode [`Opcode::RecvRdmaWithImm`], no
/// `buf`). Only on SRD queue pairs of devices with [`DeviceCaps::unsolicited_write_recv`]; on other
/// devices such a write consumes a posted receive buffer and its completion carries that buffer's
/// `wr_id`.
pub const UNSOLICITED_WR_ID: u64 = u64::MAX;

/// Which kind of device this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// AWS Elastic Fabric Adapter through rdma-core (cargo feature `efa`).
    Efa,
    /// Software device over UDP sockets (works across hosts).
    Udp,
    /// Software device over shared memory (processes on one host).
    Shm,
    /// In-process software device with seeded fault injection.
    Loopback,
}

impl DeviceKind {
    /// Every kind, whether this build offers it or not (see `getinfo`).
    pub const ALL: [DeviceKind; 4] = [
        DeviceKind::Efa,
        DeviceKind::Udp,
        DeviceKind::Shm,
        DeviceKind::Loopback,
    ];

    /// The provider-style name: `efa`, `udp`, `shm`, `loopback`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Efa => "efa",
            DeviceKind::Udp => "udp",
            DeviceKind::Shm => "shm",
            DeviceKind::Loopback => "loopback",
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Optional device capabilities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceCaps {
    /// One-sided RDMA read.
    pub rdma_read: bool,
    /// One-sided RDMA write (and write with immediate data).
    pub rdma_write: bool,
    /// RDMA write with immediate data completes at the target without consuming a receive buffer.
    pub unsolicited_write_recv: bool,
    /// The RNR retry count of a queue pair can be set.
    pub rnr_retry: bool,
}

/// Device attributes (the parts of `ibv_device_attr` / `efadv_device_attr` the layers above use).
/// Made by devices ([`DeviceAttr::software`] for software ones); fields may be added.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Device name, e.g. `udp-127.0.0.1` or `rdmap0s6`.
    pub name: String,
    /// Device kind.
    pub kind: DeviceKind,
    /// The device's GID.
    pub gid: Gid,
    /// Largest datagram (payload of one send), bytes.
    pub mtu: usize,
    /// Send queue depth of one queue pair.
    pub max_send_wr: usize,
    /// Receive queue depth of one queue pair.
    pub max_recv_wr: usize,
    /// Scatter/gather entries per work request.
    pub max_sge: usize,
    /// Largest inline send, bytes.
    pub inline_size: usize,
    /// Largest single RDMA read or write, bytes (0 without RDMA).
    pub max_rdma_size: u64,
    /// Capabilities.
    pub caps: DeviceCaps,
    /// PCI address, when the device is a PCI function.
    pub pci_addr: Option<String>,
    /// NUMA node the device is attached to, when known.
    pub numa_node: Option<i32>,
    /// How the layers above treat the device.
    #[serde(default)]
    pub policy: DevicePolicy,
}

/// What the NIC reports of one registration (`efadv_query_mr`; libfabric's `fi_efa_mr_attr`):
/// the interconnect (a NIC's internal path to the memory) each kind of traffic to or from the
/// region uses, or `None` where the NIC does not say. Applications that spread buffers over
/// interconnects (NCCL's EFA plugin) read it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct MrQuery {
    /// The interconnect received messages land through.
    pub recv_ic_id: Option<u16>,
    /// The interconnect this side's RDMA reads land through.
    pub rdma_read_ic_id: Option<u16>,
    /// The interconnect peers' RDMA writes land through.
    pub rdma_recv_ic_id: Option<u16>,
}

/// How the layers above treat a device: what each device declares of itself, so that no layer
/// above `device` decides by its [`DeviceKind`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DevicePolicy {
    /// Each work request of a queue pair holds a bounce buffer the device pins (`efa`): queue
    /// pairs get modest default depths (`PINNED_QP_DEPTH`) instead of the device's maxima, so
    /// that they fit the usual `RLIMIT_MEMLOCK`.
    pub pins_queue_buffers: bool,
    /// RDM endpoints reach peers on this host over shared memory beside it
    /// (`FI_EFA_ENABLE_SHM_TRANSFER`: the device is wrapped in a routing device), as libfabric's
    /// EFA provider hands same-host peers to its shm provider.
    pub same_host_route: bool,
}

impl DeviceAttr {
    /// Attributes of a software device: two scatter/gather entries, 32-byte inline sends, no
    /// RDMA, RNR retry count settable, no PCI function.
    pub fn software(
        kind: DeviceKind,
        name: String,
        gid: Gid,
        mtu: usize,
        max_send_wr: usize,
        max_recv_wr: usize,
    ) -> DeviceAttr {
        DeviceAttr {
            name,
            kind,
            gid,
            mtu,
            max_send_wr,
            max_recv_wr,
            max_sge: 2,
            inline_size: 32,
            max_rdma_size: 0,
            caps: DeviceCaps {
                rnr_retry: true,
                ..DeviceCaps::default()
            },
            pci_addr: None,
            numa_node: None,
            policy: DevicePolicy::default(),
        }
    }

    /// A software device's attributes with its one-sided RDMA on (`rdma`): reads and writes up
    /// to `max_rdma_size` bytes, unsolicited write-recv as configured.
    pub(crate) fn with_soft_rdma(
        mut self,
        rdma: bool,
        unsolicited_write_recv: bool,
        max_rdma_size: u64,
    ) -> DeviceAttr {
        if rdma {
            self.caps.rdma_read = true;
            self.caps.rdma_write = true;
            self.caps.unsolicited_write_recv = unsolicited_write_recv;
            self.max_rdma_size = max_rdma_size;
        }
        self
    }
}

/// Queue pair type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QpType {
    /// Scalable Reliable Datagram: exactly once, any order (RDM endpoints).
    Srd,
    /// Unreliable Datagram: may drop (DGRAM endpoints).
    Ud,
}

/// How to create a queue pair.
#[derive(Clone, Debug)]
pub struct QpAttr {
    /// SRD or UD.
    pub qp_type: QpType,
    /// Send queue depth (clamped to the device's).
    pub send_depth: usize,
    /// Receive queue depth (clamped to the device's).
    pub recv_depth: usize,
    /// RNR retries before a send fails with [`Status::RnrRetryExceeded`]; 7 means forever (SRD only).
    pub rnr_retry: u8,
    /// The QKEY; `None` picks a random 31-bit value, as EFA does.
    pub qkey: Option<u32>,
    /// Signalled whenever new completions become ready, so waiters can sleep.
    pub notifier: Arc<Notifier>,
    /// Whether RDMA writes with immediate data complete at this queue pair without consuming a
    /// receive buffer (EFA's `EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV`); honoured only on devices
    /// with [`DeviceCaps::unsolicited_write_recv`]. `None`: the device's default.
    pub unsolicited_write_recv: Option<bool>,
    /// On a routing device (`FI_EFA_ENABLE_SHM_TRANSFER`), peers on this host are reached over
    /// its shm path; false: over the primary device only (`FI_OPT_SHARED_MEMORY_PERMITTED`).
    /// Other devices ignore it. Default true.
    pub same_host_route: bool,
}

/// Changes to a queue pair after it was created, as EFA's `ibv_modify_qp` makes them on the way
/// to ready-to-send: INIT sets the QKEY, RTS the RNR retry count. `None` leaves a value as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg(any(test, feature = "emu-hooks"))]
pub struct QpModify {
    /// The new QKEY (the queue pair's [`RawAddr`] changes with it).
    pub qkey: Option<u32>,
    /// The new RNR retry count; 7 means forever (SRD only).
    pub rnr_retry: Option<u8>,
}

impl QpAttr {
    /// Defaults for a queue pair type: depths 256, RNR retry 3, random QKEY, a fresh notifier.
    pub fn new(qp_type: QpType) -> QpAttr {
        QpAttr {
            qp_type,
            send_depth: 256,
            recv_depth: 256,
            rnr_retry: 3,
            qkey: None,
            notifier: Arc::new(Notifier::new()),
            unsolicited_write_recv: None,
            same_host_route: true,
        }
    }

    /// What every device checks before it creates a queue pair: positive depths and an RNR
    /// retry count of at most 7 (7 is "for ever", as in verbs). `InvalidArgument` otherwise.
    ///
    /// ```
    /// use efa::device::{QpAttr, QpType};
    /// assert!(QpAttr::new(QpType::Srd).check().is_ok());
    /// let mut a = QpAttr::new(QpType::Srd);
    /// a.rnr_retry = 8;
    /// assert_eq!(a.check().unwrap_err().kind(), efa::ErrorKind::InvalidArgument);
    /// ```
    pub fn check(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(Error::new(ErrorKind::InvalidArgument, "create_qp").with_detail(detail))
        };
        if self.send_depth == 0 || self.recv_depth == 0 {
            return bad(format!(
                "queue depths must be positive (send {}, recv {})",
                self.send_depth, self.recv_depth
            ));
        }
        if self.rnr_retry > RNR_RETRY_FOREVER {
            return bad(format!(
                "rnr_retry {} outside 0..={RNR_RETRY_FOREVER}",
                self.rnr_retry
            ));
        }
        Ok(())
    }
}

/// The RNR retry count that retries for ever (verbs' 7).
pub const RNR_RETRY_FOREVER: u8 = 7;

/// Checks a software device's MTU (inside `mtus`) and queue limits (1 to `max_depth`) for
/// its configuration's `validate` (`what` names the configuration in the error).
pub(crate) fn check_limits(
    what: &'static str,
    mtu: usize,
    mtus: std::ops::RangeInclusive<usize>,
    (max_send_wr, max_recv_wr): (usize, usize),
    max_depth: usize,
) -> Result<()> {
    let bad =
        |detail: String| Err(Error::new(ErrorKind::InvalidArgument, what).with_detail(detail));
    if !mtus.contains(&mtu) {
        return bad(format!(
            "mtu {mtu} outside {}..={}",
            mtus.start(),
            mtus.end()
        ));
    }
    for (name, v) in [("max_send_wr", max_send_wr), ("max_recv_wr", max_recv_wr)] {
        if !(1..=max_depth).contains(&v) {
            return bad(format!("{name} {v} outside 1..={max_depth}"));
        }
    }
    Ok(())
}

/// EFA completion statuses (`EFA_IO_COMP_STATUS_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum Status {
    /// 0: success.
    Success,
    /// 1: flushed (queue pair closed or operation cancelled).
    Flushed,
    /// 2: local queue pair internal error.
    LocalQpInternalError,
    /// 3: unsupported operation.
    UnsupportedOp,
    /// 4: invalid address handle.
    InvalidAh,
    /// 5: invalid local key.
    InvalidLkey,
    /// 6: local buffer too short.
    LocalBadLength,
    /// 7: remote bad address (bad key, bounds or access rights).
    RemoteBadAddress,
    /// 8: remote aborted.
    RemoteAbort,
    /// 9: bad destination queue pair number.
    BadDestQpn,
    /// 10: receiver not ready after the RNR retries.
    RnrRetryExceeded,
    /// 11: remote length error.
    RemoteBadLength,
    /// 12: remote bad status.
    RemoteBadStatus,
    /// 13: the remote did not respond.
    UnresponsiveRemote,
    /// 14: unknown peer.
    UnknownPeer,
    /// 15: unreachable remote.
    UnreachableRemote,
    /// 18: feature mismatch.
    FeatureMismatch,
}

impl Status {
    /// The EFA status code.
    pub fn code(self) -> u8 {
        match self {
            Status::Success => 0,
            Status::Flushed => 1,
            Status::LocalQpInternalError => 2,
            Status::UnsupportedOp => 3,
            Status::InvalidAh => 4,
            Status::InvalidLkey => 5,
            Status::LocalBadLength => 6,
            Status::RemoteBadAddress => 7,
            Status::RemoteAbort => 8,
            Status::BadDestQpn => 9,
            Status::RnrRetryExceeded => 10,
            Status::RemoteBadLength => 11,
            Status::RemoteBadStatus => 12,
            Status::UnresponsiveRemote => 13,
            Status::UnknownPeer => 14,
            Status::UnreachableRemote => 15,
            Status::FeatureMismatch => 18,
        }
    }

    /// The status of an EFA code; unknown codes give `None`.
    pub fn from_code(code: u8) -> Option<Status> {
        Some(match code {
            0 => Status::Success,
            1 => Status::Flushed,
            2 => Status::LocalQpInternalError,
            3 => Status::UnsupportedOp,
            4 => Status::InvalidAh,
            5 => Status::InvalidLkey,
            6 => Status::LocalBadLength,
            7 => Status::RemoteBadAddress,
            8 => Status::RemoteAbort,
            9 => Status::BadDestQpn,
            10 => Status::RnrRetryExceeded,
            11 => Status::RemoteBadLength,
            12 => Status::RemoteBadStatus,
            13 => Status::UnresponsiveRemote,
            14 => Status::UnknownPeer,
            15 => Status::UnreachableRemote,
            18 => Status::FeatureMismatch,
            _ => return None,
        })
    }

    /// True for [`Status::Success`].
    pub fn is_ok(self) -> bool {
        self == Status::Success
    }

    /// The error kind an application sees for this status (libfabric's `to_fi_errno`).
    pub fn error_kind(self) -> ErrorKind {
        match self {
            Status::Success => ErrorKind::Io,
            Status::Flushed => ErrorKind::Canceled,
            Status::LocalQpInternalError => ErrorKind::Io,
            Status::UnsupportedOp | Status::FeatureMismatch => ErrorKind::NotSupported,
            Status::InvalidAh | Status::InvalidLkey => ErrorKind::InvalidArgument,
            Status::LocalBadLength | Status::RemoteBadLength => ErrorKind::MsgSize,
            Status::RemoteBadAddress => ErrorKind::RemoteAccess,
            Status::RemoteAbort | Status::UnresponsiveRemote => ErrorKind::ConnectionAborted,
            Status::BadDestQpn | Status::UnknownPeer => ErrorKind::NotConnected,
            Status::RnrRetryExceeded => ErrorKind::NoRx,
            Status::RemoteBadStatus => ErrorKind::RemoteIo,
            Status::UnreachableRemote => ErrorKind::Unreachable,
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?} ({})", self.code())
    }
}

/// What a completion completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Opcode {
    /// A posted send.
    Send,
    /// A posted receive.
    Recv,
    /// An RDMA read this side initiated.
    RdmaRead,
    /// An RDMA write this side initiated.
    RdmaWrite,
    /// The target side of an RDMA write with immediate data.
    RecvRdmaWithImm,
}

/// The queue pair a received datagram came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Source {
    /// The sender's GID; [`Gid::UNKNOWN`] when the device knows only the queue pair number (an
    /// EFA receiver that holds no AH for the sender, on a CQ that cannot report source GIDs).
    /// The protocol engine then identifies the sender by the raw address its REQ packets carry,
    /// as libfabric does, and drops (and counts) anything else from it.
    pub gid: Gid,
    /// The sender's queue pair number.
    pub qpn: u16,
}

/// One device completion.
///
/// Buffers come back in `buf`: a receive buffer (filled, `len() == byte_len` on success), the local
/// buffer of an RDMA read (filled with the `byte_len` bytes read on success, untouched otherwise),
/// and the receive buffer an RDMA write with immediate data consumed at the target (handed back
/// untouched: the data went to the registered region). An RDMA write with immediate data that
/// consumed no buffer (devices with [`DeviceCaps::unsolicited_write_recv`]) completes at the
/// target with `wr_id` [`UNSOLICITED_WR_ID`] and no buffer.
#[derive(Debug)]
pub struct DeviceCompletion {
    /// The work request id given when posting.
    pub wr_id: u64,
    /// EFA status.
    pub status: Status,
    /// What completed.
    pub opcode: Opcode,
    /// Bytes received (receives) or transferred (RDMA; at the target of a write with immediate
    /// data, the bytes written).
    pub byte_len: usize,
    /// Sender of a received datagram.
    pub src: Option<Source>,
    /// Immediate data, when the sender (or RDMA writer) gave some.
    pub imm: Option<u32>,
    /// A buffer handed back: a receive buffer (its `len()` equals `byte_len` on success), the
    /// local buffer of an RDMA read, or the receive buffer an RDMA write with immediate data
    /// consumed.
    pub buf: Option<BytesMut>,
}

impl DeviceCompletion {
    /// A completion with no source, immediate data or buffer.
    pub fn new(wr_id: u64, status: Status, opcode: Opcode, byte_len: usize) -> DeviceCompletion {
        DeviceCompletion {
            wr_id,
            status,
            opcode,
            byte_len,
            src: None,
            imm: None,
            buf: None,
        }
    }
}

/// One datagram to send: a header and a payload segment (either may be empty), at most one MTU.
#[derive(Clone, Debug)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Destination queue pair; its `qkey` must match the destination's or the datagram is dropped.
    pub dest: RawAddr,
    /// First segment.
    pub hdr: Bytes,
    /// Second segment.
    pub payload: Bytes,
    /// Optional immediate data delivered with the receive completion.
    pub imm: Option<u32>,
}

impl SendWr {
    /// Total length of both segments.
    pub fn len(&self) -> usize {
        self.hdr.len() + self.payload.len()
    }

    /// True when both segments are empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A remote memory range for one-sided operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteIov {
    /// Address in the target's registered region (its virtual address space as the key defines it).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The remote key.
    pub key: u64,
}

/// One one-sided operation of a list ([`QueuePair::post_rdma_list`]).
#[derive(Debug)]
pub struct RdmaWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The target queue pair.
    pub dest: RawAddr,
    /// What to do.
    pub kind: RdmaKind,
}

/// The operation of an [`RdmaWr`]: the arguments of [`QueuePair::post_write`],
/// [`post_read`](QueuePair::post_read), [`post_write_region`](QueuePair::post_write_region) or
/// [`post_read_region`](QueuePair::post_read_region).
#[derive(Debug)]
pub enum RdmaKind {
    /// `post_write`.
    Write {
        /// The bytes.
        local: Bytes,
        /// Where they go.
        remote: RemoteIov,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// `post_read`.
    Read {
        /// The buffer the bytes land in.
        local: BytesMut,
        /// Where they come from.
        remote: RemoteIov,
    },
    /// `post_write_region`.
    WriteRegion {
        /// The slice of a registered region.
        local: RegionSlice,
        /// Where it goes.
        remote: RemoteIov,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// `post_read_region`.
    ReadRegion {
        /// The slice of a registered region the bytes land in.
        local: RegionSlice,
        /// Where they come from.
        remote: RemoteIov,
    },
}

impl RdmaKind {
    /// The error the [`QueuePair`] method of this kind returns on a device that lacks it
    /// (`NotSupported`, naming the method), as the trait's default does.
    pub(crate) fn not_supported(&self) -> Error {
        let op = match self {
            RdmaKind::Write { .. } => "post_write",
            RdmaKind::Read { .. } => "post_read",
            RdmaKind::WriteRegion { .. } => "post_write_region",
            RdmaKind::ReadRegion { .. } => "post_read_region",
        };
        Error::new(ErrorKind::NotSupported, op)
    }
}

/// Writes the `Debug` form of a queue pair that shows its address and type only: the struct
/// `name` with fields `addr` and `qp_type`, the rest elided.
pub(crate) fn fmt_qp(
    f: &mut fmt::Formatter<'_>,
    name: &str,
    addr: RawAddr,
    qp_type: QpType,
) -> fmt::Result {
    f.debug_struct(name)
        .field("addr", &addr)
        .field("qp_type", &qp_type)
        .finish_non_exhaustive()
}

/// Posts one one-sided operation on `qp` by the [`QueuePair`] method of its kind
/// ([`post_write`](QueuePair::post_write), [`post_read`](QueuePair::post_read),
/// [`post_write_region`](QueuePair::post_write_region) or
/// [`post_read_region`](QueuePair::post_read_region)).
#[inline]
pub(crate) fn post_rdma_wr<Q: QueuePair + ?Sized>(qp: &mut Q, wr: RdmaWr) -> Result<()> {
    let RdmaWr { wr_id, dest, kind } = wr;
    match kind {
        RdmaKind::Write { local, remote, imm } => qp.post_write(wr_id, dest, local, remote, imm),
        RdmaKind::Read { local, remote } => qp.post_read(wr_id, dest, local, remote),
        RdmaKind::WriteRegion { local, remote, imm } => {
            qp.post_write_region(wr_id, dest, local, remote, imm)
        }
        RdmaKind::ReadRegion { local, remote } => qp.post_read_region(wr_id, dest, local, remote),
    }
}

/// Implements the named one-sided posting methods of [`QueuePair`] (any of `post_read`,
/// `post_write`, `post_read_region`, `post_write_region`) inside an `impl QueuePair for …`
/// block whose type has a method `post_one_rdma(&mut self, wr: RdmaWr) -> Result<()>`: each
/// packs its arguments into an [`RdmaWr`] (the inverse of [`post_rdma_wr`]) and hands it over,
/// so a device writes its one-sided path once, for single posts and lists alike.
macro_rules! rdma_posts_by_wr {
    ($($method:ident),+ $(,)?) => {
        $($crate::device::rdma_posts_by_wr!(@one $method);)+
    };
    (@one post_read) => {
        fn post_read(&mut self, wr_id: u64, dest: $crate::addr::RawAddr, local: ::bytes::BytesMut,
            remote: $crate::device::RemoteIov) -> $crate::error::Result<()> {
            let kind = $crate::device::RdmaKind::Read { local, remote };
            self.post_one_rdma($crate::device::RdmaWr { wr_id, dest, kind })
        }
    };
    (@one post_write) => {
        fn post_write(&mut self, wr_id: u64, dest: $crate::addr::RawAddr, local: ::bytes::Bytes,
            remote: $crate::device::RemoteIov, imm: Option<u32>) -> $crate::error::Result<()> {
            let kind = $crate::device::RdmaKind::Write { local, remote, imm };
            self.post_one_rdma($crate::device::RdmaWr { wr_id, dest, kind })
        }
    };
    (@one post_read_region) => {
        fn post_read_region(&mut self, wr_id: u64, dest: $crate::addr::RawAddr,
            local: $crate::mem::RegionSlice, remote: $crate::device::RemoteIov)
            -> $crate::error::Result<()> {
            let kind = $crate::device::RdmaKind::ReadRegion { local, remote };
            self.post_one_rdma($crate::device::RdmaWr { wr_id, dest, kind })
        }
    };
    (@one post_write_region) => {
        fn post_write_region(&mut self, wr_id: u64, dest: $crate::addr::RawAddr,
            local: $crate::mem::RegionSlice, remote: $crate::device::RemoteIov,
            imm: Option<u32>) -> $crate::error::Result<()> {
            let kind = $crate::device::RdmaKind::WriteRegion { local, remote, imm };
            self.post_one_rdma($crate::device::RdmaWr { wr_id, dest, kind })
        }
    };
}
pub(crate) use rdma_posts_by_wr;

/// A NIC.
pub trait Device: Send + Sync + fmt::Debug {
    /// Attributes.
    fn attr(&self) -> &DeviceAttr;
    /// Creates a queue pair.
    fn create_qp(&self, attr: QpAttr) -> Result<Box<dyn QueuePair>>;
    /// Counters of every queue pair of this device.
    fn stats(&self) -> DeviceStats;
    /// Makes `mem` reachable by one-sided RDMA of peers, with `access` rights, and returns the
    /// key they name it by; `Ok(None)` when the device has no RDMA (the default; the domain then
    /// makes up a software key). The device keeps `mem` (an `Arc`) until
    /// [`deregister_mem`](Device::deregister_mem); a key must never name another region later.
    /// Called by [`Domain::register`](crate::Domain::register) for every region.
    fn register_mem(&self, _mem: &Arc<RegionMem>, _access: Access) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Revokes `key` (a key [`register_mem`](Device::register_mem) returned): later remote
    /// accesses with it fail with [`Status::RemoteBadAddress`]. Called when the region is closed
    /// or dropped, before its memory is handed back. The default does nothing.
    fn deregister_mem(&self, _key: u64) {}
    /// The interconnects the NIC uses for the registration `key` made
    /// ([`register_mem`](Device::register_mem) or
    /// [`register_device_mem`](Device::register_device_mem)): libfabric's `FI_EFA_DOMAIN_OPS`
    /// `query_mr`, rdma-core's `efadv_query_mr`. The default is `NotSupported`: only a NIC has
    /// interconnects.
    fn query_mem(&self, _key: u64) -> Result<MrQuery> {
        Err(Error::new(ErrorKind::NotSupported, "query_mr").with_detail(format!(
            "the {} device has no NIC registration to query: only the efa device's regions have \
             interconnect ids",
            self.attr().name
        )))
    }
    /// Registers device-only memory ([`RegionMem::dmabuf_device_only`]: a dmabuf the CPU has
    /// no mapping of) with the NIC, which alone reaches its bytes, and returns the key peers'
    /// device RDMA names it by; revoked by [`deregister_mem`](Device::deregister_mem) like the
    /// others. The default refuses with `NotSupported`: a device without a NIC that registers
    /// dmabufs (the software devices, which move bytes with the CPU) cannot serve it. Called
    /// by [`Domain::register_dmabuf_device_only`](crate::Domain::register_dmabuf_device_only).
    fn register_device_mem(&self, _mem: &Arc<RegionMem>, _access: Access) -> Result<u64> {
        Err(
            Error::new(ErrorKind::NotSupported, "register_dmabuf_device_only").with_detail(
                format!(
                    "the {} device has no NIC that reaches device memory (it moves bytes with \
                     the CPU): device-only regions need the efa device",
                    self.attr().name
                ),
            ),
        )
    }
    /// The shared-memory directory through which RDM endpoints on this device reach peers on
    /// this host directly, bypassing the packet protocol (their local fast path, like
    /// libfabric's shm provider under the EFA provider): the `shm` device's directory, or a
    /// routing device's. `None` (the default): no local path.
    fn local_dir(&self) -> Option<&std::path::Path> {
        None
    }
}

/// A queue pair: a send queue and a receive queue sharing one completion queue.
///
/// Posting never blocks: a full queue is `ErrorKind::Again`, a datagram larger than the MTU is
/// `ErrorKind::MsgSize`. Every posted work request produces exactly one completion, including
/// when the queue pair is closed ([`Status::Flushed`]).
pub trait QueuePair: Send + fmt::Debug {
    /// This queue pair's raw address.
    fn addr(&self) -> RawAddr;
    /// SRD or UD.
    fn qp_type(&self) -> QpType;
    /// Posts one datagram.
    fn post_send(&mut self, wr: SendWr) -> Result<()>;
    /// Posts the datagrams of `wrs` in order, as one list: like a chained `ibv_post_send` or
    /// sends under libfabric's `FI_MORE`, the device may ring its doorbell once for all of them
    /// (the udp device sends them with one `sendmmsg` system call per 64 datagrams). Posting
    /// takes work requests from the front of `wrs`. At the first one the device refuses (for
    /// the reasons [`post_send`](QueuePair::post_send) would), posting stops: that work request is
    /// dropped without a completion and its `wr_id` comes back with the error; the ones behind it
    /// stay in `wrs`, not posted. The default posts them one by one.
    ///
    /// ```
    /// use std::collections::VecDeque;
    /// use bytes::{Bytes, BytesMut};
    /// use efa::device::{Device, QpAttr, QpType, SendWr};
    /// use efa::device::udp::{UdpConfig, UdpDevice};
    ///
    /// # fn main() -> efa::Result<()> {
    /// let dev = UdpDevice::open(UdpConfig::default())?;
    /// let mut a = dev.create_qp(QpAttr::new(QpType::Srd))?;
    /// let mut b = dev.create_qp(QpAttr::new(QpType::Srd))?;
    /// for i in 0..8 {
    ///     b.post_recv(i, BytesMut::with_capacity(64))?;
    /// }
    /// let mut wrs: VecDeque<SendWr> = (0..8)
    ///     .map(|i| SendWr {
    ///         wr_id: 100 + i,
    ///         dest: b.addr(),
    ///         hdr: Bytes::new(),
    ///         payload: Bytes::from(vec![i as u8; 16]),
    ///         imm: None,
    ///     })
    ///     .collect();
    /// a.post_send_list(&mut wrs).map_err(|(_, e)| e)?;
    /// assert!(wrs.is_empty());
    /// let mut got = Vec::new();
    /// let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    /// while got.len() < 16 && std::time::Instant::now() < deadline {
    ///     a.poll(&mut got, 16);
    ///     b.poll(&mut got, 16);
    /// }
    /// assert_eq!(got.len(), 16);
    /// assert!(got.iter().all(|c| c.status.is_ok()));
    /// # Ok(()) }
    /// ```
    fn post_send_list(
        &mut self,
        wrs: &mut VecDeque<SendWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        while let Some(wr) = wrs.pop_front() {
            let wr_id = wr.wr_id;
            self.post_send(wr).map_err(|e| (wr_id, e))?;
        }
        Ok(())
    }
    /// Posts a receive buffer; its `capacity()` is the room offered. Buffers are consumed in
    /// the order they were posted, except on a routing device's SRD queue pairs
    /// ([`route`]), which split them between the primary path and the
    /// shm path (in order on each; see [`route::BASE_RECV`]).
    fn post_recv(&mut self, wr_id: u64, buf: BytesMut) -> Result<()>;
    /// Appends up to `max` completions to `out`, returning how many. Also makes progress.
    fn poll(&mut self, out: &mut Vec<DeviceCompletion>, max: usize) -> usize;
    /// Stops the queue pair: every outstanding work request completes with [`Status::Flushed`]
    /// (collect them with `poll`), later posts fail with `ErrorKind::Closed`.
    fn close(&mut self);
    /// Whether this queue pair was created with unsolicited write-recv: writes with immediate
    /// data complete at the target without consuming a posted receive. What the HANDSHAKE
    /// advertises (a device may have the capability while this queue pair does not use it).
    fn unsolicited_write_recv(&self) -> bool {
        false
    }
    /// Holds back (`hold`) or releases the queue pair `src`: while held, its new messages are
    /// refused with receiver-not-ready without taking a posted receive buffer (its sender backs
    /// off and retries), while other senders' go on; RDMA is not affected. The RDM engine holds a
    /// peer that buffers more than its share of unexpected data (issue 17, defect 2). Returns
    /// false when the device cannot (the default): the caller then relies on holding back every
    /// sender by posting no receive buffers.
    fn hold_source(&mut self, _src: Source, _hold: bool) -> bool {
        false
    }
    /// Changes the QKEY or the RNR retry count (see [`QpModify`]) before traffic starts; packets
    /// in flight are not re-keyed. The default is `NotSupported`. A hook of the emulated EFA NIC
    /// (feature `emu-hooks`), not for applications.
    #[cfg(any(test, feature = "emu-hooks"))]
    fn modify(&mut self, _m: QpModify) -> Result<()> {
        Err(Error::new(ErrorKind::NotSupported, "modify_qp"))
    }
    /// Posts a one-sided RDMA read of the `remote.len` bytes at `remote` (on the queue pair
    /// `dest`) into `local`, whose `capacity()` must hold them; its contents are replaced. The
    /// completion ([`Opcode::RdmaRead`]) hands `local` back in `buf`. A bad key, revoked key,
    /// range outside the region or missing `REMOTE_READ` right completes with
    /// [`Status::RemoteBadAddress`]. The default is `NotSupported`.
    fn post_read(
        &mut self,
        _wr_id: u64,
        _dest: RawAddr,
        _local: BytesMut,
        _remote: RemoteIov,
    ) -> Result<()> {
        Err(Error::new(ErrorKind::NotSupported, "post_read"))
    }
    /// Posts a one-sided RDMA write of `local` to `remote` (on the queue pair `dest`;
    /// `remote.len` must equal `local.len()`), with optional immediate data. The initiator's
    /// completion is [`Opcode::RdmaWrite`]; with immediate data the target also gets one
    /// ([`Opcode::RecvRdmaWithImm`], `imm`, `byte_len`), which consumes a posted receive buffer
    /// unless the device has [`DeviceCaps::unsolicited_write_recv`] (then `wr_id` is
    /// [`UNSOLICITED_WR_ID`]). A bad key, revoked key, range outside the region or missing
    /// `REMOTE_WRITE` right completes with [`Status::RemoteBadAddress`] and writes nothing. The
    /// default is `NotSupported`.
    fn post_write(
        &mut self,
        _wr_id: u64,
        _dest: RawAddr,
        _local: Bytes,
        _remote: RemoteIov,
        _imm: Option<u32>,
    ) -> Result<()> {
        Err(Error::new(ErrorKind::NotSupported, "post_write"))
    }
    /// Whether [`post_read_region`](QueuePair::post_read_region) and
    /// [`post_write_region`](QueuePair::post_write_region) work: the device reads and writes
    /// the memory of regions it registered ([`Device::register_mem`]) itself, with that
    /// registration (no copy, no registration per operation). Default false.
    fn region_rdma(&self) -> bool {
        false
    }
    /// Whether [`post_write_region`](QueuePair::post_write_region) works, where
    /// [`region_rdma`](QueuePair::region_rdma) may not (the udp device writes from regions, and
    /// reads into bytes). Default: [`region_rdma`](QueuePair::region_rdma).
    fn region_rdma_write(&self) -> bool {
        self.region_rdma()
    }
    /// As [`post_read`](QueuePair::post_read), into `local` (a slice of a region this device
    /// registered, at least `remote.len` bytes): the data lands in the region, and the
    /// completion hands back no buffer. `InvalidArgument` when the slice is not inside a live
    /// registration of `local.key` that allows local writes. The default is `NotSupported`.
    fn post_read_region(
        &mut self,
        _wr_id: u64,
        _dest: RawAddr,
        _local: RegionSlice,
        _remote: RemoteIov,
    ) -> Result<()> {
        Err(Error::new(ErrorKind::NotSupported, "post_read_region"))
    }
    /// As [`post_write`](QueuePair::post_write), from `local` (a slice of a region this device
    /// registered; `remote.len` must equal `local.len`). `InvalidArgument` when the slice is not
    /// inside a live registration of `local.key`. The default is `NotSupported`.
    fn post_write_region(
        &mut self,
        _wr_id: u64,
        _dest: RawAddr,
        _local: RegionSlice,
        _remote: RemoteIov,
        _imm: Option<u32>,
    ) -> Result<()> {
        Err(Error::new(ErrorKind::NotSupported, "post_write_region"))
    }
    /// Posts the one-sided operations at the front of `wrs` as one list, popping each one
    /// posted, like a chain of work requests behind one doorbell (`FI_MORE`): a device that can
    /// rings its doorbell, or makes its system call, once for the list (the udp device sends all
    /// their datagrams with one `sendmmsg` where the socket takes them). The first refusal stops
    /// the list: its `wr_id` and error come back, the rest stay in `wrs`. The default posts
    /// them one by one.
    fn post_rdma_list(
        &mut self,
        wrs: &mut VecDeque<RdmaWr>,
    ) -> std::result::Result<(), (u64, Error)> {
        while let Some(wr) = wrs.pop_front() {
            let wr_id = wr.wr_id;
            post_rdma_wr(self, wr).map_err(|e| (wr_id, e))?;
        }
        Ok(())
    }
}

/// Picks a random 31-bit QKEY (`val & 0x7fffffff`, never 0), as EFA does with `/dev/urandom`.
pub fn random_qkey() -> u32 {
    match (crate::random::secure_u64() as u32) & 0x7fff_ffff {
        0 => 1,
        k => k,
    }
}
