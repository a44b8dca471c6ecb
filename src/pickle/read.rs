//! Pickle reader: opcodes to a [`Value`] tree, executing nothing.
//!
//! The reader is a small pickle machine that builds nodes in an arena instead of Python objects.
//! The stack and the memo hold node ids, and every mutating opcode (`APPEND`, `SETITEMS`, `BUILD`,
//! ...) changes the node in place. That gives Python's reference semantics: pickles memoize a dict
//! or list while it is still empty and fill it afterwards, and a later `BINGET` must see the filled
//! container. At `STOP` the root node is turned into an owned [`Value`] tree; a node reached twice
//! is copied each time, so copies count against [`Limits::max_nodes`] (measured on the shared
//! graph before anything is copied), and a container that contains itself (a cycle) is rejected.
//!
//! Choices where Python's pickle leaves room:
//! - `BINSTRING` / `SHORT_BINSTRING` (Python 2 `str`) become [`Value::Str`], decoded as UTF-8, which
//!   is what `torch.load` does with its default `encoding="utf-8"`; other bytes are an error there too.
//! - `BYTEARRAY8` becomes [`Value::Bytes`]: the tree does not distinguish mutable bytes.
//! - `GLOBAL` in a protocol 0-2 pickle maps the Python 2 modules `__builtin__` and `copy_reg` to their
//!   Python 3 names before the policy is asked, as Python's `fix_imports` does.
//! - A dict (or set) that receives the same simple key (str, bytes, int, bool, None) twice keeps
//!   the first position and the last value, as Python's dict does; other keys are kept as pickled.
//! - Bytes after `STOP` are ignored, as `pickle.loads` ignores them; nothing torch writes has any,
//!   but a reader that refuses them gains nothing.
//! - `FRAME` only announces how many bytes follow; the reader does not need it and skips it.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use super::{Global, Globals, Object, PickleError, Value};

/// Safety bounds on what one pickle may build.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most values on the stack (and in marks) at once.
    pub max_stack: usize,
    /// Most memo entries.
    pub max_memo: usize,
    /// Most nodes in total, counting those copied by memo gets. A string or bytes value also costs
    /// one node per 64 bytes, so many references to one large string are bounded too.
    pub max_nodes: usize,
    /// Deepest nesting of containers. This also bounds the reader's recursion when it builds the tree.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_stack: 1 << 20,
            max_memo: 1 << 20,
            max_nodes: 1 << 24,
            max_depth: 256,
        }
    }
}

/// Read one pickle (protocols 0-5 opcodes as used by torch and DCP) into a value tree.
pub fn read(bytes: &[u8], globals: &dyn Globals, limits: Limits) -> Result<Value, PickleError> {
    let mut machine = Machine {
        input: Input { bytes, pos: 0 },
        globals,
        limits,
        nodes: Vec::new(),
        origins: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        proto: 0,
    };
    let root = machine.run()?;
    // Only the arena is needed from here; the stack and memo are freed before the tree is built.
    let Machine { nodes, origins, .. } = machine;
    Tree::new(nodes, origins, limits).build(root)
}

// Opcodes, named as in CPython's `pickle.py`.
const MARK: u8 = b'(';
const STOP: u8 = b'.';
const POP: u8 = b'0';
const POP_MARK: u8 = b'1';
const DUP: u8 = b'2';
const INT: u8 = b'I';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const NONE: u8 = b'N';
const BINPERSID: u8 = b'Q';
const REDUCE: u8 = b'R';
const BINSTRING: u8 = b'T';
const SHORT_BINSTRING: u8 = b'U';
const BINUNICODE: u8 = b'X';
const APPEND: u8 = b'a';
const BUILD: u8 = b'b';
const GLOBAL: u8 = b'c';
const DICT: u8 = b'd';
const EMPTY_DICT: u8 = b'}';
const APPENDS: u8 = b'e';
const GET: u8 = b'g';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const LIST: u8 = b'l';
const EMPTY_LIST: u8 = b']';
const PUT: u8 = b'p';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const SETITEM: u8 = b's';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const SETITEMS: u8 = b'u';
const BINFLOAT: u8 = b'G';
const PROTO: u8 = 0x80;
const NEWOBJ: u8 = 0x81;
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const BINBYTES: u8 = b'B';
const SHORT_BINBYTES: u8 = b'C';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE8: u8 = 0x8d;
const BINBYTES8: u8 = 0x8e;
const EMPTY_SET: u8 = 0x8f;
const ADDITEMS: u8 = 0x90;
const FROZENSET: u8 = 0x91;
const NEWOBJ_EX: u8 = 0x92;
const STACK_GLOBAL: u8 = 0x93;
const MEMOIZE: u8 = 0x94;
const FRAME: u8 = 0x95;
const BYTEARRAY8: u8 = 0x96;

/// The highest protocol Python knows; a higher `PROTO` is not a pickle we understand.
const HIGHEST_PROTOCOL: u8 = 5;

type Id = usize;

/// A node under construction. Immutable scalars are finished values; containers refer to other
/// nodes by id so that shared references stay shared until the tree is built.
enum Node {
    Leaf(Value),
    Tuple(Vec<Id>),
    List(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    /// Boxed, as [`Value::Object`] is, so that every other node stays small.
    Object(Box<ObjectNode>),
    PersistentId(Id),
}

/// The fields of a [`super::Object`] under construction, as node ids.
struct ObjectNode {
    callable: Id,
    args: Vec<Id>,
    new_obj: bool,
    dict_items: Vec<(Id, Id)>,
    list_items: Vec<Id>,
    state: Option<Id>,
}

impl Node {
    fn kind(&self) -> &'static str {
        match self {
            Node::Leaf(Value::Global(_)) => "global",
            Node::Leaf(_) => "scalar",
            Node::Tuple(_) => "tuple",
            Node::List(_) => "list",
            Node::Dict(_) => "dict",
            Node::Set(_) => "set",
            Node::Object(_) => "object",
            Node::PersistentId(_) => "persistent id",
        }
    }
}

/// The bytes being read and the read position.
struct Input<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    fn truncated(&self) -> PickleError {
        PickleError::Truncated {
            offset: self.bytes.len(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.truncated())?;
        let slice = self
            .bytes
            .get(self.pos..end)
            .ok_or_else(|| self.truncated())?;
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let slice = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, PickleError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn i32(&mut self) -> Result<i32, PickleError> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A text argument of the protocol 0 opcodes, without its `\n`.
    fn line(&mut self) -> Result<&'a [u8], PickleError> {
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.truncated())?;
        let line = self.take(len)?;
        self.pos += 1;
        Ok(line)
    }

    /// `n` bytes whose length came from the file as a u64.
    fn take_u64(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        let n = usize::try_from(n).map_err(|_| self.truncated())?;
        self.take(n)
    }
}

struct Machine<'a> {
    input: Input<'a>,
    globals: &'a dyn Globals,
    limits: Limits,
    nodes: Vec<Node>,
    /// Byte offset of the opcode that created each node, for errors found when building the tree.
    origins: Vec<usize>,
    stack: Vec<Id>,
    /// Stack lengths at each open `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
    proto: u8,
}

fn malformed(offset: usize, reason: impl Into<String>) -> PickleError {
    PickleError::Malformed {
        offset,
        reason: reason.into(),
    }
}

fn limit(offset: usize, reason: impl Into<String>) -> PickleError {
    PickleError::LimitExceeded {
        offset,
        reason: reason.into(),
    }
}

fn utf8(offset: usize, bytes: &[u8]) -> Result<String, PickleError> {
    std::str::from_utf8(bytes)
        .map(str::to_string)
        .map_err(|_| malformed(offset, "string is not valid UTF-8"))
}

/// A decimal integer as protocol 0 writes it (`I`, `g`, `p` arguments).
fn decimal(offset: usize, line: &[u8]) -> Result<i64, PickleError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| malformed(offset, "integer argument is not a 64-bit decimal"))
}

/// A little-endian two's complement integer of any length (`LONG1`, `LONG4`), if it fits in i64.
fn long(offset: usize, bytes: &[u8]) -> Result<i64, PickleError> {
    let Some(&last) = bytes.last() else {
        return Ok(0);
    };
    let fill = if last & 0x80 != 0 { 0xff } else { 0x00 };
    let mut buf = [fill; 8];
    for (i, &b) in bytes.iter().enumerate() {
        match buf.get_mut(i) {
            Some(slot) => *slot = b,
            // Bytes past the eighth must only repeat the sign, and the eighth must carry it.
            None if b == fill => {}
            None => return Err(malformed(offset, "integer does not fit in 64 bits")),
        }
    }
    let value = i64::from_le_bytes(buf);
    if (value < 0) != (fill == 0xff) {
        return Err(malformed(offset, "integer does not fit in 64 bits"));
    }
    Ok(value)
}

impl Machine<'_> {
    fn run(&mut self) -> Result<Id, PickleError> {
        loop {
            let at = self.input.pos;
            let op = self.input.u8()?;
            match op {
                PROTO => {
                    let proto = self.input.u8()?;
                    if proto > HIGHEST_PROTOCOL {
                        return Err(malformed(at, format!("unknown pickle protocol {proto}")));
                    }
                    self.proto = proto;
                }
                FRAME => {
                    self.input.u64()?;
                }
                STOP => return self.pop(at),
                MARK => {
                    if self.marks.len() >= self.limits.max_stack {
                        return Err(limit(at, "too many open marks"));
                    }
                    self.marks.push(self.stack.len());
                }
                POP => {
                    if self.stack.len() > self.base() {
                        self.stack.pop();
                    } else {
                        self.pop_mark(at)?;
                    }
                }
                POP_MARK => {
                    self.pop_mark(at)?;
                }
                DUP => {
                    let top = self.top(at)?;
                    self.push(at, top)?;
                }
                NONE => self.leaf(at, Value::None)?,
                NEWTRUE => self.leaf(at, Value::Bool(true))?,
                NEWFALSE => self.leaf(at, Value::Bool(false))?,
                INT => {
                    let line = self.input.line()?;
                    // Protocol 0 spells booleans as `I01` / `I00`.
                    let value = match line {
                        b"01" => Value::Bool(true),
                        b"00" => Value::Bool(false),
                        _ => Value::Int(decimal(at, line)?),
                    };
                    self.leaf(at, value)?;
                }
                BININT => {
                    let v = self.input.i32()?;
                    self.leaf(at, Value::Int(v.into()))?;
                }
                BININT1 => {
                    let v = self.input.u8()?;
                    self.leaf(at, Value::Int(v.into()))?;
                }
                BININT2 => {
                    let v = self.input.u16()?;
                    self.leaf(at, Value::Int(v.into()))?;
                }
                LONG1 => {
                    let n = self.input.u8()?;
                    let v = long(at, self.input.take(n.into())?)?;
                    self.leaf(at, Value::Int(v))?;
                }
                LONG4 => {
                    let n = self.input.i32()?;
                    let n = usize::try_from(n)
                        .map_err(|_| malformed(at, "negative length for `LONG4`"))?;
                    let v = long(at, self.input.take(n)?)?;
                    self.leaf(at, Value::Int(v))?;
                }
                BINFLOAT => {
                    let v = f64::from_be_bytes(self.input.array()?);
                    self.leaf(at, Value::Float(v))?;
                }
                BINUNICODE => {
                    let n = self.input.u32()?;
                    let s = utf8(at, self.input.take_u64(n.into())?)?;
                    self.leaf(at, Value::Str(s))?;
                }
                SHORT_BINUNICODE => {
                    let n = self.input.u8()?;
                    let s = utf8(at, self.input.take(n.into())?)?;
                    self.leaf(at, Value::Str(s))?;
                }
                BINUNICODE8 => {
                    let n = self.input.u64()?;
                    let s = utf8(at, self.input.take_u64(n)?)?;
                    self.leaf(at, Value::Str(s))?;
                }
                BINSTRING => {
                    let n = self.input.i32()?;
                    let n = usize::try_from(n)
                        .map_err(|_| malformed(at, "negative length for `BINSTRING`"))?;
                    let s = utf8(at, self.input.take(n)?)?;
                    self.leaf(at, Value::Str(s))?;
                }
                SHORT_BINSTRING => {
                    let n = self.input.u8()?;
                    let s = utf8(at, self.input.take(n.into())?)?;
                    self.leaf(at, Value::Str(s))?;
                }
                BINBYTES => {
                    let n = self.input.u32()?;
                    let b = self.input.take_u64(n.into())?.to_vec();
                    self.leaf(at, Value::Bytes(b))?;
                }
                SHORT_BINBYTES => {
                    let n = self.input.u8()?;
                    let b = self.input.take(n.into())?.to_vec();
                    self.leaf(at, Value::Bytes(b))?;
                }
                BINBYTES8 | BYTEARRAY8 => {
                    let n = self.input.u64()?;
                    let b = self.input.take_u64(n)?.to_vec();
                    self.leaf(at, Value::Bytes(b))?;
                }
                EMPTY_TUPLE => self.node(at, Node::Tuple(Vec::new()))?,
                TUPLE => {
                    let items = self.pop_mark(at)?;
                    self.node(at, Node::Tuple(items))?;
                }
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let n = usize::from(op - TUPLE1) + 1;
                    let start = self
                        .stack
                        .len()
                        .checked_sub(n)
                        .filter(|&s| s >= self.base())
                        .ok_or_else(|| malformed(at, "stack underflow"))?;
                    let items = self.stack.split_off(start);
                    self.node(at, Node::Tuple(items))?;
                }
                EMPTY_LIST => self.node(at, Node::List(Vec::new()))?,
                LIST => {
                    let items = self.pop_mark(at)?;
                    self.node(at, Node::List(items))?;
                }
                APPEND => {
                    let item = self.pop(at)?;
                    self.append(at, vec![item])?;
                }
                APPENDS => {
                    let items = self.pop_mark(at)?;
                    self.append(at, items)?;
                }
                EMPTY_DICT => self.node(at, Node::Dict(Vec::new()))?,
                DICT => {
                    let items = self.pop_mark(at)?;
                    let pairs = pairs(at, items)?;
                    self.node(at, Node::Dict(pairs))?;
                }
                SETITEM => {
                    let value = self.pop(at)?;
                    let key = self.pop(at)?;
                    self.set_items(at, vec![(key, value)])?;
                }
                SETITEMS => {
                    let items = self.pop_mark(at)?;
                    let pairs = pairs(at, items)?;
                    self.set_items(at, pairs)?;
                }
                EMPTY_SET => self.node(at, Node::Set(Vec::new()))?,
                ADDITEMS => {
                    let items = self.pop_mark(at)?;
                    let target = self.top(at)?;
                    match self.nodes.get_mut(target) {
                        Some(Node::Set(set)) => set.extend(items),
                        other => {
                            let kind = other.map_or("nothing", |n| n.kind());
                            return Err(malformed(at, format!("`ADDITEMS` to a {kind}")));
                        }
                    }
                }
                FROZENSET => {
                    let items = self.pop_mark(at)?;
                    self.node(at, Node::Set(items))?;
                }
                GLOBAL => {
                    let module = utf8(at, self.input.line()?)?;
                    let name = utf8(at, self.input.line()?)?;
                    let module = if self.proto < 3 {
                        py3_module(module)
                    } else {
                        module
                    };
                    self.global(at, module, name)?;
                }
                STACK_GLOBAL => {
                    let name = self.pop(at)?;
                    let module = self.pop(at)?;
                    let module = self.string(at, module, "module")?;
                    let name = self.string(at, name, "name")?;
                    self.global(at, module, name)?;
                }
                REDUCE => {
                    let args = self.pop(at)?;
                    let callable = self.pop(at)?;
                    let args = self.tuple(at, args, "REDUCE")?;
                    self.object(at, callable, args, false)?;
                }
                NEWOBJ => {
                    let args = self.pop(at)?;
                    let cls = self.pop(at)?;
                    let args = self.tuple(at, args, "NEWOBJ")?;
                    self.object(at, cls, args, true)?;
                }
                NEWOBJ_EX => {
                    let kwargs = self.pop(at)?;
                    let args = self.pop(at)?;
                    let cls = self.pop(at)?;
                    let args = self.tuple(at, args, "NEWOBJ_EX")?;
                    // The tree has nowhere to keep keyword arguments; Python only writes
                    // `NEWOBJ_EX` with empty ones for classes whose `__getnewargs_ex__` has none.
                    match self.nodes.get(kwargs) {
                        Some(Node::Dict(items)) if items.is_empty() => {}
                        _ => {
                            return Err(PickleError::UnsupportedOpcode {
                                opcode: op,
                                offset: at,
                            })
                        }
                    }
                    self.object(at, cls, args, true)?;
                }
                BUILD => {
                    let state = self.pop(at)?;
                    let target = self.top(at)?;
                    match self.nodes.get_mut(target) {
                        Some(Node::Object(object)) => object.state = Some(state),
                        other => {
                            let kind = other.map_or("nothing", |n| n.kind());
                            return Err(malformed(at, format!("`BUILD` on a {kind}")));
                        }
                    }
                }
                BINPERSID => {
                    let pid = self.pop(at)?;
                    self.node(at, Node::PersistentId(pid))?;
                }
                PUT => {
                    let index = decimal(at, self.input.line()?)?;
                    let index =
                        u64::try_from(index).map_err(|_| malformed(at, "negative memo index"))?;
                    self.memo_put(at, index)?;
                }
                BINPUT => {
                    let index = self.input.u8()?;
                    self.memo_put(at, index.into())?;
                }
                LONG_BINPUT => {
                    let index = self.input.u32()?;
                    self.memo_put(at, index.into())?;
                }
                MEMOIZE => {
                    let index = self.memo.len() as u64;
                    self.memo_put(at, index)?;
                }
                GET => {
                    let index = decimal(at, self.input.line()?)?;
                    let index =
                        u64::try_from(index).map_err(|_| malformed(at, "negative memo index"))?;
                    self.memo_get(at, index)?;
                }
                BINGET => {
                    let index = self.input.u8()?;
                    self.memo_get(at, index.into())?;
                }
                LONG_BINGET => {
                    let index = self.input.u32()?;
                    self.memo_get(at, index.into())?;
                }
                _ => {
                    return Err(PickleError::UnsupportedOpcode {
                        opcode: op,
                        offset: at,
                    })
                }
            }
        }
    }

    /// Stack length at the innermost open mark: nothing below it may be popped without `POP_MARK`.
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn push(&mut self, at: usize, id: Id) -> Result<(), PickleError> {
        if self.stack.len() >= self.limits.max_stack {
            return Err(limit(
                at,
                format!("more than {} values on the stack", self.limits.max_stack),
            ));
        }
        self.stack.push(id);
        Ok(())
    }

    fn pop(&mut self, at: usize) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(malformed(at, "stack underflow"));
        }
        self.stack
            .pop()
            .ok_or_else(|| malformed(at, "stack underflow"))
    }

    fn top(&self, at: usize) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(malformed(at, "stack underflow"));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| malformed(at, "stack underflow"))
    }

    fn pop_mark(&mut self, at: usize) -> Result<Vec<Id>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| malformed(at, "no open `MARK`"))?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    /// Add a node to the arena and push it.
    fn node(&mut self, at: usize, node: Node) -> Result<(), PickleError> {
        if self.nodes.len() >= self.limits.max_nodes {
            return Err(limit(
                at,
                format!("more than {} nodes", self.limits.max_nodes),
            ));
        }
        let id = self.nodes.len();
        self.nodes.push(node);
        self.origins.push(at);
        self.push(at, id)
    }

    fn leaf(&mut self, at: usize, value: Value) -> Result<(), PickleError> {
        self.node(at, Node::Leaf(value))
    }

    fn global(&mut self, at: usize, module: String, name: String) -> Result<(), PickleError> {
        if !self.globals.allows(&module, &name) {
            return Err(PickleError::ForbiddenGlobal { module, name });
        }
        self.leaf(at, Value::Global(Box::new(Global { module, name })))
    }

    fn object(
        &mut self,
        at: usize,
        callable: Id,
        args: Vec<Id>,
        new_obj: bool,
    ) -> Result<(), PickleError> {
        let node = Node::Object(Box::new(ObjectNode {
            callable,
            args,
            new_obj,
            dict_items: Vec::new(),
            list_items: Vec::new(),
            state: None,
        }));
        self.node(at, node)
    }

    fn string(&self, at: usize, id: Id, what: &str) -> Result<String, PickleError> {
        match self.nodes.get(id) {
            Some(Node::Leaf(Value::Str(s))) => Ok(s.clone()),
            _ => Err(malformed(
                at,
                format!("`STACK_GLOBAL` {what} is not a string"),
            )),
        }
    }

    fn tuple(&self, at: usize, id: Id, opcode: &str) -> Result<Vec<Id>, PickleError> {
        match self.nodes.get(id) {
            Some(Node::Tuple(items)) => Ok(items.clone()),
            other => {
                let kind = other.map_or("nothing", |n| n.kind());
                Err(malformed(
                    at,
                    format!("`{opcode}` arguments are a {kind}, not a tuple"),
                ))
            }
        }
    }

    fn append(&mut self, at: usize, items: Vec<Id>) -> Result<(), PickleError> {
        let target = self.top(at)?;
        let list = match self.nodes.get_mut(target) {
            Some(Node::List(list)) => list,
            Some(Node::Object(object)) => &mut object.list_items,
            other => {
                let kind = other.map_or("nothing", |n| n.kind());
                return Err(malformed(at, format!("`APPEND` to a {kind}")));
            }
        };
        list.extend(items);
        Ok(())
    }

    fn set_items(&mut self, at: usize, pairs: Vec<(Id, Id)>) -> Result<(), PickleError> {
        let target = self.top(at)?;
        let dict = match self.nodes.get_mut(target) {
            Some(Node::Dict(dict)) => dict,
            Some(Node::Object(object)) => &mut object.dict_items,
            other => {
                let kind = other.map_or("nothing", |n| n.kind());
                return Err(malformed(at, format!("`SETITEM` on a {kind}")));
            }
        };
        dict.extend(pairs);
        Ok(())
    }

    fn memo_put(&mut self, at: usize, index: u64) -> Result<(), PickleError> {
        let top = self.top(at)?;
        if !self.memo.contains_key(&index) && self.memo.len() >= self.limits.max_memo {
            return Err(limit(
                at,
                format!("more than {} memo entries", self.limits.max_memo),
            ));
        }
        self.memo.insert(index, top);
        Ok(())
    }

    fn memo_get(&mut self, at: usize, index: u64) -> Result<(), PickleError> {
        let id = *self
            .memo
            .get(&index)
            .ok_or_else(|| malformed(at, format!("memo entry {index} was never stored")))?;
        self.push(at, id)
    }
}

/// Pair up `key, value, key, value, ...` as `DICT` and `SETITEMS` lay them out.
fn pairs(at: usize, items: Vec<Id>) -> Result<Vec<(Id, Id)>, PickleError> {
    if items.len() % 2 != 0 {
        return Err(malformed(at, "odd number of items for a dict"));
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// Python 2 module names that Python 3's unpickler renames under `fix_imports`.
fn py3_module(module: String) -> String {
    match module.as_str() {
        "__builtin__" => "builtins".to_string(),
        "copy_reg" => "copyreg".to_string(),
        _ => module,
    }
}

/// Turns the arena into an owned tree.
///
/// A first pass measures every node once (memoized): the size of its subtree with shared nodes
/// counted at each place they appear, and its height. Only when the whole tree is within
/// [`Limits`] and acyclic is it built, so a pickle that would expand to billions of nodes is
/// refused after work proportional to its own length, and the build itself cannot fail.
///
/// The build moves each node out of the arena as it converts it, so the arena's strings and id
/// lists are freed while the tree grows instead of both being alive at the end. A node referenced
/// more than once (a memoized string or global) is converted once and cloned for its other
/// references, the last of which takes the kept copy.
struct Tree {
    nodes: Vec<Node>,
    origins: Vec<usize>,
    /// Nodes on the path from the root to the node being measured: reaching one again is a cycle.
    on_path: Vec<bool>,
    /// `(size, height)` of each node measured so far.
    measured: Vec<Option<(usize, usize)>>,
    /// How many times each node is referenced from the nodes reachable from the root; during the
    /// build, how many of those references are still to be built.
    refs: Vec<usize>,
    /// Converted copies of nodes referenced more than once, kept until their last reference.
    shared: HashMap<Id, Value>,
    limits: Limits,
}

impl Tree {
    fn new(nodes: Vec<Node>, origins: Vec<usize>, limits: Limits) -> Self {
        let n = nodes.len();
        Tree {
            nodes,
            origins,
            on_path: vec![false; n],
            measured: vec![None; n],
            refs: vec![0; n],
            shared: HashMap::new(),
            limits,
        }
    }

    fn build(mut self, root: Id) -> Result<Value, PickleError> {
        let (size, _) = self.measure(root, 0)?;
        if size > self.limits.max_nodes {
            return Err(limit(
                self.origin(root),
                format!(
                    "the pickle expands to more than {} nodes once shared references are copied",
                    self.limits.max_nodes
                ),
            ));
        }
        // The measuring state is not needed to build; free it first.
        self.on_path = Vec::new();
        self.measured = Vec::new();
        self.value(root)
    }

    fn origin(&self, id: Id) -> usize {
        self.origins.get(id).copied().unwrap_or(0)
    }

    fn node(&self, id: Id) -> Result<&Node, PickleError> {
        self.nodes
            .get(id)
            .ok_or_else(|| malformed(self.origin(id), "dangling node"))
    }

    /// Size and height of the subtree at `id`, which sits at nesting `depth`.
    fn measure(&mut self, id: Id, depth: usize) -> Result<(usize, usize), PickleError> {
        let at = self.origin(id);
        let max_depth = self.limits.max_depth;
        let too_deep = || limit(at, format!("containers nested deeper than {max_depth}"));
        if let Some((size, height)) = self.measured.get(id).copied().flatten() {
            if depth.saturating_add(height) > max_depth {
                return Err(too_deep());
            }
            return Ok((size, height));
        }
        let node = self.node(id)?;
        let own = match node {
            Node::Leaf(Value::Str(s)) => 1 + s.len() / 64,
            Node::Leaf(Value::Bytes(b)) => 1 + b.len() / 64,
            _ => 1,
        };
        let is_leaf = matches!(node, Node::Leaf(_));
        let children = children(node);
        if children.is_empty() && is_leaf {
            return Ok((own, 0));
        }
        if self.on_path.get(id).copied().unwrap_or(false) {
            return Err(malformed(at, "a container contains itself"));
        }
        if depth >= max_depth {
            return Err(too_deep());
        }
        if let Some(flag) = self.on_path.get_mut(id) {
            *flag = true;
        }
        let (mut size, mut height) = (own, 1);
        for child in children {
            // Each container is expanded once, so this counts each reference once.
            if let Some(refs) = self.refs.get_mut(child) {
                *refs += 1;
            }
            let (s, h) = self.measure(child, depth + 1)?;
            size = size.saturating_add(s);
            height = height.max(h + 1);
        }
        if let Some(flag) = self.on_path.get_mut(id) {
            *flag = false;
        }
        if let Some(slot) = self.measured.get_mut(id) {
            *slot = Some((size, height));
        }
        Ok((size, height))
    }

    /// Build the measured subtree at `id`: acyclic and within the limits, so recursion is bounded.
    fn value(&mut self, id: Id) -> Result<Value, PickleError> {
        let refs = self.refs.get(id).copied().unwrap_or(0);
        if refs > 1 {
            // Not the last reference: keep a copy for the ones still to come.
            if let Some(r) = self.refs.get_mut(id) {
                *r -= 1;
            }
            if let Some(v) = self.shared.get(&id) {
                return Ok(v.clone());
            }
            let v = self.take(id)?;
            self.shared.insert(id, v.clone());
            return Ok(v);
        }
        match self.shared.remove(&id) {
            Some(v) => Ok(v),
            None => self.take(id),
        }
    }

    /// Move the node at `id` out of the arena and convert it.
    fn take(&mut self, id: Id) -> Result<Value, PickleError> {
        let node = self
            .nodes
            .get_mut(id)
            .map(|slot| std::mem::replace(slot, Node::Leaf(Value::None)));
        let Some(node) = node else {
            return Err(malformed(self.origin(id), "dangling node"));
        };
        Ok(match node {
            Node::Leaf(v) => v,
            Node::Tuple(items) => Value::Tuple(self.values(&items)?),
            Node::List(items) => Value::List(self.values(&items)?),
            Node::Set(items) => Value::Set(dedup_set(self.values(&items)?)),
            Node::Dict(items) => Value::Dict(self.pairs(&items)?),
            Node::Object(object) => Value::Object(Box::new(Object {
                callable: self.value(object.callable)?,
                args: self.values(&object.args)?,
                new_obj: object.new_obj,
                dict_items: self.pairs(&object.dict_items)?,
                list_items: self.values(&object.list_items)?,
                state: match object.state {
                    Some(s) => Some(self.value(s)?),
                    None => None,
                },
            })),
            Node::PersistentId(pid) => Value::PersistentId(Box::new(self.value(pid)?)),
        })
    }

    fn values(&mut self, ids: &[Id]) -> Result<Vec<Value>, PickleError> {
        ids.iter().map(|&id| self.value(id)).collect()
    }

    fn pairs(&mut self, ids: &[(Id, Id)]) -> Result<Vec<(Value, Value)>, PickleError> {
        let mut out = Vec::with_capacity(ids.len());
        for &(k, v) in ids {
            out.push((self.value(k)?, self.value(v)?));
        }
        Ok(dedup_pairs(out))
    }
}

/// Ids a node refers to, in no particular order.
fn children(node: &Node) -> Vec<Id> {
    match node {
        Node::Leaf(_) => Vec::new(),
        Node::Tuple(items) | Node::List(items) | Node::Set(items) => items.clone(),
        Node::Dict(items) => items.iter().flat_map(|&(k, v)| [k, v]).collect(),
        Node::Object(object) => {
            let mut ids = vec![object.callable];
            ids.extend(&object.args);
            ids.extend(object.dict_items.iter().flat_map(|&(k, v)| [k, v]));
            ids.extend(&object.list_items);
            ids.extend(object.state);
            ids
        }
        Node::PersistentId(pid) => vec![*pid],
    }
}

/// A dict or set key whose equality ckpt can decide the way Python would.
#[derive(PartialEq, Eq, Hash)]
enum SimpleKey<'a> {
    None,
    Int(i64),
    Str(&'a str),
    Bytes(&'a [u8]),
}

fn simple_key(v: &Value) -> Option<SimpleKey<'_>> {
    match v {
        Value::None => Some(SimpleKey::None),
        // In Python `True == 1`, so they are the same key.
        Value::Bool(b) => Some(SimpleKey::Int(i64::from(*b))),
        Value::Int(i) => Some(SimpleKey::Int(*i)),
        Value::Str(s) => Some(SimpleKey::Str(s)),
        Value::Bytes(b) => Some(SimpleKey::Bytes(b)),
        _ => None,
    }
}

fn key_hash(k: &SimpleKey<'_>) -> u64 {
    let mut h = DefaultHasher::new();
    k.hash(&mut h);
    h.finish()
}

/// Python dict semantics for repeated keys: first position, last value.
fn dedup_pairs(items: Vec<(Value, Value)>) -> Vec<(Value, Value)> {
    if items.len() < 2 {
        return items;
    }
    let mut out: Vec<(Value, Value)> = Vec::with_capacity(items.len());
    // Hash -> positions in `out`; hashes are compared first so keys need not be copied.
    let mut seen: HashMap<u64, Vec<usize>> = HashMap::new();
    for (k, v) in items {
        if let Some(key) = simple_key(&k) {
            let slots = seen.entry(key_hash(&key)).or_default();
            let found = slots
                .iter()
                .copied()
                .find(|&i| out.get(i).and_then(|(ok, _)| simple_key(ok)).as_ref() == Some(&key));
            if let Some(i) = found {
                if let Some(slot) = out.get_mut(i) {
                    slot.1 = v;
                }
                continue;
            }
            slots.push(out.len());
        }
        out.push((k, v));
    }
    out
}

/// Python set semantics for repeated simple items: the first is kept.
fn dedup_set(items: Vec<Value>) -> Vec<Value> {
    if items.len() < 2 {
        return items;
    }
    let pairs = items.into_iter().map(|v| (v, Value::None)).collect();
    dedup_pairs(pairs).into_iter().map(|(v, _)| v).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    const BIG_INT_P4: &[u8] = b"\x80\x04\x95\x0c\x00\x00\x00\x00\x00\x00\x00\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.";
    /// `l = []; l.append(l)`
    const CYCLE_P4: &[u8] = b"\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00]\x94h\x00a.";
    /// `data.pkl` of `torch.save(torch.arange(4.0)[1:])`: a view with storage offset 1.
    const TORCH_DATA_PKL: &[u8] = b"\x80\x02ctorch._utils\x0a_rebuild_tensor_v2\x0aq\x00((X\x07\x00\x00\x00storageq\x01ctorch\x0aFloatStorage\x0aq\x02X\x01\x00\x00\x000q\x03X\x03\x00\x00\x00cpuq\x04K\x04tq\x05QK\x01K\x03\x85q\x06K\x01\x85q\x07\x89ccollections\x0aOrderedDict\x0aq\x08)Rq\x09tq\x0aRq\x0b.";
    /// `[Point(1, "a")]` for `@dataclass class Point: x: int; y: str` defined in `__main__`.
    const DATACLASS_P4: &[u8] = b"\x80\x04\x95/\x00\x00\x00\x00\x00\x00\x00]\x94\x8c\x08__main__\x94\x8c\x05Point\x94\x93\x94)\x81\x94}\x94(\x8c\x01x\x94K\x01\x8c\x01y\x94\x8c\x01a\x94uba.";

    const NOTHING: &[(&str, &str)] = &[];

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
    fn integers_outside_i64_are_errors() {
        assert!(matches!(
            read_with(BIG_INT_P4, NOTHING),
            Err(PickleError::Malformed { offset: 11, .. })
        ));
        // 2**63 needs nine bytes with a zero sign byte; -2**63 - 1 likewise with 0xff.
        assert!(read_with(b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.", NOTHING).is_err());
        assert!(read_with(b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\x7f\xff.", NOTHING).is_err());
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
    fn cycles_are_rejected() {
        assert!(matches!(
            read_with(CYCLE_P4, NOTHING),
            Err(PickleError::Malformed { .. })
        ));
    }

    #[test]
    fn billion_laughs_hits_the_node_limit_not_memory() {
        // A list of ten references to the previous list, nine times over: 10^9 leaves.
        let mut p = b"\x80\x04K\x00\x94".to_vec();
        for level in 0u8..9 {
            p.push(b'(');
            for _ in 0..10 {
                p.extend_from_slice(&[b'h', level]);
            }
            p.extend_from_slice(b"l\x94");
        }
        p.push(b'.');
        let started = std::time::Instant::now();
        let err = read(&p, &NOTHING, Limits::default()).unwrap_err();
        assert!(matches!(err, PickleError::LimitExceeded { .. }), "{err}");
        // Refused by measuring the shared structure, not by building 16M nodes first.
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
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
            read_with(&PLAIN_P4[..20], NOTHING),
            Err(PickleError::Truncated { offset: 20 })
        );
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
}
