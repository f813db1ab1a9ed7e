"""The optimizer: CPU Adam (``cpu_adam``), the engine's pipelined step over staged pieces
(``step``) and the gradients it consumes, from backward to each unit's update
(``gradients``)."""
from offload.optim.cpu_adam import CPUAdam, adam_step_flat, join_master, split_master

__all__ = ["CPUAdam", "adam_step_flat", "join_master", "split_master"]
