"""A wrapped model whose parameters hold their real values between passes.

[Note: restored parameters] ``engine.restore_model()`` makes every parameter hold a copy
of its current value (the fp32 master where one exists, as ``engine.state_dict()``) in its
dtype from before wrap, on the CPU: between steps the model reads as a plain model
(``p.item()``, ``p.dtype``, code that walks the parameters), instead of placeholders
([Note: released parameters]) or compute copies. The copies cost the model's size in host
memory, so the engine checks that they fit first. They are a view for reading, not the
weights: the engine's tiers keep the values, and the next forward, ``gathered()``,
``load_state_dict()`` or ``load_checkpoint()`` ends the restore
(``RestoredParameters.end``): each parameter still holding its copy is pointed back at
what the engine gave it (its slot or placeholder) and its copy is compared, bit for bit,
with the engine's value; one that differs was written while restored, and that write
cannot reach the tiers: a RuntimeError names it, as a write into a placeholder is named
(``ReleasedParameters.check_unwritten``). A parameter whose ``.data`` was replaced keeps
what it got, for ``DeviceResidency._point_back_replaced`` to find.

[Note: the model after close] ``Engine.close()`` restores for good: after the last step's
updates have finished and before the tiers close it copies every value out (as above, a
unit at a time; a parameter holding a restored copy keeps it, written or not, as a plain
model keeps an edit), and once the hooks are removed each parameter gets its copy as its own
``.data``: the model is a plain model again, on the CPU, in its dtypes from before wrap,
with the trained values (bit for bit ``engine.state_dict()``'s, cast to those dtypes), and
``FailureState.let_go`` lets it be wrapped again (a new engine, a second OffloadTrainer),
which then trains as a model loaded with those values would. Not where compute copies
lived on NVMe and no restore is on (a model offloaded beyond RAM is not read whole into RAM
at close: a user who wants it calls ``engine.restore_model()`` first), nor where the values
would not fit in host memory, within host_budget (a warning says so and names
``engine.save_pretrained``), nor after
the engine failed, a failed last step or with several ranks at ZeRO stage >= 1 (each holds
a part; at stage 0 each rank holds and copies its own whole replica): then the
parameters keep what the engine gave them, and ``FailureState.check_not_wrapped`` refuses
a new wrap, naming the reason (``FailureState.not_restored``) and the way out. A model
whose engine is live is refused too, naming ``close()``: two engines would each hold
their own copy of its values.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.memory import layout as memory_layout
from offload.memory.layout import DEFAULT_HOST_FRACTION, UnitState
from offload.memory.released import ReleasedParameters
from offload.units import ParamEntry

__all__ = ["RestoredParameters", "copies_too_big", "model_copies", "same_bits"]


def copies_too_big(units: List[UnitState], released: ReleasedParameters, host_budget: Optional[int]) -> Optional[str]:
    """Why the model's values in their dtypes from before wrap would not fit in host
    memory now: over ``host_budget`` (the RAM the run may take: a model offloaded because
    it is larger is not copied whole into RAM at close) or over 3/4 of what is available
    now; None when they fit."""
    entries = {e.param: e for u in units for e in u.spec.entries}
    needed = sum(e.numel * released.dtype_before_wrap(e).itemsize for e in entries.values())
    if host_budget is not None and needed > host_budget:
        return f"the model's values take {needed} bytes, more than host_budget ({host_budget} bytes)"
    available = memory_layout.available_memory_bytes()  # read now: tests patch it
    if available is not None and needed > DEFAULT_HOST_FRACTION * available:
        return (f"the model's values take {needed} bytes, more than {DEFAULT_HOST_FRACTION:g} of the memory "
                f"available now ({available} bytes)")
    return None


def model_copies(units: List[UnitState], released: ReleasedParameters,
                 values: Callable[[UnitState], Dict[int, torch.Tensor]],
                 copies: Optional[Dict[nn.Parameter, torch.Tensor]] = None) -> Dict[nn.Parameter, torch.Tensor]:
    """Every parameter's current value (``values``: a unit's), copied to the CPU in its
    dtype from before wrap; a unit at a time. ``copies``: those there are already."""
    copies = {} if copies is None else copies
    for u in units:
        if all(e.param in copies for e in u.spec.entries):
            continue
        unit_values = values(u)
        for e in u.spec.entries:
            if e.param not in copies:
                copies[e.param] = unit_values[e.offset].to("cpu", released.dtype_before_wrap(e), copy=True)
    return copies


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (NaN equal to itself, -0.0 not to 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class RestoredParameters:
    """The copies the parameters hold while the model is restored. Main thread only."""

    def __init__(self) -> None:
        self._copies: Dict[nn.Parameter, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return bool(self._copies)

    def restore(self, copies: Dict[nn.Parameter, torch.Tensor]) -> None:
        """Each parameter of ``copies`` holds its copy from now on."""
        for p, value in copies.items():
            p.data = value
        self._copies = copies

    def take_held(self) -> Dict[nn.Parameter, torch.Tensor]:
        """End the restore for close(): the copies that parameters still hold, as they are
        (written or not), for the parameters to keep ([Note: the model after close])."""
        copies, self._copies = self._copies, {}
        return {p: copy for p, copy in copies.items() if p.data_ptr() == copy.data_ptr()}

    def end(self, units: List[UnitState], values: Optional[Callable[[UnitState], Dict[int, torch.Tensor]]],
            point_back: Callable[[UnitState, ParamEntry], None]) -> List[str]:
        """End the restore: every parameter still holding its copy gets ``point_back(u, e)``;
        returns the names of those whose copy differs from the engine's value (``values(u)``,
        Homes.unit_values), which were written while restored (none looked for when
        ``values`` is None: the caller replaces every value)."""
        copies, self._copies = self._copies, {}
        written: List[str] = []
        for u in units:
            held: List[Tuple[ParamEntry, torch.Tensor]] = [
                (e, copies[e.param]) for e in u.spec.entries
                if e.param in copies and e.param.data_ptr() == copies[e.param].data_ptr()]
            if not held:
                continue
            current = values(u) if values is not None else None
            for e, copy in held:
                if current is not None and not same_bits(current[e.offset].to(copy.dtype), copy):
                    written.append(e.fqn)
                point_back(u, e)
        return written
