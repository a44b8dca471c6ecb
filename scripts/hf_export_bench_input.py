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
  fp8-ref IN OUT              prime-rl's streaming blockwise FP8 rule, tensor by tensor: load one
        tensor, for a linear weight of attention or MLP: per 128x128 tile scale = amax / 448 (an
        all-zero tile 1.0), `(x / scale).clamp(-448, 448).to(float8_e4m3fn)`, `<name>_scale_inv`
        = scale in F32; other tensors as they are; output saved by `save_file` in files of about 1 GB
        (one is saved as soon as it reaches 1 GB; + index), so memory holds about one such file.

With HF_BENCH_SMALL=1 in the environment every command uses a model of a few MB instead (hidden
256, FFN 320, vocab 1000), for tests/interop/test_hf_export_bench_input.py.

Checks:
  compare A B [--names N]     tensors of the two HF directories bit for bit (all of them, or N
        spread over the model); exit 1 if any differs.
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
if os.environ.get("HF_BENCH_SMALL"):
    # tests/interop/test_hf_export_bench_input.py: the same code on a model of a few MB, an FFN
    # that is not a multiple of 128 (partial FP8 tiles)
    DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 4, 2, 64, 320, 1000
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


def mg_input(args) -> None:
    out = args.outdir
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node=2",
                    f"--master_port={free_port()}", __file__, "mg-worker", str(out / "ckpt"),
                    "--layers", str(args.layers)], check=True, env=env)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd, layers in (("tt-input", 9), ("mg-input", 21), ("hf-input", 20)):
        p = sub.add_parser(cmd)
        p.add_argument("outdir", type=Path)
        p.add_argument("--layers", type=int, default=layers)
    p = sub.add_parser("mg-worker")
    p.add_argument("outdir", type=Path)
    p.add_argument("--layers", type=int, required=True)
    for cmd in ("tt-convert", "tt-full", "mg-full"):
        p = sub.add_parser(cmd)
        p.add_argument("input", type=Path)
        p.add_argument("output", type=Path)
        p.add_argument("--hf", type=Path, required=True)
    p = sub.add_parser("fp8-ref")
    p.add_argument("input", type=Path)
    p.add_argument("output", type=Path)
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--names", type=int, default=0)
    args = ap.parse_args()
    {"tt-input": tt_input, "mg-input": mg_input, "hf-input": hf_input,
     "mg-worker": lambda a: mg_worker(a.outdir, a.layers),
     "tt-convert": tt_convert, "tt-full": tt_full, "mg-full": mg_full, "fp8-ref": fp8_ref,
     "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
