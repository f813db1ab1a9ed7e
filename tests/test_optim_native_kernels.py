"""The native SGD, Adagrad and RMSprop kernels ([Note: native elementwise kernels] in
offload/optim/native_kernels.py): bit for bit the generic path they replace (the optimizer's
own single-tensor step on 1-D views) on every instruction set this CPU runs, for every
gradient dtype, gradient factor, alignment and length (vector tails, thread splits), and
through the engine in a bf16 run with clipping; and routed only where their settings are
the kernels'. Adagrad and RMSprop compare under correctly_rounded_sqrt, as the Adam tests
do: torch's CPU sqrt (MKL) is not correctly rounded, the kernels' is."""
import contextlib

import pytest
import torch

from offload import _native
from offload.optim import native_kernels
from offload.optim.adam_ranges import step_elementwise
from offload.optim.generic import ParamStep, probe
from offload.optim.several import GroupRule

from support import correctly_rounded_sqrt

ISAS = _native.adam_available_isas()

SGD = {
    "plain": dict(lr=0.05),
    "momentum": dict(lr=0.05, momentum=0.9),
    "momentum-dampening-wd": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "nesterov-wd": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}
ADAGRAD = {
    "plain": dict(lr=0.05),
    "decay-wd-accumulator": dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-6),
}
RMSPROP = {
    "plain": dict(lr=0.01),
    "momentum-wd": dict(lr=0.01, momentum=0.9, weight_decay=0.01),
    "centered": dict(lr=0.01, centered=True),
    "centered-alpha-0.3": dict(lr=0.01, centered=True, alpha=0.3, eps=1e-4),  # lerp's other formula
}
# Lengths: one element, a partial vector, vectors and a tail, several thread ranges (the
# pool's grain is 64 Ki elements) and a tail.
NUMELS = [1, 7, 37, 1000, 2 * 65536 + 77]


@contextlib.contextmanager
def isa(name):
    previous = _native.adam_selected_isa()
    _native.adam_set_isa(name)
    try:
        yield
    finally:
        _native.adam_set_isa(previous)


def engine_steps(make, numel, offset, grad_dtype, grad_factor, native, num_steps=3):
    """``num_steps`` steps of one parameter through step_elementwise as the engine runs them
    (a ParamStep per update, settled first), on views starting ``offset`` elements into their
    buffers; returns (param, state slots) after."""
    gen = torch.Generator().manual_seed(numel + offset)
    param = torch.randn(numel + offset, generator=gen)[offset:]
    opt = make([torch.nn.Parameter(param.clone())])
    rule = probe(opt)
    group_rule = GroupRule(rule, 0, False)
    carried = rule.carried_state([("p", p) for p in opt.param_groups[0]["params"]])
    previous, initial = 0, (None, None)
    for step, *carried_slots in carried.values():  # Adagrad's state, made by its constructor
        previous, initial = step, carried_slots
    slots = [None, None]
    for i in range(len(rule.slots)):
        slots[i] = torch.full((numel + offset,), float("nan"))[offset:]  # SGD's: written before read
        if initial[i] is not None:
            slots[i].copy_(initial[i].detach().reshape(-1))
    group = opt.param_groups[0]
    for k in range(num_steps):
        grad = (torch.randn(numel, generator=gen) * (k + 1)).to(grad_dtype)
        step = ParamStep.after(previous)
        rule.settle(step, 0, group)
        step_elementwise(group_rule, torch.Size([numel]), group, step, grad, grad_factor, param, tuple(slots),
                         None, None, native=native)
        previous = step
    return param, [s for s in slots if s is not None]


def assert_kernel_equals_generic(make, numel, offset, grad_dtype, grad_factor, sqrt=False):
    # Both runs: RMSprop's first step, which makes its state, is the generic path's in each.
    with correctly_rounded_sqrt() if sqrt else contextlib.nullcontext():
        want = engine_steps(make, numel, offset, grad_dtype, grad_factor, native=False)
        got = engine_steps(make, numel, offset, grad_dtype, grad_factor, native=True)
    for a, b in zip([got[0]] + got[1], [want[0]] + want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("config", list(SGD))
@pytest.mark.parametrize("numel", NUMELS)
def test_sgd_kernel_equals_the_generic_step_bit_for_bit_on_every_isa(isa_name, config, numel):
    make = lambda p: torch.optim.SGD(p, **SGD[config])  # noqa: E731
    with isa(isa_name):
        for offset, grad_dtype, factor in [(0, torch.float32, 1.0), (3, torch.float32, 0.37),
                                           (1, torch.bfloat16, 1.0), (5, torch.float16, 0.5)]:
            assert_kernel_equals_generic(make, numel, offset, grad_dtype, factor)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("config", list(ADAGRAD))
@pytest.mark.parametrize("numel", NUMELS)
def test_adagrad_kernel_equals_the_generic_step_bit_for_bit_on_every_isa(isa_name, config, numel):
    make = lambda p: torch.optim.Adagrad(p, **ADAGRAD[config])  # noqa: E731
    with isa(isa_name):
        for offset, grad_dtype, factor in [(0, torch.float32, 1.0), (3, torch.float32, 0.37),
                                           (1, torch.bfloat16, 1.0), (5, torch.float16, 0.5)]:
            assert_kernel_equals_generic(make, numel, offset, grad_dtype, factor, sqrt=True)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("config", list(RMSPROP))
@pytest.mark.parametrize("numel", NUMELS)
def test_rmsprop_kernel_equals_the_generic_step_bit_for_bit_on_every_isa(isa_name, config, numel):
    """The first step makes the state (the generic path), the next two run the kernel."""
    make = lambda p: torch.optim.RMSprop(p, **RMSPROP[config])  # noqa: E731
    with isa(isa_name):
        for offset, grad_dtype, factor in [(0, torch.float32, 1.0), (3, torch.float32, 0.37),
                                           (1, torch.bfloat16, 1.0), (5, torch.float16, 0.5)]:
            assert_kernel_equals_generic(make, numel, offset, grad_dtype, factor, sqrt=True)


@pytest.mark.parametrize("isa_name", ISAS)
def test_sgd_kernel_equals_torch_sgd_on_a_parameter(isa_name):
    """Three steps of sgd_step_flat on one flat parameter against torch.optim.SGD's own
    (default, foreach=False) step: the momentum buffer starts as the decayed gradient."""
    gen = torch.Generator().manual_seed(0)
    numel = 3 * 65536 + 5
    p = torch.nn.Parameter(torch.randn(numel, generator=gen))
    mine, buf = p.detach().clone(), torch.empty(numel)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.02, foreach=False)
    with isa(isa_name):
        for k in range(3):
            p.grad = torch.randn(numel, generator=gen)
            native_kernels.sgd_step_flat(mine, p.grad, buf, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.02,
                                         nesterov=True, first_step=k == 0)
            opt.step()
            assert torch.equal(mine, p.detach()) and torch.equal(buf, opt.state[p]["momentum_buffer"])


def route(opt, group_index=0):
    return native_kernels.kernel_for(probe(opt), group_index, opt.param_groups[group_index])


class MySGD(torch.optim.SGD):
    pass


def test_only_settings_the_kernels_implement_are_routed_to_them():
    p = [torch.nn.Parameter(torch.randn(4))]
    for kw in SGD.values():
        assert route(torch.optim.SGD(p, **kw)) is not None, kw
    for kw in ADAGRAD.values():
        assert route(torch.optim.Adagrad(p, **kw)) is not None, kw
    for kw in RMSPROP.values():
        assert route(torch.optim.RMSprop(p, **kw)) is not None, kw
    assert route(torch.optim.RMSprop(p, lr=0.1, maximize=True)) is None
    assert route(torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)) is not None  # the runner is single-tensor
    assert route(torch.optim.SGD(p, lr=0.1, momentum=0.9, maximize=True)) is None
    assert route(torch.optim.SGD(p, lr=torch.tensor(0.1), momentum=0.9)) is None
    assert route(torch.optim.Adagrad(p, lr=0.1, maximize=True)) is None
    assert route(MySGD(p, lr=0.1, momentum=0.9)) is None  # a subclass may override step()
    assert route(torch.optim.Adamax(p, lr=0.1)) is None
    opt = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    opt.param_groups[0]["differentiable"] = True
    assert route(opt) is None


def test_the_flat_steps_refuse_bad_buffers():
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="momentum_buffer is required"):
        native_kernels.sgd_step_flat(p, g, None, lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False,
                                     first_step=True)
    with pytest.raises(ValueError, match="grad has 7 elements"):
        native_kernels.sgd_step_flat(p, torch.zeros(7), None, lr=0.1, momentum=0, dampening=0, weight_decay=0,
                                     nesterov=False, first_step=True)
    with pytest.raises(TypeError, match="state_sum has dtype"):
        native_kernels.adagrad_step_flat(p, g, torch.zeros(8, dtype=torch.float64), lr=0.1, lr_decay=0,
                                         weight_decay=0, eps=1e-10, step=1)
    with pytest.raises(ValueError, match="must not overlap"):
        native_kernels.adagrad_step_flat(p, g, p, lr=0.1, lr_decay=0, weight_decay=0, eps=1e-10, step=1)
    with pytest.raises(ValueError, match="grad_avg is required where centered"):
        native_kernels.rmsprop_step_flat(p, g, torch.zeros(8), None, None, lr=0.1, alpha=0.99, eps=1e-8,
                                         weight_decay=0, momentum=0, centered=True)
    with pytest.raises(ValueError, match="must not overlap"):
        native_kernels.rmsprop_step_flat(p, g, torch.zeros(8), None, g, lr=0.1, alpha=0.99, eps=1e-8,
                                         weight_decay=0, momentum=0.9, centered=False)


@pytest.mark.parametrize("name,make", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    ("rmsprop", lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, weight_decay=0.01)),
])
def test_a_bf16_engine_run_with_clipping_equals_the_generic_path(name, make, tmp_path, monkeypatch):
    """Through the engine, in bf16 (16-bit gradients read by the kernel as they are, the
    compute copy rounded from the master) with clipping that triggers every step: the run
    on the kernels equals the run with kernel_for routing nothing, bit for bit."""
    import offload
    from offload.gpt import GPT
    from support import CFG, batches, train_offload

    calls = []
    results = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if native:  # count the ranges the kernels step
                for flat in ("sgd_step_flat", "adagrad_step_flat", "rmsprop_step_flat"):
                    kernel = getattr(native_kernels, flat)
                    patch.setattr(native_kernels, flat, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
            else:
                patch.setattr(native_kernels, "kernel_for", lambda *a: None)
            torch.manual_seed(0)
            model = GPT(CFG)
            config = dict(param_tier="host", optimizer_tier="host", dtype="bf16", max_grad_norm=0.05,
                          swap_dir=str(tmp_path / f"swap{native}"))
            with correctly_rounded_sqrt(), offload.wrap(model, make(model.parameters()), config=config) as engine:
                train_offload(engine, batches(4))
                results.append((engine.state_dict(), engine.stats()["grad_norm"]))
    assert calls
    (a, norm_a), (b, norm_b) = results
    assert norm_a == norm_b and norm_a > 0.05
    for k in a:
        assert torch.equal(a[k], b[k]), k
