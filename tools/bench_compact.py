"""Benchmark of the host optimizer step on compact states against the exact ones.

On the same threads (--threads, native pool and torch), one table per size, rows run
interleaved (every row once per round: load from other processes spreads over all rows),
the median of --rounds timed runs after one warm-up each:
  * exact: offload's CPUAdam kernel (adam_step_flat, the Adam kernel's ISA) on an fp32
    master and moments with a bf16 gradient, writing the bf16 compute copy in the same pass,
    as the engine steps a bf16 run with exact states (the baseline row);
  * torch AdamW(fused=True) on one flat fp32 parameter with an fp32 gradient;
  * compact native: offload.optim.compact.compact_adam_step, the fused kernel of
    native/compact, on compact states of the same length with a bf16 gradient, per ISA
    (the scalar reference kernel over the first --reference-numel elements only);
  * compact torch-ops: compact_adam_step_reference, the same rule in torch ops, over the
    first --reference-numel elements only (it allocates several fp32 copies of its range
    and takes seconds per 100M); Gparam/s is per parameter for every row.
  * the STREAM triads of tools/bench_adam.py (torch's, 16 B/element with write-allocate,
    and the native one with streaming stores, 12 B/element): "the triad" is the faster.
"B/param" is the traffic a row moves per parameter: exact 28 (read master 4, grad 2,
moments 8; write master 4, moments 8, bf16 copy 2), torch fused 28 (fp32 throughout),
compact 12.06 (read and write the bf16 high 2, low 1, the two 8-bit moments 2 and their
scales 8/256; read the bf16 grad 2) plus 2 for the native kernel, which reads the grad once
more first to find a non-finite value before anything is written. "bound ms" is that traffic
at the triad's bandwidth (the row's memory-bandwidth bound), "of bound" the bound over the
row's time (100%: at memory bandwidth), "x base" the baseline's time over the row's.

    python tools/bench_compact.py                 # 100M params, 2 threads, 5 rounds
    python tools/bench_compact.py --sizes 10M --rounds 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import offload  # noqa: E402
from bench_adam import TORCH_TRIAD, TRIAD, cpu_model, interleaved_medians, parse_size  # noqa: E402
from offload import _native  # noqa: E402
from offload.memory.compact_codec import BLOCK_NUMEL  # noqa: E402
from offload.optim import adam_step_flat  # noqa: E402
from offload.optim.compact import CompactRange, compact_adam_step, compact_adam_step_reference  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
EXACT_BYTES = 28.0
COMPACT_BYTES = 2 * (2 + 1 + 1 + 1 + 8 / BLOCK_NUMEL) + 2  # states read and written, grad read
CHECK_BYTES = 2.0  # the native kernel's first read of the gradient
BASELINE = "exact CPUAdam, fp32 master, bf16 copy"


def bench_size(numel: int, reference_numel: int, rounds: int) -> list[tuple[str, float, int, float]]:
    """(name, median seconds, params stepped, bytes per param) per row."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-2)
    grad_bf16 = grad.to(torch.bfloat16)
    exp_avg = torch.randn(numel, generator=gen).mul_(1e-3)
    exp_avg_sq = torch.randn(numel, generator=gen).mul_(1e-3).abs_()
    copy_out = torch.zeros(numel, dtype=torch.bfloat16)
    compact = CompactRange.from_exact(master, exp_avg, exp_avg_sq)
    reference = CompactRange.from_exact(master[:reference_numel], exp_avg[:reference_numel],
                                        exp_avg_sq[:reference_numel])
    scalar = CompactRange.from_exact(master[:reference_numel], exp_avg[:reference_numel], exp_avg_sq[:reference_numel])
    triad_out = torch.zeros(numel)
    steps = iter(range(1, 10**9))
    rows: list[tuple[str, Callable[[], object], int, float]] = [
        (TORCH_TRIAD, lambda: torch.add(grad, exp_avg, alpha=0.5, out=triad_out), numel, 16.0),
        (TRIAD, lambda: _native.stream_triad(triad_out.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), numel, 0.5),
         numel, 12.0),
    ]
    isa = _native.adam_selected_isa()

    def on_isa(chosen: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            _native.adam_set_isa(chosen)
            fn()
        return run

    rows.append((BASELINE, on_isa(isa, lambda: adam_step_flat(master, grad_bf16, exp_avg, exp_avg_sq, step=next(steps),
                                                              copy_out=copy_out, **HYPER)), numel, EXACT_BYTES))
    flat = torch.nn.Parameter(master.clone())
    flat.grad = grad
    fused = torch.optim.AdamW([flat], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                              weight_decay=HYPER["weight_decay"], fused=True)
    fused.state[flat] = {"step": torch.tensor(0.0), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    rows.append(("torch AdamW fused (fp32)", fused.step, numel, EXACT_BYTES))
    for chosen in _native.adam_available_isas():
        if chosen == "scalar":  # the reference kernel takes seconds per 100M: the smaller range
            rows.append((f"compact native scalar ({reference_numel / 1e6:g}M)",
                         on_isa(chosen, lambda: compact_adam_step(scalar, grad_bf16[:reference_numel], step=next(steps),
                                                                  **HYPER)), reference_numel, COMPACT_BYTES + CHECK_BYTES))
            continue
        rows.append((f"compact native {chosen}",
                     on_isa(chosen, lambda: compact_adam_step(compact, grad_bf16, step=next(steps), **HYPER)),
                     numel, COMPACT_BYTES + CHECK_BYTES))
    rows.append((f"compact torch-ops ({reference_numel / 1e6:g}M)",
                 lambda: compact_adam_step_reference(reference, grad_bf16[:reference_numel], step=next(steps), **HYPER),
                 reference_numel, COMPACT_BYTES))
    try:
        timed = interleaved_medians([(name, fn, 0) for name, fn, _, _ in rows], rounds)
    finally:
        _native.adam_set_isa(isa)
    return [(name, seconds, n, b) for (name, seconds, _), (_, _, n, b) in zip(timed, rows)]


def print_table(numel: int, rows: list[tuple[str, float, int, float]]) -> None:
    triad_gbps = max(n * b / s / 1e9 for name, s, n, b in rows if name in (TORCH_TRIAD, TRIAD))
    base = next(s / n for name, s, n, _ in rows if name == BASELINE)
    print(f"\n{numel / 1e6:g}M params on {cpu_model()}, {_native.num_threads()} native threads, "
          f"{torch.get_num_threads()} torch threads; the triad: {triad_gbps:.1f} GB/s")
    print(f"{'row':38} {'ms':>9} {'Gparam/s':>9} {'B/param':>8} {'GB/s':>6} {'bound ms':>9} {'of bound':>8} "
          f"{'x base':>7}")
    for name, seconds, n, bytes_per in rows:
        gbps = n * bytes_per / seconds / 1e9
        if name in (TORCH_TRIAD, TRIAD):
            print(f"{name:38} {seconds * 1e3:9.2f} {'':>9} {bytes_per:8.2f} {gbps:6.1f}")
            continue
        bound = n * bytes_per / (triad_gbps * 1e9)
        print(f"{name:38} {seconds * 1e3:9.2f} {n / seconds / 1e9:9.3g} {bytes_per:8.2f} {gbps:6.1f} "
              f"{bound * 1e3:9.2f} {bound / seconds:8.0%} {base / (seconds / n):7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["100M"], help="param counts, e.g. 10M 100M")
    parser.add_argument("--threads", type=int, default=2, help="native and torch threads")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (>= 3)")
    parser.add_argument("--reference-numel", default="8M",
                        help="params the compact torch-ops row steps (it is slow and allocates)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _native.set_num_threads(args.threads)
    print(f"offload {offload.native_info()}")
    for size in args.sizes:
        numel = parse_size(size)
        reference_numel = min(numel, parse_size(args.reference_numel))
        print_table(numel, bench_size(numel, reference_numel, max(args.rounds, 3)))


if __name__ == "__main__":
    main()
