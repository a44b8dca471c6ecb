"""Scale in pieces (issue 10): FULL -> 1,048,576 pieces -> FULL, with the release binary.

A FULL safetensors of 2048 bf16 tensors [512, 64] (128 MiB of known data) is resharded by ckpt to
512 ranks, one piece per tensor per rank: 1,048,576 pieces and a .metadata of about 118 MB. Then
  (a) `ckpt verify` of the directory exits 0;
  (b) `ckpt consolidate` back to one .safetensors gives tensors byte-identical to the input;
  (c) PyTorch's `FileSystemReader(dir).read_metadata()` reads it: 2048 tensors of 512 chunks each;
  (d) PyTorch's `dcp_to_torch_save` converts it, and its tensors equal the input bitwise.

Every step runs as a child process under scripts/rss.py; its wall time and peak anonymous memory
(RssAnon of the process tree, sampled) are printed, never asserted on: scripts/bench --pieces is
where memory and time are judged. (d) dominates the module's time (PyTorch loads every piece as its
own torch.save item: minutes on a 2-core machine).

Needs a release ckpt in CKPT_RELEASE_BIN (scripts/test builds one and sets it); skipped without.
Marked `scale`: `scripts/test -m "not scale"` runs the interop suite without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_helpers import REPO, flatten_like_dcp

pytestmark = pytest.mark.scale

TENSORS = 2048
SHAPE = (512, 64)
RANKS = 512
PIECES = TENSORS * RANKS  # 1,048,576
SEED = 10
# generous: the times seen on a 2-core machine are well under these (see the module docstring)
CKPT_TIMEOUT = 1800
TORCH_TIMEOUT = 3600


def release_bin() -> Path:
    value = os.environ.get("CKPT_RELEASE_BIN")
    if not value:
        pytest.skip(
            "CKPT_RELEASE_BIN is not set: the scale test needs a release ckpt "
            "(scripts/test runs `cargo build --release` and sets it)"
        )
    path = Path(value)
    assert path.is_file(), f"CKPT_RELEASE_BIN={value} is not a file (run `cargo build --release`)"
    return path


def measured(name: str, cmd: list, logs: Path, timeout: float, report: list) -> tuple[int, str]:
    """Run `cmd` under scripts/rss.py; record (name, wall s, peak RssAnon MiB, rc) in `report`.
    Returns (exit code, the command's stdout+stderr)."""
    log = logs / f"{name.replace(' ', '_')}.log"
    argv = [sys.executable, str(REPO / "scripts" / "rss.py"), "--log", str(log), "--", *map(str, cmd)]
    env = dict(os.environ, NO_COLOR="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{name}: no result after {timeout} s: {' '.join(map(str, cmd))}")
    text = log.read_text(errors="replace") if log.exists() else ""
    try:
        j = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        pytest.fail(f"{name}: scripts/rss.py gave no result ({proc.returncode}): {out!r}\n{text[-4000:]}")
    report.append((name, j["wall_s"], j["rss_anon_kib"] / 1024, j["rc"]))
    return j["rc"], text


class Scale:
    """The module's shared state: input, its data, the 512-rank directory and the measurements."""

    def __init__(self, root: Path, ckpt: Path):
        self.root = root
        self.ckpt = ckpt
        self.logs = root / "logs"
        self.logs.mkdir()
        self.full = root / "full.safetensors"
        self.sharded = root / f"r{RANKS}"
        self.report: list = []
        self.data: np.ndarray | None = None

    def names(self) -> list:
        return [f"layers.{i}.weight" for i in range(TENSORS)]

    def expected(self, i: int) -> np.ndarray:
        """Tensor i of the input as int16 (the bf16 bits)."""
        return self.data[i].view(np.int16)


def write_input(scale: Scale) -> None:
    """Known finite bf16 data: seeded uint16 noise with bit 14 cleared (exponent never all ones),
    written by the safetensors library itself."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(SEED)
    data = rng.integers(0, 1 << 16, size=(TENSORS, *SHAPE), dtype=np.uint16) & np.uint16(0xBFFF)
    scale.data = data
    as_bf16 = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    # one clone each: save_file refuses tensors that share storage
    save_file({name: as_bf16[i].clone() for i, name in enumerate(scale.names())}, str(scale.full))


@pytest.fixture(scope="module")
def scale(tmp_path_factory, capsys_module_report) -> Scale:
    ckpt = release_bin()
    s = Scale(tmp_path_factory.mktemp("scale"), ckpt)
    write_input(s)
    rc, text = measured(
        f"ckpt reshard FULL -> {RANKS} ranks",
        [ckpt, "reshard", s.full, "-o", s.sharded, "--world-size", RANKS, "--quiet"],
        s.logs,
        CKPT_TIMEOUT,
        s.report,
    )
    assert rc == 0, f"ckpt reshard exited {rc}:\n{text[-4000:]}"
    meta = (s.sharded / ".metadata").stat().st_size
    files = sum(1 for _ in s.sharded.glob("*.distcp"))
    assert files == RANKS, f"{files} .distcp files, want {RANKS}"
    s.report.append((f".metadata {meta / 1e6:.0f} MB, {files} files", None, None, None))
    yield s
    capsys_module_report(s.report)


@pytest.fixture(scope="module")
def capsys_module_report(request):
    """Prints the module's measurements once at its end, past pytest's output capture."""
    started = time.perf_counter()

    def emit(report):
        capman = request.config.pluginmanager.getplugin("capturemanager")
        lines = [f"\ntest_scale ({PIECES:,} pieces, {TENSORS} x {list(SHAPE)} bf16, {RANKS} ranks):"]
        for name, wall, anon, rc in report:
            if wall is None:
                lines.append(f"  {name}")
                continue
            status = "" if rc == 0 else f"  EXIT {rc}"
            lines.append(
                f"  {name:<44} {wall:8.1f} s  {wall / PIECES * 1e6:7.1f} us/piece  "
                f"peak RssAnon {anon:7.1f} MiB{status}"
            )
        lines.append(f"  module total {time.perf_counter() - started:.0f} s")
        with capman.global_and_fixture_disabled():
            print("\n".join(lines), flush=True)

    return emit


def test_verify(scale):
    rc, text = measured(
        "ckpt verify", [scale.ckpt, "verify", scale.sharded], scale.logs, CKPT_TIMEOUT, scale.report
    )
    assert rc == 0, f"ckpt verify exited {rc}:\n{text[-4000:]}"
    assert str(PIECES) in text.replace(",", ""), f"verify does not report {PIECES} pieces:\n{text[-2000:]}"


def test_consolidate_is_byte_identical(scale):
    from safetensors.torch import load_file

    out = scale.root / "back.safetensors"
    rc, text = measured(
        "ckpt consolidate -> .safetensors",
        [scale.ckpt, "consolidate", scale.sharded, "-o", out, "--quiet"],
        scale.logs,
        CKPT_TIMEOUT,
        scale.report,
    )
    assert rc == 0, f"ckpt consolidate exited {rc}:\n{text[-4000:]}"
    assert_same_as_input(scale, load_file(str(out)))


READ_METADATA = """
import collections, json, sys
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
md = dcp.FileSystemReader(sys.argv[1]).read_metadata()
tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
chunks = collections.Counter(len(m.chunks) for m in tensors.values())
sizes = collections.Counter(tuple(m.size) for m in tensors.values())
rows = collections.Counter(tuple(c.sizes) for m in tensors.values() for c in m.chunks)
dtypes = collections.Counter(str(m.properties.dtype) for m in tensors.values())
print(json.dumps({
    "entries": len(md.state_dict_metadata),
    "tensors": len(tensors),
    "chunks_per_tensor": {str(k): v for k, v in chunks.items()},
    "sizes": {str(list(k)): v for k, v in sizes.items()},
    "chunk_sizes": {str(list(k)): v for k, v in rows.items()},
    "dtypes": dtypes,
    "storage_items": len(md.storage_data),
}))
"""


def test_torch_read_metadata(scale):
    rc, text = measured(
        "torch read_metadata",
        [sys.executable, "-c", READ_METADATA, scale.sharded],
        scale.logs,
        TORCH_TIMEOUT,
        scale.report,
    )
    assert rc == 0, f"read_metadata failed ({rc}):\n{text[-4000:]}"
    doc = json.loads(text.strip().splitlines()[-1])
    rows = SHAPE[0] // RANKS
    assert doc == {
        "entries": TENSORS,
        "tensors": TENSORS,
        "chunks_per_tensor": {str(RANKS): TENSORS},
        "sizes": {str(list(SHAPE)): TENSORS},
        "chunk_sizes": {str([rows, SHAPE[1]]): PIECES},
        "dtypes": {"torch.bfloat16": TENSORS},
        "storage_items": PIECES,
    }


def test_torch_dcp_to_torch_save(scale):
    out = scale.root / "torch.pt"
    rc, text = measured(
        "torch dcp_to_torch_save",
        [sys.executable, REPO / "scripts" / "torch_convert.py", "dcp_to_torch_save", scale.sharded, out],
        scale.logs,
        TORCH_TIMEOUT,
        scale.report,
    )
    assert rc == 0, f"dcp_to_torch_save failed ({rc}):\n{text[-4000:]}"
    assert_same_as_input(scale, flatten_like_dcp(torch.load(out, weights_only=True, mmap=True)))


def assert_same_as_input(scale, got: dict) -> None:
    """Every tensor of `got` has the input's name, dtype, shape and bits."""
    assert sorted(got) == sorted(scale.names()), "tensor names differ"
    bad = []
    for i, name in enumerate(scale.names()):
        t = got[name]
        if t.dtype != torch.bfloat16 or tuple(t.shape) != SHAPE:
            bad.append(f"{name}: {t.dtype} {list(t.shape)}")
        elif not np.array_equal(t.contiguous().view(torch.int16).numpy(), scale.expected(i)):
            bad.append(f"{name}: bytes differ")
    assert not bad, f"{len(bad)} tensors differ from the input, first: {bad[:5]}"
