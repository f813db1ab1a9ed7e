"""Loading a checkpoint: every file and the model's match are checked before any state
changes, then the states stream into their tiers unit by unit ([Note: sharded checkpoints],
[Note: bounded checkpoint memory])."""
from __future__ import annotations

import math
import os
import random
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from offload.checkpoint.access import Ranks, attempt
from offload.checkpoint.directory import refuse_missing
from offload.checkpoint.format import (
    COMPACT_SECTIONS, DTYPES, MANIFEST, PieceReader, checked_path, numel_of, optimizer_states_of, read_manifest,
    read_range, state_dict_aliases)
from offload.errors import CheckpointError, warn_at_caller
from offload.memory.compact_codec import BLOCK_NUMEL, num_blocks
from offload.optim.generic import step_from_json

if TYPE_CHECKING:
    from offload.checkpoint.access import CheckpointAccess
    from offload.memory.layout import UnitState


def _match_model(access: "CheckpointAccess", manifest: Dict[str, Any], ckpt_dir: str) -> Dict[str, Dict[str, Any]]:
    """Checkpoint entry for each engine parameter, or a CheckpointError naming the parameter."""
    saved_states, ours = optimizer_states_of(manifest), access.config.optimizer_states
    if saved_states != ours:  # [Note: compact optimizer states] codes are not fp32 states, nor the reverse
        raise CheckpointError(f"optimizer_states: checkpoint manifest {os.path.join(ckpt_dir, MANIFEST)!r} holds "
                              f"{saved_states!r} optimizer states, this engine runs optimizer_states={ours!r}; "
                              f"load it into an engine with optimizer_states={saved_states!r}")
    saved: Dict[str, Dict[str, Any]] = {}
    for u in manifest["units"]:
        for record in u["entries"]:
            saved[record["fqn"]] = record
    ours = {e.fqn: e for u in access.units for e in u.spec.entries}
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
        if b.get("dtype") not in DTYPES:
            raise CheckpointError(f"checkpoint: buffer {b['name']!r} has unknown dtype {b.get('dtype')!r}")
        offset, nbytes = b["offset"], numel_of(b["shape"]) * DTYPES[b["dtype"]].itemsize
        size = files.get("buffers.bin", {}).get("bytes", -1)
        if not isinstance(offset, int) or offset < 0 or offset + nbytes > size:
            raise CheckpointError(f"checkpoint file 'buffers.bin': a manifest entry points at bytes "
                                  f"[{offset}, {offset}+{nbytes}) outside the file ({size} bytes)")
    saved_state = manifest.get("optimizer_state")  # [Note: elementwise optimizers] absent: Adam's
    if saved_state != access.optimizer_state:
        def what(layout: Optional[Dict[str, Any]]) -> str:
            return "Adam's (exp_avg, exp_avg_sq)" if layout is None else \
                f"{layout.get('class')}'s ({', '.join(map(str, layout.get('slots', [])))})"
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: its optimizer state is {what(saved_state)}, this "
                              f"engine's optimizer keeps {what(access.optimizer_state)}")
    groups = manifest["param_groups"]
    if len(groups) != len(access.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {len(groups)} optimizer param groups in the "
                              f"checkpoint, {len(access.optimizer.param_groups)} in the optimizer")
    for i, (group, values) in enumerate(zip(access.optimizer.param_groups, groups)):
        for key, value in values.items():
            problem = _group_value_problem(key, value, group.get(key))
            if problem is not None:
                raise CheckpointError(f"checkpoint manifest {os.path.join(ckpt_dir, MANIFEST)!r}: field "
                                      f"'param_groups[{i}].{key}' {problem}, got {value!r}"[:400])
    _, buffers = state_dict_aliases(access.module)
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
        if manifest["config"].get(key) != getattr(access.config, key):
            reset = ""
            if key == "dtype":  # CheckpointAccess.restore_training_counters
                fresh = access.fresh_loss_scaling()["loss_scale"]
                reset = (f"; the loss scale is reset to {fresh:g}, where {access.config.dtype} runs start "
                         f"(the checkpoint's was {manifest['engine']['loss_scale']:g})")
            warn_at_caller(f"load_checkpoint: the checkpoint was written with {key}="
                           f"{manifest['config'].get(key)!r}, this engine uses "
                           f"{getattr(access.config, key)!r}; the run will not continue bit-identically{reset}")
    return saved


def _group_value_problem(key: str, value: Any, current: Any) -> Optional[str]:
    """Why a saved param-group value cannot replace the optimizer's ``current`` one (the
    kind it has, and torch.optim.AdamW's ranges), or None. Keys the optimizer does not have
    (a scheduler's initial_lr) are taken as saved."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if key == "params":
        return "is not saved in a checkpoint"
    if isinstance(current, torch.Tensor):
        current = current.item() if current.numel() == 1 else None
    if isinstance(current, bool):
        return None if isinstance(value, bool) else "must be true or false"
    low = {"lr": 0.0, "eps": 0.0, "weight_decay": 0.0}.get(key)
    if number(current):
        if not number(value):
            return "must be a finite number"
        return None if low is None or value >= low else f"must be >= {low}"
    if isinstance(current, (tuple, list)):
        # None where the optimizer has None (Adafactor's eps=(None, 1e-3): "derive it")
        if not (isinstance(value, list) and len(value) == len(current)
                and all(number(v) or (v is None and c is None) for v, c in zip(value, current))):
            return f"must be a list of {len(current)} finite numbers"
        if key == "betas" and not all(0.0 <= v < 1.0 for v in value):
            return "must be in [0, 1)"
    return None


def _read_rng(manifest: Dict[str, Any], ckpt_dir: str, rank: int) -> Dict[str, Any]:
    """The RNG states this rank continues from (those of the nearest saved rank), read and
    tried on scratch generators, so that applying them once the states are replaced cannot
    fail: a state a generator refuses is a CheckpointError naming its file or field."""
    saved_ranks = manifest["rng"]["ranks"]
    r = min(rank, len(saved_ranks) - 1)
    record, files = saved_ranks[r], manifest["files"]
    torch_states: List[Tuple[str, torch.Tensor]] = []
    for device, file_name in record["torch"].items():
        index = None if device == "cpu" else int(device.split(":")[1])
        if index is not None and not (torch.cuda.is_available() and index < torch.cuda.device_count()):
            continue  # a GPU this machine lacks: as set_rng_state would, skip it
        state = torch.empty(files[file_name]["bytes"], dtype=torch.uint8)
        with open(checked_path(ckpt_dir, file_name), "rb") as f:
            read_range(f, file_name, files[file_name]["bytes"], 0, state)
        try:
            torch.Generator(device=device).set_state(state)
        except RuntimeError as error:
            raise CheckpointError(f"checkpoint file {file_name!r} in {ckpt_dir!r} is not a torch RNG state "
                                  f"for {device} ({error})") from None
        torch_states.append((device, state))
    field = f"checkpoint manifest {os.path.join(ckpt_dir, MANIFEST)!r}: field 'rng.ranks[{r}]"
    version, internal, gauss = record["random"]
    python_state = (version, tuple(internal), gauss)
    try:
        random.Random().setstate(python_state)
    except (ValueError, TypeError, OverflowError) as error:
        raise CheckpointError(f"{field}.random' is not a state of Python's random ({error})") from None
    numpy_state = None
    if "numpy" in record:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            kind, keys, pos, has_gauss, cached = record["numpy"]
            try:
                numpy_state = (kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
                np.random.RandomState().set_state(numpy_state)
            except (ValueError, TypeError, OverflowError) as error:
                raise CheckpointError(f"{field}.numpy' is not a state of numpy.random ({error})") from None
    return {"torch": torch_states, "random": python_state, "numpy": numpy_state}


def load_checkpoint(access: "CheckpointAccess", ckpt_dir: str) -> None:
    """[Note: sharded checkpoints] Every rank verifies its share of the files, then reads
    the elements it keeps from whichever files hold them."""
    access.check_allowed(saving=False)
    ranks = Ranks(access, "load_checkpoint")
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))

    def verify() -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]], Dict[str, Any]]:
        refuse_missing(ckpt_dir, "load_checkpoint")  # [Note: atomic checkpoint directory]
        manifest = read_manifest(ckpt_dir, share=(ranks.rank, ranks.world_size))
        return manifest, _match_model(access, manifest, ckpt_dir), _read_rng(manifest, ckpt_dir, ranks.rank)
    # 1. every file and field checked before any state changes: after this, only an I/O
    # error can stop the load
    checked, error = attempt(verify)
    ranks.agree("verification", error)
    manifest, saved, rng = checked
    if manifest["world_size"] != ranks.world_size:
        warn_at_caller(f"load_checkpoint: the checkpoint was written by {manifest['world_size']} "
                       f"rank(s), this run has {ranks.world_size}: the states are re-partitioned; "
                       "random number generators continue from those of the nearest saved rank")
    unfinished = (f"load_checkpoint({ckpt_dir!r}) did not finish, so the engine holds a mix of states; "
                  "load a checkpoint again before training")
    pending = {u["name"]: u.get("delayed_pending", False) for u in manifest["units"]}
    if any(pending.values()) and not access.config.delayed_update:
        warn_at_caller("load_checkpoint: the checkpoint was saved with delayed updates pending "
                       "(delayed_update=True), this engine runs exact steps: it goes on from the updated "
                       "weights, not bit-identically")
    access.begin_state_load(unfinished)

    def load_states() -> None:
        reader = PieceReader(ckpt_dir, manifest["files"])
        access.release_buffers()  # [Note: bounded checkpoint memory] the buffers it holds are this load's
        try:
            for u in access.units:               # 2. unit by unit into the tiers
                read = _unit_reader(u, saved, reader)
                steps = [step_from_json(saved[e.fqn]["step"], saved[e.fqn].get("optimizer_scalars"))
                         for e in u.trainable]
                if access.compact:  # [Note: compact optimizer states] the saved bytes, as they are
                    access.write_compact_unit_state(u, _compact_reader(u, saved, reader), read, steps)
                    continue
                access.write_unit_state(u, read, steps)
                if pending.get(u.name) and access.config.delayed_update:  # [Note: delayed updates]
                    access.restore_lagging(u, lambda lo, hi, out, read=read: read("lagging", lo, hi, out))
        finally:
            reader.close()
            access.release_buffers()
        _load_rest(access, manifest, ckpt_dir, rng)
    error = attempt(load_states)[1]
    if isinstance(error, OSError):
        error = OSError(error.errno, f"load_checkpoint({ckpt_dir!r}) failed while writing the states "
                        f"into their tiers: {error}; {unfinished}")
    ranks.agree("loading", error)
    access.finish_state_load()


def _unit_reader(u: "UnitState", saved: Dict[str, Dict[str, Any]],
                 reader: PieceReader) -> Callable[[str, int, int, torch.Tensor], None]:
    """``read(section, lo, hi, out)`` for CheckpointAccess.write_unit_state: elements [lo, hi) of u's
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


def _compact_reader(u: "UnitState", saved: Dict[str, Dict[str, Any]],
                    reader: PieceReader) -> Callable[[int, str, int, int, torch.Tensor], None]:
    """``read_compact(k, section, lo, hi, out)`` for CheckpointAccess.write_compact_unit_state:
    elements [lo, hi) (``lo`` on a block) of u's trainable parameter k's saved ``section``
    into ``out``, from the pieces that hold them (each starts on a block: format.py checks
    it); a per-block section's part is the scales of the blocks holding them."""
    def read_compact(k: int, section: str, lo: int, hi: int, out: torch.Tensor) -> None:
        dtype, per_block = COMPACT_SECTIONS[section]
        for piece in saved[u.trainable[k].fqn]["pieces"]:
            start = piece["start"]
            a, b = max(start, lo), min(start + piece["numel"], hi)
            if a >= b:
                continue
            first, at, n = (a - start, a - lo, b - a) if not per_block else \
                ((a - start) // BLOCK_NUMEL, (a - lo) // BLOCK_NUMEL, num_blocks(b - a))
            reader.read(piece["file"], piece[section] + first * dtype.itemsize, out[at:at + n])
    return read_compact


def _load_rest(access: "CheckpointAccess", manifest: Dict[str, Any], ckpt_dir: str, rng: Dict[str, Any]) -> None:
    """Buffers, param-group values, counters and the RNG states ``_read_rng`` checked."""
    files = manifest["files"]
    _, buffers = state_dict_aliases(access.module)
    if manifest["buffers"]:
        with open(checked_path(ckpt_dir, "buffers.bin"), "rb") as f:
            for record in manifest["buffers"]:
                b = buffers[record["name"]]
                value = torch.empty(record["shape"], dtype=DTYPES[record["dtype"]])
                read_range(f, "buffers.bin", files["buffers.bin"]["bytes"], record["offset"], value)
                with torch.no_grad():
                    b.copy_(value)
    for group, values in zip(access.optimizer.param_groups, manifest["param_groups"]):
        for key, value in values.items():
            if isinstance(group.get(key), torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = tuple(value) if isinstance(value, list) else value
    access.restore_training_counters(manifest["engine"], manifest["config"].get("dtype"))
    for device, state in rng["torch"]:
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)
    random.setstate(rng["random"])
    if rng["numpy"] is not None:
        import numpy as np
        np.random.set_state(rng["numpy"])
