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


def _x(text: bytes) -> bytes:
    """BINUNICODE of raw bytes (UTF-8, or with lone surrogates as Python's `surrogatepass`)."""
    return b"X" + struct.pack("<I", len(text)) + text


def _long1(value: int) -> bytes:
    n = (value.bit_length() + 8) // 8
    return b"\x8a" + bytes([n]) + value.to_bytes(n, "little", signed=True)


EURO, SURROGATE = "€".encode(), b"\xed\xa0\x80"  # U+20AC; U+D800 as pickle spells it
# `_codecs.encode(text, codec, errors)`: the handler decides what a codec lacks
for _name, _text, _codec, _errors in [
    ("euro_latin1_ignore", EURO, b"latin1", b"ignore"),
    ("euro_latin1_replace", EURO, b"latin1", b"replace"),
    ("euro_latin1_unknown_handler", EURO, b"latin1", b"foo"),
    ("a_latin1_unknown_handler", b"a", b"latin1", b"foo"),  # looked up only when needed
    ("euro_ascii_xmlcharrefreplace", EURO, b"ascii", b"xmlcharrefreplace"),
    ("euro_ascii_strict", EURO, b"ascii", b"strict"),
    ("euro_cp1252", EURO, b"cp1252", None),  # Python encodes it; ckpt cannot tell, refuses
    ("euro_cp437", EURO, b"cp437", None),
    ("surrogate_utf8", SURROGATE, b"utf8", None),
    ("surrogate_utf8_surrogatepass", SURROGATE, b"utf8", b"surrogatepass"),
    ("surrogate_latin1_surrogatepass", SURROGATE, b"latin1", b"surrogatepass"),
    ("surrogate_latin1", SURROGATE, b"latin1", None),
    ("escaped_byte_ascii_surrogateescape", "\udc80".encode("utf-8", "surrogatepass"), b"ascii", b"surrogateescape"),
    ("a_idna_ignore", b"a", b"idna", b"ignore"),
]:
    _args = _x(_text) + _x(_codec) + (b"" if _errors is None else _x(_errors))
    MUTANTS[f"pkl_encode_{_name}"] = (replace("data.pkl", pkl(b"c_codecs\nencode\n(" + _args + b"tR")), None)
MUTANTS["pkl_encode_errors_int"] = (
    replace("data.pkl", pkl(b"c_codecs\nencode\n(" + _x(b"a") + _x(b"latin1") + b"K\x01tR")),
    None,
)

SET = b"cbuiltins\nset\n"
FROZENSET = b"cbuiltins\nfrozenset\n"
BIG = 2**64
# plain values torch's weights-only unpickler makes, or refuses to make
for _name, _value in {
    # sets and their items, and sets as keys (protocol 2 spells a set `set([...])`)
    "set_of_ints": SET + b"](K\x01K\x02e\x85R",
    "set_of_str": SET + _x(b"ab") + b"\x85R",
    "set_of_list": SET + b"](]e\x85R",
    "set_of_set": SET + b"](" + SET + b")Re\x85R",
    "set_of_dict": SET + b"](}e\x85R",
    "set_two_args": SET + b"])\x86R",
    "set_of_int": SET + b"K\x01\x85R",
    "set_as_key": b"}" + SET + b"](K\x01e\x85RK\x02s",
    "frozenset": FROZENSET + b"](K\x01K\x02e\x85R",
    "frozenset_as_key": b"}" + FROZENSET + b"](K\x01e\x85RK\x02s",
    "set_of_frozenset": SET + b"](" + FROZENSET + b")Re\x85R",
    # NEWOBJ needs a class, REDUCE a callable, BUILD an instance that takes the state
    "newobj_set": SET + b")\x81",
    "newobj_ordered_dict": b"ccollections\nOrderedDict\n)\x81",
    "newobj_dtype": b"ctorch\nfloat32\n)\x81",
    "newobj_storage_class": b"ctorch\nFloatStorage\n)\x81",
    "newobj_function": b"ctorch._utils\n_rebuild_tensor_v2\n)\x81",
    "newobj_encode": b"c_codecs\nencode\n)\x81",
    "reduce_dtype": b"ctorch\nfloat32\n)R",
    "reduce_storage_class": b"ctorch\nFloatStorage\n)R",
    "build_empty_on_set": SET + b")R}b",
    "build_items_on_set": SET + b")R}(" + _x(b"x") + b"K\x01ub",
    "build_items_on_size": b"ctorch\nSize\n)R}(" + _x(b"x") + b"K\x01ub",
    "build_items_on_ordered_dict": b"ccollections\nOrderedDict\n)R}(" + _x(b"x") + b"K\x01ub",
    "build_on_bytes": b"c_codecs\nencode\n" + _x(b"a") + _x(b"latin1") + b"\x86R}b",
    "build_on_int": b"K\x01}b",
    "build_on_dtype": b"ctorch\nfloat32\n}b",
    # the other allowed classes, called as torch calls them
    "bytearray_negative": b"cbuiltins\nbytearray\nJ\xff\xff\xff\xff\x85R",
    "bytearray_str_no_encoding": b"cbuiltins\nbytearray\n" + _x(b"a") + b"\x85R",
    "bytearray_str_utf8": b"cbuiltins\nbytearray\n" + _x(b"a") + _x(b"utf-8") + b"\x86R",
    "bytearray_big": b"cbuiltins\nbytearray\n" + _long1(BIG) + b"\x85R",
    "complex_three_args": b"cbuiltins\ncomplex\n(K\x01K\x01K\x01tR",
    "complex_str": b"cbuiltins\ncomplex\n" + _x(b"x") + b"\x85R",
    "device_cpu": b"ctorch\ndevice\n" + _x(b"cpu") + b"\x85R",
    "device_cuda_1": b"ctorch\ndevice\n" + _x(b"cuda:1") + b"\x85R",
    "device_index": b"ctorch\ndevice\nK\x00\x85R",
    "device_unknown": b"ctorch\ndevice\n" + _x(b"foo") + b"\x85R",
    "device_no_args": b"ctorch\ndevice\n)R",
    "size_big": b"ctorch\nSize\n(" + _long1(BIG) + b"t\x85R",
    # ints past 64 bits and strings with lone surrogates are plain data torch reads
    "int_2^64": _long1(BIG),
    "int_-2^64": _long1(-BIG),
    "int_2^63": _long1(2**63),
    "int_2^2000": _long1(2**2000),
    "int_long4": b"\x8b\x09\0\0\0" + BIG.to_bytes(9, "little"),
    "str_lone_surrogate": _x(SURROGATE),
    "str_surrogate_pair_apart": _x(SURROGATE + b"\xed\xb0\x80"),
    "key_lone_surrogate": b"}" + _x(SURROGATE) + b"K\x01s",
    "str_not_utf8": _x(b"\xff"),
}.items():
    MUTANTS[f"pkl_{_name}"] = (replace("data.pkl", pkl(_value)), None)

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


# Where ckpt is deliberately stricter: it cannot tell which characters Python's cp1252 table
# has, so it refuses non-ASCII text for such codecs rather than risk calling sound what torch
# refuses (docs/guarantees.md).
STRICTER = {"pkl_encode_euro_cp1252"}


def check(path) -> None:
    refusal = torch_refuses(path)
    got = run_ckpt("verify", path)
    if path.stem in STRICTER:
        assert refusal is None, f"torch now refuses {path.stem}: {refusal}"
        assert got.returncode == 1 and "ckpt cannot tell" in got.stdout + got.stderr, got.stdout
        return
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


def test_big_ints_and_lone_surrogates_are_carried_into_torch_save_output(ckpt, tmp_path):
    """Non-tensor values torch reads are read and written back as torch wrote them."""
    values = {"big": 2**64 + 5, "neg": -(2**100), "odd": "a\ud800b", "keys": {"\udfff": 2**70}}
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6, dtype=torch.float32), **values}, src)
    got = run_ckpt("verify", src)
    assert got.returncode == 0, got.stdout + got.stderr
    out = tmp_path / "out.pt"
    got = run_ckpt("consolidate", src, "-o", out, "--format", "torch")
    assert got.returncode == 0, got.stdout + got.stderr
    back = torch.load(out, weights_only=True)
    assert torch.equal(back.pop("w"), torch.arange(6, dtype=torch.float32))
    assert back == values
