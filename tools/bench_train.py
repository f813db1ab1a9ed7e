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
it, not with the io-only row taken minutes later (see paired_replay). The JSON keeps both lists
(paired_step_seconds, paired_io_seconds); step time and RSS are those of the timed steps
before the pairs.

    python tools/bench_train.py                       # full size, every row, fp32 + bf16
    python tools/bench_train.py --quick               # tiny GPT, 2+2 steps, < 1 minute
    python tools/bench_train.py --rows plain nvme-prefetch io-only --dtypes bf16 --json out.json

Several ranks (--nproc N, N >= 2; ZeRO stages, issue 8). Each row is a fresh set of N worker
processes on this node (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in their environment,
as torchrun sets them; a free port per row), every rank on global_batch / N of the same global
batch (--batch, rounded up to a multiple of N), torch threads = cores / N per rank unless
--threads says otherwise. Rows per dtype:
  ddp              torch DistributedDataParallel (default settings) + torch.optim.AdamW
                   (fused, foreach if fused fails); gloo on --device cpu, NCCL on --device
                   cuda (one GPU per rank). The baseline.
  stage0..stage3   offload with OffloadConfig(stage=S) (--stages), both tiers on --tier
                   (host, or nvme with prefetch and a swap dir per rank), the device budget
                   as above. The engine's own collectives run on gloo either way.
A step is timed from a barrier (untimed) to the end of the optimizer step, on every rank; a
row's step time is the median over steps of the slowest rank's time. Per rank: peak RSS,
and from engine.stats() parameter_bytes (compute copies at home: the rank's chunks at stage
3), optimizer_state_bytes (fp32 master apart from the compute copy +
Adam moments), gradient_bytes (fp32 gradient buffers), device_peak_bytes, and NVMe bytes
read / written per step. For ddp the same columns come from the torch objects: Adam moments
in optimizer.state, param.grad (DDP's reducer buckets hold about as much again), and
torch.cuda.max_memory_allocated on CUDA. A row that fails on any rank prints FAILED with the
first failing rank's error; the other ranks of that row are stopped and the next row runs.
The exit status is 1 when a row failed.

    python tools/bench_train.py --nproc 2 --dtypes fp32              # ddp + stages 0-3 on NVMe
    python tools/bench_train.py --nproc 2 --quick --tier host --stages 1 2
    python tools/bench_train.py --nproc 2 --device cuda              # needs 2 GPUs
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run from a source checkout (in-place build) without installing.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from offload.units import PAGE_BYTES  # noqa: E402 - after the path above

GiB = 1 << 30
GB = 1e9
RESULT_PREFIX = "BENCH_TRAIN_RESULT "

ROWS = ("plain", "compute-only", "host", "nvme-noprefetch", "nvme-prefetch", "nvme-clip", "nvme-clip-serial",
        "io-only", "ds-cpu", "ds-nvme", "auto")
NVME_ROWS = ("nvme-noprefetch", "nvme-prefetch", "nvme-clip", "nvme-clip-serial")
CLIP_ROWS = ("nvme-clip", "nvme-clip-serial")
# the clipping rows on request; auto is --sweep-host-budget's (tools/bench_sweep.py)
DEFAULT_ROWS = tuple(r for r in ROWS if r not in CLIP_ROWS + ("auto",))
DS_ROWS = ("ds-cpu", "ds-nvme")
DTYPES = ("fp32", "bf16")
STAGES = (0, 1, 2, 3)
TIERS = ("host", "nvme")

FULL_MODEL = dict(vocab_size=32000, seq_len=256, d_model=1024, num_heads=16, num_layers=8,
                  qkv_bias=True, tie_embeddings=False)
QUICK_MODEL = dict(vocab_size=512, seq_len=64, d_model=128, num_heads=4, num_layers=4,
                   qkv_bias=True, tie_embeddings=False)
# --model small: ~21M params, a step of a few seconds on 2 cores (A/B runs of an engine option).
SMALL_MODEL = dict(vocab_size=8192, seq_len=128, d_model=512, num_heads=8, num_layers=4,
                   qkv_bias=True, tie_embeddings=False)
FULL_BATCH, QUICK_BATCH = 4, 2


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
    import torch

    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=True), "fused"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True), "foreach"


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


def run_plain(spec: dict) -> dict:
    import torch

    model = build_gpt(spec["model"], meta=False)
    opt, flavour = make_adamw(model.parameters())
    idx, targets = make_batch(spec["model"], spec["batch"])
    bf16 = spec["dtype"] == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
    except RuntimeError as error:
        if flavour != "fused":
            raise
        # fused=True was accepted at construction but refused at step time: use foreach.
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
        flavour = f"foreach (fused failed: {str(error).splitlines()[0][:80]})"
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
    return {"step_seconds_all": seconds, "note": f"AdamW {flavour}"}


def bench_units(name: str, module) -> bool:
    """wte and head as units of their own, besides each block. The default policy puts them
    in the root unit, which stays on the device from forward to backward: 66M of the
    166.6M parameters, more than a 25% budget by itself."""
    return name in ("wte", "head") or re.fullmatch(r"blocks\.\d+", name) is not None


def offload_config(spec: dict, device_budget):
    row = spec["row"]
    device = f"cuda:{spec['local_rank']}" if spec.get("device") == "cuda" else "cpu"
    common = dict(device=device, dtype=spec["dtype"], unit_predicate=bench_units)
    if spec.get("nproc"):
        tier = spec["tier"]
        config = dict(common, stage=spec["stage"], param_tier=tier, optimizer_tier=tier,
                      device_budget=device_budget)
        return dict(config, swap_dir=spec["swap_dir"], prefetch=True) if tier == "nvme" else config
    if row == "compute-only":
        return dict(common, param_tier="device", optimizer_tier="host", device_budget=None)
    if row == "host":
        return dict(common, param_tier="host", optimizer_tier="host", device_budget=device_budget)
    if row in ("defaults", "old-defaults"):  # --compare-defaults (tools/bench_defaults.py)
        config = dict(common, device_budget=None if spec.get("no_device_budget") else device_budget,
                      swap_dir=spec.get("swap_dir"), host_budget=spec.get("host_budget"),
                      max_grad_norm=spec.get("max_grad_norm"), swap_checksums=spec.get("swap_checksums", True))
        return dict(config, param_tier="host", optimizer_tier="host") if row == "old-defaults" else config
    if row == "auto":  # --sweep-host-budget: [Note: placement by budget]
        config = dict(common, param_tier="auto", optimizer_tier="auto", device_budget=device_budget,
                      swap_dir=spec["swap_dir"], host_budget=spec["host_budget"],
                      machine_profile=spec.get("machine_profile"))
        # the steady state of a delayed run: no exact warm-up steps inside the few timed ones
        return dict(config, delayed_update=True, delayed_update_warmup_steps=0) if spec.get("delayed_update") \
            else config
    assert row in NVME_ROWS, row
    config = dict(common, param_tier="nvme", optimizer_tier="nvme", device_budget=device_budget,
                  swap_dir=spec["swap_dir"], prefetch=row != "nvme-noprefetch",
                  swap_checksums=spec.get("swap_checksums", True))
    if row in CLIP_ROWS:
        config.update(max_grad_norm=spec.get("max_grad_norm", 1e9), speculative_updates=row == "nvme-clip")
    return config


def wrap_with_budget(spec: dict):
    """offload.wrap under budget_fraction of the compute-copy bytes, or, when that is below
    the smallest budget the engine accepts (offload.memory.budget.minimum_device_budget),
    under that minimum plus room for two blocks."""
    import torch
    import offload
    from offload.memory.budget import minimum_device_budget, model_unit_sizes

    element_bytes = 4 if spec["dtype"] == "fp32" else 2
    model = build_gpt(spec["model"], meta=True)
    compute_bytes = sum(p.numel() for p in model.parameters()) * element_bytes
    wanted = int(spec["budget_fraction"] * compute_bytes)
    budget, note = wanted, f"budget {spec['budget_fraction']:.0%}"
    config = offload.OffloadConfig(**offload_config(spec, budget))
    # The units as one process cuts them. [zero] At stage 3 a unit's device slot is up to a
    # page longer (room for its gathers): the two blocks added below cover that, a fraction
    # within a page above this minimum does not.
    minimum = minimum_device_budget(model_unit_sizes(model, element_bytes, unit_predicate=bench_units),
                                    config.param_tier, element_bytes)
    if config.device_budget is not None and wanted < minimum:
        # The minimum holds one unit at a time; add room for two blocks so that prefetch
        # has somewhere to put the next ones.
        block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * element_bytes
        budget = minimum + 2 * block_bytes
        note = (f"budget=min+2 blocks {budget / (1 << 20):.0f} MiB = {budget / compute_bytes:.0%} "
                f"(> {spec['budget_fraction']:.0%})")
        config = offload.OffloadConfig(**offload_config(spec, budget))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    engine = offload.wrap(model, opt, config=config)
    if config.device_budget is None:
        note = "no budget"
    return engine, {"device_budget_bytes": config.device_budget,
                    "budget_wanted_bytes": wanted if config.device_budget else None,
                    "compute_copy_bytes": compute_bytes, "note": note}


PHASE_BYTES = ("forward_read", "backward_read", "optimizer_read",
               "forward_written", "backward_written", "optimizer_written")


def median_phases(probes: list) -> dict:
    """Each probe's key's median over the timed steps, but the bytes per phase (PHASE_BYTES)
    all from one step, the median one by its whole traffic (the lower of two): a sum of each
    phase's median would count work that moves between phases from step to step (deferred or
    taken-back updates) twice or not at all. The I/O-only replays replay these bytes."""
    phases = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
    moved = sorted(probes, key=lambda p: sum(p[k] for k in PHASE_BYTES))[(len(probes) - 1) // 2]
    phases.update({k: moved[k] for k in PHASE_BYTES})
    return phases


def run_offload(spec: dict) -> dict:
    engine, info = wrap_with_budget(spec)
    idx, targets = rank_batch(spec, engine.device)
    keys = ("bytes_read_nvme", "bytes_written_nvme", "io_wait_seconds")

    def snapshot():
        s = engine.stats()
        return {k: s[k] for k in keys}, time.perf_counter()

    def step():
        s0, t0 = snapshot()
        loss = engine(idx, targets)
        s1, t1 = snapshot()
        engine.backward(loss)
        s2, t2 = snapshot()
        engine.step()
        end_of_step(spec)
        s3, t3 = snapshot()
        return {
            "forward_seconds": t1 - t0, "backward_seconds": t2 - t1, "optimizer_seconds": t3 - t2,
            "forward_read": s1["bytes_read_nvme"] - s0["bytes_read_nvme"],
            "backward_read": s2["bytes_read_nvme"] - s1["bytes_read_nvme"],
            "optimizer_read": s3["bytes_read_nvme"] - s2["bytes_read_nvme"],
            "forward_written": s1["bytes_written_nvme"] - s0["bytes_written_nvme"],
            "backward_written": s2["bytes_written_nvme"] - s1["bytes_written_nvme"],
            "optimizer_written": s3["bytes_written_nvme"] - s2["bytes_written_nvme"],
            "io_wait_seconds": s3["io_wait_seconds"] - s0["io_wait_seconds"],
        }

    paired: dict = {}
    try:
        seconds, probes = timed_loop(step, spec["warmup"], spec["steps"], step_barrier(spec))
        stats = engine.stats()
        if spec.get("trace_dir"):
            trace = os.path.join(spec["trace_dir"], f"{spec['row']}-{spec['dtype']}.json")
            engine.export_trace(trace)
            info = dict(info, trace=trace)
        units = [{"name": u.name, "compute_bytes": u.compute_numel * (4 if spec["dtype"] == "fp32" else 2),
                  "master_bytes": u.master_numel * 4} for u in engine.units]
        phases = median_phases(probes)
        rss = peak_rss_bytes()  # the replay's buffers below are not the row's
        if spec["row"] == "auto":
            info = dict(info, **placement_report(engine, spec))
        if spec["row"] in ("defaults", "old-defaults"):
            placement = engine.placement()
            info = dict(info, tiers=[{t: sum(getattr(u, role) == t for u in placement.units)
                                      for t in ("device", "host", "nvme")}
                                     for role in ("compute_tier", "state_tier")])
        if spec.get("paired_replay"):
            paired = paired_replay(step, engine.zero_grad, {"units": units, "phases": phases}, spec)
    finally:
        engine.close()
    read = phases["forward_read"] + phases["backward_read"] + phases["optimizer_read"]
    written = phases["forward_written"] + phases["backward_written"] + phases["optimizer_written"]
    return dict(info, **paired, peak_rss_bytes=rss, step_seconds_all=seconds, phases=phases, units=units,
                nvme_read_per_step=read, nvme_written_per_step=written,
                io_wait_seconds=phases["io_wait_seconds"],
                device_peak_bytes=stats["device_peak_bytes"], host_peak_bytes=stats["host_peak_bytes"],
                nvme_bytes=stats["nvme_bytes"], optimizer_state_bytes=stats["optimizer_state_bytes"],
                parameter_bytes=stats["parameter_bytes"],
                gradient_bytes=stats["gradient_bytes"], world_size=stats["world_size"])


def paired_replay(engine_step, settle, pattern: dict, spec: dict) -> dict:
    """[Overlap efficiency, paired] spec["steps"] pairs of one more timed engine step and a
    replay of the row's own swap traffic with no compute, right after it: the disk's speed
    drifts by 1.5x and more between minutes here, so each step is compared with an I/O-only
    step taken seconds after it rather than with the io-only row, taken minutes later.

    A pair is: an untimed engine step, the timed one (its forward finishes the updates the
    previous step left to the optimizer worker, as in the timed loop), ``settle()`` (untimed:
    the updates the timed step left, and their swap writes, finish before the replay starts,
    so that they do not slow the replay down), then the timed replay. Still in flight during
    the replay's first moments: the prefetch of the next pass's first units."""
    steps, replays = [], []
    with replayer(pattern, spec) as (replay, _backend, _read, _written):
        replay()  # untimed: the replay's buffers are touched for the first time
        for _ in range(spec["steps"]):
            engine_step()
            start = time.perf_counter()
            engine_step()
            steps.append(time.perf_counter() - start)
            settle()
            start = time.perf_counter()
            replay()
            replays.append(time.perf_counter() - start)
    return {"paired_step_seconds": steps, "paired_io_seconds": replays}


def run_ddp(spec: dict) -> dict:
    """Plain torch DistributedDataParallel on this rank's part of the batch: the baseline of
    the --nproc table."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", spec["local_rank"]) if cuda else torch.device("cpu")
    model = build_gpt(spec["model"], meta=False).to(device)
    ddp = DistributedDataParallel(model, device_ids=[spec["local_rank"]] if cuda else None)
    opt, flavour = make_adamw(ddp.parameters())
    idx, targets = rank_batch(spec, device)
    bf16 = spec["dtype"] == "bf16"
    grad_bytes = []

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = ddp(idx, targets)
        loss.backward()
        if not grad_bytes:
            grad_bytes.append(sum(p.grad.nbytes for p in model.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad(set_to_none=True)
        end_of_step(spec)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"], step_barrier(spec))
    except RuntimeError as error:
        # Every rank takes this path together: fused=True fails the same way on each.
        if flavour != "fused":
            raise
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
        flavour = f"foreach (fused failed: {str(error).splitlines()[0][:80]})"
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"], step_barrier(spec))
    moments = sum(t.nbytes for state in opt.state.values() for k, t in state.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    backend = "nccl" if cuda else "gloo"
    return {"step_seconds_all": seconds, "note": f"DDP {backend}, AdamW {flavour}",
            "optimizer_state_bytes": moments, "gradient_bytes": grad_bytes[0],
            "parameter_bytes": sum(p.nbytes for p in ddp.parameters()),
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "nvme_read_per_step": 0, "nvme_written_per_step": 0}


def _split(total: int, weights, page: int = PAGE_BYTES):
    """``total`` bytes split over ``weights`` in proportion, each part whole pages."""
    weight_sum = sum(weights) or 1
    return [-(-int(total * w / weight_sum) // page) * page for w in weights]


@contextlib.contextmanager
def replayer(pattern: dict, spec: dict, piece_bytes=None, file_bytes=None):
    """Yields (step, backend, bytes read, bytes written per step): step() replays one NVMe
    step's swap traffic (``pattern``: the units and the median bytes per phase of an NVMe row)
    with no compute, on a file of its own in spec["swap_dir"]; the file goes when the context
    ends. The optimizer moves each unit's states in one request per unit, or, with
    ``piece_bytes``, in requests of at most that many bytes (the staged step's pieces: one
    request per fp32 state piece, as tools/bench_scale.py replays them). ``file_bytes``: the
    file's size at most (the row's swap size, which fit on its disk): the per-unit regions
    fold into it, so the same bytes move in the same requests through a smaller file."""
    from offload.io import IOEngine, aligned_empty

    units = pattern["units"]
    phases = pattern["phases"]
    compute_w = [u["compute_bytes"] for u in units]
    master_w = [u["master_bytes"] for u in units]
    forward = _split(phases["forward_read"], compute_w)
    backward = _split(phases["backward_read"], compute_w)
    opt_read = _split(phases["optimizer_read"], master_w)
    # With early updates most optimizer traffic happens during backward: its reads are in
    # backward_read (replayed there, as reads), its write-backs in backward_written.
    written = phases["forward_written"] + phases["backward_written"] + phases["optimizer_written"]
    opt_write = _split(written, master_w)
    # One file region per unit for its compute copy and one for its optimizer states.
    compute_size = [max(a, b) for a, b in zip(forward, backward)]
    opt_size = [max(a, b) for a, b in zip(opt_read, opt_write)]
    offsets, cursor = [], 0
    for c, o in zip(compute_size, opt_size):
        offsets.append((cursor, cursor + c))
        cursor += c + o
    # The optimizer's requests in order: (file offset, bytes read, bytes written).
    requests = []
    for i in range(len(units)):
        size = piece_bytes or max(opt_size[i], 1)
        for o in range(0, opt_size[i], size):
            nread, nwrite = max(0, min(size, opt_read[i] - o)), max(0, min(size, opt_write[i] - o))
            requests.append((offsets[i][1] + o, nread, nwrite))
    size = cursor if file_bytes is None else min(cursor, file_bytes)

    def fold(offset, nbytes):  # into [0, size), page-aligned
        return offset if size == cursor else (offset % max(PAGE_BYTES, size - nbytes)) // PAGE_BYTES * PAGE_BYTES

    offsets = [(fold(a, c), b) for (a, b), c in zip(offsets, compute_size)]
    requests = [(fold(o, max(r, w)), r, w) for o, r, w in requests]
    cursor = size
    depth = spec["pipeline_depth"]
    io_buf = aligned_empty(max(compute_size + [PAGE_BYTES]))
    slots = [aligned_empty(max([max(r[1], r[2]) for r in requests] + [PAGE_BYTES])) for _ in range(depth)]
    workdir = tempfile.mkdtemp(prefix="io-only-", dir=spec["swap_dir"])
    path = os.path.join(workdir, "swap.bin")
    try:
        with IOEngine(backend="auto", probe_dir=workdir) as io:
            fill = aligned_empty(64 << 20).fill_(1)
            for offset in range(0, cursor, fill.numel()):
                io.write_from(fill[:min(fill.numel(), cursor - offset)], path, offset)
            io.wait_all()
            del fill

            def step():
                for i in range(len(units)):  # forward: fetch on use, in unit order
                    if forward[i]:
                        io.read_into(io_buf[:forward[i]], path, offsets[i][0]).wait()
                for i in reversed(range(len(units))):
                    if backward[i]:
                        io.read_into(io_buf[:backward[i]], path, offsets[i][0]).wait()
                # optimizer: reads run depth - 1 requests ahead; a slot's write-back must
                # finish before the slot is read into again.
                reads, writes = {}, {}

                def issue_read(k):
                    if k - depth in writes:
                        writes.pop(k - depth).wait()
                    offset, nread, _ = requests[k]
                    reads[k] = io.read_into(slots[k % depth][:nread], path, offset) if nread else None

                for k in range(min(depth - 1, len(requests))):
                    issue_read(k)
                for k, (offset, _, nwrite) in enumerate(requests):
                    handle = reads.pop(k)
                    if handle is not None:
                        handle.wait()
                    if nwrite:
                        writes[k] = io.write_from(slots[k % depth][:nwrite], path, offset)
                    if k + depth - 1 < len(requests):
                        issue_read(k + depth - 1)
                io.wait_all()

            yield step, io.backend, sum(forward) + sum(backward) + sum(opt_read), sum(opt_write)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_io_only(spec: dict) -> dict:
    """Replays one NVMe step's swap traffic (spec["pattern"]) with no compute."""
    pattern = spec["pattern"]
    with replayer(pattern, spec) as (step, backend, read, written):
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
    return {"step_seconds_all": seconds, "nvme_read_per_step": read, "nvme_written_per_step": written,
            "note": f"replay of {pattern['source']} ({backend})"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed(spec: dict) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(name, value)
    import torch
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    device = "cpu" if spec["row"] == "ds-cpu" else "nvme"
    offload = {"device": device, "pin_memory": False}
    if device == "nvme":
        swap = tempfile.mkdtemp(prefix="ds-", dir=spec["swap_dir"])
        offload["nvme_path"] = swap
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": dict(offload),
            "offload_optimizer": dict(offload),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32, "single_submit": False,
                "overlap_events": True, "thread_count": 1},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device=device):
        model = build_gpt(spec["model"], meta=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    idx, targets = make_batch(spec["model"], spec["batch"])
    bf16 = spec["dtype"] == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()

    try:
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
    finally:
        if device == "nvme":
            shutil.rmtree(swap, ignore_errors=True)
    return {"step_seconds_all": seconds, "note": f"deepspeed {deepspeed.__version__}"}


def init_rank(spec: dict) -> dict:
    """With --nproc: this process's rank from torchrun-style environment variables, its swap
    dir, its device, and the default process group (gloo on CPU, NCCL on CUDA)."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    spec = dict(spec, rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]))
    if spec.get("swap_dir"):
        spec["swap_dir"] = os.path.join(spec["swap_dir"], f"rank{spec['rank']}")
        os.makedirs(spec["swap_dir"], exist_ok=True)
    backend = "gloo"
    if spec["device"] == "cuda":
        torch.cuda.set_device(spec["local_rank"])
        backend = "nccl"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=spec["collective_timeout"]))
    assert dist.get_world_size() == spec["nproc"], (dist.get_world_size(), spec["nproc"])
    return spec


def worker_main(spec: dict) -> int:
    import torch

    # Before offload is imported: its native pool takes torch's thread count.
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    if spec.get("nproc"):
        spec = init_rank(spec)
    row = spec["row"]
    if row == "ddp":
        result = run_ddp(spec)
    elif row == "plain":
        result = run_plain(spec)
    elif row == "io-only":
        result = run_io_only(spec)
    elif row in DS_ROWS:
        result = run_deepspeed(spec)
    else:
        result = run_offload(spec)
    result.setdefault("peak_rss_bytes", peak_rss_bytes())
    result.update(row=row, dtype=spec["dtype"], step_seconds=statistics.median(result["step_seconds_all"]))
    if spec.get("nproc"):
        import torch.distributed as dist

        result["rank"] = spec["rank"]
        dist.destroy_process_group()
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------- parent side
def worker_command(spec: dict):
    """The command line and environment of a worker process running ``spec``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
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


def placement_report(engine, spec: dict) -> dict:
    """The auto row's placement (bytes per tier) and its predicted step ([Note: step
    prediction]) with the compute time the spec gives (tools/bench_sweep.py: the same path's
    step with every state in RAM, measured in the same run)."""
    from offload.memory.budget import UnitSizes
    from offload.memory.placement import load_profile, predict_step

    sizes = [UnitSizes.of(u) for u in engine.units]
    element_bytes = engine.layout.compute_element_bytes
    blocks = max(u.compute_numel for u in sizes[1:]) * element_bytes
    slots = (engine.stats()["device_budget_bytes"] - sizes[0].compute_numel * element_bytes) // blocks
    prediction = predict_step(sizes, engine.layout, load_profile(spec.get("machine_profile"), "machine_profile"),
                              spec.get("compute_seconds"), resident_units=max(1, slots - 1))
    placement = engine.placement()
    return {"home_bytes": placement.bytes_per_tier(), "host_budget": spec["host_budget"],
            "units_on_host": sum(u.compute_tier == "host" for u in placement.units),
            "states_on_host": sum(u.state_tier == "host" for u in placement.units),
            "predicted_seconds": prediction.seconds, "predicted_read": prediction.nvme_read_bytes,
            "predicted_written": prediction.nvme_write_bytes, "predicted_io_seconds": prediction.io_seconds,
            "predicted_exposed_fraction": prediction.exposed_fraction,
            "predicted_io_cpu_fraction": prediction.io_cpu_fraction}


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


# Seconds the other ranks of a row get to exit by themselves once one rank has failed (they
# usually do, with a collective error) before they are killed.
RANK_FAILURE_GRACE_SECONDS = 20.0
PER_RANK_KEYS = ("rank", "peak_rss_bytes", "parameter_bytes", "optimizer_state_bytes", "gradient_bytes",
                 "device_peak_bytes", "nvme_read_per_step", "nvme_written_per_step",
                 "io_wait_seconds", "step_seconds")


def run_ranks(spec: dict, timeout_s: float) -> dict:
    """One configuration on ``spec["nproc"]`` fresh worker processes, one per rank, with the
    environment torchrun would give them. Returns one row: per step the slowest rank's
    time, the per-rank measurements under "per_rank", or the first failing rank's error."""
    nproc = spec["nproc"]
    cmd, env = worker_command(spec)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc))
    start = time.perf_counter()
    procs, outputs = [], []
    try:
        for rank in range(nproc):
            out = tempfile.TemporaryFile(mode="w+")  # files, not pipes: nobody reads until the end
            outputs.append(out)
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                          env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
        failed_at, timed_out, failure_order = None, False, []
        while True:
            running = [p.poll() is None for p in procs]  # a list: every rank polled
            now = time.perf_counter()
            for rank, p in enumerate(procs):
                if p.returncode not in (None, 0) and rank not in failure_order:
                    failure_order.append(rank)
                    failed_at = failed_at or now
            if not any(running):
                break
            timed_out = now - start > timeout_s
            if timed_out or (failed_at and now - failed_at > RANK_FAILURE_GRACE_SECONDS):
                hung = [r for r, p in enumerate(procs) if p.poll() is None]
                for r in hung:
                    procs[r].kill()
                for r in hung:
                    procs[r].wait()
                break
            time.sleep(0.1)
        texts = []
        for out in outputs:
            out.seek(0)
            texts.append(out.read())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out in outputs:
            out.close()
    wall = time.perf_counter() - start
    results = []
    for rank, text in enumerate(texts):
        found = [ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)]
        results.append(json.loads(found[-1][len(RESULT_PREFIX):]) if found else None)
    if timed_out and not failure_order:
        return {"row": spec["row"], "dtype": spec["dtype"],
                "error": f"timed out after {timeout_s:.0f} s (ranks {hung} still running)"}
    if failure_order or any(r is None for r in results):
        # The first rank to fail is the cause; the others mostly report the broken collective.
        rank = (failure_order or [r for r, res in enumerate(results) if res is None])[0]
        error, tail = error_line(texts[rank], procs[rank].returncode)
        return {"row": spec["row"], "dtype": spec["dtype"], "error": f"rank {rank}: {error}",
                "stderr_tail": tail}
    merged = dict(results[0])  # what every rank has alike (note, budget, units, ...)
    merged["step_seconds_all"] = [max(steps) for steps in zip(*(r["step_seconds_all"] for r in results))]
    merged["step_seconds"] = statistics.median(merged["step_seconds_all"])
    merged["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in results)
    merged["per_rank"] = [{k: r.get(k) for k in PER_RANK_KEYS} for r in results]
    for key in PER_RANK_KEYS:
        if key not in ("peak_rss_bytes", "step_seconds"):
            merged.pop(key, None)  # per rank only: rank 0's figure alone would mislead
    merged["wall_seconds"] = wall
    return merged


def deepspeed_importable() -> tuple:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                          capture_output=True, text=True, env=env)
    if proc.returncode == 0:
        return True, proc.stdout.strip().splitlines()[-1]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return False, lines[-1] if lines else "import failed"


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def overlap_efficiency(row: dict, by_key: dict):
    """max(compute-only, I/O-only) / step: paired step by step with the row's own replays
    when it has them (see paired_replay), else against the io-only row."""
    if row["row"] not in NVME_ROWS or "error" in row:
        return None
    compute = by_key.get(("compute-only", row["dtype"]), {}).get("step_seconds")
    if compute is None:
        return None
    if row.get("paired_step_seconds"):
        return statistics.median(max(compute, io) / step for step, io in
                                 zip(row["paired_step_seconds"], row["paired_io_seconds"]))
    io = by_key.get(("io-only", row["dtype"]), {}).get("step_seconds")
    return None if io is None else max(compute, io) / row["step_seconds"]


def print_table(results: list, out=sys.stdout) -> None:
    by_key = {(r["row"], r["dtype"]): r for r in results}
    header = (f"{'config':16s} {'dtype':5s} {'step s':>8s} {'x plain':>7s} {'RSS GiB':>8s} "
              f"{'x RSS':>6s} {'rd GB/st':>8s} {'wr GB/st':>8s} {'io_wait':>7s} {'overlap':>7s}  note")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        plain = by_key.get(("plain", r["dtype"]), {})
        if "error" in r:
            print(f"{r['row']:16s} {r['dtype']:5s} FAILED: {r['error']}", file=out)
            continue
        step, rss = r["step_seconds"], r["peak_rss_bytes"]
        step_ratio = step / plain["step_seconds"] if plain.get("step_seconds") else None
        rss_ratio = rss / plain["peak_rss_bytes"] if plain.get("peak_rss_bytes") else None
        read, written = r.get("nvme_read_per_step"), r.get("nvme_written_per_step")
        print(f"{r['row']:16s} {r['dtype']:5s} {step:8.3f} {fmt(step_ratio, '7.2f')} "
              f"{rss / GiB:8.2f} {fmt(rss_ratio, '6.2f')} "
              f"{fmt(None if read is None else read / GB, '8.3f')} "
              f"{fmt(None if written is None else written / GB, '8.3f')} "
              f"{fmt(r.get('io_wait_seconds'), '7.3f')} "
              f"{fmt(overlap_efficiency(r, by_key), '7.2f')}  {r.get('note', '')}", file=out)
    print_baselines(results, "plain", "plain PyTorch step", "", out)
    if any(r.get("paired_step_seconds") for r in results):
        print("overlap: median over the NVMe row's extra steps of max(compute-only step, replay of "
              "its own swap traffic right after it) / that step (paired; see the module docstring)",
              file=out)


def print_trace_summaries(results: list, out=sys.stdout) -> None:
    """The busiest lane per phase of each exported trace (its last step)."""
    tools_dir = os.path.dirname(os.path.abspath(__file__))
    if tools_dir not in sys.path:
        sys.path.insert(0, tools_dir)
    import trace_summary

    for r in results:
        if r.get("trace") and os.path.exists(r["trace"]):
            print(f"\ntrace of {r['row']} {r['dtype']} ({r['trace']}), last step:", file=out)
            trace_summary.print_summary(trace_summary.summarize(r["trace"], steps=1), out)


def print_baselines(results: list, row: str, what: str, rss_note: str, out) -> None:
    """One line per dtype: the baseline row's step time and peak RSS."""
    by_key = {(r["row"], r["dtype"]): r for r in results}
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        base = by_key.get((row, dtype))
        if base and "error" not in base:
            print(f"baseline {dtype}: {what} {base['step_seconds']:.3f} s, "
                  f"peak RSS {base['peak_rss_bytes'] / GiB:.2f} GiB{rss_note}", file=out)


def per_rank(row: dict, key: str, scale: float, spec: str) -> str:
    """``key`` of every rank, scaled, joined by '/' (rank 0 first); '-' where not measured."""
    values = [r.get(key) for r in row["per_rank"]]
    if all(v is None for v in values):
        return "-"
    return "/".join(fmt(None if v is None else v / scale, spec) for v in values)


def print_nproc_table(results: list, nproc: int, out=sys.stdout) -> None:
    """The --nproc table: one line per row; per-rank columns list rank 0/rank 1/..."""
    by_key = {(r["row"], r["dtype"]): r for r in results}
    header = (f"{'config':8s} {'tier':4s} {'dtype':5s} {'step s':>8s} {'x ddp':>6s} {'RSS GiB':>7s}  "
              f"{'RSS GiB/rank':14s} {'param MiB/rank':14s} {'opt MiB/rank':14s} {'grad MiB/rank':14s} "
              f"{'dev pk MiB/rank':15s} {'rd GB/st/rank':14s} {'wr GB/st/rank':14s} note")
    print(f"{nproc} ranks; per-rank columns: rank 0/rank 1/...; RSS GiB = the largest rank's", file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        tier = "-" if r["row"] == "ddp" else r.get("tier", "?")
        if "error" in r:
            print(f"{r['row']:8s} {tier:4s} {r['dtype']:5s} FAILED: {r['error']}", file=out)
            continue
        ddp = by_key.get(("ddp", r["dtype"]), {})
        ratio = r["step_seconds"] / ddp["step_seconds"] if ddp.get("step_seconds") else None
        print(f"{r['row']:8s} {tier:4s} {r['dtype']:5s} {r['step_seconds']:8.3f} {fmt(ratio, '6.2f')} "
              f"{r['peak_rss_bytes'] / GiB:7.2f}  {per_rank(r, 'peak_rss_bytes', GiB, '.2f'):14s} "
              f"{per_rank(r, 'parameter_bytes', 1 << 20, '.1f'):14s} "
              f"{per_rank(r, 'optimizer_state_bytes', 1 << 20, '.1f'):14s} "
              f"{per_rank(r, 'gradient_bytes', 1 << 20, '.1f'):14s} "
              f"{per_rank(r, 'device_peak_bytes', 1 << 20, '.1f'):15s} "
              f"{per_rank(r, 'nvme_read_per_step', GB, '.3f'):14s} "
              f"{per_rank(r, 'nvme_written_per_step', GB, '.3f'):14s} {r.get('note', '')}", file=out)
    print_baselines(results, "ddp", "DDP step", " (largest rank)", out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny GPT, batch 2, 2 warm-up + 2 timed steps (smoke test; < 1 minute)")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=None,
                   help="rows to run (default: all but nvme-clip and nvme-clip-serial)")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--model", choices=("full", "small", "quick"), default=None,
                   help="the GPT's size (default full; quick with --quick): small is ~21M params")
    p.add_argument("--swap-checksums", choices=("on", "off"), default="on",
                   help="OffloadConfig.swap_checksums of the NVMe rows (default on, the engine's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5; 2 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 4; 2 with --quick)")
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
    p.add_argument("--stages", nargs="+", type=int, choices=STAGES, default=list(STAGES),
                   help="with --nproc: ZeRO stages to run (default 0 1 2 3)")
    p.add_argument("--tier", choices=TIERS, default="nvme",
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
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not 0 < args.budget_fraction <= 1:
        p.error("--budget-fraction must be in (0, 1]")
    if args.nproc is None:
        given = [f"--{name}" for name, default in (("stages", list(STAGES)), ("tier", "nvme"),
                                                    ("device", "cpu")) if getattr(args, name) != default]
        if given:
            p.error(f"{' '.join(given)}: only with --nproc")
    else:
        if args.nproc < 2:
            p.error("--nproc must be >= 2 (one process: leave --nproc out)")
        if args.rows is not None:
            p.error("--rows picks single-process rows; with --nproc the rows are ddp and --stages")
        if args.device == "cuda":
            cuda_problem = cuda_unusable(args.nproc)
            if cuda_problem:
                p.error(f"--device cuda: {cuda_problem}")
    return args


def cuda_unusable(nproc: int):
    """Why --device cuda cannot run nproc ranks here (NCCL wants one GPU per rank), or None."""
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"CUDA is not available on this machine (torch {torch.__version__}, {built}); use --device cpu"
    if torch.cuda.device_count() < nproc:
        return (f"{nproc} ranks need {nproc} GPUs (NCCL runs one rank per GPU), "
                f"this machine has {torch.cuda.device_count()}")
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def main_nproc(args) -> int:
    """--nproc: ddp and the offload stages, each row a fresh set of args.nproc ranks."""
    nproc = args.nproc
    model = QUICK_MODEL if args.quick else FULL_MODEL
    batch = args.batch or (QUICK_BATCH if args.quick else FULL_BATCH)
    global_batch = -(-batch // nproc) * nproc  # every rank gets the same number of samples
    base = {
        "model": model, "batch": global_batch, "nproc": nproc, "device": args.device,
        "tier": args.tier, "collective_timeout": args.collective_timeout,
        "steps": args.steps or (2 if args.quick else 5),
        "warmup": args.warmup if args.warmup is not None else 2,
        "budget_fraction": args.budget_fraction,
        # The ranks share the cores; one thread each in --quick (see main()).
        "threads": args.threads or (1 if args.quick else max(1, (os.cpu_count() or 1) // nproc)),
    }
    own_swap = args.swap_dir is None
    swap_root = tempfile.mkdtemp(prefix="bench_train-") if own_swap else os.path.abspath(args.swap_dir)
    os.makedirs(swap_root, exist_ok=True)
    usage = shutil.disk_usage(swap_root)
    print(f"model {model}, global batch {global_batch} ({global_batch // nproc} per rank), {nproc} ranks "
          f"on {args.device} ({'NCCL' if args.device == 'cuda' else 'gloo'} for ddp), {base['threads']} "
          f"torch threads per rank, {base['warmup']} warm-up + {base['steps']} timed steps; tier "
          f"{args.tier}; swap dir {swap_root} ({usage.free / GiB:.0f} GiB free)", flush=True)
    if batch != global_batch:
        print(f"--batch {batch} rounded up to {global_batch}, a multiple of {nproc} ranks", flush=True)

    rows = [("ddp", None)] + [(f"stage{stage}", stage) for stage in args.stages]
    results = []
    try:
        for dtype in args.dtypes:
            for row, stage in rows:
                spec = dict(base, row=row, dtype=dtype, stage=stage)
                row_swap = None
                if stage is not None and args.tier == "nvme":
                    row_swap = tempfile.mkdtemp(prefix=f"{row}-{dtype}-", dir=swap_root)
                    spec["swap_dir"] = row_swap  # each rank uses rank<r>/ under it
                try:
                    result = run_ranks(spec, args.row_timeout)
                finally:
                    if row_swap:
                        shutil.rmtree(row_swap, ignore_errors=True)
                result["tier"] = None if stage is None else args.tier
                results.append(result)
                status = result.get("error") or f"{result['step_seconds']:.3f} s/step"
                print(f"  {row:8s} {dtype:5s} {status}", file=sys.stderr, flush=True)
    finally:
        if own_swap:
            shutil.rmtree(swap_root, ignore_errors=True)

    print()
    print_nproc_table(results, nproc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": base, "rows": results}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))
    if args.nproc is not None:
        return main_nproc(args)
    if args.sweep_host_budget:
        import bench_sweep  # tools/ is on sys.path: this script's directory

        return bench_sweep.main(args)
    if args.compare_defaults:
        import bench_defaults

        return bench_defaults.main(args)

    rows = list(args.rows or DEFAULT_ROWS)
    deepspeed_note = None
    if any(r in DS_ROWS for r in rows):
        ok, what = (False, "--no-deepspeed") if args.no_deepspeed else deepspeed_importable()
        if not ok:
            deepspeed_note = f"DeepSpeed rows skipped: {what}"
            rows = [r for r in rows if r not in DS_ROWS]
        else:
            deepspeed_note = f"deepspeed {what}"
    model = {"full": FULL_MODEL, "small": SMALL_MODEL, "quick": QUICK_MODEL}[args.model or
                                                                             ("quick" if args.quick else "full")]
    base = {
        "model": model,
        "swap_checksums": args.swap_checksums == "on",
        "batch": args.batch or (QUICK_BATCH if args.quick else FULL_BATCH),
        "steps": args.steps or (2 if args.quick else 5),
        "warmup": args.warmup if args.warmup is not None else 2,
        "budget_fraction": args.budget_fraction,
        # One thread in --quick: tiny ops gain nothing from two, and on a shared machine two
        # spinning threads per row turn the smoke test's timings into noise.
        "threads": args.threads or (1 if args.quick else None),
        "pipeline_depth": 3,  # OffloadConfig.optimizer_pipeline_depth default
        "max_grad_norm": args.max_grad_norm,
    }
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        base["trace_dir"] = os.path.abspath(args.trace_dir)
    own_swap = args.swap_dir is None
    swap_root = tempfile.mkdtemp(prefix="bench_train-") if own_swap else os.path.abspath(args.swap_dir)
    os.makedirs(swap_root, exist_ok=True)
    base["swap_dir"] = swap_root
    usage = shutil.disk_usage(swap_root)
    print(f"model {model}, batch {base['batch']}, {base['warmup']} warm-up + {base['steps']} timed steps; "
          f"swap dir {swap_root} ({usage.free / GiB:.0f} GiB free)", flush=True)
    if deepspeed_note:
        print(deepspeed_note, flush=True)

    results = []
    try:
        for dtype in args.dtypes:
            for row in rows:
                spec = dict(base, row=row, dtype=dtype)
                if row in NVME_ROWS and "io-only" in rows:
                    spec["paired_replay"] = True
                if row == "io-only":
                    replayable = [r for r in results if r["dtype"] == dtype and r["row"] in NVME_ROWS
                                  and "error" not in r]  # nvme-prefetch's when it ran, else the last
                    source = next((r for r in replayable if r["row"] == "nvme-prefetch"),
                                  replayable[-1] if replayable else None)
                    if source is None:  # no NVMe row run: measure the traffic of one step
                        source = run_row(dict(base, row="nvme-prefetch", dtype=dtype, warmup=1, steps=1),
                                         args.row_timeout)
                    if "error" in source:
                        results.append({"row": row, "dtype": dtype,
                                        "error": f"no NVMe traffic to replay: {source['error']}"})
                        continue
                    spec["pattern"] = {"units": source["units"], "phases": source["phases"],
                                       "source": f"{source['row']} {dtype}"}
                result = run_row(spec, args.row_timeout)
                results.append(result)
                status = result.get("error") or f"{result['step_seconds']:.3f} s/step"
                print(f"  {row:16s} {dtype:5s} {status}", file=sys.stderr, flush=True)
    finally:
        if own_swap:
            shutil.rmtree(swap_root, ignore_errors=True)

    print()
    print_table(results)
    print_trace_summaries(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in base.items()}, "deepspeed": deepspeed_note,
                       "rows": results}, f, indent=1)
    return 1 if any("error" in r and r["row"] not in DS_ROWS for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
