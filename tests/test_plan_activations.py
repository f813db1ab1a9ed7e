"""offload plan --seq-len N --batch B (offload/plan_activations.py): the activations of one
forward, traced without memory, per unit call, and where activation_offload puts them. The
prediction equals, group for group, what the engine's ActivationStore counts in a real
forward of the same model and batch (stats()["activations"]["units"]), for the first step
and the ones the prefetcher replays."""
import json
import warnings

import pytest
import torch

import offload
from offload.cli import main
from offload.gpt import GPT, GPTConfig
from offload.memory.budget import minimum_device_budget, model_unit_sizes
from offload.plan_activations import plan_activations

from support import make_opt

CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=2, num_layers=5)


def gpt():
    return GPT(CFG)


def hf(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        build = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        build = transformers.GPT2LMHeadModel

    def factory():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build(config)
    return factory


def run_groups(factory, config, seq_len, batch, steps=2):
    """stats()["activations"]["units"] after each of ``steps`` training steps."""
    torch.manual_seed(0)
    model = factory()
    model.train()
    g = torch.Generator().manual_seed(7)
    seen = []
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for _ in range(steps):
            tokens = torch.randint(0, 64, (batch, seq_len + 1), generator=g)
            if isinstance(model, GPT):
                loss = engine(tokens[:, :-1], tokens[:, 1:])
            else:
                loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
            engine.backward(loss)
            engine.step()
            seen.append(engine.stats()["activations"])
    return seen


def as_counters(plan):
    return [dict(unit=g.unit, saved_bytes=g.saved_bytes, moved_bytes=g.moved_bytes, where=g.where)
            for g in plan.groups]


def partial_budget(factory, config, seq_len, batch):
    """A device_budget under which "auto" keeps about half of what "host" would move:
    the smallest the engine accepts (param_tier "host") plus room for the rest."""
    host = plan_activations(factory, dict(config, activation_offload="host"), seq_len, batch)
    model = factory()
    e = 2 if config.get("dtype") in ("bf16", "fp16") else 4
    floor = minimum_device_budget(model_unit_sizes(model, e), "host", e)
    return floor + (host.kept_bytes + host.saved_bytes) // 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["host", "nvme", "auto", "auto-bounded"])
def test_plan_predicts_each_groups_bytes_and_destination_of_the_gpt(mode, dtype, tmp_path):
    config = dict(dtype=dtype, param_tier="host", activation_offload=mode.split("-")[0],
                  swap_dir=str(tmp_path / "swap"))
    if mode == "auto-bounded":
        config["device_budget"] = partial_budget(gpt, config, CFG.seq_len, 2)
    plan = plan_activations(gpt, config, CFG.seq_len, 2)
    for act in run_groups(gpt, config, CFG.seq_len, 2):
        assert act["units"] == as_counters(plan)
        assert (act["kept_bytes"], act["to_host_bytes"], act["to_nvme_bytes"]) == \
            (plan.kept_bytes, plan.moved_bytes("host"), plan.moved_bytes("nvme"))
    destinations = [g.where for g in plan.groups if g.saved_bytes >= 4096]
    if mode == "auto":  # no device_budget: nothing moves
        assert destinations == ["keep"] * len(destinations)
    elif mode == "auto-bounded":  # the earliest blocks leave, the later ones stay
        assert destinations[0] == "host" and destinations[-2:] == ["keep", "keep"]
    else:  # every block but the last leaves
        assert destinations == [mode] * (CFG.num_layers - 1) + ["keep"]


def test_plan_follows_the_batch_and_sequence_length():
    """Other shapes than the model's own: half the sequence, three sequences."""
    config = dict(activation_offload="host")
    plan = plan_activations(gpt, config, CFG.seq_len // 2, 3)
    assert run_groups(gpt, config, CFG.seq_len // 2, 3, steps=1)[0]["units"] == as_counters(plan)
    assert plan.saved_bytes != plan_activations(gpt, config, CFG.seq_len, 2).saved_bytes


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["host", "auto-bounded"])
def test_plan_predicts_hugging_face_models(kind, mode):
    factory = hf(kind)
    config = dict(param_tier="host", activation_offload=mode.split("-")[0])
    if mode == "auto-bounded":
        config["device_budget"] = partial_budget(factory, config, 48, 2)
    plan = plan_activations(factory, config, 48, 2)
    assert any(g.where == "host" for g in plan.groups)
    for act in run_groups(factory, config, 48, 2):
        assert act["units"] == as_counters(plan)


def test_plan_refuses_what_it_cannot_predict():
    with pytest.raises(ValueError, match="activation_offload"):
        plan_activations(gpt, {}, 32, 2)
    with pytest.raises(ValueError, match="batch"):
        plan_activations(gpt, dict(activation_offload="host"), 32, 0)
    with pytest.raises(ValueError, match="device_budget"):
        plan_activations(gpt, dict(activation_offload="auto", device_budget=1000), 32, 2)


def test_cli_prints_and_writes_the_activation_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "offload.gpt:GPT", "--seq-len", "64", "--batch", "2", "--activation-offload",
                 "host", "--host-budget", "4GiB", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "activations (activation_offload='host', batch 2 x 64 tokens, host room " in text
    saved = json.loads(out.read_text())["activations"]
    assert saved["mode"] == "host" and saved["units"][0]["unit"] == "root"
    assert saved["to_host_bytes"] == sum(u["moved_bytes"] for u in saved["units"]) > 0
    assert main(["plan", "--params", "1e6", "--seq-len", "64"]) == 1
    assert "--seq-len: needs --model" in capsys.readouterr().err
