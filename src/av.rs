//! [`AddressVector`]: peers' raw addresses in a table (`FI_AV_TABLE`), named by [`PeerId`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::addr::{Gid, RawAddr};
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};

/// A peer's handle in an address vector (libfabric's `fi_addr_t`).
///
/// The low 32 bits are the table index; the high bits a generation, so an id whose entry was
/// removed stays invalid (`UnknownPeer`) even after its slot is reused.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct PeerId(u64);

impl PeerId {
    fn new(index: u32, generation: u32) -> PeerId {
        PeerId(u64::from(generation) << 32 | u64::from(index))
    }

    /// The table index (`fi_addr` of `FI_AV_TABLE`).
    pub fn index(self) -> u32 {
        self.0 as u32
    }

    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }

    /// The raw 64-bit value.
    pub fn to_raw(self) -> u64 {
        self.0
    }

    /// From a raw 64-bit value (as returned by [`PeerId::to_raw`]).
    pub fn from_raw(raw: u64) -> PeerId {
        PeerId(raw)
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({}#{})", self.index(), self.generation())
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.index())
    }
}

#[derive(Default)]
struct Table {
    /// `(generation, address)`; `None` address = free slot.
    slots: Vec<(u32, Option<RawAddr>)>,
    free: Vec<u32>,
    by_addr: HashMap<RawAddr, PeerId>,
    /// Newest entry for a (GID, QPN): the reverse lookup for `FI_SOURCE`.
    by_qp: HashMap<(Gid, u16), PeerId>,
    len: usize,
}

/// A table of peer addresses (`FI_AV_TABLE` semantics): insert a raw address, get a [`PeerId`];
/// remove it; look it up; and reverse-look-up the source of a received datagram (`FI_SOURCE`).
///
/// Cheap to clone; holds its domain.
///
/// ```
/// # fn main() -> efa::Result<()> {
/// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
/// use efa::{AddressVector, RawAddr, ErrorKind};
/// let av = AddressVector::new(&domain);
/// let addr: RawAddr = "efa://[::1]:7:0000002a".parse()?;
/// let peer = av.insert(addr)?;
/// assert_eq!(av.lookup(peer)?, addr);
/// assert_eq!(av.reverse_lookup(addr.gid, addr.qpn), Some(peer));
/// av.remove(peer)?;
/// assert_eq!(av.lookup(peer).unwrap_err().kind(), ErrorKind::UnknownPeer);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct AddressVector {
    inner: Arc<AvInner>,
}

struct AvInner {
    domain: Domain,
    table: RwLock<Table>,
    /// Bumped by every change of the table (caches of lookups compare it).
    generation: AtomicU64,
}

impl AddressVector {
    /// An empty address vector on `domain`.
    #[doc(alias = "fi_av_open")]
    pub fn new(domain: &Domain) -> AddressVector {
        AddressVector {
            inner: Arc::new(AvInner {
                domain: domain.clone(),
                table: RwLock::new(Table::default()),
                generation: AtomicU64::new(0),
            }),
        }
    }

    /// The domain.
    pub fn domain(&self) -> &Domain {
        &self.inner.domain
    }

    /// Inserts a raw address. Inserting an address that is already present returns its existing
    /// id. An address with the same GID and QPN but another QKEY is a new peer (a restarted
    /// process on the same queue pair number) and becomes the target of reverse lookups.
    ///
    /// Errors: `InvalidArgument` for QPN 0 (no device hands it out).
    #[doc(alias = "fi_av_insert")]
    pub fn insert(&self, addr: RawAddr) -> Result<PeerId> {
        Self::check_insert(&addr)?;
        let mut t = self.inner.table.write();
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        Self::insert_locked(&mut t, addr)
    }

    /// Inserts many raw addresses under one lock (`fi_av_insert` with a count), as a program
    /// that learned a whole job's addresses at once does; the ids come back in the same order.
    /// An invalid address (QPN 0) refuses the whole list before any is inserted (`NoMemory`, past
    /// 2^32 entries, leaves those before it inserted).
    ///
    /// ```
    /// # fn main() -> efa::Result<()> {
    /// # let domain = efa::Domain::open(&efa::getinfo(&efa::Hints::new().provider("loopback"))?[0])?;
    /// use efa::{AddressVector, Gid, RawAddr};
    /// let av = AddressVector::new(&domain);
    /// let addrs: Vec<RawAddr> = (1..=4).map(|q| RawAddr::new(Gid::default(), q, 7)).collect();
    /// let ids = av.insert_many(&addrs)?;
    /// assert_eq!(ids.len(), 4);
    /// assert_eq!(av.lookup(ids[2])?, addrs[2]);
    /// # Ok(()) }
    /// ```
    #[doc(alias = "fi_av_insert")]
    pub fn insert_many(&self, addrs: &[RawAddr]) -> Result<Vec<PeerId>> {
        for a in addrs {
            Self::check_insert(a)?;
        }
        let mut t = self.inner.table.write();
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        addrs
            .iter()
            .map(|a| Self::insert_locked(&mut t, *a))
            .collect()
    }

    fn check_insert(addr: &RawAddr) -> Result<()> {
        if addr.qpn == 0 {
            return Err(Error::new(ErrorKind::InvalidArgument, "av_insert")
                .with_detail(format!("{addr}: QPN 0")));
        }
        Ok(())
    }

    fn insert_locked(t: &mut Table, addr: RawAddr) -> Result<PeerId> {
        if let Some(&id) = t.by_addr.get(&addr) {
            return Ok(id);
        }
        let index = match t.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(t.slots.len()).map_err(|_| {
                    Error::new(ErrorKind::NoMemory, "av_insert").with_detail("address vector full")
                })?;
                t.slots.push((0, None));
                i
            }
        };
        let slot = &mut t.slots[index as usize];
        slot.1 = Some(addr);
        let id = PeerId::new(index, slot.0);
        t.by_addr.insert(addr, id);
        t.by_qp.insert((addr.gid, addr.qpn), id);
        t.len += 1;
        Ok(id)
    }

    /// Inserts a raw address in its 32-byte wire form.
    #[doc(alias = "fi_av_insert")]
    pub fn insert_bytes(&self, raw: &[u8]) -> Result<PeerId> {
        if raw.len() != crate::addr::RAW_ADDR_LEN {
            return Err(
                Error::new(ErrorKind::InvalidArgument, "av_insert").with_detail(format!(
                    "raw address of {} bytes, expected {}",
                    raw.len(),
                    crate::addr::RAW_ADDR_LEN
                )),
            );
        }
        self.insert(RawAddr::from_bytes(raw)?)
    }

    /// Removes a peer. `UnknownPeer` if it is not (or no longer) present.
    #[doc(alias = "fi_av_remove")]
    pub fn remove(&self, peer: PeerId) -> Result<()> {
        let mut t = self.inner.table.write();
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        let addr = Self::get(&t, peer, "av_remove")?;
        let slot = &mut t.slots[peer.index() as usize];
        slot.1 = None;
        slot.0 = slot.0.wrapping_add(1);
        t.by_addr.remove(&addr);
        if t.by_qp.get(&(addr.gid, addr.qpn)) == Some(&peer) {
            t.by_qp.remove(&(addr.gid, addr.qpn));
            // Fall back to another live entry for the same queue pair, if any.
            if let Some((&a, &id)) = t.by_addr.iter().find(|(a, _)| a.same_qp(&addr)) {
                t.by_qp.insert((a.gid, a.qpn), id);
            }
        }
        t.free.push(peer.index());
        t.len -= 1;
        Ok(())
    }

    /// The raw address of a peer. `UnknownPeer` if it is not present.
    #[doc(alias = "fi_av_lookup")]
    pub fn lookup(&self, peer: PeerId) -> Result<RawAddr> {
        Self::get(&self.inner.table.read(), peer, "av_lookup")
    }

    /// The peer a datagram from (`gid`, `qpn`) came from, if it is in the table (`FI_SOURCE`).
    #[doc(alias = "FI_SOURCE")]
    pub fn reverse_lookup(&self, gid: Gid, qpn: u16) -> Option<PeerId> {
        self.inner.table.read().by_qp.get(&(gid, qpn)).copied()
    }

    /// The peer with exactly this raw address (QKEY included), if present.
    pub fn find(&self, addr: &RawAddr) -> Option<PeerId> {
        self.inner.table.read().by_addr.get(addr).copied()
    }

    /// A number that changes whenever an address is inserted or removed: a cache of
    /// [`Self::find`] results taken at one generation stays valid while it is unchanged.
    pub fn generation(&self) -> u64 {
        self.inner.generation.load(Ordering::Acquire)
    }

    /// Number of peers.
    pub fn len(&self) -> usize {
        self.inner.table.read().len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when both handles are the same address vector.
    pub fn same(&self, other: &AddressVector) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn get(t: &Table, peer: PeerId, op: &'static str) -> Result<RawAddr> {
        match t.slots.get(peer.index() as usize) {
            Some(&(generation, Some(addr))) if generation == peer.generation() => Ok(addr),
            _ => Err(Error::new(ErrorKind::UnknownPeer, op)
                .with_detail(format!("{peer:?} is not in the address vector"))),
        }
    }
}

impl fmt::Debug for AddressVector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressVector")
            .field("len", &self.len())
            .finish()
    }
}
