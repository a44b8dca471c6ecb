"""`ckpt reshard HF_DIR --format megatron|torchtitan` imports a Hugging Face release: tiny releases
written by transformers itself (`from_config` with a fixed seed, `save_pretrained` split into several
files with an index), sizes over 128 and not multiples of 128, judged by

- megatron-core itself (torchrun_megatron_import_load.py, 2 ranks, TP=2): `dist_checkpointing.load`
  of the model's `sharded_state_dict()` from the save root ckpt wrote, the loaded model's logits
  against transformers' own of the release, and one training iteration with Megatron's optimizer;
- the import's round trip: `consolidate OUT --hf-config REL` gives every tensor of the release back
  bit for bit (megatron and torchtitan);
- the layout megatron-core's `GPTModel.sharded_state_dict()` reads (layer-stacked `decoder.layers.*`,
  QKV interleaved per query group, `[gate; up]`, the norms under the linears' `layer_norm_weight`,
  the vocabulary padded by Megatron-LM's rule, the linears' `_extra_state` objects as megatron-core's
  save writes them), `common.pt`, `metadata.json` and the tracker file, read with torch alone;
- refusals: a config.json that disagrees with the tensors, an unknown architecture, a tensor the map
  does not place: exit 2, naming it, nothing written;
- `--dtype bf16`: torch's own `.to(torch.bfloat16)` of the release's tensors.

The three cases: Llama (untied, head_dim 40), Qwen2 (QKV bias, tied embeddings, vocabulary 300:
padded to 384 rows at T=1 and 512 at T=2) and Qwen3 (q/k norms, head_dim 48, not hidden/heads).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_helpers import bitwise_equal, load_safetensors, load_with_torch, run_torchrun
from conftest import run_ckpt

transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).parent / "torchrun_megatron_import_load.py"
MAKE_VOCAB_DIVISIBLE_BY = 128

COMMON = dict(
    hidden_size=160,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    # Weights of std 0.1 rather than 0.02: attention scores of order one, so that q and k rows
    # out of place change the logits by far more than the tolerance.
    initializer_range=0.1,
)
CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(vocab_size=250, head_dim=40, tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(vocab_size=300, tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(vocab_size=250, head_dim=48, tie_word_embeddings=False, rope_theta=500000.0)),
}
# The extra-state objects megatron-core's local linears put in their sharded_state_dict().
LINEARS = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
MEGATRON_METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                          "common_backend": "torch", "common_backend_version": 1}


def padded_vocab(vocab: int, tp: int, divisible_by: int = MAKE_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: up to a multiple of divisible_by * TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def build_release(arch: str, path: Path) -> Path:
    cls, cfg_cls, extra = CASES[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**COMMON, **extra)
    model = getattr(transformers, cls)(cfg).eval()
    # Random norms and biases too (transformers makes them ones and zeros), so that a misplaced
    # one shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    model.save_pretrained(path, max_shard_size="300KB")
    return path


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("releases")
    out = {arch: build_release(arch, root / arch) for arch in CASES}
    for path in out.values():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 3, "the release should be split"
    return out


def config_of(rel: Path) -> dict:
    return json.loads((rel / "config.json").read_text())


def release_tensors(rel: Path) -> dict:
    return load_with_torch(rel)  # split safetensors, checked against the index


def dims(c: dict) -> dict:
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    rope = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))
    return {
        "num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
        "num_attention_heads": heads, "num_query_groups": kv, "kv_channels": head_dim,
        "ffn_hidden_size": c["intermediate_size"], "eps": c["rms_norm_eps"], "rope_theta": rope,
        "qkv_bias": c["model_type"] == "qwen2", "qk_norm": c["model_type"] == "qwen3",
        "tied": bool(c["tie_word_embeddings"]), "max_positions": c["max_position_embeddings"],
    }


def import_to(rel: Path, out: Path, fmt: str = "megatron", *extra) -> Path:
    r = run_ckpt("reshard", rel, "-o", out, "--format", fmt, *extra)
    assert r.returncode == 0, r.stderr
    return out


def import_megatron(rel: Path, out: Path, world_size: int = 3, tp: int | None = 2, *extra) -> Path:
    args = ["--world-size", world_size]
    if tp is not None:
        args += ["--tensor-parallel-size", tp]
    return import_to(rel, out, "megatron", *args, *extra)


# --- the layout megatron-core reads, by torch alone ------------------------------------------------


def megatron_reference(sd: dict, c: dict, padded: int) -> dict:
    """The release's tensors as megatron-core's GPTModel (local spec) names and lays them out in
    its sharded_state_dict(): per layer stacked on a leading axis, QKV rows [q of the group's heads;
    k; v] per query group, linear_fc1 [gate; up], the vocabulary padded with zero rows."""
    d = dims(c)
    L, groups, hd = d["num_layers"], d["num_query_groups"], d["kv_channels"]
    per_group = d["num_attention_heads"] // groups

    def qkv(i: int, kind: str) -> torch.Tensor:
        q, k, v = (sd[f"model.layers.{i}.self_attn.{p}_proj.{kind}"] for p in "qkv")
        rest = q.shape[1:]
        parts = [q.reshape(groups, per_group * hd, *rest), k.reshape(groups, hd, *rest),
                 v.reshape(groups, hd, *rest)]
        return torch.cat(parts, 1).reshape(-1, *rest)

    def stack(fn) -> torch.Tensor:
        return torch.stack([fn(i) for i in range(L)])

    def pad(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])

    lay = "model.layers.{}."
    out = {
        "embedding.word_embeddings.weight": pad(sd["model.embed_tokens.weight"]),
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "decoder.layers.self_attention.linear_qkv.weight": stack(lambda i: qkv(i, "weight")),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight":
            stack(lambda i: sd[lay.format(i) + "input_layernorm.weight"]),
        "decoder.layers.self_attention.linear_proj.weight":
            stack(lambda i: sd[lay.format(i) + "self_attn.o_proj.weight"]),
        "decoder.layers.mlp.linear_fc1.weight": stack(lambda i: torch.cat(
            [sd[lay.format(i) + "mlp.gate_proj.weight"], sd[lay.format(i) + "mlp.up_proj.weight"]])),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight":
            stack(lambda i: sd[lay.format(i) + "post_attention_layernorm.weight"]),
        "decoder.layers.mlp.linear_fc2.weight":
            stack(lambda i: sd[lay.format(i) + "mlp.down_proj.weight"]),
    }
    if not d["tied"]:
        out["output_layer.weight"] = pad(sd["lm_head.weight"])
    if d["qkv_bias"]:
        out["decoder.layers.self_attention.linear_qkv.bias"] = stack(lambda i: qkv(i, "bias"))
    if d["qk_norm"]:
        out["decoder.layers.self_attention.q_layernorm.weight"] = \
            stack(lambda i: sd[lay.format(i) + "self_attn.q_norm.weight"])
        out["decoder.layers.self_attention.k_layernorm.weight"] = \
            stack(lambda i: sd[lay.format(i) + "self_attn.k_norm.weight"])
    return out


def extra_state_keys(layers: int) -> set:
    """The unique keys megatron-core gives the linears' `_extra_state` ShardedObjects of a
    layer-stacked decoder (transformer/utils.py make_sharded_object_for_checkpoint: one object per
    layer, `KEY/shard_{layer}_{layers}`)."""
    return {f"decoder.layers.{lin}._extra_state/shard_{i}_{layers}"
            for lin in LINEARS for i in range(layers)}


def read_bytes_items(path: Path, keys) -> dict:
    """The DCP's byte items as torch's own reader deserialises them (DefaultLoadPlanner.load_bytes:
    torch.load of the stored bytes), as megatron-core's TorchDistLoadShardedStrategy reads them."""
    state = {k: io.BytesIO() for k in keys}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def assert_is_megatron_save_root(out: Path, world_size: int) -> Path:
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    release = out / "release"
    names = sorted(p.name for p in release.iterdir())
    distcp = [f"__{r}_0.distcp" for r in range(world_size)]
    assert names == sorted([".metadata", "common.pt", "metadata.json", *distcp]), names
    assert json.loads((release / "metadata.json").read_text()) == MEGATRON_METADATA_JSON
    common = torch.load(release / "common.pt", weights_only=True)
    assert common == {"checkpoint_version": 3.0, "iteration": 0}, common
    return release


@pytest.mark.parametrize("arch", list(CASES))
def test_megatron_import_is_megatron_cores_layout(tmp_path, releases, arch):
    """What megatron-core's sharded_state_dict() asks for, and nothing else, with torch alone: at
    --world-size 3 --tensor-parallel-size 2, and (the same tensors, the vocabulary padded for T=1)
    at --world-size 1 with the default T."""
    rel = releases[arch]
    c = config_of(rel)
    sd = release_tensors(rel)
    for ws, tp in [(3, 2), (1, None)]:
        out = import_megatron(rel, tmp_path / f"out_ws{ws}", ws, tp)
        release = assert_is_megatron_save_root(out, ws)
        want = megatron_reference(sd, c, padded_vocab(c["vocab_size"], tp or 1))
        md = dcp.FileSystemReader(str(release)).read_metadata()
        tensors = {k for k, m in md.state_dict_metadata.items()
                   if type(m).__name__ == "TensorStorageMetadata"}
        objects = set(md.state_dict_metadata) - tensors
        assert tensors == set(want), sorted(tensors ^ set(want))
        assert objects == extra_state_keys(c["num_hidden_layers"]), sorted(objects)
        got = load_with_torch(release)
        bad = [k for k, w in want.items() if not bitwise_equal(got[k], w)]
        assert not bad, [(k, tuple(got[k].shape), tuple(want[k].shape)) for k in bad]


def test_megatron_extra_state_objects_are_as_megatron_core_saves_them(tmp_path, releases):
    """megatron-core's torch_dist save writes the ShardedObjects of one unique key as
    `torch.save([obj.data for obj in objs])` (strategies/torch.py `_mcore_to_torch_sharded_object`),
    a list even of one, and its load takes the list back apart
    (`_replace_sharded_keys_with_state_dict_keys`: `len(tensors) == len(rename_mapping[k])`): each
    linear's `_extra_state` of the local spec is stored as `[None]`."""
    rel = releases["llama"]
    release = import_megatron(rel, tmp_path / "out") / "release"
    keys = extra_state_keys(config_of(rel)["num_hidden_layers"])
    got = read_bytes_items(release, keys)
    bad = {k: v for k, v in got.items() if v != [None]}
    wrote = sorted(set(map(repr, bad.values())))
    assert not bad, f"megatron-core stores [None]; ckpt wrote {wrote} at {sorted(bad)}"


# --- megatron-core itself -------------------------------------------------------------------------


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 12 seeded tokens, the last rows of the vocabulary among them; labels the
    next token."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(7))
    ids[0, -1], ids[1, 3] = vocab - 1, vocab - 2
    labels = torch.roll(ids, -1, dims=1)
    return ids, labels


def rank_errors(stderr: str) -> str:
    """A failed torchrun's traceback lines (its warnings left out)."""
    lines = [line for line in stderr.splitlines() if line.startswith("[rank0]:")]
    return "\n".join(lines[-40:]) or stderr[-4000:]


def have_megatron_core() -> bool:
    # (find_spec of a submodule raises when its parent package is missing)
    return importlib.util.find_spec("megatron") is not None and \
        importlib.util.find_spec("megatron.core") is not None


@pytest.mark.skipif(not have_megatron_core(), reason="needs megatron-core")
@pytest.mark.parametrize("arch", list(CASES))
def test_megatron_core_loads_the_import_and_trains(tmp_path, releases, arch):
    """megatron-core's own `dist_checkpointing.load` of the import into the GPTModel of the
    release's sizes at TP=2 (torchrun_megatron_import_load.py): every parameter loaded, the keys it
    asks for are exactly the checkpoint's, its fp32 logits are transformers' of the release (within
    1e-4 of the largest |logit|; the padded vocabulary's columns 0), its loss is the cross entropy
    of those logits over the padded vocabulary, and one step of Megatron's Adam trains it. For
    Qwen2 the T=1 import too (384 rows, not 512), loaded into a TP=2 model of that vocabulary."""
    rel = releases[arch]
    c = config_of(rel)
    vocab = c["vocab_size"]
    loads = [("t2", import_megatron(rel, tmp_path / "out_t2"), padded_vocab(vocab, 2))]
    if arch == "qwen2":
        loads.append(("t1", import_megatron(rel, tmp_path / "out_t1", 1, None), padded_vocab(vocab, 1)))
    assert len({p for _, _, p in loads}) == len(loads)
    ids, labels = batch(vocab)
    spec = {
        "model": dims(c), "input_ids": ids.tolist(), "labels": labels.tolist(),
        "loads": [{"name": n, "dir": str(d), "padded_vocab": p} for n, d, p in loads],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    r = run_torchrun(WORKER, 2, tmp_path / "spec.json", tmp_path / "result.pt")
    assert r.returncode == 0, f"megatron-core failed on ckpt's output:\n{rank_errors(r.stderr)}"
    result = torch.load(tmp_path / "result.pt", weights_only=False)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(rel), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    tol = 1e-4 * want.abs().max().item()
    for name, out, padded in loads:
        got = result["loads"][name]
        assert got["tag"] == "release"
        assert got["common"] == {"checkpoint_version": 3.0, "iteration": 0}, got["common"]
        assert got["nan_params"] == [], f"{name}: not loaded: {got['nan_params']}"
        md = dcp.FileSystemReader(str(out / "release")).read_metadata()
        extra = sorted(set(md.state_dict_metadata) ^ set(got["requested_keys"]))
        assert not extra, f"{name}: keys megatron-core does not ask for, or lacks: {extra}"
        logits = got["logits"]
        assert logits.shape == (*ids.shape, padded)
        err = (logits[..., :vocab] - want).abs().max().item()
        assert err <= tol, f"{name}: max |logit difference| {err} > {tol}"
        assert torch.equal(logits[..., vocab:], torch.zeros_like(logits[..., vocab:])), name

    train = result["train"]
    padded = loads[0][2]
    full = torch.cat([want, want.new_zeros(*want.shape[:2], padded - vocab)], -1)
    want_loss = torch.nn.functional.cross_entropy(full.reshape(-1, padded), labels.reshape(-1)).item()
    assert train["ok"], "Megatron's optimizer skipped the step"
    assert math.isfinite(train["loss"]) and math.isfinite(train["grad_norm"]), train
    assert abs(train["loss"] - want_loss) <= 1e-4 * want_loss, (train["loss"], want_loss)
    assert train["finite_params"] and train["changed"] == train["params"], train
    assert train["loss_after"] < train["loss"], train


# --- round trip, dtype ----------------------------------------------------------------------------


def hf_tensors(out: Path) -> dict:
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_safetensors(f))
    return got


# torchtitan has no Qwen2 model (refused: test_architecture_without_a_map_exits_2)
ROUND_TRIPS = [(arch, fmt) for fmt in ("megatron", "torchtitan") for arch in CASES
               if (arch, fmt) != ("qwen2", "torchtitan")]


@pytest.mark.parametrize("arch,fmt", ROUND_TRIPS)
def test_import_round_trips_bit_for_bit(tmp_path, releases, arch, fmt):
    rel = releases[arch]
    extra = ["--world-size", 3] + (["--tensor-parallel-size", 2] if fmt == "megatron" else [])
    out = import_to(rel, tmp_path / "out", fmt, *extra)
    r = run_ckpt("consolidate", out, "-o", tmp_path / "back", "--hf-config", rel)
    assert r.returncode == 0, r.stderr
    got, want = hf_tensors(tmp_path / "back"), release_tensors(rel)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    bad = [k for k in want if not bitwise_equal(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
def test_bf16_import_is_torchs_cast(tmp_path, releases, fmt):
    # megatron: Qwen2 (biases, tied embeddings, a padded vocabulary); torchtitan has no Qwen2
    rel = releases["qwen2" if fmt == "megatron" else "llama"]
    c = config_of(rel)
    sd = release_tensors(rel)
    extra = ["--world-size", 3] + (["--tensor-parallel-size", 2] if fmt == "megatron" else [])
    out = import_to(rel, tmp_path / "out", fmt, *extra, "--dtype", "bf16")
    where = out / "release" if fmt == "megatron" else out
    got = {k: v for k, v in load_with_torch(where).items() if isinstance(v, torch.Tensor)}
    assert got and all(v.dtype == torch.bfloat16 for v in got.values()), \
        {k: v.dtype for k, v in got.items() if v.dtype != torch.bfloat16}
    if fmt == "megatron":
        want = megatron_reference({k: v.to(torch.bfloat16) for k, v in sd.items()}, c,
                                  padded_vocab(c["vocab_size"], 2))
        assert sorted(got) == sorted(want)
        bad = [k for k in want if not bitwise_equal(got[k], want[k])]
        assert not bad, bad
    r = run_ckpt("consolidate", out, "-o", tmp_path / "back", "--hf-config", rel)
    assert r.returncode == 0, r.stderr
    back = hf_tensors(tmp_path / "back")
    assert sorted(back) == sorted(sd)
    bad = [k for k in sd if not bitwise_equal(back[k], sd[k].to(torch.bfloat16))]
    assert not bad, bad


# --- refusals -------------------------------------------------------------------------------------


def copy_release(rel: Path, to: Path) -> Path:
    shutil.copytree(rel, to)
    return to


def assert_refused(tmp_path: Path, rel: Path, fmt: str, names) -> str:
    """Exit 2, a message naming one of `names`, and nothing written: no OUT, nothing new beside it."""
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "out"
    extra = ["--world-size", 3] + (["--tensor-parallel-size", 2] if fmt == "megatron" else [])
    r = run_ckpt("reshard", rel, "-o", out, "--format", fmt, *extra)
    wrote = sorted(p.name for p in out.rglob("*")) if out.exists() else None
    assert r.returncode == 2, f"exit {r.returncode}, wrote {wrote}\n{r.stderr}"
    assert any(n in r.stderr for n in names), f"names none of {names}: {r.stderr}"
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    return r.stderr


# (config.json field, the value written, what the refusal may name: the field or the tensor).
DISAGREEING = [
    ("num_key_value_heads", 4, ["model.layers.0.self_attn.k_proj.weight"]),
    ("num_attention_heads", 6, ["model.layers.0.self_attn.q_proj.weight"]),
    ("head_dim", 32, ["model.layers.0.self_attn.q_proj.weight"]),
    ("intermediate_size", 360, ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                "model.layers.0.mlp.down_proj.weight"]),
    ("hidden_size", 192, ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0."]),
    ("vocab_size", 256, ["model.embed_tokens.weight", "lm_head.weight"]),
    ("num_hidden_layers", 3, ["model.layers.2.", "model.layers.1.self_attn.q_proj.weight"]),
    ("num_hidden_layers", 1, ["model.layers.1."]),
    ("tie_word_embeddings", True, ["lm_head.weight"]),
]


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
@pytest.mark.parametrize("field,value,names", DISAGREEING,
                         ids=[f"{f}={v}" for f, v, _ in DISAGREEING])
def test_config_disagreeing_with_the_tensors_exits_2(tmp_path, releases, fmt, field, value, names):
    rel = copy_release(releases["llama"], tmp_path / "rel")
    c = config_of(rel)
    assert c[field] != value
    c[field] = value
    (rel / "config.json").write_text(json.dumps(c, indent=2))
    assert_refused(tmp_path, rel, fmt, [f"`{field}`", field, *names])


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
def test_unknown_architecture_exits_2(tmp_path, releases, fmt):
    rel = copy_release(releases["llama"], tmp_path / "rel")
    c = config_of(rel)
    c["architectures"] = ["NotARealModelForCausalLM"]
    (rel / "config.json").write_text(json.dumps(c, indent=2))
    assert_refused(tmp_path, rel, fmt, ["NotARealModelForCausalLM"])


def test_architecture_without_a_map_exits_2(tmp_path, releases):
    """torchtitan has no Qwen2 model: a known architecture with no torchtitan map is refused."""
    rel = copy_release(releases["qwen2"], tmp_path / "rel")
    assert_refused(tmp_path, rel, "torchtitan", ["Qwen2ForCausalLM"])


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
def test_tensor_the_map_does_not_place_exits_2(tmp_path, releases, fmt):
    """A tensor LlamaForCausalLM has no place for, in one of the release's files and its index."""
    from safetensors.torch import save_file

    rel = copy_release(releases["llama"], tmp_path / "rel")
    name = "model.layers.0.mlp.extra_proj.weight"
    index_path = rel / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"]["model.layers.0.mlp.down_proj.weight"]
    tensors = load_safetensors(rel / file)
    tensors[name] = torch.ones(352, 160)
    save_file(tensors, str(rel / file), metadata={"format": "pt"})
    index["weight_map"][name] = file
    index_path.write_text(json.dumps(index, indent=2))
    assert_refused(tmp_path, rel, fmt, [name])


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
def test_merge_lora_is_refused_not_ignored(tmp_path, releases, fmt):
    """An import writes the release as it is: an adapter asked for is refused (exit 2, nothing
    written), never silently left out."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    out = tmp_path / "out"
    r = run_ckpt("reshard", releases["llama"], "-o", out, "--format", fmt, "--merge-lora", adapter)
    assert r.returncode == 2, r.stderr
    assert "--merge-lora" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
def test_parts_and_object_storage_write_the_single_runs_bytes(tmp_path, releases, fmt):
    """The import as any reshard: three `--part` shares locally, the release read from `s3://`
    and written into it (whole and in three shares) give the local single run's files byte for
    byte, Megatron's tracker, common.pt and metadata.json included."""
    pytest.importorskip("boto3")
    import test_s3  # a module object, so that its tests are not collected here again

    rel = releases["qwen2" if fmt == "megatron" else "llama"]
    extra = ["--world-size", "3"] + (["--tensor-parallel-size", "2"] if fmt == "megatron" else [])
    single = tmp_path / "single"
    r = run_ckpt("reshard", rel, "-o", single, "--format", fmt, *extra)
    assert r.returncode == 0, r.stderr
    parts = tmp_path / "parts"
    for i in range(3):
        r = run_ckpt("reshard", rel, "-o", parts, "--format", fmt, *extra, "--part", f"{i}/3")
        assert r.returncode == 0, r.stderr
        # no tracker naming a save root, and no .metadata, before the last share commits it
        committed = parts / ("latest_checkpointed_iteration.txt" if fmt == "megatron" else ".metadata")
        assert committed.exists() == (i == 2), i
    test_s3.same_tree(single, parts)

    server = test_s3.S3Server()
    try:
        client = server.client()
        client.create_bucket(Bucket="ckpt")
        test_s3.upload_tree(client, rel, "ckpt", "rel")
        r = test_s3.run(server, "reshard", "s3://ckpt/rel", "-o", "s3://ckpt/whole", "--format", fmt, *extra)
        assert r.returncode == 0, r.stderr
        for i in range(3):
            r = test_s3.run(server, "reshard", "s3://ckpt/rel", "-o", "s3://ckpt/shares", "--format", fmt, *extra,
                            "--part", f"{i}/3")
            assert r.returncode == 0, r.stderr
        for prefix in ("whole", "shares"):
            got = tmp_path / prefix
            got.mkdir()
            test_s3.download_tree(client, "ckpt", prefix, got)
            test_s3.same_tree(single, got)
    finally:
        server.stop()
