//! Reading: `data.pkl` (or a legacy file's pickles) interpreted as data only, each tensor checked
//! against its storage record, and the records and calls checked as torch.load checks them.

use super::*;
use crate::formats::per_rank;

/// One tensor as `data.pkl` describes it: a view into a storage record.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedTensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Stride of each dimension, in elements.
    pub strides: Vec<u64>,
    /// Offset of the view's first element in the storage, in elements.
    pub storage_offset: u64,
    /// The storage's key: its bytes are the record `{prefix}/data/{storage_key}`.
    pub storage_key: String,
    /// Elements of `dtype` in the whole storage (already checked against the record's length).
    pub storage_numel: u64,
}

/// What a key path of the saved object leads to.
#[derive(Clone, Debug, PartialEq)]
pub enum Leaf {
    Tensor(SavedTensor),
    /// A tensor of a dtype ckpt does not support (`torch.bits8`), as `data.pkl` names it. Kept by
    /// name so that a selection can leave it out; its storage is not checked.
    Unsupported {
        dtype: String,
    },
    /// Anything that is neither a tensor nor a dict with str/int keys (or an empty dict).
    Value(Value),
    /// A DTensor or ShardedTensor: one rank's pieces of a sharded tensor (per-rank saves).
    Sharded(per_rank::ShardedLeaf),
}

/// A parsed torch.save archive.
#[derive(Clone, Debug, PartialEq)]
pub struct Archive {
    /// The folder every record is in: `archive` when saved to a buffer (every DCP item), else the
    /// file stem torch was given.
    pub prefix: String,
    /// Every record, sorted by name.
    pub entries: Vec<ZipEntry>,
    /// Each leaf of the saved object with the dict keys leading to it, in pickle order: str keys
    /// are `KeyPart::Key`, int keys (optimizer state) `KeyPart::IntKey`. A saved bare tensor or
    /// value is one leaf with an empty path.
    pub leaves: Vec<(Vec<KeyPart>, Leaf)>,
}

impl Archive {
    /// The record holding storage `key` (`{prefix}/data/{key}`).
    pub fn storage(&self, key: &str) -> Option<&ZipEntry> {
        self.entry(&format!("{}/data/{key}", self.prefix))
    }

    fn entry(&self, name: &str) -> Option<&ZipEntry> {
        self.entries
            .binary_search_by(|e| e.name.as_str().cmp(name))
            .ok()
            .and_then(|i| self.entries.get(i))
    }

    /// The record `{prefix}/{name}`, found without building its name: DCP reads a million
    /// archives, each looked up for several records.
    fn entry_in_prefix(&self, name: &str) -> Option<&ZipEntry> {
        self.entries
            .binary_search_by(|e| cmp_joined(e.name.as_bytes(), self.prefix.as_bytes(), name))
            .ok()
            .and_then(|i| self.entries.get(i))
    }
}

/// How `name` orders against `{prefix}/{suffix}`, compared by slices.
fn cmp_joined(name: &[u8], prefix: &[u8], suffix: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let head = name.len().min(prefix.len());
    match name[..head].cmp(&prefix[..head]) {
        Ordering::Equal if name.len() < prefix.len() => return Ordering::Less,
        Ordering::Equal => {}
        other => return other,
    }
    match name[prefix.len()..].split_first() {
        None => Ordering::Less,
        Some((&c, rest)) => c.cmp(&b'/').then_with(|| rest.cmp(suffix.as_bytes())),
    }
}

/// Read the torch.save archive that spans exactly `bytes`. Error offsets are relative to `bytes`.
pub fn read(bytes: &[u8]) -> Result<Archive> {
    read_with(bytes, false, None)
}

/// A class beyond [`TorchGlobals`] that one kind of file pickles, and how it becomes plain data:
/// `plain` gets each object of an allowed extra class and returns what stands in its place,
/// before anything else looks at the tree (Megatron's `common.pt` holds an `argparse.Namespace`,
/// read as the dict of its fields). Nothing is run either way.
pub struct Extra<'a> {
    pub globals: &'a dyn Globals,
    pub plain: &'a dyn Fn(&Object) -> Option<Value>,
}

/// [`read`] of an archive that may also name the classes of `extra`.
pub fn read_with_extra(bytes: &[u8], extra: &Extra<'_>) -> Result<Archive> {
    read_with(bytes, false, Some(extra))
}

/// [`read`] for many small archives alike: DCP stores each chunk as one, and a checkpoint of a
/// million chunks has a few distinct shapes. What a `data.pkl` says, given the records it can
/// name, is interpreted once per thread and reused for every archive with the same `data.pkl`
/// bytes and the same record names and lengths; the ZIP structure of each is still read whole.
pub fn read_cached(bytes: &[u8]) -> Result<Archive> {
    read_with(bytes, true, None)
}

/// Interpreted leaves by [`leaves_key`], per thread; cleared when full. Keys are hundreds of
/// bytes and looked up once per archive, so they are hashed with xxh3 rather than SipHash (the
/// cache is too small for colliding keys to matter).
type LeafCache = HashMap<Vec<u8>, Vec<(Vec<KeyPart>, Leaf)>, xxhash_rust::xxh3::Xxh3Builder>;
const MAX_CACHED_LEAVES: usize = 256;

thread_local! {
    static LEAVES: std::cell::RefCell<LeafCache> = std::cell::RefCell::default();
}

/// Everything the interpretation of `pkl` depends on: its bytes and each record's name, length
/// and flags (the storages it names are checked against them), each length-prefixed.
fn leaves_key(pkl: &[u8], entries: &[ZipEntry]) -> Vec<u8> {
    let mut key = Vec::with_capacity(pkl.len() + 48 * entries.len() + 8);
    key.extend_from_slice(&(pkl.len() as u64).to_le_bytes());
    key.extend_from_slice(pkl);
    for e in entries {
        key.extend_from_slice(&(e.name.len() as u64).to_le_bytes());
        key.extend_from_slice(e.name.as_bytes());
        key.extend_from_slice(&e.len.to_le_bytes());
        key.extend_from_slice(&e.flags.to_le_bytes());
        key.extend_from_slice(&e.deflated.map_or(u64::MAX, |d| d).to_le_bytes());
    }
    key
}

fn read_with(bytes: &[u8], cached: bool, extra: Option<&Extra<'_>>) -> Result<Archive> {
    // Every pickle starts with PROTO (0x80) from protocol 2 on; the legacy format is pickles.
    if bytes.first() == Some(&0x80) {
        return read_legacy(bytes);
    }
    let mut entries = zip::read_entries(bytes)?;
    let first = entries
        .first()
        .ok_or_else(|| Error::invalid("zip archive is empty, not a torch.save archive"))?;
    // torch takes the folder of the first record as the archive's prefix (`PyTorchStreamReader`).
    let prefix = match first.name.split_once('/') {
        Some((prefix, _)) => prefix.to_string(),
        None => {
            return Err(Error::invalid(format!(
                "zip record `{}` is not in a folder, so this is not a torch.save archive",
                first.name
            ))
            .at(first.data_offset))
        }
    };
    entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    let archive = Archive {
        prefix,
        entries,
        leaves: Vec::new(),
    };

    let pkl_name = format!("{}/data.pkl", archive.prefix);
    let Some(pkl) = archive.entry(&pkl_name) else {
        let mut err = Error::invalid(format!("no `{pkl_name}` record: not a torch.save archive"));
        if archive
            .entry(&format!("{}/constants.pkl", archive.prefix))
            .is_some()
        {
            err = err.hint("this looks like TorchScript (`torch.jit.save`); save the state dict with `torch.save(model.state_dict(), path)`");
        }
        return Err(err);
    };
    let byteorder = archive
        .entry(&format!("{}/byteorder", archive.prefix))
        .map(|e| zip::inflate(bytes, e).map(|order| (e, order)))
        .transpose()?;
    // Files without the record predate it and are little-endian, as torch.load assumes.
    if let Some((entry, order)) = byteorder {
        match &*order {
            b"little" => {}
            b"big" => {
                return Err(Error::invalid(
                    "archive was saved on a big-endian machine, which ckpt does not convert",
                )
                .at(entry.data_offset)
                .hint("load and re-save it with torch on a little-endian machine"))
            }
            _ => {
                return Err(
                    Error::invalid("unknown byte order in the `byteorder` record")
                        .at(entry.data_offset),
                )
            }
        }
    }

    check_records(bytes, &archive)?;

    let pkl_bytes = zip::inflate(bytes, pkl)?;
    let pkl_bytes = &*pkl_bytes;
    let key = cached.then(|| leaves_key(pkl_bytes, &archive.entries));
    if let Some(key) = &key {
        if let Some(leaves) = LEAVES.with(|c| c.borrow().get(key).cloned()) {
            return Ok(Archive { leaves, ..archive });
        }
    }
    let value = match extra {
        None => pickle::read(pkl_bytes, &TorchGlobals, Limits::default()),
        Some(extra) => pickle::read(pkl_bytes, &WithExtra(extra.globals), Limits::default())
            .map(|v| replace_objects(v, extra.plain)),
    }
    .map(|v| replace_objects(v, &counter_as_dict))
    .map_err(|e| pickle_error(e, &pkl_name, pkl.data_offset))?;
    // After the reader, so a hostile pickle meets its limits and names first.
    if let Some((opcode, at)) = opcode_torch_refuses(pkl_bytes) {
        return Err(Error::invalid(format!(
            "`{pkl_name}` uses pickle opcode 0x{opcode:02x}, which torch.load(weights_only=True) refuses"
        ))
        .at(pkl.data_offset.saturating_add(at as u64)));
    }
    check_calls(&value).map_err(|e| e.at(pkl.data_offset))?;

    let mut reader = Interpreter {
        archive: &archive,
        pkl_offset: pkl.data_offset,
        storages: HashMap::new(),
        leaves: Vec::new(),
        legacy: false,
    };
    reader.walk(&value, &mut Vec::new())?;
    let leaves = reader.leaves;
    if let Some(key) = key {
        LEAVES.with(|c| {
            let mut c = c.borrow_mut();
            if c.len() >= MAX_CACHED_LEAVES {
                c.clear();
            }
            c.insert(key, leaves.clone());
        });
    }
    Ok(Archive { leaves, ..archive })
}

/// `torch.serialization.MAGIC_NUMBER`, little-endian as a pickle's `LONG1` carries it.
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
/// `torch.serialization.PROTOCOL_VERSION`.
const LEGACY_PROTOCOL: i64 = 1001;

/// Read a legacy (pre-1.6, non-zip) torch.save file, as `torch.serialization._legacy_load`
/// reads it: five pickles back to back (the magic number, the protocol version, `sys_info`, the
/// object, the list of storage keys), then each listed storage as an 8-byte little-endian
/// element count and its bytes. Each storage becomes a record of the [`Archive`] (named as in
/// the zip format, `archive/data/{key}`) at its bytes' offset, so tensors are read in place
/// exactly as from a zip. Bytes after the last storage are ignored, as torch ignores them.
fn read_legacy(bytes: &[u8]) -> Result<Archive> {
    const PREFIX: &str = "archive";
    // One pickle at `at` with the weights-only unpickler's rules; the value and where it ends.
    let pickle_at = |at: usize, what: &str| -> Result<(Value, usize)> {
        let rest = bytes.get(at..).unwrap_or_default();
        // The reader takes less than 4 GiB; a pickle ends long before the storages do.
        let rest = &rest[..rest.len().min(u32::MAX as usize - 1)];
        let graph = pickle::parse(rest, &TorchGlobals, Limits::default())
            .map_err(|e| pickle_error(e, what, at as u64))?;
        let end = graph.end();
        let value = graph.root().to_value();
        if let Some((opcode, op_at)) = opcode_torch_refuses(&rest[..end]) {
            return Err(Error::invalid(format!(
                "{what} uses pickle opcode 0x{opcode:02x}, which torch.load(weights_only=True) refuses"
            ))
            .at((at + op_at) as u64));
        }
        check_calls(&value).map_err(|e| e.at(at as u64))?;
        Ok((value, at + end))
    };
    let (magic, at) = pickle_at(0, "the magic number pickle")?;
    if !matches!(&magic, Value::BigInt(b) if b.as_slice() == LEGACY_MAGIC) {
        return Err(Error::invalid(
            "legacy torch.save file has the wrong magic number (torch: \"Invalid magic number; corrupt file?\")",
        )
        .at(0));
    }
    let (protocol, protocol_end) = pickle_at(at, "the protocol version pickle")?;
    if protocol.as_int() != Some(LEGACY_PROTOCOL) || matches!(protocol, Value::Bool(_)) {
        return Err(Error::invalid(format!(
            "legacy torch.save file has protocol version {}, not {LEGACY_PROTOCOL}",
            protocol.to_json()
        ))
        .at(at as u64));
    }
    // `sys_info` (byte order, type sizes) is read but not used, as torch does.
    let (_, data_at) = pickle_at(protocol_end, "the sys_info pickle")?;
    let (value, keys_at) = pickle_at(data_at, "the data pickle")?;
    let (keys, mut offset) = pickle_at(keys_at, "the storage key list")?;
    let Some(keys) = keys.as_seq().filter(|_| matches!(keys, Value::List(_))) else {
        return Err(
            bad("the storage key list of a legacy torch.save file is not a list")
                .at(keys_at as u64),
        );
    };

    // The storages the object names, by key: a listed key must be one of them.
    let mut named = HashMap::new();
    collect_storage_ids(&value, &mut named).map_err(|e| e.at(data_at as u64))?;
    let mut entries = Vec::with_capacity(keys.len());
    for key in keys {
        let key = key
            .as_str()
            .ok_or_else(|| bad("a storage key is not a string").at(keys_at as u64))?;
        let &(kind, numel) = named.get(key).ok_or_else(|| {
            Error::invalid(format!(
                "storage `{key}` is listed but the object never refers to it (torch: \"storage key not found\")"
            ))
            .at(keys_at as u64)
        })?;
        let size = match kind {
            StorageKind::Typed(dtype) => dtype.size() as u64,
            StorageKind::Untyped => 1,
        };
        let head = bytes.get(offset..offset + 8).ok_or_else(|| {
            Error::invalid(format!("file ends before storage `{key}`")).at(offset as u64)
        })?;
        let saved = u64::from_le_bytes(head.try_into().unwrap_or_default());
        let nbytes = numel
            .checked_mul(size)
            .ok_or_else(|| bad(format!("storage `{key}` size overflows")))?;
        if saved.checked_mul(size) != Some(nbytes) {
            return Err(Error::invalid(format!(
                "storage `{key}` holds {saved} elements in the file but {numel} in the object (torch: \"storage has wrong byte size\")"
            ))
            .at(offset as u64));
        }
        let data_offset = offset as u64 + 8;
        let end = data_offset
            .checked_add(nbytes)
            .filter(|&e| e <= bytes.len() as u64)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "file ends inside storage `{key}` ({nbytes} bytes at {data_offset})"
                ))
                .at(data_offset)
                .hint("the file is truncated: copy it again")
            })?;
        entries.push(ZipEntry {
            name: format!("{PREFIX}/data/{key}"),
            data_offset,
            len: nbytes,
            flags: 0,
            deflated: None,
        });
        offset = end as usize;
    }
    entries.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    if let Some(pair) = entries.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(
            Error::invalid(format!("storage `{}` is listed twice", pair[1].name))
                .at(keys_at as u64),
        );
    }
    let archive = Archive {
        prefix: PREFIX.to_string(),
        entries,
        leaves: Vec::new(),
    };
    let mut reader = Interpreter {
        archive: &archive,
        pkl_offset: data_at as u64,
        storages: HashMap::new(),
        leaves: Vec::new(),
        legacy: true,
    };
    reader.walk(&value, &mut Vec::new())?;
    let leaves = reader.leaves;
    Ok(Archive { leaves, ..archive })
}

/// Every storage id (persistent id) in `value`, by key; two ids of one key must agree.
fn collect_storage_ids(value: &Value, out: &mut HashMap<String, (StorageKind, u64)>) -> Result<()> {
    match value {
        Value::PersistentId(pid) => {
            let (key, kind, numel) = storage_id(pid, true)?;
            if let Some(&seen) = out.get(&key) {
                if seen != (kind, numel) {
                    return Err(bad(format!(
                        "storage `{key}` is referenced as two different types or sizes"
                    )));
                }
            }
            out.insert(key, (kind, numel));
            Ok(())
        }
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().try_for_each(|v| collect_storage_ids(v, out))
        }
        Value::Dict(items) => items.iter().try_for_each(|(k, v)| {
            collect_storage_ids(k, out)?;
            collect_storage_ids(v, out)
        }),
        Value::Object(o) => {
            collect_storage_ids(&o.callable, out)?;
            o.args
                .iter()
                .try_for_each(|v| collect_storage_ids(v, out))?;
            o.list_items
                .iter()
                .try_for_each(|v| collect_storage_ids(v, out))?;
            o.dict_items.iter().try_for_each(|(k, v)| {
                collect_storage_ids(k, out)?;
                collect_storage_ids(v, out)
            })?;
            o.state
                .as_ref()
                .map_or(Ok(()), |s| collect_storage_ids(s, out))
        }
        _ => Ok(()),
    }
}

/// The records torch's reader parses before it unpickles anything, checked as it checks them
/// (`PyTorchStreamReader::init` and `torch.serialization._load`): an archive torch.load refuses
/// for one of them must not pass `verify`.
fn check_records(bytes: &[u8], archive: &Archive) -> Result<()> {
    // The full name is built only for a message.
    let named = |name: &'static str| archive.entry_in_prefix(name).map(|e| (name, e));
    let read_by_torch = [
        "data.pkl",
        ".format_version",
        "byteorder",
        ".storage_alignment",
        ".data/version",
        "version",
        ".data/serialization_id",
    ];
    for (_, entry) in read_by_torch.iter().filter_map(|n| named(n)) {
        readable(entry)?;
    }
    // A deflated record must inflate to its length, as miniz checks when torch reads it;
    // a storage's bytes are inflated again, in part, where a piece is copied.
    for entry in archive.entries.iter().filter(|e| e.deflated.is_some()) {
        zip::check_inflates(bytes, entry)?;
    }
    // `.data/version` wins over `version` when both exist, as in torch.
    let (name, entry) = named(".data/version")
        .or_else(|| named("version"))
        .ok_or_else(|| {
            Error::invalid(format!(
                "no `{}/version` record, which torch.load requires",
                archive.prefix
            ))
        })?;
    let content = zip::inflate(bytes, entry)?;
    let content = &*content;
    match stoll(content) {
        Some(v) if (MIN_FILE_VERSION..=MAX_FILE_VERSION).contains(&v) => {}
        parsed => {
            let shown = String::from_utf8_lossy(content);
            let why = match parsed {
                Some(v) => format!(
                    "version {v}, but torch.load reads versions {MIN_FILE_VERSION} to {MAX_FILE_VERSION}"
                ),
                None => "it is not a decimal integer".to_string(),
            };
            return Err(Error::invalid(format!(
                "record `{}/{name}` holds {shown:?}: {why}",
                archive.prefix
            ))
            .at(entry.data_offset));
        }
    }
    if let Some((name, entry)) = named(".storage_alignment") {
        let content = zip::inflate(bytes, entry)?;
        let content = &*content;
        if !is_python_int(content) {
            return Err(Error::invalid(format!(
                "record `{}/{name}` holds {:?}, which is not an integer",
                archive.prefix,
                String::from_utf8_lossy(content)
            ))
            .at(entry.data_offset));
        }
    }
    if let Some((name, entry)) = named(".data/serialization_id") {
        let content = zip::inflate(bytes, entry)?;
        let content = &*content;
        if let Err(e) = std::str::from_utf8(content) {
            return Err(
                Error::invalid(format!("record `{}/{name}` is not UTF-8", archive.prefix))
                    .at(entry.data_offset + e.valid_up_to() as u64),
            );
        }
    }
    Ok(())
}

/// The first opcode of `pkl` outside the set torch's weights-only unpickler runs
/// (`torch/_weights_only_unpickler.py`), with its offset: `FRAME`, `MEMOIZE`, `SHORT_BINUNICODE`,
/// `BINBYTES` and the rest of protocols 0, 1, 3-5 make torch.load refuse the file, though ckpt's
/// pickle reader, shared with DCP's `.metadata`, reads them. Run on a pickle that reader accepted,
/// so a truncated one (`None` here) does not occur.
fn opcode_torch_refuses(pkl: &[u8]) -> Option<(u8, usize)> {
    let mut at = 0;
    loop {
        let op = *pkl.get(at)?;
        let args = match op {
            // NEWOBJ REDUCE BUILD APPEND APPENDS SETITEM SETITEMS MARK TUPLE TUPLE1-3 NONE
            // NEWFALSE NEWTRUE EMPTY_TUPLE EMPTY_LIST EMPTY_DICT EMPTY_SET BINPERSID
            0x81 | b'R' | b'b' | b'a' | b'e' | b's' | b'u' | b'(' | b't' | 0x85 | 0x86 | 0x87
            | b'N' | 0x89 | 0x88 | b')' | b']' | b'}' | 0x8f | b'Q' => 0,
            b'.' => return None,            // STOP
            0x80 | b'K' | b'h' | b'q' => 1, // PROTO BININT1 BINGET BINPUT
            b'M' => 2,                      // BININT2
            b'J' | b'j' | b'r' => 4,        // BININT LONG_BINGET LONG_BINPUT
            b'G' => 8,                      // BINFLOAT
            b'X' => {
                // BINUNICODE
                let len = pkl.get(at + 1..at + 5)?;
                4 + u32::from_le_bytes(len.try_into().ok()?) as usize
            }
            b'U' | 0x8a => 1 + usize::from(*pkl.get(at + 1)?), // SHORT_BINSTRING LONG1
            b'c' => {
                // GLOBAL: module and name, each ending in a newline
                let rest = pkl.get(at + 1..)?;
                let first = rest.iter().position(|&b| b == b'\n')?;
                let second = rest.get(first + 1..)?.iter().position(|&b| b == b'\n')?;
                first + second + 2
            }
            _ => return Some((op, at)),
        };
        at = at.checked_add(1 + args)?;
    }
}

/// Refuse the calls torch's weights-only unpickler cannot make: it calls (`REDUCE`) or
/// instantiates (`NEWOBJ`) only an allowed global, so never a tuple or an `OrderedDict` instance,
/// and `torch.Size` takes at most one iterable of ints.
fn check_calls(value: &Value) -> Result<()> {
    match value {
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().try_for_each(check_calls)
        }
        Value::Dict(items) => items.iter().try_for_each(|(k, v)| {
            check_key(k)?;
            check_calls(k).and_then(|()| check_calls(v))
        }),
        Value::PersistentId(id) => check_calls(id),
        Value::Object(object) => {
            let Value::Global(global) = &object.callable else {
                if per_rank::is_process_group_state(&object.callable) {
                    object.args.iter().try_for_each(check_calls)?;
                    return object.state.as_ref().map_or(Ok(()), check_calls);
                }
                let what = if object.new_obj {
                    "`NEWOBJ`"
                } else {
                    "`REDUCE`"
                };
                return Err(bad(format!(
                    "{what} applies to {}, not a class or function, which torch.load(weights_only=True) refuses",
                    kind_name(&object.callable)
                )));
            };
            let (module, name) = (global.module.as_str(), global.name.as_str());
            match callable_kind(module, name) {
                Callable::Class => {}
                Callable::Function if !object.new_obj => {}
                kind => {
                    let (op, what) = match (object.new_obj, kind) {
                        (true, Callable::Function) => ("`NEWOBJ`", "a function, not a class"),
                        (true, _) => ("`NEWOBJ`", "not a class"),
                        _ => ("`REDUCE`", "not callable"),
                    };
                    return Err(bad(format!(
                        "{op} applies to `{module}.{name}`, {what}, which torch.load(weights_only=True) refuses"
                    )));
                }
            }
            if let Some(state) = &object.state {
                check_build(module, name, state)?;
            }
            match (module, name) {
                ("collections", "Counter") => {
                    return Err(bad(
                        "a `collections.Counter` made other than from one dict, which ckpt does not read",
                    ))
                }
                ("torch", "Size") => check_size_args(&object.args)?,
                ("_codecs", "encode") => check_encode_args(&object.args)?,
                ("builtins", "set") => check_set_args(&object.args)?,
                ("builtins", "bytearray") => check_bytearray_args(&object.args)?,
                ("builtins", "complex") => check_complex_args(&object.args)?,
                ("torch", "device") => check_device_args(&object.args)?,
                ("builtins", "getattr") => per_rank::check_getattr(&object.args)?,
                _ => {}
            }
            object.args.iter().try_for_each(check_calls)?;
            object.dict_items.iter().try_for_each(|(k, v)| {
                check_key(k)?;
                check_calls(k).and_then(|()| check_calls(v))
            })?;
            object.list_items.iter().try_for_each(check_calls)?;
            object.state.as_ref().map_or(Ok(()), check_calls)
        }
        _ => Ok(()),
    }
}

/// What an allowed global is to torch's weights-only unpickler: a class it may instantiate
/// (`NEWOBJ`) or call (`REDUCE`), a function it may only call, or neither (a dtype, a legacy
/// storage class: `'torch.dtype' object is not callable`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Callable {
    Class,
    Function,
    Neither,
}

fn callable_kind(module: &str, name: &str) -> Callable {
    match (module, name) {
        ("torch._utils" | "torch._tensor" | "_codecs" | "torch.serialization", _)
        | ("builtins", "getattr") => Callable::Function,
        ("torch", name)
            if DType::from_storage_class(name).is_some()
                || OTHER_STORAGE_CLASSES.contains(&name)
                || DType::from_torch_name(name).is_some()
                || OTHER_DTYPES.contains(&name) =>
        {
            Callable::Neither
        }
        // The classes of TorchGlobals and of the per-rank allow-list.
        _ => Callable::Class,
    }
}

/// `BUILD` as torch's weights-only unpickler applies it: an `OrderedDict` or an untyped storage
/// takes a dict into its `__dict__`; a set, bytearray, complex, `torch.Size` or device has no
/// `__dict__`, so only an empty state passes; bytes (`_codecs.encode`) cannot be built at all.
/// A tensor's state would re-point its storage (`Tensor.set_`), which ckpt does not follow.
fn check_build(module: &str, name: &str, state: &Value) -> Result<()> {
    fn empty(v: &Value) -> bool {
        match v {
            Value::None => true,
            Value::Bool(b) => !b,
            Value::Int(i) => *i == 0,
            Value::Str(s) => s.is_empty(),
            Value::Bytes(b) => b.is_empty(),
            Value::Tuple(items) | Value::List(items) | Value::Set(items) => items.is_empty(),
            Value::Dict(items) => items.is_empty(),
            _ => false,
        }
    }
    let ok = match (module, name) {
        ("collections", "OrderedDict") | ("torch.storage", "UntypedStorage") => {
            matches!(state, Value::Dict(_) | Value::None)
                || matches!(state, Value::Tuple(t) if t.is_empty())
        }
        ("builtins", _) | ("torch", "Size" | "device") => {
            empty(state) || matches!(state, Value::Tuple(t) if t.len() == 2 && t.iter().all(empty))
        }
        // What a function returns: a tensor (whose storage ckpt would not follow), bytes.
        ("torch._utils" | "torch._tensor" | "_codecs" | "torch.serialization", _) => false,
        // Dataclasses of other allow-lists (DTensorSpec, ...) take their `__dict__`.
        _ => true,
    };
    if ok {
        return Ok(());
    }
    Err(bad(format!(
        "`BUILD` gives {} to a `{module}.{name}` object, which torch.load(weights_only=True) cannot apply",
        kind_name(state)
    )))
}

/// `builtins.bytearray(*args)`: none, a count, bytes, a list of byte values, or a str with an
/// encoding. ckpt refuses what it cannot tell Python accepts.
fn check_bytearray_args(args: &[Value]) -> Result<()> {
    let ok = match args {
        [] => true,
        [Value::Int(n)] => *n >= 0,
        [Value::Bool(_) | Value::Bytes(_)] => true,
        [v] if made_bytes(v) => true,
        [Value::List(items) | Value::Tuple(items)] => items
            .iter()
            .all(|v| matches!(v, Value::Int(0..=255) | Value::Bool(_))),
        [Value::Str(_), Value::Str(_)] | [Value::Str(_), Value::Str(_), Value::Str(_)] => {
            check_encode_args(args).is_ok()
        }
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(bad(format!(
        "`builtins.bytearray` called with {} argument(s) ckpt cannot tell Python accepts",
        args.len()
    )))
}

/// `builtins.complex(real, imag)` of numbers, as torch.save writes complex values.
fn check_complex_args(args: &[Value]) -> Result<()> {
    let number = |v: &Value| matches!(v, Value::Int(_) | Value::Bool(_) | Value::Float(_));
    if args.len() <= 2 && args.iter().all(number) {
        return Ok(());
    }
    Err(bad(
        "`builtins.complex` called with arguments other than one or two numbers",
    ))
}

/// `torch.device(type)`, `torch.device("type:index")`, `torch.device(type, index)` or
/// `torch.device(index)`, as torch parses them.
fn check_device_args(args: &[Value]) -> Result<()> {
    const TYPES: &[&str] = &[
        "cpu",
        "cuda",
        "ipu",
        "xpu",
        "mkldnn",
        "opengl",
        "opencl",
        "ideep",
        "hip",
        "ve",
        "fpga",
        "maia",
        "xla",
        "lazy",
        "vulkan",
        "mps",
        "meta",
        "hpu",
        "mtia",
        "privateuseone",
    ];
    let index = |s: &str| {
        !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'))
            && s.parse::<i8>().is_ok()
    };
    let device = |s: &str| match s.split_once(':') {
        Some((t, i)) => TYPES.contains(&t) && index(i),
        None => TYPES.contains(&s),
    };
    let ok = match args {
        [Value::Str(s)] => device(s),
        [Value::Int(i)] => (0..=i64::from(i8::MAX)).contains(i),
        [Value::Str(s), Value::Int(i)] => {
            TYPES.contains(&s.as_str()) && (0..=i64::from(i8::MAX)).contains(i)
        }
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(bad(
        "`torch.device` called with arguments that do not name a device torch knows",
    ))
}

/// `builtins.set(*args)`: at most one argument, an iterable whose items Python can hash.
fn check_set_args(args: &[Value]) -> Result<()> {
    match args {
        [] | [Value::Dict(_) | Value::Str(_) | Value::SurrogateStr(_) | Value::Bytes(_)] => Ok(()),
        [Value::Tuple(items) | Value::List(items) | Value::Set(items)] => {
            items.iter().try_for_each(check_key)
        }
        [Value::Object(_) | Value::PersistentId(_)] => Ok(()),
        [other] => Err(bad(format!(
            "`builtins.set` called on {}, which is not iterable",
            kind_name(other)
        ))),
        _ => Err(bad(format!(
            "`builtins.set` called with {} arguments, but it takes at most one",
            args.len()
        ))),
    }
}

/// Refuse a dict key or set item Python cannot hash: a list, dict, set, bytearray or
/// `OrderedDict`, or a tuple holding one.
fn check_key(key: &Value) -> Result<()> {
    fn unhashable(v: &Value) -> Option<&'static str> {
        match v {
            Value::List(_) => Some("a list"),
            Value::Dict(_) => Some("a dict"),
            Value::Set(_) => Some("a set"),
            Value::Tuple(items) => items.iter().find_map(unhashable),
            Value::Object(o) => match o.callable.as_global() {
                Some(("builtins", "set")) => Some("a set"),
                Some(("builtins", "bytearray")) => Some("a bytearray"),
                Some(("collections", "OrderedDict")) => Some("an `OrderedDict`"),
                _ => None,
            },
            _ => None,
        }
    }
    match unhashable(key) {
        Some(what) => Err(bad(format!(
            "a dict key or set item is {what}, which Python cannot hash"
        ))),
        None => Ok(()),
    }
}

/// `torch.Size(*args)`, as far as the outcome is known without running it.
fn check_size_args(args: &[Value]) -> Result<()> {
    fn ints<'a>(mut items: impl Iterator<Item = &'a Value>) -> bool {
        // torch makes a `torch.Size` of an int past 64 bits too (it fails only when printed).
        items.all(|v| matches!(v, Value::Int(_) | Value::BigInt(_) | Value::Bool(_)))
    }
    let ok = match args {
        [] => true,
        [Value::Tuple(items) | Value::List(items) | Value::Set(items)] => ints(items.iter()),
        [Value::Dict(items)] => ints(items.iter().map(|(k, _)| k)),
        [Value::Str(s)] => s.is_empty(),
        [Value::None | Value::Int(_) | Value::Float(_) | Value::Bool(_)] => false,
        [_] => true,
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(bad(format!(
        "`torch.Size` called with {} argument(s) that are not one iterable of ints",
        args.len()
    )))
}

/// `_codecs.encode(obj, encoding="utf-8", errors="strict")`: refused when Python would not find
/// the codec (or is given no text for it), or would fail to encode `obj` with it: see
/// [`encodes`] for how far ckpt can tell.
fn check_encode_args(args: &[Value]) -> Result<()> {
    fn text(v: Option<&Value>) -> Option<Option<&str>> {
        match v {
            None => Some(None),
            Some(Value::Str(s)) => Some(Some(s.as_str())),
            // An encoding or handler name with a lone surrogate names nothing Python has.
            Some(Value::SurrogateStr(_)) => Some(Some("\u{fffd}")),
            Some(_) => None,
        }
    }
    let (Some(encoding), Some(errors)) = (text(args.get(1)), text(args.get(2))) else {
        return Err(bad(
            "`_codecs.encode` called with an encoding or errors that is not a str",
        ));
    };
    if args.is_empty() || args.len() > 3 {
        return Err(bad(format!(
            "`_codecs.encode` called with {} arguments",
            args.len()
        )));
    }
    let name = encoding.unwrap_or("utf-8");
    let Some(codec) = python_codec(name) else {
        return Err(bad(format!(
            "`_codecs.encode` names the unknown encoding {name:?}"
        )));
    };
    // Python's bytes-to-bytes codecs take bytes; its text codecs take str.
    let bytes_codec = BYTES_CODECS.contains(&codec);
    let fits = match args.first() {
        Some(Value::Str(s)) => !bytes_codec && encodes(codec, s.chars().map(u32::from), errors),
        Some(Value::SurrogateStr(b)) => {
            !bytes_codec && encodes(codec, surrogate_str_chars(b), errors)
        }
        Some(v) if made_bytes(v) => bytes_codec,
        _ => true,
    };
    if fits {
        return Ok(());
    }
    let what = match args.first() {
        Some(v) if made_bytes(v) => "bytes",
        Some(v) => kind_name(v),
        None => "nothing",
    };
    let errors = errors.unwrap_or("strict");
    Err(bad(format!(
        "`_codecs.encode` cannot encode {what} with {name:?} and errors {errors:?} (or ckpt cannot tell that Python can)"
    )))
}

/// Whether Python's text codec `codec` encodes the characters `chars` (code points, lone
/// surrogates included) with the error handler `errors`. Exact for the codecs pickles use
/// (latin-1, ascii, the UTF family, the escapes); for the other tables (cp1252, shift_jis, ...)
/// only ASCII is known to encode, so other text is refused unless a handler replaces what the
/// table lacks: the safe side, as ckpt must not call sound what torch.load refuses.
fn encodes(codec: &str, chars: impl Iterator<Item = u32>, errors: Option<&str>) -> bool {
    let is_surrogate = |c: u32| (0xd800..0xe000).contains(&c);
    let utf = matches!(
        codec,
        "utf_8"
            | "utf_8_sig"
            | "utf_16"
            | "utf_16_le"
            | "utf_16_be"
            | "utf_32"
            | "utf_32_le"
            | "utf_32_be"
    );
    let has = |c: u32| match codec {
        "undefined" => false,
        "latin_1" => c < 0x100,
        "ascii" => c < 0x80,
        "utf_7" | "unicode_escape" | "raw_unicode_escape" => true,
        _ if utf => !is_surrogate(c),
        _ => c < 0x80,
    };
    // idna refuses any handler but strict, whatever the text.
    if codec == "idna" && errors.is_some_and(|e| e != "strict") {
        return false;
    }
    let mut missing = chars.filter(|&c| !has(c)).peekable();
    if missing.peek().is_none() {
        return codec != "undefined";
    }
    // The handler is looked up only when a character is missing.
    match errors.unwrap_or("strict") {
        "ignore" | "replace" | "xmlcharrefreplace" | "backslashreplace" | "namereplace" => {
            codec != "undefined"
        }
        "surrogatepass" => utf && missing.all(is_surrogate),
        // Each of U+DC80..U+DCFF back to the byte it escaped, in byte-wise codecs.
        "surrogateescape" => {
            matches!(codec, "latin_1" | "ascii" | "utf_8" | "utf_8_sig")
                && missing.all(|c| (0xdc80..0xdd00).contains(&c))
        }
        _ => false,
    }
}

/// The code points of a str held as UTF-8 with lone surrogates (each as three bytes).
fn surrogate_str_chars(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let (&first, _) = rest.split_first()?;
        let len = match first {
            0x00..=0x7f => 1,
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            _ => 4,
        }
        .min(rest.len());
        let (head, tail) = rest.split_at(len);
        rest = tail;
        let mut c = u32::from(first) & (0x7f >> len.min(4));
        if len == 1 {
            c = u32::from(first);
        }
        for &b in &head[1..] {
            c = (c << 6) | u32::from(b & 0x3f);
        }
        Some(c)
    })
}

/// Whether `value` is bytes, or a call that makes bytes as protocol 2 spells them.
fn made_bytes(value: &Value) -> bool {
    match value {
        Value::Bytes(_) => true,
        Value::Object(o) => matches!(
            &o.callable,
            Value::Global(g) if matches!(
                (g.module.as_str(), g.name.as_str()),
                ("_codecs", "encode") | ("builtins", "bytearray")
            )
        ),
        _ => false,
    }
}

/// The codecs of the `encodings` package that encode bytes to bytes.
const BYTES_CODECS: &[&str] = &[
    "base64_codec",
    "bz2_codec",
    "hex_codec",
    "quopri_codec",
    "uu_codec",
    "zlib_codec",
];

/// The module of the `encodings` package that `codecs.lookup(name)` finds in Python 3.11, if any:
/// the name lowercased and normalized as `encodings.normalize_encoding` does, then an alias or a
/// module name.
fn python_codec(name: &str) -> Option<&'static str> {
    let mut norm = String::with_capacity(name.len());
    let mut punct = false;
    for c in name.chars() {
        if c.is_alphanumeric() || c == '.' {
            if punct && !norm.is_empty() {
                norm.push('_');
            }
            if c.is_ascii() {
                norm.push(c.to_ascii_lowercase());
            }
            punct = false;
        } else {
            punct = true;
        }
    }
    let alias = |n: &str| {
        PYTHON_CODEC_ALIASES
            .binary_search_by(|(a, _)| (*a).cmp(n))
            .ok()
            .map(|i| PYTHON_CODEC_ALIASES[i].1)
    };
    let aliased = alias(&norm).or_else(|| alias(&norm.replace('.', "_")));
    let module = |m: &str| PYTHON_CODECS.iter().copied().find(|&c| c == m);
    aliased.and_then(module).or_else(|| module(&norm))
}

// Generated from Python 3.11.7's `encodings` package.
/// The modules of Python's `encodings` package that `codecs.lookup` finds (Python 3.11, Linux).
const PYTHON_CODECS: &[&str] = &[
    "ascii",
    "base64_codec",
    "big5",
    "big5hkscs",
    "bz2_codec",
    "charmap",
    "cp037",
    "cp1006",
    "cp1026",
    "cp1125",
    "cp1140",
    "cp1250",
    "cp1251",
    "cp1252",
    "cp1253",
    "cp1254",
    "cp1255",
    "cp1256",
    "cp1257",
    "cp1258",
    "cp273",
    "cp424",
    "cp437",
    "cp500",
    "cp720",
    "cp737",
    "cp775",
    "cp850",
    "cp852",
    "cp855",
    "cp856",
    "cp857",
    "cp858",
    "cp860",
    "cp861",
    "cp862",
    "cp863",
    "cp864",
    "cp865",
    "cp866",
    "cp869",
    "cp874",
    "cp875",
    "cp932",
    "cp949",
    "cp950",
    "euc_jis_2004",
    "euc_jisx0213",
    "euc_jp",
    "euc_kr",
    "gb18030",
    "gb2312",
    "gbk",
    "hex_codec",
    "hp_roman8",
    "hz",
    "idna",
    "iso2022_jp",
    "iso2022_jp_1",
    "iso2022_jp_2",
    "iso2022_jp_2004",
    "iso2022_jp_3",
    "iso2022_jp_ext",
    "iso2022_kr",
    "iso8859_1",
    "iso8859_10",
    "iso8859_11",
    "iso8859_13",
    "iso8859_14",
    "iso8859_15",
    "iso8859_16",
    "iso8859_2",
    "iso8859_3",
    "iso8859_4",
    "iso8859_5",
    "iso8859_6",
    "iso8859_7",
    "iso8859_8",
    "iso8859_9",
    "johab",
    "koi8_r",
    "koi8_t",
    "koi8_u",
    "kz1048",
    "latin_1",
    "mac_arabic",
    "mac_croatian",
    "mac_cyrillic",
    "mac_farsi",
    "mac_greek",
    "mac_iceland",
    "mac_latin2",
    "mac_roman",
    "mac_romanian",
    "mac_turkish",
    "palmos",
    "ptcp154",
    "punycode",
    "quopri_codec",
    "raw_unicode_escape",
    "rot_13",
    "shift_jis",
    "shift_jis_2004",
    "shift_jisx0213",
    "tis_620",
    "undefined",
    "unicode_escape",
    "utf_16",
    "utf_16_be",
    "utf_16_le",
    "utf_32",
    "utf_32_be",
    "utf_32_le",
    "utf_7",
    "utf_8",
    "utf_8_sig",
    "uu_codec",
    "zlib_codec",
];
/// `encodings.aliases.aliases`: a normalized name and the module it means, sorted by name.
const PYTHON_CODEC_ALIASES: &[(&str, &str)] = &[
    ("037", "cp037"),
    ("1026", "cp1026"),
    ("1125", "cp1125"),
    ("1140", "cp1140"),
    ("1250", "cp1250"),
    ("1251", "cp1251"),
    ("1252", "cp1252"),
    ("1253", "cp1253"),
    ("1254", "cp1254"),
    ("1255", "cp1255"),
    ("1256", "cp1256"),
    ("1257", "cp1257"),
    ("1258", "cp1258"),
    ("273", "cp273"),
    ("424", "cp424"),
    ("437", "cp437"),
    ("500", "cp500"),
    ("646", "ascii"),
    ("775", "cp775"),
    ("850", "cp850"),
    ("852", "cp852"),
    ("855", "cp855"),
    ("857", "cp857"),
    ("858", "cp858"),
    ("860", "cp860"),
    ("861", "cp861"),
    ("862", "cp862"),
    ("863", "cp863"),
    ("864", "cp864"),
    ("865", "cp865"),
    ("866", "cp866"),
    ("869", "cp869"),
    ("8859", "latin_1"),
    ("932", "cp932"),
    ("936", "gbk"),
    ("949", "cp949"),
    ("950", "cp950"),
    ("ansi", "mbcs"),
    ("ansi_x3.4_1968", "ascii"),
    ("ansi_x3.4_1986", "ascii"),
    ("ansi_x3_4_1968", "ascii"),
    ("arabic", "iso8859_6"),
    ("asmo_708", "iso8859_6"),
    ("base64", "base64_codec"),
    ("base_64", "base64_codec"),
    ("big5_hkscs", "big5hkscs"),
    ("big5_tw", "big5"),
    ("bz2", "bz2_codec"),
    ("chinese", "gb2312"),
    ("cp1051", "hp_roman8"),
    ("cp1361", "johab"),
    ("cp154", "ptcp154"),
    ("cp367", "ascii"),
    ("cp65001", "utf_8"),
    ("cp819", "latin_1"),
    ("cp866u", "cp1125"),
    ("cp936", "gbk"),
    ("cp_gr", "cp869"),
    ("cp_is", "cp861"),
    ("csHPRoman8", "hp_roman8"),
    ("csascii", "ascii"),
    ("csbig5", "big5"),
    ("csibm037", "cp037"),
    ("csibm1026", "cp1026"),
    ("csibm273", "cp273"),
    ("csibm424", "cp424"),
    ("csibm500", "cp500"),
    ("csibm855", "cp855"),
    ("csibm857", "cp857"),
    ("csibm858", "cp858"),
    ("csibm860", "cp860"),
    ("csibm861", "cp861"),
    ("csibm863", "cp863"),
    ("csibm864", "cp864"),
    ("csibm865", "cp865"),
    ("csibm866", "cp866"),
    ("csibm869", "cp869"),
    ("csiso2022jp", "iso2022_jp"),
    ("csiso2022kr", "iso2022_kr"),
    ("csiso58gb231280", "gb2312"),
    ("csisolatin1", "latin_1"),
    ("csisolatin2", "iso8859_2"),
    ("csisolatin3", "iso8859_3"),
    ("csisolatin4", "iso8859_4"),
    ("csisolatin5", "iso8859_9"),
    ("csisolatin6", "iso8859_10"),
    ("csisolatinarabic", "iso8859_6"),
    ("csisolatincyrillic", "iso8859_5"),
    ("csisolatingreek", "iso8859_7"),
    ("csisolatinhebrew", "iso8859_8"),
    ("cskoi8r", "koi8_r"),
    ("cspc775baltic", "cp775"),
    ("cspc850multilingual", "cp850"),
    ("cspc862latinhebrew", "cp862"),
    ("cspc8codepage437", "cp437"),
    ("cspcp852", "cp852"),
    ("csptcp154", "ptcp154"),
    ("csshiftjis", "shift_jis"),
    ("cyrillic", "iso8859_5"),
    ("cyrillic_asian", "ptcp154"),
    ("dbcs", "mbcs"),
    ("ebcdic_cp_be", "cp500"),
    ("ebcdic_cp_ca", "cp037"),
    ("ebcdic_cp_ch", "cp500"),
    ("ebcdic_cp_he", "cp424"),
    ("ebcdic_cp_nl", "cp037"),
    ("ebcdic_cp_us", "cp037"),
    ("ebcdic_cp_wt", "cp037"),
    ("ecma_114", "iso8859_6"),
    ("ecma_118", "iso8859_7"),
    ("elot_928", "iso8859_7"),
    ("euc_cn", "gb2312"),
    ("euc_jis2004", "euc_jis_2004"),
    ("euccn", "gb2312"),
    ("eucgb2312_cn", "gb2312"),
    ("eucjis2004", "euc_jis_2004"),
    ("eucjisx0213", "euc_jisx0213"),
    ("eucjp", "euc_jp"),
    ("euckr", "euc_kr"),
    ("gb18030_2000", "gb18030"),
    ("gb2312_1980", "gb2312"),
    ("gb2312_80", "gb2312"),
    ("greek", "iso8859_7"),
    ("greek8", "iso8859_7"),
    ("hebrew", "iso8859_8"),
    ("hex", "hex_codec"),
    ("hkscs", "big5hkscs"),
    ("hz_gb", "hz"),
    ("hz_gb_2312", "hz"),
    ("hzgb", "hz"),
    ("ibm037", "cp037"),
    ("ibm039", "cp037"),
    ("ibm1026", "cp1026"),
    ("ibm1051", "hp_roman8"),
    ("ibm1125", "cp1125"),
    ("ibm1140", "cp1140"),
    ("ibm273", "cp273"),
    ("ibm367", "ascii"),
    ("ibm424", "cp424"),
    ("ibm437", "cp437"),
    ("ibm500", "cp500"),
    ("ibm775", "cp775"),
    ("ibm819", "latin_1"),
    ("ibm850", "cp850"),
    ("ibm852", "cp852"),
    ("ibm855", "cp855"),
    ("ibm857", "cp857"),
    ("ibm858", "cp858"),
    ("ibm860", "cp860"),
    ("ibm861", "cp861"),
    ("ibm862", "cp862"),
    ("ibm863", "cp863"),
    ("ibm864", "cp864"),
    ("ibm865", "cp865"),
    ("ibm866", "cp866"),
    ("ibm869", "cp869"),
    ("iso2022jp", "iso2022_jp"),
    ("iso2022jp_1", "iso2022_jp_1"),
    ("iso2022jp_2", "iso2022_jp_2"),
    ("iso2022jp_2004", "iso2022_jp_2004"),
    ("iso2022jp_3", "iso2022_jp_3"),
    ("iso2022jp_ext", "iso2022_jp_ext"),
    ("iso2022kr", "iso2022_kr"),
    ("iso646_us", "ascii"),
    ("iso8859", "latin_1"),
    ("iso8859_1", "latin_1"),
    ("iso_2022_jp", "iso2022_jp"),
    ("iso_2022_jp_1", "iso2022_jp_1"),
    ("iso_2022_jp_2", "iso2022_jp_2"),
    ("iso_2022_jp_2004", "iso2022_jp_2004"),
    ("iso_2022_jp_3", "iso2022_jp_3"),
    ("iso_2022_jp_ext", "iso2022_jp_ext"),
    ("iso_2022_kr", "iso2022_kr"),
    ("iso_646.irv_1991", "ascii"),
    ("iso_8859_1", "latin_1"),
    ("iso_8859_10", "iso8859_10"),
    ("iso_8859_10_1992", "iso8859_10"),
    ("iso_8859_11", "iso8859_11"),
    ("iso_8859_11_2001", "iso8859_11"),
    ("iso_8859_13", "iso8859_13"),
    ("iso_8859_14", "iso8859_14"),
    ("iso_8859_14_1998", "iso8859_14"),
    ("iso_8859_15", "iso8859_15"),
    ("iso_8859_16", "iso8859_16"),
    ("iso_8859_16_2001", "iso8859_16"),
    ("iso_8859_1_1987", "latin_1"),
    ("iso_8859_2", "iso8859_2"),
    ("iso_8859_2_1987", "iso8859_2"),
    ("iso_8859_3", "iso8859_3"),
    ("iso_8859_3_1988", "iso8859_3"),
    ("iso_8859_4", "iso8859_4"),
    ("iso_8859_4_1988", "iso8859_4"),
    ("iso_8859_5", "iso8859_5"),
    ("iso_8859_5_1988", "iso8859_5"),
    ("iso_8859_6", "iso8859_6"),
    ("iso_8859_6_1987", "iso8859_6"),
    ("iso_8859_7", "iso8859_7"),
    ("iso_8859_7_1987", "iso8859_7"),
    ("iso_8859_8", "iso8859_8"),
    ("iso_8859_8_1988", "iso8859_8"),
    ("iso_8859_9", "iso8859_9"),
    ("iso_8859_9_1989", "iso8859_9"),
    ("iso_celtic", "iso8859_14"),
    ("iso_ir_100", "latin_1"),
    ("iso_ir_101", "iso8859_2"),
    ("iso_ir_109", "iso8859_3"),
    ("iso_ir_110", "iso8859_4"),
    ("iso_ir_126", "iso8859_7"),
    ("iso_ir_127", "iso8859_6"),
    ("iso_ir_138", "iso8859_8"),
    ("iso_ir_144", "iso8859_5"),
    ("iso_ir_148", "iso8859_9"),
    ("iso_ir_157", "iso8859_10"),
    ("iso_ir_166", "tis_620"),
    ("iso_ir_199", "iso8859_14"),
    ("iso_ir_226", "iso8859_16"),
    ("iso_ir_58", "gb2312"),
    ("iso_ir_6", "ascii"),
    ("jisx0213", "euc_jis_2004"),
    ("korean", "euc_kr"),
    ("ks_c_5601", "euc_kr"),
    ("ks_c_5601_1987", "euc_kr"),
    ("ks_x_1001", "euc_kr"),
    ("ksc5601", "euc_kr"),
    ("ksx1001", "euc_kr"),
    ("kz_1048", "kz1048"),
    ("l1", "latin_1"),
    ("l10", "iso8859_16"),
    ("l2", "iso8859_2"),
    ("l3", "iso8859_3"),
    ("l4", "iso8859_4"),
    ("l5", "iso8859_9"),
    ("l6", "iso8859_10"),
    ("l7", "iso8859_13"),
    ("l8", "iso8859_14"),
    ("l9", "iso8859_15"),
    ("latin", "latin_1"),
    ("latin1", "latin_1"),
    ("latin10", "iso8859_16"),
    ("latin2", "iso8859_2"),
    ("latin3", "iso8859_3"),
    ("latin4", "iso8859_4"),
    ("latin5", "iso8859_9"),
    ("latin6", "iso8859_10"),
    ("latin7", "iso8859_13"),
    ("latin8", "iso8859_14"),
    ("latin9", "iso8859_15"),
    ("mac_centeuro", "mac_latin2"),
    ("maccentraleurope", "mac_latin2"),
    ("maccyrillic", "mac_cyrillic"),
    ("macgreek", "mac_greek"),
    ("maciceland", "mac_iceland"),
    ("macintosh", "mac_roman"),
    ("maclatin2", "mac_latin2"),
    ("macroman", "mac_roman"),
    ("macturkish", "mac_turkish"),
    ("ms1361", "johab"),
    ("ms932", "cp932"),
    ("ms936", "gbk"),
    ("ms949", "cp949"),
    ("ms950", "cp950"),
    ("ms_kanji", "cp932"),
    ("mskanji", "cp932"),
    ("pt154", "ptcp154"),
    ("quopri", "quopri_codec"),
    ("quoted_printable", "quopri_codec"),
    ("quotedprintable", "quopri_codec"),
    ("r8", "hp_roman8"),
    ("rk1048", "kz1048"),
    ("roman8", "hp_roman8"),
    ("rot13", "rot_13"),
    ("ruscii", "cp1125"),
    ("s_jis", "shift_jis"),
    ("s_jis_2004", "shift_jis_2004"),
    ("s_jisx0213", "shift_jisx0213"),
    ("shiftjis", "shift_jis"),
    ("shiftjis2004", "shift_jis_2004"),
    ("shiftjisx0213", "shift_jisx0213"),
    ("sjis", "shift_jis"),
    ("sjis_2004", "shift_jis_2004"),
    ("sjisx0213", "shift_jisx0213"),
    ("strk1048_2002", "kz1048"),
    ("thai", "iso8859_11"),
    ("tis620", "tis_620"),
    ("tis_620_0", "tis_620"),
    ("tis_620_2529_0", "tis_620"),
    ("tis_620_2529_1", "tis_620"),
    ("u16", "utf_16"),
    ("u32", "utf_32"),
    ("u7", "utf_7"),
    ("u8", "utf_8"),
    ("u_jis", "euc_jp"),
    ("uhc", "cp949"),
    ("ujis", "euc_jp"),
    ("unicode_1_1_utf_7", "utf_7"),
    ("unicodebigunmarked", "utf_16_be"),
    ("unicodelittleunmarked", "utf_16_le"),
    ("us", "ascii"),
    ("us_ascii", "ascii"),
    ("utf", "utf_8"),
    ("utf16", "utf_16"),
    ("utf32", "utf_32"),
    ("utf7", "utf_7"),
    ("utf8", "utf_8"),
    ("utf8_ucs2", "utf_8"),
    ("utf8_ucs4", "utf_8"),
    ("utf_16be", "utf_16_be"),
    ("utf_16le", "utf_16_le"),
    ("utf_32be", "utf_32_be"),
    ("utf_32le", "utf_32_le"),
    ("uu", "uu_codec"),
    ("windows_1250", "cp1250"),
    ("windows_1251", "cp1251"),
    ("windows_1252", "cp1252"),
    ("windows_1253", "cp1253"),
    ("windows_1254", "cp1254"),
    ("windows_1255", "cp1255"),
    ("windows_1256", "cp1256"),
    ("windows_1257", "cp1257"),
    ("windows_1258", "cp1258"),
    ("x_mac_japanese", "shift_jis"),
    ("x_mac_korean", "euc_kr"),
    ("x_mac_simp_chinese", "gb2312"),
    ("x_mac_trad_chinese", "big5"),
    ("zip", "zlib_codec"),
    ("zlib", "zlib_codec"),
];

/// What `value` is, with its article, for messages.
fn kind_name(value: &Value) -> &'static str {
    match value {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::BigInt(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) | Value::SurrogateStr(_) => "a str",
        Value::Bytes(_) => "bytes",
        Value::Tuple(_) => "a tuple",
        Value::List(_) => "a list",
        Value::Dict(_) => "a dict",
        Value::Set(_) => "a set",
        Value::Global(_) => "a global",
        Value::Object(_) => "an object instance",
        Value::PersistentId(_) => "a persistent id",
    }
}

/// Refuse a record that miniz opens but will not read (see [`zip::FLAGS_UNREADABLE`]).
fn readable(entry: &ZipEntry) -> Result<()> {
    let bits = entry.flags & zip::FLAGS_UNREADABLE;
    if bits == 0 {
        return Ok(());
    }
    let what = if bits & 0x0040 != 0 {
        "bit 6, strong encryption"
    } else {
        "bit 5, compressed patch data"
    };
    Err(Error::invalid(format!(
        "zip entry `{}` has general-purpose flag {what}, so torch.load cannot read it",
        entry.name
    ))
    .at(entry.data_offset))
}

/// The file format versions torch 2.15 reads (`kMinSupportedFileFormatVersion`,
/// `kMaxSupportedFileFormatVersion`).
const MIN_FILE_VERSION: i64 = 1;
const MAX_FILE_VERSION: i64 = 10;

/// `std::stoll` as torch parses the version record: leading whitespace, a sign, then the longest
/// run of decimal digits (anything after it is ignored); `None` without digits or on overflow.
fn stoll(bytes: &[u8]) -> Option<i64> {
    let rest = match bytes.iter().position(|b| !b" \t\n\x0b\x0c\r".contains(b)) {
        Some(i) => &bytes[i..],
        None => return None,
    };
    let (negative, rest) = match rest.split_first() {
        Some((b'-', r)) => (true, r),
        Some((b'+', r)) => (false, r),
        _ => (false, rest),
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let magnitude = std::str::from_utf8(&rest[..digits]).ok()?;
    let v: i128 = magnitude.parse().ok()?;
    i64::try_from(if negative { -v } else { v }).ok()
}

/// Whether Python's `int(bytes)` accepts `bytes` (how torch reads `.storage_alignment`): ASCII
/// whitespace around an optional sign and decimal digits, single underscores between digits.
fn is_python_int(bytes: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return false;
    };
    let text = text.trim_matches(|c: char| c.is_ascii_whitespace() || c == '\x0b');
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    !digits.is_empty()
        && !digits.starts_with('_')
        && !digits.ends_with('_')
        && !digits.contains("__")
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_')
}

/// The globals `data.pkl` may name: tensor rebuild functions, storage and dtype names, and the
/// few classes plain data pickles through. Naming one runs nothing; the tree only records it.
pub struct TorchGlobals;

impl Globals for TorchGlobals {
    fn allows(&self, module: &str, name: &str) -> bool {
        if per_rank::allows_global(module, name) {
            return true;
        }
        match module {
            "torch._utils" => matches!(
                name,
                "_rebuild_tensor_v2"
                    | "_rebuild_tensor_v3"
                    | "_rebuild_parameter"
                    | "_rebuild_parameter_with_state"
            ),
            "torch.storage" => name == "UntypedStorage",
            // Storage classes and dtypes ckpt cannot hold are let through so that the error can
            // say "unsupported dtype" rather than "not allowed".
            "torch" => {
                matches!(name, "Size" | "device")
                    || DType::from_storage_class(name).is_some()
                    || OTHER_STORAGE_CLASSES.contains(&name)
                    || DType::from_torch_name(name).is_some()
                    || OTHER_DTYPES.contains(&name)
            }
            // A `Counter` is read as the dict it is (see `counters_as_dicts`).
            "collections" => matches!(name, "OrderedDict" | "Counter"),
            // How protocol 2 spells bytes, sets and complex numbers.
            "_codecs" => name == "encode",
            // Not `frozenset`: torch's weights-only unpickler refuses it.
            "builtins" => matches!(name, "set" | "bytearray" | "complex"),
            _ => false,
        }
    }
}

/// [`TorchGlobals`] and the classes of an [`Extra`].
struct WithExtra<'a>(&'a dyn Globals);

impl Globals for WithExtra<'_> {
    fn allows(&self, module: &str, name: &str) -> bool {
        TorchGlobals.allows(module, name) || self.0.allows(module, name)
    }
}

/// `collections.Counter(d)` (how a Counter pickles: `REDUCE` of the class on one dict), or an
/// empty `Counter()`, as the dict it is; torch's weights-only reader loads it, and a dict of the
/// same items compares equal to it. Any other Counter is left for [`check_calls`] to refuse.
fn counter_as_dict(object: &Object) -> Option<Value> {
    if object.callable.as_global() != Some(("collections", "Counter"))
        || object.new_obj
        || object.state.is_some()
        || !object.dict_items.is_empty()
        || !object.list_items.is_empty()
    {
        return None;
    }
    match object.args.as_slice() {
        [] => Some(Value::Dict(Vec::new())),
        [items @ Value::Dict(_)] => Some(items.clone()),
        _ => None,
    }
}

/// `value` with every object `plain` turns into data replaced by it, depth first.
fn replace_objects(value: Value, plain: &dyn Fn(&Object) -> Option<Value>) -> Value {
    match value {
        Value::Object(object) => match plain(&object) {
            Some(v) => replace_objects(v, plain),
            None => Value::Object(object).map_children(&mut |v| replace_objects(v, plain)),
        },
        other => other.map_children(&mut |v| replace_objects(v, plain)),
    }
}

/// torch storage classes for dtypes ckpt does not support.
const OTHER_STORAGE_CLASSES: &[&str] = &[
    "QInt8Storage",
    "QUInt8Storage",
    "QInt32Storage",
    "QUInt4x2Storage",
    "QUInt2x4Storage",
];

/// torch dtypes ckpt does not support (a saved `torch.bits8` in plain data is still fine).
const OTHER_DTYPES: &[&str] = &[
    "bcomplex32",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits8",
    "bits16",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
];

/// How a storage's persistent id names its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StorageKind {
    /// A legacy class (`torch.FloatStorage`): the dtype, `numel` in elements.
    Typed(DType),
    /// `torch.storage.UntypedStorage`: `numel` in bytes, the dtype comes from the tensor.
    Untyped,
}

impl StorageKind {
    fn nbytes(self, numel: u64) -> Option<u64> {
        match self {
            StorageKind::Typed(dtype) => numel.checked_mul(dtype.size() as u64),
            StorageKind::Untyped => Some(numel),
        }
    }
}

/// Turns the unpickled tree into leaves, checking every tensor against its storage record.
struct Interpreter<'a> {
    archive: &'a Archive,
    /// Where `data.pkl`'s bytes start, for error offsets.
    pkl_offset: u64,
    /// Each storage key seen, with how it was named, so every reference must agree.
    storages: HashMap<String, (StorageKind, u64)>,
    leaves: Vec<(Vec<KeyPart>, Leaf)>,
    /// A legacy file: storage ids carry a sixth item, `view_metadata`.
    legacy: bool,
}

impl Interpreter<'_> {
    fn walk(&mut self, value: &Value, path: &mut Vec<KeyPart>) -> Result<()> {
        if let Some(name) = unsupported_dtype(value) {
            let dtype = format!("torch.{name}");
            self.leaves
                .push((path.clone(), Leaf::Unsupported { dtype }));
            return Ok(());
        }
        let sharded = per_rank::decode(value, &mut |t| match rebuild_function(t) {
            Some(kind) => self.tensor(t, kind),
            None => Err(bad("a tensor subclass's local tensor is not a tensor")),
        });
        if let Some(leaf) = sharded.map_err(|e| self.locate(e, path))? {
            self.leaves.push((path.clone(), Leaf::Sharded(leaf)));
            return Ok(());
        }
        if let Some(rebuild) = rebuild_function(value) {
            let tensor = self
                .tensor(value, rebuild)
                .map_err(|e| self.locate(e, path))?;
            self.leaves.push((path.clone(), Leaf::Tensor(tensor)));
            return Ok(());
        }
        if let Some(items) = dict_items(value) {
            let keys: Option<Vec<KeyPart>> = items.iter().map(|(k, _)| key_part(k)).collect();
            // An empty dict stays a value, so it survives the trip (optimizer state before step 1).
            if let Some(keys) = keys.filter(|k| !k.is_empty()) {
                for (key, (_, item)) in keys.into_iter().zip(items) {
                    path.push(key);
                    self.walk(item, path)?;
                    path.pop();
                }
                return Ok(());
            }
        }
        // A list or tuple holding tensors flattens as DCP flattens it: item `i` of `a` is `a.i`
        // (and is written back as a list).
        if let (Value::List(items) | Value::Tuple(items), true) = (value, holds_storage(value)) {
            for (i, item) in items.iter().enumerate() {
                path.push(KeyPart::Index(i as i64));
                self.walk(item, path)?;
                path.pop();
            }
            return Ok(());
        }
        if holds_storage(value) {
            return Err(self.locate(
                Error::invalid(
                    "tensors inside an object other than a dict, list or tuple are not supported",
                ),
                path,
            ));
        }
        self.leaves.push((path.clone(), Leaf::Value(value.clone())));
        Ok(())
    }

    /// Name the key path in an error about it, and point at `data.pkl`.
    fn locate(&self, err: Error, path: &[KeyPart]) -> Error {
        let err = if path.is_empty() {
            err
        } else {
            err.tensor(join_path(path))
        };
        err.at(self.pkl_offset)
    }

    fn tensor(&mut self, call: &Value, rebuild: Rebuild) -> Result<SavedTensor> {
        let Value::Object(object) = call else {
            return Err(bad("tensor is not a call"));
        };
        let args = &object.args;
        match rebuild {
            Rebuild::Parameter => {
                let inner = args
                    .first()
                    .ok_or_else(|| bad("parameter without arguments"))?;
                match rebuild_function(inner) {
                    Some(kind @ (Rebuild::V2 | Rebuild::V3)) => self.tensor(inner, kind),
                    _ => Err(bad("parameter does not wrap a tensor")),
                }
            }
            Rebuild::V2 | Rebuild::V3 => self.view(args, rebuild == Rebuild::V3),
        }
    }

    /// `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])` or
    /// `_rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype[, metadata])`.
    fn view(&mut self, args: &[Value], v3: bool) -> Result<SavedTensor> {
        let fixed = if v3 { 7 } else { 6 };
        if args.len() != fixed && args.len() != fixed + 1 {
            return Err(bad(format!(
                "tensor rebuild takes {fixed} or {} arguments, not {}",
                fixed + 1,
                args.len()
            )));
        }
        // torch sets tensor metadata only for features ckpt cannot carry (e.g. conjugate views).
        match args.get(fixed) {
            None | Some(Value::None) => {}
            Some(Value::Dict(items)) if items.is_empty() => {}
            Some(other) => {
                return Err(Error::invalid(format!(
                    "tensor carries metadata {other:?}, which ckpt does not support"
                )))
            }
        }
        let (key, kind, numel_field) = storage_ref(args.first(), self.legacy)?;
        let storage_offset = nonneg(args.get(1), "storage offset")?;
        let shape = dims(args.get(2), "size")?;
        let strides = dims(args.get(3), "stride")?;
        if shape.len() != strides.len() {
            return Err(bad(format!(
                "tensor has {} sizes but {} strides",
                shape.len(),
                strides.len()
            )));
        }
        let dtype = match (kind, v3.then(|| args.get(6))) {
            (_, Some(Some(Value::Global(global)))) if global.module == "torch" => {
                let name = &global.name;
                let dtype = DType::from_torch_name(name).ok_or_else(|| {
                    Error::invalid(format!("tensor dtype `torch.{name}` is not supported"))
                })?;
                if matches!(kind, StorageKind::Typed(d) if d != dtype) {
                    return Err(bad(format!(
                        "tensor of dtype `torch.{name}` over a storage of another dtype"
                    )));
                }
                dtype
            }
            (_, Some(_)) => return Err(bad("tensor dtype is not a `torch` dtype")),
            (StorageKind::Typed(dtype), None) => dtype,
            // What torch's `_rebuild_tensor_v2` makes of an untyped storage: bytes.
            (StorageKind::Untyped, None) => DType::U8,
        };

        let (storage_numel, entry_offset) = self.storage(&key, kind, numel_field, dtype)?;
        check_view(storage_offset, &shape, &strides, storage_numel)
            .map_err(|e| e.at(entry_offset))?;
        Ok(SavedTensor {
            dtype,
            shape,
            strides,
            storage_offset,
            storage_key: key,
            storage_numel,
        })
    }

    /// Check storage `key` against its record and earlier references; returns its length in
    /// elements of `dtype` and where its record's data starts.
    fn storage(
        &mut self,
        key: &str,
        kind: StorageKind,
        numel: u64,
        dtype: DType,
    ) -> Result<(u64, u64)> {
        match self.storages.get(key) {
            Some(&seen) if seen != (kind, numel) => {
                return Err(bad(format!(
                    "storage `{key}` is referenced as two different types or sizes"
                )))
            }
            Some(_) => {}
            None => {
                self.storages.insert(key.to_string(), (kind, numel));
            }
        }
        let entry = self.archive.storage(key).ok_or_else(|| {
            Error::invalid(format!(
                "storage `{key}` has no record `{}/data/{key}`",
                self.archive.prefix
            ))
        })?;
        readable(entry)?;
        let nbytes = kind
            .nbytes(numel)
            .ok_or_else(|| bad(format!("storage `{key}` size overflows")))?;
        if nbytes != entry.len {
            return Err(Error::invalid(format!(
                "storage `{key}` should be {nbytes} bytes but its record has {}",
                entry.len
            ))
            .at(entry.data_offset));
        }
        let size = dtype.size() as u64;
        if nbytes % size != 0 {
            return Err(Error::invalid(format!(
                "storage `{key}` of {nbytes} bytes is not a whole number of {dtype} elements"
            ))
            .at(entry.data_offset));
        }
        Ok((nbytes / size, entry.data_offset))
    }
}

/// Which rebuild function a value calls, if it is a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rebuild {
    V2,
    V3,
    Parameter,
}

fn rebuild_function(value: &Value) -> Option<Rebuild> {
    let Value::Object(object) = value else {
        return None;
    };
    match object.callable.as_global()? {
        ("torch._utils", "_rebuild_tensor_v2") => Some(Rebuild::V2),
        ("torch._utils", "_rebuild_tensor_v3") => Some(Rebuild::V3),
        ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
            Some(Rebuild::Parameter)
        }
        _ => None,
    }
}

/// The dtype a `_rebuild_tensor_v3` call (or a parameter wrapping one) names, when it is a torch
/// dtype ckpt does not support.
fn unsupported_dtype(value: &Value) -> Option<&str> {
    let Value::Object(object) = value else {
        return None;
    };
    match rebuild_function(value)? {
        Rebuild::Parameter => unsupported_dtype(object.args.first()?),
        Rebuild::V2 => None,
        Rebuild::V3 => match object.args.get(6)?.as_global()? {
            ("torch", name) if DType::from_torch_name(name).is_none() => Some(name),
            _ => None,
        },
    }
}

/// The items of a dict or of an `OrderedDict()` (whose items follow its creation, and whose
/// state, a module's `_metadata`, is dropped: safetensors and DCP cannot hold it either).
fn dict_items(value: &Value) -> Option<&[(Value, Value)]> {
    match value {
        Value::Dict(items) => Some(items),
        Value::Object(object)
            if object.callable.as_global() == Some(("collections", "OrderedDict"))
                && object.args.is_empty()
                && object.list_items.is_empty() =>
        {
            Some(&object.dict_items)
        }
        _ => None,
    }
}

fn key_part(key: &Value) -> Option<KeyPart> {
    match key {
        Value::Str(s) => Some(KeyPart::Key(s.clone())),
        Value::Int(i) => Some(KeyPart::IntKey(*i)),
        _ => None,
    }
}

/// True if a storage reference hides anywhere in `value`.
fn holds_storage(value: &Value) -> bool {
    match value {
        Value::PersistentId(_) => true,
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().any(holds_storage)
        }
        Value::Dict(items) => items
            .iter()
            .any(|(k, v)| holds_storage(k) || holds_storage(v)),
        Value::Object(object) => {
            holds_storage(&object.callable)
                || object.args.iter().any(holds_storage)
                || object
                    .dict_items
                    .iter()
                    .any(|(k, v)| holds_storage(k) || holds_storage(v))
                || object.list_items.iter().any(holds_storage)
                || object.state.as_ref().is_some_and(holds_storage)
        }
        _ => false,
    }
}

/// `('storage', storage_type, key, location, numel)`.
fn storage_ref(value: Option<&Value>, legacy: bool) -> Result<(String, StorageKind, u64)> {
    let Some(Value::PersistentId(pid)) = value else {
        return Err(bad("tensor storage is not a persistent id"));
    };
    storage_id(pid, legacy)
}

/// `('storage', type, key, location, numel)`, or in a legacy file the same with a sixth item,
/// `view_metadata`, which torch < 1.0 set for storage views and ckpt supports only as `None`.
fn storage_id(pid: &Value, legacy: bool) -> Result<(String, StorageKind, u64)> {
    let fields = match (pid.as_seq(), legacy) {
        (Some([tag, class, key, location, numel]), false) => [tag, class, key, location, numel],
        (Some([tag, class, key, location, numel, Value::None]), true) => {
            [tag, class, key, location, numel]
        }
        (Some([_, _, _, _, _, _]), true) => {
            return Err(Error::invalid(
                "legacy storage id carries a view of another storage (torch < 1.0), which ckpt does not support",
            ))
        }
        (_, false) => {
            return Err(bad(
                "storage persistent id is not `('storage', type, key, location, numel)`",
            ))
        }
        (_, true) => {
            return Err(bad(
                "storage persistent id is not `('storage', type, key, location, numel, view_metadata)`",
            ))
        }
    };
    let [tag, class, key, _location, numel] = fields;
    if tag.as_str() != Some("storage") {
        return Err(bad("storage persistent id does not start with `storage`"));
    }
    let kind = match class.as_global() {
        Some(("torch.storage", "UntypedStorage")) => StorageKind::Untyped,
        Some(("torch", name)) => match DType::from_storage_class(name) {
            Some(dtype) => StorageKind::Typed(dtype),
            None => {
                return Err(Error::invalid(format!(
                    "tensor storage `torch.{name}` holds a dtype ckpt does not support"
                )))
            }
        },
        _ => return Err(bad("storage type is not a torch storage class")),
    };
    let key = key
        .as_str()
        .ok_or_else(|| bad("storage key is not a string"))?
        .to_string();
    let numel = nonneg(Some(numel), "storage size")?;
    Ok((key, kind, numel))
}

/// A size or stride tuple (also accepted as `torch.Size(...)`).
fn dims(value: Option<&Value>, what: &str) -> Result<Vec<u64>> {
    let items = match value {
        Some(Value::Object(object)) if object.callable.as_global() == Some(("torch", "Size")) => {
            object.args.first().and_then(Value::as_seq)
        }
        Some(v) => v.as_seq(),
        None => None,
    };
    let items = items.ok_or_else(|| bad(format!("tensor {what} is not a tuple")))?;
    items.iter().map(|v| nonneg(Some(v), what)).collect()
}

fn nonneg(value: Option<&Value>, what: &str) -> Result<u64> {
    match value {
        Some(Value::Int(i)) => {
            u64::try_from(*i).map_err(|_| bad(format!("tensor {what} {i} is negative")))
        }
        _ => Err(bad(format!("tensor {what} is not an integer"))),
    }
}

/// Every element the view reaches must lie inside the storage.
fn check_view(offset: u64, shape: &[u64], strides: &[u64], storage_numel: u64) -> Result<()> {
    let count = numel(shape).ok_or_else(|| bad("tensor element count overflows"))?;
    if count == 0 {
        return Ok(());
    }
    let last = shape
        .iter()
        .zip(strides)
        .try_fold(offset, |acc, (&size, &stride)| {
            acc.checked_add((size - 1).checked_mul(stride)?)
        });
    match last {
        Some(last) if last < storage_numel => Ok(()),
        _ => Err(Error::invalid(format!(
            "tensor view (offset {offset}, size {shape:?}, stride {strides:?}) reaches past its storage of {storage_numel} elements"
        ))),
    }
}

/// A pickle error as an archive error, its offset moved from the pickle to the archive.
fn pickle_error(err: PickleError, name: &str, pkl_offset: u64) -> Error {
    let (message, offset) = match &err {
        PickleError::ForbiddenGlobal { .. } => (format!("`{name}`: {err}"), None),
        PickleError::UnsupportedOpcode { opcode, offset } => (
            format!("`{name}` uses unsupported pickle opcode 0x{opcode:02x}"),
            Some(offset),
        ),
        PickleError::Truncated { offset } => (format!("`{name}` ends early"), Some(offset)),
        PickleError::Malformed { offset, reason } => {
            (format!("malformed `{name}`: {reason}"), Some(offset))
        }
        PickleError::LimitExceeded { offset, reason } => (
            format!("`{name}` exceeds a safety limit: {reason}"),
            Some(offset),
        ),
        PickleError::Stopped { offset } => (format!("reading `{name}` stopped"), Some(offset)),
    };
    let at = offset.map_or(pkl_offset, |&o| pkl_offset.saturating_add(o as u64));
    Error::invalid(message).at(at)
}

#[cfg(test)]
mod tests {
    use super::super::write::tensor_value;
    use super::*;
    use proptest::prelude::*;

    const VIEWS: &[u8] = include_bytes!("../testdata/views.pt");
    const DTYPES: &[u8] = include_bytes!("../testdata/dtypes.pt");
    const BARE: &[u8] = include_bytes!("../testdata/bare.pt");
    const NESTED: &[u8] = include_bytes!("../testdata/nested.pt");
    const LEGACY: &[u8] = include_bytes!("../testdata/legacy.pt");

    fn key(k: &str) -> KeyPart {
        KeyPart::Key(k.to_string())
    }

    fn path(parts: &[&str]) -> Vec<KeyPart> {
        parts.iter().map(|p| key(p)).collect()
    }

    fn tensor(leaf: &Leaf) -> &SavedTensor {
        match leaf {
            Leaf::Tensor(t) => t,
            other => panic!("expected a tensor, got {other:?}"),
        }
    }

    fn saved(
        dtype: DType,
        shape: &[u64],
        strides: &[u64],
        offset: u64,
        key: &str,
        numel: u64,
    ) -> SavedTensor {
        SavedTensor {
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            storage_offset: offset,
            storage_key: key.to_string(),
            storage_numel: numel,
        }
    }

    /// An archive from records, storages filled from `data` in order.
    fn archive(prefix: &str, pkl: Vec<u8>, storages: &[(&str, &[u8])]) -> Vec<u8> {
        let sizes: Vec<(String, u64)> = storages
            .iter()
            .map(|(k, d)| (k.to_string(), d.len() as u64))
            .collect();
        let fill: Vec<&[u8]> = storages.iter().map(|(_, d)| *d).collect();
        zip::build(&records(prefix, pkl, &sizes), &fill).unwrap()
    }

    fn obj(module: &str, name: &str, args: Vec<Value>) -> Value {
        Value::reduce(module, name, args)
    }

    /// A hand-built `_rebuild_tensor_v2` call, for the cases torch never writes.
    fn v2(class: &str, key: &str, numel: i64, offset: i64, size: &[i64], stride: &[i64]) -> Value {
        let ints = |v: &[i64]| Value::Tuple(v.iter().map(|&i| Value::Int(i)).collect());
        obj(
            "torch._utils",
            "_rebuild_tensor_v2",
            vec![
                Value::PersistentId(Box::new(Value::Tuple(vec![
                    Value::Str("storage".into()),
                    Value::global("torch", class),
                    Value::Str(key.into()),
                    Value::Str("cpu".into()),
                    Value::Int(numel),
                ]))),
                Value::Int(offset),
                ints(size),
                ints(stride),
                Value::Bool(false),
                obj("collections", "OrderedDict", vec![]),
            ],
        )
    }

    fn read_err(bytes: &[u8]) -> Error {
        read(bytes).unwrap_err()
    }

    #[test]
    fn names_compare_as_their_joined_form() {
        let names = [
            "a", "a/", "a/b", "a/c", "a0/b", "a/b/c", "ab/b", "", "a.", "a/a",
        ];
        for name in names {
            for (prefix, suffix) in [("a", "b"), ("a", ""), ("ab", "b"), ("", "a"), ("a/b", "c")] {
                let joined = format!("{prefix}/{suffix}");
                assert_eq!(
                    cmp_joined(name.as_bytes(), prefix.as_bytes(), suffix),
                    name.cmp(joined.as_str()),
                    "{name:?} against {joined:?}"
                );
            }
        }
    }

    #[test]
    fn cached_reads_equal_plain_reads_and_still_check_each_archives_records() {
        let tensor = pickle::write(
            &v2("FloatStorage", "0", 6, 0, &[2, 3], &[3, 1]),
            Protocol::V2,
        );
        let good = archive("archive", tensor.clone(), &[("0", &[1u8; 24])]);
        let other = archive("archive", tensor.clone(), &[("0", &[2u8; 24])]);
        // The same data.pkl over a storage record of another length: torch refuses it.
        let short = archive("archive", tensor, &[("0", &[1u8; 20])]);
        for _ in 0..2 {
            assert_eq!(read_cached(&good).unwrap(), read(&good).unwrap());
            assert_eq!(read_cached(&other).unwrap(), read(&other).unwrap());
            assert_eq!(
                read_cached(&short).unwrap_err().to_string(),
                read(&short).unwrap_err().to_string()
            );
        }
        // `good` and `other` differ only in their data: one interpretation serves both.
        assert_eq!(LEAVES.with(|c| c.borrow().len()), 1);
    }

    #[test]
    fn tied_weights_and_views() {
        let a = read(VIEWS).unwrap();
        assert_eq!(a.prefix, "views");
        let expected = [
            (
                "emb.weight",
                saved(DType::F32, &[3, 4], &[4, 1], 0, "0", 12),
            ),
            (
                "lm_head.weight",
                saved(DType::F32, &[3, 4], &[4, 1], 0, "0", 12),
            ),
            ("w_t", saved(DType::F32, &[4, 3], &[1, 4], 0, "0", 12)),
            ("w_tail", saved(DType::F32, &[2, 4], &[4, 1], 4, "0", 12)),
            ("w_col", saved(DType::F32, &[3], &[4], 1, "0", 12)),
            ("bias", saved(DType::F16, &[2], &[1], 0, "1", 2)),
        ];
        assert_eq!(a.leaves.len(), expected.len());
        for ((p, leaf), (name, t)) in a.leaves.iter().zip(&expected) {
            assert_eq!(p, &path(&[name]));
            assert_eq!(tensor(leaf), t, "{name}");
        }
        let w = a.storage("0").unwrap();
        assert_eq!((w.data_offset, w.len), (1024, 48));
        let b = a.storage("1").unwrap();
        assert_eq!((b.data_offset, b.len), (1152, 4));
        assert!(a.storage("2").is_none());
        // w[1:] starts at element 4, whose value is 4.0.
        let at = (w.data_offset + 4 * 4) as usize;
        assert_eq!(&VIEWS[at..at + 4], &4.0f32.to_le_bytes());
    }

    #[test]
    fn every_dtype() {
        let a = read(DTYPES).unwrap();
        assert_eq!(a.leaves.len(), DType::ALL.len());
        let offsets: Vec<u64> = (0..22).map(|i| 2624 + 128 * i).collect();
        for (i, (p, leaf)) in a.leaves.iter().enumerate() {
            let [KeyPart::Key(name)] = p.as_slice() else {
                panic!("{p:?}")
            };
            let dtype = DType::from_torch_name(name).unwrap();
            let key = i.to_string();
            assert_eq!(
                tensor(leaf),
                &saved(dtype, &[3], &[1], 0, &key, 3),
                "{name}"
            );
            let entry = a.storage(&key).unwrap();
            assert_eq!(entry.data_offset, offsets[i]);
            assert_eq!(entry.len, 3 * dtype.size() as u64);
        }
        // The same order as the fixture: every dtype ckpt knows.
        let dtypes: Vec<DType> = a.leaves.iter().map(|(_, l)| tensor(l).dtype).collect();
        assert_eq!(dtypes, DType::ALL);
    }

    #[test]
    fn bare_tensor_is_the_dcp_item_shape() {
        let a = read(BARE).unwrap();
        assert_eq!(a.prefix, "archive");
        assert_eq!(a.leaves.len(), 1);
        assert!(a.leaves[0].0.is_empty());
        assert_eq!(
            tensor(&a.leaves[0].1),
            &saved(DType::BF16, &[2, 3], &[3, 1], 0, "0", 6)
        );
        let e = a.storage("0").unwrap();
        assert_eq!((e.data_offset, e.len), (704, 12));
    }

    #[test]
    fn nested_checkpoint() {
        let a = read(NESTED).unwrap();
        let paths: Vec<&Vec<KeyPart>> = a.leaves.iter().map(|(p, _)| p).collect();
        let state = |rest: &str| vec![key("optim"), key("state"), KeyPart::IntKey(0), key(rest)];
        let expected = vec![
            path(&["model", "weight"]),
            path(&["model", "bias"]),
            state("step"),
            state("exp_avg"),
            path(&["optim", "param_groups"]),
            path(&["epoch"]),
            path(&["name"]),
            path(&["cfg", "lr"]),
            path(&["cfg", "tags"]),
            path(&["cfg", "empty"]),
            path(&["cfg", "none"]),
            path(&["param"]),
            path(&["empty"]),
        ];
        assert_eq!(paths, expected.iter().collect::<Vec<_>>());
        let leaf = |i: usize| &a.leaves[i].1;
        assert_eq!(
            tensor(leaf(0)),
            &saved(DType::F32, &[3, 2], &[2, 1], 0, "0", 6)
        );
        assert_eq!(tensor(leaf(2)), &saved(DType::F32, &[], &[], 0, "2", 1));
        assert_eq!(tensor(leaf(11)), &saved(DType::F32, &[2], &[1], 0, "4", 2));
        assert_eq!(
            tensor(leaf(12)),
            &saved(DType::F32, &[0, 3], &[3, 1], 0, "5", 0)
        );
        assert_eq!(a.storage("5").unwrap().len, 0);
        let value = |i: usize| match leaf(i) {
            Leaf::Value(v) => v,
            other => panic!("{other:?}"),
        };
        assert_eq!(value(5), &Value::Int(3));
        assert_eq!(value(6), &Value::Str("run-1".into()));
        assert_eq!(value(7), &Value::Float(1e-3));
        assert_eq!(value(9), &Value::Dict(Vec::new()));
        assert_eq!(value(10), &Value::None);
        let groups = value(4).as_seq().unwrap();
        assert_eq!(
            groups[0].get("betas"),
            Some(&Value::Tuple(vec![Value::Float(0.9), Value::Float(0.999)]))
        );
    }

    #[test]
    fn the_small_legacy_file_is_read() {
        let archive = read(LEGACY).unwrap();
        let [(path, Leaf::Tensor(t))] = archive.leaves.as_slice() else {
            panic!("{:?}", archive.leaves);
        };
        assert_eq!(
            (path.as_slice(), t.shape.as_slice()),
            (&[key("w")][..], &[2][..])
        );
    }

    #[test]
    fn big_endian_is_refused() {
        let entries = zip::read_entries(BARE).unwrap();
        let records: Vec<ZipRecord> = entries
            .iter()
            .map(|e| {
                let data = &BARE[e.data_offset as usize..(e.data_offset + e.len) as usize];
                let content = if e.name.ends_with("byteorder") {
                    b"big".to_vec()
                } else {
                    data.to_vec()
                };
                ZipRecord {
                    name: e.name.clone(),
                    len: content.len() as u64,
                    content: Some(content),
                }
            })
            .collect();
        let e = read_err(&zip::build(&records, &[]).unwrap());
        assert_eq!(
            e.message,
            "archive was saved on a big-endian machine, which ckpt does not convert"
        );
        assert_eq!(e.offset, Some(576));
    }

    /// `BARE` with record `suffix` replaced by `content` (`None` drops it), plus `extra` records.
    fn with_record(suffix: &str, content: Option<&[u8]>, extra: &[(&str, &[u8])]) -> Vec<u8> {
        let literal = |name: &str, content: Vec<u8>| ZipRecord {
            name: name.to_string(),
            len: content.len() as u64,
            content: Some(content),
        };
        let mut records: Vec<ZipRecord> = zip::read_entries(BARE)
            .unwrap()
            .iter()
            .filter_map(|e| {
                let data = &BARE[e.data_offset as usize..(e.data_offset + e.len) as usize];
                let content = match content {
                    _ if !e.name.ends_with(suffix) => Some(data),
                    replaced => replaced,
                };
                content.map(|c| literal(&e.name, c.to_vec()))
            })
            .collect();
        let prefix = records[0].name.split_once('/').unwrap().0.to_string();
        for (name, content) in extra {
            records.push(literal(&format!("{prefix}/{name}"), content.to_vec()));
        }
        zip::build(&records, &[]).unwrap()
    }

    #[test]
    fn records_torch_refuses_are_refused() {
        let refused = |suffix: &str, content: Option<&[u8]>| {
            read_err(&with_record(suffix, content, &[])).to_string()
        };
        for version in [
            &b"x"[..],
            b"",
            b"99",
            b"-1",
            b"0x3",
            b"11",
            b"99999999999999999999",
        ] {
            let e = refused("/version", Some(version));
            assert!(e.contains("record `archive/version` holds"), "{e}");
        }
        assert!(refused("/version", Some(b"99")).contains("torch.load reads versions 1 to 10"));
        assert!(refused("/version", None).contains("no `archive/version` record"));
        for alignment in [&b"x"[..], b"", b"6__4", b"_64", b"0x40"] {
            let e = refused(".storage_alignment", Some(alignment));
            assert!(e.contains("`archive/.storage_alignment` holds"), "{e}");
        }
        let e = refused("serialization_id", Some(b"12\xff"));
        assert!(
            e.contains("record `archive/.data/serialization_id` is not UTF-8"),
            "{e}"
        );
        let e = read_err(&with_record(
            "/version",
            Some(b"3\n"),
            &[(".data/version", b"x")],
        ))
        .to_string();
        assert!(
            e.contains("record `archive/.data/version` holds \"x\""),
            "{e}"
        );
    }

    #[test]
    fn records_torch_reads_are_read() {
        let reads = |suffix: &str, content: Option<&[u8]>, extra: &[(&str, &[u8])]| {
            read(&with_record(suffix, content, extra)).unwrap();
        };
        for version in [&b"3"[..], b"1\n", b"10", b" \t+3x", b"\x0b3"] {
            reads("/version", Some(version), &[]);
        }
        // `.data/version` wins over `version`, as torch reads them.
        reads("/version", Some(b"x"), &[(".data/version", b"3\n")]);
        for alignment in [
            &b"0"[..],
            b" 6_4\n",
            b"-1",
            b"+0064",
            b"99999999999999999999999",
        ] {
            reads(".storage_alignment", Some(alignment), &[]);
        }
        reads(".storage_alignment", None, &[]);
        reads("serialization_id", Some(b""), &[]);
        reads("serialization_id", None, &[]);
    }

    /// `bytes` with general-purpose flag `bit` set in the central header of each record whose
    /// name ends with `suffix`.
    fn with_central_flag(bytes: &[u8], suffix: &str, bit: u32) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let mut at = 0;
        while let Some(i) = out[at..].windows(4).position(|w| w == b"PK\x01\x02") {
            let h = at + i;
            let name_len = u16::from_le_bytes([out[h + 28], out[h + 29]]) as usize;
            if out[h + 46..h + 46 + name_len].ends_with(suffix.as_bytes()) {
                let flags = u16::from_le_bytes([out[h + 8], out[h + 9]]) | (1 << bit);
                out[h + 8..h + 10].copy_from_slice(&flags.to_le_bytes());
            }
            at = h + 4;
        }
        out
    }

    #[test]
    fn records_torch_cannot_open_are_refused() {
        for suffix in [
            "/data/0",
            "/data.pkl",
            "/version",
            "serialization_id",
            "/byteorder",
        ] {
            for (bit, what) in [
                (5, "bit 5, compressed patch data"),
                (6, "bit 6, strong encryption"),
            ] {
                let e = read_err(&with_central_flag(BARE, suffix, bit)).to_string();
                assert!(
                    e.contains(what) && e.contains("torch.load cannot read it"),
                    "{e}"
                );
                assert!(e.contains(suffix), "{e}");
            }
        }
        // torch opens the archive and never reads a record no one refers to.
        let extra = with_record("\0", None, &[("extra", b"zz")]);
        read(&extra).unwrap();
        read(&with_central_flag(&extra, "/extra", 5)).unwrap();
        // A flag in a local header only is not looked at by torch either.
        let mut local = BARE.to_vec();
        local[6] |= 1 << 5;
        read(&local).unwrap();
    }

    #[test]
    fn inconsistent_tensors_are_errors() {
        let pkl = |v: Value| pickle::write(&v, Protocol::V2);
        let dict = |v: Value| Value::Dict(vec![(Value::Str("w".into()), v)]);
        let data = [0u8; 24];
        let full: &[u8] = &data;
        let short: &[u8] = &data[..20];
        // (saved object, storage records, expected error)
        type Case<'a> = (Value, Vec<(&'a str, &'a [u8])>, &'a str);
        let cases: Vec<Case> = vec![
            (
                v2("FloatStorage", "0", 6, 0, &[6], &[1]),
                vec![],
                "has no record `a/data/0`",
            ),
            (
                v2("FloatStorage", "0", 6, 0, &[6], &[1]),
                vec![("0", short)],
                "should be 24 bytes but its record has 20",
            ),
            (
                v2("FloatStorage", "0", 6, 1, &[6], &[1]),
                vec![("0", full)],
                "reaches past its storage of 6 elements",
            ),
            (
                v2("FloatStorage", "0", 6, 0, &[2, 3], &[4, 1]),
                vec![("0", full)],
                "reaches past its storage",
            ),
            (
                v2("FloatStorage", "0", 6, 0, &[3], &[-1]),
                vec![("0", full)],
                "stride -1 is negative",
            ),
            (
                v2("FloatStorage", "0", 6, 0, &[3, 1], &[1]),
                vec![("0", full)],
                "2 sizes but 1 strides",
            ),
            (
                v2("FloatStorage", "0", 6, i64::MAX, &[3], &[i64::MAX]),
                vec![("0", full)],
                "reaches past",
            ),
            (
                v2("QInt8Storage", "0", 3, 0, &[3], &[1]),
                vec![("0", full)],
                "`torch.QInt8Storage` holds a dtype ckpt does not support",
            ),
            (
                Value::reduce(
                    "builtins",
                    "set",
                    vec![Value::List(vec![v2("FloatStorage", "0", 6, 0, &[6], &[1])])],
                ),
                vec![("0", full)],
                "tensors inside an object other than a dict, list or tuple",
            ),
            (
                Value::Dict(vec![
                    (
                        Value::Str("a".into()),
                        v2("FloatStorage", "0", 6, 0, &[6], &[1]),
                    ),
                    (
                        Value::Str("b".into()),
                        v2("HalfStorage", "0", 12, 0, &[6], &[1]),
                    ),
                ]),
                vec![("0", full)],
                "storage `0` is referenced as two different types or sizes",
            ),
            (
                obj("os", "system", vec![Value::Str("true".into())]),
                vec![],
                "`os.system`, which ckpt does not allow",
            ),
        ];
        for (value, storages, expected) in cases {
            let value = if matches!(value, Value::Dict(_) | Value::List(_)) {
                value
            } else {
                dict(value)
            };
            let bytes = archive("a", pkl(value), &storages);
            let e = read_err(&bytes);
            assert!(
                e.to_string().contains(expected),
                "{e} (expected {expected:?})"
            );
            assert!(e.offset.is_some(), "{e} has an offset");
        }
    }

    #[test]
    fn unsupported_dtypes_are_leaves_by_name() {
        // What torch writes for a `torch.bits8` tensor: `_rebuild_tensor_v3` over untyped bytes.
        let Value::Object(mut bits8) = tensor_value(DType::F8E8M0, &[3], "0") else {
            panic!("a tensor is a call")
        };
        bits8.args[6] = Value::global("torch", "bits8");
        let saved = Value::Dict(vec![
            (Value::Str("w".into()), Value::Object(bits8)),
            (Value::Str("b".into()), tensor_value(DType::F32, &[1], "1")),
        ]);
        let bytes = archive(
            "a",
            pickle::write(&saved, Protocol::V2),
            &[("0", &[7; 3]), ("1", &[0; 4])],
        );
        let a = read(&bytes).unwrap();
        assert_eq!(
            a.leaves[0],
            (
                vec![key("w")],
                Leaf::Unsupported {
                    dtype: "torch.bits8".into()
                }
            )
        );
        assert_eq!(tensor(&a.leaves[1].1).dtype, DType::F32);
    }

    #[test]
    fn pickle_errors_point_into_the_archive() {
        let bytes = archive("a", vec![0x80, 2, b'}', 0xff], &[]);
        let e = read_err(&bytes);
        assert_eq!(
            e.message,
            "`a/data.pkl` uses unsupported pickle opcode 0xff"
        );
        assert_eq!(e.offset, Some(64 + 3));
    }

    #[test]
    fn opcodes_torch_refuses_are_refused() {
        let refused = |pkl: &[u8]| read_err(&archive("a", pkl.to_vec(), &[]));
        // `{"a": 1}` with a FRAME before the value; then protocol 4 as Python writes it.
        let e = refused(b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01\x95\x02\0\0\0\0\0\0\0K\x01s.");
        assert!(e.message.contains("pickle opcode 0x95"), "{e}");
        assert_eq!(e.offset, Some(64 + 13));
        for pkl in [
            &b"\x80\x04\x95\x0a\0\0\0\0\0\0\0}\x94\x8c\x01a\x94K\x01s."[..],
            b"\x80\x02}q\x00\x8c\x01aK\x01s.", // SHORT_BINUNICODE
            b"\x80\x02}q\x00X\x01\0\0\0aC\x01xs.", // SHORT_BINBYTES
            b"\x80\x02}q\x00X\x01\0\0\0a\x94K\x01s.", // MEMOIZE
            b"\x80\x02}q\x00X\x01\0\0\0aI1\ns.", // INT
        ] {
            let e = refused(pkl);
            assert!(
                e.message.contains("torch.load(weights_only=True) refuses"),
                "{e}"
            );
        }
        // What torch.save writes (protocol 2, every opcode torch runs) still reads.
        let pkl = b"\x80\x02}q\x00(X\x01\0\0\0aq\x01]q\x02(K\x01M\x00\x01J\0\0\0\x01\x8a\x01\x05G?\xf0\0\0\0\0\0\0N\x88\x89)U\x01c\x8f\x85\x86\x87eX\x01\0\0\0bh\x02u.";
        read(&archive("a", pkl.to_vec(), &[])).unwrap();
    }

    #[test]
    fn calls_torch_cannot_make_are_refused() {
        let one = |v: Value| {
            let pkl = pickle::write(
                &Value::Dict(vec![(Value::Str("a".into()), v)]),
                Protocol::V2,
            );
            read(&archive("a", pkl, &[]))
        };
        let call = |callable: Value, args: Vec<Value>| {
            Value::Object(Box::new(pickle::Object {
                callable,
                args,
                new_obj: false,
                dict_items: vec![],
                list_items: vec![],
                state: None,
            }))
        };
        let odict = obj("collections", "OrderedDict", vec![]);
        let e = one(call(Value::Tuple(vec![Value::Int(1)]), vec![])).unwrap_err();
        assert!(e.message.contains("`REDUCE` applies to a tuple"), "{e}");
        let e = one(call(odict.clone(), vec![])).unwrap_err();
        assert!(
            e.message.contains("`REDUCE` applies to an object instance"),
            "{e}"
        );
        let ints = |v: &[i64]| Value::Tuple(v.iter().map(|&i| Value::Int(i)).collect());
        for args in [
            vec![ints(&[1]), ints(&[2])],
            vec![Value::Int(5)],
            vec![Value::List(vec![Value::Float(1.5)])],
            vec![Value::Str("ab".into())],
        ] {
            let e = one(obj("torch", "Size", args)).unwrap_err();
            assert!(e.message.contains("`torch.Size` called with"), "{e}");
        }
        // What torch calls without complaint still reads.
        for args in [
            vec![],
            vec![ints(&[1, 2])],
            vec![Value::List(vec![Value::Bool(true), Value::Int(-1)])],
        ] {
            one(obj("torch", "Size", args)).unwrap();
        }
        one(odict).unwrap();
    }

    #[test]
    fn encodings_python_lacks_are_refused() {
        let encode = |args: Vec<Value>| {
            let v = obj("_codecs", "encode", args);
            let pkl = pickle::write(
                &Value::Dict(vec![(Value::Str("a".into()), v)]),
                Protocol::V2,
            );
            read(&archive("a", pkl, &[]))
        };
        let s = |t: &str| Value::Str(t.into());
        for name in [
            "latin1",
            "LATIN-1",
            " latin--1 ",
            "utf8",
            "iso-8859-1",
            "rot-13",
            "cp65001",
        ] {
            encode(vec![s("a"), s(name)]).unwrap();
        }
        encode(vec![s("a")]).unwrap();
        let bytes = || obj("_codecs", "encode", vec![s("a"), s("latin1")]);
        encode(vec![bytes(), s("hex")]).unwrap();
        let e = encode(vec![bytes(), s("utf8")]).unwrap_err();
        assert!(
            e.message.contains("cannot encode bytes with \"utf8\""),
            "{e}"
        );
        for name in ["foo", "", "latin.1", "u.t.f-8", "mbcs"] {
            let e = encode(vec![s("a"), s(name)]).unwrap_err();
            assert!(e.message.contains("unknown encoding"), "{name}: {e}");
        }
        for (value, name) in [
            (s("\u{20ac}"), "latin1"),
            (s("\u{e9}"), "ascii"),
            (s("a"), "hex"),
        ] {
            let e = encode(vec![value, s(name)]).unwrap_err();
            assert!(e.message.contains("cannot encode a str with"), "{e}");
        }
        encode(vec![]).unwrap_err();
        encode(vec![s("a"), Value::Int(1)]).unwrap_err();
    }

    #[test]
    fn not_torch_save() {
        let zip = |name: &str| {
            let r = ZipRecord {
                name: name.into(),
                len: 1,
                content: Some(vec![1]),
            };
            zip::build(&[r], &[]).unwrap()
        };
        assert!(read_err(&zip("data.pkl"))
            .message
            .contains("not in a folder"));
        let e = read_err(&zip("m/constants.pkl"));
        assert!(e.message.contains("no `m/data.pkl` record"));
        assert!(e.hint.unwrap().contains("TorchScript"));
        assert!(read_err(b"hello").message.contains("not a zip archive"));
    }

    #[test]
    fn written_archives_read_back() {
        // Every dtype (storage bytes sized to match), nested dicts, int keys and plain values.
        let mut items = Vec::new();
        let mut storages = Vec::new();
        for (i, dtype) in DType::ALL.into_iter().enumerate() {
            let k = i.to_string();
            items.push((
                vec![key("t"), key(dtype.torch_name())],
                WriteLeaf::Tensor {
                    dtype,
                    shape: vec![2, 3],
                    storage_key: k.clone(),
                },
            ));
            storages.push((k, vec![i as u8; 6 * dtype.size()]));
        }
        items.push((
            vec![key("opt"), KeyPart::IntKey(0), key("step")],
            WriteLeaf::Value(Value::Int(7)),
        ));
        items.push((vec![key("name")], WriteLeaf::Value(Value::Str("x".into()))));
        items.push((
            vec![key("scalar")],
            WriteLeaf::Tensor {
                dtype: DType::F32,
                shape: vec![],
                storage_key: "s".into(),
            },
        ));
        storages.push(("s".into(), vec![0; 4]));
        check_key_paths(&items).unwrap();

        let refs: Vec<(&str, &[u8])> = storages
            .iter()
            .map(|(k, d)| (k.as_str(), d.as_slice()))
            .collect();
        let bytes = archive("out", data_pkl(&items), &refs);
        let a = read(&bytes).unwrap();
        assert_eq!(a.prefix, "out");
        assert_eq!(a.leaves.len(), items.len());
        for ((p, leaf), (wp, wleaf)) in a.leaves.iter().zip(&items) {
            assert_eq!(p, wp);
            match (leaf, wleaf) {
                (
                    Leaf::Tensor(t),
                    WriteLeaf::Tensor {
                        dtype,
                        shape,
                        storage_key,
                    },
                ) => {
                    let numel = numel(shape).unwrap();
                    let strides = crate::model::contiguous_strides(shape);
                    assert_eq!(t, &saved(*dtype, shape, &strides, 0, storage_key, numel));
                    let (_, data) = storages.iter().find(|(k, _)| k == storage_key).unwrap();
                    let e = a.storage(storage_key).unwrap();
                    assert_eq!(
                        &bytes[e.data_offset as usize..][..e.len as usize],
                        &data[..]
                    );
                }
                (Leaf::Value(v), WriteLeaf::Value(w)) => assert_eq!(v, w),
                other => panic!("{other:?}"),
            }
        }
        let entries = zip::read_entries(&bytes).unwrap();
        let entries: Vec<&str> = entries.iter().map(|e| &e.name[4..]).collect();
        assert_eq!(
            &entries[..4],
            [
                "data.pkl",
                ".format_version",
                ".storage_alignment",
                "byteorder"
            ]
        );
        assert_eq!(
            &entries[entries.len() - 2..],
            ["version", ".data/serialization_id"]
        );
    }

    #[test]
    fn bare_items_round_trip() {
        let leaf = WriteLeaf::Tensor {
            dtype: DType::F8E4M3,
            shape: vec![5],
            storage_key: "0".into(),
        };
        let bytes = archive(
            "archive",
            data_pkl(&[(Vec::new(), leaf)]),
            &[("0", &[1, 2, 3, 4, 5])],
        );
        let a = read(&bytes).unwrap();
        assert_eq!(
            a.leaves,
            vec![(
                Vec::new(),
                Leaf::Tensor(saved(DType::F8E4M3, &[5], &[1], 0, "0", 5))
            )]
        );

        let value = Value::Dict(vec![(
            Value::Str("k".into()),
            Value::List(vec![Value::Int(1)]),
        )]);
        let bytes = archive(
            "archive",
            data_pkl(&[(Vec::new(), WriteLeaf::Value(Value::Int(3)))]),
            &[],
        );
        assert_eq!(
            read(&bytes).unwrap().leaves,
            vec![(Vec::new(), Leaf::Value(Value::Int(3)))]
        );
        let bytes = archive(
            "archive",
            data_pkl(&[(
                path(&["k"]),
                WriteLeaf::Value(value.get("k").unwrap().clone()),
            )]),
            &[],
        );
        assert_eq!(
            read(&bytes).unwrap().leaves,
            vec![(path(&["k"]), Leaf::Value(Value::List(vec![Value::Int(1)])))]
        );
        let bytes = archive("archive", data_pkl(&[]), &[]);
        assert_eq!(
            read(&bytes).unwrap().leaves,
            vec![(Vec::new(), Leaf::Value(Value::Dict(Vec::new())))]
        );
    }

    #[test]
    fn bytes_and_sets_use_protocol_2_calls() {
        let value = Value::Tuple(vec![
            Value::Bytes(vec![0, b'a', 0xff]),
            Value::Set(vec![Value::Int(1)]),
        ]);
        let bytes = archive("x", data_pkl(&[(Vec::new(), WriteLeaf::Value(value))]), &[]);
        let a = read(&bytes).unwrap();
        let expected = Value::Tuple(vec![
            obj(
                "_codecs",
                "encode",
                vec![
                    Value::Str("\u{0}a\u{ff}".into()),
                    Value::Str("latin1".into()),
                ],
            ),
            obj("builtins", "set", vec![Value::List(vec![Value::Int(1)])]),
        ]);
        assert_eq!(a.leaves, vec![(Vec::new(), Leaf::Value(expected))]);
    }

    #[test]
    fn conflicting_key_paths() {
        let v = |p: Vec<KeyPart>| (p, WriteLeaf::Value(Value::None));
        assert!(check_key_paths(&[v(path(&["a"])), v(path(&["b", "c"]))]).is_ok());
        let e = check_key_paths(&[v(path(&["a", "b", "c"])), v(path(&["a", "b"]))]).unwrap_err();
        assert_eq!(
            e.message,
            "entry `a.b` is both a value and a dict holding `a.b.c`"
        );
        assert!(check_key_paths(&[v(path(&["a"])), v(path(&["a"]))]).is_err());
        assert!(check_key_paths(&[v(vec![]), v(path(&["a"]))]).is_err());
        // data_pkl keeps the first of two conflicting items.
        let items = [v(path(&["a"])), v(path(&["a", "b"]))];
        let bytes = archive("x", data_pkl(&items), &[]);
        assert_eq!(
            read(&bytes).unwrap().leaves,
            vec![(path(&["a"]), Leaf::Value(Value::None))]
        );
    }

    #[test]
    fn records_match_torch() {
        let r = records(
            "archive",
            b"pkl".to_vec(),
            &[("0".into(), 12), ("1".into(), 4)],
        );
        let names: Vec<&str> = r.iter().map(|r| r.name.as_str()).collect();
        let bare: Vec<String> = zip::read_entries(BARE)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names[..5], bare[..5]);
        assert_eq!(names[5], "archive/data/1");
        assert_eq!(names[6..], bare[5..]);
        for (record, entry) in r
            .iter()
            .zip(zip::read_entries(BARE).unwrap())
            .skip(1)
            .take(3)
        {
            let real = &BARE[entry.data_offset as usize..][..entry.len as usize];
            assert_eq!(record.content.as_deref(), Some(real));
        }
        assert_eq!(r[6].content.as_deref(), Some(&b"3\n"[..]));
        let id = r[7].content.as_ref().unwrap();
        assert_eq!(id.len(), 40);
        assert!(id.iter().all(u8::is_ascii_digit));
        assert_eq!((r[4].len, r[4].content.is_none()), (12, true));
    }

    fn pkl_range() -> std::ops::Range<usize> {
        let e = zip::read_entries(NESTED).unwrap();
        let p = e.iter().find(|e| e.name.ends_with("data.pkl")).unwrap();
        p.data_offset as usize..(p.data_offset + p.len) as usize
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn mutated_archives_never_panic(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            in_pickle in any::<bool>(),
            cut in prop::option::weighted(0.1, any::<prop::sample::Index>()),
        ) {
            let mut bytes = NESTED.to_vec();
            let range = if in_pickle { pkl_range() } else { 0..bytes.len() };
            for (at, byte) in edits {
                bytes[range.start + at.index(range.len())] = byte;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len()));
            }
            if let Ok(a) = read(&bytes) {
                for (_, leaf) in &a.leaves {
                    if let Leaf::Tensor(t) = leaf {
                        let e = a.storage(&t.storage_key).unwrap();
                        prop_assert_eq!(e.len, t.storage_numel * t.dtype.size() as u64);
                    }
                }
            }
        }
    }

    #[test]
    fn legacy_files_are_read_in_place_and_damage_is_refused() {
        let bytes: &[u8] = include_bytes!("../../../fixtures/legacy_torch_save.pt");
        let archive = read(bytes).unwrap();
        let tensors = archive
            .leaves
            .iter()
            .filter(|(_, l)| matches!(l, Leaf::Tensor(_)));
        assert_eq!(tensors.count(), 16);
        // `w` is a (4, 6) F32: its storage record lies in the file, after its 8-byte count.
        let w = archive
            .leaves
            .iter()
            .find_map(|(p, l)| match (p.as_slice(), l) {
                ([KeyPart::Key(k)], Leaf::Tensor(t)) if k == "w" => Some(t),
                _ => None,
            });
        let w = w.unwrap();
        let entry = archive.storage(&w.storage_key).unwrap();
        let count = &bytes[entry.data_offset as usize - 8..entry.data_offset as usize];
        assert_eq!(u64::from_le_bytes(count.try_into().unwrap()), 24);
        assert_eq!(entry.len, 96);

        let err = |b: &[u8]| read(b).unwrap_err().to_string();
        assert!(err(&bytes[..bytes.len() - 1]).contains("file ends inside storage"));
        let mut magic = bytes.to_vec();
        magic[4] ^= 1;
        assert!(err(&magic).contains("magic number"), "{}", err(&magic));
    }
}
