//! What a sub-state's handler reaches besides its own state: the engine's shared state, one
//! struct the engine owns and hands out by `&mut` beside the sub-states (`Engine::parts`), as
//! quinn-proto hands its streams the connection's pieces they need. The
//! sub-states themselves (`TxSide`, `RxSide`, `ReadState`, `Ema`) are passed as separate
//! arguments where a handler needs another one, so the borrow checker bounds each handler.

use std::collections::VecDeque;

use super::budget::Budget;
use super::peer::Peers;
use super::util::Out;
use super::wr::Wr;
use super::{EngineConfig, RmaMemory, TargetCounts};
use crate::addr::RawAddr;
use crate::fault::Rng;

/// The configuration, our address, the memory, the peers (and the packets queued to them), the
/// flood budget, the RDMA work requests waiting for the device, the completions, counters and
/// timers, the backoff's randomness, the count of peers' RMA served and the delivery-complete
/// acknowledgements the same-host path owes.
#[derive(Debug)]
pub(super) struct Cx {
    pub(super) cfg: EngineConfig,
    pub(super) local: RawAddr,
    /// The application counts peers' writes / reads of its memory
    /// (`Engine::set_remote_events`).
    pub(super) remote_events: (bool, bool),
    /// The memory peers' RMA reaches and region sends read from.
    pub(super) memory: Option<std::sync::Arc<dyn RmaMemory>>,
    pub(super) peers: Peers,
    /// Messages and bytes held without a receive.
    pub(super) budget: Budget,
    /// RDMA work requests waiting for room on the device (device RMA, the receiver's reads,
    /// LONGREAD_RTW targets): the packets' counterpart of the queues in `Peers`.
    pub(super) wrs: VecDeque<Wr>,
    pub(super) out: Out,
    pub(super) rng: Rng,
    /// Peers' RMA served since the last `Engine::take_target_counts`.
    pub(super) counts: TargetCounts,
    /// Delivery-complete acknowledgements the same-host path owes (`local.rs`).
    pub(super) receipts: VecDeque<(RawAddr, u32)>,
}

impl Cx {
    /// The peer an operation to `dest` goes to, created if new; `None` when the table is full.
    pub(super) fn peer_for_send(&mut self, dest: RawAddr) -> Option<u64> {
        let max = self.budget.limits.max_peers;
        self.peers
            .for_send(dest, max, self.cfg.recvwin_size, &mut self.out)
    }
}
