//! Memory registration: [`MemoryRegion`] owns its buffer, carries a key, and is moved into the
//! operations that use it (and handed back in their completions). A region registered for remote
//! access can be described to a peer with a serializable [`RemoteKey`]; dropping or closing the
//! region revokes the key before the memory is released, so no peer can reach freed memory.

use std::collections::HashMap;
use std::fmt;
use std::ops::{BitOr, BitOrAssign, Deref, DerefMut};

use bytes::BytesMut;
use parking_lot::Mutex;

use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};

/// Access rights of a memory region (`FI_SEND`, `FI_RECV`, `FI_READ`, `FI_WRITE`,
/// `FI_REMOTE_READ`, `FI_REMOTE_WRITE`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct Access(u32);

impl Access {
    /// Local source of sends.
    pub const SEND: Access = Access(1);
    /// Local target of receives.
    pub const RECV: Access = Access(2);
    /// Local target of RMA reads this side initiates.
    pub const READ: Access = Access(4);
    /// Local source of RMA writes this side initiates.
    pub const WRITE: Access = Access(8);
    /// Peers may read it.
    pub const REMOTE_READ: Access = Access(16);
    /// Peers may write it.
    pub const REMOTE_WRITE: Access = Access(32);
    /// Every local access.
    pub const LOCAL: Access = Access(1 | 2 | 4 | 8);
    /// Both remote accesses.
    pub const REMOTE: Access = Access(16 | 32);

    const NAMES: [(Access, &'static str); 6] = [
        (Access::SEND, "FI_SEND"),
        (Access::RECV, "FI_RECV"),
        (Access::READ, "FI_READ"),
        (Access::WRITE, "FI_WRITE"),
        (Access::REMOTE_READ, "FI_REMOTE_READ"),
        (Access::REMOTE_WRITE, "FI_REMOTE_WRITE"),
    ];

    /// No access at all.
    pub const fn empty() -> Access {
        Access(0)
    }

    /// True when every right of `other` is in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when no right is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// True when peers may read or write.
    pub const fn is_remote(self) -> bool {
        self.0 & Access::REMOTE.0 != 0
    }

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

impl BitOrAssign for Access {
    fn bitor_assign(&mut self, o: Access) {
        self.0 |= o.0;
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Access::NAMES
            .iter()
            .filter(|(a, _)| self.contains(*a))
            .map(|(_, n)| *n)
            .collect();
        write!(f, "[{}]", names.join(" | "))
    }
}

/// Buffers a [`MemoryRegion`] can own: `BytesMut`, `Vec<u8>` and `Box<[u8]>` (taken without
/// copying).
pub trait IntoRegionBuf {
    /// The buffer as `BytesMut`.
    fn into_region_buf(self) -> BytesMut;
}

impl IntoRegionBuf for BytesMut {
    fn into_region_buf(self) -> BytesMut {
        self
    }
}

impl IntoRegionBuf for Vec<u8> {
    fn into_region_buf(self) -> BytesMut {
        // A uniquely owned `Bytes` converts back without copying.
        bytes::Bytes::from(self)
            .try_into_mut()
            .unwrap_or_else(|b| BytesMut::from(&b[..]))
    }
}

impl IntoRegionBuf for Box<[u8]> {
    fn into_region_buf(self) -> BytesMut {
        Vec::from(self).into_region_buf()
    }
}

/// What a peer needs to access a region: its address, length and key (`FI_MR_VIRT_ADDR` style:
/// `addr` is the region's address in its owner's address space). Exchange it out of band; it
/// serializes with serde.
///
/// ```
/// # use efa::{Domain, Access, RemoteKey};
/// # fn main() -> efa::Result<()> {
/// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
/// let mr = domain.register(vec![0u8; 4096], Access::REMOTE_READ | Access::REMOTE_WRITE)?;
/// let rk: RemoteKey = mr.remote_key()?;
/// assert_eq!(rk.len, 4096);
/// let json = serde_json::to_string(&rk).unwrap();
/// assert_eq!(serde_json::from_str::<RemoteKey>(&json).unwrap(), rk);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RemoteKey {
    /// Start address of the region.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The key.
    pub key: u64,
}

#[derive(Clone, Copy, Debug)]
struct MrEntry {
    addr: u64,
    len: u64,
    access: Access,
}

/// The keys a domain has handed out and not yet revoked.
#[derive(Debug)]
pub(crate) struct MrTable {
    next_key: u64,
    live: HashMap<u64, MrEntry>,
}

impl MrTable {
    pub(crate) fn new() -> Mutex<MrTable> {
        Mutex::new(MrTable {
            next_key: 1,
            live: HashMap::new(),
        })
    }
}

/// Checks a remote access against the key table of `table`: the key must be live, the range
/// inside the region and the access granted. Errors are `ErrorKind::RemoteAccess`.
pub(crate) fn verify(
    table: &Mutex<MrTable>,
    key: u64,
    addr: u64,
    len: u64,
    access: Access,
) -> Result<()> {
    let t = table.lock();
    let e = t.live.get(&key).ok_or_else(|| {
        Error::new(ErrorKind::RemoteAccess, "mr_verify")
            .with_detail(format!("key {key:#x} is not registered"))
    })?;
    let end = addr.checked_add(len);
    if addr < e.addr || end.is_none_or(|end| end > e.addr + e.len) {
        return Err(
            Error::new(ErrorKind::RemoteAccess, "mr_verify").with_detail(format!(
                "range {addr:#x}+{len} outside region {:#x}+{}",
                e.addr, e.len
            )),
        );
    }
    if !e.access.contains(access) {
        return Err(
            Error::new(ErrorKind::RemoteAccess, "mr_verify").with_detail(format!(
                "access {access:?} not granted (region has {:?})",
                e.access
            )),
        );
    }
    Ok(())
}

/// A registered memory region that owns its buffer.
///
/// Move it into an operation (`Endpoint::recv`, `Endpoint::send`) and get it back from the
/// completion. Dropping it (or [`MemoryRegion::close`]) revokes its key first.
pub struct MemoryRegion {
    buf: BytesMut,
    key: u64,
    access: Access,
    domain: Domain,
}

impl MemoryRegion {
    pub(crate) fn register(domain: &Domain, buf: BytesMut, access: Access) -> Result<MemoryRegion> {
        if buf.is_empty() {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "mr_reg").with_detail(
                    "cannot register an empty buffer (give it a length, not only capacity)",
                ),
            );
        }
        if access.is_empty() {
            return Err(Error::new(ErrorKind::InvalidArgument, "mr_reg")
                .with_detail("access flags are empty"));
        }
        let entry = MrEntry {
            addr: buf.as_ptr() as usize as u64,
            len: buf.len() as u64,
            access,
        };
        let key = {
            let mut t = domain.mr_table().lock();
            let key = t.next_key;
            t.next_key += 1;
            t.live.insert(key, entry);
            key
        };
        tracing::debug!(key, len = entry.len, ?access, "mr_reg");
        Ok(MemoryRegion {
            buf,
            key,
            access,
            domain: domain.clone(),
        })
    }

    /// The key.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The access rights.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The domain it is registered with.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// The description a peer needs for remote access. `InvalidArgument` unless the region was
    /// registered with `REMOTE_READ` or `REMOTE_WRITE`.
    pub fn remote_key(&self) -> Result<RemoteKey> {
        if !self.access.is_remote() {
            return Err(Error::new(ErrorKind::InvalidArgument, "mr_remote_key")
                .with_detail("region was not registered for remote access"));
        }
        Ok(RemoteKey {
            addr: self.buf.as_ptr() as usize as u64,
            len: self.buf.len() as u64,
            key: self.key,
        })
    }

    /// Revokes the key and hands the buffer back.
    pub fn close(mut self) -> BytesMut {
        self.revoke();
        std::mem::take(&mut self.buf)
    }

    fn revoke(&mut self) {
        if self.key != 0 {
            self.domain.mr_table().lock().live.remove(&self.key);
            tracing::debug!(key = self.key, "mr_close");
            self.key = 0;
        }
    }

    /// Checks that this region may serve as `needed` for an operation of `op`.
    pub(crate) fn check_local(
        &self,
        domain: &Domain,
        needed: Access,
        op: &'static str,
    ) -> Result<()> {
        if !domain.same(&self.domain) {
            return Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail("memory region belongs to another domain"));
        }
        if !self.access.contains(needed) {
            return Err(Error::new(ErrorKind::InvalidArgument, op)
                .with_detail(format!("memory region lacks {needed:?} access")));
        }
        Ok(())
    }
}

impl Deref for MemoryRegion {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for MemoryRegion {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("key", &self.key)
            .field("len", &self.buf.len())
            .field("access", &self.access)
            .finish()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.revoke();
    }
}
