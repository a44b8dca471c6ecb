//! PyTorch Distributed Checkpoint directories.

pub mod hf;
pub mod metadata;
