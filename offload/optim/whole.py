"""Optimizers whose step needs each parameter whole (torch.optim.Muon's Newton-Schulz on a
matrix, torch.optim.Adafactor's factored second moments), run by their own ``step()`` on
whole parameters.

[Note: whole-parameter optimizers]
An optimizer that is not elementwise ([Note: elementwise optimizers]: the probe's slices
differ from the whole, or it keeps tensors not shaped like the parameter) is probed as a
whole-parameter optimizer: two steps on a dummy parameter of each dimensionality its groups
hold, which learn its state's layout per dimensionality:
- slots: float32 tensors shaped like the parameter (Muon's momentum_buffer, Adafactor's
  ``variance`` of a 1-D parameter) live in the unit's moments home as elementwise slots do;
- side state: every other tensor (Adafactor's row_var and col_var of a matrix: rows + cols
  numbers) and the scalars ride on the parameter's ParamStep, as elementwise scalars do:
  host RAM, per parameter, cloned for each step (so an update that is taken back, a
  speculative one, leaves them as they were), committed with the step counts and saved in
  checkpoints (``optimizer_scalars``, a tensor as [dtype, shape, values]).
Such a parameter is stepped once per update, whole: every unit that holds one is updated as
one piece (``UnitAdam.pieces``; the staging slots are sized for the largest such unit,
``UnitSizes.whole_step``, and the host budget counts them), and ``step_whole`` runs the
optimizer on views of the parameter's own shape, its scalars and side state settled by that
step itself (no empty-slice settle). wrap refuses them with ZeRO stages >= 1 (the sharded
step cuts units into shards) and with ``delayed_update`` (its spare homes are not wired to
the side state).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from offload.optim.generic import MAX_STATE_SLOTS, ElementwiseRule, NotElementwise, probe, ParamStep, _clone_scalars, _is_scalar, _refuse, _runner_over

__all__ = ["WholeRule", "probe_rule", "probe_whole"]

_PROBE_SHAPES = {1: (6,), 2: (4, 3), 3: (2, 4, 3)}


class WholeRule(ElementwiseRule):
    """Steps whole parameters with the optimizer's own ``step()``. ``slots`` as
    ElementwiseRule's; ``group_slots[g]``: dimensionality -> the slot names group g's
    parameters of that dimensionality have; ``side_names``: the tensors kept per parameter
    beside the scalars."""

    whole = True

    def __init__(self, optimizer: torch.optim.Optimizer, slots: Tuple[str, ...],
                 group_slots: List[Dict[int, Tuple[str, ...]]], scalar_names: Tuple[str, ...],
                 side_names: Tuple[str, ...]) -> None:
        super().__init__(optimizer, slots, group_slots, scalar_names)  # type: ignore[arg-type]
        self.side_names = side_names

    def layout(self) -> Dict[str, Any]:
        return dict(super().layout(), side=list(self.side_names), whole=True)

    def settle(self, step: ParamStep, group_index: int, group: Dict[str, Any]) -> None:
        raise AssertionError("a whole-parameter step settles its scalars itself (step_whole)")

    def step_whole(self, group_index: int, group: Dict[str, Any], step: ParamStep, shape: torch.Size,
                   param: torch.Tensor, grad: torch.Tensor, slot_views: Sequence[Optional[torch.Tensor]]) -> None:
        """One step of a whole parameter: ``param`` and the slots' views are its elements (1-D,
        viewed here in ``shape``), ``step`` the pending ParamStep of this update, whose scalars
        and side state it sets."""
        assert isinstance(step, ParamStep) and step.pending, "a whole parameter is stepped once per update"
        names = self.group_slots[group_index][len(shape)]
        views = {name: slot_views[self.slots.index(name)].view(shape) for name in names}
        after = self.run(group, step.before, param.view(shape), grad.view(shape), views)
        step.scalars, step.pending = _clone_scalars(after), False

    def _carries(self, key: str, value: Any) -> bool:
        return (key in self.scalar_names and _is_scalar(value)) or (
            key in self.side_names and isinstance(value, torch.Tensor))


def probe_rule(optimizer: torch.optim.Optimizer) -> ElementwiseRule:
    """The rule of an optimizer other than Adam: elementwise where it is ([Note: elementwise
    optimizers]), else one that steps whole parameters. A ValueError naming the class when
    neither can run it; the user's optimizer is not touched."""
    try:
        return probe(optimizer)
    except NotElementwise:
        return probe_whole(optimizer)


def probe_whole(optimizer: torch.optim.Optimizer) -> WholeRule:
    """The WholeRule of ``optimizer``, learned by stepping copies of it on dummy parameters
    of every dimensionality its groups hold; the user's optimizer is not touched. A
    ValueError naming the class when its step fails there, it keeps state other than
    tensors and scalars, or more than MAX_STATE_SLOTS per-element tensors."""
    slots: List[str] = []
    scalars: List[str] = []
    side: List[str] = []
    group_slots: List[Dict[int, Tuple[str, ...]]] = []
    for gi, group in enumerate(optimizer.param_groups):
        by_dim: Dict[int, Tuple[str, ...]] = {}
        for ndim in sorted({p.dim() for p in group["params"]}):
            if ndim not in _PROBE_SHAPES:
                raise _refuse(optimizer, f"param_groups[{gi}] holds a {ndim}-D parameter; a whole-parameter "
                              f"optimizer is offloaded for 1-D to 3-D parameters")
            shape = _PROBE_SHAPES[ndim]
            gen = torch.Generator().manual_seed(1234)
            param = torch.randn(shape, generator=gen)
            runner = _runner_over(optimizer, group, param)
            try:
                with torch.no_grad():
                    for _ in range(2):
                        param.grad = torch.randn(shape, generator=gen)
                        inspect.unwrap(type(optimizer).step)(runner)
            except Exception as e:
                raise _refuse(optimizer, f"its step() failed on a float32 parameter of shape {shape} "
                              f"(param_groups[{gi}]): {type(e).__name__}: {e}") from e
            names = []
            for key, value in runner.state[param].items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == torch.float32:
                    names.append(key)
                    slots += [key] if key not in slots else []
                elif _is_scalar(value):
                    scalars += [key] if key not in scalars else []
                elif isinstance(value, torch.Tensor):
                    side += [key] if key not in side else []
                else:
                    raise _refuse(optimizer, f"its state {key!r} is {type(value).__name__}; only tensors and "
                                  "scalars can be kept for an offloaded parameter")
            by_dim[ndim] = tuple(names)
        group_slots.append(by_dim)
    if len(slots) > MAX_STATE_SLOTS:
        raise _refuse(optimizer, f"it keeps {len(slots)} tensors per parameter ({', '.join(slots)}); the state "
                      f"homes hold at most {MAX_STATE_SLOTS} per element")
    return WholeRule(optimizer, tuple(slots), group_slots, tuple(scalars), tuple(side))
