//! The commit of a partitioned run into an object store, by the part holding `commit.lock`.
//!
//! Before completing any upload the committer records every upload part's id in
//! `completing.json`: from then on the run needs no share again, and a commit cut short (the
//! committer killed) is finished by any part run again, from that record. Completing an upload
//! twice is harmless on Azure (a block list names committed blocks too); on S3 the second try
//! finds the upload gone and the object in place, which is what it wanted. On GCS a second
//! compose of parts still staged makes the same object again, and once any part is deleted the
//! upload is gone as on S3.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::{
    at_once, compute, hostname, upload, upload_id, Finished, Marker, Part, RunRecord, Sent, Spool,
    Started, UploadSlice, CLAIMS, COMPLETING, LOCK, RUN,
};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{self, ExecOptions, OpenSlot, PartialCrc};
use crate::output::OutputKind;
use crate::plan::Plan;
use crate::storage::{Remote, UploadedPart};

/// The id the store gave each upload part, by (file, part number).
type Ids = BTreeMap<(usize, usize), String>;

/// What the part holding the commit lock needs.
pub(super) struct Commit<'a> {
    pub(super) plan: &'a Plan<'a>,
    pub(super) record: &'a RunRecord,
    pub(super) dests: &'a [Remote],
    pub(super) remote: &'a Remote,
    pub(super) kind: OutputKind,
    pub(super) force: bool,
    pub(super) opts: &'a ExecOptions<'a>,
}

impl Commit<'_> {
    /// Take the commit lock (a conditional PUT) and commit; the lock is left to the clean-up
    /// when the commit is done, released otherwise.
    pub(super) fn locked(&self, me: &Part, pieces: &[(UploadSlice, usize)]) -> Result<Finished> {
        let holder = format!(
            "part {} on {} (pid {})",
            me.part,
            hostname(),
            std::process::id()
        );
        let lock = me.staging.join(LOCK)?;
        if !lock.put_new(holder.into_bytes())? {
            let by = lock
                .read_if_any()?
                .map(|b| String::from_utf8_lossy(&b).trim().to_string())
                .unwrap_or_else(|| "another part".into());
            return Ok(Finished::CommittedElsewhere { by });
        }
        let finished = self.run(me, pieces);
        if !matches!(finished, Ok(Finished::Committed)) {
            let _ = lock.delete();
        }
        finished
    }

    /// Holding the lock: the ids of every upload part (from the markers, sending the held-back
    /// parts; or from the record of a commit cut short), then the uploads completed, commit
    /// markers last, and the staging prefix deleted.
    fn run(&self, me: &Part, pieces: &[(UploadSlice, usize)]) -> Result<Finished> {
        let completing = me.staging.join(COMPLETING)?;
        let (ids, resumed, existing) = match completing.read_if_any()? {
            Some(b) => {
                let sent: Vec<Sent> = serde_json::from_slice(&b).map_err(|e| {
                    Error::invalid(format!("not a ckpt commit record: {e}"))
                        .file(&completing.path)
                        .hint("delete the output and its staging prefix, and run every part again")
                })?;
                let ids = sent.into_iter().map(|s| ((s.file, s.k), s.id)).collect();
                (ids, true, Vec::new())
            }
            None => {
                let ids = match self.gather(me, pieces)? {
                    Ok(ids) => ids,
                    Err(_) if me.committed_elsewhere()? => {
                        let by = "another part".to_string();
                        return Ok(Finished::CommittedElsewhere { by });
                    }
                    Err(missing) => return Ok(Finished::Waiting { missing }),
                };
                let existing = upload::existing(self.remote, self.kind, self.force)?;
                upload::unmark(&existing)?;
                let sent: Vec<Sent> = ids
                    .iter()
                    .map(|(&(file, k), id)| Sent {
                        file,
                        k,
                        id: id.clone(),
                    })
                    .collect();
                completing.put(serde_json::to_vec(&sent).unwrap_or_default())?;
                (ids, false, existing)
            }
        };
        if self.opts.cancel.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Io, "interrupted"));
        }
        self.complete(pieces, ids, resumed)?;
        let new: Vec<&str> = self.dests.iter().map(Remote::key).collect();
        for old in existing.iter().filter(|r| !new.contains(&r.key())) {
            let _ = old.delete();
        }
        let keep: Vec<Started> = self.record.uploads.iter().flatten().cloned().collect();
        clean(&me.staging, &keep);
        Ok(Finished::Committed)
    }

    /// Every upload part's id: re-read every marker, and send the parts the shares held back.
    /// The parts without a marker of this run instead (one withdrawn by a part started again
    /// since, which will commit when it is done; one of an earlier run).
    fn gather(
        &self,
        me: &Part,
        pieces: &[(UploadSlice, usize)],
    ) -> Result<std::result::Result<Ids, Vec<usize>>> {
        let all: Vec<usize> = (0..me.part.count).collect();
        let mut markers = Vec::with_capacity(me.part.count);
        let mut missing = Vec::new();
        for (i, m) in at_once(&all, |&i| me.read_marker(i))?
            .into_iter()
            .enumerate()
        {
            match m {
                Some(m) => markers.push(m),
                None => missing.push(i),
            }
        }
        if !missing.is_empty() {
            return Ok(Err(missing));
        }
        let mut ids: Ids = markers
            .iter()
            .flat_map(|m| &m.sent)
            .map(|s| ((s.file, s.k), s.id.clone()))
            .collect();
        let held: Vec<(usize, usize)> = markers.iter().flat_map(|m| m.held.clone()).collect();
        if !held.is_empty() {
            self.send_held(&markers, &held, pieces, &mut ids)?;
        }
        Ok(Ok(ids))
    }

    /// Compute the upload parts the shares held back again, patch their CRCs from every part's
    /// partial CRCs, and send them: one at a time into the spool, each released once sent, so
    /// that the spool and the memory hold a few upload parts whatever the number held.
    fn send_held(
        &self,
        markers: &[Marker],
        held: &[(usize, usize)],
        pieces: &[(UploadSlice, usize)],
        ids: &mut Ids,
    ) -> Result<()> {
        let opts = super::upload::spool_options(self.opts, &exec::NoProgress);
        let spool = Spool::new()?;
        let dest: Vec<PathBuf> = (0..self.plan.file_count()).map(|i| spool.path(i)).collect();
        let inputs = exec::open_inputs(self.plan, self.opts.io)?;
        let held: HashSet<&(usize, usize)> = held.iter().collect();
        let crcs: Vec<PartialCrc> = markers.iter().flat_map(|m| m.crcs.clone()).collect();
        let slots: Vec<OpenSlot> = markers.iter().flat_map(|m| m.open_slots.clone()).collect();
        let mut sending: upload::Sending<UploadSlice> = upload::Sending::new(self.opts.threads);
        let mut settle = |q: UploadSlice, sent: UploadedPart| -> Result<()> {
            ids.insert((q.file, q.k), sent.id().to_string());
            Ok(())
        };
        for (p, _) in pieces.iter().filter(|(p, _)| held.contains(&(p.file, p.k))) {
            if self.opts.cancel.load(Ordering::Relaxed) {
                return Err(Error::new(ErrorKind::Io, "interrupted"));
            }
            compute(self.plan, &inputs, &dest, *p, &opts)?;
            // The slots in this upload part (one cut through stays open in both).
            let mine: Vec<OpenSlot> = slots
                .iter()
                .filter(|s| s.file == p.file && s.slot < p.end && s.slot + 4 > p.at)
                .cloned()
                .collect();
            exec::patch_crcs(&dest, &crcs, &mine, false)?;
            let id = upload_id(self.record, p.file)?;
            let to = &self.dests[p.file];
            let send = || upload::send_part(&dest[p.file], to, id, p.k, p.at..p.end);
            sending.send(*p, p.end - p.at, send, &mut settle)?;
        }
        sending.finish(&mut settle)
    }

    /// Complete every upload from `ids` and put the streamed and empty files: data objects
    /// first, the commit markers last. `resumed`: a commit cut short may have completed some.
    fn complete(&self, pieces: &[(UploadSlice, usize)], mut ids: Ids, resumed: bool) -> Result<()> {
        let plan = self.plan;
        let n = plan.file_count();
        let mut parts: Vec<Vec<UploadedPart>> = vec![Vec::new(); n];
        for (p, _) in pieces {
            let id = ids.remove(&(p.file, p.k)).ok_or_else(|| {
                Error::invalid(format!(
                    "no part reported upload part {} of `{}`",
                    p.k + 1,
                    self.dests[p.file].path.display()
                ))
                .hint("run every part again")
            })?;
            parts[p.file].push(UploadedPart::from_id(id));
        }
        let spool = Spool::new()?;
        let dest: Vec<PathBuf> = (0..n).map(|i| spool.path(i)).collect();
        let finish = |&i: &usize| -> Result<()> {
            let to = &self.dests[i];
            if plan.role(i).is_streamed() {
                exec::write_streamed_files(plan, &dest, false, self.opts.cancel)?;
                let bytes = std::fs::read(&dest[i]).map_err(|e| Error::io(&dest[i], e))?;
                return to.put(bytes);
            }
            let Some(u) = self.record.uploads.get(i).and_then(|u| u.as_ref()) else {
                return to.put(Vec::new());
            };
            if to.complete_open_upload(&u.id, parts[i].clone())? {
                return Ok(());
            }
            // Gone: completed by the commit that was cut short, if the object is in place.
            let len = plan.file_len(i);
            if resumed && to.stat()? == Some(crate::storage::Stat::File(len)) {
                return Ok(());
            }
            Err(Error::invalid(format!(
                "the upload of `{}` is no longer open",
                to.path.display()
            ))
            .hint(
                "it was aborted (by a lifecycle rule?): delete the staging prefix and run \
                         every part again",
            ))
        };
        // Data objects first, at once (a streamed one on its own: they share the spool); the
        // commit markers last.
        let role = |i: usize| plan.role(i);
        let (data, mut rest): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|&i| !role(i).is_commit_marker() && !role(i).is_streamed());
        rest.sort_by_key(|&i| role(i).is_commit_marker());
        at_once(&data, finish)?;
        rest.iter().try_for_each(finish)
    }
}

/// Delete the staging prefix, aborting first the uploads of claims that killed parts left
/// (all but `keep`, the run's own). `run.json` goes first: a part that looks for it then knows
/// the run is committed; the lock last: while it stands no part starts a commit.
pub(super) fn clean(staging: &Remote, keep: &[Started]) {
    if let Ok(run) = staging.join(RUN) {
        let _ = run.delete();
    }
    let Ok(objects) = staging.objects_below() else {
        return;
    };
    for o in &objects {
        if o.key().contains(&format!("/{CLAIMS}/")) {
            let left: Vec<Started> = o
                .read_all()
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            let stale: Vec<Started> = left.into_iter().filter(|s| !keep.contains(s)).collect();
            if !upload::abort(staging, &stale) {
                continue;
            }
        }
        if o.file_name() != Some(LOCK) {
            let _ = o.delete();
        }
    }
    if let Ok(lock) = staging.join(LOCK) {
        let _ = lock.delete();
    }
}
