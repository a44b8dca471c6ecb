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

Mixture-of-experts models (HF_CONFIG_JSON's `model_type` `qwen3_moe`, `deepseek_v3`,
`glm4_moe`, `mixtral`) go through the `mapping_registry()` of Bridge's own Qwen3-MoE, DeepSeek-V3 and
GLM-4.5 bridges, and for Mixtral, which Bridge 0.3.1 has no bridge for, a `MegatronMappingRegistry`
of 0.3.1's own mapping classes with the names of Bridge's Mixtral bridge (`MIXTRAL`: from Bridge's
unreleased pull request 1317; router `block_sparse_moe.gate`, experts `w1` / `w3` / `w2`)
(their modules loaded without the package `__init__`s; the few Bridge modules that need
Transformer Engine, omegaconf or the model providers, none of which the mapping uses, are replaced
by empty stand-ins: the PEFT base class, the model providers, PreTrainedCausalLM). The registry
resolves the names of the Megatron model that holds the checkpoint's tensors, at TP=1, EP=1
(`moe_names`: layers unstacked, the local layer spec's fused names `linear_qkv.layer_norm_*` /
`mlp.linear_fc1.layer_norm_*` back to its modules' `input_layernorm` / `pre_mlp_layernorm`, and
each expert of `mlp.experts.experts.linear_fc{1,2}.weight` [.., E, out, in] named as
TEGroupedMLP names it, `mlp.experts.linear_fc{1,2}.weight<e>`, the one expert form all three
registries map); each resolved mapping's own `megatron_to_hf` gives the HF tensors. What Bridge
leaves out is added by a torch reference (`moe_reference`) and listed on stdout with the Megatron
tensors Bridge's registry has no mapping for: the DeepSeek-V3 bridge maps no MTP layer (its "TODO:
mtp"), the GLM-4.5 bridge's MTP mapping has no `embed_tokens` / `shared_head.head` (the main
embedding and output layer, which Megatron's MTP layer shares). Where Bridge does map an MTP tensor
the reference must agree with it bitwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
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
    if hf.get("model_type") in MOE_BRIDGES:
        export_moe(sd, hf, out)
        return
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


# ---------------------------------------------------------------------------------------------
# Mixture-of-experts models: Bridge's own registries of its Qwen3-MoE, DeepSeek-V3, GLM-4.5 bridges

MOE_BRIDGES = {
    "qwen3_moe": ("megatron.bridge.models.qwen.qwen3_moe_bridge", "Qwen3MoEBridge"),
    "deepseek_v3": ("megatron.bridge.models.deepseek.deepseek_v3_bridge", "DeepSeekV3Bridge"),
    "glm4_moe": ("megatron.bridge.models.glm.glm45_bridge", "GLM45Bridge"),
    # Bridge 0.3.1 has no Mixtral bridge: its registry is built here (`MIXTRAL`).
    "mixtral": None,
}
# The registry of Megatron-Bridge's Mixtral bridge (`MixtralBridge.mapping_registry()`,
# src/megatron/bridge/models/mixtral/mixtral_bridge.py of NVIDIA-NeMo/Megatron-Bridge pull request
# 1317, the same names from its first commit fd27b3b38 to its last 1ee926b34; in no release through
# 0.6.0, and not in the 0.3.1 wheel), built from 0.3.1's own `MegatronMappingRegistry`,
# `AutoMapping`, `QKVMapping` and `GatedMLPMapping`: (class, megatron pattern, HF names). Mixtral's
# names as its releases and transformers' `save_pretrained` store them: router
# `block_sparse_moe.gate`, experts' `w1` (gate), `w3` (up), `w2` (down).
MIXTRAL = [
    ("AutoMapping", "embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("AutoMapping", "output_layer.weight", "lm_head.weight"),
    ("AutoMapping", "decoder.final_layernorm.weight", "model.norm.weight"),
    ("AutoMapping", "decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"),
    ("AutoMapping", "decoder.layers.*.self_attention.linear_proj.weight",
     "model.layers.*.self_attn.o_proj.weight"),
    ("AutoMapping", "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight",
     "model.layers.*.input_layernorm.weight"),
    ("AutoMapping", "decoder.layers.*.pre_mlp_layernorm.weight",
     "model.layers.*.post_attention_layernorm.weight"),
    ("AutoMapping", "decoder.layers.*.mlp.router.weight", "model.layers.*.block_sparse_moe.gate.weight"),
    ("AutoMapping", "decoder.layers.*.mlp.experts.linear_fc2.weight*",
     "model.layers.*.block_sparse_moe.experts.*.w2.weight"),
    ("QKVMapping", "decoder.layers.*.self_attention.linear_qkv.weight",
     dict(q="model.layers.*.self_attn.q_proj.weight", k="model.layers.*.self_attn.k_proj.weight",
          v="model.layers.*.self_attn.v_proj.weight")),
    ("GatedMLPMapping", "decoder.layers.*.mlp.experts.linear_fc1.weight*",
     dict(gate="model.layers.*.block_sparse_moe.experts.*.w1.weight",
          up="model.layers.*.block_sparse_moe.experts.*.w3.weight")),
]
# megatron-core's local layer spec saves its separate norms under the fused Transformer Engine
# names (`sharded_state_dict_keys_map` of get_gpt_layer_local_spec, non-MLA layers only); the
# model's own parameters are these.
LOCAL_SPEC_NORMS = {
    ".self_attention.linear_qkv.layer_norm_": ".input_layernorm.",
    ".mlp.linear_fc1.layer_norm_": ".pre_mlp_layernorm.",
}
EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.experts\.(linear_fc[12])\.(weight|bias)$")


def bridge_registry(model_type: str, hf: dict):
    """Bridge's `mapping_registry()` for a model type, its modules loaded without the packages'
    `__init__`s (which import Transformer Engine)."""
    import importlib.abc
    import importlib.machinery

    root = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0]).parent
    root = root / "bridge"

    class NoInit(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """megatron.bridge packages as bare namespaces: their modules, not their `__init__`s."""

        def find_spec(self, name, path=None, target=None):
            if name == "megatron.bridge" or name.startswith("megatron.bridge."):
                if root.joinpath(*name.split(".")[2:]).is_dir():
                    return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = [str(root.joinpath(*spec.name.split(".")[2:]))]
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, NoInit())

    def stand_in(name: str, **attrs) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module

    def empty(name: str):
        return type(name, (), {"__class_getitem__": classmethod(lambda cls, item: cls)})

    # Modules the mapping does not use whose imports need Transformer Engine / omegaconf.
    stand_in("megatron.bridge.models.conversion.peft_bridge",
             MegatronPeftBridge=empty("MegatronPeftBridge"),
             AdapterWeightConversionTask=empty("AdapterWeightConversionTask"))
    stand_in("megatron.bridge.models.model_provider", ModelProviderMixin=empty("ModelProviderMixin"))
    stand_in("megatron.bridge.models.gpt_provider", GPTModelProvider=empty("GPTModelProvider"))
    stand_in("megatron.bridge.models.mla_provider", MLAModelProvider=empty("MLAModelProvider"))
    stand_in("megatron.bridge.models.hf_pretrained.causal_lm",
             PreTrainedCausalLM=empty("PreTrainedCausalLM"))
    pm = importlib.import_module("megatron.bridge.models.conversion.param_mapping")
    if MOE_BRIDGES[model_type] is None:
        registry = importlib.import_module("megatron.bridge.models.conversion.mapping_registry")
        mappings = []
        for kind, megatron_param, hf_names in MIXTRAL:
            cls = getattr(pm, kind)
            if isinstance(hf_names, dict):
                mappings.append(cls(megatron_param=megatron_param, **hf_names))
            else:
                mappings.append(cls(megatron_param=megatron_param, hf_param=hf_names))
        return registry.MegatronMappingRegistry(*mappings), pm
    module_name, class_name = MOE_BRIDGES[model_type]
    module = importlib.import_module(module_name)
    bridge = getattr(module, class_name)()
    # GLM45Bridge reads the HF config for its MTP mappings (set in its build_conversion_tasks).
    bridge._hf_config = SimpleNamespace(**hf)
    return bridge.mapping_registry(), pm


def moe_names(sd: dict, num_layers: int) -> dict:
    """The checkpoint's model tensors under the names of the Megatron model holding them at TP=1,
    EP=1: layer-stacked `decoder.layers.X` [L, ...] cut into `decoder.layers.<i>.X`, the local
    spec's fused norm names back to its modules' names, and the experts of
    `<layer>.mlp.experts.experts.linear_fc{1,2}.weight` [E, out, in] one by one as TEGroupedMLP
    names them (`<layer>.mlp.experts.linear_fc{1,2}.weight<e>`; SequentialMLP's
    `local_experts.<e>.linear_fc{1,2}.weight` is the same tensor)."""
    names = {}
    for key, t in sd.items():
        if key.startswith("decoder.layers.") and not re.match(r"decoder\.layers\.\d+\.", key):
            assert t.shape[0] == num_layers, (key, t.shape)
            parts = {f"decoder.layers.{i}.{key[len('decoder.layers.'):]}": t[i]
                     for i in range(num_layers)}
        else:
            parts = {key: t}
        for name, w in parts.items():
            for fused, own in LOCAL_SPEC_NORMS.items():
                if fused in name:
                    name = name.replace(fused, own)
            m = EXPERTS.match(name)
            if m:
                for e in range(w.shape[0]):
                    names[f"{m[1]}.{m[2]}.{m[3]}{e}"] = w[e]
            else:
                names[name] = w
    return names


def moe_reference(sd: dict, hf: dict, registry, pm, module) -> dict:
    """What Bridge leaves out, by the rule of the HF layout (DeepSeek-V3's, which GLM-4.5's
    follows): MTP layer j is HF layer `num_hidden_layers + j`, with `enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm` (Megatron's `final_layernorm` of the MTP layer), the transformer layer's
    tensors under that layer's names (each mapped by Bridge's own mapping for a decoder layer of
    that index), and copies of the embedding and the output layer it shares,
    `embed_tokens` and `shared_head.head` (vocabulary rows cut as the main ones)."""
    got = {}
    layers, vocab = hf["num_hidden_layers"], hf["vocab_size"]
    for j in range(hf.get("num_nextn_predict_layers", 0)):
        at = f"model.layers.{layers + j}"
        prefix = f"mtp.layers.{j}."
        for name, w in moe_names({k: v for k, v in sd.items() if k.startswith(prefix)},
                                 layers).items():
            rest = name[len(prefix):]
            if rest.startswith("transformer_layer."):
                as_decoder = f"decoder.layers.{layers + j}.{rest[len('transformer_layer.'):]}"
                mapping = registry.megatron_to_hf_lookup(as_decoder)
                assert mapping is not None, as_decoder
                got.update(mapping.megatron_to_hf(w, module))
            else:
                hf_name = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                           "eh_proj.weight": "eh_proj.weight",
                           "final_layernorm.weight": "shared_head.norm.weight"}[rest]
                got.update(pm.DirectMapping(name, f"{at}.{hf_name}").megatron_to_hf(w, module))
        got[f"{at}.embed_tokens.weight"] = sd["embedding.word_embeddings.weight"][:vocab].clone()
        got[f"{at}.shared_head.head.weight"] = sd["output_layer.weight"][:vocab].clone()
    return got


def export_moe(sd: dict, hf: dict, out: str) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]),
                      RANK="0", WORLD_SIZE="1")
    sock.close()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    registry, pm = bridge_registry(hf["model_type"], hf)
    heads = hf["num_attention_heads"]
    config = SimpleNamespace(
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim"), hidden_size=hf["hidden_size"],
        num_moe_experts=hf.get("num_experts", hf.get("n_routed_experts",
                                                      hf.get("num_local_experts"))),
    )
    module = SimpleNamespace(config=config)
    # AutoMapping picks column/row/replicated from the module's class; at TP=1, EP=1 each is the
    # tensor itself (experts gathered over an EP group of 1).
    pm.AutoMapping.register_module_type("SimpleNamespace", "column")
    got, unmapped = {}, []
    names = moe_names({k: v for k, v in sd.items() if not k.startswith("mtp.")},
                      hf["num_hidden_layers"])
    for name, w in names.items():
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            unmapped.append(name)
            continue
        for hf_name, t in mapping.megatron_to_hf(w, module).items():
            assert hf_name not in got, hf_name
            got[hf_name] = t
    # What Bridge's registry makes of the MTP layer's tensors (its own names), before the reference.
    mtp = {k: v for k, v in sd.items() if k.startswith("mtp.")}
    bridge_mtp = {}
    for name, w in moe_names(mtp, hf["num_hidden_layers"]).items():
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            unmapped.append(name)
        else:
            bridge_mtp.update(mapping.megatron_to_hf(w, module))
    vocab = hf["vocab_size"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got[name] = got[name][:vocab]
    reference = moe_reference(sd, hf, registry, pm, module)
    for name, t in bridge_mtp.items():
        # Bridge's own mapping of an MTP tensor stands where it has one; it must agree.
        assert name in reference and torch.equal(reference[name], t), name
    added = sorted(set(reference) - set(bridge_mtp))
    got.update(bridge_mtp)
    got.update({k: reference[k] for k in added})
    assert not [n for n in unmapped if not n.startswith("mtp.")], unmapped
    # (Only "format" in the metadata: safetensors writes its keys in no fixed order.)
    save_file({k: v.contiguous() for k, v in sorted(got.items())}, out, metadata={"format": "pt"})
    print(f"{len(got)} tensors; Bridge mapped {len(got) - len(added)}; the reference added "
          f"{len(added)}: {', '.join(added) or '-'}; Bridge left unmapped {len(unmapped)} Megatron "
          f"tensors: {', '.join(unmapped) or '-'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
