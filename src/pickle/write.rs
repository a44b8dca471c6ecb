//! Pickle writer: a [`Value`] tree to bytes Python's `pickle.load` reads back.
//!
//! The output mirrors what CPython's pickler writes for the same objects. Strings and globals that
//! occur more than once are written once and then fetched from the memo (DCP's `.metadata` repeats
//! class paths and fqns for every chunk, so this keeps files about as small as torch's); every other
//! value is written out wherever it occurs, which only costs bytes.
//! - [`Protocol::V2`] is torch.save's `data.pkl`: globals as `GLOBAL` (`c module\nname\n`), strings
//!   as `BINUNICODE`.
//! - [`Protocol::V4`] is DCP's `.metadata`: one `FRAME`, globals as `STACK_GLOBAL`, short strings as
//!   `SHORT_BINUNICODE`.
//!
//! Two values have no protocol 2 spelling that round-trips as the same [`Value`]: bytes (Python 3
//! writes `_codecs.encode(str, "latin1")`) and sets (`builtins.set([...])`). Both protocols write them
//! with the protocol 3/4 opcodes (`BINBYTES`, `EMPTY_SET` + `ADDITEMS`); Python's unpickler accepts
//! every opcode whatever `PROTO` says. A `GLOBAL` whose module or name holds a newline cannot be
//! spelled as text either and is written as `STACK_GLOBAL`.
use std::collections::HashMap;

use super::{Object, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// What torch.save uses for `data.pkl`.
    V2,
    /// What DCP uses for `.metadata`.
    V4,
}

/// Serialize `value` as one pickle ending in `STOP`.
pub fn write(value: &Value, protocol: Protocol) -> Vec<u8> {
    let mut body = Vec::new();
    let mut counts = HashMap::new();
    count(value, &mut counts);
    Writer {
        out: &mut body,
        protocol,
        memo: counts
            .into_iter()
            .filter(|&(_, n)| n > 1)
            .map(|(k, _)| (k, None))
            .collect(),
        next_memo: 0,
    }
    .value(value);
    body.push(b'.');
    match protocol {
        Protocol::V2 => {
            let mut out = vec![0x80, 2];
            out.extend_from_slice(&body);
            out
        }
        Protocol::V4 => {
            let mut out = Vec::with_capacity(body.len() + 11);
            out.extend_from_slice(&[0x80, 4, 0x95]);
            out.extend_from_slice(&(body.len() as u64).to_le_bytes());
            out.extend_from_slice(&body);
            out
        }
    }
}

/// A value worth memoizing: immutable in Python, so sharing it cannot change what is loaded.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Shared<'v> {
    Str(&'v str),
    Global(&'v str, &'v str),
}

/// How often each string and global occurs in `value`.
fn count<'v>(value: &'v Value, counts: &mut HashMap<Shared<'v>, usize>) {
    let mut bump = |k| *counts.entry(k).or_insert(0) += 1;
    match value {
        Value::Str(s) => bump(Shared::Str(s)),
        Value::Global(g) => bump(Shared::Global(&g.module, &g.name)),
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().for_each(|v| count(v, counts))
        }
        Value::Dict(items) => items.iter().for_each(|(k, v)| {
            count(k, counts);
            count(v, counts);
        }),
        Value::Object(object) => {
            let Object {
                callable,
                args,
                dict_items,
                list_items,
                state,
                ..
            } = &**object;
            count(callable, counts);
            args.iter().for_each(|v| count(v, counts));
            dict_items.iter().for_each(|(k, v)| {
                count(k, counts);
                count(v, counts);
            });
            list_items.iter().for_each(|v| count(v, counts));
            if let Some(s) = state {
                count(s, counts);
            }
        }
        Value::PersistentId(pid) => count(pid, counts),
        Value::None | Value::Bool(_) | Value::Int(_) | Value::Float(_) | Value::Bytes(_) => {}
    }
}

struct Writer<'a, 'v> {
    out: &'a mut Vec<u8>,
    protocol: Protocol,
    /// Values that occur more than once, with their memo index once written.
    memo: HashMap<Shared<'v>, Option<u32>>,
    next_memo: u32,
}

impl<'v> Writer<'_, 'v> {
    fn op(&mut self, op: u8) {
        self.out.push(op);
    }

    /// Fetch `key` from the memo if it was written before; otherwise note that it is about to be.
    /// Returns true when the value was fetched and nothing more needs writing.
    fn recall(&mut self, key: Shared<'v>) -> bool {
        match self.memo.get(&key) {
            Some(Some(index)) => {
                let index = *index;
                match u8::try_from(index) {
                    Ok(i) => {
                        self.op(b'h');
                        self.out.push(i);
                    }
                    Err(_) => {
                        self.op(b'j');
                        self.out.extend_from_slice(&index.to_le_bytes());
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Store what was just written under `key`, if it occurs again later.
    fn remember(&mut self, key: Shared<'v>) {
        let index = self.next_memo;
        let Some(slot @ None) = self.memo.get_mut(&key) else {
            return;
        };
        // Past u32::MAX entries the value is simply written again.
        let Some(next) = index.checked_add(1) else {
            return;
        };
        *slot = Some(index);
        self.next_memo = next;
        match self.protocol {
            // MEMOIZE stores at `len(memo)`, which is `index` because every entry is added here.
            Protocol::V4 => self.op(0x94),
            Protocol::V2 => match u8::try_from(index) {
                Ok(i) => {
                    self.op(b'q');
                    self.out.push(i);
                }
                Err(_) => {
                    self.op(b'r');
                    self.out.extend_from_slice(&index.to_le_bytes());
                }
            },
        }
    }

    fn value(&mut self, value: &'v Value) {
        match value {
            Value::None => self.op(b'N'),
            Value::Bool(true) => self.op(0x88),
            Value::Bool(false) => self.op(0x89),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.op(b'G');
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => {
                if !self.recall(Shared::Str(s)) {
                    self.str(s);
                    self.remember(Shared::Str(s));
                }
            }
            Value::Bytes(b) => self.bytes(b),
            Value::Tuple(items) => self.tuple(items),
            Value::List(items) => {
                self.op(b']');
                self.appends(items);
            }
            Value::Dict(items) => {
                self.op(b'}');
                self.setitems(items);
            }
            Value::Set(items) => {
                self.op(0x8f);
                if !items.is_empty() {
                    self.op(b'(');
                    items.iter().for_each(|v| self.value(v));
                    self.op(0x90);
                }
            }
            Value::Global(g) => {
                let (module, name) = (&g.module, &g.name);
                if !self.recall(Shared::Global(module, name)) {
                    self.global(module, name);
                    self.remember(Shared::Global(module, name));
                }
            }
            Value::Object(object) => {
                let Object {
                    callable,
                    args,
                    new_obj,
                    dict_items,
                    list_items,
                    state,
                } = &**object;
                self.value(callable);
                self.tuple(args);
                self.op(if *new_obj { 0x81 } else { b'R' });
                // CPython's `save_reduce` order: list items, dict items, then state.
                self.appends(list_items);
                self.setitems(dict_items);
                if let Some(state) = state {
                    self.value(state);
                    self.op(b'b');
                }
            }
            Value::PersistentId(pid) => {
                self.value(pid);
                self.op(b'Q');
            }
        }
    }

    /// The smallest integer opcode, as CPython's `save_long` picks it.
    fn int(&mut self, i: i64) {
        if let Ok(b) = u8::try_from(i) {
            self.op(b'K');
            self.out.push(b);
        } else if let Ok(b) = u16::try_from(i) {
            self.op(b'M');
            self.out.extend_from_slice(&b.to_le_bytes());
        } else if let Ok(b) = i32::try_from(i) {
            self.op(b'J');
            self.out.extend_from_slice(&b.to_le_bytes());
        } else {
            // LONG1 with the shortest two's complement that keeps the sign.
            let bytes = i.to_le_bytes();
            let mut n = bytes.len();
            while n > 1 {
                let (last, prev) = (bytes[n - 1], bytes[n - 2]);
                let redundant =
                    (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
                if !redundant {
                    break;
                }
                n -= 1;
            }
            self.op(0x8a);
            self.out.push(n as u8);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }

    fn str(&mut self, s: &str) {
        let b = s.as_bytes();
        match (self.protocol, u8::try_from(b.len()), u32::try_from(b.len())) {
            (Protocol::V4, Ok(n), _) => {
                self.op(0x8c);
                self.out.push(n);
            }
            (_, _, Ok(n)) => {
                self.op(b'X');
                self.out.extend_from_slice(&n.to_le_bytes());
            }
            _ => {
                self.op(0x8d);
                self.out.extend_from_slice(&(b.len() as u64).to_le_bytes());
            }
        }
        self.out.extend_from_slice(b);
    }

    fn bytes(&mut self, b: &[u8]) {
        match (u8::try_from(b.len()), u32::try_from(b.len())) {
            (Ok(n), _) => {
                self.op(b'C');
                self.out.push(n);
            }
            (_, Ok(n)) => {
                self.op(b'B');
                self.out.extend_from_slice(&n.to_le_bytes());
            }
            _ => {
                self.op(0x8e);
                self.out.extend_from_slice(&(b.len() as u64).to_le_bytes());
            }
        }
        self.out.extend_from_slice(b);
    }

    fn tuple(&mut self, items: &'v [Value]) {
        match items {
            [] => self.op(b')'),
            [a] => {
                self.value(a);
                self.op(0x85);
            }
            [a, b] => {
                self.value(a);
                self.value(b);
                self.op(0x86);
            }
            [a, b, c] => {
                self.value(a);
                self.value(b);
                self.value(c);
                self.op(0x87);
            }
            _ => {
                self.op(b'(');
                items.iter().for_each(|v| self.value(v));
                self.op(b't');
            }
        }
    }

    /// Items into the list (or object) on top of the stack.
    fn appends(&mut self, items: &'v [Value]) {
        if items.is_empty() {
            return;
        }
        self.op(b'(');
        items.iter().for_each(|v| self.value(v));
        self.op(b'e');
    }

    /// Pairs into the dict (or object) on top of the stack.
    fn setitems(&mut self, items: &'v [(Value, Value)]) {
        if items.is_empty() {
            return;
        }
        self.op(b'(');
        for (k, v) in items {
            self.value(k);
            self.value(v);
        }
        self.op(b'u');
    }

    fn global(&mut self, module: &str, name: &str) {
        let textual = !module.contains('\n') && !name.contains('\n');
        if self.protocol == Protocol::V2 && textual {
            self.op(b'c');
            self.out.extend_from_slice(module.as_bytes());
            self.out.push(b'\n');
            self.out.extend_from_slice(name.as_bytes());
            self.out.push(b'\n');
        } else {
            self.str(module);
            self.str(name);
            self.op(0x93);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::{read, Globals, Limits};
    use proptest::prelude::*;

    /// The round-trip tests name arbitrary globals; a policy that allows all of them.
    struct AnyGlobal;

    impl Globals for AnyGlobal {
        fn allows(&self, _: &str, _: &str) -> bool {
            true
        }
    }

    fn round_trip(v: &Value, protocol: Protocol) -> Value {
        read(&write(v, protocol), &AnyGlobal, Limits::default()).unwrap()
    }

    #[test]
    fn headers_and_globals_follow_the_protocol() {
        let g = Value::global("torch", "FloatStorage");
        assert_eq!(write(&g, Protocol::V2), b"\x80\x02ctorch\nFloatStorage\n.");
        let v4 = write(&g, Protocol::V4);
        assert_eq!(
            v4,
            b"\x80\x04\x95\x17\x00\x00\x00\x00\x00\x00\x00\x8c\x05torch\x8c\x0cFloatStorage\x93."
        );
        // A newline cannot be spelled by `GLOBAL`, so protocol 2 falls back to `STACK_GLOBAL`.
        let odd = Value::global("a\nb", "c");
        assert_eq!(round_trip(&odd, Protocol::V2), odd);
    }

    #[test]
    fn integers_use_the_smallest_opcode() {
        let cases: &[(i64, &[u8])] = &[
            (0, b"K\x00"),
            (255, b"K\xff"),
            (256, b"M\x00\x01"),
            (65535, b"M\xff\xff"),
            (65536, b"J\x00\x00\x01\x00"),
            (-1, b"J\xff\xff\xff\xff"),
            (1 << 31, b"\x8a\x05\x00\x00\x00\x80\x00"),
            (-(1 << 31) - 1, b"\x8a\x05\xff\xff\xff\x7f\xff"),
            (i64::MAX, b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f"),
            (i64::MIN, b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80"),
        ];
        for &(i, want) in cases {
            let got = write(&Value::Int(i), Protocol::V2);
            assert_eq!(got.get(2..got.len() - 1), Some(want), "{i}");
            assert_eq!(round_trip(&Value::Int(i), Protocol::V4), Value::Int(i));
        }
    }

    #[test]
    fn objects_write_call_items_then_state() {
        let v = Value::Object(Box::new(Object {
            callable: Value::global("collections", "OrderedDict"),
            args: vec![],
            new_obj: false,
            dict_items: vec![(Value::Str("k".into()), Value::Int(1))],
            list_items: vec![],
            state: None,
        }));
        assert_eq!(
            write(&v, Protocol::V2),
            b"\x80\x02ccollections\nOrderedDict\n)R(X\x01\x00\x00\x00kK\x01u."
        );
        let pid = Value::PersistentId(Box::new(Value::Tuple(vec![Value::Str("0".into())])));
        assert_eq!(
            write(&pid, Protocol::V2),
            b"\x80\x02X\x01\x00\x00\x000\x85Q."
        );
    }

    #[test]
    fn repeated_strings_and_globals_come_from_the_memo() {
        // 300 distinct strings twice each: memo indices past 255 need the long opcodes.
        let strings: Vec<Value> = (0..300).map(|i| Value::Str(format!("s{i}"))).collect();
        let mut items = strings.clone();
        items.extend(strings);
        items.push(Value::global("torch", "Size"));
        items.push(Value::global("torch", "Size"));
        let v = Value::List(items);
        for protocol in [Protocol::V2, Protocol::V4] {
            let bytes = write(&v, protocol);
            assert_eq!(round_trip(&v, protocol), v);
            assert!(
                bytes.windows(5).any(|w| w == b"j\x2b\x01\x00\x00"),
                "{protocol:?}"
            );
        }
        let once = write(&Value::List(vec![Value::Str("x".into())]), Protocol::V2);
        assert_eq!(once, b"\x80\x02](X\x01\x00\x00\x00xe.");
    }

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::None),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            any::<f64>()
                .prop_filter("NaN is not equal to itself", |f| !f.is_nan())
                .prop_map(Value::Float),
            ".{0,300}".prop_map(Value::Str),
            prop::collection::vec(any::<u8>(), 0..300).prop_map(Value::Bytes),
            // `__builtin__` and `copy_reg` are renamed when read under protocol 2.
            ("[a-z_.]{1,12}", "[A-Za-z_]{1,12}")
                .prop_filter("renamed module", |(m, _)| m != "__builtin__"
                    && m != "copy_reg")
                .prop_map(|(m, n)| Value::global(&m, &n)),
        ]
    }

    fn value() -> impl Strategy<Value = Value> {
        leaf().prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Tuple),
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
                // Distinct keys: a dict with repeated keys does not survive Python either.
                prop::collection::btree_map(".{0,8}", inner.clone(), 0..6).prop_map(|m| {
                    Value::Dict(m.into_iter().map(|(k, v)| (Value::Str(k), v)).collect())
                }),
                prop::collection::btree_set(any::<i64>(), 0..6)
                    .prop_map(|s| Value::Set(s.into_iter().map(Value::Int).collect())),
                (
                    inner.clone(),
                    prop::collection::vec(inner.clone(), 0..4),
                    any::<bool>(),
                    prop::collection::btree_map(".{0,8}", inner.clone(), 0..3),
                    prop::collection::vec(inner.clone(), 0..3),
                    prop::option::of(inner.clone()),
                )
                    .prop_map(|(c, args, new_obj, d, l, state)| {
                        Value::Object(Box::new(Object {
                            callable: c,
                            args,
                            new_obj,
                            dict_items: d.into_iter().map(|(k, v)| (Value::Str(k), v)).collect(),
                            list_items: l,
                            state,
                        }))
                    }),
                inner.prop_map(|v| Value::PersistentId(Box::new(v))),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn values_round_trip_through_protocol_2(v in value()) {
            prop_assert_eq!(round_trip(&v, Protocol::V2), v);
        }

        #[test]
        fn values_round_trip_through_protocol_4(v in value()) {
            prop_assert_eq!(round_trip(&v, Protocol::V4), v);
        }
    }
}
