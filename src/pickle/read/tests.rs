//! Unit tests of the data-only pickle reader.

use super::*;
use crate::pickle::graph::node_count;
use crate::pickle::Object;

// Reference pickles written by CPython 3.11's `pickle.dumps` (and torch 2.15's `torch.save` for
// `TORCH_DATA_PKL`), embedded byte for byte.

/// `{"a": [1, -2, 300, 70000, -70000, 2**40, -2**63, 2**63-1], "b": (True, False, None),
/// "c": 1.5, "s": "héllo", "t": (), "u": (1,), "v": (1, 2), "w": (1, 2, 3), "x": (1, 2, 3, 4)}`
const PLAIN_P2: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00J\x90\xee\xfe\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7feX\x01\x00\x00\x00bq\x03\x88\x89N\x87q\x04X\x01\x00\x00\x00cq\x05G?\xf8\x00\x00\x00\x00\x00\x00X\x01\x00\x00\x00sq\x06X\x06\x00\x00\x00h\xc3\xa9lloq\x07X\x01\x00\x00\x00tq\x08)X\x01\x00\x00\x00uq\x09K\x01\x85q\x0aX\x01\x00\x00\x00vq\x0bK\x01K\x02\x86q\x0cX\x01\x00\x00\x00wq\x0dK\x01K\x02K\x03\x87q\x0eX\x01\x00\x00\x00xq\x0f(K\x01K\x02K\x03K\x04tq\x10u.";
/// The same object at protocol 4.
const PLAIN_P4: &[u8] = b"\x80\x04\x95\x92\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00J\x90\xee\xfe\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7fe\x8c\x01b\x94\x88\x89N\x87\x94\x8c\x01c\x94G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x01s\x94\x8c\x06h\xc3\xa9llo\x94\x8c\x01t\x94)\x8c\x01u\x94K\x01\x85\x94\x8c\x01v\x94K\x01K\x02\x86\x94\x8c\x01w\x94K\x01K\x02K\x03\x87\x94\x8c\x01x\x94(K\x01K\x02K\x03K\x04t\x94u.";
/// `{"by": b"\x00\x01", "ba": bytearray(b"xy"), "set": {3}, "fs": frozenset({4}), "long": "z" * 300}`
const BYTES_SETS_P5: &[u8] = b"\x80\x05\x95o\x01\x00\x00\x00\x00\x00\x00}\x94(\x8c\x02by\x94C\x02\x00\x01\x94\x8c\x02ba\x94\x96\x02\x00\x00\x00\x00\x00\x00\x00xy\x94\x8c\x03set\x94\x8f\x94(K\x03\x90\x8c\x02fs\x94(K\x04\x91\x94\x8c\x04long\x94X,\x01\x00\x00zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz\x94u.";
/// `s = [1]; {"p": s, "q": s}`: the list is memoized empty, filled, then fetched again.
const SHARED_P4: &[u8] = b"\x80\x04\x95\x14\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01p\x94]\x94K\x01a\x8c\x01q\x94h\x02u.";
/// `OrderedDict([("k", 1), ("j", 2)])`
const ODICT_P2: &[u8] = b"\x80\x02ccollections\x0aOrderedDict\x0aq\x00)Rq\x01(X\x01\x00\x00\x00kq\x02K\x01X\x01\x00\x00\x00jq\x03K\x02u.";
/// `2**64`
const BIG_INT_P4: &[u8] =
    b"\x80\x04\x95\x0c\x00\x00\x00\x00\x00\x00\x00\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.";
/// `l = []; l.append(l)`
const CYCLE_P4: &[u8] = b"\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00]\x94h\x00a.";
/// `data.pkl` of `torch.save(torch.arange(4.0)[1:])`: a view with storage offset 1.
const TORCH_DATA_PKL: &[u8] = b"\x80\x02ctorch._utils\x0a_rebuild_tensor_v2\x0aq\x00((X\x07\x00\x00\x00storageq\x01ctorch\x0aFloatStorage\x0aq\x02X\x01\x00\x00\x000q\x03X\x03\x00\x00\x00cpuq\x04K\x04tq\x05QK\x01K\x03\x85q\x06K\x01\x85q\x07\x89ccollections\x0aOrderedDict\x0aq\x08)Rq\x09tq\x0aRq\x0b.";
/// `[Point(1, "a")]` for `@dataclass class Point: x: int; y: str` defined in `__main__`.
const DATACLASS_P4: &[u8] = b"\x80\x04\x95/\x00\x00\x00\x00\x00\x00\x00]\x94\x8c\x08__main__\x94\x8c\x05Point\x94\x93\x94)\x81\x94}\x94(\x8c\x01x\x94K\x01\x8c\x01y\x94\x8c\x01a\x94uba.";

const NOTHING: &[(&str, &str)] = &[];

/// Takes the items of the dict under `big` in the state of an `m.Owner`, as strings.
#[derive(Default)]
struct TakeBig {
    pairs: Vec<(String, String)>,
    batches: usize,
}

impl Consumer for TakeBig {
    fn claims(&mut self, owner: NodeRef<'_>, key: &str) -> bool {
        owner.class() == Some(("m", "Owner")) && key == "big"
    }

    fn consume(&mut self, _key: &str, pairs: &[(NodeRef<'_>, NodeRef<'_>)]) -> ControlFlow<()> {
        self.batches += 1;
        for (k, v) in pairs {
            let (Some(k), Some(v)) = (k.as_str(), v.as_str()) else {
                return ControlFlow::Break(());
            };
            self.pairs.push((k.into(), v.into()));
        }
        ControlFlow::Continue(())
    }
}

/// `m.Owner()` whose state is `{"big": {k0: v, ...}, "after": [...]}`: the values of `big`
/// repeat strings that `after` fetches again from the memo.
fn owner_pickle(n: usize) -> (Value, Vec<u8>) {
    let big = (0..n)
        .map(|i| (s(&format!("k{i}")), s(&format!("v{}", i % 7))))
        .collect();
    let after = Value::List((0..7).map(|i| s(&format!("v{i}"))).collect());
    let v = Value::Object(Box::new(Object {
        callable: Value::global("m", "Owner"),
        args: vec![],
        new_obj: true,
        dict_items: vec![],
        list_items: vec![],
        state: Some(Value::Dict(vec![
            (s("big"), Value::Dict(big)),
            (s("after"), after),
        ])),
    }));
    let bytes = crate::pickle::write(&v, crate::pickle::Protocol::V4);
    (v, bytes)
}

#[test]
fn a_consumer_takes_claimed_batches_and_their_nodes_are_dropped() {
    let (_, bytes) = owner_pickle(5000);
    let allowed = [("m", "Owner")];
    let whole = parse(&bytes, &allowed.as_slice(), Limits::default()).unwrap();
    let mut take = TakeBig::default();
    let graph = parse_consuming(&bytes, &allowed.as_slice(), Limits::default(), &mut take).unwrap();
    // Five batches of a thousand, in order, and the dict left empty in the graph.
    assert_eq!(take.batches, 5);
    assert_eq!(take.pairs.len(), 5000);
    assert_eq!(take.pairs[4321], ("k4321".into(), "v2".into()));
    let state = graph.root().state().unwrap();
    assert_eq!(
        state.get("big").unwrap().dict_items().map(|i| i.len()),
        Some(0)
    );
    let (kept, all) = (node_count(&graph), node_count(&whole));
    assert!(kept * 100 < all, "{kept} of {all} nodes kept");
    // `after` fetches strings first written inside the consumed batches: still the same.
    let after: Vec<String> = state
        .get("after")
        .unwrap()
        .as_seq()
        .unwrap()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(after, (0..7).map(|i| format!("v{i}")).collect::<Vec<_>>());
}

/// Takes the dict under `big` in the state of an `m.Owner` and, inside it, the lists under
/// `xs` in the state of each `m.Item`: per entry, its key and its list's items.
#[derive(Default)]
struct TakeNested {
    lists: HashMap<u32, Vec<String>>,
    entries: Vec<(String, Vec<String>)>,
    list_batches: usize,
}

impl Consumer for TakeNested {
    fn claims(&mut self, owner: NodeRef<'_>, key: &str) -> bool {
        owner.class() == Some(("m", "Owner")) && key == "big"
    }

    fn consume(&mut self, _key: &str, pairs: &[(NodeRef<'_>, NodeRef<'_>)]) -> ControlFlow<()> {
        for (k, v) in pairs {
            let list = v.state().and_then(|s| s.get("xs")).unwrap();
            let mut items = self.lists.remove(&list.id()).unwrap_or_default();
            // Items not taken (a last one `APPEND`ed alone) are still in the graph.
            items.extend(
                list.as_seq()
                    .unwrap()
                    .map(|x| x.as_str().unwrap().to_string()),
            );
            self.entries.push((k.as_str().unwrap().to_string(), items));
        }
        ControlFlow::Continue(())
    }

    fn claims_list(&mut self, owner: NodeRef<'_>, key: &str) -> bool {
        owner.class() == Some(("m", "Item")) && key == "xs"
    }

    fn consume_list(&mut self, list: NodeRef<'_>, items: &[NodeRef<'_>]) -> ControlFlow<()> {
        self.list_batches += 1;
        let taken = self.lists.entry(list.id()).or_default();
        taken.extend(items.iter().map(|x| x.as_str().unwrap().to_string()));
        ControlFlow::Continue(())
    }
}

#[test]
fn lists_inside_a_claimed_dict_are_taken_batch_by_batch() {
    // 1500 entries (two dict batches), each an `m.Item` whose `xs` holds 2001 strings (three
    // list batches: ckpt's writer batches by a thousand, a last one too); the strings
    // repeat, so most are memo fetches.
    let item = |i: usize| {
        let xs = (0..2001)
            .map(|j| s(&format!("x{}", (i + j) % 50)))
            .collect();
        Value::Object(Box::new(Object {
            callable: Value::global("m", "Item"),
            args: vec![],
            new_obj: true,
            dict_items: vec![],
            list_items: vec![],
            state: Some(Value::Dict(vec![(s("xs"), Value::List(xs))])),
        }))
    };
    let big = (0..1500).map(|i| (s(&format!("k{i}")), item(i))).collect();
    let v = Value::Object(Box::new(Object {
        callable: Value::global("m", "Owner"),
        args: vec![],
        new_obj: true,
        dict_items: vec![],
        list_items: vec![],
        state: Some(Value::Dict(vec![(s("big"), Value::Dict(big))])),
    }));
    let bytes = crate::pickle::write(&v, crate::pickle::Protocol::V4);
    let allowed = [("m", "Owner"), ("m", "Item")];
    let mut take = TakeNested::default();
    let graph = parse_consuming(&bytes, &allowed.as_slice(), Limits::default(), &mut take).unwrap();
    assert_eq!(take.list_batches, 1500 * 3);
    assert_eq!(take.entries.len(), 1500);
    for (i, (k, xs)) in take.entries.iter().enumerate() {
        assert_eq!(k, &format!("k{i}"));
        let want: Vec<String> = (0..2001).map(|j| format!("x{}", (i + j) % 50)).collect();
        assert_eq!(xs, &want, "entry {i}");
    }
    // Only the skeleton is left: no entry's list items stood in the graph at the end.
    assert!(node_count(&graph) < 100, "{} nodes", node_count(&graph));
}

#[test]
fn an_unclaimed_dict_is_kept_whole() {
    let (v, bytes) = owner_pickle(2500);
    struct Nothing;
    impl Consumer for Nothing {
        fn claims(&mut self, _: NodeRef<'_>, _: &str) -> bool {
            false
        }
        fn consume(&mut self, _: &str, _: &[(NodeRef<'_>, NodeRef<'_>)]) -> ControlFlow<()> {
            ControlFlow::Break(())
        }
    }
    let allowed = [("m", "Owner")];
    let graph =
        parse_consuming(&bytes, &allowed.as_slice(), Limits::default(), &mut Nothing).unwrap();
    assert_eq!(graph.root().to_value(), v);
}

fn read_with(bytes: &[u8], allowed: &[(&str, &str)]) -> Result<Value, PickleError> {
    read(bytes, &allowed, Limits::default())
}

fn s(v: &str) -> Value {
    Value::Str(v.to_string())
}

fn int(i: i64) -> Value {
    Value::Int(i)
}

#[test]
fn plain_data_matches_python_at_protocols_2_and_4() {
    let expected = Value::Dict(vec![
        (
            s("a"),
            Value::List(vec![
                int(1),
                int(-2),
                int(300),
                int(70000),
                int(-70000),
                int(1 << 40),
                int(i64::MIN),
                int(i64::MAX),
            ]),
        ),
        (
            s("b"),
            Value::Tuple(vec![Value::Bool(true), Value::Bool(false), Value::None]),
        ),
        (s("c"), Value::Float(1.5)),
        (s("s"), s("héllo")),
        (s("t"), Value::Tuple(vec![])),
        (s("u"), Value::Tuple(vec![int(1)])),
        (s("v"), Value::Tuple(vec![int(1), int(2)])),
        (s("w"), Value::Tuple(vec![int(1), int(2), int(3)])),
        (s("x"), Value::Tuple(vec![int(1), int(2), int(3), int(4)])),
    ]);
    assert_eq!(read_with(PLAIN_P2, NOTHING), Ok(expected.clone()));
    assert_eq!(read_with(PLAIN_P4, NOTHING), Ok(expected));
}

#[test]
fn bytes_sets_and_long_strings_at_protocol_5() {
    let v = read_with(BYTES_SETS_P5, NOTHING).unwrap();
    assert_eq!(v.get("by"), Some(&Value::Bytes(vec![0, 1])));
    assert_eq!(v.get("ba"), Some(&Value::Bytes(b"xy".to_vec())));
    assert_eq!(v.get("set"), Some(&Value::Set(vec![int(3)])));
    assert_eq!(v.get("fs"), Some(&Value::Set(vec![int(4)])));
    assert_eq!(v.get("long"), Some(&s(&"z".repeat(300))));
}

#[test]
fn memo_gets_see_containers_filled_after_they_were_memoized() {
    let v = read_with(SHARED_P4, NOTHING).unwrap();
    assert_eq!(v.get("p"), Some(&Value::List(vec![int(1)])));
    assert_eq!(v.get("q"), Some(&Value::List(vec![int(1)])));
}

#[test]
fn reduce_then_setitems_fills_an_ordered_dict() {
    let v = read_with(ODICT_P2, &[("collections", "OrderedDict")]).unwrap();
    assert_eq!(
        v,
        Value::Object(Box::new(Object {
            callable: Value::global("collections", "OrderedDict"),
            args: vec![],
            new_obj: false,
            dict_items: vec![(s("k"), int(1)), (s("j"), int(2))],
            list_items: vec![],
            state: None,
        }))
    );
}

#[test]
fn torch_save_data_pkl_reads_as_a_rebuild_call() {
    let allowed = [
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch", "FloatStorage"),
        ("collections", "OrderedDict"),
    ];
    let v = read_with(TORCH_DATA_PKL, &allowed).unwrap();
    assert_eq!(v.class(), Some(("torch._utils", "_rebuild_tensor_v2")));
    let args = v.args().unwrap();
    assert_eq!(
        args.first(),
        Some(&Value::PersistentId(Box::new(Value::Tuple(vec![
            s("storage"),
            Value::global("torch", "FloatStorage"),
            s("0"),
            s("cpu"),
            int(4),
        ]))))
    );
    assert_eq!(args.get(1), Some(&int(1)));
    assert_eq!(args.get(2), Some(&Value::Tuple(vec![int(3)])));
    assert_eq!(args.get(3), Some(&Value::Tuple(vec![int(1)])));
    assert_eq!(args.get(4), Some(&Value::Bool(false)));
    assert_eq!(
        args.get(5).and_then(Value::class),
        Some(("collections", "OrderedDict"))
    );
}

#[test]
fn newobj_and_build_record_a_dataclass() {
    let v = read_with(DATACLASS_P4, &[("__main__", "Point")]).unwrap();
    let point = v.as_seq().and_then(|items| items.first()).unwrap();
    assert_eq!(point.class(), Some(("__main__", "Point")));
    assert!(matches!(point, Value::Object(o) if o.new_obj));
    assert_eq!(
        point.state(),
        Some(&Value::Dict(vec![(s("x"), int(1)), (s("y"), s("a"))]))
    );
}

#[test]
fn globals_outside_the_policy_are_refused_by_name() {
    assert_eq!(
        read_with(DATACLASS_P4, NOTHING),
        Err(PickleError::ForbiddenGlobal {
            module: "__main__".into(),
            name: "Point".into()
        })
    );
    // `os.system("true")` at protocol 2; nothing may run, the global alone is refused.
    let evil = b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.";
    assert_eq!(
        read_with(evil, NOTHING),
        Err(PickleError::ForbiddenGlobal {
            module: "posix".into(),
            name: "system".into()
        })
    );
}

#[test]
fn python2_module_names_are_mapped_under_protocol_2() {
    let p2 = b"\x80\x02c__builtin__\nset\n.";
    assert_eq!(
        read_with(p2, &[("builtins", "set")]),
        Ok(Value::global("builtins", "set"))
    );
    // At protocol 3 and above Python does not rename, so neither does the reader.
    let p3 = b"\x80\x03c__builtin__\nset\n.";
    assert!(read_with(p3, &[("builtins", "set")]).is_err());
}

#[test]
fn integers_outside_i64_are_kept_as_their_bytes() {
    let Ok(Value::BigInt(_)) = read_with(BIG_INT_P4, NOTHING) else {
        panic!("2**64 is not read as a big int");
    };
    // 2**63 needs nine bytes with a zero sign byte; -2**63 - 1 likewise with 0xff. Redundant
    // sign bytes are dropped, so equal ints have equal bytes.
    assert_eq!(
        read_with(
            b"\x8a\x0a\x00\x00\x00\x00\x00\x00\x00\x80\x00\x00.",
            NOTHING
        ),
        Ok(Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]))
    );
    assert_eq!(
        read_with(b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\xff.", NOTHING),
        Ok(Value::BigInt(vec![
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff
        ]))
    );
    // Written back as `LONG1` with the same bytes.
    let v = Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]);
    assert_eq!(
        crate::pickle::write(&v, crate::pickle::Protocol::V2),
        b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00."
    );
    // Redundant sign bytes are fine, and so is the empty encoding of 0.
    assert_eq!(
        read_with(
            b"\x8a\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff.",
            NOTHING
        ),
        Ok(int(-1))
    );
    assert_eq!(read_with(b"\x8a\x00.", NOTHING), Ok(int(0)));
    assert_eq!(
        read_with(b"\x8b\x02\x00\x00\x00\x00\x80.", NOTHING),
        Ok(int(-32768))
    );
    assert!(read_with(b"\x8b\xff\xff\xff\xff.", NOTHING).is_err());
}

#[test]
fn lone_surrogates_are_read_as_python_reads_them() {
    // "\ud800x" as Python's pickle writes it (`surrogatepass`); 0xff is not UTF-8 at all.
    let p = b"\x80\x02X\x04\x00\x00\x00\xed\xa0\x80x.";
    assert_eq!(
        read_with(p, NOTHING),
        Ok(Value::SurrogateStr(b"\xed\xa0\x80x".to_vec()))
    );
    assert_eq!(
        crate::pickle::write(&read_with(p, NOTHING).unwrap(), crate::pickle::Protocol::V2),
        p
    );
    assert!(read_with(b"\x80\x02X\x01\x00\x00\x00\xff.", NOTHING).is_err());
    assert!(read_with(b"\x80\x02X\x02\x00\x00\x00\xed\xa0.", NOTHING).is_err());
}

#[test]
fn cycles_are_rejected() {
    assert!(matches!(
        read_with(CYCLE_P4, NOTHING),
        Err(PickleError::Malformed { .. })
    ));
}

/// A list of ten references to the previous list, nine times over: 10^9 leaves from 24-byte
/// levels after a 5-byte prefix.
fn billion_laughs() -> Vec<u8> {
    let mut p = b"\x80\x04K\x00\x94".to_vec();
    for level in 0u8..9 {
        p.push(b'(');
        for _ in 0..10 {
            p.extend_from_slice(&[b'h', level]);
        }
        p.extend_from_slice(b"l\x94");
    }
    p.push(b'.');
    p
}

#[test]
fn billion_laughs_hits_the_node_limit_not_memory() {
    let p = billion_laughs();
    let err = read(&p, &NOTHING, Limits::default()).unwrap_err();
    assert!(matches!(err, PickleError::LimitExceeded { .. }), "{err}");
    // Refused by measuring the shared structure (the only check that speaks of copied shared
    // references), not by building 16M nodes first.
    assert!(
        err.to_string()
            .contains("once shared references are copied"),
        "{err}"
    );
    // Three levels (10^3 leaves) are fine, and shared lists come out as equal copies.
    let mut small = b"\x80\x04K\x00\x94".to_vec();
    small.extend_from_slice(p.get(5..5 + 3 * 24).unwrap());
    small.push(b'.');
    let v = read(&small, &NOTHING, Limits::default()).unwrap();
    let level2 = v.as_seq().unwrap();
    assert_eq!(level2.len(), 10);
    assert!(level2.iter().all(|l| l == &level2[0]));
}

#[test]
fn limits_are_enforced() {
    let tight = Limits {
        max_stack: 4,
        max_memo: 2,
        max_nodes: 100,
        max_depth: 3,
    };
    // Five values on the stack.
    let err = read(b"(NNNNNt.", &NOTHING, tight).unwrap_err();
    assert!(
        matches!(err, PickleError::LimitExceeded { offset: 5, .. }),
        "{err}"
    );
    // Three memo entries.
    let err = read(b"N\x94\x94q\x05.", &NOTHING, tight).unwrap_err();
    assert!(
        matches!(err, PickleError::LimitExceeded { offset: 3, .. }),
        "{err}"
    );
    // Re-storing an existing memo key does not count again.
    assert_eq!(
        read(b"N\x94\x94q\x01q\x00.", &NOTHING, tight),
        Ok(Value::None)
    );
    // Four nested lists, three allowed.
    let nested = read(b"(((]\x85\x85\x85.", &NOTHING, tight);
    assert!(matches!(nested, Err(PickleError::LimitExceeded { .. })));
    assert!(read(b"((]\x85\x85.", &NOTHING, tight).is_ok());
    // More than 100 nodes in the arena.
    let mut p = vec![b'('];
    p.extend(std::iter::repeat_n(b'N', 101));
    p.extend_from_slice(b"l.");
    let big = Limits {
        max_stack: 1000,
        ..tight
    };
    assert!(matches!(
        read(&p, &NOTHING, big),
        Err(PickleError::LimitExceeded { .. })
    ));
}

#[test]
fn every_truncation_is_an_error() {
    for input in [PLAIN_P2, PLAIN_P4, BYTES_SETS_P5, TORCH_DATA_PKL] {
        for end in 0..input.len() {
            let err = read(input.get(..end).unwrap(), &NOTHING, Limits::default());
            assert!(err.is_err(), "prefix of {end} bytes read");
        }
    }
    assert_eq!(
        read_with(&PLAIN_P2[..20], NOTHING),
        Err(PickleError::Truncated { offset: 20 })
    );
    // With a frame, its length already says the data is short.
    assert!(matches!(
        read_with(&PLAIN_P4[..20], NOTHING),
        Err(PickleError::Malformed { offset: 2, .. })
    ));
    // A length prefix far past the end is truncation, not an allocation.
    let huge = b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\x7f";
    assert_eq!(
        read_with(huge, NOTHING),
        Err(PickleError::Truncated { offset: huge.len() })
    );
}

#[test]
fn bytes_after_stop_are_ignored() {
    assert_eq!(read_with(b"K\x07.garbage", NOTHING), Ok(int(7)));
}

#[test]
fn unsupported_opcodes_name_their_offset() {
    for (op, p) in [
        (b'i', b"\x80\x02imod\nname\n.".as_slice()),
        (b'o', b"\x80\x02(o.".as_slice()),
        (0x82, b"\x80\x02\x82\x01.".as_slice()),
        (b'P', b"\x80\x02P1\n.".as_slice()),
        (b'S', b"\x80\x02S'a'\n.".as_slice()),
        (b'F', b"\x80\x02F1.0\n.".as_slice()),
    ] {
        let offset = if op == b'o' { 3 } else { 2 };
        assert_eq!(
            read_with(p, NOTHING),
            Err(PickleError::UnsupportedOpcode { opcode: op, offset })
        );
    }
}

#[test]
fn stack_misuse_is_malformed_with_offset() {
    for p in [
        &b"."[..],
        b"(.",
        b"N(a.",
        b"Nu.",
        b"N1.",
        b"h\x00.",
        b"K\x01K\x02R.",
        b"N\x85b.",
    ] {
        let err = read_with(p, NOTHING).unwrap_err();
        assert!(matches!(err, PickleError::Malformed { .. }), "{p:?}: {err}");
        assert!(err.offset().is_some());
    }
    // POP on an empty frame drops the mark, as in Python.
    assert_eq!(read_with(b"N(0.", NOTHING), Ok(Value::None));
}

#[test]
fn protocol_0_text_arguments() {
    let p = b"(I01\nI00\nI-12\np3\ng3\nt.";
    let want = Value::Tuple(vec![
        Value::Bool(true),
        Value::Bool(false),
        int(-12),
        int(-12),
    ]);
    assert_eq!(read_with(p, NOTHING), Ok(want));
    // Python 2 `str` reads as text.
    assert_eq!(
        read_with(b"U\x02hiT\x01\x00\x00\x00!\x86.", NOTHING),
        Ok(Value::Tuple(vec![s("hi"), s("!")]))
    );
    assert!(read_with(b"U\x01\xff.", NOTHING).is_err());
}

#[test]
fn repeated_dict_keys_keep_first_position_and_last_value() {
    let p = b"}(K\x01K\x0aK\x02K\x14\x88K\x1eu.";
    assert_eq!(
        read_with(p, NOTHING),
        Ok(Value::Dict(vec![(int(1), int(30)), (int(2), int(20))]))
    );
    assert_eq!(
        read_with(b"\x8f(K\x01K\x01\x90.", NOTHING),
        Ok(Value::Set(vec![int(1)]))
    );
}

#[test]
fn newobj_ex_without_keywords_is_newobj() {
    let allowed = [("m", "C")];
    let p = b"\x8c\x01m\x8c\x01C\x93K\x01\x85}\x92.";
    let v = read_with(p, &allowed).unwrap();
    assert!(matches!(v, Value::Object(ref o) if o.new_obj && o.args == [int(1)]));
    let with_kwargs = b"\x8c\x01m\x8c\x01C\x93)}(\x8c\x01kK\x01u\x92.";
    assert!(matches!(
        read_with(with_kwargs, &allowed),
        Err(PickleError::UnsupportedOpcode { opcode: 0x92, .. })
    ));
}

#[test]
fn views_read_what_the_tree_holds_without_copying() {
    let graph = parse(PLAIN_P4, &NOTHING, Limits::default()).unwrap();
    let root = graph.root();
    let text = root.get("s").and_then(|v| v.as_str()).unwrap();
    assert_eq!(text, "héllo");
    // Borrowed from the pickle bytes, not copied.
    let input = PLAIN_P4.as_ptr_range();
    assert!(input.contains(&text.as_ptr()));
    let ints: Vec<i64> = root
        .get("a")
        .unwrap()
        .as_seq()
        .unwrap()
        .filter_map(|v| v.as_int())
        .collect();
    assert_eq!(
        ints,
        [1, -2, 300, 70000, -70000, 1 << 40, i64::MIN, i64::MAX]
    );
    assert_eq!(
        root.get("c").map(|v| v.kind()),
        Some(crate::pickle::Kind::Float)
    );
    assert!(root.get("missing").is_none());
    for p in [PLAIN_P2, PLAIN_P4, BYTES_SETS_P5, SHARED_P4] {
        let graph = parse(p, &NOTHING, Limits::default()).unwrap();
        let keys: Vec<&str> = graph
            .root()
            .dict_items()
            .unwrap()
            .iter()
            .filter_map(|(k, _)| k.as_str())
            .collect();
        let Ok(Value::Dict(tree)) = read_with(p, NOTHING) else {
            panic!("not a dict")
        };
        let tree_keys: Vec<&str> = tree.iter().filter_map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, tree_keys);
    }
    let odict = parse(
        ODICT_P2,
        &[("collections", "OrderedDict")].as_slice(),
        Limits::default(),
    )
    .unwrap();
    let items = odict.root().object_dict_items().unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!(items[1].0.as_str(), Some("j"));
}

#[test]
fn views_keep_the_last_value_of_a_repeated_key() {
    let p = b"}(\x8c\x01kK\x01\x8c\x01jK\x02\x8c\x01kK\x03u.";
    let graph = parse(p, &NOTHING, Limits::default()).unwrap();
    let root = graph.root();
    assert_eq!(root.get("k").and_then(|v| v.as_int()), Some(3));
    let items = root.dict_items().unwrap();
    let pairs: Vec<(&str, i64)> = items
        .iter()
        .map(|(k, v)| (k.as_str().unwrap(), v.as_int().unwrap()))
        .collect();
    assert_eq!(pairs, [("k", 3), ("j", 2)]);
}

#[test]
fn memo_indices_may_come_in_any_order() {
    // `BINPUT 5` before `BINPUT 0`, then both fetched: (None, 1).
    let p = b"Nq\x05K\x01q\x00h\x05h\x00\x86.";
    assert_eq!(
        read_with(p, NOTHING),
        Ok(Value::Tuple(vec![Value::None, int(1)]))
    );
    // An index put out of order, then reached by counting up, is one entry, not two.
    let tight = Limits {
        max_memo: 2,
        ..Limits::default()
    };
    assert!(read(b"Nq\x01q\x00q\x01q\x00.", &NOTHING, tight).is_ok());
    assert!(read(b"Nq\x01q\x00q\x02.", &NOTHING, tight).is_err());
}

#[test]
fn memo_bombs_are_refused_before_any_view_walks_them() {
    let p = billion_laughs();
    let err = parse(&p, &NOTHING, Limits::default()).unwrap_err();
    assert!(matches!(err, PickleError::LimitExceeded { .. }), "{err}");
    // A cycle is refused by `parse` too, so no view can loop.
    assert!(matches!(
        parse(CYCLE_P4, &NOTHING, Limits::default()),
        Err(PickleError::Malformed { .. })
    ));
}

#[test]
fn small_ints_and_empty_tuples_take_no_nodes_but_read_the_same() {
    // (0, 2**31 - 2, 2**31 - 1, 2**31, -1, (), ())
    let p = b"(K\x00J\xfe\xff\xff\x7fJ\xff\xff\xff\x7f\x8a\x05\x00\x00\x00\x80\x00J\xff\xff\xff\xff))t.";
    let want = [0, (1 << 31) - 2, (1 << 31) - 1, 1 << 31, -1].map(int);
    let mut want = want.to_vec();
    want.extend([Value::Tuple(vec![]), Value::Tuple(vec![])]);
    assert_eq!(read_with(p, NOTHING), Ok(Value::Tuple(want)));
    let graph = parse(p, &NOTHING, Limits::default()).unwrap();
    // The three ints from 2**31 - 1 up, one empty tuple for both, and the outer tuple.
    assert_eq!(graph.nodes.len(), 5);
    let items: Vec<_> = graph.root().as_seq().unwrap().collect();
    assert_eq!(items.len(), 7);
    assert_eq!(items[1].as_int(), Some((1 << 31) - 2));
    assert_eq!(items[1].kind(), crate::pickle::Kind::Int);
    // The expanded size still counts each of them.
    let tight = Limits {
        max_nodes: 7,
        ..Limits::default()
    };
    assert!(matches!(
        parse(p, &NOTHING, tight),
        Err(PickleError::LimitExceeded { .. })
    ));
    let enough = Limits {
        max_nodes: 8,
        ..Limits::default()
    };
    assert!(parse(p, &NOTHING, enough).is_ok());
}

#[test]
fn random_bytes_never_panic() {
    // A cheap deterministic xorshift so the test needs no seed handling.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 24) as usize;
        let bytes: Vec<u8> = (0..len)
            .map(|i| (x >> ((i % 8) * 8)) as u8 ^ (i as u8))
            .collect();
        let _ = read(&bytes, &NOTHING, Limits::default());
    }
}
#[test]
fn a_frame_may_not_run_past_the_data() {
    // PLAIN_P4's one frame covers everything after its length; as `pickle.loads` does, a
    // frame that announces more is refused, and one that announces less (or nothing) is not.
    let announced = u64::from_le_bytes(PLAIN_P4[3..11].try_into().unwrap());
    assert_eq!(announced as usize, PLAIN_P4.len() - 11);
    let with_frame = |n: u64| {
        let mut p = PLAIN_P4.to_vec();
        p[3..11].copy_from_slice(&n.to_le_bytes());
        read(&p, &NOTHING, Limits::default())
    };
    for n in [0, 1, announced - 1, announced] {
        assert!(with_frame(n).is_ok(), "frame of {n}");
    }
    for n in [announced + 1, 1 << 63, u64::MAX] {
        match with_frame(n) {
            Err(PickleError::Malformed { offset: 2, reason }) => {
                assert!(reason.contains("`FRAME` announces"), "{reason}")
            }
            other => panic!("frame of {n}: {other:?}"),
        }
    }
}

#[test]
fn persistent_ids_are_refused_where_the_policy_says() {
    struct NoPids;
    impl Globals for NoPids {
        fn allows(&self, _: &str, _: &str) -> bool {
            false
        }
        fn allows_persistent_ids(&self) -> bool {
            false
        }
    }
    // `N Q .`: a persistent id of None.
    let p = [0x80, 4, b'N', b'Q', b'.'];
    assert!(read(&p, &NOTHING, Limits::default()).is_ok());
    assert!(matches!(
        read(&p, &NoPids, Limits::default()),
        Err(PickleError::Malformed { offset: 3, .. })
    ));
}
#[test]
fn unhashable_keys_are_refused_as_python_refuses_them() {
    // `{KEY: 1}` by SETITEM, SETITEMS and DICT, and `{KEY}` by ADDITEMS and FROZENSET.
    let shapes: [(&[u8], &[u8]); 5] = [
        (b"}", b"K\x01s."),
        (b"}(", b"K\x01u."),
        (b"(", b"K\x01d."),
        (b"\x8f(", b"\x90."),
        (b"(", b"\x91."),
    ];
    let keys: [(&[u8], bool); 6] = [
        (b"]", false),
        (b"}", false),
        (b"]\x85", false),
        (b"K\x01]\x86\x85", false),
        (b"K\x01\x85", true),
        (b"\x8c\x01a", true),
    ];
    for (before, after) in shapes {
        for (key, hashable) in keys {
            let p = [&[0x80, 4][..], before, key, after].concat();
            let got = read(&p, &NOTHING, Limits::default());
            match (hashable, got) {
                (true, Ok(_)) => {}
                (false, Err(PickleError::Malformed { reason, .. }))
                    if reason.contains("cannot hash") => {}
                (_, other) => panic!("{p:?}: {other:?}"),
            }
        }
    }
}
