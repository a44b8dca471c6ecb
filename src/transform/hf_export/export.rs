//! The export as one step ([`Export`]): the checkpoint mapped onto the Hugging Face
//! architecture's names and layouts ([`super::map`], [`super::apply`]), its linear weights
//! quantized with `--quantize fp8-block` ([`crate::transform::fp8`]), and the model directory's
//! other files (config.json naming the dtype written and the quantization, the tokenizer's
//! files) reported for the output to hold beside the tensors.

use std::path::PathBuf;

use super::config::CONFIG_JSON;
use super::{HfConfig, Mapping};
use crate::dtype::DType;
use crate::error::Result;
use crate::exec::IoMode;
use crate::model::Checkpoint;
use crate::transform::{fp8, Report, Step};

/// `--hf-config`, and `--quantize fp8-block` on its linear weights.
pub(crate) struct Export {
    pub cfg: HfConfig,
    /// `--dtype`: what config.json names, and the values FP8 quantizes.
    pub cast: Option<DType>,
    /// `--quantize fp8-block`.
    pub fp8_block: bool,
    /// How bands of a weight are read again for their scales.
    pub io: IoMode,
}

impl Step for Export {
    fn apply(&self, ckpt: Checkpoint, report: &mut Report) -> Result<Checkpoint> {
        let mapping = super::map(&ckpt, &self.cfg)?;
        let ckpt = super::apply(ckpt, &self.cfg, &mapping)?;
        let (ckpt, quantization) = self.quantize(ckpt, &mapping)?;
        let dtype = self.cast.unwrap_or_else(|| model_dtype(&ckpt));
        report.files.push((
            PathBuf::from(CONFIG_JSON),
            self.cfg.json_with(dtype, quantization),
        ));
        for (name, bytes) in self.cfg.companion_files()? {
            report.files.push((PathBuf::from(name), bytes));
        }
        report.notes.extend(left_out_note(&mapping));
        Ok(ckpt)
    }
}

impl Export {
    /// `--quantize fp8-block`: the export's linear weights as FP8 with their scales, and what
    /// config.json's `quantization_config` says of it.
    fn quantize(
        &self,
        ckpt: Checkpoint,
        mapping: &Mapping,
    ) -> Result<(Checkpoint, Option<serde_json::Value>)> {
        if !self.fp8_block {
            return Ok((ckpt, None));
        }
        let linear = mapping
            .placed
            .iter()
            .filter(|p| p.linear)
            .map(|p| p.target.clone())
            .collect();
        let (ckpt, q) = fp8::apply(ckpt, &linear, self.cast, self.io)?;
        let mut kept = q.not_converted;
        // A head tied to the embedding is still a linear module of transformers' model, which
        // must not be made an FP8 one.
        if self.cfg.tied && !kept.iter().any(|m| m == "lm_head") {
            kept.push("lm_head".to_string());
        }
        Ok((ckpt, Some(fp8::quantization_config(&kept))))
    }
}

/// The floating-point dtype holding most of the model's bytes as written (float32 if none):
/// a computed tensor's (a dequantized weight's) is what its computation writes, and FP8 codes
/// (which `quantization_config` names) do not count.
fn model_dtype(ckpt: &Checkpoint) -> DType {
    let mut bytes: Vec<(DType, u64)> = Vec::new();
    for t in ckpt.tensors.iter() {
        let dtype = t
            .pieces
            .computed()
            .and_then(|c| c.0.out_dtype())
            .unwrap_or(t.dtype);
        if !dtype.is_float() || dtype == DType::F8E4M3 {
            continue;
        }
        let n = t
            .numel()
            .unwrap_or(u64::MAX)
            .saturating_mul(dtype.size() as u64);
        match bytes.iter_mut().find(|(d, _)| *d == dtype) {
            Some((_, sum)) => *sum = sum.saturating_add(n),
            None => bytes.push((dtype, n)),
        }
    }
    bytes
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map_or(DType::F32, |(d, _)| d)
}

/// What the export left out, counted by why, so that nobody wonders where the optimizer went.
fn left_out_note(mapping: &Mapping) -> Option<String> {
    if mapping.left_out.is_empty() {
        return None;
    }
    let mut why: Vec<(&str, usize)> = Vec::new();
    for l in &mapping.left_out {
        match why.iter_mut().find(|(w, _)| *w == l.why) {
            Some((_, n)) => *n += 1,
            None => why.push((l.why, 1)),
        }
    }
    let parts: Vec<String> = why.iter().map(|(w, n)| format!("{n} {w}")).collect();
    Some(format!(
        "--hf-config left out {} entries: {} (`ckpt inspect --hf-config` lists them)",
        mapping.left_out.len(),
        parts.join(", ")
    ))
}
