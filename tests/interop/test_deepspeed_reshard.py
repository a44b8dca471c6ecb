"""`ckpt reshard DSCKPT -o OUT --world-size M --format deepspeed` against DeepSpeed 0.19.8 itself,
for the ZeRO-1 (bf16) and ZeRO-2 (fp16, tied + frozen) fixtures saved on 3 CPU ranks at M = 3
and M = 1, zero2_fp32 and zero2_bf16 at M = 2, and the ZeRO-3 fixtures (bf16, fp16, fp32) each
at M = 3, 2 and 1:

- OUT's files are DeepSpeed's own at M: the reference is DeepSpeed's universal route
  (`ds_to_universal`, an engine at M with `load_universal`, `save_checkpoint`), its losses on
  0.19.8 (buffers, frozen parameters) repaired from the source; every file, key, type, shape,
  dtype, storage size and value agree (the reference's `ds_config` also holds the
  `load_universal` switch it was loaded with, and its Adam state keys come in another order;
  ZeRO-3's padding DeepSpeed leaves uninitialised, so there only the parameters' elements are
  compared, and ckpt's padding must be zeros);
- a DeepSpeed engine at M (torchrun, gloo, CPU) loads OUT with a plain `load_checkpoint` and
  holds what it holds after loading the reference: fp32 masters, Adam's state, param groups,
  loss scaler, counters, buffers, frozen parameters; one more step gives the same losses;
- at M = 4, where DeepSpeed's own route fails (its universal load breaks on a rank that holds
  none of a group: the bias group of 11 elements pads to 16, rank 3's 4 are all padding), an
  engine loads OUT and holds the original's fp32 masters and Adam moments, and trains on;
- the checks that need no engine, on every ZeRO-1/2/3 fixture: `get_fp32_state_dict_from_zero_
  checkpoint(OUT)` is bitwise the original's (M = 3, 2, 1), the same size gives the same files,
  3 -> 4 -> 2 gives the files of 3 -> 2 (the 4-rank source is ckpt's own reshard: DeepSpeed's
  fixtures are all saved on 3 ranks), ckpt's own reader (`consolidate`, `verify --deep`) finds
  in OUT what it finds in the input;
- OUT holds DeepSpeed's recovery scripts (`zero_to_fp32.py`, `zero_to_torch.py`) as the source
  has them, executable, and both run there and give the original's weights;
- a missing rank file, or a rank file of another save, is an error naming it, with nothing
  written; an existing OUT is refused without --force; BF16_Optimizer and Universal inputs are
  refused as not yet; stage 0 is the same checkpoint at any size.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_helpers import run_torchrun

HERE = Path(__file__).resolve().parent
DS = HERE.parents[1] / "fixtures" / "deepspeed"
TAG = "global_step2"
CASES = ["zero1_bf16", "zero2_fp16"]
ZERO3 = ["zero3_bf16", "zero3_fp16", "zero3_fp32"]
# Checked against a DeepSpeed engine at M: the two cases at M = 3 and 1, fp32 and a larger world
# once each; ZeRO-3 in each dtype at M = 3, 2 and 1; and 4 -> 2 from zero3_bf16 as 4 ranks saved
# it (`zero3_bf16_r4`, fixtures/generate_deepspeed.py with DS_SUFFIX).
ENGINE = ([(c, m) for c in CASES for m in (3, 1)] + [("zero2_fp32", 2), ("zero2_bf16", 2)]
          + [(c, m) for c in ZERO3 for m in (3, 2, 1)] + [("zero3_bf16_r4", 2)])
# Every ZeRO-1/2/3 fixture saved on 3 ranks, for the checks that need no DeepSpeed engine.
ALL_CASES = [f"zero{s}_{d}" for s in (1, 2, 3) for d in ("bf16", "fp16", "fp32")]
# Where a save's state dicts are keyed by flat group: stages 1-2 and stage 3.
STATE = re.compile(r"\.(base_optimizer_state|optimizer_state_dict)\.state\.")

logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def reshard(run_ckpt, src: Path, out: Path, world: int, *flags) -> subprocess.CompletedProcess:
    return run_ckpt("reshard", src, "-o", out, "--world-size", world, "--format", "deepspeed", *flags)


RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def as_saved(case: str, dest: Path) -> Path:
    """Fixture `case` with the recovery scripts beside its tags, as DeepSpeed's save leaves them
    (`_copy_recovery_script`: copied from the installed package and made executable); the
    committed fixtures leave them out for their size."""
    import os
    import stat

    import deepspeed.utils

    shutil.copytree(DS / case, dest)
    for script in RECOVERY_SCRIPTS:
        shutil.copyfile(Path(deepspeed.utils.__file__).parent / script, dest / script)
        os.chmod(dest / script, os.stat(dest / script).st_mode | stat.S_IEXEC)
    return dest


def fp32_of(path: Path) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path))


def same(want, got, where: str = "", real: dict | None = None) -> None:
    """Equal as DeepSpeed pickled them: types, keys in order, tensors bitwise with their dtype,
    shape and storage size, objects by their attributes. A tensor at a path in `real` is
    compared on the elements its mask marks; `got`'s others (ckpt's padding) must be zeros."""
    real = real or {}
    if torch.is_tensor(want):
        assert torch.is_tensor(got), where
        assert (want.dtype, want.shape) == (got.dtype, got.shape), where
        assert want.untyped_storage().nbytes() == got.untyped_storage().nbytes(), where
        if where in real:
            mask = real[where]
            assert torch.equal(want[mask], got[mask]), where
            assert not got[~mask].any(), (where, "padding not zeros")
        else:
            assert torch.equal(want, got), where
        return
    assert type(want) is type(got), (where, type(want), type(got))
    if isinstance(want, dict):
        # The universal route's load fills Adam's state in another key order than training
        # does; ckpt keeps the order of the save it reads.
        order = sorted if STATE.search(where) else list
        assert order(want) == order(got), (where, list(want), list(got))
        for k in want:
            same(want[k], got[k], f"{where}.{k}", real)
    elif isinstance(want, (list, tuple)):
        assert len(want) == len(got), where
        for i, (w, g) in enumerate(zip(want, got)):
            same(w, g, f"{where}[{i}]", real)
    elif hasattr(want, "__dict__") and not isinstance(want, type):
        same(vars(want), vars(got), where, real)
    else:
        assert want == got, (where, want, got)


def zero3_real(tag_dir: Path) -> dict:
    """Per path `same` names, a mask of the elements of a ZeRO-3 save's pieces that are the
    parameters' (each parameter cut in `ceil(numel / world)`, the last piece's tail padding,
    which DeepSpeed leaves uninitialised): the flat fp32 groups, Adam's moments, the frozen
    fragments. Empty for the other stages."""
    models = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
    world = len(models)
    real = {}
    for model in models:
        rank = int(model.name.split("_")[3])
        saved = load(model)

        def mask(numel: int) -> torch.Tensor:
            size = math.ceil(numel / world)
            return torch.arange(rank * size, (rank + 1) * size) < numel

        for name, shape in saved["frozen_param_shapes"].items():
            real[f"{model.name}.frozen_param_fragments.{name}"] = mask(shape.numel())
        optim = next(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")).name
        osd = f"{optim}.optimizer_state_dict"
        for j, shapes in enumerate(saved["param_shapes"]):
            m = torch.cat([mask(s.numel()) for s in shapes.values()])
            real[f"{osd}.fp32_flat_groups[{j}]"] = m
            for k in ("exp_avg", "exp_avg_sq"):
                real[f"{osd}.optimizer_state_dict.state.{j}.{k}"] = m
    return real


def load(path: Path):
    return torch.load(path, weights_only=False, map_location="cpu")


def without_universal_switch(saved: dict) -> dict:
    """The reference's `ds_config` as the engine's before `load_universal` was set."""
    config = dict(saved["ds_config"])
    config.pop("checkpoint", None)
    return {**saved, "ds_config": config}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, run_ckpt):
    """Per (case, M): ckpt's OUT, DeepSpeed's reference REF, and what an engine at M holds after
    loading each (torchrun_deepspeed_reshard.py)."""
    done = {}

    def get(case: str, world: int, reference: bool = True):
        if (case, world) in done:
            return done[(case, world)]
        tmp = tmp_path_factory.mktemp(f"{case}_{world}")
        out = tmp / "out"
        proc = reshard(run_ckpt, as_saved(case, tmp / "src"), out, world)
        assert proc.returncode == 0, proc.stderr
        universal = tmp / "universal" if reference else "-"
        if reference:
            subprocess.run(
                [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                 "--input_folder", str(DS / case / TAG),
                 "--output_folder", str(universal / f"{TAG}_universal"),
                 "--inject_missing_state", "--num_extract_workers", "1",
                 "--num_merge_workers", "1"],
                check=True, capture_output=True,
            )
        held = tmp / "held.pt"
        for attempt in range(2):
            shutil.rmtree(tmp / "ref", ignore_errors=True)
            proc = run_torchrun(HERE / "torchrun_deepspeed_reshard.py", world, case, DS / case,
                                universal, tmp / "ref", out, held)
            # A rank of DeepSpeed's CPU engine aborting in C++ with nothing raised (see
            # torchrun_deepspeed_reshard.py; 2 runs in about 60) is run once more; any other
            # failure, or the same twice, fails the test.
            if proc.returncode == 0 or "terminate called without an active exception" not in proc.stderr:
                break
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        done[(case, world)] = (out, tmp / "ref", load(held))
        return done[(case, world)]

    return get


@pytest.mark.parametrize("case,world", [(c, m) for c in ALL_CASES for m in (3, 2, 1)]
                         + [("zero3_bf16_r4", m) for m in (2, 1)])
def test_zero_to_fp32_of_the_reshard_is_the_original(run_ckpt, tmp_path, case, world):
    out = tmp_path / "out"
    proc = reshard(run_ckpt, DS / case, out, world)
    assert proc.returncode == 0, proc.stderr
    want, got = fp32_of(DS / case), fp32_of(out)
    assert list(want) == list(got)
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k


@pytest.mark.parametrize("case", ALL_CASES)
def test_same_size_gives_the_same_files(run_ckpt, tmp_path, case):
    out = tmp_path / "out"
    assert reshard(run_ckpt, DS / case, out, 3).returncode == 0
    assert (out / "latest").read_text() == (DS / case / "latest").read_text().strip()
    names = sorted(p.name for p in (DS / case / TAG).iterdir())
    assert sorted(p.name for p in (out / TAG).iterdir()) == names
    real = zero3_real(DS / case / TAG)
    for name in names:
        same(load(DS / case / TAG / name), load(out / TAG / name), name, real)


@pytest.mark.parametrize("world", [4, 1])
@pytest.mark.parametrize("case", ALL_CASES + ["zero0_fp32"])
def test_ckpt_reads_the_reshard_as_the_original(run_ckpt, tmp_path, case, world):
    """ckpt's own reader gives the same weights, moments, steps and settings from OUT as from the
    input, and `verify --deep` finds OUT sound."""
    out = tmp_path / "out"
    assert reshard(run_ckpt, DS / case, out, world).returncode == 0
    proc = run_ckpt("verify", "--deep", out)
    assert proc.returncode == 0 and "sound" in proc.stdout, proc.stdout + proc.stderr
    flat = {}
    for name, src in (("want", DS / case), ("got", out)):
        pt = tmp_path / f"{name}.pt"
        proc = run_ckpt("consolidate", src, "-o", pt, "--format", "torch")
        assert proc.returncode == 0, proc.stderr
        flat[name] = torch.load(pt, weights_only=True)
    same(flat["want"], flat["got"])


@pytest.mark.parametrize("case", ALL_CASES)
def test_going_through_another_size_gives_the_same_files(run_ckpt, tmp_path, case):
    """3 -> 4 -> 2 equals 3 -> 2: a resharded checkpoint is as good an input as DeepSpeed's."""
    direct, four, two = tmp_path / "direct", tmp_path / "four", tmp_path / "two"
    assert reshard(run_ckpt, DS / case, direct, 2).returncode == 0
    assert reshard(run_ckpt, DS / case, four, 4).returncode == 0
    assert len(list((four / TAG).glob("*optim_states.pt"))) == 4
    assert reshard(run_ckpt, four, two, 2).returncode == 0
    names = sorted(p.name for p in (direct / TAG).iterdir())
    assert sorted(p.name for p in (two / TAG).iterdir()) == names
    for name in names:
        same(load(direct / TAG / name), load(two / TAG / name), name)


@pytest.mark.parametrize("case,world", ENGINE)
def test_files_are_what_deepspeed_writes_at_m(resumed, case, world):
    out, ref, _ = resumed(case, world)
    assert (out / "latest").read_text() == TAG
    # Beside the tag: `latest` and both recovery scripts, as they are, executable.
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    for script in RECOVERY_SCRIPTS:
        assert (out / script).read_bytes() == (ref / script).read_bytes(), script
        assert (out / script).stat().st_mode == (ref / script).stat().st_mode, script
    names = sorted(p.name for p in (ref / TAG).iterdir())
    assert sorted(p.name for p in (out / TAG).iterdir()) == names
    assert len([n for n in names if "optim_states" in n]) == world
    real = zero3_real(ref / TAG)
    for name in names:
        want = without_universal_switch(load(ref / TAG / name))
        got = load(out / TAG / name)
        if "model_states" in name:
            assert got["dp_world_size"] == world
        if "optim_states" in name and case in ZERO3:
            # Each group's Adam `step` its own tensor, as training saves it (DeepSpeed's universal
            # load shares one among them, which the reference has repaired).
            steps = [s["step"] for s in got["optimizer_state_dict"]["optimizer_state_dict"]["state"].values()]
            assert len({s.untyped_storage().data_ptr() for s in steps}) == len(steps), name
        same(want, got, name, real)


@pytest.mark.parametrize("case,world", ENGINE)
def test_deepspeed_resumes_at_m_as_from_its_own_save(resumed, case, world):
    _, _, held = resumed(case, world)
    ref, ours = held["ref"], held["ours"]
    assert len(ours) == world
    for rank, (want, got) in enumerate(zip(ref, ours)):
        losses = (want.pop("loss"), got.pop("loss"))
        # The flat groups' elements that are parameters (all but ZeRO-3's padding, which
        # DeepSpeed leaves uninitialised and ckpt writes as zeros).
        real = {}
        for g, mask in enumerate(want["real"]):
            real[f"rank {rank}.fp32[{g}]"] = mask
            for k in ("exp_avg", "exp_avg_sq"):
                real[f"rank {rank}.state[{g}].{k}"] = mask
        # A load keeps the key order of the save: the reference's came through the universal
        # route's (see `same`).
        for held_state in (want, got):
            held_state["state"] = [dict(sorted(s.items())) for s in held_state["state"]]
        same(want, got, f"rank {rank}", real)
        assert torch.allclose(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)
        # Adam's step as loaded (saved after 2 steps); the counters after one more step of M ranks.
        assert int(got["state"][0]["step"]) == 2
        saved_on = 4 if case.endswith("_r4") else 3
        assert got["counters"] == [3, 2 * saved_on + world, 0]


def test_deepspeed_resumes_where_its_own_route_fails(resumed):
    case, world = "zero2_bf16", 4
    _, _, held = resumed(case, world, reference=False)
    ours = held["ours"]
    assert len(ours) == world
    saved = [load(p)["optimizer_state_dict"]
             for p in sorted((DS / case / TAG).glob("*optim_states.pt"))]
    for g in range(2):
        # The original's flat group: each rank's partition without its padding, then the moments
        # cut to the same length.
        masters = torch.cat([s["single_partition_of_fp32_groups"][g] for s in saved])
        numel = masters.numel()
        assert torch.equal(torch.cat([h["fp32"][g] for h in ours])[:numel], masters), g
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch.cat([s["base_optimizer_state"]["state"][g][key][:len(
                s["single_partition_of_fp32_groups"][g])] for s in saved])
            got = torch.cat([h["state"][g][key] for h in ours])[:numel]
            assert torch.equal(got, want), (g, key)
    for h in ours:
        assert int(h["state"][0]["step"]) == 2 and h["counters"] == [3, 2 * 3 + world, 0]
        assert all(torch.isfinite(torch.tensor(h["loss"])))


@pytest.mark.parametrize("case,gone,needles", [
    ("zero2_fp16", "zero_pp_rank_1_mp_rank_00_optim_states.pt", ["rank 1's file", "missing"]),
    # The last rank's absence shows only in the others' `partition_count`.
    ("zero2_fp16", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
     ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "partition_count", "3"]),
    ("zero3_bf16", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", ["rank 1's file", "missing"]),
    ("zero3_bf16", "zero_pp_rank_2_mp_rank_00_model_states.pt", [TAG, "2 and 3"]),
])
def test_a_missing_rank_file_is_named_and_nothing_written(run_ckpt, tmp_path, case, gone, needles):
    src = tmp_path / "src"
    shutil.copytree(DS / case, src)
    (src / TAG / gone).unlink()
    out = tmp_path / "out"
    proc = reshard(run_ckpt, src, out, 2)
    assert proc.returncode in (1, 2), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*")), "something was written"


@pytest.mark.parametrize("what", ["partition_count", "fp32_flat_groups"])
def test_zero3_partitions_that_do_not_add_up_are_named(run_ckpt, tmp_path, what):
    """A rank file of another save: one of 4 ranks (its `partition_count` says so), or one whose
    flat group is cut short."""
    src = tmp_path / "src"
    shutil.copytree(DS / "zero3_fp32", src)
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if what == "partition_count":
        four = tmp_path / "four"
        assert reshard(run_ckpt, DS / "zero3_fp32", four, 4).returncode == 0
        shutil.copy(four / TAG / name, src / TAG / name)
    else:
        saved = load(src / TAG / name)
        flat = saved["optimizer_state_dict"]["fp32_flat_groups"]
        flat[0] = flat[0][:-1].clone()
        torch.save(saved, src / TAG / name)
    out = tmp_path / "out"
    proc = reshard(run_ckpt, src, out, 2)
    assert proc.returncode == 1, proc.stderr
    assert name in proc.stderr and what in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*")), "something was written"


def test_zero3_sub_groups_cut_otherwise_at_m_are_refused(run_ckpt, tmp_path):
    """`sub_group_size` 42: at 3 ranks group 0's pieces (12 + 19 + 11) make one sub-group, as
    saved, and at 4 (9 + 14 + 9) too; at 2 (18 + 28 + 17) DeepSpeed would cut it in two."""
    src = tmp_path / "src"
    shutil.copytree(DS / "zero3_fp32", src)
    for model in (src / TAG).glob("*model_states.pt"):
        saved = load(model)
        saved["ds_config"]["zero_optimization"]["sub_group_size"] = 42
        torch.save(saved, model)
    assert reshard(run_ckpt, src, tmp_path / "four", 4).returncode == 0
    out = tmp_path / "out"
    proc = reshard(run_ckpt, src, out, 2)
    assert proc.returncode == 2, proc.stderr
    assert "not yet" in proc.stderr and "sub_group_size" in proc.stderr, proc.stderr
    assert not out.exists()


def test_the_recovery_scripts_beside_the_tags_are_carried(run_ckpt, tmp_path):
    """Whichever of the two the source has, copied as it is; a source without them gives an
    output without them, and the summary says so."""
    src = tmp_path / "src"
    shutil.copytree(DS / "zero1_bf16", src)
    proc = reshard(run_ckpt, src, tmp_path / "none", 2)
    assert proc.returncode == 0, proc.stderr
    assert not any((tmp_path / "none" / s).exists() for s in RECOVERY_SCRIPTS)
    assert "no zero_to_fp32.py or zero_to_torch.py" in proc.stderr, proc.stderr
    (src / "zero_to_torch.py").write_text("# DeepSpeed's script\n")
    proc = reshard(run_ckpt, src, tmp_path / "one", 2)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "one" / "zero_to_torch.py").read_text() == "# DeepSpeed's script\n"
    assert not (tmp_path / "one" / "zero_to_fp32.py").exists()
    assert "no zero_to_fp32.py beside" in proc.stderr, proc.stderr


@pytest.mark.parametrize("case,world", [("zero2_fp16", 2), ("zero3_bf16", 4), ("zero1_bf16", 1)])
def test_the_recovery_scripts_run_on_the_reshard(run_ckpt, tmp_path, case, world):
    """`python OUT/zero_to_torch.py OUT DIR --dtype fp32`, run where the save left it, gives the
    tensors `python OUT/zero_to_fp32.py OUT DIR` gives, which are the original's in fp32."""
    out = tmp_path / "out"
    proc = reshard(run_ckpt, as_saved(case, tmp_path / "src"), out, world)
    assert proc.returncode == 0, proc.stderr
    assert "note:" not in proc.stderr, proc.stderr
    got = {}
    for script, extra in (("zero_to_fp32.py", []), ("zero_to_torch.py", ["--dtype", "fp32"])):
        dest = tmp_path / script
        r = subprocess.run([sys.executable, str(out / script), str(out), str(dest), *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        files = sorted(dest.glob("pytorch_model*.bin"))
        assert files, list(dest.iterdir())
        got[script] = {k: v for f in files for k, v in load(f).items()}
    # The scripts write every tensor as fp32 (a frozen fp16 parameter too).
    want = {k: v.float() for k, v in fp32_of(DS / case).items()}
    for state in got.values():
        assert list(state) == list(want)
        for k in want:
            assert state[k].dtype == torch.float32 and torch.equal(state[k], want[k]), k


def test_an_existing_output_needs_force(run_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    proc = reshard(run_ckpt, DS / "zero2_fp16", out, 2)
    assert proc.returncode == 2 and "already exists" in proc.stderr, proc.stderr
    assert (out / "keep").exists()
    proc = reshard(run_ckpt, DS / "zero2_fp16", out, 2, "--force")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "keep").exists() and (out / TAG / "mp_rank_00_model_states.pt").exists()


@pytest.mark.parametrize("case,needle", [
    ("zero1_bf16_optimizer", "BF16_Optimizer"),
    ("universal", "Universal Checkpoint"),
])
def test_layouts_not_written_yet_are_refused(run_ckpt, tmp_path, case, needle):
    out = tmp_path / "out"
    proc = reshard(run_ckpt, DS / case, out, 2)
    assert proc.returncode == 2 and "not yet" in proc.stderr and needle in proc.stderr, proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("src,needle", [
    (DS.parent / "dtypes.safetensors", "not a directory"),
    (DS.parent / "dcp_zstd", "no `latest` file"),
])
def test_an_input_that_is_not_deepspeed_is_refused(run_ckpt, tmp_path, src, needle):
    out = tmp_path / "out"
    proc = reshard(run_ckpt, src, out, 2)
    assert proc.returncode in (1, 2) and needle in proc.stderr, proc.stderr
    assert not out.exists()


def test_stage0_is_the_same_checkpoint_at_any_size(run_ckpt, tmp_path):
    out = tmp_path / "out"
    proc = reshard(run_ckpt, DS / "zero0_fp32", out, 5)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in (DS / "zero0_fp32" / TAG).iterdir())
    assert sorted(p.name for p in (out / TAG).iterdir()) == names
    for name in names:
        want, got = load(DS / "zero0_fp32" / TAG / name), load(out / TAG / name)
        if "dp_world_size" in want:
            assert got["dp_world_size"] == 5
            want["dp_world_size"] = 5
        same(want, got, name)
