"""`ckpt reshard HF_DIR --format megatron --transformer-impl local` of mixture-of-experts releases,
loaded by megatron-core itself (torchrun_megatron_moe_import_load.py, 2 ranks, gloo, CPU).

The releases are written by transformers itself (`from_config` with a fixed seed, norms and biases
random, `save_pretrained` split into several files with an index) at the sizes of the Megatron MoE
fixtures' hf/config.json, so that fixtures/generate_megatron_moe.py builds the matching
megatron-core model (the one whose saves ckpt's export is known to read; the worker imports its
builder):

- Qwen3-MoE (fixtures/megatron_qwen3_moe_ep1): hidden 160, 4 heads of 48 in 2 query groups, q/k
  norms, 2 MoE layers (layer-stacked in Megatron) of 4 experts of 144, top-2 softmax router;
- DeepSeek-V3 (fixtures/megatron_deepseek_v3): latent attention (q_lora_rank 136, kv_lora_rank
  132), a dense first layer (first_k_dense_replace 1, FFN 200), routed (4 of 136, top-2) and a
  shared expert, sigmoid router with a random `e_score_correction_bias`, top-k scaling 2.5, and one
  multi-token-prediction layer. transformers' DeepseekV3 has no MTP modules, so the MTP layer is
  added to the model before `save_pretrained` as a third decoder layer (transformers' own, written
  under `model.layers.2.*` by its own save, the experts per expert) with enorm, hnorm, eh_proj,
  shared_head.norm, and DeepSeek's copies of the embedding (embed_tokens) and head
  (shared_head.head); config.json says `num_hidden_layers` 2, `num_nextn_predict_layers` 1.

The vocabulary of 250 is padded by Megatron-LM's rule to 256 rows at T=2. Each release is imported
with `--transformer-impl local --tensor-parallel-size 2 --world-size 3` and megatron-core's own
`dist_checkpointing.load` (as Megatron-LM's load_checkpoint, then a strict `load_state_dict`) of
the model built with the local spec, every parameter first NaN:

- at TP=2, EP=2, expert TP 1: the keys it asks for are exactly the checkpoint's, nothing is left
  NaN, and the main head's fp32 logits are transformers' of the release within 1e-4 of the largest
  |logit| (argmax equal over the real vocabulary, the padded columns 0);
- at TP=1, EP=2 (DP=2; megatron-core trains MoE under TP only with sequence parallelism, which
  torch's norms refuse): the same, then one training iteration with Megatron's optimizer: its loss
  is the cross entropy of transformers' logits, the step is taken, every parameter changes and
  stays finite, and the loss falls.

And the flag matters: the import of the DeepSeek-V3 release with the default
`--transformer-impl transformer_engine` (latent attention's q/kv norms fused into the up
projections' `layer_norm_weight`) is refused by the same load into the local-spec model, naming
the key it misses (`self_attention.q_layernorm.weight`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_helpers import FIXTURES_DIR, run_torchrun
from test_hf_import import batch, have_megatron_core, import_megatron, padded_vocab, rank_errors

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not have_megatron_core(), reason="needs megatron-core")

WORKER = Path(__file__).parent / "torchrun_megatron_moe_import_load.py"
TP = 2
# name: (the fixture whose hf/config.json gives the sizes, generate_megatron_moe.CASES key)
CASES = {
    "qwen3_moe": ("megatron_qwen3_moe_ep1", "qwen3"),
    "deepseek_v3": ("megatron_deepseek_v3", "deepseek"),
}
LOAD_LAYOUT = {"tp": 2, "ep": 2, "etp": 1}
TRAIN_LAYOUT = {"tp": 1, "ep": 2, "etp": 1}


def build_release(case: str, path: Path) -> Path:
    c = json.loads((FIXTURES_DIR / CASES[case][0] / "hf" / "config.json").read_text())
    arch = c.pop("architectures")[0]
    # fp32 weights of std 0.1 (the fixture's model is trained from 0.02): attention scores and
    # router logits of order one, so that a misplaced row or expert moves the logits.
    c.update(dtype="float32", initializer_range=0.1)
    layers, mtp = c["num_hidden_layers"], c.get("num_nextn_predict_layers", 0)
    # transformers builds the MTP layers' decoder layers as further layers of the model.
    cfg = transformers.AutoConfig.for_model(**{**c, "num_hidden_layers": layers + mtp})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval()
    assert len(model.model.layers) == layers + mtp
    h, v = cfg.hidden_size, cfg.vocab_size
    with torch.no_grad():
        # Random norms and biases (transformers makes them ones and zeros), so that a misplaced
        # one shows in the logits; the routing bias small beside the sigmoid scores it is added to.
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t) * 0.1)
            elif "norm" in name or name.endswith("bias"):
                t.copy_(torch.randn_like(t) * 0.5 + 1.0)
        for i in range(layers, layers + mtp):
            # DeepSeek-V3's MTP layer beside its decoder layer (DeepSeek's inference code's names)
            layer = model.model.layers[i]
            layer.enorm, layer.hnorm = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
            layer.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            layer.shared_head = torch.nn.Module()
            layer.shared_head.norm = torch.nn.RMSNorm(h)
            layer.shared_head.head = torch.nn.Linear(h, v, bias=False)
            layer.embed_tokens = torch.nn.Embedding(v, h)
            for norm in (layer.enorm, layer.hnorm, layer.shared_head.norm):
                norm.weight.copy_(torch.randn(h) * 0.5 + 1.0)
            layer.eh_proj.weight.copy_(torch.randn(h, 2 * h) * 0.1)
            # the release's copies of the shared embedding and head, as DeepSeek ships them
            layer.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
            layer.shared_head.head.weight.copy_(model.lm_head.weight)
    model.config.num_hidden_layers = layers
    model.save_pretrained(path, max_shard_size="300KB")
    return path


@functools.cache
def _release(root: Path, case: str) -> Path:
    rel = build_release(case, root / case)
    config = json.loads((rel / "config.json").read_text())
    index = json.loads((rel / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 3, "the release should be split"
    mtp = config.get("num_nextn_predict_layers", 0)
    n = config["num_hidden_layers"]
    assert n == 2 and not any(k.startswith(f"model.layers.{n + mtp}.") for k in index)
    if mtp:
        want = {f"model.layers.{n}.{k}.weight" for k in
                ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                 "embed_tokens", "self_attn.q_a_proj", "mlp.experts.3.down_proj",
                 "mlp.shared_experts.up_proj", "mlp.gate")}
        assert want <= set(index), sorted(want - set(index))
        assert f"model.layers.{n}.mlp.gate.e_score_correction_bias" in index
    return rel


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_releases")
    return lambda case: _release(root, case)


def transformers_logits(rel: Path, ids: torch.Tensor, change=None) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(rel), dtype=torch.float32).eval()
    if change is not None:
        with torch.no_grad():
            change(hf)
    with torch.no_grad():
        return hf(input_ids=ids).logits


@functools.cache
def _megatron_run(root: Path, rel: Path, case: str) -> dict:
    """One torchrun per case: the local import loaded at LOAD_LAYOUT, then at TRAIN_LAYOUT with a
    training step; for DeepSeek-V3 also the transformer_engine import (expected to fail)."""
    work = root / case
    work.mkdir()
    local = import_megatron(rel, work / "local", 3, TP, "--transformer-impl", "local")
    loads = [
        {"name": "load", "dir": str(local), "layout": LOAD_LAYOUT},
        {"name": "train", "dir": str(local), "layout": TRAIN_LAYOUT, "train": True},
    ]
    te = None
    if case == "deepseek_v3":
        te = import_megatron(rel, work / "te", 3, TP)  # the default --transformer-impl
        loads.append({"name": "te", "dir": str(te), "layout": LOAD_LAYOUT,
                      "expect_failure": True})
    vocab = json.loads((rel / "config.json").read_text())["vocab_size"]
    ids, labels = batch(vocab)
    spec = {"case": CASES[case][1], "padded_vocab": padded_vocab(vocab, TP),
            "input_ids": ids.tolist(), "labels": labels.tolist(), "loads": loads}
    (work / "spec.json").write_text(json.dumps(spec))
    r = run_torchrun(WORKER, 2, work / "spec.json", work / "result.pt")
    assert r.returncode == 0, f"megatron-core failed on ckpt's output:\n{rank_errors(r.stderr)}"
    result = torch.load(work / "result.pt", weights_only=False)
    return {"result": result, "local": local, "te": te, "ids": ids, "labels": labels,
            "vocab": vocab, "padded": spec["padded_vocab"]}


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory, release):
    root = tmp_path_factory.mktemp("moe_megatron")
    return lambda case: _megatron_run(root, release(case), case)


def checkpoint_keys(out: Path) -> set:
    return set(dcp.FileSystemReader(str(out / "release")).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_loads_the_moe_import_and_trains(release, megatron_run, case):
    run = megatron_run(case)
    rel, ids, labels = release(case), run["ids"], run["labels"]
    vocab, padded = run["vocab"], run["padded"]
    assert padded == 256
    want = transformers_logits(rel, ids)
    scale = want.abs().max().item()
    tol = 1e-4 * scale
    keys = checkpoint_keys(run["local"])
    errs = {}
    for name in ("load", "train"):
        got = run["result"]["loads"][name]
        assert got["error"] is None, got["error"]
        assert got["tag"] == "release"
        assert got["common"] == {"checkpoint_version": 3.0, "iteration": 0}, got["common"]
        assert got["nan"] == [], f"{name}: not loaded: {got['nan']}"
        extra = sorted(keys ^ set(got["requested_keys"]))
        assert not extra, f"{name}: keys megatron-core does not ask for, or lacks: {extra}"
        logits = got["logits"]
        assert logits.shape == (*ids.shape, padded)
        errs[name] = (logits[..., :vocab] - want).abs().max().item()
        assert errs[name] <= tol, f"{name}: max |logit difference| {errs[name]} > {tol}"
        assert torch.equal(logits[..., :vocab].argmax(-1), want.argmax(-1)), name
        assert torch.equal(logits[..., vocab:], torch.zeros_like(logits[..., vocab:])), name
    print(f"{case}: max |logit - transformers'| {errs['load']:.3e} at TP=2 EP=2, "
          f"{errs['train']:.3e} at TP=1 EP=2 (largest |logit| {scale:.3f}, tolerance {tol:.3e})")

    train = run["result"]["loads"]["train"]["train"]
    full = torch.cat([want, want.new_zeros(*want.shape[:2], padded - vocab)], -1)
    want_loss = torch.nn.functional.cross_entropy(
        full.reshape(-1, padded), labels.reshape(-1)).item()
    assert train["ok"], "Megatron's optimizer skipped the step"
    assert math.isfinite(train["loss"]) and math.isfinite(train["grad_norm"]), train
    assert abs(train["loss"] - want_loss) <= 1e-4 * want_loss, (train["loss"], want_loss)
    assert train["finite_params"] and train["unchanged"] == [], train
    assert train["loss_after"] < train["loss"], train
    print(f"{case}: one step: loss {train['loss']:.4f} (transformers' {want_loss:.4f}) -> "
          f"{train['loss_after']:.4f}, grad norm {train['grad_norm']:.3f}, "
          f"{train['params']} parameters (both ranks) changed")


def _swap_experts_0_1(hf) -> None:
    for layer in hf.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            for p in (experts.gate_up_proj, experts.down_proj):
                p[[0, 1]] = p[[1, 0]].clone()


def _zero_routing_bias(hf) -> None:
    for layer in hf.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.zero_()


@pytest.mark.parametrize("case", list(CASES))
def test_the_logits_see_the_routing(release, case):
    """The tolerance tells apart a wrong expert order and, for DeepSeek-V3, a lost routing bias
    (transformers alone): the comparison above can see them."""
    rel = release(case)
    ids, _ = batch(json.loads((rel / "config.json").read_text())["vocab_size"])
    want = transformers_logits(rel, ids)
    tol = 1e-4 * want.abs().max().item()
    changes = {"experts 0 and 1 swapped": _swap_experts_0_1}
    if case == "deepseek_v3":
        changes["e_score_correction_bias zeroed"] = _zero_routing_bias
    for what, change in changes.items():
        moved = (transformers_logits(rel, ids, change) - want).abs().max().item()
        assert moved > 100 * tol, f"{case}: {what} moves the logits by {moved} only"


def test_transformer_engine_import_fails_in_the_local_spec(megatron_run):
    """The DeepSeek-V3 import with the default `--transformer-impl transformer_engine` names latent
    attention's q/kv norms as Transformer Engine's spec saves them (fused into the up projections)
    and the dense layer's pre-MLP norm under linear_fc1: megatron-core's load into the local-spec
    model refuses it on every rank, naming the local spec's key it misses."""
    run = megatron_run("deepseek_v3")
    got = run["result"]["loads"]["te"]
    errors = got["errors_all_ranks"]
    assert all(e is not None for e in errors), errors
    for e in errors:
        assert "self_attention.q_layernorm.weight from model not in state dict" in e, e[:2000]
    te, local = checkpoint_keys(run["te"]), checkpoint_keys(run["local"])
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in local - te
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in te - local
    # the two imports differ in the norms' names only
    assert (te ^ local) and all("norm" in k for k in te ^ local), sorted(te ^ local)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("case", list(CASES))
def test_import_then_export_gives_the_release_back(release, tmp_path, case, impl):
    """`consolidate OUT --hf-config REL` of the import is the release, every tensor bit for bit
    (the MTP layer's copies of the embedding and head written again from the shared ones),
    whichever layer spec's names the import took."""
    from conftest import run_ckpt
    from ckpt_helpers import load_safetensors

    rel = release(case)
    out = tmp_path / "mg"
    r = run_ckpt("reshard", rel, "-o", out, "--format", "megatron", "--transformer-impl", impl,
                 "--tensor-parallel-size", "2", "--world-size", "3")
    assert r.returncode == 0, r.stderr
    back = tmp_path / "back"
    r = run_ckpt("consolidate", out, "-o", back, "--hf-config", rel)
    assert r.returncode == 0, r.stderr
    want = {k: v for f in rel.glob("*.safetensors") for k, v in load_safetensors(f).items()}
    got = {k: v for f in back.glob("*.safetensors") for k, v in load_safetensors(f).items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
