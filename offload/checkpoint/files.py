"""Reading a checkpoint's files: their sha256, and ranges of them, through the native I/O engine.

[Note: checkpoint reads]
A load reads every byte of a checkpoint twice: once to check each file's sha256 before any
state changes (read_manifest), then the states themselves (PieceReader). Through the page
cache, one read at a time, a cold file comes in at well under the disk's speed, which needs
many requests in flight. So both passes read through an IOEngine: O_DIRECT (or buffered
where the filesystem refuses it, as the swap does), 1 MiB blocks, up to 32 in flight.

- ``file_digests``: each file is read in DIGEST_STAGE_BYTES stages, DIGEST_STAGES of them
  in flight, and hashed in order as they land. sha256 on one core is slower than the disk,
  so one file is bound by its hash; two files are hashed at once (hashlib lets go of the
  GIL), on two threads with an engine each.
- ``PieceReader.read``: a range straight into the caller's tensor. The engine moves an
  aligned range (buffer, offset and length on 4 KiB) at full speed; any other range goes
  through its bounce buffer, correct but one block at a time. Pieces start on whole pages
  (CHUNK_NUMEL elements), and so do the parameters of usual models.

The engine's backend is "threads" (pread on a pool of threads): it works on every
filesystem, so nothing is probed (an "auto" engine's first probe writes and reads a file in
the temporary directory, 31 MiB of buffers, and says nothing about the checkpoint's
filesystem), and it reads these large sequential files as fast as io_uring. It does not
warn about a buffered fallback: a checkpoint directory on a filesystem without O_DIRECT is
a normal place for one.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence, Tuple

import torch

from offload.io import IOEngine, aligned_empty

DIGEST_STAGE_BYTES = 8 << 20
DIGEST_STAGES = 4
DIGEST_THREADS = 2
BLOCK_BYTES = 1 << 20
QUEUE_DEPTH = 32


def reading_engine() -> IOEngine:
    """An I/O engine for reading checkpoint files (see [Note: checkpoint reads])."""
    return IOEngine("threads", block_bytes=BLOCK_BYTES, queue_depth=QUEUE_DEPTH, warn_buffered=False)


def file_digest(io: IOEngine, path: str, size: int, stages: List[torch.Tensor]) -> str:
    """The sha256 of the ``size`` bytes of ``path``, read into ``stages`` in turn."""
    digest = hashlib.sha256()
    stage_bytes = stages[0].numel()
    count = -(-size // stage_bytes)
    in_flight: Dict[int, Tuple[object, int]] = {}

    def start(i: int) -> None:
        n = min(stage_bytes, size - i * stage_bytes)
        in_flight[i] = (io.read_into(stages[i % len(stages)][:n], path, i * stage_bytes), n)

    try:
        for i in range(min(len(stages), count)):
            start(i)
        for i in range(count):
            handle, n = in_flight.pop(i)
            handle.wait()
            digest.update(memoryview(stages[i % len(stages)].numpy())[:n])
            if i + len(stages) < count:
                start(i + len(stages))
    finally:
        for handle, _ in in_flight.values():  # an error: nothing may land in a stage after this
            try:
                handle.wait()
            except OSError:
                pass
    return digest.hexdigest()


def file_digests(files: Sequence[Tuple[str, int]]) -> List[str]:
    """The sha256 of each (path, size), DIGEST_THREADS files at a time. An OSError of a
    read comes out as it is."""
    if not files:
        return []

    def worker(share: Sequence[Tuple[int, str, int]]) -> List[Tuple[int, str]]:
        stages = [aligned_empty(DIGEST_STAGE_BYTES) for _ in range(DIGEST_STAGES)]
        with reading_engine() as io:
            return [(i, file_digest(io, path, size, stages)) for i, path, size in share]

    # the largest files first, dealt in turn, so the two threads end close together
    order = sorted(range(len(files)), key=lambda i: -files[i][1])
    threads = min(DIGEST_THREADS, len(files))
    shares = [[(i, *files[i]) for i in order[t::threads]] for t in range(threads)]
    digests: List[str] = [""] * len(files)
    with ThreadPoolExecutor(threads, thread_name_prefix="offload-checkpoint-digest") as pool:
        for done in [pool.submit(worker, share) for share in shares]:
            for i, hexdigest in done.result():
                digests[i] = hexdigest
    return digests
