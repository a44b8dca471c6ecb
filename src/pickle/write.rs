//! Pickle writer: bytes Python's `pickle.load` reads back, from a [`Value`] tree ([`write`]) or
//! described item by item to a [`Stream`] ([`write_with`]), so that a large pickle such as DCP's
//! `.metadata` with a million tensor pieces never exists as a tree in memory.
//!
//! The output mirrors what CPython's pickler writes for the same objects. Strings and globals that
//! occur more than once are written once and then fetched from the memo (DCP's `.metadata` repeats
//! class paths and fqns for every chunk, so this keeps files about as small as torch's); every other
//! value is written out wherever it occurs, which only costs bytes. Which ones repeat is learned by
//! describing the pickle twice: the first pass only counts strings and globals, the second writes.
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
use std::sync::atomic::{AtomicBool, Ordering};

use super::opcodes as op;
use super::{Object, Value};

/// Items per `APPENDS`/`SETITEMS`/`ADDITEMS`, as CPython's pickler batches them (`_BATCHSIZE`).
pub(super) const BATCH: usize = 1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// What torch.save uses for `data.pkl`.
    V2,
    /// What DCP uses for `.metadata`.
    V4,
}

/// Serialize `value` as one pickle ending in `STOP`.
pub fn write(value: &Value, protocol: Protocol) -> Vec<u8> {
    write_with(protocol, |w| w.value(value))
}

/// Serialize the one value `describe` writes to a [`Stream`], as one pickle ending in `STOP`.
///
/// `describe` is called twice (to count repeated strings, then to write) and must describe the
/// same value both times.
pub fn write_with<'v>(protocol: Protocol, describe: impl Fn(&mut Stream<'v, '_>)) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    // Writing to memory cannot fail, and nothing stops it.
    let _ = write_to(&mut out, protocol, &AtomicBool::new(false), describe);
    out.into_inner()
}

/// Bytes a [`Stream`] gathers before handing them to its sink.
const FLUSH_BYTES: usize = 1 << 20;

/// Like [`write_with`], but streamed to `sink` (from its current position) through a buffer of
/// about a megabyte, so that a pickle of hundreds of megabytes (a `.metadata` of millions of
/// pieces) is never in memory. Protocol 4's one `FRAME` length is written last, by seeking back.
/// Returns the pickle's length.
///
/// Once `stop` is set (Ctrl-C), both passes stop within a batch of items and this returns an
/// error: walking millions of pieces twice takes seconds, too long to wait for an interrupt.
pub fn write_to<'v, W: std::io::Write + std::io::Seek>(
    sink: &mut W,
    protocol: Protocol,
    stop: &AtomicBool,
    describe: impl Fn(&mut Stream<'v, '_>),
) -> std::io::Result<u64> {
    let mut counter = Stream {
        out: Vec::new(),
        sink: None,
        written: 0,
        error: None,
        stop,
        protocol,
        memo: Memo::Counting(HashMap::new()),
    };
    describe(&mut counter);
    if let Some(e) = counter.error {
        return Err(e);
    }
    let repeated = match counter.memo {
        Memo::Counting(counts) => counts
            .into_iter()
            .filter(|&(_, n)| n > 1)
            .map(|(k, _)| (k, None))
            .collect(),
        // Not reached: a stream never changes pass.
        Memo::Writing { memo, .. } => memo,
    };
    let start = sink.stream_position()?;
    // Protocol 4's frame length is filled in once the body is known.
    let header: &[u8] = match protocol {
        Protocol::V2 => &[op::PROTO, 2],
        Protocol::V4 => &[op::PROTO, 4, op::FRAME, 0, 0, 0, 0, 0, 0, 0, 0],
    };
    let mut writer = Stream {
        out: Vec::with_capacity(FLUSH_BYTES.min(64 << 10)),
        sink: Some(sink as &mut dyn std::io::Write),
        written: 0,
        error: None,
        stop,
        protocol,
        memo: Memo::Writing {
            memo: repeated,
            next: 0,
        },
    };
    writer.put(header);
    describe(&mut writer);
    writer.op(op::STOP);
    writer.flush();
    if let Some(e) = writer.error {
        return Err(e);
    }
    let len = writer.written;
    if protocol == Protocol::V4 {
        let body = len - header.len() as u64;
        sink.seek(std::io::SeekFrom::Start(start + 3))?;
        sink.write_all(&body.to_le_bytes())?;
        sink.seek(std::io::SeekFrom::Start(start + len))?;
    }
    Ok(len)
}

/// A value worth memoizing: immutable in Python, so sharing it cannot change what is loaded.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Shared<'v> {
    Str(&'v str),
    Global(&'v str, &'v str),
}

enum Memo<'v> {
    /// The first pass: how often each string and global occurs; no bytes are kept.
    Counting(HashMap<Shared<'v>, usize>),
    /// The second pass: values that occur more than once, with their memo index once written.
    Writing {
        memo: HashMap<Shared<'v>, Option<u32>>,
        next: u32,
    },
}

/// A pickle being written one item at a time, in the order the unpickler's stack sees them.
///
/// Containers take their length up front (a tuple's opcode depends on it, a list or dict writes
/// its `MARK` only when non-empty) and a closure that writes exactly that many items (for a dict,
/// key then value, that many pairs). Objects are spelled as pickle does: the callable, its
/// arguments as a tuple, [`Stream::call`], then any [`Stream::appends`], [`Stream::setitems`] and
/// [`Stream::build`].
pub struct Stream<'v, 's> {
    /// Bytes not yet handed to `sink`.
    out: Vec<u8>,
    /// Where the second pass writes; `None` while counting.
    sink: Option<&'s mut dyn std::io::Write>,
    /// Bytes written so far, `out` included.
    written: u64,
    /// The sink's first error, or the stop; later writes are skipped, and containers end early.
    error: Option<std::io::Error>,
    /// Set from outside to end the writing with an error.
    stop: &'s AtomicBool,
    protocol: Protocol,
    memo: Memo<'v>,
}

impl<'v> Stream<'v, '_> {
    fn put(&mut self, bytes: &[u8]) {
        if let Memo::Writing { .. } = self.memo {
            self.out.extend_from_slice(bytes);
            self.written += bytes.len() as u64;
            if self.out.len() >= FLUSH_BYTES {
                self.flush();
            }
        }
    }

    fn flush(&mut self) {
        if let (Some(sink), None) = (self.sink.as_mut(), &self.error) {
            if let Err(e) = sink.write_all(&self.out) {
                self.error = Some(e);
            }
        }
        self.out.clear();
    }

    fn op(&mut self, op: u8) {
        self.put(&[op]);
    }

    /// Write a string or global through the memo: counted in the first pass; in the second, fetched
    /// if it was written before, else written by `write` and stored if it occurs again.
    fn shared(&mut self, key: Shared<'v>, write: impl FnOnce(&mut Self)) {
        if let Memo::Counting(counts) = &mut self.memo {
            *counts.entry(key).or_insert(0) += 1;
        } else if !self.recall(key) {
            write(self);
            self.remember(key);
        }
    }

    /// Fetch `key` from the memo if it was written before. Returns true when it was.
    fn recall(&mut self, key: Shared<'v>) -> bool {
        let Memo::Writing { memo, .. } = &self.memo else {
            return false;
        };
        let Some(&Some(index)) = memo.get(&key) else {
            return false;
        };
        match u8::try_from(index) {
            Ok(i) => self.put(&[op::BINGET, i]),
            Err(_) => {
                self.op(op::LONG_BINGET);
                self.put(&index.to_le_bytes());
            }
        }
        true
    }

    /// Store what was just written under `key`, if it occurs again later.
    fn remember(&mut self, key: Shared<'v>) {
        let Memo::Writing { memo, next } = &mut self.memo else {
            return;
        };
        let index = *next;
        let Some(slot @ None) = memo.get_mut(&key) else {
            return;
        };
        // Past u32::MAX entries the value is simply written again.
        let Some(after) = index.checked_add(1) else {
            return;
        };
        *slot = Some(index);
        *next = after;
        match self.protocol {
            // MEMOIZE stores at `len(memo)`, which is `index` because every entry is added here.
            Protocol::V4 => self.op(op::MEMOIZE),
            Protocol::V2 => match u8::try_from(index) {
                Ok(i) => self.put(&[op::BINPUT, i]),
                Err(_) => {
                    self.op(op::LONG_BINPUT);
                    self.put(&index.to_le_bytes());
                }
            },
        }
    }

    /// A whole [`Value`] tree.
    pub fn value(&mut self, value: &'v Value) {
        match value {
            Value::None => self.none(),
            Value::Bool(b) => self.bool(*b),
            Value::Int(i) => self.int(*i),
            Value::BigInt(b) => self.long(b),
            Value::Float(f) => self.float(*f),
            Value::Str(s) => self.str(s),
            Value::SurrogateStr(b) => self.raw_text(b),
            Value::Bytes(b) => self.bytes(b),
            Value::Tuple(items) => {
                self.tuple(items.len(), |w| items.iter().for_each(|v| w.value(v)))
            }
            Value::List(items) => self.list(items, |w, v| w.value(v)),
            Value::Dict(items) => self.dict(items, |w, (k, v)| {
                w.value(k);
                w.value(v);
            }),
            Value::Set(items) => self.set(items, |w, v| w.value(v)),
            Value::Global(g) => self.global(&g.module, &g.name),
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
                self.tuple(args.len(), |w| args.iter().for_each(|v| w.value(v)));
                self.call(*new_obj);
                // CPython's `save_reduce` order: list items, dict items, then state.
                self.appends(list_items, |w, v| w.value(v));
                self.setitems(dict_items, |w, (k, v)| {
                    w.value(k);
                    w.value(v);
                });
                if let Some(state) = state {
                    self.build(|w| w.value(state));
                }
            }
            Value::PersistentId(pid) => {
                self.value(pid);
                self.op(op::BINPERSID);
            }
        }
    }

    pub fn none(&mut self) {
        self.op(op::NONE);
    }

    pub fn bool(&mut self, b: bool) {
        self.op(if b { op::NEWTRUE } else { op::NEWFALSE });
    }

    /// The smallest integer opcode, as CPython's `save_long` picks it.
    pub fn int(&mut self, i: i64) {
        if let Ok(b) = u8::try_from(i) {
            self.put(&[op::BININT1, b]);
        } else if let Ok(b) = u16::try_from(i) {
            self.op(op::BININT2);
            self.put(&b.to_le_bytes());
        } else if let Ok(b) = i32::try_from(i) {
            self.op(op::BININT);
            self.put(&b.to_le_bytes());
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
            self.put(&[op::LONG1, n as u8]);
            self.put(&bytes[..n]);
        }
    }

    /// An int of any size from its little-endian two's complement bytes: `LONG1` up to 255
    /// bytes (all torch's weights-only unpickler reads), `LONG4` beyond.
    pub fn long(&mut self, bytes: &[u8]) {
        match u8::try_from(bytes.len()) {
            Ok(n) => self.put(&[op::LONG1, n]),
            Err(_) => {
                self.op(op::LONG4);
                self.put(&(bytes.len() as u32).to_le_bytes());
            }
        }
        self.put(bytes);
    }

    pub fn float(&mut self, f: f64) {
        self.op(op::BINFLOAT);
        self.put(&f.to_be_bytes());
    }

    /// A string, through the memo.
    pub fn str(&mut self, s: &'v str) {
        self.shared(Shared::Str(s), |w| w.raw_str(s));
    }

    fn raw_str(&mut self, s: &str) {
        self.raw_text(s.as_bytes());
    }

    /// A str from the bytes Python's pickle would write for it (UTF-8, `surrogatepass`).
    fn raw_text(&mut self, b: &[u8]) {
        match (self.protocol, u8::try_from(b.len()), u32::try_from(b.len())) {
            (Protocol::V4, Ok(n), _) => self.put(&[op::SHORT_BINUNICODE, n]),
            (_, _, Ok(n)) => {
                self.op(op::BINUNICODE);
                self.put(&n.to_le_bytes());
            }
            _ => {
                self.op(op::BINUNICODE8);
                self.put(&(b.len() as u64).to_le_bytes());
            }
        }
        self.put(b);
    }

    pub fn bytes(&mut self, b: &[u8]) {
        match (u8::try_from(b.len()), u32::try_from(b.len())) {
            (Ok(n), _) => self.put(&[op::SHORT_BINBYTES, n]),
            (_, Ok(n)) => {
                self.op(op::BINBYTES);
                self.put(&n.to_le_bytes());
            }
            _ => {
                self.op(op::BINBYTES8);
                self.put(&(b.len() as u64).to_le_bytes());
            }
        }
        self.put(b);
    }

    /// A module attribute `module.name`, through the memo.
    pub fn global(&mut self, module: &'v str, name: &'v str) {
        self.shared(Shared::Global(module, name), |w| {
            let textual = !module.contains('\n') && !name.contains('\n');
            if w.protocol == Protocol::V2 && textual {
                w.op(op::GLOBAL);
                w.put(module.as_bytes());
                w.put(b"\n");
                w.put(name.as_bytes());
                w.put(b"\n");
            } else {
                w.raw_str(module);
                w.raw_str(name);
                w.op(op::STACK_GLOBAL);
            }
        });
    }

    /// A tuple of the `len` items `items` writes.
    pub fn tuple(&mut self, len: usize, items: impl FnOnce(&mut Self)) {
        let close = match len {
            0 => op::EMPTY_TUPLE,
            1 => op::TUPLE1,
            2 => op::TUPLE2,
            3 => op::TUPLE3,
            _ => {
                self.op(op::MARK);
                op::TUPLE
            }
        };
        items(self);
        self.op(close);
    }

    /// A list of `items`, each written by `each`.
    pub fn list<I: IntoIterator>(&mut self, items: I, each: impl FnMut(&mut Self, I::Item)) {
        self.op(op::EMPTY_LIST);
        self.appends(items, each);
    }

    /// A dict of `items`, `each` writing one key and its value.
    pub fn dict<I: IntoIterator>(&mut self, items: I, each: impl FnMut(&mut Self, I::Item)) {
        self.op(op::EMPTY_DICT);
        self.setitems(items, each);
    }

    /// A dict of a few fixed fields (a dataclass's state), `pairs` writing each key and value:
    /// fewer than [`BATCH`], so one `SETITEMS`.
    pub fn fields(&mut self, pairs: impl FnOnce(&mut Self)) {
        self.op(op::EMPTY_DICT);
        self.op(op::MARK);
        pairs(self);
        self.op(op::SETITEMS);
    }

    /// A set of `items`, each written by `each`.
    pub fn set<I: IntoIterator>(&mut self, items: I, each: impl FnMut(&mut Self, I::Item)) {
        self.op(op::EMPTY_SET);
        self.batched(items, op::ADDITEMS, each);
    }

    /// Call the callable under the argument tuple on the stack: `callable(*args)` (`REDUCE`), or
    /// `callable.__new__(callable, *args)` (`NEWOBJ`) when `new_obj`.
    pub fn call(&mut self, new_obj: bool) {
        self.op(if new_obj { op::NEWOBJ } else { op::REDUCE });
    }

    /// `items`, each written by `each`, appended to the list (or object) on top of the stack.
    pub fn appends<I: IntoIterator>(&mut self, items: I, each: impl FnMut(&mut Self, I::Item)) {
        self.batched(items, op::APPENDS, each);
    }

    /// Key-value pairs, `each` writing one key and its value, set into the dict (or object) on top
    /// of the stack.
    pub fn setitems<I: IntoIterator>(&mut self, items: I, each: impl FnMut(&mut Self, I::Item)) {
        self.batched(items, op::SETITEMS, each);
    }

    /// `MARK`, at most [`BATCH`] items, then `close` (`APPENDS`, `SETITEMS`, `ADDITEMS`), as often as
    /// needed: CPython's batching, so that no reader's stack ever holds more than one batch of a
    /// container, however large it is.
    fn batched<I: IntoIterator>(
        &mut self,
        items: I,
        close: u8,
        mut each: impl FnMut(&mut Self, I::Item),
    ) {
        let mut in_batch = 0;
        for item in items {
            if in_batch == 0 {
                if self.stopped() {
                    break;
                }
                self.op(op::MARK);
            }
            each(self, item);
            in_batch += 1;
            if in_batch == BATCH {
                self.op(close);
                in_batch = 0;
            }
        }
        if in_batch > 0 {
            self.op(close);
        }
    }

    /// Whether the writing is over: the sink failed or `stop` was set. What is written after
    /// that is never read, so the rest of a container need not be walked.
    fn stopped(&mut self) -> bool {
        if self.error.is_none() && self.stop.load(Ordering::Relaxed) {
            self.error = Some(std::io::Error::other("interrupted"));
        }
        self.error.is_some()
    }

    /// The state `state` writes, given to the object on top of the stack (`BUILD`).
    pub fn build(&mut self, state: impl FnOnce(&mut Self)) {
        state(self);
        self.op(op::BUILD);
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
    fn large_containers_are_written_in_batches_of_a_thousand() {
        let n = 2 * BATCH + 500;
        let nones = write(&Value::List(vec![Value::None; n]), Protocol::V4);
        let body = &nones[11..nones.len() - 1];
        let mut want = vec![b']'];
        for batch in [BATCH, BATCH, 500] {
            want.push(b'(');
            want.extend(std::iter::repeat_n(b'N', batch));
            want.push(b'e');
        }
        assert_eq!(body, &want[..]);

        let list = Value::List((0..n as i64).map(Value::Int).collect());
        let dict = Value::Dict(
            (0..n as i64)
                .map(|i| (Value::Int(i), Value::None))
                .collect(),
        );
        // A reader whose stack holds one batch (two values per dict item) reads them whole.
        let one_batch = Limits {
            max_stack: 2 * BATCH + 8,
            ..Limits::default()
        };
        for v in [&list, &dict] {
            assert_eq!(
                &read(&write(v, Protocol::V4), &AnyGlobal, one_batch).unwrap(),
                v
            );
        }
    }

    #[test]
    fn streamed_output_equals_the_in_memory_one() {
        // Over two flush buffers, written after 5 bytes already in the sink: the frame length is
        // patched at the pickle's own start.
        let big = Value::List(
            (0..300_000)
                .map(|i| Value::Str(format!("item {i}")))
                .collect(),
        );
        for protocol in [Protocol::V2, Protocol::V4] {
            let whole = write(&big, protocol);
            assert!(whole.len() > 2 * FLUSH_BYTES);
            let mut sink = std::io::Cursor::new(b"head:".to_vec());
            sink.set_position(5);
            let len = write_to(&mut sink, protocol, &AtomicBool::new(false), |w| {
                w.value(&big)
            })
            .unwrap();
            assert_eq!(len, whole.len() as u64);
            assert_eq!(sink.position(), 5 + len);
            assert_eq!(&sink.get_ref()[..5], b"head:");
            assert!(sink.get_ref()[5..] == whole[..], "{protocol:?}");
        }
    }

    #[test]
    fn a_stop_ends_the_walk_within_a_batch() {
        // Set while the first pass walks a list of ten million items: the rest is never walked.
        let stop = AtomicBool::new(false);
        let pulled = std::sync::atomic::AtomicUsize::new(0);
        let mut sink = std::io::Cursor::new(Vec::new());
        let result = write_to(&mut sink, Protocol::V4, &stop, |w| {
            let items = (0..10_000_000u64).inspect(|&i| {
                pulled.fetch_add(1, Ordering::Relaxed);
                if i == 5_000 {
                    stop.store(true, Ordering::Relaxed);
                }
            });
            w.list(items, |w, i| w.int(i as i64));
        });
        let e = result.unwrap_err();
        assert_eq!(e.to_string(), "interrupted");
        assert!(pulled.load(Ordering::Relaxed) <= 5_000 + BATCH + 1);
        assert!(sink.get_ref().is_empty(), "the first pass wrote");
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
