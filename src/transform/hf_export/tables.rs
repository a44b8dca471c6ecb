//! The name maps, as data: for each Hugging Face architecture the parameters its model holds
//! (in `state_dict` order, with the shape the config gives each), and for each source naming a
//! table of rows (source pattern, Hugging Face pattern, view). Adding an architecture is a
//! parameter list, a table per naming and a test; the code in `mod.rs` knows no model.
//!
//! Patterns are names with `{L}` for a layer index and `{E}` for an expert index. The tables
//! themselves are in `archs.rs`.

pub(crate) use super::archs::ARCHS;
use super::views::ViewKind;

/// One row of a name map.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub source: &'static str,
    pub target: &'static str,
    pub view: ViewKind,
}

impl Row {
    /// Whether the row places a multi-token prediction layer's tensor (`{M}` in its source, or
    /// an MTP layer's copy of the embedding or head).
    pub(crate) fn is_mtp(&self) -> bool {
        self.source.contains("{M}") || self.target.contains(MTP)
    }
}

pub(super) const fn row(source: &'static str, target: &'static str, view: ViewKind) -> Row {
    Row {
        source,
        target,
        view,
    }
}

/// How a checkpoint names its model's tensors, as recognised from the names themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Naming {
    /// transformers' own names (accelerate, TRL, veRL's FSDP), under any app-state prefix.
    HuggingFace,
    /// torchtitan 0.3: `attention.qkv_linear.wq`, `lm_head`.
    Torchtitan,
    /// torchtitan 0.2: `attention.wq`, `output`.
    Torchtitan02,
    /// Megatron-core's `GPTModel` (Megatron-LM, NeMo): decoder weights stacked over layers,
    /// fused QKV and `[gate; up]`, norms named after the linears they precede.
    Megatron,
}

impl Naming {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Naming::HuggingFace => "hugging-face",
            Naming::Torchtitan => "torchtitan",
            Naming::Torchtitan02 => "torchtitan-0.2",
            Naming::Megatron => "megatron-core",
        }
    }
}

/// A dimension of a Hugging Face parameter, as the config gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dim {
    /// `vocab_size`
    Vocab,
    /// `hidden_size`
    Hidden,
    /// `num_attention_heads × head_dim`
    QueryRows,
    /// `num_key_value_heads × head_dim`
    KvRows,
    /// `head_dim`
    HeadSize,
    /// `intermediate_size`
    Inter,
    /// the number of routed experts: `n_routed_experts`, `num_experts` or `num_local_experts`
    Experts,
    /// `num_attention_heads` (gpt-oss's attention sinks, one per head)
    Heads,
    /// `2 × intermediate_size` (gpt-oss's fused gate and up projections)
    TwoInter,
    /// `2 × hidden_size` (a multi-token prediction layer's projection of two hidden states)
    TwoHidden,
    /// `moe_intermediate_size`
    MoeInter,
    /// `moe_intermediate_size × n_shared_experts`
    SharedInter,
    /// `num_attention_heads × (qk_nope_head_dim + qk_rope_head_dim)`
    QkRows,
    /// `q_lora_rank`
    QLoraRank,
    /// `kv_lora_rank + qk_rope_head_dim`
    KvARows,
    /// `kv_lora_rank`
    KvLoraRank,
    /// `num_attention_heads × (qk_nope_head_dim + v_head_dim)`
    KvBRows,
    /// `num_attention_heads × v_head_dim`
    VRows,
}

/// When the config has a parameter in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum When {
    Always,
    /// `attention_bias` is true.
    AttentionBias,
    /// `mlp_bias` is true.
    MlpBias,
    /// `tie_word_embeddings` is false.
    Untied,
    /// The layer is dense, by the architecture's [`MoeLayers`] rule (below
    /// `first_k_dense_replace`, in `mlp_only_layers`).
    DenseLayer,
    /// The layer is a mixture of experts, by the architecture's [`MoeLayers`] rule.
    MoeLayer,
    /// As [`When::MoeLayer`], but the model starts from zeros where the checkpoint has none
    /// (torchtitan saves no expert bias without load balancing).
    MoeLayerIfSaved,
    /// `q_lora_rank` is set: queries through a low-rank projection.
    QLora,
    /// `q_lora_rank` is null.
    NoQLora,
    /// The layer is a multi-token prediction layer (`num_nextn_predict_layers` of them after the
    /// decoder's).
    MtpLayer,
    /// `use_qk_norm` is true (GLM-4.5's per-head q/k norms).
    QkNorm,
}

impl When {
    /// What in config.json leaves such a parameter out, for messages.
    pub(crate) fn absent_because(self) -> &'static str {
        match self {
            When::Always => "",
            When::AttentionBias => "`attention_bias` is false",
            When::MlpBias => "`mlp_bias` is false",
            When::Untied => "`tie_word_embeddings` is true",
            When::DenseLayer => {
                "the layer is a mixture of experts (`first_k_dense_replace`, `mlp_only_layers`, `decoder_sparse_step`)"
            }
            When::MoeLayer | When::MoeLayerIfSaved => {
                "the layer is dense (`first_k_dense_replace`, `mlp_only_layers`, `decoder_sparse_step`)"
            }
            When::QLora => "`q_lora_rank` is null",
            When::NoQLora => "`q_lora_rank` is set",
            When::MtpLayer => "the layer is not a multi-token prediction layer",
            When::QkNorm => "`use_qk_norm` is false",
        }
    }
}

/// A parameter of a Hugging Face model: its name pattern, shape and presence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Param {
    pub name: &'static str,
    pub shape: &'static [Dim],
    pub when: When,
    /// The weight of a linear layer of attention, an MLP or an expert: what `--quantize
    /// fp8-block` quantizes (embeddings, the head, norms, biases and routers are not).
    pub linear: bool,
}

pub(super) const fn param(name: &'static str, shape: &'static [Dim], when: When) -> Param {
    Param {
        name,
        shape,
        when,
        linear: false,
    }
}

/// A [`Param`] that is a linear layer's weight.
pub(super) const fn linear(name: &'static str, shape: &'static [Dim], when: When) -> Param {
    Param {
        name,
        shape,
        when,
        linear: true,
    }
}

/// Which layers of an architecture are mixtures of experts, as its transformers model decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MoeLayers {
    /// None: a dense model.
    None,
    /// Every layer (Mixtral, gpt-oss).
    All,
    /// Those from `first_k_dense_replace` on (DeepSeek-V3, GLM-4.5).
    AfterFirstDense,
    /// Every `decoder_sparse_step`-th layer not in `mlp_only_layers` (Qwen3-MoE).
    SparseStep,
}

/// A Hugging Face architecture (`architectures[0]` of config.json) and its name maps.
#[derive(Debug)]
pub(crate) struct Arch {
    pub name: &'static str,
    /// config.json's `model_type` of the architecture, which names it where `architectures`
    /// is missing (a config saved on its own, not with a model).
    pub model_type: &'static str,
    /// `tie_word_embeddings` when config.json does not say.
    pub tied_by_default: bool,
    /// Parameters in the model's `state_dict` order; `{L}` once per layer.
    pub params: &'static [Param],
    /// Rows for names transformers holds in memory but saves otherwise (so that an app state
    /// saved by accelerate differs from `save_pretrained`'s), beside the identity rows.
    pub hf_in_memory: &'static [Row],
    /// The rows for torchtitan 0.3 and 0.2 names (Hugging Face names map to themselves).
    pub torchtitan: Option<&'static [Row]>,
    pub torchtitan02: Option<&'static [Row]>,
    /// The rows for Megatron-core's names, in groups (attention, MLP, experts...) shared
    /// between architectures.
    pub megatron: Option<&'static [&'static [Row]]>,
    /// Top-level names of the source's that the architecture has no place for and that are
    /// left out (torchtitan's multi-token prediction layers, which transformers does not load).
    pub extra_modules: &'static [&'static str],
    /// Source tensors (patterns of any naming) the architecture has no place for, left out
    /// with why: what the user is told in the export's note and `inspect --hf-config`.
    pub no_place: &'static [(&'static str, &'static str)],
    /// Which layers are mixtures of experts.
    pub moe_layers: MoeLayers,
    /// config.json's flags the tables are written for, with the value they take when absent:
    /// another value is refused, since the rows would place the tensors of another model.
    pub assumed_flags: &'static [(&'static str, bool)],
}

impl Arch {
    /// The rows mapping `naming` to this architecture, or `None` where there is no such map.
    pub(crate) fn rows(&self, naming: Naming) -> Option<Vec<Row>> {
        match naming {
            // Every parameter under its own name: a table of identity rows.
            Naming::HuggingFace => Some(
                self.params
                    .iter()
                    .map(|p| row(p.name, p.name, ViewKind::Rename))
                    .chain(self.hf_in_memory.iter().copied())
                    .collect(),
            ),
            Naming::Torchtitan => self.torchtitan.map(<[Row]>::to_vec),
            Naming::Torchtitan02 => self.torchtitan02.map(<[Row]>::to_vec),
            Naming::Megatron => self.megatron.map(<[&[Row]]>::concat),
        }
    }
}

/// The architecture called `name`.
pub(crate) fn arch(name: &str) -> Option<&'static Arch> {
    ARCHS.iter().find(|a| a.name == name)
}

/// The Hugging Face names of the token embedding and the output head, which tied models share.
pub(crate) const EMBEDDING: &str = "model.embed_tokens.weight";
pub(crate) const LM_HEAD: &str = "lm_head.weight";

/// torchtitan's load-balancing routing bias of a MoE layer (`load_balance_coeff`): a buffer of
/// the trainer's that most architectures have no place for.
pub(crate) const TT_ROUTING_BIAS: &str = "layers.{L}.moe.expert_bias_E";

/// The placeholder of a Megatron multi-token prediction layer's index in a source pattern
/// (`mtp.layers.{M}.enorm.weight`): the Hugging Face model numbers it after the decoder's
/// layers, `{L}` = `num_hidden_layers + M`.
pub(crate) const MTP_INDEX: char = 'M';

/// A target placeholder for every multi-token prediction layer of the Hugging Face model, for a
/// source that has no index of its own (the embedding and head each MTP layer holds a copy of).
pub(crate) const MTP: &str = "{MTP}";

/// The placeholders of `row`'s target that its source lacks (`L` of a layer-stacked source, `E`
/// of an expert-stacked one, both of Megatron's layer- and expert-stacked experts): the
/// source's leading axes, outermost first, one target per index.
pub(crate) fn unstacked(row: &Row) -> Vec<char> {
    ['L', 'E']
        .into_iter()
        .filter(|c| {
            let hole = format!("{{{c}}}");
            // An MTP layer's `{L}` comes from its `{M}`.
            let mtp = *c == 'L' && row.source.contains(&format!("{{{MTP_INDEX}}}"));
            row.target.contains(&hole) && !row.source.contains(&hole) && !mtp
        })
        .collect()
}

/// `name` matched against `pattern`: the `{L}`/`{E}` indices it holds, in order, or `None`.
pub(crate) fn match_pattern(pattern: &str, name: &str) -> Option<Vec<(char, u64)>> {
    let mut found = Vec::new();
    let mut rest = name;
    let mut pat = pattern;
    loop {
        match pat.find('{') {
            None => return (rest == pat).then_some(found),
            Some(at) => {
                let literal = &pat[..at];
                rest = rest.strip_prefix(literal)?;
                let close = pat[at..].find('}')? + at;
                let which = pat[at + 1..close].chars().next()?;
                let digits =
                    rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
                if digits == 0 || (digits > 1 && rest.starts_with('0')) {
                    return None;
                }
                found.push((which, rest[..digits].parse().ok()?));
                rest = &rest[digits..];
                pat = &pat[close + 1..];
            }
        }
    }
}

/// `pattern` with its `{L}`/`{E}` filled from `indices` (a placeholder with no index stays).
pub(crate) fn fill(pattern: &str, indices: &[(char, u64)]) -> String {
    let mut out = pattern.to_string();
    for (which, i) in indices {
        out = out.replacen(&format!("{{{which}}}"), &i.to_string(), 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::When::*;
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn patterns_match_and_fill() {
        let p = "layers.{L}.attention.wq.weight";
        assert_eq!(
            match_pattern(p, "layers.12.attention.wq.weight"),
            Some(vec![('L', 12)])
        );
        assert_eq!(match_pattern(p, "layers.x.attention.wq.weight"), None);
        assert_eq!(match_pattern(p, "layers.01.attention.wq.weight"), None);
        assert_eq!(match_pattern(p, "layers.1.attention.wq.weight.x"), None);
        assert_eq!(match_pattern("norm.weight", "norm.weight"), Some(vec![]));
        assert_eq!(match_pattern("norm.weight", "model.norm.weight"), None);
        assert_eq!(fill("a.{L}.b.{E}", &[('L', 3), ('E', 7)]), "a.3.b.7");
    }

    /// Each source table maps onto its architecture's parameters one to one: no two rows give
    /// one name (but a saved and an in-memory Hugging Face name, and Megatron's several saved
    /// forms of one tensor), every parameter comes from a row, and every row's patterns have the
    /// same placeholders.
    #[test]
    fn tables_place_every_parameter_once() {
        for arch in ARCHS {
            let params: BTreeSet<&str> = arch.params.iter().map(|p| p.name).collect();
            assert_eq!(params.len(), arch.params.len(), "{}", arch.name);
            for naming in [
                Naming::HuggingFace,
                Naming::Torchtitan,
                Naming::Torchtitan02,
                Naming::Megatron,
            ] {
                let Some(rows) = arch.rows(naming) else {
                    continue;
                };
                // An MTP layer's copies of the embedding and head are its layer's parameters.
                let targets: Vec<String> =
                    rows.iter().map(|r| r.target.replace(MTP, "{L}")).collect();
                let unique: BTreeSet<&str> = targets.iter().map(String::as_str).collect();
                match naming {
                    Naming::Megatron => megatron_rows_come_in_every_form(&rows),
                    // transformers' in-memory names beside the saved ones.
                    _ => assert_eq!(
                        unique.len()
                            + arch.hf_in_memory.len() * (naming == Naming::HuggingFace) as usize,
                        targets.len(),
                        "{} {naming:?}",
                        arch.name
                    ),
                }
                for t in &targets {
                    assert!(params.contains(t.as_str()), "{} {naming:?}: {t}", arch.name);
                }
                // A source in several rows only for parts of it (or for the copies of it an
                // MTP layer holds).
                let sources: BTreeSet<(&str, String, bool)> = rows
                    .iter()
                    .map(|r| (r.source, format!("{:?}", r.view), r.target.contains(MTP)))
                    .collect();
                assert_eq!(sources.len(), rows.len(), "{} {naming:?}", arch.name);
                for r in &rows {
                    // The target has the source's placeholders; an MTP layer's `{M}` is its `{L}`.
                    let holes = |s: &str| ['L', 'E'].map(|c| s.contains(&format!("{{{c}}}")));
                    let (mut src, dst) = (holes(r.source), holes(&r.target.replace(MTP, "{L}")));
                    src[0] |= r.source.contains("{M}");
                    assert!(src.iter().zip(&dst).all(|(s, d)| !s || *d), "{r:?}");
                }
                // torchtitan has no biases and no MTP layers: every parameter but those needs a
                // row.
                let mtp = rows.iter().any(Row::is_mtp);
                for p in arch.params {
                    let optional = matches!(p.when, AttentionBias | MlpBias)
                        || (p.when == MtpLayer && !mtp && naming != Naming::HuggingFace);
                    if !optional {
                        assert!(
                            unique.contains(p.name),
                            "{} {naming:?}: {}",
                            arch.name,
                            p.name
                        );
                    }
                }
            }
        }
    }

    /// A Megatron decoder-layer row comes layer-stacked, per layer and in an MTP layer, alike.
    fn megatron_rows_come_in_every_form(rows: &[Row]) {
        let has = |source: String, r: &Row| {
            rows.iter()
                .any(|o| o.source == source && o.target == r.target && o.view == r.view)
        };
        for r in rows {
            if let Some(rest) = r.source.strip_prefix("decoder.layers.{L}.") {
                assert!(has(format!("decoder.layers.{rest}"), r), "{r:?}");
                assert!(
                    has(format!("mtp.layers.{{M}}.transformer_layer.{rest}"), r),
                    "{r:?}"
                );
            }
        }
    }
}
