"""Checkpoints of an Engine: save, verify, load, export (issue 7).

A checkpoint is a directory of raw little-endian files plus ``manifest.json``:

  manifest.json       format/version, the config of the run, engine counters (micro-step,
                      loss scale), param-group hyperparameters, Python/NumPy RNG states,
                      per-unit entries (fqn, aliases, shape, dtype, Adam step count, byte
                      offsets of each section in its unit file), and every file with its size
                      and sha256. A ``checksum`` field covers the manifest itself.
  unit-NNNNN.bin      one per unit: fp32 master of the trainable prefix | exp_avg | exp_avg_sq
                      | the compute copy of the frozen parameters (compute dtype). Trainable
                      compute copies are derived (fp32: the master itself; bf16/fp16: the
                      master rounded to nearest even, as the Adam kernel writes them), so they
                      are not stored.
  buffers.bin         the model's persistent buffers (byte offsets in the manifest).
  rng-torch-cpu.bin, rng-torch-cuda-N.bin   torch's RNG states.

The format records logical values, not tier layouts, so a checkpoint loads into an engine
with other tiers or another unit split, as long as parameter names, shapes and the
trainable set agree. Nothing is unpickled on load.

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
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.swap import pid_alive

if TYPE_CHECKING:
    from offload.engine import Engine, _Unit

FORMAT = "offload-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_CHUNK_BYTES = 4 << 20
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]+$")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
                torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing/corrupt file, or a model that differs.
    The message names the file or the parameter."""


class EngineFailedError(RuntimeError):
    """The engine refuses to go on after an I/O failure; the message says how to recover."""


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


# ---------------------------------------------------------------------- reading unit state
def _master_source(engine: "Engine", u: "_Unit") -> Any:
    return u.compute_home if engine._merged else u.master_home


def unit_master(engine: "Engine", u: "_Unit") -> torch.Tensor:
    """fp32 master of u's trainable prefix (master_numel elements), from wherever it is
    current: the engine's dirty copy after a failed swap write, else its home."""
    dirty = engine._dirty.get(u.index, {})
    if "master" in dirty:
        return dirty["master"]
    if engine._merged:
        return engine._load(u.compute_home, u.master_numel, torch.float32)
    return engine._load(u.master_home, u.master_numel, torch.float32)


def unit_moments(engine: "Engine", u: "_Unit") -> torch.Tensor:
    dirty = engine._dirty.get(u.index, {})
    if "moments" in dirty:
        return dirty["moments"]
    return engine._load(u.moments_home, 2 * u.master_numel, torch.float32)


def unit_compute(engine: "Engine", u: "_Unit") -> torch.Tensor:
    """The compute copy as the tier holds it (frozen parameters are read from here)."""
    if engine._param_tier == "device":
        return engine._device.view(u.device_offset, u.compute_numel).to("cpu", copy=True)
    dtype = torch.float32 if engine._merged else engine.compute_dtype
    return engine._load(u.compute_home, u.compute_numel, dtype)


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


def _check_savable(engine: "Engine") -> None:
    if engine._closed:
        raise RuntimeError("save_checkpoint: engine is closed")
    if engine._failure is not None and engine._failure["fatal"]:
        raise EngineFailedError(f"save_checkpoint: {engine._failure['message']}")
    pending = engine._micro_step % engine._accumulation_steps
    if pending or any(any(u.has_grad) for u in engine.units):
        raise ValueError(
            f"save_checkpoint: gradients of {pending or 'un-stepped'} micro-batch(es) are "
            f"pending (micro-step {engine._micro_step}, gradient_accumulation_steps="
            f"{engine._accumulation_steps}); save right after the engine.step() call that "
            "updates the parameters (an accumulation boundary)")


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


def save(engine: "Engine", ckpt_dir: str) -> None:
    _check_savable(engine)
    target = os.path.abspath(os.fspath(ckpt_dir).rstrip("/") or "/")
    parent, name = os.path.dirname(target), os.path.basename(target)
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise ValueError(f"save_checkpoint: {target!r} exists and is not a directory")
        if os.listdir(target) and not os.path.isfile(os.path.join(target, MANIFEST)):
            raise ValueError(f"save_checkpoint: {target!r} exists and is not an offload checkpoint; "
                             "refusing to replace it")
    os.makedirs(parent, exist_ok=True)
    _clean_stale(parent)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = os.path.join(parent, f".{name}.partial-{tag}")
    os.mkdir(tmp, 0o755)
    try:
        manifest = _write_all(engine, tmp)
        with open(os.path.join(tmp, MANIFEST), "x") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if os.path.exists(target):
            old = os.path.join(parent, f".{name}.old-{tag}")
            os.rename(target, old)
        os.rename(tmp, target)
        _fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_all(engine: "Engine", tmp: str) -> Dict[str, Any]:
    aliases, buffers = _aliases(engine.module)
    files: Dict[str, Dict[str, Any]] = {}
    units = []
    for u in engine.units:
        units.append(_write_unit(engine, u, tmp, aliases, files))
    buffer_entries = []
    if buffers:
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
    rng_files = {"cpu": "rng-torch-cpu.bin"}
    states = [("rng-torch-cpu.bin", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng_files[f"cuda:{i}"] = f"rng-torch-cuda-{i}.bin"
            states.append((f"rng-torch-cuda-{i}.bin", s))
    for file_name, state in states:
        writer = _HashingWriter(os.path.join(tmp, file_name))
        writer.write(state)
        files[file_name] = writer.close()
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "config": engine.config.to_dict(),
        "compute_dtype": _dtype_name(engine.compute_dtype),
        "engine": {"micro_step": engine._micro_step, "loss_scale": engine._loss_scale,
                   "good_steps": engine._good_steps, "last_grad_norm": engine._last_grad_norm},
        "param_groups": [_jsonable_group(g, i) for i, g in enumerate(engine.optimizer.param_groups)],
        "rng": {"torch": rng_files, **_rng_python()},
        "units": units,
        "buffers": buffer_entries,
        "files": files,
    }
    manifest["checksum"] = _manifest_checksum(manifest)
    return manifest


@torch.no_grad()
def _write_unit(engine: "Engine", u: "_Unit", tmp: str, aliases: Dict[nn.Parameter, List[str]],
                files: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """One unit's file (see the module docstring); [Note: bounded checkpoint memory]."""
    file_name = f"unit-{u.index:05d}.bin"
    trainable_numel = u.spec.trainable_numel
    frozen = [e for e in u.spec.entries if not e.trainable]
    writer = _HashingWriter(os.path.join(tmp, file_name))
    entries = []
    try:
        sections: Dict[str, int] = {}
        if u.trainable:
            sections["master"] = writer.write(unit_master(engine, u)[:trainable_numel])
            moments = unit_moments(engine, u)
            sections["exp_avg"] = writer.write(moments[:trainable_numel])
            sections["exp_avg_sq"] = writer.write(moments[u.master_numel:u.master_numel + trainable_numel])
            del moments
        frozen_start = frozen[0].offset if frozen else 0
        if frozen:
            compute = unit_compute(engine, u)
            sections["frozen"] = writer.write(compute[frozen_start:u.spec.total_numel])
            frozen_dtype = compute.dtype
            del compute
        for k, e in enumerate(u.spec.entries):
            record = {"fqn": e.fqn, "names": aliases.get(e.param, [e.fqn]), "shape": list(e.shape),
                      "numel": e.numel, "dtype": _dtype_name(e.param.dtype), "trainable": e.trainable}
            if e.trainable:
                record.update(group_index=e.group_index, step=u.steps[k], file_dtype="float32",
                              master=sections["master"] + 4 * e.offset,
                              exp_avg=sections["exp_avg"] + 4 * e.offset,
                              exp_avg_sq=sections["exp_avg_sq"] + 4 * e.offset)
            else:
                size = frozen_dtype.itemsize
                record.update(file_dtype=_dtype_name(frozen_dtype),
                              value=sections["frozen"] + size * (e.offset - frozen_start))
            entries.append(record)
    except BaseException:
        writer.abort()
        raise
    files[file_name] = writer.close()
    return {"name": u.name, "file": file_name, "entries": entries}


# ---------------------------------------------------------------------- verify
def _checked_path(ckpt_dir: str, file_name: Any) -> str:
    if not isinstance(file_name, str) or not _FILE_NAME_RE.match(file_name) or file_name == MANIFEST:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: the manifest names the file {file_name!r}, "
                              "which is not a plain file name inside the checkpoint directory")
    path = os.path.join(ckpt_dir, file_name)
    if os.path.islink(path):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {file_name!r} is a symbolic link")
    return path


def read_manifest(ckpt_dir: str) -> Dict[str, Any]:
    """The manifest after checking every file it lists (existence, size, sha256)."""
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
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} has version "
                              f"{manifest.get('version')!r}; this offload reads version {VERSION}")
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} does not match its checksum "
                              "(the manifest was modified or corrupted)")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} has no file list")
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    for file_name, info in files.items():
        file_path = _checked_path(ckpt_dir, file_name)
        try:
            size = os.stat(file_path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} listed in the "
                                  "manifest is missing") from None
        if size != info.get("bytes"):
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} has {size} bytes, "
                                  f"the manifest says {info.get('bytes')} (truncated or replaced)")
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
    for u in manifest["units"]:
        if u["file"] not in files:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: unit {u['name']!r} names the file "
                                  f"{u['file']!r}, which the manifest does not list")
    return manifest


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
            saved[record["fqn"]] = dict(record, file=u["file"])
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
    ranges = [(record["file"], record[key], record["numel"] * 4)
              for record in saved.values() if record["trainable"]
              for key in ("master", "exp_avg", "exp_avg_sq")]
    for record in saved.values():
        if not record["trainable"]:
            if record.get("file_dtype") not in _DTYPES:
                raise CheckpointError(f"checkpoint file {record['file']!r}: parameter {record['fqn']!r} "
                                      f"has unknown dtype {record.get('file_dtype')!r}")
            ranges.append((record["file"], record["value"],
                           record["numel"] * _DTYPES[record["file_dtype"]].itemsize))
    for b in manifest["buffers"]:
        if b.get("dtype") not in _DTYPES:
            raise CheckpointError(f"checkpoint: buffer {b['name']!r} has unknown dtype {b.get('dtype')!r}")
        ranges.append(("buffers.bin", b["offset"], _numel(b["shape"]) * _DTYPES[b["dtype"]].itemsize))
    for file_name, offset, nbytes in ranges:  # every read is checked before any state changes
        size = files.get(file_name, {}).get("bytes", -1)
        if not isinstance(offset, int) or offset < 0 or offset + nbytes > size:
            raise CheckpointError(f"checkpoint file {file_name!r}: a manifest entry points at bytes "
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
    if engine._closed:
        raise RuntimeError("load_checkpoint: engine is closed")
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    manifest = read_manifest(ckpt_dir)           # 1. every file checked before any state changes
    saved = _match_model(engine, manifest, ckpt_dir)
    files = manifest["files"]
    engine._failure = {"fatal": True, "message": (
        f"load_checkpoint({ckpt_dir!r}) did not finish, so the engine holds a mix of states; "
        "load a checkpoint again before training")}
    try:
        for u in engine.units:                   # 2. unit by unit into the tiers
            _load_unit(engine, u, saved, ckpt_dir, files)
        _load_rest(engine, manifest, ckpt_dir, files)
    except OSError as error:
        raise OSError(error.errno, f"load_checkpoint({ckpt_dir!r}) failed while writing the states "
                      f"into their tiers: {error}; {engine._failure['message']}") from error
    engine._dirty.clear()
    engine._failure = None


@torch.no_grad()
def _load_unit(engine: "Engine", u: "_Unit", saved: Dict[str, Dict[str, Any]], ckpt_dir: str,
               files: Dict[str, Dict[str, Any]]) -> None:
    master = torch.zeros(u.master_numel, dtype=torch.float32)
    moments = torch.zeros(2 * u.master_numel, dtype=torch.float32)
    compute = torch.zeros(u.compute_numel, dtype=engine.compute_dtype)
    handles: Dict[str, BinaryIO] = {}
    try:
        for k_entry, e in enumerate(u.spec.entries):
            record = saved[e.fqn]
            file_name = record["file"]
            if file_name not in handles:
                handles[file_name] = open(_checked_path(ckpt_dir, file_name), "rb")
            f, size = handles[file_name], files[file_name]["bytes"]
            sl = slice(e.offset, e.offset + e.numel)
            if e.trainable:
                _read_range(f, file_name, size, record["master"], master[sl])
                _read_range(f, file_name, size, record["exp_avg"], moments[sl])
                _read_range(f, file_name, size, record["exp_avg_sq"],
                            moments[u.master_numel + e.offset:u.master_numel + e.offset + e.numel])
                # Derived compute copy: the master rounded as the Adam kernel rounds it.
                compute[sl].copy_(master[sl])
            else:
                file_dtype = _DTYPES.get(record.get("file_dtype"))
                if file_dtype is None:
                    raise CheckpointError(f"checkpoint file {file_name!r}: parameter {e.fqn!r} "
                                          f"has unknown dtype {record.get('file_dtype')!r}")
                value = torch.empty(e.numel, dtype=file_dtype)
                _read_range(f, file_name, size, record["value"], value)
                compute[sl].copy_(value)
    finally:
        for f in handles.values():
            f.close()
    steps = [saved[e.fqn]["step"] for e in u.trainable]
    if engine._param_tier == "device":
        engine._device.view(u.device_offset, u.compute_numel).copy_(compute)
    else:
        # A device copy of this unit is stale from now on.
        engine._release(u)
        engine._store(u.compute_home, compute)  # merged: fp32, the master itself
    if u.trainable:
        if not engine._merged:
            engine._store(u.master_home, master)
        engine._store(u.moments_home, moments)
    u.steps = steps
    u.has_grad = [False] * len(u.trainable)


def _load_rest(engine: "Engine", manifest: Dict[str, Any], ckpt_dir: str,
               files: Dict[str, Dict[str, Any]]) -> None:
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
    counters = manifest["engine"]
    engine._micro_step = counters["micro_step"]
    engine._loss_scale = counters["loss_scale"]
    engine._good_steps = counters["good_steps"]
    engine._last_grad_norm = counters["last_grad_norm"]
    rng = manifest["rng"]
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
    parameter's own dtype), buffers; every key of tied parameters. ``out_path`` ending in
    ``.safetensors`` gives a safetensors file, anything else a ``torch.save`` file.

    Memory: the safetensors writer streams in chunks. The torch.save file is written from
    memory maps of the checkpoint files (file-backed pages, not anonymous memory), except
    frozen parameters whose dtype differs from the saved one, converted one at a time."""
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
    """(names, file, offset, shape, file dtype, output dtype) of every tensor to export."""
    items = []
    for u in manifest["units"]:
        for r in u["entries"]:
            offset = r["master"] if r["trainable"] else r["value"]
            items.append({"names": r["names"], "file": u["file"], "offset": offset, "shape": r["shape"],
                          "file_dtype": r["file_dtype"],
                          "dtype": "float32" if r["trainable"] else r["dtype"]})
    for b in manifest["buffers"]:
        items.append({"names": [b["name"]], "file": "buffers.bin", "offset": b["offset"], "shape": b["shape"],
                      "file_dtype": b["dtype"], "dtype": b["dtype"]})
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
        file_dtype, dtype = _DTYPES[item["file_dtype"]], _DTYPES[item["dtype"]]
        numel = _numel(item["shape"])
        nbytes = numel * file_dtype.itemsize
        path = _checked_path(ckpt_dir, item["file"])
        if item["offset"] + nbytes > manifest["files"][item["file"]]["bytes"]:
            raise CheckpointError(f"checkpoint file {item['file']!r}: an entry lies outside the file")
        if nbytes == 0:
            tensor = torch.empty(item["shape"], dtype=dtype)
        else:
            raw = np.memmap(path, dtype=np.uint8, mode="r", offset=item["offset"], shape=(nbytes,))
            maps.append(raw)
            with warnings.catch_warnings():  # read-only map: torch warns that it is not writable
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(raw).view(file_dtype).view(item["shape"])
            if dtype != file_dtype:
                tensor = tensor.to(dtype)
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
    with open(tmp, "wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        for item in plan:
            file_dtype, dtype = _DTYPES[item["file_dtype"]], _DTYPES[item["dtype"]]
            numel = _numel(item["shape"])
            per_chunk = max(1, _CHUNK_BYTES // file_dtype.itemsize)
            with open(_checked_path(ckpt_dir, item["file"]), "rb") as f:
                size = manifest["files"][item["file"]]["bytes"]
                done = 0
                while done < numel:
                    n = min(per_chunk, numel - done)
                    chunk = torch.empty(n, dtype=file_dtype)
                    _read_range(f, item["file"], size, item["offset"] + done * file_dtype.itemsize, chunk)
                    out.write(_as_bytes(chunk.to(dtype)))
                    done += n
        out.flush()
        os.fsync(out.fileno())


__all__ = ["CheckpointError", "EngineFailedError", "export_checkpoint", "read_manifest"]
