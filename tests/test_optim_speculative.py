"""[Note: speculative updates] Under clipping, fp16 and skip_nonfinite_steps, units are still
updated during backward, into spare homes, and step() commits or redoes them: the result is
the serialized step's (speculative_updates=False) bit for bit, and within the parity bound of
plain clip_grad_norm_ + AdamW. Failures leave the engine consistent or failed, never half
committed."""
import errno
import threading
import time
import warnings

import pytest
import torch

import offload
import offload.faults
from offload.errors import EngineFailedError
from offload.gpt import GPT
from offload.memory.budget import UnitSizes, host_bytes, swap_bytes
from offload.io.swap import Extent
from offload.memory.layout import Layout
from offload.units import Residency

from support import (CFG, CLIP_REL_TOL, REL_TOL, FaultyIO, assert_same_state, batches, gpt_loss, make_opt,
                     max_rel_error, train_gpt, train_offload, train_reference, train_sometimes, unwrap_swap_io,
                     wrap_swap_io)

# With this bound the small GPT's norm (9.6, 9.6, 7.7, 5.9, 5.0, 3.9 over six steps) is
# clipped on the first three steps and not on the last three.
MIXED_NORM = 6.0
# With 2 micro-steps per update: norms 7.99, 8.24, 7.00, so only the second update clips.
ACCUMULATED_MIXED_NORM = 8.1
NEVER_CLIPS = 1e9
NUM_STEPS = 6
NUM_BLOCKS = CFG.num_layers  # the units updated during backward (the root is updated in step())


def speculated_steps(norms, max_norm):
    """[Note: speculative updates] How many steps speculate (the first, and each after one
    that did not clip) and how many of those are redone (they clip), from the norms."""
    clipped = [n + 1e-6 > max_norm for n in norms]  # torch's coefficient max_norm / (norm + 1e-6) < 1
    speculated = [i == 0 or not clipped[i - 1] for i in range(len(norms))]
    return sum(speculated), sum(s and c for s, c in zip(speculated, clipped))


def config(tmp_path, name, tiers=("nvme", "nvme"), **kw):
    return dict(param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path / name),
                device_budget=140 * 1024 * 2, **kw)


def train(tmp_path, name, data, frozen=(), settle_backward=False, **kw):
    """Losses, the state_dict after training, the stats and every step's grad_norm.
    ``settle_backward``: every speculative update runs before step() (support.train_gpt)."""
    return train_gpt(config(tmp_path, name, **kw), data, frozen, settle_backward=settle_backward)


def assert_same_run(a, b):
    assert a[0] == b[0], "losses differ"
    assert_same_state(a[1], b[1])
    assert a[3] == b[3], "grad norms differ"


@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "host"), ("host", "nvme")], ids="-".join)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("clip", ["never", "mixed"])
def test_speculative_updates_equal_the_serialized_step_bit_for_bit(tiers, dtype, clip, tmp_path):
    """Clipping configured but never triggering commits every speculative update; clipping
    on some steps and not others redoes exactly the units of the clipped steps. Either way
    the losses, weights, optimizer states and norms are the serialized run's. (Every
    speculative update runs before step() here; test_step_takes_back_... has step() take
    back those the worker has not started.)"""
    data = batches(NUM_STEPS)
    max_norm = NEVER_CLIPS if clip == "never" else MIXED_NORM
    on = train(tmp_path, "on", data, tiers=tiers, dtype=dtype, max_grad_norm=max_norm, speculative_updates=True,
               settle_backward=True)
    off = train(tmp_path, "off", data, tiers=tiers, dtype=dtype, max_grad_norm=max_norm, speculative_updates=False)
    assert_same_run(on, off)
    clipped_steps = sum(n > max_norm for n in off[3])
    speculated, redone = speculated_steps(off[3], max_norm)
    assert on[2]["speculative_updates"] == speculated * NUM_BLOCKS
    assert on[2]["redone_updates"] == redone * NUM_BLOCKS
    assert on[2]["taken_back_updates"] == 0
    assert off[2]["speculative_updates"] == off[2]["early_updates"] == 0
    if clip == "mixed":
        assert 0 < clipped_steps < NUM_STEPS, off[3]  # the case is what its name says
        assert redone > 0 and speculated < NUM_STEPS  # a step after a clipped one does not speculate
    else:
        assert clipped_steps == 0 and speculated == NUM_STEPS


def train_with_a_slow_worker(tmp_path, name, data, **kw):
    """As train(), but the first speculative update of each backward holds the worker until
    step() has taken the others back (they are still queued behind it): step() is called
    once that update has started. By the counts, not by timing: the update waits for
    ``taken_back_updates`` to grow by the blocks left."""
    started = threading.Semaphore(0)
    wanted = {"taken_back": None}
    holder = {}

    def slow(*args, **context):
        started.release()
        target, deadline = wanted["taken_back"], time.monotonic() + 60
        while holder["engine"].stats()["taken_back_updates"] < target:
            assert time.monotonic() < deadline, "step() never took the queued updates back"
            time.sleep(0.001)

    torch.manual_seed(0)
    model = GPT(CFG)
    losses, norms = [], []
    with offload.faults.inject("optim.early_update", slow), \
            offload.wrap(model, make_opt(model.parameters()), config=config(tmp_path, name, **kw)) as engine:
        holder["engine"] = engine
        for b in data:
            stats = engine.stats()
            queued = stats["speculative_updates"]
            wanted["taken_back"] = stats["taken_back_updates"] + NUM_BLOCKS - 1
            loss = gpt_loss(engine, b)
            engine.backward(loss)
            if engine.stats()["speculative_updates"] > queued:  # this backward speculated
                assert started.acquire(timeout=60)
            engine.step()
            losses.append(loss.item())
            engine.state_dict()  # settles the deferred step: its norm is taken
            norms.append(engine.stats()["grad_norm"])
        return losses, engine.state_dict(), engine.stats(), norms


@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "host")], ids="-".join)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step_takes_back_the_speculative_updates_the_worker_has_not_started(tiers, dtype, tmp_path):
    """[Note: speculative updates] The worker is slow (the first speculative update of a
    backward holds it): at step() the first block's update has started, the other blocks'
    are still queued. step() takes those back, the norm takes their squares itself,
    and they are updated like units never updated (deferred, or in step()); the one that ran
    is committed or redone. Clipping on some steps and not others: bit for bit the
    serialized run, and the counts say which way each update went."""
    data = batches(NUM_STEPS)
    off = train(tmp_path, "off", data, tiers=tiers, dtype=dtype, max_grad_norm=MIXED_NORM, speculative_updates=False)
    on = train_with_a_slow_worker(tmp_path, "on", data, tiers=tiers, dtype=dtype, max_grad_norm=MIXED_NORM,
                                  speculative_updates=True)
    assert_same_run(on, off)
    speculated, redone = speculated_steps(off[3], MIXED_NORM)
    assert 0 < redone < speculated
    assert on[2]["speculative_updates"] == speculated  # one a step: the first the worker took
    assert on[2]["taken_back_updates"] == speculated * (NUM_BLOCKS - 1)
    assert on[2]["redone_updates"] == redone
    assert on[2]["early_updates"] == on[2]["speculative_updates"]


@pytest.mark.host_device
def test_taken_back_updates_are_deferred_and_the_next_forward_reads_less(tmp_path):
    """With the states on NVMe the updates step() takes back join its deferred ones: they run
    under the next forward and write the device copies still resident ([Note: updates
    through the device copy]), where a speculative update committed by step() left them to
    be read again. Bit for bit the serialized run either way."""
    data = batches(4)
    off = train(tmp_path, "off", data, max_grad_norm=NEVER_CLIPS, speculative_updates=False)
    on = train_with_a_slow_worker(tmp_path, "on", data, max_grad_norm=NEVER_CLIPS, speculative_updates=True)
    settled = train(tmp_path, "settled", data, max_grad_norm=NEVER_CLIPS, speculative_updates=True,
                    settle_backward=True)
    assert_same_run(on, off)
    assert_same_run(settled, off)
    assert on[2]["taken_back_updates"] == len(data) * (NUM_BLOCKS - 1)
    # the root each step, and the blocks taken back
    assert on[2]["deferred_updates"] == len(data) * NUM_BLOCKS
    assert settled[2]["deferred_updates"] == len(data) and settled[2]["taken_back_updates"] == 0
    assert on[2]["bytes_read_nvme"] < settled[2]["bytes_read_nvme"]


def test_speculative_updates_are_on_by_default_only_with_the_states_on_nvme(tmp_path):
    """None (auto): on with the optimizer states on NVMe, off with them on the host (the
    spare homes would double their RAM)."""
    data = batches(2)
    nvme = train(tmp_path, "nvme", data, tiers=("host", "nvme"), max_grad_norm=1.0)
    host = train(tmp_path, "host", data, tiers=("host", "host"), max_grad_norm=1.0)
    assert nvme[2]["speculative_updates"] > 0
    assert host[2]["speculative_updates"] == 0 and host[2]["early_updates"] == 0


def test_speculative_updates_match_plain_pytorch_clipping(tmp_path):
    """Within the parity bound of clip_grad_norm_ + AdamW (CLIP_REL_TOL), clipping on some steps."""
    data = batches(NUM_STEPS)
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref_losses = train_reference(ref, data, max_grad_norm=MIXED_NORM)
    losses, state, stats, _ = train(tmp_path, "on", data, dtype="fp32", max_grad_norm=MIXED_NORM,
                                    settle_backward=True)
    assert stats["redone_updates"] > 0 and stats["speculative_updates"] > stats["redone_updates"]
    assert max_rel_error(state, ref.state_dict()) < CLIP_REL_TOL
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= REL_TOL * abs(b)


def test_gradient_accumulation_with_clipping(tmp_path):
    """Speculation only in the backward before an update; accumulated gradients are kept
    for the redo."""
    data = batches(NUM_STEPS)
    on = train(tmp_path, "on", data, max_grad_norm=ACCUMULATED_MIXED_NORM, gradient_accumulation_steps=2,
               settle_backward=True)
    off = train(tmp_path, "off", data, max_grad_norm=ACCUMULATED_MIXED_NORM, gradient_accumulation_steps=2,
                speculative_updates=False)
    assert_same_run(on, off)
    speculated, redone = speculated_steps(off[3], ACCUMULATED_MIXED_NORM)
    assert on[2]["speculative_updates"] == speculated * NUM_BLOCKS
    assert on[2]["redone_updates"] == redone * NUM_BLOCKS
    assert 0 < redone < speculated


def test_fp16_overflow_drops_the_speculative_updates(tmp_path):
    """An fp16 step that overflows is skipped: its speculative updates are dropped, the
    homes keep the last step's state; the other steps commit theirs."""
    data = batches(NUM_STEPS)
    kw = dict(dtype="fp16", initial_loss_scale=2.0**17, tiers=("host", "nvme"))
    on = train(tmp_path, "on", data, settle_backward=True, **kw)
    off = train(tmp_path, "off", data, speculative_updates=False, **kw)
    assert_same_run(on, off)
    assert 0 < on[2]["skipped_steps"] < NUM_STEPS
    assert on[2]["speculative_updates"] == NUM_STEPS * NUM_BLOCKS
    assert on[2]["redone_updates"] == 0  # no clipping: dropped (skipped) or committed
    assert on[2]["loss_scale"] == off[2]["loss_scale"]


def test_skip_nonfinite_steps_drops_speculation_on_a_nan_step(tmp_path):
    """skip_nonfinite_steps: a NaN gradient skips the step; its speculative updates are
    dropped and the weights are those of the serialized run."""
    data = batches(4)
    nan_batch = 2

    def run(name, speculative):
        torch.manual_seed(0)
        model = GPT(CFG)
        with offload.wrap(model, make_opt(model.parameters()),
                          config=config(tmp_path, name, skip_nonfinite_steps=True,
                                        speculative_updates=speculative)) as engine:
            for i, b in enumerate(data):
                loss = gpt_loss(engine, b)
                engine.backward(loss * float("nan") if i == nan_batch else loss)
                engine.debug.updates.wait_optimizer()  # every speculative update runs (none taken back)
                engine.step()
            return engine.state_dict(), engine.stats()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the NaN step's warning
        on, off = run("on", True), run("off", False)
    assert_same_state(on[0], off[0])
    assert on[1]["skipped_steps"] == off[1]["skipped_steps"] == 1
    assert on[1]["speculative_updates"] == len(data) * NUM_BLOCKS


def test_frozen_parameters_and_a_checkpoint_load_survive_commits(tmp_path):
    """A unit's frozen tail is not written by updates: the spare compute copy holds it too,
    after wrap and after a checkpoint load, so a committed spare keeps the frozen values."""
    data = batches(NUM_STEPS)
    frozen = ("blocks.0.ln1.", "blocks.1.fc.")
    on = train(tmp_path, "on", data, frozen=frozen, max_grad_norm=NEVER_CLIPS, settle_backward=True)
    off = train(tmp_path, "off", data, frozen=frozen, max_grad_norm=NEVER_CLIPS, speculative_updates=False)
    assert_same_run(on, off)
    assert on[2]["speculative_updates"] > 0

    # Save after 3 steps, load into an engine whose frozen values differ, train on.
    def engine_for(name, seed):
        torch.manual_seed(seed)
        model = GPT(CFG)
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith(frozen))
        return offload.wrap(model, make_opt([p for p in model.parameters() if p.requires_grad]),
                            config=config(tmp_path, name, max_grad_norm=NEVER_CLIPS))

    with engine_for("first", 0) as first:
        train_offload(first, data[:3])
        first.save_checkpoint(str(tmp_path / "ckpt"))
        train_offload(first, data[3:])
        expected = first.state_dict()
    with engine_for("second", 1) as second:  # other initial (frozen) values
        second.load_checkpoint(str(tmp_path / "ckpt"))
        train_offload(second, data[3:], settle_backward=True)
        assert second.stats()["speculative_updates"] > 0
        assert_same_state(second.state_dict(), expected)


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "host"), ("host", "nvme")], ids="-".join)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_units_with_a_parameter_without_a_gradient_are_updated_in_step(tiers, dtype, tmp_path):
    """A unit whose parameter gets no gradient that step (the second linear of each block,
    two steps in three) is never final during backward: it is updated in step(), in place,
    and the run is the serialized one bit for bit, with speculative updates on the other
    steps (out of place, [Note: out-of-place Adam]). Host-homed states, the compute copy at
    home or on NVMe."""
    kw = dict(dtype=dtype, max_grad_norm=NEVER_CLIPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unit trace of a step without the branch
        on = train_sometimes(config(tmp_path, "on", tiers, speculative_updates=True, **kw), settle_backward=True)
        off = train_sometimes(config(tmp_path, "off", tiers, speculative_updates=False, **kw))
    assert on[0] == off[0], "losses differ"
    assert_same_state(on[1], off[1])
    # the three blocks speculate on the two steps that use their second linears only
    assert on[2]["speculative_updates"] == 6 and on[2]["redone_updates"] == 0


def test_state_dict_between_backward_and_step_is_the_last_step(tmp_path):
    """Speculative updates write spare homes only: between backward and step() the weights
    are still those of the last step (without speculation, early updates refuse this)."""
    data = batches(3)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "s", max_grad_norm=NEVER_CLIPS)) as engine:
        train_offload(engine, data[:2], settle_backward=True)
        before = engine.state_dict()
        engine.backward(gpt_loss(engine, data[2]))
        assert engine.stats()["speculative_updates"] == 3 * NUM_BLOCKS  # queued; none taken back yet
        assert_same_state(engine.state_dict(), before)
        engine.step()
        after = engine.state_dict()
        assert not torch.equal(after["blocks.0.fc.weight"], before["blocks.0.fc.weight"])


def written_speculatively(engine):
    """Units whose device copy holds an uncommitted speculative update ([Note: speculative
    updates]: written once the pass needed no other unit, as early updates write it)."""
    return [u for u in engine.units if u.update.speculative and u.update.in_device]


def speculated_engine(tmp_path, name, dtype="fp32"):
    torch.manual_seed(0)
    model = GPT(CFG)
    return offload.wrap(model, make_opt(model.parameters()),
                        config=config(tmp_path, name, dtype=dtype, max_grad_norm=NEVER_CLIPS))


@pytest.mark.host_device
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_committed_speculative_update_keeps_the_device_copy_it_wrote(dtype, tmp_path):
    """A speculative update writes a resident device copy, as an early update does; when
    step() commits it the copy stays, holding the new compute copy, and the next forward
    needs no read for that unit (before, every speculated unit was read back from NVMe)."""
    data = batches(3)
    with speculated_engine(tmp_path, "s", dtype) as engine:
        train_offload(engine, data[:2])
        engine.backward(gpt_loss(engine, data[2]))
        engine.debug.updates.wait_optimizer()
        written = written_speculatively(engine)
        assert written, "no speculative update wrote a device copy"
        engine.step()
        engine.state_dict()  # the deferred step settled: the homes are final
        homes, device = engine.debug.homes, engine.debug.device
        for u in written:
            assert u.compute_state == Residency.LOADED, u.name
            copy = device.view(u.device_offset, u.compute_numel)
            assert torch.equal(copy, homes.load(u.compute_home, u.compute_numel, copy.dtype)), u.name


@pytest.mark.host_device
def test_a_forward_between_backward_and_step_uses_the_last_steps_weights(tmp_path):
    """A forward before step() (an evaluation, say) computes with the last step's weights,
    as plain PyTorch does: the device copies that speculative updates wrote are dropped
    first. step() still commits those updates, and the run is the uninterrupted one."""
    data = batches(4)
    reference = train(tmp_path, "ref", data, max_grad_norm=NEVER_CLIPS)
    with speculated_engine(tmp_path, "s") as engine:
        train_offload(engine, data[:2])
        probe = data[3][:, :-1]
        with torch.no_grad():
            expected = engine(probe)
        loss = gpt_loss(engine, data[2])
        engine.backward(loss)
        engine.debug.updates.wait_optimizer()
        assert written_speculatively(engine)
        with torch.no_grad():
            assert torch.equal(engine(probe), expected)
        assert not written_speculatively(engine)
        engine.step()
        losses = [loss.item()] + train_offload(engine, data[3:])
        assert losses == reference[0][2:]
        assert_same_state(engine.state_dict(), reference[1])


@pytest.mark.host_device
def test_zero_grad_between_backward_and_step_drops_the_speculation(tmp_path):
    """zero_grad() after a backward whose units were speculated, device copies included:
    nothing of that backward remains, and the run equals one without that batch."""
    data = batches(4)
    reference = train(tmp_path, "ref", [data[0], data[1], data[3]], max_grad_norm=NEVER_CLIPS)
    with speculated_engine(tmp_path, "s") as engine:
        train_offload(engine, data[:2])
        engine.backward(gpt_loss(engine, data[2]))
        engine.debug.updates.wait_optimizer()
        written = written_speculatively(engine)
        assert written
        engine.zero_grad()
        assert all(u.compute_state == Residency.HOME for u in written)  # released, not kept
        assert train_offload(engine, data[3:]) == reference[0][2:]
        assert_same_state(engine.state_dict(), reference[1])


def test_a_failed_spare_write_redoes_that_unit(tmp_path):
    """A swap write of a speculative update fails: the unit's homes were not touched, so
    step() redoes it from them and the run equals the serialized one."""
    data = batches(3)
    off = train(tmp_path, "off", data, max_grad_norm=NEVER_CLIPS, speculative_updates=False)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "on", max_grad_norm=NEVER_CLIPS)) as engine:
        train_offload(engine, data[:1])
        engine.state_dict()  # the deferred updates of that step are written
        faulty = wrap_swap_io(engine, FaultyIO, errno.EIO, fail_write=1)  # the first write of backward
        loss = gpt_loss(engine, data[1])
        engine.backward(loss)
        engine.debug.updates.wait_optimizer()  # backward may return before the worker's first write
        assert faulty.writes >= 1
        unwrap_swap_io(engine)
        engine.step()
        train_offload(engine, data[2:])
        stats = engine.stats()
        assert stats["redone_updates"] == 1
        assert_same_state(engine.state_dict(), off[1])


@pytest.mark.parametrize("point", ["optim.early_update", "optim.adam_range", "optim.adam"])
@pytest.mark.parametrize("clip", ["never", "mixed"])
def test_a_failed_speculative_update_is_redone_by_the_step(point, clip, tmp_path):
    """[Note: speculative updates] An update that raises while it speculates (at its start,
    before a range or inside Adam) wrote the unit's spare homes and device copy only: the
    step drops them and updates that unit from its homes and kept gradients, with a warning
    naming it, and the run equals the serialized one to the bit. Before, the engine failed
    until a checkpoint was loaded."""
    data = batches(4)
    max_norm = NEVER_CLIPS if clip == "never" else MIXED_NORM
    off = train(tmp_path, "off", data, max_grad_norm=max_norm, speculative_updates=False)
    torch.manual_seed(0)
    model = GPT(CFG)
    losses = []
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "on", max_grad_norm=max_norm)) as engine:
        loss = gpt_loss(engine, data[0])  # the first step speculates (and with MIXED_NORM clips)
        with offload.faults.inject(point, offload.faults.raising(RuntimeError("boom")), at=1) as armed:
            engine.backward(loss)
            with pytest.warns(RuntimeWarning, match="a speculative update of unit .* failed"):
                engine.debug.updates.wait_optimizer()  # the failed update is judged here
        assert armed.fired == 1
        engine.step()
        losses.append(loss.item())
        losses += train_offload(engine, data[1:])
        stats = engine.stats()
        state = engine.state_dict()
    assert stats["redone_updates"] >= 1
    assert losses == off[0]
    assert_same_state(state, off[1])


def test_a_failed_speculative_update_warns_at_the_users_line(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    data = batches(2)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "on", max_grad_norm=NEVER_CLIPS)) as engine:
        train_offload(engine, data[:1])
        engine.state_dict()  # the deferred updates of that step are done
        loss = gpt_loss(engine, data[1])
        with offload.faults.inject("optim.adam", offload.faults.raising(RuntimeError("boom")), at=1):
            engine.backward(loss)
            # waited for here: step() would take back an update the worker has not started yet
            with pytest.warns(RuntimeWarning, match="a speculative update of unit 'blocks.3' failed .RuntimeError: "
                              "boom.; its second copy of the states is dropped") as caught:
                engine.debug.updates.wait_optimizer()
        assert [w.filename for w in caught if "speculative update" in str(w.message)] == [__file__]
        engine.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "deferred"])
def test_a_failure_in_a_redo_fails_the_engine_until_a_checkpoint_is_loaded(overlap, tmp_path):
    """The redo is the optimizer step: a failure there is fatal ([Note: failures inside a
    step]), raised by step() itself, or with overlap_step_with_forward (the redo deferred to
    the worker) by the next forward that needs the unit; loading a checkpoint brings the
    engine back to a state it saved."""
    data = batches(3)
    torch.manual_seed(0)
    model = GPT(CFG)
    cfg = config(tmp_path, "s", max_grad_norm=1e-3, overlap_step_with_forward=overlap)  # always clips
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        train_offload(engine, data[:1])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.state_dict()
        engine.backward(gpt_loss(engine, data[1]))
        engine.debug.updates.wait_optimizer()  # the speculative updates are over: the next Adam range is a redo
        with offload.faults.inject("optim.adam_range", offload.faults.raising(RuntimeError("boom")), at=1) as armed:
            with pytest.raises(RuntimeError, match="boom") as raised:
                engine.step()
                assert overlap, "step() redoes the units itself without overlap_step_with_forward"
                engine(data[2][:, :-1])  # waits for the deferred redo of the units it needs
            assert armed.fired == 1
        if overlap:  # the message says where the update ran: after step(), not during backward
            assert "in the last optimizer step, whose updates ran on after step() returned" in \
                " ".join(raised.value.__notes__)
        with pytest.raises(EngineFailedError):
            engine(data[2][:, :-1])
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        assert_same_state(engine.state_dict(), saved)
        train_offload(engine, data[2:])
        assert engine.stats()["redone_updates"] > 0


def test_a_backward_failing_after_speculative_updates_only_is_consistent(tmp_path):
    """Speculative updates leave the homes alone, so a backward that fails after some of
    them drops its gradients and the engine carries on (early updates would fail it)."""
    data = batches(3)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "s", max_grad_norm=NEVER_CLIPS)) as engine:
        train_offload(engine, data[:1])
        before = engine.state_dict()
        speculated = engine.stats()["speculative_updates"]
        loss = gpt_loss(engine, data[1])
        # the root's gradient hand-off comes after every block's: the blocks were speculated
        with offload.faults.inject("optim.grad_ready", offload.faults.raising(RuntimeError("late")),
                                   at=len(list(model.parameters()))):
            with pytest.raises(RuntimeError, match="late"):
                engine.backward(loss)
        assert engine.stats()["speculative_updates"] > speculated
        assert_same_state(engine.state_dict(), before)
        losses = train_offload(engine, data[1:])  # carries on, with the weights of before
        after = engine.state_dict()
    reference = train(tmp_path, "ref", data, max_grad_norm=NEVER_CLIPS)
    assert losses == reference[0][1:]
    assert_same_state(after, reference[1])


def home_bytes_on_nvme(u):
    return sum(h.nbytes for h in (u.compute_home, u.master_home, u.moments_home) if isinstance(h, Extent))


def test_the_spare_homes_double_what_updates_write_on_their_tier(tmp_path):
    """The disk cost, as planned and as allocated: every state an early update writes,
    twice; the root, updated in step() only, has no spare homes."""
    sizes = {}
    for speculative in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG)
        cfg = config(tmp_path, str(speculative), dtype="bf16", max_grad_norm=1.0, speculative_updates=speculative)
        with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
            sizes[speculative] = engine.stats()["nvme_bytes"]
            units = [UnitSizes.of(u) for u in engine.units]
            assert swap_bytes(units, engine.layout) == sizes[speculative]
            assert engine.units[0].spare is None
            assert all(u.spare is not None for u in engine.units[1:] if u.trainable) == speculative
            blocks = sum(home_bytes_on_nvme(u) for u in engine.units[1:] if u.trainable)
    assert sizes[True] == sizes[False] + blocks


def test_spare_homes_go_to_the_units_backward_finishes_first_when_the_disk_is_short(tmp_path, monkeypatch):
    """[Note: speculative updates] speculative_updates=None with a swap directory that holds
    the run but not every spare: the last blocks (done first in backward) speculate, the
    others are updated after the norm, with a warning; bit for bit the serialized run."""
    data = batches(NUM_STEPS)
    off = train(tmp_path, "off", data, max_grad_norm=MIXED_NORM, speculative_updates=False)
    full = train(tmp_path, "full", data, max_grad_norm=MIXED_NORM, settle_backward=True)
    torch.manual_seed(0)
    probe = GPT(CFG)
    with offload.wrap(probe, make_opt(probe.parameters()), config=config(tmp_path, "probe", max_grad_norm=1.0,
                                                                         speculative_updates=False)) as engine:
        unspeculated = engine.stats()["nvme_bytes"]
        last_two = sum(home_bytes_on_nvme(u) for u in engine.units[-2:])
    room = unspeculated + last_two + 4096  # the spares of the last two blocks, not of a third
    free = int(room / offload.memory.placement.SPARE_FREE_FRACTION) + 1  # of which spares take that share
    monkeypatch.setattr(offload.memory.placement, "usable_bytes", lambda swap_dir: free)
    with pytest.warns(RuntimeWarning, match=r"spare homes of 2 of 4 units"):
        short = train(tmp_path, "short", data, max_grad_norm=MIXED_NORM, settle_backward=True)
    assert_same_run(short, off)
    assert_same_run(full, off)
    speculated, redone = speculated_steps(off[3], MIXED_NORM)
    assert full[2]["speculative_updates"] == speculated * NUM_BLOCKS
    assert short[2]["speculative_updates"] == speculated * 2
    assert short[2]["redone_updates"] == redone * 2
    assert short[2]["nvme_bytes"] == unspeculated + last_two
    torch.manual_seed(0)
    model = GPT(CFG)
    with pytest.warns(RuntimeWarning, match="spare homes") as caught:
        with offload.wrap(model, make_opt(model.parameters()),
                          config=config(tmp_path, "which", max_grad_norm=1.0)) as engine:
            assert [u.spare is not None for u in engine.units] == [False] * 3 + [True] * 2
    # the warning points at the wrap() call above, not into the engine
    assert [w.filename for w in caught if "spare homes" in str(w.message)] == [__file__]


def test_host_spares_count_against_host_budget(tmp_path):
    """speculative_updates=True with host-homed states plans (and checks) twice the bytes of
    every unit's states but the root's."""
    torch.manual_seed(0)
    model = GPT(CFG)
    cfg = offload.OffloadConfig(param_tier="host", optimizer_tier="host", max_grad_norm=1.0, speculative_updates=True)
    on = Layout.resolve(cfg, torch.device("cpu"), None)
    off = Layout.resolve(offload.OffloadConfig(param_tier="host", optimizer_tier="host", max_grad_norm=1.0),
                         torch.device("cpu"), None)
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        units = [UnitSizes.of(u) for u in engine.units]
    assert on.speculative and not off.speculative
    a, b = host_bytes(units, on), host_bytes(units, off)
    root = units[0]  # updated in step() only: no spare homes
    assert a.moments == 2 * b.moments - 2 * root.state_numel * 4
    assert a.compute_copies == 2 * b.compute_copies - root.home_numel * 4  # fp32: the merged master


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_speculative_updates_must_be_a_bool_or_none(value):
    with pytest.raises(ValueError, match="speculative_updates"):
        offload.OffloadConfig(speculative_updates=value)
