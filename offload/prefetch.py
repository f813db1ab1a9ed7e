"""Trace-driven prefetch: ExecutionTrace (immutable), plan_prefetch (pure), Prefetcher.

The first pass of a kind (a forward and its backward; keyed by train/eval mode, grad mode
and the call signature) is recorded: the order in which units were needed. Later passes of
the same kind replay it: before unit k is needed, the next few units of the trace are
already on their way to the device, and when space is short the unit whose next use is
farthest leaves first.

[Note: divergence] A pass that asks for a unit the trace did not predict (data-dependent
control flow, a skipped module, a recompute that did not happen before), or that ends
before the trace does, stops prefetching for the rest of that pass: everything left is
fetched on demand, which is always correct (see [Note: saved parameters] in engine.py).
One warning per cause, not per pass, and the pass just seen becomes the new trace.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Hashable, List, Optional, Sequence, Tuple

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


class Prefetcher:
    """Records and replays traces; decides, with plan_prefetch, what the engine moves.

    The engine tells it when a pass begins and ends and which unit it needs; in return it
    gets the plan to carry out (``plan``), and the next-use distance of a unit for eviction
    when it has to make room on demand (``next_use``).
    """

    def __init__(self, enabled: bool, max_units_ahead: int,
                 warn: Callable[[str], None] = lambda msg: warnings.warn(msg, RuntimeWarning, stacklevel=4),
                 *, max_bytes_ahead: Optional[int] = None) -> None:
        self.enabled = enabled
        self.max_units_ahead = max_units_ahead
        self.max_bytes_ahead = max_bytes_ahead
        self._warn = warn
        self._traces: Dict[Hashable, ExecutionTrace] = {}
        self._warned: set = set()
        self._key: Optional[Hashable] = None
        self._trace: Optional[ExecutionTrace] = None   # being replayed, None when recording only
        self._recording: List[int] = []
        self._position = 0
        self._diverged = False
        self.hits = 0
        self.misses = 0

    # -- pass lifecycle ---------------------------------------------------------------
    def begin_pass(self, key: Hashable) -> None:
        self.end_pass()
        self._key = key
        self._trace = self._traces.get(key) if self.enabled else None
        self._recording = []
        self._position = 0
        self._diverged = False

    def end_pass(self) -> None:
        """Keep the pass just seen as the trace of its kind when there was none or the old
        one no longer matched."""
        if self._key is None:
            return
        if self._trace is not None and not self._diverged and self._position < len(self._trace):
            self._diverge("ended early", f"a pass ended after {self._position} of the "
                          f"{len(self._trace)} units its trace predicted")
        if self._recording and (self._trace is None or self._diverged):
            self._traces[self._key] = ExecutionTrace(tuple(self._recording))
        self._key = None
        self._trace = None

    @property
    def replaying(self) -> bool:
        return self._trace is not None and not self._diverged

    # -- events -----------------------------------------------------------------------
    def need(self, unit: int) -> None:
        """The engine needs ``unit`` now. Advances the trace or notes a divergence."""
        if self._key is None:
            return
        if self._recording and self._recording[-1] == unit:
            return  # the unit in use asked again (several outputs, saved tensors)
        self._recording.append(unit)
        if not self.replaying:
            return
        if self._trace.units[self._position:self._position + 1] == (unit,):
            self._position += 1
        else:
            expected = self._trace.units[self._position] if self._position < len(self._trace) else None
            self._diverge("unexpected unit", f"unit {unit} was needed where the trace predicted "
                          f"{'the end of the pass' if expected is None else f'unit {expected}'}")

    def _diverge(self, cause: str, detail: str) -> None:
        self._diverged = True
        if (self._key, cause) not in self._warned:
            self._warned.add((self._key, cause))
            self._warn(f"offload: execution left the recorded unit trace ({detail}); the rest of "
                       "this pass fetches on demand and a new trace is recorded. This warning is "
                       "shown once per cause.")

    def count(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1

    # -- decisions --------------------------------------------------------------------
    def plan(self, *, unit_bytes: Sequence[int], resident: FrozenSet[int], in_flight: FrozenSet[int],
             pinned: FrozenSet[int], free_bytes: int) -> PrefetchPlan:
        if not self.replaying:
            return PrefetchPlan((), ())
        return plan_prefetch(self._trace, self._position, unit_bytes=unit_bytes, resident=resident,
                             in_flight=in_flight, pinned=pinned, free_bytes=free_bytes,
                             max_units_ahead=self.max_units_ahead, max_bytes_ahead=self.max_bytes_ahead)

    def next_use(self, unit: int) -> float:
        """Trace distance to the next use of ``unit`` in this pass (NEVER when unknown)."""
        if not self.replaying:
            return NEVER
        return self._trace.next_use(unit, self._position)

    @property
    def pass_complete(self) -> bool:
        """Whether every unit the trace predicted for this pass has been needed (False when
        not replaying)."""
        return self.replaying and self._position >= len(self._trace)

    def used_later(self, unit: int) -> Optional[bool]:
        """Whether the trace needs ``unit`` again in this pass; None when not replaying."""
        if not self.replaying:
            return None
        return self._trace.next_use(unit, self._position) != NEVER

    def first_units(self, key: Hashable) -> Tuple[int, ...]:
        """The first units a pass of this kind will need (to fetch before it starts)."""
        trace = self._traces.get(key) if self.enabled else None
        return trace.units if trace is not None else ()
