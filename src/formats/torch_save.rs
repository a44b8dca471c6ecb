//! torch.save archives (`pytorch_model.bin`, `*.pt`, and each tensor item inside a `.distcp`):
//! `data.pkl` read as data only, tensors located as byte ranges of `data/N` records.
//!
//! (Being written: the API below is final, the bodies are not.)

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::zip::{ZipEntry, ZipRecord};
use crate::model::KeyPart;
use crate::pickle::Value;

/// One tensor as `data.pkl` describes it: a view into a storage record.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedTensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Stride of each dimension, in elements.
    pub strides: Vec<u64>,
    /// Offset of the first element in the storage, in elements.
    pub storage_offset: u64,
    /// The storage record key: the data is `{prefix}/data/{storage_key}`.
    pub storage_key: String,
    /// Elements (of `dtype`) in the whole storage record.
    pub storage_numel: u64,
}

/// What a key path of the saved object leads to.
#[derive(Clone, Debug, PartialEq)]
pub enum Leaf {
    Tensor(SavedTensor),
    Value(Value),
}

/// A parsed torch.save archive.
#[derive(Clone, Debug, PartialEq)]
pub struct Archive {
    /// The folder every record is in (`archive`, or the file stem torch was given).
    pub prefix: String,
    pub entries: Vec<ZipEntry>,
    pub leaves: Vec<(Vec<KeyPart>, Leaf)>,
}

impl Archive {
    /// The record holding storage `key`.
    pub fn storage(&self, key: &str) -> Option<&ZipEntry> {
        let name = format!("{}/data/{key}", self.prefix);
        self.entries.iter().find(|e| e.name == name)
    }
}

/// Read a torch.save archive that spans exactly `bytes`.
pub fn read(_bytes: &[u8]) -> Result<Archive> {
    Err(Error::invalid("torch.save reading is not implemented yet"))
}

/// One leaf to write.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteLeaf {
    Tensor { dtype: DType, shape: Vec<u64>, storage_key: String },
    Value(Value),
}

/// The `data.pkl` of an archive holding `items`.
pub fn data_pkl(_items: &[(Vec<KeyPart>, WriteLeaf)]) -> Vec<u8> {
    Vec::new()
}

/// The records of an archive, in torch's order.
pub fn records(_prefix: &str, _data_pkl: Vec<u8>, _storages: &[(String, u64)]) -> Vec<ZipRecord> {
    Vec::new()
}
