"""Tensors inside lists and tuples of a torch.save file: read as DCP flattens them (item `i` of
`a` is `a.i`), consolidated and resharded bit for bit, lists rebuilt where torch rebuilds them."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt_helpers import bitwise_equal, load_safetensors
from conftest import run_ckpt


def saved(tmp_path):
    g = torch.Generator().manual_seed(14)
    obj = {
        "a": [torch.randn(3, 2, generator=g), torch.randn(4, generator=g).to(torch.bfloat16)],
        "b": (torch.randn(5, generator=g), 7, "x"),
        "c": {"d": [[torch.randn(1, generator=g)], 5]},
        "e": [1, 2],
    }
    path = tmp_path / "lists.pt"
    torch.save(obj, path)
    return path, obj


def same(got, want) -> None:
    """`got` equals `want` bit for bit, a tuple of `want` read back as a list."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and bitwise_equal(got, want)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), got
        for g, w in zip(got, want):
            same(g, w)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            same(got[k], want[k])
    else:
        assert got == want


def test_tensors_in_lists_are_named_as_dcp_flattens_them(ckpt, tmp_path):
    path, obj = saved(tmp_path)
    assert run_ckpt("verify", path).returncode == 0
    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", path, "-o", out)
    assert r.returncode == 0, r.stderr
    got = load_safetensors(out)
    want = {"a.0": obj["a"][0], "a.1": obj["a"][1], "b.0": obj["b"][0], "c.d.0.0": obj["c"]["d"][0][0]}
    assert got.keys() == want.keys()
    for k in want:
        assert bitwise_equal(got[k], want[k]), k


def test_tensors_in_lists_come_back_in_lists(ckpt, tmp_path):
    path, obj = saved(tmp_path)
    out = tmp_path / "out.pt"
    r = run_ckpt("consolidate", path, "-o", out, "--format", "torch")
    assert r.returncode == 0, r.stderr
    same(torch.load(out, weights_only=True), obj)


def test_tensors_in_lists_reshard_to_dcp_that_torch_rebuilds(ckpt, tmp_path):
    path, obj = saved(tmp_path)
    out = tmp_path / "dcp"
    r = run_ckpt("reshard", path, "-o", out, "--world-size", "2")
    assert r.returncode == 0, r.stderr
    dcp_to_torch_save(out, tmp_path / "back.pt")
    same(torch.load(tmp_path / "back.pt", weights_only=True), obj)
