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

use std::collections::HashMap;
use std::ops::ControlFlow;

use crate::bail_invalid;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::{contiguous_strides, numel, KeyPart};
use crate::pickle::{self, Globals, Kind, Limits, PickleError, Protocol, Stream, Value, View};

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

/// Parse `.metadata` bytes. Never executes anything; unknown globals are errors naming them.
pub fn parse(bytes: &[u8]) -> Result<DcpMetadata> {
    let mut collected = Collect::default();
    let rest = parse_into(bytes, &mut collected, &NoExtension)?;
    Ok(DcpMetadata {
        entries: collected.entries,
        storage: dedup_storage(collected.storage),
        planner_data: rest.planner_data,
        version: rest.version,
    })
}

/// Where [`parse_into`] puts the `state_dict_metadata` entries and `storage_data` records, one at a
/// time in pickled order, so a reader can keep what it needs of millions of them in its own form.
///
/// As in the Python dicts they were pickled from, a later entry with the same fqn replaces an
/// earlier one, and a later record with the same `MetadataIndex` (fqn and offsets) does too.
pub trait Sink {
    fn entry(&mut self, entry: DcpEntry) -> Result<()>;
    fn storage(&mut self, index: MetadataIndex, info: StorageInfo) -> Result<()>;
}

/// What [`parse_into`] returns besides what it gave its [`Sink`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rest {
    /// `planner_data`: fqn -> nesting path in the original state dict.
    pub planner_data: Vec<(String, Vec<KeyPart>)>,
    /// `version`, e.g. "1.0.0".
    pub version: Option<String>,
    /// The fields [`Extension::fields`] asked for that the `Metadata` has, as data.
    pub fields: Vec<(String, Value)>,
}

/// Parse `.metadata` bytes, handing entries and storage records to `sink` as they are read.
///
/// The typed structs are read straight out of the pickle's graph (see [`pickle::View`]), and the
/// two big dicts are taken from it batch by batch (see [`pickle::Consumer`]), so no owned copy of
/// the whole pickle is ever built.
pub fn parse_into(bytes: &[u8], sink: &mut dyn Sink, extension: &dyn Extension) -> Result<Rest> {
    let mut taken = Taken {
        sink,
        extension,
        lists: HashMap::new(),
        error: None,
    };
    let globals = DcpGlobals { extension };
    let graph = pickle::parse_consuming(bytes, &globals, limits_for(bytes.len()), &mut taken)
        .map_err(|e| match (e, taken.error.take()) {
            (PickleError::Stopped { offset }, Some(err)) => Error {
                offset: err.offset.or(Some(offset as u64)),
                ..err
            },
            (e, _) => pickle_error(e),
        })?;
    let root = graph.root();
    let state = metadata_state(root, extension).ok_or_else(|| {
        Error::invalid(format!(
            "the pickle holds {}, not a DCP `Metadata`",
            describe(root)
        ))
    })?;

    let sdm = state
        .get("state_dict_metadata")
        .ok_or_else(|| Error::invalid("`Metadata` has no `state_dict_metadata`"))?;
    let sdm =
        dict_items(sdm).ok_or_else(|| Error::invalid("`state_dict_metadata` is not a dict"))?;
    // Items that were not consumed while reading (a last batch of one, written as `SETITEM`) come
    // after the consumed ones, as they did in the file.
    for (k, v) in sdm {
        taken.sink.entry(entry(k, v, &mut taken.lists)?)?;
    }
    if let Some(v) = state.get("storage_data").filter(|v| !v.is_none()) {
        let items = dict_items(v).ok_or_else(|| Error::invalid("`storage_data` is not a dict"))?;
        for (k, v) in items {
            taken
                .sink
                .storage(metadata_index(k)?, storage_info(k, v)?)?;
        }
    }

    let planner_data = match state.get("planner_data").filter(|v| !v.is_none()) {
        None => Vec::new(),
        Some(v) => {
            let items =
                dict_items(v).ok_or_else(|| Error::invalid("`planner_data` is not a dict"))?;
            items
                .into_iter()
                .map(|(k, v)| planner_entry(k, v))
                .collect::<Result<Vec<_>>>()?
        }
    };

    let version = match state.get("version").filter(|v| !v.is_none()) {
        None => None,
        Some(v) => match v.as_str() {
            Some(text) => Some(text.to_string()),
            None => bail_invalid!("`Metadata.version` is {}, not a string", describe(v)),
        },
    };

    let fields = extension
        .fields()
        .iter()
        .filter_map(|&name| {
            let value = state.get(name).filter(|v| !v.is_none())?;
            Some((name.to_string(), value.to_value()))
        })
        .collect();

    Ok(Rest {
        planner_data,
        version,
        fields,
    })
}

/// The state of the pickle's root: DCP's `Metadata`, or a derived format's subclass of it.
fn metadata_state<'g>(root: View<'g>, extension: &dyn Extension) -> Option<View<'g>> {
    match root.class() {
        Some((m, "Metadata")) if m == META || m == OLD_META => root.state(),
        Some((m, n)) if extension.is_metadata(m, n) => root.state(),
        _ => None,
    }
}

/// What the `.metadata` writer needs, item by item: an owned [`DcpMetadata`], or a plan that
/// derives millions of chunks from mesh geometry as they are written, so they are never all in
/// memory. The writer walks each sequence twice (to find repeated strings, then to write), so each
/// call must give the same items.
pub trait Describe<'m> {
    /// `state_dict_metadata`, in pickled order.
    fn entries(&self) -> Box<dyn Iterator<Item = EntryRef<'m, '_>> + '_>;
    /// `planner_data`: fqn and nesting path.
    fn planner_data(&self) -> Box<dyn Iterator<Item = (&'m str, &'m [KeyPart])> + '_>;
    /// `storage_data`, in pickled order.
    fn storage(&self) -> Box<dyn Iterator<Item = StorageRef<'m>> + '_>;
    /// `version`, e.g. "1.0.0".
    fn version(&self) -> Option<&'m str>;
}

/// One entry of `state_dict_metadata`, as [`Describe`] gives it.
pub enum EntryRef<'m, 'i> {
    Tensor {
        fqn: &'m str,
        dtype: DType,
        size: &'m [u64],
        chunks: Box<dyn Iterator<Item = Chunk> + 'i>,
    },
    Bytes {
        fqn: &'m str,
    },
}

/// One `MetadataIndex -> _StorageInfo` pair of `storage_data`, as [`Describe`] gives it.
pub struct StorageRef<'m> {
    pub fqn: &'m str,
    /// The chunk's offsets for a tensor, `None` for bytes.
    pub chunk_offsets: Option<Vec<u64>>,
    pub index: Option<i64>,
    pub relative_path: &'m str,
    pub offset: u64,
    pub length: u64,
    pub transforms: &'m [String],
}

impl<'m> Describe<'m> for &'m DcpMetadata {
    fn entries(&self) -> Box<dyn Iterator<Item = EntryRef<'m, '_>> + '_> {
        // Entries of an unsupported dtype are not written: ckpt cannot name them back.
        Box::new(self.entries.iter().filter_map(|e| match e {
            DcpEntry::Tensor {
                fqn,
                dtype,
                size,
                chunks,
            } => Some(EntryRef::Tensor {
                fqn,
                dtype: *dtype,
                size,
                chunks: Box::new(chunks.iter().cloned()),
            }),
            DcpEntry::Bytes { fqn } => Some(EntryRef::Bytes { fqn }),
            DcpEntry::Unsupported { .. } => None,
        }))
    }

    fn planner_data(&self) -> Box<dyn Iterator<Item = (&'m str, &'m [KeyPart])> + '_> {
        Box::new(
            self.planner_data
                .iter()
                .map(|(fqn, path)| (fqn.as_str(), path.as_slice())),
        )
    }

    fn storage(&self) -> Box<dyn Iterator<Item = StorageRef<'m>> + '_> {
        Box::new(self.storage.iter().map(|(index, info)| StorageRef {
            fqn: &index.fqn,
            chunk_offsets: index.offset.clone(),
            index: index.index,
            relative_path: &info.relative_path,
            offset: info.offset,
            length: info.length,
            transforms: &info.transforms,
        }))
    }

    fn version(&self) -> Option<&'m str> {
        self.version.as_deref()
    }
}

/// Serialize metadata as PyTorch writes it (pickle protocol 4 of the real classes).
///
/// Mirrors torch 2.15's `FileSystemWriter`: the same classes, field order and state shapes. Fields
/// ckpt does not model are written as torch would for a fresh contiguous tensor: `strides` are the
/// row-major strides of the first chunk (torch records the saving rank's local shard), and
/// `storage_meta` is a `StorageMeta` with no ids or path. Sizes above `i64::MAX`, which no torch
/// tensor can have, are written as `i64::MAX`.
pub fn write(meta: &DcpMetadata) -> Vec<u8> {
    pickle::write_with(Protocol::V4, |w| metadata(w, &meta))
}

/// [`write`] of what `meta` describes, streamed to `sink`; returns the length written.
pub fn write_to<'m, W: std::io::Write + std::io::Seek>(
    sink: &mut W,
    meta: &impl Describe<'m>,
) -> std::io::Result<u64> {
    pickle::write_to(sink, Protocol::V4, |w| metadata(w, meta))
}

/// `Metadata(state_dict_metadata, planner_data, storage_data, storage_meta, version)`.
fn metadata<'m, 's>(w: &mut Stream<'m, 's>, meta: &impl Describe<'m>) {
    dataclass(w, META, "Metadata", |w| {
        w.fields(|w| {
            w.str("state_dict_metadata");
            w.dict(meta.entries(), |w, entry| match entry {
                EntryRef::Tensor {
                    fqn,
                    dtype,
                    size,
                    chunks,
                } => {
                    w.str(fqn);
                    tensor_storage_metadata(w, dtype, size, chunks);
                }
                EntryRef::Bytes { fqn } => {
                    w.str(fqn);
                    new_obj(w, META, "BytesStorageMetadata");
                }
            });
            w.str("planner_data");
            w.dict(meta.planner_data(), |w, (fqn, path)| {
                w.str(fqn);
                w.tuple(path.len(), |w| {
                    for part in path {
                        match part {
                            KeyPart::Key(k) => w.str(k),
                            KeyPart::Index(i) | KeyPart::IntKey(i) => w.int(*i),
                        }
                    }
                });
            });
            w.str("storage_data");
            w.dict(meta.storage(), |w, entry| {
                write_metadata_index(w, &entry);
                write_storage_info(w, &entry);
            });
            w.str("storage_meta");
            dataclass(w, META, "StorageMeta", |w| {
                w.fields(|w| {
                    for name in ["checkpoint_id", "save_id", "load_id"] {
                        w.str(name);
                        w.none();
                    }
                    w.str("modules");
                    w.list(std::iter::empty::<()>(), |_, _| {});
                });
            });
            w.str("version");
            match meta.version() {
                Some(v) => w.str(v),
                None => w.none(),
            }
        });
    });
}

/// Where DCP defines its classes now, and where torch 1.13 defined them (`torch.distributed._shard`
/// re-exports the new module under the old name, so such files still load in torch).
const META: &str = "torch.distributed.checkpoint.metadata";
const OLD_META: &str = "torch.distributed._shard.checkpoint.metadata";
/// `TensorProperties` and its memory-format enum lived here until DCP got its own copy (torch 2.2).
const SHARDED_TENSOR_META: &str = "torch.distributed._shard.sharded_tensor.metadata";
const FS: &str = "torch.distributed.checkpoint.filesystem";
/// `SavePlan` and its parts: Megatron-core stores every rank's plan in `Metadata.all_local_plans`.
const PLANNER: &str = "torch.distributed.checkpoint.planner";
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

/// The [`Sink`] of [`parse`]: everything, as a [`DcpMetadata`] holds it.
#[derive(Default)]
struct Collect {
    entries: Vec<DcpEntry>,
    /// Position in `entries` of each fqn: a repeated key keeps its first place and last value,
    /// as a Python dict does.
    positions: std::collections::HashMap<String, usize>,
    /// Deduplicated at the end ([`dedup_storage`]).
    storage: Vec<(MetadataIndex, StorageInfo)>,
}

impl Sink for Collect {
    fn entry(&mut self, e: DcpEntry) -> Result<()> {
        match self.positions.get(e.fqn()) {
            Some(&i) => self.entries[i] = e,
            None => {
                self.positions
                    .insert(e.fqn().to_string(), self.entries.len());
                self.entries.push(e);
            }
        }
        Ok(())
    }

    fn storage(&mut self, index: MetadataIndex, info: StorageInfo) -> Result<()> {
        self.storage.push((index, info));
        Ok(())
    }
}

impl DcpEntry {
    pub fn fqn(&self) -> &str {
        match self {
            DcpEntry::Tensor { fqn, .. }
            | DcpEntry::Bytes { fqn }
            | DcpEntry::Unsupported { fqn, .. } => fqn,
        }
    }
}

/// What [`parse_into`] takes from `state_dict_metadata` and `storage_data` as the pickle is read,
/// handed to the sink, so that their millions of objects never stand in the graph at once (see
/// [`pickle::Consumer`]).
struct Taken<'s> {
    sink: &'s mut dyn Sink,
    extension: &'s dyn Extension,
    /// The chunks taken from each `chunks` list of a tensor entry, by the list's node id, until
    /// the entry is read.
    lists: HashMap<u32, Vec<Chunk>>,
    error: Option<Error>,
}

impl Taken<'_> {
    fn stop(&mut self, result: Result<()>) -> ControlFlow<()> {
        match result {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                self.error = Some(e);
                ControlFlow::Break(())
            }
        }
    }
}

impl pickle::Consumer for Taken<'_> {
    fn claims(&mut self, owner: View<'_>, key: &str) -> bool {
        let is_metadata = match owner.class() {
            Some((m, "Metadata")) => m == META || m == OLD_META,
            Some((m, n)) => self.extension.is_metadata(m, n),
            _ => false,
        };
        is_metadata && (key == "state_dict_metadata" || key == "storage_data")
    }

    fn consume(&mut self, key: &str, pairs: &[(View<'_>, View<'_>)]) -> ControlFlow<()> {
        let result = (|| -> Result<()> {
            for &(k, v) in pairs {
                if key == "state_dict_metadata" {
                    self.sink.entry(entry(k, v, &mut self.lists)?)?;
                } else {
                    self.sink.storage(metadata_index(k)?, storage_info(k, v)?)?;
                }
            }
            Ok(())
        })();
        if key == "state_dict_metadata" {
            // Lists of entries this batch did not hold are not any later entry's either: the
            // ids of their nodes are given to new nodes from here on.
            self.lists.clear();
        }
        self.stop(result)
    }

    fn claims_list(&mut self, owner: View<'_>, key: &str) -> bool {
        let is_tensor = matches!(
            owner.class(),
            Some((m, "TensorStorageMetadata")) if m == META || m == OLD_META
        );
        is_tensor && key == "chunks"
    }

    fn consume_list(&mut self, list: View<'_>, items: &[View<'_>]) -> ControlFlow<()> {
        let chunks = self.lists.entry(list.id()).or_default();
        let result = items.iter().try_for_each(|&c| {
            chunks.push(raw_chunk(c)?);
            Ok(())
        });
        self.stop(result)
    }
}

/// Bounds that scale with the file, so that any `.metadata` torch reads is read, at any piece
/// count: a real one memoizes about one object per byte it spends and copies little, so a pickle
/// that expands far past its own size is abuse, not a checkpoint. The stack allows one value per 4
/// bytes of input (so it never takes more memory than the file's size), which also reads files
/// whose writer did not batch `SETITEMS` (ckpt before it batched as CPython does).
fn limits_for(len: usize) -> Limits {
    let default = Limits::default();
    Limits {
        max_stack: default.max_stack.max(len / 4),
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

/// One `state_dict_metadata` item; `lists` holds the chunks already taken from tensor entries.
fn entry(key: View<'_>, value: View<'_>, lists: &mut HashMap<u32, Vec<Chunk>>) -> Result<DcpEntry> {
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
    tensor(&fqn, state, lists).map_err(|e| e.tensor(&fqn))
}

fn tensor(fqn: &str, state: View<'_>, lists: &mut HashMap<u32, Vec<Chunk>>) -> Result<DcpEntry> {
    let properties = state
        .get("properties")
        .ok_or_else(|| Error::invalid("`properties` is missing"))?;
    let dtype = match tensor_dtype(properties)? {
        Ok(dtype) => dtype,
        Err(dtype) => {
            let fqn = fqn.to_string();
            return Ok(DcpEntry::Unsupported { fqn, dtype });
        }
    };
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
    let list = state
        .get("chunks")
        .ok_or_else(|| Error::invalid("`chunks` is not a list"))?;
    let chunk_values = list
        .as_seq()
        .ok_or_else(|| Error::invalid("`chunks` is not a list"))?;
    // Chunks taken while the list was read come first, as they did in the file.
    let mut chunks = lists.remove(&list.id()).unwrap_or_default();
    for c in chunk_values {
        chunks.push(raw_chunk(c)?);
    }
    for c in &chunks {
        check_chunk(c, &size)?;
    }
    Ok(DcpEntry::Tensor {
        fqn: fqn.to_string(),
        dtype,
        size,
        chunks,
    })
}

/// The dtype out of a `TensorProperties`, after checking the layout is strided; `Err` with its
/// name (`torch.bits8`) for a torch dtype ckpt does not support.
fn tensor_dtype(properties: View<'_>) -> Result<std::result::Result<DType, String>> {
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
    // `__getstate__` gives (dtype, layout, requires_grad, memory_format, pin_memory[, strides]),
    // and `__setstate__` unpacks any state that way: a dict (a `__dict__`) unpacks into its keys,
    // so torch refuses it, and a list is read like the tuple.
    let (dtype, layout) = match state.kind() {
        Kind::Tuple | Kind::List => {
            let items: Vec<View<'_>> = state.as_seq().into_iter().flatten().collect();
            if items.len() != 5 && items.len() != 6 {
                bail_invalid!(
                    "`TensorProperties` state is {}, not a 5- or 6-tuple",
                    describe(state)
                );
            }
            if let Some(&encoding) = items.get(3) {
                check_memory_format(encoding)?;
            }
            (items.first().copied(), items.get(1).copied())
        }
        _ => bail_invalid!(
            "`TensorProperties` state is {}, not a 5- or 6-tuple (torch's `__setstate__` unpacks it as one)",
            describe(state)
        ),
    };
    let dtype = match dtype.and_then(|d| d.as_global()) {
        Some(("torch", name)) => {
            DType::from_torch_name(name).ok_or_else(|| format!("torch.{name}"))
        }
        _ => bail_invalid!(
            "`TensorProperties.dtype` is {}, not a torch dtype",
            describe_opt(dtype)
        ),
    };
    // A missing layout takes the dataclass default, `torch.strided`.
    if let Some(l) = layout {
        let name = match (l.class(), l.args().map(|a| a.collect::<Vec<_>>())) {
            (Some(("torch.serialization", "_get_layout")), Some(args)) => match args.as_slice() {
                [name] => name.as_str(),
                _ => None,
            },
            _ => None,
        };
        match name {
            Some("torch.strided") => {}
            Some(name) => {
                bail_invalid!("layout `{name}` is not supported by ckpt (only `torch.strided`)")
            }
            None => bail_invalid!(
                "`TensorProperties.layout` is {}, not a torch layout",
                describe(l)
            ),
        }
    }
    Ok(dtype)
}

/// The memory format of a `TensorProperties` state: torch builds `_MEM_FORMAT_ENCODING(value)` and
/// `__setstate__` maps it to a memory format, so anything but the enum with one of its three
/// values (0, 1, 2, compared as Python does: `False`, `2.0` and a member itself are fine) is
/// refused when torch loads. Which module's enum names it is not checked.
fn check_memory_format(encoding: View<'_>) -> Result<()> {
    let mut value = encoding;
    // `_MEM_FORMAT_ENCODING(_MEM_FORMAT_ENCODING(0))` is the member itself.
    loop {
        let enum_arg = match (value.class(), value.args().map(|a| a.collect::<Vec<_>>())) {
            (
                Some((META | OLD_META, "_MEM_FORMAT_ENCODING"))
                | Some((SHARDED_TENSOR_META, "MEM_FORMAT_ENCODING")),
                Some(args),
            ) => match args.as_slice() {
                [arg] => Some(*arg),
                _ => None,
            },
            _ => None,
        };
        let Some(arg) = enum_arg else { break };
        let member = match arg.kind() {
            Kind::Object => {
                value = arg;
                continue;
            }
            Kind::Int | Kind::Bool => arg.as_int().is_some_and(|i| (0..=2).contains(&i)),
            Kind::Float => {
                matches!(arg.to_value(), pickle::Value::Float(f) if f == 0.0 || f == 1.0 || f == 2.0)
            }
            _ => false,
        };
        if member {
            return Ok(());
        }
        let shown = match arg.as_int() {
            Some(i) => i.to_string(),
            None => describe(arg),
        };
        bail_invalid!(
            "`TensorProperties` memory format encoding is {shown}, not 0, 1 or 2 (torch refuses it when it loads)"
        );
    }
    bail_invalid!(
        "`TensorProperties` memory format is {}, not a `_MEM_FORMAT_ENCODING` (torch refuses it when it loads)",
        describe(value)
    )
}

/// A `ChunkStorageMetadata`, not yet checked against its tensor's size ([`check_chunk`]).
fn raw_chunk(value: View<'_>) -> Result<Chunk> {
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
    Ok(Chunk { offsets, sizes })
}

/// A chunk must lie inside its tensor.
fn check_chunk(chunk: &Chunk, size: &[u64]) -> Result<()> {
    let Chunk { offsets, sizes } = chunk;
    let fits = offsets.len() == size.len()
        && sizes.len() == size.len()
        && offsets
            .iter()
            .zip(sizes)
            .zip(size)
            .all(|((&o, &s), &d)| o.checked_add(s).is_some_and(|end| end <= d));
    if !fits {
        bail_invalid!(
            "chunk at offsets {offsets:?} with sizes {sizes:?} does not fit in size {size:?}"
        );
    }
    Ok(())
}

fn metadata_index(value: View<'_>) -> Result<MetadataIndex> {
    let state = object_state(value, &[META, OLD_META], "MetadataIndex").ok_or_else(|| {
        Error::invalid(format!(
            "a `storage_data` key is {}, not `MetadataIndex`",
            describe(value)
        ))
    })?;
    let fqn = match state.get("fqn").and_then(|f| f.as_str()) {
        Some(s) => s.to_string(),
        None => bail_invalid!(
            "`MetadataIndex.fqn` is {}, not a string",
            describe_opt(state.get("fqn"))
        ),
    };
    let offset = match state.get("offset").filter(|v| !v.is_none()) {
        None => None,
        Some(v) => Some(torch_size_of(v).ok_or_else(|| {
            Error::invalid(format!(
                "`MetadataIndex.offset` of `{fqn}` is not a `torch.Size`"
            ))
        })?),
    };
    let index = match state.get("index").filter(|v| !v.is_none()) {
        None => None,
        Some(v) if v.kind() == Kind::Int => v.as_int(),
        Some(other) => bail_invalid!(
            "`MetadataIndex.index` of `{fqn}` is {}, not an int",
            describe(other)
        ),
    };
    Ok(MetadataIndex { fqn, offset, index })
}

fn storage_info(key: View<'_>, value: View<'_>) -> Result<StorageInfo> {
    let fqn = key
        .state()
        .and_then(|s| s.get("fqn"))
        .and_then(|f| f.as_str())
        .unwrap_or("?");
    let state = object_state(value, &[FS, OLD_FS], "_StorageInfo").ok_or_else(|| {
        Error::invalid(format!(
            "storage of `{fqn}` is {}, not `_StorageInfo`",
            describe(value)
        ))
    })?;
    let path = state.get("relative_path");
    let relative_path = match path.and_then(|p| p.as_str()) {
        Some(p) if is_plain_relative(p) => p.to_string(),
        Some(p) => {
            bail_invalid!("storage of `{fqn}` points at `{p}`, outside the checkpoint directory")
        }
        None => bail_invalid!(
            "`relative_path` of `{fqn}` is {}, not a string",
            describe_opt(path)
        ),
    };
    let number = |name: &str| -> Result<u64> {
        state
            .get(name)
            .and_then(|n| n.as_int())
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
    let transforms = match state.get("transform_descriptors").filter(|v| !v.is_none()) {
        None => Vec::new(),
        Some(v) => v
            .as_seq()
            .and_then(|mut items| {
                items.try_fold(Vec::new(), |mut out, t| {
                    out.push(t.as_str()?.to_string());
                    Some(out)
                })
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

fn planner_entry(key: View<'_>, value: View<'_>) -> Result<(String, Vec<KeyPart>)> {
    let fqn = key.as_str().ok_or_else(|| {
        Error::invalid(format!(
            "a `planner_data` key is {}, not a string",
            describe(key)
        ))
    })?;
    let parts = value.as_seq().and_then(|mut items| {
        items.try_fold(Vec::new(), |mut out, p| {
            out.push(match p.kind() {
                Kind::Str => KeyPart::Key(p.as_str()?.to_string()),
                Kind::Int => KeyPart::Index(p.as_int()?),
                _ => return None,
            });
            Some(out)
        })
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
///
/// Done in place through a sorted list of positions, so a million entries cost 8 MB of positions
/// for a moment rather than a map holding a copy of every key.
fn dedup_storage(
    mut pairs: Vec<(MetadataIndex, StorageInfo)>,
) -> Vec<(MetadataIndex, StorageInfo)> {
    let key = |i: usize| {
        pairs
            .get(i)
            .map(|(k, _)| (k.fqn.as_str(), k.offset.as_deref()))
    };
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    // Equal keys end up together, in pickled order.
    order.sort_unstable_by(|&a, &b| key(a).cmp(&key(b)).then(a.cmp(&b)));
    // (first position, last position) of every key pickled more than once.
    let mut repeated: Vec<(usize, usize)> = Vec::new();
    let mut dropped = vec![false; pairs.len()];
    for group in order.chunk_by(|&a, &b| key(a) == key(b)) {
        if let ([first, .., last], rest) = (group, group.get(1..).unwrap_or_default()) {
            repeated.push((*first, *last));
            for &i in rest {
                if let Some(d) = dropped.get_mut(i) {
                    *d = true;
                }
            }
        }
    }
    drop(order);
    for (first, last) in repeated {
        let info = pairs.get(last).map(|(_, info)| info.clone());
        if let (Some(info), Some(slot)) = (info, pairs.get_mut(first)) {
            slot.1 = info;
        }
    }
    let mut dropped = dropped.into_iter();
    pairs.retain(|_| !dropped.next().unwrap_or(false));
    pairs
}

/// Items of a dict or an `OrderedDict`.
fn dict_items(value: View<'_>) -> Option<Vec<(View<'_>, View<'_>)>> {
    match value.class() {
        Some(("collections", "OrderedDict")) => value.object_dict_items(),
        _ => value.dict_items(),
    }
}

/// The state of an object of class `name` from one of `modules`, which must have one.
fn object_state<'g>(value: View<'g>, modules: &[&str], name: &str) -> Option<View<'g>> {
    object_state_or_none(value, modules, name).flatten()
}

/// `Some(state)` if `value` is an object of class `name` from one of `modules`.
fn object_state_or_none<'g>(
    value: View<'g>,
    modules: &[&str],
    name: &str,
) -> Option<Option<View<'g>>> {
    match value.class() {
        Some((m, n)) if n == name && modules.contains(&m) => Some(value.state()),
        _ => None,
    }
}

/// A `torch.Size` (or, leniently, a plain tuple or list) of non-negative ints.
fn torch_size_of(value: View<'_>) -> Option<Vec<u64>> {
    let dims = match value.class() {
        Some(("torch", "Size")) => {
            let mut args = value.args()?;
            match (args.next(), args.next()) {
                (Some(dims), None) => dims.as_seq()?,
                (None, _) => return Some(Vec::new()),
                _ => return None,
            }
        }
        _ => value.as_seq()?,
    };
    dims.map(|d| d.as_int().and_then(|i| u64::try_from(i).ok()))
        .collect()
}

/// A short description of a value for error messages: its class, or its kind.
fn describe(value: View<'_>) -> String {
    if let Some((m, n)) = value.class().or_else(|| value.as_global()) {
        return format!("`{m}.{n}`");
    }
    let kind = match value.kind() {
        Kind::None => "None",
        Kind::Bool => "a bool",
        Kind::Int | Kind::BigInt => "an int",
        Kind::Float => "a float",
        Kind::Str => "a string",
        Kind::Bytes => "bytes",
        Kind::Tuple => "a tuple",
        Kind::List => "a list",
        Kind::Dict => "a dict",
        Kind::Set => "a set",
        Kind::Global | Kind::Object => "an object",
        Kind::PersistentId => "a persistent id",
    };
    kind.to_string()
}

fn describe_opt(value: Option<View<'_>>) -> String {
    value.map_or_else(|| "missing".to_string(), describe)
}

fn int(w: &mut Stream<'_, '_>, v: u64) {
    w.int(i64::try_from(v).unwrap_or(i64::MAX));
}

/// A dataclass with no state as pickle writes it: `cls.__new__(cls)`.
fn new_obj<'m, 's>(w: &mut Stream<'m, 's>, module: &'m str, name: &'m str) {
    w.global(module, name);
    w.tuple(0, |_| {});
    w.call(true);
}

/// A dataclass as pickle writes it: `cls.__new__(cls)`, then `BUILD` with the state `state` writes.
fn dataclass<'m, 's>(
    w: &mut Stream<'m, 's>,
    module: &'m str,
    name: &'m str,
    state: impl FnOnce(&mut Stream<'m, 's>),
) {
    new_obj(w, module, name);
    w.build(state);
}

fn torch_size(w: &mut Stream<'_, '_>, dims: &[u64]) {
    w.global("torch", "Size");
    w.tuple(1, |w| {
        w.tuple(dims.len(), |w| dims.iter().for_each(|&d| int(w, d)))
    });
    w.call(false);
}

fn tensor_storage_metadata(
    w: &mut Stream<'_, '_>,
    dtype: DType,
    size: &[u64],
    chunks: impl Iterator<Item = Chunk>,
) {
    let mut chunks = chunks.peekable();
    let strides = contiguous_strides(chunks.peek().map_or(size, |c| &c.sizes));
    dataclass(w, META, "TensorStorageMetadata", |w| {
        w.fields(|w| {
            w.str("properties");
            dataclass(w, META, "TensorProperties", |w| {
                w.tuple(6, |w| {
                    w.global("torch", dtype.torch_name());
                    w.global("torch.serialization", "_get_layout");
                    w.tuple(1, |w| w.str("torch.strided"));
                    w.call(false);
                    w.bool(false);
                    // `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`
                    w.global(META, "_MEM_FORMAT_ENCODING");
                    w.tuple(1, |w| w.int(0));
                    w.call(false);
                    w.bool(false);
                    w.tuple(strides.len(), |w| strides.iter().for_each(|&s| int(w, s)));
                });
            });
            w.str("size");
            torch_size(w, size);
            w.str("chunks");
            w.list(chunks, |w, c| {
                dataclass(w, META, "ChunkStorageMetadata", |w| {
                    w.fields(|w| {
                        w.str("offsets");
                        torch_size(w, &c.offsets);
                        w.str("sizes");
                        torch_size(w, &c.sizes);
                    });
                });
            });
        });
    });
}

/// `MetadataIndex`'s state: `fqn`, `index`, and `offset` for tensors.
fn write_metadata_index<'m, 's>(w: &mut Stream<'m, 's>, entry: &StorageRef<'m>) {
    dataclass(w, META, "MetadataIndex", |w| {
        w.fields(|w| {
            w.str("fqn");
            w.str(entry.fqn);
            w.str("index");
            match entry.index {
                Some(i) => w.int(i),
                None => w.none(),
            }
            if let Some(offset) = &entry.chunk_offsets {
                w.str("offset");
                torch_size(w, offset);
            }
        });
    });
}

fn write_storage_info<'m, 's>(w: &mut Stream<'m, 's>, entry: &StorageRef<'m>) {
    dataclass(w, FS, "_StorageInfo", |w| {
        // torch leaves `transform_descriptors` out when there are none.
        let transforms = entry.transforms;
        w.fields(|w| {
            w.str("relative_path");
            w.str(entry.relative_path);
            w.str("offset");
            int(w, entry.offset);
            w.str("length");
            int(w, entry.length);
            if !transforms.is_empty() {
                w.str("transform_descriptors");
                w.list(transforms, |w, t| w.str(t));
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::{Object, Value};
    use proptest::prelude::*;

    /// The writer before [`write`] streamed: the whole `Metadata` as a [`Value`] tree, then
    /// serialized. Kept to check the streamed bytes against.
    fn write_tree(meta: &DcpMetadata) -> Vec<u8> {
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
            DcpEntry::Unsupported { .. } => unreachable!("no fixture holds one"),
        });
        let planner_data = meta.planner_data.iter().map(|(fqn, path)| {
            let parts = path
                .iter()
                .map(|p| match p {
                    KeyPart::Key(k) => Value::Str(k.clone()),
                    KeyPart::Index(i) | KeyPart::IntKey(i) => Value::Int(*i),
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

    fn int(v: u64) -> Value {
        Value::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }

    fn field(name: &str, value: Value) -> (Value, Value) {
        (Value::Str(name.to_string()), value)
    }

    /// A dataclass as pickle writes it: `cls.__new__(cls)` then `BUILD` with its state, if any.
    fn new_obj(module: &str, name: &str, state: Option<Value>) -> Value {
        Value::Object(Box::new(Object {
            callable: Value::global(module, name),
            args: Vec::new(),
            new_obj: true,
            dict_items: Vec::new(),
            list_items: Vec::new(),
            state,
        }))
    }

    fn torch_size(dims: &[u64]) -> Value {
        Value::reduce(
            "torch",
            "Size",
            vec![Value::Tuple(dims.iter().map(|&d| int(d)).collect())],
        )
    }

    fn tensor_storage_metadata(dtype: DType, size: &[u64], chunks: &[Chunk]) -> Value {
        let strides = contiguous_strides(chunks.first().map_or(size, |c| &c.sizes));
        let properties = Value::Tuple(vec![
            Value::global("torch", dtype.torch_name()),
            Value::reduce(
                "torch.serialization",
                "_get_layout",
                vec![Value::Str("torch.strided".into())],
            ),
            Value::Bool(false),
            // `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT`
            Value::reduce(META, "_MEM_FORMAT_ENCODING", vec![Value::Int(0)]),
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

    // Real files written by torch 2.15 (see `testdata/make_fixtures.py`).
    /// One process: every dtype ckpt knows, a 0-dim, an empty and a transposed tensor, a list in
    /// the state dict, and non-tensor values.
    const SINGLE: &[u8] = include_bytes!("testdata/single.metadata");
    /// Four ranks (gloo) saving DTensors: `Shard(0)`, `Shard(1)`, a 2x2 mesh, a replicated one.
    const SHARDED4: &[u8] = include_bytes!("testdata/sharded4.metadata");
    /// Items compressed by the `ZStandard` extension.
    const ZSTD: &[u8] = include_bytes!("testdata/zstd.metadata");
    /// A fresh save re-pickled with the class paths of torch 1.13-2.1 and 5-tuple properties.
    const LEGACY: &[u8] = include_bytes!("testdata/legacy.metadata");

    fn key(parts: &[&str]) -> Vec<KeyPart> {
        parts
            .iter()
            .map(|p| match p.parse::<i64>() {
                Ok(i) => KeyPart::Index(i),
                Err(_) => KeyPart::Key(p.to_string()),
            })
            .collect()
    }

    fn tensor<'m>(meta: &'m DcpMetadata, name: &str) -> (&'m DType, &'m [u64], &'m [Chunk]) {
        meta.entries
            .iter()
            .find_map(|e| match e {
                DcpEntry::Tensor {
                    fqn,
                    dtype,
                    size,
                    chunks,
                } if fqn == name => Some((dtype, size.as_slice(), chunks.as_slice())),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no tensor {name}"))
    }

    fn chunk(offsets: &[u64], sizes: &[u64]) -> Chunk {
        Chunk {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
        }
    }

    fn storage<'m>(
        meta: &'m DcpMetadata,
        fqn: &str,
        offset: Option<&[u64]>,
    ) -> &'m (MetadataIndex, StorageInfo) {
        meta.storage
            .iter()
            .find(|(i, _)| i.fqn == fqn && i.offset.as_deref() == offset)
            .unwrap_or_else(|| panic!("no storage for {fqn} {offset:?}"))
    }

    fn info(path: &str, offset: u64, length: u64, transforms: &[&str]) -> StorageInfo {
        StorageInfo {
            relative_path: path.into(),
            offset,
            length,
            transforms: transforms.iter().map(|t| t.to_string()).collect(),
        }
    }

    #[test]
    fn single_process_save_parses_exactly() {
        let meta = parse(SINGLE).unwrap();
        let fqns: Vec<&str> = meta
            .entries
            .iter()
            .map(|e| match e {
                DcpEntry::Tensor { fqn, .. }
                | DcpEntry::Bytes { fqn }
                | DcpEntry::Unsupported { fqn, .. } => fqn.as_str(),
            })
            .collect();
        assert_eq!(
            fqns,
            [
                "model.f64",
                "model.f32",
                "model.f16",
                "model.bf16",
                "model.f8e4m3",
                "model.f8e5m2",
                "model.i64",
                "model.i32",
                "model.i16",
                "model.i8",
                "model.u64",
                "model.u32",
                "model.u16",
                "model.u8",
                "model.mask",
                "model.scalar",
                "model.empty",
                "model.layers.0",
                "model.layers.1.w",
                "model.view",
                "train_state.step",
                "train_state.name",
                "train_state.lr",
                "train_state.flags",
                "epoch",
            ]
        );
        assert!(matches!(
            &meta.entries[20..],
            [DcpEntry::Bytes { .. }, _, _, _, DcpEntry::Bytes { .. }]
        ));
        let dtypes: Vec<DType> = meta.entries[..20]
            .iter()
            .filter_map(|e| match e {
                DcpEntry::Tensor { dtype, .. } => Some(*dtype),
                _ => None,
            })
            .collect();
        use DType::*;
        assert_eq!(
            dtypes,
            [
                F64, F32, F16, BF16, F8E4M3, F8E5M2, I64, I32, I16, I8, U64, U32, U16, U8, Bool,
                F32, F32, F32, F32, F32
            ]
        );
        assert_eq!(
            tensor(&meta, "model.f64"),
            (&F64, &[2, 3][..], &[chunk(&[0, 0], &[2, 3])][..])
        );
        assert_eq!(
            tensor(&meta, "model.bf16"),
            (&BF16, &[3, 1, 2][..], &[chunk(&[0, 0, 0], &[3, 1, 2])][..])
        );
        assert_eq!(
            tensor(&meta, "model.scalar"),
            (&F32, &[][..], &[chunk(&[], &[])][..])
        );
        assert_eq!(
            tensor(&meta, "model.empty"),
            (&F32, &[0, 4][..], &[chunk(&[0, 0], &[0, 4])][..])
        );
        assert_eq!(
            tensor(&meta, "model.view"),
            (&F32, &[4, 3][..], &[chunk(&[0, 0], &[4, 3])][..])
        );

        assert_eq!(meta.storage.len(), 25);
        let first = &meta.storage[0];
        assert_eq!(
            first.0,
            MetadataIndex {
                fqn: "train_state.step".into(),
                offset: None,
                index: None
            }
        );
        assert_eq!(first.1, info("__0_0.distcp", 0, 1261, &[]));
        let (index, at) = storage(&meta, "model.f64", Some(&[0, 0]));
        assert_eq!(index.index, Some(0));
        assert_eq!(at, &info("__0_0.distcp", 6305, 1577, &[]));
        assert_eq!(
            storage(&meta, "model.scalar", Some(&[])).1,
            info("__0_0.distcp", 29960, 1577, &[])
        );
        assert_eq!(
            storage(&meta, "model.empty", Some(&[0, 0])).1,
            info("__0_0.distcp", 31537, 1513, &[])
        );
        assert_eq!(
            storage(&meta, "model.view", Some(&[0, 0])).1,
            info("__0_0.distcp", 36204, 1577, &[])
        );

        assert_eq!(meta.planner_data.len(), 25);
        let planned = |f: &str| {
            meta.planner_data
                .iter()
                .find(|(k, _)| k == f)
                .map(|(_, p)| p.clone())
        };
        assert_eq!(planned("model.f64"), Some(key(&["model", "f64"])));
        assert_eq!(
            planned("model.layers.0"),
            Some(key(&["model", "layers", "0"]))
        );
        assert_eq!(
            planned("model.layers.1.w"),
            Some(key(&["model", "layers", "1", "w"]))
        );
        assert_eq!(planned("epoch"), Some(key(&["epoch"])));
        assert_eq!(meta.version.as_deref(), Some("1.0.0"));
    }

    #[test]
    fn four_rank_dtensor_save_parses_exactly() {
        let meta = parse(SHARDED4).unwrap();
        let c = chunk;
        assert_eq!(
            tensor(&meta, "w0"),
            (
                &DType::F32,
                &[10, 3][..],
                &[
                    c(&[0, 0], &[3, 3]),
                    c(&[3, 0], &[3, 3]),
                    c(&[6, 0], &[3, 3]),
                    c(&[9, 0], &[1, 3])
                ][..]
            )
        );
        assert_eq!(
            tensor(&meta, "w1"),
            (
                &DType::BF16,
                &[3, 7][..],
                &[
                    c(&[0, 0], &[3, 2]),
                    c(&[0, 2], &[3, 2]),
                    c(&[0, 4], &[3, 2]),
                    c(&[0, 6], &[3, 1])
                ][..]
            )
        );
        // torch records rank 3's empty piece of a 2-element tensor split four ways.
        assert_eq!(
            tensor(&meta, "tiny"),
            (
                &DType::F32,
                &[2][..],
                &[c(&[0], &[1]), c(&[1], &[1]), c(&[2], &[0])][..]
            )
        );
        assert_eq!(
            tensor(&meta, "grid"),
            (
                &DType::F32,
                &[5, 6][..],
                &[
                    c(&[0, 0], &[3, 3]),
                    c(&[0, 3], &[3, 3]),
                    c(&[3, 0], &[2, 3]),
                    c(&[3, 3], &[2, 3])
                ][..]
            )
        );
        assert_eq!(
            tensor(&meta, "rep"),
            (&DType::F32, &[4][..], &[c(&[0], &[4])][..])
        );
        assert_eq!(
            tensor(&meta, "plain"),
            (&DType::I64, &[4][..], &[c(&[0], &[4])][..])
        );
        assert!(meta
            .entries
            .contains(&DcpEntry::Bytes { fqn: "step".into() }));

        assert_eq!(meta.storage.len(), 18);
        let (index, at) = storage(&meta, "w0", Some(&[3, 0]));
        assert_eq!(index.index, Some(1));
        assert_eq!(at, &info("__1_0.distcp", 0, 1577, &[]));
        assert_eq!(
            storage(&meta, "grid", Some(&[3, 3])).1,
            info("__3_0.distcp", 5928, 1577, &[])
        );
        assert_eq!(
            storage(&meta, "tiny", Some(&[2])).1,
            info("__3_0.distcp", 4415, 1513, &[])
        );
        assert_eq!(
            storage(&meta, "rep", Some(&[0])).1,
            info("__1_0.distcp", 4731, 1577, &[])
        );
        assert_eq!(
            storage(&meta, "step", None).1,
            info("__3_0.distcp", 0, 1261, &[])
        );
        assert_eq!(
            meta.planner_data.first(),
            Some(&("w0".to_string(), key(&["w0"])))
        );
    }

    #[test]
    fn transform_descriptors_are_kept() {
        let meta = parse(ZSTD).unwrap();
        assert_eq!(
            storage(&meta, "note.k", None).1,
            info("__0_0.distcp", 0, 459, &["stream.zstd/1"])
        );
        assert_eq!(
            storage(&meta, "w", Some(&[0, 0])).1,
            info("__0_0.distcp", 459, 646, &["stream.zstd/1"])
        );
        assert_eq!(
            tensor(&meta, "w"),
            (&DType::F32, &[2, 3][..], &[chunk(&[0, 0], &[2, 3])][..])
        );
    }

    #[test]
    fn older_class_paths_and_five_tuple_properties_parse() {
        let meta = parse(LEGACY).unwrap();
        assert_eq!(
            tensor(&meta, "a"),
            (&DType::F32, &[2, 2][..], &[chunk(&[0, 0], &[2, 2])][..])
        );
        assert!(meta
            .entries
            .contains(&DcpEntry::Bytes { fqn: "b.c".into() }));
        assert_eq!(
            storage(&meta, "a", Some(&[0, 0])).1,
            info("__0_0.distcp", 1261, 1577, &[])
        );
        assert_eq!(meta.version, None);
    }

    #[test]
    fn parse_write_parse_is_identity() {
        for real in [SINGLE, SHARDED4, ZSTD, LEGACY] {
            let meta = parse(real).unwrap();
            let written = write(&meta);
            assert_eq!(parse(&written).unwrap(), meta);
            // Deterministic, so a rewritten checkpoint is byte-stable.
            assert_eq!(write(&parse(&written).unwrap()), written);
        }
    }

    #[test]
    fn written_file_uses_torch_classes_at_protocol_4() {
        let written = write(&parse(SHARDED4).unwrap());
        assert_eq!(written.get(..3), Some(&[0x80, 4, 0x95][..]));
        let tree = pickle::read(&written, &DcpGlobals::PLAIN, Limits::default()).unwrap();
        assert_eq!(tree.class(), Some((META, "Metadata")));
        let state = tree.state().unwrap();
        let keys: Vec<&str> = state
            .as_dict()
            .unwrap()
            .iter()
            .filter_map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(
            keys,
            [
                "state_dict_metadata",
                "planner_data",
                "storage_data",
                "storage_meta",
                "version"
            ]
        );
        let props = state
            .get("state_dict_metadata")
            .and_then(|d| d.get("w1"))
            .and_then(Value::state);
        let props = props
            .and_then(|s| s.get("properties"))
            .and_then(Value::state)
            .unwrap();
        let Value::Tuple(items) = props else {
            panic!("properties state is {props:?}")
        };
        assert_eq!(items.len(), 6);
        assert_eq!(items.first(), Some(&Value::global("torch", "bfloat16")));
        // Strides of the first chunk, [3, 2], as torch records the saving rank's shard.
        assert_eq!(
            items.get(5),
            Some(&Value::Tuple(vec![Value::Int(2), Value::Int(1)]))
        );
    }

    /// A `Metadata` whose state is `{"version": callable(*args)}`.
    fn metadata_calling(module: &str, name: &str, args: Vec<Value>) -> Vec<u8> {
        let call = Value::reduce(module, name, args);
        pickle::write(
            &new_obj(
                META,
                "Metadata",
                Some(Value::Dict(vec![field("version", call)])),
            ),
            Protocol::V4,
        )
    }

    #[test]
    fn limits_grow_with_the_file_so_unbatched_dicts_read() {
        // One dict of 600k pairs in a single `SETITEMS` (as ckpt wrote `storage_data` before it
        // batched): 1.2M values on the stack at once, 8 input bytes each.
        let pairs = 600_000;
        let mut bytes = vec![0x80, 4, b'}', b'('];
        for i in 0..pairs {
            bytes.extend_from_slice(b"\x8c\x06");
            bytes.extend_from_slice(format!("{:06}", i % 1_000_000).as_bytes());
            bytes.extend_from_slice(b"\x8c\x06valuex");
        }
        bytes.extend_from_slice(b"u.");
        let fixed = pickle::parse(&bytes, &DcpGlobals::PLAIN, Limits::default()).unwrap_err();
        assert!(
            matches!(fixed, PickleError::LimitExceeded { .. }),
            "{fixed}"
        );
        // Read under limits scaled to its size, it gets as far as finding no `Metadata` in it.
        let err = parse(&bytes).unwrap_err().to_string();
        assert!(err.contains("not a DCP `Metadata`"), "{err}");
    }

    #[test]
    fn foreign_globals_are_refused_by_name() {
        let evil = metadata_calling(
            "posix",
            "system",
            vec![Value::Str("touch /tmp/pwned".into())],
        );
        let err = parse(&evil).unwrap_err();
        assert!(err.message.contains("`posix.system`"), "{err}");
        assert!(err.hint.is_some());
        let err = parse(&metadata_calling("builtins", "eval", vec![])).unwrap_err();
        assert!(err.message.contains("`builtins.eval`"), "{err}");
    }

    /// A `Metadata` whose `all_local_plans` holds one `SavePlan` with `item` among its items.
    fn metadata_with_plan_item(item: Value) -> Vec<u8> {
        let write_item = new_obj(
            PLANNER,
            "WriteItem",
            Some(Value::Dict(vec![
                field(
                    "type",
                    Value::reduce(PLANNER, "WriteItemType", vec![int(2)]),
                ),
                field(
                    "tensor_data",
                    new_obj(
                        PLANNER,
                        "TensorWriteData",
                        Some(Value::Dict(vec![field("size", torch_size(&[4]))])),
                    ),
                ),
            ])),
        );
        let plan = new_obj(
            PLANNER,
            "SavePlan",
            Some(Value::Dict(vec![field(
                "items",
                Value::List(vec![write_item, item]),
            )])),
        );
        let meta = new_obj(
            META,
            "Metadata",
            Some(Value::Dict(vec![
                field("state_dict_metadata", Value::Dict(Vec::new())),
                field("all_local_plans", Value::List(vec![plan])),
            ])),
        );
        pickle::write(&meta, Protocol::V4)
    }

    #[test]
    fn plans_are_read_and_any_other_global_beside_them_refused() {
        let chunk = new_obj(META, "ChunkStorageMetadata", None);
        parse(&metadata_with_plan_item(chunk)).unwrap();
        for (module, name) in [
            (PLANNER, "BytesIOWriteData"),
            (PLANNER, "LoadPlan"),
            (
                "megatron.core.dist_checkpointing.strategies.torch",
                "MCoreSavePlan",
            ),
            ("posix", "system"),
        ] {
            let bytes = metadata_with_plan_item(Value::reduce(module, name, Vec::new()));
            let err = parse(&bytes).unwrap_err();
            assert!(err.message.contains(&format!("`{module}.{name}`")), "{err}");
        }
    }

    #[test]
    fn a_derived_formats_classes_and_fields_come_only_through_its_extension() {
        // megatron-core 0.15 pickles its own subclass of `Metadata`, with a `mcore_data` field.
        let bytes = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/megatron_torch_dist_flat/.metadata"
        ))
        .unwrap();
        let err = parse(&bytes).unwrap_err();
        assert!(err.message.contains("MCoreMetadata"), "{err}");

        struct Mcore;
        impl Extension for Mcore {
            fn allows(&self, module: &str, name: &str) -> bool {
                module.starts_with("megatron.") && name.starts_with("MCore")
            }
            fn is_metadata(&self, _: &str, name: &str) -> bool {
                name == "MCoreMetadata"
            }
            fn unhashable(&self, _: &str, name: &str) -> bool {
                name == "MCoreMetadata"
            }
            fn fields(&self) -> &[&str] {
                &["mcore_data", "no_such_field"]
            }
        }
        let mut collected = Collect::default();
        let rest = parse_into(&bytes, &mut collected, &Mcore).unwrap();
        assert_eq!(collected.entries.len(), 2);
        let names: Vec<&str> = rest.fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["mcore_data"]);
        assert!(matches!(rest.fields[0].1, Value::Dict(_)));
    }

    #[test]
    fn unsupported_dtype_is_kept_by_name() {
        // `uint16` and `bits16` have the same length, so the pickle stays well formed.
        let mut bytes = SINGLE.to_vec();
        let at = bytes
            .windows(8)
            .position(|w| w == b"\x8c\x06uint16")
            .unwrap();
        bytes[at + 2..at + 8].copy_from_slice(b"bits16");
        // Kept by name, so that a selection can leave it out; reading refuses it otherwise.
        let meta = parse(&bytes).unwrap();
        assert!(meta.entries.contains(&DcpEntry::Unsupported {
            fqn: "model.u16".into(),
            dtype: "torch.bits16".into()
        }));
    }

    #[test]
    fn a_memory_format_outside_the_enum_is_an_error() {
        let good = write(&parse(SHARDED4).unwrap());
        // The first `_MEM_FORMAT_ENCODING(0)`: its argument is `BININT1 0`, then `TUPLE1`.
        let name = good
            .windows(20)
            .position(|w| w == b"_MEM_FORMAT_ENCODING")
            .unwrap();
        let at = name
            + good[name..]
                .windows(3)
                .position(|w| w == b"K\x00\x85")
                .unwrap()
            + 1;
        let with = |value: u8| {
            let mut p = good.clone();
            p[at] = value;
            parse(&p)
        };
        assert!(with(1).is_ok());
        assert!(with(2).is_ok());
        for value in [3, 255] {
            let err = with(value).unwrap_err();
            assert_eq!(err.tensor.as_deref(), Some("w0"));
            assert!(
                err.message
                    .contains(&format!("memory format encoding is {value}, not 0, 1 or 2")),
                "{}",
                err.message
            );
        }
    }

    #[test]
    fn inconsistent_fields_are_errors() {
        let good = parse(SHARDED4).unwrap();
        let mut bad = good.clone();
        if let Some(DcpEntry::Tensor { chunks, .. }) = bad.entries.first_mut() {
            chunks[0].offsets = vec![9, 1];
        }
        let err = parse(&write(&bad)).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("w0"));
        let mut bad = good.clone();
        bad.storage[0].1.relative_path = "../../etc/passwd".into();
        assert!(parse(&write(&bad))
            .unwrap_err()
            .message
            .contains("outside the checkpoint directory"));
        let mut bad = good;
        if let Some(DcpEntry::Tensor { size, .. }) = bad.entries.first_mut() {
            *size = vec![1 << 62, 1 << 62];
        }
        assert!(parse(&write(&bad)).is_err());
        assert!(parse(b"\x80\x04}.")
            .unwrap_err()
            .message
            .contains("not a DCP `Metadata`"));
        // The frame at byte 2 announces the whole pickle, so it is what finds it cut short.
        let truncated = parse(&SINGLE[..100]).unwrap_err();
        assert_eq!(truncated.offset, Some(2));
        assert!(
            truncated.message.contains("truncated"),
            "{}",
            truncated.message
        );
    }

    #[test]
    fn repeated_storage_keys_keep_the_last_value() {
        let mut meta = parse(ZSTD).unwrap();
        let mut again = meta.storage[0].clone();
        again.0.index = Some(7);
        again.1.offset = 99;
        meta.storage.push(again);
        let parsed = parse(&write(&meta)).unwrap();
        assert_eq!(parsed.storage.len(), 2);
        assert_eq!(parsed.storage[0].0.index, None);
        assert_eq!(parsed.storage[0].1.offset, 99);
    }

    #[test]
    fn dedup_storage_keeps_first_positions_and_last_values() {
        let pair = |fqn: &str, offset: Option<Vec<u64>>, at: u64| {
            let index = MetadataIndex {
                fqn: fqn.into(),
                offset,
                index: None,
            };
            (index, info("__0_0.distcp", at, 1, &[]))
        };
        let pairs = vec![
            pair("a", Some(vec![0]), 1),
            pair("b", None, 2),
            pair("a", Some(vec![1]), 3),
            pair("a", Some(vec![0]), 4),
            pair("b", None, 5),
            pair("a", Some(vec![0]), 6),
        ];
        let got: Vec<(String, Option<Vec<u64>>, u64)> = dedup_storage(pairs)
            .into_iter()
            .map(|(i, s)| (i.fqn, i.offset, s.offset))
            .collect();
        let want = vec![
            ("a".to_string(), Some(vec![0]), 6),
            ("b".to_string(), None, 5),
            ("a".to_string(), Some(vec![1]), 3),
        ];
        assert_eq!(got, want);
    }

    /// Writes `write(parse(real))` over copies of the fixture directories named in
    /// `CKPT_DCP_WRITE_DIR` (`single,sharded4,...`), for loading by hand with torch:
    /// `CKPT_DCP_WRITE_DIR=/tmp/out cargo test --lib metadata -- --ignored`.
    #[test]
    #[ignore]
    fn write_for_torch() {
        let Ok(dir) = std::env::var("CKPT_DCP_WRITE_DIR") else {
            return;
        };
        for (name, real) in [
            ("single", SINGLE),
            ("sharded4", SHARDED4),
            ("zstd", ZSTD),
            ("legacy", LEGACY),
        ] {
            let path = std::path::Path::new(&dir).join(name);
            if path.is_dir() {
                std::fs::write(path.join(".metadata"), write(&parse(real).unwrap())).unwrap();
            }
        }
    }

    /// Metadata with `tensors` tensors of `pieces` chunks each, exercising every shape the writer
    /// has: bytes entries, offsets of `None`, transforms, int and string planner keys, strings past
    /// 255 bytes, sizes past `i64::MAX`, and more than 256 memoized strings (4-byte memo indices).
    fn synthetic(tensors: usize, pieces: u64) -> DcpMetadata {
        let mut meta = DcpMetadata {
            entries: Vec::new(),
            storage: Vec::new(),
            planner_data: Vec::new(),
            version: Some("1.0.0".into()),
        };
        for t in 0..tensors {
            let fqn = if t % 7 == 3 {
                format!("model.{}.w{t}", "long".repeat(70))
            } else {
                format!("model.layers.{t}.weight")
            };
            // The first 15 dtypes: those `written_bytes_are_unchanged`'s digests were taken with.
            let dtype = DType::ALL[t % 15];
            let rows = pieces * 3 + t as u64;
            let size = if t == 5 {
                vec![rows, u64::MAX]
            } else {
                vec![rows, 7, 1 + t as u64 % 3]
            };
            let chunks: Vec<Chunk> = (0..pieces)
                .map(|p| {
                    let mut sizes = size.clone();
                    sizes[0] = if p + 1 == pieces { rows - 3 * p } else { 3 };
                    let mut offsets = vec![0; size.len()];
                    offsets[0] = 3 * p;
                    chunk(&offsets, &sizes)
                })
                .collect();
            for (p, c) in chunks.iter().enumerate() {
                let transforms: &[&str] = if t % 3 == 1 { &["stream.zstd/1"] } else { &[] };
                meta.storage.push((
                    MetadataIndex {
                        fqn: fqn.clone(),
                        offset: Some(c.offsets.clone()),
                        index: (t % 2 == 0).then_some(p as i64),
                    },
                    info(
                        &format!("__{}_0.distcp", p % 200),
                        (t as u64) << 20,
                        1 << (t % 40),
                        transforms,
                    ),
                ));
            }
            meta.entries.push(DcpEntry::Tensor {
                fqn: fqn.clone(),
                dtype,
                size,
                chunks,
            });
            let mut path = key(&["model", "layers"]);
            path.push(KeyPart::IntKey(t as i64));
            path.push(KeyPart::Key("weight".into()));
            meta.planner_data.push((fqn, path));
            if t % 4 == 0 {
                let fqn = format!("extra.{t}");
                meta.entries.push(DcpEntry::Bytes { fqn: fqn.clone() });
                meta.storage.push((
                    MetadataIndex {
                        fqn: fqn.clone(),
                        offset: None,
                        index: None,
                    },
                    info("__0_0.distcp", 9, 12, &[]),
                ));
                meta.planner_data.push((fqn, key(&["extra", "0"])));
            }
        }
        meta
    }

    /// Digests of what the tree-building writer wrote for each fixture and synthetic metadata,
    /// taken before the streaming writer replaced it: torch must keep loading the same bytes.
    #[test]
    fn written_bytes_are_unchanged() {
        let cases = [
            ("single", parse(SINGLE).unwrap()),
            ("sharded4", parse(SHARDED4).unwrap()),
            ("zstd", parse(ZSTD).unwrap()),
            ("legacy", parse(LEGACY).unwrap()),
            (
                "empty",
                DcpMetadata {
                    entries: Vec::new(),
                    storage: Vec::new(),
                    planner_data: Vec::new(),
                    version: None,
                },
            ),
            ("synthetic-1x1", synthetic(1, 1)),
            ("synthetic-40x300", synthetic(40, 300)),
        ];
        let got: Vec<(&str, usize, u64)> = cases
            .iter()
            .map(|(name, meta)| {
                let bytes = write(meta);
                (*name, bytes.len(), xxhash_rust::xxh3::xxh3_64(&bytes))
            })
            .collect();
        let want: &[(&str, usize, u64)] = &[
            ("single", 4399, 0x7da8_9ca5_68db_0bb0),
            ("sharded4", 2646, 0x5b70_e844_9b1e_764a),
            ("zstd", 1077, 0x26ec_dbac_91b8_e6b2),
            ("legacy", 1015, 0xf609_cf7a_3d11_78dd),
            ("empty", 249, 0x537c_2d96_a60c_1e5e),
            ("synthetic-1x1", 1079, 0x3918_5f4d_1574_ac97),
            ("synthetic-40x300", 1138008, 0xfc73_f638_595c_563c),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn streamed_bytes_equal_the_tree_writers() {
        for real in [SINGLE, SHARDED4, ZSTD, LEGACY] {
            let meta = parse(real).unwrap();
            assert_eq!(write(&meta), write_tree(&meta));
        }
        for (tensors, pieces) in [(0, 0), (1, 1), (3, 0), (40, 300), (300, 2)] {
            let meta = synthetic(tensors, pieces);
            assert_eq!(write(&meta), write_tree(&meta), "{tensors}x{pieces}");
        }
    }

    /// Random metadata; names come from small pools so that strings repeat (or not) every way.
    fn any_metadata() -> impl Strategy<Value = DcpMetadata> {
        let name = || prop::sample::select(vec!["a", "b.c", "offset", "torch", "Size", "x\ny"]);
        let dims = || prop::collection::vec(any::<u64>(), 0..5);
        let entry = prop_oneof![
            (
                name(),
                prop::sample::select(DType::ALL.to_vec()),
                dims(),
                prop::collection::vec((dims(), dims()), 0..4),
            )
                .prop_map(|(fqn, dtype, size, chunks)| DcpEntry::Tensor {
                    fqn: fqn.into(),
                    dtype,
                    size,
                    chunks: chunks
                        .into_iter()
                        .map(|(offsets, sizes)| Chunk { offsets, sizes })
                        .collect(),
                }),
            name().prop_map(|fqn| DcpEntry::Bytes { fqn: fqn.into() }),
        ];
        let storage = (
            name(),
            prop::option::of(dims()),
            prop::option::of(any::<i64>()),
            name(),
            any::<u64>(),
            any::<u64>(),
            prop::collection::vec(name(), 0..3),
        )
            .prop_map(|(fqn, offset, index, path, off, len, transforms)| {
                (
                    MetadataIndex {
                        fqn: fqn.into(),
                        offset,
                        index,
                    },
                    info(path, off, len, &transforms),
                )
            });
        let part = prop_oneof![
            name().prop_map(|k| KeyPart::Key(k.into())),
            any::<i64>().prop_map(KeyPart::Index),
            any::<i64>().prop_map(KeyPart::IntKey),
        ];
        (
            prop::collection::vec(entry, 0..6),
            prop::collection::vec(storage, 0..8),
            prop::collection::vec((name(), prop::collection::vec(part, 0..5)), 0..5),
            prop::option::of(name()),
        )
            .prop_map(|(entries, storage, planner, version)| DcpMetadata {
                entries,
                storage,
                planner_data: planner.into_iter().map(|(f, p)| (f.into(), p)).collect(),
                version: version.map(String::from),
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn streamed_bytes_equal_the_tree_writers_for_any_metadata(meta in any_metadata()) {
            prop_assert_eq!(write(&meta), write_tree(&meta));
        }
    }

    /// One random edit of a byte string: overwrite, insert, delete, or cut.
    fn mutate(bytes: &mut Vec<u8>, op: u8, at: usize, b: u8) {
        let at = at % (bytes.len() + 1);
        match op % 4 {
            0 if at < bytes.len() => bytes[at] = b,
            1 => bytes.insert(at, b),
            2 if at < bytes.len() => {
                bytes.remove(at);
            }
            _ => bytes.truncate(at),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1500))]

        #[test]
        fn mutated_real_files_never_panic(
            which in 0usize..4,
            edits in prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..6),
        ) {
            let mut bytes = [SINGLE, SHARDED4, ZSTD, LEGACY][which].to_vec();
            for (op, at, b) in edits {
                mutate(&mut bytes, op, at, b);
            }
            let _ = parse(&bytes);
        }
    }
}
