//! Unit tests of the planner's piece index and invariants.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::sourcing::{PieceIndex, Sourcing};
use super::*;
use crate::model::NonTensor;

fn tensor_of_boxes(shape: &[u64], boxes: &[(Vec<u64>, Vec<u64>)]) -> Tensor {
    let pieces = boxes
        .iter()
        .map(|(offsets, sizes)| crate::model::Piece {
            offsets: offsets.clone(),
            sizes: sizes.clone(),
            data: crate::model::DataRef {
                file: Path::new("f").into(),
                offset: 0,
                strides: crate::model::contiguous_strides(sizes),
                encoding: Encoding::Raw,
            },
        })
        .collect();
    Tensor {
        name: "t".into(),
        key_path: Vec::new(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        pieces: crate::model::Pieces::from_vec(shape.len(), pieces).unwrap(),
    }
}

/// The boxes of an [8, 10] tensor cut unevenly on both dims, 3 x 4.
fn uneven_grid() -> Vec<(Vec<u64>, Vec<u64>)> {
    let rows = [(0, 3), (3, 4), (7, 1)];
    let cols = [(0, 2), (2, 2), (4, 5), (9, 1)];
    let mut boxes = Vec::new();
    for &(r0, rn) in &rows {
        for &(c0, cn) in &cols {
            boxes.push((vec![r0, c0], vec![rn, cn]));
        }
    }
    boxes
}

#[test]
fn the_piece_index_finds_every_piece_that_meets_a_box() {
    // The uneven grid plus a replica of one of its pieces, queried with every box of a finer
    // grid and some that straddle cuts.
    let mut boxes = uneven_grid();
    boxes.push(boxes[5].clone());
    let t = tensor_of_boxes(&[8, 10], &boxes);
    let index = PieceIndex::new(&t);
    assert_eq!(index.order.len(), 12, "the replica is dropped");
    for r0 in 0..8 {
        for c0 in 0..10 {
            for (rn, cn) in [(1, 1), (2, 3), (8 - r0, 10 - c0)] {
                let b = NdBox {
                    offsets: vec![r0, c0],
                    sizes: vec![rn, cn],
                };
                let found = index.meeting(&b);
                for (k, p) in t.pieces.iter().enumerate().take(12) {
                    let pb = NdBox {
                        offsets: p.offsets().to_vec(),
                        sizes: p.sizes().to_vec(),
                    };
                    assert_eq!(
                        pb.intersect(&b).is_some(),
                        found.contains(&k) && pb.intersect(&b).is_some(),
                        "piece {k} and box {b:?}"
                    );
                }
                assert!(found.windows(2).all(|w| w[0] < w[1]), "in piece order");
            }
        }
    }
}

#[test]
fn the_fills_of_a_sub_box_are_the_fills_of_the_whole_that_meet_it() {
    let boxes = uneven_grid();
    let ckpt = Checkpoint {
        root: PathBuf::from("/nonexistent"),
        format: crate::model::Format::Dcp,
        world_size: None,
        tensors: vec![tensor_of_boxes(&[8, 10], &boxes)],
        values: Vec::new(),
        unsupported: Vec::new(),
        details: Vec::new(),
    };
    let src = Sourcing::new(&ckpt, &PlanOptions::default()).unwrap();
    let b = NdBox {
        offsets: vec![1, 1],
        sizes: vec![6, 8],
    };
    let whole = src.fills(0, &b, None).unwrap();
    assert_eq!(
        whole.len(),
        6,
        "rows 0..3 and 3..7, cols 0..2, 2..4 and 4..9"
    );
    for (start, sizes) in [
        (vec![0, 0], vec![6, 8]),
        (vec![0, 0], vec![1, 8]),
        (vec![2, 0], vec![3, 8]),
        (vec![5, 3], vec![1, 1]),
        (vec![1, 2], vec![4, 3]),
    ] {
        let meets = |f: &Fill| {
            (0..2).all(|d| f.start[d] < start[d] + sizes[d] && start[d] < f.start[d] + f.sizes[d])
        };
        let want: Vec<Fill> = whole.iter().filter(|f| meets(f)).cloned().collect();
        assert_eq!(
            src.fills(0, &b, Some((&start, &sizes))).unwrap(),
            want,
            "{start:?} {sizes:?}"
        );
    }
}

/// The planner's consistency checks blame ckpt, not the checkpoint: a non-tensor entry no
/// reader makes (neither its bytes nor a value), and the fills of a tensor region asked of a
/// plan that has no tensors to take them from.
#[test]
fn broken_invariants_are_reported_as_bugs() {
    let ckpt = Checkpoint {
        root: PathBuf::from("/nonexistent"),
        format: crate::model::Format::Dcp,
        world_size: None,
        tensors: vec![tensor_of_boxes(&[4], &[(vec![0], vec![4])])],
        values: vec![NonTensor {
            name: "step".into(),
            key_path: Vec::new(),
            value: None,
            raw: None,
        }],
        unsupported: Vec::new(),
        details: Vec::new(),
    };
    let mesh = MeshSpec {
        shape: vec![2],
        placements: vec![Placement::Shard(0)],
        replicated: BTreeSet::new(),
    };
    let Err(err) = plan(&ckpt, &Target::Dcp(mesh), &PlanOptions::default()) else {
        panic!("planned a value with nothing to write");
    };
    assert_eq!(err.kind, crate::ErrorKind::Bug);
    assert_eq!(err.tensor.as_deref(), Some("step"));
    let text = err.to_string();
    assert!(text.contains("a bug in ckpt"), "{text}");
    assert!(text.contains("please report"), "{text}");

    let region = Region {
        name: "t".into(),
        offset: 0,
        dtype: DType::F32,
        shape: vec![4],
        source: RegionSource::Tensor {
            tensor: 0,
            b: NdBox::whole(&[4]),
        },
        crc_slots: Vec::new(),
    };
    let empty = Checkpoint {
        tensors: Vec::new(),
        values: Vec::new(),
        ..ckpt
    };
    let whole = Target::Safetensors {
        file_name: "x".into(),
    };
    let planned = plan(&empty, &whole, &PlanOptions::default()).unwrap();
    let err = planned.fills(&region, None).unwrap_err();
    assert_eq!(err.kind, crate::ErrorKind::Bug);
    assert!(err.to_string().contains("a bug in ckpt"));
}

#[test]
fn the_piece_index_looks_only_near_the_box() {
    // 1024 one-row pieces: a box of rows 10..12 is met by pieces 10 and 11 alone, so a
    // reshard asks O(log n) per box, not n.
    let boxes: Vec<_> = (0..1024).map(|r| (vec![r, 0], vec![1, 32])).collect();
    let index = PieceIndex::new(&tensor_of_boxes(&[1024, 32], &boxes));
    let b = NdBox {
        offsets: vec![10, 0],
        sizes: vec![2, 32],
    };
    assert_eq!(index.meeting(&b), vec![10, 11]);
}

#[test]
fn literals_and_item_framing_come_in_offset_order() {
    let item = TensorItem {
        base: 4,
        framing: Arc::new(ItemFraming::new(DType::F32, &[2, 3])),
    };
    let layout = item.framing.layout.clone();
    let after = 4 + layout.len;
    let file = FilePlan {
        literals: vec![(after, b"zz".to_vec()), (0, b"head".to_vec())],
        tensor_items: vec![item],
        ..FilePlan::default()
    };
    let mut seen = Vec::new();
    file.for_each_literal(|at, bytes| {
        seen.push((at, bytes.to_vec()));
        Ok(())
    })
    .unwrap();
    // The plain literals first and last, the item's framing in between, shifted to its base
    // and byte for byte what the ZIP layout gives.
    assert_eq!(seen.first(), Some(&(0, b"head".to_vec())));
    assert_eq!(seen.last(), Some(&(after, b"zz".to_vec())));
    let middle: Vec<(u64, Vec<u8>)> = layout
        .literals
        .iter()
        .map(|(o, b)| (4 + o, b.clone()))
        .collect();
    assert_eq!(&seen[1..seen.len() - 1], &middle[..]);
    assert!(seen
        .windows(2)
        .all(|w| w[0].0 + w[0].1.len() as u64 <= w[1].0));
}
