"""SwapSpace: the swap files of one run under the user's swap directory.

Layout under ``swap_dir``:
  .offload.lock                 flock()ed for the whole run; holds the owner's pid, so a second
                                run on the same directory is refused with a message naming it
  offload-run-<pid>-<hex>/      mode 0700, removed by close()
    lock                        flock()ed by the owner; pid inside (stale-run detection)
    swap-0000.bin ...           mode 0600, each ``file_bytes`` (or one extent, if larger)

Extents are 4 KiB aligned so they can be moved with O_DIRECT. The allocator is first-fit over
the files in creation order, with neighbours coalesced on free, so freeing everything makes
the whole capacity one free range per file again.
"""
from __future__ import annotations

import bisect
import errno
import fcntl
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from offload.io.probe import ALIGN_BYTES, probe_o_direct

_LOCK_NAME = ".offload.lock"
_RUN_PREFIX = "offload-run-"
# Free space required beyond reserve_bytes: filesystem metadata, and other files of the run.
_MARGIN_BYTES = 64 << 20


@dataclass(frozen=True)
class Extent:
    path: str
    offset: int
    nbytes: int


def _align_up(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class ExtentAllocator:
    """First-fit allocator over growable files; pure bookkeeping (``grow`` makes the file).

    Invariants: free ranges of a file are sorted, disjoint and never adjacent (coalesced);
    free + allocated bytes of a file equal its size.
    """

    def __init__(self, file_bytes: int, grow: Callable[[int, int], str]):
        self._file_bytes = file_bytes
        self._grow = grow  # (file_index, nbytes) -> path of a new file of nbytes
        self._paths: List[str] = []
        self._index_of: Dict[str, int] = {}
        self._free: List[List[Tuple[int, int]]] = []  # per file: sorted (offset, nbytes)
        self._allocated: Dict[Tuple[int, int], int] = {}  # (file, offset) -> nbytes
        self.capacity_bytes = 0
        self.used_bytes = 0

    def allocate(self, nbytes: int) -> Extent:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        nbytes = _align_up(nbytes)
        for index, free in enumerate(self._free):
            for position, (offset, size) in enumerate(free):
                if size >= nbytes:
                    if size == nbytes:
                        del free[position]
                    else:
                        free[position] = (offset + nbytes, size - nbytes)
                    return self._take(index, offset, nbytes)
        index = len(self._paths)
        size = max(self._file_bytes, nbytes)
        path = self._grow(index, size)
        self._paths.append(path)
        self._index_of[path] = index
        self._free.append([(nbytes, size - nbytes)] if size > nbytes else [])
        self.capacity_bytes += size
        return self._take(index, 0, nbytes)

    def _take(self, index: int, offset: int, nbytes: int) -> Extent:
        self._allocated[(index, offset)] = nbytes
        self.used_bytes += nbytes
        return Extent(self._paths[index], offset, nbytes)

    def free(self, extent: Extent) -> None:
        index = self._index_of.get(extent.path)
        key = (index, extent.offset)
        if index is None or self._allocated.get(key) != extent.nbytes:
            raise ValueError(f"{extent} is not an allocated extent of this swap space")
        del self._allocated[key]
        self.used_bytes -= extent.nbytes
        free = self._free[index]
        offset, size = extent.offset, extent.nbytes
        position = bisect.bisect_left(free, (offset, 0))
        if position < len(free) and free[position][0] == offset + size:  # next neighbour
            size += free[position][1]
            del free[position]
        if position > 0 and sum(free[position - 1]) == offset:  # previous neighbour
            offset, size = free[position - 1][0], free[position - 1][1] + size
            position -= 1
            del free[position]
        free.insert(position, (offset, size))

    def free_ranges(self) -> List[Tuple[str, int, int]]:
        return [(self._paths[i], o, n) for i, free in enumerate(self._free) for o, n in free]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip() or "0") or None
    except (OSError, ValueError):
        return None


def _lock_file(path: str) -> Optional[int]:
    """Opens and flock()s path (exclusive, non-blocking); returns the fd or None if held.

    The holder unlinks the lock file when it closes (the swap directory is left as it was
    found), so after winning the lock we check that the path still names the inode we
    locked; if not, another run removed it meanwhile and we try again on the new file."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class SwapSpace:
    """The swap files of one run. See the module docstring for the layout.

    swap_dir: where the run directory is created (created itself if missing).
    reserve_bytes: bytes of swap the run expects to need; checked against free space up front.
    file_bytes: size of each swap file; the space grows by one file when full.
    """

    def __init__(self, swap_dir, reserve_bytes: int = 0, file_bytes: int = 1 << 30):
        if not isinstance(swap_dir, (str, os.PathLike)):
            raise TypeError(f"swap_dir must be a str or os.PathLike, got {type(swap_dir).__name__}")
        for name, value in (("reserve_bytes", reserve_bytes), ("file_bytes", file_bytes)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        if file_bytes <= 0 or file_bytes % ALIGN_BYTES:
            raise ValueError(f"file_bytes must be a positive multiple of {ALIGN_BYTES}, "
                             f"got {file_bytes}")
        self._closed = True  # until fully set up: close() then has nothing to undo
        self._dir_lock_fd: Optional[int] = None
        self._run_lock_fd: Optional[int] = None
        swap_dir = os.path.abspath(os.fspath(swap_dir))
        self.swap_dir = swap_dir

        # 1. Preflight, before any file is created.
        try:
            os.makedirs(swap_dir, exist_ok=True)
        except OSError as error:
            raise ValueError(f"swap_dir {swap_dir!r} cannot be created: {error.strerror}") from None
        if not os.path.isdir(swap_dir):
            raise ValueError(f"swap_dir {swap_dir!r} is not a directory")
        if not os.access(swap_dir, os.W_OK | os.X_OK):
            raise ValueError(f"swap_dir {swap_dir!r} is not writable")
        stats = os.statvfs(swap_dir)
        free_bytes = stats.f_bavail * stats.f_frsize
        needed_bytes = reserve_bytes + _MARGIN_BYTES
        if free_bytes < needed_bytes:
            raise ValueError(
                f"swap_dir {swap_dir!r} has {free_bytes} bytes free but needs {needed_bytes} "
                f"(reserve_bytes={reserve_bytes} + margin {_MARGIN_BYTES})")
        try:
            probe = probe_o_direct(swap_dir)
        except OSError as error:
            raise ValueError(f"swap_dir {swap_dir!r} is not writable: {error.strerror}") from None
        self.o_direct: bool = bool(probe["o_direct"])
        if not self.o_direct:
            warnings.warn(f"swap_dir {swap_dir!r} does not honor O_DIRECT "
                          f"({probe['o_direct_error']}); swap I/O will be buffered",
                          RuntimeWarning, stacklevel=2)

        # 2. One run per directory.
        lock_path = os.path.join(swap_dir, _LOCK_NAME)
        self._dir_lock_fd = _lock_file(lock_path)
        if self._dir_lock_fd is None:
            raise RuntimeError(f"swap_dir {swap_dir!r} is in use by another run (pid "
                               f"{_read_pid(lock_path)}, lock file {lock_path})")
        try:
            # 3. Remove what killed runs left behind; report live ones.
            self.live_runs: List[Tuple[str, Optional[int]]] = []
            self.removed_stale_runs: List[str] = self._clean_stale_runs()

            # 4. This run's private directory.
            name = f"{_RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            self.run_dir = os.path.join(swap_dir, name)
            os.mkdir(self.run_dir, 0o700)
            os.chmod(self.run_dir, 0o700)
            self._run_lock_fd = _lock_file(os.path.join(self.run_dir, "lock"))
        except BaseException:
            os.close(self._dir_lock_fd)
            self._dir_lock_fd = None
            raise
        self._allocator = ExtentAllocator(file_bytes, self._create_file)
        self.reserve_bytes = reserve_bytes
        self.file_bytes = file_bytes
        self._closed = False

    def _clean_stale_runs(self) -> List[str]:
        removed = []
        for entry in sorted(os.listdir(self.swap_dir)):
            path = os.path.join(self.swap_dir, entry)
            if not entry.startswith(_RUN_PREFIX) or not os.path.isdir(path):
                continue
            lock_path = os.path.join(path, "lock")
            pid = _read_pid(lock_path)
            fd = _lock_file(lock_path) if os.path.exists(lock_path) else None
            held = os.path.exists(lock_path) and fd is None
            if fd is not None:
                os.close(fd)
            if held or (pid is not None and pid_alive(pid)):
                self.live_runs.append((path, pid))
                warnings.warn(f"swap_dir holds the run directory {path} of a live process "
                              f"(pid {pid}); leaving it alone", RuntimeWarning, stacklevel=3)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def _create_file(self, index: int, nbytes: int) -> str:
        path = os.path.join(self.run_dir, f"swap-{index:04d}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # fail now, not in the middle of a step
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise OSError(error.errno, f"cannot reserve {nbytes} bytes for swap file: "
                                  f"{error.strerror}", path) from None
                os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        return path

    def allocate(self, nbytes: int) -> Extent:
        """A free extent of at least ``nbytes`` (rounded up to 4 KiB), growing the space."""
        self._check_open()
        return self._allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self._check_open()
        self._allocator.free(extent)

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes if not self._closed else 0

    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity_bytes if not self._closed else 0

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("swap space is closed")

    def close(self) -> None:
        """Removes the run directory and its files and releases the locks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.run_dir, ignore_errors=True)
        try:  # unlink while still holding the lock; see _lock_file
            os.unlink(os.path.join(self.swap_dir, _LOCK_NAME))
        except FileNotFoundError:
            pass
        for fd in (self._run_lock_fd, self._dir_lock_fd):
            if fd is not None:
                os.close(fd)
        self._run_lock_fd = self._dir_lock_fd = None

    def __enter__(self) -> "SwapSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
