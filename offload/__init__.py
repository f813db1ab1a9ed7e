"""offload: train PyTorch models whose state does not fit on the device.

Public API (see ARCHITECTURE.md): ``wrap``, ``Engine``, ``OffloadConfig``, ``CPUAdam``,
``native_info``, the exceptions a user may catch (``CheckpointError``, ``EngineFailedError``)
and the ``offload.io`` module (``IOEngine``, ``aligned_empty``).
"""
import importlib as _importlib
import os as _os

import torch as _torch

from offload.config import OffloadConfig
from offload.errors import CheckpointError, EngineFailedError

try:
    _native = _importlib.import_module("offload._native")
except ImportError as _error:  # `offload doctor` must still run and say what is wrong
    _native_error = _error

    def __getattr__(name: str):
        if name in ("wrap", "Engine", "CPUAdam", "native_info"):
            raise ImportError(
                f"offload.{name} needs the native extension, which does not load ({_native_error}); "
                "build it with `python3 -m pip install -e .` (a C++17 compiler is needed) and see "
                "`offload doctor`") from _native_error
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
else:
    from offload._info import native_info
    from offload.engine import Engine, wrap
    from offload.optim import CPUAdam

    # Native kernels use their own thread pool: size it like torch's intra-op pool unless
    # OFFLOAD_NUM_THREADS says otherwise, so the two never oversubscribe the cores differently.
    if not _os.environ.get("OFFLOAD_NUM_THREADS"):
        _native.set_num_threads(_torch.get_num_threads())

__all__ = ["wrap", "Engine", "OffloadConfig", "CPUAdam", "native_info", "CheckpointError",
           "EngineFailedError"]
__version__ = "0.1.0"
