"""Sizes every layer shares, defined once, in the lowest layer (no torch, no native module)."""

PAGE_BYTES = 4096
"""The page: O_DIRECT's alignment of offsets, lengths and buffers (io.probe.ALIGN_BYTES),
the unit of swap checksums and of every home's layout."""

FP32_BYTES = 4
"""An fp32 master or moment element."""
