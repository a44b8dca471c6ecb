#!/usr/bin/env python3
"""Run one command; print its wall time and peak memory as one JSON line.

    scripts/rss.py [--interval 0.01] [--log FILE] -- CMD ARGS...

The command's stdout and stderr go to FILE (default /dev/null), so this script's stdout is only
the JSON line.

Wall time runs from just before fork to the moment the child is reaped (Python's own start-up is not
counted). Peak anonymous memory is sampled: every INTERVAL seconds, `RssAnon` of the child and all
its descendants (from /proc/PID/task/*/children) is summed and the maximum kept. Anonymous memory
is the honest measure for a tool that memory-maps its inputs: mapped file pages show in VmRSS and
VmHWM but the kernel can drop them at will. `vmhwm_kib` is the largest `VmHWM` (peak resident set,
file pages included) of any one process of the tree, as last sampled. (wait4's ru_maxrss is no
substitute: exec folds the forking parent's peak into it.)

Output: {"wall_s": 1.23, "rss_anon_kib": 1234, "vmhwm_kib": 5678, "samples": 120, "rc": 0}
The exit status is the command's.
"""

import json
import os
import subprocess
import sys
import threading
import time


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def status_kib(pid):
    """(RssAnon, VmHWM) of one process in KiB, zeros once it is gone."""
    anon = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return anon, hwm


def main(argv):
    interval, log = 0.01, os.devnull
    while argv[:1] in (["--interval"], ["--log"]):
        if argv[0] == "--interval":
            interval = float(argv[1])
        else:
            log = argv[1]
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: rss.py [--interval S] [--log FILE] -- CMD ARGS...")

    done = threading.Event()
    result = {}

    # subprocess uses vfork + exec, so no copy of this Python is ever sampled as the child
    with open(log, "ab") as out:
        start = time.perf_counter()
        pid = subprocess.Popen(argv, stdout=out, stderr=out).pid

    def reap():
        _, status, _ = os.wait4(pid, 0)
        result["end"] = time.perf_counter()
        result["rc"] = os.waitstatus_to_exitcode(status)
        done.set()

    threading.Thread(target=reap, daemon=True).start()
    peak, hwm, samples = 0, 0, 0
    while not done.is_set():
        seen = [status_kib(p) for p in descendants(pid)]
        peak = max(peak, sum(a for a, _ in seen))
        hwm = max([hwm] + [h for _, h in seen])
        samples += 1
        done.wait(interval)

    print(
        json.dumps(
            {
                "wall_s": round(result["end"] - start, 4),
                "rss_anon_kib": peak,
                "vmhwm_kib": hwm,
                "samples": samples,
                "rc": result["rc"],
            }
        )
    )
    sys.exit(result["rc"] if result["rc"] >= 0 else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
