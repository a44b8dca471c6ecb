//! Reading a torch.save archive: its records checked as torch.load checks them, `data.pkl` read
//! as data only and interpreted once per distinct pickle (the leaf cache), each tensor a view of
//! a storage record.

use super::*;

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
    Sharded(ShardedLeaf),
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

    pub(super) fn entry(&self, name: &str) -> Option<&ZipEntry> {
        self.entries
            .binary_search_by(|e| e.name.as_str().cmp(name))
            .ok()
            .and_then(|i| self.entries.get(i))
    }

    /// The record `{prefix}/{name}`, found without building its name: DCP reads a million
    /// archives, each looked up for several records.
    pub(super) fn entry_in_prefix(&self, name: &str) -> Option<&ZipEntry> {
        self.entries
            .binary_search_by(|e| cmp_joined(e.name.as_bytes(), self.prefix.as_bytes(), name))
            .ok()
            .and_then(|i| self.entries.get(i))
    }
}

/// How `name` orders against `{prefix}/{suffix}`, compared by slices.
pub(super) fn cmp_joined(name: &[u8], prefix: &[u8], suffix: &str) -> std::cmp::Ordering {
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
pub(super) type LeafCache =
    HashMap<Vec<u8>, Vec<(Vec<KeyPart>, Leaf)>, xxhash_rust::xxh3::Xxh3Builder>;
pub(super) const MAX_CACHED_LEAVES: usize = 256;

thread_local! {
    pub(super) static LEAVES: std::cell::RefCell<LeafCache> = std::cell::RefCell::default();
}

/// Everything the interpretation of `pkl` depends on: its bytes and each record's name, length
/// and flags (the storages it names are checked against them), each length-prefixed.
pub(super) fn leaves_key(pkl: &[u8], entries: &[ZipEntry]) -> Vec<u8> {
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

pub(super) fn read_with(bytes: &[u8], cached: bool, extra: Option<&Extra<'_>>) -> Result<Archive> {
    // Every pickle starts with PROTO from protocol 2 on; the legacy format is pickles.
    if bytes.first() == Some(&pickle::opcodes::PROTO) {
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

/// The records torch's reader parses before it unpickles anything, checked as it checks them
/// (`PyTorchStreamReader::init` and `torch.serialization._load`): an archive torch.load refuses
/// for one of them must not pass `verify`.
pub(super) fn check_records(bytes: &[u8], archive: &Archive) -> Result<()> {
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

/// Refuse a record that miniz opens but will not read (see [`zip::FLAGS_UNREADABLE`]).
pub(super) fn readable(entry: &ZipEntry) -> Result<()> {
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
pub(super) const MIN_FILE_VERSION: i64 = 1;
pub(super) const MAX_FILE_VERSION: i64 = 10;

/// `std::stoll` as torch parses the version record: leading whitespace, a sign, then the longest
/// run of decimal digits (anything after it is ignored); `None` without digits or on overflow.
pub(super) fn stoll(bytes: &[u8]) -> Option<i64> {
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
pub(super) fn is_python_int(bytes: &[u8]) -> bool {
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

/// A pickle error as an archive error, its offset moved from the pickle to the archive.
pub(super) fn pickle_error(err: PickleError, name: &str, pkl_offset: u64) -> Error {
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
