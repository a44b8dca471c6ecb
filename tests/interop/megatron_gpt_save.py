"""Save a small megatron-core `GPTModel` (local layer spec, on CPU, 1 gloo process) as
`dist_checkpointing.save` writes its `sharded_state_dict()`, with the Hugging Face config.json of
the same model and the model's own logits on a fixed batch. test_hf_export.py runs it as

    python megatron_gpt_save.py STYLE OUTDIR
    torchrun --nproc_per_node=2 megatron_gpt_save.py STYLE OUTDIR    (tensor parallel over 2)

    torchrun --nproc_per_node=2 megatron_gpt_save.py STYLE OUTDIR OPTIMIZER

STYLE is `llama` (GQA, kv_channels 16 where hidden/heads is 8), `qwen2` (QKV bias, tied
embeddings, bf16 parameters) or `qwen3` (q/k layernorm); the vocabulary is padded from 100 to
128 rows as Megatron-LM pads it. OUTDIR gets `ckpt/` (the torch_dist directory),
`hf/config.json` and `logits.pt` ({"input_ids", "logits"}: fp32 logits of the saved weights).

With OPTIMIZER (`distributed` or `plain`) the model is trained as Megatron-LM trains it: wrapped
in megatron-core's DistributedDataParallel, two steps of Megatron's Adam
(`get_megatron_optimizer`, with the DistributedOptimizer or without) and its
OptimizerParamScheduler; then saved as Megatron-LM's `save_checkpoint` saves `torch_dist`:
`ckpt/latest_checkpointed_iteration.txt` naming `ckpt/iter_0000002/`, whose state dict holds
`args` (an argparse.Namespace), `checkpoint_version`, `iteration`, `model`, `optimizer` (the
DistributedOptimizer's per-bucket flat tensors, `dp_reshardable` as Megatron-LM's default, or
the plain optimizer's `optimizer.state.{exp_avg,exp_avg_sq}.<model key>` beside a
`common_step` tensor), `opt_param_scheduler`, `rng_state` and
`num_floating_point_operations_so_far`.

megatron-core needs CUDA for calls that only synchronise, pick a device or fork a CUDA random
state for dropout (none here): on a CPU-only torch they are replaced by no-ops. Its optimizers
also make a few buffers on "cuda" and check that parameters are `torch.cuda.*Tensor`s: when
training, those buffers are made on the CPU and CPU tensors answer `type()` with the CUDA
name of their dtype. No value the checkpoint holds depends on either.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
if not hasattr(np, "product"):
    np.product = np.prod
warnings.filterwarnings("ignore")

VOCAB = 100
PADDED_VOCAB = 128
STYLES = {
    "llama": dict(kv_channels=16, qkv_bias=False, qk_norm=False, tied=False, bf16=False),
    "qwen2": dict(kv_channels=8, qkv_bias=True, qk_norm=False, tied=True, bf16=True),
    "qwen3": dict(kv_channels=16, qkv_bias=False, qk_norm=True, tied=False, bf16=False),
}


def run_cuda_calls_on_cpu() -> None:
    """What megatron-core's optimizers ask of CUDA, answered on the CPU (see the module doc)."""
    import functools

    def on_cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            d = k.get("device")
            if d == "cuda" or (isinstance(d, torch.device) and d.type == "cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    cpu_type = torch.Tensor.type

    def cuda_type(self, *a, **k):
        t = cpu_type(self, *a, **k)
        return t.replace("torch.", "torch.cuda.", 1) if not a and not k and "cuda" not in t else t

    torch.Tensor.type = cuda_type


def train_and_save(cfg, model, s, optimizer: str, batch, out: Path) -> None:
    """Two steps of Megatron's Adam, then a save as Megatron-LM's `save_checkpoint` makes it."""
    import argparse

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = optimizer == "distributed"
    model.train()
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed,
                                           grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.01, bf16=s["bf16"],
                        params_dtype=torch.bfloat16 if s["bf16"] else torch.float32,
                        use_distributed_optimizer=distributed),
        [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5,
                                    lr_warmup_steps=1, lr_decay_steps=10, lr_decay_style="cosine",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=10,
                                    wd_incr_style="constant")
    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(*batch).float().pow(2).mean()
        loss.backward()
        # As Megatron-LM's train_step: the DP grad sync, and the all-reduce over TP of what
        # every TP rank holds whole (the q/k layernorms), which otherwise drift apart.
        finalize_model_grads([ddp])
        ok, _, _ = opt.step()
        assert ok, "Megatron's optimizer skipped a step"
        sched.step(increment=1)
    model.eval()
    args = argparse.Namespace(
        ckpt_format="torch_dist", tensor_model_parallel_size=dist.get_world_size(),
        pipeline_model_parallel_size=1, use_distributed_optimizer=distributed,
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, iteration=2,
        bf16=s["bf16"], padded_vocab_size=PADDED_VOCAB,
    )
    model_sd = model.sharded_state_dict()
    rank = dist.get_rank()
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 2,
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(
            model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable"}),
        "opt_param_scheduler": sched.state_dict(),
        "rng_state": [ShardedObject("rng_state", {"random_rng_state": torch.get_rng_state()},
                                    (1, dist.get_world_size()), (0, rank), replica_id=0)],
        "num_floating_point_operations_so_far": 1.0e9,
    }
    where = out / "ckpt" / "iter_0000002"
    if rank == 0:
        where.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(where))
    dist.barrier()
    if rank == 0:
        (out / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")


ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def main() -> None:
    style, out = sys.argv[1], Path(sys.argv[2])
    optimizer = sys.argv[3] if len(sys.argv) > 3 else None
    assert optimizer in (None, "distributed", "plain"), optimizer
    s = STYLES[style]
    if optimizer is not None:
        run_cuda_calls_on_cpu()
    if "WORLD_SIZE" not in os.environ:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]), RANK="0", WORLD_SIZE="1"
        )
        sock.close()
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, 1)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(0)
    bf16 = bool(s["bf16"] and optimizer)  # an untrained save keeps the fp32 it always had

    def gpt(bf16: bool):
        cfg = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            kv_channels=s["kv_channels"], ffn_hidden_size=48, use_cpu_initialization=True,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
            add_qkv_bias=s["qkv_bias"], qk_layernorm=s["qk_norm"], hidden_dropout=0.0,
            attention_dropout=0.0, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            bf16=bf16,
        )
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=s["qk_norm"])
        model = GPTModel(
            config=cfg, transformer_layer_spec=spec, vocab_size=PADDED_VOCAB,
            max_sequence_length=64, position_embedding_type="rope", rotary_base=10000,
            share_embeddings_and_output_weights=s["tied"], parallel_output=False,
        ).eval()
        return cfg, model

    cfg, model = gpt(bf16)
    # The same values on every rank for what is replicated (norms), each rank's own for its
    # slice of a split tensor (the QKV bias).
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layer_norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2 + rank)))
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 40, 41], [3, 3, 8, 60, 95, 0, 11, 12]])
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
    if optimizer is None:
        if rank == 0:
            (out / "ckpt").mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(out / "ckpt"))
    else:
        train_and_save(cfg, model, s, optimizer, (ids, positions, mask), out)
    # The saved weights' own forward in fp32 (what from_pretrained in fp32 computes): a bf16
    # model's weights in an fp32 GPTModel.
    if bf16:
        weights = {k: v.float() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        _, model = gpt(False)
        model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(ids, positions, mask)[..., :VOCAB]
    if rank != 0:
        dist.destroy_process_group()
        return
    torch.save({"input_ids": ids, "logits": logits}, out / "logits.pt")
    config = {
        "architectures": [ARCHS[style]],
        "model_type": style,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": s["kv_channels"],
        "num_hidden_layers": 2,
        "intermediate_size": 48,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "tie_word_embeddings": s["tied"],
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": "bfloat16" if bf16 else "float32",
    }
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
