"""Megatron-core `torch_dist` checkpoints (fixtures/generate_megatron.py, written by the real
megatron-core on CPU) through ckpt, compared bitwise with what megatron's own
`dist_checkpointing.load` returned (fixtures/expected/megatron_torch_dist*.pt):

- `inspect` names the layout and lists Megatron's names and stored shapes (a layer-stacked weight
  stays stacked) and `common.pt`'s values; a reformulated distributed-optimizer tensor
  (`megatron_torch_dist_flat`, megatron-core 0.15) has its original shape back;
- `verify --deep` finds both sound;
- `consolidate` to safetensors and to torch.save gives megatron's tensors bit for bit (and the
  torch output, which `torch.load(weights_only=True)` reads, holds `common.pt`'s values, the
  `argparse.Namespace` as the dict of its fields);
- `reshard` to plain DCP is loaded back by torch's `dcp.load` under torchrun at 2 and 3 ranks, and
  (with the source's `metadata.json` and `common.pt` copied beside it) by megatron-core's own
  `dist_checkpointing.load` with the TP=2 requests of the model that saved it, or whole tensors;
  megatron-core 0.16 so loads the 0.15 distributed-optimizer checkpoint it cannot load itself;
- a `.metadata` whose `all_local_plans` names a class outside the allowed ones is refused.
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

from ckpt_helpers import (
    MEGATRON_FIXTURE_NAMES,
    assert_same_state,
    dtype_code,
    flatten_like_dcp,
    load_expected,
    load_safetensors,
    run_torchrun,
)

HERE = __import__("pathlib").Path(__file__).resolve().parent


def tensors_of(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", MEGATRON_FIXTURE_NAMES)
def test_inspect_says_megatron_and_keeps_names_and_shapes(run_ckpt, fixtures_dir, name):
    want, doc = load_expected(fixtures_dir, name)
    proc = run_ckpt("inspect", fixtures_dir / doc["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["format"] == "megatron-torch-dist"
    assert got["state_dict_type"] == "SHARDED_STATE_DICT"
    assert got["world_size"] == doc["world_size"]
    tensors = {t["name"]: t for t in got["tensors"]}
    assert sorted(tensors) == sorted(doc["tensors"])
    for fqn, t in doc["tensors"].items():
        assert tensors[fqn]["dtype"] == t["dtype"], fqn
        assert tensors[fqn]["shape"] == t["shape"], fqn
        assert tensors[fqn]["shape"] == list(want[fqn].shape), fqn
    assert sorted(v["name"] for v in got["non_tensors"]) == sorted(doc["non_tensors"])
    values = {v["name"]: v["value"] for v in got["non_tensors"]}
    for k in doc["non_tensors"]:
        assert values[k] == want[k], k
    human = run_ckpt("inspect", fixtures_dir / doc["path"])
    assert "Megatron-core dist_checkpointing, torch_dist backend" in human.stdout


def test_layer_stacked_and_tp_pieces_are_read_as_stored(run_ckpt, fixtures_dir):
    _, doc = load_expected(fixtures_dir, "megatron_torch_dist")
    got = json.loads(run_ckpt("inspect", fixtures_dir / doc["path"], "--json").stdout)
    for t in got["tensors"]:
        boxes = sorted([p["offsets"], p["sizes"]] for p in t["pieces"])
        assert boxes == doc["tensors"][t["name"]]["chunks"], t["name"]
    stacked = doc["tensors"]["decoder.layers.mlp.linear_fc2.weight"]
    assert stacked["shape"] == [3, 5, 6] and len(stacked["chunks"]) == 6
    # the two files per rank megatron's default strategy writes
    files = {p["file"] for t in got["tensors"] for p in t["pieces"]}
    assert {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"} >= files and len(files) >= 3


@pytest.mark.parametrize("name", MEGATRON_FIXTURE_NAMES)
def test_verify_deep_is_sound(run_ckpt, fixtures_dir, name):
    _, doc = load_expected(fixtures_dir, name)
    proc = run_ckpt("verify", fixtures_dir / doc["path"], "--deep")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", MEGATRON_FIXTURE_NAMES)
def test_consolidate_to_safetensors_is_what_megatron_loads(run_ckpt, fixtures_dir, tmp_path, name):
    want, doc = load_expected(fixtures_dir, name)
    out = tmp_path / "model.safetensors"
    proc = run_ckpt("consolidate", fixtures_dir / doc["path"], "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_same_state(load_safetensors(out), tensors_of(want), name)


@pytest.mark.parametrize("name", MEGATRON_FIXTURE_NAMES)
def test_consolidate_to_torch_is_what_megatron_loads(run_ckpt, fixtures_dir, tmp_path, name):
    want, doc = load_expected(fixtures_dir, name)
    out = tmp_path / "model.pt"
    proc = run_ckpt("consolidate", fixtures_dir / doc["path"], "-o", out, "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    nested = torch.load(out, weights_only=True)
    if name == "megatron_torch_dist":
        assert nested["args"] == {"tensor_model_parallel_size": 2, "num_layers": 3, "lr": 0.0003, "model": "toy"}
    assert_same_state(flatten_like_dcp(nested), want, name)


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_is_loaded_back_by_torch_dcp(run_ckpt, fixtures_dir, tmp_path, world):
    jobs = {"loads": [], "saves": []}
    for name in MEGATRON_FIXTURE_NAMES:
        _, doc = load_expected(fixtures_dir, name)
        out = tmp_path / f"{name}_{world}"
        proc = run_ckpt("reshard", fixtures_dir / doc["path"], "-o", out, "--world-size", world)
        assert proc.returncode == 0, proc.stderr
        jobs["loads"].append({"id": name, "ckpt": str(out),
                              "expected": str(fixtures_dir / "expected" / f"{name}.pt")})
    jobfile, result = tmp_path / "job.json", tmp_path / "result.json"
    jobfile.write_text(json.dumps(jobs))
    proc = run_torchrun(HERE / "torchrun_load.py", world, jobfile, result)
    assert result.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["loads"] == {name: [] for name in MEGATRON_FIXTURE_NAMES}


class _RunsACommand:
    """Pickles as a call of `os.system` (`posix.system` in the file), as a hostile file would."""

    def __reduce__(self):
        import os

        return (os.system, ("true",))


def _mutated_plan_item(item):
    import dataclasses

    from torch.distributed.checkpoint.planner import BytesIOWriteData

    # A class beside the allowed planner dataclasses, from the same module: still refused.
    return dataclasses.replace(item, bytes_io_data=BytesIOWriteData(nbytes=1))


@pytest.mark.parametrize("what", ["BytesIOWriteData", "os.system"])
def test_a_global_outside_the_allowed_ones_is_still_refused(run_ckpt, fixtures_dir, tmp_path, what):
    import dataclasses

    from torch.distributed.checkpoint import FileSystemReader

    src = fixtures_dir / "megatron_torch_dist"
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    meta = FileSystemReader(str(src)).read_metadata()
    plan = meta.all_local_plans[0]
    if what == "os.system":
        items = [plan.items[0], _RunsACommand(), *plan.items[1:]]
    else:
        items = [_mutated_plan_item(plan.items[0]), *plan.items[1:]]
    meta.all_local_plans[0] = dataclasses.replace(plan, items=items)
    (dst / ".metadata").write_bytes(pickle.dumps(meta))
    # the unmodified file is read, the modified one refused naming the class
    assert run_ckpt("inspect", src).returncode == 0
    proc = run_ckpt("inspect", dst)
    assert proc.returncode == 1, proc.stdout
    refused = "posix.system" if what == "os.system" else "torch.distributed.checkpoint.planner.BytesIOWriteData"
    assert f"`{refused}`" in proc.stderr and "does not allow" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name,mode", [
    ("megatron_torch_dist", "tp"),
    ("megatron_torch_dist", "full"),
    # megatron-core 0.16 cannot load the 0.15 distributed-optimizer save itself; after ckpt it can
    ("megatron_torch_dist_flat", "full"),
])
def test_reshard_is_loaded_back_by_megatron(run_ckpt, fixtures_dir, tmp_path, name, mode):
    pytest.importorskip("megatron.core")
    src = fixtures_dir / name
    out = tmp_path / "resharded"
    proc = run_ckpt("reshard", src, "-o", out, "--world-size", 3)
    assert proc.returncode == 0, proc.stderr
    for f in ("metadata.json", "common.pt"):
        shutil.copy(src / f, out / f)
    result = tmp_path / "result.json"
    proc = run_torchrun(HERE / "torchrun_megatron_load.py", 2, out, fixtures_dir / "expected" / f"{name}.pt",
                        mode, result)
    assert result.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(result.read_text())["errors"] == []
