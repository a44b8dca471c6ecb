"""Regenerate the `.metadata` fixtures in this folder with real PyTorch (2.15, CPU).

    python make_fixtures.py single OUT_DIR          # one process, many dtypes, non-tensor values
    torchrun --nproc_per_node=4 make_fixtures.py sharded OUT_DIR   # gloo, DTensor Shard(0)/Shard(1)

    python make_fixtures.py zstd OUT_DIR            # items compressed with `stream.zstd/1`
    python make_fixtures.py legacy OUT_DIR          # torch 1.13-2.1 class paths, 5-tuple properties

Only each run's `.metadata` is kept as a fixture (`single.metadata`, `sharded4.metadata`,
`zstd.metadata`, `legacy.metadata`).
"""

import sys

import torch
import torch.distributed.checkpoint as dcp


def single(out):
    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {
            "f64": torch.randn(2, 3, dtype=torch.float64, generator=g),
            "f32": torch.randn(4, dtype=torch.float32, generator=g),
            "f16": torch.randn(2, 2, dtype=torch.float16, generator=g),
            "bf16": torch.randn(3, 1, 2, dtype=torch.bfloat16, generator=g),
            "f8e4m3": torch.zeros(5, dtype=torch.float8_e4m3fn),
            "f8e5m2": torch.zeros(5, dtype=torch.float8_e5m2),
            "i64": torch.arange(6, dtype=torch.int64),
            "i32": torch.arange(6, dtype=torch.int32),
            "i16": torch.arange(6, dtype=torch.int16),
            "i8": torch.arange(6, dtype=torch.int8),
            "u64": torch.zeros(3, dtype=torch.uint64),
            "u32": torch.zeros(3, dtype=torch.uint32),
            "u16": torch.zeros(3, dtype=torch.uint16),
            "u8": torch.arange(3, dtype=torch.uint8),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "layers": [torch.ones(2), {"w": torch.ones(1, 2)}],
            "view": torch.arange(12.0).reshape(3, 4).t(),
        },
        "train_state": {"step": 7, "name": "run-α", "lr": 0.001, "flags": [1, 2]},
        "epoch": 3,
    }
    dcp.save(sd, checkpoint_id=out, no_dist=True)


def sharded(out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mesh2 = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(0)
    sd = {
        "w0": distribute_tensor(torch.randn(10, 3, generator=g), mesh, [Shard(0)]),
        "w1": distribute_tensor(torch.randn(3, 7, generator=g).bfloat16(), mesh, [Shard(1)]),
        "tiny": distribute_tensor(torch.randn(2, generator=g), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.randn(4, generator=g), mesh, [Replicate()]),
        "grid": distribute_tensor(torch.randn(5, 6, generator=g), mesh2, [Shard(0), Shard(1)]),
        "plain": torch.arange(4),
        "step": 11,
    }
    dcp.save(sd, checkpoint_id=out)
    dist.destroy_process_group()


def zstd(out):
    from torch.distributed.checkpoint._extension import ZStandard

    writer = dcp.FileSystemWriter(out, _extensions=[ZStandard()])
    sd = {"w": torch.arange(6.0).reshape(2, 3), "note": {"k": "v"}}
    dcp.save(sd, storage_writer=writer, no_dist=True)


def legacy(out):
    """Re-pickle a fresh save the way torch 1.13-2.1 named things: DCP classes under
    `torch.distributed._shard.checkpoint.*`, `TensorProperties` from `_shard.sharded_tensor` with a
    5-tuple state (no strides), no `storage_meta` or `version`."""
    import os
    import pickle
    import types

    from torch.distributed._shard.sharded_tensor import metadata as st_meta
    from torch.distributed.checkpoint import filesystem, metadata

    dcp.save({"a": torch.ones(2, 2), "b": {"c": 5}}, checkpoint_id=out, no_dist=True)
    md = dcp.FileSystemReader(out).read_metadata()
    for tsm in md.state_dict_metadata.values():
        if isinstance(tsm, metadata.TensorStorageMetadata):
            p = tsm.properties
            tsm.properties = st_meta.TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
    st_meta.TensorProperties.__getstate__ = lambda self: (
        self.dtype, self.layout, self.requires_grad, st_meta.MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, self.pin_memory)
    del md.storage_meta, md.version
    classes = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex"]
    for mod, old, names in [(metadata, "torch.distributed._shard.checkpoint.metadata", classes),
                            (filesystem, "torch.distributed._shard.checkpoint.filesystem", ["_StorageInfo"])]:
        fake = types.ModuleType(old)
        for name in names:
            getattr(mod, name).__module__ = old
            setattr(fake, name, getattr(mod, name))
        sys.modules[old] = fake
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f, protocol=4)


if __name__ == "__main__":
    {"single": single, "sharded": sharded, "zstd": zstd, "legacy": legacy}[sys.argv[1]](sys.argv[2])
