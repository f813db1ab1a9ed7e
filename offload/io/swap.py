"""SwapSpace: the swap files of one run under the user's swap directory.

Layout under ``swap_dir``:
  .offload.lock                 flock()ed for the whole run; holds the owner's pid, so a second
                                run on the same directory is refused with a message naming it
  offload-run-<pid>-<hex>/      mode 0700, removed by close()
    lock                        flock()ed by the owner for the whole run (stale-run detection)
    swap-0000.bin ...           mode 0600, sized from the plan: see SwapSpace's file_bytes

Extents are 4 KiB aligned so they can be moved with O_DIRECT. The allocator is first-fit over
the files in creation order, with neighbours coalesced on free, so freeing everything makes
the whole capacity one free range per file again. An extent carved from bytes that no extent
held before reads as zeros (the files are created zero-filled) and says so (``zeroed``); one
that reuses freed bytes holds whatever was written there.

[Note: swap directory trust]
The swap directory may be shared (/tmp, a scratch mount), so nothing in it is trusted by
name. ``swap_dir`` itself is refused when another user owns it or can write to it without the
sticky bit (a ValueError naming it): in such a directory anyone could rename our entries. Every
entry is reached through a descriptor of its directory (``dir_fd``) with O_NOFOLLOW, and what
is opened is checked to be a regular file (or directory) of this user before it is used: a
planted symlink or a foreign file is an error, never followed or truncated. Swap files are
opened once, at creation, and their descriptors handed to the I/O engine (``hold``), so
requests never resolve a path again: a run directory renamed away or a swap file replaced by
a symlink afterwards is not written through. Removal (close, stale runs) works on descriptors
too and leaves alone a name that no longer names what this run created.

[Note: stale runs]
A run killed without close() (SIGKILL, a crash, power loss) leaves its run directory. The next
SwapSpace in the same directory removes it: a run directory is live exactly when the flock on
its ``lock`` is held (the kernel drops it when the process dies, whatever its pid now names:
in containers a new trainer often gets the dead one's pid), so pids are only reported, never
trusted. Removal is reported: a warning with the bytes freed, ``removed_stale_runs`` and
``stale_bytes_removed``. SIGTERM removes the run's files as Ctrl-C does, see [Note: SIGTERM].
"""
from __future__ import annotations

import atexit
import bisect
import errno
import fcntl
import os
import secrets
import signal
import stat
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from offload.errors import warn_at_caller
from offload.io.probe import ALIGN_BYTES, probe_o_direct

_LOCK_NAME = ".offload.lock"
_RUN_PREFIX = "offload-run-"
# Free space required beyond reserve_bytes: filesystem metadata, and other files of the run.
_MARGIN_BYTES = 64 << 20
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Extent:
    path: str
    offset: int
    nbytes: int
    # Read as zeros when allocated: carved from bytes of its swap file that no extent held
    # before (files are created zero-filled, fallocate or ftruncate). A fact about the
    # allocation only: what was written to the extent since is the NVMe tier's to know
    # ([Note: zeroed extents] in offload/tiers/nvme.py).
    zeroed: bool = field(default=False, compare=False, repr=False)


# A unit with no elements (a model's root when every parameter is in its blocks) has a home
# of no bytes: reading or writing it moves nothing and touches no file.
EMPTY_EXTENT = Extent("", 0, 0)


def _align_up(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


class ExtentAllocator:
    """First-fit allocator over growable files; pure bookkeeping (``grow`` makes the file).

    file_bytes: size of each new file (an extent larger than that gets a file of its own size).
    first_file_bytes: size of the first file, when it differs (the plan's total: see SwapSpace).

    Invariants: free ranges of a file are sorted, disjoint and never adjacent (coalesced);
    free + allocated bytes of a file equal its size.
    """

    def __init__(self, file_bytes: int, grow: Callable[[int, int], str],
                 first_file_bytes: Optional[int] = None):
        self._file_bytes = file_bytes
        self._first_file_bytes = file_bytes if first_file_bytes is None else first_file_bytes
        self._grow = grow  # (file_index, nbytes) -> path of a new file of nbytes
        self._paths: List[str] = []
        self._index_of: Dict[str, int] = {}
        self._free: List[List[Tuple[int, int]]] = []  # per file: sorted (offset, nbytes)
        # per file: the end of the bytes any extent has held; beyond it the file is as created
        self._high_water: List[int] = []
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
        size = max(self._first_file_bytes if index == 0 else self._file_bytes, nbytes)
        path = self._grow(index, size)
        self._paths.append(path)
        self._index_of[path] = index
        self._free.append([(nbytes, size - nbytes)] if size > nbytes else [])
        self._high_water.append(0)
        self.capacity_bytes += size
        return self._take(index, 0, nbytes)

    def _take(self, index: int, offset: int, nbytes: int) -> Extent:
        self._allocated[(index, offset)] = nbytes
        self.used_bytes += nbytes
        zeroed = offset >= self._high_water[index]  # no extent held these bytes before
        self._high_water[index] = max(self._high_water[index], offset + nbytes)
        return Extent(self._paths[index], offset, nbytes, zeroed=zeroed)

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


def usable_bytes(swap_dir: "str | os.PathLike") -> Optional[int]:
    """Bytes a SwapSpace in ``swap_dir`` (or, before it exists, its nearest existing parent)
    may reserve: the free space less the margin SwapSpace keeps. None where unreadable."""
    path = os.path.abspath(os.fspath(swap_dir))
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return max(0, stats.f_bavail * stats.f_frsize - _MARGIN_BYTES)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(fd: int) -> Optional[int]:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or "0") or None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _check_own(st: os.stat_result, kind: str, path: str) -> None:
    """[Note: swap directory trust] ``st`` (of an open descriptor) is a ``kind`` ("file" or
    "directory") owned by this user; a ValueError naming ``path`` otherwise."""
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        what = "a directory" if kind == "directory" else "a regular file"
        raise ValueError(f"{path} is not {what}; remove it (swap_dir entries are never followed "
                         "or replaced)")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}); "
                         "remove it or use another swap_dir")


def _open_own(name: str, dir_fd: int, path: str, flags: int, kind: str = "file") -> int:
    """Opens ``name`` under ``dir_fd`` without following a symlink and checks it is this user's
    ``kind``; a ValueError naming ``path`` when it is a symlink or someone else's."""
    try:
        fd = os.open(name, flags | _NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP or (error.errno == errno.ENOTDIR and kind == "directory"):
            raise ValueError(f"{path} is a symbolic link or not a {kind}; refusing to follow it "
                             "(remove it)") from None
        raise OSError(error.errno, error.strerror, path) from None  # named in full, not by dir_fd
    try:
        _check_own(os.fstat(fd), kind, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_swap_dir(st: os.stat_result, swap_dir: str) -> None:
    """[Note: swap directory trust] Refuse a swap_dir that someone else can rename entries of."""
    if st.st_uid not in (os.geteuid(), 0):
        raise ValueError(f"swap_dir {swap_dir!r} is owned by uid {st.st_uid}, neither this user "
                         f"({os.geteuid()}) nor root: its owner could replace the run's files")
    others_write = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid != os.getegid())
    if others_write and not st.st_mode & stat.S_ISVTX:
        raise ValueError(f"swap_dir {swap_dir!r} is writable by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}) and not sticky: they could replace the "
                         "run's files; use a directory only you can write to, or chmod +t it")


def _lock_file(name: str, dir_fd: int, path: str, create: bool = True) -> Optional[int]:
    """Opens and flock()s ``name`` under ``dir_fd`` (exclusive, non-blocking; never through a
    symlink, only a regular file of this user); returns the fd, or None if another holds it.

    The holder unlinks the lock file when it closes (the swap directory is left as it was
    found), so after winning the lock we check that the name still names the inode we
    locked; if not, another run removed it meanwhile and we try again on the new file."""
    while True:
        fd = _open_own(name, dir_fd, path, os.O_RDWR | (os.O_CREAT if create else 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _remove_tree(name: str, dir_fd: int) -> int:
    """Removes the directory ``name`` under ``dir_fd`` and what it holds, never following a
    symlink (a symlink inside is unlinked, not its target); returns the bytes freed."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=dir_fd)
    freed = 0
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    freed += _remove_tree(entry.name, fd)
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    freed += st.st_blocks * 512
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)
    return freed


def remove_if_dead(dir_fd: int, name: str, path: str, lock_name: str,
                   no_lock_means_dead: bool = True) -> Optional[int]:
    """Removes the directory ``name`` under ``dir_fd`` (``path``, for messages) unless a live
    process holds the flock on its ``lock_name`` (or it has none and not no_lock_means_dead);
    returns the bytes freed, or None when it was left. Never follows a symlink; a ValueError
    when ``name`` is not a directory of this user ([Note: swap directory trust])."""
    try:
        fd = _open_own(name, dir_fd, path, os.O_RDONLY | os.O_DIRECTORY, "directory")
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror}") from None
    lock_fd: Optional[int] = -1
    try:
        try:
            lock_fd = _lock_file(lock_name, fd, os.path.join(path, lock_name), create=False)
        except FileNotFoundError:
            if not no_lock_means_dead:
                return None
        except (OSError, ValueError):  # a lock that is not ours: no run of this user holds it
            pass
        if lock_fd is None:
            return None
        if os.fstat(fd).st_ino != os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino:
            return None  # renamed meanwhile: not the directory we checked
        return _remove_tree(name, dir_fd)
    finally:
        if lock_fd is not None and lock_fd >= 0:
            os.close(lock_fd)
        os.close(fd)


def _holder_pid(dir_fd: int, name: str) -> Optional[int]:
    """The pid a live run wrote into its lock, for messages only ([Note: stale runs])."""
    try:
        fd = os.open(os.path.join(name, "lock"), os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return _read_pid(fd)
    finally:
        os.close(fd)


# [Note: SIGTERM]
# Ctrl-C raises KeyboardInterrupt, which unwinds through close() (or a with block); SIGTERM's
# default action kills the process on the spot and would leave the swap files until the next
# run in that directory. While a SwapSpace is open, SIGTERM's handler, where it is SIG_DFL in
# the main thread, removes the files of every open space and then re-delivers SIGTERM with the
# default action, so the process still ends "killed by SIGTERM". A handler the user installed
# (or SIG_IGN) is left alone: it decides what SIGTERM means (a graceful stop may still need
# the swap files); one installed later replaces ours. When the last space closes, SIG_DFL is
# put back if our handler is still the one installed.
_open_spaces: "weakref.WeakSet[SwapSpace]" = weakref.WeakSet()
_spaces_lock = threading.RLock()  # the handler runs on the main thread, maybe inside _track


def _on_sigterm(signum: int, frame: Any) -> None:
    for space in list(_open_spaces):  # close() leaves alone the spaces of a parent we forked from
        try:
            space.close()
        except Exception:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


@atexit.register
def _close_at_exit() -> None:
    """A process that ends without close() (returning from main, an uncaught exception,
    sys.exit) removes its runs' files too, as close() would, instead of leaving them until
    the next run in that directory. After the thread pools' own exit hooks have joined
    their workers (threading's, which run first); not after os._exit or a kill."""
    for space in list(_open_spaces):
        try:
            space.close()
        except Exception:  # noqa: BLE001 - the process is ending; what close() warns is shown
            pass


def _track(space: "SwapSpace") -> None:
    with _spaces_lock:
        _open_spaces.add(space)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _untrack(space: "SwapSpace") -> None:
    with _spaces_lock:
        _open_spaces.discard(space)
        if not _open_spaces and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _existing_non_directory(path: str) -> Optional[str]:
    """``path`` or the first of its ancestors that exists and is not a directory (a file
    in the way of makedirs), or None."""
    while True:
        if os.path.lexists(path) and not os.path.isdir(path):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


class SwapSpace:
    """The swap files of one run. See the module docstring for the layout.

    swap_dir: where the run directory is created (created itself, mode 0700, if missing).
    reserve_bytes: bytes of swap the run will allocate (wrap passes its plan); checked against
        free space up front.
    file_bytes: size of each swap file; the space grows by one file when full. None (the
        default): the first file is ``reserve_bytes`` (the plan, so a run allocating what it
        planned has exactly one file of exactly that size), any later one the extent that did
        not fit.
    """

    def __init__(self, swap_dir, reserve_bytes: int = 0, file_bytes: Optional[int] = None):
        if not isinstance(swap_dir, (str, os.PathLike)):
            raise TypeError(f"swap_dir must be a str or os.PathLike, got {type(swap_dir).__name__}")
        for name, value in (("reserve_bytes", reserve_bytes), ("file_bytes", file_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        if file_bytes is not None and (file_bytes <= 0 or file_bytes % ALIGN_BYTES):
            raise ValueError(f"file_bytes must be a positive multiple of {ALIGN_BYTES}, "
                             f"got {file_bytes}")
        self._closed = True  # until fully set up: close() then has nothing to undo
        # A forked child (a DataLoader worker) inherits the space and SIGTERM's handler, but
        # the files are the parent's: only the process that created them removes them.
        self._owner_pid = os.getpid()
        self._dir_fd: Optional[int] = None
        self._dir_lock_fd: Optional[int] = None
        self._run_fd: Optional[int] = None
        self._run_lock_fd: Optional[int] = None
        self._files: Dict[str, int] = {}  # swap file path -> its descriptor
        self._hold: Optional[Callable[[str, int], None]] = None
        swap_dir = os.path.abspath(os.fspath(swap_dir))
        self.swap_dir = swap_dir

        # 1. Preflight, before any file is created. [Note: swap directory trust]
        try:
            os.makedirs(swap_dir, mode=0o700, exist_ok=True)
        except OSError as error:
            blocker = _existing_non_directory(swap_dir)
            if blocker is not None:
                raise ValueError(f"swap_dir {swap_dir!r} cannot be created: {blocker!r} exists and is not a "
                                 "directory; choose another swap_dir or move that file") from None
            raise ValueError(f"swap_dir {swap_dir!r} cannot be created: {error.strerror}") from None
        try:
            dir_fd = os.open(swap_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            raise ValueError(f"swap_dir {swap_dir!r} is not a directory: {error.strerror}") from None
        try:
            _check_swap_dir(os.fstat(dir_fd), swap_dir)
            if not os.access(swap_dir, os.W_OK | os.X_OK):
                raise ValueError(f"swap_dir {swap_dir!r} is not writable")
            stats = os.fstatvfs(dir_fd)
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
        except BaseException:
            os.close(dir_fd)
            raise
        self.o_direct: bool = bool(probe["o_direct"])
        if not self.o_direct:
            warn_at_caller(f"swap_dir {swap_dir!r} does not honor O_DIRECT "
                           f"({probe['o_direct_error']}); swap I/O will be buffered")

        # 2. One run per directory.
        lock_path = os.path.join(swap_dir, _LOCK_NAME)
        try:
            self._dir_lock_fd = _lock_file(_LOCK_NAME, dir_fd, lock_path)
        except BaseException:
            os.close(dir_fd)
            raise
        if self._dir_lock_fd is None:
            pid = None
            try:
                fd = _open_own(_LOCK_NAME, dir_fd, lock_path, os.O_RDONLY)
                pid = _read_pid(fd)
                os.close(fd)
            except (OSError, ValueError):
                pass
            os.close(dir_fd)
            raise RuntimeError(f"swap_dir {swap_dir!r} is in use by another run (pid "
                               f"{pid}, lock file {lock_path})")
        self._dir_fd = dir_fd
        try:
            os.ftruncate(self._dir_lock_fd, 0)
            os.pwrite(self._dir_lock_fd, f"{os.getpid()}\n".encode(), 0)
            # 3. Remove what killed runs left behind; report live ones. [Note: stale runs]
            self.live_runs: List[Tuple[str, Optional[int]]] = []
            self.removed_stale_runs: List[str] = []
            self.stale_bytes_removed = 0
            self._clean_stale_runs()

            # 4. This run's private directory, reached through its descriptor from now on.
            name = f"{_RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            self.run_dir = os.path.join(swap_dir, name)
            self._run_name = name
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            self._run_fd = _open_own(name, dir_fd, self.run_dir, os.O_RDONLY | os.O_DIRECTORY, "directory")
            os.fchmod(self._run_fd, 0o700)
            self._run_lock_fd = _lock_file("lock", self._run_fd, os.path.join(self.run_dir, "lock"))
            assert self._run_lock_fd is not None, "a new run directory's lock is free"
            os.pwrite(self._run_lock_fd, f"{os.getpid()}\n".encode(), 0)
            # An extent of no bytes names the run's lock, opened as the swap files are (O_DIRECT
            # where honored, so it adds no "buffered" warning) and held like them: moving its no
            # bytes needs no file of its own.
            self.empty_extent = Extent(os.path.join(self.run_dir, "lock"), 0, 0)
            self._files[self.empty_extent.path] = self._open_for_io("lock", os.O_RDWR | _NOFOLLOW)
        except BaseException:
            self._closed = False
            self.close()
            raise
        self._allocator = ExtentAllocator(file_bytes or ALIGN_BYTES, self._create_file,
                                          first_file_bytes=file_bytes or _align_up(max(reserve_bytes, 1)))
        self.reserve_bytes = reserve_bytes
        self.file_bytes = file_bytes
        self._closed = False
        _track(self)
        if self.removed_stale_runs:
            warn_at_caller(f"swap_dir {swap_dir!r}: removed {len(self.removed_stale_runs)} run director"
                           f"{'y' if len(self.removed_stale_runs) == 1 else 'ies'} of killed runs, freeing "
                           f"{self.stale_bytes_removed} bytes: {', '.join(self.removed_stale_runs)}")

    def _clean_stale_runs(self) -> None:
        """[Note: stale runs] Removes the run directories (of this user) whose lock is free."""
        for entry in sorted(os.listdir(self._dir_fd)):
            if not entry.startswith(_RUN_PREFIX):
                continue
            path = os.path.join(self.swap_dir, entry)
            try:
                freed = remove_if_dead(self._dir_fd, entry, path, "lock")
            except ValueError as error:
                warn_at_caller(f"swap_dir holds {path}, which is not a run directory of this user "
                               f"({error}); leaving it alone")
                continue
            if freed is None:
                pid = _holder_pid(self._dir_fd, entry)
                self.live_runs.append((path, pid))
                warn_at_caller(f"swap_dir holds the run directory {path} of a live process "
                               f"(pid {pid}, its lock is held); leaving it alone")
                continue
            self.stale_bytes_removed += freed
            self.removed_stale_runs.append(path)

    def _create_file(self, index: int, nbytes: int) -> str:
        name = f"swap-{index:04d}.bin"
        path = os.path.join(self.run_dir, name)
        fd = self._open_for_io(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # fail now, not in the middle of a step
            except OSError as error:
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise OSError(error.errno, f"cannot reserve {nbytes} bytes for swap file: "
                                  f"{error.strerror}", path) from None
                os.ftruncate(fd, nbytes)
            if self._hold is not None:
                self._hold(path, fd)
        except BaseException:
            os.close(fd)
            os.unlink(name, dir_fd=self._run_fd)
            raise
        self._files[path] = fd
        return path

    def _open_for_io(self, name: str, flags: int) -> int:
        """``name`` in the run directory, opened with O_DIRECT where the filesystem honors it."""
        if self.o_direct:
            try:
                return os.open(name, flags | os.O_DIRECT, 0o600, dir_fd=self._run_fd)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
        return os.open(name, flags, 0o600, dir_fd=self._run_fd)

    def hold_files(self, hold: Callable[[str, int], None]) -> None:
        """Hands every file of the space, now and as it grows, to ``hold(path, fd)`` (the I/O
        engine's ``hold_file``), so that I/O uses the descriptors opened here and never
        resolves a path again ([Note: swap directory trust])."""
        self._check_open()
        self._hold = hold
        for path, fd in self._files.items():
            hold(path, fd)

    def allocate(self, nbytes: int) -> Extent:
        """A free extent of at least ``nbytes`` (rounded up to 4 KiB), growing the space;
        ``empty_extent`` for 0 bytes."""
        self._check_open()
        if nbytes == 0 and isinstance(nbytes, int) and not isinstance(nbytes, bool):
            return self.empty_extent
        return self._allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self._check_open()
        if extent != self.empty_extent:
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
        """Removes the run directory and its files and releases the locks. Idempotent. A name
        that no longer names what this run created is left alone ([Note: swap directory
        trust])."""
        if self._closed:
            return
        self._closed = True
        _untrack(self)
        for fd in self._files.values():
            os.close(fd)
        self._files = {}
        if self._run_fd is not None and os.getpid() == self._owner_pid:
            self._remove_run_directory()
        if self._dir_lock_fd is not None and os.getpid() == self._owner_pid:
            try:  # unlink while still holding the lock; see _lock_file
                if os.stat(_LOCK_NAME, dir_fd=self._dir_fd, follow_symlinks=False).st_ino == \
                        os.fstat(self._dir_lock_fd).st_ino:
                    os.unlink(_LOCK_NAME, dir_fd=self._dir_fd)
            except OSError:
                pass
        for fd in (self._run_lock_fd, self._run_fd, self._dir_lock_fd, self._dir_fd):
            if fd is not None:
                os.close(fd)
        self._run_lock_fd = self._run_fd = self._dir_lock_fd = self._dir_fd = None

    def _remove_run_directory(self) -> None:
        """The run directory's files, then the directory, if it is still the one this run
        made. The names are listed before any is unlinked, and listed again until none is
        left (a directory read while entries are removed may skip some, as on btrfs); what
        cannot be removed is warned about with its path, never dropped in silence."""
        path = os.path.join(self.swap_dir, self._run_name)
        try:
            run_ino = os.fstat(self._run_fd).st_ino
            for _ in range(3):
                with os.scandir(self._run_fd) as entries:
                    names = [entry.name for entry in entries]
                if not names:
                    break
                for name in names:
                    try:
                        os.unlink(name, dir_fd=self._run_fd)
                    except FileNotFoundError:
                        pass
            if os.stat(self._run_name, dir_fd=self._dir_fd, follow_symlinks=False).st_ino == run_ino:
                os.rmdir(self._run_name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass  # renamed or removed by someone else: not ours to find ([Note: swap directory trust])
        except OSError as error:
            warn_at_caller(f"close(): the run directory {path!r} could not be removed ({error.strerror}); "
                           "remove it by hand, or the next run in that swap_dir removes it")

    def __enter__(self) -> "SwapSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
