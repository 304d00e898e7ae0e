//! Discovery, as `fi_getinfo`: [`getinfo`] turns [`Hints`] into one [`Info`] per usable
//! (device, endpoint type), each with the attributes libfabric's EFA provider reports, printable
//! like `fi_info` ([`Info`]'s `Display`, [`Info::verbose`]) and serializable with serde.
//!
//! Devices are listed in this order: `efa` NICs (cargo feature `efa`), then `udp`, then `shm`
//! (Linux), then `loopback`. For each device, RDM (`Endpoint<Rdm>`) comes before DGRAM
//! (`Endpoint<Dgram>`); see [`Info::for_device`] for the attributes of each.
//!
//! ```
//! use efa::{Caps, EpType};
//!
//! let want: Caps = "FI_MSG, FI_SOURCE".parse().unwrap();
//! assert!(want.contains(Caps::MSG) && !want.contains(Caps::TAGGED));
//! assert_eq!(want.to_string(), "[ FI_MSG, FI_SOURCE ]");
//! assert_eq!("dgram".parse::<EpType>().unwrap(), EpType::Dgram);
//! assert_eq!(EpType::Rdm.to_string(), "FI_EP_RDM");
//! ```

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;
use std::sync::Arc;

use crate::addr::RawAddr;
use crate::config::Config;
use crate::device::registry::{self, Discovery, PROVIDERS, Provider, Query};
pub use crate::device::spec::DeviceSpec;
use crate::device::{Device, DeviceAttr, DeviceKind};
use crate::error::{Error, ErrorKind, Result};
use crate::topo::{Distance, Near, Topology};

/// The provider version `fi_info` prints: this crate's `major.minor`.
pub const PROVIDER_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION_MAJOR"),
    ".",
    env!("CARGO_PKG_VERSION_MINOR")
);

/// Bytes a libfabric EFA DGRAM application reserves in front of every buffer when it asks for
/// [`Mode::MSG_PREFIX`] (the UD GRH area).
pub const DGRAM_MSG_PREFIX_SIZE: usize = 40;

/// Largest RDM REQ packet header (bytes): base + raw address + CQ data + 4 RMA iovs.
const RDM_MAX_HDR_SIZE: usize = 168;
/// The shm provider's inject limit, which bounds RDM inject when shm transfer is on.
const SHM_MAX_INJECT_SIZE: usize = 4096;
/// RDM endpoints accept this many iovs per operation (segmentation in software).
pub(crate) const RDM_IOV_LIMIT: usize = 4;
/// `FI_TAG_GENERIC`.
const TAG_GENERIC: u64 = 0xaaaa_aaaa_aaaa_aaaa;

// ---------------------------------------------------------------------------------------------
// Endpoint type
// ---------------------------------------------------------------------------------------------

/// Endpoint type (`enum fi_ep_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum EpType {
    /// `FI_EP_RDM`: reliable, unconnected, any message size, send-after-send ordering.
    #[serde(rename = "FI_EP_RDM", alias = "rdm")]
    Rdm,
    /// `FI_EP_DGRAM`: unreliable datagrams of at most one MTU, no ordering.
    #[serde(rename = "FI_EP_DGRAM", alias = "dgram")]
    Dgram,
}

impl EpType {
    /// `FI_EP_RDM` or `FI_EP_DGRAM`.
    pub fn as_str(self) -> &'static str {
        match self {
            EpType::Rdm => "FI_EP_RDM",
            EpType::Dgram => "FI_EP_DGRAM",
        }
    }
}

impl fmt::Display for EpType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EpType {
    type Err = Error;

    /// `rdm` / `dgram` (as `fi_info -e`), or `FI_EP_RDM` / `FI_EP_DGRAM`; case-insensitive.
    fn from_str(s: &str) -> Result<EpType> {
        let u = s.trim().to_ascii_uppercase();
        match u.strip_prefix("FI_EP_").unwrap_or(&u) {
            "RDM" => Ok(EpType::Rdm),
            "DGRAM" => Ok(EpType::Dgram),
            _ => Err(Error::new(ErrorKind::InvalidArgument, "EpType::from_str")
                .with_detail(format!("expected rdm or dgram, got {s:?}"))),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bit flags (capabilities, message order, MR mode, mode)
// ---------------------------------------------------------------------------------------------

/// Parses `FI_MSG | fi_tagged, MSG` or `[ FI_MSG, FI_SOURCE ]` against a name table.
fn parse_flags(s: &str, prefix: &str, names: &[(u64, &'static str)], what: &str) -> Result<u64> {
    let mut bits = 0;
    let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
    for tok in inner.split(|c: char| c == ',' || c == '|' || c.is_whitespace()) {
        if tok.is_empty() {
            continue;
        }
        let up = tok.to_ascii_uppercase();
        let full = if up.starts_with(prefix) {
            up
        } else {
            format!("{prefix}{up}")
        };
        match names.iter().find(|(_, n)| *n == full) {
            Some((b, _)) => bits |= b,
            None => {
                return Err(Error::new(ErrorKind::InvalidArgument, "parse flags")
                    .with_detail(format!("unknown {what} {tok:?}")));
            }
        }
    }
    Ok(bits)
}

/// Writes `[ FI_A, FI_B ]` (`[  ]` when empty), as `fi_tostr` does; unknown bits as hex.
fn write_flags(
    f: &mut fmt::Formatter<'_>,
    bits: u64,
    names: &[(u64, &'static str)],
) -> fmt::Result {
    f.write_str("[ ")?;
    let mut rest = bits;
    let mut first = true;
    for (b, n) in names {
        if bits & b == *b && *b != 0 {
            if !first {
                f.write_str(", ")?;
            }
            f.write_str(n)?;
            first = false;
            rest &= !b;
        }
    }
    if rest != 0 {
        if !first {
            f.write_str(", ")?;
        }
        write!(f, "{rest:#x}")?;
    }
    f.write_str(" ]")
}

macro_rules! flags {
    (
        $(#[$m:meta])*
        $name:ident, prefix $prefix:literal, what $what:literal {
            $( $(#[$cm:meta])* $c:ident = $bit:expr => $s:literal; )*
        }
    ) => {
        $(#[$m])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(u64);

        impl $name {
            $( $(#[$cm])* pub const $c: $name = $name($bit); )*
            const NAMES: &'static [(u64, &'static str)] = &[$(($bit, $s)),*];

            /// No flag.
            pub const fn empty() -> Self {
                $name(0)
            }
            /// Every flag this type names.
            pub const fn all() -> Self {
                $name(0 $(| $bit)*)
            }
            /// libfabric's bit values.
            pub const fn bits(self) -> u64 {
                self.0
            }
            /// From libfabric's bit values; bits this type does not name are dropped.
            pub const fn from_bits_truncate(bits: u64) -> Self {
                $name(bits & Self::all().0)
            }
            /// True when every flag of `other` is set in `self`.
            pub const fn contains(self, other: Self) -> bool {
                self.0 & other.0 == other.0
            }
            /// True when `self` and `other` share a flag.
            pub const fn intersects(self, other: Self) -> bool {
                self.0 & other.0 != 0
            }
            /// True when no flag is set.
            pub const fn is_empty(self) -> bool {
                self.0 == 0
            }
            /// The libfabric names of the set flags, in bit order.
            pub fn names(self) -> impl Iterator<Item = &'static str> {
                Self::NAMES
                    .iter()
                    .filter(move |(b, _)| self.0 & b == *b)
                    .map(|(_, n)| *n)
            }
        }

        impl std::ops::BitOr for $name {
            type Output = $name;
            fn bitor(self, rhs: $name) -> $name {
                $name(self.0 | rhs.0)
            }
        }
        impl std::ops::BitOrAssign for $name {
            fn bitor_assign(&mut self, rhs: $name) {
                self.0 |= rhs.0;
            }
        }
        impl std::ops::BitAnd for $name {
            type Output = $name;
            fn bitand(self, rhs: $name) -> $name {
                $name(self.0 & rhs.0)
            }
        }
        impl std::ops::Sub for $name {
            type Output = $name;
            /// The flags of `self` that are not in `rhs`.
            fn sub(self, rhs: $name) -> $name {
                $name(self.0 & !rhs.0)
            }
        }
        impl fmt::Display for $name {
            /// `[ NAME, NAME ]`, as `fi_info -v` prints flags.
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_flags(f, self.0, Self::NAMES)
            }
        }
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self)
            }
        }
        impl FromStr for $name {
            type Err = Error;
            /// Names separated by `,`, `|` or spaces, optionally inside `[ ]`; case-insensitive,
            #[doc = concat!("the `", $prefix, "` prefix optional.")]
            fn from_str(s: &str) -> Result<$name> {
                parse_flags(s, $prefix, Self::NAMES, $what).map($name)
            }
        }
        impl serde::Serialize for $name {
            /// A list of names.
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.collect_seq(self.names())
            }
        }
        impl<'de> serde::Deserialize<'de> for $name {
            /// A list of names, or one string that [`FromStr`] accepts.
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<$name, D::Error> {
                #[derive(serde::Deserialize)]
                #[serde(untagged)]
                enum Repr {
                    List(Vec<String>),
                    One(String),
                }
                let s = match Repr::deserialize(d)? {
                    Repr::List(v) => v.join(","),
                    Repr::One(s) => s,
                };
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

flags! {
    /// Capabilities (`fi_info.caps`), with libfabric's bit values.
    ///
    /// Hints name the capabilities an application needs; [`getinfo`] lists only (device,
    /// endpoint type) pairs that have all of them. `DELIVERY_COMPLETE` is an operation flag in
    /// libfabric; it is listed here so that an application can require it (RDM has it).
    ///
    /// ```
    /// use efa::Caps;
    /// let c = Caps::MSG | Caps::SOURCE;
    /// assert!(c.contains(Caps::MSG));
    /// assert_eq!(c.to_string(), "[ FI_MSG, FI_SOURCE ]");
    /// assert_eq!("msg|source".parse::<Caps>().unwrap(), c);
    /// ```
    Caps, prefix "FI_", what "capability" {
        /// `FI_MSG`: two-sided messages.
        MSG = 1 << 1 => "FI_MSG";
        /// `FI_RMA`: one-sided read and write.
        RMA = 1 << 2 => "FI_RMA";
        /// `FI_TAGGED`: tagged messages.
        TAGGED = 1 << 3 => "FI_TAGGED";
        /// `FI_ATOMIC`: atomic operations.
        ATOMIC = 1 << 4 => "FI_ATOMIC";
        /// `FI_READ`: initiate reads.
        READ = 1 << 8 => "FI_READ";
        /// `FI_WRITE`: initiate writes.
        WRITE = 1 << 9 => "FI_WRITE";
        /// `FI_RECV`: receive messages.
        RECV = 1 << 10 => "FI_RECV";
        /// `FI_SEND`: send messages.
        SEND = 1 << 11 => "FI_SEND";
        /// `FI_REMOTE_READ`: be the target of reads.
        REMOTE_READ = 1 << 12 => "FI_REMOTE_READ";
        /// `FI_REMOTE_WRITE`: be the target of writes.
        REMOTE_WRITE = 1 << 13 => "FI_REMOTE_WRITE";
        /// `FI_MULTI_RECV`: one receive buffer for several messages.
        MULTI_RECV = 1 << 16 => "FI_MULTI_RECV";
        /// `FI_REMOTE_CQ_DATA`: immediate data delivered to the target's completion.
        REMOTE_CQ_DATA = 1 << 17 => "FI_REMOTE_CQ_DATA";
        /// `FI_DELIVERY_COMPLETE`: complete a send once the data reached the target buffer.
        DELIVERY_COMPLETE = 1 << 28 => "FI_DELIVERY_COMPLETE";
        /// `FI_HMEM`: device (GPU) memory.
        HMEM = 1 << 47 => "FI_HMEM";
        /// `FI_LOCAL_COMM`: talk to endpoints on the same host.
        LOCAL_COMM = 1 << 51 => "FI_LOCAL_COMM";
        /// `FI_REMOTE_COMM`: talk to endpoints on other hosts.
        REMOTE_COMM = 1 << 52 => "FI_REMOTE_COMM";
        /// `FI_SOURCE`: completions carry the sender's address.
        SOURCE = 1 << 57 => "FI_SOURCE";
        /// `FI_DIRECTED_RECV`: receives that match one sender only.
        DIRECTED_RECV = 1 << 59 => "FI_DIRECTED_RECV";
    }
}

flags! {
    /// Message ordering guarantees (`tx_attr.msg_order` / `rx_attr.msg_order`).
    MsgOrder, prefix "FI_ORDER_", what "message order" {
        /// `FI_ORDER_SAS`: send after send.
        SAS = 1 << 8 => "FI_ORDER_SAS";
        /// `FI_ORDER_ATOMIC_RAR`: atomic read after read.
        ATOMIC_RAR = 1 << 36 => "FI_ORDER_ATOMIC_RAR";
        /// `FI_ORDER_ATOMIC_RAW`: atomic read after write.
        ATOMIC_RAW = 1 << 37 => "FI_ORDER_ATOMIC_RAW";
        /// `FI_ORDER_ATOMIC_WAR`: atomic write after read.
        ATOMIC_WAR = 1 << 38 => "FI_ORDER_ATOMIC_WAR";
        /// `FI_ORDER_ATOMIC_WAW`: atomic write after write.
        ATOMIC_WAW = 1 << 39 => "FI_ORDER_ATOMIC_WAW";
    }
}

flags! {
    /// Memory registration mode (`domain_attr.mr_mode`).
    MrMode, prefix "FI_MR_", what "MR mode" {
        /// `FI_MR_LOCAL`: local buffers must be registered.
        LOCAL = 1 << 2 => "FI_MR_LOCAL";
        /// `FI_MR_VIRT_ADDR`: remote addresses are virtual addresses.
        VIRT_ADDR = 1 << 4 => "FI_MR_VIRT_ADDR";
        /// `FI_MR_ALLOCATED`: only allocated memory can be registered.
        ALLOCATED = 1 << 5 => "FI_MR_ALLOCATED";
        /// `FI_MR_PROV_KEY`: the provider chooses the keys.
        PROV_KEY = 1 << 6 => "FI_MR_PROV_KEY";
        /// `FI_MR_HMEM`: device memory must be registered.
        HMEM = 1 << 10 => "FI_MR_HMEM";
    }
}

flags! {
    /// Mode bits: requirements the provider puts on the application (`fi_info.mode`).
    Mode, prefix "FI_", what "mode" {
        /// `FI_MSG_PREFIX`: every DGRAM buffer starts with [`DGRAM_MSG_PREFIX_SIZE`] reserved
        /// bytes, as on libfabric's EFA DGRAM endpoints.
        MSG_PREFIX = 1 << 58 => "FI_MSG_PREFIX";
    }
}

// ---------------------------------------------------------------------------------------------
// Named constants (threading, progress, ...)
// ---------------------------------------------------------------------------------------------

macro_rules! named {
    ($(#[$m:meta])* $name:ident { $( $(#[$vm:meta])* $v:ident => $s:literal ),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
        pub enum $name {
            $( $(#[$vm])* #[serde(rename = $s)] $v, )*
        }
        impl $name {
            /// The libfabric name.
            pub fn as_str(self) -> &'static str {
                match self { $( $name::$v => $s, )* }
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

named! {
    /// Threading model (`domain_attr.threading`).
    Threading {
        /// `FI_THREAD_SAFE`: every object may be used from any thread (RDM).
        Safe => "FI_THREAD_SAFE",
        /// `FI_THREAD_DOMAIN`: one thread at a time per domain (DGRAM: `Send`, not `Sync`).
        Domain => "FI_THREAD_DOMAIN",
    }
}

named! {
    /// Progress model (`domain_attr.progress`).
    Progress {
        /// `FI_PROGRESS_MANUAL`: the application drives progress by polling its completion
        /// queues (the crate also offers an optional progress thread).
        Manual => "FI_PROGRESS_MANUAL",
        /// `FI_PROGRESS_AUTO`: the provider progresses by itself.
        Auto => "FI_PROGRESS_AUTO",
    }
}

named! {
    /// Resource management (`domain_attr.resource_mgmt`).
    ResourceMgmt {
        /// `FI_RM_ENABLED`: the provider queues when the peer has no room (RDM).
        Enabled => "FI_RM_ENABLED",
        /// `FI_RM_DISABLED`: overruns are the application's problem (DGRAM).
        Disabled => "FI_RM_DISABLED",
    }
}

named! {
    /// Address vector type (`domain_attr.av_type`).
    AvType {
        /// `FI_AV_TABLE`: addresses are indices, in insertion order.
        Table => "FI_AV_TABLE",
    }
}

// ---------------------------------------------------------------------------------------------
// Attributes
// ---------------------------------------------------------------------------------------------

/// Transmit attributes (`fi_tx_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TxAttr {
    /// Capabilities of the transmit side.
    pub caps: Caps,
    /// Outstanding transmit operations before `Again`.
    pub size: usize,
    /// Largest inject (buffer reusable on return), bytes.
    pub inject_size: usize,
    /// Segments per send.
    pub iov_limit: usize,
    /// Remote segments per RMA operation.
    pub rma_iov_limit: usize,
    /// Ordering guarantees.
    pub msg_order: MsgOrder,
    /// Largest message, bytes (same as [`EpAttr::max_msg_size`]).
    pub max_msg_size: u64,
}

/// Receive attributes (`fi_rx_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RxAttr {
    /// Capabilities of the receive side.
    pub caps: Caps,
    /// Posted receives before `Again`.
    pub size: usize,
    /// Segments per receive.
    pub iov_limit: usize,
    /// Ordering guarantees.
    pub msg_order: MsgOrder,
    /// Bytes buffered for unexpected messages beyond the provider's own (always 0).
    pub total_buffered_recv: usize,
}

/// Endpoint attributes (`fi_ep_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EpAttr {
    /// Largest message, bytes: unlimited for RDM (`u64::MAX`), one MTU for DGRAM.
    pub max_msg_size: u64,
    /// Bytes the application reserves in front of each DGRAM buffer: 0, or
    /// [`DGRAM_MSG_PREFIX_SIZE`] when the info carries [`Mode::MSG_PREFIX`].
    pub msg_prefix_size: usize,
    /// Tag format: `FI_TAG_GENERIC` (`0xaaaa_aaaa_aaaa_aaaa`) for RDM, 0 without tags.
    pub mem_tag_format: u64,
    /// Transmit contexts per endpoint.
    pub tx_ctx_cnt: usize,
    /// Receive contexts per endpoint.
    pub rx_ctx_cnt: usize,
}

/// Domain attributes (`fi_domain_attr`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DomainAttr {
    /// Domain name (= [`Info::domain`]).
    pub name: String,
    /// Threading model.
    pub threading: Threading,
    /// Data progress.
    pub progress: Progress,
    /// Control progress.
    pub control_progress: Progress,
    /// Resource management.
    pub resource_mgmt: ResourceMgmt,
    /// Address vector type.
    pub av_type: AvType,
    /// Memory registration mode.
    pub mr_mode: MrMode,
    /// Bytes of a remote key.
    pub mr_key_size: usize,
    /// Bytes of immediate (CQ) data.
    pub cq_data_size: usize,
    /// Segments per memory registration.
    pub mr_iov_limit: usize,
    /// Domain capabilities.
    pub caps: Caps,
}

// ---------------------------------------------------------------------------------------------
// Hints
// ---------------------------------------------------------------------------------------------

/// What the application wants (`fi_getinfo` hints), built with chained calls.
///
/// ```
/// use efa::{Caps, EpType, Hints};
/// let hints = Hints::new()
///     .provider("udp")
///     .ep_type(EpType::Dgram)
///     .caps(Caps::MSG | Caps::SOURCE)
///     .addr("127.0.0.1".parse().unwrap());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Hints {
    provider: Option<String>,
    ep_type: Option<EpType>,
    caps: Caps,
    mode: Mode,
    addr: Option<IpAddr>,
    config: Option<Config>,
    domain: Option<String>,
    near: Option<Near>,
    max_distance: Option<Distance>,
    topology: Option<Arc<Topology>>,
}

impl Hints {
    /// No constraints: every device and endpoint type, configuration from the environment.
    pub fn new() -> Hints {
        Hints::default()
    }

    /// Only this provider (device kind): `efa`, `udp`, `shm` or `loopback` (case-insensitive).
    pub fn provider(mut self, name: &str) -> Hints {
        self.provider = Some(name.to_string());
        self
    }

    /// Only this endpoint type.
    pub fn ep_type(mut self, ep_type: EpType) -> Hints {
        self.ep_type = Some(ep_type);
        self
    }

    /// Capabilities the application needs; entries lacking any of them are left out.
    pub fn caps(mut self, caps: Caps) -> Hints {
        self.caps = caps;
        self
    }

    /// Modes the application supports. With [`Mode::MSG_PREFIX`], DGRAM entries ask for a
    /// [`DGRAM_MSG_PREFIX_SIZE`]-byte prefix in every buffer as libfabric's EFA does; without it
    /// (the default), they need none.
    pub fn mode(mut self, mode: Mode) -> Hints {
        self.mode = mode;
        self
    }

    /// Local IP address the `udp` device binds (default `127.0.0.1`).
    pub fn addr(mut self, addr: IpAddr) -> Hints {
        self.addr = Some(addr);
        self
    }

    /// Use this configuration instead of reading `FI_EFA_*` from the environment.
    pub fn config(mut self, config: Config) -> Hints {
        self.config = Some(config);
        self
    }

    /// Only the device with this name (`udp-127.0.0.1`) or domain name (`udp-127.0.0.1-dgrm`),
    /// as `fi_info -d`.
    pub fn domain(mut self, name: &str) -> Hints {
        self.domain = Some(name.to_string());
        self
    }

    /// Order the NICs by their distance from `target` (a GPU's PCI bus id, or a NUMA node),
    /// nearest first, as [`Topology::nics_near`] ranks them; each listed NIC's
    /// [`Info::distance`] says how far it is. Devices without a PCI location (`udp`, `shm`,
    /// `loopback`) keep their order after the NICs, with no distance. The topology is read
    /// from sysfs ([`Topology::detect`]) unless [`Hints::topology`] gives one; a target it
    /// does not have is a `NoData` error.
    ///
    /// ```no_run
    /// use efa::topo::Near;
    /// let gpu = "0000:53:00.0".parse()?;
    /// let infos = efa::getinfo(&efa::Hints::new().provider("efa").near(Near::Device(gpu)))?;
    /// let nearest = &infos[0]; // the NIC closest to that GPU
    /// # Ok::<(), efa::Error>(())
    /// ```
    pub fn near(mut self, target: Near) -> Hints {
        self.near = Some(target);
        self
    }

    /// With [`Hints::near`]: leave out NICs farther from the target than `max` (only the
    /// NICs under the GPU's own PCI switch with [`Distance::Pix`]); devices without a PCI
    /// location are kept.
    pub fn max_distance(mut self, max: Distance) -> Hints {
        self.max_distance = Some(max);
        self
    }

    /// The host topology [`Hints::near`] ranks by, instead of reading sysfs.
    pub fn topology(mut self, topology: Topology) -> Hints {
        self.topology = Some(Arc::new(topology));
        self
    }

    /// Orders `out` by distance from [`Hints::near`]'s target (when set), filling in
    /// [`Info::distance`] and leaving out NICs beyond [`Hints::max_distance`].
    fn rank(&self, out: &mut Vec<Info>) -> Result<()> {
        let Some(target) = &self.near else {
            return Ok(());
        };
        let detected;
        let topo = match &self.topology {
            Some(t) => &**t,
            None => {
                detected = Topology::detect()?;
                &detected
            }
        };
        // The target must exist (this also checks a NUMA node).
        topo.nics_near(target)?;
        for info in out.iter_mut() {
            let by_addr = info
                .device
                .pci_addr
                .as_deref()
                .and_then(|a| a.parse().ok())
                .and_then(|a| topo.nics().iter().find(|n| n.addr == a));
            let nic = by_addr.or_else(|| topo.nic(&info.device.name));
            info.distance = nic.and_then(|n| topo.distance(n, target));
        }
        if let Some(max) = self.max_distance {
            out.retain(|i| i.distance.is_none_or(|d| d <= max));
        }
        // Stable: equally far NICs, and the devices without a distance, keep their order.
        out.sort_by_key(|i| (i.distance.is_none(), i.distance));
        Ok(())
    }

    fn describe(&self, config: &Config) -> String {
        let mut parts = Vec::new();
        if let Some(p) = &self.provider {
            parts.push(format!("provider {p}"));
        }
        if let Some(t) = self.ep_type {
            parts.push(format!("endpoint type {t}"));
        }
        if !self.caps.is_empty() {
            parts.push(format!("caps {}", self.caps));
        }
        if let Some(d) = &self.domain {
            parts.push(format!("domain {d}"));
        }
        if let (Some(n), Some(d)) = (&self.near, self.max_distance) {
            parts.push(format!("within {d} of {n}"));
        }
        if config.iface.trim() != "all" {
            parts.push(format!("FI_EFA_IFACE={}", config.iface));
        }
        if parts.is_empty() {
            "no device found".to_string()
        } else {
            format!("nothing matches {}", parts.join(", "))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Info
// ---------------------------------------------------------------------------------------------

/// One usable (device, endpoint type): what `fi_getinfo` returns, with the attributes the EFA
/// provider reports. Open a domain on it; `Display` prints it like `fi_info`,
/// [`verbose`](Info::verbose) like `fi_info -v`, serde serializes every attribute.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Info {
    /// The device kind (`fi_info` "provider").
    pub provider: DeviceKind,
    /// Fabric name (the provider name).
    pub fabric: String,
    /// Domain name: the device name with `-rdm` or `-dgrm` appended, as EFA names them.
    pub domain: String,
    /// Provider version ([`PROVIDER_VERSION`]).
    pub version: &'static str,
    /// Endpoint type.
    pub ep_type: EpType,
    /// Capabilities.
    pub caps: Caps,
    /// Requirements on the application.
    pub mode: Mode,
    /// Address format: `FI_ADDR_EFA` (32-byte raw addresses).
    pub addr_format: &'static str,
    /// Bytes of an endpoint address.
    pub addrlen: usize,
    /// Wire protocol: `FI_PROTO_EFA`.
    pub protocol: &'static str,
    /// Protocol version: 4 for RDM (EFA RDM protocol v4), 1 for DGRAM (as libfabric reports).
    pub protocol_version: u32,
    /// Transmit attributes.
    pub tx_attr: TxAttr,
    /// Receive attributes.
    pub rx_attr: RxAttr,
    /// Endpoint attributes.
    pub ep_attr: EpAttr,
    /// Domain attributes.
    pub domain_attr: DomainAttr,
    /// The device's attributes (MTU, queue depths, PCI address, NUMA node, capabilities).
    pub device: DeviceAttr,
    /// The runtime configuration endpoints opened from this info use.
    pub config: Config,
    /// How to open the device.
    #[serde(skip)]
    pub spec: DeviceSpec,
    /// How far the device is from the target of [`Hints::near`]; `None` without that hint
    /// and for devices without a PCI location (`udp`, `shm`, `loopback`).
    pub distance: Option<Distance>,
    /// The device opened during discovery, shared by every domain opened on this info.
    #[serde(skip)]
    handle: Option<Arc<dyn Device>>,
}

impl Info {
    /// The info of endpoint type `ep_type` on a device with attributes `device`, as the EFA
    /// provider builds it (`efa_prov_info_alloc` / `_for_rdm`). [`getinfo`] uses it; tests and
    /// tools can use it with hand-made attributes. It does not open the device:
    /// [`open_device`](Info::open_device) opens one from `spec`.
    ///
    /// DGRAM: caps `MSG|SEND|RECV|SOURCE|LOCAL_COMM|REMOTE_COMM`, `max_msg_size` = MTU, inject
    /// = the device's inline size, iov limit = its SGE count, no ordering, `FI_THREAD_DOMAIN`,
    /// `FI_RM_DISABLED`. RDM adds tagged, RMA, atomics, multi-receive, directed receive and
    /// delivery complete; unlimited messages, send-after-send order, iov limit 4,
    /// `FI_THREAD_SAFE`, `FI_RM_ENABLED`, sizes from `FI_EFA_TX_SIZE`/`FI_EFA_RX_SIZE`.
    /// Both use manual progress.
    pub fn for_device(
        kind: DeviceKind,
        device: &DeviceAttr,
        ep_type: EpType,
        config: Config,
        spec: DeviceSpec,
    ) -> Info {
        let caps = Info::ep_caps(ep_type);
        let iov = device.max_sge.max(1);
        let dev_tx = rounddown_pow2(device.max_send_wr);
        let dev_rx = rounddown_pow2(device.max_recv_wr / iov);
        let mr_base = MrMode::ALLOCATED | MrMode::PROV_KEY | MrMode::VIRT_ADDR;
        let domain_caps = Caps::LOCAL_COMM | Caps::REMOTE_COMM;
        let tx_caps = Caps::MSG | Caps::SEND;
        let rx_caps = Caps::MSG | Caps::RECV | Caps::SOURCE;
        let (tx_attr, rx_attr, ep_attr, domain_attr, protocol_version);
        match ep_type {
            EpType::Dgram => {
                let max_msg_size = device.mtu as u64;
                tx_attr = TxAttr {
                    caps: tx_caps,
                    size: dev_tx,
                    inject_size: device.inline_size,
                    iov_limit: device.max_sge,
                    rma_iov_limit: 0,
                    msg_order: MsgOrder::empty(),
                    max_msg_size,
                };
                rx_attr = RxAttr {
                    caps: rx_caps,
                    size: dev_rx,
                    iov_limit: device.max_sge,
                    msg_order: MsgOrder::empty(),
                    total_buffered_recv: 0,
                };
                ep_attr = EpAttr {
                    max_msg_size,
                    msg_prefix_size: 0,
                    mem_tag_format: 0,
                    tx_ctx_cnt: 1,
                    rx_ctx_cnt: 1,
                };
                domain_attr = (Threading::Domain, ResourceMgmt::Disabled, mr_base);
                protocol_version = 1;
            }
            EpType::Rdm => {
                let order = MsgOrder::SAS
                    | MsgOrder::ATOMIC_RAR
                    | MsgOrder::ATOMIC_RAW
                    | MsgOrder::ATOMIC_WAR
                    | MsgOrder::ATOMIC_WAW;
                let inject = rdm_inject_size(device, &config);
                let pick = |env: usize, dev: usize| if env > 0 { env } else { dev };
                tx_attr = TxAttr {
                    caps: tx_caps
                        | Caps::TAGGED
                        | Caps::RMA
                        | Caps::ATOMIC
                        | Caps::READ
                        | Caps::WRITE
                        | Caps::DELIVERY_COMPLETE
                        | Caps::HMEM,
                    size: pick(config.tx_size, dev_tx),
                    inject_size: inject,
                    iov_limit: RDM_IOV_LIMIT,
                    rma_iov_limit: 1,
                    msg_order: order,
                    max_msg_size: u64::MAX,
                };
                rx_attr = RxAttr {
                    caps: rx_caps
                        | Caps::TAGGED
                        | Caps::RMA
                        | Caps::ATOMIC
                        | Caps::REMOTE_READ
                        | Caps::REMOTE_WRITE
                        | Caps::MULTI_RECV
                        | Caps::DIRECTED_RECV
                        | Caps::HMEM,
                    size: pick(config.rx_size, dev_rx),
                    iov_limit: RDM_IOV_LIMIT,
                    msg_order: order,
                    total_buffered_recv: 0,
                };
                ep_attr = EpAttr {
                    max_msg_size: u64::MAX,
                    msg_prefix_size: 0,
                    mem_tag_format: TAG_GENERIC,
                    tx_ctx_cnt: 1,
                    rx_ctx_cnt: 1,
                };
                // FI_HMEM: device memory as dmabuf regions (`Domain::register_dmabuf`), which
                // must be registered (FI_MR_HMEM).
                domain_attr = (
                    Threading::Safe,
                    ResourceMgmt::Enabled,
                    mr_base | MrMode::HMEM,
                );
                protocol_version = 4;
            }
        }
        let domain = format!("{}{}", device.name, domain_suffix(ep_type));
        let (threading, resource_mgmt, mr_mode) = domain_attr;
        Info {
            provider: kind,
            fabric: kind.name().to_string(),
            domain: domain.clone(),
            version: PROVIDER_VERSION,
            ep_type,
            caps,
            mode: Mode::empty(),
            addr_format: "FI_ADDR_EFA",
            addrlen: crate::addr::RAW_ADDR_LEN,
            protocol: "FI_PROTO_EFA",
            protocol_version,
            tx_attr,
            rx_attr,
            ep_attr,
            domain_attr: DomainAttr {
                name: domain,
                threading,
                progress: Progress::Manual,
                control_progress: Progress::Manual,
                resource_mgmt,
                av_type: AvType::Table,
                mr_mode,
                mr_key_size: 8,
                cq_data_size: 4,
                mr_iov_limit: 1,
                caps: domain_caps,
            },
            device: device.clone(),
            config,
            spec,
            distance: None,
            handle: None,
        }
    }

    /// The capabilities an endpoint type offers on every device.
    pub fn ep_caps(ep_type: EpType) -> Caps {
        let dgram = Caps::MSG
            | Caps::SEND
            | Caps::RECV
            | Caps::SOURCE
            | Caps::LOCAL_COMM
            | Caps::REMOTE_COMM;
        match ep_type {
            EpType::Dgram => dgram,
            EpType::Rdm => {
                dgram
                    | Caps::TAGGED
                    | Caps::RMA
                    | Caps::ATOMIC
                    | Caps::READ
                    | Caps::WRITE
                    | Caps::REMOTE_READ
                    | Caps::REMOTE_WRITE
                    | Caps::MULTI_RECV
                    | Caps::DIRECTED_RECV
                    | Caps::DELIVERY_COMPLETE
                    | Caps::HMEM
            }
        }
    }

    /// Sets [`Mode::MSG_PREFIX`] and the 40-byte prefix on a DGRAM info (no effect on RDM).
    pub fn with_msg_prefix(mut self) -> Info {
        if self.ep_type == EpType::Dgram {
            self.mode |= Mode::MSG_PREFIX;
            self.ep_attr.msg_prefix_size = DGRAM_MSG_PREFIX_SIZE;
        }
        self
    }

    /// The device to open domains on: the one discovery opened, or a new one from
    /// [`spec`](Info::spec) for an info built with [`Info::for_device`].
    pub fn open_device(&self) -> Result<Arc<dyn Device>> {
        match &self.handle {
            Some(d) => Ok(d.clone()),
            None => self.spec.open_configured(&self.config),
        }
    }

    /// A displayable `fi_info -v`-style listing of every attribute.
    pub fn verbose(&self) -> Verbose<'_> {
        Verbose(self)
    }
}

impl fmt::Display for Info {
    /// The short form of `fi_info` (without `-v`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "provider: {}", self.provider)?;
        writeln!(f, "    fabric: {}", self.fabric)?;
        writeln!(f, "    domain: {}", self.domain)?;
        writeln!(f, "    version: {}", self.version)?;
        writeln!(f, "    type: {}", self.ep_type)?;
        write!(f, "    protocol: {}", self.protocol)
    }
}

/// Every attribute of an [`Info`], laid out like `fi_info -v`; from [`Info::verbose`].
#[derive(Clone, Copy, Debug)]
pub struct Verbose<'a>(&'a Info);

impl fmt::Display for Verbose<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.0;
        let d = &i.device;
        let opt = |v: Option<String>| v.unwrap_or_else(|| "(null)".to_string());
        writeln!(f, "---")?;
        writeln!(f, "fi_info:")?;
        writeln!(f, "    caps: {}", i.caps)?;
        writeln!(f, "    mode: {}", i.mode)?;
        writeln!(f, "    addr_format: {}", i.addr_format)?;
        writeln!(f, "    src_addrlen: {}", i.addrlen)?;
        writeln!(f, "    src_addr: {}", RawAddr::new(d.gid, 0, 0))?;
        writeln!(f, "    fi_tx_attr:")?;
        writeln!(f, "        caps: {}", i.tx_attr.caps)?;
        writeln!(f, "        msg_order: {}", i.tx_attr.msg_order)?;
        writeln!(f, "        inject_size: {}", i.tx_attr.inject_size)?;
        writeln!(f, "        size: {}", i.tx_attr.size)?;
        writeln!(f, "        iov_limit: {}", i.tx_attr.iov_limit)?;
        writeln!(f, "        rma_iov_limit: {}", i.tx_attr.rma_iov_limit)?;
        writeln!(f, "    fi_rx_attr:")?;
        writeln!(f, "        caps: {}", i.rx_attr.caps)?;
        writeln!(f, "        msg_order: {}", i.rx_attr.msg_order)?;
        writeln!(f, "        size: {}", i.rx_attr.size)?;
        writeln!(f, "        iov_limit: {}", i.rx_attr.iov_limit)?;
        writeln!(
            f,
            "        total_buffered_recv: {}",
            i.rx_attr.total_buffered_recv
        )?;
        writeln!(f, "    fi_ep_attr:")?;
        writeln!(f, "        type: {}", i.ep_type)?;
        writeln!(f, "        protocol: {}", i.protocol)?;
        writeln!(f, "        protocol_version: {}", i.protocol_version)?;
        writeln!(f, "        max_msg_size: {}", i.ep_attr.max_msg_size)?;
        writeln!(f, "        msg_prefix_size: {}", i.ep_attr.msg_prefix_size)?;
        writeln!(f, "        mem_tag_format: {:#x}", i.ep_attr.mem_tag_format)?;
        writeln!(f, "        tx_ctx_cnt: {}", i.ep_attr.tx_ctx_cnt)?;
        writeln!(f, "        rx_ctx_cnt: {}", i.ep_attr.rx_ctx_cnt)?;
        let da = &i.domain_attr;
        writeln!(f, "    fi_domain_attr:")?;
        writeln!(f, "        name: {}", da.name)?;
        writeln!(f, "        threading: {}", da.threading)?;
        writeln!(f, "        progress: {}", da.progress)?;
        writeln!(f, "        control_progress: {}", da.control_progress)?;
        writeln!(f, "        resource_mgmt: {}", da.resource_mgmt)?;
        writeln!(f, "        av_type: {}", da.av_type)?;
        writeln!(f, "        mr_mode: {}", da.mr_mode)?;
        writeln!(f, "        mr_key_size: {}", da.mr_key_size)?;
        writeln!(f, "        cq_data_size: {}", da.cq_data_size)?;
        writeln!(f, "        mr_iov_limit: {}", da.mr_iov_limit)?;
        writeln!(f, "        caps: {}", da.caps)?;
        writeln!(f, "    fi_fabric_attr:")?;
        writeln!(f, "        name: {}", i.fabric)?;
        writeln!(f, "        prov_name: {}", i.provider)?;
        writeln!(f, "        prov_version: {}", i.version)?;
        writeln!(f, "    nic:")?;
        writeln!(f, "        fi_device_attr:")?;
        writeln!(f, "            name: {}", d.name)?;
        writeln!(f, "            kind: {}", d.kind)?;
        writeln!(f, "            gid: {}", d.gid)?;
        writeln!(f, "            max_send_wr: {}", d.max_send_wr)?;
        writeln!(f, "            max_recv_wr: {}", d.max_recv_wr)?;
        writeln!(f, "            max_sge: {}", d.max_sge)?;
        writeln!(f, "            inline_size: {}", d.inline_size)?;
        writeln!(f, "            max_rdma_size: {}", d.max_rdma_size)?;
        writeln!(f, "            rdma_read: {}", d.caps.rdma_read)?;
        writeln!(f, "            rdma_write: {}", d.caps.rdma_write)?;
        writeln!(
            f,
            "            unsolicited_write_recv: {}",
            d.caps.unsolicited_write_recv
        )?;
        writeln!(f, "            rnr_retry: {}", d.caps.rnr_retry)?;
        writeln!(f, "        fi_bus_attr:")?;
        writeln!(f, "            pci_addr: {}", opt(d.pci_addr.clone()))?;
        writeln!(
            f,
            "            numa_node: {}",
            opt(d.numa_node.map(|n| n.to_string()))
        )?;
        if let Some(dist) = i.distance {
            writeln!(f, "            distance: {dist}")?;
        }
        writeln!(f, "        fi_link_attr:")?;
        write!(f, "            mtu: {}", d.mtu)
    }
}

/// The largest RDM inject (`tx_attr.inject_size`): what fits one packet after the largest
/// header, at most the shm provider's inject size when shm transfer is on (as libfabric's EFA
/// provider reports it), and 0 when a packet holds less than a header's worth.
pub(crate) fn rdm_inject_size(device: &DeviceAttr, config: &Config) -> usize {
    let payload = device.mtu.saturating_sub(RDM_MAX_HDR_SIZE);
    let inject = if config.enable_shm_transfer {
        payload.min(SHM_MAX_INJECT_SIZE)
    } else {
        payload
    };
    if inject < RDM_MAX_HDR_SIZE { 0 } else { inject }
}

fn domain_suffix(ep_type: EpType) -> &'static str {
    match ep_type {
        EpType::Rdm => "-rdm",
        EpType::Dgram => "-dgrm",
    }
}

fn rounddown_pow2(n: usize) -> usize {
    match n {
        0 => 0,
        n => 1 << (usize::BITS - 1 - n.leading_zeros()),
    }
}

// ---------------------------------------------------------------------------------------------
// getinfo
// ---------------------------------------------------------------------------------------------

/// Lists every usable (device, endpoint type) that matches `hints`, like `fi_getinfo`.
///
/// Order: `efa` NICs (with the `efa` feature), then `udp` (bound to [`Hints::addr`], default
/// `127.0.0.1`), then `shm` (on Linux, segments in `/dev/shm`), then `loopback`; per device RDM
/// before DGRAM. The configuration is the hints' (validated) or [`Config::from_env`]; an invalid
/// `FI_EFA_*` value is returned as its `Config` error. Devices not allowed by `FI_EFA_IFACE` or
/// the domain hint, and endpoint types lacking a requested capability, are left out; when
/// nothing is left the error is `NoData`, naming what was asked. With [`Hints::near`], NICs
/// come first ordered by their distance from a GPU or NUMA node (see there).
#[doc(alias = "fi_getinfo")]
pub fn getinfo(hints: &Hints) -> Result<Vec<Info>> {
    let config = match &hints.config {
        Some(c) => {
            c.validate()?;
            c.clone()
        }
        None => Config::from_env()?,
    };
    let no_data = |why: String| Error::new(ErrorKind::NoData, "getinfo").with_detail(why);

    let providers: Vec<&Provider> = match hints.provider.as_deref() {
        None => PROVIDERS.iter().collect(),
        Some(p) => {
            let p = p.trim().to_ascii_lowercase();
            let Some(kind) = DeviceKind::ALL.into_iter().find(|k| k.name() == p) else {
                let known: Vec<&str> = DeviceKind::ALL.iter().map(|k| k.name()).collect();
                return Err(no_data(format!(
                    "no provider named {p:?} (known: {})",
                    known.join(", ")
                )));
            };
            let Some(provider) = registry::provider(kind) else {
                return Err(no_data(match kind {
                    DeviceKind::Efa => "the efa device needs the cargo feature `efa`".to_string(),
                    _ => format!("the {kind} device is not available in this release"),
                }));
            };
            vec![provider]
        }
    };

    // Endpoint types that are offered, wanted, and have the wanted caps.
    let ep_types: Vec<EpType> = [EpType::Rdm, EpType::Dgram]
        .into_iter()
        .filter(|t| hints.ep_type.is_none_or(|want| want == *t))
        .filter(|t| Info::ep_caps(*t).contains(hints.caps))
        .collect();
    if ep_types.is_empty() {
        return Err(no_data(hints.describe(&config)));
    }

    let mut out = Vec::new();
    let mut first_err = None;
    let mut notes: Vec<&'static str> = Vec::new();
    let query = Query {
        bind: hints.addr.unwrap_or(Ipv4Addr::LOCALHOST.into()),
        config: &config,
    };
    for p in providers {
        let devices = match (p.discover)(&query) {
            Discovery::Found(d) => d,
            Discovery::Nothing(why) => {
                notes.push(why);
                continue;
            }
            Discovery::Unavailable(e) => {
                tracing::warn!(device = %p.kind, error = %e, "getinfo: cannot open device; skipped");
                first_err.get_or_insert(e);
                continue;
            }
            Discovery::Fatal(e) => return Err(e),
        };
        for (spec, device) in devices {
            if config.iface_allows(&device.attr().name) {
                push_infos(&mut out, hints, &config, &ep_types, &spec, &device);
            }
        }
    }
    hints.rank(&mut out)?;
    if out.is_empty() {
        return Err(first_err.unwrap_or_else(|| {
            let mut why = hints.describe(&config);
            for n in notes {
                why.push_str("; ");
                why.push_str(n);
            }
            no_data(why)
        }));
    }
    Ok(out)
}

/// Appends the infos of one device: one per endpoint type, unless the domain hint excludes it.
fn push_infos(
    out: &mut Vec<Info>,
    hints: &Hints,
    config: &Config,
    ep_types: &[EpType],
    spec: &DeviceSpec,
    device: &Arc<dyn Device>,
) {
    let attr = device.attr();
    for &t in ep_types {
        let domain = format!("{}{}", attr.name, domain_suffix(t));
        let domain_ok = hints
            .domain
            .as_ref()
            .is_none_or(|want| *want == attr.name || *want == domain);
        if !domain_ok {
            continue;
        }
        let mut info = Info::for_device(spec.kind(), attr, t, config.clone(), spec.clone());
        info.handle = Some(device.clone());
        if hints.mode.contains(Mode::MSG_PREFIX) {
            info = info.with_msg_prefix();
        }
        out.push(info);
    }
}
