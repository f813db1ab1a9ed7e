"""offload: train PyTorch models whose state does not fit on the device.

Public API (see ARCHITECTURE.md): ``wrap``, ``OffloadConfig``, ``CPUAdam``, ``native_info``
and the ``offload.io`` module (``IOEngine``, ``aligned_empty``).
"""
from offload._info import native_info

__all__ = ["native_info"]
__version__ = "0.1.0"
