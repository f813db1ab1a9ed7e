"""``offload plan --ranks N``: what each rank of a ZeRO run holds on each tier, and what the
ranks of one node hold together, for the configurations of ``offload plan``'s table.

[zero] A rank's units are cut as ``Partition.assign`` cuts them (``zero.shards.UnitShards``:
stage >= 1 the master and moments of the rank's shard, >= 2 its gradient part, 3 its chunks
of the compute copy and a device slot long enough for the gathers in place), and its bytes
are wrap's budget arithmetic over those sizes (memory/budget.py), as for one process.
Ranks form sharding groups of ``shard_group_size`` ([Note: sharding groups]); ranks with
the same place in their groups hold the same bytes, so one row stands for each place. The
node's sum is its ranks' rows, ``ranks_per_node`` of them (consecutive ranks, as torchrun
numbers them). Each rank's host budget is its own ``host_budget``; its default is the node's
share (``host_budget_share``: 3/4 of available memory over the node's ranks).

A rank's device bytes at stage >= 2 include the room device_budget keeps for the gradient
buckets and the reduce-scatter's output ([Note: gradient buckets in the device budget]).
Not planned: what a backend allocates inside a collective, and "auto" placement per rank.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from offload._sizes import FP32_BYTES
from offload.config import OffloadConfig
from offload.memory.budget import UnitSizes, host_bytes, low_numel, minimum_device_budget, swap_bytes
from offload.memory.layout import Layout
from offload.plan import _ELEMENT_BYTES, CONFIGURATIONS, CPU, NO_SWAP_DIR, ModelShape
from offload.zero.shards import StageShards, UnitShards


@dataclasses.dataclass(frozen=True)
class PlannedRanks(StageShards):
    """What Layout.resolve and the budget arithmetic read of a ``Partition``: the ranks and
    the stage, without a process group."""

    world_size: int
    stage: int


def check_ranks(ranks: int, stage: int, shard_group_size: Optional[int], ranks_per_node: Optional[int]) -> tuple:
    """(shard_group_size, ranks_per_node), their defaults filled in: the node's ranks, and
    every rank on one node. A ValueError naming the option that does not fit."""
    if ranks < 2:
        raise ValueError(f"--ranks: {ranks}; several ranks means at least 2 (one process: leave --ranks out)")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--stage: {stage}; a ZeRO stage is 0, 1, 2 or 3")
    per_node = ranks_per_node if ranks_per_node is not None else ranks
    if per_node < 1 or ranks % per_node:
        raise ValueError(f"--ranks-per-node: {per_node} does not divide --ranks {ranks}")
    group = shard_group_size if shard_group_size is not None else per_node
    if group < 1 or ranks % group:
        raise ValueError(f"--shard-group-size: {group} does not divide --ranks {ranks} "
                         "([Note: sharding groups]: groups of that many ranks cannot cover every rank once)")
    return group, per_node


def rank_unit_sizes(shape: ModelShape, dtype: str, stage: int, shard_rank: int, shard_size: int,
                    merged: bool) -> List[UnitSizes]:
    """The unit sizes of the rank at ``shard_rank`` of its group, as wrap has them after
    Partition.assign (UnitSizes.of of each unit): every parameter trainable."""
    e = _ELEMENT_BYTES[dtype]
    home_element_bytes = FP32_BYTES if merged else e
    sizes = []
    for u in shape.units:
        base = u.sizes(e)
        # the frozen tail starts after the trainable entries (none frozen in a plan's model)
        shards = UnitShards.of(u.trainable_numel, u.trainable_numel, u.total_numel, shard_rank, shard_size,
                               stage, home_element_bytes)
        if shards is None:
            sizes.append(base)
            continue
        param = shards.param_shard
        sizes.append(dataclasses.replace(
            base, compute_numel=shards.compute_numel or base.compute_numel,
            home_numel=param.home_numel if param is not None else base.home_numel,
            state_numel=shards.shard.state_numel, low_numel=low_numel(shards.shard.numel),
            grad_numel=shards.grad_numel, bucket_numel=shards.bucket_numel,
            reduce_out_numel=shards.shard.shard_numel if shards.bucket_numel else 0,
            # whole slots of the shard: stages >= 1 run Adam alone ([Note: per-entry state slots])
            moments_numel=None, moments_piece_numel=None))
    return sizes


def _rank_layout(dtype: str, param_tier: str, optimizer_tier: str, pipeline_depth: int,
                 ranks: PlannedRanks, optimizer_states: str, delayed_update: bool, device: torch.device) -> Layout:
    # The config wrap checks: its refusals (param_tier "device" at stage 3 or with delayed
    # updates) are the plan's, and the layout's spare homes ([Note: delayed updates]) count
    config = OffloadConfig(device="cpu", dtype=dtype, param_tier=param_tier, optimizer_tier=optimizer_tier,
                           swap_dir=NO_SWAP_DIR, stage=ranks.stage, optimizer_states=optimizer_states,
                           delayed_update=delayed_update)
    return dataclasses.replace(Layout.resolve(config, device, ranks),
                               optimizer_pipeline_depth=pipeline_depth, host_budget=None,
                               host_budget_default=False)


def plan_ranks(shape: ModelShape, dtype: str, ranks: int, stage: int, shard_group_size: int,
               ranks_per_node: int, pipeline_depth: int = 3, optimizer_states: str = "exact",
               delayed_update: bool = False, device: torch.device = CPU) -> List[Dict[str, Any]]:
    """Per configuration of ``offload plan``'s table: a row per place in a sharding group
    (device, host and NVMe bytes of each rank there) and the node's sums, or the reason
    wrap refuses it ("refused"). ``optimizer_states`` "compact" ([Note: compact optimizer
    states]): each rank's whole compact states at stage 0; refused at stage >= 1.
    ``delayed_update``: the run's ([Note: delayed updates across ranks]): each rank's
    spare compute copy (of its chunks at stage 3) counts on its tier, and param_tier
    "device" is refused, as wrap refuses it. ``device``: the compute device
    (``plan.plan_device``; on CUDA each rank's fetch buffers and fp32 gradients count)."""
    planned = PlannedRanks(ranks, stage)
    e = _ELEMENT_BYTES[dtype]
    out = []
    for param_tier, optimizer_tier in CONFIGURATIONS:
        try:
            layout = _rank_layout(dtype, param_tier, optimizer_tier, pipeline_depth, planned, optimizer_states,
                                  delayed_update, device)
        except ValueError as refused:  # as wrap refuses it (param_tier "device" at stage 3 or delayed)
            out.append({"param_tier": param_tier, "optimizer_tier": optimizer_tier, "refused": str(refused)})
            continue
        rows = []
        for shard_rank in range(shard_group_size):
            sizes = rank_unit_sizes(shape, dtype, stage, shard_rank, shard_group_size, layout.merged)
            rows.append({"shard_rank": shard_rank,
                         "ranks": list(range(shard_rank, ranks, shard_group_size)),
                         "device_bytes": minimum_device_budget(sizes, param_tier, e),
                         "host_bytes": host_bytes(sizes, layout).total,
                         "nvme_bytes": swap_bytes(sizes, layout)})
        node = [rows[r % shard_group_size] for r in range(ranks_per_node)]  # the first node's ranks
        out.append({"param_tier": param_tier, "optimizer_tier": optimizer_tier, "rows": rows,
                    "node": {k: sum(r[k] for r in node) for k in ("device_bytes", "host_bytes", "nvme_bytes")}})
    return out


def ranks_report(planned: List[Dict[str, Any]], ranks: int, stage: int, shard_group_size: int,
                 ranks_per_node: int, host_budget: Optional[int], host_budget_default: bool) -> List[str]:
    """The lines `offload plan --ranks` adds: each configuration's rows per place in a group,
    whether each rank's host bytes fit its host budget, and the node's sums."""
    from offload.config import format_size

    budget = "no limit" if host_budget is None else format_size(host_budget) + \
        (" (default: 3/4 of the memory available now, divided among the node's ranks)" if host_budget_default else "")
    lines = [f"several ranks: {ranks} ranks, ZeRO stage {stage}, sharding groups of {shard_group_size}, "
             f"{ranks_per_node} ranks per node; host budget per rank: {budget}",
             "per rank (ranks at the same place of their groups hold the same); device: the smallest "
             "device_budget wrap accepts (at stage >= 2 with room for two gradient buckets and their output)"]
    header = f"{'param_tier':<11}{'opt_tier':<9}{'ranks':<14}{'device':>12}{'host':>12}{'nvme':>12}  fits"
    lines += [header, "-" * len(header)]
    for c in planned:
        if "refused" in c:
            lines.append(f"{c['param_tier']:<11}{c['optimizer_tier']:<9}refused: {c['refused'].split(';')[0]}")
            continue
        alike: Dict[tuple, List[int]] = {}  # ranks holding the same bytes share a line
        for r in c["rows"]:
            alike.setdefault((r["device_bytes"], r["host_bytes"], r["nvme_bytes"]), []).extend(r["ranks"])
        for (device, host, nvme), members in alike.items():
            shown = f"each of {ranks}" if len(members) == ranks else \
                ",".join(map(str, sorted(members)[:4])) + (",..." if len(members) > 4 else "")
            fits = host_budget is None or host <= host_budget
            lines.append(f"{c['param_tier']:<11}{c['optimizer_tier']:<9}{shown:<14}{format_size(device):>12}"
                         f"{format_size(host):>12}{format_size(nvme):>12}  {'yes' if fits else 'NO'}")
        node = c["node"]
        lines.append(f"{c['param_tier']:<11}{c['optimizer_tier']:<9}{'node (sum)':<14}"
                     f"{format_size(node['device_bytes']):>12}{format_size(node['host_bytes']):>12}"
                     f"{format_size(node['nvme_bytes']):>12}")
    return lines
