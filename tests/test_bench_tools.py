"""Smoke tests of tools/bench_train.py: --quick runs every offload row in its own subprocess
and produces a table and JSON rows with the measurements the lead's benchmark reads; with
--nproc 2 every row runs on two fresh ranks and reports per-rank memory."""
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


def test_bench_train_nproc_2_quick_reports_each_stage_per_rank(tmp_path):
    out = tmp_path / "rows.json"
    swap = tmp_path / "swap"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--nproc", "2", "--quick", "--dtypes", "fp32",
         "--swap-dir", str(swap), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)  # shared CPUs: slack
    assert proc.returncode == 0, proc.stdout + proc.stderr

    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["ddp", "stage0", "stage1", "stage2", "stage3"]
    assert report["config"]["batch"] == 2 and report["config"]["nproc"] == 2
    for row in rows.values():
        assert "error" not in row, row
        assert row["step_seconds"] > 0 and len(row["step_seconds_all"]) == 2
        ranks = row["per_rank"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["peak_rss_bytes"] > 0 for r in ranks)
        assert row["peak_rss_bytes"] == max(r["peak_rss_bytes"] for r in ranks)
        # The row's step is the slowest rank's: never shorter than a rank's own median.
        assert row["step_seconds"] >= min(r["step_seconds"] for r in ranks)

    def each(row, key):
        return [r[key] for r in rows[row]["per_rank"]]

    # ddp: every rank holds both Adam moments and a gradient of every parameter.
    from offload.gpt import GPT, GPTConfig

    model_cfg = report["config"]["model"]
    numel = sum(p.numel() for p in GPT(GPTConfig(**model_cfg)).parameters())
    assert each("ddp", "optimizer_state_bytes") == [2 * 4 * numel] * 2
    assert each("ddp", "gradient_bytes") == [4 * numel] * 2
    # Offload, fp32 (the compute copy is the master): stage 0 holds both moments on every
    # rank, stage 1 half of them (each unit's shard padded to a page), stage 2 also half the
    # gradients.
    page_slack = len(rows["stage0"]["units"]) * 2 * 4096
    full_state = each("stage0", "optimizer_state_bytes")
    full_grad = each("stage0", "gradient_bytes")
    assert full_state[0] == full_state[1] >= 2 * 4 * numel
    for stage in ("stage1", "stage2", "stage3"):
        for half in each(stage, "optimizer_state_bytes"):
            assert full_state[0] / 2 <= half <= full_state[0] / 2 + page_slack, (stage, half)
    assert all(g >= full_grad[0] for g in each("stage1", "gradient_bytes"))
    assert sum(each("stage2", "gradient_bytes")) == sum(each("stage3", "gradient_bytes")) == full_grad[0]
    # Stage 3 also halves the compute copies at home (fp32: they are the masters).
    assert each("ddp", "parameter_bytes") == [4 * numel] * 2
    for stage in ("stage0", "stage1", "stage2"):
        assert each(stage, "parameter_bytes")[0] >= 4 * numel
    for half in each("stage3", "parameter_bytes"):
        assert each("stage0", "parameter_bytes")[0] / 2 <= half <= each("stage0", "parameter_bytes")[0] / 2 + page_slack
    for stage in ("stage0", "stage1", "stage2", "stage3"):
        assert all(r > 0 for r in each(stage, "nvme_read_per_step")), stage
        assert all(w > 0 for w in each(stage, "nvme_written_per_step")), stage
        assert all(d > 0 for d in each(stage, "device_peak_bytes")), stage

    table = proc.stdout
    for name in ("ddp", "stage0", "stage1", "stage2", "stage3", "x ddp", "opt MiB/rank", "param MiB/rank"):
        assert name in table
    assert "baseline fp32: DDP step" in table
    assert not any(swap.iterdir()), "swap files left behind"
