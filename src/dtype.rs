//! Element types, and the names each format gives them.
//!
//! One enum serves every reader and writer: safetensors codes (`F32`), torch dtype globals
//! (`torch.float32`) and torch.save storage classes (`FloatStorage`) all map onto it, so a cast or a
//! copy never needs to know which format a tensor came from.

use std::fmt;

/// An element type that at least one supported format can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    F8E4M3,
    F8E5M2,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    Bool,
    /// `torch.complex64`: two f32, real then imaginary.
    C64,
    /// `torch.complex128`: two f64. No safetensors code.
    C128,
    /// `torch.complex32` (`torch.chalf`): two f16. No safetensors code.
    C32,
    /// `torch.float8_e8m0fnu`: an unsigned power of two (the MX scale type); 0xFF is NaN.
    F8E8M0,
    /// `torch.float8_e4m3fnuz`: no infinities, no negative zero; 0x80 is NaN.
    F8E4M3Fnuz,
    /// `torch.float8_e5m2fnuz`: no infinities, no negative zero; 0x80 is NaN.
    F8E5M2Fnuz,
    /// `torch.float4_e2m1fn_x2`: two fp4 values packed in one byte; shapes count the bytes.
    /// No safetensors code (safetensors' `F4` counts the 4-bit values instead).
    F4E2M1X2,
}

/// One row of [`TABLE`].
struct Row {
    dtype: DType,
    /// ckpt's name for it: the safetensors code where safetensors has one, else a code in the
    /// same style (`C128`), used in messages and `inspect`.
    code: &'static str,
    /// Whether safetensors (0.8, crate and Python) has this dtype under `code`.
    in_safetensors: bool,
    /// The attribute of the `torch` module, as pickles name it (`torch.float32`).
    torch: &'static str,
    /// The legacy storage class torch.save names, or "" where torch has none: those dtypes are
    /// saved as `UntypedStorage` with `_rebuild_tensor_v3`.
    storage: &'static str,
}

const fn row(
    dtype: DType,
    code: &'static str,
    in_safetensors: bool,
    torch: &'static str,
    storage: &'static str,
) -> Row {
    Row {
        dtype,
        code,
        in_safetensors,
        torch,
        storage,
    }
}

/// Every dtype and its names. Codes, dtype names and storage classes are those safetensors 0.8
/// and torch 2.15 write (`C64`, `F8_E8M0`; `ComplexFloatStorage`; `torch.float8_e8m0fnu`).
const TABLE: &[Row] = &[
    row(DType::F64, "F64", true, "float64", "DoubleStorage"),
    row(DType::F32, "F32", true, "float32", "FloatStorage"),
    row(DType::F16, "F16", true, "float16", "HalfStorage"),
    row(DType::BF16, "BF16", true, "bfloat16", "BFloat16Storage"),
    row(DType::F8E4M3, "F8_E4M3", true, "float8_e4m3fn", ""),
    row(DType::F8E5M2, "F8_E5M2", true, "float8_e5m2", ""),
    row(DType::I64, "I64", true, "int64", "LongStorage"),
    row(DType::I32, "I32", true, "int32", "IntStorage"),
    row(DType::I16, "I16", true, "int16", "ShortStorage"),
    row(DType::I8, "I8", true, "int8", "CharStorage"),
    row(DType::U64, "U64", true, "uint64", ""),
    row(DType::U32, "U32", true, "uint32", ""),
    row(DType::U16, "U16", true, "uint16", ""),
    row(DType::U8, "U8", true, "uint8", "ByteStorage"),
    row(DType::Bool, "BOOL", true, "bool", "BoolStorage"),
    row(DType::C64, "C64", true, "complex64", "ComplexFloatStorage"),
    row(
        DType::C128,
        "C128",
        false,
        "complex128",
        "ComplexDoubleStorage",
    ),
    row(DType::C32, "C32", false, "complex32", ""),
    row(DType::F8E8M0, "F8_E8M0", true, "float8_e8m0fnu", ""),
    row(
        DType::F8E4M3Fnuz,
        "F8_E4M3FNUZ",
        true,
        "float8_e4m3fnuz",
        "",
    ),
    row(
        DType::F8E5M2Fnuz,
        "F8_E5M2FNUZ",
        true,
        "float8_e5m2fnuz",
        "",
    ),
    row(
        DType::F4E2M1X2,
        "F4_E2M1FN_X2",
        false,
        "float4_e2m1fn_x2",
        "",
    ),
];

/// Aliases torch accepts for the same dtype object (`torch.float` is `torch.float32`).
const TORCH_ALIASES: &[(&str, DType)] = &[
    ("double", DType::F64),
    ("float", DType::F32),
    ("half", DType::F16),
    ("long", DType::I64),
    ("int", DType::I32),
    ("short", DType::I16),
    ("cfloat", DType::C64),
    ("cdouble", DType::C128),
    ("chalf", DType::C32),
];

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 22] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U64,
        DType::U32,
        DType::U16,
        DType::U8,
        DType::Bool,
        DType::C64,
        DType::C128,
        DType::C32,
        DType::F8E8M0,
        DType::F8E4M3Fnuz,
        DType::F8E5M2Fnuz,
        DType::F4E2M1X2,
    ];

    fn row(self) -> &'static Row {
        // TABLE lists every variant, so the search always succeeds.
        TABLE.iter().find(|r| r.dtype == self).unwrap_or(&TABLE[0])
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::C128 => 16,
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 8,
            DType::F32 | DType::I32 | DType::U32 | DType::C32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F8E4M3
            | DType::F8E5M2
            | DType::F8E8M0
            | DType::F8E4M3Fnuz
            | DType::F8E5M2Fnuz
            | DType::F4E2M1X2
            | DType::I8
            | DType::U8
            | DType::Bool => 1,
        }
    }

    /// True for the floating-point types `--dtype` casts: f64, f32, f16, bf16, and the two
    /// OCP fp8 kinds (which widen exactly). The other fp8 kinds, fp4 and complex are left as they
    /// are: `e8m0` is a scale and `fnuz` (and packed fp4) values are quantized data whose meaning
    /// depends on tensors beside them, and a cast of complex to a real type drops the imaginary
    /// part.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// True for the types that hold real or complex numbers which `--dtype` leaves as they are
    /// (see [`DType::is_float`]): complex, `F8_E8M0`, the fnuz fp8 kinds and packed fp4.
    pub fn is_kept_by_cast(self) -> bool {
        matches!(
            self,
            DType::C64
                | DType::C128
                | DType::C32
                | DType::F8E8M0
                | DType::F8E4M3Fnuz
                | DType::F8E5M2Fnuz
                | DType::F4E2M1X2
        )
    }

    /// ckpt's code for the dtype: the safetensors code where there is one (`F32`, `BF16`,
    /// `F8_E4M3`, `BOOL`, `C64`), else `C128`, `C32` or `F4_E2M1FN_X2`.
    pub fn code(self) -> &'static str {
        self.row().code
    }

    /// The safetensors header code, e.g. `F32`, `BF16`, `F8_E4M3`, `BOOL`; `None` for the dtypes
    /// safetensors cannot hold (complex128, complex32, float4_e2m1fn_x2).
    pub fn safetensors_code(self) -> Option<&'static str> {
        let row = self.row();
        row.in_safetensors.then_some(row.code)
    }

    pub fn from_safetensors_code(code: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| r.in_safetensors && r.code == code)
            .map(|r| r.dtype)
    }

    /// The attribute of the `torch` module naming this dtype, e.g. `float32` for `torch.float32`.
    pub fn torch_name(self) -> &'static str {
        self.row().torch
    }

    pub fn from_torch_name(name: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| r.torch == name)
            .map(|r| r.dtype)
            .or_else(|| TORCH_ALIASES.iter().find(|a| a.0 == name).map(|a| a.1))
    }

    /// The legacy storage class torch.save names in `data.pkl`, e.g. `FloatStorage`; `None` for the
    /// dtypes torch saves through `UntypedStorage` instead.
    pub fn storage_class(self) -> Option<&'static str> {
        Some(self.row().storage).filter(|c| !c.is_empty())
    }

    pub fn from_storage_class(name: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| !r.storage.is_empty() && r.storage == name)
            .map(|r| r.dtype)
    }

    /// Parse a user-facing name: a ckpt code or a torch name, any case (`bf16`, `bfloat16`,
    /// `c128`, `complex128`).
    pub fn parse(name: &str) -> Option<DType> {
        let upper = name.to_ascii_uppercase();
        let lower = name.to_ascii_lowercase();
        TABLE
            .iter()
            .find(|r| r.code == upper)
            .map(|r| r.dtype)
            .or_else(|| DType::from_torch_name(&lower))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.code()), Some(d));
            if let Some(code) = d.safetensors_code() {
                assert_eq!(DType::from_safetensors_code(code), Some(d));
            }
            assert_eq!(DType::from_torch_name(d.torch_name()), Some(d));
            if let Some(class) = d.storage_class() {
                assert_eq!(DType::from_storage_class(class), Some(d));
            }
        }
        assert_eq!(TABLE.len(), DType::ALL.len());
        assert!(TABLE.iter().zip(DType::ALL).all(|(r, d)| r.dtype == d));
    }

    #[test]
    fn torch_only_dtypes_have_no_safetensors_code() {
        for d in [DType::C128, DType::C32, DType::F4E2M1X2] {
            assert_eq!(d.safetensors_code(), None);
            assert_eq!(DType::from_safetensors_code(d.code()), None);
        }
        // safetensors' F4 counts 4-bit values, not the packed pairs torch's dtype holds.
        assert_eq!(DType::from_safetensors_code("F4"), None);
        assert_eq!(DType::from_torch_name("chalf"), Some(DType::C32));
        assert_eq!(
            DType::from_storage_class("ComplexDoubleStorage"),
            Some(DType::C128)
        );
        assert_eq!(DType::C32.storage_class(), None);
    }

    #[test]
    fn user_names_parse() {
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
        assert_eq!(DType::parse("fp16"), None);
        assert_eq!(DType::parse("float32"), Some(DType::F32));
        assert_eq!(DType::parse("F8_E4M3"), Some(DType::F8E4M3));
    }
}
