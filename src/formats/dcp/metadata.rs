//! DCP `.metadata`: the pickled `torch.distributed.checkpoint.metadata.Metadata`, read into typed
//! structs and written back in the form PyTorch's `FileSystemReader` loads.
//!
//! The file is a pickle of dataclasses, so it is read with the data-only reader under a whitelist of
//! exactly the globals DCP writes (current and older module paths, see [`DcpGlobals`]); anything else
//! is refused by name before any meaning is read out of the tree. The writer builds the same object
//! graph torch 2.15 pickles (protocol 4) and lets [`crate::pickle::write`] serialize it.
//!
//! What is not kept: `TensorProperties` besides the dtype (layout must be strided; `requires_grad`,
//! `memory_format`, `pin_memory` and `strides` are informational and unused when torch loads), and
//! `storage_meta` (save and load ids, the original directory), which torch never reads back.

use std::collections::HashMap;

use crate::bail_invalid;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::{contiguous_strides, numel, KeyPart};
use crate::pickle::{self, Globals, Limits, PickleError, Protocol, Value};

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
pub fn parse(bytes: &[u8]) -> Result<DcpMetadata> {
    let root = pickle::read(bytes, &DcpGlobals, limits_for(bytes.len())).map_err(pickle_error)?;
    let state = object_state(&root, &[META, OLD_META], "Metadata").ok_or_else(|| {
        Error::invalid(format!(
            "the pickle holds {}, not a DCP `Metadata`",
            describe(&root)
        ))
    })?;

    let sdm = state
        .get("state_dict_metadata")
        .ok_or_else(|| Error::invalid("`Metadata` has no `state_dict_metadata`"))?;
    let sdm =
        dict_items(sdm).ok_or_else(|| Error::invalid("`state_dict_metadata` is not a dict"))?;
    let entries = sdm
        .iter()
        .map(|(k, v)| entry(k, v))
        .collect::<Result<Vec<_>>>()?;

    let storage = match state.get("storage_data") {
        None | Some(Value::None) => Vec::new(),
        Some(v) => {
            let items =
                dict_items(v).ok_or_else(|| Error::invalid("`storage_data` is not a dict"))?;
            let pairs = items
                .iter()
                .map(|(k, v)| Ok((metadata_index(k)?, storage_info(k, v)?)))
                .collect::<Result<Vec<_>>>()?;
            dedup_storage(pairs)
        }
    };

    let planner_data = match state.get("planner_data") {
        None | Some(Value::None) => Vec::new(),
        Some(v) => {
            let items =
                dict_items(v).ok_or_else(|| Error::invalid("`planner_data` is not a dict"))?;
            items
                .iter()
                .map(|(k, v)| planner_entry(k, v))
                .collect::<Result<Vec<_>>>()?
        }
    };

    let version = match state.get("version") {
        None | Some(Value::None) => None,
        Some(Value::Str(v)) => Some(v.clone()),
        Some(other) => bail_invalid!("`Metadata.version` is {}, not a string", describe(other)),
    };

    Ok(DcpMetadata {
        entries,
        storage,
        planner_data,
        version,
    })
}

/// Serialize metadata as PyTorch writes it (pickle protocol 4 of the real classes).
///
/// Mirrors torch 2.15's `FileSystemWriter`: the same classes, field order and state shapes. Fields
/// ckpt does not model are written as torch would for a fresh contiguous tensor: `strides` are the
/// row-major strides of the first chunk (torch records the saving rank's local shard), and
/// `storage_meta` is a `StorageMeta` with no ids or path. Sizes above `i64::MAX`, which no torch
/// tensor can have, are written as `i64::MAX`.
pub fn write(meta: &DcpMetadata) -> Vec<u8> {
    let entries = meta.entries.iter().map(|e| match e {
        DcpEntry::Tensor {
            fqn,
            dtype,
            size,
            chunks,
        } => (
            Value::Str(fqn.clone()),
            tensor_storage_metadata(*dtype, size, chunks),
        ),
        DcpEntry::Bytes { fqn } => (
            Value::Str(fqn.clone()),
            new_obj(META, "BytesStorageMetadata", None),
        ),
    });
    let planner_data = meta.planner_data.iter().map(|(fqn, path)| {
        let parts = path
            .iter()
            .map(|p| match p {
                KeyPart::Key(k) => Value::Str(k.clone()),
                KeyPart::Index(i) => Value::Int(*i),
            })
            .collect();
        (Value::Str(fqn.clone()), Value::Tuple(parts))
    });
    let storage = meta.storage.iter().map(|(index, info)| {
        let mut key = vec![
            field("fqn", Value::Str(index.fqn.clone())),
            field("index", index.index.map_or(Value::None, Value::Int)),
        ];
        if let Some(offset) = &index.offset {
            key.push(field("offset", torch_size(offset)));
        }
        let mut value = vec![
            field("relative_path", Value::Str(info.relative_path.clone())),
            field("offset", int(info.offset)),
            field("length", int(info.length)),
        ];
        // torch leaves the field out when there are no transforms.
        if !info.transforms.is_empty() {
            let t = info
                .transforms
                .iter()
                .map(|t| Value::Str(t.clone()))
                .collect();
            value.push(field("transform_descriptors", Value::List(t)));
        }
        (
            new_obj(META, "MetadataIndex", Some(Value::Dict(key))),
            new_obj(FS, "_StorageInfo", Some(Value::Dict(value))),
        )
    });
    let storage_meta = Value::Dict(vec![
        field("checkpoint_id", Value::None),
        field("save_id", Value::None),
        field("load_id", Value::None),
        field("modules", Value::List(Vec::new())),
    ]);
    let state = Value::Dict(vec![
        field("state_dict_metadata", Value::Dict(entries.collect())),
        field("planner_data", Value::Dict(planner_data.collect())),
        field("storage_data", Value::Dict(storage.collect())),
        field(
            "storage_meta",
            new_obj(META, "StorageMeta", Some(storage_meta)),
        ),
        field(
            "version",
            meta.version.clone().map_or(Value::None, Value::Str),
        ),
    ]);
    pickle::write(&new_obj(META, "Metadata", Some(state)), Protocol::V4)
}

/// Where DCP defines its classes now, and where torch 1.13 defined them (`torch.distributed._shard`
/// re-exports the new module under the old name, so such files still load in torch).
const META: &str = "torch.distributed.checkpoint.metadata";
const OLD_META: &str = "torch.distributed._shard.checkpoint.metadata";
/// `TensorProperties` and its memory-format enum lived here until DCP got its own copy (torch 2.2).
const SHARDED_TENSOR_META: &str = "torch.distributed._shard.sharded_tensor.metadata";
const FS: &str = "torch.distributed.checkpoint.filesystem";
const OLD_FS: &str = "torch.distributed._shard.checkpoint.filesystem";

/// Every dtype torch 2.15 has. All are names of data-only objects, so allowing them is harmless, and
/// it lets an unsupported one (`torch.complex64`) be reported against the tensor that has it.
const TORCH_DTYPES: &[&str] = &[
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
/// and the `pathlib` classes `StorageMeta.checkpoint_id` pickles as (`pathlib._local` is where
/// Python 3.13 defined them).
pub struct DcpGlobals;

impl Globals for DcpGlobals {
    fn allows(&self, module: &str, name: &str) -> bool {
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
}

/// Bounds that scale with the file: a real `.metadata` memoizes about one object per byte it spends
/// and copies little, so a pickle that expands far past its own size is abuse, not a checkpoint.
fn limits_for(len: usize) -> Limits {
    let default = Limits::default();
    Limits {
        max_memo: default.max_memo.max(len),
        max_nodes: default.max_nodes.max(len.saturating_mul(4)),
        ..default
    }
}

fn pickle_error(err: PickleError) -> Error {
    let forbidden = matches!(err, PickleError::ForbiddenGlobal { .. });
    let offset = err.offset();
    let mut e = Error::from(err);
    if let Some(o) = offset {
        e.offset = Some(o as u64);
        e.message = e.message.replace(&format!(" at byte {o}"), "");
    }
    if forbidden {
        e = e.hint("ckpt reads only the classes torch's `FileSystemWriter` puts in `.metadata`; a custom planner or storage writer may have added others");
    }
    e
}

/// One `state_dict_metadata` item.
fn entry(key: &Value, value: &Value) -> Result<DcpEntry> {
    let fqn = key
        .as_str()
        .ok_or_else(|| {
            Error::invalid(format!(
                "a `state_dict_metadata` key is {}, not a string",
                describe(key)
            ))
        })?
        .to_string();
    if object_state_or_none(value, &[META, OLD_META], "BytesStorageMetadata").is_some() {
        return Ok(DcpEntry::Bytes { fqn });
    }
    let Some(state) = object_state(value, &[META, OLD_META], "TensorStorageMetadata") else {
        bail_invalid!(
            "entry `{fqn}` is {}, not a tensor or bytes entry",
            describe(value)
        );
    };
    tensor(&fqn, state).map_err(|e| e.tensor(&fqn))
}

fn tensor(fqn: &str, state: &Value) -> Result<DcpEntry> {
    let properties = state
        .get("properties")
        .ok_or_else(|| Error::invalid("`properties` is missing"))?;
    let dtype = tensor_dtype(properties)?;
    let size = state
        .get("size")
        .and_then(torch_size_of)
        .ok_or_else(|| Error::invalid("`size` is not a `torch.Size` of non-negative integers"))?;
    if numel(&size)
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .is_none()
    {
        bail_invalid!("size {size:?} has more bytes than fit in 64 bits");
    }
    let chunk_values = state
        .get("chunks")
        .and_then(Value::as_seq)
        .ok_or_else(|| Error::invalid("`chunks` is not a list"))?;
    let chunks = chunk_values
        .iter()
        .map(|c| chunk(c, &size))
        .collect::<Result<Vec<_>>>()?;
    Ok(DcpEntry::Tensor {
        fqn: fqn.to_string(),
        dtype,
        size,
        chunks,
    })
}

/// The dtype out of a `TensorProperties`, after checking the layout is strided.
fn tensor_dtype(properties: &Value) -> Result<DType> {
    let state = object_state(
        properties,
        &[META, OLD_META, SHARDED_TENSOR_META],
        "TensorProperties",
    )
    .ok_or_else(|| {
        Error::invalid(format!(
            "`properties` is {}, not `TensorProperties`",
            describe(properties)
        ))
    })?;
    // `__getstate__` gives (dtype, layout, requires_grad, memory_format, pin_memory[, strides]);
    // a dataclass pickled without it would give its `__dict__`.
    let (dtype, layout) = match state {
        Value::Tuple(items) if items.len() == 5 || items.len() == 6 => {
            (items.first(), items.get(1))
        }
        Value::Dict(_) => (state.get("dtype"), state.get("layout")),
        other => bail_invalid!(
            "`TensorProperties` state is {}, not a 5- or 6-tuple or a dict",
            describe(other)
        ),
    };
    let dtype = match dtype.and_then(Value::as_global) {
        Some(("torch", name)) => DType::from_torch_name(name).ok_or_else(|| {
            Error::invalid(format!("dtype `torch.{name}` is not supported by ckpt"))
        })?,
        _ => bail_invalid!(
            "`TensorProperties.dtype` is {}, not a torch dtype",
            describe_opt(dtype)
        ),
    };
    match layout {
        // A missing layout takes the dataclass default, `torch.strided`.
        None => {}
        Some(l) => match (l.class(), l.args()) {
            (Some(("torch.serialization", "_get_layout")), Some([Value::Str(name)]))
                if name == "torch.strided" => {}
            (Some(("torch.serialization", "_get_layout")), Some([Value::Str(name)])) => {
                bail_invalid!("layout `{name}` is not supported by ckpt (only `torch.strided`)")
            }
            _ => bail_invalid!(
                "`TensorProperties.layout` is {}, not a torch layout",
                describe(l)
            ),
        },
    }
    Ok(dtype)
}

fn chunk(value: &Value, size: &[u64]) -> Result<Chunk> {
    let state =
        object_state(value, &[META, OLD_META], "ChunkStorageMetadata").ok_or_else(|| {
            Error::invalid(format!(
                "a chunk is {}, not `ChunkStorageMetadata`",
                describe(value)
            ))
        })?;
    let offsets = state.get("offsets").and_then(torch_size_of);
    let sizes = state.get("sizes").and_then(torch_size_of);
    let (Some(offsets), Some(sizes)) = (offsets, sizes) else {
        bail_invalid!(
            "a chunk's `offsets` or `sizes` is not a `torch.Size` of non-negative integers"
        );
    };
    let fits = offsets.len() == size.len()
        && sizes.len() == size.len()
        && offsets
            .iter()
            .zip(&sizes)
            .zip(size)
            .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|end| end <= d));
    if !fits {
        bail_invalid!(
            "chunk at offsets {offsets:?} with sizes {sizes:?} does not fit in size {size:?}"
        );
    }
    Ok(Chunk { offsets, sizes })
}

fn metadata_index(value: &Value) -> Result<MetadataIndex> {
    let state = object_state(value, &[META, OLD_META], "MetadataIndex").ok_or_else(|| {
        Error::invalid(format!(
            "a `storage_data` key is {}, not `MetadataIndex`",
            describe(value)
        ))
    })?;
    let fqn = match state.get("fqn") {
        Some(Value::Str(s)) => s.clone(),
        other => bail_invalid!(
            "`MetadataIndex.fqn` is {}, not a string",
            describe_opt(other)
        ),
    };
    let offset = match state.get("offset") {
        None | Some(Value::None) => None,
        Some(v) => Some(torch_size_of(v).ok_or_else(|| {
            Error::invalid(format!(
                "`MetadataIndex.offset` of `{fqn}` is not a `torch.Size`"
            ))
        })?),
    };
    let index = match state.get("index") {
        None | Some(Value::None) => None,
        Some(Value::Int(i)) => Some(*i),
        Some(other) => bail_invalid!(
            "`MetadataIndex.index` of `{fqn}` is {}, not an int",
            describe(other)
        ),
    };
    Ok(MetadataIndex { fqn, offset, index })
}

fn storage_info(key: &Value, value: &Value) -> Result<StorageInfo> {
    let fqn = key
        .state()
        .and_then(|s| s.get("fqn"))
        .and_then(Value::as_str)
        .unwrap_or("?");
    let state = object_state(value, &[FS, OLD_FS], "_StorageInfo").ok_or_else(|| {
        Error::invalid(format!(
            "storage of `{fqn}` is {}, not `_StorageInfo`",
            describe(value)
        ))
    })?;
    let relative_path = match state.get("relative_path") {
        Some(Value::Str(p)) if is_plain_relative(p) => p.clone(),
        Some(Value::Str(p)) => {
            bail_invalid!("storage of `{fqn}` points at `{p}`, outside the checkpoint directory")
        }
        other => bail_invalid!(
            "`relative_path` of `{fqn}` is {}, not a string",
            describe_opt(other)
        ),
    };
    let number = |name: &str| -> Result<u64> {
        state
            .get(name)
            .and_then(Value::as_int)
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "`{name}` of `{fqn}`'s storage is not a non-negative int"
                ))
            })
    };
    let (offset, length) = (number("offset")?, number("length")?);
    if offset.checked_add(length).is_none() {
        bail_invalid!("storage of `{fqn}` ends past 2^64 bytes");
    }
    let transforms = match state.get("transform_descriptors") {
        None | Some(Value::None) => Vec::new(),
        Some(v) => v
            .as_seq()
            .and_then(|items| {
                items
                    .iter()
                    .map(|t| t.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                Error::invalid(format!(
                    "`transform_descriptors` of `{fqn}` is not a list of strings"
                ))
            })?,
    };
    Ok(StorageInfo {
        relative_path,
        offset,
        length,
        transforms,
    })
}

/// A path that stays inside the checkpoint directory when joined to it: not absolute, no drive
/// or `..`. torch would follow any path; ckpt refuses to read files a checkpoint does not own.
fn is_plain_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with(['/', '\\'])
        && !path.contains(':')
        && path.split(['/', '\\']).all(|part| part != "..")
}

fn planner_entry(key: &Value, value: &Value) -> Result<(String, Vec<KeyPart>)> {
    let fqn = key.as_str().ok_or_else(|| {
        Error::invalid(format!(
            "a `planner_data` key is {}, not a string",
            describe(key)
        ))
    })?;
    let parts = value.as_seq().and_then(|items| {
        items
            .iter()
            .map(|p| match p {
                Value::Str(s) => Some(KeyPart::Key(s.clone())),
                Value::Int(i) => Some(KeyPart::Index(*i)),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
    });
    let parts = parts.ok_or_else(|| {
        Error::invalid(format!(
            "`planner_data` of `{fqn}` is {}, not a tuple of keys",
            describe(value)
        ))
    })?;
    Ok((fqn.to_string(), parts))
}

/// Python's dict keeps one entry per `MetadataIndex` (equal when `fqn` and `offset` are): the first
/// key with the last value.
fn dedup_storage(pairs: Vec<(MetadataIndex, StorageInfo)>) -> Vec<(MetadataIndex, StorageInfo)> {
    let mut out: Vec<(MetadataIndex, StorageInfo)> = Vec::with_capacity(pairs.len());
    let mut seen: HashMap<(String, Option<Vec<u64>>), usize> = HashMap::new();
    for (index, info) in pairs {
        let key = (index.fqn.clone(), index.offset.clone());
        match seen.get(&key).and_then(|&i| out.get_mut(i)) {
            Some(slot) => slot.1 = info,
            None => {
                seen.insert(key, out.len());
                out.push((index, info));
            }
        }
    }
    out
}

/// Items of a dict or an `OrderedDict`.
fn dict_items(value: &Value) -> Option<&[(Value, Value)]> {
    match value {
        Value::Dict(items) => Some(items),
        Value::Object { dict_items, .. }
            if value.class() == Some(("collections", "OrderedDict")) =>
        {
            Some(dict_items)
        }
        _ => None,
    }
}

/// The state of an object of class `name` from one of `modules`, which must have one.
fn object_state<'v>(value: &'v Value, modules: &[&str], name: &str) -> Option<&'v Value> {
    object_state_or_none(value, modules, name).flatten()
}

/// `Some(state)` if `value` is an object of class `name` from one of `modules`.
fn object_state_or_none<'v>(
    value: &'v Value,
    modules: &[&str],
    name: &str,
) -> Option<Option<&'v Value>> {
    match value.class() {
        Some((m, n)) if n == name && modules.contains(&m) => Some(value.state()),
        _ => None,
    }
}

/// A `torch.Size` (or, leniently, a plain tuple or list) of non-negative ints.
fn torch_size_of(value: &Value) -> Option<Vec<u64>> {
    let dims = match value.class() {
        Some(("torch", "Size")) => match value.args()? {
            [dims] => dims.as_seq()?,
            [] => &[],
            _ => return None,
        },
        _ => value.as_seq()?,
    };
    dims.iter()
        .map(|d| d.as_int().and_then(|i| u64::try_from(i).ok()))
        .collect()
}

/// A short description of a value for error messages: its class, or its kind.
fn describe(value: &Value) -> String {
    if let Some((m, n)) = value.class().or_else(|| value.as_global()) {
        return format!("`{m}.{n}`");
    }
    let kind = match value {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) => "a string",
        Value::Bytes(_) => "bytes",
        Value::Tuple(_) => "a tuple",
        Value::List(_) => "a list",
        Value::Dict(_) => "a dict",
        Value::Set(_) => "a set",
        Value::Global { .. } | Value::Object { .. } => "an object",
        Value::PersistentId(_) => "a persistent id",
    };
    kind.to_string()
}

fn describe_opt(value: Option<&Value>) -> String {
    value.map_or_else(|| "missing".to_string(), describe)
}

fn int(v: u64) -> Value {
    Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
}

fn field(name: &str, value: Value) -> (Value, Value) {
    (Value::Str(name.to_string()), value)
}

/// A dataclass as pickle writes it: `cls.__new__(cls)` then `BUILD` with its state, if any.
fn new_obj(module: &str, name: &str, state: Option<Value>) -> Value {
    Value::Object {
        callable: Box::new(Value::global(module, name)),
        args: Vec::new(),
        new_obj: true,
        dict_items: Vec::new(),
        list_items: Vec::new(),
        state: state.map(Box::new),
    }
}

/// `callable(*args)`, as `REDUCE` writes it.
fn reduce(module: &str, name: &str, args: Vec<Value>) -> Value {
    Value::Object {
        callable: Box::new(Value::global(module, name)),
        args,
        new_obj: false,
        dict_items: Vec::new(),
        list_items: Vec::new(),
        state: None,
    }
}

fn torch_size(dims: &[u64]) -> Value {
    reduce(
        "torch",
        "Size",
        vec![Value::Tuple(dims.iter().map(|&d| int(d)).collect())],
    )
}

fn tensor_storage_metadata(dtype: DType, size: &[u64], chunks: &[Chunk]) -> Value {
    let strides = contiguous_strides(chunks.first().map_or(size, |c| &c.sizes));
    let properties = Value::Tuple(vec![
        Value::global("torch", dtype.torch_name()),
        reduce(
            "torch.serialization",
            "_get_layout",
            vec![Value::Str("torch.strided".into())],
        ),
        Value::Bool(false),
        // `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`
        reduce(META, "_MEM_FORMAT_ENCODING", vec![Value::Int(0)]),
        Value::Bool(false),
        Value::Tuple(strides.into_iter().map(int).collect()),
    ]);
    let chunks = chunks
        .iter()
        .map(|c| {
            let state = Value::Dict(vec![
                field("offsets", torch_size(&c.offsets)),
                field("sizes", torch_size(&c.sizes)),
            ]);
            new_obj(META, "ChunkStorageMetadata", Some(state))
        })
        .collect();
    let state = Value::Dict(vec![
        field(
            "properties",
            new_obj(META, "TensorProperties", Some(properties)),
        ),
        field("size", torch_size(size)),
        field("chunks", Value::List(chunks)),
    ]);
    new_obj(META, "TensorStorageMetadata", Some(state))
}
