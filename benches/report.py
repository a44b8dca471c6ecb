#!/usr/bin/env python3
"""Turn the measurements `scripts/bench` collects into markdown tables.

    report.py table RESULTS.tsv      one row per case
    report.py flatness RESULTS.tsv   peak RssAnon per case at each input size, and the difference

RESULTS.tsv has one line per timed run, tab-separated:
    case  group  ref  label  input_bytes  round  wall_s  rss_anon_kib  vmhwm_kib
`group` names the input the case reads; `ref` is the case that copies those same bytes (`cp`),
or `-`. Cases are listed in the order they first appear.

Time is the median over rounds (min-max beside it); "x ref" is that median over the median of the
reference copy of the same input measured in the same run, "x ref, best" the same for the fastest
rounds (on a shared disk noise only adds time, so the minimum is the steadier estimate); GB/s is
input bytes (decimal GB) over the median time. Memory is the maximum over rounds: peak sampled RssAnon of the process tree, and
the largest VmHWM (resident peak including mapped file pages) of any one process.
"""

import statistics
import sys
from collections import OrderedDict


def load(path):
    cases = OrderedDict()
    with open(path) as f:
        for line in f:
            case, group, ref, label, nbytes, _round, wall, anon, hwm = line.rstrip("\n").split("\t")
            c = cases.setdefault(
                case,
                {"group": group, "ref": ref, "label": label, "bytes": int(float(nbytes)), "runs": []},
            )
            c["runs"].append((float(wall), int(anon), int(hwm)))
    return cases


def mib(kib):
    return kib / 1024


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
        ratio = f"{med[k] / med[ref]:.2f}" if ref in med and med[ref] > 0 else "-"
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
    elif not flatness(cases):
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
