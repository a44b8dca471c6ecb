"""`--dtype` casts equal PyTorch's `Tensor.to(dtype)` bit for bit, odd values included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_helpers import bitwise_equal

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
TARGETS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tricky(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of the small types; for f32/f64, specials, subnormals, exact ties and a
    million random bit patterns (NaN payloads included)."""
    g = torch.Generator().manual_seed(0)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    if dtype == torch.float32:
        special = torch.tensor(
            [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345, 0x7FBFFFFF, 0x7F800000, 0xFF800000,
             0x3F808000, 0x3F818000, 0x3F808001, 0x00000001, 0x80000001, 0x007FFFFF, 0x7F7FFFFF,
             0x477FF000, 0x477FEFFF, 0x387FC000, 0x33000000, 0x33000001, 0x00000000, 0x80000000],
            dtype=torch.int64).to(torch.int32)
        rand = torch.randint(-(2**31), 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int32)
        return torch.cat([special, rand]).view(torch.float32)
    rand = torch.randint(-(2**63), 2**63 - 1, (1_000_000,), generator=g, dtype=torch.int64)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2**-8 + 2**-40, 1e-320,
                            3.5e38, -0.0, 65520.0, 65519.99], dtype=torch.float64)
    return torch.cat([special, rand.view(torch.float64)])


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_dtype_cast_matches_torch_bitwise(run_ckpt, tmp_path, target):
    sd = {f"t.{str(d).removeprefix('torch.')}": tricky(d) for d in FLOATS}
    sd["ints.untouched"] = torch.arange(-5, 5, dtype=torch.int32)
    sd["mask.untouched"] = torch.tensor([True, False, True])
    src = tmp_path / "in.safetensors"
    save_file(sd, str(src))
    out = tmp_path / "out.safetensors"
    proc = run_ckpt("consolidate", src, "-o", out, "--dtype", target, "-q")
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(out))
    bad = []
    for name, t in sd.items():
        want = t if not t.is_floating_point() else t.to(TARGETS[target])
        if not bitwise_equal(got[name], want):
            g = got[name].reshape(-1).view(torch.uint8).reshape(len(t), -1)
            w = want.reshape(-1).view(torch.uint8).reshape(len(t), -1)
            first = (g != w).any(dim=1).nonzero()[0].item()
            bad.append(f"{name}[{first}]: src {t.view(-1)[first:first+1].view(torch.uint8).tolist()} "
                       f"got {g[first].tolist()} want {w[first].tolist()}")
    assert not bad, "\n".join(bad)
