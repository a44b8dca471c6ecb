//! Unit tests of reading and writing `.metadata`.

use super::read::*;
use super::write::*;
use super::*;
use crate::model::contiguous_strides;
use crate::pickle::{self, Limits, PickleError, Protocol};
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

/// The names of `meta`'s entries, in order.
fn fqns(meta: &DcpMetadata) -> Vec<&str> {
    meta.entries
        .iter()
        .map(|e| match e {
            DcpEntry::Tensor { fqn, .. }
            | DcpEntry::Bytes { fqn }
            | DcpEntry::Unsupported { fqn, .. } => fqn.as_str(),
        })
        .collect()
}

#[test]
fn single_process_save_lists_its_entries_in_order() {
    let meta = parse(SINGLE).unwrap();
    assert_eq!(
        fqns(&meta),
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
}

#[test]
fn single_process_save_gives_each_tensor_its_dtype_shape_and_chunk() {
    let meta = parse(SINGLE).unwrap();
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
            F64, F32, F16, BF16, F8E4M3, F8E5M2, I64, I32, I16, I8, U64, U32, U16, U8, Bool, F32,
            F32, F32, F32, F32
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
}

#[test]
fn single_process_save_locates_every_entry_in_its_file() {
    let meta = parse(SINGLE).unwrap();
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
}

#[test]
fn single_process_save_keeps_planner_data_and_version() {
    let meta = parse(SINGLE).unwrap();
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
