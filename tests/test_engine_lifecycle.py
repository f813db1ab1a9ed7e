"""The engine's lifecycle at its edges (issue 21 items 6, 8, 10): what wrap refuses before
touching anything, the optimizer state wrap carries over, close() releasing everything
whatever failed, and every verb after close()."""
import copy
import os

import pytest
import torch
from torch import nn

import offload
import offload.faults
from offload.gpt import GPT

from support import (CFG, REL_TOL, batches, gpt_loss, make_opt, max_rel_error, reference_optimizer_step,
                     train_offload)


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


# ---------------------------------------------------------------------- refused wraps
class NoParameters(nn.Module):
    def forward(self, x):
        return x * 2


def test_a_model_without_parameters_is_refused_before_anything_is_touched(tmp_path):
    config = nvme_config(tmp_path)
    spare = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="NoParameters has no parameters"):
        offload.wrap(NoParameters(), torch.optim.AdamW(spare.parameters()), config=config)
    assert os.listdir(config["swap_dir"]) == []


def test_a_parameter_only_in_the_optimizer_is_refused_naming_it(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    stray = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [stray]}], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"not parameters of the model.*param group 1, shape \(3, 5\)"):
        offload.wrap(model, opt, config=nvme_config(tmp_path))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert os.listdir(tmp_path / "swap") == []


def test_a_gradient_from_before_wrap_in_another_dtype_is_refused_naming_it(tmp_path):
    """A float64 .grad left by .double() after a backward: autograd would have accumulated
    the first step's fp32 gradients into it (an internal assertion at the first backward,
    the device's accounting passed); now a ValueError at wrap naming the parameter, the
    model and the grads as they were. An fp32 .grad is added into the first step as plain
    PyTorch adds it (the bf16 engine accepts it)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    gpt_loss(model, batches(1)[0]).backward()
    model.double()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"^wte.weight: its .grad from before wrap is torch.float64.*"
                                         r"model.zero_grad\(set_to_none=True\)"):
        offload.wrap(model, make_opt(model.parameters()), config=nvme_config(tmp_path))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n][0]) and torch.equal(p.grad, before[n][1]), n
    assert os.listdir(tmp_path / "swap") == []
    model.float()  # fp32 grads again: wrap takes them, in bf16 too
    with offload.wrap(model, make_opt(model.parameters()), config=dict(nvme_config(tmp_path), dtype="bf16")) as engine:
        one_step(engine, batches(1)[0])


def test_a_model_wrapped_twice_is_refused_before_anything_is_touched(tmp_path):
    """Item 10: the second wrap of a model (or of one of its modules) while its engine is
    live says so instead of failing on empty parameters; after close() it wraps."""
    config = nvme_config(tmp_path)
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    with pytest.raises(ValueError, match="wrapped before, by a live engine"):
        offload.wrap(model, make_opt(model.parameters()), config=config)
    with pytest.raises(ValueError, match="module 'shared' of the model was wrapped before"):
        outer = nn.ModuleDict({"inner": nn.Linear(2, 2), "shared": model.blocks[0]})
        offload.wrap(outer, make_opt(outer.parameters()), config=config)
    one_step(engine, batches(1)[0])  # the first engine is untouched
    engine.restore_model()  # units on NVMe: close() reads the model into RAM only once restored
    engine.close()  # the model holds its values again ([Note: the model after close]): test_restore.py
    assert os.listdir(config["swap_dir"]) == []
    with offload.wrap(model.blocks[1], make_opt(model.blocks[1].parameters()), config=config):
        pass


# ---------------------------------------------------------------------- optimizer state
@pytest.mark.parametrize("tiers", [("host", "host"), ("nvme", "nvme"), ("device", "host")])
def test_an_adamw_that_has_taken_steps_carries_its_state_over(tiers, tmp_path):
    """Item 8: AdamW's step counts and moments (its own layout: state[p]["step"],
    "exp_avg", "exp_avg_sq") go into the units' homes on wrap. Plain AdamW for k steps,
    then wrapped for the rest, equals plain AdamW for all steps, and offload for all."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model, whole = copy.deepcopy(ref), copy.deepcopy(ref)
    data, k = batches(6), 3
    # a frozen parameter and one that never gets a gradient keep "no state" apart from zeros
    for m in (ref, model, whole):
        m.blocks[1].ln1.weight.requires_grad_(False)
    config = dict(param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path), device_budget=None)

    def plain(m, opt, steps):
        for b in steps:
            gpt_loss(m, b).backward()
            reference_optimizer_step(opt)
            opt.zero_grad()

    ref_opt = make_opt([p for p in ref.parameters() if p.requires_grad])
    plain(ref, ref_opt, data)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    plain(model, opt, data[:k])
    assert all(int(s["step"]) == k for s in opt.state.values())
    with offload.wrap(model, opt, config=config) as engine:
        train_offload(engine, data[k:])
        carried = engine.state_dict()
    with offload.wrap(whole, make_opt([p for p in whole.parameters() if p.requires_grad]), config=config) as engine:
        train_offload(engine, data)
        offload_all = engine.state_dict()
    assert max_rel_error(carried, ref.state_dict()) < REL_TOL
    assert max_rel_error(carried, offload_all) < REL_TOL


def test_optimizer_state_in_another_layout_is_refused_before_anything_is_touched(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_opt(model.parameters())
    gpt_loss(model, batches(1)[0]).backward()
    opt.step()
    p = model.blocks[0].ln1.weight
    opt.state[p]["exp_avg"] = torch.zeros(3)  # not the parameter's shape
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    with pytest.raises(ValueError, match=r"blocks.0.ln1.weight.*exp_avg"):
        offload.wrap(model, opt, config=nvme_config(tmp_path))
    for n, q in model.named_parameters():
        assert torch.equal(q.detach(), before[n]), n
    assert os.listdir(tmp_path / "swap") == []
