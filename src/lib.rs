//! ckpt: convert PyTorch checkpoints between FULL and SHARDED state-dict layouts without torch.
//!
//! The data flows one way: **read → plan → execute**. Readers ([`formats`]) turn any on-disk layout
//! into one [`model::Checkpoint`]; the planner ([`plan`]) turns a checkpoint and a target layout
//! into a pure [`plan::Plan`] of destination files and copies; the executor ([`exec`]) runs it.

pub mod dtype;
pub mod error;
pub mod formats;
pub mod model;
pub mod pickle;

pub use error::{Error, ErrorKind, Result};
