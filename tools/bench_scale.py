"""Training at scale: a Llama-3.2-3B-shaped transformers model, both tiers on NVMe, against a
compute-only estimate and an I/O-only replay of its own swap traffic (issue #17).

The model: transformers' LlamaForCausalLM with hidden 3072, 24 heads, 8 KV heads,
intermediate 8192, vocab 128256, tied embeddings, --layers decoder layers (28: 3.21 B
parameters, 47.9 GiB of fp32 training state). It is built on the meta device and
initialized by wrap with init_fn=model._init_weights (random; nothing is downloaded).

Rows, each in a fresh subprocess of its own (peak RSS is ru_maxrss of that process):
  offload       offload.wrap(param_tier="nvme", optimizer_tier="nvme", --dtype,
                --device-budget, --host-budget, --max-grad-norm), a batch of 1 x --seq
                tokens; --warmup untimed steps, then --steps timed ones (forward, backward,
                step). Wrap time, the mean step, and per timed step from engine.stats():
                NVMe bytes read and written, prefetch hits / misses, fetch and optimizer
                waits, the optimizer step's own seconds. With --checkpoint it then saves
                and loads a checkpoint in the swap dir (seconds and peak RSS of each, the
                peak from a VmHWM reset before each; 12 B a parameter more on disk).
  compute-only  forward + backward of the same model in RAM (weights in --dtype, no
                offload), plus the Adam kernel (offload's adam_step_flat, bf16 copy-out) over
                every parameter. With --layers <= --compute-layers the whole model is run;
                otherwise one model of --compute-layers layers is run through its first
                layer and through all of them, in turns (time_forward_backward), and the
                time is extrapolated linearly in the number of layers (the embedding and the
                tied head are the intercept). The Adam kernel is timed on --adam-numel elements
                and scaled to the parameter count. The note says which.
  io-only       no compute: the offload row's swap traffic of one step (the median bytes per
                phase, spread over units as the engine's are) replayed through
                offload.io.IOEngine against a file in the swap dir, at the engine's request
                sizes: fetches a whole unit each, waited for one by one, forward then
                backward; the optimizer's reads and writes in pieces of
                OPTIMIZER_PIECE_NUMEL fp32 elements per state, optimizer_pipeline_depth
                deep (piece_replayer).

"x bound" = step / max(compute-only, io-only): 1.0 means the step takes as long as its
slower resource alone (issue #17's target: <= 1.3). With --rounds N the offload and io-only
rows run N times, alternating, each io-only replaying its own round's traffic right after it,
and each round's ratio takes that round's replay (this machine's disk moves 1.5x between
minutes; the replay alone moved 1.6x between two runs 25 minutes apart).

The swap dir (--swap-dir, default a fresh directory under $TMPDIR or /tmp) must hold the
run's swap bytes (offload plan's number; ~50 GB at 28 layers): the tool refuses before
starting when it does not, naming the free bytes. What it creates there is removed at the
end, also when a row fails, is killed, or the tool gets SIGTERM or Ctrl-C.

On a CPU without native bf16 matrix multiplies (no AVX512-BF16/AMX: the 2-core AVX2 VM
this was written on) torch runs bf16 matmuls, and above all their backward, in a scalar
fallback (cpublas_gemm_impl) about 5x slower than fp32 forward and far slower backward: the
4-layer bf16 run's warm-up step alone took ~30 minutes there. Use --dtype fp32 (with about
twice the --device-budget for the same room) for numbers on such a machine.

    python3 tools/bench_scale.py --layers 4          # ~0.8 B params
    python3 tools/bench_scale.py --dtype fp32 --host-budget 3.5GiB --device-budget 3.4GiB
                                                     # 28 layers: ~7 GiB RSS, 48-67 GB swap
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent
sys.path.insert(0, str(REPO_ROOT))

GiB = 1 << 30
GB = 1e9
RESULT_PREFIX = "BENCH_SCALE_RESULT "
ROWS = ("offload", "compute-only", "io-only")
# Llama-3.2-3B's shape; the layer count is --layers.
LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192)
ADAM_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Room beyond the planned swap bytes: the io-only replay's file is written after the offload
# row's files are gone, so the larger of the two counts, plus a margin for everything else.
DISK_MARGIN_BYTES = 2 * GiB


# ---------------------------------------------------------------------------- worker side
def progress(line: str) -> None:
    """A line on stderr while a row runs (the child's stderr is the tool's)."""
    print(f"    {line}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def timed_checkpoint(engine, ckpt_dir: str) -> dict:
    """Seconds and peak RSS (VmHWM, reset before each) of save_checkpoint then load_checkpoint
    of ``ckpt_dir``, and the checkpoint's bytes; the directory is removed after."""
    out = {}
    try:
        for verb in ("save", "load"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM from here (ru_maxrss keeps the training's peak)
            start = time.perf_counter()
            getattr(engine, f"{verb}_checkpoint")(ckpt_dir)
            seconds = time.perf_counter() - start
            with open("/proc/self/status") as f:
                peak = int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
            out[verb] = dict(seconds=seconds, peak_rss_bytes=peak)
            progress(f"{verb}_checkpoint {seconds:.1f} s, peak RSS {peak / GiB:.2f} GiB")
            if verb == "save":
                out["bytes"] = sum(os.path.getsize(os.path.join(ckpt_dir, name)) for name in os.listdir(ckpt_dir))
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return out


def llama(layers: int, meta: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, **LLAMA_3B)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


def llama_3b():
    """The 28-layer model, for `offload plan --model tools.bench_scale:llama_3b` (run from the
    repository root; plan builds it on the meta device)."""
    return llama(28, meta=True)


def batch(spec: dict):
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, LLAMA_3B["vocab_size"], (1, spec["seq"]), generator=gen)


def offload_config(spec: dict) -> dict:
    """The offload row's OffloadConfig fields."""
    config = dict(param_tier="nvme", optimizer_tier="nvme", dtype=spec["dtype"], swap_dir=spec["swap_dir"],
                  device_budget=spec["device_budget"], host_budget=spec["host_budget"],
                  max_grad_norm=spec["max_grad_norm"], speculative_updates=spec.get("speculative_updates"))
    if spec.get("prefetch_units") is not None:
        config["prefetch_units"] = spec["prefetch_units"]
    return config


def run_offload(spec: dict) -> dict:
    import torch
    import offload

    model = llama(spec["layers"], meta=True)
    config = offload_config(spec)
    start = time.perf_counter()
    engine = offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config,
                          init_fn=model._init_weights)
    wrap_seconds = time.perf_counter() - start
    wrap_rss = peak_rss_bytes()
    progress(f"wrap {wrap_seconds:.1f} s")
    ids = batch(spec)
    keys = ("bytes_read_nvme", "bytes_written_nvme", "prefetch_hits", "prefetch_misses", "prefetch_late",
            "prefetch_unplanned",
            "fetch_wait_seconds", "optimizer_wait_seconds", "total_optimizer_seconds", "io_wait_seconds",
            "speculative_updates", "redone_updates", "taken_back_updates", "deferred_updates",
            "spilled_gradient_bytes")
    try:
        seconds, probes = [], []
        for i in range(spec["warmup"] + spec["steps"]):
            s0, t0 = engine.stats(), time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            s1, t1 = engine.stats(), time.perf_counter()
            engine.backward(loss)
            s2, t2 = engine.stats(), time.perf_counter()
            engine.step()
            s3, t3 = engine.stats(), time.perf_counter()
            progress(f"step {i} ({'warm-up' if i < spec['warmup'] else 'timed'}) {t3 - t0:.1f} s: "
                     f"forward {t1 - t0:.1f}, backward {t2 - t1:.1f}, step() {t3 - t2:.1f}")
            if i < spec["warmup"]:
                continue
            seconds.append(t3 - t0)
            probe = {k: s3[k] - s0[k] for k in keys}
            for phase, (a, b) in (("forward", (s0, s1)), ("backward", (s1, s2)), ("optimizer", (s2, s3))):
                probe[f"{phase}_read"] = b["bytes_read_nvme"] - a["bytes_read_nvme"]
                probe[f"{phase}_written"] = b["bytes_written_nvme"] - a["bytes_written_nvme"]
            probe.update(forward_seconds=t1 - t0, backward_seconds=t2 - t1, step_call_seconds=t3 - t2,
                         optimizer_seconds=s3["optimizer_seconds"], loss=loss.item(), grad_norm=s3["grad_norm"])
            probes.append(probe)
        stats = engine.stats()
        if spec.get("trace"):
            engine.export_trace(spec["trace"])
        element_bytes = 4 if spec["dtype"] == "fp32" else 2
        units = [{"name": u.name, "compute_bytes": u.compute_numel * element_bytes,
                  "master_bytes": u.master_numel * 4} for u in engine.units]
        rss = peak_rss_bytes()
        checkpoint = None
        if spec.get("checkpoint"):
            engine.zero_grad()  # the last step's deferred updates are done
            checkpoint = timed_checkpoint(engine, os.path.join(spec["swap_dir"], "checkpoint"))
    finally:
        engine.close()
    from train_replay import median_phases  # tools/, beside this file

    phases = median_phases(probes)  # bytes per phase from one step
    return dict(row="offload", wrap_seconds=wrap_seconds, wrap_peak_rss_bytes=wrap_rss, peak_rss_bytes=rss,
                step_seconds_all=seconds, probes=probes, phases=phases, units=units, checkpoint=checkpoint,
                num_params=sum(p.numel() for p in model.parameters()),
                device_budget_bytes=stats["device_budget_bytes"], device_peak_bytes=stats["device_peak_bytes"],
                nvme_bytes=stats["nvme_bytes"], num_units=stats["num_units"])


def time_forward_backward(sizes, spec: dict) -> dict:
    """{layers: seconds} of a forward + backward of the model in RAM run through its first
    ``layers`` decoder layers, for each of ``sizes``: one model of max(sizes) layers, cut
    short through config.num_hidden_layers (LlamaModel runs self.layers[:that]). The sizes
    take turns, one warm-up round and then --compute-steps rounds, and each keeps its
    fastest pass: on a shared machine other jobs only ever add time, and turns spread what
    they add over every size instead of skewing the one measured while it lasts."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    model = llama(max(sizes), meta=False).to(dtype)
    ids = batch(spec)
    best = {n: float("inf") for n in sizes}
    for round_index in range(1 + spec.get("compute_steps", 2)):
        for n in sizes:
            model.config.num_hidden_layers = n
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            seconds = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            progress(f"compute-only, {n} of {max(sizes)} layers: forward + backward {seconds:.1f} s")
            if round_index > 0:
                best[n] = min(best[n], seconds)
    del model
    return best


def time_adam_per_param(spec: dict) -> float:
    """Seconds per parameter of offload's Adam kernel (fp32 state, the compute dtype's copy-out)."""
    import torch
    from offload.optim import adam_step_flat

    numel = spec["adam_numel"]
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 1e-2
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    copy = None if spec["dtype"] == "fp32" else torch.empty(numel, dtype=torch.bfloat16).fill_(0)
    seconds = []
    for step in range(1, 4):
        start = time.perf_counter()
        adam_step_flat(param, grad, exp_avg, exp_avg_sq, step=step, copy_out=copy, **ADAM_HYPER)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]) / numel


def run_compute_only(spec: dict) -> dict:
    layers, few = spec["layers"], spec["compute_layers"]
    num_params = sum(p.numel() for p in llama(layers, meta=True).parameters())
    if layers <= few:
        forward_backward = time_forward_backward([layers], spec)[layers]
        how = f"whole model in RAM ({layers} layers)"
    else:
        times = time_forward_backward([1, few], spec)
        one, many = times[1], times[few]
        per_layer = (many - one) / (few - 1)
        forward_backward = one + (layers - 1) * per_layer
        how = (f"fwd+bwd {one:.2f} s through 1 layer, {many:.2f} s through {few} (fastest of "
               f"{spec.get('compute_steps', 2)} turns each): {per_layer:.2f} s/layer, extrapolated to {layers}")
        if per_layer <= 0:
            how += " (UNRELIABLE: the machine was busier during the shorter runs)"
    adam = time_adam_per_param(spec) * num_params
    return dict(row="compute-only", step_seconds_all=[forward_backward + adam], peak_rss_bytes=peak_rss_bytes(),
                forward_backward_seconds=forward_backward, adam_seconds=adam,
                note=f"{how}; + Adam kernel {adam:.2f} s ({spec['adam_numel'] / 1e6:.0f}M elements timed, "
                     f"scaled to {num_params / 1e9:.2f} B)")


def piece_replayer(spec: dict):
    """(step, backend, bytes read, bytes written per step) in a context: tools/train_replay.py's
    replay of the offload row's median step (spec["pattern"]: its units and bytes per phase),
    with no compute, through offload.io.IOEngine on a file of its own in spec["swap_dir"]
    (removed when the context ends), at the engine's request sizes:

      forward, then backward in reverse unit order: each unit's share of that phase's reads
        in one request, waited for before the next (a fetch on use);
      the optimizer: each unit's share of step()'s reads and of every write, in pieces of
        offload.units.OPTIMIZER_PIECE_NUMEL fp32 elements per state, as the staged step
        moves them, reads running pipeline_depth - 1 pieces ahead and a slot's write-back
        finishing before the slot is read into again.

    The byte counts are the engine's; how they split between units follows the units'
    sizes (compute copies for fetches, masters for the optimizer)."""
    from offload._sizes import FP32_BYTES
    from offload.units import OPTIMIZER_PIECE_NUMEL
    from train_replay import replayer  # tools/, beside this file

    return replayer(spec["pattern"], spec, piece_bytes=OPTIMIZER_PIECE_NUMEL * FP32_BYTES,
                    file_bytes=spec["pattern"].get("nvme_bytes"))


def run_io_only(spec: dict) -> dict:
    seconds = []
    with piece_replayer(spec) as (step, backend, read, written):
        for i in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            step()
            if i >= spec["warmup"]:
                seconds.append(time.perf_counter() - start)
    from offload.units import OPTIMIZER_PIECE_NUMEL
    return dict(row="io-only", step_seconds_all=seconds, peak_rss_bytes=peak_rss_bytes(),
                read_per_step=read, written_per_step=written,
                note=f"replay of the offload row's median step through IOEngine ({backend}): fetches "
                     f"whole units, the optimizer in {OPTIMIZER_PIECE_NUMEL * 4 >> 20} MiB requests, "
                     f"depth {spec['pipeline_depth']}")


def worker_main(spec: dict) -> int:
    if spec.get("threads"):
        import torch
        torch.set_num_threads(spec["threads"])
    run = {"offload": run_offload, "compute-only": run_compute_only, "io-only": run_io_only}[spec["row"]]
    print(RESULT_PREFIX + json.dumps(run(spec)), flush=True)
    return 0


# ---------------------------------------------------------------------------- parent side
def run_row(spec: dict, timeout: float) -> dict:
    """One row in a fresh subprocess; its JSON result, or {"row", "error"}. The child's
    stderr (its progress lines, a traceback) is echoed as it comes. The child is killed
    (with its process group) when the timeout passes or this process is interrupted."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    out: list = []
    err: collections.deque = collections.deque(maxlen=40)

    def echo() -> None:
        for line in child.stderr:
            err.append(line.rstrip())
            sys.stderr.write(line)
            sys.stderr.flush()

    readers = [threading.Thread(target=lambda: out.extend(child.stdout), daemon=True),
               threading.Thread(target=echo, daemon=True)]
    for reader in readers:
        reader.start()
    try:
        child.wait(timeout=timeout)
    except BaseException as error:  # timeout, SIGTERM (see main) or Ctrl-C: the child goes too
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        return {"row": spec["row"], "error": f"timed out after {timeout:.0f} s"}
    finally:
        for reader in readers:
            reader.join(timeout=10)
    for line in out:
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = err[-1] if err else f"exit status {child.returncode}"
    if child.returncode < 0:
        tail = f"killed by signal {-child.returncode} (out of memory?); {tail}"
    return {"row": spec["row"], "error": tail}


def planned_swap_bytes(spec: dict, swap_parent: str) -> int:
    """Swap bytes of the offload row, as wrap's preflight counts them (spare homes of
    speculative updates, as many as ``swap_parent``'s free space holds, and gradient
    extents included)."""
    import torch
    from offload.config import OffloadConfig
    from offload.memory.budget import model_unit_sizes, swap_bytes
    from offload.memory.placement import resolve_placement

    config = OffloadConfig(**dict(offload_config(dict(spec, swap_dir=swap_parent)), device="cpu"))
    sizes = model_unit_sizes(llama(spec["layers"], meta=True), 4 if spec["dtype"] == "fp32" else 2)
    return swap_bytes(sizes, resolve_placement(config, torch.device("cpu"), None, sizes))


def parse_size(text: str):
    from offload.config import parse_size as parse

    return None if text.lower() == "none" else parse(text, "size")


def fmt(value, spec: str) -> str:
    """``value`` formatted, or '-' as wide, when not measured."""
    return format(value, spec) if value is not None else "-".rjust(len(format(0.0, spec)))


def round_bounds(results: list) -> dict:
    """{round: max(compute-only, that round's io-only)} in seconds, for the rounds that have
    either (compute-only runs once, in the first round; each round replays its own offload
    row's traffic)."""
    compute = next((r["step_seconds"] for r in results if r["row"] == "compute-only" and "step_seconds" in r), None)
    bounds = {}
    for k in sorted({r.get("round", 1) for r in results}):
        io = next((r["step_seconds"] for r in results
                   if r["row"] == "io-only" and r.get("round", 1) == k and "step_seconds" in r), None)
        known = [t for t in (compute, io) if t is not None]
        if known:
            bounds[k] = max(known)
    return bounds


def print_table(results: list, args, out=sys.stdout) -> None:
    for r in results:
        if "step_seconds_all" in r:
            r["step_seconds"] = statistics.mean(r["step_seconds_all"])
    bounds = round_bounds(results)
    several = any(r.get("round", 1) > 1 for r in results)
    header = (f"{'row':12s} {'wrap s':>7s} {'step s':>7s} {'x bound':>7s} {'RSS GiB':>7s} {'rd GB/st':>8s} "
              f"{'wr GB/st':>8s} {'hit rate':>13s} {'miss/late/unpl':>14s} {'fetch wt s':>10s} {'opt wt s':>8s} {'opt s':>6s}  note")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        label = f"{r['row']} {r.get('round', 1)}" if several and r["row"] != "compute-only" else r["row"]
        if "error" in r:
            print(f"{label:12s} FAILED: {r['error']}", file=out)
            continue
        bound = bounds.get(r.get("round", 1))
        ratio = r["step_seconds"] / bound if bound else None
        if r["row"] == "offload":
            p = r["phases"]
            read = p["bytes_read_nvme"]
            written = p["bytes_written_nvme"]
            hits, misses, late, unplanned = (sum(q[k] for q in r["probes"]) for k in (
                "prefetch_hits", "prefetch_misses", "prefetch_late", "prefetch_unplanned"))
            uses = hits + misses + unplanned
            rate = f"{hits / max(1, uses):.0%} {hits}/{uses}"
            counts = f"{misses}/{late}/{unplanned}"
            extra = (f"{fmt(p['fetch_wait_seconds'], '10.2f')} {fmt(p['optimizer_wait_seconds'], '8.2f')} "
                     f"{fmt(p['optimizer_seconds'], '6.2f')}")
            norms = ", ".join(format(q["grad_norm"], ".2f") for q in r["probes"] if q.get("grad_norm") is not None)
            note = (f"{r['num_params'] / 1e9:.2f} B params, {r['num_units']} units, device peak "
                    f"{r['device_peak_bytes'] / GiB:.2f}/{r['device_budget_bytes'] / GiB:.2f} GiB, swap "
                    f"{r['nvme_bytes'] / GiB:.1f} GiB, wrap RSS {r['wrap_peak_rss_bytes'] / GiB:.2f} GiB; per step: "
                    f"speculative/redone/taken back/deferred updates {p.get('speculative_updates', 0):.0f}/"
                    f"{p.get('redone_updates', 0):.0f}/{p.get('taken_back_updates', 0):.0f}/"
                    f"{p.get('deferred_updates', 0):.0f}, gradients spilled "
                    f"{p.get('spilled_gradient_bytes', 0) / GB:.1f} GB; "
                    f"grad norms {norms}")
            wrap = f"{r['wrap_seconds']:7.1f}"
        else:
            read, written = r.get("read_per_step"), r.get("written_per_step")
            rate, counts, note, wrap = "-", "-", r.get("note", ""), f"{'-':>7s}"
            extra = f"{'-':>10s} {'-':>8s} {'-':>6s}"
        print(f"{label:12s} {wrap} {r['step_seconds']:7.2f} {fmt(ratio, '7.2f')} "
              f"{r['peak_rss_bytes'] / GiB:7.2f} {fmt(None if read is None else read / GB, '8.2f')} "
              f"{fmt(None if written is None else written / GB, '8.2f')} {rate:>13s} {counts:>14s} {extra}  {note}", file=out)
    offload_rows = [r for r in results if r["row"] == "offload" and "error" not in r]
    offload_row = offload_rows[-1] if offload_rows else {}
    ckpt = offload_row.get("checkpoint")
    if ckpt:
        print(f"checkpoint of {ckpt['bytes'] / GB:.1f} GB: save {ckpt['save']['seconds']:.1f} s "
              f"({ckpt['bytes'] / GB / ckpt['save']['seconds']:.2f} GB/s), peak RSS "
              f"{ckpt['save']['peak_rss_bytes'] / GiB:.2f} GiB; load {ckpt['load']['seconds']:.1f} s "
              f"({ckpt['bytes'] / GB / ckpt['load']['seconds']:.2f} GB/s), peak RSS "
              f"{ckpt['load']['peak_rss_bytes'] / GiB:.2f} GiB (the steps' peak: "
              f"{offload_row['peak_rss_bytes'] / GiB:.2f} GiB)", file=out)
    for r in offload_rows:
        label = f"offload {r.get('round', 1)}" if several else "offload"
        print(f"{label} per timed step (s): " + ", ".join(
            f"{q['forward_seconds']:.1f} fwd + {q['backward_seconds']:.1f} bwd + {q['step_call_seconds']:.1f} step"
            for q in r["probes"]), file=out)
    print("hit rate: of the timed steps' unit uses (hits / all); miss/late/unpl: at home when needed while "
          "replaying / still on its way / no trace replayed ([Note: prefetch counters])", file=out)
    if bounds and not several:
        print(f"x bound = step / max(compute-only, io-only) = step / {bounds[1]:.2f} s (issue #17 target <= 1.3)",
              file=out)
    elif bounds:
        ratios = [r["step_seconds"] / bounds[r["round"]] for r in offload_rows if r["round"] in bounds]
        print("x bound = step / max(compute-only, the same round's io-only), per round: " + ", ".join(
            f"{ratio:.2f}" for ratio in ratios) + (f"; median {statistics.median(ratios):.2f}" if ratios else "")
            + " (issue #17 target <= 1.3)", file=out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="decoder layers (28: Llama-3.2-3B, 3.21 B params)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--seq", type=int, default=128, help="tokens in the batch of one (default 128)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--device-budget", default="3GiB", help="OffloadConfig.device_budget (default 3GiB)")
    p.add_argument("--host-budget", default="none",
                   help="OffloadConfig.host_budget (default none: the engine's, 3/4 of available memory)")
    p.add_argument("--speculative-updates", choices=("auto", "on", "off"), default="auto",
                   help="OffloadConfig.speculative_updates (auto: on, the states being on NVMe, for as "
                        "many units as the swap directory's free space holds their spare homes)")
    p.add_argument("--max-grad-norm", default="1.0", help="OffloadConfig.max_grad_norm, or 'none' (default 1.0)")
    p.add_argument("--prefetch-units", type=int, default=None,
                   help="OffloadConfig.prefetch_units (default: the engine's)")
    p.add_argument("--swap-dir", default=None,
                   help="where swap files go (default: a fresh directory under $TMPDIR or /tmp); "
                        "what the tool creates there is removed at the end")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--compute-layers", type=int, default=4,
                   help="compute-only runs the whole model up to this many layers, else 1 and this many "
                        "and extrapolates (default 4)")
    p.add_argument("--compute-steps", type=int, default=2,
                   help="compute-only: timed rounds after a warm-up one, the fastest kept (default 2)")
    p.add_argument("--adam-numel", type=int, default=50_000_000,
                   help="elements the compute-only row times the Adam kernel on (default 50M)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per row (default: torch's)")
    p.add_argument("--checkpoint", action="store_true",
                   help="the offload row then saves and loads a checkpoint in the swap directory "
                        "(its time and peak RSS; about 12 B a parameter more on disk)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="the offload row writes Engine.export_trace here (see tools/trace_summary.py)")
    p.add_argument("--row-timeout", type=float, default=3600.0, help="seconds per row before it is killed")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the offload and io-only rows this many times, alternating (compute-only "
                        "once): each round's ratio pairs its step with its own replay (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layers < 1 or args.steps < 1 or args.warmup < 0 or args.seq < 2 or args.rounds < 1:
        p.error("--layers, --steps and --rounds must be >= 1, --warmup >= 0, --seq >= 2")
    if args.compute_layers < 2:
        p.error("--compute-layers must be >= 2 (two points to extrapolate from)")
    if "io-only" in args.rows and "offload" not in args.rows:
        p.error("io-only replays the offload row's traffic: --rows needs offload too")
    return args


def schedule(rows, rounds: int) -> list:
    """(round, row) in the order they run: ``rows`` in their order, then the offload and
    io-only rows again for each further round (compute-only, CPU-bound, runs once). The
    disk's speed drifts by 1.5x over minutes on the reference machine: each round's io-only
    replay runs right after that round's offload row, so that each ratio pairs the two."""
    return [(k, row) for k in range(1, rounds + 1) for row in rows if k == 1 or row != "compute-only"]


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that remove the swap dir


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))
    max_grad_norm = None if args.max_grad_norm.lower() == "none" else float(args.max_grad_norm)
    base = dict(layers=args.layers, steps=args.steps, warmup=args.warmup, seq=args.seq, dtype=args.dtype,
                device_budget=parse_size(args.device_budget), host_budget=parse_size(args.host_budget),
                max_grad_norm=max_grad_norm, prefetch_units=args.prefetch_units,
                speculative_updates={"auto": None, "on": True, "off": False}[args.speculative_updates],
                compute_steps=args.compute_steps, compute_layers=args.compute_layers, adam_numel=args.adam_numel,
                threads=args.threads, pipeline_depth=3,  # OffloadConfig.optimizer_pipeline_depth default
                checkpoint=args.checkpoint,
                trace=os.path.abspath(args.trace) if args.trace else None)

    parent = os.path.abspath(args.swap_dir) if args.swap_dir else tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the offload row's wrap says it again, if spares do not all fit
        need = planned_swap_bytes(base, parent) + DISK_MARGIN_BYTES
        if args.checkpoint:  # fp32 master and two moments a parameter, and a few small files
            need += 12 * sum(p.numel() for p in llama(args.layers, meta=True).parameters())
    free = shutil.disk_usage(parent).free
    if "offload" in args.rows and free < need:
        print(f"bench_scale: {parent} has {free:,} bytes free ({free / GB:.1f} GB); the {args.layers}-layer "
              f"run needs {need:,} ({need / GB:.1f} GB: its swap files{', the checkpoint' if args.checkpoint else ''} "
              f"and a margin). Use --swap-dir or "
              f"--layers.", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    swap_root = tempfile.mkdtemp(prefix="bench_scale-", dir=parent)
    base["swap_dir"] = swap_root
    print(f"Llama-3.2-3B shape, {args.layers} layers, {args.dtype}, batch 1 x {args.seq}, device budget "
          f"{args.device_budget}, host budget {args.host_budget}, max_grad_norm {max_grad_norm}; "
          f"{args.warmup} warm-up + {args.steps} timed steps; swap dir {swap_root} ({free / GB:.0f} GB free, "
          f"{need / GB:.1f} GB needed)", flush=True)
    results = []
    try:
        for k, row in schedule(args.rows, args.rounds):
            spec = dict(base, row=row)
            if row == "io-only":  # this round's offload row's traffic
                source = next(r for r in reversed(results) if r["row"] == "offload" and r["round"] == k)
                if "error" in source:
                    results.append({"row": row, "round": k, "error": f"no traffic to replay: {source['error']}"})
                    continue
                spec["pattern"] = {"units": source["units"], "phases": source["phases"],
                                   "nvme_bytes": source["nvme_bytes"]}
            start = time.perf_counter()
            result = dict(run_row(spec, args.row_timeout), round=k)
            results.append(result)
            status = result.get("error") or f"done in {time.perf_counter() - start:.0f} s"
            print(f"  {row:12s} {status}{f' (round {k} of {args.rounds})' if args.rounds > 1 else ''}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    print()
    print_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": base, "rows": results}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
