//! `--part I/N` into an object store: the parts of one conversion, on machines that share nothing
//! but the store, upload one output together, and it appears only when the last part is done.
//!
//! Beside the output `NAME` the parts share the prefix `.NAME.ckpt-parts/`:
//!
//! - `run.json`: the run's fingerprint and the multipart upload of every output file. It is
//!   created with a conditional PUT (`If-None-Match: *`; GCS's `ifGenerationMatch=0`), so of
//!   parts starting at once exactly one part's uploads win; the others abort theirs and use the
//!   winner's. Before that PUT a part
//!   lists the uploads it started in `claims/part-I.json`, so that those of a part killed in
//!   between are aborted by its rerun or by the commit.
//!   A part that finds no `run.json` first takes `starting` (a conditional PUT), so that of
//!   parts starting together one creates the uploads while the others wait for its `run.json`.
//! - Each file is cut into upload parts as a plain upload cuts it ([`super::remote`]), and each
//!   upload part belongs to the share (as [`crate::part`] cuts the files laid end to end) that
//!   holds its first byte. A part sends the same part numbers each time it runs: a rerun replaces
//!   what a killed run sent.
//! - `done/part-I-of-N.json`: written once the part's uploads are acknowledged, with the ids the
//!   store gave them (S3 ETags, Azure block ids, the names of GCS's staged part objects, which
//!   any machine may add to an upload), the upload parts it held back because a ZIP CRC
//!   in them depends on other shares' bytes, and its partial CRCs.
//! - `commit.lock`: taken with a conditional PUT by a part that found all `N` markers. It re-reads
//!   them, computes the held-back parts again and patches their CRCs, records every upload part's
//!   id in `completing.json`, completes the data files' uploads, then the commit markers' (a DCP
//!   `.metadata` is written then), and deletes the prefix, `run.json` first. Nothing exists under
//!   the output's name before. A part run after a commit was cut short finishes it
//!   (see `commit.rs`).
//!
//! A part that starts deletes its own marker before sending anything, then checks that no commit
//! is under way; a committer re-reads every marker after taking the lock (as on disk, see
//! [`super::part`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use self::commit::{clean, Commit};
use super::part::{holder_is_gone, hostname, Finished, Unfinished};
use super::remote::{self as upload, Forward, Spool, Started};
use super::OutputKind;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{self, ExecOptions, OpenSlot, PartialCrc};
use crate::part::{FileRange, PartSpec, Share};
use crate::plan::Plan;
use crate::storage::{Remote, UploadedPart};

mod commit;

const SUFFIX: &str = ".ckpt-parts";
const RUN: &str = "run.json";
const DONE: &str = "done";
const CLAIMS: &str = "claims";
const LOCK: &str = "commit.lock";
const COMPLETING: &str = "completing.json";
const STARTING: &str = "starting";

/// How long a part waits for another that is starting the run's uploads.
const START_WAIT: Duration = Duration::from_secs(60);
/// Requests to the store sent at once where there is one per file or part (starting and
/// completing uploads, reading markers).
const AT_ONCE: usize = 16;

/// What every part of one run agrees on: the fingerprint, and the uploads they all send to.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RunRecord {
    fingerprint: String,
    parts: usize,
    /// The command line of the part that started the run, `--part` shown as `I/N`: for hints.
    command: String,
    /// Names this run among runs with the same fingerprint (one run after another into one
    /// output): markers carry it.
    run: String,
    /// The upload of each file uploaded in parts (`None`: streamed or empty, put at the commit).
    uploads: Vec<Option<Started>>,
}

/// An upload part one part sent: file, part number and the id the store gave it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Sent {
    file: usize,
    k: usize,
    id: String,
}

/// A part's done-marker.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Marker {
    fingerprint: String,
    run: String,
    part: usize,
    parts: usize,
    host: String,
    pid: u32,
    sent: Vec<Sent>,
    /// Upload parts left for the committer: (file, part number).
    held: Vec<(usize, usize)>,
    crcs: Vec<PartialCrc>,
    open_slots: Vec<OpenSlot>,
}

/// One upload part of the output: file `file`'s part `k`, its bytes `at..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UploadSlice {
    file: usize,
    k: usize,
    at: u64,
    end: u64,
}

/// The fingerprint of a run whose input is in an object store: `description` and the key, size
/// and ETag (or time of last change) of every object under `root`, keys taken below `root`.
pub fn fingerprint(description: &str, root: &Path) -> Result<String> {
    let at = crate::storage::remote(root)
        .ok_or_else(|| Error::bug("a remote fingerprint of a local path"))??;
    let mut text = description.to_string();
    let base = at.key().to_string();
    for v in at.versions()? {
        let rel = v
            .key
            .strip_prefix(&base)
            .map(|r| r.trim_start_matches('/'))
            .unwrap_or(&v.key);
        text.push_str(&format!("\ninput {rel} {} {}", v.size, v.tag));
    }
    Ok(format!(
        "{:032x}",
        xxhash_rust::xxh3::xxh3_128(text.as_bytes())
    ))
}

/// Every upload part of `plan`'s files, file by file, and the share each belongs to.
fn pieces(plan: &Plan, lens: &[u64], count: usize) -> Result<Vec<(UploadSlice, usize)>> {
    let mut out = Vec::new();
    for (file, &len) in lens.iter().enumerate() {
        if len > 0 {
            for (k, w) in upload::part_cuts(plan, file, len)?.windows(2).enumerate() {
                let (at, end) = (w[0], w[1]);
                out.push(UploadSlice { file, k, at, end });
            }
        }
    }
    let owners = owners(lens, &out, count);
    Ok(out.into_iter().zip(owners).collect())
}

/// The share of each of `pieces` (in file order): the one whose range of the files laid end to
/// end ([`crate::part::cuts`], cut anywhere) holds the piece's first byte. Shares are contiguous
/// runs of pieces, each within one piece of its even share of the bytes.
fn owners(lens: &[u64], pieces: &[UploadSlice], count: usize) -> Vec<usize> {
    let cuts = crate::part::cuts_aligned(lens, count, 1);
    let mut starts = Vec::with_capacity(lens.len());
    let mut at = 0u64;
    for &len in lens {
        starts.push(at);
        at += len;
    }
    pieces
        .iter()
        .map(|p| {
            let pos = starts.get(p.file).copied().unwrap_or(0) + p.at;
            cuts[1..count].partition_point(|&c| c <= pos)
        })
        .collect()
}

/// The prefix the parts of the run into `output` share.
fn staging_of(parent: &Remote, name: &str) -> Result<Remote> {
    parent.join(&format!(".{name}{SUFFIX}"))
}

/// Write part `part`'s share of `plan`'s output into the object store location `out`, and
/// commit the output if every part is done. `description` is everything that changes the
/// output's bytes; `command` the command line, for hints.
#[allow(clippy::too_many_arguments)]
pub fn write_part(
    plan: &Plan,
    input: &Path,
    out: &Path,
    kind: OutputKind,
    force: bool,
    part: PartSpec,
    fingerprint: &str,
    command: &str,
    opts: &ExecOptions,
) -> Result<(PathBuf, u64, usize, Finished)> {
    let (remote, name) = upload::output_of(out, input)?;
    let staging = staging_of(&remote.parent(), &name)?;
    // A commit that was cut short: its objects under the name are this run's.
    let completing = staging.join(COMPLETING)?.exists()?;
    if !completing {
        upload::existing(&remote, kind, force)?;
    }
    let dests = upload::destinations(plan, &remote, kind)?;
    let n = plan.file_count();
    let lens: Vec<u64> = (0..n)
        .map(|i| match plan.is_streamed(i) {
            true => 0,
            false => plan.file_len(i),
        })
        .collect();

    if completing && !staging.join(RUN)?.exists()? {
        // The commit was done and its clean-up cut short.
        clean(&staging, &[]);
        let by = "an earlier part".to_string();
        return Ok((staging.path, 0, 0, Finished::CommittedElsewhere { by }));
    }
    let record = join_run(
        &staging,
        &dests,
        &lens,
        part,
        fingerprint,
        command,
        opts.cancel,
    )?;
    let me = Part {
        staging: staging.clone(),
        part,
        fingerprint: fingerprint.to_string(),
        run: record.run.clone(),
    };
    let pieces = pieces(plan, &lens, part.count)?;
    let commit = Commit {
        plan,
        record: &record,
        dests: &dests,
        remote: &remote,
        kind,
        force,
        opts,
    };
    if completing {
        // Every share is in: what is left is the commit, whoever runs it.
        me.check_no_commit()?;
        let finished = commit.locked(&me, &pieces)?;
        return Ok((staging.path, 0, 0, finished));
    }
    // Withdraw this part's marker before sending a byte, then check for a commit: a committer
    // re-reads the markers after taking its lock, so it either sees this part missing or holds
    // the lock by now.
    me.marker(part.index)?.delete()?;
    me.check_no_commit()?;

    let mine: Vec<UploadSlice> = pieces
        .iter()
        .filter(|(_, owner)| *owner == part.index)
        .map(|(p, _)| *p)
        .collect();
    let bytes: u64 = mine.iter().map(|p| p.end - p.at).sum();
    let files = {
        let mut f: Vec<usize> = mine.iter().map(|p| p.file).collect();
        f.dedup();
        f.len()
    };
    opts.progress.start(bytes);
    let spool = Spool::new()?;
    let dest: Vec<PathBuf> = (0..n).map(|i| spool.path(i)).collect();
    let marker = send_share(plan, &record, &dests, &dest, &mine, &me, opts)?;
    opts.progress.finish();
    drop(spool);
    let text = serde_json::to_vec(&marker)
        .map_err(|e| Error::bug(format!("the part marker cannot be serialized: {e}")))?;
    me.marker(part.index)?.put(text)?;

    let missing = me.missing()?;
    if !missing.is_empty() {
        let finished = match me.committed_elsewhere()? {
            true => Finished::CommittedElsewhere {
                by: "another part".into(),
            },
            false => Finished::Waiting { missing },
        };
        return Ok((staging.path.clone(), bytes, files, finished));
    }
    let finished = commit.locked(&me, &pieces)?;
    Ok((staging.path, bytes, files, finished))
}

/// `run.json` as found, created (with this part's uploads) if there is none; refused if it is
/// another run's.
fn join_run(
    staging: &Remote,
    dests: &[Remote],
    lens: &[u64],
    part: PartSpec,
    fingerprint: &str,
    command: &str,
    cancel: &AtomicBool,
) -> Result<RunRecord> {
    let run = staging.join(RUN)?;
    let claim = staging.join(&format!("{CLAIMS}/part-{}.json", part.index))?;
    let found = match run.read_if_any()? {
        Some(b) => parse_run(&run, &b)?,
        None => match started_elsewhere(staging, &run, part)? {
            Some(b) => parse_run(&run, &b)?,
            None => {
                let uploads = start_uploads(staging, dests, lens, cancel).inspect_err(|_| {
                    // No part waits for a start that failed.
                    let _ = staging.join(STARTING).and_then(|g| g.delete());
                })?;
                let ours: Vec<Started> = uploads.iter().flatten().cloned().collect();
                claim.put(serde_json::to_vec(&ours).unwrap_or_default())?;
                let record = RunRecord {
                    fingerprint: fingerprint.to_string(),
                    parts: part.count,
                    command: command.to_string(),
                    run: format!(
                        "{} {} {}",
                        hostname(),
                        std::process::id(),
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_nanos())
                    ),
                    uploads,
                };
                let text = serde_json::to_vec_pretty(&record)
                    .map_err(|e| Error::bug(format!("the run record cannot be serialized: {e}")))?;
                if run.put_new(text)? {
                    let _ = claim.delete();
                    record
                } else {
                    // Another part's uploads won the race: ours go.
                    if upload::abort(staging, &ours) {
                        let _ = claim.delete();
                    }
                    let b = run.read_if_any()?.ok_or_else(|| {
                        Error::invalid("the run record vanished as it was being read")
                            .file(&run.path)
                            .hint("run this part again")
                    })?;
                    parse_run(&run, &b)?
                }
            }
        },
    };
    if found.fingerprint != fingerprint || found.parts != part.count {
        let what = if found.parts != part.count {
            format!("{} parts, not {}", found.parts, part.count)
        } else {
            "another input, other flags or another ckpt version".to_string()
        };
        return Err(Error::usage(format!(
            "the staging prefix `{}` holds a partitioned run of {what}, started as `{}`; this \
             part is `{command}`",
            staging.path.display(),
            found.command
        ))
        .hint(
            "run every part with the same input and flags, or let that run finish (or abort its \
             uploads and delete the prefix) before starting another",
        ));
    }
    // Uploads a killed earlier run of this part started but lost (or never recorded).
    if let Some(b) = claim.read_if_any()? {
        let left: Vec<Started> = serde_json::from_slice(&b).unwrap_or_default();
        let keep: Vec<&Started> = found.uploads.iter().flatten().collect();
        let stale: Vec<Started> = left.into_iter().filter(|s| !keep.contains(&s)).collect();
        if upload::abort(staging, &stale) {
            let _ = claim.delete();
        }
    }
    Ok(found)
}

/// `run.json` once the part that is starting the run's uploads has written it, or `None` when
/// this part is to start them: no part is (this one took the `starting` object, a conditional
/// PUT), or the one that is has not written it within [`START_WAIT`] or is gone. Of parts that
/// start together, one then creates the uploads rather than every one of them (a reshard to 1,024
/// ranks has 1,024 files); should two start them anyway, `run.json` still takes one's.
fn started_elsewhere(staging: &Remote, run: &Remote, part: PartSpec) -> Result<Option<Vec<u8>>> {
    let gate = staging.join(STARTING)?;
    let me = format!("part {part} on {} (pid {})", hostname(), std::process::id());
    if gate.put_new(me.into_bytes())? {
        return Ok(None);
    }
    let deadline = std::time::Instant::now() + START_WAIT;
    let mut pause = Duration::from_millis(100);
    while std::time::Instant::now() < deadline {
        if let Some(b) = run.read_if_any()? {
            return Ok(Some(b));
        }
        let by = gate.read_if_any()?.unwrap_or_default();
        if by.is_empty() || holder_is_gone(String::from_utf8_lossy(&by).trim()) {
            break;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(2));
    }
    run.read_if_any()
}

/// Start the multipart upload of every file uploaded in parts (`lens` 0 for a streamed or empty
/// one), a few dozen at once ([`crate::storage::create_uploads`]); if one cannot be started, or
/// the run is interrupted, those that were are aborted.
fn start_uploads(
    staging: &Remote,
    dests: &[Remote],
    lens: &[u64],
    cancel: &AtomicBool,
) -> Result<Vec<Option<Started>>> {
    let todo: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] > 0).collect();
    let (uploads, result) = upload::start_uploads(staging, dests, &todo, cancel);
    if let Err(e) = result {
        let ours: Vec<Started> = uploads.into_iter().flatten().collect();
        upload::abort(staging, &ours);
        return Err(e);
    }
    Ok(uploads)
}

/// `f` of every item, in order, up to [`AT_ONCE`] at a time (each waits on the store's reply);
/// the first error.
fn at_once<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> Result<R> + Sync) -> Result<Vec<R>> {
    let chunk = items.len().div_ceil(AT_ONCE).max(1);
    let f = &f;
    let done: Vec<Vec<Result<R>>> = std::thread::scope(|s| {
        let workers: Vec<_> = items
            .chunks(chunk)
            .map(|c| s.spawn(move || c.iter().map(f).collect::<Vec<_>>()))
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| vec![Err(Error::bug("a worker thread panicked"))])
            })
            .collect()
    });
    done.into_iter().flatten().collect()
}

fn parse_run(run: &Remote, bytes: &[u8]) -> Result<RunRecord> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::invalid(format!("not a ckpt run record: {e}"))
            .file(&run.path)
            .hint("delete the staging prefix and run every part again")
    })
}

/// One part's view of the staging prefix.
struct Part {
    staging: Remote,
    part: PartSpec,
    fingerprint: String,
    run: String,
}

impl Part {
    fn marker(&self, i: usize) -> Result<Remote> {
        self.staging
            .join(&format!("{DONE}/part-{i}-of-{}.json", self.part.count))
    }

    fn read_marker(&self, i: usize) -> Result<Option<Marker>> {
        let at = self.marker(i)?;
        let Some(text) = at.read_if_any()? else {
            return Ok(None);
        };
        let hint = format!("run part {i}/{} again", self.part.count);
        let m: Marker = serde_json::from_slice(&text).map_err(|e| {
            Error::invalid(format!("not a ckpt part marker: {e}"))
                .file(&at.path)
                .hint(hint.clone())
        })?;
        if m.run != self.run && m.fingerprint == self.fingerprint {
            // Left by an earlier run into this output whose clean-up was cut short: its part
            // sent nothing to this run's uploads.
            return Ok(None);
        }
        if m.fingerprint != self.fingerprint || m.part != i || m.parts != self.part.count {
            return Err(Error::invalid("the marker belongs to another run")
                .file(&at.path)
                .hint(hint));
        }
        Ok(Some(m))
    }

    /// Parts without a marker, by index: one listing.
    fn missing(&self) -> Result<Vec<usize>> {
        let done = self.staging.join(DONE)?;
        let names: Vec<String> = done
            .objects_below()?
            .iter()
            .filter_map(|r| r.file_name().map(str::to_string))
            .collect();
        Ok((0..self.part.count)
            .filter(|i| !names.contains(&format!("part-{i}-of-{}.json", self.part.count)))
            .collect())
    }

    /// True when the run is over: a part that finished as this one did committed it and
    /// deleted the staging prefix (`run.json` first) between this part's marker and its look.
    fn committed_elsewhere(&self) -> Result<bool> {
        Ok(!self.staging.join(RUN)?.exists()?)
    }

    /// Refuse to start while a commit holds the lock; delete a lock whose holder, on this host,
    /// is gone (on another host there is no telling: the user decides).
    fn check_no_commit(&self) -> Result<()> {
        let lock = self.staging.join(LOCK)?;
        let Some(by) = lock.read_if_any()? else {
            return Ok(());
        };
        let by = String::from_utf8_lossy(&by).trim().to_string();
        if holder_is_gone(&by) {
            return lock.delete();
        }
        Err(Error::new(
            ErrorKind::Invalid,
            format!("the output is being committed by {by}"),
        )
        .file(&lock.path)
        .hint(
            "wait for it; if that process is gone, delete the lock object and run this part again",
        ))
    }
}

/// Compute and send `mine`, the upload parts of this share (those whose CRCs depend on other
/// shares' bytes held back); the marker that says what was sent.
fn send_share(
    plan: &Plan,
    record: &RunRecord,
    dests: &[Remote],
    dest: &[PathBuf],
    mine: &[UploadSlice],
    me: &Part,
    opts: &ExecOptions,
) -> Result<Marker> {
    let forward = Forward(opts.progress);
    let part_opts = upload::spool_options(opts, &forward);
    let inputs = exec::open_inputs(plan, opts.io)?;
    let mut sending: upload::Sending<UploadSlice> = upload::Sending::new(opts.threads);
    let mut marker = Marker {
        fingerprint: me.fingerprint.clone(),
        run: me.run.clone(),
        part: me.part.index,
        parts: me.part.count,
        host: hostname(),
        pid: std::process::id(),
        sent: Vec::new(),
        held: Vec::new(),
        crcs: Vec::new(),
        open_slots: Vec::new(),
    };
    let mut sent = Vec::new();
    let mut settle = |p: UploadSlice, done: UploadedPart| -> Result<()> {
        sent.push(Sent {
            file: p.file,
            k: p.k,
            id: done.id().to_string(),
        });
        Ok(())
    };
    for &p in mine {
        if opts.cancel.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "interrupted"));
        }
        let outcome = compute(plan, &inputs, dest, p, &part_opts)?;
        marker.crcs.extend(outcome.crcs);
        if !outcome.open_slots.is_empty() {
            marker.open_slots.extend(outcome.open_slots);
            marker.held.push((p.file, p.k));
            continue;
        }
        let id = upload_id(record, p.file)?;
        let send = || upload::send_part(&dest[p.file], &dests[p.file], id, p.k, p.at..p.end);
        sending.send(p, p.end - p.at, send, &mut settle)?;
    }
    sending.finish(&mut settle)?;
    marker.sent = sent;
    if opts.cancel.load(Ordering::Relaxed) {
        return Err(Error::new(ErrorKind::Io, "interrupted"));
    }
    Ok(marker)
}

/// Write upload part `p`'s bytes into the spool.
fn compute(
    plan: &Plan,
    inputs: &[exec::Input],
    dest: &[PathBuf],
    p: UploadSlice,
    opts: &ExecOptions,
) -> Result<exec::ShareOutcome> {
    let share = Share {
        part: PartSpec { index: 0, count: 1 },
        ranges: vec![FileRange {
            file: p.file,
            bytes: p.at..p.end,
        }],
    };
    exec::execute_share_on(plan, inputs, dest, &share, opts)
}

fn upload_id(record: &RunRecord, file: usize) -> Result<&str> {
    record
        .uploads
        .get(file)
        .and_then(|u| u.as_ref())
        .map(|u| u.id.as_str())
        .ok_or_else(|| {
            Error::invalid(format!(
                "the run record has no upload for output file {file}"
            ))
            .hint("delete the staging prefix and run every part again")
        })
}

/// What `ckpt verify` says of an output in an object store whose partitioned run is not
/// committed: `path` is the output or its staging prefix. Anything unreadable is `None` (verify
/// then reports the output as it finds it).
pub fn unfinished(path: &Path) -> Option<Unfinished> {
    let at = crate::storage::remote(path)?.ok()?;
    let name = at.file_name()?.to_string();
    let (staging, output) = match name.strip_prefix('.').and_then(|n| n.strip_suffix(SUFFIX)) {
        Some(out) => (at.clone(), at.parent().join(out).ok()?),
        None => (staging_of(&at.parent(), &name).ok()?, at.clone()),
    };
    let run = staging.join(RUN).ok()?;
    let record = parse_run(&run, &run.read_if_any().ok()??).ok()?;
    let me = Part {
        staging: staging.clone(),
        part: PartSpec {
            index: 0,
            count: record.parts,
        },
        fingerprint: record.fingerprint.clone(),
        run: record.run.clone(),
    };
    let missing = me.missing().ok()?;
    let lock = staging.join(LOCK).ok()?.read_if_any().ok()?;
    let output_exists = output.exists().ok()? || !output.objects_below().ok()?.is_empty();
    Some(Unfinished {
        staging: staging.path.display().to_string(),
        output: output.path.display().to_string(),
        parts: record.parts,
        done: (0..record.parts).filter(|i| !missing.contains(i)).collect(),
        missing,
        command: record.command,
        committing: lock.map(|b| String::from_utf8_lossy(&b).trim().to_string()),
        output_exists,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uploads_start_many_at_once_and_none_stays_open_after_an_interrupt_or_a_refusal() {
        // 40 files, the third streamed or empty: each other file's upload, in file order
        let (slow, dests) = crate::storage::slow_uploads(40, None);
        let staging = dests[0].parent();
        let mut lens = vec![1u64 << 20; 40];
        lens[2] = 0;
        let started = start_uploads(&staging, &dests, &lens, &AtomicBool::new(false)).unwrap();
        for (i, s) in started.iter().enumerate() {
            assert_eq!(
                s.as_ref().map(|s| s.key.as_str()),
                (i != 2).then(|| dests[i].key())
            );
        }
        assert!(slow.most() > 8, "the creates ran one after another");
        assert_eq!(slow.created_and_aborted(), (39, 0));

        let interrupted = start_uploads(&staging, &dests, &lens, &AtomicBool::new(true));
        assert_eq!(interrupted.unwrap_err().to_string(), "interrupted");
        assert_eq!(slow.most(), 0, "an interrupted run began a create");

        let (slow, dests) = crate::storage::slow_uploads(40, Some("__7_0"));
        let staging = dests[0].parent();
        let refused = start_uploads(&staging, &dests, &lens, &AtomicBool::new(false));
        assert!(refused.unwrap_err().to_string().contains("__7_0"));
        let (created, aborted) = slow.created_and_aborted();
        assert!(
            created > 0 && aborted == created,
            "{created} created, {aborted} aborted"
        );
    }

    proptest! {
        /// Every upload part has one owner; owners run in order, so a share is a contiguous run
        /// of upload parts; and each share's bytes are within one upload part of its even share.
        #[test]
        fn upload_parts_are_shared_out_in_runs_near_the_mean(
            lens in prop::collection::vec(prop_oneof![Just(0u64), 1u64..10_000_000], 0..8),
            size in 1u64..3_000_000,
            count in 1usize..9,
        ) {
            let mut pieces = Vec::new();
            for (file, &len) in lens.iter().enumerate() {
                let mut at = 0;
                let mut k = 0;
                while at < len {
                    let end = (at + size).min(len);
                    pieces.push(UploadSlice { file, k, at, end });
                    at = end;
                    k += 1;
                }
            }
            let owners = owners(&lens, &pieces, count);
            prop_assert_eq!(owners.len(), pieces.len());
            prop_assert!(owners.windows(2).all(|w| w[0] <= w[1]));
            prop_assert!(owners.iter().all(|&o| o < count));
            let cuts = crate::part::cuts_aligned(&lens, count, 1);
            for i in 0..count {
                let got: u64 = pieces
                    .iter()
                    .zip(&owners)
                    .filter(|(_, &o)| o == i)
                    .map(|(p, _)| p.end - p.at)
                    .sum();
                let even = cuts[i + 1] - cuts[i];
                prop_assert!(got.abs_diff(even) < size, "share {} has {} bytes for {}", i, got, even);
            }
        }
    }
}
