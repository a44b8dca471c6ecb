//! Pickle reader: opcodes to a compact object [`Graph`], executing nothing.
//!
//! The reader is a small pickle machine that builds graph nodes instead of Python objects. The
//! stack and the memo hold node ids, and every mutating opcode (`APPEND`, `SETITEMS`, `BUILD`, ...)
//! changes the node in place. That gives Python's reference semantics: pickles memoize a dict or
//! list while it is still empty and fill it afterwards, and a later `BINGET` must see the filled
//! container. At `STOP` the graph under the root is validated (see [`Graph`]): copies made by
//! shared references count against [`Limits::max_nodes`], and a container that contains itself
//! (a cycle) is rejected.
//!
//! Choices where Python's pickle leaves room:
//! - `BINSTRING` / `SHORT_BINSTRING` (Python 2 `str`) become strings, decoded as UTF-8, which is
//!   what `torch.load` does with its default `encoding="utf-8"`; other bytes are an error there too.
//! - `BYTEARRAY8` becomes bytes: the graph does not distinguish mutable bytes.
//! - `GLOBAL` in a protocol 0-2 pickle maps the Python 2 modules `__builtin__` and `copy_reg` to their
//!   Python 3 names before the policy is asked, as Python's `fix_imports` does.
//! - A dict (or set) that receives the same simple key (str, bytes, int, bool, None) twice keeps
//!   the first position and the last value, as Python's dict does; other keys are kept as pickled.
//! - Bytes after `STOP` are ignored, as `pickle.loads` ignores them; nothing torch writes has any,
//!   but a reader that refuses them gains nothing.
//! - `FRAME` only announces how many bytes follow; the reader does not need it and skips it, but
//!   refuses one that runs past the end of the input, as Python's unpickler does.
//! - Pickles of 4 GiB or more are refused: graph nodes address the input with 32-bit offsets.

use std::collections::HashMap;
use std::ops::ControlFlow;

use super::graph::{
    is_small_int, small_int, Batch, Chain, Graph, Id, Node, ObjectItems, ObjectNode, Origin, Span,
    MAX_NODES, NONE,
};
use super::opcodes as op;
use super::{limit, malformed, Global, Globals, Limits, NodeRef, PickleError, Value};

/// Read one pickle (protocols 0-5 opcodes as used by torch and DCP) into an owned value tree.
pub fn read(bytes: &[u8], globals: &dyn Globals, limits: Limits) -> Result<Value, PickleError> {
    Ok(parse(bytes, globals, limits)?.root().to_value())
}

/// Read one pickle into a validated graph that borrows `bytes`; read it through [`Graph::root`].
pub fn parse<'a>(
    bytes: &'a [u8],
    globals: &dyn Globals,
    limits: Limits,
) -> Result<Graph<'a>, PickleError> {
    run_machine(bytes, globals, limits, None)
}

/// Takes the items of the large dicts of a pickle as they are read, so that their nodes can be
/// dropped instead of kept: a DCP `.metadata` of millions of pieces is two dicts of millions of
/// items (`state_dict_metadata`, `storage_data`) in the state of one object.
///
/// A dict is claimed when a `MARK` opens a batch of items for it, and only for a dict that is the
/// value of a string key in the state dict (the innermost mark but one) of a top-level object; its
/// batches then go to [`Consumer::consume`] and the dict stays empty in the graph. After each
/// batch the nodes it made are dropped, except that memo entries the pickle fetches later (found
/// by a first pass, see `scan.rs`) keep a copy when they are scalars; when one is not, or the
/// batch changed an older container, the batch's nodes are simply kept.
///
/// Inside a claimed dict's batch (whose values may be large objects: a DCP tensor entry holds a
/// chunk per rank, and a batch holds a thousand entries), a list set under a string key in the
/// state of any object may be claimed too ([`Consumer::claims_list`]); its `APPENDS` batches go to
/// [`Consumer::consume_list`] the same way, and the list stays empty in the graph.
pub trait Consumer {
    /// Whether the items of the dict set under `key` in the state of `owner` go to `consume`.
    fn claims(&mut self, owner: NodeRef<'_>, key: &str) -> bool;
    /// One batch of key-value pairs of a claimed dict, in order. `Break` stops the reader (with
    /// [`PickleError::Stopped`]); the consumer keeps the reason.
    fn consume(&mut self, key: &str, pairs: &[(NodeRef<'_>, NodeRef<'_>)]) -> ControlFlow<()>;
    /// Whether the items of the list set under `key` in the state of `owner` go to
    /// `consume_list`.
    fn claims_list(&mut self, _owner: NodeRef<'_>, _key: &str) -> bool {
        false
    }
    /// One batch of items of a claimed list, in order; `list` is the (still empty) list, whose
    /// [`NodeRef::id`] is the same when its owner is consumed later.
    fn consume_list(&mut self, _list: NodeRef<'_>, _items: &[NodeRef<'_>]) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
}

/// [`parse`], handing the items of the dicts `consumer` claims to it instead of the graph.
pub fn parse_consuming<'a>(
    bytes: &'a [u8],
    globals: &dyn Globals,
    limits: Limits,
    consumer: &mut dyn Consumer,
) -> Result<Graph<'a>, PickleError> {
    run_machine(bytes, globals, limits, Some(consumer))
}

fn run_machine<'a>(
    bytes: &'a [u8],
    globals: &dyn Globals,
    limits: Limits,
    consumer: Option<&mut dyn Consumer>,
) -> Result<Graph<'a>, PickleError> {
    if u32::try_from(bytes.len()).is_err() {
        return Err(limit(0, "pickles of 4 GiB or more are not read"));
    }
    // Without knowing which memo entries are fetched, no node may be dropped.
    let consuming = consumer.and_then(|c| {
        Some(Consuming {
            consumer: c,
            fetched: super::scan::fetched_memo(bytes)?,
            open: Vec::new(),
            closed: None,
            memo_log: Vec::new(),
        })
    });
    let mut machine = Machine {
        input: Input { bytes, pos: 0 },
        globals,
        limits,
        graph: Graph::new(bytes),
        global_ids: HashMap::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        empty_tuple: None,
        proto: 0,
        consuming,
    };
    let root = machine.run()?;
    let end = machine.input.pos;
    // Only the graph is kept; the stack and memo are freed before it is measured.
    let mut graph = machine.graph;
    graph.root = root;
    graph.end = end;
    graph.validate(limits)?;
    Ok(graph)
}

/// The state of a run with a [`Consumer`].
struct Consuming<'c> {
    consumer: &'c mut dyn Consumer,
    /// Memo indices the pickle ever fetches.
    fetched: std::collections::HashSet<u64>,
    /// The claimed batches being read, outermost first: a dict's, and inside it a list's.
    open: Vec<ClaimedBatch>,
    /// The claimed batch whose mark the last `pop_mark` closed.
    closed: Option<ClaimedBatch>,
    /// Memo indices put while a claimed batch is open.
    memo_log: Vec<u64>,
}

/// Claimed batches open at once at most: a dict's, and a list's inside it.
const MAX_OPEN_CLAIMS: usize = 2;

/// Where the graph's arenas stood when a claimed batch's `MARK` opened it.
#[derive(Clone, Copy)]
struct ClaimedBatch {
    /// `marks.len()` once this batch's mark is pushed.
    depth: usize,
    /// The claimed dict or list.
    container: Id,
    /// A list's batch (`APPENDS`), not a dict's (`SETITEMS`).
    list: bool,
    /// The claimed key, as a span of the input.
    key: Span,
    /// `memo_log.len()` when the batch opened.
    log_start: usize,
    nodes: usize,
    pool: usize,
    batches: usize,
    objects: usize,
    object_items: usize,
    /// An older container or object was changed inside the batch: its nodes must stay.
    dirty: bool,
}

/// The highest protocol Python knows; a higher `PROTO` is not a pickle we understand.
const HIGHEST_PROTOCOL: u8 = 5;

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

struct Machine<'a, 'p> {
    input: Input<'a>,
    globals: &'p dyn Globals,
    limits: Limits,
    graph: Graph<'a>,
    /// Index in `graph.globals` of each global already made, so each is stored once.
    global_ids: HashMap<(String, String), u32>,
    stack: Vec<Id>,
    /// Stack lengths at each open `MARK`.
    marks: Vec<usize>,
    memo: Memo,
    /// The one node every `EMPTY_TUPLE` pushes: tuples never change, and an empty one is as
    /// common as `NEWOBJ` (its arguments), so each need not cost a node.
    empty_tuple: Option<Id>,
    proto: u8,
    consuming: Option<Consuming<'p>>,
}

/// The memo. Python numbers its entries 0, 1, 2, ... (`MEMOIZE`, and `BINPUT` counting up), so
/// those live in a vector; any other index a pickle picks goes to a map.
#[derive(Default)]
struct Memo {
    dense: Vec<Id>,
    sparse: HashMap<u64, Id>,
}

impl Memo {
    fn len(&self) -> usize {
        self.dense.len() + self.sparse.len()
    }

    fn contains(&self, index: u64) -> bool {
        index < self.dense.len() as u64 || self.sparse.contains_key(&index)
    }

    fn put(&mut self, index: u64, id: Id) {
        let len = self.dense.len() as u64;
        if let Some(slot) = usize::try_from(index)
            .ok()
            .and_then(|i| self.dense.get_mut(i))
        {
            *slot = id;
        } else if index == len {
            // An entry put out of order at this index earlier is superseded, not counted twice.
            self.sparse.remove(&index);
            self.dense.push(id);
        } else {
            self.sparse.insert(index, id);
        }
    }

    fn get(&self, index: u64) -> Option<Id> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.dense.get(i))
            .or_else(|| self.sparse.get(&index))
            .copied()
    }
}

fn utf8(offset: usize, bytes: &[u8]) -> Result<&str, PickleError> {
    std::str::from_utf8(bytes).map_err(|_| malformed(offset, "string is not valid UTF-8"))
}

/// Whether `bytes` decode as Python's pickle decodes a str, `utf-8` with `surrogatepass`: UTF-8,
/// where a lone surrogate (U+D800 to U+DFFF, `ED A0 80` to `ED BF BF`) is also a character.
fn python_str(bytes: &[u8]) -> bool {
    let mut rest = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(_) => return true,
            Err(e) => {
                let at = e.valid_up_to();
                match rest.get(at..at + 3) {
                    Some([0xed, 0xa0..=0xbf, 0x80..=0xbf]) => rest = &rest[at + 3..],
                    _ => return false,
                }
            }
        }
    }
}

/// A decimal integer as protocol 0 writes it (`I`, `g`, `p` arguments).
fn decimal(offset: usize, line: &[u8]) -> Result<i64, PickleError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| malformed(offset, "integer argument is not a 64-bit decimal"))
}

/// A little-endian two's complement integer of any length (`LONG1`, `LONG4`), if it fits in i64.
fn long(bytes: &[u8]) -> Option<i64> {
    let Some(&last) = bytes.last() else {
        return Some(0);
    };
    let fill = if last & 0x80 != 0 { 0xff } else { 0x00 };
    let mut buf = [fill; 8];
    for (i, &b) in bytes.iter().enumerate() {
        match buf.get_mut(i) {
            Some(slot) => *slot = b,
            // Bytes past the eighth must only repeat the sign, and the eighth must carry it.
            None if b == fill => {}
            None => return None,
        }
    }
    let value = i64::from_le_bytes(buf);
    if (value < 0) != (fill == 0xff) {
        return None;
    }
    Some(value)
}

impl<'a> Machine<'a, '_> {
    fn run(&mut self) -> Result<Id, PickleError> {
        loop {
            let at = self.input.pos;
            let opcode = self.input.u8()?;
            match opcode {
                op::PROTO => {
                    let proto = self.input.u8()?;
                    if proto > HIGHEST_PROTOCOL {
                        return Err(malformed(at, format!("unknown pickle protocol {proto}")));
                    }
                    self.proto = proto;
                }
                op::FRAME => {
                    // Python's unpickler reads the whole frame ahead and refuses one that runs
                    // past the data ("pickle data was truncated"); a shorter one is harmless.
                    let len = self.input.u64()?;
                    let left = self.input.bytes.len() - self.input.pos;
                    if len > left as u64 {
                        return Err(malformed(
                            at,
                            format!("`FRAME` announces {len} bytes but only {left} follow (the pickle is truncated or the length is corrupt)"),
                        ));
                    }
                }
                op::STOP => return self.pop(at),
                op::MARK => {
                    if self.marks.len() >= self.limits.max_stack {
                        return Err(limit(at, "too many open marks"));
                    }
                    self.open_claimed_batch();
                    self.marks.push(self.stack.len());
                }
                op::POP => {
                    if self.stack.len() > self.base() {
                        self.stack.pop();
                    } else {
                        self.pop_mark(at)?;
                    }
                }
                op::POP_MARK => {
                    let mark = self.pop_mark(at)?;
                    self.stack.truncate(mark);
                }
                op::DUP => {
                    let top = self.top(at)?;
                    self.push(at, top)?;
                }
                op::NONE => self.node(at, Node::None)?,
                op::NEWTRUE => self.node(at, Node::Bool(true))?,
                op::NEWFALSE => self.node(at, Node::Bool(false))?,
                op::INT => {
                    let line = self.input.line()?;
                    // Protocol 0 spells booleans as `I01` / `I00`.
                    match line {
                        b"01" => self.node(at, Node::Bool(true))?,
                        b"00" => self.node(at, Node::Bool(false))?,
                        _ => self.int(at, decimal(at, line)?)?,
                    }
                }
                op::BININT => {
                    let v = self.input.i32()?;
                    self.int(at, v.into())?;
                }
                op::BININT1 => {
                    let v = self.input.u8()?;
                    self.int(at, v.into())?;
                }
                op::BININT2 => {
                    let v = self.input.u16()?;
                    self.int(at, v.into())?;
                }
                op::LONG1 => {
                    let n = self.input.u8()?;
                    self.long(at, n.into())?;
                }
                op::LONG4 => {
                    let n = self.input.i32()?;
                    let n = u64::try_from(n)
                        .map_err(|_| malformed(at, "negative length for `LONG4`"))?;
                    self.long(at, n)?;
                }
                op::BINFLOAT => {
                    let v = f64::from_be_bytes(self.input.array()?);
                    self.node(at, Node::Float(v.to_le_bytes()))?;
                }
                op::BINUNICODE => {
                    let n = self.input.u32()?;
                    self.text(at, n.into())?;
                }
                op::SHORT_BINUNICODE | op::SHORT_BINSTRING => {
                    let n = self.input.u8()?;
                    self.text(at, n.into())?;
                }
                op::BINUNICODE8 => {
                    let n = self.input.u64()?;
                    self.text(at, n)?;
                }
                op::BINSTRING => {
                    let n = self.input.i32()?;
                    let n = u64::try_from(n)
                        .map_err(|_| malformed(at, "negative length for `BINSTRING`"))?;
                    self.text(at, n)?;
                }
                op::BINBYTES => {
                    let n = self.input.u32()?;
                    let (span, _) = self.span(n.into())?;
                    self.node(at, Node::Bytes(span))?;
                }
                op::SHORT_BINBYTES => {
                    let n = self.input.u8()?;
                    let (span, _) = self.span(n.into())?;
                    self.node(at, Node::Bytes(span))?;
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let n = self.input.u64()?;
                    let (span, _) = self.span(n)?;
                    self.node(at, Node::Bytes(span))?;
                }
                op::EMPTY_TUPLE => match self.empty_tuple {
                    Some(id) => self.push(at, id)?,
                    None => {
                        self.node(at, Node::Tuple(Span::EMPTY, origin(at)))?;
                        self.empty_tuple = self.stack.last().copied();
                    }
                },
                op::TUPLE => {
                    let mark = self.pop_mark(at)?;
                    let items = self.pool_from(at, mark)?;
                    self.node(at, Node::Tuple(items, origin(at)))?;
                }
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = usize::from(opcode - op::TUPLE1) + 1;
                    let start = self.last(at, n)?;
                    let items = self.pool_from(at, start)?;
                    self.node(at, Node::Tuple(items, origin(at)))?;
                }
                op::EMPTY_LIST => self.node(at, Node::List(Chain::EMPTY, origin(at)))?,
                op::LIST => {
                    let mark = self.pop_mark(at)?;
                    let chain = self.new_chain(at, mark)?;
                    self.node(at, Node::List(chain, origin(at)))?;
                }
                op::APPEND => {
                    let start = self.last(at, 1)?;
                    self.extend(at, start, "APPEND")?;
                }
                op::APPENDS => {
                    let mark = self.pop_mark(at)?;
                    let closed = self.consuming.as_mut().and_then(|c| c.closed.take());
                    match closed {
                        Some(batch) if batch.list => self.consume_batch(at, mark, batch)?,
                        _ => self.extend(at, mark, "APPEND")?,
                    }
                }
                op::EMPTY_DICT => self.node(at, Node::Dict(Chain::EMPTY, origin(at)))?,
                op::DICT => {
                    let mark = self.pop_mark(at)?;
                    self.check_pairs(at, mark)?;
                    let chain = self.new_chain(at, mark)?;
                    self.node(at, Node::Dict(chain, origin(at)))?;
                }
                op::SETITEM => {
                    let start = self.last(at, 2)?;
                    self.check_hashable(at, start, 2)?;
                    self.extend(at, start, "SETITEM")?;
                }
                op::SETITEMS => {
                    let mark = self.pop_mark(at)?;
                    self.check_pairs(at, mark)?;
                    let closed = self.consuming.as_mut().and_then(|c| c.closed.take());
                    match closed {
                        Some(batch) if !batch.list => self.consume_batch(at, mark, batch)?,
                        _ => self.extend(at, mark, "SETITEM")?,
                    }
                }
                op::EMPTY_SET => self.node(at, Node::Set(Chain::EMPTY, origin(at)))?,
                op::ADDITEMS => {
                    let mark = self.pop_mark(at)?;
                    self.check_hashable(at, mark, 1)?;
                    self.extend(at, mark, "ADDITEMS")?;
                }
                op::FROZENSET => {
                    let mark = self.pop_mark(at)?;
                    self.check_hashable(at, mark, 1)?;
                    let chain = self.new_chain(at, mark)?;
                    self.node(at, Node::Set(chain, origin(at)))?;
                }
                op::GLOBAL => {
                    let module = utf8(at, self.input.line()?)?;
                    let name = utf8(at, self.input.line()?)?;
                    let module = if self.proto < 3 {
                        py3_module(module)
                    } else {
                        module
                    };
                    self.global(at, module, name)?;
                }
                op::STACK_GLOBAL => {
                    let name = self.pop(at)?;
                    let module = self.pop(at)?;
                    let module = self.string(at, module, "module")?;
                    let name = self.string(at, name, "name")?;
                    self.global(at, module, name)?;
                }
                op::REDUCE => {
                    let args = self.pop(at)?;
                    let callable = self.pop(at)?;
                    let args = self.tuple(at, args, "REDUCE")?;
                    self.object(at, callable, args, false)?;
                }
                op::NEWOBJ => {
                    let args = self.pop(at)?;
                    let cls = self.pop(at)?;
                    let args = self.tuple(at, args, "NEWOBJ")?;
                    self.object(at, cls, args, true)?;
                }
                op::NEWOBJ_EX => {
                    let kwargs = self.pop(at)?;
                    let args = self.pop(at)?;
                    let cls = self.pop(at)?;
                    let args = self.tuple(at, args, "NEWOBJ_EX")?;
                    // The graph has nowhere to keep keyword arguments; Python only writes
                    // `NEWOBJ_EX` with empty ones for classes whose `__getnewargs_ex__` has none.
                    match self.graph.node(kwargs) {
                        Node::Dict(items, _) if items.head == NONE => {}
                        _ => return Err(PickleError::UnsupportedOpcode { opcode, offset: at }),
                    }
                    self.object(at, cls, args, true)?;
                }
                op::BUILD => {
                    let state = self.pop(at)?;
                    let target = self.top(at)?;
                    self.touch(target);
                    match self.object_mut(target) {
                        Some(object) => object.state = state,
                        None => {
                            let kind = self.kind(target);
                            return Err(malformed(at, format!("`BUILD` on a {kind}")));
                        }
                    }
                }
                op::BINPERSID => {
                    if !self.globals.allows_persistent_ids() {
                        return Err(malformed(
                            at,
                            "a persistent id (`BINPERSID`), which this pickle may not hold",
                        ));
                    }
                    let pid = self.pop(at)?;
                    self.node(at, Node::PersistentId(pid, origin(at)))?;
                }
                op::PUT => {
                    let index = decimal(at, self.input.line()?)?;
                    let index =
                        u64::try_from(index).map_err(|_| malformed(at, "negative memo index"))?;
                    self.memo_put(at, index)?;
                }
                op::BINPUT => {
                    let index = self.input.u8()?;
                    self.memo_put(at, index.into())?;
                }
                op::LONG_BINPUT => {
                    let index = self.input.u32()?;
                    self.memo_put(at, index.into())?;
                }
                op::MEMOIZE => {
                    let index = self.memo.len() as u64;
                    self.memo_put(at, index)?;
                }
                op::GET => {
                    let index = decimal(at, self.input.line()?)?;
                    let index =
                        u64::try_from(index).map_err(|_| malformed(at, "negative memo index"))?;
                    self.memo_get(at, index)?;
                }
                op::BINGET => {
                    let index = self.input.u8()?;
                    self.memo_get(at, index.into())?;
                }
                op::LONG_BINGET => {
                    let index = self.input.u32()?;
                    self.memo_get(at, index.into())?;
                }
                _ => return Err(PickleError::UnsupportedOpcode { opcode, offset: at }),
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

    /// Where the top `n` values start on the stack; they must be above the innermost mark.
    fn last(&self, at: usize, n: usize) -> Result<usize, PickleError> {
        self.stack
            .len()
            .checked_sub(n)
            .filter(|&s| s >= self.base())
            .ok_or_else(|| malformed(at, "stack underflow"))
    }

    /// Close the innermost mark; the items above it are `stack[mark..]`, which the caller takes.
    fn pop_mark(&mut self, at: usize) -> Result<usize, PickleError> {
        let depth = self.marks.len();
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| malformed(at, "no open `MARK`"))?;
        if let Some(c) = &mut self.consuming {
            c.closed = None;
            if c.open.last().is_some_and(|b| b.depth == depth) {
                c.closed = c.open.pop();
            }
        }
        Ok(mark.min(self.stack.len()))
    }

    /// At a `MARK`: if it opens a batch of items for a dict or list the consumer claims, remember
    /// where the graph stands (see [`Consumer`]).
    fn open_claimed_batch(&mut self) {
        let Some(c) = &mut self.consuming else {
            return;
        };
        if c.open.len() >= MAX_OPEN_CLAIMS {
            return;
        }
        // The container and its key on top of the stack, inside the state dict of an object:
        // the stack reads [.., owner, state, MARK, .., key, container]. A dict is claimed only in
        // the state of a top-level object (one mark open) and outside any other claim.
        let n = self.stack.len();
        let (Some(&container), Some(&key), Some(&state_mark)) = (
            self.stack.get(n.wrapping_sub(1)),
            self.stack.get(n.wrapping_sub(2)),
            self.marks.last(),
        ) else {
            return;
        };
        let list = match self.graph.node(container) {
            Node::Dict(..) if c.open.is_empty() && self.marks.len() == 1 => false,
            Node::List(..) => true,
            _ => return,
        };
        let (Some(&owner), Some(&state)) = (
            self.stack.get(state_mark.wrapping_sub(2)),
            self.stack.get(state_mark.wrapping_sub(1)),
        ) else {
            return;
        };
        let (Node::Dict(..), Node::Str(span)) = (self.graph.node(state), self.graph.node(key))
        else {
            return;
        };
        let Some(name) = self
            .graph
            .input
            .get(span.range())
            .and_then(|b| std::str::from_utf8(b).ok())
        else {
            return;
        };
        let owner = self.graph.view(owner);
        let claimed = if list {
            c.consumer.claims_list(owner, name)
        } else {
            c.consumer.claims(owner, name)
        };
        if !claimed {
            return;
        }
        if c.open.is_empty() {
            c.memo_log.clear();
        }
        c.open.push(ClaimedBatch {
            depth: self.marks.len() + 1,
            container,
            list,
            key: span,
            log_start: c.memo_log.len(),
            nodes: self.graph.nodes.len(),
            pool: self.graph.pool.len(),
            batches: self.graph.batches.len(),
            objects: self.graph.objects.len(),
            object_items: self.graph.object_items.len(),
            dirty: false,
        });
    }

    /// A container or object is about to change: if it is older than an open claimed batch, the
    /// batch's nodes cannot be dropped (the change may point into them).
    fn touch(&mut self, target: Id) {
        if let Some(c) = &mut self.consuming {
            for batch in &mut c.open {
                if (target as usize) < batch.nodes {
                    batch.dirty = true;
                }
            }
        }
    }

    /// `SETITEMS` (`APPENDS`) closing a claimed dict's (list's) batch: hand `stack[mark..]` to
    /// the consumer, then drop the nodes the batch made (see [`Consumer`]).
    fn consume_batch(
        &mut self,
        at: usize,
        mark: usize,
        batch: ClaimedBatch,
    ) -> Result<(), PickleError> {
        let opcode = if batch.list { "APPEND" } else { "SETITEM" };
        let target = mark.checked_sub(1).and_then(|t| self.stack.get(t).copied());
        let Some(c) = &mut self.consuming else {
            return self.extend(at, mark, opcode);
        };
        if target != Some(batch.container) {
            // Not the container the batch was opened for (the stack changed under the mark).
            return self.extend(at, mark, opcode);
        }
        let items = self.stack.get(mark..).unwrap_or_default();
        let flow = if batch.list {
            let views: Vec<NodeRef<'_>> = items.iter().map(|&id| self.graph.view(id)).collect();
            c.consumer
                .consume_list(self.graph.view(batch.container), &views)
        } else {
            let key = self
                .graph
                .input
                .get(batch.key.range())
                .and_then(|b| std::str::from_utf8(b).ok())
                .unwrap_or_default();
            let pairs: Vec<(NodeRef<'_>, NodeRef<'_>)> = items
                .chunks_exact(2)
                .map(|kv| (self.graph.view(kv[0]), self.graph.view(kv[1])))
                .collect();
            c.consumer.consume(key, &pairs)
        };
        if flow.is_break() {
            return Err(PickleError::Stopped { offset: at });
        }
        self.stack.truncate(mark);
        self.drop_batch_nodes(batch);
        Ok(())
    }

    /// Drop the nodes a consumed batch made, keeping (as copies) the memo entries the pickle
    /// fetches later. Gives up, keeping everything, when one of those is not a scalar or the
    /// batch changed an older node.
    fn drop_batch_nodes(&mut self, batch: ClaimedBatch) {
        let Some(c) = &mut self.consuming else {
            return;
        };
        // An outer batch still open sees these memo entries again when it closes.
        let log = if c.open.is_empty() {
            std::mem::take(&mut c.memo_log)
        } else {
            c.memo_log
                .get(batch.log_start..)
                .unwrap_or_default()
                .to_vec()
        };
        if batch.dirty {
            return;
        }
        let floor = batch.nodes;
        let is_new = |id: Id| (id as usize) >= floor && !is_small_int(id) && id != NONE;
        let mut kept = Vec::new();
        for &index in &log {
            let Some(id) = self.memo.get(index) else {
                continue;
            };
            if !is_new(id) {
                continue;
            }
            if !c.fetched.contains(&index) {
                self.memo.put(index, NONE);
                continue;
            }
            match self.graph.node(id) {
                node @ (Node::None
                | Node::Bool(_)
                | Node::Int(_)
                | Node::BigInt(_)
                | Node::Float(_)
                | Node::Str(_)
                | Node::Bytes(_)
                | Node::Global(_)) => kept.push((index, node)),
                _ => return,
            }
        }
        self.graph.nodes.truncate(floor);
        self.graph.pool.truncate(batch.pool);
        self.graph.batches.truncate(batch.batches);
        self.graph.objects.truncate(batch.objects);
        self.graph.object_items.truncate(batch.object_items);
        if self.empty_tuple.is_some_and(is_new) {
            self.empty_tuple = None;
        }
        for (index, node) in kept {
            let id = self.graph.nodes.len() as Id;
            self.graph.nodes.push(node);
            self.memo.put(index, id);
        }
    }

    /// Move `stack[start..]` to the end of the pool, as one span.
    fn pool_from(&mut self, at: usize, start: usize) -> Result<Span, PickleError> {
        let items = self.stack.get(start..).unwrap_or_default();
        let span = Span {
            start: self.pool_len(at)?,
            len: u32::try_from(items.len()).map_err(|_| limit(at, "too many items"))?,
        };
        self.graph.pool.extend_from_slice(items);
        self.stack.truncate(start);
        self.pool_len(at)?;
        Ok(span)
    }

    fn pool_len(&self, at: usize) -> Result<u32, PickleError> {
        u32::try_from(self.graph.pool.len()).map_err(|_| limit(at, "too many container items"))
    }

    /// A chain holding `stack[start..]` as its one batch (or nothing).
    fn new_chain(&mut self, at: usize, start: usize) -> Result<Chain, PickleError> {
        let mut chain = Chain::EMPTY;
        self.add_batch(at, &mut chain, start)?;
        Ok(chain)
    }

    /// Append `stack[start..]` to a chain. A batch that directly follows the chain's last one in
    /// the pool (consecutive `APPEND`s of scalars) grows it instead of adding another.
    fn add_batch(&mut self, at: usize, chain: &mut Chain, start: usize) -> Result<(), PickleError> {
        if self.stack.len() <= start {
            self.stack.truncate(start);
            return Ok(());
        }
        let items = self.pool_from(at, start)?;
        let tail = self.graph.batches.get_mut(chain.tail as usize);
        if let Some(tail) =
            tail.filter(|t| t.items.start.checked_add(t.items.len) == Some(items.start))
        {
            tail.items.len = tail.items.len.saturating_add(items.len);
            return Ok(());
        }
        let index = u32::try_from(self.graph.batches.len())
            .ok()
            .filter(|&i| i != NONE)
            .ok_or_else(|| limit(at, "too many container batches"))?;
        self.graph.batches.push(Batch { items, next: NONE });
        match self.graph.batches.get_mut(chain.tail as usize) {
            Some(tail) => tail.next = index,
            None => chain.head = index,
        }
        chain.tail = index;
        Ok(())
    }

    /// `APPEND(S)`, `SETITEM(S)`, `ADDITEMS`: move `stack[start..]` into the container below them.
    fn extend(&mut self, at: usize, start: usize, opcode: &str) -> Result<(), PickleError> {
        let target = start
            .checked_sub(1)
            .filter(|&t| t >= self.base())
            .and_then(|t| self.stack.get(t).copied())
            .ok_or_else(|| malformed(at, "stack underflow"))?;
        self.touch(target);
        let mut chain = match (opcode, self.graph.node(target)) {
            ("APPEND", Node::List(c, _)) | ("SETITEM", Node::Dict(c, _)) => c,
            ("ADDITEMS", Node::Set(c, _)) => c,
            ("APPEND" | "SETITEM", Node::Object(..)) => {
                let mut items = match self.object_mut(target) {
                    Some(o) => o.items,
                    None => NONE,
                };
                if items == NONE {
                    items = u32::try_from(self.graph.object_items.len())
                        .map_err(|_| limit(at, "too many objects"))?;
                    self.graph.object_items.push(ObjectItems {
                        dict: Chain::EMPTY,
                        list: Chain::EMPTY,
                    });
                    if let Some(o) = self.object_mut(target) {
                        o.items = items;
                    }
                }
                let Some(mut both) = self.graph.object_items.get(items as usize).copied() else {
                    return Err(malformed(at, "dangling node"));
                };
                let chain = if opcode == "APPEND" {
                    &mut both.list
                } else {
                    &mut both.dict
                };
                self.add_batch(at, chain, start)?;
                if let Some(slot) = self.graph.object_items.get_mut(items as usize) {
                    *slot = both;
                }
                return Ok(());
            }
            _ => {
                let kind = self.kind(target);
                let verb = if opcode == "SETITEM" { "on" } else { "to" };
                return Err(malformed(at, format!("`{opcode}` {verb} a {kind}")));
            }
        };
        self.add_batch(at, &mut chain, start)?;
        if let Some(Node::List(c, _) | Node::Dict(c, _) | Node::Set(c, _)) =
            self.graph.nodes.get_mut(target as usize)
        {
            *c = chain;
        }
        Ok(())
    }

    fn check_pairs(&self, at: usize, start: usize) -> Result<(), PickleError> {
        if self.stack.len().saturating_sub(start) % 2 != 0 {
            return Err(malformed(at, "odd number of items for a dict"));
        }
        self.check_hashable(at, start, 2)
    }

    /// Python hashes every dict key and set item as it inserts it, so a list or dict there (or
    /// a tuple holding one, or an object [`Globals::unhashable`] names) is refused ("unhashable
    /// type"). Sets are not told apart from frozensets in the graph, so they pass; a tuple is
    /// looked into up to a small budget of items, past which it passes too.
    fn check_hashable(&self, at: usize, start: usize, step: usize) -> Result<(), PickleError> {
        for &key in self
            .stack
            .get(start..)
            .unwrap_or_default()
            .iter()
            .step_by(step)
        {
            let mut todo = vec![key];
            let mut budget = 64usize;
            while let Some(id) = todo.pop() {
                match self.graph.node(id) {
                    Node::List(..) | Node::Dict(..) => {
                        let kind = self.kind(id);
                        return Err(malformed(
                            at,
                            format!("a dict key or set item is a {kind}, which Python cannot hash"),
                        ));
                    }
                    Node::Object(..) => {
                        if let Some((module, name)) = self.graph.view(id).class() {
                            if self.globals.unhashable(module, name) {
                                return Err(malformed(
                                    at,
                                    format!("a dict key or set item is a `{module}.{name}`, which Python cannot hash"),
                                ));
                            }
                        }
                    }
                    Node::Tuple(..) => {
                        for item in self.graph.view(id).as_seq().into_iter().flatten() {
                            if budget == 0 {
                                break;
                            }
                            budget -= 1;
                            todo.push(item.id());
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn kind(&self, id: Id) -> &'static str {
        match self.graph.node(id) {
            Node::Global(_) => "global",
            Node::Tuple(..) => "tuple",
            Node::List(..) => "list",
            Node::Dict(..) => "dict",
            Node::Set(..) => "set",
            Node::Object(..) => "object",
            Node::PersistentId(..) => "persistent id",
            _ => "scalar",
        }
    }

    fn object_mut(&mut self, id: Id) -> Option<&mut ObjectNode> {
        match self.graph.node(id) {
            Node::Object(i, _) => self.graph.objects.get_mut(i as usize),
            _ => None,
        }
    }

    /// Add a node to the graph and push it.
    fn node(&mut self, at: usize, node: Node) -> Result<(), PickleError> {
        let id = self.graph.nodes.len();
        if id >= self.limits.max_nodes {
            return Err(limit(
                at,
                format!("more than {} nodes", self.limits.max_nodes),
            ));
        }
        if id >= MAX_NODES {
            return Err(limit(at, "more nodes than ids"));
        }
        self.graph.nodes.push(node);
        // Below `MAX_NODES`, which is below `u32::MAX`.
        self.push(at, id as Id)
    }

    /// Push an int: a small one as its own id, others as a node.
    fn int(&mut self, at: usize, value: i64) -> Result<(), PickleError> {
        match small_int(value) {
            Some(id) => self.push(at, id),
            None => self.node(at, Node::Int(value.to_le_bytes())),
        }
    }

    /// The next `n` input bytes, and where they are.
    fn span(&mut self, n: u64) -> Result<(Span, &'a [u8]), PickleError> {
        let start = self.input.pos;
        let bytes = self.input.take_u64(n)?;
        // Both fit: the input is shorter than 4 GiB.
        let span = Span {
            start: start as u32,
            len: bytes.len() as u32,
        };
        Ok((span, bytes))
    }

    /// A string of the next `n` input bytes, which must decode as Python decodes them (UTF-8,
    /// lone surrogates allowed).
    fn text(&mut self, at: usize, n: u64) -> Result<(), PickleError> {
        let (span, bytes) = self.span(n)?;
        if !python_str(bytes) {
            return Err(malformed(at, "string is not valid UTF-8"));
        }
        self.node(at, Node::Str(span))
    }

    /// An int of the next `n` input bytes (little-endian two's complement), of any size.
    fn long(&mut self, at: usize, n: u64) -> Result<(), PickleError> {
        let (span, bytes) = self.span(n)?;
        match long(bytes) {
            Some(v) => self.int(at, v),
            None => self.node(at, Node::BigInt(span)),
        }
    }

    fn global(&mut self, at: usize, module: &str, name: &str) -> Result<(), PickleError> {
        if !self.globals.allows(module, name) {
            return Err(PickleError::ForbiddenGlobal {
                module: module.to_string(),
                name: name.to_string(),
            });
        }
        let key = (module.to_string(), name.to_string());
        let index = match self.global_ids.get(&key) {
            Some(&i) => i,
            None => {
                let i = u32::try_from(self.graph.globals.len())
                    .map_err(|_| limit(at, "too many globals"))?;
                self.graph.globals.push(Global {
                    module: key.0.clone(),
                    name: key.1.clone(),
                });
                self.global_ids.insert(key, i);
                i
            }
        };
        self.node(at, Node::Global(index))
    }

    fn object(
        &mut self,
        at: usize,
        callable: Id,
        args: Id,
        new_obj: bool,
    ) -> Result<(), PickleError> {
        let index =
            u32::try_from(self.graph.objects.len()).map_err(|_| limit(at, "too many objects"))?;
        self.graph.objects.push(ObjectNode {
            callable,
            args,
            state: NONE,
            items: NONE,
            new_obj,
        });
        self.node(at, Node::Object(index, origin(at)))
    }

    /// The text of a string node (a `STACK_GLOBAL` operand).
    fn string(&self, at: usize, id: Id, what: &str) -> Result<&'a str, PickleError> {
        match self.graph.node(id) {
            Node::Str(span) => utf8(at, self.input.bytes.get(span.range()).unwrap_or_default()),
            _ => Err(malformed(
                at,
                format!("`STACK_GLOBAL` {what} is not a string"),
            )),
        }
    }

    /// Check that a call's arguments are a tuple, and return it.
    fn tuple(&self, at: usize, id: Id, opcode: &str) -> Result<Id, PickleError> {
        match self.graph.node(id) {
            Node::Tuple(..) => Ok(id),
            _ => {
                let kind = self.kind(id);
                Err(malformed(
                    at,
                    format!("`{opcode}` arguments are a {kind}, not a tuple"),
                ))
            }
        }
    }

    fn memo_put(&mut self, at: usize, index: u64) -> Result<(), PickleError> {
        let top = self.top(at)?;
        if !self.memo.contains(index) && self.memo.len() >= self.limits.max_memo {
            return Err(limit(
                at,
                format!("more than {} memo entries", self.limits.max_memo),
            ));
        }
        self.memo.put(index, top);
        if let Some(c) = &mut self.consuming {
            if !c.open.is_empty() {
                c.memo_log.push(index);
            }
        }
        Ok(())
    }

    fn memo_get(&mut self, at: usize, index: u64) -> Result<(), PickleError> {
        let id = self
            .memo
            .get(index)
            .ok_or_else(|| malformed(at, format!("memo entry {index} was never stored")))?;
        if id == NONE {
            // Dropped with a consumed batch: the first pass found no fetch of it.
            return Err(malformed(at, format!("memo entry {index} was consumed")));
        }
        self.push(at, id)
    }
}

/// The origin of a container made by the opcode at `at` (inside the input, so below 4 GiB).
fn origin(at: usize) -> Origin {
    at as Origin
}

/// Python 2 module names that Python 3's unpickler renames under `fix_imports`.
fn py3_module(module: &str) -> &str {
    match module {
        "__builtin__" => "builtins",
        "copy_reg" => "copyreg",
        _ => module,
    }
}

#[cfg(test)]
mod tests;
