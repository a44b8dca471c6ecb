"""`verify` lists every broken item, tensor or value, of a DCP checkpoint torch cannot load."""

from __future__ import annotations

import shutil

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from conftest import FIXTURES_DIR, run_ckpt


def test_a_broken_value_item_is_listed_beside_a_broken_tensor_item(ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES_DIR / "fsdp2_adamw", d)
    meta = dcp.FileSystemReader(str(d)).read_metadata()
    kinds = meta.state_dict_metadata
    broken = []
    for want_bytes in (True, False):
        index, info = next(
            (k, v) for k, v in sorted(meta.storage_data.items(), key=lambda kv: kv[1].offset)
            if isinstance(kinds[k.fqn], BytesStorageMetadata) == want_bytes and v.offset > 0
        )
        path = d / info.relative_path
        data = bytearray(path.read_bytes())
        data[info.offset : info.offset + 4] = b"XXXX"  # the item's first zip header signature
        path.write_bytes(bytes(data))
        broken.append((info.relative_path, index.fqn, info.offset))
    try:
        dcp_to_torch_save(d, tmp_path / "full.pt")
        torch_loads = True
    except (Exception, CheckpointException):  # noqa: BLE001 - any refusal counts
        torch_loads = False
    assert not torch_loads
    r = run_ckpt("verify", d)
    assert r.returncode == 1, r.stdout
    for file, fqn, offset in broken:
        assert f"{file}`, tensor `{fqn}`, at byte {offset}:" in r.stdout + r.stderr, (fqn, r.stdout)
