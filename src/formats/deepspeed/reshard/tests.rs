//! Unit tests of the partitioning arithmetic against what DeepSpeed saved in the fixtures.

use super::*;
use crate::pickle::Object;

#[test]
fn partitions_match_deepspeed() {
    // zero2_fp16's fixture: 123 elements over 3 ranks pad to 126, partitions of 42, the last
    // 3 short; 11 over 3 pad to 12.
    assert_eq!(partitions(123, 3), (42, vec![0, 0, 3]));
    assert_eq!(partitions(11, 3), (4, vec![0, 0, 1]));
    assert_eq!(partitions(11, 1), (12, vec![1]));
    // A group smaller than the ranks: whole partitions of padding.
    assert_eq!(partitions(3, 4), (2, vec![0, 1, 2, 2]));
}

#[test]
fn runs_cover_a_partition_once() {
    let (size, pads) = partitions(123, 3);
    let sources = [(0, 100), (1, 200), (2, 300)];
    let (new, new_pads) = partitions(123, 2);
    let runs = runs_of(&sources, size, &pads, new, new - new_pads[1], new);
    assert_eq!(
        runs,
        vec![
            Run::Copy {
                input: 1,
                offset: 200 + 20 * 4,
                len: 22 * 4
            },
            Run::Copy {
                input: 2,
                offset: 300,
                len: 39 * 4
            },
            Run::Zeros(4),
        ]
    );
}

#[test]
fn slice_mappings_are_deepspeeds() {
    // zero2_fp16's rank 2 of 3 as DeepSpeed saved it: `l1.weight` (6, 0), `l2.weight` (33, 6).
    let ordered = Value::Object(Box::new(Object {
        callable: Value::global("collections", "OrderedDict"),
        args: Vec::new(),
        new_obj: false,
        dict_items: Vec::new(),
        list_items: Vec::new(),
        state: None,
    }));
    let fragment = Value::Object(Box::new(Object {
        callable: Value::global("deepspeed.utils.tensor_fragment", "fragment_address"),
        args: Vec::new(),
        new_obj: true,
        dict_items: Vec::new(),
        list_items: Vec::new(),
        state: None,
    }));
    let group = [
        ("emb.weight".to_string(), 35, 0),
        ("l1.weight".to_string(), 55, 0),
        ("l2.weight".to_string(), 33, 0),
    ];
    let Value::Object(mapping) = slice_mapping(&ordered, &fragment, &group, 84, 42) else {
        panic!("not an OrderedDict");
    };
    let got: Vec<(String, Value)> = mapping
        .dict_items
        .iter()
        .map(|(k, v)| {
            let Value::Object(o) = v else {
                panic!("not an object")
            };
            (k.as_str().unwrap().to_string(), o.state.clone().unwrap())
        })
        .collect();
    let address = |numel, start| {
        Value::Dict(vec![
            (Value::Str("numel".into()), Value::Int(numel)),
            (Value::Str("start".into()), Value::Int(start)),
        ])
    };
    assert_eq!(
        got,
        vec![
            ("l1.weight".to_string(), address(6, 0)),
            ("l2.weight".to_string(), address(33, 6)),
        ]
    );
}

#[test]
fn zero3_pieces_match_deepspeed() {
    use super::stage3::piece;
    // zero3_*'s fixtures at 3 ranks: `emb.weight` 35, `l1.weight` 55, `l2.weight` 33 give
    // 12 + 19 + 11 = 42 elements of group 0 per rank, `l1.bias` 11 gives 4; the frozen
    // `frozen.bias` of 2 gives each rank 1, rank 2's all padding.
    assert_eq!(piece(35, 3) + piece(55, 3) + piece(33, 3), 42);
    assert_eq!(piece(11, 3), 4);
    assert_eq!(piece(2, 3), 1);
    assert_eq!(piece(0, 4), 0);
    assert_eq!(piece(11, 1), 11);
}

#[test]
fn zero3_sub_groups_count_pieces_at_the_world_size() {
    use super::stage3::cut_sub_groups;
    // One sub-group while the pieces fit (DeepSpeed's default limit is 1e9).
    assert_eq!(cut_sub_groups(&[35, 55, 33], 3, 1_000_000_000), vec![3]);
    // Pieces of 12, 19, 11 against a limit of 20: a sub-group closes once it reaches the limit.
    assert_eq!(cut_sub_groups(&[35, 55, 33], 3, 20), vec![2, 1]);
    // The same parameters at 1 rank: 35, 55, 33 each reach it alone.
    assert_eq!(cut_sub_groups(&[35, 55, 33], 1, 20), vec![1, 1, 1]);
    // At 6 ranks the pieces (6, 10, 6) sum to 22, more than 20, but reach it only at the last.
    assert_eq!(cut_sub_groups(&[35, 55, 33], 6, 20), vec![3]);
    assert_eq!(cut_sub_groups(&[35, 55, 33], 8, 20), vec![3]);
}

#[test]
fn zero3_piece_runs_cover_a_piece_once() {
    use super::stage3::piece_runs;
    // `l1.weight` (55) from 3 ranks (pieces of 19 at bytes 100, 200, 300) to 2 (pieces of 28).
    let sources = [(0, 100), (1, 200), (2, 300)];
    let mut runs = Vec::new();
    piece_runs(55, 3, 2, 0, &sources, 4, &mut runs);
    assert_eq!(
        runs,
        vec![
            Run::Copy {
                input: 0,
                offset: 100,
                len: 19 * 4
            },
            Run::Copy {
                input: 1,
                offset: 200,
                len: 9 * 4
            },
        ]
    );
    // Rank 1 holds elements 28..55: the rest of rank 1's old piece, rank 2's real 17, then
    // one element of padding.
    runs.clear();
    piece_runs(55, 3, 2, 1, &sources, 4, &mut runs);
    assert_eq!(
        runs,
        vec![
            Run::Copy {
                input: 1,
                offset: 200 + 9 * 4,
                len: 10 * 4
            },
            Run::Copy {
                input: 2,
                offset: 300,
                len: 17 * 4
            },
            Run::Zeros(4),
        ]
    );
    // 2 bf16 elements over 3 ranks, then 4: ranks 2 and 3 hold only padding, and a rank's old
    // padding is never copied.
    let mut runs = Vec::new();
    piece_runs(2, 3, 4, 1, &sources, 2, &mut runs);
    assert_eq!(
        runs,
        vec![Run::Copy {
            input: 1,
            offset: 200,
            len: 2
        }]
    );
    runs.clear();
    piece_runs(2, 3, 4, 3, &sources, 2, &mut runs);
    assert_eq!(runs, vec![Run::Zeros(2)]);
}

#[test]
fn zero3_pieces_of_one_old_rank_join() {
    use super::stage3::piece_runs;
    // Two parameters whose old pieces lie end to end in rank 0's file (4 then 2 elements), both
    // kept whole at the same size: one run, not two.
    let mut runs = Vec::new();
    piece_runs(8, 2, 2, 0, &[(0, 0), (1, 0)], 4, &mut runs);
    piece_runs(4, 2, 2, 0, &[(0, 16), (1, 16)], 4, &mut runs);
    assert_eq!(
        runs,
        vec![Run::Copy {
            input: 0,
            offset: 0,
            len: 24
        }]
    );
}
