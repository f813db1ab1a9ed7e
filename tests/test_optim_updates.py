"""The update scheduler: early updates during backward, updates deferred past step()
(overlap_step_with_forward) and their fills of the next forward's device copies give the
numbers of updates inside step(), and failures leave the engine consistent."""
import threading
import warnings

import pytest

import torch

import offload
import offload.faults
from offload.gpt import GPT

from support import (CFG, SlowDevice, Sleepy, UpdatesHeldForTheNextForward, batches, gpt_loss, make_opt,
                     nvme_gpt_engine, train_offload, wrap_swap_io)


# ---------------------------------------------------------------------------- early updates
def test_state_dict_between_backward_and_step_is_refused_after_early_updates(tmp_path):
    """Early updates change some units during backward: a state_dict taken before step()
    would mix two steps, so it is refused with the remedy; after step() it matches a run
    that never asked."""
    _, engine = nvme_gpt_engine(tmp_path)
    _, other = nvme_gpt_engine(tmp_path, "ref")  # the same seed: the same model
    data = batches(3)
    with engine, other:
        train_offload(engine, data[:2])
        train_offload(other, data[:2])
        before = engine.stats()["early_updates"]
        engine.backward(gpt_loss(engine, data[2]))
        assert engine.stats()["early_updates"] > before
        with pytest.raises(RuntimeError, match=r"between backward\(\) and step\(\).*call it after step"):
            engine.state_dict()
        engine.step()
        train_offload(other, data[2:])
        after, expected = engine.state_dict(), other.state_dict()
        assert after.keys() == expected.keys()
        for k in expected:
            assert torch.equal(after[k], expected[k]), k


# ---------------------------------------------------------------------------- deferred updates
def train_with_schedule(engine, data, eval_batch=None, norms=None):
    """Steps with an LR scheduler that changes the rate right after every step (an update
    still queued must use the rate of its own step) and, when given, an eval forward and
    a state_dict between steps; ``norms`` collects each step's gradient norm."""
    schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda i: 1.0 / (1 + i))
    evals = []
    for b in data:
        engine.backward(gpt_loss(engine, b))
        engine.step()
        schedule.step()
        if norms is not None:
            norms.append(engine.stats()["grad_norm"])
        if eval_batch is not None:
            engine.eval()
            with torch.no_grad():
                evals.append(engine(eval_batch[:, :-1]))
            engine.train()
    return evals


@pytest.mark.parametrize("dtype,max_grad_norm", [("fp32", None), ("bf16", None), ("fp32", 8.6), ("bf16", 8.6)])
def test_deferred_updates_equal_updates_inside_step_bit_for_bit(dtype, max_grad_norm, tmp_path):
    """overlap_step_with_forward: step() returns with updates still queued; the next
    forward waits per unit. Same numbers as the updates done inside step(), with an LR
    scheduler stepping right after step() and eval forwards between steps. With clipping
    and no speculative updates, step() takes the norm and defers every update with the
    clip coefficient (8.6 clips on some steps of this run and not others)."""
    data, probe = batches(5), batches(1, seed=9)[0]
    results = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG)
        config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / str(overlap)),
                      device_budget=140 * 1024 * (2 if dtype == "fp32" else 1), dtype=dtype,
                      overlap_step_with_forward=overlap, max_grad_norm=max_grad_norm, speculative_updates=False)
        norms = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eval passes are a trace kind of their own
            with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
                evals = train_with_schedule(engine, data, probe, norms if max_grad_norm else None)
                stats = engine.stats()
                results[overlap] = (engine.state_dict(), evals, stats, norms)
                trainable_units = sum(1 for u in engine.units if u.trainable)
    on, off = results[True], results[False]
    assert on[2]["deferred_updates"] > 0 and off[2]["deferred_updates"] == 0
    assert on[3] == off[3]
    if max_grad_norm is not None:
        assert on[2]["early_updates"] == 0 and on[2]["deferred_updates"] == len(data) * trainable_units
        assert min(on[3]) < max_grad_norm < max(on[3]), on[3]  # clipped on some steps, not on others
    for k in off[0]:
        assert torch.equal(on[0][k], off[0][k]), k
    for a, b in zip(on[1], off[1]):
        assert torch.equal(a, b)


def test_step_returns_before_its_deferred_updates_finish(tmp_path):
    """With slow swap I/O the updates queued by step() are still running when it returns
    (the trace shows them after the step phase), and the next forward's first unit is
    updated before the others (the queue follows the next forward's order)."""
    import json

    torch.manual_seed(0)
    model = Sleepy(8, 0.0)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"),
                  device_budget=4096 * 8, prefetch_units=2)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    wrap_swap_io(engine, SlowDevice, 0.005)
    x = torch.randn(4, 32)
    try:
        for _ in range(3):
            engine.backward(engine(x))
            engine.step()
        engine.backward(engine(x))  # waits for the last step's updates: their spans are in
        engine.export_trace(str(tmp_path / "trace.json"))
        engine.step()
    finally:
        engine.close()
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    last_step = max((e for e in spans if e["name"] == "optimizer step"), key=lambda e: e["ts"])
    step_end = last_step["ts"] + last_step["dur"]
    after = [e for e in spans if e["cat"] == "optimizer" and e["ts"] + e["dur"] > step_end]
    assert after, "every update had finished when step() returned"
    # the next forward waited for them: "wait" spans before its units, after step()
    assert any(e["cat"] == "wait" and e["name"].startswith("before forward") and e["ts"] >= step_end
               for e in spans)
    # the updates that started between step() and the next backward ran in the order the
    # next forward needs the units
    next_backward = min(e["ts"] for e in spans if e["name"] == "backward" and e["ts"] > last_step["ts"])
    queued = sorted((e for e in spans if e["cat"] == "optimizer" and last_step["ts"] <= e["ts"] < next_backward),
                    key=lambda e: e["ts"])
    names = [e["name"].split()[1] for e in queued]
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blocks.")]
    assert blocks == sorted(blocks), names


def slow_sleepy_engine(swap_dir, seed=0, budget_units=8, **config):
    """[Note: updates fill the device copy] An 8-block Sleepy model on NVMe tiers whose swap
    requests take 5 ms each: the updates step() leaves are still queued when the next
    forward looks ahead."""
    torch.manual_seed(seed)
    model = Sleepy(8, 0.0)
    config = dict(dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(swap_dir),
                       device_budget=4096 * budget_units, prefetch_units=2), **config)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    wrap_swap_io(engine, SlowDevice, 0.005)
    return engine


# Clipping on (never triggering) without speculation: no early updates, so step() defers
# every update, and UpdatesHeldForTheNextForward holds each until the next forward is near.
ALL_DEFERRED = dict(max_grad_norm=1e9, speculative_updates=False)


def train_sleepy(engine, x, steps):
    for _ in range(steps):
        engine.backward(engine(x))
        engine.step()


def state_after(engine, x, steps):
    """The weights after ``steps`` more steps, with the last step's updates finished."""
    train_sleepy(engine, x, steps)
    engine.zero_grad()
    return engine.state_dict()


@pytest.mark.host_device
def test_deferred_updates_fill_the_device_copies_of_the_next_forward(tmp_path):
    """[Note: updates fill the device copy] With slow swap I/O the updates step() leaves
    are still queued when the next forward's prefetcher looks ahead: those units get their
    device slots then, and their updates write the new compute copies into them (no read
    of the home afterwards); one already being updated is read once its writes are done.
    Against the same run with those units left to on-demand fetches: the same numbers, no
    prefetch misses in the steady state (4 a step without), and fewer reads of compute
    copies (a fill saves one; how many units backward reads again depends on what is
    resident, so the saving is not exactly one unit a fill)."""
    results = {}
    x = torch.randn(4, 32)
    for fill in (True, False):
        with slow_sleepy_engine(tmp_path / str(fill), **ALL_DEFERRED) as engine:
            if not fill:
                engine.debug.residency.fill_behind_updates = False  # the behaviour before fills
            per_step = []
            # the updates wait for the next forward to start, at any pace of this machine
            with UpdatesHeldForTheNextForward(u.name for u in engine.units) as held:
                for _ in range(6):
                    before = engine.stats()
                    engine.backward(engine(x))
                    held.hold()
                    engine.step()
                    after = engine.stats()
                    per_step.append({k: after[k] - before[k] for k in (
                        "update_fills", "prefetch_misses", "bytes_nvme_to_device")})
            engine.zero_grad()
            results[fill] = (per_step[3:], engine.state_dict())
    (on, state_on), (off, state_off) = results[True], results[False]
    for with_fills, without in zip(on, off):
        assert with_fills["update_fills"] > 0 and without["update_fills"] == 0
        assert with_fills["prefetch_misses"] == 0 < without["prefetch_misses"]
    assert sum(r["bytes_nvme_to_device"] for r in on) < sum(r["bytes_nvme_to_device"] for r in off)
    for k in state_off:
        assert torch.equal(state_on[k], state_off[k]), k


def test_fetches_behind_deferred_updates_keep_the_prefetch_going_with_compute_copies_on_the_host(tmp_path):
    """[Note: updates fill the device copy] With the compute copies at home on the host, a
    unit whose deferred update is pending gets its slot ahead of use all the same, its copy
    moved on the copy worker once the update is done (no fill there: the update writes the
    host copy). Against the run that leaves such units to on-demand fetches: no prefetch
    misses in the steady state, and the same numbers."""
    x = torch.randn(4, 32)
    results = {}
    for chained in (True, False):
        with slow_sleepy_engine(tmp_path / str(chained), param_tier="host") as engine:
            if not chained:
                engine.debug.residency.fill_behind_updates = False  # the behaviour before
            train_sleepy(engine, x, 3)
            before = engine.stats()
            train_sleepy(engine, x, 3)
            after = engine.stats()
            engine.zero_grad()
            assert after["deferred_updates"] + after["early_updates"] > 0
            results[chained] = (after["prefetch_misses"] - before["prefetch_misses"], after["update_fills"],
                                engine.state_dict())
    (misses, fills, state), (misses_before, _, state_before) = results[True], results[False]
    assert misses == 0 < misses_before and fills == 0
    for k in state_before:
        assert torch.equal(state[k], state_before[k]), k


@pytest.mark.host_device
def test_fills_with_eval_passes_and_a_scheduler_give_the_numbers_of_updates_inside_step(tmp_path):
    """[Note: updates fill the device copy] Eval forwards between steps (their own trace)
    meet units whose deferred updates are queued: they get filled slots too. With an LR
    scheduler stepping right after step(), the run gives the numbers of the same run with
    the updates done inside step() (no deferral, so no fills)."""
    x = torch.randn(4, 32)
    results = {}
    for overlap in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eval passes are a trace kind of their own
            with slow_sleepy_engine(tmp_path / str(overlap), overlap_step_with_forward=overlap) as engine:
                schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda i: 1.0 / (1 + i))
                evals = []
                for _ in range(5):
                    engine.backward(engine(x))
                    engine.step()
                    schedule.step()
                    engine.eval()
                    with torch.no_grad():
                        evals.append(engine(x))
                    engine.train()
                engine.zero_grad()
                results[overlap] = (engine.stats()["update_fills"], evals, engine.state_dict())
    (fills, evals, state), (no_fills, evals_ref, state_ref) = results[True], results[False]
    assert fills > 0 and no_fills == 0
    for a, b in zip(evals, evals_ref):
        assert torch.equal(a, b)
    for k in state_ref:
        assert torch.equal(state[k], state_ref[k]), k


def test_loading_a_checkpoint_while_fills_are_in_flight(tmp_path):
    """[Note: updates fill the device copy] step() returns with updates queued and a slot
    waiting for one of them; a checkpoint loaded right then lands it, replaces every state,
    and the run goes on as one that loaded the checkpoint from a fresh engine. The last
    step's updates are held on the optimizer worker (the first one started, the rest
    queued; the root's goes on) until load_checkpoint has begun, whatever the machine's pace."""
    x = torch.randn(4, 32)
    gate = threading.Event()

    def held(unit, **_):  # the next forward starts by waiting for the root's update
        if unit != engine.units[0].name:
            assert gate.wait(20), "the held update was never let go"

    with slow_sleepy_engine(tmp_path / "a", budget_units=16) as engine:  # room left after backward
        train_sleepy(engine, x, 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        train_sleepy(engine, x, 2)
        loss = engine(x)  # it waits for the step before's updates
        with offload.faults.inject("optim.early_update", held), offload.faults.inject("optim.deferred_update", held):
            engine.backward(loss)
            engine.step()  # it returns with its updates held
            # what the next pass's prefetcher would do: a slot for a unit whose update waits
            waiting = [u for u in engine.units if engine.debug.updates.pending(u) and not u.update.started
                       and u.compute_state == offload.units.Residency.HOME]
            assert waiting and engine.debug.residency.prefetch_updating(waiting[-1])
            assert waiting[-1].compute_state == offload.units.Residency.LOADING
            threading.Timer(0.2, gate.set).start()  # let go once the load waits for them
            engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert gate.is_set()
        assert all(u.compute_state != offload.units.Residency.LOADING for u in engine.units)
        resumed = state_after(engine, x, 2)
    with slow_sleepy_engine(tmp_path / "b", seed=1, budget_units=16) as fresh:
        fresh.load_checkpoint(str(tmp_path / "ckpt"))
        expected = state_after(fresh, x, 2)
    for k in expected:
        assert torch.equal(resumed[k], expected[k]), k


@pytest.mark.host_device
@pytest.mark.filterwarnings("ignore:offload. execution left the recorded unit trace")  # the failed pass
def test_a_failed_update_with_a_fill_in_flight_gives_its_slot_back(tmp_path):
    """[Note: updates fill the device copy] An update still queued when step() returned
    fails while the next forward has device slots waiting for updates: the error comes out of that forward, no
    slot is left in flight or unaccounted for, and loading the last checkpoint makes the
    rest of the run end where an undisturbed one does."""
    x = torch.randn(4, 32)
    with slow_sleepy_engine(tmp_path / "ref", **ALL_DEFERRED) as ref:
        final = state_after(ref, x, 6)
    with slow_sleepy_engine(tmp_path / "swap", **ALL_DEFERRED) as engine:
        train_sleepy(engine, x, 3)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        fills = engine.stats()["update_fills"]
        # step()'s updates wait for the next forward to come near them; the fourth block's fails
        with UpdatesHeldForTheNextForward((u.name for u in engine.units),
                                          fail=("blocks.3", RuntimeError("injected Adam failure"))) as held:
            engine.backward(engine(x))
            held.hold()
            engine.step()
            with pytest.raises(RuntimeError, match="injected Adam failure"):
                engine.backward(engine(x))
        assert engine.stats()["update_fills"] > fills  # slots were waiting for updates
        assert not [u.name for u in engine.units if u.compute_state == offload.units.Residency.LOADING]
        held = sum(u.compute_numel * 4 for u in engine.units if u.device_offset is not None)
        assert engine.debug.device.slot_bytes == held
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        after = state_after(engine, x, 3)
    for k in final:
        assert torch.equal(after[k], final[k]), k


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_stats_grad_norm_pending_says_whether_grad_norm_is_the_last_steps(max_grad_norm, tmp_path):
    """stats()["grad_norm_pending"] is True from a deferred step() until the pass that
    finishes its bookkeeping (grad_norm still the step before's meanwhile); clipping needs
    the norm inside step() (which may still defer the updates), so with max_grad_norm the
    norm is never pending."""
    torch.manual_seed(0)
    model = Sleepy(4, 0.0)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"),
                  device_budget=4096 * 8, prefetch_units=2, max_grad_norm=max_grad_norm)
    x = torch.randn(4, 32)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        assert engine.stats()["grad_norm_pending"] is False
        engine.backward(engine(x))
        engine.step()
        deferred = max_grad_norm is None
        assert engine.stats()["grad_norm_pending"] is deferred
        assert (engine.stats()["grad_norm"] is None) is deferred
        engine.backward(engine(x))
        assert engine.stats()["grad_norm_pending"] is False
        assert engine.stats()["grad_norm"] is not None
