"""`consolidate --hf-config` hands transformers a model directory it loads as is: small
transformers models built with a fixed seed, saved by torch's DCP as an app state (accelerate's
`model.` prefix beside an optimizer) and as torchtitan names it (top level, wq/wk rows in
torchtitan's interleaved RoPE order for Llama, beside `optimizer.*`, `lr_scheduler.*`,
`train_state.*`), exported by ckpt, then loaded with `from_pretrained`: the logits are the
original model's, and both sources give the same bytes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import run_ckpt

transformers = pytest.importorskip("transformers")

VOCAB = 96


def small_config(arch: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # Not hidden / heads (8): the export must use the config's head_dim.
        head_dim=16,
        max_position_embeddings=64,
    )
    if arch == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **common)
    if arch == "qwen2":
        common.pop("head_dim")
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    return transformers.Qwen3Config(tie_word_embeddings=True, **common)


MODELS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def build(arch: str):
    torch.manual_seed(0)
    cfg = small_config(arch)
    model = getattr(transformers, MODELS[arch])(cfg).eval()
    # Random norms and biases too, so a misplaced one shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
    return model


INPUT_IDS = torch.tensor([[1, 5, 9, 13, 2, 7, 40, 41], [3, 3, 8, 60, 95, 0, 11, 12]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def hf_dir(model, path):
    """The model directory training starts from: config, generation config, tokenizer files."""
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel"}}')
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return path


def optimizer_state(sd: dict, prefix: str) -> dict:
    return {f"{prefix}{k}": torch.full_like(v, 0.25) for k, v in sd.items()}


def save_accelerate(model, path):
    """An app state as accelerate's FSDP SHARDED_STATE_DICT saves it: `model.` + HF names."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {"model": sd, "optimizer": {"state": optimizer_state(sd, "")}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def tt_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's `Llama3StateDictAdapter._reverse_permute`: HF rows to torchtitan's."""
    dim1, dim2 = w.shape
    return w.view(heads, 2, dim1 // heads // 2, dim2).transpose(1, 2).reshape(dim1, dim2)


TT_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def save_torchtitan(model, arch: str, path):
    """The same model as torchtitan 0.3's CheckpointManager lays it out: model at the top level
    under torchtitan's names (Llama's wq/wk rows permuted as its complex RoPE wants them), beside
    the optimizer, scheduler, dataloader and train state."""
    cfg = model.config
    sd = {}
    for name, v in model.state_dict().items():
        parts = name.split(".")
        key = name
        if len(parts) > 2 and parts[1] == "layers":
            layer = parts[2]
            key = ".".join(parts[:2] + ["{}"] + parts[3:])
        tt = TT_NAMES[key].replace("{}", layer) if "{}" in key else TT_NAMES[key]
        v = v.detach().clone()
        if arch == "llama" and tt.endswith("wq.weight"):
            v = tt_from_hf(v, cfg.num_attention_heads)
        if arch == "llama" and tt.endswith("wk.weight"):
            v = tt_from_hf(v, cfg.num_key_value_heads)
        sd[tt] = v
    state = dict(sd)
    state.update(optimizer_state(sd, "optimizer.state."))
    state["lr_scheduler.last_epoch"] = torch.tensor(2)
    state["train_state"] = {"step": 2, "ntokens_seen": 1024}
    state["dataloader"] = {"world_size": 2}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def tensors_of(out) -> dict:
    files = sorted(out.glob("*.safetensors"))
    got = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            assert st.metadata() == {"format": "pt"}, f
            for k in st.keys():
                got[k] = st.get_tensor(k)
    return got


def export(src, hf, out, *extra):
    r = run_ckpt("consolidate", src, "-o", out, "--hf-config", hf, *extra)
    assert r.returncode == 0, r.stderr
    return out


def assert_same_logits(out, want: torch.Tensor):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    got = logits(loaded)
    tol = 1e-4 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_accelerate_dcp_exports_to_the_same_model(tmp_path, arch):
    model = build(arch)
    want = logits(model)
    hf = hf_dir(model, tmp_path / "hf")
    save_accelerate(model, tmp_path / "dcp")
    out = export(tmp_path / "dcp", hf, tmp_path / "out")
    assert_same_logits(out, want)
    got = tensors_of(out)
    sd = model.state_dict()
    tied = model.config.tie_word_embeddings
    assert set(got) == {k for k in sd if not (tied and k == "lm_head.weight")}
    for k, v in got.items():
        assert torch.equal(v, sd[k]), k
    # config.json is transformers' own with the dtype written; the other files as they were.
    cfg = json.loads((out / "config.json").read_text())
    src = json.loads((hf / "config.json").read_text())
    field = "dtype" if "dtype" in src else "torch_dtype"
    assert cfg[field] == "float32"
    assert {k: v for k, v in cfg.items() if k != field} == {k: v for k, v in src.items() if k != field}
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert (out / f).read_bytes() == (hf / f).read_bytes(), f


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torchtitan_names_export_to_the_same_bytes(tmp_path, arch):
    model = build(arch)
    want = logits(model)
    hf = hf_dir(model, tmp_path / "hf")
    save_accelerate(model, tmp_path / "acc")
    save_torchtitan(model, arch, tmp_path / "tt")
    a = tensors_of(export(tmp_path / "acc", hf, tmp_path / "from_acc"))
    b = tensors_of(export(tmp_path / "tt", hf, tmp_path / "from_tt"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert_same_logits(tmp_path / "from_tt", want)


def test_bf16_export_is_torch_cast_and_names_the_dtype(tmp_path):
    model = build("llama")
    hf = hf_dir(model, tmp_path / "hf")
    save_torchtitan(model, "llama", tmp_path / "tt")
    out = export(tmp_path / "tt", hf, tmp_path / "out", "--dtype", "bf16", "--max-shard-size", "40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = tensors_of(out)
    sd = model.state_dict()
    for k, v in got.items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, sd[k].to(torch.bfloat16)), k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.dtype == torch.bfloat16


def test_wrong_config_exits_2_and_writes_nothing(tmp_path):
    model = build("llama")
    hf = hf_dir(model, tmp_path / "hf")
    save_torchtitan(model, "llama", tmp_path / "tt")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (hf / "config.json").write_text(json.dumps(cfg))
    r = run_ckpt("consolidate", tmp_path / "tt", "-o", tmp_path / "out", "--hf-config", hf)
    assert r.returncode == 2, r.stderr
    assert "num_key_value_heads" in r.stderr and "layers.0.attention.qkv_linear.wk.weight" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tt"]


def test_export_to_and_from_s3_is_the_local_export(tmp_path):
    """An object-store output is uploaded as a local run writes it, config and tokenizer too; a
    checkpoint read from object storage (its small items opened when copied, so the views'
    strides apply to each item's elements) exports to the same files."""
    pytest.importorskip("boto3")
    import test_s3  # a module object, so that its tests are not collected here again

    model = build("llama")
    hf = hf_dir(model, tmp_path / "hf")
    save_torchtitan(model, "llama", tmp_path / "tt")
    local = export(tmp_path / "tt", hf, tmp_path / "local", "--max-shard-size", "40KB")
    server = test_s3.S3Server()
    try:
        client = server.client()
        client.create_bucket(Bucket="ckpt")
        r = test_s3.run(server, "consolidate", tmp_path / "tt", "-o", "s3://ckpt/out",
                        "--hf-config", hf, "--max-shard-size", "40KB")
        assert r.returncode == 0, r.stderr
        got = tmp_path / "got"
        got.mkdir()
        test_s3.download_tree(client, "ckpt", "out", got)
        test_s3.same_tree(local, got)
        test_s3.upload_tree(client, tmp_path / "tt", "ckpt", "tt")
        r = test_s3.run(server, "consolidate", "s3://ckpt/tt", "-o", tmp_path / "from_s3",
                        "--hf-config", hf, "--max-shard-size", "40KB")
        assert r.returncode == 0, r.stderr
        test_s3.same_tree(local, tmp_path / "from_s3")
    finally:
        server.stop()


TT_DEEPSEEK_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.q_a_proj.weight": "layers.{}.attention.wq_a.weight",
    "model.layers.{}.self_attn.q_a_layernorm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.q_b_proj.weight": "layers.{}.attention.wq_b.weight",
    "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight": "layers.{}.attention.wkv_a.weight",
    "model.layers.{}.self_attn.kv_a_layernorm.weight": "layers.{}.attention.kv_norm.weight",
    "model.layers.{}.self_attn.kv_b_proj.weight": "layers.{}.attention.wkv_b.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.expert_bias_E",
    "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.moe.shared_experts.w1.weight",
    "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.moe.shared_experts.w3.weight",
    "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.moe.shared_experts.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
TT_EXPERTS = {"gate_proj": "w1_EFD", "up_proj": "w3_EFD", "down_proj": "w2_EDF"}


def build_deepseek(q_lora_rank):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
        topk_group=1, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or name.endswith("bias"):
                t.copy_(torch.randn_like(t) * 0.5 + 1.0)
    return model


def save_torchtitan_deepseek(per_expert: dict, layers: int, path):
    """torchtitan 0.3's layout of DeepSeek-V3 (its `from_hf`): routed experts stacked on a leading
    axis, model at the top level beside the training state and a multi-token prediction layer."""
    sd = {}
    experts: dict = {}
    for name, v in per_expert.items():
        parts = name.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            layer, e, proj = parts[2], int(parts[5]), parts[6]
            experts.setdefault((layer, proj), {})[e] = v
            continue
        key, layer = name, None
        if len(parts) > 2 and parts[1] == "layers":
            layer = parts[2]
            key = ".".join(parts[:2] + ["{}"] + parts[3:])
        sd[TT_DEEPSEEK_NAMES[key].replace("{}", layer or "")] = v.clone()
    for (layer, proj), by_e in experts.items():
        stacked = torch.stack([by_e[e] for e in sorted(by_e)])
        sd[f"layers.{layer}.moe.routed_experts.inner_experts.{TT_EXPERTS[proj]}"] = stacked
    state = dict(sd)
    state.update(optimizer_state(sd, "optimizer.state."))
    state["mtp_layers.0.enorm.weight"] = torch.ones(32)
    state["train_state"] = {"step": 2}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_deepseek_v3_exports_as_transformers_saves_it(tmp_path, q_lora_rank):
    """transformers' own save_pretrained (one tensor per routed expert) is the reference, for
    torchtitan's layout and for transformers' in-memory names saved by accelerate."""
    model = build_deepseek(q_lora_rank)
    want = logits(model)
    ref = tmp_path / "ref"
    model.save_pretrained(ref)
    reference = tensors_of(ref)
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in ref.iterdir():
        if f.suffix == ".json":
            (hf / f.name).write_bytes(f.read_bytes())
    save_torchtitan_deepseek(reference, model.config.num_hidden_layers, tmp_path / "tt")
    r = run_ckpt("inspect", tmp_path / "tt", "--hf-config", hf, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["naming"] == "torchtitan"
    assert "mtp_layers.0.enorm.weight" in {x["name"] for x in doc["left_out"]}
    got = tensors_of(export(tmp_path / "tt", hf, tmp_path / "out"))
    assert set(got) == set(reference)
    for k in got:
        assert torch.equal(got[k], reference[k]), k
    assert_same_logits(tmp_path / "out", want)
    # An accelerate app state holds transformers' in-memory names: the experts fused
    # (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]).
    assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    save_accelerate(model, tmp_path / "acc")
    got = tensors_of(export(tmp_path / "acc", hf, tmp_path / "from_acc"))
    assert set(got) == set(reference)
    for k in got:
        assert torch.equal(got[k], reference[k]), k


@pytest.mark.parametrize("style,tp,optimizer", [
    ("llama", 2, None),
    ("llama", 1, "plain"),
    ("llama", 2, "distributed"),
    ("qwen2", 2, "distributed"),
    ("qwen3", 2, "plain"),
])
def test_megatron_gpt_exports_to_its_own_logits(tmp_path, style, tp, optimizer):
    """A megatron-core GPTModel saved by dist_checkpointing (layer-stacked weights, fused QKV per
    query group, [gate; up], a padded vocabulary; with TP=2 each cut over the ranks) gives, through
    the export, a model whose `from_pretrained` logits are Megatron's own forward's. With an
    optimizer, trained two steps by Megatron's Adam and saved as Megatron-LM's `save_checkpoint`
    saves (megatron_gpt_save.py): the save root followed to its iteration, and the optimizer's
    state read and left out of the export: the DistributedOptimizer's per-bucket flat tensors
    (its fp32 `param` copy among them), or the plain optimizer's `optimizer.state.exp_avg.<model
    key>` (a model tensor's suffix and shape) and its `common_step` tensor in common.pt. The
    Qwen2-style model trains in bf16 (Megatron's fp32 main params in the optimizer). Every export
    equals Megatron-Bridge's mapping of the same checkpoint bit for bit."""
    pytest.importorskip("megatron.core")
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "megatron_gpt_save.py"
    launch = [sys.executable]
    if tp > 1:
        launch = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={tp}"]
    r = subprocess.run([*launch, str(script), style, str(tmp_path), *([optimizer] if optimizer else [])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    src = tmp_path / "ckpt"
    if optimizer:
        assert (src / "latest_checkpointed_iteration.txt").read_text() == "2"
        r = run_ckpt("inspect", src, "--json")
        assert r.returncode == 0, r.stderr
        tensors = {t["name"]: t for t in json.loads(r.stdout)["tensors"]}
        state = [n for n in tensors if n.startswith("optimizer.")]
        if optimizer == "distributed":
            assert {n.rsplit(".", 1)[1] for n in state} == {"param", "exp_avg", "exp_avg_sq"}
            assert all(".bucket_idx_" in n for n in state)
        else:
            # torch's Adam keeps `step` as a float tensor
            assert tensors["optimizer.state.common_step"]["shape"] == []
            trap = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
            assert tensors[trap]["shape"] == tensors["embedding.word_embeddings.weight"]["shape"]
        r = run_ckpt("inspect", src, "--hf-config", tmp_path / "hf")
        assert r.returncode == 0, r.stderr
        # (names may hold spaces: "dtype_(torch.float32, torch.float32)")
        left_out = {line.strip().removesuffix("training state").strip()
                    for line in r.stdout.splitlines() if line.strip().endswith("training state")}
        assert set(state) <= left_out, set(state) - left_out
    out = export(src, tmp_path / "hf", tmp_path / "out")
    got = tensors_of(out)
    # Megatron-Bridge's own mapping of the same checkpoint (megatron_bridge_export.py): the same
    # names, and every tensor bit for bit.
    bridge = tmp_path / "bridge.safetensors"
    iteration = src / "iter_0000002" if optimizer else src
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_bridge_export.py"),
                        str(iteration), str(tmp_path / "hf" / "config.json"), str(bridge)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = load_file(str(bridge))
    assert set(got) == set(reference)
    for k in got:
        assert torch.equal(got[k], reference[k]), k
    want = torch.load(tmp_path / "logits.pt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = loaded(input_ids=want["input_ids"]).logits
    tol = 1e-4 * want["logits"].abs().max().item()
    assert (got - want["logits"]).abs().max().item() <= tol
