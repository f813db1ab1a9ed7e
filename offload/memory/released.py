"""What a parameter holds while its unit is not on the device.

[Note: released parameters] A parameter whose unit is not on the device keeps its
``nn.Parameter`` object (the user's optimizer and the gradient hooks keep working) and its
``shape``, ``dtype``, ``device``, ``numel()`` and ``requires_grad``: its ``.data`` is a
zero-stride view (``expand``) of one element of a small scratch tensor on the device, one
element per parameter, filled with NaN, one scratch tensor per dtype the parameters had
before wrap. So ``sum(p.numel() for p in model.parameters())``, a Trainer's "trainable
parameters" line and code that reads ``p.shape`` or ``p.dtype`` see the real model, as
before wrap, meta-built or not, while the values are elsewhere: read them with
``engine.state_dict()``.

While its unit is on the device a parameter holds the unit's compute copy, in the compute
dtype (``dtype='bf16'``: bfloat16 for a parameter that was float32): that is what forward
computes with. Code that asks a model for its dtype inside forward (transformers'
``model.dtype``, the first parameter's, which sizes attention masks with
``torch.finfo(dtype).min``) therefore sees the compute dtype there, as it would in a model
cast to it, since the root unit (embeddings first) is on the device from the start of
forward to the end of backward; outside a pass it sees the dtype from before wrap. A
parameter that was not floating point keeps a compute-dtype placeholder (NaN marks an
unwritten element).

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

from typing import Dict, List, Tuple

import torch

from offload.units import ParamEntry, UnitSpec

__all__ = ["ReleasedParameters"]


class ReleasedParameters:
    """The placeholders of the parameters of ``specs``, on ``device``, each in the dtype its
    parameter has now (built before wrap changes any parameter: the dtype from before wrap;
    ``dtype``, the compute dtype, for one that is not floating point). Main thread only,
    like the binding of parameters to slots."""

    def __init__(self, specs: List[UnitSpec], dtype: torch.dtype, device: torch.device) -> None:
        self._index: Dict[int, Tuple[torch.dtype, int]] = {}  # id(param) -> (scratch, element)
        self._names: Dict[torch.dtype, List[str]] = {}  # per scratch, the names by element
        for spec in specs:
            for e in spec.entries:
                if id(e.param) not in self._index:
                    own = e.param.dtype if e.param.dtype.is_floating_point else dtype
                    names = self._names.setdefault(own, [])
                    self._index[id(e.param)] = (own, len(names))
                    names.append(e.fqn)
        self._scratch = {own: torch.full((len(names),), float("nan"), dtype=own, device=device)
                         for own, names in self._names.items()}

    def release(self, e: ParamEntry) -> None:
        """Point ``e.param`` at its placeholder."""
        own, element = self._index[id(e.param)]
        e.param.data = self._scratch[own][element].expand(e.shape)

    def check_unwritten(self) -> None:
        """A RuntimeError naming the parameters written while released (the writes are
        lost; their scratch elements are reset so the next pass starts clean)."""
        names = []
        for own, scratch in self._scratch.items():
            written = ~torch.isnan(scratch)
            if bool(written.any()):
                names += [self._names[own][i] for i in written.nonzero().flatten().tolist()]
                scratch.fill_(float("nan"))
        if names:
            raise RuntimeError(
                f"parameter(s) {names} were written in place while their unit was not on the device "
                "(after offload.wrap, a parameter's values live in the engine's tiers, not in the "
                "parameter): the write was lost. Change weights before wrap, or load them with "
                "engine.load_checkpoint / wrap(..., weights=PATH); read them with engine.state_dict()")
