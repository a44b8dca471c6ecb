//! DCP `.metadata`: the pickled `torch.distributed.checkpoint.metadata.Metadata`, read into typed
//! structs and written back in the form PyTorch's `FileSystemReader` loads.

use crate::dtype::DType;
use crate::error::Result;
use crate::model::KeyPart;

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
    Tensor { fqn: String, dtype: DType, size: Vec<u64>, chunks: Vec<Chunk> },
    /// `BytesStorageMetadata`
    Bytes { fqn: String },
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

/// Parse `.metadata` bytes. Never executes anything; unknown globals are errors naming them.
pub fn parse(_bytes: &[u8]) -> Result<DcpMetadata> {
    todo!("dcp metadata reader")
}

/// Serialize metadata as PyTorch writes it (pickle protocol 4 of the real classes).
pub fn write(_meta: &DcpMetadata) -> Vec<u8> {
    todo!("dcp metadata writer")
}
