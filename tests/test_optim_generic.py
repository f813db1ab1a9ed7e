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
    "rmsprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, weight_decay=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1, lr_decay=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01, momentum_decay=0.004),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.01),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "lion": lambda p: Lion(p, lr=1e-3, weight_decay=0.1),
}
STATE_SLOTS = {"sgd": 0, "sgd-momentum-nesterov-wd": 1, "rmsprop-momentum": 2, "adagrad": 1, "nadam": 2,
               "radam": 2, "adamax": 2, "lion": 1}
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


def gpt_pair():
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("tiers", ["host", "nvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_elementwise_optimizer_equals_plain_pytorch_bit_for_bit(name, tiers, tmp_path):
    """The offloaded step runs the optimizer's own step() on views of the units' flat fp32
    master, gradients and state slots: the same numbers as plain PyTorch on an unwrapped
    copy, with an LR scheduler changing the rate every step."""
    reference, model = gpt_pair()
    data = batches(4)
    with correctly_rounded_sqrt():
        train_plain(reference, OPTIMIZERS[name](reference.parameters()), data)
        config = dict(TIERS[tiers], swap_dir=str(tmp_path / "swap"))
        with offload.wrap(model, OPTIMIZERS[name](model.parameters()), config=config) as engine:
            train_engine(engine, data)
            assert_same(engine.state_dict(), reference)


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


class NormScaled(torch.optim.Optimizer):
    """Scales each update by the parameter's norm: not elementwise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * p.norm(), alpha=-group["lr"])


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


@pytest.mark.parametrize("make,match", [
    (lambda p: torch.optim.LBFGS(p), "LBFGS cannot be offloaded: its step\\(\\) needs a closure"),
    (lambda p: torch.optim.SparseAdam(p), "SparseAdam cannot be offloaded: it needs sparse gradients"),
    (lambda p: torch.optim.Adafactor(p), "Adafactor cannot be offloaded: its state 'row_var'"),
    (lambda p: torch.optim.Muon([q for q in p if q.dim() == 2]), "Muon cannot be offloaded"),
    (lambda p: NormScaled(p), "NormScaled cannot be offloaded: it is not elementwise"),
    (lambda p: ListState(p), "ListState cannot be offloaded: its state 'history' is list"),
    (lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.9), "RMSprop cannot be offloaded: it keeps 3 tensors"),
], ids=["lbfgs", "sparseadam", "adafactor", "muon", "not-elementwise", "list-state", "three-slots"])
def test_what_cannot_be_offloaded_is_refused_before_anything_is_touched(make, match, swap_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    before = copy.deepcopy(model.state_dict())
    opt = make(list(model.parameters()))
    with pytest.raises(ValueError, match=match):
        offload.wrap(model, opt, config=dict(TIERS["nvme"], swap_dir=swap_dir))
    assert os.listdir(swap_dir) == []
    assert not opt.state or all(not isinstance(p, torch.Tensor) or p.numel() for p in opt.state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
