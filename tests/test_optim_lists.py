"""Several optimizers over one model ([Note: several optimizers] in offload/optim/several.py):
``wrap(model, [opt_a, opt_b])`` runs each optimizer's own rule on its own parameters, bit for
bit what the same optimizers compute in plain PyTorch, with each user's scheduler changing
the engine's rates, checkpoints that resume bit for bit, and refusals before anything is
touched."""
import copy
import os

import pytest
import torch

import offload
from offload.errors import CheckpointError
from offload.gpt import GPT

from support import CFG, batches, correctly_rounded_sqrt, gpt_loss, train_offload

TIERS = {"host": dict(param_tier="host", optimizer_tier="host"),
         "nvme": dict(param_tier="nvme", optimizer_tier="nvme", device_budget=140 * 1024 * 2)}


def is_matrix(name, p):
    """Muon's users' split: the blocks' 2-D weights in one optimizer, the rest in another."""
    return p.dim() == 2 and name.startswith("blocks.")


def matrices_and_rest(model):
    named = list(model.named_parameters())
    return [p for n, p in named if is_matrix(n, p)], [(n, p) for n, p in named if not is_matrix(n, p)]


def adamw_two_groups(named):
    """AdamW with a decayed and an undecayed group: group indices inside one optimizer of the list."""
    return torch.optim.AdamW([{"params": [p for n, p in named if p.dim() == 2], "weight_decay": 0.1},
                              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-2, foreach=False)


PAIRS = {
    # (optimizer of the matrices, optimizer of the rest)
    "sgd-momentum+adamw": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False), adamw_two_groups),
    "sgd-momentum+rmsprop": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
                             lambda named: torch.optim.RMSprop([p for _, p in named], lr=0.01, momentum=0.5,
                                                               foreach=False)),
}


def make_optimizers(model, pair):
    matrices, rest = matrices_and_rest(model)
    make_a, make_b = PAIRS[pair]
    return [make_a(matrices), make_b(rest)]


def schedulers(opts):
    """A scheduler on each of the user's own optimizer objects, each its own schedule."""
    return [torch.optim.lr_scheduler.StepLR(opts[0], step_size=1, gamma=0.5),
            torch.optim.lr_scheduler.LambdaLR(opts[1], lambda i: 1.0 / (1 + i))]


def train_plain(model, opts, data):
    scheds = schedulers(opts)
    for b in data:
        gpt_loss(model, b).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for s in scheds:
            s.step()


def train_engine(engine, opts, data, scheds=None):
    scheds = schedulers(opts) if scheds is None else scheds
    for b in data:
        engine.backward(gpt_loss(engine, b))
        engine.step()
        for s in scheds:
            s.step()
    return scheds


def gpt_pair():
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, copy.deepcopy(model)


def assert_same(engine_state, model):
    expected = model.state_dict()
    assert engine_state.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(engine_state[k], v), (k, (engine_state[k] - v).abs().max().item())


@pytest.mark.parametrize("tiers", ["host", "nvme"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_list_of_optimizers_equals_plain_pytorch_bit_for_bit(pair, tiers, tmp_path):
    """Each optimizer of the list updates its own parameters by its own rule (AdamW on the
    native kernel, SGD and RMSprop by their own step()), and a scheduler on each user's
    optimizer object changes the engine's rates: the numbers of plain PyTorch with both."""
    reference, model = gpt_pair()
    data = batches(4)
    with correctly_rounded_sqrt():
        train_plain(reference, make_optimizers(reference, pair), data)
        opts = make_optimizers(model, pair)
        config = dict(TIERS[tiers], swap_dir=str(tmp_path / "swap"))
        with offload.wrap(model, opts, config=config) as engine:
            assert engine.optimizer == opts and engine.optimizers == opts
            train_engine(engine, opts, data)
            assert opts[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 4)
            assert_same(engine.state_dict(), reference)
            # the state lives in the engine's homes; each optimizer's state_dict has its groups
            for opt in opts:
                sd = opt.state_dict()
                assert sd["state"] == {} and len(sd["param_groups"]) == len(opt.param_groups)


def test_one_optimizer_in_a_list_is_the_same_as_the_optimizer(tmp_path):
    reference, model = gpt_pair()
    data = batches(3)
    config = dict(TIERS["host"], swap_dir=str(tmp_path / "swap"))
    with correctly_rounded_sqrt():
        with offload.wrap(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), config=config) as engine:
            expected = train_offload(engine, data)
            want = engine.state_dict()
        with offload.wrap(model, [torch.optim.AdamW(model.parameters(), lr=1e-2)], config=config) as engine:
            assert isinstance(engine.optimizer, list) and len(engine.optimizers) == 1
            assert train_offload(engine, data) == expected
            got = engine.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_checkpoint_resume_is_bit_for_bit(tmp_path):
    """Adam's moments, SGD's momentum buffers and the step counts of both optimizers go into
    the checkpoint; a fresh engine over fresh optimizers goes on as the run that never stopped.
    A checkpoint of other optimizers is refused."""
    pair = "sgd-momentum+adamw"
    reference, model = gpt_pair()
    other, third = copy.deepcopy(model), copy.deepcopy(model)
    data = batches(6)
    config = dict(TIERS["nvme"], swap_dir=str(tmp_path / "swap"))
    ckpt = str(tmp_path / "ckpt")
    with correctly_rounded_sqrt():
        train_plain(reference, make_optimizers(reference, pair), data)
        opts = make_optimizers(model, pair)
        with offload.wrap(model, opts, config=config) as engine:
            scheds = train_engine(engine, opts, data[:3])
            engine.save_checkpoint(ckpt)
            sched_states = [s.state_dict() for s in scheds]  # the schedulers are the user's to save
        opts = make_optimizers(other, pair)
        with offload.wrap(other, opts, config=config) as engine:
            scheds = schedulers(opts)
            engine.load_checkpoint(ckpt)  # each optimizer's param groups as they were saved
            for s, state in zip(scheds, sched_states):
                s.load_state_dict(state)
            train_engine(engine, opts, data[3:], scheds)
            assert_same(engine.state_dict(), reference)
        matrices, rest = matrices_and_rest(third)
        with offload.wrap(third, [torch.optim.Adagrad(matrices), adamw_two_groups(rest)], config=config) as engine:
            with pytest.raises(CheckpointError, match="SGD \\+ Adam's.*Adagrad \\+ Adam's"):
                engine.load_checkpoint(ckpt)


@pytest.mark.parametrize("make, match", [
    (lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.AdamW([m.wte.weight])],
     "parameter 'wte.weight' is in optimizer 0 \\(SGD\\) and in optimizer 1 \\(AdamW\\)"),
    (lambda m: [torch.optim.SGD(matrices_and_rest(m)[0], lr=0.1),
                torch.optim.AdamW([p for n, p in matrices_and_rest(m)[1] if n != "wpe.weight"])],
     "trainable parameter 'wpe.weight' is in none of the 2 optimizers"),
    (lambda m: [], "an empty list"),
    (lambda m: [torch.optim.SGD(m.parameters(), lr=0.1), "adamw"], "entry 1 of the list is a str"),
    (lambda m: [torch.optim.SGD(matrices_and_rest(m)[0], lr=0.1),
                torch.optim.LBFGS([p for _, p in matrices_and_rest(m)[1]])], "LBFGS cannot be offloaded"),
])
def test_a_list_that_does_not_partition_the_parameters_is_refused_before_anything_is_touched(make, match, tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    swap = tmp_path / "swap"
    swap.mkdir()
    with pytest.raises(ValueError, match=match):
        offload.wrap(model, make(model), config=dict(TIERS["nvme"], swap_dir=str(swap)))
    assert os.listdir(swap) == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the model is not taken: a valid list wraps it afterwards
    with offload.wrap(model, make_optimizers(model, "sgd-momentum+adamw"),
                      config=dict(TIERS["host"], swap_dir=str(swap))) as engine:
        train_offload(engine, batches(1))


class NormScaled(torch.optim.Optimizer):
    """A user's optimizer that scales each update by the parameter's norm: not elementwise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * p.norm(), alpha=-group["lr"])


# [Note: whole-parameter optimizers]: Muon on the blocks' matrices beside AdamW, Adafactor
# alone (factored row/col second moments of the matrices, a per-element variance of the rest),
# and a user's optimizer that is not elementwise.
WHOLE = {
    "norm-scaled": lambda m: [NormScaled(m.parameters(), lr=0.01)],
    "muon+adamw": lambda m: [torch.optim.Muon(matrices_and_rest(m)[0], lr=0.02, weight_decay=0.1),
                             adamw_two_groups(matrices_and_rest(m)[1])],
    "adafactor": lambda m: [torch.optim.Adafactor(m.parameters(), lr=0.01, weight_decay=0.01, foreach=False)],
}


def train_plain_whole(model, opts, data):
    for b in data:
        gpt_loss(model, b).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("tiers", ["host", "nvme", "nvme-small-pieces"])
@pytest.mark.parametrize("name", list(WHOLE))
def test_whole_parameter_optimizers_equal_plain_pytorch_bit_for_bit(name, tiers, tmp_path, monkeypatch):
    """Muon's Newton-Schulz and Adafactor's factored moments see each parameter whole (its
    unit is updated as one piece, even where the staged step's pieces are smaller than a
    parameter), their per-element state lives in the state homes and the factored rows and
    columns beside the step counts: plain PyTorch's numbers."""
    if tiers == "nvme-small-pieces":  # pieces of 1024 elements would cut every matrix
        monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", 1024)
        tiers = "nvme"
    reference, model = gpt_pair()
    data = batches(4)
    with correctly_rounded_sqrt():
        train_plain_whole(reference, WHOLE[name](reference), data)
        opts = WHOLE[name](model)
        with offload.wrap(model, opts if len(opts) > 1 else opts[0],
                          config=dict(TIERS[tiers], swap_dir=str(tmp_path / "swap"))) as engine:
            train_offload(engine, data)
            assert_same(engine.state_dict(), reference)


@pytest.mark.parametrize("name", list(WHOLE))
def test_whole_parameter_optimizers_resume_from_a_checkpoint_bit_for_bit(name, tmp_path):
    """Muon's momentum buffers (state homes), Adafactor's step, row_var and col_var (kept per
    parameter) go into the checkpoint; a fresh engine goes on as the run that never stopped."""
    reference, model = gpt_pair()
    other = copy.deepcopy(model)
    data = batches(6)
    config = dict(TIERS["nvme"], swap_dir=str(tmp_path / "swap"))
    ckpt = str(tmp_path / "ckpt")
    with correctly_rounded_sqrt():
        train_plain_whole(reference, WHOLE[name](reference), data)
        opts = WHOLE[name](model)
        with offload.wrap(model, opts, config=config) as engine:
            train_offload(engine, data[:3])
            engine.save_checkpoint(ckpt)
        opts = WHOLE[name](other)
        with offload.wrap(other, opts, config=config) as engine:
            engine.load_checkpoint(ckpt)
            train_offload(engine, data[3:])
            assert_same(engine.state_dict(), reference)


def test_whole_parameter_optimizers_are_refused_with_delayed_updates(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    swap = tmp_path / "swap"
    swap.mkdir()
    with pytest.raises(ValueError, match="delayed_update: Muon steps whole parameters"):
        offload.wrap(model, WHOLE["muon+adamw"](model), config=dict(TIERS["nvme"], swap_dir=str(swap),
                                                                     delayed_update=True))
    assert os.listdir(swap) == []


def test_a_whole_parameter_optimizer_over_a_4d_parameter_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3))
    with pytest.raises(ValueError, match="NormScaled cannot be offloaded: param_groups\\[0\\] holds a 4-D parameter"):
        offload.wrap(model, NormScaled(model.parameters()), config=TIERS["host"])


def test_adafactor_factors_are_counted_in_host_ram(tmp_path):
    """Adafactor's row and column factors of each matrix (rows + cols float32 numbers) are
    kept per parameter in host RAM and counted in stats(); its vectors' variance is a slot of
    the state homes."""
    torch.manual_seed(0)
    model = GPT(CFG)
    factored = sum((p.shape[0] + p.shape[1]) * 4 for p in model.parameters() if p.dim() == 2)
    with offload.wrap(model, torch.optim.Adafactor(model.parameters(), lr=0.01),
                      config=dict(TIERS["host"], swap_dir=str(tmp_path / "swap"))) as engine:
        assert engine.stats()["optimizer_side_bytes"] == 0  # nothing before the first step
        train_offload(engine, batches(2))
        assert engine.stats()["optimizer_side_bytes"] == factored
        assert all(u.state_slots == 1 for u in engine.units)  # variance of the vectors


def run_whole_modes(tmp_path, label, name, data, settle_backward=False, **kw):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(TIERS["nvme"], swap_dir=str(tmp_path / label), **kw)
    with offload.wrap(model, WHOLE[name](model), config=config) as engine:
        for b in data:
            engine.backward(gpt_loss(engine, b))
            if settle_backward:
                engine.debug.updates.wait_optimizer()
            engine.step()
        return engine.state_dict(), engine.stats()


@pytest.mark.parametrize("name", ["muon+adamw", "adafactor"])
def test_speculative_updates_of_whole_parameter_optimizers_equal_the_serialized_step(name, tmp_path):
    """Speculative updates (clipping that triggers on some steps: those units are redone)
    step whole units out of place, the side state carried in the spare step counts: the
    serialized run's numbers."""
    data = batches(6)
    with correctly_rounded_sqrt():
        on, on_stats = run_whole_modes(tmp_path, "on", name, data, settle_backward=True, max_grad_norm=6.0,
                                       speculative_updates=True)
        off, off_stats = run_whole_modes(tmp_path, "off", name, data, max_grad_norm=6.0, speculative_updates=False)
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)
    assert on_stats["speculative_updates"] > 0 and on_stats["redone_updates"] > 0
    assert off_stats["speculative_updates"] == 0
