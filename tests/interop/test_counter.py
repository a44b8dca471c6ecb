"""`collections.Counter` inside a torch.save file: torch's weights-only reader loads it, and so
does ckpt, as the dict it is (a Counter pickles as `Counter({...})`); it comes back through
`--format torch` with the same items, and a Counter built any other way is refused by name."""

from __future__ import annotations

import collections
import json
import pickle

import torch


def test_a_counter_round_trips_through_torch_output(run_ckpt, tmp_path):
    src = tmp_path / "with_counter.pt"
    counts = collections.Counter({"tokens": 12, "documents": 3})
    state = {"w": torch.arange(6.0).reshape(2, 3), "counts": counts, "nested": {"c": collections.Counter()}}
    torch.save(state, src)
    assert torch.load(src, weights_only=True)["counts"] == counts
    proc = run_ckpt("inspect", src, "--json")
    assert proc.returncode == 0, proc.stderr
    values = {v["name"]: v["value"] for v in json.loads(proc.stdout)["non_tensors"]}
    assert values["counts.tokens"] == 12 and values["counts.documents"] == 3
    out = tmp_path / "out.pt"
    proc = run_ckpt("consolidate", src, "-o", out, "--format", "torch")
    assert proc.returncode == 0, proc.stderr
    back = torch.load(out, weights_only=True)
    assert back["counts"] == counts
    assert dict(back["counts"]) == dict(counts)
    assert back["nested"]["c"] == collections.Counter()
    assert torch.equal(back["w"], state["w"])


def test_a_counter_made_another_way_is_refused(run_ckpt, tmp_path):
    class Odd:
        def __reduce__(self):
            return (collections.Counter, ("abc", 2))

    src = tmp_path / "odd.pt"
    torch.save({"x": torch.zeros(1)}, src)
    import zipfile
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
        parts = {n: z.read(n) for n in names}
    pkl = next(n for n in names if n.endswith("data.pkl"))
    parts[pkl] = pickle.dumps({"x": Odd()}, protocol=2)
    with zipfile.ZipFile(src, "w", compression=zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, parts[n])
    proc = run_ckpt("inspect", src)
    assert proc.returncode == 1, proc.stdout
    assert "Counter" in proc.stderr, proc.stderr
