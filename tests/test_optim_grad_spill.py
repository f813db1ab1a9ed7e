"""[Note: gradient spill] With a host budget below the step's fp32 gradients, units'
gradients go to NVMe once backward is done with them and come back for their update: the
run is the unspilled run bit for bit, the process stays near its budget, a failed read of
spilled gradients fails the engine as the checkpoint rules say, and a budget below the
fixed host needs is refused with the sizes."""
import dataclasses
import errno
import os

import pytest
import torch

import offload
from offload.config import OffloadConfig
from offload.errors import EngineFailedError
from offload.gpt import GPT
from offload.memory.budget import UnitSizes, host_bytes, minimum_device_budget, minimum_host_budget
from offload.memory.layout import Layout

from support import (CFG, RSS_SLACK_BYTES, FailedHandle, FaultyIO, assert_same_state, batches, gpt_loss, make_opt,
                     rss_gpt_sizes, train_gpt, train_in_fresh_process, train_offload, wrap_swap_io)

# Gradients spill only where the host tier adopts autograd's tensors: the CPU device
pytestmark = pytest.mark.host_device

# The small GPT's norms over six steps: 9.6, 9.6, 7.7, 5.9, 5.0, 3.9 (test_optim_speculative)
MIXED_NORM = 6.0
NEVER_CLIPS = 1e9
NUM_STEPS = 6


def config(tmp_path, name, **kw):
    return {**dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / name),
                   device_budget=140 * 1024 * 2), **kw}


def smallest_budget(tmp_path, **kw):
    """The smallest host_budget wrap accepts for the small GPT: one unit's gradients in RAM."""
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config(tmp_path, "probe", **kw)) as engine:
        sizes = [UnitSizes.of(u) for u in engine.units]
        return minimum_host_budget(sizes, engine.layout), host_bytes(sizes, engine.layout)


def train(tmp_path, name, data, **kw):
    """Losses, the state_dict after training, the stats and every update's grad_norm."""
    return train_gpt(config(tmp_path, name, **kw), data)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("clip", ["never", "mixed"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_spilled_run_equals_the_unspilled_run_bit_for_bit(dtype, clip, speculative, accumulation, tmp_path):
    """Gradients spilled (the smallest budget: one unit's gradients stay in RAM) and read
    back for the speculative redo, the staged step or the next micro-step's accumulation:
    losses, weights, optimizer states and norms are the unspilled run's. The host tier's
    peak is at most the budget plus one unit's gradients on the main thread (a unit read
    back for accumulation, or the gradient a hook just took, before others go) and, with
    updates in backward, one more on the optimizer worker (a spilled unit read back by its
    early update). Units whose updates are queued or running are not spilled, so backward
    waits for them rather than going past the budget by the worker's backlog (before, the
    speculative cases went up to 3 units past it)."""
    kw = dict(dtype=dtype, max_grad_norm=NEVER_CLIPS if clip == "never" else MIXED_NORM,
              speculative_updates=speculative, gradient_accumulation_steps=accumulation)
    budget, planned = smallest_budget(tmp_path, **kw)
    assert budget < planned.total
    data = batches(NUM_STEPS)
    spilled = train(tmp_path, "spilled", data, host_budget=budget, **kw)
    plain = train(tmp_path, "plain", data, **kw)
    assert spilled[0] == plain[0], "losses differ"
    assert_same_state(spilled[1], plain[1])
    assert spilled[3] == plain[3], "grad norms differ"
    assert spilled[2]["spilled_gradient_bytes"] > 0 and plain[2]["spilled_gradient_bytes"] == 0
    unit_bytes = (budget - (planned.total - planned.gradients)) // 2  # the smallest budget has two
    assert spilled[2]["host_peak_bytes"] <= budget + unit_bytes * (2 if speculative else 1)


class ExtentTraffic:
    """Wraps the engine's IOEngine (``inner``): counts the reads and writes that start inside
    one extent (``path``, [lo, hi) bytes)."""

    def __init__(self, io, extent):
        self.inner, self._extent = io, extent
        self.reads = self.writes = 0

    def _inside(self, path, offset):
        e = self._extent
        return path == e.path and e.offset <= offset < e.offset + e.nbytes

    def write_from(self, tensor, path, offset=0):
        self.writes += self._inside(path, offset)
        return self.inner.write_from(tensor, path, offset)

    def read_into(self, tensor, path, offset=0):
        self.reads += self._inside(path, offset)
        return self.inner.read_into(tensor, path, offset)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_unit_holding_little_of_its_gradient_extent_is_not_spilled(dtype, tmp_path):
    """[Note: gradient spill] Tied embeddings, clipping on, the smallest budget: for most of
    backward the root unit holds only its final norm's gradient in RAM, while the tied
    embedding's sum waits for the end of backward. Spilling it then wrote its whole extent
    to free a few bytes, and the sum's arrival read it all back on the main thread. Now it
    is spilled only once it holds its gradients: its extent is written and read at most
    once a step (by the update), and the run is the unspilled one bit for bit."""
    tied = dataclasses.replace(CFG, tie_embeddings=True)
    kw = dict(dtype=dtype, max_grad_norm=MIXED_NORM, speculative_updates=False)

    def run(name, host_budget=None):
        torch.manual_seed(0)
        model = GPT(tied)
        with offload.wrap(model, make_opt(model.parameters()),
                          config=config(tmp_path, name, host_budget=host_budget, **kw)) as engine:
            if host_budget is None:
                sizes = [UnitSizes.of(u) for u in engine.units]
                return minimum_host_budget(sizes, engine.layout), None, None
            root = engine.units[0]
            traffic = wrap_swap_io(engine, ExtentTraffic, root.grad_home)
            losses = train_offload(engine, data)
            return losses, engine.state_dict(), (traffic.reads, traffic.writes, engine.stats())

    data = batches(NUM_STEPS)
    budget, _, _ = run("probe")
    losses, state, (reads, writes, stats) = run("spilled", budget)
    plain = train_gpt(config(tmp_path, "plain", **kw), data, model_config=tied)
    assert losses == plain[0]
    assert_same_state(state, plain[1])
    assert stats["spilled_gradient_bytes"] > 0
    assert 0 < writes <= NUM_STEPS and reads <= writes


def test_backward_waits_for_a_slow_worker_rather_than_passing_the_budget(tmp_path):
    """[Note: gradient spill] A worker made slow (each speculative update starts 50 ms late)
    has a backlog during backward: the main thread waits for it (gradient_budget_waits)
    instead of holding the gradients of every queued unit, the host tier stays within the
    budget plus two units' gradients, and the run is the unspilled one bit for bit."""
    import time

    import offload.faults

    kw = dict(dtype="fp32", max_grad_norm=NEVER_CLIPS, speculative_updates=True)
    budget, planned = smallest_budget(tmp_path, **kw)
    data = batches(3)
    with offload.faults.inject("optim.early_update", lambda **_: time.sleep(0.05)):
        spilled = train(tmp_path, "spilled", data, host_budget=budget, **kw)
    plain = train(tmp_path, "plain", data, **kw)
    assert spilled[0] == plain[0] and spilled[3] == plain[3]
    assert_same_state(spilled[1], plain[1])
    unit_bytes = (budget - (planned.total - planned.gradients)) // 2
    assert spilled[2]["gradient_budget_waits"] > 0 and plain[2]["gradient_budget_waits"] == 0
    assert spilled[2]["host_peak_bytes"] <= budget + 2 * unit_bytes


def test_rss_stays_under_a_bound_computed_from_the_budget(tmp_path):
    """A GPT (d_model 512, 16 layers: 202 MB of fp32 gradients) trained 2 steps with the
    smallest host_budget wrap accepts (63 MB: 38 MB of staging slots, a 12.6 MB bounce
    buffer, one block's 12.6 MB of gradients) in a fresh process. Bound on its peak RSS
    (ru_maxrss): the RSS after ``import torch, offload`` + host_budget + device_budget (the
    CPU "device" is RAM) + 256 MiB for everything no budget covers (activations, autograd's
    gradient tensors before the hook takes them, the I/O engine, allocator slack). Measured:
    about 290 MB over the baseline, against 439 MB without a host_budget (the unspilled
    run, which this bound refuses)."""
    conf = dict(device="cpu", param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"),
                max_grad_norm=1.0, speculative_updates=False)
    sizes = rss_gpt_sizes()
    layout = Layout.resolve(OffloadConfig(**conf), torch.device("cpu"), None)
    host_budget, device_budget = minimum_host_budget(sizes, layout), minimum_device_budget(sizes, "nvme", 4)
    baseline, peak, stats = train_in_fresh_process(dict(conf, host_budget=host_budget, device_budget=device_budget))
    gradient_bytes, spilled = stats["gradient_bytes"], stats["spilled_gradient_bytes"]
    assert gradient_bytes > 3 * host_budget and spilled >= 2 * gradient_bytes * 3 // 4
    assert peak <= baseline + host_budget + device_budget + RSS_SLACK_BYTES, \
        f"peak RSS {peak} over {baseline} + {host_budget} + {device_budget} + {RSS_SLACK_BYTES}"


class FailGradientReads:
    """Wraps the engine's IOEngine (``inner``): every read of one of ``extents`` (a unit's
    gradient extent) fails with EIO."""

    def __init__(self, io, extents):
        self.inner, self._extents = io, {(e.path, e.offset) for e in extents}
        self.failed = 0

    def read_into(self, tensor, path, offset=0):
        if (path, offset) in self._extents:
            self.failed += 1
            return FailedHandle(OSError(errno.EIO, os.strerror(errno.EIO), path))
        return self.inner.read_into(tensor, path, offset)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("speculative", [True, False])
def test_a_failed_spilled_gradient_read_fails_the_engine_until_a_checkpoint_is_loaded(speculative, tmp_path):
    """The first step clips (norm 9.6 > 6): the speculative updates are redone (or, not
    speculative, the staged step runs) from spilled gradients, whose reads fail. The engine
    is failed (the step, or the call that settles a deferred one, raises; EngineFailedError
    on the next forward), and load_checkpoint of the state
    before the step recovers it: the next steps are the unspilled run's, bit for bit."""
    kw = dict(max_grad_norm=MIXED_NORM, speculative_updates=speculative)
    budget, _ = smallest_budget(tmp_path, **kw)
    data = batches(3)
    plain = train(tmp_path, "plain", data[1:], **kw)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "spilled", host_budget=budget, **kw)) as engine:
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.backward(gpt_loss(engine, data[0]))
        assert engine.stats()["spilled_gradient_bytes"] > 0
        faulty = wrap_swap_io(engine, FailGradientReads, [u.grad_home for u in engine.units if u.trainable])
        with pytest.raises(OSError, match="resume from the last checkpoint"):
            engine.step()
            engine.state_dict()  # settles a deferred step ([Note: deferred updates])
        assert faulty.failed > 0
        with pytest.raises(EngineFailedError):
            gpt_loss(engine, data[1])
        engine.debug.nvme.io = faulty.inner
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        losses = train_offload(engine, data[1:])
        assert losses == plain[0]
        assert_same_state(engine.state_dict(), plain[1])


def test_a_failed_spill_write_keeps_the_gradients_in_ram(tmp_path):
    """Without early updates the only writes in backward are spills: the first fails
    (scribbling over the extent), that unit's gradients stay in RAM, and the run is still
    the unspilled run bit for bit."""
    kw = dict(max_grad_norm=MIXED_NORM, speculative_updates=False)
    budget, _ = smallest_budget(tmp_path, **kw)
    data = batches(2)
    plain = train(tmp_path, "plain", data, **kw)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "spilled", host_budget=budget, **kw)) as engine:
        faulty = wrap_swap_io(engine, FaultyIO, errno.ENOSPC, fail_write=1)
        losses = train_offload(engine, data)
        stats = engine.stats()
        assert faulty.writes > 1 and stats["failed_gradient_spills"] == 1 and stats["spilled_gradient_bytes"] > 0
        assert losses == plain[0]
        assert_same_state(engine.state_dict(), plain[1])


class FullDisk:
    """The swap I/O engine of a disk that filled up: every write from the ``first``-th on
    fails with ENOSPC (as a real one does where the files are not preallocated: btrfs, a
    filesystem without fallocate), reads go on."""

    def __init__(self, io, first):
        self.inner, self.first, self.writes = io, first, 0

    def write_from(self, tensor, path, offset=0):
        self.writes += 1
        if self.writes >= self.first:
            return FailedHandle(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))
        return self.inner.write_from(tensor, path, offset)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("first", [1, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_full_disk_at_the_smallest_budget_keeps_the_step_to_save_elsewhere(dtype, first, tmp_path):
    """[Note: swap I/O failures] ENOSPC on every swap write from some point of a step, with
    gradients spilling at the smallest host_budget: the spills keep their gradients in RAM
    and the states the step could not write are held in host RAM past host_budget (it leaves
    no room there), which the error says; a checkpoint saved elsewhere holds the step, and
    the run resumed from it is the uninterrupted one. Before, the budget left no room for
    the held states, the engine failed and refused to save."""
    kw = dict(dtype=dtype)
    budget, _ = smallest_budget(tmp_path, **kw)
    data = batches(3)
    plain = train(tmp_path, "plain", data, **kw)
    torch.manual_seed(0)
    model = GPT(CFG)
    ckpt = str(tmp_path / "elsewhere")
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "full", host_budget=budget, **kw)) as engine:
        train_offload(engine, data[:1])
        engine.state_dict()  # the first step's updates written
        full = wrap_swap_io(engine, FullDisk, first)
        loss = gpt_loss(engine, data[1])
        engine.backward(loss)
        with pytest.raises(OSError, match="past host_budget") as caught:
            engine.step()
            engine.state_dict()  # a deferred step reports its failed writes here
        assert caught.value.errno == errno.ENOSPC and "save_checkpoint" in str(caught.value)
        assert full.writes >= first and engine.stats()["spilled_gradient_bytes"] > 0
        with pytest.raises(EngineFailedError):
            gpt_loss(engine, data[2])
        engine.save_checkpoint(ckpt)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=config(tmp_path, "resumed", host_budget=budget, **kw)) as engine:
        engine.load_checkpoint(ckpt)
        losses = [plain[0][0], loss.item()] + train_offload(engine, data[2:])
        assert losses == plain[0]
        assert_same_state(engine.state_dict(), plain[1])


@pytest.mark.parametrize("dtype,kw", [
    ("fp32", {}), ("bf16", {}), ("fp16", {}), ("fp32", dict(max_grad_norm=1.0)),
    ("bf16", dict(delayed_update=True, delayed_update_warmup_steps=1)),
    ("fp32", dict(param_tier="host")), ("fp32", dict(optimizer_tier="host"))],
    ids=["fp32", "bf16", "fp16", "fp32-clip", "bf16-delayed", "host-params", "host-states"])
def test_the_host_peak_stays_within_the_smallest_budget(dtype, kw, tmp_path):
    """At the smallest host_budget wrap accepts, what the engine holds on the host never
    goes past it: the floor keeps room for the unit backward is producing and for one an
    update on the worker reads back meanwhile (before, the two at once went 1-9% past it)."""
    kw = dict(dtype=dtype, **kw)
    budget, planned = smallest_budget(tmp_path, **kw)
    assert budget < planned.total  # gradients spill
    stats = train_gpt(config(tmp_path, "smallest", host_budget=budget, **kw), batches(4))[2]
    assert stats["spilled_gradient_bytes"] > 0
    assert stats["host_peak_bytes"] <= budget


def test_budget_below_the_fixed_host_needs_is_refused_naming_the_sizes(tmp_path):
    """One byte below the smallest spilling budget names host_budget, the staging buffers
    and the gradients; without an NVMe tier a budget below the gradients says spilling needs
    one."""
    budget, _ = smallest_budget(tmp_path)
    torch.manual_seed(0)
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"host_budget: .*optimizer staging buffers .*gradients"):
        offload.wrap(model, make_opt(model.parameters()), config=config(tmp_path, "low", host_budget=budget - 1))
    with pytest.raises(ValueError, match=r"host_budget: .*fp32 gradients.*NVMe"):
        offload.wrap(model, make_opt(model.parameters()),
                     config=dict(param_tier="host", optimizer_tier="host", host_budget=budget))
