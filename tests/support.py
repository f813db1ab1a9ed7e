"""Helpers shared by the test modules: the small GPT and its batches, the plain-PyTorch
reference the engine is compared with, small models (Checkpointed, Sleepy), and stand-ins
for the NVMe tier's I/O engine (FaultyIO fails on request, SlowDevice is a slow disk).

Test modules import from here (``from support import ...``), never from one another
(tests/test_layers.py checks that). pytest puts tests/ on sys.path before it imports a test
module from there (the default "prepend" import mode), so ``import support`` works in the
test modules and in the worker processes they start.

Tests reach the engine's internals through its documented seams only: ``Engine.stats()`` for
counters, ``Engine.debug`` for the tier and mechanism objects, ``offload.faults`` to inject failures (wrap_swap_io below goes through it)."""
import contextlib
import os
import queue
import socket
import threading
import time

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import _native
from offload.gpt import GPT, GPTConfig
from offload.io import IOEngine, aligned_empty


# ------------------------------------------------------------------ the model and its reference
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=4)
# fp32 parity bound from the issue. The engine runs the same fp32 operations in the same
# order as torch's single-tensor AdamW, so against reference_optimizer_step the error is 0;
# 1e-5 leaves room for a kernel that fuses differently (FMA) without hiding a real bug
# (those show as >1e-3).
REL_TOL = 1e-5
# Clipped runs against plain clip_grad_norm_ + AdamW. The engine sums the per-parameter fp32
# norms' squares in float64 and folds the coefficient into Adam; torch takes an fp32 norm of
# the stacked fp32 norms and multiplies the gradients by the coefficient in fp32 first. The
# coefficients differ in their last bits, and Adam's normalisation carries that into the
# parameters with the smallest gradients. Measured on test_optim_speculative's clipping run
# (MIXED_NORM, 6 steps; the same run without clipping is bit for bit plain PyTorch): 3.6e-7
# with MKL's AVX2 kernels (an AMD EPYC, or MKL_CBWR=AVX2,STRICT), 1.9e-5 with its AVX-512 ones
# (an Intel Xeon); plain PyTorch against itself, MKL AVX2 against AVX-512 on that Xeon,
# differs by 5.5e-5. A real bug shows as > 1e-3.
CLIP_REL_TOL = 1e-4
# bf16 runs against fp32 ones, on the loss (what users watch): bf16 keeps 8 mantissa bits,
# a relative rounding of 2**-9 ~ 0.002 per op; after 10 steps of the small GPT the curve
# stays within a few percent of fp32. A real bug (a wrong copy, a missed update) moves the
# loss by far more within a few steps.
BF16_LOSS_REL_TOL = 0.05


def batches(n, seed=1, batch=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len + 1), generator=g) for _ in range(n)]


def gpt_loss(model, b):
    return model(b[:, :-1], b[:, 1:])


def make_opt(params, kind="adamw", lr=1e-2, weight_decay=0.1):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=False)


@contextlib.contextmanager
def correctly_rounded_sqrt():
    """torch.Tensor.sqrt correctly rounded while the block runs.

    torch's CPU sqrt calls MKL's vsSqrt, which is not correctly rounded, and how often it
    misses depends on the CPU: about 0.6% of results one ulp off where [Note: how exact
    the tests are] (tests/test_optim_cpu_adam.py) was measured, 19.5% on an AMD EPYC
    (AVX2). The engine's Adam uses IEEE sqrt. Adam amplifies one-ulp differences (a tiny gradient that changed
    in its leading digits moves Adam's normalized update as much as a large one): over the
    10 steps of test_fp32_parity_every_tier_combination on the EPYC, stock
    torch.optim.AdamW differs from itself with IEEE sqrt by 1.37e-5 relative, over
    REL_TOL, while the engine equals the IEEE-sqrt reference bit for bit at every step.
    sqrt is the only op of _single_tensor_adam's step this replaces. The in-place sqrt_
    (centered RMSprop's) is replaced too."""
    torch_sqrt, torch_sqrt_ = torch.Tensor.sqrt, torch.Tensor.sqrt_

    def ieee_sqrt(self):
        if self.dtype != torch.float32 or self.device.type != "cpu" or self.requires_grad:
            return torch_sqrt(self)
        return torch.from_numpy(np.sqrt(self.contiguous().numpy()))  # numpy: SQRTPS, correctly rounded

    def ieee_sqrt_(self):
        if self.dtype != torch.float32 or self.device.type != "cpu" or self.requires_grad:
            return torch_sqrt_(self)
        return self.copy_(ieee_sqrt(self))

    torch.Tensor.sqrt, torch.Tensor.sqrt_ = ieee_sqrt, ieee_sqrt_
    try:
        yield
    finally:
        torch.Tensor.sqrt, torch.Tensor.sqrt_ = torch_sqrt, torch_sqrt_


def reference_optimizer_step(opt):
    """opt.step() of a reference torch.optim.Adam/AdamW(foreach=False), with IEEE sqrt."""
    with correctly_rounded_sqrt():
        opt.step()


def train_reference(model, data, steps_per_update=1, max_grad_norm=None, opt=None, loss_fn=gpt_loss):
    opt = opt or make_opt(model.parameters())
    losses = []
    for i, b in enumerate(data):
        loss = loss_fn(model, b)
        (loss / steps_per_update).backward()
        losses.append(loss.item())
        if (i + 1) % steps_per_update == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            reference_optimizer_step(opt)
            opt.zero_grad()
    return losses


def train_holding_the_first_delayed_update(config, data, timeout):
    """[Note: delayed updates] Train GPT(CFG) (seed 0) on ``data`` with the first delayed
    update (step 1's first unit, the root) held on the optimizer worker until step 2's
    forward has run a block, or ``timeout`` s: (losses, state_dict, stats, held), ``held``
    [True] when the hold saw that forward (a forward that waited for the update would not
    run meanwhile)."""
    import offload.faults

    forward_ran = threading.Event()
    held = []

    def hold(**context):
        held.append(forward_ran.wait(timeout=timeout))

    torch.manual_seed(0)
    model = GPT(CFG)
    model.blocks[1].register_forward_hook(lambda *args: forward_ran.set())
    losses = []
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        # armed throughout: the first hit is step 1's first delayed update (nothing before
        # step 1's step() reaches the point: no early or deferred updates in this mode)
        with offload.faults.inject("optim.deferred_update", hold, at=1):
            for k, b in enumerate(data, start=1):
                loss = gpt_loss(engine, b)
                if k == 1:
                    forward_ran.clear()  # set by this forward: the update waits for step 2's
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses, engine.state_dict(), engine.stats(), held


def train_offload(engine, data, loss_fn=gpt_loss, settle_backward=False):
    """``settle_backward``: as train_gpt's."""
    losses = []
    for b in data:
        loss = loss_fn(engine, b)
        engine.backward(loss)
        if settle_backward:
            engine.debug.updates.wait_optimizer()
        engine.step()
        losses.append(loss.item())
    return losses


def train_gpt(config, data, frozen=(), settle_backward=False, model_config=CFG):
    """The small GPT (seed 0; ``model_config``) wrapped with ``config`` and trained on
    ``data``, parameters whose names start with one of ``frozen`` frozen: (losses, the
    state_dict after training, the stats, every update's grad_norm, each taken once the
    update is settled).
    ``settle_backward``: wait for the optimizer worker between backward and step(), so that
    every speculative update runs and step() takes none back ([Note: speculative updates]:
    which it takes back otherwise depends on how far the worker got)."""
    torch.manual_seed(0)
    model = GPT(model_config)
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and name.startswith(frozen)))
    norms, losses = [], []
    accumulation = config.get("gradient_accumulation_steps", 1)
    with offload.wrap(model, make_opt([p for p in model.parameters() if p.requires_grad]), config=config) as engine:
        for i, b in enumerate(data):
            loss = gpt_loss(engine, b)
            engine.backward(loss)
            if settle_backward:
                engine.debug.updates.wait_optimizer()
            engine.step()
            losses.append(loss.item())
            if (i + 1) % accumulation == 0:
                engine.state_dict()  # settles a deferred step, so that its norm is taken
                norms.append(engine.stats()["grad_norm"])
        return losses, engine.state_dict(), engine.stats(), norms


# ------------------------------------------------------------------ peak RSS in a fresh process
# A GPT large enough that budgets show in RSS (d_model 512, 16 layers: 202 MB of fp32
# gradients), trained by RSS_SCRIPT in a subprocess, and the RSS no budget covers
# (activations, autograd's gradient tensors before the hook takes them, the I/O engine,
# allocator slack): the bound of test_optim_grad_spill and test_memory_placement.
RSS_GPT = GPTConfig(vocab_size=256, seq_len=64, d_model=512, num_heads=8, num_layers=16)
RSS_SLACK_BYTES = 256 << 20
RSS_SCRIPT = """
import json, resource, sys
import torch
import offload
from offload.gpt import GPT, GPTConfig
torch.set_num_threads(1)
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cfg, config = GPTConfig(**json.loads(sys.argv[1])), json.loads(sys.argv[2])
with torch.device("meta"):
    model = GPT(cfg)
g = torch.Generator().manual_seed(1)
with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config) as engine:
    for _ in range(2):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x).reshape(-1, cfg.vocab_size), x.reshape(-1))
        engine.backward(loss)
        engine.step()
    stats = engine.stats()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(baseline=baseline, peak=peak, stats=stats)))
"""


def rss_gpt_sizes(element_bytes=4):
    """The units of RSS_GPT as wrap cuts them on one process."""
    from offload.memory.budget import model_unit_sizes

    with torch.device("meta"):
        return model_unit_sizes(GPT(RSS_GPT), element_bytes)


def train_in_fresh_process(config):
    """RSS_GPT wrapped with ``config`` (a dict) and trained 2 steps in a fresh process:
    (ru_maxrss after ``import torch, offload``, peak ru_maxrss, the engine's stats)."""
    import dataclasses
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(dataclasses.asdict(RSS_GPT)),
                          json.dumps(config)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["baseline"], result["peak"], result["stats"]


def max_rel_error(state, ref_state):
    worst = 0.0
    for k, ref in ref_state.items():
        assert k in state, f"missing key {k}"
        assert state[k].shape == ref.shape, k
        scale = ref.abs().max().clamp_min(1e-12)
        worst = max(worst, ((state[k].float() - ref.float()).abs().max() / scale).item())
    return worst


def model_compute_bytes(model):
    return sum(p.numel() for p in model.parameters()) * 4


def budget_for(model, fraction=0.5):
    return max(int(model_compute_bytes(model) * fraction), 1)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def nvme_gpt_engine(tmp_path, name="swap"):
    """A small GPT with params and optimizer on NVMe under a budget that evicts."""
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / name),
                  device_budget=140 * 1024)
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


class Checkpointed(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                     for _ in range(4)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = x.requires_grad_() if self.use_reentrant else x
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x).pow(2).mean()


class SometimesBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, h, use_b):
        h = torch.tanh(self.a(h))
        return h + self.b(h) if use_b else h


class Sometimes(nn.Module):
    """Blocks (units) whose second linear is used on some steps only: on the others it has
    no gradient, so an update of its unit must leave its value and moments as they are
    while it updates the rest ([Note: out-of-place Adam]: the kernel writes only what has a
    gradient, and a spare home must get the rest copied)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([SometimesBlock() for _ in range(3)])
        self.out = nn.Linear(32, 1)

    def forward(self, x, use_b):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, use_b)
        return self.out(h).pow(2).mean()


def train_sometimes(config, steps=6, settle_backward=False):
    """Sometimes (seed 0) wrapped with ``config``, trained for ``steps`` steps, its second
    linears used on steps 1, 4, 7, ... (every third: with delayed updates, the copy an update
    without them writes is read two steps later by a forward with them): (losses, the
    state_dict, the stats). ``settle_backward``: as train_gpt's."""
    torch.manual_seed(0)
    model = Sometimes()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 8, generator=g), i % 3 == 0) for i in range(steps)]
    dtype = torch.bfloat16 if config.get("dtype") == "bf16" else torch.float32
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        losses = train_offload(engine, data, loss_fn=lambda m, b: m(b[0].to(dtype), b[1]).float(),
                               settle_backward=settle_backward)
        return losses, engine.state_dict(), engine.stats()


# ------------------------------------------------------------------ models that take time
class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepyBlock(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return Sleep.apply(torch.tanh(self.lin(x)), self.seconds)


class Sleepy(nn.Module):
    def __init__(self, num_blocks, seconds):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))
        self.blocks = nn.ModuleList(SleepyBlock(seconds) for _ in range(num_blocks))

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


# ------------------------------------------------------------------ processes
# ------------------------------------------------------------------ signals
def sigint_once_main_waits_in(function, timeout=30.0):
    """A fault-point action for the optimizer worker: it waits until the main thread is
    blocked inside ``function`` (a name on its stack) on a condition (threading's, which
    concurrent.futures waits with: waiting on the worker), sends this process a real SIGINT, and
    gives the handler time to run before the update it holds goes on. Fires once; a real
    Ctrl-C lands where this one does. ``.sent`` tells whether it fired."""
    import signal
    import sys

    main = threading.main_thread().ident

    def main_stack():
        frame, names = sys._current_frames().get(main), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return names

    def action(**_):
        if action.sent:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            names = main_stack()
            if names[:1] == ["wait"] and function in names:
                action.sent = True
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the update is still running when the handler raises
                return
            time.sleep(0.002)
        raise AssertionError(f"the main thread never waited in {function}: {main_stack()}")
    action.sent = False
    return action


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ swap I/O
def working_io_backends():
    """The I/O backends this build has that also start on this machine."""
    def works(backend):
        try:
            IOEngine(backend, queue_depth=2).close()
            return True
        except OSError:  # e.g. io_uring refused by seccomp or kernel.io_uring_disabled
            return False

    return [b for b in _native.io_available_backends() if works(b)]


def wrap_swap_io(engine, wrapper, *args, **kwargs):
    """Route the engine's NVMe requests through ``wrapper(io, *args, **kwargs)``, ``io`` being
    the I/O engine they go to now; returns the wrapper. unwrap_swap_io undoes it. A wrapper
    keeps what it wraps in ``inner``."""
    nvme = engine.debug.nvme
    nvme.io = wrapper(nvme.io, *args, **kwargs)
    return nvme.io


def unwrap_swap_io(engine):
    """Undo the last wrap_swap_io: the requests go to the wrapped I/O engine again."""
    nvme = engine.debug.nvme
    nvme.io = nvme.io.inner


class FailedHandle:
    """An I/O handle whose wait() raises ``error``: a request that failed."""

    def __init__(self, error):
        self._error = error

    def wait(self):
        raise self._error

    def done(self):
        return True


class FaultyIO:
    """Wraps the engine's IOEngine (``inner``): the k-th write (after scribbling over its
    target, as a half-done write would) or the k-th read fails with ``err``. Install it with
    wrap_swap_io(engine, FaultyIO, err, fail_write=k)."""

    def __init__(self, io, err, fail_write=None, fail_read=None):
        self.inner, self._err = io, err
        self._fail_write, self._fail_read = fail_write, fail_read
        self.writes = self.reads = 0

    def write_from(self, tensor, path, offset=0):
        self.writes += 1
        if self.writes == self._fail_write:
            garbage = aligned_empty(tensor.numel() * tensor.element_size()).fill_(0x7F)
            self.inner.write_from(garbage, path, offset).wait()
            return FailedHandle(OSError(self._err, os.strerror(self._err), path))
        return self.inner.write_from(tensor, path, offset)

    def read_into(self, tensor, path, offset=0):
        self.reads += 1
        if self.reads == self._fail_read:
            return FailedHandle(OSError(self._err, os.strerror(self._err), path))
        return self.inner.read_into(tensor, path, offset)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SlowDevice:
    """Wraps the engine's IOEngine (``inner``): one request at a time, each taking ``delay``
    seconds more than the real I/O (a slow disk with a single queue). Installed with
    wrap_swap_io(engine, SlowDevice, delay)."""

    def __init__(self, io, delay):
        self.inner, self.delay = io, delay
        self.requests = 0
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    class Handle:
        def __init__(self):
            self.event = threading.Event()
            self.result = self.error = None

        def wait(self):
            self.event.wait()
            if self.error:
                raise self.error
            return self.result

        def done(self):
            return self.event.is_set()

    def _serve(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, method, args = item
            time.sleep(self.delay)
            try:
                handle.result = method(*args).wait()
            except OSError as e:
                handle.error = e
            handle.event.set()

    def _submit(self, method, *args):
        self.requests += 1
        handle = self.Handle()
        self._queue.put((handle, method, args))
        return handle

    def read_into(self, tensor, path, offset=0):
        return self._submit(self.inner.read_into, tensor, path, offset)

    def write_from(self, tensor, path, offset=0):
        return self._submit(self.inner.write_from, tensor, path, offset)

    def close(self):
        self._queue.put(None)
        self._thread.join()
        self.inner.close()


# ------------------------------------------------------------------ update timing
class UpdatesHeldForTheNextForward:
    """Updates made to wait, on the optimizer worker, for the next forward to come near
    them: after ``hold()`` (called between backward and ``step()``), the update of the unit
    at position k of ``order`` (the unit names in forward order, the root first) waits until
    the next forward reaches unit k - 1 (the first block waits for its own forward; the
    root's update is not held: the forward starts by waiting for it). So the prefetcher,
    which looks ahead of the forward, has always met those updates queued and not started,
    whatever the machine's pace. ``fail``: (unit name, exception) that unit's held update
    raises once it is let go (an update still queued when step() returned, failing while
    the next forward runs); nothing is held after it. As a context manager it arms the
    ``hooks.forward``, ``optim.early_update`` and ``optim.deferred_update`` points, and lets
    everything go on exit."""

    def __init__(self, order, fail=None, timeout=60.0):
        self.order, self.fail, self.timeout = list(order), fail, timeout
        self._reached = None  # the units the forward since hold() has reached; None: not held
        self._changed = threading.Condition()
        self._stack = contextlib.ExitStack()

    def hold(self):
        with self._changed:
            self._reached = set()

    def _forward(self, unit, **_):
        with self._changed:
            if self._reached is not None:
                self._reached.add(unit)
                self._changed.notify_all()

    def _update(self, unit, **_):
        k = self.order.index(unit)
        if k == 0:
            return
        waits_for = self.order[max(k - 1, 1)]
        with self._changed:
            if not self._changed.wait_for(lambda: self._reached is None or waits_for in self._reached,
                                          self.timeout):
                raise AssertionError(f"the update of {unit} waited {self.timeout} s for the forward of {waits_for}")
        if self.fail is not None and self.fail[0] == unit and self._reached is not None:
            with self._changed:  # the forward stops here: the updates behind this one go on
                self._reached = None
                self._changed.notify_all()
            raise self.fail[1]

    def __enter__(self):
        self._stack.enter_context(offload.faults.inject("hooks.forward", self._forward))
        self._stack.enter_context(offload.faults.inject("optim.early_update", self._update))
        self._stack.enter_context(offload.faults.inject("optim.deferred_update", self._update))
        return self

    def __exit__(self, *exc):
        with self._changed:
            self._reached = None
            self._changed.notify_all()
        return self._stack.__exit__(*exc)


def curves(config, data, devices=("cuda", "cpu"), tmp_path=None):
    """The losses and engine stats of the small GPT trained under ``config`` on each device."""
    runs = {}
    for device in devices:
        torch.manual_seed(0)
        model = GPT(CFG)
        extra = dict(swap_dir=str(tmp_path / device)) if tmp_path is not None else {}
        with offload.wrap(model, make_opt(model.parameters()), config=dict(config, device=device, **extra)) as engine:
            runs[device] = (train_offload(engine, [b.to(device) for b in data]), engine.stats())
    return runs


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# The bodies of gpu-marked tests (tests/test_engine_gpu.py), which also run on the CPU device
# (test_device_streams.py) so that a GPU's few minutes are not spent on their own bugs.
def check_delayed_updates(devices, tmp_path):
    """[Note: delayed updates] after the warm-up each update runs during the next forward:
    the CUDA curve is the CPU device's."""
    config = dict(param_tier="host", optimizer_tier="nvme", delayed_update=True, delayed_update_warmup_steps=1)
    runs = curves(config, batches(5), devices, tmp_path)
    (a, stats), (b, _) = runs[devices[0]], runs[devices[1]]
    assert max_rel(a, b) < 1e-4
    assert stats["delayed_updates"] > 0


def check_activation_offload(kind, devices, tmp_path):
    """Saved tensors to pinned host buffers or NVMe and back: the run of keeping them, and
    every byte that left came back."""
    data = batches(3)
    kept = curves(dict(param_tier="host", optimizer_tier="host"), data, devices[:1], tmp_path / "kept")
    moved = curves(dict(param_tier="host", optimizer_tier="host", activation_offload=kind), data, devices[:1],
                   tmp_path / "moved")
    (a, _), (b, stats) = kept[devices[0]], moved[devices[0]]
    # CUDA's embedding backward adds with atomics: two runs may differ in the last bits
    assert max_rel(b, a) < 1e-5
    act = stats["activations"]
    assert act[f"moved_to_{kind}_bytes"] > 0 and act[f"moved_to_{kind}_bytes"] == act["returned_bytes"]

