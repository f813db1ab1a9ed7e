"""The I/O-only replays of tools/bench_train.py: one NVMe step's swap traffic with no compute,
through offload.io.IOEngine. The io-only row times them alone; each NVMe row times them
paired with its own steps ([Overlap efficiency, paired], paired_replay); tools/bench_scale.py
replays its offload row's step with them, in the staged step's pieces.

What a replay moves is the traffic an NVMe row measured (``pattern``): its units' sizes and
the bytes per phase of its median step (median_phases). Forward and backward fetch each unit
on use; the optimizer's requests go through the staging slots in the order of the engine's
piece ring ([Note: the piece ring], offload/optim/step.py), which piece_ring below follows.

Imports train_harness only (see the graph in tools/bench_train.py).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time

from train_harness import MiB, timed_loop

PHASE_BYTES = ("forward_read", "backward_read", "optimizer_read",
               "forward_written", "backward_written", "optimizer_written")


def median_phases(probes: list) -> dict:
    """Each probe's key's median over the timed steps, but the bytes per phase (PHASE_BYTES)
    all from one step, the median one by its whole traffic (the lower of two): a sum of each
    phase's median would count work that moves between phases from step to step (deferred or
    taken-back updates) twice or not at all. The I/O-only replays replay these bytes."""
    phases = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
    moved = sorted(probes, key=lambda p: sum(p[k] for k in PHASE_BYTES))[(len(probes) - 1) // 2]
    phases.update({k: moved[k] for k in PHASE_BYTES})
    return phases


def split_pages(total: int, weights) -> list:
    """``total`` bytes split over ``weights`` in proportion, each part whole pages."""
    from offload._sizes import PAGE_BYTES

    weight_sum = sum(weights) or 1
    return [-(-int(total * w / weight_sum) // PAGE_BYTES) * PAGE_BYTES for w in weights]


@contextlib.contextmanager
def replayer(pattern: dict, spec: dict, piece_bytes=None, file_bytes=None):
    """Yields (step, backend, bytes read, bytes written per step): step() replays one NVMe
    step's swap traffic (``pattern``: the units and the median bytes per phase of an NVMe row)
    with no compute, on a file of its own in spec["swap_dir"]; the file goes when the context
    ends. The optimizer moves each unit's states in one request per unit, or, with
    ``piece_bytes``, in requests of at most that many bytes (the staged step's pieces: one
    request per fp32 state piece, as tools/bench_scale.py replays them), through
    spec["pipeline_depth"] staging slots (the engine's piece_ring). ``file_bytes``: the file's size at
    most (the row's swap size, which fit on its disk): the per-unit regions fold into it, so
    the same bytes move in the same requests through a smaller file."""
    from offload._sizes import PAGE_BYTES
    from offload.io import IOEngine, aligned_empty
    from offload.optim.step import piece_ring  # the engine's own ring ([Note: the piece ring])
    from offload.stats import Stats

    units = pattern["units"]
    phases = pattern["phases"]
    compute_w = [u["compute_bytes"] for u in units]
    master_w = [u["master_bytes"] for u in units]
    forward = split_pages(phases["forward_read"], compute_w)
    backward = split_pages(phases["backward_read"], compute_w)
    opt_read = split_pages(phases["optimizer_read"], master_w)
    # With early updates most optimizer traffic happens during backward: its reads are in
    # backward_read (replayed there, as reads), its write-backs in backward_written.
    written = phases["forward_written"] + phases["backward_written"] + phases["optimizer_written"]
    opt_write = split_pages(written, master_w)
    # One file region per unit for its compute copy and one for its optimizer states.
    compute_size = [max(a, b) for a, b in zip(forward, backward)]
    opt_size = [max(a, b) for a, b in zip(opt_read, opt_write)]
    offsets, cursor = [], 0
    for c, o in zip(compute_size, opt_size):
        offsets.append((cursor, cursor + c))
        cursor += c + o
    # The optimizer's requests in order: (file offset, bytes read, bytes written).
    requests = []
    for i in range(len(units)):
        size = piece_bytes or max(opt_size[i], 1)
        for o in range(0, opt_size[i], size):
            nread, nwrite = max(0, min(size, opt_read[i] - o)), max(0, min(size, opt_write[i] - o))
            requests.append((offsets[i][1] + o, nread, nwrite))
    size = cursor if file_bytes is None else min(cursor, file_bytes)

    def fold(offset, nbytes):  # into [0, size), page-aligned
        return offset if size == cursor else (offset % max(PAGE_BYTES, size - nbytes)) // PAGE_BYTES * PAGE_BYTES

    offsets = [(fold(a, c), b) for (a, b), c in zip(offsets, compute_size)]
    requests = [(fold(o, max(r, w)), r, w) for o, r, w in requests]
    cursor = size
    depth = spec["pipeline_depth"]
    io_buf = aligned_empty(max(compute_size + [PAGE_BYTES]))
    slots = [aligned_empty(max([max(r[1], r[2]) for r in requests] + [PAGE_BYTES])) for _ in range(depth)]
    slot_writes = [[] for _ in range(depth)]  # each slot's write-back in flight
    workdir = tempfile.mkdtemp(prefix="io-only-", dir=spec["swap_dir"])
    path = os.path.join(workdir, "swap.bin")
    try:
        with IOEngine(backend="auto", probe_dir=workdir) as io:
            fill = aligned_empty(64 * MiB).fill_(1)
            for offset in range(0, cursor, fill.numel()):
                io.write_from(fill[:min(fill.numel(), cursor - offset)], path, offset)
            io.wait_all()
            del fill

            def start_reads(k, slot):
                while slot_writes[slot]:  # the slot's previous piece is on disk first
                    slot_writes[slot].pop().wait()
                offset, nread, _ = requests[k]
                return [io.read_into(slots[slot][:nread], path, offset)] if nread else []

            def update(k, slot):  # no Adam: the piece's write-back
                offset, _, nwrite = requests[k]
                slot_writes[slot] = [io.write_from(slots[slot][:nwrite], path, offset)] if nwrite else []

            def step():
                for i in range(len(units)):  # forward: fetch on use, in unit order
                    if forward[i]:
                        io.read_into(io_buf[:forward[i]], path, offsets[i][0]).wait()
                for i in reversed(range(len(units))):
                    if backward[i]:
                        io.read_into(io_buf[:backward[i]], path, offsets[i][0]).wait()
                piece_ring(len(requests), list(range(depth)), start_reads, update, Stats())
                io.wait_all()
                for writes in slot_writes:
                    writes.clear()

            yield step, io.backend, sum(forward) + sum(backward) + sum(opt_read), sum(opt_write)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_io_only(spec: dict) -> dict:
    """The io-only row: replays one NVMe step's swap traffic (spec["pattern"]) with no compute."""
    pattern = spec["pattern"]
    with replayer(pattern, spec) as (step, backend, read, written):
        seconds, _ = timed_loop(step, spec["warmup"], spec["steps"])
    return {"step_seconds_all": seconds, "nvme_read_per_step": read, "nvme_written_per_step": written,
            "note": f"replay of {pattern['source']} ({backend})"}


def paired_replay(engine_step, settle, pattern: dict, spec: dict) -> dict:
    """[Overlap efficiency, paired] spec["steps"] pairs of one more timed engine step and a
    replay of the row's own swap traffic with no compute, right after it: the disk's speed
    drifts by 1.5x and more between minutes here, so each step is compared with an I/O-only
    step taken seconds after it rather than with the io-only row, taken minutes later.

    A pair is: an untimed engine step, the timed one (its forward finishes the updates the
    previous step left to the optimizer worker, as in the timed loop), ``settle()`` (untimed:
    the updates the timed step left, and their swap writes, finish before the replay starts,
    so that they do not slow the replay down), then the timed replay. Still in flight during
    the replay's first moments: the prefetch of the next pass's first units."""
    steps, replays = [], []
    with replayer(pattern, spec) as (replay, _backend, _read, _written):
        replay()  # untimed: the replay's buffers are touched for the first time
        for _ in range(spec["steps"]):
            engine_step()
            start = time.perf_counter()
            engine_step()
            steps.append(time.perf_counter() - start)
            settle()
            start = time.perf_counter()
            replay()
            replays.append(time.perf_counter() - start)
    return {"paired_step_seconds": steps, "paired_io_seconds": replays}
