"""[Note: bounded checkpoint memory] with compact optimizer states ([Note: compact optimizer
states]): a save reads each parameter's piece of the high parts and of the compact home's
arrays, a load writes the compute copy in pieces and the compact home in windows of whole
pages, so neither holds a unit's compact home and compute copy at once. The buffers they
move through are counted (stats()["checkpoint_buffer_peak_bytes"]); the RSS of a process
shows the same. A checkpoint cut in pieces resumes bit for bit and a load in windows writes
every home byte for byte as a one-window load does."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import offload
import offload.checkpoint.access
from offload.memory.compact_codec import (compact_home_layout, compact_padded_numel, compact_piece_bytes,
                                          compact_piece_numel)
from offload.units import PAGE_BYTES

from support import train_offload

# elements: 391 blocks (a compact piece starts on a block), not a page of bf16 (the compute
# copy's pieces start off its pages); five pieces of a block's weight
CHUNK = 100_096


class Wide(nn.Module):
    """Blocks of 410,240 parameters (a paged compact home of 410,368 elements: two windows of
    262,144), a frozen bias in the first one (a frozen tail), and a small head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(640, 640) for _ in range(2)])
        self.blocks[0].bias.requires_grad_(False)
        self.head = nn.Linear(640, 3)

    def forward(self, x):
        x = x.to(torch.bfloat16)  # the compute dtype of every run here
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).float().square().mean()


TIERS = {"nvme": dict(param_tier="nvme", optimizer_tier="nvme"),
         "host": dict(param_tier="host", optimizer_tier="host"),
         "nvme-clipped": dict(param_tier="nvme", optimizer_tier="nvme", max_grad_norm=0.5)}


def make_engine(tiers, swap_dir, seed=0):
    torch.manual_seed(seed)
    model = Wide()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return offload.wrap(model, opt, config=dict(device="cpu", dtype="bf16", optimizer_states="compact",
                                                swap_dir=str(swap_dir), **TIERS[tiers]))


def loss(engine, i):
    return engine(torch.randn(4, 640, generator=torch.Generator().manual_seed(i)))


def run(engine, start, steps):
    return train_offload(engine, range(start, start + steps), loss)


def homes_bytes(engine):
    """Every byte of every unit's compute copy and compact home (padding included)."""
    homes, out = engine.debug.homes, {}
    for u in engine.units:
        for name, home in (("compute", u.compute_home), ("compact", u.compact_home)):
            if home is None:
                continue
            out[u.name, name] = home.clone().view(torch.uint8) if isinstance(home, torch.Tensor) else \
                homes.load(home, home.nbytes, torch.uint8)
    return out


def compact_states(engine):
    out = {}
    for u in engine.units:
        compact = engine.debug.homes.read_compact(u)
        for k in range(len(u.trainable)):
            out[u.index, k] = compact.exact(k) + (compact.param(k).high.clone(),)
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert all(torch.equal(p, q) for p, q in zip(x, y)) if isinstance(x, tuple) else torch.equal(x, y), key


@pytest.mark.parametrize("tiers", TIERS)
def test_a_compact_checkpoint_in_pieces_resumes_bit_for_bit_and_loads_every_home_byte_as_one_window(
        tiers, tmp_path, monkeypatch):
    with make_engine(tiers, tmp_path / "ref") as ref:
        ref_losses = run(ref, 0, 6)
        ref_state, ref_states = ref.state_dict(), compact_states(ref)
    monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", CHUNK)
    with make_engine(tiers, tmp_path / "first") as first:
        run(first, 0, 3)
        first.save_checkpoint(str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    pieces = {r["fqn"]: len(r["pieces"]) for u in manifest["units"] for r in u["entries"]}
    assert pieces["blocks.0.weight"] == 5 and pieces["blocks.0.bias"] == 1, pieces
    with make_engine(tiers, tmp_path / "resumed", seed=1) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        layout = compact_home_layout(compact_padded_numel([640 * 640, 640]))
        assert layout.paged and compact_piece_numel(CHUNK) < layout.numel  # the block units took two windows
        in_windows = homes_bytes(resumed)
        assert run(resumed, 3, 3) == ref_losses[3:]
        assert_same(resumed.state_dict(), ref_state)
        assert_same(compact_states(resumed), ref_states)
    monkeypatch.undo()  # CHUNK_NUMEL's 8 Mi elements: every home one window, the compute copy one piece
    with make_engine(tiers, tmp_path / "whole", seed=2) as whole:
        whole.load_checkpoint(str(tmp_path / "ckpt"))
        assert_same(homes_bytes(whole), in_windows)


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_compact_save_and_load_move_a_piece_at_a_time_not_a_unit(tiers, tmp_path, monkeypatch):
    """The buffers a save and a load hold at once (stats' checkpoint_buffer_peak_bytes): a
    save at most one piece of the high parts and of each array (host homes: none, it reads
    views of them), a load a piece of the compute copy, its bounce through the edge pages
    and one window of the compact home; a block unit's compact home and compute copy
    together are more than either."""
    monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", CHUNK)
    scales = 4 * (CHUNK // 256 + 2)
    piece = [2 * CHUNK, CHUNK, CHUNK, CHUNK, scales, scales]  # high, low, both codes, both scales
    save_bound = sum(n + 2 * PAGE_BYTES for n in piece)  # each read in whole pages
    load_bound = 2 * CHUNK + (2 * CHUNK + 2 * PAGE_BYTES) + compact_piece_bytes(compact_piece_numel(CHUNK))
    layout = compact_home_layout(compact_padded_numel([640 * 640, 640]))
    unit = layout.nbytes + 2 * (640 * 640 + 640)  # a block unit's compact home and compute copy
    assert max(save_bound, load_bound) < unit
    with make_engine(tiers, tmp_path / "swap") as engine:
        run(engine, 0, 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.stats()["checkpoint_buffer_peak_bytes"]
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = engine.stats()["checkpoint_buffer_peak_bytes"]
    assert (0 < saved <= save_bound) if tiers == "nvme" else saved == 0, (saved, save_bound)
    assert 0 < loaded <= load_bound, (loaded, load_bound)


RSS_SCRIPT = """
import json, re, sys
import torch
from torch import nn
import offload, offload.checkpoint.access
torch.set_num_threads(1)
offload.checkpoint.access.CHUNK_NUMEL = 1 << 20
class Big(nn.Module):  # one unit of 32 Mi parameters: a 96.5 MiB compact home, a 64 MiB compute copy
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(32 << 20))
    def forward(self, x):
        return (self.table[:x.numel()].float() * x.reshape(-1)).square().sum()
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
def now():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
with torch.device("meta"):
    model = Big()
config = dict(device="cpu", dtype="bf16", optimizer_states="compact", param_tier="nvme", optimizer_tier="nvme",
              swap_dir=sys.argv[1], device_budget=160 << 20)
growth = {}
with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config,
                  init_fn=lambda m: nn.init.normal_(m.table) if isinstance(m, Big) else None) as engine:
    for i in range(2):
        engine.backward(engine(torch.randn(1024)))
        engine.step()
    for verb in ("save", "load"):
        open("/proc/self/clear_refs", "w").write("5")
        start = now()
        getattr(engine, verb + "_checkpoint")(sys.argv[2])
        growth[verb] = peak() - start
print(json.dumps(dict(growth=growth, unit=engine.units[0].compact_home.nbytes + 2 * (32 << 20))))
"""


def test_a_compact_save_and_load_grow_the_process_by_a_few_pieces_not_a_unit(tmp_path):
    # Pieces of 1 Mi elements: a save's reads are about 5 MiB, a load's compute piece, bounce
    # and window about 7 MiB, beside the writer's stages and the load's hashing (test_checkpoint_
    # pieces' bound has them too); the unit's compact home and compute copy are 161 MiB.
    # Measured: 0.2 and 36 MB (one run); before pieces 169 MB each, the unit's bytes.
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "swap"), str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for verb, growth in result["growth"].items():
        assert growth <= result["unit"] / 2, (verb, result)


def test_a_partial_load_state_dict_reads_and_writes_compact_weights_a_piece_at_a_time(tmp_path, monkeypatch):
    """load_state_dict of one parameter of a block unit on NVMe: each piece of the unit's high
    and low parts is read to compare it with the new masters and once more for the masters it
    keeps (Homes.read_master_range over Homes.read_compact_range), never the unit's whole
    compact home or compute copy: at most twice the unit's high and low bytes, where reading
    the whole unit for the write and for each of the 6 pieces of its two parameters read 7
    times its compact home and compute copy. The buffers hold a piece at a time. The values
    are checked by test_optim_compact's test_weight_writes_encode_new_masters_and_keep_every_other_byte."""
    monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", CHUNK)
    with make_engine("nvme", tmp_path / "swap") as engine:
        run(engine, 0, 2)
        engine.state_dict()  # settles the last step
        u = next(u for u in engine.units if any(e.fqn == "blocks.1.weight" for e in u.trainable))
        high_and_low = 3 * u.spec.trainable_numel  # bf16 high, int8 low
        before = engine.stats()["bytes_read_nvme"]
        engine.load_state_dict({"blocks.1.bias": torch.ones(640)}, strict=False)
        read = engine.stats()["bytes_read_nvme"] - before
        held = engine.stats()["checkpoint_buffer_peak_bytes"]
        assert high_and_low <= read <= 2 * high_and_low + 64 * PAGE_BYTES, (read, high_and_low)
        # two fp32 master pieces (the new one, the one kept), two reads of high and low, a bounce
        assert held <= 2 * 4 * CHUNK + 2 * (3 * CHUNK + 4 * PAGE_BYTES) + 2 * CHUNK + 2 * PAGE_BYTES, held
        assert torch.equal(engine.state_dict()["blocks.1.bias"], torch.ones(640))
