"""optimizer_states="compact": the config field, wrap's refusals, the codec's round-trip
bounds ([Note: compact optimizer states], offload/memory/compact_codec.py) and the compact
Adam/AdamW step against a float64 reference of the same rule written here, and the fused
native step against the torch-ops one (its scalar reference) bit for bit on every ISA."""
import contextlib
import dataclasses
import math

import pytest
import torch
from torch import nn

import offload
from offload import _native
from offload.memory.compact_codec import (BLOCK_NUMEL, NonFiniteStateError, compact_padded_numel,
                                          compact_state_bytes,
                                          decode_exp_avg, decode_exp_avg_sq, decode_master, encode_exp_avg,
                                          encode_exp_avg_sq, encode_master, num_blocks, ulp_of_bf16)
from offload.memory.layout import Layout
from offload.optim import compact as offload_compact
from offload.optim.compact import CompactRange, compact_adam_step, compact_adam_step_reference, compact_constants

F32_TINY = 2.0 ** -149  # the smallest fp32 subnormal: the absolute rounding of subnormal results


# ------------------------------------------------------------------ the config field and wrap

def test_optimizer_states_defaults_to_exact_and_names_itself_when_wrong():
    assert offload.OffloadConfig().optimizer_states == "exact"
    assert offload.OffloadConfig.from_dict({"optimizer_states": "compact"}).optimizer_states == "compact"
    for bad in ("fast", "Compact", True, None, 8):
        with pytest.raises(ValueError, match="optimizer_states: .*accepted values are 'exact', 'compact'"):
            offload.OffloadConfig(optimizer_states=bad)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _model():
    torch.manual_seed(0)
    return _Net()


@pytest.mark.parametrize("optimizer,values,why", [
    ("sgd", {"dtype": "bf16"}, "SGD is not torch.optim.Adam/AdamW"),
    ("adamw", {"dtype": "fp32"}, "needs dtype='bf16'"),
    ("adamw", {"dtype": "bf16", "delayed_update": True, "param_tier": "host"}, "delayed_update=True"),
])
def test_wrap_refuses_compact_naming_the_field_and_the_reason_before_touching_the_model(optimizer, values, why):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=0.1),
           "adam": lambda: torch.optim.Adam(params, lr=0.1),
           "adamw": lambda: torch.optim.AdamW(params, lr=0.1)}[optimizer]()
    config = offload.OffloadConfig(device="cpu", optimizer_states="compact", **values)
    with pytest.raises(ValueError, match=f"optimizer_states: .*{why}"):
        offload.wrap(model, opt, config)
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the model was not taken: an exact wrap of it trains
    with offload.wrap(model, torch.optim.AdamW(params, lr=0.1), offload.OffloadConfig(device="cpu")) as engine:
        engine.backward(engine(torch.ones(3, 8)).sum())
        engine.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_ignores_the_stage_with_compact_states_as_with_exact_ones(stage, tmp_path):
    """One process has no ranks to shard among: a ZeRO stage is ignored with Partition's
    warning, for compact states as for exact ones, and the run is stage 0's bit for bit
    (host homes; compute copies and compact homes on NVMe at stage 3, the home stage 3 asks for)."""
    from support import batches, train_gpt

    tiers = {"param_tier": "nvme", "optimizer_tier": "nvme"} if stage == 3 else {"param_tier": "host",
                                                                                 "optimizer_tier": "host"}
    config = dict(device="cpu", dtype="bf16", optimizer_states="compact", swap_dir=str(tmp_path), **tiers)
    data = batches(3)
    with pytest.warns(UserWarning, match=f"stage={stage} is ignored: this is a single process"):
        losses, state, stats, _ = train_gpt(dict(config, stage=stage), data)
    want_losses, want_state, want_stats, _ = train_gpt(dict(config, stage=0), data)
    assert losses == want_losses
    assert all(torch.equal(v, want_state[k]) for k, v in state.items())
    assert stats["optimizer_state_bytes"] == want_stats["optimizer_state_bytes"]
    assert not list(tmp_path.iterdir())  # both engines closed: their swap files are gone


def test_the_layout_takes_compact_on_host_and_nvme_tiers_but_not_an_accelerators_device_tier():
    config = offload.OffloadConfig(device="cpu", dtype="bf16", optimizer_states="compact",
                                   swap_dir="/nonexistent-offload", max_grad_norm=1.0)  # tiers "auto"
    for tiers in ({}, {"param_tier": "nvme", "optimizer_tier": "nvme"}, {"param_tier": "host", "optimizer_tier": "nvme"},
                  {"param_tier": "device", "optimizer_tier": "nvme"}, {"param_tier": "nvme", "optimizer_tier": "host"}):
        layout = Layout.resolve(dataclasses.replace(config, **tiers), torch.device("cpu"), None)
        # [Note: compact optimizer states] no split master: the compact home holds the low parts
        assert layout.compact_states and not layout.split_master, tiers
        # [Note: speculative updates] by default where the states are on NVMe, as exact states
        assert layout.speculative == (layout.optimizer_tier == "nvme" and layout.param_tier != "device"), tiers
    with pytest.raises(ValueError, match="optimizer_states: 'compact' is not available with param_tier='device' on an "
                                         "accelerator"):
        Layout.resolve(dataclasses.replace(config, param_tier="device"), torch.device("cuda"), None)
    assert not Layout.resolve(offload.OffloadConfig(device="cpu"), torch.device("cpu"), None).compact_states


# ------------------------------------------------------------------ the codec's bounds

def _moment_blocks(kind, numel=4 * BLOCK_NUMEL + 37, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(numel, generator=g)
    if kind == "heavy":  # Cauchy, scales over 12 decades: one outlier per block and tiny neighbours
        cauchy = torch.tan(math.pi * (torch.rand(numel, generator=g, dtype=torch.float64) - 0.5))
        return (cauchy * 10.0 ** (-12 * torch.rand(numel, generator=g, dtype=torch.float64))).float()
    if kind == "zero_blocks":
        x = torch.randn(numel, generator=g)
        x[BLOCK_NUMEL:3 * BLOCK_NUMEL] = 0
        return x
    if kind == "subnormal":  # a block of subnormals only (a subnormal scale), one mixed with normals
        x = torch.randn(numel, generator=g) * 1e-40
        x[2 * BLOCK_NUMEL:3 * BLOCK_NUMEL] = torch.randn(BLOCK_NUMEL, generator=g)
        assert (x[:BLOCK_NUMEL].abs() < 2.0 ** -126).all()
        return x
    raise AssertionError(kind)


def _per_element_scale(scales, numel):
    return scales.repeat_interleave(BLOCK_NUMEL)[:numel].double()


@pytest.mark.parametrize("kind", ["random", "heavy", "zero_blocks", "subnormal"])
def test_exp_avg_round_trip_within_half_a_level_in_the_square_root_domain(kind):
    m = _moment_blocks(kind)
    codes, scales = encode_exp_avg(m)
    assert codes.dtype == torch.int8 and scales.numel() == math.ceil(m.numel() / BLOCK_NUMEL)
    assert torch.equal(scales, torch.stack([b.abs().max() for b in m.split(BLOCK_NUMEL)]))
    back = decode_exp_avg(codes, scales).double()
    s = _per_element_scale(scales, m.numel())
    safe = torch.where(s == 0, torch.ones_like(s), s)
    u, u_back = (m.double().abs() / safe).sqrt(), (back.abs() / safe).sqrt()
    assert ((u_back - u).abs() <= 0.5 / 127 + 1e-6 + (F32_TINY / safe).sqrt()).all()
    assert (torch.sign(back) * torch.sign(m.double()) >= 0).all()  # never the other sign
    assert (back[s == 0] == 0).all() and (codes[(s == 0)] == 0).all()
    # the block's largest value comes back to within fp32 rounding
    top = m.double().abs() == s
    assert ((back[top].abs() - s[top]).abs() <= 4e-7 * s[top] + 2 * F32_TINY).all()


@pytest.mark.parametrize("kind", ["random", "heavy", "zero_blocks", "subnormal"])
def test_exp_avg_sq_round_trip_within_half_a_level_in_the_fourth_root_domain(kind):
    v = _moment_blocks(kind) ** 2
    codes, scales = encode_exp_avg_sq(v)
    assert codes.dtype == torch.uint8
    back = decode_exp_avg_sq(codes, scales).double()
    s = _per_element_scale(scales, v.numel())
    safe = torch.where(s == 0, torch.ones_like(s), s)
    w, w_back = (v.double() / safe) ** 0.25, (back / safe) ** 0.25
    kept = w >= 0.5 / 255
    assert ((w_back - w).abs()[kept] <= 0.5 / 255 + 1e-6 + (F32_TINY / safe[kept]) ** 0.25).all()
    # below half a level a nonzero v decodes to the smallest level, never to 0
    small = (~kept) & (v.double() > 0)
    assert (codes[small] == 1).all()
    assert (back[v.double() > 0] > 0).all() and (back[v == 0] == 0).all()


def test_the_master_comes_back_within_a_508th_of_a_bf16_ulp_across_the_fp32_range():
    g = torch.Generator().manual_seed(1)
    n = 20000
    x = (torch.randn(n, generator=g, dtype=torch.float64)
         * 10.0 ** (torch.rand(n, generator=g, dtype=torch.float64) * 76 - 38)).float()
    x[:4] = torch.tensor([0.0, -0.0, 1e-45, -3e-39])  # zero, the smallest subnormal, a subnormal
    x[4:8] = torch.tensor([1.0, 1.0 + 2.0 ** -8, 1.0 - 2.0 ** -24, 3.3e38])  # a tie, just below 2^0, large
    high, low = encode_master(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int8
    assert torch.equal(high, x.to(torch.bfloat16))  # the compute copy: rounded to nearest even
    back = decode_master(high, low).double()
    ulp = ulp_of_bf16(high).double()
    fp32_rounding = torch.maximum(x.double().abs() * 2.0 ** -24, torch.full_like(ulp, F32_TINY))
    assert ((back - x.double()).abs() <= ulp / 508 + fp32_rounding).all()
    assert torch.equal(ulp_of_bf16(torch.tensor([1.0, 0.0, 1e-40, -3.0]).bfloat16()),
                       torch.tensor([2.0 ** -7, 2.0 ** -133, 2.0 ** -133, 2.0 ** -6]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("state", ["exp_avg", "exp_avg_sq", "master"])
def test_a_non_finite_state_is_raised_naming_the_state_and_the_element(bad, state):
    x = torch.rand(3 * BLOCK_NUMEL)
    x[300] = bad
    encode = {"exp_avg": encode_exp_avg, "exp_avg_sq": encode_exp_avg_sq, "master": encode_master}[state]
    with pytest.raises(NonFiniteStateError, match=f"^{state}: 1 non-finite value.*element 300"):
        encode(x)


def test_a_master_beyond_bf16s_range_and_a_negative_second_moment_are_refused():
    with pytest.raises(NonFiniteStateError, match="master .*beyond bf16"):
        encode_master(torch.tensor([1.0, 3.4e38]))
    with pytest.raises(NonFiniteStateError, match="exp_avg_sq: negative value"):
        encode_exp_avg_sq(torch.tensor([1.0, -1e-30]))


def test_compact_states_take_three_bytes_per_parameter_and_two_scales_per_block():
    assert compact_state_bytes(BLOCK_NUMEL * 10) == 3 * BLOCK_NUMEL * 10 + 10 * 8
    assert compact_state_bytes(BLOCK_NUMEL + 1) == 3 * (BLOCK_NUMEL + 1) + 2 * 8
    states = CompactRange(1000)
    held = sum(t.numel() * t.element_size() for t in
               (states.low, states.exp_avg, states.exp_avg_scales, states.exp_avg_sq, states.exp_avg_sq_scales))
    assert held == compact_state_bytes(1000)


# ------------------------------------------------------------------ the step against float64

def _reference_step(states, grad, hp, step):
    """The rule of compact_adam_step in float64 from the same codes and the same fp32
    constants (compact_constants): decode, update, encode, every quantity in float64."""
    c = {k: float(v) for k, v in compact_constants(step=step, **hp).items()}
    n = states.numel
    per = lambda scales: scales.double().repeat_interleave(BLOCK_NUMEL)[:n]  # noqa: E731
    cm = states.exp_avg.double()
    m = torch.sign(cm) * (cm.abs() / 127) ** 2 * per(states.exp_avg_scales)
    v = (states.exp_avg_sq.double() / 255) ** 4 * per(states.exp_avg_sq_scales)
    high = states.high.double()
    ulp = ulp_of_bf16(states.high).double()
    x = high + states.low.double() * ulp / 254
    g = grad.double() * c["grad_scale"]
    if hp["adamw"]:
        x = x * c["decay"]
    else:
        g = g + x * c["decay"]
    m = m * c["beta1"] + g * c["one_minus_beta1"]
    v = v * c["beta2"] + g * g * c["one_minus_beta2"]
    update = m / (v.sqrt() / c["sqrt_bias_correction2"] + c["eps"]) * c["step_size"]
    operands = x.abs() + update.abs()  # what fp32's roundings are relative to (the result may cancel)
    x = x - update

    def blocks(t):
        pad = (-n) % BLOCK_NUMEL
        return torch.cat([t, t.new_zeros(pad)]).view(-1, BLOCK_NUMEL)

    mb, vb = blocks(m), blocks(v)
    sm, sv = mb.abs().amax(1, keepdim=True), vb.amax(1, keepdim=True)
    cm = torch.round(torch.sign(mb) * (mb.abs() / torch.where(sm == 0, 1.0, sm)).sqrt() * 127)
    cv = torch.round((vb / torch.where(sv == 0, 1.0, sv)) ** 0.25 * 255)
    cv = torch.where(vb > 0, cv.clamp(min=1), cv)
    return x, operands, cm.view(-1)[:n], sm.view(-1), cv.view(-1)[:n], sv.view(-1)


@pytest.mark.parametrize("adamw", [True, False])
def test_compact_step_follows_a_float64_reference_of_its_rule_for_50_steps(adamw):
    """Each step starts both from the compact states the step left: the codes agree with
    the float64 reference's within one level (fp32 against float64 arithmetic moves only
    values at a rounding boundary, so nearly all agree exactly), the scales to fp32
    rounding, and the master within its codec bound of the float64 result plus a few fp32
    roundings of the operands of its last subtraction (which may cancel)."""
    g = torch.Generator().manual_seed(3)
    n = 3 * BLOCK_NUMEL + 100  # a short last block
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw, grad_scale=0.5)
    states = CompactRange.from_exact(torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n))
    differing = 0
    for step in range(1, 51):
        grad = torch.randn(n, generator=g) * 10.0 ** (-3 * torch.rand(n, generator=g))
        grad[:BLOCK_NUMEL] = 0 if step % 10 == 0 else grad[:BLOCK_NUMEL]  # all-zero gradient blocks
        x_ref, operands, cm_ref, sm_ref, cv_ref, sv_ref = _reference_step(states, grad, hp, step)
        compact_adam_step(states, grad, step=step, **hp)
        for codes, ref in ((states.exp_avg, cm_ref), (states.exp_avg_sq, cv_ref)):
            delta = (codes.double() - ref).abs()
            assert delta.max() <= 1
            differing += int((delta != 0).sum())
        assert torch.allclose(states.exp_avg_scales.double(), sm_ref, rtol=1e-6, atol=0)
        assert torch.allclose(states.exp_avg_sq_scales.double(), sv_ref, rtol=1e-6, atol=0)
        ulp = ulp_of_bf16(states.high).double()
        assert ((states.master().double() - x_ref).abs() <= ulp / 508 + operands * 2.0 ** -22).all()
    assert differing <= 50 * 2 * n * 0.01  # at most 1% of the codes off by one level


def test_compact_step_moves_every_parameter_with_a_gradient_the_way_adamw_does():
    """Against exact fp32 AdamW, loosely: after 20 steps the compact master is within a
    few percent of the distance AdamW moved (the 8-bit moments' rounding, about 1.6% of a
    block's largest momentum, not a bug)."""
    g = torch.Generator().manual_seed(4)
    n = 2 * BLOCK_NUMEL
    start = torch.randn(n, generator=g).to(torch.bfloat16).float()
    target = torch.randn(n, generator=g)
    exact = start.clone().requires_grad_(True)
    opt = torch.optim.AdamW([exact], lr=1e-2, weight_decay=0.0)
    states = CompactRange.from_exact(start, torch.zeros(n), torch.zeros(n))
    for step in range(1, 21):
        opt.zero_grad()
        ((exact - target) ** 2).sum().backward()
        opt.step()
        compact_adam_step(states, 2 * (states.master() - target), step=step, lr=1e-2, beta1=0.9,
                          beta2=0.999, eps=1e-8, weight_decay=0.0)
    moved = (exact.detach() - start).abs()
    apart = (states.master() - exact.detach()).abs()
    # a wrong sign, bias correction or decay is off by a good part of ``moved``
    assert apart.max() <= 0.1 * moved.max() and apart.mean() <= 0.02 * moved.mean()  # measured: 6.5%, 1.1%


def test_a_non_finite_gradient_raises_and_leaves_the_states_as_they_were():
    n = 2 * BLOCK_NUMEL
    states = CompactRange.from_exact(torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01)
    before = [t.clone() for t in (states.high, states.low, states.exp_avg, states.exp_avg_scales,
                                  states.exp_avg_sq, states.exp_avg_sq_scales)]
    grad = torch.randn(n)
    grad[7] = float("nan")
    with pytest.raises(NonFiniteStateError, match="exp_avg: 1 non-finite value.*element 7"):
        compact_adam_step(states, grad, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    after = (states.high, states.low, states.exp_avg, states.exp_avg_scales, states.exp_avg_sq,
             states.exp_avg_sq_scales)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_compact_step_gives_the_same_bits_on_one_thread_and_many():
    """torch's threads (the reference's ops) and the native pool's (the kernel's ranges)."""
    g = torch.Generator().manual_seed(5)
    n = 2 * 512 * BLOCK_NUMEL + 3  # past two grains of the native pool, so its threads split it
    start = (torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(3)]
    results = []
    threads, native_threads = torch.get_num_threads(), _native.num_threads()
    for num_threads in (1, max(2, threads)):
        torch.set_num_threads(num_threads)
        _native.set_num_threads(num_threads)
        try:
            states = CompactRange.from_exact(*start)
            for step, grad in enumerate(grads, start=1):
                compact_adam_step(states, grad, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.01)
            results.append(states)
        finally:
            torch.set_num_threads(threads)
            _native.set_num_threads(native_threads)
    a, b = results
    for name in ("high", "low", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ------------------------------------------------------------------ the native kernel against the torch ops

STATE_FIELDS = ("high", "low", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales")


@contextlib.contextmanager
def forced_isa(name):
    if name not in _native.adam_available_isas():
        pytest.skip(f"this CPU cannot run the {name} kernel")
    previous = _native.adam_selected_isa()
    _native.adam_set_isa(name)
    try:
        yield
    finally:
        _native.adam_set_isa(previous)


def _copy(states):
    copy = CompactRange.__new__(CompactRange)
    copy.numel = states.numel
    for name in STATE_FIELDS:
        setattr(copy, name, getattr(states, name).clone())
    return copy


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def _assert_same_bits(native, reference, where):
    for name in STATE_FIELDS:
        a, b = _bits(getattr(native, name)), _bits(getattr(reference, name))
        differ = (a != b).nonzero().flatten()
        assert differ.numel() == 0, (f"{where}: {name} differs at {differ.numel()} element(s), the first "
                                     f"{differ[:4].tolist()}: native {getattr(native, name)[differ[:4]].tolist()}, "
                                     f"torch ops {getattr(reference, name)[differ[:4]].tolist()}")


def _states_and_grads(kind, n, num_steps, g):
    """Start states and gradients: "random" (normal), "heavy" (six decades within each block,
    subnormal and huge masters, gradients with exact zeros), "zero" (all-zero moments and
    gradients in whole blocks, a zero master block)."""
    master = torch.randn(n, generator=g)
    exp_avg = torch.randn(n, generator=g) * 0.1
    exp_avg_sq = torch.rand(n, generator=g) * 0.01
    grads = [torch.randn(n, generator=g) for _ in range(num_steps)]
    if kind == "heavy":
        decades = lambda: 10.0 ** (-6 * torch.rand(n, generator=g))  # noqa: E731
        master = master * 10.0 ** (12 * torch.rand(n, generator=g) - 6)
        master[::17] = torch.randn(master[::17].shape, generator=g) * 1e-39  # subnormal
        master[5::19] = torch.randn(master[5::19].shape, generator=g) * 1e12  # (g + x * wd)^2 stays finite
        exp_avg, exp_avg_sq = exp_avg * decades(), exp_avg_sq * decades() ** 2
        grads = [grad * decades() ** 2 for grad in grads]
        for grad in grads:
            grad[::7] = 0
    if kind == "zero":
        exp_avg[:BLOCK_NUMEL] = 0
        exp_avg_sq[:BLOCK_NUMEL] = 0
        master[BLOCK_NUMEL:2 * BLOCK_NUMEL] = 0
        for k, grad in enumerate(grads):
            grad[:BLOCK_NUMEL] = 0
            if k % 2:
                grad[-BLOCK_NUMEL:] = 0
    return CompactRange.from_exact(master, exp_avg, exp_avg_sq), grads


# lengths: shorter than a vector, than a block, a block and a bit, not a multiple of 8 or 16,
# and past two grains of the native pool (its threads split it)
NATIVE_NUMELS = [1, 7, 13, BLOCK_NUMEL - 1, BLOCK_NUMEL, BLOCK_NUMEL + 9, 3 * BLOCK_NUMEL + 100, 2 * 512 * BLOCK_NUMEL + 77]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("kind", ["random", "heavy", "zero"])
def test_the_native_step_equals_the_torch_ops_step_bit_for_bit(isa, kind):
    """Every length, Adam and AdamW with and without weight decay, each gradient dtype and a
    grad_scale: four steps each, every state compared bit for bit after every step."""
    g = torch.Generator().manual_seed(11)
    cases = [(adamw, wd, dtype) for adamw in (True, False) for wd in (0.0, 0.1)
             for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    with forced_isa(isa):
        for n in NATIVE_NUMELS:
            for case, (adamw, wd, dtype) in enumerate(cases):
                if n > 10 * BLOCK_NUMEL and case % 6 != 4:  # the long one: Adam and AdamW, wd, bf16
                    continue
                native, grads = _states_and_grads(kind, n, 4, g)
                reference = _copy(native)
                for step, grad in enumerate(grads, start=1):
                    hp = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, adamw=adamw,
                              grad_scale=0.5 if step % 2 else 1.0)
                    grad = grad.to(dtype)
                    compact_adam_step(native, grad, **hp)
                    compact_adam_step_reference(reference, grad, **hp)
                    _assert_same_bits(native, reference, f"{isa} {kind} n={n} adamw={adamw} wd={wd} {dtype} step {step}")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_the_native_step_decodes_every_code_and_tiny_masters_as_the_torch_ops_step(isa):
    """Every exp_avg, exp_avg_sq and low code, beside highs of every bf16 exponent from 0
    (zero and subnormals, where the low part decodes below fp32's normal range) to 40 and
    around 1: the vector kernels' division-free decoding ([Note: compact kernel divisions]
    in native/compact/compact_simd.h) gives the torch-ops step's bits."""
    g = torch.Generator().manual_seed(13)
    n = 4 * BLOCK_NUMEL
    states = CompactRange(n)
    codes = torch.arange(n)
    states.exp_avg.copy_((codes % 255 - 127).to(torch.int8))
    states.exp_avg_sq.copy_((codes % 256).to(torch.uint8))
    states.low.copy_(((codes * 7) % 255 - 127).to(torch.int8))
    exponents = torch.where(codes < 2 * BLOCK_NUMEL, codes % 41, 120 + codes % 16)  # bf16 exponent fields
    sign = torch.where(codes % 3 == 0, 1, 0) << 15
    states.high.copy_(((exponents << 7) | (codes % 128) | sign).to(torch.int16).view(torch.bfloat16))
    states.exp_avg_scales.copy_(torch.rand(num_blocks(n), generator=g) * 0.1)
    states.exp_avg_sq_scales.copy_(torch.rand(num_blocks(n), generator=g) * 0.01)
    reference = _copy(states)
    with forced_isa(isa):
        for step in range(1, 4):
            grad = torch.randn(n, generator=g) * 1e-3
            hp = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=step != 2)
            compact_adam_step(states, grad, **hp)
            compact_adam_step_reference(reference, grad, **hp)
            _assert_same_bits(states, reference, f"{isa} step {step}")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_the_native_step_divides_where_its_reciprocals_would_not_be_exact(isa):
    """Blocks whose moment scales lie outside [2^-60, 2^100] (tiny gradients, subnormal
    second moments; huge gradients) and a bias correction of 0 (beta2 = 1): the kernels
    divide there ([Note: compact kernel divisions]), with the torch-ops step's bits."""
    g = torch.Generator().manual_seed(14)
    n = 3 * BLOCK_NUMEL + 5
    states = CompactRange.from_exact(torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-22,
                                     torch.rand(n, generator=g) * 1e-42)
    reference = _copy(states)
    scales = torch.ones(n)
    scales[:BLOCK_NUMEL] = 1e-21                   # v ~ 1e-45 (subnormal), m ~ 1e-22
    scales[BLOCK_NUMEL:2 * BLOCK_NUMEL] = 1e17     # v ~ 1e31 > 2^100
    with forced_isa(isa):
        for step, beta2 in ((1, 0.999), (2, 0.999), (3, 1.0)):
            grad = torch.randn(n, generator=g) * scales
            hp = dict(step=step, lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.1)
            compact_adam_step(states, grad, **hp)
            compact_adam_step_reference(reference, grad, **hp)
            _assert_same_bits(states, reference, f"{isa} step {step}")
    assert float(states.exp_avg_sq_scales[0]) < 2.0 ** -60 and float(states.exp_avg_sq_scales[1]) > 2.0 ** 100


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_an_overflowing_update_raises_naming_the_state_and_stores_the_blocks_without_one(isa):
    """A finite gradient whose square overflows fp32 (v = inf): both steps raise naming
    exp_avg_sq; the native one leaves the block that holds it as it was and stores the one
    before it, which equals that block stepped alone."""
    g = torch.Generator().manual_seed(12)
    n = 2 * BLOCK_NUMEL
    start = (torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01)
    grad = torch.randn(n, generator=g)
    grad[BLOCK_NUMEL + 3] = 3e19
    hp = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with forced_isa(isa):
        native = CompactRange.from_exact(*start)
        before = _copy(native)
        with pytest.raises(NonFiniteStateError, match=f"exp_avg_sq: .*element {BLOCK_NUMEL + 3} "):
            compact_adam_step(native, grad, **hp)
        with pytest.raises(NonFiniteStateError, match="exp_avg_sq"):
            compact_adam_step_reference(_copy(before), grad, **hp)
        first = _copy(before).range(0, BLOCK_NUMEL)
        compact_adam_step_reference(first, grad[:BLOCK_NUMEL], **hp)
        _assert_same_bits(native.range(0, BLOCK_NUMEL), first, "the block before")
        _assert_same_bits(native.range(BLOCK_NUMEL, n), before.range(BLOCK_NUMEL, n), "the block with it")


# ------------------------------------------------------------------ a unit of parameters

def test_a_unit_updates_each_parameter_as_alone_and_leaves_one_without_a_gradient_bit_for_bit():
    """Parameters start on block boundaries: one without a gradient keeps its codes and
    scales, and each updated one equals a CompactRange of that parameter alone stepped with
    its own group's hyperparameters, bit for bit."""
    g = torch.Generator().manual_seed(6)
    numels = [300, 5, 2 * BLOCK_NUMEL, 100]
    groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
              dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
    group_of = [0, 1, 0, 1]
    unit = offload_compact.CompactUnit(numels)
    assert unit.offsets == [0, 2 * BLOCK_NUMEL, 3 * BLOCK_NUMEL, 5 * BLOCK_NUMEL]
    alone = []
    for k, n in enumerate(numels):
        start = (torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01)
        unit.load_exact(k, *start)
        alone.append(CompactRange.from_exact(*start))
        assert all(torch.equal(a, b) for a, b in zip(unit.exact(k), (alone[k].master(),) + alone[k].moments()))
    steps = [0, 0, 0, 0]
    for step in range(3):
        grads = [torch.randn(n, generator=g) for n in numels]
        grads[1] = None  # parameter 1 gets no gradient
        before = {name: getattr(unit.param(1), name).clone()
                  for name in ("high", "low", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales")}
        steps = unit.step(grads, steps, [groups[i] for i in group_of])
        for k, grad in enumerate(grads):
            if grad is None:
                continue
            group = groups[group_of[k]]
            compact_adam_step(alone[k], grad, step=step + 1, lr=group["lr"], beta1=group["betas"][0],
                              beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"])
        for name, value in before.items():
            assert torch.equal(getattr(unit.param(1), name), value), name
    assert steps == [3, 0, 3, 3]
    for k in (0, 2, 3):
        for name in ("high", "low", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales"):
            assert torch.equal(getattr(unit.param(k), name), getattr(alone[k], name)), (k, name)
    # the padding after each parameter stays 0
    ends = [o + n for o, n in zip(unit.offsets, numels)]
    pad = torch.ones(unit.states.numel, dtype=torch.bool)
    for lo, hi in zip(unit.offsets, ends):
        pad[lo:hi] = False
    for name in ("high", "low", "exp_avg", "exp_avg_sq"):
        assert (getattr(unit.states, name)[pad].float() == 0).all(), name
    held = sum(t.numel() * t.element_size() for t in (unit.states.low, unit.states.exp_avg, unit.states.exp_avg_sq,
                                                      unit.states.exp_avg_scales, unit.states.exp_avg_sq_scales))
    assert held == offload_compact.compact_unit_bytes(numels) == compact_state_bytes(6 * BLOCK_NUMEL)


def test_loading_exact_states_that_are_not_finite_raises_and_keeps_the_parameters_states():
    unit = offload_compact.CompactUnit([10, 10])
    unit.load_exact(0, torch.ones(10), torch.full((10,), 0.5), torch.full((10,), 0.25))
    before = [t.clone() for t in unit.exact(0)]
    bad = torch.full((10,), 0.25)
    bad[3] = float("inf")
    with pytest.raises(NonFiniteStateError, match="exp_avg_sq: 1 non-finite value.*element 3"):
        unit.load_exact(0, torch.ones(10), torch.zeros(10), bad)
    assert all(torch.equal(a, b) for a, b in zip(before, unit.exact(0)))
    master, exp_avg, exp_avg_sq = unit.exact(0)
    assert torch.equal(master, torch.ones(10)) and torch.equal(exp_avg, torch.full((10,), 0.5))
    assert torch.equal(exp_avg_sq, torch.full((10,), 0.25))  # a block's largest value comes back exactly


def test_a_unit_over_a_home_buffer_and_compute_copy_views_steps_the_same_bits_and_holds_them_there():
    """What a host home gives a CompactUnit: one uint8 buffer of compact_unit_bytes (every
    code and scale lives in it) and the high parts as views of the unit's compute copy (not
    held twice). Same bits as a unit with tensors of its own, through load_exact and steps."""
    g = torch.Generator().manual_seed(8)
    numels = [300, 7, BLOCK_NUMEL]
    group = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    buffer = torch.full((offload_compact.compact_unit_bytes(numels),), 0, dtype=torch.uint8)
    compute = torch.zeros(1000, dtype=torch.bfloat16)  # a compute copy: parameters at 0, 400, 500
    offsets = [0, 400, 500]
    homed = offload_compact.CompactUnit(numels, buffer=buffer,
                                        highs=[compute[o:o + n] for o, n in zip(offsets, numels)])
    own = offload_compact.CompactUnit(numels)
    assert homed.padded_numel == own.padded_numel == compact_padded_numel(numels) == 4 * BLOCK_NUMEL
    for k, n in enumerate(numels):
        start = (torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01)
        homed.load_exact(k, *start)
        own.load_exact(k, *start)
    steps = [0, 0, 0]
    for _ in range(3):
        grads = [torch.randn(n, generator=g) for n in numels]
        steps = homed.step(grads, steps, [group] * 3)
        own.step(grads, [s - 1 for s in steps], [group] * 3)
    for k, o in enumerate(offsets):
        for name in ("high", "low", "exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales"):
            assert torch.equal(getattr(homed.param(k), name), getattr(own.param(k), name)), (k, name)
        assert homed.param(k).high.data_ptr() == compute[o:].data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(homed.exact(k), own.exact(k)))
    # every code and scale is in the buffer: a copy of the buffer (and the compute copy) is the state
    copy = offload_compact.CompactUnit(numels, buffer=buffer.clone(),
                                       highs=[compute.clone()[o:o + n] for o, n in zip(offsets, numels)])
    assert all(torch.equal(a, b) for k in range(3) for a, b in zip(copy.exact(k), own.exact(k)))
    for gap in (compute[300:400], compute[407:500], compute[500 + BLOCK_NUMEL:]):  # outside the parameters
        assert (gap.float() == 0).all()


# ------------------------------------------------------------------ the budgets

def test_the_budgets_count_a_compact_unit_as_its_low_parts_codes_and_scales():
    """[Note: compact optimizer states] A trainable unit's states at home are
    compact_unit_bytes of its parameters (the high part is the compute copy, counted there):
    the int8 low parts as the master, codes and scales as the moments; the planner's shapes
    (shape_from_module) pad each parameter to blocks as wrap's units do."""
    import dataclasses
    from offload.gpt import GPT
    from offload.memory.budget import host_bytes, model_unit_sizes
    from offload.plan import shape_from_module
    from offload.units import split_into_units
    from tests.support import CFG
    model = GPT(CFG)
    exact = Layout.resolve(offload.OffloadConfig(device="cpu", dtype="bf16", param_tier="host", optimizer_tier="host"),
                           torch.device("cpu"), None)
    compact = dataclasses.replace(exact, compact_states=True)
    units = model_unit_sizes(model, 2)
    specs = split_into_units(model, {p: 0 for p in model.parameters()}, 2)
    numels = [[e.numel for e in s.trainable_entries] for s in specs]
    assert [u.compact_numel for u in units] == [compact_padded_numel(n) for n in numels]
    assert [u.sizes(2).compact_numel for u in shape_from_module(model, "gpt").units] == [u.compact_numel for u in units]
    a, b = host_bytes(units, compact), host_bytes(units, exact)
    assert a.master_weights == sum(compact_padded_numel(n) for n in numels)
    assert a.master_weights + a.moments == sum(offload_compact.compact_unit_bytes(n) for n in numels)
    assert a.compute_copies == b.compute_copies and a.gradients == b.gradients
    assert 2 * (a.master_weights + a.moments) < b.master_weights + b.moments  # 3 B/param (+ padding) against 12



# ------------------------------------------------------------------ training end to end

COMPACT_HOST = dict(device="cpu", dtype="bf16", param_tier="host", optimizer_tier="host", optimizer_states="compact")


@pytest.mark.parametrize("kind,extra", [("adamw", {}), ("adam", {}),
                                        ("adamw", {"max_grad_norm": 0.5, "gradient_accumulation_steps": 2}),
                                        ("adamw", {"param_tier": "device"}),
                                        ("adamw", {"param_tier": "auto", "optimizer_tier": "auto"})])
def test_a_compact_run_equals_its_rule_driven_by_hand_over_the_same_gradients(kind, extra, monkeypatch, tmp_path):
    """[Note: compact optimizer states] The small GPT trained with compact states on the
    host: every update is CompactUnit's step of the engine's gradients with the optimizer's
    hyperparameters. Driven by hand here from the initial weights (each parameter its own
    CompactRange, over the gradients the engine handed to the step), the masters equal the
    engine's bit for bit; state_dict gives master = high + low; the compute copy is the high
    part; the loss goes down; the host holds what the budgets predict."""
    from offload.gpt import GPT
    from offload.memory.budget import UnitSizes, host_bytes
    from tests.support import CFG, batches, gpt_loss, make_opt
    seen = []  # (parameter's unit offset key, step, grad, grad_scale) as the engine hands them over
    real_step = compact_adam_step

    def recording_step(states, grad, **kw):
        seen.append((states.high.data_ptr(), kw["step"], grad.clone(), kw))
        real_step(states, grad, **kw)
    monkeypatch.setattr(offload_compact, "compact_adam_step", recording_step)
    torch.manual_seed(0)
    model = GPT(CFG)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = make_opt(model.parameters(), kind=kind)
    data = batches(12)
    losses = []
    with offload.wrap(model, opt, config=offload.OffloadConfig(**{**COMPACT_HOST, **extra})) as engine:
        sizes = [UnitSizes.of(u) for u in engine.units]
        predicted = host_bytes(sizes, engine.layout)
        assert engine.stats()["optimizer_state_bytes"] == predicted.master_weights + predicted.moments
        ptr_to_name = {}
        for u in engine.units:
            for k, e in enumerate(u.trainable):
                ptr_to_name[u.compact.param(k).high.data_ptr()] = (u, k, e)
        for b in data:
            loss = gpt_loss(engine, b)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.state_dict()
        names = {id(p): n for n, p in model.named_parameters()}
        by_hand = {}
        for u in engine.units:
            for k, e in enumerate(u.trainable):
                by_hand[(u.index, k)] = CompactRange.from_exact(initial[names[id(e.param)]].reshape(-1).float(),
                                                                torch.zeros(e.numel), torch.zeros(e.numel))
        for ptr, step, grad, kw in seen:
            u, k, e = ptr_to_name[ptr]
            group = opt.param_groups[e.group_index]
            assert kw["lr"] == group["lr"] and kw["weight_decay"] == group["weight_decay"]
            assert kw["adamw"] == (kind == "adamw")
            real_step(by_hand[(u.index, k)], grad, **kw)
        steps = {}
        for u in engine.units:
            compute = engine.debug.homes.compute_copy(u)
            for k, e in enumerate(u.trainable):
                mine = by_hand[(u.index, k)]
                master, exp_avg, exp_avg_sq = u.compact.exact(k)
                assert torch.equal(master, mine.master()), names[id(e.param)]
                assert torch.equal(exp_avg, mine.moments()[0]) and torch.equal(exp_avg_sq, mine.moments()[1])
                assert torch.equal(compute[e.offset:e.offset + e.numel], mine.high)
                assert torch.equal(state[names[id(e.param)]].reshape(-1), mine.master())
                steps[names[id(e.param)]] = u.steps[k]
        # save_pretrained writes master = high + low (fp32 here, the master's dtype)
        engine.save_pretrained(str(tmp_path / "pretrained"), dtype="fp32")
        from safetensors.torch import load_file
        saved = {}
        for f in (tmp_path / "pretrained").glob("*.safetensors"):
            saved.update(load_file(str(f)))
        for name in steps:
            assert torch.equal(saved[name], state[name]), name
    num_updates = len(data) // extra.get("gradient_accumulation_steps", 1)
    assert set(steps.values()) == {num_updates}
    assert len(seen) == num_updates * len(steps)
    if "max_grad_norm" in extra:  # the clipping coefficient reached the step
        assert any(kw["grad_scale"] != 1.0 for _, _, _, kw in seen)
    assert sum(losses[-3:]) < sum(losses[:3])


def test_re_encoding_decoded_states_keeps_their_values_and_moment_codes_but_not_always_the_split():
    """What a checkpoint written as fp32 (CompactUnit.exact) and read back (load_exact)
    would give: the same master values and the same moment codes and scales, but at a
    master that decodes to the midpoint of two bf16 values the split may flip (high rounded
    to even, low -127 instead of high + 1 ulp, low 127): the compute copy, and so the next
    forward, would change. Hence a compact checkpoint keeps the codes, not fp32 states."""
    g = torch.Generator().manual_seed(0)
    n = BLOCK_NUMEL * 64
    states = CompactRange.from_exact(torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n))
    for step in range(1, 21):
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
        compact_adam_step(states, grad, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    again = CompactRange.from_exact(states.master(), *states.moments())
    assert torch.equal(again.master(), states.master())
    for name in ("exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales"):
        assert torch.equal(getattr(again, name), getattr(states, name)), name
    flipped = again.high != states.high
    assert flipped.any()  # this seed reaches midpoints (29 of 16384 elements)
    assert (states.low[flipped].abs() == 127).all() and (again.low[flipped] == -states.low[flipped]).all()


# ------------------------------------------------------------------ NVMe tiers

def _compact_run(extra, tmp_path, num_batches=6, inspect=None, settle_backward=False):
    """The small GPT trained with compact states under ``extra`` (swap under tmp_path);
    (losses, state_dict, every trainable parameter's decoded master, moments and high part,
    placement's (compute tiers, state tiers), what ``inspect(engine)`` gave).
    ``settle_backward``: as support.train_offload's (every speculative update runs)."""
    from offload.gpt import GPT
    from tests.support import CFG, batches, make_opt, train_offload
    torch.manual_seed(0)
    model = GPT(CFG)
    config = offload.OffloadConfig(**{**COMPACT_HOST, "swap_dir": str(tmp_path / "swap"), **extra})
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        losses = train_offload(engine, batches(num_batches), settle_backward=settle_backward)
        state = engine.state_dict()  # settles the last step's deferred updates first
        states = {}
        for u in engine.units:
            compact = engine.debug.homes.read_compact(u)
            for k, e in enumerate(u.trainable):
                states[(u.index, k)] = compact.exact(k) + (compact.param(k).high.clone(),)
        tiers = tuple(engine.layout.compute_tier(i) for i in range(len(engine.units))), \
            tuple(engine.layout.state_tier(i) for i in range(len(engine.units)))
        seen = inspect(engine) if inspect is not None else None
        return losses, state, states, tiers, seen


def _mixed_state_budget(numerics):
    """A host_budget at which "auto" homes some units' compact states on the host and others
    on NVMe in a run with ``numerics`` (found by asking the placement: pure arithmetic)."""
    from offload.gpt import GPT
    from offload.memory.budget import model_unit_sizes
    from offload.memory.placement import resolve_placement
    from tests.support import CFG
    sizes = model_unit_sizes(GPT(CFG), 2)
    for budget in range(200_000, 2_000_000, 10_000):
        config = offload.OffloadConfig(**{**COMPACT_HOST, **numerics, "param_tier": "auto", "optimizer_tier": "auto",
                                          "swap_dir": "/nonexistent-offload", "host_budget": budget})
        try:
            layout = resolve_placement(config, torch.device("cpu"), None, sizes)
        except ValueError:  # below the floor
            continue
        if {"host", "nvme"} <= set(layout.state_tiers):
            return budget
    raise AssertionError("no host_budget splits the compact states between host and NVMe")


@pytest.mark.parametrize("numerics", [{}, {"max_grad_norm": 0.5, "gradient_accumulation_steps": 2}],
                         ids=["early-updates", "clipped-accumulated"])
def test_compact_states_on_nvme_train_the_same_bits_as_on_the_host(numerics, tmp_path):
    """[Note: compact optimizer states] Placement never changes numerics: compact homes and
    compute copies on NVMe (each combination, and "auto" splitting the states between host
    and NVMe) give the all-host run's losses, weights, codes (decoded) and high parts bit for
    bit, through early updates (no clipping) and the step's own staged pipeline."""
    host = _compact_run(numerics, tmp_path / "host")
    assert set(host[3][1]) == {"host"}
    runs = {"states-nvme": {"optimizer_tier": "nvme"},
            "both-nvme": {"param_tier": "nvme", "optimizer_tier": "nvme"},
            "compute-nvme": {"param_tier": "nvme"},
            "auto-mixed": {"param_tier": "auto", "optimizer_tier": "auto", "host_budget": _mixed_state_budget(numerics)}}
    for name, tiers in runs.items():
        losses, state, states, placed, _ = _compact_run({**numerics, **tiers}, tmp_path / name)
        if name == "auto-mixed":
            assert {"host", "nvme"} <= set(placed[1]), placed
        else:
            assert "nvme" in set(placed[0]) | set(placed[1]), placed
        assert losses == host[0], name
        assert state.keys() == host[1].keys() and all(torch.equal(state[k], host[1][k]) for k in state), name
        for key, (master, exp_avg, exp_avg_sq, high) in states.items():
            want = host[2][key]
            assert torch.equal(master, want[0]) and torch.equal(exp_avg, want[1]) and \
                torch.equal(exp_avg_sq, want[2]) and torch.equal(high, want[3]), (name, key)
        assert not (tmp_path / name / "swap").exists() or not any((tmp_path / name / "swap").rglob("*.swap"))


def test_compact_states_on_nvme_move_the_bytes_the_planner_predicts(tmp_path):
    """[Note: compact optimizer states], [Note: step prediction] With the compact homes on
    NVMe and the compute copies on the host, a step reads and writes each unit's whole
    compact home once, exactly what predict_step says, which is under a third of what the
    exact states' step moves (fp32 master and moments), also where speculative updates that
    are never dropped write the spare homes instead; the swap holds what swap_bytes plans
    (two compact homes a unit with spares) and the staging slots are what slot_shape says. (Updates are not left to the next
    forward, so each step's traffic falls between two stats() calls.)"""
    from offload.memory.budget import UnitSizes, compact_home_bytes, slot_shape, swap_bytes
    from offload.memory.placement import DEFAULT_PROFILE, predict_step
    from tests.support import batches, gpt_loss

    def inspect(engine):
        sizes = [UnitSizes.of(u) for u in engine.units]
        before = engine.stats()
        for b in batches(2, seed=7):
            engine.backward(gpt_loss(engine, b))
            engine.step()
        after = engine.stats()
        exact = dataclasses.replace(engine.layout, compact_states=False)
        shape = slot_shape(sizes, engine.layout)
        # [Note: speculative updates] a unit with spare homes has two compact homes
        copies = [engine.layout.home_copies(i, u.trainable)[1] for i, u in enumerate(sizes)]
        spared = sum(c * compact_home_bytes(u, "nvme") for c, u in zip(copies, sizes) if u.trainable)
        return (sizes, predict_step(sizes, engine.layout, DEFAULT_PROFILE, 1.0),
                predict_step(sizes, exact, DEFAULT_PROFILE, 1.0),
                (after["bytes_read_nvme"] - before["bytes_read_nvme"]) / 2,
                (after["bytes_written_nvme"] - before["bytes_written_nvme"]) / 2,
                swap_bytes(sizes, engine.layout), engine.placement().bytes_per_tier().get("nvme"), shape, spared)

    # clipped: not speculative, whose redone updates the prediction leaves out
    for run, numerics in enumerate(({}, {"max_grad_norm": 0.5, "speculative_updates": False},
                                    {"max_grad_norm": 1e9})):
        sizes, predicted, exact, read, written, planned_swap, placed_nvme, shape, spared = _compact_run(
            {"optimizer_tier": "nvme", "overlap_step_with_forward": False, **numerics}, tmp_path / f"run{run}", num_batches=2, inspect=inspect)[4]
        homes = sum(compact_home_bytes(u, "nvme") for u in sizes if u.trainable)
        assert read == written == predicted.nvme_read_bytes == predicted.nvme_write_bytes == homes, numerics
        assert 3 * homes < exact.nvme_read_bytes, (homes, exact)
        assert planned_swap == placed_nvme == spared >= homes
        assert (spared > homes) == ("max_grad_norm" in numerics and "speculative_updates" not in numerics)
        assert shape.master_numel == 0 and shape.compute_numel == 0
        assert shape.compact_bytes == max(compact_home_bytes(u, "nvme") for u in sizes if u.trainable)


# ------------------------------------------------------------------ checkpoints

def _train_from(engine, data):
    from tests.support import train_offload
    return train_offload(engine, data)


def _compact_engine(extra, tmp_path, name):
    from offload.gpt import GPT
    from tests.support import CFG, make_opt
    torch.manual_seed(0)
    model = GPT(CFG)
    config = offload.OffloadConfig(**{**COMPACT_HOST, "swap_dir": str(tmp_path / name), **extra})
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


def _all_compact_states(engine):
    out = {}
    for u in engine.units:
        compact = engine.debug.homes.read_compact(u)
        for k in range(len(u.trainable)):
            out[(u.index, k)] = compact.exact(k) + (compact.param(k).high.clone(),)
    return out


@pytest.mark.parametrize("save_tiers,load_tiers", [
    ({}, {}),
    ({"optimizer_tier": "nvme"}, {"optimizer_tier": "nvme"}),
    ({"param_tier": "nvme", "optimizer_tier": "nvme", "max_grad_norm": 0.5},
     {"param_tier": "nvme", "optimizer_tier": "nvme", "max_grad_norm": 0.5}),
    ({"optimizer_tier": "nvme"}, {}),  # saved from NVMe, resumed on the host
], ids=["host", "states-nvme", "both-nvme-clipped", "nvme-to-host"])
def test_a_compact_checkpoint_resumes_bit_for_bit(save_tiers, load_tiers, tmp_path, monkeypatch):
    """[Note: compact optimizer states] Saved at step 3 (the codes, scales, low parts and the
    compute copy, in pieces of CHUNK_NUMEL: made small here so that parameters span several),
    loaded into a new engine and continued to step 6: the losses, weights, decoded states and
    high parts equal an uninterrupted run's bit for bit, on host and NVMe tiers, and across
    them. The manifest says the states are compact and holds no fp32 master."""
    import json
    from offload.checkpoint import access as checkpoint_access
    from tests.support import batches
    monkeypatch.setattr(checkpoint_access, "CHUNK_NUMEL", 4 * BLOCK_NUMEL)
    data = batches(6)
    _, engine = _compact_engine(save_tiers, tmp_path, "whole")
    with engine:
        whole_losses = _train_from(engine, data)
        whole_state = engine.state_dict()
        whole_states = _all_compact_states(engine)
    _, engine = _compact_engine(save_tiers, tmp_path, "first")
    with engine:
        first = _train_from(engine, data[:3])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["optimizer_states"] == "compact"
    pieces = [p for u in manifest["units"] for r in u["entries"] if r["trainable"] for p in r["pieces"]]
    assert pieces and all("master" not in p and {"high", "low", "exp_avg_scales"} <= set(p) for p in pieces)
    assert any(p["start"] > 0 for p in pieces)  # a parameter in several pieces
    _, engine = _compact_engine(load_tiers, tmp_path, "second")
    with engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        second = _train_from(engine, data[3:])
        state = engine.state_dict()
        states = _all_compact_states(engine)
    assert first + second == whole_losses
    assert all(torch.equal(state[k], whole_state[k]) for k in whole_state)
    for key, got in states.items():
        assert all(torch.equal(a, b) for a, b in zip(got, whole_states[key])), key


def test_a_compact_checkpoint_and_an_exact_engine_refuse_each_other_before_touching_anything(tmp_path):
    """[Note: compact optimizer states] A compact checkpoint loaded into an exact engine, or
    an exact one into a compact engine: a ValueError naming optimizer_states and the
    manifest, and the engine's weights and states are those from before."""
    from offload.gpt import GPT
    from tests.support import CFG, batches, make_opt
    data = batches(2)
    _, engine = _compact_engine({}, tmp_path, "compact")
    with engine:
        _train_from(engine, data)
        engine.save_checkpoint(str(tmp_path / "compact-ckpt"))
        torch.manual_seed(0)
        exact_model = GPT(CFG)
        exact = offload.wrap(exact_model, make_opt(exact_model.parameters()),
                             config=offload.OffloadConfig(device="cpu", dtype="bf16", param_tier="host",
                                                          optimizer_tier="host"))
        with exact:
            _train_from(exact, data)
            exact.save_checkpoint(str(tmp_path / "exact-ckpt"))
            for target, ckpt, saved, ours in ((exact, "compact-ckpt", "compact", "exact"),
                                               (engine, "exact-ckpt", "exact", "compact")):
                before = target.state_dict()
                manifest = str(tmp_path / ckpt / "manifest.json")
                with pytest.raises(ValueError, match=f"optimizer_states: checkpoint manifest '{manifest}' holds "
                                                     f"'{saved}' optimizer states, this engine runs "
                                                     f"optimizer_states='{ours}'"):
                    target.load_checkpoint(str(tmp_path / ckpt))
                after = target.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
                _train_from(target, data[:1])  # not failed: it trains on


@pytest.mark.parametrize("tiers", [{}, {"param_tier": "nvme", "optimizer_tier": "nvme"}], ids=["host", "nvme"])
def test_export_of_a_compact_checkpoint_writes_the_fp32_master_high_plus_low(tiers, tmp_path, monkeypatch):
    """[Note: compact optimizer states] offload export of a compact checkpoint (torch and
    safetensors files, and a model directory) gives master = high + low decoded, the values
    engine.state_dict() and save_pretrained give, in fp32."""
    from offload.checkpoint import access as checkpoint_access
    from offload.checkpoint import export_checkpoint, export_pretrained
    from safetensors.torch import load_file
    from tests.support import batches
    monkeypatch.setattr(checkpoint_access, "CHUNK_NUMEL", 4 * BLOCK_NUMEL)
    _, engine = _compact_engine(tiers, tmp_path, "swap")
    with engine:
        _train_from(engine, batches(3))
        state = engine.state_dict()
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.save_pretrained(str(tmp_path / "pretrained"), dtype="fp32")
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out.pt"))
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "exported"))
    from_torch = torch.load(str(tmp_path / "out.pt"))
    from_safetensors = load_file(str(tmp_path / "out.safetensors"))
    pretrained, exported = {}, {}
    for directory, into in ((tmp_path / "pretrained", pretrained), (tmp_path / "exported", exported)):
        for f in directory.glob("*.safetensors"):
            into.update(load_file(str(f)))
    trainable = [k for k, v in state.items() if v.dtype == torch.float32]
    assert trainable
    for name in trainable:
        for got in (from_torch, from_safetensors, pretrained, exported):
            if name in got:
                assert got[name].dtype == torch.float32 and torch.equal(got[name], state[name]), name
        assert name in from_torch and name in from_safetensors


@pytest.mark.parametrize("tiers", [{"speculative_updates": True},
                                   {"optimizer_tier": "nvme"},
                                   {"param_tier": "nvme", "optimizer_tier": "nvme"},
                                   {"param_tier": "nvme", "speculative_updates": True}],
                         ids=["host", "states-nvme", "both-nvme", "compute-nvme"])
def test_speculative_compact_updates_equal_the_serialized_run_bit_for_bit(tiers, tmp_path):
    """[Note: compact optimizer states], [Note: speculative updates] Clipped runs whose
    early updates speculate into the spare compact homes (and spare compute copies): steps
    that do not clip commit them, a step that clips drops and redoes them; either way every
    loss, weight, code and high part equals the all-host serialized run (no speculation)
    bit for bit, and a checkpoint saved after such steps holds the committed states."""
    # a norm bound the first steps exceed and the later ones do not: both outcomes happen
    numerics = {"max_grad_norm": 6.0}
    serial = _compact_run({**numerics, "speculative_updates": False}, tmp_path / "serial", num_batches=8)

    def counts(engine):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        s = engine.stats()
        return s.get("speculative_updates", 0), s.get("redone_updates", 0)
    # the worker runs every speculative update before step(): otherwise which ones step()
    # takes back, and so the counts below, depend on the machine's pace
    losses, state, states, _, (speculated, redone) = _compact_run(
        {**numerics, **tiers}, tmp_path / "speculative", num_batches=8, inspect=counts, settle_backward=True)
    assert speculated > 0 and redone > 0 and speculated > redone, (speculated, redone)
    assert losses == serial[0]
    assert all(torch.equal(state[k], serial[1][k]) for k in serial[1])
    for key, got in states.items():
        assert all(torch.equal(a, b) for a, b in zip(got, serial[2][key])), key
    _, engine = _compact_engine(numerics, tmp_path, "loaded")
    with engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = _all_compact_states(engine)
    for key, got in loaded.items():
        assert all(torch.equal(a, b) for a, b in zip(got, serial[2][key])), key


def test_a_failed_swap_write_of_compact_states_stops_the_run_until_a_checkpoint_is_loaded(tmp_path):
    """[Note: compact optimizer states], [Note: swap I/O failures] Compact states are not
    held in host RAM after a failed swap write (exact ones are): the step fails, naming the
    unit; training and saving are refused (EngineFailedError) until a checkpoint is loaded,
    after which the run ends where an uninterrupted one does, bit for bit."""
    import errno
    from offload.errors import EngineFailedError
    from tests.support import FaultyIO, batches, gpt_loss, unwrap_swap_io, wrap_swap_io
    data = batches(5)
    extra = {"optimizer_tier": "nvme", "overlap_step_with_forward": False}
    _, engine = _compact_engine(extra, tmp_path, "reference")
    with engine:
        _train_from(engine, data)
        final = _all_compact_states(engine)
    _, engine = _compact_engine(extra, tmp_path, "failing")
    with engine:
        _train_from(engine, data[:2])
        engine.save_checkpoint(str(tmp_path / "before"))
        wrap_swap_io(engine, FaultyIO, errno.EIO, fail_write=2)
        with pytest.raises(Exception, match="compact states of unit .* are not held in host RAM"):
            engine.backward(gpt_loss(engine, data[2]))
            engine.step()
        unwrap_swap_io(engine)
        with pytest.raises(EngineFailedError):
            engine.save_checkpoint(str(tmp_path / "mixed"))
        assert not (tmp_path / "mixed").exists()
        with pytest.raises(EngineFailedError):
            engine.backward(gpt_loss(engine, data[2]))
        engine.load_checkpoint(str(tmp_path / "before"))
        _train_from(engine, data[2:])
        for key, got in _all_compact_states(engine).items():
            assert all(torch.equal(a, b) for a, b in zip(got, final[key])), key


@pytest.mark.parametrize("tiers", [{}, {"param_tier": "nvme", "optimizer_tier": "nvme"}], ids=["host", "nvme"])
def test_weight_writes_encode_new_masters_and_keep_every_other_byte(tiers, tmp_path):
    """[Note: compact optimizer states] load_state_dict of some parameters: theirs become
    encode(value) (state_dict gives high + low decoded from it), every other parameter keeps
    its high and low parts bit for bit (no decode and re-encode, which may flip a tie), and
    every moment code is kept. gathered(modify=True) with one element edited: that element
    gets the edited bf16 value as its master (low part 0), the rest keep their bytes."""
    from tests.support import batches
    _, engine = _compact_engine(tiers, tmp_path, "swap")
    with engine:
        _train_from(engine, batches(3))
        engine.state_dict()  # settles the last step's deferred updates
        before = _all_compact_states(engine)
        names = {e.fqn: (u.index, k) for u in engine.units for k, e in enumerate(u.trainable)}
        new_name = next(n for n in engine.state_dict() if n.endswith("weight") and n in names)
        shape = engine.state_dict()[new_name].shape
        value = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        engine.load_state_dict({new_name: value}, strict=False)
        after = _all_compact_states(engine)
        high, low = encode_master(value.reshape(-1).float())
        assert torch.equal(after[names[new_name]][3], high)
        assert torch.equal(after[names[new_name]][0], decode_master(high, low))
        assert torch.equal(engine.state_dict()[new_name].reshape(-1), decode_master(high, low))
        for key, got in after.items():
            assert torch.equal(got[1], before[key][1]) and torch.equal(got[2], before[key][2]), key  # moments
            if key != names[new_name]:
                assert all(torch.equal(a, b) for a, b in zip(got, before[key])), key
        # an edit of one element in place
        u_index, k = names[new_name]
        param = engine.units[u_index].trainable[k].param
        with engine.gathered([param], modify=True):
            with torch.no_grad():
                param.view(-1)[0] = 0.5
        edited = _all_compact_states(engine)
        mine = edited[names[new_name]]
        assert float(mine[0][0]) == 0.5 and float(mine[3][0]) == 0.5
        assert torch.equal(mine[0][1:], after[names[new_name]][0][1:])
        assert torch.equal(mine[3][1:], after[names[new_name]][3][1:])
        for key, got in edited.items():
            if key != names[new_name]:
                assert all(torch.equal(a, b) for a, b in zip(got, after[key])), key
        _train_from(engine, batches(1, seed=5))  # trains on
    # param_tier "device": the edit would be found against the copy being edited
    _, engine = _compact_engine({"param_tier": "device"}, tmp_path, "device")
    with engine:
        with pytest.raises(ValueError, match="optimizer_states: engine.gathered.modify=True. is not available with "
                                             "'compact' states and param_tier='device'"):
            engine.gathered(modify=True).__enter__()
