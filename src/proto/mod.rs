//! The EFA RDM wire protocol (version 4), as libfabric's EFA provider speaks it.
//!
//! [`wire`] is the packet codec: typed headers, a total decoder and an encoder that writes
//! libfabric's byte layout, so that the protocol engine built on it can one day talk to a
//! libfabric peer. See `docs/protocol.md`.

pub mod wire;
