//! `efa_rma_iov` lists: [`IovList`], borrowed from a packet or from a slice of [`RemoteIov`].

use std::fmt;

use super::RMA_IOV_LEN;
use crate::device::RemoteIov;

/// A list of `efa_rma_iov` (`{u64 addr; u64 len; u64 key}`): either borrowed from a packet
/// (what [`decode`](super::decode) returns, no allocation) or from a slice of [`RemoteIov`]
/// (what an encoder builds). Two lists are equal when their entries are.
#[derive(Clone, Copy)]
pub struct IovList<'a>(Repr<'a>);

#[derive(Clone, Copy)]
enum Repr<'a> {
    Wire(&'a [u8]),
    Slice(&'a [RemoteIov]),
}

fn iov_from_wire(b: &[u8]) -> RemoteIov {
    let w = |i: usize| {
        let mut a = [0u8; 8];
        if let Some(s) = b.get(i * 8..i * 8 + 8) {
            a.copy_from_slice(s);
        }
        u64::from_le_bytes(a)
    };
    RemoteIov {
        addr: w(0),
        len: w(1),
        key: w(2),
    }
}

impl<'a> IovList<'a> {
    /// The empty list.
    pub const EMPTY: IovList<'static> = IovList(Repr::Slice(&[]));

    /// A list over `iovs`.
    pub const fn new(iovs: &'a [RemoteIov]) -> IovList<'a> {
        IovList(Repr::Slice(iovs))
    }

    /// A list over wire bytes; a trailing partial entry is ignored.
    pub(crate) fn from_wire(bytes: &'a [u8]) -> IovList<'a> {
        IovList(Repr::Wire(bytes))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        match self.0 {
            Repr::Wire(b) => b.len() / RMA_IOV_LEN,
            Repr::Slice(s) => s.len(),
        }
    }

    /// True when there is no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entry `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<RemoteIov> {
        match self.0 {
            Repr::Wire(b) => {
                let start = i.checked_mul(RMA_IOV_LEN)?;
                b.get(start..start.checked_add(RMA_IOV_LEN)?)
                    .map(iov_from_wire)
            }
            Repr::Slice(s) => s.get(i).copied(),
        }
    }

    /// The entries in order.
    pub fn iter(&self) -> IovIter<'a> {
        IovIter(match self.0 {
            Repr::Wire(b) => IterRepr::Wire(b.chunks_exact(RMA_IOV_LEN)),
            Repr::Slice(s) => IterRepr::Slice(s.iter()),
        })
    }

    /// The entries, copied into a vector.
    pub fn to_vec(&self) -> Vec<RemoteIov> {
        self.iter().collect()
    }

    /// Total bytes the entries cover (saturating).
    pub fn total_len(&self) -> u64 {
        self.iter().fold(0u64, |acc, v| acc.saturating_add(v.len))
    }
}

impl Default for IovList<'_> {
    fn default() -> Self {
        IovList::EMPTY
    }
}

impl<'a> From<&'a [RemoteIov]> for IovList<'a> {
    fn from(s: &'a [RemoteIov]) -> Self {
        IovList::new(s)
    }
}

impl<'a, const N: usize> From<&'a [RemoteIov; N]> for IovList<'a> {
    fn from(s: &'a [RemoteIov; N]) -> Self {
        IovList::new(s)
    }
}

impl<'a> From<&'a Vec<RemoteIov>> for IovList<'a> {
    fn from(s: &'a Vec<RemoteIov>) -> Self {
        IovList::new(s)
    }
}

impl PartialEq for IovList<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for IovList<'_> {}

impl fmt::Debug for IovList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for IovList<'a> {
    type Item = RemoteIov;
    type IntoIter = IovIter<'a>;
    fn into_iter(self) -> IovIter<'a> {
        self.iter()
    }
}

impl<'a> IntoIterator for &IovList<'a> {
    type Item = RemoteIov;
    type IntoIter = IovIter<'a>;
    fn into_iter(self) -> IovIter<'a> {
        self.iter()
    }
}

/// Iterator over an [`IovList`].
#[derive(Clone, Debug)]
pub struct IovIter<'a>(IterRepr<'a>);

#[derive(Clone, Debug)]
enum IterRepr<'a> {
    Wire(std::slice::ChunksExact<'a, u8>),
    Slice(std::slice::Iter<'a, RemoteIov>),
}

impl Iterator for IovIter<'_> {
    type Item = RemoteIov;
    fn next(&mut self) -> Option<RemoteIov> {
        match &mut self.0 {
            IterRepr::Wire(c) => c.next().map(iov_from_wire),
            IterRepr::Slice(s) => s.next().copied(),
        }
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::Wire(c) => c.size_hint(),
            IterRepr::Slice(s) => s.size_hint(),
        }
    }
}

impl ExactSizeIterator for IovIter<'_> {}
