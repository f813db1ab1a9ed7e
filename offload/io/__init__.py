"""File I/O for offloaded state: the asynchronous I/O engine, the probe of a directory's
backends, and the swap space of a run.

  engine.py  IOEngine (asynchronous O_DIRECT reads and writes of tensor bytes), aligned_empty
  probe.py   O_DIRECT and backend checks in a directory, backend="auto"'s choice; a leaf
             module (stdlib and offload._native only), so config can ask it
  swap.py    SwapSpace (the run's directory, lock and swap files) and its extent allocator
  checksum.py  SwapChecksums: the CRC32C of every swap page written, checked on every read
"""
from offload.io.engine import (
    DEFAULT_MAX_OPEN_FILES, HUGE_PAGE_BYTES, IOEngine, IOHandle, aligned_empty)
from offload.io.probe import (
    ALIGN_BYTES, BACKENDS, backend_refusal, check_backend, probe_directory, probe_o_direct)
from offload.io.swap import Extent, ExtentAllocator, SwapSpace, pid_alive

__all__ = ["IOEngine", "IOHandle", "aligned_empty", "ALIGN_BYTES", "HUGE_PAGE_BYTES",
           "DEFAULT_MAX_OPEN_FILES", "BACKENDS", "probe_directory", "probe_o_direct",
           "check_backend", "backend_refusal", "SwapSpace", "Extent", "ExtentAllocator",
           "pid_alive"]
