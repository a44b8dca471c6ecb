"""Acceptance of `ckpt consolidate`: every committed fixture, consolidated to FULL, reads back with
PyTorch / safetensors exactly as fixtures/expected/<name>.pt (bitwise for tensors, == for values).

Runs against the committed fixtures (fixtures/), which test_fixtures.py pins to expected/."""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_helpers import (
    FIXTURE_NAMES,
    FIXTURES_DIR,
    assert_same_state,
    bitwise_equal,
    expected_non_tensors,
    expected_tensors,
    flatten_like_dcp,
    layout_of,
    load_expected,
    load_safetensors,
    safetensors_lacks,
    tensor_bytes,
)
from conftest import run_ckpt

SHARD_FILE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def fixture_path(name: str) -> Path:
    return FIXTURES_DIR / load_expected(FIXTURES_DIR, name)[1]["path"]


def consolidate(*args) -> None:
    proc = run_ckpt("consolidate", *args)
    assert proc.returncode == 0, f"ckpt consolidate {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}"
    return proc


def assert_refused_for_safetensors(name: str, flat: dict, *args) -> None:
    """ckpt refuses safetensors output of a fixture holding a dtype safetensors lacks: exit 2, the
    first such tensor and its torch dtype named, `--format torch` suggested, nothing written."""
    out = args[args.index("-o") + 1]
    proc = run_ckpt("consolidate", fixture_path(name), *args)
    assert proc.returncode == 2, f"{name}: exit {proc.returncode}:\n{proc.stderr}"
    first = safetensors_lacks(flat)[0]
    assert f"`{first}`" in proc.stderr and f"`{flat[first].dtype}`" in proc.stderr, proc.stderr
    assert "--format torch" in proc.stderr, proc.stderr
    assert not Path(out).exists() and not list(Path(out).parent.glob(".*ckpt-tmp*")), "refused, yet wrote"


def assert_tensors_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    bad = [k for k, w in want.items() if not bitwise_equal(got[k], w)]
    assert not bad, f"{what}: tensors differ: {bad}"


# --- one safetensors file ----------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_safetensors_file_equals_expected(ckpt, tmp_path, name):
    flat, _ = load_expected(FIXTURES_DIR, name)
    out = tmp_path / "out.safetensors"
    if safetensors_lacks(flat):
        return assert_refused_for_safetensors(name, flat, "-o", out)
    proc = consolidate(fixture_path(name), "-o", out)
    assert_tensors_equal(load_safetensors(str(out)), expected_tensors(flat), name)
    # non-tensor entries cannot live in safetensors: one note lists every one of them
    skipped = expected_non_tensors(flat)
    missing = [k for k in skipped if k not in proc.stderr]
    assert not missing, f"{name}: the note on skipped non-tensor entries lacks {missing}:\n{proc.stderr}"
    if not skipped:
        assert "skipped" not in proc.stderr, proc.stderr


# --- torch.save --------------------------------------------------------------------------------


@pytest.mark.parametrize("io", ["mmap", "read"])
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_torch_format_equals_expected(ckpt, tmp_path, name, io):
    flat, _ = load_expected(FIXTURES_DIR, name)
    out = tmp_path / "out.bin"
    consolidate(fixture_path(name), "-o", out, "--format", "torch", "--io", io)
    # torch.load does not check CRCs; Python's zipfile does, record by record
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None, f"{name}: a record's CRC-32 does not match its bytes"
    got = torch.load(out, weights_only=True)
    assert isinstance(got, dict)
    assert_same_state(flatten_like_dcp(got), flat, name)


def structure_diff(got, want, path: str = "") -> list:
    """Where two nested state dicts differ in containers, keys or leaf kinds/values."""
    where = path or "<top>"
    if type(got) is not type(want) and not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return [f"{where}: {type(got).__name__} where PyTorch has {type(want).__name__}"]
    if isinstance(want, dict):
        if list(map(repr, got)) != list(map(repr, want)) and sorted(map(repr, got)) != sorted(map(repr, want)):
            return [f"{where}: keys {sorted(map(repr, got))} where PyTorch has {sorted(map(repr, want))}"]
        return [d for k in want for d in structure_diff(got[k], want[k], f"{path}.{k}".lstrip("."))]
    if isinstance(want, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in want):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items where PyTorch has {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in structure_diff(g, w, f"{path}.{i}".lstrip("."))]
    if isinstance(want, torch.Tensor):
        return [] if (got.dtype, got.shape) == (want.dtype, want.shape) else [f"{where}: {got.dtype} {tuple(got.shape)}"]
    return [] if got == want else [f"{where}: {got!r} where PyTorch has {want!r}"]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_torch_format_nests_as_pytorch_does(ckpt, tmp_path, name):
    """The torch.save output holds the same containers PyTorch gives back: for DCP, what
    `dcp_to_torch_save` writes (optim.param_groups a list, so `Optimizer.load_state_dict` takes it);
    for torch.save, the file itself; for safetensors layouts, the flat dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = fixture_path(name)
    out = tmp_path / "out.bin"
    consolidate(src, "-o", out, "--format", "torch")
    got = torch.load(out, weights_only=True)
    layout = layout_of(src)
    if layout == "dcp":
        dcp_to_torch_save(src, tmp_path / "torch.pt")
        want = torch.load(tmp_path / "torch.pt", weights_only=True)
    elif layout == "torch_save":
        want = torch.load(src, weights_only=True)
    else:
        want = expected_tensors(load_expected(FIXTURES_DIR, name)[0])
    diffs = structure_diff(got, want)
    assert not diffs, f"{name}: " + "; ".join(diffs)


def test_torch_format_optimizer_state_loads_into_adamw(ckpt, tmp_path):
    """What a user does with a consolidated FSDP2 checkpoint: the optimizer state goes back into
    torch.optim.AdamW.load_state_dict."""
    out = tmp_path / "out.bin"
    consolidate(fixture_path("fsdp2_adamw"), "-o", out, "--format", "torch")
    sd = torch.load(out, weights_only=True)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in sd["model"].items()}
    groups = sd["optim"]["param_groups"]
    assert isinstance(groups, list), f"optim.param_groups is a {type(groups).__name__}, PyTorch writes a list"
    opt = torch.optim.AdamW([params[k] for k in groups[0]["params"]])
    opt.load_state_dict({"state": {i: sd["optim"]["state"][k] for i, k in enumerate(groups[0]["params"])},
                         "param_groups": [{**g, "params": list(range(len(g["params"])))} for g in groups]})
    assert opt.param_groups[0]["lr"] == groups[0]["lr"]


# --- Hugging Face split files ------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_max_shard_size_split_files(ckpt, tmp_path, name):
    flat, _ = load_expected(FIXTURES_DIR, name)
    want = expected_tensors(flat)
    total = sum(map(tensor_bytes, want.values()))
    limit = min(300, total // 3)  # 300 B, or a third of the smallest fixtures
    out = tmp_path / "split"
    if safetensors_lacks(flat):
        return assert_refused_for_safetensors(name, flat, "-o", out, "--max-shard-size", f"{limit}B")
    consolidate(fixture_path(name), "-o", out, "--max-shard-size", f"{limit}B")

    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files, files
    shards = [f for f in files if f != "model.safetensors.index.json"]
    assert all(SHARD_FILE.fullmatch(f) for f in shards), f"unexpected files {shards}"
    n = len(shards)
    assert n >= 3, f"{name}: {n} files for {total} B at --max-shard-size {limit}B"
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert index["metadata"]["total_size"] == total
    got = {}
    for f in shards:
        with safe_open(str(out / f), "pt") as st:
            keys = list(st.keys())
        assert keys, f"{f} holds no tensor"
        for k in keys:
            assert weight_map.get(k) == f, f"{k} is in {f}, the index says {weight_map.get(k)}"
        part = load_safetensors(str(out / f))
        size = sum(map(tensor_bytes, part.values()))
        assert size <= limit or len(part) == 1, f"{f}: {size} B in {len(part)} tensors over {limit} B"
        assert not set(part) & set(got), f"{sorted(set(part) & set(got))} in two files"
        got.update(part)
    assert sorted(weight_map) == sorted(got), "the index names tensors no file holds, or misses some"
    assert set(weight_map.values()) == set(shards)
    assert_tensors_equal(got, want, name)


def test_directory_output_of_one_file_is_model_safetensors(ckpt, tmp_path):
    out = tmp_path / "outdir"
    consolidate(FIXTURES_DIR / "single.safetensors", "-o", out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert_tensors_equal(load_safetensors(str(out / "model.safetensors")), load_safetensors(str(FIXTURES_DIR / "single.safetensors")), "single")


# --- torch.save specifics: tied weights and views ----------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_tied_weights_and_views(ckpt, tmp_path, fmt):
    src = torch.load(FIXTURES_DIR / "torch_save.bin", weights_only=True)
    assert src["embed.weight"].untyped_storage().data_ptr() == src["lm_head.weight"].untyped_storage().data_ptr()
    if fmt == "safetensors":
        out = tmp_path / "out.safetensors"
        consolidate(FIXTURES_DIR / "torch_save.bin", "-o", out)
        got = load_safetensors(str(out))
    else:
        out = tmp_path / "out.bin"
        consolidate(FIXTURES_DIR / "torch_save.bin", "-o", out, "--format", "torch")
        got = flatten_like_dcp(torch.load(out, weights_only=True))
        # written as separate tensors: no storage shared between the tied pair
        assert got["embed.weight"].untyped_storage().data_ptr() != got["lm_head.weight"].untyped_storage().data_ptr()
    for k in ("embed.weight", "lm_head.weight", "proj.weight", "proj.weight_t", "proj.weight_tail", "proj.row_strided"):
        assert k in got, k
        assert bitwise_equal(got[k], src[k]), f"{fmt}: {k} differs from PyTorch's value"
    assert bitwise_equal(got["embed.weight"], got["lm_head.weight"])
    # the views are the values PyTorch sees through them, not the storage they start at
    w = src["proj.weight"]
    assert bitwise_equal(got["proj.weight_t"], w.t().contiguous())
    assert bitwise_equal(got["proj.weight_tail"], w[2:].contiguous())
    assert bitwise_equal(got["proj.row_strided"], w[:, 1].contiguous())


# --- selection ---------------------------------------------------------------------------------


def test_include_strip_prefix_gives_the_models_parameters(ckpt, tmp_path):
    flat, _ = load_expected(FIXTURES_DIR, "fsdp2_adamw")
    out = tmp_path / "model.safetensors"
    consolidate(fixture_path("fsdp2_adamw"), "-o", out, "--include", "model.*", "--strip-prefix", "model.")
    want = {k.removeprefix("model."): v for k, v in expected_tensors(flat).items() if k.startswith("model.")}
    assert sorted(want) == ["embed.weight", "head.weight", "layers.0.bias", "layers.0.weight",
                            "layers.1.bias", "layers.1.weight", "norm.bias", "norm.weight"]
    assert_tensors_equal(load_safetensors(str(out)), want, "--include model.* --strip-prefix model.")


def test_exclude_and_repeated_include(ckpt, tmp_path):
    flat, _ = load_expected(FIXTURES_DIR, "fsdp2_adamw")
    tensors = expected_tensors(flat)
    out = tmp_path / "a.safetensors"
    consolidate(fixture_path("fsdp2_adamw"), "-o", out, "--exclude", "optim.*", "--exclude", "*.bias")
    want = {k: v for k, v in tensors.items() if not k.startswith("optim.") and not k.endswith(".bias")}
    assert_tensors_equal(load_safetensors(str(out)), want, "--exclude optim.* --exclude *.bias")

    out = tmp_path / "b.bin"
    consolidate(fixture_path("fsdp2_adamw"), "-o", out, "--format", "torch",
                "--include", "model.head.*", "--include", "optim.state.head.*")
    got = flatten_like_dcp(torch.load(out, weights_only=True))
    got = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
    want = {k: v for k, v in tensors.items() if k.startswith(("model.head.", "optim.state.head."))}
    assert_tensors_equal(got, want, "--include model.head.* --include optim.state.head.*")


# --- determinism -------------------------------------------------------------------------------


def files_under(path: Path) -> dict:
    """{relative path: bytes} of a file, or of every file in a directory."""
    if path.is_file():
        return {Path(): path.read_bytes()}
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_two_runs_give_byte_identical_files(ckpt, tmp_path, name):
    src = fixture_path(name)
    outputs = {"one.safetensors": [], "one.bin": ["--format", "torch"], "split": ["--max-shard-size", "300B"]}
    if safetensors_lacks(load_expected(FIXTURES_DIR, name)[0]):
        outputs = {"one.bin": ["--format", "torch"]}
    # same output name in both runs (a torch.save archive names its records after the file)
    for out, extra in outputs.items():
        runs = []
        for run in ("a", "b"):
            (tmp_path / run).mkdir(exist_ok=True)
            consolidate(src, "-o", tmp_path / run / out, *extra)
            runs.append(files_under(tmp_path / run / out))
        assert runs[0], f"{name}: {out} is empty"
        assert sorted(runs[0]) == sorted(runs[1]), f"{name}: {out}: different files"
        differ = [str(k) for k in runs[0] if runs[0][k] != runs[1][k]]
        assert not differ, f"{name}: {out}: {differ} differ between two runs"


# --- refusals ----------------------------------------------------------------------------------


def test_existing_output_is_kept_without_force(ckpt, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    proc = run_ckpt("consolidate", FIXTURES_DIR / "single.safetensors", "-o", out)
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr}"
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"], "left files behind"
    consolidate(FIXTURES_DIR / "single.safetensors", "-o", out, "--force")
    assert_tensors_equal(load_safetensors(str(out)), load_safetensors(str(FIXTURES_DIR / "single.safetensors")), "--force")


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_output_equal_to_input_is_refused(ckpt, tmp_path, force):
    # copies, so that a broken refusal cannot damage the committed fixtures
    single = tmp_path / "single.safetensors"
    shutil.copy(FIXTURES_DIR / "single.safetensors", single)
    split = tmp_path / "hf_split"
    shutil.copytree(FIXTURES_DIR / "hf_split", split)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for src, out in [(single, single), (split, split), (split, split / "inner.safetensors")]:
        proc = run_ckpt("consolidate", src, "-o", out, *force)
        assert proc.returncode == 2, f"consolidate {src.name} -o {out} {force}: exit {proc.returncode}\n{proc.stderr}"
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before, "the input was modified"
