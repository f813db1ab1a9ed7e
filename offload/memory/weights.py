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

Writing weights out (``Engine.save_pretrained``) is offload/checkpoint/export.py's
([Note: atomic model directory]); ``iter_weights`` below reads them one unit at a time.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from offload.io.safetensors import WeightFiles
from offload.memory.layout import UnitState

__all__ = ["PretrainedWeights", "WeightMatch", "match_weights", "open_weights", "close_weights", "iter_weights"]


@dataclass(frozen=True)
class WeightMatch:
    """Which tensor of a source each parameter and buffer of a model takes (``match_weights``)."""

    key_of: Dict[str, str]
    """The source's key for each parameter, by the parameter's first name."""
    buffer_keys: Dict[str, str]
    """The source's key for each buffer it holds, by the buffer's name."""
    missing: List[str]
    """Parameters with no tensor (``" = "``-joined names of a tied one); empty when strict."""
    unexpected: List[str]
    """Keys that match no parameter or buffer; empty when strict."""


def match_weights(model: nn.Module, shapes: Dict[str, Tuple[int, ...]], source: str,
                  check_conversion: Callable[[str, torch.dtype, str], None], strict: bool = True) -> WeightMatch:
    """[Note: weights into the tiers] Match the tensors of a source (``shapes``: its keys and
    their shapes) to ``model``'s parameters and buffers, before anything changes. A
    parameter tied to others needs one of its names. Mis-shaped tensors always, and with
    ``strict`` missing parameters and unexpected keys too, are one ValueError that begins
    with ``source`` and lists them all. ``check_conversion(key, dtype, what)`` raises where
    the key's values cannot become a ``dtype`` parameter or buffer."""
    names_of: Dict[int, List[str]] = {}
    shape_of: Dict[int, Tuple[int, ...]] = {}
    dtype_of: Dict[int, torch.dtype] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        shape_of[id(p)] = tuple(p.shape)
        dtype_of[id(p)] = p.dtype
    key_of: Dict[str, str] = {}
    missing: List[str] = []
    mis_shaped: List[str] = []
    for pid, names in names_of.items():
        present = [n for n in names if n in shapes]
        if not present:
            missing.append(" = ".join(names))
            continue
        for n in present:
            if tuple(shapes[n]) != shape_of[pid]:
                mis_shaped.append(f"{n}: file {tuple(shapes[n])}, model {shape_of[pid]}")
        key_of[names[0]] = present[0]
    buffer_keys: Dict[str, str] = {}
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, b in buffers.items():
        if name in shapes:
            if tuple(shapes[name]) != tuple(b.shape):
                mis_shaped.append(f"{name}: file {tuple(shapes[name])}, model {tuple(b.shape)}")
            buffer_keys[name] = name
    known = {n for names in names_of.values() for n in names} | set(buffer_keys)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in shapes if k not in known and not any(p.search(k) for p in ignored)]
    problems = []
    if missing and strict:
        problems.append(f"missing (no tensor for the parameter): {missing}")
    if unexpected and strict:
        problems.append(f"unexpected (no parameter or buffer of that name): {sorted(unexpected)}")
    if mis_shaped:
        problems.append(f"mis-shaped: {mis_shaped}")
    if problems:
        raise ValueError(f"{source} does not match the model; " + "; ".join(problems))
    first_name = {pid: names[0] for pid, names in names_of.items()}
    for pid, name in first_name.items():  # integers into weights refused, fp8 warned about
        if name in key_of:
            check_conversion(key_of[name], dtype_of[pid], "parameter")
    for name, key in buffer_keys.items():
        check_conversion(key, buffers[name].dtype, "buffer")
    return WeightMatch(key_of, buffer_keys, [] if strict else missing, [] if strict else sorted(unexpected))


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
        files = self.files
        match = match_weights(model, {name: tuple(shape) for name, (_, shape) in files.shapes.items()},
                              f"weights: {files.path!r}", files.check_conversion)
        return match.key_of, match.buffer_keys

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
