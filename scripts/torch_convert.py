#!/usr/bin/env python3
"""PyTorch's own conversions, for benchmarking ckpt against them (run with the venv's python).

    torch_convert.py dcp_to_torch_save DCP_DIR OUT.pt
    torch_convert.py consolidate_safetensors DCP_SAFETENSORS_DIR OUT_DIR [--threads N]
    torch_convert.py import_torch

`consolidate_safetensors` calls
`torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files`, whose
`fqn_to_index_mapping` must be given (despite its docstring it calls `max()` on it): every tensor
named in the input files' headers goes to output file 1, i.e. one `model-00001-of-00001.safetensors`.
`import_torch` only imports torch, to show the start-up cost included in the other two timings.
"""

import json
import os
import struct
import sys


def tensor_names(directory):
    names = set()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        names.update(k for k in header if k != "__metadata__")
    return sorted(names)


def main(argv):
    mode = argv[0] if argv else ""
    import torch  # noqa: F401  (the import is part of what is measured)

    if mode == "import_torch":
        return
    if mode == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(argv[1], argv[2])
    elif mode == "consolidate_safetensors":
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        threads = int(argv[4]) if argv[3:4] == ["--threads"] else 1
        os.makedirs(argv[2], exist_ok=True)
        mapping = {name: 1 for name in tensor_names(argv[1])}
        consolidate_safetensors_files(argv[1], argv[2], mapping, num_threads=threads)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
