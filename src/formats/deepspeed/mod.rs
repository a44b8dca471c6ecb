//! DeepSpeed ZeRO checkpoints: what `engine.save_checkpoint(dir)` writes, read as one SHARDED
//! checkpoint named as torch's `get_state_dict` names an FSDP2 model and optimizer.
//!
//! `dir/latest` names the tag (`global_step3`); `dir/TAG/` holds, for a data-parallel world of N
//! ranks, the model states (stages 0-2: `mp_rank_00_model_states.pt`; stage 3 one per rank,
//! `zero_pp_rank_{r}_mp_rank_00_model_states.pt`) and one optimizer state per rank
//! (`[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`). The fp32 master weights and Adam's
//! moments are flat 1-D buffers per parameter group, cut across the ranks ([`zero`] has the
//! geometry of each stage); each parameter's share of each rank's buffer becomes ordinary pieces
//! of the parameter (a flat range is a few boxes, [`crate::geometry::flat_range_boxes`]), so
//! planning and copying are as for any other sharded checkpoint and no buffer is ever gathered.
//!
//! Names: `model.<fqn>` for the fp32 master weights (as DeepSpeed's
//! `get_fp32_state_dict_from_zero_checkpoint` gives them), frozen parameters in their stored
//! 16-bit dtype, buffers, and each tied alias; `optim.state.<fqn>.{exp_avg,exp_avg_sq,step}` and
//! `optim.param_groups.<fqn>.<key>`, as `get_state_dict(..., StateDictOptions(
//! flatten_optimizer_state_dict=True))` names an optimizer. So `consolidate --include 'model.*'
//! --strip-prefix model.` replaces `zero_to_fp32`, and `reshard` writes a DCP an FSDP2 model and
//! its optimizer resume from.
//!
//! The pickles name a few DeepSpeed classes (`LossScaler`, `ZeroStageEnum`, `fragment_address`)
//! and stage 3's flat groups are rebuilt through `torch._tensor._rebuild_from_type_v2`: each is
//! read as data by name ([`DeepSpeedGlobals`]), nothing is called, and every other global is
//! refused as for any torch.save file.

mod files;
pub(crate) mod reshard;
mod universal;
mod zero;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::torch_save::{self, Archive, Extra, Leaf, SavedTensor};
use crate::geometry::{contiguous_strides, flat_range_boxes};
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{Checkpoint, DataRef, Encoding, KeyPart, Piece, Pieces};
use crate::pickle::{Globals, Object, Value};
use crate::storage::{self, Access};

pub(crate) use files::{LATEST, LATEST_UNIVERSAL};

/// A DeepSpeed checkpoint directory (with `latest`), one tag's directory, or a Hugging Face
/// Trainer `checkpoint-N/` that holds one.
pub(crate) struct DeepSpeed;

impl Layout for DeepSpeed {
    fn describe(&self) -> &'static str {
        "DeepSpeed ZeRO checkpoints (`latest`, `global_stepN/*_model_states.pt`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        Ok(match at {
            Listing::Dir { path, entries } => {
                let holds_states = entries
                    .iter()
                    .any(|e| e.is_file() && files::is_states_file(e.name()));
                // `latest` alone could be anyone's file: with it, a tag's directory beside it.
                let latest = at.file_named(LATEST).or(at.file_named(LATEST_UNIVERSAL));
                let tags = entries.iter().any(|e| e.is_dir());
                (holds_states || (latest.is_some() && tags)).then(|| Found::at(path))
            }
            // One of a tag's files stands for the tag's directory.
            Listing::File(f) if files::is_states_file(f.name()) => f.path.parent().map(Found::at),
            _ => None,
        })
    }

    fn read(&self, found: &Found, opts: &ReadOptions) -> Result<Checkpoint> {
        read(&found.path, opts)
    }
}

/// Read the DeepSpeed checkpoint at `path`: a directory with `latest` (or with `--tag`'s
/// directory), or a tag's directory itself.
pub(crate) fn read(path: &Path, opts: &ReadOptions) -> Result<Checkpoint> {
    let tag = files::Tag::find(path, opts.tag)?;
    let universal = tag.dir.join(files::UNIVERSAL_DIR);
    if storage::is_dir(&universal) {
        return universal::read(&tag, &universal);
    }
    let set = files::Set::list(&tag.dir)?;
    zero::read(&tag, &set)
}

/// The classes DeepSpeed's files pickle beyond torch.save's own, all read as data: the loss
/// scaler's state, the ZeRO stage enum, a parameter's fragment address, and the tensor subclass
/// rebuild stage 3's flat groups go through (its `ds_id` attribute dropped).
struct DeepSpeedGlobals;

const LOSS_SCALER: &str = "deepspeed.runtime.fp16.loss_scaler";
const ZERO_CONFIG: &str = "deepspeed.runtime.zero.config";
const FRAGMENT: &str = "deepspeed.utils.tensor_fragment";

impl Globals for DeepSpeedGlobals {
    fn allows(&self, module: &str, name: &str) -> bool {
        matches!(
            (module, name),
            (LOSS_SCALER, "LossScaler" | "DynamicLossScaler")
                | (ZERO_CONFIG, "ZeroStageEnum")
                | (FRAGMENT, "fragment_address")
                | ("torch._tensor", "_rebuild_from_type_v2")
                | ("torch", "Tensor")
        )
    }
}

/// What each allowed DeepSpeed object stands for as data.
fn plain(object: &Object) -> Option<Value> {
    let (module, name) = object.callable.as_global()?;
    match (module, name) {
        // `ZeroStageEnum(2)`: the stage.
        (ZERO_CONFIG, "ZeroStageEnum") => match object.args.as_slice() {
            [stage @ Value::Int(_)] => Some(stage.clone()),
            _ => None,
        },
        // A plain object's `__dict__`: the scaler's settings, a fragment's `numel` and `start`.
        (LOSS_SCALER, _) | (FRAGMENT, _) => match &object.state {
            Some(state @ Value::Dict(_)) => Some(state.clone()),
            _ => None,
        },
        // `_rebuild_from_type_v2(func, type, args, state)`: the tensor `func(*args)` makes; the
        // subclass and its Python attributes (`ds_id`) are not data ckpt carries.
        ("torch._tensor", "_rebuild_from_type_v2") => match object.args.as_slice() {
            [func @ Value::Global(_), ty, Value::Tuple(args), _state]
                if ty.as_global() == Some(("torch", "Tensor")) =>
            {
                Some(Value::Object(Box::new(Object {
                    callable: func.clone(),
                    args: args.clone(),
                    new_obj: false,
                    dict_items: Vec::new(),
                    list_items: Vec::new(),
                    state: None,
                })))
            }
            _ => None,
        },
        _ => None,
    }
}

/// One torch.save file of the checkpoint, read as data, its leaves found by key path.
struct StateFile {
    path: PathBuf,
    /// The file's name, as pieces name it (relative to the tag's directory).
    name: Arc<Path>,
    archive: Archive,
    index: HashMap<Vec<KeyPart>, usize>,
}

impl StateFile {
    fn open(path: &Path) -> Result<StateFile> {
        let name = PathBuf::from(path.file_name().unwrap_or_default());
        StateFile::open_as(path, name)
    }

    /// [`StateFile::open`], its pieces naming it `name` (relative to the checkpoint's root).
    fn open_as(path: &Path, name: PathBuf) -> Result<StateFile> {
        let input = storage::Input::open(path, Access::Map)?;
        let bytes = input.zip_view(0, input.len())?;
        let extra = Extra {
            globals: &DeepSpeedGlobals,
            plain: &plain,
        };
        let archive = torch_save::read_with_extra(&bytes, &extra).map_err(|e| e.file(path))?;
        let index = archive
            .leaves
            .iter()
            .enumerate()
            .map(|(i, (key, _))| (key.clone(), i))
            .collect();
        Ok(StateFile {
            path: path.to_path_buf(),
            name: name.as_path().into(),
            archive,
            index,
        })
    }

    fn leaf(&self, key: &[KeyPart]) -> Option<&Leaf> {
        self.index
            .get(key)
            .and_then(|&i| self.archive.leaves.get(i))
            .map(|(_, leaf)| leaf)
    }

    /// The plain value at `key`, if there is one.
    fn value(&self, key: &[KeyPart]) -> Option<&Value> {
        match self.leaf(key) {
            Some(Leaf::Value(v)) => Some(v),
            _ => None,
        }
    }

    /// The tensor at `key`, or an error naming the file and the key.
    fn tensor(&self, key: &[KeyPart]) -> Result<&SavedTensor> {
        match self.leaf(key) {
            Some(Leaf::Tensor(t)) => Ok(t),
            _ => Err(self.missing(key, "a tensor")),
        }
    }

    fn missing(&self, key: &[KeyPart], what: &str) -> Error {
        Error::invalid(format!(
            "`{}` holds no {what} at `{}`",
            self.name.display(),
            KeyPart::flat_name(key)
        ))
        .file(&self.path)
        .hint("the file is not a DeepSpeed checkpoint's, or it was written by a DeepSpeed version ckpt does not know")
    }

    /// A 1-D tensor as a run of elements in this file.
    fn flat(&self, key: &[KeyPart]) -> Result<Flat> {
        let t = self.tensor(key)?;
        if t.shape.len() != 1 || t.strides.first().is_some_and(|&s| s != 1) {
            return Err(Error::invalid(format!(
                "expected a flat (1-D, contiguous) buffer, found shape {:?} strides {:?}",
                t.shape, t.strides
            ))
            .file(&self.path)
            .tensor(KeyPart::flat_name(key)));
        }
        Ok(Flat {
            file: Arc::clone(&self.name),
            offset: self.data_offset(t, key)?,
            dtype: t.dtype,
            len: t.shape[0],
        })
    }

    /// A tensor as one piece covering all of it (a buffer, a stage-2 frozen parameter).
    fn whole(&self, key: &[KeyPart]) -> Result<(DType, Vec<u64>, Pieces)> {
        let t = self.tensor(key)?;
        let piece = Piece {
            offsets: vec![0; t.shape.len()],
            sizes: t.shape.clone(),
            data: DataRef {
                file: Arc::clone(&self.name),
                offset: self.data_offset(t, key)?,
                strides: t.strides.clone(),
                encoding: Encoding::Raw,
            },
        };
        Ok((t.dtype, t.shape.clone(), Pieces::single(piece)?))
    }

    /// Where `t`'s first element is in the file.
    fn data_offset(&self, t: &SavedTensor, key: &[KeyPart]) -> Result<u64> {
        let entry = self.archive.storage(&t.storage_key).ok_or_else(|| {
            Error::invalid(format!("no storage record `{}`", t.storage_key))
                .file(&self.path)
                .tensor(KeyPart::flat_name(key))
        })?;
        if entry.deflated.is_some() {
            return Err(Error::invalid(
                "a compressed record in a DeepSpeed checkpoint: DeepSpeed stores them plain",
            )
            .file(&self.path)
            .tensor(KeyPart::flat_name(key)));
        }
        Ok(entry.data_offset + t.storage_offset * t.dtype.size() as u64)
    }
}

/// A run of elements of one dtype in a file: a rank's flat buffer, or a part of one.
#[derive(Clone, Debug)]
struct Flat {
    file: Arc<Path>,
    /// Byte offset of element 0.
    offset: u64,
    dtype: DType,
    len: u64,
}

impl Flat {
    /// Add to `pieces` the boxes of a tensor of `shape` that its row-major elements
    /// `lo..hi` make, their bytes at element `at` of this run onward.
    fn add(&self, pieces: &mut Pieces, shape: &[u64], lo: u64, hi: u64, at: u64) -> Result<()> {
        if hi > lo && at.checked_add(hi - lo).is_none_or(|end| end > self.len) {
            return Err(Error::bug("a flat range reaches past its buffer"));
        }
        let strides = contiguous_strides(shape);
        let size = self.dtype.size() as u64;
        for (offsets, sizes) in flat_range_boxes(shape, lo, hi) {
            let first: u64 = offsets.iter().zip(&strides).map(|(o, s)| o * s).sum();
            pieces.push(Piece {
                offsets,
                sizes,
                data: DataRef {
                    file: Arc::clone(&self.file),
                    offset: self.offset + (at + first - lo) * size,
                    strides: strides.clone(),
                    encoding: Encoding::Raw,
                },
            })?;
        }
        Ok(())
    }
}

/// `KeyPart::Key`s for a path of string keys.
fn key(parts: &[&str]) -> Vec<KeyPart> {
    parts.iter().map(|p| KeyPart::Key(p.to_string())).collect()
}

/// The entries of a dict or an `OrderedDict`, in order.
fn dict_items(value: &Value) -> Option<&[(Value, Value)]> {
    match value {
        Value::Dict(items) => Some(items),
        Value::Object(o) if o.callable.as_global() == Some(("collections", "OrderedDict")) => {
            Some(&o.dict_items)
        }
        _ => None,
    }
}

/// `(name, shape)` of each entry of an ordered dict of `torch.Size`s.
fn shapes_of(value: &Value) -> Option<Vec<(String, Vec<u64>)>> {
    dict_items(value)?
        .iter()
        .map(|(k, v)| Some((k.as_str()?.to_string(), v.as_sizes()?)))
        .collect()
}
