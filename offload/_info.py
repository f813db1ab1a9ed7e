"""What the native build provides on this machine."""
from __future__ import annotations

from offload import _native


def native_info() -> dict:
    """Report the native build: the Adam instruction set chosen at load time, the ones this
    CPU can run, the step size from which Adam streams its 16-bit copy-out past the cache,
    the threads the kernels use, the I/O backends compiled in (which of them work in a
    given directory is probed by ``offload.io.IOEngine``), and the CRC32C kernel that checks
    swap pages ([Note: swap checksums]) with those this CPU can run."""
    return {
        "adam_isa": _native.adam_selected_isa(),
        "adam_isas_available": list(_native.adam_available_isas()),
        "adam_stream_copy_out_min_numel": _native.adam_stream_copy_out_min_numel(),
        "num_threads": _native.num_threads(),
        "io_backends": list(_native.io_available_backends()),
        "crc32c_isa": _native.crc32c_selected_isa(),
        "crc32c_isas_available": list(_native.crc32c_available_isas()),
    }
