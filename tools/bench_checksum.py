"""Throughput of the CRC32C kernels that check swap pages ([Note: swap checksums]).

For each kernel this CPU has (scalar: slicing-by-8 tables; sse42: the crc32 instruction in
three interleaved lanes), the GB/s of the per-page CRCs (4 KiB pages, as the NVMe tier takes
them) over a buffer that fits in cache (a page just written by Adam) and over one far larger
than the cache (a page just read by DMA, so from DRAM), and beside them a single-threaded read
of the same buffers (a sum over int64) measured in the same run: a kernel at 1.0x that
yardstick is bound by memory, not by its arithmetic. Each figure is the best of --repeats
runs, the kernels and the yardstick taking turns, so drift hits them alike.

    python tools/bench_checksum.py               # 1 MiB and 256 MiB
    python tools/bench_checksum.py --quick       # 1 MiB and 32 MiB, fewer repeats
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from offload import _native
from offload.io import aligned_empty
from offload.io.checksum import PAGE_BYTES


def best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(sizes, repeats: int):
    torch.set_num_threads(1)
    chosen = _native.crc32c_selected_isa()
    rows = []
    try:
        for nbytes in sizes:
            buf = aligned_empty(nbytes)
            buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
            out = torch.empty(nbytes // PAGE_BYTES, dtype=torch.int32)
            words = buf.view(torch.int64)
            inner = max(1, (64 << 20) // nbytes)  # small buffers: several passes per timing

            def pages():
                for _ in range(inner):
                    _native.crc32c_pages(buf.data_ptr(), nbytes, PAGE_BYTES, out.data_ptr())

            def read():
                for _ in range(inner):
                    words.sum()

            best = {isa: float("inf") for isa in _native.crc32c_available_isas()}
            best_read = float("inf")
            for _ in range(repeats):  # the kernels and the yardstick take turns
                for isa in best:
                    _native.crc32c_set_isa(isa)
                    best[isa] = min(best[isa], best_seconds(pages, 1))
                best_read = min(best_read, best_seconds(read, 1))
            read_gbs = inner * nbytes / best_read / 1e9
            for isa, seconds in best.items():
                gbs = inner * nbytes / seconds / 1e9
                rows.append({"kernel": isa, "buffer_bytes": nbytes, "gb_per_s": gbs,
                             "read_gb_per_s": read_gbs, "of_read": gbs / read_gbs})
    finally:
        _native.crc32c_set_isa(chosen)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 MiB and 32 MiB, 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="timings per figure (default 7; 3 with --quick)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here")
    args = p.parse_args(argv)
    sizes = [1 << 20, (32 if args.quick else 256) << 20]
    rows = measure(sizes, args.repeats or (3 if args.quick else 7))
    print(f"CRC32C of {PAGE_BYTES}-byte pages, one thread; load-time choice: {_native.crc32c_selected_isa()}")
    print(f"{'kernel':8s} {'buffer':>8s} {'GB/s':>7s} {'read GB/s':>10s} {'x read':>7s}")
    for r in rows:
        print(f"{r['kernel']:8s} {r['buffer_bytes'] >> 20:>5d}MiB {r['gb_per_s']:7.2f} "
              f"{r['read_gb_per_s']:10.2f} {r['of_read']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
