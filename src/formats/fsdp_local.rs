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

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::{Checkpoint, Encoding, Format, KeyPart, PieceRef, Pieces, Tensor};

/// The name FSDP gives a unit's flattened parameters, after the unit's prefix.
pub const FLAT_PARAM: &str = "_flat_param";

thread_local! {
    // The `--shapes-from` of this command. Every read of a checkpoint goes through
    // `detect::read`, in many places of the CLI; a scoped setting reaches them all without each
    // caller passing it along.
    static SHAPES_FROM: RefCell<Option<PathBuf>> = const { RefCell::new(None) };
}

/// While alive, checkpoints read on this thread that are FSDP1 LOCAL are resolved with names and
/// shapes from this reference (see [`apply`]).
pub struct ShapesFrom {
    previous: Option<PathBuf>,
}

impl ShapesFrom {
    pub fn install(reference: Option<PathBuf>) -> ShapesFrom {
        ShapesFrom {
            previous: SHAPES_FROM.with(|s| s.replace(reference)),
        }
    }
}

impl Drop for ShapesFrom {
    fn drop(&mut self) {
        let previous = self.previous.take();
        SHAPES_FROM.with(|s| *s.borrow_mut() = previous);
    }
}

/// What a partitioned run (`--part`) must agree on about `--shapes-from`: the reference's path,
/// size and time, so parts resolved with different references never mix. Empty without one.
pub fn fingerprint() -> String {
    let Some(path) = SHAPES_FROM.with(|s| s.borrow().clone()) else {
        return String::new();
    };
    let abs = std::path::absolute(&path).unwrap_or_else(|_| path.clone());
    let mut line = format!("\nshapes-from {}", abs.display());
    // A directory reference (DCP) changes through its files.
    let mut files = vec![path.clone()];
    if let Ok(dir) = std::fs::read_dir(&path) {
        let mut inner: Vec<PathBuf> = dir.flatten().map(|e| e.path()).collect();
        inner.sort();
        files.extend(inner);
    }
    for f in files {
        if let Ok(meta) = std::fs::metadata(&f) {
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .unwrap_or_default();
            line.push_str(&format!(
                " {}:{}:{}",
                f.file_name().unwrap_or_default().to_string_lossy(),
                meta.len(),
                mtime.as_nanos()
            ));
        }
    }
    line
}

/// True for `_flat_param` and `prefix._flat_param`.
pub fn is_flat_param(name: &str) -> bool {
    name == FLAT_PARAM || name.ends_with("._flat_param")
}

/// The flat parameters of an FSDP1 LOCAL checkpoint not resolved yet (none for any other).
pub fn flat_params(ckpt: &Checkpoint) -> Vec<&Tensor> {
    ckpt.tensors
        .iter()
        .filter(|t| is_flat_param(&t.name) && t.shape.len() == 1)
        .collect()
}

/// The hint every message about missing names and shapes ends with.
pub const SHAPES_HINT: &str = "pass --shapes-from REF: a FULL torch.save of model.state_dict(), a JSON list [[name, shape], ...] in model.named_parameters() order, or a SHARDED checkpoint of the same model";

/// Refuse a LOCAL checkpoint whose flat parameters were not resolved: consolidating them would
/// write FSDP's internal buffers, not the model.
pub fn check_resolved(ckpt: &Checkpoint) -> Result<()> {
    let flats = flat_params(ckpt);
    let Some(first) = flats.first() else {
        return Ok(());
    };
    let names: Vec<String> = flats
        .iter()
        .take(4)
        .map(|t| format!("`{}`", t.name))
        .collect();
    let more = if flats.len() > 4 { ", ..." } else { "" };
    Err(Error::usage(format!(
        "this is an FSDP1 LOCAL_STATE_DICT checkpoint: {} flat parameter{} ({}{more}) hold the model's parameters flattened, and their names and shapes are not in the files",
        flats.len(),
        if flats.len() == 1 { "" } else { "s" },
        names.join(", ")
    ))
    .file(&ckpt.root)
    .tensor(&first.name)
    .hint(SHAPES_HINT))
}

/// Resolve `ckpt` with the installed `--shapes-from` reference when it is an FSDP1 LOCAL
/// checkpoint; anything else, or a LOCAL checkpoint without a reference, is returned as read.
pub fn apply(ckpt: Checkpoint) -> Result<Checkpoint> {
    if flat_params(&ckpt).is_empty() {
        return Ok(ckpt);
    }
    let Some(reference) = SHAPES_FROM.with(|s| s.borrow().clone()) else {
        return Ok(ckpt);
    };
    let entries = read_reference(&reference)?;
    resolve(ckpt, &entries).map_err(|e| {
        if e.file.is_none() {
            e.file(&reference)
        } else {
            e
        }
    })
}

/// A name and shape from the reference, with its dtype where the reference has one.
#[derive(Clone, Debug, PartialEq)]
pub struct RefEntry {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: Option<DType>,
    /// A tied parameter (`lm_head.weight` is `embed.weight`): the index of the entry it shares
    /// storage with. FSDP flattens it once; `model.state_dict()` lists it under both names.
    pub alias_of: Option<usize>,
}

/// Read the names and shapes of `--shapes-from`: a JSON list, or any checkpoint ckpt reads whose
/// tensors are listed in module order.
pub fn read_reference(path: &Path) -> Result<Vec<RefEntry>> {
    if path.extension().is_some_and(|e| e == "json") {
        let text = crate::storage::read(path)?;
        return parse_json(&text).map_err(|e| e.file(path));
    }
    let ckpt = crate::detect::read_layout(path)?;
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
    if let Some(flat) = flat_params(&ckpt).first() {
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
pub fn resolve(mut ckpt: Checkpoint, reference: &[RefEntry]) -> Result<Checkpoint> {
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
    let firsts: HashSet<&str> = flat_params(ckpt)
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
    let total = flat.shape[0];
    let unit_err = |msg: String| {
        Error::invalid(format!(
            "FSDP unit `{}` (`{}`, {total} elements): {msg}",
            unit_name(&unit.prefix),
            flat.name
        ))
        .tensor(&flat.name)
    };
    // FSDP refuses 0-dim parameters: a 0-dim name is a buffer.
    let names: Vec<usize> = unit
        .names
        .iter()
        .copied()
        .filter(|&i| !reference[i].shape.is_empty())
        .collect();
    let saved = |i: usize| {
        by_name
            .get(reference[i].name.as_str())
            .map(|&j| &tensors[j])
    };
    // use_orig_params=False keeps the parameters out of the file, so a name the file lacks is a
    // parameter, and one it holds is a buffer; with True, every parameter is in the file too.
    let absent: Vec<usize> = names
        .iter()
        .copied()
        .filter(|&i| saved(i).is_none())
        .collect();
    let orig_params = absent.is_empty();
    let mut ambiguous = Vec::new();
    let members: Vec<usize> = if orig_params {
        names
            .iter()
            .copied()
            .filter(|&i| {
                let t = saved(i).expect("every name is in the file");
                let r = &reference[i];
                // A parameter is saved as a 1-D slice of itself; anything else is a buffer.
                if t.shape.len() != 1 || t.dtype != flat.dtype {
                    return false;
                }
                // A JSON list of named_parameters() holds no buffers; a checkpoint does.
                if r.shape.len() == 1 && t.shape == r.shape && r.dtype.is_some() {
                    ambiguous.push(i);
                }
                crate::model::numel(&r.shape).is_some_and(|n| t.shape[0] <= n)
            })
            .collect()
    } else {
        absent
    };
    if members.is_empty() {
        if total == 0 {
            return Ok(Vec::new());
        }
        return Err(unit_err(format!(
            "the reference names no parameter under `{}`",
            unit.prefix
        ))
        .hint(
            "--shapes-from must describe the model the checkpoint was saved from, with the same names",
        ));
    }
    for &i in &members {
        let r = &reference[i];
        if let Some(d) = r.dtype {
            if d != flat.dtype {
                return Err(unit_err(format!(
                    "`{}` is {d} in the reference but the flat parameter is {}",
                    r.name, flat.dtype
                ))
                .hint("pass a reference saved in the training dtype, or a JSON list of names and shapes"));
            }
        }
    }
    let shard = shard_numel(flat);
    // Alignment is by the dtype FSDP computes in (a MixedPrecision param_dtype may differ from
    // the stored one), so the stored dtype's comes first and the others after it.
    let aligns: Vec<u64> = if orig_params {
        let own = 16 / flat.dtype.size().max(1) as u64;
        let mut a = vec![own.max(1)];
        a.extend([8, 16, 4, 2, 1].into_iter().filter(|&x| x != own));
        a
    } else {
        vec![1]
    };
    let numels_of = |members: &[usize]| -> Result<Vec<u64>> {
        members
            .iter()
            .map(|&i| {
                crate::model::numel(&reference[i].shape).ok_or_else(|| {
                    unit_err(format!("`{}` has too many elements", reference[i].name))
                })
            })
            .collect()
    };
    // The slots of `members` if they fill the flat parameter as FSDP lays it out.
    // The slots of `members` if they fill the flat parameter as FSDP lays it out: with the
    // stored dtype's alignment, or else with the one other alignment every fitting layout agrees
    // on (a MixedPrecision param_dtype of another size); layouts that disagree are refused.
    let fit = |members: &[usize]| -> Result<Option<Vec<Slot>>> {
        let numels = numels_of(members)?;
        let fits = |starts: &[u64], end: u64| {
            if !orig_params {
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
                    .zip(&numels)
                    .all(|((&i, &s), &n)| {
                        let len = saved(i).map_or(0, |t| t.shape[0]);
                        slice_fits(s, n, len, shard, world)
                    })
        };
        let mut found: Option<(u64, Vec<u64>)> = None;
        for (k, &align) in aligns.iter().enumerate() {
            let (starts, end) = layout(&numels, align);
            if !fits(&starts, end) {
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
                    return Err(unit_err(format!(
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
    };
    let as_params = fit(&members)?;
    // A 1-D buffer saved whole looks like a parameter's slice: the other reading is tried too,
    // and when both fill the flat parameter the files cannot tell which is right.
    let ambiguous_names = || {
        ambiguous
            .iter()
            .map(|&i| reference[i].name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let as_buffers = if ambiguous.is_empty() {
        None
    } else {
        let rest: Vec<usize> = members
            .iter()
            .copied()
            .filter(|i| !ambiguous.contains(i))
            .collect();
        fit(&rest)?
    };
    match (as_params, as_buffers) {
        (Some(slots), None) | (None, Some(slots)) => return Ok(slots),
        (Some(_), Some(_)) => {
            return Err(unit_err(format!(
                "the 1-D tensors {} fit both as parameters and as buffers",
                ambiguous_names()
            ))
            .hint("pass --shapes-from a JSON list [[name, shape], ...] of model.named_parameters(), which has no buffers"))
        }
        (None, None) => {}
    }
    let end_seen = layout(&numels_of(&members)?, aligns[0]).1;
    let shown: Vec<&str> = members
        .iter()
        .take(6)
        .map(|&i| reference[i].name.as_str())
        .collect();
    let more = if members.len() > 6 { ", ..." } else { "" };
    let mut err = unit_err(format!(
        "its {} parameters in the reference ({}{more}) take {end_seen} elements{}, which does not match the flat parameter",
        members.len(),
        shown.join(", "),
        if orig_params { " with use_orig_params=True padding" } else { "" }
    ));
    err = if ambiguous.is_empty() {
        err.hint("--shapes-from must describe the model the checkpoint was saved from, with the same names and shapes; a tied parameter counts once, which only a torch.save or a JSON list of named_parameters() shows")
    } else {
        err.hint(format!(
            "the 1-D tensors {} may be buffers rather than parameters: pass --shapes-from a JSON list [[name, shape], ...] of model.named_parameters(), which has no buffers",
            ambiguous_names()
        ))
    };
    Err(err)
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
        for (offsets, sizes) in boxes(&entry.shape, a - lo, b - lo) {
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

/// The boxes (offsets, sizes) that elements `[lo, hi)` of a row-major tensor of `shape` make, in
/// order: at most `2 * (ndim - 1) + 1`, each a contiguous run of the flat elements.
pub fn boxes(shape: &[u64], lo: u64, hi: u64) -> Vec<(Vec<u64>, Vec<u64>)> {
    if lo >= hi {
        return Vec::new();
    }
    let Some((&rows, rest)) = shape.split_first() else {
        return vec![(Vec::new(), Vec::new())];
    };
    let inner = crate::model::numel(rest).unwrap_or(0);
    if inner == 0 {
        return Vec::new();
    }
    let row = |r: u64, sub: Vec<(Vec<u64>, Vec<u64>)>| {
        sub.into_iter().map(move |(mut o, mut s)| {
            o.insert(0, r);
            s.insert(0, 1);
            (o, s)
        })
    };
    let (r0, c0) = (lo / inner, lo % inner);
    let (r1, c1) = (hi / inner, hi % inner);
    let mut out = Vec::new();
    if r0 == r1 {
        out.extend(row(r0, boxes(rest, c0, c1)));
        return out;
    }
    let mut first_full = r0;
    if c0 != 0 {
        out.extend(row(r0, boxes(rest, c0, inner)));
        first_full += 1;
    }
    if r1 > first_full {
        let mut o = vec![first_full];
        o.extend(std::iter::repeat_n(0, rest.len()));
        let mut s = vec![r1 - first_full];
        s.extend_from_slice(rest);
        out.push((o, s));
    }
    if c1 != 0 && r1 < rows {
        out.extend(row(r1, boxes(rest, 0, c1)));
    }
    out
}

/// The rebuilt tensor's nesting: the flat parameter's, with its last step renamed. A DCP state
/// dict `{"model": ...}` records `("model", "layers.0._flat_param")`.
fn key_path(flat: &Tensor, name: &str) -> Vec<KeyPart> {
    let Some((KeyPart::Key(_), parents)) = flat.key_path.split_last() else {
        return Vec::new();
    };
    let parent = crate::detect::flat_name(parents);
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
mod tests {
    use super::*;
    use crate::model::{contiguous_strides, numel, DataRef, Piece};

    /// Every element of `[lo, hi)` exactly once, in order, each box contiguous, at most
    /// 2*(ndim-1)+1 boxes.
    fn check(shape: &[u64], lo: u64, hi: u64) {
        let bs = boxes(shape, lo, hi);
        let strides = contiguous_strides(shape);
        let mut next = lo;
        for (o, s) in &bs {
            let first: u64 = o.iter().zip(&strides).map(|(a, b)| a * b).sum();
            assert_eq!(first, next, "{shape:?} [{lo},{hi}) {bs:?}");
            // contiguous: all dims after the first non-1 size are full
            let lead = s.iter().position(|&x| x != 1).unwrap_or(s.len());
            for d in lead + 1..s.len() {
                assert_eq!(s[d], shape[d], "{shape:?} [{lo},{hi}) {bs:?}");
                assert_eq!(o[d], 0);
            }
            next += numel(s).unwrap();
        }
        assert_eq!(next, hi.max(lo), "{shape:?} [{lo},{hi}) {bs:?}");
        assert!(bs.len() <= 2 * shape.len().saturating_sub(1) + 1);
    }

    #[test]
    fn flat_ranges_decompose_into_contiguous_boxes() {
        for shape in [&[7u64][..], &[3, 5], &[2, 3, 4], &[1, 1, 6], &[4, 1, 3, 2]] {
            let n = numel(shape).unwrap();
            for lo in 0..=n {
                for hi in lo..=n {
                    check(shape, lo, hi);
                }
            }
        }
        assert_eq!(boxes(&[], 0, 1), vec![(vec![], vec![])]);
        assert!(boxes(&[0, 3], 0, 0).is_empty());
        assert_eq!(
            boxes(&[3, 4], 2, 11),
            vec![
                (vec![0, 2], vec![1, 2]),
                (vec![1, 0], vec![1, 4]),
                (vec![2, 0], vec![1, 3])
            ]
        );
    }

    fn flat(name: &str, total: u64, shard: u64) -> Tensor {
        let mut pieces = Pieces::new(1);
        let mut o = 0;
        let mut r = 0;
        while o < total {
            let s = shard.min(total - o);
            pieces
                .push(Piece {
                    offsets: vec![o],
                    sizes: vec![s],
                    data: DataRef {
                        file: Path::new(&format!("__{r}_0.distcp")).into(),
                        offset: 1000,
                        strides: vec![1],
                        encoding: Encoding::Raw,
                    },
                })
                .unwrap();
            o += s;
            r += 1;
        }
        Tensor {
            name: name.into(),
            key_path: Vec::new(),
            dtype: DType::F32,
            shape: vec![total],
            pieces,
        }
    }

    fn plain(name: &str, shape: &[u64]) -> Tensor {
        Tensor {
            name: name.into(),
            key_path: Vec::new(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces: Pieces::single(Piece {
                offsets: vec![0; shape.len()],
                sizes: shape.to_vec(),
                data: DataRef {
                    file: Path::new("__0_0.distcp").into(),
                    offset: 0,
                    strides: contiguous_strides(shape),
                    encoding: Encoding::Raw,
                },
            })
            .unwrap(),
        }
    }

    fn ckpt(tensors: Vec<Tensor>) -> Checkpoint {
        Checkpoint {
            root: PathBuf::from("local"),
            format: Format::Dcp,
            world_size: Some(2),
            tensors,
            values: Vec::new(),
            unsupported: Vec::new(),
        }
    }

    fn entry(name: &str, shape: &[u64]) -> RefEntry {
        RefEntry {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: None,
            alias_of: None,
        }
    }

    #[test]
    fn unpadded_units_resolve_and_keep_buffers() {
        // Root: w (3, 5) + b (4) = 19 over 2 ranks (10 + 9); nested unit `l.0.`: 6 elements.
        let c = ckpt(vec![
            flat("_flat_param", 19, 10),
            plain("count", &[]),
            flat("l.0._flat_param", 6, 3),
        ]);
        assert!(check_resolved(&c).is_err());
        let reference = vec![
            entry("w", &[3, 5]),
            entry("count", &[]),
            entry("l.0.x", &[2, 3]),
            entry("b", &[4]),
        ];
        let out = resolve(c, &reference).unwrap();
        check_resolved(&out).unwrap();
        let names: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["w", "count", "l.0.x", "b"]);
        let w = &out.tensors[0];
        // rank 0 holds w[0..10) = rows 0-1, rank 1 w[10..15) = row 2
        let got: Vec<(Vec<u64>, Vec<u64>, u64)> = w
            .pieces
            .iter()
            .map(|p| (p.offsets().to_vec(), p.sizes().to_vec(), p.offset()))
            .collect();
        assert_eq!(
            got,
            vec![
                (vec![0, 0], vec![2, 5], 1000),
                (vec![2, 0], vec![1, 5], 1000)
            ]
        );
        let b = &out.tensors[3];
        assert_eq!(b.pieces.len(), 1);
        assert_eq!(b.pieces.get(0).offset(), 1000 + 5 * 4);
    }

    #[test]
    fn orig_params_pad_and_drop_slices() {
        // use_orig_params=True, f32 (align 4), 2 ranks: a (5) at 0, pad 3, c (2, 3) at 8..14,
        // world pad to 14 -> 14 (divisible by 2): shard 7.
        let c = ckpt(vec![
            plain("a", &[5]),
            plain("c", &[0]),
            flat("_flat_param", 14, 7),
        ]);
        let out = resolve(c, &[entry("a", &[5]), entry("c", &[2, 3])]).unwrap();
        let names: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        let c = &out.tensors[1];
        let got: Vec<(Vec<u64>, Vec<u64>)> = c
            .pieces
            .iter()
            .map(|p| (p.offsets().to_vec(), p.sizes().to_vec()))
            .collect();
        // elements 8..14: rank 1 (7..14) holds all of c, from its element 1
        assert_eq!(got, vec![(vec![0, 0], vec![2, 3])]);
        assert_eq!(c.pieces.get(0).offset(), 1000 + 4);
    }

    fn with_dtype(name: &str, shape: &[u64]) -> RefEntry {
        RefEntry {
            dtype: Some(DType::F32),
            ..entry(name, shape)
        }
    }

    #[test]
    fn a_1d_buffer_saved_whole_is_told_from_a_parameter_or_refused() {
        // use_orig_params=True on 8 ranks: `a` (9) at 0..9, padded to 16, shard 2.
        let flat16 = || flat("_flat_param", 16, 2);
        let slice = |name: &str, len: u64| plain(name, &[len]);
        // `rm` (4) read as a parameter would sit at 12..16, but no rank holds 4 of it: a buffer.
        let c = ckpt(vec![slice("a", 2), slice("rm", 4), flat16()]);
        let out = resolve(c, &[with_dtype("a", &[9]), with_dtype("rm", &[4])]).unwrap();
        let rm = out.tensors.iter().find(|t| t.name == "rm").unwrap();
        assert_eq!(rm.pieces.get(0).file().to_str(), Some("__0_0.distcp"));
        assert_eq!(
            rm.pieces.get(0).offset(),
            0,
            "the buffer as saved, not flat bytes"
        );
        // `z` (1) fits in the padding as well as being a buffer: the files cannot tell.
        let c = ckpt(vec![slice("a", 2), slice("z", 1), flat16()]);
        let e = resolve(c, &[with_dtype("a", &[9]), with_dtype("z", &[1])]).unwrap_err();
        assert!(
            e.message.contains("both as parameters and as buffers"),
            "{}",
            e.message
        );
        assert!(e.hint.unwrap().contains("named_parameters()"));
        // a JSON list has no buffers: `z` is a parameter
        let c = ckpt(vec![slice("a", 2), slice("z", 1), flat16()]);
        let out = resolve(c, &[entry("a", &[9]), entry("z", &[1])]).unwrap();
        let z = out.tensors.iter().find(|t| t.name == "z").unwrap();
        assert_eq!(
            z.pieces.get(0).offset(),
            1000,
            "element 12 is the start of rank 6's piece"
        );
    }

    #[test]
    fn a_mixed_precision_alignment_is_found_when_it_is_the_only_one() {
        // f32 storage, bf16 compute (8-element alignment), 2 ranks: `a` (9) at 0, `b` (3) at 16,
        // padded to 20. With f32's 4, `b` would be at 12 and leave 5 elements of padding.
        let c = ckpt(vec![
            plain("a", &[9]),
            plain("b", &[0]),
            flat("_flat_param", 20, 10),
        ]);
        let out = resolve(c, &[entry("a", &[9]), entry("b", &[3])]).unwrap();
        let b = out.tensors.iter().find(|t| t.name == "b").unwrap();
        // element 16 is element 6 of rank 1's piece
        assert_eq!(b.pieces.get(0).offset(), 1000 + 6 * 4);
        // 10 ranks, shard 2: f32's 4 leaves too much padding, and 8 (`b` at 8) and 16 (`b` at
        // 16) both fit, placing `b` differently: refused
        let c = ckpt(vec![
            plain("a", &[1]),
            plain("b", &[2]),
            flat("_flat_param", 20, 2),
        ]);
        let e = resolve(c, &[entry("a", &[1]), entry("b", &[3])]).unwrap_err();
        assert!(e.message.contains("alignment"), "{}", e.message);
    }

    #[test]
    fn mismatches_name_the_unit() {
        let c = ckpt(vec![flat("l.0._flat_param", 6, 3)]);
        let e = resolve(c.clone(), &[entry("l.0.x", &[7])]).unwrap_err();
        assert!(e.message.contains("FSDP unit `l.0`"), "{}", e.message);
        let e = resolve(c.clone(), &[entry("other.x", &[6])]).unwrap_err();
        assert!(e.message.contains("names no parameter"), "{}", e.message);
        let mut wrong = entry("l.0.x", &[6]);
        wrong.dtype = Some(DType::BF16);
        let e = resolve(c, &[wrong]).unwrap_err();
        assert!(e.message.contains("BF16"), "{}", e.message);
    }

    #[test]
    fn app_prefix_and_json() {
        let mut f = flat("model._flat_param", 4, 2);
        f.key_path = vec![
            KeyPart::Key("model".into()),
            KeyPart::Key("_flat_param".into()),
        ];
        let out = resolve(ckpt(vec![f]), &[entry("w", &[2, 2])]).unwrap();
        assert_eq!(out.tensors[0].name, "model.w");
        assert_eq!(
            out.tensors[0].key_path,
            vec![KeyPart::Key("model".into()), KeyPart::Key("w".into())]
        );
        let parsed = parse_json(br#"[["a.w", [2, 3]], ["b", []]]"#).unwrap();
        assert_eq!(parsed, vec![entry("a.w", &[2, 3]), entry("b", &[])]);
        assert!(parse_json(br#"{"a": [1]}"#).is_err());
        let twice = [entry("w", &[2]), entry("w", &[2])];
        let e = resolve(ckpt(vec![flat("_flat_param", 4, 2)]), &twice).unwrap_err();
        assert!(e.message.contains("`w` twice"), "{}", e.message);
        assert!(parse_json(br#"[["a", [-1]]]"#).is_err());
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn shape() -> impl Strategy<Value = Vec<u64>> {
            prop::collection::vec(0u64..5, 0..4)
        }

        proptest! {
            /// Any parameter list that fits a flat parameter split over any world size comes back
            /// as pieces covering each parameter exactly once, at the bytes of its flat range.
            #[test]
            fn resolved_pieces_cover_each_parameter(
                shapes in prop::collection::vec(shape(), 1..6),
                world in 1u64..6,
                orig in any::<bool>(),
            ) {
                let shapes: Vec<Vec<u64>> = shapes.into_iter().filter(|s| !s.is_empty()).collect();
                prop_assume!(!shapes.is_empty());
                let numels: Vec<u64> = shapes.iter().map(|s| numel(s).unwrap()).collect();
                let (starts, end) = layout(&numels, if orig { 4 } else { 1 });
                let total = if orig { end.div_ceil(world) * world } else { end };
                prop_assume!(total > 0);
                let shard = total.div_ceil(world);
                let names: Vec<String> = (0..shapes.len()).map(|i| format!("p{i}")).collect();
                let mut tensors = Vec::new();
                if orig {
                    for (k, n) in names.iter().enumerate() {
                        // rank 0's slice, as DCP may keep it
                        let lo = starts[k].min(shard);
                        let hi = (starts[k] + numels[k]).min(shard);
                        tensors.push(plain(n, &[hi.saturating_sub(lo)]));
                    }
                }
                tensors.push(flat("_flat_param", total, shard));
                let reference: Vec<RefEntry> =
                    names.iter().zip(&shapes).map(|(n, s)| entry(n, s)).collect();
                // Only use_orig_params=True can be refused: another alignment may fit as well.
                let out = match resolve(ckpt(tensors), &reference) {
                    Ok(out) => out,
                    Err(e) => {
                        prop_assert!(orig && e.message.contains("alignment"), "{}", e.message);
                        return Ok(());
                    }
                };
                for (k, t) in out.tensors.iter().enumerate() {
                    prop_assert_eq!(&t.shape, &shapes[k]);
                    let boxes: Vec<crate::geometry::NdBox> = t.pieces.iter().map(|p| crate::geometry::NdBox {
                        offsets: p.offsets().to_vec(),
                        sizes: p.sizes().to_vec(),
                    }).filter(|b| numel(&b.sizes) != Some(0)).collect();
                    if numels[k] > 0 {
                        prop_assert!(crate::geometry::check_coverage(&t.shape, &boxes).is_empty(), "{:?} {:?}", t.shape, boxes);
                    }
                    // each piece's first element is where its flat index lies in its rank's piece
                    let strides = contiguous_strides(&t.shape);
                    for p in t.pieces.iter().filter(|p| numel(p.sizes()) != Some(0)) {
                        let flat_index = starts[k] + p.offsets().iter().zip(&strides).map(|(a, b)| a * b).sum::<u64>();
                        let rank = flat_index / shard;
                        prop_assert_eq!(p.file().to_str().unwrap(), format!("__{rank}_0.distcp"));
                        prop_assert_eq!(p.offset(), 1000 + (flat_index - rank * shard) * 4);
                    }
                }
            }
        }
    }
}
