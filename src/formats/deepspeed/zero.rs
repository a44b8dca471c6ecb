//! Where each parameter's elements are in a ZeRO checkpoint, stage by stage (as DeepSpeed's
//! `zero_to_fp32.py` reads them, and checked the way it checks them).
//!
//! - **Stages 1 and 2**: each parameter group is one flat fp32 buffer, its parameters one after
//!   another in `param_shapes` order (each followed by its `param_alignment_paddings`), padded at
//!   the end to a multiple of the world size and cut into equal partitions, rank `r` holding
//!   `[r * P, (r + 1) * P)`. The saved `single_partition_of_fp32_groups` leaves out a rank's
//!   `group_paddings`; Adam's moments (`base_optimizer_state`) keep it.
//! - **Stage 3**: each parameter is cut on its own into `ceil(numel / N)` elements per rank, the
//!   last rank's tail padded; a rank's `fp32_flat_groups` buffer is its part of each parameter of
//!   the group, one after another. Moments (`optimizer_state_dict.optimizer_state_dict`) alike.
//! - **Frozen parameters** are not in the optimizer: stage 2 saves each whole in its 16-bit dtype
//!   (`frozen_param_fragments`), stage 3 each rank's part of it, cut as above.
//! - **Buffers** come from `module` by `buffer_names`, **tied parameters** from `shared_params`
//!   (alias -> the parameter it is).

use std::collections::HashSet;

use super::files::{Set, Tag};
use super::{dict_items, key, shapes_of, Flat, StateFile};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::formats::torch_save::Leaf;
use crate::model::{Checkpoint, Format, KeyPart, NonTensor, Pieces, Tensor};
use crate::pickle::Value;

const OPTIMIZER: &str = "optimizer_state_dict";

/// One parameter group's parameters, each a name and a shape, in layout order.
type Group = Vec<(String, Vec<u64>)>;

/// Read one tag's files.
pub(super) fn read(tag: &Tag, set: &Set) -> Result<Checkpoint> {
    let model = set
        .model
        .iter()
        .map(|p| StateFile::open(p))
        .collect::<Result<Vec<_>>>()?;
    let optim = set
        .optim
        .iter()
        .map(|p| StateFile::open(p))
        .collect::<Result<Vec<_>>>()?;
    let Some(first) = optim.first() else {
        return unpartitioned(tag, &model);
    };
    // DeepSpeed's BF16_Optimizer (bf16 with stage 1 and fp32 gradient accumulation) records no
    // stage; its partitions are stage 1's.
    let bf16_optimizer = first.value(&key(&[OPTIMIZER, "zero_stage"])).is_none()
        && first
            .leaf(&with(
                &key(&[OPTIMIZER, "single_partition_of_fp32_groups"]),
                KeyPart::Index(0),
            ))
            .is_some();
    let stage = match first.value(&key(&[OPTIMIZER, "zero_stage"])) {
        _ if bf16_optimizer => 1,
        Some(v) => v
            .as_int()
            .ok_or_else(|| first.missing(&key(&[OPTIMIZER, "zero_stage"]), "ZeRO stage"))?,
        None => return Err(first.missing(&key(&[OPTIMIZER, "zero_stage"]), "ZeRO stage")),
    };
    let world = partition_count(first)?;
    if world != optim.len() {
        return Err(Error::invalid(format!(
            "`partition_count` says {world} ranks, but the tag holds {} optimizer files",
            optim.len()
        ))
        .file(&first.path)
        .hint(
            "a save over another world size was written into the same tag, or files are missing",
        ));
    }
    let expected_models = if stage == 3 { world } else { 1 };
    if model.len() != expected_models {
        return Err(Error::invalid(format!(
            "ZeRO stage {stage} over {world} ranks saves {expected_models} model state file(s), the tag holds {}",
            model.len()
        ))
        .file(&tag.dir));
    }
    let shapes = param_groups(&model[0])?;
    let mut out = Out::default();
    buffers(&model[0], &mut out)?;
    frozen(&model, stage, &shapes, &mut out)?;
    match stage {
        1 | 2 => partitioned_groups(&optim, &shapes, &mut out)?,
        3 => per_parameter(&optim, &shapes, &mut out)?,
        other => {
            return Err(Error::invalid(format!("unknown ZeRO stage {other}"))
                .file(&first.path)
                .hint("ckpt reads ZeRO stages 1, 2 and 3"))
        }
    }
    aliases(&model[0], &mut out)?;
    let (tensors, values) = out.finish();
    let mut details: Vec<(String, String)> = vec![
        (
            "zero stage".into(),
            if bf16_optimizer {
                "1 (BF16_Optimizer)".into()
            } else {
                stage.to_string()
            },
        ),
        ("tag".into(), tag.name.clone()),
        (
            "training dtype".into(),
            training_dtype(&model[0], &optim[0]),
        ),
    ];
    if !tag.beside.is_empty() {
        details.push((
            "also here".into(),
            format!(
                "{}: weights exported beside the DeepSpeed state, which is what is read here; point ckpt at that file to read it instead",
                tag.beside.join(", ")
            ),
        ));
    }
    Ok(Checkpoint {
        root: tag.dir.clone(),
        format: Format::DeepSpeedZero { partitioned: true },
        world_size: Some(world),
        tensors,
        values,
        unsupported: Vec::new(),
        details,
    })
}

/// ZeRO stage 0 (no partitioning): the model states hold the whole `module` and the client
/// optimizer's own `state_dict` (`optimizer`), keyed by parameter index as torch keys it (the
/// file does not say which parameter an index is).
fn unpartitioned(tag: &Tag, model: &[StateFile]) -> Result<Checkpoint> {
    let [file] = model else {
        return Err(Error::invalid(format!(
            "{} model state files and no optimizer states: not a save ckpt knows",
            model.len()
        ))
        .file(&tag.dir));
    };
    let mut tensors = Vec::new();
    let mut values = Vec::new();
    for (k, leaf) in &file.archive.leaves {
        let (section, rest) = match k.split_first() {
            Some((KeyPart::Key(s), rest)) if s == "module" => ("model", rest),
            Some((KeyPart::Key(s), rest)) if s == "optimizer" => ("optim", rest),
            _ => continue,
        };
        let mut key_path = vec![KeyPart::Key(section.into())];
        key_path.extend(rest.iter().cloned());
        let name = KeyPart::flat_name(&key_path);
        match leaf {
            Leaf::Tensor(_) => {
                let (dtype, shape, pieces) = file.whole(k)?;
                tensors.push(Tensor {
                    name,
                    key_path,
                    dtype,
                    shape,
                    pieces,
                });
            }
            Leaf::Value(v) if *v != Value::None => values.push(NonTensor {
                name,
                key_path,
                value: Some(v.clone()),
                raw: None,
            }),
            _ => {}
        }
    }
    Ok(Checkpoint {
        root: tag.dir.clone(),
        // Stage 0 partitions nothing: the file holds the whole model and optimizer.
        format: Format::DeepSpeedZero { partitioned: false },
        // Every rank saved the same; `dp_world_size` says how many there were.
        world_size: file
            .value(&key(&["dp_world_size"]))
            .and_then(Value::as_int)
            .and_then(|n| usize::try_from(n).ok()),
        tensors,
        values,
        unsupported: Vec::new(),
        details: vec![
            ("zero stage".into(), "0".into()),
            ("tag".into(), tag.name.clone()),
        ],
    })
}

/// The tensors and values read so far, in the order `zero_to_fp32` gives the model's (buffers,
/// frozen, trainable, aliases), then the optimizer's.
#[derive(Default)]
struct Out {
    model: Vec<Tensor>,
    optim: Vec<Tensor>,
    values: Vec<NonTensor>,
}

impl Out {
    fn model(&mut self, fqn: &str, dtype: DType, shape: Vec<u64>, pieces: Pieces) {
        self.model.push(Tensor {
            name: format!("model.{fqn}"),
            key_path: vec![KeyPart::Key("model".into()), KeyPart::Key(fqn.into())],
            dtype,
            shape,
            pieces,
        });
    }

    fn optim(&mut self, fqn: &str, state: &str, dtype: DType, shape: Vec<u64>, pieces: Pieces) {
        let flat = format!("state.{fqn}.{state}");
        self.optim.push(Tensor {
            name: format!("optim.{flat}"),
            key_path: vec![KeyPart::Key("optim".into()), KeyPart::Key(flat)],
            dtype,
            shape,
            pieces,
        });
    }

    fn param_group(&mut self, fqn: &str, group: &[(Value, Value)]) {
        for (k, v) in group {
            let Some(k) = k.as_str().filter(|k| *k != "params") else {
                continue;
            };
            let flat = format!("param_groups.{fqn}.{k}");
            self.values.push(NonTensor {
                name: format!("optim.{flat}"),
                key_path: vec![KeyPart::Key("optim".into()), KeyPart::Key(flat)],
                value: Some(v.clone()),
                raw: None,
            });
        }
    }

    fn finish(self) -> (Vec<Tensor>, Vec<NonTensor>) {
        let mut tensors = self.model;
        tensors.extend(self.optim);
        (tensors, self.values)
    }
}

/// `partition_count`: the data-parallel world size (a list per group in stages 1-2, whose
/// largest `zero_to_fp32` takes).
fn partition_count(file: &StateFile) -> Result<usize> {
    let k = key(&[OPTIMIZER, "partition_count"]);
    let count = match file.value(&k) {
        Some(Value::Int(n)) => Some(*n),
        Some(Value::List(items)) => items.iter().filter_map(Value::as_int).max(),
        _ => None,
    };
    count
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| file.missing(&k, "world size"))
}

/// `param_shapes`: per parameter group, each trainable parameter's name and shape in layout
/// order.
fn param_groups(model: &StateFile) -> Result<Vec<Group>> {
    let k = key(&["param_shapes"]);
    let groups = match model.value(&k) {
        Some(Value::List(groups)) => groups,
        _ => return Err(model.missing(&k, "list of parameter shapes")),
    };
    groups
        .iter()
        .map(|g| shapes_of(g).ok_or_else(|| model.missing(&k, "ordered dict of sizes per group")))
        .collect()
}

/// The entries directly under `prefix`, as (name, leaf key) in pickle order.
fn children<'f>(file: &'f StateFile, prefix: &[KeyPart]) -> Vec<(&'f str, &'f [KeyPart])> {
    file.archive
        .leaves
        .iter()
        .filter_map(|(k, _)| {
            let (last, head) = k.split_last()?;
            match last {
                KeyPart::Key(name) if head == prefix => Some((name.as_str(), k.as_slice())),
                _ => None,
            }
        })
        .collect()
}

/// Buffers: `module`'s entries named in `buffer_names`, whole.
fn buffers(model: &StateFile, out: &mut Out) -> Result<()> {
    let names: Vec<&str> = match model.value(&key(&["buffer_names"])) {
        Some(Value::List(names)) => names.iter().filter_map(Value::as_str).collect(),
        _ => return Err(model.missing(&key(&["buffer_names"]), "list of buffer names")),
    };
    for name in names {
        let (dtype, shape, pieces) = model.whole(&key(&["module", name]))?;
        out.model(name, dtype, shape, pieces);
    }
    Ok(())
}

/// Frozen parameters, in their stored dtype: whole (stages 1-2), or each rank's part (stage 3).
/// Stage 1 saves no `frozen_param_shapes` (so `zero_to_fp32` loses them, DeepSpeed #3090), but
/// its `module` holds every parameter whole: those neither trained, nor buffers, nor aliases are
/// the frozen ones.
fn frozen(model: &[StateFile], stage: i64, trained: &[Group], out: &mut Out) -> Result<()> {
    let first = &model[0];
    let declared = first.value(&key(&["frozen_param_shapes"]));
    if stage < 3 && declared.is_none_or(|v| matches!(v, Value::None)) {
        let mut known: std::collections::HashSet<&str> = trained
            .iter()
            .flatten()
            .map(|(name, _)| name.as_str())
            .collect();
        if let Some(Value::List(names)) = first.value(&key(&["buffer_names"])) {
            known.extend(names.iter().filter_map(Value::as_str));
        }
        known.extend(
            children(first, &key(&["shared_params"]))
                .into_iter()
                .map(|(alias, _)| alias),
        );
        for (name, k) in children(first, &key(&["module"])) {
            if !known.contains(name) {
                let (dtype, shape, pieces) = first.whole(k)?;
                out.model(name, dtype, shape, pieces);
            }
        }
        return Ok(());
    }
    let shapes: Vec<(String, Vec<u64>)> = children(first, &key(&["frozen_param_shapes"]))
        .into_iter()
        .filter_map(|(name, k)| {
            let shape = Value::as_sizes(model[0].value(k)?)?;
            Some((name.to_string(), shape))
        })
        .collect();
    for (name, shape) in shapes {
        let k = key(&["frozen_param_fragments", &name]);
        if stage < 3 {
            let (dtype, stored, pieces) = model[0].whole(&k)?;
            if stored != shape {
                return Err(Error::invalid(format!(
                    "frozen parameter saved as {stored:?}, but `frozen_param_shapes` says {shape:?}"
                ))
                .file(&model[0].path)
                .tensor(&name));
            }
            out.model(&name, dtype, shape, pieces);
            continue;
        }
        // Stage 3: the ranks' fragments one after another, the padding after the last element.
        let numel = crate::geometry::numel(&shape).unwrap_or(0);
        let mut pieces = Pieces::new(shape.len());
        let mut start = 0u64;
        let mut dtype = None;
        for file in model {
            let flat = file.flat(&k)?;
            dtype.get_or_insert(flat.dtype);
            let hi = (start + flat.len).min(numel);
            if start < hi {
                flat.add(&mut pieces, &shape, start, hi, 0)?;
            }
            start += flat.len;
        }
        if start < numel {
            return Err(Error::invalid(format!(
                "the ranks' fragments hold {start} of the frozen parameter's {numel} elements"
            ))
            .file(&model[0].path)
            .tensor(&name));
        }
        out.model(&name, dtype.unwrap_or(DType::F32), shape, pieces);
    }
    Ok(())
}

/// Tied parameters: each alias of `shared_params` is the parameter it names, when that one was
/// read (as `zero_to_fp32` does).
fn aliases(model: &StateFile, out: &mut Out) -> Result<()> {
    let pairs: Vec<(String, String)> = children(model, &key(&["shared_params"]))
        .into_iter()
        .filter_map(|(alias, k)| Some((alias.to_string(), model.value(k)?.as_str()?.to_string())))
        .collect();
    for (alias, owner) in pairs {
        let name = format!("model.{owner}");
        if let Some(t) = out.model.iter().find(|t| t.name == name).cloned() {
            out.model(&alias, t.dtype, t.shape, t.pieces);
        }
    }
    Ok(())
}

/// Stages 1 and 2: each group's flat buffer in equal partitions over the ranks.
fn partitioned_groups(optim: &[StateFile], groups: &[Group], out: &mut Out) -> Result<()> {
    let first = &optim[0];
    let alignment = first.value(&key(&[OPTIMIZER, "param_alignment_paddings"]));
    let state = key(&[OPTIMIZER, "base_optimizer_state", "state"]);
    let param_groups = first.value(&key(&[OPTIMIZER, "base_optimizer_state", "param_groups"]));
    for (g, shapes) in groups.iter().enumerate() {
        let flat_key = with(
            &key(&[OPTIMIZER, "single_partition_of_fp32_groups"]),
            KeyPart::Index(g as i64),
        );
        let flats = optim
            .iter()
            .map(|f| f.flat(&flat_key))
            .collect::<Result<Vec<_>>>()?;
        let paddings = optim
            .iter()
            .map(|f| group_padding(f, g))
            .collect::<Result<Vec<_>>>()?;
        let partition = flats[0].len + paddings[0];
        for (r, (flat, pad)) in flats.iter().zip(&paddings).enumerate() {
            // ZeRO's optimizer saves a partition without its padding, BF16_Optimizer with it.
            if flat.len + pad != partition && flat.len != partition {
                return Err(Error::invalid(format!(
                    "group {g}'s partition on rank {r} is {} elements and {pad} of padding; rank 0's is {partition} in all",
                    flat.len
                ))
                .file(&optim[r].path)
                .hint("the ranks' files come from different saves"));
            }
        }
        // Each parameter's start in the group's buffer.
        let aligned: Vec<u64> = alignment
            .and_then(|a| a.as_seq()?.get(g)?.as_seq().map(|p| p.to_vec()))
            .map(|p| {
                p.iter()
                    .map(|v| v.as_int().unwrap_or(0).max(0) as u64)
                    .collect()
            })
            .unwrap_or_default();
        let mut starts = Vec::with_capacity(shapes.len());
        let mut at = 0u64;
        for (i, (_, shape)) in shapes.iter().enumerate() {
            starts.push(at);
            at += crate::geometry::numel(shape).unwrap_or(0) + aligned.get(i).copied().unwrap_or(0);
        }
        // As `zero_to_fp32` checks: both rounded up to twice the world size (the partitions'
        // padding is at most that).
        let saved: u64 = flats.iter().map(|f| f.len).sum();
        let align = 2 * optim.len() as u64;
        if at.div_ceil(align) != saved.div_ceil(align) {
            return Err(Error::invalid(format!(
                "group {g}'s parameters take {at} elements, but its partitions hold {saved}"
            ))
            .file(&first.path)
            .hint("the shapes in the model states and the optimizer's partitions come from different saves"));
        }
        let place =
            |pieces: &mut Pieces, shape: &[u64], start: u64, runs: &[Flat]| -> Result<u64> {
                let numel = crate::geometry::numel(shape).unwrap_or(0);
                let mut covered = 0;
                for (r, flat) in runs.iter().enumerate() {
                    let base = r as u64 * partition;
                    let lo = start.max(base);
                    let hi = (start + numel).min(base + flat.len);
                    if lo < hi {
                        flat.add(pieces, shape, lo - start, hi - start, lo - base)?;
                        covered += hi - lo;
                    }
                }
                Ok(covered)
            };
        for ((name, shape), &start) in shapes.iter().zip(&starts) {
            let mut pieces = Pieces::new(shape.len());
            let covered = place(&mut pieces, shape, start, &flats)?;
            let numel = crate::geometry::numel(shape).unwrap_or(0);
            if covered != numel {
                return Err(Error::invalid(format!(
                    "the partitions hold {covered} of this parameter's {numel} elements"
                ))
                .file(&first.path)
                .tensor(name));
            }
            out.model(name, flats[0].dtype, shape.clone(), pieces);
        }
        // Adam's moments: flat like the weights, padding kept.
        let group_state = with(&state, KeyPart::IntKey(g as i64));
        let cut = |p: &mut Pieces, shape: &[u64], start: u64, runs: &[Flat]| {
            place(p, shape, start, runs).map(|_| ())
        };
        group_moments(optim, g, &group_state, shapes, &starts, None, &cut, out)?;
        add_param_groups(param_groups, g, shapes, out);
    }
    Ok(())
}

/// Stage 3: each parameter cut on its own.
fn per_parameter(optim: &[StateFile], groups: &[Group], out: &mut Out) -> Result<()> {
    let first = &optim[0];
    let world = optim.len() as u64;
    let inner = key(&[OPTIMIZER, OPTIMIZER]);
    let state = with(&inner, KeyPart::Key("state".into()));
    let param_groups = first.value(&with(&inner, KeyPart::Key("param_groups".into())));
    for (g, shapes) in groups.iter().enumerate() {
        let flat_key = with(
            &key(&[OPTIMIZER, "fp32_flat_groups"]),
            KeyPart::Index(g as i64),
        );
        let flats = optim
            .iter()
            .map(|f| f.flat(&flat_key))
            .collect::<Result<Vec<_>>>()?;
        let place = |pieces: &mut Pieces, shape: &[u64], at: u64, runs: &[Flat]| -> Result<()> {
            let numel = crate::geometry::numel(shape).unwrap_or(0);
            let share = numel.div_ceil(world);
            for (r, flat) in runs.iter().enumerate() {
                let lo = r as u64 * share;
                let hi = (lo + share).min(numel);
                if lo < hi {
                    flat.add(pieces, shape, lo, hi, at)?;
                }
            }
            Ok(())
        };
        let mut starts = Vec::with_capacity(shapes.len());
        let mut at = 0u64;
        for (_, shape) in shapes {
            starts.push(at);
            at += crate::geometry::numel(shape).unwrap_or(0).div_ceil(world);
        }
        for (r, flat) in flats.iter().enumerate() {
            if flat.len != at {
                return Err(Error::invalid(format!(
                    "group {g}'s parameters take {at} elements per rank, but rank {r}'s buffer holds {}",
                    flat.len
                ))
                .file(&optim[r].path)
                .hint("the shapes in the model states and the optimizer's buffers come from different saves"));
            }
        }
        for ((name, shape), &start) in shapes.iter().zip(&starts) {
            let mut pieces = Pieces::new(shape.len());
            place(&mut pieces, shape, start, &flats)?;
            out.model(name, flats[0].dtype, shape.clone(), pieces);
        }
        let group_state = with(&state, KeyPart::IntKey(g as i64));
        group_moments(
            optim,
            g,
            &group_state,
            shapes,
            &starts,
            Some(at),
            &place,
            out,
        )?;
        add_param_groups(param_groups, g, shapes, out);
    }
    Ok(())
}

/// A piece cutter: adds to the pieces of a parameter of `shape` whose elements start at `start`
/// of its group's flat buffer, its share of each rank's run.
type Place<'a> = dyn Fn(&mut Pieces, &[u64], u64, &[Flat]) -> Result<()> + 'a;

/// Adam's state of one group for each of its parameters: a 0-dim entry (`step`) is the group's
/// and goes to each parameter whole; a flat one is laid out as the group's weights and cut by
/// `place`. With `per_rank`, each rank's run must hold that many elements (stage 3).
#[allow(clippy::too_many_arguments)]
fn group_moments(
    optim: &[StateFile],
    g: usize,
    group_state: &[KeyPart],
    shapes: &Group,
    starts: &[u64],
    per_rank: Option<u64>,
    place: &Place<'_>,
    out: &mut Out,
) -> Result<()> {
    let first = &optim[0];
    for (state_name, k) in children(first, group_state) {
        match first.leaf(k) {
            Some(Leaf::Tensor(t)) if t.shape.is_empty() => {
                for (name, _) in shapes {
                    let (dtype, shape, pieces) = first.whole(k)?;
                    out.optim(name, state_name, dtype, shape, pieces);
                }
            }
            Some(Leaf::Tensor(_)) => {
                let runs = optim
                    .iter()
                    .map(|f| f.flat(k))
                    .collect::<Result<Vec<_>>>()?;
                if let Some(want) = per_rank {
                    if let Some((r, run)) = runs.iter().enumerate().find(|(_, f)| f.len != want) {
                        return Err(Error::invalid(format!(
                            "`{state_name}` of group {g} holds {} elements on rank {r}, the weights {want}",
                            run.len
                        ))
                        .file(&optim[r].path));
                    }
                }
                for ((name, shape), &start) in shapes.iter().zip(starts) {
                    let mut pieces = Pieces::new(shape.len());
                    place(&mut pieces, shape, start, &runs)?;
                    out.optim(name, state_name, runs[0].dtype, shape.clone(), pieces);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The optimizer's settings of group `g` (`lr`, `betas`, ...) for each of its parameters.
fn add_param_groups(
    param_groups: Option<&Value>,
    g: usize,
    shapes: &[(String, Vec<u64>)],
    out: &mut Out,
) {
    let Some(group) = param_groups
        .and_then(Value::as_seq)
        .and_then(|groups| groups.get(g))
        .and_then(dict_items)
    else {
        return;
    };
    let mut seen = HashSet::new();
    for (name, _) in shapes {
        if seen.insert(name) {
            out.param_group(name, group);
        }
    }
}

/// A rank's padding at the end of group `g` (stages 1-2; none when not recorded).
fn group_padding(file: &StateFile, g: usize) -> Result<u64> {
    let k = key(&[OPTIMIZER, "group_paddings"]);
    match file.value(&k) {
        None => Ok(0),
        Some(v) => v
            .as_seq()
            .and_then(|p| p.get(g))
            .and_then(Value::as_int)
            .and_then(|p| u64::try_from(p).ok())
            .ok_or_else(|| file.missing(&k, "padding per group")),
    }
}

/// `prefix` with one more step.
fn with(prefix: &[KeyPart], part: KeyPart) -> Vec<KeyPart> {
    let mut k = prefix.to_vec();
    k.push(part);
    k
}

/// The dtype training ran in, as `ds_config` says (`bf16`, `fp16`, else `fp32`).
fn training_dtype(model: &StateFile, optim: &StateFile) -> String {
    let enabled = |section: &str| {
        matches!(
            model.value(&key(&["ds_config", section, "enabled"])),
            Some(Value::Bool(true))
        )
    };
    if enabled("bf16") || optim.name.to_string_lossy().starts_with("bf16_") {
        "bf16".into()
    } else if enabled("fp16") {
        "fp16".into()
    } else {
        "fp32".into()
    }
}
