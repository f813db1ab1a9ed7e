"""The optimizer: CPU Adam (``cpu_adam``), Adam over a range of one unit (``adam_ranges``),
the gradients from backward to each unit's update (``gradients``), their squares for the
global norm (``squares``), the pipelined step over staged pieces (``step``), [zero] the step
over a rank's shards (``sharded``), when each unit's update runs (``updates``) and the
delayed updates (``delayed``). ``join_master``/``split_master`` are re-exported from the
master codec (offload/memory/master_codec.py)."""
from offload.memory.master_codec import join_master, split_master
from offload.optim.cpu_adam import CPUAdam, adam_step_flat

__all__ = ["CPUAdam", "adam_step_flat", "join_master", "split_master"]
