"""Any elementwise ``torch.optim.Optimizer``, run by its own ``step()`` on views of a unit's
flat fp32 master, gradient and state slots.

[Note: elementwise optimizers]
An optimizer other than Adam/AdamW/CPUAdam (which keep the native kernel) is *elementwise*
when the new value of each element of a parameter and of its per-element state depends on
that element alone, given the scalar state (``step``, NAdam's ``mu_product``) and the group's
hyperparameters: SGD (momentum, nesterov, weight decay), RMSprop, Adagrad, Adadelta, Adamax,
NAdam, RAdam, ASGD's tensors, and a user's subclass written the same way. For such an
optimizer a slice of a parameter stepped as a 1-D parameter gives the same numbers as the
whole parameter, so every update path (the piece ring's pieces, a host unit at once) steps
ranges of the flat buffers. ``probe`` checks this at wrap on a dummy parameter (whole against
two slices, two steps) and learns the state's layout from the optimizer itself: per-element
tensors shaped like the parameter (float32) become *slots*, and a unit's moments home holds
``UnitState.state_slots`` of them (0 to 2: none for plain SGD, Adam's exp_avg and exp_avg_sq
are its slots 0 and 1; each parameter's elements only in the slots its group keeps: [Note:
per-entry state slots]), which the budgets and the planner count; everything else must be a
scalar (a 0-dim tensor or a Python number). An optimizer that fails these checks is probed
as one that steps whole parameters ([Note: whole-parameter optimizers] in optim/whole.py).

Scalar state advances once per parameter per step, not once per range: ``ParamStep`` is the
step count the engine keeps per parameter (``UnitState.steps``) carrying the scalars after
that step. ``UnitAdam.next_steps`` makes the new ParamSteps (``after``), the first range of a
unit's update settles their scalars by stepping an empty (0-element) slice of each parameter
from the scalars before (``settle``), and every range steps from the scalars before,
so every range of a parameter sees the same ``step``. The new counts are committed where
Adam's are (the steps lists are assigned whole), so speculative and delayed updates, which
keep a spare steps list, carry the scalars with them. (The ZeRO sharded step, which moves
Adam's two moments and may skip a unit on a rank, is refused for these optimizers at wrap.)

torch's CPU sqrt (MKL) is not correctly rounded, and may round a slice of a tensor otherwise
than the whole: an optimizer that takes a square root equals plain PyTorch to the last bit
where sqrt is correctly rounded (tests/support.correctly_rounded_sqrt), as Adam's tests say.

The runner is a shallow copy of the user's optimizer (its attributes, without its hooks or
an LR scheduler's patch of ``step``) whose class ``step`` is called unwrapped under
``torch.no_grad()`` with one param group: a copy of the parameter's group (the hyperparameters
of the step, so LR schedulers and ``param_groups`` edits work) with ``foreach=False`` and
``fused=False`` where the group has those keys (torch's single-tensor path, what plain PyTorch
runs on CPU tensors by default).
"""
from __future__ import annotations

import inspect
from collections import OrderedDict, defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = ["ElementwiseRule", "MAX_STATE_SLOTS", "NotElementwise", "ParamStep", "probe", "scalars_to_json", "step_from_json"]

# At most two fp32 slots per element, Adam's exp_avg and exp_avg_sq: the staging slots, the
# sharded update buffers and the checkpoint format have room for two.
MAX_STATE_SLOTS = 2

_PROBE_SHAPE = (2, 3)
_PROBE_SPLIT = 2  # the probe's slices: elements [0, 2) and [2, 6)


class ParamStep(int):
    """A parameter's step count (an int, as Adam's steps are) and the scalar state of an
    elementwise optimizer after that step ([Note: elementwise optimizers]).

    ``scalars``: name -> value (a cloned 0-dim tensor or a Python number); None while the
    optimizer holds no state for the parameter (torch's empty ``state[p]``) or, with
    ``pending``, until ``ElementwiseRule.settle`` has run. ``before``: the scalars
    this step starts from (None: from an empty state)."""

    scalars: Optional[Dict[str, Any]]
    before: Optional[Dict[str, Any]]
    pending: bool

    def __new__(cls, count: int, scalars: Optional[Dict[str, Any]] = None,
                before: Optional[Dict[str, Any]] = None, pending: bool = False) -> "ParamStep":
        step = super().__new__(cls, count)
        step.scalars, step.before, step.pending = scalars, before, pending
        return step

    @staticmethod
    def after(previous: int) -> "ParamStep":
        """The step after ``previous``, its scalars not settled yet."""
        if isinstance(previous, ParamStep):
            assert not previous.pending, "a step whose scalars were never settled"
            before = previous.scalars
        else:  # a count without scalars: a parameter the optimizer holds no state for
            assert previous == 0, f"step {previous} without the optimizer's scalar state"
            before = None
        return ParamStep(int(previous) + 1, before=before, pending=True)


def _clone_scalars(scalars: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    return {} if scalars is None else {k: v.clone() if isinstance(v, torch.Tensor) else v
                                       for k, v in scalars.items()}


def _runner_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer``: its class and attributes, no hooks, no instance
    ``step`` (an LR scheduler patches one in to count calls)."""
    runner = object.__new__(type(optimizer))
    for key, value in vars(optimizer).items():
        if key == "step":
            continue
        runner.__dict__[key] = OrderedDict() if key.startswith("_optimizer_") and isinstance(value, dict) else value
    runner.param_groups, runner.state = [], defaultdict(dict)
    return runner


def _runner_over(optimizer: torch.optim.Optimizer, group: Dict[str, Any], param: torch.Tensor) -> torch.optim.Optimizer:
    """A runner (``_runner_of``) with one param group: a copy of ``group``'s settings over
    ``param`` alone, on torch's single-tensor path (``foreach``/``fused`` False where the
    group has those keys)."""
    runner = _runner_of(optimizer)
    g = {k: v for k, v in group.items() if k != "params"}
    for key in ("foreach", "fused"):
        if key in g:
            g[key] = False
    g["params"] = [param]
    runner.param_groups = [g]
    return runner


class NotElementwise(ValueError):
    """The probe's refusal of an optimizer whose step is not elementwise or whose state is
    not per-element tensors and scalars: wrap then probes it as a whole-parameter optimizer
    ([Note: whole-parameter optimizers] in optim/whole.py)."""


class ElementwiseRule:
    """Steps ranges of flat fp32 buffers with an elementwise optimizer's own ``step()``.
    ``slots``: the per-element state names, slot i stored where Adam keeps its i-th moment;
    ``group_slots[g]``: the names group g's parameters have; ``scalar_names``: the rest."""

    whole = False  # WholeRule: steps whole parameters only

    def __init__(self, optimizer: torch.optim.Optimizer, slots: Tuple[str, ...],
                 group_slots: List[Tuple[str, ...]], scalar_names: Tuple[str, ...]) -> None:
        self.name = type(optimizer).__name__
        self.optimizer_type = type(optimizer)  # [Note: native elementwise kernels] routes by it
        self.slots = slots
        self.group_slots = group_slots
        self.scalar_names = scalar_names
        self._optimizer = optimizer
        self._step = inspect.unwrap(type(optimizer).step)

    def layout(self) -> Dict[str, Any]:
        """What a checkpoint records so that a load into another optimizer is refused."""
        return {"class": self.name, "slots": list(self.slots), "scalars": list(self.scalar_names)}

    @torch.no_grad()
    def run(self, group: Dict[str, Any], before: Optional[Dict[str, Any]], param: torch.Tensor,
            grad: torch.Tensor, slot_views: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        """One step of ``param`` (a 1-D fp32 view, updated in place) with ``grad`` (fp32, its
        shape), its state's tensors the ``slot_views`` (updated in place) and its scalars a copy
        of ``before`` (None: an empty state, which the optimizer initializes). Returns the
        state's scalars after the step."""
        runner = _runner_over(self._optimizer, group, param)
        state = _clone_scalars(before)
        if before is not None:
            state.update(slot_views)
        runner.state[param] = state
        param.grad = grad
        try:
            self._step(runner)
        finally:
            param.grad = None
        state = runner.state[param]
        for name, view in slot_views.items():
            value = state.get(name)
            if value is None:
                raise RuntimeError(f"{self.name}.step() left no state {name!r}, which the probe at wrap found")
            if value is not view:  # the optimizer made a new tensor (or initialized its state)
                view.copy_(value)
        return {k: v for k, v in state.items() if k not in slot_views}

    def settle(self, step: "ParamStep", group_index: int, group: Dict[str, Any]) -> None:
        """Fill the scalars of ``step`` (pending; a parameter of this optimizer's param group
        ``group_index``, whose hyperparameters are ``group``) by stepping an empty slice from
        its ``before``."""
        empty = {name: torch.empty(0, dtype=torch.float32) for name in self.group_slots[group_index]}
        scalars = self.run(group, step.before, torch.empty(0, dtype=torch.float32),
                           torch.empty(0, dtype=torch.float32), empty)
        step.scalars, step.pending = _clone_scalars(scalars), False

    def step_range(self, group_index: int, group: Dict[str, Any], step: int, param: torch.Tensor,
                   grad: torch.Tensor, slot_views: Sequence[torch.Tensor]) -> None:
        """Elements of one parameter: ``param`` and the slots' views over them, ``step`` the
        settled ParamStep of this update (its ``before`` scalars are the start)."""
        assert isinstance(step, ParamStep) and not step.pending, "settle runs first"
        views = {name: slot_views[self.slots.index(name)] for name in self.group_slots[group_index]}
        self.run(group, step.before, param, grad, views)

    def carried_state(self, params: Iterable[Tuple[str, torch.nn.Parameter]]
                      ) -> Dict[torch.nn.Parameter, Tuple[ParamStep, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """What the optimizer holds for each of ``params`` (Adagrad creates its state in its
        constructor; an optimizer that has taken steps holds its moments): (ParamStep, slot 0,
        slot 1), a slot None where unused; parameters without state are left out. The step
        count is the state's ``step`` where it has one (else 0)."""
        carried = {}
        for name, p in params:
            state = self._optimizer.state.get(p)  # .get: optimizer.state is a defaultdict
            if not state:
                continue
            slots: List[Optional[torch.Tensor]] = [None] * MAX_STATE_SLOTS
            scalars = {}
            for key, value in state.items():
                if key in self.slots and isinstance(value, torch.Tensor) and value.shape == p.shape:
                    slots[self.slots.index(key)] = value
                elif self._carries(key, value):
                    scalars[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
                else:
                    raise ValueError(f"optimizer: the state {key!r} of parameter {name!r} is not what "
                                     f"{self.name} keeps ({self.layout()}); wrap a fresh optimizer")
            step = scalars.get("step", 0)
            step = float(step)
            if step < 0 or step != int(step):
                raise ValueError(f"optimizer: state[{name!r}]['step'] must be a non-negative whole number, got {step}")
            carried[p] = (ParamStep(int(step), scalars=scalars), slots[0], slots[1])
        return carried


    def _carries(self, key: str, value: Any) -> bool:
        """Whether ``value`` of state ``key`` rides on the ParamStep (not a slot)."""
        return key in self.scalar_names and _is_scalar(value)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, (int, float, bool))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True))


def _refuse(optimizer: torch.optim.Optimizer, why: str, error: type = ValueError) -> ValueError:
    return error(f"optimizer: {type(optimizer).__name__} cannot be offloaded: {why}")


def probe(optimizer: torch.optim.Optimizer) -> ElementwiseRule:
    """The ElementwiseRule of ``optimizer``, learned by stepping copies of it on a dummy
    parameter ([Note: elementwise optimizers]); the user's optimizer is not touched. A
    ValueError naming the class when it needs a closure (LBFGS), sparse gradients
    (SparseAdam), keeps state that is neither per-element float32 tensors nor scalars, is
    not elementwise, or keeps more than MAX_STATE_SLOTS tensors per parameter."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise _refuse(optimizer, "its step() needs a closure that re-evaluates the model, which an "
                      "offloaded step (a unit at a time) cannot call")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise _refuse(optimizer, "it needs sparse gradients; the engine's gradients are dense flat buffers")
    for state in optimizer.state.values():
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in state.values()):
            # Adagrad makes its state in its constructor: over a meta model that state has no
            # values for wrap to carry into the homes
            raise _refuse(optimizer, "it holds state on the meta device (made in its constructor over the "
                          "meta model's parameters), which has no values to carry over; build the model "
                          "on the CPU for this optimizer")
    slots: List[str] = []
    group_slots: List[Tuple[str, ...]] = []
    scalar_names: List[str] = []
    for gi, group in enumerate(optimizer.param_groups):
        names, scalars = _probe_group(optimizer, gi, group)
        group_slots.append(names)
        slots += [n for n in names if n not in slots]
        scalar_names += [n for n in scalars if n not in scalar_names]
    if len(slots) > MAX_STATE_SLOTS:
        raise _refuse(optimizer, f"it keeps {len(slots)} tensors per parameter ({', '.join(slots)}); the state "
                      f"homes hold at most {MAX_STATE_SLOTS} per element")
    return ElementwiseRule(optimizer, tuple(slots), group_slots, tuple(scalar_names))


def _initial_state(optimizer: torch.optim.Optimizer, group: Dict[str, Any], shape: Tuple[int, ...]
                   ) -> Optional[Dict[str, Any]]:
    """A state for a dummy parameter of ``shape`` shaped like the state the optimizer already
    holds for a parameter of ``group`` (Adagrad's, made in its constructor), or None."""
    numel = 1
    for d in shape:
        numel *= d
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state and p.numel() > 0:
            dummy = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                    flat = value.detach().reshape(-1)
                    dummy[key] = flat.repeat((numel + flat.numel() - 1) // flat.numel())[:numel].reshape(shape).clone()
                elif isinstance(value, torch.Tensor):
                    dummy[key] = value.detach().clone()
                else:
                    dummy[key] = value
            return dummy
    return None


def _probe_group(optimizer: torch.optim.Optimizer, gi: int, group: Dict[str, Any]
                 ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(slot names, scalar names) of group ``gi``, after checking that two steps of a whole
    dummy parameter equal two steps of its two slices bit for bit."""
    gen = torch.Generator().manual_seed(1234)
    start = torch.randn(_PROBE_SHAPE, generator=gen)
    grads = [torch.randn(_PROBE_SHAPE, generator=gen) for _ in range(2)]
    initial = _initial_state(optimizer, group, _PROBE_SHAPE)
    whole = start.clone()
    runner = _runner_over(optimizer, group, whole)
    if initial is not None:
        runner.state[whole] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in initial.items()}
    try:
        with torch.no_grad():
            for grad in grads:
                whole.grad = grad.clone()
                inspect.unwrap(type(optimizer).step)(runner)
    except Exception as e:  # what the optimizer raises on a plain fp32 parameter
        raise _refuse(optimizer, f"its step() failed on a float32 parameter of shape {_PROBE_SHAPE} "
                      f"(param_groups[{gi}]): {type(e).__name__}: {e}") from e
    state = runner.state[whole]
    slots, scalars = [], []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == whole.shape and value.dtype == torch.float32:
            slots.append(key)
        elif _is_scalar(value):
            scalars.append(key)
        else:
            what = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise _refuse(optimizer, f"its state {key!r} is {what} for a float32 parameter of shape {_PROBE_SHAPE}; "
                          "only float32 tensors shaped like the parameter and scalars can live in the offloaded "
                          "state homes", NotElementwise)
    # The same two steps on two 1-D slices, through the engine's own runner.
    rule = ElementwiseRule(optimizer, tuple(slots), [tuple(slots)] * (gi + 1), tuple(scalars))
    flat = start.clone().reshape(-1)
    slot_flat = {}
    for name in slots:
        init = initial.get(name) if initial is not None else None
        slot_flat[name] = init.clone().reshape(-1) if init is not None else torch.zeros(flat.numel())
    try:
        for lo, hi in ((0, _PROBE_SPLIT), (_PROBE_SPLIT, flat.numel())):
            if initial is None:
                before = None
            else:
                before = {k: v for k, v in initial.items() if k not in slots}
            for grad in grads:
                views = {name: slot_flat[name][lo:hi] for name in slots}
                after = rule.run(group, before, flat[lo:hi], grad.reshape(-1)[lo:hi].clone(), views)
                before = after
    except Exception as e:
        raise _refuse(optimizer, f"its step() failed on a slice of a parameter (param_groups[{gi}]), so it is not "
                      f"elementwise: {type(e).__name__}: {e}", NotElementwise) from e
    # Close, not equal: torch's CPU sqrt (MKL) is not correctly rounded and may round a
    # 2-element slice otherwise than the same elements of a 6-element tensor; an optimizer
    # that is not elementwise (Muon, a norm over the parameter) is off by far more.
    same = _close(flat, whole.reshape(-1)) and all(_close(slot_flat[name], state[name].reshape(-1)) for name in slots)
    if not same:
        raise _refuse(optimizer, f"it is not elementwise (param_groups[{gi}]): stepping a parameter in two slices "
                      "gives other numbers than stepping it whole, and the offloaded step updates slices of "
                      "units", NotElementwise)
    return tuple(slots), tuple(scalars)


def scalars_to_json(step: int) -> Optional[Dict[str, List[Any]]]:
    """A checkpoint's record of ``step``'s scalars: name -> [dtype ("python" for a Python
    number), value]; None where there are none to keep (Adam's plain counts, an empty state).
    A float32 or float64 value is exact in JSON (Python's repr of a double round-trips)."""
    if not isinstance(step, ParamStep) or step.scalars is None:
        return None
    assert not step.pending, "a checkpoint is taken between steps"
    out = {}
    for name, value in step.scalars.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:  # [Note: whole-parameter optimizers] side state
            out[name] = [str(value.dtype).replace("torch.", ""), list(value.shape), value.reshape(-1).tolist()]
        elif isinstance(value, torch.Tensor):
            out[name] = [str(value.dtype).replace("torch.", ""), value.item()]
        else:
            out[name] = ["python", value]
    return out


def step_from_json(count: int, scalars: Optional[Dict[str, List[Any]]]) -> int:
    """The inverse of scalars_to_json: a ParamStep with its scalars, or ``count`` as is."""
    if scalars is None:
        return count
    restored = {}
    for name, record in scalars.items():
        if len(record) == 3:  # a side-state tensor: [dtype, shape, values]
            dtype, shape, values = record
            restored[name] = torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
            continue
        dtype, value = record
        restored[name] = value if dtype == "python" else torch.tensor(value, dtype=getattr(torch, dtype))
    return ParamStep(count, scalars=restored)
