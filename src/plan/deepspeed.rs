//! A [`Resharded`] DeepSpeed checkpoint (planned from its source's files by
//! [`crate::formats::deepspeed::reshard`]) as a [`Plan`] the executor writes like any other: each
//! archive's framing from [`crate::zip::layout`] as literals, each storage record a byte region
//! filled from runs of the input files' bytes and zeros (its CRC-32 computed as it is copied and
//! patched into the framing), `latest` as the output's commit marker, and the recovery scripts
//! copied whole with their permissions. So the reshard gets what every conversion has: progress,
//! Ctrl-C, object storage outputs and `--part`.

use std::path::PathBuf;

use super::{FilePlan, FileRole, Fill, Plan, Region, RegionSource};
use crate::dtype::DType;
use crate::error::Result;
use crate::formats::deepspeed::reshard::{Body, OutFile, Resharded, Run};
use crate::formats::deepspeed::LATEST;
use crate::model::Encoding;

/// The plan writing `resharded`'s files from its inputs.
pub(crate) fn plan(resharded: Resharded) -> Result<Plan<'static>> {
    let Resharded { inputs, files, .. } = resharded;
    let files = files
        .into_iter()
        .map(|f| file_plan(f, &inputs))
        .collect::<Result<Vec<_>>>()?;
    Plan::listed(inputs, files)
}

/// One destination file's plan.
fn file_plan(file: OutFile, inputs: &[PathBuf]) -> Result<FilePlan> {
    let OutFile { path, body } = file;
    // DeepSpeed finds its tag through `latest`: the output is a checkpoint once it is written.
    let role = match path == std::path::Path::new(LATEST) {
        true => FileRole::CommitMarker,
        false => FileRole::Data,
    };
    let mut plan = FilePlan {
        path,
        role,
        ..FilePlan::default()
    };
    match body {
        Body::Bytes(bytes) => {
            plan.len = bytes.len() as u64;
            if !bytes.is_empty() {
                plan.literals.push((0, bytes));
            }
        }
        Body::Copy(input) => {
            let from = &inputs[input];
            let len = match crate::storage::stat(from)? {
                Some(crate::storage::Stat::File(len)) => len,
                _ => 0,
            };
            let name = plan.path.display().to_string();
            let run = Run::Copy {
                input,
                offset: 0,
                len,
            };
            plan.regions.push(bytes_region(name, &[run]));
            plan.len = len;
            plan.mode = crate::storage::mode(from);
        }
        Body::Archive { records, runs } => {
            let file = plan.path.display().to_string();
            let regions = super::torch_save::archive_into(&mut plan, 0, &records, |key| {
                let runs = runs.get(key)?;
                Some(bytes_region(format!("{file}: storage {key}"), runs))
            })?;
            plan.regions = regions;
        }
    }
    Ok(plan)
}

/// A region of bytes (`name`, for messages) filled from `runs` one after another; placed by the
/// caller.
fn bytes_region(name: String, runs: &[Run]) -> Region {
    let mut fills = Vec::with_capacity(runs.len());
    let mut at = 0;
    for run in runs {
        let (input, offset, len, encoding) = match *run {
            Run::Copy { input, offset, len } => (input, offset, len, Encoding::Raw),
            Run::Zeros(len) => (0, 0, len, Encoding::Zeros),
        };
        if len == 0 {
            continue;
        }
        fills.push(Fill {
            input,
            encoding,
            dtype: DType::U8,
            offset,
            strides: vec![1],
            start: vec![at],
            sizes: vec![len],
        });
        at += len;
    }
    Region {
        name,
        offset: 0,
        dtype: DType::U8,
        shape: vec![at],
        source: RegionSource::Fills(fills),
        crc_slots: Vec::new(),
    }
}
