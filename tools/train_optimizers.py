"""``tools/bench_train.py --optimizer NAME ...``: the GPT of --model trained on NVMe with each
named optimizer (issue 40), beside plain PyTorch.

Rows, per dtype, each a fresh worker process (train_rows.run_offload):
  plain            the model in RAM with torch's fused AdamW (train_rows.run_plain): the
                   reference step of the same model
  NAME             offload with param_tier="nvme", optimizer_tier="nvme", prefetch, the
                   device budget of --budget-fraction (the nvme-prefetch row's config) and
                   the optimizers offload.plan_optimizers builds for NAME (`offload plan
                   --optimizer NAME` plans the same ones); AdamW ("adamw") is the baseline.
                   The model is built on the CPU, not on the meta device: wrap cannot take
                   the values of Adagrad's state made in its constructor over meta parameters
A name the machine cannot build (adafactor without transformers) is a FAILED row.
Columns: step time (median of the timed steps) and its ratio to AdamW's on NVMe; NVMe bytes
read and written per step (the engine's counters, bytes_read_nvme / bytes_written_nvme,
summed over the timed steps and divided by their number: an update deferred from one step
into the next counts once); "state B/p", the optimizer's state at home per trainable
parameter (stats()["optimizer_state_bytes"]: the moments home, each parameter's own
optimizer's tensors in whole pages ([Note: per-entry state slots]), and the master apart from
the compute copy: none in fp32, which merges it into the compute copy, its 2-byte low halves in
bf16 on NVMe, split_master); "side B/p", the tensors a whole-parameter
optimizer keeps per parameter in host RAM (Adafactor's row and column factors,
stats()["optimizer_side_bytes"]); peak RSS.

    python tools/bench_train.py --optimizer adamw sgd-momentum adagrad rmsprop adafactor muon \\
        --dtypes fp32 bf16 --warmup 1 --steps 3

Imports train_harness (see the graph in tools/bench_train.py); its rows run train_rows.run_offload
(bench_train.worker_main) with the spec's "optimizer".
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from train_harness import GB, GiB, QUICK_STEPS, STEPS, WARMUP_STEPS, batch_size, fmt, model_config, report, run_row

BASELINE = "adamw"
OFFLOAD_ROW = "nvme-prefetch"  # the config of every optimizer row (train_rows.offload_config)


def check_names(names) -> None:
    """A ValueError naming --optimizer when a name is not one of offload.plan_optimizers'."""
    from offload.plan_optimizers import OPTIMIZERS

    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"--optimizer: {', '.join(unknown)} not among {', '.join(OPTIMIZERS)}")


def main(args) -> int:
    from offload.plan_optimizers import describe

    names = list(dict.fromkeys(args.optimizer))
    base = {
        "model": model_config(args), "swap_checksums": args.swap_checksums == "on", "batch": batch_size(args),
        "steps": args.steps or (QUICK_STEPS if args.quick else STEPS),
        "warmup": args.warmup if args.warmup is not None else WARMUP_STEPS,
        "budget_fraction": args.budget_fraction, "threads": args.threads or (1 if args.quick else None),
    }
    own_swap = args.swap_dir is None
    swap_root = tempfile.mkdtemp(prefix="bench_train-opt-") if own_swap else os.path.abspath(args.swap_dir)
    os.makedirs(swap_root, exist_ok=True)
    base["swap_dir"] = swap_root
    print(f"model {base['model']}, batch {base['batch']}, {base['warmup']} warm-up + {base['steps']} timed steps; "
          f"swap dir {swap_root}", flush=True)
    for name in names:
        print(f"  {name}: {describe(name)}", flush=True)
    results = []
    try:
        for dtype in args.dtypes:
            for name in ["plain"] + names:
                spec = dict(base, row="plain" if name == "plain" else OFFLOAD_ROW, dtype=dtype)
                if name != "plain":
                    spec["optimizer"] = name
                result = dict(run_row(spec, args.row_timeout), optimizer=name)
                results.append(result)
                status = result.get("error") or f"{result['step_seconds']:.3f} s/step"
                print(f"  {name:14s} {dtype:5s} {status}", file=sys.stderr, flush=True)
    finally:
        if own_swap:
            shutil.rmtree(swap_root, ignore_errors=True)
    return report(results, print_table, args.json, base)


def print_table(results: list, out=sys.stdout) -> None:
    baseline = {r["dtype"]: r for r in results if r["optimizer"] == BASELINE and "error" not in r}
    header = (f"{'optimizer':14s} {'dtype':5s} {'step s':>8s} {'x AdamW':>7s} {'rd GB/st':>8s} {'wr GB/st':>8s} "
              f"{'state B/p':>9s} {'side B/p':>8s} {'RSS GiB':>7s}  note")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        head = f"{r['optimizer']:14s} {r['dtype']:5s}"
        if "error" in r:
            print(f"{head} FAILED: {r['error']}", file=out)
            continue
        base = baseline.get(r["dtype"])
        ratio = r["step_seconds"] / base["step_seconds"] if base else None
        params = r.get("trainable_params")
        state = r["optimizer_state_bytes"] / params if params else None
        side = r["optimizer_side_bytes"] / params if params else None
        read, written = r.get("nvme_read_mean_per_step"), r.get("nvme_written_mean_per_step")
        print(f"{head} {r['step_seconds']:8.3f} {fmt(ratio, '7.2f')} "
              f"{fmt(None if read is None else read / GB, '8.3f')} "
              f"{fmt(None if written is None else written / GB, '8.3f')} "
              f"{fmt(state, '9.2f')} {fmt(side, '8.3f')} {r['peak_rss_bytes'] / GiB:7.2f}  {r.get('note', '')}",
              file=out)
