"""Trace-driven prefetch: the planner's budget guarantees, parity with prefetch on and off,
quiet steady state, and overlap of I/O with compute (issue 5)."""
import copy
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import offload
from offload.gpt import GPT, GPTConfig
from offload.prefetch import NEVER, ExecutionTrace, Prefetcher, plan_prefetch
from offload.units import OPTIMIZER_PIECE_NUMEL

from support import (CFG, REL_TOL, Checkpointed, SlowDevice, Sleepy, batches, gpt_loss, make_opt, max_rel_error,
                     nvme_gpt_engine, train_offload, train_reference, wrap_swap_io)


# ---------------------------------------------------------------------------- planner
def test_trace_next_use():
    trace = ExecutionTrace((1, 2, 3, 3 + 1, 3, 2, 1))
    assert trace.next_use(3, 0) == 2
    assert trace.next_use(3, 3) == 4
    assert trace.next_use(1, 1) == 6
    assert trace.next_use(9, 0) == NEVER


@st.composite
def planner_inputs(draw):
    num_units = draw(st.integers(1, 8))
    units = draw(st.lists(st.integers(0, num_units - 1), min_size=1, max_size=30))
    collapsed = [u for i, u in enumerate(units) if i == 0 or units[i - 1] != u]
    sizes = draw(st.lists(st.integers(1, 100), min_size=num_units, max_size=num_units))
    position = draw(st.integers(0, len(collapsed)))
    states = draw(st.lists(st.sampled_from(["home", "resident", "in_flight", "pinned"]),
                           min_size=num_units, max_size=num_units))
    extra_free = draw(st.integers(0, 300))
    ahead = draw(st.integers(0, 5))
    max_bytes = draw(st.one_of(st.none(), st.integers(0, 300)))
    return ExecutionTrace(tuple(collapsed)), sizes, position, states, extra_free, ahead, max_bytes


@settings(max_examples=400, deadline=None)
@given(planner_inputs())
def test_planner_never_plans_beyond_the_budget(inputs):
    trace, sizes, position, states, free, ahead, max_bytes = inputs
    resident = frozenset(u for u, s in enumerate(states) if s in ("resident", "pinned"))
    pinned = frozenset(u for u, s in enumerate(states) if s == "pinned")
    in_flight = frozenset(u for u, s in enumerate(states) if s == "in_flight")
    plan = plan_prefetch(trace, position, unit_bytes=sizes, resident=resident, in_flight=in_flight,
                         pinned=pinned, free_bytes=free, max_units_ahead=ahead, max_bytes_ahead=max_bytes)
    # budget: what it fetches fits in the free bytes plus what it evicts
    assert sum(sizes[u] for u in plan.fetch) <= free + sum(sizes[u] for u in plan.evict)
    # only unpinned resident units are evicted, each once; only absent units are fetched
    assert set(plan.evict) <= resident - pinned and len(set(plan.evict)) == len(plan.evict)
    assert not set(plan.fetch) & (resident | in_flight) and len(set(plan.fetch)) == len(plan.fetch)
    # only units of the look-ahead window, in trace order
    window = []
    for u in trace.units[position:]:
        if u not in window:
            window.append(u)
    window = window[:ahead]
    assert list(plan.fetch) == [u for u in window if u in plan.fetch]
    # look-ahead bytes: the window's units on the device or on their way, up to the last
    # one fetched, stay within max_bytes
    if max_bytes is not None and plan.fetch:
        upto = window[:window.index(plan.fetch[-1]) + 1]
        there = [u for u in upto if u in plan.fetch or u in in_flight or (u in resident and u not in plan.evict)]
        assert sum(sizes[u] for u in there) <= max_bytes
    # an evicted unit is never needed before a unit fetched in its place
    for v in plan.evict:
        assert all(trace.next_use(v, position) > trace.next_use(f, position) for f in plan.fetch)


def test_prefetcher_warns_once_per_cause_and_rerecords():
    seen = []
    p = Prefetcher(enabled=True, max_units_ahead=2, warn=seen.append)
    for order in ([1, 2, 3], [1, 2, 3], [1, 3], [1, 3], [1, 2, 3], [1, 2, 3]):
        p.begin_pass("train")
        for u in order:
            p.need(u)
    p.end_pass()
    # [1,3] diverges from [1,2,3] (warned), is recorded, then [1,2,3] diverges from [1,3]
    # with the same cause: no second warning.
    assert len(seen) == 1 and "unit 3" in seen[0]
    assert p.replaying is False


# ---------------------------------------------------------------------------- room
def _steady_counts(tmp_path, budget, name):
    """The small GPT on NVMe under ``budget``: wrap's warnings, then (hits, misses) over
    steps 2-4 (the first records the trace) and the state_dict."""
    torch.manual_seed(0)
    model = GPT(CFG)
    data = batches(4, seed=7)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / name), device_budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    with engine:
        train_offload(engine, data[:1])
        before = engine.stats()
        train_offload(engine, data[1:])
        after = engine.stats()
        state = {k: v.clone() for k, v in engine.state_dict().items()}
    counts = tuple(after[k] - before[k] for k in ("prefetch_hits", "prefetch_misses"))
    return caught, counts, state


@pytest.mark.host_device
def test_a_device_budget_with_no_room_ahead_is_named_at_wrap_and_the_budget_it_names_prefetches(tmp_path):
    """[Note: prefetch room] At the smallest device budget wrap accepts the arena holds the
    root unit and the one in use, nothing ahead: wrap warns, at the caller's line, and names
    the budget for prefetch_units (2) units ahead. At the floor a replayed use finds its unit
    on the device at most once a step (the first unit of a pass, fetched between passes); at
    the named budget every replayed use does. The numbers are the same."""
    from offload.config import format_size
    from offload.memory.budget import minimum_device_budget, model_unit_sizes
    from offload.plan import DEFAULT_PROFILE, report, shape_from_module

    floor = minimum_device_budget(model_unit_sizes(GPT(CFG), 4), "nvme", 4)
    caught, (hits, misses), at_floor = _steady_counts(tmp_path, floor, "floor")
    room = [w for w in caught if "leaves no room to fetch a unit ahead" in str(w.message)]
    assert len(room) == 1 and room[0].filename == __file__
    named = int(re.search(r"\((\d+) bytes\) lets the prefetcher keep 2 units ahead", str(room[0].message)).group(1))
    uses = 3 * (2 * CFG.num_layers - 1)  # three steps of blocks 0..3, 2..0 (3 used once at the turn)
    assert hits + misses == uses and hits <= 3, "at most the unit a pass begins with, once a step"
    block = 53248  # a block's fp32 compute copy: the named budget is the floor and two more
    assert named == floor + 2 * block
    with torch.device("meta"):  # offload plan says the same before any run
        text, _ = report(shape_from_module(GPT(CFG), "gpt"), "fp32", DEFAULT_PROFILE, None, None, None, 3, None, 1)
    assert f"({format_size(floor)}) leaves room for 0 units ahead" in text
    assert f"{format_size(named)} for 2" in text

    caught, (hits, misses), at_named = _steady_counts(tmp_path, named, "named")
    assert not [w for w in caught if "leaves no room" in str(w.message)]
    assert (hits, misses) == (uses, 0)
    caught, _, _ = _steady_counts(tmp_path, named - 1, "one_less")
    assert [w for w in caught if "leaves no room" in str(w.message)] == [], "one unit ahead still fits"
    assert at_floor.keys() == at_named.keys()
    assert all(torch.equal(at_floor[k], at_named[k]) for k in at_floor)


# ---------------------------------------------------------------------------- parity
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_model_parity_with_prefetch_on_and_off(prefetch, use_reentrant):
    torch.manual_seed(0)
    ref = Checkpointed(use_reentrant)
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(4, 16, generator=g) for _ in range(6)]
    loss_fn = lambda m, b: m(b.clone())  # noqa: E731
    train_reference(ref, data, loss_fn=loss_fn)
    budget = 20 * 1024  # root 4 KiB + one 8 KiB block + 2 KiB gradient fit; four blocks do not
    engine = offload.wrap(model, make_opt(model.parameters()),
                          config=dict(device_budget=budget, prefetch=prefetch))
    assert sum(u.compute_numel for u in engine.units) * 4 > budget
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a steady checkpointed loop replays its trace
        train_offload(engine, data, loss_fn=loss_fn)
    assert max_rel_error(engine.state_dict(), ref.state_dict()) < REL_TOL
    assert engine.stats()["device_peak_bytes"] <= budget
    if prefetch:
        assert engine.stats()["prefetch_hits"] > 0
    engine.close()


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("pipeline_depth", [2, 3])
def test_units_of_several_optimizer_pieces_update_as_whole_units(prefetch, pipeline_depth, tmp_path):
    # Blocks of 1.24 Mi trainable elements: two optimizer pieces each, so the staging slots
    # are reused within a unit, by early updates during backward (prefetch on: with two
    # slots for them, the next piece is read while Adam runs on this one) and by the step.
    # The reference is the engine with states on the host, updated a whole unit at a time
    # (at this width plain PyTorch's GEMMs round differently from those on the arena).
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=320, num_heads=4, num_layers=2)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g) for _ in range(4)]
    results = []
    for config in (dict(param_tier="host", optimizer_tier="host", prefetch=False),
                   dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path), prefetch=prefetch,
                        optimizer_pipeline_depth=pipeline_depth)):
        torch.manual_seed(0)
        model = GPT(cfg)
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            pieces = -(-max(u.master_numel for u in engine.units) // OPTIMIZER_PIECE_NUMEL)
            losses = train_offload(engine, data)
            results.append((losses, engine.state_dict()))
    assert pieces == 2
    (ref_losses, ref_state), (losses, state) = results
    assert losses == ref_losses
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


class Branchy(nn.Module):
    """Block 2 runs only when the batch mean is positive: data-dependent control flow."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i == 2 and x.mean() <= 0:
                continue
            x = x + block(x)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")])
def test_data_dependent_branch_parity(tiers, tmp_path):
    torch.manual_seed(0)
    ref = Branchy()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(11)
    data = [torch.randn(4, 16, generator=g) + (0.5 if i % 3 else -0.5) for i in range(9)]
    loss_fn = lambda m, b: m(b)  # noqa: E731
    train_reference(ref, data, loss_fn=loss_fn)
    config = dict(param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path),
                  device_budget=24 * 1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            train_offload(engine, data, loss_fn=loss_fn)
            assert max_rel_error(engine.state_dict(), ref.state_dict()) < REL_TOL
    divergence = [w for w in caught if "left the recorded unit trace" in str(w.message)]
    assert 1 <= len(divergence) <= 2, "one warning per cause, not one per step"
    # at the user's line: Branchy.forward's call of the module it did not call before,
    # not offload's nor torch's Module.__call__
    assert all(w.filename == __file__ for w in divergence), [w.filename for w in divergence]


def test_alternating_train_and_eval_keeps_both_traces_and_stays_quiet():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    data = batches(8)
    ref_opt = make_opt(ref.parameters())
    engine = offload.wrap(model, make_opt(model.parameters()), config=dict(device_budget=140 * 1024))
    for step, b in enumerate(data):
        if step == 2:
            warnings.simplefilter("error")  # from the third step on: no warning at all
        for m in (ref, engine):
            m.train()
        loss = gpt_loss(ref, b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(gpt_loss(engine, b))
        engine.step()
        for m in (ref, engine):
            m.eval()
        with torch.no_grad():
            expected = ref(b[:, :-1])
            got = engine(b[:, :-1])
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    warnings.resetwarnings()
    stats = engine.stats()
    assert stats["prefetch_hits"] > stats["prefetch_misses"]
    engine.close()


# ---------------------------------------------------------------------------- overlap
def requested_at_each_forward(prefetch, tmp_path, num_blocks=8, delay_s=0.007):
    """Per steady-state step, for each unit's forward start (in order): the names of the
    units whose compute copy was then requested or resident (not at home)."""
    torch.manual_seed(0)
    model = Sleepy(num_blocks, 0.005)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path), prefetch=prefetch,
                  device_budget=4096 * 8, prefetch_units=2)  # root + 3 blocks + a gradient
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    wrap_swap_io(engine, SlowDevice, delay_s)
    seen = []

    def record(unit, **_):
        seen.append((unit, {u.name for u in engine.units if u.compute_state != offload.units.Residency.HOME}))

    x = torch.randn(4, 32)
    steps, misses = [], []
    try:
        for step in range(5):
            seen.clear()
            before = engine.stats()["prefetch_misses"]
            with offload.faults.inject("hooks.forward", record):
                loss = engine(x)
            engine.backward(loss)
            engine.step()
            steps.append(list(seen))
            misses.append(engine.stats()["prefetch_misses"] - before)
    finally:
        engine.close()
    return steps[2:], misses[2:]  # the first step records the trace, the second replays it


# The CPU device's order: on CUDA (and its stand-in) the step's updates do not go through
# resident device copies ([Note: updates through the device copy]), so the next pass's
# first units are read again after every step and their requests follow another order.
@pytest.mark.host_device
def test_prefetch_overlaps_io_with_compute(tmp_path):
    """With prefetch every block's read is issued before the forward of the block before it
    starts, so it runs under that block's compute; without, a block is requested only when
    its own forward needs it. Checked by the order of requests and forwards, not by wall
    time (which the machine's load decides)."""
    on_steps, on_misses = requested_at_each_forward(True, tmp_path / "on")
    off_steps, _ = requested_at_each_forward(False, tmp_path / "off")
    assert on_misses == [0] * len(on_misses), "steady state: every unit was prefetched"
    for seen in on_steps:
        blocks = [(name, requested) for name, requested in seen if name.startswith("blocks.")]
        assert len(blocks) == 8
        for (name, requested), (following, _) in zip(blocks, blocks[1:]):
            assert following in requested, (name, following, requested)
    for seen in off_steps:
        blocks = [(name, requested) for name, requested in seen if name.startswith("blocks.")]
        assert any(following not in requested for (_, requested), (following, _) in zip(blocks, blocks[1:]))


def test_export_trace_writes_chrome_trace_events_per_lane(tmp_path):
    import json

    _, engine = nvme_gpt_engine(tmp_path)
    with engine:
        train_offload(engine, batches(3))
        engine.export_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    lanes = {e["cat"] for e in spans}
    assert {"compute", "copy", "adam", "phase"} <= lanes
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["name"] for e in spans}
    assert any(n.startswith("forward blocks.") for n in names)
    assert any(n.startswith("backward blocks.") for n in names)
    assert any(n.startswith("adam blocks.") for n in names)
    assert {"nvme read", "nvme write", "optimizer"} <= lanes  # early updates: steps 2 and 3
    phases = [e["name"] for e in spans if e["cat"] == "phase"]
    assert phases.count("forward") == 3 and phases.count("backward") == 3
    assert phases.count("optimizer step") == 3
    # NVMe requests overlap; each numbered lane holds spans that do not.
    lane_names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    by_lane = {}
    for e in spans:
        by_lane.setdefault(lane_names[e["tid"]], []).append((e["ts"], e["ts"] + e["dur"]))
    nvme_lanes = [name for name in by_lane if name.startswith("nvme")]
    assert "nvme read 0" in nvme_lanes and "nvme write 0" in nvme_lanes
    for name in nvme_lanes:
        intervals = sorted(by_lane[name])
        assert all(a[1] <= b[0] for a, b in zip(intervals, intervals[1:])), name
    # Spans are named by direction and size.
    for e in spans:
        if e["cat"] in ("nvme read", "nvme write"):
            assert e["name"].split(" ", 1)[0] == e["cat"].split(" ")[1], e


def test_trace_keeps_only_the_most_recent_spans_and_requests(tmp_path, monkeypatch):
    """A long run must not grow the timeline without bound: the engine keeps the last
    TIMELINE_SPANS spans and the NVMe tier the last TRACE_REQUESTS requests."""
    import json

    import offload.stats
    import offload.tiers.nvme

    monkeypatch.setattr(offload.stats, "TIMELINE_SPANS", 40)
    monkeypatch.setattr(offload.tiers.nvme, "TRACE_REQUESTS", 30)
    _, engine = nvme_gpt_engine(tmp_path)
    with engine:
        train_offload(engine, batches(4))
        assert engine.stats()["bytes_read_nvme"] > 0
        engine.export_trace(str(tmp_path / "trace.json"))
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    nvme = [e for e in spans if e["cat"].startswith("nvme")]
    assert len(spans) - len(nvme) == 40
    assert 0 < len(nvme) <= 30
    # the kept spans are the last ones: the final optimizer step is among them
    assert max(e["ts"] for e in spans if e["cat"] == "phase" and e["name"] == "optimizer step") >= \
        max(e["ts"] for e in spans if e["cat"] == "compute")


def test_prefetch_bytes_bounds_how_much_is_brought_ahead(tmp_path):
    """prefetch_bytes=0 leaves every fetch to the moment of use (only units that stayed on
    the device, as after an update through their device copy, are there when needed);
    without it the same run prefetches. Either way the numbers are the same."""
    results = {}
    for limit in (None, 0):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / str(limit)),
                      device_budget=140 * 1024, prefetch_bytes=limit)
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            train_offload(engine, batches(2))
            before = engine.stats()
            train_offload(engine, batches(2, seed=5))
            after = engine.stats()
            results[limit] = (after["prefetch_hits"] - before["prefetch_hits"],
                              after["prefetch_misses"] - before["prefetch_misses"], engine.state_dict())
    (hits, misses, state), (hits0, misses0, state0) = results[None], results[0]
    assert misses0 > misses and hits0 < hits
    for k in state:
        assert torch.equal(state[k], state0[k]), k


def test_the_recording_pass_counts_as_unplanned_and_the_replayed_ones_hit_with_a_big_tied_root(tmp_path):
    """[Note: prefetch counters] The shape of issue 17's 3B run, scaled down: a tied
    embedding in the root unit about 2.7 blocks large (its gradient reserve as large again),
    room for 8 of 16 blocks, both tiers on NVMe, clipping on. The first step records the
    trace: every fetch of it is unplanned, none a miss (they were 48 of the 3B run's 110
    "misses" after two steps). Every later step replays it with no miss: forward needs 16
    blocks, backward 15 (the last block of forward is still the unit in use)."""
    torch.manual_seed(0)
    layers, element_bytes = 16, 2
    cfg = GPTConfig(vocab_size=4096, seq_len=32, d_model=128, num_heads=4, num_layers=layers)
    model = GPT(cfg)
    root_bytes = (cfg.vocab_size + cfg.seq_len + 2) * cfg.d_model * element_bytes
    block_bytes = ((4 + 2 * cfg.mlp_ratio) * cfg.d_model ** 2 + (cfg.mlp_ratio + 6) * cfg.d_model) * element_bytes
    budget = root_bytes + cfg.vocab_size * cfg.d_model * element_bytes + 8 * (block_bytes + 4096) + 8192
    config = dict(param_tier="nvme", optimizer_tier="nvme", dtype="bf16", swap_dir=str(tmp_path),
                  device_budget=budget, max_grad_norm=1.0)
    batch = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    counted = []
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        prefetcher = engine.debug.prefetcher
        for _ in range(3):
            before = (prefetcher.unplanned, prefetcher.hits, prefetcher.misses)
            engine.backward(gpt_loss(engine, batch))
            engine.step()
            after = (prefetcher.unplanned, prefetcher.hits, prefetcher.misses)
            counted.append(tuple(a - b for a, b in zip(after, before)))
        stats = engine.stats()
    uses = layers + layers - 1
    assert counted == [(uses, 0, 0), (0, uses, 0), (0, uses, 0)]
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (2 * uses, 0)
