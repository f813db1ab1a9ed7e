"""Pretrained weights straight into the tiers: ``wrap(model, optimizer, config, weights=PATH)``.

[Note: weights into the tiers] ``PATH`` is a Hugging Face model directory or one
``.safetensors`` file (offload/io/safetensors.py). Before anything the caller holds is
touched, every parameter of the model is matched to a tensor of the files by name: a
parameter tied to others (one object under several names, as an embedding tied to the
output layer) needs one of its names present. Missing parameters, tensors that match no
parameter or buffer (``_keys_to_ignore_on_load_unexpected`` patterns of a transformers model
excepted) and shape mismatches are one ValueError that lists them all. Then moving the
model home (memory/materialize.py) fills each unit as it goes home: each parameter's tensor is
read from its file, converted to the parameter's dtype, and let go once the unit is home, so
peak RSS holds about one unit of weights whatever the model's size. A meta model's modules
are not randomly initialized first (their values would be overwritten), except those with a
meta buffer the files do not hold (a rotary embedding's ``inv_freq``, say): those run
``reset_parameters`` and ``init_fn``, or, without an ``init_fn``, the model's own
``_init_weights`` where it has one (transformers' convention), which computes such buffers.
Buffers the files hold are loaded too.

[Note: weights out] ``Engine.save_pretrained(DIR)`` writes what ``from_pretrained(DIR)``
reads: ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors`` of at most
``max_shard_size`` each and ``model.safetensors.index.json``, plus ``config.json`` (and
``generation_config.json``) when the model has a ``config`` with ``save_pretrained``. The
values are those of ``engine.state_dict()`` (the fp32 master of trainable parameters), read
one unit at a time as the files are written, so RAM holds about a unit; a parameter tied to
others is written once, under its first name (transformers ties it again on load).
``dtype`` converts floating-point tensors (``torch.bfloat16`` halves the files). Each file
is written beside its name and renamed into place; the index comes last, and files of an
earlier save in the other layout (a single file or shards) are removed so that
``from_pretrained`` cannot pick them up.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from offload.config import parse_size
from offload.io.safetensors import INDEX_NAME, SINGLE_NAME, SafetensorsWriter, WeightFiles
from offload.memory.layout import UnitState

__all__ = ["PretrainedWeights", "open_weights", "close_weights", "iter_weights", "save_pretrained"]


class PretrainedWeights:
    """The files of ``path`` matched against ``model`` (checked here, before any change);
    ``parameter(fqn, dtype)`` and ``buffer(fqn, dtype)`` read one tensor."""

    def __init__(self, path: "str | os.PathLike[str]", model: nn.Module) -> None:
        self.files = WeightFiles(path)
        try:
            self._key_of, self._buffer_keys = self._match(model)
        except BaseException:
            self.files.close()
            raise

    def _match(self, model: nn.Module) -> Tuple[Dict[str, str], Dict[str, str]]:
        shapes = self.files.shapes
        names_of: Dict[int, List[str]] = {}
        shape_of: Dict[int, Tuple[int, ...]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
            shape_of[id(p)] = tuple(p.shape)
        key_of: Dict[str, str] = {}
        missing: List[str] = []
        mis_shaped: List[str] = []
        for pid, names in names_of.items():
            present = [n for n in names if n in shapes]
            if not present:
                missing.append(" = ".join(names))
                continue
            for n in present:
                if tuple(shapes[n][1]) != shape_of[pid]:
                    mis_shaped.append(f"{n}: file {tuple(shapes[n][1])}, model {shape_of[pid]}")
            key_of[names[0]] = present[0]
        buffer_keys: Dict[str, str] = {}
        for name, b in model.named_buffers(remove_duplicate=False):
            if name in shapes:
                if tuple(shapes[name][1]) != tuple(b.shape):
                    mis_shaped.append(f"{name}: file {tuple(shapes[name][1])}, model {tuple(b.shape)}")
                buffer_keys[name] = name
        known = {n for names in names_of.values() for n in names} | set(buffer_keys)
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
        unexpected = [k for k in shapes if k not in known and not any(p.search(k) for p in ignored)]
        problems = []
        if missing:
            problems.append(f"missing (no tensor for the parameter): {missing}")
        if unexpected:
            problems.append(f"unexpected (no parameter or buffer of that name): {sorted(unexpected)}")
        if mis_shaped:
            problems.append(f"mis-shaped: {mis_shaped}")
        if problems:
            raise ValueError(f"weights: {self.files.path!r} does not match the model; " + "; ".join(problems))
        return key_of, buffer_keys

    def parameter(self, fqn: str, dtype: torch.dtype) -> torch.Tensor:
        """The values of the parameter first named ``fqn``, as ``dtype``."""
        return self.files.read(self._key_of[fqn]).to(dtype)

    def has_buffer(self, fqn: str) -> bool:
        return fqn in self._buffer_keys

    def buffer(self, fqn: str, dtype: torch.dtype) -> torch.Tensor:
        return self.files.read(self._buffer_keys[fqn]).to(dtype)

    def close(self) -> None:
        self.files.close()


def open_weights(path: "Optional[str | os.PathLike[str]]", model: nn.Module) -> Optional[PretrainedWeights]:
    """``PretrainedWeights(path, model)``, or None without a path."""
    return None if path is None else PretrainedWeights(path, model)


def close_weights(weights: Optional[PretrainedWeights]) -> None:
    if weights is not None:
        weights.close()


UnitValues = Callable[[UnitState], Dict[int, torch.Tensor]]
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def iter_weights(module: nn.Module, units: List[UnitState], unit_values: UnitValues,
                 aliases: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, value) for every entry of ``module.state_dict()``, in its order, a unit's
    values read when its first parameter comes (``unit_values``: Homes.unit_values) and
    kept until another unit's are needed. ``aliases=False`` skips the later names of a
    parameter tied to others. The tensors are views: clone what outlives the next one."""
    entry_of = {e.param: (u, e) for u in units for e in u.spec.entries}
    current: Tuple[Optional[UnitState], Dict[int, torch.Tensor]] = (None, {})
    seen = set()
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and value in entry_of:
            if not aliases and value in seen:
                continue
            seen.add(value)
            u, e = entry_of[value]
            if current[0] is not u:
                current = (None, {})  # let the last unit's values go first
                current = (u, unit_values(u))
            yield name, current[1][e.offset]
        else:
            yield name, value.detach()


def save_pretrained(directory: "str | os.PathLike[str]", module: nn.Module, units: List[UnitState],
                    unit_values: UnitValues, frozen_dtype: torch.dtype, dtype: Optional[torch.dtype] = None,
                    max_shard_size: "int | str" = "5GB") -> None:
    """[Note: weights out] ``frozen_dtype``: that of the values ``unit_values`` gives for
    frozen parameters (trainable ones come from the fp32 master)."""
    directory = os.fspath(directory)
    limit = parse_size(max_shard_size, "max_shard_size")
    if not limit:
        raise ValueError(f"max_shard_size: must be a positive size, got {max_shard_size!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating-point torch.dtype, got {dtype!r}")
    entry_of = {e.param: e for u in units for e in u.spec.entries}

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    # Names, dtypes and shapes first (a safetensors header precedes the data), cut into shards.
    layout: List[Tuple[str, torch.dtype, Tuple[int, ...]]] = []
    seen = set()
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter) and value in entry_of:
            if value in seen:
                continue
            seen.add(value)
            e = entry_of[value]
            shape, kind = tuple(e.shape), torch.empty(0, dtype=torch.float32 if e.trainable else frozen_dtype)
        else:
            shape, kind = tuple(value.shape), value
        layout.append((name, out_dtype(kind), shape))
    shards: List[List[Tuple[str, torch.dtype, Tuple[int, ...]]]] = [[]]
    size = 0
    for item in layout:
        nbytes = math.prod(item[2]) * torch.empty(0, dtype=item[1]).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    os.makedirs(directory, exist_ok=True)
    names = [SINGLE_NAME] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    values = iter_weights(module, units, unit_values, aliases=False)
    total = 0
    for file_name, shard in zip(names, shards):
        writer = SafetensorsWriter(os.path.join(directory, file_name), shard, metadata={"format": "pt"})
        try:
            for name, want, _ in shard:
                got, value = next(values)
                assert got == name, (got, name)
                writer.write(name, value.to(want))
            writer.finish()
        except BaseException:
            writer.abandon()
            raise
        total += writer.data_bytes
    index_path = os.path.join(directory, INDEX_NAME)
    if len(shards) > 1:
        weight_map = {name: file_name for file_name, shard in zip(names, shards) for name, _, _ in shard}
        with open(index_path + ".partial", "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(index_path + ".partial", index_path)
    for old in os.listdir(directory):  # an earlier save in the other layout
        stale = old == SINGLE_NAME if len(shards) > 1 else (old == INDEX_NAME or _SHARD_RE.match(old))
        if stale or (_SHARD_RE.match(old) and old not in names):
            os.unlink(os.path.join(directory, old))
    for attribute in ("config", "generation_config"):
        config = getattr(module, attribute, None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
