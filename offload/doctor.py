"""``offload doctor``: is this machine ready to offload? Each check prints one line; a check
that fails on something required names the fix, and the exit code is 1.

Required: the native extension loads; the swap directory is writable (or, where it does not
exist yet, the directory wrap would create it in is), and at least one I/O backend completes
a real aligned write+read there. Reported (warnings only): O_DIRECT
support (without it the engine falls back to buffered I/O), free space, RLIMIT_MEMLOCK, CUDA.
"""
from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
from typing import List, Optional, TextIO

GiB = 1 << 30


class Checks:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.failures: List[str] = []

    def ok(self, what: str, detail: str) -> None:
        print(f"  ok    {what:<18} {detail}", file=self.out)

    def warn(self, what: str, detail: str) -> None:
        print(f"  warn  {what:<18} {detail}", file=self.out)

    def fail(self, what: str, detail: str, fix: str) -> None:
        print(f"  FAIL  {what:<18} {detail}\n        fix: {fix}", file=self.out)
        self.failures.append(what)


def _format_limit(value: int) -> str:
    from offload.config import format_size
    return "unlimited" if value == resource.RLIM_INFINITY else format_size(value)


def run_doctor(swap_dir: Optional[str], out: TextIO = sys.stdout) -> int:
    checks = Checks(out)
    directory = os.path.abspath(swap_dir or tempfile.gettempdir())
    print(f"offload doctor (swap directory: {directory})", file=out)

    # 1. Native build and instruction set.
    try:
        from offload import native_info
        info = native_info()
    except (ImportError, AttributeError) as e:
        checks.fail("native build", f"offload._native does not load: {e}",
                    "build it: `python3 -m pip install -e .` (or `python setup.py build_ext --inplace`)")
        info = None
    if info is not None:
        checks.ok("native build", f"offload._native loaded, {info['num_threads']} threads")
        isa = info["adam_isa"]
        detail = f"Adam kernel {isa} (CPU supports: {', '.join(info['adam_isas_available'])})"
        if isa == "scalar" and len(info["adam_isas_available"]) > 1:
            checks.warn("cpu adam", detail + "; OFFLOAD_FORCE_ISA may be forcing the scalar kernel")
        else:
            checks.ok("cpu adam", detail)
        crc = info["crc32c_isa"]
        detail = f"CRC32C kernel {crc} (CPU supports: {', '.join(info['crc32c_isas_available'])})"
        if crc == "scalar" and len(info["crc32c_isas_available"]) > 1:
            checks.warn("swap checksums", detail + "; OFFLOAD_CRC32C_ISA may be forcing the scalar kernel")
        else:
            checks.ok("swap checksums", detail)

    # 2. Swap directory, backends, O_DIRECT, free space.
    usable_dir = False
    probe_dir = directory  # where the swap files would be: the directory, or what wrap creates it in
    if not os.path.exists(directory):
        ancestor = os.path.dirname(directory)
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if os.path.isdir(ancestor):
            probe_dir = ancestor  # wrap creates the rest (mode 0700), as it does here
        else:
            checks.fail("swap directory", f"{directory} cannot exist: {ancestor} is a file, not a directory",
                        "pass --swap-dir DIR naming a directory on a local NVMe drive")
    elif not os.path.isdir(directory):
        checks.fail("swap directory", f"{directory} is not a directory",
                    "pass --swap-dir DIR naming a directory on a local NVMe drive")
    if os.path.isdir(probe_dir):
        try:
            fd, probe_path = tempfile.mkstemp(prefix=".offload-doctor-", dir=probe_dir)
            os.close(fd)
            os.unlink(probe_path)
            usable_dir = True
            checks.ok("swap directory", f"{directory} is writable" if probe_dir == directory else
                      f"{directory} does not exist yet; wrap creates it in {probe_dir}, which is writable "
                      "(the checks below are of that filesystem)")
        except OSError as e:
            checks.fail("swap directory", f"cannot create files in {probe_dir}: {e.strerror}",
                        f"grant write permission on {probe_dir} or pass --swap-dir DIR you can write")
    directory = probe_dir
    if usable_dir and info is not None:
        from offload.io.probe import BACKENDS, probe_directory
        try:
            probe = probe_directory(directory)
        except (OSError, ValueError) as e:
            checks.fail("I/O backends", f"probing {directory} failed: {e}",
                        "pass --swap-dir DIR on a local filesystem you can write")
            probe = None
        if probe is not None:
            working = [b for b, r in probe["backends"].items() if r["ok"]]
            broken = [f"{b} ({r['error']})" for b, r in probe["backends"].items() if not r["ok"]]
            if working:
                checks.ok("I/O backends", f"working in {directory}: {', '.join(working)}; "
                          f"io_backend='auto' uses {probe['choice']} (the first of {', '.join(BACKENDS)} "
                          "that works here)" + (f"; not working: {'; '.join(broken)}" if broken else ""))
            else:
                checks.fail("I/O backends", f"none works in {directory}: {'; '.join(broken)}",
                            "pass --swap-dir DIR on a local ext4/xfs filesystem")
            if probe["o_direct"]:
                checks.ok("O_DIRECT", f"honored in {directory}")
            else:
                checks.warn("O_DIRECT", f"not honored in {directory} ({probe['o_direct_error']}): "
                            "swap I/O goes through the page cache (slower, uses RAM); "
                            "use a directory on ext4/xfs for full speed")
        usage = shutil.disk_usage(directory)
        from offload.config import format_size
        detail = f"{format_size(usage.free)} free of {format_size(usage.total)} in {directory}"
        if usage.free < GiB:
            checks.warn("free space", detail + " (swap files need 16 B per parameter or more)")
        else:
            checks.ok("free space", detail + " (enough for ~"
                      f"{usage.free / 16 / 1e9:.1f} B parameters' optimizer states)")

    # 3. Pinned memory and CUDA.
    import torch
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = f"RLIMIT_MEMLOCK soft {_format_limit(soft)}, hard {_format_limit(hard)}"
    cuda = torch.cuda.is_available()
    if cuda and soft != resource.RLIM_INFINITY and soft < 64 << 20:
        checks.warn("pinned memory", memlock + ": registering large pinned buffers may fail; "
                    "raise it (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf)")
    else:
        checks.ok("pinned memory", memlock)
    if cuda:
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        checks.ok("CUDA", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): {names}")
    elif torch.version.cuda:
        checks.warn("CUDA", f"torch built with CUDA {torch.version.cuda} but no GPU is visible: "
                    "training runs on the CPU")
    else:
        checks.ok("CUDA", f"not present (torch {torch.__version__} is a CPU build): "
                  "the device tier is a byte-budgeted region of RAM")

    if checks.failures:
        print(f"{len(checks.failures)} problem(s): {', '.join(checks.failures)}", file=out)
        return 1
    print("all required checks passed", file=out)
    return 0
