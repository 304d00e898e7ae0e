//! Endpoint types, the bit flags (`FI_*` capabilities, message order, MR mode, mode) and the
//! named constants (threading, progress, ...), each parsed from and printed as libfabric names.

use super::*;

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
pub(super) fn parse_flags(
    s: &str,
    prefix: &str,
    names: &[(u64, &'static str)],
    what: &str,
) -> Result<u64> {
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
pub(super) fn write_flags(
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

            /// Every flag this type names.
            pub const fn all() -> Self {
                $name(0 $(| $bit)*)
            }
            /// From libfabric's bit values; bits this type does not name are dropped.
            pub const fn from_bits_truncate(bits: u64) -> Self {
                $name(bits & Self::all().0)
            }
            /// True when `self` and `other` share a flag.
            pub const fn intersects(self, other: Self) -> bool {
                self.0 & other.0 != 0
            }
            /// The libfabric names of the set flags, in bit order.
            pub fn names(self) -> impl Iterator<Item = &'static str> {
                Self::NAMES
                    .iter()
                    .filter(move |(b, _)| self.0 & b == *b)
                    .map(|(_, n)| *n)
            }
        }

        bit_ops!($name: u64);
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
