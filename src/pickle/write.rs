//! Pickle writer: a [`Value`] tree to bytes Python's `pickle.load` reads back.
use super::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// What torch.save uses for `data.pkl`.
    V2,
    /// What DCP uses for `.metadata`.
    V4,
}

pub fn write(_value: &Value, _protocol: Protocol) -> Vec<u8> {
    todo!("pickle writer")
}
