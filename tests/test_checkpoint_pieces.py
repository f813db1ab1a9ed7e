"""[Note: bounded checkpoint memory] Save and load move a unit's state in pieces of at most
CHUNK_NUMEL elements (issue 17: the 3B model's embedding unit holds 4.7 GB of fp32 master
and moments, more than the host budget of a run that size). Here the pieces are made small
(offload.checkpoint.access.CHUNK_NUMEL patched) so that the units of small models are cut:
1000 elements cut every home off its pages (the edge pages are read, patched and written
again), 2048 cut them at whole pages of any dtype. A run resumes bit for bit; a load in
pieces writes every home byte for byte as a whole-unit load does, padding included; and the
memory a save or load takes beyond training is a few pieces, not a unit (subprocess RSS).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import offload
import offload.checkpoint.access

from support import train_offload

CHUNKS = [1000, 2048]


class Model(nn.Module):
    """A frozen parameter (a frozen tail in the first unit), trainable blocks of 2352
    elements and a buffer: every state of every unit is cut into several pieces."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(64, 48), requires_grad=False)
        self.blocks = nn.ModuleList([nn.Linear(48, 48) for _ in range(3)])
        self.register_buffer("running_mean", torch.zeros(48))

    def forward(self, x):
        x = x.to(self.frozen.dtype) @ self.frozen
        for blk in self.blocks:
            x = torch.tanh(blk(x))
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(x.float().mean(0), alpha=0.1)
        return (x.float() - self.running_mean).square().mean()


CASES = {
    "fp32-nvme": dict(param_tier="nvme", optimizer_tier="nvme"),
    "bf16-nvme": dict(dtype="bf16", param_tier="nvme", optimizer_tier="nvme"),  # split master
    "bf16-host": dict(dtype="bf16", param_tier="host", optimizer_tier="host"),
    "fp16-nvme-host": dict(dtype="fp16", param_tier="nvme", optimizer_tier="host"),
    "fp32-device-nvme": dict(param_tier="device", optimizer_tier="nvme"),
    # spare homes ([Note: speculative updates]): a load writes the frozen tail of the spare
    # compute copy too
    "fp32-nvme-spares": dict(param_tier="nvme", optimizer_tier="nvme", max_grad_norm=1e9, speculative_updates=True),
}


def make_engine(case, swap_dir, seed=0):
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return offload.wrap(model, opt, config=dict(CASES[case], swap_dir=str(swap_dir)))


def loss(engine, i):
    return engine(torch.randn(4, 64, generator=torch.Generator().manual_seed(i)))


def run(engine, start, steps):
    return train_offload(engine, range(start, start + steps), loss)


def pieces_of(ckpt):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return {r["fqn"]: len(r["pieces"]) for u in manifest["units"] for r in u["entries"]}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("case", CASES)
def test_a_run_saved_and_loaded_in_pieces_resumes_bit_for_bit(case, chunk, tmp_path, monkeypatch):
    with make_engine(case, tmp_path / "ref") as ref:
        ref_losses = run(ref, 0, 6)
        ref_state = ref.state_dict()
    monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", chunk)
    with make_engine(case, tmp_path / "first") as first:
        run(first, 0, 3)
        first.save_checkpoint(str(tmp_path / "ckpt"))
    pieces = pieces_of(tmp_path / "ckpt")
    assert pieces["frozen"] >= 2 and pieces["blocks.0.weight"] >= 2, pieces  # the units were cut
    with make_engine(case, tmp_path / "resumed", seed=1) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert run(resumed, 3, 3) == ref_losses[3:]
        assert_same_state(resumed.state_dict(), ref_state)


def home_bytes(engine):
    """Every byte of every home of every unit (padding included), by unit and home."""
    homes = engine.debug.homes
    out = {}
    for u in engine.units:
        named = {"compute": u.compute_home, "master": u.master_home, "moments": u.moments_home}
        if u.spare is not None:
            named.update(spare_compute=u.spare.compute_home, spare_master=u.spare.master_home,
                         spare_moments=u.spare.moments_home)
        for name, home in named.items():
            if home is None:
                continue
            if isinstance(home, torch.Tensor):
                out[u.name, name] = home.clone().view(torch.uint8)
            else:
                out[u.name, name] = homes.load(home, home.nbytes, torch.uint8)
    return out


@pytest.mark.parametrize("case", ["fp32-nvme", "bf16-nvme", "bf16-host", "fp32-nvme-spares"])
def test_a_load_in_pieces_writes_every_home_as_a_whole_unit_load_does(case, tmp_path, monkeypatch):
    """The same state saved whole and in pieces of 1000; loaded whole and in pieces into
    engines of other initial weights: the homes hold the same bytes, padding included."""
    with make_engine(case, tmp_path / "saver") as saver:
        run(saver, 0, 3)
        saver.save_checkpoint(str(tmp_path / "whole"))
        monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", 1000)
        saver.save_checkpoint(str(tmp_path / "pieces"))
        monkeypatch.undo()
    assert max(pieces_of(tmp_path / "whole").values()) == 1 < max(pieces_of(tmp_path / "pieces").values())
    with make_engine(case, tmp_path / "a", seed=1) as a:
        a.load_checkpoint(str(tmp_path / "whole"))
        whole = home_bytes(a)
    monkeypatch.setattr(offload.checkpoint.access, "CHUNK_NUMEL", 1000)
    with make_engine(case, tmp_path / "b", seed=2) as b:
        b.load_checkpoint(str(tmp_path / "pieces"))
        cut = home_bytes(b)
    assert whole.keys() == cut.keys()
    for key in whole:
        assert torch.equal(whole[key], cut[key]), key


RSS_SCRIPT = """
import json, re, sys
import torch
from torch import nn
import offload
torch.set_num_threads(1)
class Big(nn.Module):  # one unit of 32 M parameters (128 MB fp32; master and moments 403 MB)
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(32 << 20))
    def forward(self, x):
        return (self.table[:x.numel()] * x.reshape(-1)).square().sum()
def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
def now():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
with torch.device("meta"):
    model = Big()
config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=sys.argv[1], device_budget=300 << 20)
growth = {}
with offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config,
                  init_fn=lambda m: nn.init.normal_(m.table) if isinstance(m, Big) else None) as engine:
    for i in range(2):
        engine.backward(engine(torch.randn(1024)))
        engine.step()
    engine.zero_grad()
    for verb in ("save", "load"):
        open("/proc/self/clear_refs", "w").write("5")
        start = now()
        getattr(engine, verb + "_checkpoint")(sys.argv[2])
        growth[verb] = peak() - start
print(json.dumps(dict(growth=growth, unit_state=3 * 4 * (32 << 20))))
"""


def test_a_save_and_a_load_hold_a_few_pieces_not_a_unit(tmp_path):
    # Measured (RSS peak over the call, from the RSS before it): 100.5-100.7 MB for each,
    # three fp32 pieces (a save: master, exp_avg, exp_avg_sq; a load: the compute piece it
    # builds, the master piece it reads, a moment). Before pieces: 671 MB to save, 805 MB
    # to load, 1.7x and 2.0x the unit's master and moments.
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "swap"), str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    four_pieces = 4 * 4 * offload.checkpoint.access.CHUNK_NUMEL
    assert four_pieces <= result["unit_state"] / 3
    for verb, growth in result["growth"].items():
        assert growth <= four_pieces, (verb, result)


@pytest.mark.parametrize("direct", ["honored", "refused at open", "refused at write"])
def test_unit_files_go_through_o_direct_or_the_page_cache_and_load_the_same(direct, tmp_path, monkeypatch):
    """Unit files are written a staging buffer at a time with O_DIRECT (here 8 KiB, so that
    the small units' files take several), their tail through the page cache; where
    O_DIRECT is refused, at open or at the first write, everything goes through the page
    cache. Either way the checkpoint loads into a fresh engine as the saver's state, and
    its run goes on bit for bit."""
    import errno
    import fcntl

    import offload.checkpoint.save as save

    monkeypatch.setattr(save._DirectWriter, "STAGE_BYTES", 8192)
    real_open, real_pwrite = os.open, os.pwrite
    direct_writes = []

    def fake_open(path, flags, *args, **kwargs):
        if direct == "refused at open" and flags & os.O_DIRECT and os.path.basename(path).startswith("unit-"):
            raise OSError(errno.EINVAL, "O_DIRECT refused (test)", path)
        return real_open(path, flags, *args, **kwargs)

    def fake_pwrite(fd, data, offset):
        ours = os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("unit-")  # not swap I/O
        if ours and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if direct == "refused at write":
                raise OSError(errno.EINVAL, "O_DIRECT refused (test)")
            direct_writes.append(len(data))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", fake_open)  # the swap's own opens and writes pass through
    monkeypatch.setattr(os, "pwrite", fake_pwrite)
    with make_engine("bf16-nvme", tmp_path / "ref") as ref:
        ref_losses = run(ref, 0, 6)
        ref_state = ref.state_dict()
    with make_engine("bf16-nvme", tmp_path / "first") as first:
        run(first, 0, 3)
        first.save_checkpoint(str(tmp_path / "ckpt"))
        saved = first.state_dict()
    monkeypatch.undo()
    assert (len(direct_writes) > 0) == (direct == "honored")
    assert all(n == 8192 for n in direct_writes)
    with make_engine("bf16-nvme", tmp_path / "resumed", seed=1) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert_same_state(resumed.state_dict(), saved)
        assert run(resumed, 3, 3) == ref_losses[3:]
        assert_same_state(resumed.state_dict(), ref_state)


def test_a_unit_file_write_that_fails_on_the_writer_thread_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    """Unit files' stages are hashed and written on threads of their own while the next
    stage fills; a write failing there (ENOSPC at the third O_DIRECT stage, 8 KiB stages)
    fails save_checkpoint with that errno and the file's name, removes the partial
    directory, keeps the checkpoint the name held, and the next save works."""
    import errno

    import offload.checkpoint.save as save

    monkeypatch.setattr(save._DirectWriter, "STAGE_BYTES", 8192)
    real_pwrite = os.pwrite
    writes = []

    def failing_pwrite(fd, data, offset):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("unit-"):
            writes.append(offset)
            if len(writes) == 3:
                raise OSError(errno.ENOSPC, "No space left on device (test)")
        return real_pwrite(fd, data, offset)

    with make_engine("bf16-nvme", tmp_path / "swap") as engine:
        run(engine, 0, 2)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        kept = offload.checkpoint.read_manifest(str(tmp_path / "ckpt"))["checksum"]
        run(engine, 2, 1)
        monkeypatch.setattr(os, "pwrite", failing_pwrite)
        with pytest.raises(OSError, match=r"unit-\d+\.bin") as caught:
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        monkeypatch.undo()
        assert caught.value.errno == errno.ENOSPC
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "swap"]  # no partial directory
        assert offload.checkpoint.read_manifest(str(tmp_path / "ckpt"))["checksum"] == kept
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.state_dict()
    with make_engine("bf16-nvme", tmp_path / "resumed", seed=1) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert_same_state(resumed.state_dict(), saved)
