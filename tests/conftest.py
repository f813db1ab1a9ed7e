import os

import pytest
import torch

from offload.tiers.streams import STANDIN_ENV


def pytest_collection_modifyitems(config, items):
    if os.environ.get(STANDIN_ENV):
        # [Note: streams] the stand-in takes CUDA's branches: what only the CPU device does
        # as users run it is not there to test
        skip_host = pytest.mark.skip(reason=f"pins the CPU device's own behaviour; {STANDIN_ENV} is set")
        for item in items:
            if "host_device" in item.keywords:
                item.add_marker(skip_host)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_CUDA_IS_AVAILABLE = torch.cuda.is_available
_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="session", autouse=True)
def no_cuda_for_the_session():
    """A test not marked ``gpu`` sees a machine without CUDA whatever this one has: device
    "auto" resolves to the CPU, host buffers are not pinned, and the processes it starts
    see no GPU either. Most tests feed CPU batches and compare with CPU references; on a GPU
    machine they would otherwise run the engine on CUDA (issue 37, finding 3).

    Session-wide, in a MonkeyPatch of its own: module-scoped fixtures run before any
    function-scoped one, a forkserver keeps the environment of the moment it started, and a
    test's ``monkeypatch.undo()`` undoes everything its ``monkeypatch`` did. On the H200 each of
    the three put tests on CUDA when this was a function-scoped fixture on the test's own
    ``monkeypatch``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(autouse=True)
def cuda_when_marked_gpu(request):
    """A test marked ``gpu`` sees the machine's CUDA as the session found it."""
    if "gpu" not in request.keywords:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", _CUDA_IS_AVAILABLE)
        if _CUDA_VISIBLE_DEVICES is None:
            mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            mp.setenv("CUDA_VISIBLE_DEVICES", _CUDA_VISIBLE_DEVICES)
        yield
