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

/// transformers' `DeepseekV3ForCausalLM`: multi-head latent attention (queries through a
/// low-rank projection when `q_lora_rank` is set), dense MLPs in the first
/// `first_k_dense_replace` layers, routed experts (one name per expert), a router with its
/// score-correction bias and shared experts in the others.
const DEEPSEEK_V3_PARAMS: &[Param] = &[
    EMBED,
    linear(
        "model.layers.{L}.self_attn.q_proj.weight",
        &[QkRows, Hidden],
        NoQLora,
    ),
    linear(
        "model.layers.{L}.self_attn.q_a_proj.weight",
        &[QLoraRank, Hidden],
        QLora,
    ),
    param(
        "model.layers.{L}.self_attn.q_a_layernorm.weight",
        &[QLoraRank],
        QLora,
    ),
    linear(
        "model.layers.{L}.self_attn.q_b_proj.weight",
        &[QkRows, QLoraRank],
        QLora,
    ),
    linear(
        "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        &[KvARows, Hidden],
        Always,
    ),
    param(
        "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        &[KvLoraRank],
        Always,
    ),
    linear(
        "model.layers.{L}.self_attn.kv_b_proj.weight",
        &[KvBRows, KvLoraRank],
        Always,
    ),
    linear(
        "model.layers.{L}.self_attn.o_proj.weight",
        &[Hidden, VRows],
        Always,
    ),
    linear(GATE.name, &[Inter, Hidden], DenseLayer),
    linear(UP.name, &[Inter, Hidden], DenseLayer),
    linear(DOWN.name, &[Hidden, Inter], DenseLayer),
    linear(
        "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
        &[MoeInter, Hidden],
        MoeLayer,
    ),
    linear(
        "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        &[MoeInter, Hidden],
        MoeLayer,
    ),
    linear(
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
    linear(
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        &[SharedInter, Hidden],
        MoeLayer,
    ),
    linear(
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        &[SharedInter, Hidden],
        MoeLayer,
    ),
    linear(
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

/// The rows of a Megatron-core GPT (as its `torch_dist` checkpoint names them: the layer norms
/// under the linears they precede, which the local layer spec saves as Transformer Engine's
/// do). Each decoder row comes twice: layer-stacked (`decoder.layers.X`, one leading axis over
/// the layers, what `TransformerBlock` saves) and per layer (`decoder.layers.N.X`, what
/// heterogeneous layers save). Megatron rotates half-split rows as transformers does: no row
/// moves.
macro_rules! megatron_rows {
    ($(($layer:literal, $target:expr, $view:expr)),* $(,)?) => {
        &[
            row("embedding.word_embeddings.weight", EMBED.name, TrimVocab),
            row("decoder.final_layernorm.weight", NORM.name, Rename),
            row("output_layer.weight", LM_HEAD.name, TrimVocab),
            $(
                row(concat!("decoder.layers.", $layer), $target, $view),
                row(concat!("decoder.layers.{L}.", $layer), $target, $view),
            )*
        ]
    };
}

macro_rules! megatron_gpt {
    ($($extra:tt),* $(,)?) => {
        megatron_rows![
            ("self_attention.linear_qkv.weight", Q.name, Qkv(QkvPart::Q)),
            ("self_attention.linear_qkv.weight", K.name, Qkv(QkvPart::K)),
            ("self_attention.linear_qkv.weight", V.name, Qkv(QkvPart::V)),
            ("self_attention.linear_qkv.layer_norm_weight", IN_NORM.name, Rename),
            ("input_layernorm.weight", IN_NORM.name, Rename),
            ("self_attention.linear_proj.weight", O.name, Rename),
            ("mlp.linear_fc1.weight", GATE.name, Split { part: 0, of: 2 }),
            ("mlp.linear_fc1.weight", UP.name, Split { part: 1, of: 2 }),
            ("mlp.linear_fc1.layer_norm_weight", POST_NORM.name, Rename),
            ("pre_mlp_layernorm.weight", POST_NORM.name, Rename),
            ("mlp.linear_fc2.weight", DOWN.name, Rename),
            $($extra,)*
        ]
    };
}

const MEGATRON_LLAMA: &[Row] = megatron_gpt![];

/// Qwen2's q/k/v biases are the fused QKV's bias, interleaved per group as its rows.
const MEGATRON_QWEN2: &[Row] = megatron_gpt![
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

const MEGATRON_QWEN3: &[Row] = megatron_gpt![
    ("self_attention.q_layernorm.weight", Q_NORM.name, Rename),
    ("self_attention.k_layernorm.weight", K_NORM.name, Rename),
];

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
    linear(GATE.name, &[Inter, Hidden], DenseLayer),
    linear(UP.name, &[Inter, Hidden], DenseLayer),
    linear(DOWN.name, &[Hidden, Inter], DenseLayer),
    param(
        "model.layers.{L}.mlp.gate.weight",
        &[Experts, Hidden],
        MoeLayer,
    ),
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
/// `--quantize fp8-block` leaves them (and lists them) as they are.
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
        no_place: &[],
        moe_layers: MoeLayers::AfterFirstDense,
    },
    Arch {
        name: "Qwen3MoeForCausalLM",
        model_type: "qwen3_moe",
        tied_by_default: false,
        params: QWEN3_MOE_PARAMS,
        hf_in_memory: HF_QWEN3_MOE_FUSED,
        torchtitan: Some(TT_QWEN3_MOE),
        torchtitan02: None,
        megatron: None,
        extra_modules: &[],
        no_place: &[TT_EXPERT_BIAS],
        moe_layers: MoeLayers::SparseStep,
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
    },
];
