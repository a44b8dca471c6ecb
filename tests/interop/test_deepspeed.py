"""DeepSpeed ZeRO checkpoints (fixtures/generate_deepspeed.py: real DeepSpeed 0.19.8 on 3 CPU
ranks, stages 0-3 in bf16, fp16 and fp32, a Universal Checkpoint, a Trainer `checkpoint-N/`)
through ckpt, against what DeepSpeed's own tools give (fixtures/expected/deepspeed_*.pt):

- `consolidate` is bitwise equal to `get_fp32_state_dict_from_zero_checkpoint` for the weights
  and to `ds_to_universal`'s per-parameter files for Adam's moments, with the optimizer's step and
  settings; `--include 'model.*' --strip-prefix model.` is the `zero_to_fp32` replacement;
- a Universal Checkpoint reads as its files hold it;
- `reshard` gives a DCP that an FSDP2 model and its AdamW resume from (`dcp.load`,
  `set_state_dict`) on 3 ranks with DeepSpeed's parameters and moments;
- `inspect` names the stage, tag and dtype; `verify` finds every fixture sound;
- a missing rank, `latest` naming a missing tag, a file of another world size, model-parallel
  files, shapes that do not add up and a pickle calling a function are errors that write nothing;
- the same read from S3 (moto_server on loopback) equals the local one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_helpers import assert_same_state, bitwise_equal, load_safetensors, run_torchrun

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "fixtures"
DS = FIXTURES / "deepspeed"
CASES = sorted(p.name for p in DS.iterdir() if p.name.startswith("zero"))
ZERO_CASES = [c for c in CASES if not c.startswith("zero0")]


def expected(case: str) -> tuple[dict, dict]:
    exp = FIXTURES / "expected"
    return (
        torch.load(exp / f"deepspeed_{case}.pt", weights_only=True),
        json.loads((exp / f"deepspeed_{case}.json").read_text()),
    )


def nested_to_flat(d: dict, prefix: str = "") -> dict:
    """`{"model": {"emb.weight": t}, "optim": {"state.x.exp_avg": t}}` as `model.emb.weight`,
    `optim.state.x.exp_avg`; tuples and lists stay values."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out.update(nested_to_flat(v, key + "."))
        else:
            out[key] = v
    return out


def stage1_frozen(case: str) -> dict:
    """Stage 1 saves no `frozen_param_shapes`, so DeepSpeed's own tools lose its frozen
    parameters (DeepSpeed #3090); its `module` holds them whole, and ckpt gives them from there:
    `module`'s entries that are not trained, buffers or aliases, as saved."""
    if not case.startswith("zero1"):
        return {}
    (states,) = (DS / case).glob("global_step*/mp_rank_00_model_states.pt")
    sd = torch.load(states, weights_only=False, map_location="cpu")
    known = {n for group in sd["param_shapes"] for n in group}
    known |= set(sd["buffer_names"]) | set(sd["shared_params"])
    return {k: v for k, v in sd["module"].items() if k not in known}


def consolidated(run_ckpt, src, tmp_path: Path, *flags) -> dict:
    out = tmp_path / "out.pt"
    proc = run_ckpt("consolidate", src, "-o", out, "--format", "torch", *flags)
    assert proc.returncode == 0, proc.stderr
    return nested_to_flat(torch.load(out, weights_only=True))


@pytest.mark.parametrize("case", CASES)
def test_consolidate_equals_what_deepspeed_gives(run_ckpt, tmp_path, case):
    want, _ = expected(case)
    frozen = stage1_frozen(case)
    assert not frozen or not set(frozen) & {k.removeprefix("model.") for k in want}
    want = {**want, **{f"model.{k}": v for k, v in frozen.items()}}
    got = consolidated(run_ckpt, DS / case, tmp_path)
    if case.startswith("zero0"):
        # stage 0: the module as saved; its optimizer state is keyed by index (not compared)
        got = {k: v for k, v in got.items() if k.startswith("model.")}
    assert_same_state(got, want, case)


@pytest.mark.parametrize("case", ["zero2_bf16", "zero3_fp16", "zero1_fp32"])
def test_zero_to_fp32_replacement_is_bitwise(run_ckpt, tmp_path, case):
    """The one command that replaces `zero_to_fp32.py`, checked against DeepSpeed run now."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    want = {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(DS / case)).items()}
    out = tmp_path / "model.safetensors"
    proc = run_ckpt("consolidate", DS / case, "-o", out, "--include", "model.*", "--strip-prefix", "model.")
    assert proc.returncode == 0, proc.stderr
    got = load_safetensors(out)
    # and the frozen parameters zero_to_fp32 loses in stage 1, as the module saved them
    want.update(stage1_frozen(case))
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not bitwise_equal(got[k], want[k])]
    assert not bad, bad


@pytest.mark.parametrize("case", CASES)
def test_inspect_names_stage_tag_and_dtype(run_ckpt, case):
    _, doc = expected(case)
    proc = run_ckpt("inspect", DS / case, "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["format"] == "deepspeed-zero"
    details = {d["what"]: d["value"] for d in got["details"]}
    assert details["zero stage"].split()[0] == str(doc["stage"])
    assert details["tag"] == doc["tag"]
    assert got["world_size"] == doc["world_size"]
    # stage 0 partitions nothing: its one file is the whole model, as FSDP's FULL_STATE_DICT is
    want_type = "FULL_STATE_DICT" if doc["stage"] == 0 else "SHARDED_STATE_DICT"
    assert got["state_dict_type"] == want_type
    if doc["stage"] > 0:
        assert details["training dtype"] == doc["dtype"]


def test_a_trainer_checkpoint_reads_the_deepspeed_state_and_names_the_export(run_ckpt, tmp_path):
    trainer = DS / "hf_trainer" / "checkpoint-2"
    proc = run_ckpt("inspect", trainer)
    assert proc.returncode == 0, proc.stderr
    assert "deepspeed-zero" in proc.stdout
    assert "model.safetensors" in proc.stdout and "point ckpt at that file" in proc.stdout
    want, _ = expected("zero2_bf16")
    assert_same_state(consolidated(run_ckpt, trainer, tmp_path), want, "checkpoint-2")
    # the export itself, when named
    alone = run_ckpt("inspect", trainer / "model.safetensors", "--json")
    assert json.loads(alone.stdout)["format"] == "safetensors"


def test_a_universal_checkpoint_reads_as_its_files_hold_it(run_ckpt, tmp_path):
    root = DS / "universal"
    tag = (root / "latest_universal").read_text().strip()
    got = consolidated(run_ckpt, root, tmp_path)
    seen = 0
    for param in sorted((root / tag / "zero").iterdir()):
        if not param.is_dir():
            continue
        for f in param.glob("*.pt"):
            saved = torch.load(f, weights_only=False)
            saved = saved["param"] if isinstance(saved, dict) else saved
            name = f"model.{param.name}" if f.stem == "fp32" else f"optim.state.{param.name}.{f.stem}"
            assert bitwise_equal(got[name], saved.reshape(got[name].shape)), name
            seen += 1
    assert seen >= 20
    lr = [k for k in got if k.startswith("optim.param_groups.") and k.endswith(".lr")]
    assert lr and all(got[k] == 0.01 for k in lr)
    # each parameter whole in files of its own: nothing partitioned
    doc = json.loads(run_ckpt("inspect", root, "--json").stdout)
    assert doc["state_dict_type"] == "FULL_STATE_DICT"


def test_tag_picks_a_save_other_than_latest(run_ckpt, tmp_path):
    both = tmp_path / "both"
    shutil.copytree(DS / "zero2_fp32", both)
    shutil.copytree(DS / "zero3_bf16" / "global_step2", both / "global_step9")
    want2, _ = expected("zero2_fp32")
    want9, _ = expected("zero3_bf16")
    assert_same_state(consolidated(run_ckpt, both, tmp_path), want2, "latest")
    (tmp_path / "out.pt").unlink()
    assert_same_state(consolidated(run_ckpt, both, tmp_path, "--tag", "global_step9"), want9, "--tag")
    (tmp_path / "out.pt").unlink()
    # a tag's own directory is a checkpoint too
    assert_same_state(consolidated(run_ckpt, both / "global_step9", tmp_path), want9, "tag dir")
    proc = run_ckpt("inspect", both, "--tag", "global_step5")
    assert proc.returncode == 2 and "global_step9" in proc.stderr, proc.stderr


def spec_file(case: str, tmp_path: Path) -> Path:
    _, doc = expected(case)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(doc["spec"]))
    return path


@pytest.mark.parametrize("case", ["zero2_bf16", "zero3_fp32"])
def test_reshard_resumes_an_fsdp2_model_and_adamw(run_ckpt, tmp_path, case):
    """DeepSpeed to FSDP2: the reshard is a DCP that `dcp.load` and `set_state_dict` put into an
    FSDP2 model and its AdamW on 3 ranks, which then hold DeepSpeed's parameters, moments, step
    and settings (frozen 16-bit parameters go into fp32 ones, as `dcp.load` converts)."""
    want, _ = expected(case)
    out = tmp_path / "dcp"
    proc = run_ckpt("reshard", DS / case, "-o", out, "--world-size", "3")
    assert proc.returncode == 0, proc.stderr
    held = tmp_path / "held.pt"
    proc = run_torchrun(HERE / "torchrun_fsdp2_resume.py", 3, out, spec_file(case, tmp_path), held)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = nested_to_flat(torch.load(held, weights_only=True))
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert bitwise_equal(g.to(w.dtype), w), k
        else:
            assert g == w or list(g) == list(w), k


@pytest.mark.parametrize("case", CASES + ["universal", "hf_trainer/checkpoint-2"])
def test_verify_deep_finds_every_fixture_sound(run_ckpt, case):
    proc = run_ckpt("verify", "--deep", DS / case)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sound" in proc.stdout


def broken_copy(tmp_path: Path, case: str = "zero3_bf16") -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(DS / case, dst)
    return dst


def refused(run_ckpt, src: Path, tmp_path: Path, *needles: str) -> str:
    out = tmp_path / "out.safetensors"
    proc = run_ckpt("consolidate", src, "-o", out)
    assert proc.returncode in (1, 2), proc.stdout + proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob("*.ckpt-*")), "something was written"
    verify = run_ckpt("verify", src)
    assert verify.returncode != 0, verify.stdout
    return proc.stderr


def test_a_missing_rank_file_is_named(run_ckpt, tmp_path):
    src = broken_copy(tmp_path)
    (src / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(run_ckpt, src, tmp_path, "rank 1's file", "missing")


def test_latest_naming_a_missing_tag_is_an_error(run_ckpt, tmp_path):
    src = broken_copy(tmp_path)
    (src / "latest").write_text("global_step7")
    refused(run_ckpt, src, tmp_path, "`global_step7`", "global_step2")


def test_a_file_of_another_world_size_is_an_error(run_ckpt, tmp_path):
    src = broken_copy(tmp_path, "zero2_bf16")
    tag = src / "global_step2"
    shutil.copy(tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", tag / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt")
    refused(run_ckpt, src, tmp_path, "partition_count", "4 optimizer files")


def test_model_parallel_files_are_refused_by_name(run_ckpt, tmp_path):
    src = broken_copy(tmp_path, "zero2_bf16")
    tag = src / "global_step2"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    refused(run_ckpt, src, tmp_path, "model-parallel", "mp_rank_01_model_states.pt")


def test_shapes_that_do_not_add_up_are_an_error(run_ckpt, tmp_path):
    src = broken_copy(tmp_path, "zero2_fp32")
    states = src / "global_step2" / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=False)
    first = next(iter(sd["param_shapes"][0]))
    sd["param_shapes"][0][first] = torch.Size([40, 5])
    torch.save(sd, states)
    refused(run_ckpt, src, tmp_path, "group 0")


def test_a_pickle_that_calls_a_function_is_refused_and_nothing_runs(run_ckpt, tmp_path):
    src = broken_copy(tmp_path, "zero2_fp32")
    victim = src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    sd = torch.load(victim, weights_only=False)
    sd["optimizer_state_dict"]["loss_scaler"] = Evil()
    torch.save(sd, victim)
    refused(run_ckpt, src, tmp_path, "system")
    assert not marker.exists()


def test_reads_the_same_from_s3(tmp_path):
    from test_s3 import BUCKET, S3Server, run, upload_tree

    server = S3Server()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        upload_tree(server.client(), DS / "zero3_bf16", BUCKET, "ds/zero3_bf16")
        local = tmp_path / "local.safetensors"
        remote = tmp_path / "remote.safetensors"
        assert run(None, "consolidate", DS / "zero3_bf16", "-o", local).returncode == 0
        proc = run(server, "consolidate", f"s3://{BUCKET}/ds/zero3_bf16", "-o", remote)
        assert proc.returncode == 0, proc.stderr
        assert remote.read_bytes() == local.read_bytes()
        insp = run(server, "inspect", "--json", f"s3://{BUCKET}/ds/zero3_bf16")
        assert json.loads(insp.stdout)["format"] == "deepspeed-zero"
    finally:
        server.stop()


def test_parts_of_a_consolidation_make_the_whole(run_ckpt, tmp_path):
    """Split over machines with `--part`, as for any layout: the parts' output is the whole's."""
    whole = tmp_path / "whole.safetensors"
    parts = tmp_path / "parts.safetensors"
    assert run_ckpt("consolidate", DS / "zero3_bf16", "-o", whole).returncode == 0
    for i in range(3):
        proc = run_ckpt("consolidate", DS / "zero3_bf16", "-o", parts, "--part", f"{i}/3")
        assert proc.returncode == 0, proc.stderr
    assert parts.read_bytes() == whole.read_bytes()
