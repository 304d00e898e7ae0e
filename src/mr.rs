//! Memory registration: [`MemoryRegion`] owns its buffer, carries a key, and is moved into the
//! operations that use it (and handed back in their completions). A region registered for remote
//! access can be described to a peer with a serializable [`RemoteKey`]; dropping or closing the
//! region revokes the key before the memory is released, so no peer can reach freed memory.
//!
//! The region handle lives with its domain (`domain/mr.rs`); the memory core it shares with the
//! devices ([`RegionMem`], [`Access`], [`RemoteKey`], the key table) is in [`crate::mem`]. This
//! module gathers what users of memory registration need under one path.

pub use crate::device::MrQuery;
pub use crate::domain::mr::MemoryRegion;
pub use crate::mem::{Access, IntoRegionBuf, RegionMem, RemoteKey};
