"""What every row of tools/bench_train.py shares: the reference models and their batch, the
timing loop, a row in a fresh worker process (and the error line of one that failed), the
spec a run starts from, and the table helpers.

The bottom of the tools' import graph (drawn in tools/bench_train.py): imports nothing from
tools/. Nothing here imports offload at module level either: a worker sets torch's thread
count before offload is first imported, since offload sizes its native thread pool from it.
"""
from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
# Every row runs in a fresh process of the entry point (its --worker option).
ENTRY_POINT = TOOLS_DIR / "bench_train.py"
RESULT_PREFIX = "BENCH_TRAIN_RESULT "

GiB = 1 << 30
MiB = 1 << 20
GB = 1e9

DTYPES = ("fp32", "bf16")
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

FULL_MODEL = dict(vocab_size=32000, seq_len=256, d_model=1024, num_heads=16, num_layers=8,
                  qkv_bias=True, tie_embeddings=False)
QUICK_MODEL = dict(vocab_size=512, seq_len=64, d_model=128, num_heads=4, num_layers=4,
                   qkv_bias=True, tie_embeddings=False)
# --model small: ~21M params, a step of a few seconds on 2 cores (A/B runs of an engine option).
SMALL_MODEL = dict(vocab_size=8192, seq_len=128, d_model=512, num_heads=8, num_layers=4,
                   qkv_bias=True, tie_embeddings=False)
MODELS = {"full": FULL_MODEL, "small": SMALL_MODEL, "quick": QUICK_MODEL}
FULL_BATCH, QUICK_BATCH = 4, 2
# timed steps, and untimed ones before them, of a row (--steps, --warmup)
STEPS, QUICK_STEPS, WARMUP_STEPS = 5, 2, 2
# torch.optim.AdamW's settings wherever a row builds one (the engine's optimizer included)
ADAMW_OPTIONS = dict(lr=3e-4, weight_decay=0.1)


# ---------------------------------------------------------------------------- the run's spec
def model_config(args) -> dict:
    """The GPT of --model (default full; quick with --quick)."""
    return MODELS[args.model or ("quick" if args.quick else "full")]


def batch_size(args) -> int:
    return args.batch or (QUICK_BATCH if args.quick else FULL_BATCH)


def compute_element_bytes(dtype: str) -> int:
    """Bytes of one element of the compute copy (and of a plain model's parameters) in ``dtype``."""
    import torch

    return getattr(torch, TORCH_DTYPES[dtype]).itemsize


def pipeline_depth() -> int:
    """OffloadConfig.optimizer_pipeline_depth's default: the depth the I/O-only replays use."""
    from offload.config import OffloadConfig

    return OffloadConfig.optimizer_pipeline_depth


def floor_rows_base(args) -> dict:
    """The spec every row of --sweep-host-budget (tools/bench_sweep.py) and of
    --compare-defaults (tools/bench_defaults.py) starts from: the model, batch and steps of
    the arguments, and the device budget at its floor."""
    return {
        "model": model_config(args),
        "swap_checksums": args.swap_checksums == "on",
        "batch": batch_size(args),
        "steps": args.steps or (QUICK_STEPS if args.quick else 3),
        "warmup": args.warmup if args.warmup is not None else 1,
        # the device budget floor: train_rows.wrap_with_budget raises a budget below the
        # minimum to it + 2 blocks
        "budget_fraction": min(args.budget_fraction, 0.01),
        "threads": args.threads or (1 if args.quick else None),
    }


# ---------------------------------------------------------------------------- worker side
def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_batch(model_cfg: dict, batch: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    shape = (batch, model_cfg["seq_len"])
    idx = torch.randint(0, model_cfg["vocab_size"], shape, generator=gen)
    targets = torch.randint(0, model_cfg["vocab_size"], shape, generator=gen)
    return idx, targets


def rank_batch(spec: dict, device="cpu"):
    """This process's part of the global batch: all of it on one process, the rank's
    ``batch / nproc`` rows with several (every row of the table sees the same samples)."""
    idx, targets = make_batch(spec["model"], spec["batch"])
    if spec.get("nproc"):
        per_rank = spec["batch"] // spec["nproc"]
        part = slice(spec["rank"] * per_rank, (spec["rank"] + 1) * per_rank)
        idx, targets = idx[part], targets[part]
    return idx.to(device), targets.to(device)


def step_barrier(spec: dict):
    """With several ranks: a barrier before each step, so that every rank's clock starts
    together and the slowest rank's time is the step's; None on one process."""
    if not spec.get("nproc"):
        return None
    import torch.distributed as dist

    if spec["device"] == "cuda":
        return lambda: dist.barrier(device_ids=[spec["local_rank"]])
    return dist.barrier


def end_of_step(spec: dict):
    """Waits for queued device work, so a step's clock stops when the step is done."""
    if spec.get("device") == "cuda":
        import torch

        torch.cuda.synchronize()


def build_gpt(model_cfg: dict, meta: bool):
    import torch
    from offload.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT(GPTConfig(**model_cfg))
    return GPT(GPTConfig(**model_cfg))


def make_adamw(params):
    """torch.optim.AdamW, fused, or foreach where fused is refused; and which it is."""
    import torch

    params = list(params)
    try:
        return torch.optim.AdamW(params, **ADAMW_OPTIONS, fused=True), "fused"
    except (RuntimeError, ValueError):
        return foreach_adamw(params), "foreach"


def foreach_adamw(params):
    """The AdamW a row falls back to when fused=True was accepted at construction but
    refused at step time."""
    import torch

    return torch.optim.AdamW(params, **ADAMW_OPTIONS, foreach=True)


def timed_loop(step_fn, warmup: int, steps: int, before_step=None):
    """Runs warmup + steps calls of step_fn(), each after an untimed ``before_step()`` when
    given; returns per-step seconds of the timed ones and the list of what step_fn returned
    in each of them."""
    seconds, probes = [], []
    for i in range(warmup + steps):
        if before_step is not None:
            before_step()
        start = time.perf_counter()
        extra = step_fn()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            seconds.append(elapsed)
            probes.append(extra)
    return seconds, probes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- parent side
def worker_command(spec: dict):
    """The command line and environment of a worker process running ``spec``."""
    cmd = [sys.executable, str(ENTRY_POINT), "--worker", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    return cmd, env


def error_line(output: str, returncode: int) -> tuple:
    """The line of a failed worker's output that says what went wrong, and its last lines."""
    # torch prefixes a rank's traceback lines with "[rank<r>]: ".
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"Error|error|Exception|Killed", ln)]
    tail = (errors or lines or [f"exit status {returncode}"])[-1].strip()
    if returncode < 0:
        tail = f"killed by signal {-returncode}; last: {tail}"
    return tail[:300], "\n".join(lines[-30:])


def run_row(spec: dict, timeout_s: float) -> dict:
    """One configuration in a fresh subprocess; failures become a row with an error."""
    cmd, env = worker_command(spec)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"row": spec["row"], "dtype": spec["dtype"], "error": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            result["wall_seconds"] = time.perf_counter() - start
            return result
    error, tail = error_line(proc.stderr + proc.stdout, proc.returncode)
    return {"row": spec["row"], "dtype": spec["dtype"], "error": error, "stderr_tail": tail}


def report(results: list, print_tables, json_path, config: dict, json_extra: dict | None = None,
           failed=lambda r: "error" in r) -> int:
    """The end of every table tool: a blank line, ``print_tables(results)``, the run's config
    and rows as JSON to ``json_path`` (when given; ``json_extra``'s keys between the two),
    and the exit code: 1 when a row is ``failed`` (by default: it has an error), else 0."""
    print()
    print_tables(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": config, **(json_extra or {}), "rows": results}, f, indent=1)
    return 1 if any(failed(r) for r in results) else 0


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_baselines(results: list, row: str, what: str, rss_note: str, out) -> None:
    """One line per dtype: the baseline row's step time and peak RSS."""
    by_key = {(r["row"], r["dtype"]): r for r in results}
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        base = by_key.get((row, dtype))
        if base and "error" not in base:
            print(f"baseline {dtype}: {what} {base['step_seconds']:.3f} s, "
                  f"peak RSS {base['peak_rss_bytes'] / GiB:.2f} GiB{rss_note}", file=out)
