//! The quantizer through the executor's seam: a weight read from a file, its FP8 boxes and its
//! scales computed as the executor would ask for them, against the whole tensor quantized at once.

use std::collections::BTreeSet;

use super::*;

/// A `[rows, cols]` bf16 weight in a safetensors file, read back as a checkpoint; its values.
fn weight(dir: &std::path::Path, rows: usize, cols: usize) -> (Checkpoint, Vec<u8>) {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|k| ((k as f32) * 0.377).sin() * (1.0 + (k % 13) as f32))
        .collect();
    let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut bf16 = vec![0u8; rows * cols * 2];
    crate::cast::convert(&f32s, DType::F32, &mut bf16, DType::BF16);
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![rows, cols], &bf16)
            .unwrap();
    let path = dir.join("w.safetensors");
    safetensors::tensor::serialize_to_file([("w", view)], None, &path).unwrap();
    (crate::detect::read(&path).unwrap(), bf16)
}

#[test]
fn any_box_quantizes_as_the_whole_and_scales_read_their_bands() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, cols) = (300usize, 200usize);
    let (ckpt, bf16) = weight(dir.path(), rows, cols);
    let linear: BTreeSet<String> = ["w".to_string()].into();
    let (q, kept) = apply(ckpt, &linear, None, IoMode::Read).unwrap();
    assert!(kept.not_converted.is_empty());
    let names: Vec<&str> = q.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["w", "w_scale_inv"]);
    assert_eq!(q.tensors[1].shape, [3, 2]);

    // The whole weight at once: bands of the source, then every row.
    let scales: Vec<Vec<f32>> = (0..3)
        .map(|b| {
            let n = 128.min(rows - b * 128);
            quant::band_scales(
                &bf16[b * 128 * cols * 2..(b * 128 + n) * cols * 2],
                DType::BF16,
                n,
                cols,
            )
        })
        .collect();
    let mut whole = vec![0u8; rows * cols];
    quant::quantize_rows(
        &bf16,
        DType::BF16,
        rows,
        cols,
        0,
        |i| &scales[i / 128],
        &mut whole,
    );

    let fp8 = q.tensors[0].pieces.computed().unwrap();
    assert_eq!(fp8.0.out_dtype(), Some(DType::F8E4M3));
    assert_eq!(fp8.0.block_rows(), 128);
    // Boxes of whole bands (computed from what they hold), and boxes that are not (bands read).
    for (r0, nr, c0, nc) in [
        (0, 128, 0, 200),
        (128, 172, 0, 200),
        (100, 150, 0, 200),
        (5, 3, 130, 70),
    ] {
        let src: Vec<u8> = (r0..r0 + nr)
            .flat_map(|i| bf16[(i * cols + c0) * 2..(i * cols + c0 + nc) * 2].to_vec())
            .collect();
        let mut dst = vec![0u8; nr * nc];
        let (start, sizes) = ([r0 as u64, c0 as u64], [nr as u64, nc as u64]);
        fp8.0
            .compute(&start, &sizes, &src, &mut dst, DType::F8E4M3)
            .unwrap();
        for i in 0..nr {
            let want = &whole[(r0 + i) * cols + c0..(r0 + i) * cols + c0 + nc];
            assert_eq!(&dst[i * nc..(i + 1) * nc], want, "box at {r0},{c0} row {i}");
        }
    }

    let s = q.tensors[1].pieces.computed().unwrap();
    assert_eq!(s.0.out_dtype(), Some(DType::F32));
    let mut dst = vec![0u8; 3 * 2 * 4];
    s.0.compute(&[0, 0], &[3, 2], &[], &mut dst, DType::F32)
        .unwrap();
    let got: Vec<f32> = dst
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got, scales.concat());
}

/// The scale grid's pieces source each of its elements once, from the weight's piece holding
/// the tile's first element, whatever the weight's pieces.
#[test]
fn corners_cover_the_grid_once() {
    use crate::model::{DataRef, Encoding, Piece};
    let mut pieces = Pieces::new(2);
    // A [300, 200] weight in three row pieces and two column pieces, row-major each.
    let mut at = 0;
    for (r0, nr) in [(0u64, 100u64), (100, 156), (256, 44)] {
        for (c0, nc) in [(0u64, 129u64), (129, 71)] {
            pieces
                .push(Piece {
                    offsets: vec![r0, c0],
                    sizes: vec![nr, nc],
                    data: DataRef {
                        file: std::path::Path::new("f").into(),
                        offset: at,
                        strides: vec![nc, 1],
                        encoding: Encoding::Raw,
                    },
                })
                .unwrap();
            at += nr * nc * 2;
        }
    }
    let t = Tensor {
        name: "w".into(),
        key_path: Vec::new(),
        dtype: DType::BF16,
        shape: vec![300, 200],
        pieces,
    };
    let grid = corners(&t, [3, 2]).unwrap();
    let mut seen = vec![0; 6];
    for p in grid.iter() {
        for i in 0..p.sizes()[0] {
            for j in 0..p.sizes()[1] {
                seen[((p.offsets()[0] + i) * 2 + p.offsets()[1] + j) as usize] += 1;
            }
        }
    }
    assert_eq!(seen, [1; 6]);
    // Scales (1, 0) and (1, 1) read elements (128, 0) and (128, 128): row 28 of the piece at
    // (100, 0), columns 0 and 128.
    let p = grid.iter().find(|p| p.offsets() == [1, 0]).unwrap();
    assert_eq!(p.strides().as_ref(), &[128 * 129, 128]);
    assert_eq!(p.sizes(), &[1, 2]);
    // After the first band's two pieces of 100 rows.
    assert_eq!(p.offset(), (100 * 129 + 100 * 71) * 2 + 28 * 129 * 2);
}

/// A `[rows, cols]` weight of `dtype` (values as [`weight`]'s) stored in one raw file as
/// `row_cuts` × `col_cuts` pieces, each row-major: the boxes of several ranks' shards, cut inside
/// 128-row bands and 128-column tiles. Returns the checkpoint and the weight whole, row-major.
fn pieced_weight(
    dir: &std::path::Path,
    dtype: DType,
    (rows, cols): (u64, u64),
    row_cuts: &[u64],
    col_cuts: &[u64],
) -> (Checkpoint, Vec<u8>) {
    use crate::model::{DataRef, Encoding, Format, Piece};
    let vals: Vec<f32> = (0..rows * cols)
        .map(|k| ((k as f32) * 0.377).sin() * (1.0 + (k % 13) as f32) * 1e-2)
        .collect();
    let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let es = dtype.size() as u64;
    let mut whole = vec![0u8; (rows * cols * es) as usize];
    crate::cast::convert(&f32s, DType::F32, &mut whole, dtype);
    let bounds = |cuts: &[u64], n: u64| -> Vec<(u64, u64)> {
        let mut edges = vec![0];
        edges.extend_from_slice(cuts);
        edges.push(n);
        edges.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
    };
    let (mut file, mut pieces) = (Vec::new(), Pieces::new(2));
    for (r0, nr) in bounds(row_cuts, rows) {
        for (c0, nc) in bounds(col_cuts, cols) {
            let at = file.len() as u64;
            for i in r0..r0 + nr {
                let row = ((i * cols + c0) * es) as usize;
                file.extend_from_slice(&whole[row..row + (nc * es) as usize]);
            }
            pieces
                .push(Piece {
                    offsets: vec![r0, c0],
                    sizes: vec![nr, nc],
                    data: DataRef {
                        file: std::path::Path::new("shards.bin").into(),
                        offset: at,
                        strides: vec![nc, 1],
                        encoding: Encoding::Raw,
                    },
                })
                .unwrap();
        }
    }
    std::fs::write(dir.join("shards.bin"), &file).unwrap();
    let ckpt = Checkpoint {
        root: dir.to_path_buf(),
        format: Format::Dcp,
        world_size: None,
        tensors: vec![Tensor {
            name: "w".into(),
            key_path: Vec::new(),
            dtype,
            shape: vec![rows, cols],
            pieces,
        }],
        values: Vec::new(),
        unsupported: Vec::new(),
        details: Vec::new(),
    };
    (ckpt, whole)
}

/// The FP8 codes and scales of a whole row-major weight of `dtype`, quantized at once.
fn quantized_whole(w: &[u8], dtype: DType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let es = dtype.size();
    let scales: Vec<Vec<f32>> = (0..rows.div_ceil(128))
        .map(|b| {
            let n = 128.min(rows - b * 128);
            quant::band_scales(
                &w[b * 128 * cols * es..(b * 128 + n) * cols * es],
                dtype,
                n,
                cols,
            )
        })
        .collect();
    let mut codes = vec![0u8; rows * cols];
    quant::quantize_rows(w, dtype, rows, cols, 0, |i| &scales[i / 128], &mut codes);
    (codes, scales.concat())
}

/// Through the executor, as a consolidate runs it: the weight's pieces cut its bands (a shard
/// boundary inside rows 128..256, another inside 256..320, a column cut inside the second tile)
/// and the executor gathers each box from several of them. Every code and scale is the whole
/// weight's, quantized from the values `--dtype` writes, whatever the source dtype.
#[test]
fn pieces_that_cut_bands_quantize_as_the_whole_weight() {
    let (rows, cols) = (352u64, 200u64);
    for (dtype, cast) in [
        (DType::F32, None),
        (DType::F32, Some(DType::BF16)),
        (DType::BF16, None),
        (DType::F16, Some(DType::BF16)),
        (DType::BF16, Some(DType::F32)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, whole) =
            pieced_weight(dir.path(), dtype, (rows, cols), &[117, 176, 300], &[150]);
        let values = cast.unwrap_or(dtype);
        let mut cast_whole = vec![0u8; (rows * cols) as usize * values.size()];
        crate::cast::convert(&whole, dtype, &mut cast_whole, values);
        let (want_codes, want_scales) =
            quantized_whole(&cast_whole, values, rows as usize, cols as usize);

        let linear: BTreeSet<String> = ["w".to_string()].into();
        let (q, _) = apply(ckpt, &linear, cast, IoMode::Read).unwrap();
        let got = crate::exec::read_tensors(&q, IoMode::Read).unwrap();
        assert_eq!(got[0], want_codes, "{dtype:?} cast {cast:?}: codes");
        let scales: Vec<f32> = got[1]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(scales, want_scales, "{dtype:?} cast {cast:?}: scales");
    }
}
