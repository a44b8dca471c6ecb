"""Acceptance of `ckpt reshard`: every committed fixture, resharded for N ranks (or a 2-D mesh),
is a DCP checkpoint that real PyTorch reads back exactly as fixtures/expected/<name>.pt:

- single process: `dcp_to_torch_save` (every fixture x N in {1, 2, 3, 5, 8}, and 2-D meshes);
- torchrun (gloo, CPU): `dcp.load` into `Shard(0)` DTensors at the world size it was written for
  and at other ones, then `full_tensor()` bitwise against expected (tests/interop/torchrun_load.py);
- the chunks in `.metadata` are exactly those real DTensor + `dcp.save` record for the same
  placements (1-D meshes of 2, 3, 5 ranks and a 2x2 mesh);
- `--format dcp-safetensors` consolidates with PyTorch's `consolidate_safetensors_files`;
- FULL -> SHARDED -> FULL and SHARDED(4) -> SHARDED(3) -> FULL are lossless.

Each torchrun world size is one torchrun process group that handles every item for that size
(15-45 s each on 2 cores, mostly importing torch in every rank); ckpt outputs are made once per
module and shared.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_helpers import (
    FIXTURE_NAMES,
    FIXTURES_DIR,
    assert_same_state,
    bitwise_equal,
    dcp_chunks,
    expected_tensors,
    load_expected,
    load_with_torch,
    run_torchrun,
    safetensors_lacks,
)
from conftest import run_ckpt

HERE = Path(__file__).resolve().parent
WORLD_SIZES = [1, 2, 3, 5, 8]
MESH_PLACEMENTS = ["S(0),S(1)", "R,S(0)", "S(1),S(0)", "S(0),S(0)"]

# torchrun world size -> the ckpt outputs it dcp.loads: written for its own world size first, then
# for others (an int is `--world-size N`, "2x2:..." a 2-D mesh output).
# The 2-, 3- and 5-rank runs also dcp.save DTensor Shard(0) references for their size, and the
# 4-rank run 2x2-mesh references for every MESH_PLACEMENTS, compared with ckpt's .metadata chunks.
LOADS = {2: [2, 1, 3, 8, "2x2:S(0),S(1)"], 3: [3, 2, 5], 4: [5], 5: [5, 8]}
SHARD0_REFERENCE_SIZES = [2, 3, 5]


def fixture_path(name: str) -> Path:
    return FIXTURES_DIR / load_expected(FIXTURES_DIR, name)[1]["path"]


def expected_pt(name: str) -> Path:
    return FIXTURES_DIR / "expected" / f"{name}.pt"


def spec_flags(spec) -> list:
    """An output spec (an int world size, or "AxB:placements") as ckpt reshard flags."""
    if isinstance(spec, int):
        return ["--world-size", str(spec)]
    mesh, placements = spec.split(":")
    return ["--mesh", mesh, "--placements", placements]


def spec_id(spec) -> str:
    return f"ws{spec}" if isinstance(spec, int) else "mesh" + re.sub(r"[^0-9A-Za-z]+", "_", spec).strip("_")


class Outputs:
    """ckpt reshard outputs and torchrun results, each made once per module."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict = {}
        self.runs: dict = {}

    def reshard(self, name: str, spec, *extra) -> Path:
        key = (name, spec, extra)
        out = self.root / "ckpt" / name / (spec_id(spec) + "".join(re.sub(r"[^0-9A-Za-z]+", "_", e) for e in extra))
        if key not in self.procs:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.procs[key] = run_ckpt("reshard", fixture_path(name), "-o", out, *spec_flags(spec), *extra, "-q")
        proc = self.procs[key]
        assert proc.returncode == 0, (f"ckpt reshard {name} {' '.join(spec_flags(spec) + list(extra))} exited "
                                      f"{proc.returncode}:\n{proc.stderr}")
        return out

    def ok(self, name: str, spec) -> bool:
        try:
            self.reshard(name, spec)
            return True
        except AssertionError:
            return False

    def torchrun(self, world: int) -> dict:
        if world not in self.runs:
            job = {"loads": [], "saves": []}
            for name in FIXTURE_NAMES:
                for spec in LOADS[world]:
                    if self.ok(name, spec):
                        job["loads"].append({"id": f"{name}/{spec_id(spec)}", "ckpt": str(self.reshard(name, spec)),
                                             "expected": str(expected_pt(name))})
                if world in SHARD0_REFERENCE_SIZES:
                    job["saves"].append({"id": f"{name}/shard0", "expected": str(expected_pt(name)),
                                         "out": str(self.root / "dtensor" / f"{name}_ws{world}"),
                                         "mesh": [world], "placements": ["S(0)"]})
                if world == 4:
                    for pl in MESH_PLACEMENTS:
                        job["saves"].append({"id": f"{name}/{pl}", "expected": str(expected_pt(name)),
                                             "out": str(self.root / "dtensor" / f"{name}_{spec_id('2x2:' + pl)}"),
                                             "mesh": [2, 2], "placements": pl.split(",")})
            jobfile = self.root / f"job_{world}.json"
            result = self.root / f"result_{world}.json"
            jobfile.write_text(json.dumps(job, indent=1))
            try:
                proc = run_torchrun(HERE / "torchrun_load.py", world, jobfile, result, timeout=600)
            except subprocess.TimeoutExpired as e:
                self.runs[world] = {"crashed": f"torchrun on {world} ranks timed out after {e.timeout} s"}
            else:
                if result.is_file():  # written before teardown: a crash at exit does not matter
                    self.runs[world] = json.loads(result.read_text())
                else:
                    self.runs[world] = {"crashed": f"torchrun exited {proc.returncode}:\n"
                                                   f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"}
        run = self.runs[world]
        assert "crashed" not in run, run.get("crashed")
        assert run["world_size"] == world
        return run


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, ckpt) -> Outputs:
    return Outputs(tmp_path_factory.mktemp("reshard"))


def dcp_files(out: Path) -> list:
    return sorted(p.name for p in out.iterdir())


# --- single process: dcp_to_torch_save ----------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_reshard_reads_back_with_dcp_to_torch_save(outputs, name, n):
    flat, _ = load_expected(FIXTURES_DIR, name)
    out = outputs.reshard(name, n)
    files = dcp_files(out)
    assert ".metadata" in files
    ranks = [int(m.group(1)) for f in files if (m := re.fullmatch(r"__(\d+)_0\.distcp", f))]
    assert ranks and all(0 <= r < n for r in ranks), f"files for ranks outside 0..{n - 1}: {files}"
    assert set(files) == {".metadata"} | {f"__{r}_0.distcp" for r in ranks}, f"unexpected files {files}"
    # dcp_to_torch_save + flatten: non-tensor values must come back through DCP too
    assert_same_state(load_with_torch(out), flat, f"{name} --world-size {n}")


@pytest.mark.parametrize("placements", MESH_PLACEMENTS)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_mesh_reshard_reads_back_with_dcp_to_torch_save(outputs, name, placements):
    flat, _ = load_expected(FIXTURES_DIR, name)
    out = outputs.reshard(name, "2x2:" + placements)
    assert_same_state(load_with_torch(out), flat, f"{name} --mesh 2x2 --placements {placements}")


# --- chunks are DTensor's -----------------------------------------------------------------------


def assert_same_chunks(got_dir: Path, want_dir: Path, what: str) -> None:
    got, want = dcp_chunks(got_dir), dcp_chunks(want_dir)
    assert sorted(got) == sorted(want), f"{what}: entries differ: {sorted(set(got) ^ set(want))}"
    bad = []
    for fqn in sorted(want):
        if got[fqn] != want[fqn]:
            fmt = lambda e: e if e[0] == "bytes" else (e[0], e[1], sorted(e[2]))  # noqa: E731
            bad.append(f"{fqn}: ckpt {fmt(got[fqn])} / DTensor {fmt(want[fqn])}")
    assert not bad, f"{what}: .metadata differs from what DTensor + dcp.save record:\n" + "\n".join(bad)


@pytest.mark.parametrize("n", SHARD0_REFERENCE_SIZES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_chunks_equal_dtensor_shard0(outputs, name, n):
    out = outputs.reshard(name, n)
    run = outputs.torchrun(n)
    errors = run["saves"][f"{name}/shard0"]
    assert not errors, "DTensor reference save failed:\n" + "\n".join(errors)
    assert_same_chunks(out, outputs.root / "dtensor" / f"{name}_ws{n}", f"{name} --world-size {n}")


@pytest.mark.parametrize("placements", MESH_PLACEMENTS)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_mesh_chunks_equal_dtensor(outputs, name, placements):
    spec = "2x2:" + placements
    out = outputs.reshard(name, spec)
    run = outputs.torchrun(4)
    errors = run["saves"][f"{name}/{placements}"]
    assert not errors, "DTensor reference save failed:\n" + "\n".join(errors)
    assert_same_chunks(out, outputs.root / "dtensor" / f"{name}_{spec_id(spec)}",
                       f"{name} --mesh 2x2 --placements {placements}")


# --- torchrun: dcp.load into Shard(0) DTensors --------------------------------------------------

TORCHRUN_CASES = [(name, spec, world) for world, specs in LOADS.items() for spec in specs for name in FIXTURE_NAMES]


@pytest.mark.parametrize(
    ("name", "spec", "world"),
    TORCHRUN_CASES,
    ids=[f"{n}-written_{spec_id(s)}-loaded_on_{w}" for n, s, w in TORCHRUN_CASES],
)
def test_torchrun_dcp_load(outputs, name, spec, world):
    outputs.reshard(name, spec)  # ckpt's own failure shows here, not as a missing item
    run = outputs.torchrun(world)
    key = f"{name}/{spec_id(spec)}"
    assert key in run["loads"], f"{key} was not loaded"
    errors = run["loads"][key]
    assert not errors, f"dcp.load on {world} ranks of `ckpt reshard {name} {' '.join(spec_flags(spec))}`:\n" + "\n".join(errors)


# --- DCP's Hugging Face flavour -----------------------------------------------------------------

# consolidate_safetensors_files sizes every output tensor with torch.finfo(dtype) (an int dtype
# raises) and maps dtypes outside _hf_utils.DTYPE_MAP (F8, BOOL, U16...) to float32: it only
# handles F64/F32/F16/BF16. It also writes 0-dim tensors as 0 (seen on torch 2.15 with its own
# HuggingFaceStorageWriter output: `a = tensor(3.5)` comes back `tensor(0.)`). So PyTorch
# consolidates only the F64/F32/F16/BF16 tensors of rank >= 1; all tensors (those included) are
# also assembled here from each file's pieces and DCP_SHARDING_INFO, as that function does.
HF_FLOATS = {torch.float64, torch.float32, torch.float16, torch.bfloat16}


def assemble_dcp_hf(out: Path) -> dict:
    """Every tensor of a dcp-safetensors directory, assembled from each file's local pieces and
    DCP_SHARDING_INFO saved_offsets (size = max(offset + local size), as PyTorch infers it)."""
    pieces = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            info = json.loads(st.metadata()["DCP_SHARDING_INFO"])
            for k in st.keys():
                pieces.setdefault(k, []).append((info[k]["saved_offsets"], st.get_tensor(k)))
    full = {}
    for k, ps in pieces.items():
        shape = [max(off[d] + t.shape[d] for off, t in ps) for d in range(ps[0][1].dim())]
        t = torch.empty(shape, dtype=ps[0][1].dtype)
        covered = torch.zeros(shape, dtype=torch.int32)
        for off, piece in ps:
            box = tuple(slice(o, o + s) for o, s in zip(off, piece.shape))
            t[box] = piece
            covered[box] += 1
        assert (covered == 1).all(), f"{k}: pieces do not cover every element exactly once"
        full[k] = t
    return full


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_dcp_safetensors_consolidates_with_pytorch(outputs, tmp_path, name):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    flat, _ = load_expected(FIXTURES_DIR, name)
    want = expected_tensors(flat)
    if safetensors_lacks(flat):
        # refused: exit 2, the first such tensor and its dtype named, plain DCP suggested
        out = tmp_path / "refused"
        proc = run_ckpt("reshard", fixture_path(name), "-o", out, "--world-size", "3", "--format", "dcp-safetensors")
        first = safetensors_lacks(flat)[0]
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}:\n{proc.stderr}"
        assert f"`{first}`" in proc.stderr and f"`{flat[first].dtype}`" in proc.stderr, proc.stderr
        assert "--format dcp" in proc.stderr and not out.exists(), proc.stderr
        return
    out = outputs.reshard(name, 3, "--format", "dcp-safetensors")
    files = sorted(p.name for p in out.iterdir())
    assert files and all(re.fullmatch(r"shard-0000[123]-model-\d{5}-of-\d{5}\.safetensors", f) for f in files), files
    floats = {k for k, v in want.items() if v.dtype in HF_FLOATS and v.dim() > 0}
    if floats:
        (tmp_path / "full").mkdir()
        consolidate_safetensors_files(str(out), str(tmp_path / "full"), dict.fromkeys(floats, 1))
        got = {}
        for f in (tmp_path / "full").glob("*.safetensors"):
            got.update(load_file(str(f)))
        assert sorted(got) == sorted(floats)
        bad = [k for k in floats if not bitwise_equal(got[k], want[k])]
        assert not bad, f"{name}: consolidate_safetensors_files gives other values for {bad}"
    # every tensor (the non-float ones too) from the pieces and their saved_offsets
    got = assemble_dcp_hf(out)
    assert sorted(got) == sorted(want), f"{name}: names differ: {sorted(set(got) ^ set(want))}"
    bad = [k for k in want if not bitwise_equal(got[k], want[k])]
    assert not bad, f"{name}: pieces + DCP_SHARDING_INFO give other values for {bad}"


# --- round trips --------------------------------------------------------------------------------


def test_full_sharded_full_is_lossless(ckpt, tmp_path):
    src = FIXTURES_DIR / "single.safetensors"
    for cmd in (["reshard", src, "-o", tmp_path / "s", "--world-size", "3"],
                ["consolidate", tmp_path / "s", "-o", tmp_path / "f.safetensors"]):
        proc = run_ckpt(*cmd)
        assert proc.returncode == 0, f"ckpt {' '.join(map(str, cmd))}:\n{proc.stderr}"
    got, want = load_file(str(tmp_path / "f.safetensors")), load_file(str(src))
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not bitwise_equal(got[k], want[k])]
    assert not bad, f"single.safetensors -> 3 ranks -> safetensors changes {bad}"


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if load_expected(FIXTURES_DIR, n)[1]["world_size"] == 4])
def test_sharded4_sharded3_full_is_lossless(ckpt, tmp_path, name):
    flat, _ = load_expected(FIXTURES_DIR, name)
    for cmd in (["reshard", fixture_path(name), "-o", tmp_path / "s3", "--world-size", "3"],
                ["consolidate", tmp_path / "s3", "-o", tmp_path / "full.bin", "--format", "torch"]):
        proc = run_ckpt(*cmd)
        assert proc.returncode == 0, f"ckpt {' '.join(map(str, cmd))}:\n{proc.stderr}"
    assert_same_state(load_with_torch(tmp_path / "full.bin"), flat, f"{name} -> 3 ranks -> torch.save")


def test_existing_output_dir_is_kept_without_force(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("precious")
    proc = run_ckpt("reshard", FIXTURES_DIR / "single.safetensors", "-o", out, "--world-size", "2")
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{proc.stderr}"
    assert sorted(p.name for p in out.iterdir()) == ["keep"] and (out / "keep").read_text() == "precious"
