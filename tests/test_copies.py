"""Copies of a wrapped model ([Note: copies of a wrapped model] in hooks.py): copy.deepcopy,
pickle and torch.save of the model, or of one of its modules, give a plain model holding the
current values (as engine.restore_model() gives them), with the model's ties and the user's
hooks but none of the engine's; the engine trains on as if no copy had been made; where the
values cannot be read now the copy is a ValueError that changes nothing."""
import copy
import io
import pickle

import pytest
import torch

import offload
from offload.gpt import GPT

from support import CFG, assert_same_state, batches, gpt_loss, make_opt, train_offload

ENGINE_ATTRIBUTES = ("_apply", "__deepcopy__", "__reduce_ex__")  # the instance attributes wrap adds


def config_for(tmp_path, tier, dtype="fp32"):
    return dict(device="cpu", param_tier=tier, optimizer_tier=tier, dtype=dtype, swap_dir=str(tmp_path / "swap"))


def wrapped(config):
    torch.manual_seed(0)
    model = GPT(CFG)
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


def by_deepcopy(module):
    return copy.deepcopy(module)


def by_pickle(module):
    return pickle.loads(pickle.dumps(module))


def by_torch_save(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": by_deepcopy, "pickle": by_pickle, "torch.save": by_torch_save}


def assert_plain(module):
    """No module of ``module`` carries the engine: none of its attributes, no hook."""
    for m in module.modules():
        assert not set(ENGINE_ATTRIBUTES) & set(vars(m)), type(m).__name__
        for name in ("_forward_pre_hooks", "_forward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                     "_load_state_dict_pre_hooks"):
            assert not getattr(m, name), (type(m).__name__, name)


def trained_on(config, data, copy_after=None, make_copy=by_deepcopy):
    """The small GPT trained on ``data``; after ``copy_after`` steps a copy is made (and
    trained a step by plain PyTorch, which must not reach the engine). (losses, state,
    the copy, the engine's state when the copy was made)."""
    model, engine = wrapped(config)
    made = state_then = None
    with engine:
        losses = []
        for i, b in enumerate(data):
            if i == copy_after:
                state_then = engine.state_dict()
                made = make_copy(model)
                opt = torch.optim.SGD(made.parameters(), lr=0.5)
                gpt_loss(made, b).backward()
                opt.step()
                opt.zero_grad()
            losses += train_offload(engine, [b])
        return losses, engine.state_dict(), made, state_then


@pytest.mark.parametrize("how, tier, dtype", [("deepcopy", "host", "fp32"), ("deepcopy", "nvme", "fp32"),
                                              ("deepcopy", "host", "bf16"), ("pickle", "nvme", "fp32"),
                                              ("torch.save", "host", "bf16")])
def test_a_copy_is_a_plain_model_with_the_current_values_and_the_engine_trains_on(how, tier, dtype, tmp_path):
    data = batches(4)
    config = config_for(tmp_path, tier, dtype)
    losses, state, made, state_then = trained_on(config, data, copy_after=2, make_copy=COPIES[how])
    reference_losses, reference_state, _, _ = trained_on(config, data)
    assert losses == reference_losses  # the copy, and its own training, reached nothing of the engine
    assert_same_state(state, reference_state)
    assert type(made) is GPT
    assert_plain(made)
    assert made.head.weight is made.wte.weight  # the tie kept
    # its values were the engine's at the copy (fp32 masters, float32 as before wrap), and
    # it trained one plain SGD step from there: redo that step on a model loaded with them
    again = GPT(CFG)
    again.load_state_dict(state_then)
    opt = torch.optim.SGD(again.parameters(), lr=0.5)
    gpt_loss(again, data[2]).backward()
    opt.step()
    assert_same_state(made.state_dict(), again.state_dict())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in made.parameters())
    assert made.double() is made  # a plain model casts
    with offload.wrap(made, make_opt(made.parameters()), config=config_for(tmp_path / "second", "host")) as second:
        train_offload(second, data[:1])  # and another engine takes it


def test_a_copy_of_a_module_holds_its_values_and_keeps_the_users_hooks_only(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "nvme"))
    calls = []
    model.blocks[1].register_forward_hook(lambda module, args, output: calls.append(type(module).__name__))
    with engine:
        train_offload(engine, batches(2))
        calls.clear()
        block = copy.deepcopy(model.blocks[1])
        state = engine.state_dict()
        expected = {k[len("blocks.1."):]: v for k, v in state.items() if k.startswith("blocks.1.")}
        assert_same_state(block.state_dict(), expected)
        assert list(block._forward_hooks) and not block._forward_pre_hooks  # the user's, not the engine's
        assert not set(ENGINE_ATTRIBUTES) & set(vars(block))
        block(torch.randn(2, CFG.seq_len, CFG.d_model))
        assert calls == ["Block"]
        assert_same_state(engine.state_dict(), state)
        # a submodule first, then the model, in one deepcopy: one copy of the block, shared
        block, whole = copy.deepcopy([model.blocks[1], model])
        assert whole.blocks[1] is block and whole.head.weight is whole.wte.weight
        assert all(not set(ENGINE_ATTRIBUTES) & set(vars(m)) for m in whole.modules())
        assert not whole._forward_pre_hooks and not whole._state_dict_hooks
        assert list(block._forward_hooks) and not block._forward_pre_hooks  # the user's hook only
        assert_same_state(whole.state_dict(), state)


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_between_backward_and_step_is_refused_and_changes_nothing(how, tmp_path):
    data = batches(3)
    config = config_for(tmp_path, "host")
    model, engine = wrapped(config)
    with engine:
        train_offload(engine, data[:1])
        loss = gpt_loss(engine, data[1])
        engine.backward(loss)
        with pytest.raises(ValueError, match=r"copy.deepcopy\(\) or pickle of a model wrapped by offload: "
                                              r"a step is pending"):
            COPIES[how](model)
        engine.step()
        losses = [loss.item()] + train_offload(engine, data[2:])
        state = engine.state_dict()
    reference_losses, reference_state, _, _ = trained_on(config, data)
    assert losses == reference_losses[1:]
    assert_same_state(state, reference_state)


def test_after_close_the_model_copies_as_any_model(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "host"))
    with engine:
        train_offload(engine, batches(1))
        state = engine.state_dict()
    assert_plain(model)
    made = copy.deepcopy(model)
    assert_same_state(made.state_dict(), state)
    assert made.head.weight is made.wte.weight
