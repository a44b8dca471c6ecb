//! DTensor and ShardedTensor values in a torch.save file, decoded as data: each rank's pieces of
//! a sharded tensor and how they were placed (mesh, placements, coordinate; or every shard's
//! offsets and the process group). Nothing is called: the classes they pickle through are allowed
//! by name ([`allows_global`]) and nowhere else. The per-rank layout reads sets of files that hold
//! them ([`crate::formats::per_rank`]).

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::geometry::{local_box_at, Placement};
use crate::pickle::Value;

use super::SavedTensor;

/// A tensor as one rank saved it: its global shape and the pieces this rank holds.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedLeaf {
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// This rank's pieces (a DTensor has one, possibly empty; a ShardedTensor any number).
    pub pieces: Vec<LocalPiece>,
    pub sharding: Sharding,
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
pub enum Sharding {
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

impl Sharding {
    /// The global rank that saved the file, when the value records it.
    pub fn rank(&self) -> Option<u64> {
        match self {
            Sharding::DTensor { rank, .. } | Sharding::ShardedTensor { rank, .. } => *rank,
        }
    }

    /// Whether a file named as rank `named`'s can be what the saving rank wrote: the rank is
    /// not recorded, or it is `named` in the job or in the process group that saved the value
    /// (a group that is not the whole job numbers its files either way: FSDP1 on a subgroup by
    /// the group's ranks, hybrid sharding by the job's).
    pub fn saved_by(&self, named: u64) -> bool {
        match self {
            Sharding::ShardedTensor {
                rank, group_rank, ..
            } => rank.is_none_or(|r| r == named) || *group_rank == Some(named),
            Sharding::DTensor { rank, .. } => rank.is_none_or(|r| r == named),
        }
    }

    /// `(job rank, group rank, group size)` of the saving rank when the value was saved by a
    /// process group smaller than the job and records both.
    pub fn subgroup(&self) -> Option<(u64, u64, u64)> {
        match self {
            Sharding::ShardedTensor {
                rank: Some(rank),
                world_size: Some(world),
                group_rank: Some(group_rank),
                group_size: Some(size),
                ..
            } if size < world => Some((*rank, *group_rank, *size)),
            _ => None,
        }
    }

    /// The highest rank that must have saved a file for this tensor to be whole.
    pub fn last_rank(&self) -> Option<u64> {
        match self {
            Sharding::DTensor { mesh_ranks, .. } => mesh_ranks.iter().max().copied(),
            // The shards are placed on the saving group's ranks.
            Sharding::ShardedTensor {
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
pub(super) fn allows_global(module: &str, name: &str) -> bool {
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
pub(super) fn check_getattr(args: &[Value]) -> Result<()> {
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
pub(super) fn is_process_group_state(callable: &Value) -> bool {
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
pub(super) fn decode(
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
pub(super) fn dtensor(
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
    let mesh = DeviceMesh::read(field(spec, "mesh", "DTensorSpec")?)?;
    let placements = field(spec, "placements", "DTensorSpec")?
        .as_seq()
        .ok_or_else(|| bad("DTensor placements are not a tuple"))?;
    if placements.len() != mesh.sizes.len() {
        return Err(bad(format!(
            "{} placements on a {}-dimensional mesh",
            placements.len(),
            mesh.sizes.len()
        )));
    }
    let placements = placements
        .iter()
        .map(|p| placement(p, shape.len()))
        .collect::<Result<Vec<_>>>()?;
    if let Some(order) = spec_field(spec, "shard_order") {
        check_shard_order(order)?;
    }
    let coordinate = mesh.coordinate;
    let b = local_box_at(&shape, &mesh.sizes, &placements, &coordinate);
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
        sharding: Sharding::DTensor {
            mesh: mesh.sizes,
            placements,
            coordinate,
            rank: mesh.rank,
            mesh_ranks: mesh.ranks,
        },
    })
}

/// What a DTensor's `DeviceMesh` says: its shape and where the saving rank sits in it.
struct DeviceMesh {
    /// Size of each mesh dimension.
    sizes: Vec<usize>,
    /// The saving rank's coordinate.
    coordinate: Vec<usize>,
    /// The saving rank (global), when recorded.
    rank: Option<u64>,
    /// Global ranks of the mesh, row-major; empty when not recorded.
    ranks: Vec<u64>,
}

impl DeviceMesh {
    /// The mesh pickled as `value`, once the saving rank's coordinate and rank agree with it.
    fn read(value: &Value) -> Result<DeviceMesh> {
        let mesh = fields_of(value, ("torch.distributed.device_mesh", "DeviceMesh"))?;
        let sizes = mesh_sizes(mesh)?;
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
        let ranks = match spec_field(mesh, "_flatten_rank_map") {
            Some(v) => ints(Some(v), "mesh rank map")?,
            None => Vec::new(),
        };
        let numel = sizes.iter().try_fold(1usize, |a, &s| a.checked_mul(s));
        if !ranks.is_empty() {
            // coordinates are below their sizes, so this stays below `numel`
            let at = coordinate.iter().zip(&sizes).fold(0usize, |acc, (&c, &s)| {
                acc.saturating_mul(s).saturating_add(c)
            });
            if numel != Some(ranks.len()) || rank.is_some_and(|r| ranks.get(at) != Some(&r)) {
                return Err(bad(format!(
                    "mesh of shape {sizes:?} with ranks {ranks:?} does not place rank {rank:?} at {coordinate:?}"
                )));
            }
        }
        Ok(DeviceMesh {
            sizes,
            coordinate,
            rank,
            ranks,
        })
    }
}

/// The size of each dimension of a `DeviceMesh` (its fields `mesh`), from its `_MeshLayout`.
fn mesh_sizes(mesh: &[(Value, Value)]) -> Result<Vec<usize>> {
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
    Ok(sizes)
}

pub(super) fn placement(value: &Value, ndim: usize) -> Result<Placement> {
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
pub(super) fn check_shard_order(order: &Value) -> Result<()> {
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
pub(super) fn sharded_tensor(
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
        sharding: Sharding::ShardedTensor {
            rank,
            world_size,
            group_rank,
            group_size,
            shards,
        },
    })
}

/// The class a `NEWOBJ` was applied to (for the process group state, a `getattr` call).
pub(super) fn pg_class(value: &Value) -> Value {
    match value {
        Value::Object(o) => o.callable.clone(),
        _ => Value::None,
    }
}

/// `ShardMetadata(shard_offsets, shard_sizes, placement=_remote_device)`.
pub(super) fn shard_metadata(value: &Value) -> Result<(Vec<u64>, Vec<u64>, Option<u64>)> {
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
pub(super) fn fields(state: &Value) -> Option<&[(Value, Value)]> {
    match state {
        Value::Dict(items) => Some(items),
        Value::Tuple(pair) if pair.len() == 2 => pair[1].as_dict(),
        _ => None,
    }
}

/// The fields of an object of `class`.
pub(super) fn fields_of<'a>(value: &'a Value, class: (&str, &str)) -> Result<&'a [(Value, Value)]> {
    if value.class() != Some(class) {
        return Err(bad(format!("expected a `{}.{}`", class.0, class.1)));
    }
    Ok(value.state().and_then(fields).unwrap_or_default())
}

pub(super) fn spec_field<'a>(items: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    items
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

pub(super) fn field<'a>(items: &'a [(Value, Value)], key: &str, what: &str) -> Result<&'a Value> {
    spec_field(items, key).ok_or_else(|| bad(format!("{what} without `{key}`")))
}

/// A tuple or list of non-negative ints, or a `torch.Size` of one.
pub(super) fn ints(value: Option<&Value>, what: &str) -> Result<Vec<u64>> {
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

pub(super) fn bad(message: impl Into<String>) -> Error {
    Error::invalid(format!("malformed `data.pkl`: {}", message.into()))
}

// ------------------------------------------------------------------------------------------------
// Directories and lists of per-rank files

#[cfg(test)]
mod tests {
    use super::*;

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
