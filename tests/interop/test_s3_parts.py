"""`--part I/N` into S3 (`moto_server`, started here as test_s3.py starts it): the parts of one
conversion, run one after another or killed and run again, share nothing but the bucket, and
leave the bytes a single run leaves in the same store, nothing under the output's name before
the last part is done, and no multipart upload open after the commit."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_helpers import assert_same_state, load_with_torch
from test_s3 import BUCKET, S3Server, download_tree, run, start, upload_tree

N = 3

# What each case writes: (command, flags, output name). Outputs span several 16 MiB upload parts
# per share; the torch.save file's central directory holds every record's CRC, so its last
# upload part waits for every share's CRCs.
CASES = {
    "split": ("consolidate", ["--max-shard-size", "40MB"], "model"),
    "dcp": ("reshard", ["--world-size", "4"], "dcp"),
    "torch": ("consolidate", ["--format", "torch"], "model.pt"),
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A server with a 96 MB FULL safetensors at `s3://ckpt/in/model.safetensors`."""
    server = S3Server()
    try:
        c = server.client()
        c.create_bucket(Bucket=BUCKET)
        d = tmp_path_factory.mktemp("s3_parts_in")
        g = torch.Generator().manual_seed(11)
        tensors = {f"layers.{i}.weight": torch.randn(4000, 1000, generator=g) for i in range(6)}
        tensors["norm.weight"] = torch.randn(1013, generator=g).to(torch.bfloat16)
        save_file(tensors, str(d / "model.safetensors"))
        upload_tree(c, d / "model.safetensors", BUCKET, "in/model.safetensors")
        server.tensors = tensors
        server.singles = {}
        yield server
    finally:
        server.stop()


SRC = f"s3://{BUCKET}/in/model.safetensors"


def keys(c, prefix: str = "") -> list[str]:
    out = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def open_uploads(c, prefix: str) -> list[str]:
    """Multipart uploads open under `prefix` (a test's own: the mixed-plans test leaves its
    unfinished run's open)."""
    got = c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in got]


def fetch(c, key: str, local: Path) -> dict[str, bytes]:
    """The output at `key` (an object or a prefix), by relative name."""
    local.mkdir(parents=True)
    if key in keys(c, key) and not keys(c, key + "/"):
        c.download_file(BUCKET, key, str(local / "model.pt"))
        return {"": (local / "model.pt").read_bytes()}
    names = download_tree(c, BUCKET, key, local)
    return {n: (local / n).read_bytes() for n in names}


def single(s3, tmp_path, case: str) -> dict[str, bytes]:
    """The bytes of a single run of `case` into the same store (made once)."""
    if case not in s3.singles:
        command, flags, name = CASES[case]
        key = f"single-{case}/{name}"
        proc = run(s3, command, SRC, "-o", f"s3://{BUCKET}/{key}", *flags)
        assert proc.returncode == 0, proc.stderr
        s3.singles[case] = fetch(s3.client(), key, tmp_path / "single")
    return s3.singles[case]


def part(s3, case: str, dest: str, i: int, *extra) -> "subprocess.CompletedProcess":  # noqa: F821
    command, flags, _ = CASES[case]
    return run(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", *flags, *extra, "--part", f"{i}/{N}")


@pytest.mark.parametrize("case", list(CASES))
def test_parts_give_the_bytes_of_a_single_run(s3, tmp_path, case):
    c = s3.client()
    want = single(s3, tmp_path, case)
    name = CASES[case][2]
    dest = f"parts-{case}/{name}"
    for i in range(N):
        proc = part(s3, case, dest, i)
        assert proc.returncode == 0, proc.stderr
        if i < N - 1:
            # Nothing under the output's name (the staging prefix is `.NAME.ckpt-parts/`).
            assert keys(c, dest) == [], keys(c, dest)
            assert f"{N - 1 - i} of {N} parts still missing" in proc.stderr, proc.stderr
            if i == N - 2:
                # verify names the part still to run, from the output's name or the prefix's.
                for path in [dest, f"parts-{case}/.{name}.ckpt-parts"]:
                    v = run(s3, "verify", f"s3://{BUCKET}/{path}")
                    assert v.returncode == 1, v.stdout + v.stderr
                    assert f"1 of {N} parts missing: {N - 1}" in v.stdout + v.stderr, v.stdout + v.stderr
        else:
            assert f"all {N} parts done: committed" in proc.stderr, proc.stderr
    got = fetch(c, dest, tmp_path / "parts")
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]
    assert keys(c, f"parts-{case}/.{name}.ckpt-parts") == []
    assert open_uploads(c, f"parts-{case}/") == []
    if case == "split":
        back = {}
        for f in sorted((tmp_path / "parts").glob("*.safetensors")):
            back.update(load_file(f))
    else:
        # torch's own readers: torch.load, and DCP's (dcp_to_torch_save)
        back = load_with_torch(tmp_path / "parts" / ("model.pt" if case == "torch" else ""))
    assert_same_state({k: back[k] for k in s3.tensors}, s3.tensors, case)


def test_parts_run_at_once_commit_once(s3, tmp_path):
    """Parts started together race for `run.json`: one's uploads win, the others' are aborted."""
    c = s3.client()
    want = single(s3, tmp_path, "split")
    dest = "together/model"
    command, flags, _ = CASES["split"]
    procs = [
        start(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", *flags, "--part", f"{i}/{N}")
        for i in range(N)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * N, [e.decode() for _, e in outs]
    committed = [e.decode() for _, e in outs if b"committed" in e]
    assert len(committed) == 1, [e.decode() for _, e in outs]
    got = fetch(c, dest, tmp_path / "parts")
    assert got == want
    assert open_uploads(c, "together/") == []


def test_killed_part_runs_again_to_the_same_bytes(s3, tmp_path, spools):
    c = s3.client()
    want = single(s3, tmp_path, "split")
    dest = "killed/model"
    command, flags, _ = CASES["split"]
    proc = start(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", *flags, "--part", f"1/{N}")
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no upload part arrived"
        sent = [
            p
            for u in c.list_multipart_uploads(Bucket=BUCKET, Prefix=dest).get("Uploads", [])
            for p in c.list_parts(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])
        ]
        if sent:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(spools()) == 1
    assert keys(c, dest) == []
    assert keys(c, f"killed/.model.ckpt-parts/done") == []
    for i in [1, 0, 2]:
        again = part(s3, "split", dest, i)
        assert again.returncode == 0, again.stderr
    assert spools() == []
    assert fetch(c, dest, tmp_path / "parts") == want
    assert open_uploads(c, "killed/") == []


@pytest.mark.parametrize("when", ["recorded", "completing"])
def test_killed_commit_is_finished_by_a_part_run_again(s3, tmp_path, when, spools):
    """The committer killed once it has recorded the upload parts' ids (`completing.json`), or
    once it has completed the first upload (the objects complete one by one, the index last): any
    part run again finishes the commit. The kill races the commit, which may finish first on an
    idle machine: the case is tried afresh until the kill lands inside the commit."""
    c = s3.client()
    want = single(s3, tmp_path, "split")
    command, flags, _ = CASES["split"]
    for attempt in range(6):
        dest = f"commit-killed-{when}-{attempt}/model"
        staging = f"commit-killed-{when}-{attempt}/.model.ckpt-parts"
        for i in range(N - 1):
            proc = part(s3, "split", dest, i)
            assert proc.returncode == 0, proc.stderr
        proc = start(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", *flags, "--part", f"{N - 1}/{N}")
        deadline = time.monotonic() + 120
        while not (keys(c, dest) if when == "completing" else keys(c, f"{staging}/completing.json")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the commit did not start"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if f"{staging}/run.json" in keys(c, staging) and f"{dest}/model.safetensors.index.json" not in keys(c, dest):
            break
    else:
        pytest.fail("in 6 tries the commit always ended before it could be killed")
    again = part(s3, "split", dest, 0)
    assert again.returncode == 0, again.stderr
    assert f"all {N} parts done: committed" in again.stderr, again.stderr
    assert fetch(c, dest, tmp_path / "parts") == want
    assert keys(c, staging) == [] and open_uploads(c, f"commit-killed-{when}-{attempt}/") == []
    assert spools() == []


def test_parts_of_another_plan_refuse_to_mix(s3):
    c = s3.client()
    dest = "mixed/model"
    first = part(s3, "split", dest, 0, "--dtype", "bf16")
    assert first.returncode == 0, first.stderr
    other = part(s3, "split", dest, 1)
    assert other.returncode == 2, other.stderr
    assert "holds a partitioned run of another input, other flags" in other.stderr, other.stderr
    # Both command lines are named: the run's, with --dtype, and this part's, without.
    assert "--dtype bf16" in other.stderr, other.stderr
    assert other.stderr.count("--part I/3") == 2, other.stderr
    assert keys(c, dest) == []


def test_parts_with_force_replace_an_output_at_the_commit(s3, tmp_path):
    """An existing output is refused without --force; with it, it stays whole until the commit,
    and the shards the new output lacks go after it."""
    c = s3.client()
    command, flags, name = CASES["split"]
    dest = "forced/model"
    old = run(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", *flags)
    assert old.returncode == 0, old.stderr
    before = {k: c.get_object(Bucket=BUCKET, Key=k)["ETag"] for k in keys(c, dest)}
    assert len(before) == 4, before  # three shards and the index
    refused = run(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", "--part", f"0/{N}")
    assert refused.returncode == 2 and "already exists" in refused.stderr, refused.stderr
    for i in range(N):
        proc = run(s3, command, SRC, "-o", f"s3://{BUCKET}/{dest}", "--force", "--part", f"{i}/{N}")
        assert proc.returncode == 0, proc.stderr
        if i < N - 1:
            assert {k: c.get_object(Bucket=BUCKET, Key=k)["ETag"] for k in keys(c, dest)} == before
    want = run(s3, command, SRC, "-o", tmp_path / "want.safetensors")
    assert want.returncode == 0, want.stderr
    assert keys(c, dest) == [f"{dest}/model.safetensors"]
    got = fetch(c, dest, tmp_path / "got")
    assert got == {"model.safetensors": (tmp_path / "want.safetensors").read_bytes()}
    assert open_uploads(c, "forced/") == []


def test_parts_from_s3_into_a_local_directory(s3, tmp_path):
    """The fingerprint of an input in a bucket is its objects' keys, sizes and ETags (a local
    input's is names, sizes and times)."""
    command, flags, name = CASES["split"]
    want, got = tmp_path / "single" / name, tmp_path / "parts" / name
    proc = run(s3, command, SRC, "-o", want, *flags)
    assert proc.returncode == 0, proc.stderr
    for i in range(N):
        proc = run(s3, command, SRC, "-o", got, *flags, "--part", f"{i}/{N}")
        assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in want.iterdir())
    assert names == sorted(p.name for p in got.iterdir())
    assert all((want / n).read_bytes() == (got / n).read_bytes() for n in names)

