//! Per-rank torch.save files: one `torch.save(state_dict)` per rank, read as one SHARDED checkpoint.
//!
//! Many training codes save without DCP. FSDP2's `model.state_dict()` holds DTensors, whose pickle
//! records the global shape, the device mesh, the placements and the saving rank's mesh coordinate:
//! the rank's piece follows from torch.chunk geometry ([`crate::geometry::local_box_at`]). FSDP1's
//! `SHARDED_STATE_DICT` holds ShardedTensors, whose pickle lists every shard's offsets and sizes. The
//! torch.save reader decodes both as data (`torch_save::distributed`) into
//! [`torch_save::ShardedLeaf`]s; this module reads sets of such files as one checkpoint. Files are named as veRL and others name them (`{prefix}_world_size_{W}_rank_{R}.pt`,
//! `rank{R}.pt`, `{prefix}_rank{R}.pt`); the prefix (`model`, `optim`, `extra_state`) becomes the first
//! segment of every name in it, so one directory is one state dict.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::torch_save::{self, Leaf, SavedTensor, Sharding};

use crate::layout::{Found, Listing, ReadOptions};
use crate::model::{
    Checkpoint, DataRef, Encoding, Format, KeyPart, NonTensor, Piece, Pieces, Tensor, Unsupported,
};
use crate::pickle::Value;
use crate::storage::{self, Access};

/// A file named as one rank's save.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RankFile {
    path: PathBuf,
    /// `model` of `model_world_size_4_rank_0.pt`; empty for `rank0.pt`.
    prefix: String,
    world_size: Option<usize>,
    rank: usize,
}

impl RankFile {
    /// The name this prefix's file of `rank` has, for messages about a missing one.
    fn sibling(&self, rank: usize) -> String {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ext = self
            .path
            .extension()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        let stem = &name[..name.len() - ext.len() - usize::from(!ext.is_empty())];
        let digits = stem.len() - stem.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        format!("{}{rank}.{ext}", &stem[..stem.len() - digits])
    }
}

/// `(prefix, world size, rank)` of a per-rank file name: `{prefix}_world_size_{W}_rank_{R}`,
/// `{prefix}_rank{R}`, `{prefix}_rank_{R}`, `rank{R}`, `rank_{R}`, each `.pt`, `.pth` or `.bin`.
fn parse_name(file_name: &str) -> Option<(String, Option<usize>, usize)> {
    let stem = [".pt", ".pth", ".bin"]
        .iter()
        .find_map(|ext| file_name.strip_suffix(ext))?;
    let number = |s: &str| -> Option<usize> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    if let Some((head, r)) = stem.rsplit_once("_rank_") {
        let split = match head.strip_prefix("world_size_") {
            Some(w) => Some(("", w)),
            None => head
                .rsplit_once("_world_size_")
                .filter(|(p, _)| !p.is_empty()),
        };
        if let Some((prefix, w)) = split {
            return Some((prefix.to_string(), Some(number(w)?), number(r)?));
        }
    }
    let digits = stem.len() - stem.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let rank = number(&stem[stem.len() - digits..])?;
    let head = &stem[..stem.len() - digits];
    let prefix = match head {
        "rank" | "rank_" => "",
        _ => head
            .strip_suffix("_rank_")
            .or_else(|| head.strip_suffix("_rank"))
            .filter(|p| !p.is_empty())?,
    };
    Some((prefix.to_string(), None, rank))
}

/// Per-rank torch.save files: a directory of them, several given, or one rank's file holding
/// DTensor or ShardedTensor values.
pub(crate) struct PerRank;

impl crate::layout::Layout for PerRank {
    fn describe(&self) -> &'static str {
        "per-rank torch.save files (`model_world_size_4_rank_0.pt`, `rank0.pt`)"
    }

    fn probe(&self, at: &Listing) -> Result<Option<Found>> {
        let files: Vec<PathBuf> = match at {
            Listing::Dir { .. } => at
                .files()
                .into_iter()
                .filter(|e| is_rank_file(&e.path))
                .map(|e| e.path.clone())
                .collect(),
            Listing::Files(many) => many.iter().map(|e| e.path.clone()).collect(),
            // A single file named as a rank's is one only when it holds a rank's pieces: a
            // `rank0.pt` of whole tensors is a plain torch.save.
            Listing::File(f) if is_rank_file(&f.path) && holds_pieces(&f.path)? => {
                vec![f.path.clone()]
            }
            Listing::File(_) => Vec::new(),
        };
        let Some(first) = files.first() else {
            return Ok(None);
        };
        let path = match at.dir() {
            Some(dir) => dir.to_path_buf(),
            None => first.parent().map(Path::to_path_buf).unwrap_or_default(),
        };
        Ok(Some(Found { path, files }))
    }

    fn read(&self, found: &Found, _: &ReadOptions) -> Result<Checkpoint> {
        read(&found.files)
    }
}

/// Whether a file's name is one rank's save (`model_world_size_4_rank_0.pt`, `rank0.pt`).
fn is_rank_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_name)
        .is_some()
}

/// Whether a torch.save file holds DTensor or ShardedTensor values.
fn holds_pieces(path: &Path) -> Result<bool> {
    let input = storage::Input::open(path, Access::Map)?;
    let bytes = input.zip_view(0, input.len())?;
    let archive = torch_save::read(&bytes).map_err(|e| e.file(path))?;
    Ok(archive
        .leaves
        .iter()
        .any(|(_, leaf)| matches!(leaf, Leaf::Sharded(_))))
}

/// Read per-rank files (every rank of one or more prefixes, in one directory) as one checkpoint.
pub(crate) fn read(paths: &[PathBuf]) -> Result<Checkpoint> {
    let files = rank_files(paths)?;
    let root = files[0]
        .path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let mut world_size = world_size(&files)?;
    let mut merged = Merged::default();
    let mut ranks = SavedRanks {
        subgroups: vec![None; files.len()],
        last_needed: None,
    };
    for (k, f) in files.iter().enumerate() {
        read_rank_file(k, f, &mut merged, &mut ranks)?;
    }
    // Files named by job rank, saved by one process group smaller than the job: every member's
    // file is there though the names skip the job ranks outside the group, and the world the
    // pieces are placed in is the group's.
    match one_group_saved_all(&files, &ranks.subgroups)? {
        Some(group_size) => world_size = group_size,
        None => check_every_rank(&files, world_size)?,
    }
    check_no_rank_beyond(&files, world_size, ranks.last_needed)?;
    // FSDP1 LOCAL_STATE_DICT with use_orig_params=True saves each parameter's name with the rank's
    // own 1-D slice of it, of another length on each rank: beside flat parameters, the first
    // file's slice is kept (as DCP keeps one rank's), for `--shapes-from` to replace
    // (crate::formats::fsdp_local); anywhere else, ranks that disagree on a tensor are an error.
    let flat = merged
        .tensors
        .iter()
        .any(|(t, _)| crate::model::is_flat_param(&t.name));
    if !flat {
        if let Some((_, first)) = std::mem::take(&mut merged.slices).pop_first() {
            return Err(first);
        }
    }
    Ok(Checkpoint {
        root,
        format: Format::PerRankTorchSave,
        world_size: Some(world_size),
        tensors: merged.tensors.into_iter().map(|(t, _)| t).collect(),
        values: merged.values.into_iter().map(|(v, _)| v).collect(),
        unsupported: merged.unsupported,
        details: Vec::new(),
    })
}

/// What the files' sharded values say of the ranks that saved them and of the ranks they are
/// placed on.
struct SavedRanks {
    /// Per file, where its saver sat in a process group smaller than the job, if it says so.
    subgroups: Vec<Option<(u64, u64, u64)>>,
    /// The highest rank a mesh or process group names, with the entry and file that name it.
    last_needed: Option<(u64, String, PathBuf)>,
}

impl SavedRanks {
    /// Note what entry `name`'s `sharding` in file `k` (`f`) says of the ranks, after checking
    /// that the rank the file is named after saved it.
    fn note(&mut self, k: usize, f: &RankFile, sharding: &Sharding, name: &str) -> Result<()> {
        if !sharding.saved_by(f.rank as u64) {
            return Err(Error::invalid(format!(
                "the file is named as rank {}'s, but rank {} saved it",
                f.rank,
                sharding.rank().unwrap_or_default()
            ))
            .file(&f.path)
            .tensor(name)
            .hint("rename the files after the ranks that saved them"));
        }
        self.subgroups[k] = self.subgroups[k].or(sharding.subgroup());
        if let Some(r) = sharding.last_rank() {
            if self.last_needed.as_ref().is_none_or(|(l, ..)| r > *l) {
                self.last_needed = Some((r, name.to_string(), f.path.clone()));
            }
        }
        Ok(())
    }
}

/// Merge the entries of rank file `f` (the `k`th) into `merged`, noting in `ranks` what its
/// sharded values say of the ranks.
fn read_rank_file(
    k: usize,
    f: &RankFile,
    merged: &mut Merged,
    ranks: &mut SavedRanks,
) -> Result<()> {
    let name = PathBuf::from(f.path.file_name().unwrap_or_default());
    let file: Arc<Path> = name.as_path().into();
    let input = storage::Input::open(&f.path, Access::Map)?;
    let bytes = input.zip_view(0, input.len())?;
    let archive = torch_save::read(&bytes).map_err(|e| {
        e.file(&f.path).hint(
            "every file of a per-rank checkpoint is read; pass the others as a list of files to leave this one out",
        )
    })?;
    for (key_path, leaf) in &archive.leaves {
        let mut path = Vec::with_capacity(key_path.len() + 1);
        if !f.prefix.is_empty() {
            path.push(KeyPart::Key(f.prefix.clone()));
        }
        path.extend(key_path.iter().cloned());
        let name = KeyPart::flat_name(&path);
        let err = |e: Error| e.file(&f.path).tensor(&name);
        match leaf {
            Leaf::Tensor(t) => {
                let piece = piece(&archive, t, &file, vec![0; t.shape.len()]).map_err(err)?;
                if let Some(column) =
                    merged.tensor(name.clone(), path, t.dtype, &t.shape, false, &f.path)?
                {
                    column.push(piece).map_err(err)?;
                }
            }
            Leaf::Sharded(s) => {
                ranks.note(k, f, &s.sharding, &name)?;
                let pieces = s
                    .pieces
                    .iter()
                    .map(|p| piece(&archive, &p.tensor, &file, p.offsets.clone()))
                    .collect::<Result<Vec<_>>>()
                    .map_err(err)?;
                if let Some(column) =
                    merged.tensor(name.clone(), path, s.dtype, &s.shape, true, &f.path)?
                {
                    for p in pieces {
                        column.push(p).map_err(err)?;
                    }
                }
            }
            Leaf::Value(v) => {
                let mut flat = Vec::new();
                flatten_value(path, v, &mut flat);
                for (path, v) in flat {
                    let name = KeyPart::flat_name(&path);
                    merged.value(name, path, &v, &f.path)?;
                }
            }
            Leaf::Unsupported { dtype } => merged.unsupported(name, dtype, &file),
        }
    }
    Ok(())
}

/// An error when a mesh or process group names a rank beyond the files (`last_needed`): that
/// rank's file is missing.
fn check_no_rank_beyond(
    files: &[RankFile],
    world_size: usize,
    last_needed: Option<(u64, String, PathBuf)>,
) -> Result<()> {
    let Some((r, name, by)) = last_needed.filter(|(r, ..)| *r >= world_size as u64) else {
        return Ok(());
    };
    let missing: Vec<String> = prefixes(files)
        .into_iter()
        .map(|f| format!("`{}`", f.sibling(world_size)))
        .collect();
    let which = if r == world_size as u64 {
        format!("rank {r}'s file is missing")
    } else {
        format!("the files of ranks {world_size} to {r} are missing, the first")
    };
    Err(Error::invalid(format!(
        "{which}: {} (the files go up to rank {}, but `{name}` in this file is placed on rank {r})",
        missing.join(", "),
        world_size.saturating_sub(1)
    ))
    .file(by)
    .hint("pass every rank's file, or the directory that holds them"))
}

/// A value as DCP's `flatten_state_dict` flattens it: a list that holds a dict is walked, its
/// items named by index (`optim.param_groups.0.lr`), so that a DCP written from it has the keys
/// torch's own `dcp.save` gives the same state dict, and a torch.save rebuilds the list.
fn flatten_value(path: Vec<KeyPart>, value: &Value, out: &mut Vec<(Vec<KeyPart>, Value)>) {
    match value {
        Value::List(items) if !is_terminal(value) => {
            for (i, item) in items.iter().enumerate() {
                let mut p = path.clone();
                p.push(KeyPart::Index(i as i64));
                flatten_value(p, item, out);
            }
        }
        Value::Dict(items) if !is_terminal(value) => {
            for (k, v) in items {
                let mut p = path.clone();
                p.push(match k {
                    Value::Int(i) => KeyPart::IntKey(*i),
                    k => KeyPart::Key(k.as_str().unwrap_or_default().to_string()),
                });
                flatten_value(p, v, out);
            }
        }
        _ => out.push((path, value.clone())),
    }
}

/// Whether DCP keeps a value whole: anything but a non-empty dict with str or int keys, or a
/// list holding one. (An empty dict stays a value, as the torch.save reader keeps it.)
fn is_terminal(value: &Value) -> bool {
    match value {
        Value::Dict(items) => {
            items.is_empty()
                || !items
                    .iter()
                    .all(|(k, _)| matches!(k, Value::Str(_) | Value::Int(_)))
        }
        Value::List(items) => items.iter().all(is_terminal),
        _ => true,
    }
}

/// The tensor piece a saved tensor holds, at `offsets` of the global tensor.
fn piece(
    archive: &torch_save::Archive,
    t: &SavedTensor,
    file: &Arc<Path>,
    offsets: Vec<u64>,
) -> Result<Piece> {
    let entry = archive
        .storage(&t.storage_key)
        .ok_or_else(|| Error::invalid(format!("no storage record `{}`", t.storage_key)))?;
    Ok(Piece {
        offsets,
        sizes: t.shape.clone(),
        data: DataRef {
            file: Arc::clone(file),
            offset: entry.data_offset + t.storage_offset * t.dtype.size() as u64,
            strides: t.strides.clone(),
            encoding: Encoding::Raw,
        },
    })
}

/// Each file's name parsed, sorted by prefix then rank; every file in one directory.
fn rank_files(paths: &[PathBuf]) -> Result<Vec<RankFile>> {
    let mut files = Vec::with_capacity(paths.len());
    for path in paths {
        let parsed = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_name);
        let Some((prefix, world_size, rank)) = parsed else {
            return Err(Error::usage(
                "not named as one rank's file of a per-rank checkpoint",
            )
            .file(path)
            .hint("ckpt reads per-rank files named `{prefix}_world_size_{W}_rank_{R}.pt`, `{prefix}_rank{R}.pt` or `rank{R}.pt`"));
        };
        files.push(RankFile {
            path: path.clone(),
            prefix,
            world_size,
            rank,
        });
    }
    let Some(first) = files.first() else {
        return Err(Error::usage("no per-rank files given"));
    };
    let dir = first
        .path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if let Some(other) = files
        .iter()
        .find(|f| f.path.parent().map(Path::to_path_buf).unwrap_or_default() != dir)
    {
        return Err(Error::usage(format!(
            "per-rank files must be in one directory; `{}` is not beside `{}`",
            other.path.display(),
            first.path.display()
        )));
    }
    // `model` before `optim` before the rest, as a state dict usually lists them.
    files.sort_by(|a, b| {
        let key = |f: &RankFile| {
            (
                f.prefix != "model",
                f.prefix != "optim",
                f.prefix.clone(),
                f.rank,
            )
        };
        key(a).cmp(&key(b))
    });
    for w in files.windows(2) {
        if w[0].prefix == w[1].prefix && w[0].rank == w[1].rank {
            return Err(Error::usage(format!(
                "two files of rank {} for the same prefix: `{}` and `{}`",
                w[0].rank,
                w[0].path.display(),
                w[1].path.display()
            )));
        }
    }
    Ok(files)
}

/// One file per prefix (the first), to name its siblings.
fn prefixes(files: &[RankFile]) -> Vec<&RankFile> {
    let mut seen = std::collections::BTreeSet::new();
    files
        .iter()
        .filter(|f| seen.insert(f.prefix.clone()))
        .collect()
}

/// The world size the file names say, checked to be one world size that holds every named rank
/// (see [`check_every_rank`] for the ranks that are not named).
fn world_size(files: &[RankFile]) -> Result<usize> {
    let named: Vec<&RankFile> = files.iter().filter(|f| f.world_size.is_some()).collect();
    if let Some(first) = named.first() {
        if let Some(other) = named.iter().find(|f| f.world_size != first.world_size) {
            return Err(Error::invalid(format!(
                "files of different world sizes: `{}` is of {}, `{}` of {}",
                first.path.display(),
                first.world_size.unwrap_or_default(),
                other.path.display(),
                other.world_size.unwrap_or_default()
            ))
            .hint("a checkpoint is the files of one run: point ckpt at one world size's files"));
        }
    }
    let world_size = match named.first().and_then(|f| f.world_size) {
        Some(w) => w,
        None => files
            .iter()
            .map(|f| f.rank.saturating_add(1))
            .max()
            .unwrap_or(0),
    };
    for f in files {
        if f.rank >= world_size {
            return Err(
                Error::invalid(format!("rank {} of a world of {world_size}", f.rank)).file(&f.path),
            );
        }
    }
    Ok(world_size)
}

/// Every prefix has one file per rank of `world_size`, or the error names the missing ones.
fn check_every_rank(files: &[RankFile], world_size: usize) -> Result<()> {
    for f in prefixes(files) {
        let have: std::collections::BTreeSet<usize> = files
            .iter()
            .filter(|g| g.prefix == f.prefix)
            .map(|g| g.rank)
            .collect();
        // A few are named; a world size in a name can be anything.
        let count = world_size - have.len();
        let missing: Vec<String> = (0..world_size)
            .filter(|r| !have.contains(r))
            .take(8)
            .map(|r| f.sibling(r))
            .collect();
        if count > 0 {
            let dir = f.path.parent().unwrap_or(Path::new("."));
            let listed: Vec<String> = missing.iter().map(|m| format!("`{m}`")).collect();
            let beside = missing.iter().all(|m| dir.join(m).is_file());
            let hint = if beside {
                format!(
                    "they are beside it: pass the directory `{}` (or every rank's file)",
                    dir.display()
                )
            } else {
                "every rank's file is needed: copy the missing ones beside the others".to_string()
            };
            let what = if beside { "not given" } else { "missing" };
            let more = if count > missing.len() { ", ..." } else { "" };
            return Err(Error::invalid(format!(
                "{count} of {world_size} ranks' files are {what}: {}{more}",
                listed.join(", ")
            ))
            .file(dir)
            .hint(hint));
        }
    }
    Ok(())
}

/// The size of the process group that saved every file, when each prefix's files are named by
/// the job ranks of that group's members: each file's sharded values name its saver's job rank
/// (the file's) and group rank, and the group ranks are `0..size`, each once. Group ranks that
/// no file holds are an error naming them (the job ranks of the missing files are unknown).
fn one_group_saved_all(
    files: &[RankFile],
    subgroups: &[Option<(u64, u64, u64)>],
) -> Result<Option<usize>> {
    let mut size = None;
    for p in prefixes(files) {
        let mut group_ranks = std::collections::BTreeSet::new();
        for (f, g) in files
            .iter()
            .zip(subgroups)
            .filter(|(f, _)| f.prefix == p.prefix)
        {
            let Some((rank, group_rank, group_size)) = *g else {
                return Ok(None);
            };
            // Two files of one group rank: several groups saved (hybrid sharding's replicas),
            // each whole, and the names count the job's ranks.
            if rank != f.rank as u64
                || *size.get_or_insert(group_size) != group_size
                || !group_ranks.insert(group_rank)
            {
                return Ok(None);
            }
        }
        let Some(n) = size else {
            return Ok(None);
        };
        let missing: Vec<String> = (0..n)
            .filter(|g| !group_ranks.contains(g))
            .take(8)
            .map(|g| g.to_string())
            .collect();
        if !missing.is_empty() {
            let dir = p.path.parent().unwrap_or(Path::new("."));
            return Err(Error::invalid(format!(
                "the files were saved by a process group of {n} ranks and are named by their job \
                 ranks, but the group's rank(s) {} saved none of them",
                missing.join(", ")
            ))
            .file(dir)
            .hint("every member of the saving group's file is needed: copy the missing ones beside the others"));
        }
    }
    Ok(size.and_then(|n| usize::try_from(n).ok()))
}

/// Entries merged over the ranks' files, in the order they first appear, each with the file that
/// first gave it (for messages) and whether it is sharded.
#[derive(Default)]
struct Merged {
    tensors: Vec<(Tensor, (PathBuf, bool))>,
    values: Vec<(NonTensor, PathBuf)>,
    unsupported: Vec<Unsupported>,
    index: HashMap<String, Slot>,
    /// Plain 1-D tensors of another length in each file (FSDP1 LOCAL per-parameter slices, whose
    /// first file's piece is kept), with the error they are if the files hold no flat parameters.
    slices: std::collections::BTreeMap<String, Error>,
}

#[derive(Clone, Copy)]
enum Slot {
    Tensor(usize),
    Value(usize),
    Unsupported,
}

impl Merged {
    /// The pieces of tensor `name`, which every file must give the same dtype, global shape and
    /// kind (sharded, or a plain tensor that each file holds whole).
    fn tensor(
        &mut self,
        name: String,
        key_path: Vec<KeyPart>,
        dtype: DType,
        shape: &[u64],
        sharded: bool,
        file: &Path,
    ) -> Result<Option<&mut Pieces>> {
        if self.slices.contains_key(&name) {
            return Ok(None);
        }
        let kind = |s: bool| if s { "sharded" } else { "plain" };
        let k = match self.index.get(&name).copied() {
            Some(Slot::Tensor(k)) => {
                let (t, (first, was_sharded)) = &self.tensors[k];
                if t.dtype != dtype || t.shape != shape || *was_sharded != sharded {
                    let slice = !sharded
                        && !*was_sharded
                        && t.dtype == dtype
                        && t.shape.len() == 1
                        && shape.len() == 1;
                    let err = Error::invalid(format!(
                        "ranks disagree on this tensor: `{}` has a {} {} of shape {:?}, `{}` a {} {dtype} of shape {shape:?}",
                        first.display(),
                        kind(*was_sharded),
                        t.dtype,
                        t.shape,
                        file.display(),
                        kind(sharded),
                    ))
                    .file(file)
                    .tensor(&name)
                    .hint("the files are not of one save: check that they come from the same step");
                    if slice {
                        self.slices.insert(name, err);
                        return Ok(None);
                    }
                    return Err(err);
                }
                k
            }
            Some(_) => return Err(mixed(&name, file)),
            None => {
                self.index
                    .insert(name.clone(), Slot::Tensor(self.tensors.len()));
                self.tensors.push((
                    Tensor {
                        name,
                        key_path,
                        dtype,
                        shape: shape.to_vec(),
                        pieces: Pieces::new(shape.len()),
                    },
                    (file.to_path_buf(), sharded),
                ));
                self.tensors.len() - 1
            }
        };
        Ok(Some(&mut self.tensors[k].0.pieces))
    }

    /// A non-tensor entry: every file that holds it must hold the same value, since ckpt keeps one.
    fn value(
        &mut self,
        name: String,
        key_path: Vec<KeyPart>,
        value: &Value,
        file: &Path,
    ) -> Result<()> {
        match self.index.get(&name).copied() {
            Some(Slot::Value(k)) => {
                let (v, first) = &self.values[k];
                if v.value.as_ref() != Some(value) {
                    return Err(Error::invalid(format!(
                        "this non-tensor entry differs between `{}` and `{}`; ckpt keeps one copy of each entry",
                        first.display(),
                        file.display()
                    ))
                    .file(file)
                    .tensor(&name)
                    .hint("per-rank state (a data loader's position) cannot be merged: pass the other files as a list to leave these out"));
                }
                Ok(())
            }
            Some(_) => Err(mixed(&name, file)),
            None => {
                self.index
                    .insert(name.clone(), Slot::Value(self.values.len()));
                self.values.push((
                    NonTensor {
                        name,
                        key_path,
                        value: Some(value.clone()),
                        raw: None,
                    },
                    file.to_path_buf(),
                ));
                Ok(())
            }
        }
    }

    fn unsupported(&mut self, name: String, dtype: &str, file: &Arc<Path>) {
        if self.index.contains_key(&name) {
            return;
        }
        self.index.insert(name.clone(), Slot::Unsupported);
        self.unsupported.push(Unsupported {
            name,
            dtype: dtype.to_string(),
            file: file.to_path_buf(),
        });
    }
}

fn mixed(name: &str, file: &Path) -> Error {
    Error::invalid("ranks disagree on this entry: a tensor in one file, not in another")
        .file(file)
        .tensor(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_rank_files() {
        let p = |s: &str| parse_name(s);
        assert_eq!(
            p("model_world_size_4_rank_3.pt"),
            Some(("model".into(), Some(4), 3))
        );
        assert_eq!(
            p("extra_state_world_size_16_rank_10.pt"),
            Some(("extra_state".into(), Some(16), 10))
        );
        assert_eq!(p("rank0.pt"), Some(("".into(), None, 0)));
        assert_eq!(p("world_size_2_rank_1.pt"), Some(("".into(), Some(2), 1)));
        assert_eq!(p("rank_12.pth"), Some(("".into(), None, 12)));
        assert_eq!(p("model_rank2.pt"), Some(("model".into(), None, 2)));
        assert_eq!(p("optim_rank_2.bin"), Some(("optim".into(), None, 2)));
        for no in [
            "model.pt",
            "rank.pt",
            "model_world_size_4_rank_.pt",
            "pytorch_model.bin",
            "rank0.safetensors",
            "frank3.pt",
            "_rank3.pt",
        ] {
            assert_eq!(p(no), None, "{no}");
        }
        let f = RankFile {
            path: "d/model_world_size_4_rank_0.pt".into(),
            prefix: "model".into(),
            world_size: Some(4),
            rank: 0,
        };
        assert_eq!(f.sibling(3), "model_world_size_4_rank_3.pt");
        let f = RankFile {
            path: "d/rank10.pt".into(),
            prefix: String::new(),
            world_size: None,
            rank: 10,
        };
        assert_eq!(f.sibling(2), "rank2.pt");
    }
}
