"""Save a small megatron-core `GPTModel` (local layer spec, on CPU, 1 gloo process) as
`dist_checkpointing.save` writes its `sharded_state_dict()`, with the Hugging Face config.json of
the same model and the model's own logits on a fixed batch. test_hf_export.py runs it as

    python megatron_gpt_save.py STYLE OUTDIR
    torchrun --nproc_per_node=2 megatron_gpt_save.py STYLE OUTDIR    (tensor parallel over 2)

STYLE is `llama` (GQA, kv_channels 16 where hidden/heads is 8), `qwen2` (QKV bias, tied
embeddings) or `qwen3` (q/k layernorm); the vocabulary is padded from 100 to 128 rows as
Megatron-LM pads it. OUTDIR gets `ckpt/` (the torch_dist directory), `hf/config.json` and
`logits.pt` ({"input_ids", "logits"}).

megatron-core needs CUDA for calls that only synchronise, pick a device or fork a CUDA random
state for dropout (none here): on a CPU-only torch they are replaced by no-ops.
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
    "llama": dict(kv_channels=16, qkv_bias=False, qk_norm=False, tied=False),
    "qwen2": dict(kv_channels=8, qkv_bias=True, qk_norm=False, tied=True),
    "qwen3": dict(kv_channels=16, qkv_bias=False, qk_norm=True, tied=False),
}
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def main() -> None:
    style, out = sys.argv[1], Path(sys.argv[2])
    s = STYLES[style]
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
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        kv_channels=s["kv_channels"], ffn_hidden_size=48, use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=1e-6, add_bias_linear=False, add_qkv_bias=s["qkv_bias"],
        qk_layernorm=s["qk_norm"], params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=s["qk_norm"])
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=PADDED_VOCAB,
        max_sequence_length=64, position_embedding_type="rope", rotary_base=10000,
        share_embeddings_and_output_weights=s["tied"], parallel_output=False,
    ).eval()
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
    with torch.no_grad():
        logits = model(ids, positions, mask)[..., :VOCAB]
    if rank == 0:
        (out / "ckpt").mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out / "ckpt"))
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
        "dtype": "float32",
    }
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text(json.dumps(config, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
