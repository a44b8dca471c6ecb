//! FSDP1 `LOCAL_STATE_DICT`: each FSDP unit's parameters flattened into one 1-D `_flat_param`,
//! 1/N of it per rank, with neither names nor shapes in the files.
//!
//! `--shapes-from REF` supplies them: a FULL `torch.save` of `model.state_dict()`, a JSON list
//! `[[name, shape], ...]` in `named_parameters()` order, or a SHARDED checkpoint of the same model.
//! With them, [`resolve`] rebuilds the named tensors as a pure transform of the [`Checkpoint`]: a
//! parameter fills a contiguous range of its unit's flat parameter, and each rank's part of that
//! range is at most `2 * (ndim - 1) + 1` boxes of the parameter, each contiguous in the rank's
//! bytes, so every parameter becomes ordinary [`crate::model::Piece`]s and the planner and executor see a sharded
//! checkpoint like any other.
//!
//! The layout follows torch 2.15's `FlatParamHandle._init_flat_param_and_metadata`: parameters in
//! `module.named_modules()` then `named_parameters(recurse=False)` order (the order of
//! `model.state_dict()`), those of nested FSDP units left to their own unit, tied ones once. With
//! `use_orig_params=True`, each parameter starts at a multiple of `16 / itemsize` elements (zero
//! padding before it) and the whole is padded to a multiple of the world size; the file then also
//! holds each parameter's name with one rank's 1-D slice of it, which the rebuilt tensor replaces.
//! `_local_post_state_dict_hook` saves `_unpadded_unsharded_size` elements, rank `r`'s piece at
//! `r * shard_numel`, the padding of the last shards dropped.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::geometry::flat_range_boxes;
use crate::model::{
    is_flat_param, Checkpoint, Encoding, Format, KeyPart, PieceRef, Pieces, Tensor, FLAT_PARAM,
    SHAPES_HINT,
};
use crate::storage::{self, Entry, Stat};

/// Resolve `ckpt` with the names and shapes of `reference` (`--shapes-from`) when it is an FSDP1
/// LOCAL checkpoint; anything else, or a LOCAL checkpoint without a reference, is returned as
/// read (writing one is refused later, by [`Checkpoint::check_supported`]). The reference is read
/// through storage, so it may be an object store URL like the checkpoint.
pub(crate) fn apply(ckpt: Checkpoint, reference: Option<&Path>) -> Result<Checkpoint> {
    if ckpt.flat_params().is_empty() {
        return Ok(ckpt);
    }
    let Some(reference) = reference else {
        return Ok(ckpt);
    };
    let entries = read_reference(reference)?;
    resolve(ckpt, &entries).map_err(|e| {
        if e.file.is_none() {
            e.file(reference)
        } else {
            e
        }
    })
}

/// The step: an FSDP1 LOCAL checkpoint resolved with `--shapes-from` ([`apply`]).
pub(crate) struct ResolveLocal<'a> {
    pub shapes_from: Option<&'a Path>,
}

impl super::Step for ResolveLocal<'_> {
    fn apply(&self, ckpt: Checkpoint, _: &mut super::Report) -> Result<Checkpoint> {
        apply(ckpt, self.shapes_from)
    }
}

/// What a partitioned run (`--part`) must agree on about a file or directory it reads besides
/// its input (`--shapes-from`, `--merge-lora`'s adapter), under `label`: its location, and the
/// length and time of it and of each file it holds, so parts run with different ones never mix.
/// Empty without one.
pub(crate) fn fingerprint(label: &str, reference: Option<&Path>) -> Result<String> {
    let Some(path) = reference else {
        return Ok(String::new());
    };
    let abs = storage::absolute(path);
    let mut line = format!("\n{label} {}", abs.display());
    let mut entries = Vec::new();
    match storage::stat(path)? {
        Some(stat @ Stat::File(_)) => entries.push(Entry {
            path: path.to_path_buf(),
            stat,
        }),
        // A directory reference (DCP) changes through its files.
        Some(Stat::Dir) => entries = storage::listing(path)?,
        None => return Err(Error::usage(format!("`{}` does not exist", path.display()))),
    }
    for e in entries {
        let len = match e.stat {
            Stat::File(len) => len,
            Stat::Dir => continue,
        };
        line.push_str(&format!(" {}:{len}", e.name()));
        // A local file rewritten in place at the same length still shows in its time.
        if let Ok(mtime) = std::fs::metadata(&e.path).and_then(|m| m.modified()) {
            let nanos = mtime
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            line.push_str(&format!(":{nanos}"));
        }
    }
    Ok(line)
}

/// A name and shape from the reference, with its dtype where the reference has one.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RefEntry {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: Option<DType>,
    /// A tied parameter (`lm_head.weight` is `embed.weight`): the index of the entry it shares
    /// storage with. FSDP flattens it once; `model.state_dict()` lists it under both names.
    pub alias_of: Option<usize>,
}

/// Read the names and shapes of `--shapes-from`: a JSON list, or any checkpoint ckpt reads whose
/// tensors are listed in module order.
pub(crate) fn read_reference(path: &Path) -> Result<Vec<RefEntry>> {
    if path.extension().is_some_and(|e| e == "json") {
        let text = crate::storage::read(path)?;
        return parse_json(&text).map_err(|e| e.file(path));
    }
    let ckpt = crate::detect::read(path)?;
    if matches!(
        ckpt.format,
        Format::Safetensors | Format::SafetensorsIndex | Format::DcpSafetensors
    ) {
        return Err(Error::usage(
            "safetensors files list tensors alphabetically, not in the module order FSDP flattens them in",
        )
        .file(path)
        .hint(SHAPES_HINT));
    }
    if let Some(flat) = ckpt.flat_params().first() {
        return Err(Error::usage(
            "the reference is itself an FSDP1 LOCAL_STATE_DICT checkpoint, without names or shapes",
        )
        .file(path)
        .tensor(&flat.name)
        .hint(SHAPES_HINT));
    }
    // torch.save keeps tied tensors as one storage: the same bytes, shape and strides.
    let mut first_of = HashMap::new();
    Ok(ckpt
        .tensors
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let alias_of = match (ckpt.format, t.pieces.len()) {
                (Format::TorchSave, 1) => {
                    let p = t.pieces.get(0);
                    let key = (
                        p.file().clone(),
                        p.offset(),
                        t.shape.clone(),
                        p.strides().into_owned(),
                        t.dtype,
                    );
                    let first = *first_of.entry(key).or_insert(i);
                    (first != i && crate::model::numel(&t.shape) != Some(0)).then_some(first)
                }
                _ => None,
            };
            RefEntry {
                name: t.name,
                shape: t.shape,
                dtype: Some(t.dtype),
                alias_of,
            }
        })
        .collect())
}

/// `[[name, shape], ...]`, e.g. `json.dump([[n, list(p.shape)] for n, p in model.named_parameters()], f)`.
fn parse_json(text: &[u8]) -> Result<Vec<RefEntry>> {
    let bad = |why: String| {
        Error::usage(format!("not a list of [name, shape] pairs: {why}")).hint(
            "write it with json.dump([[n, list(p.shape)] for n, p in model.named_parameters()], f)",
        )
    };
    let value: serde_json::Value = serde_json::from_slice(text).map_err(|e| bad(format!("{e}")))?;
    let list = value
        .as_array()
        .ok_or_else(|| bad("the document is not a list".into()))?;
    list.iter()
        .enumerate()
        .map(|(i, item)| {
            let pair = item.as_array().filter(|p| p.len() == 2);
            let name = pair.and_then(|p| p[0].as_str());
            let shape = pair.and_then(|p| p[1].as_array()).and_then(|dims| {
                dims.iter()
                    .map(serde_json::Value::as_u64)
                    .collect::<Option<Vec<u64>>>()
            });
            match (name, shape) {
                (Some(name), Some(shape)) => Ok(RefEntry {
                    name: name.to_string(),
                    shape,
                    dtype: None,
                    alias_of: None,
                }),
                _ => Err(bad(format!("item {i} is `{item}`"))),
            }
        })
        .collect()
}

/// One FSDP unit of the checkpoint: its flat parameter and the names the reference puts in it.
struct Unit {
    /// `""` for the root, else the unit's path with a trailing dot (`layers.0.`).
    prefix: String,
    /// Index of its `_flat_param` in the checkpoint's tensors.
    flat: usize,
    /// Indices into the reference of the names under `prefix` and under no deeper unit.
    names: Vec<usize>,
}

/// Where one parameter lies in its unit's flat parameter.
struct Slot {
    entry: usize,
    start: u64,
    numel: u64,
}

/// Rebuild the named parameters of an FSDP1 LOCAL checkpoint from the reference's names and shapes
/// (see the module docs). Pure: the bytes stay where they are, in new pieces.
pub(crate) fn resolve(mut ckpt: Checkpoint, reference: &[RefEntry]) -> Result<Checkpoint> {
    let reference = with_app_prefix(&ckpt, reference);
    let mut seen = HashSet::new();
    if let Some(twice) = reference.iter().find(|e| !seen.insert(e.name.as_str())) {
        return Err(
            Error::usage(format!("the reference names `{}` twice", twice.name))
                .hint("--shapes-from must list each parameter once"),
        );
    }
    let by_name: HashMap<&str, usize> = ckpt
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut units: Vec<Unit> = ckpt
        .tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| is_flat_param(&t.name) && t.shape.len() == 1)
        .map(|(i, t)| Unit {
            prefix: t.name[..t.name.len() - FLAT_PARAM.len()].to_string(),
            flat: i,
            names: Vec::new(),
        })
        .collect();
    for (i, entry) in reference.iter().enumerate() {
        // The deepest unit whose prefix the name starts with: nested units own their parameters.
        // A tied name is not flattened again.
        let owner = units
            .iter_mut()
            .filter(|u| {
                entry.alias_of.is_none()
                    && entry.name.starts_with(&u.prefix)
                    && !is_flat_param(&entry.name)
            })
            .max_by_key(|u| u.prefix.len());
        if let Some(u) = owner {
            u.names.push(i);
        }
    }
    let mut rebuilt: HashMap<usize, Tensor> = HashMap::new();
    let mut slices: HashSet<usize> = HashSet::new();
    for unit in &units {
        let flat = &ckpt.tensors[unit.flat];
        let slots = place(unit, flat, &reference, &ckpt.tensors, &by_name)?;
        let mut chunks: Vec<PieceRef> = flat.pieces.iter().collect();
        chunks.sort_by_key(|p| p.offsets()[0]);
        for slot in &slots {
            let entry = &reference[slot.entry];
            if let Some(&i) = by_name.get(entry.name.as_str()) {
                // use_orig_params=True: the file's entry is one rank's 1-D slice of it.
                slices.insert(i);
            }
            let tensor = cut(flat, &chunks, entry, slot).map_err(|e| e.file(&ckpt.root))?;
            rebuilt.insert(slot.entry, tensor);
        }
    }
    // A tied name reads the bytes of the parameter it is tied to; with use_orig_params=True the
    // file holds a slice under it too.
    for (i, entry) in reference.iter().enumerate() {
        let Some(target) = entry.alias_of.and_then(|j| rebuilt.get(&j)) else {
            continue;
        };
        let mut tied = target.clone();
        tied.key_path = key_path(target, &entry.name);
        tied.name = entry.name.clone();
        if let Some(&j) = by_name.get(entry.name.as_str()) {
            slices.insert(j);
        }
        rebuilt.insert(i, tied);
    }
    // The model's tensors in the reference's order (buffers as the file holds them), then
    // whatever else the checkpoint holds (other app states), in its order.
    let by_name: HashMap<String, usize> = by_name
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let mut old: Vec<Option<Tensor>> = ckpt.tensors.drain(..).map(Some).collect();
    for u in &units {
        old[u.flat] = None;
    }
    for &i in &slices {
        old[i] = None;
    }
    let mut tensors = Vec::with_capacity(old.len());
    for (i, entry) in reference.iter().enumerate() {
        if let Some(t) = rebuilt.remove(&i) {
            tensors.push(t);
        } else if let Some(&j) = by_name.get(entry.name.as_str()) {
            if let Some(t) = old[j].take() {
                tensors.push(t);
            }
        }
    }
    tensors.extend(old.into_iter().flatten());
    ckpt.tensors = tensors;
    Ok(ckpt)
}

/// The reference's names as the checkpoint spells them: a LOCAL state dict saved with
/// `dcp.save({"model": model.state_dict()})` names its units `model.layers.0._flat_param`, while
/// `model.state_dict()` says `layers.0.weight`.
fn with_app_prefix(ckpt: &Checkpoint, reference: &[RefEntry]) -> Vec<RefEntry> {
    let firsts: HashSet<&str> = ckpt
        .flat_params()
        .iter()
        .map(|t| t.name.split('.').next().unwrap_or_default())
        .collect();
    let prefix = match firsts.iter().next() {
        Some(&first) if firsts.len() == 1 && first != FLAT_PARAM => format!("{first}."),
        _ => return reference.to_vec(),
    };
    if reference.iter().any(|e| e.name.starts_with(&prefix)) {
        return reference.to_vec();
    }
    reference
        .iter()
        .map(|e| RefEntry {
            name: format!("{prefix}{}", e.name),
            ..e.clone()
        })
        .collect()
}

/// Which of a unit's names are its parameters, and where each starts in the flat parameter.
fn place(
    unit: &Unit,
    flat: &Tensor,
    reference: &[RefEntry],
    tensors: &[Tensor],
    by_name: &HashMap<&str, usize>,
) -> Result<Vec<Slot>> {
    let p = Placing::new(unit, flat, reference, tensors, by_name);
    let (members, ambiguous) = p.members();
    if members.is_empty() {
        if p.total == 0 {
            return Ok(Vec::new());
        }
        return Err(p
            .error(format!(
                "the reference names no parameter under `{}`",
                unit.prefix
            ))
            .hint(
                "--shapes-from must describe the model the checkpoint was saved from, with the same names",
            ));
    }
    p.check_dtypes(&members)?;
    let as_params = p.fit(&members)?;
    // A 1-D buffer saved whole looks like a parameter's slice: the other reading is tried too,
    // and when both fill the flat parameter the files cannot tell which is right.
    let as_buffers = if ambiguous.is_empty() {
        None
    } else {
        let rest: Vec<usize> = members
            .iter()
            .copied()
            .filter(|i| !ambiguous.contains(i))
            .collect();
        p.fit(&rest)?
    };
    match (as_params, as_buffers) {
        (Some(slots), None) | (None, Some(slots)) => Ok(slots),
        (Some(_), Some(_)) => Err(p
            .error(format!(
                "the 1-D tensors {} fit both as parameters and as buffers",
                p.joined_names(&ambiguous)
            ))
            .hint("pass --shapes-from a JSON list [[name, shape], ...] of model.named_parameters(), which has no buffers")),
        (None, None) => Err(p.mismatch(&members, &ambiguous)?),
    }
}

/// One unit's flat parameter and the reference's names under it, while [`place`] places them.
struct Placing<'a> {
    unit: &'a Unit,
    flat: &'a Tensor,
    reference: &'a [RefEntry],
    tensors: &'a [Tensor],
    by_name: &'a HashMap<&'a str, usize>,
    /// The unit's names that may be parameters: FSDP refuses 0-dim parameters, so a 0-dim name
    /// is a buffer.
    names: Vec<usize>,
    /// use_orig_params=True: every parameter is in the file too, as a rank's 1-D slice of it.
    orig_params: bool,
    /// Elements of the flat parameter, padding included.
    total: u64,
    /// Elements per rank.
    shard: u64,
    /// The alignments (in elements) to try, the stored dtype's first.
    aligns: Vec<u64>,
}

impl<'a> Placing<'a> {
    /// The unit, with what its names and the files say of how it was saved.
    fn new(
        unit: &'a Unit,
        flat: &'a Tensor,
        reference: &'a [RefEntry],
        tensors: &'a [Tensor],
        by_name: &'a HashMap<&'a str, usize>,
    ) -> Self {
        let names: Vec<usize> = unit
            .names
            .iter()
            .copied()
            .filter(|&i| !reference[i].shape.is_empty())
            .collect();
        let mut p = Placing {
            unit,
            flat,
            reference,
            tensors,
            by_name,
            names,
            orig_params: false,
            total: flat.shape[0],
            shard: shard_numel(flat),
            aligns: vec![1],
        };
        // use_orig_params=False keeps the parameters out of the file, so a name the file lacks
        // is a parameter, and one it holds is a buffer; with True, every parameter is in the file
        // too.
        p.orig_params = p.names.iter().all(|&i| p.saved(i).is_some());
        if p.orig_params {
            // Alignment is by the dtype FSDP computes in (a MixedPrecision param_dtype may differ
            // from the stored one), so the stored dtype's comes first and the others after it.
            let own = 16 / flat.dtype.size().max(1) as u64;
            p.aligns = vec![own.max(1)];
            p.aligns
                .extend([8, 16, 4, 2, 1].into_iter().filter(|&x| x != own));
        }
        p
    }

    /// An error about the unit.
    fn error(&self, msg: String) -> Error {
        Error::invalid(format!(
            "FSDP unit `{}` (`{}`, {} elements): {msg}",
            unit_name(&self.unit.prefix),
            self.flat.name,
            self.total
        ))
        .tensor(&self.flat.name)
    }

    /// The file's tensor of reference entry `i`, if the file holds one.
    fn saved(&self, i: usize) -> Option<&'a Tensor> {
        self.by_name
            .get(self.reference[i].name.as_str())
            .map(|&j| &self.tensors[j])
    }

    /// The names that may be the unit's parameters, and those of them that may as well be 1-D
    /// buffers saved whole.
    fn members(&self) -> (Vec<usize>, Vec<usize>) {
        if !self.orig_params {
            let absent = self
                .names
                .iter()
                .copied()
                .filter(|&i| self.saved(i).is_none());
            return (absent.collect(), Vec::new());
        }
        let mut ambiguous = Vec::new();
        let members = self
            .names
            .iter()
            .copied()
            .filter(|&i| {
                let t = self.saved(i).expect("every name is in the file");
                let r = &self.reference[i];
                // A parameter is saved as a 1-D slice of itself; anything else is a buffer.
                if t.shape.len() != 1 || t.dtype != self.flat.dtype {
                    return false;
                }
                // A JSON list of named_parameters() holds no buffers; a checkpoint does.
                if r.shape.len() == 1 && t.shape == r.shape && r.dtype.is_some() {
                    ambiguous.push(i);
                }
                crate::model::numel(&r.shape).is_some_and(|n| t.shape[0] <= n)
            })
            .collect();
        (members, ambiguous)
    }

    /// An error unless every member the reference gives a dtype is of the flat parameter's.
    fn check_dtypes(&self, members: &[usize]) -> Result<()> {
        for &i in members {
            let r = &self.reference[i];
            if let Some(d) = r.dtype {
                if d != self.flat.dtype {
                    return Err(self.error(format!(
                        "`{}` is {d} in the reference but the flat parameter is {}",
                        r.name, self.flat.dtype
                    ))
                    .hint("pass a reference saved in the training dtype, or a JSON list of names and shapes"));
                }
            }
        }
        Ok(())
    }

    /// The element count of each of `members`.
    fn numels(&self, members: &[usize]) -> Result<Vec<u64>> {
        members
            .iter()
            .map(|&i| {
                crate::model::numel(&self.reference[i].shape).ok_or_else(|| {
                    self.error(format!(
                        "`{}` has too many elements",
                        self.reference[i].name
                    ))
                })
            })
            .collect()
    }

    /// The slots of `members` if they fill the flat parameter as FSDP lays it out: with the
    /// stored dtype's alignment, or else with the one other alignment every fitting layout
    /// agrees on (a MixedPrecision param_dtype of another size); layouts that disagree are
    /// refused.
    fn fit(&self, members: &[usize]) -> Result<Option<Vec<Slot>>> {
        let numels = self.numels(members)?;
        let mut found: Option<(u64, Vec<u64>)> = None;
        for (k, &align) in self.aligns.iter().enumerate() {
            let (starts, end) = layout(&numels, align);
            if !self.fills(members, &numels, &starts, end) {
                continue;
            }
            match &found {
                None if k == 0 => {
                    found = Some((align, starts));
                    break;
                }
                None => found = Some((align, starts)),
                Some((_, same)) if *same == starts => {}
                Some((other, _)) => {
                    return Err(self.error(format!(
                        "the parameters fit both {other}- and {align}-element alignment, which place them differently"
                    ))
                    .hint("the alignment follows the dtype FSDP computes in (MixedPrecision param_dtype); it cannot be told from the files"));
                }
            }
        }
        Ok(found.map(|(_, starts)| {
            members
                .iter()
                .zip(starts)
                .zip(&numels)
                .map(|((&entry, start), &numel)| Slot {
                    entry,
                    start,
                    numel,
                })
                .collect()
        }))
    }

    /// Whether `members`, of `numels` elements starting at `starts` and ending at `end`, fill
    /// the flat parameter (and, with use_orig_params=True, each saved slice is some rank's part).
    fn fills(&self, members: &[usize], numels: &[u64], starts: &[u64], end: u64) -> bool {
        let (total, shard) = (self.total, self.shard);
        if !self.orig_params {
            return end == total;
        }
        // Padded to a multiple of the world size, every shard full.
        let world = total.checked_div(shard).unwrap_or(1);
        shard > 0
            && total % shard == 0
            && end <= total
            && total - end < world.max(1)
            && members
                .iter()
                .zip(starts)
                .zip(numels)
                .all(|((&i, &s), &n)| {
                    let len = self.saved(i).map_or(0, |t| t.shape[0]);
                    slice_fits(s, n, len, shard, world)
                })
    }

    /// The names of reference entries `entries`, for messages.
    fn joined_names(&self, entries: &[usize]) -> String {
        entries
            .iter()
            .map(|&i| self.reference[i].name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The error for members that fill the flat parameter in no way: how many elements they
    /// take, and what to pass instead.
    fn mismatch(&self, members: &[usize], ambiguous: &[usize]) -> Result<Error> {
        let end_seen = layout(&self.numels(members)?, self.aligns[0]).1;
        let shown: Vec<&str> = members
            .iter()
            .take(6)
            .map(|&i| self.reference[i].name.as_str())
            .collect();
        let more = if members.len() > 6 { ", ..." } else { "" };
        let err = self.error(format!(
            "its {} parameters in the reference ({}{more}) take {end_seen} elements{}, which does not match the flat parameter",
            members.len(),
            shown.join(", "),
            if self.orig_params { " with use_orig_params=True padding" } else { "" }
        ));
        Ok(if ambiguous.is_empty() {
            err.hint("--shapes-from must describe the model the checkpoint was saved from, with the same names and shapes; a tied parameter counts once, which only a torch.save or a JSON list of named_parameters() shows")
        } else {
            err.hint(format!(
                "the 1-D tensors {} may be buffers rather than parameters: pass --shapes-from a JSON list [[name, shape], ...] of model.named_parameters(), which has no buffers",
                self.joined_names(ambiguous)
            ))
        })
    }
}

/// `""` shows as the root.
fn unit_name(prefix: &str) -> &str {
    if prefix.is_empty() {
        "<root>"
    } else {
        prefix.trim_end_matches('.')
    }
}

/// Start of each parameter and the end of the last, each start a multiple of `align`.
fn layout(numels: &[u64], align: u64) -> (Vec<u64>, u64) {
    let mut pos = 0u64;
    let starts = numels
        .iter()
        .map(|&n| {
            pos = pos.div_ceil(align).saturating_mul(align);
            let start = pos;
            pos = pos.saturating_add(n);
            start
        })
        .collect();
    (starts, pos)
}

/// Elements per rank: the size of the piece at offset 0 (every rank's but the last ones').
fn shard_numel(flat: &Tensor) -> u64 {
    flat.pieces
        .iter()
        .filter(|p| p.offsets()[0] == 0)
        .map(|p| p.sizes()[0])
        .max()
        .unwrap_or(0)
}

/// Could a use_orig_params slice of `len` elements be some rank's part of `[start, start+numel)`?
fn slice_fits(start: u64, numel: u64, len: u64, shard: u64, world: u64) -> bool {
    (0..world).any(|r| {
        let lo = (r * shard).max(start);
        let hi = ((r + 1) * shard).min(start + numel);
        hi.saturating_sub(lo) == len
    })
}

/// The tensor `entry` names, as pieces of the flat parameter's pieces.
fn cut(flat: &Tensor, chunks: &[PieceRef], entry: &RefEntry, slot: &Slot) -> Result<Tensor> {
    let elem = flat.dtype.size() as u64;
    let ndim = entry.shape.len();
    let mut pieces = Pieces::new(ndim);
    let (lo, hi) = (slot.start, slot.start + slot.numel);
    let strides = crate::model::contiguous_strides(&entry.shape);
    // Chunks are sorted by offset: skip those that end before the parameter starts.
    let first = chunks.partition_point(|p| p.offsets()[0] + p.sizes()[0] <= lo);
    for p in &chunks[first..] {
        if p.offsets()[0] >= hi {
            break;
        }
        let (o, s) = (p.offsets()[0], p.sizes()[0]);
        let (a, b) = (lo.max(o), hi.min(o + s));
        if a >= b {
            continue;
        }
        if s > 1 && p.strides()[0] != 1 {
            return Err(Error::invalid("a flat parameter's piece is not contiguous")
                .file(p.file())
                .tensor(&flat.name)
                .at(p.offset()));
        }
        let mut byte = p.offset() + (a - o) * elem;
        for (offsets, sizes) in flat_range_boxes(&entry.shape, a - lo, b - lo) {
            let n = crate::model::numel(&sizes).unwrap_or(0);
            // Each box is a contiguous run of the rank's bytes: row-major in its own sizes.
            let box_strides = crate::model::contiguous_strides(&sizes);
            pieces.push_parts(
                &offsets,
                &sizes,
                Arc::clone(p.file()),
                byte,
                &box_strides,
                p.encoding(),
            )?;
            byte += n * elem;
        }
    }
    if slot.numel == 0 {
        // An empty parameter is one empty box, like a FULL reader's.
        if let Some(p) = chunks.first() {
            pieces.push_parts(
                &vec![0; ndim],
                &entry.shape,
                Arc::clone(p.file()),
                p.offset(),
                &strides,
                Encoding::Raw,
            )?;
        }
    }
    Ok(Tensor {
        name: entry.name.clone(),
        key_path: key_path(flat, &entry.name),
        dtype: flat.dtype,
        shape: entry.shape.clone(),
        pieces,
    })
}

/// The rebuilt tensor's nesting: the flat parameter's, with its last step renamed. A DCP state
/// dict `{"model": ...}` records `("model", "layers.0._flat_param")`.
fn key_path(flat: &Tensor, name: &str) -> Vec<KeyPart> {
    let Some((KeyPart::Key(_), parents)) = flat.key_path.split_last() else {
        return Vec::new();
    };
    let parent = KeyPart::flat_name(parents);
    let rest = if parent.is_empty() {
        Some(name)
    } else {
        name.strip_prefix(&parent).and_then(|r| r.strip_prefix('.'))
    };
    match rest {
        Some(rest) if !rest.is_empty() => {
            let mut path = parents.to_vec();
            path.push(KeyPart::Key(rest.to_string()));
            path
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests;
