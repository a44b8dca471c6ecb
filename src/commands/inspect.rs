//! `ckpt inspect`: what a checkpoint is, as a table or as JSON; with `--hf-config`, how the
//! export to that Hugging Face model would map it.

use std::path::PathBuf;

use super::{terminal_safe, to_stdout};
use crate::convert::Reading;
use crate::detect::Source;
use crate::error::Result;
use crate::transform::select::Selection;

/// What `inspect` was asked.
pub(crate) struct Inspect {
    pub input: Source,
    pub reading: Reading,
    /// Print the JSON document instead of a table.
    pub json: bool,
    /// `--filter`: only entries whose name matches.
    pub filters: Vec<String>,
    /// `--lora-config`: PEFT's adapter config, for each adapter's alpha.
    pub lora_config: Option<PathBuf>,
    /// `--hf-config`: show the export's mapping instead of the checkpoint.
    pub hf_config: Option<PathBuf>,
}

pub(crate) fn run(job: Inspect) -> Result<i32> {
    let mut ckpt = crate::convert::read(&job.input, &job.reading, Default::default())?;
    let sel = Selection::new(&job.filters, &[], &[])?;
    if let Some(hf) = &job.hf_config {
        let ckpt = sel.apply(ckpt)?;
        let cfg = crate::transform::hf_export::HfConfig::read(hf)?;
        let mapping = crate::transform::hf_export::map(&ckpt, &cfg)?;
        let report = crate::transform::hf_export::report::report(&mapping);
        to_stdout(|out| {
            if job.json {
                serde_json::to_writer_pretty(&mut *out, &report)?;
                writeln!(out)
            } else {
                let text = crate::transform::hf_export::report::render(&report);
                write!(out, "{}", terminal_safe(&text))
            }
        })?;
        return Ok(0);
    }
    let lora = match &job.lora_config {
        Some(path) => Some(crate::transform::lora::config::read(path)?.0),
        None => None,
    };
    let adapters = crate::transform::lora::describe(&ckpt, lora.as_ref());
    ckpt.details.extend(adapters);
    let report = crate::inspect::report(&ckpt, &|name| sel.keeps(name));
    to_stdout(|out| {
        if job.json {
            serde_json::to_writer_pretty(&mut *out, &report)?;
            writeln!(out)
        } else {
            write!(out, "{}", terminal_safe(&crate::inspect::render(&report)))
        }
    })?;
    Ok(0)
}
