"""`offload plan --device` (issue 37 with #43's notes): on CUDA, and on its CPU stand-in
(OFFLOAD_DEVICE_STANDIN=cuda, which wrap runs as CUDA), the host holds what a CPU device
does not: pinned fetch staging buffers for reads from NVMe, fp32 gradient buffers, staging
slots with a compute piece. The plan counts them from wrap's own arithmetic
(budget.host_bytes, budget.fetch_buffer_numels), so its host bytes are what wrap
allocates; on a CPU device the plan is what it was."""
import json
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload import plan
from offload.gpt import GPT, GPTConfig
from offload.memory.budget import host_bytes
from offload.tiers.streams import STANDIN_ENV

CFG = GPTConfig(d_model=64, num_layers=3, num_heads=2, seq_len=32)
CUDA = torch.device("cuda")  # a plan for a GPU needs no GPU


def shape():
    with torch.device("meta"):
        return plan.shape_from_module(GPT(CFG), "gpt")


# With clipping every gradient of the step is held until step(), so the host's peak is the
# plan's whole need. (param_tier "host" with NVMe states is left out: clipping makes its
# updates speculative, whose spare compute copies on the host the table's rows do not count
# on any device, as they do not count --max-grad-norm.)
@pytest.mark.parametrize("case", ["nvme-nvme-bf16", "nvme-nvme-fp32", "nvme-host-bf16", "host-host-bf16",
                                  "device-nvme-bf16"])
def test_plan_on_the_cuda_standin_is_what_wrap_allocates_on_the_host(case, tmp_path, monkeypatch):
    *tiers, dtype = case.split("-")
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    for_cuda = plan.place(shape(), dtype, *tiers, device=CUDA)
    monkeypatch.setenv(STANDIN_ENV, "cuda")
    planned = plan.place(shape(), dtype, *tiers)  # device "cpu", which the stand-in runs as CUDA
    assert planned == for_cuda
    fetch = planned.host_parts["fetch staging buffers"]
    assert (fetch > 0) == (tiers[0] == "nvme")

    def wrap(**budgets):
        torch.manual_seed(0)
        model = GPT(CFG)
        return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            dict(device="cpu", param_tier=tiers[0], optimizer_tier=tiers[1], dtype=dtype,
                                 swap_dir=str(tmp_path), max_grad_norm=1.0, **budgets))

    with wrap(host_budget=planned.host_bytes) as engine:
        host = engine.debug.host
        # at wrap: everything but the gradients, which backward's buffers hold
        assert host.planned_bytes == planned.host_bytes - planned.host_parts["gradients"]
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
        loss = engine(x, x)
        engine.backward(loss)
        assert host.planned_bytes == planned.host_bytes  # every gradient held, until step()
        # besides the plan: the placeholders' one-byte answers ([Note: released parameters])
        unplanned = host.used_bytes - host.planned_bytes
        assert 0 < unplanned < 8
        engine.step()
        assert engine.stats()["host_peak_bytes"] == planned.host_bytes + unplanned
    # no gradient spill on CUDA: one byte less is refused, naming the budget
    with pytest.raises(ValueError, match="host_budget"):
        wrap(host_budget=planned.host_bytes - 1)


def test_the_plan_of_a_cpu_device_has_no_fetch_staging_and_auto_is_what_wrap_resolves(monkeypatch):
    monkeypatch.delenv(STANDIN_ENV, raising=False)
    assert plan.plan_device("auto") == offload.OffloadConfig(device="auto").resolved_device()  # the CPU here
    assert plan.plan_device("cuda") == CUDA
    with pytest.raises(ValueError, match="--device"):
        plan.plan_device("tpu")
    s = shape()
    for tiers in plan.CONFIGURATIONS:
        on_cpu = plan.place(s, "bf16", *tiers, device=plan.plan_device("cpu"))
        assert on_cpu == plan.place(s, "bf16", *tiers)
        assert "fetch staging buffers" not in on_cpu.host_parts
        layout = plan._layout("bf16", *tiers, 3, True)
        sizes = [u.sizes(2) for u in s.units]
        assert on_cpu.host_bytes == host_bytes(sizes, layout).total
        on_cuda = plan.place(s, "bf16", *tiers, device=CUDA)
        # fp32 gradient buffers, not bf16 ones; fetch staging where compute copies are read from NVMe
        assert on_cuda.host_parts["gradients"] == 2 * on_cpu.host_parts["gradients"]
        assert (on_cuda.host_parts["fetch staging buffers"] > 0) == (tiers[0] == "nvme")


def run_plan(*args, standin=False):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    env.pop(STANDIN_ENV, None)
    if standin:
        env[STANDIN_ENV] = "cuda"
    return subprocess.run([sys.executable, "-m", "offload", "plan", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_plan_command_takes_the_device_and_runs_on_the_standin(tmp_path):
    common = ("--params", "2e6", "--num-units", "3", "--host-budget", "1GiB")
    outputs = {}
    for name, extra, standin in (("default", (), False), ("cpu", ("--device", "cpu"), False),
                                 ("cuda", ("--device", "cuda"), False), ("standin", (), True)):
        path = tmp_path / f"{name}.json"
        result = run_plan(*common, *extra, "--json", str(path), standin=standin)
        assert result.returncode == 0, result.stderr
        outputs[name] = (result.stdout, json.loads(path.read_text()))
    rows = {name: [(c["param_tier"], c["optimizer_tier"], c["host_bytes"], c["host_parts"])
                   for c in report["configurations"]] for name, (_, report) in outputs.items()}
    assert rows["default"] == rows["cpu"]  # no GPU in the tests: auto is the CPU
    assert rows["standin"] == rows["cuda"] != rows["cpu"]
    assert outputs["cuda"][1]["device"] == "cuda" and not outputs["cuda"][1]["device_is_host"]
    assert outputs["cpu"][1]["device_is_host"] and not outputs["standin"][1]["device_is_host"]
    assert "fetch staging" in outputs["cuda"][0] and "fetch staging" not in outputs["cpu"][0]
    assert all("fetch staging buffers" not in parts for *_, parts in rows["cpu"])
    nvme_rows = [parts for p, _, _, parts in rows["cuda"] if p == "nvme"]
    assert nvme_rows and all(parts["fetch staging buffers"] > 0 for parts in nvme_rows)
    bad = run_plan(*common, "--device", "tpu")
    assert bad.returncode == 2 and "--device" in bad.stderr


def test_compact_states_with_param_tier_device_are_refused_rows_on_cuda(tmp_path):
    """wrap refuses compact states with compute copies on an accelerator: the plan says so
    per row instead of failing."""
    text, _ = plan.report(shape(), "bf16", plan.DEFAULT_PROFILE, None, None, None, 3, None, 2048,
                          optimizer_states="compact", device=CUDA)
    refused = [line for line in text.splitlines() if "refused: " in line]
    assert [line.split()[:2] for line in refused] == [["device", "host"], ["device", "nvme"]]
    report = plan.as_json(shape(), "bf16", plan.DEFAULT_PROFILE, None, None, None, 3, None, 2048, auto={},
                          optimizer_states="compact", device=CUDA)
    refused = [c for c in report["configurations"] if "refused" in c]
    assert [(c["param_tier"], c["fits"]) for c in refused] == [("device", False)] * 2
    assert all("param_tier" in c["refused"] for c in refused)
