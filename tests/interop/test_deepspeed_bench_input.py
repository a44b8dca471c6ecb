"""The benchmark's DeepSpeed input (scripts/deepspeed_bench_input.py writes a ZeRO-3 save with torch
directly, too large to train here) is the layout DeepSpeed writes: a small one, read by DeepSpeed's
own `get_fp32_state_dict_from_zero_checkpoint`, gives the tensors the generator wrote, and ckpt's
consolidation of it equals DeepSpeed's bit for bit."""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from ckpt_helpers import bitwise_equal, load_safetensors

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_a_small_bench_input_reads_right_in_deepspeed_and_in_ckpt(run_ckpt, tmp_path):
    import deepspeed_bench_input as gen
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    params = OrderedDict(
        [("embed.weight", torch.Size([37, 11])), ("layers.0.q.weight", torch.Size([11, 11])),
         ("layers.0.norm.weight", torch.Size([11])), ("head.weight", torch.Size([5, 11]))]
    )
    wrote = gen.write(tmp_path / "ds", params, ranks=8, buffers=OrderedDict([("rope.inv_freq", torch.Size([6]))]))
    assert "rope.inv_freq" in wrote
    deepspeed = {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ds")).items()}
    assert sorted(deepspeed) == sorted(wrote)
    assert all(bitwise_equal(deepspeed[k], wrote[k]) for k in wrote)
    out = tmp_path / "model.safetensors"
    proc = run_ckpt("consolidate", tmp_path / "ds", "-o", out, "--include", "model.*", "--strip-prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    got = load_safetensors(out)
    assert sorted(got) == sorted(wrote)
    assert all(bitwise_equal(got[k], wrote[k]) for k in wrote)


def test_a_bench_input_holds_the_keys_of_a_real_zero3_save(tmp_path):
    """What DeepSpeed's universal route reads beyond the tensors (the counters, `ds_config`, each
    flat group's `ds_id`) is there, as in the zero3_bf16 fixture an engine saved."""
    import deepspeed_bench_input as gen

    real = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed" / "zero3_bf16" / "global_step2"
    params = OrderedDict([("embed.weight", torch.Size([37, 11])), ("layers.0.norm.weight", torch.Size([11])),
                          ("head.weight", torch.Size([5, 11]))])
    gen.write(tmp_path / "ds", params, ranks=3)
    ours = tmp_path / "ds" / gen.TAG
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        want = torch.load(real / name, weights_only=False)
        got = torch.load(ours / name, weights_only=False)
        assert list(got) == list(want), name
        if "optim" in name:
            want, got = want["optimizer_state_dict"], got["optimizer_state_dict"]
            assert list(got) == list(want)
            # stage3.py names each flat group by its first and last parameter's ds_id
            assert [t.ds_id for t in got["fp32_flat_groups"]] == ["0_2", "1_1"]
        else:
            assert sorted(got["ds_config"]) == sorted(want["ds_config"])
