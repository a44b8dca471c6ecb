//! torch.save archives (`pytorch_model.bin`, `*.pt`, and each tensor item inside a `.distcp`):
//! `data.pkl` read as data only, tensors located as byte ranges of `data/N` records.
//!
//! An archive is a ZIP whose records all sit in one folder (`archive/` for a buffer, the file stem
//! for a path): `data.pkl`, the pickled object, refers to each storage through a persistent id
//! `('storage', storage_type, key, location, numel)` whose bytes are the record `data/{key}`.
//! torch 2.15 names the storage type two ways, and both are read and written here:
//! - dtypes with a legacy storage class (`torch.FloatStorage`, `torch.BFloat16Storage`, ...) are
//!   `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`, with
//!   `numel` counted in elements;
//! - the others (float8, float4, complex32, uint16/32/64) are `_rebuild_tensor_v3(..., hooks, dtype)` over
//!   `torch.storage.UntypedStorage`, with `numel` counted in bytes.
//!
//! Reading accepts only the globals that tensors and plain data need (see [`TorchGlobals`]);
//! nested dicts flatten into key paths, and everything else is kept as a [`Value`].
//! Writing produces `data.pkl` and the record list; [`crate::zip::layout`] frames them.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::{numel, KeyPart};
use crate::pickle::{self, Globals, Limits, Object, PickleError, Protocol, Value};
use crate::zip::{self, ZipEntry, ZipRecord};

mod archive;
mod checkpoint;
mod distributed;
mod interpret;
mod legacy;
mod weights_only;
mod write;

pub(crate) use checkpoint::saved_tensor;
pub use checkpoint::{read_checkpoint, TorchSave};
pub use distributed::{LocalPiece, ShardedLeaf, Sharding};

pub use archive::{read, read_cached, read_with_extra, Archive, Extra, Leaf, SavedTensor};
pub use weights_only::TorchGlobals;

// Each part of the reader sees the others' items (they are one reader, split by job).
use archive::*;
use distributed::{allows_global, check_getattr, decode, is_process_group_state};
use interpret::*;
use legacy::*;
use weights_only::*;

#[cfg(test)]
mod tests;
pub use write::{check_key_paths, data_pkl, records, save_value, WriteLeaf};

fn bad(message: impl Into<String>) -> Error {
    Error::invalid(format!("malformed `data.pkl`: {}", message.into()))
}

fn cmp_path(a: &[KeyPart], b: &[KeyPart]) -> std::cmp::Ordering {
    fn rank(p: &KeyPart) -> (u8, &str, i64) {
        match p {
            KeyPart::Key(k) => (0, k.as_str(), 0),
            KeyPart::Index(i) => (1, "", *i),
            KeyPart::IntKey(i) => (2, "", *i),
        }
    }
    a.iter().map(rank).cmp(b.iter().map(rank))
}
