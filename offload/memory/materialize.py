"""Materializing: the meta stand-ins a meta-device model gets at wrap, and moving every
unit's initial state home, materializing a meta model module by module on the way.

Every change made here to what the caller holds (module parameter and buffer slots, param
groups, the parameters' storage, the CPU RNG) is logged on the wrap's ExitStack ``undo``,
which the engine's constructor owns and passes in ([Note: a failed wrap changes nothing],
offload/engine.py).

[Note: a meta model needs an initializer] A model built under ``torch.device("meta")`` has
shapes and no values: what its constructor computed (``torch.ones``, a buffer of rotary
frequencies) is gone. Its tensors get values at wrap from ``weights=`` (the files), else
from the initializers of their module: its ``reset_parameters()`` (torch's own layers
have one), then ``init_fn(module)``, or without one a transformers model's own
``_init_weights`` (so a Hugging Face model built from its config starts as ``from_config``
would have it, e.g. RMSNorm weights 1.0, which no reset_parameters gives). A meta tensor
none of them wrote must not train from whatever memory it got: a floating one is filled
with NaN before its module's initializers run, and a NaN left after them (or a tensor of
a module with no initializer at all: an integer buffer has no NaN to mark it) makes wrap a
ValueError naming the tensors and the three ways (``weights=``, ``init_fn``, building off
the meta device); the wrap then changes nothing (the Note above).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from offload.memory.layout import UnitState
from offload.memory.weights import PretrainedWeights
from offload.units import UnitSpec


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _swap_in(undo: contextlib.ExitStack, table: Dict[Any, Any], key: Any, value: Any) -> None:
    """``table[key] = value``, the old entry put back when ``undo`` unwinds ([Note: a failed
    wrap changes nothing])."""
    undo.callback(table.__setitem__, key, table[key])
    table[key] = value


def meta_stand_ins(specs: List[UnitSpec]) -> Dict[nn.Parameter, nn.Parameter]:
    """A meta tensor's storage cannot be swapped for a real one, so each meta parameter
    gets a CPU parameter with no storage yet; the unit specs refer to the stand-ins from
    here on. Returns {meta parameter: stand-in}. Nothing the caller holds changes here:
    install_stand_ins does that, once every check of wrap has passed."""
    new_of: Dict[nn.Parameter, nn.Parameter] = {}
    for spec in specs:
        for e in spec.entries:
            if e.param.is_meta:
                if e.param not in new_of:
                    new_of[e.param] = nn.Parameter(torch.empty(0, dtype=e.param.dtype),
                                                   requires_grad=e.param.requires_grad)
                e.param = new_of[e.param]
    return new_of


def install_stand_ins(model: nn.Module, optimizer: torch.optim.Optimizer,
                      new_of: Dict[nn.Parameter, nn.Parameter], undo: contextlib.ExitStack) -> Set[nn.Parameter]:
    """Puts the stand-ins in every module of ``model`` that holds their meta parameter (ties
    stay ties) and in ``optimizer``'s param groups, the meta parameters put back when
    ``undo`` unwinds. Returns the stand-ins (not materialized yet)."""
    if not new_of:
        return set()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p in new_of:
                _swap_in(undo, module._parameters, name, new_of[p])
    for group in optimizer.param_groups:
        _swap_in(undo, group, "params", [new_of.get(p, p) for p in group["params"]])
    return set(new_of.values())


class _MaterializeScratch:
    """[Note: materializing through reused memory] A meta model's parameters are
    materialized into one CPU buffer per unit, taken from a pool and given back once the
    unit is home (its parameters then hold placeholders: [Note: released parameters]), so a
    model of many equal blocks touches fresh pages for the root and one block, not for every
    block. Fresh pages are what wrap would pay for: the first touch of a page costs many
    times a write to a page already touched. A parameter gets no other values than with
    ``torch.empty``; without weights it is filled with NaN, which initialization overwrites
    ([Note: a meta model needs an initializer]).
    A buffer goes back to the pool only when no parameter of the unit still points into it
    (an ``init_fn`` that replaced ``.data`` is fine; one that kept a view keeps it out of
    the pool)."""

    ALIGN_BYTES = 64

    def __init__(self, units: List[UnitState], unmaterialized: Set[nn.Parameter]) -> None:
        self._offset: Dict[nn.Parameter, int] = {}
        self._need: Dict[int, int] = {}
        for u in units:
            cursor = 0
            for e in u.spec.entries:
                if e.param in unmaterialized and e.param not in self._offset:
                    self._offset[e.param] = cursor
                    nbytes = e.numel * e.param.element_size()
                    cursor += -(-nbytes // self.ALIGN_BYTES) * self.ALIGN_BYTES
            self._need[u.index] = cursor
        self._taken: Dict[int, torch.Tensor] = {}
        self._free: List[torch.Tensor] = []

    def materialize(self, p: nn.Parameter, u: UnitState, shape: torch.Size) -> torch.Tensor:
        """Storage for ``p`` (of unit ``u``) in u's buffer."""
        buffer = self._taken.get(u.index)
        if buffer is None:
            need = self._need[u.index]
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            smallest = min(fits, key=lambda i: self._free[i].numel(), default=None)
            if smallest is None:
                self._free.clear()  # none fits: idle ones would only add to wrap's peak
                buffer = torch.empty(need, dtype=torch.uint8)
            else:
                buffer = self._free.pop(smallest)
            self._taken[u.index] = buffer
        start = self._offset[p]
        nbytes = shape.numel() * p.element_size()
        return buffer[start:start + nbytes].view(p.dtype).view(shape)

    def unit_home(self, u: UnitState) -> None:
        """u is written home: its buffer may serve the next unit."""
        buffer = self._taken.pop(u.index, None)
        if buffer is None:
            return
        lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        if all(not lo <= e.param.data_ptr() < hi for e in u.spec.entries):
            self._free.append(buffer)


def _unwritten(t: torch.Tensor) -> torch.Tensor:
    """[Note: a meta model needs an initializer] ``t`` filled with NaN where it is floating
    point (where it is not, nothing can mark it): what no initializer wrote stays NaN."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


def _has_nan(t: torch.Tensor, chunk_numel: int = 1 << 20) -> bool:
    """Whether ``t`` holds a NaN, looked for a chunk at a time (a meta model is materialized
    so as not to hold a second copy of a unit: no mask of the whole tensor either)."""
    flat = t.detach().reshape(-1)
    return any(bool(torch.isnan(flat[i:i + chunk_numel]).any()) for i in range(0, flat.numel(), chunk_numel))


def _check_initialized(module: nn.Module, prefix: str, tensors: List[Tuple[str, torch.Tensor]],
                       initializer: bool) -> None:
    """[Note: a meta model needs an initializer] A ValueError naming the meta tensors of
    ``module`` (after its initializers ran) that hold no values: NaN left where one was
    floating point, or no initializer at all. ``tensors``: (name, the tensor as made here);
    a parameter whose ``.data`` an initializer replaced is read where the module holds it."""
    held = {**{_qualified(prefix, n): p for n, p in module._parameters.items() if p is not None},
            **{_qualified(prefix, n): b for n, b in module._buffers.items() if b is not None}}
    empty = []
    for name, made in tensors:
        now = held.get(name, made)
        if not initializer or (now.is_floating_point() and _has_nan(now)):
            empty.append(name)
    if empty:
        raise ValueError(
            f"wrap: the model was built on the meta device, and nothing gave {', '.join(empty[:4])}"
            f"{f' (and {len(empty) - 4} more)' if len(empty) > 4 else ''} its values: neither a "
            f"reset_parameters() of its module ({type(module).__name__}) nor an init_fn (or a transformers model's "
            "_init_weights) wrote them. Give the values with wrap(..., weights=PATH) (a Hugging "
            "Face model directory or .safetensors file; OffloadTrainer(..., weights=PATH)), initialize them "
            "with wrap(..., init_fn=fn) (fn(module) is called on every module once its tensors exist), or "
            "build the model off the meta device")


def move_to_homes(model: nn.Module, units: List[UnitState], unmaterialized: Set[nn.Parameter],
                  device: torch.device, init_fn: Optional[Callable[[nn.Module], None]],
                  write_home: Callable[[UnitState], None], undo: contextlib.ExitStack,
                  weights: Optional[PretrainedWeights] = None) -> None:
    """Copy each unit's parameters into its home buffers (``write_home(u)``:
    Homes.write_initial_state) and free the originals; buffers go to ``device``. A
    meta-device model (its stand-ins in ``unmaterialized``, emptied here) is materialized
    module by module in model order (so initial values follow the same RNG sequence as an
    eager build), each unit written home as soon as all its parameters exist: the whole
    model never has to be in RAM. With ``weights``, each parameter (and each buffer the
    files hold) takes its values from them instead ([Note: weights into the tiers] in
    memory/weights.py). What this changes in the model is put back when ``undo`` unwinds
    ([Note: a failed wrap changes nothing])."""
    unit_of: Dict[nn.Parameter, UnitState] = {}
    for u in units:
        for e in u.spec.entries:
            unit_of[e.param] = u
    for p in unit_of:
        if p not in unmaterialized:
            undo.callback(setattr, p, "data", p.data)
    if unmaterialized:  # reset_parameters and init_fn draw from it
        undo.callback(torch.set_rng_state, torch.get_rng_state())
    missing = {u.index: len(u.spec.entries) for u in units}
    done: set = set()
    scratch = _MaterializeScratch(units, unmaterialized)

    def finish(param: nn.Parameter) -> None:
        if param in done:
            return
        done.add(param)
        u = unit_of[param]
        missing[u.index] -= 1
        if missing[u.index] == 0:
            write_home(u)
            scratch.unit_home(u)

    shape_of = {e.param: e.shape for u in units for e in u.spec.entries}
    fqn_of = {e.param: e.fqn for u in units for e in u.spec.entries}
    # [Note: weights into the tiers] without an init_fn, a transformers model's own
    # initializer computes the meta tensors the files do not hold (every one without files)
    buffer_init = init_fn if init_fn is not None else getattr(model, "_init_weights", None)
    for prefix, module in model.named_modules():
        materialized = needs_init = False
        to_check: List[Tuple[str, torch.Tensor]] = []  # [Note: a meta model needs an initializer]
        for name, p in list(module._parameters.items()):
            if p is not None and p in unmaterialized:
                p.data = scratch.materialize(p, unit_of[p], shape_of[p])  # [Note: materializing through reused memory]
                unmaterialized.discard(p)
                materialized = needs_init = weights is None
                if weights is None:
                    to_check.append((_qualified(prefix, name), _unwritten(p.data)))
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                from_files = weights is not None and weights.has_buffer(_qualified(prefix, name))
                value = torch.zeros(b.shape, dtype=b.dtype, device=device)
                if not from_files:
                    to_check.append((_qualified(prefix, name), _unwritten(value)))
                _swap_in(undo, module._buffers, name, value)
                materialized = True
                needs_init = needs_init or not from_files
        if materialized and needs_init:
            with torch.no_grad():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                if buffer_init is not None:
                    buffer_init(module)
        if to_check:
            _check_initialized(module, prefix, to_check, initializer=hasattr(module, "reset_parameters")
                               or buffer_init is not None)
        if weights is not None:
            for name, p in module._parameters.items():
                if p is not None and p not in done:
                    p.data = weights.parameter(fqn_of[p], p.dtype)
            for name, b in list(module._buffers.items()):
                if b is not None and weights.has_buffer(_qualified(prefix, name)):
                    _swap_in(undo, module._buffers, name, weights.buffer(_qualified(prefix, name), b.dtype))
        for name, b in list(module._buffers.items()):
            if b is not None and b.device != device:
                _swap_in(undo, module._buffers, name, b.to(device))
        for p in module._parameters.values():
            if p is not None:
                finish(p)
    assert all(v == 0 for v in missing.values()), "every unit must have been written home"
