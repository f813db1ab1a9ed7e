"""Smoke tests of the benchmark tools: tools/bench_train.py --quick runs every offload row in
its own subprocess and produces a table and JSON rows with the measurements the lead's
benchmark reads; tools/bench_io.py runs every writer and its aiofiles baseline reads cold."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL = REPO_ROOT / "tools" / "bench_train.py"


def test_bench_train_quick_writes_every_row_and_the_table(tmp_path):
    out = tmp_path / "rows.json"
    swap = tmp_path / "swap"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--no-deepspeed", "--dtypes", "bf16",
         "--swap-dir", str(swap), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)  # shared CPUs: slack
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"plain", "compute-only", "host", "nvme-noprefetch", "nvme-prefetch", "io-only"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["step_seconds"] > 0 and len(row["step_seconds_all"]) == 2
        assert row["peak_rss_bytes"] > 0
    nvme = rows["nvme-prefetch"]
    # Both tiers on NVMe: every step reads the states back and writes them.
    assert nvme["nvme_read_per_step"] > 0 and nvme["nvme_written_per_step"] > 0
    assert rows["host"]["nvme_read_per_step"] == 0
    # The I/O-only row replays the NVMe row's traffic: the same bytes, up to page rounding.
    io = rows["io-only"]
    num_units = len(nvme["units"])
    slack = 4 * 4096 * num_units
    assert abs(io["nvme_read_per_step"] - nvme["nvme_read_per_step"]) <= slack
    assert abs(io["nvme_written_per_step"] - nvme["nvme_written_per_step"]) <= slack
    # The budget the offloaded rows ran under is at least the asked fraction.
    assert nvme["device_budget_bytes"] >= 0.25 * nvme["compute_copy_bytes"]

    table = proc.stdout
    for name in rows:
        assert name in table
    assert "baseline bf16: plain PyTorch step" in table
    assert "overlap" in table
    assert not any(swap.iterdir()), "swap files left behind"


BENCH_IO = REPO_ROOT / "tools" / "bench_io.py"


def _load_bench_io():
    spec = importlib.util.spec_from_file_location("bench_io", BENCH_IO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_io_drops_the_aiofiles_file_from_the_page_cache(tmp_path):
    bench_io = _load_bench_io()
    path = tmp_path / "cached.bin"
    path.write_bytes(os.urandom(4 << 20))
    if bench_io.page_cache_fraction(str(path)) < 0.9:
        pytest.skip("this filesystem does not keep written files in the page cache")
    remaining = bench_io.drop_from_page_cache(str(path))
    if remaining > 0.9:
        pytest.skip("this filesystem cannot drop its pages (tmpfs)")
    assert remaining < 0.05


def test_bench_io_small_run_has_every_writer_and_the_summary(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(BENCH_IO), "--dir", str(tmp_path), "--size", "8MiB",
         "--block-sizes", "1", "--depths", "2"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout
    for backend in ("io_uring", "libaio", "threads"):
        assert f"engine:{backend} " in table or f"engine:{backend} failed" in proc.stderr
    assert "python pwrite loop" in table and "engine best:" in table
    if shutil.which("fio"):
        assert "fio:io_uring" in table and "vs fio best" in table and "same cell" in table
    if importlib.util.find_spec("aiofiles"):
        assert "aiofiles" in table and "vs aiofiles, buffered + fsync, cold read" in table
        assert "still cached" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # its work directory is removed
