"""Counters, phase timers and the timeline of one engine."""
from __future__ import annotations

import collections
import functools
import heapq
import json
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Deque, Dict, Iterator, List, Tuple, TypeVar

import torch
from torch.profiler import record_function

from offload.config import format_size

# Spans kept for export_trace: the most recent ones (about 100 per step of a 10-unit
# model), so a long run's timeline stays a few MiB.
TIMELINE_SPANS = 1 << 16


_Method = TypeVar("_Method", bound=Callable[..., Any])


def profiled(phase: str) -> Callable[[_Method], _Method]:
    """Label calls of a method whose first argument is a unit as ``offload::PHASE::UNIT``
    for torch.profiler, so that a user's profiler trace shows the engine's fetches, releases,
    Adam updates and swap I/O beside their own ops. Costs a few microseconds a call when no
    profiler runs."""
    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def labelled(self: Any, unit: Any, *args: Any, **kwargs: Any) -> Any:
            with record_function(f"offload::{phase}::{unit.name}"):
                return method(self, unit, *args, **kwargs)
        return labelled  # type: ignore[return-value]
    return decorate


class Stats:
    """Byte counters per link and seconds per phase. Only ever written to by the engine and
    read by ``Engine.stats()``: no decision is taken on these numbers."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.seconds: Dict[str, float] = defaultdict(float)
        self.counts: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # the copy and optimizer workers count too

    def add_bytes(self, link: str, num_bytes: int) -> None:
        with self._lock:
            self.bytes[link] += num_bytes

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def add_seconds(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] += seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self.seconds[phase] += elapsed


class Timeline:
    """Spans (lane, name, start, end) in ``time.perf_counter()`` seconds, the most recent
    ``TIMELINE_SPANS`` of them, for ``Engine.export_trace``. Time 0 is the creation. The
    engine's threads append; a deque's append is atomic, so no lock."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self._spans: Deque[Tuple[str, str, float, float]] = collections.deque(maxlen=TIMELINE_SPANS)

    def __len__(self) -> int:
        """Spans kept now (at most ``TIMELINE_SPANS``)."""
        return len(self._spans)

    def span(self, lane: str, name: str, start: float, end: float) -> None:
        self._spans.append((lane, name, start, end))

    def wait(self, what: str, start: float) -> float:
        """A "wait" span from ``start`` to now when the main thread waited there (for a fetch
        or an update) before ``what`` could run; returns now."""
        now = time.perf_counter()
        if now - start > 1e-4:
            self.span("wait", f"before {what}", start, now)
        return now

    def export(self, path: str, requests: List[Tuple[bool, int, Any]]) -> None:
        """Write the spans and those of the finished NVMe ``requests`` (is_write, bytes,
        IOHandle) as Chrome/Perfetto trace-event JSON (see ``Engine.export_trace``)."""
        spans = list(self._spans) + request_spans(requests)

        def numbered(prefix: str) -> List[str]:  # "nvme read 0", "nvme read 1", ...
            return sorted({lane for lane, _, _, _ in spans if lane.startswith(prefix)},
                          key=lambda lane: int(lane.rsplit(" ", 1)[1]))

        order = ["phase", "compute", "wait", "copy", "activations", *numbered("nvme read "), *numbered("nvme write "),
                 "optimizer", "adam"]
        lanes = {lane: tid for tid, lane in enumerate(order)}
        events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
                  for lane, tid in lanes.items()]
        for lane, name, start, end in spans:
            kind = lane.rsplit(" ", 1)[0] if lane.startswith("nvme") else lane  # "nvme read 3"
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 1, "tid": lanes[lane],
                           "ts": (start - self.origin) * 1e6, "dur": max(end - start, 0.0) * 1e6})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def request_spans(requests: List[Tuple[bool, int, Any]]) -> List[Tuple[str, str, float, float]]:
    """Trace spans of finished NVMe requests (is_write, bytes, IOHandle), each
    direction spread over numbered lanes in which no two spans overlap (a request goes to
    the lowest-numbered lane that is free when it starts)."""
    spans: List[Tuple[str, str, float, float]] = []
    for is_write, direction in ((False, "read"), (True, "write")):
        done = []
        for w, nbytes, handle in requests:
            times = handle.times() if w == is_write and hasattr(handle, "times") else None
            if times is not None:  # finished (a test's stand-in handle has no times)
                done.append((*times, nbytes))
        done.sort()
        free: List[int] = []                   # lane numbers free now (a heap)
        busy: List[Tuple[float, int]] = []     # (end, lane) of the spans running
        lanes_used = 0
        for start, end, nbytes in done:
            while busy and busy[0][0] <= start:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                lane = heapq.heappop(free)
            else:
                lane, lanes_used = lanes_used, lanes_used + 1
            heapq.heappush(busy, (end, lane))
            spans.append((f"nvme {direction} {lane}", f"{direction} {format_size(nbytes)}", start, end))
    return spans


def engine_stats(*, device: Any, host: Any, nvme: Any, counters: Stats, prefetcher: Any, gradients: Any,
                 updates: Any, partition: Any, homes: Any, units: List[Any], micro_step: int,
                 step_seconds: float, optimizer_seconds: float, home_bytes: Dict[str, int],
                 activations: Any) -> Dict[str, Any]:
    """What ``Engine.stats()`` returns: counters of one engine (bytes, seconds, peaks).
    ``*_seconds`` are cumulative except ``step_seconds`` and ``optimizer_seconds``: those of
    the last optimizer step (step_seconds: wall time between the last two optimizer steps).
    The arguments are the engine's tiers and mechanisms, read here and never written."""
    s = counters
    return {
        "device_peak_bytes": device.peak_bytes,
        "device_budget_bytes": device.budget_bytes,
        "host_peak_bytes": host.peak_bytes,
        "host_bytes": host.used_bytes,
        "nvme_bytes": nvme.used_bytes if nvme else 0, "bytes_read_nvme": nvme.bytes_read if nvme else 0,
        "stale_swap_bytes_removed": nvme.space.stale_bytes_removed if nvme else 0,  # [Note: stale runs]
        "bytes_written_nvme": nvme.bytes_written if nvme else 0,
        "bytes_host_to_device": s.bytes["host_to_device"],
        "bytes_nvme_to_device": s.bytes["nvme_to_device"],
        "bytes_device_to_host": s.bytes["device_to_host"],
        "bytes_all_gather": s.bytes["all_gather"],  # [zero] stage 3: the gathered units' slots
        "step_seconds": step_seconds,
        "optimizer_seconds": optimizer_seconds,
        "io_wait_seconds": s.seconds["io_wait"] + s.seconds["fetch_wait"],
        "fetch_wait_seconds": s.seconds["fetch_wait"],
        "optimizer_wait_seconds": s.seconds["optimizer_wait"],
        # [Note: prefetch counters]
        **{f"prefetch_{k}": getattr(prefetcher, k) for k in ("hits", "misses", "late", "unplanned")},
        "backward_seconds": s.seconds["backward"],
        "total_optimizer_seconds": s.seconds["optimizer"],  # in step() itself
        # the optimizer worker's updates (early, speculative, deferred, delayed), I/O included
        "worker_update_seconds": s.seconds["worker_updates"],
        # counts of steps and updates ([Note: speculative updates] for speculative_updates,
        # redone_updates and taken_back_updates; [Note: delayed updates] for the last three:
        # optimizer steps whose update ran delayed, steps past the warm-up that fell back to
        # exact ones, and gradient hand-offs that waited for the unit's delayed update)
        **{k: s.counts[k] for k in ("skipped_steps", "nonfinite_steps", "early_updates", "deferred_updates",
                                    "update_fills", "speculative_updates", "redone_updates",
                                    "taken_back_updates", "delayed_updates",
                                    "delayed_fallbacks", "delayed_grad_waits")},
        "loss_scale": gradients.loss_scale,
        "grad_norm": gradients.last_grad_norm,  # see Gradients.last_grad_norm
        # [Note: deferred updates] True while the last step's norm is taken during the
        # next pass (no clipping): grad_norm is the step before's meanwhile
        "grad_norm_pending": updates.norm_pending,
        "micro_steps": micro_step,  # micro-steps since wrap; a checkpoint restores it
        "num_units": len(units),
        # [zero] per rank: what this rank holds (gradient buffers as planned: the pool
        # fills them lazily)
        "world_size": partition.world_size if partition is not None else 1,
        "rank": partition.rank if partition is not None else 0,
        # [Note: sharding groups] ranks per group, and all-reduces of gradient shards across groups
        "shard_group_size": partition.shard_size if partition is not None else 1,
        "cross_group_reduces": partition.num_cross_group_reduces if partition is not None else 0,
        "optimizer_state_bytes": homes.optimizer_state_bytes(),
        # [Note: bounded checkpoint memory] the most bytes the buffers that the last of wrap's
        # initial writes, save_checkpoint, load_checkpoint, load_state_dict or a
        # gathered(modify=True) write-back moved pieces through held at once (beside the
        # homes and host_budget)
        "checkpoint_buffer_peak_bytes": homes.last_buffer_peak_bytes,
        # [Note: whole-parameter optimizers] side state (Adafactor's row and column factors)
        # in host RAM beside each parameter's step count
        "optimizer_side_bytes": sum(v.numel() * v.element_size() for u in units for step in u.steps
                                    for v in (getattr(step, "scalars", None) or {}).values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0),
        "parameter_bytes": homes.parameter_bytes(),
        # [Note: 16-bit gradients] in the dtype they are held in
        "gradient_bytes": sum(u.grad_numel for u in units if u.trainable) * gradients.element_bytes,
        "spilled_gradient_bytes": s.bytes["gradient_spill"],  # [Note: gradient spill]
        "failed_gradient_spills": s.counts["failed_gradient_spills"],
        # fetches that failed before anything used them: drain_fetches in DeviceResidency
        "failed_prefetches": s.counts["failed_prefetches"],
        "gradient_budget_waits": s.counts["gradient_budget_waits"],  # [Note: gradient spill]
        # [Note: placement by budget] compute copies, masters and moments at home per tier
        **{f"home_bytes_{tier}": n for tier, n in home_bytes.items()},
        "gradient_bucket_peak_bytes":
            partition.bucket_peak_bytes if partition is not None else 0,
        # [Note: gradient buckets in the device budget] the reduce-scatters' output on the device
        "reduce_scatter_output_bytes": partition.output_bytes if partition is not None else 0,
        # [Note: saved activations] ActivationStore.stats: kept, moved, peaks per tier
        "activations": activations.stats(),
    }
