"""The checkpoint directory on disk: its private files, and how a finished one is put in place.

[Note: atomic checkpoint directory] Every crash of a save leaves a complete checkpoint at
NAME, or a missing NAME with complete copies beside it that load_checkpoint(NAME) names and
the next save puts back. A save writes every file into ``.NAME.partial-PID-HEX`` beside
NAME, fsyncs each file, writes the manifest last, fsyncs the directory, and only then puts
it in place (``put_in_place``):

- no NAME yet: rename the partial directory to NAME, fsync the parent;
- replacing NAME where the filesystem can (``renameat2(RENAME_EXCHANGE)``: ext4, xfs,
  btrfs, tmpfs, ...): exchange the two directories in one step, fsync the parent, remove
  the partial name, which holds the old checkpoint now. NAME is complete at every instant;
- replacing NAME where it cannot (EINVAL or ENOSYS: NFS, older kernels, some FUSE mounts):
  rename NAME to ``.NAME.old-PID-HEX``, rename the partial directory to NAME, fsync the
  parent, remove the old one. An exception between the two renames renames the old one
  back; a kill between them leaves no NAME and two complete copies beside it.

A copy is complete when it holds a manifest: the manifest is written last and the
directory is fsynced before any rename, and removing a copy unlinks its manifest first, so a
manifest means every file is there. The next save into the same parent starts by cleaning
what dead processes left (``clean_stale``): where NAME is not complete, it renames the
newest complete copy back to NAME; then it removes the leftovers, a complete one only once
NAME is complete. Leftovers of live processes (a save in progress) are left alone.

Files are created 0600 and directories 0700 whatever the umask: a checkpoint holds the
whole model and its optimizer state (as the swap files do).

Each durable step hits a fault point ``checkpoint.save.<step>`` (offload/faults.py) just
before its system call; an OSError there, injected or real, names the path (``os_step``).
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
from typing import Any, Callable, Dict, List, Optional

from offload import faults
from offload.checkpoint.format import MANIFEST
from offload.errors import CheckpointError
from offload.io.swap import pid_alive

FILE_MODE = 0o600
DIR_MODE = 0o700
_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]+$")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# the errnos of a filesystem or kernel that cannot exchange: take the fallback
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _load_renameat2() -> Optional[Callable[..., int]]:
    """libc's renameat2 (glibc >= 2.28), or None where the C library lacks it."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_RENAMEAT2 = _load_renameat2()


def os_step(point: Optional[str], what: str, path: str, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, after fault point ``point`` (None: none): one durable step of a save.
    An OSError names what failed and ``path`` and keeps its errno (ENOSPC stays ENOSPC)."""
    try:
        if point is not None:
            faults.hit(point, path=path)
        return call(*args)
    except OSError as error:
        raise OSError(error.errno, f"save_checkpoint could not {what} ({error.strerror or error})",
                      path) from error


def create_file(path: str) -> int:
    """A new file for writing, mode 0600 whatever the umask; its descriptor."""
    fd = os_step("checkpoint.save.create", "create the file", path, os.open, path,
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os_step(None, "set the mode of", path, os.fchmod, fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: str, point: str) -> None:
    fd = os_step(None, "open the directory", path, os.open, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os_step(point, "fsync the directory", path, os.fsync, fd)
    finally:
        os.close(fd)


def is_complete(path: str) -> bool:
    """[Note: atomic checkpoint directory] A directory with a manifest."""
    return not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST))


def remove_checkpoint(path: str, first: str = MANIFEST) -> None:
    """Remove a checkpoint directory, the file that makes it complete (``first``: its
    manifest) first: interrupted, it is not complete. A symbolic link is removed itself,
    never what it points to."""
    if os.path.islink(path):
        os.unlink(path)
        return
    try:
        os.unlink(os.path.join(path, first))
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def make_partial(target: str) -> str:
    """The empty partial directory (0700) beside ``target`` that a save writes into."""
    parent, name = os.path.dirname(target), os.path.basename(target)
    partial = os.path.join(parent, f".{name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    os_step("checkpoint.save.mkdir", "create the directory", partial, os.mkdir, partial, DIR_MODE)
    os_step(None, "set the mode of", partial, os.chmod, partial, DIR_MODE)
    return partial


def _leftovers(parent: str) -> Dict[str, List[Dict[str, Any]]]:
    """Leftovers of saves in ``parent``, by the NAME they were for."""
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return {}
    found: Dict[str, List[Dict[str, Any]]] = {}
    for entry in entries:
        match = _STALE_RE.match(entry)
        if match:
            path = os.path.join(parent, entry)
            found.setdefault(match.group("name"), []).append(
                {"path": path, "pid": int(match.group("pid")), "complete": is_complete(path)})
    return found


def _newest_first(copies: List[Dict[str, Any]]) -> List[str]:
    """The complete copies' paths, the most recently finished first (by their manifests)."""
    complete = [c["path"] for c in copies if c["complete"]]
    return sorted(complete, key=lambda p: os.stat(os.path.join(p, MANIFEST)).st_mtime_ns, reverse=True)


def complete_copies_beside(ckpt_dir: str) -> List[str]:
    """Complete checkpoints that interrupted saves into ``ckpt_dir`` left beside it, newest first."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    copies = _leftovers(os.path.dirname(ckpt_dir)).get(os.path.basename(ckpt_dir), [])
    return _newest_first(copies)


def refuse_missing(ckpt_dir: str, what: str) -> None:
    """A CheckpointError naming the complete copies beside ``ckpt_dir`` when it is not a
    complete checkpoint and an interrupted save left some; else nothing (the caller's own
    checks report what is wrong)."""
    if is_complete(ckpt_dir):
        return
    copies = complete_copies_beside(ckpt_dir)
    if copies:
        raise CheckpointError(
            f"{what}: checkpoint {ckpt_dir!r} does not exist (or has no {MANIFEST}): a save into it "
            f"was interrupted and left {len(copies)} complete checkpoint(s) beside it, newest first: "
            f"{', '.join(repr(c) for c in copies)}; load one of them, or rename it to "
            f"{os.path.basename(ckpt_dir)!r}; once the process that left them has exited, the next "
            f"save_checkpoint into {os.path.dirname(ckpt_dir)!r} renames the newest back itself")


def clean_stale(parent: str) -> None:
    """[Note: atomic checkpoint directory] What saves of dead processes left in ``parent``:
    for each NAME that is not complete, its newest complete copy is renamed back to NAME;
    then the leftovers go, a complete one only once NAME is complete."""
    for name, leftovers in _leftovers(parent).items():
        dead = [c for c in leftovers if not pid_alive(c["pid"])]
        target = os.path.join(parent, name)
        newest = _newest_first(dead)
        # NAME missing, or an empty directory (which rename replaces): put a copy back
        if newest and not is_complete(target) and (not os.path.lexists(target) or _is_empty_dir(target)):
            os_step("checkpoint.save.restore", "rename a complete copy back to", target,
                    os.rename, newest[0], target)
            fsync_dir(parent, "checkpoint.save.parent_fsync")
            dead = [c for c in dead if c["path"] != newest[0]]
        keep_complete = not is_complete(target)
        for c in dead:
            if not (c["complete"] and keep_complete):
                os_step("checkpoint.save.remove_stale", "remove", c["path"], remove_checkpoint, c["path"])


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path)


def _exchange(partial: str, target: str) -> bool:
    """Swap ``partial`` and ``target`` in one step; False where the filesystem or the
    kernel cannot (then nothing moved)."""
    try:
        faults.hit("checkpoint.save.exchange", path=target)
        if _RENAMEAT2 is None:
            raise OSError(errno.ENOSYS, "renameat2 is not in this C library")
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(partial), _AT_FDCWD, os.fsencode(target), _RENAME_EXCHANGE):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    except OSError as error:
        if error.errno in _NO_EXCHANGE:
            return False
        raise OSError(error.errno, f"save_checkpoint could not exchange the finished checkpoint "
                      f"{partial!r} with the one it replaces ({error.strerror or error})", target) from error
    return True


def put_in_place(partial: str, target: str) -> None:
    """[Note: atomic checkpoint directory] The finished ``partial`` becomes ``target``.
    On an exception ``target`` is complete (the old or the new checkpoint) and the caller
    removes ``partial``, whichever checkpoint it then holds."""
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        os_step("checkpoint.save.rename", "rename the finished checkpoint to", target,
                os.rename, partial, target)
        fsync_dir(parent, "checkpoint.save.parent_fsync")
        return
    if _exchange(partial, target):  # partial holds the old checkpoint now
        fsync_dir(parent, "checkpoint.save.parent_fsync")
        os_step("checkpoint.save.remove_old", "remove the replaced checkpoint", partial, remove_checkpoint, partial)
        return
    old = os.path.join(parent, f".{os.path.basename(target)}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os_step("checkpoint.save.rename_aside", "rename aside the checkpoint it replaces", target,
            os.rename, target, old)
    try:
        os_step("checkpoint.save.rename", "rename the finished checkpoint to", target, os.rename, partial, target)
    except BaseException as error:
        try:
            os.rename(old, target)
        except OSError as undo:
            raise OSError(undo.errno, f"save_checkpoint failed ({error}) and could not rename the "
                          f"checkpoint it replaces back ({undo.strerror}); that one is complete at {old!r}",
                          target) from error
        raise
    try:
        fsync_dir(parent, "checkpoint.save.parent_fsync")
        os_step("checkpoint.save.remove_old", "remove the replaced checkpoint", old, remove_checkpoint, old)
    except BaseException:
        remove_checkpoint(old)
        raise
