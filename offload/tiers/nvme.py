"""The NVMe tier: extents of swap files, moved by the native I/O engine."""
from __future__ import annotations

import threading

import torch

from offload.io import IOEngine, SwapSpace


class NvmeTier:
    """Owns the run's SwapSpace and IOEngine; counts the bytes it moves."""

    def __init__(self, swap_dir: str, reserve_bytes: int, backend: str, block_bytes: int,
                 queue_depth: int) -> None:
        # SwapSpace runs its preflight (space, permissions, O_DIRECT) before creating files.
        self.space = SwapSpace(swap_dir, reserve_bytes=reserve_bytes)
        try:
            self.io = IOEngine(backend=backend, block_bytes=block_bytes, queue_depth=queue_depth)
        except BaseException:
            self.space.close()
            raise
        self.bytes_read = 0
        self.bytes_written = 0
        self._count_lock = threading.Lock()  # the fetch path and the optimizer worker both move bytes

    def allocate(self, num_bytes: int):
        return self.space.allocate(num_bytes)

    def read(self, dst: torch.Tensor, extent):
        """Start reading ``extent`` into ``dst``; returns a handle with ``wait()``."""
        assert dst.numel() * dst.element_size() == extent.nbytes
        with self._count_lock:
            self.bytes_read += extent.nbytes
        return self.io.read_into(dst, extent.path, extent.offset)

    def write(self, src: torch.Tensor, extent):
        assert src.numel() * src.element_size() == extent.nbytes
        with self._count_lock:
            self.bytes_written += extent.nbytes
        return self.io.write_from(src, extent.path, extent.offset)

    @property
    def used_bytes(self) -> int:
        return self.space.used_bytes

    def close(self) -> None:
        try:
            self.io.close()
        finally:
            self.space.close()
