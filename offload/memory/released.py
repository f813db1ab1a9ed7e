"""What a parameter holds while its unit is not on the device.

[Note: released parameters] A parameter whose unit is not on the device keeps its
``nn.Parameter`` object (the user's optimizer and the gradient hooks keep working) and its
``shape``, ``dtype``, ``device``, ``numel()`` and ``requires_grad``: its ``.data`` is a
zero-stride view (``expand``) of one element of a small scratch tensor on the device, one
element per parameter, filled with NaN, one scratch tensor per dtype the parameters had
before wrap. So ``sum(p.numel() for p in model.parameters())``, a Trainer's "trainable
parameters" line and code that reads ``p.shape`` or ``p.dtype`` see the real model, as
before wrap, meta-built or not, while the values are elsewhere: read them with
``engine.state_dict()``, or inside ``with engine.gathered(params):``, where the units
holding them are on the device ([Note: gathered parameters] in memory/residency.py).

While its unit is on the device a parameter holds the unit's compute copy, in the compute
dtype (``dtype='bf16'``: bfloat16 for a parameter that was float32): that is what forward
computes with. Code that asks a model for its dtype inside forward (transformers'
``model.dtype``, the first parameter's, which sizes attention masks with
``torch.finfo(dtype).min``) therefore sees the compute dtype there, as it would in a model
cast to it, since the root unit (embeddings first) is on the device from the start of
forward to the end of backward. Outside a pass a parameter whose unit stayed on the device
still holds its compute copy, the others their placeholders; ``engine.restore_model()``
([Note: restored parameters] in memory/restored.py; OffloadTrainer calls it after
``train()``) makes every parameter hold its value in the dtype from before wrap until the
next forward. A parameter that was not floating point keeps a compute-dtype placeholder
(NaN marks an unwritten element).

Writes into a released parameter cannot reach its values, so they must not pass
silently; the ways to change weights after wrap are ``engine.gathered(..., modify=True)``,
``engine.load_state_dict``, ``wrap(..., weights=)`` and ``load_checkpoint``. An in-place
write into a view whose elements share one memory location (``copy_``, ``mul_``,
``add_``) raises at once in torch ("more than one element of the written-to tensor refers
to a single memory location") for every parameter of two elements or more: torch checks
that before any kernel runs, and only a placeholder with memory of its own (the model's
size) or a tensor subclass on every parameter could turn it into the engine's message, so
that error stays, loud but torch's. ``fill_`` and ``zero_`` (which torch lets through) and
any write into a one-element parameter land in the parameter's scratch element; and
``p.data = t`` makes the parameter hold something else than its placeholder (or, while
its unit is on the device, its slot). ``check_unwritten`` finds both at the start of a
forward (DeviceResidency.begin_pass compares each parameter's ``data_ptr()`` with what the
engine gave it and gives it that back), a RuntimeError naming the parameters: a replaced
``.data`` at the next forward; a write into the scratch at the next forward where the host
addresses the device's memory, and on a device it does not (CUDA) at the forward after
next: the scratch is checked on the device and its answer comes back on the
device-to-host stream while a pass runs, so that no forward waits for the device
(reading it at once would hold the host until every kernel queued so far had run).
The scratch is not in the device arena, so [Note: saved parameters] never mistakes a
placeholder for a unit's slot.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from offload.tiers.host import HostTier
from offload.tiers.streams import Event, Streams
from offload.units import ParamEntry, UnitSpec

__all__ = ["ReleasedParameters"]


class ReleasedParameters:
    """The placeholders of the parameters of ``specs``, on ``device``, each in the dtype its
    parameter has now (built before wrap changes any parameter: the dtype from before wrap;
    ``dtype``, the compute dtype, for one that is not floating point). Main thread only,
    like the binding of parameters to slots. ``streams``: the device's; ``host``: the host
    tier, which holds the pinned bytes the device's answers come back into."""

    def __init__(self, specs: List[UnitSpec], dtype: torch.dtype, device: torch.device, streams: Streams,
                 host: HostTier) -> None:
        self._index: Dict[int, Tuple[torch.dtype, int]] = {}  # id(param) -> (scratch, element)
        self._dtype_before_wrap: Dict[int, torch.dtype] = {}  # id(param) -> its dtype before wrap
        self._names: Dict[torch.dtype, List[str]] = {}  # per scratch, the names by element
        for spec in specs:
            for e in spec.entries:
                if id(e.param) not in self._index:
                    self._dtype_before_wrap[id(e.param)] = e.param.dtype
                    own = e.param.dtype if e.param.dtype.is_floating_point else dtype
                    names = self._names.setdefault(own, [])
                    self._index[id(e.param)] = (own, len(names))
                    names.append(e.fqn)
        self._scratch = {own: torch.full((len(names),), float("nan"), dtype=own, device=device)
                         for own, names in self._names.items()}
        self._streams = streams
        # one byte per scratch tensor where the host does not address the device's memory
        # (a few bytes outside the planned budget, like a spilled gradient's)
        self._flags: Optional[torch.Tensor] = None if streams.host_addressable else \
            host.allocate(len(self._scratch), torch.uint8, planned=False)
        self._answer: Optional[Event] = None  # the copy of the last check's answer into _flags

    def release(self, e: ParamEntry) -> None:
        """Point ``e.param`` at its placeholder."""
        own, element = self._index[id(e.param)]
        e.param.data = self._scratch[own][element].expand(e.shape)

    def dtype_before_wrap(self, e: ParamEntry) -> torch.dtype:
        """The dtype ``e.param`` had before wrap."""
        return self._dtype_before_wrap[id(e.param)]

    def address(self, e: ParamEntry) -> int:
        """The ``data_ptr()`` of ``e.param`` while it holds its placeholder."""
        own, element = self._index[id(e.param)]
        scratch = self._scratch[own]
        return scratch.data_ptr() + element * scratch.element_size()

    def check_unwritten(self, replaced: List[str], restored_written: Sequence[str] = ()) -> None:
        """A RuntimeError naming the parameters written while released, those whose
        ``.data`` was replaced (``replaced``, their names; the caller has pointed them back)
        and those written while restored (``restored_written``, [Note: restored parameters]):
        the writes are lost. Where the host does not address the device, the writes are
        those the previous call's check found, and this call queues the next check
        ([Note: released parameters]). The scratch elements are reset so the next pass
        starts clean."""
        if self._flags is None:
            written = [bool((~torch.isnan(scratch)).any()) for scratch in self._scratch.values()]
        else:
            answer, self._answer = self._answer, None
            written = []
            if answer is not None:
                answer.synchronize()  # queued a whole pass ago: done long since
                self._streams.host_access(self._flags, write=False, what="a read of the released parameters' check")
                written = [bool(flag) for flag in self._flags.tolist()]
            if not any(written):  # the next check; a failed one starts again at the next pass
                self._answer = self._streams.copy_out(
                    self._flags, torch.stack([(~torch.isnan(s)).any() for s in self._scratch.values()]).to(torch.uint8),
                    what="the check of released parameters")
        names = []
        for (own, scratch), was_written in zip(self._scratch.items(), written):
            if was_written:
                names += [self._names[own][i] for i in (~torch.isnan(scratch)).nonzero().flatten().tolist()]
                scratch.fill_(float("nan"))
        what = []
        if names:
            what.append(f"parameter(s) {names} were written in place while their unit was not on the device")
        if replaced:
            what.append(f"parameter(s) {replaced} had their .data replaced (p.data = ...)")
        if restored_written:
            what.append(f"parameter(s) {list(restored_written)} were written while they held restored values "
                        "(engine.restore_model(), OffloadTrainer after train())")
        if what:
            raise RuntimeError(
                f"{'; '.join(what)}, after offload.wrap: the write was lost (a parameter's values live in "
                "the engine's tiers, not in the parameter). Change weights with `with engine.gathered(params, "
                "modify=True):`, engine.load_state_dict(state_dict), wrap(..., weights=PATH) or "
                "engine.load_checkpoint(DIR); read them with engine.gathered(params) or engine.state_dict()")
