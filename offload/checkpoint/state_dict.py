"""``engine.load_state_dict``: weights from a state dict into the tiers, as ``weights=``
puts them there at wrap ([Note: weights into the tiers]: the same matching of names,
shapes and dtypes, before anything is written), unit by unit through the writer a
checkpoint load uses (CheckpointAccess.write_unit_weights), with the optimizer's states
left alone."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict

import torch
from torch.nn.modules.module import _IncompatibleKeys

from offload.memory.weights import match_weights

if TYPE_CHECKING:
    from offload.checkpoint.access import CheckpointAccess
    from offload.memory.layout import UnitState


def _check_conversion(state_dict: Dict[str, torch.Tensor]) -> Callable[[str, torch.dtype, str], None]:
    def check(key: str, dtype: torch.dtype, what: str) -> None:
        have = state_dict[key].dtype
        if dtype.is_floating_point and not have.is_floating_point:
            raise ValueError(f"load_state_dict: tensor {key!r} is {have}, and the {what} it would load into is "
                             f"{dtype}: integer or bool values are not weights")
    return check


def load_weights(access: "CheckpointAccess", state_dict: Dict[str, torch.Tensor], strict: bool,
                 unfinished: str) -> _IncompatibleKeys:
    """Check ``state_dict`` against the model (a ValueError before any change), then write
    each unit's weights home and copy the buffers it holds into the model's. ``unfinished``:
    the engine's failure while units are being written (an I/O error part-way leaves a mix)."""
    module = access.module
    not_tensors = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"load_state_dict: the values of {not_tensors[:4]} are not tensors")
    match = match_weights(module, {k: tuple(v.shape) for k, v in state_dict.items()}, "load_state_dict: the state dict",
                          _check_conversion(state_dict), strict)
    access.begin_state_load(unfinished)
    try:
        for u in access.units:
            values = {e.offset: state_dict[match.key_of[e.fqn]] for e in u.spec.entries if e.fqn in match.key_of}
            if values:
                access.write_unit_weights(u, _unit_reader(access, u, values))
    finally:
        access.release_buffers()
    buffers = dict(module.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, key in match.buffer_keys.items():
            buffers[name].copy_(state_dict[key])
    access.finish_state_load()
    return _IncompatibleKeys(match.missing, match.unexpected)


def _unit_reader(access: "CheckpointAccess", u: "UnitState", values: Dict[int, torch.Tensor]
                 ) -> Callable[[str, int, int, torch.Tensor], None]:
    """``read(section, lo, hi, out)`` for write_unit_weights: the new values of the
    parameters in ``values`` (by element offset), the current ones of the others of u."""
    tail = u.spec.frozen_start
    complete = len(values) == len(u.spec.entries)

    def read(section: str, lo: int, hi: int, out: torch.Tensor) -> None:
        base = tail if section == "value" else 0
        if complete:
            out.zero_()  # the gaps between parameters
        elif section == "value":
            out.copy_(access.read_frozen_values(u, lo, hi))
        else:
            out.copy_(access.read_master(u, lo, hi))
        for offset, value in values.items():
            a, b = max(offset - base, lo), min(offset - base + value.numel(), hi)
            if a < b:
                flat = value.detach().reshape(-1)[a - (offset - base):b - (offset - base)]
                out[a - lo:b - lo].copy_(flat.to(out.dtype))
    return read
