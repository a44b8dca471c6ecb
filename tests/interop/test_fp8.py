"""`consolidate --hf-config --quantize fp8-block` writes the blockwise FP8 that DeepSeek-V3 and
Qwen3-FP8 ship: small transformers models in bf16 made with a fixed seed, saved as a plain Hugging
Face model directory and as a DCP app state, exported by ckpt; every linear weight's FP8 bytes and
scales equal a torch reference quantizer following the rule (per 128×128 tile scale = amax / 448,
edge tiles zero-padded, an all-zero tile's scale 1, x / scale clamped to ±448 and rounded to
nearest even), the rest is the bf16 export's, and transformers loads the directory
(FineGrainedFP8, dequantising on the CPU) with the bf16 export's top-1 predictions."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from conftest import run_ckpt

transformers = pytest.importorskip("transformers")

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def small_config(arch: str, intermediate: int = 384):
    # Every linear dim a multiple of 128: transformers 5.25 without a GPU infers the block size
    # as weight shape ÷ scale grid, which misreads a partial edge tile (see test_partial_edge).
    common = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=64,
    )
    if arch == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **common)
    return transformers.Qwen3Config(tie_word_embeddings=True, **common)


MODELS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@functools.cache
def build(arch: str, intermediate: int = 384):
    """A model trained for a few steps from a fixed seed on a fixed map of tokens, so that its
    top-1 predictions are decided by a margin, as a trained model's are, rather than by near ties
    of random logits that any rounding flips. Built once per session and not changed after."""
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[arch])(small_config(arch, intermediate))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(60):
        x = torch.randint(0, 256, (4, 32), generator=g)
        out = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 256), ((5 * x + 17) % 256).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        # An all-zero tile: its scale must be 1.0, not NaN.
        model.model.layers[0].mlp.up_proj.weight[:128, :128] = 0.0
    return model.to(torch.bfloat16)


def hf_dir(model, path):
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel"}}')
    return path


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


def read_dir(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def export(src, out, hf, *extra):
    r = run_ckpt("consolidate", src, "-o", out, "--hf-config", hf, "--dtype", "bf16", *extra)
    assert r.returncode == 0, r.stderr
    return read_dir(out)


def check_quantized(state: dict[str, torch.Tensor], got: dict[str, torch.Tensor]):
    """Every linear weight as the reference quantizes it, everything else as it was."""
    quantized = 0
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] in LINEAR and name.endswith(".weight"):
            q, s = reference(w)
            assert got[name].dtype == torch.float8_e4m3fn, name
            assert got[name + "_scale_inv"].dtype == torch.float32, name
            assert torch.equal(got[name + "_scale_inv"], s), name
            # Both round x / scale to nearest even from the same f32 quotient: no byte differs.
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            quantized += 1
        elif name in got:
            assert got[name].dtype == torch.bfloat16, name
            assert torch.equal(got[name], w), name
    assert quantized == 7 * 2
    assert not any(v.isnan().any() for v in got.values() if v.dtype == torch.float32)


INPUT_IDS = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def logits(path, dequantized: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if dequantized and name in dequantized:
                p.copy_(dequantized[name])
        return model(input_ids=INPUT_IDS).logits.float()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_block_from_a_model_directory(tmp_path, arch):
    model = build(arch)
    hf = hf_dir(model, tmp_path / "hf")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    got = export(hf, tmp_path / "fp8", hf, "--quantize", "fp8-block")
    check_quantized(state, got)

    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    q = config["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    kept = set(q["modules_to_not_convert"])
    assert {"model.embed_tokens", "model.norm", "lm_head", "model.layers.1.input_layernorm"} <= kept
    assert not any(m.endswith(LINEAR) for m in kept)
    if arch == "qwen3":
        assert "model.layers.0.self_attn.q_norm" in kept
    assert (tmp_path / "fp8" / "tokenizer.json").is_file()

    bf16 = export(hf, tmp_path / "bf16", hf)
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())
    # transformers dequantises each weight (fp8 × scale_inv per tile) on the CPU: the
    # predictions are the bf16 export's nearly everywhere.
    fp8 = logits(tmp_path / "fp8")
    agree = (fp8.argmax(-1) == logits(tmp_path / "bf16").argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree
    # And they are the logits of the bf16 model with each linear weight the reference's
    # dequantised one: transformers read every tile's scale where the rule puts it.
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    deq = {}
    for name, w in state.items():
        if name.rsplit(".", 2)[-2] in LINEAR:
            q, s = reference(w)
            deq[name] = _dequantize_fp8_weight(q, s, [128, 128], torch.bfloat16)
    want = logits(tmp_path / "bf16", deq)
    assert (fp8 - want).abs().max() <= 1e-2 * want.abs().max(), (fp8 - want).abs().max()


def test_fp8_block_from_dcp_and_in_parts(tmp_path):
    model = build("llama")
    hf = hf_dir(model, tmp_path / "hf")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # A training app state: the model under `model.` beside an optimizer-like tensor.
    app = {f"model.{k}": v for k, v in state.items()}
    app["optimizer.step"] = torch.tensor([3.0])
    dcp.save(app, checkpoint_id=str(tmp_path / "dcp"))
    whole = export(tmp_path / "dcp", tmp_path / "whole", hf, "--quantize", "fp8-block")
    check_quantized(state, whole)
    # Two parts of one run write the same directory: scales are computed wherever they land.
    for i in range(2):
        r = run_ckpt(
            "consolidate", tmp_path / "dcp", "-o", tmp_path / "parts", "--hf-config", hf,
            "--dtype", "bf16", "--quantize", "fp8-block", "--part", f"{i}/2",
        )
        assert r.returncode == 0, r.stderr
    parts = read_dir(tmp_path / "parts")
    assert parts.keys() == whole.keys()
    for k in whole:
        assert torch.equal(parts[k].view(torch.uint8), whole[k].view(torch.uint8)), k
    for f in ("config.json",):
        assert (tmp_path / "parts" / f).read_bytes() == (tmp_path / "whole" / f).read_bytes()


def test_partial_edge(tmp_path):
    """An intermediate size of 320 rows: gate/up `[320, 256]` end in a band of 64 rows, down
    `[256, 320]` in a tile of 64 columns. transformers 5.25 on the CPU would infer the block as
    320 ÷ 3 rows and misread them, so the 128×128 rule is checked by itself: the reference's bytes,
    and transformers' `_dequantize_fp8_weight` with block 128 giving the reference's values."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    model = build("llama", intermediate=320)
    hf = hf_dir(model, tmp_path / "hf")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    got = export(hf, tmp_path / "fp8", hf, "--quantize", "fp8-block")
    check_quantized(state, got)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w, s = got[name], got[name + "_scale_inv"]
        assert list(s.shape) == [-(-w.shape[0] // 128), -(-w.shape[1] // 128)]
        deq = _dequantize_fp8_weight(w, s, [128, 128], torch.float32)
        q, ref_s = reference(state[name])
        full = ref_s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        assert torch.equal(deq, q.float() * full), name
        # Dequantised, each value is within half an FP8 step (1/16 relative) of the source.
        err = (deq - state[name].float()).abs()
        assert (err <= state[name].float().abs() / 16 + full * 2**-9 + 1e-12).all(), name


def test_fp8_block_needs_hf_config(tmp_path):
    hf = hf_dir(build("qwen3"), tmp_path / "hf")
    r = run_ckpt("consolidate", hf, "-o", tmp_path / "out", "--quantize", "fp8-block")
    assert r.returncode == 2, r.stderr
    assert "--hf-config" in r.stderr
    assert not (tmp_path / "out").exists()


def test_fp8_block_of_a_lora_merge(tmp_path):
    """`--merge-lora` with `--quantize fp8-block`: folded, then quantized; the FP8 weights are
    the reference's quantization of the bf16 merge ckpt writes without `--quantize`."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file

    model = build("llama")
    hf = hf_dir(model, tmp_path / "hf")
    torch.manual_seed(3)
    wrapped = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False),
    )
    try:
        wrapped.save_pretrained(tmp_path / "adapter")
        save_file({k: v.contiguous() for k, v in wrapped.state_dict().items()}, tmp_path / "wrapped.safetensors")
    finally:
        # `build` hands every test the same model: take the adapter out again.
        wrapped.unload()
    adapter = tmp_path / "adapter" / "adapter_config.json"
    src = tmp_path / "wrapped.safetensors"
    merged = export(src, tmp_path / "bf16", hf, "--merge-lora", adapter)
    got = export(src, tmp_path / "fp8", hf, "--merge-lora", adapter, "--quantize", "fp8-block")
    check_quantized(merged, got)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_fp8_block_of_deepseek_v3_from_torchtitan(tmp_path):
    """DeepSeek-V3 as torchtitan saves it (routed experts stacked on a leading axis): each
    expert's, shared expert's and latent attention's linear weight is quantized from its view of
    the stacked f32 source, as `--dtype bf16` writes it; the router's gate and its bias are not,
    and are listed by module."""
    import test_hf_export  # a module object, so that its tests are not collected here again

    model = test_hf_export.build_deepseek(12)
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    saved = test_hf_export.tensors_of(ref)
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in ref.iterdir():
        if f.suffix == ".json":
            (hf / f.name).write_bytes(f.read_bytes())
    test_hf_export.save_torchtitan_deepseek(saved, model.config.num_hidden_layers, tmp_path / "tt")
    got = export(tmp_path / "tt", tmp_path / "out", hf, "--quantize", "fp8-block")
    linear = ("_proj.weight", "_proj_with_mqa.weight")
    quantized = 0
    for name, w in saved.items():
        if name.endswith(linear):
            # f32 weights exported `--dtype bf16`: quantized from the bf16 values the plain
            # export writes
            q, s = reference(w.to(torch.bfloat16))
            assert torch.equal(got[name + "_scale_inv"], s), name
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            quantized += 1
        else:
            assert torch.equal(got[name], w.to(torch.bfloat16)), name
    # Layer 0 dense (q_a, q_b, kv_a, kv_b, o, 3 MLP), layers 1-2 with 4 experts and a shared one.
    assert quantized == 8 + 2 * (5 + 4 * 3 + 3)
    kept = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.mlp.gate" in kept and "model.layers.0.self_attn.kv_a_layernorm" in kept
    assert not any(m.endswith(("_proj", "_mqa")) for m in kept)


def test_fp8_block_from_and_to_s3_is_the_local_export(tmp_path):
    """Read from an object store, the bands the scales need are ranged reads of the same
    objects; written to one, the directory is the local run's."""
    pytest.importorskip("boto3")
    import test_s3  # a module object, so that its tests are not collected here again

    model = build("qwen3")
    hf = hf_dir(model, tmp_path / "hf")
    app = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    dcp.save(app, checkpoint_id=str(tmp_path / "dcp"))
    export(tmp_path / "dcp", tmp_path / "local", hf, "--quantize", "fp8-block")
    server = test_s3.S3Server()
    try:
        client = server.client()
        client.create_bucket(Bucket="ckpt")
        test_s3.upload_tree(client, tmp_path / "dcp", "ckpt", "dcp")
        r = test_s3.run(server, "consolidate", "s3://ckpt/dcp", "-o", "s3://ckpt/out", "--hf-config", hf,
                        "--dtype", "bf16", "--quantize", "fp8-block")
        assert r.returncode == 0, r.stderr
        got = tmp_path / "got"
        got.mkdir()
        test_s3.download_tree(client, "ckpt", "out", got)
        test_s3.same_tree(tmp_path / "local", got)
    finally:
        server.stop()
