"""Ctrl-C during an upload into S3 (moto_server on loopback, as test_s3.py starts it): ckpt exits
130 within seconds, its multipart uploads aborted, and nothing is left under the output's name nor
beside it (the journal of its uploads, `.NAME.ckpt-uploads/`, is removed once they are aborted)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ckpt_path
from test_s3 import BUCKET, S3Server

boto3 = pytest.importorskip("boto3")


def sparse_safetensors(path: Path, tensors: int, elems: int) -> None:
    """A FULL safetensors file of `tensors` F32 tensors of `elems` zeros each, sparse on disk."""
    header, at = {}, 0
    for i in range(tensors):
        header[f"layers.{i}.weight"] = {"dtype": "F32", "shape": [elems], "data_offsets": [at, at + 4 * elems]}
        at += 4 * elems
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + at)


@pytest.fixture
def s3():
    server = S3Server()
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


def start(server: S3Server, *args) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env, NO_COLOR="1")
    return subprocess.Popen(
        [str(ckpt_path()), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def keys(client) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET).get("Contents", [])]


def pending(client) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]


def test_ctrl_c_during_an_upload_aborts_it_and_leaves_nothing(s3, tmp_path):
    client = s3.client()
    # 8 ranks of 48 MiB: 3 upload parts each, sent one thread's worth at a time.
    src = tmp_path / "big.safetensors"
    sparse_safetensors(src, 16, 6 << 20)
    child = start(s3, "reshard", src, "-o", f"s3://{BUCKET}/out", "--world-size", "8", "--threads", "1", "-q")
    deadline = time.monotonic() + 20
    # Wait until parts are on their way: uploads started and the first part of one sent.
    while not any(client.list_parts(Bucket=BUCKET, Key=k, UploadId=u["UploadId"]).get("Parts")
                  for u in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
                  for k in [u["Key"]]):
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


def test_ctrl_c_while_the_metadata_is_written_leaves_no_object(s3, tmp_path):
    # 128 ranks of 1,024 tensors: a `.metadata` of 131,072 pieces, which the debug build takes
    # seconds to write, into a spool file in TMPDIR before any object is completed (and with 128
    # uploads open to abort).
    client = s3.client()
    src = tmp_path / "many.safetensors"
    sparse_safetensors(src, 1024, 1024)
    spool_root = tmp_path / "tmp"
    spool_root.mkdir()
    os.environ["TMPDIR"] = str(spool_root)
    try:
        child = start(s3, "reshard", src, "-o", f"s3://{BUCKET}/out", "--world-size", "128", "-q")
    finally:
        del os.environ["TMPDIR"]
    deadline = time.monotonic() + 40
    # The spool holds one file per output file, named by its index; `.metadata` is the last.
    while True:
        spools = list(spool_root.glob("ckpt-spool-*"))
        if spools and (spools[0] / "128").exists():
            break
        assert child.poll() is None, f"ckpt ended ({child.returncode}) before it was interrupted: {child.stderr.read()}"
        assert time.monotonic() < deadline, "the .metadata was not begun"
        time.sleep(0.01)
    time.sleep(0.2)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    took = time.monotonic() - sent
    assert child.returncode == 130, err
    assert took < 3, f"exited {took:.1f} s after SIGINT"
    assert pending(client) == []
    assert keys(client) == []
    assert list(spool_root.iterdir()) == []
