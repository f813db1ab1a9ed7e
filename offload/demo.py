"""``offload demo``: train a small byte-level GPT on the Python standard library's own source,
with a device budget smaller than the model and every parameter, master weight and Adam
moment in swap files.

Why the default size (d_model 512, 6 layers, seq 128, batch 8: 19.1 M parameters, 73 MiB of
fp32 weights, 306 MiB of training state in swap files, a device budget of 41 MiB): on two
idle CPU cores its 100 steps (102k tokens) run in a couple of minutes and bring the loss
well below 5.5 (uniform over 256 bytes); the figures are in docs/performance.md ("Demo").
On a busy machine it is slower; --d-model/--layers/--steps scale it down or up.
"""
from __future__ import annotations

import fcntl
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, TextIO, Tuple

import torch
from torch import nn

MiB = 1 << 20


@dataclass(frozen=True)
class DemoSettings:
    d_model: int = 512
    num_layers: int = 6
    num_heads: int = 8
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 100
    lr: float = 2e-3
    dtype: str = "fp32"
    data_bytes: int = 4 * MiB
    device_budget: Optional[int] = None     # None: the smallest budget the engine accepts + 2 blocks
    swap_dir: Optional[str] = None          # None: a temporary directory, removed at the end
    trace: Optional[str] = None
    seed: int = 0


def stdlib_corpus(max_bytes: int) -> Tuple[bytes, str, int]:
    """The first ``max_bytes`` of the standard library's .py files (the directory of
    ``os.__file__``), in sorted path order, third-party site-packages left out."""
    root = os.path.dirname(os.path.abspath(os.__file__))
    chunks: List[bytes] = []
    total = num_files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            num_files += 1
            if total >= max_bytes:
                return b"".join(chunks)[:max_bytes], root, num_files
    if total < 1024:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return b"".join(chunks), root, num_files


def _init_weights(module: nn.Module) -> None:
    """GPT-2 style: small normal weights so the first loss is ~ln(256), zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Progress:
    """A one-line progress bar on a terminal; a line every few steps when piped."""

    def __init__(self, total: int, out: TextIO, width: int = 30) -> None:
        self.total = total
        self.out = out
        self.width = width
        self.tty = out.isatty()
        self.every = max(1, total // 20)

    def update(self, step: int, loss: float, tokens_per_second: float, eta_seconds: float) -> None:
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        text = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.3f} "
                f"| {tokens_per_second:,.0f} tok/s | eta {eta_seconds:.0f}s")
        if self.tty:
            self.out.write("\r" + text)
            if step == self.total:
                self.out.write("\n")
        elif step == 1 or step % self.every == 0 or step == self.total:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


class _StopRequest:
    """First Ctrl-C: finish the current step, then stop. Second: stop now."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> "_StopRequest":
        # SIGTERM (kill, timeout) also stops cleanly: the swap files are removed either way.
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping after this step (press again to stop now)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# The temporary swap directory of a demo: ``offload-demo-*`` in the temp directory, with a
# ``demo.lock`` flock()ed for the demo's life. A demo removes the ones whose lock is free (a
# demo killed by SIGKILL leaves its directory), and SIGTERM while it runs unwinds the demo so
# that its own directory goes too, see _SigtermUnwinds.
DEMO_DIR_PREFIX = "offload-demo-"
DEMO_LOCK = "demo.lock"


def make_temporary_swap_dir(out: TextIO) -> Tuple[str, int]:
    """A new temporary swap directory and the fd of its flock()ed lock, after removing the
    directories of demos that are no longer running (reported on ``out``)."""
    from offload.io.swap import remove_if_dead

    parent = tempfile.gettempdir()
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in sorted(os.listdir(parent_fd)):
            if not name.startswith(DEMO_DIR_PREFIX):
                continue
            try:  # no lock yet: a demo creating it right now
                freed = remove_if_dead(parent_fd, name, os.path.join(parent, name), DEMO_LOCK,
                                       no_lock_means_dead=False)
            except (OSError, ValueError):  # another user's, or not a directory: not ours to remove
                continue
            if freed is not None:
                print(f"removed {os.path.join(parent, name)} of a demo that was killed ({_fmt(freed)} freed)",
                      file=out)
    finally:
        os.close(parent_fd)
    swap_dir = tempfile.mkdtemp(prefix=DEMO_DIR_PREFIX)
    lock_fd = os.open(os.path.join(swap_dir, DEMO_LOCK),
                      os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    return swap_dir, lock_fd


class _Terminated(BaseException):
    """SIGTERM arrived: unwind (closing the engine, removing the temporary directory)."""


class _SigtermUnwinds:
    """SIGTERM raises _Terminated while inside (where SIGTERM's handler was SIG_DFL); on the
    way out, after the cleanup the unwinding did, SIGTERM is delivered again with its default
    action, so the demo still ends "killed by SIGTERM" ([Note: SIGTERM] in offload/io/swap.py
    does the same for the library without unwinding)."""

    def __enter__(self) -> "_SigtermUnwinds":
        self._installed = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        if self._installed:
            signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame) -> None:
        raise _Terminated

    def __exit__(self, kind, value, traceback) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if kind is _Terminated:
            os.kill(os.getpid(), signal.SIGTERM)


def _fmt(n: int) -> str:
    from offload.config import format_size
    return format_size(n)


def run_demo(s: DemoSettings, out: TextIO = sys.stdout) -> int:
    with _SigtermUnwinds():
        return _run_demo(s, out)


def _run_demo(s: DemoSettings, out: TextIO) -> int:
    import offload
    from offload.gpt import GPT, GPTConfig
    from offload.plan import place, shape_from_module

    torch.manual_seed(s.seed)
    text, source_dir, num_files = stdlib_corpus(s.data_bytes)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * 0.95)
    train = data[:split]
    if len(train) <= s.seq_len + 1:
        raise ValueError(f"--data-bytes: {len(data)} bytes is too little text for --seq-len {s.seq_len}")

    cfg = GPTConfig(vocab_size=256, seq_len=s.seq_len, d_model=s.d_model, num_heads=s.num_heads,
                    num_layers=s.num_layers)
    with torch.device("meta"):
        model = GPT(cfg)
    element_bytes = 4 if s.dtype == "fp32" else 2
    placement = place(shape_from_module(model, "GPT"), s.dtype, "nvme", "nvme")
    model_bytes = cfg.num_params * element_bytes
    # Default: the smallest budget the engine accepts plus two blocks, so that prefetch has
    # room for the next units; still well below the model's compute copy.
    block_bytes = (cfg.num_params - 256 * s.d_model - s.seq_len * s.d_model - 2 * s.d_model) // s.num_layers * 4
    budget = s.device_budget if s.device_budget is not None else placement.device_bytes + 2 * block_bytes
    temporary = s.swap_dir is None
    swap_dir: Optional[str] = None
    demo_lock: Optional[int] = None
    if not temporary:
        swap_dir = os.path.abspath(s.swap_dir)
        os.makedirs(swap_dir, exist_ok=True)
    engine = None
    interrupted = False
    losses: List[float] = []
    try:
        if temporary:
            swap_dir, demo_lock = make_temporary_swap_dir(out)
        print(f"offload demo: training a byte-level GPT on Python's own standard library source\n"
              f"  model   {cfg.num_params / 1e6:.2f} M parameters (d_model {s.d_model}, {s.num_layers} layers, "
              f"{s.num_heads} heads, seq_len {s.seq_len}), {s.dtype} compute, AdamW lr {s.lr:g}\n"
              f"  data    {len(text) / MiB:.1f} MiB from {num_files} .py files under {source_dir}\n"
              f"  budget  device {_fmt(budget)} for a model whose compute copy is {_fmt(model_bytes)} "
              f"(units stream in and out)\n"
              f"  tiers   params + fp32 master + Adam moments -> nvme swap files, gradients -> host\n"
              f"  swap    {swap_dir}{' (temporary)' if temporary else ''}\n"
              f"  run     {s.steps} steps of {s.batch_size} x {s.seq_len} tokens", file=out, flush=True)

        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.1)
        config = offload.OffloadConfig(device="cpu" if not torch.cuda.is_available() else "auto",
                                       device_budget=budget, param_tier="nvme", optimizer_tier="nvme",
                                       swap_dir=swap_dir, dtype=s.dtype, max_grad_norm=1.0)
        engine = offload.wrap(model, optimizer, config, init_fn=_init_weights)
        # what wrap made: the states, and their second copies where units are updated during
        # backward ([Note: speculative updates]), which the plan of the tiers does not count
        print(f"  swap    {_fmt(engine.stats()['nvme_bytes'])} in swap files "
              f"({_fmt(placement.nvme_bytes)} of states, the rest second copies for the updates "
              "during backward)", file=out, flush=True)
        warmup = max(1, s.steps // 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda i: min(
            1.0, (i + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, s.steps) / s.steps))))
        generator = torch.Generator().manual_seed(s.seed)
        progress = Progress(s.steps, out)
        tokens_per_step = s.batch_size * s.seq_len
        rate = None
        started = time.perf_counter()
        with _StopRequest() as stop:
            for step in range(1, s.steps + 1):
                t0 = time.perf_counter()
                starts = torch.randint(0, len(train) - s.seq_len - 1, (s.batch_size,), generator=generator)
                x = torch.stack([train[i:i + s.seq_len] for i in starts.tolist()]).to(engine.device)
                y = torch.stack([train[i + 1:i + 1 + s.seq_len] for i in starts.tolist()]).to(engine.device)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                schedule.step()
                losses.append(float(loss.detach()))
                seconds = time.perf_counter() - t0
                current = tokens_per_step / seconds
                rate = current if rate is None else 0.8 * rate + 0.2 * current
                progress.update(step, losses[-1], rate, (s.steps - step) * tokens_per_step / rate)
                if stop.requested:
                    interrupted = True
                    break
        elapsed = time.perf_counter() - started
        if interrupted:
            progress.close()
        stats = engine.stats()
        k = max(1, min(10, len(losses) // 5))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"\nloss: {first:.3f} -> {last:.3f} (mean of the first {k} vs the last {k} steps; "
              f"uniform guess is {math.log(256):.3f})", file=out)
        print(f"trained {len(losses)} steps in {elapsed:.1f} s "
              f"({len(losses) * tokens_per_step / elapsed:,.0f} tokens/s)", file=out)
        _print_stats(stats, out)
        if s.trace:
            engine.export_trace(s.trace)
            print(f"timeline trace written to {s.trace} (open it in Perfetto or chrome://tracing)", file=out)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if engine is not None:
            engine.close()
        if demo_lock is not None:
            shutil.rmtree(swap_dir, ignore_errors=True)
            os.close(demo_lock)
    if temporary:
        left = [swap_dir] if os.path.exists(swap_dir) else []
    else:
        left = [n for n in os.listdir(swap_dir) if n.startswith(("offload-run-", ".offload"))]
    removed = f"swap files NOT all removed: {left}" if left else "swap files removed"
    if interrupted:
        print(f"interrupted after {len(losses)} of {s.steps} steps: stopped cleanly, {removed} ({swap_dir})",
              file=out, flush=True)
        return 130
    print(f"{removed} ({swap_dir})", file=out, flush=True)
    return 0


def _print_stats(stats: dict, out: TextIO) -> None:
    rows = [
        ("peak bytes", [("device", _fmt(stats["device_peak_bytes"]) + f" of {_fmt(stats['device_budget_bytes'])} budget"),
                        ("host", _fmt(stats["host_peak_bytes"])),
                        ("nvme", _fmt(stats["nvme_bytes"]))]),
        ("bytes moved", [("nvme -> device", _fmt(stats["bytes_nvme_to_device"])),
                         ("host -> device", _fmt(stats["bytes_host_to_device"])),
                         ("device -> host", _fmt(stats["bytes_device_to_host"])),
                         ("nvme read (all)", _fmt(stats["bytes_read_nvme"])),
                         ("nvme written (all)", _fmt(stats["bytes_written_nvme"]))]),
        ("time", [("waiting on I/O", f"{stats['io_wait_seconds']:.2f} s"),
                  ("waiting for units", f"{stats['fetch_wait_seconds']:.2f} s"),
                  ("waiting for Adam", f"{stats['optimizer_wait_seconds']:.2f} s"),
                  ("optimizer (total)", f"{stats['total_optimizer_seconds'] + stats['worker_update_seconds']:.2f} s "
                   f"({stats['worker_update_seconds']:.2f} s of it beside forward and backward)"),
                  ("last step", f"{stats['step_seconds']:.3f} s")]),
        ("prefetch", [("hits", str(stats["prefetch_hits"])),
                      ("misses", str(stats["prefetch_misses"]))]),
    ]
    print("tier statistics:", file=out)
    for title, items in rows:
        print(f"  {title}", file=out)
        for name, value in items:
            print(f"    {name:<20} {value}", file=out)
