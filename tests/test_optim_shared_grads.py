"""[Note: shared parameter gradients] A parameter used in several module slots (a head tied
to the embedding) hands its gradient off use by use: the sum is autograd's to the bit, held
by the host tier, and autograd's out-of-place sum (a third whole gradient) is gone."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import offload
from offload.gpt import GPT
from offload.optim.gradients import Gradients

from support import CFG, assert_same_state, batches, gpt_loss, make_opt, train_gpt


@pytest.fixture
def autograd_sums(monkeypatch):
    """The engine as it was before: autograd adds the uses' gradients itself."""
    def off():
        monkeypatch.setattr(Gradients, "sums_shared_uses", property(lambda self: False))
    return off


CASES = {
    "fp32-host": dict(param_tier="host", optimizer_tier="host"),
    "bf16-nvme": dict(param_tier="nvme", optimizer_tier="nvme", dtype="bf16"),
    "fp32-nvme-clip-accumulate": dict(param_tier="nvme", optimizer_tier="nvme", max_grad_norm=0.05,
                                      gradient_accumulation_steps=2),
    "fp16-host": dict(param_tier="host", optimizer_tier="host", dtype="fp16"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_tied_head_trains_bit_for_bit_as_when_autograd_sums(case, autograd_sums, tmp_path):
    config = dict(CASES[case], device="cpu", swap_dir=str(tmp_path / "a"))
    data = batches(6)
    losses, state, _, norms = train_gpt(config, data)
    autograd_sums()
    ref_losses, ref_state, _, ref_norms = train_gpt(dict(config, swap_dir=str(tmp_path / "b")), data)
    assert losses == ref_losses and norms == ref_norms
    assert_same_state(state, ref_state)


class ThreeUses(nn.Module):
    """One weight in three module slots: the embedding, a head and a second head used on
    another activation, so that three gradients of it meet in backward."""

    def __init__(self, vocab=48, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.head = nn.Linear(d, vocab, bias=False)
        self.aux = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.aux.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        mid = torch.tanh(self.blocks[0](h))
        out = torch.tanh(self.blocks[1](mid))
        return self.head(out) + self.aux(mid * 0.5)


def train_three_uses(config, steps=4):
    torch.manual_seed(0)
    model = ThreeUses()
    g = torch.Generator().manual_seed(3)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for _ in range(steps):
            x = torch.randint(0, 48, (4, 8), generator=g)
            loss = nn.functional.cross_entropy(engine(x).reshape(-1, 48), x.reshape(-1))
            engine.backward(loss)
            engine.step()
        return engine.state_dict(), engine.stats()["grad_norm"]


def test_three_uses_sum_in_autograd_order(autograd_sums):
    config = dict(param_tier="host", optimizer_tier="host", device="cpu")
    state, norm = train_three_uses(config)
    autograd_sums()
    ref_state, ref_norm = train_three_uses(config)
    assert norm == ref_norm
    assert_same_state(state, ref_state)


def test_plain_pytorch_sees_its_own_gradient_after_backward():
    # The aliases exist only while a slot's forward runs: afterwards the model's modules
    # hold the one parameter again, and the engine's parameters are the model's.
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=dict(param_tier="host", optimizer_tier="host",
                                                                     device="cpu")) as engine:
        engine.backward(gpt_loss(engine, batches(1)[0]))
        assert model.head.weight is model.wte.weight
        assert model.wte.weight.grad is None
        engine.step()
        assert model.head.weight is model.wte.weight


@pytest.mark.host_device
def test_a_failed_backward_drops_the_held_head_gradient():
    # The head's gradient is held from the start of backward; a backward that fails later
    # (at the last block's, before any update) drops it with the rest, as zero_grad does:
    # the host tier is back where it was, and training goes on as if the batch never came.
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(param_tier="host", optimizer_tier="host", device="cpu")
    data = batches(3)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        before = engine.stats()["host_bytes"]
        loss = gpt_loss(engine, data[0])
        with offload.faults.inject("hooks.backward", offload.faults.raising(RuntimeError("injected")), at=1):
            with pytest.raises(RuntimeError, match="injected"):
                engine.backward(loss)
            held = engine.stats()["host_peak_bytes"] - before
        assert held >= model.wte.weight.numel() * 4  # the head's gradient was held
        assert engine.stats()["host_bytes"] == before
        for b in data[1:]:
            engine.backward(gpt_loss(engine, b))
            engine.step()
        state = engine.state_dict()
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for b in data[1:]:
            engine.backward(gpt_loss(engine, b))
            engine.step()
        assert_same_state(state, engine.state_dict())


RSS_SCRIPT = """
import json, re, sys
import torch
import offload
from offload.gpt import GPT, GPTConfig
from offload.optim.gradients import Gradients
torch.set_num_threads(1)
if sys.argv[1] == "autograd":
    Gradients.sums_shared_uses = property(lambda self: False)
cfg = GPTConfig(vocab_size=65536, seq_len=16, d_model=1024, num_heads=8, num_layers=1)
with torch.device("meta"):
    model = GPT(cfg)
g = torch.Generator().manual_seed(1)
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
def now():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
config = dict(param_tier="host", optimizer_tier="host", device="cpu")
with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config) as engine:
    for i in range(3):
        if i == 2:  # the peak of a step in steady state, from the RSS at its start
            open("/proc/self/clear_refs", "w").write("5")
            start = now()
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).reshape(-1, cfg.vocab_size), x.reshape(-1))
        engine.backward(loss)
        engine.step()
print(json.dumps(dict(growth=peak() - start, grad=cfg.vocab_size * cfg.d_model * 4)))
"""


def step_growth(mode):
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, mode], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.host_device
def test_a_step_holds_one_tied_gradient_less_than_when_autograd_sums():
    # A 65536 x 1024 tied embedding (268 MB of fp32 gradient) and one small block: over a
    # steady step the RSS grows by about two of its gradients (the head's, held, and the
    # embedding's, added into it), not three (autograd's sum is a new tensor). Measured alone:
    # 2.05-2.14 against 3.02-3.20 gradients; under a loaded full suite once 2.19 against
    # 2.92 (the allocator's timing of returning freed pages), hence half a gradient here.
    ours, theirs = step_growth("engine"), step_growth("autograd")
    grad = ours["grad"]
    assert theirs["growth"] - ours["growth"] >= 0.5 * grad, (ours, theirs)
    assert ours["growth"] <= 2.5 * grad, ours
