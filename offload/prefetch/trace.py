"""ExecutionTrace: the units one pass needed, in order; immutable once recorded.

The first pass of a kind (a forward and its backward; keyed by train/eval mode, grad mode
and the call signature) is recorded as a trace; later passes of the same kind replay it
(see prefetcher.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

# The next use of a unit the trace does not need again. Here, not in plan.py, because
# ExecutionTrace.next_use returns it and plan.py imports this module.
NEVER = math.inf


@dataclass(frozen=True)
class ExecutionTrace:
    """Units (indices, the root unit excluded) in the order one pass needed them;
    consecutive repeats collapsed."""

    units: Tuple[int, ...]
    _positions: Dict[int, Tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        positions: Dict[int, List[int]] = {}
        for pos, u in enumerate(self.units):
            positions.setdefault(u, []).append(pos)
        object.__setattr__(self, "_positions", {u: tuple(p) for u, p in positions.items()})

    def __len__(self) -> int:
        return len(self.units)

    def next_use(self, unit: int, position: int) -> float:
        """First position >= ``position`` at which ``unit`` is needed, or NEVER."""
        for p in self._positions.get(unit, ()):
            if p >= position:
                return p
        return NEVER
