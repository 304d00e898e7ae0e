//! Atomic operations and datatypes for RMA atomics (`fi_atomic`, `fi_fetch_atomic`,
//! `fi_compare_atomic`), with libfabric's numbering, which the RDM wire protocol carries.
//!
//! An atomic operation applies `op` element-wise to `count` elements of `datatype` at the
//! target, in the target's memory, as one indivisible step with respect to other atomics and RMA
//! from the same endpoint (EFA emulates atomics in software: the target endpoint applies them in
//! the order the initiator issued them).

use crate::error::{Error, ErrorKind, Result};

/// An atomic operation (`enum fi_op`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum AtomicOp {
    /// `FI_MIN`: target = min(target, operand).
    Min,
    /// `FI_MAX`: target = max(target, operand).
    Max,
    /// `FI_SUM`: target += operand.
    Sum,
    /// `FI_PROD`: target *= operand.
    Prod,
    /// `FI_LOR`: logical or.
    Lor,
    /// `FI_LAND`: logical and.
    Land,
    /// `FI_BOR`: bitwise or (integers only).
    Bor,
    /// `FI_BAND`: bitwise and (integers only).
    Band,
    /// `FI_LXOR`: logical exclusive or.
    Lxor,
    /// `FI_BXOR`: bitwise exclusive or (integers only).
    Bxor,
    /// `FI_ATOMIC_READ`: fetch only (fetch atomics).
    Read,
    /// `FI_ATOMIC_WRITE`: target = operand.
    Write,
    /// `FI_CSWAP`: target = operand if target == compare.
    Cswap,
    /// `FI_CSWAP_NE`: target = operand if target != compare.
    CswapNe,
    /// `FI_CSWAP_LE`: target = operand if compare <= target.
    CswapLe,
    /// `FI_CSWAP_LT`: target = operand if compare < target.
    CswapLt,
    /// `FI_CSWAP_GE`: target = operand if compare >= target.
    CswapGe,
    /// `FI_CSWAP_GT`: target = operand if compare > target.
    CswapGt,
    /// `FI_MSWAP`: target = (operand & compare) | (target & !compare) (integers only).
    Mswap,
}

const OPS: [AtomicOp; 19] = [
    AtomicOp::Min,
    AtomicOp::Max,
    AtomicOp::Sum,
    AtomicOp::Prod,
    AtomicOp::Lor,
    AtomicOp::Land,
    AtomicOp::Bor,
    AtomicOp::Band,
    AtomicOp::Lxor,
    AtomicOp::Bxor,
    AtomicOp::Read,
    AtomicOp::Write,
    AtomicOp::Cswap,
    AtomicOp::CswapNe,
    AtomicOp::CswapLe,
    AtomicOp::CswapLt,
    AtomicOp::CswapGe,
    AtomicOp::CswapGt,
    AtomicOp::Mswap,
];

impl AtomicOp {
    /// libfabric's code (`FI_MIN` = 0 ... `FI_MSWAP` = 18).
    pub fn code(self) -> u32 {
        OPS.iter().position(|o| *o == self).unwrap_or(0) as u32
    }

    /// The operation of a libfabric code; unknown codes are `InvalidArgument`.
    pub fn from_code(code: u32) -> Result<AtomicOp> {
        OPS.get(code as usize).copied().ok_or_else(|| {
            Error::new(ErrorKind::InvalidArgument, "atomic op")
                .with_detail(format!("unknown code {code}"))
        })
    }

    /// True for the compare operations (`FI_CSWAP*`, `FI_MSWAP`), which take a compare operand.
    pub fn is_compare(self) -> bool {
        matches!(
            self,
            AtomicOp::Cswap
                | AtomicOp::CswapNe
                | AtomicOp::CswapLe
                | AtomicOp::CswapLt
                | AtomicOp::CswapGe
                | AtomicOp::CswapGt
                | AtomicOp::Mswap
        )
    }
}

/// An atomic datatype (`enum fi_datatype`; the complex and long-double types are not offered).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum AtomicType {
    /// `FI_INT8`.
    I8,
    /// `FI_UINT8`.
    U8,
    /// `FI_INT16`.
    I16,
    /// `FI_UINT16`.
    U16,
    /// `FI_INT32`.
    I32,
    /// `FI_UINT32`.
    U32,
    /// `FI_INT64`.
    I64,
    /// `FI_UINT64`.
    U64,
    /// `FI_FLOAT`.
    F32,
    /// `FI_DOUBLE`.
    F64,
}

const TYPES: [AtomicType; 10] = [
    AtomicType::I8,
    AtomicType::U8,
    AtomicType::I16,
    AtomicType::U16,
    AtomicType::I32,
    AtomicType::U32,
    AtomicType::I64,
    AtomicType::U64,
    AtomicType::F32,
    AtomicType::F64,
];

impl AtomicType {
    /// libfabric's code (`FI_INT8` = 0 ... `FI_DOUBLE` = 9).
    pub fn code(self) -> u32 {
        TYPES.iter().position(|t| *t == self).unwrap_or(0) as u32
    }

    /// The datatype of a libfabric code; unknown or unsupported codes are `NotSupported`.
    pub fn from_code(code: u32) -> Result<AtomicType> {
        TYPES.get(code as usize).copied().ok_or_else(|| {
            Error::new(ErrorKind::NotSupported, "atomic datatype")
                .with_detail(format!("unknown code {code}"))
        })
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            AtomicType::I8 | AtomicType::U8 => 1,
            AtomicType::I16 | AtomicType::U16 => 2,
            AtomicType::I32 | AtomicType::U32 | AtomicType::F32 => 4,
            AtomicType::I64 | AtomicType::U64 | AtomicType::F64 => 8,
        }
    }

    /// True for `F32` and `F64`.
    pub fn is_float(self) -> bool {
        matches!(self, AtomicType::F32 | AtomicType::F64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for (i, o) in OPS.iter().enumerate() {
            assert_eq!(o.code(), i as u32);
            assert_eq!(AtomicOp::from_code(i as u32).unwrap(), *o);
        }
        assert!(AtomicOp::from_code(19).is_err());
        for (i, t) in TYPES.iter().enumerate() {
            assert_eq!(t.code(), i as u32);
            assert_eq!(AtomicType::from_code(i as u32).unwrap(), *t);
        }
        assert_eq!(
            AtomicType::from_code(10).unwrap_err().kind(),
            ErrorKind::NotSupported
        );
    }
}
