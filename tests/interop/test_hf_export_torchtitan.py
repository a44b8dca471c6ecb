"""`ckpt consolidate CKPT -o OUTDIR --hf-config HF` (issue 26): a training checkpoint exported as a
Hugging Face model directory, held to what the training framework's own converter gives.

The inputs are real torchtitan 0.3.0 checkpoints (fixtures/generate_torchtitan.py: torchtitan's
Trainer and CheckpointManager, FSDP2 over 2 gloo ranks, 2 AdamW steps from its seed checkpoint) of
a Llama3 with GQA, a Qwen3 with tied embeddings and q/k norms, and a DeepSeek-V3 (MLA, a dense
layer then an MoE layer with routed and shared experts and `expert_bias_E`), and the Llama3 and
Qwen3 again with 2 heads of 32 (`_hd32`, the ones tests/interop/test_hf_export_vllm.py loads in
vLLM), fixtures/torchtitan_<model>/:

- `step-2/`: the DCP directory torchtitan wrote (model tensors at the top level under torchtitan's
  names, `attention.qkv_linear.wq.weight` with the RoPE rows interleaved; `optimizer.*`,
  `lr_scheduler.*`, `dataloader.*`, `train_state.*` beside them);
- `hf/`: the Hugging Face directory the training started from (config.json, generation_config.json,
  tokenizer.json, tokenizer_config.json; no weights);
- `expected/model.safetensors`: torchtitan's own `StateDictAdapter.to_hf` of the trained model;
  `expected/logits.safetensors`: the training model's F32 logits on a fixed batch (`input_ids`; for
  DeepSeek-V3 with the routed experts in F32, see fixtures/README.md).

For each: the export has the reference's tensors bit for bit and no other, transformers'
`from_pretrained(OUTDIR)` gives the training logits (within 1e-4 of the largest), config.json is
HF's but for its dtype field, the tokenizer and generation files are copied byte for byte, and
`--dtype bf16` equals torch's `.to(torch.bfloat16)` of the reference. A config that disagrees with
the tensors (each field the tensors fix: heads, KV heads, head_dim, hidden, intermediate, layers,
vocab; for DeepSeek-V3 the MLA ranks and head dims, experts, dense layers) exits 2 naming the field
and both values, and writes nothing; so does an architecture ckpt has no map for.

The references themselves are checked here too, without ckpt: transformers on hf/ plus
expected/model.safetensors gives expected/logits, and the reference is the DCP checkpoint's model
tensors renamed, with Llama's wq/wk rows put from torchtitan's interleaved RoPE order into HF's
(`HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i + j]`) and DeepSeek-V3's expert-stacked tensors unstacked.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_helpers import FIXTURES_DIR

import transformers
from transformers import AutoModelForCausalLM

# fixture name -> (DCP directory, HF architecture)
TORCHTITAN = {
    "torchtitan_llama3": ("step-2", "LlamaForCausalLM"),
    "torchtitan_qwen3": ("step-2", "Qwen3ForCausalLM"),
    "torchtitan_deepseek_v3": ("step-2", "DeepseekV3ForCausalLM"),
    # the Llama 3 and Qwen3 with 2 heads of 32 that vLLM loads (tests/interop/test_hf_export_vllm.py)
    "torchtitan_llama3_hd32": ("step-2", "LlamaForCausalLM"),
    "torchtitan_qwen3_hd32": ("step-2", "Qwen3ForCausalLM"),
    # trained until decisive, dims over 128, model-only BF16 saves (3 and 2 ranks), for the FP8
    # export (tests/interop/test_fp8_sharded.py)
    "torchtitan_qwen3_fp8": ("step-60", "Qwen3ForCausalLM"),
    "torchtitan_deepseek_v3_fp8": ("step-60", "DeepseekV3ForCausalLM"),
    # mixtures of experts (trained like the `_fp8` ones): Qwen3-MoE's experts one tensor each, as
    # its `to_hf` writes them; gpt-oss's fused and transposed, as transformers holds them (its
    # `to_hf` drops them: expected/ is built by that rule, fixtures/README.md)
    "torchtitan_qwen3_moe": ("step-60", "Qwen3MoeForCausalLM"),
    "torchtitan_gpt_oss": ("step-60", "GptOssForCausalLM"),
}
NAMES = sorted(TORCHTITAN)
# config.json's fields naming the dtype of the weights (transformers 5 writes `dtype`; older
# configs `torch_dtype`): the only ones an export may change
DTYPE_FIELDS = ("dtype", "torch_dtype")
# what `save_pretrained` / the tokenizer's `save_pretrained` wrote beside config.json
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def fixture(name: str) -> Path:
    return FIXTURES_DIR / name


def ckpt_dir(name: str) -> Path:
    return fixture(name) / TORCHTITAN[name][0]


def export(run_ckpt, name: str, out: Path, *extra, hf: Path | None = None):
    return run_ckpt(
        "consolidate", ckpt_dir(name), "-o", out, "--hf-config", hf or fixture(name) / "hf", *extra
    )


def export_ok(run_ckpt, name: str, out: Path, *extra) -> Path:
    proc = export(run_ckpt, name, out, *extra)
    assert proc.returncode == 0, f"ckpt consolidate --hf-config exited {proc.returncode}:\n{proc.stderr}"
    return out


def read_export(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported directory, as `from_pretrained` finds them: one
    model.safetensors, or the files model.safetensors.index.json names; each file's metadata
    `{"format": "pt"}`, no name twice, the index naming each tensor's file."""
    index = out / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(out / f, framework="pt") as sf:
            assert (sf.metadata() or {}).get("format") == "pt", f
            for k in sf.keys():
                assert k not in tensors, f"{k} in two files"
                if weight_map is not None:
                    assert weight_map.get(k) == f, f"{k} is in {f}, the index says {weight_map.get(k)}"
                tensors[k] = sf.get_tensor(k)
    if weight_map is not None:
        assert sorted(weight_map) == sorted(tensors)
    return tensors


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), (
        f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}"
    )
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, f"{k}: {g.dtype} {list(g.shape)} != {w.dtype} {list(w.shape)}"
        assert bitwise(g, w), f"{k}: values differ (max {(g.double() - w.double()).abs().max().item()})"


def assert_logits_match(model_dir: Path, name: str) -> None:
    ref = load_file(fixture(name) / "expected" / "logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == TORCHTITAN[name][1]
    model.eval()
    with torch.no_grad():
        got = model(ref["input_ids"]).logits
    want = ref["logits"]
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4 * want.abs().max().item(), f"logits differ by {diff} (largest {want.abs().max().item()})"


def config_without_dtype(path: Path) -> dict:
    cfg = json.loads(path.read_text())
    for f in DTYPE_FIELDS:
        cfg.pop(f, None)
    if isinstance(cfg.get("text_config"), dict):
        for f in DTYPE_FIELDS:
            cfg["text_config"].pop(f, None)
    return cfg


def written_dtype(path: Path) -> str:
    cfg = json.loads(path.read_text())
    names = [cfg[f] for f in DTYPE_FIELDS if f in cfg]
    assert names, f"no dtype field in {path}"
    assert len(set(names)) == 1, names
    return names[0]


# ------------------------------------------------------------------------------------------------
# The references (no ckpt involved): they are what makes the export tests mean something.


@pytest.mark.parametrize("name", NAMES)
def test_reference_loads_in_transformers_with_the_training_logits(tmp_path, name):
    d = tmp_path / "ref"
    shutil.copytree(fixture(name) / "hf", d)
    shutil.copy(fixture(name) / "expected" / "model.safetensors", d)
    assert_logits_match(d, name)


@pytest.mark.parametrize("name", NAMES)
def test_reference_is_the_dcp_model_renamed_with_hf_rope_rows(tmp_path, name):
    """expected/model.safetensors against the DCP checkpoint read by torch's own reader, with the
    issue's map written out independently of torchtitan's adapter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt_dir(name), tmp_path / "all.pt")
    tt = torch.load(tmp_path / "all.pt", weights_only=False)
    keys = json.loads((fixture(name) / "expected" / "dcp_keys.json").read_text())
    model_keys = set(keys["model"])
    # the model at the top level; everything else under torchtitan's four state names
    assert all(k.split(".")[0] in {"optimizer", "lr_scheduler", "dataloader", "train_state"}
               for k in set(tt) - model_keys)
    cfg = json.loads((fixture(name) / "hf" / "config.json").read_text())
    hd, nh, nkv = cfg.get("head_dim"), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    llama = cfg["architectures"][0] == "LlamaForCausalLM"

    def rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
        # HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i + j]
        if not llama:  # Qwen3 in torchtitan already uses HF's rotate-half order
            return w
        return w.view(heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    per_layer = {
        # Llama, Qwen3
        "attention.qkv_linear.wq.weight": ("self_attn.q_proj.weight", lambda w: rope_rows(w, nh)),
        "attention.qkv_linear.wk.weight": ("self_attn.k_proj.weight", lambda w: rope_rows(w, nkv)),
        "attention.qkv_linear.wv.weight": ("self_attn.v_proj.weight", None),
        "attention.wo.weight": ("self_attn.o_proj.weight", None),
        "attention.q_norm.weight": ("self_attn.q_norm.weight", None),
        "attention.k_norm.weight": ("self_attn.k_norm.weight", None),
        "feed_forward.w1.weight": ("mlp.gate_proj.weight", None),
        "feed_forward.w3.weight": ("mlp.up_proj.weight", None),
        "feed_forward.w2.weight": ("mlp.down_proj.weight", None),
        "attention_norm.weight": ("input_layernorm.weight", None),
        "ffn_norm.weight": ("post_attention_layernorm.weight", None),
        # DeepSeek-V3: MLA (its RoPE halves stay interleaved, config.json's rope_interleave), MoE
        "attention.wq_a.weight": ("self_attn.q_a_proj.weight", None),
        "attention.wq_b.weight": ("self_attn.q_b_proj.weight", None),
        "attention.wkv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight", None),
        "attention.kv_norm.weight": ("self_attn.kv_a_layernorm.weight", None),
        "attention.wkv_b.weight": ("self_attn.kv_b_proj.weight", None),
        "moe.router.gate.weight": ("mlp.gate.weight", None),
        "moe.expert_bias_E": ("mlp.gate.e_score_correction_bias", None),
        "moe.shared_experts.w1.weight": ("mlp.shared_experts.gate_proj.weight", None),
        "moe.shared_experts.w3.weight": ("mlp.shared_experts.up_proj.weight", None),
        "moe.shared_experts.w2.weight": ("mlp.shared_experts.down_proj.weight", None),
        # gpt-oss: biases, a sink per head, a router with a bias, the experts fused as
        # transformers holds them ([E, 2F, D] -> [E, D, 2F], gate and up interleaved as they are)
        "attention.qkv_linear.wq.bias": ("self_attn.q_proj.bias", None),
        "attention.qkv_linear.wk.bias": ("self_attn.k_proj.bias", None),
        "attention.qkv_linear.wv.bias": ("self_attn.v_proj.bias", None),
        "attention.wo.bias": ("self_attn.o_proj.bias", None),
        "attention.sinks": ("self_attn.sinks", None),
        "moe.router.gate.bias": ("mlp.router.bias", None),
        "moe.routed_experts.inner_experts.mlp1_weight_EGD": ("mlp.experts.gate_up_proj", lambda w: w.transpose(1, 2)),
        "moe.routed_experts.inner_experts.mlp1_bias_EG": ("mlp.experts.gate_up_proj_bias", None),
        "moe.routed_experts.inner_experts.mlp2_weight_EDF": ("mlp.experts.down_proj", lambda w: w.transpose(1, 2)),
        "moe.routed_experts.inner_experts.mlp2_bias_ED": ("mlp.experts.down_proj_bias", None),
    }
    arch = cfg["architectures"][0]
    if arch == "GptOssForCausalLM":
        per_layer["moe.router.gate.weight"] = ("mlp.router.weight", None)
    if arch != "DeepseekV3ForCausalLM":
        # torchtitan's load-balancing bias: no place in Qwen3-MoE or gpt-oss (left out, said)
        per_layer["moe.expert_bias_E"] = (None, None)
    if arch == "DeepseekV3ForCausalLM":
        # MLA's q_norm is the norm of the query's low-rank projection (Qwen3's normalises heads)
        per_layer["attention.q_norm.weight"] = ("self_attn.q_a_layernorm.weight", None)
    # expert-stacked [E, F, D] / [E, D, F]: one HF tensor per expert
    experts = {
        "moe.routed_experts.inner_experts.w1_EFD": "gate_proj.weight",
        "moe.routed_experts.inner_experts.w3_EFD": "up_proj.weight",
        "moe.routed_experts.inner_experts.w2_EDF": "down_proj.weight",
    }
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    want = {}
    for k in model_keys:
        if k.startswith("layers.") and k.split(".", 2)[2] in experts:
            _, i, rest = k.split(".", 2)
            for e in range(tt[k].shape[0]):
                want[f"model.layers.{i}.mlp.experts.{e}.{experts[rest]}"] = tt[k][e]
        elif k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            hf_name, view = per_layer[rest]
            if hf_name is not None:
                want[f"model.layers.{i}.{hf_name}"] = view(tt[k]) if view else tt[k]
        elif k == "lm_head.weight" and cfg["tie_word_embeddings"]:
            assert torch.equal(tt[k], tt["tok_embeddings.weight"])  # one parameter, saved twice
        else:
            want[top[k]] = tt[k]
    assert_same_tensors(load_file(fixture(name) / "expected" / "model.safetensors"), want)


# ------------------------------------------------------------------------------------------------
# The export (ckpt consolidate --hf-config), to the contract.


@pytest.mark.parametrize("name", NAMES)
def test_export_equals_torchtitans_to_hf_bit_for_bit(ckpt, run_ckpt, tmp_path, name):
    out = export_ok(run_ckpt, name, tmp_path / "out")
    assert_same_tensors(read_export(out), load_file(fixture(name) / "expected" / "model.safetensors"))


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_in_transformers_with_the_training_logits(ckpt, run_ckpt, tmp_path, name):
    out = export_ok(run_ckpt, name, tmp_path / "out")
    assert_logits_match(out, name)


@pytest.mark.parametrize("name", NAMES)
def test_export_config_is_hfs_but_for_its_dtype(ckpt, run_ckpt, tmp_path, name):
    out = export_ok(run_ckpt, name, tmp_path / "out")
    assert config_without_dtype(out / "config.json") == config_without_dtype(fixture(name) / "hf" / "config.json")
    # what the checkpoint holds: F32 training saves, BF16 model-only ones (the `_fp8` fixtures)
    saved = {t.dtype for t in load_file(fixture(name) / "expected" / "model.safetensors").values()}
    assert written_dtype(out / "config.json") == ("bfloat16" if saved == {torch.bfloat16} else "float32")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_export_copies_tokenizer_and_generation_files_byte_for_byte(ckpt, run_ckpt, tmp_path, name):
    out = export_ok(run_ckpt, name, tmp_path / "out")
    for f in COPIED:
        assert (out / f).read_bytes() == (fixture(name) / "hf" / f).read_bytes(), f


@pytest.mark.parametrize("name", NAMES)
def test_export_bf16_equals_torch_cast_of_the_reference(ckpt, run_ckpt, tmp_path, name):
    out = export_ok(run_ckpt, name, tmp_path / "out", "--dtype", "bf16")
    ref = load_file(fixture(name) / "expected" / "model.safetensors")
    got = read_export(out)
    # transformers keeps some tensors F32 whatever the dtype (DeepseekV3's router:
    # `_keep_in_fp32_modules_strict` = e_score_correction_bias, gate.weight); an export may leave
    # those F32 (the reference's bits) or cast them like the rest
    cls = getattr(transformers, TORCHTITAN[name][1])
    keep_f32 = getattr(cls, "_keep_in_fp32_modules_strict", None) or []
    want = {}
    for k, v in ref.items():
        kept = any(m in k for m in keep_f32) and got.get(k) is not None and got[k].dtype == torch.float32
        want[k] = v if kept else v.to(torch.bfloat16)
    assert_same_tensors(got, want)
    assert written_dtype(out / "config.json") == "bfloat16"
    assert config_without_dtype(out / "config.json") == config_without_dtype(fixture(name) / "hf" / "config.json")


@pytest.mark.parametrize("name", NAMES)
def test_export_accepts_config_json_itself(ckpt, run_ckpt, tmp_path, name):
    """`--hf-config` may name config.json rather than its directory: the same weights and config."""
    proc = export(run_ckpt, name, tmp_path / "out", hf=fixture(name) / "hf" / "config.json")
    assert proc.returncode == 0, proc.stderr
    assert_same_tensors(read_export(tmp_path / "out"), load_file(fixture(name) / "expected" / "model.safetensors"))
    assert config_without_dtype(tmp_path / "out" / "config.json") == config_without_dtype(fixture(name) / "hf" / "config.json")


# field -> a wrong value, given the fixture's config (every one disagrees with the tensors' shapes)
WRONG_GQA = {
    # halved, or doubled where there is 1 (the hd32 fixtures): 0 would fail as not a count at all
    "num_key_value_heads": lambda c: c["num_key_value_heads"] // 2 or 2,
    "num_attention_heads": lambda c: c["num_attention_heads"] * 2,
    "head_dim": lambda c: c["head_dim"] * 2,
    "hidden_size": lambda c: c["hidden_size"] // 2,
    "intermediate_size": lambda c: c["intermediate_size"] + 8,
    "num_hidden_layers": lambda c: c["num_hidden_layers"] + 1,
    # larger, not smaller: fewer rows than the tensor would read as a padded vocabulary to trim
    "vocab_size": lambda c: c["vocab_size"] + 1,
}


# DeepSeek-V3's MLA has no KV heads of its own (num_key_value_heads is unused) and head_dim is
# qk_rope_head_dim; these are the fields its tensors do fix
WRONG_MLA_MOE = {
    "num_attention_heads": lambda c: c["num_attention_heads"] * 2,
    "q_lora_rank": lambda c: c["q_lora_rank"] * 2,
    "kv_lora_rank": lambda c: c["kv_lora_rank"] * 2,
    "qk_rope_head_dim": lambda c: c["qk_rope_head_dim"] * 2,
    "qk_nope_head_dim": lambda c: c["qk_nope_head_dim"] * 2,
    "v_head_dim": lambda c: c["v_head_dim"] * 2,
    "hidden_size": lambda c: c["hidden_size"] // 2,
    "intermediate_size": lambda c: c["intermediate_size"] + 8,
    "moe_intermediate_size": lambda c: c["moe_intermediate_size"] + 8,
    "n_routed_experts": lambda c: c["n_routed_experts"] * 2,
    "first_k_dense_replace": lambda c: c["first_k_dense_replace"] + 1,
    "num_hidden_layers": lambda c: c["num_hidden_layers"] + 1,
    "vocab_size": lambda c: c["vocab_size"] + 1,
}
# Qwen3-MoE: every layer a mixture of experts here, so `intermediate_size` (the dense MLP's) is
# not a size of any tensor: the experts' fields are
WRONG_QWEN3_MOE = {
    **{k: v for k, v in WRONG_GQA.items() if k != "intermediate_size"},
    "moe_intermediate_size": lambda c: c["moe_intermediate_size"] + 8,
    "num_local_experts": lambda c: c["num_local_experts"] * 2,
}
# gpt-oss: `intermediate_size` is each expert's
WRONG_GPT_OSS = {**WRONG_GQA, "num_local_experts": lambda c: c["num_local_experts"] * 2}
WRONG = {
    name: WRONG_MLA_MOE if "deepseek" in name
    else WRONG_QWEN3_MOE if "qwen3_moe" in name
    else WRONG_GPT_OSS if "gpt_oss" in name
    else WRONG_GQA
    for name in NAMES
}
WRONG_CASES = [(name, field) for name in NAMES for field in WRONG[name]]


@pytest.mark.parametrize("name,field", WRONG_CASES)
def test_a_config_disagreeing_with_the_tensors_exits_2_and_writes_nothing(ckpt, run_ckpt, tmp_path, name, field):
    hf = tmp_path / "hf"
    shutil.copytree(fixture(name) / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    good = cfg[field]
    cfg[field] = WRONG[name][field](cfg)
    assert cfg[field] != good
    (hf / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = export(run_ckpt, name, out, hf=hf)
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr}"
    # the message names the field and both values (the config's and the tensors')
    assert field in proc.stderr and str(cfg[field]) in proc.stderr and str(good) in proc.stderr, proc.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no staging left beside it


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_architecture_exits_2_and_writes_nothing(ckpt, run_ckpt, tmp_path, name):
    hf = tmp_path / "hf"
    shutil.copytree(fixture(name) / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["NoSuchModelForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = export(run_ckpt, name, out, hf=hf)
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr}"
    assert "NoSuchModelForCausalLM" in proc.stderr, proc.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
