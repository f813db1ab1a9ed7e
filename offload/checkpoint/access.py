"""CheckpointAccess: the one way from checkpoint code into an engine's states.

[Note: checkpoint access] Save and load deal in values and files: the values of the
elements of a unit (ranges of its trainable prefix or of its frozen tail) and the scalar
counters. How the homes hold them (merged or split master, host copies of failed swap
writes, [zero] shards and chunks) is known here, and only here in offload/checkpoint/.
The engine builds one CheckpointAccess at the end of wrap and hands over what it needs
explicitly: the units, the layout, what the run is (RunRecord: model, optimizer, config),
the Homes (which read and write unit homes), the residency (which drops a device copy a
load makes stale), the FailureState, the update scheduler for the training counters and
the failed writes' host copies (a TrainingState), and the partition. Nothing here reads an
attribute of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn

from offload.errors import CheckpointError, EngineFailedError
from offload.memory.compact_codec import (COMPACT_ARRAYS, CompactHomeLayout, compact_piece_numel, compact_piece_regions,
                                          compact_range_parts, decode_master, encode_master)

# [Note: bounded checkpoint memory] The elements a save or load moves at once: 32 MiB of
# fp32, a whole number of pages in any dtype.
CHUNK_NUMEL = 8 << 20

if TYPE_CHECKING:
    from offload.config import OffloadConfig
    from offload.memory.homes import Homes
    from offload.memory.layout import Layout, UnitState
    from offload.memory.residency import DeviceResidency
    from offload.optim.failure import FailureState
    from offload.zero import Partition


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint records of the run beside the states, and what a load checks
    against: values fixed at wrap, no callables."""

    module: nn.Module
    """The model: its parameter names and buffers."""
    optimizer: Any
    """The optimizers' param groups as one sequence (optim.several.OptimizerSet)."""
    config: "OffloadConfig"
    """The config of the run: recorded in the manifest, compared on load."""
    optimizer_state: Optional[Dict[str, Any]] = None
    """An elementwise optimizer's state layout (what sections exp_avg and exp_avg_sq hold,
    [Note: elementwise optimizers]); None for Adam's."""


class TrainingState(Protocol):
    """What a checkpoint reads and replaces of the optimizer step's own state
    (optim.updates.UpdateScheduler)."""

    def training_counters(self) -> Dict[str, Any]:
        """The scalar training state as a checkpoint keeps it: micro_step, loss_scale,
        good_steps (fp16 steps since the loss scale last changed), last_grad_norm."""

    def restore_training_counters(self, counters: Dict[str, Any]) -> None:
        """Set the counters that ``training_counters()`` returned."""

    def held_states(self, u: "UnitState") -> Dict[str, torch.Tensor]:
        """The states of u whose swap write failed, held in host RAM and current ([Note:
        swap I/O failures]): "master" and/or "moments"; {} when none."""

    def forget_held_states(self) -> None:
        """Drop every host copy of a failed swap write (they are stale after a load)."""


class CheckpointAccess:
    """[Note: checkpoint access] What save and load see of one engine."""

    def __init__(self, units: List["UnitState"], layout: "Layout", run: RunRecord, *, homes: "Homes",
                 residency: "DeviceResidency", failures: "FailureState", training: TrainingState,
                 partition: Optional["Partition"]) -> None:
        """``homes``: the readers and writers of unit homes (ranged, whole, the master codec,
        reused buffers, [Note: compact optimizer states] the CompactStates port), and, with
        param_tier "device", the device slot that is a unit's home. ``residency``: drops a
        unit's device copy a write makes stale. ``failures``: whether the engine is closed
        or failed; a load marks it failed until it is done. ``training``: the counters and
        failed writes' host copies. ``partition``: [zero] the ranks, or None."""
        self.units = units
        self.module = run.module
        self.optimizer = run.optimizer
        self.optimizer_state = run.optimizer_state
        self.config = run.config  # of the run: recorded in the manifest, compared on load
        self.compute_dtype = layout.compute_dtype
        self._layout = layout
        self._partition = partition
        self._homes = homes
        self._residency = residency
        self._failures = failures
        self._training = training

    def check_allowed(self, saving: bool) -> None:
        """Raise unless a checkpoint can be saved (``saving``) or loaded now: RuntimeError
        when the engine is closed; a save also refuses after a fatal failure
        (EngineFailedError) and while gradients of un-stepped micro-batches are pending
        (ValueError)."""
        what = "save_checkpoint" if saving else "load_checkpoint"
        if self._failures.closed:
            raise RuntimeError(f"{what}: engine is closed")
        if not saving:
            return
        failure = self._failures.failure
        if failure is not None and failure["fatal"]:
            raise EngineFailedError(f"save_checkpoint: {failure['message']}")
        micro_step = self._training.training_counters()["micro_step"]
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
        if self._partition.replica_index > 0:  # [Note: sharding groups] the first group's copy
            return nothing
        trainable = (u.shard.lo, u.shard.hi)
        if u.param_shard is not None:
            f = u.param_shard.frozen
            return trainable, (f.lo, f.hi)
        return trainable, whole[1] if rank == 0 else (0, 0)

    def chunks(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """[Note: bounded checkpoint memory] [lo, hi) in ranges of at most CHUNK_NUMEL elements
        that start at multiples of it (counted from 0, so in a home whole pages of any dtype),
        the pieces save and load move."""
        starts = range(lo - lo % CHUNK_NUMEL, hi, CHUNK_NUMEL)
        return [(max(a, lo), min(a + CHUNK_NUMEL, hi)) for a in starts if max(a, lo) < min(a + CHUNK_NUMEL, hi)]

    def release_buffers(self) -> None:
        """Let go of the buffers the pieces were moved through (end of a save or load)."""
        self._homes.drop_buffers()

    def read_trainable_state(self, u: "UnitState", lo: int,
                             hi: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 master, exp_avg and exp_avg_sq of elements [lo, hi) of u's trainable prefix,
        which this rank keeps (its shard, or everything), from wherever they are current;
        at most one of ``chunks`` at a time. Valid until the next call. A state slot u does
        not have (an optimizer with fewer than two, [Note: elementwise optimizers]) reads as
        zeros."""
        s = u.shard  # whole on one process and at stage 0; the home buffers start at element s.lo
        # [Note: swap I/O failures] after a failed write the host copy is current (the staged
        # step that keeps one runs only where the shard is whole)
        dirty = self._training.held_states(u)
        if "master" in dirty:
            # merged at stages 0-2: the whole compute copy's prefix; stage 3: the rank's chunk
            base = 0 if self._layout.merged and u.param_shard is None else s.lo
            master = dirty["master"][lo - base:hi - base]
        else:
            master = self._homes.read_master_range(u, lo, hi)
        moments = []
        for i, name in enumerate(("exp_avg", "exp_avg_sq")):
            start = i * s.state_numel + lo - s.lo
            if i >= u.state_slots:
                moments.append(torch.zeros(hi - lo, dtype=torch.float32))
            elif "moments" in dirty:
                moments.append(dirty["moments"][start:start + hi - lo])
            else:
                moments.append(self._homes.load_range(u.moments_home, start, hi - lo, torch.float32, f"ckpt.{name}"))
        return (master, moments[0], moments[1])

    def read_master(self, u: "UnitState", lo: int, hi: int) -> torch.Tensor:
        """fp32 master of elements [lo, hi) of u's trainable prefix as its homes hold it (one
        of ``chunks`` at a time; valid until the next call)."""
        return self._homes.read_master_range(u, lo, hi)

    def read_lagging(self, u: "UnitState", lo: int, hi: int) -> Optional[torch.Tensor]:
        """[Note: delayed updates] fp32 values of elements [lo, hi) of u's trainable prefix in
        the compute copy the forward reads, one update behind the state a save writes; None
        when u has no delayed update pending. During a save the engine shows each unit's true
        state as its homes (DelayedUpdates.committed_view), so that copy sits in the spare homes."""
        if not u.delayed_pending:
            return None
        base = 0 if u.param_shard is None else u.shard.lo  # [zero] stage 3: the rank's chunk starts with its shard
        compute = self._homes.load_range(u.spare.compute_home, lo - base, hi - lo, self._layout.home_dtype,
                                         "ckpt.lagging")
        return compute.to(torch.float32)

    def read_frozen_values(self, u: "UnitState", lo: int, hi: int) -> torch.Tensor:
        """Compute-copy values of elements [lo, hi) of u's frozen tail, which this rank keeps.
        Valid until the next call."""
        p = u.param_shard
        home_dtype = self._layout.home_dtype
        load = self._homes.load_range
        if p is not None:  # [zero] stage 3: the rank's chunks, the frozen one second
            return load(u.compute_home, p.trainable_chunk_numel + lo - p.frozen.lo, hi - lo, home_dtype, "ckpt.value")
        start = u.spec.frozen_start
        if self._layout.param_tier == "device":
            return self._homes.device_copy(u)[start + lo:start + hi].to("cpu", copy=True)
        return load(u.compute_home, start + lo, hi - lo, home_dtype, "ckpt.value")

    @torch.no_grad()
    def write_unit_state(self, u: "UnitState", read: Callable[[str, int, int, torch.Tensor], None],
                         steps: List[int]) -> None:
        """Replace the state of u this rank keeps by a checkpoint's values, and drop u's
        gradients. ``read(section, lo, hi, out)`` fills ``out`` with elements [lo, hi) of the
        trainable prefix ("master", "exp_avg", "exp_avg_sq") or of the frozen tail ("value",
        counted from the tail's start); ``steps``: Adam's step count of each trainable
        parameter. The weights go as ``write_unit_weights`` writes them. [Note: bounded
        checkpoint memory] One piece (``chunks``) of the compute copy, the master or a moment
        at a time; every home is written whole, its padding with zeros, as the wrap wrote it."""
        s = u.shard
        self._homes.forget_contents(u)
        self.write_unit_weights(u, read)
        if u.trainable:
            for half, section in ((0, "exp_avg"), (s.state_numel, "exp_avg_sq"))[:u.state_slots]:
                for a, b in self.chunks(0, s.state_numel):
                    moment = self._homes.buffer("ckpt.moment", (b - a) * 4).view(torch.float32).zero_()
                    if a < s.numel:
                        read(section, s.lo + a, s.lo + min(b, s.numel), moment[:min(b, s.numel) - a])
                    self._homes.store_range(u.moments_home, half + a, moment, "ckpt.bounce")
        u.steps = list(steps)
        u.has_grad = [False] * len(u.trainable)
        u.delayed_pending = False  # [Note: delayed updates] unless restore_lagging says otherwise

    @torch.no_grad()
    def write_unit_weights(self, u: "UnitState", read: Callable[[str, int, int, torch.Tensor], None]) -> None:
        """Replace u's weights this rank keeps: its compute copy at home (param_tier
        "device": in its device slot) and, for the trainable elements, the fp32 master
        (merged: the compute copy itself; split: its low halves, [Note: split master]). u's
        device copy is released first (stale from now on). ``read(section, lo, hi, out)``
        fills ``out`` with fp32 elements [lo, hi) of the trainable prefix ("master") or
        compute-dtype elements of the frozen tail ("value", counted from the tail's start).
        Trainable compute values are derived from the master (rounded as the Adam kernel
        rounds it). Adam's moments, step counts and u's gradients are left alone. One piece
        (``chunks``) at a time; the compute home is written whole, its padding zeros."""
        if self.compact:
            self._write_compact_weights(u, read)
            return
        s, p = u.shard, u.param_shard
        on_device = self._layout.param_tier == "device"
        if not on_device:
            self._residency.release(u)  # a device copy of this unit is stale from now on
        # The compute copy as its home holds it: (home start, section, first element, count)
        # of its trainable and frozen parts; the rest of the home is zeros.
        if p is None:
            frozen_start = u.spec.frozen_start
            home_numel = u.compute_numel
            parts = [(0, "master", 0, u.spec.trainable_numel),
                     (frozen_start, "value", 0, u.spec.total_numel - frozen_start)]
        else:  # [zero] stage 3: the rank's chunks
            home_numel = p.home_numel
            parts = [(0, "master", s.lo, s.numel), (p.trainable_chunk_numel, "value", p.frozen.lo, p.frozen.numel)]
        home_dtype = self.compute_dtype if p is None else self._layout.home_dtype
        for a, b in self.chunks(0, home_numel):
            compute = self._homes.buffer("ckpt.compute", (b - a) * home_dtype.itemsize).view(home_dtype).zero_()
            for start, section, first, numel in parts:
                x, y = max(a, start), min(b, start + numel)
                if x >= y:
                    continue
                lo, hi = first + x - start, first + y - start
                if section == "value":
                    read("value", lo, hi, compute[x - a:y - a])
                    continue
                master = self._homes.buffer("ckpt.master", (hi - lo) * 4).view(torch.float32)
                read("master", lo, hi, master)
                self._homes.store_master_range(u, master, lo, compute[x - a:y - a])
            if on_device:
                self._homes.device_copy(u)[a:b].copy_(compute)
            elif p is None:
                self._homes.store_compute_range(u, a, compute)  # merged: fp32, the master itself
            else:  # [zero] stage 3: the rank's chunks, the spare's too (its frozen chunk is never updated)
                self._homes.store_range(u.compute_home, a, compute, "ckpt.bounce")
                if u.spare is not None:
                    self._homes.store_range(u.spare.compute_home, a, compute, "ckpt.bounce")
        if u.trainable:
            self._homes.zero_master_padding(u)

    def _write_compact_weights(self, u: "UnitState", read: Callable[[str, int, int, torch.Tensor], None]) -> None:
        """[Note: compact optimizer states] write_unit_weights of compact states: an element
        whose new master (``read("master", ...)``) differs from the one its high and low
        parts decode to gets them encoded from it; the others keep their bytes (re-encoding
        a decoded master may flip the split at a tie). Codes and scales are left alone.
        [Note: bounded checkpoint memory] A piece at a time: each of ``chunks`` of a
        parameter's high and low parts is read (Homes.read_compact_range: views of host homes,
        changed in place) and, on NVMe, written back where an element changed; then the
        frozen tail's values in ``chunks``. Each range is read before it is changed and
        never again, so ``read`` sees the weights from before the write."""
        on_device = self._layout.param_tier == "device"
        if not on_device:
            self._residency.release(u)  # a device copy of this unit is stale from now on
        layout, starts = self._homes.compact_layout(u) if u.trainable else (None, [])
        for k, e in enumerate(u.trainable):
            for a, b in self.chunks(0, e.numel):
                parts = self._homes.read_compact_range(u, k, a, b, ("high", "low"))
                high, low = parts["high"], parts["low"]
                new = self._homes.buffer("ckpt.master", (b - a) * 4).view(torch.float32)
                read("master", e.offset + a, e.offset + b, new)
                changed = new.view(torch.int32) != decode_master(high, low).view(torch.int32)
                if not bool(changed.any()):
                    continue
                new_high, new_low = encode_master(new.contiguous())
                high.copy_(torch.where(changed, new_high, high))
                low.copy_(torch.where(changed, new_low, low))
                if u.compute_home is not None and not isinstance(u.compute_home, torch.Tensor):  # on NVMe
                    self._homes.store_range(u.compute_home, e.offset + a, high, "ckpt.bounce")
                if not isinstance(u.compact_home, torch.Tensor):  # on NVMe
                    self._homes.store_range(u.compact_home, layout.low + starts[k] + a, low, "ckpt.bounce")
        dtype, tail = self.compute_dtype, u.spec.frozen_start
        for a, b in self.chunks(tail, u.spec.total_numel):
            values = self._homes.buffer("ckpt.compute", (b - a) * dtype.itemsize).view(dtype).zero_()  # gaps: 0
            read("value", a - tail, b - tail, values)
            if on_device:
                self._homes.device_copy(u)[a:b].copy_(values)
            else:
                self._homes.store_compute_range(u, a, values)

    @torch.no_grad()
    def write_edited_weights(self, u: "UnitState", edited: torch.Tensor) -> None:
        """[Note: gathered parameters] Write home u's compute copy as edited in place
        (``edited``: the whole copy, compute dtype, on the CPU): the frozen elements as they
        are; a trainable element whose compute value changed gets that value as its fp32
        master, one that did not keeps its master (with bf16/fp16 compute, finer than the
        compute copy shows), both compared bit for bit with the master's rounding."""
        tail = u.spec.frozen_start
        compare = {4: torch.int32, 2: torch.int16}[edited.element_size()]

        def read(section: str, lo: int, hi: int, out: torch.Tensor) -> None:
            if section == "value":
                out.copy_(edited[tail + lo:tail + hi])
                return
            new = edited[lo:hi]
            if self.compact:  # [Note: compact optimizer states] the high parts at home, not a rounding:
                # a master decoded from low = +-127 rounds to the other neighbour at a tie
                current = self._homes.load_range(u.compute_home, lo, hi - lo, self.compute_dtype, "ckpt.stored")
            master = self._homes.read_master_range(u, lo, hi)  # valid until the next read
            if not self.compact:
                current = self._homes.round_master(master)
            kept = current.view(compare) == new.view(compare)
            torch.where(kept, master, new.to(torch.float32), out=out)
        self.write_unit_weights(u, read)

    @torch.no_grad()
    def restore_lagging(self, u: "UnitState", read: Callable[[int, int, torch.Tensor], None]) -> bool:
        """[Note: delayed updates] u's state (just written by write_unit_state) is the result
        of a delayed update that was pending when the checkpoint was saved: it goes into the
        spare homes, and the compute copy the forward read then (``read(lo, hi, out)``: fp32
        elements [lo, hi) of its trainable prefix) into the homes' compute copy, as the engine
        held them. False (and nothing changes: the run goes on from the updated weights)
        without delayed_update."""
        if not self._layout.delayed_update or u.spare is None:
            return False
        u.commit_spare()  # the homes written just now become the spare ones; their frozen tail is current
        home_dtype = self._layout.home_dtype
        # [zero] stage 3: the rank's trainable chunk, which starts with its shard; else the whole prefix
        lo, hi = (0, u.spec.trainable_numel) if u.param_shard is None else (u.shard.lo, u.shard.hi)
        for a, b in self.chunks(lo, hi):
            lagging = self._homes.buffer("ckpt.master", (b - a) * 4).view(torch.float32)
            read(a, b, lagging)
            self._homes.store_range(u.compute_home, a - lo, lagging.to(home_dtype), "ckpt.bounce")
        u.delayed_pending = True
        return True

    @property
    def compact(self) -> bool:
        """[Note: compact optimizer states] The states are compact: a checkpoint keeps their
        codes, scales and high parts, never fp32 states."""
        return self._layout.compact_states

    def read_compact_range(self, u: "UnitState", k: int, lo: int, hi: int) -> Dict[str, torch.Tensor]:
        """Elements [lo, hi) (``lo`` on a block) of u's trainable parameter k's compact states
        as its homes hold them, by section (format.COMPACT_SECTIONS: the high parts, the low
        parts, the codes and the scales of their blocks): [Note: bounded checkpoint memory]
        the range alone is read, never the whole unit. Valid until the next call."""
        return self._homes.read_compact_range(u, k, lo, hi)

    @torch.no_grad()
    def write_compact_unit_state(self, u: "UnitState", read_compact: Callable[[int, str, int, int, torch.Tensor], None],
                                 read: Callable[[str, int, int, torch.Tensor], None], steps: List[int]) -> None:
        """[Note: compact optimizer states] Replace u's compact states and compute copy by a
        checkpoint's, and drop u's gradients: ``read_compact(k, section, lo, hi, out)`` fills
        ``out`` with elements [lo, hi) of trainable parameter k's saved ``section`` (a
        COMPACT_SECTIONS name; a per-block one: the scales of the blocks holding [lo, hi),
        ``lo`` on a block), ``read("value", lo, hi, out)`` with the frozen tail's values. The
        bytes are the saved ones: nothing is decoded and encoded again. Both homes are written
        whole, zeros between the parameters, as the wrap wrote them, [Note: bounded checkpoint
        memory] a piece at a time: the compute copy in ``chunks``, the compact home in the
        windows of _compact_windows."""
        on_device = self._layout.param_tier == "device"
        self._homes.forget_contents(u)
        if not on_device:
            self._residency.release(u)  # a device copy of this unit is stale from now on
        dtype, tail = self.compute_dtype, u.spec.frozen_start
        for a, b in self.chunks(0, u.compute_numel):
            compute = self._homes.buffer("ckpt.compute", (b - a) * dtype.itemsize).view(dtype).zero_()
            for k, e in enumerate(u.trainable):
                x, y = max(a, e.offset), min(b, e.offset + e.numel)
                if x < y:
                    read_compact(k, "high", x - e.offset, y - e.offset, compute[x - a:y - a])
            x, y = max(a, tail), min(b, u.spec.total_numel)
            if x < y:
                read("value", x - tail, y - tail, compute[x - a:y - a])
            if on_device:
                self._homes.device_copy(u)[a:b].copy_(compute)
            else:
                self._homes.store_compute_range(u, a, compute)
        if u.trainable:
            home = u.compact_home
            layout, starts = self._homes.compact_layout(u)
            home_bytes = home.numel() if isinstance(home, torch.Tensor) else home.nbytes
            for lo, hi, nbytes, regions in _compact_windows(layout, home_bytes):
                window = self._homes.buffer("ckpt.compact", nbytes).zero_()
                for k, e in enumerate(u.trainable):
                    x, y = max(lo, starts[k]), min(hi, starts[k] + e.numel)
                    if x >= y:
                        continue
                    for name, (start, size) in compact_range_parts(layout, x, y).items():
                        at = regions[name][0] + start - regions[name][1]  # where the window holds it
                        read_compact(k, name, x - starts[k], y - starts[k],
                                     window[at:at + size].view(_ARRAY_DTYPES[name]))
                if not layout.paged:  # one window: the whole home
                    self._homes.store(home, window)
                    continue
                for at, start, size in regions.values():
                    self._homes.store_range(home, start, window[at:at + size], "ckpt.bounce")
        u.steps = list(steps)
        u.has_grad = [False] * len(u.trainable)

    def training_counters(self) -> Dict[str, Any]:
        """The engine's scalar training state, as a checkpoint keeps it (TrainingState.training_counters)."""
        return self._training.training_counters()

    def restore_training_counters(self, counters: Dict[str, Any], saved_dtype: str) -> None:
        """Set the counters that ``training_counters()`` returned, from a checkpoint written
        with compute dtype ``saved_dtype``. The loss scale belongs to the dtype: from another
        dtype's checkpoint it starts afresh (``fresh_loss_scaling``), else fp16's scale
        would multiply the gradients of a bf16 run, or a bf16 run's 1.0 start an fp16 one."""
        if saved_dtype != self.config.dtype:
            counters = {**counters, **self.fresh_loss_scaling()}
        self._training.restore_training_counters(counters)

    def fresh_loss_scaling(self) -> Dict[str, Any]:
        """The loss-scale counters this engine's dtype starts a run with."""
        return {"loss_scale": self._layout.starting_loss_scale, "good_steps": 0}

    def begin_state_load(self, message: str) -> None:
        """The states are about to be replaced: until ``finish_state_load()`` the engine may
        hold a mix of old and new ones, and refuses to train (EngineFailedError: ``message``)."""
        self._failures.set({"fatal": True, "message": message})

    def finish_state_load(self) -> None:
        """Every state was replaced: host copies of failed swap writes are stale now, and
        the engine trains again."""
        self._training.forget_held_states()
        self._failures.set(None)


_ARRAY_DTYPES = {name: dtype for name, dtype, _ in COMPACT_ARRAYS}


def _compact_windows(layout: "CompactHomeLayout",
                     home_bytes: int) -> List[Tuple[int, int, int, Dict[str, Tuple[int, int, int]]]]:
    """[Note: bounded checkpoint memory] The windows a load writes a compact home of
    ``home_bytes`` bytes (laid out by ``layout``) in: (lo, hi, bytes, regions) for compact
    elements [lo, hi), ``regions`` as compact_piece_regions gives them (per array: start in
    the window's buffer, start in the home, bytes). A packed home (at most SCALE_PAGE_NUMEL
    elements) is one window, the whole home; a paged one is cut in windows of
    compact_piece_numel(CHUNK_NUMEL) elements, each array's part whole pages ([Note: compact
    pieces]), the last window running on to each array's padded end."""
    if not layout.paged:
        regions = {name: (getattr(layout, name), getattr(layout, name), layout.region_end(name) - getattr(layout, name))
                   for name, _, _ in COMPACT_ARRAYS}
        return [(0, layout.numel, home_bytes, regions)]
    size = compact_piece_numel(CHUNK_NUMEL)
    windows = []
    for lo in range(0, layout.numel, size):
        hi = min(lo + size, layout.numel)
        regions = compact_piece_regions(layout, lo, hi)
        windows.append((lo, hi, sum(n for _, _, n in regions.values()), regions))
    return windows


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
