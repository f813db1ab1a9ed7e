"""Sequential write-then-read bandwidth of the I/O engine against baselines measured in the
same run, one fresh file each (removed before every write, never preallocated):

    python tools/bench_io.py --dir /mnt/nvme/tmp             # 4 GiB, full grid (~8 min)
    python tools/bench_io.py --dir /mnt/nvme/tmp --quick     # 256 MiB, few settings, < 1 min
    python tools/bench_io.py --dir /mnt/nvme/tmp --block-sizes 1 --depths 8 --repeat 3

Writers, per block size (bs) and queue depth (qd):

engine:<backend>  offload.io.IOEngine(backend, block_bytes=bs, queue_depth=qd) moving the file
    in 256 MiB requests from one buffer made by aligned_empty, as swap staging buffers are:
    2 MiB huge pages where the kernel allows (see [Note: huge-page buffers] in
    offload/io/engine.py).
engine:io_uring 4K  the same from ordinary 4 KiB pages (torch.empty, what aligned_empty gave
    before huge pages): the effect of the buffer alone. On a virtio disk (max_segments 254)
    blocks from scattered 4 KiB pages reach the device split into requests of ~0.3-1 MiB,
    from huge pages whole (up to max_sectors_kb); that, not the submission path, was the
    engine's read gap to fio. fio's malloc'ed buffers are 4 KiB pages that happen to be more
    or less contiguous from run to run, one reason its numbers are the noisiest here.
fio:<engine>  ioengine io_uring and libaio, direct=1, one file, fallocate=none, fio's default
    buffers (qd malloc'ed buffers of bs bytes), no fixedbufs, registerfiles or sqthread_poll:
    the job the engine runs. Skipped when fio is not installed.
python pwrite loop  os.pwrite / os.preadv of one reused block, O_DIRECT, one at a time.
aiofiles  aiofiles used the way people use it, as the baseline for "what you get without a
    native engine": buffered I/O (the page cache), one awaited block at a time, the write made
    durable with fsync (inside the timing: a write is not done until it is on the disk), then
    the file dropped from the page cache (posix_fadvise DONTNEED after the fsync, checked with
    mincore) so the read comes from the disk, not from RAM. Skipped when aiofiles is not
    installed. (The earlier baseline opened aiofiles with O_DIRECT: that is the Python loop
    above run in a thread, not how aiofiles is used.)

Each cell runs every writer back to back, ``--repeat`` times (rows show the median). The
summary compares bests over the whole grid (the targets) and, less noisy on a shared machine,
the median over cells of best engine / best fio within the same cell. Ratios, not absolute
numbers, are the point: the machine may be shared.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from offload import _native
import torch

from offload.io import ALIGN_BYTES, IOEngine, aligned_empty

MiB = 1 << 20
GB = 1e9
REQUEST_BYTES = 256 * MiB


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def page_cache_fraction(path: str) -> float:
    """Fraction of ``path``'s pages resident in the page cache (mincore over a mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            num_pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            resident = (ctypes.c_ubyte * num_pages)()
            if libc.mincore(address, size, resident) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return sum(page & 1 for page in resident) / num_pages
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def drop_from_page_cache(path: str) -> float:
    """Drops ``path``'s clean pages from the page cache; returns the fraction still cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return page_cache_fraction(path)


def bench_engine(backend, path, size, block_bytes, queue_depth, huge_pages=True):
    """GB/s write, GB/s read, CPU seconds per GB moved (both directions)."""
    chunk = min(size, REQUEST_BYTES)
    if huge_pages:
        buf = aligned_empty(chunk)
    else:
        raw = torch.empty(chunk + ALIGN_BYTES, dtype=torch.uint8)  # 4 KiB pages from malloc
        skip = (-raw.data_ptr()) % ALIGN_BYTES
        buf = raw[skip:skip + chunk]
    buf.fill_(7)
    spans = [(offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]
    with IOEngine(backend, block_bytes=block_bytes, queue_depth=queue_depth) as io:
        cpu0 = cpu_seconds()
        t0 = time.perf_counter()
        for offset, nbytes in spans:
            io.write_from(buf[:nbytes], path, offset)
        io.wait_all()
        t1 = time.perf_counter()
        for offset, nbytes in spans:
            io.read_into(buf[:nbytes], path, offset)
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
    """Buffered aiofiles: write + fsync timed, page cache dropped, then a cold read."""
    try:
        import aiofiles  # benchmark-only dependency
        import aiofiles.os
    except ImportError:
        return None
    view = memoryview(mmap.mmap(-1, block_bytes))
    fsync = aiofiles.os.wrap(os.fsync)

    async def write():
        async with aiofiles.open(path, "wb") as f:
            for _ in range(0, size, block_bytes):
                await f.write(view)
            await f.flush()
            await fsync(f.fileno())

    async def read():
        async with aiofiles.open(path, "rb") as f:
            while await f.readinto(view):
                pass

    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    asyncio.run(write())
    t1 = time.perf_counter()
    cpu = cpu_seconds() - cpu0
    cached = drop_from_page_cache(path)
    if cached > 0.01:
        print(f"  aiofiles: {cached:.0%} of the file still cached before the read",
              file=sys.stderr)
    cpu0 = cpu_seconds()
    t2 = time.perf_counter()
    asyncio.run(read())
    t3 = time.perf_counter()
    cpu += cpu_seconds() - cpu0
    return size / (t1 - t0) / GB, size / (t3 - t2) / GB, cpu / (2 * size / GB)


def bench_fio(engine, path, size, block_bytes, queue_depth):
    result = []
    for rw in ("write", "read"):
        cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={block_bytes}",
               f"--iodepth={queue_depth}", f"--ioengine={engine}", "--direct=1",
               f"--size={size}", "--fallocate=none", "--output-format=json"]
        if rw == "write" and os.path.exists(path):
            os.unlink(path)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return None
        job = json.loads(out.stdout)["jobs"][0]
        result.append(job[rw]["bw_bytes"] / GB)
    return result[0], result[1], None


def median_result(results):
    """Column-wise median of (write, read, cpu) tuples; cpu may be None."""
    write = statistics.median(r[0] for r in results)
    read = statistics.median(r[1] for r in results)
    cpus = [r[2] for r in results if r[2] is not None]
    return write, read, statistics.median(cpus) if cpus else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the device")
    parser.add_argument("--size", default=None, help="file size, e.g. 4GiB (default 4GiB)")
    parser.add_argument("--quick", action="store_true", help="256 MiB and few settings")
    parser.add_argument("--backends", default=None, help="comma list (default: all compiled)")
    parser.add_argument("--block-sizes", default=None,
                        help="comma list in MiB (default 1,4,8; --quick 1,8)")
    parser.add_argument("--depths", default=None, help="comma list (default 1,8,32; --quick 8,32)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each cell; rows show the median (default 1)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the Python loop and aiofiles (fio still runs)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    size = parse_size(args.size) if args.size else (256 * MiB if args.quick else 4 << 30)
    if args.block_sizes:
        block_sizes = [int(float(b) * MiB) for b in args.block_sizes.split(",")]
    else:
        block_sizes = [1 * MiB, 8 * MiB] if args.quick else [1 * MiB, 4 * MiB, 8 * MiB]
    if args.depths:
        depths = [int(d) for d in args.depths.split(",")]
    else:
        depths = [8, 32] if args.quick else [1, 8, 32]
    if any(b <= 0 or b % 4096 for b in block_sizes) or any(d < 1 for d in depths):
        parser.error("block sizes must be positive multiples of 4 KiB and depths >= 1")
    backends = args.backends.split(",") if args.backends else list(_native.io_available_backends())
    size = max(size // max(block_sizes), 1) * max(block_sizes)
    workdir = tempfile.mkdtemp(prefix="bench-io-", dir=args.dir)
    path = os.path.join(workdir, "bench.bin")
    rows = []  # (name, block_bytes, queue_depth, write, read, cpu_per_gb)

    def measure(name, bs, qd, run):
        """Runs ``run`` --repeat times, each on a fresh file; appends the median row."""
        results = []
        for _ in range(args.repeat):
            try:
                result = run()
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
                print(f"  {name} failed: {error}", file=sys.stderr)
                result = None
            if os.path.exists(path):
                os.unlink(path)
            if result is None:
                print(f"  {name}: skipped", file=sys.stderr)
                return
            results.append(result)
        w, r, cpu = median_result(results)
        rows.append((name, bs, qd, w, r, cpu))
        print(f"  {name:18s} bs={bs / MiB:g}MiB qd={qd}: write {w:.2f} read {r:.2f} GB/s",
              file=sys.stderr)

    try:
        print(f"bench_io: {size / GB:.2f} GB in {args.dir}, repeat {args.repeat}", file=sys.stderr)
        for bs in block_sizes:
            for qd in depths:
                for backend in backends:
                    measure(f"engine:{backend}", bs, qd,
                            lambda: bench_engine(backend, path, size, bs, qd))
                if "io_uring" in backends:
                    measure("engine:io_uring 4K", bs, qd,
                            lambda: bench_engine("io_uring", path, size, bs, qd, huge_pages=False))
                if shutil.which("fio"):
                    for engine in ("io_uring", "libaio"):
                        measure(f"fio:{engine}", bs, qd,
                                lambda: bench_fio(engine, path, size, bs, qd))
            if not args.no_baselines:
                measure("python pwrite loop", bs, 1, lambda: bench_python_loop(path, size, bs))
                measure("aiofiles", bs, 1, lambda: bench_aiofiles(path, size, bs))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def best(prefix, column, cell=None):
        values = [row[column] for row in rows
                  if row[0].startswith(prefix) and (cell is None or row[1:3] == cell)]
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
        print(f"{name:18s} {bs / MiB:4g}M {qd:3d} {w:6.2f} {r:6.2f} {cpu_text} "
              f"{ratio(w, fio_w)} {ratio(r, fio_r)} {ratio(w, aio_w)} {ratio(r, aio_r)}")
    eng_w, eng_r = best("engine:", 3), best("engine:", 4)
    if eng_w is None:
        print("\nno engine backend ran")
        return 1
    print(f"\nengine best: write {eng_w:.2f} GB/s, read {eng_r:.2f} GB/s")
    if fio_w:
        print(f"vs fio best (write {fio_w:.2f}, read {fio_r:.2f}): "
              f"write {eng_w / fio_w:.0%}, read {eng_r / fio_r:.0%}  (target >= 95%)")
        cells = sorted({row[1:3] for row in rows if row[0].startswith("fio:")})
        paired = [(best("engine:", 3, c) / best("fio:", 3, c), best("engine:", 4, c) / best("fio:", 4, c))
                  for c in cells if best("engine:", 3, c)]
        if paired:
            print(f"same cell, best engine / best fio, median over {len(paired)} cells: "
                  f"write {statistics.median(p[0] for p in paired):.0%}, "
                  f"read {statistics.median(p[1] for p in paired):.0%}")
    if aio_w:
        print(f"vs aiofiles, buffered + fsync, cold read (write {aio_w:.2f}, read {aio_r:.2f}): "
              f"write {eng_w / aio_w:.1f}x, read {eng_r / aio_r:.1f}x  (target >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
