"""Saving a checkpoint: every rank writes its part ([Note: sharded checkpoints]), one unit
at a time ([Note: bounded checkpoint memory]), into a directory put into place at the end.

[Note: atomic checkpoint directory] Save writes into ``.NAME.partial-PID-HEX`` beside the
target, fsyncs every file and the directory, then renames it into place. Replacing an
existing checkpoint first renames it to ``.NAME.old-PID-HEX``; the next save into the same
parent removes partial and old directories of dead processes, and renames an old one back
when a crash left no ``NAME`` (so a complete checkpoint always survives).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import shutil
import warnings
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, List, Tuple

import torch

from offload.checkpoint.access import Ranks, attempt
from offload.checkpoint.format import (
    FORMAT, MANIFEST, VERSION, as_bytes, dtype_name, manifest_checksum, state_dict_aliases)
from offload.io.swap import pid_alive

if TYPE_CHECKING:
    from offload.checkpoint.access import CheckpointAccess
    from offload.memory.layout import UnitState


_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]+$")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """Writes a file sequentially while hashing it; ``close`` fsyncs and returns (bytes, sha256)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: BinaryIO = open(path, "xb")
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, t: torch.Tensor) -> int:
        """Appends the tensor's bytes; returns the byte offset they start at."""
        offset = self.nbytes
        data = as_bytes(t)
        self._hash.update(data)
        self._file.write(data)
        self.nbytes += len(data)
        return offset

    def close(self) -> Dict[str, Any]:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"bytes": self.nbytes, "sha256": self._hash.hexdigest()}

    def abort(self) -> None:
        self._file.close()


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
            warnings.warn(f"save_checkpoint: param_groups[{index}][{key!r}] ({type(value).__name__}) "
                          "is not saved", RuntimeWarning, stacklevel=4)
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


def _clean_stale(parent: str) -> None:
    """[Note: atomic checkpoint directory] Leftovers of dead processes in ``parent``."""
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return
    for entry in entries:
        match = _STALE_RE.match(entry)
        if not match or pid_alive(int(match.group("pid"))):
            continue
        path = os.path.join(parent, entry)
        target = os.path.join(parent, match.group("name"))
        if match.group("kind") == "old" and not os.path.exists(target):
            os.rename(path, target)  # the crash came between the two renames: keep it
        else:
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(access: "CheckpointAccess", ckpt_dir: str) -> None:
    """[Note: sharded checkpoints] Every rank writes its part into one directory, which
    rank 0 prepares beforehand and completes (manifest, rename) afterwards."""
    ranks = Ranks(access, "save_checkpoint")
    ranks.agree("checks", attempt(lambda: access.check_allowed(saving=True))[1])
    target = os.path.abspath(os.fspath(ckpt_dir).rstrip("/") or "/")
    tmp, error = attempt(lambda: _prepare_directory(target)) if ranks.rank == 0 else (None, None)
    ranks.agree("directory", error)
    tmp = ranks.gather("directory name", tmp)[0]
    written, error = attempt(lambda: _write_rank(access, tmp))
    try:
        everyone = ranks.gather("files written", None if error else written)
        ranks.agree("writing", error)
        if ranks.rank == 0:
            error = attempt(lambda: _complete(access, target, tmp, everyone))[1]
        ranks.agree("manifest", error)
    except BaseException:
        if ranks.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _prepare_directory(target: str) -> str:
    parent, name = os.path.dirname(target), os.path.basename(target)
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise ValueError(f"save_checkpoint: {target!r} exists and is not a directory")
        if os.listdir(target) and not os.path.isfile(os.path.join(target, MANIFEST)):
            raise ValueError(f"save_checkpoint: {target!r} exists and is not an offload checkpoint; "
                             "refusing to replace it")
    os.makedirs(parent, exist_ok=True)
    _clean_stale(parent)
    tmp = os.path.join(parent, f".{name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp, 0o755)
    return tmp


def _complete(access: "CheckpointAccess", target: str, tmp: str, everyone: List[Dict[str, Any]]) -> None:
    """Rank 0: the manifest over every rank's files, then the atomic rename."""
    manifest = _manifest(access, everyone)
    with open(os.path.join(tmp, MANIFEST), "x") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    parent, name = os.path.dirname(target), os.path.basename(target)
    old = None
    if os.path.exists(target):
        old = os.path.join(parent, f".{name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_rank(access: "CheckpointAccess", tmp: str) -> Dict[str, Any]:
    """This rank's files: its part of every unit, its RNG states, and (rank 0) the buffers.
    Returns their sizes and hashes, the pieces each parameter got, and the Python RNGs."""
    rank, world_size, _ = access.world()
    suffix = f"-rank-{rank:05d}" if world_size > 1 else ""
    files: Dict[str, Dict[str, Any]] = {}
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    for u in access.units:
        for fqn, piece in _write_unit(access, u, tmp, suffix, files):
            pieces.setdefault(fqn, []).append(piece)
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
        writer.write(state)
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
    for u in access.units:
        entries = []
        for k, e in enumerate(u.spec.entries):
            record = {"fqn": e.fqn, "names": aliases.get(e.param, [e.fqn]), "shape": list(e.shape),
                      "numel": e.numel, "dtype": dtype_name(e.param.dtype), "trainable": e.trainable,
                      "pieces": sorted(pieces.get(e.fqn, []), key=lambda p: p["start"])}
            if e.trainable:
                record.update(group_index=e.group_index, step=u.steps[k])
            entries.append(record)
        units.append({"name": u.name, "entries": entries})
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
    manifest["checksum"] = manifest_checksum(manifest)
    return manifest


@torch.no_grad()
def _write_unit(access: "CheckpointAccess", u: "UnitState", tmp: str, suffix: str,
                files: Dict[str, Dict[str, Any]]) -> List[Tuple[str, Dict[str, Any]]]:
    """This rank's part of one unit (see offload/checkpoint/format.py): (fqn, piece) pairs;
    [Note: bounded checkpoint memory]."""
    (t_lo, t_hi), (f_lo, f_hi) = access.ranges(u)
    if t_lo >= t_hi and f_lo >= f_hi:
        return []
    file_name = f"unit-{u.index:05d}{suffix}.bin"
    writer = _HashingWriter(os.path.join(tmp, file_name))
    pieces = []
    try:
        if t_lo < t_hi:
            master, exp_avg, exp_avg_sq = access.read_trainable_state(u, t_lo, t_hi)
            sections = [writer.write(master), writer.write(exp_avg), writer.write(exp_avg_sq)]
            del master, exp_avg, exp_avg_sq
            for e in u.trainable:
                a, b = max(e.offset, t_lo), min(e.offset + e.numel, t_hi)
                if a < b:
                    at = 4 * (a - t_lo)
                    pieces.append((e.fqn, {"file": file_name, "start": a - e.offset, "numel": b - a,
                                           "master": sections[0] + at, "exp_avg": sections[1] + at,
                                           "exp_avg_sq": sections[2] + at}))
        if f_lo < f_hi:
            values = access.read_frozen_values(u, f_lo, f_hi)
            section, size, dtype = writer.write(values), values.element_size(), dtype_name(values.dtype)
            del values
            frozen, tail = u.spec.frozen_entries, u.spec.frozen_start
            for e in frozen:
                a, b = max(e.offset - tail, f_lo), min(e.offset - tail + e.numel, f_hi)
                if a < b:
                    pieces.append((e.fqn, {"file": file_name, "start": a - (e.offset - tail), "numel": b - a,
                                           "value": section + size * (a - f_lo), "file_dtype": dtype}))
    except BaseException:
        writer.abort()
        raise
    files[file_name] = writer.close()
    return pieces
