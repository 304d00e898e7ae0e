//! Queue-pair bring-up as a typestate: RESET → INIT → RTR → RTS, each step one `ibv_modify_qp`
//! with the attribute mask EFA expects (libfabric's `efa_base_ep_modify_qp_rst2rts`):
//!
//! | step          | mask                                       | values                       |
//! |---------------|--------------------------------------------|------------------------------|
//! | RESET → INIT  | `STATE \| PKEY_INDEX \| PORT \| QKEY`       | pkey index 0, port 1, QKEY   |
//! | INIT → RTR    | `STATE`                                    |                              |
//! | RTR → RTS     | `STATE \| SQ_PSN` (`\| RNR_RETRY` for SRD)  | sq_psn 0, RNR retry count    |
//!
//! `RNR_RETRY` is set only on SRD queue pairs of a device that can modify it
//! (`EFADV_DEVICE_ATTR_CAPS_RNR_RETRY`); UD queue pairs never retry.
//!
//! The verbs are reached through [`QpOps`], so the sequence is tested against a fake that records
//! every call.

use std::marker::PhantomData;

use super::verbs_error;
use crate::device::QpType;
use crate::error::Result;

/// `enum ibv_qp_attr_mask` bits used here (values fixed by the verbs ABI).
pub mod mask {
    /// `IBV_QP_STATE`.
    pub const STATE: u32 = 1 << 0;
    /// `IBV_QP_PKEY_INDEX`.
    pub const PKEY_INDEX: u32 = 1 << 4;
    /// `IBV_QP_PORT`.
    pub const PORT: u32 = 1 << 5;
    /// `IBV_QP_QKEY`.
    pub const QKEY: u32 = 1 << 6;
    /// `IBV_QP_RNR_RETRY`.
    pub const RNR_RETRY: u32 = 1 << 11;
    /// `IBV_QP_SQ_PSN`.
    pub const SQ_PSN: u32 = 1 << 16;

    /// `STATE|PORT|...` for messages.
    pub fn describe(m: u32) -> String {
        let names = [
            (STATE, "STATE"),
            (PKEY_INDEX, "PKEY_INDEX"),
            (PORT, "PORT"),
            (QKEY, "QKEY"),
            (RNR_RETRY, "RNR_RETRY"),
            (SQ_PSN, "SQ_PSN"),
        ];
        let mut out: Vec<String> = names
            .iter()
            .filter(|(b, _)| m & b != 0)
            .map(|(_, n)| (*n).to_string())
            .collect();
        let rest = m & !names.iter().fold(0, |a, (b, _)| a | b);
        if rest != 0 {
            out.push(format!("{rest:#x}"));
        }
        out.join("|")
    }
}

// The masks must be the verbs ABI values.
const _: () = {
    use rdma_sys::ibv_qp_attr_mask as m;
    assert!(mask::STATE == m::IBV_QP_STATE.0);
    assert!(mask::PKEY_INDEX == m::IBV_QP_PKEY_INDEX.0);
    assert!(mask::PORT == m::IBV_QP_PORT.0);
    assert!(mask::QKEY == m::IBV_QP_QKEY.0);
    assert!(mask::RNR_RETRY == m::IBV_QP_RNR_RETRY.0);
    assert!(mask::SQ_PSN == m::IBV_QP_SQ_PSN.0);
};

/// A queue pair state (`enum ibv_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// `IBV_QPS_INIT`.
    Init,
    /// `IBV_QPS_RTR`.
    Rtr,
    /// `IBV_QPS_RTS`.
    Rts,
    /// `IBV_QPS_ERR`.
    Err,
}

impl QpState {
    /// The verbs value.
    pub fn ibv(self) -> u32 {
        use rdma_sys::ibv_qp_state::*;
        match self {
            QpState::Init => IBV_QPS_INIT,
            QpState::Rtr => IBV_QPS_RTR,
            QpState::Rts => IBV_QPS_RTS,
            QpState::Err => IBV_QPS_ERR,
        }
    }
}

/// One `ibv_modify_qp` call: the target state, the attribute mask and the attribute values the
/// mask selects (the others are zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModifyQp {
    /// Target state.
    pub state: QpState,
    /// `ibv_qp_attr_mask` bits.
    pub mask: u32,
    /// P_Key index (always 0 on EFA).
    pub pkey_index: u16,
    /// Port (always 1 on EFA).
    pub port_num: u8,
    /// QKEY.
    pub qkey: u32,
    /// Send queue PSN.
    pub sq_psn: u32,
    /// RNR retry count, 0..=7 (7 = retry forever).
    pub rnr_retry: u8,
}

impl ModifyQp {
    fn to(state: QpState, mask: u32) -> ModifyQp {
        ModifyQp {
            state,
            mask,
            pkey_index: 0,
            port_num: 0,
            qkey: 0,
            sq_psn: 0,
            rnr_retry: 0,
        }
    }
}

/// The verbs a bring-up needs: the real implementation calls `ibv_modify_qp`, tests record.
pub trait QpOps {
    /// Applies one state transition; `Err(errno)` when the verb fails.
    fn modify_qp(&mut self, m: &ModifyQp) -> std::result::Result<(), i32>;
}

/// What a bring-up sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BringUpPlan {
    /// SRD or UD.
    pub qp_type: QpType,
    /// The queue pair's QKEY.
    pub qkey: u32,
    /// RNR retry count (clamped to 7).
    pub rnr_retry: u8,
    /// The device can modify the RNR retry count (`EFADV_DEVICE_ATTR_CAPS_RNR_RETRY`).
    pub rnr_retry_modifiable: bool,
}

/// Typestate marker: the queue pair is in RESET (just created).
#[derive(Debug)]
pub struct Reset;
/// Typestate marker: INIT.
#[derive(Debug)]
pub struct Init;
/// Typestate marker: ready to receive.
#[derive(Debug)]
pub struct Rtr;
/// Typestate marker: ready to send.
#[derive(Debug)]
pub struct Rts;

/// A queue pair being brought up; the type parameter is the state it is in.
pub struct BringUp<'a, O: QpOps, S> {
    ops: &'a mut O,
    plan: BringUpPlan,
    _state: PhantomData<S>,
}

impl<'a, O: QpOps, S> BringUp<'a, O, S> {
    fn step<T>(self, m: ModifyQp, op: &'static str) -> Result<BringUp<'a, O, T>> {
        if let Err(errno) = self.ops.modify_qp(&m) {
            return Err(verbs_error(op, errno)
                .with_detail(format!("{op} with mask {} failed", mask::describe(m.mask))));
        }
        Ok(BringUp {
            ops: self.ops,
            plan: self.plan,
            _state: PhantomData,
        })
    }
}

impl<'a, O: QpOps> BringUp<'a, O, Reset> {
    /// A queue pair in RESET.
    pub fn new(ops: &'a mut O, plan: BringUpPlan) -> Self {
        BringUp {
            ops,
            plan,
            _state: PhantomData,
        }
    }

    /// RESET → INIT: pkey index 0, port 1, the QKEY.
    pub fn init(self) -> Result<BringUp<'a, O, Init>> {
        let mut m = ModifyQp::to(
            QpState::Init,
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY,
        );
        m.port_num = 1;
        m.qkey = self.plan.qkey;
        self.step(m, "ibv_modify_qp(RESET->INIT)")
    }
}

impl<'a, O: QpOps> BringUp<'a, O, Init> {
    /// INIT → RTR.
    pub fn rtr(self) -> Result<BringUp<'a, O, Rtr>> {
        self.step(
            ModifyQp::to(QpState::Rtr, mask::STATE),
            "ibv_modify_qp(INIT->RTR)",
        )
    }
}

impl<'a, O: QpOps> BringUp<'a, O, Rtr> {
    /// RTR → RTS: send PSN 0, and the RNR retry count on SRD queue pairs when the device can set it.
    pub fn rts(self) -> Result<BringUp<'a, O, Rts>> {
        let mut m = ModifyQp::to(QpState::Rts, mask::STATE | mask::SQ_PSN);
        if self.plan.qp_type == QpType::Srd && self.plan.rnr_retry_modifiable {
            m.mask |= mask::RNR_RETRY;
            m.rnr_retry = self.plan.rnr_retry.min(7);
        }
        self.step(m, "ibv_modify_qp(RTR->RTS)")
    }
}

/// RESET → INIT → RTR → RTS.
pub fn bring_up<O: QpOps>(ops: &mut O, plan: BringUpPlan) -> Result<()> {
    BringUp::new(ops, plan).init()?.rtr()?.rts()?;
    Ok(())
}

/// Moves a queue pair to ERR, which makes the device stop it (used on close).
pub fn to_error<O: QpOps>(ops: &mut O) -> Result<()> {
    let m = ModifyQp::to(QpState::Err, mask::STATE);
    ops.modify_qp(&m)
        .map_err(|errno| verbs_error("ibv_modify_qp(->ERR)", errno))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    /// Records every call; fails the `fail_at`-th one (0-based) with `errno`.
    #[derive(Default)]
    struct Fake {
        calls: Vec<ModifyQp>,
        fail_at: Option<(usize, i32)>,
    }

    impl QpOps for Fake {
        fn modify_qp(&mut self, m: &ModifyQp) -> std::result::Result<(), i32> {
            let i = self.calls.len();
            self.calls.push(*m);
            match self.fail_at {
                Some((n, errno)) if n == i => Err(errno),
                _ => Ok(()),
            }
        }
    }

    fn plan(qp_type: QpType, rnr: bool) -> BringUpPlan {
        BringUpPlan {
            qp_type,
            qkey: 0x1234_5678,
            rnr_retry: 3,
            rnr_retry_modifiable: rnr,
        }
    }

    #[test]
    fn srd_sets_rnr_retry_when_supported() {
        let mut f = Fake::default();
        bring_up(&mut f, plan(QpType::Srd, true)).unwrap();
        let states: Vec<QpState> = f.calls.iter().map(|c| c.state).collect();
        assert_eq!(states, [QpState::Init, QpState::Rtr, QpState::Rts]);
        let init = f.calls[0];
        assert_eq!(
            init.mask,
            mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY
        );
        assert_eq!(init.mask, 0x71);
        assert_eq!(
            (init.pkey_index, init.port_num, init.qkey),
            (0, 1, 0x1234_5678)
        );
        assert_eq!(f.calls[1].mask, mask::STATE);
        let rts = f.calls[2];
        assert_eq!(rts.mask, mask::STATE | mask::SQ_PSN | mask::RNR_RETRY);
        assert_eq!(rts.mask, 0x10801);
        assert_eq!((rts.sq_psn, rts.rnr_retry), (0, 3));
    }

    #[test]
    fn srd_without_rnr_cap_and_ud_never_set_rnr_retry() {
        for p in [
            plan(QpType::Srd, false),
            plan(QpType::Ud, true),
            plan(QpType::Ud, false),
        ] {
            let mut f = Fake::default();
            bring_up(&mut f, p).unwrap();
            assert_eq!(f.calls.len(), 3);
            assert_eq!(f.calls[0].mask, 0x71, "{p:?}");
            assert_eq!(f.calls[2].mask, mask::STATE | mask::SQ_PSN, "{p:?}");
            assert_eq!(f.calls[2].rnr_retry, 0);
        }
    }

    #[test]
    fn rnr_retry_is_clamped_to_seven() {
        let mut f = Fake::default();
        let mut p = plan(QpType::Srd, true);
        p.rnr_retry = 200;
        bring_up(&mut f, p).unwrap();
        assert_eq!(f.calls[2].rnr_retry, 7);
    }

    #[test]
    fn a_failing_step_names_the_verb_and_the_step() {
        let steps = [
            ("ibv_modify_qp(RESET->INIT)", "STATE|PKEY_INDEX|PORT|QKEY"),
            ("ibv_modify_qp(INIT->RTR)", "STATE"),
            ("ibv_modify_qp(RTR->RTS)", "STATE|RNR_RETRY|SQ_PSN"),
        ];
        for (i, (op, masks)) in steps.iter().enumerate() {
            let mut f = Fake {
                fail_at: Some((i, 22)),
                ..Fake::default()
            };
            let e = bring_up(&mut f, plan(QpType::Srd, true)).unwrap_err();
            assert_eq!(e.op(), *op);
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert!(e.detail().unwrap().contains(masks), "{e}");
            assert_eq!(f.calls.len(), i + 1, "no step after the failing one");
            let text = format!("{e:#}");
            assert!(
                text.contains(op) && text.contains("Invalid argument"),
                "{text}"
            );
        }
        let mut f = Fake {
            fail_at: Some((0, 12)),
            ..Fake::default()
        };
        assert_eq!(
            bring_up(&mut f, plan(QpType::Ud, false))
                .unwrap_err()
                .kind(),
            ErrorKind::NoMemory
        );
    }

    #[test]
    fn to_error_state() {
        let mut f = Fake::default();
        to_error(&mut f).unwrap();
        assert_eq!(f.calls[0].state, QpState::Err);
        assert_eq!(f.calls[0].mask, mask::STATE);
        assert_eq!(QpState::Err.ibv(), 6);
        assert_eq!(QpState::Rts.ibv(), 3);
    }

    #[test]
    fn mask_names() {
        assert_eq!(mask::describe(0x71), "STATE|PKEY_INDEX|PORT|QKEY");
        assert_eq!(mask::describe(1 << 30 | 1), "STATE|0x40000000");
    }
}
