"""Megatron-Bridge's own mapping of a Megatron-core torch_dist checkpoint to Hugging Face names
and layouts: the reference an export by ckpt must equal bit for bit (test_hf_export.py).

    python megatron_bridge_export.py ITERDIR HF_CONFIG_JSON OUT.safetensors

The model tensors of ITERDIR are read whole by torch's DCP reader. Each goes through the
mapping classes of megatron-bridge 0.3.1 (`megatron/bridge/models/conversion/param_mapping.py`,
loaded on its own: the package's `__init__` imports Transformer Engine, which needs CUDA):
`QKVMapping` (Megatron's QKV per query group into q, k, v; the bias alike), `GatedMLPMapping`
([gate; up] into two) and `DirectMapping` for the rest, with the names of Bridge's Llama, Qwen2
and Qwen3 bridges (`mapping_registry`). The mappings run in one gloo process with Megatron's
model parallelism at 1, as Bridge runs on a single GPU. A layer-stacked tensor is mapped a layer
at a time, and the padded vocabulary is cut to `vocab_size` rows as Bridge's export does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

warnings.filterwarnings("ignore")

# Bridge's `mapping_registry` names (Llama, Qwen2, Qwen3): `*` is the layer.
DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight": "model.layers.*.input_layernorm.weight",
    "decoder.layers.*.mlp.linear_fc1.layer_norm_weight": "model.layers.*.post_attention_layernorm.weight",
    "decoder.layers.*.self_attention.q_layernorm.weight": "model.layers.*.self_attn.q_norm.weight",
    "decoder.layers.*.self_attention.k_layernorm.weight": "model.layers.*.self_attn.k_norm.weight",
    "decoder.layers.*.self_attention.linear_proj.weight": "model.layers.*.self_attn.o_proj.weight",
    "decoder.layers.*.mlp.linear_fc2.weight": "model.layers.*.mlp.down_proj.weight",
}
QKV = {
    "decoder.layers.*.self_attention.linear_qkv.weight": "weight",
    "decoder.layers.*.self_attention.linear_qkv.bias": "bias",
}
GATED = "decoder.layers.*.mlp.linear_fc1.weight"


def param_mapping():
    """Bridge's param_mapping.py, without running the package `__init__`s above it."""
    where = Path(importlib.util.find_spec("megatron.bridge").submodule_search_locations[0])
    for name in ("megatron.bridge", "megatron.bridge.models", "megatron.bridge.models.conversion"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package

    def load(name: str, path: Path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    load("megatron.bridge.models.conversion.utils", where / "models/conversion/utils.py")
    return load("megatron.bridge.models.conversion.param_mapping",
                where / "models/conversion/param_mapping.py")


def model_tensors(iterdir: str) -> dict:
    reader = dcp.FileSystemReader(iterdir)
    meta = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in meta.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer")}
    dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True))
    return sd


def main() -> None:
    iterdir, hf_config, out = sys.argv[1:4]
    hf = json.loads(Path(hf_config).read_text())
    sd = model_tensors(iterdir)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]),
                      RANK="0", WORLD_SIZE="1")
    sock.close()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    pm = param_mapping()
    config = SimpleNamespace(
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf["head_dim"], hidden_size=hf["hidden_size"],
    )
    module = SimpleNamespace(config=config)
    # QKVMapping and GatedMLPMapping gather their TP shards through an AutoMapping, which tells
    # column- from row-parallel by the module's class: both are column-parallel in Megatron.
    pm.AutoMapping.register_module_type("SimpleNamespace", "column")
    layers = hf["num_hidden_layers"]

    def each_layer(pattern: str):
        """(layer or None, megatron tensor) of a name pattern, unstacking layers."""
        name = pattern.replace(".*.", ".")
        if name not in sd:
            return
        if "*" not in pattern:
            yield None, sd[name]
            return
        assert sd[name].shape[0] == layers, (name, sd[name].shape)
        for i in range(layers):
            yield i, sd[name][i]

    def named(pattern: str, i) -> str:
        return pattern if i is None else pattern.replace("*", str(i))

    got = {}
    for mpattern, hpattern in DIRECT.items():
        for i, w in each_layer(mpattern):
            m = pm.DirectMapping(named(mpattern, i), named(hpattern, i))
            got.update(m.megatron_to_hf(w, module))
    for mpattern, kind in QKV.items():
        for i, w in each_layer(mpattern):
            p = f"model.layers.{i}.self_attn"
            m = pm.QKVMapping(named(mpattern, i), q=f"{p}.q_proj.{kind}", k=f"{p}.k_proj.{kind}",
                              v=f"{p}.v_proj.{kind}")
            got.update(m.megatron_to_hf(w, module))
    for i, w in each_layer(GATED):
        p = f"model.layers.{i}.mlp"
        m = pm.GatedMLPMapping(named(GATED, i), gate=f"{p}.gate_proj.weight", up=f"{p}.up_proj.weight")
        got.update(m.megatron_to_hf(w, module))
    vocab = hf["vocab_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in got:
            got[name] = got[name][:vocab]
    if hf.get("tie_word_embeddings"):
        got.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in got.items()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
