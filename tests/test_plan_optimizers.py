"""`offload plan --optimizer NAME` against wrap: the state layout the plan learns by probing
each optimizer (offload/plan_optimizers.py) is the one wrap gives the units, and the NVMe
bytes a step moves, counted by the engine, are the bytes the plan predicts from it."""
from __future__ import annotations

import json

import pytest
import torch

import offload
from offload.cli import main
from offload.gpt import GPT, GPTConfig
from offload.memory.budget import UnitSizes, slot_shape
from offload.plan import shape_from_module
from offload.plan_optimizers import OPTIMIZERS, build_optimizers
from support import CFG, batches, gpt_loss

NAMES = list(OPTIMIZERS)
# fp32 state tensors per element each unit's state home holds, as the issue states them
# (the most any of its parameters keeps: each parameter's elements only in its own optimizer's,
# [Note: per-entry state slots])
STATE_SLOTS = {"adamw": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1, "rmsprop": 1,
               "adafactor": 1,  # the vectors' exp_avg_sq (the factored matrices keep none)
               "muon": 2}       # AdamW's two (Muon's matrices keep one, their momentum)
FACTORY = f"""
from offload.gpt import GPT, GPTConfig


def build():
    return GPT(GPTConfig(**{CFG.__dict__!r}))
"""


def plan_json(tmp_path, monkeypatch, name, dtype):
    """`offload plan --model <the tiny GPT> --optimizer NAME --json`'s report."""
    (tmp_path / "plan_optimizers_gpt.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "plan_optimizers_gpt:build", "--optimizer", name, "--dtype", dtype,
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    return report, {(c["param_tier"], c["optimizer_tier"]): c for c in report["configurations"]}


def _stepped_once(name):
    """The seed-0 GPT and the optimizers ``name`` builds over it, after one step: the state
    torch keeps."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opts = build_optimizers(name, model)
    gpt_loss(model, batches(1)[0]).backward()
    for opt in opts:
        opt.step()
    return model, opts


def steps_traffic(engine, num_steps):
    """(bytes read, bytes written) on NVMe by each of ``num_steps`` steps after a first one."""
    data = batches(num_steps + 1)
    engine.backward(gpt_loss(engine, data[0]))
    engine.step()
    moved = []
    for b in data[1:]:
        before = engine.stats()
        engine.backward(gpt_loss(engine, b))
        engine.step()
        after = engine.stats()
        moved.append((after["bytes_read_nvme"] - before["bytes_read_nvme"],
                      after["bytes_written_nvme"] - before["bytes_written_nvme"]))
    return moved


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_nvme_bytes_per_step_are_what_the_plan_predicts_from_the_optimizers_state(name, dtype, tmp_path,
                                                                                  monkeypatch):
    """States on NVMe, compute copies in RAM (so every NVMe byte is the optimizer's: its
    state slots, and with bf16 the master's low halves), updates finished inside step()
    (overlap_step_with_forward=False), so each step moves the same bytes: those the plan
    predicts for host/nvme, from the layout it learned by probing the optimizer; its staging
    buffers are the ones wrap allocates."""
    if name == "adafactor":
        pytest.importorskip("transformers")
    report, by_tiers = plan_json(tmp_path, monkeypatch, name, dtype)
    planned = by_tiers[("host", "nvme")]
    slots = report["optimizer"]["state_slots"]
    assert slots == STATE_SLOTS[name]
    with torch.device("meta"):  # the units the plan cuts: the same ones are updated whole
        shape = shape_from_module(GPT(CFG), "gpt", optimizer=name)
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(device="cpu", dtype=dtype, param_tier="host", optimizer_tier="nvme",
                  swap_dir=str(tmp_path / "swap"), overlap_step_with_forward=False)
    with offload.wrap(model, build_optimizers(name, model), config=config) as engine:
        assert [u.state_slots for u in engine.units] == [slots] * len(engine.units)
        assert any(u.whole_step for u in engine.units) == report["optimizer"]["whole_step"]
        assert [u.whole_step for u in engine.units] == [u.whole_step for u in shape.units]
        layout = engine.layout
        # [Note: per-entry state slots] the staging slots wrap allocates, sized by what its
        # largest piece moves
        staging = layout.optimizer_pipeline_depth * slot_shape([UnitSizes.of(u) for u in engine.units],
                                                               layout).num_bytes(layout.compute_element_bytes)
        moved = steps_traffic(engine, 2)
        stats = engine.stats()
    traffic = planned["traffic_bytes_per_step"]
    assert moved == [(traffic["nvme_read"], traffic["nvme_write"])] * 2
    assert (slots == 0 and dtype == "fp32") == (traffic["nvme_read"] == 0)  # plain SGD in fp32 moves nothing
    assert stats["nvme_bytes"] == planned["nvme_bytes"]
    assert stats["optimizer_state_bytes"] == planned["state_bytes"]["fp32 master"] + \
        planned["state_bytes"][report["optimizer"]["state_name"]]
    assert stats["host_bytes"] <= planned["host_bytes"]
    assert planned["host_parts"]["optimizer staging buffers"] == staging


@pytest.mark.parametrize("name", NAMES)
def test_state_writes_of_an_all_nvme_step_are_what_the_plan_predicts(name, tmp_path, monkeypatch):
    """Both tiers on NVMe in fp32 (tools/bench_train.py --optimizer's rows): a step writes
    the merged master and the state slots, as the plan predicts; it reads at most the plan's
    bytes (a unit still on the device is not fetched again, and its update reads the device
    copy: [Note: updates through the device copy])."""
    if name == "adafactor":
        pytest.importorskip("transformers")
    _, by_tiers = plan_json(tmp_path, monkeypatch, name, "fp32")
    traffic = by_tiers[("nvme", "nvme")]["traffic_bytes_per_step"]
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(device="cpu", dtype="fp32", param_tier="nvme", optimizer_tier="nvme",
                  swap_dir=str(tmp_path / "swap"), overlap_step_with_forward=False)
    with offload.wrap(model, build_optimizers(name, model), config=config) as engine:
        moved = steps_traffic(engine, 2)
    for read, written in moved:
        assert written == traffic["nvme_write"]
        assert 0 < read <= traffic["nvme_read"]


def test_an_unknown_optimizer_name_is_refused(capsys):
    assert main(["plan", "--params", "1e6", "--optimizer", "lamb"]) == 1
    assert "--optimizer: expected one of adamw" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "--optimizer", "sgd", "--optimizer-state-tensors", "0"]) == 1
    assert "give one" in capsys.readouterr().err


@pytest.mark.parametrize("name", NAMES)
def test_the_plans_state_bytes_per_parameter_are_what_torch_keeps(name, tmp_path, monkeypatch, capsys):
    """[Note: per-entry state slots] The plan's optimizer state bytes per parameter (JSON and
    text) are the fp32 tensors shaped like each parameter that plain PyTorch keeps for it,
    averaged over the parameters: Muon's matrices one, AdamW's two; Adafactor's factored
    matrices none, its vectors one."""
    if name == "adafactor":
        pytest.importorskip("transformers")
    report, _ = plan_json(tmp_path, monkeypatch, name, "fp32")
    model, opts = _stepped_once(name)
    state = {p: s for opt in opts for p, s in opt.state.items()}
    params = list(model.parameters())
    tensors = [sum(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape for v in state.get(p, {}).values())
               for p in params]
    kept = sum(k * p.numel() * 4 for k, p in zip(tensors, params))
    per_param = kept / sum(p.numel() for p in params)
    slots = report["optimizer"]["state_slots"]
    assert report["bytes_per_param"][report["optimizer"]["state_name"]] == pytest.approx(per_param, rel=1e-12)
    if name in ("muon", "adafactor"):  # fewer than the most slots for every parameter
        assert per_param < slots * 4
    capsys.readouterr()
    assert main(["plan", "--model", "plan_optimizers_gpt:build", "--optimizer", name]) == 0
    assert f" {report['bytes_per_param'][report['optimizer']['state_name']]:g} B/param" in capsys.readouterr().out


# what each optimizer keeps per element, by class, as plain PyTorch's state names it
KEPT = {"adamw": "Adam moments", "sgd": "optimizer state (SGD none)",
        "sgd-momentum": "optimizer state (SGD momentum_buffer)", "adagrad": "optimizer state (Adagrad sum)",
        "rmsprop": "optimizer state (RMSprop square_avg)", "adafactor": "optimizer state (Adafactor exp_avg_sq)",
        "muon": "optimizer state (Muon momentum_buffer; AdamW exp_avg, exp_avg_sq)"}


@pytest.mark.parametrize("name", NAMES)
def test_the_plan_names_the_state_the_optimizers_keep(name, tmp_path, monkeypatch, capsys):
    """The state homes' row of `offload plan --optimizer NAME` (text and JSON) is named after
    what its optimizers keep per element in plain PyTorch (Muon beside AdamW is not "Adam
    moments"), and no other name of the moments is left in the report."""
    if name == "adafactor":
        pytest.importorskip("transformers")
    report, by_tiers = plan_json(tmp_path, monkeypatch, name, "fp32")
    out = capsys.readouterr().out
    model, opts = _stepped_once(name)
    kept = [sorted({k for p in opt.state for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)
                    and v.shape == p.shape and v.dim() > 0}) for opt in opts]
    assert report["optimizer"]["slots"] == kept
    assert report["optimizer"]["classes"] == [type(opt).__name__ for opt in opts]
    label = KEPT[name]
    assert report["optimizer"]["state_name"] == label
    assert label in report["bytes_per_param"]
    for c in by_tiers.values():
        assert c["state_tier"][label] == c["optimizer_tier"] and label in c["state_bytes"]
        assert label in c["host_parts"]
    if name != "adamw":
        assert "Adam moments" not in json.dumps(report) and "Adam moments" not in out
    assert f"  {label} " in out and f"{label}: nvme" in out


@pytest.mark.parametrize("name", ["muon", "adafactor", "sgd-momentum"])
def test_a_plan_from_a_parameter_count_counts_each_parameters_own_slots(name, tmp_path, capsys):
    """`offload plan --params N --optimizer NAME` (no model) says what it assumed (the
    reference GPT's blocks, the root's embeddings and final norm) and counts each assumed
    parameter's own optimizer's slots, as wrap does per entry: the state bytes and a step's
    NVMe bytes it plans are those of wrapping that very GPT (tied embeddings, the root unit as
    large as a block), which are below every parameter at the most slots for Muon and
    Adafactor; without --optimizer every parameter keeps every slot, and it says so."""
    if name == "adafactor":
        pytest.importorskip("transformers")
    d, layers, seq = 64, 4, 16
    cfg = GPTConfig(vocab_size=12 * d + 8 - seq, seq_len=seq, d_model=d, num_heads=2, num_layers=layers)
    block = 12 * d * d + 10 * d
    assert cfg.num_params == (layers + 1) * block  # the root unit is the size of a block
    out = tmp_path / "plan.json"
    assert main(["plan", "--params", str(cfg.num_params), "--num-units", str(layers), "--optimizer", name,
                 "--dtype", "fp32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"each parameter keeps what {name} keeps for its kind: a block is the reference GPT's of width {d}" in text
    report = json.loads(out.read_text())
    assert "each parameter keeps what" in report["model"]
    label = report["optimizer"]["state_name"]
    planned = {(c["param_tier"], c["optimizer_tier"]): c for c in report["configurations"]}[("host", "nvme")]
    torch.manual_seed(0)
    model = GPT(cfg)
    config = dict(device="cpu", dtype="fp32", param_tier="host", optimizer_tier="nvme",
                  swap_dir=str(tmp_path / "swap"), overlap_step_with_forward=False)
    with offload.wrap(model, build_optimizers(name, model), config=config) as engine:
        assert len(engine.units) == layers + 1
        data = [torch.randint(0, cfg.vocab_size, (2, seq + 1)) for _ in range(3)]
        moved = []
        for i, b in enumerate(data):
            before = engine.stats()
            engine.backward(torch.nn.functional.cross_entropy(
                engine(b[:, :-1]).view(-1, cfg.vocab_size), b[:, 1:].reshape(-1)))
            engine.step()
            after = engine.stats()
            if i:
                moved.append((after["bytes_read_nvme"] - before["bytes_read_nvme"],
                              after["bytes_written_nvme"] - before["bytes_written_nvme"]))
        stats = engine.stats()
    assert stats["optimizer_state_bytes"] == planned["state_bytes"]["fp32 master"] + planned["state_bytes"][label]
    traffic = planned["traffic_bytes_per_step"]
    assert moved == [(traffic["nvme_read"], traffic["nvme_write"])] * 2
    assert planned["nvme_bytes"] == stats["nvme_bytes"]
    slots = report["optimizer"]["state_slots"]
    if name != "sgd-momentum":  # fewer than every parameter at the most slots
        assert planned["state_bytes"][label] < slots * 4 * cfg.num_params
        assert report["bytes_per_param"][label] < slots * 4
    assert main(["plan", "--params", str(cfg.num_params), "--num-units", str(layers), "--dtype", "fp32"]) == 0
    assert "every parameter keeps every optimizer state tensor" in capsys.readouterr().out
