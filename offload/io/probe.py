"""What the I/O backends and O_DIRECT do in a directory, and which backend "auto" takes.

A leaf module: it imports only the stdlib and ``offload._native`` (no torch, nothing else of
offload), so ``OffloadConfig`` can ask ``backend_refusal`` and ``SwapSpace`` can ask
``probe_o_direct`` without importing the I/O engine. A backend's check is one real aligned
write+read of 8 MiB through the native engine core, from page-aligned anonymous mappings.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import random
import tempfile
import time
from typing import Dict, Optional

from offload import _native
from offload._sizes import PAGE_BYTES

ALIGN_BYTES = PAGE_BYTES  # O_DIRECT's alignment of offsets, lengths and buffers
# Every backend, in the order backend="auto" prefers them; see [Note: auto backend choice].
BACKENDS = ("io_uring", "libaio", "threads")
# Size of a backend check's aligned write+read: 8 blocks of 1 MiB go through the queue at once.
_PROBE_BYTES = 8 << 20
_auto_choice_by_dir: Dict[str, str] = {}
# Why the kernel refused to start a backend in this process (None: it started), asked once
# per process: seccomp filters only ever tighten, kernel.io_uring_disabled is rarely changed on
# a running machine, and asking is slow (libaio's io_destroy alone takes tens of ms). A
# backend refused after the answer was cached still fails where a run starts, with an OSError
# (NvmeTier checks it in the swap directory).
_refusal_by_backend: Dict[str, Optional[str]] = {}


def check_path(path) -> str:
    """``path`` as a str; a TypeError unless it is a str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def probe_o_direct(directory: str) -> Dict[str, object]:
    """Whether files in ``directory`` can be opened with O_DIRECT and bypass the page cache:
    {"o_direct": bool, "o_direct_error": why not, or None}."""
    fd, path = tempfile.mkstemp(prefix=".offload-probe-", dir=directory)
    os.close(fd)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError as error:
            return {"o_direct": False, "o_direct_error": f"{error.strerror} (errno {error.errno})"}
        try:
            # A filesystem that accepts an unaligned O_DIRECT write is serving it from the page
            # cache (tmpfs does since Linux 6.6): it does not really honor O_DIRECT.
            try:
                os.pwrite(fd, b"x", 1)
            except OSError:
                return {"o_direct": True, "o_direct_error": None}
            return {"o_direct": False, "o_direct_error": "accepted but not honored (page cache)"}
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


def _time_backend(backend: str, directory: str) -> float:
    """Seconds for an aligned write then read of _PROBE_BYTES; raises if the data differs."""
    # Anonymous mappings start on a page boundary, a multiple of ALIGN_BYTES, so the core
    # moves them with O_DIRECT and no bounce buffer.
    data = mmap.mmap(-1, _PROBE_BYTES)
    back = mmap.mmap(-1, _PROBE_BYTES)
    # A private generator: probing (once per directory per process) must not advance the
    # user's global RNG, or a run's dropout masks would depend on whether a probe ran.
    data[:] = random.Random(0).randbytes(_PROBE_BYTES)
    data_address = ctypes.addressof((ctypes.c_char * _PROBE_BYTES).from_buffer(data))
    back_address = ctypes.addressof((ctypes.c_char * _PROBE_BYTES).from_buffer(back))
    fd, path = tempfile.mkstemp(prefix=".offload-probe-", dir=directory)
    os.close(fd)
    try:
        # One file, so one descriptor kept open between the write and the read.
        core = _native.IOEngineCore(backend, 1 << 20, 8, 1)
        try:
            start = time.perf_counter()
            core.submit(True, data_address, _PROBE_BYTES, path, 0).wait()
            core.submit(False, back_address, _PROBE_BYTES, path, 0).wait()
            seconds = time.perf_counter() - start
        finally:
            core.close()
    finally:
        os.unlink(path)
    if data[:] != back[:]:
        raise OSError(f"backend {backend}: data read back differs from data written")
    return seconds


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        return f"{error.strerror} (errno {error.errno})"
    return str(error)


def _check_backend(backend: str, directory: str) -> dict:
    """{"ok", "seconds", "error"} of one real aligned write+read with ``backend`` in
    ``directory``."""
    try:
        seconds = _time_backend(backend, directory)
    except (OSError, RuntimeError) as error:
        return {"ok": False, "seconds": None, "error": _describe(error)}
    return {"ok": True, "seconds": seconds, "error": None}


# [Note: auto backend choice]
# backend="auto" takes the first backend of BACKENDS (io_uring, then libaio, then threads)
# that this build has and that completes a real aligned write+read in the directory. It does
# not pick by speed: one probe's time says nothing about the backends. Under the runtime's
# load they move data at about the same speed, and a disk's speed drifts between seconds by
# more than they differ, so a pick by the fastest probe would flip between runs and make
# them irreproducible. The order: io_uring hands over a batch and reaps completions in one
# system call; libaio is the kernel's older asynchronous interface (truly asynchronous only
# with O_DIRECT); threads (pread/pwrite) work everywhere.


def _preferred(results: Dict[str, dict]) -> Optional[str]:
    return next((b for b in BACKENDS if b in results and results[b]["ok"]), None)


def probe_directory(path) -> dict:
    """Which I/O backends work in ``path`` (a real aligned write+read each) and whether O_DIRECT
    works there. Used by ``offload doctor`` and ``offload profile``.

    Returns {"path", "o_direct", "o_direct_error", "backends": {name: {"ok", "seconds",
    "error"}}, "choice": name or None, "best": the same as "choice"}. "backends" lists the
    backends of this build in the order "auto" prefers them. "choice" is the backend
    ``IOEngine(backend="auto", probe_dir=path)`` uses: the first that works ([Note: auto
    backend choice]). "seconds" is the time of that one 8 MiB write+read, for information
    only: it is not a measure of the backend, and the choice does not look at it. "best" is
    "choice" under its older name, kept for older callers; it no longer means the fastest.
    """
    path = os.path.abspath(check_path(path))
    if not os.path.isdir(path):
        raise ValueError(f"path {path!r} is not a directory")
    report: dict = {"path": path}
    report.update(probe_o_direct(path))
    compiled = set(_native.io_available_backends())
    report["backends"] = {b: _check_backend(b, path) for b in BACKENDS if b in compiled}
    report["choice"] = report["best"] = _preferred(report["backends"])
    return report


def auto_backend(directory: str) -> str:
    """The first backend of BACKENDS that works in ``directory`` ([Note: auto backend
    choice]), found once per directory per process."""
    directory = os.path.abspath(directory)
    if directory not in _auto_choice_by_dir:
        compiled = set(_native.io_available_backends())
        results: Dict[str, dict] = {}
        for backend in (b for b in BACKENDS if b in compiled):
            results[backend] = _check_backend(backend, directory)
            if results[backend]["ok"]:
                break
        choice = _preferred(results)
        if choice is None:
            raise OSError(f"no I/O backend works in {directory}: " + "; ".join(
                f"{b}: {r['error']}" for b, r in results.items()))
        _auto_choice_by_dir[directory] = choice
    return _auto_choice_by_dir[directory]


def check_backend(backend: str, directory: str) -> None:
    """Raises ``OSError`` saying why, unless ``backend`` completes a real aligned write+read
    in ``directory``."""
    result = _check_backend(backend, os.path.abspath(directory))
    if not result["ok"]:
        raise OSError(f"I/O backend {backend!r} does not work in {os.path.abspath(directory)}: "
                      f"{result['error']}")


def backend_refusal(backend: str) -> Optional[str]:
    """Why this process cannot use ``backend`` (one of BACKENDS) anywhere: not compiled into
    this build, or refused by the kernel (io_uring disabled by sysctl or seccomp, no native
    AIO). None when it starts. ``OffloadConfig`` asks this for an explicit io_backend."""
    compiled = list(_native.io_available_backends())
    if backend not in compiled:
        return f"not compiled into this build (it has {', '.join(compiled)})"
    if backend not in _refusal_by_backend:
        try:
            _native.IOEngineCore(backend, ALIGN_BYTES, 1, 0).close()
            _refusal_by_backend[backend] = None
        except (OSError, RuntimeError) as error:
            _refusal_by_backend[backend] = f"the kernel refuses it: {_describe(error)}"
    return _refusal_by_backend[backend]
