"""The single-process rows of tools/bench_train.py (their list and what each measures: its
docstring): plain PyTorch, the baseline, and offload's rows (compute-only, host, the NVMe
rows; the stage rows of --nproc and the rows of --sweep-host-budget and --compare-defaults
run the same run_offload), each in a worker process; and the parent side of a run of them:
which rows run with what, the io-only row's traffic, and the table.

Imports train_harness, train_replay (the io-only row and the NVMe rows' paired replays) and
train_deepspeed (the DeepSpeed rows); see the graph in tools/bench_train.py.
"""
from __future__ import annotations

import os
import re
import shutil
import statistics
import sys
import tempfile
import time

from train_deepspeed import DS_ROWS, deepspeed_importable
from train_harness import (ADAMW_OPTIONS, GB, GiB, MiB, QUICK_STEPS, STEPS, WARMUP_STEPS, batch_size,
                           build_gpt, compute_element_bytes, end_of_step, fmt, foreach_adamw, make_adamw,
                           make_batch, model_config, peak_rss_bytes, pipeline_depth, print_baselines, rank_batch,
                           report, run_row, step_barrier, timed_loop)
from train_replay import median_phases, paired_replay

ROWS = ("plain", "compute-only", "host", "nvme-noprefetch", "nvme-prefetch", "nvme-clip", "nvme-clip-serial",
        "io-only") + DS_ROWS + ("auto",)
NVME_ROWS = ("nvme-noprefetch", "nvme-prefetch", "nvme-clip", "nvme-clip-serial")
CLIP_ROWS = ("nvme-clip", "nvme-clip-serial")
# the clipping rows on request; auto is --sweep-host-budget's (tools/bench_sweep.py)
DEFAULT_ROWS = tuple(r for r in ROWS if r not in CLIP_ROWS + ("auto",))


# ---------------------------------------------------------------------------- worker side
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
        opt = foreach_adamw(model.parameters())
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

    element_bytes = compute_element_bytes(spec["dtype"])
    # --optimizer builds a real model: wrap cannot use Adagrad's state made in its constructor
    # over meta parameters (meta tensors, without values)
    model = build_gpt(spec["model"], meta=not spec.get("optimizer"))
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
        note = (f"budget=min+2 blocks {budget / MiB:.0f} MiB = {budget / compute_bytes:.0%} "
                f"(> {spec['budget_fraction']:.0%})")
        config = offload.OffloadConfig(**offload_config(spec, budget))
    if spec.get("optimizer"):  # --optimizer (tools/train_optimizers.py): what `offload plan --optimizer` plans
        from offload.plan_optimizers import build_optimizers

        opt = build_optimizers(spec["optimizer"], model)
    else:
        opt = torch.optim.AdamW(model.parameters(), **ADAMW_OPTIONS)
    engine = offload.wrap(model, opt, config=config)
    if config.device_budget is None:
        note = "no budget"
    return engine, {"device_budget_bytes": config.device_budget,
                    "budget_wanted_bytes": wanted if config.device_budget else None,
                    "compute_copy_bytes": compute_bytes, "note": note}


def run_offload(spec: dict) -> dict:
    from offload._sizes import FP32_BYTES

    engine, info = wrap_with_budget(spec)
    idx, targets = rank_batch(spec, engine.device)
    keys = ("bytes_read_nvme", "bytes_written_nvme", "io_wait_seconds", "bytes_host_to_device",
            "bytes_device_to_host", "bytes_all_gather")

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
            **{k: s3[k] - s0[k] for k in ("bytes_host_to_device", "bytes_device_to_host", "bytes_all_gather")},
        }

    paired: dict = {}
    try:
        seconds, probes = timed_loop(step, spec["warmup"], spec["steps"], step_barrier(spec))
        stats = engine.stats()
        if spec.get("trace_dir"):
            trace = os.path.join(spec["trace_dir"], f"{spec['row']}-{spec['dtype']}.json")
            engine.export_trace(trace)
            info = dict(info, trace=trace)
        element_bytes = compute_element_bytes(spec["dtype"])
        units = [{"name": u.name, "compute_bytes": u.compute_numel * element_bytes,
                  "master_bytes": u.master_numel * FP32_BYTES} for u in engine.units]
        phases = median_phases(probes)
        trainable_params = sum(e.numel for u in engine.units for e in u.trainable)
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
    # every timed step's traffic over their number: an update deferred into the next step counts once
    mean_read, mean_written = (sum(p[f"{phase}_{k}"] for p in probes for phase in ("forward", "backward", "optimizer"))
                               / len(probes) for k in ("read", "written"))
    written = phases["forward_written"] + phases["backward_written"] + phases["optimizer_written"]
    return dict(info, **paired, peak_rss_bytes=rss, step_seconds_all=seconds, phases=phases, units=units,
                nvme_read_per_step=read, nvme_written_per_step=written,
                nvme_read_mean_per_step=mean_read, nvme_written_mean_per_step=mean_written,
                trainable_params=trainable_params,
                optimizer_side_bytes=stats.get("optimizer_side_bytes", 0),
                io_wait_seconds=phases["io_wait_seconds"],
                host_to_device_per_step=phases["bytes_host_to_device"],
                device_to_host_per_step=phases["bytes_device_to_host"],
                all_gather_per_step=phases["bytes_all_gather"],
                device_peak_bytes=stats["device_peak_bytes"], host_peak_bytes=stats["host_peak_bytes"],
                nvme_bytes=stats["nvme_bytes"], optimizer_state_bytes=stats["optimizer_state_bytes"],
                parameter_bytes=stats["parameter_bytes"],
                gradient_bytes=stats["gradient_bytes"], world_size=stats["world_size"])


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


# ---------------------------------------------------------------------------- parent side
def overlap_efficiency(row: dict, by_key: dict):
    """max(compute-only, I/O-only) / step: paired step by step with the row's own replays
    when it has them (see train_replay.paired_replay), else against the io-only row."""
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
              "its own swap traffic right after it) / that step (paired; see tools/bench_train.py)",
              file=out)


def print_trace_summaries(results: list, out=sys.stdout) -> None:
    """The busiest lane per phase of each exported trace (its last step)."""
    import trace_summary  # tools/, beside this file

    for r in results:
        if r.get("trace") and os.path.exists(r["trace"]):
            print(f"\ntrace of {r['row']} {r['dtype']} ({r['trace']}), last step:", file=out)
            trace_summary.print_summary(trace_summary.summarize(r["trace"], steps=1), out)


def io_only_pattern(results: list, base: dict, dtype: str, timeout_s: float) -> dict:
    """The swap traffic the io-only row replays: that of nvme-prefetch when it ran, else of
    the last NVMe row that did, else of one step of nvme-prefetch measured now; a row with
    the error instead when there is none to replay."""
    replayable = [r for r in results if r["dtype"] == dtype and r["row"] in NVME_ROWS and "error" not in r]
    source = next((r for r in replayable if r["row"] == "nvme-prefetch"),
                  replayable[-1] if replayable else None)
    if source is None:  # no NVMe row run: measure the traffic of one step
        source = run_row(dict(base, row="nvme-prefetch", dtype=dtype, warmup=1, steps=1), timeout_s)
    if "error" in source:
        return {"error": f"no NVMe traffic to replay: {source['error']}"}
    return {"units": source["units"], "phases": source["phases"], "source": f"{source['row']} {dtype}"}


def main(args) -> int:
    """The single-process rows (--rows), each in a fresh worker, then the table."""
    rows = list(args.rows or DEFAULT_ROWS)
    deepspeed_note = None
    if any(r in DS_ROWS for r in rows):
        ok, what = (False, "--no-deepspeed") if args.no_deepspeed else deepspeed_importable()
        if not ok:
            deepspeed_note = f"DeepSpeed rows skipped: {what}"
            rows = [r for r in rows if r not in DS_ROWS]
        else:
            deepspeed_note = f"deepspeed {what}"
    model = model_config(args)
    base = {
        "model": model,
        "swap_checksums": args.swap_checksums == "on",
        "batch": batch_size(args),
        "steps": args.steps or (QUICK_STEPS if args.quick else STEPS),
        "warmup": args.warmup if args.warmup is not None else WARMUP_STEPS,
        "budget_fraction": args.budget_fraction,
        # One thread in --quick: tiny ops gain nothing from two, and on a shared machine two
        # spinning threads per row turn the smoke test's timings into noise.
        "threads": args.threads or (1 if args.quick else None),
        "pipeline_depth": pipeline_depth(),
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
                    pattern = io_only_pattern(results, base, dtype, args.row_timeout)
                    if "error" in pattern:
                        results.append({"row": row, "dtype": dtype, "error": pattern["error"]})
                        continue
                    spec["pattern"] = pattern
                result = run_row(spec, args.row_timeout)
                results.append(result)
                status = result.get("error") or f"{result['step_seconds']:.3f} s/step"
                print(f"  {row:16s} {dtype:5s} {status}", file=sys.stderr, flush=True)
    finally:
        if own_swap:
            shutil.rmtree(swap_root, ignore_errors=True)

    def print_tables(rows: list) -> None:
        print_table(rows)
        print_trace_summaries(rows)

    # a DeepSpeed row that fails is reported, not a failure of the run
    return report(results, print_tables, args.json, base, json_extra={"deepspeed": deepspeed_note},
                  failed=lambda r: "error" in r and r["row"] not in DS_ROWS)
