"""The one budget arithmetic: the device arena, what the host and the swap files hold for a
run, and the shape of a staging slot. Wrap checks its budgets with it before anything is
allocated; ``offload plan`` and tools/bench_train.py call it on models they never wrap.

Everything here is a pure function of per-unit sizes (``UnitSizes``, in elements, padded to
whole pages as the buffers are) and the run's ``Layout``. A budget that is too small is a
ValueError naming ``device_budget`` or ``host_budget`` and the bytes needed. A host budget
below the step's gradients is met by spilling them to NVMe when the run can
(``gradient_spill``, [Note: gradient spill] in optim/gradients.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload import units as unit_split
from offload.config import format_size
from offload.memory.compact_codec import compact_home_layout, compact_padded_numel, compact_piece_bytes, compact_piece_numel
from offload.memory.layout import ACTIVATION_PIECE_BYTES, DTYPE_NAMES, FP32_BYTES, Layout, UnitState
from offload.units import PAGE_BYTES, padded_numel, round_up, split_into_units
from offload.zero import ParamShard


def low_numel(shard_numel: int) -> int:
    """[Note: split master] Low halves of a master at home: one per element of its trainable
    prefix ([zero] of this rank's shard, ``shard_numel`` elements), padded to whole pages as
    a 16-bit prefix is."""
    return padded_numel(shard_numel, 2)


def compute_home_numel(compute_numel: int, param_shard: Optional[ParamShard]) -> int:
    """Elements of a unit's compute copy at home: [zero] the rank's chunks at stage 3."""
    return param_shard.home_numel if param_shard is not None else compute_numel


@dataclass(frozen=True)
class UnitSizes:
    """What the arithmetic needs of one unit, in elements."""

    name: str
    compute_numel: int          # the compute copy on the device
    master_numel: int           # the fp32 master of the trainable prefix
    home_numel: int             # the compute copy at home ([zero] the rank's chunks at stage 3)
    state_numel: int            # the master and each moment at home ([zero] the rank's shard)
    low_numel: int              # [Note: split master] the master's low halves at home
    grad_numel: int             # the fp32 gradient buffer
    largest_param_numel: int    # its largest trainable parameter (0: none)
    trainable: bool             # it has trainable parameters
    shared_numel: int = 0       # of trainable parameters held by several module attributes (tied)
    state_slots: int = 2        # fp32 optimizer state tensors per element (Adam's two moments)
    whole_step: bool = False    # updated as one piece ([Note: whole-parameter optimizers])
    compact_numel: int = 0      # [Note: compact optimizer states] trainable elements, each parameter padded to blocks
    bucket_numel: int = 0       # [zero] stage >= 2: its fp32 gradient bucket on the device (0: none)
    reduce_out_numel: int = 0   # [zero] stage >= 2: its shard of the bucket, the reduce-scatter's output (fp32)
    # [Note: per-entry state slots] fp32 elements of the moments home where its parameters keep
    # different slots (None: state_slots whole slots), and the most of them one piece of the
    # staged step moves (StateSlots.largest_piece_numel at units.OPTIMIZER_PIECE_NUMEL)
    moments_numel: Optional[int] = None
    moments_piece_numel: Optional[int] = None

    @property
    def moments_home_numel(self) -> int:
        """fp32 elements of the unit's moments home (one copy)."""
        return self.state_slots * self.state_numel if self.moments_numel is None else self.moments_numel

    @property
    def staged_moments_numel(self) -> int:
        """fp32 moments elements the largest piece of its staged step moves through a staging
        slot: ``state_slots`` per element of the piece, or with per-entry slots the piece's
        spans of them ([Note: per-entry state slots])."""
        if self.moments_piece_numel is not None:
            return self.moments_piece_numel
        piece = self.master_numel if self.whole_step else min(self.master_numel, unit_split.OPTIMIZER_PIECE_NUMEL)
        return self.state_slots * piece

    @classmethod
    def of(cls, u: UnitState) -> "UnitSizes":
        """The sizes of a unit of a wrap ([zero] as its partition has cut it)."""
        return cls(u.name, u.compute_numel, u.master_numel,
                   compute_home_numel(u.compute_numel, u.param_shard), u.shard.state_numel,
                   low_numel(u.shard.numel), u.grad_numel,
                   max((e.numel for e in u.trainable), default=0), bool(u.trainable),
                   u.spec.shared_numel, u.state_slots, u.whole_step,
                   compact_padded_numel([e.numel for e in u.trainable]), u.bucket_numel,
                   u.shard.shard_numel if u.bucket_numel else 0,
                   None if u.state_pages is None else u.state_pages.numel,
                   None if u.state_pages is None else
                   u.state_pages.largest_piece_numel(unit_split.OPTIMIZER_PIECE_NUMEL, u.whole_step))

    @classmethod
    def unsharded(cls, name: str, total_numel: int, trainable_numel: int, largest_param_numel: int,
                  compute_element_bytes: int, shared_numel: int = 0,
                  compact_numel: Optional[int] = None) -> "UnitSizes":
        """The sizes of a unit of one process (as ``of`` gives them with no ZeRO partition);
        ``compact_numel``: compact_padded_numel of its trainable parameters (None, their
        sizes unknown: the trainable elements as one parameter, the fewest blocks)."""
        compute_numel = padded_numel(total_numel, compute_element_bytes)
        master_numel = padded_numel(trainable_numel, FP32_BYTES)
        if compact_numel is None:
            compact_numel = compact_padded_numel([trainable_numel])
        return cls(name, compute_numel, master_numel, compute_numel, master_numel,
                   low_numel(trainable_numel), trainable_numel, largest_param_numel,
                   trainable_numel > 0, shared_numel, compact_numel=compact_numel)


def model_unit_sizes(model: nn.Module, compute_element_bytes: int, unit_classes: Sequence[str] = (),
                     unit_predicate: Optional[Callable[[str, nn.Module], bool]] = None) -> List[UnitSizes]:
    """The units of ``model`` (meta or real) as wrap cuts them on one process, root first,
    every parameter that requires a gradient trainable; the model is not changed."""
    group_of = {p: 0 for p in model.parameters() if p.requires_grad}
    specs = split_into_units(model, group_of, compute_element_bytes, unit_classes, unit_predicate)
    return [UnitSizes.unsharded(s.name, s.total_numel, s.trainable_numel,
                                max((e.numel for e in s.trainable_entries), default=0),
                                compute_element_bytes, s.shared_numel,
                                compact_padded_numel([e.numel for e in s.trainable_entries]))
            for s in specs]


# ---------------------------------------------------------------------------- device
@dataclass(frozen=True)
class DeviceBudget:
    capacity_numel: int   # the arena, in elements of the compute dtype
    budget_bytes: int     # device_budget, or all the units and a gradient when it is None
    minimum_bytes: int    # the smallest device_budget wrap accepts
    bucket_room_bytes: int = 0  # [Note: gradient buckets in the device budget]


def _gradient_reserve_bytes(units: Sequence[UnitSizes], compute_element_bytes: int) -> int:
    """Room for the largest gradient on its way out of the device, and [zero] for the
    gradient buckets ([Note: gradient buckets in the device budget]): both are outside
    the arena."""
    largest = max((u.largest_param_numel for u in units), default=0) * compute_element_bytes
    return largest + gradient_bucket_room_bytes(units)


# [Note: gradient buckets in the device budget] [zero] At stage >= 2 a unit's gradients are
# summed into an fp32 bucket on the device until its reduce-scatter ([Note: collectives on
# the device] in zero/partition.py), whose output, the rank's shard, is on the device too
# until its copy to the host has run. device_budget keeps room for them beside the arena
# and the largest gradient: two buckets, the root unit's (its gradients arrive first and
# last in backward: the head's, then the embeddings') and the largest other unit's (the
# blocks' arrive one unit after another, each bucket reused by the next unit of its size),
# and one output as long as the largest unit's shard (``Partition._reduce_output``: every
# reduce-scatter writes into it, after the copy out of what it held last has run). The
# device tier counts them all (``DeviceTier.hold_buckets``); with a device_budget given
# the partition keeps them within that room (``Partition._hold_on_device``): spare buckets
# go first; a backward that needs more at once (a unit whose gradients are still arriving
# while two others' are: a parameter of a block used early and late, or not at all) holds
# the excess in the arena's free capacity, as saved activations do (a slot is refused
# while they hold it), and where that is short too it stops with a ValueError naming
# device_budget and the bytes to add, not past the budget. Without device_budget they are
# counted and bound nothing. ``offload plan --ranks`` counts the room. Not counted: what a
# backend allocates inside a collective (gloo's reduce-scatter on a CPU device works on a
# copy of the bucket for the call's duration; NCCL's works in place).
def gradient_bucket_room_bytes(units: Sequence[UnitSizes]) -> int:
    """[Note: gradient buckets in the device budget] The root unit's bucket, the largest
    other unit's and the reduce-scatter's output (the largest unit's shard), in bytes (0
    below stage 2 and on one process)."""
    if not units:
        return 0
    largest = max((u.bucket_numel for u in units[1:]), default=0)
    output = max(u.reduce_out_numel for u in units)
    return (units[0].bucket_numel + largest + output) * FP32_BYTES


def _device_need(units: Sequence[UnitSizes], param_tier: str,
                 compute_element_bytes: int) -> Tuple[int, str]:
    """The smallest device budget, and why (for the error), of ``units``, root first."""
    largest = max(units[1:], key=lambda u: u.compute_numel, default=None)
    grad_reserve = _gradient_reserve_bytes(units, compute_element_bytes)
    root_bytes = units[0].compute_numel * compute_element_bytes
    total_bytes = sum(u.compute_numel for u in units) * compute_element_bytes
    if param_tier == "device":
        return (total_bytes + grad_reserve,
                f"param_tier='device' keeps all {len(units)} units there ({format_size(total_bytes)})")
    largest_bytes = largest.compute_numel * compute_element_bytes if largest else 0
    why = (f"unit {largest.name!r} needs {format_size(largest_bytes)} for its compute copy, "
           if largest else "") + \
        f"the root unit (on the device from forward to backward) {format_size(root_bytes)}"
    return root_bytes + largest_bytes + grad_reserve, why


def minimum_device_budget(units: Sequence[UnitSizes], param_tier: str, compute_element_bytes: int) -> int:
    """The smallest ``device_budget`` wrap accepts for ``units`` (root first, e.g. from
    ``model_unit_sizes``): every unit with param_tier="device", else the root unit (on the
    device from forward to backward) and the largest other unit; plus the largest gradient
    on its way out and [zero] the gradient buckets' room ([Note: gradient buckets in the
    device budget]). One byte less is a ValueError naming device_budget."""
    return _device_need(units, param_tier, compute_element_bytes)[0]


def check_device_budget(units: Sequence[UnitSizes], layout: Layout) -> DeviceBudget:
    """The arena and budget of a run, or a ValueError naming device_budget and the bytes
    needed."""
    element_bytes = layout.compute_element_bytes
    needed, why = _device_need(units, layout.param_tier, element_bytes)
    grad_reserve = _gradient_reserve_bytes(units, element_bytes)
    buckets = gradient_bucket_room_bytes(units)
    budget = layout.device_budget
    if budget is None:
        budget = sum(u.compute_numel for u in units) * element_bytes + grad_reserve
    if budget < needed:
        raise ValueError(
            f"device_budget: {format_size(budget)} ({budget} bytes) is too small: {why}, plus "
            f"{format_size(grad_reserve - buckets)} for the largest gradient on its way out"
            + (f" and {format_size(buckets)} for the gradient buckets of the reduce-scatters (the root unit's and "
               "the largest other unit's, fp32) and their output (the largest unit's shard)" if buckets else "")
            + f"; at least {needed} bytes ({format_size(needed)}) are needed")
    return DeviceBudget((budget - grad_reserve) // element_bytes, budget, needed, buckets)


def activation_room_bytes(units: Sequence[UnitSizes], layout: Layout, arena: DeviceBudget) -> Optional[int]:
    """[Note: saved activations] What activation_offload="auto" lets the activations kept on
    the device hold: the arena less the compute copies the budget check above guarantees
    room for (every unit with param_tier="device", else the root unit and the largest
    other). None with no device_budget: nothing bounds them."""
    if layout.device_budget is None:
        return None
    element_bytes = layout.compute_element_bytes
    guaranteed_slot_bytes = arena.minimum_bytes - _gradient_reserve_bytes(units, element_bytes)
    return arena.capacity_numel * element_bytes - guaranteed_slot_bytes


# [Note: activation host room] host_budget bounds the engine's own host needs (homes,
# staging, gradients: ``host_bytes``) and the saved activations' host buffers ([Note: saved
# activations] in memory/activations.py) together. The engine's needs are planned at wrap,
# the activations only seen in forward, so the two share the budget by one rule:
# ``Layout.activation_host_bytes`` (the config's activation_host_bytes, else 0) is the
# activations'; the engine's needs fit in the rest (``Layout.state_host_budget``: checked by
# check_host_budget, met by spilling gradients in gradient_spill, and filled by "auto"
# placement, placement.place_units); the activations may hold whatever the rest leaves
# (``activation_host_room_bytes``), at least their share. So "auto" placement never takes
# the activations' share, and the two never pass host_budget. ``offload plan --seq-len``
# (plan_activations.activation_host_share) gives the share one forward needs. With no share
# set, the first forward whose activations go on to NVMe for want of that room warns once,
# naming activation_host_bytes (ActivationStore, ``warn_room_spill``). Where the activations
# may reach NVMe (a swap_dir, a host budget), the share is at least
# ``layout.ACTIVATION_PIECE_BYTES`` even when none is set: a group larger than the room goes
# to NVMe in pieces through it ([Note: activation pieces] in memory/activations.py), so the
# room must hold a piece whatever placement takes; wrap refuses a host_budget below the
# engine's least needs plus that floor, naming host_budget and the bytes.
def activation_host_room_bytes(layout: Layout, planned_host_bytes: int) -> Optional[int]:
    """[Note: activation host room] What the saved activations' host buffers may hold: the
    host budget less what wrap planned (``check_host_budget(...).total``), at least
    ``layout.activation_host_bytes`` (where gradients spill their allowance takes the rest
    of the engine's share, and the activations get theirs). None with no host budget."""
    if layout.host_budget is None:
        return None
    return layout.host_budget - min(planned_host_bytes, layout.state_host_budget)


def check_gathered_fits(root_numel: int, wanted: Sequence[Tuple[str, int]], element_bytes: int,
                        capacity_numel: int, budget_bytes: int) -> None:
    """[Note: gathered parameters] A ValueError naming device_budget and the bytes needed
    unless the compute copies of ``wanted`` ((name, numel) of units other than the root)
    fit in the device arena (``capacity_numel`` elements) at once, beside the root unit's
    slot (``root_numel``; 0 when the root is not kept there)."""
    needed_numel = root_numel + sum(numel for _, numel in wanted)
    if needed_numel <= capacity_numel:
        return
    reserve = budget_bytes - capacity_numel * element_bytes
    needed = needed_numel * element_bytes + reserve
    raise ValueError(
        f"engine.gathered(): device_budget {format_size(budget_bytes)} ({budget_bytes} bytes) cannot hold the "
        f"{len(wanted)} unit(s) asked for at once ({', '.join(name for name, _ in wanted[:4])}"
        f"{', ...' if len(wanted) > 4 else ''}): their compute copies take "
        f"{format_size(needed_numel * element_bytes - root_numel * element_bytes)}, beside the root unit's "
        f"{format_size(root_numel * element_bytes)} and the {format_size(reserve)} kept for gradients on their way out; "
        f"{needed} bytes ({format_size(needed)}) are needed. Gather fewer parameters at a time (one module "
        "after another) or raise device_budget")


@dataclass(frozen=True)
class PrefetchRoom:
    """[Note: prefetch room] What the device arena leaves the prefetcher."""

    units_ahead: int    # typical units on their way while one is in use beside the root
    unit_bytes: int     # a typical unit's compute copy (the median of the fetched units)
    root_bytes: int     # the root unit's compute copy, on the device from forward to backward
    reserve_bytes: int  # kept for gradients on their way out, [zero] buckets included (not in the arena)

    def budget_for(self, units_ahead: int) -> int:
        """The smallest device_budget with room for ``units_ahead`` typical units ahead."""
        return self.reserve_bytes + self.root_bytes + (units_ahead + 1) * self.unit_bytes

    def warning(self, budget_bytes: int, prefetch_units: int) -> str:
        """What wrap warns when nothing can be fetched ahead (``units_ahead`` 0)."""
        return (f"offload: device_budget {format_size(budget_bytes)} leaves no room to fetch a unit ahead of "
                f"the one in use (the root unit takes {format_size(self.root_bytes)} from forward to backward, "
                f"a unit {format_size(self.unit_bytes)}, and {format_size(self.reserve_bytes)} is kept for the "
                "gradients on their way out): every use of a unit waits for its whole transfer. "
                f"device_budget {format_size(self.budget_for(prefetch_units))} "
                f"({self.budget_for(prefetch_units)} bytes) lets the prefetcher keep {prefetch_units} "
                f"unit{'s' if prefetch_units > 1 else ''} ahead (prefetch_units={prefetch_units}); "
                "prefetch=False silences this")


def prefetch_room(units: Sequence[UnitSizes], layout: Layout, arena: DeviceBudget) -> Optional[PrefetchRoom]:
    """[Note: prefetch room] The prefetcher brings compute copies into the device arena,
    beside the root unit (there from forward to backward) and the unit in use; the largest
    gradient's reserve is not part of the arena. At the smallest budget wrap accepts the
    arena holds exactly the root and the largest unit, so nothing is fetched ahead: every
    use waits for its whole transfer. With room for two blocks ahead a fetch has a whole
    unit's use to arrive in, and the deferred updates write the next forward's copies into
    their slots, which saves reading them; with one, fetches arrive late. Counted in units
    of the median size of those fetched (transformer blocks are all alike), ``units_ahead``
    is how many fit on their way while one is in use. None when nothing is fetched: every
    compute copy on the device, or fewer than two units besides the root."""
    element_bytes = layout.compute_element_bytes
    fetched = [i for i in range(1, len(units)) if layout.compute_tier(i) != "device"]
    return _room(units, fetched, element_bytes, arena.capacity_numel * element_bytes)


def floor_prefetch_room(units: Sequence[UnitSizes], compute_element_bytes: int,
                        floor_bytes: int) -> Optional[PrefetchRoom]:
    """[Note: prefetch room] The room at ``floor_bytes``, the smallest device budget of a run
    that fetches every unit (``minimum_device_budget(units, "nvme", ...)``, which the caller
    has), for ``offload plan``."""
    arena = floor_bytes - _gradient_reserve_bytes(units, compute_element_bytes)
    return _room(units, range(1, len(units)), compute_element_bytes, arena)


def _room(units: Sequence[UnitSizes], fetched: Sequence[int], element_bytes: int,
          arena_bytes: int) -> Optional[PrefetchRoom]:
    sizes = sorted(units[i].compute_numel * element_bytes for i in fetched)
    if len(sizes) < 2:
        return None
    typical = sizes[len(sizes) // 2]
    root = units[0].compute_numel * element_bytes
    free = arena_bytes - root - typical
    return PrefetchRoom(max(0, free // typical), typical, root, _gradient_reserve_bytes(units, element_bytes))


# ---------------------------------------------------------------------------- homes
@dataclass(frozen=True)
class HomeBytes:
    """One unit's bytes at home, on whichever tiers ``Layout`` gives its roles."""

    compute: int   # the compute copy (the master too when merged), if it is not on the device
    master: int    # the fp32 master apart from the compute copy (split: its low halves; compact: int8 low parts)
    moments: int   # exp_avg and exp_avg_sq (an elementwise optimizer's state_slots tensors; compact: codes, scales)


def unit_home_bytes(u: UnitSizes, layout: Layout, index: int) -> HomeBytes:
    """The homes of u (unit ``index``), spare homes included ([Note: speculative updates],
    [Note: delayed updates]: ``Layout.has_spare``; a delayed update's spare homes are a
    second compute copy only, ``Layout.spare_states``)."""
    copies, state_copies = layout.home_copies(index, u.trainable)
    compute = copies * u.home_numel * (FP32_BYTES if layout.merged else layout.compute_element_bytes)
    if not u.trainable:
        return HomeBytes(compute, 0, 0)
    if layout.compact_states:  # [Note: compact optimizer states] the high part is the compute copy
        low = u.compact_numel  # int8
        return HomeBytes(compute, state_copies * low,
                         state_copies * (compact_home_bytes(u, layout.state_tier(index)) - low))
    master = u.low_numel * 2 if layout.split_master else 0 if layout.merged else u.state_numel * FP32_BYTES
    return HomeBytes(compute, state_copies * master, state_copies * u.moments_home_numel * FP32_BYTES)


def compact_home_bytes(u: UnitSizes, tier: str) -> int:
    """[Note: compact optimizer states] Bytes of u's compact home on ``tier``: its
    compact_home_layout (compact_state_bytes, or each array on whole pages: [Note: compact
    pieces]), whole pages on NVMe (a swap extent)."""
    nbytes = compact_home_layout(u.compact_numel).nbytes
    return round_up(nbytes, PAGE_BYTES) if tier == "nvme" else nbytes


def compact_num_pieces(u: UnitSizes) -> int:
    """[Note: compact pieces] The pieces of u's compact step (compact_pieces: one for a home
    of at most compact_piece_numel elements)."""
    size = compact_piece_numel(unit_split.OPTIMIZER_PIECE_NUMEL)
    return max(1, -(-u.compact_numel // size))


# ---------------------------------------------------------------------------- NVMe
def swap_bytes(units: Sequence[UnitSizes], layout: Layout) -> int:
    """Swap bytes a run holds (0 with no tier on NVMe)."""
    total = 0
    for i, u in enumerate(units):
        home = unit_home_bytes(u, layout, i)
        if layout.compute_tier(i) == "nvme":  # [Note: placement by budget] per unit
            total += home.compute
        if layout.state_tier(i) == "nvme":
            total += home.master + home.moments
    spill = gradient_spill(units, layout)
    if spill is not None:  # [Note: gradient spill] one gradient extent per trainable unit
        total += sum(unit_gradient_bytes(u, layout) for u in units if u.trainable)
    return total


# ---------------------------------------------------------------------------- host
@dataclass(frozen=True)
class SlotShape:
    """Elements of one staging slot's buffers: one pipeline piece."""

    master_numel: int
    compute_numel: int    # 0: the slot has no compute buffer
    low_numel: int        # [Note: split master] 0 without a split master
    compact_bytes: int = 0  # [Note: compact optimizer states] the largest NVMe-homed compact home
    moments_numel: int = 0  # fp32 state slots of the largest piece of an NVMe-homed moments home

    def num_bytes(self, compute_element_bytes: int) -> int:
        return (self.master_numel + self.moments_numel) * FP32_BYTES + self.compute_numel * compute_element_bytes + \
            self.low_numel * 2 + self.compact_bytes


def slot_shape(units: Sequence[UnitSizes], layout: Layout) -> SlotShape:
    if layout.compact_states:
        return _compact_slot_shape(units, layout)
    master = min(max((u.master_numel for u in units), default=0), unit_split.OPTIMIZER_PIECE_NUMEL)
    # [Note: whole-parameter optimizers] such a unit's update is one piece, whatever its size
    master = max([master] + [u.master_numel for u in units if u.whole_step])
    # the state slots a piece reads and writes through the slot: those of NVMe-homed moments
    # (host-homed ones are updated at home), each unit's own ([Note: per-entry state slots])
    moments = max((u.staged_moments_numel for i, u in enumerate(units)
                   if u.trainable and layout.state_tier(i) == "nvme"), default=0)
    any_compute_on_nvme = any(layout.compute_tier(i) == "nvme" for i in range(len(units)))
    needs_compute = any_compute_on_nvme and not layout.merged or \
        (layout.param_tier == "device" and not layout.device_is_host and layout.compute_dtype != torch.float32)
    # a 16-bit compute prefix is padded to 2048 elements, the fp32 master to 1024
    compute = master + 2048 if needs_compute else 0
    # [Note: split master] low halves: a piece, padded as a 16-bit prefix is
    low = master + 2048 if layout.split_master else 0
    return SlotShape(master, compute, low, moments_numel=moments)


def _compact_slot_shape(units: Sequence[UnitSizes], layout: Layout) -> SlotShape:
    """[Note: compact pieces] A compact unit's update runs over pieces of
    compact_piece_numel compact elements: a slot holds the largest piece of an NVMe-homed
    compact home (a home of one piece whole), and where compute copies are on NVMe the
    largest piece's high parts: the trainable prefix of a one-piece unit, padded as a
    16-bit prefix is, else a piece's elements, whole pages, and the page after them. No
    fp32 buffers."""
    size = compact_piece_numel(unit_split.OPTIMIZER_PIECE_NUMEL)
    trainable = [i for i, u in enumerate(units) if u.trainable]
    compact = max((min(compact_home_bytes(units[i], "nvme"), compact_piece_bytes(size))
                   for i in trainable if layout.state_tier(i) == "nvme"), default=0)
    page = PAGE_BYTES // layout.compute_element_bytes
    compute = max((min(units[i].low_numel, size + page) for i in trainable if layout.compute_tier(i) == "nvme"),
                  default=0)
    return SlotShape(0, compute, 0, compact)


def update_buffer_bytes(units: Sequence[UnitSizes], layout: Layout) -> Dict[str, int]:
    """[zero] Stage >= 1 with states on NVMe: bytes of the host buffer each NVMe-homed
    state is read into for an update, per role (one of the two buffer sets of the sharded
    update): a piece at stage 3, the largest unit's shard (and, for the compute copy, the
    whole unit) at stages 1-2."""
    # With a tier on NVMe, the sharded update is the one that runs without staging slots
    # (Layout.staged_step); with none, no state is NVMe-homed.
    if not layout.needs_nvme or layout.staged_step:
        return {}
    sizes = {}
    largest = max((u.state_numel for u in units if u.trainable), default=0)
    if layout.gathers:
        largest = min(largest, unit_split.OPTIMIZER_PIECE_NUMEL)
    # per unit where "auto" placed them ([Note: placement by budget])
    indices = range(len(units))
    if any(layout.compute_tier(i) == "nvme" for i in indices) and (layout.merged or layout.compute_dtype != torch.float32):
        home_element_bytes = FP32_BYTES if layout.merged else layout.compute_element_bytes
        compute = largest if layout.gathers else max(u.compute_numel for u in units)
        sizes["compute"] = home_element_bytes * compute
    if any(layout.state_tier(i) == "nvme" for i in indices):
        if not layout.merged:  # split: where the master is joined, updated and split again
            sizes["master"] = largest * FP32_BYTES
        if layout.split_master:
            sizes["low"] = (largest + 2048) * 2
        sizes["exp_avg"] = sizes["exp_avg_sq"] = largest * FP32_BYTES
    return sizes


@dataclass(frozen=True)
class HostBytes:
    """Bytes a run holds on the host, by part."""

    gradients: int
    compute_copies: int
    master_weights: int
    moments: int
    optimizer_staging: int   # staging slots, or [zero] the sharded update's two buffer sets
    fetch_staging: int       # see the fetch buffers the engine makes
    squares_scratch: int = 0  # [Note: gradient squares] 16-bit gradients widened chunk by chunk

    @property
    def total(self) -> int:
        return sum(self.parts().values())

    def parts(self) -> Dict[str, int]:
        """By part, named as host_budget's error names them."""
        return {"gradients": self.gradients, "compute copies": self.compute_copies,
                "fp32 master weights": self.master_weights, "Adam moments": self.moments,
                "optimizer staging buffers": self.optimizer_staging,
                "fetch staging buffers": self.fetch_staging,
                "gradient norm scratch": self.squares_scratch}


def host_bytes(units: Sequence[UnitSizes], layout: Layout) -> HostBytes:
    grads = sum(u.grad_numel for u in units if u.trainable) * layout.grad_element_bytes
    compute = master = moments = staging = 0
    home_element_bytes = FP32_BYTES if layout.merged else layout.compute_element_bytes
    for i, u in enumerate(units):
        home = unit_home_bytes(u, layout, i)
        if layout.compute_tier(i) == "host":  # [Note: placement by budget] per unit
            compute += home.compute
        if layout.state_tier(i) == "host":
            master += home.master
            moments += home.moments
    if layout.staged_step:
        staging = layout.optimizer_pipeline_depth * slot_shape(units, layout).num_bytes(layout.compute_element_bytes)
    staging += 2 * sum(update_buffer_bytes(units, layout).values())  # two buffer sets
    fetch = sum(fetch_buffer_numels(units, layout)) * home_element_bytes
    return HostBytes(grads, compute, master, moments, staging, fetch, squares_scratch_bytes(units, layout))


def fetch_buffer_numels(units: Sequence[UnitSizes], layout: Layout) -> Tuple[int, ...]:
    """Elements (of ``layout.home_dtype``) of each host buffer the device residency reads
    compute copies from NVMe into on their way to the device: the buffers
    ``DeviceResidency`` allocates at wrap and ``host_bytes`` counts ("fetch staging
    buffers"). None where no compute copy is on NVMe, nor on a device the host addresses
    (a CPU device as users run it: reads land in the slot itself). [zero] Stage 3: one
    buffer of the rank's chunks (gathered on the device); else ``prefetch_units + 1``
    buffers of the largest unit, used in turn ([Note: streams])."""
    if not any(layout.compute_tier(i) == "nvme" for i in range(len(units))):
        return ()
    if layout.gathers:
        return (max(u.home_numel for u in units),)
    if layout.device_is_host:
        return ()
    return (max(u.compute_numel for u in units),) * (layout.prefetch_units + 1)


# [Note: gradient squares] (optim/squares.py) a gradient's squares are summed over chunks
# of this many elements, a 16-bit one widened into an fp32 scratch of one chunk, one per
# thread that takes squares: the main thread (spills, step()) and the optimizer worker
# (early updates)
SQUARES_CHUNK_NUMEL = 1 << 22
SQUARES_THREADS = 2


def squares_scratch_numel(units: Sequence[UnitSizes], layout: Layout) -> int:
    """[Note: gradient squares] Elements of one thread's fp32 scratch: a chunk, or the
    largest unit's gradients when less; 0 where gradients are held in fp32."""
    if layout.grad_dtype == torch.float32:
        return 0
    return min(SQUARES_CHUNK_NUMEL, max((u.grad_numel for u in units if u.trainable), default=0))


def squares_scratch_bytes(units: Sequence[UnitSizes], layout: Layout) -> int:
    return SQUARES_THREADS * squares_scratch_numel(units, layout) * FP32_BYTES


def unit_gradient_bytes(u: UnitSizes, layout: Layout) -> int:
    """A unit's gradients as one flat buffer of ``layout.grad_dtype`` ([Note: 16-bit
    gradients]), padded to whole pages (its gradient extent on NVMe, the spill's bounce
    buffer, a read-back buffer)."""
    return padded_numel(u.grad_numel, layout.grad_element_bytes) * layout.grad_element_bytes


@dataclass(frozen=True)
class GradientSpill:
    """[Note: gradient spill] How much of the step's gradients may stay in host RAM."""

    allowance_bytes: int   # gradients held in RAM before units are spilled
    bounce_bytes: int      # the one buffer a unit's gradients are written from


def _can_spill(layout: Layout) -> bool:
    # adopted gradients only: [zero] several ranks and CUDA keep flat pooled buffers
    return layout.adopts_grads and layout.device_is_host


# [Note: gradient spill] A unit's gradients are written from a bounce buffer of two pieces
# of this many bytes (filled and written in turn), not of the largest unit: a tied
# embedding's 1.6 GB gradient would otherwise keep 1.6 GB of the budget for itself.
SPILL_PIECE_BYTES = 16 << 20


def held_shared_bytes(units: Sequence[UnitSizes], layout: Layout) -> int:
    """[Note: shared parameter gradients] RAM the first use's gradient of each tied
    parameter holds through backward (in the compute dtype), where the engine holds it."""
    if not layout.adopts_grads:
        return 0
    return sum(u.shared_numel for u in units) * layout.compute_element_bytes


def _spill_floor(units: Sequence[UnitSizes], layout: Layout) -> Tuple[int, int, int]:
    """(bounce buffer, the room of the units' gradients beyond the allowance, the tied
    gradients held): what a spilling run keeps in RAM beside the fixed host needs and the
    allowance. The room is the largest unit's gradients, which arrive whole before they can
    be spilled, and once more where an update on the optimizer worker may read a spilled
    unit back while backward hands gradients over (early, speculative or delayed updates):
    the two at once would otherwise take the host tier past host_budget."""
    largest = max((unit_gradient_bytes(u, layout) for u in units if u.trainable), default=0)
    read_back_in_backward = layout.early_allowed or layout.delayed_update
    room = largest * (2 if read_back_in_backward else 1)
    return min(largest, 2 * SPILL_PIECE_BYTES), room, held_shared_bytes(units, layout)


def spill_floor_bytes(units: Sequence[UnitSizes], layout: Layout) -> int:
    """[Note: gradient spill] The gradient bytes a spilling run keeps in RAM at least: the
    bounce buffer, the room of the gradients beyond the allowance and the tied ones held."""
    return sum(_spill_floor(units, layout))


def gradient_spill(units: Sequence[UnitSizes], layout: Layout) -> Optional[GradientSpill]:
    """[Note: gradient spill] None when the host budget holds every gradient of a step (or
    there is none); else the gradient bytes that may stay in RAM, or a ValueError naming
    host_budget and the sizes when even spilling cannot fit the run: the fixed host needs
    plus a bounce buffer, one unit's gradients (the unit backward is producing) and the
    tied gradients held through backward ([Note: shared parameter gradients])."""
    budget = layout.state_host_budget  # [Note: activation host room]
    if budget is None or not _can_spill(layout):
        return None
    planned = host_bytes(units, layout)
    if planned.total <= budget:
        return None
    fixed = planned.total - planned.gradients
    detail = ", ".join(f"{k} {format_size(v)}" for k, v in planned.parts().items() if v and k != "gradients")
    grads = f"{DTYPE_NAMES[layout.grad_dtype]} gradients"
    if not layout.needs_nvme:
        raise ValueError(
            f"host_budget: {_budget_text(layout)} is below the step's {grads} "
            f"({format_size(planned.gradients)}) plus the rest of the host needs ({detail or 'none'}); "
            "gradients beyond the budget are spilled to NVMe, which needs a tier on NVMe "
            "(param_tier or optimizer_tier 'nvme' and swap_dir)")
    bounce, room, held = _spill_floor(units, layout)
    needed = fixed + bounce + room + held
    if budget < needed:
        raise ValueError(
            f"host_budget: {_budget_text(layout)} is too small: this configuration "
            f"holds {detail or 'nothing else'} on the host, plus {format_size(room)} for the gradients of "
            f"the unit backward is producing (and of one an update reads back meanwhile), "
            f"{format_size(bounce)} to spill them to NVMe"
            + (f" and {format_size(held)} for tied parameters' gradients, held through backward" if held else "")
            + f" (of {format_size(planned.gradients)} {grads} in all); at least "
            f"{needed + layout.activation_host_bytes} bytes are needed")
    # The room (_spill_floor) is kept free: a unit's gradient arrives whole from autograd
    # before it can be spilled, and an update may read another back meanwhile, so RAM holds
    # the allowance plus those. The held tied gradients count inside the allowance, which the
    # floor makes at least as large.
    return GradientSpill(budget - fixed - bounce - room, bounce)


def minimum_host_budget(units: Sequence[UnitSizes], layout: Layout) -> int:
    """The smallest ``host_budget`` wrap accepts: every byte of ``host_bytes``, or, where
    gradients can be spilled (a CPU device, one rank, a tier on NVMe), the fixed needs and
    the spill's floor (``_spill_floor``) ([Note: gradient spill]); plus the activations'
    share ([Note: activation host room])."""
    planned = host_bytes(units, layout)
    if not (_can_spill(layout) and layout.needs_nvme):
        return planned.total + layout.activation_host_bytes
    bounce, room, held = _spill_floor(units, layout)
    fixed_and_floor = planned.total - planned.gradients + bounce + room + held
    return min(planned.total, fixed_and_floor) + layout.activation_host_bytes


def _budget_text(layout: Layout) -> str:
    """host_budget for an error, with the activations' share ([Note: activation host room])."""
    budget = layout.host_budget
    text = f"{format_size(budget)} ({budget} bytes)"
    if layout.activation_host_bytes:
        text += f" less {activation_reserve_text(layout)}"
    return text


def activation_reserve_text(layout: Layout) -> str:
    """[Note: activation host room] The host bytes kept for activations, for an error."""
    reserved = layout.activation_host_bytes
    return (f"activation_host_bytes {format_size(reserved)} ({reserved} bytes) kept for activations"
            + (" (the least kept where they may reach NVMe: the room for their pieces)"
               if reserved == ACTIVATION_PIECE_BYTES else ""))


def check_host_budget(units: Sequence[UnitSizes], layout: Layout) -> HostBytes:
    """What a run holds on the host, or a ValueError naming host_budget when that is more
    (gradients beyond the budget spilled to NVMe are not: see ``gradient_spill``)."""
    planned = host_bytes(units, layout)
    budget = layout.state_host_budget  # [Note: activation host room]
    needed = planned.total
    if budget is not None and needed > budget and gradient_spill(units, layout) is None:
        detail = ", ".join(f"{k} {format_size(v)}" for k, v in planned.parts().items() if v)
        raise ValueError(
            f"host_budget: {_budget_text(layout)} is too small: this "
            f"configuration holds {detail} on the host, {needed} bytes in all")
    return planned
