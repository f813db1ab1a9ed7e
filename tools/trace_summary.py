"""Text summary of a trace written by Engine.export_trace: per phase, how long each lane was
busy and which lane was the busiest.

For each phase (forward, backward, optimizer step), over its last --steps occurrences: the
phase's wall time, then for each lane kind (compute, wait, copy, nvme read, nvme write,
"nvme any" = reads or writes, "optimizer" = a unit's whole update on the worker, its waits
included, and "adam" = the Adam kernel itself) the time at least one span of that kind was
running inside the phase (the union of the spans, clipped to the phase), as seconds and as
a share of the phase.
NVMe requests overlap (many in flight): their union says how long the disk had work queued,
not how many bytes moved. "wait" is the main thread waiting before a unit could run (for
its fetch or, with deferred updates, its update). The busiest lane is the resource
(compute, copy, nvme any, adam) with the largest union; "main idle" is the share of the
phase with no compute span: on the main thread that is waiting (for fetches and updates in
forward and backward, for the optimizer pipeline in the step).

    python tools/trace_summary.py trace.json [--steps 2]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple

PHASES = ("forward", "backward", "optimizer step")
KINDS = ("compute", "wait", "copy", "nvme read", "nvme write", "nvme any", "optimizer", "adam")
# What can be a bottleneck: the main thread's compute, the copy worker, the disk, the Adam
# kernel ("optimizer" spans wrap whole updates, waits included, so they are not one).
RESOURCES = ("compute", "copy", "nvme any", "adam")


def _union(intervals: List[Tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def summarize(path: str, steps: int = 1) -> List[Dict]:
    """One dict per phase present: phase, occurrences, seconds, busy {kind: seconds},
    busiest kind, main_idle share."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    spans: Dict[str, List[Tuple[float, float]]] = {k: [] for k in KINDS}
    phases: Dict[str, List[Tuple[float, float]]] = {p: [] for p in PHASES}
    for e in events:
        start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
        kind = e.get("cat", "")
        if kind == "phase" and e["name"] in phases:
            phases[e["name"]].append((start, end))
        elif kind in spans:
            spans[kind].append((start, end))
            if kind.startswith("nvme"):
                spans["nvme any"].append((start, end))
    rows = []
    for phase in PHASES:
        chosen = sorted(phases[phase])[-steps:] if steps > 0 else sorted(phases[phase])
        if not chosen:
            continue
        seconds = sum(end - start for start, end in chosen)
        busy = {kind: sum(_union(spans[kind], start, end) for start, end in chosen) for kind in KINDS}
        busiest = max(RESOURCES, key=busy.get)
        rows.append({"phase": phase, "occurrences": len(chosen), "seconds": seconds, "busy": busy,
                     "busiest": busiest,
                     "main_idle": 1.0 - busy["compute"] / seconds if seconds > 0 else 0.0})
    return rows


def print_summary(rows: List[Dict], out=sys.stdout) -> None:
    print(f"{'phase':15s} {'n':>2s} {'wall s':>7s} " + " ".join(f"{k:>11s}" for k in KINDS) +
          f" {'main idle':>9s}  busiest", file=out)
    for r in rows:
        cells = " ".join(f"{r['busy'][k]:5.2f} {r['busy'][k] / r['seconds']:5.0%}" if r["seconds"] > 0
                         else f"{'-':>11s}" for k in KINDS)
        print(f"{r['phase']:15s} {r['occurrences']:2d} {r['seconds']:7.3f} {cells} {r['main_idle']:9.0%}  "
              f"{r['busiest']}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="JSON written by Engine.export_trace")
    p.add_argument("--steps", type=int, default=1,
                   help="summarize the last N occurrences of each phase (0: all; default 1)")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error("--steps must be >= 0")
    try:
        rows = summarize(args.trace, args.steps)
    except (OSError, ValueError, KeyError) as error:
        print(f"{args.trace}: not a trace written by export_trace ({error})", file=sys.stderr)
        return 2
    if not rows:
        print(f"{args.trace}: no phase spans (forward, backward, optimizer step) in this trace", file=sys.stderr)
        return 1
    print_summary(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
