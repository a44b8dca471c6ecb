"""Legacy (pre-1.6, non-zip) torch.save files and deflated torch.save zips, written by real
PyTorch (fixtures/generate_agree.py): ckpt reads them data-only and its output is what torch.load
gives, bit for bit; a damaged legacy file torch refuses, ckpt refuses too."""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys

import pytest
import torch

from ckpt_helpers import AGREE_FIXTURE_NAMES, assert_same_state, load_expected, load_safetensors
from conftest import FIXTURES_DIR, REPO, run_ckpt


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The fixtures written anew by the installed torch."""
    out = tmp_path_factory.mktemp("agree_fixtures")
    subprocess.run([sys.executable, str(REPO / "fixtures" / "generate_agree.py"), str(out)], check=True, cwd=REPO)
    return out


@pytest.mark.parametrize("where", ["committed", "fresh"])
@pytest.mark.parametrize("name", AGREE_FIXTURE_NAMES)
def test_consolidate_gives_what_torch_load_gives(ckpt, fresh, tmp_path, name, where):
    root = FIXTURES_DIR if where == "committed" else fresh
    flat, doc = load_expected(root, name)
    src = root / doc["path"]
    assert run_ckpt("verify", src, "--deep").returncode == 0
    assert_same_state(torch.load(src, weights_only=True), flat, "torch.load")

    out = tmp_path / "out.pt"
    r = run_ckpt("consolidate", src, "-o", out, "--format", "torch")
    assert r.returncode == 0, r.stderr
    assert_same_state(torch.load(out, weights_only=True), flat, f"{name} -> torch")

    out = tmp_path / "out.safetensors"
    r = run_ckpt("consolidate", src, "-o", out)
    assert r.returncode == 0, r.stderr
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert_same_state(load_safetensors(out), tensors, f"{name} -> safetensors")


def test_reshard_of_a_legacy_file_loads_in_torch(ckpt, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat, doc = load_expected(FIXTURES_DIR, "legacy_torch_save")
    r = run_ckpt("reshard", FIXTURES_DIR / doc["path"], "-o", tmp_path / "dcp", "--world-size", "2")
    assert r.returncode == 0, r.stderr
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    assert_same_state(torch.load(tmp_path / "back.pt", weights_only=True), flat, "legacy -> dcp")


# ---- damaged legacy files: torch.load(weights_only=True) decides


def _layout(data: bytes):
    """(end of each of the five pickles, [(key, offset of its count)])."""
    f = io.BytesIO(data)
    sizes = {}

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid):
            sizes[pid[2]] = pid[1].dtype.itemsize  # ('storage', torch.FloatStorage, key, ...)

        def find_class(self, module, name):
            if module == "torch._utils":
                return lambda *args: None  # the tensors themselves are not needed
            return super().find_class(module, name)

    ends = []
    for _ in range(5):
        value = Reader(f).load()
        ends.append(f.tell())
    storages, at = [], ends[-1]
    for key in value:
        storages.append((key, at))
        (count,) = struct.unpack_from("<q", data, at)
        at += 8 + count * sizes[key]
    assert at == len(data)
    return ends, storages


def _mutants(data: bytes) -> dict:
    ends, storages = _layout(data)
    _, last_at = storages[-1]
    _, first_at = storages[0]
    wrong_count = bytearray(data)
    struct.pack_into("<q", wrong_count, first_at, struct.unpack_from("<q", data, first_at)[0] + 1)
    keys = pickle.loads(data[ends[3] : ends[4]])
    extra_key = pickle.dumps(keys + ["999"], protocol=2)
    missing_key = pickle.dumps(keys[1:], protocol=2)
    return {
        "as_written": (data, True),
        "trailing_garbage": (data + b"junk" * 10, True),
        "truncated_in_last_storage": (data[:-1], False),
        "truncated_at_a_count": (data[: last_at + 4], False),
        "truncated_in_the_data_pickle": (data[: (ends[2] + ends[3]) // 2], False),
        "truncated_after_the_keys": (data[: ends[4]], False),
        "wrong_count": (bytes(wrong_count), False),
        "wrong_magic": (pickle.dumps(0x1950A86A20F9469CFC6D, protocol=2) + data[ends[0] :], False),
        "magic_as_small_int": (pickle.dumps(1, protocol=2) + data[ends[0] :], False),
        "wrong_protocol": (data[: ends[0]] + pickle.dumps(1000, protocol=2) + data[ends[1] :], False),
        "key_never_referenced": (data[: ends[3]] + extra_key + data[ends[4] :], False),
        # the list and the bytes no longer agree
        "key_not_listed": (data[: ends[3]] + missing_key + data[ends[4] :], False),
        # the first storage's bytes left out with its key: torch leaves that storage
        # uninitialized and still reads the file
        "storage_left_out": (data[: ends[3]] + missing_key + data[storages[1][1] :], None),
    }


def _torch_reads(path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal counts
        return False
    return True


@pytest.mark.parametrize(
    "name",
    [
        "as_written",
        "trailing_garbage",
        "truncated_in_last_storage",
        "truncated_at_a_count",
        "truncated_in_the_data_pickle",
        "truncated_after_the_keys",
        "wrong_count",
        "wrong_magic",
        "magic_as_small_int",
        "wrong_protocol",
        "key_never_referenced",
        "key_not_listed",
        "storage_left_out",
    ],
)
def test_damaged_legacy_files_agree_with_torch(ckpt, tmp_path, name):
    data = (FIXTURES_DIR / "legacy_torch_save.pt").read_bytes()
    mutant, torch_reads = _mutants(data)[name]
    path = tmp_path / f"{name}.pt"
    path.write_bytes(mutant)
    r = run_ckpt("verify", path)
    if torch_reads is None:
        # Deliberately stricter: a storage whose bytes the file does not hold is refused.
        assert _torch_reads(path)
        assert r.returncode == 1, r.stdout
        return
    assert _torch_reads(path) == torch_reads, "torch's verdict on the mutant changed"
    assert r.returncode == (0 if torch_reads else 1), r.stdout + r.stderr
