"""`--part I/N` into Azure Blob Storage (Azurite, started here as test_azure.py starts it). Azure's
multipart is a block blob's blocks, put by any process that names the blob and committed by one
Put Block List: the parts put their blocks, their markers carry the block ids, and the part that
commits lists them. The output is the bytes a single run leaves in the same container, nothing is
listed under its name before the last part, and a killed part run again changes nothing."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_helpers import assert_same_state, load_with_torch
from test_azure import CONTAINER, Azurite, blobs, download, download_tree, run, start, uncommitted, upload_tree

N = 3

CASES = {
    "split": ("consolidate", ["--max-shard-size", "40MB"], "model"),
    "dcp": ("reshard", ["--world-size", "4"], "dcp"),
    "torch": ("consolidate", ["--format", "torch"], "model.pt"),
}
SRC = f"az://{CONTAINER}/in/model.safetensors"


@pytest.fixture(scope="module")
def az(tmp_path_factory):
    """Azurite with a 96 MB FULL safetensors at `az://ckpt/in/model.safetensors`."""
    server = Azurite(tmp_path_factory.mktemp("azurite_parts"))
    try:
        c = server.container()
        c.create_container()
        d = tmp_path_factory.mktemp("az_parts_in")
        g = torch.Generator().manual_seed(11)
        tensors = {f"layers.{i}.weight": torch.randn(4000, 1000, generator=g) for i in range(6)}
        tensors["norm.weight"] = torch.randn(1013, generator=g).to(torch.bfloat16)
        save_file(tensors, str(d / "model.safetensors"))
        upload_tree(c, d / "model.safetensors", "in/model.safetensors")
        server.tensors = tensors
        server.singles = {}
        yield server
    finally:
        server.stop()


def fetch(c, name: str, local: Path) -> dict[str, bytes]:
    """The output at `name` (a blob or a prefix), by relative name."""
    local.mkdir(parents=True)
    if blobs(c, name) == [name]:
        download(c, name, local / "model.pt")
        return {"": (local / "model.pt").read_bytes()}
    names = download_tree(c, name, local)
    return {n: (local / n).read_bytes() for n in names}


def single(az, tmp_path, case: str) -> dict[str, bytes]:
    """The bytes of a single run of `case` into the same container (made once)."""
    if case not in az.singles:
        command, flags, name = CASES[case]
        dest = f"single-{case}/{name}"
        proc = run(az, command, SRC, "-o", f"az://{CONTAINER}/{dest}", *flags)
        assert proc.returncode == 0, proc.stderr
        az.singles[case] = fetch(az.container(), dest, tmp_path / "single")
    return az.singles[case]


def part(az, case: str, dest: str, i: int, *extra):
    command, flags, _ = CASES[case]
    return run(az, command, SRC, "-o", f"az://{CONTAINER}/{dest}", *flags, *extra, "--part", f"{i}/{N}")


@pytest.mark.parametrize("case", list(CASES))
def test_parts_give_the_bytes_of_a_single_run(az, tmp_path, case):
    c = az.container()
    want = single(az, tmp_path, case)
    name = CASES[case][2]
    dest = f"parts-{case}/{name}"
    for i in range(N):
        proc = part(az, case, dest, i)
        assert proc.returncode == 0, proc.stderr
        if i < N - 1:
            assert blobs(c, dest) == [], blobs(c, dest)
        else:
            assert f"all {N} parts done: committed" in proc.stderr, proc.stderr
    got = fetch(c, dest, tmp_path / "parts")
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]
    assert blobs(c, f"parts-{case}/.{name}.ckpt-parts") == []
    # The commit's block lists left no block of any part uncommitted.
    assert all(uncommitted(c, f"{dest}/{k}" if k else dest) == 0 for k in got)
    if case == "split":
        back = {}
        for f in sorted((tmp_path / "parts").glob("*.safetensors")):
            back.update(load_file(f))
    else:
        back = load_with_torch(tmp_path / "parts" / ("model.pt" if case == "torch" else ""))
    assert_same_state({k: back[k] for k in az.tensors}, az.tensors, case)


def test_killed_part_runs_again_to_the_same_bytes(az, tmp_path, spools):
    c = az.container()
    want = single(az, tmp_path, "split")
    dest = "killed/model"
    command, flags, _ = CASES["split"]
    proc = start(az, command, SRC, "-o", f"az://{CONTAINER}/{dest}", *flags, "--part", f"1/{N}")
    deadline = time.monotonic() + 120
    while not any(uncommitted(c, f"{dest}/{k}") for k in want):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no block was put"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert blobs(c, dest) == []
    for i in [1, 0, 2]:
        again = part(az, "split", dest, i)
        assert again.returncode == 0, again.stderr
    assert fetch(c, dest, tmp_path / "parts") == want
    assert all(uncommitted(c, f"{dest}/{k}") == 0 for k in want)
    assert spools() == []


def test_parts_of_another_plan_refuse_to_mix(az):
    first = part(az, "split", "mixed/model", 0, "--dtype", "bf16")
    assert first.returncode == 0, first.stderr
    other = part(az, "split", "mixed/model", 1)
    assert other.returncode == 2, other.stderr
    assert "holds a partitioned run of another input, other flags" in other.stderr, other.stderr
    assert "--dtype bf16" in other.stderr, other.stderr
    assert blobs(az.container(), "mixed/model") == []
