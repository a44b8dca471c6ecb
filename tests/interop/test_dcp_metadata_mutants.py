"""`.metadata` mutants of a DCP fixture: whatever PyTorch's `FileSystemReader.read_metadata` refuses,
`ckpt verify` must call unsound (exit 1); the near misses torch still reads, ckpt must read too."""

from __future__ import annotations

import os
import pickletools
import struct
from pathlib import Path

import pytest

from conftest import run_ckpt

FIXTURE = "fsdp2_adamw"


def _ops(data: bytes):
    return list(pickletools.genops(data))


def _refit_frame(data: bytes) -> bytes:
    """The one frame at byte 2 re-announced to cover everything after its length."""
    return data[:3] + struct.pack("<Q", len(data) - 11) + data[11:]


def _with_frame(n: int):
    return lambda data: data[:3] + struct.pack("<Q", n) + data[11:]


def _frame_grown(by: int):
    return lambda data: _with_frame(len(data) - 11 + by)(data)


def _frame_before_stop(n: int):
    # A second frame just before STOP announcing n bytes: only STOP's one byte follows.
    return lambda data: data[:-1] + b"\x95" + struct.pack("<Q", n) + b"."


def _persid_for_requires_grad(data: bytes) -> bytes:
    # The first NEWFALSE is the first `TensorProperties.requires_grad`: it becomes a persistent id of None.
    pos = next(pos for op, _, pos in _ops(data) if op.name == "NEWFALSE")
    return _refit_frame(data[:pos] + b"NQ" + data[pos + 1 :])


def _memory_format(value: int):
    def mutate(data: bytes) -> bytes:
        # The first `_MEM_FORMAT_ENCODING(0)`: STACK_GLOBAL, MEMOIZE, BININT1 0.
        ops = _ops(data)
        for i, (op, arg, _) in enumerate(ops):
            if op.name == "SHORT_BINUNICODE" and arg == "_MEM_FORMAT_ENCODING":
                for op2, arg2, pos in ops[i:]:
                    if op2.name == "BININT1":
                        assert arg2 == 0
                        return data[: pos + 1] + bytes([value]) + data[pos + 2 :]
        raise AssertionError("no memory format in the fixture")

    return mutate


def _key_replaced(key: str, opcode: bytes):
    # The first string `key` (a dict key in the fixture) becomes an empty list or dict.
    def mutate(data: bytes) -> bytes:
        ops = _ops(data)
        for (op, arg, pos), (_, _, end) in zip(ops, ops[1:]):
            if op.name == "SHORT_BINUNICODE" and arg == key:
                return _refit_frame(data[:pos] + opcode + data[end:])
        raise AssertionError(f"no {key!r} in the fixture")

    return mutate


def _key_fetches(key: str, cls: str):
    # The first string `key` becomes a LONG_BINGET of the first `cls` object (memoized before it).
    def mutate(data: bytes) -> bytes:
        ops = _ops(data)
        memo, last_global, found = 0, None, None
        names = []
        for i, (op, arg, pos) in enumerate(ops):
            if op.name == "SHORT_BINUNICODE":
                names.append(arg)
            if op.name == "STACK_GLOBAL":
                last_global = names[-1]
            if op.name == "MEMOIZE":
                if found is None and ops[i - 1][0].name in ("NEWOBJ", "REDUCE") and last_global == cls:
                    found = memo
                memo += 1
            if op.name == "SHORT_BINUNICODE" and arg == key and found is not None:
                end = ops[i + 1][2]
                return _refit_frame(data[:pos] + b"j" + struct.pack("<I", found) + data[end:])
        raise AssertionError(f"no {key!r} after a {cls}")

    return mutate


def _after_checkpoint_id(insert: bytes):
    # `StorageMeta.checkpoint_id` is a `PosixPath` (REDUCE, MEMOIZE): `insert` pops it and pushes
    # another value; the memo keeps the path, which nothing fetches again.
    def mutate(data: bytes) -> bytes:
        ops = _ops(data)
        i = next(i for i, (op, arg, _) in enumerate(ops) if op.name == "SHORT_BINUNICODE" and arg == "checkpoint_id")
        j = next(j for j in range(i, len(ops)) if ops[j][0].name == "REDUCE")
        assert ops[j + 1][0].name == "MEMOIZE"
        pos = ops[j + 2][2]
        return _refit_frame(data[:pos] + insert + data[pos:])

    return mutate


def _tensor_properties_state(insert: bytes):
    # Just before the first `TensorProperties`'s BUILD, `insert` replaces its state tuple.
    def mutate(data: bytes) -> bytes:
        ops = _ops(data)
        i = next(i for i, (op, arg, _) in enumerate(ops) if op.name == "SHORT_BINUNICODE" and arg == "TensorProperties")
        pos = next(pos for op, _, pos in ops[i:] if op.name == "BUILD")
        return _refit_frame(data[:pos] + insert + data[pos:])

    return mutate


def _s(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


_FLOAT32 = _s("torch") + _s("float32") + b"\x93"
_STRIDED = _s("torch.serialization") + _s("_get_layout") + b"\x93" + _s("torch.strided") + b"\x85R"
_CONTIGUOUS = (
    _s("torch.distributed.checkpoint.metadata") + _s("_MEM_FORMAT_ENCODING") + b"\x93K\x00\x85R"
)
_PROPERTIES = [_FLOAT32, _STRIDED, b"\x89", _CONTIGUOUS, b"\x89"]  # dtype, layout, grad, format, pin
_NAMES = ["dtype", "layout", "requires_grad", "memory_format", "pin_memory"]

# name -> (mutation, whether torch reads the result)
MUTANTS = {
    "frame-exact": (lambda d: d, True),
    "frame-short-by-1": (_frame_grown(-1), True),
    "frame-of-0": (_with_frame(0), True),
    "frame-long-by-1": (_frame_grown(1), False),
    "frame-long-by-100": (_frame_grown(100), False),
    "frame-2^63-1": (_with_frame(2**63 - 1), False),
    "frame-2^63": (_with_frame(2**63), False),
    "frame-u64-max": (_with_frame(2**64 - 1), False),
    "second-frame-of-1": (_frame_before_stop(1), True),
    "second-frame-of-2": (_frame_before_stop(2), False),
    "persid-in-tensor-properties": (_persid_for_requires_grad, False),
    "persid-at-root": (lambda d: _refit_frame(d[:-1] + b"Q."), False),
    "memory-format-1": (_memory_format(1), True),
    "memory-format-2": (_memory_format(2), True),
    "memory-format-3": (_memory_format(3), False),
    "memory-format-255": (_memory_format(255), False),
    # Keys ckpt does not look up: the metadata index's `index`, `version`, `storage_meta`.
    "list-as-index-key": (_key_replaced("index", b"]"), False),
    "dict-as-index-key": (_key_replaced("index", b"}"), False),
    "list-as-version-key": (_key_replaced("version", b"]"), False),
    "dict-as-storage-meta-key": (_key_replaced("storage_meta", b"}"), False),
    "list-as-save-id-key": (_key_replaced("save_id", b"]"), False),
    "chunk-as-index-key": (_key_fetches("index", "ChunkStorageMetadata"), False),
    "storage-info-as-save-id-key": (_key_fetches("save_id", "_StorageInfo"), False),
    "metadata-index-as-save-id-key": (_key_fetches("save_id", "MetadataIndex"), True),
    # `StorageMeta` is a plain dataclass: torch keeps whatever `checkpoint_id` holds.
    "checkpoint-id-list": (_after_checkpoint_id(b"0]"), True),
    "checkpoint-id-list-of-ints": (_after_checkpoint_id(b"0](K\x01K\x02e"), True),
    "checkpoint-id-dict": (_after_checkpoint_id(b"0}(K\x01K\x02u"), True),
    "checkpoint-id-int": (_after_checkpoint_id(b"0K\x07"), True),
    "checkpoint-id-none": (_after_checkpoint_id(b"0N"), True),
    "checkpoint-id-set": (_after_checkpoint_id(b"0\x8f(K\x01\x90"), True),
    # `TensorProperties.__setstate__` unpacks its state as a 5- or 6-sequence: a dict unpacks
    # into its keys, so torch refuses it however complete it is; a list is read as the tuple.
    "tensor-properties-dict-empty": (_tensor_properties_state(b"0}"), False),
    "tensor-properties-dict-2": (
        _tensor_properties_state(b"0}(" + _s("dtype") + _FLOAT32 + _s("layout") + _STRIDED + b"u"),
        False,
    ),
    "tensor-properties-dict-5": (
        _tensor_properties_state(
            b"0}(" + b"".join(_s(k) + v for k, v in zip(_NAMES, _PROPERTIES)) + b"u"
        ),
        False,
    ),
    "tensor-properties-list-5": (_tensor_properties_state(b"0](" + b"".join(_PROPERTIES) + b"e"), True),
    "tensor-properties-tuple-4": (_tensor_properties_state(b"0(" + b"".join(_PROPERTIES[:4]) + b"t"), False),
}


def _torch_reads(d: Path) -> bool:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.FileSystemReader(str(d)).read_metadata()
    except Exception:
        return False
    return True


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_verify_refuses_what_read_metadata_refuses(name, fixtures_dir, tmp_path):
    mutate, torch_reads = MUTANTS[name]
    src = fixtures_dir / FIXTURE
    d = tmp_path / FIXTURE
    d.mkdir()
    for f in os.listdir(src):
        if f != ".metadata":
            os.symlink(src / f, d / f)
    (d / ".metadata").write_bytes(mutate((src / ".metadata").read_bytes()))

    assert _torch_reads(d) == torch_reads, "torch's verdict on the mutant changed"
    r = run_ckpt("verify", d)
    out = r.stdout + r.stderr
    if torch_reads:
        assert r.returncode == 0, out
    else:
        assert r.returncode == 1, out
        assert ".metadata`," in out and "at byte" in out, out
