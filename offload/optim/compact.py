"""The Adam/AdamW step on compact optimizer states ([Note: compact optimizer states] in
offload/memory/compact_codec.py), and what optimizer_states="compact" is refused with.

``compact_adam_step`` runs the fused native kernel (native/compact/compact.h): per block it
dequantizes, updates and requantizes in one pass, on the Adam kernel's instruction set.
``compact_adam_step_reference`` is the same rule in torch ops, slow but plain: each
operation one fp32 rounding in a fixed order (no fused multiply-add, no ISA-dependent
intrinsic, square roots correctly rounded). The kernel equals it bit for bit on every ISA
([Note: compact step numerics] in native/compact/compact.h; tests/test_optim_compact.py)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from offload import _native
from offload.memory.compact_codec import (BLOCK_NUMEL, COMPACT_ARRAYS, CompactHomeLayout, NonFiniteStateError,
                                          compact_home_layout, compact_padded_numel,
                                          compact_piece_regions, compact_range_parts,
                                          decode_exp_avg, decode_exp_avg_sq, decode_master, encode_exp_avg, encode_exp_avg_sq, encode_master,
                                          ieee_sqrt, num_blocks)
from offload.memory.master_codec import check_flat
from offload.optim.cpu_adam import CPUAdam

__all__ = ["CompactRange", "CompactUnit", "UnitCompactStates", "check_compact_supported", "compact_adam_step", "compact_adam_step_reference",
           "compact_constants",
           "compact_padded_numel", "compact_unit_bytes"]


class CompactRange:
    """The compact states of ``numel`` consecutive parameters: the bf16 compute copy (the
    master's high part), the int8 low part, and the two 8-bit moments with one fp32 scale
    per block of BLOCK_NUMEL."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.high = torch.zeros(numel, dtype=torch.bfloat16)
        self.low = torch.zeros(numel, dtype=torch.int8)
        self.exp_avg = torch.zeros(numel, dtype=torch.int8)
        self.exp_avg_scales = torch.zeros(num_blocks(numel), dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.uint8)
        self.exp_avg_sq_scales = torch.zeros(num_blocks(numel), dtype=torch.float32)

    @classmethod
    def from_exact(cls, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> "CompactRange":
        """The compact form of fp32 ``master`` and moments (flat, one length)."""
        states = cls(master.numel())
        states.high, states.low = encode_master(master)
        states.exp_avg, states.exp_avg_scales = encode_exp_avg(exp_avg)
        states.exp_avg_sq, states.exp_avg_sq_scales = encode_exp_avg_sq(exp_avg_sq)
        return states

    def range(self, lo: int, hi: int) -> "CompactRange":
        """Elements [lo, hi) as a CompactRange of views (updates write through). ``lo`` on
        a block boundary; the rest of the block that holds ``hi - 1`` must be the caller's
        own (the end, or CompactUnit's padding): its scale is rewritten from [lo, hi) alone."""
        assert lo % BLOCK_NUMEL == 0 and lo <= hi <= self.numel
        view = CompactRange.__new__(CompactRange)
        view.numel = hi - lo
        blocks = slice(lo // BLOCK_NUMEL, lo // BLOCK_NUMEL + num_blocks(hi - lo))
        # high None: a CompactUnit whose high parts are views of a compute copy (it sets them)
        view.high = None if self.high is None else self.high[lo:hi]
        view.low = self.low[lo:hi]
        view.exp_avg, view.exp_avg_scales = self.exp_avg[lo:hi], self.exp_avg_scales[blocks]
        view.exp_avg_sq, view.exp_avg_sq_scales = self.exp_avg_sq[lo:hi], self.exp_avg_sq_scales[blocks]
        return view

    def master(self) -> torch.Tensor:
        return decode_master(self.high, self.low)

    def moments(self) -> "tuple[torch.Tensor, torch.Tensor]":
        return (decode_exp_avg(self.exp_avg, self.exp_avg_scales),
                decode_exp_avg_sq(self.exp_avg_sq, self.exp_avg_sq_scales))


def compact_constants(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, adamw: bool, grad_scale: float) -> Dict[str, torch.Tensor]:
    """The step's scalars, each worked out in double and rounded to fp32 once: part of the
    rule (a reference implementation takes these same values)."""
    values = _constants_in_double(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                  adamw=adamw, grad_scale=grad_scale)
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()}


def _constants_in_double(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, adamw: bool, grad_scale: float) -> Dict[str, float]:
    return {
        "grad_scale": grad_scale,
        "decay": 1.0 - lr * weight_decay if adamw else weight_decay,
        "beta1": beta1, "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2, "one_minus_beta2": 1.0 - beta2,
        "sqrt_bias_correction2": math.sqrt(1.0 - beta2 ** step),
        "eps": eps,
        "step_size": lr / (1.0 - beta1 ** step),
    }


assert _native.COMPACT_BLOCK_NUMEL == BLOCK_NUMEL, "native/compact/compact.h's kBlockNumel is the codec's"

_GRAD_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # native/adam/adam.h, DType
# native/compact/compact.h, Problem: the state each code names (1, the gradient, is exp_avg's first input)
_PROBLEM_STATES = {2: "exp_avg", 3: "exp_avg_sq", 4: "master",
                   5: "master (rounded to bf16: beyond bf16's largest value)"}


def compact_adam_step(states: CompactRange, grad: torch.Tensor, *, step: int, lr: float, beta1: float,
                      beta2: float, eps: float, weight_decay: float, adamw: bool = True,
                      grad_scale: float = 1.0) -> None:
    """One Adam (``adamw=False``) or AdamW step of ``states`` with ``grad`` (flat,
    fp32/bf16/fp16, multiplied by ``grad_scale`` first), ``step`` the 1-based number of this
    step: the rule of compact_adam_step_reference, the same bits, in one fused native pass
    over the states (in place, on the native thread pool, the GIL released).

    A non-finite gradient (times grad_scale) raises NonFiniteStateError naming exp_avg and
    the first element before anything is written. A finite gradient whose update overflows
    a state (a moment or master beyond fp32, a master beyond bf16) raises it naming that
    state and element after other blocks were stored (the block holding it and those after
    it in its thread's range keep their states): the states are then a mix of two steps (as
    the units stepped before it are), and the run cannot go on from them."""
    assert grad.dim() == 1 and grad.numel() == states.numel
    n = states.numel
    check_flat("grad", grad, tuple(_GRAD_DTYPE_CODES), n)
    check_flat("high", states.high, (torch.bfloat16,), n)
    check_flat("low", states.low, (torch.int8,), n)
    check_flat("exp_avg", states.exp_avg, (torch.int8,), n)
    check_flat("exp_avg_sq", states.exp_avg_sq, (torch.uint8,), n)
    check_flat("exp_avg_scales", states.exp_avg_scales, (torch.float32,), num_blocks(n))
    check_flat("exp_avg_sq_scales", states.exp_avg_sq_scales, (torch.float32,), num_blocks(n))
    # compact_constants' fp32 values, as Python floats (no tensors: a unit steps each parameter)
    c = {k: float(np.float32(v)) for k, v in _constants_in_double(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
        grad_scale=grad_scale).items()}
    problem, element, value, count = _native.compact_adam_step(
        grad.data_ptr(), _GRAD_DTYPE_CODES[grad.dtype], states.high.data_ptr(), states.low.data_ptr(),
        states.exp_avg.data_ptr(), states.exp_avg_scales.data_ptr(), states.exp_avg_sq.data_ptr(),
        states.exp_avg_sq_scales.data_ptr(), n, adamw=adamw, **c)
    if problem == 1:
        raise NonFiniteStateError(
            f"exp_avg: {count} non-finite value(s) (NaN/Inf) from the gradient, the first at element {element} "
            f"({value}); compact optimizer states cannot hold them (nothing was written)")
    if problem != 0:
        raise NonFiniteStateError(
            f"{_PROBLEM_STATES[problem]}: a non-finite value (NaN/Inf) at element {element} ({value}); "
            "compact optimizer states cannot hold it (some other blocks were updated)")


def compact_adam_step_reference(states: CompactRange, grad: torch.Tensor, *, step: int, lr: float, beta1: float,
                                beta2: float, eps: float, weight_decay: float, adamw: bool = True,
                                grad_scale: float = 1.0) -> None:
    """One Adam (``adamw=False``: L2 decay added to the gradient) or AdamW step of
    ``states`` with ``grad`` (flat, fp32/bf16/fp16, multiplied by ``grad_scale`` first),
    ``step`` the 1-based number of this step. Slow but plain: torch ops, one pass each; the
    reference the native kernel (compact_adam_step) is tested against bit for bit.
    The new states are worked out whole before any is stored: a non-finite value raises
    NonFiniteStateError (naming the state and element) and leaves ``states`` as it was.

    The rule, each line one fp32 rounding per operation, left to right:
      g = grad * grad_scale;  x = high + low * ulp(high) / 254   (decode_master)
      AdamW: x = x * (1 - lr*wd)            Adam: g = g + x * wd
      m = m * b1 + g * (1 - b1);  v = v * b2 + (g * g) * (1 - b2)
      x = x - (m / (sqrt(v) / sqrt(1 - b2^t) + eps)) * (lr / (1 - b1^t))
    then m, v and x are encoded (memory/compact_codec.py)."""
    assert grad.dim() == 1 and grad.numel() == states.numel
    c = compact_constants(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          adamw=adamw, grad_scale=grad_scale)
    g = grad.to(torch.float32)
    if grad_scale != 1.0:
        g = g * c["grad_scale"]
    x = states.master()
    m, v = states.moments()
    if adamw:
        x = x * c["decay"]
    else:
        g = g + x * c["decay"]
    m = m * c["beta1"] + g * c["one_minus_beta1"]
    v = v * c["beta2"] + (g * g) * c["one_minus_beta2"]
    denom = ieee_sqrt(v) / c["sqrt_bias_correction2"] + c["eps"]
    x = x - (m / denom) * c["step_size"]
    exp_avg, exp_avg_scales = encode_exp_avg(m)
    exp_avg_sq, exp_avg_sq_scales = encode_exp_avg_sq(v)
    high, low = encode_master(x)
    for dst, src in ((states.exp_avg, exp_avg), (states.exp_avg_scales, exp_avg_scales),
                     (states.exp_avg_sq, exp_avg_sq), (states.exp_avg_sq_scales, exp_avg_sq_scales),
                     (states.high, high), (states.low, low)):
        dst.copy_(src)


class CompactUnit:
    """The compact states of one unit's trainable parameters, each parameter starting on a
    block boundary (its last block padded with elements that stay 0): a block never holds
    two parameters, so a parameter without a gradient (left alone, as torch's AdamW does)
    or in another param group never shares a scale with one being updated, and a
    parameter's update is the same bits whatever its neighbours."""

    def __init__(self, numels: Sequence[int], *, buffer: Optional[torch.Tensor] = None,
                 highs: Optional[Sequence[torch.Tensor]] = None) -> None:
        """``buffer``: flat uint8 of compact_unit_bytes(numels) bytes that the states are
        carved from (a host home: the scales first, fp32-aligned, then the low part, exp_avg
        and exp_avg_sq), not touched here; None: zeroed tensors of their own. ``highs``: each
        parameter's master high part, a bf16 view of ``numels[k]`` elements (the unit's
        compute copy, so that the high part is not held twice); None: a bf16 range of its own."""
        self.numels = list(numels)
        self.offsets: List[int] = []
        end = 0
        for n in self.numels:
            self.offsets.append(end)
            end += compact_padded_numel([n])
        self._highs = None if highs is None else list(highs)
        assert self._highs is None or [h.numel() for h in self._highs] == self.numels
        if buffer is None:
            self.states = CompactRange(end)
        else:
            layout = compact_home_layout(end)
            assert buffer.dtype == torch.uint8 and buffer.numel() == layout.nbytes
            self.states = compact_range_over(buffer, layout, 0, end)
            if highs is None:
                self.states.high = torch.zeros(end, dtype=torch.bfloat16)
        if highs is not None:
            self.states.high = None

    @property
    def padded_numel(self) -> int:
        """Elements of the unit's compact states, each parameter padded to whole blocks."""
        return self.states.numel

    def param(self, k: int) -> CompactRange:
        lo = self.offsets[k]
        view = self.states.range(lo, lo + self.numels[k])
        if self._highs is not None:
            view.high = self._highs[k]
        return view

    def load_exact(self, k: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Parameter k's states from fp32 ones (an optimizer's carried state, an exact
        checkpoint), encoded; a non-finite value raises NonFiniteStateError and changes
        nothing of parameter k."""
        fresh = CompactRange.from_exact(master.reshape(-1).float(), exp_avg.reshape(-1).float(),
                                        exp_avg_sq.reshape(-1).float())
        target = self.param(k)
        for name in ("high", "low", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales"):
            getattr(target, name).copy_(getattr(fresh, name))

    def exact(self, k: int) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
        """Parameter k's fp32 master, exp_avg and exp_avg_sq, decoded (for an fp32 export,
        save_pretrained's weights from master = high + low, or a switch to exact states)."""
        states = self.param(k)
        return (states.master(),) + states.moments()

    def step(self, grads: Sequence[Optional[torch.Tensor]], steps: Sequence[int],
             groups: Sequence[Dict[str, Any]], *, adamw: bool = True, grad_scale: float = 1.0) -> List[int]:
        """One step of every parameter with a gradient (``grads[k]`` None: no gradient,
        nothing changes), parameter k with ``groups[k]``'s hyperparameters; returns the step
        counts after it."""
        after = []
        for k, (grad, step, group) in enumerate(zip(grads, steps, groups)):
            if grad is None:
                after.append(step)
                continue
            beta1, beta2 = group["betas"]
            compact_adam_step(self.param(k), grad.reshape(-1), step=step + 1, lr=float(group["lr"]),
                              beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                              weight_decay=float(group["weight_decay"]), adamw=adamw, grad_scale=grad_scale)
            after.append(step + 1)
        return after


def compact_unit_bytes(numels: Sequence[int]) -> int:
    """Bytes of the buffer a CompactUnit of parameters of ``numels`` elements is carved from
    (a compact home), beside the bf16 compute copy: compact_state_bytes of its padded
    length, packed, or with each array on whole pages (compact_home_layout)."""
    return compact_home_layout(compact_padded_numel(numels)).nbytes


def compact_range_over(buffer: torch.Tensor, layout: CompactHomeLayout, lo: int, hi: int,
                       staged_piece: bool = False) -> CompactRange:
    """Compact elements [lo, hi) (``lo`` on a block) of the home ``layout`` describes, as a
    CompactRange of views of ``buffer`` (uint8): the whole home's bytes, or with
    ``staged_piece`` ([Note: compact pieces]) a staging slot's copy of piece [lo, hi) of a
    paged home (compact_piece_regions). ``high`` is None (the caller sets it)."""
    n = hi - lo
    regions = compact_piece_regions(layout, lo, hi) if staged_piece else None
    parts = compact_range_parts(layout, lo, hi)
    states = CompactRange.__new__(CompactRange)
    states.numel = n
    states.high = None
    for name, dtype, _ in COMPACT_ARRAYS:
        first = regions[name][0] if regions is not None else parts[name][0]
        setattr(states, name, buffer[first:first + parts[name][1]].view(dtype))
    return states


class UnitCompactStates:
    """The CompactStates port (memory/compact_codec.py) over CompactUnit: a unit's trainable
    parameters, in unit order, each its own CompactUnit parameter. Holds nothing between
    calls; any thread may call it ([Note: compact optimizer states])."""

    def over(self, u: Any, buffer: torch.Tensor, compute: torch.Tensor) -> CompactUnit:
        """u's CompactUnit over ``buffer`` (at least compact_unit_bytes of u's parameters,
        uint8) and ``compute`` (u's compute copy from element 0, or its trainable prefix),
        whose views are the high parts."""
        numels = [e.numel for e in u.trainable]
        return CompactUnit(numels, buffer=buffer[:compact_unit_bytes(numels)],
                           highs=[compute[e.offset:e.offset + e.numel] for e in u.trainable])


def check_compact_supported(config: Any, optimizer: torch.optim.Optimizer) -> None:
    """wrap's refusals of optimizer_states="compact", before anything is touched: a
    ValueError naming the field and the reason."""
    if config.optimizer_states != "compact":
        return
    if not isinstance(optimizer, (torch.optim.Adam, CPUAdam)):  # AdamW is an Adam
        raise ValueError(f"optimizer_states: 'compact' keeps Adam's two moments only; "
                         f"{type(optimizer).__name__} is not torch.optim.Adam/AdamW or offload.CPUAdam "
                         "(use optimizer_states='exact')")
    check_compact_config(config)


def check_compact_config(config: Any) -> None:
    """The refusals of optimizer_states="compact" that the config alone decides (wrap's,
    and offload plan's, which has no optimizer): a ValueError naming the field and the
    reason. Not the stage: one process ignores it, and several ranks are refused a sharding
    stage once the process group is known (memory/layout.check_compact_stage)."""
    if config.optimizer_states != "compact":
        return
    if config.dtype != "bf16":
        raise ValueError(f"optimizer_states: 'compact' keeps the master as the bf16 compute copy plus an "
                         f"8-bit low part, so it needs dtype='bf16' (got dtype={config.dtype!r})")
    if config.delayed_update:
        raise ValueError("optimizer_states: 'compact' is not available with delayed_update=True; "
                         "use optimizer_states='exact' with it")
    # the tiers it is not available on yet: Layout.resolve (memory/layout.py)
