"""ckpt on Azure Blob Storage (`az://container/prefix`): Azurite, Microsoft's storage emulator
(`azurite-blob`, installed by scripts/test with npm into .node/), on 127.0.0.1 and a free port,
started and stopped here; containers and blobs made with azure-storage-blob.

The same code serves az:// as s3:// (object_store behind ckpt's storage seam), so these tests
check what could differ: that object_store's Azure client reads and writes every kind of output
byte for byte as a local run does, that Azure's multipart (Put Block, then Put Block List) leaves
nothing under the output name until the run commits, and that errors name Azure's variables."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckpt_helpers import FIXTURES_DIR, REPO, assert_same_state, load_expected, load_with_torch
from conftest import ckpt_path, free_port
from test_s3 import big, consolidate_args, fixture, same_tree  # noqa: F401 (big is a fixture)

AZURITE = REPO / ".node" / "node_modules" / ".bin" / "azurite-blob"
if not AZURITE.exists():
    pytest.skip(
        f"Azurite is not installed at {AZURITE} (scripts/test installs it with npm; "
        + ("npm is missing" if shutil.which("npm") is None else "run scripts/test")
        + ")",
        allow_module_level=True,
    )
if shutil.which("node") is None:
    pytest.skip("node is missing: Azurite cannot run", allow_module_level=True)
blob = pytest.importorskip("azure.storage.blob")

CONTAINER = "ckpt"
ACCOUNT = "devstoreaccount1"
# Azurite's well-known account key (the same in every installation).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

# A DCP, a zstd DCP, a FULL safetensors, split safetensors with their index and a torch.save.
AZ_FIXTURE_NAMES = ["fsdp2_adamw", "dcp_zstd", "single", "hf_split", "torch_save"]


class Azurite:
    """An azurite-blob process on loopback and the environment that points ckpt at it."""

    def __init__(self, location: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        location.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                str(AZURITE),
                "--blobHost", "127.0.0.1",
                "--blobPort", str(self.port),
                "--location", str(location),
                "--silent",
                # no data leaves the machine
                "--disableTelemetry",
                # azure-storage-blob may speak a newer API version than this Azurite knows
                "--skipApiVersionCheck",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(location / "azurite.log", "w"),
        )
        # object_store's emulator mode: account devstoreaccount1, path-style URLs, plain HTTP.
        self.env = {
            "AZURE_STORAGE_USE_EMULATOR": "true",
            "AZURITE_BLOB_STORAGE_URL": self.url,
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": KEY,
        }
        deadline = time.monotonic() + 60
        while True:
            try:
                self.service().get_service_properties(timeout=2)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"azurite did not start: {(location / 'azurite.log').read_text()}")
                time.sleep(0.2)

    def service(self):
        return blob.BlobServiceClient(
            account_url=f"{self.url}/{ACCOUNT}",
            credential={"account_name": ACCOUNT, "account_key": KEY},
        )

    def container(self, name: str = CONTAINER):
        return self.service().get_container_client(name)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def upload_tree(c, local: Path, prefix: str) -> None:
    files = [local] if local.is_file() else sorted(f for f in local.rglob("*") if f.is_file())
    for f in files:
        name = prefix if f == local else f"{prefix}/{f.relative_to(local).as_posix()}"
        with open(f, "rb") as data:
            c.upload_blob(name, data)


def download(c, name: str, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(c.download_blob(name).readall())


def download_tree(c, prefix: str, local: Path) -> list[str]:
    """Every blob under `prefix/` into `local`; returns the relative names."""
    names = []
    for b in c.list_blobs(name_starts_with=prefix + "/"):
        rel = b.name[len(prefix) + 1 :]
        download(c, b.name, local / rel)
        names.append(rel)
    return sorted(names)


def blobs(c, prefix: str = "") -> list[str]:
    """Committed blobs: what a reader of the container sees."""
    return sorted(b.name for b in c.list_blobs(name_starts_with=prefix))


@pytest.fixture(scope="module")
def az(tmp_path_factory):
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    try:
        c = server.container()
        c.create_container()
        for name in AZ_FIXTURE_NAMES:
            upload_tree(c, fixture(name), fixture(name).name)
        yield server
    finally:
        server.stop()


def run(server: Azurite | None, *args, env: dict | None = None, timeout: float = 180):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "AZURITE_"))}
    full["NO_COLOR"] = "1"
    full.update(server.env if server else {})
    full.update(env or {})
    return subprocess.run(
        [str(ckpt_path()), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=full
    )


def url(name: str) -> str:
    return f"az://{CONTAINER}/{fixture(name).name}"


# --- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", AZ_FIXTURE_NAMES)
def test_inspect_and_verify_deep_read_the_same_from_azure(az, name):
    local = run(az, "inspect", "--json", fixture(name))
    remote = run(az, "inspect", "--json", url(name))
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)

    local = run(az, "verify", "--deep", "--json", fixture(name))
    remote = run(az, "verify", "--deep", "--json", url(name))
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stdout + remote.stderr
    want, got = json.loads(local.stdout), json.loads(remote.stdout)
    assert got.pop("path") == url(name) and want.pop("path") == str(fixture(name))
    assert got == want
    against = run(az, "verify", url(name), "--against", fixture(name))
    assert against.returncode == 0, against.stdout + against.stderr


def test_the_endpoint_form_of_the_configuration(az):
    """A real account's configuration (name, key and an endpoint; no emulator mode) reads the
    same: object_store signs and addresses requests differently in the two modes."""
    env = {
        "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": KEY,
        "AZURE_ENDPOINT": f"{az.url}/{ACCOUNT}",
        "AZURE_ALLOW_HTTP": "true",
    }
    local = run(None, "inspect", "--json", fixture("fsdp2_adamw"))
    remote = run(None, "inspect", "--json", url("fsdp2_adamw"), env=env)
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)


@pytest.mark.parametrize("name", ["fsdp2_adamw", "hf_split", "torch_save"])
def test_consolidate_from_azure_to_local(az, name, tmp_path):
    extra = consolidate_args(name)
    (tmp_path / "local").mkdir()
    (tmp_path / "remote").mkdir()
    want, got = tmp_path / "local" / "out.safetensors", tmp_path / "remote" / "out.safetensors"
    a = run(az, "consolidate", fixture(name), "-o", want, *extra)
    b = run(az, "consolidate", url(name), "-o", got, *extra)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    assert got.read_bytes() == want.read_bytes()
    flat, _ = load_expected(FIXTURES_DIR, name)
    tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
    assert_same_state(load_with_torch(got), tensors, name)


# --- writing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["local", "azure"])
def test_consolidate_to_azure(az, source, tmp_path):
    """Single file (safetensors and torch.save) and split files, from disk and from Azure,
    uploaded byte for byte as a local run writes them, and nothing else left in the container."""
    src = fixture("fsdp2_adamw") if source == "local" else url("fsdp2_adamw")
    c = az.container()
    cases = [
        ("model.safetensors", []),
        ("model.pt", ["--format", "torch"]),
        ("split", ["--max-shard-size", "1KB"]),
    ]
    for name, extra in cases:
        (tmp_path / "want").mkdir(exist_ok=True)
        local = run(az, "consolidate", fixture("fsdp2_adamw"), "-o", tmp_path / "want" / name, *extra)
        assert local.returncode == 0, local.stderr
        dest = f"out-{source}/{name}"
        proc = run(az, "consolidate", src, "-o", f"az://{CONTAINER}/{dest}", *extra)
        assert proc.returncode == 0, proc.stderr
        assert f"az://{CONTAINER}/{dest}" in proc.stderr
        got = tmp_path / "got" / name
        if name == "split":
            names = download_tree(c, dest, got)
            assert "model.safetensors.index.json" in names and len(names) > 2
            same_tree(tmp_path / "want" / name, got)
            assert_same_state(load_with_torch(got), load_with_torch(tmp_path / "want" / name), "split")
        else:
            download(c, dest, got)
            assert got.read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    # No journal of uploads is left; the blobs are the outputs' and nothing else.
    want = sorted(
        f"out-{source}/{p.relative_to(tmp_path / 'want').as_posix()}"
        for p in (tmp_path / "want").rglob("*")
        if p.is_file()
    )
    assert blobs(c, f"out-{source}/") == want
    assert not [n for n in blobs(c) if "ckpt-uploads" in n]


@pytest.mark.parametrize("source", ["local", "azure"])
def test_reshard_to_azure_loads_in_torch(az, source, tmp_path):
    src = fixture("fsdp2_adamw") if source == "local" else url("fsdp2_adamw")
    dest = f"reshard-{source}"
    proc = run(az, "reshard", src, "-o", f"az://{CONTAINER}/{dest}", "--world-size", "3")
    assert proc.returncode == 0, proc.stderr
    local = run(az, "reshard", fixture("fsdp2_adamw"), "-o", tmp_path / "want", "--world-size", "3")
    assert local.returncode == 0, local.stderr
    got = tmp_path / "got"
    download_tree(az.container(), dest, got)
    same_tree(tmp_path / "want", got)
    flat, _ = load_expected(FIXTURES_DIR, "fsdp2_adamw")
    tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
    back = load_with_torch(got)  # torch's own DCP reader (dcp_to_torch_save)
    assert_same_state({k: back[k] for k in tensors}, tensors, "reshard to azure")
    assert run(az, "verify", "--deep", f"az://{CONTAINER}/{dest}").returncode == 0


def start(server, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "AZURITE_"))}
    env.update(NO_COLOR="1", **server.env)
    return subprocess.Popen(
        [str(ckpt_path()), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def wait_for_journal(c, prefix: str, proc) -> None:
    """Until the run has recorded its uploads (before it sends a part), then a little more."""
    deadline = time.monotonic() + 120
    while not blobs(c, prefix):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no upload started"
        time.sleep(0.02)
    time.sleep(0.3)
    assert proc.poll() is None, "the run ended before it could be killed"


def uncommitted(c, name: str) -> int:
    """Blocks put to `name` and not committed: Azure's open multipart upload."""
    try:
        _, pending = c.get_blob_client(name).get_block_list("uncommitted")
    except Exception:  # ResourceNotFoundError: no block was ever put there
        return 0
    return len(pending)


@pytest.mark.parametrize("target", ["file", "dcp"])
def test_killed_upload_leaves_no_checkpoint_and_a_rerun_works(az, big, tmp_path, target, spools):
    """Azure has no abort: object_store's abort_multipart does nothing and the blocks a killed run
    put stay uncommitted (the service drops them after a week). They are invisible to readers:
    no blob is listed under the output name until Put Block List commits it, and the rerun's
    commit discards them."""
    c = az.container()
    if target == "file":
        name, args = "killed.safetensors", ["consolidate"]
        marker = data = "killed.safetensors"
    else:
        name, args = "killed-dcp", ["reshard", "--world-size", "2"]
        marker, data = "killed-dcp/.metadata", "killed-dcp/__0_0.distcp"
    cmd = [args[0], big, "-o", f"az://{CONTAINER}/{name}", *args[1:]]
    proc = start(az, *cmd)
    wait_for_journal(c, f".{name}.ckpt-uploads/", proc)
    # Until some block is put: the kill lands mid-upload.
    deadline = time.monotonic() + 60
    while not uncommitted(c, data):
        assert proc.poll() is None and time.monotonic() < deadline, "no block was put"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    listed = blobs(c)
    assert marker not in listed and data not in listed, listed
    assert [n for n in listed if n.startswith(f".{name}.ckpt-uploads/")], listed
    assert uncommitted(c, data) > 0

    again = run(az, *cmd)
    assert again.returncode == 0, again.stderr
    assert spools() == [], "the killed run's spool was not removed"
    listed = blobs(c)
    assert marker in listed and not [n for n in listed if "ckpt-uploads" in n], listed
    assert uncommitted(c, data) == 0
    local = tmp_path / "want" / name
    local.parent.mkdir()
    assert run(az, *[str(a).replace(f"az://{CONTAINER}/{name}", str(local)) for a in cmd]).returncode == 0
    if target == "file":
        got = tmp_path / "got"
        download(c, name, got)
        assert got.read_bytes() == local.read_bytes()
    else:
        download_tree(c, name, tmp_path / "got")
        same_tree(local, tmp_path / "got")


def test_ctrl_c_leaves_no_blob(az, big):
    c = az.container()
    proc = start(az, "consolidate", big, "-o", f"az://{CONTAINER}/interrupted.safetensors")
    wait_for_journal(c, ".interrupted.safetensors.ckpt-uploads/", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    # The abort (a no-op on Azure) succeeded, so the journal is gone too.
    assert not [n for n in blobs(c) if "interrupted" in n], blobs(c)


# --- errors ----------------------------------------------------------------------------------


def test_missing_blob_and_container(az):
    proc = run(az, "inspect", f"az://{CONTAINER}/no-such-checkpoint")
    assert proc.returncode == 2, proc.stderr
    assert f"az://{CONTAINER}/no-such-checkpoint" in proc.stderr and "does not exist" in proc.stderr
    proc = run(az, "inspect", "az://no-such-container/x")
    assert proc.returncode == 1, proc.stderr
    assert "az://no-such-container/x" in proc.stderr, proc.stderr
    assert "hint: the container does not exist" in proc.stderr, proc.stderr
    # Azure's error text runs over lines (RequestId, Time): ckpt's error is one line and a hint.
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr
    assert "panicked" not in proc.stderr


def test_bad_credentials_name_azure_variables(az):
    wrong = "d3JvbmcgYWNjb3VudCBrZXk="  # base64, as a key is, but not the account's
    proc = run(az, "inspect", url("single"), env={"AZURE_STORAGE_ACCOUNT_KEY": wrong})
    assert proc.returncode == 1, proc.stderr
    assert url("single") in proc.stderr and "403" in proc.stderr, proc.stderr
    assert "AZURE_STORAGE_ACCOUNT_KEY" in proc.stderr and "AWS_" not in proc.stderr, proc.stderr


def test_refused_connection_names_azure_variables():
    env = {
        "AZURE_STORAGE_USE_EMULATOR": "true",
        "AZURITE_BLOB_STORAGE_URL": f"http://127.0.0.1:{free_port()}",
    }
    proc = run(None, "inspect", f"az://{CONTAINER}/x", env=env)
    assert proc.returncode == 1, proc.stderr
    assert f"az://{CONTAINER}/x" in proc.stderr and "AZURITE_BLOB_STORAGE_URL" in proc.stderr, proc.stderr
    assert "AWS_" not in proc.stderr, proc.stderr


def test_no_account_is_a_usage_error_naming_azure_variables():
    proc = run(None, "inspect", f"az://{CONTAINER}/x")
    assert proc.returncode == 2, proc.stderr
    assert "AZURE_STORAGE_ACCOUNT_NAME" in proc.stderr and "AWS_" not in proc.stderr, proc.stderr
