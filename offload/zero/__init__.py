"""[zero] ZeRO across ranks: which part of each unit's flat buffers a rank owns
(``shards``) and the collectives that keep the ranks in step (``partition``), below
offload.memory, which keeps each unit's shard records. The optimizer step over the rank's
shards is the optimizer's (offload/optim/sharded.py).

  stage 0  every rank keeps and updates everything (plain data parallel); gradients are
           all-reduced at the optimizer step.
  stage 1  master weights and Adam moments hold only the rank's shard (padded to whole
           pages so NVMe extents stay O_DIRECT-able); gradients are reduce-scattered at the
           optimizer step into the rank's part of a full-size buffer; after Adam the updated
           compute copy (or master) is all-gathered.
  stage 2  as stage 1, and the fp32 gradient buffer is shard-sized: each unit's gradients
           are reduce-scattered as soon as the unit's last gradient is final in backward.
  stage 3  as stage 2, and the compute copy at home (param_tier host or nvme) holds only the
           rank's chunks (``ParamShard``): fetching a unit onto the device all-gathers it,
           releasing it drops it, and Adam writes the rank's chunk home with no all-gather.
"""
from offload.zero.partition import Partition
from offload.zero.shards import ParamShard, ShardRange, UnitShards, even_range

__all__ = ["ParamShard", "Partition", "ShardRange", "UnitShards", "even_range"]
