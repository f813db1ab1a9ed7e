"""The optimizer's state in torch's layout, read from an engine checkpoint: what
``trainer.optimizer.state_dict()`` returns and what OffloadTrainer writes as ``optimizer.pt``.

[Note: optimizer.pt beside the engine's checkpoint] OffloadTrainer resumes from
``checkpoint-N/offload/`` (the engine's checkpoint: every state, bit for bit). Trainer's own
tools look for ``optimizer.pt`` instead: ``Trainer._load_optimizer_and_scheduler`` loads the
optimizer *and the scheduler* only when ``optimizer.pt`` (or ``optimizer.bin``, or a folder
named like ``optimizer*``) is there, and otherwise skips both without a word, as for a
DeepSpeed checkpoint. So a plain ``Trainer`` resuming from a checkpoint without it would
restart AdamW's moments and the learning-rate schedule. OffloadTrainer therefore also
writes ``optimizer.pt`` (``torch.optim.AdamW.state_dict()``'s layout, read from the engine
checkpoint just saved, not from a second save) where the layout exists and is small:

1. one process (with several ranks each holds a shard of the moments);
2. an Adam/AdamW with exact states (another optimizer's state is laid out by the engine's
   rules, compact states in 8-bit blocks, neither in torch's layout);
3. moments of at most OPTIMIZER_PT_MAX_BYTES, and no more than 3/4 of the memory
   available now (they are read into memory whole).

Otherwise the checkpoint has no ``optimizer.pt``: Trainer's resume accepts its absence (it
loads the weights and restarts optimizer and scheduler); OffloadTrainer never reads it.
``trainer.optimizer.state_dict()`` refuses with a ValueError that names the reason (1-3,
without OPTIMIZER_PT_MAX_BYTES, which bounds checkpoint files only) and
``trainer.engine.save_checkpoint(DIR)`` as the way to the state.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, Optional

import torch

import offload
from offload.checkpoint.format import PieceReader, read_manifest

__all__ = ["OPTIMIZER_PT_MAX_BYTES", "ADAM_CLASSES", "torch_layout_problem", "adam_state_dict",
           "adam_state_from_checkpoint", "write_optimizer_pt"]

OPTIMIZER_PT_MAX_BYTES = 1 << 30
"""OffloadTrainer writes ``optimizer.pt`` into ``checkpoint-N/`` only for Adam moments up to
this size (1 GiB: about 134M trainable parameters); larger ones stay in the engine's
checkpoint alone ([Note: optimizer.pt beside the engine's checkpoint])."""

ADAM_CLASSES = (torch.optim.Adam, offload.CPUAdam)  # torch.optim.AdamW is an Adam
"""Optimizers the engine runs with its CPU Adam, and whose state has torch's Adam layout."""

OPTIMIZER_PT = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME


def torch_layout_problem(adam: torch.optim.Optimizer, engine: "offload.Engine") -> Optional[str]:
    """Why the optimizer's state cannot be had in torch's layout now ([Note: optimizer.pt
    beside the engine's checkpoint] 1-3, without the file bound); None when it can."""
    from offload.memory.layout import DEFAULT_HOST_FRACTION, available_memory_bytes

    world_size = engine.stats()["world_size"]
    if world_size > 1:
        return (f"not with several ranks (this run has {world_size}): each rank holds a shard of the moments; "
                "save them on every rank with trainer.engine.save_checkpoint(DIR), DIR one path on a file system "
                "the ranks share (the Trainer's checkpoints do)")
    if engine.config.optimizer_states == "compact":
        return ("the engine keeps compact optimizer states (optimizer_states='compact'), which torch's AdamW "
                "layout cannot hold (8-bit moments in blocks); save them with trainer.engine.save_checkpoint(DIR) "
                "(the Trainer's checkpoints do)")
    if not isinstance(adam, ADAM_CLASSES):
        return (f"the state of {type(adam).__name__} lives in the engine's tiers and is read in torch's layout "
                "for Adam/AdamW only; save it with trainer.engine.save_checkpoint(DIR) (the Trainer's "
                "checkpoints do)")
    params = [p for group in adam.param_groups for p in group["params"]]
    moments_bytes = _moments_bytes(adam)
    available = available_memory_bytes()
    if available is not None and moments_bytes > DEFAULT_HOST_FRACTION * available:
        return (f"the Adam moments of {len(params)} parameters take {moments_bytes} bytes, more than "
                f"{DEFAULT_HOST_FRACTION:g} of the memory available now ({available} bytes). Save them with "
                "trainer.engine.save_checkpoint(DIR) (the Trainer's checkpoints do) and read each parameter's "
                "exp_avg / exp_avg_sq pieces as DIR/manifest.json lists them")
    return None


def adam_state_dict(adam: torch.optim.Optimizer, engine: "offload.Engine") -> Dict[str, Any]:
    """``torch.optim.AdamW.state_dict()`` of the engine's optimizer, read through a temporary
    ``engine.save_checkpoint`` (in swap_dir when there is one, else the system's temporary
    directory; 12 B per trainable parameter on disk while this runs; removed after). Like a
    checkpoint save, it finishes a step the engine deferred first. A ValueError naming the
    way to the state, before anything is written, where torch_layout_problem says one."""
    problem = torch_layout_problem(adam, engine)
    if problem is not None:
        raise ValueError(f"optimizer.state_dict(): {problem}")
    with tempfile.TemporaryDirectory(prefix=".offload-optimizer-state-", dir=engine.config.swap_dir) as tmp:
        checkpoint_dir = os.path.join(tmp, "checkpoint")
        engine.save_checkpoint(checkpoint_dir)
        return adam_state_from_checkpoint(adam, engine.module, checkpoint_dir)


def adam_state_from_checkpoint(adam: torch.optim.Optimizer, module: torch.nn.Module,
                               checkpoint_dir: str) -> Dict[str, Any]:
    """[Note: the optimizer's state as torch lays it out] ``torch.optim.AdamW.state_dict()``'s
    layout, from the engine checkpoint in ``checkpoint_dir`` (saved by the engine that runs
    ``adam`` on ``module``'s parameters): ``param_groups`` as the AdamW's own (the learning
    rates the scheduler set), ``state[i]`` = ``step``, ``exp_avg``, ``exp_avg_sq`` of the i-th
    parameter of the groups, for the parameters the engine has updated (as AdamW, none for one
    that never had a gradient). The moments are read piece by piece into the tensors returned."""
    layout = adam.state_dict()  # param_groups, and the indices torch gives the parameters
    params = [p for group in adam.param_groups for p in group["params"]]
    name_of = {p: name for name, p in module.named_parameters()}
    manifest = read_manifest(checkpoint_dir)
    record_of = {name: r for u in manifest["units"] for r in u["entries"] if r["trainable"] for name in r["names"]}
    reader = PieceReader(checkpoint_dir, manifest["files"])
    try:
        for index, param in enumerate(params):
            record = record_of[name_of[param]]
            if not record["step"]:
                continue  # never updated: AdamW has no state for it either
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                value = torch.empty(record["numel"], dtype=torch.float32)
                reader.read_param(record, key, 0, record["numel"], value)
                moments[key] = value.view(record["shape"])
            layout["state"][index] = {"step": torch.tensor(float(record["step"]), dtype=torch.float32), **moments}
    finally:
        reader.close()
    return layout


def write_optimizer_pt(adam: torch.optim.Optimizer, engine: "offload.Engine", checkpoint_dir: str,
                       engine_checkpoint_dir: str) -> bool:
    """[Note: optimizer.pt beside the engine's checkpoint]: ``checkpoint_dir/optimizer.pt``
    from the engine checkpoint in ``engine_checkpoint_dir`` where 1-3 hold; True when written.
    Not fsynced here: the marker of [Note: complete Trainer checkpoints] fsyncs every file."""
    if _moments_bytes(adam) > OPTIMIZER_PT_MAX_BYTES or torch_layout_problem(adam, engine) is not None:
        return False
    state = adam_state_from_checkpoint(adam, engine.module, engine_checkpoint_dir)
    torch.save(state, os.path.join(checkpoint_dir, OPTIMIZER_PT))
    return True


def _moments_bytes(adam: torch.optim.Optimizer) -> int:
    """Bytes of Adam's two fp32 moments over every parameter of the optimizer."""
    return 2 * 4 * sum(p.numel() for group in adam.param_groups for p in group["params"])
