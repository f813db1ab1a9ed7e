"""SwapSpace: preflight, the per-directory lock, stale-run cleanup, the extent allocator."""
import fcntl
import os
import random
import stat
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import offload
from offload.gpt import GPT, GPTConfig
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


def test_run_dir_whose_lock_is_held_is_left_alone(tmp_path):
    live = tmp_path / "offload-run-1-abcd"
    live.mkdir()
    (live / "lock").write_text("1\n")
    with open(live / "lock", "r+") as held:  # a live run holds the flock on its lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.warns(RuntimeWarning, match="live process") as seen:
            with SwapSpace(tmp_path, file_bytes=1 << 20) as space:
                assert (str(live), 1) in space.live_runs and space.removed_stale_runs == []
        assert [w.filename for w in seen] == [__file__]  # the caller's line
    assert live.exists()


def test_stale_run_whose_pid_is_reused_is_removed_and_reported(tmp_path):
    """[Note: stale runs] The flock, not the pid, says whether a run is alive: in a container
    the dead trainer's pid is often the new one's (here: this very process, alive)."""
    stale = tmp_path / f"offload-run-{os.getpid()}-abcd"
    stale.mkdir(mode=0o700)
    (stale / "lock").write_text(f"{os.getpid()}\n")
    (stale / "swap-0000.bin").write_bytes(b"x" * (1 << 20))
    with pytest.warns(RuntimeWarning, match=r"removed 1 run directory of killed runs, freeing \d+ bytes") as seen:
        with SwapSpace(tmp_path, file_bytes=1 << 20) as space:
            assert space.removed_stale_runs == [str(stale)] and space.live_runs == []
            assert space.stale_bytes_removed >= 1 << 20
    assert str(stale) in str(seen[0].message)
    assert [w.filename for w in seen] == [__file__]
    assert not stale.exists()


def test_swap_files_are_sized_from_the_plan(tmp_path):
    """A run needing 10 MiB gets 10 MiB of swap file, not a 1 GiB file: on a 256 MiB
    filesystem it fits, and the preflight checked exactly what is created."""
    planned = [3 << 20, 4096, 7 << 20]
    with SwapSpace(tmp_path, reserve_bytes=sum(planned)) as space:
        extents = [space.allocate(n) for n in planned]
        assert space.capacity_bytes == space.used_bytes == sum(planned)
        files = sorted(os.listdir(space.run_dir))
        assert files == ["lock", "swap-0000.bin"]
        assert os.path.getsize(os.path.join(space.run_dir, "swap-0000.bin")) == sum(planned)
        assert {e.path for e in extents} == {os.path.join(space.run_dir, "swap-0000.bin")}
        more = space.allocate(8192)  # beyond the plan: grows by what was asked, not by a plan
        assert space.capacity_bytes == sum(planned) + 8192 and more.offset == 0


def test_an_empty_extent_moves_nothing(tmp_path):
    with SwapSpace(tmp_path, reserve_bytes=4096) as space, IOEngine("threads") as io:
        empty = space.allocate(0)
        space.hold_files(io.hold_file)
        assert empty.nbytes == 0 and space.used_bytes == 0
        assert io.write_from(torch.empty(0, dtype=torch.uint8), empty.path, empty.offset).wait() == 0
        assert io.read_into(torch.empty(0, dtype=torch.uint8), empty.path, empty.offset).wait() == 0
        space.free(empty)


def test_preflight_errors_name_the_directory(tmp_path):
    with pytest.raises(ValueError, match="needs") as info:
        SwapSpace(tmp_path, reserve_bytes=1 << 60)
    assert str(tmp_path) in str(info.value) and "free" in str(info.value)
    plain = tmp_path / "file"
    plain.write_text("x")
    for swap_dir in (plain, plain / "sub"):  # the file in the way is named, not "File exists"
        with pytest.raises(ValueError, match=f"cannot be created: '{plain}' exists and is not a directory"):
            SwapSpace(swap_dir)
    assert not any(p.name.startswith("offload-run-") for p in tmp_path.iterdir())


def test_extent_is_plain_record():
    assert Extent("p", 0, 4096) == Extent("p", 0, 4096)


# ---------------------------------------------------------------------- through the engine
class Blocks(torch.nn.Module):
    """Every parameter in a ModuleList: the root unit has no elements."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def train_blocks(tmp_path, tier):
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with offload.wrap(model, optimizer, config=dict(device="cpu", param_tier=tier, optimizer_tier=tier,
                                                    swap_dir=str(tmp_path))) as engine:
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).square().mean())
            engine.step()
        stats = engine.stats()
        return engine.state_dict(), stats


def test_a_model_with_an_empty_root_trains_on_nvme_as_on_host(tmp_path):
    on_host, _ = train_blocks(tmp_path, "host")
    on_nvme, stats = train_blocks(tmp_path, "nvme")
    assert stats["nvme_bytes"] > 0
    assert on_host.keys() == on_nvme.keys()
    for name in on_host:
        assert torch.equal(on_host[name], on_nvme[name]), name


def test_wrap_sizes_the_swap_file_from_its_plan_and_reports_stale_runs(tmp_path):
    stale = tmp_path / "offload-run-999999-dead"
    stale.mkdir(mode=0o700)
    (stale / "swap-0000.bin").write_bytes(b"x" * (1 << 20))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2))
    with pytest.warns(RuntimeWarning, match="removed 1 run directory") as seen:
        engine = offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(
            device="cpu", param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path)))
    # at the user's wrap() line, not inside offload's tiers
    assert [w.filename for w in seen if "removed 1 run" in str(w.message)] == [__file__]
    with engine:
        stats = engine.stats()
        space = engine.debug.nvme.space
        assert stats["stale_swap_bytes_removed"] >= 1 << 20
        # The plan is what wrap allocates: one file, exactly that size (it was 1 GiB).
        assert space.capacity_bytes == space.used_bytes == stats["nvme_bytes"] == space.reserve_bytes
        assert os.path.getsize(os.path.join(space.run_dir, "swap-0000.bin")) == stats["nvme_bytes"] < 1 << 20


def test_a_swap_dir_without_o_direct_is_said_once_at_the_users_wrap(tmp_path):
    """tmpfs accepts O_DIRECT without honoring it: SwapSpace says so at wrap, at the user's
    line, and the run's I/O engine does not say it again for each swap file (it did, from
    inside offload/tiers/nvme.py)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = os.path.join("/dev/shm", f"offload-test-wrap-{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(
                    device="cpu", param_tier="nvme", optimizer_tier="nvme", swap_dir=directory)) as engine:
                b = torch.randint(0, 64, (2, 17))
                engine.backward(engine(b[:, :-1], b[:, 1:]))
                engine.step()
                engine.state_dict()
        said = [(w.filename, str(w.message)) for w in caught if "O_DIRECT" in str(w.message)]
        assert len(said) == 1 and said[0][0] == __file__, said
        assert "does not honor O_DIRECT" in said[0][1]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
