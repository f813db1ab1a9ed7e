"""What cutting compact states into pieces costs: the staged optimizer step, a checkpoint
save and a checkpoint load over pieces, each against the same work over whole units in the
same run ([Note: compact pieces], [Note: bounded checkpoint memory]).

One GPT with bf16 compute and compact optimizer states, compute copies and compact homes on
NVMe (--swap-dir, a temporary directory under it, removed at the end), on the CPU device:
  * step rows: one engine per piece size (units.OPTIMIZER_PIECE_NUMEL at wrap); "whole
    units" (the baseline) takes pieces larger than every unit, so each unit's compact home
    and the high parts are one piece. Clipping on, speculative updates and the overlap with
    the next forward off, so that every update runs inside engine.step(), which is what is
    timed (forward and backward are not).
  * save and load rows: the default piece engine's checkpoint with
    checkpoint.access.CHUNK_NUMEL past every parameter ("whole", the baseline: one piece a
    parameter, one window a compact home) and at the piece sizes.
Every round times each row once, rows interleaved, each round starting at the next row (load
from other processes spreads over all rows); the median of --rounds after one warm-up.
"pieces": pieces a step moves (summed over units), or pieces a checkpoint writes (a
parameter's piece with its six sections) / windows a load writes; "x base" the row's time
over its baseline's; "ms/extra piece" the time over the baseline divided by the pieces over
the baseline's: the cost of one more piece.

    python tools/bench_compact_pieces.py --swap-dir /mnt/nvme/tmp            # d_model 1024, 8 layers
    python tools/bench_compact_pieces.py --swap-dir /tmp --quick             # d_model 384, 4 layers
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import offload  # noqa: E402
import offload.checkpoint.access as checkpoint_access  # noqa: E402
import offload.units as units  # noqa: E402
from bench_adam import cpu_model  # noqa: E402
from offload.gpt import GPT, GPTConfig  # noqa: E402
from offload.memory.compact_codec import SCALE_PAGE_NUMEL, compact_home_layout, compact_padded_numel, \
    compact_piece_numel, compact_pieces  # noqa: E402

WHOLE = 1 << 40  # elements: past every unit
FULL = GPTConfig(vocab_size=32000, seq_len=128, d_model=1024, num_heads=16, num_layers=8)
QUICK = GPTConfig(vocab_size=4096, seq_len=64, d_model=384, num_heads=6, num_layers=4)
PIECES = [1 << 20, SCALE_PAGE_NUMEL]  # the default piece, and the smallest a paged home takes


def step_pieces(engine, piece_numel: int) -> int:
    """The pieces one step of ``engine`` moves: each trainable unit's compact_pieces."""
    return sum(len(compact_pieces([e.numel for e in u.trainable], [e.offset for e in u.trainable], piece_numel))
               for u in engine.units if u.trainable)


def checkpoint_pieces(engine, chunk: int) -> "tuple[int, int]":
    """(pieces a save writes, windows a load writes) at checkpoint.access.CHUNK_NUMEL ``chunk``."""
    saved = sum(-(-e.numel // chunk) for u in engine.units for e in u.trainable)
    windows = 0
    for u in engine.units:
        if u.trainable:
            layout = compact_home_layout(compact_padded_numel([e.numel for e in u.trainable]))
            windows += -(-layout.numel // compact_piece_numel(chunk)) if layout.paged else 1
    return saved, windows


def build(cfg: GPTConfig, swap_dir: str, piece_numel: int):
    """A wrapped GPT whose staged step moves pieces of ``piece_numel`` (read at wrap)."""
    saved = units.OPTIMIZER_PIECE_NUMEL
    units.OPTIMIZER_PIECE_NUMEL = piece_numel
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
        config = dict(device="cpu", dtype="bf16", optimizer_states="compact", param_tier="nvme",
                      optimizer_tier="nvme", swap_dir=swap_dir, max_grad_norm=1.0, speculative_updates=False,
                      overlap_step_with_forward=False)
        return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    finally:
        units.OPTIMIZER_PIECE_NUMEL = saved


def timed_step(engine, batch: torch.Tensor) -> float:
    """Forward and backward (not timed), then engine.step() (timed): every update runs in it."""
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def timed_checkpoint(engine, verb: str, path: str, chunk: int) -> float:
    saved = checkpoint_access.CHUNK_NUMEL
    checkpoint_access.CHUNK_NUMEL = chunk
    try:
        start = time.perf_counter()
        getattr(engine, f"{verb}_checkpoint")(path)
        return time.perf_counter() - start
    finally:
        checkpoint_access.CHUNK_NUMEL = saved


def measure(cfg: GPTConfig, swap_dir: str, rounds: int, batch_size: int) -> list:
    """[(section, row, pieces, median seconds)], each section's baseline first."""
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    engines = {}
    try:
        for name, piece in [("whole units", WHOLE)] + [(f"pieces of {p >> 10} Ki", p) for p in PIECES]:
            engines[name] = (build(cfg, os.path.join(swap_dir, f"swap-{piece}"), piece), piece)
        ckpt_engine = engines[f"pieces of {PIECES[0] >> 10} Ki"][0]
        ckpt = os.path.join(swap_dir, "ckpt")
        checkpoint_rows = [("whole", WHOLE)] + [(f"pieces of {p >> 10} Ki", p) for p in PIECES]
        times: dict = {}
        for round_ in range(rounds + 1):  # round 0: the warm-up
            # each round starts at another row, so that no row always follows the same one
            step_order = list(engines.items())
            step_order = step_order[round_ % len(step_order):] + step_order[:round_ % len(step_order)]
            for name, (engine, piece) in step_order:
                seconds = timed_step(engine, batch)
                if round_:
                    times.setdefault(("step", name), []).append(seconds)
            first = round_ % len(checkpoint_rows)
            ckpt_order = checkpoint_rows[first:] + checkpoint_rows[:first]
            for name, chunk in ckpt_order:
                for verb in ("save", "load"):
                    seconds = timed_checkpoint(ckpt_engine, verb, ckpt, chunk)
                    if round_:
                        times.setdefault((verb, name), []).append(seconds)
        rows = [("step", name, step_pieces(engine, piece), statistics.median(times["step", name]))
                for name, (engine, piece) in engines.items()]
        for verb in ("save", "load"):
            for name, chunk in checkpoint_rows:
                counted = checkpoint_pieces(ckpt_engine, chunk)[0 if verb == "save" else 1]
                rows.append((verb, name, counted, statistics.median(times[verb, name])))
        return rows
    finally:
        for engine, _ in engines.values():
            engine.close()


def table(rows: list) -> str:
    lines = [f"{'row':<28} {'pieces':>7} {'seconds':>9} {'x base':>7} {'ms/extra piece':>15}"]
    base = {}
    for section, name, pieces, seconds in rows:
        base.setdefault(section, (pieces, seconds))
        base_pieces, base_seconds = base[section]
        extra = f"{1e3 * (seconds - base_seconds) / (pieces - base_pieces):.2f}" if pieces > base_pieces else "-"
        lines.append(f"{section + ', ' + name:<28} {pieces:>7} {seconds:>9.4f} {seconds / base_seconds:>7.2f} "
                     f"{extra:>15}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--swap-dir", required=True, help="a directory on the disk to measure (a temporary "
                        "directory is made under it and removed)")
    parser.add_argument("--quick", action="store_true", help="the small GPT (d_model 384, 4 layers)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, --quick 3)")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    rounds = args.rounds or (3 if args.quick else 5)
    work = tempfile.mkdtemp(prefix="bench-compact-pieces-", dir=args.swap_dir)
    try:
        rows = measure(cfg, work, rounds, args.batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"{num_params / 1e6:.1f}M params (d_model {cfg.d_model}, {cfg.num_layers} layers), bf16, compact states "
          f"and compute copies on NVMe ({args.swap_dir}), {cpu_model()}, {torch.get_num_threads()} torch threads; "
          f"median of {rounds} rounds")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
