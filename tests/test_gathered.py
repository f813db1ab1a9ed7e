"""Reading and editing weights after wrap (issue 39 items 7 and 8): engine.gathered() holds
units on the device with their real values and, with modify=True, writes edits back to
every tier; engine.load_state_dict() loads weights into the tiers; a parameter whose .data
was replaced after wrap is named at the next forward ([Note: gathered parameters],
[Note: released parameters])."""
import pytest
import torch

import offload
from offload.gpt import GPT

from support import CFG, assert_same_state, batches, gpt_loss, make_opt, train_offload

TIER_PAIRS = [(p, o) for p in ("device", "host", "nvme") for o in ("host", "nvme")]


def config_for(tmp_path, param_tier="host", optimizer_tier="host", dtype="fp32", **extra):
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return dict(param_tier=param_tier, optimizer_tier=optimizer_tier, dtype=dtype, swap_dir=str(swap), **extra)


def wrapped(config, edit=None, seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


def is_placeholder(p):
    """[Note: released parameters] a released parameter is a zero-stride view of NaN."""
    return all(s == 0 for s in p.stride()) and bool(torch.isnan(p).all())


# ---------------------------------------------------------------------- reading
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("param_tier, optimizer_tier", TIER_PAIRS)
def test_gathered_parameters_hold_the_values_of_state_dict_on_every_tier(param_tier, optimizer_tier, dtype,
                                                                        tmp_path):
    model, engine = wrapped(config_for(tmp_path, param_tier, optimizer_tier, dtype))
    with engine:
        train_offload(engine, batches(2))
        state = engine.state_dict()
        round_master = engine.debug.homes.round_master  # bf16: the master rounded as the homes round it
        with engine.gathered():
            for name, p in model.named_parameters():
                assert p.dtype == engine.compute_dtype and p.device == engine.device, name
                expected = round_master(state[name].reshape(-1)).view(p.shape)
                assert torch.equal(p.detach().cpu(), expected), name
        for name, p in model.named_parameters():
            if param_tier == "device":  # a device-homed copy stays bound to its slot
                assert torch.equal(p.detach().cpu(), round_master(state[name].reshape(-1)).view(p.shape))
            else:
                assert is_placeholder(p), f"{name} is released again after the block"
        assert_same_state(engine.state_dict(), state)


def test_gathering_some_modules_brings_only_their_units(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "nvme", "nvme"))
    with engine:
        state = engine.state_dict()
        with engine.gathered([model.blocks[2], model.blocks[0].ln1.weight]):
            for name, p in model.named_parameters():
                if name.startswith(("blocks.0.", "blocks.2.")):
                    assert torch.equal(p.detach(), state[name]), name
                elif name.startswith("blocks."):
                    assert is_placeholder(p), f"{name}'s unit was not asked for"


# ---------------------------------------------------------------------- editing
def edit_fp32(model):
    model.blocks[1].ln1.bias.fill_(0.25)
    model.blocks[2].fc.weight.mul_(2.0)
    model.ln_f.weight.zero_()


def edit_bf16(model):
    """Edits whose values bf16 holds exactly, each element changed: the engine's result then
    equals editing the fp32 model before wrap bit for bit (an element whose bf16 value
    changed takes it as its master; one written with the value it had keeps its finer
    master, so none is left so here)."""
    model.blocks[1].ln1.bias.fill_(0.25)
    g = torch.Generator().manual_seed(5)
    w = model.blocks[2].fc.weight
    new = torch.randn(w.shape, generator=g).to(torch.bfloat16)
    new = torch.where(new == w.to(torch.bfloat16), torch.full_like(new, 4.0), new)
    w.copy_(new.to(w.dtype))


@pytest.mark.parametrize("tiers, dtype", [("host", "fp32"), ("nvme", "fp32"), ("host", "bf16"), ("nvme", "bf16")])
def test_edits_made_in_a_gathered_block_train_as_edits_made_before_wrap(tiers, dtype, tmp_path):
    edit = edit_fp32 if dtype == "fp32" else edit_bf16
    data = batches(4)
    config = config_for(tmp_path, tiers, tiers, dtype, device_budget=200 * 1024 if tiers == "nvme" else None)
    _, reference = wrapped(config, edit=edit)
    with reference:
        expected_losses = train_offload(reference, data)
        expected = reference.state_dict()
    model, engine = wrapped(config)
    with engine:
        before = engine.state_dict()
        with engine.gathered([model.blocks[1], model.blocks[2], model.ln_f], modify=True), torch.no_grad():
            edit(model)
        edited = engine.state_dict()
        untouched = [n for n in before if not n.startswith(("blocks.1.ln1.bias", "blocks.2.fc.weight", "ln_f.weight"))]
        assert all(torch.equal(edited[n], before[n]) for n in untouched), "only the edited parameters change"
        losses = train_offload(engine, data)
        assert losses == expected_losses
        assert_same_state(engine.state_dict(), expected)


def test_an_edit_survives_a_checkpoint(tmp_path):
    data = batches(3)
    config = config_for(tmp_path, "nvme", "nvme", device_budget=200 * 1024)
    model, engine = wrapped(config)
    with engine:
        train_offload(engine, data[:1])
        with engine.gathered(model.blocks[0], modify=True), torch.no_grad():
            model.blocks[0].ln1.weight.fill_(3.0)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected_losses = train_offload(engine, data[1:])
        expected = engine.state_dict()
    config["swap_dir"] = str(tmp_path / "swap2")
    (tmp_path / "swap2").mkdir()
    _, again = wrapped(config, seed=1)
    with again:
        again.load_checkpoint(str(tmp_path / "ckpt"))
        assert bool((again.state_dict()["blocks.0.ln1.weight"] == 3.0).all())
        assert train_offload(again, data[1:]) == expected_losses
        assert_same_state(again.state_dict(), expected)


def test_without_modify_edits_do_not_reach_the_tiers(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "host", "host"))
    with engine:
        state = engine.state_dict()
        with engine.gathered(model.blocks[0]), torch.no_grad():
            model.blocks[0].ln1.weight.fill_(3.0)
        assert_same_state(engine.state_dict(), state)


# ---------------------------------------------------------------------- load_state_dict
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_load_state_dict_loads_weights_and_trains_as_the_same_edit_in_a_gathered_block(tiers, tmp_path):
    """Weights only: the moments stay, so loading new weights mid-run continues exactly as
    writing the same values through engine.gathered(modify=True)."""
    torch.manual_seed(7)
    new = GPT(CFG).state_dict()
    data = batches(3)
    config = config_for(tmp_path, tiers, tiers, device_budget=240 * 1024 if tiers == "nvme" else None)
    runs = []
    for how in ("load_state_dict", "gathered"):
        model, engine = wrapped(config)
        with engine:
            train_offload(engine, data[:1])
            if how == "load_state_dict":
                result = engine.load_state_dict(new)
                assert result.missing_keys == [] and result.unexpected_keys == []
            else:
                with engine.gathered(modify=True), torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(new[name])
            assert_same_state(engine.state_dict(), new)
            runs.append((train_offload(engine, data[1:]), engine.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert_same_state(runs[0][1], runs[1][1])


@pytest.mark.parametrize("case, message", [
    ("shape", "blocks.1.ln1.weight"),
    ("unknown", "blocks.9.nothing"),
    ("missing", "ln_f.weight"),
    ("integers", "blocks.0.ln1.bias"),
])
def test_load_state_dict_refuses_what_does_not_match_before_anything_changes(case, message, tmp_path):
    model, engine = wrapped(config_for(tmp_path, "nvme", "nvme"))
    with engine:
        train_offload(engine, batches(1))
        before = engine.state_dict()
        bad = {k: torch.zeros_like(v) for k, v in before.items()}
        if case == "shape":
            bad["blocks.1.ln1.weight"] = torch.zeros(3)
        elif case == "unknown":
            bad["blocks.9.nothing"] = torch.zeros(3)
        elif case == "missing":
            del bad["ln_f.weight"]
        else:
            bad["blocks.0.ln1.bias"] = bad["blocks.0.ln1.bias"].long()
        with pytest.raises(ValueError, match=message):
            engine.load_state_dict(bad)
        assert_same_state(engine.state_dict(), before)
        train_offload(engine, batches(1))  # the engine trains on


def test_load_state_dict_not_strict_keeps_what_is_missing_and_reports_it(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "host", "host"))
    with engine:
        before = engine.state_dict()
        partial = {"blocks.1.ln1.weight": torch.full_like(before["blocks.1.ln1.weight"], 2.0),
                   "extra": torch.zeros(1)}
        result = engine.load_state_dict(partial, strict=False)
        assert result.unexpected_keys == ["extra"] and "ln_f.weight" in result.missing_keys
        after = engine.state_dict()
        assert bool((after["blocks.1.ln1.weight"] == 2.0).all())
        assert_same_state({k: v for k, v in after.items() if k != "blocks.1.ln1.weight"},
                          {k: v for k, v in before.items() if k != "blocks.1.ln1.weight"})


# ---------------------------------------------------------------------- lost writes
def test_replacing_a_released_parameters_data_is_named_at_the_next_forward(tmp_path):
    """Item 8: p.data = ... after wrap used to be lost silently."""
    data = batches(3)
    states = []
    for disturb in (False, True):
        model, engine = wrapped(config_for(tmp_path, "nvme", "nvme", device_budget=140 * 1024))
        with engine:
            train_offload(engine, data[:1])
            before = engine.state_dict()
            if disturb:
                p = model.blocks[2].fc.weight
                p.data = torch.zeros(p.shape)
                with pytest.raises(RuntimeError, match=r"blocks\.2\.fc\.weight.*\.data replaced.*engine\.gathered"):
                    engine(data[1][:, :-1], data[1][:, 1:])
                assert_same_state(engine.state_dict(), before)
                assert is_placeholder(p), "the parameter holds its placeholder again"
            states.append((train_offload(engine, data[1:]), engine.state_dict()))
    assert states[0][0] == states[1][0]
    assert_same_state(states[0][1], states[1][1])


# ---------------------------------------------------------------------- refusals
def test_gathered_is_refused_inside_a_pass_and_with_a_step_pending(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "host", "host"))
    with engine:
        b = batches(1)[0]
        state = engine.state_dict()
        seen = []

        def inside(module, args, output):
            with pytest.raises(ValueError, match="forward pass is running"):
                with engine.gathered(module):
                    pass
            seen.append(True)
        handle = model.blocks[1].register_forward_hook(inside)
        loss = gpt_loss(engine, b)
        handle.remove()
        assert seen
        engine.backward(loss)
        with pytest.raises(ValueError, match="a step is pending"):
            with engine.gathered():
                pass
        with pytest.raises(ValueError, match="a step is pending"):
            engine.load_state_dict(state)
        engine.step()
        with engine.gathered(model.blocks[0]):
            with pytest.raises(ValueError, match="a forward inside engine.gathered"):
                gpt_loss(engine, b)
            with pytest.raises(ValueError, match="a forward inside engine.gathered"):
                gpt_loss(model, b)  # the model called directly
            with pytest.raises(ValueError, match=r"step\(\) inside engine.gathered"):
                engine.step()
            with pytest.raises(ValueError, match="inside an engine.gathered"):
                engine.load_state_dict(state)
            assert not torch.isnan(model.blocks[0].ln1.weight).any(), "still held"
        train_offload(engine, [b])  # nothing is left held


def test_a_device_budget_too_small_for_what_is_asked_is_refused_before_anything_moves(tmp_path):
    model, engine = wrapped(config_for(tmp_path, "nvme", "nvme", device_budget=140 * 1024))
    with engine:
        state = engine.state_dict()
        moved = lambda: (engine.stats()["bytes_read_nvme"], engine.stats()["bytes_host_to_device"])  # noqa: E731
        fetched = moved()
        with pytest.raises(ValueError, match=r"device_budget 140\.00 KiB \(143360 bytes\) cannot hold.*bytes .* are needed"):
            with engine.gathered(modify=True):
                pass
        assert moved() == fetched
        for block in model.blocks:  # one module after another fits
            with engine.gathered(block):
                assert not torch.isnan(block.ln1.weight).any()
        assert_same_state(engine.state_dict(), state)
