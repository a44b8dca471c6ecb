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
}

/// (dtype, safetensors code, torch dtype attribute, torch.save legacy storage class or "" where torch
/// has none: fp8 and wide unsigned tensors are saved as `UntypedStorage` with `_rebuild_tensor_v3`)
const TABLE: &[(DType, &str, &str, &str)] = &[
    (DType::F64, "F64", "float64", "DoubleStorage"),
    (DType::F32, "F32", "float32", "FloatStorage"),
    (DType::F16, "F16", "float16", "HalfStorage"),
    (DType::BF16, "BF16", "bfloat16", "BFloat16Storage"),
    (DType::F8E4M3, "F8_E4M3", "float8_e4m3fn", ""),
    (DType::F8E5M2, "F8_E5M2", "float8_e5m2", ""),
    (DType::I64, "I64", "int64", "LongStorage"),
    (DType::I32, "I32", "int32", "IntStorage"),
    (DType::I16, "I16", "int16", "ShortStorage"),
    (DType::I8, "I8", "int8", "CharStorage"),
    (DType::U64, "U64", "uint64", ""),
    (DType::U32, "U32", "uint32", ""),
    (DType::U16, "U16", "uint16", ""),
    (DType::U8, "U8", "uint8", "ByteStorage"),
    (DType::Bool, "BOOL", "bool", "BoolStorage"),
];

/// Aliases torch accepts for the same dtype object (`torch.float` is `torch.float32`).
const TORCH_ALIASES: &[(&str, DType)] = &[
    ("double", DType::F64),
    ("float", DType::F32),
    ("half", DType::F16),
    ("long", DType::I64),
    ("int", DType::I32),
    ("short", DType::I16),
];

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 15] = [
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
    ];

    fn row(self) -> &'static (DType, &'static str, &'static str, &'static str) {
        // TABLE lists every variant, so the search always succeeds.
        TABLE.iter().find(|r| r.0 == self).unwrap_or(&TABLE[0])
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// True for floating-point types, the ones `--dtype` casts.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F64 | DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// The safetensors header code, e.g. `F32`, `BF16`, `F8_E4M3`, `BOOL`.
    pub fn safetensors_code(self) -> &'static str {
        self.row().1
    }

    pub fn from_safetensors_code(code: &str) -> Option<DType> {
        TABLE.iter().find(|r| r.1 == code).map(|r| r.0)
    }

    /// The attribute of the `torch` module naming this dtype, e.g. `float32` for `torch.float32`.
    pub fn torch_name(self) -> &'static str {
        self.row().2
    }

    pub fn from_torch_name(name: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| r.2 == name)
            .map(|r| r.0)
            .or_else(|| TORCH_ALIASES.iter().find(|a| a.0 == name).map(|a| a.1))
    }

    /// The legacy storage class torch.save names in `data.pkl`, e.g. `FloatStorage`; `None` for the
    /// dtypes torch saves through `UntypedStorage` instead.
    pub fn storage_class(self) -> Option<&'static str> {
        Some(self.row().3).filter(|c| !c.is_empty())
    }

    pub fn from_storage_class(name: &str) -> Option<DType> {
        TABLE
            .iter()
            .find(|r| !r.3.is_empty() && r.3 == name)
            .map(|r| r.0)
    }

    /// Parse a user-facing name: a safetensors code or a torch name, any case (`bf16`, `bfloat16`).
    pub fn parse(name: &str) -> Option<DType> {
        let upper = name.to_ascii_uppercase();
        let lower = name.to_ascii_lowercase();
        DType::from_safetensors_code(&upper).or_else(|| DType::from_torch_name(&lower))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips() {
        for d in DType::ALL {
            assert_eq!(DType::from_safetensors_code(d.safetensors_code()), Some(d));
            assert_eq!(DType::from_torch_name(d.torch_name()), Some(d));
            if let Some(class) = d.storage_class() {
                assert_eq!(DType::from_storage_class(class), Some(d));
            }
        }
        assert_eq!(TABLE.len(), DType::ALL.len());
    }

    #[test]
    fn user_names_parse() {
        assert_eq!(DType::parse("bf16"), Some(DType::BF16));
        assert_eq!(DType::parse("fp16"), None);
        assert_eq!(DType::parse("float32"), Some(DType::F32));
        assert_eq!(DType::parse("F8_E4M3"), Some(DType::F8E4M3));
    }
}
