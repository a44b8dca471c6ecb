//! ZeRO-3 written again at another data-parallel size.
//!
//! Stage 3 cuts every parameter on its own: `ceil(numel / world)` elements per rank, the last
//! rank's tail padded (DeepSpeed's `_aligned_size` in partition_parameters.py). A rank's flat fp32
//! sub-group is its pieces of the sub-group's parameters in `param_shapes` order, nothing between
//! them nor after them (stage3.py sums `partition_numel()`); Adam's moments are laid out the same.
//! So each piece at the new size is a run or two of the old pieces plus zeros, whatever the world
//! sizes, and the pieces of the frozen parameters (`frozen_param_fragments`, in the training
//! dtype, one per rank in each rank's model states) are cut the same way.
//!
//! Each rank saves its own model states (placeholders for the parameters, buffers whole,
//! `shared_params` on rank 0 only) and optimizer states; both are written from rank 0's as the
//! template, changed where the world size shows: `dp_world_size`, `partition_count`, the flat
//! groups, the moments, the frozen fragments.

use std::collections::HashMap;
use std::path::Path;

use super::source::{dict_get, dict_get_mut, entries, flat_tensor, set, SavedFile, TensorRef};
use super::{archive, OutFile, Run, OPTIMIZER};
use crate::error::{Error, Result};
use crate::pickle::Value;

/// DeepSpeed's default `zero_optimization.sub_group_size` (zero/config.py).
const SUB_GROUP_SIZE: u64 = 1_000_000_000;

/// Elements of a `numel`-element parameter each of `world` ranks holds.
pub(crate) fn piece(numel: u64, world: u64) -> u64 {
    numel.div_ceil(world)
}

/// The sub-groups DeepSpeed's `_create_fp16_sub_groups` cuts a parameter group of these
/// parameters into at `world` ranks: their lengths, in parameters. The cut depends on the world
/// size, since it counts each rank's pieces against `limit`.
pub(crate) fn cut_sub_groups(numels: &[u64], world: u64, limit: u64) -> Vec<usize> {
    let total: u64 = numels.iter().map(|&n| piece(n, world)).sum();
    if limit >= total {
        return vec![numels.len()];
    }
    let mut cut = Vec::new();
    let (mut count, mut size) = (0, 0);
    for (i, &n) in numels.iter().enumerate() {
        count += 1;
        size += piece(n, world);
        if size >= limit || i + 1 == numels.len() {
            cut.push(count);
            (count, size) = (0, 0);
        }
    }
    cut
}

/// Runs filling rank `rank` of `to`'s piece of a `numel`-element parameter from its pieces at
/// `from` ranks, rank `s`'s starting at `sources[s]` (input, byte offset); `elem` bytes an
/// element. The piece's tail past the parameter is zeros.
pub(crate) fn piece_runs(
    numel: u64,
    from: u64,
    to: u64,
    rank: u64,
    sources: &[(usize, u64)],
    elem: u64,
    runs: &mut Vec<Run>,
) {
    let (old, new) = (piece(numel, from), piece(numel, to));
    let lo = (rank * new).min(numel);
    let hi = (rank * new + new).min(numel);
    let mut at = lo;
    while at < hi {
        let s = at / old;
        let end = hi.min(s * old + old);
        let (input, offset) = sources[s as usize];
        push(
            runs,
            Run::Copy {
                input,
                offset: offset + (at - s * old) * elem,
                len: (end - at) * elem,
            },
        );
        at = end;
    }
    if new > hi - lo {
        push(runs, Run::Zeros((new - (hi - lo)) * elem));
    }
}

/// Append `run`, joined to the last one when it continues it (a piece usually lies in one old
/// piece, and consecutive parameters' pieces lie end to end in their old rank file).
fn push(runs: &mut Vec<Run>, run: Run) {
    match (runs.last_mut(), run) {
        (Some(Run::Zeros(a)), Run::Zeros(b)) => *a += b,
        (
            Some(Run::Copy {
                input: i,
                offset: o,
                len: l,
            }),
            Run::Copy { input, offset, len },
        ) if *i == input && *o + *l == offset => *l += len,
        (_, run) if run != Run::Zeros(0) => runs.push(run),
        _ => {}
    }
}

/// The trainable parameters of a save as stage 3 partitions them.
struct Layout {
    /// Per saved sub-group: its parameters (name, numel), in `param_shapes` order.
    sub_groups: Vec<Vec<(String, u64)>>,
    /// Per parameter group: the sub-groups it holds, as `param_groups[g].params` lists them.
    groups: Vec<Vec<usize>>,
}

impl Layout {
    fn of(model: &SavedFile, optim: &SavedFile, from: u64, to: u64) -> Result<Layout> {
        let shapes = model
            .at(&["param_shapes"])
            .and_then(Value::as_seq)
            .ok_or_else(|| model.missing("`param_shapes`"))?;
        let sub_groups = shapes
            .iter()
            .enumerate()
            .map(|(j, s)| {
                let params = super::super::shapes_of(s)
                    .ok_or_else(|| model.missing(&format!("shapes at `param_shapes[{j}]`")))?;
                Ok(params
                    .into_iter()
                    .map(|(n, shape)| (n, shape.iter().product()))
                    .collect())
            })
            .collect::<Result<Vec<Vec<(String, u64)>>>>()?;
        let param_groups = optim
            .at(&[OPTIMIZER, OPTIMIZER, "param_groups"])
            .and_then(Value::as_seq)
            .ok_or_else(|| optim.missing("`param_groups`"))?;
        let groups = param_groups
            .iter()
            .enumerate()
            .map(|(g, group)| {
                dict_get(group, "params")
                    .and_then(Value::as_sizes)
                    .map(|ids| ids.into_iter().map(|i| i as usize).collect::<Vec<_>>())
                    .ok_or_else(|| optim.missing(&format!("`param_groups[{g}].params`")))
            })
            .collect::<Result<Vec<_>>>()?;
        // Sub-groups are numbered group by group, as `_create_fp16_partitions_with_defragmentation`
        // makes them.
        let listed: Vec<usize> = groups.iter().flatten().copied().collect();
        if listed != (0..sub_groups.len()).collect::<Vec<_>>() {
            return Err(Error::invalid(format!(
                "`param_groups` list the flat sub-groups {listed:?}, but `param_shapes` holds {}",
                sub_groups.len()
            ))
            .file(&optim.path)
            .hint("the model and optimizer states are of different saves"));
        }
        let limit = match model.at(&["ds_config", "zero_optimization", "sub_group_size"]) {
            None => SUB_GROUP_SIZE,
            Some(Value::Int(i)) => u64::try_from(*i).unwrap_or(0),
            Some(Value::Float(f)) if *f >= 0.0 => *f as u64,
            Some(_) => return Err(model.missing("a number at `zero_optimization.sub_group_size`")),
        };
        let layout = Layout { sub_groups, groups };
        for (g, subs) in layout.groups.iter().enumerate() {
            let numels: Vec<u64> = subs
                .iter()
                .flat_map(|&j| layout.sub_groups[j].iter().map(|(_, n)| *n))
                .collect();
            let saved: Vec<usize> = subs.iter().map(|&j| layout.sub_groups[j].len()).collect();
            if cut_sub_groups(&numels, from, limit) != saved {
                return Err(Error::invalid(format!(
                    "group {g}'s sub-groups hold {saved:?} parameters, but `sub_group_size` {limit} at {from} ranks cuts them otherwise"
                ))
                .file(&model.path)
                .hint("the save's `ds_config` is not the one it was trained with"));
            }
            // Each sub-group's flat buffer is an fp32 tensor with a `ds_id` naming its first and
            // last parameter, which the save does not record for the others.
            if cut_sub_groups(&numels, to, limit) != saved {
                return Err(Error::usage(format!(
                    "not yet: at the new world size DeepSpeed cuts group {g} into other sub-groups (`sub_group_size` {limit})"
                ))
                .file(&model.path)
                .hint("reshard it to DCP (`--format dcp`) instead"));
            }
        }
        Ok(layout)
    }

    fn sub_group_piece(&self, j: usize, world: u64) -> u64 {
        self.sub_groups[j]
            .iter()
            .map(|(_, n)| piece(*n, world))
            .sum()
    }
}

/// Plan the files of a ZeRO-3 save at `to` ranks: per rank its model states and optimizer
/// states (`optim_name(r)` in `tag_dir`).
pub(super) fn files(
    model: &[SavedFile],
    optim: &[SavedFile],
    tag_dir: &Path,
    optim_name: &dyn Fn(usize) -> String,
    to: usize,
) -> Result<Vec<OutFile>> {
    let from = optim.len();
    if model.len() != from {
        return Err(Error::invalid(format!(
            "ZeRO-3 saves model states and optimizer states per rank; the tag holds {} and {from}",
            model.len()
        ))
        .file(optim[0].path.parent().unwrap_or(tag_dir))
        .hint("every rank's files of one save are needed; copy the missing ones or save again"));
    }
    for source in optim {
        let count = source
            .at(&[OPTIMIZER, "partition_count"])
            .and_then(Value::as_int)
            .ok_or_else(|| source.missing("`partition_count`"))?;
        if count != from as i64 {
            return Err(Error::invalid(format!(
                "`partition_count` is {count}, but the tag holds {from} rank files"
            ))
            .file(&source.path)
            .hint("a save over another world size was written into the same tag, or rank files are missing"));
        }
        if source
            .at(&[OPTIMIZER, "ds_zero_partition_groups"])
            .is_some()
        {
            return Err(Error::usage(
                "not yet: a ZeRO-3 save with its own partition groups per parameter (AutoEP)",
            )
            .file(&source.path));
        }
    }
    let layout = Layout::of(&model[0], &optim[0], from as u64, to as u64)?;
    let fp32 = Pieces::fp32(optim, &layout)?;
    let moments = Pieces::moments(optim, &layout)?;
    let frozen = Frozen::of(model)?;
    let mut files = Vec::new();
    for r in 0..to {
        files.push(model_file(model, &frozen, tag_dir, r, to)?);
        let path = tag_dir.join(optim_name(r));
        files.push(optim_file(optim, &layout, &fp32, &moments, &path, r, to)?);
    }
    Ok(files)
}

/// Where each rank's piece of each parameter of one flat buffer kind lies.
struct Pieces {
    /// Per sub-group: the template tensor (rank 0's).
    templates: Vec<Value>,
    /// Per sub-group, per parameter in it, per source rank: (input, byte offset).
    at: Vec<Vec<Vec<(usize, u64)>>>,
}

impl Pieces {
    /// The fp32 master pieces, from `fp32_flat_groups`.
    fn fp32(optim: &[SavedFile], layout: &Layout) -> Result<Pieces> {
        Pieces::gather(optim, layout, "`fp32_flat_groups`", &|s, j| {
            s.at(&[OPTIMIZER, "fp32_flat_groups"])
                .and_then(Value::as_seq)
                .and_then(|l| l.get(j))
        })
    }

    /// Each flat state tensor of the base optimizer (Adam's `exp_avg`, `exp_avg_sq`), by name, in
    /// the order rank 0 saved them.
    fn moments(optim: &[SavedFile], layout: &Layout) -> Result<Vec<(String, Pieces)>> {
        let Some(first) = state(&optim[0], 0) else {
            return Ok(Vec::new()); // Saved before any step: no state.
        };
        let names: Vec<String> = first
            .iter()
            .filter(|(_, v)| TensorRef::of(v).is_some_and(|t| !t.sizes.is_empty()))
            .filter_map(|(k, _)| k.as_str().map(str::to_string))
            .collect();
        names
            .into_iter()
            .map(|name| {
                let what = format!("`{name}`");
                let pieces = Pieces::gather(optim, layout, &what, &|s, j| {
                    state(s, j).and_then(|st| {
                        st.iter()
                            .find(|(k, _)| k.as_str() == Some(&name))
                            .map(|(_, v)| v)
                    })
                })?;
                Ok((name, pieces))
            })
            .collect()
    }

    fn gather(
        optim: &[SavedFile],
        layout: &Layout,
        what: &str,
        get: &dyn Fn(&SavedFile, usize) -> Option<&Value>,
    ) -> Result<Pieces> {
        let from = optim.len() as u64;
        let mut templates = Vec::new();
        let mut at = Vec::new();
        for (j, params) in layout.sub_groups.iter().enumerate() {
            let what = format!("{what} of sub-group {j}");
            let mut per_param = vec![Vec::with_capacity(optim.len()); params.len()];
            for s in optim {
                let t = get(s, j).ok_or_else(|| s.missing(&what))?;
                let (mut offset, len) = s.flat(t, &what)?;
                let want = layout.sub_group_piece(j, from);
                if len != want {
                    return Err(Error::invalid(format!(
                        "{what} holds {len} elements, but its parameters' pieces at {from} ranks add up to {want}"
                    ))
                    .file(&s.path)
                    .hint("the partitions do not add up: the files are of different saves, or cut short"));
                }
                for (p, (_, numel)) in params.iter().enumerate() {
                    per_param[p].push((s.input, offset));
                    offset += piece(*numel, from) * 4;
                }
            }
            let template = get(&optim[0], j).cloned().unwrap_or(Value::None);
            templates.push(template);
            at.push(per_param);
        }
        Ok(Pieces { templates, at })
    }

    /// Sub-group `j`'s flat tensor at rank `rank` of `to`, over storage `key`, and its runs.
    fn at_rank(
        &self,
        layout: &Layout,
        j: usize,
        key: &str,
        rank: usize,
        from: u64,
        to: u64,
    ) -> (Value, (u64, Vec<Run>)) {
        let mut runs = Vec::new();
        for (p, (_, numel)) in layout.sub_groups[j].iter().enumerate() {
            piece_runs(*numel, from, to, rank as u64, &self.at[j][p], 4, &mut runs);
        }
        let len = layout.sub_group_piece(j, to);
        let tensor = flat_tensor(&self.templates[j], key, len, len);
        (tensor, (len * 4, runs))
    }
}

/// Sub-group `j`'s entry in a rank's `base optimizer state`, keyed by int.
fn state(s: &SavedFile, j: usize) -> Option<&[(Value, Value)]> {
    let st = s.at(&[OPTIMIZER, OPTIMIZER, "state"])?;
    entries(st)?
        .iter()
        .find(|(k, _)| k.as_int() == Some(j as i64))
        .and_then(|(_, v)| entries(v))
}

/// Rank `r` of `to`'s optimizer states, from rank 0's as the template.
fn optim_file(
    optim: &[SavedFile],
    layout: &Layout,
    fp32: &Pieces,
    moments: &[(String, Pieces)],
    path: &Path,
    r: usize,
    to: usize,
) -> Result<OutFile> {
    let first = &optim[0];
    let from = optim.len() as u64;
    let mut root = first.root.clone();
    let mut fresh = HashMap::new();
    let mut flat = Vec::new();
    let mut states = Vec::new();
    let saved_state = first.at(&[OPTIMIZER, OPTIMIZER, "state"]);
    for j in 0..layout.sub_groups.len() {
        let key = format!("new/fp32/{j}");
        let (tensor, runs) = fp32.at_rank(layout, j, &key, r, from, to as u64);
        fresh.insert(key, runs);
        flat.push(tensor);
        let Some(entry) = state(first, j) else {
            continue;
        };
        let mut items = Vec::new();
        for (name, value) in entry {
            let n = name.as_str().unwrap_or_default();
            let new = match moments.iter().find(|(m, _)| m == n) {
                Some((_, pieces)) => {
                    let key = format!("new/{n}/{j}");
                    let (tensor, runs) = pieces.at_rank(layout, j, &key, r, from, to as u64);
                    fresh.insert(key, runs);
                    tensor
                }
                // A flat state the first sub-group lacks: its pieces were never located.
                None if TensorRef::of(value).is_some_and(|t| !t.sizes.is_empty()) => {
                    return Err(
                        first.missing(&format!("`{n}` of sub-group 0 (sub-group {j} holds one)"))
                    );
                }
                // `step` and any other scalar: the same on every rank, carried as saved.
                None => value.clone(),
            };
            items.push((name.clone(), new));
        }
        states.push((Value::Int(j as i64), Value::Dict(items)));
    }
    if saved_state.is_some() {
        set(
            &mut root,
            &[OPTIMIZER, OPTIMIZER, "state"],
            Value::Dict(states),
        )?;
    }
    set(
        &mut root,
        &[OPTIMIZER, "fp32_flat_groups"],
        Value::List(flat),
    )?;
    set(
        &mut root,
        &[OPTIMIZER, "partition_count"],
        Value::Int(to as i64),
    )?;
    archive(path, root, first, fresh)
}

/// The frozen parameters' pieces in each rank's model states.
struct Frozen {
    params: Vec<FrozenParam>,
}

struct FrozenParam {
    name: String,
    numel: u64,
    /// Per source rank: (input, byte offset) of its piece.
    at: Vec<(usize, u64)>,
    /// Bytes an element (the training dtype's).
    elem: u64,
}

impl Frozen {
    fn of(model: &[SavedFile]) -> Result<Frozen> {
        let first = &model[0];
        let from = model.len() as u64;
        let Some(shapes) = first.at(&["frozen_param_shapes"]) else {
            return Ok(Frozen { params: Vec::new() });
        };
        let shapes = super::super::shapes_of(shapes)
            .ok_or_else(|| first.missing("shapes at `frozen_param_shapes`"))?;
        let mut params = Vec::new();
        for (name, shape) in shapes {
            let numel: u64 = shape.iter().product();
            let what = format!("`frozen_param_fragments.{name}`");
            let mut at = Vec::new();
            let mut size = 0;
            for s in model {
                let t = s
                    .at(&["frozen_param_fragments"])
                    .and_then(|f| dict_get(f, &name))
                    .ok_or_else(|| s.missing(&what))?;
                let (offset, len, elem) = s.flat_any(t, &what)?;
                if len != piece(numel, from) {
                    return Err(Error::invalid(format!(
                        "{what} holds {len} elements, but {numel} over {from} ranks gives {}",
                        piece(numel, from)
                    ))
                    .file(&s.path)
                    .hint("the partitions do not add up: the files are of different saves, or cut short"));
                }
                size = elem;
                at.push((s.input, offset));
            }
            params.push(FrozenParam {
                name,
                numel,
                at,
                elem: size,
            });
        }
        Ok(Frozen { params })
    }
}

/// Rank `r` of `to`'s model states, from rank 0's as the template.
fn model_file(
    model: &[SavedFile],
    frozen: &Frozen,
    tag_dir: &Path,
    r: usize,
    to: usize,
) -> Result<OutFile> {
    let first = &model[0];
    let from = model.len() as u64;
    let mut root = first.root.clone();
    if dict_get(&root, "dp_world_size").is_none() {
        return Err(first.missing("`dp_world_size`"));
    }
    set(&mut root, &["dp_world_size"], Value::Int(to as i64))?;
    // `_get_shared_params` walks the module on rank 0 only; the others save it empty.
    if r > 0 {
        if let Some(shared) = dict_get_mut(&mut root, "shared_params") {
            *shared = Value::Dict(Vec::new());
        }
    }
    let mut fresh = HashMap::new();
    if let Some(fragments) = dict_get_mut(&mut root, "frozen_param_fragments") {
        let items = match fragments {
            Value::Dict(items) => items,
            Value::Object(o) => &mut o.dict_items,
            _ => return Err(first.missing("a dict at `frozen_param_fragments`")),
        };
        for (i, p) in frozen.params.iter().enumerate() {
            let FrozenParam {
                name,
                numel,
                at,
                elem,
            } = p;
            let Some((_, value)) = items.iter_mut().find(|(k, _)| k.as_str() == Some(name)) else {
                return Err(first.missing(&format!("`frozen_param_fragments.{name}`")));
            };
            let key = format!("new/frozen/{i}");
            let mut runs = Vec::new();
            piece_runs(*numel, from, to as u64, r as u64, at, *elem, &mut runs);
            let len = piece(*numel, to as u64);
            *value = flat_tensor(value, &key, len, len);
            fresh.insert(key, (len * elem, runs));
        }
    }
    let name = tag_dir.join(format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt"));
    archive(&name, root, first, fresh)
}
