//! Pickle writer: a [`Value`] tree to bytes Python's `pickle.load` reads back.
//!
//! The output mirrors what CPython's pickler writes for the same objects, without a memo (every
//! shared value is written again, which only costs bytes):
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
use super::Value;

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
    Writer {
        out: &mut body,
        protocol,
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

struct Writer<'a> {
    out: &'a mut Vec<u8>,
    protocol: Protocol,
}

impl Writer<'_> {
    fn op(&mut self, op: u8) {
        self.out.push(op);
    }

    fn value(&mut self, value: &Value) {
        match value {
            Value::None => self.op(b'N'),
            Value::Bool(true) => self.op(0x88),
            Value::Bool(false) => self.op(0x89),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.op(b'G');
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.str(s),
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
            Value::Global { module, name } => self.global(module, name),
            Value::Object {
                callable,
                args,
                new_obj,
                dict_items,
                list_items,
                state,
            } => {
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

    fn tuple(&mut self, items: &[Value]) {
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
    fn appends(&mut self, items: &[Value]) {
        if items.is_empty() {
            return;
        }
        self.op(b'(');
        items.iter().for_each(|v| self.value(v));
        self.op(b'e');
    }

    /// Pairs into the dict (or object) on top of the stack.
    fn setitems(&mut self, items: &[(Value, Value)]) {
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
