"""``tools/bench_train.py --activations``: the device peak and step time of saved activations
kept, recomputed or moved ([Note: saved activations] in offload/memory/activations.py).

Per dtype and sequence length (--seq-lens; default 256 512 1024 2048 4096, --quick 32 64),
the GPT of --model at that length, batch --batch, every compute copy on the device
(param_tier="device", optimizer_tier="host"), each row a fresh subprocess:
  keep       activation_offload="auto" with no device budget: every saved tensor stays on
             the device and is counted, nothing moves (the no-offload peak, measured)
  recompute  keep with every block under torch.utils.checkpoint (non-reentrant)
  host       activation_offload="host": every unit's saved tensors but the last's move
  nvme       activation_offload="nvme" (swap files under --swap-dir or a temporary directory)
  auto       activation_offload="auto" with device_budget = keep's peak less half of its
             activations (at least host's peak): the earliest units' move, only as many as
             the budget needs
Columns: the device peak (compute copies, gradients on their way out, activations kept),
its ratio to keep's, the step time (median of the timed steps) and its ratio to keep's, and
the activation bytes moved to host and to NVMe in the last step. On a CPU-only machine the
"device" is RAM and every copy is a memcpy: the ratios say what moving costs there, not on
a GPU.

    python tools/bench_train.py --activations --dtypes bf16 --model small

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile

from train_harness import (GiB, batch_size, build_gpt, make_batch, model_config, run_row, timed_loop,
                           QUICK_STEPS, STEPS, WARMUP_STEPS)

ROWS = ("keep", "recompute", "host", "nvme", "auto")
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
            "activations": stats["activations"], "seq_len": spec["seq_len"]}


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
                keep = run_row(dict(spec, row="keep", config=dict(activation_offload="auto")), args.row_timeout)
                rows = [keep]
                for row, config in (("recompute", dict(activation_offload="auto")),
                                    ("host", dict(activation_offload="host")),
                                    ("nvme", dict(activation_offload="nvme", swap_dir=swap_dir))):
                    rows.append(run_row(dict(spec, row=row, config=config), args.row_timeout))
                host = rows[2]
                if "error" not in keep and "error" not in host:
                    # half the activations kept, but not below what "host" needed (the last
                    # unit's stay whatever the budget)
                    budget = max(host["device_peak_bytes"],
                                 keep["device_peak_bytes"] - keep["activations"]["device_peak_bytes"] // 2)
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
    print(f"{'dtype':5} {'seq':>5} {'row':9} {'device peak GiB':>15} {'x keep':>7} {'step s':>8} {'x keep':>7} "
          f"{'to host MiB':>11} {'to nvme MiB':>11}", file=out)
    keep = {(r["dtype"], r["seq_len"]): r for r in results if r["row"] == "keep" and "error" not in r}
    for r in results:
        head = f"{r['dtype']:5} {r['seq_len']:>5} {r['row']:9}"
        if "error" in r:
            print(f"{head} FAILED: {r['error']}", file=out)
            continue
        k = keep.get((r["dtype"], r["seq_len"]))
        act = r["activations"]
        print(f"{head} {r['device_peak_bytes'] / GiB:>15.3f} "
              f"{r['device_peak_bytes'] / k['device_peak_bytes'] if k else float('nan'):>7.2f} "
              f"{r['step_seconds']:>8.3f} {r['step_seconds'] / k['step_seconds'] if k else float('nan'):>7.2f} "
              f"{act['to_host_bytes'] / 2**20:>11.1f} {act['to_nvme_bytes'] / 2**20:>11.1f}", file=out)
