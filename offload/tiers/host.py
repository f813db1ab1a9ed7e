"""The host tier: page-aligned (and, with CUDA, pinned) RAM under a byte budget."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from offload.io import aligned_empty


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

    def allocate(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        tensor = aligned_empty(numel * element_bytes, dtype=dtype)
        if zero:
            tensor.zero_()
        self.adopt(tensor)
        return tensor

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` (allocated elsewhere) as held until ``release(tensor)``."""
        num_bytes = tensor.numel() * tensor.element_size()
        with self._lock:
            assert self.budget_bytes is None or self.used_bytes + num_bytes <= self.budget_bytes, \
                "host budget exceeded: the wrap-time plan should have refused this configuration"
            self.used_bytes += num_bytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.used_bytes -= tensor.numel() * tensor.element_size()
