"""Shared helpers of the interop suite: dtype codes, bitwise comparison, and reading any fixture
layout back with PyTorch's own tools (the reference ckpt is held to)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FIXTURES_DIR = REPO / "fixtures"

# Every fixture fixtures/generate.py writes (expected/<name>.{pt,json}); keep in step with its FIXTURES.
FIXTURE_NAMES = [
    "fsdp2_adamw",
    "mesh_2x2",
    "dtypes",
    "dcp_hf",
    "dcp_zstd",
    "single",
    "hf_split",
    "torch_save",
    "dtypes_safetensors",
    "dtypes_torch_save",
    "dtypes_torch_dcp",
]
# Per-rank torch.save fixtures (fixtures/generate_per_rank.py, expected/ in the same style), tested
# by test_per_rank.py: a directory of one file per rank, which torch itself reads rank by rank.
PER_RANK_NAMES = ["per_rank_fsdp2", "per_rank_mesh_2x2", "per_rank_fsdp1", "per_rank_hf_llama"]

# Fixtures fixtures/generate_megatron.py writes with the real megatron-core (tests/interop/test_megatron.py);
# PyTorch alone cannot read them back whole (common.pt, and megatron's own classes in the _flat one).
MEGATRON_FIXTURE_NAMES = ["megatron_torch_dist", "megatron_torch_dist_flat"]
# Written by fixtures/generate_agree.py: a legacy (non-zip) torch.save and a deflated one.
AGREE_FIXTURE_NAMES = ["legacy_torch_save", "deflated_torch_save"]
# Written by fixtures/generate_dcp_safetensors_format.py: DCP saved with serialization_format=SAFETENSORS
# (plain and zstd), which torch's own FileSystemReader cannot read back (tests/interop/test_dcp_sfmt.py).
SFMT_FIXTURE_NAMES = ["dcp_sfmt", "dcp_sfmt_zstd"]
# DeepSpeed ZeRO cases written by fixtures/generate_deepspeed.py under fixtures/deepspeed/<case>/
# (tests/interop/test_deepspeed.py); expected/deepspeed_<case>.{pt,json} is what DeepSpeed's own tools give.
DEEPSPEED_FIXTURE_NAMES = [
    f"zero{stage}_{dtype}" for stage in (1, 2, 3) for dtype in ("bf16", "fp16", "fp32")
] + ["zero0_fp32", "zero1_bf16_optimizer", "zero3_bf16_r4"]
# Per-rank and DCP fixtures saved by process subgroups and hybrid sharding
# (fixtures/generate_subgroups.py, tests/interop/test_subgroups.py): expected/<name>.pt only.
SUBGROUP_FIXTURE_NAMES = ["subgroup_fsdp1", "hybrid_fsdp1", "hsdp_fsdp2", "hsdp_fsdp2_dcp"]
# LoRA cases written by fixtures/generate_lora.py with the real PEFT, under fixtures/lora/<case>/; their
# expected/lora_<case>.{pt,json} and expected/lora_<case>_logits.pt are what merge_and_unload gives
# (fixtures/lora/FORMAT.md), not the checkpoint's own tensors.
LORA_FIXTURE_NAMES = [
    "llama_fsdp2",
    "rslora_bf16",
    "dora",
    "dora_f32",
    "gpt2_fan_in_fan_out",
    "embedding",
    "adapter_apart",
]

# safetensors dtype code <-> torch dtype
CODE_TO_DTYPE = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    # no safetensors code: ckpt's names for them
    "C128": torch.complex128,
    "C32": torch.complex32,
    "F4_E2M1FN_X2": torch.float4_e2m1fn_x2,
}
DTYPE_TO_CODE = {v: k for k, v in CODE_TO_DTYPE.items()}
# torch dtypes safetensors cannot hold: ckpt refuses them for safetensors output
SAFETENSORS_LACKS = {torch.complex128, torch.complex32, torch.float4_e2m1fn_x2}


def dtype_code(dtype: torch.dtype) -> str:
    return DTYPE_TO_CODE[dtype]


def safetensors_lacks(flat: dict) -> list:
    """Names of the tensors of a flat state dict that safetensors cannot hold."""
    return [k for k, v in flat.items() if isinstance(v, torch.Tensor) and v.dtype in SAFETENSORS_LACKS]


def load_safetensors(path) -> dict:
    """A safetensors file as {name: tensor}. Through safe_open: safetensors 0.8 writes F8_E8M0 but
    its load_file cannot map the code back to torch (safe_open can)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements in row-major order, as little-endian bytes (any dtype, any strides)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, same shape, same bits (NaN payloads, -0.0 and fp8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_same_state(got: dict, want: dict, what: str = "") -> None:
    """Flat dicts hold the same keys, bitwise-equal tensors and equal plain values."""
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    bad = []
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            ok = isinstance(g, torch.Tensor) and bitwise_equal(g, w)
        else:
            ok = not isinstance(g, torch.Tensor) and g == w
        if not ok:
            bad.append(k)
    assert not bad, f"{what}: differ at {bad}"


def load_expected(fixtures_dir: Path, name: str) -> tuple[dict, dict]:
    """(expected/<name>.pt as a flat dict, expected/<name>.json)."""
    exp = Path(fixtures_dir) / "expected"
    flat = torch.load(exp / f"{name}.pt", weights_only=True)
    doc = json.loads((exp / f"{name}.json").read_text())
    return flat, doc


def expected_tensors(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def expected_non_tensors(flat: dict) -> list:
    return [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]


def layout_of(path: Path) -> str:
    """Which on-disk layout a checkpoint path is: dcp, dcp_hf, hf_split, safetensors or torch_save."""
    path = Path(path)
    if path.is_dir():
        if (path / ".metadata").exists():
            return "dcp"
        if (path / "model.safetensors.index.json").exists():
            return "hf_split"
        if any(path.glob("shard-*.safetensors")):
            return "dcp_hf"
        raise ValueError(f"unknown checkpoint directory {path}")
    if path.suffix == ".safetensors":
        return "safetensors"
    return "torch_save"


def load_with_torch(path: Path) -> dict:
    """Read any supported checkpoint with PyTorch / safetensors only, as a flat {fqn: value} dict.
    Nested dicts are flattened the way DCP flattens them (torch_save_to_dcp names a torch.save
    entry {"config": {"hidden": 6}} `config.hidden`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    path = Path(path)
    layout = layout_of(path)
    if layout == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            nested = torch.load(Path(tmp) / "full.pt", weights_only=True)
        return flatten_state_dict(nested)[0]
    if layout == "dcp_hf":
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        names = set()
        for f in path.glob("shard-*.safetensors"):
            with safe_open(str(f), "pt") as st:
                names.update(st.keys())
        with tempfile.TemporaryDirectory() as tmp:
            consolidate_safetensors_files(str(path), tmp, dict.fromkeys(names, 1))
            out = {}
            for f in Path(tmp).glob("*.safetensors"):
                out.update(load_safetensors(str(f)))
        return out
    if layout == "hf_split":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        out = {}
        for f in sorted(set(index["weight_map"].values())):
            part = load_safetensors(str(path / f))
            for k in part:
                assert index["weight_map"][k] == f, f"{k} is in {f}, index says {index['weight_map'][k]}"
            out.update(part)
        assert sorted(out) == sorted(index["weight_map"]), "index and files disagree"
        return out
    if layout == "safetensors":
        return load_safetensors(str(path))
    return flatten_state_dict(torch.load(path, weights_only=True))[0]


# --- helpers of test_consolidate.py / test_reshard.py -------------------------------------------


def flatten_like_dcp(nested: dict) -> dict:
    """A nested state dict flattened to DCP fqns (`optim.param_groups.0.lr`, `config.hidden`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(nested)[0]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dcp_chunks(path: Path) -> dict:
    """A DCP directory's .metadata as read by PyTorch, reduced to what placement decides:
    {fqn: ("bytes",) | (dtype code, shape, frozenset of (offsets, sizes) chunks)}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            out[fqn] = ("bytes",)
        else:
            chunks = frozenset((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            out[fqn] = (dtype_code(m.properties.dtype), tuple(m.size), chunks)
    return out


def run_torchrun(script: Path, nproc: int, *args, timeout: float = 600) -> "subprocess.CompletedProcess":
    """`torchrun --nproc_per_node=nproc script args` on CPU/gloo (free port, OMP_NUM_THREADS=1)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={port}", str(script), *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
