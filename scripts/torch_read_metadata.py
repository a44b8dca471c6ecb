#!/usr/bin/env python3
"""PyTorch reading a DCP directory's `.metadata`, for benchmarking ckpt against it (run with the
venv's python).

    torch_read_metadata.py DCP_DIR

Calls `torch.distributed.checkpoint.FileSystemReader(DCP_DIR).read_metadata()` (unpickling the
whole `.metadata`: the first thing every DCP load does) and prints the number of entries and of
chunks. The import of torch is part of what is measured (`torch_convert.py import_torch` times it
alone).
"""

import sys


def main(argv):
    if len(argv) != 1:
        sys.exit(__doc__)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(argv[0]).read_metadata()
    chunks = sum(
        len(m.chunks) for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)
    )
    print(f"{argv[0]}: {len(md.state_dict_metadata)} entries, {chunks} chunks")


if __name__ == "__main__":
    main(sys.argv[1:])
