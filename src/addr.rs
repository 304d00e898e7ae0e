//! EFA's 32-byte raw endpoint address (`struct efa_ep_addr`) and its 16-byte GID.
//!
//! Layout (little-endian): `gid[16] @0`, `qpn u16 @16`, `pad u16 @18`, `qkey u32 @20`, `reserved[8] @24`.
//! Software devices use an IPv6 (or IPv4-mapped IPv6) address as the GID.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use crate::error::{Error, ErrorKind, Result};

/// Length of a raw address on the wire and from `Endpoint::addr` (`EFA_EP_ADDR_LEN`).
pub const RAW_ADDR_LEN: usize = 32;

/// A 16-byte global identifier: an IPv6 address, or an IPv4-mapped IPv6 address for IPv4 devices.
///
/// With serde it is text (`"::ffff:127.0.0.1"`, as it prints) in human-readable formats such as
/// JSON, and its 16 bytes in binary ones; both forms are read back.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl serde::Serialize for Gid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> serde::Deserialize<'de> for Gid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Gid, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Form {
            Text(String),
            Bytes([u8; 16]),
        }
        if d.is_human_readable() {
            match Form::deserialize(d)? {
                Form::Text(t) => t
                    .parse::<IpAddr>()
                    .map(Gid::from_ip)
                    .map_err(|_| serde::de::Error::custom(format!("{t:?} is not a GID"))),
                Form::Bytes(b) => Ok(Gid(b)),
            }
        } else {
            <[u8; 16]>::deserialize(d).map(Gid)
        }
    }
}

impl Gid {
    /// All zeros: in a [`Source`](crate::device::Source), a sender whose GID the device could
    /// not tell (an EFA receiver holding no AH for it, on a CQ without source-GID reporting).
    pub const UNKNOWN: Gid = Gid([0; 16]);

    /// Whether this is [`Gid::UNKNOWN`].
    pub fn is_unknown(&self) -> bool {
        *self == Gid::UNKNOWN
    }

    /// The GID of an IP address (IPv4 becomes IPv4-mapped `::ffff:a.b.c.d`).
    pub fn from_ip(ip: IpAddr) -> Gid {
        match ip {
            IpAddr::V4(v4) => Gid(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Gid(v6.octets()),
        }
    }

    /// The IP address this GID stands for (IPv4-mapped GIDs give IPv4).
    pub fn to_ip(&self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.0);
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }
}

impl From<IpAddr> for Gid {
    fn from(ip: IpAddr) -> Gid {
        Gid::from_ip(ip)
    }
}

impl From<Ipv4Addr> for Gid {
    fn from(ip: Ipv4Addr) -> Gid {
        Gid::from_ip(IpAddr::V4(ip))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", Ipv6Addr::from(self.0))
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// An endpoint's raw address: GID, queue pair number and QKEY (the connection id, "connid").
///
/// It prints and parses as `efa://[<gid>]:<qpn>:<qkey hex>`:
///
/// ```
/// use efa::RawAddr;
/// let a = RawAddr::new("127.0.0.1".parse::<std::net::IpAddr>().unwrap().into(), 4791, 0x1234);
/// let s = a.to_string();
/// assert_eq!(s, "efa://[::ffff:127.0.0.1]:4791:00001234");
/// assert_eq!(s.parse::<RawAddr>().unwrap(), a);
/// assert_eq!(RawAddr::from_bytes(&a.to_bytes()).unwrap(), a);
/// ```
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize,
)]
#[doc(alias = "fi_av_straddr")]
pub struct RawAddr {
    /// The device's global identifier.
    pub gid: Gid,
    /// The queue pair number (a UDP port on the udp device).
    pub qpn: u16,
    /// The QKEY of the queue pair; EFA uses it as the connection id that tells a restarted peer apart.
    pub qkey: u32,
}

impl RawAddr {
    /// A raw address from its parts.
    pub fn new(gid: Gid, qpn: u16, qkey: u32) -> RawAddr {
        RawAddr { gid, qpn, qkey }
    }

    /// The 32-byte wire form (reserved bytes zero).
    pub fn to_bytes(&self) -> [u8; RAW_ADDR_LEN] {
        let mut b = [0u8; RAW_ADDR_LEN];
        b[..16].copy_from_slice(&self.gid.0);
        b[16..18].copy_from_slice(&self.qpn.to_le_bytes());
        b[20..24].copy_from_slice(&self.qkey.to_le_bytes());
        b
    }

    /// Parses the 32-byte wire form; reserved and pad bytes are ignored.
    pub fn from_bytes(b: &[u8]) -> Result<RawAddr> {
        if b.len() < RAW_ADDR_LEN {
            return Err(Error::new(ErrorKind::InvalidArgument, "raw_addr")
                .with_detail(format!("{} bytes, need {RAW_ADDR_LEN}", b.len())));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[..16]);
        Ok(RawAddr {
            gid: Gid(gid),
            qpn: u16::from_le_bytes([b[16], b[17]]),
            qkey: u32::from_le_bytes([b[20], b[21], b[22], b[23]]),
        })
    }

    /// True when both name the same queue pair, whatever the QKEY (same GID and QPN).
    pub fn same_qp(&self, other: &RawAddr) -> bool {
        self.gid == other.gid && self.qpn == other.qpn
    }
}

impl fmt::Display for RawAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "efa://[{}]:{}:{:08x}", self.gid, self.qpn, self.qkey)
    }
}

impl fmt::Debug for RawAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for RawAddr {
    type Err = Error;

    fn from_str(s: &str) -> Result<RawAddr> {
        let bad = || {
            Error::new(ErrorKind::InvalidArgument, "raw_addr_parse")
                .with_detail(format!("{s:?} is not efa://[<gid>]:<qpn>:<qkey hex>"))
        };
        let rest = s.strip_prefix("efa://[").ok_or_else(bad)?;
        let (gid, rest) = rest.split_once("]:").ok_or_else(bad)?;
        let (qpn, qkey) = rest.split_once(':').ok_or_else(bad)?;
        let ip: IpAddr = gid.parse().map_err(|_| bad())?;
        Ok(RawAddr {
            gid: Gid::from_ip(ip),
            qpn: qpn.parse().map_err(|_| bad())?,
            qkey: u32::from_str_radix(qkey, 16).map_err(|_| bad())?,
        })
    }
}
