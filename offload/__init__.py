"""offload: train PyTorch models whose state does not fit on the device.

Public API (see ARCHITECTURE.md): ``wrap``, ``Engine``, ``OffloadConfig``, ``CPUAdam``,
``native_info`` and the ``offload.io`` module (``IOEngine``, ``aligned_empty``).
"""
import os as _os

import torch as _torch

from offload import _native
from offload._info import native_info
from offload.config import OffloadConfig
from offload.engine import Engine, wrap
from offload.optim import CPUAdam

# Native kernels use their own thread pool: size it like torch's intra-op pool unless
# OFFLOAD_NUM_THREADS says otherwise, so the two never oversubscribe the cores differently.
if not _os.environ.get("OFFLOAD_NUM_THREADS"):
    _native.set_num_threads(_torch.get_num_threads())

__all__ = ["wrap", "Engine", "OffloadConfig", "CPUAdam", "native_info"]
__version__ = "0.1.0"
