"""offload.io.probe: which I/O backend "auto" picks, what config accepts, and that the NVMe
tier and wrap check the backend in the swap directory."""
import errno
import os
import re

import pytest
import torch

import offload
import offload.io
import offload.io.probe
from offload import _native
from offload.gpt import GPT, GPTConfig
from offload.io import IOEngine, probe_directory
from offload.tiers import NvmeTier

from support import working_io_backends

BACKENDS = working_io_backends()


# ---------------------------------------------------------------- which backend is used
# [Note: auto backend choice] These tests fake which backends this build has and how each
# one's check goes, so they pin the rule whatever this machine's kernel allows.

def _fake_backends(monkeypatch, compiled, outcome):
    """This build has ``compiled``; the check of a backend in a directory returns
    ``outcome[backend]`` as its seconds, or raises it when it is an exception. Returns the
    (backend, directory) of every check, in order."""
    checks = []

    def time_backend(backend, directory):
        checks.append((backend, directory))
        if isinstance(outcome[backend], BaseException):
            raise outcome[backend]
        return outcome[backend]

    class FakeCore:  # an engine that starts whatever it is asked for and moves nothing
        def __init__(self, backend, block_bytes, queue_depth, max_open_files):
            self.backend = backend

        def hold_file(self, path, fd):  # the NVMe tier hands its swap files over
            pass

        def close(self):
            pass

    monkeypatch.setattr(_native, "io_available_backends", lambda: list(compiled))
    monkeypatch.setattr(_native, "IOEngineCore", FakeCore)
    monkeypatch.setattr(offload.io.probe, "_time_backend", time_backend)
    monkeypatch.setattr(offload.io.probe, "_auto_choice_by_dir", {})
    monkeypatch.setattr(offload.io.probe, "_refusal_by_backend", {})
    return checks


REFUSED = OSError(errno.EPERM, "io_uring_setup: Operation not permitted")


def test_auto_prefers_io_uring_then_libaio_then_threads_whatever_the_timings(monkeypatch, tmp_path):
    # Timings that favour the least preferred backend, and a build that lists it first.
    checks = _fake_backends(monkeypatch, ["threads", "libaio", "io_uring"],
                            {"io_uring": 0.3, "libaio": 0.2, "threads": 0.1})
    report = probe_directory(tmp_path)
    assert list(report["backends"]) == ["io_uring", "libaio", "threads"]
    assert [r["seconds"] for r in report["backends"].values()] == [0.3, 0.2, 0.1]  # still reported
    assert report["choice"] == report["best"] == "io_uring"
    checks.clear()
    with IOEngine("auto", probe_dir=str(tmp_path)) as io:
        assert io.backend == "io_uring"
    assert checks == [("io_uring", str(tmp_path))]  # auto stops at the first that works


def test_auto_takes_the_next_backend_when_the_preferred_one_fails(monkeypatch, tmp_path):
    _fake_backends(monkeypatch, ["io_uring", "libaio", "threads"],
                   {"io_uring": REFUSED, "libaio": 0.2, "threads": 0.1})
    report = probe_directory(tmp_path)
    assert report["backends"]["io_uring"] == {
        "ok": False, "seconds": None, "error": "io_uring_setup: Operation not permitted (errno 1)"}
    assert report["choice"] == report["best"] == "libaio"
    with IOEngine("auto", probe_dir=str(tmp_path)) as io:
        assert io.backend == "libaio"

    _fake_backends(monkeypatch, ["io_uring", "threads"], {"io_uring": REFUSED, "threads": 0.5})
    assert probe_directory(tmp_path)["choice"] == "threads"  # libaio not in this build
    with IOEngine("auto", probe_dir=str(tmp_path)) as io:
        assert io.backend == "threads"

    _fake_backends(monkeypatch, ["io_uring", "threads"],
                   {"io_uring": REFUSED, "threads": OSError("data read back differs")})
    assert probe_directory(tmp_path)["choice"] is None
    with pytest.raises(OSError, match=r"no I/O backend works in .*io_uring: io_uring_setup: "
                                      r"Operation not permitted \(errno 1\); threads: data read back"):
        IOEngine("auto", probe_dir=str(tmp_path))


def test_config_accepts_every_backend_of_the_io_engine():
    assert offload.config.IO_BACKENDS == offload.io.BACKENDS
    for backend in BACKENDS:  # those this machine starts
        assert offload.OffloadConfig(io_backend=backend).io_backend == backend
    if "libaio" in BACKENDS:
        assert offload.OffloadConfig.from_any({"io_backend": "libaio"}).io_backend == "libaio"
    else:
        with pytest.raises(ValueError, match="io_backend: 'libaio' cannot be used in this process"):
            offload.OffloadConfig(io_backend="libaio")
    with pytest.raises(ValueError, match="io_backend: got 'aio'; accepted values are "
                                         "'auto', 'io_uring', 'libaio', 'threads'"):
        offload.OffloadConfig(io_backend="aio")


def test_config_refuses_a_backend_missing_from_the_build_or_refused_by_the_kernel(monkeypatch):
    _fake_backends(monkeypatch, ["io_uring", "threads"], {})
    with pytest.raises(ValueError, match=r"io_backend: 'libaio' cannot be used in this process: "
                                         r"not compiled into this build \(it has io_uring, threads\)"):
        offload.OffloadConfig(io_backend="libaio")

    class RefusingCore:
        def __init__(self, backend, *args):
            if backend == "io_uring":  # as under seccomp or kernel.io_uring_disabled=2
                raise OSError(errno.EPERM, "io_uring_setup: Operation not permitted", "")

        def close(self):
            pass

    monkeypatch.setattr(_native, "IOEngineCore", RefusingCore)
    with pytest.raises(ValueError, match=r"io_backend: 'io_uring' cannot be used in this process: the "
                                         r"kernel refuses it: io_uring_setup: Operation not permitted "
                                         r"\(errno 1\); use 'auto'"):
        offload.OffloadConfig(io_backend="io_uring")
    assert offload.OffloadConfig(io_backend="threads").io_backend == "threads"
    assert offload.OffloadConfig(io_backend="auto").io_backend == "auto"


def test_nvme_tier_checks_its_backend_in_the_swap_directory(monkeypatch, tmp_path):
    swap_dir = str(tmp_path / "swap")
    checks = _fake_backends(monkeypatch, ["io_uring", "libaio", "threads"],
                            {"io_uring": 0.3, "libaio": 0.2, "threads": 0.1})
    tier = NvmeTier(swap_dir, 0, "auto", 1 << 20, 8)
    try:
        assert tier.io.backend == "io_uring"
    finally:
        tier.close()
    assert checks == [("io_uring", swap_dir)]  # probed where the swap files go, not in /tmp
    checks.clear()
    tier = NvmeTier(swap_dir, 0, "threads", 1 << 20, 8)
    tier.close()
    assert checks == [("threads", swap_dir)]


def test_wrap_names_io_backend_when_it_fails_in_the_swap_directory(monkeypatch, tmp_path):
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    failure = OSError(errno.EINVAL, "pwrite: Invalid argument")
    _fake_backends(monkeypatch, ["io_uring", "libaio", "threads"],
                   {"io_uring": failure, "libaio": failure, "threads": failure})
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters())
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(swap_dir))
    with pytest.raises(OSError, match=rf"io_backend='threads': I/O backend 'threads' does not work in "
                                      rf"{re.escape(str(swap_dir))}: pwrite: Invalid argument \(errno 22\)"):
        offload.wrap(model, opt, config=dict(config, io_backend="threads"))
    with pytest.raises(OSError, match=rf"io_backend='auto': no I/O backend works in {re.escape(str(swap_dir))}: "
                                      r"io_uring: .*; libaio: .*; threads: pwrite: Invalid argument"):
        offload.wrap(model, opt, config=config)
    assert os.listdir(swap_dir) == []  # no lock, no run directory, no probe file left
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
