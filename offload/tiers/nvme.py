"""The NVMe tier: extents of swap files, moved by the native I/O engine.

[Note: zeroed extents]
Swap files are created zero-filled, and the initial Adam moments are zeros: writing them
(twice the fp32 master, most of what wrap writes with the optimizer state on NVMe) would
only write what the file already holds. So the tier remembers the extents it allocated from
bytes no extent held before (``Extent.zeroed``) until anything is written into them, and
``claim_zeroed`` lets the one caller that wants zeros there (Homes, zeroing the moments at
wrap) skip the write. The swap checksums agree without a write: their page tables start at
the CRC32C of a zero page for such extents ([Note: swap checksums]), so the first read of
those pages is checked against zeros and a page changed behind the run's back is still
caught. What this does not cover is written as before: moments carried over from the
user's optimizer, a checkpoint load (which writes the moments it loads), extents that reuse
freed bytes. A wrap that fails part-way closes the tier and removes the files, so no claim
outlives it; ZeRO ranks each own their swap space, so each claims its own shard's extents.
"""
from __future__ import annotations

import bisect
import collections
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch
from torch.profiler import record_function

from offload import faults
from offload.io.checksum import SwapChecksums
from offload.io.engine import IOEngine
from offload.io.probe import check_backend
from offload.io.swap import SwapSpace
from offload.stats import Stats


# Requests kept for the engine's trace (export_trace): the most recent ones only, so a long
# run holds a bounded amount (a few MiB) whatever its length.
TRACE_REQUESTS = 1 << 15


def _start_engine(swap_dir: str, backend: str, block_bytes: int, queue_depth: int,
                  warn_buffered: bool) -> IOEngine:
    """The run's I/O engine, its backend seen to complete a real aligned write+read in
    ``swap_dir`` first ("auto": the first of io_uring, libaio, threads that does), so a
    backend that fails there is an error naming io_backend before any swap file is written.
    ``warn_buffered``: whether the engine warns when a file opens without O_DIRECT (not
    when SwapSpace has already said so of the whole directory)."""
    try:
        if backend != "auto":
            check_backend(backend, swap_dir)
        return IOEngine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth,
                        probe_dir=swap_dir, warn_buffered=warn_buffered)
    except OSError as error:
        raise OSError(f"io_backend={backend!r}: {error}") from error


def wait_all(handles: List[Any], stats: Stats) -> None:
    """Waits for every handle (none may stay in flight into a buffer about to be reused),
    then raises the first error."""
    first_error: Optional[OSError] = None
    with stats.timed("io_wait"):
        while handles:
            try:
                handles.pop().wait()
            except OSError as error:
                first_error = first_error or error
    if first_error is not None:
        raise first_error


def drain(handles: List[Any], stats: Stats) -> None:
    """Wait for handles whose errors are already being reported another way."""
    try:
        wait_all(handles, stats)
    except OSError:
        pass


class NvmeTier:
    """Owns the run's SwapSpace and IOEngine; counts the bytes it moves and keeps the most
    recent requests (``recent``: (is_write, bytes, handle)) for the trace. A handle holds its
    buffer only until it is waited for, which the engine always does. ``checksums``: keep a
    CRC32C of every page written and check every read ([Note: swap checksums],
    offload/io/checksum.py); ``self.checksums`` is then their tables, else None."""

    def __init__(self, swap_dir: str, reserve_bytes: int, backend: str, block_bytes: int,
                 queue_depth: int, checksums: bool = True) -> None:
        # SwapSpace runs its preflight (space, permissions, O_DIRECT) before creating files.
        self.space = SwapSpace(swap_dir, reserve_bytes=reserve_bytes)
        try:
            self.io = faults.passing("nvme.io_engine",
                                     _start_engine(self.space.swap_dir, backend, block_bytes, queue_depth,
                                                   warn_buffered=self.space.o_direct))
            # [Note: swap directory trust] requests use the swap files' descriptors, never paths
            self.space.hold_files(self.io.hold_file)
        except BaseException:
            self.space.close()
            raise
        self.bytes_read = 0
        self.bytes_written = 0
        self._count_lock = threading.Lock()  # the fetch path and the optimizer worker both move bytes
        self.recent: Deque[Tuple[bool, int, Any]] = collections.deque(maxlen=TRACE_REQUESTS)
        self.checksums: Optional[SwapChecksums] = SwapChecksums() if checksums else None
        # [Note: zeroed extents] per swap file, the sorted (offset, end) of the extents that
        # read as zeros: allocated zeroed, nothing written into them since, not yet claimed.
        # Empty once wrap is done, so later writes only test it.
        self._zeroed: Dict[str, List[Tuple[int, int]]] = {}
        self._zeroed_lock = threading.Lock()  # writes come from the fetch path and the optimizer worker

    def allocate(self, num_bytes: int):
        extent = self.space.allocate(num_bytes)
        if self.checksums is not None:  # [Note: swap checksums]
            self.checksums.track(extent, zeroed=extent.zeroed)
        if extent.zeroed:
            bisect.insort(self._zeroed.setdefault(extent.path, []), (extent.offset, extent.offset + extent.nbytes))
        return extent

    def claim_zeroed(self, extent) -> bool:
        """[Note: zeroed extents] True when ``extent`` (a whole extent from ``allocate``) reads
        as zeros with nothing written: the caller may skip writing zeros there. Once only: it
        is then the caller's, like any extent written."""
        return self._forget_zeroed(extent.path, extent.offset, extent.nbytes, whole=True)

    def _forget_zeroed(self, path: str, offset: int, nbytes: int, whole: bool = False) -> bool:
        """Drop the zeroed extent that [offset, offset + nbytes) of ``path`` lies in (a write
        into it, or a claim: ``whole``, which must match it exactly); True if there was one."""
        with self._zeroed_lock:
            ranges = self._zeroed.get(path)
            if not ranges:
                return False
            position = bisect.bisect_right(ranges, (offset, float("inf"))) - 1
            if position < 0 or offset >= ranges[position][1] or \
                    (whole and ranges[position] != (offset, offset + nbytes)):
                return False
            del ranges[position]
            if not ranges:
                del self._zeroed[path]
            return True

    def read(self, dst: torch.Tensor, extent, unit: str = ""):
        """Start reading ``extent`` into ``dst``; returns a handle with ``wait()``. ``unit``
        names the unit the bytes belong to in the torch.profiler label
        (``offload::swap_read::UNIT``, around the issue: the transfer itself runs on the I/O
        engine's threads)."""
        assert dst.numel() * dst.element_size() == extent.nbytes
        with record_function(f"offload::swap_read::{unit}" if unit else "offload::swap_read"):
            handle = self.io.read_into(dst, extent.path, extent.offset)
        with self._count_lock:
            self.bytes_read += extent.nbytes
            self.recent.append((False, extent.nbytes, handle))
        if self.checksums is not None:  # [Note: swap checksums] wait() checks the bytes read
            return self.checksums.checked_read(handle, dst, extent, unit)
        return handle

    def write(self, src: torch.Tensor, extent, unit: str = ""):
        """Start writing ``src`` to ``extent`` (see ``read`` for ``unit``)."""
        assert src.numel() * src.element_size() == extent.nbytes
        if self._zeroed:  # [Note: zeroed extents] written: no longer known to be zeros
            self._forget_zeroed(extent.path, extent.offset, extent.nbytes)
        with record_function(f"offload::swap_write::{unit}" if unit else "offload::swap_write"):
            handle = self.io.write_from(src, extent.path, extent.offset)
        with self._count_lock:
            self.bytes_written += extent.nbytes
            self.recent.append((True, extent.nbytes, handle))
        if self.checksums is not None:  # [Note: swap checksums] taken while the bytes move
            return self.checksums.recorded_write(handle, src, extent)
        return handle

    @property
    def used_bytes(self) -> int:
        return self.space.used_bytes

    def close(self) -> None:
        try:
            self.io.close()
        finally:
            self.space.close()
