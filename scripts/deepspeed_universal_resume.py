"""The second half of DeepSpeed's own route to another data-parallel size, for scripts/bench-deepspeed
--reshard-to M: an engine at M ranks loads a universal checkpoint and saves it as a ZeRO-3
checkpoint at M. Run with torchrun on CPU (gloo):

    DS_ACCELERATOR=cpu torchrun --nproc_per_node=M scripts/deepspeed_universal_resume.py \
        SOURCE UNIVERSAL OUT --gb G [--layers N]

SOURCE is the checkpoint scripts/deepspeed_bench_input.py wrote (its rank 0 files give the buffer
and the param groups' settings), UNIVERSAL the `ds_to_universal` of its tag, OUT where the engine's
`save_checkpoint` goes (tag global_step100). The model is built under `deepspeed.zero.Init` with
the generator's shapes for --gb/--layers, so each rank allocates only its partition; the optimizer
is AdamW with the generator's two groups (matrices with weight decay, norms without), bf16, as the
input was saved. What the universal load leaves out on DeepSpeed 0.19.8 is put back as
tests/interop/torchrun_deepspeed_reshard.py does: the buffer (as saved, fp32), each group's
settings, a `step` per group.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's CPU backend loads its shared-memory op through torch's extension loader, which
# wants the venv's ninja on PATH even when the op is already built.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepspeed_bench_input import TAG, shapes  # noqa: E402


class Leaf(nn.Module):
    """One module's own parameters and buffers: zero.Init partitions a module's parameters when its
    own __init__ returns (not recursively), so each holder is built with all of its parameters."""

    def __init__(self, params: dict, buffers: dict):
        super().__init__()
        for name, shape in params.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))
        for name, shape in buffers.items():
            self.register_buffer(name, torch.zeros(shape))


def build(params: "OrderedDict[str, torch.Size]", buffers: "OrderedDict[str, torch.Size]") -> nn.Module:
    """A module tree whose parameter names and order are the checkpoint's."""
    owners: "OrderedDict[str, tuple[dict, dict]]" = OrderedDict()
    for kind, table in ((0, params), (1, buffers)):
        for name, shape in table.items():
            parent, _, leaf = name.rpartition(".")
            owners.setdefault(parent, ({}, {}))[kind][leaf] = shape
    root = nn.Module()
    for path, (ps, bs) in owners.items():
        mod = root
        parts = path.split(".")
        for part in parts[:-1]:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.add_module(parts[-1], Leaf(ps, bs))
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("universal", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--gb", type=float, required=True)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    params = shapes(args.gb, args.layers)
    buffers = OrderedDict([("model.rotary_emb.inv_freq", torch.Size([64]))])
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True},
        "checkpoint": {"load_universal": True},
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build(params, buffers)
    named = dict(model.named_parameters())
    assert list(named) == list(params), "the model's parameters are not the checkpoint's"
    optim = torch.optim.AdamW(
        [{"params": [named[n] for n, s in params.items() if len(s) > 1], "weight_decay": 0.1},
         {"params": [named[n] for n, s in params.items() if len(s) <= 1], "weight_decay": 0.0}],
        lr=1e-4,
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    engine.load_checkpoint(str(args.universal), tag=f"{TAG}_universal")
    # What the universal load leaves out (tests/interop/torchrun_deepspeed_reshard.py, `repair`).
    src = args.source / TAG
    saved = torch.load(src / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False, mmap=True)
    # zero.Init cast the buffer to bf16; the source's is fp32 (as an engine that partitions a
    # module built outside zero.Init keeps it), so it is put back as saved, dtype included.
    for name, _ in list(engine.module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        engine.module.get_submodule(owner).register_buffer(leaf, saved["module"][name].clone())
    optim_file = src / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    groups = torch.load(optim_file, weights_only=False, mmap=True)["optimizer_state_dict"]["optimizer_state_dict"]
    base = engine.optimizer.optimizer
    for group, want in zip(base.param_groups, groups["param_groups"]):
        group.update({k: v for k, v in want.items() if k != "params"})
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        if "step" in base.state[flat]:
            base.state[flat]["step"] = base.state[flat]["step"].clone()
    engine.save_checkpoint(str(args.out), tag=TAG)
    dist.barrier()
    # Left to interpreter exit, gloo's threads are torn down in no set order.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
