//! Writing a plan's output into an object store: multipart uploads, their parts computed by the
//! executor's share machinery, commit markers last.
//!
//! Each output file is cut into upload parts of [`part_size`] bytes. A part is one share of the
//! file (as for `--part`): the executor writes exactly those bytes into a sparse spool file in the
//! temporary directory, they are read back and uploaded, and their pages are released. A part
//! holding a ZIP CRC that depends on bytes of other parts (a torch.save record or a DCP item cut
//! by a part boundary) is kept in the spool until every part is done, patched from the parts'
//! partial CRCs, and uploaded then: multipart part numbers fix the order, not upload time.
//!
//! Nothing appears as a checkpoint before it is complete: an object becomes visible only when its
//! multipart upload completes, data objects complete first (a few dozen at once, as the uploads
//! are created: a round trip each), and the files the plan marks as commit markers
//! ([`crate::plan::FileRole`]) last. The uploads a run starts are recorded in a
//! journal object beside the output (`.NAME.ckpt-uploads/PID.json`) before any part is sent; a
//! failed or interrupted run aborts them, and a run killed outright has them aborted by the next
//! run into the same place. On GCS a multipart upload is the storage seam's own (parts staged as
//! objects in `.NAME.ckpt-parts/` beside the output and composed when it completes, see
//! `src/storage/gcs.rs`): the same steps, and an abort deletes the staged parts.

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use super::OutputKind;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{self, ExecOptions, Progress};
use crate::part::{FileRange, PartSpec, Share};
use crate::plan::{self, Plan};
use crate::storage::{PendingPart, Remote, UploadedPart};

/// Smallest upload part (S3 wants at least 5 MiB for all but the last).
const MIN_PART: u64 = 16 << 20;
/// S3 allows 10,000 parts per upload.
const MAX_PARTS: u64 = 10_000;

/// Upload part size for a file of `len` bytes.
pub fn part_size(len: u64) -> u64 {
    MIN_PART.max(len.div_ceil(MAX_PARTS).next_multiple_of(1 << 20))
}

/// Where file `i` of `plan` (of `len` bytes) is cut into upload parts: `0`, the cuts, `len`.
/// Cuts are [`part_size`] apart, each moved forward (by less than a part) to the end of a ZIP
/// record it would cut, with the CRC slots that belong to it: a part that holds a record whole
/// can be sent as soon as it is computed. A cut that cannot move so far (a record larger than a
/// part, or a torch.save file whose central directory at the end names every record's CRC)
/// stays, and the part holding the slot waits for the other parts' CRCs.
pub(super) fn part_cuts(plan: &Plan, i: usize, len: u64) -> Result<Vec<u64>> {
    let size = part_size(len);
    let file = plan.file(i)?;
    let mut spans: Vec<(u64, u64)> = file
        .regions
        .iter()
        .filter(|r| !r.crc_slots.is_empty())
        .map(|r| {
            let last_slot = r.crc_slots.iter().map(|s| s + 4).max().unwrap_or(0);
            (r.offset, (r.offset + r.nbytes()).max(last_slot))
        })
        .collect();
    spans.sort_unstable();
    let mut cuts = vec![0];
    let mut at = 0;
    let mut k = 0;
    loop {
        let mut cut = at + size;
        if cut >= len {
            break;
        }
        while k < spans.len() && spans[k].1 <= cut {
            k += 1;
        }
        // The spans that contain the cut, merged: the cut moves past all of them or stays.
        let mut end = cut;
        let mut j = k;
        while j < spans.len() && spans[j].0 < end {
            end = end.max(spans[j].1);
            j += 1;
        }
        if end > cut && end - cut < size {
            cut = end;
        }
        if cut >= len {
            break;
        }
        cuts.push(cut);
        at = cut;
    }
    cuts.push(len);
    Ok(cuts)
}

/// Parts uploading at once for `threads` workers (0: one per core): the memory bound is this
/// many parts of [`part_size`] bytes.
pub fn in_flight(threads: usize) -> usize {
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    2 * threads
}

/// Most upload parts in flight at once, however small.
const PARTS_IN_FLIGHT: usize = 64;

/// Upload parts being sent, oldest first. Each holds its bytes until the store has them, so
/// what bounds them is their bytes: [`in_flight`] parts of at least [`MIN_PART`] as before, and
/// as many smaller ones as fit in the same bytes (up to [`PARTS_IN_FLIGHT`]). A reshard's 1,024
/// one-part rank files of a few KiB went 2 x threads at a time (4 on 2 cores): 256 round trips
/// one after another.
pub(super) struct Sending<K> {
    queue: VecDeque<(K, u64, PendingPart)>,
    bytes: u64,
    /// Parts always let in flight, whatever their size, and the bytes smaller ones may fill.
    floor: usize,
    budget: u64,
}

impl<K> Sending<K> {
    pub(super) fn new(threads: usize) -> Sending<K> {
        let floor = in_flight(threads);
        Sending {
            queue: VecDeque::new(),
            bytes: 0,
            floor,
            budget: floor as u64 * MIN_PART,
        }
    }

    /// Send a part of `len` bytes with `send` once there is room for it, waiting for the oldest
    /// parts first; each that finishes goes to `done` with its key.
    pub(super) fn send(
        &mut self,
        key: K,
        len: u64,
        send: impl FnOnce() -> Result<PendingPart>,
        done: &mut impl FnMut(K, UploadedPart) -> Result<()>,
    ) -> Result<()> {
        while !self.has_room(len) {
            self.settle_oldest(done)?;
        }
        let pending = send()?;
        self.bytes += len;
        self.queue.push_back((key, len, pending));
        Ok(())
    }

    /// Wait for every part still in flight.
    pub(super) fn finish(
        &mut self,
        done: &mut impl FnMut(K, UploadedPart) -> Result<()>,
    ) -> Result<()> {
        while !self.queue.is_empty() {
            self.settle_oldest(done)?;
        }
        Ok(())
    }

    fn has_room(&self, len: u64) -> bool {
        let n = self.queue.len();
        n < self.floor || (n < PARTS_IN_FLIGHT && self.bytes + len <= self.budget)
    }

    fn settle_oldest(
        &mut self,
        done: &mut impl FnMut(K, UploadedPart) -> Result<()>,
    ) -> Result<()> {
        let Some((key, len, pending)) = self.queue.pop_front() else {
            return Ok(());
        };
        self.bytes -= len;
        done(key, pending.wait()?)
    }
}

/// One upload this run started, as the journal records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Started {
    pub(super) key: String,
    pub(super) id: String,
}

/// Abort `uploads` (keys in `at`'s store). False if one may still be open (its abort failed,
/// e.g. throttled past its retries): the journal that lists them is then kept, for the next run
/// into the same place.
pub(super) fn abort(at: &Remote, uploads: &[Started]) -> bool {
    let mut closed = true;
    let mut open = Vec::with_capacity(uploads.len());
    for s in uploads {
        match at.with_key(&s.key) {
            Ok(r) => open.push((r, s.id.clone())),
            Err(_) => closed = false,
        }
    }
    crate::storage::abort_uploads(open) && closed
}

/// The run's uploads: aborted (and the journal removed once they are) unless committed, and
/// the objects it completed before it failed deleted again.
struct Uploads {
    journal: Remote,
    started: Vec<Started>,
    completed: Vec<Remote>,
    committed: bool,
}

impl Drop for Uploads {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        for done in &self.completed {
            let _ = done.delete();
        }
        if abort(&self.journal, &self.started) {
            let _ = self.journal.delete();
        }
    }
}

/// Start the multipart upload of each of `dests` listed in `todo`, a few dozen at once (a round
/// trip each: a reshard to a thousand ranks would wait for a thousand one after another): what
/// was started, per file of `dests`, and the first failure or interrupt. What was started is
/// known even then, so that the caller aborts it.
pub(super) fn start_uploads(
    staging: &Remote,
    dests: &[Remote],
    todo: &[usize],
    cancel: &AtomicBool,
) -> (Vec<Option<Started>>, Result<()>) {
    let at: Vec<Remote> = todo.iter().map(|&i| dests[i].clone()).collect();
    let (ids, result) = crate::storage::create_uploads(&at, staging, cancel);
    let mut started = vec![None; dests.len()];
    for (&i, id) in todo.iter().zip(ids) {
        started[i] = id.map(|id| Started {
            key: dests[i].key().to_string(),
            id,
        });
    }
    (started, result)
}

fn interrupted() -> Error {
    Error::new(ErrorKind::Io, "interrupted")
}

/// Forwards the executor's per-part progress to the run's, which spans every part.
pub(super) struct Forward<'a>(pub(super) &'a dyn Progress);
impl Progress for Forward<'_> {
    fn advance(&self, bytes: u64) {
        self.0.advance(bytes);
    }
}

/// `opts` for the executor writing upload parts into a spool: the same threads, I/O and stop
/// flag, `progress` for the run's, and no sync (the spool is read back and uploaded, not kept).
pub(super) fn spool_options<'a>(
    opts: &ExecOptions<'a>,
    progress: &'a dyn Progress,
) -> ExecOptions<'a> {
    ExecOptions {
        threads: opts.threads,
        io: opts.io,
        progress,
        cancel: opts.cancel,
        durable: false,
    }
}

/// A sparse file per output file in the temporary directory, removed when dropped.
///
/// A run killed outright (SIGKILL, out of memory) cannot remove its spool, which holds up to the
/// parts in flight of every file; the next run does. A live run holds an exclusive lock on its
/// spool's `.lock` file, which the kernel releases when the process ends however it ends: a
/// spool whose lock can be taken is a dead run's. (A process id would do on one host, but not in
/// a temporary directory shared between containers, each with process ids of its own.)
pub(super) struct Spool {
    dir: PathBuf,
    /// Held while the run lives.
    _lock: File,
}

const SPOOL_PREFIX: &str = "ckpt-spool-";
const SPOOL_LOCK: &str = ".lock";

impl Spool {
    /// A new empty spool directory, named by process and time, after removing the spools of runs
    /// that are gone.
    pub(super) fn new() -> Result<Spool> {
        let tmp = std::env::temp_dir();
        remove_dead_spools(&tmp);
        let dir = tmp.join(format!(
            "{SPOOL_PREFIX}{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::create_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        // Locked under another name, then renamed: another run never finds `.lock` unlocked
        // while this one lives.
        let (new, lock_path) = (dir.join(".lock-new"), dir.join(SPOOL_LOCK));
        let lock = File::create(&new).map_err(|e| Error::io(&new, e))?;
        lock_exclusive(&lock, false).map_err(|e| Error::io(&new, e))?;
        std::fs::rename(&new, &lock_path).map_err(|e| Error::io(&lock_path, e))?;
        Ok(Spool { dir, _lock: lock })
    }

    /// Where output file `i` is spooled.
    pub(super) fn path(&self, i: usize) -> PathBuf {
        self.dir.join(format!("{i}"))
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Take an exclusive `flock(2)` on `file` (std's `File::lock` is newer than our MSRV, 1.85):
/// waiting for it, or with `nowait` failing at once if another open file description holds it.
fn lock_exclusive(file: &File, nowait: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let op = libc::LOCK_EX | if nowait { libc::LOCK_NB } else { 0 };
    // SAFETY: a plain syscall on a descriptor we own; no memory of ours is involved.
    match unsafe { libc::flock(file.as_raw_fd(), op) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Remove the `ckpt-spool-*` directories in `tmp` whose run is gone: their `.lock` can be locked.
fn remove_dead_spools(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for entry in entries.flatten() {
        let is_spool = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(SPOOL_PREFIX));
        if !is_spool {
            continue;
        }
        let Ok(lock) = File::open(entry.path().join(SPOOL_LOCK)) else {
            continue;
        };
        if lock_exclusive(&lock, true).is_ok() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Release the pages of `len` bytes at `offset` of a spool file once they are uploaded.
fn punch(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on a descriptor we own; no memory of ours is involved. Only a hint:
    // on a filesystem without hole punching the spool keeps its pages.
    unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        );
    }
}

/// Send bytes `range` of the spool file at `path` as part `k` of upload `id` to `to`, releasing
/// their pages.
pub(super) fn send_part(
    path: &Path,
    to: &Remote,
    id: &str,
    k: usize,
    range: std::ops::Range<u64>,
) -> Result<PendingPart> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut buf = vec![0u8; (range.end - range.start) as usize];
    file.read_exact_at(&mut buf, range.start)
        .map_err(|e| Error::io(path, e).at(range.start))?;
    punch(&file, range.start, range.end - range.start);
    to.upload_part(id, k, buf)
}

/// The remote location of output `out` and its name, refused when it overlaps `input`.
pub(super) fn output_of(out: &Path, input: &Path) -> Result<(Remote, String)> {
    let remote = crate::storage::remote(out)
        .ok_or_else(|| Error::usage("internal: not a remote output"))??;
    let out_s = out.to_string_lossy();
    let in_s = input.to_string_lossy();
    if out_s == in_s
        || in_s.starts_with(&format!("{out_s}/"))
        || out_s.starts_with(&format!("{in_s}/"))
    {
        return Err(Error::usage(format!(
            "the output `{out_s}` is, contains or lies inside the input `{in_s}`"
        ))
        .hint("write the output somewhere else: ckpt never modifies its input"));
    }
    let name = remote
        .file_name()
        .ok_or_else(|| Error::usage(format!("`{out_s}` is not a usable output name")))?
        .to_string();
    Ok((remote, name))
}

/// The objects of the output at `remote` that exist already (refused without `force`).
pub(super) fn existing(remote: &Remote, kind: OutputKind, force: bool) -> Result<Vec<Remote>> {
    let existing: Vec<Remote> = match kind {
        OutputKind::File => match remote.exists()? {
            true => vec![remote.clone()],
            false => Vec::new(),
        },
        OutputKind::Dir => remote.objects_below()?,
    };
    if !existing.is_empty() && !force {
        return Err(
            Error::usage(format!("`{}` already exists", remote.path.display()))
                .hint("pass --force to replace it"),
        );
    }
    Ok(existing)
}

/// Where each of `plan`'s files goes: `remote` itself, or objects below it.
pub(super) fn destinations(plan: &Plan, remote: &Remote, kind: OutputKind) -> Result<Vec<Remote>> {
    (0..plan.file_count())
        .map(|i| match kind {
            OutputKind::File => Ok(remote.clone()),
            OutputKind::Dir => {
                let rel = plan.path(i);
                let rel = rel
                    .to_str()
                    .ok_or_else(|| Error::invalid("output name is not UTF-8"))?;
                remote
                    .join(rel)
                    .map_err(|e| Error::invalid(format!("output name `{rel}`: {e}")))
            }
        })
        .collect()
}

/// Delete the commit markers among `existing` (an output being replaced): it stops being a
/// checkpoint before any of it is.
pub(super) fn unmark(existing: &[Remote]) -> Result<()> {
    for old in existing.iter().filter(|r| {
        r.file_name()
            .is_some_and(|f| plan::COMMIT_MARKERS.contains(&f))
    }) {
        old.delete()?;
    }
    Ok(())
}

/// Write `plan`'s output to the remote location `out` (a single object for `OutputKind::File`,
/// objects under `out/` for `OutputKind::Dir`), reading from `input` (refused if they overlap).
pub fn write(
    plan: &Plan,
    input: &Path,
    out: &Path,
    kind: OutputKind,
    force: bool,
    opts: &ExecOptions,
) -> Result<()> {
    let (remote, name) = output_of(out, input)?;
    let journal_dir = remote.parent().join(&format!(".{name}.ckpt-uploads"))?;
    // Where a store whose upload parts are objects (GCS) stages them: beside the output too.
    let parts_dir = remote.parent().join(&format!(".{name}.ckpt-parts"))?;
    // From here until the uploads are aborted or complete (it is dropped last), a signal stops
    // the run rather than the process.
    let _armed = crate::interrupt::Armed::new();
    abort_killed_runs(&journal_dir, out)?;

    let existing = existing(&remote, kind, force)?;
    let n = plan.file_count();
    let dests = destinations(plan, &remote, kind)?;
    if force {
        unmark(&existing)?;
    }

    let spool = Spool::new()?;
    let mut uploads = Uploads {
        journal: journal_dir.join(&format!("{}.json", std::process::id()))?,
        started: Vec::new(),
        completed: Vec::new(),
        committed: false,
    };
    let todo: Vec<usize> = (0..n)
        .filter(|&i| !plan.role(i).is_streamed() && plan.file_len(i) > 0)
        .collect();
    // Those started before a failure are aborted with the rest, when `uploads` is dropped.
    let (started, all_created) = start_uploads(&parts_dir, &dests, &todo, opts.cancel);
    uploads.started = started.iter().flatten().cloned().collect();
    let ids: Vec<Option<String>> = started.into_iter().map(|s| s.map(|s| s.id)).collect();
    all_created?;
    let journal = serde_json::to_vec(&uploads.started).unwrap_or_default();
    uploads.journal.put(journal)?;

    opts.progress.start(plan.data_bytes());
    let run = Upload {
        plan,
        dests: &dests,
        spooled: (0..n).map(|i| spool.path(i)).collect(),
        ids,
        opts,
    };
    let parts = run.send_parts()?;
    run.complete(&parts, &mut uploads)?;
    uploads.committed = true;
    let _ = uploads.journal.delete();
    // Objects of a replaced output that the new one does not have.
    let new: HashSet<&str> = dests.iter().map(Remote::key).collect();
    for old in existing.iter().filter(|r| !new.contains(r.key())) {
        let _ = old.delete();
    }
    opts.progress.finish();
    drop(spool);
    Ok(())
}

/// Abort the uploads of runs into the same place that were killed before they could abort
/// them, as their journals in `journal_dir` list them. The run's first request: a missing
/// bucket or refused credentials show here, and are named as the output `out`, not as the
/// journal's hidden prefix.
fn abort_killed_runs(journal_dir: &Remote, out: &Path) -> Result<()> {
    let journals = journal_dir.objects_below().map_err(|mut e| {
        e.file = Some(out.to_path_buf());
        e
    })?;
    for j in journals {
        let closed = match j.read_all() {
            Ok(b) => abort(
                &j,
                &serde_json::from_slice::<Vec<Started>>(&b).unwrap_or_default(),
            ),
            Err(_) => false,
        };
        if closed {
            let _ = j.delete();
        }
    }
    Ok(())
}

/// One run's upload of a plan's files: each written into the spool a part at a time and sent.
struct Upload<'a> {
    plan: &'a Plan<'a>,
    /// Where each file goes.
    dests: &'a [Remote],
    /// Where each file is spooled.
    spooled: Vec<PathBuf>,
    /// Each file's multipart upload, for those uploaded in parts.
    ids: Vec<Option<String>>,
    opts: &'a ExecOptions<'a>,
}

impl Upload<'_> {
    /// Write every upload part of every file into the spool and send it, a bounded number in
    /// flight; a part whose CRC slots need other parts' bytes is held until they are written.
    /// Returns each file's uploaded parts, in order.
    fn send_parts(&self) -> Result<Vec<Vec<UploadedPart>>> {
        let (plan, opts) = (self.plan, self.opts);
        let n = plan.file_count();
        let forward = Forward(opts.progress);
        let part_opts = spool_options(opts, &forward);
        let inputs = exec::open_inputs(plan, opts.io)?;
        let mut sending: Sending<(usize, usize)> = Sending::new(opts.threads);
        let mut parts: Vec<Vec<Option<UploadedPart>>> = vec![Vec::new(); n];
        let mut held: Vec<(usize, usize, u64, u64)> = Vec::new();
        let mut crcs = Vec::new();
        let mut slots = Vec::new();
        let send = |i: usize, k: usize, at: u64, len: u64| -> Result<PendingPart> {
            let id = self.ids[i].as_deref().unwrap_or_default();
            send_part(&self.spooled[i], &self.dests[i], id, k, at..at + len)
        };
        // Where each file uploaded in parts is cut (`[0, len]` and the cuts between), else nothing.
        let cuts: Vec<Vec<u64>> = (0..n)
            .map(|i| match self.ids[i] {
                Some(_) => part_cuts(plan, i, plan.file_len(i)),
                None => Ok(Vec::new()),
            })
            .collect::<Result<_>>()?;
        for (i, c) in cuts.iter().enumerate() {
            parts[i] = vec![None; c.len().saturating_sub(1)];
        }
        let mut sent = |(i, k): (usize, usize), part: UploadedPart| -> Result<()> {
            parts[i][k] = Some(part);
            Ok(())
        };
        for (i, cuts) in cuts.iter().enumerate() {
            for (k, w) in cuts.windows(2).enumerate() {
                if opts.cancel.load(Ordering::Relaxed) {
                    return Err(interrupted());
                }
                let (at, len) = (w[0], w[1] - w[0]);
                let share = Share {
                    part: PartSpec { index: 0, count: 1 },
                    ranges: vec![FileRange {
                        file: i,
                        bytes: at..at + len,
                    }],
                };
                let outcome =
                    exec::execute_share_on(plan, &inputs, &self.spooled, &share, &part_opts)?;
                crcs.extend(outcome.crcs);
                if !outcome.open_slots.is_empty() {
                    slots.extend(outcome.open_slots);
                    held.push((i, k, at, len));
                    continue;
                }
                sending.send((i, k), len, || send(i, k, at, len), &mut sent)?;
            }
        }
        // The parts whose CRC slots needed other parts' bytes: patched, then sent.
        exec::patch_crcs(&self.spooled, &crcs, &slots, false)?;
        for (i, k, at, len) in held {
            sending.send((i, k), len, || send(i, k, at, len), &mut sent)?;
        }
        sending.finish(&mut sent)?;
        Ok(parts
            .into_iter()
            .map(|p| p.into_iter().flatten().collect())
            .collect())
    }

    /// Make the uploaded files objects: the streamed files (a DCP `.metadata`: seconds at
    /// millions of pieces) written to the spool first, so that an interrupt while they are
    /// written leaves no object under the output's name; then the data objects, a few dozen at
    /// once (a round trip each); the commit markers (one or two) last, once every data object is
    /// in place. What was completed is recorded in `uploads`, to be deleted if the run fails.
    fn complete(&self, parts: &[Vec<UploadedPart>], uploads: &mut Uploads) -> Result<()> {
        let (plan, opts) = (self.plan, self.opts);
        let n = plan.file_count();
        exec::write_streamed_files(plan, &self.spooled, false, opts.cancel)?;
        let data: Vec<_> = (0..n)
            .filter(|&i| !plan.role(i).is_commit_marker())
            .map(|i| {
                let upload = self.ids[i].clone().map(|id| (id, parts[i].clone()));
                (self.dests[i].clone(), upload)
            })
            .collect();
        let (done, all_done) = crate::storage::complete_uploads(&data, opts.cancel);
        for ((to, _), done) in data.into_iter().zip(done) {
            if done {
                uploads.completed.push(to);
            }
        }
        all_done?;
        for i in (0..n).filter(|&i| plan.role(i).is_commit_marker()) {
            if opts.cancel.load(Ordering::Relaxed) {
                return Err(interrupted());
            }
            let to = &self.dests[i];
            if plan.role(i).is_streamed() {
                let bytes =
                    std::fs::read(&self.spooled[i]).map_err(|e| Error::io(&self.spooled[i], e))?;
                to.put(bytes)?;
            } else if let Some(id) = &self.ids[i] {
                to.complete_upload(id, parts[i].clone())?;
            } else {
                to.put(Vec::new())?;
            }
            uploads.completed.push(to.clone());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upload into an in-memory store, and where it goes.
    fn upload() -> (Remote, String) {
        let to = Remote::in_memory("out/__0_0.distcp");
        let id = to.create_upload(&to.parent()).unwrap();
        (to, id)
    }

    /// The most parts [`Sending`] had in flight sending 100 parts of `len` bytes each, with 2
    /// threads; every part is settled, in order.
    fn most_in_flight(len: u64) -> usize {
        let (to, id) = upload();
        let mut sending: Sending<usize> = Sending::new(2);
        let mut settled = Vec::new();
        let mut settle = |k: usize, _part: UploadedPart| -> Result<()> {
            settled.push(k);
            Ok(())
        };
        let mut most = 0;
        for k in 0..100 {
            let send = || to.upload_part(&id, k, vec![k as u8; 16]);
            sending.send(k, len, send, &mut settle).unwrap();
            most = most.max(sending.queue.len());
        }
        sending.finish(&mut settle).unwrap();
        assert_eq!(settled, (0..100).collect::<Vec<_>>());
        most
    }

    #[test]
    fn the_spools_of_dead_runs_are_removed_and_no_other() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = |name: &str| {
            let d = tmp.path().join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("0"), b"part").unwrap();
            d
        };
        // A dead run's: its lock released. A live run's: locked (another open file description
        // of the same file conflicts, in one process too). One being made: no `.lock` yet.
        std::fs::write(dir("ckpt-spool-1-1").join(SPOOL_LOCK), b"").unwrap();
        let live = File::create(dir("ckpt-spool-2-2").join(SPOOL_LOCK)).unwrap();
        lock_exclusive(&live, false).unwrap();
        dir("ckpt-spool-3-3");
        std::fs::write(dir("not-a-spool").join(SPOOL_LOCK), b"").unwrap();
        remove_dead_spools(tmp.path());
        let mut left: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["ckpt-spool-2-2", "ckpt-spool-3-3", "not-a-spool"]);
        // and a spool of this run's own is locked from the start
        let spool = Spool::new().unwrap();
        let name = spool.dir.file_name().unwrap().to_owned();
        remove_dead_spools(spool.dir.parent().unwrap());
        assert!(spool.dir.join(SPOOL_LOCK).is_file(), "{name:?} was removed");
        drop(live);
    }

    #[test]
    fn small_parts_go_many_at_once_in_the_bytes_of_a_few_large_ones() {
        // 2 threads: 4 parts of 16 MiB in flight, 64 MiB.
        assert_eq!(most_in_flight(4 << 10), PARTS_IN_FLIGHT);
        assert_eq!(most_in_flight(2 << 20), 32);
        assert_eq!(most_in_flight(MIN_PART), 4);
        // Larger parts (files beyond 160 GB): as many as before, whatever their size.
        assert_eq!(most_in_flight(100 << 20), 4);
    }
}
