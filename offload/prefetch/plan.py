"""plan_prefetch: what to move to the device next, given a trace and where the pass is.

Pure: it reads a trace and sets of unit indices and returns a PrefetchPlan; the Prefetcher
(prefetcher.py) asks it and the engine carries the plan out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

from offload.prefetch.trace import ExecutionTrace

__all__ = ["PrefetchPlan", "plan_prefetch"]


@dataclass(frozen=True)
class PrefetchPlan:
    fetch: Tuple[int, ...]     # units to start moving to the device, in this order
    evict: Tuple[int, ...]     # resident units to drop first to make room


def plan_prefetch(trace: ExecutionTrace, position: int, *, unit_bytes: Sequence[int],
                  resident: FrozenSet[int], in_flight: FrozenSet[int], pinned: FrozenSet[int],
                  free_bytes: int, max_units_ahead: int,
                  max_bytes_ahead: Optional[int] = None) -> PrefetchPlan:
    """What to move next. ``position`` is the trace index of the next unit to be needed.

    Walks the next ``max_units_ahead`` distinct units of the trace; a unit not yet on the
    device (nor in flight) is fetched if it fits in ``free_bytes`` after evicting resident,
    unpinned units whose next use is later than its own (farthest first). Stops at the first
    unit that cannot be placed, so fetches happen in trace order. Never plans beyond
    ``free_bytes`` plus what it evicts, nor (when given) beyond ``max_bytes_ahead`` bytes of
    units of the window on the device or on their way (counted in trace order, those
    already there included).
    """
    fetch: List[int] = []
    evict: List[int] = []
    free = free_bytes
    victims = sorted((u for u in resident if u not in pinned),
                     key=lambda u: trace.next_use(u, position), reverse=True)
    seen: set = set()
    ahead = 0  # bytes of window units on the device or on their way
    for pos in range(position, len(trace)):
        u = trace.units[pos]
        if u in seen:
            continue
        seen.add(u)
        if len(seen) > max_units_ahead:
            break
        if (u in resident and u not in evict) or u in in_flight:
            ahead += unit_bytes[u]
            continue
        need = unit_bytes[u]
        if max_bytes_ahead is not None and ahead + need > max_bytes_ahead:
            break
        while free < need and victims and trace.next_use(victims[0], position) > pos:
            v = victims.pop(0)
            evict.append(v)
            free += unit_bytes[v]
        if free < need:
            break
        fetch.append(u)
        free -= need
        ahead += need
    return PrefetchPlan(tuple(fetch), tuple(evict))
