//! The name maps themselves: each Hugging Face architecture's parameters and, per source
//! naming, the rows that place a checkpoint's tensors on them (types and matching in
//! `tables.rs`).

use super::tables::{linear, param, row, Arch, Dim, MoeLayers, Param, Row, When};
use super::views::QkvPart;
use super::views::ViewKind;
use Dim::*;
use ViewKind::{Qkv, Rename, RopeKv, RopeQuery, Split, Transpose, TrimVocab};
use When::*;

const EMBED: Param = param(super::tables::EMBEDDING, &[Vocab, Hidden], Always);
const NORM: Param = param("model.norm.weight", &[Hidden], Always);
const LM_HEAD: Param = param(super::tables::LM_HEAD, &[Vocab, Hidden], Untied);
const Q: Param = linear(
    "model.layers.{L}.self_attn.q_proj.weight",
    &[QueryRows, Hidden],
    Always,
);
const K: Param = linear(
    "model.layers.{L}.self_attn.k_proj.weight",
    &[KvRows, Hidden],
    Always,
);
const V: Param = linear(
    "model.layers.{L}.self_attn.v_proj.weight",
    &[KvRows, Hidden],
    Always,
);
const O: Param = linear(
    "model.layers.{L}.self_attn.o_proj.weight",
    &[Hidden, QueryRows],
    Always,
);
const GATE: Param = linear(
    "model.layers.{L}.mlp.gate_proj.weight",
    &[Inter, Hidden],
    Always,
);
const UP: Param = linear(
    "model.layers.{L}.mlp.up_proj.weight",
    &[Inter, Hidden],
    Always,
);
const DOWN: Param = linear(
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

/// A mixture-of-experts layer's router and its score-correction bias (DeepSeek-V3's and
/// GLM-4.5's sigmoid routing; kept in F32), and its shared experts.
const ROUTER: Param = param(
    "model.layers.{L}.mlp.gate.weight",
    &[Experts, Hidden],
    MoeLayer,
);
const SCORE_CORRECTION: Param = param(
    "model.layers.{L}.mlp.gate.e_score_correction_bias",
    &[Experts],
    MoeLayerIfSaved,
);
const SHARED_GATE: Param = linear(
    "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
    &[SharedInter, Hidden],
    MoeLayer,
);
const SHARED_UP: Param = linear(
    "model.layers.{L}.mlp.shared_experts.up_proj.weight",
    &[SharedInter, Hidden],
    MoeLayer,
);
const SHARED_DOWN: Param = linear(
    "model.layers.{L}.mlp.shared_experts.down_proj.weight",
    &[Hidden, SharedInter],
    MoeLayer,
);

/// A multi-token prediction layer's own parameters, as DeepSeek-V3's release holds them at
/// layer `num_hidden_layers + M` (GLM-4.5's the same): the norms of the token's embedding and of
/// the previous hidden state, their projection `[H, 2H]`, and the shared head (its norm, and a
/// copy of the model's head); and a copy of the embedding. transformers does not load them;
/// vLLM's and SGLang's speculative decoding do.
const MTP_EMBED: Param = param(
    "model.layers.{L}.embed_tokens.weight",
    &[Vocab, Hidden],
    MtpLayer,
);
const MTP_ENORM: Param = param("model.layers.{L}.enorm.weight", &[Hidden], MtpLayer);
const MTP_HNORM: Param = param("model.layers.{L}.hnorm.weight", &[Hidden], MtpLayer);
const MTP_EH_PROJ: Param = param(
    "model.layers.{L}.eh_proj.weight",
    &[Hidden, TwoHidden],
    MtpLayer,
);
const MTP_HEAD_NORM: Param = param(
    "model.layers.{L}.shared_head.norm.weight",
    &[Hidden],
    MtpLayer,
);
const MTP_HEAD: Param = param(
    "model.layers.{L}.shared_head.head.weight",
    &[Vocab, Hidden],
    MtpLayer,
);

/// Multi-head latent attention's parameters (DeepSeek-V3's).
const MLA_Q: Param = linear(
    "model.layers.{L}.self_attn.q_proj.weight",
    &[QkRows, Hidden],
    NoQLora,
);
const MLA_Q_A: Param = linear(
    "model.layers.{L}.self_attn.q_a_proj.weight",
    &[QLoraRank, Hidden],
    QLora,
);
const MLA_Q_A_NORM: Param = param(
    "model.layers.{L}.self_attn.q_a_layernorm.weight",
    &[QLoraRank],
    QLora,
);
const MLA_Q_B: Param = linear(
    "model.layers.{L}.self_attn.q_b_proj.weight",
    &[QkRows, QLoraRank],
    QLora,
);
const MLA_KV_A: Param = linear(
    "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
    &[KvARows, Hidden],
    Always,
);
const MLA_KV_A_NORM: Param = param(
    "model.layers.{L}.self_attn.kv_a_layernorm.weight",
    &[KvLoraRank],
    Always,
);
const MLA_KV_B: Param = linear(
    "model.layers.{L}.self_attn.kv_b_proj.weight",
    &[KvBRows, KvLoraRank],
    Always,
);
const MLA_O: Param = linear(
    "model.layers.{L}.self_attn.o_proj.weight",
    &[Hidden, VRows],
    Always,
);

/// transformers' `DeepseekV3ForCausalLM`: multi-head latent attention (queries through a
/// low-rank projection when `q_lora_rank` is set), dense MLPs in the first
/// `first_k_dense_replace` layers, routed experts (one name per expert), a router with its
/// score-correction bias and shared experts in the others.
const DEEPSEEK_V3_PARAMS: &[Param] = &[
    EMBED,
    MLA_Q,
    MLA_Q_A,
    MLA_Q_A_NORM,
    MLA_Q_B,
    MLA_KV_A,
    MLA_KV_A_NORM,
    MLA_KV_B,
    MLA_O,
    DENSE_GATE,
    DENSE_UP,
    DENSE_DOWN,
    EXPERT_GATE,
    EXPERT_UP,
    EXPERT_DOWN,
    ROUTER,
    SCORE_CORRECTION,
    SHARED_GATE,
    SHARED_UP,
    SHARED_DOWN,
    IN_NORM,
    POST_NORM,
    MTP_EMBED,
    MTP_ENORM,
    MTP_HNORM,
    MTP_EH_PROJ,
    MTP_HEAD_NORM,
    MTP_HEAD,
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

/// Megatron-core's names of what is not in a decoder layer: the vocabulary-parallel embedding
/// and head, padded past `vocab_size` (Megatron-LM's rule), and the final norm.
const MEGATRON_COMMON: &[Row] = &[
    row("embedding.word_embeddings.weight", EMBED.name, TrimVocab),
    row("decoder.final_layernorm.weight", NORM.name, Rename),
    row("output_layer.weight", LM_HEAD.name, TrimVocab),
];

/// Rows of a Megatron-core decoder layer's tensors, each three times: layer-stacked
/// (`decoder.layers.X`, one leading axis over the layers, what `TransformerBlock` saves when its
/// layers are alike), per layer (`decoder.layers.N.X`, what it saves when they are not: dense and
/// MoE layers), and in a multi-token prediction layer (`mtp.layers.M.transformer_layer.X`, Hugging
/// Face's layer `num_hidden_layers + M`). Megatron rotates half-split rows as transformers does:
/// no row moves.
macro_rules! megatron_layer_rows {
    ($(($layer:literal, $target:expr, $view:expr)),* $(,)?) => {
        &[
            $(
                row(concat!("decoder.layers.", $layer), $target, $view),
                row(concat!("decoder.layers.{L}.", $layer), $target, $view),
                row(concat!("mtp.layers.{M}.transformer_layer.", $layer), $target, $view),
            )*
        ]
    };
}

/// Grouped-query attention: the fused QKV, interleaved per query group, and its input norm
/// under the linear (local spec and Transformer Engine alike) or its own name.
const MEGATRON_GQA: &[Row] = megatron_layer_rows![
    ("self_attention.linear_qkv.weight", Q.name, Qkv(QkvPart::Q)),
    ("self_attention.linear_qkv.weight", K.name, Qkv(QkvPart::K)),
    ("self_attention.linear_qkv.weight", V.name, Qkv(QkvPart::V)),
    (
        "self_attention.linear_qkv.layer_norm_weight",
        IN_NORM.name,
        Rename
    ),
    ("input_layernorm.weight", IN_NORM.name, Rename),
    ("self_attention.linear_proj.weight", O.name, Rename),
];

/// The q/k/v biases (Qwen2's, GLM-4.5's) are the fused QKV's bias, interleaved as its rows.
const MEGATRON_QKV_BIAS: &[Row] = megatron_layer_rows![
    (
        "self_attention.linear_qkv.bias",
        QKV_BIAS[0],
        Qkv(QkvPart::Q)
    ),
    (
        "self_attention.linear_qkv.bias",
        QKV_BIAS[1],
        Qkv(QkvPart::K)
    ),
    (
        "self_attention.linear_qkv.bias",
        QKV_BIAS[2],
        Qkv(QkvPart::V)
    ),
];

const QKV_BIAS: [&str; 3] = [
    "model.layers.{L}.self_attn.q_proj.bias",
    "model.layers.{L}.self_attn.k_proj.bias",
    "model.layers.{L}.self_attn.v_proj.bias",
];

/// Per-head RMS norms of queries and keys (Qwen3's, GLM-4.5's `use_qk_norm`).
const MEGATRON_QK_NORM: &[Row] = megatron_layer_rows![
    ("self_attention.q_layernorm.weight", Q_NORM.name, Rename),
    ("self_attention.k_layernorm.weight", K_NORM.name, Rename),
];

/// The norm before the MLP: under the dense MLP's first linear (local spec, and Transformer
/// Engine's dense layers) or its own name (Transformer Engine's MoE layers, MLA models).
const MEGATRON_MLP_NORM: &[Row] = megatron_layer_rows![
    ("mlp.linear_fc1.layer_norm_weight", POST_NORM.name, Rename),
    ("pre_mlp_layernorm.weight", POST_NORM.name, Rename),
];

/// Megatron-LM's `--transformer-impl`: the layer spec a run builds its layers with. The export
/// reads the names of both; the import writes the run's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerSpec {
    TransformerEngine,
    Local,
}

/// A norm megatron-core's two layer specs save under different names. Transformer Engine fuses
/// a norm into the linear after it, save before a MoE layer's router (no linear to fuse into);
/// the local spec keeps norms as modules and maps those of grouped-query attention's layers onto
/// Transformer Engine's fused names (its `sharded_state_dict_keys_map`), but not latent
/// attention's.
struct SpecName {
    param: &'static str,
    /// Of a latent-attention (MLA) model's layers, or of the others.
    mla: bool,
    /// Of a layer whose MLP is a mixture of experts (`None`: of either kind).
    moe_layer: Option<bool>,
    transformer_engine: &'static str,
    local: &'static str,
}

const FC1_NORM: &str = "mlp.linear_fc1.layer_norm_weight";
const OWN_MLP_NORM: &str = "pre_mlp_layernorm.weight";

const SPEC_NAMES: &[SpecName] = &[
    SpecName {
        param: POST_NORM.name,
        mla: false,
        moe_layer: Some(false),
        transformer_engine: FC1_NORM,
        local: FC1_NORM,
    },
    SpecName {
        param: POST_NORM.name,
        mla: false,
        moe_layer: Some(true),
        transformer_engine: OWN_MLP_NORM,
        local: FC1_NORM,
    },
    SpecName {
        param: POST_NORM.name,
        mla: true,
        moe_layer: Some(false),
        transformer_engine: FC1_NORM,
        local: OWN_MLP_NORM,
    },
    SpecName {
        param: POST_NORM.name,
        mla: true,
        moe_layer: Some(true),
        transformer_engine: OWN_MLP_NORM,
        local: OWN_MLP_NORM,
    },
    SpecName {
        param: MLA_Q_A_NORM.name,
        mla: true,
        moe_layer: None,
        transformer_engine: "self_attention.linear_q_up_proj.layer_norm_weight",
        local: "self_attention.q_layernorm.weight",
    },
    SpecName {
        param: MLA_KV_A_NORM.name,
        mla: true,
        moe_layer: None,
        transformer_engine: "self_attention.linear_kv_up_proj.layer_norm_weight",
        local: "self_attention.kv_layernorm.weight",
    },
];

/// The name (within a layer) under which `spec` saves `param` of `arch` in a layer of the kind
/// `moe_layer`, where the two specs differ; `None` where any of the table's names is the one.
pub(crate) fn spec_name(
    arch: &Arch,
    param: &str,
    moe_layer: bool,
    spec: LayerSpec,
) -> Option<&'static str> {
    let mla = arch.params.iter().any(|p| p.name == MLA_KV_A.name);
    SPEC_NAMES
        .iter()
        .find(|n| n.param == param && n.mla == mla && n.moe_layer.is_none_or(|m| m == moe_layer))
        .map(|n| match spec {
            LayerSpec::TransformerEngine => n.transformer_engine,
            LayerSpec::Local => n.local,
        })
}

/// A dense SwiGLU MLP: `linear_fc1` is `[gate; up]`, or its two halves under `weight_w` and
/// `weight_v` where megatron-core saves singleton local shards.
const MEGATRON_DENSE_MLP: &[Row] = megatron_layer_rows![
    ("mlp.linear_fc1.weight", GATE.name, Split { part: 0, of: 2 }),
    ("mlp.linear_fc1.weight", UP.name, Split { part: 1, of: 2 }),
    ("mlp.linear_fc1.weight_w", GATE.name, Rename),
    ("mlp.linear_fc1.weight_v", UP.name, Rename),
    ("mlp.linear_fc2.weight", DOWN.name, Rename),
];

/// megatron-core's mixture of experts (`MoELayer`) onto DeepSeek-V3's, Qwen3-MoE's and
/// GLM-4.5's names: the router and the routed experts. The experts are saved under global expert indices whatever
/// the expert parallelism: SequentialMLP and the grouped GEMMs alike as one tensor stacked over
/// the experts (`experts.experts.linear_fc1.weight` `[E, 2F, H]`, each expert's `[gate; up]`),
/// one tensor per expert with singleton local shards (`weight_w`/`weight_v`), and under the
/// module's own names in a plain `state_dict` (`local_experts.E`).
const MEGATRON_MOE: &[Row] = megatron_layer_rows![
    ("mlp.router.weight", ROUTER.name, Rename),
    (
        "mlp.experts.experts.linear_fc1.weight",
        EXPERT_GATE.name,
        Split { part: 0, of: 2 }
    ),
    (
        "mlp.experts.experts.linear_fc1.weight",
        EXPERT_UP.name,
        Split { part: 1, of: 2 }
    ),
    (
        "mlp.experts.experts.linear_fc2.weight",
        EXPERT_DOWN.name,
        Rename
    ),
    (
        "mlp.experts.experts.{E}.linear_fc1.weight_w",
        EXPERT_GATE.name,
        Rename
    ),
    (
        "mlp.experts.experts.{E}.linear_fc1.weight_v",
        EXPERT_UP.name,
        Rename
    ),
    (
        "mlp.experts.experts.{E}.linear_fc2.weight",
        EXPERT_DOWN.name,
        Rename
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
        EXPERT_GATE.name,
        Split { part: 0, of: 2 }
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
        EXPERT_UP.name,
        Split { part: 1, of: 2 }
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc2.weight",
        EXPERT_DOWN.name,
        Rename
    ),
];

/// The router's load-balancing bias (`moe_router_enable_expert_bias`, kept in F32), which
/// DeepSeek-V3's and GLM-4.5's sigmoid routing adds to the scores as `e_score_correction_bias`.
const MEGATRON_SCORE_CORRECTION: &[Row] =
    megatron_layer_rows![("mlp.router.expert_bias", SCORE_CORRECTION.name, Rename)];

/// Shared experts, always on (DeepSeek-V3's, GLM-4.5's): a SwiGLU MLP beside the routed ones.
const MEGATRON_SHARED_EXPERTS: &[Row] = megatron_layer_rows![
    (
        "mlp.shared_experts.linear_fc1.weight",
        SHARED_GATE.name,
        Split { part: 0, of: 2 }
    ),
    (
        "mlp.shared_experts.linear_fc1.weight",
        SHARED_UP.name,
        Split { part: 1, of: 2 }
    ),
    (
        "mlp.shared_experts.linear_fc2.weight",
        SHARED_DOWN.name,
        Rename
    ),
];

/// A multi-token prediction layer's own tensors (its transformer layer's rows are the decoder's):
/// the norms of the embedding and of the hidden state, their projection, and its final norm,
/// which DeepSeek-V3's checkpoints hold as the shared head's; beside them each Hugging Face MTP
/// layer holds a copy of the embedding and of the head, which Megatron shares.
const MEGATRON_MTP: &[Row] = &[
    row("mtp.layers.{M}.enorm.weight", MTP_ENORM.name, Rename),
    row("mtp.layers.{M}.hnorm.weight", MTP_HNORM.name, Rename),
    row("mtp.layers.{M}.eh_proj.weight", MTP_EH_PROJ.name, Rename),
    row(
        "mtp.layers.{M}.final_layernorm.weight",
        MTP_HEAD_NORM.name,
        Rename,
    ),
    row(
        "embedding.word_embeddings.weight",
        "model.layers.{MTP}.embed_tokens.weight",
        TrimVocab,
    ),
    row(
        "output_layer.weight",
        "model.layers.{MTP}.shared_head.head.weight",
        TrimVocab,
    ),
];

/// Multi-head latent attention (DeepSeek-V3's): the query's and the key-value's down and up
/// projections, each latent's norm under its own name (local spec) or under the up projection
/// it precedes (Transformer Engine), and the input norm under its own name. Megatron and
/// transformers lay out each head's rows `[nope; rope]` alike: every row is a rename.
const MEGATRON_MLA: &[Row] = megatron_layer_rows![
    ("input_layernorm.weight", IN_NORM.name, Rename),
    ("self_attention.linear_q_proj.weight", MLA_Q.name, Rename),
    (
        "self_attention.linear_q_down_proj.weight",
        MLA_Q_A.name,
        Rename
    ),
    (
        "self_attention.q_layernorm.weight",
        MLA_Q_A_NORM.name,
        Rename
    ),
    (
        "self_attention.linear_q_up_proj.layer_norm_weight",
        MLA_Q_A_NORM.name,
        Rename
    ),
    (
        "self_attention.linear_q_up_proj.weight",
        MLA_Q_B.name,
        Rename
    ),
    (
        "self_attention.linear_kv_down_proj.weight",
        MLA_KV_A.name,
        Rename
    ),
    (
        "self_attention.kv_layernorm.weight",
        MLA_KV_A_NORM.name,
        Rename
    ),
    (
        "self_attention.linear_kv_up_proj.layer_norm_weight",
        MLA_KV_A_NORM.name,
        Rename
    ),
    (
        "self_attention.linear_kv_up_proj.weight",
        MLA_KV_B.name,
        Rename
    ),
    ("self_attention.linear_proj.weight", MLA_O.name, Rename),
];

/// Mixtral's experts under megatron-core's MoE names: the router, and SequentialMLP's or the
/// grouped GEMMs' experts (see [`MEGATRON_MOE`]) onto `block_sparse_moe`.
const MEGATRON_MIXTRAL_MOE: &[Row] = megatron_layer_rows![
    ("mlp.router.weight", MIXTRAL_ROUTER.name, Rename),
    (
        "mlp.experts.experts.linear_fc1.weight",
        MIXTRAL_W1.name,
        Split { part: 0, of: 2 }
    ),
    (
        "mlp.experts.experts.linear_fc1.weight",
        MIXTRAL_W3.name,
        Split { part: 1, of: 2 }
    ),
    (
        "mlp.experts.experts.linear_fc2.weight",
        MIXTRAL_W2.name,
        Rename
    ),
    (
        "mlp.experts.experts.{E}.linear_fc1.weight_w",
        MIXTRAL_W1.name,
        Rename
    ),
    (
        "mlp.experts.experts.{E}.linear_fc1.weight_v",
        MIXTRAL_W3.name,
        Rename
    ),
    (
        "mlp.experts.experts.{E}.linear_fc2.weight",
        MIXTRAL_W2.name,
        Rename
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
        MIXTRAL_W1.name,
        Split { part: 0, of: 2 }
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc1.weight",
        MIXTRAL_W3.name,
        Split { part: 1, of: 2 }
    ),
    (
        "mlp.experts.local_experts.{E}.linear_fc2.weight",
        MIXTRAL_W2.name,
        Rename
    ),
];

const MEGATRON_LLAMA: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_GQA,
    MEGATRON_MLP_NORM,
    MEGATRON_DENSE_MLP,
];
const MEGATRON_QWEN2: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_GQA,
    MEGATRON_MLP_NORM,
    MEGATRON_DENSE_MLP,
    MEGATRON_QKV_BIAS,
];
const MEGATRON_QWEN3: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_GQA,
    MEGATRON_MLP_NORM,
    MEGATRON_DENSE_MLP,
    MEGATRON_QK_NORM,
];

/// megatron-core's Qwen3-MoE (`Qwen3MoEBridge`'s model): Qwen3's attention, and megatron-core's
/// MoE without shared experts; layers it makes dense (`moe_layer_freq`) a dense MLP.
const MEGATRON_QWEN3_MOE: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_GQA,
    MEGATRON_QK_NORM,
    MEGATRON_MLP_NORM,
    MEGATRON_DENSE_MLP,
    MEGATRON_MOE,
];

/// megatron-core's DeepSeek-V3: latent attention, dense first layers, routed and shared experts
/// with the score-correction bias, and multi-token prediction layers.
const MEGATRON_DEEPSEEK_V3: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_MLA,
    MEGATRON_MLP_NORM,
    MEGATRON_DENSE_MLP,
    MEGATRON_MOE,
    MEGATRON_SCORE_CORRECTION,
    MEGATRON_SHARED_EXPERTS,
    MEGATRON_MTP,
];

/// megatron-core's GLM-4.5: grouped-query attention with q/k/v biases (and q/k norms with
/// `use_qk_norm`), otherwise DeepSeek-V3's MoE and multi-token prediction.
const MEGATRON_GLM4_MOE: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_GQA,
    MEGATRON_QKV_BIAS,
    MEGATRON_QK_NORM,
    MEGATRON_MLP_NORM,
    MEGATRON_DENSE_MLP,
    MEGATRON_MOE,
    MEGATRON_SCORE_CORRECTION,
    MEGATRON_SHARED_EXPERTS,
    MEGATRON_MTP,
];

/// megatron-core's Mixtral: Llama's attention, every layer's MLP a mixture of experts.
const MEGATRON_MIXTRAL: &[&[Row]] = &[
    MEGATRON_COMMON,
    MEGATRON_GQA,
    MEGATRON_MLP_NORM,
    MEGATRON_MIXTRAL_MOE,
];

/// transformers' `Glm4MoeForCausalLM` (GLM-4.5, 4.6): grouped-query attention with q/k/v biases
/// (`attention_bias`) and optional per-head q/k norms (`use_qk_norm`), dense MLPs in the first
/// `first_k_dense_replace` layers, DeepSeek-V3's experts, router and shared experts in the others,
/// and its multi-token prediction layers.
const GLM4_MOE_PARAMS: &[Param] = &[
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
    param(Q_NORM.name, &[HeadSize], QkNorm),
    param(K_NORM.name, &[HeadSize], QkNorm),
    DENSE_GATE,
    DENSE_UP,
    DENSE_DOWN,
    EXPERT_GATE,
    EXPERT_UP,
    EXPERT_DOWN,
    ROUTER,
    SCORE_CORRECTION,
    SHARED_GATE,
    SHARED_UP,
    SHARED_DOWN,
    IN_NORM,
    POST_NORM,
    MTP_EMBED,
    MTP_ENORM,
    MTP_HNORM,
    MTP_EH_PROJ,
    MTP_HEAD_NORM,
    MTP_HEAD,
    NORM,
    LM_HEAD,
];

/// Mixtral's experts as its releases (and transformers' `save_pretrained`) store them: one
/// tensor each under `block_sparse_moe`, `w1` the gate, `w3` the up and `w2` the down projection,
/// of `intermediate_size`; the router `block_sparse_moe.gate`.
const MIXTRAL_ROUTER: Param = param(
    "model.layers.{L}.block_sparse_moe.gate.weight",
    &[Experts, Hidden],
    Always,
);
const MIXTRAL_W1: Param = linear(
    "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
    &[Inter, Hidden],
    Always,
);
const MIXTRAL_W3: Param = linear(
    "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
    &[Inter, Hidden],
    Always,
);
const MIXTRAL_W2: Param = linear(
    "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight",
    &[Hidden, Inter],
    Always,
);

/// transformers' `MixtralForCausalLM`: Llama's attention, every layer a mixture of experts.
const MIXTRAL_PARAMS: &[Param] = &[
    EMBED,
    Q,
    K,
    V,
    O,
    MIXTRAL_ROUTER,
    MIXTRAL_W1,
    MIXTRAL_W2,
    MIXTRAL_W3,
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// transformers 5 holds Mixtral's router under `mlp.gate` and its experts fused as DeepSeek-V3's
/// (see [`HF_DEEPSEEK_V3_FUSED`]), and saves `block_sparse_moe`'s names.
const HF_MIXTRAL_FUSED: &[Row] = &[
    row(
        "model.layers.{L}.mlp.gate.weight",
        MIXTRAL_ROUTER.name,
        Rename,
    ),
    row(
        "model.layers.{L}.mlp.experts.gate_up_proj",
        MIXTRAL_W1.name,
        Split { part: 0, of: 2 },
    ),
    row(
        "model.layers.{L}.mlp.experts.gate_up_proj",
        MIXTRAL_W3.name,
        Split { part: 1, of: 2 },
    ),
    row(
        "model.layers.{L}.mlp.experts.down_proj",
        MIXTRAL_W2.name,
        Rename,
    ),
];

/// megatron-core's routing bias (`moe_router_enable_expert_bias`), which Qwen3-MoE and Mixtral
/// have no place for.
const MEGATRON_EXPERT_BIAS: [(&str, &str); 3] = [
    ("decoder.layers.mlp.router.expert_bias", MEGATRON_BIAS_WHY),
    (
        "decoder.layers.{L}.mlp.router.expert_bias",
        MEGATRON_BIAS_WHY,
    ),
    (
        "mtp.layers.{M}.transformer_layer.mlp.router.expert_bias",
        MEGATRON_BIAS_WHY,
    ),
];
const MEGATRON_BIAS_WHY: &str = "routing biases of megatron-core's load balancing (moe_router_enable_expert_bias), which the architecture has no place for: the export routes without them";

/// The dense MLP of a model whose other layers are mixtures of experts.
const DENSE_GATE: Param = linear(GATE.name, &[Inter, Hidden], DenseLayer);
const DENSE_UP: Param = linear(UP.name, &[Inter, Hidden], DenseLayer);
const DENSE_DOWN: Param = linear(DOWN.name, &[Hidden, Inter], DenseLayer);

/// A routed expert's gate, up and down projections, one tensor each per expert, as DeepSeek-V3's
/// and Qwen3-MoE's released checkpoints hold them.
const EXPERT_GATE: Param = linear(
    "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
    &[MoeInter, Hidden],
    MoeLayer,
);
const EXPERT_UP: Param = linear(
    "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
    &[MoeInter, Hidden],
    MoeLayer,
);
const EXPERT_DOWN: Param = linear(
    "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
    &[Hidden, MoeInter],
    MoeLayer,
);

/// transformers' `Qwen3MoeForCausalLM`: Qwen3's attention, and in each mixture-of-experts layer
/// (every `decoder_sparse_step`-th not in `mlp_only_layers`) a router `mlp.gate` and the routed
/// experts, no shared one; the other layers a dense MLP.
const QWEN3_MOE_PARAMS: &[Param] = &[
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
    DENSE_GATE,
    DENSE_UP,
    DENSE_DOWN,
    ROUTER,
    EXPERT_GATE,
    EXPERT_UP,
    EXPERT_DOWN,
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// transformers 5 holds Qwen3-MoE's routed experts fused as DeepSeek-V3's (see
/// [`HF_DEEPSEEK_V3_FUSED`]) and saves one tensor per expert.
const HF_QWEN3_MOE_FUSED: &[Row] = HF_DEEPSEEK_V3_FUSED;

/// torchtitan's auxiliary-loss-free load balancing keeps a routing bias per expert that shifts
/// which experts a token goes to. Qwen3-MoE and gpt-oss have no such parameter: the export
/// routes without it, as torchtitan's own `to_hf` does, and says so.
const TT_EXPERT_BIAS: (&str, &str) = (
    super::tables::TT_ROUTING_BIAS,
    "routing biases of torchtitan's load balancing, which the architecture has no place for (the export routes without them, as torchtitan's to_hf does)",
);

/// torchtitan 0.3's Qwen3-MoE (`Qwen3StateDictAdapter`): Qwen3's names, the routed experts
/// stacked on a leading axis as its DeepSeek-V3's.
const TT_QWEN3_MOE: &[Row] = &[
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
    row(
        "layers.{L}.moe.router.gate.weight",
        "model.layers.{L}.mlp.gate.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.w1_EFD",
        EXPERT_GATE.name,
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.w3_EFD",
        EXPERT_UP.name,
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.w2_EDF",
        EXPERT_DOWN.name,
        Rename,
    ),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("lm_head.weight", LM_HEAD.name, Rename),
];

/// transformers' `GptOssForCausalLM` (unquantized, as `from_pretrained` of a bf16 config
/// loads it): attention with biases and a learned sink per head, a router with a bias, and the
/// routed experts fused: `gate_up_proj` `[E, D, 2F]` (gate and up interleaved, even and odd
/// columns) and `down_proj` `[E, F, D]`, each with a bias. The experts are 3-D, so
/// `--quantize fp8-block` leaves them as they are (not in `modules_to_not_convert`, which names
/// the modules of the `.weight`s left unquantized).
const GPT_OSS_PARAMS: &[Param] = &[
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
    param("model.layers.{L}.self_attn.o_proj.bias", &[Hidden], Always),
    param("model.layers.{L}.self_attn.sinks", &[Heads], Always),
    param(
        "model.layers.{L}.mlp.router.weight",
        &[Experts, Hidden],
        Always,
    ),
    param("model.layers.{L}.mlp.router.bias", &[Experts], Always),
    param(
        "model.layers.{L}.mlp.experts.gate_up_proj",
        &[Experts, Hidden, TwoInter],
        Always,
    ),
    param(
        "model.layers.{L}.mlp.experts.gate_up_proj_bias",
        &[Experts, TwoInter],
        Always,
    ),
    param(
        "model.layers.{L}.mlp.experts.down_proj",
        &[Experts, Inter, Hidden],
        Always,
    ),
    param(
        "model.layers.{L}.mlp.experts.down_proj_bias",
        &[Experts, Hidden],
        Always,
    ),
    IN_NORM,
    POST_NORM,
    NORM,
    LM_HEAD,
];

/// torchtitan 0.3's gpt-oss: its experts stacked `[E, 2F, D]` and `[E, D, F]` with their
/// biases, transposed to transformers' layout. (torchtitan's own `to_hf` names them
/// `mlp1_weight`..., which the model's `mlp1_weight_EGD`... are not, and leaves them out.)
const TT_GPT_OSS: &[Row] = &[
    row("tok_embeddings.weight", EMBED.name, Rename),
    row("layers.{L}.attention.qkv_linear.wq.weight", Q.name, Rename),
    row(
        "layers.{L}.attention.qkv_linear.wq.bias",
        "model.layers.{L}.self_attn.q_proj.bias",
        Rename,
    ),
    row("layers.{L}.attention.qkv_linear.wk.weight", K.name, Rename),
    row(
        "layers.{L}.attention.qkv_linear.wk.bias",
        "model.layers.{L}.self_attn.k_proj.bias",
        Rename,
    ),
    row("layers.{L}.attention.qkv_linear.wv.weight", V.name, Rename),
    row(
        "layers.{L}.attention.qkv_linear.wv.bias",
        "model.layers.{L}.self_attn.v_proj.bias",
        Rename,
    ),
    row("layers.{L}.attention.wo.weight", O.name, Rename),
    row(
        "layers.{L}.attention.wo.bias",
        "model.layers.{L}.self_attn.o_proj.bias",
        Rename,
    ),
    row(
        "layers.{L}.attention.sinks",
        "model.layers.{L}.self_attn.sinks",
        Rename,
    ),
    row(
        "layers.{L}.moe.router.gate.weight",
        "model.layers.{L}.mlp.router.weight",
        Rename,
    ),
    row(
        "layers.{L}.moe.router.gate.bias",
        "model.layers.{L}.mlp.router.bias",
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.mlp1_weight_EGD",
        "model.layers.{L}.mlp.experts.gate_up_proj",
        Transpose,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.mlp1_bias_EG",
        "model.layers.{L}.mlp.experts.gate_up_proj_bias",
        Rename,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.mlp2_weight_EDF",
        "model.layers.{L}.mlp.experts.down_proj",
        Transpose,
    ),
    row(
        "layers.{L}.moe.routed_experts.inner_experts.mlp2_bias_ED",
        "model.layers.{L}.mlp.experts.down_proj_bias",
        Rename,
    ),
    row("layers.{L}.attention_norm.weight", IN_NORM.name, Rename),
    row("layers.{L}.ffn_norm.weight", POST_NORM.name, Rename),
    row("norm.weight", NORM.name, Rename),
    row("lm_head.weight", LM_HEAD.name, Rename),
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
        no_place: &[],
        moe_layers: MoeLayers::None,
        assumed_flags: &[],
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
        no_place: &[],
        moe_layers: MoeLayers::None,
        assumed_flags: &[],
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
        no_place: &[],
        moe_layers: MoeLayers::None,
        assumed_flags: &[],
    },
    Arch {
        name: "DeepseekV3ForCausalLM",
        model_type: "deepseek_v3",
        tied_by_default: false,
        params: DEEPSEEK_V3_PARAMS,
        hf_in_memory: HF_DEEPSEEK_V3_FUSED,
        torchtitan: Some(TT_DEEPSEEK_V3),
        // torchtitan 0.2's DeepSeek-V3 names are not mapped.
        torchtitan02: None,
        megatron: Some(MEGATRON_DEEPSEEK_V3),
        extra_modules: &["mtp_layers"],
        no_place: &[],
        moe_layers: MoeLayers::AfterFirstDense,
        // transformers' DeepSeek-V3 pairs adjacent rope dims (rope_interleave, true by default),
        // as torchtitan's and Megatron's do: the rows are renames only under that.
        assumed_flags: &[("rope_interleave", true)],
    },
    Arch {
        name: "Qwen3MoeForCausalLM",
        model_type: "qwen3_moe",
        tied_by_default: false,
        params: QWEN3_MOE_PARAMS,
        hf_in_memory: HF_QWEN3_MOE_FUSED,
        torchtitan: Some(TT_QWEN3_MOE),
        torchtitan02: None,
        megatron: Some(MEGATRON_QWEN3_MOE),
        extra_modules: &[],
        no_place: &[
            TT_EXPERT_BIAS,
            MEGATRON_EXPERT_BIAS[0],
            MEGATRON_EXPERT_BIAS[1],
            MEGATRON_EXPERT_BIAS[2],
        ],
        moe_layers: MoeLayers::SparseStep,
        assumed_flags: &[],
    },
    Arch {
        name: "GptOssForCausalLM",
        model_type: "gpt_oss",
        tied_by_default: false,
        params: GPT_OSS_PARAMS,
        hf_in_memory: &[],
        torchtitan: Some(TT_GPT_OSS),
        torchtitan02: None,
        megatron: None,
        extra_modules: &[],
        no_place: &[TT_EXPERT_BIAS],
        moe_layers: MoeLayers::All,
        assumed_flags: &[],
    },
    Arch {
        // torchtitan has no GLM-4.5.
        name: "Glm4MoeForCausalLM",
        model_type: "glm4_moe",
        tied_by_default: false,
        params: GLM4_MOE_PARAMS,
        hf_in_memory: HF_DEEPSEEK_V3_FUSED,
        torchtitan: None,
        torchtitan02: None,
        megatron: Some(MEGATRON_GLM4_MOE),
        extra_modules: &[],
        no_place: &[],
        moe_layers: MoeLayers::AfterFirstDense,
        assumed_flags: &[],
    },
    Arch {
        // torchtitan has no Mixtral.
        name: "MixtralForCausalLM",
        model_type: "mixtral",
        tied_by_default: false,
        params: MIXTRAL_PARAMS,
        hf_in_memory: HF_MIXTRAL_FUSED,
        torchtitan: None,
        torchtitan02: None,
        megatron: Some(MEGATRON_MIXTRAL),
        extra_modules: &[],
        no_place: &MEGATRON_EXPERT_BIAS,
        moe_layers: MoeLayers::All,
        assumed_flags: &[],
    },
];
