"""Elementwise torch optimizers other than Adam, offloaded ([Note: elementwise optimizers] in
offload/optim/generic.py): each equals the same optimizer on an unwrapped copy of the model
bit for bit, with its state in the units' state homes, and what cannot be offloaded is
refused before anything is touched.

torch's CPU sqrt (MKL's vsSqrt) is not correctly rounded and rounds a slice otherwise than
the whole tensor now and then, so runs of optimizers that take a square root compare under
correctly_rounded_sqrt on both sides, as the Adam tests do ([Note: how exact the tests are]
in tests/test_optim_cpu_adam.py)."""
import copy
import math
import os

import pytest
import torch
from torch import nn

import offload
from offload.errors import CheckpointError
from offload.gpt import GPT

from support import CFG, CLIP_REL_TOL, batches, correctly_rounded_sqrt, gpt_loss, train_offload


@pytest.fixture
def swap_dir(tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    return str(d)


class Lion(torch.optim.Optimizer):
    """A user's optimizer (Lion, Chen et al. 2023): one state tensor, no scalars."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class HandAdamW(torch.optim.Optimizer):
    """A user's AdamW written out with the operations of torch's single-tensor AdamW, in its
    order: the engine runs it on the generic path, where torch.optim.AdamW takes the native
    kernel, and the two agree bit for bit (with correctly rounded sqrt)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                step_size = lr / bias_correction1
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-momentum-dampening-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "sgd-momentum-maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, maximize=True),
    "rmsprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, weight_decay=0.01),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True, alpha=0.9),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1, lr_decay=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01, momentum_decay=0.004),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.01),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "lion": lambda p: Lion(p, lr=1e-3, weight_decay=0.1),
}
STATE_SLOTS = {"sgd": 0, "sgd-momentum-nesterov-wd": 1, "sgd-momentum-dampening-wd": 1, "sgd-momentum-maximize": 1,
               "rmsprop-momentum": 2, "rmsprop-centered": 2, "adagrad": 1, "nadam": 2,
               "radam": 2, "adamax": 2, "lion": 1}
# Stepped by a native kernel ([Note: native elementwise kernels] in offload/optim/native_kernels.py);
# the rest (maximize among them) by the optimizer's own step.
NATIVE = {"sgd", "sgd-momentum-nesterov-wd", "sgd-momentum-dampening-wd", "adagrad", "rmsprop-momentum",
          "rmsprop-centered"}
TIERS = {"host": dict(param_tier="host", optimizer_tier="host"),
         "nvme": dict(param_tier="nvme", optimizer_tier="nvme", device_budget=140 * 1024 * 2),
         "auto": dict(param_tier="auto", optimizer_tier="auto", device_budget=140 * 1024 * 2)}


def halving_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))


def train_plain(model, opt, data, accumulation=1, max_grad_norm=None):
    schedule = halving_schedule(opt)
    for i, b in enumerate(data):
        (gpt_loss(model, b) / accumulation).backward()
        if (i + 1) % accumulation == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad()
            schedule.step()


def train_engine(engine, data, accumulation=1):
    schedule = halving_schedule(engine.optimizer)
    norms = []
    for i, b in enumerate(data):
        engine.backward(gpt_loss(engine, b))
        engine.step()
        if (i + 1) % accumulation == 0:
            schedule.step()
            norms.append(engine.stats()["grad_norm"])
    return norms


def assert_same(engine_state, model):
    expected = model.state_dict()
    assert engine_state.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(engine_state[k], v), (k, (engine_state[k] - v).abs().max().item())


@pytest.fixture
def native_steps(monkeypatch):
    """Counts the ranges the native SGD, Adagrad and RMSprop kernels step."""
    from offload.optim import native_kernels
    calls = []
    for name in ("sgd_step_flat", "adagrad_step_flat", "rmsprop_step_flat"):
        kernel = getattr(native_kernels, name)
        monkeypatch.setattr(native_kernels, name, lambda *a, _kernel=kernel, **kw: calls.append(1) or _kernel(*a, **kw))
    return calls


def gpt_pair():
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("tiers", ["host", "nvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_elementwise_optimizer_equals_plain_pytorch_bit_for_bit(name, tiers, tmp_path, native_steps):
    """The offloaded step runs the optimizer's own step() on views of the units' flat fp32
    master, gradients and state slots, or the native kernel where one is routed (NATIVE):
    the same numbers as plain PyTorch on an unwrapped copy, with an LR scheduler changing
    the rate every step."""
    reference, model = gpt_pair()
    data = batches(4)
    with correctly_rounded_sqrt():
        train_plain(reference, OPTIMIZERS[name](reference.parameters()), data)
        config = dict(TIERS[tiers], swap_dir=str(tmp_path / "swap"))
        with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
            train_engine(engine, data)
            assert_same(engine.state_dict(), reference)
    assert bool(native_steps) == (name in NATIVE), len(native_steps)


@pytest.mark.parametrize("name", ["sgd-momentum-nesterov-wd", "nadam"])
def test_auto_placement_equals_plain_pytorch_bit_for_bit(name, tmp_path):
    reference, model = gpt_pair()
    data = batches(4)
    with correctly_rounded_sqrt():
        train_plain(reference, OPTIMIZERS[name](reference.parameters()), data)
        config = dict(TIERS["auto"], swap_dir=str(tmp_path / "swap"))
        with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
            train_engine(engine, data)
            assert_same(engine.state_dict(), reference)


@pytest.mark.parametrize("name", ["sgd-momentum-nesterov-wd", "nadam", "lion"])
def test_accumulation_equals_plain_pytorch_bit_for_bit(name, tmp_path):
    reference, model = gpt_pair()
    data = batches(6)
    with correctly_rounded_sqrt():
        train_plain(reference, OPTIMIZERS[name](reference.parameters()), data, accumulation=3)
        config = dict(TIERS["nvme"], swap_dir=str(tmp_path / "swap"), gradient_accumulation_steps=3)
        with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
            train_engine(engine, data, accumulation=3)
            assert_same(engine.state_dict(), reference)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_generic_path_equals_the_native_adam_kernel(dtype, max_grad_norm, tmp_path):
    """HandAdamW runs on the generic path, torch.optim.AdamW on the native kernel; the
    two engines agree bit for bit in fp32 and bf16 (the master, the 16-bit compute copy
    rounded from it, the gradients' factor), with clipping that triggers on every step."""
    results = []
    for make in (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=False),
                 lambda p: HandAdamW(p, lr=0.01, weight_decay=0.1)):
        _, model = gpt_pair()
        config = dict(TIERS["nvme"], swap_dir=str(tmp_path / str(len(results))), dtype=dtype,
                      max_grad_norm=max_grad_norm)
        with correctly_rounded_sqrt(), offload.wrap(model, make(model.parameters()), config=config) as engine:
            norms = train_engine(engine, batches(4))
            results.append((engine.state_dict(), norms))
    (native, native_norms), (generic, generic_norms) = results
    assert native_norms == generic_norms
    if max_grad_norm is not None:
        assert min(native_norms) > max_grad_norm  # clipped on every step
    for k in native:
        assert torch.equal(native[k], generic[k]), k


@pytest.mark.parametrize("name", ["sgd-momentum-nesterov-wd", "adagrad"])
def test_clipping_that_triggers_matches_plain_pytorch(name, tmp_path):
    """Clipped against torch's clip_grad_norm_: the coefficients differ in their last bits
    (CLIP_REL_TOL in tests/support.py says why), so the bound is CLIP_REL_TOL; the same
    coefficient gives the same numbers (test_generic_path_equals_the_native_adam_kernel)."""
    reference, model = gpt_pair()
    data = batches(4)
    max_grad_norm = 0.5
    with correctly_rounded_sqrt():
        train_plain(reference, OPTIMIZERS[name](reference.parameters()), data, max_grad_norm=max_grad_norm)
        config = dict(TIERS["host"], max_grad_norm=max_grad_norm)
        with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
            norms = train_engine(engine, data)
            got = engine.state_dict()
    assert min(norms) > max_grad_norm
    for k, v in reference.state_dict().items():
        assert torch.allclose(got[k], v, rtol=CLIP_REL_TOL, atol=1e-7), k


class Branchy(nn.Module):
    """Blocks of which one (``side``) gets a gradient only when asked, and a frozen one."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.side = nn.ModuleList([nn.Linear(16, 16)])
        self.frozen = nn.ModuleList([nn.Linear(16, 16)])
        self.frozen.requires_grad_(False)

    def forward(self, x, use_side=False):
        x = self.frozen[0](x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        if use_side:
            x = x + self.side[0](x)
        return x.square().mean()


@pytest.mark.filterwarnings("ignore:offload. execution left the recorded unit trace")
@pytest.mark.parametrize("name", ["sgd-momentum-nesterov-wd", "nadam", "adagrad"])
def test_a_parameter_without_gradient_is_left_alone_and_frozen_ones_stay(name, tmp_path):
    """A parameter that got no gradient in a step is skipped as torch skips it (no decay,
    no state update, its step count unchanged); frozen parameters are not the optimizer's."""
    torch.manual_seed(0)
    reference = Branchy()
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 16, generator=g), use) for use in (True, False, False, True, False)]
    with correctly_rounded_sqrt():
        opt = OPTIMIZERS[name]([p for p in reference.parameters() if p.requires_grad])
        for x, use in data:
            reference(x, use).backward()
            opt.step()
            opt.zero_grad()
        config = dict(TIERS["nvme"], swap_dir=str(tmp_path / "swap"), device_budget=None)
        with offload.wrap(model, OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad]),
                          config=config) as engine:
            for x, use in data:
                engine.backward(engine(x, use))
                engine.step()
            assert_same(engine.state_dict(), reference)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("name", ["nadam", "sgd-momentum-nesterov-wd"])
def test_checkpoint_resume_is_bit_for_bit(name, tmp_path):
    """The state slots and the scalars (NAdam's step and mu_product) go into the
    checkpoint; a fresh engine that loads it goes on as the run that never stopped."""
    reference, model = gpt_pair()
    other = copy.deepcopy(model)
    data = batches(6)
    config = dict(TIERS["nvme"], swap_dir=str(tmp_path / "swap"))
    with correctly_rounded_sqrt():
        train_plain(reference, OPTIMIZERS[name](reference.parameters()), data)
        with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
            schedule = halving_schedule(engine.optimizer)
            for b in data[:3]:
                engine.backward(gpt_loss(engine, b))
                engine.step()
                schedule.step()
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        with offload.wrap(other, OPTIMIZERS[name](other.parameters()), config=config) as engine:
            schedule = halving_schedule(engine.optimizer)
            engine.load_checkpoint(str(tmp_path / "ckpt"))
            for _ in range(3):
                schedule.step()  # the scheduler is the user's: it goes on where it was
            for b in data[3:]:
                engine.backward(gpt_loss(engine, b))
                engine.step()
                schedule.step()
            assert_same(engine.state_dict(), reference)


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    model, other = gpt_pair()
    third = copy.deepcopy(model)
    config = dict(TIERS["host"], swap_dir=str(tmp_path / "swap"))
    with offload.wrap(model, OPTIMIZERS["nadam"](model.parameters()), config=config) as engine:
        train_offload(engine, batches(1))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    with offload.wrap(other, OPTIMIZERS["adamax"](other.parameters()), config=config) as engine:
        with pytest.raises(CheckpointError, match="NAdam's \\(exp_avg, exp_avg_sq\\).*Adamax's \\(exp_avg, exp_inf\\)"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
    with offload.wrap(third, torch.optim.AdamW(third.parameters()), config=config) as engine:
        with pytest.raises(CheckpointError, match="NAdam's.*Adam's"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))


def test_state_carried_from_the_optimizer_goes_on(tmp_path):
    """An optimizer that has taken steps (its momentum buffers, NAdam's mu_product) is
    wrapped where it stands."""
    reference, model = gpt_pair()
    data = batches(4)
    with correctly_rounded_sqrt():
        opt = OPTIMIZERS["nadam"](reference.parameters())
        for b in data:
            gpt_loss(reference, b).backward()
            opt.step()
            opt.zero_grad()
        opt = OPTIMIZERS["nadam"](model.parameters())
        for b in data[:2]:
            gpt_loss(model, b).backward()
            opt.step()
            opt.zero_grad()
        with offload.wrap(model, opt, config=TIERS["host"]) as engine:
            train_offload(engine, data[2:])
            assert_same(engine.state_dict(), reference)


class ListState(torch.optim.Optimizer):
    """Keeps a Python list per parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("history", []).append(1)
                    p.add_(p.grad, alpha=-group["lr"])


# Optimizers that are not elementwise (Muon, Adafactor, a norm over the parameter) step whole
# parameters: tests/test_optim_lists.py.
@pytest.mark.parametrize("make,match", [
    (lambda p: torch.optim.LBFGS(p), "LBFGS cannot be offloaded: its step\\(\\) needs a closure"),
    (lambda p: torch.optim.SparseAdam(p), "SparseAdam cannot be offloaded: it needs sparse gradients"),
    (lambda p: ListState(p), "ListState cannot be offloaded: its state 'history' is list"),
    (lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.9), "RMSprop cannot be offloaded: it keeps 3 tensors"),
], ids=["lbfgs", "sparseadam", "list-state", "three-slots"])
def test_what_cannot_be_offloaded_is_refused_before_anything_is_touched(make, match, swap_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    before = copy.deepcopy(model.state_dict())
    opt = make(list(model.parameters()))
    with pytest.raises(ValueError, match=match):
        offload.wrap(model, opt, config=dict(TIERS["nvme"], swap_dir=swap_dir))
    assert os.listdir(swap_dir) == []
    assert len(opt.state) == 0  # the probe stepped copies, never the user's optimizer
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_an_optimizer_holding_state_of_a_meta_model_is_refused_naming_why(tmp_path):
    """Adagrad makes its state in its constructor; over a meta model that state is meta,
    without values to carry into the homes: a ValueError naming the class and the reason
    (not the probe's step failing on mixed devices), no file created. With the model on the
    CPU it wraps."""
    with torch.device("meta"):
        model = GPT(CFG)
    swap = tmp_path / "swap"
    swap.mkdir()
    config = dict(TIERS["nvme"], swap_dir=str(swap))
    with pytest.raises(ValueError, match="Adagrad cannot be offloaded: it holds state on the meta device"):
        offload.wrap(model, torch.optim.Adagrad(model.parameters(), lr=0.01), config=config)
    assert os.listdir(swap) == []
    model = GPT(CFG)
    with offload.wrap(model, torch.optim.Adagrad(model.parameters(), lr=0.01), config=config):
        pass


@pytest.mark.parametrize("tiers", ["host", "nvme"])
@pytest.mark.parametrize("name", ["sgd", "sgd-momentum-nesterov-wd", "nadam"])
def test_state_bytes_on_each_tier_are_what_the_planner_predicts(name, tiers, tmp_path):
    """Each optimizer's state takes its own bytes per parameter at home (0 for plain SGD, 4
    with momentum, 8 for NAdam as for Adam), and wrap's tiers hold what the planner
    (offload.plan.place, the budget arithmetic) predicts for that many state tensors."""
    import dataclasses

    from offload.memory.budget import host_bytes, model_unit_sizes, swap_bytes
    from offload.memory.layout import Layout
    from offload.config import OffloadConfig
    from offload.plan import optimizer_state_name, place, shape_from_module

    slots = STATE_SLOTS[name]
    config = dict(TIERS[tiers], swap_dir=str(tmp_path / "swap"), device_budget=None)
    _, model = gpt_pair()
    with torch.device("meta"):
        sizes = [dataclasses.replace(s, state_slots=slots) for s in model_unit_sizes(GPT(CFG), 4)]
        planned = place(shape_from_module(GPT(CFG), "gpt"), "fp32", *tiers.split() * 2, state_slots=slots)
    layout = Layout.resolve(OffloadConfig(device="cpu", **config), torch.device("cpu"), None)
    trainable_numel = sum(s.state_numel for s in sizes if s.trainable)
    with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
        train_offload(engine, batches(1))
        stats = engine.stats()
    # fp32: the compute copy is the master, so the optimizer's own state is all there is
    assert stats["optimizer_state_bytes"] == slots * 4 * trainable_numel == planned.state_bytes[optimizer_state_name(slots)]
    assert stats["nvme_bytes"] == swap_bytes(sizes, layout) == planned.nvme_bytes
    assert stats["host_bytes"] <= host_bytes(sizes, layout).total == planned.host_bytes
    on_tier = stats[f"home_bytes_{tiers}"]
    assert on_tier == planned.state_bytes["compute copy"] + slots * 4 * trainable_numel


# ---------------------------------------------------------------------------- modes
# The small GPT's norms over six steps: 9.6, 9.6, 7.7, 5.9, 5.0, 3.9 (test_optim_speculative)
MIXED_NORM = 6.0
NEVER_CLIPS = 1e9


def run_modes(tmp_path, label, name, data, settle_backward=False, **kw):
    """The small GPT with ``OPTIMIZERS[name]`` and the config's tiers on NVMe plus ``kw``:
    (state_dict, stats). ``settle_backward``: every speculative update runs before step()."""
    _, model = gpt_pair()
    config = dict(TIERS["nvme"], swap_dir=str(tmp_path / label), **kw)
    with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
        for b in data:
            engine.backward(gpt_loss(engine, b))
            if settle_backward:
                engine.debug.updates.wait_optimizer()
            engine.step()
        return engine.state_dict(), engine.stats()


def assert_same_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("clip", ["never", "mixed"])
@pytest.mark.parametrize("name", ["sgd-momentum-nesterov-wd", "nadam"])
def test_speculative_updates_equal_the_serialized_step_bit_for_bit(name, clip, tmp_path):
    """Speculative updates write the spare homes out of place (the slots copied, then
    stepped there) and carry the scalars in the spare step counts; clipped steps redo their
    units. The numbers are the serialized run's."""
    data = batches(6)
    max_norm = NEVER_CLIPS if clip == "never" else MIXED_NORM
    with correctly_rounded_sqrt():
        on, on_stats = run_modes(tmp_path, "on", name, data, settle_backward=True, max_grad_norm=max_norm,
                                 speculative_updates=True)
        off, off_stats = run_modes(tmp_path, "off", name, data, max_grad_norm=max_norm, speculative_updates=False)
    assert_same_states(on, off)
    assert on_stats["speculative_updates"] > 0 and off_stats["speculative_updates"] == 0
    assert (on_stats["redone_updates"] > 0) == (clip == "mixed")


@pytest.mark.parametrize("name", ["sgd-momentum-nesterov-wd", "nadam"])
def test_early_and_deferred_updates_equal_updates_inside_step_bit_for_bit(name, tmp_path):
    """Early updates (in backward, no clipping) and deferred ones (past step(), with
    clipping) give the numbers of updates run inside step()."""
    data = batches(5)
    with correctly_rounded_sqrt():
        early, early_stats = run_modes(tmp_path, "early", name, data)
        inside, inside_stats = run_modes(tmp_path, "inside", name, data, max_grad_norm=NEVER_CLIPS,
                                         speculative_updates=False, overlap_step_with_forward=False)
        deferred, deferred_stats = run_modes(tmp_path, "deferred", name, data, max_grad_norm=NEVER_CLIPS,
                                             speculative_updates=False)
    assert early_stats["early_updates"] > 0
    assert deferred_stats["deferred_updates"] > 0
    assert inside_stats["early_updates"] == inside_stats["deferred_updates"] == 0
    assert_same_states(early, inside)
    assert_same_states(deferred, inside)


def test_gradient_spill_equals_the_unspilled_run_bit_for_bit(tmp_path):
    from offload.memory.budget import UnitSizes, minimum_host_budget

    name = "nadam"
    _, model = gpt_pair()
    with offload.wrap(model, OPTIMIZERS[name](model.parameters()),
                      config=dict(TIERS["nvme"], swap_dir=str(tmp_path / "probe"))) as engine:
        budget = minimum_host_budget([UnitSizes.of(u) for u in engine.units], engine.layout)
    data = batches(4)
    with correctly_rounded_sqrt():
        spilled, spilled_stats = run_modes(tmp_path, "spilled", name, data, host_budget=budget)
        plain, plain_stats = run_modes(tmp_path, "plain", name, data)
    assert spilled_stats["spilled_gradient_bytes"] > 0 and plain_stats["spilled_gradient_bytes"] == 0
    assert_same_states(spilled, plain)


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_delayed_updates_follow_a_plain_pytorch_reference_of_the_rule(tiers, tmp_path):
    """delayed_update: step k's update runs while step k+1's forward and backward use the
    weights from before it (after the warm-up). The reference applies that rule by hand to
    plain PyTorch with the same optimizer (tests/test_optim_delayed.py's, with SGD)."""
    name, warmup = "sgd-momentum-nesterov-wd", 1
    data = batches(5)
    master, lagging = gpt_pair()
    opt = OPTIMIZERS[name](master.parameters())
    for k, b in enumerate(data, start=1):
        gpt_loss(lagging, b).backward()
        before = {n: p.detach().clone() for n, p in master.named_parameters()}
        for p, q in zip(master.parameters(), lagging.parameters()):
            p.grad = q.grad
        opt.step()
        opt.zero_grad()
        lagging.zero_grad()
        with torch.no_grad():
            for n, q in lagging.named_parameters():
                q.copy_(before[n] if k > warmup else master.get_parameter(n))
    _, model = gpt_pair()
    config = dict(TIERS[tiers], swap_dir=str(tmp_path / "swap"), delayed_update=True,
                  delayed_update_warmup_steps=warmup)
    with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
        for b in data:
            engine.backward(gpt_loss(engine, b))
            engine.step()
        got, stats = engine.state_dict(), engine.stats()
    assert stats["delayed_updates"] == len(data) - warmup
    assert_same(got, master)


# ---------------------------------------------------------------------------- ZeRO
def _zero_worker(rank, port, config, data, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        result = {}
        torch.manual_seed(0)
        model = GPT(CFG)
        try:
            refused = offload.wrap(model, OPTIMIZERS["nadam"](model.parameters()), config=dict(config, stage=1))
            refused.close()
            result["stage1"] = None
        except ValueError as error:
            result["stage1"] = str(error)
        torch.manual_seed(0)
        model = GPT(CFG)
        per_rank = data[0].shape[0] // 2
        with correctly_rounded_sqrt(), \
                offload.wrap(model, OPTIMIZERS["nadam"](model.parameters()), config=dict(config, stage=0)) as engine:
            for b in data:
                mine = b[rank * per_rank:(rank + 1) * per_rank]
                engine.backward(gpt_loss(engine, mine))
                engine.step()
            result["state"] = engine.state_dict()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_stage_0_train_as_one_process_and_sharded_stages_are_refused(tmp_path):
    """ZeRO stage 0 (every rank keeps its whole state) runs the generic path: two gloo ranks
    on half batches agree with each other bit for bit and with plain PyTorch on the whole
    batch within REL_TOL (the all-reduced mean rounds otherwise than one backward). Stages
    1-3 shard Adam's two moments only: refused naming the stage and the optimizer."""
    import torch.multiprocessing as mp

    from support import REL_TOL, free_port

    data = batches(4, batch=4)
    reference, _ = gpt_pair()
    opt = OPTIMIZERS["nadam"](reference.parameters())
    with correctly_rounded_sqrt():
        for b in data:
            gpt_loss(reference, b).backward()
            opt.step()
            opt.zero_grad()
    mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "offload"])
    mp.start_processes(_zero_worker, args=(free_port(), dict(TIERS["host"]), data, str(tmp_path)), nprocs=2,
                       join=True, start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in results:
        assert r["stage1"] is not None and "stage: ZeRO stage 1" in r["stage1"] and "NAdam" in r["stage1"]
    assert_same_states(results[0]["state"], results[1]["state"])
    for k, v in reference.state_dict().items():
        got = results[0]["state"][k]
        assert ((got - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() < REL_TOL, k


def test_offload_plan_counts_the_optimizers_state_tensors(tmp_path, capsys):
    """`offload plan --optimizer-state-tensors K`: K x 4 bytes per parameter on the
    optimizer's tier, in the table, the JSON and the auto placement."""
    import json

    from offload.cli import main

    plans = {}
    for k in (0, 1, 2):
        out = tmp_path / f"plan{k}.json"
        main(["plan", "--params", "1e8", "--dtype", "fp32", "--optimizer-state-tensors", str(k), "--json", str(out)])
        text = capsys.readouterr().out
        assert f"{4 * k} B/param" in text
        plans[k] = json.loads(out.read_text())
    n = plans[2]["num_trainable"]
    for k, p in plans.items():
        by_tier = {(c["param_tier"], c["optimizer_tier"]): c for c in p["configurations"]}
        nvme = by_tier[("nvme", "nvme")]
        name = "Adam moments" if k == 2 else f"optimizer state ({k} x fp32)"  # the names users read
        assert p["bytes_per_param"][name] == 4 * k
        assert n * 4 * k <= nvme["state_bytes"][name] <= n * 4 * k + 4096 * k * 64  # page padding per unit
        assert nvme["nvme_bytes"] - plans[0]["configurations"][list(by_tier).index(("nvme", "nvme"))]["nvme_bytes"] \
            == nvme["state_bytes"][name]


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_a_checkpoint_in_a_delayed_run_resumes_bit_for_bit(tiers, tmp_path):
    """Saved while a delayed update is pending (bf16: the lagging compute copy is not the
    rounded master), NAdam's slots and scalars included: the resumed run is the
    uninterrupted one to the bit."""
    import json

    data, cut = batches(6), 3

    def cfg(label):
        return dict(TIERS[tiers], swap_dir=str(tmp_path / label), dtype="bf16", delayed_update=True,
                    delayed_update_warmup_steps=1)

    with correctly_rounded_sqrt():
        _, model = gpt_pair()
        with offload.wrap(model, OPTIMIZERS["nadam"](model.parameters()), config=cfg("whole")) as engine:
            whole_losses = train_offload(engine, data)
            whole = engine.state_dict()
        _, model = gpt_pair()
        with offload.wrap(model, OPTIMIZERS["nadam"](model.parameters()), config=cfg("saver")) as engine:
            losses = train_offload(engine, data[:cut])
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
        assert any(u.get("delayed_pending") for u in manifest["units"])
        assert all("mu_product" in e["optimizer_scalars"] for u in manifest["units"] for e in u["entries"]
                   if e["trainable"])
        torch.manual_seed(1)  # other initial weights: the load replaces them
        model = GPT(CFG)
        with offload.wrap(model, OPTIMIZERS["nadam"](model.parameters()), config=cfg("resumed")) as engine:
            engine.load_checkpoint(str(tmp_path / "ckpt"))
            losses += train_offload(engine, data[cut:])
            resumed = engine.state_dict()
    assert losses == whole_losses
    assert_same_states(resumed, whole)
