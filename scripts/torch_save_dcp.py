#!/usr/bin/env python3
"""Write a SHARDED DCP checkpoint with PyTorch itself, for benchmarking ckpt on torch's own files.

    torchrun --standalone --nproc_per_node=N scripts/torch_save_dcp.py FULL.safetensors OUT_DIR

Every rank reads only its Shard(0) slice of each tensor of FULL.safetensors (DTensor's chunking:
ceil(dim0 / N) rows per rank, trailing ranks possibly empty), wraps it as a DTensor on a 1-D mesh
of N ranks (gloo, CPU) and the ranks call `torch.distributed.checkpoint.save` together, as an FSDP2
job saving its model does. Run with the venv's torchrun.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__)
    full_path, out_dir = argv
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    with safe_open(full_path, framework="pt") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            shape = sl.get_shape()
            if not shape:
                state[name] = f.get_tensor(name)
                continue
            rows = -(-shape[0] // world)
            start = min(rank * rows, shape[0])
            stop = min(start + rows, shape[0])
            local = sl[start:stop]
            full = torch.Size(shape)
            state[name] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=full, stride=_contiguous_stride(full)
            )
    dcp.save(state, checkpoint_id=out_dir)
    dist.barrier()
    # gloo's threads can abort interpreter teardown after the work is done and checked
    sys.stdout.flush()
    os._exit(0)


def _contiguous_stride(shape):
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


if __name__ == "__main__":
    main(sys.argv[1:])
