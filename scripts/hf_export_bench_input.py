#!/usr/bin/env python3
"""Inputs and torch references for `scripts/bench-hf-export` (the `--hf-config` export and
`--quantize fp8-block`), written with torch directly for models too large to train here.

    .venv/bin/python scripts/hf_export_bench_input.py COMMAND ...

Inputs (each writes OUTDIR/ckpt or OUTDIR/model, and OUTDIR/hf: config.json, generation_config.json):
  tt-input OUTDIR [--layers 9]   a torchtitan 0.3 Llama3 (dim 2048, 16 heads, 8 KV heads, FFN
        5632, vocab 32000, untied; 9 layers: 2.22 GB of fp32), its names and shapes from
        torchtitan's own `Llama3Model.Config(...).build()` on the meta device, seeded random values,
        saved by `dcp.save` over 2 gloo processes, each holding a `Shard(0)` DTensor of every
        tensor as `fully_shard` leaves them, with the model's keys at the top level as torchtitan's
        CheckpointManager saves a model-only checkpoint (`last_save_model_only`).
  mg-input OUTDIR [--layers 21]  a megatron-core `GPTModel` (local layer spec, bf16, the same dims;
        21 layers: 2.24 GB) at tensor parallel 2, seeded random values, saved by
        `dist_checkpointing.save` of its `sharded_state_dict()` under torchrun (gloo) as Megatron-LM
        saves `torch_dist`.
  hf-input OUTDIR [--layers 20]  a Hugging Face Llama directory in bf16 (the same dims; 20 layers:
        2.15 GB in one model.safetensors, as `save_pretrained` writes it below 5 GB).
  moe-input OUTDIR [--layers 6]  a megatron-core mixture-of-experts `GPTModel` in the style of
        Qwen3-MoE (a Qwen3-30B-A3B layer with 32 experts where it has 128: hidden 2048, 32 heads of
        128, 4 KV heads, q/k RMSNorm, every layer MoE with 32 experts of FFN 768, top 8, vocab
        32000, untied; 6 layers: 2.30 GB of bf16) as Megatron-LM's model_provider builds it for
        --num-experts with --transformer-impl local (`get_gpt_decoder_block_spec`, SequentialMLP
        experts, made bf16 as Float16Module does), at EP=2 (TP 1, DP 2: rank r holds experts
        16r..16r+15 of every layer), seeded random values (by the parameter's name with its global
        expert number), saved by megatron-core's own `dist_checkpointing.save` of its
        `sharded_state_dict()` under torchrun (gloo), fully parallel over the data-parallel group
        as Megatron-LM saves torch_dist by default. OUTDIR/hf: the Qwen3MoeForCausalLM config.
  import-input OUTDIR [--layers 6]  a Hugging Face Qwen3-MoE release of the same model (OUTDIR/model,
        2.30 GB): transformers' `from_config` (seed 0, its own init; the norms, which it makes
        ones, drawn around 1) in bf16, `save_pretrained(max_shard_size="1GB")`: 3 files + index.

References (each writes a Hugging Face directory OUT):
  tt-convert IN OUT --hf HF   torchtitan's scripts/checkpoint_conversion/convert_to_hf.py (not in
        the wheel) for the installed torchtitan: build the model on the CPU, `dcp.load` its state
        dict, `Llama3StateDictAdapter.to_hf`, `dcp.save` with `HuggingFaceStorageWriter(path,
        save_distributed=True, fqn_to_index_mapping=adapter.fqn_to_index_mapping,
        enable_consolidation=True, thread_count_consolidation=5)`, export dtype float32 (its default).
  tt-full IN OUT --hf HF      the whole-model converter slime and veRL use: DCP's full load
        (`_load_state_dict` with `_EmptyStateDictLoadPlanner`, as `dcp_to_torch_save`), rename to
        transformers' names by a table, Q/K rows permuted as HF's conversion does, `save_file`.
  mg-full IN OUT --hf HF      the same for Megatron torch_dist: the full load merges the TP shards
        into global tensors; each layer's slice of the stacked weights renamed, the fused QKV split
        per query group, `linear_fc1` into gate and up, `save_file`.
  moe-full IN OUT --hf HF     the same for the Megatron MoE: the full load merges the EP shards
        into [layer, expert, ...] tensors; each layer's and each expert's slice renamed, QKV split
        per query group, each expert's `linear_fc1` into gate and up, `save_file`.
  fp8-ref IN OUT              prime-rl's streaming blockwise FP8 rule, tensor by tensor: load one
        tensor, for a linear weight of attention or MLP: per 128x128 tile scale = amax / 448 (an
        all-zero tile 1.0), `(x / scale).clamp(-448, 448).to(float8_e4m3fn)`, `<name>_scale_inv`
        = scale in F32; other tensors as they are; output saved by `save_file` in files of about 1 GB
        (one is saved as soon as it reaches 1 GB; + index), so memory holds about one such file.

Importers (each writes a trainer's checkpoint OUT from a Hugging Face release IN, loaded whole
with safetensors' `load_file`):
  import-ref IN OUT --format megatron    to megatron-core's names as its local spec's GPTModel
        `sharded_state_dict()` asks for them (layer-stacked `decoder.layers.*`, QKV rows [q of the
        group's heads; k; v] per query group, experts stacked [layer, expert, ...] with
        `linear_fc1` [gate; up], the norms under the linears they precede, the vocabulary padded by
        Megatron-LM's rule, the linears' `_extra_state` objects), `dcp.save` into OUT/release with
        megatron-core's common.pt, metadata.json and OUT/latest_checkpointed_iteration.txt
        (tests/interop/test_hf_export_bench_input.py checks these names, shapes and objects
        against megatron-core's own save of moe-input's model).
  import-ref IN OUT --format torchtitan  torchtitan 0.3's own `Qwen3StateDictAdapter.from_hf` (its
        offline path: the experts stacked [E, ...]), plus what the model's state dict holds that the
        release has no place for (`moe.expert_bias_E`, zeros as the model starts it), `dcp.save`.
        (torchtitan's convert_from_hf.py loads into the model built in F32, and so writes F32.)

With HF_BENCH_SMALL=1 in the environment every command uses a model of a few MB instead (hidden
256, FFN 320, vocab 1000; the MoE: 8 heads of 64, 4 experts of FFN 160, top 2), for
tests/interop/test_hf_export_bench_input.py.

Checks:
  compare A B [--names N]     tensors of the two HF directories bit for bit (all of them, or N
        spread over the model); exit 1 if any differs.
  compare-dcp A B [--layout]  two DCP checkpoints or Megatron save roots through torch's DCP reader,
        whatever their sharding: the same entries, every tensor bit for bit, every byte item equal
        once deserialised, the save roots' tracker, common.pt and metadata.json; with --layout
        only the entries, each tensor's dtype and global shape, and the byte items.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2048, 16, 8, 128, 5632, 32000
# The mixture of experts (moe, import): a Qwen3-30B-A3B layer (hidden 2048, 32 heads of 128, 4 KV
# heads, experts of FFN 768, top 8) with 32 experts where it has 128
MOE_DIM, MOE_HEADS, MOE_KV_HEADS, MOE_FFN, EXPERTS, TOPK = 2048, 32, 4, 768, 32, 8
if os.environ.get("HF_BENCH_SMALL"):
    # tests/interop/test_hf_export_bench_input.py: the same code on a model of a few MB, an FFN
    # that is not a multiple of 128 (partial FP8 tiles), a vocabulary Megatron pads (1000 -> 1024)
    DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 4, 2, 64, 320, 1000
    MOE_DIM, MOE_HEADS, MOE_KV_HEADS, MOE_FFN, EXPERTS, TOPK = 256, 8, 2, 160, 4, 2
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_hf_config(hf: Path, layers: int, dtype: str, rope: dict) -> None:
    from transformers import GenerationConfig, LlamaConfig

    hf.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters=rope, bos_token_id=1, eos_token_id=2, dtype=dtype,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(hf)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(hf)


# ---------------------------------------------------------------------------------------------
# torchtitan


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def tt_config(layers: int):
    """torchtitan's Llama3Model.Config for the bench's dims, built as its model registry builds one."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init,
    )
    from torchtitan.models.llama3.model import Llama3Model

    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
            rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=8192, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )


def tt_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = tt_config(layers).build()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def tt_worker(rank: int, world: int, outdir: str, layers: int, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for k, (name, shape) in enumerate(tt_shapes(layers).items()):
        # this rank's rows of Shard(0), as torch.chunk cuts them
        rows = -(-shape[0] // world)
        local_shape = (max(0, min(rows, shape[0] - rank * rows)),) + shape[1:]
        g = torch.Generator().manual_seed(1000 + 2 * k + rank)
        local = torch.randn(local_shape, generator=g, dtype=torch.float32)
        local = 1 + 0.1 * local if len(shape) == 1 else 0.02 * local
        full = torch.empty(shape, device="meta")
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                         shape=full.shape, stride=full.stride())
    dcp.save(state, checkpoint_id=outdir)
    dist.barrier()
    dist.destroy_process_group()


def tt_input(args) -> None:
    import torch.multiprocessing as mp

    out = args.outdir
    (out / "ckpt").mkdir(parents=True, exist_ok=True)
    mp.spawn(tt_worker, args=(2, str(out / "ckpt"), args.layers, free_port()), nprocs=2)
    write_hf_config(out / "hf", args.layers, "float32", LLAMA3_ROPE)
    total = sum(f.stat().st_size for f in (out / "ckpt").iterdir())
    print(f"{out}: torchtitan Llama3, {args.layers} layers, fp32, DCP over 2 ranks, {total / 1e9:.2f} GB")


@torch.inference_mode()
def tt_convert(args) -> None:
    """torchtitan's convert_to_hf.py, as it runs for this model (export dtype float32)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    layers = json.loads((args.hf / "config.json").read_text())["num_hidden_layers"]
    model_config = tt_config(layers)
    with torch.device("cpu"):
        model = model_config.build()
    model = ModelWrapper(model)
    sd_adapter = Llama3StateDictAdapter(model_config, str(args.hf))
    state_dict = model._get_state_dict()
    dcp.load(state_dict, checkpoint_id=str(args.input))
    hf_state_dict = sd_adapter.to_hf(state_dict)
    storage_writer = HuggingFaceStorageWriter(
        path=str(args.output),
        save_distributed=True,
        fqn_to_index_mapping=sd_adapter.fqn_to_index_mapping,
        enable_consolidation=True,
        thread_count_consolidation=5,
    )
    dcp.save(hf_state_dict, storage_writer=storage_writer)


def full_load(path: Path) -> dict:
    """Every entry of a DCP checkpoint in memory, as dcp_to_torch_save loads it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return sd


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved (complex) RoPE rows to transformers' half-split order, per head."""
    d1, d2 = w.shape
    return w.view(n_heads, d1 // n_heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


TT_TO_HF = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wk\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.qkv_linear\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


def save_hf(out: Path, hf: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for f in hf.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)


@torch.inference_mode()
def tt_full(args) -> None:
    cfg = json.loads((args.hf / "config.json").read_text())
    sd = full_load(args.input)
    out = {}
    for name, t in sd.items():
        for pat, repl in TT_TO_HF:
            if re.fullmatch(pat, name):
                new = re.sub(pat, repl, name)
                break
        else:
            continue
        if new.endswith("q_proj.weight"):
            t = permute(t, cfg["num_attention_heads"])
        elif new.endswith("k_proj.weight"):
            t = permute(t, cfg["num_key_value_heads"])
        out[new] = t
    save_hf(args.output, args.hf, out)


# ---------------------------------------------------------------------------------------------
# Megatron-core


def mg_worker(out: Path, layers: int) -> None:
    """One torchrun rank: build the TP=2 GPTModel, fill its parameters, dist_checkpointing.save."""
    import contextlib
    import warnings

    import numpy as np
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if not hasattr(np, "product"):
        np.product = np.prod
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, 1)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=DIM, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, use_cpu_initialization=True, perform_initialization=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-5, add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB, max_sequence_length=8192, position_embedding_type="rope", rotary_base=10000,
        share_embeddings_and_output_weights=False,
    )
    # each rank's own values for its slice of a split tensor, the same on every rank for the
    # replicated norms
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            norm = "norm" in name
            g = torch.Generator().manual_seed(5000 + 2 * k + (0 if norm else rank))
            v = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + 0.1 * v if norm else 0.02 * v)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    dist.barrier()
    dist.destroy_process_group()


def two_rank_worker(worker: str, ckpt: Path, layers: int) -> None:
    """This script's `worker` subcommand on 2 gloo ranks under torchrun, saving into `ckpt`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node=2",
                    f"--master_port={free_port()}", __file__, worker, str(ckpt),
                    "--layers", str(layers)], check=True, env=env)


def mg_input(args) -> None:
    out = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    two_rank_worker("mg-worker", out / "ckpt", args.layers)
    write_hf_config(out / "hf", args.layers, "bfloat16", {"rope_type": "default", "rope_theta": 10000.0})
    total = sum(f.stat().st_size for f in (out / "ckpt").iterdir())
    print(f"{out}: megatron-core GPTModel, {args.layers} layers, bf16, torch_dist at TP=2, {total / 1e9:.2f} GB")


@torch.inference_mode()
def mg_full(args) -> None:
    cfg = json.loads((args.hf / "config.json").read_text())
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, vocab = cfg["head_dim"], cfg["vocab_size"]
    sd = full_load(args.input)
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab]}
    p = "decoder.layers."
    for i in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{i}."
        qkv = sd[p + "self_attention.linear_qkv.weight"][i]
        qkv = qkv.view(groups, heads // groups + 2, hd, -1)
        out[h + "self_attn.q_proj.weight"] = qkv[:, : heads // groups].reshape(heads * hd, -1)
        out[h + "self_attn.k_proj.weight"] = qkv[:, -2].reshape(groups * hd, -1)
        out[h + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(groups * hd, -1)
        out[h + "self_attn.o_proj.weight"] = sd[p + "self_attention.linear_proj.weight"][i]
        gate, up = sd[p + "mlp.linear_fc1.weight"][i].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = sd[p + "mlp.linear_fc2.weight"][i]
        out[h + "input_layernorm.weight"] = sd[p + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[h + "post_attention_layernorm.weight"] = sd[p + "mlp.linear_fc1.layer_norm_weight"][i]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    save_hf(args.output, args.hf, out)


# ---------------------------------------------------------------------------------------------
# A Megatron-core mixture of experts at EP=2 (moe), and a Hugging Face release of the same model
# imported into Megatron-core and torchtitan (import)

MEGATRON_METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                          "common_backend": "torch", "common_backend_version": 1}
# what Megatron-LM passes to sharded_state_dict() and dist_checkpointing.save
SAVE_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def n_experts(cfg: dict) -> int:
    """transformers 5 writes Qwen3-MoE's num_experts as num_local_experts."""
    return cfg.get("num_experts", cfg.get("num_local_experts"))


def megatron_padded_vocab(vocab: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: up to a multiple of divisible_by * TP."""
    m = divisible_by * tp
    return -(-vocab // m) * m


def write_moe_hf_config(hf: Path, layers: int) -> None:
    from transformers import GenerationConfig, Qwen3MoeConfig

    hf.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=MOE_DIM, intermediate_size=8 * MOE_FFN,
        moe_intermediate_size=MOE_FFN, num_hidden_layers=layers, num_attention_heads=MOE_HEADS,
        num_key_value_heads=MOE_KV_HEADS, head_dim=HEAD_DIM, num_experts=EXPERTS,
        num_experts_per_tok=TOPK, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1,
        eos_token_id=2, dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"],
    ).save_pretrained(hf)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(hf)


def moe_worker(out: Path, layers: int) -> None:
    """One torchrun rank of the EP=2 save: megatron-core's MoE GPTModel as Megatron-LM's
    model_provider builds it for --num-experts with --transformer-impl local (SequentialMLP
    experts), made bf16 as Float16Module makes it under --bf16, filled, and saved as Megatron-LM
    saves torch_dist (fully parallel over the data-parallel group)."""
    import contextlib
    import warnings
    import zlib

    import numpy as np
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if not hasattr(np, "product"):
        np.product = np.prod
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    ep, rank = dist.get_world_size(), dist.get_rank()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron-core 0.16.1 without Transformer Engine: the router reads this name regardless
    # (fixtures/generate_megatron_moe.py); None selects its torch path. No saved value depends on it.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=MOE_DIM, num_attention_heads=MOE_HEADS,
        num_query_groups=MOE_KV_HEADS, kv_channels=HEAD_DIM, ffn_hidden_size=8 * MOE_FFN,
        qk_layernorm=True, num_moe_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN,
        moe_router_topk=TOPK, moe_layer_freq=1, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3, expert_model_parallel_size=ep, use_cpu_initialization=True,
        perform_initialization=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
        params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=megatron_padded_vocab(VOCAB),
        max_sequence_length=4096, position_embedding_type="rope", rotary_base=1000000,
        share_embeddings_and_output_weights=False,
    ).bfloat16()  # torch's RMSNorm is made in fp32 whatever params_dtype says
    per_rank = EXPERTS // ep
    with torch.no_grad():
        for name, p in model.named_parameters():
            # seeded by the parameter's name with the global expert number: the same values
            # whatever the layout, and the same replicated tensors on every rank
            name = re.sub(r"\.local_experts\.(\d+)\.",
                          lambda m: f".experts.{rank * per_rank + int(m.group(1))}.", name)
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            v = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + 0.1 * v if "norm" in name else 0.02 * v)
    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = model.sharded_state_dict(metadata={**SAVE_METADATA, "dp_cp_group": dp})
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp)
    dist_checkpointing.save(sd, str(out), strategy, content_metadata=dict(SAVE_METADATA))
    dist.barrier()
    dist.destroy_process_group()


def moe_input(args) -> None:
    out = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    two_rank_worker("moe-worker", out / "ckpt", args.layers)
    write_moe_hf_config(out / "hf", args.layers)
    total = sum(f.stat().st_size for f in (out / "ckpt").iterdir())
    print(f"{out}: megatron-core MoE GPTModel, {args.layers} layers of {EXPERTS} experts, bf16, "
          f"torch_dist at EP=2, {total / 1e9:.2f} GB")


@torch.inference_mode()
def moe_full(args) -> None:
    """The whole-model converter for the Megatron MoE: the full load (the EP shards merged into
    [layer, expert, ...] tensors), each layer's and expert's slice renamed, QKV split per query
    group, each expert's linear_fc1 into gate and up, save_file."""
    cfg = json.loads((args.hf / "config.json").read_text())
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, vocab, experts = cfg["head_dim"], cfg["vocab_size"], n_experts(cfg)
    sd = full_load(args.input)
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab]}
    p = "decoder.layers."
    for i in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{i}."
        qkv = sd[p + "self_attention.linear_qkv.weight"][i]
        qkv = qkv.view(groups, heads // groups + 2, hd, -1)
        out[h + "self_attn.q_proj.weight"] = qkv[:, : heads // groups].reshape(heads * hd, -1)
        out[h + "self_attn.k_proj.weight"] = qkv[:, -2].reshape(groups * hd, -1)
        out[h + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(groups * hd, -1)
        out[h + "self_attn.o_proj.weight"] = sd[p + "self_attention.linear_proj.weight"][i]
        out[h + "self_attn.q_norm.weight"] = sd[p + "self_attention.q_layernorm.weight"][i]
        out[h + "self_attn.k_norm.weight"] = sd[p + "self_attention.k_layernorm.weight"][i]
        out[h + "input_layernorm.weight"] = sd[p + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[h + "post_attention_layernorm.weight"] = sd[p + "mlp.linear_fc1.layer_norm_weight"][i]
        out[h + "mlp.gate.weight"] = sd[p + "mlp.router.weight"][i]
        fc1 = sd[p + "mlp.experts.experts.linear_fc1.weight"][i]
        fc2 = sd[p + "mlp.experts.experts.linear_fc2.weight"][i]
        for e in range(experts):
            gate, up = fc1[e].chunk(2, dim=0)
            out[h + f"mlp.experts.{e}.gate_proj.weight"] = gate
            out[h + f"mlp.experts.{e}.up_proj.weight"] = up
            out[h + f"mlp.experts.{e}.down_proj.weight"] = fc2[e]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    save_hf(args.output, args.hf, out)


def import_input(args) -> None:
    """A Qwen3-MoE release as transformers writes one: from_config with a fixed seed (its own
    init; the norms, which it makes ones, drawn around 1), save_pretrained in files of 1 GB."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = args.outdir / "model"
    write_moe_hf_config(out, args.layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    shard = "200KB" if os.environ.get("HF_BENCH_SMALL") else "1GB"
    model.save_pretrained(out, max_shard_size=shard)
    files = sorted(out.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    print(f"{out}: Qwen3-MoE, {args.layers} layers of {EXPERTS} experts, bf16, {len(files)} files, "
          f"{total / 1e9:.2f} GB")


def load_release(rel: Path) -> dict:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(rel.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def megatron_import(hf: dict, cfg: dict, out: Path) -> None:
    """The release under megatron-core's GPTModel names (local spec, as its sharded_state_dict()
    asks: layer-stacked `decoder.layers.*`, QKV rows [q of the group's heads; k; v] per query
    group, the experts stacked [layer, expert, ...] with linear_fc1 [gate; up], the norms under
    the linears they precede, the vocabulary padded with zero rows, the linears' `_extra_state`
    objects), dcp.save'd with megatron-core's common.pt, metadata.json and tracker file."""
    import torch.distributed.checkpoint as dcp

    L, heads, groups = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, experts = cfg["head_dim"], n_experts(cfg)
    padded = megatron_padded_vocab(cfg["vocab_size"])

    def pad(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])

    def stack(fmt: str) -> torch.Tensor:
        return torch.stack([hf[f"model.layers.{i}." + fmt] for i in range(L)])

    def qkv(i: int) -> torch.Tensor:
        q, k, v = (hf[f"model.layers.{i}.self_attn.{x}_proj.weight"] for x in "qkv")
        h = q.shape[1]
        return torch.cat([q.view(groups, heads // groups * hd, h), k.view(groups, hd, h),
                          v.view(groups, hd, h)], 1).view(-1, h)

    def fc1(i: int) -> torch.Tensor:
        e = f"model.layers.{i}.mlp.experts.{{}}.{{}}_proj.weight"
        return torch.stack([torch.cat([hf[e.format(x, "gate")], hf[e.format(x, "up")]])
                            for x in range(experts)])

    def fc2(i: int) -> torch.Tensor:
        return torch.stack([hf[f"model.layers.{i}.mlp.experts.{x}.down_proj.weight"] for x in range(experts)])

    p = "decoder.layers."
    sd = {
        "embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"]),
        p + "self_attention.linear_qkv.weight": torch.stack([qkv(i) for i in range(L)]),
        p + "self_attention.linear_qkv.layer_norm_weight": stack("input_layernorm.weight"),
        p + "self_attention.linear_proj.weight": stack("self_attn.o_proj.weight"),
        p + "self_attention.q_layernorm.weight": stack("self_attn.q_norm.weight"),
        p + "self_attention.k_layernorm.weight": stack("self_attn.k_norm.weight"),
        p + "mlp.linear_fc1.layer_norm_weight": stack("post_attention_layernorm.weight"),
        p + "mlp.router.weight": stack("mlp.gate.weight"),
        p + "mlp.experts.experts.linear_fc1.weight": torch.stack([fc1(i) for i in range(L)]),
        p + "mlp.experts.experts.linear_fc2.weight": torch.stack([fc2(i) for i in range(L)]),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": pad(hf["lm_head.weight"]),
    }

    # The local linears' extra state (None), one ShardedObject per layer (and expert), stored by
    # megatron-core's torch_dist strategy as the list of the key's objects (DCP torch.saves it).
    for lin in ("self_attention.linear_qkv", "self_attention.linear_proj"):
        for i in range(L):
            sd[f"{p}{lin}._extra_state/shard_{i}_{L}"] = [None]
    for lin in ("linear_fc1", "linear_fc2"):
        for i in range(L):
            for e in range(experts):
                sd[f"{p}mlp.experts.experts.{lin}._extra_state/shard_{i}.{e}_{L}.{experts}"] = [None]
    release = out / "release"
    release.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(release), no_dist=True)
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, release / "common.pt")
    (release / "metadata.json").write_text(json.dumps(MEGATRON_METADATA_JSON))
    (out / "latest_checkpointed_iteration.txt").write_text("release")


def tt_moe_config(cfg: dict):
    """torchtitan 0.3's Qwen3Model.Config of a Qwen3-MoE config.json, as its qwen3 MoE flavors
    build one (`_build_qwen3_moe_layers`: every layer MoE, softmax router, top-k renormalised)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

    assert cfg["decoder_sparse_step"] == 1 and not cfg["mlp_only_layers"] and cfg["norm_topk_prob"]
    assert not cfg["tie_word_embeddings"]
    vocab, dim, hd = cfg["vocab_size"], cfg["hidden_size"], cfg["head_dim"]
    return Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=cfg["num_hidden_layers"], dim=dim,
            n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"], head_dim=hd,
            moe_hidden_dim=cfg["moe_intermediate_size"], num_experts=n_experts(cfg),
            top_k=cfg["num_experts_per_tok"], attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=hd, max_seq_len=cfg["max_position_embeddings"],
                                   theta=cfg["rope_parameters"]["rope_theta"]),
        ),
    )


def torchtitan_import(hf: dict, cfg: dict, rel: Path, out: Path) -> None:
    """torchtitan's own map of the release (`Qwen3StateDictAdapter.from_hf`, the experts stacked
    [E, ...]; its offline path, as convert_from_hf.py and an `initial_load_in_hf` load use it),
    plus what the model's state dict holds that the release has no place for (`moe.expert_bias_E`,
    torchtitan's load-balancing bias: zeros, as the model starts it), dcp.save'd as a model-only
    checkpoint. (convert_from_hf.py itself builds the model in F32 and so writes F32.)"""
    import torch.distributed.checkpoint as dcp
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    model_cfg = tt_moe_config(cfg)
    sd = Qwen3StateDictAdapter(model_cfg, str(rel)).from_hf(hf)
    with torch.device("meta"):
        model = model_cfg.build()
    want = model.state_dict()
    for k, v in want.items():
        if k not in sd:
            assert k.endswith("moe.expert_bias_E"), f"the release has no {k}"
            sd[k] = torch.zeros(v.shape, dtype=v.dtype)
    assert sd.keys() == want.keys(), sorted(set(sd) ^ set(want))
    assert all(sd[k].shape == want[k].shape for k in want), [k for k in want if sd[k].shape != want[k].shape]
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)


@torch.inference_mode()
def import_ref(args) -> None:
    cfg = json.loads((args.input / "config.json").read_text())
    hf = load_release(args.input)
    args.output.mkdir(parents=True, exist_ok=True)
    if args.format == "megatron":
        megatron_import(hf, cfg, args.output)
    else:
        torchtitan_import(hf, cfg, args.input, args.output)


# ---------------------------------------------------------------------------------------------
# A bf16 Hugging Face model and the FP8 reference


def hf_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (VOCAB, DIM)}
    for i in range(layers):
        h = f"model.layers.{i}."
        out[h + "self_attn.q_proj.weight"] = (HEADS * HEAD_DIM, DIM)
        out[h + "self_attn.k_proj.weight"] = (KV_HEADS * HEAD_DIM, DIM)
        out[h + "self_attn.v_proj.weight"] = (KV_HEADS * HEAD_DIM, DIM)
        out[h + "self_attn.o_proj.weight"] = (DIM, HEADS * HEAD_DIM)
        out[h + "mlp.gate_proj.weight"] = (FFN, DIM)
        out[h + "mlp.up_proj.weight"] = (FFN, DIM)
        out[h + "mlp.down_proj.weight"] = (DIM, FFN)
        out[h + "input_layernorm.weight"] = (DIM,)
        out[h + "post_attention_layernorm.weight"] = (DIM,)
    out["model.norm.weight"] = (DIM,)
    out["lm_head.weight"] = (VOCAB, DIM)
    return out


def hf_input(args) -> None:
    from safetensors.torch import save_file

    out = args.outdir / "model"
    sd = {}
    for k, (name, shape) in enumerate(hf_shapes(args.layers).items()):
        v = torch.randn(shape, generator=torch.Generator().manual_seed(9000 + k), dtype=torch.float32)
        sd[name] = (1 + 0.1 * v if len(shape) == 1 else 0.02 * v).to(torch.bfloat16)
    write_hf_config(out, args.layers, "bfloat16", {"rope_type": "default", "rope_theta": 10000.0})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"{out}: Llama, {args.layers} layers, bf16, {(out / 'model.safetensors').stat().st_size / 1e9:.2f} GB")


QUANTIZED = re.compile(r".*\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight")
BLOCK, FP8_MAX = 128, 448.0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 of one weight: (fp8 [out, in], scale_inv F32 [ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    x = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32)
    x[:rows, :cols] = w.float()
    tiles = x.view(br, BLOCK, bc, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(br * BLOCK, bc * BLOCK)[:rows, :cols].contiguous(), scale


@torch.inference_mode()
def fp8_ref(args) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = args.input, args.output
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    pending: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    weight_map: dict[str, str] = {}
    written = 0

    def flush() -> None:
        nonlocal pending, written
        if pending:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(pending, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in pending})
            shards.append({})
            pending, written = {}, 0

    for f in files:
        with safe_open(str(f), "pt") as s:
            for name in s.keys():
                t = s.get_tensor(name)
                if QUANTIZED.fullmatch(name):
                    q, scale_inv = quantize(t)
                    pending[name], pending[name + "_scale_inv"] = q, scale_inv
                    written += q.numel() + 4 * scale_inv.numel()
                else:
                    pending[name] = t
                    written += t.numel() * t.element_size()
                if written >= 1_000_000_000:
                    flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------------------------


def tensors_of(d: Path) -> dict[str, Path]:
    from safetensors import safe_open

    where = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            where.update({k: f for k in s.keys()})
    return where


def compare(args) -> None:
    from safetensors import safe_open

    a, b = tensors_of(args.a), tensors_of(args.b)
    if sorted(a) != sorted(b):
        sys.exit(f"{args.a} and {args.b} name different tensors: "
                 f"{sorted(set(a) ^ set(b))[:5]}")
    names = sorted(a)
    if args.names:
        step = max(1, len(names) // args.names)
        names = names[::step]
    differ = []
    for n in names:
        with safe_open(str(a[n]), "pt") as fa, safe_open(str(b[n]), "pt") as fb:
            x, y = fa.get_tensor(n), fb.get_tensor(n)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            differ.append(n)
    what = "all" if not args.names else f"{len(names)} of"
    if differ:
        print(f"{args.a.name} vs {args.b.name}: {len(differ)} of {len(names)} tensors differ: {differ[:5]}")
        sys.exit(1)
    print(f"{args.a.name} vs {args.b.name}: {what} {len(a)} tensors bit for bit equal")


def dcp_entries(root: Path) -> tuple[Path, dict]:
    """A DCP directory (a Megatron save root: its tracker's iteration directory) and its
    .metadata's entries."""
    from torch.distributed.checkpoint import FileSystemReader

    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.exists():
        root = root / tracker.read_text().strip()
    return root, FileSystemReader(str(root)).read_metadata().state_dict_metadata


def load_entries(root: Path, metas: dict) -> dict:
    """Entries as torch's DCP reader gives them: tensors whole, byte items deserialised
    (DefaultLoadPlanner.load_bytes: torch.load of the stored bytes)."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state = {k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata)
             else io.BytesIO() for k, m in metas.items()}
    if state:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(root)), no_dist=True)
    return state


def batches(metas: dict, limit: int = 512 << 20) -> list[list[str]]:
    """The keys in groups of at most `limit` bytes of tensors (one larger tensor alone)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out, size = [[]], 0
    for k in sorted(metas):
        m = metas[k]
        n = m.size.numel() * m.properties.dtype.itemsize if isinstance(m, TensorStorageMetadata) else 0
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return out


def compare_dcp(args) -> None:
    """Two DCP checkpoints (or Megatron save roots) entry by entry through torch's DCP reader,
    whatever their sharding: the same keys, every tensor bit for bit (dtype, shape, bytes), every
    byte item equal once deserialised; for save roots the tracker, common.pt and metadata.json.
    With --layout only the keys, every tensor's dtype and global shape, and the byte items."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ra, ma = dcp_entries(args.a)
    rb, mb = dcp_entries(args.b)
    if sorted(ma) != sorted(mb):
        sys.exit(f"{args.a} and {args.b} hold different entries: {sorted(set(ma) ^ set(mb))[:5]}")
    if args.layout:
        tensors = [k for k in ma if isinstance(ma[k], TensorStorageMetadata)]
        differ = [k for k in tensors
                  if (ma[k].size, ma[k].properties.dtype) != (mb[k].size, mb[k].properties.dtype)]
        objects = [k for k in ma if k not in tensors]
        xs = load_entries(ra, {k: ma[k] for k in objects})
        ys = load_entries(rb, {k: mb[k] for k in objects})
        differ += [k for k in objects if xs[k] != ys[k]]
        if differ:
            sys.exit(f"{args.a.name} vs {args.b.name}: {len(differ)} entries differ: {differ[:5]}")
        print(f"{args.a.name} vs {args.b.name}: the same {len(tensors)} tensors (dtype, shape) and "
              f"{len(ma) - len(tensors)} other entries")
        return
    differ, tensors = [], 0
    for keys in batches(ma):
        xs = load_entries(ra, {k: ma[k] for k in keys})
        ys = load_entries(rb, {k: mb[k] for k in keys})
        for k in keys:
            x, y = xs.pop(k), ys.pop(k)
            if isinstance(ma[k], TensorStorageMetadata):
                tensors += 1
                same = (x.dtype == y.dtype and x.shape == y.shape
                        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
            else:
                same = x == y
            if not same:
                differ.append(k)
    for f in ("common.pt", "metadata.json"):
        if (ra / f).exists() or (rb / f).exists():
            if f == "common.pt":
                same = torch.load(ra / f, weights_only=False) == torch.load(rb / f, weights_only=False)
            else:
                same = json.loads((ra / f).read_text()) == json.loads((rb / f).read_text())
            if not same:
                differ.append(f)
    if ra != args.a or rb != args.b:
        t = "latest_checkpointed_iteration.txt"
        if (args.a / t).read_text().strip() != (args.b / t).read_text().strip():
            differ.append(t)
    if differ:
        print(f"{args.a.name} vs {args.b.name}: {len(differ)} entries differ: {differ[:5]}")
        sys.exit(1)
    print(f"{args.a.name} vs {args.b.name}: all {tensors} tensors bit for bit equal, and the "
          f"{len(ma) - tensors} other entries equal (torch's DCP reader)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, layers in (("tt-input", 9), ("mg-input", 21), ("hf-input", 20), ("moe-input", 6),
                        ("import-input", 6)):
        p = sub.add_parser(cmd)
        p.add_argument("outdir", type=Path)
        p.add_argument("--layers", type=int, default=layers)
    for cmd in ("mg-worker", "moe-worker"):
        p = sub.add_parser(cmd)
        p.add_argument("outdir", type=Path)
        p.add_argument("--layers", type=int, required=True)
    for cmd in ("tt-convert", "tt-full", "mg-full", "moe-full"):
        p = sub.add_parser(cmd)
        p.add_argument("input", type=Path)
        p.add_argument("output", type=Path)
        p.add_argument("--hf", type=Path, required=True)
    p = sub.add_parser("fp8-ref")
    p.add_argument("input", type=Path)
    p.add_argument("output", type=Path)
    p = sub.add_parser("import-ref")
    p.add_argument("input", type=Path)
    p.add_argument("output", type=Path)
    p.add_argument("--format", choices=("megatron", "torchtitan"), required=True)
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--names", type=int, default=0)
    p = sub.add_parser("compare-dcp")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--layout", action="store_true")
    args = ap.parse_args()
    {"tt-input": tt_input, "mg-input": mg_input, "hf-input": hf_input, "moe-input": moe_input,
     "import-input": import_input,
     "mg-worker": lambda a: mg_worker(a.outdir, a.layers),
     "moe-worker": lambda a: moe_worker(a.outdir, a.layers),
     "tt-convert": tt_convert, "tt-full": tt_full, "mg-full": mg_full, "moe-full": moe_full,
     "fp8-ref": fp8_ref, "import-ref": import_ref, "compare": compare,
     "compare-dcp": compare_dcp}[args.cmd](args)


if __name__ == "__main__":
    main()
