"""Resume an FSDP2 model and its AdamW from a DCP checkpoint, as a training job moving to FSDP2
would: build the model from a spec, `fully_shard` it, `get_state_dict` (flattened optimizer
state), `dcp.load`, `set_state_dict`, then save what the model and optimizer now hold, gathered.

    torchrun --nproc_per_node=N torchrun_fsdp2_resume.py DCP_DIR SPEC.json OUT.pt

SPEC.json: {"params": [[fqn, shape, group or null when frozen], ...], "buffers": [[fqn, shape,
dtype], ...], "tied": [[alias, owner], ...], "groups": N}. The model has exactly those
parameters (zeros), buffers and tied aliases; AdamW gets one param group per DeepSpeed group, with
settings that differ from the checkpoint's, so the load must set them. OUT.pt: {"model": {fqn:
tensor}, "optim": {flat key: tensor or value}}, every DTensor gathered with `full_tensor()`.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def submodule(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module that holds `fqn`'s last part, made on the way as needed."""
    *path, leaf = fqn.split(".")
    m = root
    for part in path:
        if not hasattr(m, part):
            m.add_module(part, nn.Module())
        m = getattr(m, part)
    return m, leaf


def build(spec: dict) -> nn.Module:
    root = nn.Module()
    by_name: dict[str, nn.Parameter] = {}
    for fqn, shape, group in spec["params"]:
        p = nn.Parameter(torch.zeros(shape), requires_grad=group is not None)
        m, leaf = submodule(root, fqn)
        m.register_parameter(leaf, p)
        by_name[fqn] = p
    for alias, owner in spec["tied"]:
        m, leaf = submodule(root, alias)
        m.register_parameter(leaf, by_name[owner])
    for fqn, shape, dtype in spec["buffers"]:
        m, leaf = submodule(root, fqn)
        m.register_buffer(leaf, torch.zeros(shape, dtype=getattr(torch, dtype)))
    return root


def gathered(sd: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}


def main() -> None:
    ckpt, spec_path, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    spec = json.load(open(spec_path))
    model = build(spec)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    # After fully_shard, which puts sharded parameters in the modules' places.
    params = dict(model.named_parameters())
    groups: list[list[nn.Parameter]] = [[] for _ in range(spec["groups"])]
    for fqn, _, group in spec["params"]:
        if group is not None:
            groups[group].append(params[fqn])
    optim = torch.optim.AdamW(
        [{"params": g, "lr": 123.0, "weight_decay": 0.5} for g in groups if g], lr=123.0
    )
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    msd, osd = get_state_dict(model, optim, options=options)
    held = {"model": gathered(msd), "optim": gathered(osd)}
    if dist.get_rank() == 0:
        torch.save(held, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # All work is done and saved. gloo's background threads can abort the interpreter's own
    # teardown ("terminate called without an active exception"), failing a finished run, so leave
    # without it (as torchrun_load.py does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
