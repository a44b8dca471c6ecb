//! Per-rank torch.save files: one `torch.save(state_dict)` per rank, read as one SHARDED checkpoint.
//!
//! Many training codes save without DCP. FSDP2's `model.state_dict()` holds DTensors, whose pickle
//! records the global shape, the device mesh, the placements and the saving rank's mesh coordinate:
//! the rank's piece follows from torch.chunk geometry ([`crate::geometry::local_box_at`]). FSDP1's
//! `SHARDED_STATE_DICT` holds ShardedTensors, whose pickle lists every shard's offsets and sizes. Both
//! are read as data here ([`decode`], called by the torch.save reader for each value): nothing is
//! called, and the classes they pickle through are allowed by name ([`allows_global`]) and nowhere
//! else. Files are named as veRL and others name them (`{prefix}_world_size_{W}_rank_{R}.pt`,
//! `rank{R}.pt`, `{prefix}_rank{R}.pt`); the prefix (`model`, `optim`, `extra_state`) becomes the first
//! segment of every name in it, so one directory is one state dict.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::torch_save::{self, Leaf, SavedTensor};
use crate::geometry::{local_box_at, Placement};
use crate::layout::{Found, Listing, ReadOptions};
use crate::model::{
    Checkpoint, DataRef, Encoding, Format, KeyPart, NonTensor, Piece, Pieces, Tensor, Unsupported,
};
use crate::pickle::Value;
use crate::storage::{self, Access};

/// A tensor as one rank saved it: its global shape and the pieces this rank holds.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedLeaf {
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// This rank's pieces (a DTensor has one, possibly empty; a ShardedTensor any number).
    pub pieces: Vec<LocalPiece>,
    pub layout: Layout,
}

/// One box of the global tensor and the saved tensor holding it.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalPiece {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub tensor: SavedTensor,
}

/// How the pieces were placed, as far as the file says.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    DTensor {
        /// Size of each mesh dimension.
        mesh: Vec<usize>,
        placements: Vec<Placement>,
        /// The saving rank's coordinate in the mesh.
        coordinate: Vec<usize>,
        /// The saving rank (global), when recorded.
        rank: Option<u64>,
        /// Global ranks of the mesh, row-major.
        mesh_ranks: Vec<u64>,
    },
    ShardedTensor {
        /// The saving rank (global) and world size, from the process group state.
        rank: Option<u64>,
        world_size: Option<u64>,
        /// The saving rank and the size of the process group that saved it, which the shards'
        /// placements count in: not the whole job under a subgroup or hybrid sharding.
        group_rank: Option<u64>,
        group_size: Option<u64>,
        /// Every rank's shard: offsets, sizes and the rank the metadata places it on.
        shards: Vec<(Vec<u64>, Vec<u64>, Option<u64>)>,
    },
}

impl Layout {
    /// The global rank that saved the file, when the value records it.
    pub fn rank(&self) -> Option<u64> {
        match self {
            Layout::DTensor { rank, .. } | Layout::ShardedTensor { rank, .. } => *rank,
        }
    }

    /// Whether a file named as rank `named`'s can be what the saving rank wrote: the rank is
    /// not recorded, or it is `named` in the job or in the process group that saved the value
    /// (a group that is not the whole job numbers its files either way: FSDP1 on a subgroup by
    /// the group's ranks, hybrid sharding by the job's).
    pub fn saved_by(&self, named: u64) -> bool {
        match self {
            Layout::ShardedTensor {
                rank, group_rank, ..
            } => rank.is_none_or(|r| r == named) || *group_rank == Some(named),
            Layout::DTensor { rank, .. } => rank.is_none_or(|r| r == named),
        }
    }

    /// The highest rank that must have saved a file for this tensor to be whole.
    fn last_rank(&self) -> Option<u64> {
        match self {
            Layout::DTensor { mesh_ranks, .. } => mesh_ranks.iter().max().copied(),
            // The shards are placed on the saving group's ranks.
            Layout::ShardedTensor {
                world_size,
                group_size,
                shards,
                ..
            } => match group_size.or(*world_size) {
                Some(w) => w.checked_sub(1),
                None => shards.iter().filter_map(|s| s.2).max(),
            },
        }
    }
}

const DTENSOR: &str = "torch.distributed.tensor";
const SPEC: &str = "torch.distributed.tensor._dtensor_spec";
const PLACEMENTS: &str = "torch.distributed.tensor.placement_types";
const SHARDED_TENSOR: (&str, &str) = (
    "torch.distributed._shard.sharded_tensor.api",
    "ShardedTensor",
);

/// The globals DTensor and ShardedTensor values pickle through. The torch.save reader allows them
/// besides its own; naming one runs nothing.
pub fn allows_global(module: &str, name: &str) -> bool {
    match module {
        "torch._tensor" => name == "_rebuild_from_type_v2",
        "torch._utils" => name == "_rebuild_wrapper_subclass",
        "torch.serialization" => name == "_get_layout",
        DTENSOR => name == "DTensor",
        SPEC => matches!(name, "DTensorSpec" | "TensorMeta" | "ShardOrderEntry"),
        "torch.distributed.device_mesh" => name == "DeviceMesh",
        "torch.distributed._mesh_layout" => matches!(name, "_MeshLayout" | "_FlatLayout"),
        // Partial and _StridedShard are named so that the error can say why they are refused.
        PLACEMENTS => matches!(name, "Shard" | "Replicate" | "Partial" | "_StridedShard"),
        "torch.distributed._shard.sharded_tensor.api" => name == "ShardedTensor",
        "torch.distributed._shard.sharded_tensor.metadata" => matches!(
            name,
            "ShardedTensorMetadata" | "TensorProperties" | "MEM_FORMAT_ENCODING"
        ),
        "torch.distributed._shard.sharded_tensor.shard" => name == "Shard",
        "torch.distributed._shard.metadata" => name == "ShardMetadata",
        "torch.distributed.remote_device" => name == "_remote_device",
        "torch.distributed._shard.sharding_spec.chunk_sharding_spec" => name == "ChunkShardingSpec",
        // Only as `getattr(ShardedTensor, "ProcessGroupState")`: see [`check_getattr`].
        "builtins" => name == "getattr",
        _ => false,
    }
}

/// `getattr(*args)` is allowed only as ShardedTensor's `__getstate__` pickles it, naming its
/// process-group record class; any other use is refused.
pub fn check_getattr(args: &[Value]) -> Result<()> {
    match args {
        [class, Value::Str(attr)]
            if class.as_global() == Some(SHARDED_TENSOR) && attr == "ProcessGroupState" =>
        {
            Ok(())
        }
        _ => Err(Error::invalid(
            "malformed `data.pkl`: `getattr` is allowed only as `getattr(ShardedTensor, \"ProcessGroupState\")`",
        )),
    }
}

/// Whether a `NEWOBJ`'s class is `getattr(ShardedTensor, "ProcessGroupState")`: the one class made
/// by a call that the torch.save reader accepts.
pub fn is_process_group_state(callable: &Value) -> bool {
    match callable {
        Value::Object(o) => {
            o.callable.as_global() == Some(("builtins", "getattr"))
                && check_getattr(&o.args).is_ok()
        }
        _ => false,
    }
}

/// If `value` is a DTensor or ShardedTensor (`torch._tensor._rebuild_from_type_v2` of
/// `_rebuild_wrapper_subclass`), its global shape and this rank's pieces; `local` turns each
/// `_rebuild_tensor_v2` call inside into the tensor it saves (checked against its storage).
pub fn decode(
    value: &Value,
    local: &mut dyn FnMut(&Value) -> Result<SavedTensor>,
) -> Result<Option<ShardedLeaf>> {
    if value.class() != Some(("torch._tensor", "_rebuild_from_type_v2")) {
        return Ok(None);
    }
    let args = value.args().unwrap_or_default();
    let [func, class, wrapper_args, state] = args else {
        return Err(bad(format!(
            "`_rebuild_from_type_v2` takes 4 arguments, not {}",
            args.len()
        )));
    };
    if func.as_global() != Some(("torch._utils", "_rebuild_wrapper_subclass")) {
        return Err(bad(
            "a tensor subclass not rebuilt by `_rebuild_wrapper_subclass`",
        ));
    }
    // (cls, dtype, size, stride, storage_offset, layout, device, requires_grad)
    let wrapper = wrapper_args
        .as_seq()
        .ok_or_else(|| bad("tensor subclass arguments are not a tuple"))?;
    let dtype = match wrapper.get(1).and_then(Value::as_global) {
        Some(("torch", name)) => DType::from_torch_name(name).ok_or_else(|| {
            Error::invalid(format!("tensor dtype `torch.{name}` is not supported"))
        })?,
        _ => return Err(bad("tensor subclass dtype is not a `torch` dtype")),
    };
    let shape = ints(wrapper.get(2), "tensor subclass size")?;
    let leaf = match class.as_global() {
        Some((DTENSOR, "DTensor")) => dtensor(dtype, shape, state, local)?,
        Some(SHARDED_TENSOR) => sharded_tensor(dtype, shape, state, local)?,
        Some((module, name)) => {
            return Err(Error::invalid(format!(
                "tensor subclass `{module}.{name}` is not supported"
            )))
        }
        None => return Err(bad("tensor subclass is not a class")),
    };
    for p in &leaf.pieces {
        if p.tensor.dtype != dtype {
            return Err(bad(format!(
                "a {} piece of a {dtype} tensor",
                p.tensor.dtype
            )));
        }
        let inside = p.offsets.len() == leaf.shape.len()
            && (0..leaf.shape.len()).all(|d| {
                p.offsets[d]
                    .checked_add(p.sizes[d])
                    .is_some_and(|end| end <= leaf.shape[d])
            });
        if !inside || p.tensor.shape != p.sizes {
            return Err(Error::invalid(format!(
                "a piece at offsets {:?} with sizes {:?} (its saved tensor has shape {:?}) does not fit the shape {:?}",
                p.offsets, p.sizes, p.tensor.shape, leaf.shape
            )));
        }
    }
    Ok(Some(leaf))
}

/// A DTensor's state: `{"_local_tensor": tensor, "_spec": DTensorSpec}`.
fn dtensor(
    dtype: DType,
    shape: Vec<u64>,
    state: &Value,
    local: &mut dyn FnMut(&Value) -> Result<SavedTensor>,
) -> Result<ShardedLeaf> {
    let state = fields(state).ok_or_else(|| bad("DTensor state is not a dict"))?;
    let tensor = local(field(state, "_local_tensor", "DTensor")?)?;
    let spec = fields_of(field(state, "_spec", "DTensor")?, (SPEC, "DTensorSpec"))?;
    if let Some(meta) = spec_field(spec, "tensor_meta") {
        if meta.class() == Some((SPEC, "TensorMeta")) {
            let meta_shape = ints(meta.args().and_then(|a| a.first()), "TensorMeta shape")?;
            if meta_shape != shape {
                return Err(bad(format!(
                    "DTensor of size {shape:?} whose spec says {meta_shape:?}"
                )));
            }
        }
    }
    let mesh = fields_of(
        field(spec, "mesh", "DTensorSpec")?,
        ("torch.distributed.device_mesh", "DeviceMesh"),
    )?;
    let layout = fields_of(
        field(mesh, "_layout", "DeviceMesh")?,
        ("torch.distributed._mesh_layout", "_MeshLayout"),
    )?;
    let axes = field(layout, "axes", "_MeshLayout")?
        .as_seq()
        .ok_or_else(|| bad("mesh layout axes are not a tuple"))?;
    let mut sizes = Vec::with_capacity(axes.len());
    for axis in axes {
        let axis = fields_of(axis, ("torch.distributed._mesh_layout", "_FlatLayout"))?;
        let dims = ints(
            Some(field(axis, "shape", "_FlatLayout")?),
            "mesh axis shape",
        )?;
        let size = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(|| bad("mesh size overflows"))?;
        sizes.push(size);
    }
    let coordinate = match field(mesh, "_coordinate_on_dim", "DeviceMesh")? {
        Value::None => {
            return Err(Error::invalid(
                "the rank that saved this DTensor is not in its device mesh",
            ))
        }
        v => ints(Some(v), "mesh coordinate")?,
    };
    let coordinate: Vec<usize> = coordinate.iter().map(|&c| c as usize).collect();
    if coordinate.len() != sizes.len() || coordinate.iter().zip(&sizes).any(|(c, s)| c >= s) {
        return Err(bad(format!(
            "mesh coordinate {coordinate:?} is not in a mesh of shape {sizes:?}"
        )));
    }
    let rank = spec_field(mesh, "_rank").and_then(Value::as_int);
    let rank = rank
        .map(|r| u64::try_from(r).map_err(|_| bad("negative rank")))
        .transpose()?;
    let mesh_ranks = match spec_field(mesh, "_flatten_rank_map") {
        Some(v) => ints(Some(v), "mesh rank map")?,
        None => Vec::new(),
    };
    let numel = sizes.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
    if !mesh_ranks.is_empty() {
        // coordinates are below their sizes, so this stays below `numel`
        let at = coordinate.iter().zip(&sizes).fold(0usize, |acc, (&c, &s)| {
            acc.saturating_mul(s).saturating_add(c)
        });
        if numel != Some(mesh_ranks.len()) || rank.is_some_and(|r| mesh_ranks.get(at) != Some(&r)) {
            return Err(bad(format!(
                "mesh of shape {sizes:?} with ranks {mesh_ranks:?} does not place rank {rank:?} at {coordinate:?}"
            )));
        }
    }

    let placements = field(spec, "placements", "DTensorSpec")?
        .as_seq()
        .ok_or_else(|| bad("DTensor placements are not a tuple"))?;
    if placements.len() != sizes.len() {
        return Err(bad(format!(
            "{} placements on a {}-dimensional mesh",
            placements.len(),
            sizes.len()
        )));
    }
    let placements = placements
        .iter()
        .map(|p| placement(p, shape.len()))
        .collect::<Result<Vec<_>>>()?;
    if let Some(order) = spec_field(spec, "shard_order") {
        check_shard_order(order)?;
    }
    let b = local_box_at(&shape, &sizes, &placements, &coordinate);
    if tensor.shape != b.sizes {
        return Err(Error::invalid(format!(
            "the DTensor's local tensor has shape {:?}, but torch.chunk geometry gives mesh coordinate {coordinate:?} a piece of {:?} at {:?}",
            tensor.shape, b.sizes, b.offsets
        ))
        .hint("ckpt reads DTensors whose local tensors are torch.chunk pieces (FSDP2, distribute_tensor)"));
    }
    Ok(ShardedLeaf {
        dtype,
        shape,
        pieces: vec![LocalPiece {
            offsets: b.offsets,
            sizes: b.sizes,
            tensor,
        }],
        layout: Layout::DTensor {
            mesh: sizes,
            placements,
            coordinate,
            rank,
            mesh_ranks,
        },
    })
}

fn placement(value: &Value, ndim: usize) -> Result<Placement> {
    match value.class() {
        Some((PLACEMENTS, "Shard")) => {
            let state = value.state().and_then(fields);
            let dim = state
                .and_then(|s| spec_field(s, "dim"))
                .and_then(Value::as_int)
                .ok_or_else(|| bad("`Shard` placement without a dim"))?;
            // torch normalises a negative dim against the tensor's dims
            let dim = if dim < 0 { dim + ndim as i64 } else { dim };
            usize::try_from(dim)
                .ok()
                .filter(|&d| d < ndim)
                .map(Placement::Shard)
                .ok_or_else(|| bad(format!("`Shard({dim})` of a {ndim}-dimensional tensor")))
        }
        Some((PLACEMENTS, "Replicate")) => Ok(Placement::Replicate),
        Some((PLACEMENTS, "Partial")) => Err(Error::invalid(
            "a DTensor with a `Partial` placement holds unreduced partial values, which cannot be assembled by copying",
        )
        .hint("save it after `redistribute` to `Shard` or `Replicate` placements")),
        Some((PLACEMENTS, "_StridedShard")) => Err(Error::invalid(
            "a DTensor with a `_StridedShard` placement (FSDP2 over tensor parallel) is not supported",
        )
        .hint("save it with DCP (`dcp.save`), which ckpt reads")),
        _ => Err(bad("a DTensor placement is not `Shard` or `Replicate`")),
    }
}

/// `shard_order`: ckpt follows the default order, in which a tensor dim sharded over several
/// mesh dims is split by them in mesh order.
fn check_shard_order(order: &Value) -> Result<()> {
    let entries = match order {
        Value::None => return Ok(()),
        v => v
            .as_seq()
            .ok_or_else(|| bad("DTensor shard order is not a tuple"))?,
    };
    for entry in entries {
        let args = entry.args().unwrap_or_default();
        let mesh_dims = ints(args.get(1), "shard order mesh dims")?;
        if mesh_dims.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::invalid(format!(
                "a DTensor sharded over mesh dims {mesh_dims:?} in that order is not supported (ckpt follows the default, ascending order)"
            )));
        }
    }
    Ok(())
}

/// A ShardedTensor's state: `(local_shards, metadata, process_group_state, sharding_spec,
/// init_rrefs)`.
fn sharded_tensor(
    dtype: DType,
    shape: Vec<u64>,
    state: &Value,
    local: &mut dyn FnMut(&Value) -> Result<SavedTensor>,
) -> Result<ShardedLeaf> {
    let state = state
        .as_seq()
        .ok_or_else(|| bad("ShardedTensor state is not a tuple"))?;
    let (Some(local_shards), Some(metadata)) = (state.first(), state.get(1)) else {
        return Err(bad("ShardedTensor state lacks its shards or metadata"));
    };
    let metadata = fields_of(
        metadata,
        (
            "torch.distributed._shard.sharded_tensor.metadata",
            "ShardedTensorMetadata",
        ),
    )?;
    let size = ints(
        Some(field(metadata, "size", "ShardedTensorMetadata")?),
        "ShardedTensor size",
    )?;
    if size != shape {
        return Err(bad(format!(
            "ShardedTensor of size {shape:?} whose metadata says {size:?}"
        )));
    }
    let shards = field(metadata, "shards_metadata", "ShardedTensorMetadata")?
        .as_seq()
        .ok_or_else(|| bad("ShardedTensor shards metadata is not a list"))?
        .iter()
        .map(shard_metadata)
        .collect::<Result<Vec<_>>>()?;
    let (mut rank, mut world_size, mut group_rank, mut group_size) = (None, None, None, None);
    if let Some(pg) = state.get(2) {
        if is_process_group_state(&pg_class(pg)) {
            let pg = pg.state().and_then(fields).unwrap_or_default();
            let get = |k| {
                spec_field(pg, k)
                    .and_then(Value::as_int)
                    .and_then(|v| u64::try_from(v).ok())
            };
            rank = get("global_rank");
            world_size = get("global_world_size");
            group_rank = get("local_rank");
            group_size = get("local_world_size");
        }
    }
    let mut pieces = Vec::new();
    for shard in local_shards
        .as_seq()
        .ok_or_else(|| bad("ShardedTensor local shards are not a list"))?
    {
        let s = fields_of(
            shard,
            ("torch.distributed._shard.sharded_tensor.shard", "Shard"),
        )?;
        let tensor = local(field(s, "tensor", "Shard")?)?;
        let (offsets, sizes, _) = shard_metadata(field(s, "metadata", "Shard")?)?;
        if !shards.iter().any(|m| m.0 == offsets && m.1 == sizes) {
            return Err(bad(format!(
                "local shard at offsets {offsets:?} is not among the ShardedTensor's shards"
            )));
        }
        pieces.push(LocalPiece {
            offsets,
            sizes,
            tensor,
        });
    }
    Ok(ShardedLeaf {
        dtype,
        shape,
        pieces,
        layout: Layout::ShardedTensor {
            rank,
            world_size,
            group_rank,
            group_size,
            shards,
        },
    })
}

/// The class a `NEWOBJ` was applied to (for the process group state, a `getattr` call).
fn pg_class(value: &Value) -> Value {
    match value {
        Value::Object(o) => o.callable.clone(),
        _ => Value::None,
    }
}

/// `ShardMetadata(shard_offsets, shard_sizes, placement=_remote_device)`.
fn shard_metadata(value: &Value) -> Result<(Vec<u64>, Vec<u64>, Option<u64>)> {
    let m = fields_of(
        value,
        ("torch.distributed._shard.metadata", "ShardMetadata"),
    )?;
    let offsets = ints(
        Some(field(m, "shard_offsets", "ShardMetadata")?),
        "shard offsets",
    )?;
    let sizes = ints(
        Some(field(m, "shard_sizes", "ShardMetadata")?),
        "shard sizes",
    )?;
    if offsets.len() != sizes.len() {
        return Err(bad("shard offsets and sizes differ in length"));
    }
    let rank = spec_field(m, "placement")
        .and_then(|p| p.state())
        .and_then(fields)
        .and_then(|p| spec_field(p, "_rank"))
        .and_then(Value::as_int)
        .and_then(|r| u64::try_from(r).ok());
    Ok((offsets, sizes, rank))
}

/// The `__dict__` an object was built with: a dict, or the dict of a `(slots, dict)` pair.
fn fields(state: &Value) -> Option<&[(Value, Value)]> {
    match state {
        Value::Dict(items) => Some(items),
        Value::Tuple(pair) if pair.len() == 2 => pair[1].as_dict(),
        _ => None,
    }
}

/// The fields of an object of `class`.
fn fields_of<'a>(value: &'a Value, class: (&str, &str)) -> Result<&'a [(Value, Value)]> {
    if value.class() != Some(class) {
        return Err(bad(format!("expected a `{}.{}`", class.0, class.1)));
    }
    Ok(value.state().and_then(fields).unwrap_or_default())
}

fn spec_field<'a>(items: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    items
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

fn field<'a>(items: &'a [(Value, Value)], key: &str, what: &str) -> Result<&'a Value> {
    spec_field(items, key).ok_or_else(|| bad(format!("{what} without `{key}`")))
}

/// A tuple or list of non-negative ints, or a `torch.Size` of one.
fn ints(value: Option<&Value>, what: &str) -> Result<Vec<u64>> {
    let items = match value {
        Some(v) if v.class() == Some(("torch", "Size")) => {
            v.args().and_then(|a| a.first()).and_then(Value::as_seq)
        }
        Some(v) => v.as_seq(),
        None => None,
    };
    items
        .ok_or_else(|| bad(format!("{what} is not a tuple")))?
        .iter()
        .map(|v| match v {
            Value::Int(i) => u64::try_from(*i).map_err(|_| bad(format!("{what} holds {i}"))),
            _ => Err(bad(format!("{what} holds a non-integer"))),
        })
        .collect()
}

fn bad(message: impl Into<String>) -> Error {
    Error::invalid(format!("malformed `data.pkl`: {}", message.into()))
}

// ------------------------------------------------------------------------------------------------
// Directories and lists of per-rank files

/// A file named as one rank's save.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RankFile {
    path: PathBuf,
    /// `model` of `model_world_size_4_rank_0.pt`; empty for `rank0.pt`.
    prefix: String,
    world_size: Option<usize>,
    rank: usize,
}

impl RankFile {
    /// The name this prefix's file of `rank` has, for messages about a missing one.
    fn sibling(&self, rank: usize) -> String {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ext = self
            .path
            .extension()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stem = &name[..name.len() - ext.len() - usize::from(!ext.is_empty())];
        let digits = stem.len() - stem.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        format!("{}{rank}.{ext}", &stem[..stem.len() - digits])
    }
}

/// `(prefix, world size, rank)` of a per-rank file name: `{prefix}_world_size_{W}_rank_{R}`,
/// `{prefix}_rank{R}`, `{prefix}_rank_{R}`, `rank{R}`, `rank_{R}`, each `.pt`, `.pth` or `.bin`.
fn parse_name(file_name: &str) -> Option<(String, Option<usize>, usize)> {
    let stem = [".pt", ".pth", ".bin"]
        .iter()
        .find_map(|ext| file_name.strip_suffix(ext))?;
    let number = |s: &str| -> Option<usize> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    if let Some((head, r)) = stem.rsplit_once("_rank_") {
        let split = match head.strip_prefix("world_size_") {
            Some(w) => Some(("", w)),
            None => head
                .rsplit_once("_world_size_")
                .filter(|(p, _)| !p.is_empty()),
        };
        if let Some((prefix, w)) = split {
            return Some((prefix.to_string(), Some(number(w)?), number(r)?));
        }
    }
    let digits = stem.len() - stem.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let rank = number(&stem[stem.len() - digits..])?;
    let head = &stem[..stem.len() - digits];
    let prefix = match head {
        "rank" | "rank_" => "",
        _ => head
            .strip_suffix("_rank_")
            .or_else(|| head.strip_suffix("_rank"))
            .filter(|p| !p.is_empty())?,
    };
    Some((prefix.to_string(), None, rank))
}

/// Per-rank torch.save files: a directory of them, several given, or one rank's file holding
/// DTensor or ShardedTensor values.
pub struct PerRank;

impl crate::layout::Layout for PerRank {
    fn describe(&self) -> &'static str {
        "per-rank torch.save files (`model_world_size_4_rank_0.pt`, `rank0.pt`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        let files: Vec<PathBuf> = match at {
            Listing::Dir { .. } => at
                .files()
                .into_iter()
                .filter(|e| is_rank_file(&e.path))
                .map(|e| e.path.clone())
                .collect(),
            Listing::Files(many) => many.iter().map(|e| e.path.clone()).collect(),
            // A single file named as a rank's is one only when it holds a rank's pieces: a
            // `rank0.pt` of whole tensors is a plain torch.save.
            Listing::File(f) if is_rank_file(&f.path) && holds_pieces(&f.path)? => {
                vec![f.path.clone()]
            }
            Listing::File(_) => Vec::new(),
        };
        let Some(first) = files.first() else {
            return Ok(None);
        };
        let path = match at.dir() {
            Some(dir) => dir.to_path_buf(),
            None => first.parent().map(Path::to_path_buf).unwrap_or_default(),
        };
        Ok(Some(Found { path, files }))
    }

    fn read(&self, found: &Found, _: &ReadOptions) -> Result<Checkpoint> {
        read(&found.files)
    }
}

/// Whether a file's name is one rank's save (`model_world_size_4_rank_0.pt`, `rank0.pt`).
fn is_rank_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_name)
        .is_some()
}

/// Whether a torch.save file holds DTensor or ShardedTensor values.
fn holds_pieces(path: &Path) -> Result<bool> {
    let input = storage::Input::open(path, Access::Map)?;
    let bytes = input.zip_view(0, input.len())?;
    let archive = torch_save::read(&bytes).map_err(|e| e.file(path))?;
    Ok(archive
        .leaves
        .iter()
        .any(|(_, leaf)| matches!(leaf, Leaf::Sharded(_))))
}

/// Read per-rank files (every rank of one or more prefixes, in one directory) as one checkpoint.
pub fn read(paths: &[PathBuf]) -> Result<Checkpoint> {
    let files = rank_files(paths)?;
    let root = files[0]
        .path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let world_size = world_size(&files)?;
    let mut merged = Merged::default();
    // The highest rank a mesh or process group names, with the entry and file that name it.
    let mut last_needed: Option<(u64, String, PathBuf)> = None;
    for f in &files {
        let name = PathBuf::from(f.path.file_name().unwrap_or_default());
        let file: Arc<Path> = name.as_path().into();
        let input = storage::Input::open(&f.path, Access::Map)?;
        let bytes = input.zip_view(0, input.len())?;
        let archive = torch_save::read(&bytes).map_err(|e| {
            e.file(&f.path).hint(
                "every file of a per-rank checkpoint is read; pass the others as a list of files to leave this one out",
            )
        })?;
        for (key_path, leaf) in &archive.leaves {
            let mut path = Vec::with_capacity(key_path.len() + 1);
            if !f.prefix.is_empty() {
                path.push(KeyPart::Key(f.prefix.clone()));
            }
            path.extend(key_path.iter().cloned());
            let name = KeyPart::flat_name(&path);
            let err = |e: Error| e.file(&f.path).tensor(&name);
            match leaf {
                Leaf::Tensor(t) => {
                    let piece = piece(&archive, t, &file, vec![0; t.shape.len()]).map_err(err)?;
                    if let Some(column) =
                        merged.tensor(name.clone(), path, t.dtype, &t.shape, false, &f.path)?
                    {
                        column.push(piece).map_err(err)?;
                    }
                }
                Leaf::Sharded(s) => {
                    if !s.layout.saved_by(f.rank as u64) {
                        return Err(Error::invalid(format!(
                            "the file is named as rank {}'s, but rank {} saved it",
                            f.rank,
                            s.layout.rank().unwrap_or_default()
                        ))
                        .file(&f.path)
                        .tensor(&name)
                        .hint("rename the files after the ranks that saved them"));
                    }
                    if let Some(r) = s.layout.last_rank() {
                        if last_needed.as_ref().is_none_or(|(l, ..)| r > *l) {
                            last_needed = Some((r, name.clone(), f.path.clone()));
                        }
                    }
                    let pieces = s
                        .pieces
                        .iter()
                        .map(|p| piece(&archive, &p.tensor, &file, p.offsets.clone()))
                        .collect::<Result<Vec<_>>>()
                        .map_err(err)?;
                    if let Some(column) =
                        merged.tensor(name.clone(), path, s.dtype, &s.shape, true, &f.path)?
                    {
                        for p in pieces {
                            column.push(p).map_err(err)?;
                        }
                    }
                }
                Leaf::Value(v) => {
                    let mut flat = Vec::new();
                    flatten_value(path, v, &mut flat);
                    for (path, v) in flat {
                        let name = KeyPart::flat_name(&path);
                        merged.value(name, path, &v, &f.path)?;
                    }
                }
                Leaf::Unsupported { dtype } => merged.unsupported(name, dtype, &file),
            }
        }
    }
    // A mesh or process group that names a rank beyond the files: that rank's file is missing.
    if let Some((r, name, by)) = last_needed.filter(|(r, ..)| *r >= world_size as u64) {
        let missing: Vec<String> = prefixes(&files)
            .into_iter()
            .map(|f| format!("`{}`", f.sibling(world_size)))
            .collect();
        let which = if r == world_size as u64 {
            format!("rank {r}'s file is missing")
        } else {
            format!("the files of ranks {world_size} to {r} are missing, the first")
        };
        return Err(Error::invalid(format!(
            "{which}: {} (the files go up to rank {}, but `{name}` in this file is placed on rank {r})",
            missing.join(", "),
            world_size.saturating_sub(1)
        ))
        .file(by)
        .hint("pass every rank's file, or the directory that holds them"));
    }
    // FSDP1 LOCAL_STATE_DICT with use_orig_params=True saves each parameter's name with the rank's
    // own 1-D slice of it, of another length on each rank: beside flat parameters, the first
    // file's slice is kept (as DCP keeps one rank's), for `--shapes-from` to replace
    // (crate::formats::fsdp_local); anywhere else, ranks that disagree on a tensor are an error.
    let flat = merged
        .tensors
        .iter()
        .any(|(t, _)| crate::model::is_flat_param(&t.name));
    if !flat {
        if let Some((_, first)) = std::mem::take(&mut merged.slices).pop_first() {
            return Err(first);
        }
    }
    Ok(Checkpoint {
        root,
        format: Format::PerRankTorchSave,
        world_size: Some(world_size),
        tensors: merged.tensors.into_iter().map(|(t, _)| t).collect(),
        values: merged.values.into_iter().map(|(v, _)| v).collect(),
        unsupported: merged.unsupported,
        details: Vec::new(),
    })
}

/// A value as DCP's `flatten_state_dict` flattens it: a list that holds a dict is walked, its
/// items named by index (`optim.param_groups.0.lr`), so that a DCP written from it has the keys
/// torch's own `dcp.save` gives the same state dict, and a torch.save rebuilds the list.
fn flatten_value(path: Vec<KeyPart>, value: &Value, out: &mut Vec<(Vec<KeyPart>, Value)>) {
    match value {
        Value::List(items) if !is_terminal(value) => {
            for (i, item) in items.iter().enumerate() {
                let mut p = path.clone();
                p.push(KeyPart::Index(i as i64));
                flatten_value(p, item, out);
            }
        }
        Value::Dict(items) if !is_terminal(value) => {
            for (k, v) in items {
                let mut p = path.clone();
                p.push(match k {
                    Value::Int(i) => KeyPart::IntKey(*i),
                    k => KeyPart::Key(k.as_str().unwrap_or_default().to_string()),
                });
                flatten_value(p, v, out);
            }
        }
        _ => out.push((path, value.clone())),
    }
}

/// Whether DCP keeps a value whole: anything but a non-empty dict with str or int keys, or a
/// list holding one. (An empty dict stays a value, as the torch.save reader keeps it.)
fn is_terminal(value: &Value) -> bool {
    match value {
        Value::Dict(items) => {
            items.is_empty()
                || !items
                    .iter()
                    .all(|(k, _)| matches!(k, Value::Str(_) | Value::Int(_)))
        }
        Value::List(items) => items.iter().all(is_terminal),
        _ => true,
    }
}

/// The tensor piece a saved tensor holds, at `offsets` of the global tensor.
fn piece(
    archive: &torch_save::Archive,
    t: &SavedTensor,
    file: &Arc<Path>,
    offsets: Vec<u64>,
) -> Result<Piece> {
    let entry = archive
        .storage(&t.storage_key)
        .ok_or_else(|| Error::invalid(format!("no storage record `{}`", t.storage_key)))?;
    Ok(Piece {
        offsets,
        sizes: t.shape.clone(),
        data: DataRef {
            file: Arc::clone(file),
            offset: entry.data_offset + t.storage_offset * t.dtype.size() as u64,
            strides: t.strides.clone(),
            encoding: Encoding::Raw,
        },
    })
}

/// Each file's name parsed, sorted by prefix then rank; every file in one directory.
fn rank_files(paths: &[PathBuf]) -> Result<Vec<RankFile>> {
    let mut files = Vec::with_capacity(paths.len());
    for path in paths {
        let parsed = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_name);
        let Some((prefix, world_size, rank)) = parsed else {
            return Err(Error::usage(
                "not named as one rank's file of a per-rank checkpoint",
            )
            .file(path)
            .hint("ckpt reads per-rank files named `{prefix}_world_size_{W}_rank_{R}.pt`, `{prefix}_rank{R}.pt` or `rank{R}.pt`"));
        };
        files.push(RankFile {
            path: path.clone(),
            prefix,
            world_size,
            rank,
        });
    }
    let Some(first) = files.first() else {
        return Err(Error::usage("no per-rank files given"));
    };
    let dir = first
        .path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if let Some(other) = files
        .iter()
        .find(|f| f.path.parent().map(Path::to_path_buf).unwrap_or_default() != dir)
    {
        return Err(Error::usage(format!(
            "per-rank files must be in one directory; `{}` is not beside `{}`",
            other.path.display(),
            first.path.display()
        )));
    }
    // `model` before `optim` before the rest, as a state dict usually lists them.
    files.sort_by(|a, b| {
        let key = |f: &RankFile| {
            (
                f.prefix != "model",
                f.prefix != "optim",
                f.prefix.clone(),
                f.rank,
            )
        };
        key(a).cmp(&key(b))
    });
    for w in files.windows(2) {
        if w[0].prefix == w[1].prefix && w[0].rank == w[1].rank {
            return Err(Error::usage(format!(
                "two files of rank {} for the same prefix: `{}` and `{}`",
                w[0].rank,
                w[0].path.display(),
                w[1].path.display()
            )));
        }
    }
    Ok(files)
}

/// One file per prefix (the first), to name its siblings.
fn prefixes(files: &[RankFile]) -> Vec<&RankFile> {
    let mut seen = std::collections::BTreeSet::new();
    files
        .iter()
        .filter(|f| seen.insert(f.prefix.clone()))
        .collect()
}

/// The world size the file names say, checked to be one, with every rank of every prefix present.
fn world_size(files: &[RankFile]) -> Result<usize> {
    let named: Vec<&RankFile> = files.iter().filter(|f| f.world_size.is_some()).collect();
    if let Some(first) = named.first() {
        if let Some(other) = named.iter().find(|f| f.world_size != first.world_size) {
            return Err(Error::invalid(format!(
                "files of different world sizes: `{}` is of {}, `{}` of {}",
                first.path.display(),
                first.world_size.unwrap_or_default(),
                other.path.display(),
                other.world_size.unwrap_or_default()
            ))
            .hint("a checkpoint is the files of one run: point ckpt at one world size's files"));
        }
    }
    let world_size = match named.first().and_then(|f| f.world_size) {
        Some(w) => w,
        None => files
            .iter()
            .map(|f| f.rank.saturating_add(1))
            .max()
            .unwrap_or(0),
    };
    for f in files {
        if f.rank >= world_size {
            return Err(
                Error::invalid(format!("rank {} of a world of {world_size}", f.rank)).file(&f.path),
            );
        }
    }
    for f in prefixes(files) {
        let have: std::collections::BTreeSet<usize> = files
            .iter()
            .filter(|g| g.prefix == f.prefix)
            .map(|g| g.rank)
            .collect();
        // A few are named; a world size in a name can be anything.
        let count = world_size - have.len();
        let missing: Vec<String> = (0..world_size)
            .filter(|r| !have.contains(r))
            .take(8)
            .map(|r| f.sibling(r))
            .collect();
        if count > 0 {
            let dir = f.path.parent().unwrap_or(Path::new("."));
            let listed: Vec<String> = missing.iter().map(|m| format!("`{m}`")).collect();
            let beside = missing.iter().all(|m| dir.join(m).is_file());
            let hint = if beside {
                format!(
                    "they are beside it: pass the directory `{}` (or every rank's file)",
                    dir.display()
                )
            } else {
                "every rank's file is needed: copy the missing ones beside the others".to_string()
            };
            let what = if beside { "not given" } else { "missing" };
            let more = if count > missing.len() { ", ..." } else { "" };
            return Err(Error::invalid(format!(
                "{count} of {world_size} ranks' files are {what}: {}{more}",
                listed.join(", ")
            ))
            .file(dir)
            .hint(hint));
        }
    }
    Ok(world_size)
}

/// Entries merged over the ranks' files, in the order they first appear, each with the file that
/// first gave it (for messages) and whether it is sharded.
#[derive(Default)]
struct Merged {
    tensors: Vec<(Tensor, (PathBuf, bool))>,
    values: Vec<(NonTensor, PathBuf)>,
    unsupported: Vec<Unsupported>,
    index: HashMap<String, Slot>,
    /// Plain 1-D tensors of another length in each file (FSDP1 LOCAL per-parameter slices, whose
    /// first file's piece is kept), with the error they are if the files hold no flat parameters.
    slices: std::collections::BTreeMap<String, Error>,
}

#[derive(Clone, Copy)]
enum Slot {
    Tensor(usize),
    Value(usize),
    Unsupported,
}

impl Merged {
    /// The pieces of tensor `name`, which every file must give the same dtype, global shape and
    /// kind (sharded, or a plain tensor that each file holds whole).
    fn tensor(
        &mut self,
        name: String,
        key_path: Vec<KeyPart>,
        dtype: DType,
        shape: &[u64],
        sharded: bool,
        file: &Path,
    ) -> Result<Option<&mut Pieces>> {
        if self.slices.contains_key(&name) {
            return Ok(None);
        }
        let kind = |s: bool| if s { "sharded" } else { "plain" };
        let k = match self.index.get(&name).copied() {
            Some(Slot::Tensor(k)) => {
                let (t, (first, was_sharded)) = &self.tensors[k];
                if t.dtype != dtype || t.shape != shape || *was_sharded != sharded {
                    let slice = !sharded
                        && !*was_sharded
                        && t.dtype == dtype
                        && t.shape.len() == 1
                        && shape.len() == 1;
                    let err = Error::invalid(format!(
                        "ranks disagree on this tensor: `{}` has a {} {} of shape {:?}, `{}` a {} {dtype} of shape {shape:?}",
                        first.display(),
                        kind(*was_sharded),
                        t.dtype,
                        t.shape,
                        file.display(),
                        kind(sharded),
                    ))
                    .file(file)
                    .tensor(&name)
                    .hint("the files are not of one save: check that they come from the same step");
                    if slice {
                        self.slices.insert(name, err);
                        return Ok(None);
                    }
                    return Err(err);
                }
                k
            }
            Some(_) => return Err(mixed(&name, file)),
            None => {
                self.index
                    .insert(name.clone(), Slot::Tensor(self.tensors.len()));
                self.tensors.push((
                    Tensor {
                        name,
                        key_path,
                        dtype,
                        shape: shape.to_vec(),
                        pieces: Pieces::new(shape.len()),
                    },
                    (file.to_path_buf(), sharded),
                ));
                self.tensors.len() - 1
            }
        };
        Ok(Some(&mut self.tensors[k].0.pieces))
    }

    /// A non-tensor entry: every file that holds it must hold the same value, since ckpt keeps one.
    fn value(
        &mut self,
        name: String,
        key_path: Vec<KeyPart>,
        value: &Value,
        file: &Path,
    ) -> Result<()> {
        match self.index.get(&name).copied() {
            Some(Slot::Value(k)) => {
                let (v, first) = &self.values[k];
                if v.value.as_ref() != Some(value) {
                    return Err(Error::invalid(format!(
                        "this non-tensor entry differs between `{}` and `{}`; ckpt keeps one copy of each entry",
                        first.display(),
                        file.display()
                    ))
                    .file(file)
                    .tensor(&name)
                    .hint("per-rank state (a data loader's position) cannot be merged: pass the other files as a list to leave these out"));
                }
                Ok(())
            }
            Some(_) => Err(mixed(&name, file)),
            None => {
                self.index
                    .insert(name.clone(), Slot::Value(self.values.len()));
                self.values.push((
                    NonTensor {
                        name,
                        key_path,
                        value: Some(value.clone()),
                        raw: None,
                    },
                    file.to_path_buf(),
                ));
                Ok(())
            }
        }
    }

    fn unsupported(&mut self, name: String, dtype: &str, file: &Arc<Path>) {
        if self.index.contains_key(&name) {
            return;
        }
        self.index.insert(name.clone(), Slot::Unsupported);
        self.unsupported.push(Unsupported {
            name,
            dtype: dtype.to_string(),
            file: file.to_path_buf(),
        });
    }
}

fn mixed(name: &str, file: &Path) -> Error {
    Error::invalid("ranks disagree on this entry: a tensor in one file, not in another")
        .file(file)
        .tensor(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_rank_files() {
        let p = |s: &str| parse_name(s);
        assert_eq!(
            p("model_world_size_4_rank_3.pt"),
            Some(("model".into(), Some(4), 3))
        );
        assert_eq!(
            p("extra_state_world_size_16_rank_10.pt"),
            Some(("extra_state".into(), Some(16), 10))
        );
        assert_eq!(p("rank0.pt"), Some(("".into(), None, 0)));
        assert_eq!(p("world_size_2_rank_1.pt"), Some(("".into(), Some(2), 1)));
        assert_eq!(p("rank_12.pth"), Some(("".into(), None, 12)));
        assert_eq!(p("model_rank2.pt"), Some(("model".into(), None, 2)));
        assert_eq!(p("optim_rank_2.bin"), Some(("optim".into(), None, 2)));
        for no in [
            "model.pt",
            "rank.pt",
            "model_world_size_4_rank_.pt",
            "pytorch_model.bin",
            "rank0.safetensors",
            "frank3.pt",
            "_rank3.pt",
        ] {
            assert_eq!(p(no), None, "{no}");
        }
        let f = RankFile {
            path: "d/model_world_size_4_rank_0.pt".into(),
            prefix: "model".into(),
            world_size: Some(4),
            rank: 0,
        };
        assert_eq!(f.sibling(3), "model_world_size_4_rank_3.pt");
        let f = RankFile {
            path: "d/rank10.pt".into(),
            prefix: String::new(),
            world_size: None,
            rank: 10,
        };
        assert_eq!(f.sibling(2), "rank2.pt");
    }

    #[test]
    fn getattr_only_names_the_process_group_state() {
        let st = Value::global(SHARDED_TENSOR.0, SHARDED_TENSOR.1);
        assert!(check_getattr(&[st.clone(), Value::Str("ProcessGroupState".into())]).is_ok());
        assert!(check_getattr(&[st.clone(), Value::Str("__init__".into())]).is_err());
        assert!(check_getattr(&[
            Value::global("os", "system"),
            Value::Str("ProcessGroupState".into())
        ])
        .is_err());
        assert!(check_getattr(&[st]).is_err());
        assert!(allows_global("builtins", "getattr"));
        assert!(!allows_global("builtins", "eval"));
        assert!(!allows_global(
            "torch.distributed.tensor",
            "distribute_tensor"
        ));
    }
}
