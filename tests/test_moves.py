"""Misuses of a wrapped model, named at the call and changing nothing. Moving or casting it
([Note: moving a wrapped model] in hooks.py): ``model.to(...)``, ``.cuda()``, ``.half()``
and the rest are refused naming the method, the parameter and the engine; one that changes
nothing goes ahead; after close() the model moves and casts as a plain model. A backward
outside engine.backward ([Note: backward outside engine.backward])."""
import pytest
import torch

import offload
from offload.gpt import GPT

from support import CFG, assert_same_state, batches, make_opt, train_offload

CALLS = {
    "to(torch.bfloat16)": (lambda m: m.to(torch.bfloat16), "GPT.to()", "wte.weight"),
    "to('meta')": (lambda m: m.to("meta"), "GPT.to()", "wte.weight"),
    "half()": (lambda m: m.half(), "GPT.half()", "wte.weight"),
    "cuda()": (lambda m: m.cuda(), "GPT.cuda()", "wte.weight"),
    "type(torch.float64)": (lambda m: m.type(torch.float64), "GPT.type()", "wte.weight"),
    "to_empty(device='cpu')": (lambda m: m.to_empty(device="cpu"), "GPT.to_empty()", "wte.weight"),
    "blocks[1].double()": (lambda m: m.blocks[1].double(), "Block.double()", "blocks.1."),
}


def config_for(tmp_path, tier):
    return dict(device="cpu", param_tier=tier, optimizer_tier=tier if tier != "device" else "host",
                swap_dir=str(tmp_path / "swap"))


def wrapped(config):
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


def tensors_of(model):
    """Each parameter's and buffer's tensor as the model holds it now (object, dtype, device)."""
    return {name: (t.data_ptr(), t.dtype, t.device, t.stride())
            for name, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("call, tier", [(call, "host") for call in sorted(CALLS)] + [("half()", "nvme")])
def test_a_move_or_cast_is_refused_at_the_call_and_changes_nothing(call, tier, tmp_path):
    apply, method, parameter = CALLS[call]
    data = batches(4)
    model, engine = wrapped(config_for(tmp_path, tier))
    with engine:
        train_offload(engine, data[:2])
        engine.restore_model()  # the parameters hold copies, as after OffloadTrainer.train()
        before = tensors_of(model)
        with pytest.raises(ValueError) as refusal:
            apply(model)
        assert str(refusal.value).startswith(f"{method} on a model wrapped by offload")
        assert f"it would replace {parameter}" in str(refusal.value)
        assert "wrapped by offload" in str(refusal.value) and "engine.close()" in str(refusal.value)
        assert tensors_of(model) == before
        losses = train_offload(engine, data[2:])
        got = engine.state_dict()
    reference, ref_engine = wrapped(config_for(tmp_path, tier))
    with ref_engine:
        train_offload(ref_engine, data[:2])
        ref_engine.restore_model()
        assert train_offload(ref_engine, data[2:]) == losses
        assert_same_state(got, ref_engine.state_dict())


def test_a_call_that_changes_nothing_goes_ahead(tmp_path):
    """The restored copies are float32 on the CPU, as the engine's buffers: to("cpu"),
    float(), to(torch.float32) and cpu() return the model, which trains on unchanged."""
    data = batches(4)
    model, engine = wrapped(config_for(tmp_path, "host"))
    with engine:
        train_offload(engine, data[:2])
        engine.restore_model()
        before = tensors_of(model)
        for apply in (lambda m: m.to("cpu"), lambda m: m.float(), lambda m: m.to(torch.float32), lambda m: m.cpu()):
            assert apply(model) is model
        assert tensors_of(model) == before
        losses = train_offload(engine, data[2:])
    reference, ref_engine = wrapped(config_for(tmp_path, "host"))
    with ref_engine:
        assert train_offload(ref_engine, data)[2:] == losses


def test_after_close_the_model_moves_and_casts_as_a_plain_model(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "host"))
    with engine:
        train_offload(engine, batches(2))
        values = engine.state_dict()
    assert model.half() is model
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert torch.equal(model.wte.weight, values["wte.weight"].half())


@pytest.mark.parametrize("outside", ["loss.backward()", "torch.autograd.grad"])
def test_a_backward_outside_engine_backward_is_refused_and_keeps_nothing(outside, tmp_path):
    """[Note: backward outside engine.backward] (accelerate's accelerator.backward(loss) is
    loss.backward()): a ValueError naming engine.backward, no gradient left in p.grad, and
    the training after it is bit for bit one that never had it."""
    data = batches(3)
    model, engine = wrapped(config_for(tmp_path, "host"))
    with engine:
        train_offload(engine, data[:1])
        loss = engine(data[1][:, :-1], data[1][:, 1:])
        with pytest.raises(ValueError, match=r"outside engine.backward\(loss\) .*call engine.backward\(loss\)"):
            if outside == "loss.backward()":
                loss.backward()
            else:
                torch.autograd.grad(loss, [p for p in model.parameters()])
        assert all(p.grad is None for p in model.parameters())
        losses = train_offload(engine, data[1:])
        got = engine.state_dict()
    reference, ref_engine = wrapped(config_for(tmp_path, "host"))
    with ref_engine:
        assert train_offload(ref_engine, data)[1:] == losses
        assert_same_state(got, ref_engine.state_dict())
