"""[Note: split master] The master codec: an fp32 master stored as two 16-bit halves (the
bf16 compute copy and the low 16 bits), on the native kernels. Below the optimizer and the
homes, which both split and join masters."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from offload import _native

__all__ = ["check_flat", "join_master", "split_master"]


def check_flat(name: str, tensor: Any, dtypes: Iterable[torch.dtype], numel: int | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {tensor.device}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.dtype not in dtypes:
        accepted = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected one of: {accepted}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements; param has {numel}")


def split_master(master: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> None:
    """[Note: split master] Store fp32 ``master`` as two 16-bit halves: ``high`` (bf16) is
    the master rounded half away from zero, which makes it the bf16 compute copy; ``low``
    (int16) holds the master's low 16 bits. ``join_master`` gives the master back bit for
    bit (a NaN as a NaN). The compute copy differs from rounding to nearest even only at
    exact ties, by one bf16 ulp. Contiguous CPU tensors of one length."""
    check_flat("master", master, (torch.float32,), None)
    check_flat("high", high, (torch.bfloat16,), master.numel())
    check_flat("low", low, (torch.int16,), master.numel())
    _native.split_master(master.data_ptr(), high.data_ptr(), low.data_ptr(), master.numel())


def join_master(high: torch.Tensor, low: torch.Tensor, master: torch.Tensor) -> None:
    """The fp32 ``master`` from the halves ``split_master`` made (see there)."""
    check_flat("master", master, (torch.float32,), None)
    check_flat("high", high, (torch.bfloat16,), master.numel())
    check_flat("low", low, (torch.int16,), master.numel())
    _native.join_master(high.data_ptr(), low.data_ptr(), master.data_ptr(), master.numel())
