"""A DeepSpeed engine at M ranks resumes two checkpoints and tells what it holds (for
test_deepspeed_reshard.py; run with torchrun on CPU, gloo).

    torchrun --nproc_per_node=M torchrun_deepspeed_reshard.py CASE SOURCE UNIVERSAL REF OURS OUT

1. DeepSpeed's own route, the reference: an engine at M loads UNIVERSAL (`ds_to_universal` of
   SOURCE) with `checkpoint.load_universal`, has what that route loses on 0.19.8 repaired from
   SOURCE's model states (buffers, frozen parameters; under ZeRO-3 also the param groups'
   settings and Adam's `step` per group), and `save_checkpoint`s REF.
2. A fresh engine loads REF with a plain `engine.load_checkpoint`, and another loads OURS (ckpt's
   `reshard --format deepspeed` of SOURCE); each records its fp32 master partitions (with a
   mask of their real elements: ZeRO-3's padding is left uninitialised) and Adam's state as
   loaded, then takes one more training step and records its losses, the loss scaler and the
   counters.

Rank 0 writes OUT: torch.save of {"ref": [per-rank dict], "ours": [per-rank dict]}. With
UNIVERSAL `-` step 1 is skipped and there is no "ref".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's CPU backend loads its shared-memory op through torch's extension loader, which
# wants the venv's ninja on PATH even when the op is already built.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))
from generate_deepspeed import TAG, engine_parts  # noqa: E402


def engine_for(case: str, universal: bool):
    stage = int(case[4])
    dtype = case.split("_")[1]  # zero3_bf16_r4: a case saved on 4 ranks
    model, optim, config, _ = engine_parts(stage, dtype)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    return engine


def stage3(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def repair(engine, source: Path) -> None:
    """Put back what DeepSpeed's universal load leaves out: buffers and frozen parameters, as
    the source saved them; under ZeRO-3 also each param group's settings (its universal load
    gives every group group 0's) and a `step` of each group's own (it gives every group's Adam
    state one shared `step` tensor, stage3.py `_load_universal_checkpoint`, which each group's
    step then advances: after one more step, the second group's Adam counts 4, not 3)."""
    if not stage3(engine):
        saved = torch.load(source / TAG / "mp_rank_00_model_states.pt", weights_only=False)
        module = saved["module"]
        with torch.no_grad():
            for name, buf in engine.module.named_buffers():
                buf.copy_(module[name])
            for name, p in engine.module.named_parameters():
                if not p.requires_grad:
                    p.copy_(module[name])
        return
    ranks = sorted(source.joinpath(TAG).glob("zero_pp_rank_*_mp_rank_00_model_states.pt"),
                   key=lambda f: int(f.name.split("_")[3]))
    saved = [torch.load(f, weights_only=False) for f in ranks]
    rank = dist.get_rank()
    with torch.no_grad():
        for name, buf in engine.module.named_buffers():
            buf.copy_(saved[0]["module"][name])
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                continue
            # The whole parameter from the source's pieces, this rank's piece of it.
            numel = saved[0]["frozen_param_shapes"][name].numel()
            full = torch.cat([s["frozen_param_fragments"][name] for s in saved])[:numel]
            size = p.ds_tensor.ds_numel
            mine = full[rank * size:(rank + 1) * size]
            p.ds_tensor.data[:mine.numel()].copy_(mine)
    optim = sorted(source.joinpath(TAG).glob("*optim_states.pt"))[0]
    groups = torch.load(optim, weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
    base = engine.optimizer.optimizer
    for group, want in zip(base.param_groups, groups["param_groups"]):
        group.update({k: v for k, v in want.items() if k != "params"})
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        if "step" in base.state[flat]:
            base.state[flat]["step"] = base.state[flat]["step"].clone()


def fp32_groups(engine) -> tuple[list, list]:
    """The engine's fp32 master partitions and, per partition, which elements are parameters
    (the rest is padding, which DeepSpeed leaves uninitialised under ZeRO-3)."""
    opt = engine.optimizer
    if not stage3(engine):
        groups = opt.single_partition_of_fp32_groups
        return groups, [torch.ones(t.numel(), dtype=torch.bool) for t in groups]
    rank = dist.get_rank()
    masks = []
    for sub_group in opt.fp16_groups:
        parts = []
        for p in sub_group:
            size = p.partition_numel()
            parts.append(torch.arange(rank * size, (rank + 1) * size) < p.ds_numel)
        masks.append(torch.cat(parts))
    return opt.fp32_partitioned_groups_flat, masks


def held(engine) -> dict:
    opt = engine.optimizer
    base = opt.optimizer
    groups, real = fp32_groups(engine)
    state = []
    if stage3(engine):
        # ZeRO-3 keys the base optimizer's state by the flat fp32 partitions themselves.
        for t in groups:
            state.append({k: v.detach().clone() for k, v in base.state[t].items()})
    else:
        for group in base.param_groups:
            s = base.state[group["params"][0]]
            state.append({k: v.detach().clone() for k, v in s.items()})
    fp32 = [t.detach().clone() for t in groups]
    scaler = getattr(opt, "loss_scaler", None)
    frozen_params = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    if stage3(engine):
        # A collective: every rank gathers the same parameters in the same order.
        with deepspeed.zero.GatheredParameters([p for _, p in frozen_params]):
            frozen = {n: p.detach().clone() for n, p in frozen_params}
    else:
        frozen = {n: p.detach().clone() for n, p in frozen_params}
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randint(0, 7, (4,))
    before = engine(x)
    engine.backward(before)
    engine.step()
    after = engine(x)
    return {
        "fp32": fp32,
        "real": real,
        "state": state,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
        "scaler": {k: v for k, v in vars(scaler).items()} if scaler is not None else None,
        "counters": [engine.global_steps, engine.global_samples, engine.skipped_steps],
        "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
        "frozen": frozen,
        "loss": [float(before.detach()), float(after.detach())],
    }


def main() -> None:
    case, source, universal, ref, ours, out = sys.argv[1:7]
    deepspeed.init_distributed(dist_backend="gloo")
    get_accelerator().is_fp16_supported = lambda: True
    resumes = [("ours", ours)]
    # Every engine is kept to the end: a rank aborted in C++ ("terminate called without an
    # active exception", SIGABRT) about 300 ms after the universal load in 2 of about 60 runs,
    # when the next engine was built and the last one dropped.
    engines = []
    # UNIVERSAL `-`: no reference (DeepSpeed's route fails at this size).
    if universal != "-":
        engine = engine_for(case, universal=True)
        engines.append(engine)
        engine.load_checkpoint(universal, tag=f"{TAG}_universal")
        repair(engine, Path(source))
        engine.save_checkpoint(ref, tag=TAG)
        dist.barrier()
        resumes.insert(0, ("ref", ref))
    results = {}
    for name, path in resumes:
        engine = engine_for(case, universal=False)
        engines.append(engine)
        loaded, _ = engine.load_checkpoint(path)
        assert loaded is not None, f"DeepSpeed loaded nothing from {path}"
        mine = held(engine)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    # Everything is written: end without the C++ teardown of the engines and gloo's threads,
    # where a rank can abort in the same way after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
