"""What a parameter holds while its unit is not on the device.

[Note: released parameters] A parameter whose unit is not on the device keeps its
``nn.Parameter`` object (the user's optimizer and the gradient hooks keep working) and its
``shape``, ``dtype``, ``device``, ``numel()`` and ``requires_grad``: its ``.data`` is a
zero-stride view (``expand``) of one element of a small scratch tensor on the device, one
element per parameter, filled with NaN. So ``sum(p.numel() for p in model.parameters())``,
a Trainer's "trainable parameters" line and code that reads ``p.shape`` see the real model,
as before wrap, while the values are elsewhere: read them with ``engine.state_dict()``.

Writes into a released parameter cannot reach its values, so they must not pass
silently. An in-place write into a view whose elements share one memory location raises
at once in torch ("more than one element of the written-to tensor refers to a single
memory location") for every parameter of two elements or more; ``fill_`` and ``zero_``
(which torch lets through) and any write into a one-element parameter land in the
parameter's scratch element and are found by ``check_unwritten`` at the start of the next
forward, with the parameter named. The scratch is not in the device arena, so
[Note: saved parameters] never mistakes a placeholder for a unit's slot.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from offload.units import ParamEntry, UnitSpec

__all__ = ["ReleasedParameters"]


class ReleasedParameters:
    """The placeholders of the parameters of ``specs`` (compute ``dtype`` on ``device``).
    Main thread only, like the binding of parameters to slots."""

    def __init__(self, specs: List[UnitSpec], dtype: torch.dtype, device: torch.device) -> None:
        self._index: Dict[int, int] = {}
        self._names: List[str] = []
        for spec in specs:
            for e in spec.entries:
                if id(e.param) not in self._index:
                    self._index[id(e.param)] = len(self._names)
                    self._names.append(e.fqn)
        self._scratch = torch.full((max(len(self._names), 1),), float("nan"), dtype=dtype, device=device)

    def release(self, e: ParamEntry) -> None:
        """Point ``e.param`` at its placeholder."""
        e.param.data = self._scratch[self._index[id(e.param)]].expand(e.shape)

    def check_unwritten(self) -> None:
        """A RuntimeError naming the parameters written while released (the writes are
        lost; their scratch elements are reset so the next pass starts clean)."""
        written = ~torch.isnan(self._scratch)
        if bool(written.any()):
            names = [self._names[i] for i in written.nonzero().flatten().tolist() if i < len(self._names)]
            self._scratch.fill_(float("nan"))
            raise RuntimeError(
                f"parameter(s) {names} were written in place while their unit was not on the device "
                "(after offload.wrap, a parameter's values live in the engine's tiers, not in the "
                "parameter): the write was lost. Change weights before wrap, or load them with "
                "engine.load_checkpoint / wrap(..., weights=PATH); read them with engine.state_dict()")
