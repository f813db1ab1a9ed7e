"""The engine's tests on the CPU stand-in of CUDA ([Note: streams], issue 37): the CPU device
takes every branch a GPU takes (staging slots with compute buffers, fetches through pinned
staging buffers, updates copied into device slots, a copy stream that runs behind the
caller), and the hazard checker follows every hand-off between the streams.

STANDIN_TESTS run again in a child process with OFFLOAD_DEVICE_STANDIN=cuda
(``-m "not slow"``); tests marked ``host_device`` pin what only the CPU device as users run
it does and are skipped there. Passes when every test of the child does, and at least one
was skipped for that reason (the variable reached the child). Slow: a few minutes.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload.tiers.streams import STANDIN_ENV

REPO = Path(__file__).parent.parent
# numerics on every tier pair, speculative and delayed updates, the
# split master, deferred updates and their fills, ZeRO on 2 and 4 ranks (early and delayed
# updates there too), faults and interrupts,
# prefetch, gathered parameters, and the streams' own tests
STANDIN_TESTS = ["tests/test_engine.py", "tests/test_golden.py",
                 "tests/test_optim_speculative.py", "tests/test_optim_delayed.py", "tests/test_optim_split_master.py",
                 "tests/test_optim_updates.py", "tests/test_zero.py", "tests/test_engine_faults.py",
                 "tests/test_engine_fault_matrix.py", "tests/test_interrupts.py", "tests/test_prefetch.py",
                 "tests/test_device_streams.py", "tests/test_gathered.py",
                 "tests/test_zero_groups.py", "tests/test_zero_overlap.py", "tests/test_zero_delayed.py",
                 "tests/test_zero_buckets.py"]


@pytest.mark.slow
def test_the_engine_tests_pass_on_the_cpu_standin_of_cuda():
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "--disable-warnings", "-p", "no:cacheprovider", "-m",
         "not slow", *STANDIN_TESTS],  # no warnings summary: the tail below keeps a failure's traceback
        cwd=REPO, env={**os.environ, STANDIN_ENV: "cuda"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=1800)
    failed = [line for line in child.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert child.returncode == 0, "\n".join(failed) + "\n" + child.stdout[-6000:]
    assert re.search(r"SKIPPED .*pins the CPU device's own behaviour", child.stdout), child.stdout[-3000:]
