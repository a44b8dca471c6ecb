//! The output of a partitioned run (`--part I/N`): a staging area that every part shares, one
//! done-marker per part, and a commit by whichever part finds all of them.
//!
//! Parts run anywhere that sees the output's directory (one machine or many, over a shared POSIX
//! filesystem), in any order, at the same time or not; there is no coordinator. Beside the output
//! `NAME` they share `.NAME.ckpt-parts/`:
//!
//! - `run.json`: the run's fingerprint (input files, flags, part count, ckpt version), written once
//!   by the first part (an atomic `link`); a part with another fingerprint refuses to touch the area.
//! - `NAME`: the output being written, each part writing only its share of its bytes.
//! - `done/part-I-of-N.json`: part I's marker, written once its share is synced, holding the
//!   CRC-32s the committer needs (see [`crate::exec::ShareOutcome`]).
//! - `commit.lock`: taken with an atomic `link` by the part that found all N markers; the one that
//!   gets it re-reads the markers, writes what depends on every part (a DCP `.metadata`, ZIP CRCs
//!   that span parts), syncs, and renames `NAME` into place. Until that rename nothing exists
//!   under the output's name.
//!
//! A part that starts removes its own marker before writing, then checks that no commit is under
//! way; a committer re-reads every marker after taking the lock. Whichever order those two happen
//! in, a part is never rewriting bytes that a commit is using.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::local as output;
use super::OutputKind;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{OpenSlot, PartialCrc, ShareOutcome};
use crate::part::PartSpec;

const SUFFIX: &str = ".ckpt-parts";
const RUN: &str = "run.json";
const DONE: &str = "done";
const LOCK: &str = "commit.lock";

/// What every part of one run agrees on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct RunRecord {
    fingerprint: String,
    parts: usize,
    /// The command line of the part that started the area, `--part` shown as `I/N`: for hints.
    command: String,
}

/// A part's done-marker.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Marker {
    fingerprint: String,
    part: usize,
    parts: usize,
    bytes: u64,
    host: String,
    pid: u32,
    crcs: Vec<PartialCrc>,
    open_slots: Vec<OpenSlot>,
}

/// The fingerprint of a run: `description` (flags, target, part count, ckpt version, the output's
/// layout) and the path below `root`, length and modification time of every file the plan reads
/// (`inputs`) and of every file directly in `root` (a DCP `.metadata`, an index). Paths are taken
/// below `root` so that machines mounting the input at different places agree.
pub fn fingerprint(description: &str, inputs: &[PathBuf], root: &Path) -> Result<String> {
    let root = root.canonicalize().map_err(|e| Error::io(root, e))?;
    let mut files: std::collections::BTreeSet<PathBuf> = inputs.iter().cloned().collect();
    if root.is_dir() {
        for entry in std::fs::read_dir(&root).map_err(|e| Error::io(&root, e))? {
            let entry = entry.map_err(|e| Error::io(&root, e))?;
            if entry.file_type().is_ok_and(|t| t.is_file()) {
                files.insert(entry.path());
            }
        }
    } else {
        files.insert(root.clone());
    }
    let mut text = description.to_string();
    for input in &files {
        let meta = std::fs::metadata(input).map_err(|e| Error::io(input, e))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .unwrap_or_default();
        let rel = input
            .strip_prefix(&root)
            .map(Path::to_path_buf)
            .unwrap_or_else(|_| input.file_name().map(PathBuf::from).unwrap_or_default());
        text.push_str(&format!(
            "\ninput {} {} {}.{:09}",
            rel.display(),
            meta.len(),
            mtime.as_secs(),
            mtime.subsec_nanos()
        ));
    }
    Ok(format!(
        "{:032x}",
        xxhash_rust::xxh3::xxh3_128(text.as_bytes())
    ))
}

/// The name of the staging area of output `final_path`.
pub fn staging_of(final_path: &Path) -> PathBuf {
    let name = final_path.file_name().unwrap_or_default().to_string_lossy();
    final_path.with_file_name(format!(".{name}{SUFFIX}"))
}

/// One part's hold on the shared staging area, from [`PartOutput::prepare`] to
/// [`PartOutput::finish`].
#[derive(Debug)]
pub struct PartOutput {
    staging: PathBuf,
    final_path: PathBuf,
    data: PathBuf,
    kind: OutputKind,
    part: PartSpec,
    fingerprint: String,
    force: bool,
    /// A signal stops the part, so that a commit it had begun gives up its lock, instead of
    /// ending the process.
    _armed: crate::interrupt::Armed,
}

/// How a part ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    /// Other parts have not recorded their share yet (indices, 0-based).
    Waiting { missing: Vec<usize> },
    /// This part committed the output.
    Committed,
    /// Every part is done and another one holds the commit lock (its description).
    CommittedElsewhere { by: String },
}

impl PartOutput {
    /// Join (or start) the staging area of `out`: check the output as a plain run does, check
    /// the area's fingerprint, withdraw this part's earlier marker and make sure no commit is
    /// under way.
    pub fn prepare(
        out: &Path,
        input: &Path,
        kind: OutputKind,
        force: bool,
        part: PartSpec,
        fingerprint: &str,
        command: &str,
    ) -> Result<PartOutput> {
        let (_, name, final_path, missing) = output::resolve(out, input, force)?;
        // Shared by every part, so never removed again by one of them.
        for dir in missing {
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
                Err(e) => return Err(Error::io(&dir, e)),
            }
        }
        let staging = staging_of(&final_path);
        match std::fs::create_dir(&staging) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let meta = staging
                    .symlink_metadata()
                    .map_err(|e| Error::io(&staging, e))?;
                if !meta.is_dir() {
                    return Err(Error::invalid(
                        "the staging area of a partitioned run is not a directory",
                    )
                    .file(&staging)
                    .hint("remove it and run the parts again"));
                }
            }
            Err(e) => return Err(Error::io(&staging, e)),
        }
        let me = PartOutput {
            data: staging.join(&name),
            staging,
            final_path,
            kind,
            part,
            fingerprint: fingerprint.to_string(),
            force,
            _armed: crate::interrupt::Armed::new(),
        };
        let record = RunRecord {
            fingerprint: fingerprint.to_string(),
            parts: part.count,
            command: command.to_string(),
        };
        let found = me.claim_run(&record)?;
        if found.fingerprint != record.fingerprint || found.parts != record.parts {
            let what = if found.parts != record.parts {
                format!("{} parts, not {}", found.parts, record.parts)
            } else {
                "another input, other flags or another ckpt version".to_string()
            };
            return Err(Error::usage(format!(
                "the staging area `{}` holds a partitioned run of {what}, started as `{}`",
                me.staging.display(),
                found.command
            ))
            .hint(format!(
                "run every part with the same input and flags, or remove `{}` to start over",
                me.staging.display()
            )));
        }
        std::fs::create_dir_all(me.staging.join(DONE))
            .map_err(|e| Error::io(&me.staging.join(DONE), e))?;
        // Withdraw this part's marker before writing a byte, then check for a commit: a committer
        // re-reads the markers after taking its lock, so it either sees this part missing or
        // holds the lock by now.
        let marker = me.marker_path(part.index);
        match std::fs::remove_file(&marker) {
            Ok(()) => output::sync_dir(&me.staging.join(DONE))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&marker, e)),
        }
        me.check_no_commit()?;
        if kind == OutputKind::Dir {
            std::fs::create_dir_all(&me.data).map_err(|e| Error::io(&me.data, e))?;
        }
        Ok(me)
    }

    /// Where each planned file is written, as [`super::Staging::paths`].
    pub fn paths(&self, relative: &[PathBuf]) -> Vec<PathBuf> {
        match self.kind {
            OutputKind::File => relative.iter().map(|_| self.data.clone()).collect(),
            OutputKind::Dir => relative.iter().map(|p| self.data.join(p)).collect(),
        }
    }

    pub fn final_path(&self) -> &Path {
        &self.final_path
    }

    pub fn staging(&self) -> &Path {
        &self.staging
    }

    /// Record this part as done (its share of `bytes` is synced already), then commit if every
    /// part is. `write_late` writes what depends on no part's bytes but was left to the commit
    /// (streamed files) at the given paths.
    pub fn finish(
        self,
        bytes: u64,
        outcome: ShareOutcome,
        dest: &[PathBuf],
        write_late: impl FnOnce() -> Result<()>,
    ) -> Result<Finished> {
        let marker = Marker {
            fingerprint: self.fingerprint.clone(),
            part: self.part.index,
            parts: self.part.count,
            bytes,
            host: hostname(),
            pid: std::process::id(),
            crcs: outcome.crcs,
            open_slots: outcome.open_slots,
        };
        let text = serde_json::to_vec(&marker)
            .map_err(|e| Error::bug(format!("the part marker cannot be serialized: {e}")))?;
        write_atomic(&self.marker_path(self.part.index), &text)?;
        let missing = self.missing();
        if !missing.is_empty() {
            // Our own marker gone and the output in place: a part that finished at the same
            // moment committed, and removed the markers, between our write and our look.
            if !self.marker_path(self.part.index).exists() && self.final_path.exists() {
                return Ok(Finished::CommittedElsewhere {
                    by: "another part".into(),
                });
            }
            return Ok(Finished::Waiting { missing });
        }
        let lock = self.staging.join(LOCK);
        let me = format!(
            "part {} on {} (pid {})",
            self.part,
            hostname(),
            std::process::id()
        );
        let took = match link_new(&lock, me.as_bytes()) {
            Ok(took) => took,
            // The staging area was removed under us: the part that took the lock has committed.
            Err(_) if !self.staging.exists() && self.final_path.exists() => false,
            Err(e) => return Err(e),
        };
        if !took {
            let by = std::fs::read_to_string(&lock).unwrap_or_else(|_| "another part".into());
            return Ok(Finished::CommittedElsewhere { by });
        }
        let result = self.commit(dest, write_late);
        if result.is_err() {
            let _ = std::fs::remove_file(&lock);
        }
        result
    }

    /// Holding the lock: re-read every marker, write what was left for the end, sync, and rename
    /// the output into place.
    fn commit(
        &self,
        dest: &[PathBuf],
        write_late: impl FnOnce() -> Result<()>,
    ) -> Result<Finished> {
        let mut markers = Vec::with_capacity(self.part.count);
        for i in 0..self.part.count {
            match self.read_marker(i)? {
                Some(m) => markers.push(m),
                // Withdrawn by a part started again since: it will commit when it is done.
                None => {
                    let _ = std::fs::remove_file(self.staging.join(LOCK));
                    return Ok(Finished::Waiting {
                        missing: self.missing(),
                    });
                }
            }
        }
        write_late()?;
        let crcs: Vec<PartialCrc> = markers.iter().flat_map(|m| m.crcs.clone()).collect();
        let slots: Vec<OpenSlot> = markers.iter().flat_map(|m| m.open_slots.clone()).collect();
        crate::exec::patch_crcs(dest, &crcs, &slots, true)?;
        if self.kind == OutputKind::Dir {
            sync_tree(&self.data)?;
        }
        // The markers go before the rename: a commit that dies in between leaves complete bytes
        // that no marker vouches for (every part runs again), never markers of moved bytes.
        let done = self.staging.join(DONE);
        std::fs::remove_dir_all(&done).map_err(|e| Error::io(&done, e))?;
        output::sync_dir(&self.staging)?;
        output::move_into_place(&self.data, &self.final_path, self.force, || {})?;
        output::remove_path(&self.staging);
        Ok(Finished::Committed)
    }

    fn marker_path(&self, i: usize) -> PathBuf {
        marker_path(&self.staging, i, self.part.count)
    }

    fn read_marker(&self, i: usize) -> Result<Option<Marker>> {
        let path = self.marker_path(i);
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(&path, e)),
        };
        let m: Marker = serde_json::from_slice(&text).map_err(|e| {
            Error::invalid(format!("not a ckpt part marker: {e}"))
                .file(&path)
                .hint(format!("run part {i}/{} again", self.part.count))
        })?;
        if m.fingerprint != self.fingerprint || m.part != i || m.parts != self.part.count {
            return Err(Error::invalid("the marker belongs to another run")
                .file(&path)
                .hint(format!("run part {i}/{} again", self.part.count)));
        }
        Ok(Some(m))
    }

    fn missing(&self) -> Vec<usize> {
        done_parts(&self.staging, self.part.count).1
    }

    /// `run.json` as found, writing ours first if there is none.
    fn claim_run(&self, record: &RunRecord) -> Result<RunRecord> {
        let path = self.staging.join(RUN);
        let text = serde_json::to_vec_pretty(record)
            .map_err(|e| Error::bug(format!("the run record cannot be serialized: {e}")))?;
        link_new(&path, &text)?;
        let found = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        serde_json::from_slice(&found).map_err(|e| {
            Error::invalid(format!("not a ckpt run record: {e}"))
                .file(&path)
                .hint(format!("remove `{}` to start over", self.staging.display()))
        })
    }

    /// Refuse to start while a commit holds the lock; clear a lock whose holder, on this host,
    /// is gone (on another host there is no telling: the user decides).
    fn check_no_commit(&self) -> Result<()> {
        let lock = self.staging.join(LOCK);
        let Ok(by) = std::fs::read_to_string(&lock) else {
            return Ok(());
        };
        if holder_is_gone(&by) {
            // Move the lock aside under a name of our own and make sure it is the one we read:
            // a lock taken since by a live part goes back.
            let aside = self
                .staging
                .join(format!("{LOCK}.stale-{}", std::process::id()));
            if std::fs::rename(&lock, &aside).is_ok() {
                let moved = std::fs::read_to_string(&aside).unwrap_or_default();
                if moved == by {
                    let _ = std::fs::remove_file(&aside);
                    return Ok(());
                }
                let _ = std::fs::hard_link(&aside, &lock);
                let _ = std::fs::remove_file(&aside);
            }
        }
        let by = std::fs::read_to_string(&lock).unwrap_or(by);
        Err(Error::new(
            ErrorKind::Invalid,
            format!("the output is being committed by {}", by.trim()),
        )
        .file(&lock)
        .hint("wait for it; if that process is gone, remove the lock file and run this part again"))
    }
}

/// What `ckpt verify` says of an output that a partitioned run has not committed.
#[derive(Clone, Debug, Serialize)]
pub struct Unfinished {
    /// The staging area.
    pub staging: String,
    /// The output it becomes.
    pub output: String,
    pub parts: usize,
    pub done: Vec<usize>,
    pub missing: Vec<usize>,
    /// The command line the run was started with (`--part` shown as `I/N`).
    pub command: String,
    /// Who holds the commit lock, if anyone.
    pub committing: Option<String>,
    /// True when the output exists already (a `--force` run is staged beside it).
    pub output_exists: bool,
}

/// The unfinished partitioned run on a filesystem that `path` names: the staging area itself, a
/// path inside it, or an output with a staging area beside it.
pub fn unfinished(path: &Path) -> Option<Unfinished> {
    let abs = std::path::absolute(path).ok()?;
    let is_staging = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.') && n.ends_with(SUFFIX))
            && p.join(RUN).is_file()
    };
    let staging = abs
        .ancestors()
        .find(|p| is_staging(p))
        .map(Path::to_path_buf)
        .or_else(|| Some(staging_of(&abs)).filter(|s| is_staging(s)))?;
    let name = staging.file_name()?.to_str()?;
    let output_name = name.strip_prefix('.')?.strip_suffix(SUFFIX)?;
    let output = staging.with_file_name(output_name);
    let record: RunRecord = serde_json::from_slice(&std::fs::read(staging.join(RUN)).ok()?).ok()?;
    let (done, missing) = done_parts(&staging, record.parts);
    Some(Unfinished {
        staging: staging.display().to_string(),
        output_exists: output.symlink_metadata().is_ok(),
        output: output.display().to_string(),
        parts: record.parts,
        done,
        missing,
        command: record.command,
        committing: std::fs::read_to_string(staging.join(LOCK))
            .ok()
            .map(|s| s.trim().to_string()),
    })
}

fn marker_path(staging: &Path, i: usize, n: usize) -> PathBuf {
    staging.join(DONE).join(format!("part-{i}-of-{n}.json"))
}

/// Parts with a marker and parts without, by index.
fn done_parts(staging: &Path, n: usize) -> (Vec<usize>, Vec<usize>) {
    (0..n).partition(|&i| marker_path(staging, i, n).is_file())
}

/// Write `bytes` to `path` under a temporary name, synced, then rename it into place.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_beside(path);
    let result = write_synced(&tmp, bytes).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
        output::sync_dir(path.parent().unwrap_or(Path::new(".")))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Create `path` holding `bytes` unless it exists, atomically (a synced temporary, then `link`,
/// which never replaces: the one primitive NFS also makes atomic). True when this call created it.
fn link_new(path: &Path, bytes: &[u8]) -> Result<bool> {
    let tmp = temp_beside(path);
    write_synced(&tmp, bytes)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            output::sync_dir(path.parent().unwrap_or(Path::new(".")))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn temp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.{}-{}", hostname(), std::process::id()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let _ = std::fs::remove_file(path);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .map_err(|e| Error::io(path, e))
}

/// Sync every directory under `dir` (the files were synced by the parts that wrote them).
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        if entry.file_type().map_err(|e| Error::io(dir, e))?.is_dir() {
            sync_tree(&entry.path())?;
        }
    }
    output::sync_dir(dir)
}

pub(super) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// True when a lock's holder (`part I/N on HOST (pid P)`) ran on this host and is gone.
pub(super) fn holder_is_gone(by: &str) -> bool {
    let Some((_, rest)) = by.split_once(" on ") else {
        return false;
    };
    let Some((host, pid)) = rest.trim().split_once(" (pid ") else {
        return false;
    };
    let Some(pid) = pid.strip_suffix(')').and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    host == hostname() && pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_of_many_racing_links_wins() {
        let dir = tempfile::tempdir().unwrap();
        let lock = dir.path().join(LOCK);
        let wins: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|k| {
                    let lock = lock.clone();
                    let tmp = dir.path().join(format!("t{k}"));
                    s.spawn(move || {
                        // Distinct temporaries per thread, as distinct processes would have.
                        write_synced(&tmp, format!("{k}").as_bytes()).unwrap();
                        let won = std::fs::hard_link(&tmp, &lock).is_ok();
                        std::fs::remove_file(&tmp).unwrap();
                        won as usize
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(wins, 1);
        assert!(!link_new(&lock, b"late").unwrap());
    }

    #[test]
    fn a_lock_of_a_gone_process_on_this_host_is_stale() {
        let me = hostname();
        assert!(!holder_is_gone(&format!(
            "part 0/2 on {me} (pid {})",
            std::process::id()
        )));
        assert!(!holder_is_gone(
            "part 0/2 on another-host-name (pid 4000000)"
        ));
        assert!(holder_is_gone(&format!("part 0/2 on {me} (pid 4000000)")));
        assert!(!holder_is_gone("garbage"));
    }
}
