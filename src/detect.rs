//! Layout detection: which reader a path needs, and a helpful error when none fits.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::formats::torch_save::{self, Leaf};
use crate::formats::{dcp, fsdp_local, hf_index, megatron, per_rank, safetensors};
use crate::model::{
    Checkpoint, DataRef, Encoding, Format, KeyPart, NonTensor, Piece, Pieces, Tensor, Unsupported,
};
use crate::storage::{self, Access, Stat};

/// What ckpt was pointed at: one file or directory, or several files of one per-rank save
/// (`ckpt inspect ckpt/model_world_size_4_rank_*.pt`).
#[derive(Clone, Debug)]
pub struct Input {
    paths: Vec<PathBuf>,
    /// The one path, or the directory that holds the files.
    root: PathBuf,
}

impl Input {
    pub fn new(paths: Vec<PathBuf>) -> Result<Input> {
        let root = match paths.as_slice() {
            [] => return Err(Error::usage("no checkpoint given")),
            [one] => one.clone(),
            many => {
                for p in many {
                    if !storage::is_file(p) {
                        return Err(Error::usage(format!(
                            "`{}` is not a file: several paths are the files of one per-rank checkpoint",
                            p.display()
                        )));
                    }
                }
                match many[0].parent() {
                    Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
                    _ => PathBuf::from("."),
                }
            }
        };
        Ok(Input { paths, root })
    }

    /// One path.
    pub fn one(path: &Path) -> Input {
        Input {
            paths: vec![path.to_path_buf()],
            root: path.to_path_buf(),
        }
    }

    /// The one path, or the directory of the files: what an output must not lie inside.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The single path given, if only one was.
    pub fn single(&self) -> Option<&Path> {
        match self.paths.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    pub fn read(&self) -> Result<Checkpoint> {
        match self.single() {
            Some(one) => read(one),
            None => fsdp_local::apply(per_rank::read(&self.paths)?),
        }
    }

    /// How messages name it: the path, or the first file and how many others.
    pub fn display(&self) -> String {
        match self.paths.as_slice() {
            [one] => one.display().to_string(),
            [first, rest @ ..] => format!("{} (and {} more files)", first.display(), rest.len()),
            [] => String::new(),
        }
    }
}

/// Read whatever checkpoint `path` is: a file (safetensors, torch.save, an index) or a directory
/// (DCP, DCP's Hugging Face flavour, Hugging Face split files, or one safetensors/torch.save file).
/// An FSDP1 LOCAL_STATE_DICT checkpoint is resolved with the `--shapes-from` reference in force
/// ([`fsdp_local::apply`]).
pub fn read(path: &Path) -> Result<Checkpoint> {
    fsdp_local::apply(read_layout(path)?)
}

/// [`read`] without resolving FSDP1 LOCAL flat parameters: the checkpoint as its files hold it.
pub fn read_layout(path: &Path) -> Result<Checkpoint> {
    match storage::stat(path)? {
        Some(Stat::File(_)) => return read_file(path),
        Some(Stat::Dir) => {}
        None => return Err(Error::usage(format!("`{}` does not exist", path.display()))),
    }
    // Before DCP: a Megatron directory is a DCP one with more beside it.
    if megatron::looks_like(path) {
        return megatron::read(path);
    }
    if dcp::looks_like(path) {
        return dcp::read(path);
    }
    if storage::is_file(&path.join(hf_index::INDEX_NAME)) {
        return hf_index::read(path);
    }
    if dcp::hf::looks_like(path) {
        return dcp::hf::read(path);
    }
    if let Some(files) = per_rank::files_in(path)? {
        return per_rank::read(&files);
    }
    let entries = list(path)?;
    let safetensors: Vec<&PathBuf> = entries
        .iter()
        .filter(|p| has_ext(p, "safetensors"))
        .collect();
    if let [only] = safetensors.as_slice() {
        return safetensors::read(only);
    }
    for name in ["pytorch_model.bin", "model.pt", "consolidated.pth"] {
        if storage::is_file(&path.join(name)) {
            return read_file(&path.join(name));
        }
    }
    Err(no_layout(path, &entries))
}

fn read_file(path: &Path) -> Result<Checkpoint> {
    if let Some(dir) = megatron::dir_of(path) {
        return megatron::read(&dir);
    }
    if has_ext(path, "safetensors") {
        return safetensors::read(path);
    }
    if path.file_name().is_some_and(|n| n == hf_index::INDEX_NAME) {
        return hf_index::read(path);
    }
    if path.file_name().is_some_and(|n| n == dcp::METADATA) {
        if let Some(dir) = path.parent() {
            return dcp::read(dir);
        }
    }
    let input = storage::Input::open(path, Access::Map)?;
    let mut magic = [0u8; 2];
    let n = input.len().min(2) as usize;
    input.read_at(0, &mut magic[..n])?;
    if n == 2 && (magic.starts_with(b"PK") || magic[0] == 0x80) {
        return read_torch_save(path);
    }
    Err(Error::invalid("not a checkpoint ckpt knows")
        .file(path)
        .hint("ckpt reads .safetensors, torch.save (.bin/.pt) files, model.safetensors.index.json and DCP directories"))
}

/// A full `torch.save` file: every tensor one piece, every other leaf a value.
pub fn read_torch_save(path: &Path) -> Result<Checkpoint> {
    let input = storage::Input::open(path, Access::Map)?;
    let bytes = input.zip_view(0, input.len())?;
    let archive = torch_save::read(&bytes).map_err(|e| e.file(path))?;
    let file_name = PathBuf::from(path.file_name().unwrap_or_default());
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    let mut unsupported = Vec::new();
    let mut names = std::collections::HashSet::new();
    for (key_path, leaf) in &archive.leaves {
        let name = flat_name(key_path);
        if !names.insert(name.clone()) {
            return Err(Error::invalid("two entries flatten to the same name")
                .file(path)
                .tensor(&name));
        }
        match leaf {
            Leaf::Tensor(t) => {
                let entry = archive.storage(&t.storage_key).ok_or_else(|| {
                    Error::invalid(format!("no storage record `{}`", t.storage_key))
                        .file(path)
                        .tensor(&name)
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
                        file: file_name.as_path().into(),
                        offset,
                        strides: t.strides.clone(),
                        encoding,
                    },
                })
                .map_err(|e| e.file(path).tensor(&name))?;
                tensors.push(Tensor {
                    name,
                    key_path: key_path.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    pieces,
                });
            }
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
    })
}

/// A torch.save file holding DTensor or ShardedTensor values is one rank's part of a sharded save:
/// read as a per-rank checkpoint when named like one (which says what other files it needs).
fn one_rank_file(path: &Path, name: &str) -> Result<Checkpoint> {
    if per_rank::is_rank_file(path) {
        return per_rank::read(&[path.to_path_buf()]);
    }
    Err(Error::invalid(
        "this file holds DTensor or ShardedTensor values: it is one rank's part of a sharded save",
    )
    .file(path)
    .tensor(name)
    .hint("name the files by rank (`model_rank0.pt`, ...) and pass the directory that holds every rank's file"))
}

/// DCP's flattening of a nested key: parts joined with dots.
pub fn flat_name(path: &[KeyPart]) -> String {
    path.iter()
        .map(KeyPart::as_name)
        .collect::<Vec<_>>()
        .join(".")
}

fn has_ext(path: &Path, ext: &str) -> bool {
    path.extension().is_some_and(|e| e == ext)
}

fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    storage::list(dir)
}

/// The error for a directory no reader recognises, pointing at a likely checkpoint inside it.
fn no_layout(dir: &Path, entries: &[PathBuf]) -> Error {
    let err = Error::invalid("no checkpoint layout recognised in this directory").file(dir);
    let mut nested: Vec<&PathBuf> = entries
        .iter()
        .filter(|p| {
            storage::is_dir(p)
                && (dcp::looks_like(p)
                    || storage::is_file(&p.join(hf_index::INDEX_NAME))
                    || dcp::hf::looks_like(p))
        })
        .collect();
    // accelerate saves `pytorch_model_fsdp_0/` beside `optimizer_0/`: the model is what most
    // people want, so it comes first.
    nested.sort_by_key(|p| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        (!name.contains("model"), name.contains("optim"))
    });
    match nested.as_slice() {
        [] => {}
        [inner] => {
            return err.hint(format!(
                "it holds a checkpoint in `{}`: point ckpt at that",
                inner.display()
            ))
        }
        many => {
            let names: Vec<String> = many.iter().map(|p| format!("`{}`", p.display())).collect();
            return err.hint(format!(
                "it holds {} checkpoints, {}: point ckpt at one of them",
                many.len(),
                names.join(", ")
            ));
        }
    }
    let many: Vec<&PathBuf> = entries
        .iter()
        .filter(|p| has_ext(p, "safetensors"))
        .collect();
    if many.len() > 1 {
        return err.hint(format!(
            "it holds {} .safetensors files but no `{}`: pass one file, or restore the index",
            many.len(),
            hf_index::INDEX_NAME
        ));
    }
    err.hint("ckpt reads DCP directories (`.metadata`), Hugging Face split files (`model.safetensors.index.json`), DCP safetensors shards, .safetensors and torch.save files")
}
