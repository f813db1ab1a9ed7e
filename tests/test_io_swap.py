"""SwapSpace: preflight, the per-directory lock, stale-run cleanup, the extent allocator."""
import os
import random
import stat
import subprocess
import sys

import pytest
import torch

from offload.io import Extent, IOEngine, SwapSpace, aligned_empty
from offload.io.swap import ExtentAllocator


def make_allocator(file_bytes):
    return ExtentAllocator(file_bytes, lambda index, nbytes: f"file{index}")


@pytest.mark.parametrize("seed", range(20))
def test_allocator_matches_reference_model(seed):
    rng = random.Random(seed)
    file_bytes = 64 * 4096
    alloc = make_allocator(file_bytes)
    live = {}  # extent -> set of (path, page) it owns: the reference model
    for _ in range(400):
        if live and rng.random() < 0.45:
            ext = rng.choice(list(live))
            alloc.free(ext)
            del live[ext]
        else:
            nbytes = rng.choice([1, 4096, 5000, rng.randrange(1, 20 * 4096), 70 * 4096])
            ext = alloc.allocate(nbytes)
            assert ext.offset % 4096 == 0 and ext.nbytes % 4096 == 0 and ext.nbytes >= nbytes
            pages = {(ext.path, ext.offset // 4096 + i) for i in range(ext.nbytes // 4096)}
            for other in live.values():
                assert not (pages & other), "overlapping extents"
            live[ext] = pages
        assert alloc.used_bytes == sum(e.nbytes for e in live)
        free = sum(n for _, _, n in alloc.free_ranges())
        assert free + alloc.used_bytes == alloc.capacity_bytes, "leaked bytes"
    capacity = alloc.capacity_bytes
    for ext in list(live):
        alloc.free(ext)
    # Everything coalesced back: one free range per file, reused before growing.
    ranges = alloc.free_ranges()
    assert len(ranges) == len({p for p, _, _ in ranges}) and all(o == 0 for _, o, _ in ranges)
    biggest = max(n for _, _, n in ranges)
    alloc.allocate(biggest)
    assert alloc.capacity_bytes == capacity


def test_allocator_refuses_double_free():
    alloc = make_allocator(1 << 20)
    ext = alloc.allocate(4096)
    alloc.free(ext)
    with pytest.raises(ValueError, match="not an allocated extent"):
        alloc.free(ext)


def test_swap_space_files_modes_and_io(tmp_path):
    with SwapSpace(tmp_path / "swap", reserve_bytes=1 << 20, file_bytes=1 << 20) as space:
        assert stat.S_IMODE(os.stat(space.run_dir).st_mode) == 0o700
        exts = [space.allocate(300_000) for _ in range(5)]  # grows past one file
        assert space.capacity_bytes >= 2 << 20 and space.used_bytes == 5 * 303104
        for ext in exts:
            assert stat.S_IMODE(os.stat(ext.path).st_mode) == 0o600
        with IOEngine("auto") as io:
            data = [aligned_empty(e.nbytes).random_(0, 256) for e in exts]
            for d, e in zip(data, exts):
                io.write_from(d, e.path, e.offset)
            io.wait_all()
            for d, e in zip(data, exts):
                back = aligned_empty(e.nbytes)
                io.read_into(back, e.path, e.offset).wait()
                assert torch.equal(back, d)
        for e in exts:
            space.free(e)
        assert space.used_bytes == 0
        run_dir = space.run_dir
    assert not os.path.exists(run_dir)
    space.close()  # idempotent


def test_second_space_on_same_directory_names_the_holder(tmp_path):
    with SwapSpace(tmp_path, file_bytes=1 << 20):
        with pytest.raises(RuntimeError, match=f"pid {os.getpid()}"):
            SwapSpace(tmp_path, file_bytes=1 << 20)
    with SwapSpace(tmp_path, file_bytes=1 << 20):  # released on close
        pass


def test_stale_run_of_dead_process_is_removed(tmp_path):
    script = ("import os; from offload.io import SwapSpace; "
              f"s = SwapSpace({str(tmp_path)!r}, file_bytes=1 << 20); s.allocate(4096); "
              "print(s.run_dir, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    stale = out.stdout.strip()
    assert os.path.isdir(stale)
    with SwapSpace(tmp_path, file_bytes=1 << 20) as space:
        assert stale in space.removed_stale_runs
        assert not os.path.exists(stale)


def test_live_foreign_run_dir_is_left_alone(tmp_path):
    live = tmp_path / "offload-run-1-abcd"
    live.mkdir()
    (live / "lock").write_text("1\n")  # pid 1 is alive
    with pytest.warns(RuntimeWarning, match="live process"):
        with SwapSpace(tmp_path, file_bytes=1 << 20) as space:
            assert (str(live), 1) in space.live_runs
    assert live.exists()


def test_preflight_errors_name_the_directory(tmp_path):
    with pytest.raises(ValueError, match="needs") as info:
        SwapSpace(tmp_path, reserve_bytes=1 << 60)
    assert str(tmp_path) in str(info.value) and "free" in str(info.value)
    plain = tmp_path / "file"
    plain.write_text("x")
    with pytest.raises(ValueError, match="not a directory|cannot be created"):
        SwapSpace(plain)
    with pytest.raises(ValueError, match="cannot be created"):
        SwapSpace(plain / "sub")
    assert not any(p.name.startswith("offload-run-") for p in tmp_path.iterdir())


def test_extent_is_plain_record():
    assert Extent("p", 0, 4096) == Extent("p", 0, 4096)
