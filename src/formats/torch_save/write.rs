//! Writing: `data.pkl` for a list of key paths and leaves, and the records of the archive, which
//! [`crate::zip::layout`] frames.

use super::*;

/// One leaf to write.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteLeaf {
    /// A contiguous tensor at storage offset 0 over the whole storage `storage_key`, whose record
    /// holds `numel(shape)` elements of `dtype`.
    Tensor {
        dtype: DType,
        shape: Vec<u64>,
        storage_key: String,
    },
    Value(Value),
}

/// The `data.pkl` of an archive holding `items`, as protocol 2 like torch.save.
///
/// Key paths rebuild nested plain dicts and lists (`KeyPart::IntKey` becomes an int key, as
/// optimizer state has; a node of `KeyPart::Index` steps becomes a list); one item with an empty path is the whole object (a bare tensor, as in a DCP item). No
/// items make an empty dict. Paths must be distinct and none may be a prefix of another (see
/// [`check_key_paths`]); an item that breaks this is left out.
pub fn data_pkl(items: &[(Vec<KeyPart>, WriteLeaf)]) -> Vec<u8> {
    let root = match items {
        [(path, leaf)] if path.is_empty() => leaf_value(leaf),
        _ => {
            let mut root = Tree::Dict(Vec::new());
            for (path, leaf) in items {
                root.insert(path, leaf);
            }
            root.into_value()
        }
    };
    pickle::write(&protocol2_spelling(root), Protocol::V2)
}

/// Rewrite bytes and sets the way Python's protocol 2 pickler spells them (`_codecs.encode(str,
/// "latin1")`, `builtins.set([...])`): torch.load's `weights_only` unpickler knows those calls
/// but not the protocol 3+ opcodes (`BINBYTES`, `ADDITEMS`) a bare [`Value::Bytes`] or
/// [`Value::Set`] would be written with.
fn protocol2_spelling(value: Value) -> Value {
    match value {
        // Latin-1 maps each byte to the code point of the same value, so this is lossless.
        Value::Bytes(bytes) => Value::reduce(
            "_codecs",
            "encode",
            vec![
                Value::Str(bytes.iter().map(|&b| char::from(b)).collect()),
                Value::Str("latin1".into()),
            ],
        ),
        Value::Set(items) => Value::reduce(
            "builtins",
            "set",
            vec![Value::List(
                items.into_iter().map(protocol2_spelling).collect(),
            )],
        ),
        Value::PersistentId(id) => Value::PersistentId(Box::new(protocol2_spelling(*id))),
        other => other.map_children(&mut protocol2_spelling),
    }
}

/// Check that `items` describe one object: distinct key paths, none a prefix of another, and an
/// empty path only when it is the only item.
/// The bytes `torch.save(value, f)` writes for plain data (no tensors), archive named `prefix`:
/// a small file written whole (Megatron's `common.pt`).
pub fn save_value(prefix: &str, value: &crate::pickle::Value) -> Result<Vec<u8>> {
    let pkl = data_pkl(&[(Vec::new(), WriteLeaf::Value(value.clone()))]);
    crate::zip::build(&records(prefix, pkl, &[]), &[])
}

pub fn check_key_paths(items: &[(Vec<KeyPart>, WriteLeaf)]) -> Result<()> {
    let mut paths: Vec<&[KeyPart]> = items.iter().map(|(p, _)| p.as_slice()).collect();
    if items.len() > 1 && paths.iter().any(|p| p.is_empty()) {
        return Err(Error::invalid(
            "a torch.save object cannot be both one bare value and a dict of entries",
        ));
    }
    // After sorting, a path that another starts with comes right before one such path.
    paths.sort_unstable_by(|a, b| cmp_path(a, b));
    for pair in paths.windows(2) {
        if let [a, b] = pair {
            if b.starts_with(a) {
                return Err(Error::invalid(format!(
                    "entry `{}` is both a value and a dict holding `{}`",
                    KeyPart::flat_name(a),
                    KeyPart::flat_name(b)
                )));
            }
        }
    }
    Ok(())
}

/// The records of an archive in torch's order: `data.pkl`, the small metadata records, each
/// storage in the order given, then `version` and `.data/serialization_id`. Storage records have
/// no content: the caller writes their bytes at the offsets [`zip::layout`] gives.
///
/// torch names storages `0`, `1`, ... in order of first use in `data.pkl` and writes them in that
/// order, which `.format_version` 1 promises: `torch.load` with
/// `torch.utils.serialization.config.load.calculate_storage_offsets` relies on it. Pass storages
/// keyed and ordered that way for archives every torch reader accepts.
pub fn records(prefix: &str, data_pkl: Vec<u8>, storages: &[(String, u64)]) -> Vec<ZipRecord> {
    // torch's id is 20 digits of a hash of every record's CRC plus 20 random digits; nothing reads
    // it back, and hashing what we know instead keeps our output reproducible.
    let mut hashed = data_pkl.clone();
    for (key, len) in storages {
        hashed.extend_from_slice(key.as_bytes());
        hashed.extend_from_slice(&len.to_le_bytes());
    }
    let serialization_id = format!(
        "{:020}{:020}",
        xxhash_rust::xxh3::xxh3_64_with_seed(&hashed, 0),
        xxhash_rust::xxh3::xxh3_64_with_seed(&hashed, 1)
    );

    let literal = |name: &str, content: Vec<u8>| ZipRecord {
        name: format!("{prefix}/{name}"),
        len: content.len() as u64,
        content: Some(content),
    };
    let mut records = vec![
        literal("data.pkl", data_pkl),
        // Format 1: storages are written in key order, so torch may compute their offsets.
        literal(".format_version", b"1".to_vec()),
        literal(
            ".storage_alignment",
            zip::ALIGNMENT.to_string().into_bytes(),
        ),
        literal("byteorder", b"little".to_vec()),
    ];
    records.extend(storages.iter().map(|(key, len)| ZipRecord {
        name: format!("{prefix}/data/{key}"),
        len: *len,
        content: None,
    }));
    records.push(literal("version", b"3\n".to_vec()));
    records.push(literal(
        ".data/serialization_id",
        serialization_id.into_bytes(),
    ));
    records
}

/// The object being rebuilt from key paths; dicts keep first-insertion order.
enum Tree<'a> {
    Leaf(&'a WriteLeaf),
    Dict(Vec<(&'a KeyPart, Tree<'a>)>),
}

impl<'a> Tree<'a> {
    fn insert(&mut self, path: &'a [KeyPart], leaf: &'a WriteLeaf) {
        let Tree::Dict(items) = self else {
            return; // a leaf already holds this path's prefix
        };
        let Some((first, rest)) = path.split_first() else {
            return; // an empty path among others: no place for it in a dict
        };
        let index = match items.iter().position(|(k, _)| *k == first) {
            Some(i) => i,
            None if rest.is_empty() => {
                items.push((first, Tree::Leaf(leaf)));
                return;
            }
            None => {
                items.push((first, Tree::Dict(Vec::new())));
                items.len() - 1
            }
        };
        if let Some((_, child)) = items.get_mut(index) {
            if !rest.is_empty() {
                child.insert(rest, leaf);
            }
        }
    }

    fn into_value(self) -> Value {
        match self {
            Tree::Leaf(leaf) => leaf_value(leaf),
            // A node whose steps are all list indices is a list, as `dcp_to_torch_save` rebuilds
            // it: missing positions are None.
            Tree::Dict(items) if is_list(&items) => {
                let len = items
                    .iter()
                    .filter_map(|(k, _)| match k {
                        KeyPart::Index(i) => usize::try_from(*i).ok(),
                        _ => None,
                    })
                    .max()
                    .map_or(0, |m| m + 1);
                let mut list = vec![Value::None; len];
                for (k, v) in items {
                    if let KeyPart::Index(i) = k {
                        if let Some(slot) = usize::try_from(*i).ok().and_then(|i| list.get_mut(i)) {
                            *slot = v.into_value();
                        }
                    }
                }
                Value::List(list)
            }
            Tree::Dict(items) => Value::Dict(
                items
                    .into_iter()
                    .map(|(k, v)| {
                        let key = match k {
                            KeyPart::Key(s) => Value::Str(s.clone()),
                            KeyPart::Index(i) | KeyPart::IntKey(i) => Value::Int(*i),
                        };
                        (key, v.into_value())
                    })
                    .collect(),
            ),
        }
    }
}

/// True when every step under a node is a small, non-negative list index. Lists are rebuilt only
/// up to a million entries: a larger index in hostile metadata stays a dict key.
fn is_list(items: &[(&KeyPart, Tree)]) -> bool {
    !items.is_empty()
        && items
            .iter()
            .all(|(k, _)| matches!(k, KeyPart::Index(i) if (0..1_000_000).contains(i)))
}

fn leaf_value(leaf: &WriteLeaf) -> Value {
    match leaf {
        WriteLeaf::Value(v) => v.clone(),
        WriteLeaf::Tensor {
            dtype,
            shape,
            storage_key,
        } => tensor_value(*dtype, shape, storage_key),
    }
}

/// What torch.save pickles for a contiguous CPU tensor at storage offset 0.
pub(super) fn tensor_value(dtype: DType, shape: &[u64], storage_key: &str) -> Value {
    let numel = numel(shape).unwrap_or(u64::MAX);
    let int = |v: u64| Value::Int(i64::try_from(v).unwrap_or(i64::MAX));
    let strides = crate::model::contiguous_strides(shape);
    // torch keeps legacy storage classes for the dtypes that have one, and uses untyped storages
    // (sized in bytes) plus `_rebuild_tensor_v3` for the rest.
    let typed = dtype.storage_class();
    let (class, storage_numel) = match typed {
        Some(class) => (Value::global("torch", class), numel),
        None => (
            Value::global("torch.storage", "UntypedStorage"),
            numel.saturating_mul(dtype.size() as u64),
        ),
    };
    let storage = Value::PersistentId(Box::new(Value::Tuple(vec![
        Value::Str("storage".into()),
        class,
        Value::Str(storage_key.to_string()),
        Value::Str("cpu".into()),
        int(storage_numel),
    ])));
    let backward_hooks = Value::reduce("collections", "OrderedDict", Vec::new());
    let mut args = vec![
        storage,
        Value::Int(0),
        Value::Tuple(shape.iter().map(|&d| int(d)).collect()),
        Value::Tuple(strides.iter().map(|&s| int(s)).collect()),
        Value::Bool(false),
        backward_hooks,
    ];
    let function = if typed.is_some() {
        "_rebuild_tensor_v2"
    } else {
        args.push(Value::global("torch", dtype.torch_name()));
        "_rebuild_tensor_v3"
    };
    Value::reduce("torch._utils", function, args)
}
