#!/usr/bin/env python3
"""Check the outputs of scripts/bench-deepspeed --reshard-to M against the input and each other.

    .venv/bin/python scripts/deepspeed_reshard_check.py INPUT CKPT_OUT DEEPSPEED_OUT

(DEEPSPEED_OUT `-`: only the first check, on ckpt's output.)

INPUT is the ZeRO-3 checkpoint the bench read, CKPT_OUT `ckpt reshard --format deepspeed` of it,
DEEPSPEED_OUT the save of DeepSpeed's own route (ds_to_universal, an engine at M with
load_universal, save_checkpoint). Checks, one rank file at a time where it can:
- DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` gives the same tensors, bit for bit, from
  all three;
- per rank at M, ckpt's and DeepSpeed's optimizer files hold the same fp32 flat partitions and
  Adam moments on every parameter element (ZeRO-3's padding DeepSpeed leaves uninitialised; ckpt's
  must be zeros), the same `step`, `ds_id` and param-group settings.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402


def tag_dir(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def main(inp: Path, ours: Path, theirs: Path) -> None:
    want = get_fp32_state_dict_from_zero_checkpoint(str(inp))
    outputs = [("ckpt", ours)] + ([("deepspeed", theirs)] if str(theirs) != "-" else [])
    for name, path in outputs:
        got = get_fp32_state_dict_from_zero_checkpoint(str(path))
        assert sorted(got) == sorted(want), f"{name}: other tensor names"
        diff = [k for k in want if not torch.equal(got[k].contiguous(), want[k].contiguous())]
        assert not diff, f"{name}: zero_to_fp32 differs from the input's at {diff[:5]}"
        del got
    print(f"zero_to_fp32 of {' and of '.join(n for n, _ in outputs)}'s output equals the input's: "
          f"{len(want)} tensors, bit for bit")
    del want
    if str(theirs) == "-":
        return

    a, b = tag_dir(ours), tag_dir(theirs)
    files = sorted(p.name for p in a.glob("*optim_states.pt"))
    assert files == sorted(p.name for p in b.glob("*optim_states.pt")), "other optimizer files"
    m = len(files)
    shapes = torch.load(a / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)["param_shapes"]
    checked = 0
    for r in range(m):
        f = f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        x = torch.load(a / f, weights_only=False, mmap=True)["optimizer_state_dict"]
        y = torch.load(b / f, weights_only=False, mmap=True)["optimizer_state_dict"]
        assert x["partition_count"] == y["partition_count"] == m
        xs, ys = x["optimizer_state_dict"], y["optimizer_state_dict"]
        for g, group in enumerate(shapes):
            real = torch.cat([torch.arange(r * math.ceil(s.numel() / m), (r + 1) * math.ceil(s.numel() / m)) < s.numel()
                              for s in group.values()])
            pairs = [(x["fp32_flat_groups"][g], y["fp32_flat_groups"][g], "fp32")]
            pairs += [(xs["state"][g][k], ys["state"][g][k], k) for k in ("exp_avg", "exp_avg_sq")]
            for u, v, what in pairs:
                assert u.shape == v.shape == real.shape, f"rank {r} group {g} {what}: sizes differ"
                assert torch.equal(u[real], v[real]), f"rank {r} group {g} {what}: values differ"
                assert not u[~real].any(), f"rank {r} group {g} {what}: ckpt's padding is not zeros"
                checked += int(real.sum())
            assert torch.equal(xs["state"][g]["step"], ys["state"][g]["step"]), f"rank {r} group {g}: step"
            ds_ids = [getattr(t["fp32_flat_groups"][g], "ds_id", None) for t in (x, y)]
            assert ds_ids[0] == ds_ids[1], f"rank {r} group {g}: ds_id {ds_ids[0]} against DeepSpeed's {ds_ids[1]}"
        settings = [{k: v for k, v in g.items() if k != "params"} for g in xs["param_groups"]]
        assert settings == [{k: v for k, v in g.items() if k != "params"} for g in ys["param_groups"]], \
            f"rank {r}: param groups differ"
        del x, y, xs, ys
    print(f"optimizer files at {m} ranks: ckpt's equal DeepSpeed's on {checked} elements "
          "(fp32, exp_avg, exp_avg_sq), steps, ds_ids and param groups the same, ckpt's padding zeros")


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
