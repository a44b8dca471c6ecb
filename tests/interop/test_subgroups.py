"""Checkpoints saved by process groups that are not the whole job (fixtures/generate_subgroups.py,
real torch on 4 CPU ranks): FSDP1 on a 3-rank subgroup (files named by the group's ranks, shards
placed on them), FSDP1 HYBRID_SHARD (every replica group saves the same shards, files named by
the job's ranks) and FSDP2 HSDP (`(Replicate, Shard(0))` DTensors) saved per rank and with
`dcp.save`. Each consolidates bitwise to what torch held, reshards to a DCP torch's own reader
loads, and `verify --deep` checks that repeated shards hold the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_helpers import assert_same_state, load_safetensors

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
NAMES = ["subgroup_fsdp1", "hybrid_fsdp1", "hsdp_fsdp2", "hsdp_fsdp2_dcp"]


def want(name: str) -> dict:
    return torch.load(FIXTURES / "expected" / f"{name}.pt", weights_only=True)


@pytest.mark.parametrize("name", NAMES)
def test_consolidate_equals_what_torch_held(run_ckpt, tmp_path, name):
    out = tmp_path / "out.safetensors"
    proc = run_ckpt("consolidate", FIXTURES / name, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_same_state(load_safetensors(out), want(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_reshard_gives_a_dcp_torch_reads(run_ckpt, tmp_path, name):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "dcp"
    proc = run_ckpt("reshard", FIXTURES / name, "-o", out, "--world-size", "3")
    assert proc.returncode == 0, proc.stderr
    dcp_to_torch_save(out, tmp_path / "full.pt")
    nested = torch.load(tmp_path / "full.pt", weights_only=True)
    flat = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            flat[k] = v
    assert_same_state(flat, want(name), name)


@pytest.mark.parametrize("name", NAMES)
def test_verify_deep_is_sound(run_ckpt, name):
    proc = run_ckpt("verify", "--deep", FIXTURES / name)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_replica_group_holding_other_bytes_fails_deep_verify(run_ckpt, tmp_path):
    """Hybrid sharding saves every shard once per replica group: the copies must agree."""
    import shutil

    import json
    import shutil
    import struct
    import zipfile

    src = tmp_path / "hybrid"
    shutil.copytree(FIXTURES / "hybrid_fsdp1", src)
    doc = json.loads(run_ckpt("inspect", src, "--json").stdout)
    piece = next(p for p in doc["tensors"][0]["pieces"] if p["file"] == "rank2.pt")
    # Rewrite rank2.pt with one element of that shard changed (the archive rewritten, so every
    # record's CRC is right and only the replicas disagree).
    victim = src / "rank2.pt"
    raw = victim.read_bytes()
    shard = raw[piece["byte_offset"] : piece["byte_offset"] + piece["byte_length"]]
    with zipfile.ZipFile(victim) as z:
        infos = z.infolist()
        records = {i.filename: z.read(i) for i in infos}
    name = next(n for n, data in records.items() if "/data/" in n and shard in data)
    data = bytearray(records[name])
    at = data.index(shard)
    (value,) = struct.unpack_from("<f", data, at)
    struct.pack_into("<f", data, at, value + 1.0)
    records[name] = bytes(data)
    with zipfile.ZipFile(victim, "w", compression=zipfile.ZIP_STORED) as z:
        for i in infos:
            z.writestr(i.filename, records[i.filename])
    assert run_ckpt("verify", src).returncode == 0
    proc = run_ckpt("verify", "--deep", src)
    assert proc.returncode == 1, proc.stdout
    assert "NOT sound" in proc.stdout


def test_a_subgroup_named_by_job_ranks_is_whole(run_ckpt, tmp_path):
    """The subgroup's members are job ranks 1, 2 and 3: files named by those (as
    `torch.save(sd, f"rank{dist.get_rank()}.pt")` names them) have no rank 0, and are still every
    file of the group that saved them."""
    import shutil

    src = tmp_path / "by_job_rank"
    src.mkdir()
    for group_rank in range(3):
        shutil.copy(FIXTURES / "subgroup_fsdp1" / f"rank{group_rank}.pt", src / f"rank{group_rank + 1}.pt")
    out = tmp_path / "out.safetensors"
    proc = run_ckpt("consolidate", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert_same_state(load_safetensors(out), want("subgroup_fsdp1"), "by job rank")
    doc = run_ckpt("inspect", src, "--json")
    assert doc.returncode == 0, doc.stderr
    import json

    assert json.loads(doc.stdout)["world_size"] == 3
    assert run_ckpt("verify", "--deep", src).returncode == 0

    # One member's file gone: the group's pieces no longer cover the tensors, and the error
    # names the missing file (the names alone cannot tell which).
    (src / "rank2.pt").unlink()
    proc = run_ckpt("consolidate", src, "-o", tmp_path / "partial.safetensors")
    assert proc.returncode == 1, proc.stderr
    assert "rank" in proc.stderr and "missing" in proc.stderr, proc.stderr
    assert not (tmp_path / "partial.safetensors").exists()
