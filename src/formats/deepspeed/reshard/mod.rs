//! `reshard --format deepspeed`: a ZeRO checkpoint written again as DeepSpeed's own
//! `engine.save_checkpoint` would have written it on another number of data-parallel ranks, so
//! that a plain `engine.load_checkpoint(dir)` resumes it (DeepSpeed itself refuses a ZeRO
//! checkpoint saved at another data-parallel size, short of its offline universal conversion).
//!
//! Stages 1 and 2 keep each parameter group as one flat fp32 buffer whose order of elements does
//! not depend on the world size: the trainable parameters in `param_shapes` order (tied ones once,
//! frozen ones out), each followed by its `param_alignment_paddings`. Only the zero padding at the
//! end does: DeepSpeed pads the group to a multiple of `2 * world` (`nccl_start_alignment_factor`
//! times the data-parallel size) and cuts it into `world` equal partitions. So each rank file at
//! the new size is a few runs of the old rank files' bytes plus zeros, copied through a small
//! buffer ([`super::reshard_write`]); no buffer is ever gathered whole. Stage 3 cuts each
//! parameter on its own and saves model states per rank: [`stage3`].
//!
//! The pickles are read as data ([`pickle::read`], nothing run) and written back with the same
//! classes (`DynamicLossScaler`, `ZeroStageEnum`, `fragment_address`, `OrderedDict`, torch's
//! tensor rebuilds), changed only where the world size shows: `dp_world_size`, the partitions,
//! `group_paddings`, `partition_count` and `param_slice_mappings`. Everything else (module and
//! buffers, frozen parameters, lr scheduler, client state, loss scaler, `step`, param groups) is
//! carried as saved.

mod source;
mod stage3;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::files::{Set, Tag, LATEST};
use crate::error::{Error, Result};
use crate::formats::torch_save;
use crate::pickle::{self, Protocol, Value};
use crate::storage;
use crate::zip::ZipRecord;
use source::{dict_get, entries, flat_tensor, set, SavedFile, TensorRef};

/// The recovery scripts DeepSpeed 0.19's `save_checkpoint` copies beside the tags
/// (`_copy_recovery_script`), which people run there, offline, to get the weights without
/// DeepSpeed's engine.
pub(crate) const RECOVERY_SCRIPTS: [&str; 2] = ["zero_to_fp32.py", "zero_to_torch.py"];
/// What DeepSpeed pads a group to, per rank: `nccl_start_alignment_factor` in stage_1_and_2.py.
const ALIGNMENT_PER_RANK: u64 = 2;
const OPTIMIZER: &str = "optimizer_state_dict";

/// Where the bytes of part of a destination record come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Run {
    /// `len` bytes of input `input` at byte `offset`.
    Copy { input: usize, offset: u64, len: u64 },
    /// `len` zero bytes (a partition's padding).
    Zeros(u64),
}

/// What a destination file holds.
#[derive(Debug)]
pub(crate) enum Body {
    /// Small literal bytes (`latest`).
    Bytes(Vec<u8>),
    /// An input copied whole, its permissions too (the recovery scripts, which DeepSpeed
    /// makes executable).
    Copy(usize),
    /// A torch.save archive: its records, the storage records (`{prefix}/data/{key}`) without
    /// content, each filled from runs keyed by storage key.
    Archive {
        records: Vec<ZipRecord>,
        runs: HashMap<String, Vec<Run>>,
    },
}

/// One destination file, relative to the output directory.
#[derive(Debug)]
pub(crate) struct OutFile {
    pub path: PathBuf,
    pub body: Body,
}

/// A DeepSpeed checkpoint planned at a new world size.
#[derive(Debug)]
pub(crate) struct Resharded {
    /// Files that runs and copies read; [`Run::Copy::input`] indexes this.
    pub inputs: Vec<PathBuf>,
    pub files: Vec<OutFile>,
    pub stage: i64,
    pub from_world: usize,
}

/// Plan rewriting the DeepSpeed checkpoint at `path` (a directory with `latest`, or a tag's
/// directory; `tag` as `--tag`) for `world` data-parallel ranks.
pub(crate) fn plan(path: &Path, tag: Option<&str>, world: usize) -> Result<Resharded> {
    if world == 0 {
        return Err(Error::usage("--world-size must be at least 1"));
    }
    let tag = Tag::find(path, tag)?;
    if storage::is_dir(&tag.dir.join(super::files::UNIVERSAL_DIR)) {
        return Err(Error::usage(
            "not yet: a Universal Checkpoint input cannot be written as ZeRO rank files",
        )
        .file(&tag.dir)
        .hint("DeepSpeed loads a Universal Checkpoint at any size with `checkpoint.load_universal`; or reshard the ZeRO tag it was made from"));
    }
    let set = Set::list(&tag.dir)?;
    let mut inputs: Vec<PathBuf> = Vec::new();
    let mut open = |p: &Path| -> Result<SavedFile> {
        inputs.push(p.to_path_buf());
        SavedFile::open(p, inputs.len() - 1)
    };
    let model = set
        .model
        .iter()
        .map(|p| open(p))
        .collect::<Result<Vec<_>>>()?;
    let optim = set
        .optim
        .iter()
        .map(|p| open(p))
        .collect::<Result<Vec<_>>>()?;
    let tag_dir = PathBuf::from(&tag.name);
    let mut files = Vec::new();
    let (stage, from_world) = match optim.first() {
        None => (0, 1),
        Some(first) => {
            let stage = zero_stage(first)?;
            (stage, optim.len())
        }
    };
    let bf16 = set.optim.first().is_some_and(|p| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("bf16_"))
    });
    let optim_name = |r: usize| {
        format!(
            "{}zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            if bf16 { "bf16_" } else { "" }
        )
    };
    if stage == 3 {
        files.extend(stage3::files(&model, &optim, &tag_dir, &optim_name, world)?);
    } else {
        files.extend(stage012(
            &model,
            &optim,
            &tag,
            &tag_dir,
            &optim_name,
            stage,
            world,
        )?);
    }
    files.push(OutFile {
        path: PathBuf::from(LATEST),
        body: Body::Bytes(tag.name.clone().into_bytes()),
    });
    let root = if tag.dir == path {
        tag.dir.parent()
    } else {
        Some(path)
    };
    for name in RECOVERY_SCRIPTS {
        if let Some(script) = root.map(|r| r.join(name)).filter(|p| storage::is_file(p)) {
            inputs.push(script);
            files.push(OutFile {
                path: PathBuf::from(name),
                body: Body::Copy(inputs.len() - 1),
            });
        }
    }
    Ok(Resharded {
        inputs,
        files,
        stage,
        from_world,
    })
}

/// The files of a stage 0, 1 or 2 save at `world` ranks: one model states file and, for stages 1
/// and 2, optimizer states per rank.
fn stage012(
    model: &[SavedFile],
    optim: &[SavedFile],
    tag: &Tag,
    tag_dir: &Path,
    optim_name: &dyn Fn(usize) -> String,
    stage: i64,
    world: usize,
) -> Result<Vec<OutFile>> {
    let [model_states] = model else {
        return Err(Error::invalid(format!(
            "ZeRO stage {stage} saves one `mp_rank_00_model_states.pt`, the tag holds {}",
            model.len()
        ))
        .file(&tag.dir));
    };
    let groups = match optim.is_empty() {
        true => None,
        false => Some(Groups::of(model_states, optim)?),
    };
    let mut files = vec![model_file(model_states, groups.as_ref(), tag_dir, world)?];
    if let Some(groups) = &groups {
        check_partitions(optim, groups)?;
        for r in 0..world {
            let path = tag_dir.join(optim_name(r));
            files.push(optim_file(optim, groups, &path, r, world)?);
        }
    }
    Ok(files)
}

/// The ZeRO stage a rank's optimizer states record.
fn zero_stage(first: &SavedFile) -> Result<i64> {
    let Some(stage) = first.at(&[OPTIMIZER, "zero_stage"]) else {
        // BF16_Optimizer (bf16, stage 1, fp32 gradient accumulation) records no stage and keeps
        // its partitions differently.
        return Err(Error::usage(
            "not yet: this optimizer state has no `zero_stage` (DeepSpeed's BF16_Optimizer); ckpt writes ZeRO-1/2 saves of its ZeRO optimizer",
        )
        .file(&first.path)
        .hint("reshard it to DCP (`--format dcp`) instead"));
    };
    match stage {
        Value::Object(o)
            if o.callable.as_global() == Some((super::ZERO_CONFIG, "ZeroStageEnum")) =>
        {
            o.args.first().and_then(Value::as_int)
        }
        other => other.as_int(),
    }
    .ok_or_else(|| first.missing("ZeRO stage at `optimizer_state_dict.zero_stage`"))
}

/// `mp_rank_00_model_states.pt` as saved, with `dp_world_size` the new size.
fn model_file(
    model: &SavedFile,
    groups: Option<&Groups>,
    tag_dir: &Path,
    world: usize,
) -> Result<OutFile> {
    let mut root = model.root.clone();
    if dict_get(&root, "dp_world_size").is_none() {
        return Err(model.missing("`dp_world_size`"));
    }
    set(&mut root, &["dp_world_size"], Value::Int(world as i64))?;
    // Stages 1 and 2 save each trained parameter as a view of its group's flat 16-bit buffer,
    // and torch.save keeps the whole buffer: at the new size it is padded to 2 * world instead.
    let mut resized: HashMap<String, u64> = HashMap::new();
    let mut fresh = HashMap::new();
    if let Some(groups) = groups {
        for (g, group) in groups.groups.iter().enumerate() {
            let Some((name, _, _)) = group.first() else {
                continue;
            };
            let Some(t) = model.at(&["module", name]).and_then(TensorRef::of) else {
                continue;
            };
            let Some(&(offset, len)) = model.storages.get(&t.key) else {
                continue;
            };
            let (size, _) = partitions(groups.numel(g), world as u64);
            let elements = size * world as u64;
            let bytes = elements * t.elem;
            let mut runs = vec![Run::Copy {
                input: model.input,
                offset,
                len: len.min(bytes),
            }];
            if bytes > len {
                runs.push(Run::Zeros(bytes - len));
            }
            fresh.insert(t.key.clone(), (bytes, runs));
            resized.insert(t.key, elements);
        }
    }
    rename_storages(&mut root, &mut |items: &mut Vec<Value>| {
        let elements = items
            .get(2)
            .and_then(Value::as_str)
            .and_then(|k| resized.get(k));
        if let (Some(&elements), Some(numel)) = (elements, items.get_mut(4)) {
            *numel = Value::Int(elements as i64);
        }
    });
    let name = tag_dir.join("mp_rank_00_model_states.pt");
    archive(&name, root, model, fresh)
}

/// A torch.save archive of `root` at `path`: tensors over storages of `template` are copied from
/// its records; those over a key in `fresh` are filled from those runs. Storages are renamed
/// `0`, `1`, ... in order of first use, as torch.save names them.
fn archive(
    path: &Path,
    mut root: Value,
    template: &SavedFile,
    mut fresh: HashMap<String, (u64, Vec<Run>)>,
) -> Result<OutFile> {
    let mut renamed: HashMap<String, String> = HashMap::new();
    let mut storages: Vec<(String, u64)> = Vec::new();
    let mut runs: HashMap<String, Vec<Run>> = HashMap::new();
    let mut error = None;
    rename_storages(&mut root, &mut |items: &mut Vec<Value>| {
        let Some(Value::Str(old)) = items.get_mut(2) else {
            return;
        };
        if let Some(new) = renamed.get(old.as_str()) {
            *old = new.clone();
            return;
        }
        let new = storages.len().to_string();
        let (len, filled) = match fresh.remove(old.as_str()) {
            Some(fill) => fill,
            None => match template.storages.get(old.as_str()) {
                Some(&(offset, len)) => (
                    len,
                    vec![Run::Copy {
                        input: template.input,
                        offset,
                        len,
                    }],
                ),
                None => {
                    error.get_or_insert_with(|| {
                        template.missing(&format!("storage record `{old}` its pickle names"))
                    });
                    (0, Vec::new())
                }
            },
        };
        storages.push((new.clone(), len));
        runs.insert(new.clone(), filled);
        renamed.insert(old.to_string(), new.clone());
        *old = new;
    });
    if let Some(e) = error {
        return Err(e);
    }
    let prefix = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("archive")
        .to_string();
    let records = torch_save::records(&prefix, pickle::write(&root, Protocol::V2), &storages);
    Ok(OutFile {
        path: path.to_path_buf(),
        body: Body::Archive { records, runs },
    })
}

/// Call `visit` with the items of every storage's persistent id in `value`
/// (`('storage', class, key, location, numel)`), in the order pickle writes them.
fn rename_storages(value: &mut Value, rename: &mut dyn FnMut(&mut Vec<Value>)) {
    match value {
        Value::PersistentId(id) => {
            if let Value::Tuple(items) = id.as_mut() {
                if items.first().and_then(Value::as_str) == Some("storage") {
                    rename(items);
                }
            }
        }
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter_mut().for_each(|v| rename_storages(v, rename))
        }
        Value::Dict(items) => items.iter_mut().for_each(|(k, v)| {
            rename_storages(k, rename);
            rename_storages(v, rename);
        }),
        Value::Object(o) => {
            o.args.iter_mut().for_each(|v| rename_storages(v, rename));
            o.list_items
                .iter_mut()
                .for_each(|v| rename_storages(v, rename));
            o.dict_items.iter_mut().for_each(|(k, v)| {
                rename_storages(k, rename);
                rename_storages(v, rename);
            });
            if let Some(state) = &mut o.state {
                rename_storages(state, rename);
            }
        }
        _ => {}
    }
}

/// Each parameter group's layout: its parameters (name, numel, padding after it) in order.
struct Groups {
    groups: Vec<Vec<(String, u64, u64)>>,
}

impl Groups {
    fn of(model: &SavedFile, optim: &[SavedFile]) -> Result<Groups> {
        let first = &optim[0];
        let shapes = model
            .at(&["param_shapes"])
            .and_then(Value::as_seq)
            .ok_or_else(|| model.missing("`param_shapes`"))?;
        let paddings = first.at(&[OPTIMIZER, "param_alignment_paddings"]);
        let mut groups = Vec::new();
        for (g, shapes) in shapes.iter().enumerate() {
            let shapes = super::shapes_of(shapes)
                .ok_or_else(|| model.missing(&format!("shapes at `param_shapes[{g}]`")))?;
            let pads: Vec<u64> = match paddings {
                None => vec![0; shapes.len()],
                Some(p) => p
                    .as_seq()
                    .and_then(|p| p.get(g))
                    .and_then(Value::as_sizes)
                    .filter(|p| p.len() == shapes.len())
                    .ok_or_else(|| {
                        first.missing(&format!("`param_alignment_paddings[{g}]` per parameter"))
                    })?,
            };
            let group = shapes
                .into_iter()
                .zip(pads)
                .map(|((name, shape), pad)| (name, shape.iter().product::<u64>(), pad))
                .collect();
            groups.push(group);
        }
        if ds_config_flag(model, "round_robin_gradients") {
            return Err(Error::usage(
                "not yet: `round_robin_gradients` orders a group's parameters by world size",
            )
            .file(&model.path));
        }
        Ok(Groups { groups })
    }

    /// Elements of group `g` before DeepSpeed's end padding.
    fn numel(&self, g: usize) -> u64 {
        self.groups[g].iter().map(|(_, n, p)| n + p).sum()
    }
}

/// Whether the saved `ds_config.zero_optimization` sets `key` true.
fn ds_config_flag(model: &SavedFile, key: &str) -> bool {
    model
        .at(&["ds_config", "zero_optimization", key])
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// Partition size and each rank's end padding of a group of `numel` elements over `world` ranks,
/// as stage_1_and_2.py computes them.
pub(crate) fn partitions(numel: u64, world: u64) -> (u64, Vec<u64>) {
    let align = ALIGNMENT_PER_RANK * world;
    let total = numel.div_ceil(align) * align;
    let size = total / world;
    let pads = (0..world)
        .map(|r| {
            // All padding when the group ends before the partition, some when inside it.
            let left = r * size;
            if numel <= left {
                size
            } else {
                (left + size).saturating_sub(numel)
            }
        })
        .collect();
    (size, pads)
}

/// Check, once, what every rank file must agree on: `partition_count` is the number of rank
/// files for each group, and the moments are saved with their padding (not elastic).
fn check_partitions(optim: &[SavedFile], groups: &Groups) -> Result<()> {
    let from = optim.len() as u64;
    for (s, source) in optim.iter().enumerate() {
        let counts = source
            .at(&[OPTIMIZER, "partition_count"])
            .and_then(Value::as_sizes)
            .ok_or_else(|| source.missing("`partition_count`"))?;
        if counts.len() != groups.groups.len() || counts.iter().any(|&c| c != from) {
            return Err(Error::invalid(format!(
                "`partition_count` is {counts:?}, but the tag holds {from} rank files for {} groups (rank {s})",
                groups.groups.len()
            ))
            .file(&source.path)
            .hint("a save over another world size was written into the same tag, or rank files are missing"));
        }
        let base = source
            .at(&[OPTIMIZER, "base_optimizer_state"])
            .ok_or_else(|| source.missing("`base_optimizer_state`"))?;
        if dict_get(base, "state").is_none() {
            return Err(Error::usage(
                "not yet: an elastic ZeRO checkpoint (moments saved per group without padding)",
            )
            .file(&source.path)
            .hint("save with `zero_optimization.elastic_checkpoint` off, or reshard to DCP"));
        }
    }
    Ok(())
}

/// Rank `r` of `world`'s optimizer states, from rank 0's as the template.
fn optim_file(
    optim: &[SavedFile],
    groups: &Groups,
    path: &Path,
    r: usize,
    world: usize,
) -> Result<OutFile> {
    let first = &optim[0];
    let base = first
        .at(&[OPTIMIZER, "base_optimizer_state"])
        .ok_or_else(|| first.missing("`base_optimizer_state`"))?;
    let mut root = first.root.clone();
    let mut fresh = HashMap::new();
    let mut fp32 = Vec::new();
    let mut paddings = Vec::new();
    let mut mappings = Vec::new();
    let fragment = fragment_template(first)?;
    let ordered = first
        .at(&[OPTIMIZER, "param_slice_mappings"])
        .and_then(Value::as_seq)
        .and_then(|m| m.first())
        .cloned()
        .ok_or_else(|| first.missing("`param_slice_mappings`"))?;
    let mut state = dict_get(base, "state").cloned().unwrap_or(Value::None);
    for g in 0..groups.groups.len() {
        let numel = groups.numel(g);
        let (src_size, src_pads) = partitions(numel, optim.len() as u64);
        let (size, pads) = partitions(numel, world as u64);
        let pad = pads[r];
        let lean = size - pad;
        // The master partition: saved without the padding, over a storage holding it.
        let key = |what: &str| format!("new/{g}/{what}");
        let masters = |s: &SavedFile| {
            s.at(&[OPTIMIZER, "single_partition_of_fp32_groups"])
                .and_then(Value::as_seq)
                .and_then(|l| l.get(g))
                .cloned()
        };
        let template = masters(first)
            .ok_or_else(|| first.missing(&format!("`single_partition_of_fp32_groups[{g}]`")))?;
        let sources = optim
            .iter()
            .zip(&src_pads)
            .map(|(s, &p)| {
                let t = masters(s)
                    .ok_or_else(|| s.missing(&format!("`single_partition_of_fp32_groups[{g}]`")))?;
                let (offset, len) = s.flat(&t, "an fp32 partition")?;
                check_len(s, len, src_size - p, &format!("group {g}'s fp32 partition"))?;
                Ok((s.input, offset))
            })
            .collect::<Result<Vec<_>>>()?;
        let runs = runs_of(&sources, src_size, &src_pads, r as u64 * size, lean, size);
        fresh.insert(key("fp32"), (size * 4, runs));
        fp32.push(flat_tensor(&template, &key("fp32"), lean, size));
        paddings.push(Value::Int(pad as i64));
        // Adam's moments (and any other flat state): saved with the padding.
        let group_state = state_of_group(&mut state, g)
            .ok_or_else(|| first.missing(&format!("`base_optimizer_state.state[{g}]`")))?;
        for (name, value) in group_state.iter_mut() {
            let Some(t) = TensorRef::of(value) else {
                continue;
            };
            if t.sizes.is_empty() {
                continue; // `step`: the same on every rank, carried as saved.
            }
            let name = name.as_str().unwrap_or_default().to_string();
            let sources = optim
                .iter()
                .map(|s| {
                    let t = s
                        .at(&[OPTIMIZER, "base_optimizer_state", "state"])
                        .and_then(|st| int_key(st, g))
                        .and_then(|gs| dict_get(gs, &name))
                        .ok_or_else(|| s.missing(&format!("`{name}` of group {g}")))?;
                    let (offset, len) = s.flat(t, &format!("`{name}` of group {g}"))?;
                    check_len(s, len, src_size, &format!("group {g}'s `{name}`"))?;
                    Ok((s.input, offset))
                })
                .collect::<Result<Vec<_>>>()?;
            let runs = runs_of(&sources, src_size, &src_pads, r as u64 * size, lean, size);
            fresh.insert(key(&name), (size * 4, runs));
            *value = flat_tensor(value, &key(&name), size, size);
        }
        mappings.push(slice_mapping(
            &ordered,
            &fragment,
            &groups.groups[g],
            r as u64 * size,
            size,
        ));
    }
    let osd = |k: &'static str| [OPTIMIZER, k];
    set(
        &mut root,
        &osd("single_partition_of_fp32_groups"),
        Value::List(fp32),
    )?;
    set(
        &mut root,
        &[OPTIMIZER, "base_optimizer_state", "state"],
        state,
    )?;
    set(&mut root, &osd("group_paddings"), Value::List(paddings))?;
    let counts = vec![Value::Int(world as i64); groups.groups.len()];
    set(&mut root, &osd("partition_count"), Value::List(counts))?;
    set(
        &mut root,
        &osd("param_slice_mappings"),
        Value::List(mappings),
    )?;
    archive(path, root, first, fresh)
}

/// A source tensor's length must be what the partitioning says.
fn check_len(s: &SavedFile, len: u64, expected: u64, what: &str) -> Result<()> {
    if len == expected {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "{what} holds {len} elements, but the group's partitioning gives {expected}"
    ))
    .file(&s.path)
    .hint("the partitions do not add up: the files are of different saves, or cut short"))
}

/// The entries of group `g`'s state in a `base_optimizer_state.state` dict keyed by int.
fn state_of_group(state: &mut Value, g: usize) -> Option<&mut Vec<(Value, Value)>> {
    let Value::Dict(items) = state else {
        return None;
    };
    match items
        .iter_mut()
        .find(|(k, _)| k.as_int() == Some(g as i64))
        .map(|(_, v)| v)?
    {
        Value::Dict(items) => Some(items),
        _ => None,
    }
}

fn int_key(dict: &Value, g: usize) -> Option<&Value> {
    entries(dict)?
        .iter()
        .find(|(k, _)| k.as_int() == Some(g as i64))
        .map(|(_, v)| v)
}

/// Runs filling a destination storage of `storage` elements whose first `len` elements are the
/// group's flat elements from `start` on, the rest zeros. SavedFile rank `s` holds the flat range
/// `[s * size, (s + 1) * size - pads[s])` from byte `sources[s].1` of input `sources[s].0`.
fn runs_of(
    sources: &[(usize, u64)],
    size: u64,
    pads: &[u64],
    start: u64,
    len: u64,
    storage: u64,
) -> Vec<Run> {
    let mut runs = Vec::new();
    let end = start + len;
    for (s, (&(input, offset), pad)) in sources.iter().zip(pads).enumerate() {
        let lo = (s as u64 * size).max(start);
        let hi = ((s as u64 + 1) * size - pad).min(end);
        if lo < hi {
            runs.push(Run::Copy {
                input,
                offset: offset + (lo - s as u64 * size) * 4,
                len: (hi - lo) * 4,
            });
        }
    }
    let copied: u64 = runs
        .iter()
        .map(|r| match r {
            Run::Copy { len, .. } | Run::Zeros(len) => len,
        })
        .sum();
    if storage * 4 > copied {
        runs.push(Run::Zeros(storage * 4 - copied));
    }
    runs
}

/// A `fragment_address` object of the source, to copy the class and layout of.
fn fragment_template(first: &SavedFile) -> Result<Value> {
    first
        .at(&[OPTIMIZER, "param_slice_mappings"])
        .and_then(Value::as_seq)
        .into_iter()
        .flatten()
        .filter_map(entries)
        .flat_map(|e| e.iter().map(|(_, v)| v))
        .next()
        .cloned()
        .ok_or_else(|| first.missing("a `fragment_address` in `param_slice_mappings`"))
}

/// A rank's `param_slice_mappings` for one group: name -> `fragment_address(numel, start)` of
/// each parameter that starts in, or reaches into, the partition `[left, left + size)`, as
/// `get_partition_info` picks them.
fn slice_mapping(
    ordered: &Value,
    fragment: &Value,
    group: &[(String, u64, u64)],
    left: u64,
    size: u64,
) -> Value {
    let right = left + size;
    let mut items = Vec::new();
    let mut at = 0;
    for (name, numel, pad) in group {
        let inside = (left <= at && at < right) || (at < left && left < at + numel);
        if inside {
            let lo = at.max(left);
            let hi = (at + numel).min(right);
            let mut address = fragment.clone();
            if let Value::Object(o) = &mut address {
                o.state = Some(Value::Dict(vec![
                    (Value::Str("numel".into()), Value::Int((hi - lo) as i64)),
                    (Value::Str("start".into()), Value::Int((lo - left) as i64)),
                ]));
            }
            items.push((Value::Str(name.clone()), address));
        }
        at += numel + pad;
    }
    let mut mapping = ordered.clone();
    match &mut mapping {
        Value::Object(o) => o.dict_items = items,
        other => *other = Value::Dict(items),
    }
    mapping
}
