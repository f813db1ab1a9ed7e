"""UpdatePaths: the ways one unit's update runs on this process, chosen once from the
layout and the ranks; the update scheduler and the delayed updates run every update through
it rather than each choosing among the steps itself."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from offload.memory.layout import Layout, UnitState
from offload.optim.adam_ranges import UnitAdam
from offload.optim.sharded import ShardedStep
from offload.optim.step import PipelinedStep
from offload.zero import Partition

__all__ = ["UpdatePaths"]


class UpdatePaths:
    """How a unit's update runs here: [zero] the sharded step over this rank's shards at
    stage >= 1 (``sharded``), else the staged step through the staging slots where a state
    is on NVMe (``ring``, [Note: the piece ring]), else Adam in place on host homes
    (``adam``). ``partition``: [zero] the Partition of several ranks that the updates
    agree with ([Note: early updates across ranks], [Note: delayed updates across ranks]),
    or None on one process. Holds no state of its own."""

    def __init__(self, layout: Layout, *, ring: PipelinedStep, sharded: Optional[ShardedStep], adam: UnitAdam,
                 partition: Optional[Partition]) -> None:
        self._layout = layout
        self.ring = ring
        self.sharded = sharded
        self.adam = adam
        self.partition = partition

    def early(self, u: UnitState, groups: List[Dict[str, Any]], grad_factor: float, micro_step: int) -> None:
        """On the optimizer worker: u's early or deferred update ([Note: early updates],
        [Note: deferred updates]), into its spare homes when ``u.update.speculative``
        ([Note: speculative updates]). [zero] The sharded one issues no collective."""
        if self.sharded is not None:
            self.sharded.run([u], grad_factor, micro_step, groups, speculative=u.update.speculative, early=True)
        elif self._layout.staged_step:
            self.ring.update_early(u, groups, grad_factor)
        else:
            self.adam.update_in_place(u, grad_factor, groups, speculative=u.update.speculative)

    def delayed(self, u: UnitState, groups: List[Dict[str, Any]], grad_factor: float, micro_step: int) -> None:
        """On the optimizer worker: u's delayed update ([Note: delayed updates]), from its
        homes into its spare compute copy and step counts, master and moments in place;
        [zero] stages 1-2 all-gather the spare copy over the "param" lane ([Note: delayed
        updates across ranks])."""
        if self.sharded is not None:
            self.sharded.run([u], grad_factor, micro_step, groups, speculative=True, lane="param")
        elif self._layout.staged_step:
            self.ring.update_early(u, groups, grad_factor, into_spare=True)
        else:
            self.adam.update_in_place(u, grad_factor, groups, speculative=True)
