"""TierContext: the tiers one engine places state on and the recorders of what moves
between them, shared by the mechanisms that move bytes (as FSDP2's FSDPCommContext
shares its streams). The engine builds the one instance at wrap, once the tiers exist."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from offload.stats import Stats, Timeline
from offload.tiers.device import DeviceTier
from offload.tiers.host import HostTier
from offload.tiers.nvme import NvmeTier

__all__ = ["TierContext"]


@dataclass(frozen=True)
class TierContext:
    """One engine's tiers, its counters and its timeline."""

    device: DeviceTier
    host: HostTier
    nvme: Optional[NvmeTier]
    """None when nothing is homed on NVMe (``Layout.needs_nvme``)."""
    stats: Stats
    """Bytes per link, counts and seconds per phase; also what waits for I/O are counted in."""
    timeline: Timeline
    """The spans behind ``Engine.export_trace``."""
