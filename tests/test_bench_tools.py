"""Smoke test of tools/bench_train.py: --quick runs every offload row in its own subprocess
and produces a table and JSON rows with the measurements the lead's benchmark reads."""
import json
import os
import subprocess
import sys
from pathlib import Path

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
