//! The Hugging Face model directory `--hf-config` names: its config.json, read for the
//! architecture and the sizes the tensors must agree with, and written back with the output's
//! dtype; and the files beside it (tokenizer, generation config) that an inference engine loads
//! with the weights, copied byte for byte.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::tables::{self, Arch, Dim, MoeLayers, When};
use super::views::Sizes;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transform::fp8::dequant::Block;

/// config.json's name in a model directory.
pub(crate) const CONFIG_JSON: &str = "config.json";

/// What an export needs of a Hugging Face config.
#[derive(Clone, Debug)]
pub(crate) struct HfConfig {
    /// The config.json read.
    pub path: PathBuf,
    /// The directory whose other files go with the output; `None` when `--hf-config` named
    /// config.json itself.
    pub dir: Option<PathBuf>,
    json: Map<String, Value>,
    pub arch: &'static Arch,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub layers: u64,
    pub inter: u64,
    pub vocab: u64,
    pub tied: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// The fields of mixture-of-experts and latent-attention models, by name
    /// (`n_routed_experts`, `kv_lora_rank`, ...), where the config has them: read only for the
    /// dims and layers of the architecture's parameters.
    moe: Vec<(&'static str, u64)>,
    /// Qwen3-MoE's `mlp_only_layers`: layers with a dense MLP among mixture-of-experts ones.
    mlp_only_layers: Vec<u64>,
    /// Multi-token prediction layers the model has after its decoder's
    /// (`num_nextn_predict_layers`); 0 with `--no-mtp`.
    pub mtp_layers: u64,
    /// `--no-mtp`: the checkpoint's MTP layers are left out (and the output's config says 0).
    pub no_mtp: bool,
    /// A blockwise-FP8 release's tiles (`quantization_config` with `quant_method` `fp8` and
    /// `weight_block_size`), whose weights are dequantized on the way.
    pub fp8_block: Option<Block>,
}

/// The fields of mixture-of-experts and latent-attention models, zero allowed.
const MOE_FIELDS: [&str; 13] = [
    "n_routed_experts",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "num_nextn_predict_layers",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
];

/// The names of the number of routed experts, in the order they are looked for: DeepSeek's and
/// GLM's `n_routed_experts`, Qwen3-MoE's `num_experts`, Mixtral's and gpt-oss's
/// `num_local_experts` (which transformers 5 also writes for Qwen3-MoE).
const EXPERT_FIELDS: [&str; 3] = ["n_routed_experts", "num_experts", "num_local_experts"];

impl HfConfig {
    /// Read `--hf-config`: a model directory holding config.json, or a config.json.
    pub(crate) fn read(path: &Path) -> Result<HfConfig> {
        // Through storage: a model directory in an object store serves as well.
        let (file, dir) = if crate::storage::is_dir(path) {
            (path.join(CONFIG_JSON), Some(path.to_path_buf()))
        } else {
            (path.to_path_buf(), None)
        };
        let text = crate::storage::read(&file).map_err(|e| {
            Error::usage(format!("cannot read `{}`: {}", file.display(), e.message))
                .hint("--hf-config takes the Hugging Face model directory the training started from, or its config.json")
        })?;
        let json: Map<String, Value> = serde_json::from_slice(&text)
            .map_err(|e| Error::usage(format!("`{}` is not a JSON object: {e}", file.display())))?;
        HfConfig::from_json(file, dir, json)
    }

    fn from_json(
        path: PathBuf,
        dir: Option<PathBuf>,
        json: Map<String, Value>,
    ) -> Result<HfConfig> {
        let bad = |field: &str, why: &str| {
            Error::usage(format!("config.json's `{field}` {why}")).file(&path)
        };
        let named = json
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str);
        let model_type = json.get("model_type").and_then(Value::as_str);
        let arch = match (named, model_type) {
            (Some(name), _) => tables::arch(name).ok_or_else(|| unknown(name, &path))?,
            // transformers' AutoModelForCausalLM goes by `model_type` alone.
            (None, Some(t)) => tables::ARCHS
                .iter()
                .find(|a| a.model_type == t)
                .ok_or_else(|| unknown(&format!("model_type {t}"), &path))?,
            (None, None) => return Err(bad("architectures", "is missing or empty")),
        };
        let named = named.is_some();
        let mut json = json;
        if !named {
            // vLLM goes by `architectures`: the output's config names it.
            json.insert("architectures".into(), Value::from(vec![arch.name]));
        }
        let int = |field: &str| -> Result<Option<u64>> {
            match json.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(Some)
                    .ok_or_else(|| bad(field, &format!("is {v}, not a positive integer"))),
            }
        };
        let need =
            |field: &str| -> Result<u64> { int(field)?.ok_or_else(|| bad(field, "is missing")) };
        let flag = |field: &str, default: bool| -> Result<bool> {
            match json.get(field) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(bad(field, &format!("is {v}, not true or false"))),
            }
        };
        for &(field, assumed) in arch.assumed_flags {
            if flag(field, assumed)? != assumed {
                return Err(bad(
                    field,
                    &format!("is {}, which ckpt's map of {} does not handle: it is written for {assumed}, as the released checkpoints have it", !assumed, arch.name),
                )
                .hint(format!("the tensors would be placed for a model with `{field}` {assumed}, which computes otherwise on the same weights")));
            }
        }
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let kv_heads = int("num_key_value_heads")?.unwrap_or(heads);
        // transformers' own default when the config has no head_dim (or null).
        let head_dim = match int("head_dim")? {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(bad(
                    "head_dim",
                    &format!("is missing and hidden_size {hidden} is not a multiple of num_attention_heads {heads}"),
                ))
            }
        };
        let mut moe = Vec::new();
        for field in MOE_FIELDS {
            match json.get(field) {
                None | Some(Value::Null) => {}
                Some(v) => moe.push((
                    field,
                    v.as_u64()
                        .ok_or_else(|| bad(field, &format!("is {v}, not an integer")))?,
                )),
            }
        }
        let mlp_only_layers = match json.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().ok_or_else(|| {
                        bad("mlp_only_layers", &format!("holds {v}, not a layer index"))
                    })
                })
                .collect::<Result<_>>()?,
            Some(v) => return Err(bad("mlp_only_layers", &format!("is {v}, not a list"))),
        };
        let fp8_block = fp8_block(&json).map_err(|why| bad("quantization_config", &why))?;
        let mtp_layers = moe
            .iter()
            .find(|(f, _)| *f == "num_nextn_predict_layers")
            .map_or(0, |(_, n)| *n);
        Ok(HfConfig {
            moe,
            mlp_only_layers,
            fp8_block,
            mtp_layers,
            no_mtp: false,
            arch,
            hidden,
            heads,
            kv_heads,
            head_dim,
            layers: need("num_hidden_layers")?,
            inter: need("intermediate_size")?,
            vocab: need("vocab_size")?,
            tied: flag("tie_word_embeddings", arch.tied_by_default)?,
            attention_bias: flag("attention_bias", false)?,
            mlp_bias: flag("mlp_bias", false)?,
            path,
            dir,
            json,
        })
    }

    /// What the views need of the config.
    pub(crate) fn sizes(&self) -> Sizes {
        Sizes {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            vocab: self.vocab,
        }
    }

    /// A mixture-of-experts or latent-attention field (see `MOE_FIELDS`), if the config has it.
    fn moe_field(&self, field: &str) -> Option<u64> {
        self.moe.iter().find(|(f, _)| *f == field).map(|(_, n)| *n)
    }

    /// `first_k_dense_replace`: how many leading layers are dense (transformers'
    /// DeepseekV3Config default where the config does not say).
    pub(crate) fn dense_layers(&self) -> u64 {
        self.moe_field("first_k_dense_replace").unwrap_or(3)
    }

    /// The fields that decide which layers are dense, as config.json gives them (for messages).
    pub(crate) fn moe_rule(&self) -> String {
        match self.arch.moe_layers {
            MoeLayers::None | MoeLayers::All => "architecture".to_string(),
            MoeLayers::AfterFirstDense => {
                format!("`first_k_dense_replace` = {}", self.dense_layers())
            }
            MoeLayers::SparseStep => format!(
                "`mlp_only_layers` = {:?} and `decoder_sparse_step` = {}",
                self.mlp_only_layers,
                self.moe_field("decoder_sparse_step").unwrap_or(1)
            ),
        }
    }

    /// Whether layer `layer` is a mixture of experts, by the architecture's rule.
    pub(crate) fn is_moe_layer(&self, layer: u64) -> bool {
        match self.arch.moe_layers {
            MoeLayers::None => false,
            MoeLayers::All => true,
            MoeLayers::AfterFirstDense => layer >= self.dense_layers(),
            // transformers' Qwen3MoeDecoderLayer: not in `mlp_only_layers`, experts, and every
            // `decoder_sparse_step`-th layer.
            MoeLayers::SparseStep => {
                let step = self.moe_field("decoder_sparse_step").unwrap_or(1);
                let experts = EXPERT_FIELDS.iter().find_map(|f| self.moe_field(f));
                !self.mlp_only_layers.contains(&layer)
                    && experts.unwrap_or(0) > 0
                    && step > 0
                    && (layer + 1) % step == 0
            }
        }
    }

    /// The same config, its model with `n` multi-token prediction layers (config.json as is).
    pub(crate) fn with_mtp_layers(&self, n: u64) -> HfConfig {
        HfConfig {
            mtp_layers: n,
            ..self.clone()
        }
    }

    /// The same config with `--no-mtp`: no multi-token prediction layer is written (config.json
    /// then says `num_nextn_predict_layers` 0) and the checkpoint's are left out.
    pub(crate) fn without_mtp(mut self) -> HfConfig {
        self.no_mtp = true;
        self.mtp_layers = 0;
        self
    }

    /// Whether the model has a parameter that is there `when`, in `layer` for a layer's.
    pub(crate) fn has(&self, when: When, layer: Option<u64>) -> bool {
        let q_lora = self.moe_field("q_lora_rank").is_some_and(|r| r > 0);
        match when {
            When::Always => true,
            When::AttentionBias => self.attention_bias,
            When::MlpBias => self.mlp_bias,
            When::Untied => !self.tied,
            When::DenseLayer => layer.is_some_and(|l| !self.is_moe_layer(l)),
            When::MoeLayer | When::MoeLayerIfSaved => layer.is_some_and(|l| self.is_moe_layer(l)),
            When::QLora => q_lora,
            When::NoQLora => !q_lora,
            When::MtpLayer => layer.is_some_and(|l| l >= self.layers),
            When::QkNorm => self.json.get("use_qk_norm").and_then(Value::as_bool) == Some(true),
        }
    }

    /// The size the config gives `dim`, and how it says so (for messages); an error naming the
    /// field the config lacks.
    pub(crate) fn size(&self, dim: Dim) -> Result<(u64, String)> {
        let field = |name: &str| {
            self.moe_field(name).ok_or_else(|| {
                Error::usage(format!(
                    "config.json's `{name}` is missing, which {} needs",
                    self.arch.name
                ))
                .file(&self.path)
            })
        };
        let one = |name: &str| -> Result<(u64, String)> {
            let n = field(name)?;
            Ok((n, format!("`{name}` = {n}")))
        };
        let product = |a: &str, x: u64, b: &str, y: u64| {
            // Saturating: the sizes come from a file, and a product past u64 only has to differ.
            let n = x.saturating_mul(y);
            (n, format!("`{a}` × {b} = {x} × {y} = {n}"))
        };
        Ok(match dim {
            Dim::Vocab => (self.vocab, format!("`vocab_size` = {}", self.vocab)),
            Dim::Hidden => (self.hidden, format!("`hidden_size` = {}", self.hidden)),
            Dim::Inter => (self.inter, format!("`intermediate_size` = {}", self.inter)),
            Dim::HeadSize => (self.head_dim, format!("`head_dim` = {}", self.head_dim)),
            Dim::QueryRows => product(
                "num_attention_heads",
                self.heads,
                "`head_dim`",
                self.head_dim,
            ),
            Dim::KvRows => product(
                "num_key_value_heads",
                self.kv_heads,
                "`head_dim`",
                self.head_dim,
            ),
            Dim::Experts => match EXPERT_FIELDS.iter().find(|f| self.moe_field(f).is_some()) {
                Some(name) => one(name)?,
                None => one(EXPERT_FIELDS[0])?,
            },
            Dim::Heads => (
                self.heads,
                format!("`num_attention_heads` = {}", self.heads),
            ),
            Dim::TwoInter => (
                self.inter.saturating_mul(2),
                format!(
                    "2 × `intermediate_size` = 2 × {} = {}",
                    self.inter,
                    self.inter.saturating_mul(2)
                ),
            ),
            Dim::TwoHidden => (
                self.hidden.saturating_mul(2),
                format!(
                    "2 × `hidden_size` = 2 × {} = {}",
                    self.hidden,
                    self.hidden.saturating_mul(2)
                ),
            ),
            Dim::MoeInter => one("moe_intermediate_size")?,
            Dim::QLoraRank => one("q_lora_rank")?,
            Dim::KvLoraRank => one("kv_lora_rank")?,
            Dim::SharedInter => {
                let (f, n) = (field("moe_intermediate_size")?, field("n_shared_experts")?);
                (
                    f.saturating_mul(n),
                    format!(
                        "`moe_intermediate_size` × `n_shared_experts` = {f} × {n} = {}",
                        f.saturating_mul(n)
                    ),
                )
            }
            Dim::KvARows => {
                let (r, p) = (field("kv_lora_rank")?, field("qk_rope_head_dim")?);
                (
                    r.saturating_add(p),
                    format!(
                        "`kv_lora_rank` + `qk_rope_head_dim` = {r} + {p} = {}",
                        r.saturating_add(p)
                    ),
                )
            }
            Dim::QkRows => {
                let (a, b) = (field("qk_nope_head_dim")?, field("qk_rope_head_dim")?);
                let what = format!("(`qk_nope_head_dim` + `qk_rope_head_dim`) = ({a} + {b})");
                product(
                    "num_attention_heads",
                    self.heads,
                    &what,
                    a.saturating_add(b),
                )
            }
            Dim::KvBRows => {
                let (a, b) = (field("qk_nope_head_dim")?, field("v_head_dim")?);
                let what = format!("(`qk_nope_head_dim` + `v_head_dim`) = ({a} + {b})");
                product(
                    "num_attention_heads",
                    self.heads,
                    &what,
                    a.saturating_add(b),
                )
            }
            Dim::VRows => {
                let v = field("v_head_dim")?;
                product("num_attention_heads", self.heads, "`v_head_dim`", v)
            }
        })
    }

    /// What a tensor's `n` in `dim` says of the config's fields, where the config's size is a
    /// sum or product of several (for messages): `head_dim` = 16 at `num_attention_heads` = 4,
    /// or the other way round, so the message shows the value the config should have had.
    pub(crate) fn implied(&self, dim: Dim, n: u64) -> Option<String> {
        let field = |name: &str| self.moe_field(name);
        // `n` = `a` × `b`: each field's value at the other's.
        let product = |a: &str, x: u64, b: &str, y: u64| {
            let mut readings = Vec::new();
            if x > 0 && n % x == 0 {
                readings.push(format!("`{b}` = {} at `{a}` = {x}", n / x));
            }
            if y > 0 && n % y == 0 {
                readings.push(format!("`{a}` = {} at `{b}` = {y}", n / y));
            }
            (!readings.is_empty()).then(|| readings.join(", or "))
        };
        // `n` = `a` + `b`: `a`'s value at `b`'s.
        let sum = |a: &str, b: &str, y: u64| {
            n.checked_sub(y)
                .map(|x| format!("`{a}` = {x} at `{b}` = {y}"))
        };
        match dim {
            Dim::QueryRows => product("num_attention_heads", self.heads, "head_dim", self.head_dim),
            Dim::KvRows => product(
                "num_key_value_heads",
                self.kv_heads,
                "head_dim",
                self.head_dim,
            ),
            Dim::VRows => product(
                "num_attention_heads",
                self.heads,
                "v_head_dim",
                field("v_head_dim")?,
            ),
            Dim::TwoInter => (n % 2 == 0).then(|| format!("`intermediate_size` = {}", n / 2)),
            Dim::SharedInter => product(
                "n_shared_experts",
                field("n_shared_experts")?,
                "moe_intermediate_size",
                field("moe_intermediate_size")?,
            ),
            Dim::KvARows => sum(
                "kv_lora_rank",
                "qk_rope_head_dim",
                field("qk_rope_head_dim")?,
            ),
            Dim::QkRows | Dim::KvBRows => {
                let per_head = (self.heads > 0 && n % self.heads == 0).then(|| n / self.heads)?;
                let (a, b) = match dim {
                    Dim::QkRows => ("qk_nope_head_dim", "qk_rope_head_dim"),
                    _ => ("qk_nope_head_dim", "v_head_dim"),
                };
                let (x, y) = (field(a)?, field(b)?);
                let mut readings = Vec::new();
                if let Some(v) = per_head.checked_sub(y) {
                    readings.push(format!("`{a}` = {v} at `{b}` = {y}"));
                }
                if let Some(v) = per_head.checked_sub(x) {
                    readings.push(format!("`{b}` = {v} at `{a}` = {x}"));
                }
                (!readings.is_empty()).then(|| {
                    format!(
                        "{} with `num_attention_heads` = {}",
                        readings.join(", or "),
                        self.heads
                    )
                })
            }
            _ => None,
        }
    }

    /// [`HfConfig::json_with`] of no quantization.
    #[cfg(test)]
    pub(crate) fn json_with_dtype(&self, dtype: DType) -> Vec<u8> {
        self.json_with(dtype, None)
    }

    /// config.json as written to the output: the input's, with each dtype field it has
    /// (`torch_dtype`, transformers 5's `dtype`; `torch_dtype` if neither) naming `dtype`, and
    /// `quantization` as its `quantization_config` when set.
    pub(crate) fn json_with(&self, dtype: DType, quantization: Option<Value>) -> Vec<u8> {
        let name = Value::String(dtype.torch_name().trim_start_matches("torch.").to_string());
        let mut json = self.json.clone();
        let mut set = false;
        for field in ["torch_dtype", "dtype"] {
            if let Some(v) = json.get_mut(field) {
                *v = name.clone();
                set = true;
            }
        }
        if !set {
            json.insert("torch_dtype".into(), name);
        }
        // A blockwise-FP8 release's own quantization is undone on the way (the weights are
        // dequantized); what the output holds is `quantization`'s.
        if self.fp8_block.is_some() {
            json.remove("quantization_config");
        }
        if self.no_mtp && json.contains_key("num_nextn_predict_layers") {
            json.insert("num_nextn_predict_layers".into(), Value::from(0));
        }
        if let Some(q) = quantization {
            json.insert("quantization_config".into(), q);
        }
        let mut out = serde_json::to_vec_pretty(&json).unwrap_or_default();
        out.push(b'\n');
        out
    }

    /// The files of the model directory that go with the weights (tokenizer, generation
    /// config, chat template...): every regular file but config.json, weights and their indexes,
    /// by name in the directory's order.
    pub(crate) fn companion_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let Some(dir) = &self.dir else {
            return Ok(Vec::new());
        };
        let mut names: Vec<String> = crate::storage::listing(dir)?
            .into_iter()
            .filter(|e| e.is_file() && is_companion(e.name()))
            .map(|e| e.name().to_string())
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let bytes = crate::storage::read(&dir.join(&name))?;
                Ok((name, bytes))
            })
            .collect()
    }
}

/// The tiles of a blockwise-FP8 release's `quantization_config`, or `None` for a model that is
/// not one; why a config that says FP8 cannot be read.
fn fp8_block(json: &Map<String, Value>) -> std::result::Result<Option<Block>, String> {
    let Some(q) = json.get("quantization_config").and_then(Value::as_object) else {
        return Ok(None);
    };
    if q.get("quant_method").and_then(Value::as_str) != Some("fp8") {
        return Ok(None);
    }
    let Some(size) = q.get("weight_block_size") else {
        return Err("is fp8 without `weight_block_size`: ckpt dequantizes blockwise FP8".into());
    };
    match size
        .as_array()
        .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
    {
        Some(v) if v.len() == 2 && v.iter().all(|n| n.is_some_and(|n| n > 0)) => Ok(Some(Block {
            rows: v[0].unwrap_or(1),
            cols: v[1].unwrap_or(1),
        })),
        _ => Err(format!(
            "has `weight_block_size` {size}, not two positive integers"
        )),
    }
}

/// The error for an architecture no table maps to.
fn unknown(name: &str, path: &Path) -> Error {
    let known: Vec<&str> = tables::ARCHS.iter().map(|a| a.name).collect();
    Error::usage(format!(
        "architecture `{name}` has no name map in ckpt; known: {}",
        known.join(", ")
    ))
    .file(path)
}

/// Whether a file of a model directory goes with an export: not config.json (written anew),
/// not weights or their index (the export writes its own), not hidden.
fn is_companion(name: &str) -> bool {
    const WEIGHTS: [&str; 13] = [
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".gguf",
        ".onnx",
        ".onnx_data",
        ".tflite",
        ".ot",
        ".index.json",
    ];
    name != CONFIG_JSON && !name.starts_with('.') && !WEIGHTS.iter().any(|w| name.ends_with(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> Result<HfConfig> {
        let json: Map<String, Value> = serde_json::from_str(json).unwrap();
        HfConfig::from_json(PathBuf::from("config.json"), None, json)
    }

    const LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "float32"}"#;

    #[test]
    fn sizes_come_from_the_config_with_transformers_defaults() {
        let c = config(LLAMA).unwrap();
        assert_eq!((c.heads, c.kv_heads, c.head_dim), (4, 2, 16));
        assert!(!c.tied);
        let c = config(&LLAMA.replace(
            "\"hidden_size\": 64",
            "\"hidden_size\": 64, \"head_dim\": 32, \"tie_word_embeddings\": true",
        ))
        .unwrap();
        assert_eq!(c.head_dim, 32);
        assert!(c.tied);
        assert_eq!(c.size(Dim::KvRows).unwrap().0, 64);
        assert!(c
            .size(Dim::KvRows)
            .unwrap()
            .1
            .contains("`num_key_value_heads`"));
        // A field of another architecture's is an error naming it.
        let e = c.size(Dim::Experts).unwrap_err();
        assert!(
            e.message.contains("`n_routed_experts` is missing"),
            "{}",
            e.message
        );
    }

    #[test]
    fn unknown_architectures_and_missing_fields_are_usage_errors() {
        let e = config(&LLAMA.replace("LlamaForCausalLM", "GPT2LMHeadModel")).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Usage);
        assert!(e.message.contains("`GPT2LMHeadModel`"), "{}", e.message);
        assert!(e.message.contains("Qwen3ForCausalLM"), "{}", e.message);
        // Without `architectures`, `model_type` names it, and the output's config says so.
        let c = config(&LLAMA.replace(
            "\"architectures\": [\"LlamaForCausalLM\"]",
            "\"model_type\": \"qwen3\"",
        ))
        .unwrap();
        assert_eq!(c.arch.name, "Qwen3ForCausalLM");
        let out: Value = serde_json::from_slice(&c.json_with_dtype(DType::F32)).unwrap();
        assert_eq!(out["architectures"][0], "Qwen3ForCausalLM");
        let e = config(&LLAMA.replace("\"vocab_size\": 100,", "")).unwrap_err();
        assert!(
            e.message.contains("`vocab_size` is missing"),
            "{}",
            e.message
        );
        let e = config(&LLAMA.replace(
            "\"num_attention_heads\": 4",
            "\"num_attention_heads\": \"4\"",
        ))
        .unwrap_err();
        assert!(e.message.contains("`num_attention_heads`"), "{}", e.message);
    }

    #[test]
    fn the_dtype_fields_name_the_written_dtype() {
        let c = config(LLAMA).unwrap();
        let out: Value = serde_json::from_slice(&c.json_with_dtype(DType::BF16)).unwrap();
        assert_eq!(out["torch_dtype"], "bfloat16");
        assert!(out.get("dtype").is_none());
        let c = config(&LLAMA.replace("\"torch_dtype\"", "\"dtype\"")).unwrap();
        let out: Value = serde_json::from_slice(&c.json_with_dtype(DType::F16)).unwrap();
        assert_eq!(out["dtype"], "float16");
        assert!(out.get("torch_dtype").is_none());
        // Everything else as it was, in its order.
        let keys: Vec<&String> = out.as_object().unwrap().keys().collect();
        assert_eq!(keys[0], "architectures");
    }

    #[test]
    fn companions_leave_out_weights_and_config() {
        for keep in [
            "tokenizer.json",
            "tokenizer.model",
            "merges.txt",
            "generation_config.json",
            "special_tokens_map.json",
        ] {
            assert!(is_companion(keep), "{keep}");
        }
        for skip in [
            "config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            ".gitattributes",
        ] {
            assert!(!is_companion(skip), "{skip}");
        }
    }
}
