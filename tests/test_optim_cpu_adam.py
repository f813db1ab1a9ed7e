"""CPU Adam: the native kernel per ISA, adam_step_flat and CPUAdam.

[Note: how exact the tests are] The kernel performs torch's _single_tensor_adam operations
in torch's order with torch's FMA placement (see [Note: Adam numerics] in
native/adam/adam.h), so against a reference that runs those same torch ops it is compared
with torch.equal: bit-exact, on every ISA. The one op the reference does not take from
torch is sqrt: torch's CPU sqrt calls MKL's vsSqrt, which is not correctly rounded (about
0.6% of results are one ulp off), while the kernel uses IEEE sqrt (correctly rounded, the
same on every ISA). So:
  * kernel vs reference-with-IEEE-sqrt: exact equality;
  * CPUAdam vs torch.optim.AdamW/Adam itself: the moments of AdamW are bit-exact (they do
    not depend on sqrt or the param); params may differ where a one-ulp sqrt difference
    changed an update by one rounding: at most one ulp of the param's scale per step, so
    over 20 steps |diff| <= 20 * 2**-24 * max(|p|, 1) ~= 1.2e-6 * max(|p|, 1); we assert
    1e-6 * max(|p|, 1) (observed: <= 2.4e-7 on 2**20+3 elements).
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import offload
from offload import _native
from offload.optim import CPUAdam, adam_step_flat

ISAS = list(_native.adam_available_isas())
SIZES = [1, 7, 17, 1023, 4097, 2**20 + 3]
STEPS = 20


@contextlib.contextmanager
def forced_isa(name: str):
    previous = _native.adam_selected_isa()
    _native.adam_set_isa(name)
    try:
        yield
    finally:
        _native.adam_set_isa(previous)


def ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    # numpy's float32 sqrt is the correctly rounded SQRTPS.
    return torch.from_numpy(np.sqrt(x.numpy()))


def reference_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw,
                   grad_scale=1.0):
    """torch's _single_tensor_adam (foreach=False) op for op, with IEEE sqrt."""
    g = g.float() * grad_scale
    if weight_decay != 0:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (ieee_sqrt(v) / bias_correction2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


def run_flat(isa, numel, *, grad_dtype=torch.float32, copy_dtype=None, seed=0, **hyper):
    """20 steps of the kernel and of the reference on the same data; returns both states
    and, with copy_dtype, whether every copy_out equalled the reference param cast."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(numel, generator=gen)
    ours = [p.clone(), torch.zeros(numel), torch.zeros(numel)]
    ref = [p.clone(), torch.zeros(numel), torch.zeros(numel)]
    copy_out = None if copy_dtype is None else torch.empty(numel, dtype=copy_dtype)
    copies_equal = True
    with forced_isa(isa):
        for step in range(1, STEPS + 1):
            g = torch.randn(numel, generator=gen).to(grad_dtype)
            adam_step_flat(ours[0], g, ours[1], ours[2], step=step, copy_out=copy_out, **hyper)
            reference_step(ref[0], g, ref[1], ref[2], step=step, **hyper)
            if copy_out is not None:
                copies_equal &= torch.equal(copy_out, ref[0].to(copy_dtype))
    return ours, ref, copies_equal


HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
DECAY_VARIANTS = {
    "adamw_no_decay": dict(weight_decay=0.0, adamw=True),
    "adamw_decay": dict(weight_decay=0.1, adamw=True),
    "adam_l2": dict(weight_decay=0.1, adamw=False),
}


def assert_states_equal(ours, ref):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, ref):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} elements differ"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("variant", list(DECAY_VARIANTS))
def test_kernel_bit_exact_fp32_grad(isa, numel, variant):
    ours, ref, _ = run_flat(isa, numel, **HYPER, **DECAY_VARIANTS[variant])
    assert_states_equal(ours, ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("numel", [1, 17, 4097, 2**20 + 3])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_kernel_bit_exact_16bit_grad(isa, numel, grad_dtype):
    # The grad is widened exactly; the rest is the fp32 path.
    ours, ref, _ = run_flat(isa, numel, grad_dtype=grad_dtype, **HYPER,
                            **DECAY_VARIANTS["adamw_decay"])
    assert_states_equal(ours, ref)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("numel", [1, 7, 17, 1023, 4097, 2**20 + 3])
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copy_out_is_param_rounded_to_nearest_even(isa, numel, copy_dtype):
    ours, ref, copies_equal = run_flat(isa, numel, copy_dtype=copy_dtype, **HYPER,
                                       **DECAY_VARIANTS["adamw_decay"])
    assert_states_equal(ours, ref)
    assert copies_equal


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copy_out_special_values(isa, copy_dtype):
    # Denormals (VCVTNEPS2BF16 would flush them), ties, overflow to inf, signed zeros.
    # With lr=0 the param is unchanged, so copy_out must equal torch's cast of it.
    values = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1e-45, 6e-8, 1.00390625, 1.01171875,
                           65520.0, -70000.0, 3.0e38, float("inf"), float("-inf"), 1.5e-5,
                           2.0**-24, 2.0**-25, 3 * 2.0**-26] * 3)
    param = values.clone()
    copy_out = torch.empty_like(values, dtype=copy_dtype)
    with forced_isa(isa):
        adam_step_flat(param, torch.zeros_like(values), torch.zeros_like(values),
                       torch.zeros_like(values), step=1, lr=0.0, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.0, copy_out=copy_out)
    assert torch.equal(param, values)
    assert torch.equal(copy_out.view(torch.int16), values.to(copy_dtype).view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
def test_grad_scale_multiplies_grad_first(isa):
    ours, ref, _ = run_flat(isa, 4097, grad_scale=0.37, **HYPER, **DECAY_VARIANTS["adam_l2"])
    assert_states_equal(ours, ref)
    # And it really is applied: a different scale gives a different result.
    other, _, _ = run_flat(isa, 4097, grad_scale=0.5, **HYPER, **DECAY_VARIANTS["adam_l2"])
    assert not torch.equal(ours[2], other[2])


@pytest.mark.parametrize("isa", ISAS)
def test_small_beta1_takes_torch_other_lerp_branch(isa):
    # 1 - beta1 >= 0.5 switches ATen's lerp to end - (end - start) * (1 - w).
    hyper = dict(lr=1e-3, beta1=0.3, beta2=0.99, eps=1e-6)
    ours, ref, _ = run_flat(isa, 1023, **hyper, **DECAY_VARIANTS["adamw_decay"])
    assert_states_equal(ours, ref)


# ---- memory paths: streaming copy-out, prefetch, misaligned buffers ---------------------
# See [Note: Adam memory traffic] in native/adam/adam_kernels.h. None of these paths may change
# a result, so each is pinned against the same bit-exact reference as above.

@contextlib.contextmanager
def stream_copy_out_from(numel: int):
    previous = _native.adam_stream_copy_out_min_numel()
    _native.adam_set_stream_copy_out_min_numel(numel)
    try:
        yield
    finally:
        _native.adam_set_stream_copy_out_min_numel(previous)


def misaligned(numel: int, offset: int, dtype=torch.float32) -> torch.Tensor:
    """A contiguous view that starts offset elements into a (64-byte aligned) allocation."""
    return torch.zeros(numel + offset, dtype=dtype)[offset:]


def run_misaligned(isa, numel, offsets, copy_dtype, grad_dtype=torch.float32, steps=3):
    """Kernel and reference on buffers starting offsets[name] elements past an aligned
    allocation; returns (ours, ref, copies_equal) like run_flat."""
    gen = torch.Generator().manual_seed(numel)
    init = torch.randn(numel, generator=gen)
    ours = [misaligned(numel, offsets[name]) for name in ("param", "exp_avg", "exp_avg_sq")]
    ours[0].copy_(init)
    ref = [init.clone(), torch.zeros(numel), torch.zeros(numel)]
    grad = misaligned(numel, offsets["grad"], grad_dtype)
    copy_out = misaligned(numel, offsets["copy_out"], copy_dtype)
    hyper = dict(**HYPER, **DECAY_VARIANTS["adamw_decay"])
    copies_equal = True
    with forced_isa(isa):
        for step in range(1, steps + 1):
            grad.copy_(torch.randn(numel, generator=gen))
            adam_step_flat(*ours[:1], grad, *ours[1:], step=step, copy_out=copy_out, **hyper)
            reference_step(ref[0], grad, ref[1], ref[2], step=step, **hyper)
            copies_equal &= torch.equal(copy_out, ref[0].to(copy_dtype))
    return ours, ref, copies_equal


# Sizes around the vector widths (8, 16), the prefetch distance (512 + 16) and the threads'
# 64 Ki-element ranges; offsets put copy_out 2..30 bytes past a 32-byte boundary, so the
# streaming path must peel a head of every length, and the fp32 buffers off their lines.
MEMORY_SIZES = [1, 5, 15, 16, 31, 527, 529, 1040, 4097, 2 * 2**16 + 77]
COPY_OUT_OFFSETS = [0, 1, 3, 7, 8, 15]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("numel", MEMORY_SIZES)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "cached"])
def test_copy_out_paths_bit_exact_on_odd_sizes_and_alignments(isa, numel, stream):
    threshold = 0 if stream else 2**62
    for copy_offset in COPY_OUT_OFFSETS:
        offsets = dict(param=copy_offset % 4, grad=copy_offset % 3, exp_avg=copy_offset % 5,
                       exp_avg_sq=1, copy_out=copy_offset)
        with stream_copy_out_from(threshold):
            ours, ref, copies_equal = run_misaligned(isa, numel, offsets, torch.bfloat16)
        assert_states_equal(ours, ref)
        assert copies_equal, f"copy_out offset {copy_offset}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_streamed_fp16_copy_out_with_16bit_grad_bit_exact(isa, grad_dtype):
    offsets = dict(param=0, grad=3, exp_avg=0, exp_avg_sq=0, copy_out=5)
    with stream_copy_out_from(0):
        ours, ref, copies_equal = run_misaligned(isa, 2 * 2**16 + 77, offsets, torch.float16,
                                                 grad_dtype=grad_dtype)
    assert_states_equal(ours, ref)
    assert copies_equal


VECTOR_ISAS = [isa for isa in ISAS if isa != "scalar"]
# Infinities, denormals (VCVTNEPS2BF16 would flush them), ties, fp16 overflow, NaN (with a
# payload once the gradient went through bf16, which torch casts NaN to as 0xFFFF: every
# kernel narrows it to fp16 keeping the payload's top bits, as VCVTPS2PH does).
VECTOR_SPECIALS = [float("inf"), float("-inf"), 1e-40, -3e-39, 1e-45, 6e-8, 1.00390625,
                   1.01171875, 65520.0, -70000.0, 3.0e38, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
                   float("nan")]


def step_bits(isa, numel, grad_dtype, copy_dtype, stream, offset, hyper, specials):
    """Three steps of isa's kernel on buffers offset elements past an aligned allocation
    (copy_out by offset, so a streamed copy-out has a head of every length); returns every
    output as integers, so that equal means equal bits, NaN included."""
    gen = torch.Generator().manual_seed(numel * 100 + offset)
    state = [misaligned(numel, offset % 4), misaligned(numel, offset % 5), misaligned(numel, 1)]
    state[0].copy_(torch.randn(numel, generator=gen))
    grad = misaligned(numel, offset % 3, grad_dtype)
    copy_out = None if copy_dtype is None else misaligned(numel, offset, copy_dtype)
    outputs = []
    with forced_isa(isa), stream_copy_out_from(0 if stream else 2**62):
        for step in range(1, 4):
            g = torch.randn(numel, generator=gen)
            if numel > len(specials):
                where = torch.randperm(numel, generator=gen)[:len(specials)]
                (g if step == 2 else state[0])[where] = torch.tensor(specials)
            grad.copy_(g)
            adam_step_flat(state[0], grad, state[1], state[2], step=step, copy_out=copy_out,
                           **hyper)
            if copy_out is not None:
                outputs.append(copy_out.view(torch.int16).clone())
    return [t.view(torch.int32).clone() for t in state] + outputs


@pytest.mark.parametrize("isa", VECTOR_ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_vector_kernel_equals_scalar_bit_for_bit(isa, grad_dtype, copy_dtype):
    # Every dtype path of every vector kernel this CPU runs (one loop template over per-ISA
    # traits, native/adam/adam_simd.h) against the scalar reference: partial-vector heads and
    # tails around each vector width and the prefetch distance, streamed and cached copy-out.
    streams = (False, True) if copy_dtype is not None else (False,)
    for numel in (1, 7, 15, 17, 33, 529, 1053):
        for stream in streams:
            for offset in (0, 1, 3, 7):
                for variant, decay in DECAY_VARIANTS.items():
                    hyper = dict(**HYPER, **decay)
                    args = (numel, grad_dtype, copy_dtype, stream, offset, hyper, VECTOR_SPECIALS)
                    ours = step_bits(isa, *args)
                    ref = step_bits("scalar", *args)
                    assert all(torch.equal(a, b) for a, b in zip(ours, ref)), (
                        f"numel={numel} stream={stream} offset={offset} {variant}")


# ---- out-of-place steps ([Note: out-of-place Adam] in native/adam/adam.h) ---------------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
def test_out_of_place_step_equals_in_place_bit_for_bit(isa, grad_dtype, copy_dtype):
    # Three steps that alternate between two sets of buffers, as a delayed run's homes and
    # spare homes do: each writes the other set and leaves its inputs alone, and every
    # output equals the in-place step's, bit for bit (specials included), across partial
    # heads and tails, streamed and cached copy-outs and misaligned buffers.
    hyper = dict(**HYPER, **DECAY_VARIANTS["adamw_decay"])
    for numel in (1, 7, 17, 529, 1053, 2 * 2**16 + 77):
        for offset in (0, 3):
            for stream in (False, True):
                gen = torch.Generator().manual_seed(numel + offset)
                init = torch.randn(numel, generator=gen)
                init[torch.randperm(numel, generator=gen)[:min(numel, 4)]] = torch.tensor(
                    VECTOR_SPECIALS[:min(numel, 4)])
                in_place = [init.clone(), torch.zeros(numel), torch.zeros(numel)]
                # set 1 and the first copy-out share a phase, so that all four can stream
                # together; set 0's differ, so that only some outputs can
                sets = [[misaligned(numel, (offset + k + 2) % 7) for k in range(3)],
                        [misaligned(numel, offset) for _ in range(3)]]
                sets[0][0].copy_(init)
                copies = [None if copy_dtype is None else misaligned(numel, offset + i, copy_dtype)
                          for i in range(2)]
                with forced_isa(isa), stream_copy_out_from(0 if stream else 2**62):
                    for step in range(1, 4):
                        grad = torch.randn(numel, generator=gen).to(grad_dtype)
                        src, dst = sets[(step - 1) % 2], sets[step % 2]
                        before = [t.clone() for t in src]
                        adam_step_flat(*in_place[:1], grad, *in_place[1:], step=step,
                                       copy_out=copies[1], **hyper)
                        adam_step_flat(src[0], grad, src[1], src[2], step=step, copy_out=copies[0],
                                       out=tuple(dst), **hyper)
                        where = f"numel={numel} offset={offset} stream={stream} step={step}"
                        for name, t, b in zip(("param", "exp_avg", "exp_avg_sq"), src, before):
                            assert torch.equal(t.view(torch.int32), b.view(torch.int32)), f"{name} read only: {where}"
                        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), dst, in_place):
                            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{name}: {where}"
                        if copy_dtype is not None:
                            assert torch.equal(copies[0].view(torch.int16), copies[1].view(torch.int16)), where


def test_out_of_place_outputs_must_not_overlap_any_buffer():
    n = 64
    shifted = torch.zeros(n + 1)
    p, m, v, g = shifted[:n], torch.zeros(n), torch.zeros(n), torch.ones(n)
    block = torch.zeros(4 * n)
    hyper = dict(step=1, **HYPER, weight_decay=0.0)
    for out, names in [((shifted[1:], torch.zeros(n), torch.zeros(n)), ("param", "out[0]")),
                       ((block[:n], block[n // 2:3 * n // 2], block[2 * n:3 * n]), ("out[0]", "out[1]")),
                       ((torch.zeros(n), torch.zeros(n), g), ("grad", "out[2]"))]:
        with pytest.raises(ValueError, match=rf"{re.escape(names[0])} and {re.escape(names[1])} overlap"):
            adam_step_flat(p, g, m, v, out=out, **hyper)
    with pytest.raises(ValueError, match=r"out\[1\] \(exp_avg\) has 63 elements"):
        adam_step_flat(p, g, m, v, out=(torch.zeros(n), torch.zeros(n - 1), torch.zeros(n)), **hyper)
    with pytest.raises(TypeError, match="out must be a tuple"):
        adam_step_flat(p, g, m, v, out=(torch.zeros(n), torch.zeros(n)), **hyper)
    # the native check stands on its own (the binding takes bare addresses): an output
    # that overlaps an input is refused before anything is written
    q = torch.arange(2 * n, dtype=torch.float32)
    before = q.clone()
    with pytest.raises(ValueError, match="param_out overlaps param"):
        _native.adam_step(q.data_ptr(), g.data_ptr(), 0, m.data_ptr(), v.data_ptr(), n, step=1.0, lr=1e-2,
                          beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, grad_scale=1.0,
                          param_out=q.data_ptr() + 4 * (n // 2))
    assert torch.equal(q, before)
    # one output apart, the others in place
    ref = [q[:n].clone(), m.clone(), v.clone()]
    adam_step_flat(*ref[:1], g, *ref[1:], **hyper)
    new_param = torch.zeros(n)
    _native.adam_step(q.data_ptr(), g.data_ptr(), 0, m.data_ptr(), v.data_ptr(), n, step=1.0, lr=1e-2,
                      beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, grad_scale=1.0,
                      param_out=new_param.data_ptr())
    assert torch.equal(q, before) and torch.equal(new_param, ref[0])
    assert torch.equal(m, ref[1]) and torch.equal(v, ref[2])
    # the same through adam_step_flat: an entry of out that is its input (the same memory,
    # here another view of it) is updated in place
    p2, m2, v2, new_m = q[:n].clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    adam_step_flat(p2, g, m2, v2, out=(p2.view(-1), new_m, v2), **hyper)
    assert torch.equal(p2, ref[0]) and torch.equal(new_m, ref[1]) and torch.equal(v2, ref[2])
    assert not m2.any()


def test_large_steps_stream_the_copy_out_by_default():
    # The load-time threshold is a working set of half the last-level cache at 30 B/element:
    # positive, and far below the sizes tools/bench_adam.py measures (100M params).
    threshold = _native.adam_stream_copy_out_min_numel()
    assert offload.native_info()["adam_stream_copy_out_min_numel"] == threshold
    assert 0 < threshold < 100_000_000
    with stream_copy_out_from(12345):
        assert _native.adam_stream_copy_out_min_numel() == 12345
    assert _native.adam_stream_copy_out_min_numel() == threshold


def test_the_streaming_threshold_comes_from_sysfs_alone():
    """Half the highest-level cache of cpu0 as sysfs reports it, at 30 B/element, or a 32 MiB
    cache where sysfs says nothing: never glibc's sysconf, whose CPUID decoding says 320 MiB
    on an AMD EPYC guest. (Issue #43: reading sysfs through std::ifstream crashed the
    process on the lent GPU machine; the native code now reads it with POSIX calls.)"""
    import glob
    import os

    best_level, best_bytes = 0, 0
    for index in range(16):
        d = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            level = int(open(os.path.join(d, "level")).read())
            text = open(os.path.join(d, "size")).read().strip()
        except (OSError, ValueError):
            break
        digits = text.rstrip("KM")
        size = int(digits) << {"K": 10, "M": 20}.get(text[len(digits):len(digits) + 1], 0)
        if level > best_level:
            best_level, best_bytes = level, size
    assert glob.glob("/sys/devices/system/cpu/cpu0/cache/index*") or best_bytes == 0
    expected = (best_bytes if best_bytes > 0 else 32 << 20) // 2 // 30
    assert _native.adam_stream_copy_out_min_numel() == expected


# ---- CPUAdam against torch.optim itself -------------------------------------------------

def close_to_torch(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    # See [Note: how exact the tests are] for the bound.
    return bool(((ours - theirs).abs() <= 1e-6 * theirs.abs().clamp(min=1.0)).all())


def make_groups(seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen) for n in SIZES]
    return tensors, [
        dict(indices=[0, 1, 2], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
        dict(indices=[3, 4], lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
        dict(indices=[5], lr=5e-2, betas=(0.95, 0.9999), eps=1e-7, weight_decay=0.01),
    ]


def build_pair(torch_cls, adamw, seed=0):
    tensors, groups = make_groups(seed)
    ours = [torch.nn.Parameter(t.clone()) for t in tensors]
    theirs = [torch.nn.Parameter(t.clone()) for t in tensors]

    def group_list(params):
        return [dict(params=[params[i] for i in g["indices"]],
                     **{k: v for k, v in g.items() if k != "indices"}) for g in groups]

    return (ours, CPUAdam(group_list(ours), adamw=adamw),
            theirs, torch_cls(group_list(theirs), foreach=False))


def set_grads(ours, theirs, gen, skip=()):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if i in skip:
            a.grad = b.grad = None
        else:
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("torch_cls,adamw", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_cpuadam_matches_torch_with_param_groups(isa, torch_cls, adamw):
    ours, opt, theirs, ref = build_pair(torch_cls, adamw)
    gen = torch.Generator().manual_seed(1)
    with forced_isa(isa):
        for _ in range(STEPS):
            set_grads(ours, theirs, gen)
            opt.step()
            ref.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert close_to_torch(a.detach(), b.detach()), f"param {i}"
        sa, sb = opt.state[a], ref.state[b]
        assert sa["step"].dtype == torch.float32 and sa["step"].item() == STEPS
        if adamw:  # moments do not depend on the param or on sqrt: bit-exact
            assert torch.equal(sa["exp_avg"], sb["exp_avg"])
            assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_state_dict_round_trip_with_torch_adamw():
    ours, opt, theirs, ref = build_pair(torch.optim.AdamW, adamw=True)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        set_grads(ours, theirs, gen)
        opt.step()
        ref.step()

    # CPUAdam -> torch AdamW: a fresh AdamW loaded from CPUAdam continues like CPUAdam.
    saved = opt.state_dict()
    assert set(saved["param_groups"][0]) == set(ref.state_dict()["param_groups"][0])
    loaded_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    tensors, groups = make_groups()
    loaded = torch.optim.AdamW(
        [dict(params=[loaded_params[i] for i in g["indices"]]) for g in groups], foreach=False)
    # deepcopy as a save/load to disk would: load_state_dict may alias the given tensors.
    loaded.load_state_dict(copy.deepcopy(saved))
    # torch AdamW -> CPUAdam: a fresh CPUAdam loaded from torch's state continues like it.
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in loaded_params]
    back = CPUAdam([dict(params=[back_params[i] for i in g["indices"]]) for g in groups],
                   adamw=False)  # overwritten by the loaded groups
    back.load_state_dict(copy.deepcopy(loaded.state_dict()))
    assert all(g["decoupled_weight_decay"] for g in back.param_groups)
    for a, b in zip(opt.state.values(), back.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and a["step"].item() == b["step"].item()

    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for params in (ours, loaded_params, back_params):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        opt.step()
        loaded.step()
        back.step()
    for a, b, c in zip(ours, loaded_params, back_params):
        assert torch.equal(a, c)  # CPUAdam continued from torch's state: identical
        assert close_to_torch(a.detach(), b.detach())
    for p_ours, p_loaded in zip(ours, loaded_params):
        assert loaded.state[p_loaded]["step"].item() == 6


def test_lr_scheduler_changes_lr_each_step():
    ours, opt, theirs, ref = build_pair(torch.optim.AdamW, adamw=True)
    sched_ours = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    sched_ref = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        set_grads(ours, theirs, gen)
        opt.step()
        ref.step()
        sched_ours.step()
        sched_ref.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    for a, b in zip(ours, theirs):
        assert close_to_torch(a.detach(), b.detach())
    # A schedule that zeroes lr freezes params without decay (AdamW decay is lr * wd).
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in ours]
    set_grads(ours, theirs, gen)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ours))


def test_params_without_grad_are_skipped():
    ours, opt, theirs, ref = build_pair(torch.optim.AdamW, adamw=True)
    gen = torch.Generator().manual_seed(4)
    set_grads(ours, theirs, gen)
    opt.step()
    ref.step()
    before = [p.detach().clone() for p in ours]
    states_before = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(ours)}
    skip = {0, 3}  # param 0 has weight decay 0.1: still must not decay
    for _ in range(2):
        set_grads(ours, theirs, gen, skip=skip)
        opt.step()
        ref.step()
    for i in skip:
        assert torch.equal(ours[i], before[i])
        for k, v in states_before[i].items():
            assert torch.equal(opt.state[ours[i]][k], v)
    assert opt.state[ours[1]]["step"].item() == 3
    for a, b in zip(ours, theirs):
        assert close_to_torch(a.detach(), b.detach())
    # A param that never had a grad gets no state at all, as in torch.
    lonely = torch.nn.Parameter(torch.ones(3))
    opt2 = CPUAdam([lonely], weight_decay=0.5)
    opt2.step()
    assert len(opt2.state) == 0 and torch.equal(lonely, torch.ones(3))


# ---- errors --------------------------------------------------------------------------------

def flat_args(numel=8):
    return [torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)]


FLAT_HYPER = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize("index,name,bad,error", [
    (0, "param", torch.zeros(8, dtype=torch.float64), TypeError),
    (0, "param", torch.zeros(16)[::2], ValueError),
    (0, "param", [0.0] * 8, TypeError),
    (1, "grad", torch.zeros(8, dtype=torch.int32), TypeError),
    (1, "grad", torch.zeros(9), ValueError),
    (1, "grad", torch.zeros(16)[::2], ValueError),
    (2, "exp_avg", torch.zeros(8, dtype=torch.bfloat16), TypeError),
    (2, "exp_avg", torch.zeros(7), ValueError),
    (3, "exp_avg_sq", torch.zeros(16)[::2], ValueError),
    (3, "exp_avg_sq", torch.zeros(8, device="meta"), ValueError),
])
def test_adam_step_flat_rejects_bad_tensors(index, name, bad, error):
    args = flat_args()
    args[index] = bad
    with pytest.raises(error, match=name):
        adam_step_flat(*args, **FLAT_HYPER)


def test_adam_step_flat_rejects_bad_copy_out_and_step():
    with pytest.raises(TypeError, match="copy_out"):
        adam_step_flat(*flat_args(), **FLAT_HYPER, copy_out=torch.zeros(8))
    with pytest.raises(ValueError, match="copy_out"):
        adam_step_flat(*flat_args(), **FLAT_HYPER, copy_out=torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="step"):
        adam_step_flat(*flat_args(), **{**FLAT_HYPER, "step": 0})


def one_param_optimizer(param, grad, **kwargs):
    params = [torch.nn.Parameter(torch.zeros(2)), param]
    params[0].grad = torch.zeros(2)
    param.grad = grad
    return CPUAdam([dict(params=[params[0]]), dict(params=[torch.nn.Parameter(torch.zeros(1)), param])],
                   **kwargs)


@pytest.mark.parametrize("param,grad,error", [
    (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), TypeError),
    (torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16), TypeError),
    (torch.zeros(4), torch.zeros(4).to_sparse(), ValueError),
    (torch.zeros(4, 4).t(), torch.zeros(4, 4).t(), ValueError),  # non-contiguous param
    (torch.zeros(4, 4), torch.zeros(4, 4).t(), ValueError),      # non-contiguous grad
    (torch.zeros(4, device="meta"), torch.zeros(4, device="meta"), ValueError),  # not CPU
])
def test_cpuadam_rejects_bad_params_naming_them(param, grad, error):
    param = torch.nn.Parameter(param) if param.dtype.is_floating_point else param
    opt = one_param_optimizer(param, None)
    param.grad = grad
    with pytest.raises(error, match=r"param_groups\[1\]\['params'\]\[1\]"):
        opt.step()


def test_cpuadam_rejects_mismatched_grad_shape():
    param = torch.nn.Parameter(torch.zeros(4))
    opt = one_param_optimizer(param, None)
    param.grad = torch.zeros(4)
    with torch.no_grad():
        param.grad.set_(torch.zeros(2, 2))  # torch's assignment check does not see this
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\].*shape"):
        opt.step()


def test_cpuadam_rejects_amsgrad_and_maximize():
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], maximize=True)
    # The same options arriving through a torch state dict are refused at step().
    p = torch.nn.Parameter(torch.zeros(2))
    torch_opt = torch.optim.AdamW([p], amsgrad=True)
    opt = CPUAdam([p])
    opt.load_state_dict(torch_opt.state_dict())
    p.grad = torch.zeros(2)
    with pytest.raises(ValueError, match=r"param_groups\[0\].*amsgrad"):
        opt.step()


# ---- ISA selection and threads -----------------------------------------------------------

def run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_force_isa_unknown_name_fails_clearly_at_import():
    result = run_python("import offload", OFFLOAD_FORCE_ISA="avx9000")
    assert result.returncode != 0
    assert "avx9000" in result.stderr and "scalar, avx2, avx512" in result.stderr


@pytest.mark.parametrize("isa", ISAS)
def test_force_isa_selects_it(isa):
    result = run_python("import offload; print(offload.native_info()['adam_isa'])",
                        OFFLOAD_FORCE_ISA=isa)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == isa


def test_set_isa_rejects_unknown_name():
    with pytest.raises(ValueError, match="avx9000"):
        _native.adam_set_isa("avx9000")


def test_best_isa_is_selected_by_default():
    if os.environ.get("OFFLOAD_FORCE_ISA"):
        pytest.skip("OFFLOAD_FORCE_ISA is set")
    result = run_python("import offload; print(offload.native_info()['adam_isa'])")
    assert result.stdout.strip() == ISAS[-1]


def test_native_threads_follow_env_else_torch():
    code = "import offload, torch; print(offload.native_info()['num_threads'], torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    native, torch_threads = result.stdout.split()
    assert native == torch_threads
    result = run_python(code, OFFLOAD_NUM_THREADS="1")
    assert result.stdout.split()[0] == "1"
    assert offload.CPUAdam is CPUAdam


@pytest.mark.parametrize("isa", ISAS)
def test_fp16_copy_out_of_nan_keeps_the_payload_as_torch_does(isa):
    # torch's cast (and VCVTPS2PH) keeps the top 10 payload bits of a NaN and sets the quiet
    # bit; the scalar kernel used to write 0x7E00 for every NaN.
    payloads = torch.tensor([0x7FC12345, 0x7F801000, -0x10000, 0x7FFFFFFF, -0x7F3EDCBB], dtype=torch.int32)
    param = payloads.view(torch.float32).clone()
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    copy_out = torch.empty(param.numel(), dtype=torch.float16)
    with forced_isa(isa):
        adam_step_flat(param, torch.zeros_like(param), m, v, step=1, copy_out=copy_out,
                       **dict(HYPER, weight_decay=0.0))
    expected = payloads.view(torch.float32).to(torch.float16)
    assert torch.equal(copy_out.view(torch.int16), expected.view(torch.int16))
