"""ckpt on S3-compatible object storage: a real S3 API server (`moto_server`, from the test venv)
on 127.0.0.1 and a free port, started and stopped here; buckets and objects made with boto3.

Every command reads `s3://bucket/prefix` as it reads a local path, and gives the same answer:
inspect's document, verify's checksums, and consolidate/reshard outputs byte for byte equal to
a run on the same checkpoint on disk (whose outputs the other interop tests hand to PyTorch),
and read back by PyTorch here too."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_helpers import (
    AGREE_FIXTURE_NAMES,
    FIXTURE_NAMES,
    MEGATRON_FIXTURE_NAMES,
    SFMT_FIXTURE_NAMES,
    FIXTURES_DIR,
    assert_same_state,
    load_expected,
    load_with_torch,
)
from conftest import ckpt_path, free_port

boto3 = pytest.importorskip("boto3")

BUCKET = "ckpt"

# Every layout ckpt reads that needs no other input (FSDP1 LOCAL needs --shapes-from).
S3_FIXTURE_NAMES = (
    FIXTURE_NAMES
    + MEGATRON_FIXTURE_NAMES
    + AGREE_FIXTURE_NAMES
    + SFMT_FIXTURE_NAMES
    + ["per_rank_fsdp2", "per_rank_mesh_2x2"]
)


class S3Server:
    """A moto_server process on loopback and the environment that points ckpt and boto3 at it."""

    def __init__(self, auth: bool = False, log: Path | None = None):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if auth:
            # moto checks every request's access key (and refuses unknown ones) from the first.
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        moto = Path(sys.executable).parent / "moto_server"
        self.proc = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            # moto_server logs one line per request to stderr: tests count the GETs.
            stderr=open(log, "w") if log else subprocess.DEVNULL,
            env=env,
        )
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }
        deadline = time.monotonic() + 60
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def upload_tree(client, local: Path, bucket: str, prefix: str) -> None:
    if local.is_file():
        client.upload_file(str(local), bucket, prefix)
        return
    for f in sorted(local.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(local).as_posix()}")


def download_tree(client, bucket: str, prefix: str, local: Path) -> list[str]:
    """Every object under `prefix/` into `local`; returns the relative names."""
    names = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            rel = o["Key"][len(prefix) + 1 :]
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, o["Key"], str(local / rel))
            names.append(rel)
    return sorted(names)


@contextlib.contextmanager
def counting_s3(tmp_path: Path, **trees: Path):
    """A moto_server of the test's own holding `trees` (prefix -> local path) in BUCKET, whose
    request log counts GETs: yields the server and `gets(prefix)`, the GETs so far of objects
    whose key starts with it."""
    log = tmp_path / "moto.log"
    server = S3Server(log=log)
    try:
        c = server.client()
        c.create_bucket(Bucket=BUCKET)
        for prefix, local in trees.items():
            upload_tree(c, local, BUCKET, prefix)
        yield server, lambda prefix: log.read_text().count(f"GET /{BUCKET}/{prefix}")
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    try:
        c = server.client()
        c.create_bucket(Bucket=BUCKET)
        for name in S3_FIXTURE_NAMES:
            path = FIXTURES_DIR / load_expected(FIXTURES_DIR, name)[1]["path"]
            upload_tree(c, path, BUCKET, path.name)
        yield server
    finally:
        server.stop()


def run(server: S3Server | None, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1")
    for k in list(env):
        if k.startswith("AWS_"):
            del env[k]
    if server is not None:
        env.update(server.env)
    return subprocess.run(
        [str(ckpt_path()), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def fixture(name: str) -> Path:
    return FIXTURES_DIR / load_expected(FIXTURES_DIR, name)[1]["path"]


def url(name: str) -> str:
    return f"s3://{BUCKET}/{fixture(name).name}"


@pytest.mark.parametrize("name", S3_FIXTURE_NAMES)
def test_inspect_reads_the_same_from_s3(s3, name):
    local = run(s3, "inspect", "--json", fixture(name))
    remote = run(s3, "inspect", "--json", url(name))
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)


@pytest.mark.parametrize("name", S3_FIXTURE_NAMES)
def test_verify_deep_and_against(s3, name):
    local = run(s3, "verify", "--deep", "--json", fixture(name))
    remote = run(s3, "verify", "--deep", "--json", url(name))
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stdout + remote.stderr
    want, got = json.loads(local.stdout), json.loads(remote.stdout)
    assert got.pop("path") == url(name) and want.pop("path") == str(fixture(name))
    assert got == want
    against = run(s3, "verify", url(name), "--against", fixture(name))
    assert against.returncode == 0, against.stdout + against.stderr
    back = run(s3, "verify", fixture(name), "--against", url(name))
    assert back.returncode == 0, back.stdout + back.stderr


def test_verify_against_finds_a_difference(s3):
    proc = run(s3, "verify", url("fsdp2_adamw"), "--against", url("mesh_2x2"))
    assert proc.returncode == 1, proc.stdout + proc.stderr


def consolidate_args(name: str) -> list[str]:
    # Fixtures holding dtypes safetensors lacks are consolidated to torch.save.
    if name.startswith("dtypes"):
        return ["--format", "torch"]
    return []


@pytest.mark.parametrize("name", S3_FIXTURE_NAMES)
def test_consolidate_from_s3_to_local(s3, name, tmp_path):
    extra = consolidate_args(name)
    ext = ".pt" if extra else ".safetensors"
    # torch.save names its records after the file: the same name in two directories.
    (tmp_path / "local").mkdir()
    (tmp_path / "remote").mkdir()
    want, got = tmp_path / "local" / f"out{ext}", tmp_path / "remote" / f"out{ext}"
    a = run(s3, "consolidate", fixture(name), "-o", want, *extra)
    b = run(s3, "consolidate", url(name), "-o", got, *extra)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    assert got.read_bytes() == want.read_bytes()
    if not extra:
        flat, _ = load_expected(FIXTURES_DIR, name)
        tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
        assert_same_state(load_with_torch(got), tensors, name)


def test_consolidate_split_from_s3(s3, tmp_path):
    a = run(s3, "consolidate", fixture("fsdp2_adamw"), "-o", tmp_path / "local", "--max-shard-size", "1KB")
    b = run(s3, "consolidate", url("fsdp2_adamw"), "-o", tmp_path / "remote", "--max-shard-size", "1KB")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert len(names) > 2
    assert names == sorted(p.name for p in (tmp_path / "remote").iterdir())
    for n in names:
        assert (tmp_path / "remote" / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n


def test_reshard_from_s3_to_local(s3, tmp_path):
    a = run(s3, "reshard", fixture("fsdp2_adamw"), "-o", tmp_path / "local", "--world-size", "3")
    b = run(s3, "reshard", url("fsdp2_adamw"), "-o", tmp_path / "remote", "--world-size", "3")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    names = sorted(p.name for p in (tmp_path / "local").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "remote").iterdir())
    for n in names:
        assert (tmp_path / "remote" / n).read_bytes() == (tmp_path / "local" / n).read_bytes(), n
    flat, _ = load_expected(FIXTURES_DIR, "fsdp2_adamw")
    got = load_with_torch(tmp_path / "remote")
    tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
    assert_same_state({k: got[k] for k in tensors}, tensors, "reshard from s3")


def test_missing_key_and_bucket(s3):
    proc = run(s3, "inspect", f"s3://{BUCKET}/no-such-checkpoint")
    assert proc.returncode == 2, proc.stderr
    assert "s3://ckpt/no-such-checkpoint" in proc.stderr and "does not exist" in proc.stderr
    proc = run(s3, "inspect", "s3://no-such-bucket/x")
    assert proc.returncode == 1, proc.stderr
    assert "s3://no-such-bucket/x" in proc.stderr and "bucket does not exist" in proc.stderr, proc.stderr
    assert "panicked" not in proc.stderr


def test_bad_urls_are_usage_errors(s3):
    for bad in ["http://ckpt/x", "s3:///x", "s3://ckpt/a//b", "s3://ckpt/a/../b"]:
        proc = run(s3, "inspect", bad)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert bad in proc.stderr, proc.stderr


def test_refused_connection_is_a_clear_error():
    env = S3Server.__new__(S3Server)
    port = free_port()
    env.env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    started = time.monotonic()
    proc = run(env, "inspect", "s3://ckpt/x")
    assert proc.returncode == 1, proc.stderr
    assert "s3://ckpt/x" in proc.stderr and "AWS_ENDPOINT_URL" in proc.stderr, proc.stderr
    assert time.monotonic() - started < 120


def test_bad_credentials_are_a_clear_error():
    server = S3Server(auth=True)
    try:
        proc = run(server, "inspect", "s3://ckpt/x")
        assert proc.returncode == 1, proc.stderr
        assert "s3://ckpt/x" in proc.stderr and "AWS_ACCESS_KEY_ID" in proc.stderr, proc.stderr
        assert "panicked" not in proc.stderr
    finally:
        server.stop()


# --- writing to object storage --------------------------------------------------------------


def same_tree(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.parametrize("source", ["local", "s3"])
def test_consolidate_to_s3(s3, source, tmp_path):
    """Single file (safetensors and torch.save) and split files, from disk and from S3, uploaded
    byte for byte as a local run writes them."""
    src = fixture("fsdp2_adamw") if source == "local" else url("fsdp2_adamw")
    c = s3.client()
    cases = [
        ("model.safetensors", []),
        ("model.pt", ["--format", "torch"]),
        ("split", ["--max-shard-size", "1KB"]),
    ]
    for name, extra in cases:
        (tmp_path / "want").mkdir(exist_ok=True)
        local = run(s3, "consolidate", fixture("fsdp2_adamw"), "-o", tmp_path / "want" / name, *extra)
        assert local.returncode == 0, local.stderr
        dest = f"out-{source}/{name}"
        proc = run(s3, "consolidate", src, "-o", f"s3://{BUCKET}/{dest}", *extra)
        assert proc.returncode == 0, proc.stderr
        assert f"s3://{BUCKET}/{dest}" in proc.stderr
        got = tmp_path / "got" / name
        if name == "split":
            got.mkdir(parents=True)
            names = download_tree(c, BUCKET, dest, got)
            assert "model.safetensors.index.json" in names and len(names) > 2
            same_tree(tmp_path / "want" / name, got)
            assert_same_state(load_with_torch(got), load_with_torch(tmp_path / "want" / name), "split")
        else:
            got.parent.mkdir(parents=True, exist_ok=True)
            c.download_file(BUCKET, dest, str(got))
            assert got.read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    # Nothing is left behind: no journal of uploads, no incomplete upload.
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=f"out-{source}/").get("Contents", [])]
    assert not [k for k in keys if "ckpt-uploads" in k], keys
    assert not c.list_multipart_uploads(Bucket=BUCKET).get("Uploads"), "uploads left open"


@pytest.mark.parametrize("source", ["local", "s3"])
def test_reshard_to_s3_loads_in_torch(s3, source, tmp_path):
    src = fixture("fsdp2_adamw") if source == "local" else url("fsdp2_adamw")
    dest = f"reshard-{source}"
    proc = run(s3, "reshard", src, "-o", f"s3://{BUCKET}/{dest}", "--world-size", "3")
    assert proc.returncode == 0, proc.stderr
    local = run(s3, "reshard", fixture("fsdp2_adamw"), "-o", tmp_path / "want", "--world-size", "3")
    assert local.returncode == 0, local.stderr
    got = tmp_path / "got"
    got.mkdir()
    download_tree(s3.client(), BUCKET, dest, got)
    same_tree(tmp_path / "want", got)
    flat, _ = load_expected(FIXTURES_DIR, "fsdp2_adamw")
    tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
    back = load_with_torch(got)  # torch's own DCP reader (dcp_to_torch_save)
    assert_same_state({k: back[k] for k in tensors}, tensors, "reshard to s3")
    assert run(s3, "verify", "--deep", f"s3://{BUCKET}/{dest}").returncode == 0


def test_existing_output_is_refused_without_force(s3):
    dest = f"s3://{BUCKET}/forced"
    assert run(s3, "reshard", fixture("fsdp2_adamw"), "-o", dest, "--world-size", "3").returncode == 0
    again = run(s3, "reshard", fixture("fsdp2_adamw"), "-o", dest, "--world-size", "2")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    forced = run(s3, "reshard", fixture("fsdp2_adamw"), "-o", dest, "--world-size", "2", "--force")
    assert forced.returncode == 0, forced.stderr
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix="forced/")["Contents"])
    # The old rank file __2_0 is gone with the old output.
    assert keys == ["forced/.metadata", "forced/__0_0.distcp", "forced/__1_0.distcp"], keys


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 160 MB FULL safetensors written by safetensors itself: large enough that an upload runs
    for a while, and that tensors cross upload parts (16 MiB)."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({f"layer.{i}.weight": torch.randn(1000, 5000, generator=g) for i in range(8)}, str(path))
    return path


def test_torch_save_crcs_across_upload_parts(s3, big, tmp_path):
    """torch.save records larger than an upload part: their CRCs are combined from the parts'."""
    want = tmp_path / "want" / "big.pt"
    want.parent.mkdir()
    assert run(s3, "consolidate", big, "-o", want, "--format", "torch").returncode == 0
    proc = run(s3, "consolidate", big, "-o", f"s3://{BUCKET}/crc/big.pt", "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    got = tmp_path / "got.pt"
    s3.client().download_file(BUCKET, "crc/big.pt", str(got))
    assert got.read_bytes() == want.read_bytes()


def start(server, *args):
    env = dict(os.environ, NO_COLOR="1", **server.env)
    return subprocess.Popen(
        [str(ckpt_path()), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def wait_for_journal(client, prefix: str, proc) -> None:
    deadline = time.monotonic() + 120
    while not client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no upload started"
        time.sleep(0.02)
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before it could be killed"


@pytest.mark.parametrize("target", ["file", "dcp"])
def test_killed_upload_leaves_no_checkpoint_and_a_rerun_works(s3, big, tmp_path, target, spools):
    import signal

    c = s3.client()
    if target == "file":
        name, args, marker = "killed.safetensors", ["consolidate"], "killed.safetensors"
    else:
        name, args, marker = "killed-dcp", ["reshard", "--world-size", "2"], "killed-dcp/.metadata"
    cmd = [args[0], big, "-o", f"s3://{BUCKET}/{name}", *args[1:]]
    proc = start(s3, *cmd)
    wait_for_journal(c, f".{name}.ckpt-uploads/", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = spools()
    assert len(left) == 1, left
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert marker not in keys, keys
    open_uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]
    assert any(k.startswith(name) for k in open_uploads), open_uploads

    again = run(s3, *cmd)
    assert again.returncode == 0, again.stderr
    assert spools() == [], "the killed run's spool was not removed"
    open_uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]
    assert not any(k.startswith(name) for k in open_uploads), f"not aborted: {open_uploads}"
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert marker in keys and not [k for k in keys if "ckpt-uploads" in k], keys
    local = tmp_path / "want" / name
    local.parent.mkdir()
    assert run(s3, *[str(a).replace(f"s3://{BUCKET}/{name}", str(local)) for a in cmd]).returncode == 0
    if target == "file":
        got = tmp_path / "got"
        c.download_file(BUCKET, name, str(got))
        assert got.read_bytes() == local.read_bytes()
    else:
        got = tmp_path / "got"
        got.mkdir()
        download_tree(c, BUCKET, name, got)
        same_tree(local, got)


def test_ctrl_c_aborts_its_uploads(s3, big, spools):
    import signal

    c = s3.client()
    proc = start(s3, "consolidate", big, "-o", f"s3://{BUCKET}/interrupted.safetensors")
    wait_for_journal(c, ".interrupted.safetensors.ckpt-uploads/", proc)
    assert len(spools()) == 1
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert spools() == [], "an interrupted run left its spool"
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert "interrupted.safetensors" not in keys and not [k for k in keys if "interrupted" in k], keys
    open_uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]
    assert "interrupted.safetensors" not in open_uploads, open_uploads


def test_manifest_in_s3(s3):
    dest = f"s3://{BUCKET}/manifests/fsdp2.json"
    wrote = run(s3, "verify", fixture("fsdp2_adamw"), "--write-manifest", dest)
    assert wrote.returncode == 0, wrote.stderr
    body = s3.client().get_object(Bucket=BUCKET, Key="manifests/fsdp2.json")["Body"].read()
    assert json.loads(body)
    # The same tensors in another layout, read from S3, check against the manifest in S3.
    same = run(s3, "verify", url("fsdp2_adamw"), "--manifest", dest)
    assert same.returncode == 0, same.stdout + same.stderr
    other = run(s3, "verify", url("mesh_2x2"), "--manifest", dest)
    assert other.returncode == 1, other.stdout + other.stderr


def test_s3_to_s3_reads_each_block_about_once(tmp_path):
    """S3 -> S3 of a 100 MB DCP (4 ranks) of a small transformer: the output (names sorted:
    layers 0, 1, 10, 11, ...) visits the rank files out of their order, and the files together
    outgrow the block cache (64 MiB). Each upload part's units read their small shards through
    the cache while other workers fetch; the blocks a unit had fetched used to be evicted before
    it copied them and were fetched again, and again (a 500 MB input did not finish in 5
    minutes). Eight workers (a machine with eight cores runs as many) make that certain here. Now
    the output matches the local run and each block is fetched a few times at most (the ZIP
    framing, the data, and workers missing the same block at once)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    d, ffn, vocab = 256, 768, 32000
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(39):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{n}_proj.weight"] = (d, d)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, d)
        shapes[p + "mlp.up_proj.weight"] = (ffn, d)
        shapes[p + "mlp.down_proj.weight"] = (d, ffn)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    full = tmp_path / "full.safetensors"
    save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}, str(full))
    dcp = tmp_path / "dcp"
    proc = run(None, "reshard", full, "-o", dcp, "--world-size", "4")
    assert proc.returncode == 0, proc.stderr
    want = tmp_path / "want.safetensors"
    assert run(None, "consolidate", dcp, "-o", want).returncode == 0
    with counting_s3(tmp_path, dcp=dcp) as (server, gets_of):
        gets_before = gets_of("dcp/")
        out = f"s3://{BUCKET}/out/model.safetensors"
        proc = run(server, "consolidate", f"s3://{BUCKET}/dcp", "-o", out, "--threads", "8", timeout=120)
        assert proc.returncode == 0, proc.stderr
        gets = gets_of("dcp/") - gets_before
        got = tmp_path / "got.safetensors"
        server.client().download_file(BUCKET, "out/model.safetensors", str(got))
        assert got.read_bytes() == want.read_bytes()
    blocks = sum(-(-f.stat().st_size // (4 << 20)) for f in dcp.iterdir())
    # Measured on 2 cores: 127 GETs for 29 blocks (some blocks fetched by two workers at once);
    # before, 2,866.
    assert gets <= 6 * blocks, f"{gets} GETs for {blocks} blocks of input"


def test_many_rank_files_come_in_one_get_each(tmp_path):
    """A DCP of 16 ranks (84 MB, 5 MB a rank file) in S3, consolidated: each rank file is fetched
    in one GET (its pieces written where they belong as it arrives), as a download fetches it,
    where the block-by-block copy fetched it a block or a piece at a time (at least 2 GETs a file
    here; about 23 at 512 ranks). The bytes equal the local run's: as saved, cast (`--dtype
    fp32`), from a 2-D mesh whose column shards are copied block by block, as torch.save, and
    resharded to 4 ranks (the last two hold ZIP CRCs)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    shapes = {"embed": (16384, 1024), "wide": (4096, 2048), "norm": (1024,), "odd": (1000, 3)}
    for i in range(4):
        shapes[f"layers.{i}.w"] = (2048, 2048)
    full = tmp_path / "full.safetensors"
    save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}, str(full))
    dcp, mesh = tmp_path / "dcp", tmp_path / "mesh"
    assert run(None, "reshard", full, "-o", dcp, "--world-size", "16").returncode == 0
    proc = run(None, "reshard", full, "-o", mesh, "--mesh", "4x4", "--placements", "S(0),S(1)")
    assert proc.returncode == 0, proc.stderr
    # name -> (input, command and flags, output name): torch.save names its records after the file,
    # so a case's output has the same name locally and from S3
    cases = {
        "plain": ("dcp", ["consolidate"], "model.safetensors"),
        "cast": ("dcp", ["consolidate", "--dtype", "fp32"], "model.safetensors"),
        "mesh": ("mesh", ["consolidate"], "model.safetensors"),
        "torch": ("dcp", ["consolidate", "--format", "torch"], "pytorch_model.bin"),
        "reshard": ("dcp", ["reshard", "--world-size", "4"], "dcp4"),
    }

    def convert(server, name: str, src, side: str) -> Path:
        command, *flags = cases[name][1]
        out = tmp_path / f"{side}-{name}" / cases[name][2]
        out.parent.mkdir()
        proc = run(server, command, src, "-o", out, *flags, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return out

    want = {name: convert(None, name, tmp_path / src, "want") for name, (src, _, _) in cases.items()}
    with counting_s3(tmp_path, dcp=dcp, mesh=mesh) as (server, gets_of):
        for name, (src, _, _) in cases.items():
            gets_before = gets_of(f"{src}/__")
            got = convert(server, name, f"s3://{BUCKET}/{src}", "got")
            if got.is_dir():
                same_tree(want[name], got)
            else:
                assert got.read_bytes() == want[name].read_bytes(), name
            gets = gets_of(f"{src}/__") - gets_before
            if src == "dcp":
                # One GET a rank file, and the first items opened to tell the checkpoint's items
                # from a safetensors-format file's (one per worker reading, at most). The
                # torch.save file and the resharded items hold ZIP CRCs, combined from the runs'.
                probes = max(2, os.cpu_count() or 1)
                assert gets <= 16 + probes, f"{name}: {gets} GETs for 16 rank files"


def test_many_items_are_opened_a_rank_file_at_a_time(tmp_path):
    """`inspect` and `verify` of a DCP in S3 open every item (each a small torch.save archive) to
    check its framing. A DCP of 16 ranks and 4,800 items: the items of each rank file come in
    GETs of many items each (here one per file), several files in flight, where opening them one
    by one made a GET per item (37,861 GETs and 2.5 minutes at 128 ranks in the bench). The
    reports equal the local ones."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    tensors = {f"layers.{i}.{p}": torch.randn(64, 48, generator=g) for i in range(100) for p in "abc"}
    full = tmp_path / "full.safetensors"
    save_file(tensors, str(full))
    dcp = tmp_path / "dcp"
    assert run(None, "reshard", full, "-o", dcp, "--world-size", "16").returncode == 0
    with counting_s3(tmp_path, dcp=dcp) as (server, gets_of):
        for args in (["inspect", "--json"], ["verify", "--json"]):
            local = run(None, *args, dcp)
            assert local.returncode == 0, local.stderr
            gets_before = gets_of("dcp/__")
            remote = run(server, *args, f"s3://{BUCKET}/dcp", timeout=120)
            assert remote.returncode == 0, remote.stdout + remote.stderr
            gets = gets_of("dcp/__") - gets_before
            want, got = json.loads(local.stdout), json.loads(remote.stdout)
            for report in (want, got):
                report.pop("path", None)
            assert got == want, args[0]
            # Each rank file holds 300 items (370 KB): one GET of all of them (16 here, and 1,033
            # opening them one by one).
            assert gets <= 2 * 16, f"{args[0]}: {gets} GETs for 4,800 items in 16 rank files"


def test_input_flags_that_name_files_read_them_from_s3(tmp_path):
    """`--merge-lora s3://…` (an adapter directory, with its adapter_model.safetensors and a
    config naming it) and `--hf-config s3://…` (a model directory: config.json and the tokenizer's
    files carried beside the weights) are read through storage like the checkpoint: the outputs
    equal those of the same flags given local paths."""
    lora = FIXTURES_DIR / "lora" / "adapter_apart"
    tt = FIXTURES_DIR / "torchtitan_qwen3"
    cases = {
        "lora": (["consolidate", lora / "model.safetensors", "-o", "{out}/merged.safetensors",
                  "--merge-lora", "{adapter}"], lora / "lora_adapter"),
        "hf": (["consolidate", tt / "step-2", "-o", "{out}/hf", "--hf-config", "{adapter}"], tt / "hf"),
    }
    with counting_s3(tmp_path, **{name: local for name, (_, local) in cases.items()}) as (server, _):
        for name, (args, local) in cases.items():
            outs = {}
            for where, adapter in (("local", local), ("s3", f"s3://{BUCKET}/{name}")):
                out = tmp_path / f"{name}_{where}"
                out.mkdir()
                filled = [str(a).replace("{out}", str(out)).replace("{adapter}", str(adapter)) for a in args]
                r = run(server, *filled)
                assert r.returncode == 0, f"{name} {where}: {r.stderr}"
                outs[where] = out
            same_tree(outs["local"], outs["s3"])
            assert sorted(p.name for p in outs["s3"].rglob("*") if p.is_file()), name
