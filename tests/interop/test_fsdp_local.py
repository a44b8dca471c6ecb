"""FSDP1 LOCAL_STATE_DICT (fixtures/fsdp_local*, written by real FSDP1 on 2 CPU ranks, see
fixtures/generate_fsdp_local.py) resolved with `--shapes-from`: consolidated with each kind of
reference and compared bitwise with the model's full state dict; resharded and loaded by torch's
own `dcp.load` under torchrun; refused clearly without a reference or with a wrong one.

The committed fixtures are checked, and the same cases run on fixtures the installed torch writes
anew (`fresh_local`), so a change in FSDP's layout shows here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpt_helpers import FIXTURES_DIR, REPO, assert_same_state, flatten_like_dcp, run_torchrun
from conftest import free_port, run_ckpt

HERE = Path(__file__).parent
LOCALS = ["fsdp_local", "fsdp_local_orig"]
REFERENCES = ["model.pt", "params.json", "sharded"]
# (LOCAL checkpoint, reference under fsdp_local_ref/): every kind of reference for both
# use_orig_params variants, and a tied weight (`out.weight` is `embed.weight`) known from the
# torch.save reference's shared storage
CASES = [(n, r) for n in LOCALS for r in REFERENCES] + [("fsdp_local_tied", "tied.pt")]


@pytest.fixture(scope="module")
def fresh_local(tmp_path_factory) -> Path:
    """fixtures/generate_fsdp_local.py run anew into a temporary folder (2 ranks, about 15 s)."""
    out = tmp_path_factory.mktemp("fsdp_local")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "fixtures" / "generate_fsdp_local.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        pytest.fail(f"generate_fsdp_local.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return out


def roots(fresh: bool, fresh_local) -> Path:
    return fresh_local if fresh else FIXTURES_DIR


def expected(root: Path, name: str) -> dict:
    return torch.load(root / "expected" / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("fresh", [False, True], ids=["committed", "fresh"])
@pytest.mark.parametrize(("name", "reference"), CASES)
def test_consolidate_is_the_models_state_dict(ckpt, tmp_path, request, name, reference, fresh):
    root = request.getfixturevalue("fresh_local") if fresh else FIXTURES_DIR
    ref = root / "fsdp_local_ref" / reference
    want = expected(root, name)
    out = tmp_path / "model.safetensors"
    r = run_ckpt("consolidate", root / name, "-o", out, "--shapes-from", ref)
    assert r.returncode == 0, r.stderr
    assert_same_state(load_file(str(out)), want, f"{name} with {reference} -> safetensors")
    pt = tmp_path / "model.pt"
    r = run_ckpt("consolidate", root / name, "-o", pt, "--shapes-from", ref)
    assert r.returncode == 0, r.stderr
    got = torch.load(pt, weights_only=True)
    assert_same_state(flatten_like_dcp(got), want, f"{name} with {reference} -> torch.save")
    if name == "fsdp_local_orig":
        # saved as dcp.save({"model": ...}): consolidated under the same nesting
        assert list(got) == ["model"]


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_loads_with_dcp_load(ckpt, tmp_path, world):
    """ckpt's reshard of each LOCAL checkpoint, loaded by torch's dcp.load into Shard(0) DTensors
    on `world` ranks and gathered: bitwise the model's state dict."""
    job = {"loads": [], "saves": []}
    for name, reference in CASES:
        out = tmp_path / f"{name}_{reference}"
        r = run_ckpt("reshard", FIXTURES_DIR / name, "-o", out, "--world-size", world,
                     "--shapes-from", FIXTURES_DIR / "fsdp_local_ref" / reference)
        assert r.returncode == 0, r.stderr
        job["loads"].append({"id": f"{name}/{reference}", "ckpt": str(out),
                             "expected": str(FIXTURES_DIR / "expected" / f"{name}.pt")})
    jobfile, result = tmp_path / "job.json", tmp_path / "result.json"
    jobfile.write_text(json.dumps(job))
    proc = run_torchrun(HERE / "torchrun_load.py", world, jobfile, result, timeout=600)
    assert result.is_file(), f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    loads = json.loads(result.read_text())["loads"]
    assert sorted(loads) == sorted(item["id"] for item in job["loads"])
    failed = {k: v for k, v in loads.items() if v}
    assert not failed, failed


@pytest.mark.parametrize("name", LOCALS)
def test_without_shapes_from_the_error_says_what_to_pass(ckpt, tmp_path, name):
    out = tmp_path / "m.safetensors"
    r = run_ckpt("consolidate", FIXTURES_DIR / name, "-o", out)
    assert r.returncode == 2
    assert "FSDP1 LOCAL_STATE_DICT" in r.stderr and "_flat_param" in r.stderr
    assert "--shapes-from" in r.stderr and "named_parameters()" in r.stderr
    assert not out.exists()
    r = run_ckpt("reshard", FIXTURES_DIR / name, "-o", tmp_path / "rs", "--world-size", 2)
    assert r.returncode == 2 and "--shapes-from" in r.stderr
    r = run_ckpt("inspect", FIXTURES_DIR / name, "--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["state_dict_type"] == "LOCAL_STATE_DICT"
    assert len(doc["fsdp_local"]["flat_params"]) == 3


@pytest.mark.parametrize("name", LOCALS)
def test_a_wrong_shapes_list_is_refused_naming_the_unit(ckpt, tmp_path, name):
    params = json.loads((FIXTURES_DIR / "fsdp_local_ref" / "params.json").read_text())
    # one more row: the unit's parameters no longer add up to its flat parameter (a shape with the
    # same numel, e.g. transposed, cannot be told apart from the files)
    wrong = [[n, [s[0] + 1, *s[1:]] if n == "layers.0.lin.weight" else s] for n, s in params]
    ref = tmp_path / "wrong.json"
    ref.write_text(json.dumps(wrong))
    r = run_ckpt("consolidate", FIXTURES_DIR / name, "-o", tmp_path / "m.safetensors", "--shapes-from", ref)
    assert r.returncode == 1, r.stderr
    assert "layers.0` (`" in r.stderr and "does not match the flat parameter" in r.stderr
    assert not (tmp_path / "m.safetensors").exists()
