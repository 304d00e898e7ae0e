//! Unpredictable numbers for keys, connection and sequence numbers: the kernel's CSPRNG
//! (`/dev/urandom`), or, should it be unreadable (a sandbox without `/dev`), SipHash keyed by the
//! standard library from the operating system's random source over a counter and the clock.

use std::io::Read;

/// 64 bits from the kernel's CSPRNG.
pub(crate) fn secure_u64() -> u64 {
    let mut b = [0u8; 8];
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)) {
        Ok(()) => u64::from_ne_bytes(b),
        Err(_) => fallback_u64(),
    }
}

fn fallback_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    );
    h.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn distinct_and_spread() {
        let v: std::collections::HashSet<u64> = (0..1000).map(|_| super::secure_u64()).collect();
        assert_eq!(v.len(), 1000);
        let high = v.iter().filter(|k| **k >> 63 == 1).count();
        assert!(
            (350..650).contains(&high),
            "{high} of 1000 with the top bit set"
        );
        assert_ne!(super::fallback_u64(), super::fallback_u64());
    }
}
