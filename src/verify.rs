//! `ckpt verify`: is a checkpoint sound? Every check that can be made from the files, each problem
//! named by file, tensor and byte offset.
//!
//! Readers already refuse what they cannot parse (truncated items, bad headers, hostile pickles,
//! paths that climb out); those refusals become problems here. On top, the verifier checks what
//! a reader accepts but a loader would trip on: pieces that overlap, leave gaps or fall outside the
//! tensor, and data ranges past the end of their file. `--deep` reads every byte.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::detect::Source;
use crate::error::{Error, Result};
use crate::exec::{self, ExecOptions};
use crate::geometry::{check_coverage, NdBox};
use crate::layout::{Problems, ReadOptions};
use crate::model::{Checkpoint, Encoding};
use crate::plan::{self, PlanOptions, Target};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// One finding.
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    pub severity: Severity,
    pub message: String,
    pub file: Option<String>,
    pub tensor: Option<String>,
    pub offset: Option<u64>,
    pub hint: Option<String>,
}

impl Problem {
    fn error(message: impl Into<String>) -> Problem {
        Problem {
            severity: Severity::Error,
            message: message.into(),
            file: None,
            tensor: None,
            offset: None,
            hint: None,
        }
    }

    fn tensor(mut self, name: &str) -> Problem {
        self.tensor = Some(name.to_string());
        self
    }

    fn file(mut self, path: &Path) -> Problem {
        self.file = Some(path.display().to_string());
        self
    }

    fn at(mut self, offset: u64) -> Problem {
        self.offset = Some(offset);
        self
    }

    fn from_error(e: &Error) -> Problem {
        Problem {
            severity: Severity::Error,
            message: e.message.clone(),
            file: e.file.as_ref().map(|f| f.display().to_string()),
            tensor: e.tensor.clone(),
            offset: e.offset,
            hint: e.hint.clone(),
        }
    }

    /// One line: ``error: `file`, tensor `x`, at byte 3: message``.
    pub fn line(&self) -> String {
        let e = Error {
            kind: crate::ErrorKind::Invalid,
            message: self.message.clone(),
            file: self.file.clone().map(Into::into),
            tensor: self.tensor.clone(),
            offset: self.offset,
            hint: None,
            source: None,
        };
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        format!("{sev}: {}", e.headline())
    }
}

#[derive(Clone, Debug, Default)]
pub struct VerifyOptions<'a> {
    /// Read every byte: checksums, NaN/Inf warnings.
    pub deep: bool,
    pub threads: usize,
    pub io: exec::IoMode,
    /// `--shapes-from`: names and shapes for an FSDP1 LOCAL checkpoint.
    pub shapes_from: Option<&'a Path>,
    /// `--tag`: which of a DeepSpeed directory's tags.
    pub tag: Option<&'a str>,
}

/// The outcome, serialised by `--json`.
#[derive(Debug, Default, Serialize)]
pub struct VerifyReport {
    pub path: String,
    pub format: Option<&'static str>,
    pub tensors: usize,
    pub pieces: usize,
    pub bytes: u64,
    /// xxh3 digest of each tensor's logical bytes (with `--deep`), by name.
    pub checksums: BTreeMap<String, String>,
    pub problems: Vec<Problem>,
    /// The partitioned run (`--part I/N`) staged for this output and not committed yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unfinished: Option<crate::output::part::Unfinished>,
}

impl VerifyReport {
    pub fn is_sound(&self) -> bool {
        !self.problems.iter().any(|p| p.severity == Severity::Error)
    }
}

/// Verify the checkpoint at `path`.
pub fn verify(path: &Path, opts: &VerifyOptions) -> Result<VerifyReport> {
    verify_input(&Source::one(path), opts).map(|(report, _)| report)
}

/// Verify the checkpoint at `path`, or the files of a per-rank checkpoint: the report, and the
/// checkpoint as read when it could be read (for the checks that need its data).
pub fn verify_input(
    input: &Source,
    opts: &VerifyOptions,
) -> Result<(VerifyReport, Option<Checkpoint>)> {
    let mut report = VerifyReport {
        path: input.display(),
        ..VerifyReport::default()
    };
    let unfinished = input.single().and_then(crate::output::unfinished);
    if let Some(u) = unfinished {
        let path = input.path();
        let missing = u
            .missing
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let state = match &u.committing {
            Some(by) => format!("all {} parts done, {by} is committing it", u.parts),
            None if u.missing.is_empty() => format!("all {} parts done, not committed", u.parts),
            None => format!(
                "{} of {} parts missing: {missing}",
                u.missing.len(),
                u.parts
            ),
        };
        let staging = Path::new(&u.staging);
        let inside = std::path::absolute(path).is_ok_and(|p| p.starts_with(staging));
        if u.output_exists && !inside {
            // A `--force` run staged beside a finished output: the output itself is checked.
            report.problems.push(Problem {
                severity: Severity::Warning,
                hint: Some(format!("finish it or remove `{}`", staging.display())),
                ..Problem::error(format!(
                    "a partitioned run into this output is staged beside it ({state})"
                ))
                .file(staging)
            });
        } else {
            let hint = if u.committing.is_some() || u.missing.is_empty() {
                format!("if no part is running, run any part again: `{}`", u.command)
            } else {
                format!(
                    "run the missing parts (`{}` with I = {missing}); the last one done commits `{}`",
                    u.command, u.output
                )
            };
            report.problems.push(Problem {
                hint: Some(hint),
                ..Problem::error(format!("unfinished partitioned run: {state}")).file(staging)
            });
            report.unfinished = Some(u);
            return Ok((report, None));
        }
    }
    // Readers step past a broken item or file here, so every one of them is listed.
    let problems = Problems::default();
    let read_opts = ReadOptions {
        problems: Some(&problems),
        ..ReadOptions::default()
    };
    let reading = crate::convert::Reading {
        shapes_from: opts.shapes_from.map(Path::to_path_buf),
        tag: opts.tag.map(str::to_string),
    };
    let read = crate::convert::read(input, &reading, read_opts);
    report
        .problems
        .extend(problems.into_errors().iter().map(Problem::from_error));
    let ckpt = match read {
        Ok(c) => c,
        // A usage error or a bug in ckpt says nothing about the checkpoint.
        Err(e) if matches!(e.kind, crate::ErrorKind::Usage | crate::ErrorKind::Bug) => {
            return Err(e)
        }
        Err(e) => {
            report.problems.push(Problem::from_error(&e));
            return Ok((report, None));
        }
    };
    report.format = Some(ckpt.format.name());
    report.tensors = ckpt.tensors.len();
    report.pieces = ckpt.tensors.iter().map(|t| t.pieces.len()).sum();
    report.bytes = ckpt.total_bytes();
    report.problems.extend(structural_problems(&ckpt));
    if let Err(e) = ckpt.check_supported() {
        report.problems.push(Problem::from_error(&e));
    }
    if opts.deep && report.is_sound() {
        match digests(&ckpt, opts) {
            Ok(per_tensor) => {
                for (name, d) in per_tensor {
                    report
                        .checksums
                        .insert(name.clone(), format!("{:016x}", d.xxh3));
                    if d.nan + d.inf > 0 {
                        report.problems.push(
                            Problem {
                                severity: Severity::Warning,
                                ..Problem::error(format!(
                                    "{} NaN and {} infinite values",
                                    d.nan, d.inf
                                ))
                            }
                            .tensor(&name),
                        );
                    }
                }
            }
            Err(e) if e.kind == crate::ErrorKind::Bug => return Err(e),
            Err(e) => report.problems.push(Problem::from_error(&e)),
        }
        match replica_problems(&ckpt, opts) {
            Ok(problems) => report.problems.extend(problems),
            Err(e) if e.kind == crate::ErrorKind::Bug => return Err(e),
            Err(e) => report.problems.push(Problem::from_error(&e)),
        }
    }
    Ok((report, Some(ckpt)))
}

/// Pieces saved more than once (a plain or replicated tensor in every rank's file) must hold the
/// same bytes: ckpt writes the first copy, so a copy that differs is data the output loses. Each
/// copy is digested as a tensor of its own.
fn replica_problems(ckpt: &Checkpoint, opts: &VerifyOptions) -> Result<Vec<Problem>> {
    // (tensor, piece of the first copy, piece of this copy) for every copy after the first
    let mut copies = Vec::new();
    let mut tensors = Vec::new();
    for (ti, t) in ckpt.tensors.iter().enumerate() {
        let mut first: BTreeMap<(&[u64], &[u64]), usize> = BTreeMap::new();
        for (k, p) in t.pieces.iter().enumerate() {
            if let Some(&f) = first.get(&(p.offsets(), p.sizes())) {
                copies.push((ti, f, k));
            } else {
                first.insert((p.offsets(), p.sizes()), k);
            }
        }
    }
    if copies.is_empty() {
        return Ok(Vec::new());
    }
    let mut wanted = std::collections::BTreeSet::new();
    for &(ti, f, k) in &copies {
        wanted.insert((ti, f));
        wanted.insert((ti, k));
    }
    for &(ti, k) in &wanted {
        let t = &ckpt.tensors[ti];
        let mut piece = t.pieces.get(k).to_piece();
        piece.offsets = vec![0; piece.offsets.len()];
        tensors.push(crate::model::Tensor {
            name: format!("{ti}/{k}"),
            key_path: Vec::new(),
            dtype: t.dtype,
            shape: piece.sizes.clone(),
            pieces: crate::model::Pieces::single(piece)?,
        });
    }
    let copy_ckpt = Checkpoint {
        root: ckpt.root.clone(),
        format: ckpt.format,
        world_size: ckpt.world_size,
        tensors,
        values: Vec::new(),
        unsupported: Vec::new(),
        details: Vec::new(),
    };
    let digests: BTreeMap<String, u64> = digests(&copy_ckpt, opts)?
        .into_iter()
        .map(|(name, d)| (name, d.xxh3))
        .collect();
    let mut problems = Vec::new();
    for (ti, f, k) in copies {
        if digests.get(&format!("{ti}/{f}")) == digests.get(&format!("{ti}/{k}")) {
            continue;
        }
        let t = &ckpt.tensors[ti];
        let (a, b) = (t.pieces.get(f), t.pieces.get(k));
        problems.push(Problem {
            hint: Some(format!(
                "each file holds its own copy and ckpt writes the first, from `{}`",
                a.file().display()
            )),
            ..Problem::error(format!(
                "copies of the piece at offsets {:?} differ: `{}` and `{}` hold different bytes",
                a.offsets(),
                a.file().display(),
                b.file().display()
            ))
            .tensor(&t.name)
            .file(b.file())
            .at(b.offset())
        });
    }
    Ok(problems)
}

/// Per-tensor digests of a checkpoint's logical bytes, in tensor order.
pub fn digests(
    ckpt: &Checkpoint,
    opts: &VerifyOptions,
) -> Result<Vec<(String, exec::RegionDigest)>> {
    let p = plan::plan(
        ckpt,
        &Target::Safetensors {
            file_name: "digest".into(),
        },
        &PlanOptions::default(),
    )?;
    let cancel = std::sync::atomic::AtomicBool::new(false);
    let exec_opts = ExecOptions {
        threads: opts.threads,
        io: opts.io,
        progress: &exec::NoProgress,
        cancel: &cancel,
        durable: false,
    };
    let digests = exec::digest(&p, &exec_opts)?;
    let regions = p.whole_files().iter().flat_map(|f| &f.regions);
    Ok(regions
        .zip(digests)
        .map(|(r, d)| (r.name.clone(), d))
        .collect())
}

/// Checks that need no tensor data: coverage and byte ranges.
pub fn structural_problems(ckpt: &Checkpoint) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut file_lens: BTreeMap<&Path, Option<u64>> = BTreeMap::new();
    for t in &ckpt.tensors {
        let rank = t.shape.len();
        if t.pieces.ndim() != rank {
            problems.push(
                Problem::error(format!(
                    "its pieces have {} dims but the tensor has {rank}",
                    t.pieces.ndim()
                ))
                .tensor(&t.name),
            );
            continue;
        }
        let mut boxes = Vec::new();
        for p in t.pieces.iter() {
            boxes.push(NdBox {
                offsets: p.offsets().to_vec(),
                sizes: p.sizes().to_vec(),
            });
            if p.encoding() != Encoding::Raw || p.sizes().contains(&0) {
                continue;
            }
            let len = *file_lens.entry(&**p.file()).or_insert_with(|| {
                match crate::storage::stat(&ckpt.path_of(p.file())) {
                    Ok(Some(crate::storage::Stat::File(len))) => Some(len),
                    _ => None,
                }
            });
            let elem = t.dtype.size() as u64;
            let end = p
                .sizes()
                .iter()
                .zip(p.strides().iter())
                .try_fold(0u64, |acc, (&n, &s)| {
                    acc.checked_add((n - 1).checked_mul(s)?)
                })
                .and_then(|last| last.checked_add(1)?.checked_mul(elem))
                .and_then(|b| b.checked_add(p.offset()));
            match (len, end) {
                (None, _) => {
                    problems.push(
                        Problem::error("file is missing")
                            .file(p.file())
                            .tensor(&t.name),
                    );
                }
                (Some(len), Some(end)) if end <= len => {}
                (Some(len), _) => {
                    problems.push(
                        Problem::error(format!("data runs past the end of the file ({len} bytes)"))
                            .file(p.file())
                            .tensor(&t.name)
                            .at(p.offset()),
                    );
                }
            }
        }
        // Identical boxes are replicas (saved by several ranks); only partial overlaps are wrong.
        boxes.sort();
        boxes.dedup();
        for c in check_coverage(&t.shape, &boxes) {
            problems.push(Problem::error(c.describe(&t.shape, &boxes)).tensor(&t.name));
        }
    }
    for v in &ckpt.values {
        if let Some(blob) = &v.raw {
            let len = match crate::storage::stat(&ckpt.path_of(&blob.file)) {
                Ok(Some(crate::storage::Stat::File(len))) => Some(len),
                _ => None,
            };
            if len.is_none_or(|len| blob.offset.saturating_add(blob.length) > len) {
                problems.push(
                    Problem::error("value bytes run past the end of the file")
                        .file(&blob.file)
                        .tensor(&v.name)
                        .at(blob.offset),
                );
            }
        }
    }
    problems
}

/// Compare the logical tensors of two checkpoints in any layouts. Returns the differences found,
/// at most `limit`.
pub fn compare(
    a: &Checkpoint,
    b: &Checkpoint,
    opts: &VerifyOptions,
    limit: usize,
) -> Result<Vec<Problem>> {
    let mut diffs = Vec::new();
    let by_name: BTreeMap<&str, &crate::model::Tensor> =
        b.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let a_names: std::collections::BTreeSet<&str> =
        a.tensors.iter().map(|t| t.name.as_str()).collect();
    for t in &a.tensors {
        let problem = match by_name.get(t.name.as_str()) {
            None => Problem::error("only in the first checkpoint"),
            Some(o) if o.dtype != t.dtype => {
                Problem::error(format!("dtype {} vs {}", t.dtype, o.dtype))
            }
            Some(o) if o.shape != t.shape => {
                Problem::error(format!("shape {:?} vs {:?}", t.shape, o.shape))
            }
            Some(_) => continue,
        };
        diffs.push(problem.tensor(&t.name));
    }
    for t in &b.tensors {
        if !a_names.contains(t.name.as_str()) {
            diffs.push(Problem::error("only in the second checkpoint").tensor(&t.name));
        }
    }
    if diffs.is_empty() {
        let da = digests(a, opts)?;
        let db: BTreeMap<String, exec::RegionDigest> = digests(b, opts)?.into_iter().collect();
        for (name, d) in da {
            if db.get(&name).map(|o| o.xxh3) != Some(d.xxh3) {
                diffs.push(Problem::error("contents differ").tensor(&name));
            }
        }
    }
    diffs.truncate(limit);
    Ok(diffs)
}

/// A checksum manifest: per-tensor digests of the logical bytes, so corruption between save and
/// load is caught whatever layout each side uses.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Manifest {
    /// How digests were made; a manifest with another scheme is refused.
    pub scheme: String,
    pub tensors: BTreeMap<String, ManifestEntry>,
}

#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ManifestEntry {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub xxh3: String,
}

/// The only scheme so far: xxh3-64 over row-major bytes, tree-hashed over 8 MiB blocks.
pub const MANIFEST_SCHEME: &str = "xxh3-64 row-major, blocks of 8 MiB";

/// Build the manifest of a checkpoint (reads every byte).
pub fn manifest(ckpt: &Checkpoint, opts: &VerifyOptions) -> Result<Manifest> {
    let digests = digests(ckpt, opts)?;
    let tensors = ckpt
        .tensors
        .iter()
        .zip(digests)
        .map(|(t, (_, d))| {
            (
                t.name.clone(),
                ManifestEntry {
                    dtype: t.dtype.to_string(),
                    shape: t.shape.clone(),
                    xxh3: format!("{:016x}", d.xxh3),
                },
            )
        })
        .collect();
    Ok(Manifest {
        scheme: MANIFEST_SCHEME.to_string(),
        tensors,
    })
}

/// Differences between a manifest and a checkpoint's own manifest.
pub fn check_manifest(want: &Manifest, have: &Manifest) -> Vec<Problem> {
    let mut problems = Vec::new();
    if want.scheme != have.scheme {
        problems.push(Problem::error(format!(
            "manifest uses `{}`, ckpt makes `{}`",
            want.scheme, have.scheme
        )));
        return problems;
    }
    for (name, w) in &want.tensors {
        let message = match have.tensors.get(name) {
            None => "in the manifest but not in the checkpoint".to_string(),
            Some(h) if h.dtype != w.dtype || h.shape != w.shape => {
                format!(
                    "manifest says {} {:?}, checkpoint has {} {:?}",
                    w.dtype, w.shape, h.dtype, h.shape
                )
            }
            Some(h) if h.xxh3 != w.xxh3 => format!(
                "checksum {} does not match the manifest's {}",
                h.xxh3, w.xxh3
            ),
            Some(_) => continue,
        };
        problems.push(Problem::error(message).tensor(name));
    }
    for name in have
        .tensors
        .keys()
        .filter(|n| !want.tensors.contains_key(*n))
    {
        problems.push(Problem::error("in the checkpoint but not in the manifest").tensor(name));
    }
    problems
}
