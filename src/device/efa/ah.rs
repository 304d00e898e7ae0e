//! GIDs and address handles.
//!
//! A send on EFA names its destination by an address handle (`ibv_ah`) made from the peer's GID,
//! plus the peer's QPN and QKEY. Creating one is a system call, so the device keeps one per GID in
//! an [`AhCache`] shared by its queue pairs (they share one protection domain), as libfabric's
//! domain-wide AH map does:
//!
//! * a handle is reference-counted (`Arc`): the cache holds one reference and every work request
//!   that uses it holds another until its completion, so a handle is never destroyed while the NIC
//!   may still use it;
//! * handles only the cache references are "idle"; they stay cached for the next send to the same
//!   GID, and are evicted (destroyed) when the cache grows beyond its bound or the device runs out
//!   of handles — the least recently used first, an eighth of the bound at a time, so the
//!   handles of live peers (sent to or heard from lately) stay: EFA needs the target of an RDMA
//!   operation to hold an AH for the initiator (else status 14), and reports the sender of a
//!   receive by AHN only while it holds one;
//! * the cache also maps the address handle number (AHN) the device reports in receive completions
//!   back to the sender's GID (a lookup counts as a use).

use std::collections::HashMap;
use std::sync::Arc;

use rdma_sys::ibv_gid;

use crate::addr::Gid;
use crate::error::{ErrorKind, Result};

/// The verbs form of a GID.
pub fn gid_to_ibv(gid: &Gid) -> ibv_gid {
    ibv_gid { raw: gid.0 }
}

/// A GID from its verbs form.
pub fn gid_from_ibv(gid: &ibv_gid) -> Gid {
    // SAFETY: both members of the union are plain 16-byte integers; every bit pattern is a valid
    // `[u8; 16]`.
    Gid(unsafe { gid.raw })
}

/// Makes address handles; the real one calls `ibv_create_ah` + `efadv_query_ah`.
pub trait AhFactory {
    /// The handle type; dropping it destroys the handle.
    type Ah: Send + Sync;
    /// A new handle for `gid` and its address handle number.
    fn create_ah(&self, gid: &Gid) -> Result<(Self::Ah, u16)>;
}

struct Entry<A> {
    ah: Arc<A>,
    ahn: u16,
    /// The cache's clock at the last use (a send or a receive naming it).
    used: u64,
}

/// Address handles by GID, reference-counted, with the reverse map AHN → GID.
pub struct AhCache<A> {
    map: HashMap<Gid, Entry<A>>,
    by_ahn: HashMap<u16, Gid>,
    max_cached: usize,
    created: u64,
    evicted: u64,
    clock: u64,
}

impl<A> AhCache<A> {
    /// An empty cache that evicts idle handles when it holds more than `max_cached`.
    pub fn new(max_cached: usize) -> AhCache<A> {
        AhCache {
            map: HashMap::new(),
            by_ahn: HashMap::new(),
            max_cached: max_cached.max(1),
            created: 0,
            evicted: 0,
            clock: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// How many idle handles one eviction round destroys.
    fn batch(&self) -> usize {
        (self.max_cached / 8).max(1)
    }

    /// A reference to the handle of `gid`, created with `factory` on a miss. When the cache is
    /// full or the device is out of handles (`NoMemory`), the least recently used idle handles
    /// are evicted (then the creation is tried once more). (The device uses [`get_shared`].)
    #[cfg(test)]
    pub fn get<F: AhFactory<Ah = A>>(&mut self, gid: &Gid, factory: &F) -> Result<Arc<A>> {
        if let Some(a) = self.lookup(gid) {
            return Ok(a);
        }
        self.make_room();
        let (ah, ahn) = match factory.create_ah(gid) {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::NoMemory && self.evict_lru(self.batch()) > 0 => {
                factory.create_ah(gid)?
            }
            Err(e) => return Err(e),
        };
        Ok(self.insert(gid, ah, ahn))
    }

    /// The cached handle of `gid` (counted as a use).
    fn lookup(&mut self, gid: &Gid) -> Option<Arc<A>> {
        let now = self.tick();
        let e = self.map.get_mut(gid)?;
        e.used = now;
        Some(e.ah.clone())
    }

    /// Evicts a batch of idle handles when the cache is full.
    fn make_room(&mut self) {
        if self.map.len() >= self.max_cached {
            self.evict_lru(self.batch());
        }
    }

    /// Caches a handle just created for `gid`, or, when another thread cached one meanwhile,
    /// keeps that one (the new handle is destroyed).
    fn insert(&mut self, gid: &Gid, ah: A, ahn: u16) -> Arc<A> {
        if let Some(a) = self.lookup(gid) {
            return a;
        }
        let now = self.tick();
        self.created += 1;
        let ah = Arc::new(ah);
        if let Some(old) = self.by_ahn.insert(ahn, *gid) {
            // The device reused the number of a handle that is gone from the map already.
            tracing::debug!(ahn, old = %old, new = %gid, "efa: address handle number reused");
        }
        self.map.insert(
            *gid,
            Entry {
                ah: ah.clone(),
                ahn,
                used: now,
            },
        );
        ah
    }

    /// Destroys every handle no work request references; returns how many.
    #[cfg(test)]
    pub fn evict_idle(&mut self) -> usize {
        self.evict_lru(usize::MAX)
    }

    /// Destroys up to `n` handles no work request references, the least recently used first;
    /// returns how many.
    pub fn evict_lru(&mut self, n: usize) -> usize {
        let mut idle: Vec<(u64, Gid)> = self
            .map
            .iter()
            .filter(|(_, e)| Arc::strong_count(&e.ah) == 1)
            .map(|(g, e)| (e.used, *g))
            .collect();
        if idle.len() > n {
            idle.select_nth_unstable(n);
            idle.truncate(n);
        }
        let idle: Vec<Gid> = idle.into_iter().map(|(_, g)| g).collect();
        for g in &idle {
            if let Some(e) = self.map.remove(g) {
                if self.by_ahn.get(&e.ahn) == Some(g) {
                    self.by_ahn.remove(&e.ahn);
                }
            }
        }
        self.evicted += idle.len() as u64;
        idle.len()
    }

    /// The GID of the peer whose handle has number `ahn`, if this cache made it (a use of
    /// that handle: a peer heard from stays cached).
    pub fn gid_of(&mut self, ahn: u16) -> Option<Gid> {
        let g = self.by_ahn.get(&ahn).copied()?;
        let now = self.tick();
        if let Some(e) = self.map.get_mut(&g) {
            e.used = now;
        }
        Some(g)
    }

    /// The handle number of `gid`, if cached.
    #[cfg(test)]
    pub fn ahn_of(&self, gid: &Gid) -> Option<u16> {
        self.map.get(gid).map(|e| e.ahn)
    }

    /// Handles cached (idle or in use).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Handles created and evicted so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.created, self.evicted)
    }
}

/// [`AhCache::get`] on a shared cache, holding its lock only to look up and to insert: creating
/// a handle (`ibv_create_ah`) is a kernel command on a NIC, and under the device-wide lock it
/// stalled every queue pair's sends (and completions from unknown senders) meanwhile. Two
/// threads that miss at once both create one; the second is destroyed.
pub fn get_shared<A, F: AhFactory<Ah = A>>(
    cache: &parking_lot::Mutex<AhCache<A>>,
    gid: &Gid,
    factory: &F,
) -> Result<Arc<A>> {
    {
        let mut c = cache.lock();
        if let Some(a) = c.lookup(gid) {
            return Ok(a);
        }
        c.make_room();
    }
    let (ah, ahn) = match factory.create_ah(gid) {
        Ok(x) => x,
        Err(e) if e.kind() == ErrorKind::NoMemory => {
            let evicted = {
                let mut c = cache.lock();
                let n = c.batch();
                c.evict_lru(n)
            };
            if evicted == 0 {
                return Err(e);
            }
            factory.create_ah(gid)?
        }
        Err(e) => return Err(e),
    };
    Ok(cache.lock().insert(gid, ah, ahn))
}

/// The link-local GID `fe80::n`, for tests.
#[cfg(test)]
pub(super) fn test_gid(n: u8) -> Gid {
    let mut g = [0u8; 16];
    g[0] = 0xfe;
    g[1] = 0x80;
    g[15] = n;
    Gid(g)
}

#[cfg(test)]
mod tests {
    use super::test_gid as gid;
    use super::*;
    use crate::addr::RawAddr;
    use crate::error::Error;
    use parking_lot::Mutex;
    use std::cell::Cell;

    #[test]
    fn gid_bytes_round_trip() {
        let bytes = [
            0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x04, 0x8a, 0x1c, 0xff, 0xfe, 0x2b, 0x3c, 0x4d,
        ];
        let ibv = ibv_gid { raw: bytes };
        let gid = gid_from_ibv(&ibv);
        assert_eq!(gid.0, bytes);
        assert_eq!(gid.to_string(), "fe80::48a:1cff:fe2b:3c4d");
        assert_eq!(gid_from_ibv(&gid_to_ibv(&gid)), gid);
        let raw = RawAddr::new(gid, 0x1a, 0x7eadbeef);
        let wire = raw.to_bytes();
        assert_eq!(&wire[..16], &bytes);
        assert_eq!(&wire[16..18], &[0x1a, 0]);
        assert_eq!(&wire[20..24], &0x7eadbeef_u32.to_le_bytes());
        let back = RawAddr::from_bytes(&wire).unwrap();
        assert_eq!(back, raw);
        assert_eq!(back.to_string().parse::<RawAddr>().unwrap(), raw);
        assert_eq!(
            back.to_string(),
            "efa://[fe80::48a:1cff:fe2b:3c4d]:26:7eadbeef"
        );
    }

    #[derive(Debug)]
    struct FakeAh {
        gid: Gid,
        log: Arc<Mutex<Vec<Gid>>>,
    }

    impl Drop for FakeAh {
        fn drop(&mut self) {
            self.log.lock().push(self.gid);
        }
    }

    struct Factory {
        log: Arc<Mutex<Vec<Gid>>>,
        next_ahn: Cell<u16>,
        created: Cell<usize>,
        /// Fail with NoMemory while more than this many handles are alive.
        limit: Option<usize>,
    }

    impl Factory {
        fn new(limit: Option<usize>) -> Factory {
            Factory {
                log: Arc::new(Mutex::new(Vec::new())),
                next_ahn: Cell::new(1),
                created: Cell::new(0),
                limit,
            }
        }
        fn alive(&self) -> usize {
            self.created.get() - self.log.lock().len()
        }
    }

    impl AhFactory for Factory {
        type Ah = FakeAh;
        fn create_ah(&self, gid: &Gid) -> Result<(FakeAh, u16)> {
            if self.limit.is_some_and(|l| self.alive() >= l) {
                return Err(Error::new(ErrorKind::NoMemory, "ibv_create_ah"));
            }
            let ahn = self.next_ahn.get();
            self.next_ahn.set(ahn + 1);
            self.created.set(self.created.get() + 1);
            Ok((
                FakeAh {
                    gid: *gid,
                    log: self.log.clone(),
                },
                ahn,
            ))
        }
    }

    #[test]
    fn one_handle_per_gid_shared_by_references() {
        let f = Factory::new(None);
        let mut c = AhCache::new(16);
        let a1 = c.get(&gid(1), &f).unwrap();
        let a2 = c.get(&gid(1), &f).unwrap();
        assert!(Arc::ptr_eq(&a1, &a2));
        assert_eq!(f.created.get(), 1);
        assert_eq!(Arc::strong_count(&a1), 3, "cache + two work requests");
        let b = c.get(&gid(2), &f).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c.gid_of(1), Some(gid(1)));
        assert_eq!(c.gid_of(2), Some(gid(2)));
        assert_eq!(c.ahn_of(&gid(2)), Some(2));
        assert_eq!(c.gid_of(3), None);
        // Handles in use are never evicted.
        assert_eq!(c.evict_idle(), 0);
        drop(a1);
        assert_eq!(c.evict_idle(), 0, "a2 still holds gid 1");
        drop(a2);
        assert!(f.log.lock().is_empty(), "idle handles stay cached");
        assert_eq!(c.evict_idle(), 1);
        assert_eq!(*f.log.lock(), vec![gid(1)], "evicted handle destroyed");
        assert_eq!(c.gid_of(1), None);
        // Dropping the cache leaves a handle alive until its last work request completes.
        drop(c);
        assert_eq!(f.log.lock().len(), 1);
        drop(b);
        assert_eq!(*f.log.lock(), vec![gid(1), gid(2)]);
    }

    #[test]
    fn bound_evicts_idle_handles() {
        let f = Factory::new(None);
        let mut c = AhCache::new(2);
        let keep = c.get(&gid(1), &f).unwrap();
        drop(c.get(&gid(2), &f).unwrap());
        // Third GID: over the bound, the idle handle of gid 2 goes.
        let _three = c.get(&gid(3), &f).unwrap();
        assert_eq!(*f.log.lock(), vec![gid(2)]);
        assert_eq!(c.len(), 2);
        assert!(c.ahn_of(&gid(1)).is_some());
        assert_eq!(c.counts(), (3, 1));
        drop(keep);
    }

    /// Over the bound, the least recently used idle handles go, an eighth of the bound at a
    /// time; a handle used by a send or named by a receive (`gid_of`) counts as used, so the
    /// AHs of live peers stay (issue 16, defect 5).
    #[test]
    fn eviction_takes_the_least_recently_used_idle_handles() {
        let f = Factory::new(None);
        let mut c = AhCache::new(16);
        for n in 1..=16 {
            drop(c.get(&gid(n), &f).unwrap());
        }
        // Peers 1 and 2 are heard from (receives), peer 3 sent to: all three are recent.
        let ahn1 = c.ahn_of(&gid(1)).unwrap();
        let ahn2 = c.ahn_of(&gid(2)).unwrap();
        assert_eq!(c.gid_of(ahn1), Some(gid(1)));
        assert_eq!(c.gid_of(ahn2), Some(gid(2)));
        drop(c.get(&gid(3), &f).unwrap());
        drop(c.get(&gid(17), &f).unwrap());
        // Two (16 / 8) went: the two least recently used, 4 and 5.
        let gone: std::collections::HashSet<Gid> = f.log.lock().iter().copied().collect();
        assert_eq!(gone, [gid(4), gid(5)].into_iter().collect());
        for n in [1, 2, 3, 6, 16, 17] {
            assert!(c.ahn_of(&gid(n)).is_some(), "peer {n} kept");
        }
        assert_eq!(c.len(), 15);
    }

    #[test]
    fn out_of_handles_evicts_and_retries_once() {
        let f = Factory::new(Some(2));
        let mut c = AhCache::new(100);
        let a = c.get(&gid(1), &f).unwrap();
        drop(c.get(&gid(2), &f).unwrap());
        // The device is full; gid 2 is idle, so it goes and gid 3 gets its place.
        let b = c.get(&gid(3), &f).unwrap();
        assert_eq!(*f.log.lock(), vec![gid(2)]);
        // Full with both in use: the error comes back.
        let e = c.get(&gid(4), &f).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoMemory);
        drop((a, b));
    }

    /// Creating a handle (a kernel command on a NIC) happens outside the shared cache's lock:
    /// another thread's lookups of other peers go on meanwhile (issue 30, point 9); a handle
    /// made twice by racing threads is cached once.
    #[test]
    fn handles_are_created_outside_the_shared_lock() {
        struct Probe<'a> {
            cache: &'a Mutex<AhCache<u8>>,
            held: Cell<bool>,
        }
        impl AhFactory for Probe<'_> {
            type Ah = u8;
            fn create_ah(&self, gid: &Gid) -> Result<(u8, u16)> {
                if self.cache.try_lock().is_none() {
                    self.held.set(true);
                }
                Ok((gid.0[15], u16::from(gid.0[15])))
            }
        }
        let cache = Mutex::new(AhCache::new(8));
        let p = Probe {
            cache: &cache,
            held: Cell::new(false),
        };
        let g = |n: u8| {
            let mut b = [0u8; 16];
            b[15] = n;
            Gid(b)
        };
        let a = get_shared(&cache, &g(1), &p).unwrap();
        assert!(
            !p.held.get(),
            "ibv_create_ah ran under the device-wide lock"
        );
        // A handle another thread cached meanwhile wins; the new one is dropped.
        let again = cache.lock().insert(&g(1), 99, 1);
        assert!(Arc::ptr_eq(&a, &again));
        assert_eq!(*get_shared(&cache, &g(1), &p).unwrap(), 1);
    }
}
