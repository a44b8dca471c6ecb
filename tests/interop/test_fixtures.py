"""The committed fixtures are what fixtures/generate.py says they are: PyTorch's own readers load
each one and give back exactly fixtures/expected/<name>.pt. Needs torch only, not ckpt."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_helpers import (
    AGREE_FIXTURE_NAMES,
    DEEPSPEED_FIXTURE_NAMES,
    SUBGROUP_FIXTURE_NAMES,
    FIXTURE_NAMES,
    LORA_FIXTURE_NAMES,
    MEGATRON_FIXTURE_NAMES,
    PER_RANK_NAMES,
    SFMT_FIXTURE_NAMES,
    assert_same_state,
    dtype_code,
    expected_non_tensors,
    expected_tensors,
    layout_of,
    load_expected,
    load_with_torch,
)


def test_every_fixture_is_committed(fixtures_dir):
    names = sorted(p.stem for p in (fixtures_dir / "expected").glob("*.json"))
    every = FIXTURE_NAMES + MEGATRON_FIXTURE_NAMES + PER_RANK_NAMES + AGREE_FIXTURE_NAMES + SFMT_FIXTURE_NAMES
    lora = [f"lora_{case}" for case in LORA_FIXTURE_NAMES]
    deepspeed = [f"deepspeed_{case}" for case in DEEPSPEED_FIXTURE_NAMES]
    assert names == sorted(every + lora + deepspeed)
    for name in every + lora + deepspeed + SUBGROUP_FIXTURE_NAMES:
        assert (fixtures_dir / "expected" / f"{name}.pt").is_file()
    for case in LORA_FIXTURE_NAMES:
        assert (fixtures_dir / "expected" / f"lora_{case}_logits.pt").is_file()
        assert (fixtures_dir / "lora" / case / "config.json").is_file()


def has_experts(fixture):
    """Whether the trained model in `fixture` is a mixture of experts, by its Hugging Face config."""
    config = fixture / "hf" / "config.json"
    if not config.is_file():
        return False
    fields = json.loads(config.read_text())
    return any(fields.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def test_fixtures_stay_small(fixtures_dir):
    every = [f for f in fixtures_dir.rglob("*") if f.is_file() and "__pycache__" not in f.parts]

    def family(name):
        def holds(f):
            rel = f.relative_to(fixtures_dir)
            return rel.parts[0] == name or (rel.parts[0] == "expected" and f.name.startswith(f"{name}_"))

        return holds

    # the LoRA cases (fixtures/generate_lora.py: 7 tiny models, their merged state dicts and logits)
    # and the DeepSpeed ones (fixtures/generate_deepspeed.py: 14 saves of one tiny model, a few
    # files each) have budgets of their own
    lora = [f for f in every if family("lora")(f)]
    assert sum(f.stat().st_size for f in lora) < 1_500_000
    assert len(lora) < 60
    deepspeed = [f for f in every if family("deepspeed")(f)]
    assert sum(f.stat().st_size for f in deepspeed) < 700_000
    assert len(deepspeed) < 135
    # the real torchtitan checkpoints (fixtures/generate_torchtitan.py: a DCP save with its optimizer,
    # the HF directory and the references) each have one: under 2 MB
    top = {f.relative_to(fixtures_dir).parts[0] for f in every}
    torchtitan = [f for f in every if f.relative_to(fixtures_dir).parts[0].startswith("torchtitan_")]
    # the trained models of the FP8 export on real sharded saves (dims over 128 and not multiples
    # of 128: fixtures/generate_fp8.py, generate_megatron_fp8.py and the torchtitan `_fp8` ones,
    # saved model only) and the mixtures of experts (generate_megatron_moe.py's Megatron saves, the
    # torchtitan ones whose config names experts): under 7 MB each, and at most 14 of them
    fp8 = {name for name in top if "fp8" in name and not name.endswith(".py")}
    moe = {name for name in top if name.startswith(("torchtitan_", "megatron_")) and has_experts(fixtures_dir / name)}
    for name in {n for n in top if n.startswith("torchtitan_")} | fp8 | moe:
        one = [f for f in every if family(name)(f)]
        budget = 7_000_000 if name in fp8 | moe else 2_000_000
        assert sum(f.stat().st_size for f in one) < budget, name
        assert len(one) < 20, name
    assert len(fp8 | moe) <= 14
    big = [f for f in every if f.relative_to(fixtures_dir).parts[0] in fp8 | moe]
    assert sum(f.stat().st_size for f in big) < 70_000_000
    files = [
        f for f in every
        if not family("lora")(f) and not family("deepspeed")(f) and f not in torchtitan and f not in big
    ]
    assert sum(f.stat().st_size for f in files) < 2_000_000
    # per-rank layouts are one small file per rank and prefix (veRL's 3 prefixes x 4 ranks); the
    # two serialization_format=SAFETENSORS DCP fixtures add 11 files, the subgroup and hybrid
    # sharding ones (fixtures/generate_subgroups.py) 19
    assert len(files) < 200


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_torch_reads_fixture_as_expected(fixtures_dir, name):
    want, doc = load_expected(fixtures_dir, name)
    got = load_with_torch(fixtures_dir / doc["path"])
    assert_same_state(got, want, name)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_expected_json_matches_expected_pt(fixtures_dir, name):
    flat, doc = load_expected(fixtures_dir, name)
    tensors = expected_tensors(flat)
    assert sorted(doc["tensors"]) == sorted(tensors)
    for fqn, t in tensors.items():
        assert doc["tensors"][fqn]["dtype"] == dtype_code(t.dtype), fqn
        assert doc["tensors"][fqn]["shape"] == list(t.shape), fqn
    assert sorted(doc["non_tensors"]) == sorted(expected_non_tensors(flat))
    sharded = layout_of(fixtures_dir / doc["path"]) in ("dcp", "dcp_hf")
    assert doc["state_dict_type"] == ("SHARDED_STATE_DICT" if sharded else "FULL_STATE_DICT")
    assert doc["world_size"] == (4 if sharded else None)


def test_dcp_chunks_are_recorded_as_in_metadata(fixtures_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for name in FIXTURE_NAMES:
        _, doc = load_expected(fixtures_dir, name)
        path = fixtures_dir / doc["path"]
        if layout_of(path) != "dcp":
            continue
        md = dcp.FileSystemReader(str(path)).read_metadata()
        for fqn, m in md.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                boxes = sorted([list(c.offsets), list(c.sizes)] for c in m.chunks)
                assert doc["tensors"][fqn]["chunks"] == boxes, (name, fqn)
                assert list(m.size) == doc["tensors"][fqn]["shape"]


def test_zstd_items_are_compressed(fixtures_dir):
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(fixtures_dir / "dcp_zstd")).read_metadata()
    descriptors = {tuple(s.transform_descriptors or ()) for s in md.storage_data.values()}
    assert descriptors == {("stream.zstd/1",)}


def test_dcp_hf_files_carry_sharding_info(fixtures_dir):
    from safetensors import safe_open

    files = sorted((fixtures_dir / "dcp_hf").glob("shard-*.safetensors"))
    assert {f.name.split("-")[1] for f in files} == {"00001", "00002", "00003", "00004"}
    for f in files:
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            info = json.loads(meta["DCP_SHARDING_INFO"])
            assert set(info) == set(st.keys())
            assert all("saved_offsets" in v for v in info.values())


def test_hf_split_index_is_as_hugging_face_writes_it(fixtures_dir):
    path = fixtures_dir / "hf_split"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(f.name for f in path.glob("*.safetensors")) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    flat, _ = load_expected(fixtures_dir, "hf_split")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in flat.values())
    assert sorted(index["weight_map"]) == sorted(flat)


def test_torch_save_keeps_shared_storage_and_views(fixtures_dir):
    sd = torch.load(fixtures_dir / "torch_save.bin", weights_only=True)
    ptr = lambda k: sd[k].untyped_storage().data_ptr()  # noqa: E731
    assert ptr("embed.weight") == ptr("lm_head.weight")
    assert ptr("proj.weight") == ptr("proj.weight_t") == ptr("proj.weight_tail") == ptr("proj.row_strided")
    assert not sd["proj.weight_t"].is_contiguous()
    assert sd["proj.weight_tail"].storage_offset() == 8
    assert sd["proj.row_strided"].stride() == (4,) and sd["proj.row_strided"].storage_offset() == 1
    assert isinstance(sd["config"], dict) and sd["version"] == 2


@pytest.mark.parametrize("case", LORA_FIXTURE_NAMES)
def test_lora_fixture_is_what_its_json_says(fixtures_dir, case):
    """A LoRA case's checkpoint holds the names, dtypes and shapes expected/lora_<case>.json lists,
    and expected/lora_<case>.pt those of merge_and_unload's state dict."""
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    doc = json.loads((fixtures_dir / "expected" / f"lora_{case}.json").read_text())
    path = fixtures_dir / "lora" / case

    def meta(sd):
        return {k: {"dtype": dtype_code(v.dtype), "shape": list(v.shape)} for k, v in sd.items()}

    if (path / ".metadata").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            assert meta(torch.load(Path(tmp) / "full.pt", weights_only=True)) == doc["checkpoint_names"]
    elif (path / "peft_model.safetensors").is_file():
        assert meta(load_file(path / "peft_model.safetensors")) == doc["checkpoint_names"]
    else:
        assert meta(load_file(path / "model.safetensors")) == doc["base_names"]
        assert meta(load_file(path / "lora_adapter" / "adapter_model.safetensors")) == doc["adapter_names"]
    merged = torch.load(fixtures_dir / "expected" / f"lora_{case}.pt", weights_only=True)
    assert meta(merged) == doc["merged_names"]
    assert doc["agreement"]["exact_rules_vs_merge_and_unload"]["max_ulp_diff"] == 0
    logits = torch.load(fixtures_dir / "expected" / f"lora_{case}_logits.pt", weights_only=True)
    assert logits["logits"].shape[:2] == logits["input_ids"].shape
