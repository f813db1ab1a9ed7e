"""[Note: delayed updates] delayed_update=True: after the warm-up, step k's update runs on the
optimizer worker while step k+1's forward and backward use the weights from before it
(w_{k-1}); skipped and clipped steps fall back to exact ones. Checked against the exact run
(warm-up, bit for bit), against a plain-PyTorch reference of the rule (fp32, REL_TOL), inside
the forward (the values a parameter holds there), and across a checkpoint."""
import errno
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import offload
import offload.checkpoint.access
import offload.faults
from offload.errors import EngineFailedError
from offload.gpt import GPT
from offload.memory.budget import UnitSizes, host_bytes, minimum_host_budget, swap_bytes, unit_home_bytes
from offload.memory.layout import Layout

from support import (CFG, CLIP_REL_TOL, REL_TOL, FaultyIO, assert_same_state, batches, gpt_loss, make_opt,
                     max_rel_error, reference_optimizer_step, sigint_once_main_waits_in, train_offload,
                     train_holding_the_first_delayed_update, train_sometimes, unwrap_swap_io, wrap_swap_io)

WATCHED = "blocks.1.fc.weight"  # a parameter of a block unit, read inside the forward


def config(tmp_path, name, tiers=("host", "host"), **kw):
    return dict(param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path / name),
                device_budget=140 * 1024 * 2, **kw)


def run(config, data, scale=None, read_each_step=False, frozen=()):
    """The small GPT (seed 0) trained on ``data`` with ``config``. ``scale(k)``: a factor on
    the loss of step k (1-based), to make a step overflow. Returns the losses, the value of
    WATCHED inside each step's forward, the state_dict after training, the stats and (with
    ``read_each_step``) the state_dict after every step. Nothing waits for the delayed
    updates between steps unless ``read_each_step``. Parameters whose names start with one
    of ``frozen`` are frozen."""
    torch.manual_seed(0)
    model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and name.startswith(frozen)))
    seen = []
    block = model.blocks[1]
    block.register_forward_hook(lambda module, args, output: seen.append(block.fc.weight.detach().float().clone()))
    losses, states = [], []
    trainable = [p for p in model.parameters() if p.requires_grad]
    with offload.wrap(model, make_opt(trainable), config=config) as engine:
        for k, b in enumerate(data, start=1):
            loss = gpt_loss(engine, b)
            engine.backward(loss if scale is None else loss * scale(k))
            engine.step()
            losses.append(loss.item())
            if read_each_step:
                states.append(engine.state_dict())
        return SimpleNamespace(losses=losses, seen=seen, state=engine.state_dict(), stats=engine.stats(),
                               states=states)


def reference(data, warmup, max_grad_norm=None, skipped=(), accumulation=1, frozen=()):
    """Plain PyTorch and torch.optim.AdamW with the delayed rule applied by hand: ``master``
    holds w_k (the optimizer steps it), ``lagging`` the weights the forward and backward use.
    Step k's update is delayed when k > warmup and it is neither skipped (k in ``skipped``:
    no update, like a non-finite step) nor clipped (torch's clip coefficient < 1); after a
    delayed step the forward keeps the weights from before it, after an exact one it takes
    the new ones. ``accumulation`` micro-batches make one step (k counts steps); parameters
    whose names start with one of ``frozen`` are frozen. Returns the losses, WATCHED in each
    forward and the final master weights."""
    torch.manual_seed(0)
    master = GPT(CFG)
    torch.manual_seed(0)
    lagging = GPT(CFG)
    for model in (master, lagging):
        for name, p in model.named_parameters():
            p.requires_grad_(not (frozen and name.startswith(frozen)))
    opt = make_opt([p for p in master.parameters() if p.requires_grad])
    losses, seen = [], []
    for i, b in enumerate(data):
        seen.append(lagging.get_parameter(WATCHED).detach().clone())
        loss = gpt_loss(lagging, b)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation:
            continue
        k = (i + 1) // accumulation
        trainable = [q for q in lagging.parameters() if q.requires_grad]
        clipped = False
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            clipped = max_grad_norm / (norm.item() + 1e-6) < 1.0
        before = {n: p.detach().clone() for n, p in master.named_parameters()}
        if k not in skipped:
            for p, q in zip(master.parameters(), lagging.parameters()):
                p.grad = q.grad if q.requires_grad else None
            reference_optimizer_step(opt)
            opt.zero_grad()
        lagging.zero_grad()
        delayed = k > warmup and k not in skipped and not clipped
        with torch.no_grad():
            for n, q in lagging.named_parameters():
                q.copy_(before[n] if delayed else master.get_parameter(n))
    return SimpleNamespace(losses=losses, seen=seen, state={n: p.detach().clone() for n, p in master.named_parameters()})


def assert_close_losses(losses, ref_losses):
    assert len(losses) == len(ref_losses)
    for k, (a, b) in enumerate(zip(losses, ref_losses), start=1):
        if math.isnan(b):
            assert math.isnan(a), k
        else:
            assert abs(a - b) <= REL_TOL * abs(b), (k, a, b)


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")], ids="-".join)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_warmup_steps_equal_the_exact_run_bit_for_bit(tiers, dtype, tmp_path):
    """With W warm-up steps the first W+1 steps use exact weights and step W+1's update is
    Adam(w_W, g_{W+1}) either way: after W+1 steps the losses and weights are the exact run's
    to the bit; only step W+2's forward sees the delay."""
    warmup = 2
    data = batches(warmup + 2)
    exact = run(config(tmp_path, "exact", tiers, dtype=dtype), data[:warmup + 1])
    delayed = run(config(tmp_path, "delayed", tiers, dtype=dtype, delayed_update=True,
                         delayed_update_warmup_steps=warmup), data[:warmup + 1])
    assert delayed.losses == exact.losses
    assert_same_state(delayed.state, exact.state)
    assert delayed.stats["delayed_updates"] == 1 and delayed.stats["delayed_fallbacks"] == 0
    longer = run(config(tmp_path, "longer", tiers, dtype=dtype, delayed_update=True,
                        delayed_update_warmup_steps=warmup), data)
    exact_longer = run(config(tmp_path, "exact_longer", tiers, dtype=dtype), data)
    assert longer.losses[:warmup + 1] == exact.losses
    assert longer.losses[warmup + 1] != exact_longer.losses[warmup + 1]  # the delay is real
    assert exact_longer.stats["delayed_updates"] == 0


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme"), ("host", "nvme")], ids="-".join)
def test_a_delayed_run_follows_a_plain_pytorch_reference_of_the_rule(tiers, tmp_path):
    """fp32 after one warm-up step: the losses, the weights inside every forward and the final
    weights agree with the reference within REL_TOL, with nothing waiting for the updates
    between steps (they overlap the next forward)."""
    data = batches(6)
    ours = run(config(tmp_path, "ours", tiers, delayed_update=True, delayed_update_warmup_steps=1), data)
    ref = reference(data, warmup=1)
    assert_close_losses(ours.losses, ref.losses)
    assert len(ours.seen) == len(ref.seen)
    for k, (a, b) in enumerate(zip(ours.seen, ref.seen), start=1):
        assert max_rel_error({"w": a}, {"w": b}) < REL_TOL, k
    assert max_rel_error(ours.state, ref.state) < REL_TOL
    assert ours.stats["delayed_updates"] == 5 and ours.stats["delayed_fallbacks"] == 0


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")], ids="-".join)
def test_accumulation_and_frozen_parameters_follow_the_reference(tiers, tmp_path):
    """Two micro-batches a step (steps counted as optimizer steps, the warm-up too), the
    token embedding and the first block frozen (a unit with no update, the root partly frozen)."""
    data = batches(10)
    frozen = ("wte.", "blocks.0.")
    ours = run(config(tmp_path, "ours", tiers, delayed_update=True, delayed_update_warmup_steps=1,
                      gradient_accumulation_steps=2), data, frozen=frozen)
    ref = reference(data, warmup=1, accumulation=2, frozen=frozen)
    assert_close_losses(ours.losses, ref.losses)
    for k, (a, b) in enumerate(zip(ours.seen, ref.seen), start=1):
        assert max_rel_error({"w": a}, {"w": b}) < REL_TOL, k
    assert max_rel_error(ours.state, ref.state) < REL_TOL
    assert ours.stats["delayed_updates"] == 4


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "host")], ids="-".join)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parameters_without_a_gradient_keep_their_state_through_a_delayed_update(tiers, dtype, tmp_path):
    """[Note: out-of-place Adam] A delayed update of host-homed states reads the homes and
    writes the spares: a parameter without a gradient that step (the second linear of each
    block, two steps in three) must come through the commit unchanged, its fp32 master,
    moments and 16-bit compute copy. The run equals the one with every state on NVMe (updated in the
    staging slots) bit for bit, as placement never changes numerics (without the split
    master, whose bf16 compute copy rounds ties away from zero)."""
    kw = dict(dtype=dtype, delayed_update=True, delayed_update_warmup_steps=1, split_master=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unit trace of a step without the branch
        ours = train_sometimes(config(tmp_path, "ours", tiers, **kw))
        ref = train_sometimes(config(tmp_path, "ref", ("nvme", "nvme"), **kw))
    assert ours[0] == ref[0], "losses differ"
    assert_same_state(ours[1], ref[1])
    assert ours[2]["delayed_updates"] == ref[2]["delayed_updates"] == 5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step_t_plus_1_uses_the_weights_from_before_step_t(dtype, tmp_path):
    """Bit for bit inside the engine: in step t+1's forward a parameter holds the weights
    after step t-1 (state_dict then) once step t is delayed, those after step t before."""
    warmup = 2
    data = batches(6)
    ours = run(config(tmp_path, "ours", ("nvme", "nvme"), dtype=dtype, delayed_update=True,
                      delayed_update_warmup_steps=warmup), data, read_each_step=True)
    compute = torch.float32 if dtype == "fp32" else torch.bfloat16
    for t in range(1, len(data)):  # step t+1's forward, 1-based t
        used = ours.seen[t]
        before_t = ours.states[t - 2][WATCHED] if t >= 2 else None
        after_t = ours.states[t - 1][WATCHED]
        expected = before_t if t > warmup else after_t
        assert torch.equal(used, expected.to(compute).float()), t
        if t > warmup:
            assert not torch.equal(used, after_t.to(compute).float()), t  # the two differ


def test_an_fp16_overflow_falls_back_to_an_exact_step(tmp_path):
    """Step 4's gradients overflow: it is skipped, the pending update of step 3 is committed,
    and step 5's forward uses w_4 (= w_3, nothing applied), while step 6's uses w_4 again
    because step 5 is delayed."""
    data = batches(7)
    overflow = 4
    ours = run(config(tmp_path, "ours", ("nvme", "nvme"), dtype="fp16", delayed_update=True,
                      delayed_update_warmup_steps=1, initial_loss_scale=2.0**8),  # no overflow but step 4's
               data, scale=lambda k: 1e30 if k == overflow else 1.0, read_each_step=True)
    assert ours.stats["skipped_steps"] == 1 and ours.stats["delayed_fallbacks"] == 1
    assert ours.stats["delayed_updates"] == len(data) - 1 - 1
    state = [s[WATCHED] for s in ours.states]  # state[k - 1] = w_k
    assert torch.equal(state[overflow - 1], state[overflow - 2])  # skipped: w_4 == w_3
    for k in range(2, len(data) + 1):  # step k's forward
        prev_delayed = k - 1 > 1 and k - 1 != overflow
        expected = state[k - 3] if prev_delayed else state[k - 2]
        assert torch.equal(ours.seen[k - 1], expected.to(torch.float16).float()), k


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")], ids="-".join)
def test_skipped_and_clipped_steps_fall_back_as_the_reference_does(tiers, tmp_path):
    """fp32 with skip_nonfinite_steps and a clipping bound some steps exceed: a NaN step and
    the clipped steps are exact, the others delayed; the reference follows the same rule."""
    data = batches(8)
    nan_step = 5
    max_norm = 6.0  # clips the first steps of this run, not the later ones
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the NaN step's warning
        ours = run(config(tmp_path, "ours", tiers, delayed_update=True, delayed_update_warmup_steps=1,
                          skip_nonfinite_steps=True, max_grad_norm=max_norm),
                   data, scale=lambda k: float("nan") if k == nan_step else 1.0)
    ref = reference(data, warmup=1, max_grad_norm=max_norm, skipped={nan_step})
    assert_close_losses(ours.losses, ref.losses)
    for k, (a, b) in enumerate(zip(ours.seen, ref.seen), start=1):
        assert max_rel_error({"w": a}, {"w": b}) < CLIP_REL_TOL, k
    assert max_rel_error(ours.state, ref.state) < CLIP_REL_TOL
    assert ours.stats["skipped_steps"] == 1
    fallbacks = ours.stats["delayed_fallbacks"]
    assert fallbacks >= 2 and ours.stats["delayed_updates"] >= 2  # both kinds happen
    assert fallbacks + ours.stats["delayed_updates"] == len(data) - 1


@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")], ids="-".join)
def test_a_checkpoint_in_a_delayed_run_resumes_bit_for_bit(tiers, chunk, tmp_path, monkeypatch):
    """Saved while step 3's update is pending (bf16, so that the lagging compute copy is not
    the rounded master), loaded into a fresh engine: steps 4-6 are the uninterrupted run's to
    the bit, the losses and the weights. ``chunk``: saved and loaded in pieces of 1000
    elements, the lagging copy too ([Note: bounded checkpoint memory])."""
    if chunk is not None:
        monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", chunk)
    data = batches(6)
    cut = 3

    def cfg(name):
        return config(tmp_path, name, tiers, dtype="bf16", delayed_update=True, delayed_update_warmup_steps=1)

    whole = run(cfg("whole"), data)
    torch.manual_seed(0)
    model = GPT(CFG)
    ckpt = tmp_path / "ckpt"
    with offload.wrap(model, make_opt(model.parameters()), config=cfg("saver")) as engine:
        losses = train_offload(engine, data[:cut])
        engine.save_checkpoint(str(ckpt))
    assert losses == whole.losses[:cut]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert any(u.get("delayed_pending") for u in manifest["units"])
    if chunk is not None:
        assert any(len(e["pieces"]) > 1 and "lagging" in e["pieces"][1] for u in manifest["units"] for e in u["entries"])
    torch.manual_seed(1)  # other initial weights: the load replaces them
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=cfg("resumed")) as engine:
        engine.load_checkpoint(str(ckpt))
        losses = train_offload(engine, data[cut:])
        state = engine.state_dict()
    assert losses == whole.losses[cut:]
    assert_same_state(state, whole.state)


def test_checkpoints_across_delayed_and_exact_engines(tmp_path):
    """A checkpoint with nothing pending (an exact run's) loads into a delayed engine; one
    with an update pending loads into an exact engine with a warning, from the updated weights."""
    data = batches(3)
    exact_cfg = config(tmp_path, "exact", ("nvme", "nvme"))
    delayed_cfg = config(tmp_path, "delayed", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0)
    for source, target, pending in ((exact_cfg, delayed_cfg, False), (delayed_cfg, exact_cfg, True)):
        torch.manual_seed(0)
        model = GPT(CFG)
        ckpt = tmp_path / f"ckpt-{pending}"
        with offload.wrap(model, make_opt(model.parameters()), config=source) as engine:
            for b in data:
                engine.backward(gpt_loss(engine, b))
                engine.step()
            engine.save_checkpoint(str(ckpt))
            saved = engine.state_dict()
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert any(u.get("delayed_pending", False) for u in manifest["units"]) == pending
        torch.manual_seed(0)
        model = GPT(CFG)
        with offload.wrap(model, make_opt(model.parameters()), config=target) as engine:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.load_checkpoint(str(ckpt))
            assert [w.filename for w in caught if "delayed updates pending" in str(w.message)] == \
                ([__file__] if pending else [])  # at the user's load_checkpoint() line
            assert_same_state(engine.state_dict(), saved)
            engine.backward(gpt_loss(engine, data[0]))
            engine.step()


@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme")], ids="-".join)
def test_the_next_forward_runs_while_the_delayed_update_runs(tiers, tmp_path):
    """The first delayed update of step 1 is held on the worker until step 2's forward has
    run a block: the forward does not wait for it (a forward that waited would never get
    there, and the update gives up after 10 s). The run is the unheld one's to the bit."""
    data = batches(3)
    cfg = config(tmp_path, "held", tiers, delayed_update=True, delayed_update_warmup_steps=0)
    free = run(config(tmp_path, "free", tiers, delayed_update=True, delayed_update_warmup_steps=0), data)
    losses, state, stats, held = train_holding_the_first_delayed_update(cfg, data, timeout=10)
    assert held == [True], "the forward waited for the delayed update"
    assert losses == free.losses
    assert_same_state(state, free.state)
    assert stats["delayed_updates"] == len(data)


def test_the_config_refuses_what_delayed_updates_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="delayed_update: expected True or False"):
        offload.OffloadConfig(delayed_update="yes")
    with pytest.raises(ValueError, match="delayed_update_warmup_steps: expected an int >= 0"):
        offload.OffloadConfig(delayed_update=True, delayed_update_warmup_steps=-1)
    with pytest.raises(ValueError, match="delayed_update_warmup_steps"):
        offload.OffloadConfig(delayed_update=True, delayed_update_warmup_steps=2.5)
    with pytest.raises(ValueError, match="delayed_update: needs the compute copies at home"):
        offload.OffloadConfig(delayed_update=True, param_tier="device")
    with pytest.raises(ValueError, match="delayed_update: .*speculative_updates"):
        offload.OffloadConfig(delayed_update=True, speculative_updates=True, optimizer_tier="host")
    with pytest.warns(UserWarning, match=r"delayed_update_warmup_steps \(delayed_update=False\)"):
        offload.OffloadConfig(delayed_update_warmup_steps=3)
    cfg = offload.OffloadConfig(delayed_update=True, param_tier="host", optimizer_tier="host")
    layout = Layout.resolve(cfg, torch.device("cpu"), None)
    assert layout.delayed_update and not layout.early_allowed and not layout.speculative and layout.spare_homes


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_spare_homes_are_a_second_compute_copy_in_the_budgets(dtype, tmp_path):
    """The spare homes are a second compute copy only: master and moments are shared with
    the homes (the update writes them in place), and the copy is counted where it lives, so
    that wrap's checks and offload plan stay true: on NVMe the swap bytes grow by the
    compute copies, on the host the compute copies double and the states do not."""
    sizes, compute = {}, {}
    for delayed in (False, True):
        torch.manual_seed(0)
        model = GPT(CFG)
        cfg = config(tmp_path, f"swap-{delayed}", ("nvme", "nvme"), delayed_update=delayed, dtype=dtype)
        with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
            sizes[delayed] = engine.stats()["nvme_bytes"]
            units = [UnitSizes.of(u) for u in engine.units]
            assert swap_bytes(units, engine.layout) == sizes[delayed]
            compute[delayed] = sum(unit_home_bytes(s, engine.layout, i).compute // (2 if delayed else 1)
                                   for i, s in enumerate(units))
            for u in engine.units:
                if delayed and u.trainable:
                    assert u.spare.master_home is u.master_home and u.spare.moments_home is u.moments_home
                    assert u.spare.compute_home is not u.compute_home
    assert compute[True] == compute[False] > 0
    assert sizes[True] == sizes[False] + compute[False]
    on = Layout.resolve(offload.OffloadConfig(param_tier="host", optimizer_tier="host", delayed_update=True,
                                              dtype=dtype), torch.device("cpu"), None)
    off = Layout.resolve(offload.OffloadConfig(param_tier="host", optimizer_tier="host", dtype=dtype),
                         torch.device("cpu"), None)
    a, b = host_bytes(units, on), host_bytes(units, off)
    assert a.moments == b.moments and a.compute_copies == 2 * b.compute_copies


def test_a_failed_delayed_update_fails_the_step_until_a_checkpoint_is_loaded(tmp_path):
    """[Note: failures inside a step] A delayed update that raises on the worker is a failure
    of its step: the next training verb raises it, the ones after EngineFailedError, and
    load_checkpoint recovers (the run then equals the uninterrupted one)."""
    data = batches(4)
    cfg = config(tmp_path, "ours", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0)
    whole = run(config(tmp_path, "whole", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0), data)
    torch.manual_seed(0)
    model = GPT(CFG)
    ckpt = str(tmp_path / "ckpt")
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        engine.backward(gpt_loss(engine, data[0]))
        engine.step()
        engine.save_checkpoint(ckpt)  # step 1's update pending
        with offload.faults.inject("optim.deferred_update", offload.faults.raising(RuntimeError), at=2) as point:
            with pytest.raises(RuntimeError):
                engine.backward(gpt_loss(engine, data[1]))
                engine.step()  # queues step 2's updates: the second one raises on the worker
                engine.backward(gpt_loss(engine, data[2]))
                engine.step()
        assert point.fired == 1
        with pytest.raises(EngineFailedError, match="in a delayed update of the last optimizer step"):
            engine(data[2][:, :-1], data[2][:, 1:])
        with pytest.raises(EngineFailedError):
            engine.step()
        engine.load_checkpoint(ckpt)
        losses = train_offload(engine, data[1:])
        assert losses == whole.losses[1:]
        assert_same_state(engine.state_dict(), whole.state)


def test_a_failed_spare_write_of_a_delayed_update_fails_the_engine(tmp_path):
    """A swap write of a delayed update that fails leaves its spare homes half-written: the
    update cannot be committed, so the engine fails (OSError, then EngineFailedError) until a
    checkpoint is loaded, after which the run is the uninterrupted one's."""
    data = batches(3)
    cfg = config(tmp_path, "ours", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0)
    whole = run(config(tmp_path, "whole", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0), data)
    torch.manual_seed(0)
    model = GPT(CFG)
    ckpt = str(tmp_path / "ckpt")
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        engine.backward(gpt_loss(engine, data[0]))
        engine.step()
        engine.save_checkpoint(ckpt)
        engine.backward(gpt_loss(engine, data[1]))
        faulty = wrap_swap_io(engine, FaultyIO, errno.EIO, fail_write=1)  # the delayed updates' first write
        engine.step()  # returns: the updates run after it
        with pytest.raises(OSError, match="delayed updates of units"):
            engine.state_dict()
        assert faulty.writes >= 1
        unwrap_swap_io(engine)
        with pytest.raises(EngineFailedError):
            engine.step()
        engine.load_checkpoint(ckpt)
        losses = train_offload(engine, data[1:])
        assert losses == whole.losses[1:]
        assert_same_state(engine.state_dict(), whole.state)


@pytest.mark.host_device
@pytest.mark.parametrize("accumulation", [1, 2])
def test_spilled_gradients_change_nothing_in_a_delayed_run(accumulation, tmp_path):
    """With the smallest host_budget (gradients spilled to NVMe and read back by the delayed
    update on the worker, or by the next micro-step) the delayed run is the unspilled one's to
    the bit; units whose gradients a delayed update holds are never spilled."""
    kw = dict(dtype="bf16", delayed_update=True, delayed_update_warmup_steps=1,
              gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config(tmp_path, "probe", ("nvme", "nvme"),
                                                                         **kw)) as engine:
        sizes = [UnitSizes.of(u) for u in engine.units]
        budget, planned = minimum_host_budget(sizes, engine.layout), host_bytes(sizes, engine.layout)
    assert budget < planned.total
    data = batches(8)
    spilled = run(config(tmp_path, "spilled", ("nvme", "nvme"), host_budget=budget, **kw), data)
    plain = run(config(tmp_path, "plain", ("nvme", "nvme"), **kw), data)
    assert spilled.losses == plain.losses
    assert_same_state(spilled.state, plain.state)
    assert spilled.stats["spilled_gradient_bytes"] > 0 and spilled.stats["delayed_updates"] > 0


def test_a_failed_backward_keeps_the_pending_update(tmp_path):
    """[Note: failures inside a step] A backward that fails while the last step's delayed
    update is pending (some units' gradients already taken back from it) is consistent: the
    pending update is kept and committed by the next step(), and the run equals one that
    never saw that micro-batch, to the bit."""
    data = batches(5)
    cfg = config(tmp_path, "ours", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0)
    without = run(config(tmp_path, "without", ("nvme", "nvme"), delayed_update=True,
                         delayed_update_warmup_steps=0), data[:2] + data[3:])
    torch.manual_seed(0)
    model = GPT(CFG)
    losses = []
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        for k, b in enumerate(data, start=1):
            loss = gpt_loss(engine, b)
            if k == 3:  # step 2's update pending; the third unit's backward raises
                with offload.faults.inject("hooks.backward", offload.faults.raising(RuntimeError), at=3):
                    with pytest.raises(RuntimeError):
                        engine.backward(loss)
                continue
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.state_dict()
        stats = engine.stats()
    assert losses == without.losses
    assert_same_state(state, without.state)
    assert stats["delayed_updates"] == len(data) - 1


@pytest.mark.parametrize("where", ["waiting", "hand-off"])
def test_ctrl_c_while_backward_waits_for_a_delayed_update_is_consistent(where, tmp_path):
    """[Note: interrupts while waiting] A real SIGINT while backward waits for the last
    step's delayed update (to take its gradient fields back) is raised once that update is
    done, and the backward failed before any of its own updates: consistent; so is a
    KeyboardInterrupt at the first gradient hand-off, before the unit's fields are taken
    back ("hand-off"). The run then equals one that never saw that micro-batch, to the bit
    (before, the parameter whose hand-off was interrupted kept its gradient in .grad, which
    zero_grad left to a unit with a pending update, and the next backward added to it)."""
    data = batches(5)
    cfg = config(tmp_path, "ours", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0)
    without = run(config(tmp_path, "without", ("nvme", "nvme"), delayed_update=True,
                         delayed_update_warmup_steps=0), data[:2] + data[3:])
    torch.manual_seed(0)
    model = GPT(CFG)
    losses = []
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        for k, b in enumerate(data, start=1):
            if k == 2:  # step 2's first delayed update holds the worker until step 3's backward waits
                interrupt = sigint_once_main_waits_in("take_back")
                if where == "waiting":
                    point, action = "optim.deferred_update", interrupt
                else:
                    point, action = "optim.grad_ready", offload.faults.raising(KeyboardInterrupt)
                loss = gpt_loss(engine, b)
                engine.backward(loss)  # every update of step 1 done: their fields are taken back
                with offload.faults.inject(point, action) as armed:
                    engine.step()
                    losses.append(loss.item())
                    with pytest.raises(KeyboardInterrupt) as raised:
                        engine.backward(gpt_loss(engine, data[2]))
                assert interrupt.sent if where == "waiting" else armed.fired == 1
                assert "backward failed before any unit was updated" in str(raised.value.__notes__)
                continue
            if k == 3:
                continue
            loss = gpt_loss(engine, b)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.state_dict()
    assert losses == without.losses
    assert_same_state(state, without.state)


@pytest.mark.parametrize("verb", ["save_checkpoint", "state_dict"])
def test_ctrl_c_while_a_reader_waits_for_a_delayed_update_changes_nothing(verb, tmp_path):
    """[Note: interrupts while waiting] A real SIGINT while save_checkpoint or state_dict
    waits for the pending delayed updates is raised once they are done, before anything is
    read or written: the engine is not failed (before, a save marked it failed, and on a
    run's first save everything since wrap was lost), the verb works when called again and
    the run goes on as the uninterrupted one, to the bit."""
    data = batches(4)
    cfg = config(tmp_path, "ours", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0)
    whole = run(config(tmp_path, "whole", ("nvme", "nvme"), delayed_update=True, delayed_update_warmup_steps=0), data)
    torch.manual_seed(0)
    model = GPT(CFG)
    ckpt = tmp_path / "ckpt"
    read = {"save_checkpoint": lambda e: e.save_checkpoint(str(ckpt)), "state_dict": lambda e: e.state_dict()}[verb]
    with offload.wrap(model, make_opt(model.parameters()), config=cfg) as engine:
        losses = train_offload(engine, data[:1])
        interrupt = sigint_once_main_waits_in(verb)
        engine.backward(gpt_loss(engine, data[1]))  # every update of step 1 done
        with offload.faults.inject("optim.deferred_update", interrupt):
            engine.step()  # step 2's updates pending: the first holds the worker until the reader waits
            losses.append(whole.losses[1])
            with pytest.raises(KeyboardInterrupt):
                read(engine)
        assert interrupt.sent
        assert not ckpt.exists()
        read(engine)
        losses += train_offload(engine, data[2:])
        assert losses == whole.losses
        assert_same_state(engine.state_dict(), whole.state)
