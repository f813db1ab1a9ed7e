"""The --nproc rows of tools/bench_train.py (issue 8; what they measure: its docstring):
torch DistributedDataParallel, the baseline, torch FSDP2, and offload's ZeRO stages, each row a fresh set
of N worker processes on this node with the environment torchrun would give them; and the
parent side of such a run: the rows, the ranks' results merged, and the per-rank table. A
stage row's worker runs train_rows.run_offload, which reads the stage from its spec.

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from train_harness import (GB, GiB, MiB, QUICK_STEPS, STEPS, WARMUP_STEPS, RESULT_PREFIX, batch_size, build_gpt,
                           end_of_step, error_line, fmt, foreach_adamw, free_port, make_adamw, model_config,
                           print_baselines, rank_batch, report, step_barrier, timed_loop, worker_command)

STAGES = (0, 1, 2, 3)
TIERS = ("host", "nvme")
# Seconds the other ranks of a row get to exit by themselves once one rank has failed (they
# usually do, with a collective error) before they are killed.
RANK_FAILURE_GRACE_SECONDS = 20.0
PER_RANK_KEYS = ("rank", "peak_rss_bytes", "parameter_bytes", "optimizer_state_bytes", "gradient_bytes",
                 "device_peak_bytes", "nvme_read_per_step", "nvme_written_per_step",
                 "io_wait_seconds", "step_seconds", "host_to_device_per_step", "device_to_host_per_step",
                 "all_gather_per_step")


# ---------------------------------------------------------------------------- worker side
def init_rank(spec: dict) -> dict:
    """This process's rank from torchrun-style environment variables, its swap dir, its
    device, and the default process group (gloo on CPU, NCCL on CUDA)."""
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


def end_rank(spec: dict, result: dict) -> None:
    """The rank in the result; the process group goes."""
    import torch.distributed as dist

    result["rank"] = spec["rank"]
    dist.destroy_process_group()


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
        opt = foreach_adamw(ddp.parameters())
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


def run_fsdp2(spec: dict) -> dict:
    """torch FSDP2 (fully_shard per block and on the root): the parameters, gradients and
    AdamW states sharded over the ranks and kept on the host, the optimizer step on the
    host. On CUDA that is ``CPUOffloadPolicy``; on the CPU device (which it refuses:
    "Cannot access accelerator device") the shards are host memory already. The peer row
    of the --nproc table."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", spec["local_rank"]) if cuda else torch.device("cpu")
    model = build_gpt(spec["model"], meta=False)
    bf16 = spec["dtype"] == "bf16"
    options = dict(offload_policy=CPUOffloadPolicy()) if cuda else {}
    if bf16:  # bf16 compute, fp32 sharded parameters and gradient reduction
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    # The states live where the sharded parameters do (host): torch's foreach AdamW there.
    opt = foreach_adamw(model.parameters())
    idx, targets = rank_batch(spec, device)

    def step():
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end_of_step(spec)

    seconds, _ = timed_loop(step, spec["warmup"], spec["steps"], step_barrier(spec))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731 - DTensor shards
    moments = sum(local(t).nbytes for state in opt.state.values() for k, t in state.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    backend = "nccl" if cuda else "gloo"
    policy = "CPUOffloadPolicy" if cuda else "shards in host memory"
    return {"step_seconds_all": seconds, "note": f"FSDP2 {backend}, {policy}, AdamW foreach",
            "optimizer_state_bytes": moments, "gradient_bytes": None,
            "parameter_bytes": sum(local(p).nbytes for p in model.parameters()),
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "nvme_read_per_step": 0, "nvme_written_per_step": 0}


# ---------------------------------------------------------------------------- parent side
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
              f"{'dev pk MiB/rank':15s} {'rd GB/st/rank':14s} {'wr GB/st/rank':14s} {'d2h MiB/st/rank':15s} "
              f"{'h2d MiB/st/rank':15s} {'gath MiB/st/rank':16s} note")
    print(f"{nproc} ranks; per-rank columns: rank 0/rank 1/...; RSS GiB = the largest rank's", file=out)
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        tier = {"ddp": "-", "fsdp2": "host"}.get(r["row"]) or r.get("tier", "?")
        if "error" in r:
            print(f"{r['row']:8s} {tier:4s} {r['dtype']:5s} FAILED: {r['error']}", file=out)
            continue
        ddp = by_key.get(("ddp", r["dtype"]), {})
        ratio = r["step_seconds"] / ddp["step_seconds"] if ddp.get("step_seconds") else None
        print(f"{r['row']:8s} {tier:4s} {r['dtype']:5s} {r['step_seconds']:8.3f} {fmt(ratio, '6.2f')} "
              f"{r['peak_rss_bytes'] / GiB:7.2f}  {per_rank(r, 'peak_rss_bytes', GiB, '.2f'):14s} "
              f"{per_rank(r, 'parameter_bytes', MiB, '.1f'):14s} "
              f"{per_rank(r, 'optimizer_state_bytes', MiB, '.1f'):14s} "
              f"{per_rank(r, 'gradient_bytes', MiB, '.1f'):14s} "
              f"{per_rank(r, 'device_peak_bytes', MiB, '.1f'):15s} "
              f"{per_rank(r, 'nvme_read_per_step', GB, '.3f'):14s} "
              f"{per_rank(r, 'nvme_written_per_step', GB, '.3f'):14s} "
              f"{per_rank(r, 'device_to_host_per_step', MiB, '.1f'):15s} "
              f"{per_rank(r, 'host_to_device_per_step', MiB, '.1f'):15s} "
              f"{per_rank(r, 'all_gather_per_step', MiB, '.1f'):16s} {r.get('note', '')}", file=out)
    print_baselines(results, "ddp", "DDP step", " (largest rank)", out)


def main(args) -> int:
    """--nproc: ddp and the offload stages, each row a fresh set of args.nproc ranks."""
    nproc = args.nproc
    model = model_config(args)
    batch = batch_size(args)
    global_batch = -(-batch // nproc) * nproc  # every rank gets the same number of samples
    base = {
        "model": model, "batch": global_batch, "nproc": nproc, "device": args.device,
        "tier": args.tier, "collective_timeout": args.collective_timeout,
        "steps": args.steps or (QUICK_STEPS if args.quick else STEPS),
        "warmup": args.warmup if args.warmup is not None else WARMUP_STEPS,
        "budget_fraction": args.budget_fraction,
        # The ranks share the cores; one thread each in --quick (see train_rows.main).
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

    rows = [("ddp", None)] + [("fsdp2", None)] * (not args.no_fsdp2) + \
        [(f"stage{stage}", stage) for stage in args.stages]
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

    return report(results, lambda rows: print_nproc_table(rows, nproc), args.json, base)
