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
    let (q, kept) = apply(ckpt, &linear, IoMode::Read).unwrap();
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
