"""[zero] Who keeps what: the pure arithmetic of cutting a unit's flat buffers across ranks.

Every rank holds the same units with the same flat layout (checked at wrap time). The
trainable prefix of a unit, ``T = spec.trainable_numel`` elements, is cut evenly:
``shard_numel = ceil(T / world_size)`` and rank r owns ``[r * shard_numel, (r + 1) *
shard_numel)`` clipped to ``[0, T)`` (the last ranks may own less, or nothing). Collectives
move chunks of ``shard_numel`` elements, zero-padded where a rank owns less.

Nothing here talks to other ranks or touches a tensor: ``UnitShards.of`` says what one
rank keeps of one unit, and the engine copies that into the unit's ``UnitState`` at wrap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from offload._sizes import FP32_BYTES
from offload.units import padded_numel


class StageShards:
    """What a ZeRO stage shards, from ``self.stage``: Partition's, and the planner's stand-in
    of one (plan_ranks.PlannedRanks)."""

    stage: int

    @property
    def shards_state(self) -> bool:
        """Master weights and moments are sharded (stage >= 1)."""
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """The fp32 gradient buffer is shard-sized; reduce-scatter in backward (stage >= 2)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """The compute copy at home is shard-sized; all-gathered on every fetch (stage 3)."""
        return self.stage >= 3


@dataclass(frozen=True)
class ShardRange:
    """The part ``[lo, hi)`` of a unit's trainable prefix whose master weights and moments
    this rank keeps and updates."""

    lo: int
    hi: int
    shard_numel: int   # elements per rank in the collectives (ceil(T / world_size))
    state_numel: int   # length of this rank's master buffer and of each moment buffer

    @staticmethod
    def whole(trainable_numel: int, master_numel: int) -> "ShardRange":
        """Everything: a single process, or stage 0."""
        return ShardRange(0, trainable_numel, trainable_numel, master_numel)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def even_range(trainable_numel: int, rank: int, world_size: int) -> ShardRange:
    shard = -(-trainable_numel // world_size)
    lo = min(rank * shard, trainable_numel)
    hi = min(lo + shard, trainable_numel)
    return ShardRange(lo, hi, shard, padded_numel(shard, FP32_BYTES))


@dataclass(frozen=True)
class ParamShard:
    """[zero] Stage 3: the part of a unit's compute copy a rank keeps at home. Two regions
    of the unit's flat layout are cut evenly across ranks, the trainable prefix ``[0, T)``
    (the cut of ``ShardRange``, so the rank's master and its compute chunk cover the same
    elements) and the frozen tail ``[frozen_start, total)``. The home holds the rank's chunk
    of each, padded to whole pages: ``[trainable chunk | frozen chunk]``.

    A gather writes ``world_size * shard_numel`` elements from a region's start, so the
    device slot (``slot_numel``) is long enough for both gathers in place; the trainable one
    runs first and may spill past ``T`` into the frozen region, which the frozen gather then
    overwrites."""

    trainable: ShardRange
    frozen_start: int
    frozen: ShardRange                # over [0, total - frozen_start)
    trainable_chunk_numel: int        # home elements of each chunk (whole pages)
    frozen_chunk_numel: int
    slot_numel: int                   # device slot elements (whole pages)

    @property
    def home_numel(self) -> int:
        return self.trainable_chunk_numel + self.frozen_chunk_numel

    @staticmethod
    def of(trainable_numel: int, frozen_start: int, total_numel: int, rank: int, world_size: int,
           element_bytes: int) -> "ParamShard":
        t = even_range(trainable_numel, rank, world_size)
        f = even_range(total_numel - frozen_start, rank, world_size)
        reach = max(total_numel, world_size * t.shard_numel,
                    frozen_start + world_size * f.shard_numel if f.shard_numel else 0)
        return ParamShard(t, frozen_start, f, padded_numel(t.shard_numel, element_bytes),
                          padded_numel(f.shard_numel, element_bytes), padded_numel(reach, element_bytes))


@dataclass(frozen=True)
class UnitShards:
    """[zero] Stage >= 1: what one rank keeps of one unit, the values of the UnitState
    fields of the same names (stage 0 keeps everything: the UnitState defaults)."""

    shard: ShardRange                  # the master and moments this rank keeps and updates
    grad_numel: int                    # length of the unit's fp32 gradient buffer
    grad_base: int                     # element of the trainable prefix at grad[0]
    param_shard: Optional[ParamShard]  # stage 3: the rank's chunks of the compute copy
    # stage >= 2: elements of the unit's fp32 gradient bucket on the device, the
    # reduce-scatter's input ([Note: collectives on the device]); 0 below
    bucket_numel: int = 0

    @property
    def compute_numel(self) -> Optional[int]:
        """Stage 3: elements of the unit's device slot (long enough for the gathers in
        place, see ParamShard); None: the whole compute copy, as without ranks."""
        return self.param_shard.slot_numel if self.param_shard is not None else None

    @staticmethod
    def of(trainable_numel: int, frozen_start: int, total_numel: int, rank: int, world_size: int,
           stage: int, home_element_bytes: int) -> Optional["UnitShards"]:
        """What ``rank`` keeps of a unit at ``stage``; None at stage 0 (everything).
        ``home_element_bytes``: the element size of the compute copy's home buffer."""
        if stage == 0:
            return None
        owned = even_range(trainable_numel, rank, world_size)
        if stage == 1:  # the whole reduce-scatter input, as is
            grad_numel, grad_base = owned.shard_numel * world_size, 0
        else:           # stage >= 2: only the rank's part, reduce-scattered in backward
            grad_numel, grad_base = owned.numel, owned.lo
        param_shard = ParamShard.of(trainable_numel, frozen_start, total_numel, rank, world_size,
                                    home_element_bytes) if stage == 3 else None
        bucket_numel = owned.shard_numel * world_size if stage >= 2 else 0
        return UnitShards(owned, grad_numel, grad_base, param_shard, bucket_numel)
