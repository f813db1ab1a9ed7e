"""CheckpointAccess: the one way from checkpoint code into an engine's states.

[Note: checkpoint access] Save and load deal in values and files: the values of the
elements of a unit (ranges of its trainable prefix or of its frozen tail) and the scalar
counters. How the homes hold them (merged or split master, host copies of failed swap
writes, [zero] shards and chunks) is known here, and only here in offload/checkpoint/.
The engine builds one CheckpointAccess at the end of wrap and hands over what it needs
explicitly: the units, the layout, the partition, the device tier, its readers and
writers of homes (HomeIO) and the state it owns (EngineState: counters and failure
state, as callables). Nothing here reads an attribute of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.errors import CheckpointError, EngineFailedError

if TYPE_CHECKING:
    from offload.config import OffloadConfig
    from offload.memory.layout import Layout, UnitState
    from offload.tiers import DeviceTier
    from offload.zero import Partition


@dataclass(frozen=True)
class HomeIO:
    """The engine's synchronous readers and writers of unit homes (the seam between the
    checkpoint code and wherever homes are kept; today bound methods of offload/memory/
    homes.py's Homes, and the engine's release)."""

    read_master: Callable[["UnitState"], torch.Tensor]
    """u's fp32 master as its home holds it: this rank's shard at stage >= 1; merged, the
    compute copy's prefix; split ([Note: split master]), joined from its two halves."""
    load: Callable[[Any, int, torch.dtype], torch.Tensor]
    """``load(home, numel, dtype)``: a new host tensor with a home's first ``numel`` elements."""
    store: Callable[[Any, torch.Tensor], None]
    """``store(home, src)``: overwrite a whole home with ``src``."""
    store_compute: Callable[["UnitState", torch.Tensor], None]
    """``store_compute(u, compute)``: overwrite u's whole compute copy at home (and the frozen
    tail of its spare one, [Note: speculative updates])."""
    store_master: Callable[["UnitState", torch.Tensor, int, Optional[torch.Tensor]], None]
    """``store_master(u, master, start, low)``: write the master's home from ``master`` (fp32,
    u's trainable elements from ``start``); ``low``: split_master_into's result, or None."""
    split_master_into: Callable[["UnitState", torch.Tensor, torch.Tensor, int], torch.Tensor]
    """``split_master_into(u, master, high, start)``: [Note: split master] round ``master``
    into the bf16 ``high`` and return the low halves of this rank's shard as the home holds them."""
    release: Callable[["UnitState"], None]
    """Drop u's device copy (about to be stale)."""


@dataclass(frozen=True)
class EngineState:
    """The engine's own state that a checkpoint reads or replaces. The engine keeps the
    fields; these callables read and set them."""

    closed: Callable[[], bool]
    failure: Callable[[], Optional[Dict[str, Any]]]
    """None, or why the engine refuses to train: {"fatal": bool, "message": str}
    ([Note: swap I/O failures])."""
    set_failure: Callable[[Optional[Dict[str, Any]]], None]
    dirty: Callable[[int], Dict[str, torch.Tensor]]
    """The states of the unit with this index whose swap write failed, held in host RAM
    and current ([Note: swap I/O failures]): "master" and/or "moments"; {} when none."""
    forget_dirty: Callable[[], None]
    """Drop every host copy of a failed swap write (they are stale after a load)."""
    counters: Callable[[], Dict[str, Any]]
    """The scalar training state as a checkpoint keeps it: micro_step, loss_scale,
    good_steps (fp16 steps since the loss scale last changed), last_grad_norm."""
    restore_counters: Callable[[Dict[str, Any]], None]
    """Set the counters that ``counters()`` returned."""


class CheckpointAccess:
    """[Note: checkpoint access] What save and load see of one engine."""

    def __init__(self, units: List["UnitState"], layout: "Layout", partition: Optional["Partition"],
                 device: "DeviceTier", module: nn.Module, optimizer: torch.optim.Optimizer,
                 config: "OffloadConfig", homes: HomeIO, state: EngineState) -> None:
        self.units = units
        self.module = module
        self.optimizer = optimizer
        self.config = config  # of the run: recorded in the manifest, compared on load
        self.compute_dtype = layout.compute_dtype
        self._layout = layout
        self._partition = partition
        self._device = device
        self._homes = homes
        self._state = state

    def check_allowed(self, saving: bool) -> None:
        """Raise unless a checkpoint can be saved (``saving``) or loaded now: RuntimeError
        when the engine is closed; a save also refuses after a fatal failure
        (EngineFailedError) and while gradients of un-stepped micro-batches are pending
        (ValueError)."""
        what = "save_checkpoint" if saving else "load_checkpoint"
        if self._state.closed():
            raise RuntimeError(f"{what}: engine is closed")
        if not saving:
            return
        failure = self._state.failure()
        if failure is not None and failure["fatal"]:
            raise EngineFailedError(f"save_checkpoint: {failure['message']}")
        micro_step = self._state.counters()["micro_step"]
        pending = micro_step % self._layout.accumulation_steps
        if pending or any(any(u.has_grad) for u in self.units):
            raise ValueError(
                f"save_checkpoint: gradients of {pending or 'un-stepped'} micro-batch(es) are "
                f"pending (micro-step {micro_step}, gradient_accumulation_steps="
                f"{self._layout.accumulation_steps}); save right after the engine.step() call that "
                "updates the parameters (an accumulation boundary)")

    def world(self) -> Tuple[int, int, int]:
        """(rank, world_size, ZeRO stage) of this process: (0, 1, 0) on a single process."""
        p = self._partition
        return (0, 1, 0) if p is None else (p.rank, p.world_size, p.stage)

    def gather_from_ranks(self, what: str, value: Any) -> List[Any]:
        """Every rank's ``value``, in rank order ([value] on a single process). A collective:
        every rank calls it; ``what`` names it in the error when a rank does not."""
        if self._partition is None:
            return [value]
        return self._partition.all_gather_object(what, value)

    def ranges(self, u: "UnitState") -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """[Note: sharded checkpoints] The elements of u this rank writes: ``[lo, hi)`` of the
        trainable prefix (master and moments) and ``[lo, hi)`` of the frozen tail (counted from
        the tail's start)."""
        rank, world_size, stage = self.world()
        frozen_numel = u.spec.total_numel - u.spec.frozen_start
        whole = ((0, u.spec.trainable_numel), (0, frozen_numel))
        if world_size == 1:
            return whole
        nothing = ((0, 0), (0, 0))
        if stage == 0:  # every rank holds everything: rank 0 writes it
            return whole if rank == 0 else nothing
        trainable = (u.shard.lo, u.shard.hi)
        if u.param_shard is not None:
            f = u.param_shard.frozen
            return trainable, (f.lo, f.hi)
        return trainable, whole[1] if rank == 0 else (0, 0)

    def read_trainable_state(self, u: "UnitState", lo: int,
                             hi: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 master, exp_avg and exp_avg_sq of elements [lo, hi) of u's trainable prefix,
        which this rank keeps (its shard, or everything), from wherever they are current."""
        s = u.shard  # whole on one process and at stage 0; the home buffers start at element s.lo
        # [Note: swap I/O failures] after a failed write the host copy is current (the staged
        # step that keeps one runs only where the shard is whole)
        dirty = self._state.dirty(u.index)
        master = dirty["master"] if "master" in dirty else self._homes.read_master(u)
        # merged at stages 0-2: the whole compute copy's prefix; stage 3: the rank's chunk
        base = 0 if self._layout.merged and u.param_shard is None else s.lo
        moments = dirty["moments"] if "moments" in dirty else \
            self._homes.load(u.moments_home, 2 * s.state_numel, torch.float32)
        return (master[lo - base:hi - base], moments[lo - s.lo:hi - s.lo],
                moments[s.state_numel + lo - s.lo:s.state_numel + hi - s.lo])

    def read_lagging(self, u: "UnitState", lo: int, hi: int) -> Optional[torch.Tensor]:
        """[Note: delayed updates] fp32 values of elements [lo, hi) of u's trainable prefix in
        the compute copy the forward reads, one update behind the state a save writes; None
        when u has no delayed update pending. During a save the engine shows each unit's true
        state as its homes (DelayedUpdates.committed_view), so that copy sits in the spare homes."""
        if not u.delayed_pending:
            return None
        compute = self._homes.load(u.spare.compute_home, u.compute_numel, self._layout.home_dtype)
        return compute[lo:hi].to(torch.float32)

    def read_frozen_values(self, u: "UnitState", lo: int, hi: int) -> torch.Tensor:
        """Compute-copy values of elements [lo, hi) of u's frozen tail, which this rank keeps."""
        p = u.param_shard
        home_dtype = self._layout.home_dtype
        if p is not None:  # [zero] stage 3: the rank's chunks, the frozen one second
            home = self._homes.load(u.compute_home, p.home_numel, home_dtype)
            return home[p.trainable_chunk_numel + lo - p.frozen.lo:p.trainable_chunk_numel + hi - p.frozen.lo]
        start = u.spec.frozen_start
        if self._layout.param_tier == "device":
            compute = self._device.view(u.device_offset, u.compute_numel).to("cpu", copy=True)
        else:
            compute = self._homes.load(u.compute_home, u.compute_numel, home_dtype)
        return compute[start + lo:start + hi]

    @torch.no_grad()
    def write_unit_state(self, u: "UnitState", read: Callable[[str, int, int, torch.Tensor], None],
                         steps: List[int]) -> None:
        """Replace the state of u this rank keeps by a checkpoint's values, and drop u's
        gradients. ``read(section, lo, hi, out)`` fills ``out`` with elements [lo, hi) of the
        trainable prefix ("master", "exp_avg", "exp_avg_sq") or of the frozen tail ("value",
        counted from the tail's start); ``steps``: Adam's step count of each trainable
        parameter. Trainable compute values are derived from the master (rounded as the Adam
        kernel rounds it). Holds one unit's master, moments and compute copy at a time."""
        s = u.shard
        p = u.param_shard
        t = u.spec.trainable_numel
        lo, hi = (s.lo, s.hi) if p is not None else (0, t)  # master elements the compute copy needs
        master = torch.zeros(hi - lo, dtype=torch.float32)
        moments = torch.zeros(2 * s.state_numel, dtype=torch.float32)
        read("master", lo, hi, master)
        read("exp_avg", s.lo, s.hi, moments[:s.numel])
        read("exp_avg_sq", s.lo, s.hi, moments[s.state_numel:s.state_numel + s.numel])
        home_dtype = self._layout.home_dtype
        low = None
        if p is None:
            compute = torch.zeros(u.compute_numel, dtype=self.compute_dtype)
            if self._layout.split_master and u.trainable:  # [Note: split master]
                low = self._homes.split_master_into(u, master, compute[:t], 0)
            else:
                compute[:t].copy_(master)
            frozen_start = u.spec.frozen_start
            read("value", 0, u.spec.total_numel - frozen_start, compute[frozen_start:u.spec.total_numel])
        else:  # [zero] stage 3: the rank's chunks
            compute = torch.zeros(p.home_numel, dtype=home_dtype)
            if self._layout.split_master and u.trainable:  # [Note: split master]
                low = self._homes.split_master_into(u, master, compute[:s.numel], s.lo)
            else:
                compute[:s.numel].copy_(master)
            f = p.frozen
            read("value", f.lo, f.hi, compute[p.trainable_chunk_numel:p.trainable_chunk_numel + f.numel])
        if self._layout.param_tier == "device":
            self._device.view(u.device_offset, u.compute_numel).copy_(compute)
        else:
            self._homes.release(u)  # a device copy of this unit is stale from now on
            self._homes.store_compute(u, compute)  # merged: fp32, the master itself
        if u.trainable:
            self._homes.store_master(u, master, lo, low)
            self._homes.store(u.moments_home, moments)
        u.steps = list(steps)
        u.has_grad = [False] * len(u.trainable)
        u.delayed_pending = False  # [Note: delayed updates] unless restore_lagging says otherwise

    @torch.no_grad()
    def restore_lagging(self, u: "UnitState", lagging: torch.Tensor) -> bool:
        """[Note: delayed updates] u's state (just written by write_unit_state) is the result
        of a delayed update that was pending when the checkpoint was saved: it goes into the
        spare homes, and ``lagging`` (fp32, the trainable prefix of the compute copy the
        forward read then) into the homes' compute copy, as the engine held them. False (and
        nothing changes: the run goes on from the updated weights) without delayed_update."""
        if not self._layout.delayed_update or u.spare is None:
            return False
        u.commit_spare()  # the homes written just now become the spare ones
        home_dtype = self._layout.home_dtype
        compute = self._homes.load(u.compute_home, u.compute_numel, home_dtype)  # its frozen tail is current
        compute[:u.spec.trainable_numel].copy_(lagging)
        self._homes.store(u.compute_home, compute)
        u.delayed_pending = True
        return True

    def training_counters(self) -> Dict[str, Any]:
        """The engine's scalar training state, as a checkpoint keeps it (EngineState.counters)."""
        return self._state.counters()

    def restore_training_counters(self, counters: Dict[str, Any]) -> None:
        """Set the counters that ``training_counters()`` returned."""
        self._state.restore_counters(counters)

    def begin_state_load(self, message: str) -> None:
        """The states are about to be replaced: until ``finish_state_load()`` the engine may
        hold a mix of old and new ones, and refuses to train (EngineFailedError: ``message``)."""
        self._state.set_failure({"fatal": True, "message": message})

    def finish_state_load(self) -> None:
        """Every state was replaced: host copies of failed swap writes are stale now, and
        the engine trains again."""
        self._state.forget_dirty()
        self._state.set_failure(None)


class Ranks:
    """[Note: sharded checkpoints] The ranks' agreement on each phase of a save or load:
    every rank reports its error (or none); when one failed, all raise, naming it."""

    def __init__(self, access: CheckpointAccess, what: str) -> None:
        self.access = access
        self.rank, self.world_size, _ = access.world()
        self.what = what

    def gather(self, phase: str, value: Any) -> List[Any]:
        return self.access.gather_from_ranks(f"{self.what} ({phase})", value)

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


def attempt(call: Any) -> Tuple[Any, Optional[BaseException]]:
    """``(call(), None)``, or ``(None, error)`` when it raised."""
    try:
        return call(), None
    except Exception as error:  # reported to the other ranks, then raised (see Ranks)
        return None, error
