"""``tools/bench_train.py --activations``: the device peak and step time of saved activations
kept, recomputed or moved ([Note: saved activations] in offload/memory/activations.py).

Per dtype and sequence length (--seq-lens; default 256 512 1024 2048 4096, --quick 32 64),
the GPT of --model at that length, batch --batch, every compute copy on the device
(param_tier="device", optimizer_tier="host"), each row a fresh subprocess:
  none       activation_offload=None: the model's activations where it puts them, outside
             the engine's counters (the step-time baseline; its device peak counts none)
  keep       activation_offload="auto" with no device budget: every saved tensor stays on
             the device and is counted, nothing moves (the no-offload peak, measured)
  recompute  keep with every block under torch.utils.checkpoint (non-reentrant)
  host       activation_offload="host": every unit's saved tensors but the last's move
  nvme       activation_offload="nvme" (swap files under --swap-dir or a temporary directory)
  auto       activation_offload="auto" with a device_budget whose room for activations is
             half-way between what host keeps on the device and all of them (auto_budget):
             the earliest units' move, only as many as the budget needs
Columns: the device peak the engine accounts (compute copies, gradients on their way out,
activations kept) and its ratio to keep's, the step time (median of the timed steps) and its
ratio to none's, and the activation bytes of the last step's forward kept on the device,
moved to host RAM and to NVMe, and the peak of their host buffers. Each row's JSON carries
the config it ran (``config``), so that ``offload plan --seq-len`` (plan_activations) can
predict its byte columns (tests/test_tools_bench.py checks they are equal). On a CPU-only
machine the "device" is RAM and every copy is a memcpy: the ratios say what moving costs
there, not on a GPU.

    python tools/bench_train.py --activations --dtypes bf16 --model small

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile

from train_harness import (MiB, batch_size, compute_element_bytes, build_gpt, make_batch, model_config, run_row, timed_loop,
                           QUICK_STEPS, STEPS, WARMUP_STEPS)

ROWS = ("none", "keep", "recompute", "host", "nvme", "auto")
SEQ_LENS, QUICK_SEQ_LENS = (256, 512, 1024, 2048, 4096), (32, 64)


def run_worker(spec: dict) -> dict:
    """One row in a worker process (bench_train.worker_main calls it)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import offload

    model_cfg = dict(spec["model"], seq_len=spec["seq_len"])
    model = build_gpt(model_cfg, meta=False)
    if spec["row"] == "recompute":
        class Checkpointed(torch.nn.Module):
            def __init__(self, block):
                super().__init__()
                self.block = block

            def forward(self, x):
                return checkpoint(self.block, x, use_reentrant=False)

        for i, block in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(block)
    config = dict(param_tier="device", optimizer_tier="host", dtype=spec["dtype"], **spec["config"])
    idx, targets = make_batch(model_cfg, spec["batch"])
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-4), config=config) as engine:
        def step():
            engine.backward(engine(idx, targets))
            engine.step()
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
        stats = engine.stats()
    return {"step_seconds_all": seconds, "device_peak_bytes": stats["device_peak_bytes"],
            "activations": stats["activations"], "seq_len": spec["seq_len"], "batch": spec["batch"],
            "model": model_cfg, "config": config}


def auto_budget(spec: dict, keep: dict, host: dict) -> int:
    """The auto row's device_budget: room for the activations half-way between those "host"
    kept on the device (the last unit's, and what never moves: auto cannot keep fewer) and
    all of them ("keep"), beside every compute copy and the reserve for the largest
    gradient (budget.activation_room_bytes: "auto"'s room is the budget less those two)."""
    import torch

    from offload.memory.budget import minimum_device_budget, model_unit_sizes

    element_bytes = compute_element_bytes(spec["dtype"])
    with torch.device("meta"):
        sizes = model_unit_sizes(build_gpt(dict(spec["model"], seq_len=spec["seq_len"]), meta=True), element_bytes)
    room = (keep["activations"]["device_peak_bytes"] + host["activations"]["device_peak_bytes"]) // 2
    return minimum_device_budget(sizes, "device", element_bytes) + room


def main(args) -> int:
    seq_lens = tuple(args.seq_lens or (QUICK_SEQ_LENS if args.quick else SEQ_LENS))
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    warmup = WARMUP_STEPS if args.warmup is None else args.warmup
    base = dict(model=model_config(args), batch=batch_size(args), steps=steps, warmup=warmup,
                threads=args.threads, activations=True)
    swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="bench-activations-")
    results, failed = [], False
    try:
        for dtype in args.dtypes:
            for seq_len in seq_lens:
                spec = dict(base, dtype=dtype, seq_len=seq_len)
                rows = [run_row(dict(spec, row="none", config=dict(activation_offload=None)), args.row_timeout)]
                keep = run_row(dict(spec, row="keep", config=dict(activation_offload="auto")), args.row_timeout)
                rows.append(keep)
                for row, config in (("recompute", dict(activation_offload="auto")),
                                    ("host", dict(activation_offload="host")),
                                    ("nvme", dict(activation_offload="nvme", swap_dir=swap_dir))):
                    rows.append(run_row(dict(spec, row=row, config=config), args.row_timeout))
                host = rows[3]
                if "error" not in keep and "error" not in host:
                    budget = auto_budget(spec, keep, host)
                    rows.append(run_row(dict(spec, row="auto", config=dict(activation_offload="auto",
                                                                             device_budget=budget)),
                                        args.row_timeout))
                for r in rows:
                    r.update(dtype=dtype, seq_len=seq_len)
                    if "error" not in r:
                        r["step_seconds"] = statistics.median(r["step_seconds_all"])
                    failed |= "error" in r
                results.extend(rows)
    finally:
        if args.swap_dir is None:
            shutil.rmtree(swap_dir, ignore_errors=True)
    print_table(results, sys.stdout)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


def print_table(results: list, out) -> None:
    """One line per row; activation bytes are the last step's (kept, to host, to NVMe) and
    the host buffers' peak since wrap, in MiB."""
    print(f"{'dtype':5} {'seq':>5} {'row':9} {'device peak MiB':>15} {'x keep':>7} {'step s':>8} {'x none':>7} "
          f"{'kept MiB':>9} {'to host MiB':>11} {'to nvme MiB':>11} {'host peak MiB':>13}", file=out)
    by_row = {(r["dtype"], r["seq_len"], r["row"]): r for r in results if "error" not in r}
    for r in results:
        head = f"{r['dtype']:5} {r['seq_len']:>5} {r['row']:9}"
        if "error" in r:
            print(f"{head} FAILED: {r['error']}", file=out)
            continue
        keep, none = (by_row.get((r["dtype"], r["seq_len"], row)) for row in ("keep", "none"))
        act = r["activations"]
        print(f"{head} {r['device_peak_bytes'] / MiB:>15.1f} "
              f"{r['device_peak_bytes'] / keep['device_peak_bytes'] if keep else float('nan'):>7.2f} "
              f"{r['step_seconds']:>8.3f} {r['step_seconds'] / none['step_seconds'] if none else float('nan'):>7.2f} "
              f"{act['kept_bytes'] / MiB:>9.1f} {act['to_host_bytes'] / MiB:>11.1f} "
              f"{act['to_nvme_bytes'] / MiB:>11.1f} {act['host_peak_bytes'] / MiB:>13.1f}", file=out)
