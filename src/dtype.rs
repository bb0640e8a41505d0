//! Element types and reduce operations, as plain codes shared with the shim.

use crate::error::{Error, Result};

/// Element type of a buffer. The discriminants are the codes the shim passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DType {
    F32 = 0,
    F64 = 1,
    F16 = 2,
    BF16 = 3,
    I8 = 4,
    U8 = 5,
    I16 = 6,
    I32 = 7,
    I64 = 8,
    Bool = 9,
    U16 = 10,
    U32 = 11,
    U64 = 12,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    pub fn from_code(code: u8) -> Result<DType> {
        DType::ALL
            .get(code as usize)
            .copied()
            .ok_or_else(|| Error::unsupported(format!("rustc10d does not support dtype code {code}")))
    }

    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// torch's name for the dtype, for error messages.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "torch.float32",
            DType::F64 => "torch.float64",
            DType::F16 => "torch.float16",
            DType::BF16 => "torch.bfloat16",
            DType::I8 => "torch.int8",
            DType::U8 => "torch.uint8",
            DType::I16 => "torch.int16",
            DType::I32 => "torch.int32",
            DType::I64 => "torch.int64",
            DType::Bool => "torch.bool",
            DType::U16 => "torch.uint16",
            DType::U32 => "torch.uint32",
            DType::U64 => "torch.uint64",
        }
    }
}

/// The element type of a buffer an op may only move: a `DType` code, or
/// `OPAQUE_BASE` plus torch's ScalarType for a type the engine never
/// reduces (complex, float8, ...), which ranks must
/// still agree on.
pub type TypeCode = u8;

/// The type code of plain bytes (uint8), for ops on untyped buffers.
pub const BYTES: TypeCode = DType::U8 as TypeCode;

/// Where the codes of types the engine only moves start (see `TypeCode`).
pub const OPAQUE_BASE: u8 = 64;

/// A complex type's code (torch's ComplexHalf, ComplexFloat, ComplexDouble:
/// ScalarType 8, 9, 10, which the shim asserts): the real type of its two
/// parts. SUM, AVG and PREMUL_SUM (a real factor) act on each part alone, so
/// a complex tensor reduces by them as pairs of reals, as torch's all_reduce
/// hands it on and NCCL reduces it; other ops have no such form.
pub fn complex_parts(code: TypeCode) -> Option<DType> {
    match code.checked_sub(OPAQUE_BASE)? {
        8 => Some(DType::F16),
        9 => Some(DType::F32),
        10 => Some(DType::F64),
        _ => None,
    }
}

/// "torch.float32"; for a type the engine only moves, torch's ScalarType number.
pub fn type_name(code: TypeCode) -> String {
    match DType::from_code(code) {
        Ok(d) => d.torch_name().to_string(),
        Err(_) if code >= OPAQUE_BASE => format!("torch ScalarType {}", code - OPAQUE_BASE),
        Err(_) => format!("code {code}"),
    }
}

/// Reduce operation; discriminants follow `c10d::ReduceOp::RedOpType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Product = 2,
    Min = 3,
    Max = 4,
    BAnd = 5,
    BOr = 6,
    BXor = 7,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    pub fn from_code(code: u8) -> Result<ReduceOp> {
        ReduceOp::ALL.get(code as usize).copied().ok_or_else(|| {
            let name = if code == 8 { "PREMUL_SUM".to_string() } else { format!("code {code}") };
            Error::unsupported(format!("rustc10d does not support ReduceOp.{name} yet"))
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Avg => "AVG",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::BAnd => "BAND",
            ReduceOp::BOr => "BOR",
            ReduceOp::BXor => "BXOR",
        }
    }

    /// Refuse combinations with no sensible meaning before anything is sent.
    pub fn check(self, dtype: DType) -> Result<()> {
        let ok = match self {
            ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max => true,
            // Integer AVG would need a rounding rule torch does not define for c10d.
            ReduceOp::Avg => dtype.is_float(),
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => !dtype.is_float(),
        };
        if ok {
            Ok(())
        } else {
            Err(Error::unsupported(format!(
                "rustc10d does not support ReduceOp.{} on {} tensors",
                self.name(),
                dtype.torch_name()
            )))
        }
    }
}
