//! Reading `.metadata`: the pickle walked as data, its two big dicts handed to a [`Sink`] batch
//! by batch.

use std::collections::HashMap;
use std::ops::ControlFlow;

use super::*;
use crate::bail_invalid;
use crate::error::{Error, Result};
use crate::model::numel;
use crate::pickle::{self, Kind, Limits, NodeRef, PickleError, Value};

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
/// The typed structs are read straight out of the pickle's graph (see [`pickle::NodeRef`]), and the
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
pub(super) fn metadata_state<'g>(
    root: NodeRef<'g>,
    extension: &dyn Extension,
) -> Option<NodeRef<'g>> {
    match root.class() {
        Some((m, "Metadata")) if m == META || m == OLD_META => root.state(),
        Some((m, n)) if extension.is_metadata(m, n) => root.state(),
        _ => None,
    }
}

/// The [`Sink`] of [`parse`]: everything, as a [`DcpMetadata`] holds it.
#[derive(Default)]
pub(super) struct Collect {
    pub(super) entries: Vec<DcpEntry>,
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
pub(super) struct Taken<'s> {
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
    fn claims(&mut self, owner: NodeRef<'_>, key: &str) -> bool {
        let is_metadata = match owner.class() {
            Some((m, "Metadata")) => m == META || m == OLD_META,
            Some((m, n)) => self.extension.is_metadata(m, n),
            _ => false,
        };
        is_metadata && (key == "state_dict_metadata" || key == "storage_data")
    }

    fn consume(&mut self, key: &str, pairs: &[(NodeRef<'_>, NodeRef<'_>)]) -> ControlFlow<()> {
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

    fn claims_list(&mut self, owner: NodeRef<'_>, key: &str) -> bool {
        let is_tensor = matches!(
            owner.class(),
            Some((m, "TensorStorageMetadata")) if m == META || m == OLD_META
        );
        is_tensor && key == "chunks"
    }

    fn consume_list(&mut self, list: NodeRef<'_>, items: &[NodeRef<'_>]) -> ControlFlow<()> {
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
pub(super) fn limits_for(len: usize) -> Limits {
    let default = Limits::default();
    Limits {
        max_stack: default.max_stack.max(len / 4),
        max_memo: default.max_memo.max(len),
        max_nodes: default.max_nodes.max(len.saturating_mul(4)),
        ..default
    }
}

pub(super) fn pickle_error(err: PickleError) -> Error {
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
pub(super) fn entry(
    key: NodeRef<'_>,
    value: NodeRef<'_>,
    lists: &mut HashMap<u32, Vec<Chunk>>,
) -> Result<DcpEntry> {
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

pub(super) fn tensor(
    fqn: &str,
    state: NodeRef<'_>,
    lists: &mut HashMap<u32, Vec<Chunk>>,
) -> Result<DcpEntry> {
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
pub(super) fn tensor_dtype(properties: NodeRef<'_>) -> Result<std::result::Result<DType, String>> {
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
            let items: Vec<NodeRef<'_>> = state.as_seq().into_iter().flatten().collect();
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
pub(super) fn check_memory_format(encoding: NodeRef<'_>) -> Result<()> {
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
pub(super) fn raw_chunk(value: NodeRef<'_>) -> Result<Chunk> {
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
pub(super) fn check_chunk(chunk: &Chunk, size: &[u64]) -> Result<()> {
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

pub(super) fn metadata_index(value: NodeRef<'_>) -> Result<MetadataIndex> {
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

pub(super) fn storage_info(key: NodeRef<'_>, value: NodeRef<'_>) -> Result<StorageInfo> {
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
pub(super) fn is_plain_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.starts_with(['/', '\\'])
        && !path.contains(':')
        && path.split(['/', '\\']).all(|part| part != "..")
}

pub(super) fn planner_entry(
    key: NodeRef<'_>,
    value: NodeRef<'_>,
) -> Result<(String, Vec<KeyPart>)> {
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
pub(super) fn dedup_storage(
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
pub(super) fn dict_items(value: NodeRef<'_>) -> Option<Vec<(NodeRef<'_>, NodeRef<'_>)>> {
    match value.class() {
        Some(("collections", "OrderedDict")) => value.object_dict_items(),
        _ => value.dict_items(),
    }
}

/// The state of an object of class `name` from one of `modules`, which must have one.
pub(super) fn object_state<'g>(
    value: NodeRef<'g>,
    modules: &[&str],
    name: &str,
) -> Option<NodeRef<'g>> {
    object_state_or_none(value, modules, name).flatten()
}

/// `Some(state)` if `value` is an object of class `name` from one of `modules`.
pub(super) fn object_state_or_none<'g>(
    value: NodeRef<'g>,
    modules: &[&str],
    name: &str,
) -> Option<Option<NodeRef<'g>>> {
    match value.class() {
        Some((m, n)) if n == name && modules.contains(&m) => Some(value.state()),
        _ => None,
    }
}

/// A `torch.Size` (or, leniently, a plain tuple or list) of non-negative ints.
pub(super) fn torch_size_of(value: NodeRef<'_>) -> Option<Vec<u64>> {
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
pub(super) fn describe(value: NodeRef<'_>) -> String {
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

pub(super) fn describe_opt(value: Option<NodeRef<'_>>) -> String {
    value.map_or_else(|| "missing".to_string(), describe)
}
