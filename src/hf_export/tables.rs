//! The name maps, as data: for each Hugging Face architecture the parameters its model holds
//! (in `state_dict` order, with the shape the config gives each), and for each source naming a
//! table of rows (source pattern, Hugging Face pattern, view). Adding an architecture is a
//! parameter list, a table per naming and a test; the code in `mod.rs` knows no model.
//!
//! Patterns are names with `{L}` for a layer index and `{E}` for an expert index.

use super::views::ViewKind;

/// One row of a name map.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub source: &'static str,
    pub target: &'static str,
    pub view: ViewKind,
}

const fn row(source: &'static str, target: &'static str, view: ViewKind) -> Row {
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
    /// `n_routed_experts`
    Experts,
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
    /// The layer is dense: its index is below `first_k_dense_replace`.
    DenseLayer,
    /// The layer is a mixture of experts: its index is `first_k_dense_replace` or above.
    MoeLayer,
    /// As [`When::MoeLayer`], but the model starts from zeros where the checkpoint has none
    /// (torchtitan saves no expert bias without load balancing).
    MoeLayerIfSaved,
    /// `q_lora_rank` is set: queries through a low-rank projection.
    QLora,
    /// `q_lora_rank` is null.
    NoQLora,
}

impl When {
    /// What in config.json leaves such a parameter out, for messages.
    pub(crate) fn absent_because(self) -> &'static str {
        match self {
            When::Always => "",
            When::AttentionBias => "`attention_bias` is false",
            When::MlpBias => "`mlp_bias` is false",
            When::Untied => "`tie_word_embeddings` is true",
            When::DenseLayer => "the layer is at or past `first_k_dense_replace`",
            When::MoeLayer | When::MoeLayerIfSaved => "the layer is before `first_k_dense_replace`",
            When::QLora => "`q_lora_rank` is null",
            When::NoQLora => "`q_lora_rank` is set",
        }
    }
}

/// A parameter of a Hugging Face model: its name pattern, shape and presence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Param {
    pub name: &'static str,
    pub shape: &'static [Dim],
    pub when: When,
}

const fn param(name: &'static str, shape: &'static [Dim], when: When) -> Param {
    Param { name, shape, when }
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
    /// The rows for Megatron-core's names.
    pub megatron: Option<&'static [Row]>,
    /// Top-level names of the source's that the architecture has no place for and that are
    /// left out (torchtitan's multi-token prediction layers, which transformers does not load).
    pub extra_modules: &'static [&'static str],
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
            Naming::Megatron => self.megatron.map(<[Row]>::to_vec),
        }
    }
}

use super::views::QkvPart;
use Dim::*;
use ViewKind::{Qkv, Rename, RopeKv, RopeQuery, Split, TrimVocab};
use When::*;

const EMBED: Param = param("model.embed_tokens.weight", &[Vocab, Hidden], Always);
const NORM: Param = param("model.norm.weight", &[Hidden], Always);
const LM_HEAD: Param = param("lm_head.weight", &[Vocab, Hidden], Untied);
const Q: Param = param(
    "model.layers.{L}.self_attn.q_proj.weight",
    &[QueryRows, Hidden],
    Always,
);
const K: Param = param(
    "model.layers.{L}.self_attn.k_proj.weight",
    &[KvRows, Hidden],
    Always,
);
const V: Param = param(
    "model.layers.{L}.self_attn.v_proj.weight",
    &[KvRows, Hidden],
    Always,
);
const O: Param = param(
    "model.layers.{L}.self_attn.o_proj.weight",
    &[Hidden, QueryRows],
    Always,
);
const GATE: Param = param(
    "model.layers.{L}.mlp.gate_proj.weight",
    &[Inter, Hidden],
    Always,
);
const UP: Param = param(
    "model.layers.{L}.mlp.up_proj.weight",
    &[Inter, Hidden],
    Always,
);
const DOWN: Param = param(
    "model.layers.{L}.mlp.down_proj.weight",
    &[Hidden, Inter],
    Always,
);
const IN_NORM: Param = param("model.layers.{L}.input_layernorm.weight", &[Hidden], Always);
const POST_NORM: Param = param(
    "model.layers.{L}.post_attention_layernorm.weight",
    &[Hidden],
    Always,
);
const Q_NORM: Param = param(
    "model.layers.{L}.self_attn.q_norm.weight",
    &[HeadSize],
    Always,
);
const K_NORM: Param = param(
    "model.layers.{L}.self_attn.k_norm.weight",
    &[HeadSize],
    Always,
);

/// transformers' `LlamaForCausalLM`: `attention_bias` adds q/k/v/o biases, `mlp_bias` the MLP's.
const LLAMA_PARAMS: &[Param] = &[
    EMBED,
    Q,
    param(
        "model.layers.{L}.self_attn.q_proj.bias",
        &[QueryRows],
        AttentionBias,
    ),
    K,
    param(
        "model.layers.{L}.self_attn.k_proj.bias",
        &[KvRows],
        AttentionBias,
    ),
    V,
    param(
        "model.layers.{L}.self_attn.v_proj.bias",
        &[KvRows],
        AttentionBias,
    ),
    O,
    param(
        "model.layers.{L}.self_attn.o_proj.bias",
        &[Hidden],
        AttentionBias,
    ),
    GATE,
    param("model.layers.{L}.mlp.gate_proj.bias", &[Inter], MlpBias),
    UP,
    param("model.layers.{L}.mlp.up_proj.bias", &[Inter], MlpBias),
    DOWN,
    param("model.layers.{L}.mlp.down_proj.bias", &[Hidden], MlpBias),
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// transformers' `Qwen2ForCausalLM`: q/k/v always have a bias, o never.
const QWEN2_PARAMS: &[Param] = &[
    EMBED,
    Q,
    param(
        "model.layers.{L}.self_attn.q_proj.bias",
        &[QueryRows],
        Always,
    ),
    K,
    param("model.layers.{L}.self_attn.k_proj.bias", &[KvRows], Always),
    V,
    param("model.layers.{L}.self_attn.v_proj.bias", &[KvRows], Always),
    O,
    GATE,
    UP,
    DOWN,
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// transformers' `Qwen3ForCausalLM`: RMS norms over each head's queries and keys.
const QWEN3_PARAMS: &[Param] = &[
    EMBED,
    Q,
    param(
        "model.layers.{L}.self_attn.q_proj.bias",
        &[QueryRows],
        AttentionBias,
    ),
    K,
    param(
        "model.layers.{L}.self_attn.k_proj.bias",
        &[KvRows],
        AttentionBias,
    ),
    V,
    param(
        "model.layers.{L}.self_attn.v_proj.bias",
        &[KvRows],
        AttentionBias,
    ),
    O,
    param(
        "model.layers.{L}.self_attn.o_proj.bias",
        &[Hidden],
        AttentionBias,
    ),
    Q_NORM,
    K_NORM,
    GATE,
    UP,
    DOWN,
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// torchtitan 0.3's Llama 3 (`Llama3StateDictAdapter`): its rotary embedding is complex
/// (interleaved pairs), so wq and wk rows are permuted to transformers' half-split order.
const TT_LLAMA: &[Row] = &[
    row("tok_embeddings.weight", EMBED.name, Rename),
    row(
        "layers.{L}.attention.qkv_linear.wq.weight",
        Q.name,
        RopeQuery,
    ),
    row("layers.{L}.attention.qkv_linear.wk.weight", K.name, RopeKv),
    row("layers.{L}.attention.qkv_linear.wv.weight", V.name, Rename),
    row("layers.{L}.attention.wo.weight", O.name, Rename),
    row("layers.{L}.feed_forward.w1.weight", GATE.name, Rename),
    row("layers.{L}.feed_forward.w3.weight", UP.name, Rename),
    row("layers.{L}.feed_forward.w2.weight", DOWN.name, Rename),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("lm_head.weight", LM_HEAD.name, Rename),
];

/// torchtitan 0.2's Llama 3: the same model, wq/wk/wv directly under `attention`, the output
/// projection called `output`.
const TT02_LLAMA: &[Row] = &[
    row("tok_embeddings.weight", EMBED.name, Rename),
    row("layers.{L}.attention.wq.weight", Q.name, RopeQuery),
    row("layers.{L}.attention.wk.weight", K.name, RopeKv),
    row("layers.{L}.attention.wv.weight", V.name, Rename),
    row("layers.{L}.attention.wo.weight", O.name, Rename),
    row("layers.{L}.feed_forward.w1.weight", GATE.name, Rename),
    row("layers.{L}.feed_forward.w3.weight", UP.name, Rename),
    row("layers.{L}.feed_forward.w2.weight", DOWN.name, Rename),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("output.weight", LM_HEAD.name, Rename),
];

/// torchtitan 0.3's dense Qwen3 (`Qwen3StateDictAdapter`): its rotary embedding is cos/sin over
/// half-split rows as transformers', so no row moves.
const TT_QWEN3: &[Row] = &[
    row("tok_embeddings.weight", EMBED.name, Rename),
    row("layers.{L}.attention.qkv_linear.wq.weight", Q.name, Rename),
    row("layers.{L}.attention.qkv_linear.wk.weight", K.name, Rename),
    row("layers.{L}.attention.qkv_linear.wv.weight", V.name, Rename),
    row("layers.{L}.attention.wo.weight", O.name, Rename),
    row("layers.{L}.attention.q_norm.weight", Q_NORM.name, Rename),
    row("layers.{L}.attention.k_norm.weight", K_NORM.name, Rename),
    row("layers.{L}.feed_forward.w1.weight", GATE.name, Rename),
    row("layers.{L}.feed_forward.w3.weight", UP.name, Rename),
    row("layers.{L}.feed_forward.w2.weight", DOWN.name, Rename),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("lm_head.weight", LM_HEAD.name, Rename),
];

/// torchtitan 0.2's dense Qwen3.
const TT02_QWEN3: &[Row] = &[
    row("tok_embeddings.weight", EMBED.name, Rename),
    row("layers.{L}.attention.wq.weight", Q.name, Rename),
    row("layers.{L}.attention.wk.weight", K.name, Rename),
    row("layers.{L}.attention.wv.weight", V.name, Rename),
    row("layers.{L}.attention.wo.weight", O.name, Rename),
    row("layers.{L}.attention.q_norm.weight", Q_NORM.name, Rename),
    row("layers.{L}.attention.k_norm.weight", K_NORM.name, Rename),
    row("layers.{L}.feed_forward.w1.weight", GATE.name, Rename),
    row("layers.{L}.feed_forward.w3.weight", UP.name, Rename),
    row("layers.{L}.feed_forward.w2.weight", DOWN.name, Rename),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("output.weight", LM_HEAD.name, Rename),
];

/// transformers' `DeepseekV3ForCausalLM`: multi-head latent attention (queries through a
/// low-rank projection when `q_lora_rank` is set), dense MLPs in the first
/// `first_k_dense_replace` layers, routed experts (one name per expert), a router with its
/// score-correction bias and shared experts in the others.
const DEEPSEEK_V3_PARAMS: &[Param] = &[
    EMBED,
    param(
        "model.layers.{L}.self_attn.q_proj.weight",
        &[QkRows, Hidden],
        NoQLora,
    ),
    param(
        "model.layers.{L}.self_attn.q_a_proj.weight",
        &[QLoraRank, Hidden],
        QLora,
    ),
    param(
        "model.layers.{L}.self_attn.q_a_layernorm.weight",
        &[QLoraRank],
        QLora,
    ),
    param(
        "model.layers.{L}.self_attn.q_b_proj.weight",
        &[QkRows, QLoraRank],
        QLora,
    ),
    param(
        "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        &[KvARows, Hidden],
        Always,
    ),
    param(
        "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        &[KvLoraRank],
        Always,
    ),
    param(
        "model.layers.{L}.self_attn.kv_b_proj.weight",
        &[KvBRows, KvLoraRank],
        Always,
    ),
    param(
        "model.layers.{L}.self_attn.o_proj.weight",
        &[Hidden, VRows],
        Always,
    ),
    param(GATE.name, &[Inter, Hidden], DenseLayer),
    param(UP.name, &[Inter, Hidden], DenseLayer),
    param(DOWN.name, &[Hidden, Inter], DenseLayer),
    param(
        "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
        &[MoeInter, Hidden],
        MoeLayer,
    ),
    param(
        "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        &[MoeInter, Hidden],
        MoeLayer,
    ),
    param(
        "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
        &[Hidden, MoeInter],
        MoeLayer,
    ),
    param(
        "model.layers.{L}.mlp.gate.weight",
        &[Experts, Hidden],
        MoeLayer,
    ),
    param(
        "model.layers.{L}.mlp.gate.e_score_correction_bias",
        &[Experts],
        MoeLayerIfSaved,
    ),
    param(
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        &[SharedInter, Hidden],
        MoeLayer,
    ),
    param(
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        &[SharedInter, Hidden],
        MoeLayer,
    ),
    param(
        "model.layers.{L}.mlp.shared_experts.down_proj.weight",
        &[Hidden, SharedInter],
        MoeLayer,
    ),
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// transformers 5 holds the routed experts fused (`experts.gate_up_proj` `[E, 2F, D]`, each
/// expert's gate rows then its up rows; `experts.down_proj` `[E, D, F]`) and saves one tensor per
/// expert: an accelerate or FSDP2 checkpoint has the fused names.
const HF_DEEPSEEK_V3_FUSED: &[Row] = &[
    row(
        "model.layers.{L}.mlp.experts.gate_up_proj",
        "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
        Split { part: 0, of: 2 },
    ),
    row(
        "model.layers.{L}.mlp.experts.gate_up_proj",
        "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        Split { part: 1, of: 2 },
    ),
    row(
        "model.layers.{L}.mlp.experts.down_proj",
        "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
        Rename,
    ),
];

/// torchtitan 0.3's DeepSeek-V3 (`DeepSeekV3StateDictAdapter`): transformers' DeepSeek-V3
/// rotates interleaved pairs as torchtitan does (`rope_interleave`), so no row moves; the
/// routed experts are stacked on a leading axis (`w1_EFD` `[E, F, D]`, `w2_EDF` `[E, D, F]`).
const TT_DEEPSEEK_V3: &[Row] = &[
    row("tok_embeddings.weight", EMBED.name, Rename),
    row(
        "layers.{L}.attention.wq.weight",
        "model.layers.{L}.self_attn.q_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.attention.wq_a.weight",
        "model.layers.{L}.self_attn.q_a_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.attention.q_norm.weight",
        "model.layers.{L}.self_attn.q_a_layernorm.weight",
        Rename,
    ),
    row(
        "layers.{L}.attention.wq_b.weight",
        "model.layers.{L}.self_attn.q_b_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.attention.wkv_a.weight",
        "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        Rename,
    ),
    row(
        "layers.{L}.attention.kv_norm.weight",
        "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        Rename,
    ),
    row(
        "layers.{L}.attention.wkv_b.weight",
        "model.layers.{L}.self_attn.kv_b_proj.weight",
        Rename,
    ),
    row("layers.{L}.attention.wo.weight", O.name, Rename),
    row("layers.{L}.feed_forward.w1.weight", GATE.name, Rename),
    row("layers.{L}.feed_forward.w3.weight", UP.name, Rename),
    row("layers.{L}.feed_forward.w2.weight", DOWN.name, Rename),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
        "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
        "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
        "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.router.gate.weight",
        "model.layers.{L}.mlp.gate.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.expert_bias_E",
        "model.layers.{L}.mlp.gate.e_score_correction_bias",
        Rename,
    ),
    row(
        "layers.{L}.moe.shared_experts.w1.weight",
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.shared_experts.w3.weight",
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.shared_experts.w2.weight",
        "model.layers.{L}.mlp.shared_experts.down_proj.weight",
        Rename,
    ),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("lm_head.weight", LM_HEAD.name, Rename),
];

/// The rows every Megatron-core GPT shares (as its `torch_dist` checkpoint names them: each
/// decoder weight stacked over layers, the layer norms under the linears they precede, which the
/// local layer spec saves as Transformer Engine's do). Megatron rotates half-split rows as
/// transformers does: no row moves.
macro_rules! megatron_rows {
    ($($extra:expr),* $(,)?) => {
        &[
            row("embedding.word_embeddings.weight", EMBED.name, TrimVocab),
            row(MG_QKV, Q.name, Qkv(QkvPart::Q)),
            row(MG_QKV, K.name, Qkv(QkvPart::K)),
            row(MG_QKV, V.name, Qkv(QkvPart::V)),
            row("decoder.layers.self_attention.linear_qkv.layer_norm_weight", IN_NORM.name, Rename),
            row("decoder.layers.input_layernorm.weight", IN_NORM.name, Rename),
            row("decoder.layers.self_attention.linear_proj.weight", O.name, Rename),
            row(MG_FC1, GATE.name, Split { part: 0, of: 2 }),
            row(MG_FC1, UP.name, Split { part: 1, of: 2 }),
            row("decoder.layers.mlp.linear_fc1.layer_norm_weight", POST_NORM.name, Rename),
            row("decoder.layers.pre_mlp_layernorm.weight", POST_NORM.name, Rename),
            row("decoder.layers.mlp.linear_fc2.weight", DOWN.name, Rename),
            row("decoder.final_layernorm.weight", NORM.name, Rename),
            row("output_layer.weight", LM_HEAD.name, TrimVocab),
            $($extra,)*
        ]
    };
}

const MG_QKV: &str = "decoder.layers.self_attention.linear_qkv.weight";
const MG_QKV_BIAS: &str = "decoder.layers.self_attention.linear_qkv.bias";
const MG_FC1: &str = "decoder.layers.mlp.linear_fc1.weight";

const MEGATRON_LLAMA: &[Row] = megatron_rows![];

/// Qwen2's q/k/v biases are the fused QKV's bias, interleaved per group as its rows.
const MEGATRON_QWEN2: &[Row] = megatron_rows![
    row(
        MG_QKV_BIAS,
        "model.layers.{L}.self_attn.q_proj.bias",
        Qkv(QkvPart::Q)
    ),
    row(
        MG_QKV_BIAS,
        "model.layers.{L}.self_attn.k_proj.bias",
        Qkv(QkvPart::K)
    ),
    row(
        MG_QKV_BIAS,
        "model.layers.{L}.self_attn.v_proj.bias",
        Qkv(QkvPart::V)
    ),
];

const MEGATRON_QWEN3: &[Row] = megatron_rows![
    row(
        "decoder.layers.self_attention.q_layernorm.weight",
        Q_NORM.name,
        Rename
    ),
    row(
        "decoder.layers.self_attention.k_layernorm.weight",
        K_NORM.name,
        Rename
    ),
];

/// Every architecture ckpt exports to.
pub(crate) const ARCHS: &[Arch] = &[
    Arch {
        name: "LlamaForCausalLM",
        model_type: "llama",
        tied_by_default: false,
        params: LLAMA_PARAMS,
        hf_in_memory: &[],
        torchtitan: Some(TT_LLAMA),
        torchtitan02: Some(TT02_LLAMA),
        megatron: Some(MEGATRON_LLAMA),
        extra_modules: &[],
    },
    Arch {
        // torchtitan has no Qwen2.
        name: "Qwen2ForCausalLM",
        model_type: "qwen2",
        tied_by_default: false,
        params: QWEN2_PARAMS,
        hf_in_memory: &[],
        torchtitan: None,
        torchtitan02: None,
        megatron: Some(MEGATRON_QWEN2),
        extra_modules: &[],
    },
    Arch {
        name: "Qwen3ForCausalLM",
        model_type: "qwen3",
        tied_by_default: false,
        params: QWEN3_PARAMS,
        hf_in_memory: &[],
        torchtitan: Some(TT_QWEN3),
        torchtitan02: Some(TT02_QWEN3),
        megatron: Some(MEGATRON_QWEN3),
        extra_modules: &[],
    },
    Arch {
        name: "DeepseekV3ForCausalLM",
        model_type: "deepseek_v3",
        tied_by_default: false,
        params: DEEPSEEK_V3_PARAMS,
        hf_in_memory: HF_DEEPSEEK_V3_FUSED,
        torchtitan: Some(TT_DEEPSEEK_V3),
        // torchtitan 0.2's and Megatron's DeepSeek-V3 names are not mapped.
        torchtitan02: None,
        megatron: None,
        extra_modules: &["mtp_layers"],
    },
];

/// The architecture called `name`.
pub(crate) fn arch(name: &str) -> Option<&'static Arch> {
    ARCHS.iter().find(|a| a.name == name)
}

/// The placeholder of `row`'s target that its source lacks (`L` of a layer-stacked source, `E`
/// of an expert-stacked one): the source's leading axis, one target per index.
pub(crate) fn unstacked(row: &Row) -> Option<char> {
    ['L', 'E'].into_iter().find(|c| {
        let hole = format!("{{{c}}}");
        row.target.contains(&hole) && !row.source.contains(&hole)
    })
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
    /// one name (but a saved and an in-memory Hugging Face name), every parameter comes from a
    /// row, and every row's patterns have the same placeholders.
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
                let targets: Vec<&str> = rows.iter().map(|r| r.target).collect();
                let unique: BTreeSet<&str> = targets.iter().copied().collect();
                // transformers' in-memory names; Megatron's norms under their own names or the
                // linears'.
                let alternatives = match naming {
                    Naming::HuggingFace => arch.hf_in_memory.len(),
                    Naming::Megatron => 2,
                    _ => 0,
                };
                assert_eq!(
                    unique.len() + alternatives,
                    targets.len(),
                    "{} {naming:?}",
                    arch.name
                );
                for t in &targets {
                    assert!(params.contains(t), "{} {naming:?}: {t}", arch.name);
                }
                // A source in several rows only for parts of it.
                let sources: BTreeSet<(&str, String)> = rows
                    .iter()
                    .map(|r| (r.source, format!("{:?}", r.view)))
                    .collect();
                assert_eq!(sources.len(), rows.len(), "{} {naming:?}", arch.name);
                for r in &rows {
                    // The target has the source's placeholders and at most one more, which
                    // unstacks the source's leading axis.
                    let holes = |s: &str| ['L', 'E'].map(|c| s.contains(&format!("{{{c}}}")));
                    let (src, dst) = (holes(r.source), holes(r.target));
                    assert!(src.iter().zip(&dst).all(|(s, d)| !s || *d), "{r:?}");
                }
                // torchtitan has no biases: every parameter but those needs a row.
                for p in arch.params {
                    if !matches!(p.when, AttentionBias | MlpBias) {
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
}
