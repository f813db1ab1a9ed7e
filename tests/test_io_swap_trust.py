"""[Note: swap directory trust] and [Note: SIGTERM] in offload/io/swap.py: nothing in swap_dir
is followed or trusted by name, and a SIGTERM removes the run's files as Ctrl-C does."""
import errno
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch

from offload.io import SwapSpace, aligned_empty
from offload.tiers import NvmeTier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, **env))


def test_a_planted_lock_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / ".offload.lock").symlink_to(victim)
    with pytest.raises(ValueError, match=r"\.offload\.lock is a symbolic link"):
        SwapSpace(swap)
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(swap)) == [".offload.lock"]


def test_a_symlink_named_like_a_stale_run_is_not_followed(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("precious")
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "offload-run-1-abcd").symlink_to(target)
    with pytest.warns(RuntimeWarning, match="offload-run-1-abcd, which is not a run directory") as seen:
        with SwapSpace(swap) as space:
            assert space.removed_stale_runs == []
    assert [w.filename for w in seen] == [__file__]
    assert sorted(os.listdir(target)) == ["keep"] and (target / "keep").read_text() == "precious"
    assert (swap / "offload-run-1-abcd").is_symlink()


def test_a_stale_run_holding_a_symlink_is_removed_without_following_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    swap = tmp_path / "swap"
    stale = swap / "offload-run-1-abcd"
    stale.mkdir(parents=True)
    (stale / "lock").symlink_to(victim)
    (stale / "swap-0000.bin").symlink_to(victim)
    with pytest.warns(RuntimeWarning, match="removed 1 run directory"):
        with SwapSpace(swap):
            pass
    assert not stale.exists() and victim.read_text() == "precious"


def test_a_run_directory_swapped_after_start_is_not_written_through(tmp_path):
    """Another user (or a bug) replaces the run directory by one whose swap file is a symlink:
    requests keep going to the files the run created, by descriptor."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 8192)
    swap = tmp_path / "swap"
    tier = NvmeTier(str(swap), 8192, "threads", 1 << 20, 4)
    try:
        extent = tier.allocate(8192)
        data = aligned_empty(8192).fill_(7)
        tier.write(data, extent).wait()
        run_dir = tier.space.run_dir
        os.rename(run_dir, tmp_path / "moved")
        os.mkdir(run_dir, 0o700)
        os.symlink(victim, extent.path)
        tier.write(aligned_empty(8192).fill_(9), extent).wait()
        back = aligned_empty(8192)
        tier.read(back, extent).wait()
        assert torch.equal(back, aligned_empty(8192).fill_(9))
        assert victim.read_bytes() == b"v" * 8192
    finally:
        tier.close()
    assert victim.read_bytes() == b"v" * 8192
    assert os.path.islink(os.path.join(run_dir, "swap-0000.bin")), "the stranger's directory is left alone"


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o1777, False), (0o755, False)])
def test_a_swap_dir_others_can_write_is_refused_unless_sticky(tmp_path, mode, refused):
    swap = tmp_path / "swap"
    swap.mkdir()
    os.chmod(swap, mode)
    if refused:
        with pytest.raises(ValueError, match=f"swap_dir {str(swap)!r} is writable by other users"):
            SwapSpace(swap)
        assert os.listdir(swap) == []
    else:
        with SwapSpace(swap):
            pass


def test_a_created_swap_dir_is_private(tmp_path):
    with SwapSpace(tmp_path / "new" / "swap") as space:
        assert stat.S_IMODE(os.stat(space.swap_dir).st_mode) == 0o700


WRAP_THEN = """
import os, signal, sys, torch, offload, offload.faults
from offload.gpt import GPT, GPTConfig
def sigterm_handler():
    handler = signal.getsignal(signal.SIGTERM)
    return "default" if handler is signal.SIG_DFL else handler.__module__
cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2)
model = GPT(cfg)
{before}
def during_wrap(**context):
    print(os.listdir({swap!r}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
with offload.faults.inject("wrap.done", during_wrap if {during_wrap} else (lambda **context: None)):
    engine = offload.wrap(model, torch.optim.AdamW(model.parameters()), config=dict(
        device="cpu", param_tier="nvme", optimizer_tier="nvme", swap_dir={swap!r}))
print("wrapped", sigterm_handler(), flush=True)
engine.close()
print("closed", sigterm_handler(), flush=True)
"""


def test_sigterm_during_wrap_removes_the_swap_files_and_still_kills(tmp_path):
    swap = str(tmp_path)
    result = run_python(WRAP_THEN.format(before="", swap=swap, during_wrap=True))
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "offload-run-" in result.stdout, "the swap files existed when SIGTERM came"
    assert os.listdir(swap) == []


def test_sigterm_handler_of_the_user_is_left_alone_and_ours_is_removed_on_close(tmp_path):
    swap = str(tmp_path)
    # The handler is the library's while an engine is open, SIG_DFL again after close.
    result = run_python(WRAP_THEN.format(before="", swap=swap, during_wrap=False))
    assert result.stdout.splitlines() == ["wrapped offload.io.swap", "closed default"], result.stderr
    # A handler of the user's stays theirs throughout (and SIGTERM is theirs to handle).
    user = "def mine(signum, frame):\n    print('mine', flush=True)\nsignal.signal(signal.SIGTERM, mine)"
    result = run_python(WRAP_THEN.format(before=user, swap=swap, during_wrap=True))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == ["mine", "wrapped __main__", "closed __main__"], result.stdout
    assert os.listdir(swap) == []


def test_a_forked_child_killed_by_sigterm_leaves_the_parents_swap_files(tmp_path):
    """A DataLoader worker is a fork: it inherits the space and SIGTERM's handler (and is
    sent SIGTERM when it hangs at shutdown), but the swap files stay the parent's."""
    script = f"""
import os, signal, time
from offload.io import SwapSpace
space = SwapSpace({str(tmp_path)!r}, reserve_bytes=4096)
space.allocate(4096)
child = os.fork()
if child == 0:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
    os._exit(3)
_, status = os.waitpid(child, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, sorted(os.listdir(space.run_dir)))
space.close()
"""
    result = run_python(script)
    assert result.stdout.split() == ["True", "['lock',", "'swap-0000.bin']"], result.stdout + result.stderr
    assert os.listdir(tmp_path) == []


ENDS_WITHOUT_CLOSE = """
import sys, torch, offload
from offload.gpt import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2))
engine = offload.wrap(model, torch.optim.AdamW(model.parameters()),
                      config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir={swap!r}))
b = torch.randint(0, 32, (2, 9))
engine.backward(engine(b[:, :-1], b[:, 1:]))
engine.step()
print("training", flush=True)
{end}
"""


@pytest.mark.parametrize("end,code", [("pass", 0), ("raise RuntimeError('uncaught')", 1), ("sys.exit(3)", 3)],
                         ids=["return", "uncaught", "sys.exit"])
def test_a_process_ending_without_close_removes_its_run_directory(end, code, tmp_path):
    """A script that never calls close() (it ends, raises, or calls sys.exit) leaves no run
    directory or swap file behind (before, they stayed until the next run in swap_dir)."""
    swap = str(tmp_path)
    result = run_python(ENDS_WITHOUT_CLOSE.format(swap=swap, end=end))
    assert result.returncode == code and result.stdout == "training\n", result.stderr
    assert os.listdir(swap) == []


def test_close_lists_again_what_a_directory_read_skipped(tmp_path, monkeypatch):
    """A filesystem whose directory reads skip entries while they are removed (btrfs) used to
    leave the run directory and a swap file behind, the rmdir's ENOTEMPTY swallowed: close()
    lists the directory again until it is empty. What it still cannot remove is warned
    about with its path."""
    real_scandir = os.scandir

    class OneEntryARead:  # each read of a directory returns its first entry only
        def __init__(self, fd):
            self.inner = real_scandir(fd)

        def __enter__(self):
            return iter(list(self.inner)[:1])

        def __exit__(self, *exc):
            self.inner.close()

    space = SwapSpace(tmp_path / "a", reserve_bytes=8192, file_bytes=4096)
    space.allocate(4096)
    space.allocate(4096)
    assert len(os.listdir(space.run_dir)) == 3  # the lock and two swap files
    monkeypatch.setattr(os, "scandir", OneEntryARead)
    space.close()
    monkeypatch.undo()
    assert os.listdir(tmp_path / "a") == []

    space = SwapSpace(tmp_path / "b", reserve_bytes=4096)
    space.allocate(4096)
    run_dir = space.run_dir

    def not_empty(path, dir_fd=None):
        raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
    monkeypatch.setattr(os, "rmdir", not_empty)
    with pytest.warns(RuntimeWarning, match=f"the run directory '{run_dir}' could not be removed "
                      ".Directory not empty.; remove it by hand") as caught:
        space.close()
    assert [w.filename for w in caught] == [__file__]


def test_a_held_file_is_used_by_descriptor_until_released(tmp_path):
    """[Note: held files] requests naming a held path go to the held descriptor, whatever the
    path names now; after release_file the path is resolved again."""
    from offload.io import IOEngine
    held, other = tmp_path / "held", tmp_path / "other"
    held.write_bytes(b"h" * 4096)
    other.write_bytes(b"o" * 4096)
    fd = os.open(held, os.O_RDONLY)
    try:
        with IOEngine("threads") as io:
            io.hold_file(str(held), fd)
            os.rename(held, tmp_path / "moved")
            os.symlink(other, held)
            back = aligned_empty(4096)
            io.read_into(back, str(held), 0).wait()
            assert bytes(back.numpy()) == b"h" * 4096
            with pytest.raises(OSError, match="Bad file descriptor"):  # held read-only
                io.write_from(back, str(held), 0).wait()
            assert io.release_file(str(held)) and not io.release_file(str(held))
            io.read_into(back, str(held), 0).wait()
            assert bytes(back.numpy()) == b"o" * 4096
    finally:
        os.close(fd)
