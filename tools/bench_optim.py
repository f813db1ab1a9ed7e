"""Benchmark of the host optimizer step for optimizers other than Adam: the engine's step
against torch's fastest flags, and against the memory-bandwidth bound.

For each optimizer (SGD with momentum, SGD nesterov with weight decay, Adagrad, RMSprop, a
Lion written as a user writes it, Adafactor, and AdamW for reference) it times on one flat
fp32 parameter of --size elements:
  * "offload engine": the step as the engine runs it over a unit's range
    (offload.optim.adam_ranges.step_elementwise: the native kernel where one is routed,
    [Note: native elementwise kernels], else the gradient copied to fp32 and the optimizer's
    own single-tensor step on 1-D views, [Note: elementwise optimizers]); AdamW's is the
    native Adam kernel (adam_step_flat);
  * "offload generic": where a native kernel is routed, the generic path it replaces;
  * "torch <flag>": the same torch optimizer over the same tensors with each of its flags
    (fused, foreach, and the for-loop where it has neither), the fastest one being the
    baseline of "vs torch".
Every row of one optimizer steps the same param, grad and state tensors (the torch rows are
handed them as their state), interleaved in rounds (every row once per round) so that load
from other processes spreads over all rows; each figure is the median of --rounds.

Columns: Gparam/s; B/param, the bytes a one-pass step must move per parameter (read param,
grad and each state tensor, write param and each state tensor: 12 B for SGD without state,
+8 B per fp32 state tensor; Adafactor 16 B: the gradient is read twice, once for the factored
row and column means and once for the update); "bound" Gparam/s, the triad bandwidth over
those bytes; "x bound", this row's time over the bound's; "vs torch", torch's fastest time
over this row's (> 1: faster). The triad (a = b + s * c) is measured in each optimizer's rounds,
once with torch.add (16 B/element: a's lines are read before they are written) and once
natively with streaming stores (12 B/element); "triad" is the faster in GB/s.

    python tools/bench_optim.py --quick            # 1M params, 3 rounds
    python tools/bench_optim.py --size 50M         # the table of docs/performance.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Tuple

# Run from a source checkout (in-place build) without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import offload  # noqa: E402
from offload import _native  # noqa: E402
from offload.optim import adam_step_flat, native_kernels  # noqa: E402
from offload.optim.adam_ranges import step_elementwise  # noqa: E402
from offload.optim.generic import ParamStep  # noqa: E402
from offload.optim.several import GroupRule  # noqa: E402
from offload.optim.whole import probe_rule  # noqa: E402

from bench_adam import cpu_model, interleaved_medians, parse_size  # noqa: E402


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) as a user writes it (tests/test_optim_generic.py's): one state
    tensor, no scalars. torch has no Lion, so its for-loop is the only torch row."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Spec(NamedTuple):
    """One optimizer of the table. ``make(params, **flag)`` builds it; ``flags``: torch's
    variants ({} is the for-loop); ``state``: the per-element state tensors' names;
    ``scalars``: its initial scalar state; ``bytes_per_param``: see the module docstring."""
    name: str
    make: Callable[..., torch.optim.Optimizer]
    flags: Tuple[Dict[str, bool], ...]
    state: Tuple[str, ...]
    scalars: Dict[str, Any]
    bytes_per_param: int
    matrix: bool = False  # steps a 2-D parameter (Adafactor's factored state)


FUSED_FOREACH = ({"fused": True}, {"foreach": True})
SPECS = [
    Spec("SGD momentum", lambda p, **f: torch.optim.SGD(p, lr=1e-3, momentum=0.9, **f),
         FUSED_FOREACH, ("momentum_buffer",), {}, 20),
    Spec("SGD nesterov wd", lambda p, **f: torch.optim.SGD(p, lr=1e-3, momentum=0.9, nesterov=True,
                                                            weight_decay=1e-4, **f),
         FUSED_FOREACH, ("momentum_buffer",), {}, 20),
    Spec("Adagrad", lambda p, **f: torch.optim.Adagrad(p, lr=1e-2, **f),
         FUSED_FOREACH, ("sum",), {"step": 0.0}, 20),
    Spec("RMSprop", lambda p, **f: torch.optim.RMSprop(p, lr=1e-3, **f),
         ({"foreach": True},), ("square_avg",), {"step": 0.0}, 20),
    Spec("Lion", lambda p, **f: Lion(p, lr=1e-4, weight_decay=0.1),
         ({},), ("exp_avg",), {}, 20),
    Spec("Adafactor", lambda p, **f: torch.optim.Adafactor(p, lr=1e-2, **f),
         ({"foreach": True}, {"foreach": False}), (), {}, 16, matrix=True),
    Spec("AdamW", lambda p, **f: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, **f),
         FUSED_FOREACH, ("exp_avg", "exp_avg_sq"), {"step": 0.0}, 28),
]

TORCH_TRIAD = "stream triad, torch (16 B)"
TRIAD = "stream triad, NT stores (12 B)"

Row = Tuple[str, Callable[[], object], int]


def flag_label(flags: Dict[str, bool]) -> str:
    on = [k for k, v in flags.items() if v]
    return on[0] if on else "for-loop"


def matrix_shape(numel: int) -> Tuple[int, int]:
    """A 2-D shape of at most ``numel`` elements, 1024 columns (Adafactor's rows and columns)."""
    cols = min(1024, numel)
    return numel // cols, cols


class EngineStep:
    """The engine's step of one parameter over its whole range: a fresh ParamStep per
    update, settled by the rule's empty-slice step for an elementwise rule, then
    step_elementwise ([Note: elementwise optimizers])."""

    def __init__(self, opt: torch.optim.Optimizer, shape: torch.Size, param: torch.Tensor,
                 grad: torch.Tensor, state: Dict[str, torch.Tensor], scalars: Dict[str, Any],
                 native: bool) -> None:
        rule = probe_rule(opt)
        self.rule = GroupRule(rule, 0, False)
        self.group = opt.param_groups[0]
        self.shape, self.param, self.grad, self.native = shape, param, grad, native
        names = list(rule.slots) + [None] * (2 - len(rule.slots))
        self.slots = tuple(None if name is None else state[name] for name in names)
        self.last: int = ParamStep(0, scalars={k: torch.tensor(v) for k, v in scalars.items()}) if scalars else 0

    def __call__(self) -> None:
        step = ParamStep.after(self.last)
        if not self.rule.rule.whole:
            self.rule.rule.settle(step, 0, self.group)
        step_elementwise(self.rule, self.shape, self.group, step, self.grad, 1.0, self.param, self.slots,
                         None, None, native=self.native)
        self.last = step


def routes_natively(opt: torch.optim.Optimizer) -> bool:
    """Whether the engine steps this optimizer's group 0 with a native kernel ([Note: native
    elementwise kernels])."""
    return native_kernels.kernel_for(probe_rule(opt), 0, opt.param_groups[0]) is not None


def optimizer_rows(spec: Spec, numel: int, param: torch.Tensor, grad: torch.Tensor,
                   states: List[torch.Tensor]) -> List[Row]:
    """The rows of one optimizer, all over ``param``, ``grad`` and ``states``."""
    gen = torch.Generator().manual_seed(1)
    for s in states:  # non-negative and small: a valid sum or square average for every optimizer
        s.copy_(torch.rand(s.numel(), generator=gen)).mul_(1e-3)
    if spec.matrix:
        shape = torch.Size(matrix_shape(numel))
        n = shape[0] * shape[1]
        p_view, g_view = param[:n], grad[:n]
    else:
        shape, p_view, g_view = torch.Size([numel]), param, grad
    flat = torch.nn.Parameter(p_view.view(shape))
    flat.grad = g_view.view(shape)
    state = {name: states[i] for i, name in enumerate(spec.state)}
    rows: List[Row] = []

    def torch_state() -> Dict[str, Any]:
        return dict({k: torch.tensor(v) for k, v in spec.scalars.items()}, **state)

    if spec.name == "AdamW":
        counter = iter(range(1, 10**9))
        rows.append(("offload engine: native adam", lambda: adam_step_flat(
            param, grad, states[0], states[1], step=next(counter), lr=1e-3, beta1=0.9, beta2=0.999,
            eps=1e-8, weight_decay=0.01), spec.bytes_per_param))
    else:
        ours = spec.make([flat])
        native = routes_natively(ours)
        label = "offload engine: " + ("native" if native else "generic")
        rows.append((label, EngineStep(ours, shape, p_view, g_view, state, spec.scalars, True), spec.bytes_per_param))
        if native:
            rows.append(("offload generic", EngineStep(ours, shape, p_view, g_view, state, spec.scalars, False),
                         spec.bytes_per_param))
    for flags in spec.flags:
        opt = spec.make([flat], **flags)
        if state:
            opt.state[flat] = torch_state()
        rows.append((f"torch {flag_label(flags)}", opt.step, spec.bytes_per_param))
    return rows


def triad_rows(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> List[Row]:
    """The two triads a = b + 0.5 * c of the module docstring."""
    return [(TORCH_TRIAD, lambda: torch.add(b, c, alpha=0.5, out=a), 16),
            (TRIAD, lambda: _native.stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), b.numel(), 0.5), 12)]


def print_table(numel: int, results: List[Tuple[str, int, List[Tuple[str, float, int]]]]) -> None:
    """``results``: (optimizer, its parameter's numel, its rows measured with the triads)."""
    print(f"\n{numel / 1e6:g}M fp32 params on {cpu_model()}, {offload.native_info()['num_threads']} "
          f"native threads, {torch.get_num_threads()} torch threads; triad GB/s measured in each "
          "optimizer's rounds")
    print(f"{'optimizer':18} {'implementation':28} {'ms':>9} {'Gparam/s':>9} {'B/param':>8} "
          f"{'triad':>6} {'bound':>7} {'x bound':>8} {'vs torch':>9}")
    for opt_name, n, rows in results:
        triad_gbps = max(numel * b / s / 1e9 for name, s, b in rows if name in (TORCH_TRIAD, TRIAD))
        best_torch = min(s for name, s, _ in rows if name.startswith("torch"))
        for name, seconds, bytes_per in rows:
            if name in (TORCH_TRIAD, TRIAD):
                continue
            bound_gparams = triad_gbps / bytes_per
            gparams = n / seconds / 1e9
            print(f"{opt_name:18} {name:28} {seconds * 1e3:9.2f} {gparams:9.3f} {bytes_per:8d} {triad_gbps:6.1f} "
                  f"{bound_gparams:7.3f} {bound_gparams / gparams:8.2f} {best_torch / seconds:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M params (unless --size), 3 rounds")
    parser.add_argument("--size", default=None, help="fp32 params, e.g. 50M (default 50M; 1M with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per figure (default 5; 3 with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="native and torch threads (default 2)")
    parser.add_argument("--only", nargs="+", default=None, help="optimizer names to run (default: all)")
    args = parser.parse_args()
    numel = parse_size(args.size or ("1M" if args.quick else "50M"))
    rounds = args.rounds or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    _native.set_num_threads(args.threads)
    print(f"offload {offload.native_info()}")

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-2)
    states = [torch.zeros(numel), torch.zeros(numel)]
    triad_out = torch.zeros(numel)
    results = []
    for spec in SPECS:
        if args.only and spec.name not in args.only:
            continue
        # The triads run in the optimizer's rounds, so that its bound is measured under the
        # same load from other processes as its rows.
        rows = optimizer_rows(spec, numel, param, grad, states) + triad_rows(triad_out, grad, states[0])
        rows_2d, cols = matrix_shape(numel) if spec.matrix else (numel, 1)
        results.append((spec.name, rows_2d * cols, interleaved_medians(rows, rounds)))
    print_table(numel, results)


if __name__ == "__main__":
    main()
