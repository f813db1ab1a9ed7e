"""Swap integrity: the CRC32C of every page of swap written, checked on every read.

[Note: swap checksums]
Swap data that a disk, a filesystem or another process changes behind the run's back would
otherwise be trained on without notice. So each write to a swap extent records the CRC32C
(native/common/crc32c.h) of every 4 KiB page it covers in a table kept in host RAM beside
the extent (4 bytes and a flag per page: 1.25 MiB per GiB of swap), and each read compares
the pages it brought in with the table before anyone uses them: a mismatch is an OSError
(errno EIO) naming the unit, the swap file and the offset of the first bad page.
- Pages, not whole extents: the optimizer step reads and writes pieces of a home (a piece of
  the master, the low halves of a split master, one moment), a fetch reads the home whole
  or its frozen tail, the initial zeros go out in 4 MiB pieces. Every swap request is page
  aligned (extents and pieces are), so the page is the unit that every request covers
  whole. A request edge off a page boundary (none today) leaves that page unknown: it is
  not checked until a write covers it whole.
- When: a write's CRCs are taken right after it is submitted (its buffer may not change
  until the write is waited for, [Note: request lifecycle] in native/io/engine.h), so the
  computation overlaps the transfer. A write that fails, or whose wait is interrupted, marks
  its pages unknown, since what reached the disk is then not known ([Note: swap I/O
  failures] keeps those states in host RAM). A read is checked in its handle's ``wait()``
  once the transfer is done, on the thread that waits; whoever waits for a read (the staged
  step, a fetch, a whole-home load) gets checked bytes or the error, never the bytes alone.
- Pages never written hold zeros (swap files are created zero-filled): the table of an
  extent allocated from such bytes (``Extent.zeroed``) starts at the CRC of a zero page,
  known, so reads of pages never written are checked too, and the initial zero moments need
  no write ([Note: zeroed extents] in offload/tiers/nvme.py); an extent reusing freed bytes
  starts unknown, until written.
- Threads ([Note: threads] in memory/layout.py): the tables are made when extents are
  allocated (wrap, main thread) and never resized; a request reads or writes only its own
  pages' entries, and requests that overlap in a file are never in flight together (the
  engine waits for one before issuing the other, as it must for the data), so the entries
  need no lock.
"""
from __future__ import annotations

import bisect
import errno
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from offload import _native
from offload.io.probe import ALIGN_BYTES

__all__ = ["PAGE_BYTES", "SwapChecksums", "crc32c"]

PAGE_BYTES = ALIGN_BYTES


def crc32c(data: torch.Tensor, crc: int = 0) -> int:
    """The CRC32C of a contiguous CPU tensor's bytes, continuing from ``crc``."""
    assert data.device.type == "cpu" and data.is_contiguous()
    return _native.crc32c(data.data_ptr(), data.numel() * data.element_size(), crc)


class _ExtentSums:
    """The page table of one extent: ``crcs[i]`` the CRC32C of its page i as last written,
    valid where ``known[i]`` is 1."""

    __slots__ = ("path", "offset", "nbytes", "crcs", "known")

    def __init__(self, path: str, offset: int, nbytes: int, zero_crc: int, zeroed: bool) -> None:
        assert offset % PAGE_BYTES == 0
        self.path, self.offset, self.nbytes = path, offset, nbytes
        num_pages = -(-nbytes // PAGE_BYTES)
        self.crcs = torch.full((num_pages,), zero_crc - (1 << 32) if zero_crc >= 1 << 31 else zero_crc,
                               dtype=torch.int32)
        self.known = torch.full((num_pages,), int(zeroed), dtype=torch.uint8)


def _whole_pages(offset: int, nbytes: int) -> Tuple[int, int]:
    """[first, last): the file offsets of the whole pages inside [offset, offset + nbytes)."""
    first = -(-offset // PAGE_BYTES) * PAGE_BYTES
    last = (offset + nbytes) // PAGE_BYTES * PAGE_BYTES
    return first, max(first, last)


class SwapChecksums:
    """The page tables of a run's swap extents; see [Note: swap checksums]."""

    def __init__(self) -> None:
        zero_page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        self._zero_crc = crc32c(zero_page)
        self._lock = threading.Lock()  # guards the index below (tables are added at wrap)
        self._starts: Dict[str, List[int]] = {}
        self._extents: Dict[str, List[_ExtentSums]] = {}

    def track(self, extent: Any, zeroed: bool = True) -> None:
        """Keep a page table for a newly allocated ``extent`` (path, offset, nbytes); its pages
        hold zeros when ``zeroed`` (never held by an extent before), else are unknown."""
        sums = _ExtentSums(extent.path, extent.offset, extent.nbytes, self._zero_crc, zeroed)
        with self._lock:
            starts = self._starts.setdefault(extent.path, [])
            extents = self._extents.setdefault(extent.path, [])
            position = bisect.bisect_left(starts, extent.offset)
            starts.insert(position, extent.offset)
            extents.insert(position, sums)

    def _find(self, path: str, offset: int, nbytes: int) -> _ExtentSums:
        with self._lock:
            starts = self._starts.get(path, [])
            position = bisect.bisect_right(starts, offset) - 1
            sums = self._extents[path][position] if position >= 0 else None
        assert sums is not None and offset + nbytes <= sums.offset + sums.nbytes, \
            f"{path} [{offset}, {offset + nbytes}) is not inside a tracked extent"
        return sums

    def record(self, src: torch.Tensor, path: str, offset: int) -> None:
        """``src`` (the whole buffer of a write submitted to ``path`` at ``offset``) is what
        its pages hold from now on; pages it covers only in part become unknown."""
        nbytes = src.numel() * src.element_size()
        sums = self._find(path, offset, nbytes)
        first, last = _whole_pages(offset, nbytes)
        lo, hi = (first - sums.offset) // PAGE_BYTES, (last - sums.offset) // PAGE_BYTES
        if hi > lo:
            _native.crc32c_pages(src.data_ptr() + first - offset, last - first, PAGE_BYTES,
                                 sums.crcs.data_ptr() + 4 * lo)
            sums.known[lo:hi] = 1
        self._mark_edges_unknown(sums, offset, nbytes, lo, hi)

    def forget(self, path: str, offset: int, nbytes: int) -> None:
        """A write to [offset, offset + nbytes) of ``path`` failed: its pages are unknown."""
        sums = self._find(path, offset, nbytes)
        lo = (offset - sums.offset) // PAGE_BYTES
        hi = -(-(offset + nbytes - sums.offset) // PAGE_BYTES)
        sums.known[lo:hi] = 0

    @staticmethod
    def _mark_edges_unknown(sums: _ExtentSums, offset: int, nbytes: int, lo: int, hi: int) -> None:
        start = (offset - sums.offset) // PAGE_BYTES
        end = -(-(offset + nbytes - sums.offset) // PAGE_BYTES)
        if start < lo:
            sums.known[start:lo] = 0
        if hi < end:
            sums.known[hi:end] = 0

    def check(self, dst: torch.Tensor, path: str, offset: int) -> Optional[int]:
        """The file offset of the first page that ``dst`` (just read from ``path`` at
        ``offset``) holds otherwise than last written, or None when every known page agrees."""
        nbytes = dst.numel() * dst.element_size()
        sums = self._find(path, offset, nbytes)
        first, last = _whole_pages(offset, nbytes)
        if last == first:
            return None
        lo = (first - sums.offset) // PAGE_BYTES
        bad = _native.crc32c_check_pages(dst.data_ptr() + first - offset, last - first, PAGE_BYTES,
                                         sums.crcs.data_ptr() + 4 * lo, sums.known.data_ptr() + lo)
        return None if bad < 0 else first + bad * PAGE_BYTES

    def checked_read(self, handle: Any, dst: torch.Tensor, extent: Any, unit: str) -> "CheckedRead":
        return CheckedRead(handle, self, dst, extent, unit)

    def recorded_write(self, handle: Any, src: torch.Tensor, extent: Any) -> "RecordedWrite":
        """Record ``src`` as what ``extent`` holds (the write ``handle`` is in flight)."""
        self.record(src, extent.path, extent.offset)
        return RecordedWrite(handle, self, extent)


class _Wrapped:
    """A request's handle with the engine's ``done()`` and ``times()`` passed through; the
    subclasses add to ``wait()``."""

    __slots__ = ("_handle",)

    def done(self) -> bool:
        return self._handle.done()

    def times(self):
        return self._handle.times()


class CheckedRead(_Wrapped):
    """A read's handle whose ``wait()`` also checks the bytes read ([Note: swap checksums])."""

    __slots__ = ("_sums", "_dst", "_extent", "_unit", "_error")

    def __init__(self, handle: Any, sums: SwapChecksums, dst: torch.Tensor, extent: Any, unit: str) -> None:
        self._handle, self._sums, self._dst, self._extent, self._unit = handle, sums, dst, extent, unit
        self._error: Optional[OSError] = None

    def wait(self) -> int:
        try:
            result = self._handle.wait()
        except BaseException:
            self._dst = None  # nothing to check: the read's own error travels
            raise
        if self._dst is not None:
            dst, self._dst = self._dst, None
            bad = self._sums.check(dst, self._extent.path, self._extent.offset)
            if bad is not None:
                self._error = self._mismatch(bad)
        if self._error is not None:
            raise self._error
        return result

    def _mismatch(self, bad: int) -> OSError:
        extent = self._extent
        unit = f"unit {self._unit!r}" if self._unit else "swap data"
        message = (f"swap read of {unit} failed its checksum: {extent.path} at offset {bad} (the "
                   f"{PAGE_BYTES}-byte page {(bad - extent.offset) // PAGE_BYTES} of the {extent.nbytes}-byte "
                   f"read at offset {extent.offset}) does not hold the bytes this run last wrote there; "
                   "the swap file was changed outside the run (disk, filesystem or another process) and "
                   "its contents were not used")
        return OSError(errno.EIO, message, extent.path)


class RecordedWrite(_Wrapped):
    """A write's handle whose failure marks the written pages unknown ([Note: swap
    checksums]): what reached the disk is then not known."""

    __slots__ = ("_sums", "_extent")

    def __init__(self, handle: Any, sums: SwapChecksums, extent: Any) -> None:
        self._handle, self._sums, self._extent = handle, sums, extent

    def wait(self) -> int:
        try:
            return self._handle.wait()
        except BaseException:
            self._sums.forget(self._extent.path, self._extent.offset, self._extent.nbytes)
            raise
