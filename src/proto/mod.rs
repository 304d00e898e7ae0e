//! The RDM protocol: the EFA RDM wire protocol v4, as libfabric's EFA provider speaks it, and
//! the sans-I/O engine that speaks it.
//!
//! [`wire`] is the packet codec: typed headers, a total decoder and an encoder that writes
//! libfabric's byte layout, so that the protocol engine built on it can one day talk to a
//! libfabric peer. See `docs/protocol.md`. [`engine`] is the protocol engine; [`matching`] and
//! [`reorder`] are its receive-side data structures.

pub mod engine;
pub mod matching;
pub mod reorder;
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod sim;
pub mod wire;
