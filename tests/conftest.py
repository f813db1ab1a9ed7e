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


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """A test not marked ``gpu`` sees a machine without CUDA whatever this one has: device
    "auto" resolves to the CPU, host buffers are not pinned, and the processes it starts
    see no GPU either. Most tests feed CPU batches and compare with CPU references; on a GPU
    machine they would otherwise run the engine on CUDA (issue 37, finding 3)."""
    if "gpu" in request.keywords:
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
