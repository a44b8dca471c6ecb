"""`--quantize fp8-block` on real sharded training checkpoints, whose 128×128 tiles are assembled
from several pieces of the source: FSDP2 shard boundaries inside 128-row bands (2 and 3 ranks),
Megatron-core TP=2 saves (QKV interleaved per query group over the ranks, `[gate; up]` split from
a TP-sharded `linear_fc1`, a padded vocabulary; fp32 and bf16 parameters), and a DeepSeek-V3-style
torchtitan MoE (stacked experts). The fixtures are the trainers' own saves (see
fixtures/README.md); every model was trained to decisive predictions.

The invariant: for every FP8 weight, the codes and `_scale_inv` equal the torch reference
quantizer (per tile amax / 448, edge tiles zero-padded, x / scale clamped to ±448 and rounded to
nearest even) applied to the `--dtype bf16` export of the same checkpoint, bit for bit; every other
tensor is the bf16 export's; a `--part` run and an `s3://` output write the same bytes; and the
model dequantized tile by tile (transformers' own `_dequantize_fp8_weight` with block 128×128)
predicts the bf16 export's next token at >= 95% of positions."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import FIXTURES_DIR, run_ckpt

transformers = pytest.importorskip("transformers")

# fixture -> (checkpoint, Hugging Face config directory), under fixtures/
SHARDED = {
    "fsdp2_llama_fp8": ("fsdp2_llama_fp8/dcp", "fsdp2_llama_fp8/hf"),
    "megatron_fp8_fp32": ("megatron_fp8_fp32/ckpt", "megatron_fp8_fp32/hf"),
    "megatron_fp8_bf16": ("megatron_fp8_bf16/ckpt", "megatron_fp8_bf16/hf"),
    "torchtitan_qwen3_fp8": ("torchtitan_qwen3_fp8/step-60", "torchtitan_qwen3_fp8/hf"),
    "torchtitan_deepseek_v3_fp8": ("torchtitan_deepseek_v3_fp8/step-60", "torchtitan_deepseek_v3_fp8/hf"),
    "torchtitan_qwen3_moe": ("torchtitan_qwen3_moe/step-60", "torchtitan_qwen3_moe/hf"),
    # megatron-core MoE saves (fixtures/generate_megatron_moe.py): Qwen3-MoE at TP=2 with experts
    # cut by expert-tensor parallelism (each expert's fc1 and fc2 over 2 ranks), DeepSeek-V3 at
    # TP=2 EP=2 (latent attention cut over TP, routed and shared experts, an MTP layer)
    "megatron_qwen3_moe_ep1": ("megatron_qwen3_moe_ep1/ckpt", "megatron_qwen3_moe_ep1/hf"),
    "megatron_deepseek_v3": ("megatron_deepseek_v3/ckpt", "megatron_deepseek_v3/hf"),
}
# the mixtures of experts among them
MOE = ["torchtitan_qwen3_moe", "megatron_qwen3_moe_ep1", "megatron_deepseek_v3"]


def read_dir(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def reference(w: torch.Tensor):
    """The rule, in torch: (fp8 weight, scale_inv) of a 2-D weight, computed in f32."""
    x = w.float()
    rows, cols = x.shape
    tr, tc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(tr * 128, tc * 128)
    padded[:rows, :cols] = x
    amax = padded.view(tr, 128, tc, 128).abs().amax(dim=(1, 3))
    scale = amax / 448.0
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    q = (x / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def paths(name: str) -> tuple[Path, Path]:
    ckpt, hf = SHARDED[name]
    return FIXTURES_DIR / ckpt, FIXTURES_DIR / hf


@functools.cache
def exports(name: str, root: Path) -> tuple[Path, Path]:
    """The `--dtype bf16` export of fixture `name` and its `--quantize fp8-block` one, made once
    per session under `root`."""
    src, hf = paths(name)
    out = root / name
    for which, extra in (("bf16", []), ("fp8", ["--quantize", "fp8-block"])):
        r = run_ckpt("consolidate", src, "-o", out / which, "--hf-config", hf, "--dtype", "bf16", *extra)
        assert r.returncode == 0, r.stderr
    return out / "bf16", out / "fp8"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_sharded")
    return lambda name: exports(name, root)


def pieces_cut_a_tile(name: str, quantized: set[str]) -> bool:
    """Whether the source tensor of some quantized weight has pieces that meet inside a 128-row
    band or a 128-column tile of its last two dims: the case these fixtures exist for."""
    src, hf = paths(name)
    r = run_ckpt("inspect", src, "--hf-config", hf, "--json")
    assert r.returncode == 0, r.stderr
    sources = {m["source"] for m in json.loads(r.stdout)["mapping"] if m["target"] in quantized}
    r = run_ckpt("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    for t in json.loads(r.stdout)["tensors"]:
        if t["name"] in sources:
            if any(o % 128 for p in t["pieces"] for o in p["offsets"][-2:]):
                return True
    return False


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_codes_and_scales_are_the_reference_quantization_of_the_bf16_export(exported, name):
    bf16_dir, fp8_dir = exported(name)
    bf16, fp8 = read_dir(bf16_dir), read_dir(fp8_dir)
    quantized = 0
    for k, w in bf16.items():
        if k + "_scale_inv" in fp8:
            q, s = reference(w)
            assert fp8[k].dtype == torch.float8_e4m3fn, k
            assert fp8[k + "_scale_inv"].dtype == torch.float32, k
            assert torch.equal(fp8[k + "_scale_inv"], s), (k, (fp8[k + "_scale_inv"] / s))
            assert torch.equal(fp8[k].view(torch.uint8), q.view(torch.uint8)), k
            quantized += 1
        else:
            assert torch.equal(fp8[k], w), k
    assert quantized > 0
    assert set(fp8) == set(bf16) | {k + "_scale_inv" for k in bf16 if k + "_scale_inv" in fp8}
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("name", MOE)
def test_experts_are_quantized_and_routers_stay_in_dtype(exported, name):
    """As DeepSeek-V3's and Qwen3-MoE-FP8's releases hold them: every expert's (and shared
    expert's) projections in FP8, the router's gate, its bias, the norms and the MTP layer's own
    projection and embedding/head copies in --dtype."""
    bf16_dir, fp8_dir = exported(name)
    fp8 = read_dir(fp8_dir)
    experts = [k for k in fp8 if ".mlp.experts." in k or ".mlp.shared_experts." in k]
    assert experts
    for k in experts:
        assert k.endswith("_scale_inv") or fp8[k].dtype == torch.float8_e4m3fn, k
    stays = [k for k in fp8 if k.endswith(("mlp.gate.weight", "e_score_correction_bias", "norm.weight",
                                            "eh_proj.weight", "embed_tokens.weight", "head.weight"))]
    assert any(k.endswith("mlp.gate.weight") for k in stays)
    for k in stays:
        assert fp8[k].dtype in (torch.bfloat16, torch.float32), k
        assert k + "_scale_inv" not in fp8, k


def dequantized_dir(bf16_dir: Path, fp8_dir: Path, out: Path) -> Path:
    """The fp8 export dequantized tile by tile into bf16 by transformers' own block-size-aware
    routine, as a model directory beside the bf16 export's config."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    fp8 = read_dir(fp8_dir)
    state = {}
    for k, v in fp8.items():
        if k.endswith("_scale_inv"):
            continue
        if k + "_scale_inv" in fp8:
            v = _dequantize_fp8_weight(v, fp8[k + "_scale_inv"], [128, 128], torch.bfloat16)
        state[k] = v.contiguous()
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in bf16_dir.iterdir():
        if f.suffix == ".json" and not f.name.endswith("index.json"):
            shutil.copy(f, out / f.name)
    return out


def next_tokens(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.argmax(-1)


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_dequantized_export_predicts_as_the_bf16_export(exported, name, tmp_path):
    bf16_dir, fp8_dir = exported(name)
    vocab = json.loads((bf16_dir / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (8, 32), generator=torch.Generator().manual_seed(1))
    deq = dequantized_dir(bf16_dir, fp8_dir, tmp_path / "deq")
    agree = (next_tokens(deq, ids) == next_tokens(bf16_dir, ids)).float().mean().item()
    assert agree >= 0.95, agree


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_the_fixture_cuts_tiles_with_its_pieces(exported, name):
    """Each fixture is a case of tiles spanning pieces (else it would not test the rule)."""
    _, fp8_dir = exported(name)
    quantized = {k.removesuffix("_scale_inv") for k in read_dir(fp8_dir) if k.endswith("_scale_inv")}
    assert pieces_cut_a_tile(name, quantized)


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_parts_write_the_single_runs_bytes(exported, name, tmp_path):
    """Three `--part` runs of one output: every tile's scale is computed from all of its
    elements wherever the parts' shares cut the weight and its scales."""
    _, fp8_dir = exported(name)
    src, hf = paths(name)
    out = tmp_path / "parts"
    for i in range(3):
        r = run_ckpt("consolidate", src, "-o", out, "--hf-config", hf, "--dtype", "bf16",
                     "--quantize", "fp8-block", "--part", f"{i}/3")
        assert r.returncode == 0, r.stderr
    for f in fp8_dir.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fp8_dir.iterdir())


def test_s3_output_is_the_local_export(exported, tmp_path):
    """From and into an object store: the bands a scale needs are ranged reads of the same
    objects, and the directory is the local run's, for every fixture."""
    pytest.importorskip("boto3")
    import test_s3  # a module object, so that its tests are not collected here again

    server = test_s3.S3Server()
    try:
        client = server.client()
        client.create_bucket(Bucket="ckpt")
        for name in sorted(SHARDED):
            _, fp8_dir = exported(name)
            src, hf = paths(name)
            test_s3.upload_tree(client, src, "ckpt", f"{name}/src")
            r = test_s3.run(server, "consolidate", f"s3://ckpt/{name}/src", "-o", f"s3://ckpt/{name}/out",
                            "--hf-config", hf, "--dtype", "bf16", "--quantize", "fp8-block")
            assert r.returncode == 0, r.stderr
            got = tmp_path / name
            got.mkdir()
            test_s3.download_tree(client, "ckpt", f"{name}/out", got)
            test_s3.same_tree(fp8_dir, got)
    finally:
        server.stop()
