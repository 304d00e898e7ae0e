//! The RDM protocol: the EFA RDM wire protocol v4 and the sans-I/O engine that speaks it.

pub mod engine;
pub mod matching;
pub mod reorder;
