"""offload.faults: armed points fire at the hit asked for, and every point is reached."""
import contextlib
import errno

import pytest
import torch

import offload
import offload.faults
from offload.gpt import GPT, GPTConfig

from support import FaultyIO, gpt_loss


def test_an_unknown_or_doubly_armed_point_is_refused():
    with pytest.raises(ValueError, match="unknown fault point 'optim.adamw'"):
        with offload.faults.inject("optim.adamw", offload.faults.raising(RuntimeError)):
            pass
    with pytest.raises(ValueError, match="at must be a positive int"):
        with offload.faults.inject("optim.adam", offload.faults.raising(RuntimeError), at=0):
            pass
    with offload.faults.inject("optim.adam", offload.faults.raising(RuntimeError)):
        with pytest.raises(ValueError, match="already armed"):
            with offload.faults.inject("optim.adam", offload.faults.raising(RuntimeError)):
                pass
    offload.faults.hit("optim.adam")  # disarmed on leaving the block: nothing happens


def test_an_armed_point_fires_at_its_hit_and_only_while_armed():
    seen = []
    with offload.faults.inject("optim.adam", lambda **context: seen.append(context), at=2) as point:
        for k in range(4):
            offload.faults.hit("optim.adam", k=k)
    assert seen == [{"k": 1}] and point.hits == 4 and point.fired == 1
    with offload.faults.inject("nvme.io_engine", lambda value: value + 1) as point:
        assert offload.faults.passing("nvme.io_engine", 1) == 2
    assert offload.faults.passing("nvme.io_engine", 1) == 1 and point.fired == 1


def test_every_point_is_reached_by_a_wrap_and_a_step(tmp_path):
    """A point no run reaches would make the tests that arm it pass without injecting
    anything: wrapping with everything on NVMe and one step reaches each point of the
    engine (those of the checkpoint code are reached by its own harness)."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    names = [n for n in offload.faults.points() if not n.startswith("checkpoint.")]
    armed = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            action = (lambda io: FaultyIO(io, errno.EIO)) if name == "nvme.io_engine" else (lambda **context: None)
            armed[name] = stack.enter_context(offload.faults.inject(name, action))
        with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=dict(
                param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path), device_budget=100_000)) as engine:
            batch = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
            engine.backward(gpt_loss(engine, batch))
            engine.step()
            engine.state_dict()
    assert {n: a.hits for n, a in armed.items() if a.hits == 0} == {}
