//! What two multi-rail groups exchange: the address bundle ([`RailAddr`]) and the key bundle of a
//! region registered on every rail ([`RailRemoteKey`]), each with a small, checked byte format.

use crate::addr::{RAW_ADDR_LEN, RawAddr};
use crate::error::{Error, ErrorKind, Result};

/// The most rails a group has (and a bundle carries).
pub const MAX_RAILS: usize = 64;

/// Magic and version of [`RailAddr::to_bytes`].
const ADDR_MAGIC: [u8; 3] = *b"RA1";
/// Magic and version of [`RailRemoteKey::to_bytes`].
const KEY_MAGIC: [u8; 3] = *b"RK1";

/// The address bundle of a multi-rail group: every rail's endpoint address, in rail order. Hand
/// it to the peer out of band (its [`to_bytes`](Self::to_bytes) form, or serde); the peer's
/// [`RailGroup::insert`](super::RailGroup::insert) turns it into one group peer id.
///
/// ```
/// # use efa::rail::RailAddr;
/// # use efa::{Gid, RawAddr};
/// let a = RailAddr::new(vec![RawAddr::new(Gid::UNKNOWN, 1, 7), RawAddr::new(Gid::UNKNOWN, 2, 9)])?;
/// let bytes = a.to_bytes();
/// assert_eq!(RailAddr::from_bytes(&bytes)?, a);
/// assert!(RailAddr::from_bytes(&bytes[..bytes.len() - 1]).is_err());
/// # Ok::<(), efa::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RailAddr {
    addrs: Vec<RawAddr>,
}

impl RailAddr {
    /// A bundle of 1 to [`MAX_RAILS`] addresses; `InvalidArgument` otherwise.
    pub fn new(addrs: Vec<RawAddr>) -> Result<RailAddr> {
        if addrs.is_empty() || addrs.len() > MAX_RAILS {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "rail_addr").with_detail(format!(
                    "a bundle holds 1 to {MAX_RAILS} addresses, not {}",
                    addrs.len()
                )),
            );
        }
        Ok(RailAddr { addrs })
    }

    /// The rails' addresses, in rail order.
    pub fn addrs(&self) -> &[RawAddr] {
        &self.addrs
    }

    /// The bundle as bytes: `RA1`, the count, then each 32-byte raw address.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(4 + self.addrs.len() * RAW_ADDR_LEN);
        v.extend_from_slice(&ADDR_MAGIC);
        v.push(self.addrs.len() as u8);
        for a in &self.addrs {
            v.extend_from_slice(&a.to_bytes());
        }
        v
    }

    /// Parses [`to_bytes`](Self::to_bytes)' form; anything else is `InvalidArgument`.
    pub fn from_bytes(b: &[u8]) -> Result<RailAddr> {
        let bad =
            |why: String| Error::new(ErrorKind::InvalidArgument, "rail_addr").with_detail(why);
        if b.len() < 4 || b[..3] != ADDR_MAGIC {
            return Err(bad("not a rail address bundle (no RA1 header)".into()));
        }
        let n = b[3] as usize;
        if b.len() != 4 + n * RAW_ADDR_LEN {
            return Err(bad(format!(
                "a bundle of {n} addresses is {} bytes, not {}",
                4 + n * RAW_ADDR_LEN,
                b.len()
            )));
        }
        let addrs = b[4..]
            .chunks_exact(RAW_ADDR_LEN)
            .map(RawAddr::from_bytes)
            .collect::<Result<Vec<_>>>()?;
        RailAddr::new(addrs)
    }
}

/// The keys a peer needs to reach a region registered on every rail of a group
/// ([`RailRegion::remote_key`](super::RailRegion::remote_key)): the address of its first byte
/// and its length (the same on every rail: one memory), and one key per rail, in rail order.
/// Send it to the peer ([`to_bytes`](Self::to_bytes), or serde); the peer's striped
/// [`write`](super::RailGroup::write) and [`read`](super::RailGroup::read) use key `i` on rail
/// `i`.
///
/// ```
/// # use efa::rail::RailRemoteKey;
/// let rk = RailRemoteKey { addr: 0x1000, len: 4096, keys: vec![7, 8, 9] };
/// assert_eq!(RailRemoteKey::from_bytes(&rk.to_bytes())?, rk);
/// assert_eq!(rk.at(16, 1), efa::RmaAddr { addr: 0x1010, key: 8 });
/// # Ok::<(), efa::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RailRemoteKey {
    /// Address of the region's first byte, in the keys' address space.
    pub addr: u64,
    /// Length of the region, bytes.
    pub len: u64,
    /// One key per rail.
    pub keys: Vec<u64>,
}

impl RailRemoteKey {
    /// Where `offset` bytes into the region lie for rail `rail` (not checked here: the target
    /// refuses an access outside the region; a rail without a key gets key 0, which no region
    /// has).
    pub fn at(&self, offset: u64, rail: usize) -> crate::RmaAddr {
        crate::RmaAddr {
            addr: self.addr.wrapping_add(offset),
            key: self.keys.get(rail).copied().unwrap_or(0),
        }
    }

    /// The bundle as bytes: `RK1`, the count, the address, the length, then each key
    /// (little-endian).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(20 + 8 * self.keys.len());
        self.encode(&mut v);
        v
    }

    pub(super) fn encode(&self, v: &mut Vec<u8>) {
        v.extend_from_slice(&KEY_MAGIC);
        v.push(self.keys.len().min(MAX_RAILS) as u8);
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        for k in self.keys.iter().take(MAX_RAILS) {
            v.extend_from_slice(&k.to_le_bytes());
        }
    }

    /// Parses [`to_bytes`](Self::to_bytes)' form; anything else is `InvalidArgument`.
    pub fn from_bytes(b: &[u8]) -> Result<RailRemoteKey> {
        match RailRemoteKey::decode(b) {
            Some((k, [])) => Ok(k),
            _ => Err(Error::new(ErrorKind::InvalidArgument, "rail_remote_key")
                .with_detail(format!("{} bytes are no rail key bundle", b.len()))),
        }
    }

    /// A bundle at the start of `b`, and the bytes after it.
    pub(super) fn decode(b: &[u8]) -> Option<(RailRemoteKey, &[u8])> {
        if b.len() < 20 || b[..3] != KEY_MAGIC {
            return None;
        }
        let n = b[3] as usize;
        if n > MAX_RAILS {
            return None;
        }
        let u64_at = |i: usize| super::wire::le64(b, i);
        let addr = u64_at(4)?;
        let len = u64_at(12)?;
        let keys = (0..n)
            .map(|i| u64_at(20 + 8 * i))
            .collect::<Option<Vec<_>>>()?;
        Some((RailRemoteKey { addr, len, keys }, &b[20 + 8 * n..]))
    }
}
