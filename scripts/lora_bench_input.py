#!/usr/bin/env python3
"""Write a large PEFT-wrapped Llama-like checkpoint with torch directly, saved sharded as FSDP2
saves it, for `scripts/bench-lora` (too large to build as a transformers model on this machine).

    .venv/bin/python scripts/lora_bench_input.py OUTDIR [--layers 8] [--r 16] [--dtype bf16]

Shapes of a 1B Llama (hidden 2048, intermediate 5504, vocab 32000, untied lm_head; 8 layers give
1.07 GB of bf16 base weights), names as `get_model_state_dict` of `get_peft_model(model, config)`
gives them: `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`, and
`….lora_A.default.weight` [r, in] / `….lora_B.default.weight` [out, r] in f32 (PEFT's
`autocast_adapter_dtype`) on every linear layer of every decoder layer (q/k/v/o, gate/up/down).
Two processes (gloo) each hold a `Shard(0)` DTensor of every tensor, as `fully_shard` leaves them,
and `dcp.save` writes `.metadata`, `__0_0.distcp` and `__1_0.distcp`. Values are seeded random
(B too, as after training). PEFT's `LoraConfig(r, lora_alpha=2r).save_pretrained` writes
`adapter_config.json` beside them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, INTER, VOCAB = 2048, 5504, 32000
PREFIX = "base_model.model."
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shapes(layers: int, r: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, "base" or "adapter")} in the order the state dict gives them."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    out[f"{PREFIX}model.embed_tokens.weight"] = ((VOCAB, HIDDEN), "base")
    for i in range(layers):
        p = f"{PREFIX}model.layers.{i}."
        linear = {
            "self_attn.q_proj": (HIDDEN, HIDDEN),
            "self_attn.k_proj": (HIDDEN, HIDDEN),
            "self_attn.v_proj": (HIDDEN, HIDDEN),
            "self_attn.o_proj": (HIDDEN, HIDDEN),
            "mlp.gate_proj": (INTER, HIDDEN),
            "mlp.up_proj": (INTER, HIDDEN),
            "mlp.down_proj": (HIDDEN, INTER),
        }
        for m, (o, n) in linear.items():
            out[f"{p}{m}.base_layer.weight"] = ((o, n), "base")
            out[f"{p}{m}.lora_A.default.weight"] = ((r, n), "adapter")
            out[f"{p}{m}.lora_B.default.weight"] = ((o, r), "adapter")
        out[f"{p}input_layernorm.weight"] = ((HIDDEN,), "base")
        out[f"{p}post_attention_layernorm.weight"] = ((HIDDEN,), "base")
    out[f"{PREFIX}model.norm.weight"] = ((HIDDEN,), "base")
    out[f"{PREFIX}lm_head.weight"] = ((VOCAB, HIDDEN), "base")
    return out


def tensor(name: str, layers: int, r: int, dtype: str) -> torch.Tensor:
    """The full tensor `name` as the checkpoint holds it (regenerated from its seed)."""
    for k, (n, (shape, kind)) in enumerate(shapes(layers, r).items()):
        if n == name:
            g = torch.Generator().manual_seed(1000 + k)
            full = torch.randn(shape, generator=g, dtype=torch.float32)
            if kind == "adapter":
                return 0.05 * full
            base_dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
            return (0.02 * full if len(shape) > 1 else 1 + 0.1 * full).to(base_dtype)
    raise KeyError(name)


def worker(rank: int, world: int, outdir: str, layers: int, r: int, dtype: str, port: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name in shapes(layers, r):
        full = tensor(name, layers, r, dtype)
        local = torch.chunk(full, world, dim=0)[rank].clone()
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                         shape=full.shape, stride=full.stride())
        del full
    dcp.save(state, checkpoint_id=outdir)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    from peft import LoraConfig

    args.outdir.mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(2, str(args.outdir), args.layers, args.r, args.dtype, args.port), nprocs=2)
    LoraConfig(r=args.r, lora_alpha=2 * args.r, target_modules=TARGETS, lora_dropout=0.0,
               task_type="CAUSAL_LM").save_pretrained(str(args.outdir))
    total = sum(f.stat().st_size for f in args.outdir.iterdir())
    print(f"{args.outdir}: {args.layers} layers, LoRA r={args.r} on {7 * args.layers} modules, "
          f"{args.dtype} base, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
