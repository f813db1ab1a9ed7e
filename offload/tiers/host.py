"""The host tier: page-aligned (and, with CUDA, pinned) RAM under a byte budget."""
from __future__ import annotations

from typing import Optional

import torch

from offload.io import aligned_empty


class HostTier:
    """Allocations are made once at wrap time and accounted against ``budget_bytes``."""

    def __init__(self, budget_bytes: Optional[int]) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0

    def allocate(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        num_bytes = numel * element_bytes
        assert self.budget_bytes is None or self.used_bytes + num_bytes <= self.budget_bytes, \
            "host budget exceeded: the wrap-time plan should have refused this configuration"
        tensor = aligned_empty(num_bytes, dtype=dtype)
        if zero:
            tensor.zero_()
        self.used_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        self.used_bytes -= tensor.numel() * tensor.element_size()
