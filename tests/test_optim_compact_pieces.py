"""[Note: compact pieces] The staged compact step runs over pieces of a unit's compact
states (whole blocks, page-aligned parts of a paged home, the compute copy's pages with a
carry between pieces): the same bits as the whole-unit step, and less host staging."""

import pytest
import torch

import offload
from offload.memory.compact_codec import (BLOCK_NUMEL, SCALE_PAGE_NUMEL, compact_home_layout, compact_piece_bytes,
                                          compact_piece_numel, compact_pieces)

# Odd sizes: the block units' pieces start off the compute copy's pages (the carry runs),
# and the root's embedding (275,000 elements) is cut by a piece
PIECES_GPT = dict(vocab_size=1100, seq_len=16, d_model=250, num_heads=2, num_layers=2)
COMPACT = dict(device="cpu", dtype="bf16", param_tier="host", optimizer_tier="host", optimizer_states="compact")


def _run(extra, swap_dir, num_batches=4, inspect=None):
    """The odd-sized GPT trained with compact states under ``extra``: (losses, every trainable
    parameter's decoded master, moments and high part, what ``inspect(engine)`` gave)."""
    from offload.gpt import GPT, GPTConfig
    from tests.support import batches, make_opt, train_offload
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PIECES_GPT))
    config = offload.OffloadConfig(**{**COMPACT, "swap_dir": str(swap_dir), **extra})
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        losses = train_offload(engine, batches(num_batches))
        engine.state_dict()  # settles the last step's deferred updates
        states = {}
        for u in engine.units:
            compact = engine.debug.homes.read_compact(u)
            for k in range(len(u.trainable)):
                states[(u.index, k)] = compact.exact(k) + (compact.param(k).high.clone(),)
        seen = inspect(engine) if inspect is not None else None
    assert not swap_dir.exists() or not any(swap_dir.rglob("*.swap"))
    return losses, states, seen


def test_pieces_cover_each_parameter_in_whole_blocks_and_the_prefix_in_order():
    numels, offsets = [250, 187500, 62500, 250000, 7], [0, 250, 187750, 250250, 500250]
    pieces = compact_pieces(numels, offsets, 4096)
    size = compact_piece_numel(4096)
    assert size == SCALE_PAGE_NUMEL and len(pieces) == 2
    assert [(p.lo, p.hi) for p in pieces] == [(0, size), (size, sum(-(-n // BLOCK_NUMEL) * BLOCK_NUMEL for n in numels))]
    assert pieces[0].compute_lo == 0 and pieces[-1].compute_hi == 500257
    assert all(a.compute_hi == b.compute_lo for a, b in zip(pieces, pieces[1:]))
    covered = {k: [] for k in range(len(numels))}
    for p in pieces:
        for k, a, b, at in p.params:
            assert a % BLOCK_NUMEL == 0 and at % BLOCK_NUMEL == 0 and 0 <= at < p.hi - p.lo
            covered[k].append((a, b))
    assert all(sum(b - a for a, b in covered[k]) == n for k, n in enumerate(numels))
    # a one-piece unit keeps the packed home; a larger one puts each array on pages
    assert not compact_home_layout(SCALE_PAGE_NUMEL).paged and compact_home_layout(2 * SCALE_PAGE_NUMEL).paged
    assert compact_home_layout(SCALE_PAGE_NUMEL + BLOCK_NUMEL).low % 4096 == 0


@pytest.mark.parametrize("numerics", [{}, {"max_grad_norm": 0.5, "gradient_accumulation_steps": 2}],
                         ids=["early-updates", "clipped-accumulated"])
def test_compact_pieces_on_nvme_train_the_same_bits_as_whole_units_on_the_host(numerics, tmp_path, monkeypatch):
    """Units of two and three pieces (piece boundaries inside parameters, off the compute
    copy's pages): compact homes and compute copies on NVMe, or compact homes on NVMe beside
    the CPU device's compute copies (through early and speculative updates, the step's own
    ring, and updates through the resident device copy) give the
    all-host run's losses, masters, moments and high parts bit for bit; the all-host run
    steps each unit whole (UnitAdam.update_in_place)."""
    monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", 4096)

    def pieces(engine):
        return [len(compact_pieces([e.numel for e in u.trainable], [e.offset for e in u.trainable], 4096))
                for u in engine.units]
    host = _run(numerics, tmp_path / "host")
    for name, tiers in {"states-nvme": {"optimizer_tier": "nvme"},
                        "both-nvme": {"param_tier": "nvme", "optimizer_tier": "nvme"},
                        "compute-nvme": {"param_tier": "nvme"},
                        "compute-on-the-cpu-device": {"param_tier": "device", "optimizer_tier": "nvme"}}.items():
        losses, states, num_pieces = _run({**numerics, **tiers}, tmp_path / name, inspect=pieces)
        assert num_pieces == [2, 3, 3], name
        assert losses == host[0], name
        for key, got in states.items():
            assert all(torch.equal(a, b) for a, b in zip(got, host[1][key])), (name, key)


def test_the_compact_step_stages_pieces_not_whole_units(tmp_path, monkeypatch):
    """The host peak (bytes the host tier accounts) of a compact run with both tiers on NVMe
    is below the same run's with whole-unit staging (pieces larger than every unit) by the
    staging slots' difference exactly: a slot holds one piece of a compact home and its
    compute window (a piece and a page of high parts), not the largest unit's home and
    prefix. Same bits either way."""
    from offload.memory.budget import UnitSizes, compact_home_bytes, slot_shape

    def peak(engine):
        sizes = [UnitSizes.of(u) for u in engine.units]
        return engine.stats()["host_peak_bytes"], slot_shape(sizes, engine.layout), sizes, \
            engine.layout.optimizer_pipeline_depth
    tiers = {"param_tier": "nvme", "optimizer_tier": "nvme", "max_grad_norm": 0.5}
    monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", 1 << 24)
    whole = _run(tiers, tmp_path / "whole", num_batches=2, inspect=peak)
    monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", 4096)
    pieces = _run(tiers, tmp_path / "pieces", num_batches=2, inspect=peak)
    assert pieces[0] == whole[0]
    assert all(torch.equal(a, b) for key in whole[1] for a, b in zip(pieces[1][key], whole[1][key]))
    (whole_peak, whole_shape, sizes, depth), (piece_peak, piece_shape, _, _) = whole[2], pieces[2]
    whole_compact, whole_compute = whole_shape.compact_bytes, whole_shape.compute_numel
    piece_compact, piece_compute = piece_shape.compact_bytes, piece_shape.compute_numel
    largest = max(sizes, key=lambda u: u.compact_numel)
    assert whole_compact == compact_home_bytes(largest, "nvme") and whole_compute == max(u.low_numel for u in sizes)
    size = compact_piece_numel(4096)
    assert piece_compact == compact_piece_bytes(size) < whole_compact
    assert piece_compute == size + 2048 < whole_compute
    slot_saving = (whole_compact - piece_compact) + 2 * (whole_compute - piece_compute)
    assert whole_peak - piece_peak == depth * slot_saving > 0


@pytest.mark.parametrize("tiers", [("host", "nvme"), ("nvme", "nvme")])
def test_compact_pieces_move_each_home_byte_once_as_the_plan_says(tiers, tmp_path, monkeypatch):
    """A step over pieces writes to NVMe what `offload plan` says (each page of a compact
    home and of a compute copy's trainable prefix once), and with the compute copies on the
    host reads exactly that too: a piece's parts of the paged arrays tile each home."""
    from offload.gpt import GPT, GPTConfig
    from offload.plan import place, shape_from_module
    from tests.support import batches, make_opt
    monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", 4096)
    cfg = GPTConfig(**PIECES_GPT)
    with torch.device("meta"):
        plan = place(shape_from_module(GPT(cfg), "gpt"), "bf16", *tiers, optimizer_states="compact")
    torch.manual_seed(0)
    model = GPT(cfg)
    config = dict(COMPACT, param_tier=tiers[0], optimizer_tier=tiers[1], swap_dir=str(tmp_path / "swap"),
                  overlap_step_with_forward=False, prefetch=False, speculative_updates=False, max_grad_norm=1.0)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        assert engine.stats()["nvme_bytes"] == plan.nvme_bytes
        for b in batches(2):
            before = engine.stats()
            engine.backward(engine(b[:, :-1], b[:, 1:]))
            engine.step()
            after = engine.stats()
            assert after["bytes_written_nvme"] - before["bytes_written_nvme"] == plan.traffic["nvme_write"]
            read = after["bytes_read_nvme"] - before["bytes_read_nvme"]
            assert read == plan.traffic["nvme_read"] if tiers[0] == "host" else read <= plan.traffic["nvme_read"]
