"""Prefetcher: records a trace per kind of pass, replays it, and plans the moves with
plan_prefetch.

Later passes of a kind replay the trace recorded by the first: before unit k is needed, the
next few units of the trace are already on their way to the device, and when space is short
the unit whose next use is farthest leaves first.

[Note: divergence] A pass that asks for a unit the trace did not predict (data-dependent
control flow, a skipped module, a recompute that did not happen before), or that ends
before the trace does, stops prefetching for the rest of that pass: everything left is
fetched on demand, which is always correct (see [Note: saved parameters] in hooks.py).
One warning per cause and kind of pass (again only if its trace was evicted since, see
MAX_TRACES), not per pass, and the pass just seen becomes the new trace.
"""
from __future__ import annotations

import collections
from typing import Callable, FrozenSet, Hashable, List, Optional, Sequence, Tuple

from offload.errors import warn_at_caller
from offload.prefetch.plan import PrefetchPlan, plan_prefetch
from offload.prefetch.trace import NEVER, ExecutionTrace

# Traces kept, one per kind of pass (mode, grad mode, the shapes of the inputs): a run fed
# many input shapes (variable sequence lengths, a short last batch) would otherwise keep one
# per shape for ever. The least recently replayed leaves first; a kind of pass seen again
# after its trace left is recorded anew (one pass of on-demand fetches). A trace costs about
# 120 bytes per unit (two uses each, forward and backward), so 256 of a 100-unit model hold
# about 3 MiB. Read when a Prefetcher is built.
MAX_TRACES = 256


class Prefetcher:
    """Records and replays traces; decides, with plan_prefetch, what the engine moves.

    The engine tells it when a pass begins and ends and which unit it needs; in return it
    gets the plan to carry out (``plan``), and the next-use distance of a unit for eviction
    when it has to make room on demand (``next_use``). It keeps the traces of the
    ``MAX_TRACES`` kinds of pass used most recently.
    """

    def __init__(self, enabled: bool, max_units_ahead: int,
                 warn: Callable[[str], None] = warn_at_caller,
                 *, max_bytes_ahead: Optional[int] = None) -> None:
        self.enabled = enabled
        self.max_units_ahead = max_units_ahead
        self.max_bytes_ahead = max_bytes_ahead
        self._warn = warn
        self._max_traces = MAX_TRACES
        assert self._max_traces >= 1, "MAX_TRACES must keep at least the trace of the pass running"
        self._traces: "collections.OrderedDict[Hashable, ExecutionTrace]" = collections.OrderedDict()
        self._warned: set = set()  # (key, cause), for keys in _traces only
        self._key: Optional[Hashable] = None
        self._trace: Optional[ExecutionTrace] = None   # being replayed, None when recording only
        self._recording: List[int] = []
        self._position = 0
        self._diverged = False
        # The key of the last training pass (grad mode on): what the step after it brings
        # back first for the next one (UpdateScheduler.prefetch_next_pass).
        self.last_train_key: Optional[Hashable] = None
        # [Note: prefetch counters]
        self.hits = 0
        self.late = 0
        self.misses = 0
        self.unplanned = 0

    # -- pass lifecycle ---------------------------------------------------------------
    def begin_pass(self, key: Hashable, training: bool = False) -> None:
        """A pass of kind ``key`` begins (``training``: a training pass, with grad mode)."""
        self.end_pass()
        if training:
            self.last_train_key = key
        self._key = key
        self._trace = self._traces.get(key) if self.enabled else None
        if self._trace is not None:
            self._traces.move_to_end(key)
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
            self._traces.move_to_end(self._key)
            while len(self._traces) > self._max_traces:
                evicted, _ = self._traces.popitem(last=False)
                self._warned = {(key, cause) for key, cause in self._warned if key != evicted}
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

    @property
    def num_traces(self) -> int:
        """Traces kept now (at most ``MAX_TRACES``)."""
        return len(self._traces)

    def count(self, *, on_device: bool, in_flight: bool) -> None:
        """[Note: prefetch counters] One new use of a unit (after ``need``), by where its
        compute copy was:

          unplanned  no trace was being replayed: the first pass of a kind (which records
                     its trace), a pass with prefetch off, or the rest of a pass that left its
                     trace ([Note: divergence]). Fetched on demand by design, whatever
                     happened to be resident, so it says nothing about the plan.
          hit        replaying, and the copy on the device or on its way;
          late       of the hits, those still on their way (the pass waits for the rest of
                     the transfer: the horizon or the disk was short, not the plan);
          miss       replaying, and the copy still at home: the plan did not start it (the
                     budget, the horizon, an update it had to wait for).

        Counting the recording pass as misses made the first steps of a long model look like
        a failing prefetcher: a 28-layer model's first step is 48 on-demand fetches, which
        were 48 of the 110 "misses" after two steps, while every fetch of the second step
        was a hit."""
        if not self.replaying:
            self.unplanned += 1
        elif on_device or in_flight:
            self.hits += 1
            self.late += in_flight
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
