#!/usr/bin/env python3
"""Turn the measurements `scripts/bench` collects into markdown tables.

    report.py table RESULTS.tsv [--pieces PIECES.tsv]   one row per case
    report.py flatness RESULTS.tsv   peak RssAnon per case at each input size, and the difference

RESULTS.tsv has one line per timed run, tab-separated:
    case  group  ref  label  input_bytes  round  wall_s  rss_anon_kib  vmhwm_kib  [exit_code]
`group` names the input the case reads; `ref` is the case that copies those same bytes (`cp`),
or `-`. Cases are listed in the order they first appear. A run whose exit code is not 0 counts
in no time, ratio or target: its row says FAILED with the exit code (and the time it took to fail)
when no run of the case succeeded, or how many runs failed beside the others' median.

PIECES.tsv (`scripts/bench --pieces`) has one line `case  pieces` per case that handles a
many-piece checkpoint: the table then gains a "µs/piece" column (median time over pieces) and is
followed by the targets of issue 10 instead of those of issue 5.

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
            fields = line.rstrip("\n").split("\t")
            case, group, ref, label, nbytes, rnd, wall, anon, hwm = fields[:9]
            rc = int(fields[9]) if len(fields) > 9 else 0
            c = cases.setdefault(
                case,
                {
                    "group": group,
                    "ref": ref,
                    "label": label,
                    "bytes": int(float(nbytes)),
                    "runs": [],
                    "failed": [],
                    "by_round": {},
                },
            )
            if rc == 0:
                c["runs"].append((float(wall), int(anon), int(hwm)))
                c["by_round"][rnd] = float(wall)
            else:
                c["failed"].append((float(wall), int(anon), int(hwm), rc))
    return cases


def load_pieces(path):
    with open(path) as f:
        return {case: int(n) for case, n in (line.split() for line in f if line.strip())}


def mib(kib):
    return kib / 1024


def paired_ratio(cases, k):
    """Median over rounds of case `k`'s time over its reference's time in the same round."""
    c = cases[k]
    ref = cases.get(c["ref"])
    if ref is None or not c["runs"]:
        return None
    ratios = [w / ref["by_round"][r] for r, w in c["by_round"].items() if ref["by_round"].get(r)]
    return statistics.median(ratios) if ratios else None


def medians(cases):
    """Median wall time of each case's successful runs (cases with none are left out)."""
    return {k: statistics.median(w for w, _, _ in c["runs"]) for k, c in cases.items() if c["runs"]}


def table(cases, pieces=None):
    med = medians(cases)
    best = {k: min(w for w, _, _ in c["runs"]) for k, c in cases.items() if c["runs"]}
    per_piece = " µs/piece |" if pieces else ""
    print(
        "| tool | input | median s (min-max) | x ref | x ref, best | GB/s |"
        f"{per_piece} peak RssAnon MiB | peak VmHWM MiB |"
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|" if pieces else ""))
    for k, c in cases.items():
        ref = c["ref"]
        size = f"{c['group']} {c['bytes'] / 1e9:.2f} GB" if c["bytes"] else "-"
        # memory of failed runs too: the peak reached before failing is worth seeing
        anon = max(r[1] for r in c["runs"] + c["failed"])
        hwm = max(r[2] for r in c["runs"] + c["failed"])
        failed = ""
        if c["failed"]:
            codes = ", ".join(sorted({str(r[3]) for r in c["failed"]}))
            failed = f"FAILED (exit {codes})"
        if not c["runs"]:
            slowest = max(r[0] for r in c["failed"])
            cells = [f"{failed} after {slowest:.2f} s", "-", "-", "-"] + (["-"] if pieces else [])
        else:
            walls = [w for w, _, _ in c["runs"]]
            paired = paired_ratio(cases, k)
            ratio = f"{paired:.2f}" if paired is not None else "-"
            ratio_best = f"{best[k] / best[ref]:.2f}" if ref in best and best[ref] > 0 else "-"
            if ref == k:
                ratio = ratio_best = "1.00 (ref)"
            gbs = f"{c['bytes'] / 1e9 / med[k]:.3g}" if c["bytes"] else "-"
            time = f"{med[k]:.2f} ({min(walls):.2f}-{max(walls):.2f})"
            if failed:
                time += f"; {len(c['failed'])} run(s) {failed}"
            cells = [time, ratio, ratio_best, gbs]
            if pieces:
                n = pieces.get(k)
                cells.append(f"{med[k] / n * 1e6:.2f}" if n else "-")
        print(f"| {c['label']} | {size} | " + " | ".join(cells) + f" | {mib(anon):.1f} | {mib(hwm):.0f} |")


def targets(cases):
    """Print each target of issue 5 with the rows it is judged on; return whether all hold."""
    ok = True

    def verdict(holds):
        nonlocal ok
        ok &= holds
        return "holds" if holds else "MISSED"

    ckpt_rows = [k for k, c in cases.items() if c["label"].startswith("ckpt ") and c["runs"]]
    ratios = {k: paired_ratio(cases, k) for k in ckpt_rows}
    worst = max((k for k in ckpt_rows if ratios[k] is not None), key=ratios.get, default=None)
    if worst is not None:
        print(
            f"- at most 1.5x the copy of the same bytes: {verdict(ratios[worst] <= 1.5)}; "
            f"worst row {cases[worst]['label']!r} at {ratios[worst]:.2f}x"
        )
    torch = cases.get("torch-dcp2ts")
    if torch is not None and torch["runs"] and "cons" in cases and cases["cons"]["runs"]:
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
        if one is None or not one["runs"]:
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
        if not (per[small]["runs"] and per[large]["runs"]):
            ok = False
            print(f"| {per[small]['label']} | FAILED | FAILED | - | NO |")
            continue
        a = mib(max(x[1] for x in per[small]["runs"]))
        b = mib(max(x[1] for x in per[large]["runs"]))
        within = abs(b - a) <= limit_mib
        ok &= within
        label = per[small]["label"]
        print(f"| {label} | {a:.1f} | {b:.1f} | {b - a:+.1f} | {'yes' if within else 'NO'} |")
    return ok


def pieces_targets(cases, pieces):
    """Print each target of issue 10 with the rows it is judged on; return whether all hold.
    Case ids of the many-piece rows end in `-p<ranks>` (scripts/bench --pieces)."""
    ok = True

    def verdict(holds):
        nonlocal ok
        ok &= holds
        return "holds" if holds else "MISSED"

    med = medians(cases)
    most = max(pieces.values(), default=0)
    ckpt_rows = [k for k, c in cases.items() if c["label"].startswith("ckpt ") and k in pieces]
    largest = [k for k in ckpt_rows if pieces[k] == most]
    broken = [k for k in ckpt_rows if not cases[k]["runs"]]
    if broken:
        print(f"- every ckpt row runs: {verdict(False)}; failed: {', '.join(repr(cases[k]['label'] + ' ' + cases[k]['group']) for k in broken)}")
    if largest:
        peak = max((max(r[1] for r in cases[k]["runs"] + cases[k]["failed"]), k) for k in largest)
        print(
            f"- at most 256 MiB anonymous memory at {most:,} pieces: {verdict(peak[0] <= 256 * 1024)}; "
            f"largest {mib(peak[0]):.1f} MiB ({cases[peak[1]]['label']!r})"
        )
    for k in ckpt_rows:
        c = cases[k]
        if not (c["label"].startswith("ckpt reshard") or c["label"].startswith("ckpt consolidate")):
            continue
        if k not in med or c["ref"] not in med:
            continue
        extra = (med[k] - med[c["ref"]]) / pieces[k] * 1e6
        print(
            f"- at most 5 µs per piece beyond copying the bytes, {c['label']!r} ({pieces[k]:,} pieces): "
            f"{verdict(extra <= 5)}; {extra:.2f} µs ({med[k]:.2f} s, `{cases[c['ref']]['label']}` "
            f"of the directory {med[c['ref']]:.2f} s)"
        )
    for k in ckpt_rows:
        if not cases[k]["label"].startswith("ckpt consolidate"):
            continue
        suffix = k[k.rfind("-p"):]
        torch = f"torch-md{suffix}"
        if k in med and torch in med:
            print(
                f"- consolidate of {pieces[k]:,} pieces done before torch's read_metadata of them: "
                f"{verdict(med[k] < med[torch])}; {med[k]:.2f} s vs {med[torch]:.2f} s"
            )
    return ok


def main(argv):
    if len(argv) not in (2, 4) or argv[0] not in ("table", "flatness"):
        sys.exit(__doc__)
    if len(argv) == 4 and (argv[0] != "table" or argv[2] != "--pieces"):
        sys.exit(__doc__)
    cases = load(argv[1])
    if argv[0] == "table" and len(argv) == 4:
        pieces = load_pieces(argv[3])
        table(cases, pieces)
        print()
        print("targets (issue 10):")
        pieces_targets(cases, pieces)
    elif argv[0] == "table":
        table(cases)
        print()
        print("targets (issue 5):")
        targets(cases)
    elif not flatness(cases):
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
