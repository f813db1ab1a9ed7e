"""Smoke tests of the benchmarks: tools/bench_train.py --quick runs every offload row in its
own subprocess and produces a table and JSON rows with the measurements the lead's benchmark
reads; with --nproc 2 every row runs on two fresh ranks and reports per-rank memory;
tools/bench_adam.py prints every row and the CPU model, and its native bandwidth yardsticks
compute what they claim to (their timing is never asserted); tools/bench_optim.py prints every
optimizer's rows with the bytes per parameter of its one-pass step and the bound they imply; tools/bench_io.py runs every
writer and its aiofiles baseline reads cold; tools/bench_checksum.py times every CRC32C
kernel beside its read yardstick; bench_train.py's --model and --swap-checksums reach the
engine's config."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload import _native

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS_DIR = REPO_ROOT / "tools"
TOOL = TOOLS_DIR / "bench_train.py"
ROWS_TOOL = TOOLS_DIR / "train_rows.py"
REPLAY_TOOL = TOOLS_DIR / "train_replay.py"
ADAM_TOOL = REPO_ROOT / "tools" / "bench_adam.py"
SUMMARY_TOOL = REPO_ROOT / "tools" / "trace_summary.py"
CHECKSUM_TOOL = REPO_ROOT / "tools" / "bench_checksum.py"
OPTIM_TOOL = REPO_ROOT / "tools" / "bench_optim.py"


def load_tool(path: Path):
    """A module of tools/, loaded from its file; tools/ goes on sys.path, as for a script
    run from there, since the modules of tools/bench_train.py import each other by name."""
    if str(TOOLS_DIR) not in sys.path:
        sys.path.insert(0, str(TOOLS_DIR))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_summary_takes_the_union_of_each_lane_inside_each_phase(tmp_path):
    """Two overlapping NVMe reads count once; spans are clipped to the phase; the busiest
    lane and the main thread's idle share follow from the unions."""
    def span(cat, name, start_ms, end_ms, tid=1):
        return {"name": name, "cat": cat, "ph": "X", "pid": 1, "tid": tid,
                "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3}

    events = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "phase"}},
        span("phase", "forward", 0, 100), span("phase", "backward", 100, 300),
        span("phase", "optimizer step", 300, 400),
        span("compute", "forward a", 0, 40), span("compute", "forward b", 60, 100),
        span("nvme read", "read 1 MiB", 10, 50, 3), span("nvme read", "read 1 MiB", 30, 70, 4),
        span("nvme write", "write 1 MiB", 60, 80, 5),
        span("compute", "backward b", 100, 300),
        span("adam", "adam b", 250, 350),  # half in backward, half in the step
        span("optimizer", "update b (early)", 240, 400),  # wraps the update: never "busiest"
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rows = {r["phase"]: r for r in load_tool(SUMMARY_TOOL).summarize(str(path))}
    forward = rows["forward"]
    assert forward["seconds"] == pytest.approx(0.1)
    assert forward["busy"]["nvme read"] == pytest.approx(0.06)   # 10..70, counted once
    assert forward["busy"]["nvme any"] == pytest.approx(0.07)    # 10..80
    assert forward["busy"]["compute"] == pytest.approx(0.08)
    assert forward["busiest"] == "compute"
    assert forward["main_idle"] == pytest.approx(0.2)
    assert rows["backward"]["busy"]["adam"] == pytest.approx(0.05)
    step = rows["optimizer step"]
    assert step["busy"]["adam"] == pytest.approx(0.05) and step["busiest"] == "adam"
    assert step["busy"]["optimizer"] == pytest.approx(0.1)
    assert step["main_idle"] == pytest.approx(1.0)


def test_trace_summary_cli_names_a_file_that_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, str(SUMMARY_TOOL), str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "bad.json" in proc.stderr


def test_bench_train_clip_rows_run_speculative_and_serialized_steps(tmp_path):
    """The clipping rows (on request only): clipping on but never triggering, with and
    without speculative updates; both train and write their states every step."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--no-deepspeed", "--dtypes", "fp32", "--rows", "nvme-clip",
         "nvme-clip-serial", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"nvme-clip", "nvme-clip-serial"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["step_seconds"] > 0 and row["nvme_written_per_step"] > 0


def test_bench_train_quick_writes_every_row_and_the_table(tmp_path):
    out = tmp_path / "rows.json"
    swap = tmp_path / "swap"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--no-deepspeed", "--dtypes", "bf16",
         "--swap-dir", str(swap), "--json", str(out), "--trace-dir", str(tmp_path / "traces")],
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
    # Each NVMe row compared its steps with replays of its own traffic, pair by pair; its
    # RSS is that of the timed steps, before the replay's buffers.
    for name in ("nvme-noprefetch", "nvme-prefetch"):
        r = rows[name]
        assert len(r["paired_step_seconds"]) == len(r["paired_io_seconds"]) == 2
        assert all(t > 0 for t in r["paired_step_seconds"] + r["paired_io_seconds"])
    assert "paired_step_seconds" not in rows["host"]
    # The budget the offloaded rows ran under is at least the asked fraction.
    assert nvme["device_budget_bytes"] >= 0.25 * nvme["compute_copy_bytes"]

    table = proc.stdout
    for name in rows:
        assert name in table
    assert "baseline bf16: plain PyTorch step" in table
    assert "overlap" in table
    assert not any(swap.iterdir()), "swap files left behind"
    # --trace-dir: each NVMe row exported its trace, summarized after the table.
    for name in ("nvme-noprefetch", "nvme-prefetch"):
        assert Path(rows[name]["trace"]) == tmp_path / "traces" / f"{name}-bf16.json"
        assert f"trace of {name} bf16" in table
    summary = table.split("trace of nvme-prefetch bf16", 1)[1]
    for phase in ("forward", "backward", "optimizer step"):
        assert phase in summary


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
    assert list(rows) == ["ddp", "fsdp2", "stage0", "stage1", "stage2", "stage3"]
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
    # fsdp2: each rank holds its shard of the parameters and both moments (dim-0 shards,
    # padded to whole rows: within a row of each parameter of the half).
    row_slack = sum(4 * p[0].numel() for p in GPT(GPTConfig(**model_cfg)).parameters())
    assert 4 * numel / 2 - row_slack <= min(each("fsdp2", "parameter_bytes"))
    assert sum(each("fsdp2", "parameter_bytes")) == 4 * numel
    assert sum(each("fsdp2", "optimizer_state_bytes")) == 2 * 4 * numel
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
    # Gradients device->host per step: the whole at stages 0/1, the rank's fp32 shard at 2/3
    # (after the reduce-scatter on the device); stage 3 gathers whole slots. On NVMe tiers a
    # fetch reads the swap file into the slot: no host->device bytes.
    for stage in ("stage0", "stage1"):
        assert each(stage, "device_to_host_per_step") == [4 * numel] * 2, stage
    for stage in ("stage2", "stage3"):
        assert sum(each(stage, "device_to_host_per_step")) == 4 * numel, stage
    gathered = each("stage3", "all_gather_per_step")
    assert gathered[0] == gathered[1] > 0
    assert each("stage0", "host_to_device_per_step") == each("stage3", "host_to_device_per_step") == [0, 0]
    for stage in ("stage0", "stage1", "stage2", "stage3"):
        assert all(r > 0 for r in each(stage, "nvme_read_per_step")), stage
        assert all(w > 0 for w in each(stage, "nvme_written_per_step")), stage
        assert all(d > 0 for d in each(stage, "device_peak_bytes")), stage

    table = proc.stdout
    for name in ("ddp", "fsdp2", "stage0", "stage1", "stage2", "stage3", "x ddp", "opt MiB/rank", "param MiB/rank",
                 "d2h MiB/st/rank", "gath MiB/st/rank"):
        assert name in table
    assert "baseline fp32: DDP step" in table
    assert not any(swap.iterdir()), "swap files left behind"


def test_bench_zero_summary_puts_each_stage_beside_its_peers_and_the_formulas():
    """The summary of tools/bench_zero.py: step ratios to DDP and FSDP2 of the same table,
    rank 0's device->host bytes beside P x 4 (fp32, stages 0/1) or P x 4 / N (2/3)."""
    bench_zero = load_tool(TOOLS_DIR / "bench_zero.py")
    MiB = 1 << 20
    params = 1 << 20

    def row(name, step, **rank0):
        return {"row": name, "dtype": "fp32", "step_seconds": step, "per_rank": [dict(rank0), {}]}
    rows = [row("ddp", 1.0, parameter_bytes=4 * params), row("fsdp2", 2.0),
            row("stage0", 1.5, device_to_host_per_step=4 * params, all_gather_per_step=0,
                host_to_device_per_step=3 * MiB),
            row("stage2", 1.2, device_to_host_per_step=2 * params + 4096, all_gather_per_step=0),
            row("stage3", 1.1, device_to_host_per_step=2 * params, all_gather_per_step=3 * MiB),
            {"row": "stage1", "dtype": "fp32", "error": "rank 1: boom"}]
    out = __import__("io").StringIO()
    bench_zero.summary([(2, "host", rows)], out)
    lines = {ln.split()[3]: ln.split() for ln in out.getvalue().splitlines()[2:]}
    # columns: ranks tier dtype config step "x ddp" "x fsdp2" d2h formula gath "st0 h2d"
    assert lines["stage0"][4:11] == ["1.500", "1.50", "0.75", "4.00", "4.00", "0.00", "-"]
    assert lines["stage2"][7:9] == ["2.00", "2.00"]  # P x 4 / 2
    assert lines["stage3"][9:11] == ["3.00", "3.00"]  # gathered beside stage 0's host->device
    assert "FAILED: rank 1: boom" in out.getvalue()
    assert bench_zero.formula_device_to_host(1, params, 4, "bf16") == 2 * params
    assert bench_zero.formula_device_to_host(3, params, 4, "bf16") == params


def test_bench_adam_prints_limits_every_isa_and_the_copy_out_cost():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, str(ADAM_TOOL), "--sizes", "300K"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout
    for row in ["stream triad, torch (16 B)", "stream triad, NT stores (12 B)",
                "adam traffic, no math (28 B)", "torch AdamW fused", "torch AdamW foreach"]:
        assert row in table
    for isa in _native.adam_available_isas():
        assert f"offload {isa} fp32" in table and f"offload {isa} +bf16 copy" in table
    assert "of triad" in table and "of traffic" in table
    assert "bf16 copy-out, time over the fp32 step: " in table
    assert re.search(r"^0.3M params on \S.*, \d+ native threads", table, re.MULTILINE), table


def test_bench_optim_prints_every_optimizer_with_its_bytes_per_param_and_bound():
    """Each optimizer's rows (the engine's step, the generic path where a native kernel
    replaces it, torch's flags), the bytes its one-pass step moves per parameter, and the
    bound those bytes imply at the triad bandwidth measured in that optimizer's rounds."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, str(OPTIM_TOOL), "--quick", "--size", "100K", "--rounds", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout
    assert re.search(r"^0.1M fp32 params on \S.*, 2 native threads, 2 torch threads", table, re.MULTILINE), table
    expected = {
        ("SGD momentum", "offload engine: native"): 20, ("SGD momentum", "offload generic"): 20,
        ("SGD momentum", "torch fused"): 20, ("SGD momentum", "torch foreach"): 20,
        ("SGD nesterov wd", "offload engine: native"): 20, ("SGD nesterov wd", "offload generic"): 20,
        ("SGD nesterov wd", "torch fused"): 20, ("SGD nesterov wd", "torch foreach"): 20,
        ("Adagrad", "offload engine: native"): 20, ("Adagrad", "offload generic"): 20,
        ("Adagrad", "torch fused"): 20, ("Adagrad", "torch foreach"): 20,
        ("RMSprop", "offload engine: native"): 20, ("RMSprop", "offload generic"): 20,
        ("RMSprop", "torch foreach"): 20,
        ("Lion", "offload engine: generic"): 20, ("Lion", "torch for-loop"): 20,
        ("Adafactor", "offload engine: generic"): 16, ("Adafactor", "torch foreach"): 16,
        ("Adafactor", "torch for-loop"): 16,
        ("AdamW", "offload engine: native adam"): 28, ("AdamW", "torch fused"): 20 + 8,
        ("AdamW", "torch foreach"): 28,
    }
    rows = {}
    for line in table.splitlines():
        key = (line[:18].strip(), line[19:47].strip())
        if key in expected:
            rows[key] = line[47:].split()  # ms, Gparam/s, B/param, triad GB/s, bound, x bound, vs torch
    assert rows.keys() == expected.keys(), table
    for key, fields in rows.items():
        assert int(fields[2]) == expected[key], (key, fields)
        assert float(fields[4]) == pytest.approx(float(fields[3]) / expected[key], rel=0.01, abs=0.002), (key, fields)


def test_bench_compact_prints_every_row_its_bytes_and_bound():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_compact.py"), "--sizes", "300K",
                           "--rounds", "3", "--reference-numel", "50K"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout
    rows = {line[:38].strip(): line[38:].split() for line in table.splitlines() if line[38:39] == " "}
    assert rows["exact CPUAdam, fp32 master, bf16 copy"][2] == "28.00"
    assert rows["exact CPUAdam, fp32 master, bf16 copy"][-1] == "1.00"  # the baseline
    assert rows["torch AdamW fused (fp32)"][2] == "28.00"
    for isa in _native.adam_available_isas():
        name = "compact native scalar (0.05M)" if isa == "scalar" else f"compact native {isa}"
        assert rows[name][2] == "14.06"  # 12.06 of states and grad, 2 of the grad check
    assert rows["compact torch-ops (0.05M)"][2] == "12.06"
    assert "stream triad, NT stores (12 B)" in rows and "stream triad, torch (16 B)" in rows
    assert re.search(r"^0.3M params on \S.*, 2 native threads, 2 torch threads; the triad: ", table, re.MULTILINE), table


def test_bench_compact_pieces_times_each_piece_size_beside_the_whole_unit_baseline(tmp_path):
    """[Note: compact pieces] The step, save and load rows of the small GPT: the pieces each
    moves (a block of 1.77M parameters is 2 pieces of 1 Mi and 7 of 256 Ki; a save writes a
    piece per parameter and CHUNK_NUMEL; a load a window per 256 Ki of a paged home), each
    section's baseline first at 1.00, and the swap directory left as it was."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_compact_pieces.py"), "--swap-dir",
                           str(tmp_path), "--quick", "--rounds", "1"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:28].strip(): line[28:].split() for line in proc.stdout.splitlines()[2:]}
    pieces = {name: int(fields[0]) for name, fields in rows.items()}
    assert pieces == {"step, whole units": 5, "step, pieces of 1024 Ki": 10, "step, pieces of 256 Ki": 35,
                      "save, whole": 48, "save, pieces of 1024 Ki": 49, "save, pieces of 256 Ki": 73,
                      "load, whole": 5, "load, pieces of 1024 Ki": 10, "load, pieces of 256 Ki": 35}, proc.stdout
    for name in ("step, whole units", "save, whole", "load, whole"):
        assert rows[name][2] == "1.00" and rows[name][3] == "-"
    assert "8.7M params (d_model 384, 4 layers)" in proc.stdout and not list(tmp_path.iterdir())


@pytest.mark.parametrize("numel", [1, 3, 5, 4097, 2 * 2**16 + 77])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_stream_triad_computes_b_plus_scalar_c_at_any_alignment(numel, offset):
    # offset shifts a off 16-byte alignment: the streaming stores need a scalar head.
    gen = torch.Generator().manual_seed(numel)
    b, c = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    a = torch.full((numel + offset,), float("nan"))[offset:]
    _native.stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), numel, 0.5)
    torch.testing.assert_close(a, b + 0.5 * c, rtol=1e-6, atol=0)


@pytest.mark.parametrize("numel", [1, 527, 529, 2 * 2**16 + 77])
def test_adam_traffic_adds_grad_to_param_and_both_moments(numel):
    gen = torch.Generator().manual_seed(numel)
    param, grad, exp_avg, exp_avg_sq = (torch.randn(numel, generator=gen) for _ in range(4))
    expected = [t + grad for t in (param, exp_avg, exp_avg_sq)]
    _native.adam_traffic(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                         exp_avg_sq.data_ptr(), numel)
    for got, want in zip((param, exp_avg, exp_avg_sq), expected):
        assert torch.equal(got, want)


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


def test_overlap_is_paired_step_by_step_when_the_row_has_its_own_replays():
    bench = load_tool(ROWS_TOOL)
    compute = {"row": "compute-only", "dtype": "bf16", "step_seconds": 1.0}
    io_row = {"row": "io-only", "dtype": "bf16", "step_seconds": 3.0}
    row = {"row": "nvme-prefetch", "dtype": "bf16", "step_seconds": 2.0}
    by_key = {(r["row"], r["dtype"]): r for r in (compute, io_row, row)}
    # Unpaired: against the io-only row, measured at another time.
    assert bench.overlap_efficiency(row, by_key) == pytest.approx(3.0 / 2.0)
    # Paired: each step against the replay right after it (the disk's speed of that moment),
    # median over pairs; the io-only row is not used.
    row.update(paired_step_seconds=[2.0, 4.0, 2.0], paired_io_seconds=[1.5, 3.6, 0.5])
    assert bench.overlap_efficiency(row, by_key) == pytest.approx(0.75)  # 0.75, 0.9, 0.5
    assert bench.overlap_efficiency(compute, by_key) is None


def test_bench_checksum_times_every_kernel_and_restores_the_choice(tmp_path):
    out = tmp_path / "crc.json"
    proc = subprocess.run([sys.executable, str(CHECKSUM_TOOL), "--quick", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == set(_native.crc32c_available_isas())
    assert all(r["gb_per_s"] > 0 and r["read_gb_per_s"] > 0 for r in rows)
    chosen = _native.crc32c_selected_isa()
    load_tool(CHECKSUM_TOOL).measure([1 << 20], 1)
    assert _native.crc32c_selected_isa() == chosen


def test_bench_train_model_and_swap_checksums_reach_the_config():
    bench, rows = load_tool(TOOL), load_tool(ROWS_TOOL)
    args = bench.parse_args(["--model", "small", "--swap-checksums", "off"])
    assert args.model == "small" and args.swap_checksums == "off"
    spec = {"row": "nvme-prefetch", "dtype": "fp32", "swap_dir": "/tmp/x", "swap_checksums": False}
    assert rows.offload_config(spec, 1 << 20)["swap_checksums"] is False
    assert rows.offload_config(dict(spec, swap_checksums=True), 1 << 20)["swap_checksums"] is True


SCALE_TOOL = REPO_ROOT / "tools" / "bench_scale.py"


def test_bench_scale_refuses_a_swap_dir_without_room_naming_the_free_bytes(tmp_path, monkeypatch, capsys):
    bench = load_tool(SCALE_TOOL)
    monkeypatch.setattr(bench.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 9 << 30, 1 << 30))
    assert bench.main(["--layers", "1", "--swap-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{1 << 30:,} bytes free" in err and "--swap-dir" in err
    assert list(tmp_path.iterdir()) == []


def test_bench_scale_removes_its_swap_dir_when_a_row_raises(tmp_path, monkeypatch):
    bench = load_tool(SCALE_TOOL)

    def failing_row(spec, timeout):
        Path(spec["swap_dir"], "swap.bin").write_bytes(b"x" * 4096)  # as a killed engine leaves it
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_row", failing_row)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--layers", "1", "--swap-dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_bench_scale_table_gives_the_step_over_the_slower_of_compute_and_io(capsys):
    bench = load_tool(SCALE_TOOL)
    probe = dict(prefetch_hits=50, prefetch_misses=3, prefetch_late=7, prefetch_unplanned=2,
                 forward_seconds=1.0, backward_seconds=2.0, step_call_seconds=3.0)
    offload_row = dict(row="offload", step_seconds_all=[12.0, 14.0], wrap_seconds=5.0, peak_rss_bytes=2 << 30,
                       wrap_peak_rss_bytes=1 << 30, probes=[probe, probe], num_params=10**9, num_units=5,
                       device_peak_bytes=1 << 30, device_budget_bytes=3 << 30, nvme_bytes=8 << 30,
                       phases=dict(bytes_read_nvme=4e9, bytes_written_nvme=2e9, fetch_wait_seconds=0.5,
                                   optimizer_wait_seconds=0.25, optimizer_seconds=3.0))
    rows = [offload_row,
            dict(row="compute-only", step_seconds_all=[10.0], peak_rss_bytes=1 << 30, note="n"),
            dict(row="io-only", step_seconds_all=[6.5], peak_rss_bytes=1 << 30, read_per_step=4e9,
                 written_per_step=2e9, note="r")]
    bench.print_table(rows, None)
    out = capsys.readouterr().out
    offload_line = next(line for line in out.splitlines() if line.startswith("offload "))
    assert " 13.00    1.30 " in offload_line  # mean step 13 s over compute-only's 10 s
    assert "91% 100/110" in offload_line and "6/14/4" in offload_line  # hits / all uses
    assert "step / 10.00 s" in out


def test_bench_scale_rounds_pair_each_step_with_its_own_replay(capsys):
    """--rounds: offload and io-only alternate, compute-only runs once, and each round's
    ratio is over max(compute-only, that round's io-only), not another round's."""
    bench = load_tool(SCALE_TOOL)
    assert bench.schedule(["offload", "compute-only", "io-only"], 3) == [
        (1, "offload"), (1, "compute-only"), (1, "io-only"), (2, "offload"), (2, "io-only"),
        (3, "offload"), (3, "io-only")]
    probe = dict(prefetch_hits=1, prefetch_misses=0, prefetch_late=0, prefetch_unplanned=0,
                 forward_seconds=1.0, backward_seconds=2.0, step_call_seconds=3.0)

    def offload_row(k, seconds):
        return dict(row="offload", round=k, step_seconds_all=[seconds], wrap_seconds=5.0, peak_rss_bytes=2 << 30,
                    wrap_peak_rss_bytes=1 << 30, probes=[probe], num_params=10**9, num_units=5,
                    device_peak_bytes=1 << 30, device_budget_bytes=3 << 30, nvme_bytes=8 << 30,
                    phases=dict(bytes_read_nvme=4e9, bytes_written_nvme=2e9, fetch_wait_seconds=0.5,
                                optimizer_wait_seconds=0.25, optimizer_seconds=3.0))

    def io_row(k, seconds):
        return dict(row="io-only", round=k, step_seconds_all=[seconds], peak_rss_bytes=1 << 30, read_per_step=4e9,
                    written_per_step=2e9, note="r")

    rows = [offload_row(1, 24.0), dict(row="compute-only", round=1, step_seconds_all=[10.0],
                                       peak_rss_bytes=1 << 30, note="n"),
            io_row(1, 20.0), offload_row(2, 33.0), io_row(2, 30.0)]  # the disk slower in round 2
    bench.print_table(rows, None)
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("offload 1 ")).split()[4] == "1.20"
    assert next(line for line in out.splitlines() if line.startswith("offload 2 ")).split()[4] == "1.10"
    assert "per round: 1.20, 1.10; median 1.15" in out


def test_bench_scale_io_only_replays_the_rows_bytes_and_leaves_no_file(tmp_path):
    bench = load_tool(SCALE_TOOL)
    mib = 1 << 20
    phases = dict(forward_read=24 * mib, backward_read=15 * mib, optimizer_read=72 * mib,  # whole pages a unit
                  forward_written=0, backward_written=0, optimizer_written=72 * mib)
    spec = dict(swap_dir=str(tmp_path), dtype="fp32", pipeline_depth=3, warmup=0, steps=2,
                pattern={"units": [{"compute_bytes": 8 * mib, "master_bytes": 8 * mib}] * 3, "phases": phases})
    row = bench.run_io_only(spec)
    assert row["read_per_step"] == (24 + 15 + 72) * mib and row["written_per_step"] == 72 * mib
    assert len(row["step_seconds_all"]) == 2 and "4 MiB requests" in row["note"]
    assert list(tmp_path.iterdir()) == []


def test_bench_scale_compute_only_extrapolates_from_one_model_cut_short(monkeypatch, capsys):
    bench = load_tool(SCALE_TOOL)
    monkeypatch.setattr(bench, "LLAMA_3B", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
                                                max_position_embeddings=64))
    spec = dict(layers=6, compute_layers=3, compute_steps=1, seq=8, dtype="fp32", adam_numel=4096)
    row = bench.run_compute_only(spec)
    assert "through 1 layer" in row["note"] and "extrapolated to 6" in row["note"]
    assert row["step_seconds_all"][0] == row["forward_backward_seconds"] + row["adam_seconds"]
    passes = [line for line in capsys.readouterr().err.splitlines() if "compute-only" in line]
    assert len(passes) == 4 and "1 of 3 layers" in passes[0] and "3 of 3 layers" in passes[1]  # in turns


def test_bench_scale_times_a_checkpoint_and_removes_it(monkeypatch, tmp_path, capsys):
    """--checkpoint: after the timed steps the offload row saves and loads a checkpoint in
    its swap directory, timing each with its own peak RSS, and removes it."""
    bench = load_tool(SCALE_TOOL)
    monkeypatch.setattr(bench, "LLAMA_3B", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
                                                max_position_embeddings=64))
    spec = dict(layers=2, dtype="fp32", swap_dir=str(tmp_path), device_budget=None, host_budget=None,
                max_grad_norm=1.0, speculative_updates=None, seq=8, warmup=0, steps=1, checkpoint=True)
    row = bench.run_offload(spec)
    ckpt = row["checkpoint"]
    params = sum(p.numel() for p in bench.llama(2, meta=True).parameters())
    assert ckpt["bytes"] >= 12 * params  # fp32 master and moments of every parameter
    for verb in ("save", "load"):
        assert ckpt[verb]["seconds"] > 0 and ckpt[verb]["peak_rss_bytes"] > 0
    assert not (tmp_path / "checkpoint").exists()
    bench.print_table([dict(row, step_seconds=row["step_seconds_all"][0])], None)
    assert "checkpoint of " in capsys.readouterr().out


def test_bench_scale_plans_the_swap_bytes_wrap_preflights(tmp_path):
    """The disk check counts the spare homes of speculative updates (a second copy of every
    unit's states but the root's, which is never updated early)."""
    from offload.memory.budget import model_unit_sizes

    bench = load_tool(SCALE_TOOL)
    spec = dict(layers=1, dtype="fp32", device_budget=None, host_budget=None, max_grad_norm=1.0)
    on = bench.planned_swap_bytes(dict(spec, speculative_updates=True), str(tmp_path))
    off = bench.planned_swap_bytes(dict(spec, speculative_updates=False), str(tmp_path))
    sizes = model_unit_sizes(bench.llama(1, meta=True), 4)
    spares = sum((u.home_numel + 2 * u.state_numel) * 4 for u in sizes[1:] if u.trainable)  # fp32: merged master
    assert spares > 0 and on == off + spares


def test_bench_train_sweeps_host_budgets_with_auto_placement(tmp_path):
    """--sweep-host-budget: the plain row, the compute row (everything in RAM, no budget),
    then placement "auto" at each fraction of the plain RSS: a tiny budget puts states on
    NVMe, a generous one keeps everything in RAM; every row has its predicted step and NVMe
    bytes, predicted with the compute row's time."""
    out = tmp_path / "sweep.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--sweep-host-budget", "--dtypes", "fp32", "--fractions", "0.03",
         "1.0", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pred/meas" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    # two plain runs, the compute time, the sweep, one plain run, and the baseline: their median
    assert [r["row"] for r in rows] == ["plain-run", "plain-run", "compute", "auto", "auto", "plain-run", "plain"]
    runs = sorted(r["step_seconds"] for r in rows if r["row"] == "plain-run")
    assert rows[-1]["plain_runs"] == [r["step_seconds"] for r in rows if r["row"] == "plain-run"]
    assert rows[-1]["step_seconds"] == runs[1]
    compute, tiny, generous = rows[2], rows[3], rows[4]
    assert "error" not in compute and compute["home_bytes"]["nvme"] == 0 and not compute["delayed"]
    for row in (tiny, generous):
        assert "error" not in row, row
        assert row["predicted_seconds"] > 0 and row["step_seconds"] > 0
        # the disk checked before the point, and the prediction at its speed
        assert row["disk"]["read_bytes_per_second"] > 0 and row["disk"]["write_bytes_per_second"] > 0
        assert row["predicted_at_disk_seconds"] > 0
    # nothing on NVMe: the prediction is the compute time (and more with I/O)
    assert generous["predicted_seconds"] == compute["step_seconds"] < tiny["predicted_seconds"]
    assert generous["predicted_at_disk_seconds"] == compute["step_seconds"] < tiny["predicted_at_disk_seconds"]
    assert tiny["home_bytes"]["nvme"] > 0 and tiny["nvme_read_per_step"] > 0
    assert generous["home_bytes"]["nvme"] == 0 and generous["nvme_read_per_step"] == 0
    assert list((tmp_path / "swap").iterdir()) == []


def test_bench_train_compares_the_new_default_tiers_with_the_old(tmp_path):
    """--compare-defaults: an old (host, host) and a new (no tier given) row per scenario; with
    nothing set the new defaults keep the compute copies on the device, with the device budget
    at its floor on the host like the old; with a host budget the old defaults cannot meet
    (here 0.03x their RSS, below the all-host need) the old row is refused at wrap and the
    new one puts states on NVMe."""
    out = tmp_path / "defaults.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--compare-defaults", "--dtypes", "fp32", "--tight-fraction", "0.03",
         "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step new/old" in proc.stdout
    rows = {(r["scenario"], r["row"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 8
    units = rows[("nothing set", "old-defaults")]["tiers"][0]["host"]
    assert rows[("nothing set", "defaults")]["tiers"] == [{"device": units, "host": 0, "nvme": 0},
                                                          {"device": 0, "host": units, "nvme": 0}]
    for scenario in ("device budget at the floor", "floor, swap_dir, clipping"):
        assert rows[(scenario, "defaults")]["tiers"] == rows[(scenario, "old-defaults")]["tiers"]
    tight = "floor, swap_dir, clipping, tight host budget"
    assert "host_budget" in rows[(tight, "old-defaults")]["error"]
    assert rows[(tight, "defaults")]["tiers"][1]["nvme"] > 0 and rows[(tight, "defaults")]["nvme_read_per_step"] > 0
    assert list((tmp_path / "swap").iterdir()) == []


# The imports between the modules of tools/ (module -> the tools modules it imports), as
# tools/bench_train.py's docstring draws them: split by what each measures, no circle.
TOOLS_IMPORTS = {
    "bench_train": {"bench_activations", "bench_defaults", "bench_sweep", "train_deepspeed", "train_harness",
                    "train_optimizers", "train_ranks", "train_replay", "train_rows"},
    "train_rows": {"train_deepspeed", "train_harness", "train_replay", "trace_summary"},
    "train_ranks": {"train_harness"},
    "train_deepspeed": {"train_harness"},
    "train_replay": {"train_harness"},
    "bench_sweep": {"train_harness"},
    "bench_defaults": {"train_harness"},
    "bench_activations": {"train_harness"},
    "train_optimizers": {"train_harness"},
    "bench_scale": {"train_replay"},
    "bench_compact": {"bench_adam"},
    "bench_compact_pieces": {"bench_adam"},
    "bench_optim": {"bench_adam"},
    "bench_zero": {"bench_train", "train_harness", "train_ranks"},
}


def tools_import_graph() -> dict:
    """Each tools/*.py module -> the tools modules it imports anywhere (lazy imports too)."""
    import ast

    names = {p.stem for p in TOOLS_DIR.glob("*.py")}
    graph = {}
    for path in TOOLS_DIR.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[path.stem] = imported & names
    return graph


def test_tools_import_each_other_one_way_as_bench_train_draws_it():
    graph = tools_import_graph()
    assert {k: v for k, v in graph.items() if v} == TOOLS_IMPORTS
    assert graph["train_harness"] == set()

    def reach(start):  # every module start imports, directly or not
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    circles = [m for m in graph if m in reach(m)]
    assert circles == [], f"import circles through {circles}"


def test_importing_bench_train_imports_no_offload():
    """A worker sets torch's thread count before offload is imported: offload sizes its
    native thread pool from it at import (offload/__init__.py)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_train, bench_scale; "
            "print(sorted(m for m in sys.modules if m == 'offload' or m.startswith('offload.')))")
    proc = subprocess.run([sys.executable, "-c", code, str(TOOLS_DIR)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("num_slots", [1, 2, 3, 4])
@pytest.mark.parametrize("num_pieces", [0, 1, 2, 3, 7])
def test_the_piece_ring_reads_ahead_and_updates_in_order(num_slots, num_pieces):
    """offload.optim.step.piece_ring ([Note: the piece ring]), which the engine's staged step
    and the I/O-only replayer (tools/train_replay.py) both run: every piece is read, then
    updated, in order; the reads run len(slots) - 1 pieces ahead (one with a single slot),
    before the update with two slots, after it otherwise; nothing is left in flight."""
    from offload.optim.step import piece_ring
    from offload.stats import Stats

    calls = []

    class Handle:
        def __init__(self, i):
            self.i = i

        def wait(self):
            calls.append(("wait", self.i))

    def start_reads(i, slot):
        calls.append(("read", i, slot))
        return [Handle(i)]

    def update(i, slot):
        calls.append(("update", i, slot))

    slots = [10 + s for s in range(num_slots)]
    piece_ring(num_pieces, slots, start_reads, update, Stats())
    assert [c[1] for c in calls if c[0] == "update"] == list(range(num_pieces))
    ahead = max(1, num_slots - 1)
    for i in range(num_pieces):
        update_at = calls.index(("update", i, slots[i % num_slots]))
        assert calls.index(("wait", i)) < update_at  # its reads are in first
        if i + ahead < num_pieces:  # the reads ahead are started around this update
            read_at = calls.index(("read", i + ahead, slots[(i + ahead) % num_slots]))
            assert (read_at < update_at) == (num_slots == 2)
    assert sum(1 for c in calls if c[0] == "read") == sum(1 for c in calls if c[0] == "wait") == num_pieces


@pytest.mark.parametrize("depth", [2, 3])
def test_io_only_row_replays_the_pattern_bytes_and_leaves_no_file(tmp_path, depth):
    replay = load_tool(REPLAY_TOOL)
    mib = 1 << 20
    phases = dict(forward_read=6 * mib, backward_read=3 * mib, optimizer_read=12 * mib,  # whole pages a unit
                  forward_written=0, backward_written=3 * mib, optimizer_written=9 * mib)
    spec = dict(swap_dir=str(tmp_path), pipeline_depth=depth, warmup=0, steps=2,
                pattern={"units": [{"compute_bytes": 2 * mib, "master_bytes": 4 * mib}] * 3, "phases": phases,
                         "source": "nvme-prefetch fp32"})
    row = replay.run_io_only(spec)
    assert row["nvme_read_per_step"] == (6 + 3 + 12) * mib and row["nvme_written_per_step"] == 12 * mib
    assert len(row["step_seconds_all"]) == 2 and "replay of nvme-prefetch fp32" in row["note"]
    assert list(tmp_path.iterdir()) == []


def test_sweep_and_defaults_start_from_the_harness_spec():
    """--sweep-host-budget and --compare-defaults build their rows from one spec (no copy of
    the model and step defaults in either): the device budget at its floor."""
    bench, harness = load_tool(TOOL), load_tool(TOOLS_DIR / "train_harness.py")
    args = bench.parse_args(["--quick", "--model", "small", "--sweep-host-budget"])
    base = harness.floor_rows_base(args)
    assert base["model"] == harness.SMALL_MODEL and base["batch"] == harness.QUICK_BATCH
    assert base["budget_fraction"] == 0.01 and base["threads"] == 1


def test_bench_train_activations_rows_keep_recompute_and_move(tmp_path):
    """--activations: per sequence length, none (the baseline), keep (nothing moves, the
    activations counted), recompute, host, nvme and auto (within its budget); the table and
    the JSON rows. Each row's byte columns (kept, to host, to NVMe, per unit, the host
    buffers' peak) are what offload plan --seq-len predicts for the config it ran."""
    from offload.gpt import GPT, GPTConfig
    from offload.plan_activations import plan_activations

    out = tmp_path / "activations.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--activations", "--dtypes", "fp32", "--seq-lens", "32",
         "--steps", "1", "--warmup", "1", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x keep" in proc.stdout and "x none" in proc.stdout
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["auto", "host", "keep", "none", "nvme", "recompute"]
    keep, recompute, host, nvme = rows["keep"], rows["recompute"], rows["host"], rows["nvme"]
    assert keep["activations"]["moved_to_host_bytes"] == 0 and keep["activations"]["device_peak_bytes"] > 0
    assert rows["none"]["activations"]["device_peak_bytes"] == 0  # outside the engine's counters
    assert recompute["activations"]["device_peak_bytes"] < keep["activations"]["device_peak_bytes"]
    assert host["activations"]["to_host_bytes"] > 0 and host["device_peak_bytes"] < keep["device_peak_bytes"]
    assert nvme["activations"]["to_nvme_bytes"] == host["activations"]["to_host_bytes"]
    assert nvme["activations"]["nvme_bytes_written"] > 0
    assert 0 < rows["auto"]["activations"]["to_host_bytes"] < host["activations"]["to_host_bytes"]
    assert list((tmp_path / "swap").iterdir()) == []
    for name in ("keep", "host", "nvme", "auto"):
        r = rows[name]
        plan = plan_activations(lambda: GPT(GPTConfig(**r["model"])), r["config"], r["seq_len"], r["batch"])
        act = r["activations"]
        assert act["units"] == [vars(g) for g in plan.groups], name
        assert (act["kept_bytes"], act["to_host_bytes"], act["to_nvme_bytes"], act["host_peak_bytes"]) == \
            (plan.kept_bytes, plan.moved_bytes("host"), plan.moved_bytes("nvme"), plan.host_peak_bytes), name


def test_the_compact_plan_of_the_3b_shape_in_docs_performance_is_what_offload_plan_prints(tmp_path):
    """docs/performance.md's answer for compact states at the 3B shape, from its own command
    line: compact fits host_budget 3.5 GiB as exact does ([Note: compact pieces]: staging
    slots of a piece, not of the largest unit); the table's NVMe bytes per parameter (both
    tiers "nvme") and the auto placement's are those the doc's table gives."""
    pytest.importorskip("transformers")
    doc = (REPO_ROOT / "docs" / "performance.md").read_text()
    section = doc[doc.index("## Issue #41: what `offload plan` predicts"):]
    command = re.search(r"```\npython3 -m offload (plan .*?)   #", section, re.S).group(1).replace("\\\n", " ").split()
    num_params = 3_212_749_824
    per_param = {}
    for states in ("compact", "exact"):
        args = command if states == "compact" else command[:command.index("--optimizer-states")]
        result = subprocess.run([sys.executable, "-m", "offload", *args, "--json", str(tmp_path / "plan.json")],
                                capture_output=True, text=True, cwd=REPO_ROOT, timeout=600,
                                env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        plan = json.loads((tmp_path / "plan.json").read_text())
        assert plan["num_trainable"] == num_params and plan["optimizer_states"] == states
        auto = plan["auto"]
        assert auto["possible"], (auto["error"], result.stdout)
        nvme = next(c for c in plan["configurations"] if c["param_tier"] == c["optimizer_tier"] == "nvme")
        per_param[states] = tuple(round(nvme["traffic_bytes_per_step"][link] / num_params, 2)
                                  for link in ("nvme_read", "nvme_write"))
        per_param[states, "auto"] = tuple(round(auto[f"nvme_{way}_bytes_per_step"] / num_params, 2)
                                          for way in ("read", "write"))
    assert per_param == {"exact": (15.75, 12.0), "compact": (8.79, 5.03),
                         ("exact", "auto"): (17.05, 15.36), ("compact", "auto"): (10.07, 6.38)}
    assert "**Compact states fit host_budget 3.5 GiB**" in section
    for states in ("exact", "compact"):
        for model in ("table", "auto"):
            read, written = per_param[states] if model == "table" else per_param[states, "auto"]
            assert re.search(rf"\| {states} \| {model}[ ,][^|]* \| {read:.2f} \| {written:.2f} \|", section), (states, model)


def test_bench_train_optimizer_rows_count_each_optimizers_state_and_traffic(tmp_path):
    """--optimizer: the plain row, then the NVMe row of each named optimizer: its state bytes
    per parameter at home (8 for AdamW's two moments, 0 for plain SGD, 4 for SGD's momentum)
    and its NVMe traffic per step (SGD's writes only the merged master, AdamW's the moments
    too); an unknown name is refused before any row runs."""
    out = tmp_path / "optimizers.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--optimizer", "adamw", "sgd", "sgd-momentum", "--dtypes", "fp32",
         "--steps", "2", "--warmup", "1", "--swap-dir", str(tmp_path / "swap"), "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x AdamW" in proc.stdout and "state B/p" in proc.stdout
    rows = {r["optimizer"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["plain", "adamw", "sgd", "sgd-momentum"]
    assert all("error" not in r for r in rows.values()), rows
    per_param = {k: rows[k]["optimizer_state_bytes"] / rows[k]["trainable_params"]
                 for k in ("adamw", "sgd", "sgd-momentum")}
    assert per_param["sgd"] == 0 and 4 <= per_param["sgd-momentum"] < 4.1 and 8 <= per_param["adamw"] < 8.2  # pages
    written = {k: rows[k]["nvme_written_mean_per_step"] for k in per_param}
    assert 0 < written["sgd"] < written["sgd-momentum"] < written["adamw"]
    assert list((tmp_path / "swap").iterdir()) == []
    proc = subprocess.run([sys.executable, str(TOOL), "--quick", "--optimizer", "lamb"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "--optimizer: lamb not among adamw" in proc.stderr


def test_the_gpu_check_runs_on_the_cpu_so_a_lent_gpus_minutes_are_not_spent_on_its_bugs(tmp_path):
    """tools/gpu_check.py (issue #43, run by tools/gpu_run.sh where a GPU is lent) kept working
    here: one parity case against plain PyTorch with NVMe tiers at the device floor, within the
    fp32 bounds, and two bench rows in fresh processes with their table."""
    tool = load_tool(TOOLS_DIR / "gpu_check.py")
    device = torch.device("cpu")
    model = tool.build("gpt", tool.SMALL_GPT)
    plain = tool.plain_reference("gpt", model, tool.data_for(tool.SMALL_GPT["vocab_size"], 10, 4, 64, device), device)
    assert plain[3][1] > 0  # fused AdamW rounds otherwise than foreach=False: a spread to compare with
    row = tool.parity_case("gpt", tool.SMALL_GPT, "fp32", ("nvme", "nvme"), None, device, str(tmp_path), plain)
    assert row["ok"] and row["loss_err"] < tool.LOSS_TOL_FP32 and row["state_err"] < tool.STATE_TOL_FP32
    out = subprocess.run([sys.executable, str(TOOLS_DIR / "gpu_check.py"), "bench", "--device", "cpu",
                          "--swap-dir", str(tmp_path), "--model", "gptquick", "--rows", "plain", "nvme-floor",
                          "--steps", "1", "--warmup", "0", "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["row"] for r in rows] == ["plain", "nvme-floor"] and all(r["step_s"] > 0 for r in rows)
    assert rows[1]["per_step"]["bytes_read_nvme"] > 0
    assert "nvme-floor" in out.stdout.splitlines()[-1]


def test_report_prints_the_tables_writes_config_then_rows_and_counts_the_failures(tmp_path, capsys):
    """train_harness.report, the end of train_rows, train_optimizers, train_ranks,
    bench_defaults and bench_sweep: a blank line, the tables, the JSON (config, the extra
    keys, rows, in that order) and the exit code, 1 only for a row that counts as failed."""
    harness = load_tool(TOOLS_DIR / "train_harness.py")
    rows = [{"row": "plain", "step_seconds": 1.0}, {"row": "ds", "error": "no deepspeed"}]
    out = tmp_path / "rows.json"
    code = harness.report(rows, lambda r: print(f"table of {len(r)} rows"), str(out), {"batch": 2},
                          json_extra={"deepspeed": "skipped"})
    assert code == 1
    assert capsys.readouterr().out == "\ntable of 2 rows\n"
    assert list(json.loads(out.read_text())) == ["config", "deepspeed", "rows"]
    assert json.loads(out.read_text()) == {"config": {"batch": 2}, "deepspeed": "skipped", "rows": rows}
    assert harness.report(rows, lambda r: None, None, {}, failed=lambda r: "error" in r and r["row"] != "ds") == 0
    assert capsys.readouterr().out == "\n"
