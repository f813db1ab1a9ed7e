"""The engine's lifecycle at its edges (issue 21 items 6, 8, 10): what wrap refuses before
touching anything, the optimizer state wrap carries over, close() releasing everything
whatever failed, and every verb after close()."""
import os

import pytest
import torch

import offload
import offload.faults
from offload.gpt import GPT

from support import CFG, batches, gpt_loss, make_opt


def nvme_config(tmp_path, **extra):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(swap), device_budget=140 * 1024, **extra)


def one_step(engine, b):
    engine.backward(gpt_loss(engine, b))
    engine.step()


# ---------------------------------------------------------------------- close()
def test_close_after_a_failed_deferred_update_releases_everything_then_reports(tmp_path):
    """Item 6: a deferred update ([Note: deferred updates]) fails after step() returned;
    close() must still stop the threads, remove the hooks, the swap files and the lock
    (the directory can be used again at once), and only then raise the failure."""
    config = nvme_config(tmp_path)
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    data = batches(2)
    one_step(engine, data[0])
    engine.zero_grad()
    failing = offload.faults.raising(RuntimeError("injected"))
    with offload.faults.inject("optim.deferred_update", failing, at=1) as point:
        engine.backward(gpt_loss(engine, data[1]))
        engine.step()  # returns with updates still queued on the worker
        with pytest.raises(RuntimeError, match="injected"):
            engine.close()
    assert point.fired == 1 and engine.stats()["deferred_updates"] > 0
    assert os.listdir(config["swap_dir"]) == [], "swap files and the lock are gone"
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    engine.close()  # idempotent: nothing is raised twice
    torch.manual_seed(0)
    again = GPT(CFG)
    with offload.wrap(again, make_opt(again.parameters()), config=config) as fresh:  # the directory is free
        one_step(fresh, data[0])


def test_every_verb_after_close_raises_one_clear_error(tmp_path):
    """Item 10: after close() every training verb raises RuntimeError saying the engine is
    closed, instead of returning silently (step, zero_grad, backward) or failing with
    AttributeError (state_dict)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()), config=nvme_config(tmp_path))
    b = batches(1)[0]
    loss = gpt_loss(engine, b)
    engine.close()
    verbs = {
        "forward": lambda: engine(b[:, :-1], b[:, 1:]),
        "backward": lambda: engine.backward(loss),
        "step": engine.step,
        "zero_grad": engine.zero_grad,
        "state_dict": engine.state_dict,
        "save_checkpoint": lambda: engine.save_checkpoint(str(tmp_path / "ckpt")),
        "load_checkpoint": lambda: engine.load_checkpoint(str(tmp_path / "ckpt")),
    }
    for name, verb in verbs.items():
        with pytest.raises(RuntimeError, match="closed") as info:
            verb()
        assert name in str(info.value), (name, str(info.value))
    assert not os.path.exists(tmp_path / "ckpt")
    assert engine.stats()["nvme_bytes"] == 0  # the counters stay readable
