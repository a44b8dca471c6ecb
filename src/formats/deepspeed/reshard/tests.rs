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
