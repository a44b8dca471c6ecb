use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::*;
use crate::dtype::DType;
use crate::error::ErrorKind;
use crate::model::{DataRef, Encoding, Format, NonTensor, Piece, Pieces};

/// A small config of `arch`: hidden 8, 2 query heads of head_dim 6 (not hidden/heads), 1 KV
/// head, 2 layers, intermediate 10, vocab 11.
fn config(arch: &str, extra: &[(&str, Value)]) -> HfConfig {
    let mut json: Map<String, Value> = serde_json::from_value(serde_json::json!({
        "architectures": [arch],
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 6,
        "num_hidden_layers": 2,
        "intermediate_size": 10,
        "vocab_size": 11,
        "torch_dtype": "float32",
    }))
    .unwrap();
    for (k, v) in extra {
        json.insert(k.to_string(), v.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    HfConfig::read(&path).unwrap()
}

fn tensor(name: &str, shape: &[u64]) -> Tensor {
    let piece = Piece {
        offsets: vec![0; shape.len()],
        sizes: shape.to_vec(),
        data: DataRef {
            file: Path::new("f").into(),
            offset: 0,
            strides: crate::model::contiguous_strides(shape),
            encoding: Encoding::Raw,
        },
    };
    Tensor {
        name: name.to_string(),
        key_path: Vec::new(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        pieces: Pieces::single(piece).unwrap(),
    }
}

fn checkpoint(tensors: Vec<Tensor>) -> Checkpoint {
    Checkpoint {
        root: PathBuf::from("/ckpt"),
        format: Format::Dcp,
        world_size: Some(1),
        tensors,
        values: Vec::new(),
        unsupported: Vec::new(),
        details: Vec::new(),
    }
}

/// torchtitan 0.3 names of the small config's Llama (or Qwen3 with `qk_norm`), with the
/// training state torchtitan saves beside them.
fn torchtitan(prefix: &str, qk_norm: bool, lm_head: &str) -> Checkpoint {
    let mut ts = vec![tensor(&format!("{prefix}tok_embeddings.weight"), &[11, 8])];
    for l in 0..2 {
        let p = format!("{prefix}layers.{l}.");
        ts.push(tensor(
            &format!("{p}attention.qkv_linear.wq.weight"),
            &[12, 8],
        ));
        ts.push(tensor(
            &format!("{p}attention.qkv_linear.wk.weight"),
            &[6, 8],
        ));
        ts.push(tensor(
            &format!("{p}attention.qkv_linear.wv.weight"),
            &[6, 8],
        ));
        ts.push(tensor(&format!("{p}attention.wo.weight"), &[8, 12]));
        if qk_norm {
            ts.push(tensor(&format!("{p}attention.q_norm.weight"), &[6]));
            ts.push(tensor(&format!("{p}attention.k_norm.weight"), &[6]));
        }
        ts.push(tensor(&format!("{p}feed_forward.w1.weight"), &[10, 8]));
        ts.push(tensor(&format!("{p}feed_forward.w2.weight"), &[8, 10]));
        ts.push(tensor(&format!("{p}feed_forward.w3.weight"), &[10, 8]));
        ts.push(tensor(&format!("{p}attention_norm.weight"), &[8]));
        ts.push(tensor(&format!("{p}ffn_norm.weight"), &[8]));
    }
    ts.push(tensor(&format!("{prefix}norm.weight"), &[8]));
    ts.push(tensor(&format!("{prefix}{lm_head}"), &[11, 8]));
    // The optimizer repeats the model's names after its own.
    ts.push(tensor(
        "optimizer.state.tok_embeddings.weight.exp_avg",
        &[11, 8],
    ));
    ts.push(tensor(
        "optimizer.state.layers.0.attention.wo.weight.exp_avg",
        &[8, 12],
    ));
    ts.push(tensor("lr_scheduler.last_epoch", &[]));
    let mut ckpt = checkpoint(ts);
    ckpt.values.push(NonTensor {
        name: "train_state.step".into(),
        key_path: Vec::new(),
        value: None,
        raw: None,
    });
    ckpt
}

/// The Hugging Face names of the small config's model, in `state_dict` order.
fn hf_names(arch: &str, tied: bool) -> Vec<String> {
    let mut names = vec!["model.embed_tokens.weight".to_string()];
    for l in 0..2 {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            names.push(format!("model.layers.{l}.self_attn.{p}.weight"));
            if arch == "Qwen2ForCausalLM" && p != "o_proj" {
                names.push(format!("model.layers.{l}.self_attn.{p}.bias"));
            }
        }
        if arch == "Qwen3ForCausalLM" {
            names.push(format!("model.layers.{l}.self_attn.q_norm.weight"));
            names.push(format!("model.layers.{l}.self_attn.k_norm.weight"));
        }
        for p in ["gate_proj", "up_proj", "down_proj"] {
            names.push(format!("model.layers.{l}.mlp.{p}.weight"));
        }
        names.push(format!("model.layers.{l}.input_layernorm.weight"));
        names.push(format!("model.layers.{l}.post_attention_layernorm.weight"));
    }
    names.push("model.norm.weight".into());
    if !tied {
        names.push("lm_head.weight".into());
    }
    names
}

fn targets(m: &Mapping) -> Vec<String> {
    m.placed.iter().map(|p| p.target.clone()).collect()
}

#[test]
fn torchtitan_llama_maps_every_parameter_once_with_rope_rows() {
    for prefix in ["", "model."] {
        let cfg = config("LlamaForCausalLM", &[]);
        let ckpt = torchtitan(prefix, false, "lm_head.weight");
        let m = map(&ckpt, &cfg).unwrap();
        assert_eq!(m.naming, Naming::Torchtitan);
        assert_eq!(m.prefix, prefix);
        assert_eq!(targets(&m), hf_names("LlamaForCausalLM", false));
        let view = |t: &str| m.placed.iter().find(|p| p.target == t).unwrap().view;
        assert_eq!(
            view("model.layers.1.self_attn.q_proj.weight"),
            ViewKind::RopeQuery
        );
        assert_eq!(
            view("model.layers.1.self_attn.k_proj.weight"),
            ViewKind::RopeKv
        );
        assert_eq!(
            view("model.layers.1.self_attn.v_proj.weight"),
            ViewKind::Rename
        );
        let left: Vec<&str> = m.left_out.iter().map(|l| l.name.as_str()).collect();
        assert!(left.contains(&"optimizer.state.tok_embeddings.weight.exp_avg"));
        assert!(left.contains(&"lr_scheduler.last_epoch"));
        assert!(left.contains(&"train_state.step"));
        let out = apply(ckpt, &cfg, &m).unwrap();
        let names: Vec<&str> = out.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, hf_names("LlamaForCausalLM", false));
        assert!(out.values.is_empty());
        // wq's rows permuted: 2 heads × 2 halves, a piece each reading every other row.
        let q = &out.tensors[1];
        assert_eq!(q.pieces.len(), 4);
        assert_eq!(q.pieces.get(1).offsets(), &[3, 0]);
        assert_eq!(q.pieces.get(1).offset(), 8 * 4);
        assert_eq!(&*q.pieces.get(1).strides(), &[16, 1]);
    }
}

#[test]
fn torchtitan_02_names_and_qwen3_without_permutation() {
    let mut ckpt = torchtitan("", false, "output.weight");
    for t in &mut ckpt.tensors {
        t.name = t.name.replace("attention.qkv_linear.", "attention.");
    }
    let m = map(&ckpt, &config("LlamaForCausalLM", &[])).unwrap();
    assert_eq!(m.naming, Naming::Torchtitan02);
    assert_eq!(targets(&m), hf_names("LlamaForCausalLM", false));

    let cfg = config("Qwen3ForCausalLM", &[("tie_word_embeddings", true.into())]);
    let m = map(&torchtitan("", true, "lm_head.weight"), &cfg).unwrap();
    assert_eq!(targets(&m), hf_names("Qwen3ForCausalLM", true));
    assert!(m.placed.iter().all(|p| p.view == ViewKind::Rename));
    let lm = m
        .left_out
        .iter()
        .find(|l| l.name == "lm_head.weight")
        .unwrap();
    assert!(lm.why.contains("tie_word_embeddings"));
}

#[test]
fn hugging_face_names_under_an_app_state_prefix() {
    let cfg = config("Qwen2ForCausalLM", &[]);
    let mut ts = Vec::new();
    for name in hf_names("Qwen2ForCausalLM", false) {
        let shape: Vec<u64> = match name.rsplit('.').nth(1).unwrap() {
            "embed_tokens" | "lm_head" => vec![11, 8],
            "q_proj" if name.ends_with("bias") => vec![12],
            "k_proj" | "v_proj" if name.ends_with("bias") => vec![6],
            "q_proj" => vec![12, 8],
            "k_proj" | "v_proj" => vec![6, 8],
            "o_proj" => vec![8, 12],
            "gate_proj" | "up_proj" => vec![10, 8],
            "down_proj" => vec![8, 10],
            _ => vec![8],
        };
        ts.push(tensor(&format!("model.{name}"), &shape));
        ts.push(tensor(
            &format!("optimizer.state.model.{name}.exp_avg"),
            &shape,
        ));
    }
    ts.push(tensor(
        "model.model.layers.0.self_attn.rotary_emb.inv_freq",
        &[3],
    ));
    ts.reverse();
    let m = map(&checkpoint(ts), &cfg).unwrap();
    assert_eq!(m.naming, Naming::HuggingFace);
    assert_eq!(m.prefix, "model.");
    assert_eq!(targets(&m), hf_names("Qwen2ForCausalLM", false));
    let inv = m
        .left_out
        .iter()
        .find(|l| l.name.ends_with("inv_freq"))
        .unwrap();
    assert!(inv.why.contains("buffer"));
}

fn usage_error(ckpt: &Checkpoint, cfg: &HfConfig) -> crate::error::Error {
    let e = map(ckpt, cfg).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Usage, "{}", e.message);
    e
}

#[test]
fn a_config_that_disagrees_names_the_tensor_the_field_and_both_values() {
    let ckpt = torchtitan("", false, "lm_head.weight");
    // 2 KV heads of 6 rows, where the tensors have 1.
    let e = usage_error(
        &ckpt,
        &config("LlamaForCausalLM", &[("num_key_value_heads", 2.into())]),
    );
    assert_eq!(
        e.tensor.as_deref(),
        Some("layers.0.attention.qkv_linear.wk.weight")
    );
    assert!(
        e.message
            .contains("`num_key_value_heads` × `head_dim` = 2 × 6 = 12"),
        "{}",
        e.message
    );
    assert!(e.message.contains("has 6 in dim 0"), "{}", e.message);
    // head_dim from hidden/heads (4) where the config has none: the tensors' 6 disagree.
    let e = usage_error(
        &ckpt,
        &config("LlamaForCausalLM", &[("head_dim", Value::Null)]),
    );
    assert!(e.message.contains("`head_dim`"), "{}", e.message);
    for (field, value, says) in [
        ("hidden_size", 16, "`hidden_size` = 16"),
        ("intermediate_size", 12, "`intermediate_size` = 12"),
        ("vocab_size", 12, "`vocab_size` = 12"),
    ] {
        let e = usage_error(&ckpt, &config("LlamaForCausalLM", &[(field, value.into())]));
        assert!(e.message.contains(says), "{field}: {}", e.message);
        assert!(e.tensor.is_some(), "{field}");
    }
    // Fewer layers in the config than in the checkpoint, and more.
    let e = usage_error(
        &ckpt,
        &config("LlamaForCausalLM", &[("num_hidden_layers", 1.into())]),
    );
    assert!(
        e.message.contains("layer 1") && e.message.contains("`num_hidden_layers` is 1"),
        "{}",
        e.message
    );
    let e = usage_error(
        &ckpt,
        &config("LlamaForCausalLM", &[("num_hidden_layers", 3.into())]),
    );
    assert!(
        e.message
            .contains("`model.layers.2.self_attn.q_proj.weight`"),
        "{}",
        e.message
    );
    assert!(
        e.message
            .contains("`layers.2.attention.qkv_linear.wq.weight`"),
        "{}",
        e.message
    );
    // A Qwen2 config for a torchtitan checkpoint: no such map.
    let e = usage_error(&ckpt, &config("Qwen2ForCausalLM", &[]));
    assert!(e.message.contains("no map"), "{}", e.message);
    // A Qwen3 config for a Llama: the q/k norms are missing.
    let e = usage_error(&ckpt, &config("Qwen3ForCausalLM", &[]));
    assert!(e.message.contains("q_norm"), "{}", e.message);
    // Untied config, tied checkpoint (no lm_head).
    let mut tied = torchtitan("", false, "lm_head.weight");
    tied.tensors.retain(|t| t.name != "lm_head.weight");
    let e = usage_error(&tied, &config("LlamaForCausalLM", &[]));
    assert!(e.message.contains("`lm_head.weight`"), "{}", e.message);
}

#[test]
fn a_model_tensor_the_map_does_not_place_is_named() {
    let mut ckpt = torchtitan("model.", false, "lm_head.weight");
    ckpt.tensors
        .push(tensor("model.layers.0.attention.sinks", &[2]));
    let e = usage_error(&ckpt, &config("LlamaForCausalLM", &[]));
    assert_eq!(e.tensor.as_deref(), Some("model.layers.0.attention.sinks"));
    assert!(e.hint.unwrap().contains("--exclude"));
    // Without any embedding, the naming is unknown.
    let ckpt = checkpoint(vec![tensor("encoder.weight", &[2])]);
    let e = usage_error(&ckpt, &config("LlamaForCausalLM", &[]));
    assert!(e.message.contains("naming is unknown"), "{}", e.message);
    // Two tensors for one parameter (0.2 and 0.3 names side by side).
    let mut ckpt = torchtitan("", false, "lm_head.weight");
    ckpt.tensors.push(tensor("output.weight", &[11, 8]));
    assert!(map(&ckpt, &config("LlamaForCausalLM", &[])).is_err());
}

#[test]
fn biases_follow_the_config_flags() {
    let ckpt = torchtitan("", false, "lm_head.weight");
    let m = map(&ckpt, &config("LlamaForCausalLM", &[])).unwrap();
    let mut hf: Vec<Tensor> = apply(ckpt.clone(), &config("LlamaForCausalLM", &[]), &m)
        .unwrap()
        .tensors;
    hf.push(tensor("model.layers.0.mlp.up_proj.bias", &[10]));
    let e = usage_error(&checkpoint(hf.clone()), &config("LlamaForCausalLM", &[]));
    assert!(e.message.contains("`mlp_bias` is false"), "{}", e.message);
    // With mlp_bias the others are missing.
    let e = usage_error(
        &checkpoint(hf),
        &config("LlamaForCausalLM", &[("mlp_bias", true.into())]),
    );
    assert!(e.message.contains("gate_proj.bias"), "{}", e.message);
}

#[test]
fn a_computed_tensor_is_not_permuted() {
    struct Nothing;
    impl crate::model::Compute for Nothing {
        fn compute(&self, _: &[u64], _: &[u64], _: &[u8], _: &mut [u8], _: DType) -> Result<()> {
            Ok(())
        }
    }
    let cfg = config("LlamaForCausalLM", &[]);
    let mut ckpt = torchtitan("", false, "lm_head.weight");
    let m = map(&ckpt, &cfg).unwrap();
    for t in &mut ckpt.tensors {
        t.pieces
            .set_computed(crate::model::Computed(Arc::new(Nothing)));
    }
    let e = apply(ckpt, &cfg, &m).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Usage);
}

/// torchtitan 0.3's DeepSeek-V3 of a small config: layer 0 dense, layer 1 of 3 routed experts and
/// a shared one; queries without a low-rank projection unless `q_lora`.
fn torchtitan_deepseek(q_lora: bool) -> Checkpoint {
    let mut ts = vec![tensor("tok_embeddings.weight", &[11, 8])];
    for l in 0..2 {
        let p = format!("layers.{l}.");
        if q_lora {
            ts.push(tensor(&format!("{p}attention.wq_a.weight"), &[4, 8]));
            ts.push(tensor(&format!("{p}attention.q_norm.weight"), &[4]));
            ts.push(tensor(&format!("{p}attention.wq_b.weight"), &[10, 4]));
        } else {
            ts.push(tensor(&format!("{p}attention.wq.weight"), &[10, 8]));
        }
        ts.push(tensor(&format!("{p}attention.wkv_a.weight"), &[6, 8]));
        ts.push(tensor(&format!("{p}attention.kv_norm.weight"), &[4]));
        ts.push(tensor(&format!("{p}attention.wkv_b.weight"), &[12, 4]));
        ts.push(tensor(&format!("{p}attention.wo.weight"), &[8, 6]));
        if l == 0 {
            ts.push(tensor(&format!("{p}feed_forward.w1.weight"), &[10, 8]));
            ts.push(tensor(&format!("{p}feed_forward.w2.weight"), &[8, 10]));
            ts.push(tensor(&format!("{p}feed_forward.w3.weight"), &[10, 8]));
        } else {
            let e = format!("{p}moe.routed_experts.inner_experts.");
            ts.push(tensor(&format!("{e}w1_EFD"), &[3, 5, 8]));
            ts.push(tensor(&format!("{e}w2_EDF"), &[3, 8, 5]));
            ts.push(tensor(&format!("{e}w3_EFD"), &[3, 5, 8]));
            ts.push(tensor(&format!("{p}moe.router.gate.weight"), &[3, 8]));
            ts.push(tensor(&format!("{p}moe.expert_bias_E"), &[3]));
            ts.push(tensor(&format!("{p}moe.shared_experts.w1.weight"), &[5, 8]));
            ts.push(tensor(&format!("{p}moe.shared_experts.w2.weight"), &[8, 5]));
            ts.push(tensor(&format!("{p}moe.shared_experts.w3.weight"), &[5, 8]));
        }
        ts.push(tensor(&format!("{p}attention_norm.weight"), &[8]));
        ts.push(tensor(&format!("{p}ffn_norm.weight"), &[8]));
    }
    ts.push(tensor("norm.weight", &[8]));
    ts.push(tensor("lm_head.weight", &[11, 8]));
    ts.push(tensor("mtp_layers.0.enorm.weight", &[8]));
    ts.push(tensor(
        "optimizer.state.layers.1.moe.expert_bias_E.exp_avg",
        &[3],
    ));
    checkpoint(ts)
}

fn deepseek_config(q_lora: bool) -> HfConfig {
    config(
        "DeepseekV3ForCausalLM",
        &[
            ("head_dim", Value::Null),
            ("num_key_value_heads", 2.into()),
            ("n_routed_experts", 3.into()),
            ("moe_intermediate_size", 5.into()),
            ("n_shared_experts", 1.into()),
            ("first_k_dense_replace", 1.into()),
            ("q_lora_rank", if q_lora { 4.into() } else { Value::Null }),
            ("kv_lora_rank", 4.into()),
            ("qk_rope_head_dim", 2.into()),
            ("qk_nope_head_dim", 3.into()),
            ("v_head_dim", 3.into()),
        ],
    )
}

#[test]
fn torchtitan_deepseek_v3_unstacks_the_experts() {
    for q_lora in [false, true] {
        let cfg = deepseek_config(q_lora);
        let ckpt = torchtitan_deepseek(q_lora);
        let m = map(&ckpt, &cfg).unwrap();
        assert_eq!(
            m.naming,
            Naming::Torchtitan,
            "0.3 although it has `attention.wq`"
        );
        let names = targets(&m);
        let q = if q_lora { 3 } else { 1 };
        // embed; 2 layers of (q + 4 attention + 2 norms), 3 dense MLPs, 3 experts x 3 + gate,
        // bias, 3 shared; norm; head.
        assert_eq!(
            names.len(),
            1 + 2 * (q + 4 + 2) + 3 + 9 + 2 + 3 + 2,
            "{names:?}"
        );
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        for e in 0..3 {
            for p in ["gate_proj", "up_proj", "down_proj"] {
                let name = format!("model.layers.1.mlp.experts.{e}.{p}.weight");
                assert!(names.contains(&name), "{name}");
            }
        }
        assert!(names.contains(&"model.layers.1.mlp.gate.e_score_correction_bias".to_string()));
        assert!(!names.iter().any(|n| n.contains("layers.0.mlp.experts")));
        let why = |name: &str| m.left_out.iter().find(|l| l.name == name).unwrap().why;
        assert!(why("mtp_layers.0.enorm.weight").contains("does not have"));
        let out = apply(ckpt, &cfg, &m).unwrap();
        let down = out
            .tensors
            .iter()
            .find(|t| t.name == "model.layers.1.mlp.experts.2.down_proj.weight")
            .unwrap();
        assert_eq!(down.shape, vec![8, 5]);
        assert_eq!(down.pieces.get(0).offset(), 2 * 40 * 4);
    }
}

#[test]
fn deepseek_v3_errors_name_its_fields() {
    let ckpt = torchtitan_deepseek(false);
    let e = usage_error(&ckpt, &deepseek_config(true));
    assert!(e.message.contains("`q_lora_rank` is set"), "{}", e.message);
    let mut cfg = deepseek_config(false);
    cfg = {
        let mut json: Map<String, Value> =
            serde_json::from_slice(&cfg.json_with_dtype(DType::F32)).unwrap();
        json.insert("n_routed_experts".into(), 4.into());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        HfConfig::read(&path).unwrap()
    };
    let e = usage_error(&ckpt, &cfg);
    assert!(
        e.message.contains("`n_routed_experts` = 4"),
        "{}",
        e.message
    );
    assert_eq!(
        e.tensor.as_deref(),
        Some("layers.1.moe.routed_experts.inner_experts.w1_EFD")
    );
    // Without the expert bias (torchtitan without load balancing) the router starts at zero.
    let mut ckpt = torchtitan_deepseek(false);
    ckpt.tensors.retain(|t| !t.name.ends_with("expert_bias_E"));
    let m = map(&ckpt, &deepseek_config(false)).unwrap();
    assert!(!targets(&m).iter().any(|n| n.contains("e_score")));
    // Another architecture's config lacks DeepSeek-V3's fields.
    let e = usage_error(&ckpt, &config("DeepseekV3ForCausalLM", &[]));
    assert!(e.message.contains("is missing"), "{}", e.message);
}

/// Megatron-core's names of the small config's model (2 query heads and 1 group of head_dim 6:
/// 24 fused QKV rows), layer-stacked, the vocabulary padded to 16 rows.
fn megatron(extra: &[(&str, &[u64])]) -> Checkpoint {
    let mut ts = vec![
        tensor("embedding.word_embeddings.weight", &[16, 8]),
        tensor(
            "decoder.layers.self_attention.linear_qkv.weight",
            &[2, 24, 8],
        ),
        tensor(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            &[2, 8],
        ),
        tensor(
            "decoder.layers.self_attention.linear_proj.weight",
            &[2, 8, 12],
        ),
        tensor("decoder.layers.mlp.linear_fc1.weight", &[2, 20, 8]),
        tensor("decoder.layers.mlp.linear_fc1.layer_norm_weight", &[2, 8]),
        tensor("decoder.layers.mlp.linear_fc2.weight", &[2, 8, 10]),
        tensor("decoder.final_layernorm.weight", &[8]),
        tensor("output_layer.weight", &[16, 8]),
        // Non-distributed optimizer state keyed by the model's names: a trap for suffixes.
        tensor(
            "optimizer.state.exp_avg.embedding.word_embeddings.weight",
            &[16, 8],
        ),
    ];
    for (name, shape) in extra {
        ts.push(tensor(name, shape));
    }
    checkpoint(ts)
}

#[test]
fn megatron_layers_are_unstacked_and_split() {
    let cfg = config("LlamaForCausalLM", &[]);
    let m = map(&megatron(&[]), &cfg).unwrap();
    assert_eq!(m.naming, Naming::Megatron);
    assert_eq!(m.prefix, "");
    assert_eq!(targets(&m), hf_names("LlamaForCausalLM", false));
    let out = apply(megatron(&[]), &cfg, &m).unwrap();
    let get = |name: &str| out.tensors.iter().find(|t| t.name == name).unwrap();
    assert_eq!(get("model.embed_tokens.weight").shape, vec![11, 8]);
    let k = get("model.layers.1.self_attn.k_proj.weight");
    assert_eq!(k.shape, vec![6, 8]);
    // Layer 1's fused rows start 24 rows in; its key rows 12 further.
    assert_eq!(k.pieces.get(0).offset(), (24 + 12) * 8 * 4);
    let up = get("model.layers.0.mlp.up_proj.weight");
    assert_eq!(
        (up.shape.clone(), up.pieces.get(0).offset()),
        (vec![10, 8], 10 * 8 * 4)
    );

    let cfg = config("Qwen3ForCausalLM", &[]);
    let norms: &[(&str, &[u64])] = &[
        ("decoder.layers.self_attention.q_layernorm.weight", &[2, 6]),
        ("decoder.layers.self_attention.k_layernorm.weight", &[2, 6]),
    ];
    let m = map(&megatron(norms), &cfg).unwrap();
    assert_eq!(targets(&m), hf_names("Qwen3ForCausalLM", false));
    let cfg = config("Qwen2ForCausalLM", &[("tie_word_embeddings", true.into())]);
    let mut ckpt = megatron(&[("decoder.layers.self_attention.linear_qkv.bias", &[2, 24])]);
    ckpt.tensors.retain(|t| t.name != "output_layer.weight");
    let m = map(&ckpt, &cfg).unwrap();
    assert_eq!(targets(&m), hf_names("Qwen2ForCausalLM", true));
}

#[test]
fn megatron_per_layer_keys_map_as_the_stacked_ones() {
    let stacked = megatron(&[]);
    let mut per_layer = Vec::new();
    for t in &stacked.tensors {
        match t.name.strip_prefix("decoder.layers.") {
            Some(rest) => {
                for l in 0..2 {
                    per_layer.push(tensor(&format!("decoder.layers.{l}.{rest}"), &t.shape[1..]));
                }
            }
            None => per_layer.push(t.clone()),
        }
    }
    let cfg = config("LlamaForCausalLM", &[]);
    let m = map(&checkpoint(per_layer), &cfg).unwrap();
    assert_eq!(targets(&m), hf_names("LlamaForCausalLM", false));
    assert!(m.placed.iter().all(|p| p.stack.is_empty()));
}

#[test]
fn megatron_errors_name_the_config_field() {
    let e = usage_error(
        &megatron(&[]),
        &config("LlamaForCausalLM", &[("num_key_value_heads", 2.into())]),
    );
    assert_eq!(
        e.tensor.as_deref(),
        Some("decoder.layers.self_attention.linear_qkv.weight")
    );
    assert!(e.message.contains("`num_key_value_heads`"), "{}", e.message);
    let e = usage_error(
        &megatron(&[]),
        &config("LlamaForCausalLM", &[("num_hidden_layers", 3.into())]),
    );
    assert!(
        e.message.contains("`num_hidden_layers` = 3"),
        "{}",
        e.message
    );
    let e = usage_error(
        &megatron(&[]),
        &config("LlamaForCausalLM", &[("vocab_size", 17.into())]),
    );
    assert!(e.message.contains("`vocab_size` = 17"), "{}", e.message);
}

#[test]
fn huge_config_sizes_are_errors_not_overflows() {
    let huge = Value::from(u64::MAX / 2);
    for field in ["num_attention_heads", "head_dim", "num_key_value_heads"] {
        let cfg = config("LlamaForCausalLM", &[(field, huge.clone())]);
        usage_error(&torchtitan("", false, "lm_head.weight"), &cfg);
        usage_error(&megatron(&[]), &cfg);
    }
    let mut cfg = deepseek_config(false);
    cfg.heads = u64::MAX / 2;
    usage_error(&torchtitan_deepseek(false), &cfg);
}
