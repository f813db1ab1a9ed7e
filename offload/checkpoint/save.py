"""Saving a checkpoint: every rank writes its part ([Note: sharded checkpoints]), one unit
at a time ([Note: bounded checkpoint memory]), into a partial directory that is put in
place at the end ([Note: atomic checkpoint directory] in directory.py).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import random
import re
import threading
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, List, Optional, Tuple

import torch

from offload.checkpoint.access import Ranks, attempt
from offload.checkpoint.directory import (
    clean_stale, create_file, fsync_dir, make_partial, os_step, put_in_place, remove_checkpoint)
from offload.checkpoint.format import (
    COMPACT_SECTIONS, FORMAT, MANIFEST, VERSION, as_bytes, dtype_name, manifest_checksum, state_dict_aliases)
from offload.errors import warn_at_caller
from offload.optim.generic import scalars_to_json

if TYPE_CHECKING:
    from offload.checkpoint.access import CheckpointAccess
    from offload.memory.layout import UnitState


class _HashingWriter:
    """Writes a new file (0600, [Note: atomic checkpoint directory]) sequentially while
    hashing it; ``close`` fsyncs and returns (bytes, sha256). Every OSError names the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: BinaryIO = os.fdopen(create_file(path), "wb")
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, t: torch.Tensor) -> int:
        """Appends the tensor's bytes; returns the byte offset they start at."""
        return self.write_bytes(as_bytes(t))

    def write_bytes(self, data: "bytes | memoryview") -> int:
        offset = self.nbytes
        self._hash.update(data)
        os_step("checkpoint.save.write", "write", self.path, self._file.write, data)
        self.nbytes += len(data)
        return offset

    def close(self) -> Dict[str, Any]:
        try:
            os_step(None, "write", self.path, self._file.flush)
            os_step("checkpoint.save.fsync", "fsync", self.path, os.fsync, self._file.fileno())
        except BaseException:
            self.abort()
            raise
        self._file.close()
        return {"bytes": self.nbytes, "sha256": self._hash.hexdigest()}

    def abort(self) -> None:
        try:
            self._file.close()  # flushes what is buffered: may fail as the write did
        except OSError:
            pass


class _DirectWriter(_HashingWriter):
    """A _HashingWriter for the large unit files: the bytes go through page-aligned staging
    buffers, written with O_DIRECT a whole buffer at a time, and the tail (less than a
    buffer) through the page cache at close. O_DIRECT, because the kernel's writeback
    throttles buffered writes of tens of GB to a fraction of the disk's speed. Where the
    filesystem refuses O_DIRECT (tmpfs: at open; some others: EINVAL at the first write)
    the buffers go through the page cache instead.

    A full stage is hashed on one thread and written on another while the caller fills the
    next one (STAGES of them in turn): reading the states from their tiers, sha256 and the
    write cost about the same, so they overlap rather than run one after the other. A
    write's OSError comes out of the next ``write`` or of ``close``, naming the file."""

    STAGE_BYTES = 8 << 20
    STAGES = 3

    def __init__(self, path: str) -> None:
        super().__init__(path)
        from offload.io import aligned_empty

        self._direct: Optional[int] = None
        try:
            self._direct = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except (OSError, AttributeError):
            pass
        self._stages = [memoryview(aligned_empty(self.STAGE_BYTES).numpy()) for _ in range(self.STAGES)]
        self._free: "queue.Queue[int]" = queue.Queue()
        for i in range(1, self.STAGES):
            self._free.put(i)
        self._to_hash: "queue.Queue[Optional[Tuple[int, int, int, bool]]]" = queue.Queue()
        self._to_write: "queue.Queue[Optional[Tuple[int, int, int, bool]]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._stage, self._staged = 0, 0  # the stage being filled, and its bytes so far
        self._flushed = 0  # bytes handed off before them (the stage's offset in the file)
        self._threads = [threading.Thread(target=self._hash_stages, daemon=True, name="offload-checkpoint-hash"),
                         threading.Thread(target=self._write_stages, daemon=True, name="offload-checkpoint-write")]
        for thread in self._threads:
            thread.start()

    def write_bytes(self, data: "bytes | memoryview") -> int:
        offset = self.nbytes
        os_step("checkpoint.save.write", "write", self.path, self._stage_bytes, memoryview(data).cast("B"))
        self.nbytes += len(data)
        return offset

    def _stage_bytes(self, data: memoryview) -> None:
        while len(data):
            n = min(len(data), self.STAGE_BYTES - self._staged)
            self._stages[self._stage][self._staged:self._staged + n] = data[:n]
            self._staged += n
            data = data[n:]
            if self._staged == self.STAGE_BYTES:
                self._hand_off(direct=True)
                self._stage = self._free.get()

    def _hand_off(self, direct: bool) -> None:
        """The stage being filled goes to be hashed and written at the file's end."""
        if self._error is not None:
            raise self._error
        self._to_hash.put((self._stage, self._staged, self._flushed, direct))
        self._flushed += self._staged
        self._staged = 0

    def _hash_stages(self) -> None:
        while True:
            item = self._to_hash.get()
            if item is not None:
                self._hash.update(self._stages[item[0]][:item[1]])
            self._to_write.put(item)
            if item is None:
                return

    def _write_stages(self) -> None:
        while True:
            item = self._to_write.get()
            if item is None:
                return
            stage, n, offset, direct = item
            try:
                if self._error is None:
                    self._write_stage(self._stages[stage][:n], offset, direct)
            except BaseException as error:  # noqa: B902 - raised by the caller's next write or close
                self._error = error
            finally:
                self._free.put(stage)

    def _write_stage(self, data: memoryview, offset: int, direct: bool) -> None:
        """Write ``data`` at ``offset``: with O_DIRECT when ``direct`` and it is open, else
        through the page cache."""
        done, n = 0, len(data)
        while done < n:  # a short write goes on from where it stopped
            fd = self._direct if direct and self._direct is not None else self._file.fileno()
            try:
                done += os.pwrite(fd, data[done:n], offset + done)
            except OSError as error:
                if fd != self._direct or error.errno != errno.EINVAL:
                    raise
                self._close_direct()  # O_DIRECT opened but refused: the page cache from here

    def _stop(self) -> None:
        """Let the threads finish what was handed off, and end."""
        if self._threads:
            self._to_hash.put(None)
            for thread in self._threads:
                thread.join()
            self._threads = []

    def _close_direct(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None

    def _finish(self) -> None:
        """The tail goes out through the page cache; every stage is written."""
        if self._staged:
            self._hand_off(direct=False)
        self._stop()
        if self._error is not None:
            raise self._error

    def close(self) -> Dict[str, Any]:
        try:
            os_step(None, "write", self.path, self._finish)
        except BaseException:
            self.abort()
            raise
        self._close_direct()
        return super().close()

    def abort(self) -> None:
        self._stop()
        self._close_direct()
        super().abort()


def _jsonable_group(group: Dict[str, Any], index: int) -> Dict[str, Any]:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        try:
            json.dumps(value)
        except TypeError:
            warn_at_caller(f"save_checkpoint: param_groups[{index}][{key!r}] ({type(value).__name__}) "
                           "is not saved")
            continue
        out[key] = value
    return out


def _rng_python() -> Dict[str, Any]:
    state: Dict[str, Any] = {"random": [list(x) if isinstance(x, tuple) else x for x in random.getstate()]}
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    return state


def save_checkpoint(access: "CheckpointAccess", ckpt_dir: str) -> None:
    """[Note: sharded checkpoints] Every rank writes its part into one directory, which
    rank 0 prepares beforehand and completes (manifest, rename) afterwards."""
    ranks = Ranks(access, "save_checkpoint")
    ranks.agree("checks", attempt(lambda: access.check_allowed(saving=True))[1])
    target = os.path.abspath(os.fspath(ckpt_dir).rstrip("/") or "/")
    partial, error = attempt(lambda: _prepare_directory(target)) if ranks.rank == 0 else (None, None)
    ranks.agree("directory", error)
    partial = ranks.gather("directory name", partial)[0]
    try:
        written, error = attempt(lambda: _write_rank(access, partial))
        everyone = ranks.gather("files written", None if error else written)
        ranks.agree("writing", error)
        if ranks.rank == 0:
            error = attempt(lambda: _complete(access, target, partial, everyone))[1]
        ranks.agree("manifest", error)
    except BaseException:
        if ranks.rank == 0:  # what it holds is incomplete, or (after an exchange) the replaced checkpoint
            remove_checkpoint(partial)
        raise


def _prepare_directory(target: str) -> str:
    """Rank 0: leftovers of dead processes cleaned, the target checked, the partial
    directory made ([Note: atomic checkpoint directory])."""
    parent = os.path.dirname(target)
    os_step(None, "create the directory", parent, os.makedirs, parent, 0o777, True)
    clean_stale(parent)  # first: it may rename a complete copy back to the target
    if os.path.islink(target):  # an exchange would move the link, not the checkpoint it names
        raise ValueError(f"save_checkpoint: {target!r} is a symbolic link; save into the directory "
                         f"it points to ({os.path.realpath(target)!r})")
    if os.path.lexists(target):
        if not os.path.isdir(target):
            raise ValueError(f"save_checkpoint: {target!r} exists and is not a directory")
        if os.listdir(target) and not os.path.isfile(os.path.join(target, MANIFEST)):
            raise ValueError(f"save_checkpoint: {target!r} exists and is not an offload checkpoint; "
                             "refusing to replace it")
        foreign = _foreign_entries(target)
        if foreign:
            shown = ", ".join(repr(name) for name in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            entries = "entry" if len(foreign) == 1 else "entries"
            raise ValueError(f"save_checkpoint: {target!r} holds {len(foreign)} {entries} "
                             f"the checkpoint there does not list ({shown}); the save replaces the whole "
                             "directory and would remove them: move them out, or save elsewhere")
    return make_partial(target)


def _foreign_entries(target: str) -> List[str]:
    """The entries of the checkpoint directory ``target`` that its manifest does not list
    (a user's files), sorted. Where the manifest cannot be read (a corrupt checkpoint, which
    a save may replace), the names a save writes count as listed."""
    try:
        with open(os.path.join(target, MANIFEST), "rb") as f:
            listed = set(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    own = re.compile(r"^(buffers\.bin|rng-[A-Za-z0-9._-]+\.bin|unit-\d+[A-Za-z0-9._-]*\.bin)$")
    return sorted(name for name in os.listdir(target) if name != MANIFEST and
                  (name not in listed if listed is not None else not own.match(name)))


def _complete(access: "CheckpointAccess", target: str, partial: str, everyone: List[Dict[str, Any]]) -> None:
    """Rank 0: the manifest over every rank's files, last, then the directory in place."""
    writer = _HashingWriter(os.path.join(partial, MANIFEST))
    try:
        writer.write_bytes(json.dumps(_manifest(access, everyone), indent=1, sort_keys=True).encode())
    except BaseException:
        writer.abort()
        raise
    writer.close()
    fsync_dir(partial, "checkpoint.save.dir_fsync")
    put_in_place(partial, target)


def _write_rank(access: "CheckpointAccess", tmp: str) -> Dict[str, Any]:
    """This rank's files: its part of every unit, its RNG states, and (rank 0) the buffers.
    Returns their sizes and hashes, the pieces each parameter got, and the Python RNGs."""
    rank, world_size, _ = access.world()
    suffix = f"-rank-{rank:05d}" if world_size > 1 else ""
    files: Dict[str, Dict[str, Any]] = {}
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    access.release_buffers()  # [Note: bounded checkpoint memory] the buffers it holds are this save's
    try:
        for u in access.units:
            for fqn, piece in _write_unit(access, u, tmp, suffix, files):
                pieces.setdefault(fqn, []).append(piece)
    finally:
        access.release_buffers()
    buffer_entries = []
    _, buffers = state_dict_aliases(access.module)
    if buffers and rank == 0:
        writer = _HashingWriter(os.path.join(tmp, "buffers.bin"))
        try:
            for key, b in buffers.items():
                t = b.detach().to("cpu")
                buffer_entries.append({"name": key, "shape": list(t.shape), "dtype": dtype_name(t.dtype),
                                       "file": "buffers.bin", "offset": writer.write(t)})
        except BaseException:
            writer.abort()
            raise
        files["buffers.bin"] = writer.close()
    rng_files = {"cpu": f"rng-torch-cpu{suffix}.bin"}
    states = [(rng_files["cpu"], torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            rng_files[f"cuda:{i}"] = f"rng-torch-cuda-{i}{suffix}.bin"
            states.append((rng_files[f"cuda:{i}"], state))
    for file_name, state in states:
        writer = _HashingWriter(os.path.join(tmp, file_name))
        try:
            writer.write(state)
        except BaseException:
            writer.abort()
            raise
        files[file_name] = writer.close()
    return {"files": files, "pieces": pieces, "buffers": buffer_entries,
            "rng": {"torch": rng_files, **_rng_python()}}


def _manifest(access: "CheckpointAccess", everyone: List[Dict[str, Any]]) -> Dict[str, Any]:
    aliases, _ = state_dict_aliases(access.module)
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    files: Dict[str, Dict[str, Any]] = {}
    for written in everyone:
        files.update(written["files"])
        for fqn, mine in written["pieces"].items():
            pieces.setdefault(fqn, []).extend(mine)
    units = []
    # An entry's values are those of the compute copy (frozen) or the fp32 master: its dtype
    # is the compute dtype, as the parameter shows it while its unit is on the device; not
    # p.dtype, which is the dtype from before wrap while released ([Note: released parameters]).
    compute_dtype = access.compute_dtype
    for u in access.units:
        entries = []
        for k, e in enumerate(u.spec.entries):
            record = {"fqn": e.fqn, "names": aliases.get(e.param, [e.fqn]), "shape": list(e.shape),
                      "numel": e.numel, "dtype": dtype_name(compute_dtype), "trainable": e.trainable,
                      "pieces": sorted(pieces.get(e.fqn, []), key=lambda p: p["start"])}
            if e.trainable:
                record.update(group_index=e.group_index, step=int(u.steps[k]))
                scalars = scalars_to_json(u.steps[k])  # [Note: elementwise optimizers]
                if scalars is not None:
                    record["optimizer_scalars"] = scalars
            entries.append(record)
        record = {"name": u.name, "entries": entries}
        if u.delayed_pending:  # [Note: delayed updates] its pieces have a "lagging" section
            record["delayed_pending"] = True
        units.append(record)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": len(everyone),
        "stage": access.world()[2],
        "config": access.config.to_dict(),
        "compute_dtype": dtype_name(access.compute_dtype),
        "engine": access.training_counters(),
        "param_groups": [_jsonable_group(g, i) for i, g in enumerate(access.optimizer.param_groups)],
        "rng": {"ranks": [written["rng"] for written in everyone]},
        "units": units,
        "buffers": everyone[0]["buffers"],
        "files": files,
    }
    if access.compact:  # [Note: compact optimizer states] absent: "exact"
        manifest["optimizer_states"] = "compact"
    if access.optimizer_state is not None:  # [Note: elementwise optimizers] Adam's layout is the default
        manifest["optimizer_state"] = access.optimizer_state
    manifest["checksum"] = manifest_checksum(manifest)
    return manifest


def _write_compact_states(access: "CheckpointAccess", u: "UnitState", writer: _HashingWriter,
                          file_name: str) -> List[Tuple[str, Dict[str, Any]]]:
    """[Note: compact optimizer states] u's compact states as the engine holds them, each
    trainable parameter in pieces of ``access.chunks`` of its own elements (so each starts
    on a block): its COMPACT_SECTIONS one after the other. [Note: bounded checkpoint
    memory] Each piece is read from the homes alone (views of host homes; from NVMe, a
    piece of each array and of the high parts), never the whole unit."""
    pieces = []
    for k, e in enumerate(u.trainable):
        for a, b in access.chunks(0, e.numel):
            sections = access.read_compact_range(u, k, a, b)
            piece = {"file": file_name, "start": a, "numel": b - a}
            for key in COMPACT_SECTIONS:
                piece[key] = writer.write(sections[key])
            del sections
            pieces.append((e.fqn, piece))
    return pieces


@torch.no_grad()
def _write_unit(access: "CheckpointAccess", u: "UnitState", tmp: str, suffix: str,
                files: Dict[str, Dict[str, Any]]) -> List[Tuple[str, Dict[str, Any]]]:
    """This rank's part of one unit (see offload/checkpoint/format.py): (fqn, piece) pairs,
    a piece of each parameter in each of ``access.chunks`` it meets ([Note: bounded
    checkpoint memory])."""
    (t_lo, t_hi), (f_lo, f_hi) = access.ranges(u)
    if t_lo >= t_hi and f_lo >= f_hi:
        return []
    file_name = f"unit-{u.index:05d}{suffix}.bin"
    writer = _DirectWriter(os.path.join(tmp, file_name))
    pieces = []
    try:
        if access.compact and t_lo < t_hi:
            pieces.extend(_write_compact_states(access, u, writer, file_name))
        for a, b in ([] if access.compact else access.chunks(t_lo, t_hi)):  # master | exp_avg | exp_avg_sq
            master, exp_avg, exp_avg_sq = access.read_trainable_state(u, a, b)
            sections = [writer.write(master), writer.write(exp_avg), writer.write(exp_avg_sq)]
            del master, exp_avg, exp_avg_sq
            lagging = access.read_lagging(u, a, b)  # [Note: delayed updates]
            if lagging is not None:
                sections.append(writer.write(lagging))
                del lagging
            for e in u.trainable:
                x, y = max(e.offset, a), min(e.offset + e.numel, b)
                if x < y:
                    at = 4 * (x - a)
                    piece = {"file": file_name, "start": x - e.offset, "numel": y - x,
                             "master": sections[0] + at, "exp_avg": sections[1] + at, "exp_avg_sq": sections[2] + at}
                    if len(sections) > 3:
                        piece["lagging"] = sections[3] + at
                    pieces.append((e.fqn, piece))
        frozen, tail = u.spec.frozen_entries, u.spec.frozen_start
        for a, b in access.chunks(f_lo, f_hi):
            values = access.read_frozen_values(u, a, b)
            section, size, dtype = writer.write(values), values.element_size(), dtype_name(values.dtype)
            del values
            for e in frozen:
                x, y = max(e.offset - tail, a), min(e.offset - tail + e.numel, b)
                if x < y:
                    pieces.append((e.fqn, {"file": file_name, "start": x - (e.offset - tail), "numel": y - x,
                                           "value": section + size * (x - a), "file_dtype": dtype}))
    except BaseException:
        writer.abort()
        raise
    files[file_name] = writer.close()
    return pieces
