"""Benchmark of the CPU Adam step: offload's native kernel per ISA against its peers.

For each size it times, on the same random fp32 data (allocated once, touched first):
  * offload adam_step_flat, every ISA this CPU runs, fp32 only and with a bf16 copy-out;
  * torch.optim.AdamW(fused=True) and AdamW(foreach=True) on one flat parameter;
  * deepspeed.ops.adam.DeepSpeedCPUAdam when importable (DS_ACCELERATOR=cpu);
  * memory-bandwidth limits on the same threads, each counted at the traffic it really moves:
    - a STREAM triad, a = b + s * c, twice: torch.add(b, c, alpha=s, out=a), whose stores
      read a's lines first (write-allocate: 16 B/element), and a native one with streaming
      stores (12 B/element); "the triad" is the faster of the two in GB/s;
    - the traffic of an fp32 Adam step without its arithmetic (native: param, exp_avg,
      exp_avg_sq += grad in place, 28 B/element, with the Adam kernels' prefetch): the limit
      for the step's own access pattern. It can beat the triad: when one core's outstanding
      misses are the limit, the write-backs of lines read before cost no fill buffer, while
      the triad's write-allocate reads and streaming stores do.
Each figure is the median of --steps timed runs after one warm-up; the rows run interleaved
(every row once per round), so load from other processes on a shared machine spreads over
all rows instead of skewing the few that run while it lasts. GB/s counts the useful
traffic of an Adam step for every implementation: 28 B/param (read param, grad, exp_avg,
exp_avg_sq; write param, exp_avg, exp_avg_sq; none of these lines is written without
being read, so there is no hidden write-allocate traffic), 30 B/param with a 16-bit copy-out
(streamed past the cache for large steps; without that, +2 B/param of reads go uncounted).
Each table's title names the CPU model (/proc/cpuinfo): the ratios between rows differ
between CPU models, AMD's and Intel's above all.
"vs peer" is the best peer's time over this row's time (> 1: faster than every peer);
"of triad" and "of traffic" are this row's GB/s over those limits'. Below the table, the
time the bf16 copy-out adds to each ISA's fp32 step.

    python tools/bench_adam.py --quick          # 10M params only
    python tools/bench_adam.py --sizes 100M 400M
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Run from a source checkout (in-place build) without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import offload  # noqa: E402
from offload import _native  # noqa: E402
from offload.optim import adam_step_flat  # noqa: E402

BYTES_PER_PARAM = 28
BYTES_PER_PARAM_COPY_OUT = 30
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    if text[-1].upper() in scale:
        return int(float(text[:-1]) * scale[text[-1].upper()])
    return int(text)


def cpu_model() -> str:
    """The CPU's "model name" from /proc/cpuinfo (ratios between rows differ between CPU
    models, AMD and Intel above all), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def interleaved_medians(rows: list[tuple[str, Callable[[], object], int]],
                        rounds: int) -> list[tuple[str, float, int]]:
    """Times every row once per round, round after round, and returns each row's median.
    Interleaving spreads load from other processes over all rows rather than onto the few
    that happen to run while it lasts, so the ratios between rows stay meaningful."""
    for _, fn, _ in rows:
        fn()  # warm-up: first touch, caches, thread wake-up
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for row_times, (_, fn, _) in zip(times, rows):
            start = time.perf_counter()
            fn()
            row_times.append(time.perf_counter() - start)
    return [(name, statistics.median(t), b) for (name, _, b), t in zip(rows, times)]


def random_like(numel: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=gen).mul_(scale)


TORCH_TRIAD = "stream triad, torch (16 B)"
TRIAD = "stream triad, NT stores (12 B)"
TRAFFIC = "adam traffic, no math (28 B)"


def bench_size(numel: int, rounds: int) -> list[tuple[str, float, int]]:
    """Returns (name, median seconds, bytes per param) rows. Every Adam row steps the same
    param and state tensors (the peers' optimizers are handed them as their state), so one
    set is in memory and every row sees the same kind of data."""
    gen = torch.Generator().manual_seed(0)
    param = random_like(numel, gen)
    grad = random_like(numel, gen, 1e-2)
    exp_avg = random_like(numel, gen, 1e-3)
    exp_avg_sq = random_like(numel, gen, 1e-3).abs_()
    copy_out = torch.empty(numel, dtype=torch.bfloat16).fill_(0)
    triad_out = torch.empty(numel).fill_(0)
    zeros = torch.zeros(numel)  # the traffic row adds these, leaving the Adam data as it was
    rows: list[tuple[str, Callable[[], object], int]] = [
        (TORCH_TRIAD, lambda: torch.add(grad, exp_avg, alpha=0.5, out=triad_out), 16),
        (TRIAD, lambda: _native.stream_triad(triad_out.data_ptr(), grad.data_ptr(),
                                             exp_avg.data_ptr(), numel, 0.5), 12),
        (TRAFFIC, lambda: _native.adam_traffic(param.data_ptr(), zeros.data_ptr(),
                                               exp_avg.data_ptr(), exp_avg_sq.data_ptr(), numel),
         BYTES_PER_PARAM),
    ]

    counter = iter(range(1, 10**9))

    def offload_step(isa: str, copy: torch.Tensor | None) -> Callable[[], None]:
        def step() -> None:
            _native.adam_set_isa(isa)
            adam_step_flat(param, grad, exp_avg, exp_avg_sq, step=next(counter),
                           copy_out=copy, **HYPER)
        return step

    for isa in _native.adam_available_isas():
        rows.append((f"offload {isa} fp32", offload_step(isa, None), BYTES_PER_PARAM))
        rows.append((f"offload {isa} +bf16 copy", offload_step(isa, copy_out),
                     BYTES_PER_PARAM_COPY_OUT))

    flat = torch.nn.Parameter(param)
    flat.grad = grad
    torch_hyper = dict(lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                       weight_decay=HYPER["weight_decay"])
    for label, kwargs in (("torch AdamW fused", dict(fused=True)),
                          ("torch AdamW foreach", dict(foreach=True))):
        opt = torch.optim.AdamW([flat], **torch_hyper, **kwargs)
        opt.state[flat] = {"step": torch.tensor(0.0), "exp_avg": exp_avg,
                           "exp_avg_sq": exp_avg_sq}
        rows.append((label, opt.step, BYTES_PER_PARAM))

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its JIT build failed
        print(f"  (DeepSpeedCPUAdam unavailable: {type(exc).__name__}: {exc})")
    else:
        opt = DeepSpeedCPUAdam([flat], **torch_hyper, adamw_mode=True)
        opt.state[flat] = {"step": 0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        rows.append(("deepspeed DeepSpeedCPUAdam", opt.step, BYTES_PER_PARAM))

    previous_isa = _native.adam_selected_isa()
    try:
        return interleaved_medians(rows, rounds)
    finally:
        _native.adam_set_isa(previous_isa)


def print_table(numel: int, rows: list[tuple[str, float, int]]) -> None:
    limits = {name: numel * b / s / 1e9 for name, s, b in rows
              if name in (TORCH_TRIAD, TRIAD, TRAFFIC)}
    triad_gbps = max(limits[TORCH_TRIAD], limits[TRIAD])
    peers = [s for name, s, _ in rows if name.startswith(("torch", "deepspeed"))]
    best_peer = min(peers) if peers else float("nan")
    print(f"\n{numel / 1e6:g}M params on {cpu_model()}, {offload.native_info()['num_threads']} "
          f"native threads, {torch.get_num_threads()} torch threads")
    print(f"{'implementation':30} {'ms':>9} {'Mparam/s':>9} {'GB/s':>7} {'vs peer':>8} "
          f"{'of triad':>8} {'of traffic':>10}")
    for name, seconds, bytes_per in rows:
        gbps = numel * bytes_per / seconds / 1e9
        is_limit = name in limits
        mparams = "" if is_limit else f"{numel / seconds / 1e6:9.0f}"
        vs_peer = "" if is_limit else f"{best_peer / seconds:8.2f}"
        print(f"{name:30} {seconds * 1e3:9.2f} {mparams:>9} {gbps:7.2f} {vs_peer:>8} "
              f"{gbps / triad_gbps:8.0%} {gbps / limits[TRAFFIC]:10.0%}")
    time_of = {name: s for name, s, _ in rows}
    costs = []
    for isa in _native.adam_available_isas():
        extra = time_of[f"offload {isa} +bf16 copy"] / time_of[f"offload {isa} fp32"] - 1
        costs.append(f"{isa} {extra:+.1%}")
    print("bf16 copy-out, time over the fp32 step: " + ", ".join(costs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10M params only (< 30 s)")
    parser.add_argument("--sizes", nargs="+", default=["10M", "100M", "400M"],
                        help="param counts, e.g. 10M 100M 400M")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per figure (>= 5)")
    args = parser.parse_args()
    sizes = ["10M"] if args.quick else args.sizes
    print(f"offload {offload.native_info()}")
    for size in sizes:
        numel = parse_size(size)
        print_table(numel, bench_size(numel, max(args.steps, 5)))


if __name__ == "__main__":
    main()
