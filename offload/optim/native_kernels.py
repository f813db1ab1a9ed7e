"""Native kernels for the elementwise optimizers that pay for one: torch.optim.SGD,
Adagrad and RMSprop, stepped in one pass over memory instead of by their own ``step()``.

[Note: native elementwise kernels]
The generic path ([Note: elementwise optimizers] in optim/generic.py) runs an optimizer's
single-tensor step on views of a range: one pass over memory per torch operation, plus the
copy of the gradient to fp32. For SGD, Adagrad and RMSprop, measured with tools/bench_optim.py
(docs/performance.md), that was 7-20x the time the bytes of a one-pass step take at memory
bandwidth; their kernels in native/adam/elementwise.h run that one pass, on the ISA and the
threads of the Adam kernel, reading the engine's gradient (fp32, bf16 or fp16) directly and
folding in ``grad_factor``. Their results are the generic path's bit for bit on every ISA
([Note: elementwise kernel numerics] there; tests/test_optim_native_kernels.py).

``kernel_for`` routes a param group to a kernel only where the kernel computes what the
generic path would, and leaves everything else to the generic path:
  * the optimizer's class is exactly torch.optim.SGD, Adagrad or RMSprop (a subclass may
    override ``step``) and the rule steps ranges (not whole parameters);
  * the group's ``maximize``, ``differentiable`` (and RMSprop's ``capturable``) are False,
    and its hyperparameters are Python numbers (a tensor ``lr`` goes through torch's tensor
    arithmetic);
  * the group's state slots include those the kernel updates (SGD's ``momentum_buffer``
    where momentum is not 0, Adagrad's ``sum``, RMSprop's ``square_avg``, its
    ``momentum_buffer`` where momentum > 0 and ``grad_avg`` where centered), and Adagrad's
    and RMSprop's scalar state is their ``step``.
At the step, a range whose gradient is of another dtype, or an Adagrad or RMSprop parameter
that starts from an empty state (its first RMSprop step; Adagrad's own step refuses one),
takes the generic path, which makes the state as torch does.
``foreach`` and ``fused`` do not matter: the generic path runs torch's single-tensor step
whatever they say, which is what the kernels reproduce.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from offload import _native
from offload.memory.master_codec import check_flat as _check_flat

__all__ = ["adagrad_step_flat", "kernel_for", "rmsprop_step_flat", "sgd_step_flat"]

# Dtype codes of native/adam/adam.h, enum DType.
_GRAD_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# A native step of one range: (step, param, grad, grad_factor, slots) -> whether it ran (False:
# the caller runs the generic path).
NativeStep = Callable[[Any, torch.Tensor, torch.Tensor, float, Sequence[Optional[torch.Tensor]]], bool]


def sgd_step_flat(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor], *,
                  lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
                  first_step: bool, grad_scale: float = 1.0) -> None:
    """One torch.optim.SGD step over flat CPU buffers, in place, in one pass over memory:
    ``param`` fp32, ``grad`` fp32/bf16/fp16 (multiplied by ``grad_scale`` first), and the fp32
    ``momentum_buffer`` (None allowed where ``momentum`` is 0). ``first_step``: the buffer does
    not exist yet in torch's terms; it is set to the (decayed) gradient, as torch's clone.
    Bit for bit torch's single-tensor step ([Note: elementwise kernel numerics])."""
    _check_flat("param", param, (torch.float32,), None)
    numel = param.numel()
    _check_flat("grad", grad, tuple(_GRAD_DTYPE_CODES), numel)
    if momentum_buffer is not None:
        _check_flat("momentum_buffer", momentum_buffer, (torch.float32,), numel)
    elif momentum != 0:
        raise ValueError("momentum_buffer is required where momentum is not 0")
    _native.sgd_step(param.data_ptr(), grad.data_ptr(), _GRAD_DTYPE_CODES[grad.dtype],
                     0 if momentum_buffer is None else momentum_buffer.data_ptr(), numel,
                     lr=float(lr), momentum=float(momentum), dampening=float(dampening),
                     weight_decay=float(weight_decay), nesterov=bool(nesterov), first_step=bool(first_step),
                     grad_scale=float(grad_scale))


def adagrad_step_flat(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, *, lr: float,
                      lr_decay: float, weight_decay: float, eps: float, step: float,
                      grad_scale: float = 1.0) -> None:
    """One torch.optim.Adagrad step over flat CPU buffers, in place, in one pass over memory;
    ``step`` is the count after this step's increment (torch's ``state['step']`` after it).
    Bit for bit torch's single-tensor step where torch's sqrt is correctly rounded ([Note:
    elementwise kernel numerics])."""
    _check_flat("param", param, (torch.float32,), None)
    numel = param.numel()
    _check_flat("grad", grad, tuple(_GRAD_DTYPE_CODES), numel)
    _check_flat("state_sum", state_sum, (torch.float32,), numel)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this step), got {step}")
    _native.adagrad_step(param.data_ptr(), grad.data_ptr(), _GRAD_DTYPE_CODES[grad.dtype], state_sum.data_ptr(),
                         numel, lr=float(lr), lr_decay=float(lr_decay), weight_decay=float(weight_decay),
                         eps=float(eps), step=float(step), grad_scale=float(grad_scale))


def rmsprop_step_flat(param: torch.Tensor, grad: torch.Tensor, square_avg: torch.Tensor,
                      grad_avg: Optional[torch.Tensor], momentum_buffer: Optional[torch.Tensor], *, lr: float,
                      alpha: float, eps: float, weight_decay: float, momentum: float, centered: bool,
                      grad_scale: float = 1.0) -> None:
    """One torch.optim.RMSprop step over flat CPU buffers, in place, in one pass over memory;
    ``grad_avg`` is needed where ``centered``, ``momentum_buffer`` where ``momentum`` > 0 (each
    None allowed otherwise). Bit for bit torch's single-tensor step where torch's sqrt is
    correctly rounded ([Note: elementwise kernel numerics])."""
    _check_flat("param", param, (torch.float32,), None)
    numel = param.numel()
    _check_flat("grad", grad, tuple(_GRAD_DTYPE_CODES), numel)
    _check_flat("square_avg", square_avg, (torch.float32,), numel)
    for name, tensor, needed in (("grad_avg", grad_avg, centered), ("momentum_buffer", momentum_buffer, momentum > 0)):
        if tensor is not None:
            _check_flat(name, tensor, (torch.float32,), numel)
        elif needed:
            raise ValueError(f"{name} is required" + (" where centered" if name == "grad_avg" else " where momentum > 0"))
    _native.rmsprop_step(param.data_ptr(), grad.data_ptr(), _GRAD_DTYPE_CODES[grad.dtype], square_avg.data_ptr(),
                         0 if grad_avg is None else grad_avg.data_ptr(),
                         0 if momentum_buffer is None else momentum_buffer.data_ptr(), numel, lr=float(lr),
                         alpha=float(alpha), eps=float(eps), weight_decay=float(weight_decay),
                         momentum=float(momentum), centered=bool(centered), grad_scale=float(grad_scale))


def _numbers(group: Dict[str, Any], keys: Sequence[str]) -> bool:
    return all(isinstance(group.get(k), (int, float)) and not isinstance(group.get(k), bool) for k in keys)


def kernel_for(rule: Any, group_index: int, group: Dict[str, Any]) -> Optional[NativeStep]:
    """The native step of the parameters of ``rule``'s (an ElementwiseRule's) param group
    ``group_index`` with the hyperparameters ``group``, or None where the generic path steps
    them ([Note: native elementwise kernels])."""
    if rule.whole or group.get("maximize", False) or group.get("differentiable", False):
        return None
    slots = rule.group_slots[group_index]
    if rule.optimizer_type is torch.optim.SGD and _numbers(group, ("lr", "momentum", "dampening", "weight_decay")):
        if group["momentum"] != 0 and "momentum_buffer" not in slots:
            return None
        return _SgdStep(rule.slots.index("momentum_buffer") if group["momentum"] != 0 else None, group)
    if (rule.optimizer_type is torch.optim.Adagrad and _numbers(group, ("lr", "lr_decay", "weight_decay", "eps"))
            and "sum" in slots and rule.scalar_names == ("step",)):
        return _AdagradStep(rule.slots.index("sum"), group)
    if (rule.optimizer_type is torch.optim.RMSprop and not group.get("capturable", False)
            and _numbers(group, ("lr", "alpha", "eps", "weight_decay", "momentum")) and rule.scalar_names == ("step",)):
        needed = ["square_avg"] + (["momentum_buffer"] if group["momentum"] > 0 else []) + (
            ["grad_avg"] if group["centered"] else [])
        if all(name in slots for name in needed):
            return _RmspropStep([rule.slots.index(name) if name in needed else None
                                 for name in ("square_avg", "grad_avg", "momentum_buffer")], group)
    return None


class _SgdStep:
    def __init__(self, slot: Optional[int], group: Dict[str, Any]) -> None:
        self._slot, self._group = slot, group

    def __call__(self, step: Any, param: torch.Tensor, grad: torch.Tensor, grad_factor: float,
                 slots: Sequence[Optional[torch.Tensor]]) -> bool:
        if grad.dtype not in _GRAD_DTYPE_CODES:
            return False
        g = self._group
        sgd_step_flat(param, grad, None if self._slot is None else slots[self._slot], lr=g["lr"],
                      momentum=g["momentum"], dampening=g["dampening"], weight_decay=g["weight_decay"],
                      nesterov=bool(g["nesterov"]), first_step=step.before is None, grad_scale=grad_factor)
        return True


class _AdagradStep:
    def __init__(self, slot: int, group: Dict[str, Any]) -> None:
        self._slot, self._group = slot, group

    def __call__(self, step: Any, param: torch.Tensor, grad: torch.Tensor, grad_factor: float,
                 slots: Sequence[Optional[torch.Tensor]]) -> bool:
        # The settled scalars hold torch's state['step'] after this step's increment.
        if grad.dtype not in _GRAD_DTYPE_CODES or step.before is None or "step" not in step.scalars:
            return False
        g = self._group
        adagrad_step_flat(param, grad, slots[self._slot], lr=g["lr"], lr_decay=g["lr_decay"],
                          weight_decay=g["weight_decay"], eps=g["eps"], step=float(step.scalars["step"]),
                          grad_scale=grad_factor)
        return True


class _RmspropStep:
    def __init__(self, slots: Sequence[Optional[int]], group: Dict[str, Any]) -> None:
        self._slots, self._group = slots, group  # square_avg, grad_avg, momentum_buffer

    def __call__(self, step: Any, param: torch.Tensor, grad: torch.Tensor, grad_factor: float,
                 slots: Sequence[Optional[torch.Tensor]]) -> bool:
        if grad.dtype not in _GRAD_DTYPE_CODES or step.before is None:
            return False
        g = self._group
        square_avg, grad_avg, momentum_buffer = (None if i is None else slots[i] for i in self._slots)
        rmsprop_step_flat(param, grad, square_avg, grad_avg, momentum_buffer, lr=g["lr"], alpha=g["alpha"],
                          eps=g["eps"], weight_decay=g["weight_decay"], momentum=g["momentum"],
                          centered=bool(g["centered"]), grad_scale=grad_factor)
        return True
