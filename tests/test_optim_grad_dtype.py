"""[Note: 16-bit gradients] With a 16-bit compute dtype, adopted gradients (CPU device, one
rank) and one backward a step, gradients are held, and spilled, in the compute dtype: the
run computes what holding them in fp32 computed, bit for bit, with half the gradient bytes.
The fp32-held run is the same engine with ``Layout.grad_dtype`` forced to fp32, which is
what it held before."""
import pytest
import torch

import offload
from offload.gpt import GPT
from offload.memory.budget import UnitSizes, host_bytes, minimum_host_budget
from offload.memory.layout import Layout
from offload.optim import squares

from support import CFG, assert_same_state, batches, gpt_loss, make_opt, train_gpt

MIXED_NORM = 6.0  # clips on some of the small GPT's first steps and not on others (test_optim_grad_spill)
NUM_STEPS = 6


def held_in_fp32(monkeypatch):
    """Gradients held in fp32 whatever the compute dtype, as before [Note: 16-bit gradients]."""
    monkeypatch.setattr(Layout, "grad_dtype", property(lambda self: torch.float32))


def config(tmp_path, name, tiers, **kw):
    return dict(param_tier=tiers, optimizer_tier=tiers, swap_dir=str(tmp_path / name),
                device_budget=140 * 1024 * 2, **kw)


def trainable_numel():
    return sum(p.numel() for p in GPT(CFG).parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099, 2**20 + 3])
def test_norm_of_a_16bit_gradient_is_that_of_its_fp32_copy(dtype, numel):
    """The norm's squares read the 16-bit gradient where they read its fp32 copy before:
    ``vector_norm(..., dtype=float32)`` widens each element first, so the bits agree
    (large and tiny magnitudes included)."""
    torch.manual_seed(numel)
    g = (torch.randn(numel) * torch.logspace(-6, 3, numel)).to(dtype)
    ours = torch.linalg.vector_norm(g, dtype=torch.float32)
    ref = torch.linalg.vector_norm(g.to(torch.float32), dtype=torch.float32)
    assert ours.view(torch.int32).item() == ref.view(torch.int32).item()


@pytest.mark.host_device
@pytest.mark.parametrize("tiers", ["host", "nvme"])
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_gradients_compute_what_fp32_gradients_did(dtype, speculative, tiers, tmp_path, monkeypatch):
    """Clipping on some steps and not others (fp16: with loss scaling), speculative
    updates or not: losses, weights, optimizer states and norms are those of the run that
    held its gradients in fp32, and the engine counts half the gradient bytes."""
    kw = dict(dtype=dtype, max_grad_norm=MIXED_NORM, speculative_updates=speculative)
    data = batches(NUM_STEPS)
    ours = train_gpt(config(tmp_path, "ours", tiers, **kw), data)
    held_in_fp32(monkeypatch)
    ref = train_gpt(config(tmp_path, "ref", tiers, **kw), data)
    assert ours[0] == ref[0], "losses differ"
    assert_same_state(ours[1], ref[1])
    assert ours[3] == ref[3], "grad norms differ"
    assert ours[2]["gradient_bytes"] == 2 * trainable_numel()
    assert ref[2]["gradient_bytes"] == 4 * trainable_numel()


@pytest.mark.host_device
@pytest.mark.parametrize("speculative", [True, False])
def test_spilled_16bit_gradients_compute_what_spilled_fp32_gradients_did(speculative, tmp_path, monkeypatch):
    """Each run at the smallest budget it accepts (one unit's gradients in RAM), so both
    spill: the 16-bit run's extents are half the size (page-padded) and it computes the
    same bits."""
    kw = dict(dtype="bf16", max_grad_norm=MIXED_NORM, speculative_updates=speculative)
    data = batches(NUM_STEPS)

    def run(name):
        probe = GPT(CFG)
        with offload.wrap(probe, make_opt(probe.parameters()), config=config(tmp_path, "probe" + name, "nvme", **kw)) as e:
            budget = minimum_host_budget([UnitSizes.of(u) for u in e.units], e.layout)
        torch.manual_seed(0)
        model = GPT(CFG)
        with offload.wrap(model, make_opt(model.parameters()),
                          config=config(tmp_path, "extents" + name, "nvme", host_budget=budget, **kw)) as e:
            extents = [(u.grad_numel, u.grad_home.nbytes) for u in e.units if u.trainable]
        return extents, train_gpt(config(tmp_path, name, "nvme", host_budget=budget, **kw), data)

    extents, ours = run("ours")
    held_in_fp32(monkeypatch)
    ref_extents, ref = run("ref")
    assert extents == [(n, -(-2 * n // 4096) * 4096) for n, _ in ref_extents]
    assert ref_extents == [(n, -(-4 * n // 4096) * 4096) for n, _ in ref_extents]
    assert ours[0] == ref[0], "losses differ"
    assert_same_state(ours[1], ref[1])
    assert ours[3] == ref[3], "grad norms differ"
    assert ours[2]["spilled_gradient_bytes"] > 0 and ref[2]["spilled_gradient_bytes"] > 0


@pytest.mark.host_device
@pytest.mark.parametrize("host_budget", ["none", "planned", "smallest"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_second_backward_before_step_sums_in_fp32(dtype, host_budget, tmp_path, monkeypatch):
    """Two backward passes before each step() with gradient_accumulation_steps 1, as with
    plain PyTorch: each parameter's second gradient is added to the fp32 copy of the first
    (held in RAM, or read back from a 16-bit extent: such a unit then stays in RAM), as the
    fp32-held run added it. Bit for bit that run. At a budget of exactly the planned host
    bytes (no spill) the widened copies go past the plan's 16-bit gradients softly: the run
    goes on."""
    kw = dict(dtype=dtype, max_grad_norm=MIXED_NORM, speculative_updates=False)
    data = batches(2 * 4)

    def run(name):
        budget = None
        if host_budget != "none":
            probe = GPT(CFG)
            with offload.wrap(probe, make_opt(probe.parameters()),
                              config=config(tmp_path, "probe" + name, "nvme", **kw)) as e:
                sizes = [UnitSizes.of(u) for u in e.units]
                budget = minimum_host_budget(sizes, e.layout) if host_budget == "smallest" else \
                    host_bytes(sizes, e.layout).total
        torch.manual_seed(0)
        model = GPT(CFG)
        losses = []
        with offload.wrap(model, make_opt(model.parameters()),
                          config=config(tmp_path, name, "nvme", host_budget=budget, **kw)) as engine:
            for a, b in zip(data[::2], data[1::2]):
                for x in (a, b):
                    loss = gpt_loss(engine, x)
                    engine.backward(loss)
                    losses.append(loss.item())
                engine.step()
            return losses, engine.state_dict(), engine.stats(), budget

    ours = run("ours")
    held_in_fp32(monkeypatch)
    ref = run("ref")
    assert ours[0] == ref[0], "losses differ"
    assert_same_state(ours[1], ref[1])
    if host_budget == "smallest":
        assert ours[2]["spilled_gradient_bytes"] > 0
    if host_budget == "planned":
        assert ours[2]["spilled_gradient_bytes"] == 0
        assert ours[2]["host_peak_bytes"] > ours[3]  # the widened copies, past the plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_squares_of_a_gradient_chunk_by_chunk(dtype, monkeypatch):
    """[Note: gradient squares] Up to a chunk: one vector_norm's square, the engine's formula
    before. Longer: the chunks' squares added in float64 in order, the same bits whether the
    gradient is held in 16 bits or as its fp32 copy (the scratch a 16-bit one is widened
    into is reused, and asked for only then), and nearer the float64 sum of squares than
    one vector_norm over the whole."""
    monkeypatch.setattr(squares, "SQUARES_CHUNK_NUMEL", 1 << 12)
    torch.manual_seed(0)
    scratch = torch.full((1 << 12,), float("nan"))
    asked = []

    def scratch_for():
        asked.append(1)
        return scratch

    def ours(g):
        return squares.grad_squares(g, scratch_for)

    def one_norm(g):
        return torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2

    short = torch.randn(1 << 12).to(dtype)
    assert ours(short).item() == one_norm(short).item()
    long = (torch.randn(3 * (1 << 12) + 5) * 1e-3).to(dtype)
    expected = torch.zeros((), dtype=torch.float64)
    for a in range(0, long.numel(), 1 << 12):
        expected = expected + one_norm(long[a:a + (1 << 12)])
    assert ours(long).item() == expected.item() == ours(long.to(torch.float32)).item()
    assert (len(asked) > 0) == (dtype != torch.float32)
    big = (torch.randn(1 << 22) * 1e-3).to(dtype)
    exact = (big.double() ** 2).sum().item()
    assert abs(ours(big).item() - exact) < abs(one_norm(big).item() - exact)
