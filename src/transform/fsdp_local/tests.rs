//! Unit tests of FSDP1 LOCAL resolution.
use super::*;
use crate::model::{contiguous_strides, numel, DataRef, Piece};
use std::path::PathBuf;

/// Every element of `[lo, hi)` exactly once, in order, each box contiguous, at most
/// 2*(ndim-1)+1 boxes.
fn check(shape: &[u64], lo: u64, hi: u64) {
    let bs = flat_range_boxes(shape, lo, hi);
    let strides = contiguous_strides(shape);
    let mut next = lo;
    for (o, s) in &bs {
        let first: u64 = o.iter().zip(&strides).map(|(a, b)| a * b).sum();
        assert_eq!(first, next, "{shape:?} [{lo},{hi}) {bs:?}");
        // contiguous: all dims after the first non-1 size are full
        let lead = s.iter().position(|&x| x != 1).unwrap_or(s.len());
        for d in lead + 1..s.len() {
            assert_eq!(s[d], shape[d], "{shape:?} [{lo},{hi}) {bs:?}");
            assert_eq!(o[d], 0);
        }
        next += numel(s).unwrap();
    }
    assert_eq!(next, hi.max(lo), "{shape:?} [{lo},{hi}) {bs:?}");
    assert!(bs.len() <= 2 * shape.len().saturating_sub(1) + 1);
}

#[test]
fn flat_ranges_decompose_into_contiguous_boxes() {
    for shape in [&[7u64][..], &[3, 5], &[2, 3, 4], &[1, 1, 6], &[4, 1, 3, 2]] {
        let n = numel(shape).unwrap();
        for lo in 0..=n {
            for hi in lo..=n {
                check(shape, lo, hi);
            }
        }
    }
    assert_eq!(flat_range_boxes(&[], 0, 1), vec![(vec![], vec![])]);
    assert!(flat_range_boxes(&[0, 3], 0, 0).is_empty());
    assert_eq!(
        flat_range_boxes(&[3, 4], 2, 11),
        vec![
            (vec![0, 2], vec![1, 2]),
            (vec![1, 0], vec![1, 4]),
            (vec![2, 0], vec![1, 3])
        ]
    );
}

fn flat(name: &str, total: u64, shard: u64) -> Tensor {
    let mut pieces = Pieces::new(1);
    let mut o = 0;
    let mut r = 0;
    while o < total {
        let s = shard.min(total - o);
        pieces
            .push(Piece {
                offsets: vec![o],
                sizes: vec![s],
                data: DataRef {
                    file: Path::new(&format!("__{r}_0.distcp")).into(),
                    offset: 1000,
                    strides: vec![1],
                    encoding: Encoding::Raw,
                },
            })
            .unwrap();
        o += s;
        r += 1;
    }
    Tensor {
        name: name.into(),
        key_path: Vec::new(),
        dtype: DType::F32,
        shape: vec![total],
        pieces,
    }
}

fn plain(name: &str, shape: &[u64]) -> Tensor {
    Tensor {
        name: name.into(),
        key_path: Vec::new(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        pieces: Pieces::single(Piece {
            offsets: vec![0; shape.len()],
            sizes: shape.to_vec(),
            data: DataRef {
                file: Path::new("__0_0.distcp").into(),
                offset: 0,
                strides: contiguous_strides(shape),
                encoding: Encoding::Raw,
            },
        })
        .unwrap(),
    }
}

fn ckpt(tensors: Vec<Tensor>) -> Checkpoint {
    Checkpoint {
        root: PathBuf::from("local"),
        format: Format::Dcp,
        world_size: Some(2),
        tensors,
        values: Vec::new(),
        unsupported: Vec::new(),
        details: Vec::new(),
    }
}

fn entry(name: &str, shape: &[u64]) -> RefEntry {
    RefEntry {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: None,
        alias_of: None,
    }
}

#[test]
fn unpadded_units_resolve_and_keep_buffers() {
    // Root: w (3, 5) + b (4) = 19 over 2 ranks (10 + 9); nested unit `l.0.`: 6 elements.
    let c = ckpt(vec![
        flat("_flat_param", 19, 10),
        plain("count", &[]),
        flat("l.0._flat_param", 6, 3),
    ]);
    assert!(c.check_supported().is_err());
    let reference = vec![
        entry("w", &[3, 5]),
        entry("count", &[]),
        entry("l.0.x", &[2, 3]),
        entry("b", &[4]),
    ];
    let out = resolve(c, &reference).unwrap();
    out.check_supported().unwrap();
    let names: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["w", "count", "l.0.x", "b"]);
    let w = &out.tensors[0];
    // rank 0 holds w[0..10) = rows 0-1, rank 1 w[10..15) = row 2
    let got: Vec<(Vec<u64>, Vec<u64>, u64)> = w
        .pieces
        .iter()
        .map(|p| (p.offsets().to_vec(), p.sizes().to_vec(), p.offset()))
        .collect();
    assert_eq!(
        got,
        vec![
            (vec![0, 0], vec![2, 5], 1000),
            (vec![2, 0], vec![1, 5], 1000)
        ]
    );
    let b = &out.tensors[3];
    assert_eq!(b.pieces.len(), 1);
    assert_eq!(b.pieces.get(0).offset(), 1000 + 5 * 4);
}

#[test]
fn orig_params_pad_and_drop_slices() {
    // use_orig_params=True, f32 (align 4), 2 ranks: a (5) at 0, pad 3, c (2, 3) at 8..14,
    // world pad to 14 -> 14 (divisible by 2): shard 7.
    let c = ckpt(vec![
        plain("a", &[5]),
        plain("c", &[0]),
        flat("_flat_param", 14, 7),
    ]);
    let out = resolve(c, &[entry("a", &[5]), entry("c", &[2, 3])]).unwrap();
    let names: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "c"]);
    let c = &out.tensors[1];
    let got: Vec<(Vec<u64>, Vec<u64>)> = c
        .pieces
        .iter()
        .map(|p| (p.offsets().to_vec(), p.sizes().to_vec()))
        .collect();
    // elements 8..14: rank 1 (7..14) holds all of c, from its element 1
    assert_eq!(got, vec![(vec![0, 0], vec![2, 3])]);
    assert_eq!(c.pieces.get(0).offset(), 1000 + 4);
}

fn with_dtype(name: &str, shape: &[u64]) -> RefEntry {
    RefEntry {
        dtype: Some(DType::F32),
        ..entry(name, shape)
    }
}

#[test]
fn a_1d_buffer_saved_whole_is_told_from_a_parameter_or_refused() {
    // use_orig_params=True on 8 ranks: `a` (9) at 0..9, padded to 16, shard 2.
    let flat16 = || flat("_flat_param", 16, 2);
    let slice = |name: &str, len: u64| plain(name, &[len]);
    // `rm` (4) read as a parameter would sit at 12..16, but no rank holds 4 of it: a buffer.
    let c = ckpt(vec![slice("a", 2), slice("rm", 4), flat16()]);
    let out = resolve(c, &[with_dtype("a", &[9]), with_dtype("rm", &[4])]).unwrap();
    let rm = out.tensors.iter().find(|t| t.name == "rm").unwrap();
    assert_eq!(rm.pieces.get(0).file().to_str(), Some("__0_0.distcp"));
    assert_eq!(
        rm.pieces.get(0).offset(),
        0,
        "the buffer as saved, not flat bytes"
    );
    // `z` (1) fits in the padding as well as being a buffer: the files cannot tell.
    let c = ckpt(vec![slice("a", 2), slice("z", 1), flat16()]);
    let e = resolve(c, &[with_dtype("a", &[9]), with_dtype("z", &[1])]).unwrap_err();
    assert!(
        e.message.contains("both as parameters and as buffers"),
        "{}",
        e.message
    );
    assert!(e.hint.unwrap().contains("named_parameters()"));
    // a JSON list has no buffers: `z` is a parameter
    let c = ckpt(vec![slice("a", 2), slice("z", 1), flat16()]);
    let out = resolve(c, &[entry("a", &[9]), entry("z", &[1])]).unwrap();
    let z = out.tensors.iter().find(|t| t.name == "z").unwrap();
    assert_eq!(
        z.pieces.get(0).offset(),
        1000,
        "element 12 is the start of rank 6's piece"
    );
}

#[test]
fn a_mixed_precision_alignment_is_found_when_it_is_the_only_one() {
    // f32 storage, bf16 compute (8-element alignment), 2 ranks: `a` (9) at 0, `b` (3) at 16,
    // padded to 20. With f32's 4, `b` would be at 12 and leave 5 elements of padding.
    let c = ckpt(vec![
        plain("a", &[9]),
        plain("b", &[0]),
        flat("_flat_param", 20, 10),
    ]);
    let out = resolve(c, &[entry("a", &[9]), entry("b", &[3])]).unwrap();
    let b = out.tensors.iter().find(|t| t.name == "b").unwrap();
    // element 16 is element 6 of rank 1's piece
    assert_eq!(b.pieces.get(0).offset(), 1000 + 6 * 4);
    // 10 ranks, shard 2: f32's 4 leaves too much padding, and 8 (`b` at 8) and 16 (`b` at
    // 16) both fit, placing `b` differently: refused
    let c = ckpt(vec![
        plain("a", &[1]),
        plain("b", &[2]),
        flat("_flat_param", 20, 2),
    ]);
    let e = resolve(c, &[entry("a", &[1]), entry("b", &[3])]).unwrap_err();
    assert!(e.message.contains("alignment"), "{}", e.message);
}

#[test]
fn mismatches_name_the_unit() {
    let c = ckpt(vec![flat("l.0._flat_param", 6, 3)]);
    let e = resolve(c.clone(), &[entry("l.0.x", &[7])]).unwrap_err();
    assert!(e.message.contains("FSDP unit `l.0`"), "{}", e.message);
    let e = resolve(c.clone(), &[entry("other.x", &[6])]).unwrap_err();
    assert!(e.message.contains("names no parameter"), "{}", e.message);
    let mut wrong = entry("l.0.x", &[6]);
    wrong.dtype = Some(DType::BF16);
    let e = resolve(c, &[wrong]).unwrap_err();
    assert!(e.message.contains("BF16"), "{}", e.message);
}

#[test]
fn app_prefix_and_json() {
    let mut f = flat("model._flat_param", 4, 2);
    f.key_path = vec![
        KeyPart::Key("model".into()),
        KeyPart::Key("_flat_param".into()),
    ];
    let out = resolve(ckpt(vec![f]), &[entry("w", &[2, 2])]).unwrap();
    assert_eq!(out.tensors[0].name, "model.w");
    assert_eq!(
        out.tensors[0].key_path,
        vec![KeyPart::Key("model".into()), KeyPart::Key("w".into())]
    );
    let parsed = parse_json(br#"[["a.w", [2, 3]], ["b", []]]"#).unwrap();
    assert_eq!(parsed, vec![entry("a.w", &[2, 3]), entry("b", &[])]);
    assert!(parse_json(br#"{"a": [1]}"#).is_err());
    let twice = [entry("w", &[2]), entry("w", &[2])];
    let e = resolve(ckpt(vec![flat("_flat_param", 4, 2)]), &twice).unwrap_err();
    assert!(e.message.contains("`w` twice"), "{}", e.message);
    assert!(parse_json(br#"[["a", [-1]]]"#).is_err());
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn shape() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(0u64..5, 0..4)
    }

    proptest! {
        /// Any parameter list that fits a flat parameter split over any world size comes back
        /// as pieces covering each parameter exactly once, at the bytes of its flat range.
        #[test]
        fn resolved_pieces_cover_each_parameter(
            shapes in prop::collection::vec(shape(), 1..6),
            world in 1u64..6,
            orig in any::<bool>(),
        ) {
            let shapes: Vec<Vec<u64>> = shapes.into_iter().filter(|s| !s.is_empty()).collect();
            prop_assume!(!shapes.is_empty());
            let numels: Vec<u64> = shapes.iter().map(|s| numel(s).unwrap()).collect();
            let (starts, end) = layout(&numels, if orig { 4 } else { 1 });
            let total = if orig { end.div_ceil(world) * world } else { end };
            prop_assume!(total > 0);
            let shard = total.div_ceil(world);
            let names: Vec<String> = (0..shapes.len()).map(|i| format!("p{i}")).collect();
            let mut tensors = Vec::new();
            if orig {
                for (k, n) in names.iter().enumerate() {
                    // rank 0's slice, as DCP may keep it
                    let lo = starts[k].min(shard);
                    let hi = (starts[k] + numels[k]).min(shard);
                    tensors.push(plain(n, &[hi.saturating_sub(lo)]));
                }
            }
            tensors.push(flat("_flat_param", total, shard));
            let reference: Vec<RefEntry> =
                names.iter().zip(&shapes).map(|(n, s)| entry(n, s)).collect();
            // Only use_orig_params=True can be refused: another alignment may fit as well.
            let out = match resolve(ckpt(tensors), &reference) {
                Ok(out) => out,
                Err(e) => {
                    prop_assert!(orig && e.message.contains("alignment"), "{}", e.message);
                    return Ok(());
                }
            };
            for (k, t) in out.tensors.iter().enumerate() {
                prop_assert_eq!(&t.shape, &shapes[k]);
                let boxes: Vec<crate::geometry::NdBox> = t.pieces.iter().map(|p| crate::geometry::NdBox {
                    offsets: p.offsets().to_vec(),
                    sizes: p.sizes().to_vec(),
                }).filter(|b| numel(&b.sizes) != Some(0)).collect();
                if numels[k] > 0 {
                    prop_assert!(crate::geometry::check_coverage(&t.shape, &boxes).is_empty(), "{:?} {:?}", t.shape, boxes);
                }
                // each piece's first element is where its flat index lies in its rank's piece
                let strides = contiguous_strides(&t.shape);
                for p in t.pieces.iter().filter(|p| numel(p.sizes()) != Some(0)) {
                    let flat_index = starts[k] + p.offsets().iter().zip(&strides).map(|(a, b)| a * b).sum::<u64>();
                    let rank = flat_index / shard;
                    prop_assert_eq!(p.file().to_str().unwrap(), format!("__{rank}_0.distcp"));
                    prop_assert_eq!(p.offset(), 1000 + (flat_index - rank * shard) * 4);
                }
            }
        }
    }
}
