"""Regenerate the torch.save reference archives used by zip.rs and torch_save.rs unit tests.

Run with torch (these were made with 2.15): `python make.py` in this folder. The serialization id
record is random, so regenerated files differ in those 40 bytes (and the CRC that covers them).
"""
import collections
import io

import torch

torch.manual_seed(0)

# A tied weight (the same tensor under two keys), views with an offset and non-contiguous strides.
w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
torch.save(
    {
        "emb.weight": w,
        "lm_head.weight": w,
        "w_t": w.t(),
        "w_tail": w[1:],
        "w_col": w[:, 1],
        "bias": torch.tensor([0.5, -1.5], dtype=torch.float16),
    },
    "views.pt",
)

# Every dtype ckpt knows, in `DType::ALL` order; fp8, fp4, complex32 and uint16/32/64 take torch's
# `_rebuild_tensor_v3` path. The byte kinds without a cast from integers are viewed from bytes.
dtypes = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64,
    torch.uint32, torch.uint16, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.complex32, torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float4_e2m1fn_x2,
]
BYTE_VIEWS = {torch.float8_e8m0fnu, torch.float4_e2m1fn_x2}


def three(d):
    if d in BYTE_VIEWS:
        return torch.tensor([0, 1, 2], dtype=torch.uint8).view(d)
    return torch.tensor([0, 1, 2]).to(d)


torch.save({str(d).removeprefix("torch."): three(d) for d in dtypes}, "dtypes.pt")

# A bare tensor written to a buffer: what every DCP tensor item is (prefix `archive`).
buf = io.BytesIO()
torch.save(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), buf)
open("bare.pt", "wb").write(buf.getvalue())

# A training checkpoint: module state dict (OrderedDict with `_metadata`), optimizer state with int
# keys, a Parameter, a 0-dim tensor, an empty tensor (an empty record: no data descriptor), nested
# plain data.
lin = torch.nn.Linear(2, 3)
torch.save(
    {
        "model": lin.state_dict(),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(3, 2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "epoch": 3,
        "name": "run-1",
        "cfg": {"lr": 1e-3, "tags": ["a", "b"], "empty": {}, "none": None},
        "param": torch.nn.Parameter(torch.ones(2)),
        "empty": torch.zeros(0, 3),
    },
    "nested.pt",
)

# The pre-1.6 format, which ckpt refuses with a hint.
torch.save({"w": torch.ones(2)}, "legacy.pt", _use_new_zipfile_serialization=False)

# `zip64_framing.bin`: every byte of a real > 4 GiB archive except its big record's data, to check
# the zip64 layout without a 4 GiB fixture. Needs ~9 GB of disk and RAM, so only on request.
if __import__("sys").argv[1:] == ["--zip64"]:
    import struct
    import zipfile

    big = torch.zeros(2**32 + 100, dtype=torch.uint8)
    torch.save({"small": torch.ones(3), "big": big, "after": torch.ones(2)}, "/tmp/big.pt")
    info = zipfile.ZipFile("/tmp/big.pt").getinfo("big/data/1")
    with open("/tmp/big.pt", "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        start = info.header_offset + 30 + name_len + extra_len
        f.seek(0)
        head = f.read(start)
        f.seek(start + info.file_size)
        open("zip64_framing.bin", "wb").write(head + f.read())
