"""Homes: where each unit's state lives between uses, and the synchronous codec that reads
and writes a home whole.

A unit's compute copy is homed on ``layout.compute_tier(index)`` (on the device itself, or
on the host or NVMe, fetched to a device slot when needed); its fp32 master and Adam moments
on ``layout.state_tier(index)`` ([Note: placement by budget]). ``Homes`` allocates them once
at wrap, writes every unit's initial state there (``write_initial_state``, one unit at a
time as offload/memory/materialize.py materializes the model) and offers the synchronous
readers and writers that ``state_dict`` and the optimizer steps' failure paths go through,
whole buffers (``load``, ``store``, ``read_master``, ``store_master``,
``split_master_into``), and those that checkpoints go through, ranges of a buffer
(``load_range``, ``store_range``, ``read_master_range``, ``store_master_range``,
``store_compute_range``, ``read_compact_range``: [Note: bounded checkpoint memory]). The
per-step traffic (fetches, the staged and sharded optimizer steps) moves pieces of the same
homes through buffers of its own and does not come here.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from offload.memory.budget import (SlotShape, UnitSizes, compact_home_bytes, compute_home_numel, gradient_spill,
                                   low_numel, unit_gradient_bytes)
from offload.memory.compact_codec import (BLOCK_NUMEL, COMPACT_ARRAYS, CompactHomeLayout, CompactStates,
                                          compact_home_layout, compact_padded_numel, decode_master, num_blocks)
from offload.memory.layout import FP32_BYTES, Layout, SpareHomes, StagingSlot, UnitState, on_nvme, sub_extent
from offload.memory.master_codec import join_master, split_master
from offload.memory.state_slots import PackedHome
from offload.tiers.nvme import wait_all
from offload.tiers.context import TierContext
from offload.units import PAGE_BYTES, ParamEntry, Residency, round_up
from offload.zero import Partition

_ZEROS_BYTES = 4 << 20  # the zero buffer the initial moments are written from
# [Note: compact optimizer states] what read_compact_range reads: the high parts, then the
# compact home's arrays (those that hold a value per block: _PER_BLOCK)
COMPACT_RANGE_NAMES = ("high",) + tuple(name for name, _, _ in COMPACT_ARRAYS)
_PER_BLOCK = {name for name, _, per_block in COMPACT_ARRAYS if per_block}


class Homes:
    """The homes of ``units``' states on the tiers, as ``layout`` places them.

    Collaborators: the ``tiers`` (their nvme None when nothing is homed there; their
    counters count the waits for NVMe writes); the ``partition`` ([zero] None with one
    rank), which cuts what this rank keeps and through which every rank starts from rank
    0's initial values; ``release_param``, which points a parameter at its placeholder
    while its unit is not on the device ([Note: released parameters]); and ``bind(u)``,
    the engine's residency pointing u's parameters at its device copy, called once a
    device-homed unit's initial state is written;
    ``compact``, with compact states: the CompactStates port (memory/compact_codec.py) that
    gives a unit's states as one object over bytes and a compute copy. Homes holds the one
    instance; the staged step and the checkpoint code use it as ``Homes.compact``.
    """

    def __init__(self, units: List[UnitState], layout: Layout, *, tiers: TierContext, partition: Optional[Partition],
                 release_param: Callable[[ParamEntry], None], bind: Callable[[UnitState], None],
                 adam_state: Optional[Dict[nn.Parameter, Tuple[int, torch.Tensor, torch.Tensor]]] = None,
                 compact: Optional[CompactStates] = None) -> None:
        self._units = units
        self._adam_state = adam_state or {}  # carried_adam_state: what the optimizer had, by parameter
        self._layout = layout
        self._device, self._host, self._nvme, self._stats = tiers.device, tiers.host, tiers.nvme, tiers.stats
        self._partition = partition
        self._release_param = release_param
        self._bind = bind
        # [Note: compact optimizer states] read only with compact states
        self.compact = compact
        self._buffers: Dict[str, torch.Tensor] = {}  # see buffer
        # [Note: bounded checkpoint memory] the bytes those buffers hold now, the most they
        # held at once since drop_buffers last let go of them, and that most as of that drop
        self._buffer_bytes = 0
        self._buffer_peak_bytes = 0
        self.last_buffer_peak_bytes = 0
        self._num_written = 0
        # [Note: wrap scratch in the arena] write_initial_state's buffers in the device arena,
        # by name ("compute", "master", "low"); None until the first unit is written
        self._scratch: Optional[Dict[str, torch.Tensor]] = None
        self._scratch_in_slot = False  # "compute" is the root unit's slot

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> None:
        """Every unit's homes (param_tier 'device': its device slot, loaded from now on),
        and the root unit's device slot."""
        layout = self._layout
        for u in self._units:
            if layout.param_tier == "device":
                u.device_offset = self._device.allocate(u.compute_numel)
                assert u.device_offset is not None
                u.compute_state.to(Residency.LOADING)
                u.compute_state.to(Residency.LOADED)
            else:  # [Note: placement by budget] each unit on its own tiers
                dtype = torch.float32 if layout.merged else layout.compute_dtype
                u.compute_home = self._allocate_home(layout.compute_tier(u.index),
                                                     compute_home_numel(u.compute_numel, u.param_shard), dtype)
            if u.trainable:
                state_numel = u.shard.state_numel  # [zero] shard-sized with stage >= 1
                state_tier = layout.state_tier(u.index)
                if layout.compact_states:  # [Note: compact optimizer states] one buffer on the state tier
                    u.compact_home = self._allocate_home(state_tier, compact_home_bytes(UnitSizes.of(u), state_tier),
                                                         torch.uint8)
                    if not on_nvme(u.compact_home) and (isinstance(u.compute_home, torch.Tensor)
                                                        or layout.param_tier == "device"):
                        u.compact = self.compact.over(u, u.compact_home, self.compute_copy(u))
                    if layout.has_spare(u.index, True):  # [Note: speculative updates] (never param_tier "device")
                        u.spare = SpareHomes(self._like(layout.compute_tier(u.index), u.compute_home), None, None,
                                             list(u.steps), self._like(state_tier, u.compact_home))
                        if u.compact is not None:
                            u.spare.compact = self.compact.over(u, u.spare.compact_home, u.spare.compute_home)
                    continue
                if layout.split_master:
                    u.master_home = self._allocate_home(state_tier, low_numel(u.shard.numel), torch.int16)
                elif not layout.merged:
                    u.master_home = self._allocate_home(state_tier, state_numel, torch.float32)
                if u.state_slots:  # none for an optimizer without per-element state (plain SGD)
                    if u.state_pages is None:
                        u.moments_home = self._allocate_home(state_tier, u.state_slots * state_numel, torch.float32)
                    else:  # [Note: per-entry state slots] the slots each parameter's optimizer keeps
                        u.moments_home = PackedHome(self._allocate_home(state_tier, u.state_pages.numel,
                                                                        torch.float32), u.state_pages)
                # [Note: speculative updates] a second set, same sizes and tiers; [Note: delayed
                # updates] a second compute copy, master and moments shared (written in place)
                if layout.has_spare(u.index, True):
                    own = layout.spare_states
                    u.spare = SpareHomes(self._like(layout.compute_tier(u.index), u.compute_home),
                                         self._like(state_tier, u.master_home) if own else u.master_home,
                                         self._like(state_tier, u.moments_home) if own else u.moments_home,
                                         list(u.steps))
        if gradient_spill([UnitSizes.of(u) for u in self._units], layout) is not None:
            for u in self._units:  # [Note: gradient spill] where a unit's gradients may go
                if u.trainable:
                    u.grad_home = self._nvme.allocate(unit_gradient_bytes(UnitSizes.of(u), layout))
        if layout.param_tier != "device":
            # The root unit keeps one slot for the whole run: it is on the device from the
            # start of forward to the end of backward, and a fixed place avoids fragmenting.
            root = self._units[0]
            root.device_offset = self._device.allocate(root.compute_numel)

    def _like(self, tier: str, home: Any) -> Any:
        """A new home on ``tier`` the size (and dtype) of ``home``; None for None."""
        if home is None:
            return None
        if isinstance(home, PackedHome):
            return PackedHome(self._like(tier, home.home), home.slots)
        if isinstance(home, torch.Tensor):
            return self._allocate_home(tier, home.numel(), home.dtype)
        return self._nvme.allocate(home.nbytes)

    def _allocate_home(self, tier: str, numel: int, dtype: torch.dtype) -> Any:
        if tier == "host":
            return self._host.allocate(numel, dtype)
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        return self._nvme.allocate(numel * element_bytes)

    def allocate_staging(self, shape: SlotShape) -> List[StagingSlot]:
        """The staged optimizer step's host slots, ``shape`` each (none without a staged step)."""
        if not self._layout.staged_step:
            return []
        return [StagingSlot(self._host, shape.master_numel, shape.compute_numel, self._layout.compute_dtype,
                            shape.low_numel, shape.compact_bytes, shape.moments_numel)
                for _ in range(self._layout.optimizer_pipeline_depth)]

    # ------------------------------------------------------------------ initial state
    @torch.no_grad()
    def write_initial_state(self, u: UnitState) -> None:
        """Write u's initial state home. Transient memory, page aligned so that it is written
        without a bounce copy ([Note: wrap scratch in the arena]): u's compute copy, and a
        separate fp32 master where one is kept or, split ([Note: split master]), the master's
        low halves, split from each parameter's values in turn; each parameter lets go of
        its storage once copied (the model's own storage is still held until wrap succeeds:
        [Note: a failed wrap changes nothing]), the moments are zeros."""
        layout = self._layout
        split_here = self._splits_per_parameter() and u.trainable
        compute = self._initial_buffer("compute", u.compute_numel, layout.compute_dtype)
        master = self._initial_buffer("master", u.master_numel, torch.float32) \
            if (not layout.merged or self._partition is not None) and not split_here else None
        low = self._initial_buffer("low", low_numel(u.shard.numel), torch.int16) if split_here else None
        for e in u.spec.entries:
            value = e.param.detach().reshape(-1).to("cpu")
            target = compute[e.offset:e.offset + e.numel]
            if split_here and e.trainable:  # elementwise: the same halves as splitting the whole prefix
                split_master(value.to(torch.float32).contiguous(), target, low[e.offset:e.offset + e.numel])
            else:
                target.copy_(value)
            if e.trainable and master is not None:
                master[e.offset:e.offset + e.numel].copy_(value)
            self._release_param(e)
        if self._partition is not None:  # [zero] every rank starts from rank 0's values
            self._partition.broadcast_initial(compute, master)
        t = u.spec.trainable_numel
        if layout.split_master and u.trainable and not split_here:
            low = self.split_master_into(u, master, compute[:t], 0)
        if layout.compact_states and u.trainable:  # the high parts into ``compute`` before it goes home
            self._store_initial_compact(u, master, compute)
        if layout.param_tier == "device":
            self._device.view(u.device_offset, u.compute_numel).copy_(compute)
        elif u.param_shard is not None:  # [zero] stage 3: this rank's chunks only
            chunks = self._home_chunks(u, compute)
            self.store(u.compute_home, chunks)
            if u.spare is not None:  # its frozen chunk, which no update writes ([Note: speculative updates])
                self.store(u.spare.compute_home, chunks)
        else:
            self.store_compute(u, compute)  # merged: compute dtype is fp32, the master
        if u.trainable and not layout.compact_states:
            self.store_master(u, master, 0, low)
            self._store_initial_moments(u)
        if layout.param_tier == "device":
            self._bind(u)
        self._num_written += 1
        if self._num_written == len(self._units):  # the last unit: wrap holds no buffer past here
            self.drop_buffers()

    def _initial_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed, page-aligned buffer of ``numel`` ``dtype`` for write_initial_state
        ("compute", "master" or "low"), reused from unit to unit: memory touched for the first time
        is several times slower than memory reused (see offload/tiers/device.py), and writing
        each unit from a new buffer made first touches a large part of wrap's time. Every use
        is synchronous (written home before the next unit), so the reuse holds no more than
        the largest unit needs, as one buffer per unit did; dropped after the last unit.
        Zeroed on each use: the alignment gaps between parameters stay zeros. On a CPU device
        they are carved from the arena when it has room ([Note: wrap scratch in the arena]),
        else kept by ``buffer``."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        scratch = self._wrap_scratch(name)
        if scratch is not None and nbytes <= scratch.numel():
            return scratch[:nbytes].view(dtype).zero_()
        return self.buffer(name, nbytes).view(dtype).zero_()

    def _splits_per_parameter(self) -> bool:
        """[Note: split master] write_initial_state splits each parameter's values into the
        compute copy and the low halves, with no fp32 master buffer ([zero]: not with a
        partition, whose ranks start from rank 0's master)."""
        return self._layout.split_master and self._partition is None

    def _wrap_scratch(self, name: str) -> Optional[torch.Tensor]:
        """[Note: wrap scratch in the arena] On a CPU device with compute copies off the
        device, the arena is touched RAM that no unit uses until the first fetch: the
        "compute" buffer goes in the root unit's slot when the largest compute copy fits
        there, and the others ("master" or "low", and "compute" when it does not fit there)
        in bytes borrowed from the rest of the arena: all of them if they fit together, else
        the largest one that fits (the arena lends one run of bytes at a time). None for a
        buffer without such room: the heap then, through ``buffer``."""
        if self._scratch is None:
            self._scratch = {}
            root = self._units[0]
            layout = self._layout
            if layout.device_is_host and layout.param_tier != "device" \
                    and root.device_offset is not None and self._num_written < len(self._units):
                element_bytes = layout.compute_element_bytes
                split = self._splits_per_parameter()
                sizes = {
                    "compute": max(round_up(u.compute_numel * element_bytes, PAGE_BYTES) for u in self._units),
                    "master": 0 if split or (layout.merged and self._partition is None) else
                    round_up(max(u.master_numel for u in self._units) * FP32_BYTES, PAGE_BYTES),
                    "low": round_up(max(low_numel(u.shard.numel) for u in self._units) * 2, PAGE_BYTES)
                    if split else 0,
                }
                if sizes["compute"] <= root.compute_numel * element_bytes:
                    self._scratch["compute"] = self._device.view(root.device_offset, root.compute_numel).view(torch.uint8)
                    self._scratch_in_slot, sizes["compute"] = True, 0
                wanted = sorted((n for n in sizes if sizes[n]), key=lambda n: -sizes[n])
                for names in [wanted] + [[n] for n in wanted]:
                    borrowed = self._device.borrow(sum(sizes[n] for n in names)) if names else None
                    if borrowed is not None:
                        for n in names:
                            self._scratch[n], borrowed = borrowed[:sizes[n]], borrowed[sizes[n]:]
                        break
        return self._scratch.get(name)

    def buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of a page-aligned uint8 buffer kept under ``name`` and reused
        by the next call with that name (grown when too small); ``drop_buffers`` lets go of
        them all. A caller is done with a name's bytes before it asks for that name again."""
        from offload.io import aligned_empty

        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            smaller = self._buffers.pop(name, None)  # let go of the smaller one first
            self._buffer_bytes -= 0 if smaller is None else smaller.numel()
            buffer = self._buffers[name] = aligned_empty(nbytes)
            self._buffer_bytes += nbytes
            self._buffer_peak_bytes = max(self._buffer_peak_bytes, self._buffer_bytes)
        return buffer[:nbytes]

    def drop_buffers(self) -> None:
        """Let go of every buffer ``buffer`` keeps and of the arena borrowed for wrap (after
        wrap's last unit, and before and after a checkpoint's save or load). The most bytes
        they held at once since the drop before stays as ``last_buffer_peak_bytes``."""
        self._buffers.clear()
        self.last_buffer_peak_bytes, self._buffer_peak_bytes, self._buffer_bytes = self._buffer_peak_bytes, 0, 0
        if self._scratch:  # [Note: wrap scratch in the arena] zeros again, as the arena starts
            if self._scratch_in_slot:
                self._scratch["compute"].zero_()  # the root's slot (give_back zeroes what it lent)
            self._device.give_back()
            self._scratch = {}

    def _store_initial_moments(self, u: UnitState) -> None:
        """u's moments and step counts: zeros, or those the optimizer had (``adam_state``:
        its exp_avg and exp_avg_sq laid out like the master, this rank's [zero] shard; an
        elementwise optimizer's state slots 0 and 1, [Note: elementwise optimizers])."""
        carried = [self._adam_state.get(e.param) for e in u.trainable]
        if not any(carried):
            if u.moments_home is not None:
                self.store_zeros(u.moments_home)
            return
        t, s = u.spec.trainable_numel, u.shard
        exp_avg, exp_avg_sq = torch.zeros(t, dtype=torch.float32), torch.zeros(t, dtype=torch.float32)
        for e, state in zip(u.trainable, carried):
            for moment, carried_moment in zip((exp_avg, exp_avg_sq), state[1:] if state is not None else ()):
                if carried_moment is not None:  # None: a slot this parameter's optimizer does not use
                    moment[e.offset:e.offset + e.numel].copy_(carried_moment.detach().reshape(-1))
        if u.state_slots:
            moments = torch.zeros(u.state_slots * s.state_numel, dtype=torch.float32)
            for i, moment in enumerate((exp_avg, exp_avg_sq)[:u.state_slots]):
                moments[i * s.state_numel:i * s.state_numel + s.numel].copy_(moment[s.lo:s.hi])
            self.store(u.moments_home, moments)
        u.steps = [state[0] if state is not None else 0 for state in carried]

    def device_copy(self, u: UnitState) -> torch.Tensor:
        """u's slot in the device arena: with param_tier "device" its compute copy's home."""
        return self._device.view(u.device_offset, u.compute_numel)

    def compute_copy(self, u: UnitState) -> torch.Tensor:
        """[Note: compact optimizer states] u's whole compute copy in host memory, where the
        compact step writes the high parts: its host home, or its slot on a CPU device."""
        if u.compute_home is not None:
            assert isinstance(u.compute_home, torch.Tensor)
            return u.compute_home
        assert self._layout.device_is_host
        return self._device.view(u.device_offset, u.compute_numel)

    def _store_initial_compact(self, u: UnitState, master: torch.Tensor, compute: torch.Tensor) -> None:
        """[Note: compact optimizer states] u's compact states encoded from ``master`` (fp32,
        u's trainable prefix) and zero moments, or those the optimizer had, into its compact
        home (on NVMe through a page-aligned buffer); the high parts are written into
        ``compute``, u's initial compute copy (the same bf16 values: both round to nearest even)."""
        home = u.compact_home
        buffer = home if isinstance(home, torch.Tensor) else self.buffer("compact", home.nbytes)
        buffer.zero_()  # the padding after each parameter stays 0
        states = self.compact.over(u, buffer, compute)
        steps = []
        for k, e in enumerate(u.trainable):
            carried = self._adam_state.get(e.param)
            zeros = torch.zeros(e.numel, dtype=torch.float32)
            exp_avg, exp_avg_sq = (carried[1], carried[2]) if carried is not None else (zeros, zeros)
            states.load_exact(k, master[e.offset:e.offset + e.numel], zeros if exp_avg is None else exp_avg,
                              zeros if exp_avg_sq is None else exp_avg_sq)
            steps.append(carried[0] if carried is not None else 0)
        if on_nvme(home):
            self.store(home, buffer)
        u.steps = steps

    def read_compact(self, u: UnitState, compute: Optional[torch.Tensor] = None) -> Any:
        """[Note: compact optimizer states] u's compact states as they are at home, for
        reading: over its host home and compute copy, or copies read from NVMe (``compute``:
        u's whole compute copy, when the caller has it)."""
        if u.compact is not None:
            return u.compact
        home = u.compact_home
        buffer = home if isinstance(home, torch.Tensor) else self.load(home, home.nbytes, torch.uint8)
        if compute is None:
            compute = self.compute_copy(u) if isinstance(u.compute_home, torch.Tensor) or u.compute_home is None \
                else self.load(u.compute_home, u.spec.trainable_numel, self._layout.compute_dtype)
        return self.compact.over(u, buffer, compute)

    def compact_layout(self, u: UnitState) -> Tuple[CompactHomeLayout, List[int]]:
        """[Note: compact optimizer states] u's compact home layout and where each trainable
        parameter's compact elements start in it (each on a block: CompactUnit)."""
        numels = [e.numel for e in u.trainable]
        return (compact_home_layout(compact_padded_numel(numels)),
                [compact_padded_numel(numels[:k]) for k in range(len(numels))])

    def read_compact_range(self, u: UnitState, k: int, lo: int, hi: int, names: Tuple[str, ...] = COMPACT_RANGE_NAMES,
                           buffer: str = "ckpt") -> Dict[str, torch.Tensor]:
        """[Note: bounded checkpoint memory] Elements [lo, hi) of u's trainable parameter k's
        compact states as its homes hold them, by name: "high" (the compute copy's elements)
        and the compact home's arrays (COMPACT_ARRAYS; a per-block one: the scales of the
        blocks holding [lo, hi), ``lo`` on a block then). Views of homes in host memory, else
        read from NVMe into the reused buffers "<buffer>.<name>": valid until those are used again."""
        layout, starts = self.compact_layout(u)
        arrays = {name: dtype for name, dtype, _ in COMPACT_ARRAYS}
        out = {}
        for name in names:
            if name == "high":
                e, dtype = u.trainable[k], self._layout.compute_dtype
                if isinstance(u.compute_home, torch.Tensor) or u.compute_home is None:
                    out[name] = self.compute_copy(u)[e.offset + lo:e.offset + hi]
                else:
                    out[name] = self.load_range(u.compute_home, e.offset + lo, hi - lo, dtype, f"{buffer}.high")
                continue
            a, b = starts[k] + lo, starts[k] + hi
            if name in _PER_BLOCK:
                a, b = a // BLOCK_NUMEL * 4, num_blocks(b) * 4
            region = getattr(layout, name)
            out[name] = self.load_range(u.compact_home, region + a, b - a, torch.uint8,
                                        f"{buffer}.{name}").view(arrays[name])
        return out

    # ------------------------------------------------------------------ the master codec
    def store_master(self, u: UnitState, master: torch.Tensor, start: int, low: Optional[torch.Tensor]) -> None:
        """Write the master's home from ``master`` (fp32, u's trainable elements from
        ``start``): split, ``low`` (the home's low halves, split_master_into); merged,
        nothing (the compute copy is the master); else this rank's shard ([zero]), padded."""
        if low is not None:
            self.store(u.master_home, low)
        elif not self._layout.merged and start == 0 and self._partition is None and \
                master.numel() == u.shard.state_numel:  # the whole home, its padding zero (write_initial_state)
            self.store(u.master_home, master)
        elif not self._layout.merged:
            s = u.shard
            shard = torch.zeros(s.state_numel, dtype=torch.float32)
            shard[:s.numel].copy_(master[s.lo - start:s.hi - start])
            self.store(u.master_home, shard)

    def split_master_into(self, u: UnitState, master: torch.Tensor, high: torch.Tensor, start: int) -> torch.Tensor:
        """[Note: split master] Round ``master`` (fp32, elements [start, start + n) of u's
        trainable prefix) into ``high`` (its bf16 compute copy there, n elements) and return
        the low halves of this rank's shard ([zero] within that range) as the master's home
        holds them."""
        s = u.shard
        home = torch.zeros(low_numel(u.shard.numel), dtype=torch.int16)
        if s.lo == start and s.numel == high.numel():  # the range is this rank's: split into the home
            split_master(master[:high.numel()].contiguous(), high, home[:s.numel])
            return home
        low = torch.empty(high.numel(), dtype=torch.int16)
        split_master(master[:high.numel()].contiguous(), high, low)
        home[:s.numel].copy_(low[s.lo - start:s.hi - start])
        return home

    def read_master(self, u: UnitState, compute: Optional[torch.Tensor] = None) -> torch.Tensor:
        """u's fp32 master as its home holds it (this rank's shard at stage >= 1; merged:
        the compute copy's prefix). Split ([Note: split master]): joined from the low
        halves at home and the shard's compute copy (``compute``: the whole copy in full
        coordinates, when the caller has it already)."""
        layout = self._layout
        if layout.merged:
            return self.load(u.compute_home, u.master_numel, torch.float32)
        if layout.compact_states:  # [Note: compact optimizer states] high + low, decoded
            states = self.read_compact(u, compute)
            master = torch.zeros(u.master_numel, dtype=torch.float32)
            for k, e in enumerate(u.trainable):
                master[e.offset:e.offset + e.numel].copy_(states.exact(k)[0])
            return master
        if not layout.split_master:
            return self.load(u.master_home, u.shard.state_numel, torch.float32)
        s = u.shard
        if compute is not None:
            high = compute[s.lo:s.hi]
        elif u.param_shard is not None:  # [zero] stage 3: the rank's chunk starts with its shard
            high = self.load(u.compute_home, s.numel, layout.compute_dtype)
        else:
            high = self.load(u.compute_home, s.hi, layout.compute_dtype)[s.lo:]
        master = torch.zeros(s.state_numel, dtype=torch.float32)
        low = self.load(u.master_home, low_numel(u.shard.numel), torch.int16)
        join_master(high.contiguous(), low[:s.numel], master[:s.numel])
        return master

    @staticmethod
    def _home_chunks(u: UnitState, full: torch.Tensor) -> torch.Tensor:
        """[zero] Stage 3: this rank's chunks of a whole compute copy, laid out as at home."""
        p = u.param_shard
        home = torch.zeros(p.home_numel, dtype=full.dtype)
        t, f = p.trainable, p.frozen
        home[:t.numel].copy_(full[t.lo:t.hi])
        start = p.trainable_chunk_numel
        home[start:start + f.numel].copy_(full[p.frozen_start + f.lo:p.frozen_start + f.hi])
        return home

    # ------------------------------------------------------------------ whole buffers
    def store(self, home: Any, src: torch.Tensor) -> None:
        """Synchronous copy of a whole buffer home (setup and checkpoint load only); a
        PackedHome takes ``src`` in the virtual layout ([Note: per-entry state slots])."""
        if isinstance(home, PackedHome):
            home, src = home.home, home.slots.pack(src)
        if isinstance(home, torch.Tensor):
            home.copy_(src)
            return
        staging = src if src.data_ptr() % PAGE_BYTES == 0 else self._host_bounce(src)
        self._nvme.write(staging, home).wait()

    def store_compute(self, u: UnitState, compute: torch.Tensor) -> None:
        """Overwrite u's whole compute copy at home (setup and checkpoint load), and the
        frozen tail of its spare one: [Note: speculative updates] an update writes only the
        trainable prefix, so the spare's tail must already hold the frozen values when the
        spare becomes the home."""
        self.store(u.compute_home, compute)
        if u.spare is None:
            return
        start = u.spec.frozen_start
        if start >= u.spec.total_numel:  # nothing frozen: the padding past the end is never read
            return
        rest = compute.numel() - start
        if isinstance(u.spare.compute_home, torch.Tensor):
            u.spare.compute_home[start:].copy_(compute[start:])
            return
        size = compute.element_size()
        self.store(sub_extent(u.spare.compute_home, start * size, rest * size), compute[start:])

    def store_zeros(self, home: Any) -> None:
        """Zero a whole buffer at home (setup): on NVMe nothing to write when the extent reads
        as zeros already ([Note: zeroed extents]), else from one small zero buffer, written
        piece by piece, all pieces in flight at once."""
        if isinstance(home, PackedHome):
            home = home.home
        if isinstance(home, torch.Tensor):
            home.zero_()
            return
        if self._nvme.claim_zeroed(home):
            return
        from offload.io import aligned_empty

        zeros = aligned_empty(min(home.nbytes, _ZEROS_BYTES)).zero_()
        wait_all([self._nvme.write(zeros[:min(_ZEROS_BYTES, home.nbytes - offset)],
                                   sub_extent(home, offset, min(_ZEROS_BYTES, home.nbytes - offset)))
                  for offset in range(0, home.nbytes, _ZEROS_BYTES)], self._stats)

    def load(self, home: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Synchronous read of a whole buffer from its home into a new host tensor (a
        PackedHome's in the virtual layout, [Note: per-entry state slots])."""
        if isinstance(home, PackedHome):
            return home.slots.unpack(self.load(home.home, home.slots.numel, torch.float32))[:numel]
        if isinstance(home, torch.Tensor):
            return home[:numel].clone()
        from offload.io import aligned_empty

        buf = aligned_empty(home.nbytes, dtype=torch.uint8)
        self._nvme.read(buf, home).wait()
        return buf.view(dtype)[:numel].clone()

    @staticmethod
    def _host_bounce(src: torch.Tensor) -> torch.Tensor:
        """A page-aligned copy of ``src``, which the NVMe tier can write from."""
        from offload.io import aligned_empty

        buf = aligned_empty(src.numel() * src.element_size(), dtype=src.dtype)
        buf.copy_(src)
        return buf

    # ------------------------------------------------------------------ ranges
    # [Note: bounded checkpoint memory] Checkpoints move a unit's state piece by piece
    # (offload/checkpoint/access.py): the 128256 x 3072 fp32 embedding of a 3B model is
    # 1.6 GB, its master and moments 4.7 GB, more than a host budget a run of that size gets.
    def load_range(self, home: Any, start: int, numel: int, dtype: torch.dtype, buffer: str) -> torch.Tensor:
        """Elements [start, start + numel) of a buffer home holding ``dtype``: a view of the
        home itself on the host; on NVMe, read (the whole pages that hold them) into the
        reused buffer of that name (see ``buffer``), valid until the name is used again. A
        PackedHome's elements are those of the virtual layout, read into a buffer of their
        own (zeros where a parameter does not use the slot: [Note: per-entry state slots])."""
        if isinstance(home, PackedHome):
            slots, (s, lo) = home.slots, divmod(start, home.slots.state_numel)
            assert lo + numel <= slots.state_numel, "a range inside one slot"
            out = self.buffer(f"{buffer}.virtual", numel * FP32_BYTES).view(torch.float32).zero_()
            for a, b in slots.owned_parts(s, lo, lo + numel):
                out[a - lo:b - lo].copy_(self.load_range(home.home, slots.physical(s, a), b - a, dtype, buffer))
            return out
        if isinstance(home, torch.Tensor):
            return home[start:start + numel]
        size = dtype.itemsize
        lo = start * size // PAGE_BYTES * PAGE_BYTES
        hi = round_up((start + numel) * size, PAGE_BYTES)
        buf = self.buffer(buffer, hi - lo)
        self._nvme.read(buf, sub_extent(home, lo, hi - lo)).wait()
        first = (start * size - lo) // size
        return buf.view(dtype)[first:first + numel]

    def store_range(self, home: Any, start: int, src: torch.Tensor, buffer: str) -> None:
        """Overwrite elements [start, start + n) of a buffer home with ``src`` (n elements,
        the home's dtype), synchronously. On NVMe whole pages are written: from ``src``
        itself when it covers them exactly from a page-aligned address, else through the
        reused buffer named ``buffer``, with the edge pages' other bytes read first. A
        PackedHome takes elements of the virtual layout and keeps those of parameters using
        the slot ([Note: per-entry state slots])."""
        n = src.numel()
        if isinstance(home, PackedHome):
            slots, (s, lo) = home.slots, divmod(start, home.slots.state_numel)
            assert lo + n <= slots.state_numel, "a range inside one slot"
            for a, b in slots.owned_parts(s, lo, lo + n):
                self.store_range(home.home, slots.physical(s, a), src[a - lo:b - lo], buffer)
            return
        if isinstance(home, torch.Tensor):
            home[start:start + n].copy_(src)
            return
        size = src.element_size()
        a, b = start * size, (start + n) * size
        lo, hi = a // PAGE_BYTES * PAGE_BYTES, round_up(b, PAGE_BYTES)
        if (lo, hi) == (a, b) and src.is_contiguous() and src.data_ptr() % PAGE_BYTES == 0:
            staging = src
        else:
            staging = self.buffer(buffer, hi - lo)
            if lo < a:  # the first page's bytes before ``a``
                self._nvme.read(staging[:PAGE_BYTES], sub_extent(home, lo, PAGE_BYTES)).wait()
            if hi > b and not (lo < a and hi - PAGE_BYTES == lo):  # the last page's, unless read just now
                self._nvme.read(staging[hi - lo - PAGE_BYTES:], sub_extent(home, hi - PAGE_BYTES, PAGE_BYTES)).wait()
            staging[a - lo:b - lo].view(src.dtype).copy_(src)
        self._nvme.write(staging, sub_extent(home, lo, hi - lo)).wait()

    def read_master_range(self, u: UnitState, lo: int, hi: int) -> torch.Tensor:
        """fp32 master of elements [lo, hi) of u's trainable prefix, inside this rank's shard,
        as ``read_master`` gives them (uses the buffers "master", "high" and "low")."""
        layout, s = self._layout, u.shard
        base = 0 if u.param_shard is None else s.lo  # [zero] stage 3: the rank's chunk starts with its shard
        if layout.compact_states:  # [Note: compact optimizer states] high + low of [lo, hi) alone, decoded
            master = self.buffer("master", (hi - lo) * FP32_BYTES).view(torch.float32).zero_()
            for k, e in enumerate(u.trainable):
                a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
                if a < b:
                    parts = self.read_compact_range(u, k, a - e.offset, b - e.offset, ("high", "low"), "master")
                    master[a - lo:b - lo].copy_(decode_master(parts["high"], parts["low"]))
            return master
        if layout.merged:
            return self.load_range(u.compute_home, lo - base, hi - lo, torch.float32, "master")
        if not layout.split_master:
            return self.load_range(u.master_home, lo - s.lo, hi - lo, torch.float32, "master")
        high = self.load_range(u.compute_home, lo - base, hi - lo, layout.compute_dtype, "high")
        low = self.load_range(u.master_home, lo - s.lo, hi - lo, torch.int16, "low")
        master = self.buffer("master", (hi - lo) * FP32_BYTES).view(torch.float32)
        join_master(high.contiguous(), low.contiguous(), master)
        return master

    def store_master_range(self, u: UnitState, master: torch.Tensor, start: int, high: torch.Tensor) -> None:
        """From ``master`` (fp32, elements [start, start + n) of u's trainable prefix) fill
        ``high``, the compute copy's values of those elements (the master itself, or its
        rounding: [Note: split master]), and write the master's home where it is kept apart
        from the compute copy (the elements of this rank's shard among them)."""
        layout, s = self._layout, u.shard
        n = master.numel()
        a, b = max(start, s.lo), min(start + n, s.hi)
        if layout.split_master:
            low = self.buffer("low", n * 2).view(torch.int16)
            split_master(master.contiguous(), high, low)
            if a < b:
                self.store_range(u.master_home, a - s.lo, low[a - start:b - start], "bounce")
            return
        high.copy_(master)
        if not layout.merged and a < b:
            self.store_range(u.master_home, a - s.lo, master[a - start:b - start], "bounce")

    def round_master(self, master: torch.Tensor) -> torch.Tensor:
        """The compute copy's values of fp32 ``master`` (a new tensor), as
        ``store_master_range`` derives them: the master itself (fp32), rounded to nearest
        even (bf16, fp16, as the Adam kernel narrows), or split's high halves ([Note: split
        master]: ties rounded away from zero)."""
        dtype = self._layout.compute_dtype
        if not self._layout.split_master:
            return master.to(dtype, copy=True)
        high = torch.empty(master.numel(), dtype=dtype)
        split_master(master.contiguous(), high, torch.empty(master.numel(), dtype=torch.int16))
        return high

    def forget_contents(self, u: UnitState) -> None:
        """u's own homes (compute copy, master, moments) are about to be written whole (a
        checkpoint load): their swap checksums are dropped, the pages unknown until written,
        so that the edge pages a piece's write reads back are not checked against bytes the
        load replaces anyway ([Note: swap checksums]). A page changed outside the run then
        no longer stops the load that is its documented recovery."""
        sums = None if self._nvme is None else self._nvme.checksums
        if sums is None:
            return
        for home in (u.compute_home, u.master_home, u.moments_home, u.compact_home):
            if isinstance(home, PackedHome):
                home = home.home
            if home is not None and on_nvme(home):
                sums.forget(home.path, home.offset, home.nbytes)

    def zero_master_padding(self, u: UnitState) -> None:
        """Zero the master's home past this rank's shard, to the end of its last page (as
        ``store_master`` writes it)."""
        layout, s = self._layout, u.shard
        if layout.merged or not u.trainable:
            return
        end, dtype = (low_numel(s.numel), torch.int16) if layout.split_master else (s.state_numel, torch.float32)
        if end > s.numel:
            self.store_range(u.master_home, s.numel, torch.zeros(end - s.numel, dtype=dtype), "bounce")

    def store_compute_range(self, u: UnitState, start: int, compute: torch.Tensor) -> None:
        """Overwrite elements [start, start + n) of u's compute copy at home from ``compute``,
        and, past the frozen start, the same elements of its spare copy (see
        ``store_compute``)."""
        self.store_range(u.compute_home, start, compute, "bounce")
        frozen_start = u.spec.frozen_start
        if u.spare is None or frozen_start >= u.spec.total_numel:
            return
        a = max(start, frozen_start)
        if a < start + compute.numel():
            self.store_range(u.spare.compute_home, a, compute[a - start:], "bounce")

    def unit_values(self, u: UnitState, dirty: Dict[str, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """u's current values, {element offset: tensor shaped as its parameter}: the fp32
        master for trainable parameters, else the compute copy. ``dirty``: u's states held
        in host RAM after a failed swap write ([Note: swap I/O failures]), which are current.
        [zero] A collective at stage 3 or with sharded states: every rank calls it."""
        if self._layout.param_tier == "device":
            compute = self._device.view(u.device_offset, u.compute_numel).to("cpu")
        elif u.param_shard is not None:  # [zero] stage 3: a collective
            dtype = torch.float32 if self._layout.merged else self._layout.compute_dtype
            own = self.load(u.compute_home, compute_home_numel(u.compute_numel, u.param_shard), dtype)
            compute = torch.empty(u.compute_numel, dtype=dtype)
            self._partition.gather_params(u, own, compute, lane="main")
        else:
            dtype = torch.float32 if self._layout.merged else self._layout.compute_dtype
            compute = self.load(u.compute_home, u.compute_numel, dtype)
        master = compute
        if "master" in dirty:
            master = dirty["master"]  # [Note: swap I/O failures]
        elif u.trainable and not self._layout.merged:
            master = self.read_master(u, compute)
            if self._partition is not None and self._partition.shards_state:  # [zero] collective
                master = self._partition.all_gather_shards(u, master, in_full_coordinates=False).clone()
        out = {}
        for e in u.spec.entries:
            source = master if e.trainable else compute
            out[e.offset] = source[e.offset:e.offset + e.numel].view(e.shape)
        return out

    def parameter_bytes(self) -> int:
        """Compute copies at home on this rank ([zero] its chunks at stage 3; param_tier
        'device': the device slots)."""
        if self._layout.param_tier == "device":
            return sum(u.compute_numel for u in self._units) * self._layout.compute_element_bytes
        return sum(self._home_bytes(u.compute_home) for u in self._units)

    @staticmethod
    def _home_bytes(home: Any) -> int:
        if isinstance(home, PackedHome):
            home = home.home
        if isinstance(home, torch.Tensor):
            return home.numel() * home.element_size()
        return 0 if home is None else home.nbytes

    def optimizer_state_bytes(self) -> int:
        """fp32 master weights held apart from the compute copy, plus Adam moments."""
        return sum(self._home_bytes(home) for u in self._units
                   for home in (u.master_home, u.moments_home, u.compact_home))
