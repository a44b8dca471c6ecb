"""Run under torchrun (gloo, CPU, tensor parallel over the ranks) by test_hf_import.py: megatron-core's
own load of what `ckpt reshard HF_DIR --format megatron` wrote, then the loaded model's logits and
one training step.

    torchrun --nproc_per_node=2 tests/interop/torchrun_megatron_import_load.py SPEC.json RESULT.pt

SPEC.json: {"model": {the GPTModel's dims, from the release's config.json: num_layers, hidden_size,
num_attention_heads, num_query_groups, kv_channels, ffn_hidden_size, eps, rope_theta, qkv_bias,
qk_norm, tied, max_positions}, "input_ids": [[...]], "labels": [[...]], "loads": [{"name", "dir",
"padded_vocab"}, ...]}. For each load (a save root ckpt wrote, with the padded vocabulary of
Megatron-LM's rule for the run's TP) the worker:

- builds megatron-core's `GPTModel` with the local layer spec (megatron-core's attention, RMSNorm,
  SwiGLU MLP; fp32) as Megatron-LM's `model_provider` does, with every parameter first filled with
  NaN, so a tensor the load leaves alone shows;
- reads `latest_checkpointed_iteration.txt` as Megatron-LM does (`release` names `release/`) and
  calls `dist_checkpointing.load({"model": model.sharded_state_dict()}, DIR/release)` as
  Megatron-LM's load_checkpoint does (the model nested under "model", its default strictness:
  a key the model asks for and the checkpoint lacks raises) and `model.load_state_dict(
  loaded["model"])` (strict); the keys the model asked for are reported (every rank's), for the
  test to check the checkpoint holds no other;
- computes the fp32 logits of INPUT_IDS (gathered over TP);
- for the first load only: one training iteration as megatron_gpt_save.py's train_and_save runs it
  (megatron-core's DistributedDataParallel, `get_megatron_optimizer` Adam, OptimizerParamScheduler,
  `finalize_model_grads`), on megatron-core's own loss (`GPTModel(..., labels=...)`, vocab-parallel
  cross entropy averaged over the tokens); the loss before the step, the step's success, the loss
  of a second forward after it and how many parameters changed are reported.

Rank 0 writes RESULT.pt: {"loads": {name: {"tag", "logits", "common": the loaded non-tensor
entries (common.pt's), "nan_params": parameters left NaN, "requested_keys"}}, "train": {"loss",
"loss_after", "ok", "grad_norm", "changed", "unchanged", "params", "finite_params"}}. Each rank
checks its own parameters and keys; the two ranks' are gathered.

megatron-core on a CPU-only torch needs the shims of megatron_gpt_save.py (imported from there; see
its docstring): torch.cuda.synchronize and current_device answered on the CPU, tensors asked for
on "cuda" made on the CPU for its optimizers, CPU tensors naming themselves `torch.cuda.*Tensor`,
and a CUDA RNG tracker `fork` that does nothing (no dropout here). None changes a loaded value.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_gpt_save  # noqa: E402  (its shims apply on import)


def build(m: dict, padded_vocab: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        kv_channels=m["kv_channels"], ffn_hidden_size=m["ffn_hidden_size"],
        use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=m["eps"], add_bias_linear=False, add_qkv_bias=m["qkv_bias"],
        qk_layernorm=m["qk_norm"], hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, bf16=False,
        tensor_model_parallel_size=dist.get_world_size(),
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m["qk_norm"])
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab,
        max_sequence_length=m["max_positions"], position_embedding_type="rope",
        rotary_base=int(m["rope_theta"]), share_embeddings_and_output_weights=m["tied"],
        parallel_output=True,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return cfg, model


def causal(n: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), 1)


def forward_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        return model(ids, positions, causal(ids.shape[1]), runtime_gather_output=True).float()


def load(m: dict, entry: dict):
    from megatron.core import dist_checkpointing

    root = Path(entry["dir"])
    tag = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    where = root / ("release" if tag == "release" else f"iter_{int(tag):07d}")
    cfg, model = build(m, entry["padded_vocab"])
    # Megatron-LM's default strictness (assume_ok_unexpected). `strict="raise_all"` would compare
    # the checkpoint's keys itself, but megatron-core 0.16.1 reads the checkpoint's
    # TensorProperties into `torch.empty(**properties.__dict__)` (strategies/torch.py
    # load_tensors_metadata), which fails on torch 2.15's new `strides` field whoever wrote the
    # checkpoint: the keys asked for are returned instead, for the test to compare with the DCP's.
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(where))
    model.load_state_dict(loaded["model"])
    common = {k: v for k, v in loaded.items() if k != "model"}
    nan = sorted(n for n, p in model.named_parameters() if torch.isnan(p).any())
    return cfg, model, tag, common, nan, requested_keys(model)


def requested_keys(model) -> list:
    """The DCP keys the model's sharded_state_dict() reads: each ShardedTensor's key (after its
    factories, e.g. the [gate; up] split of linear_fc1) and each ShardedObject's unique key."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    keys = set()
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            keys.add(v.key)
        elif isinstance(v, ShardedObject):
            keys.add(v.unique_key)
    return sorted(keys)


def train_one_step(cfg, model, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """One iteration as megatron_gpt_save.train_and_save runs them (Megatron-LM's train_step)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model.train()
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=False), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.01, bf16=False,
                        params_dtype=torch.float32, use_distributed_optimizer=False, clip_grad=1.0),
        [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=1e-3, max_lr=1e-3, min_lr=1e-5,
                                    lr_warmup_steps=0, lr_decay_steps=10, lr_decay_style="cosine",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=10,
                                    wd_incr_style="constant")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = causal(ids.shape[1])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(ids, positions, mask, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    ok, grad_norm, _ = opt.step()
    sched.step(increment=1)
    ddp.eval()
    with torch.no_grad():
        after = ddp(ids, positions, mask, labels=labels).float().mean()
    unchanged = sorted(n for n, p in model.named_parameters() if torch.equal(before[n], p))
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    return {
        "loss": loss.item(), "loss_after": after.item(), "ok": bool(ok),
        "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
        "changed": len(before) - len(unchanged), "unchanged": unchanged, "params": len(before),
        "finite_params": finite,
    }


def main() -> None:
    spec_path, result_path = sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    megatron_gpt_save.run_cuda_calls_on_cpu()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.initialize_model_parallel(dist.get_world_size(), 1)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(0)
    m = spec["model"]
    ids = torch.tensor(spec["input_ids"])
    labels = torch.tensor(spec["labels"])
    rank = dist.get_rank()
    result = {"loads": {}, "train": None}
    for i, entry in enumerate(spec["loads"]):
        cfg, model, tag, common, nan, keys = load(m, entry)
        model.eval()
        logits = forward_logits(model, ids)
        nans = [None] * dist.get_world_size()
        dist.all_gather_object(nans, (nan, keys))
        result["loads"][entry["name"]] = {
            "tag": tag, "common": common, "logits": logits,
            "nan_params": sorted({n for part, _ in nans for n in part}),
            "requested_keys": sorted({k for _, part in nans for k in part}),
        }
        if i == 0:
            result["train"] = train_one_step(cfg, model, ids, labels)
        del model
    if rank == 0:
        torch.save(result, result_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
