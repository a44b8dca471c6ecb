"""Run under torchrun (2 ranks, gloo, CPU) by test_hf_import_megatron_moe.py: megatron-core's own
load of what `ckpt reshard HF_DIR --format megatron --transformer-impl local` wrote of a
mixture-of-experts release, the loaded model's logits and one training iteration.

    torchrun --nproc_per_node=2 tests/interop/torchrun_megatron_moe_import_load.py \
        SPEC.json RESULT.pt

The model is the one fixtures/generate_megatron_moe.py builds (imported as a module, not copied:
its `build`, `transformer_config`, `shims`, `set_layout` and the latent-attention core-attention
workaround), i.e. the GPTModel whose saves ckpt's export is known to read: Megatron-LM's
`model_provider` for `--num-experts` with `--transformer-impl local` (megatron-core's attention or
multi-latent attention, torch's RMSNorm, `MoELayer` with a `TopKRouter` and `SequentialMLP`
experts, the allgather dispatcher, MTP layers where the case has them), here in fp32 (the
DeepSeek-V3 fixture's bf16 aside: the releases are fp32).

SPEC.json: {"case": a key of generate_megatron_moe.CASES, "padded_vocab", "input_ids": [[...]],
"labels": [[...]], "loads": [{"name", "dir", "layout": {"tp", "ep", "etp"}, "train": bool,
"expect_failure": bool}, ...]}. For each load (a save root ckpt wrote) the worker:

- sets megatron's model parallel groups for the layout and builds the model with the padded
  vocabulary, every parameter and persistent buffer (the routers' `expert_bias`) first filled
  with NaN, so that a tensor the load leaves alone shows;
- reads `latest_checkpointed_iteration.txt` as Megatron-LM does (`release` names `release/`) and
  calls `dist_checkpointing.load({"model": model.sharded_state_dict()}, DIR/release)` as
  Megatron-LM's load_checkpoint does (its default strictness: a key the model asks for and the
  checkpoint lacks raises), then `model.load_state_dict(loaded["model"])` (strict);
- reports the keys the model asked for (every rank's), the parameters and buffers left NaN, and
  the fp32 logits of the main head on INPUT_IDS gathered over TP (the MTP layers run, as
  megatron-core 0.16.1 needs labels with MTP, but do not change them);
- with "train": one training iteration as generate_megatron_moe.py's `train` runs them
  (megatron-core's DistributedDataParallel, `get_megatron_optimizer` Adam, OptimizerParamScheduler,
  `finalize_model_grads`, which also updates DeepSeek-V3's routing `expert_bias`) on
  megatron-core's own loss (`labels=`), both ranks on the whole batch: the loss before the step,
  whether the step was taken, the loss after, the parameters the step left unchanged (every
  rank's);
- with "expect_failure": the load is expected to raise; each rank's message is reported
  (megatron-core checks the keys against the checkpoint's metadata before it reads anything, and
  torch's CheckpointException carries every rank's error).

MoE training under TP > 1 needs sequence parallelism (`MoELayer.forward` raises without it), which
torch's norms refuse, so the training loads are at TP=1 (DP=2), as generate_megatron_moe.py trains.

Rank 0 writes RESULT.pt: {"loads": {name: {"tag", "common", "logits", "nan", "requested_keys",
"train": {"loss", "loss_after", "ok", "grad_norm", "unchanged", "params", "finite_params"},
"error", "errors_all_ranks"}}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))
import generate_megatron_moe as gm  # noqa: E402  (puts tests/interop on sys.path itself)
# the dense import's worker's
from torchrun_megatron_import_load import requested_keys, train_one_step  # noqa: E402


def build(c: dict, layout: dict, padded_vocab: int):
    gm.set_layout(layout)
    gm.PADDED_VOCAB = padded_vocab  # the generator's build reads its module global
    cfg, model = gm.build(c, layout, bf16=False)
    with torch.no_grad():
        for _, t in saved_tensors(model):
            t.fill_(float("nan"))
    return cfg, model


def saved_tensors(model) -> list:
    """The model's state: its parameters and persistent buffers (the routers' `expert_bias`),
    not the non-persistent ones it counts tokens in (`local_tokens_per_expert`)."""
    return [(n, t) for n, t in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(t) and t.is_floating_point()]


def nan_left(model) -> list:
    return sorted(n for n, t in saved_tensors(model) if torch.isnan(t).any())


def load(c: dict, entry: dict, padded_vocab: int):
    from megatron.core import dist_checkpointing

    root = Path(entry["dir"])
    tag = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    where = root / ("release" if tag == "release" else f"iter_{int(tag):07d}")
    cfg, model = build(c, entry["layout"], padded_vocab)
    # Megatron-LM's default strictness (see torchrun_megatron_import_load.py for why not
    # "raise_all" with megatron-core 0.16.1 on torch 2.15): the keys asked for are returned.
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(where))
    model.load_state_dict(loaded["model"])
    common = {k: v for k, v in loaded.items() if k != "model"}
    return cfg, model, tag, common


def main_logits(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The main head's fp32 logits [b, s, padded vocab], gathered over TP. Without MTP layers
    the model's own inference output (`runtime_gather_output`); with them megatron-core 0.16.1's
    GPTModel cannot run without labels (`_postprocess` clones them), so it runs with labels and
    the main head's output is taken as `output_layer` returns it (its last call, after the MTP
    heads': megatron's cross entropy then works on it in place, hence the copy), its vocabulary
    shards gathered over the TP group."""
    from megatron.core import parallel_state

    b, s = ids.shape
    pos = torch.arange(s)[None].expand(b, s)
    if model.config.mtp_num_layers is None:
        with torch.no_grad():
            return model(ids, pos, gm.causal(s), runtime_gather_output=True).float()
    seen = []
    hook = model.output_layer.register_forward_hook(
        lambda m, i, o: seen.append(o[0].detach().clone()))
    try:
        with torch.no_grad():
            model(ids, pos, gm.causal(s), labels=labels)
    finally:
        hook.remove()
    assert len(seen) == 1 + model.config.mtp_num_layers, len(seen)
    shard = seen[-1].transpose(0, 1).contiguous()  # [b, s, padded / TP]
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard, group=group)
    return torch.cat(parts, -1).float()


def gathered(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main() -> None:
    spec_path, result_path = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, "run with torchrun --nproc_per_node=2"
    gm.shims()
    c = gm.CASES[spec["case"]]
    ids = torch.tensor(spec["input_ids"])
    labels = torch.tensor(spec["labels"])
    result = {"loads": {}}
    for entry in spec["loads"]:
        torch.manual_seed(0)
        got = {"error": None, "train": None, "logits": None}
        if entry.get("expect_failure"):
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                load(c, entry, spec["padded_vocab"])
            # (torch's CheckpointException, which carries each rank's exception, is a
            # BaseException)
            except (Exception, CheckpointException) as e:  # noqa: BLE001  (the test reads it)
                got["error"] = f"{type(e).__name__}: {e}"
            errors = gathered(got["error"])
            got["error"] = errors[0]
            got["errors_all_ranks"] = errors
            result["loads"][entry["name"]] = got
            dist.barrier()
            continue
        cfg, model, tag, common = load(c, entry, spec["padded_vocab"])
        model.eval()
        got.update(tag=tag, common=common, logits=main_logits(model, ids, labels))
        parts = gathered((nan_left(model), requested_keys(model)))
        got["nan"] = sorted({n for part, _ in parts for n in part})
        got["requested_keys"] = sorted({k for _, part in parts for k in part})
        if entry.get("train"):
            t = train_one_step(cfg, model, ids, labels)
            ranks = gathered(t)
            t["unchanged"] = sorted({n for r in ranks for n in r["unchanged"]})
            t["params"] = sum(r["params"] for r in ranks)
            t["finite_params"] = all(r["finite_params"] for r in ranks)
            got["train"] = t
        result["loads"][entry["name"]] = got
        del model
    if dist.get_rank() == 0:
        torch.save(result, result_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
