//! `ckpt verify`: the checkpoint's problems, then (if it is sound) the comparisons and manifests
//! that need its data. Exit 1 when anything was found.

use std::path::PathBuf;

use super::{terminal_safe, to_stdout, Run};
use crate::convert::Reading;
use crate::detect::Source;
use crate::error::{Error, Result};
use crate::inspect::human_bytes;
use crate::verify::{self, VerifyOptions};

/// What `verify` was asked.
pub(crate) struct Verify {
    pub input: Source,
    pub reading: Reading,
    pub json: bool,
    /// `--deep`: read every byte.
    pub deep: bool,
    /// `--against`: compare the tensors with another checkpoint.
    pub against: Option<PathBuf>,
    /// `--write-manifest`: record per-tensor checksums here.
    pub write_manifest: Option<PathBuf>,
    /// `--manifest`: check the tensors against this manifest.
    pub manifest: Option<PathBuf>,
    pub run: Run,
}

pub(crate) fn run(job: Verify) -> Result<i32> {
    let opts = VerifyOptions {
        deep: job.deep,
        threads: job.run.threads,
        io: job.run.io,
        shapes_from: job.reading.shapes_from.as_deref(),
        tag: job.reading.tag.as_deref(),
    };
    let (mut report, ckpt) = verify::verify_input(&job.input, &opts)?;
    if let (Some(ckpt), true) = (ckpt, report.is_sound()) {
        if let Some(other) = &job.against {
            let b = crate::convert::read(&Source::one(other), &job.reading, Default::default())?;
            report
                .problems
                .extend(verify::compare(&ckpt, &b, &opts, 20)?);
        }
        if let Some(file) = &job.write_manifest {
            let m = verify::manifest(&ckpt, &opts)?;
            let text = serde_json::to_string_pretty(&m).unwrap_or_default() + "\n";
            crate::storage::write_small(file, text.into_bytes())?;
        }
        if let Some(file) = &job.manifest {
            let text = crate::storage::read(file)?;
            let want: verify::Manifest = serde_json::from_slice(&text).map_err(|e| {
                Error::usage(format!("`{}` is not a ckpt manifest: {e}", file.display()))
            })?;
            report.problems.extend(verify::check_manifest(
                &want,
                &verify::manifest(&ckpt, &opts)?,
            ));
        }
    }
    let input = &job.input;
    to_stdout(|out| {
        if job.json {
            serde_json::to_writer_pretty(&mut *out, &report)?;
            return writeln!(out);
        }
        for p in &report.problems {
            writeln!(out, "{}", terminal_safe(&p.line()))?;
            if let Some(hint) = &p.hint {
                writeln!(out, "  hint: {}", terminal_safe(hint))?;
            }
        }
        let verdict = if report.is_sound() {
            "sound"
        } else {
            "NOT sound"
        };
        if let Some(u) = &report.unfinished {
            writeln!(
                out,
                "{}: {verdict} (unfinished: {} of {} parts done)",
                input.display(),
                u.done.len(),
                u.parts
            )
        } else if report.format.is_none() {
            writeln!(out, "{}: {verdict} (it could not be read)", input.display())
        } else {
            writeln!(
                out,
                "{}: {verdict} ({} tensors, {} pieces, {}{})",
                input.display(),
                report.tensors,
                report.pieces,
                human_bytes(report.bytes),
                if job.deep { ", every byte read" } else { "" }
            )
        }
    })?;
    Ok(if report.is_sound() { 0 } else { 1 })
}
