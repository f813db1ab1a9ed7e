"""Streams and events: how work on the device is ordered ([Note: streams]).

[Note: streams] The device runs ordered queues of work: the compute stream (forward,
backward; on the CPU the main thread), the copy stream (host -> device transfers into
slots) and the device-to-host stream (gradients on their way out). A transfer returns
before it has run; an event recorded on a stream completes once the work queued on it
before the event has; a stream told to wait for an event runs nothing queued after the
wait before the event completes. Who waits for what:

- a use of a unit waits (compute stream) for the event of the fill that brought it
  (DeviceResidency.wait_ready);
- a fill or an update written into a slot waits (copy stream) for the event recorded on the
  compute stream when it was last done reading that slot: when the slot was released, at a
  device-homed unit's gradient or at the end of a forward (DeviceTier.reads_done);
- a gradient's copy out waits (device-to-host stream) for the compute that made it, and
  its readers wait for the copy ([Note: gradients off the device]);
- the host waits (blocking, never spinning) for a transfer before reusing its buffer.
docs/architecture.md has the table.

Three implementations share this interface. ``CudaStreams``: torch's streams and blocking
events. ``HostStreams``: the CPU device as it runs for users, every transfer done when it
returns (the arena is RAM the engine and the I/O engine also address directly).
``StandInStreams``: the CPU device behaving like CUDA, for tests
(``OFFLOAD_DEVICE_STANDIN=cuda``): each transfer stream is an ordered queue served by its
own thread, so a transfer returns before it has run (``OFFLOAD_STANDIN_COPY_DELAY_S``
holds each one back that long, so that a use that does not wait reads stale bytes), and a
``HazardChecker`` follows happens-before through the events recorded and waited for, so
that an access not ordered after the last conflicting access from another stream raises
at once, whatever the timing on this machine.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

STANDIN_ENV = "OFFLOAD_DEVICE_STANDIN"
COPY_DELAY_ENV = "OFFLOAD_STANDIN_COPY_DELAY_S"

COMPUTE = "compute"
COPY = "copy"        # host -> device
D2H = "d2h"          # device -> host: gradients on their way out
HOST = "host"        # a host thread reading or writing a buffer itself


def standin_requested() -> bool:
    """Whether tests asked the CPU device to behave like CUDA ([Note: streams])."""
    value = os.environ.get(STANDIN_ENV, "")
    if value not in ("", "cuda"):
        raise ValueError(f"{STANDIN_ENV}={value!r}: expected 'cuda' or nothing")
    return value == "cuda"


class StreamHazard(RuntimeError):
    """An access to device memory not ordered after a conflicting one on another stream."""


# ---------------------------------------------------------------------------- events
class Event:
    """Completes once the work queued on its stream before it has run."""

    def synchronize(self) -> None:
        """Block the calling thread until the event completes (raises what the work raised)."""
        raise NotImplementedError


class DoneEvent(Event):
    def __init__(self, clock: Optional[Dict[str, int]] = None) -> None:
        self.clock = clock or {}

    def synchronize(self) -> None:
        return None


class _QueuedEvent(Event):
    def __init__(self, clock: Dict[str, int]) -> None:
        self.clock = clock
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        # a host thread waited for it: work any thread queues afterwards comes after it
        # (the host passes that on through its own locks and futures)
        self.observed = False

    def complete(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        self.observed = True
        if self._error is not None:
            raise self._error


class _CudaEvent(Event):
    def __init__(self, event: "torch.cuda.Event") -> None:
        self.event = event

    def synchronize(self) -> None:
        self.event.synchronize()


# ---------------------------------------------------------------------------- streams
class Streams:
    """The device's compute and copy streams ([Note: streams])."""

    #: whether the device's memory is host RAM the engine may read and write directly
    host_addressable = True

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Sequence[Event] = (),
             what: str = "") -> Event:
        """Queue ``dst.copy_(src)`` on the copy stream, after ``after``'s events; its event."""
        raise NotImplementedError

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, *, what: str = "") -> Event:
        """Queue ``dst.copy_(src)`` (device -> pinned host) on the device-to-host stream,
        after the compute work queued so far (which produced ``src``); its event. ``src``
        may be dropped at once: the stream keeps it until the copy has run."""
        raise NotImplementedError

    def host_access(self, t: torch.Tensor, write: bool, what: str) -> None:
        """A host thread reads (or writes) host buffer ``t`` now: checked by the stand-in."""

    def record_compute(self) -> Event:
        """An event that completes once the compute work queued so far has."""
        raise NotImplementedError

    def compute_wait(self, event: Event) -> None:
        """The compute stream runs nothing queued from now on before ``event`` completes."""
        raise NotImplementedError

    def compute_access(self, t: torch.Tensor, write: bool, what: str, check: bool = True) -> None:
        """The compute stream reads (or writes) ``t`` from now on: checked by the stand-in
        (``check`` False: only remembered, as the last access)."""

    def after_collective(self, copied: Event) -> Event:
        """An event that completes once a collective the calling thread just ran on device
        memory has (it was issued after ``copied`` completed): on CUDA recorded on the
        thread's current stream, which the collective's stream made wait; elsewhere the
        collective ran on the calling thread, and ``copied`` orders what came before it."""
        return copied

    def pin(self, t: torch.Tensor) -> None:
        """[Note: pinned buffers] Page-lock host tensor ``t`` where it lies, so that copies
        between it and the device run without the host; ``unpin`` before it is freed."""

    def unpin(self, t: torch.Tensor) -> None:
        """Undo ``pin``."""

    def close(self) -> None:
        """Wait for the copy stream to run dry and stop it."""


class HostStreams(Streams):
    """The CPU device as users run it: every transfer is done when ``copy`` returns."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Sequence[Event] = (),
             what: str = "") -> Event:
        for event in after:
            event.synchronize()
        dst.copy_(src)
        return DoneEvent()

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, *, what: str = "") -> Event:
        dst.copy_(src)
        return DoneEvent()

    def record_compute(self) -> Event:
        return DoneEvent()

    def compute_wait(self, event: Event) -> None:
        event.synchronize()


class CudaStreams(Streams):
    host_addressable = False

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # Transfers run on streams of their own so that they overlap the compute on the
        # current stream; every hand-off carries an event. One stream each way: a
        # gradient's copy out never waits behind a fill.
        self._copy = torch.cuda.Stream(device)
        self._d2h = torch.cuda.Stream(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Sequence[Event] = (),
             what: str = "") -> Event:
        with torch.cuda.stream(self._copy):
            for event in after:
                if isinstance(event, _CudaEvent):
                    self._copy.wait_event(event.event)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # host waits sleep instead of spinning
            event.record(self._copy)
        return _CudaEvent(event)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, *, what: str = "") -> Event:
        self._d2h.wait_stream(torch.cuda.current_stream(self._device))  # src is computed
        with torch.cuda.stream(self._d2h):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(self._d2h)
        src.record_stream(self._d2h)  # its memory is not reused before the copy has run
        return _CudaEvent(event)

    def record_compute(self) -> Event:
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self._device))
        return _CudaEvent(event)

    def compute_wait(self, event: Event) -> None:
        if isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self._device).wait_event(event.event)

    def after_collective(self, copied: Event) -> Event:
        return self.record_compute()  # the calling thread's current stream

    def pin(self, t: torch.Tensor) -> None:
        # registered at its own size: torch's pinned allocator would round it up to a power
        # of two and keep it cached after it is freed ([Note: pinned buffers])
        nbytes = t.numel() * t.element_size()
        if nbytes:
            try:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
            except RuntimeError as error:
                raise RuntimeError(f"page-locking a host buffer of {nbytes} bytes for the device failed ({error}); "
                                   "lower host_budget, or raise the limit on locked memory (ulimit -l)") from error

    def unpin(self, t: torch.Tensor) -> None:
        if t.numel():
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))

    def close(self) -> None:
        self._copy.synchronize()
        self._d2h.synchronize()


@dataclass(frozen=True)
class _Access:
    stream: str
    tick: int
    what: str
    event: Optional[_QueuedEvent]


class HazardChecker:
    """Happens-before over the streams, by vector clocks ([Note: streams]).

    Each stream has a clock (one counter per stream); recording an event on a stream ticks
    its own counter and the event carries the clock; waiting for an event joins its clock
    into the waiting stream's. An access to a range of the arena is remembered with the
    stream and the tick an event recorded after it would carry; a later conflicting access
    (a write after anything, a read after a write) from another stream is ordered only if
    that stream's clock has reached the remembered tick. All decisions happen when work is
    queued, as CUDA orders it, not when it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clocks: Dict[str, Dict[str, int]] = {COMPUTE: {}, COPY: {}, D2H: {}, HOST: {}}
        # per range [lo, hi) of arena bytes: (last write, reads by stream), each access as
        # (stream, tick, what, its event: a copy's, None for the compute stream's)
        self._ranges: List[Tuple[int, int, Optional[_Access], Dict[str, _Access]]] = []
        self.num_checks = 0

    def record(self, stream: str) -> Dict[str, int]:
        with self._lock:
            clock = self._clocks[stream]
            clock[stream] = clock.get(stream, 0) + 1
            return dict(clock)

    def join(self, stream: str, clock: Dict[str, int]) -> None:
        with self._lock:
            mine = self._clocks[stream]
            for s, tick in clock.items():
                mine[s] = max(mine.get(s, 0), tick)

    def access(self, stream: str, lo: int, hi: int, write: bool, what: str,
               event: Optional[_QueuedEvent] = None, check: bool = True) -> None:
        """``stream`` reads (or writes) bytes [lo, hi) now, ``event`` recorded right after;
        StreamHazard if that is not ordered after a conflicting access from another stream
        (``check`` False: only remembered). A host thread's access (HOST) is done when it
        returns, before anything the host queues later: checked, not remembered."""
        if lo >= hi:
            return
        with self._lock:
            self.num_checks += 1
            clock = self._clocks[stream]
            # the tick the next event recorded on this stream carries
            mine = _Access(stream, clock.get(stream, 0) + 1, what, event)
            kept, pieces = [], []
            for r in self._ranges:
                a, b, last_write, reads = r
                if b <= lo or a >= hi:
                    kept.append(r)
                    continue
                conflicts = []
                if last_write is not None and last_write.stream != stream:
                    conflicts.append((last_write, "wrote"))
                if write:
                    conflicts.extend((other, "read") for s, other in reads.items() if s != stream)
                for other, verb in conflicts if check else ():
                    observed = other.event is not None and other.event.observed
                    if clock.get(other.stream, 0) < other.tick and not observed:
                        other_what, other = other.what, other.stream
                        raise StreamHazard(
                            f"stream hazard: {what} {'writes' if write else 'reads'} bytes "
                            f"[{max(a, lo)}, {min(b, hi)}) on the {stream} stream, not ordered after "
                            f"{other_what}, which {verb} them on the {other} stream: no event of "
                            f"the {other} stream recorded after that was waited for")
                if a < lo:
                    kept.append((a, lo, last_write, dict(reads)))
                if b > hi:
                    kept.append((hi, b, last_write, dict(reads)))
                pieces.append((max(a, lo), min(b, hi), last_write, reads))
            if stream == HOST:
                return
            # the accessed range itself, cut where the records before it were
            covered = sorted(pieces, key=lambda piece: piece[0])
            new, at = [], lo
            for a, b, last_write, reads in covered:
                if a > at:
                    new.append((at, a, None, {}))
                new.append((a, b, last_write, reads))
                at = b
            if at < hi:
                new.append((at, hi, None, {}))
            for a, b, last_write, reads in new:
                if write:
                    kept.append((a, b, mine, {}))
                else:
                    reads = dict(reads)
                    reads[stream] = mine
                    kept.append((a, b, last_write, reads))
            kept.sort(key=lambda r: r[0])
            self._ranges = kept


class _Queue:
    """One stream of the stand-in: work run in order by a thread of its own."""

    def __init__(self, name: str) -> None:
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work()

    def put(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes [lo, hi) a contiguous tensor covers, as addresses."""
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class StandInStreams(Streams):
    """The CPU device behaving like CUDA ([Note: streams]), for tests: the compute stream
    is the main thread, whose work is done once queued; the copy stream and the
    device-to-host stream are ordered queues served by threads of their own, so a copy
    returns before it has run. Every access the engine makes through this interface (to
    the arena, and to host buffers the copies write) is checked by a HazardChecker."""

    host_addressable = False

    def __init__(self, arena: torch.Tensor) -> None:
        self.checker = HazardChecker()
        self.pinned: Dict[int, int] = {}  # data_ptr -> bytes: what CUDA would have page-locked
        self._arena_ptr = arena.untyped_storage().data_ptr()
        self._arena_end = self._arena_ptr + arena.untyped_storage().nbytes()
        self._delay_s = float(os.environ.get(COPY_DELAY_ENV, "0") or 0)
        self._queues = {COPY: _Queue("offload-copy-stream"), D2H: _Queue("offload-d2h-stream")}

    def _in_arena(self, t: torch.Tensor) -> bool:
        return self._arena_ptr <= t.data_ptr() < self._arena_end

    def _queue_copy(self, stream: str, dst: torch.Tensor, src: torch.Tensor, after: Sequence[Event],
                    what: str) -> Event:
        for e in after:  # the stream waits for them: ordered from here on
            if isinstance(e, (_QueuedEvent, DoneEvent)):
                self.checker.join(stream, e.clock)
        event = _QueuedEvent({})
        for t, write in ((src, False), (dst, True)):
            lo, hi = _span(t)
            self.checker.access(stream, lo, hi, write, what, event)
        event.clock = self.checker.record(stream)

        def work() -> None:
            try:
                for e in after:
                    e.synchronize()
                if self._delay_s:
                    time.sleep(self._delay_s)
                dst.copy_(src)
            except BaseException as error:  # noqa: B902 - reported by the event
                event.complete(error)
            else:
                event.complete()
        self._queues[stream].put(work)
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: Sequence[Event] = (),
             what: str = "") -> Event:
        if src.numel() and not self._in_arena(src) and not self._is_pinned(src):
            raise StreamHazard(f"{what or 'a copy'} copies to the device from host memory that is not pinned "
                               "(on CUDA that copy would run synchronously, and into a staging buffer)")
        return self._queue_copy(COPY, dst, src, after, what or "a copy")

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, *, what: str = "") -> Event:
        if dst.numel() and not self._is_pinned(dst):
            raise StreamHazard(f"{what or 'a copy'} copies from the device into host memory that is not pinned "
                               "(on CUDA that copy would run synchronously)")
        return self._queue_copy(D2H, dst, src, [self.record_compute()], what or "a copy out")

    def host_access(self, t: torch.Tensor, write: bool, what: str) -> None:
        lo, hi = _span(t)
        self.checker.access(HOST, lo, hi, write, what)

    def pin(self, t: torch.Tensor) -> None:
        ptr = t.data_ptr()
        assert ptr not in self.pinned, "a host buffer pinned twice"
        self.pinned[ptr] = t.numel() * t.element_size()

    def unpin(self, t: torch.Tensor) -> None:
        del self.pinned[t.data_ptr()]

    def _is_pinned(self, t: torch.Tensor) -> bool:
        start, end = _span(t)
        return any(p <= start and end <= p + n for p, n in self.pinned.items())

    def hold(self, gate: threading.Event) -> _QueuedEvent:
        """Stop the copy stream at this point until ``gate`` is set (for tests); the
        returned event completes once it has passed."""
        event = _QueuedEvent(self.checker.record(COPY))

        def work() -> None:
            gate.wait()
            event.complete()
        self._queues[COPY].put(work)
        return event

    def record_compute(self) -> Event:
        return DoneEvent(self.checker.record(COMPUTE))

    def compute_wait(self, event: Event) -> None:
        if isinstance(event, (_QueuedEvent, DoneEvent)):
            self.checker.join(COMPUTE, event.clock)
        event.synchronize()  # the main thread is the compute stream: its next work comes after

    def compute_access(self, t: torch.Tensor, write: bool, what: str, check: bool = True) -> None:
        lo, hi = _span(t)
        self.checker.access(COMPUTE, lo, hi, write, what, check=check)

    def close(self) -> None:
        for q in self._queues.values():
            q.close()
