"""The numerics tests under every kernel choice this machine can make, so that a tolerance
tuned on one CPU cannot pass here and fail on another x86-64 machine (issue 36: an AMD EPYC
failed a bound that held only with an Intel Xeon's kernels).

Each case runs NUMERICS_TESTS again in a child process (``-m "not slow"``) with the kernels
forced through the variables that select them when the libraries load (as test_golden.py
forces the recorded ones):

- ``adam-<isa>``: our Adam kernel at each instruction set the native module has here other
  than the one it picks by itself (OFFLOAD_FORCE_ISA: scalar, avx2, avx512), which the
  suite's own run covers (avx2 within ``avx2-machine`` where that case runs);
- ``avx2-machine``: where torch picks AVX-512, every kernel an AVX2-only machine picks:
  torch's (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA), MKL's (MKL_CBWR, STRICT, or
  an Intel CPU limited to AVX2 still sums in another order than an AMD machine) and ours.

A case passes when every test of the child passes; its output is shown when one does not.
Slow: the child runs take a few minutes in all.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload

REPO = Path(__file__).parent.parent
# The tests whose bounds depend on the arithmetic: parity with plain PyTorch (fp32, clipped,
# bf16 against fp32), the Adam kernels against their references, the split master, the
# speculative and delayed paths against the serialized ones and their references, the compact
# states' fused kernel (its engine runs included) on the ISA forced.
NUMERICS_TESTS = ["tests/test_optim_cpu_adam.py", "tests/test_engine.py", "tests/test_optim_split_master.py",
                  "tests/test_optim_speculative.py", "tests/test_optim_delayed.py", "tests/test_optim_grad_dtype.py",
                  "tests/test_optim_native_kernels.py", "tests/test_optim_compact.py"]


def kernel_choices():
    """(case id, variables) for every kernel choice this machine can make but its own; our
    AVX2 Adam is checked with the rest of an AVX2 machine's kernels where those can be
    forced (one child run instead of two)."""
    info = offload.native_info()
    avx2_machine = torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx2" in info["adam_isas_available"]
    cases = [(f"adam-{isa}", {"OFFLOAD_FORCE_ISA": isa}) for isa in info["adam_isas_available"]
             if isa != info["adam_isa"] and not (isa == "avx2" and avx2_machine)]
    if avx2_machine:
        cases.append(("avx2-machine", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                       "MKL_CBWR": "AVX2,STRICT", "OFFLOAD_FORCE_ISA": "avx2"}))
    return cases


CHOICES = kernel_choices()


@pytest.mark.slow
@pytest.mark.parametrize("variables", [v for _, v in CHOICES], ids=[name for name, _ in CHOICES])
def test_the_numerics_tests_pass_with_these_kernels(variables):
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *NUMERICS_TESTS],
        cwd=REPO, env={**os.environ, **variables}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=1800)
    forced = " ".join(f"{k}={v}" for k, v in variables.items())
    assert child.returncode == 0, f"with {forced}:\n{child.stdout[-6000:]}"
    if "OFFLOAD_FORCE_ISA" in variables:  # the child really ran the forced kernel
        probe = subprocess.run([sys.executable, "-c", "import offload; print(offload.native_info()['adam_isa'])"],
                               cwd=REPO, env={**os.environ, **variables}, capture_output=True, text=True, timeout=120)
        assert probe.stdout.strip() == variables["OFFLOAD_FORCE_ISA"], probe.stdout + probe.stderr

