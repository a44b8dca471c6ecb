//! The pickle opcodes ckpt reads, scans, checks and writes, each named once, with how its argument
//! is laid out in the stream.
//!
//! Four places speak opcodes: the reader (`read.rs`), the pass that finds fetched memo entries
//! (`scan.rs`), the check for what torch's weights-only unpickler refuses
//! (`formats/torch_save/weights_only.rs`) and the writer (`write.rs`); the torch.save and DCP
//! probes also tell a pickle by its first byte, `PROTO`. With one table they cannot disagree on a
//! byte, and the two passes that only step over opcodes take each argument's length from
//! [`argument`] rather than each keeping its own count.
//!
//! Names, bytes and argument layouts are CPython's: `Lib/pickle.py` defines the bytes, and
//! `Lib/pickletools.py` (its `opcodes` list, with an `ArgumentDescriptor` per argument) the
//! layouts. Only the opcodes ckpt uses are here; `EXT1`, `INST`, `OBJ`, the out-of-band buffers and
//! the rest are unknown bytes to every pass.

// The stream itself.
pub(crate) const PROTO: u8 = 0x80;
pub(crate) const FRAME: u8 = 0x95;
pub(crate) const STOP: u8 = b'.';

// The stack and the memo.
pub(crate) const MARK: u8 = b'(';
pub(crate) const POP: u8 = b'0';
pub(crate) const POP_MARK: u8 = b'1';
pub(crate) const DUP: u8 = b'2';
pub(crate) const PUT: u8 = b'p';
pub(crate) const BINPUT: u8 = b'q';
pub(crate) const LONG_BINPUT: u8 = b'r';
pub(crate) const MEMOIZE: u8 = 0x94;
pub(crate) const GET: u8 = b'g';
pub(crate) const BINGET: u8 = b'h';
pub(crate) const LONG_BINGET: u8 = b'j';

// None, bools and numbers.
pub(crate) const NONE: u8 = b'N';
pub(crate) const NEWTRUE: u8 = 0x88;
pub(crate) const NEWFALSE: u8 = 0x89;
pub(crate) const INT: u8 = b'I';
pub(crate) const BININT: u8 = b'J';
pub(crate) const BININT1: u8 = b'K';
pub(crate) const BININT2: u8 = b'M';
pub(crate) const LONG: u8 = b'L';
pub(crate) const LONG1: u8 = 0x8a;
pub(crate) const LONG4: u8 = 0x8b;
pub(crate) const FLOAT: u8 = b'F';
pub(crate) const BINFLOAT: u8 = b'G';

// Strings and bytes.
pub(crate) const STRING: u8 = b'S';
pub(crate) const BINSTRING: u8 = b'T';
pub(crate) const SHORT_BINSTRING: u8 = b'U';
pub(crate) const UNICODE: u8 = b'V';
pub(crate) const BINUNICODE: u8 = b'X';
pub(crate) const SHORT_BINUNICODE: u8 = 0x8c;
pub(crate) const BINUNICODE8: u8 = 0x8d;
pub(crate) const BINBYTES: u8 = b'B';
pub(crate) const SHORT_BINBYTES: u8 = b'C';
pub(crate) const BINBYTES8: u8 = 0x8e;
pub(crate) const BYTEARRAY8: u8 = 0x96;

// Containers. `TUPLE1` to `TUPLE3` are consecutive bytes.
pub(crate) const EMPTY_TUPLE: u8 = b')';
pub(crate) const TUPLE: u8 = b't';
pub(crate) const TUPLE1: u8 = 0x85;
pub(crate) const TUPLE2: u8 = 0x86;
pub(crate) const TUPLE3: u8 = 0x87;
pub(crate) const EMPTY_LIST: u8 = b']';
pub(crate) const LIST: u8 = b'l';
pub(crate) const APPEND: u8 = b'a';
pub(crate) const APPENDS: u8 = b'e';
pub(crate) const EMPTY_DICT: u8 = b'}';
pub(crate) const DICT: u8 = b'd';
pub(crate) const SETITEM: u8 = b's';
pub(crate) const SETITEMS: u8 = b'u';
pub(crate) const EMPTY_SET: u8 = 0x8f;
pub(crate) const ADDITEMS: u8 = 0x90;
pub(crate) const FROZENSET: u8 = 0x91;

// Globals, calls and persistent ids.
pub(crate) const GLOBAL: u8 = b'c';
pub(crate) const STACK_GLOBAL: u8 = 0x93;
pub(crate) const REDUCE: u8 = b'R';
pub(crate) const NEWOBJ: u8 = 0x81;
pub(crate) const NEWOBJ_EX: u8 = 0x92;
pub(crate) const BUILD: u8 = b'b';
pub(crate) const PERSID: u8 = b'P';
pub(crate) const BINPERSID: u8 = b'Q';

/// How the argument that follows an opcode is laid out.
#[derive(Clone, Copy)]
enum Layout {
    /// Exactly this many bytes: none, or an int, float or memo index of fixed width.
    Fixed(usize),
    /// An unsigned little-endian length of this many bytes, then that many bytes (pickletools'
    /// `TAKEN_FROM_ARGUMENT1`, `4`, `4U` and `8U`). `BINSTRING` and `LONG4` count with a signed
    /// length; read unsigned, a negative one (which the reader refuses) runs past the end.
    Counted(usize),
    /// This many lines, each ending in `\n` (pickletools' `UP_TO_NEWLINE`): protocol 0's text.
    Lines(usize),
}

/// Every byte's [`layout`], computed at compile time. The scan steps over every opcode of a
/// `.metadata` of millions of pieces: on a consolidate of 262,144 pieces, callgrind counted 800M
/// instructions in it with the `match` run per opcode, 485M with this table.
const LAYOUTS: [Option<Layout>; 256] = {
    let mut table = [None; 256];
    let mut byte = 0;
    while byte < table.len() {
        table[byte] = layout(byte as u8);
        byte += 1;
    }
    table
};

/// The layout of `opcode`'s argument, or `None` for a byte this table does not name.
const fn layout(opcode: u8) -> Option<Layout> {
    Some(match opcode {
        STOP | MARK | POP | POP_MARK | DUP | MEMOIZE | NONE | NEWTRUE | NEWFALSE | EMPTY_TUPLE
        | TUPLE | TUPLE1 | TUPLE2 | TUPLE3 | EMPTY_LIST | LIST | APPEND | APPENDS | EMPTY_DICT
        | DICT | SETITEM | SETITEMS | EMPTY_SET | ADDITEMS | FROZENSET | STACK_GLOBAL | REDUCE
        | NEWOBJ | NEWOBJ_EX | BUILD | BINPERSID => Layout::Fixed(0),
        PROTO | BININT1 | BINPUT | BINGET => Layout::Fixed(1),
        BININT2 => Layout::Fixed(2),
        BININT | LONG_BINPUT | LONG_BINGET => Layout::Fixed(4),
        FRAME | BINFLOAT => Layout::Fixed(8),
        SHORT_BINSTRING | SHORT_BINUNICODE | SHORT_BINBYTES | LONG1 => Layout::Counted(1),
        BINSTRING | BINUNICODE | BINBYTES | LONG4 => Layout::Counted(4),
        BINUNICODE8 | BINBYTES8 | BYTEARRAY8 => Layout::Counted(8),
        PUT | GET | INT | LONG | FLOAT | STRING | UNICODE | PERSID => Layout::Lines(1),
        GLOBAL => Layout::Lines(2),
        _ => return None,
    })
}

/// The argument of the opcode at `at`: every byte between it and the next opcode, length prefix
/// and line ends included (so the next opcode is at `at + 1 + len`). `None` when the byte at `at`
/// is not in this table or the argument runs past the end of `bytes`.
#[inline]
pub(crate) fn argument(bytes: &[u8], at: usize) -> Option<&[u8]> {
    let rest = bytes.get(at.checked_add(1)?..)?;
    let len = match LAYOUTS[usize::from(*bytes.get(at)?)]? {
        Layout::Fixed(len) => len,
        Layout::Counted(width) => {
            let count = usize::try_from(uint(rest.get(..width)?)).ok()?;
            width.checked_add(count)?
        }
        Layout::Lines(lines) => {
            let mut len = 0;
            for _ in 0..lines {
                len += rest.get(len..)?.iter().position(|&b| b == b'\n')? + 1;
            }
            len
        }
    };
    rest.get(..len)
}

/// An unsigned little-endian int of up to 8 bytes: a length prefix, or a memo index.
pub(crate) fn uint(le: &[u8]) -> u64 {
    le.iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pickle::{write, Object, Protocol, Value};

    #[test]
    fn arguments_follow_their_layout() {
        let cases: &[(&[u8], Option<&[u8]>)] = &[
            (&[NONE, BINGET], Some(b"")),
            (&[BININT2, 1, 2, 3], Some(&[1, 2])),
            (
                &[SHORT_BINUNICODE, 2, b'a', b'b', STOP],
                Some(&[2, b'a', b'b']),
            ),
            (&[BINBYTES, 1, 0, 0, 0, b'x'], Some(&[1, 0, 0, 0, b'x'])),
            (b"p12\n.", Some(b"12\n")),
            (b"cmod\nname\n.", Some(b"mod\nname\n")),
            // Past the end: a fixed width, a length prefix, a length, a line.
            (&[BININT, 1, 2], None),
            (&[BINUNICODE, 1, 0], None),
            (&[SHORT_BINBYTES, 3, b'x'], None),
            (b"cmod\nname", None),
            // Not in the table: `OBJ`, `EXT1`.
            (b"o", None),
            (&[0x82, 1], None),
        ];
        for &(bytes, want) in cases {
            assert_eq!(argument(bytes, 0), want, "{bytes:?}");
        }
        assert_eq!(argument(&[NONE], 1), None, "at the end");
    }

    #[test]
    fn the_writers_pickles_step_opcode_by_opcode_to_their_stop() {
        let object = Value::Object(Box::new(Object {
            callable: Value::global("collections", "OrderedDict"),
            args: vec![Value::Tuple(vec![]), Value::Tuple(vec![Value::None; 5])],
            new_obj: true,
            dict_items: vec![(Value::Str("k".repeat(300)), Value::Float(1.5))],
            list_items: vec![Value::Bytes(vec![b'\n'; 300]), Value::BigInt(vec![1; 300])],
            state: Some(Value::Set(vec![Value::Int(-1), Value::Int(1 << 40)])),
        }));
        let value = Value::List(vec![
            object.clone(),
            object,
            Value::PersistentId(Box::new(Value::Str("\n".into()))),
            Value::Dict(vec![(Value::Int(300), Value::Bool(true))]),
        ]);
        for protocol in [Protocol::V2, Protocol::V4] {
            let pickle = write(&value, protocol);
            let mut at = 0;
            while pickle[at] != STOP {
                at += 1 + argument(&pickle, at).unwrap().len();
            }
            assert_eq!(at, pickle.len() - 1, "{protocol:?}");
        }
    }
}
