"""Run under torchrun (gloo, CPU) by test_reshard.py: real DTensor + DCP against ckpt's output.

    torchrun --nproc_per_node=W tests/interop/torchrun_load.py JOB.json RESULT.json

JOB.json:
    {"loads": [{"id", "ckpt": DCP dir written by ckpt, "expected": expected/<name>.pt}],
     "saves": [{"id", "expected": expected/<name>.pt, "out": dir, "mesh": [a, b], "placements": ["S(0)", "R"]}]}

- load: a flat state dict with one `Shard(0)` DTensor over a W-rank mesh per tensor of expected
  (0-dim tensors as plain tensors), filled with a sentinel, plus every non-tensor key (sentinel
  value; DCP loads BytesStorageMetadata into it); `dcp.load(sd, checkpoint_id=ckpt)`; then every
  `full_tensor()` must be bitwise equal to expected and every non-tensor value equal.
- save: what real DTensor writes: every tensor of expected distributed on the given mesh with the
  given placements (a `S(d)` naming a dim the tensor lacks replicates, as ckpt documents; 0-dim
  tensors stay plain), non-tensors as they are, `dcp.save`d to `out` so the test can compare
  `.metadata` chunks with ckpt's.

Rank 0 writes RESULT.json: {"world_size": W, "loads": {id: [error, ...]}, "saves": {id: [error, ...]}}
(an empty list means the item passed). One item's failure never stops the others.
"""

from __future__ import annotations

import datetime
import json
import re
import os
import sys
import time
import traceback

STARTED = time.monotonic()

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# dtypes gloo cannot all_gather ("Invalid scalar type"): full_tensor() is impossible for them on
# CPU, so their full tensor is assembled from every rank's local shard with all_gather_object.
GLOO_GATHERS = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                torch.int8, torch.uint8, torch.bool}

SENTINEL = "<not loaded by dcp.load>"


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape and dtype whose bytes are 0xA5 (ones for bool), so an element DCP
    never wrote cannot pass for a loaded one (expected tensors include all-zero ones)."""
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=torch.bool)
    n = t.numel() * t.element_size()
    return torch.full((n,), 0xA5, dtype=torch.uint8).view(t.dtype).reshape(t.shape).clone()


def distribute(t: torch.Tensor, mesh, placements: list) -> DTensor:
    """distribute_tensor without communication (src_data_rank=None). float4_e2m1fn_x2 goes as
    bytes of the same shape, viewed back: torch zero-fills an empty shard, and has no fill for it."""
    if t.dtype != torch.float4_e2m1fn_x2:
        return distribute_tensor(t, mesh, placements, src_data_rank=None)
    d = distribute_tensor(t.view(torch.uint8), mesh, placements, src_data_rank=None)
    return DTensor.from_local(d.to_local().view(t.dtype), mesh, placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def parse_placement(s: str):
    s = s.strip()
    if s == "R":
        return Replicate()
    m = re.fullmatch(r"S\((\d+)\)", s)
    if not m:
        raise ValueError(f"bad placement {s!r}")
    return Shard(int(m.group(1)))


def placements_for(t: torch.Tensor, placements: list) -> list:
    return [Replicate() if isinstance(p, Shard) and p.dim >= t.dim() else p for p in placements]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def full_of(t) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    if t.dtype in GLOO_GATHERS:
        return t.full_tensor()
    # Shard(0) over a 1-D mesh only (what load items build). Tensors of these dtypes do not even
    # pickle through all_gather_object, so their bytes travel instead.
    local = t.to_local().contiguous()
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (tuple(local.shape), local.reshape(-1).view(torch.uint8).numpy().tobytes()))
    parts = [torch.frombuffer(bytearray(b), dtype=torch.uint8).view(t.dtype).reshape(shape) if b
             else torch.empty(shape, dtype=t.dtype) for shape, b in pieces]
    return torch.cat(parts, dim=0)


_EXPECTED: dict = {}


def expected(path: str) -> dict:
    if path not in _EXPECTED:
        _EXPECTED[path] = torch.load(path, weights_only=True)
    return _EXPECTED[path]


def run_load(item: dict, mesh) -> list:
    want = expected(item["expected"])
    sd = {}
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            blank = sentinel_like(v)
            sd[k] = blank if v.dim() == 0 else distribute(blank, mesh, [Shard(0)])
        else:
            sd[k] = SENTINEL
    dcp.load(sd, checkpoint_id=item["ckpt"])
    errors = []
    for k, w in want.items():
        g = sd.get(k)
        if isinstance(w, torch.Tensor):
            full = full_of(g)
            if not isinstance(full, torch.Tensor) or not bitwise_equal(full, w):
                errors.append(f"{k}: loaded {getattr(full, 'dtype', type(full))} {tuple(getattr(full, 'shape', ()))} "
                              f"differs from expected {w.dtype} {tuple(w.shape)}")
        elif isinstance(g, torch.Tensor) or g != w:
            errors.append(f"{k}: loaded {g!r}, expected {w!r}")
    return errors


_MESHES: dict = {}


def mesh_of(shape: tuple):
    # one DeviceMesh (and its process groups) per shape, created in the same order on every rank
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def run_save(item: dict) -> list:
    want = expected(item["expected"])
    mesh = mesh_of(tuple(item["mesh"]))
    placements = [parse_placement(p) for p in item["placements"]]
    sd = {}
    for k, v in want.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            sd[k] = distribute(v, mesh, placements_for(v, placements))
        else:
            sd[k] = v
    dcp.save(sd, checkpoint_id=item["out"])
    return []


def guarded(fn, *args) -> list:
    try:
        return fn(*args)
    except (Exception, BaseException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return [f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"]


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    mesh = mesh_of((world,))
    result = {"world_size": world, "loads": {}, "saves": {}, "seconds": {"startup": time.monotonic() - STARTED}}
    t0 = time.monotonic()
    for item in job.get("loads", []):
        errs = guarded(run_load, item, mesh)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, errs)
        result["loads"][item["id"]] = [f"rank {r}: {e}" for r, es in enumerate(per_rank) for e in es]
    result["seconds"]["loads"] = time.monotonic() - t0
    t0 = time.monotonic()
    for item in job.get("saves", []):
        errs = guarded(run_save, item)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, errs)
        result["saves"][item["id"]] = [f"rank {r}: {e}" for r, es in enumerate(per_rank) for e in es]
    result["seconds"]["saves"] = time.monotonic() - t0
    if dist.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # All work is done and checked. gloo's background threads can abort the interpreter's own
    # teardown ("terminate called without an active exception"), failing a finished run, so leave
    # without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
