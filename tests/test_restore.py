"""A wrapped model that reads as a plain one (issue 39 items 2-4): engine.restore_model()
puts every parameter's value, in its dtype from before wrap, into the parameter until the
next forward ([Note: restored parameters]); close() gives the model its values back for
good, so it can be wrapped again ([Note: the model after close])."""
import os

import pytest
import torch

import offload
from offload.gpt import GPT, GPTConfig

from support import CFG, assert_same_state, batches, gpt_loss, make_opt, train_offload

TIERS = [("host", "host"), ("nvme", "nvme")]


def config_for(tmp_path, tiers, dtype="fp32"):
    swap = tmp_path / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    return dict(param_tier=tiers[0], optimizer_tier=tiers[1], dtype=dtype, swap_dir=str(swap))


def wrapped(config, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


def assert_plain_values(model, state, dtype=torch.float32):
    """Every parameter holds ``state``'s value as a tensor of its own, in ``dtype``, on the CPU."""
    for name, p in model.named_parameters():
        assert p.dtype == dtype and p.device.type == "cpu", name
        assert all(s != 0 for s in p.stride() if p.numel() > 1), f"{name} is a placeholder"
        assert torch.equal(p.detach(), state[name].to(dtype)), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tiers", TIERS, ids=lambda t: ",".join(t))
def test_restore_model_puts_the_values_in_their_dtype_from_before_wrap_and_training_goes_on_alike(
        tiers, dtype, tmp_path):
    data = batches(5)
    _, plain_engine = wrapped(config_for(tmp_path / "a", tiers, dtype))
    with plain_engine:
        whole = train_offload(plain_engine, data)
        final = plain_engine.state_dict()
    model, engine = wrapped(config_for(tmp_path / "b", tiers, dtype))
    with engine:
        losses = train_offload(engine, data[:3])
        state = engine.state_dict()
        engine.restore_model()
        assert_plain_values(model, state)  # fp32 before wrap: the master, not the bf16 copy
        with torch.no_grad():
            assert torch.equal(gpt_loss(model, data[3]), gpt_loss(engine, data[3]))  # the next forward takes them back
        engine.restore_model()
        losses += train_offload(engine, data[3:])
        assert losses == whole
        assert_same_state(engine.state_dict(), final)


def test_a_write_into_a_restored_parameter_is_named_at_the_next_forward(tmp_path):
    model, engine = wrapped(config_for(tmp_path, ("nvme", "nvme")))
    with engine:
        train_offload(engine, batches(1))
        state = engine.state_dict()
        engine.restore_model()
        model.blocks[1].qkv.weight.data[0, 0] += 1.0  # through .data: no version counter sees it
        with pytest.raises(RuntimeError, match=r"\['blocks.1.qkv.weight'\] were written while they held "
                                               r"restored values .*write was lost"):
            gpt_loss(model, batches(1)[0])
        assert_same_state(engine.state_dict(), state)
        train_offload(engine, batches(1))  # the forward after that runs


def test_restore_model_too_big_for_memory_is_refused_naming_the_bytes(tmp_path, monkeypatch):
    model, engine = wrapped(config_for(tmp_path, ("nvme", "nvme")))
    with engine:
        train_offload(engine, batches(1))
        monkeypatch.setattr("offload.memory.layout.available_memory_bytes", lambda: 64 << 10)
        with pytest.raises(ValueError, match=r"restore_model\(\): the model's values take \d+ bytes, more than "
                                             r"0.75 of the memory available now \(65536 bytes\); read .*state_dict"):
            engine.restore_model()
        assert torch.isnan(model.blocks[1].qkv.weight).all()  # untouched: the placeholder
        monkeypatch.undo()  # room for close() to give the values back


@pytest.mark.parametrize("tiers", TIERS, ids=lambda t: ",".join(t))
def test_after_close_the_model_holds_its_values_and_a_new_wrap_goes_on_from_them(tiers, tmp_path):
    """Trained 3 steps, closed, wrapped again with a fresh AdamW for 2 steps: the same
    losses as a model built again from the first engine's state_dict."""
    data = batches(5)
    _, twin = wrapped(config_for(tmp_path / "twin", tiers, "bf16"))
    with twin:
        train_offload(twin, data[:3])
        state = twin.state_dict()
    model, engine = wrapped(config_for(tmp_path / "a", tiers, "bf16"))
    train_offload(engine, data[:3])
    if tiers[0] == "nvme":  # units on NVMe: close() reads the model into RAM only once restored
        engine.restore_model()
    engine.close()  # right after step(): a deferred step's updates finish first
    assert os.listdir(tmp_path / "a" / "swap") == []
    assert_plain_values(model, state)
    reference = GPT(CFG)
    reference.load_state_dict(state)
    losses = {}
    for name, m in (("handed over", model), ("rebuilt", reference)):
        with offload.wrap(m, make_opt(m.parameters()), config=config_for(tmp_path / name, tiers, "bf16")) as again:
            losses[name] = train_offload(again, data[3:])
    assert losses["handed over"] == losses["rebuilt"]


def test_close_keeps_a_restored_model_as_it_reads_edits_included(tmp_path):
    model, engine = wrapped(config_for(tmp_path, ("nvme", "nvme")))
    train_offload(engine, batches(2))
    state = engine.state_dict()
    engine.restore_model()
    with torch.no_grad():
        model.blocks[0].qkv.weight.mul_(2)  # a plain model keeps an edit
    engine.close()
    state["blocks.0.qkv.weight"] = state["blocks.0.qkv.weight"] * 2
    assert_plain_values(model, state)


def test_close_of_a_model_on_nvme_leaves_it_without_values_unless_restored(tmp_path):
    """A model whose units lived on NVMe is not read into RAM at close: its parameters keep
    their placeholders, and a new wrap says why and what to do."""
    model, engine = wrapped(config_for(tmp_path, ("nvme", "nvme")))
    train_offload(engine, batches(1))
    engine.close()
    assert torch.isnan(model.blocks[1].qkv.weight).all()
    with pytest.raises(ValueError, match=r"close\(\) could not give them back: \d+ of its \d+ units lived on NVMe"):
        offload.wrap(model, make_opt(model.parameters()), config=config_for(tmp_path, ("nvme", "nvme")))


def test_close_without_room_for_the_values_warns_and_the_next_wrap_says_why(tmp_path, monkeypatch):
    model, engine = wrapped(config_for(tmp_path, ("host", "host")))
    train_offload(engine, batches(1))
    monkeypatch.setattr("offload.memory.layout.available_memory_bytes", lambda: 64 << 10)
    with pytest.warns(RuntimeWarning, match=r"close\(\): the model's parameters hold no values from now on: .*"
                                         r"engine.save_pretrained\(DIR\)"):
        engine.close()
    with pytest.raises(ValueError, match=r"closed now, and its parameters hold no values any more \(close\(\) could "
                                         r"not give them back: the model's values take \d+ bytes.*weights=DIR"):
        offload.wrap(model, make_opt(model.parameters()), config=config_for(tmp_path, ("host", "host")))


def test_close_of_a_model_larger_than_host_budget_leaves_its_values_in_the_tiers(tmp_path):
    """A model offloaded because RAM cannot hold it is not copied whole into RAM at close:
    the values beyond host_budget stay unread, the warning names host_budget."""
    deep = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=32)  # RAM needs < its size
    model_bytes = sum(p.numel() * 4 for p in GPT(deep).parameters())
    # bf16 compute copies at home in RAM (half the fp32 values), states on NVMe
    config = dict(config_for(tmp_path, ("host", "nvme"), "bf16"), host_budget=model_bytes - 1,
                  device_budget=200_000, optimizer_pipeline_depth=2)
    torch.manual_seed(0)
    model = GPT(deep)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    train_offload(engine, batches(1))
    with pytest.warns(RuntimeWarning, match=rf"close\(\): .*the model's values take {model_bytes} bytes, more than "
                                         rf"host_budget \({model_bytes - 1} bytes\)"):
        engine.close()
    assert torch.isnan(model.blocks[1].qkv.weight).all()
