"""ZeRO across ranks beside its peers (issue #38): the reference GPT on N ranks of this node
(--ranks, default 2 4), tiers host and nvme (--tiers), rows torch DDP (the baseline), torch
FSDP2 and offload's stages 0-3, each row a fresh set of N worker processes
(``tools/bench_train.py --nproc N``; what each row runs and measures: its docstring). After
the per-N tables, one summary: each offload row's step against DDP's and FSDP2's of the same
N and dtype (same run), and rank 0's bytes per step beside their formulas, P the parameter
count, N the ranks (one sharding group: LOCAL_WORLD_SIZE = N):

  device->host (gradients)   stages 0/1: P x compute-dtype bytes (the whole gradient leaves);
                             stages 2/3: P x 4 / N (only the rank's fp32 shard leaves the
                             device after the reduce-scatter on it)
  all-gather (stage 3)       the fetched units' compute bytes (the rank's own chunks are
                             copied in, the rest gathered on the device): as many as stage
                             0 brings host->device at the same budget with host tiers
                             (column "st0 h2d"; on NVMe a fetch reads the swap file into
                             the slot, no host->device bytes: "-")

On a CPU-only machine the "device" is RAM and gloo carries every collective, so the time
columns say what the bookkeeping costs, not what a GPU node would see; the bytes are what
the engine moves on either.

    python tools/bench_zero.py --quick                        # a smoke run, 2 ranks, host
    python tools/bench_zero.py --model small --ranks 2 4 --tiers host nvme --dtypes bf16

Exit status 1 when a row failed. One rank (no --ranks 1): tools/bench_train.py's rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train  # noqa: E402
import train_ranks  # noqa: E402
from train_harness import MiB, fmt  # noqa: E402


def formula_device_to_host(stage: int, params: int, nproc: int, dtype: str) -> float:
    """Rank 0's gradient bytes device->host per step (no accumulation), as the docstring says."""
    return params * (4 if dtype == "fp32" else 2) if stage < 2 else params * 4 / nproc


def summary(tables: list, out=sys.stdout) -> None:
    """One line per offload row of every (N, tier) table."""
    header = (f"{'ranks':>5s} {'tier':4s} {'dtype':5s} {'config':7s} {'step s':>7s} {'x ddp':>6s} {'x fsdp2':>7s} "
              f"{'d2h MiB':>8s} {'formula':>8s} {'gath MiB':>8s} {'st0 h2d':>8s}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for nproc, tier, rows in tables:
        by_key = {(r["row"], r["dtype"]): r for r in rows if "error" not in r}
        for r in rows:
            if not r["row"].startswith("stage"):
                continue
            if "error" in r:
                print(f"{nproc:5d} {tier:4s} {r['dtype']:5s} {r['row']:7s} FAILED: {r['error']}", file=out)
                continue
            stage = int(r["row"][len("stage"):])
            ddp, fsdp2 = by_key.get(("ddp", r["dtype"])), by_key.get(("fsdp2", r["dtype"]))
            ratio = lambda peer: r["step_seconds"] / peer["step_seconds"] if peer else None  # noqa: E731
            rank0 = r["per_rank"][0]
            params = ddp["per_rank"][0]["parameter_bytes"] // 4 if ddp else None  # DDP holds fp32 params
            d2h = formula_device_to_host(stage, params, nproc, r["dtype"]) if params else None
            stage0 = by_key.get(("stage0", r["dtype"]))
            gathered = stage0["per_rank"][0]["host_to_device_per_step"] \
                if stage == 3 and stage0 and tier == "host" else None
            print(f"{nproc:5d} {tier:4s} {r['dtype']:5s} {r['row']:7s} {r['step_seconds']:7.3f} "
                  f"{fmt(ratio(ddp), '6.2f'):>6s} {fmt(ratio(fsdp2), '7.2f'):>7s} "
                  f"{rank0['device_to_host_per_step'] / MiB:8.2f} {fmt(d2h and d2h / MiB, '8.2f'):>8s} "
                  f"{rank0['all_gather_per_step'] / MiB:8.2f} {fmt(gathered and gathered / MiB, '8.2f'):>8s}",
                  file=out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="rank counts, each >= 2 (default 2 4)")
    p.add_argument("--tiers", nargs="+", choices=train_ranks.TIERS, default=list(train_ranks.TIERS))
    p.add_argument("--quick", action="store_true", help="the quick model, 2 ranks, host tier, fp32")
    p.add_argument("--json", default=None, metavar="PATH", help="write every table's rows as JSON here")
    args, rest = p.parse_known_args(argv)
    if args.quick:
        args.ranks, args.tiers, rest = [2], ["host"], ["--quick", "--dtypes", "fp32"] + rest
    if any(n < 2 for n in args.ranks):
        p.error("--ranks: each >= 2 (one process: tools/bench_train.py)")
    return args, rest


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    tables, failed = [], False
    for nproc in args.ranks:
        for tier in args.tiers:
            with tempfile.TemporaryDirectory(prefix="bench_zero-") as tmp:
                path = os.path.join(tmp, "rows.json")
                row_args = bench_train.parse_args(["--nproc", str(nproc), "--tier", tier, "--json", path] + rest)
                failed |= train_ranks.main(row_args) != 0
                with open(path) as f:
                    tables.append((nproc, tier, json.load(f)["rows"]))
            print()
    summary(tables)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"ranks": n, "tier": t, "rows": rows} for n, t, rows in tables], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
