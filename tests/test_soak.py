"""Long runs leak nothing: process memory, file descriptors, threads and swap bytes stay flat
after a warm-up, the always-on trace buffers stop growing at their documented bounds
(docs/architecture.md, "Bounded buffers"), and wrap/close cycles give back every fd, thread
and swap file.

What is sampled, from the process itself (no psutil): VmRSS from /proc/self/status, the
entries of /proc/self/fd, threading.active_count() and the entries of /proc/self/task (the
native I/O and Adam threads are not Python threads), and the files under swap_dir with their
sizes. Counts must be exactly equal; only RSS gets a slack (see RSS_SLACK_BYTES).

The soaks are marked slow: about two minutes of CPU time in all (measured as user time on
a loaded two-core machine, where they took 12 minutes of wall time); the trace-count bound
of the prefetcher is also pinned by a fast test.
"""
import gc
import os
import threading

import pytest
import torch

import offload
import offload.io.engine
import offload.prefetch.prefetcher
import offload.stats
import offload.tiers.nvme
from offload.gpt import GPT
from offload.prefetch import Prefetcher
from support import CFG, batches, gpt_loss, make_opt

# The trace buffers are shrunk so that they fill during the warm-up: the soak then checks
# that they stay at their bound, not merely that they have not reached it yet.
TIMELINE_SPANS = 256         # about 30 spans a step for this model
TRACE_REQUESTS = 128         # about 20 requests a step with both tiers on NVMe
TRACKED_REQUESTS = 128       # the I/O engine's finished requests kept for wait_all
MAX_TRACES = 3               # fewer than the kinds of pass the soak runs (1 train + 4 eval)
EVAL_SHAPES = ((1, 8), (1, 12), (2, 5), (3, 16))  # (batch, tokens): a kind of pass each

WARMUP_STEPS = 20            # traces recorded, buffers full, pools and allocator arenas at their size
MEASURED_STEPS = 60          # sampled every SAMPLE_EVERY steps
SAMPLE_EVERY = 6

# RSS is the one measure that may move without a leak: glibc's malloc keeps freed chunks in
# per-thread arenas and returns them lazily, and torch's CPU allocator caches blocks by size.
# On the development machine, with every buffer above at its bound, RSS moved by 0 over the
# 30 steps of the second half (host and NVMe; 16 KiB over all 60 measured NVMe steps), and
# by 24 KiB from step 100 to 225 of a longer NVMe run. 1 MiB leaves that noise a wide
# margin, yet a leak of one block's compute copy a step (52 KiB: 1.5 MiB over 30 steps) or
# anything larger fails the check.
RSS_SLACK_BYTES = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise AssertionError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> tuple:
    return threading.active_count(), len(os.listdir("/proc/self/task"))


def swap_files(swap_dir) -> dict:
    """path -> size in bytes of every file under swap_dir (the run directory's included)."""
    sizes = {}
    for root, _, names in os.walk(swap_dir):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, swap_dir)] = os.stat(path).st_size
    return sizes


@pytest.fixture
def shrunk_buffers(monkeypatch):
    # Module constants read when an engine is built (docs/architecture.md, "Seams").
    monkeypatch.setattr(offload.stats, "TIMELINE_SPANS", TIMELINE_SPANS)
    monkeypatch.setattr(offload.tiers.nvme, "TRACE_REQUESTS", TRACE_REQUESTS)
    monkeypatch.setattr(offload.prefetch.prefetcher, "MAX_TRACES", MAX_TRACES)
    monkeypatch.setattr(offload.io.engine, "TRACKED_REQUESTS", TRACKED_REQUESTS)


def sample(engine, swap_dir):
    gc.collect()
    debug = engine.debug
    return {
        "rss": rss_bytes(),
        "fds": open_fds(),
        "threads": threads(),
        "swap": swap_files(swap_dir),
        "timeline": len(debug.timeline),
        "requests": len(debug.nvme.recent) if debug.nvme is not None else 0,
        "traces": debug.prefetcher.num_traces,
        "micro_steps": engine.stats()["micro_steps"],
    }


def train_and_sample(engine, swap_dir):
    """Train WARMUP_STEPS + MEASURED_STEPS steps, with an eval pass of another input shape
    every few steps (each a kind of pass with its own trace); samples after the warm-up."""
    data = batches(8)
    eval_inputs = [torch.randint(0, CFG.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(t))
                   for b, t in EVAL_SHAPES]
    samples = []
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        engine.backward(gpt_loss(engine, data[step % len(data)]))
        engine.step()
        if step % 2 == 1:  # every eval shape comes back every 8 steps: traces are evicted and re-recorded
            engine.eval()
            with torch.no_grad():
                loss = gpt_loss(engine, eval_inputs[(step // 2) % len(eval_inputs)])
            assert torch.isfinite(loss)
            engine.train()
        if step + 1 >= WARMUP_STEPS and (step + 1 - WARMUP_STEPS) % SAMPLE_EVERY == 0:
            samples.append(sample(engine, swap_dir))
    return samples


def assert_flat(samples, with_nvme):
    first = samples[0]
    for s in samples[1:]:
        where = f"at micro-step {s['micro_steps']} (first sample at {first['micro_steps']})"
        assert s["fds"] == first["fds"], f"open fds grew {where}: {first['fds']} -> {s['fds']}"
        assert s["threads"] == first["threads"], f"threads changed {where}: {first['threads']} -> {s['threads']}"
        assert s["swap"] == first["swap"], f"swap files changed {where}: {first['swap']} -> {s['swap']}"
        # trace buffers: full from the warm-up on, and never beyond their bound
        assert s["timeline"] == TIMELINE_SPANS, where
        assert s["requests"] == (TRACE_REQUESTS if with_nvme else 0), where
        assert 1 <= s["traces"] <= MAX_TRACES, where
    middle = samples[len(samples) // 2]
    growth = samples[-1]["rss"] - middle["rss"]  # over the second half
    assert growth < RSS_SLACK_BYTES, \
        f"RSS grew by {growth / 2**20:.2f} MiB over the second half of the soak (slack {RSS_SLACK_BYTES >> 20} MiB)"


def make_engine(tmp_path, tier):
    torch.manual_seed(0)
    model = GPT(CFG)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir(exist_ok=True)
    config = offload.OffloadConfig(device="cpu", param_tier=tier, optimizer_tier=tier,
                                   swap_dir=str(swap_dir) if tier == "nvme" else None,
                                   device_budget=96 * 1024)  # a third of the model: units stream
    return offload.wrap(model, make_opt(model.parameters()), config), swap_dir


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["nvme", "host"])
def test_soak_is_flat_after_warmup(tier, tmp_path, shrunk_buffers):
    engine, swap_dir = make_engine(tmp_path, tier)
    with engine:
        samples = train_and_sample(engine, swap_dir)
    assert samples[0]["swap"] if tier == "nvme" else not samples[0]["swap"]
    assert_flat(samples, with_nvme=tier == "nvme")
    assert swap_files(swap_dir) == {} or tier == "host"


@pytest.mark.slow
def test_wrap_close_cycles_return_fds_threads_and_swap_files(tmp_path):
    """Each cycle wraps a model on NVMe, trains two steps and closes; after the first cycle
    (which starts what lives for the process: torch's and the native Adam's thread pools),
    fds, threads and the files under swap_dir are back at the same numbers every time."""
    def cycle():
        engine, swap_dir = make_engine(tmp_path, "nvme")
        with engine:
            for b in batches(2):
                engine.backward(gpt_loss(engine, b))
                engine.step()
            assert swap_files(swap_dir)  # the run's swap file exists while it runs
        gc.collect()
        return open_fds(), threads(), swap_files(swap_dir)

    baseline = cycle()
    assert baseline[2] == {}, f"close() left files under swap_dir: {baseline[2]}"
    for i in range(4):
        assert cycle() == baseline, f"cycle {i + 2} did not return to the first cycle's fds/threads/swap files"


def test_prefetcher_keeps_at_most_max_traces(monkeypatch):
    """A run fed many input shapes records a trace per shape; only the MAX_TRACES most
    recently used are kept, and a kind of pass in use keeps replaying its trace."""
    monkeypatch.setattr(offload.prefetch.prefetcher, "MAX_TRACES", 3)
    p = Prefetcher(enabled=True, max_units_ahead=2, warn=lambda msg: None)
    for shape in range(10):
        for key in ("train", ("eval", shape)):  # "train" is used between every new shape
            p.begin_pass(key)
            for u in (0, 1, 2):
                p.need(u)
            assert key != "train" or shape == 0 or p.replaying  # its trace was never evicted
        p.end_pass()
        assert p.num_traces <= 3
    assert p.num_traces == 3
    p.begin_pass(("eval", 0))  # evicted long ago: recorded anew
    assert not p.replaying
