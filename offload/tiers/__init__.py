"""Allocation and budgets per tier: device, host, nvme."""
from offload.tiers.device import DeviceTier
from offload.tiers.host import HostTier
from offload.tiers.nvme import NvmeTier

__all__ = ["DeviceTier", "HostTier", "NvmeTier"]
