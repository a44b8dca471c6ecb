//! Readers and writers of each on-disk layout.
//!
//! Readers produce a [`crate::model::Checkpoint`]; writers own only headers and framing (the bytes
//! around tensor data), which the planner places and the executor writes.

pub mod dcp;
pub mod fsdp_local;
pub mod hf_index;
pub mod megatron;
pub mod per_rank;
pub mod safetensors;
pub mod torch_save;
pub mod zip;
