"""`ckpt reshard REL -o OUT --format torchtitan --world-size 3`: a Hugging Face release imported as
the initial checkpoint of a torchtitan 0.3.0 run, held to what torchtitan itself does with it.

For each case a tiny release is written here by transformers itself (`save_pretrained` in several
files with an index, plus a word-level tokenizer, which torchtitan's Trainer reads from its
`hf_assets_path`) from a config whose dims a torchtitan model matches; every weight is drawn anew
(norms around 1, linears of unit gain) so that no wrong row order, norm or expert can hide in the
logits:

- `llama3`: LlamaForCausalLM, dim 192, 6 heads of 32, 2 KV heads, FFN 328, vocab 260, untied,
  `rope_parameters` Llama 3.1 scaling (factor 8, low 1, high 4, original 8192, theta 500000), as
  torchtitan's ComplexRoPE "llama" scaling defaults; wq/wk rows go to torchtitan's interleaved
  RoPE order (the inverse of `HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i + j]`).
- `qwen3`: Qwen3ForCausalLM, dim 200, 4 heads of 48, 2 KV heads, FFN 344, vocab 258, tied (as
  Qwen3's small releases), q/k norms, no permutation. torchtitan's tied model saves (and asks a
  load for) `lm_head.weight` beside `tok_embeddings.weight`, the one parameter under both names
  (fixtures/torchtitan_qwen3's own checkpoint holds both). Vocab 258 is even: over 2 FSDP2 ranks
  the tied embedding needs no padding (fixtures/README.md: torchtitan 0.3.0's re-tie bug).
- `qwen3_moe`: Qwen3MoeForCausalLM, dim 200, 3 heads of 64, 1 KV head, 4 experts of 168, top 2
  renormalised, every layer sparse (`decoder_sparse_step` 1, `mlp_only_layers` []), vocab 262,
  untied; torchtitan's qwen3 MoE flavors (`_build_qwen3_moe_layers`), experts stacked
  (`w1_EFD` [E, F, D], ...), and their `load_balance_coeff` 1e-3: a persistent `moe.expert_bias_E`
  buffer (F32 [E], zeros at init) that HF's Qwen3-MoE has no place for and a torchtitan load asks
  for; zeros are the bias that routes as the release does.
- `deepseek_v3`: DeepseekV3ForCausalLM, dim 200, 3 heads, latent attention with `q_lora_rank` 152
  (wq_a, q_norm, wq_b), `kv_lora_rank` 144, qk 48 + 24 RoPE dims, v 56; 3 layers, the first dense
  (`first_k_dense_replace` 1, FFN 344), the others 8 routed experts of 168 (4 groups, 2 kept, top
  3, sigmoid scores renormalised and scaled by 2.5) and 2 shared (one MLP of 336), vocab 266,
  untied, no MTP layer (`num_nextn_predict_layers` 0: torchtitan's names have no place for one),
  RMSNorm eps 1e-6 (transformers fixes q_a/kv_a_layernorm's at 1e-6 whatever `rms_norm_eps` says),
  plain RoPE (theta 10000, `rope_interleave` as DeepSeek's weights: torchtitan's ComplexRoPE pairs
  the same adjacent elements, so no row moves). Its `e_score_correction_bias` (a buffer, zeros
  at init) is drawn too (0.2 x randn a layer, enough to change which experts the logits see); it
  is torchtitan's `moe.expert_bias_E`, which only chooses experts, as in transformers.

Every dim over 128 and not a multiple of 128 (and a multiple of 8 where torch._grouped_mm runs),
but the per-head dims of DeepSeek-V3's latent attention; `--world-size 3` cuts them unevenly
(vocab 260 as 87/87/86, 4 experts as 2/2/0, 8 as 3/3/2).

Tests:
- no torchtitan: OUT holds the release's tensors bit for bit under torchtitan 0.3.0's names (the
  map written out here, independently of ckpt), and `ckpt consolidate OUT -o BACK --hf-config REL`
  gives every release tensor back bit for bit, and no other.
- torchtitan (tests/interop/torchtitan_import_load.py under torchrun, 2 gloo ranks, FSDP2):
  torchtitan's own Trainer and CheckpointManager start a run from OUT with
  `checkpoint.initial_load_path=OUT`, `initial_load_model_only=True`, `initial_load_in_hf=False`
  (and, for Llama 3 with `--dtype bf16`, OUT placed as `checkpoint/step-0`, torchtitan's seed
  checkpoint place); the keys that load asks for are exactly OUT's, same shapes; the loaded
  model's forward (F32, eval) on a fixed batch equals transformers' of the release within 1e-4
  of the largest |logit| (bf16: of the release rounded to bf16); then one training step runs
  with a finite loss. For the MoE cases the loaded `moe.expert_bias_E` of every MoE layer is
  the release's (zeros for Qwen3-MoE, `e_score_correction_bias` for DeepSeek-V3).
- the criterion decides: transformers' logits with Llama's q/k rows left in HF's order, or with
  DeepSeek-V3's routing bias zeroed (torchtitan's init), are off by far more than 1e-4.

fixtures/generate_torchtitan.py builds HF configs from torchtitan dims; the worker's `tt_dims`
reads them back the same way, and borrows its CPU shims and `f32_experts` (torchtitan's
GroupedExperts runs the routed experts in bf16; the comparison is of the F32 forward).
About 2.5 minutes (5 torchtitan runs of about 25 s on 2 CPU cores).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_helpers import REPO, bitwise_equal, load_with_torch, run_torchrun

WORKER = Path(__file__).resolve().parent / "torchtitan_import_load.py"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "generate_torchtitan", REPO / "fixtures" / "generate_torchtitan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()
CASES = ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"]


def hf_config(case: str):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(num_hidden_layers=2, bos_token_id=1, eos_token_id=2, dtype="float32")
    if case == "llama3":
        s = GEN.DIMS["llama3"]["scaling"]  # torchtitan's ComplexRoPE "llama" defaults (3.1)
        return LlamaConfig(
            vocab_size=260, hidden_size=192, intermediate_size=328, num_attention_heads=6,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
            max_position_embeddings=131072, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **s},
            architectures=["LlamaForCausalLM"], **common)
    if case == "qwen3":
        return Qwen3Config(
            vocab_size=258, hidden_size=200, intermediate_size=344, num_attention_heads=4,
            num_key_value_heads=2, head_dim=48, rms_norm_eps=1e-6, max_position_embeddings=4096,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            architectures=["Qwen3ForCausalLM"], **common)
    if case == "deepseek_v3":
        return DeepseekV3Config(
            vocab_size=266, hidden_size=200, intermediate_size=344, moe_intermediate_size=168,
            num_attention_heads=3, num_key_value_heads=3, q_lora_rank=152, kv_lora_rank=144,
            qk_nope_head_dim=48, qk_rope_head_dim=24, v_head_dim=56, attention_bias=False,
            first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
            num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
            routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_interleave=True, num_nextn_predict_layers=0, tie_word_embeddings=False,
            architectures=["DeepseekV3ForCausalLM"], **{**common, "num_hidden_layers": 3})
    assert case == "qwen3_moe"
    return Qwen3MoeConfig(
        vocab_size=262, hidden_size=200,
        intermediate_size=168,  # the dense MLP's: unused, every layer sparse
        moe_intermediate_size=168, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        architectures=["Qwen3MoeForCausalLM"], **common)


def write_tokenizer(rel: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the vocab, as fixtures/generate_torchtitan.py's write_hf_dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            bos_token="<|begin_of_text|>",
                            eos_token="<|end_of_text|>").save_pretrained(rel)


def write_release(case: str, rel: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = hf_config(case)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(CASES.index(case))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights (these architectures have no biases)
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # unit gain over the input dim (the last), embeddings and experts too
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias (F32)
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    model.save_pretrained(rel, max_shard_size="300KB")
    write_tokenizer(rel, cfg.vocab_size)
    index = json.loads((rel / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3, "the release is not split"


_RELEASES: dict[str, Path] = {}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    def get(case: str) -> Path:
        if case not in _RELEASES:
            rel = tmp_path_factory.mktemp(f"release_{case}")
            write_release(case, rel)
            _RELEASES[case] = rel
        return _RELEASES[case]

    return get


def release_tensors(rel: Path) -> dict[str, torch.Tensor]:
    return load_with_torch(rel)  # checks the index against the files


def reshard(run_ckpt, rel: Path, out: Path, *extra) -> Path:
    proc = run_ckpt("reshard", rel, "-o", out, "--format", "torchtitan", "--world-size", "3", *extra)
    assert proc.returncode == 0, f"ckpt reshard --format torchtitan exited {proc.returncode}:\n{proc.stderr}"
    assert (out / ".metadata").is_file()
    assert sorted(p.name for p in out.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    return out


def input_ids(vocab: int) -> torch.Tensor:
    return torch.tensor(GEN.LOGIT_IDS, dtype=torch.int64) % vocab


def transformers_logits(rel: Path, ids: torch.Tensor, *, bf16_weights: bool = False) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rel, dtype=torch.float32).eval()
    with torch.no_grad():
        if bf16_weights:
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        return model(ids).logits.float()


# ------------------------------------------------------------------------------------------------
# torchtitan 0.3.0's names, written out here (not ckpt's tables)


def to_torchtitan_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half rows of q/k into torchtitan's interleaved order: the inverse of
    HF[h*hd + j*hd/2 + i] = TT[h*hd + 2i + j]."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def expected_torchtitan(case: str, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cfg = hf_config(case)
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        # a tied torchtitan model holds (and saves, and loads) the embedding as lm_head.weight too
        "lm_head.weight": hf["lm_head.weight"] if not cfg.tie_word_embeddings
        else hf["model.embed_tokens.weight"],
    }
    if case == "deepseek_v3":
        return out | expected_deepseek_v3(cfg, hf)
    for n in range(cfg.num_hidden_layers):
        p, t = f"model.layers.{n}.", f"layers.{n}."
        q, k = hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"]
        if case == "llama3":
            q, k = to_torchtitan_rows(q, n_heads), to_torchtitan_rows(k, n_kv)
        out[t + "attention.qkv_linear.wq.weight"] = q
        out[t + "attention.qkv_linear.wk.weight"] = k
        out[t + "attention.qkv_linear.wv.weight"] = hf[p + "self_attn.v_proj.weight"]
        out[t + "attention.wo.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[t + "attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[t + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        if case != "llama3":
            out[t + "attention.q_norm.weight"] = hf[p + "self_attn.q_norm.weight"]
            out[t + "attention.k_norm.weight"] = hf[p + "self_attn.k_norm.weight"]
        if case == "qwen3_moe":
            E = cfg.num_experts
            ex = p + "mlp.experts.{}.{}.weight"
            inner = t + "moe.routed_experts.inner_experts."
            out[t + "moe.router.gate.weight"] = hf[p + "mlp.gate.weight"]
            out[inner + "w1_EFD"] = torch.stack([hf[ex.format(e, "gate_proj")] for e in range(E)])
            out[inner + "w3_EFD"] = torch.stack([hf[ex.format(e, "up_proj")] for e in range(E)])
            out[inner + "w2_EDF"] = torch.stack([hf[ex.format(e, "down_proj")] for e in range(E)])
            # the flavors' load-balancing bias: F32 zeros, torchtitan's init, routing as HF does
            out[t + "moe.expert_bias_E"] = torch.zeros(E, dtype=torch.float32)
        else:
            out[t + "feed_forward.w1.weight"] = hf[p + "mlp.gate_proj.weight"]
            out[t + "feed_forward.w3.weight"] = hf[p + "mlp.up_proj.weight"]
            out[t + "feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


def expected_deepseek_v3(cfg, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan 0.3.0's DeepSeekV3StateDictAdapter names (q_lora_rank > 0), no row moved."""
    out = {}
    for n in range(cfg.num_hidden_layers):
        p, t = f"model.layers.{n}.", f"layers.{n}."
        a = p + "self_attn."
        out |= {
            t + "attention.wq_a.weight": hf[a + "q_a_proj.weight"],
            t + "attention.q_norm.weight": hf[a + "q_a_layernorm.weight"],
            t + "attention.wq_b.weight": hf[a + "q_b_proj.weight"],
            t + "attention.wkv_a.weight": hf[a + "kv_a_proj_with_mqa.weight"],
            t + "attention.kv_norm.weight": hf[a + "kv_a_layernorm.weight"],
            t + "attention.wkv_b.weight": hf[a + "kv_b_proj.weight"],
            t + "attention.wo.weight": hf[a + "o_proj.weight"],
            t + "attention_norm.weight": hf[p + "input_layernorm.weight"],
            t + "ffn_norm.weight": hf[p + "post_attention_layernorm.weight"],
        }
        if n < cfg.first_k_dense_replace:
            out[t + "feed_forward.w1.weight"] = hf[p + "mlp.gate_proj.weight"]
            out[t + "feed_forward.w3.weight"] = hf[p + "mlp.up_proj.weight"]
            out[t + "feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
            continue
        E = cfg.n_routed_experts
        ex = p + "mlp.experts.{}.{}.weight"
        inner = t + "moe.routed_experts.inner_experts."
        out |= {
            t + "moe.router.gate.weight": hf[p + "mlp.gate.weight"],
            # the routing bias: torchtitan's load-balancing expert_bias_E is the same term
            t + "moe.expert_bias_E": hf[p + "mlp.gate.e_score_correction_bias"],
            inner + "w1_EFD": torch.stack([hf[ex.format(e, "gate_proj")] for e in range(E)]),
            inner + "w3_EFD": torch.stack([hf[ex.format(e, "up_proj")] for e in range(E)]),
            inner + "w2_EDF": torch.stack([hf[ex.format(e, "down_proj")] for e in range(E)]),
            t + "moe.shared_experts.w1.weight": hf[p + "mlp.shared_experts.gate_proj.weight"],
            t + "moe.shared_experts.w3.weight": hf[p + "mlp.shared_experts.up_proj.weight"],
            t + "moe.shared_experts.w2.weight": hf[p + "mlp.shared_experts.down_proj.weight"],
        }
    return out


def read_back(back: Path) -> dict[str, torch.Tensor]:
    index = back / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    got = {}
    for f in files:
        with safe_open(back / f, framework="pt") as sf:
            for k in sf.keys():
                assert k not in got, f"{k} in two files"
                got[k] = sf.get_tensor(k)
    return got


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not unexpected, f"{what}: missing {missing}, unexpected {unexpected}"
    bad = [f"{k}: {got[k].dtype} {list(got[k].shape)} vs {want[k].dtype} {list(want[k].shape)}"
           for k in want if not bitwise_equal(got[k], want[k])]
    assert not bad, f"{what}: differ at {bad}"


# ------------------------------------------------------------------------------------------------
# no torchtitan


@pytest.mark.parametrize("case", CASES)
def test_import_holds_the_release_under_torchtitan_names(run_ckpt, release, tmp_path, case):
    rel = release(case)
    out = reshard(run_ckpt, rel, tmp_path / "out")
    assert_bitwise(load_with_torch(out), expected_torchtitan(case, release_tensors(rel)),
                   f"{case}: OUT (torch's DCP reader) against the release renamed")


@pytest.mark.parametrize("case", CASES)
def test_consolidate_gives_the_release_back_bit_for_bit(run_ckpt, release, tmp_path, case):
    rel = release(case)
    out = reshard(run_ckpt, rel, tmp_path / "out")
    proc = run_ckpt("consolidate", out, "-o", tmp_path / "back", "--hf-config", rel)
    assert proc.returncode == 0, f"ckpt consolidate --hf-config exited {proc.returncode}:\n{proc.stderr}"
    assert_bitwise(read_back(tmp_path / "back"), release_tensors(rel), f"{case}: BACK against REL")


# ------------------------------------------------------------------------------------------------
# torchtitan 0.3.0 starts a run from the import


def _torchtitan_reason() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return ("torchtitan is not installed (pip install --no-deps -r "
                "fixtures/requirements-torchtitan.txt)")
    from importlib.metadata import version

    if not version("torchtitan").startswith("0.3."):
        return f"torchtitan {version('torchtitan')}: the worker builds torchtitan 0.3's models"
    return None


needs_torchtitan = pytest.mark.skipif(_torchtitan_reason() is not None,
                                      reason=_torchtitan_reason() or "")

# (case, how torchtitan finds OUT, ckpt's --dtype)
RUNS = [
    ("llama3", "initial_load_path", None),
    ("qwen3", "initial_load_path", None),
    ("qwen3_moe", "initial_load_path", None),
    ("deepseek_v3", "initial_load_path", None),
    ("llama3", "step-0", "bf16"),
]


@needs_torchtitan
@pytest.mark.parametrize("case,how,dtype", RUNS, ids=[f"{c}-{h}" + (f"-{d}" if d else "")
                                                      for c, h, d in RUNS])
def test_torchtitan_starts_from_the_import(run_ckpt, release, tmp_path, case, how, dtype):
    rel = release(case)
    out = reshard(run_ckpt, rel, tmp_path / "out", *(["--dtype", dtype] if dtype else []))
    vocab = hf_config(case).vocab_size
    ids = input_ids(vocab)
    work = tmp_path / "work"
    work.mkdir()
    job = {"release": str(rel), "dcp": str(out), "work": str(work), "how": how,
           "input_ids": ids.tolist(), "result": str(tmp_path / "result.safetensors"),
           "report": str(tmp_path / "report.json")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = run_torchrun(WORKER, 2, tmp_path / "job.json", timeout=300)

    # what torchtitan's model-only load asks DCP for, against OUT's .metadata
    report_path = tmp_path / "report.json"
    assert report_path.exists(), (
        f"the worker failed before torchtitan's load ({proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    report = json.loads(report_path.read_text())
    tt = report["torchtitan"]
    assert not report["missing"] and not report["unexpected"] and not report["mismatched"], (
        f"{case}: OUT lacks {[(k, *tt[k]) for k in report['missing']]} (torchtitan's model "
        f"state dict: dtype, shape), holds keys torchtitan has not {report['unexpected']}, "
        f"shapes differ {report['mismatched']}")
    want_dtype = "torch.bfloat16" if dtype == "bf16" else "torch.float32"
    bad = {k: v for k, v in report["dtypes"].items() if v != ["torch.float32", want_dtype]}
    assert not bad, f"{case}: [torchtitan's dtype, OUT's] {bad}"

    assert proc.returncode == 0, (
        f"torchtitan's run from OUT failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-8000:]}")
    from safetensors.torch import load_file

    got = load_file(tmp_path / "result.safetensors")
    want = transformers_logits(rel, ids, bf16_weights=dtype == "bf16")
    assert got["logits"].shape == want.shape
    diff = (got["logits"] - want).abs().max().item()
    scale = want.abs().max().item()
    assert diff <= 1e-4 * scale, (
        f"{case}: torchtitan's logits of OUT differ from transformers' of the release by {diff} "
        f"(largest |logit| {scale})")
    loss = got["loss"]
    assert loss.numel() == 1 and math.isfinite(loss.item()), f"training step loss {loss.tolist()}"
    if case == "qwen3_moe":
        assert torch.equal(got["expert_bias_E"], torch.zeros_like(got["expert_bias_E"]))
    if case == "deepseek_v3":  # every MoE layer's, as loaded: the release's routing bias
        hf = release_tensors(rel)
        cfg = hf_config(case)
        want_bias = torch.stack([hf[f"model.layers.{n}.mlp.gate.e_score_correction_bias"]
                                 for n in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)])
        assert torch.equal(got["expert_bias_E"], want_bias), (got["expert_bias_E"], want_bias)
    print(f"{case} ({how}{', ' + dtype if dtype else ''}): logits within {diff / scale:.2e} of "
          f"the largest |logit| {scale:.3f}; step 1 loss {loss.item():.4f}")


def test_llama3_logits_see_the_rope_rows(release):
    """The 1e-4 criterion decides the RoPE permutation: transformers' logits with q/k rows in the
    wrong order (what torchtitan would compute had ckpt left HF's rows unpermuted) are far off."""
    rel = release("llama3")
    cfg = hf_config("llama3")
    ids = input_ids(cfg.vocab_size)
    want = transformers_logits(rel, ids)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rel, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            # torchtitan reading HF rows as interleaved = HF with rows taken by the forward map
            for proj, heads in ((att.q_proj, cfg.num_attention_heads),
                                (att.k_proj, cfg.num_key_value_heads)):
                w = proj.weight.detach().clone()
                hd = w.shape[0] // heads
                proj.weight.copy_(w.reshape(heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape))
        wrong = model(ids).logits
    rel_diff = ((wrong - want).abs().max() / want.abs().max()).item()
    assert rel_diff > 1e-2, f"unpermuted rows change the logits by only {rel_diff:.2e}"
    print(f"q/k rows left in HF's order: logits off by {rel_diff:.2e} of the largest |logit|")


def test_deepseek_v3_logits_see_the_routing_bias(release):
    """The 1e-4 criterion decides DeepSeek-V3's routing bias: transformers' logits with
    `e_score_correction_bias` zeroed (what torchtitan would compute had the import left
    `moe.expert_bias_E` at torchtitan's zeros) are far off, and the experts chosen differ."""
    rel = release("deepseek_v3")
    ids = input_ids(hf_config("deepseek_v3").vocab_size)
    want = transformers_logits(rel, ids)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(rel, dtype=torch.float32).eval()
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    assert routers and all(r.e_score_correction_bias.abs().max() > 0 for r in routers)
    chosen = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].sort(-1).values))
             for r in routers]
    with torch.no_grad():
        model(ids)
        for r in routers:
            r.e_score_correction_bias.zero_()
        wrong = model(ids).logits
    for h in hooks:
        h.remove()
    n = len(routers)
    flips = [int((a != b).any(-1).sum()) for a, b in zip(chosen[:n], chosen[n:])]
    rel_diff = ((wrong - want).abs().max() / want.abs().max()).item()
    assert rel_diff > 1e-2 and all(flips), (rel_diff, flips)
    print(f"routing bias zeroed: logits off by {rel_diff:.2e} of the largest |logit|, "
          f"tokens routed differently per MoE layer {flips} of {ids.numel()}")
