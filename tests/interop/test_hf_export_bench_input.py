"""The inputs and torch references of scripts/bench-hf-export (scripts/hf_export_bench_input.py),
on models of a few MB (HF_BENCH_SMALL=1): torchtitan's own load and `to_hf` accept the torchtitan
input, and ckpt's export equals each torch converter's bit for bit (the torchtitan Llama's Q/K
rows permuted, the Megatron TP=2 save's QKV and fc1 split, the Megatron MoE's EP=2 experts split
per expert), and ckpt's import of a Hugging Face Qwen3-MoE release equals each torch importer's
through torch's DCP reader (Megatron-core's names, whose layout is checked against megatron-core's
own save of the same model, and torchtitan's `from_hf`), as the bench checks at 2 GB."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[2] / "scripts" / "hf_export_bench_input.py"


def helper(*args, timeout: float = 300) -> None:
    env = dict(os.environ, HF_BENCH_SMALL="1")
    proc = subprocess.run([sys.executable, str(HELPER), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_torchtitan_export_equals_convert_to_hf_and_the_whole_model_converter(run_ckpt, tmp_path):
    helper("tt-input", tmp_path / "in", "--layers", 2)
    helper("tt-convert", tmp_path / "in" / "ckpt", tmp_path / "convert", "--hf", tmp_path / "in" / "hf")
    helper("tt-full", tmp_path / "in" / "ckpt", tmp_path / "full", "--hf", tmp_path / "in" / "hf")
    proc = run_ckpt("consolidate", tmp_path / "in" / "ckpt", "-o", tmp_path / "ckpt", "--hf-config", tmp_path / "in" / "hf")
    assert proc.returncode == 0, proc.stderr
    helper("compare", tmp_path / "ckpt", tmp_path / "convert")
    helper("compare", tmp_path / "ckpt", tmp_path / "full")


def test_megatron_tp2_export_equals_the_whole_model_converter(run_ckpt, tmp_path):
    helper("mg-input", tmp_path / "in", "--layers", 2)
    helper("mg-full", tmp_path / "in" / "ckpt", tmp_path / "full", "--hf", tmp_path / "in" / "hf")
    proc = run_ckpt("consolidate", tmp_path / "in" / "ckpt", "-o", tmp_path / "ckpt", "--hf-config", tmp_path / "in" / "hf")
    assert proc.returncode == 0, proc.stderr
    helper("compare", tmp_path / "ckpt", tmp_path / "full")


def test_fp8_block_equals_the_streaming_torch_quantizer(run_ckpt, tmp_path):
    helper("hf-input", tmp_path / "in", "--layers", 2)
    model = tmp_path / "in" / "model"
    helper("fp8-ref", model, tmp_path / "ref")
    proc = run_ckpt("consolidate", model, "-o", tmp_path / "ckpt", "--hf-config", model, "--quantize", "fp8-block")
    assert proc.returncode == 0, proc.stderr
    helper("compare", tmp_path / "ckpt", tmp_path / "ref")


@pytest.fixture(scope="module")
def moe_input(tmp_path_factory) -> Path:
    """megatron-core's own save of a 2-layer Qwen3-MoE-style GPTModel at EP=2 (the moe bench's input)."""
    root = tmp_path_factory.mktemp("moe_input")
    helper("moe-input", root, "--layers", 2)
    return root


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A Qwen3-MoE release of the same sizes, written by transformers (the import bench's input)."""
    root = tmp_path_factory.mktemp("import_input")
    helper("import-input", root, "--layers", 2)
    return root / "model"


def test_megatron_moe_ep2_export_equals_the_whole_model_converter(run_ckpt, moe_input, tmp_path):
    helper("moe-full", moe_input / "ckpt", tmp_path / "full", "--hf", moe_input / "hf")
    proc = run_ckpt("consolidate", moe_input / "ckpt", "-o", tmp_path / "ckpt", "--hf-config", moe_input / "hf")
    assert proc.returncode == 0, proc.stderr
    helper("compare", tmp_path / "ckpt", tmp_path / "full")


@pytest.mark.parametrize("fmt", ["megatron", "torchtitan"])
def test_import_equals_the_whole_model_importer(run_ckpt, moe_input, release, tmp_path, fmt):
    helper("import-ref", release, tmp_path / "ref", "--format", fmt)
    spec = []
    if fmt == "megatron":
        # the reference's names, global shapes, dtypes and extra-state objects are those of
        # megatron-core's own save of the same model (local layer spec)
        helper("compare-dcp", tmp_path / "ref", moe_input / "ckpt", "--layout")
        if "--transformer-impl" in run_ckpt("reshard", "--help").stdout:
            spec = ["--transformer-impl", "local"]
    proc = run_ckpt("reshard", release, "-o", tmp_path / "ckpt", "--format", fmt, "--world-size", 2, *spec)
    assert proc.returncode == 0, proc.stderr
    helper("compare-dcp", tmp_path / "ckpt", tmp_path / "ref")
