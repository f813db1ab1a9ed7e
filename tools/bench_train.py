"""Training-step benchmark of offload against plain PyTorch and DeepSpeed ZeRO-3 offload.

Reference workload: offload.gpt.GPT(vocab 32000, seq 256, d_model 1024, 16 heads, 8 layers,
qkv_bias, untied head; 166,569,984 params), batch 4, fp32 and bf16. Each configuration (row)
runs in its own fresh subprocess, so its peak RSS (ru_maxrss) is its own; the parent collects
one JSON line per row and prints the table. Step time is the median of --steps timed steps
after --warmup untimed ones (forward + backward + optimizer step, wall clock).

Rows (--rows):
  plain            the model in RAM, torch.optim.AdamW(fused=True) (foreach if fused fails);
                   bf16 = torch.autocast("cpu", dtype=torch.bfloat16). The baseline.
  compute-only     offload, everything in RAM: param_tier=device, optimizer_tier=host, no
                   device budget. The compute part of an offloaded step.
  host             offload, param_tier=host, optimizer_tier=host, device budget (see below).
  nvme-noprefetch  offload, param_tier=nvme, optimizer_tier=nvme, prefetch=False, budget.
  nvme-prefetch    the same with prefetch=True.
  nvme-clip        nvme-prefetch with max_grad_norm set (--max-grad-norm, default 1e9: clipping
                   on but never triggering): speculative updates ([Note: speculative updates]).
  nvme-clip-serial nvme-clip with speculative_updates=False: the serialized step (norm after
                   backward, then every update).
  io-only          no compute: replays the swap traffic of one NVMe step through
                   offload.io.IOEngine (per unit: read the compute copy in forward, again in
                   backward in reverse order, then a read + write of master and moments in
                   the optimizer's pipelined order; with bf16 the master is its low halves
                   plus the compute copy, see split_master), with the byte counts per phase measured
                   from engine.stats() of the NVMe row of the same dtype.
  ds-cpu, ds-nvme  DeepSpeed ZeRO-3, offload_param + offload_optimizer to cpu / nvme (when
                   deepspeed imports; DS_ACCELERATOR=cpu, gloo, world size 1). bf16 via autocast.

Device budget: --budget-fraction (0.25) of the model's compute-copy bytes (params x 4 for
fp32, x 2 for bf16). The engine needs at least the root unit (embeddings + head) + the largest
block + the largest gradient; when the fraction is below that, the row uses the minimum the
engine accepts and the table says so ("budget=min").

DeepSpeed setup (once per machine): pip install deepspeed torch==2.13.0; apt-get install -y
libaio-dev; then prebuild its JIT ops (cpu_adam took ~14 min on 2 busy cores, async_io a few),
or the first DeepSpeed row spends that time inside its step and may hit --row-timeout:
    DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder import CPUAdamBuilder, \
        AsyncIOBuilder; CPUAdamBuilder().load(); AsyncIOBuilder().load()"
A row that fails (DeepSpeed 0.19.8 NVMe param swap may stop with "Not enough buffers") is
printed as FAILED with its error; the other rows go on.

Overlap efficiency (NVMe rows) = max(compute-only step, I/O-only step) / this row's step:
1.0 means I/O is fully hidden behind compute (or the reverse). When the io-only row is asked
for, each NVMe row also runs --steps more pairs of a timed step and, once the step's pending
updates are done (engine.zero_grad()), a replay of its own swap traffic (the io-only row's
replay); the overlap is the median of the per-pair ratios: the disk's speed here drifts by
1.5x and more between minutes, so a step is compared with an I/O-only step taken seconds after
it, not with the io-only row taken minutes later (see train_replay.paired_replay). The JSON
keeps both lists (paired_step_seconds, paired_io_seconds); step time and RSS are those of the
timed steps before the pairs.

    python tools/bench_train.py                       # full size, every row, fp32 + bf16
    python tools/bench_train.py --quick               # tiny GPT, 2+2 steps, < 1 minute
    python tools/bench_train.py --rows plain nvme-prefetch io-only --dtypes bf16 --json out.json

Optimizers (--optimizer NAME ...; issue 40): the nvme-prefetch row with each named optimizer
(offload.plan_optimizers, what `offload plan --optimizer NAME` plans), AdamW the baseline of
the ratio, beside the plain row; step time, NVMe bytes per step and the optimizer's state
bytes per parameter (tools/train_optimizers.py).

    python tools/bench_train.py --optimizer adamw sgd-momentum adafactor muon --dtypes fp32

Several ranks (--nproc N, N >= 2; ZeRO stages, issue 8). Each row is a fresh set of N worker
processes on this node (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in their environment,
as torchrun sets them; a free port per row), every rank on global_batch / N of the same global
batch (--batch, rounded up to a multiple of N), torch threads = cores / N per rank unless
--threads says otherwise. Rows per dtype:
  ddp              torch DistributedDataParallel (default settings) + torch.optim.AdamW
                   (fused, foreach if fused fails); gloo on --device cpu, NCCL on --device
                   cuda (one GPU per rank). The baseline.
  fsdp2            torch FSDP2 (fully_shard per block and the root) + foreach AdamW on the
                   shards: CPUOffloadPolicy on cuda; on cpu the shards are host memory
                   already (FSDP2 refuses CPUOffloadPolicy without an accelerator).
                   --no-fsdp2 leaves it out.
  stage0..stage3   offload with OffloadConfig(stage=S) (--stages), both tiers on --tier
                   (host, or nvme with prefetch and a swap dir per rank), the device budget
                   as above. The engine's own collectives run on gloo either way.
A step is timed from a barrier (untimed) to the end of the optimizer step, on every rank; a
row's step time is the median over steps of the slowest rank's time. Per rank: peak RSS,
and from engine.stats() parameter_bytes (compute copies at home: the rank's chunks at stage
3), optimizer_state_bytes (fp32 master apart from the compute copy +
Adam moments), gradient_bytes (fp32 gradient buffers), device_peak_bytes, and NVMe bytes
read / written per step, and per step the bytes the engine moved device->host (gradients:
the whole unit at stages 0/1, the rank's fp32 shard at 2/3), host->device (compute copies
fetched) and into stage-3 all-gathers (the gathered slots). For ddp the same columns come from the torch objects: Adam moments
in optimizer.state, param.grad (DDP's reducer buckets hold about as much again), and
torch.cuda.max_memory_allocated on CUDA. A row that fails on any rank prints FAILED with the
first failing rank's error; the other ranks of that row are stopped and the next row runs.
The exit status is 1 when a row failed.

    python tools/bench_train.py --nproc 2 --dtypes fp32              # ddp + stages 0-3 on NVMe
    python tools/bench_train.py --nproc 2 --quick --tier host --stages 1 2
    python tools/bench_train.py --nproc 2 --device cuda              # needs 2 GPUs

Layout, by what each part measures (an arrow is an import; none leads back, so there is no
import circle; no module imports offload at module level, so that a worker sets torch's
thread count before offload sizes its native pool from it):

    bench_train.py     the command line and a worker's row dispatch (--worker)
      -> train_rows.py, train_ranks.py, train_deepspeed.py, train_replay.py,
         bench_sweep.py, bench_defaults.py, bench_activations.py, train_optimizers.py,
         train_harness.py
    train_rows.py      plain and offload rows; a single-process run and its table
      -> train_replay.py, train_deepspeed.py, train_harness.py, trace_summary.py
    train_ranks.py     ddp, fsdp2 and the stage rows (--nproc); the per-rank table  -> train_harness.py
    train_deepspeed.py the DeepSpeed rows                                    -> train_harness.py
    train_replay.py    the I/O-only replays (io-only, paired overlap)        -> train_harness.py
    bench_sweep.py     --sweep-host-budget                                   -> train_harness.py
    bench_defaults.py  --compare-defaults                                    -> train_harness.py
    bench_activations.py --activations                                       -> train_harness.py
    train_optimizers.py --optimizer                                          -> train_harness.py
    train_harness.py   models, batches, the timing loop, a row in a worker process, table
                       helpers, constants; imports nothing from tools/
    (tools/bench_scale.py -> train_replay.py: its io-only row replays the same way;
     tools/bench_optim.py -> bench_adam.py: the same timing loop and CPU model;
     tools/bench_compact.py -> bench_adam.py: its triads, timing loop and CPU model)
    (tools/bench_zero.py -> bench_train.py, train_ranks.py, train_harness.py: the --nproc
     tables for several rank counts and tiers, and their summary)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# Run from a source checkout (in-place build) without installing; the modules beside this
# file import each other by name.
TOOLS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS_DIR.parent))
sys.path.insert(0, str(TOOLS_DIR))

import bench_activations  # noqa: E402 - after the path above
import bench_defaults  # noqa: E402
import bench_sweep  # noqa: E402
import train_optimizers  # noqa: E402
import train_ranks  # noqa: E402
import train_rows  # noqa: E402
from train_deepspeed import DS_ROWS, run_deepspeed  # noqa: E402
from train_harness import (DTYPES, FULL_BATCH, MODELS, QUICK_BATCH, QUICK_STEPS, RESULT_PREFIX,  # noqa: E402
                           STEPS, WARMUP_STEPS, peak_rss_bytes)
from train_replay import run_io_only  # noqa: E402


def worker_main(spec: dict) -> int:
    """A worker process: one row of ``spec``, its result printed as one JSON line."""
    import torch

    # Before offload is imported: its native pool takes torch's thread count.
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    if spec.get("nproc"):
        spec = train_ranks.init_rank(spec)
    row = spec["row"]
    if spec.get("activations"):
        result = bench_activations.run_worker(spec)
    elif row == "ddp":
        result = train_ranks.run_ddp(spec)
    elif row == "fsdp2":
        result = train_ranks.run_fsdp2(spec)
    elif row == "plain":
        result = train_rows.run_plain(spec)
    elif row == "io-only":
        result = run_io_only(spec)
    elif row in DS_ROWS:
        result = run_deepspeed(spec)
    else:
        result = train_rows.run_offload(spec)
    result.setdefault("peak_rss_bytes", peak_rss_bytes())
    result.update(row=row, dtype=spec["dtype"], step_seconds=statistics.median(result["step_seconds_all"]))
    if spec.get("nproc"):
        train_ranks.end_rank(spec, result)
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"tiny GPT, batch {QUICK_BATCH}, {WARMUP_STEPS} warm-up + {QUICK_STEPS} timed steps "
                        "(smoke test; < 1 minute)")
    p.add_argument("--rows", nargs="+", choices=train_rows.ROWS, default=None,
                   help="rows to run (default: all but nvme-clip and nvme-clip-serial)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--model", choices=tuple(MODELS), default=None,
                   help="the GPT's size (default full; quick with --quick): small is ~21M params")
    p.add_argument("--swap-checksums", choices=("on", "off"), default="on",
                   help="OffloadConfig.swap_checksums of the NVMe rows (default on, the engine's)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps (default {STEPS}; {QUICK_STEPS} with --quick)")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed steps first (default {WARMUP_STEPS})")
    p.add_argument("--batch", type=int, default=None,
                   help=f"batch size (default {FULL_BATCH}; {QUICK_BATCH} with --quick)")
    p.add_argument("--swap-dir", default=None,
                   help="directory for swap files (default: a fresh temp dir under $TMPDIR or /tmp)")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="device budget as a fraction of the compute-copy bytes (default 0.25)")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    p.add_argument("--max-grad-norm", type=float, default=1e9,
                   help="max_grad_norm of the nvme-clip rows (default 1e9: on, never triggering)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per row (default: torch's)")
    p.add_argument("--row-timeout", type=float, default=1800.0, help="seconds per row before it is killed")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="offload rows export their engine's trace (Engine.export_trace) here as "
                        "ROW-DTYPE.json, and a summary of its last step (tools/trace_summary.py) "
                        "is printed after the table")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="N >= 2 ranks on this node: ddp + offload ZeRO stages (see above)")
    p.add_argument("--stages", nargs="+", type=int, choices=train_ranks.STAGES, default=list(train_ranks.STAGES),
                   help="with --nproc: ZeRO stages to run (default 0 1 2 3)")
    p.add_argument("--no-fsdp2", action="store_true", help="with --nproc: skip the torch FSDP2 row")
    p.add_argument("--tier", choices=train_ranks.TIERS, default="nvme",
                   help="with --nproc: home of params and optimizer states (default nvme)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="with --nproc: cpu (gloo) or cuda (NCCL for ddp, one GPU per rank)")
    p.add_argument("--collective-timeout", type=float, default=300.0,
                   help="with --nproc: seconds a collective may wait for the other ranks")
    p.add_argument("--compare-defaults", action="store_true",
                   help="the tiers' defaults ('auto') against param_tier='host', optimizer_tier='host' in four "
                        "scenarios (tools/bench_defaults.py)")
    p.add_argument("--tight-fraction", type=float, default=0.5,
                   help="with --compare-defaults: the last scenario's host budget as a fraction of the "
                        "old defaults' RSS")
    p.add_argument("--sweep-host-budget", action="store_true",
                   help="placement 'auto' at host budgets from 0.3x to 1.2x the plain run's RSS, at "
                        "the device budget floor: step time measured and predicted (tools/bench_sweep.py)")
    p.add_argument("--fractions", nargs="+", type=float, default=None,
                   help="with --sweep-host-budget: host budgets as fractions of the plain RSS")
    p.add_argument("--delayed-update", action="store_true",
                   help="with --sweep-host-budget: also every point with delayed_update=True")
    p.add_argument("--machine-profile", default=None, metavar="PATH",
                   help="with --sweep-host-budget: an `offload profile --json` file for auto placement")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="with --sweep-host-budget: step time against host budget (needs matplotlib)")
    p.add_argument("--activations", action="store_true",
                   help="device peak and step time of saved activations kept, recomputed or moved, per "
                        "sequence length (tools/bench_activations.py)")
    p.add_argument("--seq-lens", nargs="+", type=int, default=None,
                   help="--activations: sequence lengths (default 256 512 1024 2048 4096; --quick 32 64)")
    p.add_argument("--optimizer", nargs="+", default=None, metavar="NAME",
                   help="the GPT on NVMe with each named optimizer (offload.plan_optimizers: adamw, sgd, "
                        "sgd-momentum, adagrad, rmsprop, adafactor, muon) beside plain PyTorch "
                        "(tools/train_optimizers.py)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not 0 < args.budget_fraction <= 1:
        p.error("--budget-fraction must be in (0, 1]")
    if args.optimizer is not None and args.worker is None:
        try:
            train_optimizers.check_names(args.optimizer)
        except ValueError as e:
            p.error(str(e))
    if args.nproc is None:
        given = [f"--{name.replace('_', '-')}" for name, default in (
            ("stages", list(train_ranks.STAGES)), ("tier", "nvme"), ("device", "cpu"), ("no_fsdp2", False))
            if getattr(args, name) != default]
        if given:
            p.error(f"{' '.join(given)}: only with --nproc")
    else:
        if args.nproc < 2:
            p.error("--nproc must be >= 2 (one process: leave --nproc out)")
        if args.rows is not None:
            p.error("--rows picks single-process rows; with --nproc the rows are ddp and --stages")
        if args.device == "cuda":
            cuda_problem = train_ranks.cuda_unusable(args.nproc)
            if cuda_problem:
                p.error(f"--device cuda: {cuda_problem}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))
    if args.nproc is not None:
        return train_ranks.main(args)
    if args.activations:
        return bench_activations.main(args)
    if args.optimizer is not None:
        return train_optimizers.main(args)
    if args.sweep_host_budget:
        return bench_sweep.main(args)
    if args.compare_defaults:
        return bench_defaults.main(args)
    return train_rows.main(args)


if __name__ == "__main__":
    sys.exit(main())
