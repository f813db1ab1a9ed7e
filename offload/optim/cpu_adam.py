"""CPU Adam: the native vectorized kernel and a ``torch.optim.Optimizer`` around it.

``adam_step_flat`` runs one Adam/AdamW step over flat CPU buffers in one pass over memory
(the training engine calls it on slices of its flat state buffers). ``CPUAdam`` is a drop-in
``torch.optim.AdamW``/``Adam`` for CPU fp32 parameters built on it.

Numerics: with fp32 gradients, both reproduce ``torch.optim.AdamW``/``Adam`` with
``foreach=False`` bit for bit on CPUs where torch's kernels use FMA (AVX2/AVX-512); see
[Note: Adam numerics] in native/adam/adam.h for the exact order of operations.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Callable

import torch

from offload import _native
from offload.memory.master_codec import check_flat as _check_flat, join_master, split_master

__all__ = ["CPUAdam", "adam_flavour", "adam_step_flat", "carried_adam_state", "join_master", "split_master"]

# Dtype codes understood by the native kernel (native/adam/adam.h, enum DType).
_GRAD_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_COPY_OUT_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}

# Fail at import, with the native message, when OFFLOAD_FORCE_ISA names an unknown
# instruction set or one this CPU lacks; better than failing at the first optimizer step.
_native.adam_selected_isa()


def adam_step_flat(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    grad_scale: float = 1.0,
    copy_out: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One Adam/AdamW step over flat CPU buffers, in a single pass over memory: in place,
    or with ``out`` into other buffers.

    Args:
        param: fp32 master weights, updated in place.
        grad: gradient, fp32, bf16 or fp16; read only. It is multiplied by ``grad_scale``
            before anything else (fold loss-scale unscaling and clipping in here).
        exp_avg, exp_avg_sq: fp32 Adam moments, updated in place.
        step: the 1-based number of this step (already incremented), for bias correction.
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw: decoupled weight decay (AdamW) if True, else L2 decay added to the grad (Adam).
        copy_out: optional bf16/fp16 buffer that receives the updated param, rounded to
            nearest even, in the same pass.
        out: optional fp32 (param, exp_avg, exp_avg_sq) that receive the new values, while
            ``param``, ``exp_avg`` and ``exp_avg_sq`` are only read ([Note: out-of-place
            Adam] in native/adam/adam.h); the results are the same bit for bit. An entry
            that is its input (the same memory) is updated in place.

    All tensors must be contiguous CPU tensors with ``param.numel()`` elements and must not
    overlap. Runs on the native thread pool with the GIL released.

    Raises:
        TypeError: an argument is not a tensor or has an unsupported dtype.
        ValueError: an argument is not on the CPU, not contiguous, has the wrong number of
            elements, or ``step`` < 1.
    """
    _check_flat("param", param, (torch.float32,), None)
    numel = param.numel()
    _check_flat("grad", grad, tuple(_GRAD_DTYPE_CODES), numel)
    _check_flat("exp_avg", exp_avg, (torch.float32,), numel)
    _check_flat("exp_avg_sq", exp_avg_sq, (torch.float32,), numel)
    if copy_out is not None:
        _check_flat("copy_out", copy_out, tuple(_COPY_OUT_DTYPE_CODES), numel)
    out_addresses = (0, 0, 0)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise TypeError("out must be a tuple (param, exp_avg, exp_avg_sq) of tensors")
        for name, tensor in zip(("out[0] (param)", "out[1] (exp_avg)", "out[2] (exp_avg_sq)"), out):
            _check_flat(name, tensor, (torch.float32,), numel)
        apart = [o.data_ptr() != i.data_ptr() for o, i in zip(out, (param, exp_avg, exp_avg_sq))]
        out_addresses = tuple(o.data_ptr() if a else 0 for o, a in zip(out, apart))
        _check_disjoint([("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                         ("copy_out", copy_out)] + [(f"out[{k}]", o) for k, (o, a) in enumerate(zip(out, apart)) if a])
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count after this step), got {step}")
    _native.adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        _GRAD_DTYPE_CODES[grad.dtype],
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        numel,
        step=float(step),
        lr=float(lr),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(eps),
        weight_decay=float(weight_decay),
        adamw=bool(adamw),
        grad_scale=float(grad_scale),
        copy_out=0 if copy_out is None else copy_out.data_ptr(),
        copy_out_dtype=0 if copy_out is None else _COPY_OUT_DTYPE_CODES[copy_out.dtype],
        param_out=out_addresses[0],
        exp_avg_out=out_addresses[1],
        exp_avg_sq_out=out_addresses[2],
    )


def _check_disjoint(named: list[tuple[str, torch.Tensor | None]]) -> None:
    """ValueError naming the first two of ``named`` (contiguous tensors or None) whose
    memory overlaps; an out-of-place step's outputs must overlap nothing it reads."""
    spans = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for name, t in named if t is not None and t.numel() > 0]
    for i, (a, a_lo, a_hi) in enumerate(spans):
        for b, b_lo, b_hi in spans[i + 1:]:
            if a_lo < b_hi and b_lo < a_hi:
                raise ValueError(f"{a} and {b} overlap; an out-of-place step needs separate buffers")


# Group options torch.optim.Adam/AdamW keep that this optimizer cannot honour, with the
# value it requires. They are kept in every group so state dicts interchange with torch.
_FIXED_GROUP_OPTIONS = {
    "amsgrad": False,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
}


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 CPU parameters, on the native vectorized kernel.

    A drop-in for ``torch.optim.AdamW`` (``adamw=True``) or ``torch.optim.Adam``
    (``adamw=False``) on CPU: the same results (see the module docstring), the same
    per-parameter state (``step``: a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq``) and
    the same param-group keys, so ``state_dict()`` / ``load_state_dict()`` interchange with
    torch's optimizers both ways. ``adamw`` is stored in each group under torch's name,
    ``decoupled_weight_decay``; a group added as a dict may give either key.

    Param groups may differ in every hyperparameter; ``group['lr']`` is read at every step,
    so lr schedulers work. A parameter whose ``grad`` is None is skipped as torch skips it:
    no decay, no moment update, its step count unchanged.

    Not supported, each a ``ValueError``/``TypeError`` naming the parameter
    (``param_groups[g]['params'][i]``): amsgrad, maximize, sparse gradients, non-CPU
    tensors, non-contiguous params/grads/states, params other than float32, grads other than
    float32/bfloat16/float16, and a grad whose shape differs from its param's.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
    ) -> None:
        if isinstance(lr, torch.Tensor):
            raise TypeError("lr must be a float; CPUAdam reads it on the host every step")
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=adamw,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = dict(param_group)
        if "adamw" in param_group:
            param_group["decoupled_weight_decay"] = bool(param_group.pop("adamw"))
        super().add_param_group(param_group)
        self._check_group_options(len(self.param_groups) - 1)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A state dict saved by torch.optim.Adam before it had these keys.
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", False)
            group.setdefault("foreach", None)
            group.setdefault("fused", None)
            for key, value in _FIXED_GROUP_OPTIONS.items():
                group.setdefault(key, value)

    def _check_group_options(self, group_index: int) -> None:
        group = self.param_groups[group_index]
        for key, required in _FIXED_GROUP_OPTIONS.items():
            if group.get(key, required) != required:
                raise ValueError(
                    f"param_groups[{group_index}]: {key}={group[key]!r} is not supported by "
                    f"CPUAdam (only {key}={required!r})"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step; ``closure`` re-evaluates the model and returns
        the loss, as in every torch optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group_index, group in enumerate(self.param_groups):
            self._check_group_options(group_index)
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else float(lr)
            beta1, beta2 = group["betas"]
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                name = f"param_groups[{group_index}]['params'][{param_index}]"
                self._check_param(name, param)
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.preserve_format
                    )
                self._check_state(name, param, state)
                state["step"] += 1
                adam_step_flat(
                    param.view(-1),
                    param.grad.view(-1),
                    state["exp_avg"].view(-1),
                    state["exp_avg_sq"].view(-1),
                    step=state["step"].item(),
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adamw=group["decoupled_weight_decay"],
                )
        return loss

    @staticmethod
    def _check_param(name: str, param: torch.Tensor) -> None:
        grad = param.grad
        if param.device.type != "cpu" or grad.device.type != "cpu":
            raise ValueError(
                f"{name}: CPUAdam needs CPU tensors; param is on {param.device}, "
                f"grad on {grad.device}"
            )
        if grad.is_sparse or grad.layout != torch.strided:
            raise ValueError(f"{name}: sparse gradients are not supported (layout {grad.layout})")
        if param.dtype != torch.float32:
            raise TypeError(f"{name}: param dtype {param.dtype} is not supported (float32 only)")
        if grad.dtype not in _GRAD_DTYPE_CODES:
            raise TypeError(
                f"{name}: grad dtype {grad.dtype} is not supported "
                "(float32, bfloat16 or float16)"
            )
        if grad.shape != param.shape:
            raise ValueError(
                f"{name}: grad shape {tuple(grad.shape)} differs from param shape "
                f"{tuple(param.shape)}"
            )
        if not param.is_contiguous():
            raise ValueError(f"{name}: param is not contiguous")
        if not grad.is_contiguous():
            raise ValueError(f"{name}: grad is not contiguous")

    @staticmethod
    def _check_state(name: str, param: torch.Tensor, state: dict[str, Any]) -> None:
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state[key]
            if (
                moment.device.type != "cpu"
                or moment.dtype != torch.float32
                or moment.shape != param.shape
                or not moment.is_contiguous()
            ):
                raise ValueError(
                    f"{name}: state['{key}'] must be a contiguous float32 CPU tensor shaped "
                    f"like the param, got {moment.dtype} {tuple(moment.shape)} on "
                    f"{moment.device}"
                )


def carried_adam_state(optimizer: torch.optim.Optimizer, params: "Iterable[tuple[str, torch.nn.Parameter]]"
                       ) -> "dict[torch.nn.Parameter, tuple[int, torch.Tensor, torch.Tensor]]":
    """The state an Adam/AdamW (or CPUAdam) that has taken steps holds for each of ``params``
    ((name, parameter) pairs of the trainable parameters), in its own layout:
    ``state[p]["step"]``, ``"exp_avg"``, ``"exp_avg_sq"``, as (step, exp_avg, exp_avg_sq);
    parameters without state are left out (they start at step 0, zero moments). Wrap puts
    them into the units' homes, so that wrapping a trained optimizer goes on where it was.
    A state in any other layout is a ValueError naming the parameter, raised before wrap
    touches anything."""
    carried = {}
    for name, p in params:
        state = optimizer.state.get(p)  # .get: optimizer.state is a defaultdict
        if not state:
            continue
        if set(state) != {"step", "exp_avg", "exp_avg_sq"}:
            raise ValueError(f"optimizer: the state of parameter {name!r} has keys {sorted(state)}, not Adam's "
                             "'step', 'exp_avg' and 'exp_avg_sq'; wrap a fresh optimizer or load a checkpoint")
        step = float(state["step"])
        if step < 0 or step != int(step):
            raise ValueError(f"optimizer: state[{name!r}]['step'] must be a non-negative whole number, got {step}")
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state[key]
            if not isinstance(moment, torch.Tensor) or moment.shape != p.shape or not moment.is_floating_point():
                what = f"shape {tuple(moment.shape)}" if isinstance(moment, torch.Tensor) else type(moment).__name__
                raise ValueError(f"optimizer: state[{name!r}][{key!r}] must be a floating-point tensor shaped "
                                 f"like the parameter {tuple(p.shape)}, got {what}")
        carried[p] = (int(step), state["exp_avg"], state["exp_avg_sq"])
    return carried


def adam_flavour(optimizer: torch.optim.Optimizer) -> bool:
    """True for decoupled weight decay (AdamW); checks what we cannot honor."""
    if not isinstance(optimizer, (torch.optim.Adam, CPUAdam)):
        raise ValueError(
            f"optimizer: offload runs Adam/AdamW on the CPU next to the states; got "
            f"{type(optimizer).__name__}. Pass torch.optim.Adam, torch.optim.AdamW or offload.CPUAdam")
    ours = {inspect.unwrap(cls.step) for cls in (torch.optim.Adam, torch.optim.AdamW, CPUAdam)}
    if inspect.unwrap(type(optimizer).step) not in ours:  # torch wraps step() in a profiling hook
        raise ValueError(
            f"optimizer: {type(optimizer).__name__} overrides step(), which offload never calls: the "
            "states live beside the engine's own Adam kernel, which updates them. Wrap "
            "torch.optim.Adam, torch.optim.AdamW or offload.CPUAdam itself (a change to the loss or the "
            "gradients belongs before engine.backward or in the model)")
    for i, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key, False):
                raise ValueError(f"optimizer: param_groups[{i}]['{key}']=True is not supported")
    if isinstance(optimizer, CPUAdam):
        return bool(optimizer.defaults.get("adamw", True))
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay", False))
