"""Placement by budget ([Note: placement by budget], offload/memory/placement.py):
param_tier/optimizer_tier "auto" place each unit's compute copy and states on host or NVMe
within host_budget, never change what is computed, and ``offload plan`` places as wrap does."""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload import plan
from offload.config import OffloadConfig
from offload.gpt import GPT, GPTConfig
from offload.memory.budget import host_bytes, minimum_device_budget, minimum_host_budget
from offload.memory.layout import Layout
from offload.memory.placement import DEFAULT_PROFILE, DELAYED_IO_CPU_FRACTION, EXPOSED_IO_FRACTION, predict_step
from support import (CFG, RSS_SLACK_BYTES, assert_same_state, batches, gpt_loss, make_opt, rss_gpt_sizes, train_gpt,
                     train_in_fresh_process)

CPU = torch.device("cpu")
# Budgets and plans here are worked out for the CPU device as users run it, which needs no
# fetch staging buffers: [Note: streams]
pytestmark = pytest.mark.host_device


def base(tmp_path, dtype="fp32", **extra):
    """A CPU run with swap under tmp_path and the device budget at its floor (below every
    unit: "auto" then places compute copies on host or NVMe, not the device)."""
    extra.setdefault("device_budget", minimum_device_budget(gpt_sizes(dtype), "nvme", 4 if dtype == "fp32" else 2))
    return dict(device="cpu", dtype=dtype, swap_dir=str(tmp_path / "swap"), **extra)


def gpt_sizes(dtype, cfg=CFG):
    """The units of the GPT as wrap cuts them on one process."""
    with torch.device("meta"):
        shape = plan.shape_from_module(GPT(cfg), "gpt")
    e = 4 if dtype == "fp32" else 2
    return [u.sizes(e) for u in shape.units]


def all_nvme_floor(tmp_path, dtype, **extra):
    """The smallest host_budget wrap accepts with every state on NVMe (the auto floor)."""
    sizes = gpt_sizes(dtype)
    config = OffloadConfig(**base(tmp_path, dtype, **extra))
    tiers = (("nvme",) * len(sizes), tuple("nvme" if u.trainable else "" for u in sizes))
    return minimum_host_budget(sizes, Layout.resolve(config, CPU, None, tiers))


def all_host_need(tmp_path, dtype, **extra):
    """What the run holds in RAM with every state on the host (the auto ceiling)."""
    sizes = gpt_sizes(dtype)
    config = OffloadConfig(**base(tmp_path, dtype, **extra))
    tiers = (("host",) * len(sizes), tuple("host" if u.trainable else "" for u in sizes))
    return host_bytes(sizes, Layout.resolve(config, CPU, None, tiers)).total


def placement_of(config):
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        return engine.placement(), engine.stats(), engine.layout


def tiers(placement):
    return "".join(u.compute_tier[0] for u in placement.units) + "/" + \
        "".join((u.state_tier or "-")[0] for u in placement.units)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_generous_host_budget_places_everything_in_ram_and_computes_what_host_host_computes(tmp_path, dtype):
    data = batches(3)
    auto = base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", host_budget="1GiB")
    placement, stats, layout = placement_of(auto)
    assert {u.compute_tier for u in placement.units} == {"host"}
    assert {u.state_tier for u in placement.units} == {"host"}
    assert placement.bytes_per_tier()["nvme"] == 0 and stats["nvme_bytes"] == 0
    assert stats["home_bytes_host"] == placement.bytes_per_tier()["host"] > 0
    assert (layout.param_tier, layout.optimizer_tier) == ("host", "host")
    losses, state, *_ = train_gpt(auto, data)
    ref_losses, ref_state, *_ = train_gpt(base(tmp_path, dtype, param_tier="host", optimizer_tier="host"), data)
    assert losses == ref_losses
    assert_same_state(state, ref_state)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_tiny_host_budget_places_everything_on_nvme_and_computes_what_nvme_nvme_computes(tmp_path, dtype):
    data = batches(3)
    floor = all_nvme_floor(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme", split_master=False)
    auto = base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", host_budget=floor)
    placement, stats, layout = placement_of(auto)
    assert tiers(placement) == "nnnnn/nnnnn"
    # the swap file also holds the gradient extents (the floor spills gradients)
    assert stats["home_bytes_host"] == 0 and 0 < stats["home_bytes_nvme"] < stats["nvme_bytes"]
    assert not layout.split_master  # never with "auto": every placement computes the same
    losses, state, *_ = train_gpt(auto, data)
    ref_losses, ref_state, *_ = train_gpt(base(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme",
                                               split_master=False), data)
    assert losses == ref_losses
    assert_same_state(state, ref_state)
    with pytest.raises(ValueError, match="host_budget"):
        placement_of(dict(auto, host_budget=floor - 1))
    assert not os.listdir(tmp_path / "swap")  # refused before any swap file


MODES = {
    "plain": {},
    "clipped": dict(max_grad_norm=0.05),  # clips on some steps: speculative updates, redone
    "accumulation": dict(gradient_accumulation_steps=2, max_grad_norm=1.0),
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_mixed_placement_computes_the_all_nvme_numbers_bit_for_bit(tmp_path, dtype, mode):
    """Budgets between the floor and everything: each gives a placement with both tiers,
    and each computes exactly what the all-NVMe run computes (split_master off: "auto"
    never splits the master, whose compute copy rounds ties differently)."""
    extra = dict(MODES[mode], split_master=False)
    data = batches(4)
    ref_losses, ref_state, ref_stats, ref_norms = train_gpt(
        base(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme", **extra), data)
    floor = all_nvme_floor(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme", **extra)
    ceiling = all_host_need(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", **extra)
    mixed = {}  # placement -> the first budget (in tenths from floor to ceiling) that gives it
    for k in range(1, 10):
        budget = floor + (ceiling - floor) * k // 10
        where = tiers(placement_of(base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto",
                                        host_budget=budget, **extra))[0])
        if "h" in where and "n" in where:
            mixed.setdefault(where, budget)
    assert len(mixed) >= 3, mixed
    for where, budget in sorted(mixed.items(), key=lambda item: item[1])[:3]:
        auto = base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", host_budget=budget, **extra)
        losses, state, stats, norms = train_gpt(auto, data)
        assert losses == ref_losses, where
        assert norms == ref_norms, where
        assert_same_state(state, ref_state)
        # the homes are within the budget (the gradients are a soft bound, [Note: gradient
        # spill]: how many wait for queued updates depends on timing; the RSS test below
        # bounds the process)
        assert 0 < stats["home_bytes_host"] <= budget and stats["home_bytes_nvme"] > 0
        if mode != "plain":  # speculated: run, or taken back by step() before the worker started it
            assert stats["speculative_updates"] + stats["taken_back_updates"] > 0


def test_units_forward_needs_first_get_ram_first(tmp_path):
    """Equal blocks: the compute copies in RAM are those of the first blocks in forward
    order (their updates finish last in backward and the next forward needs them first)."""
    floor = all_nvme_floor(tmp_path, "fp32", param_tier="nvme", optimizer_tier="nvme")
    sizes = gpt_sizes("fp32")
    block = sizes[1].home_numel * 4
    for n in (1, 2, 3):
        auto = base(tmp_path, param_tier="auto", optimizer_tier="nvme", host_budget=floor + n * block)
        placement, _, _ = placement_of(auto)
        blocks = [u.compute_tier for u in placement.units[1:]]
        assert blocks == ["host"] * n + ["nvme"] * (len(blocks) - n), (n, blocks)
        assert {u.state_tier for u in placement.units} == {"nvme"}  # explicit: kept


def test_auto_without_a_swap_dir_keeps_everything_in_ram(tmp_path):
    floor = minimum_device_budget(gpt_sizes("fp32"), "nvme", 4)
    auto = dict(device="cpu", param_tier="auto", optimizer_tier="auto", device_budget=floor)
    placement, stats, _ = placement_of(auto)
    assert tiers(placement) == "hhhhh/hhhhh" and stats["nvme_bytes"] == 0
    with pytest.raises(ValueError, match="host_budget"):
        placement_of(dict(auto, host_budget=100_000))


@pytest.mark.parametrize("device_budget", [None, "all"])
def test_compute_copies_go_to_the_device_when_its_budget_holds_them_all(tmp_path, device_budget):
    """device_budget None (no limit) or one that holds every unit: param_tier "auto" puts
    every compute copy on the device, as param_tier="device" does, and computes what that
    computes; the states are still placed by host_budget."""
    sizes = gpt_sizes("fp32")
    if device_budget == "all":
        device_budget = minimum_device_budget(sizes, "device", 4)
    auto = base(tmp_path, param_tier="auto", optimizer_tier="auto", device_budget=device_budget)
    placement, stats, layout = placement_of(auto)
    assert {u.compute_tier for u in placement.units} == {"device"} and layout.param_tier == "device"
    assert stats["home_bytes_device"] == sum(u.compute_numel for u in sizes) * 4
    data = batches(3)
    losses, state, *_ = train_gpt(auto, data)
    ref_losses, ref_state, *_ = train_gpt(base(tmp_path, param_tier="device", optimizer_tier="host",
                                               device_budget=device_budget), data)
    assert losses == ref_losses
    assert_same_state(state, ref_state)
    one_byte_short = minimum_device_budget(sizes, "device", 4) - 1
    placement, _, _ = placement_of(dict(auto, device_budget=one_byte_short))
    assert "device" not in {u.compute_tier for u in placement.units}


def test_the_default_tiers_are_auto_and_compute_what_host_host_computes(tmp_path):
    """Issue 19: "auto" is the default of both tiers. With nothing set it keeps every compute
    copy on the device (device_budget None) and every state in RAM; where the run may update
    speculatively (clipping here) the compute copies stay at home as with param_tier "host";
    with the device budget at its floor and no swap_dir, everything is on the host as with
    the old defaults. Every case computes what explicit (host, host) computes, bit for bit."""
    assert (OffloadConfig().param_tier, OffloadConfig().optimizer_tier) == ("auto", "auto")
    floor = minimum_device_budget(gpt_sizes("fp32"), "nvme", 4)
    data = batches(3)
    for extra, expected in ((dict(), "ddddd/hhhhh"), (dict(max_grad_norm=0.5), "hhhhh/hhhhh"),
                            (dict(max_grad_norm=0.5, speculative_updates=False), "ddddd/hhhhh"),
                            (dict(device_budget=floor), "hhhhh/hhhhh")):
        defaults = dict(device="cpu", **extra)
        placement, stats, _ = placement_of(defaults)
        assert tiers(placement) == expected, extra
        assert stats["nvme_bytes"] == 0
        losses, state, *_ = train_gpt(defaults, data)
        ref_losses, ref_state, *_ = train_gpt(dict(defaults, param_tier="host", optimizer_tier="host"), data)
        assert losses == ref_losses, extra
        assert_same_state(state, ref_state)


def test_the_default_tiers_with_a_swap_dir_use_nvme_only_beyond_the_host_budget(tmp_path):
    """The defaults with a swap_dir: everything in RAM while host_budget holds it (no NVMe
    byte), states on NVMe only beyond it, where explicit (host, host) is refused at wrap."""
    floor = minimum_device_budget(gpt_sizes("fp32"), "nvme", 4)
    roomy = dict(device="cpu", device_budget=floor, swap_dir=str(tmp_path / "swap"))
    placement, stats, _ = placement_of(roomy)
    assert tiers(placement) == "hhhhh/hhhhh" and stats["nvme_bytes"] == 0
    tight = dict(roomy, host_budget=all_nvme_floor(tmp_path, "fp32"))
    placement, stats, _ = placement_of(tight)
    assert "n" in tiers(placement) and stats["nvme_bytes"] > 0
    with pytest.raises(ValueError, match="host_budget"):
        placement_of(dict(tight, param_tier="host", optimizer_tier="host"))


def test_a_machine_profile_is_checked_at_wrap_before_anything_is_touched(tmp_path):
    model = GPT(CFG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_opt(model.parameters())
    for content, match in ((None, "machine_profile: cannot read"), ("{", "machine_profile: .* not valid JSON"),
                           (json.dumps({"schema": "x"}), "machine_profile: .*not an offload profile")):
        path = tmp_path / "profile.json"
        if content is not None:
            path.write_text(content)
        with pytest.raises(ValueError, match=match):
            offload.wrap(model, opt, config=base(tmp_path, param_tier="auto", optimizer_tier="auto",
                                                 machine_profile=str(path)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "swap").exists() or not os.listdir(tmp_path / "swap")
    with pytest.raises(ValueError, match="param_tier"):
        OffloadConfig(param_tier="fastest")
    with pytest.raises(ValueError, match="machine_profile"):
        OffloadConfig(machine_profile=3)


@pytest.mark.parametrize("delayed", [False, True], ids=["exact", "delayed"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compute_copies_go_to_ram_before_states(tmp_path, dtype, delayed):
    """Per byte of RAM a compute copy saves more NVMe time than the states (it is read twice
    a step, the states once, both written once) whatever the bandwidths: as the budget
    grows, no unit's states are placed in RAM before every compute copy is, except all at
    once when everything fits. With delayed updates ([Note: delayed updates]) the compute
    copies' RAM counts twice (the spare) and the states' once, but the states' traffic runs
    beside the next forward and backward and only its CPU share counts: compute copies still
    go first, and a unit's states are in RAM only where its compute copy is (a whole spared
    block may not fit where the root's copy and states do)."""
    extra = dict(delayed_update=True) if delayed else {}
    floor = all_nvme_floor(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme", split_master=False, **extra)
    ceiling = all_host_need(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", **extra)
    found = []
    for k in range(0, 11):
        budget = floor + (ceiling - floor) * k // 10
        placement, _, _ = placement_of(base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto",
                                            host_budget=budget, **extra))
        computes, states = tiers(placement).split("/")
        found.append(tiers(placement))
        if delayed:
            assert all(c == "h" for c, t in zip(computes, states) if t == "h"), found
        elif "h" in states:
            assert computes == "hhhhh", found
    assert found[0] == "nnnnn/nnnnn" and found[-1] == "hhhhh/hhhhh", found
    if delayed:  # more compute copies in RAM than states, somewhere between
        assert any(w.split("/")[0].count("h") > w.split("/")[1].count("h") for w in found), found
    elif dtype == "bf16":
        assert any(w.startswith("hhhhh/") and "n" in w for w in found), found  # states partly on NVMe
    # In fp32 this model has no such window: below the all-RAM need gradients spill, and the
    # spill's floor (budget.spill_floor_bytes: two units' gradients where early updates read
    # spilled units back during backward) is more than the states left on NVMe would take,
    # so the states go to RAM all at once, when every gradient fits too.


MODELS = {
    "gpt": lambda: GPT(CFG),
    "gpt-wide": lambda: GPT(GPTConfig(vocab_size=128, seq_len=16, d_model=64, num_heads=4, num_layers=6)),
}


@pytest.mark.parametrize("name,delayed", [("gpt", False), ("gpt-wide", False), ("gpt", True)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_planner_places_every_unit_as_the_engine_does(tmp_path, name, delayed, dtype):
    with torch.device("meta"):
        shape = plan.shape_from_module(MODELS[name](), name)
    sizes = [u.sizes(4 if dtype == "fp32" else 2) for u in shape.units]
    config = base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", max_grad_norm=1.0,
                  delayed_update=delayed,  # [Note: delayed updates] spare homes for every trainable unit
                  device_budget=minimum_device_budget(sizes, "nvme", 4 if dtype == "fp32" else 2))
    floor = minimum_host_budget(sizes, Layout.resolve(OffloadConfig(**config), CPU, None, (
        ("nvme",) * len(sizes), tuple("nvme" for _ in sizes))))
    full = host_bytes(sizes, Layout.resolve(OffloadConfig(**config), CPU, None, (
        ("host",) * len(sizes), ("host",) * len(sizes)))).total
    seen = set()
    for budget in (floor + (full - floor) * k // 6 for k in range(7)):
        planned, _, _ = plan.auto_placement(shape, dict(config, host_budget=budget))
        torch.manual_seed(0)
        model = MODELS[name]()
        with offload.wrap(model, make_opt(model.parameters()), config=dict(config, host_budget=budget)) as engine:
            assert engine.placement() == planned, budget
        seen.add(tiers(planned))
    assert len(seen) >= 4, seen  # all NVMe, mixed ones, all in RAM


def test_offload_plan_prints_the_engine_placement_and_a_predicted_step(tmp_path):
    module = tmp_path / "plan_models.py"
    module.write_text("from offload.gpt import GPT, GPTConfig\n"
                      "def build():\n    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, "
                      "num_heads=2, num_layers=4))\n")
    budget = all_nvme_floor(tmp_path, "fp32", param_tier="nvme", optimizer_tier="nvme") + 120_000
    out = subprocess.run([sys.executable, "-m", "offload", "plan", "--model", "plan_models:build", "--dtype", "fp32",
                          "--host-budget", str(budget), "--device-budget", str(base(tmp_path)["device_budget"]),
                          "--compute-seconds", "2", "--swap-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                             [os.path.dirname(os.path.dirname(offload.__file__)), os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stderr
    text = out.stdout[out.stdout.index("auto placement"):]
    placement, _, _ = placement_of(base(tmp_path, param_tier="auto", optimizer_tier="auto", host_budget=budget))
    for line in placement.describe():
        assert line in text
    assert "predicted step: " in text
    assert f"+ {EXPOSED_IO_FRACTION:g} x min(compute, I/O)" in text


def test_offload_plan_with_delayed_update_counts_spares_and_hides_the_update_io(tmp_path):
    """--delayed-update: the placement is the engine's with delayed_update=True (spare homes
    counted), and the predicted step is max(compute + DELAYED_IO_CPU_FRACTION x I/O, I/O)
    ([Note: step prediction]): nothing exposed, the updates' CPU work beside compute."""
    from offload.cli import main

    shape = plan.shape_from_count(2e7, 4)
    budget = 150 << 20
    common = ["plan", "--params", "2e7", "--num-units", "4", "--dtype", "bf16", "--host-budget", str(budget),
              "--device-budget", str(64 << 20), "--compute-seconds", "2", "--swap-dir", str(tmp_path)]
    texts, nvme = {}, {}
    for delayed in (False, True):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(common + (["--delayed-update"] if delayed else [])) == 0
        texts[delayed] = out.getvalue()[out.getvalue().index("auto placement"):]
        config = dict(device="cpu", dtype="bf16", param_tier="auto", optimizer_tier="auto", host_budget=budget,
                      device_budget=64 << 20, swap_dir=str(tmp_path), delayed_update=delayed)
        placement, _, _ = plan.auto_placement(shape, config)
        for line in placement.describe():
            assert line in texts[delayed]
        nvme[delayed] = placement.bytes_per_tier().get("nvme", 0)
    assert "delayed_update" in texts[True] and "delayed_update" not in texts[False]
    assert f"max(compute + {DELAYED_IO_CPU_FRACTION:g} x I/O, I/O))" in texts[True]
    assert "min(compute, I/O)" not in texts[True] and f"+ {EXPOSED_IO_FRACTION:g} x min(compute, I/O)" in texts[False]
    assert nvme[True] > nvme[False] > 0, nvme  # the spares take RAM: more goes to NVMe


def test_the_prediction_counts_the_bytes_each_placement_moves(tmp_path):
    """predict_step's NVMe bytes per step against a measured run, for the all-NVMe and a
    mixed placement: a compute copy read in forward and in backward (the root once), a
    merged master read and written by its update, the moments read and written."""
    data = batches(4)
    floor = all_nvme_floor(tmp_path, "fp32", param_tier="nvme", optimizer_tier="nvme")
    sizes = gpt_sizes("fp32")
    for budget in (floor, floor + 250_000):
        config = base(tmp_path, param_tier="auto", optimizer_tier="auto", host_budget=budget,
                      device_budget=minimum_device_budget(sizes, "nvme", 4), overlap_step_with_forward=False)
        torch.manual_seed(0)
        model = GPT(CFG)
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            for b in data[:2]:
                engine.backward(gpt_loss(engine, b))
                engine.step()
            s0 = engine.stats()
            for b in data[2:]:
                engine.backward(gpt_loss(engine, b))
                engine.step()
            s1 = engine.stats()
            predicted = predict_step(sizes, engine.layout, DEFAULT_PROFILE, 1.0)
        read = (s1["bytes_read_nvme"] - s0["bytes_read_nvme"]) / 2
        written = (s1["bytes_written_nvme"] - s0["bytes_written_nvme"]) / 2
        assert abs(read - predicted.nvme_read_bytes) <= 0.15 * read, (budget, read, predicted)
        assert abs(written - predicted.nvme_write_bytes) <= 0.15 * written, (budget, written, predicted)
        assert predicted.seconds >= max(1.0, predicted.io_seconds)


@pytest.mark.parametrize("delayed", [False, True], ids=["exact", "delayed"])
def test_the_predicted_step_shows_io_beside_compute_unless_updates_are_delayed(delayed, tmp_path):
    """[Note: step prediction] The exact path's step is max(compute, I/O) plus
    EXPOSED_IO_FRACTION of the smaller of the two; with delayed_update a step's updates run
    under the next forward and backward whole, their CPU work (DELAYED_IO_CPU_FRACTION of
    the I/O time) beside compute: max(compute + that, I/O)."""
    _, _, layout = placement_of(base(tmp_path, param_tier="nvme", optimizer_tier="nvme", delayed_update=delayed))
    sizes = gpt_sizes("fp32")
    for compute in (1e-3, 1.0, 1e3):
        predicted = predict_step(sizes, layout, DEFAULT_PROFILE, compute)
        io_s = predicted.io_seconds
        assert io_s > 0
        if delayed:
            expected = max(compute + DELAYED_IO_CPU_FRACTION * io_s, io_s)
        else:
            expected = max(compute, io_s) + EXPOSED_IO_FRACTION * min(compute, io_s)
        assert predicted.seconds == pytest.approx(expected, rel=1e-12)
    # where the CPU work tips the balance: I/O a little longer than compute
    compute = 0.9 * io_s
    expected = (compute + DELAYED_IO_CPU_FRACTION * io_s) if delayed else io_s + EXPOSED_IO_FRACTION * compute
    assert predict_step(sizes, layout, DEFAULT_PROFILE, compute).seconds == pytest.approx(expected, rel=1e-12)


def test_rss_of_a_mixed_placement_stays_under_a_bound_from_the_host_budget(tmp_path):
    """A GPT (d_model 512, 16 layers: 810 MB of fp32 state) placed by a 250 MB host budget:
    part of it in RAM, the rest on NVMe. Peak RSS (ru_maxrss, fresh process) at most the
    RSS after import + host_budget + device_budget (the CPU "device" is RAM) + 256 MiB for
    what no budget covers (activations, autograd's gradients before the hook takes them,
    the I/O engine, allocator slack), as in test_optim_grad_spill."""
    host_budget, device_budget = 250 << 20, minimum_device_budget(rss_gpt_sizes(), "nvme", 4)
    baseline, peak, stats = train_in_fresh_process(dict(
        device="cpu", param_tier="auto", optimizer_tier="auto", swap_dir=str(tmp_path / "swap"),
        host_budget=host_budget, device_budget=device_budget))
    assert stats["home_bytes_host"] > 100 << 20 and stats["home_bytes_nvme"] > 300 << 20  # mixed
    assert peak <= baseline + host_budget + device_budget + RSS_SLACK_BYTES, \
        f"peak RSS {peak} over {baseline} + {host_budget} + {device_budget} + {RSS_SLACK_BYTES}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_mixed_placement_of_a_delayed_run_computes_the_all_nvme_numbers(tmp_path, dtype):
    """delayed_update with "auto": the spare homes (the lagging copy's) are counted where
    each unit lives, and a mixed placement computes what the all-NVMe delayed run does."""
    extra = dict(split_master=False, delayed_update=True, delayed_update_warmup_steps=1)
    data = batches(5)
    ref_losses, ref_state, *_ = train_gpt(base(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme", **extra),
                                          data)
    floor = all_nvme_floor(tmp_path, dtype, param_tier="nvme", optimizer_tier="nvme", **extra)
    ceiling = all_host_need(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", **extra)
    for k in range(3, 10):
        budget = floor + (ceiling - floor) * k // 10
        auto = base(tmp_path, dtype, param_tier="auto", optimizer_tier="auto", host_budget=budget, **extra)
        placement, _, layout = placement_of(auto)
        if "h" in tiers(placement) and "n" in tiers(placement):
            break
    else:
        pytest.fail("no budget gave a mixed placement")
    assert layout.spare_homes and {u.compute_tier for u in placement.units} <= {"host", "nvme"}
    losses, state, stats, _ = train_gpt(auto, data)
    assert losses == ref_losses
    assert_same_state(state, ref_state)
    assert stats["delayed_updates"] > 0
