"""offload: train PyTorch models whose state does not fit on the device.

Public API (see ARCHITECTURE.md): ``wrap``, ``Engine``, ``OffloadConfig``, ``CPUAdam``,
``native_info`` and the ``offload.io`` module (``IOEngine``, ``aligned_empty``).
"""
from offload._info import native_info
from offload.config import OffloadConfig
from offload.engine import Engine, wrap
from offload.optim import CPUAdam

__all__ = ["wrap", "Engine", "OffloadConfig", "CPUAdam", "native_info"]
__version__ = "0.1.0"
