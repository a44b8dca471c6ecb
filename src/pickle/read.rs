//! Pickle reader: opcodes to a [`Value`] tree, executing nothing.
use super::{Globals, PickleError, Value};

/// Safety bounds on what one pickle may build.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most values on the stack (and in marks) at once.
    pub max_stack: usize,
    /// Most memo entries.
    pub max_memo: usize,
    /// Most nodes in total, counting those copied by memo gets.
    pub max_nodes: usize,
    /// Deepest nesting of containers.
    pub max_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_stack: 1 << 20, max_memo: 1 << 20, max_nodes: 1 << 24, max_depth: 256 }
    }
}

/// Read one pickle (protocols 0-5 opcodes as used by torch and DCP) into a value tree.
pub fn read(_bytes: &[u8], _globals: &dyn Globals, _limits: Limits) -> Result<Value, PickleError> {
    todo!("pickle reader")
}
