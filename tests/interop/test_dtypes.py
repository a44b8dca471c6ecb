"""The dtypes beyond the common ones, through every layout: complex64 (C64), float8_e8m0fnu
(F8_E8M0), float8_e4m3fnuz and float8_e5m2fnuz (F8_E4M3FNUZ, F8_E5M2FNUZ) wherever they go, and
complex128, complex32 and float4_e2m1fn_x2, which safetensors cannot hold, through torch.save and
DCP. Each chain of ckpt conversions ends in a file PyTorch or safetensors reads back, compared bitwise
with what torch held when it wrote the fixture (fixtures/expected/<name>.pt).

Also here: `--dtype` leaves these kinds as they are, and `--include/--exclude` act before ckpt
checks that it supports a tensor's dtype (fixtures/unsupported_dtypes/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_helpers import (
    FIXTURES_DIR,
    SAFETENSORS_LACKS,
    assert_same_state,
    bitwise_equal,
    expected_tensors,
    load_expected,
    load_safetensors,
    load_with_torch,
)
from conftest import run_ckpt

NEW_KINDS = {torch.complex64, torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
KEPT_BY_CAST = NEW_KINDS | SAFETENSORS_LACKS
UNSUPPORTED = FIXTURES_DIR / "unsupported_dtypes"


def fixture(name: str) -> Path:
    return FIXTURES_DIR / load_expected(FIXTURES_DIR, name)[1]["path"]


def ckpt_ok(*args) -> str:
    proc = run_ckpt(*args)
    assert proc.returncode == 0, f"ckpt {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}"
    return proc.stderr


def test_fixtures_hold_every_new_dtype():
    held = set()
    for name in ("dtypes", "dtypes_safetensors", "dtypes_torch_save", "dtypes_torch_dcp"):
        held |= {t.dtype for t in expected_tensors(load_expected(FIXTURES_DIR, name)[0]).values()}
    assert KEPT_BY_CAST <= held, KEPT_BY_CAST - held


# (fixture, chain of ckpt steps: (subcommand, output name, flags)); the last output is read by torch
CHAINS = {
    "safetensors-dcp3-safetensors": ("dtypes_safetensors", [
        ("reshard", "s3", ["--world-size", "3"]),
        ("consolidate", "full.safetensors", []),
    ]),
    "safetensors-mesh-torch": ("dtypes_safetensors", [
        ("reshard", "m", ["--mesh", "2x2", "--placements", "S(0),R"]),
        ("consolidate", "full.pt", ["--format", "torch"]),
    ]),
    "safetensors-dcpsafetensors-dcp": ("dtypes_safetensors", [
        ("reshard", "h", ["--world-size", "2", "--format", "dcp-safetensors"]),
        ("reshard", "d", ["--world-size", "5"]),
    ]),
    "dcp4-dcp3-safetensors": ("dtypes", [
        ("reshard", "s3", ["--world-size", "3"]),
        ("consolidate", "full.safetensors", []),
    ]),
    "torch-dcp3-torch": ("dtypes_torch_save", [
        ("reshard", "s3", ["--world-size", "3"]),
        ("consolidate", "full.pt", ["--format", "torch"]),
    ]),
    "torch-mesh": ("dtypes_torch_save", [
        ("reshard", "m", ["--mesh", "2x2", "--placements", "S(0),S(1)"]),
    ]),
    "dcp4-dcp2-torch": ("dtypes_torch_dcp", [
        ("reshard", "s2", ["--world-size", "2"]),
        ("consolidate", "full.pt", ["--format", "torch"]),
    ]),
    "dcp4-dcp1": ("dtypes_torch_dcp", [
        ("reshard", "s1", ["--world-size", "1"]),
    ]),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_dtypes_round_trip_bitwise(ckpt, tmp_path, chain):
    name, steps = CHAINS[chain]
    flat, _ = load_expected(FIXTURES_DIR, name)
    src = fixture(name)
    for cmd, out, flags in steps:
        ckpt_ok(cmd, src, "-o", tmp_path / out, *flags, "-q")
        src = tmp_path / out
    got = load_with_torch(src)  # dcp_to_torch_save, safe_open or torch.load
    if src.suffix == ".safetensors":
        flat = expected_tensors(flat)  # safetensors holds no plain values
    assert_same_state(got, flat, chain)


def test_dtypes_safetensors_output_is_what_safetensors_writes(ckpt, tmp_path):
    """Consolidating a file safetensors 0.8 wrote gives back its bytes: the same dtype codes
    (C64, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ), header and data."""
    out = tmp_path / "same.safetensors"
    ckpt_ok("consolidate", fixture("dtypes_safetensors"), "-o", out, "-q")
    assert out.read_bytes() == fixture("dtypes_safetensors").read_bytes()


def test_torch_only_dtypes_are_refused_for_safetensors(ckpt, tmp_path):
    for args, suggestion in [
        (["consolidate", fixture("dtypes_torch_dcp"), "-o", tmp_path / "x.safetensors"], "--format torch"),
        (["consolidate", fixture("dtypes_torch_save"), "-o", tmp_path / "split", "--max-shard-size", "1KB"],
         "--format torch"),
        (["reshard", fixture("dtypes_torch_save"), "-o", tmp_path / "h", "--world-size", "2",
          "--format", "dcp-safetensors"], "--format dcp"),
    ]:
        proc = run_ckpt(*args)
        assert proc.returncode == 2, f"{args}: exit {proc.returncode}\n{proc.stderr}"
        assert "torch.complex128" in proc.stderr and suggestion in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "a refused run wrote something"
    # leaving them out makes the same conversion legal
    out = tmp_path / "rest.safetensors"
    ckpt_ok("consolidate", fixture("dtypes_torch_save"), "-o", out, "--exclude", "t.c128*", "--exclude", "t.c32",
            "--exclude", "t.f4_e2m1fn_x2", "-q")
    want = {k: v for k, v in expected_tensors(load_expected(FIXTURES_DIR, "dtypes_torch_save")[0]).items()
            if v.dtype not in SAFETENSORS_LACKS}
    got = load_safetensors(out)
    assert sorted(got) == sorted(want) and all(bitwise_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32"])
def test_dtype_cast_leaves_complex_fp8_scales_and_fp4_alone(ckpt, tmp_path, target):
    to = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[target]
    flat, _ = load_expected(FIXTURES_DIR, "dtypes_torch_save")
    out = tmp_path / "cast.pt"
    stderr = ckpt_ok("consolidate", fixture("dtypes_torch_save"), "-o", out, "--format", "torch", "--dtype", target)
    got = load_with_torch(out)
    kept = []
    for k, v in expected_tensors(flat).items():
        if v.dtype in KEPT_BY_CAST:
            want = v
            kept.append(k)
        elif v.is_floating_point():
            want = v.to(to)
        else:
            want = v
        assert bitwise_equal(got[k], want), f"{k}: {v.dtype} -> {got[k].dtype}"
    assert "--dtype left" in stderr and all(k in stderr for k in kept[:8]), stderr


# --- tensors of dtypes ckpt does not support ----------------------------------------------------

# (file, the unsupported tensor, its dtype as ckpt names it, the supported tensors beside it)
UNSUPPORTED_CASES = {
    "safetensors-F4": ("f4.safetensors", "packed", "F4", ["w"]),
    "torch-bits8": ("bits8.pt", "bits", "torch.bits8", ["w"]),
    "dcp-bcomplex32": ("bcomplex32_dcp", "model.bc", "torch.bcomplex32", ["model.w"]),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED_CASES))
def test_dtypes_unsupported_tensor_blocks_only_until_excluded(ckpt, tmp_path, case):
    file, bad, dtype, rest = UNSUPPORTED_CASES[case]
    src = UNSUPPORTED / file
    want = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    want = {k: want["w"] for k in rest}
    proc = run_ckpt("consolidate", src, "-o", tmp_path / "all.pt", "--format", "torch")
    assert proc.returncode == 1, proc.stderr
    assert f"`{bad}`" in proc.stderr and f"`{dtype}`" in proc.stderr and "--exclude" in proc.stderr, proc.stderr
    assert not (tmp_path / "all.pt").exists()
    # excluded, or simply not included: the rest converts, and torch reads it back
    for flags, out in [(["--exclude", bad], "ex.pt"), (["--include", rest[0]], "in.pt")]:
        ckpt_ok("consolidate", src, "-o", tmp_path / out, "--format", "torch", *flags, "-q")
        assert_same_state(load_with_torch(tmp_path / out), want, f"{case} {flags}")
    ckpt_ok("reshard", src, "-o", tmp_path / "dcp", "--world-size", "2", "--exclude", bad, "-q")
    assert_same_state(load_with_torch(tmp_path / "dcp"), want, f"{case} reshard")
