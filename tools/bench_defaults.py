"""``tools/bench_train.py --compare-defaults``: the tiers' defaults ("auto", issue 19) against
the defaults before them (param_tier="host", optimizer_tier="host"), in one run.

Per dtype, four scenarios, each an "old" row (explicit host tiers) and a "new" row (no
tier given), every row a fresh subprocess (its RSS its own):

- nothing set: no device budget, no swap_dir;
- the device budget at its floor (the smallest the engine accepts plus two blocks), no swap_dir;
- the same with a swap_dir and max_grad_norm=1.0 (never triggering here, the Hugging Face
  Trainer's default);
- the same with host_budget at --tight-fraction (default 0.5) of the old row's peak RSS
  in the scenario before: the old defaults are refused at wrap, the new ones place what does
  not fit on NVMe.

Columns: where the compute copies and the states are (units on device/host/NVMe), step
time, peak RSS, NVMe bytes per step, and new / old for step and RSS.

    python tools/bench_train.py --compare-defaults --dtypes fp32

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import shutil
import sys
import tempfile

from train_harness import GB, GiB, floor_rows_base, report, run_row

SCENARIOS = (
    ("nothing set", dict(no_device_budget=True)),
    ("device budget at the floor", dict()),
    ("floor, swap_dir, clipping", dict(swap=True, max_grad_norm=1.0)),
    ("floor, swap_dir, clipping, tight host budget", dict(swap=True, max_grad_norm=1.0, tight=True)),
)


def main(args) -> int:
    if not 0 < args.tight_fraction:
        print("--tight-fraction: must be > 0", file=sys.stderr)
        return 2
    base = floor_rows_base(args)
    model = base["model"]
    own_swap = args.swap_dir is None
    swap_root = tempfile.mkdtemp(prefix="bench_defaults-") if own_swap else args.swap_dir
    print(f"model {model}, batch {base['batch']}, {base['warmup']} warm-up + {base['steps']} timed steps; "
          f"old defaults: param_tier='host', optimizer_tier='host'; new: no tier given ('auto')", flush=True)
    results = []
    try:
        for dtype in args.dtypes:
            last_old_rss = None
            for name, scenario in SCENARIOS:
                spec = dict(base, dtype=dtype, no_device_budget=scenario.get("no_device_budget", False),
                            max_grad_norm=scenario.get("max_grad_norm"),
                            swap_dir=swap_root if scenario.get("swap") else None, host_budget=None)
                if scenario.get("tight"):
                    if last_old_rss is None:
                        continue
                    spec["host_budget"] = int(args.tight_fraction * last_old_rss)
                for row in ("old-defaults", "defaults"):
                    result = run_row(dict(spec, row=row), args.row_timeout)
                    result.update(row=row, dtype=dtype, scenario=name, host_budget=spec["host_budget"])
                    results.append(result)
                    status = result.get("error") or f"{result['step_seconds']:.3f} s/step"
                    print(f"  {dtype} {name}: {row} {status}", file=sys.stderr, flush=True)
                    if row == "old-defaults" and "error" not in result:
                        last_old_rss = result["peak_rss_bytes"]
    finally:
        if own_swap:
            shutil.rmtree(swap_root, ignore_errors=True)
    # the old defaults refused in the tight scenario is the expected outcome, not a failure
    return report(results, print_comparison, args.json, base,
                  failed=lambda r: "error" in r and r["row"] == "defaults")


def _where(r: dict) -> str:
    tiers = r.get("tiers")
    if not tiers:
        return "-"
    return "/".join("".join(f"{n}{t[0]}" for t, n in counts.items() if n) for counts in tiers)


def print_comparison(results: list, out=sys.stdout) -> None:
    header = (f"{'dtype':5s} {'scenario':45s} {'defaults':8s} {'compute/states':>18s} {'step s':>7s} "
              f"{'RSS GiB':>7s} {'rd GB':>6s} {'wr GB':>6s} {'step new/old':>12s} {'RSS new/old':>11s}")
    print(header, file=out)
    print("-" * len(header), file=out)
    old = {}
    for r in results:
        lead = f"{r['dtype']:5s} {r['scenario']:45s} {'old' if r['row'] == 'old-defaults' else 'new':8s}"
        if "error" in r:
            print(f"{lead} refused: {r['error'][:120]}", file=out)
            continue
        ratios = ""
        if r["row"] == "old-defaults":
            old[(r["dtype"], r["scenario"])] = r
        elif (r["dtype"], r["scenario"]) in old:
            o = old[(r["dtype"], r["scenario"])]
            ratios = (f"{r['step_seconds'] / o['step_seconds']:12.2f} "
                      f"{r['peak_rss_bytes'] / o['peak_rss_bytes']:11.2f}")
        print(f"{lead} {_where(r):>18s} {r['step_seconds']:7.3f} {r['peak_rss_bytes'] / GiB:7.2f} "
              f"{r['nvme_read_per_step'] / GB:6.2f} {r['nvme_written_per_step'] / GB:6.2f} {ratios}", file=out)
    print("compute/states: how many units have their compute copy / their master + moments on "
          "the device (d), the host (h) or NVMe (n)", file=out)
