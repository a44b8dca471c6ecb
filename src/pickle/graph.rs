//! The object graph a pickle describes, kept compact, and a read-only [`NodeRef`] of it.
//!
//! A DCP `.metadata` with a million tensor pieces unpickles to tens of millions of objects, so the
//! per-object cost is what bounds ckpt's memory. Here a node is 16 bytes: scalars are inline,
//! strings and bytes are ranges of the pickle's own bytes, tuples are ranges of one shared pool of
//! child ids, and the containers pickle fills after creating them (`APPENDS`, `SETITEMS`) are
//! chains of batches in that pool. Small non-negative ints, the bulk of a `.metadata` (offsets,
//! sizes, lengths), are not nodes at all: their id holds the value (see [`small_int`]). Nothing is copied out until a caller asks: format modules read
//! meaning straight through a [`NodeRef`], and [`NodeRef::to_value`] builds an owned [`Value`] tree for
//! callers that want one.
//!
//! A graph is only handed out after [`Graph::validate`] has checked, from the root, that it is
//! acyclic, no deeper than [`Limits::max_depth`], and no larger than [`Limits::max_nodes`] with
//! shared references counted at every place they appear. So any walk of a view terminates, its
//! recursion is bounded, and a memo bomb is refused before anyone expands it.

use std::collections::HashMap;

use super::{limit, malformed, Global, Limits, Object, PickleError, Value};

/// Index of a node in [`Graph::nodes`], or a small int (see [`small_int`]).
pub(super) type Id = u32;
/// "No node" / "no batch" in the fields that may be empty.
pub(super) const NONE: u32 = u32::MAX;
/// Ids with this bit set are not nodes but the int in the other 31 bits.
const SMALL_INT: u32 = 1 << 31;

/// The id that stands for `value` without a node, if it is small enough to have one. The largest
/// such id would be [`NONE`], so that value keeps a node.
pub(super) fn small_int(value: i64) -> Option<Id> {
    u32::try_from(value)
        .ok()
        .filter(|&v| v < SMALL_INT - 1)
        .map(|v| v | SMALL_INT)
}

/// Nodes in a graph, for tests of how much a reader keeps.
#[cfg(test)]
pub(super) fn node_count(graph: &Graph<'_>) -> usize {
    graph.nodes.len()
}

/// True when `id` stands for a small int rather than a node.
pub(super) fn is_small_int(id: Id) -> bool {
    id & SMALL_INT != 0
}

/// Node ids stay below the small-int bit.
pub(super) const MAX_NODES: usize = SMALL_INT as usize;

/// Byte offset of the opcode that made a container, for errors found after reading.
pub(super) type Origin = u32;

/// `start..start + len` of the pickle bytes (strings, bytes) or of [`Graph::pool`] (tuples).
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub start: u32,
    pub len: u32,
}

impl Span {
    pub(super) const EMPTY: Span = Span { start: 0, len: 0 };

    pub(super) fn range(self) -> std::ops::Range<usize> {
        let start = self.start as usize;
        start..start.saturating_add(self.len as usize)
    }
}

/// The items of a container pickle may fill after creating it: a linked list of batches
/// ([`Batch`]), each a span of the pool. `head` and `tail` are [`NONE`] while it is empty.
#[derive(Clone, Copy, Debug)]
pub(super) struct Chain {
    pub head: u32,
    pub tail: u32,
}

impl Chain {
    pub(super) const EMPTY: Chain = Chain {
        head: NONE,
        tail: NONE,
    };
}

/// One `APPENDS`/`SETITEMS` worth of items of a [`Chain`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Batch {
    pub items: Span,
    pub next: u32,
}

/// One object of the pickle. Kept at 16 bytes (asserted below): this is the per-object cost.
/// Numbers are stored as little-endian bytes so that no field needs 8-byte alignment, which leaves
/// room for each container's [`Origin`].
#[derive(Clone, Copy, Debug)]
pub(super) enum Node {
    None,
    Bool(bool),
    Int([u8; 8]),
    /// An int outside i64: the pickle's little-endian two's complement bytes.
    BigInt(Span),
    Float([u8; 8]),
    /// UTF-8, or UTF-8 with lone surrogates (as Python's `surrogatepass`), checked when read.
    Str(Span),
    Bytes(Span),
    /// Index into [`Graph::globals`].
    Global(u32),
    Tuple(Span, Origin),
    List(Chain, Origin),
    /// Keys and values alternate in the chain's batches.
    Dict(Chain, Origin),
    Set(Chain, Origin),
    /// Index into [`Graph::objects`].
    Object(u32, Origin),
    PersistentId(Id, Origin),
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Node>() == 16);

/// The fields of an [`Object`], as ids.
#[derive(Clone, Copy, Debug)]
pub(super) struct ObjectNode {
    pub callable: Id,
    /// The argument tuple.
    pub args: Id,
    /// [`NONE`] until `BUILD`.
    pub state: Id,
    /// Index into [`Graph::object_items`], or [`NONE`]: only an `OrderedDict` (or a list
    /// subclass) receives items, so most objects do not pay for two empty chains.
    pub items: u32,
    pub new_obj: bool,
}

/// What `SETITEMS` and `APPENDS` put into an object.
#[derive(Clone, Copy, Debug)]
pub(super) struct ObjectItems {
    pub dict: Chain,
    pub list: Chain,
}

/// An unpickled object graph, borrowing the pickle's bytes.
#[derive(Debug)]
pub struct Graph<'a> {
    pub(super) input: &'a [u8],
    pub(super) nodes: Vec<Node>,
    /// Child ids of every tuple and every batch.
    pub(super) pool: Vec<Id>,
    pub(super) batches: Vec<Batch>,
    pub(super) objects: Vec<ObjectNode>,
    pub(super) object_items: Vec<ObjectItems>,
    /// Each distinct global once.
    pub(super) globals: Vec<Global>,
    pub(super) root: Id,
    /// Bytes of the input up to and including `STOP`.
    pub(super) end: usize,
}

/// What a node is, for callers that describe unexpected input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    None,
    Bool,
    Int,
    /// An int outside i64 ([`NodeRef::as_int`] gives `None`).
    BigInt,
    Float,
    Str,
    Bytes,
    Tuple,
    List,
    Dict,
    Set,
    Global,
    Object,
    PersistentId,
}

/// Per-node result of [`Graph::validate`]: expanded size and height. `size == 0` means not yet
/// measured (every node counts at least one); `height == ON_PATH` marks the nodes on the path from
/// the root to the one being measured, so reaching one again is a cycle.
#[derive(Clone, Copy, Default)]
struct Measure {
    size: u32,
    height: u32,
}

const ON_PATH: u32 = u32::MAX;

impl<'a> Graph<'a> {
    pub(super) fn new(input: &'a [u8]) -> Self {
        Graph {
            input,
            nodes: Vec::new(),
            pool: Vec::new(),
            batches: Vec::new(),
            objects: Vec::new(),
            object_items: Vec::new(),
            globals: Vec::new(),
            root: NONE,
            end: 0,
        }
    }

    /// How many bytes of the input the pickle took, up to and including its `STOP`: where a
    /// next pickle written after it (as legacy torch.save writes several) starts.
    pub fn end(&self) -> usize {
        self.end
    }

    /// The object the pickle returned.
    pub fn root(&self) -> NodeRef<'_> {
        NodeRef {
            graph: self,
            id: self.root,
        }
    }

    pub(super) fn node(&self, id: Id) -> Node {
        if id & SMALL_INT != 0 && id != NONE {
            return Node::Int(i64::from(id & !SMALL_INT).to_le_bytes());
        }
        // Every other id in the graph was handed out by the reader for a node it pushed, so this
        // never falls back; `None` keeps a mistake from panicking.
        self.nodes.get(id as usize).copied().unwrap_or(Node::None)
    }

    fn origin(&self, id: Id) -> usize {
        match self.node(id) {
            Node::Tuple(_, at)
            | Node::List(_, at)
            | Node::Dict(_, at)
            | Node::Set(_, at)
            | Node::Object(_, at)
            | Node::PersistentId(_, at) => at as usize,
            _ => 0,
        }
    }

    pub(super) fn object(&self, id: Id) -> Option<&ObjectNode> {
        match self.node(id) {
            Node::Object(i, _) => self.objects.get(i as usize),
            _ => None,
        }
    }

    /// The items of a tuple node (empty for anything else).
    fn tuple_items(&self, id: Id) -> Items<'_> {
        match self.node(id) {
            Node::Tuple(span, _) => self.items(span, NONE),
            _ => self.items(Span::EMPTY, NONE),
        }
    }

    /// The dict and list items of an object.
    fn object_items(&self, o: &ObjectNode) -> ObjectItems {
        self.object_items
            .get(o.items as usize)
            .copied()
            .unwrap_or(ObjectItems {
                dict: Chain::EMPTY,
                list: Chain::EMPTY,
            })
    }

    fn bytes(&self, span: Span) -> &'a [u8] {
        self.input.get(span.range()).unwrap_or_default()
    }

    fn items(&self, span: Span, next: u32) -> Items<'_> {
        Items {
            graph: self,
            at: span.range(),
            next,
        }
    }

    fn chain(&self, chain: Chain) -> Items<'_> {
        self.items(Span::EMPTY, chain.head)
    }

    /// Call `f` on each id a node refers to.
    fn for_each_child(
        &self,
        id: Id,
        f: &mut dyn FnMut(Id) -> Result<(), PickleError>,
    ) -> Result<(), PickleError> {
        let items = match self.node(id) {
            Node::Tuple(span, _) => self.items(span, NONE),
            Node::List(c, _) | Node::Dict(c, _) | Node::Set(c, _) => self.chain(c),
            Node::Object(i, _) => {
                let Some(o) = self.objects.get(i as usize) else {
                    return Ok(());
                };
                for single in [o.callable, o.state] {
                    if single != NONE {
                        f(single)?;
                    }
                }
                // The arguments count as the object's own children, as in [`Object::args`].
                let items = self.object_items(o);
                for items in [
                    self.tuple_items(o.args),
                    self.chain(items.dict),
                    self.chain(items.list),
                ] {
                    items.map(|v| v.id).try_for_each(&mut *f)?;
                }
                return Ok(());
            }
            Node::PersistentId(pid, _) => return f(pid),
            _ => return Ok(()),
        };
        items.map(|v| v.id).try_for_each(f)
    }

    pub(super) fn view(&self, id: Id) -> NodeRef<'_> {
        NodeRef { graph: self, id }
    }

    /// Check the graph under the root against `limits` (see the module docs); `Ok` means every
    /// walk of [`Graph::root`] is finite and bounded.
    pub(super) fn validate(&self, limits: Limits) -> Result<(), PickleError> {
        let mut measured = vec![Measure::default(); self.nodes.len()];
        // Sizes are kept in 32 bits: a subtree over the limit is refused as soon as it is seen.
        let max_nodes = limits.max_nodes.min(u32::MAX as usize - 1) as u64;
        self.measure(&mut measured, self.root, 0, limits.max_depth, max_nodes)?;
        Ok(())
    }

    /// Size and height of the subtree at `id`, which sits at nesting `depth`.
    fn measure(
        &self,
        measured: &mut [Measure],
        id: Id,
        depth: usize,
        max_depth: usize,
        max_nodes: u64,
    ) -> Result<Measure, PickleError> {
        let at = self.origin(id);
        let too_deep = || limit(at, format!("containers nested deeper than {max_depth}"));
        let too_big = || {
            limit(
                at,
                format!(
                    "the pickle expands to more than {max_nodes} nodes once shared references are copied"
                ),
            )
        };
        let own = match self.node(id) {
            Node::Str(s) | Node::Bytes(s) | Node::BigInt(s) => {
                return Ok(leaf(1 + u64::from(s.len) / 64))
            }
            Node::None | Node::Bool(_) | Node::Int(_) | Node::Float(_) | Node::Global(_) => {
                return Ok(leaf(1))
            }
            _ => 1u64,
        };
        let slot = measured
            .get(id as usize)
            .copied()
            .ok_or_else(|| malformed(at, "dangling node"))?;
        if slot.height == ON_PATH {
            return Err(malformed(at, "a container contains itself"));
        }
        if slot.size != 0 {
            if depth.saturating_add(slot.height as usize) > max_depth {
                return Err(too_deep());
            }
            return Ok(slot);
        }
        if depth >= max_depth {
            return Err(too_deep());
        }
        set(
            measured,
            id,
            Measure {
                size: 0,
                height: ON_PATH,
            },
        );
        let (mut size, mut height) = (own, 1u32);
        self.for_each_child(id, &mut |child| {
            let m = self.measure(measured, child, depth + 1, max_depth, max_nodes)?;
            size = size.saturating_add(u64::from(m.size));
            height = height.max(m.height.saturating_add(1));
            if size > max_nodes {
                return Err(too_big());
            }
            Ok(())
        })?;
        // `size <= max_nodes < u32::MAX` here.
        let m = Measure {
            size: u32::try_from(size).map_err(|_| too_big())?,
            height,
        };
        set(measured, id, m);
        Ok(m)
    }
}

fn leaf(size: u64) -> Measure {
    Measure {
        size: u32::try_from(size).unwrap_or(u32::MAX),
        height: 0,
    }
}

fn set(measured: &mut [Measure], id: Id, m: Measure) {
    if let Some(slot) = measured.get_mut(id as usize) {
        *slot = m;
    }
}

/// A node of a validated [`Graph`], read in place.
#[derive(Clone, Copy)]
pub struct NodeRef<'g> {
    graph: &'g Graph<'g>,
    id: Id,
}

impl std::fmt::Debug for NodeRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeRef({:?})", self.kind())
    }
}

/// The items of a tuple, list, set or dict (keys and values alternating), as views.
#[derive(Clone)]
pub struct Items<'g> {
    graph: &'g Graph<'g>,
    /// What is left of the current batch, as pool indices.
    at: std::ops::Range<usize>,
    /// The next batch, or [`NONE`].
    next: u32,
}

impl<'g> Iterator for Items<'g> {
    type Item = NodeRef<'g>;

    fn next(&mut self) -> Option<NodeRef<'g>> {
        loop {
            if let Some(i) = self.at.next() {
                let id = *self.graph.pool.get(i)?;
                return Some(self.graph.view(id));
            }
            let batch = self.graph.batches.get(self.next as usize)?;
            self.at = batch.items.range();
            self.next = batch.next;
        }
    }
}

impl<'g> NodeRef<'g> {
    fn node(&self) -> Node {
        self.graph.node(self.id)
    }

    fn object(&self) -> Option<&'g ObjectNode> {
        self.graph.object(self.id)
    }

    fn at(&self, id: Id) -> Option<NodeRef<'g>> {
        (id != NONE).then(|| self.graph.view(id))
    }

    /// The node's identity: two views of one node have the same id. Ids of nodes a consumed
    /// batch made are given to later nodes (see [`crate::pickle::Consumer`]).
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn kind(&self) -> Kind {
        match self.node() {
            Node::None => Kind::None,
            Node::Bool(_) => Kind::Bool,
            Node::Int(_) => Kind::Int,
            Node::BigInt(_) => Kind::BigInt,
            Node::Float(_) => Kind::Float,
            Node::Str(_) => Kind::Str,
            Node::Bytes(_) => Kind::Bytes,
            Node::Global(_) => Kind::Global,
            Node::Tuple(..) => Kind::Tuple,
            Node::List(..) => Kind::List,
            Node::Dict(..) => Kind::Dict,
            Node::Set(..) => Kind::Set,
            Node::Object(..) => Kind::Object,
            Node::PersistentId(..) => Kind::PersistentId,
        }
    }

    pub fn is_none(&self) -> bool {
        matches!(self.node(), Node::None)
    }

    /// The text of a string, borrowed from the pickle bytes; `None` for one holding lone
    /// surrogates, which Rust's `str` cannot.
    pub fn as_str(&self) -> Option<&'g str> {
        match self.node() {
            Node::Str(s) => std::str::from_utf8(self.graph.bytes(s)).ok(),
            _ => None,
        }
    }

    pub fn as_bytes(&self) -> Option<&'g [u8]> {
        match self.node() {
            Node::Bytes(s) => Some(self.graph.bytes(s)),
            _ => None,
        }
    }

    /// An int, or a bool as 0/1 (as Python's `int(True)`).
    pub fn as_int(&self) -> Option<i64> {
        match self.node() {
            Node::Int(i) => Some(i64::from_le_bytes(i)),
            Node::Bool(b) => Some(i64::from(b)),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self.node() {
            Node::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// `(module, name)` if this is a global.
    pub fn as_global(&self) -> Option<(&'g str, &'g str)> {
        match self.node() {
            Node::Global(i) => self
                .graph
                .globals
                .get(i as usize)
                .map(|g| (g.module.as_str(), g.name.as_str())),
            _ => None,
        }
    }

    /// Items of a tuple or list.
    pub fn as_seq(&self) -> Option<Items<'g>> {
        match self.node() {
            Node::Tuple(span, _) => Some(self.graph.items(span, NONE)),
            Node::List(chain, _) => Some(self.graph.chain(chain)),
            _ => None,
        }
    }

    /// Pairs of a dict, with Python's rule for a repeated key (first position, last value).
    pub fn dict_items(&self) -> Option<Vec<(NodeRef<'g>, NodeRef<'g>)>> {
        match self.node() {
            Node::Dict(chain, _) => Some(dedup_pairs(self.graph.chain(chain))),
            _ => None,
        }
    }

    /// Look up a string key in a dict (the last value pickled for it, as Python keeps).
    pub fn get(&self, key: &str) -> Option<NodeRef<'g>> {
        let Node::Dict(chain, _) = self.node() else {
            return None;
        };
        let mut items = self.graph.chain(chain);
        let mut found = None;
        while let (Some(k), Some(v)) = (items.next(), items.next()) {
            if k.as_str() == Some(key) {
                found = Some(v);
            }
        }
        found
    }

    /// `(module, name)` of the class or function that made this object (`REDUCE`/`NEWOBJ`).
    pub fn class(&self) -> Option<(&'g str, &'g str)> {
        self.at(self.object()?.callable)?.as_global()
    }

    /// The state `BUILD` gave this object.
    pub fn state(&self) -> Option<NodeRef<'g>> {
        self.at(self.object()?.state)
    }

    /// Arguments of the call that made this object.
    pub fn args(&self) -> Option<Items<'g>> {
        Some(self.graph.tuple_items(self.object()?.args))
    }

    /// Items `SETITEMS` put into this object (an `OrderedDict`), as [`NodeRef::dict_items`] gives.
    pub fn object_dict_items(&self) -> Option<Vec<(NodeRef<'g>, NodeRef<'g>)>> {
        let items = self.graph.object_items(self.object()?);
        Some(dedup_pairs(self.graph.chain(items.dict)))
    }

    /// An owned copy of the subtree: a node reached twice is copied twice (validation has
    /// bounded the total).
    pub fn to_value(&self) -> Value {
        let g = self.graph;
        let all = |items: Items<'g>| all_of(items);
        let pairs = |pairs: Vec<(NodeRef<'g>, NodeRef<'g>)>| {
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_value(), v.to_value()))
                .collect()
        };
        match self.node() {
            Node::None => Value::None,
            Node::Bool(b) => Value::Bool(b),
            Node::Int(i) => Value::Int(i64::from_le_bytes(i)),
            Node::Float(f) => Value::Float(f64::from_le_bytes(f)),
            Node::BigInt(s) => Value::BigInt(shortest_twos_complement(g.bytes(s))),
            Node::Str(s) => match self.as_str() {
                Some(text) => Value::Str(text.to_string()),
                None => Value::SurrogateStr(g.bytes(s).to_vec()),
            },
            Node::Bytes(s) => Value::Bytes(g.bytes(s).to_vec()),
            Node::Global(i) => match g.globals.get(i as usize) {
                Some(global) => Value::Global(Box::new(global.clone())),
                None => Value::None,
            },
            Node::Tuple(span, _) => Value::Tuple(all(g.items(span, NONE))),
            Node::List(chain, _) => Value::List(all(g.chain(chain))),
            Node::Set(chain, _) => Value::Set(all_of(dedup_set(g.chain(chain)))),
            Node::Dict(chain, _) => Value::Dict(pairs(dedup_pairs(g.chain(chain)))),
            Node::Object(..) => {
                let Some(o) = self.object() else {
                    return Value::None;
                };
                let items = g.object_items(o);
                Value::Object(Box::new(Object {
                    callable: self.at(o.callable).map_or(Value::None, |c| c.to_value()),
                    args: all(g.tuple_items(o.args)),
                    new_obj: o.new_obj,
                    dict_items: pairs(dedup_pairs(g.chain(items.dict))),
                    list_items: all(g.chain(items.list)),
                    state: self.at(o.state).map(|s| s.to_value()),
                }))
            }
            Node::PersistentId(pid, _) => Value::PersistentId(Box::new(g.view(pid).to_value())),
        }
    }
}

/// `bytes` (little-endian two's complement) without the high bytes that only repeat the sign.
pub(super) fn shortest_twos_complement(bytes: &[u8]) -> Vec<u8> {
    let mut n = bytes.len();
    while n > 1 {
        let (last, prev) = (bytes[n - 1], bytes[n - 2]);
        let redundant = (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
        if !redundant {
            break;
        }
        n -= 1;
    }
    bytes[..n].to_vec()
}

fn all_of<'g>(items: impl IntoIterator<Item = NodeRef<'g>>) -> Vec<Value> {
    items.into_iter().map(|v| v.to_value()).collect()
}

/// A dict or set key whose equality ckpt can decide the way Python would.
#[derive(PartialEq, Eq, Hash)]
enum SimpleKey<'g> {
    None,
    Int(i64),
    BigInt(Vec<u8>),
    Str(&'g [u8]),
    Bytes(&'g [u8]),
}

fn simple_key<'g>(v: &NodeRef<'g>) -> Option<SimpleKey<'g>> {
    match v.node() {
        Node::None => Some(SimpleKey::None),
        // In Python `True == 1`, so they are the same key.
        Node::Bool(b) => Some(SimpleKey::Int(i64::from(b))),
        Node::Int(i) => Some(SimpleKey::Int(i64::from_le_bytes(i))),
        Node::BigInt(s) => Some(SimpleKey::BigInt(shortest_twos_complement(
            v.graph.bytes(s),
        ))),
        Node::Str(s) => Some(SimpleKey::Str(v.graph.bytes(s))),
        Node::Bytes(s) => Some(SimpleKey::Bytes(v.graph.bytes(s))),
        _ => None,
    }
}

/// Pair up a dict's alternating keys and values, then apply [`dedup_pairs_of`].
fn dedup_pairs<'g>(mut items: Items<'g>) -> Vec<(NodeRef<'g>, NodeRef<'g>)> {
    let pairs = std::iter::from_fn(move || Some((items.next()?, items.next()?)));
    dedup_pairs_of(pairs)
}

/// Python dict semantics for repeated simple keys: the first position, the last value. Other keys
/// (objects, tuples) are kept as pickled.
fn dedup_pairs_of<'g>(
    pairs: impl Iterator<Item = (NodeRef<'g>, NodeRef<'g>)>,
) -> Vec<(NodeRef<'g>, NodeRef<'g>)> {
    let mut out: Vec<(NodeRef<'g>, NodeRef<'g>)> = Vec::new();
    let mut seen: HashMap<SimpleKey<'g>, usize> = HashMap::new();
    for (k, v) in pairs {
        if let Some(key) = simple_key(&k) {
            if let Some(slot) = seen.get(&key).and_then(|&i| out.get_mut(i)) {
                slot.1 = v;
                continue;
            }
            seen.insert(key, out.len());
        }
        out.push((k, v));
    }
    out
}

/// Python set semantics for repeated simple items: the first is kept.
fn dedup_set(items: Items<'_>) -> Vec<NodeRef<'_>> {
    let mut seen = std::collections::HashSet::new();
    items
        .filter(|v| simple_key(v).is_none_or(|key| seen.insert(key)))
        .collect()
}
