"""tests/conftest.py hides CUDA from every test not marked gpu wherever the test's code runs:
in a module-scoped fixture, after the test's own ``monkeypatch.undo()``, and in processes a
forkserver starts. On a GPU machine each of these once ran the engine on CUDA (H200,
issue 43); on a machine without CUDA the environment variable shows whether the hiding held."""
import multiprocessing
import os

import pytest
import torch


@pytest.fixture(scope="module")
def seen_by_a_module_fixture():
    return torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_module_fixture_sees_no_cuda(seen_by_a_module_fixture):
    assert seen_by_a_module_fixture == (False, "")


def test_monkeypatch_undo_leaves_cuda_hidden(monkeypatch):
    monkeypatch.setenv("OFFLOAD_TEST_UNDONE", "1")
    monkeypatch.undo()
    assert not torch.cuda.is_available()
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""


def _report_environment(queue):
    queue.put(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_processes_a_forkserver_starts_see_no_cuda():
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    child = context.Process(target=_report_environment, args=(queue,))
    child.start()
    seen = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0 and seen == ""


@pytest.mark.gpu
def test_a_gpu_marked_test_sees_the_machines_cuda():
    assert torch.cuda.is_available()
    assert os.environ.get("CUDA_VISIBLE_DEVICES") != ""
