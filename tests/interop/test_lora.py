"""`--merge-lora` equals PEFT's `merge_and_unload().state_dict()`: small real PEFT models, saved
as a wrapped model (whole or as DCP) or as a base checkpoint plus PEFT's adapter directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, conv1d: bool):
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 24)
        self.v_proj = torch.nn.Linear(16, 16, bias=False)
        if conv1d:
            from transformers.pytorch_utils import Conv1D

            self.c_attn = Conv1D(12, 16)  # weight [in=16, out=12]


class Model(torch.nn.Module):
    def __init__(self, conv1d: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.layers = torch.nn.ModuleList([Block(conv1d) for _ in range(2)])
        self.head = torch.nn.Linear(16, 10)


CASES = {
    "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "patterns_rslora": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"],
        rank_pattern={"layers.1.q_proj": 4, "v_proj": 2}, alpha_pattern={"^layers.0.*v_proj": 5}),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]),
    "embedding_modules_to_save": dict(
        r=4, lora_alpha=4, target_modules=["embed", "q_proj"], modules_to_save=["head"]),
    "dora_embedding": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["embed", "v_proj"]),
    "fan_in_fan_out": dict(r=4, lora_alpha=8, fan_in_fan_out=True, target_modules=["c_attn"]),
}


def make(case: str, dtype=torch.float32, seed: int = 0):
    """The base state dict and the PEFT model (random A and B) of one case."""
    torch.manual_seed(seed)
    base = Model(conv1d=case == "fan_in_fan_out")
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = LoraConfig(init_lora_weights=False, **CASES[case])
    model = get_peft_model(base, cfg)
    if "modules_to_save" in CASES[case]:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "modules_to_save" in n:
                    p.add_(0.5)
    if dtype != torch.float32:
        model = model.to(dtype)
        base_sd = {k: v.to(dtype) for k, v in base_sd.items()}
    return base_sd, model


def merged(model) -> dict:
    return {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}


def assert_matches(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        if w.dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=k)
        else:
            # Within one unit in the last place: adjacent bit patterns (same sign).
            gi, wi = g.view(torch.int16).int(), w.view(torch.int16).int()
            assert (gi - wi).abs().max().item() <= 1, k


def wrapped_checkpoint(tmp_path, model, name="wrapped.safetensors"):
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def config_dir(tmp_path, model, name="adapter"):
    d = tmp_path / name
    model.save_pretrained(d)
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_from_the_wrapped_checkpoint(run_ckpt, tmp_path, case):
    _, model = make(case)
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", ckpt_file, "-o", out, "--merge-lora", adapter / "adapter_config.json")
    assert r.returncode == 0, r.stderr
    assert_matches(load_file(out), merged(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out.safetensors", "wrapped.safetensors"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_from_the_adapter_directory(run_ckpt, tmp_path, case):
    base_sd, model = make(case)
    base = tmp_path / "base.pt"
    torch.save(base_sd, base)
    adapter = config_dir(tmp_path, model)
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", base, "-o", out, "--merge-lora", adapter)
    assert r.returncode == 0, r.stderr
    assert_matches(load_file(out), merged(model))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "patterns_rslora", "embedding_modules_to_save", "dora", "fan_in_fan_out"])
def test_merge_in_half_precision_is_within_one_ulp(run_ckpt, tmp_path, case, dtype):
    _, model = make(case, dtype)
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", ckpt_file, "-o", out, "--merge-lora", adapter / "adapter_config.json")
    assert r.returncode == 0, r.stderr
    assert_matches(load_file(out), merged(model))


def test_merge_from_dcp_with_reshard_and_selection(run_ckpt, tmp_path):
    import torch.distributed.checkpoint as dcp

    _, model = make("plain")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "dcp"))
    adapter = config_dir(tmp_path, model)
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", tmp_path / "dcp", "-o", out, "--merge-lora", adapter / "adapter_config.json",
                 "--strip-prefix", "model.", "--exclude", "model.embed.*")
    assert r.returncode == 0, r.stderr
    want = {k: v for k, v in merged(model).items() if not k.startswith("embed.")}
    assert_matches(load_file(out), want)
    resharded = tmp_path / "resharded"
    r = run_ckpt("reshard", tmp_path / "dcp", "-o", resharded, "--world-size", "2",
                 "--merge-lora", adapter / "adapter_config.json")
    assert r.returncode == 0, r.stderr
    back = tmp_path / "back.safetensors"
    assert run_ckpt("consolidate", resharded, "-o", back).returncode == 0
    assert_matches(load_file(back), {f"model.{k}": v for k, v in merged(model).items()})


def test_several_adapters_need_a_name(run_ckpt, tmp_path):
    _, model = make("plain")
    model.add_adapter("second", LoraConfig(init_lora_weights=False, r=2, lora_alpha=3,
                                           target_modules=["q_proj"]))
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", ckpt_file, "-o", out, "--merge-lora", adapter)
    assert r.returncode != 0 and "several LoRA adapters" in r.stderr and "--adapter" in r.stderr
    assert not out.exists()
    r = run_ckpt("consolidate", ckpt_file, "-o", out, "--merge-lora", adapter / "second", "--adapter", "second")
    assert r.returncode == 0, r.stderr
    model.set_adapter("second")
    assert_matches(load_file(out), merged(model))


def bad_inputs(tmp_path):
    base_sd, model = make("plain")
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    cfg = json.loads((adapter / "adapter_config.json").read_text())

    def config(name, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
        return d

    no_q = {k: v for k, v in base_sd.items() if k != "layers.0.q_proj.weight"}
    torch.save(no_q, tmp_path / "no_q.pt")
    wrong = dict(base_sd, **{"layers.0.q_proj.weight": torch.zeros(24, 8)})
    torch.save(wrong, tmp_path / "wrong.pt")
    return {
        "no base weight": (tmp_path / "no_q.pt", adapter, [], "has no base weight"),
        "shape": (tmp_path / "wrong.pt", adapter, [], "does not fit"),
        "rank": (ckpt_file, config("rank", r=4), [], "rank 4"),
        "unknown adapter": (ckpt_file, adapter / "adapter_config.json", ["--adapter", "other"], "no LoRA adapter `other`"),
        "peft type": (ckpt_file, config("ia3", peft_type="IA3"), [], "`IA3`"),
    }


@pytest.mark.parametrize("case", ["no base weight", "shape", "rank", "unknown adapter", "peft type"])
def test_bad_input_is_an_error_that_writes_nothing(run_ckpt, tmp_path, case):
    src, config, extra, message = bad_inputs(tmp_path)[case]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = run_ckpt("consolidate", src, "-o", out_dir / "out.safetensors", "--merge-lora", config, *extra)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert list(out_dir.iterdir()) == []


def test_without_merge_lora_the_adapters_stay(run_ckpt, tmp_path):
    _, model = make("dora")
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    out = tmp_path / "out.safetensors"
    assert run_ckpt("consolidate", ckpt_file, "-o", out).returncode == 0
    assert sorted(load_file(out)) == sorted(model.state_dict())
    folded = tmp_path / "folded.safetensors"
    r = run_ckpt("consolidate", ckpt_file, "-o", folded, "--merge-lora", adapter)
    assert r.returncode == 0, r.stderr
    assert not any("lora" in k or "base_model" in k for k in load_file(folded))


def test_inspect_shows_the_adapters(run_ckpt, tmp_path):
    _, model = make("patterns_rslora")
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    r = run_ckpt("inspect", ckpt_file)
    assert r.returncode == 0, r.stderr
    assert "lora adapter `default`" in r.stdout and "4 modules (q_proj, v_proj), r 2/4/8" in r.stdout
    r = run_ckpt("inspect", ckpt_file, "--lora-config", adapter)
    assert r.returncode == 0, r.stderr
    assert "alpha 5/16" in r.stdout, r.stdout


def test_a_run_that_fails_after_the_fold_leaves_nothing_behind(run_ckpt, tmp_path):
    _, model = make("plain")
    ckpt_file = wrapped_checkpoint(tmp_path, model)
    adapter = config_dir(tmp_path, model)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "out.safetensors").write_bytes(b"already here")
    r = run_ckpt("consolidate", ckpt_file, "-o", out_dir / "out.safetensors", "--merge-lora", adapter)
    assert r.returncode != 0
    assert [p.name for p in out_dir.iterdir()] == ["out.safetensors"]
    assert (out_dir / "out.safetensors").read_bytes() == b"already here"
    r = run_ckpt("consolidate", ckpt_file, "-o", out_dir / "out.safetensors", "--merge-lora", adapter, "--force")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out_dir.iterdir()] == ["out.safetensors"]
    assert_matches(load_file(out_dir / "out.safetensors"), merged(model))


FIXTURES = {
    # case: (input, --merge-lora), relative to fixtures/lora/
    "llama_fsdp2": ("llama_fsdp2", "llama_fsdp2"),
    "dora": ("dora", "dora"),
    "embedding": ("embedding", "embedding"),
    "gpt2_fan_in_fan_out": ("gpt2_fan_in_fan_out", "gpt2_fan_in_fan_out"),
    "rslora_bf16": ("rslora_bf16/peft_model.safetensors", "rslora_bf16"),
    "dora_f32": ("dora_f32/peft_model.safetensors", "dora_f32"),
    "adapter_apart": ("adapter_apart/model.safetensors", "adapter_apart/lora_adapter"),
}


@pytest.mark.parametrize("case", sorted(FIXTURES))
def test_fixtures_merge_as_peft_did(run_ckpt, tmp_path, case):
    """The committed PEFT 0.21.2 fixtures (FSDP2 DCP, one file, an adapter saved apart): bitwise
    equal to merge_and_unload's state dict, but for DoRA in f32, whose row norm torch sums in an
    order of its own (within 2 ulp, fixtures/lora/FORMAT.md §5)."""
    from ckpt_helpers import FIXTURES_DIR

    src, config = FIXTURES[case]
    lora = FIXTURES_DIR / "lora"
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", lora / src, "-o", out, "--merge-lora", lora / config)
    assert r.returncode == 0, r.stderr
    got = load_file(out)
    want = torch.load(FIXTURES_DIR / "expected" / f"lora_{case}.pt", weights_only=True)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        if case == "dora_f32":
            torch.testing.assert_close(got[k], w, rtol=2.5e-7, atol=1e-7, msg=k)
        else:
            assert torch.equal(got[k], w), k


@pytest.mark.parametrize("case", ["llama_fsdp2", "dora"])
def test_fixture_merged_with_dtype_is_the_merge_cast(run_ckpt, tmp_path, case):
    """`--merge-lora --dtype bf16` of FSDP2 DCP saves (f32 and bf16): the fold computes each box
    from both ranks' pieces, then casts, so the output is torch's merge `.to(torch.bfloat16)`
    (an f32 source's pieces after a box's first once landed at offsets of the bf16 output)."""
    from ckpt_helpers import FIXTURES_DIR

    lora = FIXTURES_DIR / "lora" / case
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", lora, "-o", out, "--merge-lora", lora, "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    want = torch.load(FIXTURES_DIR / "expected" / f"lora_{case}.pt", weights_only=True)
    got = load_file(out)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        want_k = w.to(torch.bfloat16) if w.is_floating_point() else w
        assert torch.equal(got[k], want_k), k


def test_fixture_resharded_with_the_merge_reads_back_bitwise(run_ckpt, tmp_path):
    from ckpt_helpers import FIXTURES_DIR

    lora = FIXTURES_DIR / "lora" / "llama_fsdp2"
    r = run_ckpt("reshard", lora, "-o", tmp_path / "dcp", "--world-size", "3", "--merge-lora", lora)
    assert r.returncode == 0, r.stderr
    assert run_ckpt("consolidate", tmp_path / "dcp", "-o", tmp_path / "back.safetensors").returncode == 0
    want = torch.load(FIXTURES_DIR / "expected" / "lora_llama_fsdp2.pt", weights_only=True)
    got = load_file(tmp_path / "back.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], w) for k, w in want.items())


@pytest.mark.parametrize(
    "case,command",
    [("llama_fsdp2", "consolidate"), ("dora", "reshard"), ("embedding", "consolidate"), ("rslora_bf16", "reshard")],
)
def test_parts_of_a_merge_equal_the_whole_run(run_ckpt, tmp_path, case, command):
    """`--part I/N` with `--merge-lora`: each part folds only the boxes of the merged weights it
    writes (DoRA's row norms from the whole weight), and the parts together equal the run without
    `--part`, byte for byte."""
    from ckpt_helpers import FIXTURES_DIR

    src, config = FIXTURES[case]
    lora = FIXTURES_DIR / "lora"
    if command == "consolidate":
        name, extra = "out.safetensors", []
    else:
        name, extra = "out", ["--world-size", "3"]
    whole = tmp_path / "whole" / name
    r = run_ckpt(command, lora / src, "-o", whole, "--merge-lora", lora / config, *extra)
    assert r.returncode == 0, r.stderr
    parts = tmp_path / "parts" / name
    for i in range(3):
        r = run_ckpt(command, lora / src, "-o", parts, "--merge-lora", lora / config, *extra, "--part", f"{i}/3")
        assert r.returncode == 0, r.stderr
    files = sorted(p.relative_to(whole).as_posix() for p in whole.rglob("*") if p.is_file()) if whole.is_dir() else [""]
    assert files == (
        sorted(p.relative_to(parts).as_posix() for p in parts.rglob("*") if p.is_file()) if parts.is_dir() else [""]
    )
    for f in files:
        assert (parts / f).read_bytes() == (whole / f).read_bytes(), f
    if command == "consolidate":
        assert not [k for k in load_file(whole) if "lora_" in k]


@pytest.mark.parametrize("case", sorted(FIXTURES))
def test_from_pretrained_of_the_merge_gives_the_merged_models_logits(run_ckpt, tmp_path, case):
    """The merged output, beside the model's config, loads in transformers' `from_pretrained` and
    gives the logits PEFT's merged model gave on the same input (bit for bit, as the weights are;
    DoRA in f32 within its 2 ulp)."""
    import shutil

    from ckpt_helpers import FIXTURES_DIR
    from transformers import AutoModelForCausalLM

    src, config = FIXTURES[case]
    lora = FIXTURES_DIR / "lora"
    model_dir = tmp_path / "merged"
    model_dir.mkdir()
    r = run_ckpt("consolidate", lora / src, "-o", model_dir / "model.safetensors", "--merge-lora", lora / config)
    assert r.returncode == 0, r.stderr
    base_config = next(p for p in [lora / case / "config.json", (lora / src).parent / "config.json"] if p.is_file())
    shutil.copy(base_config, model_dir / "config.json")
    want = torch.load(FIXTURES_DIR / "expected" / f"lora_{case}_logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        got = model(want["input_ids"]).logits
    assert got.dtype == want["logits"].dtype and got.shape == want["logits"].shape
    # PEFT's merged model's logits where the fixture was made; CPUs with other vector units
    # compute the same weights' forward a few ulp apart
    torch.testing.assert_close(got, want["logits"], rtol=1e-5, atol=1e-5)
    # and bit for bit, on this machine, the logits of the state dict merge_and_unload gave
    # (expected/lora_<case>.pt) loaded the same way
    from safetensors.torch import save_file

    merged = torch.load(FIXTURES_DIR / "expected" / f"lora_{case}.pt", weights_only=True)
    ref_dir = tmp_path / "peft"
    ref_dir.mkdir()
    save_file({k: v.clone().contiguous() for k, v in merged.items()}, ref_dir / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(base_config, ref_dir / "config.json")
    reference = AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    with torch.no_grad():
        ref = reference(want["input_ids"]).logits
    if case == "dora_f32":
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, ref)
