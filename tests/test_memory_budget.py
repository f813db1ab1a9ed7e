"""offload.memory.budget is the arithmetic wrap checks its budgets with: on a model it never
wraps it gives the bytes wrap reports and `offload plan` prints, and the minimum device
budget it names is the smallest one wrap accepts."""
import pytest
import torch

import offload
from offload.config import OffloadConfig
from offload.gpt import GPT, GPTConfig
from offload.memory.budget import (
    check_device_budget, check_host_budget, host_bytes, minimum_device_budget, minimum_host_budget,
    model_unit_sizes, swap_bytes)
from offload.memory.layout import Layout
from offload.plan import place, shape_from_module

CFG = GPTConfig(d_model=64, num_layers=3, num_heads=2, seq_len=32)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
FROZEN = ("blocks.1.attn.proj.bias", "wpe.weight")  # frozen parameters: pages apart at home


def build(frozen=()):
    torch.manual_seed(0)
    model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model


def wrap(model, **config):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return offload.wrap(model, opt, dict(device="cpu", **config))


def sizes_of(dtype, frozen=()):
    with torch.device("meta"):
        return model_unit_sizes(build(frozen), ELEMENT_BYTES[dtype])


def layout_of(**config):
    return Layout.resolve(OffloadConfig(device="cpu", **config), torch.device("cpu"), None)


@pytest.mark.host_device
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "nvme"), ("device", "host")])
def test_budget_of_an_unwrapped_model_is_what_wrap_reports_and_plan_prints(tiers, dtype, tmp_path):
    config = dict(param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path), dtype=dtype)
    sizes, layout = sizes_of(dtype), layout_of(**config)
    arena = check_device_budget(sizes, layout)
    host = host_bytes(sizes, layout)
    with wrap(build(), **config, host_budget=host.total) as engine:
        stats = engine.stats()
        assert stats["device_budget_bytes"] == arena.budget_bytes
        assert stats["nvme_bytes"] == swap_bytes(sizes, layout)
    # [Note: gradient spill] below that, gradients go to NVMe where a tier is there; below
    # minimum_host_budget wrap refuses
    with pytest.raises(ValueError, match="host_budget"):
        wrap(build(), **config, host_budget=minimum_host_budget(sizes, layout) - 1)
    with torch.device("meta"):
        placement = place(shape_from_module(build(), "gpt"), dtype, *tiers)
    assert placement.device_bytes == arena.minimum_bytes
    assert placement.host_bytes == host.total
    assert placement.nvme_bytes == swap_bytes(sizes, layout)


@pytest.mark.parametrize("param_tier", ["device", "host", "nvme"])
def test_minimum_device_budget_is_the_smallest_wrap_accepts(param_tier, tmp_path):
    # frozen parameters too: the largest gradient on its way out is a trainable one's
    config = dict(param_tier=param_tier, optimizer_tier="host", swap_dir=str(tmp_path), dtype="bf16")
    minimum = minimum_device_budget(sizes_of("bf16", FROZEN), param_tier, 2)
    with wrap(build(FROZEN), **config, device_budget=minimum) as engine:
        assert engine.stats()["device_budget_bytes"] == minimum
    with pytest.raises(ValueError, match="device_budget") as refused:
        wrap(build(FROZEN), **config, device_budget=minimum - 1)
    assert f"at least {minimum} bytes" in str(refused.value)
    # wrap's error is the budget module's, word for word
    layout = layout_of(**config, device_budget=minimum - 1)
    with pytest.raises(ValueError) as computed:
        check_device_budget(sizes_of("bf16", FROZEN), layout)
    assert str(computed.value) == str(refused.value)


def test_host_budget_error_is_the_budget_modules(tmp_path):
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path), dtype="bf16")
    sizes = sizes_of("bf16")
    budget = minimum_host_budget(sizes, layout_of(**config)) - 1
    with pytest.raises(ValueError, match="host_budget") as refused:
        wrap(build(), **config, host_budget=budget)
    with pytest.raises(ValueError) as computed:
        check_host_budget(sizes, layout_of(**config, host_budget=budget))
    assert str(computed.value) == str(refused.value)
