"""A checkpoint's weights as one state dict file, or as a Hugging Face model directory
(``offload export``), and an engine's weights as a model directory (``Engine.save_pretrained``).

[Note: atomic model directory] A save into a model directory DIR (save_pretrained, and
``offload export --format safetensors``) leaves DIR holding the whole earlier save or the
whole new one at every instant, for this package's reader and for ``from_pretrained`` alike
(both take ``model.safetensors`` over an index), and touches nothing else DIR holds (a
Trainer's output_dir holds its ``checkpoint-N`` directories). The steps:

1. Stage: every file is written into DIR/.offload-save-PID-HEX, made 0700 for this save
   (weights files created there O_EXCL|O_NOFOLLOW), made 0600 and fsynced. Shards get the usual
   names ``model-0000k-of-0000n.safetensors``, or, where DIR holds any of those already,
   those names with the save id after them, so that no file of the earlier save is replaced.
   Each weights file and the index carry the save id ([Note: save ids] in io/safetensors.py).
2. Move in: the shards and config files are renamed into DIR, then DIR is fsynced; then the
   file readers start from: ``model.safetensors`` (replacing the earlier one in one rename),
   or the index, after which an earlier ``model.safetensors`` is removed (readers switch
   there); DIR is fsynced after each.
3. Clean: the earlier save's files (those its index named, shards nothing names, the index
   a one-file save leaves behind) are removed, then the staging directory.

An exception before the switch removes what was moved in (config files excepted: the same
model writes the same ones) and the staging directory: DIR is as before. After the switch
the new save is in place (an error removing the earlier one's files says so). A kill leaves the staging directory and
files no index names, which the next save into DIR removes (a staging directory once its
process has exited). Why not put a finished directory in place as checkpoints do ([Note:
atomic checkpoint directory]): DIR is often shared with files that are not the save's, and
moving those across is not atomic.

Each durable step hits a fault point ``checkpoint.pretrained.<step>`` (offload/faults.py)
just before its system call; an OSError there, injected or real, keeps its errno and names
the file.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from offload import faults
from offload.checkpoint.directory import DIR_MODE, FILE_MODE, refuse_missing
from offload.checkpoint.format import (
    CHUNK_BYTES, DTYPES, PieceReader, checked_path, numel_of, optimizer_states_of, read_manifest)
from offload.config import parse_size
from offload.errors import CheckpointError
from offload.io.safetensors import INDEX_NAME, SAVE_ID_KEY, SINGLE_NAME, SafetensorsWriter, open_regular
from offload.io.swap import pid_alive
from offload.memory.compact_codec import decode_master
from offload.memory.layout import UnitState
from offload.memory.weights import iter_weights

Layout = List[Tuple[str, torch.dtype, Tuple[int, ...]]]
UnitValues = Callable[[UnitState], Dict[int, torch.Tensor]]
# Accepted by save_pretrained's dtype, as torch dtypes or as OffloadConfig.dtype spells them.
EXPORT_DTYPES: Dict[Any, torch.dtype] = {
    torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_STAGING_RE = re.compile(r"^\.offload-save-(?P<pid>\d+)-[0-9a-f]+$")
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}(-[0-9a-f]{16})?\.safetensors$")


def export_checkpoint(ckpt_dir: str, out_path: str) -> None:
    """Write the checkpoint's weights as one state dict that ``model.load_state_dict()``
    accepts: fp32 masters for trainable parameters, saved values for frozen ones (in the
    parameter's own dtype), buffers; every key of tied parameters. A checkpoint of several
    ranks is consolidated (each parameter's pieces joined). ``out_path`` ending in
    ``.safetensors`` gives a safetensors file, anything else a ``torch.save`` file. Either is
    written beside ``out_path`` as a new 0600 file (O_EXCL|O_NOFOLLOW), fsynced and renamed.

    Memory: the safetensors writer streams in chunks. The torch.save file is written from
    memory maps of the checkpoint files (file-backed pages, not anonymous memory), except
    parameters in several pieces or whose dtype differs from the saved one, joined or
    converted one at a time."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    refuse_missing(ckpt_dir, "export_checkpoint")  # [Note: atomic checkpoint directory]
    manifest = read_manifest(ckpt_dir)
    out_path = os.fspath(out_path)
    items = _export_items(manifest)
    if out_path.endswith(".safetensors"):
        layout = [(name, DTYPES[item["dtype"]], tuple(item["shape"])) for item in items for name in item["names"]]
        # each name of a tied parameter gets its own bytes (safetensors has no aliasing)
        named = [(name, item) for item in items for name in item["names"]]
        reader = PieceReader(ckpt_dir, manifest["files"])
        writer = SafetensorsWriter(out_path, layout, metadata={"format": "pt"})
        try:
            for name, item in named:
                writer.write_parts(name, _chunks(reader, item))
            writer.finish()
        except BaseException:
            writer.abandon()
            raise
        finally:
            reader.close()
    else:
        _write_torch_save(ckpt_dir, manifest, items, out_path)


def _export_items(manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """(names, shape, output dtype, pieces as (file, offset, numel, file dtype)) of every
    tensor to export."""
    items = []
    compact = optimizer_states_of(manifest) == "compact"
    for u in manifest["units"]:
        for r in u["entries"]:
            if r["trainable"] and compact:  # [Note: compact optimizer states] master = high + low
                pieces = [(p["file"], p["high"], p["numel"], "bfloat16", p["low"]) for p in r["pieces"]]
            else:
                key = "master" if r["trainable"] else "value"
                pieces = [(p["file"], p[key], p["numel"], "float32" if r["trainable"] else p["file_dtype"], None)
                          for p in r["pieces"]]
            items.append({"names": r["names"], "shape": r["shape"], "pieces": pieces,
                          "dtype": "float32" if r["trainable"] else r["dtype"]})
    for b in manifest["buffers"]:
        items.append({"names": [b["name"]], "shape": b["shape"], "dtype": b["dtype"],
                      "pieces": [("buffers.bin", b["offset"], numel_of(b["shape"]), b["dtype"], None)]})
    return items


def _write_torch_save(ckpt_dir: str, manifest: Dict[str, Any], items: List[Dict[str, Any]], out_path: str) -> None:
    import numpy as np

    result: Dict[str, torch.Tensor] = {}
    maps = []
    for item in items:
        dtype = DTYPES[item["dtype"]]
        parts = []
        for file_name, offset, numel, file_dtype_name, low_offset in item["pieces"]:
            file_dtype = DTYPES[file_dtype_name]

            def mapped(at: int, dtype: torch.dtype) -> torch.Tensor:
                nbytes = numel * dtype.itemsize
                if at + nbytes > manifest["files"][file_name]["bytes"]:
                    raise CheckpointError(f"checkpoint file {file_name!r}: an entry lies outside the file")
                raw = np.memmap(checked_path(ckpt_dir, file_name), dtype=np.uint8, mode="r", offset=at, shape=(nbytes,))
                maps.append(raw)
                with warnings.catch_warnings():  # read-only map: torch warns that it is not writable
                    warnings.simplefilter("ignore", UserWarning)
                    return torch.from_numpy(raw).view(dtype)
            if low_offset is None:
                parts.append(mapped(offset, file_dtype))
            else:  # [Note: compact optimizer states] decoded one piece at a time
                parts.append(decode_master(mapped(offset, file_dtype), mapped(low_offset, torch.int8)))
        if not parts:
            tensor = torch.empty(item["shape"], dtype=dtype)
        elif len(parts) == 1 and parts[0].dtype == dtype:
            tensor = parts[0].view(item["shape"])
        else:
            tensor = torch.cat([part.to(dtype) for part in parts]).view(item["shape"])
        for name in item["names"]:
            result[name] = tensor
    partial = f"{out_path}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            torch.save(result, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, out_path)
    except BaseException:
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass
        raise
    result.clear()  # the maps' tensors go before the maps
    maps.clear()


def _chunks(reader: PieceReader, item: Dict[str, Any]) -> Iterator[torch.Tensor]:
    dtype = DTYPES[item["dtype"]]
    for file_name, offset, numel, file_dtype_name, low_offset in item["pieces"]:
        file_dtype = DTYPES[file_dtype_name]
        per_chunk = max(1, CHUNK_BYTES // file_dtype.itemsize)
        for done in range(0, numel, per_chunk):
            chunk = torch.empty(min(per_chunk, numel - done), dtype=file_dtype)
            reader.read(file_name, offset + done * file_dtype.itemsize, chunk)
            if low_offset is not None:  # [Note: compact optimizer states] master = high + low
                low = torch.empty(chunk.numel(), dtype=torch.int8)
                reader.read(file_name, low_offset + done, low)
                chunk = decode_master(chunk, low)
            yield chunk.to(dtype)


# ---------------------------------------------------------------------- model directories
def export_dtype(dtype: Any) -> Optional[torch.dtype]:
    """save_pretrained's ``dtype`` as a torch dtype (None: each tensor's own)."""
    if dtype is None:
        return None
    try:
        return EXPORT_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype: expected torch.float32, torch.bfloat16, torch.float16, 'fp32', 'bf16', "
                         f"'fp16' or None, got {dtype!r}") from None


def _shard_limit(max_shard_size: "int | str") -> int:
    limit = parse_size(max_shard_size, "max_shard_size")
    if not limit:
        raise ValueError(f"max_shard_size: must be a positive size, got {max_shard_size!r}")
    return limit


def _target(directory: Any, verb: str) -> str:
    """The absolute path of a model directory to save into; a ValueError, before anything
    is written, when it is not a path or names something that is not a directory."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"{verb}: the directory must be a path, got {directory!r}")
    target = os.path.abspath(os.fspath(directory))
    if os.path.lexists(target) and not os.path.isdir(target):
        raise ValueError(f"{verb}: {target!r} exists and is not a directory")
    return target


def _cut(sizes: Sequence[int], limit: int) -> List[List[int]]:
    """The indices of ``sizes`` cut in order into runs of at most ``limit`` bytes each (a
    larger item alone)."""
    shards: List[List[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def save_pretrained(directory: "str | os.PathLike[str]", module: nn.Module, units: List[UnitState],
                    unit_values: UnitValues, frozen_dtype: torch.dtype, dtype: Any = None,
                    max_shard_size: "int | str" = "5GB", write: bool = True) -> None:
    """An engine's weights as a Hugging Face model directory (``Engine.save_pretrained``):
    ``model.safetensors``, or shards of at most ``max_shard_size`` and
    ``model.safetensors.index.json``, plus ``config.json`` (and ``generation_config.json``)
    when the model has a ``config`` with ``save_pretrained``, put in place as [Note: atomic
    model directory] says. The values are those of ``iter_weights`` (the fp32 master of
    trainable parameters; ``frozen_dtype``: that of frozen ones), read one unit at a time as
    the files are written; a parameter tied to others is written once, under its first name
    (transformers ties it again on load). ``dtype`` (see ``export_dtype``) converts
    floating-point tensors. Arguments are checked before anything is written. ``write=False``
    (the ranks other than 0 of a run with several): the values are read, unit by unit as
    the writer reads them, and nothing is written ([Note: save_pretrained with several ranks]
    in engine.py)."""
    target = _target(directory, "save_pretrained")
    limit = _shard_limit(max_shard_size)
    out_dtype = export_dtype(dtype)
    entry_of = {e.param: e for u in units for e in u.spec.entries}
    # Names, dtypes and shapes first (a safetensors header precedes the data).
    layout: Layout = []
    seen = set()
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and value in entry_of:
            if value in seen:
                continue
            seen.add(value)
            e = entry_of[value]
            shape, kind = tuple(e.shape), torch.float32 if e.trainable else frozen_dtype
        else:
            shape, kind = tuple(value.shape), value.dtype
        layout.append((name, out_dtype if out_dtype is not None and kind.is_floating_point else kind, shape))
    shards = [[layout[i] for i in run] for run in _cut([_nbytes(s, d) for _, d, s in layout], limit)]
    values = iter_weights(module, units, unit_values, aliases=False)
    if not write:
        for _ in values:  # the reads' collectives, in the writer's order
            pass
        return

    def tensors() -> Iterator[Tuple[str, Iterable[torch.Tensor]]]:
        for (name, want, _), (got, value) in zip(layout, values):
            assert got == name, (got, name)
            yield name, [value.to(want)]

    configs = [c for c in (getattr(module, "config", None), getattr(module, "generation_config", None))
               if c is not None and hasattr(c, "save_pretrained")]
    write_model_directory(target, "save_pretrained", shards, tensors(), configs)


def export_pretrained(ckpt_dir: str, out_dir: str, max_shard_size: "int | str" = "5GB") -> None:
    """The checkpoint's weights as a Hugging Face model directory, as
    ``Engine.save_pretrained`` writes it: ``model.safetensors``, or shards of at most
    ``max_shard_size`` and ``model.safetensors.index.json``; a tied parameter under its
    first name only; put in place as [Note: atomic model directory] says. No config.json (a
    checkpoint does not hold the model's config: copy it beside)."""
    target = _target(out_dir, "export")
    limit = _shard_limit(max_shard_size)
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    manifest = read_manifest(ckpt_dir)
    named = [(item["names"][0], item) for item in _export_items(manifest)]
    layout = [(name, DTYPES[item["dtype"]], tuple(item["shape"])) for name, item in named]
    shards = [[layout[i] for i in run] for run in _cut([_nbytes(s, d) for _, d, s in layout], limit)]
    reader = PieceReader(ckpt_dir, manifest["files"])
    try:
        write_model_directory(target, "export", shards,
                              ((name, _chunks(reader, item)) for name, item in named), [])
    finally:
        reader.close()


def write_model_directory(target: str, verb: str, shards: List[Layout],
                          tensors: Iterator[Tuple[str, Iterable[torch.Tensor]]], configs: Sequence[Any]) -> None:
    """[Note: atomic model directory] The tensors (name, flat parts of it in its dtype), in
    the order of ``shards``, and the ``configs`` (objects with ``save_pretrained(DIR)``)
    saved into ``target``. ``verb`` starts the messages of errors."""
    save = _DirectorySave(target, verb)
    try:
        for config in configs:
            save.stage_config(config)
        names = save.shard_names(len(shards))
        metadata = {"format": "pt", SAVE_ID_KEY: save.save_id}
        for file_name, layout in zip(names, shards):
            f = save.create(file_name)
            try:
                writer = SafetensorsWriter(f, layout, metadata=metadata)
                for name, _, _ in layout:
                    got, parts = next(tensors)
                    assert got == name, (got, name)
                    writer.write_parts(name, parts)
                writer.finish()
                f.sync()
            finally:
                f.close()
        if len(shards) > 1:
            weight_map = {name: file_name for file_name, layout in zip(names, shards) for name, _, _ in layout}
            total = sum(_nbytes(shape, dtype) for layout in shards for _, dtype, shape in layout)
            index = {"metadata": {"total_size": total, SAVE_ID_KEY: save.save_id}, "weight_map": weight_map}
            f = save.create(INDEX_NAME)
            try:
                f.write(json.dumps(index, indent=2, sort_keys=True).encode("utf-8"))
                f.sync()
            finally:
                f.close()
        save.commit(names)
    except BaseException:
        save.abandon()
        raise
    finally:
        save.close()


class _StagedFile:
    """A new file of the staging directory, written with each write a durable step."""

    def __init__(self, save: "_DirectorySave", name: str) -> None:
        self.save = save
        self.name = os.path.join(save.staging_path, name)  # as a file object's: its path
        self.fd = save.step("create", "create", self.name, os.open, name,
                            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                            dir_fd=save.staging_fd)
        try:
            save.step(None, "set the mode of", self.name, os.fchmod, self.fd, FILE_MODE)
        except BaseException:
            self.close()
            raise

    def write(self, data: "bytes | memoryview") -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += self.save.step("write", "write", self.name, os.write, self.fd, view[done:])
        return done

    def flush(self) -> None:
        pass  # unbuffered: every write went to the file

    def sync(self) -> None:
        self.save.step("fsync", "fsync", self.name, os.fsync, self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _DirectorySave:
    """One save into the model directory ``target`` ([Note: atomic model directory]): files
    are made in its staging directory (``create``, ``stage_config``), moved in by
    ``commit``; ``abandon`` after any failure, ``close`` in the end."""

    def __init__(self, target: str, verb: str) -> None:
        self.target, self.verb = target, verb
        self.save_id = secrets.token_hex(8)
        self.dir_fd = self.staging_fd = -1
        self.switched = False  # readers take the new save
        self.moved: List[str] = []  # weights files moved into target, undone before the switch
        self.staging_name = f".offload-save-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            created = not os.path.isdir(target)
            if created:  # private like a checkpoint; an existing directory keeps its mode
                self.step("mkdir", "create the directory", target, os.makedirs, target, DIR_MODE, True)
            self.dir_fd = self.step(None, "open the directory", target, os.open, target,
                                    os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if created:
                self.step(None, "set the mode of", target, os.fchmod, self.dir_fd, DIR_MODE)
            self._remove_stale()
            self.before = set(os.listdir(self.dir_fd))
            self.earlier_shards = self._earlier_shards()
            self.step("mkdir", "create the directory", self.staging_path, os.mkdir, self.staging_name, DIR_MODE,
                      dir_fd=self.dir_fd)
            self.staging_fd = self.step(None, "open the directory", self.staging_path, os.open, self.staging_name,
                                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                        dir_fd=self.dir_fd)
            self.step(None, "set the mode of", self.staging_path, os.fchmod, self.staging_fd, DIR_MODE)
        except BaseException:
            self.abandon()
            self.close()
            raise

    @property
    def staging_path(self) -> str:
        return os.path.join(self.target, self.staging_name)

    def step(self, point: Optional[str], what: str, path: str, call: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
        """``call(*args, **kwargs)`` after fault point ``checkpoint.pretrained.<point>`` (None:
        none): one durable step. An OSError keeps its errno and names ``path``."""
        try:
            if point is not None:
                faults.hit(f"checkpoint.pretrained.{point}", path=path)
            return call(*args, **kwargs)
        except OSError as error:
            raise OSError(error.errno, f"{self.verb} could not {what} ({error.strerror or error})", path) from error

    def _remove_stale(self) -> None:
        """Staging directories that saves of exited processes left."""
        for entry in sorted(os.listdir(self.dir_fd)):
            match = _STAGING_RE.match(entry)
            if match and not pid_alive(int(match.group("pid"))):
                path = os.path.join(self.target, entry)  # rmtree never follows a link there
                self.step("remove_stale", "remove", path, shutil.rmtree, path)

    def _earlier_shards(self) -> Set[str]:
        """The .safetensors files the index in ``target`` names (none without a readable one)."""
        if INDEX_NAME not in self.before:
            return set()
        try:
            with os.fdopen(open_regular(os.path.join(self.target, INDEX_NAME)), encoding="utf-8") as f:
                files = json.load(f)["weight_map"].values()
            return {f for f in files if isinstance(f, str) and os.path.basename(f) == f and f.endswith(".safetensors")}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return set()  # not an index anything reads: only the usual shard names are cleaned

    def shard_names(self, count: int) -> List[str]:
        """[Note: atomic model directory] The names of ``count`` files of weights."""
        if count == 1:
            return [SINGLE_NAME]
        usual = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        if not self.before.intersection(usual):
            return usual
        return [f"model-{k + 1:05d}-of-{count:05d}-{self.save_id}.safetensors" for k in range(count)]

    def create(self, name: str) -> _StagedFile:
        return _StagedFile(self, name)

    def stage_config(self, config: Any) -> None:
        """``config.save_pretrained`` into the staging directory (reached through this
        process's descriptor of it where /proc has one), its files then made 0600 and fsynced."""
        before = set(os.listdir(self.staging_fd))
        through_fd = f"/proc/self/fd/{self.staging_fd}"
        config.save_pretrained(through_fd if os.path.isdir(through_fd) else self.staging_path)
        for name in sorted(set(os.listdir(self.staging_fd)) - before):
            path = os.path.join(self.staging_path, name)
            fd = self.step(None, "open", path, os.open, name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=self.staging_fd)
            try:
                self.step(None, "set the mode of", path, os.fchmod, fd, FILE_MODE)
                self.step("fsync", "fsync", path, os.fsync, fd)
            finally:
                os.close(fd)

    def _move(self, name: str) -> None:
        self.step("move", f"move {name!r} from {self.staging_path!r} into the directory",
                  os.path.join(self.target, name), os.rename, name, name,
                  src_dir_fd=self.staging_fd, dst_dir_fd=self.dir_fd)

    def _sync(self) -> None:
        self.step("dir_fsync", "fsync the directory", self.target, os.fsync, self.dir_fd)

    def commit(self, names: List[str]) -> None:
        """[Note: atomic model directory] Steps 2 and 3: move in, switch, clean."""
        root = SINGLE_NAME if names == [SINGLE_NAME] else INDEX_NAME
        weights = set(names) | {root}
        for name in sorted(os.listdir(self.staging_fd), key=lambda n: (n not in weights, n)):
            if name != root:
                self._move(name)
                if name in weights:
                    self.moved.append(name)
        self._sync()
        self._move(root)
        if root == SINGLE_NAME or SINGLE_NAME not in os.listdir(self.dir_fd):
            self.switched = True
        else:
            self.moved.append(root)
        self._sync()
        if not self.switched:
            self.step("switch", "remove the earlier save's file", os.path.join(self.target, SINGLE_NAME),
                      os.unlink, SINGLE_NAME, dir_fd=self.dir_fd)
            self.switched = True
            self._sync()
        stale = {n for n in os.listdir(self.dir_fd) if _SHARD_RE.match(n)} | \
            (self.earlier_shards & set(os.listdir(self.dir_fd)))
        if root == SINGLE_NAME:
            stale.add(INDEX_NAME)
        for name in sorted(stale - weights):
            self._remove_old(name)
        self._sync()
        self._remove_old(self.staging_name, os.rmdir)

    def _remove_old(self, name: str, remove: Callable[..., None] = os.unlink) -> None:
        path = os.path.join(self.target, name)
        try:
            self.step("remove_old", "remove", path, remove, name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise OSError(error.errno, f"{self.verb}: the new save is in place in {self.target!r}, but "
                          f"{error.strerror}", error.filename) from error

    def abandon(self) -> None:
        """After a failure: before the switch, what was moved in goes, so ``target`` is as
        before; the staging directory goes in any case. Errors here are not raised (the
        failure is)."""
        if self.dir_fd < 0:
            return
        if not self.switched:
            for name in self.moved:
                try:
                    os.unlink(name, dir_fd=self.dir_fd)
                except OSError:
                    pass
            self.moved = []
        if self.staging_fd >= 0 or os.path.lexists(self.staging_path):
            shutil.rmtree(self.staging_path, ignore_errors=True)

    def close(self) -> None:
        for fd in (self.staging_fd, self.dir_fd):
            if fd >= 0:
                os.close(fd)
        self.staging_fd = self.dir_fd = -1
