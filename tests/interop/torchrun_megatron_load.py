"""Run under torchrun (gloo, CPU) by test_megatron.py: megatron-core's own `dist_checkpointing.load`
of a checkpoint ckpt wrote.

    torchrun --nproc_per_node=2 tests/interop/torchrun_megatron_load.py CKPT EXPECTED.pt MODE RESULT.json

CKPT is ckpt's DCP output with the source's `metadata.json` and `common.pt` copied beside it (what
makes a directory a Megatron checkpoint). MODE `tp` requests each tensor as the TP=2 model of
fixtures/generate_megatron.py does (dim-0 and dim-1 splits, the layer-stacked weight per layer),
MODE `full` every tensor whole on every rank. Each loaded tensor must be bitwise equal to its part
of EXPECTED.pt. Rank 0 writes RESULT.json: {"errors": [...]} (empty when everything matched).
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fixtures"))
import generate_megatron as gen  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def main() -> None:
    ckpt, expected_path, mode, result = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    errors = []
    try:
        expected = torch.load(expected_path, weights_only=True)
        full = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
        if mode == "tp":
            request = gen.sharded_state_dict({k: torch.zeros_like(v) for k, v in full.items()}, rank)
            want = gen.sharded_state_dict(full, rank)
        else:
            request = gen.request_full({k: torch.zeros_like(v) for k, v in full.items()}, rank)
            want = gen.request_full(full, rank)
            for k, v in want.items():
                v.data = full[k]
        request = {k: v for k, v in request.items() if isinstance(v, (ShardedTensor, list))}
        loaded = dist_checkpointing.load(request, ckpt)
        for k, w in want.items():
            if isinstance(w, ShardedTensor):
                pairs = [(w, loaded[k])]
            elif isinstance(w, list):
                pairs = list(zip(w, loaded[k]))
            else:
                continue
            for sh, got in pairs:
                if not same(got, sh.data):
                    errors.append(f"rank {rank}: {sh.key} at {sh.global_offset} differs")
    except Exception:
        errors.append(f"rank {rank}: {traceback.format_exc()}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        Path(result).write_text(json.dumps({"errors": [e for part in gathered for e in part]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
