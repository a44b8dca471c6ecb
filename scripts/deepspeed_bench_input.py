#!/usr/bin/env python3
"""Write a large DeepSpeed ZeRO-3 checkpoint with torch directly, in the layout
`engine.save_checkpoint` writes, for benchmarks too large to train on this machine.

    .venv/bin/python scripts/deepspeed_bench_input.py OUTDIR [--gb 2.0] [--ranks 8] [--layers N]

Llama-like shapes (an embedding, per layer q/k/v/o and gate/up/down projections and two norms),
sized so the fp32 master weights are about --gb gigabytes; every size is odd, so ZeRO-3's
`ceil(numel / ranks)` split pads the last rank. Per rank: `zero_pp_rank_{r}_mp_rank_00_model_states.pt`
(the module's 0-size parameter placeholders and a persistent fp32 buffer, `buffer_names`,
`param_shapes`, empty frozen and shared entries, the counters and `ds_config` a save holds) and `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`
(`fp32_flat_groups`, each with its `ds_id`, and the inner optimizer's `exp_avg`/`exp_avg_sq` in the same flat layout, one
per parameter group: matrices with weight decay, norms without, as training scripts split them),
with DeepSpeed's own `ZeroStageEnum` and `LossScaler` objects, and the installed DeepSpeed's
`zero_to_fp32.py` copied beside `latest`, as a real save has. Values are seeded random, so tools
that read the wrong element disagree.

The layout is checked against DeepSpeed's reader by tests/interop/test_deepspeed_bench_input.py
(a small version, read by `get_fp32_state_dict_from_zero_checkpoint` and by ckpt).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections import OrderedDict
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

TAG = "global_step100"


def shapes(gb: float, layers: int | None) -> "OrderedDict[str, torch.Size]":
    """Parameter shapes of a Llama-like model of about `gb` GB of fp32, hidden size odd."""
    hidden = 2047
    inter = 5503
    vocab = 32001
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    if layers is None:
        target = gb * 1e9 / 4
        layers = max(1, round((target - 2 * vocab * hidden) / per_layer))
    out: OrderedDict[str, torch.Size] = OrderedDict()
    out["model.embed_tokens.weight"] = torch.Size([vocab, hidden])
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{n}.weight"] = torch.Size([hidden, hidden])
        out[f"{p}mlp.gate_proj.weight"] = torch.Size([inter, hidden])
        out[f"{p}mlp.up_proj.weight"] = torch.Size([inter, hidden])
        out[f"{p}mlp.down_proj.weight"] = torch.Size([hidden, inter])
        out[f"{p}input_layernorm.weight"] = torch.Size([hidden])
        out[f"{p}post_attention_layernorm.weight"] = torch.Size([hidden])
    out["model.norm.weight"] = torch.Size([hidden])
    out["lm_head.weight"] = torch.Size([vocab, hidden])
    return out


def write(outdir: Path, params: "OrderedDict[str, torch.Size]", ranks: int, seed: int = 0,
          buffers: "OrderedDict[str, torch.Size] | None" = None) -> dict:
    """Write the checkpoint; returns {name: full fp32 tensor}, buffers included, when the model is
    small (for checks)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    import deepspeed.utils.zero_to_fp32 as z2f

    tag = outdir / TAG
    tag.mkdir(parents=True, exist_ok=True)
    (outdir / "latest").write_text(TAG)
    shutil.copy(z2f.__file__, outdir / "zero_to_fp32.py")
    buffers = buffers or OrderedDict()
    small = sum(s.numel() for s in params.values()) < 10_000_000
    full = {}
    gen = torch.Generator().manual_seed(seed)
    groups = [OrderedDict((n, s) for n, s in params.items() if len(s) > 1),
              OrderedDict((n, s) for n, s in params.items() if len(s) <= 1)]
    groups = [g for g in groups if g]
    # Each rank's flat buffers, one per group, filled parameter by parameter to keep memory to one
    # parameter.
    flats = {k: [[] for _ in range(ranks)] for k in ("w", "m", "v")}
    for group in groups:
        share = {n: math.ceil(s.numel() / ranks) for n, s in group.items()}
        total = sum(share.values())
        for k in flats:
            for r in range(ranks):
                flats[k][r].append(torch.empty(total, dtype=torch.float32))
        at = 0
        for name, shape in group.items():
            n = shape.numel()
            s = share[name]
            for k in ("w", "m", "v"):
                values = torch.randn(n, generator=gen, dtype=torch.float32)
                if k == "v":
                    values = values.abs()
                padded = torch.zeros(s * ranks, dtype=torch.float32)
                padded[:n] = values
                for r in range(ranks):
                    flats[k][r][-1][at : at + s] = padded[r * s : (r + 1) * s]
                if small and k == "w":
                    full[name] = values.reshape(shape).clone()
            at += s
    buffer_values = OrderedDict((n, torch.randn(s, generator=gen, dtype=torch.float32)) for n, s in buffers.items())
    full.update(buffer_values)
    # Each flat fp32 group carries the `ds_id` stage3.py gives it: its first and last parameter's
    # ds_id (the parameters' order in the module), joined by `_`.
    ids = {n: i for i, n in enumerate(params)}
    for g, group in enumerate(groups):
        names = list(group)
        for r in range(ranks):
            flats["w"][r][g].ds_id = f"{ids[names[0]]}_{ids[names[-1]]}"
    for r in range(ranks):
        module = OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n in params)
        module.update(buffer_values)
        model_states = {
            "module": module,
            "buffer_names": list(buffers),
            "optimizer": None,
            "param_shapes": groups,
            "frozen_param_shapes": OrderedDict(),
            "shared_params": {},
            "frozen_param_fragments": OrderedDict(),
            "lr_scheduler": None,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": 0,
            "global_steps": 100,
            "global_samples": 100 * ranks,
            "dp_world_size": ranks,
            "mp_world_size": 1,
            "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
            "ds_config": {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                          "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}},
            "ds_version": "0.19.8",
        }
        torch.save(model_states, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        settings = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1 if g == 0 else 0.0,
                     "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True, "params": [g]}
                    for g in range(len(groups))]
        optim_states = {
            "optimizer_state_dict": {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": LossScaler(1.0),
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": ranks,
                "optimizer_state_dict": {
                    "state": {
                        g: {"step": torch.tensor(100.0), "exp_avg": flats["m"][r][g], "exp_avg_sq": flats["v"][r][g]}
                        for g in range(len(groups))
                    },
                    "param_groups": settings,
                },
                "fp32_flat_groups": flats["w"][r],
            },
            "ds_config": model_states["ds_config"],
            "ds_version": "0.19.8",
        }
        torch.save(optim_states, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    params = shapes(args.gb, args.layers)
    write(args.outdir, params, args.ranks, buffers=OrderedDict([("model.rotary_emb.inv_freq", torch.Size([64]))]))
    n = sum(s.numel() for s in params.values())
    print(f"{args.outdir}: ZeRO-3 over {args.ranks} ranks, {len(params)} parameters, {n * 4 / 1e9:.2f} GB fp32")


if __name__ == "__main__":
    main()
