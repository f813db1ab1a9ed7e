"""The NVMe tier: extents of swap files, moved by the native I/O engine."""
from __future__ import annotations

import collections
import threading
from typing import Any, Deque, List, Optional, Tuple

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


def _start_engine(swap_dir: str, backend: str, block_bytes: int, queue_depth: int) -> IOEngine:
    """The run's I/O engine, its backend seen to complete a real aligned write+read in
    ``swap_dir`` first ("auto": the first of io_uring, libaio, threads that does), so a
    backend that fails there is an error naming io_backend before any swap file is written."""
    try:
        if backend != "auto":
            check_backend(backend, swap_dir)
        return IOEngine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth,
                        probe_dir=swap_dir)
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
                                     _start_engine(self.space.swap_dir, backend, block_bytes, queue_depth))
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

    def allocate(self, num_bytes: int):
        extent = self.space.allocate(num_bytes)
        if self.checksums is not None:  # [Note: swap checksums]
            self.checksums.track(extent)
        return extent

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
