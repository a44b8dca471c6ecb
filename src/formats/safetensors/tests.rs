//! Unit tests of the safetensors reader and header writer.

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
    let json = r#"{"x":{"dtype":"F5","shape":[2],"data_offsets":[0,1]}}"#;
    let err = parse(&raw_file(json, 1)).unwrap_err();
    assert_eq!(err.tensor.as_deref(), Some("x"));
    assert_eq!(err.message, "unknown dtype `F5`");
    assert!(err.hint.as_deref().unwrap().contains("BF16"));
}

#[test]
fn sub_byte_dtypes_are_kept_aside_and_still_tile() {
    // F4 counts 4-bit values: 3 of them fill 1.5 bytes, which the crate refuses.
    let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"F4","shape":[2,2],"data_offsets":[1,3]},"y":{"dtype":"F6_E3M2","shape":[4],"data_offsets":[3,6]}}"#;
    let h = parse(&raw_file(json, 6)).unwrap();
    assert_eq!(h.tensors.len(), 1);
    let codes: Vec<(&str, &str, u64)> = h
        .unsupported
        .iter()
        .map(|u| (u.name.as_str(), u.code.as_str(), u.begin))
        .collect();
    assert_eq!(codes, [("x", "F4", 1), ("y", "F6_E3M2", 3)]);
    let json = r#"{"x":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
    let err = parse(&raw_file(json, 2)).unwrap_err();
    assert!(
        err.message.contains("12 bits, not whole bytes"),
        "{}",
        err.message
    );
    // An unsupported entry still takes part in the hole and overlap checks.
    let json = r#"{"x":{"dtype":"F4","shape":[2],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}"#;
    let err = parse(&raw_file(json, 3)).unwrap_err();
    assert!(err.message.starts_with("1 bytes before"), "{}", err.message);
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
