//! A data-only pickle reader and writer.
//!
//! Checkpoints carry Python pickles (`.metadata`, `data.pkl`). Unpickling them with Python would run
//! whatever the file asks for, so ckpt never does: the reader turns opcodes into an object graph in
//! which a global is only a name and a call (`REDUCE`, `NEWOBJ`, `BUILD`) is only a record of what
//! would have been called. A global is accepted only when the caller's [`Globals`] policy names it;
//! any other is an error naming it. Format modules then read meaning out of it: [`parse`] gives a
//! compact [`Graph`] read in place through a [`NodeRef`] (what DCP's `.metadata`, which can hold
//! millions of objects, uses), and [`read`] an owned [`Value`] tree (for small pickles and tests).
//! Writing likewise takes a [`Value`] tree ([`write()`]) or, for pickles too large to hold as one,
//! items described one at a time to a [`Stream`] ([`write_with`]).

mod graph;
pub(crate) mod opcodes;
mod read;
mod scan;
mod write;

pub use graph::{Graph, Items, Kind, NodeRef};
pub use read::{parse, parse_consuming, read, Consumer};
pub use write::{write, write_to, write_with, Protocol, Stream};

// A `Value` is built per pickled item, so its size is most of a big tree's memory.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Value>() <= 32);

/// One node of an unpickled object graph, with nothing executed.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    /// Integers that fit in an i64.
    Int(i64),
    /// An integer outside i64 (torch.save keeps Python ints of any size among plain data): its
    /// shortest little-endian two's complement bytes, as `LONG1` carries them.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    /// A str holding lone surrogates, which a Rust `String` cannot: its bytes as pickled, UTF-8
    /// with each surrogate as three bytes (what Python's `surrogatepass` reads and writes).
    SurrogateStr(Vec<u8>),
    Bytes(Vec<u8>),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    /// Key order is kept as pickled.
    Dict(Vec<(Value, Value)>),
    Set(Vec<Value>),
    /// A module attribute, `module.name` (e.g. `torch.float32`, or a class). Boxed, like
    /// [`Value::Object`], to keep every `Value` small.
    Global(Box<Global>),
    /// An object made by a call that ckpt records but never runs; see [`Object`]. Boxed so that
    /// this rare variant does not make every `Value` (most are strings, ints and tuples) as large
    /// as its six fields: that keeps big trees, such as a DCP `.metadata` with 10^5 tensor pieces,
    /// small in memory.
    Object(Box<Object>),
    /// A persistent id (BINPERSID), e.g. torch.save's storage reference tuple.
    PersistentId(Box<Value>),
}

/// An object made by a call that ckpt records but never runs: `callable(*args)` (REDUCE) or
/// `cls.__new__(cls, *args)` (NEWOBJ), then any items SETITEM(S)/APPEND(S) put into it (an
/// `OrderedDict`), then the state BUILD gave it (a dataclass's `__dict__`, a `__setstate__` tuple).
#[derive(Clone, Debug, PartialEq)]
pub struct Object {
    pub callable: Value,
    pub args: Vec<Value>,
    pub new_obj: bool,
    pub dict_items: Vec<(Value, Value)>,
    pub list_items: Vec<Value>,
    pub state: Option<Value>,
}

/// A module attribute, `module.name`.
#[derive(Clone, Debug, PartialEq)]
pub struct Global {
    pub module: String,
    pub name: String,
}

/// Which globals a pickle may name. Anything else is refused with an error naming it.
pub trait Globals {
    fn allows(&self, module: &str, name: &str) -> bool;
    /// Whether the pickle may hold persistent ids (`BINPERSID`): torch.save's storages are
    /// persistent ids, but a plain `pickle.load` (DCP's `.metadata`) has no `persistent_load` and
    /// refuses any.
    fn allows_persistent_ids(&self) -> bool {
        true
    }
    /// Whether what `module.name` makes (an instance of the class, or what the callable returns)
    /// is unhashable in Python, e.g. a dataclass with `eq` and without `frozen`: such an object
    /// as a dict key or set item is refused as Python refuses it.
    fn unhashable(&self, _module: &str, _name: &str) -> bool {
        false
    }
}

/// A fixed list of `(module, name)` pairs.
impl Globals for &[(&str, &str)] {
    fn allows(&self, module: &str, name: &str) -> bool {
        self.iter().any(|&(m, n)| m == module && n == name)
    }
}

/// Safety bounds on what one pickle may build.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most values on the stack (and in marks) at once.
    pub max_stack: usize,
    /// Most memo entries.
    pub max_memo: usize,
    /// Most nodes: both those the pickle makes and the total it expands to, counting those copied
    /// by memo gets. A string or bytes value also costs one node per 64 bytes, so many references
    /// to one large string are bounded too. (Small non-negative ints and the empty tuple take no
    /// node of their own, so they count only in the expanded total.)
    pub max_nodes: usize,
    /// Deepest nesting of containers. This also bounds the recursion of any walk of the graph.
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

/// Errors from reading a pickle; offsets are byte positions in the pickle stream.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PickleError {
    #[error("pickle refers to `{module}.{name}`, which ckpt does not allow (it never runs code from a checkpoint)")]
    ForbiddenGlobal { module: String, name: String },
    #[error("unsupported pickle opcode 0x{opcode:02x} at byte {offset}")]
    UnsupportedOpcode { opcode: u8, offset: usize },
    #[error("pickle ends early at byte {offset}")]
    Truncated { offset: usize },
    #[error("malformed pickle at byte {offset}: {reason}")]
    Malformed { offset: usize, reason: String },
    #[error("pickle exceeds a safety limit at byte {offset}: {reason}")]
    LimitExceeded { offset: usize, reason: String },
    /// A [`Consumer`] refused a batch; it holds the reason.
    #[error("pickle reading stopped at byte {offset}")]
    Stopped { offset: usize },
}

impl PickleError {
    /// Byte offset in the pickle stream the error concerns, when it has one.
    pub fn offset(&self) -> Option<usize> {
        match self {
            PickleError::ForbiddenGlobal { .. } => None,
            PickleError::UnsupportedOpcode { offset, .. }
            | PickleError::Truncated { offset }
            | PickleError::Malformed { offset, .. }
            | PickleError::LimitExceeded { offset, .. }
            | PickleError::Stopped { offset } => Some(*offset),
        }
    }
}

impl Value {
    /// This value with `f` applied to each value it holds directly: the items of a tuple, list or
    /// set, a dict's keys and values, and an object's arguments, items and state (not its callable,
    /// nor what a persistent id holds). A rewrite of a whole tree is an `f` that recurses.
    pub fn map_children(self, f: &mut dyn FnMut(Value) -> Value) -> Value {
        fn each(items: Vec<Value>, f: &mut dyn FnMut(Value) -> Value) -> Vec<Value> {
            items.into_iter().map(f).collect()
        }
        fn pairs(
            items: Vec<(Value, Value)>,
            f: &mut dyn FnMut(Value) -> Value,
        ) -> Vec<(Value, Value)> {
            items.into_iter().map(|(k, v)| (f(k), f(v))).collect()
        }
        match self {
            Value::Tuple(items) => Value::Tuple(each(items, f)),
            Value::List(items) => Value::List(each(items, f)),
            Value::Set(items) => Value::Set(each(items, f)),
            Value::Dict(items) => Value::Dict(pairs(items, f)),
            Value::Object(object) => {
                let Object {
                    callable,
                    args,
                    new_obj,
                    dict_items,
                    list_items,
                    state,
                } = *object;
                Value::Object(Box::new(Object {
                    callable,
                    args: each(args, f),
                    new_obj,
                    dict_items: pairs(dict_items, f),
                    list_items: each(list_items, f),
                    state: state.map(f),
                }))
            }
            other => other,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    /// Items of a tuple or list.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// A `torch.Size` (or, leniently, a tuple or list) of non-negative ints: a shape as pickled.
    pub fn as_sizes(&self) -> Option<Vec<u64>> {
        let dims = match self {
            Value::Object(o) if o.callable.as_global() == Some(("torch", "Size")) => {
                match o.args.as_slice() {
                    [] => return Some(Vec::new()),
                    [Value::Tuple(d) | Value::List(d)] => d,
                    _ => return None,
                }
            }
            Value::Tuple(d) | Value::List(d) => d,
            _ => return None,
        };
        dims.iter()
            .map(|d| d.as_int().and_then(|i| u64::try_from(i).ok()))
            .collect()
    }

    /// Look up a string key in a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// `(module, name)` if this is a global.
    pub fn as_global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global(global) => Some((&global.module, &global.name)),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// Pairs of a dict, in pickled order.
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(items) => Some(items),
            _ => None,
        }
    }

    /// `(module, name)` of the class or function that made this object (`REDUCE`/`NEWOBJ`).
    pub fn class(&self) -> Option<(&str, &str)> {
        match self {
            Value::Object(object) => object.callable.as_global(),
            _ => None,
        }
    }

    /// The state `BUILD` gave this object.
    pub fn state(&self) -> Option<&Value> {
        match self {
            Value::Object(object) => object.state.as_ref(),
            _ => None,
        }
    }

    /// Arguments of the call that made this object.
    pub fn args(&self) -> Option<&[Value]> {
        match self {
            Value::Object(object) => Some(&object.args),
            _ => None,
        }
    }

    /// `module.name(*args)`, as `REDUCE` records it.
    pub fn reduce(module: &str, name: &str, args: Vec<Value>) -> Value {
        Value::Object(Box::new(Object {
            callable: Value::global(module, name),
            args,
            new_obj: false,
            dict_items: Vec::new(),
            list_items: Vec::new(),
            state: None,
        }))
    }

    pub fn global(module: &str, name: &str) -> Value {
        Value::Global(Box::new(Global {
            module: module.to_string(),
            name: name.to_string(),
        }))
    }
}

impl Value {
    /// Plain data as JSON; anything else (a recorded call) as a short description.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::None => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            // Beyond what a JSON number reliably holds; kept out rather than rounded.
            Value::BigInt(_) => J::Null,
            Value::SurrogateStr(b) => J::String(String::from_utf8_lossy(b).into_owned()),
            Value::Float(f) => {
                serde_json::Number::from_f64(*f).map_or_else(|| J::String(f.to_string()), J::Number)
            }
            Value::Str(s) => J::String(s.clone()),
            Value::Bytes(b) => J::String(format!("<{} bytes>", b.len())),
            Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
                J::Array(items.iter().map(Value::to_json).collect())
            }
            Value::Dict(items) => J::Object(
                items
                    .iter()
                    .map(|(k, v)| (key_string(k), v.to_json()))
                    .collect(),
            ),
            Value::Global(g) => J::String(format!("{}.{}", g.module, g.name)),
            Value::Object(object)
                if !object.dict_items.is_empty() || is_ordered_dict(&object.callable) =>
            {
                J::Object(
                    object
                        .dict_items
                        .iter()
                        .map(|(k, v)| (key_string(k), v.to_json()))
                        .collect(),
                )
            }
            Value::Object(object) => {
                J::String(format!("<object {}>", key_string(&object.callable)))
            }
            Value::PersistentId(_) => J::String("<persistent id>".into()),
        }
    }
}

fn is_ordered_dict(v: &Value) -> bool {
    v.as_global() == Some(("collections", "OrderedDict"))
}

fn key_string(k: &Value) -> String {
    match k {
        Value::Str(s) => s.clone(),
        Value::Global(g) => format!("{}.{}", g.module, g.name),
        other => other.to_json().to_string(),
    }
}
