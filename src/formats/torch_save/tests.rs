//! Unit tests of reading torch.save archives.

use super::write::tensor_value;
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
        b"\x80\x02}q\x00\x8c\x01aK\x01s.",     // SHORT_BINUNICODE
        b"\x80\x02}q\x00X\x01\0\0\0aC\x01xs.", // SHORT_BINBYTES
        b"\x80\x02}q\x00X\x01\0\0\0a\x94K\x01s.", // MEMOIZE
        b"\x80\x02}q\x00X\x01\0\0\0aI1\ns.",   // INT
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
