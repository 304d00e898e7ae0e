//! Bulk copies that avoid one slow case of the C library's `memcpy`.
//!
//! glibc's `memcpy` copies large buffers with `rep movsb`. On some x86 cores that instruction
//! runs an order of magnitude slower when the destination sits just after the source modulo the
//! 4 KiB page (the stores alias the loads still in flight). Measured on the AMD EPYC VM of
//! docs/performance.md (family 25, glibc 2.36): a 64 KiB copy with `(dst - src) mod 4096` in
//! `1..=15` moves 2.0–3.5 GB/s against 40–57 GB/s at any other distance, for any copy longer
//! than about 3 KiB; copied in 2 KiB pieces (which glibc copies with vector registers) the same
//! bytes move at 15–20 GB/s.
//!
//! Where the two addresses fall is chance: a receive buffer's payload offset (behind a header)
//! against the place in a region a peer writes to. The udp device received every RDMA write of
//! `examples/rma-bw` at a distance of 4, so the same program ran at 2.3 or 3.4 GB/s depending on
//! where the allocator had put its buffer. The receive paths that copy bulk data (into regions,
//! into posted buffers, into a message's destination) copy through [`copy`] and [`extend`],
//! which split a copy in the aliasing band into pieces and leave every other one to one
//! `memcpy`.

use bytes::BytesMut;

/// The aliasing period (a page).
const PERIOD: usize = 4096;
/// Distances `(dst - src) mod PERIOD` in `1..BAND` are copied in pieces. Measured slow: 1–15;
/// the band covers the cache line, for cores where it is wider.
const BAND: usize = 64;
/// Copies up to this long never take `rep movsb`; longer ones in the band go in pieces this long.
const PIECE: usize = 2048;

/// How long the pieces of a copy of `len` bytes from `src` to `dst` should be: `len` (one
/// piece, never 0) unless the copy falls into the aliasing band. For copies that cannot make a
/// slice of their source (shared memory another process writes).
#[inline]
pub(crate) fn piece_len(dst: *const u8, src: *const u8, len: usize) -> usize {
    if len <= PIECE {
        return len.max(1);
    }
    let distance = (dst as usize).wrapping_sub(src as usize) % PERIOD;
    if (1..BAND).contains(&distance) {
        PIECE
    } else {
        len
    }
}

/// `src` cut into the pieces a copy to `dst` should take: one piece (the whole of it) unless the
/// copy falls into the aliasing band.
#[inline]
pub(crate) fn pieces(dst: *const u8, src: &[u8]) -> std::slice::Chunks<'_, u8> {
    src.chunks(piece_len(dst, src.as_ptr(), src.len()))
}

/// `dst.copy_from_slice(src)` (the same panic when the lengths differ), in pieces when the two
/// alias.
#[inline]
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy: lengths differ");
    if src.len() <= PIECE {
        // Small messages, the hot case: one `memcpy`, never `rep movsb`.
        dst.copy_from_slice(src);
        return;
    }
    let mut at = 0;
    for p in pieces(dst.as_ptr(), src) {
        dst[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
}

/// A buffer [`extend`] appends to.
pub(crate) trait Tail {
    /// The address the next appended byte goes to (when no reallocation intervenes).
    fn tail(&self) -> *const u8;
    /// Appends `s`.
    fn put(&mut self, s: &[u8]);
}

impl Tail for Vec<u8> {
    fn tail(&self) -> *const u8 {
        self.as_ptr().wrapping_add(self.len())
    }
    fn put(&mut self, s: &[u8]) {
        self.extend_from_slice(s);
    }
}

impl Tail for BytesMut {
    fn tail(&self) -> *const u8 {
        self.as_ptr().wrapping_add(self.len())
    }
    fn put(&mut self, s: &[u8]) {
        self.extend_from_slice(s);
    }
}

/// `out.extend_from_slice(src)`, in pieces when the copy aliases.
#[inline]
pub(crate) fn extend(out: &mut impl Tail, src: &[u8]) {
    if src.len() > PIECE {
        // The copy lands where the buffer ends now only if it has room.
        for p in pieces(out.tail(), src) {
            out.put(p);
        }
    } else {
        out.put(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn copies_every_distance_and_length_intact() {
        let src = data(3 * PIECE + 100);
        let mut big = vec![0u8; 3 * PIECE + 200 + PERIOD];
        // Every distance in and around the band, lengths around a piece.
        for off in 0..(BAND + 8) {
            for len in [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 100] {
                let dst = &mut big[off..off + len];
                dst.fill(0);
                copy(dst, &src[..len]);
                assert_eq!(dst, &src[..len], "offset {off}, length {len}");
                let mut v: Vec<u8> = Vec::with_capacity(off + len);
                v.resize(off, 9);
                extend(&mut v, &src[..len]);
                assert_eq!(&v[off..], &src[..len], "extend, offset {off}, length {len}");
                let mut b = BytesMut::with_capacity(off + len);
                b.resize(off, 9);
                extend(&mut b, &src[..len]);
                assert_eq!(&b[off..], &src[..len], "extend BytesMut, offset {off}");
            }
        }
    }

    #[test]
    fn splits_only_in_the_band() {
        let src = vec![0u8; 4 * PIECE];
        let at = src.as_ptr() as usize;
        assert_eq!(pieces((at + 4) as *const u8, &src).count(), 4);
        assert_eq!(pieces((at + PERIOD + 63) as *const u8, &src).count(), 4);
        assert_eq!(pieces(at as *const u8, &src).count(), 1);
        assert_eq!(pieces((at + 64) as *const u8, &src).count(), 1);
        assert_eq!(pieces((at + PERIOD - 4) as *const u8, &src).count(), 1);
        // Short copies are never split.
        assert_eq!(pieces((at + 4) as *const u8, &src[..PIECE]).count(), 1);
        assert_eq!(pieces(at as *const u8, &[]).count(), 0);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn copy_of_unequal_lengths_panics_as_copy_from_slice() {
        copy(&mut [0u8; 3], &[1, 2]);
    }
}
