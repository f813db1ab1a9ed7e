"""The host tier: page-aligned (and, with CUDA, pinned) RAM under a byte budget.

[Note: host buffers outside the heap] Without CUDA a buffer of the tier is an anonymous
mapping of its own, not a malloc block. The tier's buffers live for the whole run, and
malloc would place the smaller ones (staging pieces of a few MiB) in its heap between
activations: the heap can only shrink from its top, so every later step's activations and
gradients would grow it around them, and that free space stays resident. A mapping is page
aligned by construction and goes back to the kernel when its tensor dies. With CUDA the
buffers are pinned (``aligned_empty``): the CUDA host allocator keeps them off the heap.
"""
from __future__ import annotations

import mmap
import threading
from typing import Optional

import torch

from offload.io.engine import HUGE_PAGE_BYTES, aligned_empty


def mapped_empty(num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor on anonymous pages of its own. From 2 MiB up these are
    ``aligned_empty``'s huge-page mappings ([Note: huge-page buffers] in offload/io/engine.py:
    swap I/O into them runs at full speed), below that a page-aligned mapping of 4 KiB pages."""
    if num_bytes >= HUGE_PAGE_BYTES and not torch.cuda.is_available():
        return aligned_empty(num_bytes, dtype)
    if num_bytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=dtype)  # the tensor keeps the map


class HostTier:
    """Host bytes the runtime holds, accounted against ``budget_bytes``: buffers it
    allocates (``allocate``) and tensors handed over to it (``adopt``: gradients that
    autograd produced in host RAM). Both end with ``release``; the optimizer worker releases
    while the main thread allocates, hence the lock."""

    def __init__(self, budget_bytes: Optional[int]) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def allocate(self, numel: int, dtype: torch.dtype, planned: bool = True) -> torch.Tensor:
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        if torch.cuda.is_available():
            tensor = aligned_empty(numel * element_bytes, dtype=dtype)
        else:  # [Note: host buffers outside the heap]
            tensor = mapped_empty(numel * element_bytes, dtype)
        self.adopt(tensor, planned)
        return tensor

    def adopt(self, tensor: torch.Tensor, planned: bool = True) -> None:
        """Count ``tensor`` (allocated elsewhere) as held until ``release(tensor)``.
        ``planned=False``: gradients kept under the budget by spilling them ([Note: gradient
        spill]), which may overshoot it while units wait for their updates."""
        num_bytes = tensor.numel() * tensor.element_size()
        with self._lock:
            assert not planned or self.budget_bytes is None or self.used_bytes + num_bytes <= self.budget_bytes, \
                "host budget exceeded: the wrap-time plan should have refused this configuration"
            self.used_bytes += num_bytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.used_bytes -= tensor.numel() * tensor.element_size()
