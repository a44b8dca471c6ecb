//! A full `torch.save` file as a checkpoint: the torch.save layout.

use std::path::{Path, PathBuf};

use super::Leaf;
use crate::error::{Error, Result};
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{
    Checkpoint, DataRef, Encoding, Format, KeyPart, NonTensor, Piece, Pieces, Tensor, Unsupported,
};
use crate::pickle::opcodes;
use crate::storage::{self, Access};

/// Names a directory's one torch.save file goes by.
const FILE_NAMES: [&str; 3] = ["pytorch_model.bin", "model.pt", "consolidated.pth"];

/// A `torch.save` file (ZIP or the legacy format), given or by its usual name in a directory.
pub struct TorchSave;

impl Layout for TorchSave {
    fn describe(&self) -> &'static str {
        "torch.save files (`pytorch_model.bin`, `*.pt`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        match at {
            Listing::File(f) => Ok(is_torch_save(&f.path)?.then(|| Found::at(&f.path))),
            Listing::Dir { .. } => Ok(FILE_NAMES
                .iter()
                .find_map(|name| at.file_named(name))
                .map(|f| Found::at(&f.path))),
            Listing::Files(_) => Ok(None),
        }
    }

    fn read(&self, found: &Found, _: &ReadOptions) -> Result<Checkpoint> {
        read_checkpoint(&found.path)
    }
}

/// Whether a file starts as a torch.save does: a ZIP (`PK`) or a legacy pickle (protocol 2's
/// `0x80`).
fn is_torch_save(path: &Path) -> Result<bool> {
    let input = storage::Input::open(path, Access::Map)?;
    let mut magic = [0u8; 2];
    if input.len() < 2 {
        return Ok(false);
    }
    input.read_at(0, &mut magic)?;
    Ok(magic.starts_with(b"PK") || magic[0] == opcodes::PROTO)
}

/// A full `torch.save` file: every tensor one piece, every other leaf a value.
pub fn read_checkpoint(path: &Path) -> Result<Checkpoint> {
    let input = storage::Input::open(path, Access::Map)?;
    let bytes = input.zip_view(0, input.len())?;
    let archive = super::read(&bytes).map_err(|e| e.file(path))?;
    let file_name = PathBuf::from(path.file_name().unwrap_or_default());
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    let mut unsupported = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (key_path, leaf) in &archive.leaves {
        let name = KeyPart::flat_name(key_path);
        if !names.insert(name.clone()) {
            return Err(Error::invalid("two entries flatten to the same name")
                .file(path)
                .tensor(&name));
        }
        match leaf {
            Leaf::Tensor(t) => tensors.push(
                saved_tensor(&archive, t, name, key_path, &file_name).map_err(|e| e.file(path))?,
            ),
            Leaf::Value(v) => values.push(NonTensor {
                name,
                key_path: key_path.clone(),
                value: Some(v.clone()),
                raw: None,
            }),
            Leaf::Sharded(_) => return one_rank_file(path, &name),
            Leaf::Unsupported { dtype } => unsupported.push(Unsupported {
                name,
                dtype: dtype.clone(),
                file: file_name.clone(),
            }),
        }
    }
    Ok(Checkpoint {
        root: path.parent().map(Path::to_path_buf).unwrap_or_default(),
        format: Format::TorchSave,
        world_size: None,
        tensors,
        values,
        unsupported,
        details: Vec::new(),
    })
}

/// A tensor of a torch.save archive as one piece of `file_name` (the archive's file, relative to
/// the checkpoint's root): what the torch.save layout reads, and Megatron's `common.pt`.
pub(crate) fn saved_tensor(
    archive: &super::Archive,
    t: &super::SavedTensor,
    name: String,
    key_path: &[KeyPart],
    file_name: &Path,
) -> Result<Tensor> {
    let entry = archive.storage(&t.storage_key).ok_or_else(|| {
        Error::invalid(format!("no storage record `{}`", t.storage_key)).tensor(&name)
    })?;
    let within = t.storage_offset * t.dtype.size() as u64;
    // A deflated record cannot be mapped: its piece is read through an inflater.
    let (offset, encoding) = match entry.deflated {
        None => (entry.data_offset + within, Encoding::Raw),
        Some(item_length) => (
            within,
            Encoding::Deflate {
                item_offset: entry.data_offset,
                item_length,
            },
        ),
    };
    let pieces = Pieces::single(Piece {
        offsets: vec![0; t.shape.len()],
        sizes: t.shape.clone(),
        data: DataRef {
            file: file_name.into(),
            offset,
            strides: t.strides.clone(),
            encoding,
        },
    })
    .map_err(|e| e.tensor(&name))?;
    Ok(Tensor {
        name,
        key_path: key_path.to_vec(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        pieces,
    })
}

/// A torch.save file holding DTensor or ShardedTensor values is one rank's part of a sharded save:
/// the per-rank layout reads it among its siblings when it is named as a rank's file.
fn one_rank_file(path: &Path, name: &str) -> Result<Checkpoint> {
    Err(Error::invalid(
        "this file holds DTensor or ShardedTensor values: it is one rank's part of a sharded save",
    )
    .file(path)
    .tensor(name)
    .hint("name the files by rank (`model_rank0.pt`, ...) and pass the directory that holds every rank's file"))
}
