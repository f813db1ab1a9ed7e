"""``tools/bench_train.py --sweep-host-budget``: step time against host budget with
placement "auto" ([Note: placement by budget], offload/memory/placement.py).

Per dtype, in one run: the plain PyTorch step, twice before the sweep and once after it
(the baseline is their median, since this machine's step time drifts by ±15% between
minutes; the first two give the compute time of the prediction, and their peak RSS sets
the budgets), then the reference GPT
wrapped with param_tier="auto", optimizer_tier="auto" at host budgets of --fractions (0.3x
to 1.2x) of the plain run's peak RSS, at the device budget floor (the smallest the engine
accepts plus two blocks; --budget-fraction defaults to 0.01 here), each row a fresh
subprocess (its RSS its own). With --delayed-update the same points again with
delayed_update=True. Before each path's points, its compute time: the engine's step with
every state in RAM (no host budget), delayed or not, which its predictions use. Columns:
what the placement put on the host (compute copies /
states of how many units), measured step and RSS (and their ratios to plain), the predicted
step ([Note: step prediction]) and predicted / measured, NVMe GB read and written per step
measured and predicted. --plot writes step time against host budget (matplotlib), the plain
step as a horizontal line.

    python tools/bench_train.py --sweep-host-budget --dtypes fp32 --plot sweep.png

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

from train_harness import GB, GiB, floor_rows_base, pipeline_depth, report, run_row

DEFAULT_FRACTIONS = (0.3, 0.45, 0.5, 0.6, 0.75, 0.9, 1.05, 1.2)  # 0.5 and 0.75: issue #19's targets


def main(args) -> int:
    fractions = tuple(args.fractions or DEFAULT_FRACTIONS)
    if any(not 0 < f for f in fractions):
        print("--fractions: every fraction must be > 0", file=sys.stderr)
        return 2
    base = dict(floor_rows_base(args), pipeline_depth=pipeline_depth(),
                machine_profile=os.path.abspath(args.machine_profile) if args.machine_profile else None)
    model = base["model"]
    own_swap = args.swap_dir is None
    swap_root = tempfile.mkdtemp(prefix="bench_sweep-") if own_swap else os.path.abspath(args.swap_dir)
    os.makedirs(swap_root, exist_ok=True)
    base["swap_dir"] = swap_root
    print(f"model {model}, batch {base['batch']}, {base['warmup']} warm-up + {base['steps']} timed steps; "
          f"host budgets {', '.join(f'{f:g}' for f in fractions)} x plain RSS; device budget at the floor; "
          f"profile {args.machine_profile or 'default (offload/memory/placement.py DEFAULT_PROFILE)'}",
          flush=True)
    results = []
    try:
        for dtype in args.dtypes:
            # [the baseline] plain PyTorch PLAIN_RUNS_FIRST times before the sweep and once
            # after it: this machine's step time drifts ±15% between minutes, so the ratios use
            # the median ("plain" row), the budgets and the prediction the first runs'
            runs = [plain_run(base, dtype, args.row_timeout) for _ in range(PLAIN_RUNS_FIRST)]
            results.extend(runs)
            first = [r for r in runs if "error" not in r]
            if not first:
                continue
            plain = dict(first[0], step_seconds=statistics.median(r["step_seconds"] for r in first),
                         peak_rss_bytes=max(r["peak_rss_bytes"] for r in first))
            for delayed in ((False, True) if args.delayed_update else (False,)):
                compute = compute_run(base, dtype, delayed, args.row_timeout)
                results.append(compute)
                compute_seconds = plain["step_seconds"] if "error" in compute else compute["step_seconds"]
                for fraction in fractions:
                    spec = dict(base, row="auto", dtype=dtype, delayed_update=delayed,
                                host_budget=int(fraction * plain["peak_rss_bytes"]),
                                compute_seconds=compute_seconds)
                    disk = disk_check(swap_root)
                    result = run_row(spec, args.row_timeout)
                    result.update(fraction=fraction, delayed=delayed, dtype=dtype, disk=disk)
                    if "error" not in result:
                        result["predicted_at_disk_seconds"] = predicted_at_disk(result, disk, compute_seconds)
                    results.append(result)
                    status = result.get("error") or f"{result['step_seconds']:.3f} s/step"
                    print(f"  auto {dtype:5s} {fraction:4.2f}x{' delayed' if delayed else ''} {status}",
                          file=sys.stderr, flush=True)
            last = plain_run(base, dtype, args.row_timeout)
            results.append(last)
            every = first + ([last] if "error" not in last else [])
            results.append(dict(plain, row="plain", step_seconds=statistics.median(r["step_seconds"] for r in every),
                                plain_runs=[r["step_seconds"] for r in every]))
    finally:
        if own_swap:
            shutil.rmtree(swap_root, ignore_errors=True)
    code = report(results, print_sweep, args.json, base)
    if args.plot:
        try:
            plot(results, args.plot)
        except ImportError:
            print("--plot needs matplotlib, which is not installed (the table above is complete)", file=sys.stderr)
            return 1
        print(f"plot written to {args.plot}")
    return code


# plain runs before the sweep (and one after it): see main
PLAIN_RUNS_FIRST = 2


def plain_run(base: dict, dtype: str, timeout: float) -> dict:
    """One plain PyTorch row ("plain-run"); the sweep's baseline is their median."""
    run = run_row(dict(base, row="plain", dtype=dtype), timeout)
    run["row"] = "plain-run"
    if "error" in run:
        print(f"  plain {dtype}: FAILED {run['error']}", file=sys.stderr, flush=True)
    else:
        print(f"  plain {dtype:5s} {run['step_seconds']:.3f} s/step, "
              f"{run['peak_rss_bytes'] / GiB:.2f} GiB", file=sys.stderr, flush=True)
    return run


# [Note: step prediction] This machine's disk moves between minutes (1.6x for the same
# traffic), which the profile's fixed bandwidths cannot follow: each point is preceded by a
# short O_DIRECT write and read of DISK_CHECK_BYTES in the swap directory, at the engine's
# default I/O settings, and the table shows that speed and the prediction at it.
DISK_CHECK_BYTES = 512 << 20


def disk_check(directory: str) -> dict:
    """Write then read DISK_CHECK_BYTES through offload.io.IOEngine (backend "auto", the
    default block size and queue depth) in ``directory``: bytes per second each way."""
    from offload.io import IOEngine, aligned_empty
    from offload.profile import time_write_read

    buf = aligned_empty(64 << 20).fill_(7)
    fd, path = tempfile.mkstemp(prefix=".disk-check-", dir=directory)
    os.close(fd)
    try:
        with IOEngine("auto", probe_dir=directory) as io:
            write_seconds, read_seconds = time_write_read(io, buf, path, DISK_CHECK_BYTES)
    finally:
        os.unlink(path)
    return {"read_bytes_per_second": DISK_CHECK_BYTES / read_seconds,
            "write_bytes_per_second": DISK_CHECK_BYTES / write_seconds}


def predicted_at_disk(row: dict, disk: dict, compute_seconds: float) -> float:
    """The point's predicted step ([Note: step prediction]: same bytes, same compute time,
    the fractions its prediction used) with the NVMe bandwidths of its disk check instead of
    the profile's."""
    from offload.memory.placement import StepPrediction

    io = row["predicted_read"] / disk["read_bytes_per_second"] + \
        row["predicted_written"] / disk["write_bytes_per_second"]
    return StepPrediction(row["predicted_read"], row["predicted_written"], io, compute_seconds,
                          row["predicted_exposed_fraction"], row.get("predicted_io_cpu_fraction", 0.0)).seconds


def compute_run(base: dict, dtype: str, delayed: bool, timeout: float) -> dict:
    """[Note: step prediction] The compute time of one path's predictions: the engine's step
    with placement "auto" and no host budget given (the default, which holds every state
    of this model in RAM: checked), delayed or not as the path, measured before its points.
    A failed one leaves the plain step as the compute time (and the row says why)."""
    run = run_row(dict(base, row="auto", dtype=dtype, delayed_update=delayed, host_budget=None), timeout)
    run.update(row="compute", delayed=delayed, dtype=dtype)
    if "error" not in run and run["home_bytes"].get("nvme", 0):
        run["error"] = (f"the default host budget left {run['home_bytes']['nvme'] / GB:.2f} GB on NVMe: "
                        "not a compute time; the plain step is used instead")
    what = f"{dtype:5s}{' delayed' if delayed else ''}"
    status = run.get("error") or f"{run['step_seconds']:.3f} s/step"
    print(f"  compute {what} (every state in RAM) {status}", file=sys.stderr, flush=True)
    return run


def _gb(value) -> str:
    return "-" if value is None else f"{value / GB:.2f}"


def _disk(disk) -> str:
    if not disk:
        return "-"
    return f"{disk['read_bytes_per_second'] / GB:.2f}/{disk['write_bytes_per_second'] / GB:.2f}"


def _at_disk(row: dict, step: float) -> str:
    predicted = row.get("predicted_at_disk_seconds")
    return f"{'-':>9s} {'-':>5s}" if predicted is None else f"{predicted:9.3f} {predicted / step:5.2f}"


def print_sweep(results: list, out=sys.stdout) -> None:
    plain = {r["dtype"]: r for r in results if r["row"] == "plain" and "error" not in r}
    header = (f"{'dtype':5s} {'delayed':7s} {'x RSS':>5s} {'budget GiB':>10s} {'host c/s':>8s} {'step s':>7s} "
              f"{'x plain':>7s} {'pred s':>7s} {'pred/meas':>9s} {'RSS GiB':>7s} {'x RSS':>6s} "
              f"{'rd GB':>6s} {'pred rd':>7s} {'wr GB':>6s} {'pred wr':>7s} {'disk r/w GB/s':>13s} "
              f"{'pred@disk':>9s} {'/meas':>5s}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in sorted(results, key=lambda r: r["row"] != "plain"):  # the baselines first
        if r["row"] == "plain-run":
            if "error" in r:
                print(f"{r['dtype']:5s} plain run FAILED: {r['error']}", file=out)
            continue
        if r["row"] == "plain":
            runs = ", ".join(f"{x:.3f}" for x in r["plain_runs"])
            print(f"{r['dtype']:5s} {'plain':7s} {'':>5s} {'':>10s} {'':>8s} {r['step_seconds']:7.3f} "
                  f"{1.0:7.2f} {'':>7s} {'':>9s} {r['peak_rss_bytes'] / GiB:7.2f} {1.0:6.2f}   "
                  f"(median of {len(r['plain_runs'])} runs: {runs})", file=out)
            continue
        base = plain.get(r["dtype"])
        if r["row"] == "compute":
            lead = f"{r['dtype']:5s} {'yes' if r['delayed'] else 'no':7s} compute (every state in RAM, no budget):"
            if "error" in r:
                print(f"{lead} FAILED: {r['error']}", file=out)
            else:
                print(f"{lead} {r['step_seconds']:7.3f} s, {r['step_seconds'] / base['step_seconds']:.2f} x plain, "
                      f"RSS {r['peak_rss_bytes'] / GiB:.2f} GiB: the compute time of this path's predictions",
                      file=out)
            continue
        lead = f"{r['dtype']:5s} {'yes' if r['delayed'] else 'no':7s} {r['fraction']:5.2f}"
        if "error" in r:
            print(f"{lead} FAILED: {r['error']}", file=out)
            continue
        step, predicted = r["step_seconds"], r.get("predicted_seconds")
        print(f"{lead} {r['host_budget'] / GiB:10.2f} {r['units_on_host']:>3d}/{r['states_on_host']:<4d} "
              f"{step:7.3f} {step / base['step_seconds']:7.2f} "
              f"{'-' if predicted is None else f'{predicted:7.3f}':>7s} "
              f"{'-' if predicted is None else f'{predicted / step:9.2f}':>9s} "
              f"{r['peak_rss_bytes'] / GiB:7.2f} {r['peak_rss_bytes'] / base['peak_rss_bytes']:6.2f} "
              f"{_gb(r.get('nvme_read_per_step')):>6s} {_gb(r.get('predicted_read')):>7s} "
              f"{_gb(r.get('nvme_written_per_step')):>6s} {_gb(r.get('predicted_written')):>7s} "
              f"{_disk(r.get('disk')):>13s} {_at_disk(r, step)}", file=out)
    print("host c/s: units whose compute copy / whose master+moments the placement put in RAM; "
          "x RSS (first column): the host budget as a fraction of the plain run's peak RSS; disk r/w: "
          f"a {DISK_CHECK_BYTES >> 20} MiB O_DIRECT write and read just before the point; pred@disk: the "
          "prediction at those bandwidths instead of the profile's", file=out)


def plot(results: list, path: str) -> None:
    """Step time against host budget per dtype (and delayed), measured and predicted, the
    plain step as a horizontal line of the dtype's colour. ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    colours = {"fp32": "tab:blue", "bf16": "tab:orange"}
    for dtype in sorted({r["dtype"] for r in results}):
        plain = next((r for r in results if r["row"] == "plain" and r["dtype"] == dtype and "error" not in r), None)
        if plain is None:
            continue
        colour = colours.get(dtype, "tab:gray")
        ax.axhline(plain["step_seconds"], color=colour, linestyle=":", label=f"plain {dtype}")
        for delayed in (False, True):
            rows = sorted((r for r in results if r["row"] == "auto" and r["dtype"] == dtype
                           and r["delayed"] == delayed and "error" not in r), key=lambda r: r["fraction"])
            if not rows:
                continue
            what = f"auto {dtype}{' delayed' if delayed else ''}"
            compute = next((r for r in results if r["row"] == "compute" and r["dtype"] == dtype
                            and r["delayed"] == delayed and "error" not in r), None)
            if compute is not None:
                ax.axhline(compute["step_seconds"], color=colour, alpha=0.5, linestyle="-." if delayed else (0, (1, 4)),
                           label=f"{what}, every state in RAM")
            xs = [r["fraction"] for r in rows]
            ax.plot(xs, [r["step_seconds"] for r in rows], marker="o", color=colour,
                    linestyle="--" if delayed else "-", label=f"{what}, measured")
            if all(r.get("predicted_seconds") for r in rows):
                ax.plot(xs, [r["predicted_seconds"] for r in rows], marker="x", color=colour, alpha=0.5,
                        linestyle="--" if delayed else "-", label=f"{what}, predicted")
    ax.set_xlabel("host budget / plain run's peak RSS")
    ax.set_ylabel("step time (s)")
    ax.set_title("reference GPT, placement auto, device budget at the floor")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, not on them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
