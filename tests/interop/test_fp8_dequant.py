"""Blockwise-FP8 releases (DeepSeek-V3's and Kimi K2's layout: each linear weight `F8_E4M3` with a
`<name>_scale_inv` of one `F32` per 128×128 tile, `quantization_config.weight_block_size`)
dequantized on the way, exactly as DeepSeek's `weight_dequant` and its `fp8_cast_bf16.py` make
the bf16 weights: `fp8.float() * scale_inv` of the element's tile (edge tiles partial), rounded to
bf16. The release is written by transformers itself (a tiny DeepSeek-V3 with dims over 128 and
not multiples of 128) and quantized by the torch reference rule; every dequantized tensor equals
the torch reference bit for bit:

- `consolidate REL -o OUT --hf-config REL` writes the plain bf16 model (config.json without its
  quantization_config), which transformers loads;
- `reshard REL -o TT --format torchtitan` writes torchtitan's tensors from it (routed experts
  stacked from the per-expert weights, computed a run of rows at a time), which exported back
  are the same bf16 model; also in 3 `--part`s and with `--dtype float32`."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_ckpt
# the blockwise rule (amax / 448 per 128×128 tile, edge tiles zero-padded) and the directory
# reader of the FP8 export's tests
from test_fp8_sharded import read_dir
from test_fp8_sharded import reference as quantize

transformers = pytest.importorskip("transformers")


def weight_dequant(q: torch.Tensor, s: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """DeepSeek's `weight_dequant`, in torch: each element times its tile's scale, in f32."""
    rows, cols = q.shape
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (q.float() * full).to(dtype)


@functools.cache
def release(root: Path) -> Path:
    """A tiny DeepSeek-V3 release, quantized as DeepSeek ships V3: its linear weights (attention,
    dense MLP, routed and shared experts) FP8 with scales, the rest bf16."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=250, hidden_size=288, intermediate_size=352, moe_intermediate_size=160,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=192, kv_lora_rank=160, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=80,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        rope_interleave=True, tie_word_embeddings=False, num_nextn_predict_layers=0,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    bf16 = root / "bf16"
    model.save_pretrained(bf16)
    state = read_dir(bf16)
    quantized = {}
    for k, v in state.items():
        if k.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            quantized[k], quantized[k + "_scale_inv"] = quantize(v)
        else:
            quantized[k] = v
    rel = root / "fp8"
    rel.mkdir()
    # Split in two files with an index, as releases are.
    names = sorted(quantized)
    index = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        f = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: quantized[k].contiguous() for k in part}, str(rel / f), metadata={"format": "pt"})
        index.update({k: f for k in part})
    (rel / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    }
    (rel / "config.json").write_text(json.dumps(config, indent=2))
    return rel


@pytest.fixture(scope="module")
def rel(tmp_path_factory):
    return release(tmp_path_factory.mktemp("fp8_release"))


def reference(rel: Path, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    q = read_dir(rel)
    out = {}
    for k, v in q.items():
        if k.endswith("_scale_inv"):
            continue
        out[k] = weight_dequant(v, q[k + "_scale_inv"], dtype) if v.dtype == torch.float8_e4m3fn else v.to(dtype)
    return out


def assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for k, w in want.items():
        assert got[k].dtype == w.dtype and torch.equal(got[k], w), k


def test_consolidate_of_a_release_writes_its_dequantized_model(rel, tmp_path):
    out = tmp_path / "out"
    r = run_ckpt("consolidate", rel, "-o", out, "--hf-config", rel)
    assert r.returncode == 0, r.stderr
    assert "dequantized 28 blockwise-FP8 weights" in r.stderr, r.stderr
    assert_same(read_dir(out), reference(rel))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    # transformers loads it as the plain model
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, reference(rel)["model.layers.0.mlp.gate_proj.weight"])


def test_dtype_float32_rounds_the_same_products_to_f32(rel, tmp_path):
    out = tmp_path / "out"
    r = run_ckpt("consolidate", rel, "-o", out, "--hf-config", rel, "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert_same(read_dir(out), reference(rel, torch.float32))


def test_torchtitan_import_of_a_release_is_its_dequantized_model(rel, tmp_path):
    """torchtitan's DeepSeek-V3 stacks the routed experts: each stack is the experts' dequantized
    weights, and exported back to Hugging Face names the import is the dequantized release."""
    tt = tmp_path / "tt"
    r = run_ckpt("reshard", rel, "-o", tt, "--format", "torchtitan", "--world-size", "2")
    assert r.returncode == 0, r.stderr
    want = reference(rel)
    # the stacked experts as torchtitan holds them
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tt, tmp_path / "tt.pt")
    held = torch.load(tmp_path / "tt.pt", weights_only=True)
    stack = held["layers.1.moe.routed_experts.inner_experts.w1_EFD"]
    assert stack.dtype == torch.bfloat16 and stack.shape == (4, 160, 288)
    for e in range(4):
        assert torch.equal(stack[e], want[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"]), e
    back = tmp_path / "back"
    plain = tmp_path / "plain_config"
    plain.mkdir()
    config = json.loads((rel / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    r = run_ckpt("consolidate", tt, "-o", back, "--hf-config", plain)
    assert r.returncode == 0, r.stderr
    assert_same(read_dir(back), want)
    # three parts of one run write the single run's files
    parts = tmp_path / "parts"
    for i in range(3):
        r = run_ckpt("reshard", rel, "-o", parts, "--format", "torchtitan", "--world-size", "2", "--part", f"{i}/3")
        assert r.returncode == 0, r.stderr
    for f in tt.iterdir():
        if f.name != ".metadata":  # its save_id is the run's own
            assert (parts / f.name).read_bytes() == f.read_bytes(), f.name


def test_an_fp8_weight_without_scales_is_refused(rel, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    q = read_dir(rel)
    del q["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(q, str(broken / "model.safetensors"))
    (broken / "config.json").write_bytes((rel / "config.json").read_bytes())
    out = tmp_path / "out"
    r = run_ckpt("consolidate", broken, "-o", out, "--hf-config", broken)
    assert r.returncode == 2, r.stderr
    assert "model.layers.0.self_attn.o_proj.weight" in r.stderr and "_scale_inv" in r.stderr, r.stderr
    assert not out.exists()
