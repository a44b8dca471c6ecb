//! Readers and writers of each on-disk layout.
//!
//! Readers produce a [`crate::model::Checkpoint`]; writers own only headers and framing (the bytes
//! around tensor data), which the planner places and the executor writes. Every layout ckpt reads
//! is one entry of [`LAYOUTS`].

pub(crate) mod codec;
pub mod dcp;
pub(crate) mod deepspeed;
pub(crate) mod hf_index;
pub(crate) mod megatron;
pub(crate) mod per_rank;
pub mod safetensors;
pub mod torch_save;

use crate::layout::Layout;

/// Every layout ckpt reads, in the order detection asks them: a layout that is another one with
/// more beside it comes before that one (Megatron's directory is a DCP directory plus
/// `metadata.json`; a rank's torch.save file is a torch.save file holding DTensors), and the
/// layouts that recognise a directory by one file it holds come before those that settle for any
/// file of a kind.
pub static LAYOUTS: &[&dyn Layout] = &[
    &megatron::Megatron,
    &deepspeed::DeepSpeed,
    &dcp::Dcp,
    &hf_index::HfIndex,
    &dcp::hf::DcpHf,
    &per_rank::PerRank,
    &safetensors::Safetensors,
    &torch_save::TorchSave,
];
