"""The mechanisms built on their own, without wrap(): the staged optimizer step, the homes,
the delayed updates, the update scheduler, the hooks and the checkpoints' access, each from
the few collaborators its constructor names (the TierContext, the Homes, UnitAdam,
Gradients, FailureState, DeviceResidency, UpdatePaths, the ports of the classes built after
them), small real ones here, so that the ports are usable by themselves.

A unit's update through PipelinedStep is held against torch.optim.AdamW as tests/
test_optim_cpu_adam.py does ([Note: how exact the tests are] there): the moments bit for bit,
the parameters within one rounding per step (the kernel's square root is IEEE's, torch's CPU
one MKL's)."""
from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, List, Optional

import pytest
import torch
from torch import nn

import offload
from offload import faults
from offload.errors import EngineFailedError
from offload.memory.budget import UnitSizes, check_device_budget, check_host_budget, slot_shape, swap_bytes
from offload.memory.homes import Homes
from offload.memory.layout import Layout, UnitState, on_nvme
from offload.memory.placement import resolve_placement
from offload.checkpoint import CheckpointAccess, RunRecord
from offload.hooks import Hooks
from offload.memory.activations import ActivationStore
from offload.memory.residency import DeviceResidency
from offload.optim.adam_ranges import UnitAdam
from offload.optim.compact import CompactUnit, UnitCompactStates
from offload.optim.cpu_adam import adam_flavour
from offload.optim.delayed import DelayedUpdates
from offload.optim.failure import FailureState
from offload.optim.gradients import Gradients
from offload.optim.paths import UpdatePaths
from offload.optim.several import GroupRule, OptimizerSet
from offload.optim.step import PipelinedStep
from offload.optim.updates import UpdateScheduler
from offload.prefetch import Prefetcher
from offload.stats import Stats, Timeline
from offload.tiers import DeviceTier, HostTier, NvmeTier
from offload.tiers.context import TierContext
from offload.units import OPTIMIZER_PIECE_NUMEL, padded_numel, split_into_units

LR, WEIGHT_DECAY = 1e-2, 0.1


class Tiny(nn.Module):
    """Three units: the root (the head) and one per block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class NoEarlyUpdates:
    """Gradients' EarlyUpdates port with nothing to start early (no update scheduler here)."""

    early_updates = False

    def maybe_update_early(self) -> None:
        raise AssertionError("no early update is asked for")


class StandAlone:
    """What the engine's wrap builds for the optimizer step, built by hand from the config:
    the units, the Layout, the tiers, the residency, the Homes (every unit's initial state
    written home), UnitAdam, Gradients and the PipelinedStep over them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: offload.OffloadConfig) -> None:
        device = torch.device("cpu")
        self.config = config
        self.optimizers = optimizers = OptimizerSet([optimizer])
        layout = Layout.resolve(config, device, None)
        group_of = {p: gi for gi, group in enumerate(optimizers.param_groups) for p in group["params"]}
        specs = split_into_units(model, group_of, layout.compute_element_bytes)
        self.units = [UnitState(spec, layout.compute_element_bytes, 2) for spec in specs]
        sizes = [UnitSizes.of(u) for u in self.units]
        self.layout = layout = resolve_placement(config, device, None, sizes)
        arena = check_device_budget(sizes, layout)
        host_planned_bytes = check_host_budget(sizes, layout).total
        stats, timeline = Stats(), Timeline()
        device_tier = DeviceTier(device, layout.compute_dtype, arena.capacity_numel, arena.budget_bytes)
        host = HostTier(layout.host_budget)
        self.nvme = NvmeTier(config.swap_dir, swap_bytes(sizes, layout), "threads", config.io_block_bytes,
                             config.io_queue_depth) if layout.needs_nvme else None
        self.tiers = TierContext(device_tier, host, self.nvme, stats, timeline)
        self.prefetcher = Prefetcher(layout.prefetch, layout.prefetch_units, max_bytes_ahead=layout.prefetch_bytes)
        self.residency = DeviceResidency(layout=layout, units=self.units, tiers=self.tiers, partition=None,
                                         prefetcher=self.prefetcher)
        self.homes = Homes(self.units, layout, tiers=self.tiers, partition=None,
                           release_param=self.residency.released.release, bind=self.residency.bind,
                           compact=UnitCompactStates())
        self.homes.allocate()
        slots = self.homes.allocate_staging(slot_shape(sizes, layout))
        with torch.no_grad():
            for u in self.units:
                self.homes.write_initial_state(u)
        self.gradients = Gradients(self.units, layout=layout, partition=None, device=device_tier, host=host,
                                   stats=stats)
        self.gradients.connect(NoEarlyUpdates())
        rules = [GroupRule(None, gi, adam_flavour(optimizer)) for gi in range(len(optimizer.param_groups))]
        self.adam = UnitAdam(optimizers, rules, layout=layout, device=device_tier, gradients=self.gradients,
                             timeline=timeline, piece_numel=OPTIMIZER_PIECE_NUMEL)
        self.failures = FailureState()
        self.step = PipelinedStep(slots, layout=layout, tiers=self.tiers, homes=self.homes, adam=self.adam,
                                  gradients=self.gradients, failures=self.failures,
                                  host_planned_bytes=host_planned_bytes)

    def hand_gradients(self, grads: dict) -> None:
        """Give each parameter's gradient to Gradients, as the gradient hooks do in backward."""
        for u in self.units:
            for k, e in enumerate(u.trainable):
                e.param.grad = grads[e.fqn].clone()
                self.gradients.on_grad_ready(u, k, e.param)

    def paths(self) -> UpdatePaths:
        """The update paths of one process: the staged step or Adam in place, no sharded step."""
        return UpdatePaths(self.layout, ring=self.step, sharded=None, adam=self.adam, partition=None)

    def close(self) -> None:
        self.residency.drain_fetches()
        self.residency.shutdown()
        if self.nvme is not None:
            self.nvme.close()
        self.tiers.host.close()
        self.tiers.device.close()


def _config(tmp_path, **fields) -> offload.OffloadConfig:
    return offload.OffloadConfig(**{"device": "cpu", "dtype": "fp32", "param_tier": "host", "optimizer_tier": "nvme",
                                    "swap_dir": str(tmp_path / "swap"), **fields})


def _holds_gradients(u: UnitState) -> bool:
    return u.grad is not None or any(g is not None for g in u.param_grads)


def _grads(model: nn.Module) -> dict:
    generator = torch.Generator().manual_seed(1)
    return {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}


@pytest.mark.parametrize("param_tier,dtype", [("host", "fp32"), ("nvme", "bf16")])
def test_one_unit_through_the_pipelined_step_built_alone_is_torchs_adamw(tmp_path, param_tier, dtype):
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = _grads(model)
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                       _config(tmp_path, param_tier=param_tier, dtype=dtype))
    try:
        root = built.units[0]
        assert [u.name for u in built.units][1:] == ["blocks.0", "blocks.1"]
        assert on_nvme(root.moments_home) and on_nvme(root.compute_home) == (param_tier == "nvme")
        assert built.step.slots  # the states on NVMe: the step is staged
        built.hand_gradients(grads)
        nvme = built.nvme
        read_before, written_before = nvme.bytes_read, nvme.bytes_written
        # one unit, the root: the others keep their gradients and their states
        built.step.staged_update([root], grad_factor=1.0, micro_step=1)
        moved = (nvme.bytes_read - read_before, nvme.bytes_written - written_before)

        torch_adamw = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for name, p in reference.named_parameters():
            p.grad = grads[name].clone()
        torch_adamw.step()
        stepped = dict(reference.named_parameters())

        state_numel = root.shard.state_numel
        master = built.homes.read_master(root)
        moments = built.homes.load(root.moments_home, 2 * state_numel, torch.float32)
        assert root.steps == [1] * len(root.trainable)
        assert _holds_gradients(built.units[1]) and not _holds_gradients(root)  # Gradients.release
        for e in root.trainable:
            want = stepped[e.fqn].detach().reshape(-1)
            state = torch_adamw.state[stepped[e.fqn]]
            tolerance = 1e-6 * max(float(want.abs().max()), 1.0)
            assert float((master[e.offset:e.offset + e.numel] - want).abs().max()) <= tolerance, e.fqn
            assert not torch.equal(want, initial[e.fqn].reshape(-1)), e.fqn  # the step moved it
            assert torch.equal(moments[e.offset:e.offset + e.numel], state["exp_avg"].reshape(-1)), e.fqn
            assert torch.equal(moments[state_numel + e.offset:state_numel + e.offset + e.numel],
                               state["exp_avg_sq"].reshape(-1)), e.fqn
        for u in built.units[1:]:  # not stepped: their initial values, zero moments, gradients kept
            assert u.steps == [0] * len(u.trainable) and _holds_gradients(u)
            values = built.homes.unit_values(u, {})
            for e in u.trainable:
                assert torch.equal(values[e.offset], initial[e.fqn]), e.fqn
            assert not bool(built.homes.load(u.moments_home, 2 * u.shard.state_numel, torch.float32).any())
        # the root is one piece: its moments home whole, read once and written once; with bf16
        # the master split ([Note: split master]): its low halves and the compute copy (the high
        # ones), whole pages of 2-byte elements each, read and written
        moments_bytes = root.moments_home.nbytes
        if dtype == "fp32":  # merged: the master is the compute copy at home, on the host
            assert moved == (moments_bytes, moments_bytes)
        else:
            assert built.layout.split_master
            half_bytes = padded_numel(root.spec.trainable_numel, 2) * 2
            assert moved == (moments_bytes + 2 * half_bytes, moments_bytes + 2 * half_bytes)
        assert built.failures.failure is None
    finally:
        built.close()


def test_a_failed_step_of_the_pipelined_step_built_alone_fails_the_failure_state_it_was_given(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR), _config(tmp_path))
    try:
        built.hand_gradients(_grads(model))
        root = built.units[0]

        def fail(**where):
            raise OSError(5, "injected write failure")

        with faults.inject("optim.write_back", fail, at=1):
            with pytest.raises(OSError, match="injected write failure"):
                built.step.staged_update([root], grad_factor=1.0, micro_step=7)
        failure = built.failures.failure
        assert failure is not None and failure["fatal"]
        assert "micro-step 7" in failure["message"] and repr(root.name) in failure["message"]
        with pytest.raises(EngineFailedError, match="resume from the last checkpoint"):
            built.failures.check("step")
    finally:
        built.close()


def test_compact_states_reach_the_pipelined_step_built_alone_through_the_homes_port(tmp_path):
    """[Note: compact optimizer states] With compact states on NVMe the step reads the root's
    compact home into a slot and steps the CompactUnit the homes' CompactStates port builds
    over it: the same bits as a CompactUnit of its own, loaded with the initial values and
    stepped with the same gradients and hyperparameters."""
    torch.manual_seed(0)
    model = Tiny()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = _grads(model)
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                       _config(tmp_path, dtype="bf16", optimizer_states="compact"))
    try:
        root = built.units[0]
        assert built.layout.compact_states and on_nvme(root.compact_home) and root.compact is None
        built.hand_gradients(grads)
        built.step.staged_update([root], grad_factor=1.0, micro_step=1)

        expected = CompactUnit([e.numel for e in root.trainable])
        for k, e in enumerate(root.trainable):
            zeros = torch.zeros(e.numel)
            expected.load_exact(k, initial[e.fqn].reshape(-1), zeros, zeros)
        group = {"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": WEIGHT_DECAY}
        steps = expected.step([grads[e.fqn].reshape(-1) for e in root.trainable], [0] * len(root.trainable),
                              [group] * len(root.trainable))
        got = built.homes.read_compact(root)
        assert root.steps == steps == [1] * len(root.trainable)
        for k, e in enumerate(root.trainable):
            for name, a, b in zip(("master", "exp_avg", "exp_avg_sq"), got.exact(k), expected.exact(k)):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (e.fqn, name)
            assert not torch.equal(got.exact(k)[0], initial[e.fqn].reshape(-1)), e.fqn  # the step moved it
    finally:
        built.close()


@pytest.mark.parametrize("num_slots", [0, 1])
def test_a_staged_step_built_without_two_staging_slots_is_a_value_error_naming_them(tmp_path, num_slots):
    """[Note: the piece ring] Slot 0 serves the step's first unit and the early updates' ring the
    others: fewer than two would divide by zero in the ring, so construction refuses them."""
    torch.manual_seed(0)
    model = Tiny()
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR), _config(tmp_path))
    try:
        assert built.layout.staged_step and len(built.step.slots) == built.layout.optimizer_pipeline_depth
        with pytest.raises(ValueError, match=f"slots: .*at least 2 staging slots.*got {num_slots}"):
            PipelinedStep(built.step.slots[:num_slots], layout=built.layout, tiers=built.tiers, homes=built.homes,
                          adam=built.adam, gradients=built.gradients, failures=built.failures,
                          host_planned_bytes=0)
    finally:
        built.close()


class OneWorker:
    """The delayed updates' OptimizerWorker port over a thread of its own, as the update
    scheduler runs it: what it was given to run is what finish_optimizer waits for."""

    def __init__(self, micro_step: int) -> None:
        self.micro_step = micro_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-worker")
        self._tickets: List[Future] = []

    def submit_update(self, run: Callable[..., None], *args: Any) -> Future:
        ticket = self._pool.submit(run, *args)
        self._tickets.append(ticket)
        return ticket

    def finish_optimizer(self) -> Optional[BaseException]:
        tickets, self._tickets = self._tickets, []
        for ticket in tickets:
            ticket.result()
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _adamw_after_one_step(model: nn.Module, grads: dict, **hyperparameters) -> dict:
    """Each parameter of a copy of ``model`` after one torch.optim.AdamW step with ``grads``."""
    reference = copy.deepcopy(model)
    adamw = torch.optim.AdamW(reference.parameters(), **hyperparameters)
    for name, p in reference.named_parameters():
        p.grad = grads[name].clone()
    adamw.step()
    return {name: p.detach().reshape(-1) for name, p in reference.named_parameters()}


def _assert_masters(built: "StandAlone", want: dict, units: List[UnitState], read=None) -> None:
    for u in units:
        master = built.homes.read_master(u) if read is None else read(u)
        for e in u.trainable:
            tolerance = 1e-6 * max(float(want[e.fqn].abs().max()), 1.0)
            assert float((master[e.offset:e.offset + e.numel] - want[e.fqn]).abs().max()) <= tolerance, e.fqn


@pytest.mark.parametrize("optimizer_tier", ["host", "nvme"])
def test_delayed_updates_built_alone_write_the_spare_homes_until_the_commit(tmp_path, optimizer_tier):
    """[Note: delayed updates] DelayedUpdates from its eight collaborators (a worker of its
    own for the OptimizerWorker port): queued updates leave the homes as they were and write
    the spare homes, which read_committed shows and commit makes the homes; the master is
    then torch's AdamW step, the gradients are given back and taken back."""
    torch.manual_seed(0)
    model = Tiny()
    initial = {name: p.detach().reshape(-1).clone() for name, p in model.named_parameters()}
    grads = _grads(model)
    want = _adamw_after_one_step(model, grads, lr=LR, weight_decay=WEIGHT_DECAY)
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                       _config(tmp_path, optimizer_tier=optimizer_tier, delayed_update=True,
                               delayed_update_warmup_steps=0))
    worker = OneWorker(micro_step=1)
    try:
        assert built.layout.delayed_update and built.layout.staged_step == (optimizer_tier == "nvme")
        delayed = DelayedUpdates(built.units, layout=built.layout, tiers=built.tiers, paths=built.paths(),
                                 worker=worker, gradients=built.gradients, residency=built.residency,
                                 failures=built.failures)
        built.hand_gradients(grads)
        assert delayed.delays(skip=False, clipped=False)  # past the warm-up (micro-step 1, W = 0)
        delayed.queue(built.adam.hyperparameters(), grad_factor=1.0)
        delayed.wait()
        assert all(u.delayed_pending for u in built.units)
        for u in built.units:  # the homes hold the values before the step: the forward reads them
            values = built.homes.unit_values(u, {})
            for e in u.trainable:
                assert torch.equal(values[e.offset].reshape(-1), initial[e.fqn]), e.fqn
        _assert_masters(built, want, built.units,
                        read=lambda u: delayed.read_committed(u, lambda: built.homes.read_master(u)))
        delayed.take_back_all()
        assert not any(any(u.has_grad) for u in built.units)
        assert not any(_holds_gradients(u) for u in built.units)  # the updates gave them back
        delayed.commit()
        assert not any(u.delayed_pending for u in built.units)
        _assert_masters(built, want, built.units)
        assert [u.steps for u in built.units] == [[1] * len(u.trainable) for u in built.units]
        assert built.failures.failure is None
    finally:
        worker.close()
        built.close()


def _scheduler(built: "StandAlone") -> UpdateScheduler:
    """The update scheduler over what ``built`` holds, connected to the residency and the
    gradients as wrap connects them."""
    scheduler = UpdateScheduler(built.units, layout=built.layout, tiers=built.tiers, paths=built.paths(),
                                prefetcher=built.prefetcher, gradients=built.gradients, residency=built.residency,
                                status=built.failures)
    built.residency.connect(scheduler)
    built.gradients.connect(scheduler)
    return scheduler


@pytest.mark.parametrize("optimizer_tier", ["host", "nvme"])
def test_the_update_scheduler_built_alone_steps_every_unit_as_torchs_adamw(tmp_path, optimizer_tier):
    """UpdateScheduler from its eight collaborators: step() at the accumulation boundary
    updates every unit with a gradient through the update paths (with states on NVMe
    deferred to the worker, through the staged step; Adam in place on the host) and drops
    the gradients (zero_grad); a second step() without gradients changes nothing."""
    torch.manual_seed(0)
    model = Tiny()
    grads = _grads(model)
    want = _adamw_after_one_step(model, grads, lr=LR, weight_decay=WEIGHT_DECAY)
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY),
                       _config(tmp_path, optimizer_tier=optimizer_tier))
    scheduler = _scheduler(built)
    try:
        built.hand_gradients(grads)
        scheduler.micro_step = 1
        scheduler.step()
        # [Note: deferred updates] with the states on NVMe step() leaves the updates to the
        # worker and returns; settle_all finishes them and the step's bookkeeping
        assert scheduler.step_pending == (optimizer_tier == "nvme")
        scheduler.settle_all()
        _assert_masters(built, want, built.units)
        assert [u.steps for u in built.units] == [[1] * len(u.trainable) for u in built.units]
        assert not any(any(u.has_grad) or _holds_gradients(u) for u in built.units)
        moments = [built.homes.load(u.moments_home, 2 * u.shard.state_numel, torch.float32).clone()
                   for u in built.units]
        scheduler.micro_step = 2
        scheduler.step()  # no gradient: no unit moves
        assert [u.steps for u in built.units] == [[1] * len(u.trainable) for u in built.units]
        for u, before in zip(built.units, moments):
            assert torch.equal(built.homes.load(u.moments_home, 2 * u.shard.state_numel, torch.float32), before)
        assert built.failures.failure is None
    finally:
        scheduler.shutdown_worker()
        built.close()


def test_the_hooks_built_alone_run_the_models_function_and_hand_its_gradients_over(tmp_path):
    """Hooks from their eight collaborators (the residency and the update scheduler for their
    ports): a forward through the installed hooks fetches each unit to the device and
    computes what the plain model computes; its backward (begun as engine.backward begins
    one) hands every parameter's gradient to Gradients, which the scheduler's step then
    applies as torch's AdamW does with the plain model's gradients. state_dict() of the
    wrapped model reads the values through the scheduler's settled_values."""
    torch.manual_seed(0)
    model = Tiny()
    plain = copy.deepcopy(model)
    x = torch.randn(3, 16)
    expected_out = plain(x)
    expected_out.sum().backward()
    grads = {name: p.grad.clone() for name, p in plain.named_parameters()}
    want = _adamw_after_one_step(model, grads, lr=LR)
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR), _config(tmp_path))
    scheduler = _scheduler(built)
    activations = ActivationStore(None, tiers=built.tiers, nvme=None)
    hooks = Hooks(model, built.units, tiers=built.tiers, gradients=built.gradients, partition=None,
                  activations=activations, residency=built.residency, updates=scheduler)
    hooks.install()
    try:
        out = model(x)
        assert torch.allclose(out, expected_out, rtol=1e-6, atol=1e-6)
        assert all(u.calls == (0 if u is built.units[0] else 1) for u in built.units)
        hooks.begin_backward()
        out.sum().backward()
        built.gradients.finish_backward()
        hooks.end_backward()
        assert all(all(u.has_grad) for u in built.units)
        scheduler.micro_step = 1
        scheduler.step()
        scheduler.settle_all()  # [Note: deferred updates] the pass's trace let step() defer them
        _assert_masters(built, want, built.units)
        state = model.state_dict()  # [Note: state_dict of a wrapped model]
        for name, value in state.items():
            assert torch.equal(value.reshape(-1), want[name]) or \
                float((value.reshape(-1) - want[name]).abs().max()) <= 1e-6, name
    finally:
        hooks.remove()
        scheduler.shutdown_worker()
        activations.close()
        built.close()


@pytest.mark.parametrize("optimizer_tier", ["host", "nvme"])
def test_checkpoint_access_built_alone_writes_a_units_state_and_reads_it_back(tmp_path, optimizer_tier):
    """[Note: checkpoint access] CheckpointAccess from its eight collaborators (the Homes, the
    residency, the FailureState, the update scheduler as its TrainingState): a unit's state
    written as a load writes it (master, both moments, step counts) reads back bit for bit
    from the homes, the weights go to the compute copy too, and the counters go to the
    scheduler and the gradients; a save is refused while gradients are pending, and a load
    marks the engine failed until it is finished."""
    torch.manual_seed(0)
    model = Tiny()
    built = StandAlone(model, torch.optim.AdamW(model.parameters(), lr=LR),
                       _config(tmp_path, optimizer_tier=optimizer_tier))
    scheduler = _scheduler(built)
    access = CheckpointAccess(built.units, built.layout, RunRecord(model, built.optimizers, built.config),
                              homes=built.homes, residency=built.residency, failures=built.failures,
                              training=scheduler, partition=None)
    try:
        generator = torch.Generator().manual_seed(2)
        u = built.units[1]
        n = u.spec.trainable_numel
        saved = {"master": torch.randn(n, generator=generator), "exp_avg": torch.randn(n, generator=generator),
                 "exp_avg_sq": torch.rand(n, generator=generator)}

        def read(section: str, lo: int, hi: int, out: torch.Tensor) -> None:
            out.copy_(saved[section][lo:hi])

        access.begin_state_load("a test's load did not finish")
        with pytest.raises(EngineFailedError, match="a test's load did not finish"):
            built.failures.check("step")
        access.write_unit_state(u, read, steps=[7] * len(u.trainable))
        access.finish_state_load()
        built.failures.check("step")  # trains again
        master, exp_avg, exp_avg_sq = access.read_trainable_state(u, 0, n)
        for name, got in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            assert torch.equal(got, saved[name]), name
        assert u.steps == [7] * len(u.trainable)
        values = built.homes.unit_values(u, {})
        for e in u.trainable:  # fp32: the compute copy is the master
            assert torch.equal(values[e.offset].reshape(-1), saved["master"][e.offset:e.offset + e.numel]), e.fqn

        access.restore_training_counters({"micro_step": 4, "loss_scale": 1.0, "good_steps": 0,
                                          "last_grad_norm": 0.5}, saved_dtype="fp32")
        assert scheduler.micro_step == 4 and built.gradients.last_grad_norm == 0.5
        assert access.training_counters()["micro_step"] == 4
        access.check_allowed(saving=True)
        built.hand_gradients(_grads(model))
        with pytest.raises(ValueError, match="save_checkpoint: gradients of un-stepped micro-batch"):
            access.check_allowed(saving=True)
    finally:
        access.release_buffers()
        scheduler.shutdown_worker()
        built.close()
