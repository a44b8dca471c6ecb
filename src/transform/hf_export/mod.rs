//! Export to a Hugging Face model (`--hf-config`): a step between reading and planning, like
//! the LoRA fold and FSDP1 LOCAL resolution, that turns a checkpoint into one holding exactly
//! the tensors `architectures[0]` of a Hugging Face config.json names, in its layouts.
//!
//! Trainers that do not use transformers' names (torchtitan; Megatron-core next) save
//! checkpoints no inference engine loads, and their own converters build the whole model in
//! memory, need torch, and skip what their map lacks without a word. Here the source's naming
//! is recognised from its tensor names (under any app-state prefix), the maps are data
//! ([`tables`]), and every change of layout is a view of bytes where they already are
//! ([`views`]): the export is a copy, in bounded memory, like any consolidate.
//!
//! Training state (optimizer, scheduler, dataloader, train state, rotary buffers, non-tensor
//! values) is left out without being asked, and so is `lm_head` when the config ties it to the
//! embedding. Everything else under the model's names must be placed: a tensor the map does
//! not know, a config that disagrees with a tensor's shape, and a parameter the config wants
//! but no tensor gives are usage errors, found before anything is written.

mod archs;
pub(crate) mod config;
mod export;
mod import;
pub(crate) mod report;
pub(crate) mod tables;
pub(crate) mod views;

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::model::{Checkpoint, Tensor};
pub(crate) use archs::LayerSpec;
pub(crate) use config::HfConfig;
pub(crate) use export::Export;
pub(crate) use import::{Import, Trainer};
use tables::{Arch, Dim, Naming, Row, When};
use views::ViewKind;

/// One tensor of the export: the source tensor it is a view of.
#[derive(Clone, Debug)]
pub(crate) struct Placed {
    /// Index of the source tensor in the checkpoint.
    source: usize,
    pub source_name: String,
    pub target: String,
    pub view: ViewKind,
    /// The indices of the leading axes unstacking takes, outermost first (a layer of a
    /// layer-stacked weight, an expert of an expert-stacked one, or both).
    pub stack: Vec<u64>,
    /// The target is a linear layer's weight ([`tables::Param::linear`]).
    pub linear: bool,
}

/// An entry of the checkpoint the export leaves out, and why.
#[derive(Clone, Debug)]
pub(crate) struct LeftOut {
    pub name: String,
    pub why: &'static str,
}

/// How a checkpoint maps onto a Hugging Face architecture.
#[derive(Clone, Debug)]
pub(crate) struct Mapping {
    pub architecture: &'static str,
    pub naming: Naming,
    /// The app-state prefix the model's names sit under (`model.`, or empty).
    pub prefix: String,
    /// The exported tensors, in the Hugging Face model's `state_dict` order.
    pub placed: Vec<Placed>,
    pub left_out: Vec<LeftOut>,
}

/// Top-level names of training state beside a model saved without a prefix (torchtitan's
/// `optimizer`, `lr_scheduler`, `dataloader`, `train_state`; other trainers' alike).
const TRAINING_STATE: [&str; 11] = [
    "opt_param_scheduler",
    "rerun_state_machine",
    "optimizer",
    "optim",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "dataloader",
    "train_state",
    "rng_state",
    "extra_state",
];

/// Buffers a model may save that are not parameters of a Hugging Face model: rotary
/// frequencies (old transformers' `rotary_emb.inv_freq`, torchtitan's `freqs_cis`) and
/// Transformer Engine's `_extra_state`.
const BUFFERS: [&str; 3] = ["rotary_emb.inv_freq", "freqs_cis", "_extra_state"];

/// The embedding's name under each naming: what recognises a naming and its prefix.
const ANCHORS: [(&str, Naming); 3] = [
    ("model.embed_tokens.weight", Naming::HuggingFace),
    ("tok_embeddings.weight", Naming::Torchtitan),
    ("embedding.word_embeddings.weight", Naming::Megatron),
];

/// The naming and prefix of `ckpt`'s model: from the embedding with the shortest prefix that is
/// not training state (an optimizer's states repeat the model's names after theirs).
fn recognise(ckpt: &Checkpoint, arch: &Arch) -> Result<(Naming, String)> {
    let mut best: Option<(Naming, &str)> = None;
    for t in &ckpt.tensors {
        for (anchor, naming) in ANCHORS {
            let Some(prefix) = t.name.strip_suffix(anchor) else {
                continue;
            };
            if !(prefix.is_empty() || prefix.ends_with('.')) || is_training_state(prefix) {
                continue;
            }
            if best.is_none_or(|(_, p)| prefix.len() < p.len()) {
                best = Some((naming, prefix));
            }
        }
    }
    let Some((naming, prefix)) = best else {
        return Err(Error::usage(
            "no embedding tensor found (`model.embed_tokens.weight` of Hugging Face names, `tok_embeddings.weight` of torchtitan's or `embedding.word_embeddings.weight` of Megatron-core's, under any prefix), so the checkpoint's model naming is unknown",
        )
        .hint("`ckpt inspect` lists the checkpoint's tensors"));
    };
    // torchtitan's two generations share most names (0.3's DeepSeek-V3 keeps 0.2's
    // `attention.wq`): the one whose table places more of the tensors is the checkpoint's.
    let naming = match naming {
        Naming::Torchtitan => {
            let placed = |naming: Naming| {
                let rows = arch.rows(naming).unwrap_or_default();
                ckpt.tensors
                    .iter()
                    .filter_map(|t| t.name.strip_prefix(prefix))
                    .filter(|rest| {
                        rows.iter()
                            .any(|r| tables::match_pattern(r.source, rest).is_some())
                    })
                    .count()
            };
            if placed(Naming::Torchtitan02) > placed(Naming::Torchtitan) {
                Naming::Torchtitan02
            } else {
                Naming::Torchtitan
            }
        }
        other => other,
    };
    Ok((naming, prefix.to_string()))
}

fn is_training_state(name: &str) -> bool {
    let first = name.split('.').next().unwrap_or_default();
    TRAINING_STATE.contains(&first)
}

/// Why an entry under the model's prefix is not a parameter to export, if it is not.
fn not_a_parameter(rest: &str, arch: &Arch) -> Option<&'static str> {
    if is_training_state(rest) {
        return Some("training state");
    }
    let first = rest.split('.').next().unwrap_or_default();
    if arch.extra_modules.contains(&first) {
        return Some("a module transformers' model does not have");
    }
    if let Some((_, why)) = arch
        .no_place
        .iter()
        .find(|(pattern, _)| tables::match_pattern(pattern, rest).is_some())
    {
        return Some(why);
    }
    BUFFERS
        .iter()
        .any(|b| rest == *b || rest.ends_with(&format!(".{b}")))
        .then_some("buffer (not a parameter)")
}

/// Map `ckpt` onto `cfg`'s architecture, checking every shape against the config.
pub(crate) fn map(ckpt: &Checkpoint, cfg: &HfConfig) -> Result<Mapping> {
    let arch = cfg.arch;
    let (naming, prefix) = recognise(ckpt, arch)?;
    let rows = arch.rows(naming).ok_or_else(|| {
        Error::usage(format!(
            "the checkpoint has {} names, which ckpt has no map of to {}",
            naming.describe(),
            arch.name
        ))
        .file(&cfg.path)
    })?;
    let mut left_out = Vec::new();
    let mut placed = Vec::new();
    let mut unplaced = Vec::new();
    // A checkpoint without multi-token prediction layers (torchtitan's are left out below as
    // an extra module; a model trained without them) is exported without: config.json's count
    // is not asked of it.
    let without_mtp;
    let cfg = match has_mtp_layers(ckpt, cfg, &rows, &prefix, naming) {
        true => cfg,
        false => {
            without_mtp = cfg.with_mtp_layers(0);
            &without_mtp
        }
    };
    let has_mtp_params = arch.params.iter().any(|p| p.when == When::MtpLayer);
    for (i, t) in ckpt.tensors.iter().enumerate() {
        let Some(rest) = t.name.strip_prefix(prefix.as_str()) else {
            left_out.push(left(&t.name, "not under the model's prefix"));
            continue;
        };
        if let Some(why) = not_a_parameter(rest, arch) {
            left_out.push(left(&t.name, why));
            continue;
        }
        // Several rows take parts of one tensor (`gate_up_proj`'s gate and up rows).
        let matches: Vec<(&Row, Vec<(char, u64)>)> = rows
            .iter()
            .filter_map(|r| Some((r, tables::match_pattern(r.source, rest)?)))
            .collect();
        if matches.is_empty() {
            unplaced.push(t.name.as_str());
        }
        // A multi-token prediction layer past the config's: left out with --no-mtp, else refused.
        // Megatron names it by its own index; Hugging Face's names as a layer past the decoder's.
        let hf_mtp = |at: &Vec<(char, u64)>| match naming == Naming::HuggingFace && has_mtp_params {
            true => at
                .iter()
                .find(|&&(c, l)| c == 'L' && l >= cfg.layers)
                .map(|&(_, l)| l - cfg.layers),
            false => None,
        };
        let mtp = matches.iter().find_map(|(_, at)| {
            at.iter()
                .find(|(c, _)| *c == tables::MTP_INDEX)
                .map(|&(_, m)| m)
                .or_else(|| hf_mtp(at))
        });
        if let Some(m) = mtp.filter(|&m| m >= cfg.mtp_layers) {
            if cfg.no_mtp {
                left_out.push(left(&t.name, "multi-token prediction layers (--no-mtp)"));
                continue;
            }
            return Err(Error::usage(format!(
                "tensor `{}` is of multi-token prediction layer {m}, but config.json's `num_nextn_predict_layers` is {}",
                t.name, cfg.mtp_layers
            ))
            .file(&cfg.path)
            .tensor(&t.name)
            .hint("set `num_nextn_predict_layers` to the trained model's, or pass --no-mtp to leave the MTP layers out"));
        }
        for (row, indices) in matches {
            place(i, t, row, &indices, cfg, &mut placed, &mut left_out)?;
        }
    }
    if let Some(first) = unplaced.first() {
        let more = match unplaced.len() {
            1 => String::new(),
            n => format!(" (and {} more)", n - 1),
        };
        return Err(Error::usage(format!(
            "tensor `{first}`{more} of the model ({} names) has no place in {}",
            naming.describe(),
            arch.name
        ))
        .tensor(*first)
        .hint(format!(
            "leave it out with --exclude '{first}' if it is not part of the model, or check that config.json's architecture is the trained model's"
        )));
    }
    for v in &ckpt.values {
        left_out.push(left(&v.name, "not a tensor"));
    }
    let placed = order_and_check(ckpt, cfg, placed, &rows)?;
    Ok(Mapping {
        architecture: arch.name,
        naming,
        prefix,
        placed,
        left_out,
    })
}

/// Whether the checkpoint holds a multi-token prediction layer: a tensor an MTP row places
/// (`{M}`), or under Hugging Face names one of a layer past the decoder's.
fn has_mtp_layers(
    ckpt: &Checkpoint,
    cfg: &HfConfig,
    rows: &[Row],
    prefix: &str,
    naming: Naming,
) -> bool {
    let mtp_rows: Vec<&Row> = rows.iter().filter(|r| r.source.contains("{M}")).collect();
    ckpt.tensors.iter().any(|t| {
        let Some(rest) = t.name.strip_prefix(prefix) else {
            return false;
        };
        let past_decoder = naming == Naming::HuggingFace
            && rows.iter().any(|r| {
                tables::match_pattern(r.source, rest)
                    .is_some_and(|at| at.iter().any(|&(c, l)| c == 'L' && l >= cfg.layers))
            });
        past_decoder
            || mtp_rows
                .iter()
                .any(|r| tables::match_pattern(r.source, rest).is_some())
    })
}

/// Place tensor `i` by `row` (whose source it matched with `indices`): one tensor, or one per
/// expert of its leading axis, or none for a tied head.
fn place(
    i: usize,
    t: &Tensor,
    row: &Row,
    indices: &[(char, u64)],
    cfg: &HfConfig,
    placed: &mut Vec<Placed>,
    left_out: &mut Vec<LeftOut>,
) -> Result<()> {
    // Under Hugging Face names the MTP layers follow the decoder's.
    if let Some(&(_, layer)) = indices.iter().find(|(c, _)| *c == 'L') {
        if layer >= cfg.layers + cfg.mtp_layers {
            return Err(Error::usage(format!(
                "tensor `{}` is of layer {layer}, but config.json's `num_hidden_layers` is {}{}",
                t.name,
                cfg.layers,
                match cfg.mtp_layers {
                    0 => String::new(),
                    n => format!(" and its `num_nextn_predict_layers` {n}"),
                }
            ))
            .file(&cfg.path)
            .tensor(&t.name)
            .hint(CONFIG_HINT));
        }
    }
    // A multi-token prediction layer `M` is layer `num_hidden_layers + M` of the Hugging Face
    // model; a source without one (the embedding, the head) goes to every MTP layer, of which
    // there may be none (--no-mtp, or a model trained without).
    let mtp: Option<Vec<u64>> = match indices.iter().find(|(c, _)| *c == 'M') {
        Some(&(_, m)) => Some(vec![cfg.layers + m]),
        None if row.target.contains(tables::MTP) => {
            Some((0..cfg.mtp_layers).map(|j| cfg.layers + j).collect())
        }
        None => None,
    };
    let targets: Vec<String> = match mtp {
        None => vec![tables::fill(row.target, indices)],
        Some(layers) => layers
            .iter()
            .map(|&l| {
                let mut with = indices.to_vec();
                with.push(('L', l));
                tables::fill(&row.target.replace(tables::MTP, "{L}"), &with)
            })
            .collect(),
    };
    for target in targets {
        if cfg.tied && target == "lm_head.weight" {
            left_out.push(left(&t.name, "tied to the embedding (tie_word_embeddings)"));
            continue;
        }
        unstack_into(i, t, row, target, cfg, placed)?;
    }
    Ok(())
}

/// Tensor `i` placed at `target` by `row`: itself, or one tensor per index of each leading axis
/// its target names and its source does not (per layer, per expert, or both).
fn unstack_into(
    i: usize,
    t: &Tensor,
    row: &Row,
    target: String,
    cfg: &HfConfig,
    placed: &mut Vec<Placed>,
) -> Result<()> {
    let axes = tables::unstacked(row);
    let mut counts = Vec::with_capacity(axes.len());
    for (d, &axis) in axes.iter().enumerate() {
        let (count, says) = match axis {
            'L' => (cfg.layers, format!("`num_hidden_layers` = {}", cfg.layers)),
            _ => cfg.size(Dim::Experts)?,
        };
        let leading = t.shape.get(d).copied().unwrap_or(0);
        if t.shape.len() < axes.len() + 1 || leading != count {
            return Err(Error::usage(format!(
                "tensor `{}` has shape {:?}, whose axis {d} should be config.json's {says}",
                t.name, t.shape
            ))
            .file(&cfg.path)
            .tensor(&t.name)
            .hint(CONFIG_HINT));
        }
        counts.push(count);
    }
    // Every combination of the stacked axes' indices, outermost first.
    let mut combos: Vec<Vec<u64>> = vec![Vec::new()];
    for &n in &counts {
        combos = combos
            .into_iter()
            .flat_map(|c| {
                (0..n).map(move |k| {
                    let mut c = c.clone();
                    c.push(k);
                    c
                })
            })
            .collect();
    }
    for stack in combos {
        let at: Vec<(char, u64)> = axes.iter().copied().zip(stack.iter().copied()).collect();
        placed.push(Placed {
            source: i,
            source_name: t.name.clone(),
            target: tables::fill(&target, &at),
            view: row.view,
            stack,
            linear: false,
        });
    }
    Ok(())
}

const CONFIG_HINT: &str = "pass the config.json of the model this checkpoint was trained as";

fn left(name: &str, why: &'static str) -> LeftOut {
    LeftOut {
        name: name.to_string(),
        why,
    }
}

/// `placed` in the architecture's parameter order, each parameter the config asks for given
/// exactly once, by a tensor of the shape the config gives it.
fn order_and_check(
    ckpt: &Checkpoint,
    cfg: &HfConfig,
    placed: Vec<Placed>,
    rows: &[Row],
) -> Result<Vec<Placed>> {
    let mut by_target: BTreeMap<String, Placed> = BTreeMap::new();
    for p in placed {
        if let Some(other) = by_target.get(&p.target) {
            return Err(Error::usage(format!(
                "tensors `{}` and `{}` both map to `{}`",
                other.source_name, p.source_name, p.target
            ))
            .tensor(&p.source_name)
            .hint("leave one out with --exclude"));
        }
        by_target.insert(p.target.clone(), p);
    }
    let wanted = parameters(cfg)?;
    // Layers the checkpoint has a tensor of: a layer it lacks whole is `num_hidden_layers`'
    // doing, whatever else the config says of that layer.
    let saved_layers: BTreeSet<u64> = wanted
        .iter()
        .filter(|w| by_target.contains_key(&w.name))
        .filter_map(|w| w.layer())
        .collect();
    let mut out = Vec::with_capacity(by_target.len());
    for w in wanted {
        let (param, name) = (w.param, &w.name);
        if !w.present {
            if let Some(p) = by_target.get(name) {
                return Err(Error::usage(format!(
                    "tensor `{}` maps to `{name}`, which {} does not have: config.json's {}",
                    p.source_name,
                    cfg.arch.name,
                    param.when.absent_because()
                ))
                .file(&cfg.path)
                .tensor(&p.source_name)
                .hint(CONFIG_HINT));
            }
            continue;
        }
        let Some(mut p) = by_target.remove(name) else {
            if param.when == When::MoeLayerIfSaved {
                continue;
            }
            return Err(missing(cfg, rows, param, name, &w.indices, &saved_layers));
        };
        check_shape(&ckpt.tensors[p.source], &p, param.shape, cfg)?;
        p.linear = param.linear;
        out.push(p);
    }
    if let Some(p) = by_target.values().next() {
        // Every row's target is a parameter of its architecture (a unit test checks the tables).
        return Err(Error::bug(format!(
            "`{}` is not a parameter of {}",
            p.target, cfg.arch.name
        ))
        .tensor(&p.source_name));
    }
    Ok(out)
}

/// One parameter of the architecture, at its layer and expert.
pub(super) struct Wanted {
    pub param: &'static tables::Param,
    /// `('L', layer)` and `('E', expert)` where the name has them.
    pub indices: Vec<(char, u64)>,
    pub name: String,
    /// Whether config.json gives the model this parameter.
    pub present: bool,
}

impl Wanted {
    fn layer(&self) -> Option<u64> {
        self.indices.iter().find(|(c, _)| *c == 'L').map(|x| x.1)
    }
}

/// Every parameter of `cfg`'s architecture, in the model's `state_dict` order: what comes
/// before the layers (the embedding), each layer's parameters (the decoder's layers, then the
/// multi-token prediction layers), then what comes after (the final norm, the head); a routed
/// expert's once per expert. Those config.json leaves out are listed too, as not present.
pub(super) fn parameters(cfg: &HfConfig) -> Result<Vec<Wanted>> {
    let params = cfg.arch.params;
    let layered = |p: &&tables::Param| p.name.contains("{L}");
    let first = params
        .iter()
        .position(|p| layered(&p))
        .unwrap_or(params.len());
    let (head, rest) = params.split_at(first);
    let experts = match params.iter().any(|p| p.name.contains("{E}")) {
        true => cfg.size(Dim::Experts)?.0,
        false => 0,
    };
    let order = head
        .iter()
        .map(|p| (p, None))
        .chain(
            (0..cfg.layers + cfg.mtp_layers)
                .flat_map(|l| rest.iter().filter(layered).map(move |p| (p, Some(l)))),
        )
        .chain(rest.iter().filter(|p| !layered(p)).map(|p| (p, None)));
    let mut out = Vec::new();
    for (param, layer) in order {
        // An MTP layer holds a decoder layer's parameters and its own; a decoder layer only its.
        let mtp_layer = layer.is_some_and(|l| l >= cfg.layers);
        let present = cfg.has(param.when, layer) && (mtp_layer || param.when != When::MtpLayer);
        let per_expert: Vec<Option<u64>> = match param.name.contains("{E}") {
            true => (0..experts).map(Some).collect(),
            false => vec![None],
        };
        for expert in per_expert {
            let mut indices = Vec::new();
            indices.extend(layer.map(|l| ('L', l)));
            indices.extend(expert.map(|e| ('E', e)));
            out.push(Wanted {
                param,
                name: tables::fill(param.name, &indices),
                indices,
                present,
            });
        }
    }
    Ok(out)
}

/// The error for a parameter the config asks for and no tensor gives.
fn missing(
    cfg: &HfConfig,
    rows: &[Row],
    param: &tables::Param,
    name: &str,
    indices: &[(char, u64)],
    saved_layers: &BTreeSet<u64>,
) -> Error {
    let layer = indices.iter().find(|(c, _)| *c == 'L').map(|&(_, l)| l);
    let from = rows
        .iter()
        .find(|r| r.target == param.name)
        .map(|r| tables::fill(r.source, indices));
    let wanted = match &from {
        Some(source) if source != name => format!(" (from `{source}`)"),
        _ => String::new(),
    };
    // The field that put the parameter there: a dense or MoE layer is first_k_dense_replace's
    // (or mlp_only_layers') doing, not num_hidden_layers'.
    let rule = cfg.moe_rule();
    let why = match (param.when, layer) {
        (_, Some(l)) if !saved_layers.contains(&l) => format!(
            "; config.json's `num_hidden_layers` is {}, but the checkpoint has no tensor of layer {l} (it has {})",
            cfg.layers,
            saved_layers.len()
        ),
        (When::DenseLayer, Some(l)) => format!(
            "; config.json's {rule} makes layer {l} dense, but the checkpoint has no dense MLP there"
        ),
        (When::MoeLayer, Some(l)) => format!(
            "; config.json's {rule} makes layer {l} a mixture of experts, but the checkpoint has no experts there"
        ),
        (When::QLora, _) => "; config.json's `q_lora_rank` is set".to_string(),
        (_, Some(l)) if l >= cfg.layers => format!(
            "; config.json's `num_nextn_predict_layers` = {} makes layer {l} a multi-token prediction layer (pass --no-mtp to leave them out)",
            cfg.mtp_layers
        ),
        (_, Some(_)) => format!("; config.json's `num_hidden_layers` is {}", cfg.layers),
        (_, None) => String::new(),
    };
    Error::usage(format!(
        "{} needs `{name}`{wanted}, which the checkpoint does not have{why}",
        cfg.arch.name
    ))
    .file(&cfg.path)
    .hint(CONFIG_HINT)
}

/// Refuse a tensor whose shape (after its view) disagrees with what the config gives it.
fn check_shape(t: &Tensor, p: &Placed, want: &[tables::Dim], cfg: &HfConfig) -> Result<()> {
    let here = format!("tensor `{}` (`{}`)", t.name, p.target);
    let stacked = t.shape.get(p.stack.len()..).unwrap_or_default();
    let shape = p.view.shape(stacked, &cfg.sizes()).map_err(|why| {
        Error::usage(format!(
            "{here} cannot be viewed as {}: {why}",
            p.view.describe()
        ))
        .file(&cfg.path)
        .tensor(&t.name)
        .hint(CONFIG_HINT)
    })?;
    check_dims(&here, &t.name, &shape, want, cfg, CONFIG_HINT)
}

/// `shape`, of the tensor named `tensor` (`here` says which, for errors), has the sizes `want`
/// gives under config.json; `hint` says what to do when it has not.
fn check_dims(
    here: &str,
    tensor: &str,
    shape: &[u64],
    want: &[tables::Dim],
    cfg: &HfConfig,
    hint: &str,
) -> Result<()> {
    if shape.len() != want.len() {
        return Err(Error::usage(format!(
            "{here} has shape {shape:?}, but {} has {} dims there",
            cfg.arch.name,
            want.len()
        ))
        .tensor(tensor));
    }
    for (d, (&n, &dim)) in shape.iter().zip(want).enumerate() {
        let (size, says) = cfg.size(dim)?;
        if n != size {
            let implied = cfg
                .implied(dim, n)
                .map(|r| format!("; the tensor's {n} would be {r}"))
                .unwrap_or_default();
            return Err(Error::usage(format!(
                "{here} has {n} in dim {d} of its shape {shape:?}, but config.json's {says}{implied}"
            ))
            .file(&cfg.path)
            .tensor(tensor)
            .hint(hint));
        }
    }
    Ok(())
}

/// The checkpoint the export writes: `mapping`'s tensors under their Hugging Face names, each
/// a view of its source's pieces; nothing else.
pub(crate) fn apply(ckpt: Checkpoint, cfg: &HfConfig, mapping: &Mapping) -> Result<Checkpoint> {
    let mut tensors = Vec::with_capacity(mapping.placed.len());
    let sizes = cfg.sizes();
    for p in &mapping.placed {
        let t = &ckpt.tensors[p.source];
        if !p.stack.is_empty() || p.view != ViewKind::Rename {
            views::check_copied(t)?;
        }
        let mut pieces = t.pieces.clone();
        for (d, &k) in p.stack.iter().enumerate() {
            pieces = views::unstack(&pieces, &t.shape[d..], t.dtype.size() as u64, k)
                .map_err(|e| e.tensor(&t.name))?;
        }
        let stacked = t.shape.get(p.stack.len()..).unwrap_or_default();
        // `map` checked every view's shape against the config.
        let shape = p.view.shape(stacked, &sizes).map_err(Error::usage)?;
        let elem = t.dtype.size() as u64;
        let pieces = p.view.apply(&pieces, stacked, elem, &sizes)?;
        tensors.push(Tensor {
            name: p.target.clone(),
            key_path: Vec::new(),
            dtype: t.dtype,
            shape,
            pieces,
        });
    }
    Ok(Checkpoint {
        tensors,
        values: Vec::new(),
        unsupported: Vec::new(),
        ..ckpt
    })
}

#[cfg(test)]
mod tests;
