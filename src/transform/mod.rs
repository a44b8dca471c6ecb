//! The steps between reading and planning. Each takes the checkpoint a reader produced (or the
//! step before it left) and gives back another, adding to the [`Report`] what it has to say or
//! to write beside the tensors. Steps change names, views and computations of tensors, never
//! bytes: a computed tensor's elements are made as the executor copies them.
//!
//! In the order a conversion runs them: [`fsdp_local`] (an FSDP1 LOCAL checkpoint's flat
//! parameters as the model's tensors, with `--shapes-from`), [`lora`] (`--merge-lora`),
//! [`select`] (`--include`, `--exclude`, `--strip-prefix`), and [`hf_export`] (`--hf-config`:
//! the Hugging Face architecture's names and layouts, its linear weights quantized by [`fp8`]
//! with `--quantize fp8-block`).

pub(crate) mod fp8;
pub(crate) mod fsdp_local;
pub(crate) mod hf_export;
pub(crate) mod lora;
pub(crate) mod select;

use std::path::PathBuf;

use crate::error::Result;
use crate::model::Checkpoint;

/// A step between reading and planning.
pub(crate) trait Step {
    /// `ckpt` transformed, with what the step has to report added to `report`.
    fn apply(&self, ckpt: Checkpoint, report: &mut Report) -> Result<Checkpoint>;
}

/// What the steps of a conversion report beside the checkpoint they give back.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Things the user should hear about (what an export left out).
    pub notes: Vec<String>,
    /// Files the output holds beside the tensors, by path relative to its root (an export's
    /// config.json and tokenizer files).
    pub files: Vec<(PathBuf, Vec<u8>)>,
}

/// `ckpt` through every step of `steps`, in order.
pub(crate) fn run(
    steps: &[Box<dyn Step + '_>],
    ckpt: Checkpoint,
    report: &mut Report,
) -> Result<Checkpoint> {
    steps
        .iter()
        .try_fold(ckpt, |ckpt, step| step.apply(ckpt, report))
}
