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

/// The position of `v` in `table` (a table of libfabric's numbering, in code order).
fn code_in<T: PartialEq>(table: &[T], v: T) -> u32 {
    table.iter().position(|t| *t == v).unwrap_or(0) as u32
}

/// The entry `code` of `table`; an error of `kind` for `op` when there is none.
fn by_code<T: Copy>(table: &[T], code: u32, kind: ErrorKind, op: &'static str) -> Result<T> {
    let found = usize::try_from(code).ok().and_then(|i| table.get(i));
    found
        .copied()
        .ok_or_else(|| Error::new(kind, op).with_detail(format!("unknown code {code}")))
}

/// The pattern of the compare-and-swap family (`FI_CSWAP*`, [`compare_swap`]'s operations).
macro_rules! cswap {
    () => {
        AtomicOp::Cswap
            | AtomicOp::CswapNe
            | AtomicOp::CswapLe
            | AtomicOp::CswapLt
            | AtomicOp::CswapGe
            | AtomicOp::CswapGt
    };
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
        code_in(&OPS, self)
    }

    /// The operation of a libfabric code; unknown codes are `InvalidArgument`.
    pub fn from_code(code: u32) -> Result<AtomicOp> {
        by_code(&OPS, code, ErrorKind::InvalidArgument, "atomic op")
    }

    /// True for the compare operations (`FI_CSWAP*`, `FI_MSWAP`), which take a compare operand.
    pub fn is_compare(self) -> bool {
        matches!(self, cswap!() | AtomicOp::Mswap)
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
        code_in(&TYPES, self)
    }

    /// The datatype of a libfabric code; unknown or unsupported codes are `NotSupported`.
    pub fn from_code(code: u32) -> Result<AtomicType> {
        by_code(&TYPES, code, ErrorKind::NotSupported, "atomic datatype")
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

/// The compare-and-swap family (`op` one of the `Cswap*`): `o` where the comparison of the
/// compare value `c` with the current `x` holds, else `x` unchanged.
fn compare_swap<T: PartialOrd + Copy>(op: AtomicOp, x: T, o: T, c: T) -> T {
    let hit = match op {
        AtomicOp::Cswap => c == x,
        AtomicOp::CswapNe => c != x,
        AtomicOp::CswapLe => c <= x,
        AtomicOp::CswapLt => c < x,
        AtomicOp::CswapGe => c >= x,
        AtomicOp::CswapGt => c > x,
        _ => false,
    };
    if hit { o } else { x }
}

macro_rules! int_op {
    ($t:ty, $op:expr, $x:expr, $o:expr, $c:expr) => {{
        let (x, o, c): ($t, $t, $t) = ($x, $o, $c);
        match $op {
            AtomicOp::Min => x.min(o),
            AtomicOp::Max => x.max(o),
            AtomicOp::Sum => x.wrapping_add(o),
            AtomicOp::Prod => x.wrapping_mul(o),
            AtomicOp::Lor => ((x != 0) || (o != 0)) as $t,
            AtomicOp::Land => ((x != 0) && (o != 0)) as $t,
            AtomicOp::Bor => x | o,
            AtomicOp::Band => x & o,
            AtomicOp::Lxor => ((x != 0) ^ (o != 0)) as $t,
            AtomicOp::Bxor => x ^ o,
            AtomicOp::Read => x,
            AtomicOp::Write => o,
            cswap!() => compare_swap($op, x, o, c),
            AtomicOp::Mswap => (o & c) | (x & !c),
        }
    }};
}

macro_rules! float_op {
    ($t:ty, $op:expr, $x:expr, $o:expr, $c:expr) => {{
        let (x, o, c): ($t, $t, $t) = ($x, $o, $c);
        let b = |v: bool| if v { 1.0 } else { 0.0 };
        (|| -> Option<$t> {
            Some(match $op {
                AtomicOp::Min => {
                    if o < x {
                        o
                    } else {
                        x
                    }
                }
                AtomicOp::Max => {
                    if o > x {
                        o
                    } else {
                        x
                    }
                }
                AtomicOp::Sum => x + o,
                AtomicOp::Prod => x * o,
                AtomicOp::Lor => b(x != 0.0 || o != 0.0),
                AtomicOp::Land => b(x != 0.0 && o != 0.0),
                AtomicOp::Lxor => b((x != 0.0) ^ (o != 0.0)),
                AtomicOp::Read => x,
                AtomicOp::Write => o,
                cswap!() => compare_swap($op, x, o, c),
                AtomicOp::Bor | AtomicOp::Band | AtomicOp::Bxor | AtomicOp::Mswap => return None,
            })
        })()
    }};
}

/// One atomic as its target applies it: the operation, the element type and the operands (what
/// [`RmaMemory::atomic`](crate::proto::engine::RmaMemory::atomic) is given).
#[derive(Clone, Copy, Debug)]
pub struct AtomicArgs<'a> {
    /// The operation.
    pub op: AtomicOp,
    /// The element type.
    pub datatype: AtomicType,
    /// Operand elements, little-endian (for [`AtomicOp::Read`], a buffer of the length to fetch).
    pub operand: &'a [u8],
    /// Compare elements (compare operations only).
    pub compare: Option<&'a [u8]>,
}

impl AtomicArgs<'_> {
    /// True when the operation hands back the previous values (fetch and compare atomics,
    /// and reads): the target needs `REMOTE_READ` too.
    pub fn fetches(&self) -> bool {
        self.op == AtomicOp::Read || self.op.is_compare()
    }
}

/// Checks that `op` is defined on `datatype` and the operands have whole, equal numbers of
/// elements. `InvalidArgument` otherwise.
pub fn validate(
    op: AtomicOp,
    datatype: AtomicType,
    len: usize,
    operand: &[u8],
    compare: Option<&[u8]>,
) -> Result<()> {
    let size = datatype.size();
    let bad = |why: String| Err(Error::new(ErrorKind::InvalidArgument, "atomic").with_detail(why));
    if len == 0 || !len.is_multiple_of(size) {
        return bad(format!(
            "{len} bytes is not a whole number of {datatype:?} elements"
        ));
    }
    if op != AtomicOp::Read && operand.len() != len {
        return bad(format!(
            "operand of {} bytes for {len} bytes",
            operand.len()
        ));
    }
    match (op.is_compare(), compare) {
        (true, Some(c)) if c.len() == len => {}
        (true, _) => return bad(format!("{op:?} needs a compare operand of {len} bytes")),
        (false, Some(_)) => return bad(format!("{op:?} takes no compare operand")),
        (false, None) => {}
    }
    if datatype.is_float()
        && matches!(
            op,
            AtomicOp::Bor | AtomicOp::Band | AtomicOp::Bxor | AtomicOp::Mswap
        )
    {
        return bad(format!("{op:?} is not defined on {datatype:?}"));
    }
    Ok(())
}

/// Applies `op` element-wise to `target` (little-endian elements of `datatype`) with `operand`
/// and, for compare operations, `compare`, as libfabric defines the operations (integers wrap).
/// `target` is left unchanged when the arguments are invalid (see [`validate`]).
///
/// ```
/// use efa::atomic::{apply, AtomicOp, AtomicType};
/// let mut t = 5u32.to_le_bytes();
/// apply(AtomicOp::Sum, AtomicType::U32, &mut t, &7u32.to_le_bytes(), None).unwrap();
/// assert_eq!(u32::from_le_bytes(t), 12);
/// apply(AtomicOp::Cswap, AtomicType::U32, &mut t, &1u32.to_le_bytes(), Some(&12u32.to_le_bytes())).unwrap();
/// assert_eq!(u32::from_le_bytes(t), 1);
/// ```
pub fn apply(
    op: AtomicOp,
    datatype: AtomicType,
    target: &mut [u8],
    operand: &[u8],
    compare: Option<&[u8]>,
) -> Result<()> {
    validate(op, datatype, target.len(), operand, compare)?;
    if op == AtomicOp::Read {
        return Ok(());
    }
    let size = datatype.size();
    for i in 0..target.len() / size {
        let r = i * size..(i + 1) * size;
        let c = compare.map(|c| &c[r.clone()]);
        macro_rules! int {
            ($t:ty) => {{
                let get = |b: &[u8]| <$t>::from_le_bytes(b.try_into().unwrap_or_default());
                let v = int_op!(
                    $t,
                    op,
                    get(&target[r.clone()]),
                    get(&operand[r.clone()]),
                    c.map_or(0, get)
                );
                target[r.clone()].copy_from_slice(&v.to_le_bytes());
            }};
        }
        macro_rules! float {
            ($t:ty) => {{
                let get = |b: &[u8]| <$t>::from_le_bytes(b.try_into().unwrap_or_default());
                let Some(v) = float_op!(
                    $t,
                    op,
                    get(&target[r.clone()]),
                    get(&operand[r.clone()]),
                    c.map_or(0.0, get)
                ) else {
                    return Err(Error::new(ErrorKind::InvalidArgument, "atomic"));
                };
                target[r.clone()].copy_from_slice(&v.to_le_bytes());
            }};
        }
        match datatype {
            AtomicType::I8 => int!(i8),
            AtomicType::U8 => int!(u8),
            AtomicType::I16 => int!(i16),
            AtomicType::U16 => int!(u16),
            AtomicType::I32 => int!(i32),
            AtomicType::U32 => int!(u32),
            AtomicType::I64 => int!(i64),
            AtomicType::U64 => int!(u64),
            AtomicType::F32 => float!(f32),
            AtomicType::F64 => float!(f64),
        }
    }
    Ok(())
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

    fn one(op: AtomicOp, dt: AtomicType, x: &[u8], o: &[u8], c: Option<&[u8]>) -> Vec<u8> {
        let mut t = x.to_vec();
        apply(op, dt, &mut t, o, c).unwrap();
        t
    }

    #[test]
    fn integer_ops_follow_libfabric() {
        let u = |v: u32| v.to_le_bytes();
        let t = AtomicType::U32;
        let cases = [
            (AtomicOp::Min, 5, 3, 0, 3),
            (AtomicOp::Max, 5, 3, 0, 5),
            (AtomicOp::Sum, u32::MAX, 2, 0, 1),
            (AtomicOp::Prod, 6, 7, 0, 42),
            (AtomicOp::Lor, 0, 9, 0, 1),
            (AtomicOp::Land, 4, 0, 0, 0),
            (AtomicOp::Bor, 0b1010, 0b0101, 0, 0b1111),
            (AtomicOp::Band, 0b1110, 0b0111, 0, 0b0110),
            (AtomicOp::Lxor, 3, 3, 0, 0),
            (AtomicOp::Bxor, 0b1100, 0b1010, 0, 0b0110),
            (AtomicOp::Write, 1, 2, 0, 2),
            (AtomicOp::Cswap, 5, 9, 5, 9),
            (AtomicOp::Cswap, 5, 9, 4, 5),
            (AtomicOp::CswapNe, 5, 9, 4, 9),
            (AtomicOp::CswapLe, 5, 9, 5, 9),
            (AtomicOp::CswapLt, 5, 9, 5, 5),
            (AtomicOp::CswapGe, 5, 9, 6, 9),
            (AtomicOp::CswapGt, 5, 9, 5, 5),
            (AtomicOp::Mswap, 0xff00, 0x1234, 0x0ff0, 0xf230),
        ];
        for (op, x, o, c, want) in cases {
            let cmp = op.is_compare().then(|| u(c));
            let got = one(op, t, &u(x), &u(o), cmp.as_ref().map(|c| &c[..]));
            assert_eq!(got, u(want).to_vec(), "{op:?}");
        }
        // Signed minimum, several elements.
        let x: Vec<u8> = [-3i16, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        let o: Vec<u8> = [2i16, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let want: Vec<u8> = [-3i16, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(one(AtomicOp::Min, AtomicType::I16, &x, &o, None), want);
    }

    #[test]
    fn float_ops_and_refusals() {
        let f = |v: f64| v.to_le_bytes();
        let got = one(AtomicOp::Sum, AtomicType::F64, &f(1.5), &f(2.25), None);
        assert_eq!(got, f(3.75).to_vec());
        let got = one(AtomicOp::Min, AtomicType::F64, &f(1.5), &f(-2.0), None);
        assert_eq!(got, f(-2.0).to_vec());
        let mut t = 1.0f32.to_le_bytes();
        for op in [AtomicOp::Bor, AtomicOp::Band, AtomicOp::Bxor] {
            let e = apply(op, AtomicType::F32, &mut t, &2.0f32.to_le_bytes(), None).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        }
        assert_eq!(t, 1.0f32.to_le_bytes());
        // Lengths.
        let mut t = [0u8; 6];
        assert!(apply(AtomicOp::Sum, AtomicType::U32, &mut t, &[0; 6], None).is_err());
        let mut t = [0u8; 4];
        assert!(apply(AtomicOp::Cswap, AtomicType::U32, &mut t, &[0; 4], None).is_err());
        assert!(
            apply(
                AtomicOp::Sum,
                AtomicType::U32,
                &mut t,
                &[0; 4],
                Some(&[0; 4])
            )
            .is_err()
        );
    }

    proptest::proptest! {
        #[test]
        fn sum_matches_a_reference(xs in proptest::collection::vec(proptest::num::i64::ANY, 1..8),
                                   os in proptest::collection::vec(proptest::num::i64::ANY, 8)) {
            let x: Vec<u8> = xs.iter().flat_map(|v| v.to_le_bytes()).collect();
            let o: Vec<u8> = os[..xs.len()].iter().flat_map(|v| v.to_le_bytes()).collect();
            let got = one(AtomicOp::Sum, AtomicType::I64, &x, &o, None);
            let want: Vec<u8> = xs.iter().zip(&os).flat_map(|(a, b)| a.wrapping_add(*b).to_le_bytes()).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }
}
