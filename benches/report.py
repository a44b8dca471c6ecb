#!/usr/bin/env python3
"""Turn the measurements `scripts/bench` collects into markdown tables.

    report.py table RESULTS.tsv      one row per case
    report.py flatness RESULTS.tsv   peak RssAnon per case at each input size, and the difference

RESULTS.tsv has one line per timed run, tab-separated:
    case  group  ref  label  input_bytes  round  wall_s  rss_anon_kib  vmhwm_kib
`group` names the input the case reads; `ref` is the case that copies those same bytes (`cp`),
or `-`. Cases are listed in the order they first appear.

Time is the median over rounds (min-max beside it). "x ref" is the median over rounds of the
case's time over the reference copy's time in the same round: each round runs every case once, so
pairing a case with the copy of its own round cancels the slow drift of a shared disk. "x ref,
best" is the fastest run over the fastest reference run (noise only adds time, so minima are the
other steady estimate). GB/s is input bytes (decimal GB) over the median time. Memory is the
maximum over rounds: peak sampled RssAnon of the process tree, and the largest VmHWM (resident peak
including mapped file pages) of any one process.

After the table come the targets of issue 5, each with the rows it was judged on: ckpt's
consolidate and reshard rows at most 1.5x their reference copy, at least 5x faster than
`dcp_to_torch_save`, at most 256 MiB of anonymous memory, and every case measured both with the
default threads and `--threads 1` (case ids `X` and `X-t1`) faster with the default.
"""

import statistics
import sys
from collections import OrderedDict


def load(path):
    cases = OrderedDict()
    with open(path) as f:
        for line in f:
            case, group, ref, label, nbytes, rnd, wall, anon, hwm = line.rstrip("\n").split("\t")
            c = cases.setdefault(
                case,
                {"group": group, "ref": ref, "label": label, "bytes": int(float(nbytes)), "runs": []},
            )
            c["runs"].append((float(wall), int(anon), int(hwm)))
            c.setdefault("by_round", {})[rnd] = float(wall)
    return cases


def mib(kib):
    return kib / 1024


def paired_ratio(cases, k):
    """Median over rounds of case `k`'s time over its reference's time in the same round."""
    c = cases[k]
    ref = cases.get(c["ref"])
    if ref is None:
        return None
    ratios = [w / ref["by_round"][r] for r, w in c["by_round"].items() if ref["by_round"].get(r)]
    return statistics.median(ratios) if ratios else None


def table(cases):
    med = {k: statistics.median(w for w, _, _ in c["runs"]) for k, c in cases.items()}
    best = {k: min(w for w, _, _ in c["runs"]) for k, c in cases.items()}
    print(
        "| tool | input | median s (min-max) | x ref | x ref, best | GB/s "
        "| peak RssAnon MiB | peak VmHWM MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k, c in cases.items():
        walls = [w for w, _, _ in c["runs"]]
        ref = c["ref"]
        paired = paired_ratio(cases, k)
        ratio = f"{paired:.2f}" if paired is not None else "-"
        ratio_best = f"{best[k] / best[ref]:.2f}" if ref in best and best[ref] > 0 else "-"
        if ref == k:
            ratio = ratio_best = "1.00 (ref)"
        gbs = f"{c['bytes'] / 1e9 / med[k]:.3g}" if c["bytes"] else "-"
        size = f"{c['group']} {c['bytes'] / 1e9:.2f} GB" if c["bytes"] else "-"
        anon = max(a for _, a, _ in c["runs"])
        hwm = max(h for _, _, h in c["runs"])
        print(
            f"| {c['label']} | {size} | {med[k]:.2f} ({min(walls):.2f}-{max(walls):.2f}) "
            f"| {ratio} | {ratio_best} | {gbs} | {mib(anon):.1f} | {mib(hwm):.0f} |"
        )


def targets(cases):
    """Print each target of issue 5 with the rows it is judged on; return whether all hold."""
    ok = True

    def verdict(holds):
        nonlocal ok
        ok &= holds
        return "holds" if holds else "MISSED"

    ckpt_rows = [k for k, c in cases.items() if c["label"].startswith("ckpt ")]
    ratios = {k: paired_ratio(cases, k) for k in ckpt_rows}
    worst = max((k for k in ckpt_rows if ratios[k] is not None), key=ratios.get, default=None)
    if worst is not None:
        print(
            f"- at most 1.5x the copy of the same bytes: {verdict(ratios[worst] <= 1.5)}; "
            f"worst row {cases[worst]['label']!r} at {ratios[worst]:.2f}x"
        )
    torch = cases.get("torch-dcp2ts")
    if torch is not None and "cons" in cases:
        t = statistics.median(w for w, _, _ in torch["runs"])
        c = statistics.median(w for w, _, _ in cases["cons"]["runs"])
        print(
            f"- at least 5x faster than dcp_to_torch_save: {verdict(t / c >= 5)}; "
            f"{t:.2f} s vs {c:.2f} s ({t / c:.1f}x)"
        )
    peak = max((max(a for _, a, _ in cases[k]["runs"]), k) for k in ckpt_rows) if ckpt_rows else None
    if peak is not None:
        print(
            f"- at most 256 MiB anonymous memory: {verdict(peak[0] <= 256 * 1024)}; "
            f"largest {mib(peak[0]):.1f} MiB ({cases[peak[1]]['label']!r})"
        )
    for k in ckpt_rows:
        one = cases.get(f"{k}-t1")
        if one is None:
            continue
        many = statistics.median(w for w, _, _ in cases[k]["runs"])
        single = statistics.median(w for w, _, _ in one["runs"])
        print(
            f"- faster with more threads, {cases[k]['label']!r}: {single / many:.2f}x "
            f"({single:.2f} s with --threads 1, {many:.2f} s with the default)"
        )
    return ok


def flatness(cases, limit_mib=32):
    # case ids are "<name>@<size label>"; sizes appear in the order they were run
    by_name, sizes = OrderedDict(), []
    for k, c in cases.items():
        name, _, size = k.partition("@")
        if size not in sizes:
            sizes.append(size)
        by_name.setdefault(name, {})[size] = c
    small, large = sizes[0], sizes[-1]
    print(
        f"| case | peak RssAnon MiB, {small} | peak RssAnon MiB, {large} | difference MiB "
        f"| within {limit_mib} MiB |"
    )
    print("|---|---|---|---|---|")
    ok = True
    for name, per in by_name.items():
        a = mib(max(x[1] for x in per[small]["runs"]))
        b = mib(max(x[1] for x in per[large]["runs"]))
        within = abs(b - a) <= limit_mib
        ok &= within
        label = per[small]["label"]
        print(f"| {label} | {a:.1f} | {b:.1f} | {b - a:+.1f} | {'yes' if within else 'NO'} |")
    return ok


def main(argv):
    if len(argv) != 2 or argv[0] not in ("table", "flatness"):
        sys.exit(__doc__)
    cases = load(argv[1])
    if argv[0] == "table":
        table(cases)
        print()
        print("targets (issue 5):")
        targets(cases)
    elif not flatness(cases):
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
