"""Trace-driven prefetch: ExecutionTrace (immutable), plan_prefetch (pure), Prefetcher.

The first pass of a kind (a forward and its backward; keyed by train/eval mode, grad mode
and the call signature) is recorded: the order in which units were needed. Later passes of
the same kind replay it: before unit k is needed, the next few units of the trace are
already on their way to the device, and when space is short the unit whose next use is
farthest leaves first. A pass that leaves its trace fetches on demand ([Note: divergence] in
prefetcher.py).

  trace.py       ExecutionTrace, NEVER
  plan.py        plan_prefetch, PrefetchPlan
  prefetcher.py  Prefetcher
"""
from offload.prefetch.plan import PrefetchPlan, plan_prefetch
from offload.prefetch.prefetcher import Prefetcher
from offload.prefetch.trace import NEVER, ExecutionTrace

__all__ = ["ExecutionTrace", "NEVER", "PrefetchPlan", "plan_prefetch", "Prefetcher"]
