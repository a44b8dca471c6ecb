"""DCP saved with `serialization_format=SAFETENSORS` (fixtures/generate_dcp_safetensors_format.py:
2 ranks, Shard(0) DTensors incl. BF16 and odd dims, a replicated tensor, non-tensor values; plain and
with `_extensions=[ZStandard()]`). torch 2.15's own FileSystemReader cannot read these back (the
`.metadata` offsets point at the blob's start, not at each chunk), so the reference is the full
tensors the DTensors held before saving (fixtures/expected/dcp_sfmt*.pt):

- the fixtures are as the issue says: each tensor record's bytes are not a torch.save item, and
  torch's own reader fails on them;
- `inspect` lists every tensor with its chunks as `.metadata` has them, and the non-tensor values;
- `verify --deep` finds both sound;
- `consolidate` to safetensors and to torch.save gives the saved tensors bit for bit;
- `reshard` to plain DCP is loaded back by torch's `dcp.load` under torchrun at 2 and 3 ranks;
- a blob whose header disagrees with `.metadata` (dtype changed in place) is refused, naming the
  file and tensor.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ckpt_helpers import (
    SFMT_FIXTURE_NAMES,
    assert_same_state,
    flatten_like_dcp,
    load_expected,
    load_safetensors,
    run_torchrun,
)

HERE = __import__("pathlib").Path(__file__).resolve().parent


def tensors_of(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", SFMT_FIXTURE_NAMES)
def test_torch_cannot_read_the_fixture_back(fixtures_dir, name):
    """Why the expected files come from the DTensors before saving, not from torch's reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, doc = load_expected(fixtures_dir, name)
    path = fixtures_dir / doc["path"]
    md = dcp.FileSystemReader(str(path)).read_metadata()
    zstd = {tuple(s.transform_descriptors or ()) for s in md.storage_data.values()}
    assert zstd == ({("stream.zstd/1",)} if name.endswith("zstd") else {()})
    with pytest.raises(BaseException):  # CheckpointException is not an Exception
        dcp_to_torch_save(path, path.parent / "never-written.pt")
    assert not (path.parent / "never-written.pt").exists()


@pytest.mark.parametrize("name", SFMT_FIXTURE_NAMES)
def test_inspect_lists_tensors_chunks_and_values(run_ckpt, fixtures_dir, name):
    want, doc = load_expected(fixtures_dir, name)
    proc = run_ckpt("inspect", fixtures_dir / doc["path"], "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["format"] == "dcp"
    assert got["world_size"] == doc["world_size"] == 2
    tensors = {t["name"]: t for t in got["tensors"]}
    assert sorted(tensors) == sorted(doc["tensors"])
    for fqn, t in doc["tensors"].items():
        assert tensors[fqn]["dtype"] == t["dtype"], fqn
        assert tensors[fqn]["shape"] == t["shape"] == list(want[fqn].shape), fqn
        assert sorted([p["offsets"], p["sizes"]] for p in tensors[fqn]["pieces"]) == t["chunks"], fqn
    values = {v["name"]: v["value"] for v in got["non_tensors"]}
    assert values == {k: want[k] for k in doc["non_tensors"]}


@pytest.mark.parametrize("name", SFMT_FIXTURE_NAMES)
def test_verify_deep_is_sound(run_ckpt, fixtures_dir, name):
    _, doc = load_expected(fixtures_dir, name)
    proc = run_ckpt("verify", fixtures_dir / doc["path"], "--deep")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", SFMT_FIXTURE_NAMES)
def test_consolidate_to_safetensors_is_what_was_saved(run_ckpt, fixtures_dir, tmp_path, name):
    want, doc = load_expected(fixtures_dir, name)
    out = tmp_path / "model.safetensors"
    proc = run_ckpt("consolidate", fixtures_dir / doc["path"], "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_same_state(load_safetensors(out), tensors_of(want), name)


@pytest.mark.parametrize("name", SFMT_FIXTURE_NAMES)
def test_consolidate_to_torch_is_what_was_saved(run_ckpt, fixtures_dir, tmp_path, name):
    want, doc = load_expected(fixtures_dir, name)
    out = tmp_path / "model.pt"
    proc = run_ckpt("consolidate", fixtures_dir / doc["path"], "-o", out, "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    assert_same_state(flatten_like_dcp(torch.load(out, weights_only=True)), want, name)


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_is_loaded_back_by_torch_dcp(run_ckpt, fixtures_dir, tmp_path, world):
    jobs = {"loads": [], "saves": []}
    for name in SFMT_FIXTURE_NAMES:
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
    assert got["loads"] == {name: [] for name in SFMT_FIXTURE_NAMES}


@pytest.mark.parametrize("name", SFMT_FIXTURE_NAMES)
def test_a_blob_disagreeing_with_metadata_is_refused(run_ckpt, fixtures_dir, tmp_path, name):
    _, doc = load_expected(fixtures_dir, name)
    dst = tmp_path / name
    shutil.copytree(fixtures_dir / doc["path"], dst)
    # model.ramp is I32 in .metadata; say U32 in the blob's header (same length, so it stays valid)
    hits = []
    for f in sorted(dst.glob("*.distcp")):
        data = f.read_bytes()
        if b'"model.ramp":{"dtype":"I32"' in data:
            f.write_bytes(data.replace(b'"model.ramp":{"dtype":"I32"', b'"model.ramp":{"dtype":"U32"'))
            hits.append(f.name)
    assert hits
    proc = run_ckpt("consolidate", dst, "-o", tmp_path / "out.safetensors")
    assert proc.returncode != 0
    assert "model.ramp" in proc.stderr and "U32" in proc.stderr and "I32" in proc.stderr, proc.stderr
    assert any(h in proc.stderr for h in hits), proc.stderr
