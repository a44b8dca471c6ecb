"""What detection costs in requests on object storage: a directory is listed once, and the
objects the listing showed are opened without a HEAD each.

A recording proxy (test_s3_throttle's, throttling nothing) in front of moto_server sees every
request. A checkpoint of 512 per-rank torch.save files is the case that matters: before the
listing was kept, detection sent a HEAD per file, one after another, and each missed probe a
HEAD and a LIST."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_s3 import BUCKET, run
# the S3 server and the recording proxy in front of it, as test_s3_reads.py sets them up
from test_s3_reads import recorder, s3  # noqa: F401
from test_s3_throttle import ThrottlingProxy

torch = pytest.importorskip("torch")

RANKS = 512


def requests(proxy: ThrottlingProxy) -> list[tuple[str, str, dict]]:
    """(method, key, query) of every request the proxy forwarded."""
    with proxy.lock:
        return [(req.method, req.key, req.query) for req, _ in proxy.seen]


def per_rank_files(tmp_path: Path) -> Path:
    """`RANKS` rank files of a per-rank save of plain values: a weight and a step equal on
    every rank (replicas, as a plain tensor saved by every rank is read)."""
    out = tmp_path / "ranks"
    out.mkdir()
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for r in range(RANKS):
        torch.save({"weight": weight, "step": 7}, out / f"model_world_size_{RANKS}_rank_{r}.pt")
    return out


def test_a_512_rank_directory_is_listed_once_and_no_file_gets_a_head(s3, recorder, tmp_path):
    ranks = per_rank_files(tmp_path)
    client = s3.client()
    for f in sorted(ranks.iterdir()):
        client.upload_file(str(f), BUCKET, f"ranks/{f.name}")

    local = run(None, "inspect", "--json", ranks)
    assert local.returncode == 0, local.stderr
    proc = run(recorder, "inspect", "--json", f"s3://{BUCKET}/ranks")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.replace(f"s3://{BUCKET}/ranks", str(ranks)) == local.stdout

    seen = requests(recorder)
    heads = [key for method, key, _ in seen if method == "HEAD"]
    lists = [key for method, key, _ in seen if method == "GET" and key in ("", "/")]
    gets = [key for method, key, _ in seen if method == "GET" and key not in ("", "/")]
    assert heads == [], f"{len(heads)} HEADs, e.g. {heads[:3]}"
    assert len(lists) == 1, f"{len(lists)} LISTs"
    # Each small file is fetched whole, once.
    assert len(gets) == RANKS, f"{len(gets)} GETs for {RANKS} files"
