"""Named fault points: the places where a run can be made to fail on purpose.

The engine calls ``hit(NAME, ...)`` at each place listed in ``POINTS`` (and ``passing(NAME,
value)`` where a test may substitute a value, such as the NVMe tier's I/O engine). Nothing
happens unless a test has armed that point with ``inject``::

    with offload.faults.inject("optim.adam", raising(KeyboardInterrupt), at=5) as point:
        engine.backward(loss)          # the 5th Adam kernel call raises
    assert point.hits >= 5

This is the seam through which tests reach failures inside the engine, instead of
monkeypatching private methods; the crash-point harness of ``save_checkpoint`` and the fault
matrix of a step enumerate ``POINTS`` to reach every one. It is for tests and tools, not a
stable API. An unarmed point costs one dict lookup.

A point's action runs on whichever thread reaches the point (the optimizer worker for Adam
during backward, the copy worker for its copies): an exception it raises travels the way an
error of that code would.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

__all__ = ["POINTS", "Armed", "hit", "passing", "inject", "raising", "points"]

# Every fault point, with where it is. A point's name starts with the package it is in.
POINTS: Dict[str, str] = {
    "wrap.done": "the last step of wrap(), after the hooks are installed",
    "optim.adam_range": "UnitAdam.adam_range: Adam over one range (a unit, a piece or a shard) "
                        "of a unit's trainable elements, before any element is touched",
    "optim.adam": "each call of the Adam kernel over one parameter's elements of a range",
    "nvme.io_engine": "passing: the I/O engine the NVMe tier has just started (a test may wrap it)",
    "memory.fetch": "DeviceResidency.finish_fetch: a unit's compute copy has landed on the device, "
                    "before it is bound (raising there is a failed fetch)",
    "memory.release": "DeviceResidency.release: a unit's device copy is about to be dropped",
    "hooks.forward": "Hooks._unit_pre_forward: a unit's forward is about to run (main thread)",
    "hooks.backward": "Hooks._pre_backward: a unit's backward is about to run (main thread)",
    "optim.grad_ready": "Gradients.on_grad_ready: autograd hands over a parameter's gradient, "
                        "before it is taken (main thread)",
    "optim.early_update": "UpdateScheduler: a unit's early update starts on the optimizer worker, "
                          "during backward ([Note: early updates])",
    "optim.deferred_update": "UpdateScheduler: a unit's deferred update starts on the optimizer "
                             "worker, after step() returned ([Note: deferred updates]), or "
                             "DelayedUpdates: a unit's delayed one ([Note: delayed updates])",
    "optim.write_back": "PipelinedStep: a piece's updated states are about to be written back to "
                        "NVMe (step, early or deferred update)",
    # The durable steps of save_checkpoint, in the order a save reaches them ([Note: atomic
    # checkpoint directory] in offload/checkpoint/directory.py). Each is hit just before the
    # system call, with the path it acts on; an OSError raised here is that call failing.
    "checkpoint.save.restore": "a save: renaming back to NAME a complete copy that a killed save "
                               "left beside a missing NAME (before anything else is written)",
    "checkpoint.save.remove_stale": "a save: removing each leftover of a dead process's save once "
                                    "no complete copy depends on it",
    "checkpoint.save.mkdir": "creating the partial directory .NAME.partial-PID-HEX beside NAME",
    "checkpoint.save.create": "creating each file of the checkpoint (units, buffers, RNG states, manifest)",
    "checkpoint.save.write": "each write of bytes into a checkpoint file",
    "checkpoint.save.fsync": "the fsync of each checkpoint file after its last write",
    "checkpoint.save.dir_fsync": "the fsync of the partial directory once every file, manifest last, is in it",
    "checkpoint.save.exchange": "renameat2(RENAME_EXCHANGE) of the partial directory and the NAME it "
                                "replaces (an OSError with EINVAL or ENOSYS here takes the fallback)",
    "checkpoint.save.rename_aside": "fallback: renaming the NAME being replaced to .NAME.old-PID-HEX",
    "checkpoint.save.rename": "renaming the partial directory to NAME (a first save, or the fallback's "
                              "second rename)",
    "checkpoint.save.parent_fsync": "the fsync of NAME's parent directory after a rename, exchange or restore",
    "checkpoint.save.remove_old": "removing the checkpoint that NAME held before",
    # The durable steps of save_pretrained and offload export into a model directory DIR
    # ([Note: atomic model directory] in offload/checkpoint/export.py), in the order a save
    # reaches them; each is hit just before the system call, with the path it acts on.
    "checkpoint.pretrained.mkdir": "creating DIR where it is missing, and the staging directory "
                                   "DIR/.offload-save-PID-HEX",
    "checkpoint.pretrained.remove_stale": "removing a staging directory that a save of an exited process left in DIR",
    "checkpoint.pretrained.create": "creating each weights file (a shard, the index) in the staging directory",
    "checkpoint.pretrained.write": "each write into a weights file in the staging directory",
    "checkpoint.pretrained.fsync": "the fsync of each staged file (weights and config files)",
    "checkpoint.pretrained.move": "renaming each staged file into DIR: shards and config files, then "
                                  "model.safetensors or the index",
    "checkpoint.pretrained.dir_fsync": "the fsync of DIR after the files are moved in, after the switch, "
                                       "and after the earlier save's files are removed",
    "checkpoint.pretrained.switch": "a sharded save removing the earlier save's model.safetensors, "
                                    "after which readers take the new index",
    "checkpoint.pretrained.remove_old": "removing each file of the earlier save once the new one is in "
                                        "place, then the empty staging directory",
}

_armed: Dict[str, "Armed"] = {}
_lock = threading.Lock()


class Armed:
    """An armed point: ``action(**context)`` runs at hit number ``at`` (every hit when
    ``at`` is None). ``hits`` counts the hits while armed, ``fired`` the actions run."""

    def __init__(self, name: str, action: Callable[..., Any], at: Optional[int]) -> None:
        self.name, self.action, self.at = name, action, at
        self.hits = 0
        self.fired = 0

    def _due(self) -> bool:
        with _lock:
            self.hits += 1
            due = self.at is None or self.hits == self.at
            self.fired += due
            return due


def hit(name: str, **context: Any) -> None:
    """The engine reached point ``name``; run its action if it is armed and due."""
    armed = _armed.get(name)
    if armed is not None and armed._due():
        armed.action(**context)


def passing(name: str, value: Any) -> Any:
    """``value`` as it passes point ``name``: the armed action's result when it is armed and
    due (the action is called with ``value``), else ``value`` itself."""
    armed = _armed.get(name)
    if armed is not None and armed._due():
        return armed.action(value)
    return value


@contextmanager
def inject(name: str, action: Callable[..., Any], at: Optional[int] = None) -> Iterator[Armed]:
    """Arm point ``name`` (a key of POINTS) with ``action`` inside the ``with`` block.
    ``at``: the hit (1 = the first) whose action runs; None: every hit. A ValueError for a
    name that is not a point or a point already armed."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; the points are {sorted(POINTS)}")
    if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 1):
        raise ValueError(f"at must be a positive int or None, got {at!r}")
    armed = Armed(name, action, at)
    with _lock:
        if name in _armed:
            raise ValueError(f"fault point {name!r} is already armed")
        _armed[name] = armed
    try:
        yield armed
    finally:
        with _lock:
            del _armed[name]


def raising(error: "BaseException | type") -> Callable[..., None]:
    """An action that raises ``error`` (an exception instance or class)."""
    def action(*args: Any, **context: Any) -> None:
        raise error
    return action


def points(prefix: str = "") -> list:
    """The names of the points that start with ``prefix``, sorted."""
    return sorted(n for n in POINTS if n.startswith(prefix))
