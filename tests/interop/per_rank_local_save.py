"""Run under torchrun (gloo, CPU, 4 ranks) by test_per_rank.py: FSDP1 LOCAL_STATE_DICT saved per
rank with torch.save, as `rank{R}.pt`, for both use_orig_params variants, beside what the model held.

    torchrun --nproc_per_node=4 tests/interop/per_rank_local_save.py OUTDIR

OUTDIR/orig_{True,False}/rank{R}.pt: one file per rank; OUTDIR/orig_{True,False}.ref.pt: torch.save
of the unwrapped model's state_dict() (the --shapes-from reference, and what ckpt must give back).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

dist.init_process_group("gloo")
out = Path(sys.argv[1])
for orig in (True, False):
    torch.manual_seed(21)
    # dims not divisible by 4 or by the 4-element alignment of use_orig_params, so padding shows
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 5))
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fsdp = FSDP(model, use_orig_params=orig, device_id=torch.device("cpu"))
    with FSDP.state_dict_type(fsdp, StateDictType.LOCAL_STATE_DICT):
        sd = fsdp.state_dict()
    path = out / f"orig_{orig}"
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / f"rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        torch.save(ref, out / f"orig_{orig}.ref.pt")
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
