//! The import (`reshard HF_MODEL --format megatron|torchtitan`): a Hugging Face release under a
//! trainer's names and layouts, so that the trainer starts from it. The export's tables read the
//! other way: each row that places a trainer tensor's view on a Hugging Face parameter here
//! places that parameter's pieces back where the view took them from (rows of a fused QKV or a
//! `[gate; up]`, one layer of a layer-stacked weight, one expert of an expert-stacked one, the
//! RoPE rows of torchtitan's queries and keys, a vocabulary padded with zeros), without a byte
//! read or gathered: the trainer's tensors are views of the release's files, written as any
//! reshard writes them.
//!
//! Where the export has several rows for one parameter (Megatron's layer-stacked and per-layer
//! names, a norm under its own name and under the linear it precedes), the first row of the
//! table is the one written: the layer-stacked names and the norms under the linears, what
//! megatron-core's `GPTModel` saves.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::archs::{self, LayerSpec};
use super::tables::{self, Naming, Param, Row};
use super::views::{Sizes, ViewKind};
use super::HfConfig;
use crate::error::{Error, Result};
use crate::model::{Checkpoint, Compute, Computed, Encoding, NonTensor, Pieces, Tensor};
use crate::pickle::Value;
use crate::transform::{Report, Step};

/// The trainer a release is imported for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Trainer {
    /// Megatron-core's `GPTModel` in `torch_dist`: the vocabulary padded to a multiple of
    /// `vocab_multiple` × `tensor_parallel` rows, as Megatron-LM pads it.
    Megatron {
        tensor_parallel: u64,
        vocab_multiple: u64,
        /// The run's layer spec, which names the norms.
        spec: LayerSpec,
    },
    /// torchtitan's model, as its `create_seed_checkpoint` saves it.
    Torchtitan,
}

impl Trainer {
    fn naming(self) -> Naming {
        match self {
            Trainer::Megatron { .. } => Naming::Megatron,
            Trainer::Torchtitan => Naming::Torchtitan,
        }
    }
}

/// `reshard --format megatron|torchtitan` of a Hugging Face release.
pub(crate) struct Import {
    /// The release's own config.json: the source of truth for the architecture.
    pub cfg: HfConfig,
    pub trainer: Trainer,
}

/// One Hugging Face tensor placed in a trainer tensor.
struct Placement {
    /// Index of the Hugging Face tensor.
    hf: usize,
    view: ViewKind,
    /// The indices of the trainer tensor's leading (stack) axes it is at, outermost first.
    stacked: Vec<u64>,
}

/// A trainer tensor being assembled.
struct Assembly {
    name: String,
    /// The view's parts present, for the ones a fused tensor needs all of.
    placements: Vec<Placement>,
    /// How many each leading stack axis holds (layers, experts), outermost first.
    stack: Vec<u64>,
}

impl Step for Import {
    fn apply(&self, ckpt: Checkpoint, report: &mut Report) -> Result<Checkpoint> {
        let cfg = &self.cfg;
        let naming = self.trainer.naming();
        let rows = cfg.arch.rows(naming).ok_or_else(|| {
            Error::usage(format!(
                "ckpt has no map of {} to {}'s names",
                cfg.arch.name,
                naming.describe()
            ))
            .file(&cfg.path)
        })?;
        let assemblies = self.assemble(&ckpt, &rows, report)?;
        let sizes = cfg.sizes();
        let padded = self.padded_vocab();
        let values = match self.trainer {
            Trainer::Megatron { .. } => megatron_extra_states(&assemblies),
            Trainer::Torchtitan => Vec::new(),
        };
        let mut tensors = Vec::with_capacity(assemblies.len());
        for a in assemblies {
            tensors.push(self.tensor(&ckpt, a, &sizes, padded)?);
        }
        if self.trainer == Trainer::Torchtitan {
            tensors.extend(self.tied_head(&tensors, &rows));
            tensors.extend(self.trainer_zeros(&ckpt, &rows, report)?);
        }
        Ok(Checkpoint {
            tensors,
            values,
            unsupported: Vec::new(),
            ..ckpt
        })
    }
}

impl Import {
    /// Megatron-LM's padded vocabulary: `ceil(V / (M·T))·M·T`; torchtitan's is the release's.
    fn padded_vocab(&self) -> u64 {
        let v = self.cfg.vocab;
        match self.trainer {
            Trainer::Megatron {
                tensor_parallel,
                vocab_multiple,
                ..
            } => {
                let m = vocab_multiple.max(1).saturating_mul(tensor_parallel.max(1));
                v.div_ceil(m).saturating_mul(m)
            }
            Trainer::Torchtitan => v,
        }
    }

    /// torchtitan's head when the release ties it to the embedding: a tied torchtitan model
    /// saves (and its load asks for) the one parameter under both names.
    fn tied_head(&self, tensors: &[Tensor], rows: &[Row]) -> Option<Tensor> {
        if !self.cfg.tied {
            return None;
        }
        let name_of = |target: &str| rows.iter().find(|r| r.target == target).map(|r| r.source);
        let head = name_of(tables::LM_HEAD)?;
        let embedding = name_of(tables::EMBEDDING)?;
        let e = tensors.iter().find(|t| t.name == embedding)?;
        Some(Tensor {
            name: head.to_string(),
            ..e.clone()
        })
    }

    /// The trainer tensors no release holds, as the trainer initializes them: torchtitan's
    /// load-balancing routing bias of each MoE layer (zeros), where the architecture has no
    /// place for it.
    fn trainer_zeros(
        &self,
        ckpt: &Checkpoint,
        rows: &[Row],
        report: &mut Report,
    ) -> Result<Vec<Tensor>> {
        let cfg = &self.cfg;
        let mut out = Vec::new();
        for &(pattern, _) in cfg.arch.no_place {
            if pattern != tables::TT_ROUTING_BIAS || rows.iter().any(|r| r.source == pattern) {
                continue;
            }
            let Some(file) = ckpt.tensors.iter().find_map(|t| t.pieces.iter().next()) else {
                continue;
            };
            let experts = cfg.size(tables::Dim::Experts)?.0;
            for l in (0..cfg.layers).filter(|&l| cfg.is_moe_layer(l)) {
                let mut pieces = Pieces::new(1);
                pieces.push_parts(
                    &[0],
                    &[experts],
                    Arc::clone(file.file()),
                    0,
                    &[1],
                    Encoding::Zeros,
                )?;
                out.push(Tensor {
                    name: tables::fill(pattern, &[('L', l)]),
                    key_path: Vec::new(),
                    dtype: crate::dtype::DType::F32,
                    shape: vec![experts],
                    pieces,
                });
            }
        }
        if !out.is_empty() {
            report.notes.push(format!(
                "the import wrote torchtitan's load-balancing routing bias of {} MoE layers as zeros, as torchtitan starts it: the release has none",
                out.len()
            ));
        }
        Ok(out)
    }

    /// Every Hugging Face tensor placed in the trainer tensor the table's first row for its
    /// parameter names; the trainer tensors in table order.
    fn assemble(
        &self,
        ckpt: &Checkpoint,
        rows: &[Row],
        report: &mut Report,
    ) -> Result<Vec<Assembly>> {
        let cfg = &self.cfg;
        // Megatron saves layer-stacked weights when every decoder layer is alike, and one
        // tensor per layer when they are not (dense and MoE layers).
        let per_layer = !(0..cfg.layers).all(|l| cfg.is_moe_layer(l) == cfg.is_moe_layer(0));
        let mut by_name: BTreeMap<String, usize> = BTreeMap::new();
        let mut out: Vec<Assembly> = Vec::new();
        let mut left = 0;
        let mut copies = 0;
        for (i, t) in ckpt.tensors.iter().enumerate() {
            let Some((param, indices)) = param_of(cfg, &t.name) else {
                if is_buffer(&t.name) {
                    left += 1;
                    continue;
                }
                return Err(Error::usage(format!(
                    "tensor `{}` is not a parameter of {} as ckpt knows it",
                    t.name, cfg.arch.name
                ))
                .tensor(&t.name)
                .file(&cfg.path)
                .hint(RELEASE_HINT));
            };
            let layer = indices.iter().find(|(c, _)| *c == 'L').map(|&(_, l)| l);
            let mtp = layer.is_some_and(|l| l >= cfg.layers);
            check_present(cfg, t, param, layer)?;
            super::check_dims(
                &format!("tensor `{}`", t.name),
                &t.name,
                &t.shape,
                param.shape,
                cfg,
                RELEASE_HINT,
            )?;
            let row = self.row_of(rows, t, param, layer, per_layer)?;
            if row.target.contains(tables::MTP) {
                // An MTP layer's copy of the embedding or head: the trainer has the one.
                copies += 1;
                continue;
            }
            let axes = tables::unstacked(row);
            let mut own: Vec<(char, u64)> = indices
                .iter()
                .copied()
                .filter(|(c, _)| !axes.contains(c))
                .collect();
            if let Some(l) = layer.filter(|_| mtp) {
                own.retain(|(c, _)| *c != 'L');
                own.push((tables::MTP_INDEX, l - cfg.layers));
            }
            let name = tables::fill(row.source, &own);
            let stacked: Vec<u64> = axes
                .iter()
                .filter_map(|a| indices.iter().find(|(c, _)| c == a).map(|x| x.1))
                .collect();
            let mut stack = Vec::with_capacity(axes.len());
            for a in &axes {
                stack.push(match a {
                    'L' => cfg.layers,
                    _ => cfg.size(tables::Dim::Experts)?.0,
                });
            }
            let k = *by_name.entry(name.clone()).or_insert_with(|| {
                out.push(Assembly {
                    name,
                    placements: Vec::new(),
                    stack,
                });
                out.len() - 1
            });
            out[k].placements.push(Placement {
                hf: i,
                view: row.view,
                stacked,
            });
        }
        complete(ckpt, cfg)?;
        if copies > 0 {
            report.notes.push(format!(
                "the import wrote the embedding and head once: the release's {copies} copies of them in its multi-token prediction layers are the trainer's shared ones"
            ));
        }
        if left > 0 {
            report.notes.push(format!(
                "the import left out {left} buffers of the release (rotary frequencies), which the trainer makes itself"
            ));
        }
        // Table order: what the trainer's state dict lists first comes first.
        let position = |name: &str| {
            rows.iter()
                .position(|r| tables::match_pattern(r.source, name).is_some())
                .unwrap_or(usize::MAX)
        };
        out.sort_by_key(|a| position(&a.name));
        Ok(out)
    }

    /// The row that places `param` (of `t`, at `layer`) in the trainer's names: the table's,
    /// under the name the run's layer spec saves where Megatron's specs differ.
    fn row_of<'r>(
        &self,
        rows: &'r [Row],
        t: &Tensor,
        param: &Param,
        layer: Option<u64>,
        per_layer: bool,
    ) -> Result<&'r Row> {
        let cfg = &self.cfg;
        let mtp = layer.is_some_and(|l| l >= cfg.layers);
        let named = match self.trainer {
            Trainer::Megatron { spec, .. } => {
                let moe_layer = layer.is_some_and(|l| cfg.is_moe_layer(l));
                archs::spec_name(cfg.arch, param.name, moe_layer, spec)
            }
            Trainer::Torchtitan => None,
        };
        row_for(rows, param, mtp, per_layer, named).ok_or_else(|| {
            Error::usage(format!(
                "{}'s `{}` has no place in {}'s names",
                cfg.arch.name,
                param.name,
                self.trainer.naming().describe()
            ))
            .tensor(&t.name)
        })
    }

    /// The trainer tensor `a`: its shape, and every Hugging Face tensor's pieces placed in it.
    fn tensor(&self, ckpt: &Checkpoint, a: Assembly, s: &Sizes, padded: u64) -> Result<Tensor> {
        let first = &ckpt.tensors[a.placements[0].hf];
        let dtype = first.dtype;
        if let Some(p) = a
            .placements
            .iter()
            .find(|p| ckpt.tensors[p.hf].dtype != dtype)
        {
            return Err(Error::usage(format!(
                "`{}` and `{}` go into one tensor `{}` but are {} and {}",
                first.name, ckpt.tensors[p.hf].name, a.name, dtype, ckpt.tensors[p.hf].dtype
            ))
            .hint("pass --dtype to write one dtype"));
        }
        let inner = inner_shape(first, a.placements[0].view, s, padded)?;
        let mut shape = a.stack.clone();
        shape.extend_from_slice(&inner);
        let mut pieces = Pieces::new(shape.len());
        let computed = computed_rows(ckpt, &a, &inner, s)?;
        for p in &a.placements {
            let t = &ckpt.tensors[p.hf];
            if inner_shape(t, p.view, s, padded)? != inner {
                return Err(Error::usage(format!(
                    "`{}` of shape {:?} does not fit `{}` beside `{}` of shape {:?}",
                    t.name, t.shape, a.name, first.name, first.shape
                ))
                .tensor(&t.name));
            }
            place(&mut pieces, t, p, &inner, s)?;
        }
        if let Some(v) = a.placements.iter().find(|p| p.view == ViewKind::TrimVocab) {
            if !a.stack.is_empty() {
                return Err(Error::bug("a padded vocabulary in a stacked tensor").tensor(&a.name));
            }
            pad_rows(&mut pieces, &ckpt.tensors[v.hf], &inner, s.vocab)?;
        }
        if let Some(c) = computed {
            pieces.set_computed(c);
        }
        let want = crate::model::numel(&shape).unwrap_or(0);
        let got: u64 = pieces
            .iter()
            .map(|p| crate::model::numel(p.sizes()).unwrap_or(0))
            .sum();
        if got != want {
            let names: Vec<&str> = a
                .placements
                .iter()
                .map(|p| ckpt.tensors[p.hf].name.as_str())
                .collect();
            return Err(Error::usage(format!(
                "`{}` of shape {shape:?} is made of {}, which hold {got} of its {want} elements: a part of it is missing from the release",
                a.name,
                names.join(", ")
            ))
            .tensor(&a.name));
        }
        Ok(Tensor {
            name: a.name,
            key_path: Vec::new(),
            dtype,
            shape,
            pieces,
        })
    }
}

/// What to do when the release and its config.json disagree.
const RELEASE_HINT: &str = "check that config.json is the release's own";

/// Every parameter config.json gives the model is in the release (routing biases a release
/// may leave out aside).
fn complete(ckpt: &Checkpoint, cfg: &HfConfig) -> Result<()> {
    let names: std::collections::BTreeSet<&str> =
        ckpt.tensors.iter().map(|t| t.name.as_str()).collect();
    let wanted = super::parameters(cfg)?;
    let lacking = wanted
        .iter()
        .filter(|w| w.present && w.param.when != tables::When::MoeLayerIfSaved)
        .find(|w| !names.contains(w.name.as_str()));
    let Some(w) = lacking else {
        return Ok(());
    };
    let layer = w.indices.iter().find(|(c, _)| *c == 'L').map(|x| x.1);
    let why = match layer {
        Some(l) if l >= cfg.layers => format!(
            "config.json's `num_nextn_predict_layers` = {} makes layer {l} a multi-token prediction layer",
            cfg.mtp_layers
        ),
        Some(l) => format!(
            "config.json's `num_hidden_layers` = {} has a layer {l}",
            cfg.layers
        ),
        None => format!("{} has it", cfg.arch.name),
    };
    Err(
        Error::usage(format!("the release has no tensor `{}`, but {why}", w.name))
            .file(&cfg.path)
            .hint(RELEASE_HINT),
    )
}

/// That config.json gives the model `param` at `layer` (past the decoder's layers: of an MTP
/// layer it has), as the release's tensor `t` says it has.
fn check_present(cfg: &HfConfig, t: &Tensor, param: &Param, layer: Option<u64>) -> Result<()> {
    let mtp = layer.is_some_and(|l| l >= cfg.layers);
    let present = match (layer, mtp) {
        (Some(l), true) => l < cfg.layers + cfg.mtp_layers,
        _ => cfg.has(param.when, layer),
    } && (!mtp || param.when != tables::When::MtpLayer || cfg.has(param.when, layer));
    if !present {
        return Err(Error::usage(format!(
            "tensor `{}` is a parameter {} does not have: config.json's {}",
            t.name,
            cfg.arch.name,
            match mtp {
                true => "`num_nextn_predict_layers` has fewer multi-token prediction layers",
                false => param.when.absent_because(),
            }
        ))
        .tensor(&t.name)
        .file(&cfg.path));
    }
    Ok(())
}

/// The row that places `param` for the import: the first of the table's, among those of an MTP
/// layer's (`{M}`) when `mtp`, of one layer's (`decoder.layers.{L}`) rather than the
/// layer-stacked ones when `per_layer`, and of those under the name `named` (the one the run's
/// layer spec saves) where that is given.
fn row_for<'r>(
    rows: &'r [Row],
    param: &Param,
    mtp: bool,
    per_layer: bool,
    named: Option<&str>,
) -> Option<&'r Row> {
    let targets = |r: &&Row| r.target.replace(tables::MTP, "{L}") == param.name;
    let spec_named = |r: &&Row| named.is_none_or(|n| r.source.ends_with(&format!(".{n}")));
    let candidates: Vec<&Row> = rows
        .iter()
        .filter(targets)
        .filter(|r| r.is_mtp() == mtp)
        .filter(spec_named)
        .collect();
    let one_layer = |r: &&&Row| r.source.contains("{L}");
    match per_layer {
        true => candidates
            .iter()
            .find(one_layer)
            .or(candidates.first())
            .copied(),
        false => candidates.first().copied(),
    }
}

/// The architecture's parameter `name` is, with the indices it holds.
fn param_of(cfg: &HfConfig, name: &str) -> Option<(&'static Param, Vec<(char, u64)>)> {
    cfg.arch
        .params
        .iter()
        .find_map(|p| Some((p, tables::match_pattern(p.name, name)?)))
}

/// Buffers a release may hold that are not parameters (old transformers' rotary frequencies).
fn is_buffer(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// The shape of the trainer tensor (one entry of its stack) that `t` is a view of.
fn inner_shape(t: &Tensor, view: ViewKind, s: &Sizes, padded: u64) -> Result<Vec<u64>> {
    let mut shape = t.shape.clone();
    let Some(rows) = shape.first_mut() else {
        return Ok(shape);
    };
    match view {
        ViewKind::Rename | ViewKind::RopeQuery | ViewKind::RopeKv => {}
        ViewKind::Split { of, .. } => *rows = rows.saturating_mul(of),
        ViewKind::Qkv(_) => {
            *rows = s
                .heads
                .saturating_add(s.kv_heads.saturating_mul(2))
                .saturating_mul(s.head_dim)
        }
        ViewKind::TrimVocab => *rows = padded,
        ViewKind::Transpose => {
            let n = shape.len();
            if n < 2 {
                return Err(Error::bug("a transpose of fewer than 2 dims").tensor(&t.name));
            }
            shape.swap(n - 2, n - 1);
        }
    }
    // Checked by the forward view: `t` is what the trainer tensor's view gives.
    let back = view.shape(&shape, s).map_err(Error::usage)?;
    if back != t.shape {
        return Err(Error::usage(format!(
            "`{}` of shape {:?} cannot be taken as the {} of a tensor of the sizes config.json gives (it would be {back:?})",
            t.name,
            t.shape,
            view.describe()
        ))
        .tensor(&t.name));
    }
    Ok(shape)
}

/// `t`'s pieces placed where placement `p`'s view takes them from in a trainer tensor whose
/// stack entries are `inner`.
fn place(out: &mut Pieces, t: &Tensor, p: &Placement, inner: &[u64], s: &Sizes) -> Result<()> {
    let elem = t.dtype.size() as u64;
    if p.view == ViewKind::Transpose {
        // Its own inverse: the axes swapped back.
        let n = t.shape.len();
        for piece in t.pieces.iter() {
            let (mut offsets, mut sizes) = (piece.offsets().to_vec(), piece.sizes().to_vec());
            let mut strides = piece.strides().to_vec();
            for v in [&mut offsets, &mut sizes, &mut strides] {
                v.swap(n - 2, n - 1);
            }
            push(
                out,
                &p.stacked,
                &offsets,
                &sizes,
                piece,
                piece.offset(),
                &strides,
            )?;
        }
        return Ok(());
    }
    let rows = inner.first().copied().unwrap_or(0);
    // (row of `t`, row of the trainer tensor, rows): the view's runs, laid end to end in `t`.
    let runs: Vec<(u64, u64, u64)> = match p.view {
        ViewKind::RopeQuery | ViewKind::RopeKv => {
            let heads = match p.view {
                ViewKind::RopeQuery => s.heads,
                _ => s.kv_heads,
            };
            rope_rows(rows, heads).map_err(|e| e.tensor(&t.name))?
        }
        _ => {
            let runs = p
                .view
                .source_runs(rows, s)
                .map_err(|e| Error::usage(e).tensor(&t.name))?;
            let mut at = 0;
            runs.into_iter()
                .map(|(start, len)| {
                    let run = (at, start, len);
                    at += len;
                    run
                })
                .collect()
        }
    };
    for piece in t.pieces.iter() {
        if piece.sizes().contains(&0) {
            continue;
        }
        let (o, n) = (piece.offsets()[0], piece.sizes()[0]);
        let strides = piece.strides();
        for &(from, to, len) in &runs {
            let (lo, hi) = (o.max(from), (o + n).min(from + len));
            if lo >= hi {
                continue;
            }
            let mut offsets = piece.offsets().to_vec();
            let mut sizes = piece.sizes().to_vec();
            offsets[0] = to + (lo - from);
            sizes[0] = hi - lo;
            let at = piece.offset() + (lo - o) * strides[0] * elem;
            push(out, &p.stacked, &offsets, &sizes, piece, at, &strides)?;
        }
    }
    Ok(())
}

/// When the Hugging Face tensors of `a` are computed (an FP8 release's weights, dequantized as
/// they are copied), the computation of the trainer tensor: each box handed to the tensors'
/// own computations a run of rows at a time, in their coordinates. Only views that move whole
/// rows keep a computation (a transposed or padded one is refused).
fn computed_rows(
    ckpt: &Checkpoint,
    a: &Assembly,
    inner: &[u64],
    s: &Sizes,
) -> Result<Option<Computed>> {
    let of = |p: &Placement| ckpt.tensors[p.hf].pieces.computed();
    if a.placements.iter().all(|p| of(p).is_none()) {
        return Ok(None);
    }
    let name = &ckpt.tensors[a.placements[0].hf].name;
    let refuse = |why: &str| {
        Err(Error::usage(format!(
            "`{}` is computed (dequantized) as it is copied, which {why}",
            a.name
        ))
        .tensor(name))
    };
    if a.placements.iter().any(|p| of(p).is_none()) {
        return refuse("its other parts are not");
    }
    if inner.len() != 2 {
        return refuse("ckpt does for 2-D weights only");
    }
    let mut runs = Vec::new();
    for (k, p) in a.placements.iter().enumerate() {
        let rows = inner[0];
        let placed: Vec<(u64, u64, u64)> = match p.view {
            ViewKind::Transpose | ViewKind::TrimVocab => {
                return refuse(&format!("the view `{}` does not keep", p.view.describe()))
            }
            ViewKind::RopeQuery | ViewKind::RopeKv => {
                let heads = match p.view {
                    ViewKind::RopeQuery => s.heads,
                    _ => s.kv_heads,
                };
                rope_rows(rows, heads)?
            }
            _ => {
                let mut at = 0;
                p.view
                    .source_runs(rows, s)
                    .map_err(Error::usage)?
                    .into_iter()
                    .map(|(start, len)| {
                        let run = (at, start, len);
                        at += len;
                        run
                    })
                    .collect()
            }
        };
        for (from, to, len) in placed {
            runs.push(RowRun {
                stack: p.stacked.clone(),
                rows: to..to + len,
                source_row: from,
                part: k,
            });
        }
    }
    let parts = a
        .placements
        .iter()
        .filter_map(|p| of(p).cloned())
        .collect::<Vec<_>>();
    let out = parts[0].0.out_dtype();
    Ok(Some(Computed(Arc::new(ViewedRows {
        runs,
        parts,
        stack: a.stack.clone(),
        out,
    }))))
}

/// A run of a trainer tensor's rows that is rows `source_row..` of part `part`.
struct RowRun {
    /// The stack axes' indices the run is at.
    stack: Vec<u64>,
    rows: std::ops::Range<u64>,
    source_row: u64,
    part: usize,
}

/// The computation of a trainer tensor whose rows are runs of computed Hugging Face tensors'.
struct ViewedRows {
    runs: Vec<RowRun>,
    parts: Vec<Computed>,
    /// The sizes of the tensor's leading stack axes before its rows.
    stack: Vec<u64>,
    out: Option<crate::dtype::DType>,
}

impl Compute for ViewedRows {
    fn compute(
        &self,
        start: &[u64],
        sizes: &[u64],
        src: &[u8],
        dst: &mut [u8],
        dst_dtype: crate::dtype::DType,
    ) -> Result<()> {
        let n = self.stack.len();
        let (lead_start, lead_sizes) = (&start[..n], &sizes[..n]);
        let (&[r0, c0], &[nr, nc]) = (&start[n..], &sizes[n..]) else {
            return Err(Error::bug("a dequantized view's box is not 2-D"));
        };
        let (se, de) = (src.len() as u64, dst.len() as u64);
        let boxes: u64 = lead_sizes.iter().product();
        let (src_row, dst_row) = (se / (boxes * nr).max(1), de / (boxes * nr).max(1));
        let mut covered = 0;
        for b in 0..boxes {
            // The stack indices of box `b`, row-major over the leading axes.
            let mut at = vec![0u64; n];
            let mut rest = b;
            for d in (0..n).rev() {
                at[d] = lead_start[d] + rest % lead_sizes[d];
                rest /= lead_sizes[d];
            }
            for run in self.runs.iter().filter(|r| r.stack == at) {
                let (lo, hi) = (run.rows.start.max(r0), run.rows.end.min(r0 + nr));
                if lo >= hi {
                    continue;
                }
                let first = b * nr + (lo - r0);
                let n = hi - lo;
                let s = &src[(first * src_row) as usize..((first + n) * src_row) as usize];
                let d = &mut dst[(first * dst_row) as usize..((first + n) * dst_row) as usize];
                let at = [run.source_row + (lo - run.rows.start), c0];
                self.parts[run.part]
                    .0
                    .compute(&at, &[n, nc], s, d, dst_dtype)?;
                covered += n;
            }
        }
        if covered != boxes * nr {
            return Err(Error::bug(format!(
                "{covered} of {} rows of a dequantized view were computed",
                boxes * nr
            )));
        }
        Ok(())
    }

    fn out_dtype(&self) -> Option<crate::dtype::DType> {
        self.out
    }
}

/// A piece of `source`'s file at byte `at`, put at `offsets` (behind the stack indices, if any).
fn push(
    out: &mut Pieces,
    stacked: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    source: crate::model::PieceRef<'_>,
    at: u64,
    strides: &[u64],
) -> Result<()> {
    let step = crate::model::numel(sizes).unwrap_or(1).max(1);
    let mut o = stacked.to_vec();
    o.extend_from_slice(offsets);
    let mut z = vec![1; stacked.len()];
    z.extend_from_slice(sizes);
    let mut st = vec![step; stacked.len()];
    st.extend_from_slice(strides);
    out.push_parts(
        &o,
        &z,
        Arc::clone(source.file()),
        at,
        &st,
        source.encoding(),
    )
}

/// The zero rows of a padded vocabulary: rows `vocab..` of a tensor whose stack entries are
/// `inner`, as pieces that read nothing (they name `t`'s first file, never opened for them).
fn pad_rows(out: &mut Pieces, t: &Tensor, inner: &[u64], vocab: u64) -> Result<()> {
    let rows = inner.first().copied().unwrap_or(0);
    if rows <= vocab {
        return Ok(());
    }
    let Some(first) = t.pieces.iter().next() else {
        return Ok(());
    };
    let mut offsets = vec![0; inner.len()];
    let mut sizes = inner.to_vec();
    offsets[0] = vocab;
    sizes[0] = rows - vocab;
    let strides = crate::model::contiguous_strides(&sizes);
    out.push_parts(
        &offsets,
        &sizes,
        Arc::clone(first.file()),
        0,
        &strides,
        Encoding::Zeros,
    )
}

/// (row of the Hugging Face tensor, row of torchtitan's, 1) for every row of a RoPE-permuted
/// weight of `rows` rows over `heads` heads: the export's `HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i
/// + j]` the other way.
fn rope_rows(rows: u64, heads: u64) -> Result<Vec<(u64, u64, u64)>> {
    if heads == 0 || rows % heads != 0 || (rows / heads) % 2 != 0 {
        return Err(Error::usage(format!(
            "its {rows} rows are not {heads} heads of an even number of rows each"
        )));
    }
    let hd = rows / heads;
    let half = hd / 2;
    Ok((0..rows)
        .map(|r| {
            let (h, rem) = (r / hd, r % hd);
            let (j, i) = (rem / half, rem % half);
            (r, h * hd + 2 * i + j, 1)
        })
        .collect())
}

/// What megatron-core's `GPTModel.sharded_state_dict()` saves beside each linear's weights: its
/// `_extra_state` (FP8 metadata under Transformer Engine, `None` otherwise), one ShardedObject
/// per entry of the weight's stack axes: `<module>._extra_state/shard_<l>_<L>` of a
/// layer-stacked linear, `shard_<l>.<e>_<L>.<E>` of layer- and expert-stacked experts,
/// `shard_0_1` of one layer's. `dist_checkpointing.load` asks for them, so an import writes them
/// empty: as megatron-core's own save does, each object is a one-item list (`[None]`), which its
/// load unpacks by length.
fn megatron_extra_states(assemblies: &[Assembly]) -> Vec<NonTensor> {
    const LINEARS: [&str; 10] = [
        "linear_proj",
        "linear_qkv",
        "linear_fc1",
        "linear_fc2",
        "linear_q_proj",
        "linear_q_down_proj",
        "linear_q_up_proj",
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "eh_proj",
    ];
    let mut out = Vec::new();
    for a in assemblies {
        let Some(module) = a.name.strip_suffix(".weight") else {
            continue;
        };
        if !LINEARS.iter().any(|l| module.ends_with(&format!(".{l}"))) {
            continue;
        }
        let (stack, counts) = match a.stack.is_empty() {
            true => (vec![vec![0]], vec![1]),
            false => {
                let mut combos: Vec<Vec<u64>> = vec![Vec::new()];
                for &n in &a.stack {
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
                (combos, a.stack.clone())
            }
        };
        let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
        for at in stack {
            out.push(NonTensor {
                name: format!(
                    "{module}._extra_state/shard_{}_{}",
                    join(&at),
                    join(&counts)
                ),
                key_path: Vec::new(),
                value: Some(Value::List(vec![Value::None])),
                raw: None,
            });
        }
    }
    out
}
