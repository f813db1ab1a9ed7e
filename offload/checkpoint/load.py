"""Loading a checkpoint: every file and the model's match are checked before any state
changes, then the states stream into their tiers unit by unit ([Note: sharded checkpoints],
[Note: bounded checkpoint memory])."""
from __future__ import annotations

import os
import random
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Tuple

import torch

from offload.checkpoint.access import Ranks, attempt
from offload.checkpoint.directory import refuse_missing
from offload.checkpoint.format import (
    DTYPES, PieceReader, checked_path, numel_of, read_manifest, read_range, state_dict_aliases)
from offload.errors import CheckpointError

if TYPE_CHECKING:
    from offload.checkpoint.access import CheckpointAccess
    from offload.memory.layout import UnitState


def _match_model(access: "CheckpointAccess", manifest: Dict[str, Any], ckpt_dir: str) -> Dict[str, Dict[str, Any]]:
    """Checkpoint entry for each engine parameter, or a CheckpointError naming the parameter."""
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
    groups = manifest["param_groups"]
    if len(groups) != len(access.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {len(groups)} optimizer param groups in the "
                              f"checkpoint, {len(access.optimizer.param_groups)} in the optimizer")
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
            warnings.warn(f"load_checkpoint: the checkpoint was written with {key}="
                          f"{manifest['config'].get(key)!r}, this engine uses "
                          f"{getattr(access.config, key)!r}; the run will not continue bit-identically",
                          RuntimeWarning, stacklevel=4)
    return saved


def load_checkpoint(access: "CheckpointAccess", ckpt_dir: str) -> None:
    """[Note: sharded checkpoints] Every rank verifies its share of the files, then reads
    the elements it keeps from whichever files hold them."""
    access.check_allowed(saving=False)
    ranks = Ranks(access, "load_checkpoint")
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))

    def verify() -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
        refuse_missing(ckpt_dir, "load_checkpoint")  # [Note: atomic checkpoint directory]
        manifest = read_manifest(ckpt_dir, share=(ranks.rank, ranks.world_size))
        return manifest, _match_model(access, manifest, ckpt_dir)
    checked, error = attempt(verify)     # 1. every file checked before any state changes
    ranks.agree("verification", error)
    manifest, saved = checked
    if manifest["world_size"] != ranks.world_size:
        warnings.warn(f"load_checkpoint: the checkpoint was written by {manifest['world_size']} "
                      f"rank(s), this run has {ranks.world_size}: the states are re-partitioned; "
                      "random number generators continue from those of the nearest saved rank",
                      RuntimeWarning, stacklevel=3)
    unfinished = (f"load_checkpoint({ckpt_dir!r}) did not finish, so the engine holds a mix of states; "
                  "load a checkpoint again before training")
    access.begin_state_load(unfinished)

    def load_states() -> None:
        reader = PieceReader(ckpt_dir, manifest["files"])
        try:
            for u in access.units:               # 2. unit by unit into the tiers
                access.write_unit_state(u, _unit_reader(u, saved, reader),
                                        [saved[e.fqn]["step"] for e in u.trainable])
        finally:
            reader.close()
        _load_rest(access, manifest, ckpt_dir, ranks.rank)
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


def _load_rest(access: "CheckpointAccess", manifest: Dict[str, Any], ckpt_dir: str, rank: int) -> None:
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
    access.restore_training_counters(manifest["engine"])
    saved_ranks = manifest["rng"]["ranks"]
    rng = saved_ranks[min(rank, len(saved_ranks) - 1)]
    for device, file_name in rng["torch"].items():
        state = torch.empty(files[file_name]["bytes"], dtype=torch.uint8)
        with open(checked_path(ckpt_dir, file_name), "rb") as f:
            read_range(f, file_name, files[file_name]["bytes"], 0, state)
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
