//! ckpt's safetensors header reader against the reference reader, the `safetensors` crate (which
//! the Python package wraps): over generated headers and their mutations, ckpt accepts a file
//! exactly when the crate does, and then reads the same tensors and metadata. The only exceptions
//! are the cases in `oracle::STRICTER` (ckpt refuses on purpose, each with its reason, as
//! docs/guarantees.md says) and `oracle::NOT_YET` (sub-byte dtypes ckpt keeps aside by name, never generated here).
//!
//! Files start valid (tensors laid out back to back, header members in any order, keys escaped
//! or not, optional `__metadata__`), then get JSON-level edits (a field repeated, dropped or
//! given an odd value, an entry written as an array, a name used twice, `__metadata__` variants,
//! offsets shifted into gaps and overlaps, unknown fields nested near serde_json's depth limit),
//! text-level edits (whitespace or junk before and after the JSON, a trailing comma) and
//! byte-level edits (the length field, flipped bytes, truncation, trailing bytes).

// ckpt's error carries file, tensor, offset and hint; the library allows its size the same way.
#![allow(clippy::result_large_err)]

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use ckpt::formats::safetensors::read_header;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

mod oracle;
use oracle::{top_members, Verdict, STRICTER};

/// Every dtype ckpt reads, with its element size in bytes.
const DTYPES: &[(&str, u64)] = &[
    ("BOOL", 1),
    ("U8", 1),
    ("I8", 1),
    ("F8_E5M2", 1),
    ("F8_E4M3", 1),
    ("F8_E8M0", 1),
    ("F8_E4M3FNUZ", 1),
    ("F8_E5M2FNUZ", 1),
    ("I16", 2),
    ("U16", 2),
    ("F16", 2),
    ("BF16", 2),
    ("I32", 4),
    ("U32", 4),
    ("F32", 4),
    ("F64", 8),
    ("I64", 8),
    ("U64", 8),
    ("C64", 8),
];

// ---------------------------------------------------------------------------------------------
// A JSON document with its members in order and duplicates kept, written out in several styles.

#[derive(Clone, Debug)]
enum Json {
    /// Written as is: numbers, literals, and deliberately broken tokens.
    Raw(String),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

/// How a document is written out.
#[derive(Clone, Debug)]
struct Style {
    /// Whitespace between tokens (`""` for compact).
    space: &'static str,
    /// Write every non-ASCII-alphanumeric character of a string as `\uXXXX`.
    escape_all: bool,
    /// Pad the header with spaces to a multiple of 8, as the Python writer does.
    pad: bool,
}

fn quote(s: &str, escape_all: bool) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || (escape_all && !c.is_ascii_alphanumeric()) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn render(j: &Json, style: &Style, out: &mut String) {
    let sp = style.space;
    match j {
        Json::Raw(t) => out.push_str(t),
        Json::Str(s) => out.push_str(&quote(s, style.escape_all)),
        Json::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(sp);
                render(item, style, out);
            }
            out.push_str(sp);
            out.push(']');
        }
        Json::Obj(members) => {
            out.push('{');
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(sp);
                out.push_str(&quote(k, style.escape_all));
                out.push_str(sp);
                out.push(':');
                out.push_str(sp);
                render(v, style, out);
            }
            out.push_str(sp);
            out.push('}');
        }
    }
}

fn int(n: u64) -> Json {
    Json::Raw(n.to_string())
}

// ---------------------------------------------------------------------------------------------
// Valid files.

/// Tensor names: plain, dotted, unicode, empty, quotes and backslashes, control characters, and
/// near misses of `__metadata__`.
const NAMES: &[&str] = &[
    "a",
    "w",
    "layers.0.weight",
    "é",
    "😀",
    "",
    " ",
    "q\"uote",
    "back\\slash",
    "\u{1}",
    "__metadata_",
    "__METADATA__",
    "x\u{0}y",
];

const META_KEYS: &[&str] = &["format", "", "é", "k\"", "DCP_VERSION", "__metadata__"];
const META_VALUES: &[&str] = &["pt", "", "1.0", "😀", "\u{0}", "{\"a\": 1}"];

#[derive(Clone, Debug)]
struct Spec {
    /// (name, dtype, shape), in the order of their bytes in the data buffer.
    tensors: Vec<(String, &'static str, Vec<u64>)>,
    metadata: Option<Vec<(String, String)>>,
    /// Where `__metadata__` goes among the header's members, and the order of the tensors there.
    metadata_at: usize,
    order: Vec<usize>,
    style: Style,
}

fn spec() -> impl Strategy<Value = Spec> {
    let tensors = (
        prop::sample::subsequence(NAMES.to_vec(), 0..=5),
        prop::collection::vec(
            (
                prop::sample::select(DTYPES.to_vec()),
                prop::collection::vec(0u64..4, 0..=3),
            ),
            5,
        ),
    )
        .prop_map(|(names, rest)| {
            names
                .into_iter()
                .zip(rest)
                .map(|(n, ((code, _), shape))| (n.to_string(), code, shape))
                .collect::<Vec<_>>()
        })
        .prop_shuffle();
    let metadata = prop::option::of(
        (
            prop::sample::subsequence(META_KEYS.to_vec(), 0..=3),
            prop::collection::vec(prop::sample::select(META_VALUES.to_vec()), 3),
        )
            .prop_map(|(keys, values)| {
                keys.into_iter()
                    .zip(values)
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<Vec<_>>()
            }),
    );
    let style = (
        prop::sample::select(vec!["", "", " ", "\n", "\t", " \r\n"]),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(space, escape_all, pad)| Style {
            space,
            escape_all,
            pad,
        });
    (tensors, metadata, 0usize..8, any::<u64>(), style).prop_map(
        |(tensors, metadata, metadata_at, seed, style)| {
            // Header order: a rotation plus a reversal of the data order, from the seed.
            let n = tensors.len();
            let mut order: Vec<usize> = (0..n).collect();
            if n > 0 {
                order.rotate_left(seed as usize % n);
                if seed & (1 << 40) != 0 {
                    order.reverse();
                }
            }
            Spec {
                tensors,
                metadata,
                metadata_at,
                order,
                style,
            }
        },
    )
}

fn dtype_size(code: &str) -> u64 {
    DTYPES.iter().find(|(c, _)| *c == code).map_or(1, |d| d.1)
}

/// The header members of a valid file, and the length of its data buffer.
fn members(spec: &Spec) -> (Vec<(String, Json)>, u64) {
    let mut pos = 0;
    let mut entries = Vec::new();
    for (name, code, shape) in &spec.tensors {
        let nbytes = shape.iter().product::<u64>() * dtype_size(code);
        let entry = Json::Obj(vec![
            ("dtype".into(), Json::Str(code.to_string())),
            (
                "shape".into(),
                Json::Arr(shape.iter().map(|&d| int(d)).collect()),
            ),
            (
                "data_offsets".into(),
                Json::Arr(vec![int(pos), int(pos + nbytes)]),
            ),
        ]);
        entries.push((name.clone(), entry));
        pos += nbytes;
    }
    let mut out: Vec<(String, Json)> = spec.order.iter().map(|&i| entries[i].clone()).collect();
    if let Some(meta) = &spec.metadata {
        let value = Json::Obj(
            meta.iter()
                .map(|(k, v)| (k.clone(), Json::Str(v.clone())))
                .collect(),
        );
        let at = spec.metadata_at.min(out.len());
        out.insert(at, ("__metadata__".into(), value));
    }
    (out, pos)
}

// ---------------------------------------------------------------------------------------------
// Mutations.

/// Odd JSON values: the wrong type, numbers at and past the integer limits, floats and negative
/// zero, strings with lone surrogates, dtypes in other spellings or forms, nesting around
/// serde_json's depth limit of 128.
fn odd_value() -> impl Strategy<Value = Json> {
    let raw = prop::sample::select(vec![
        "0",
        "1",
        "-1",
        "-0",
        "1.0",
        "1e2",
        "1e400",
        "4294967296",
        "18446744073709551615",
        "18446744073709551616",
        "null",
        "true",
        "[]",
        "{}",
        "\"\\ud800\"",
        "\"\\udc00\\ud800\"",
        "\"\\ud83d\\ude00\"",
        "\"\\x\"",
    ])
    .prop_map(|t| Json::Raw(t.to_string()));
    let nested = (
        prop::sample::select(vec![1usize, 60, 124, 125, 126, 127, 128, 129, 200]),
        any::<bool>(),
    )
        .prop_map(|(depth, objects)| {
            Json::Raw(if objects {
                format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
            } else {
                format!("{}{}", "[".repeat(depth), "]".repeat(depth))
            })
        });
    let dtype_spellings = prop::sample::select(vec![
        "U8",
        "F32",
        "BF16",
        "BOOL",
        "u8",
        "f32",
        "F8_E4M3FN",
        "Bool",
        "F33",
        "",
        " U8",
        "U8 ",
    ])
    .prop_map(|s| Json::Str(s.to_string()));
    let dtype_forms = prop::sample::select(vec![
        "{\"U8\":null}",
        "{\"F32\":null}",
        "{\"U8\":1}",
        "{\"U8\":[]}",
        "{\"U8\":{}}",
        "{\"U8\":null,\"U8\":null}",
        "{}",
        "[\"U8\"]",
    ])
    .prop_map(|t| Json::Raw(t.to_string()));
    let ints = prop::collection::vec(
        prop::sample::select(vec![
            "0",
            "1",
            "2",
            "3",
            "4",
            "8",
            "-1",
            "-0",
            "1.0",
            "\"1\"",
            "null",
            "4294967296",
            "2305843009213693952",
            "18446744073709551615",
            "18446744073709551616",
        ]),
        0..4,
    )
    .prop_map(|v| Json::Arr(v.into_iter().map(|t| Json::Raw(t.to_string())).collect()));
    prop_oneof![raw, nested, dtype_spellings, dtype_forms, ints]
}

#[derive(Clone, Debug)]
enum Edit {
    /// A field of an entry written again after the others, with the same or another value.
    RepeatField(usize, usize, Option<Json>),
    DropField(usize, usize),
    SetField(usize, usize, Json),
    /// A field the format does not define.
    ExtraField(usize, &'static str, Json),
    /// `["U8", [1], [0, 1]]` for `{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}`.
    EntryAsArray(usize),
    SetEntry(usize, Json),
    /// The member's name used again, with its own value or another.
    DuplicateMember(usize, Option<Json>),
    Rename(usize, &'static str),
    SetMetadata(Json),
    MetadataDuplicateKey,
    MetadataTwice,
    /// `data_offsets[which] += delta`: gaps, overlaps, backwards ranges.
    ShiftOffset(usize, usize, i64),
    Swap(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let i = any::<usize>;
    prop_oneof![
        4 => (i(), i(), prop::option::of(odd_value()))
            .prop_map(|(e, f, v)| Edit::RepeatField(e, f, v)),
        1 => (i(), i()).prop_map(|(e, f)| Edit::DropField(e, f)),
        4 => (i(), i(), odd_value()).prop_map(|(e, f, v)| Edit::SetField(e, f, v)),
        2 => (
            i(),
            prop::sample::select(vec!["extra", "DTYPE", "dtype ", "data_offset", ""]),
            odd_value()
        )
            .prop_map(|(e, k, v)| Edit::ExtraField(e, k, v)),
        1 => i().prop_map(Edit::EntryAsArray),
        1 => (i(), odd_value()).prop_map(|(e, v)| Edit::SetEntry(e, v)),
        2 => (i(), prop::option::of(odd_value())).prop_map(|(e, v)| Edit::DuplicateMember(e, v)),
        1 => (
            i(),
            prop::sample::select(vec!["__metadata__", "a", "", "\u{7f}", "__metadata__ "])
        )
            .prop_map(|(e, n)| Edit::Rename(e, n)),
        1 => odd_value().prop_map(Edit::SetMetadata),
        1 => Just(Edit::MetadataDuplicateKey),
        1 => Just(Edit::MetadataTwice),
        3 => (i(), 0usize..2, -9i64..9).prop_map(|(e, w, d)| Edit::ShiftOffset(e, w, d)),
        1 => (i(), i()).prop_map(|(a, b)| Edit::Swap(a, b)),
    ]
}

fn fields_of(j: &mut Json) -> Option<&mut Vec<(String, Json)>> {
    match j {
        Json::Obj(fields) if !fields.is_empty() => Some(fields),
        _ => None,
    }
}

fn apply(edit: &Edit, doc: &mut Vec<(String, Json)>) {
    let n = doc.len();
    let member = |i: usize| i % n.max(1);
    if n == 0
        && !matches!(
            edit,
            Edit::SetMetadata(_) | Edit::MetadataDuplicateKey | Edit::MetadataTwice
        )
    {
        return;
    }
    match edit {
        Edit::RepeatField(e, f, v) => {
            if let Some(fields) = fields_of(&mut doc[member(*e)].1) {
                let (k, own) = fields[f % fields.len()].clone();
                fields.push((k, v.clone().unwrap_or(own)));
            }
        }
        Edit::DropField(e, f) => {
            if let Some(fields) = fields_of(&mut doc[member(*e)].1) {
                let at = f % fields.len();
                fields.remove(at);
            }
        }
        Edit::SetField(e, f, v) => {
            if let Some(fields) = fields_of(&mut doc[member(*e)].1) {
                let at = f % fields.len();
                fields[at].1 = v.clone();
            }
        }
        Edit::ExtraField(e, k, v) => {
            if let Json::Obj(fields) = &mut doc[member(*e)].1 {
                fields.push((k.to_string(), v.clone()));
            }
        }
        Edit::EntryAsArray(e) => {
            let entry = &mut doc[member(*e)].1;
            if let Json::Obj(fields) = entry {
                let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|f| f.1.clone());
                if let (Some(d), Some(s), Some(o)) =
                    (get("dtype"), get("shape"), get("data_offsets"))
                {
                    *entry = Json::Arr(vec![d, s, o]);
                }
            }
        }
        Edit::SetEntry(e, v) => doc[member(*e)].1 = v.clone(),
        Edit::DuplicateMember(e, v) => {
            let (k, own) = doc[member(*e)].clone();
            doc.push((k, v.clone().unwrap_or(own)));
        }
        Edit::Rename(e, name) => doc[member(*e)].0 = name.to_string(),
        Edit::SetMetadata(v) => match doc.iter_mut().find(|(k, _)| k == "__metadata__") {
            Some(m) => m.1 = v.clone(),
            None => doc.insert(0, ("__metadata__".into(), v.clone())),
        },
        Edit::MetadataDuplicateKey => {
            let pair = ("k".to_string(), Json::Str("1".into()));
            match doc.iter_mut().find(|(k, _)| k == "__metadata__") {
                Some((_, Json::Obj(m))) => {
                    let first = m.first().cloned().unwrap_or(pair);
                    m.push((first.0, Json::Str("2".into())));
                }
                Some(_) => {}
                None => doc.push((
                    "__metadata__".into(),
                    Json::Obj(vec![pair.clone(), (pair.0, Json::Str("2".into()))]),
                )),
            }
        }
        Edit::MetadataTwice => doc.push(("__metadata__".into(), Json::Obj(vec![]))),
        Edit::ShiftOffset(e, which, delta) => {
            if let Json::Obj(fields) = &mut doc[member(*e)].1 {
                for (k, v) in fields.iter_mut() {
                    if let (true, Json::Arr(items)) = (k == "data_offsets", &mut *v) {
                        if let Some(Json::Raw(t)) = items.get_mut(*which) {
                            if let Ok(x) = t.parse::<i64>() {
                                *t = (x + delta).to_string();
                            }
                        }
                    }
                }
            }
        }
        Edit::Swap(a, b) => doc.swap(member(*a), member(*b)),
    }
}

/// Edits of the header text.
#[derive(Clone, Debug)]
enum TextEdit {
    Prefix(&'static str),
    Suffix(&'static str),
    TrailingComma,
}

fn text_edit() -> impl Strategy<Value = TextEdit> {
    // JSON's whitespace (space, \t, \n, \r), other whitespace it does not allow (\x0b, \x0c,
    // no-break space, BOM), a NUL, and plain junk.
    let pieces = vec![
        " ", "\n", "\t", "\r", "  \n\t", "\u{b}", "\u{c}", "\u{a0}", "\u{feff}", "\0", "x", "}",
        ",", "{}",
    ];
    prop_oneof![
        prop::sample::select(pieces.clone()).prop_map(TextEdit::Prefix),
        prop::sample::select(pieces).prop_map(TextEdit::Suffix),
        Just(TextEdit::TrailingComma),
    ]
}

fn apply_text(edit: &TextEdit, text: &mut String) {
    match edit {
        TextEdit::Prefix(p) => text.insert_str(0, p),
        TextEdit::Suffix(s) => text.push_str(s),
        TextEdit::TrailingComma => {
            if let Some(i) = text.rfind('}') {
                text.insert(i, ',');
            }
        }
    }
}

/// Edits of the finished file.
#[derive(Clone, Debug)]
enum ByteEdit {
    LenDelta(i64),
    LenSet(u64),
    Set(usize, u8),
    Truncate(usize),
    Append(Vec<u8>),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        (-9i64..9).prop_map(ByteEdit::LenDelta),
        prop::sample::select(vec![0, 1, 2, 100_000_000, 100_000_001, u64::MAX])
            .prop_map(ByteEdit::LenSet),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| ByteEdit::Set(i, b)),
        any::<usize>().prop_map(ByteEdit::Truncate),
        prop::collection::vec(any::<u8>(), 1..4).prop_map(ByteEdit::Append),
    ]
}

fn apply_bytes(edit: &ByteEdit, file: &mut Vec<u8>) {
    let len_field = |file: &Vec<u8>| u64::from_le_bytes(file[..8].try_into().unwrap());
    match edit {
        ByteEdit::LenDelta(d) => {
            let n = len_field(file).wrapping_add(*d as u64);
            file[..8].copy_from_slice(&n.to_le_bytes());
        }
        ByteEdit::LenSet(n) => file[..8].copy_from_slice(&n.to_le_bytes()),
        ByteEdit::Set(i, b) => {
            let at = i % file.len();
            file[at] = *b;
        }
        ByteEdit::Truncate(i) => file.truncate(i % (file.len() + 1)),
        ByteEdit::Append(bytes) => file.extend_from_slice(bytes),
    }
}

#[derive(Clone, Debug)]
struct Case {
    spec: Spec,
    edits: Vec<Edit>,
    text_edits: Vec<TextEdit>,
    byte_edits: Vec<ByteEdit>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        spec(),
        prop::collection::vec(edit(), 0..3),
        prop::collection::vec(text_edit(), 0..2),
        // Most files keep their framing, so that the JSON edits reach the parser.
        prop_oneof![
            3 => Just(Vec::new()),
            1 => prop::collection::vec(byte_edit(), 1..3),
        ],
    )
        .prop_map(|(spec, edits, text_edits, byte_edits)| Case {
            spec,
            edits,
            text_edits,
            byte_edits,
        })
}

fn file_of(case: &Case) -> Vec<u8> {
    let (mut doc, data_len) = members(&case.spec);
    for e in &case.edits {
        apply(e, &mut doc);
    }
    let mut text = String::new();
    render(&Json::Obj(doc), &case.spec.style, &mut text);
    for e in &case.text_edits {
        apply_text(e, &mut text);
    }
    if case.spec.style.pad {
        while text.len() % 8 != 0 {
            text.push(' ');
        }
    }
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(text.as_bytes());
    // A recognisable pattern, not zeros, so a misplaced data start would show.
    file.extend((0..data_len).map(|i| (i % 251) as u8));
    for e in &case.byte_edits {
        let applies = match e {
            ByteEdit::LenDelta(_) | ByteEdit::LenSet(_) => file.len() >= 8,
            ByteEdit::Set(..) => !file.is_empty(),
            ByteEdit::Truncate(_) | ByteEdit::Append(_) => true,
        };
        if applies {
            apply_bytes(e, &mut file);
        }
    }
    file
}

/// Counts over a run, so that a generator that drifts to one side is noticed.
#[derive(Default)]
struct Tally {
    both_read: AtomicUsize,
    both_refused: AtomicUsize,
    excused: AtomicUsize,
}

/// Compare ckpt and the reference on one file written at `path`.
fn agree(path: &Path, file: &[u8], tally: &Tally) -> Result<(), TestCaseError> {
    std::fs::write(path, file).unwrap();
    let counter = match oracle::compare(read_header(path), file) {
        Verdict::BothRead => &tally.both_read,
        Verdict::BothRefused => &tally.both_refused,
        Verdict::Excused(_) => &tally.excused,
        Verdict::Disagree(e) => return Err(TestCaseError::fail(e)),
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// A scratch directory in memory where there is one: thousands of small file writes to a disk
/// would take most of the run.
fn scratch() -> tempfile::TempDir {
    match tempfile::tempdir_in("/dev/shm") {
        Ok(dir) => dir,
        Err(_) => tempfile::tempdir().expect("temp dir"),
    }
}

#[test]
fn ckpt_reads_exactly_what_the_reference_reads() {
    let dir = scratch();
    let path = dir.path().join("case.safetensors");
    let tally = Tally::default();
    let config = Config {
        // PROPTEST_CASES=200000 for a longer search.
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(5000),
        // Failures print the file; there is no source file to keep regressions beside.
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&case(), |case| agree(&path, &file_of(&case), &tally));
    if let Err(e) = result {
        panic!("{e}");
    }
    let read = tally.both_read.load(Ordering::Relaxed);
    let refused = tally.both_refused.load(Ordering::Relaxed);
    let excused = tally.excused.load(Ordering::Relaxed);
    let total = read + refused + excused;
    eprintln!("both read {read}, both refused {refused}, excused {excused}");
    // Both sides of the boundary get real traffic.
    assert!(
        read * 10 >= total && refused * 10 >= total,
        "{read} read, {refused} refused"
    );
}

/// A file of `json` as its header and `data` zero bytes.
fn raw(json: &str, data: usize) -> Vec<u8> {
    let mut f = (json.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(json.as_bytes());
    f.extend(std::iter::repeat_n(0u8, data));
    f
}

/// Whether ckpt and the reference read one such file, after checking they agree on it.
fn check_fixed(json: &str, data: usize) -> (bool, bool) {
    let dir = scratch();
    let path = dir.path().join("fixed.safetensors");
    let file = raw(json, data);
    let tally = Tally::default();
    if let Err(e) = agree(&path, &file, &tally) {
        panic!("{json}: {e}");
    }
    (
        read_header(&path).is_ok(),
        safetensors::SafeTensors::read_metadata(&file).is_ok(),
    )
}

#[test]
fn a_field_repeated_inside_an_entry_is_refused_as_the_reference_does() {
    let json = r#"{"a":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    assert_eq!(check_fixed(json, 1), (false, false));
}

#[test]
fn whitespace_before_the_header_is_read_as_the_reference_does() {
    let json = " \n\t{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    assert_eq!(check_fixed(json, 1), (true, true));
}

#[test]
fn the_disagreements_found_so_far_are_agreements() {
    let entry = r#""dtype":"U8","shape":[1],"data_offsets":[0,1]"#;
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    for (json, reads) in [
        // The reference reads an entry written as an array, as serde reads any struct...
        (r#"{"a":["U8",[1],[0,1]]}"#.to_string(), true),
        (r#"{"a":["U8",[1]]}"#.to_string(), false),
        (r#"{"a":["U8",[1],[0,1],0]}"#.to_string(), false),
        // ... and a dtype written as a one-key object, as serde reads a unit enum variant.
        (
            r#"{"a":{"dtype":{"U8":null},"shape":[1],"data_offsets":[0,1]}}"#.to_string(),
            true,
        ),
        (
            r#"{"a":{"dtype":{"U8":1},"shape":[1],"data_offsets":[0,1]}}"#.to_string(),
            false,
        ),
        // Unknown fields are ignored but must be valid JSON within the depth limit of 128.
        (format!(r#"{{"a":{{{entry},"x":{}}}}}"#, deep(125)), true),
        (format!(r#"{{"a":{{{entry},"x":{}}}}}"#, deep(126)), false),
        (format!(r#"{{"a":{{{entry},"x":1e400}}}}"#), false),
        (format!(r#"{{"a":{{{entry},"x":"\ud800"}}}}"#), false),
        // `-0` is a float to serde_json, so not an offset.
        (
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[-0,1]}}"#.to_string(),
            false,
        ),
        (
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"shape":[1]}}"#.to_string(),
            false,
        ),
        // A repeated `__metadata__` is a duplicate field to the reference too.
        (
            r#"{"__metadata__":{},"__metadata__":{}}"#.to_string(),
            false,
        ),
        // Only JSON's own whitespace may surround the object.
        ("\u{feff}{}".to_string(), false),
        ("\u{a0}{}".to_string(), false),
        ("\r\n{} \t".to_string(), true),
    ] {
        let data = usize::from(json.contains("[0,1]"));
        assert_eq!(check_fixed(&json, data), (reads, reads), "{json}");
    }
}

#[test]
fn the_documented_exceptions_are_the_only_refusals_of_readable_files() {
    // Each is read by the reference, refused by ckpt, and excused by exactly its STRICTER entry.
    let dup_name = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    let dup_meta = r#"{"__metadata__":{"k":"1","k":"2"}}"#;
    let dir = scratch();
    let path = dir.path().join("strict.safetensors");
    for (json, data, why) in [(dup_name, 1, 0), (dup_meta, 0, 1)] {
        let file = raw(json, data);
        std::fs::write(&path, &file).unwrap();
        match oracle::compare(read_header(&path), &file) {
            Verdict::Excused(reason) => assert_eq!(reason, STRICTER[why].0, "{json}"),
            _ => panic!("{json}: not an excused refusal"),
        }
        let members = top_members(&file).unwrap();
        let applies: Vec<usize> = (0..STRICTER.len())
            .filter(|&i| (STRICTER[i].1)(&members))
            .collect();
        assert_eq!(applies, [why], "{json}");
    }
}
