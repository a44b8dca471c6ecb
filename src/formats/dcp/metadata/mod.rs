//! DCP `.metadata`: the pickled `torch.distributed.checkpoint.metadata.Metadata`, read into typed
//! structs and written back in the form PyTorch's `FileSystemReader` loads.
//!
//! The file is a pickle of dataclasses, so it is read with the data-only reader under a whitelist of
//! exactly the globals DCP writes (current and older module paths, see [`DcpGlobals`]); anything else
//! is refused by name before any meaning is read out of the tree. The writer describes the same object
//! graph torch 2.15 pickles (protocol 4) item by item to a [`pickle::Stream`], so no tree of it is
//! ever built (that would cost kilobytes per tensor piece, and a reshard can have millions).
//!
//! What is not kept: `TensorProperties` besides the dtype (layout must be strided; `requires_grad`,
//! `memory_format`, `pin_memory` and `strides` are informational and unused when torch loads), and
//! `storage_meta` (save and load ids, the original directory), which torch never reads back.

mod read;
mod write;

pub use read::{parse, parse_into, Rest, Sink};
pub use write::{write, write_to, Describe, EntryRef, StorageRef};

use crate::dtype::DType;
use crate::model::KeyPart;
use crate::pickle::Globals;

/// The parts of DCP's `Metadata` ckpt uses, in pickled order.
#[derive(Clone, Debug, PartialEq)]
pub struct DcpMetadata {
    /// `state_dict_metadata`, in pickled order.
    pub entries: Vec<DcpEntry>,
    /// `storage_data`: where each item's bytes are.
    pub storage: Vec<(MetadataIndex, StorageInfo)>,
    /// `planner_data`: fqn -> nesting path in the original state dict.
    pub planner_data: Vec<(String, Vec<KeyPart>)>,
    /// `version`, e.g. "1.0.0".
    pub version: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum DcpEntry {
    /// `TensorStorageMetadata`
    Tensor {
        fqn: String,
        dtype: DType,
        size: Vec<u64>,
        chunks: Vec<Chunk>,
    },
    /// `BytesStorageMetadata`
    Bytes { fqn: String },
    /// `TensorStorageMetadata` of a dtype ckpt does not support, named as the pickle names it
    /// (`torch.bits8`); kept so that a selection can leave it out.
    Unsupported { fqn: String, dtype: String },
}

/// `ChunkStorageMetadata`: a box of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

/// `MetadataIndex(fqn, offset, index)`; `offset` is the chunk's offsets for tensors, `None` for bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetadataIndex {
    pub fqn: String,
    pub offset: Option<Vec<u64>>,
    pub index: Option<i64>,
}

/// `_StorageInfo(relative_path, offset, length, transform_descriptors)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageInfo {
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
    /// e.g. `["stream.zstd/1"]`; empty when absent.
    pub transforms: Vec<String>,
}

/// What a format built on DCP adds to `.metadata` (megatron-core pickles subclasses of
/// `Metadata` and `SavePlan` with a `mcore_data` field): the classes of its own the pickle may
/// name, and the fields of its `Metadata` it wants back. DCP's reader calls it and never names
/// the format that fills it.
pub trait Extension: Sync {
    /// Whether the pickle may name `module.name` (a class of the derived format, read as data).
    fn allows(&self, module: &str, name: &str) -> bool;
    /// Whether such a class is a subclass of DCP's `Metadata`, which the pickle's root may be.
    fn is_metadata(&self, module: &str, name: &str) -> bool;
    /// Whether such a class is unhashable in Python (a dataclass without `frozen`).
    fn unhashable(&self, module: &str, name: &str) -> bool;
    /// Fields of `Metadata` DCP does not define that [`Rest::fields`] should hand back.
    fn fields(&self) -> &[&str];
}

/// Plain DCP: no classes or fields beyond DCP's own.
pub struct NoExtension;

impl Extension for NoExtension {
    fn allows(&self, _: &str, _: &str) -> bool {
        false
    }
    fn is_metadata(&self, _: &str, _: &str) -> bool {
        false
    }
    fn unhashable(&self, _: &str, _: &str) -> bool {
        false
    }
    fn fields(&self) -> &[&str] {
        &[]
    }
}

/// Where DCP defines its classes now, and where torch 1.13 defined them (`torch.distributed._shard`
/// re-exports the new module under the old name, so such files still load in torch).
pub(super) const META: &str = "torch.distributed.checkpoint.metadata";
pub(super) const OLD_META: &str = "torch.distributed._shard.checkpoint.metadata";
/// `TensorProperties` and its memory-format enum lived here until DCP got its own copy (torch 2.2).
pub(super) const SHARDED_TENSOR_META: &str = "torch.distributed._shard.sharded_tensor.metadata";
pub(super) const FS: &str = "torch.distributed.checkpoint.filesystem";
/// `SavePlan` and its parts: Megatron-core stores every rank's plan in `Metadata.all_local_plans`.
pub(super) const PLANNER: &str = "torch.distributed.checkpoint.planner";
pub(super) const OLD_FS: &str = "torch.distributed._shard.checkpoint.filesystem";

/// Every dtype torch 2.15 has. All are names of data-only objects, so allowing them is harmless, and
/// it lets an unsupported one (`torch.complex64`) be reported against the tensor that has it.
pub(super) const TORCH_DTYPES: &[&str] = &[
    "bcomplex32",
    "bfloat16",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bool",
    "complex128",
    "complex32",
    "complex64",
    "float16",
    "float32",
    "float4_e2m1fn_x2",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int1",
    "int16",
    "int2",
    "int3",
    "int32",
    "int4",
    "int5",
    "int6",
    "int64",
    "int7",
    "int8",
    "qint32",
    "qint8",
    "quint2x4",
    "quint4x2",
    "quint8",
    "uint1",
    "uint16",
    "uint2",
    "uint3",
    "uint32",
    "uint4",
    "uint5",
    "uint6",
    "uint64",
    "uint7",
    "uint8",
];

/// The globals a DCP `.metadata` may name: DCP's own classes, `torch.Size`, dtypes and layouts,
/// the `pathlib` classes `StorageMeta.checkpoint_id` pickles as (`pathlib._local` is where
/// Python 3.13 defined them), the planner dataclasses that a derived format's `all_local_plans`
/// holds, and what the derived format's [`Extension`] allows. All are plain dataclasses and an
/// enum, read as data; ckpt reads nothing from the plans.
pub struct DcpGlobals<'e> {
    pub extension: &'e dyn Extension,
}

impl DcpGlobals<'static> {
    /// Plain DCP's globals, without a derived format's.
    pub const PLAIN: DcpGlobals<'static> = DcpGlobals {
        extension: &NoExtension,
    };
}

impl Globals for DcpGlobals<'_> {
    fn allows(&self, module: &str, name: &str) -> bool {
        if self.extension.allows(module, name) {
            return true;
        }
        match module {
            META | OLD_META => matches!(
                name,
                "Metadata"
                    | "TensorStorageMetadata"
                    | "BytesStorageMetadata"
                    | "ChunkStorageMetadata"
                    | "TensorProperties"
                    | "MetadataIndex"
                    | "StorageMeta"
                    | "_MEM_FORMAT_ENCODING"
            ),
            SHARDED_TENSOR_META => matches!(name, "TensorProperties" | "MEM_FORMAT_ENCODING"),
            FS | OLD_FS => name == "_StorageInfo",
            PLANNER => matches!(
                name,
                "SavePlan" | "WriteItem" | "WriteItemType" | "TensorWriteData"
            ),
            "torch" => name == "Size" || TORCH_DTYPES.contains(&name),
            "torch.serialization" => name == "_get_layout",
            "collections" => name == "OrderedDict",
            "pathlib" | "pathlib._local" => matches!(
                name,
                "Path"
                    | "PosixPath"
                    | "WindowsPath"
                    | "PurePath"
                    | "PurePosixPath"
                    | "PureWindowsPath"
            ),
            _ => false,
        }
    }

    /// `FileSystemReader.read_metadata` is a plain `pickle.load`, which refuses persistent ids.
    fn allows_persistent_ids(&self) -> bool {
        false
    }

    /// DCP's dataclasses other than the frozen `MetadataIndex`, and `OrderedDict`.
    fn unhashable(&self, module: &str, name: &str) -> bool {
        if self.extension.unhashable(module, name) {
            return true;
        }
        match module {
            META | OLD_META => matches!(
                name,
                "Metadata"
                    | "TensorStorageMetadata"
                    | "BytesStorageMetadata"
                    | "ChunkStorageMetadata"
                    | "TensorProperties"
                    | "StorageMeta"
            ),
            SHARDED_TENSOR_META => name == "TensorProperties",
            FS | OLD_FS => name == "_StorageInfo",
            "collections" => name == "OrderedDict",
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests;
