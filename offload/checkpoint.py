"""Checkpoints of an Engine: save, verify, load, export (issue 7).

A checkpoint is a directory of raw little-endian files plus ``manifest.json``:

  manifest.json       format/version, the world size and ZeRO stage that wrote it, the config
                      of the run, engine counters (micro-step, loss scale), param-group
                      hyperparameters, each rank's Python/NumPy RNG states, per-parameter
                      entries (fqn, aliases, shape, dtype, Adam step count, and its *pieces*:
                      which file holds which elements, at which byte offsets), and every file
                      with its size and sha256. A ``checksum`` field covers the manifest.
  unit-NNNNN.bin      per unit (``unit-NNNNN-rank-RRRRR.bin`` per unit and rank when several
                      ranks wrote it): fp32 master of the elements written | exp_avg |
                      exp_avg_sq | the compute copy of frozen parameters (compute dtype).
                      Trainable compute copies are derived (fp32: the master itself;
                      bf16/fp16: the master rounded to nearest even, as the Adam kernel writes
                      them; bf16 with a split master: rounded half away from zero, see
                      [Note: split master] in native/adam/master_split.cpp), so they are not
                      stored.
  buffers.bin         the model's persistent buffers (byte offsets in the manifest).
  rng-torch-cpu.bin, rng-torch-cuda-N.bin   torch's RNG states (``-rank-RRRRR`` per rank).

The format records logical values, not tier layouts, so a checkpoint loads into an engine
with other tiers, another unit split or another number of ranks, as long as parameter
names, shapes and the trainable set agree. Nothing is unpickled on load. Version 1
manifests (one process, one piece per parameter) are read too.

[Note: sharded checkpoints] With several ranks every rank calls save/load. Save: rank 0
prepares the directory; every rank writes the elements it keeps (its shard of master and
moments at stage >= 1, its chunk of frozen values at stage 3; what every rank holds, rank 0
alone) and its RNG states; rank 0 writes the manifest over all of them and renames the
directory into place. Load: every rank hashes its share of the files, then reads the
elements it keeps from whichever pieces hold them, so a checkpoint of N ranks loads on M.
After every phase the ranks agree: when one failed, every rank raises an error naming it,
and nothing is renamed into place.

[Note: bounded checkpoint memory] Save and load move one unit at a time: the host holds at
most one unit's master, moments and compute copy (plus the engine's own I/O bounce buffer);
verification and export hash and copy in 4 MiB chunks.

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
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.errors import CheckpointError
from offload.swap import pid_alive

if TYPE_CHECKING:
    from offload.engine import Engine
    from offload.memory.layout import UnitState

FORMAT = "offload-checkpoint"
VERSION = 2
_READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
_CHUNK_BYTES = 4 << 20
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]+$")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
                torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


# ---------------------------------------------------------------------- small helpers
def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"checkpoint: tensors of dtype {dtype} are not supported")
    return _DTYPE_NAMES[dtype]


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (little-endian machines)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


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
        data = _as_bytes(t)
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


def _manifest_checksum(manifest: Dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------- save
def _aliases(module: nn.Module) -> Tuple[Dict[nn.Parameter, List[str]], Dict[str, torch.Tensor]]:
    """Every state_dict key of each parameter (ties give several), and the buffers."""
    names: Dict[nn.Parameter, List[str]] = {}
    buffers: Dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            names.setdefault(value, []).append(key)
        else:
            buffers[key] = value
    return names, buffers


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


class _Ranks:
    """[Note: sharded checkpoints] The ranks' agreement on each phase of a save or load:
    every rank reports its error (or none); when one failed, all raise, naming it."""

    def __init__(self, engine: "Engine", what: str) -> None:
        self.engine = engine
        self.rank, self.world_size, _ = engine.checkpoint_world()
        self.what = what

    def gather(self, phase: str, value: Any) -> List[Any]:
        return self.engine.gather_from_ranks(f"{self.what} ({phase})", value)

    def agree(self, phase: str, error: Optional[BaseException]) -> None:
        """Raise ``error`` here, or an error naming the first rank that had one."""
        report = None if error is None else (type(error).__name__, str(error))
        reports = self.gather(phase, report)
        if error is not None:
            raise error
        for r, report in enumerate(reports):
            if report is not None:
                kind = CheckpointError if report[0] == "CheckpointError" else \
                    ValueError if report[0] == "ValueError" else RuntimeError
                raise kind(f"{self.what}: rank {r} failed ({report[0]}: {report[1]})")


def _attempt(call: Any) -> Tuple[Any, Optional[BaseException]]:
    try:
        return call(), None
    except Exception as error:  # reported to the other ranks, then raised (see _Ranks)
        return None, error


def save(engine: "Engine", ckpt_dir: str) -> None:
    """[Note: sharded checkpoints] Every rank writes its part into one directory, which
    rank 0 prepares beforehand and completes (manifest, rename) afterwards."""
    ranks = _Ranks(engine, "save_checkpoint")
    ranks.agree("checks", _attempt(lambda: engine.check_checkpoint_allowed(saving=True))[1])
    target = os.path.abspath(os.fspath(ckpt_dir).rstrip("/") or "/")
    tmp, error = _attempt(lambda: _prepare_directory(target)) if ranks.rank == 0 else (None, None)
    ranks.agree("directory", error)
    tmp = ranks.gather("directory name", tmp)[0]
    written, error = _attempt(lambda: _write_rank(engine, tmp))
    try:
        everyone = ranks.gather("files written", None if error else written)
        ranks.agree("writing", error)
        if ranks.rank == 0:
            error = _attempt(lambda: _complete(engine, target, tmp, everyone))[1]
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


def _complete(engine: "Engine", target: str, tmp: str, everyone: List[Dict[str, Any]]) -> None:
    """Rank 0: the manifest over every rank's files, then the atomic rename."""
    manifest = _manifest(engine, everyone)
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


def _write_rank(engine: "Engine", tmp: str) -> Dict[str, Any]:
    """This rank's files: its part of every unit, its RNG states, and (rank 0) the buffers.
    Returns their sizes and hashes, the pieces each parameter got, and the Python RNGs."""
    rank, world_size, _ = engine.checkpoint_world()
    suffix = f"-rank-{rank:05d}" if world_size > 1 else ""
    files: Dict[str, Dict[str, Any]] = {}
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    for u in engine.units:
        for fqn, piece in _write_unit(engine, u, tmp, suffix, files):
            pieces.setdefault(fqn, []).append(piece)
    buffer_entries = []
    _, buffers = _aliases(engine.module)
    if buffers and rank == 0:
        writer = _HashingWriter(os.path.join(tmp, "buffers.bin"))
        try:
            for key, b in buffers.items():
                t = b.detach().to("cpu")
                buffer_entries.append({"name": key, "shape": list(t.shape), "dtype": _dtype_name(t.dtype),
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


def _manifest(engine: "Engine", everyone: List[Dict[str, Any]]) -> Dict[str, Any]:
    aliases, _ = _aliases(engine.module)
    pieces: Dict[str, List[Dict[str, Any]]] = {}
    files: Dict[str, Dict[str, Any]] = {}
    for written in everyone:
        files.update(written["files"])
        for fqn, mine in written["pieces"].items():
            pieces.setdefault(fqn, []).extend(mine)
    units = []
    for u in engine.units:
        entries = []
        for k, e in enumerate(u.spec.entries):
            record = {"fqn": e.fqn, "names": aliases.get(e.param, [e.fqn]), "shape": list(e.shape),
                      "numel": e.numel, "dtype": _dtype_name(e.param.dtype), "trainable": e.trainable,
                      "pieces": sorted(pieces.get(e.fqn, []), key=lambda p: p["start"])}
            if e.trainable:
                record.update(group_index=e.group_index, step=u.steps[k])
            entries.append(record)
        units.append({"name": u.name, "entries": entries})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": len(everyone),
        "stage": engine.checkpoint_world()[2],
        "config": engine.config.to_dict(),
        "compute_dtype": _dtype_name(engine.compute_dtype),
        "engine": engine.training_counters(),
        "param_groups": [_jsonable_group(g, i) for i, g in enumerate(engine.optimizer.param_groups)],
        "rng": {"ranks": [written["rng"] for written in everyone]},
        "units": units,
        "buffers": everyone[0]["buffers"],
        "files": files,
    }
    manifest["checksum"] = _manifest_checksum(manifest)
    return manifest


@torch.no_grad()
def _write_unit(engine: "Engine", u: "UnitState", tmp: str, suffix: str,
                files: Dict[str, Dict[str, Any]]) -> List[Tuple[str, Dict[str, Any]]]:
    """This rank's part of one unit (see the module docstring): (fqn, piece) pairs;
    [Note: bounded checkpoint memory]."""
    (t_lo, t_hi), (f_lo, f_hi) = engine.checkpoint_ranges(u)
    if t_lo >= t_hi and f_lo >= f_hi:
        return []
    file_name = f"unit-{u.index:05d}{suffix}.bin"
    writer = _HashingWriter(os.path.join(tmp, file_name))
    pieces = []
    try:
        if t_lo < t_hi:
            master, exp_avg, exp_avg_sq = engine.read_trainable_state(u, t_lo, t_hi)
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
            values = engine.read_frozen_values(u, f_lo, f_hi)
            section, size, dtype = writer.write(values), values.element_size(), _dtype_name(values.dtype)
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


# ---------------------------------------------------------------------- verify
def _checked_path(ckpt_dir: str, file_name: Any) -> str:
    if not isinstance(file_name, str) or not _FILE_NAME_RE.match(file_name) or file_name == MANIFEST:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: the manifest names the file {file_name!r}, "
                              "which is not a plain file name inside the checkpoint directory")
    path = os.path.join(ckpt_dir, file_name)
    if os.path.islink(path):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {file_name!r} is a symbolic link")
    return path


def read_manifest(ckpt_dir: str, share: Tuple[int, int] = (0, 1)) -> Dict[str, Any]:
    """The manifest after checking every file it lists (existence, size, sha256), in the
    current layout (a version 1 manifest is converted). ``share=(i, n)``: hash only every
    n-th file from the i-th (the ranks of a sharded load split the work)."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint {ckpt_dir!r} does not exist or is not a directory")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is missing (an incomplete "
                              "or foreign directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("version") not in _READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} has version "
                              f"{manifest.get('version')!r}; this offload reads versions "
                              f"{', '.join(map(str, _READABLE_VERSIONS))}")
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} does not match its checksum "
                              "(the manifest was modified or corrupted)")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} has no file list")
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    first, every = share
    for i, (file_name, info) in enumerate(sorted(files.items())):
        file_path = _checked_path(ckpt_dir, file_name)
        try:
            size = os.stat(file_path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} listed in the "
                                  "manifest is missing") from None
        if size != info.get("bytes"):
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} has {size} bytes, "
                                  f"the manifest says {info.get('bytes')} (truncated or replaced)")
        if i % every != first:
            continue
        digest = hashlib.sha256()
        with open(file_path, "rb") as f:
            while True:
                n = f.readinto(buffer)
                if not n:
                    break
                digest.update(view[:n])
        if digest.hexdigest() != info.get("sha256"):
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} does not match its "
                                  "sha256 checksum (corrupted)")
    if manifest["version"] == 1:
        _upgrade_version_1(manifest)
    _check_pieces(manifest, ckpt_dir)
    return manifest


def _upgrade_version_1(manifest: Dict[str, Any]) -> None:
    """Version 1 (one process): one file per unit, one offset per section and parameter."""
    for u in manifest["units"]:
        for r in u["entries"]:
            piece = {"file": u["file"], "start": 0, "numel": r["numel"]}
            if r["trainable"]:
                piece.update({key: r.pop(key) for key in ("master", "exp_avg", "exp_avg_sq")})
            else:
                piece.update(value=r.pop("value"), file_dtype=r["file_dtype"])
            r["pieces"] = [piece]
    manifest["rng"] = {"ranks": [manifest["rng"]]}
    manifest["world_size"] = 1
    manifest["stage"] = 0


def _check_pieces(manifest: Dict[str, Any], ckpt_dir: str) -> None:
    """Every parameter's pieces cover it once, in listed files, inside those files."""
    files = manifest["files"]
    keys = {True: ("master", "exp_avg", "exp_avg_sq"), False: ("value",)}
    for u in manifest["units"]:
        for r in u["entries"]:
            covered = 0
            for piece in r["pieces"]:
                file_name = piece.get("file")
                if file_name not in files:
                    _checked_path(ckpt_dir, file_name)
                    raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {r['fqn']!r} names the "
                                          f"file {file_name!r}, which the manifest does not list")
                if piece.get("start") != covered or not isinstance(piece.get("numel"), int) or piece["numel"] <= 0:
                    raise CheckpointError(f"checkpoint {ckpt_dir!r}: the pieces of parameter {r['fqn']!r} "
                                          "do not cover it exactly once")
                covered += piece["numel"]
                dtype = _DTYPES.get("float32" if r["trainable"] else piece.get("file_dtype"))
                if dtype is None:
                    raise CheckpointError(f"checkpoint file {file_name!r}: parameter {r['fqn']!r} "
                                          f"has unknown dtype {piece.get('file_dtype')!r}")
                for key in keys[r["trainable"]]:
                    offset, nbytes, size = piece.get(key), piece["numel"] * dtype.itemsize, files[file_name]["bytes"]
                    if not isinstance(offset, int) or offset < 0 or offset + nbytes > size:
                        raise CheckpointError(f"checkpoint file {file_name!r}: a manifest entry points at bytes "
                                              f"[{offset}, {offset}+{nbytes}) outside the file ({size} bytes)")
            if covered != r["numel"]:
                raise CheckpointError(f"checkpoint {ckpt_dir!r}: the pieces of parameter {r['fqn']!r} "
                                      f"cover {covered} of its {r['numel']} elements")


def _read_range(f: BinaryIO, file_name: str, file_bytes: int, offset: int, out: torch.Tensor) -> None:
    nbytes = out.numel() * out.element_size()
    if not isinstance(offset, int) or offset < 0 or offset + nbytes > file_bytes:
        raise CheckpointError(f"checkpoint file {file_name!r}: a manifest entry points at bytes "
                              f"[{offset}, {offset}+{nbytes}) outside the file ({file_bytes} bytes)")
    f.seek(offset)
    view = out.reshape(-1).view(torch.uint8).numpy()
    if f.readinto(memoryview(view)) != nbytes:
        raise CheckpointError(f"checkpoint file {file_name!r}: short read at offset {offset}")


# ---------------------------------------------------------------------- load
def _match_model(engine: "Engine", manifest: Dict[str, Any], ckpt_dir: str) -> Dict[str, Dict[str, Any]]:
    """Checkpoint entry for each engine parameter, or a CheckpointError naming the parameter."""
    saved: Dict[str, Dict[str, Any]] = {}
    for u in manifest["units"]:
        for record in u["entries"]:
            saved[record["fqn"]] = record
    ours = {e.fqn: e for u in engine.units for e in u.spec.entries}
    for fqn in sorted(set(saved) - set(ours)):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {fqn!r} is in the checkpoint "
                              "but not in the model")
    for fqn in sorted(set(ours) - set(saved)):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {fqn!r} of the model is not in "
                              "the checkpoint")
    for fqn, e in ours.items():
        record = saved[fqn]
        if list(e.shape) != record["shape"]:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {fqn!r} has shape "
                                  f"{tuple(record['shape'])} in the checkpoint, {tuple(e.shape)} in the model")
        if e.trainable != record["trainable"]:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {fqn!r} is "
                                  f"{'trainable' if record['trainable'] else 'frozen'} in the checkpoint "
                                  f"but {'trainable' if e.trainable else 'frozen'} in the model")
        if e.trainable and e.group_index != record["group_index"]:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {fqn!r} is in param group "
                                  f"{record['group_index']} in the checkpoint, {e.group_index} in the optimizer")
    files = manifest["files"]
    for b in manifest["buffers"]:
        if b.get("dtype") not in _DTYPES:
            raise CheckpointError(f"checkpoint: buffer {b['name']!r} has unknown dtype {b.get('dtype')!r}")
        offset, nbytes = b["offset"], _numel(b["shape"]) * _DTYPES[b["dtype"]].itemsize
        size = files.get("buffers.bin", {}).get("bytes", -1)
        if not isinstance(offset, int) or offset < 0 or offset + nbytes > size:
            raise CheckpointError(f"checkpoint file 'buffers.bin': a manifest entry points at bytes "
                                  f"[{offset}, {offset}+{nbytes}) outside the file ({size} bytes)")
    groups = manifest["param_groups"]
    if len(groups) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {len(groups)} optimizer param groups in the "
                              f"checkpoint, {len(engine.optimizer.param_groups)} in the optimizer")
    _, buffers = _aliases(engine.module)
    saved_buffers = {b["name"]: b for b in manifest["buffers"]}
    if set(saved_buffers) != set(buffers):
        diff = sorted(set(saved_buffers) ^ set(buffers))
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: buffer {diff[0]!r} is in only one of the "
                              "checkpoint and the model")
    for key, b in buffers.items():
        if list(b.shape) != saved_buffers[key]["shape"]:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: buffer {key!r} has shape "
                                  f"{tuple(saved_buffers[key]['shape'])} in the checkpoint, "
                                  f"{tuple(b.shape)} in the model")
    for key in ("dtype", "gradient_accumulation_steps", "max_grad_norm"):
        if manifest["config"].get(key) != getattr(engine.config, key):
            warnings.warn(f"load_checkpoint: the checkpoint was written with {key}="
                          f"{manifest['config'].get(key)!r}, this engine uses "
                          f"{getattr(engine.config, key)!r}; the run will not continue bit-identically",
                          RuntimeWarning, stacklevel=4)
    return saved


def load(engine: "Engine", ckpt_dir: str) -> None:
    """[Note: sharded checkpoints] Every rank verifies its share of the files, then reads
    the elements it keeps from whichever files hold them."""
    engine.check_checkpoint_allowed(saving=False)
    ranks = _Ranks(engine, "load_checkpoint")
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))

    def verify() -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
        manifest = read_manifest(ckpt_dir, share=(ranks.rank, ranks.world_size))
        return manifest, _match_model(engine, manifest, ckpt_dir)
    checked, error = _attempt(verify)     # 1. every file checked before any state changes
    ranks.agree("verification", error)
    manifest, saved = checked
    if manifest["world_size"] != ranks.world_size:
        warnings.warn(f"load_checkpoint: the checkpoint was written by {manifest['world_size']} "
                      f"rank(s), this run has {ranks.world_size}: the states are re-partitioned; "
                      "random number generators continue from those of the nearest saved rank",
                      RuntimeWarning, stacklevel=3)
    unfinished = (f"load_checkpoint({ckpt_dir!r}) did not finish, so the engine holds a mix of states; "
                  "load a checkpoint again before training")
    engine.begin_state_load(unfinished)

    def load_states() -> None:
        reader = _PieceReader(ckpt_dir, manifest["files"])
        try:
            for u in engine.units:               # 2. unit by unit into the tiers
                engine.write_unit_state(u, _unit_reader(u, saved, reader),
                                        [saved[e.fqn]["step"] for e in u.trainable])
        finally:
            reader.close()
        _load_rest(engine, manifest, ckpt_dir, ranks.rank)
    error = _attempt(load_states)[1]
    if isinstance(error, OSError):
        error = OSError(error.errno, f"load_checkpoint({ckpt_dir!r}) failed while writing the states "
                        f"into their tiers: {error}; {unfinished}")
    ranks.agree("loading", error)
    engine.finish_state_load()


class _PieceReader:
    """Reads ranges of a checkpoint's files, keeping each file open once opened."""

    def __init__(self, ckpt_dir: str, files: Dict[str, Dict[str, Any]]) -> None:
        self.ckpt_dir = ckpt_dir
        self.files = files
        self._handles: Dict[str, BinaryIO] = {}

    def read(self, file_name: str, offset: int, out: torch.Tensor) -> None:
        if file_name not in self._handles:
            self._handles[file_name] = open(_checked_path(self.ckpt_dir, file_name), "rb")
        _read_range(self._handles[file_name], file_name, self.files[file_name]["bytes"], offset, out)

    def read_param(self, record: Dict[str, Any], key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of one parameter's ``key`` section ("master", "exp_avg",
        "exp_avg_sq" or "value") into ``out``, from the pieces that hold them."""
        for piece in record["pieces"]:
            a, b = max(piece["start"], lo), min(piece["start"] + piece["numel"], hi)
            if a >= b:
                continue
            dtype = torch.float32 if key != "value" else _DTYPES[piece["file_dtype"]]
            part = out[a - lo:b - lo]
            value = part if part.dtype == dtype else torch.empty(b - a, dtype=dtype)
            self.read(piece["file"], piece[key] + dtype.itemsize * (a - piece["start"]), value)
            if value is not part:
                part.copy_(value)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def _unit_reader(u: "UnitState", saved: Dict[str, Dict[str, Any]],
                 reader: _PieceReader) -> Callable[[str, int, int, torch.Tensor], None]:
    """``read(section, lo, hi, out)`` for Engine.write_unit_state: elements [lo, hi) of u's
    trainable prefix ("master", "exp_avg", "exp_avg_sq") or of its frozen tail ("value",
    counted from the tail's start), from the pieces of the parameters that overlap them."""
    frozen, tail = u.spec.frozen_entries, u.spec.frozen_start

    def read(section: str, lo: int, hi: int, out: torch.Tensor) -> None:
        entries, base = (frozen, tail) if section == "value" else (u.trainable, 0)
        for e in entries:
            start = e.offset - base
            a, b = max(start, lo), min(start + e.numel, hi)
            if a < b:
                reader.read_param(saved[e.fqn], section, a - start, b - start, out[a - lo:b - lo])
    return read


def _load_rest(engine: "Engine", manifest: Dict[str, Any], ckpt_dir: str, rank: int) -> None:
    files = manifest["files"]
    _, buffers = _aliases(engine.module)
    if manifest["buffers"]:
        with open(_checked_path(ckpt_dir, "buffers.bin"), "rb") as f:
            for record in manifest["buffers"]:
                b = buffers[record["name"]]
                value = torch.empty(record["shape"], dtype=_DTYPES[record["dtype"]])
                _read_range(f, "buffers.bin", files["buffers.bin"]["bytes"], record["offset"], value)
                with torch.no_grad():
                    b.copy_(value)
    for group, values in zip(engine.optimizer.param_groups, manifest["param_groups"]):
        for key, value in values.items():
            if isinstance(group.get(key), torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = tuple(value) if isinstance(value, list) else value
    engine.restore_training_counters(manifest["engine"])
    saved_ranks = manifest["rng"]["ranks"]
    rng = saved_ranks[min(rank, len(saved_ranks) - 1)]
    for device, file_name in rng["torch"].items():
        state = torch.empty(files[file_name]["bytes"], dtype=torch.uint8)
        with open(_checked_path(ckpt_dir, file_name), "rb") as f:
            _read_range(f, file_name, files[file_name]["bytes"], 0, state)
        if device == "cpu":
            torch.set_rng_state(state)
        elif torch.cuda.is_available() and int(device.split(":")[1]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(state, device)
    version, internal, gauss = rng["random"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------- export
def export_checkpoint(ckpt_dir: str, out_path: str) -> None:
    """Write the checkpoint's weights as one state dict that ``model.load_state_dict()``
    accepts: fp32 masters for trainable parameters, saved values for frozen ones (in the
    parameter's own dtype), buffers; every key of tied parameters. A checkpoint of several
    ranks is consolidated (each parameter's pieces joined). ``out_path`` ending in
    ``.safetensors`` gives a safetensors file, anything else a ``torch.save`` file.

    Memory: the safetensors writer streams in chunks. The torch.save file is written from
    memory maps of the checkpoint files (file-backed pages, not anonymous memory), except
    parameters in several pieces or whose dtype differs from the saved one, joined or
    converted one at a time."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    manifest = read_manifest(ckpt_dir)
    out_path = os.fspath(out_path)
    items = _export_items(manifest)
    tmp = f"{out_path}.partial-{os.getpid()}"
    try:
        if out_path.endswith(".safetensors"):
            _write_safetensors(ckpt_dir, manifest, items, tmp)
        else:
            _write_torch_save(ckpt_dir, manifest, items, tmp)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _export_items(manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """(names, shape, output dtype, pieces as (file, offset, numel, file dtype)) of every
    tensor to export."""
    items = []
    for u in manifest["units"]:
        for r in u["entries"]:
            key = "master" if r["trainable"] else "value"
            pieces = [(p["file"], p[key], p["numel"], "float32" if r["trainable"] else p["file_dtype"])
                      for p in r["pieces"]]
            items.append({"names": r["names"], "shape": r["shape"], "pieces": pieces,
                          "dtype": "float32" if r["trainable"] else r["dtype"]})
    for b in manifest["buffers"]:
        items.append({"names": [b["name"]], "shape": b["shape"], "dtype": b["dtype"],
                      "pieces": [("buffers.bin", b["offset"], _numel(b["shape"]), b["dtype"])]})
    return items


def _numel(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_torch_save(ckpt_dir: str, manifest: Dict[str, Any], items: List[Dict[str, Any]], tmp: str) -> None:
    import numpy as np

    result: Dict[str, torch.Tensor] = {}
    maps = []
    for item in items:
        dtype = _DTYPES[item["dtype"]]
        parts = []
        for file_name, offset, numel, file_dtype_name in item["pieces"]:
            file_dtype = _DTYPES[file_dtype_name]
            nbytes = numel * file_dtype.itemsize
            if offset + nbytes > manifest["files"][file_name]["bytes"]:
                raise CheckpointError(f"checkpoint file {file_name!r}: an entry lies outside the file")
            raw = np.memmap(_checked_path(ckpt_dir, file_name), dtype=np.uint8, mode="r",
                            offset=offset, shape=(nbytes,))
            maps.append(raw)
            with warnings.catch_warnings():  # read-only map: torch warns that it is not writable
                warnings.simplefilter("ignore", UserWarning)
                parts.append(torch.from_numpy(raw).view(file_dtype))
        if not parts:
            tensor = torch.empty(item["shape"], dtype=dtype)
        elif len(parts) == 1 and parts[0].dtype == dtype:
            tensor = parts[0].view(item["shape"])
        else:
            tensor = torch.cat([part.to(dtype) for part in parts]).view(item["shape"])
        for name in item["names"]:
            result[name] = tensor
    torch.save(result, tmp)
    del result, maps


def _write_safetensors(ckpt_dir: str, manifest: Dict[str, Any], items: List[Dict[str, Any]], tmp: str) -> None:
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
    header: Dict[str, Any] = {}
    position = 0
    plan = []
    for item in items:
        dtype = _DTYPES[item["dtype"]]
        nbytes = _numel(item["shape"]) * dtype.itemsize
        for name in item["names"]:  # safetensors has no aliasing: each name gets its bytes
            header[name] = {"dtype": names[dtype], "shape": item["shape"],
                            "data_offsets": [position, position + nbytes]}
            plan.append(item)
            position += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    reader = _PieceReader(ckpt_dir, manifest["files"])
    try:
        with open(tmp, "wb") as out:
            out.write(len(blob).to_bytes(8, "little"))
            out.write(blob)
            for item in plan:
                dtype = _DTYPES[item["dtype"]]
                for file_name, offset, numel, file_dtype_name in item["pieces"]:
                    file_dtype = _DTYPES[file_dtype_name]
                    per_chunk = max(1, _CHUNK_BYTES // file_dtype.itemsize)
                    for done in range(0, numel, per_chunk):
                        chunk = torch.empty(min(per_chunk, numel - done), dtype=file_dtype)
                        reader.read(file_name, offset + done * file_dtype.itemsize, chunk)
                        out.write(_as_bytes(chunk.to(dtype)))
            out.flush()
            os.fsync(out.fileno())
    finally:
        reader.close()


__all__ = ["export_checkpoint", "read_manifest"]
