//! [`RailRegion`]: one memory registered on every rail's domain, so that a peer's striped
//! writes and reads reach it over any rail.

use std::ops::{Deref, DerefMut};

use bytes::BytesMut;

use super::addr::RailRemoteKey;
use crate::domain::Domain;
use crate::error::{Error, ErrorKind, Result};
use crate::mem::{Access, IntoRegionBuf};
use crate::mr::MemoryRegion;

/// One buffer registered with every rail's domain of a [`RailGroup`](super::RailGroup): one
/// memory, one key per rail. Hand its [`remote_key`](Self::remote_key) to a peer group, whose
/// striped [`write`](super::RailGroup::write)s and [`read`](super::RailGroup::read)s then land
/// in it (or read from it) over all rails at once.
///
/// Its bytes are read and written through the same guards as a
/// [`MemoryRegion`]'s (one lock for the memory, whichever rail a remote access comes by).
/// Dropping it (or [`close`](Self::close)) revokes every rail's key before the memory goes.
///
/// ```
/// # use efa::rail::RailGroup;
/// # use efa::Access;
/// # fn main() -> efa::Result<()> {
/// # let net = efa::device::loopback::LoopbackNetwork::new(Default::default());
/// # let domains = (0..2).map(|_| efa::device::loopback::LoopbackDevice::open(&net, Default::default())
/// #     .map(|d| efa::Domain::with_device(d, Default::default()))).collect::<efa::Result<Vec<_>>>()?;
/// let group = RailGroup::builder(domains).build()?;
/// let mut region = group.register(vec![0u8; 4096], Access::REMOTE_WRITE | Access::REMOTE_READ)?;
/// region.write()[..2].copy_from_slice(b"hi");
/// let rk = region.remote_key()?;
/// assert_eq!(rk.keys.len(), 2); // a key per rail
/// assert_eq!(&region.close()[..2], b"hi");
/// # Ok(()) }
/// ```
pub struct RailRegion {
    /// Rail `i`'s registration of the memory.
    regs: Vec<MemoryRegion>,
}

impl RailRegion {
    /// Registers `buf` with each of `domains` (the rails' domains, in rail order).
    pub(super) fn register_on(
        domains: &[&Domain],
        buf: impl IntoRegionBuf,
        access: Access,
    ) -> Result<RailRegion> {
        let Some((first, rest)) = domains.split_first() else {
            return Err(Error::new(ErrorKind::InvalidArgument, "rail_mr_reg")
                .with_detail("no rail to register with"));
        };
        let head = first.register(buf, access)?;
        let mut regs = Vec::with_capacity(domains.len());
        for d in rest {
            let r = head.register_also(d)?;
            regs.push(r);
        }
        regs.insert(0, head);
        Ok(RailRegion { regs })
    }

    /// The length, bytes.
    pub fn len(&self) -> usize {
        self.regs[0].len()
    }

    /// True for a region of no bytes (never registered so; kept for symmetry).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The access rights.
    pub fn access(&self) -> Access {
        self.regs[0].access()
    }

    /// Rail `rail`'s registration (its key and domain); `None` past the last rail.
    pub fn rail(&self, rail: usize) -> Option<&MemoryRegion> {
        self.regs.get(rail)
    }

    /// The bytes, for reading, under the memory's lock (see [`MemoryRegion::read`]).
    pub fn read(&self) -> impl Deref<Target = [u8]> + '_ {
        self.regs[0].read()
    }

    /// The bytes, for writing, under the memory's lock (see [`MemoryRegion::write`]).
    pub fn write(&mut self) -> impl DerefMut<Target = [u8]> + '_ {
        self.regs[0].write()
    }

    /// The key bundle a peer needs (address, length, a key per rail). `InvalidArgument` unless
    /// the region has `REMOTE_READ` or `REMOTE_WRITE`.
    pub fn remote_key(&self) -> Result<RailRemoteKey> {
        let first = self.regs[0].remote_key()?;
        Ok(RailRemoteKey {
            addr: first.addr,
            len: first.len,
            keys: self.regs.iter().map(MemoryRegion::key).collect(),
        })
    }

    /// Revokes every rail's key, then hands the buffer back.
    pub fn close(mut self) -> BytesMut {
        let first = self.regs.remove(0);
        // Each rail's key goes with its registration; the memory stays with the first.
        self.regs.clear();
        first.close()
    }
}

impl std::fmt::Debug for RailRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailRegion")
            .field("len", &self.len())
            .field(
                "keys",
                &self.regs.iter().map(MemoryRegion::key).collect::<Vec<_>>(),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::loopback::{LoopbackDevice, LoopbackNetwork};

    fn domains(n: usize) -> Vec<Domain> {
        let net = LoopbackNetwork::new(Default::default());
        (0..n)
            .map(|_| {
                Domain::with_device(
                    LoopbackDevice::open(&net, Default::default()).unwrap(),
                    Default::default(),
                )
            })
            .collect()
    }

    #[test]
    fn one_memory_a_key_per_domain_every_key_revoked_before_the_memory_goes() {
        let ds = domains(3);
        let refs: Vec<&Domain> = ds.iter().collect();
        let mut r = RailRegion::register_on(&refs, vec![0u8; 64], Access::REMOTE_WRITE).unwrap();
        assert!(r.regs[0].same_memory(&r.regs[2]));
        let rk = r.remote_key().unwrap();
        assert_eq!(rk.len, 64);
        // A remote write through any domain lands in the one memory.
        for (i, d) in ds.iter().enumerate() {
            d.remote_write(rk.keys[i], rk.addr + i as u64, &[i as u8 + 1])
                .unwrap();
        }
        assert_eq!(&r.read()[..3], &[1, 2, 3]);
        r.write()[10] = 9;
        // Dropping one rail's registration alone keeps the memory for the others.
        let last = r.regs.pop().unwrap();
        drop(last);
        assert!(
            ds[2].remote_write(rk.keys[2], rk.addr, &[0]).is_err(),
            "revoked"
        );
        ds[1].remote_write(rk.keys[1], rk.addr + 20, &[7]).unwrap();
        let buf = r.close();
        assert_eq!((buf.len(), buf[0], buf[10], buf[20]), (64, 1, 9, 7));
        for (i, d) in ds.iter().enumerate() {
            assert!(
                d.remote_write(rk.keys[i], rk.addr, &[0]).is_err(),
                "rail {i} revoked"
            );
        }
    }
}
