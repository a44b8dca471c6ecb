"""`consolidate --hf-config` of Megatron-core mixtures of experts, saved by real megatron-core
0.16.1 (fixtures/generate_megatron_moe.py; fixtures/README.md says how): Qwen3-MoE at EP=1 and at
EP=2 (experts stacked over global indices, cut over the expert-parallel ranks), another Qwen3-MoE
at EP=2 with heads of 64 and experts of FFN 132 (the one test_hf_export_vllm.py loads in vLLM), DeepSeek-V3 at
TP=2 EP=2 (latent attention, a dense first layer, routed and shared experts, the routing bias, one
multi-token prediction layer), GLM-4.5 (QKV biases, partial RoPE, MTP) and Mixtral in BF16 at EP=2
(every layer MoE, experts of FFN 136 exported as `block_sparse_moe.experts.<e>.w1/w3/w2`, the
router as `block_sparse_moe.gate`). Judged by

- Megatron-Bridge 0.3.1's own mapping of the same checkpoint (megatron_bridge_export.py, run
  here): every tensor bit for bit, names included (where Bridge maps nothing, the MTP layers of
  DeepSeek-V3 and the MTP embedding and head copies of GLM-4.5, by its rules; Mixtral, for which
  0.3.1 has no bridge, through 0.3.1's mapping classes with the names of Bridge's unreleased
  Mixtral bridge);
- transformers' `from_pretrained` of the export: the trained Megatron model's logits on a fixed
  batch (fp32, within 1e-4 of the largest logit);
- the EP=1 and EP=2 saves of the same weights giving byte-identical exports;
- `--dtype bf16` equal to torch's `.to(torch.bfloat16)` of the export;
- `--no-mtp`, and a config.json that disagrees with the tensors: exit 2 naming the field and both
  values, nothing written.

The FP8 export of the experts is in test_fp8_sharded.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURES_DIR, run_ckpt
from test_hf_export import tensors_of

transformers = pytest.importorskip("transformers")

FIXTURES = ["megatron_qwen3_moe_ep1", "megatron_qwen3_moe_ep2", "megatron_qwen3_moe_vllm",
            "megatron_deepseek_v3", "megatron_glm4_moe", "megatron_mixtral"]


def src(name: str) -> Path:
    return FIXTURES_DIR / name / "ckpt"


def hf(name: str) -> Path:
    return FIXTURES_DIR / name / "hf"


def export(name: str, out: Path, *extra) -> Path:
    r = run_ckpt("consolidate", src(name), "-o", out, "--hf-config", hf(name), *extra)
    assert r.returncode == 0, r.stderr
    return out


def iteration(name: str) -> Path:
    root = src(name)
    return root / f"iter_{int((root / 'latest_checkpointed_iteration.txt').read_text()):07d}"


@pytest.mark.parametrize("name", FIXTURES)
def test_export_is_megatron_bridges_mapping_bit_for_bit(tmp_path, name):
    got = tensors_of(export(name, tmp_path / "out"))
    bridge = tmp_path / "bridge.safetensors"
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_bridge_export.py"),
                        str(iteration(name)), str(hf(name) / "config.json"), str(bridge)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = load_file(str(bridge))
    assert sorted(got) == sorted(reference)
    for k, want in reference.items():
        assert got[k].dtype == want.dtype, k
        assert torch.equal(got[k], want), k
    # the committed reference is the same run's
    assert bridge.read_bytes() == (FIXTURES_DIR / name / "expected" / "bridge.safetensors").read_bytes()


@pytest.mark.parametrize("name", FIXTURES)
def test_from_pretrained_gives_the_training_models_logits(tmp_path, name):
    out = export(name, tmp_path / "out")
    want = load_file(str(FIXTURES_DIR / name / "expected" / "logits.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=want["input_ids"]).logits
    tol = 1e-4 * want["logits"].abs().max().item()
    assert (got - want["logits"]).abs().max().item() <= tol
    # decisive: a misplaced expert would change the prediction, not only the last digits
    assert torch.equal(got.argmax(-1), want["logits"].argmax(-1))


def test_expert_parallel_saves_export_the_same_bytes(tmp_path):
    one = export("megatron_qwen3_moe_ep1", tmp_path / "ep1")
    two = export("megatron_qwen3_moe_ep2", tmp_path / "ep2")
    # the two saves hold the same weights cut differently: over TP=2 with the experts whole, and
    # over EP=2 with each rank's experts whole
    inspect = [json.loads(run_ckpt("inspect", src(n), "--json").stdout) for n in ("megatron_qwen3_moe_ep1", "megatron_qwen3_moe_ep2")]
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    pieces = [{tuple(p["offsets"]) for t in i["tensors"] if t["name"] == fc1 for p in t["pieces"]} for i in inspect]
    assert pieces[0] != pieces[1]
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir())
    for f in files:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f


@pytest.mark.parametrize("name", ["megatron_qwen3_moe_ep2", "megatron_deepseek_v3"])
def test_dtype_bf16_is_torchs_cast(tmp_path, name):
    full = tensors_of(export(name, tmp_path / "full"))
    bf16 = tensors_of(export(name, tmp_path / "bf16", "--dtype", "bf16"))
    assert sorted(full) == sorted(bf16)
    for k, w in full.items():
        assert bf16[k].dtype == torch.bfloat16, k
        assert torch.equal(bf16[k], w.to(torch.bfloat16)), k


def mtp_names(names) -> set:
    return {k for k in names if k.startswith("model.layers.2.")}


def test_mtp_layers_are_kept_and_left_out_only_with_no_mtp(tmp_path):
    name = "megatron_deepseek_v3"
    kept = tensors_of(export(name, tmp_path / "kept"))
    mtp = mtp_names(kept)
    # the MTP layer as DeepSeek-V3's release holds it: its own norms and projection, the shared
    # head, copies of the embedding and head, and a MoE transformer layer
    for own in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "shared_head.head.weight", "embed_tokens.weight", "mlp.experts.3.down_proj.weight",
                "self_attn.kv_a_proj_with_mqa.weight"):
        assert f"model.layers.2.{own}" in mtp, own
    assert torch.equal(kept["model.layers.2.embed_tokens.weight"], kept["model.embed_tokens.weight"])
    assert torch.equal(kept["model.layers.2.shared_head.head.weight"], kept["lm_head.weight"])
    assert json.loads((tmp_path / "kept" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    r = run_ckpt("consolidate", src(name), "-o", tmp_path / "without", "--hf-config", hf(name), "--no-mtp")
    assert r.returncode == 0, r.stderr
    assert "--no-mtp" in r.stderr
    without = tensors_of(tmp_path / "without")
    assert sorted(without) == sorted(set(kept) - mtp)
    for k, w in without.items():
        assert torch.equal(w, kept[k]), k
    assert json.loads((tmp_path / "without" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    # transformers loads either and predicts alike (it does not run the MTP layer)
    want = load_file(str(FIXTURES_DIR / name / "expected" / "logits.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "without"), dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(input_ids=want["input_ids"]).logits
    assert (got - want["logits"]).abs().max().item() <= 1e-4 * want["logits"].abs().max().item()


def edited_config(tmp_path: Path, name: str, **fields) -> Path:
    d = tmp_path / "hf"
    shutil.copytree(hf(name), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name, fields, says", [
    # an MTP layer the config does not have: kept only when asked for, never dropped silently
    ("megatron_deepseek_v3", {"num_nextn_predict_layers": 0}, ["num_nextn_predict_layers", "--no-mtp"]),
    ("megatron_qwen3_moe_ep2", {"num_experts": 5}, ["num_experts", "5", "4"]),
    ("megatron_qwen3_moe_ep2", {"moe_intermediate_size": 128}, ["moe_intermediate_size", "128", "144"]),
    ("megatron_deepseek_v3", {"n_routed_experts": 8}, ["n_routed_experts", "8", "4"]),
    ("megatron_deepseek_v3", {"first_k_dense_replace": 0}, ["first_k_dense_replace", "0"]),
    ("megatron_deepseek_v3", {"q_lora_rank": 128}, ["q_lora_rank", "128", "136"]),
    ("megatron_deepseek_v3", {"kv_lora_rank": 100}, ["kv_lora_rank", "100"]),
    # rope dims in halves rather than pairs: another model on the same weights
    ("megatron_deepseek_v3", {"rope_interleave": False}, ["rope_interleave", "false"]),
    ("megatron_glm4_moe", {"n_shared_experts": 2}, ["n_shared_experts", "2", "136"]),
    ("megatron_glm4_moe", {"first_k_dense_replace": 2}, ["first_k_dense_replace", "2"]),
    ("megatron_mixtral", {"num_local_experts": 8}, ["num_local_experts", "8", "4"]),
    ("megatron_mixtral", {"intermediate_size": 128}, ["intermediate_size", "128", "136"]),
])
def test_a_config_that_disagrees_is_refused_and_nothing_written(tmp_path, name, fields, says):
    cfg = edited_config(tmp_path, name, **fields)
    out = tmp_path / "out"
    r = run_ckpt("consolidate", src(name), "-o", out, "--hf-config", cfg)
    assert r.returncode == 2, r.stderr
    for s in says:
        assert s in r.stderr, (s, r.stderr)
    assert "panicked" not in r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def megatron_model_tensors(path: Path) -> dict:
    """The model's tensors of a Megatron `torch_dist` save (optimizer state and the linears'
    `_extra_state` left out), read by torch's own DCP reader."""
    from ckpt_helpers import load_with_torch

    return {k: v for k, v in load_with_torch(path).items()
            if isinstance(v, torch.Tensor) and not k.startswith("optimizer.") and "_extra_state" not in k}


@pytest.mark.parametrize("name", ["megatron_qwen3_moe_ep1", "megatron_deepseek_v3", "megatron_glm4_moe",
                                  "megatron_mixtral"])
def test_import_of_the_export_is_megatron_cores_own_save(tmp_path, name):
    """The export read back by `reshard --format megatron --transformer-impl local`: the keys,
    shapes, dtypes and values megatron-core's local spec saved, bit for bit (latent attention's
    norms under their own names, the MoE layers' pre-MLP norm under the local spec's fused name
    or its own, experts stacked, MTP layers under `mtp.layers`), but for the padding rows of the
    vocabulary, which the export drops and the import writes as zeros."""
    out = export(name, tmp_path / "hf")
    r = run_ckpt("reshard", out, "-o", tmp_path / "mg", "--format", "megatron", "--transformer-impl", "local",
                 "--world-size", "2")
    assert r.returncode == 0, r.stderr
    want = megatron_model_tensors(iteration(name))
    got = megatron_model_tensors(tmp_path / "mg" / "release")
    assert sorted(got) == sorted(want)
    vocab = json.loads((hf(name) / "config.json").read_text())["vocab_size"]
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            # the rows past the vocabulary are Megatron's padding, which the export drops and
            # the import writes as zeros
            assert torch.equal(got[k][:vocab], w[:vocab]), k
            assert not got[k][vocab:].any(), k
        else:
            assert torch.equal(got[k], w), k


@pytest.mark.parametrize("name, te, local", [
    # Transformer Engine's spec: a MoE layer's pre-MLP norm is a module of its own (there is no
    # linear to fuse it into), a dense layer's fused into linear_fc1, and latent attention's q
    # and kv norms fused into the up projections; the local spec maps a grouped-query layer's
    # norms onto the fused names (its sharded_state_dict_keys_map) but keeps latent
    # attention's as modules
    ("megatron_qwen3_moe_ep1",
     {"decoder.layers.pre_mlp_layernorm.weight"},
     {"decoder.layers.mlp.linear_fc1.layer_norm_weight"}),
    ("megatron_deepseek_v3",
     {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
      "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
      "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
      "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight"},
     {"decoder.layers.0.pre_mlp_layernorm.weight",
      "decoder.layers.1.self_attention.q_layernorm.weight",
      "decoder.layers.1.self_attention.kv_layernorm.weight",
      "mtp.layers.0.transformer_layer.self_attention.kv_layernorm.weight"}),
])
def test_import_names_norms_as_the_run_s_layer_spec_saves_them(tmp_path, name, te, local):
    out = export(name, tmp_path / "hf")
    names = {}
    for impl in ("transformer_engine", "local"):
        args = ["--transformer-impl", impl] if impl == "local" else []
        r = run_ckpt("reshard", out, "-o", tmp_path / impl, "--format", "megatron", *args)
        assert r.returncode == 0, r.stderr
        names[impl] = {t["name"] for t in json.loads(run_ckpt("inspect", tmp_path / impl, "--json").stdout)["tensors"]}
    # Megatron-LM's default is Transformer Engine's
    assert te <= names["transformer_engine"] - names["local"], sorted(te - names["transformer_engine"])
    assert local <= names["local"] - names["transformer_engine"], sorted(local - names["local"])
    assert len(names["local"]) == len(names["transformer_engine"])


def test_no_mtp_leaves_out_hugging_face_named_mtp_layers(tmp_path):
    """A checkpoint under Hugging Face's names (a release, or an accelerate save) holds its MTP
    layers as layers past the decoder's: --no-mtp leaves them out there too, and says so; a
    config.json without them refuses them as MTP layers, naming the field."""
    name = "megatron_deepseek_v3"
    full = export(name, tmp_path / "full")
    r = run_ckpt("consolidate", full, "-o", tmp_path / "without", "--hf-config", full, "--no-mtp")
    assert r.returncode == 0, r.stderr
    assert "--no-mtp" in r.stderr, r.stderr
    got = tensors_of(tmp_path / "without")
    kept = tensors_of(full)
    assert sorted(got) == sorted(k for k in kept if not k.startswith("model.layers.2."))
    for k, v in got.items():
        assert torch.equal(v, kept[k]), k
    assert json.loads((tmp_path / "without" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    cfg = edited_config(tmp_path, name, num_nextn_predict_layers=0)
    r = run_ckpt("consolidate", full, "-o", tmp_path / "refused", "--hf-config", cfg)
    assert r.returncode == 2, r.stderr
    assert "num_nextn_predict_layers" in r.stderr and "multi-token prediction layer 0" in r.stderr, r.stderr
    assert not (tmp_path / "refused").exists()
