"""`ckpt verify` against `torch.load(weights_only=True)` on mutants of a small torch.save file:
whatever torch refuses, verify must call not sound (exit 1); whatever torch reads, verify must
still call sound (exit 0).

Each mutant rewrites the records of one real torch.save archive with Python's zipfile (stored,
so both readers accept the framing) and changes one thing torch checks."""

from __future__ import annotations

import struct
import zipfile

import pytest
import torch

from conftest import run_ckpt

PKL_HEAD = b"\x80\x02}q\x00X\x01\x00\x00\x00aq\x01"  # {"a": <value>}


def pkl(value: bytes) -> bytes:
    return PKL_HEAD + value + b"s."


def replace(name: str, content: bytes):
    return lambda recs: [(n, content if n == f"base/{name}" else b) for n, b in recs]


def drop(name: str):
    return lambda recs: [(n, b) for n, b in recs if n != f"base/{name}"]


def add(name: str, content: bytes):
    return lambda recs: recs + [(f"base/{name}", content)]


def same(recs):
    return recs


# name -> (change to the record list, central-directory flag bit to set on one record or None)
MUTANTS = {
    # the version record, parsed by `std::stoll` and bounded to 1..=10
    "version_x": (replace("version", b"x"), None),
    "version_99": (replace("version", b"99"), None),
    "version_-1": (replace("version", b"-1"), None),
    "version_empty": (replace("version", b""), None),
    "version_0x3": (replace("version", b"0x3"), None),
    "version_huge": (replace("version", b"9" * 30), None),
    "version_missing": (drop("version"), None),
    "version_3_no_newline": (replace("version", b"3"), None),
    "version_10": (replace("version", b"10\n"), None),
    "version_padded": (replace("version", b"\t+3x"), None),
    "data_version_x": (add(".data/version", b"x"), None),
    "data_version_wins": (
        lambda recs: add(".data/version", b"3\n")(replace("version", b"x")(recs)),
        None,
    ),
    # `.storage_alignment`, parsed by Python's int()
    "alignment_x": (replace(".storage_alignment", b"x"), None),
    "alignment_empty": (replace(".storage_alignment", b""), None),
    "alignment_underscore": (replace(".storage_alignment", b" 6_4\n"), None),
    "alignment_negative": (replace(".storage_alignment", b"-1"), None),
    # `.data/serialization_id`, decoded as UTF-8
    "serialization_id_not_utf8": (replace(".data/serialization_id", b"\xff" * 20), None),
    "serialization_id_text": (replace(".data/serialization_id", b"abc"), None),
    "serialization_id_missing": (drop(".data/serialization_id"), None),
    # central-directory flags miniz refuses: bits 5 and 6 on a record torch reads, bit 13 anywhere
    "flag5_storage": (same, ("base/data/0", 5)),
    "flag6_storage": (same, ("base/data/0", 6)),
    "flag5_serialization_id": (same, ("base/.data/serialization_id", 5)),
    "flag6_data_pkl": (same, ("base/data.pkl", 6)),
    "flag13_storage": (same, ("base/data/0", 13)),
    "flag5_unread_record": (add("extra", b"zz"), ("base/extra", 5)),
    # pickle opcodes outside torch's weights-only unpickler
    "pkl_stray_frame": (replace("data.pkl", pkl(b"\x95\x02\0\0\0\0\0\0\0K\x01")), None),
    "pkl_protocol4": (
        replace("data.pkl", b"\x80\x04\x95\x0b\0\0\0\0\0\0\0}\x94\x8c\x01a\x94K\x01s."),
        None,
    ),
    "pkl_short_binbytes": (replace("data.pkl", pkl(b"C\x01x")), None),
    "pkl_plain_values": (
        replace("data.pkl", pkl(b"](K\x01M\x00\x01\x8a\x01\x05G?\xf0\0\0\0\0\0\0N\x88\x89)U\x01c\x8f\x87e")),
        None,
    ),
    # calls torch's weights-only unpickler cannot make
    "pkl_reduce_on_tuple": (replace("data.pkl", pkl(b"(K\x01t)R")), None),
    "pkl_reduce_on_ordered_dict": (
        replace("data.pkl", pkl(b"ccollections\nOrderedDict\n)R)R")),
        None,
    ),
    "pkl_size_two_args": (replace("data.pkl", pkl(b"ctorch\nSize\n(K\x01\x85K\x02\x85tR")), None),
    "pkl_size_float": (replace("data.pkl", pkl(b"ctorch\nSize\nG?\xf0\0\0\0\0\0\0\x85\x85R")), None),
    "pkl_size_no_args": (replace("data.pkl", pkl(b"ctorch\nSize\n)R")), None),
    "pkl_size_list_of_bools": (replace("data.pkl", pkl(b"ctorch\nSize\n]\x88a\x85R")), None),
    "pkl_ordered_dict_call": (replace("data.pkl", pkl(b"ccollections\nOrderedDict\n)R")), None),
}

# `_codecs.encode("a", name)`: torch refuses a name Python's `codecs.lookup` does not know
ENCODINGS = ["foo", "", "latin1", "LATIN-1", "latin 1", " latin--1 ", "latin.1", "u.t.f-8", "utf8",
             "iso-8859-1", "hex", "rot-13", "mbcs", "cp65001", "Windows_1252", "x-mac-japanese"]
for _enc in ENCODINGS:
    _e = _enc.encode()
    MUTANTS[f"pkl_encode_{_enc!r}"] = (
        replace(
            "data.pkl",
            pkl(b"c_codecs\nencode\n(X\x01\0\0\0aX" + struct.pack("<I", len(_e)) + _e + b"tR"),
        ),
        None,
    )

LATIN1_A = b"c_codecs\nencode\n(X\x01\0\0\0aX\x06\0\0\0latin1tR"  # b"a" as protocol 2 spells it
# what a text or bytes codec can encode: a str for the first, bytes for the second
for _name, _codec, _value in [
    ("latin1_euro", b"latin1", b"X\x03\0\0\0\xe2\x82\xac"),
    ("latin1_e_acute", b"latin1", b"X\x02\0\0\0\xc3\xa9"),
    ("ascii_e_acute", b"ascii", b"X\x02\0\0\0\xc3\xa9"),
    ("hex_bytes", b"hex", LATIN1_A),
    ("utf8_bytes", b"utf8", LATIN1_A),
]:
    MUTANTS[f"pkl_encode_{_name}"] = (
        replace(
            "data.pkl",
            pkl(b"c_codecs\nencode\n(" + _value + b"X" + struct.pack("<I", len(_codec)) + _codec + b"tR"),
        ),
        None,
    )

def build(path, records) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name, content in records:
            out.writestr(name, content)


def set_central_flag(path, record: str, bit: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_len] == record.encode():
            flags = struct.unpack_from("<H", data, at + 8)[0]
            struct.pack_into("<H", data, at + 8, flags | (1 << bit))
        at = data.find(b"PK\x01\x02", at + 4)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def base_records(tmp_path_factory) -> list:
    path = tmp_path_factory.mktemp("tsave") / "base.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, path)
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def torch_refuses(path) -> str | None:
    try:
        torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal counts
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def check(path) -> None:
    refusal = torch_refuses(path)
    got = run_ckpt("verify", path)
    if refusal is not None:
        assert got.returncode == 1, (
            f"torch refuses ({refusal}) but ckpt verify exits {got.returncode}:\n{got.stdout}{got.stderr}"
        )
    else:
        assert got.returncode == 0, f"torch reads it but ckpt verify refuses:\n{got.stderr}"


def test_rebuilt_base_is_read_by_both(ckpt, base_records, tmp_path):
    path = tmp_path / "base.pt"
    build(path, base_records)
    assert torch_refuses(path) is None
    assert run_ckpt("verify", path).returncode == 0


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_torch_save_mutant_agrees(ckpt, base_records, tmp_path, name):
    change, flag = MUTANTS[name]
    path = tmp_path / f"{name}.pt"
    build(path, change(list(base_records)))
    if flag is not None:
        set_central_flag(path, *flag)
    check(path)
