"""The optimizer: CPU Adam (``cpu_adam``) and the engine's pipelined step over staged pieces
(``step``)."""
from offload.optim.cpu_adam import CPUAdam, adam_step_flat, join_master, split_master

__all__ = ["CPUAdam", "adam_step_flat", "join_master", "split_master"]
