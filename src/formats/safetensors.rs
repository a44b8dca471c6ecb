//! safetensors files: header parsing (bounded, checked) and header writing.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! `{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`, then the
//! data buffer that the offsets index. The reader accepts what the `safetensors` crate (and so the
//! Python package, which wraps it) accepts: a capped header length, JSON read the way the crate's
//! serde types read it, offsets that tile the data buffer with no hole and no overlap, and a file
//! that ends where the buffer ends. It is stricter in two places, a tensor name or a
//! `__metadata__` key given twice (the crate keeps the last); `tests/safetensors_oracle.rs` holds
//! it to that against the crate. It reads only the header, so a checkpoint of any size is
//! described without touching tensor bytes.
//!
//! The writer side produces only the header bytes, byte for byte what the Python package writes
//! for the same tensors in the same order; the executor writes the data after it.
//!
//! Two JSON helpers live here because every safetensors-based layout needs them: [`Entries`]
//! parses an object keeping its key order and its duplicate keys (so a duplicate can be reported
//! instead of silently dropped), and [`python_json_string`] quotes a string the way Python's
//! `json.dumps` does, for the JSON that torch and Hugging Face write from Python.

use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::{
    self, Deserialize, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess,
    VariantAccess, Visitor,
};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::{
    contiguous_strides, numel, Checkpoint, DataRef, Encoding, Format, Piece, Pieces, Tensor,
    Unsupported,
};
use crate::storage::{Access, Input};

/// Largest header the `safetensors` crate accepts; anything larger is corruption, and the cap keeps
/// a bad length from making us allocate gigabytes.
pub const MAX_HEADER_SIZE: u64 = 100_000_000;

/// Bytes of the little-endian header length that opens every file.
const LEN_PREFIX: u64 = 8;

/// The `__metadata__` key torch's Hugging Face writer uses for per-rank shard offsets.
pub(crate) const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// The parsed header of one safetensors file.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    /// Absolute byte offset of the data buffer: 8 + the JSON header length.
    pub data_start: u64,
    /// Every tensor, sorted by `begin` (the order of their bytes in the file).
    pub tensors: Vec<HeaderTensor>,
    /// The `__metadata__` string map, in file order.
    pub metadata: Vec<(String, String)>,
    /// Entries of a dtype safetensors has but ckpt does not support, in file order.
    pub unsupported: Vec<HeaderUnsupported>,
}

/// A header entry whose dtype ckpt does not support (`F4`, `F6_E2M3`, `F6_E3M2`: sub-byte
/// types). Its bytes still count when the offsets are checked; readers report it by name.
#[derive(Clone, Debug, PartialEq)]
pub struct HeaderUnsupported {
    pub name: String,
    pub code: String,
    pub begin: u64,
    pub end: u64,
}

/// safetensors codes ckpt does not support, with their size in bits.
const UNSUPPORTED_CODES: &[(&str, u64)] = &[("F4", 4), ("F6_E2M3", 6), ("F6_E3M2", 6)];

/// What one tensor entry of a header is.
enum Entry {
    Tensor(HeaderTensor),
    Unsupported(HeaderUnsupported),
}

/// One tensor entry of a safetensors header.
#[derive(Clone, Debug, PartialEq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    /// Start of the tensor's bytes, relative to [`Header::data_start`].
    pub begin: u64,
    /// End (exclusive) of the tensor's bytes, relative to [`Header::data_start`].
    pub end: u64,
}

impl Header {
    /// The value of a `__metadata__` key.
    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Read and validate the header of the safetensors file at `path`, without reading tensor data.
pub fn read_header(path: &Path) -> Result<Header> {
    let file = Input::open(path, Access::Read)?;
    let file_len = file.len();
    if file_len < LEN_PREFIX {
        return Err(Error::invalid(format!(
            "file is {file_len} bytes, too short for a safetensors header"
        ))
        .file(path)
        .hint("a safetensors file starts with an 8-byte header length; this one is truncated or not safetensors"));
    }
    let mut prefix = [0u8; LEN_PREFIX as usize];
    file.read_at(0, &mut prefix)?;
    let header_len =
        check_header_len(u64::from_le_bytes(prefix), file_len).map_err(|e| e.file(path))?;
    let mut json = vec![0u8; header_len];
    file.read_at(LEN_PREFIX, &mut json)?;
    parse_header(&json, file_len).map_err(|e| e.file(path))
}

/// Check the declared header length against the cap and the file, returning it as a `usize`.
fn check_header_len(header_len: u64, file_len: u64) -> Result<usize> {
    if header_len > MAX_HEADER_SIZE {
        return Err(Error::invalid(format!(
            "header length {header_len} exceeds the {MAX_HEADER_SIZE}-byte limit"
        ))
        .at(0)
        .hint("the file is not safetensors, or its first 8 bytes are corrupt"));
    }
    let available = file_len.saturating_sub(LEN_PREFIX);
    if header_len > available {
        return Err(Error::invalid(format!(
            "header length {header_len} runs past the end of the file ({file_len} bytes)"
        ))
        .at(0)
        .hint("the file was truncated, e.g. by an interrupted copy or download"));
    }
    // The cap above keeps this well inside `usize` even on 32-bit targets.
    usize::try_from(header_len).map_err(|_| {
        Error::invalid(format!("header length {header_len} does not fit in memory")).at(0)
    })
}

/// Parse the JSON header bytes (after the 8-byte length) of a file that is `file_len` bytes long.
/// Errors carry byte offsets but no file; the caller adds it.
pub(crate) fn parse_header(json: &[u8], file_len: u64) -> Result<Header> {
    let data_start = LEN_PREFIX + json.len() as u64;
    let raw = parse_raw_header(json)?;
    let mut header = header_from_raw(raw, data_start)?;
    // The crate sorts by (begin, end) before checking that the offsets tile the buffer, so an
    // empty tensor at the start of another one's range is fine.
    header.tensors.sort_by_key(|t| (t.begin, t.end));
    let data_len = check_tiling(&header)?;
    check_file_len(data_start, data_len, file_len)?;
    Ok(header)
}

/// The header's members as JSON gives them, after the checks the crate makes of the text.
fn parse_raw_header(json: &[u8]) -> Result<RawHeader> {
    // JSON whitespace may come first: the crate's parser skips it (0.4 and 0.8 alike).
    let start = json
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    if start.and_then(|i| json.get(i)) != Some(&b'{') {
        // The crate refuses any header that is not a JSON object.
        return Err(Error::invalid("header does not start with `{`")
            .at(LEN_PREFIX + start.unwrap_or(0) as u64)
            .hint("the file is not safetensors, or its header is corrupt"));
    }
    let text = std::str::from_utf8(json).map_err(|e| {
        Error::invalid("header is not valid UTF-8").at(LEN_PREFIX + e.valid_up_to() as u64)
    })?;
    // The member being read when the JSON turns out bad, to name the tensor in the error.
    let mut current = None;
    let mut de = serde_json::Deserializer::from_str(text);
    HeaderSeed {
        current: &mut current,
    }
    .deserialize(&mut de)
    .and_then(|raw| de.end().map(|()| raw))
    .map_err(|e| {
        let err = json_error(&e, json, LEN_PREFIX);
        match current.take() {
            Some(name) if e.is_data() => err.tensor(name),
            _ => err,
        }
    })
}

/// The header's members as tensors, unsupported entries and metadata, in file order; each
/// name once.
fn header_from_raw(raw: RawHeader, data_start: u64) -> Result<Header> {
    let mut seen = HashSet::new();
    let mut metadata = None;
    let mut tensors = Vec::with_capacity(raw.0.len());
    let mut unsupported = Vec::new();
    for (name, entry) in raw.0 {
        if !seen.insert(name.clone()) {
            return Err(Error::invalid("header names this key twice")
                .tensor(name)
                .at(LEN_PREFIX));
        }
        match entry {
            RawEntry::Metadata(m) => {
                let m = m.map(|e| e.0).unwrap_or_default();
                if let Some(dup) = first_duplicate(&m) {
                    return Err(
                        Error::invalid(format!("`__metadata__` names `{dup}` twice"))
                            .at(LEN_PREFIX),
                    );
                }
                metadata = Some(m);
            }
            RawEntry::Tensor(raw) => match tensor_entry(&name, raw) {
                Ok(Entry::Tensor(t)) => tensors.push(t),
                Ok(Entry::Unsupported(u)) => unsupported.push(u),
                Err(e) => return Err(e.tensor(&name)),
            },
        }
    }
    Ok(Header {
        data_start,
        tensors,
        metadata: metadata.unwrap_or_default(),
        unsupported,
    })
}

/// The length of the data buffer, once the entries' offsets cover it exactly: no overlap, no
/// gap.
fn check_tiling(header: &Header) -> Result<u64> {
    let data_start = header.data_start;
    let mut spans: Vec<(u64, u64, &str)> = header
        .tensors
        .iter()
        .map(|t| (t.begin, t.end, t.name.as_str()))
        .chain(
            header
                .unsupported
                .iter()
                .map(|u| (u.begin, u.end, u.name.as_str())),
        )
        .collect();
    spans.sort_by_key(|&(begin, end, _)| (begin, end));
    let mut expected = 0u64;
    let mut previous: Option<&str> = None;
    for &(begin, end, name) in &spans {
        let at = data_start.saturating_add(begin);
        if begin < expected {
            let prev = previous.unwrap_or_default();
            return Err(Error::invalid(format!(
                "data_offsets [{begin}, {end}] overlap tensor `{prev}`, which ends at data byte {expected}",
            ))
            .tensor(name)
            .at(at));
        }
        if begin > expected {
            return Err(Error::invalid(format!(
                "{} bytes before data_offsets [{begin}, {end}] belong to no tensor",
                begin - expected,
            ))
            .tensor(name)
            .at(data_start.saturating_add(expected))
            .hint("safetensors requires the tensors to cover the data buffer exactly"));
        }
        expected = end;
        previous = Some(name);
    }
    Ok(expected)
}

/// An error unless the file is exactly as long as the header and `data_len` bytes of data
/// after it.
fn check_file_len(data_start: u64, data_len: u64, file_len: u64) -> Result<()> {
    let Some(needed) = data_start.checked_add(data_len) else {
        return Err(Error::invalid("data_offsets overflow a 64-bit file size").at(LEN_PREFIX));
    };
    if file_len < needed {
        return Err(Error::invalid(format!(
            "file is {file_len} bytes, header says {needed} ({} bytes missing)",
            needed - file_len
        ))
        .at(file_len)
        .hint("the file was truncated, e.g. by an interrupted copy or download"));
    }
    if file_len > needed {
        return Err(Error::invalid(format!(
            "file is {file_len} bytes, header says {needed} ({} trailing bytes)",
            file_len - needed
        ))
        .at(needed)
        .hint("safetensors does not allow bytes after the last tensor; the file may have been appended to"));
    }
    Ok(())
}

/// Interpret one `name: {...}` entry of the header: a dtype ckpt knows (or an unsupported
/// sub-byte one, kept by name), offsets that hold the shape.
fn tensor_entry(name: &str, raw: RawTensor) -> Result<Entry> {
    let at = |e: Error| e.at(LEN_PREFIX);
    let RawTensor {
        dtype: code,
        shape,
        data_offsets: (begin, end),
    } = raw;
    // Bits per element: the supported dtype's, or an unsupported sub-byte type's.
    let (dtype, bits) = match DType::from_safetensors_code(&code) {
        Some(dtype) => (Some(dtype), dtype.size() as u64 * 8),
        None => match UNSUPPORTED_CODES.iter().find(|(c, _)| *c == code) {
            Some(&(_, bits)) => (None, bits),
            None => {
                let known: Vec<&str> = DType::ALL
                    .iter()
                    .filter_map(|d| d.safetensors_code())
                    .chain(UNSUPPORTED_CODES.iter().map(|(c, _)| *c))
                    .collect();
                return Err(at(Error::invalid(format!("unknown dtype `{code}`"))
                    .hint(format!("safetensors knows {}", known.join(", ")))));
            }
        },
    };
    if end < begin {
        return Err(at(Error::invalid(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        ))));
    }
    // Counted in bits, as the crate counts: the elements' bits must fill whole bytes, and a
    // shape whose bit count overflows 64 bits is refused even where its byte count would not.
    let nbits = numel(&shape).and_then(|n| n.checked_mul(bits));
    let nbytes = nbits.filter(|b| b % 8 == 0).map(|b| b / 8);
    if nbytes != Some(end - begin) {
        let needs = match nbits {
            None => "more than 2^64 bits".to_string(),
            Some(b) if b % 8 != 0 => format!("{b} bits, not whole bytes"),
            Some(b) => format!("{} bytes", b / 8),
        };
        return Err(at(Error::invalid(format!(
            "shape {shape:?} of {code} needs {needs}, data_offsets [{begin}, {end}] hold {}",
            end - begin
        ))));
    }
    Ok(match dtype {
        Some(dtype) => Entry::Tensor(HeaderTensor {
            name: name.to_string(),
            dtype,
            shape,
            begin,
            end,
        }),
        None => Entry::Unsupported(HeaderUnsupported {
            name: name.to_string(),
            code: code.to_string(),
            begin,
            end,
        }),
    })
}

/// One `.safetensors` file, given or alone in a directory.
pub struct Safetensors;

impl Layout for Safetensors {
    fn describe(&self) -> &'static str {
        ".safetensors files"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        let ours = |e: &&crate::storage::Entry| e.name().ends_with(".safetensors");
        Ok(match at {
            Listing::File(f) => ours(&f).then(|| Found::at(&f.path)),
            // Several are a split checkpoint without its index: see detection's hint.
            Listing::Dir { .. } => {
                match at.files().into_iter().filter(ours).collect::<Vec<_>>()[..] {
                    [only] => Some(Found::at(&only.path)),
                    _ => None,
                }
            }
            Listing::Files(_) => None,
        })
    }

    fn read(&self, found: &Found, _: &ReadOptions) -> Result<Checkpoint> {
        read(&found.path)
    }
}

/// Read a single safetensors file as a FULL checkpoint rooted at its directory.
pub fn read(path: &Path) -> Result<Checkpoint> {
    let header = read_header(path)?;
    if header.metadata_value(DCP_SHARDING_INFO).is_some() {
        // Its tensors are one rank's slices; read alone they would pass for whole tensors.
        return Err(Error::invalid(format!(
            "file holds one rank's shards of a distributed checkpoint (`__metadata__` has `{DCP_SHARDING_INFO}`)"
        ))
        .file(path)
        .hint("read the directory that holds all the `shard-*-model-*.safetensors` files instead"));
    }
    let (root, file) = split_path(path)?;
    let file: Arc<Path> = file.into();
    let tensors = header
        .tensors
        .iter()
        .map(|t| full_tensor(t, &file, header.data_start))
        .collect::<Result<Vec<_>>>()?;
    Ok(Checkpoint {
        root,
        format: Format::Safetensors,
        world_size: None,
        tensors,
        values: Vec::new(),
        unsupported: unsupported(&header, &file),
        details: Vec::new(),
    })
}

/// The entries of `header`, a header of `file`, whose dtype ckpt does not support.
pub(crate) fn unsupported(header: &Header, file: &Path) -> Vec<Unsupported> {
    header
        .unsupported
        .iter()
        .map(|u| Unsupported {
            name: u.name.clone(),
            dtype: u.code.clone(),
            file: file.to_path_buf(),
        })
        .collect()
}

/// The directory of `path` (`.` for a bare file name) and the file name within it.
pub(crate) fn split_path(path: &Path) -> Result<(PathBuf, PathBuf)> {
    let file = path
        .file_name()
        .ok_or_else(|| Error::usage("path does not name a file").file(path))?;
    let root = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((root, PathBuf::from(file)))
}

/// A header tensor as one whole-tensor piece of `file`, whose data buffer starts at `data_start`.
pub(crate) fn full_tensor(t: &HeaderTensor, file: &Arc<Path>, data_start: u64) -> Result<Tensor> {
    Ok(Tensor {
        name: t.name.clone(),
        key_path: Vec::new(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        pieces: Pieces::single(piece(t, vec![0; t.shape.len()], file, data_start))?,
    })
}

/// A header tensor as the box at `offsets` of some larger tensor.
pub(crate) fn piece(
    t: &HeaderTensor,
    offsets: Vec<u64>,
    file: &Arc<Path>,
    data_start: u64,
) -> Piece {
    Piece {
        offsets,
        sizes: t.shape.clone(),
        data: DataRef {
            file: Arc::clone(file),
            // Cannot saturate: parse_header checked data_start + end against the file length.
            offset: data_start.saturating_add(t.begin),
            strides: contiguous_strides(&t.shape),
            encoding: Encoding::Raw,
        },
    }
}

/// The header of a safetensors file holding `tensors` in the given order, exactly as the Python
/// `safetensors` package writes it: 8-byte length, compact JSON with `__metadata__` first (omitted
/// when `metadata` is empty), padded with spaces to a multiple of 8. Also returns each tensor's
/// `(begin, end)` relative to the data start, which is `header.len()`.
///
/// The Python package orders tensors by dtype (widest first), then name; pass them in that order
/// to reproduce its files exactly. A shape whose byte size overflows `u64` saturates: validate
/// shapes before planning.
pub fn header_bytes(
    tensors: &[(String, DType, Vec<u64>)],
    metadata: &[(String, String)],
) -> (Vec<u8>, Vec<(u64, u64)>) {
    let mut json = String::from("{");
    if !metadata.is_empty() {
        json.push_str("\"__metadata__\":{");
        for (i, (k, v)) in metadata.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&rust_json_string(k));
            json.push(':');
            json.push_str(&rust_json_string(v));
        }
        json.push('}');
    }
    let mut ranges = Vec::with_capacity(tensors.len());
    let mut pos = 0u64;
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let nbytes = numel(shape)
            .and_then(|n| n.checked_mul(dtype.size() as u64))
            .unwrap_or(u64::MAX);
        let end = pos.saturating_add(nbytes);
        if i > 0 || !metadata.is_empty() {
            json.push(',');
        }
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{pos},{end}]}}",
            rust_json_string(name),
            // `plan::check_dtypes` keeps dtypes safetensors lacks out of every file written; only
            // verify's digest plan, never written, gets here with one, named by ckpt's code.
            dtype.safetensors_code().unwrap_or(dtype.code()),
            dims.join(",")
        ));
        ranges.push((pos, end));
        pos = end;
    }
    json.push('}');
    // The crate pads so that the data buffer starts 8-aligned.
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = Vec::with_capacity(json.len() + LEN_PREFIX as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    (out, ranges)
}

/// A JSON string literal as `serde_json` (and so the safetensors crate) writes it.
fn rust_json_string(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

/// A JSON string literal as Python's `json.dumps` writes it by default (`ensure_ascii=True`):
/// every character outside printable ASCII becomes `\uXXXX` (lowercase hex, UTF-16 surrogate
/// pairs above U+FFFF). torch and Hugging Face write their JSON from Python, so byte-identical
/// output needs this rather than serde_json's escaping.
pub(crate) fn python_json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
    out
}

/// A JSON object's members in file order, duplicates kept (serde_json's own maps keep only the
/// last of a duplicated key, which would hide a corrupt or ambiguous file).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Entries<V>(pub(crate) Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Entries<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct EntriesVisitor<V>(PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for EntriesVisitor<V> {
            type Value = Entries<V>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries<V>, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        deserializer.deserialize_map(EntriesVisitor(PhantomData))
    }
}

/// The first key that occurs twice, if any.
pub(crate) fn first_duplicate<V>(entries: &[(String, V)]) -> Option<&str> {
    let mut seen = HashSet::new();
    entries
        .iter()
        .map(|(k, _)| k.as_str())
        .find(|k| !seen.insert(*k))
}

/// A header's members in file order; `__metadata__` parsed as a string map, each other member as
/// a tensor entry.
struct RawHeader(Vec<(String, RawEntry)>);

enum RawEntry {
    /// `None` for `"__metadata__": null`, which the crate accepts.
    Metadata(Option<Entries<String>>),
    Tensor(RawTensor),
}

/// Reads a [`RawHeader`], leaving in `current` the name of the member it was reading, so that an
/// error can name the tensor.
struct HeaderSeed<'a> {
    current: &'a mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = RawHeader;
    fn deserialize<D: Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> std::result::Result<RawHeader, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = RawHeader;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<RawHeader, A::Error> {
        let mut out = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            *self.current = Some(key.clone());
            let entry = if key == "__metadata__" {
                RawEntry::Metadata(map.next_value()?)
            } else {
                RawEntry::Tensor(map.next_value()?)
            };
            out.push((key, entry));
        }
        *self.current = None;
        Ok(RawHeader(out))
    }
}

/// One tensor entry as the `safetensors` crate's `TensorInfo` reads it (a serde-derived struct):
/// the three fields once each, or an array of the three in order; other fields are allowed and
/// ignored but must still be valid JSON within serde_json's depth limit (the crate buffers the
/// entry before reading it); the dtype a string or a one-key `{"F32": null}` (a unit enum
/// variant). The dtype is kept as its name, to be checked with the tensor's name in the error.
struct RawTensor {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

const TENSOR_FIELDS: &[&str] = &["dtype", "shape", "data_offsets"];

impl<'de> Deserialize<'de> for RawTensor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct TensorVisitor;
        impl<'de> Visitor<'de> for TensorVisitor {
            type Value = RawTensor;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tensor entry {\"dtype\", \"shape\", \"data_offsets\"}")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawTensor, A::Error> {
                let (mut dtype, mut shape, mut offsets) = (None, None, None);
                while let Some(field) = map.next_key::<Field>()? {
                    match field {
                        Field::DType if dtype.is_some() => {
                            return Err(de::Error::duplicate_field("dtype"))
                        }
                        Field::DType => dtype = Some(map.next_value::<DTypeName>()?.0),
                        Field::Shape if shape.is_some() => {
                            return Err(de::Error::duplicate_field("shape"))
                        }
                        Field::Shape => shape = Some(map.next_value()?),
                        Field::DataOffsets if offsets.is_some() => {
                            return Err(de::Error::duplicate_field("data_offsets"))
                        }
                        Field::DataOffsets => offsets = Some(map.next_value()?),
                        Field::Other => {
                            map.next_value::<serde_json::Value>()?;
                        }
                    }
                }
                Ok(RawTensor {
                    dtype: dtype.ok_or_else(|| de::Error::missing_field("dtype"))?,
                    shape: shape.ok_or_else(|| de::Error::missing_field("shape"))?,
                    data_offsets: offsets
                        .ok_or_else(|| de::Error::missing_field("data_offsets"))?,
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<RawTensor, A::Error> {
                let missing = |i| de::Error::invalid_length(i, &"an array of 3 elements");
                Ok(RawTensor {
                    dtype: seq
                        .next_element::<DTypeName>()?
                        .ok_or_else(|| missing(0))?
                        .0,
                    shape: seq.next_element()?.ok_or_else(|| missing(1))?,
                    data_offsets: seq.next_element()?.ok_or_else(|| missing(2))?,
                })
            }
        }
        deserializer.deserialize_struct("TensorInfo", TENSOR_FIELDS, TensorVisitor)
    }
}

/// A member name inside a tensor entry.
enum Field {
    DType,
    Shape,
    DataOffsets,
    Other,
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct FieldVisitor;
        impl Visitor<'_> for FieldVisitor {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> std::result::Result<Field, E> {
                Ok(match name {
                    "dtype" => Field::DType,
                    "shape" => Field::Shape,
                    "data_offsets" => Field::DataOffsets,
                    _ => Field::Other,
                })
            }
        }
        deserializer.deserialize_identifier(FieldVisitor)
    }
}

/// A dtype's name, read the way serde reads a unit enum variant: `"F32"` or `{"F32": null}`.
struct DTypeName(String);

impl<'de> Deserialize<'de> for DTypeName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct NameVisitor;
        impl<'de> Visitor<'de> for NameVisitor {
            type Value = DTypeName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a dtype name")
            }
            fn visit_enum<A: EnumAccess<'de>>(
                self,
                data: A,
            ) -> std::result::Result<DTypeName, A::Error> {
                let (name, variant) = data.variant::<String>()?;
                variant.unit_variant()?;
                Ok(DTypeName(name))
            }
        }
        // Any name is taken here; `tensor_entry` refuses the ones ckpt does not know.
        deserializer.deserialize_enum("Dtype", &[], NameVisitor)
    }
}

/// A serde_json error as ours, positioned at the absolute byte it names in `json`, which starts at
/// file offset `base`.
pub(crate) fn json_error(err: &serde_json::Error, json: &[u8], base: u64) -> Error {
    let line_start = if err.line() <= 1 {
        Some(0)
    } else {
        json.iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .nth(err.line() - 2)
            .map(|(i, _)| i + 1)
    };
    let offset = line_start
        .map(|s| {
            s.saturating_add(err.column().saturating_sub(1))
                .min(json.len()) as u64
        })
        .unwrap_or(0);
    // Drop serde_json's own " at line L column C": the byte offset says it better.
    let message = err.to_string();
    let message = match message.rfind(" at line ") {
        Some(i) => message.get(..i).unwrap_or(&message).to_string(),
        None => message,
    };
    Error::invalid(format!("invalid JSON: {message}")).at(base.saturating_add(offset))
}

#[cfg(test)]
mod tests;
