"""Sequential O_DIRECT write-then-read bandwidth of the I/O engine against baselines measured
in the same run: fio (io_uring and libaio engines, direct=1) when installed, a plain Python
os.pwrite/os.preadv O_DIRECT loop, and aiofiles (O_DIRECT, unbuffered) when installed.

    python tools/bench_io.py --dir /mnt/nvme/tmp             # 4 GiB, full grid
    python tools/bench_io.py --dir /mnt/nvme/tmp --quick     # 256 MiB, few settings, < 1 min

Every writer writes a fresh file (no preallocation, for fio too: fallocate=none), then reads
it back. Ratios, not absolute numbers, are the point: the machine may be shared.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from offload import _native
from offload.io import IOEngine, aligned_empty

MiB = 1 << 20
GB = 1e9


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_engine(backend, path, size, block_bytes, queue_depth):
    """GB/s write, GB/s read, CPU seconds per GB moved (both directions)."""
    chunk = min(size, 256 * MiB)
    buf = aligned_empty(chunk).fill_(7)
    with IOEngine(backend, block_bytes=block_bytes, queue_depth=queue_depth) as io:
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        for offset in range(0, size, chunk):
            io.write_from(buf, path, offset)
        io.wait_all()
        t1 = time.perf_counter()
        for offset in range(0, size, chunk):
            io.read_into(buf, path, offset)
        io.wait_all()
        t2 = time.perf_counter()
        cpu = cpu_seconds() - cpu0
    return size / (t1 - t0) / GB, size / (t2 - t1) / GB, cpu / (2 * size / GB)


def bench_python_loop(path, size, block_bytes):
    buf = mmap.mmap(-1, block_bytes)  # page aligned, as O_DIRECT needs
    view = memoryview(buf)
    cpu0 = cpu_seconds()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    t0 = time.perf_counter()
    for offset in range(0, size, block_bytes):
        os.pwrite(fd, view, offset)
    t1 = time.perf_counter()
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    t2 = time.perf_counter()
    for offset in range(0, size, block_bytes):
        os.preadv(fd, [view], offset)
    t3 = time.perf_counter()
    os.close(fd)
    cpu = cpu_seconds() - cpu0
    return size / (t1 - t0) / GB, size / (t3 - t2) / GB, cpu / (2 * size / GB)


def bench_aiofiles(path, size, block_bytes):
    try:
        import aiofiles  # benchmark-only dependency
    except ImportError:
        return None
    buf = mmap.mmap(-1, block_bytes)
    view = memoryview(buf)

    def opener(flags):
        return lambda p, f: os.open(p, f | flags, 0o600)

    async def run():
        t0 = time.perf_counter()
        async with aiofiles.open(path, "wb", buffering=0, opener=opener(os.O_DIRECT)) as f:
            for _ in range(0, size, block_bytes):
                await f.write(view)
        t1 = time.perf_counter()
        async with aiofiles.open(path, "rb", buffering=0, opener=opener(os.O_DIRECT)) as f:
            for _ in range(0, size, block_bytes):
                await f.readinto(view)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    cpu0 = cpu_seconds()
    tw, tr = asyncio.run(run())
    cpu = cpu_seconds() - cpu0
    return size / tw / GB, size / tr / GB, cpu / (2 * size / GB)


def bench_fio(engine, path, size, block_bytes, queue_depth):
    result = []
    for rw in ("write", "read"):
        cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={block_bytes}",
               f"--iodepth={queue_depth}", f"--ioengine={engine}", "--direct=1",
               f"--size={size}", "--fallocate=none", "--output-format=json"]
        if rw == "write" and os.path.exists(path):
            os.unlink(path)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            return None
        job = json.loads(out.stdout)["jobs"][0]
        result.append(job[rw]["bw_bytes"] / GB)
    return result[0], result[1], None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the device")
    parser.add_argument("--size", default=None, help="file size, e.g. 4GiB (default 4GiB)")
    parser.add_argument("--quick", action="store_true", help="256 MiB and few settings")
    parser.add_argument("--backends", default=None, help="comma list (default: all compiled)")
    args = parser.parse_args(argv)

    size = parse_size(args.size) if args.size else (256 * MiB if args.quick else 4 << 30)
    block_sizes = [1 * MiB, 8 * MiB] if args.quick else [1 * MiB, 4 * MiB, 8 * MiB]
    depths = [8, 32] if args.quick else [1, 8, 32]
    backends = args.backends.split(",") if args.backends else list(_native.io_available_backends())
    size = max(size // (8 * MiB), 1) * 8 * MiB
    workdir = tempfile.mkdtemp(prefix="bench-io-", dir=args.dir)
    path = os.path.join(workdir, "bench.bin")
    rows = []  # (name, block_bytes, queue_depth, write, read, cpu_per_gb)

    def record(name, bs, qd, result):
        if result is None:
            print(f"  {name}: skipped", file=sys.stderr)
            return
        if os.path.exists(path):
            os.unlink(path)
        rows.append((name, bs, qd) + tuple(result))
        w, r, cpu = result
        print(f"  {name:18s} bs={bs // MiB}MiB qd={qd}: write {w:.2f} read {r:.2f} GB/s",
              file=sys.stderr)

    try:
        print(f"bench_io: {size / GB:.2f} GB in {args.dir}", file=sys.stderr)
        for bs in block_sizes:
            for qd in depths:
                for backend in backends:
                    try:
                        record(f"engine:{backend}", bs, qd, bench_engine(backend, path, size, bs, qd))
                    except (OSError, RuntimeError) as error:
                        print(f"  engine:{backend} failed: {error}", file=sys.stderr)
                if shutil.which("fio"):
                    for engine in ("io_uring", "libaio"):
                        record(f"fio:{engine}", bs, qd, bench_fio(engine, path, size, bs, qd))
            record("python pwrite loop", bs, 1, bench_python_loop(path, size, bs))
            record("aiofiles", bs, 1, bench_aiofiles(path, size, bs))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def best(prefix, column):
        values = [row[column] for row in rows if row[0].startswith(prefix)]
        return max(values) if values else None

    fio_w, fio_r = best("fio:", 3), best("fio:", 4)
    aio_w, aio_r = best("aiofiles", 3), best("aiofiles", 4)

    def ratio(value, base):
        return f"{value / base:6.2f}" if base else "     -"

    header = (f"{'writer':18s} {'bs':>5s} {'qd':>3s} {'write':>6s} {'read':>6s} {'cpu s/GB':>8s} "
              f"{'w/fio':>6s} {'r/fio':>6s} {'w/aiof':>6s} {'r/aiof':>6s}")
    print(header)
    print("-" * len(header))
    for name, bs, qd, w, r, cpu in rows:
        cpu_text = f"{cpu:8.3f}" if cpu is not None else "       -"
        print(f"{name:18s} {bs // MiB:4d}M {qd:3d} {w:6.2f} {r:6.2f} {cpu_text} "
              f"{ratio(w, fio_w)} {ratio(r, fio_r)} {ratio(w, aio_w)} {ratio(r, aio_r)}")
    eng_w, eng_r = best("engine:", 3), best("engine:", 4)
    print(f"\nengine best: write {eng_w:.2f} GB/s, read {eng_r:.2f} GB/s")
    if fio_w:
        print(f"vs fio best (write {fio_w:.2f}, read {fio_r:.2f}): "
              f"write {eng_w / fio_w:.0%}, read {eng_r / fio_r:.0%}  (target >= 95%)")
    if aio_w:
        print(f"vs aiofiles (write {aio_w:.2f}, read {aio_r:.2f}): "
              f"write {eng_w / aio_w:.1f}x, read {eng_r / aio_r:.1f}x  (target >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
