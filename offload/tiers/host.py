"""The host tier: page-aligned (and, for a CUDA device, pinned) RAM under a byte budget.

[Note: host buffers outside the heap] A buffer of the tier is an anonymous mapping of its
own, not a malloc block. The tier's buffers live for the whole run, and malloc would place
the smaller ones (staging pieces of a few MiB) in its heap between activations: the heap can
only shrink from its top, so every later step's activations and gradients would grow it
around them, and that free space stays resident. A mapping is page aligned by construction
and goes back to the kernel when its tensor dies.

[Note: pinned buffers] For a device the host does not address (CUDA), the tier page-locks
each buffer where it lies (``DeviceTier.pin``: cudaHostRegister), so that copies to and from
the device run without the host, and unlocks it when the buffer is released or the tier
closes. Not through torch's pinned allocator: it rounds every request up to a power of two
and keeps freed blocks cached, so a budget of pinned buffers could hold twice its bytes
for the whole run. Buffers are pinned only when the engine's device needs it (a CPU device
pins nothing, whatever the machine has), and only the tier's own: temporary buffers (wrap,
checkpoints) stay pageable. ``pinned_bytes`` is what the tier holds locked, at its size.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any, Dict, Optional, Tuple

import torch

from offload.io.engine import HUGE_PAGE_BYTES, aligned_empty


def mapped_empty(num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor on anonymous pages of its own. From 2 MiB up these are
    ``aligned_empty``'s huge-page mappings ([Note: huge-page buffers] in offload/io/engine.py:
    swap I/O into them runs at full speed), below that a page-aligned mapping of 4 KiB pages."""
    if num_bytes >= HUGE_PAGE_BYTES:
        return aligned_empty(num_bytes, dtype)
    if num_bytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype)  # the tensor keeps the map


_PAGE_BYTES = mmap.PAGESIZE
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_libc: Any = None


def release_pages(t: torch.Tensor) -> None:
    """[Note: device pages follow the slots] Give the whole pages inside ``t`` (a
    contiguous CPU tensor on a private anonymous mapping: ``aligned_empty``'s from 2 MiB up)
    back to the kernel: they stop counting in RSS, and read as zeros when touched again."""
    global _libc
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first = -(-start // _PAGE_BYTES) * _PAGE_BYTES
    last = end // _PAGE_BYTES * _PAGE_BYTES
    if last <= first:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if _libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"madvise(MADV_DONTNEED) of {last - first} bytes at {first:#x}: {os.strerror(error)}")


class HostTier:
    """Host bytes the runtime holds, accounted against ``budget_bytes``: buffers it
    allocates (``allocate``) and tensors handed over to it (``adopt``: gradients that
    autograd produced in host RAM). Both end with ``release``; the optimizer worker releases
    while the main thread allocates, hence the lock. ``pinner``: what page-locks the buffers
    it allocates ([Note: pinned buffers]: the DeviceTier of a device the host does not
    address), or None."""

    def __init__(self, budget_bytes: Optional[int], pinner: Optional[Any] = None) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        # [Note: planned host bytes] What the wrap-time plan allocates is checked against
        # the budget apart from the soft overshoots (``planned=False``): those may hold
        # ``used_bytes`` past the budget for a while, which must not fail a planned buffer
        # made in the meantime (the gradient pool's, made when units wait for updates).
        self.planned_bytes = 0
        self._unplanned: Dict[Tuple[int, int], int] = {}  # (data_ptr, bytes) -> how many held
        self._pinner = pinner
        self._pinned: Dict[int, torch.Tensor] = {}  # data_ptr -> the buffer, while locked
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._pinned.values())

    def allocate(self, numel: int, dtype: torch.dtype, planned: bool = True) -> torch.Tensor:
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        tensor = mapped_empty(numel * element_bytes, dtype)  # [Note: host buffers outside the heap]
        self.adopt(tensor, planned)
        if self._pinner is not None and tensor.numel():
            self._pinner.pin(tensor)
            with self._lock:
                self._pinned[tensor.data_ptr()] = tensor
        return tensor

    def close(self) -> None:
        """Unlock every buffer still pinned (the device's copies are done)."""
        with self._lock:
            pinned, self._pinned = list(self._pinned.values()), {}
        for tensor in pinned:
            self._pinner.unpin(tensor)

    def adopt(self, tensor: torch.Tensor, planned: bool = True) -> None:
        """Count ``tensor`` (allocated elsewhere) as held until ``release(tensor)``.
        ``planned=False``: gradients kept under the budget by spilling them ([Note: gradient
        spill]), which may overshoot it while units wait for their updates."""
        num_bytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if planned:  # [Note: planned host bytes]
                assert self.budget_bytes is None or self.planned_bytes + num_bytes <= self.budget_bytes, \
                    "host budget exceeded: the wrap-time plan should have refused this configuration"
                self.planned_bytes += num_bytes
            elif num_bytes:
                key = (tensor.data_ptr(), num_bytes)
                self._unplanned[key] = self._unplanned.get(key, 0) + 1
            self.used_bytes += num_bytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, tensor: torch.Tensor) -> None:
        num_bytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self.used_bytes -= num_bytes
            key = (tensor.data_ptr(), num_bytes)
            held = self._unplanned.get(key, 0)
            if held:
                self._unplanned[key] = held - 1
                if held == 1:
                    del self._unplanned[key]
            else:
                self.planned_bytes -= num_bytes
            pinned = self._pinned.pop(tensor.data_ptr(), None) if tensor.numel() else None
        if pinned is not None:
            self._pinner.unpin(pinned)
