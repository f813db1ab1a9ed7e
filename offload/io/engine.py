"""Asynchronous O_DIRECT file I/O for tensors, and the aligned CPU buffers it moves fastest.

``IOEngine`` moves the bytes of contiguous CPU tensors to and from files with many blocks in
flight (io_uring, libaio or a thread pool of pread/pwrite, see native/io/). Semantics:

- ``write_from(t, path, offset)`` writes exactly ``t.nbytes`` bytes at ``offset``, creating
  the file (mode 0600) if needed; bytes outside that range are left as they were and the file
  grows only to ``offset + t.nbytes``, as with ``os.pwrite``.
- ``read_into(t, path, offset)`` reads exactly ``t.nbytes`` bytes; a file that ends before
  ``offset + t.nbytes`` is an ``OSError`` (errno ENODATA) naming the file.
- Errors of any stage (open, submission, completion) surface from ``handle.wait()`` (and
  from ``wait_all()``) as ``OSError`` with ``errno`` set and a message naming the operation,
  file, offset, length and errno. The engine stays usable afterwards.
- A buffer, offset or length that is not 4 KiB aligned is moved correctly through an aligned
  bounce buffer the size of the request, synchronously inside the engine and after every
  earlier request has finished; use ``aligned_empty`` and aligned offsets for full speed.
- Requests in flight at the same time that overlap in the file are not ordered against each
  other (as with any asynchronous I/O): wait for one before issuing the other.
- Filesystems that cannot bypass the page cache (tmpfs, or any that refuses O_DIRECT) are
  written buffered with ``fdatasync`` at each write's completion, after one warning.
- Files stay open between requests (up to ``max_open_files``, least recently used closed
  first). Each request still checks its path: a file removed since is an error as if it had
  never been opened, a file replaced since is opened anew. A removed file keeps its disk space
  while the engine holds it open; ``close_files()`` (or ``close()``) lets go of every file.
- ``hold_file(path, fd)`` hands over a file the caller opened itself (the swap space does, with
  O_NOFOLLOW through directory descriptors): requests naming ``path`` then use that open file
  and never resolve ``path`` again, until ``release_file(path)`` or ``close()``. A path
  replaced by a symlink or another file afterwards is not followed.
"""
from __future__ import annotations

import mmap
import tempfile
import warnings
from typing import List, Optional, Tuple

import torch

from offload import _native
from offload.io.probe import ALIGN_BYTES, BACKENDS, auto_backend, check_path

__all__ = ["IOEngine", "IOHandle", "aligned_empty", "ALIGN_BYTES", "HUGE_PAGE_BYTES",
           "DEFAULT_MAX_OPEN_FILES"]

# Swap spaces use a few large files; 128 descriptors cover a terabyte of 8 GiB swap files.
DEFAULT_MAX_OPEN_FILES = 128

# Requests an engine tracks for ``wait_all`` (a handle and its native request, well under
# 1 KiB each): past this many, those already finished stop being tracked, so a long run
# holds at most this many finished ones. Read when an IOEngine is built.
TRACKED_REQUESTS = 4096


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized 1-D tensor of ``nbytes`` bytes whose data starts on a 4 KiB boundary;
    buffers of 2 MiB and more are backed by transparent huge pages where the kernel allows it
    (see [Note: huge-page buffers]). Never pinned: the host tier page-locks its own buffers
    where a device needs it ([Note: pinned buffers] in offload/tiers/host.py)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(f"nbytes={nbytes} is not a multiple of {dtype}'s size {itemsize}")
    if nbytes < HUGE_PAGE_BYTES:
        raw = torch.empty(nbytes + ALIGN_BYTES, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGN_BYTES
        return raw[skip:skip + nbytes].view(dtype)
    return _huge_page_empty(nbytes).view(dtype)


# [Note: huge-page buffers]
# An O_DIRECT transfer is handed to the device as a list of physically contiguous segments,
# and a device takes a bounded number per request (virtio-blk: max_segments 254). A buffer of
# scattered 4 KiB pages therefore splits every block into requests of at most ~1 MiB, and
# more, smaller requests move fewer bytes a second; from 2 MiB huge pages a block goes out
# whole, one request. So CPU buffers of 2 MiB and more are anonymous mappings aligned to 2 MiB
# with MADV_HUGEPAGE on their whole huge pages (the tail stays in 4 KiB pages, so resident
# memory is never rounded up). The kernel may still decline (THP "never", fragmentation):
# the buffer is then ordinary pages, only slower. For a CUDA device the host tier page-locks
# such a buffer in place ([Note: pinned buffers]).
HUGE_PAGE_BYTES = 2 << 20


def _huge_page_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` uninitialized bytes at a 2 MiB boundary, MADV_HUGEPAGE before first touch."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    skip = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    huge_bytes = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, skip, huge_bytes)
        except OSError:  # kernel without THP: ordinary pages
            pass
    return raw[skip:skip + nbytes]


def _check_tensor(tensor, name: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_offset(offset) -> int:
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    return offset


class IOHandle:
    """Completion of one request. Keeps its tensor alive until the request is finished."""

    __slots__ = ("_request", "_tensor", "_result")

    def __init__(self, request, tensor: torch.Tensor):
        self._request = request
        self._tensor = tensor
        self._result: Optional[int] = None

    def done(self) -> bool:
        return self._request.done()

    def times(self) -> Optional[Tuple[float, float]]:
        """(first block issued, finished) in ``time.perf_counter()`` seconds once the
        request is done, else None."""
        if not self._request.done():
            return None
        return self._request.started, self._request.finished

    def wait(self) -> int:
        """Blocks until finished; returns the bytes moved or raises ``OSError``."""
        if self._result is None:
            try:
                self._result = self._request.wait()
            finally:
                self._tensor = None  # finished either way: the engine no longer touches it
        return self._result


class IOEngine:
    """Asynchronous reads and writes of tensor bytes; see the module docstring.

    backend: "auto" (the first of io_uring, libaio, threads that completes a real aligned
        write+read in ``probe_dir``; see [Note: auto backend choice] in probe.py), or one of
        "io_uring", "libaio", "threads".
    block_bytes: largest single kernel request; larger requests are split. Multiple of 4096.
    queue_depth: blocks kept in flight at once.
    probe_dir: where "auto" probes (default: the temp directory); pass the swap directory so
        the choice reflects the device that will be used.
    max_open_files: files kept open between requests (each holds a file descriptor); 0 opens
        and closes the file for every request.
    warn_buffered: warn (once) when a file is opened without O_DIRECT because its filesystem
        refuses it; False where that is expected.
    """

    def __init__(self, backend: str = "auto", block_bytes: int = 1 << 20, queue_depth: int = 32,
                 probe_dir: Optional[str] = None, *,
                 max_open_files: int = DEFAULT_MAX_OPEN_FILES, warn_buffered: bool = True):
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        for name, value in (("block_bytes", block_bytes), ("queue_depth", queue_depth),
                            ("max_open_files", max_open_files)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not isinstance(warn_buffered, bool):
            raise TypeError(f"warn_buffered must be a bool, got {type(warn_buffered).__name__}")
        if block_bytes <= 0 or block_bytes % ALIGN_BYTES or block_bytes > (1 << 30):
            raise ValueError(
                f"block_bytes must be a positive multiple of {ALIGN_BYTES} up to 1 GiB, "
                f"got {block_bytes}")
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in [1, 4096], got {queue_depth}")
        if max_open_files < 0:
            raise ValueError(f"max_open_files must be >= 0, got {max_open_files}")
        if backend == "auto":
            backend = auto_backend(probe_dir or tempfile.gettempdir())
        self._core = _native.IOEngineCore(backend, block_bytes, queue_depth, max_open_files)
        self.backend: str = backend
        self.block_bytes = block_bytes
        self.queue_depth = queue_depth
        self._pending: List[IOHandle] = []
        self._tracked_requests = TRACKED_REQUESTS
        self._warned_buffered = not warn_buffered
        self._closed = False

    def read_into(self, tensor: torch.Tensor, path, offset: int = 0) -> IOHandle:
        """Starts reading ``tensor.nbytes`` bytes of ``path`` at ``offset`` into ``tensor``."""
        return self._submit(False, tensor, path, offset)

    def write_from(self, tensor: torch.Tensor, path, offset: int = 0) -> IOHandle:
        """Starts writing the bytes of ``tensor`` to ``path`` at ``offset``."""
        return self._submit(True, tensor, path, offset)

    def _submit(self, is_write: bool, tensor, path, offset) -> IOHandle:
        _check_tensor(tensor)
        path = check_path(path)
        offset = _check_offset(offset)
        if self._closed:
            raise ValueError("I/O engine is closed")
        nbytes = tensor.numel() * tensor.element_size()
        request = self._core.submit(is_write, tensor.data_ptr(), nbytes, path, offset)
        handle = IOHandle(request, tensor)
        self._pending.append(handle)
        if len(self._pending) > self._tracked_requests:
            self._pending = [h for h in self._pending if not h.done()]
        if not self._warned_buffered and self._core.num_buffered_opens:
            self._warned_buffered = True
            warnings.warn(
                f"{path}: the filesystem does not honor O_DIRECT; this engine falls back to "
                "buffered I/O with fdatasync on write completion there (slower, uses page cache)",
                RuntimeWarning, stacklevel=3)
        return handle

    def wait_all(self) -> None:
        """Waits for every request; raises the first ``OSError`` not yet seen via ``wait()``.

        Requests dropped from tracking after finishing (see _submit) had their errors
        observable only through their handles."""
        pending, self._pending = self._pending, []
        self._core.wait_all()
        first_error = None
        for handle in pending:
            if handle._result is not None:
                continue
            try:
                handle.wait()
            except OSError as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    @property
    def num_open_files(self) -> int:
        """Files the engine holds open now between requests."""
        return self._core.num_open_files

    def close_files(self) -> None:
        """Closes the files held open between requests (those in use by requests in flight
        close when the requests finish). Call it before removing files this engine moved
        bytes of, so their disk space is freed at once."""
        if not self._closed:
            self._core.close_files()

    def hold_file(self, path, fd: int) -> None:
        """Requests naming ``path`` use (a duplicate of) the open file ``fd`` from now on and
        never resolve ``path`` again; see [Note: held files] in native/io/file_cache.h. ``fd``
        stays the caller's to close. ``OSError`` if ``fd`` is not an open file."""
        path = check_path(path)
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise TypeError(f"fd must be a non-negative int, got {fd!r}")
        if self._closed:
            raise ValueError("I/O engine is closed")
        self._core.hold_file(path, fd)

    def release_file(self, path) -> bool:
        """Lets go of a file given to ``hold_file``; False if ``path`` was not held."""
        return False if self._closed else self._core.release_file(check_path(path))

    def close(self) -> None:
        """Waits for everything in flight (errors are not raised here) and stops the engine."""
        if self._closed:
            return
        self._closed = True
        self._core.close()
        self._pending = []

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()
