"""Checkpoints (issue 7): save/load resume bit-identically for every tier combination,
corrupt or mismatched checkpoints are refused before anything changes, export gives a state
dict that plain PyTorch loads, saves are atomic."""
import errno
import json
import os
import shutil
import struct

import pytest
import torch
from torch import nn

import offload
import offload.faults
from offload.checkpoint import MANIFEST, export_checkpoint
from offload.checkpoint.format import manifest_checksum
from offload.errors import CheckpointError
from offload.gpt import GPT, GPTConfig

from support import train_offload

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=3)


def batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)


def make_engine(config, seed=0, model_fn=None):
    torch.manual_seed(seed)
    model = (model_fn or (lambda: GPT(CFG)))()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return offload.wrap(model, opt, config=config)


def gpt_loss(engine, i):
    b = batch(i)
    return engine(b[:, :-1], b[:, 1:])


def run(engine, start, micro_steps, loss_fn=gpt_loss):
    return train_offload(engine, range(start, start + micro_steps), loss_fn)


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def config_for(tmp_path, param_tier, optimizer_tier, **extra):
    swap = tmp_path / f"swap-{param_tier}-{optimizer_tier}"
    swap.mkdir(exist_ok=True)
    budget = None if param_tier == "device" else 100_000
    return dict(param_tier=param_tier, optimizer_tier=optimizer_tier, swap_dir=str(swap),
                device_budget=budget, **extra)


TIERS = [("device", "host"), ("device", "nvme"), ("host", "host"), ("host", "nvme"),
         ("nvme", "host"), ("nvme", "nvme")]


@pytest.mark.parametrize("param_tier,optimizer_tier,accumulation",
                         [t + (1,) for t in TIERS] + [("host", "host", 2), ("nvme", "nvme", 2)])
def test_resume_is_bit_identical(param_tier, optimizer_tier, accumulation, tmp_path):
    """N updates, save, a fresh engine (other initial weights) loads and runs M more: exactly
    the parameters and losses of N+M uninterrupted updates."""
    config = config_for(tmp_path, param_tier, optimizer_tier, gradient_accumulation_steps=accumulation,
                        max_grad_norm=0.5 if accumulation == 2 else None)
    n, m = 3 * accumulation, 3 * accumulation
    with make_engine(config) as ref:
        ref_losses = run(ref, 0, n + m)
        ref_state = ref.state_dict()
    with make_engine(config) as first:
        run(first, 0, n)
        first.save_checkpoint(str(tmp_path / "ckpt"))
    with make_engine(config, seed=1) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        losses = run(resumed, n, m)
        assert_same_state(resumed.state_dict(), ref_state)
    assert losses == ref_losses[n:]


def test_resume_bf16_nvme_is_bit_identical(tmp_path):
    """bf16: the compute copy is derived from the master on load and matches bit for bit."""
    config = config_for(tmp_path, "nvme", "nvme", dtype="bf16")
    with make_engine(config) as ref:
        ref_losses = run(ref, 0, 6)
        ref_state = ref.state_dict()
    with make_engine(config) as first:
        run(first, 0, 3)
        first.save_checkpoint(str(tmp_path / "ckpt"))
    with make_engine(config, seed=1) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert run(resumed, 3, 3) == ref_losses[3:]
        assert_same_state(resumed.state_dict(), ref_state)


class Frozen(nn.Module):
    """A frozen parameter, a buffer updated in forward and dropout (RNG) next to trainable
    blocks."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(8, 16), requires_grad=False)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.drop = nn.Dropout(0.3)
        self.register_buffer("running_mean", torch.zeros(16))

    def forward(self, x):
        x = x.to(self.frozen.dtype) @ self.frozen
        for blk in self.blocks:
            x = self.drop(torch.tanh(blk(x)))
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(x.float().mean(0), alpha=0.1)
        return (x.float() - self.running_mean).square().mean()


def frozen_loss(engine, i):
    return engine(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)))


@pytest.mark.parametrize("param_tier,optimizer_tier", [("host", "host"), ("nvme", "nvme"), ("device", "nvme")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_frozen_params_buffers_and_rng_are_restored(param_tier, optimizer_tier, dtype, tmp_path):
    config = config_for(tmp_path, param_tier, optimizer_tier, dtype=dtype)
    config["device_budget"] = None
    with make_engine(config, model_fn=Frozen) as ref:
        run(ref, 0, 3, frozen_loss)
        torch.manual_seed(123)
        ref_losses = run(ref, 3, 3, frozen_loss)
        ref_state = ref.state_dict()
    with make_engine(config, model_fn=Frozen) as first:
        run(first, 0, 3, frozen_loss)
        torch.manual_seed(123)
        first.save_checkpoint(str(tmp_path / "ckpt"))
    torch.manual_seed(999)  # the RNG state must come from the checkpoint
    with make_engine(config, seed=1, model_fn=Frozen) as resumed:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert run(resumed, 3, 3, frozen_loss) == ref_losses
        assert_same_state(resumed.state_dict(), ref_state)
    assert "running_mean" in ref_state and "frozen" in ref_state


def test_checkpoint_loads_into_other_tiers_and_restores_hyperparameters(tmp_path):
    with make_engine(config_for(tmp_path, "host", "host")) as a:
        run(a, 0, 3)
        a.optimizer.param_groups[0]["lr"] = 3e-3
        a.save_checkpoint(str(tmp_path / "ckpt"))
        state = a.state_dict()
    with make_engine(config_for(tmp_path, "nvme", "nvme"), seed=2) as b:
        b.load_checkpoint(str(tmp_path / "ckpt"))
        assert_same_state(b.state_dict(), state)
        assert b.optimizer.param_groups[0]["lr"] == 3e-3
        assert b.optimizer.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_loss_scale_belongs_to_the_dtype(dtype, tmp_path):
    """An fp16 checkpoint loaded into an engine of another dtype does not bring its loss
    scale along: the next step is the one from the same states saved with scale 1 (before,
    the gradients were multiplied by 2**15 and never unscaled), and the warning says what
    was reset. A checkpoint of another dtype loaded into an fp16 engine starts that
    engine's own initial scale."""
    fp16 = config_for(tmp_path, "host", "host", dtype="fp16", min_loss_scale=1.0)
    for scale in (2.0**15, 1.0):
        with make_engine({**fp16, "initial_loss_scale": scale}) as engine:  # the same states
            engine.save_checkpoint(str(tmp_path / f"fp16-{scale:g}"))
    after = {}
    for scale in (2.0**15, 1.0):
        with make_engine(config_for(tmp_path, "host", "host", dtype=dtype), seed=3) as engine:
            with pytest.warns(RuntimeWarning, match="dtype='fp16'.*the loss scale is reset to 1, where "
                              f"{dtype} runs start \\(the checkpoint's was {scale:g}\\)") as caught:
                engine.load_checkpoint(str(tmp_path / f"fp16-{scale:g}"))
            assert all(w.filename == __file__ for w in caught)
            assert engine.stats()["loss_scale"] == 1.0
            run(engine, 0, 1)
            after[scale] = engine.state_dict()
    assert_same_state(after[2.0**15], after[1.0])
    with make_engine(config_for(tmp_path, "host", "host", dtype=dtype)) as engine:
        engine.save_checkpoint(str(tmp_path / dtype))
    with make_engine({**fp16, "initial_loss_scale": 2.0**10}) as engine:
        with pytest.warns(RuntimeWarning, match=f"dtype='{dtype}'.*the loss scale is reset to 1024, where "
                          "fp16 runs start \\(the checkpoint's was 1\\)"):
            engine.load_checkpoint(str(tmp_path / dtype))
        assert engine.stats()["loss_scale"] == 2.0**10


def test_save_mid_accumulation_is_refused(tmp_path):
    with make_engine(dict(gradient_accumulation_steps=2)) as engine:
        run(engine, 0, 1)
        with pytest.raises(ValueError, match="accumulation boundary"):
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        assert not os.path.exists(tmp_path / "ckpt")
        assert os.listdir(tmp_path) == []
        run(engine, 1, 1)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.backward(gpt_loss(engine, 5))  # gradients without step(): refused as well
        with pytest.raises(ValueError, match="pending"):
            engine.save_checkpoint(str(tmp_path / "ckpt2"))


# ---------------------------------------------------------------------- corruption
def _flip_byte(path, position):
    with open(path, "r+b") as f:
        f.seek(position)
        b = f.read(1)
        f.seek(position)
        f.write(bytes([b[0] ^ 0x01]))


def _rewrite_manifest(ckpt, change):
    path = os.path.join(ckpt, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    manifest["checksum"] = manifest_checksum(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def _corrupt_flip(ckpt):
    _flip_byte(os.path.join(ckpt, "unit-00001.bin"), 100)
    return "unit-00001.bin.*sha256"


def _corrupt_truncate(ckpt):
    path = os.path.join(ckpt, "unit-00002.bin")
    os.truncate(path, os.path.getsize(path) - 4)
    return "unit-00002.bin.*bytes"


def _corrupt_missing(ckpt):
    os.unlink(os.path.join(ckpt, "unit-00000.bin"))
    return "unit-00000.bin.*missing"


def _corrupt_outside(ckpt):
    def change(m):
        m["files"]["../outside.bin"] = m["files"].pop("unit-00001.bin")
        for entry in m["units"][1]["entries"]:
            for piece in entry["pieces"]:
                piece["file"] = "../outside.bin"
    _rewrite_manifest(ckpt, change)
    return "outside.bin.*not a plain file name"


def _corrupt_manifest_byte(ckpt):
    path = os.path.join(ckpt, MANIFEST)
    text = open(path).read().replace('"micro_step": 3', '"micro_step": 4')
    assert '"micro_step": 4' in text
    open(path, "w").write(text)
    return "manifest.json does not match its checksum"


def _corrupt_entry_offset(ckpt):
    _rewrite_manifest(ckpt, lambda m: m["units"][1]["entries"][0]["pieces"][0].update(master=1 << 40))
    return "unit-00001.bin.*outside the file"


def _corrupt_piece_gap(ckpt):
    def change(m):
        pieces = m["units"][1]["entries"][0]["pieces"]
        whole = pieces[0]
        pieces[:] = [dict(whole, numel=10), dict(whole, start=11, numel=whole["numel"] - 11)]
    _rewrite_manifest(ckpt, change)
    return "pieces of parameter .* do not cover it exactly once"


def _corrupt_overlapping_sections(ckpt):
    """A manifest whose checksum is right again but whose exp_avg section reads the master's
    bytes (before, loaded as the moments)."""
    def change(m):
        piece = m["units"][1]["entries"][0]["pieces"][0]
        piece["exp_avg"] = piece["master"]
    _rewrite_manifest(ckpt, change)
    return "unit-00001.bin.*places .* (exp_avg and .* master|master and .* exp_avg) on the same bytes"


def _corrupt_overlapping_parameters(ckpt):
    def change(m):
        first, second = m["units"][1]["entries"][:2]
        second["pieces"][0]["master"] = first["pieces"][0]["master"] + 4  # inside the first one's master
    _rewrite_manifest(ckpt, change)
    return "unit-00001.bin.*on the same bytes"


def _corrupt_manifest_symlink(ckpt):
    """manifest.json replaced by a link to a copy elsewhere (before, followed and accepted)."""
    elsewhere = os.path.join(os.path.dirname(ckpt), "elsewhere.json")
    os.rename(os.path.join(ckpt, MANIFEST), elsewhere)
    os.symlink(elsewhere, os.path.join(ckpt, MANIFEST))
    return "manifest.json is a symbolic link"


@pytest.mark.parametrize("corrupt", [_corrupt_flip, _corrupt_truncate, _corrupt_missing, _corrupt_outside,
                                     _corrupt_manifest_byte, _corrupt_entry_offset, _corrupt_piece_gap,
                                     _corrupt_overlapping_sections, _corrupt_overlapping_parameters,
                                     _corrupt_manifest_symlink])
def test_corrupt_checkpoint_is_rejected_and_nothing_is_loaded(corrupt, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    config = config_for(tmp_path, "nvme", "nvme")
    with make_engine(config) as source:
        run(source, 0, 3)
        source.save_checkpoint(ckpt)
    pattern = corrupt(ckpt)
    with make_engine(config, seed=1) as engine:
        run(engine, 0, 1)
        before, micro_step = engine.state_dict(), engine.stats()["micro_steps"]
        rng = torch.get_rng_state()
        with pytest.raises(CheckpointError, match=pattern):
            engine.load_checkpoint(ckpt)
        assert_same_state(engine.state_dict(), before)
        assert engine.stats()["micro_steps"] == micro_step and torch.equal(torch.get_rng_state(), rng)
        run(engine, 1, 1)  # still trains


def _as_version_1(ckpt):
    """Rewrite a one-process checkpoint's manifest in the first layout: one file per unit,
    one offset per section and parameter, one RNG record."""
    def change(m):
        m["version"] = 1
        for u in m["units"]:
            u["file"] = u["entries"][0]["pieces"][0]["file"]
            for r in u["entries"]:
                (piece,) = r.pop("pieces")
                assert piece["file"] == u["file"]
                keys = ("master", "exp_avg", "exp_avg_sq") if r["trainable"] else ("value",)
                r.update({key: piece[key] for key in keys},
                         file_dtype="float32" if r["trainable"] else piece["file_dtype"])
        (m["rng"],) = m["rng"]["ranks"]
        del m["world_size"], m["stage"]
    _rewrite_manifest(ckpt, change)


def test_version_1_checkpoints_still_load(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    config = config_for(tmp_path, "host", "nvme")
    with make_engine(config) as source:
        run(source, 0, 2)
        source.save_checkpoint(ckpt)
        run(source, 2, 2)
        expected = source.state_dict()
    _as_version_1(ckpt)
    with make_engine(config, seed=1) as engine:
        engine.load_checkpoint(ckpt)
        run(engine, 2, 2)
        assert_same_state(engine.state_dict(), expected)


def test_other_model_is_rejected_naming_the_parameter(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with make_engine({}) as source:
        source.save_checkpoint(ckpt)
    wider = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=3, mlp_ratio=2)
    with make_engine({}, model_fn=lambda: GPT(wider)) as engine:
        with pytest.raises(CheckpointError, match=r"blocks\.0\.fc\.weight.*shape \(128, 32\)"):
            engine.load_checkpoint(ckpt)
    deeper = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2, num_layers=4)
    with make_engine({}, model_fn=lambda: GPT(deeper)) as engine:
        with pytest.raises(CheckpointError, match=r"blocks\.3\..* not in the checkpoint"):
            engine.load_checkpoint(ckpt)


# ---------------------------------------------------------------------- export
def _read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":  # the format's optional string map
            continue
        start, end = v["data_offsets"]
        out[k] = torch.frombuffer(bytearray(data[start:end]), dtype=dtypes[v["dtype"]]).view(v["shape"])
    return out


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_gives_a_state_dict_plain_pytorch_loads(suffix, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / f"weights{suffix}")
    with make_engine(config_for(tmp_path, "nvme", "nvme", dtype="bf16")) as engine:
        run(engine, 0, 3)
        engine.save_checkpoint(ckpt)
        expected = engine.state_dict()
    export_checkpoint(ckpt, out)
    loaded = torch.load(out, weights_only=True) if suffix == ".pt" else _read_safetensors(out)
    plain = GPT(CFG)
    plain.load_state_dict(loaded)  # strict: every key, tied ones included
    assert_same_state(plain.state_dict(), expected)
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_export_rejects_a_corrupt_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with make_engine({}) as engine:
        engine.save_checkpoint(ckpt)
    _flip_byte(os.path.join(ckpt, "unit-00000.bin"), 7)
    with pytest.raises(CheckpointError, match="unit-00000.bin"):
        export_checkpoint(ckpt, str(tmp_path / "out.pt"))
    assert not os.path.exists(tmp_path / "out.pt")


# ---------------------------------------------------------------------- atomicity
def test_save_replaces_atomically_and_cleans_leftovers_of_dead_processes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dead_pid = 2**22 + 12345  # above pid_max on default kernels: never alive
    partial = tmp_path / f".ckpt.partial-{dead_pid}-abcd1234"
    partial.mkdir()
    (partial / "unit-00000.bin").write_bytes(b"half")
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "x.txt").write_text("mine")
    with make_engine({}) as engine:
        engine.save_checkpoint(ckpt)
        assert not partial.exists(), "the half-written checkpoint of a dead process is removed"
        run(engine, 0, 1)
        engine.save_checkpoint(ckpt)  # replaces the previous one
        state = engine.state_dict()
        with pytest.raises(ValueError, match="not an offload checkpoint"):
            engine.save_checkpoint(str(foreign))
    assert (foreign / "x.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "notes"]
    # A crash between the two renames of a replacement leaves only ".ckpt.old-PID-HEX".
    os.rename(ckpt, tmp_path / f".ckpt.old-{dead_pid}-00ff00ff")
    with make_engine({}, seed=1) as other:
        other.save_checkpoint(str(tmp_path / "other"))  # a save into the same parent restores it
        other.load_checkpoint(ckpt)
        assert_same_state(other.state_dict(), state)


def test_load_names_the_complete_copies_a_killed_replacement_left(tmp_path):
    """Where the filesystem cannot exchange directories, a kill between the two renames of
    a replacement leaves no ``ckpt`` but two complete copies beside it: load_checkpoint
    names them (not just "does not exist"), and the next save into the parent renames the
    newest back before it replaces it, so neither is lost."""
    ckpt = str(tmp_path / "ckpt")
    dead_pid = 2**22 + 12345  # above pid_max on default kernels: never alive
    with make_engine({}) as engine:
        engine.save_checkpoint(ckpt)
        old_state = engine.state_dict()
        run(engine, 0, 1)
        engine.save_checkpoint(str(tmp_path / "new"))
        new_state = engine.state_dict()
    old, new = tmp_path / f".ckpt.old-{dead_pid}-00ff00ff", tmp_path / f".ckpt.partial-{dead_pid}-0a0a0a0a"
    os.rename(ckpt, old)
    os.rename(tmp_path / "new", new)
    with make_engine({}, seed=1) as other:
        with pytest.raises(CheckpointError, match="complete checkpoint") as info:
            other.load_checkpoint(ckpt)
        assert repr(str(new)) in str(info.value) and repr(str(old)) in str(info.value)
        other.load_checkpoint(str(new))  # what the message names loads
        assert_same_state(other.state_dict(), new_state)
        other.load_checkpoint(str(old))
        assert_same_state(other.state_dict(), old_state)
        # a save into the parent puts the newest back, then removes the other copy
        other.save_checkpoint(str(tmp_path / "elsewhere"))
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "elsewhere"]
        other.load_checkpoint(ckpt)
        assert_same_state(other.state_dict(), new_state)


def test_a_save_over_a_checkpoint_holding_a_users_files_is_refused(tmp_path):
    """Saving replaces the checkpoint directory whole, so a file of the user's inside it
    would go with the old checkpoint: refused naming it, before anything is written, and the
    checkpoint there still loads (before, the file was deleted)."""
    ckpt = tmp_path / "ckpt"
    with make_engine(config_for(tmp_path, "host", "host")) as engine:
        run(engine, 0, 1)
        engine.save_checkpoint(str(ckpt))
        (ckpt / "notes.txt").write_text("mine")
        (ckpt / "extra").mkdir()
        run(engine, 1, 1)
        with pytest.raises(ValueError, match="holds 2 entries the checkpoint there does not list "
                           "\\('extra', 'notes.txt'\\).*move them out"):
            engine.save_checkpoint(str(ckpt))
        assert (ckpt / "notes.txt").read_text() == "mine"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]
        engine.load_checkpoint(str(ckpt))
        (ckpt / "notes.txt").unlink()
        (ckpt / "extra").rmdir()
        engine.save_checkpoint(str(ckpt))  # its own files only: replaced as always


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_checkpoint_files_are_private_whatever_the_umask(umask, tmp_path):
    """A checkpoint holds the whole model: files 0600, directories 0700, as swap files."""
    previous = os.umask(umask)
    try:
        with make_engine({}, model_fn=Frozen) as engine:  # buffers too
            engine.save_checkpoint(str(tmp_path / "ckpt"))
            engine.save_checkpoint(str(tmp_path / "ckpt"))  # a replacement as well
    finally:
        os.umask(previous)
    modes = {name: os.stat(tmp_path / "ckpt" / name).st_mode & 0o777 for name in os.listdir(tmp_path / "ckpt")}
    assert "buffers.bin" in modes and MANIFEST in modes
    assert modes == {name: 0o600 for name in modes}
    assert os.stat(tmp_path / "ckpt").st_mode & 0o777 == 0o700


def test_a_failed_write_during_a_save_names_the_file_and_keeps_the_last_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with make_engine({}) as engine:
        engine.save_checkpoint(ckpt)
        state = engine.state_dict()
        run(engine, 0, 1)
        full = OSError(errno.ENOSPC, "No space left on device")
        with offload.faults.inject("checkpoint.save.write", offload.faults.raising(full), at=4):
            with pytest.raises(OSError) as info:  # the 4th write: the second unit's master
                engine.save_checkpoint(ckpt)
        assert info.value.errno == errno.ENOSPC
        assert "unit-00001.bin" in str(info.value) and info.value.filename.endswith("unit-00001.bin")
        assert os.listdir(tmp_path) == ["ckpt"], "the partial directory is removed"
        run(engine, 1, 1)  # the engine itself is fine
    with make_engine({}, seed=1) as fresh:
        fresh.load_checkpoint(ckpt)
        assert_same_state(fresh.state_dict(), state)


# ---------------------------------------------------------------------- refused loads
@pytest.fixture(scope="module")
def refusal_source(tmp_path_factory):
    """A checkpoint after 3 micro-steps, and the state a seed-1 engine reaches after 3."""
    base = tmp_path_factory.mktemp("refusal")
    with make_engine({}) as source:
        run(source, 0, 3)
        source.save_checkpoint(str(base / "ckpt"))
    with make_engine({}, seed=1) as reference:
        run(reference, 0, 3)
        final = reference.state_dict()
    return base / "ckpt", final


def _bad_rng_file(ckpt):
    """torch's CPU RNG file replaced by bytes torch refuses (with a matching sha256)."""
    import hashlib
    path = os.path.join(ckpt, "rng-torch-cpu.bin")
    data = b"\xff" * os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(data)
    _rewrite_manifest(ckpt, lambda m: m["files"]["rng-torch-cpu.bin"].update(
        sha256=hashlib.sha256(data).hexdigest()))
    return "rng-torch-cpu.bin.*not a torch RNG state"


def _edit(name, change, pattern):
    def corrupt(ckpt):
        _rewrite_manifest(ckpt, change)
        return FIELD + pattern
    corrupt.__name__ = name
    return corrupt


FIELD = r"manifest\.json'?: field "
HAND_EDITS = [
    _edit("no-units", lambda m: m.pop("units"), "'units' is missing"),
    _edit("shape-string", lambda m: m["units"][1]["entries"][0].update(shape="32x32"),
          r"'units\[1\]\.entries\[0\]\.shape'"),
    _edit("fqn-twice", lambda m: m["units"][0]["entries"].append(m["units"][0]["entries"][0]), r".*fqn' repeats"),
    _edit("group-index", lambda m: m["units"][1]["entries"][0].update(group_index=7), r".*group_index' must be"),
    _edit("micro-step-string", lambda m: m["engine"].update(micro_step="3"), "'engine.micro_step'"),
    _edit("loss-scale-zero", lambda m: m["engine"].update(loss_scale=0), "'engine.loss_scale'"),
    _edit("lr-string", lambda m: m["param_groups"][0].update(lr="fast"),
          r"'param_groups\[0\]\.lr' must be a finite number"),
    _edit("betas-short", lambda m: m["param_groups"][0].update(betas=[0.9]), r"'param_groups\[0\]\.betas'"),
    _edit("python-rng", lambda m: m["rng"]["ranks"][0].update(random=[3, [1, 2], None]),
          r"'rng\.ranks\[0\]\.random'"),
    _edit("rng-file-unlisted", lambda m: m["rng"]["ranks"][0]["torch"].update(cpu="unit-00009.bin"),
          r"'rng\.ranks\[0\]\.torch\.cpu'"),
    _edit("file-bytes-missing", lambda m: m["files"]["unit-00000.bin"].pop("bytes"),
          r"'files\.unit-00000\.bin\.bytes' is missing"),
    _bad_rng_file,
]


@pytest.mark.parametrize("corrupt", HAND_EDITS, ids=[c.__name__ for c in HAND_EDITS])
def test_a_refused_load_leaves_the_engine_exactly_as_before(corrupt, refusal_source, tmp_path):
    """A hand-edited manifest (checksum recomputed) or an RNG file torch refuses: a
    CheckpointError naming the manifest field or the file, raised before any state is
    replaced, so the engine trains on exactly as if the load had not been tried."""
    source, final = refusal_source
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(source, ckpt)
    pattern = corrupt(ckpt)
    with make_engine({}, seed=1) as engine:
        run(engine, 0, 1)
        before, rng = engine.state_dict(), torch.get_rng_state()
        with pytest.raises(CheckpointError, match=pattern):
            engine.load_checkpoint(ckpt)
        assert_same_state(engine.state_dict(), before)
        assert engine.stats()["micro_steps"] == 1 and torch.equal(torch.get_rng_state(), rng)
        run(engine, 1, 2)
        assert_same_state(engine.state_dict(), final)


def test_a_symlinked_checkpoint_name_is_refused_and_its_target_kept(tmp_path):
    """Replacing NAME moves NAME itself: a symbolic link there is refused (naming where it
    points), and a planted link among a dead save's leftovers is removed as a link, never
    what it points to."""
    real = str(tmp_path / "real")
    with make_engine({}) as engine:
        engine.save_checkpoint(real)
        os.symlink(real, tmp_path / "ckpt")
        with pytest.raises(ValueError, match="symbolic link.*real"):
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        os.symlink(real, tmp_path / f".other.old-{2**22 + 12345}-0000beef")
        engine.save_checkpoint(str(tmp_path / "other"))
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "other", "real"]
        assert os.path.isfile(os.path.join(real, MANIFEST))
        engine.load_checkpoint(str(tmp_path / "ckpt"))  # loading through a link is fine


def test_checkpoint_warnings_point_at_the_users_call(tmp_path):
    """A param_groups value that JSON cannot hold is not saved, and a checkpoint written
    with another max_grad_norm loads without resuming bit-identically: each says so in a
    warning attributed to the user's save_checkpoint() / load_checkpoint() line."""
    import warnings

    ckpt = str(tmp_path / "ckpt")
    with make_engine(config_for(tmp_path, "host", "host", max_grad_norm=1.0)) as engine:
        run(engine, 0, 1)
        engine.optimizer.param_groups[0]["custom"] = object()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.save_checkpoint(ckpt)
    assert [(w.filename, str(w.message)) for w in caught] == [
        (__file__, "save_checkpoint: param_groups[0]['custom'] (object) is not saved")]
    with make_engine(config_for(tmp_path, "host", "host", max_grad_norm=2.0)) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.load_checkpoint(ckpt)
    assert [w.filename for w in caught if "max_grad_norm=1.0" in str(w.message)] == [__file__]
