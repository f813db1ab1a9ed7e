"""Swap integrity ([Note: swap checksums], offload/io/checksum.py): the CRC32C kernels, the
page tables, and an engine that refuses swap data changed behind its back."""
import errno
import os
import subprocess
import sys

import pytest
import torch

import offload
from offload import _native
from offload.errors import EngineFailedError
from offload.gpt import GPT
from offload.io import aligned_empty
from offload.io.checksum import PAGE_BYTES, SwapChecksums, crc32c
from offload.io.swap import Extent

from support import CFG, FaultyIO, batches, gpt_loss, make_opt, train_offload, wrap_swap_io

ISAS = _native.crc32c_available_isas()


@pytest.fixture
def isa():
    """Runs the test under each CRC32C kernel this CPU has, then restores the choice."""
    chosen = _native.crc32c_selected_isa()
    yield
    _native.crc32c_set_isa(chosen)


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """The definition: reflected CRC-32 with the Castagnoli polynomial, one bit at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


# ------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("name", ISAS)
def test_crc32c_matches_known_vectors(isa, name):
    """The check value of the CRC-32C catalogue and the iSCSI vectors of RFC 3720 B.4."""
    _native.crc32c_set_isa(name)
    vectors = [(b"123456789", 0xE3069283), (b"", 0), (bytes(32), 0x8A9136AA),
               (b"\xff" * 32, 0x62A8AB43), (bytes(range(32)), 0x46DD794E),
               (bytes(range(31, -1, -1)), 0x113FDB5C)]
    for data, expected in vectors:
        assert crc32c(as_tensor(data)) == expected, (name, data)
        assert crc32c_bitwise(data) == expected


@pytest.mark.parametrize("name", ISAS)
def test_crc32c_matches_the_definition_and_continues(isa, name):
    _native.crc32c_set_isa(name)
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 8, 9, 100, 383, 384, 385, 1000):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert crc32c(data) == crc32c_bitwise(bytes(data.tolist())), (name, n)
        cut = n // 3
        assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data), (name, n)


@pytest.mark.skipif("sse42" not in ISAS, reason="this CPU has no SSE4.2")
def test_scalar_kernel_equals_the_hardware_kernel(isa):
    """Odd lengths around every lane and block boundary of the three-stream kernel, at every
    alignment of the start: the table kernel and the crc32 instruction give one answer."""
    g = torch.Generator().manual_seed(2)
    buf = aligned_empty(5 * 4096 + 64)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8, generator=g))
    lengths = sorted({0, 1, 3, 7, 8, 15, 127, 128, 383, 384, 385, 767, 1360, 4079, 4080, 4081, 4095,
                      4096, 4097, 8160, 8161, 12241, 20000} | set(torch.randint(1, 20480, (20,), generator=g).tolist()))
    for start in range(0, 17):
        for n in lengths:
            view = buf[start:start + n]
            _native.crc32c_set_isa("scalar")
            scalar = crc32c(view)
            _native.crc32c_set_isa("sse42")
            assert crc32c(view) == scalar, (start, n)


def test_isa_is_chosen_at_load_and_can_be_forced():
    """CPUID picks the kernel at load (native_info() and `offload doctor` report it);
    OFFLOAD_CRC32C_ISA forces one, and a bad value is an error at use, not a silent fallback."""
    code = "import offload; print(offload.native_info()['crc32c_isa'])"
    env = dict(os.environ, OFFLOAD_CRC32C_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"
    env["OFFLOAD_CRC32C_ISA"] = "avx9000"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "OFFLOAD_CRC32C_ISA" in out.stderr
    if "sse42" in ISAS:
        env.pop("OFFLOAD_CRC32C_ISA")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "sse42"


def test_pages_and_check_pages():
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (3 * PAGE_BYTES + 100,), dtype=torch.uint8, generator=g)
    crcs = torch.empty(4, dtype=torch.int32)
    _native.crc32c_pages(data.data_ptr(), data.numel(), PAGE_BYTES, crcs.data_ptr())
    for i in range(4):
        assert crcs[i].item() & 0xFFFFFFFF == crc32c(data[i * PAGE_BYTES:(i + 1) * PAGE_BYTES])
    check = lambda known=0: _native.crc32c_check_pages(data.data_ptr(), data.numel(), PAGE_BYTES,  # noqa: E731
                                                       crcs.data_ptr(), known)
    assert check() == -1
    data[2 * PAGE_BYTES + 5] ^= 1
    assert check() == 2
    known = torch.tensor([1, 1, 0, 1], dtype=torch.uint8)
    assert check(known.data_ptr()) == -1  # an unknown page is not checked


# ------------------------------------------------------------------ the page tables
def test_tables_follow_writes_and_catch_changed_pages():
    sums = SwapChecksums()
    extent = Extent("/swap-0000.bin", 8 * PAGE_BYTES, 4 * PAGE_BYTES)
    sums.track(extent)
    page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert sums.check(torch.zeros(4 * PAGE_BYTES, dtype=torch.uint8), extent.path, extent.offset) is None
    written = torch.arange(2 * PAGE_BYTES, dtype=torch.int32).view(torch.uint8)[:2 * PAGE_BYTES].clone()
    sums.record(written, extent.path, extent.offset + PAGE_BYTES)  # pages 1-2 of the extent
    assert sums.check(written, extent.path, extent.offset + PAGE_BYTES) is None
    assert sums.check(page, extent.path, extent.offset + PAGE_BYTES) == extent.offset + PAGE_BYTES
    changed = written.clone()
    changed[PAGE_BYTES + 7] ^= 0x10
    assert sums.check(changed, extent.path, extent.offset + PAGE_BYTES) == extent.offset + 2 * PAGE_BYTES
    zeroed = written.clone()
    zeroed[PAGE_BYTES:] = 0
    assert sums.check(zeroed, extent.path, extent.offset + PAGE_BYTES) == extent.offset + 2 * PAGE_BYTES
    # a failed write: its pages are no longer known, so whatever is there is not refused
    sums.forget(extent.path, extent.offset + PAGE_BYTES, 2 * PAGE_BYTES)
    assert sums.check(changed, extent.path, extent.offset + PAGE_BYTES) is None


def test_a_write_off_page_boundaries_leaves_its_edge_pages_unknown():
    sums = SwapChecksums()
    extent = Extent("/swap-0000.bin", 0, 3 * PAGE_BYTES)
    sums.track(extent)
    ones = torch.ones(PAGE_BYTES + 200, dtype=torch.uint8)
    sums.record(ones, extent.path, PAGE_BYTES - 100)  # the end of page 0, page 1, the start of page 2
    anything = torch.full((3 * PAGE_BYTES,), 9, dtype=torch.uint8)
    anything[PAGE_BYTES:2 * PAGE_BYTES] = 1
    assert sums.check(anything, extent.path, 0) is None
    anything[PAGE_BYTES] = 2
    assert sums.check(anything, extent.path, 0) == PAGE_BYTES


# ------------------------------------------------------------------ the engine
def nvme_engine(tmp_path, dtype="fp32", swap_checksums=True, **overrides):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"),
                  device_budget=140 * 1024, dtype=dtype, swap_checksums=swap_checksums, **overrides)
    return model, offload.wrap(model, make_opt(model.parameters()), config=config)


def flip_byte(extent, at):
    """Change one byte of a swap extent in its file, behind the engine's back."""
    with open(extent.path, "r+b") as f:
        f.seek(extent.offset + at)
        value = f.read(1)[0]
        f.seek(extent.offset + at)
        f.write(bytes([value ^ 0x01]))
        f.flush()
        os.fsync(f.fileno())


def zero_page(extent, page):
    with open(extent.path, "r+b") as f:
        f.seek(extent.offset + page * PAGE_BYTES)
        f.write(bytes(PAGE_BYTES))
        f.flush()
        os.fsync(f.fileno())


def assert_names_the_place(error, unit, extent, bad_offset):
    assert error.errno == errno.EIO
    message = str(error)
    assert f"unit {unit!r}" in message and "checksum" in message
    assert extent.path in message and f"offset {bad_offset}" in message


def test_swap_checksums_are_on_by_default(tmp_path):
    """On by default (README, "Swap integrity": the measured cost is within the 3% a default
    may cost); swap_checksums=False keeps no tables."""
    assert offload.OffloadConfig().swap_checksums is True
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"))) as engine:
        assert engine.debug.nvme.checksums is not None
    _, engine = nvme_engine(tmp_path, swap_checksums=False)
    with engine:
        assert engine.debug.nvme.checksums is None


def test_a_flipped_byte_of_a_compute_copy_fails_its_fetch(tmp_path):
    """The fetch that reads a changed page raises, naming unit, file and offset; the forward
    that needed it never ran on those bytes, and the next try refuses them again."""
    _, engine = nvme_engine(tmp_path)
    with engine:
        train_offload(engine, batches(2))
        # Every unit back home only, so the next forward must read unit 2: a checkpoint load
        # settles the last step's updates and releases every device copy (a deferred update
        # could otherwise rewrite the page, or fill the unit's device slot, first).
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        u = engine.units[2]
        assert u.compute_state == offload.units.Residency.HOME
        flip_byte(u.compute_home, PAGE_BYTES + 123)
        for _ in range(2):
            with pytest.raises(OSError) as caught:
                gpt_loss(engine, batches(1, seed=5)[0])
            cause = caught.value.__cause__ or caught.value
            assert_names_the_place(cause, u.name, u.compute_home, u.compute_home.offset + PAGE_BYTES)
            assert caught.value.errno == errno.EIO


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_zeroed_page_of_the_moments_fails_the_step(tmp_path, dtype):
    """Adam's states read back in the optimizer step: a zeroed page stops the step, the
    engine refuses to go on (it says to load a checkpoint) and nothing is trained on it."""
    _, engine = nvme_engine(tmp_path, dtype=dtype, max_grad_norm=1.0, speculative_updates=False,
                            overlap_step_with_forward=False)  # every update in step()
    with engine:
        train_offload(engine, batches(2))
        engine.state_dict()  # every update of the last step written before the page is changed
        u = engine.units[1]
        page = u.moments_home.nbytes // PAGE_BYTES - 1  # the last page of exp_avg_sq
        zero_page(u.moments_home, page)
        steps = list(u.steps)
        engine.backward(gpt_loss(engine, batches(1, seed=6)[0]))
        with pytest.raises(OSError) as caught:
            engine.step()
        assert caught.value.errno == errno.EIO and "load_checkpoint" in str(caught.value)
        assert_names_the_place(caught.value.__cause__, u.name, u.moments_home,
                               u.moments_home.offset + page * PAGE_BYTES)
        assert u.steps == steps  # Adam never ran on the unit's states
        with pytest.raises(EngineFailedError):
            gpt_loss(engine, batches(1, seed=7)[0])


def test_a_failed_swap_write_is_not_a_checksum_error(tmp_path):
    """[Note: swap I/O failures] A write that fails half-done leaves its pages unknown: the
    step still completes with that unit's states in host RAM, as without checksums."""
    _, engine = nvme_engine(tmp_path, max_grad_norm=1.0, speculative_updates=False,
                            overlap_step_with_forward=False)  # writes in step()
    with engine:
        train_offload(engine, batches(1))
        wrap_swap_io(engine, FaultyIO, errno.EIO, fail_write=2)
        engine.backward(gpt_loss(engine, batches(1, seed=8)[0]))
        with pytest.raises(OSError) as caught:
            engine.step()
        assert "swap writes failed" in str(caught.value) and "checksum" not in str(caught.value)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checksums_change_no_result(tmp_path, dtype):
    """A run with checksums is bit-identical to one without (losses and final tensors)."""
    results = []
    for on in (True, False):
        _, engine = nvme_engine(tmp_path / str(on), dtype=dtype, swap_checksums=on)
        with engine:
            losses = train_offload(engine, batches(4))
            results.append((losses, engine.state_dict()))
    (losses_on, state_on), (losses_off, state_off) = results
    assert losses_on == losses_off
    assert state_on.keys() == state_off.keys()
    for key in state_on:
        assert torch.equal(state_on[key], state_off[key]), key


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_swap_checksums_must_be_a_bool(value):
    with pytest.raises(ValueError, match="swap_checksums"):
        offload.OffloadConfig(swap_checksums=value)


def test_load_checkpoint_after_a_checksum_error_trains_on(tmp_path):
    """The documented recovery (docs: reliability): loading a checkpoint rewrites every
    swap home and its checksums, and training goes on from the checkpoint's state."""
    _, engine = nvme_engine(tmp_path)
    with engine:
        train_offload(engine, batches(2))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        # every unit home, so that the next forward reads unit 2 (a deferred update may have
        # filled its device copy, and then nothing would read the flipped page)
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        saved = engine.state_dict()
        u = engine.units[2]
        flip_byte(u.compute_home, 10)
        with pytest.raises(OSError):
            gpt_loss(engine, batches(1, seed=5)[0])
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        after = engine.state_dict()
        assert all(torch.equal(saved[k], after[k]) for k in saved)
        train_offload(engine, batches(1, seed=9))


@pytest.mark.parametrize("dtype,split,home", [
    (dtype, split, home) for dtype, split in (("fp32", False), ("bf16", True), ("bf16", False))
    for home in ("compute_home", "master_home", "moments_home")
    if not (dtype == "fp32" and home == "master_home")])  # fp32: the compute copy is the master
def test_load_checkpoint_into_the_same_engine_recovers_from_any_changed_page(dtype, split, home, tmp_path):
    """In-process recovery: whatever page of a unit's homes changed, the checkpoint load
    replaces it, and the run goes on as one loaded from the checkpoint in a fresh engine.
    Before, a changed byte in a page the load writes only in part (its last page, read back
    to keep its other bytes) failed its checksum, and the load failed every time."""
    ckpt = str(tmp_path / "ckpt")
    _, engine = nvme_engine(tmp_path / "a", dtype=dtype, split_master=split)
    with engine:
        train_offload(engine, batches(2))
        engine.save_checkpoint(ckpt)
        engine.load_checkpoint(ckpt)  # every unit home, nothing in flight
        changed = 0
        for u in engine.units:
            extent = getattr(u, home)
            if extent is None or isinstance(extent, torch.Tensor):
                continue
            flip_byte(extent, extent.nbytes - PAGE_BYTES + 8)  # the last page, inside the values
            changed += 1
        assert changed
        engine.load_checkpoint(ckpt)
        losses, state = train_offload(engine, batches(2, seed=9)), engine.state_dict()
    _, fresh = nvme_engine(tmp_path / "b", dtype=dtype, split_master=split)
    with fresh:
        fresh.load_checkpoint(ckpt)
        assert train_offload(fresh, batches(2, seed=9)) == losses
        for key, value in fresh.state_dict().items():
            assert torch.equal(value, state[key]), key


# ------------------------------------------------------------------ zeroed extents
def home_bytes(engine, *, moments):
    """Bytes of the units' swap homes: the moments' or all but the moments'."""
    return sum(h.nbytes for u in engine.units
               for h in ([u.moments_home] if moments else [u.compute_home, u.master_home])
               if h is not None and not isinstance(h, torch.Tensor))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_wrap_writes_no_zero_moments_and_the_first_step_checks_them(tmp_path, dtype):
    """[Note: zeroed extents] The initial Adam moments are not written (the swap file holds
    zeros there already): wrap writes the compute copies and masters only. The first step
    reads those pages, checked against the CRC32C of a zero page, and passes; the results
    are those of a run whose moments were written (test_golden pins them bit for bit)."""
    # every update in step(), so that all are done when it returns
    _, engine = nvme_engine(tmp_path, dtype=dtype, max_grad_norm=1.0, speculative_updates=False,
                            overlap_step_with_forward=False)
    with engine:
        moments = home_bytes(engine, moments=True)
        assert moments > 0
        assert engine.stats()["bytes_written_nvme"] == home_bytes(engine, moments=False)
        read_before = engine.stats()["bytes_read_nvme"]
        train_offload(engine, batches(1))
        assert engine.stats()["bytes_read_nvme"] - read_before >= moments  # the moments were read
        assert all(u.steps and min(u.steps) == 1 for u in engine.units if u.trainable)


def test_a_changed_page_of_moments_never_written_fails_the_first_step(tmp_path):
    """A page of the zero moments that wrap did not write is still checked: one changed in
    the file before the first step stops that step, naming the place."""
    _, engine = nvme_engine(tmp_path, max_grad_norm=1.0, speculative_updates=False,
                            overlap_step_with_forward=False)  # every update in step()
    with engine:
        u = engine.units[1]
        page = u.moments_home.nbytes // PAGE_BYTES - 1  # the last page of exp_avg_sq
        flip_byte(u.moments_home, page * PAGE_BYTES + 17)
        engine.backward(gpt_loss(engine, batches(1)[0]))
        with pytest.raises(OSError) as caught:
            engine.step()
        assert caught.value.errno == errno.EIO
        assert_names_the_place(caught.value.__cause__, u.name, u.moments_home,
                               u.moments_home.offset + page * PAGE_BYTES)


def test_moments_carried_from_an_optimizer_that_took_steps_are_written(tmp_path):
    """Only zeros are skipped: an AdamW with state writes its moments home at wrap."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_opt(model.parameters())
    gpt_loss(model, batches(1)[0]).backward()
    opt.step()
    opt.zero_grad()
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"),
                  device_budget=140 * 1024)
    with offload.wrap(model, opt, config=config) as engine:
        assert engine.stats()["bytes_written_nvme"] == \
            home_bytes(engine, moments=False) + home_bytes(engine, moments=True)


def test_nvme_tier_claims_a_zeroed_extent_once_and_never_after_a_write(tmp_path):
    """[Note: zeroed extents] The bookkeeping itself: a new extent is claimable once; a
    write into any part of one makes it unclaimable; so are extents that reuse freed bytes,
    whose checksum pages start unknown instead of zero."""
    from offload.tiers.nvme import NvmeTier

    tier = NvmeTier(str(tmp_path / "swap"), 1 << 20, "auto", 1 << 20, 8)
    try:
        a, b, c = (tier.allocate(4 * PAGE_BYTES) for _ in range(3))
        assert a.zeroed and b.zeroed and c.zeroed
        assert tier.claim_zeroed(a) and not tier.claim_zeroed(a)
        ones = aligned_empty(PAGE_BYTES).fill_(1)
        tier.write(ones, Extent(b.path, b.offset + 2 * PAGE_BYTES, PAGE_BYTES)).wait()  # a piece of b
        assert not tier.claim_zeroed(b)
        assert tier.claim_zeroed(c)
        buf = aligned_empty(4 * PAGE_BYTES)
        tier.read(buf, c).wait()  # never written: zeros, checked against the zero page's CRC
        assert int(buf.count_nonzero()) == 0
        tier.space.free(b)
        again = tier.allocate(4 * PAGE_BYTES)  # b's bytes, written before
        assert (again.path, again.offset) == (b.path, b.offset) and not again.zeroed
        assert not tier.claim_zeroed(again)
        tier.read(buf, again).wait()  # unknown pages: not refused
    finally:
        tier.close()
