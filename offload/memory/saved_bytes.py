"""What of a saved tensor leaves the device, as bytes ([Note: saved activations] in
memory/activations.py): which tensors may leave (``movable``), the storage bytes each reaches
(``reach``), the spans that views with gaps leave in (``view_spans``, ``Span``) and where
spans lie in a group's host buffer (``buffer_layout``). Pure functions of tensors' sizes,
strides and storages, shared by ``ActivationStore`` and ``offload plan``'s trace
(offload/plan_activations.py), so that the two decide alike."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Sequence, Tuple

import torch

__all__ = ["Span", "buffer_layout", "dense", "movable", "reach", "same_reading", "view_spans",
           "ACTIVATION_MIN_BYTES", "PAGE_BYTES"]

# Saved tensors below this stay on the device: a page, less than what a record and a copy cost.
ACTIVATION_MIN_BYTES = 4096
# Each tensor's offset in its group's host buffer is a multiple of this (any dtype's alignment).
_TENSOR_ALIGN_BYTES = 64
# A group's host buffer and swap extent are whole pages (O_DIRECT), and so is each piece.
PAGE_BYTES = 4096


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def buffer_layout(sizes: List[int]) -> Tuple[List[int], int]:
    """Where tensors of ``sizes`` bytes lie in their group's host buffer, and its bytes."""
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset = _round_up(offset + size, _TENSOR_ALIGN_BYTES)
    return offsets, _round_up(offset, PAGE_BYTES)


def movable(t: torch.Tensor, plain_type: type = torch.Tensor) -> bool:
    """[Note: saved activations] Whether a saved tensor may leave the device (the rest stay;
    one that is not dense leaves only within a span, ``view_spans``). ``plain_type``: what a
    tensor that is no subclass is (offload plan's trace: FakeTensor)."""
    return (type(t) is plain_type and t.layout == torch.strided and not t.is_conj() and not t.is_neg()
            and t.numel() * t.element_size() >= ACTIVATION_MIN_BYTES)


def reach(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes [lo, hi) of its storage that ``t``'s elements lie in (strides are never negative)."""
    size = t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (last + 1) * size


def view_spans(views: Sequence[Tuple[Any, torch.dtype, int, int, int]]) -> List[Tuple[List[int], int, int]]:
    """[Note: saved activations] Which saved tensors that are not dense leave, and as what:
    ``views`` are (storage key, dtype, lo, hi, bytes) of each, [lo, hi) the storage bytes it
    reaches. Those of one storage and dtype leave together as one span, [least lo, most hi),
    where the span holds no more bytes than they do (their elements cover it: q, k and v of
    one fused projection); (indices into ``views``, lo, hi) of each such span. The others stay
    (their span holds bytes no saved view reads: one view of a larger storage)."""
    by_storage: Dict[Tuple[Any, torch.dtype], List[int]] = {}
    for i, (key, dtype, _, _, _) in enumerate(views):
        by_storage.setdefault((key, dtype), []).append(i)
    spans = []
    for indices in by_storage.values():
        lo, hi = min(views[i][2] for i in indices), max(views[i][3] for i in indices)
        if hi - lo <= sum(views[i][4] for i in indices):
            spans.append((indices, lo, hi))
    return spans


def same_reading(a: torch.Tensor, b: torch.Tensor) -> bool:
    """[Note: saved activations] Whether two tensors over the same bytes (storage, offset,
    shape, strides, dtype) read the same values: of one type, dense strided and not
    quantized (no scale of their own), neither a lazy conjugate or negation the other is not."""
    return (type(a) is type(b) and a.layout == b.layout == torch.strided and not a.is_quantized
            and not b.is_quantized and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg())


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill [storage_offset, storage_offset + numel) exactly."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class Span:
    """[Note: saved activations] Storage bytes [lo, hi) that left the device together, at
    ``offset`` in the group's host buffer and extent: one dense saved tensor's, or those of
    the views with gaps of one storage (``view_spans``). Its records come back as views of
    one fresh storage of these bytes, with their own shapes, strides and offsets in it."""

    __slots__ = ("records", "dtype", "lo", "hi", "offset")

    def __init__(self, records: List["Any"], lo: int, hi: int) -> None:
        self.records = [weakref.ref(r) for r in records]
        self.dtype = records[0].dtype
        self.lo, self.hi = lo, hi
        self.offset = 0

    @property
    def num_bytes(self) -> int:
        return self.hi - self.lo

    def away(self) -> List["Any"]:
        return [r for r in (ref() for ref in self.records) if r is not None and r.tensor is None]

    def source(self, r: "Any") -> torch.Tensor:
        """The span's bytes on the device, as they lie, through its record ``r`` (still there)."""
        size = r.tensor.element_size()
        return torch.as_strided(r.tensor, (self.num_bytes // size,), (1,), self.lo // size).view(torch.uint8)

    def restore(self, flat: torch.Tensor) -> List["Any"]:
        """Its records away, each a view of ``flat`` (the span's bytes back, of its dtype)."""
        records = self.away()
        size = flat.element_size()
        for r in records:
            r.tensor = flat.as_strided(r.size, r.stride, (r.lo - self.lo) // size)  # strides included
        return records
