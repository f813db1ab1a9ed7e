"""The `offload` command line, run as a user runs it: `python -m offload ...` in a subprocess.

The plan's byte counts are also checked in-process against what the engine really allocates
(offload.wrap on a small GPT), so the planner cannot drift from the engine.
"""
from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

import offload
import offload.io
from offload.gpt import GPT, GPTConfig
from offload.config import format_size
from offload.memory.budget import UnitSizes, minimum_host_budget
from offload.plan import load_profile, place, shape_from_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DEMO = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "32",
             "--batch-size", "4", "--data-bytes", "256KiB"]
MiB = 1 << 20


def run_cli(*args: str, timeout: float = 240, extra_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, extra_path) if p))
    return subprocess.run([sys.executable, "-m", "offload", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def swap_leftovers(directory: str) -> list:
    return [n for n in os.listdir(directory) if n.startswith(("offload-run-", ".offload"))]


@pytest.mark.parametrize("command", ["demo", "profile", "plan", "doctor", "export"])
def test_every_subcommand_has_help(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"usage: offload {command}" in result.stdout


@pytest.mark.parametrize("args", [("demo", "--steps", "zero"), ("plan", "--params", "lots"),
                                  ("plan",), ("doctor", "--no-such-flag"), ("frobnicate",)])
def test_bad_flags_exit_2_with_one_error_line(args):
    result = run_cli(*args)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_demo_trains_end_to_end_and_removes_its_swap_files(tmp_path):
    result = run_cli("demo", "--steps", "16", "--lr", "1e-2", "--swap-dir", str(tmp_path), *TINY_DEMO)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # What it does, said at the start.
    assert "M parameters" in out and "device" in out and "nvme" in out and str(tmp_path) in out
    first, last = map(float, re.search(r"^loss: ([0-9.]+) -> ([0-9.]+)", out, re.M).groups())
    assert last < first - 0.3, out
    step_losses = [float(m) for m in re.findall(r"^step +\d+/16 .* loss ([0-9.]+)", out, re.M)]
    assert len(step_losses) == 16
    assert "tier statistics" in out and "waiting on I/O" in out and "nvme -> device" in out
    assert "swap files removed" in out
    assert swap_leftovers(str(tmp_path)) == []
    # The figures are true: the swap it made is the swap it used at its peak (second copies
    # included), and the optimizer's time counts the updates on its thread (clipping on: they
    # run during backward and after step()), which took the time step() did not.
    swap = re.search(r"^  swap +([0-9.]+ [KMG]iB) in swap files", out, re.M).group(1)
    assert re.search(rf"^    nvme +{re.escape(swap)}$", out, re.M), out
    total, beside = map(float, re.search(r"optimizer \(total\) +([0-9.]+) s \(([0-9.]+) s of it beside", out).groups())
    assert total >= beside > 0, out


def test_demo_ctrl_c_stops_cleanly_and_removes_swap_files(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload", "demo", "--steps", "100000", "--swap-dir", str(tmp_path), *TINY_DEMO],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        lines = []
        for line in proc.stdout:  # wait until training has started
            lines.append(line)
            if line.startswith("step "):
                break
        assert swap_leftovers(str(tmp_path)), "swap files must exist while training"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out + err
    assert "stopped cleanly" in out and "swap files removed" in out, out
    assert "Traceback" not in err
    assert swap_leftovers(str(tmp_path)) == []


def test_profile_quick_writes_a_profile_that_plan_loads(tmp_path):
    profile_path = tmp_path / "profile.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    result = run_cli("profile", "--swap-dir", str(swap), "--quick", "--json", str(profile_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[3/3]" in result.stdout  # progress
    profile = json.loads(profile_path.read_text())
    load_profile(str(profile_path))  # schema and version check
    assert profile["version"] == 1
    rec = profile["recommended_io"]
    offload.OffloadConfig(io_backend=rec["io_backend"], io_block_bytes=rec["io_block_bytes"],
                          io_queue_depth=rec["io_queue_depth"])  # valid config fields
    assert f"io_backend={rec['io_backend']!r}" in result.stdout
    assert os.listdir(swap) == []
    plan = run_cli("plan", "--params", "1e8", "--profile", str(profile_path))
    assert plan.returncode == 0, plan.stderr
    assert "profile: measured on" in plan.stdout


def test_profile_plot_draws_a_png_or_says_matplotlib_is_missing(tmp_path):
    png = tmp_path / "bw.png"
    result = run_cli("profile", "--swap-dir", str(tmp_path), "--quick", "--plot", str(png))
    if importlib.util.find_spec("matplotlib") is None:
        assert result.returncode == 1 and "matplotlib" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_on_a_parameter_count_gives_the_documented_bytes(tmp_path):
    # 25 units (24 + root) of 1 Mi parameters each: every buffer is whole pages, no padding.
    n_unit = 1 << 20
    n = 25 * n_unit
    out_json = tmp_path / "plan.json"
    result = run_cli("plan", "--params", str(n), "--num-units", "24", "--dtype", "bf16",
                     "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    for text in ("2 B/param", "4 B/param", "8 B/param"):
        assert text in result.stdout
    assert "step time model" in result.stdout
    configs = {(c["param_tier"], c["optimizer_tier"]): c
               for c in json.loads(out_json.read_text())["configurations"]}
    assert len(configs) == 6
    # [Note: 16-bit gradients] held in bf16: one backward a step, a CPU device
    grads, master, moments, compute = 2 * n, 4 * n, 8 * n, 2 * n
    scratch = 2 * 4 * n_unit  # [Note: gradient squares] two threads' fp32 scratch, a unit's each
    largest_param_bytes = (n_unit // 3) * 2
    staging = 3 * (3 * 4 * n_unit)                       # pipeline depth 3, master+moments
    # [Note: split master] bf16 with the optimizer on NVMe keeps the master's low half only
    low = 2 * n
    low_staging = 3 * 2 * (n_unit + 2048)                # a piece of low halves per slot
    c = configs[("nvme", "nvme")]
    assert c["nvme_bytes"] == compute + low + moments
    # + a bf16 compute piece per slot: the piece (one unit here, 1 Mi elements) plus
    # 2048 elements, since a 16-bit prefix is padded to 2048 elements and fp32 to 1024
    assert c["host_bytes"] == grads + scratch + staging + 3 * 2 * (n_unit + 2048) + low_staging
    # the optimizer moves the low halves and moments both ways, reads the compute copy
    # (the high halves) and writes it back
    assert c["traffic_bytes_per_step"]["nvme_write"] == low + moments + compute
    assert c["device_bytes"] == 2 * (2 * n_unit) + largest_param_bytes
    c = configs[("device", "host")]
    assert c["nvme_bytes"] == 0
    assert c["host_bytes"] == grads + scratch + master + moments
    assert c["device_bytes"] == compute + largest_param_bytes
    c = configs[("host", "nvme")]
    assert c["host_bytes"] == grads + scratch + compute + staging + low_staging
    assert c["nvme_bytes"] == low + moments
    # fp32 compute merges the compute copy with the master: 4 + 8 B/param on NVMe, no master.
    result = run_cli("plan", "--params", str(n), "--num-units", "24", "--dtype", "fp32",
                     "--json", str(out_json))
    c = {(c["param_tier"], c["optimizer_tier"]): c
         for c in json.loads(out_json.read_text())["configurations"]}[("nvme", "nvme")]
    assert c["merged"] and c["nvme_bytes"] == 4 * n + 8 * n


def test_plan_says_what_is_missing_when_nothing_fits():
    result = run_cli("plan", "--params", "7e9", "--device-budget", "16MiB", "--host-budget", "1GiB",
                     "--nvme-budget", "10GiB")
    assert result.returncode == 1
    assert "NOTHING FITS" in result.stdout
    assert re.search(r"nvme/nvme: .*host needs .* budget 1.00 GiB \(short by", result.stdout)


@pytest.mark.parametrize("states", ["exact", "compact"])
def test_a_plan_row_fits_a_host_budget_that_gradient_spill_meets(states):
    """[Note: gradient spill] A configuration with a tier on NVMe fits a host budget below
    its host need down to the floor wrap takes (minimum_host_budget: the gradients beyond
    the budget spilled, test_plan_bytes_agree_with_what_the_engine_allocates), its swap
    then holding the gradient extents too; below the floor the
    shortfall names both needs. Without a tier on NVMe nothing is spilled: the floor is the
    whole need."""
    from offload.plan import shortfalls
    with torch.device("meta"):
        shape = shape_from_module(GPT(GPTConfig(d_model=512, num_layers=8, num_heads=8, seq_len=32)), "gpt")
    p = place(shape, "bf16", "nvme", "nvme", optimizer_states=states)
    assert p.host_floor_bytes < p.host_bytes and p.spill_nvme_bytes >= p.host_parts["gradients"]  # extents: pages
    assert p.host_floor_bytes == minimum_host_budget([u.sizes(2) for u in shape.units],
                                                     dataclasses.replace(_plan_layout(states), host_budget=None))
    swap = p.nvme_bytes + p.spill_nvme_bytes
    assert shortfalls(p, None, p.host_bytes, p.nvme_bytes) == []  # no spill at the whole need
    assert shortfalls(p, None, p.host_floor_bytes, swap) == []
    assert [s.split(",")[0] for s in shortfalls(p, None, p.host_floor_bytes, swap - 1)] == \
        [f"nvme needs {format_size(swap)}"]
    short = shortfalls(p, None, p.host_floor_bytes - 1, None)
    assert len(short) == 1 and short[0].startswith(
        f"host needs {format_size(p.host_floor_bytes)} with gradients spilled to NVMe ({format_size(p.host_bytes)} without)")
    in_ram = place(shape, "bf16", "host", "host", optimizer_states=states)
    assert in_ram.host_floor_bytes == in_ram.host_bytes and in_ram.spill_nvme_bytes == 0


def _plan_layout(states):
    from offload.plan import _layout
    return _layout("bf16", "nvme", "nvme", 3, True, states)


def test_plan_builds_a_model_factory_on_the_meta_device(tmp_path):
    (tmp_path / "my_models.py").write_text(
        "from offload.gpt import GPT, GPTConfig\n"
        "def build():\n    return GPT(GPTConfig(d_model=128, num_layers=3))\n"
        "def broken():\n    raise RuntimeError('no such checkpoint')\n")
    result = run_cli("plan", "--model", "my_models:build", "--dtype", "fp32", extra_path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    num_params = GPTConfig(d_model=128, num_layers=3).num_params
    assert f"{num_params:,} parameters, 4 units" in result.stdout
    result = run_cli("plan", "--model", "my_models:broken", extra_path=str(tmp_path))
    assert result.returncode == 1
    assert "my_models:broken" in result.stderr and "no such checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "nvme"), ("nvme", "host"), ("device", "host")])
def test_plan_bytes_agree_with_what_the_engine_allocates(tiers, dtype, tmp_path):
    cfg = GPTConfig(d_model=64, num_layers=3, num_heads=2, seq_len=32)
    with torch.device("meta"):
        placement = place(shape_from_module(GPT(cfg), "gpt"), dtype, *tiers)

    def wrap(**budgets):
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return offload.wrap(model, opt, dict(device="cpu", param_tier=tiers[0], optimizer_tier=tiers[1],
                                             swap_dir=str(tmp_path), dtype=dtype, **budgets))

    with wrap(device_budget=placement.device_bytes, host_budget=placement.host_bytes) as engine:
        assert engine.stats()["nvme_bytes"] == placement.nvme_bytes
        smallest = minimum_host_budget([UnitSizes.of(u) for u in engine.units], engine.layout)
    with pytest.raises(ValueError, match="device_budget"):
        wrap(device_budget=placement.device_bytes - 1)
    # [Note: gradient spill] a smaller host budget spills gradients, where the spill's floor
    # is below them (not in bf16 at this size: the floor is more than every gradient)
    if "nvme" in tiers and smallest < placement.host_bytes:
        with wrap(host_budget=placement.host_bytes - 1) as engine:
            assert engine.stats()["nvme_bytes"] > placement.nvme_bytes  # the gradient extents
    else:
        with pytest.raises(ValueError, match="host_budget"):
            wrap(host_budget=placement.host_bytes - 1)


def _compact_plan_gpt():
    cfg = GPTConfig(d_model=64, num_layers=3, num_heads=2, seq_len=32)
    with torch.device("meta"):
        return cfg, shape_from_module(GPT(cfg), "gpt")


@pytest.mark.parametrize("tiers", [("host", "host"), ("host", "nvme"), ("nvme", "host"), ("nvme", "nvme"),
                                   ("device", "host")])
def test_plan_of_compact_states_agrees_with_what_the_engine_allocates_and_moves(tiers, tmp_path):
    """[Note: compact optimizer states] The plan of optimizer_states="compact" (bf16) is what
    wrap plans and allocates: swap bytes, the smallest device and host budgets, each state's
    bytes and the bytes on each tier; a step writes to NVMe what the plan says, and reads it
    too where the compute copies are not on NVMe (with them there the plan is the upper
    bound [Note: step time model] states: every unit fetched in forward and again in
    backward). The plan's compact states on NVMe move under half the exact ones' bytes."""
    from offload.plan import COMPACT_MASTER_NAME, COMPACT_MOMENTS_NAME
    cfg, shape = _compact_plan_gpt()
    p = place(shape, "bf16", *tiers, optimizer_states="compact")
    exact = place(shape, "bf16", *tiers)
    states = p.state_bytes[COMPACT_MASTER_NAME] + p.state_bytes[COMPACT_MOMENTS_NAME]
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=generator) for _ in range(3)]

    def wrap(**budgets):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return offload.wrap(model, opt, dict(device="cpu", param_tier=tiers[0], optimizer_tier=tiers[1], dtype="bf16",
                                             optimizer_states="compact", swap_dir=str(tmp_path / "swap"),
                                             overlap_step_with_forward=False, prefetch=False, **budgets))

    with wrap(device_budget=p.device_bytes, host_budget=p.host_bytes) as engine:
        stats = engine.stats()
        assert stats["nvme_bytes"] == p.nvme_bytes
        assert stats["optimizer_state_bytes"] == states
        assert states < (exact.state_bytes["fp32 master"] + exact.state_bytes["Adam moments"]) / 2
        on_tiers = {"device": 0, "host": 0, "nvme": 0}
        on_tiers[tiers[0]] += p.state_bytes["compute copy"]
        on_tiers[tiers[1]] += states
        assert engine.placement().bytes_per_tier() == on_tiers
        for b in data:
            before = engine.stats()
            engine.backward(engine(b[:, :-1], b[:, 1:]))
            engine.step()
            after = engine.stats()
            read = after["bytes_read_nvme"] - before["bytes_read_nvme"]
            assert after["bytes_written_nvme"] - before["bytes_written_nvme"] == p.traffic["nvme_write"]
            if tiers[0] == "nvme":
                assert read <= p.traffic["nvme_read"]
            else:
                assert read == p.traffic["nvme_read"]
    if tiers[1] == "nvme":  # the states' share of the writes: the compact homes, under half the exact states'
        compute_written = p.state_bytes["compute copy"] if tiers[0] == "nvme" else 0
        assert p.traffic["nvme_write"] - compute_written == states
        assert 2 * states < exact.traffic["nvme_write"] - compute_written
    with pytest.raises(ValueError, match="device_budget"):
        wrap(device_budget=p.device_bytes - 1)
    if "nvme" in tiers:  # [Note: gradient spill] one byte less spills gradients, or is refused
        try:
            with wrap(host_budget=p.host_bytes - 1) as engine:
                assert engine.stats()["nvme_bytes"] > p.nvme_bytes  # the gradient extents
        except ValueError as error:
            assert "host_budget" in str(error)
    else:
        with pytest.raises(ValueError, match="host_budget"):
            wrap(host_budget=p.host_bytes - 1)


def test_plan_of_compact_states_places_auto_as_wrap_does_and_refuses_what_wrap_refuses(tmp_path):
    """[Note: compact optimizer states] With tiers "auto" the plan's placement of compact
    states is wrap's, unit by unit, at the smallest host budget it finds possible (which
    puts compact states on NVMe); with
    fp32 (or another optimizer's state tensors, or delayed updates) the plan refuses as wrap
    does, naming --optimizer-states and the reason (with --ranks: a stage other than 0), and
    plans nothing."""
    from offload.plan import auto_plan, load_profile
    cfg, shape = _compact_plan_gpt()
    config = dict(device="cpu", dtype="bf16", param_tier="auto", optimizer_tier="auto", optimizer_states="compact",
                  swap_dir=str(tmp_path / "swap"))
    all_host = place(shape, "bf16", "host", "host", optimizer_states="compact").host_bytes
    for budget in range(all_host // 2, all_host, 4096):  # the smallest the plan finds possible
        planned = auto_plan(shape, dict(config, host_budget=budget), load_profile(None), None)
        if planned["possible"]:
            break
    else:
        raise AssertionError("no host budget below the all-host run's is possible")
    assert "nvme" in {u["state_tier"] for u in planned["units"]}
    config["host_budget"] = budget
    model = GPT(cfg)
    with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config) as engine:
        placed = engine.placement()
        assert [dataclasses.asdict(u) for u in placed.units] == planned["units"]
        assert placed.bytes_per_tier() == planned["bytes_per_tier"]
        assert engine.stats()["nvme_bytes"] == planned["bytes_per_tier"]["nvme"] > 0
    assert not auto_plan(shape, dict(config, dtype="fp32"), load_profile(None), None)["possible"]
    with pytest.raises(ValueError, match="dtype='bf16'"):
        place(shape, "fp32", "host", "nvme", optimizer_states="compact")
    with pytest.raises(ValueError, match="two moments"):
        place(shape, "bf16", "host", "nvme", state_slots=1, optimizer_states="compact")
    for flags, why in ((("--dtype", "fp32"), "dtype='bf16'"), (("--optimizer-state-tensors", "1"), "two moments"),
                       (("--delayed-update",), "delayed_update"), (("--ranks", "2"), "ZeRO stage 3"),
                       (("--optimizer", "muon"), "not --optimizer muon's")):
        out_json = tmp_path / "plan.json"
        result = run_cli("plan", "--params", "1e6", "--optimizer-states", "compact", *flags, "--json", str(out_json))
        assert result.returncode == 1 and "--optimizer-states compact" in result.stderr and why in result.stderr, \
            result.stderr
        assert "Traceback" not in result.stderr and not out_json.exists()
    model = GPT(cfg)
    with pytest.raises(ValueError, match="dtype='bf16'"):
        offload.wrap(model, torch.optim.AdamW(model.parameters()), dict(config, dtype="fp32"))


def test_plan_prints_and_writes_compact_state_bytes_per_parameter_and_tier(tmp_path):
    """`offload plan --optimizer-states compact` prints each compact state's bytes per
    parameter and its tier per configuration, and --json holds the same numbers."""
    from offload.plan import COMPACT_MASTER_NAME, COMPACT_MOMENTS_NAME
    out_json = tmp_path / "plan.json"
    n = 25 << 20
    result = run_cli("plan", "--params", str(n), "--num-units", "24", "--optimizer-states", "compact",
                     "--host-budget", "1GiB", "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    assert "optimizer states: compact" in result.stdout
    assert re.search(r"master low part 1 B/param .*int8", result.stdout)
    assert re.search(r"Adam moments +2\.03 B/param", result.stdout)
    plan = json.loads(out_json.read_text())
    assert plan["optimizer_states"] == "compact"
    assert plan["bytes_per_param"] == {"compute copy": 2, "gradients": 2, COMPACT_MASTER_NAME: 1,
                                       COMPACT_MOMENTS_NAME: 2 + 8 / 256}
    shape = offload.plan.shape_from_count(n, 24)
    for c in plan["configurations"]:
        want = place(shape, "bf16", c["param_tier"], c["optimizer_tier"], optimizer_states="compact")
        assert c["state_bytes"] == want.state_bytes and c["state_tier"] == want.state_tier
        assert c["nvme_bytes"] == want.nvme_bytes and c["traffic_bytes_per_step"] == want.traffic
        assert c["state_tier"][COMPACT_MOMENTS_NAME] == c["optimizer_tier"]
        # 1 Mi parameters a unit, four parameters: whole blocks; the scales fill the pages on NVMe
        low = n
        assert c["state_bytes"][COMPACT_MASTER_NAME] == low
        moments = 2 * n + 8 * (n // 256)
        assert c["state_bytes"][COMPACT_MOMENTS_NAME] - moments in ((0,) if c["optimizer_tier"] == "host" else
                                                                     range(0, 25 * 4096))
    assert plan["auto"]["possible"]
    # several ranks at stage 0: each holds the whole compact states (test_plan_ranks checks the bytes)
    result = run_cli("plan", "--params", str(n), "--num-units", "24", "--optimizer-states", "compact", "--ranks", "2",
                     "--stage", "0", "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    ranks = json.loads(out_json.read_text())["ranks"]["configurations"]
    assert len(ranks) == 6 and not any("refused" in c for c in ranks)


def test_plan_of_compact_states_at_the_3b_shape_stages_pieces_and_fits_host_budget_3_5_gib(tmp_path):
    """[Note: compact pieces] docs/performance.md's 3B command line (Llama-3.2-3B shape, bf16,
    clipping, host_budget 3.5 GiB) with --optimizer-states compact: a staging slot holds one
    piece (3 MiB of compact home and a piece and a page of high parts), not the largest
    unit's 1.98 GB, so the optimizer staging is 15.1 MiB (the exact step's 48.0 MiB) and
    "auto" fits, every unit on NVMe, moving about half the exact run's NVMe bytes."""
    pytest.importorskip("transformers")
    from offload.memory.compact_codec import compact_piece_bytes, compact_piece_numel
    from offload.units import OPTIMIZER_PIECE_NUMEL
    args = ["plan", "--model", "tools.bench_scale:llama_3b", "--dtype", "bf16", "--device-budget", "3GiB",
            "--host-budget", "3.5GiB", "--max-grad-norm", "1.0"]
    plans = {}
    for states in ("compact", "exact"):
        out = tmp_path / f"{states}.json"
        result = run_cli(*args, "--optimizer-states", states, "--json", str(out), timeout=600)
        assert result.returncode == 0, result.stderr
        plans[states] = json.loads(out.read_text())
    size = compact_piece_numel(OPTIMIZER_PIECE_NUMEL)
    assert size == OPTIMIZER_PIECE_NUMEL
    window = 2 * (size + 2048)  # a piece of high parts and the page after it
    slot = compact_piece_bytes(size) + window
    for plan in plans.values():
        assert plan["auto"]["possible"], plan["auto"]["error"]
        assert plan["auto"]["bytes_per_tier"]["host"] == 0 and plan["auto"]["bytes_per_tier"]["device"] == 0
    for c in plans["compact"]["configurations"]:  # a slot's parts where their homes are on NVMe
        want = (c["optimizer_tier"] == "nvme") * compact_piece_bytes(size) + (c["param_tier"] == "nvme") * window
        assert c["host_parts"]["optimizer staging buffers"] == 3 * want, c
    nvme = {s: next(c for c in p["configurations"] if c["param_tier"] == c["optimizer_tier"] == "nvme")
            for s, p in plans.items()}
    # the row fits with gradients spilled (the bf16 gradients alone are 5.98 GiB), as wrap would
    assert all(c["fits"] and c["host_floor_bytes"] < 3.5 * 2**30 < c["host_bytes"] for c in nvme.values())
    assert 3 * slot == 15_839_232 < nvme["exact"]["host_parts"]["optimizer staging buffers"] == 50_356_224
    moved = {s: p["auto"]["nvme_read_bytes_per_step"] + p["auto"]["nvme_write_bytes_per_step"] for s, p in plans.items()}
    assert moved["compact"] < 0.52 * moved["exact"]


def test_doctor_passes_on_a_writable_directory(tmp_path):
    result = run_cli("doctor", "--swap-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout
    assert "O_DIRECT" in result.stdout and "RLIMIT_MEMLOCK" in result.stdout and "CUDA" in result.stdout
    # The backend it names is the one io_backend="auto" really takes there.
    with offload.io.IOEngine("auto", probe_dir=str(tmp_path)) as io:
        assert f"io_backend='auto' uses {io.backend} (the first of io_uring, libaio, threads that " \
               "works here)" in result.stdout, result.stdout


def test_doctor_fails_naming_a_directory_it_cannot_use(tmp_path):
    # Root ignores permission bits, so use a path that cannot be a directory at all.
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    bad = blocker / "swap"
    result = run_cli("doctor", "--swap-dir", str(bad))
    assert result.returncode == 1
    assert str(bad) in result.stdout and "FAIL" in result.stdout and "fix:" in result.stdout


def test_export_writes_a_state_dict_that_plain_pytorch_loads(tmp_path):
    import torch

    import offload
    from offload.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    with offload.wrap(model, torch.optim.AdamW(model.parameters()),
                      config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"))) as engine:
        b = torch.randint(0, 32, (2, 9))
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = engine.state_dict()
    result = run_cli("export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"))
    assert result.returncode == 0, result.stderr
    fresh = GPT(cfg)
    fresh.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
    bad = run_cli("export", str(tmp_path / "missing"), str(tmp_path / "x.pt"))
    assert bad.returncode != 0 and "missing" in bad.stderr and "Traceback" not in bad.stderr


_WITHOUT_NATIVE = """
import sys

class NoNativeBuild:  # as if offload._native had never been compiled, however offload is installed
    def find_spec(self, name, path=None, target=None):
        if name == "offload._native":
            raise ModuleNotFoundError("No module named 'offload._native'", name=name)
        return None

sys.meta_path.insert(0, NoNativeBuild())
"""


def test_doctor_reports_a_missing_native_build_instead_of_crashing(tmp_path):
    doctor = _WITHOUT_NATIVE + f"from offload.cli import main\nsys.exit(main(['doctor', '--swap-dir', {str(tmp_path)!r}]))"
    proc = subprocess.run([sys.executable, "-c", doctor], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "FAIL  native build" in proc.stdout and "No module named 'offload._native'" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_NATIVE + "import offload\noffload.wrap"],
                          capture_output=True, text=True, timeout=300)
    assert "offload.wrap needs the native extension" in proc.stderr, proc.stderr


DEMO_SETTINGS = "DemoSettings(d_model=32, num_layers=2, num_heads=2, seq_len=32, batch_size=4, data_bytes=256 << 10, steps=2)"


def demo_dirs(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.startswith("offload-demo-"))


def run_in_temp(script: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=240)


def test_demo_sigterm_during_wrap_removes_its_temporary_directory(tmp_path):
    script = ("import os, signal, offload.faults\n"
              "from offload.demo import DemoSettings, run_demo\n"
              "with offload.faults.inject('wrap.done', lambda **context: os.kill(os.getpid(), signal.SIGTERM)):\n"
              f"    run_demo({DEMO_SETTINGS})\n")
    result = run_in_temp(script, tmp_path)
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    assert "(temporary)" in result.stdout
    assert demo_dirs(tmp_path) == []


def test_a_demo_removes_the_temporary_directories_of_killed_demos_only(tmp_path):
    killed = ("import os, signal\n"
              "from offload.demo import make_temporary_swap_dir\n"
              "from offload.io import SwapSpace\n"
              "swap_dir, lock = make_temporary_swap_dir(None)\n"
              "SwapSpace(swap_dir, reserve_bytes=1 << 20).allocate(1 << 20)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert run_in_temp(killed, tmp_path).returncode == -signal.SIGKILL
    (dead,) = demo_dirs(tmp_path)
    live = tmp_path / "offload-demo-live"
    live.mkdir()
    with open(live / "demo.lock", "w") as held:  # a demo still running holds its lock
        fcntl.flock(held, fcntl.LOCK_EX)
        result = run_in_temp(f"from offload.demo import DemoSettings, run_demo\nrun_demo({DEMO_SETTINGS})\n",
                             tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"removed {tmp_path / dead} of a demo that was killed" in result.stdout
    assert demo_dirs(tmp_path) == ["offload-demo-live"]


def test_version_names_offload_and_torch():
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"offload {offload.__version__} (torch {torch.__version__})"


def test_doctor_and_wrap_agree_about_a_missing_swap_directory(tmp_path):
    """A swap_dir that does not exist yet is one wrap creates: doctor checks the filesystem
    it would be made on and passes (before, it failed while wrap went ahead)."""
    missing = tmp_path / "not" / "yet"
    result = run_cli("doctor", "--swap-dir", str(missing))
    assert result.returncode == 0, result.stdout
    assert f"{missing} does not exist yet; wrap creates it in {tmp_path}" in result.stdout
    assert not missing.exists()  # doctor created nothing
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2))
    with offload.wrap(model, torch.optim.AdamW(model.parameters()),
                      config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(missing))):
        assert missing.is_dir()


def _budget_bytes(text: str) -> float:
    """'15.76 GiB' -> bytes (as format_size writes sizes)."""
    number, unit = text.split()
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]


@pytest.mark.parametrize("host_budget", [None, "1GiB"])
def test_plan_uses_one_host_budget_and_writes_everything_it_prints_to_json(host_budget, tmp_path):
    """The table and the auto placement are planned under the same host budget (the given
    one, else wrap's default), and --json holds the auto placement too."""
    out_json = tmp_path / "plan.json"
    budget = ["--host-budget", host_budget] if host_budget else []
    result = run_cli("plan", "--params", str(25 << 20), "--num-units", "24", *budget, "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    table = re.search(r"^budgets: .*\bhost (\d+\.\d+ [KMGT]iB)", result.stdout, re.M).group(1)
    auto_header = re.search(r"^auto placement .*host budget (\d+\.\d+ [KMGT]iB)", result.stdout, re.M).group(1)
    printed = {_budget_bytes(table), _budget_bytes(auto_header)}
    assert len(printed) == 1, result.stdout
    plan = json.loads(out_json.read_text())
    assert plan["budgets"]["host"] == plan["auto"]["host_budget"]
    assert plan["host_budget_default"] is (host_budget is None)
    assert abs(plan["budgets"]["host"] - printed.pop()) < 0.01 * plan["budgets"]["host"]
    if host_budget:
        assert plan["budgets"]["host"] == 1 << 30
    auto = plan["auto"]
    assert auto["possible"] and len(auto["units"]) == 25
    assert [u["name"] for u in auto["units"]][:2] == ["<root>", "unit1"]
    assert sum(u["compute_bytes"] for u in auto["units"]) + sum(u["state_bytes"] for u in auto["units"]) == \
        sum(auto["bytes_per_tier"].values())
    at_home = re.search(r"at home: device (.*), host (.*), nvme (.*)", result.stdout).groups()
    for tier, printed_bytes in zip(("device", "host", "nvme"), at_home):
        assert abs(auto["bytes_per_tier"][tier] - _budget_bytes(printed_bytes)) <= 0.01 * max(1, auto["bytes_per_tier"][tier])
    assert plan["prefetch"]["units_ahead"] >= 0 and plan["any_fits"] is True
    assert set(plan["bandwidth_bytes_per_second"]) >= {"nvme_read", "nvme_write"}


def test_plan_model_takes_offload_gpt_and_the_readme_factory_and_names_missing_arguments(tmp_path):
    result = run_cli("plan", "--model", "offload.gpt:GPT", "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert f"offload.gpt:GPT ({GPTConfig().num_params:,} parameters, {GPTConfig().num_layers + 1} units)" \
        in result.stdout
    # the README's example, as written there
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    factory = re.search(r"```python\n(# my_models\.py.*?)```", readme, re.S).group(1)
    command = re.search(r"^offload plan (--model my_models:.*)$", readme, re.M).group(1).split()
    (tmp_path / "my_models.py").write_text(factory)
    command[command.index("--json") + 1] = str(tmp_path / "plan.json")
    result = run_cli("plan", *command, extra_path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["auto"]["possible"]
    result = run_cli("plan", "--model", "offload.gpt:Block")
    assert result.returncode == 1
    assert "offload.gpt:Block needs arguments (cfg)" in result.stderr and "Traceback" not in result.stderr
