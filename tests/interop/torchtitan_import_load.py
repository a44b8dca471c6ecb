"""Run under torchrun (2 gloo ranks, CPU) by test_hf_import_torchtitan.py: torchtitan 0.3.0's own
Trainer starts a run from a checkpoint `ckpt reshard REL --format torchtitan` wrote, as a user
starts torchtitan from an imported Hugging Face release.

    torchrun --nproc_per_node=2 tests/interop/torchtitan_import_load.py JOB.json

JOB.json: {"release": REL (the Hugging Face directory: config.json, tokenizer files, weights),
           "dcp": OUT (ckpt's output), "work": a fresh folder (torchtitan's dump folder, cwd),
           "input_ids": [[...], ...], "result": RESULT.safetensors, "report": REPORT.json,
           "how": "initial_load_path" or "step-0"}

The torchtitan model is built from REL/config.json the way fixtures/generate_torchtitan.py builds
an HF config from torchtitan dims, read backwards (`tt_model_spec`): Llama 3 (`Llama3Model`,
`ComplexRoPE` with the config's Llama 3.1 scaling), Qwen3 (`Qwen3Model`, q/k norms, `CosSinRoPE`,
tied or not) and Qwen3-MoE (`Qwen3Model` of `_build_qwen3_moe_layers`: every layer MoE, softmax
router, top-k renormalised, the flavors' `load_balance_coeff` 1e-3, hence `moe.expert_bias_E`)
and DeepSeek-V3 (`DeepSeekV3Model` of `_build_dsv3_layers`, as its flavors: latent attention,
`first_k_dense_replace` dense layers, then MoE with shared experts; the router as transformers'
DeepseekV3TopkRouter: sigmoid scores, `expert_bias_E` (the release's `e_score_correction_bias`)
added for the choice only, `n_group`/`topk_group` as num_expert_groups/num_limited_groups,
`norm_topk_prob` as route_norm, `routed_scaling_factor` as route_scale; `ComplexRoPE` without
scaling, whose adjacent pairs are transformers' `rope_interleave`; no MTP layers).
The checkpoint options are torchtitan's own, nothing else loads weights:

- how="initial_load_path": `checkpoint.initial_load_path=OUT`, `initial_load_model_only=True`,
  `initial_load_in_hf=False`, an empty `checkpoint.folder` (so CheckpointManager._load takes its
  initial-load branch);
- how="step-0": OUT copied to `<dump>/checkpoint/step-0` (the seed-checkpoint place: `_load`
  finds step 0 by its `.metadata` and loads it model only).

Before anything is loaded, rank 0 writes REPORT: the keys torchtitan's model-only load asks DCP
for (the model's state dict: dtype, shape) against OUT's .metadata (`missing`, `unexpected`,
`mismatched` shapes, both dtypes of each key). Then `Trainer.train()` loads it (`checkpointer.load`), then runs 1 training step (FSDP2 over the 2
ranks, AdamW). Its first `train_step` is wrapped: before it, the loaded model's forward (eval, no
grad, F32; for the MoEs the routed experts in F32, fixtures/generate_torchtitan.py's `f32_experts`,
since torchtitan's GroupedExperts casts to bf16) on `input_ids`. Rank 0 writes RESULT with
`logits` (F32), `loss` (the step's global average loss, as torchtitan's metrics logger gets it)
and, for the MoEs, `expert_bias_E` (every MoE layer's, as loaded). Shims for a CPU-only machine are
fixtures/generate_torchtitan.py's (its docstring says why each is needed); none touches a value.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def load_generator():
    """fixtures/generate_torchtitan.py as a module (its helpers: `cpu_shims`, `f32_experts`,
    `SEQ`)."""
    spec = importlib.util.spec_from_file_location(
        "generate_torchtitan", REPO / "fixtures" / "generate_torchtitan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tt_dims(cfg: dict) -> dict:
    """The torchtitan model's dims from a Hugging Face config.json: the inverse of
    generate_torchtitan.py's write_hf_dir (DIMS -> LlamaConfig / Qwen3Config / Qwen3MoeConfig /
    DeepseekV3Config). Asserts what torchtitan's builders fix (Llama 3's head_dim = dim / n_heads;
    Qwen3-MoE's every layer MoE with a renormalised top-k; DeepSeek-V3's sigmoid routing, RoPE
    on interleaved pairs without scaling here, no MTP layers)."""
    arch = cfg["architectures"][0]
    rope = cfg["rope_parameters"]
    d = dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        eps=cfg["rms_norm_eps"], theta=rope["rope_theta"],
        max_seq_len=cfg["max_position_embeddings"], tied=cfg.get("tie_word_embeddings", False),
        vocab=cfg["vocab_size"],
    )
    if arch == "LlamaForCausalLM":
        assert d["head_dim"] * d["n_heads"] == d["dim"], "torchtitan's Llama 3: head_dim = dim / n_heads"
        assert rope["rope_type"] == "llama3", rope
        d.update(arch="llama3", hidden_dim=cfg["intermediate_size"], scaling={
            k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings")})
    elif arch == "Qwen3ForCausalLM":
        assert rope["rope_type"] == "default", rope
        d.update(arch="qwen3", hidden_dim=cfg["intermediate_size"])
    elif arch == "Qwen3MoeForCausalLM":
        assert rope["rope_type"] == "default", rope
        # torchtitan's _build_qwen3_moe_layers: every layer MoE, softmax router, top-k renormalised
        assert cfg["decoder_sparse_step"] == 1 and not cfg["mlp_only_layers"], cfg
        assert cfg["norm_topk_prob"], cfg
        n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        d.update(arch="qwen3_moe", moe_hidden_dim=cfg["moe_intermediate_size"],
                 num_experts=n_experts, top_k=cfg["num_experts_per_tok"])
    elif arch == "DeepseekV3ForCausalLM":
        # transformers' DeepseekV3TopkRouter always scores by sigmoid (a release's `scoring_func`
        # and `topk_method` are not read): torchtitan's 671B flavor's "sigmoid"
        assert cfg.get("scoring_func", "sigmoid") == "sigmoid", cfg
        # torchtitan's ComplexRoPE rotates adjacent pairs: transformers' rope_interleave
        assert cfg.get("rope_interleave", True), cfg
        # plain RoPE: torchtitan's YaRN (and its mscale in the softmax scale) not built here
        assert rope["rope_type"] == "default", rope
        assert not cfg.get("num_nextn_predict_layers"), "torchtitan's names have no MTP layer"
        assert not cfg.get("attention_bias"), cfg
        n_group = cfg.get("n_group") or 1
        d.update(arch="deepseek_v3", n_dense_layers=cfg["first_k_dense_replace"],
                 q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
                 qk_nope_head_dim=cfg["qk_nope_head_dim"],
                 qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                 hidden_dim=cfg["intermediate_size"], moe_hidden_dim=cfg["moe_intermediate_size"],
                 num_experts=cfg["n_routed_experts"], num_shared_experts=cfg["n_shared_experts"],
                 top_k=cfg["num_experts_per_tok"],
                 # one group is no group (transformers' then keeps it whole)
                 n_group=n_group if n_group > 1 else None,
                 topk_group=cfg["topk_group"] if n_group > 1 else None,
                 route_norm=bool(cfg["norm_topk_prob"]),
                 route_scale=float(cfg["routed_scaling_factor"]))
    else:
        raise SystemExit(f"no torchtitan model for {arch}")
    return d


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    work = Path(job["work"])
    os.chdir(work)

    gen = load_generator()
    gen.cpu_shims()  # its worker's, for torchtitan's Trainer on a CPU-only torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.utils.data import IterableDataset

    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.moe import MoE
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    release = Path(job["release"])
    d = tt_dims(json.loads((release / "config.json").read_text()))
    V = d["vocab"]
    SEQ = gen.SEQ

    class FixedTokens(IterableDataset):
        """Seeded random token rows per DP rank, SEQ + 1 long (input, shifted label)."""

        def __init__(self, dp_rank: int):
            self.dp_rank = dp_rank

        def __iter__(self):
            g = torch.Generator().manual_seed(1000 + self.dp_rank)
            while True:
                row = torch.randint(3, V, (SEQ + 1,), generator=g)
                yield {"input": row[:-1]}, row[1:]

    class FixedTokensDataLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            dataset: str = "fixed_tokens"

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer,
                     seq_len: int, local_batch_size: int, snapshot_every_n_steps=1, **kwargs):
            super().__init__(FixedTokens(dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size,
                             batch_size=local_batch_size,
                             snapshot_every_n_steps=snapshot_every_n_steps)

    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    if d["arch"] == "llama3":
        from torchtitan.models.common import ComplexRoPE
        from torchtitan.models.llama3 import (
            _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init,
            parallelize_llama,
        )
        from torchtitan.models.llama3.model import Llama3Model
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        assert not d["tied"], "torchtitan's Llama 3 has no weight tying"
        s = d["scaling"]
        model = Llama3Model.Config(
            dim=d["dim"], vocab_size=V,
            tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d["dim"],
                                            param_init=_EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=d["dim"], param_init=_NORM_INIT),
            lm_head=Linear.Config(in_features=d["dim"], out_features=V,
                                  param_init=_output_linear_init(d["dim"])),
            layers=_build_llama3_layers(
                fuse_qkv=True, n_layers=d["n_layers"], dim=d["dim"], n_heads=d["n_heads"],
                n_kv_heads=d["n_kv_heads"], hidden_dim=d["hidden_dim"],
                rope=ComplexRoPE.Config(
                    dim=d["head_dim"], max_seq_len=d["max_seq_len"], theta=d["theta"],
                    scaling="llama", scaling_factor=s["factor"],
                    low_freq_factor=s["low_freq_factor"], high_freq_factor=s["high_freq_factor"],
                    original_max_position_embeddings=s["original_max_position_embeddings"],
                ),
                attn_backend="flex",
            ),
        )
        spec = ModelSpec(name="llama3", flavor="imported", model=model,
                         parallelize_fn=parallelize_llama, pipelining_fn=pipeline_llm,
                         post_optimizer_build_fn=None, state_dict_adapter=Llama3StateDictAdapter)
    elif d["arch"] == "qwen3":
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import (
            _EMBEDDING_INIT, _EMBEDDING_SKIP_INIT, _LINEAR_INIT, _build_qwen3_layers,
            _qwen3_norm, parallelize_qwen3,
        )
        from torchtitan.models.qwen3.model import Qwen3Model
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        model = Qwen3Model.Config(
            vocab_size=V, dim=d["dim"], norm=_qwen3_norm(d["dim"]),
            enable_weight_tying=d["tied"],
            tok_embeddings=Embedding.Config(
                num_embeddings=V, embedding_dim=d["dim"],
                param_init=_EMBEDDING_SKIP_INIT if d["tied"] else _EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=d["dim"], out_features=V, param_init=_LINEAR_INIT),
            layers=_build_qwen3_layers(
                fuse_qkv=True, n_layers=d["n_layers"], dim=d["dim"], n_heads=d["n_heads"],
                n_kv_heads=d["n_kv_heads"], head_dim=d["head_dim"], hidden_dim=d["hidden_dim"],
                attn_backend="flex",
                rope=CosSinRoPE.Config(dim=d["head_dim"], max_seq_len=d["max_seq_len"],
                                       theta=d["theta"]),
            ),
        )
        spec = ModelSpec(name="qwen3", flavor="imported", model=model,
                         parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                         post_optimizer_build_fn=register_moe_load_balancing_hook,
                         state_dict_adapter=Qwen3StateDictAdapter)
    elif d["arch"] == "deepseek_v3":
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.models.common import ComplexRoPE
        from torchtitan.models.deepseek_v3 import (
            _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init,
            parallelize_deepseekv3,
        )
        from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
        from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

        assert not d["tied"], "torchtitan's DeepSeek-V3 has no weight tying"
        model = DeepSeekV3Model.Config(
            vocab_size=V, dim=d["dim"],
            tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d["dim"],
                                            param_init=_EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=d["dim"], param_init=_NORM_INIT),
            lm_head=Linear.Config(in_features=d["dim"], out_features=V,
                                  param_init=_output_linear_init(d["dim"])),
            layers=_build_dsv3_layers(
                n_layers=d["n_layers"], n_dense_layers=d["n_dense_layers"], dim=d["dim"],
                n_heads=d["n_heads"], q_lora_rank=d["q_lora_rank"],
                kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
                qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
                mscale=1.0,  # only read with YaRN
                dense_hidden_dim=d["hidden_dim"], moe_hidden_dim=d["moe_hidden_dim"],
                num_experts=d["num_experts"], num_shared_experts=d["num_shared_experts"],
                router_top_k=d["top_k"], router_score_func="sigmoid",
                router_num_expert_groups=d["n_group"], router_num_limited_groups=d["topk_group"],
                router_route_scale=d["route_scale"], router_route_norm=d["route_norm"],
                attn_backend="flex", moe_comm_backend="standard",
                non_blocking_capacity_factor=None,
                rope=ComplexRoPE.Config(dim=d["qk_rope_head_dim"], max_seq_len=d["max_seq_len"],
                                        theta=d["theta"]),
            ),
            mtp_layers=[],
        )
        # the flavors' load_balance_coeff (1e-3): the expert_bias_E buffer the release's
        # e_score_correction_bias fills
        for _fqn, moe, _parent, _attr in model.traverse(MoE.Config):
            assert moe.load_balance_coeff is not None, _fqn
        spec = ModelSpec(name="deepseek_v3", flavor="imported", model=model,
                         parallelize_fn=parallelize_deepseekv3, pipelining_fn=pipeline_llm,
                         post_optimizer_build_fn=register_moe_load_balancing_hook,
                         state_dict_adapter=DeepSeekV3StateDictAdapter)
    else:  # qwen3_moe, as torchtitan's qwen3 "debugmodel_moe" / "30B-A3B" flavors
        from torchtitan.components.optimizer import register_moe_load_balancing_hook
        from torchtitan.models.common import CosSinRoPE
        from torchtitan.models.qwen3 import (
            _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm,
            parallelize_qwen3,
        )
        from torchtitan.models.qwen3.model import Qwen3Model
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        assert not d["tied"]
        model = Qwen3Model.Config(
            vocab_size=V, dim=d["dim"], norm=_qwen3_norm(d["dim"]),
            tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=d["dim"],
                                            param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=d["dim"], out_features=V, param_init=_LINEAR_INIT),
            layers=_build_qwen3_moe_layers(
                fuse_qkv=True, n_layers=d["n_layers"], dim=d["dim"], n_heads=d["n_heads"],
                n_kv_heads=d["n_kv_heads"], head_dim=d["head_dim"],
                moe_hidden_dim=d["moe_hidden_dim"], num_experts=d["num_experts"],
                top_k=d["top_k"], attn_backend="flex", moe_comm_backend="standard",
                rope=CosSinRoPE.Config(dim=d["head_dim"], max_seq_len=d["max_seq_len"],
                                       theta=d["theta"]),
            ),
        )
        spec = ModelSpec(name="qwen3", flavor="imported_moe", model=model,
                         parallelize_fn=parallelize_qwen3, pipelining_fn=pipeline_llm,
                         post_optimizer_build_fn=register_moe_load_balancing_hook,
                         state_dict_adapter=Qwen3StateDictAdapter)

    # every RMSNorm at the release's eps (torchtitan's Llama 3 norms default to 1e-5, Qwen3's 1e-6),
    # but DeepSeek-V3's q_a_layernorm / kv_a_layernorm, which transformers builds at 1e-6 whatever
    # rms_norm_eps says
    for fqn, norm, _parent, _attr in spec.model.traverse(RMSNorm.Config):
        latent = fqn.endswith(("attention.q_norm", "attention.kv_norm"))
        norm.eps = 1e-6 if d["arch"] == "deepseek_v3" and latent else d["eps"]
    # FlexAttention has no CPU backward: torchtitan's SDPA inner attention instead (causal)
    for _fqn, _cfg, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())

    dcp_dir = Path(job["dcp"]).resolve()
    ckpt_kwargs = dict(enable=True, folder="checkpoint", interval=1000, load_only=True)
    if job["how"] == "initial_load_path":
        ckpt_kwargs.update(initial_load_path=str(dcp_dir), initial_load_model_only=True,
                           initial_load_in_hf=False)
    else:
        assert job["how"] == "step-0", job["how"]
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.copytree(dcp_dir, work / "outputs" / "checkpoint" / "step-0")

    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(release),
        dump_folder="./outputs",
        loss=CrossEntropyLoss.Config(global_vocab_size=V),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=1, decay_ratio=None,
                                                  decay_type="linear", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=2, seq_len=SEQ, steps=1,
                                mixed_precision_param="float32", disable_cuda_graphs=True),
        dataloader=FixedTokensDataLoader.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1),
        checkpoint=CheckpointManager.Config(**ckpt_kwargs),
        activation_checkpoint=None,
        debug=DebugConfig(seed=42, enable_structured_logging=False),
    )
    trainer = config.build()
    assert dist.get_world_size() == 2
    if job["how"] == "step-0":
        dist.barrier()  # rank 0's copy is in place before any rank looks for step-0

    # What torchtitan's CheckpointManager will ask DCP for (a model-only load: exactly the model
    # wrapper's state dict, `_states_to_load(model_only=True)`) against what OUT's .metadata holds,
    # written before the load so that a failing load is explained key by key.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    held = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    wanted = trainer.checkpointer.states["model"].state_dict()
    report = {"missing": sorted(set(wanted) - set(held)),
              "unexpected": sorted(set(held) - set(wanted)), "mismatched": [], "dtypes": {}}
    for k in sorted(set(wanted) & set(held)):
        w, h = wanted[k], held[k]
        if not isinstance(h, TensorStorageMetadata):
            report["mismatched"].append(f"{k}: torchtitan a tensor, OUT bytes")
            continue
        if list(w.shape) != list(h.size):
            report["mismatched"].append(f"{k}: torchtitan {list(w.shape)}, OUT {list(h.size)}")
        report["dtypes"][k] = [str(w.dtype), str(h.properties.dtype)]
    report["torchtitan"] = {k: [str(v.dtype), list(v.shape)] for k, v in wanted.items()}
    if dist.get_rank() == 0:
        Path(job["report"]).write_text(json.dumps(report, indent=1) + "\n")

    model_part = trainer.model_parts[0]
    n_fsdp = 0
    for m in model_part.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            n_fsdp += 1
    assert n_fsdp > 0, "no FSDP module"

    losses = []
    log_metrics = trainer.metrics_processor.log

    def log_and_keep(step, loss, *args, **kwargs):
        losses.append(float(loss))
        return log_metrics(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = log_and_keep

    ids = torch.tensor(job["input_ids"], dtype=torch.int64)
    got = {}
    loads = []
    checkpointer_load = trainer.checkpointer.load

    def load_and_note(*args, **kwargs):
        loaded = checkpointer_load(*args, **kwargs)
        loads.append(loaded)
        return loaded

    trainer.checkpointer.load = load_and_note
    train_step = trainer.train_step

    def forward_then_train_step(data_iterator):
        if not got:
            assert loads == [True], f"the checkpointer did not load a checkpoint: {loads}"
            model_part.eval()
            as_trained = None
            if d["arch"] in ("qwen3_moe", "deepseek_v3"):
                from torchtitan.models.common.moe import GroupedExperts

                # the routed experts in F32 (torchtitan's GroupedExperts runs them in bf16)
                as_trained = GroupedExperts.forward.__code__
                GroupedExperts.forward.__code__ = gen.f32_experts.__code__
                got["expert_bias_E"] = torch.stack(
                    [m.expert_bias_E.detach().clone() for m in model_part.modules()
                     if isinstance(m, MoE)])
            with torch.no_grad():
                out = model_part(ids)
            if isinstance(out, DTensor):
                out = out.full_tensor()
            got["logits"] = out.float().contiguous()
            if as_trained is not None:
                GroupedExperts.forward.__code__ = as_trained
            model_part.train()
        return train_step(data_iterator)

    trainer.train_step = forward_then_train_step
    trainer.train()
    trainer.close()
    assert len(losses) == 1, losses
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        got["loss"] = torch.tensor(losses, dtype=torch.float32)
        save_file(got, job["result"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
