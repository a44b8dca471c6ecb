//! Where a plan's bytes end up, and how an output becomes visible only once it is complete:
//! [`write`] is the one call every conversion makes, whatever the output is.
//!
//! Four backends behind it, one promise (nothing is a checkpoint before all of it is written):
//! [`local`] stages a local output under a temporary name and renames it into place; [`part`]
//! shares one staged output between the `--part I/N` runs of a partitioned job, the last to
//! finish committing it; [`remote`] uploads into an object store with multipart uploads, the
//! plan's commit markers completed last; [`remote_part`] shares those uploads between the parts
//! of a partitioned run, the last to finish completing them. The plan says which file is which
//! ([`crate::plan::FileRole`]); no backend knows a format's file names.

pub mod local;
pub mod part;
pub mod remote;
pub mod remote_part;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

pub use local::{leftovers, Staging};

use crate::error::{Error, ErrorKind, Result};
use crate::exec::{self, ExecOptions};
use crate::part::PartSpec;
use crate::plan::Plan;
use crate::storage;
use part::{Finished, PartOutput};

/// The unfinished partitioned run that `path` names, on a filesystem or in an object store: what
/// `verify` tells of a path that is a run's staging area or an output its parts have not finished.
pub fn unfinished(path: &Path) -> Option<part::Unfinished> {
    if storage::is_remote(path) {
        return remote_part::unfinished(path);
    }
    part::unfinished(path)
}

/// Whether the output is one file or a directory of files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    File,
    Dir,
}

/// Where a conversion's output goes.
#[derive(Clone, Debug)]
pub(crate) struct Destination<'a> {
    /// The output: a local path or an object store URL.
    pub path: &'a Path,
    /// The input's path, which the output must not be, hold or lie inside.
    pub input: &'a Path,
    pub kind: OutputKind,
    /// Replace an existing output.
    pub force: bool,
    /// `--part I/N`: this run writes one share of the output.
    pub part: Option<PartRun<'a>>,
}

/// One part of a partitioned run.
#[derive(Clone, Debug)]
pub(crate) struct PartRun<'a> {
    pub spec: PartSpec,
    /// Everything that changes the output's bytes, which every part must agree on.
    pub description: String,
    /// The command line with `--part` as `I/N`, for the hints of a partitioned run.
    pub command_line: &'a str,
}

/// How the output stands.
pub(crate) enum Done {
    /// Written whole at `path`: `files` files, `bytes` of tensor data.
    Whole {
        path: PathBuf,
        files: usize,
        bytes: u64,
    },
    /// One part's share written into `staging`.
    Part {
        part: PartSpec,
        /// Bytes of this share, of all shares, and the files it touched.
        bytes: u64,
        total: u64,
        files: usize,
        staging: PathBuf,
        final_path: PathBuf,
        finished: Finished,
    },
}

/// Write `plan` at `to`: staged under a temporary name and renamed, uploaded into an object
/// store, or one `--part` share of either.
pub(crate) fn write(plan: &Plan, to: &Destination, opts: &ExecOptions) -> Result<Done> {
    if let Some(part) = &to.part {
        return write_part(plan, to, part, opts);
    }
    let path = if storage::is_remote(to.path) {
        remote::write(plan, to.input, to.path, to.kind, to.force, opts)?;
        to.path.to_path_buf()
    } else {
        let staging = Staging::prepare(to.path, to.input, to.kind, to.force)?;
        let dest = staging.paths(&plan.paths());
        exec::execute(plan, &dest, opts)?;
        if opts.cancel.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "interrupted"));
        }
        let final_path = staging.final_path().to_path_buf();
        staging.commit()?;
        final_path
    };
    Ok(Done::Whole {
        path,
        files: plan.file_count(),
        bytes: plan.data_bytes(),
    })
}

/// One part of a partitioned run: its share of the bytes into the shared staging area, a marker,
/// and the commit if it is the last part done.
fn write_part(plan: &Plan, to: &Destination, part: &PartRun, opts: &ExecOptions) -> Result<Done> {
    let mut description = format!("{}\nparts {}", part.description, part.spec.count);
    let lens: Vec<u64> = (0..plan.file_count())
        .map(|i| {
            let len = if plan.is_streamed(i) {
                0
            } else {
                plan.file_len(i)
            };
            description.push_str(&format!("\nfile {} {len}", plan.path(i).display()));
            len
        })
        .collect();
    let fingerprint = match storage::is_remote(to.input) {
        true => remote_part::fingerprint(&description, to.input)?,
        false => part::fingerprint(&description, &plan.inputs, to.input)?,
    };
    let total = lens.iter().sum();
    if storage::is_remote(to.path) {
        let (staging, bytes, files, finished) = remote_part::write_part(
            plan,
            to.input,
            to.path,
            to.kind,
            to.force,
            part.spec,
            &fingerprint,
            part.command_line,
            opts,
        )?;
        return Ok(Done::Part {
            part: part.spec,
            bytes,
            total,
            files,
            staging,
            final_path: to.path.to_path_buf(),
            finished,
        });
    }
    let out = PartOutput::prepare(
        to.path,
        to.input,
        to.kind,
        to.force,
        part.spec,
        &fingerprint,
        part.command_line,
    )?;
    let share = crate::part::share(&lens, part.spec);
    let dest = out.paths(&plan.paths());
    let outcome = exec::execute_share(plan, &dest, &share, opts)?;
    if opts.cancel.load(Ordering::Relaxed) {
        return Err(Error::new(ErrorKind::Io, "interrupted"));
    }
    let staging = out.staging().to_path_buf();
    let final_path = out.final_path().to_path_buf();
    let finished = out.finish(share.len(), outcome, &dest, || {
        exec::write_streamed_files(plan, &dest, true, opts.cancel)
    })?;
    Ok(Done::Part {
        part: part.spec,
        bytes: share.len(),
        total,
        files: share.ranges.len(),
        staging,
        final_path,
        finished,
    })
}
