//! safetensors files: header parsing (bounded, checked) and header writing.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! `{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`, then the
//! data buffer that the offsets index. The reader accepts exactly what the `safetensors` crate (and
//! so the Python package) accepts: a capped header length, offsets that tile the data buffer with
//! no hole and no overlap, and a file that ends where the buffer ends. It reads only the header, so
//! a checkpoint of any size is described without touching tensor bytes.
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
use std::fs::File;
use std::io::Read;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::{
    contiguous_strides, numel, Checkpoint, DataRef, Encoding, Format, Piece, Pieces, Tensor,
};

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
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if file_len < LEN_PREFIX {
        return Err(Error::invalid(format!(
            "file is {file_len} bytes, too short for a safetensors header"
        ))
        .file(path)
        .hint("a safetensors file starts with an 8-byte header length; this one is truncated or not safetensors"));
    }
    let mut prefix = [0u8; LEN_PREFIX as usize];
    file.read_exact(&mut prefix)
        .map_err(|e| Error::io(path, e))?;
    let header_len =
        check_header_len(u64::from_le_bytes(prefix), file_len).map_err(|e| e.file(path))?;
    let mut json = vec![0u8; header_len];
    file.read_exact(&mut json).map_err(|e| Error::io(path, e))?;
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
fn parse_header(json: &[u8], file_len: u64) -> Result<Header> {
    let data_start = LEN_PREFIX + json.len() as u64;
    if json.first() != Some(&b'{') {
        // The safetensors crate rejects this too (`InvalidHeaderStart`), so a file we accepted
        // would not load.
        return Err(Error::invalid("header does not start with `{`")
            .at(LEN_PREFIX)
            .hint("the file is not safetensors, or its header is corrupt"));
    }
    let text = std::str::from_utf8(json).map_err(|e| {
        Error::invalid("header is not valid UTF-8").at(LEN_PREFIX + e.valid_up_to() as u64)
    })?;
    let raw: RawHeader =
        serde_json::from_str(text).map_err(|e| json_error(&e, json, LEN_PREFIX))?;

    let mut seen = HashSet::new();
    let mut metadata = None;
    let mut tensors = Vec::with_capacity(raw.0.len());
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
            RawEntry::Tensor(value) => {
                tensors.push(tensor_entry(&name, &value).map_err(|e| e.tensor(&name))?)
            }
        }
    }

    // The crate sorts by (begin, end) before checking that the offsets tile the buffer, so an
    // empty tensor at the start of another one's range is fine.
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut expected = 0u64;
    let mut previous: Option<&HeaderTensor> = None;
    for t in &tensors {
        let at = data_start.saturating_add(t.begin);
        if t.begin < expected {
            let prev = previous.map(|p| p.name.as_str()).unwrap_or_default();
            return Err(Error::invalid(format!(
                "data_offsets [{}, {}] overlap tensor `{prev}`, which ends at data byte {expected}",
                t.begin, t.end
            ))
            .tensor(&t.name)
            .at(at));
        }
        if t.begin > expected {
            return Err(Error::invalid(format!(
                "{} bytes before data_offsets [{}, {}] belong to no tensor",
                t.begin - expected,
                t.begin,
                t.end
            ))
            .tensor(&t.name)
            .at(data_start.saturating_add(expected))
            .hint("safetensors requires the tensors to cover the data buffer exactly"));
        }
        expected = t.end;
        previous = Some(t);
    }

    let Some(needed) = data_start.checked_add(expected) else {
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

    Ok(Header {
        data_start,
        tensors,
        metadata: metadata.unwrap_or_default(),
    })
}

/// Interpret one `name: {...}` entry of the header.
fn tensor_entry(name: &str, value: &serde_json::Value) -> Result<HeaderTensor> {
    let at = |e: Error| e.at(LEN_PREFIX);
    let obj = value
        .as_object()
        .ok_or_else(|| at(Error::invalid("header entry is not an object")))?;
    let code = obj
        .get("dtype")
        .and_then(|v| v.as_str())
        .ok_or_else(|| at(Error::invalid("`dtype` is missing or not a string")))?;
    let dtype = DType::from_safetensors_code(code).ok_or_else(|| {
        let known: Vec<&str> = DType::ALL.iter().map(|d| d.safetensors_code()).collect();
        at(Error::invalid(format!("unknown dtype `{code}`"))
            .hint(format!("ckpt handles {}", known.join(", "))))
    })?;
    let shape = obj
        .get("shape")
        .and_then(|v| v.as_array())
        .and_then(|dims| {
            dims.iter()
                .map(|d| d.as_u64())
                .collect::<Option<Vec<u64>>>()
        })
        .ok_or_else(|| {
            at(Error::invalid(
                "`shape` is missing or not a list of non-negative integers",
            ))
        })?;
    let (begin, end) = match obj
        .get("data_offsets")
        .and_then(|v| v.as_array())
        .map(|a| a.as_slice())
    {
        Some([b, e]) => match (b.as_u64(), e.as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => {
                return Err(at(Error::invalid(
                    "`data_offsets` must be two non-negative integers",
                )))
            }
        },
        _ => {
            return Err(at(Error::invalid(
                "`data_offsets` is missing or not a [begin, end] pair",
            )))
        }
    };
    if end < begin {
        return Err(Error::invalid(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        ))
        .at(LEN_PREFIX));
    }
    let nbytes = numel(&shape).and_then(|n| n.checked_mul(dtype.size() as u64));
    if nbytes != Some(end - begin) {
        let needs = nbytes.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string());
        return Err(Error::invalid(format!(
            "shape {shape:?} of {dtype} needs {needs} bytes, data_offsets [{begin}, {end}] hold {}",
            end - begin
        ))
        .at(LEN_PREFIX));
    }
    Ok(HeaderTensor {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
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
    })
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
            dtype.safetensors_code(),
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

/// A header's members in file order; `__metadata__` parsed as a string map, tensors kept as JSON
/// values to be checked one by one with their name in the error.
struct RawHeader(Vec<(String, RawEntry)>);

enum RawEntry {
    /// `None` for `"__metadata__": null`, which the crate accepts.
    Metadata(Option<Entries<String>>),
    Tensor(serde_json::Value),
}

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct HeaderVisitor;
        impl<'de> Visitor<'de> for HeaderVisitor {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawHeader, A::Error> {
                let mut out = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let entry = if key == "__metadata__" {
                        RawEntry::Metadata(map.next_value()?)
                    } else {
                        RawEntry::Tensor(map.next_value()?)
                    };
                    out.push((key, entry));
                }
                Ok(RawHeader(out))
            }
        }
        deserializer.deserialize_map(HeaderVisitor)
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<(String, DType, Vec<u64>)> {
        vec![
            ("w".to_string(), DType::F32, vec![2, 3]),
            ("b".to_string(), DType::BF16, vec![3]),
            ("empty".to_string(), DType::I64, vec![0, 4]),
            ("scalar".to_string(), DType::U8, vec![]),
        ]
    }

    /// A complete file: header plus zeroed data.
    fn file_bytes(tensors: &[(String, DType, Vec<u64>)], metadata: &[(String, String)]) -> Vec<u8> {
        let (mut bytes, ranges) = header_bytes(tensors, metadata);
        let data_len = ranges.last().map_or(0, |r| r.1) as usize;
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }

    /// A file with a hand-written JSON header (padding not applied) and `data_len` data bytes.
    fn raw_file(json: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        bytes.resize(bytes.len() + data_len, 0);
        bytes
    }

    fn write(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn parse(bytes: &[u8]) -> Result<Header> {
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        let n = check_header_len(len, bytes.len() as u64)?;
        parse_header(&bytes[8..8 + n], bytes.len() as u64)
    }

    #[test]
    fn header_matches_python_layout() {
        let meta = vec![("format".to_string(), "pt".to_string())];
        let (bytes, ranges) = header_bytes(&sample(), &meta);
        let json = std::str::from_utf8(&bytes[8..]).unwrap();
        assert_eq!(
            json.trim_end(),
            r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]},"empty":{"dtype":"I64","shape":[0,4],"data_offsets":[30,30]},"scalar":{"dtype":"U8","shape":[],"data_offsets":[30,31]}}"#
        );
        assert_eq!(bytes.len() % 8, 0);
        assert_eq!(
            u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize,
            bytes.len() - 8
        );
        assert_eq!(ranges, vec![(0, 24), (24, 30), (30, 30), (30, 31)]);
    }

    #[test]
    fn header_without_metadata_or_tensors() {
        let (bytes, ranges) = header_bytes(&[], &[]);
        assert_eq!(&bytes[8..], b"{}      ");
        assert!(ranges.is_empty());
        let h = parse(&bytes).unwrap();
        assert_eq!(h.data_start, 16);
        assert!(h.tensors.is_empty() && h.metadata.is_empty());
    }

    #[test]
    fn round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let meta = vec![
            ("format".to_string(), "pt".to_string()),
            ("k\"é".to_string(), "v\n".to_string()),
        ];
        let path = write(&dir, "m.safetensors", &file_bytes(&sample(), &meta));
        let h = read_header(&path).unwrap();
        assert_eq!(h.metadata, meta);
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        // Sorted by (begin, end): the empty tensor sits at 30..30, before `scalar` at 30..31.
        assert_eq!(names, ["w", "b", "empty", "scalar"]);
        assert_eq!(h.tensors[1].dtype, DType::BF16);
        assert_eq!((h.tensors[1].begin, h.tensors[1].end), (24, 30));

        let ckpt = read(&path).unwrap();
        assert_eq!(ckpt.format, Format::Safetensors);
        assert_eq!(ckpt.root, dir.path());
        let w = &ckpt.tensors[0];
        assert_eq!(w.shape, vec![2, 3]);
        assert_eq!(w.pieces.len(), 1);
        let p = w.pieces.get(0);
        assert_eq!(p.offsets(), [0, 0]);
        assert_eq!(p.sizes(), [2, 3]);
        assert_eq!(&**p.file(), Path::new("m.safetensors"));
        assert_eq!(p.offset(), h.data_start);
        assert_eq!(&*p.strides(), [3, 1]);
        assert_eq!(ckpt.tensors[1].pieces.get(0).offset(), h.data_start + 24);
        assert_eq!(ckpt.tensors[3].pieces.get(0).offsets(), [] as [u64; 0]);
    }

    #[test]
    fn file_order_not_header_order() {
        // A hand-written header listing tensors out of data order.
        let json = r#"{"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#;
        let h = parse(&raw_file(json, 5)).unwrap();
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.tensors[1].name, "b");
        assert_eq!(h.data_start, 8 + json.len() as u64);
    }

    #[test]
    fn truncated_file_says_how_much_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = file_bytes(&sample(), &[]);
        let full = bytes.len();
        bytes.truncate(full - 7);
        let path = write(&dir, "t.safetensors", &bytes);
        let err = read_header(&path).unwrap_err();
        assert_eq!(
            err.message,
            format!(
                "file is {} bytes, header says {full} (7 bytes missing)",
                full - 7
            )
        );
        assert_eq!(err.file.as_deref(), Some(path.as_path()));
        assert!(err.hint.is_some());
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = file_bytes(&sample(), &[]);
        bytes.push(0);
        let err = parse(&bytes).unwrap_err();
        assert!(err.message.contains("1 trailing bytes"), "{}", err.message);
    }

    #[test]
    fn header_longer_than_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = file_bytes(&sample(), &[]);
        bytes.truncate(40);
        let path = write(&dir, "h.safetensors", &bytes);
        let err = read_header(&path).unwrap_err();
        assert!(
            err.message
                .contains("runs past the end of the file (40 bytes)"),
            "{}",
            err.message
        );
        assert_eq!(err.offset, Some(0));

        let short = write(&dir, "s.safetensors", b"abc");
        let err = read_header(&short).unwrap_err();
        assert_eq!(
            err.message,
            "file is 3 bytes, too short for a safetensors header"
        );
    }

    #[test]
    fn huge_header_length_is_capped() {
        let mut bytes = u64::MAX.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        let err = parse(&bytes).unwrap_err();
        assert!(err.message.contains("exceeds"), "{}", err.message);
    }

    #[test]
    fn overlapping_offsets() {
        let json = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
        let err = parse(&raw_file(json, 4)).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("b"));
        assert!(
            err.message.contains("overlap tensor `a`"),
            "{}",
            err.message
        );
        assert_eq!(err.offset, Some(8 + json.len() as u64 + 2));
    }

    #[test]
    fn hole_in_data() {
        let json = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
        let err = parse(&raw_file(json, 6)).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("b"));
        assert!(err.message.starts_with("1 bytes before"), "{}", err.message);
    }

    #[test]
    fn unknown_dtype_names_tensor_and_code() {
        let json = r#"{"x":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#;
        let err = parse(&raw_file(json, 1)).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("x"));
        assert_eq!(err.message, "unknown dtype `F4`");
        assert!(err.hint.as_deref().unwrap().contains("BF16"));
    }

    #[test]
    fn size_mismatch_and_overflow() {
        let json = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#;
        let err = parse(&raw_file(json, 4)).unwrap_err();
        assert!(err.message.contains("needs 8 bytes"), "{}", err.message);
        let json = r#"{"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#;
        let err = parse(&raw_file(json, 4)).unwrap_err();
        assert!(err.message.contains("more than 2^64"), "{}", err.message);
        let json = r#"{"x":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#;
        assert!(parse(&raw_file(json, 0)).is_err());
    }

    #[test]
    fn duplicates_are_rejected() {
        let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        let err = parse(&raw_file(json, 2)).unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("a"));
        let json = r#"{"__metadata__":{"k":"1","k":"2"}}"#;
        let err = parse(&raw_file(json, 0)).unwrap_err();
        assert!(err.message.contains("`k` twice"), "{}", err.message);
    }

    #[test]
    fn malformed_json_is_located() {
        let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},}"#;
        let err = parse(&raw_file(json, 1)).unwrap_err();
        assert!(err.message.starts_with("invalid JSON: "), "{}", err.message);
        assert!(!err.message.contains("line"), "{}", err.message);
        let at = err.offset.unwrap() as usize;
        assert!((8 + json.len() - 2..=8 + json.len()).contains(&at), "{at}");

        let json = r#"{"__metadata__":{"k":1}}"#;
        assert!(parse(&raw_file(json, 0)).is_err());
        let json = r#"[1]"#;
        assert!(parse(&raw_file(json, 0)).is_err());
        let json = r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#;
        assert!(parse(&raw_file(json, 1)).is_err());
        let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}"#;
        assert!(parse(&raw_file(json, 1)).is_err());
    }

    #[test]
    fn null_metadata_is_accepted() {
        let json = r#"{"__metadata__":null}"#;
        assert!(parse(&raw_file(json, 0)).unwrap().metadata.is_empty());
    }

    #[test]
    fn shard_files_are_not_read_as_full() {
        let dir = tempfile::tempdir().unwrap();
        let meta = vec![(DCP_SHARDING_INFO.to_string(), "{}".to_string())];
        let path = write(&dir, "shard.safetensors", &file_bytes(&sample(), &meta));
        let err = read(&path).unwrap_err();
        assert!(err.message.contains(DCP_SHARDING_INFO));
        assert!(err.hint.is_some());
    }

    #[test]
    fn python_strings() {
        assert_eq!(python_json_string("a\"b\\c\n"), r#""a\"b\\c\n""#);
        assert_eq!(
            python_json_string("é😀\u{7f}\u{1}"),
            r#""\u00e9\ud83d\ude00\u007f\u0001""#
        );
        assert_eq!(rust_json_string("é\u{1}"), "\"é\\u0001\"");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Random byte edits, truncations and extensions of a valid file never panic the parser.
        #[test]
        fn mutations_never_panic(
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
            extra in proptest::collection::vec(any::<u8>(), 0..4),
            truncate in any::<bool>(),
        ) {
            let mut bytes = file_bytes(&sample(), &[("format".to_string(), "pt".to_string())]);
            for (pos, byte) in edits {
                let i = pos % bytes.len();
                bytes[i] = byte;
            }
            if truncate {
                bytes.truncate(cut % (bytes.len() + 1));
            }
            bytes.extend_from_slice(&extra);
            if bytes.len() >= 8 {
                let _ = parse(&bytes);
            }
        }
    }

    #[test]
    fn mutations_through_the_file_api_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let base = file_bytes(&sample(), &[]);
        for len in 0..base.len() {
            let path = write(&dir, "p.safetensors", &base[..len]);
            assert!(read_header(&path).is_err());
        }
        for i in 0..base.len() {
            let mut bytes = base.clone();
            bytes[i] ^= 0xff;
            let path = write(&dir, "p.safetensors", &bytes);
            let _ = read_header(&path);
        }
    }
}
