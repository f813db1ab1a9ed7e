"""The sum of squares of one parameter's gradient, for the global norm ([Note: gradient
squares]).

[Note: gradient squares] The global norm sums, per parameter, the square of its gradient's
fp32 norm, in float64. A gradient of at most ``SQUARES_CHUNK_NUMEL`` elements (4 Mi,
memory/budget.py) gives ``vector_norm(g, dtype=float32).double() ** 2``, what the engine
has always computed; a longer one is cut into chunks of that many elements, and the squares
of the chunks' norms are added in float64, in order, whatever its dtype. A 16-bit gradient
([Note: 16-bit gradients] in optim/gradients.py) is widened into a reused fp32 scratch of
one chunk first: the same fp32 values as its fp32 copy, in the same order, so the same bits
as if it had been held in fp32. Why:
- Speed and memory. ``vector_norm`` of a 16-bit tensor with ``dtype=float32`` widens the
  whole tensor into memory it allocates and touches for the first time: several times
  slower than through a warm chunk, and a whole fp32 temporary of the largest gradient (a
  tied embedding's) on top of the host budget.
- Accuracy. One ``vector_norm`` accumulates in fp32, whose error grows with the length; the
  chunks' float64 sum is an order of magnitude closer to the float64 sum of squares. So a
  gradient longer than a chunk gets a norm whose last bits (or more) differ from one
  ``vector_norm`` over it, and from torch's ``clip_grad_norm_``, which takes one per
  parameter: ours is the more exact. The golden models' parameters and the reference
  GPT's blocks are below a chunk; embeddings and the 3B shape's matrices above it.
Each thread that takes squares (the main thread and the optimizer worker) has its scratch,
allocated at wrap and planned with the host needs (``budget.squares_scratch_bytes``).
"""
from __future__ import annotations

from typing import Callable

import torch

from offload.memory.budget import SQUARES_CHUNK_NUMEL

__all__ = ["grad_squares"]


def grad_squares(g: torch.Tensor, scratch: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Sum of squares of the flat gradient ``g`` (float64, 0-d), chunk by chunk.
    ``scratch()``: this thread's fp32 buffer of at least min(len(g), SQUARES_CHUNK_NUMEL)
    elements, asked for only when ``g`` is not fp32."""
    n = g.numel()
    total = None
    for a in range(0, max(n, 1), SQUARES_CHUNK_NUMEL):
        piece = g[a:a + SQUARES_CHUNK_NUMEL]
        if piece.dtype != torch.float32:
            wide = scratch()[:piece.numel()]
            wide.copy_(piece)  # exact
            piece = wide
        square = torch.linalg.vector_norm(piece, dtype=torch.float32).double() ** 2
        total = square if total is None else total + square
    return total
