"""``offload profile``: bandwidth of every tier link on this machine, and CPU Adam throughput.

Profile JSON schema (version 1; ``offload plan --profile PATH`` reads it, see
offload/plan.py ``validate_profile``)::

  {
    "schema": "offload-profile",          # constant
    "version": 1,                         # bumped on any incompatible change
    "source": "measured on HOST at ISO-TIME",
    "machine": {"hostname", "cpu_count", "torch", "cuda": null | "<version>", "device_name"},
    "bandwidth_bytes_per_second": {       # what the planner uses; best setting of each link
      "nvme_read", "nvme_write",          # native I/O engine, O_DIRECT when the fs allows it
      "host_to_device", "device_to_host", # pinned when CUDA; without CUDA the "device" is
                                          # RAM, so these are host memcpy
      "host_memcpy"                       # pageable (pinned too when CUDA, see "links")
    },
    "adam_params_per_second": float,      # native CPU Adam, fp32 states, all threads
    "links": [{"link", "setting", "bytes", "seconds", "bytes_per_second"}],  # every measurement
    "nvme": {"swap_dir", "o_direct", "o_direct_error", "file_bytes",
             "grid": [{"backend", "block_bytes", "queue_depth",
                       "read_bytes_per_second", "write_bytes_per_second"}]},
    "adam": {"isa", "num_threads", "numel", "seconds"},
    "recommended_io": {"io_backend", "io_block_bytes", "io_queue_depth"}   # OffloadConfig fields
  }
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List

import torch

from offload.plan import PROFILE_SCHEMA, PROFILE_VERSION, validate_profile

MiB = 1 << 20


def _best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm up: page faults, thread pools
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gbps(num_bytes: float, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:6.2f} GB/s"


def time_write_read(io, buf: torch.Tensor, path: str, num_bytes: int) -> "tuple[float, float]":
    """Seconds to write the first ``num_bytes`` of ``path`` through the IOEngine ``io``,
    ``buf`` (aligned) at a time, and then to read them back: (write, read)."""
    chunk = buf.numel() * buf.element_size()
    start = time.perf_counter()
    for offset in range(0, num_bytes, chunk):
        io.write_from(buf, path, offset)
    io.wait_all()
    write_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for offset in range(0, num_bytes, chunk):
        io.read_into(buf, path, offset)
    io.wait_all()
    return write_seconds, time.perf_counter() - start


def _config_accepts_backend(backend: str) -> bool:
    from offload.config import OffloadConfig
    try:
        OffloadConfig(io_backend=backend)
    except ValueError:
        return False
    return True


class Profiler:
    """Runs the measurements in order, printing each as it finishes."""

    def __init__(self, swap_dir: str, quick: bool, out=sys.stdout) -> None:
        self.swap_dir = swap_dir
        self.quick = quick
        self.out = out
        self.links: List[dict] = []
        self.copy_bytes = 32 * MiB if quick else 256 * MiB
        self.file_bytes = 64 * MiB if quick else 512 * MiB
        self.block_sizes = (256 << 10, 1 << 20, 4 << 20) if not quick else (256 << 10, 1 << 20)
        self.queue_depths = (4, 16, 64) if not quick else (4, 32)
        self.adam_numel = (4 if quick else 32) * MiB // 4 * 4

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def record(self, link: str, setting: str, num_bytes: int, seconds: float) -> float:
        rate = num_bytes / seconds
        self.links.append({"link": link, "setting": setting, "bytes": num_bytes, "seconds": seconds,
                           "bytes_per_second": rate})
        self.say(f"  {link:<15} {setting:<34} {_gbps(num_bytes, seconds)}")
        return rate

    # ------------------------------------------------------------------ host and device
    def measure_copies(self) -> Dict[str, float]:
        n = self.copy_bytes
        repeats = 3 if self.quick else 5
        cuda = torch.cuda.is_available()
        src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        memcpy = self.record("host_memcpy", "pageable", n, _best_seconds(lambda: dst.copy_(src), repeats))
        result = {"host_memcpy": memcpy, "host_to_device": memcpy, "device_to_host": memcpy}
        if not cuda:
            self.say("  (no CUDA: the device tier is RAM, so host<->device copies are host memcpy)")
            return result
        psrc, pdst = src.pin_memory(), dst.pin_memory()
        result["host_memcpy"] = max(memcpy, self.record(
            "host_memcpy", "pinned", n, _best_seconds(lambda: pdst.copy_(psrc), repeats)))
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")

        def timed(fn: Callable[[], None]) -> float:
            def run() -> None:
                fn()
                torch.cuda.synchronize()
            return _best_seconds(run, repeats)

        for pinned, host in (("pinned", psrc), ("pageable", src)):
            h2d = self.record("host_to_device", pinned, n, timed(lambda: dev.copy_(host, non_blocking=True)))
            d2h = self.record("device_to_host", pinned, n, timed(lambda: host.copy_(dev, non_blocking=True)))
            if pinned == "pinned":  # the engine stages through pinned buffers
                result["host_to_device"], result["device_to_host"] = h2d, d2h
        return result

    # ------------------------------------------------------------------ NVMe
    def measure_nvme(self) -> dict:
        from offload import _native
        from offload.io import IOEngine, aligned_empty, probe_directory

        probe = probe_directory(self.swap_dir)
        self.say(f"  O_DIRECT in {probe['path']}: "
                 + ("yes" if probe["o_direct"] else f"no ({probe['o_direct_error']}): buffered I/O, "
                    "reads may come from the page cache"))
        backends = [b for b, r in probe["backends"].items() if r["ok"]]
        for b, r in probe["backends"].items():
            if not r["ok"]:
                self.say(f"  backend {b} does not work here: {r['error']}")
        if not backends:
            raise RuntimeError(f"no I/O backend works in {self.swap_dir} (see `offload doctor`)")
        chunk = min(self.file_bytes, 64 * MiB)
        buf = aligned_empty(chunk).fill_(7)
        grid = []
        fd, path = tempfile.mkstemp(prefix=".offload-profile-", dir=self.swap_dir)
        os.close(fd)
        try:
            for backend in backends:
                for block in self.block_sizes:
                    for depth in self.queue_depths:
                        setting = f"{backend} block={block >> 10}KiB qd={depth}"
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            with IOEngine(backend, block_bytes=block, queue_depth=depth) as io:
                                os.truncate(path, 0)
                                write_s, read_s = time_write_read(io, buf, path, self.file_bytes)
                        w = self.record("nvme_write", setting, self.file_bytes, write_s)
                        r = self.record("nvme_read", setting, self.file_bytes, read_s)
                        grid.append({"backend": backend, "block_bytes": block, "queue_depth": depth,
                                     "read_bytes_per_second": r, "write_bytes_per_second": w})
        finally:
            os.unlink(path)
        # The setting that moves a read plus a write of the same bytes fastest, among the
        # backends OffloadConfig.io_backend accepts.
        candidates = [g for g in grid if _config_accepts_backend(g["backend"])] or grid
        best = min(candidates, key=lambda g: 1 / g["read_bytes_per_second"] + 1 / g["write_bytes_per_second"])
        return {"swap_dir": probe["path"], "o_direct": probe["o_direct"],
                "o_direct_error": probe["o_direct_error"], "file_bytes": self.file_bytes,
                "grid": grid, "best": best, "native_backends": list(_native.io_available_backends())}

    # ------------------------------------------------------------------ Adam
    def measure_adam(self) -> dict:
        from offload import native_info
        from offload.optim import adam_step_flat

        n = self.adam_numel
        param, grad = torch.randn(n), torch.randn(n) * 1e-3
        m, v = torch.zeros(n), torch.zeros(n)
        step = [0]

        def run() -> None:
            step[0] += 1
            adam_step_flat(param, grad, m, v, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=0.01)

        seconds = _best_seconds(run, 3 if self.quick else 5)
        info = native_info()
        self.say(f"  cpu_adam        {info['adam_isa']}, {info['num_threads']} threads, {n:,} params"
                 f"{'':<6}{n / seconds / 1e6:8.1f} M params/s")
        return {"isa": info["adam_isa"], "num_threads": info["num_threads"], "numel": n,
                "seconds": seconds, "params_per_second": n / seconds}

    def run(self) -> dict:
        steps = ["host and device copies", "NVMe grid", "CPU Adam"]
        started = time.perf_counter()
        self.say(f"[1/3] {steps[0]} ({self.copy_bytes // MiB} MiB buffers)")
        copies = self.measure_copies()
        self.say(f"[2/3] {steps[1]} in {self.swap_dir} ({self.file_bytes // MiB} MiB file, "
                 f"{len(self.block_sizes)} block sizes x {len(self.queue_depths)} queue depths per backend)")
        nvme = self.measure_nvme()
        self.say(f"[3/3] {steps[2]}")
        adam = self.measure_adam()
        self.say(f"done in {time.perf_counter() - started:.1f} s")
        best = nvme.pop("best")
        cuda = torch.version.cuda if torch.cuda.is_available() else None
        now = datetime.datetime.now().isoformat(timespec="seconds")
        profile = {
            "schema": PROFILE_SCHEMA,
            "version": PROFILE_VERSION,
            "source": f"measured on {socket.gethostname()} at {now}",
            "machine": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                        "torch": torch.__version__, "cuda": cuda,
                        "device_name": torch.cuda.get_device_name() if cuda else "cpu"},
            "bandwidth_bytes_per_second": {
                "nvme_read": max(g["read_bytes_per_second"] for g in nvme["grid"]),
                "nvme_write": max(g["write_bytes_per_second"] for g in nvme["grid"]),
                "host_to_device": copies["host_to_device"],
                "device_to_host": copies["device_to_host"],
                "host_memcpy": copies["host_memcpy"],
            },
            "adam_params_per_second": adam["params_per_second"],
            "links": self.links,
            "nvme": nvme,
            "adam": {k: adam[k] for k in ("isa", "num_threads", "numel", "seconds")},
            "recommended_io": {"io_backend": best["backend"], "io_block_bytes": best["block_bytes"],
                               "io_queue_depth": best["queue_depth"]},
        }
        return validate_profile(profile, "measured profile")


def summary_table(profile: dict) -> str:
    bw = profile["bandwidth_bytes_per_second"]
    rows = [("link", "bandwidth")] + [(k, f"{v / 1e9:.2f} GB/s") for k, v in bw.items()]
    rows.append(("cpu_adam", f"{profile['adam_params_per_second'] / 1e6:.1f} M params/s"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{a:<{width}}{b:>16}" for a, b in rows]
    lines.insert(1, "-" * (width + 16))
    rec = profile["recommended_io"]
    lines += ["", f"recommended I/O settings for {profile['nvme']['swap_dir']} (OffloadConfig fields):",
              f"  io_backend={rec['io_backend']!r}, io_block_bytes={rec['io_block_bytes']}, "
              f"io_queue_depth={rec['io_queue_depth']}"]
    return "\n".join(lines)


def plot(profile: dict, path: str) -> None:
    """Bar charts: best bandwidth per link, and NVMe read/write per I/O setting. Raises
    ImportError when matplotlib is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = profile["bandwidth_bytes_per_second"]
    grid = profile["nvme"]["grid"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 2]})
    ax1.bar(list(bw), [v / 1e9 for v in bw.values()], color="tab:blue")
    ax1.set_ylabel("GB/s")
    ax1.set_title("best bandwidth per link")
    ax1.tick_params(axis="x", rotation=45)
    labels = [f"{g['backend']}\n{g['block_bytes'] >> 10}K qd{g['queue_depth']}" for g in grid]
    xs = range(len(grid))
    ax2.bar([x - 0.2 for x in xs], [g["read_bytes_per_second"] / 1e9 for g in grid], 0.4, label="read")
    ax2.bar([x + 0.2 for x in xs], [g["write_bytes_per_second"] / 1e9 for g in grid], 0.4, label="write")
    ax2.set_xticks(list(xs))
    ax2.set_xticklabels(labels, fontsize=7)
    ax2.set_ylabel("GB/s")
    ax2.set_title(f"NVMe per setting ({profile['nvme']['swap_dir']})")
    ax2.legend()
    fig.suptitle(profile["source"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(profile: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
