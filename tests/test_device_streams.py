"""[Note: streams] The CPU stand-in of CUDA: a copy stream that runs behind the caller, events,
and a hazard checker that follows happens-before by logic, not timing. Issue 37 findings 1
and 2 fail here without their fixes."""
import threading

import pytest
import torch

import offload
from offload.tiers.device import DeviceTier
from offload.tiers.streams import COMPUTE, COPY, STANDIN_ENV, HazardChecker, StreamHazard
from support import (CFG, batches, check_activation_offload, check_delayed_updates, gpt_loss, make_opt, max_rel_error,
                     train_gpt, train_offload)
from offload.gpt import GPT


@pytest.fixture
def swap_dir(tmp_path):
    return str(tmp_path / "swap")


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv(STANDIN_ENV, "cuda")


# ---------------------------------------------------------------------------- the checker
def test_a_copy_into_bytes_the_compute_stream_read_must_wait_for_an_event_recorded_after_the_read():
    c = HazardChecker()
    c.access(COMPUTE, 0, 100, write=False, what="the use of unit 'a'")
    with pytest.raises(StreamHazard, match=r"the fill of unit 'b' writes bytes \[40, 100\) on the copy "
                                           r"stream, not ordered after the use of unit 'a', which read them"):
        c.access(COPY, 40, 200, write=True, what="the fill of unit 'b'")
    # an event recorded before the read does not order it
    early = HazardChecker()
    before = early.record(COMPUTE)
    early.access(COMPUTE, 0, 100, write=False, what="a read")
    early.join(COPY, before)
    with pytest.raises(StreamHazard):
        early.access(COPY, 0, 100, write=True, what="a fill")
    # one recorded after it does, once the copy stream waited for it
    c.join(COPY, c.record(COMPUTE))
    c.access(COPY, 40, 200, write=True, what="the fill of unit 'b'")
    # bytes outside every earlier access conflict with nothing
    c.access(COPY, 1000, 2000, write=True, what="a fill of fresh bytes")


def test_a_read_of_bytes_a_copy_wrote_must_wait_for_the_copy():
    c = HazardChecker()
    c.access(COPY, 0, 64, write=True, what="the fill of unit 'a'")
    with pytest.raises(StreamHazard, match="the use of unit 'a' reads .* which wrote them on the copy stream"):
        c.access(COMPUTE, 0, 64, write=False, what="the use of unit 'a'")
    c.join(COMPUTE, c.record(COPY))
    c.access(COMPUTE, 0, 64, write=False, what="the use of unit 'a'")
    # reads on one stream after another's read: no conflict
    c.access(COPY, 0, 64, write=False, what="a read")


# ---------------------------------------------------------------------------- the stand-in
def test_the_standin_copy_stream_runs_behind_the_caller_and_its_events_order_the_fills():
    tier = DeviceTier(torch.device("cpu"), torch.float32, capacity_numel=4096, budget_bytes=4096 * 4,
                      host_addressable=False)
    streams = tier.streams
    sources = [torch.full((1024,), float(v)) for v in range(4)]
    for t in sources:
        tier.pin(t)  # [Note: pinned buffers] copies to the device come from page-locked memory
    with pytest.raises(StreamHazard, match="from host memory that is not pinned"):
        tier.copy_in(tier.view(0, 1024), torch.zeros(1024))
    try:
        gate = threading.Event()
        blocker = tier.copy_in(tier.view(3072, 1024), sources[1])  # unrelated bytes, first in line
        held = streams.hold(gate)  # the copy stream stops here until the gate opens
        a = tier.allocate(1024)
        event = tier.copy_in(tier.view(a, 1024), sources[2], what="the fill of unit 'a'")
        assert not held.done() and tier.view(a, 1024).sum() == 0, "copy_in returned before the copy ran"
        gate.set()
        tier.compute_uses(a, 1024, event, what="the use of unit 'a'")
        assert tier.view(a, 1024).sum() == 2048
        # a released slot handed out again: the next fill waits for the compute stream's reads
        tier.reads_done(a, 1024, what="the use of unit 'a'")
        tier.free(a, 1024)
        b = tier.allocate(1024)
        assert b == a
        tier.copy_in(tier.view(b, 1024), sources[3], what="the fill of unit 'b'").synchronize()
        # without the wait ([Note: streams]: issue 37, finding 2) the checker says so, deterministically
        tier.reads_done(b, 1024, what="the use of unit 'b'")
        tier.free(b, 1024)
        tier.fills_wait_for_reads = False
        c = tier.allocate(1024)
        with pytest.raises(StreamHazard, match="the fill of unit 'c' writes .* not ordered after the use of unit 'b'"):
            tier.copy_in(tier.view(c, 1024), sources[0], what="the fill of unit 'c'")
        blocker.synchronize()
    finally:
        tier.close()


# ---------------------------------------------------------------------------- the engine on it
def _losses_and_state(config, data):
    losses, state, stats, _ = train_gpt(config, data)
    return losses, state, stats


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_device_homed_compute_copies_with_states_on_nvme_train_as_on_the_host_device(dtype, swap_dir, standin,
                                                                                   monkeypatch):
    """Issue 37, finding 1: param_tier "device" with optimizer_tier "nvme", the commonest
    GPU setup. On CUDA (and its stand-in) the staging slots have a compute buffer; an update
    took a device-homed unit for an NVMe-homed one (``on_nvme(None)`` was True) and crashed
    at its first step. It trains to the same numbers as the CPU device, bit for bit."""
    data = batches(4)
    config = dict(param_tier="device", optimizer_tier="nvme", swap_dir=swap_dir, dtype=dtype, device="cpu")
    losses, state, stats = _losses_and_state(config, data)
    monkeypatch.delenv(STANDIN_ENV)
    ref_losses, ref_state, _ = _losses_and_state(dict(config, swap_dir=swap_dir + "-ref"), data)
    assert losses == ref_losses
    assert max_rel_error(state, ref_state) == 0


@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "host"), ("device", "host")])
def test_evaluation_and_training_on_the_standin_raise_no_hazard_and_equal_the_host_device(tiers, swap_dir, standin,
                                                                                        monkeypatch):
    """Issue 37, finding 2: a slot released under no_grad evaluation is filled again while
    the compute stream may still read it, unless the fill waits for the release's event.
    The stand-in checks every fill and use; the run equals the CPU device's bit for bit."""
    param_tier, optimizer_tier = tiers
    torch.manual_seed(0)
    model = GPT(CFG)
    budget = None if param_tier == "device" else 200_000  # slots reused within a pass
    config = dict(param_tier=param_tier, optimizer_tier=optimizer_tier, swap_dir=swap_dir, device="cpu",
                  device_budget=budget)
    data = batches(3)

    def run(model):
        out = []
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            checker = getattr(engine.debug.device.streams, "checker", None)
            for b in data:
                with torch.no_grad():
                    out.append(gpt_loss(engine, b).item())
                loss = gpt_loss(engine, b)
                engine.backward(loss)
                engine.step()
                out.append(loss.item())
            return out, {k: v.clone() for k, v in engine.state_dict().items()}, checker

    losses, state, checker = run(model)
    assert checker is not None and checker.num_checks > 0
    monkeypatch.delenv(STANDIN_ENV)
    torch.manual_seed(0)
    config["swap_dir"] = swap_dir + "-ref"
    ref_losses, ref_state, _ = run(GPT(CFG))
    assert losses == ref_losses
    assert max_rel_error(state, ref_state) == 0


def test_without_the_release_event_the_standin_catches_the_fill_that_overwrites_a_slot_in_use(swap_dir, standin,
                                                                                             monkeypatch):
    """The check of the fix: with fills not waiting for the compute stream's reads (the
    code before issue 37's fix), the first reused slot raises, naming both units."""
    monkeypatch.setattr(DeviceTier, "fills_wait_for_reads", False)
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(param_tier="host", optimizer_tier="host", device="cpu", device_budget=200_000)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        with pytest.raises(StreamHazard, match=r"the fill of unit '.*' writes bytes .* not ordered after "
                                               r"the use of unit '.*', which read them on the compute stream"):
            for b in batches(2):
                with torch.no_grad():
                    gpt_loss(engine, b)


def test_fills_delayed_on_the_copy_stream_are_waited_for(swap_dir, standin, monkeypatch):
    """A check of the checker's premise: with every copy held back on the stand-in's copy
    stream, the numbers are still those of the CPU device, so each use really waits for its
    fill (a missing wait would read a slot before its bytes arrived)."""
    monkeypatch.setenv("OFFLOAD_STANDIN_COPY_DELAY_S", "0.002")
    data = batches(2)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=swap_dir, device="cpu", device_budget=200_000)
    losses, state, _ = _losses_and_state(config, data)
    monkeypatch.delenv(STANDIN_ENV)
    ref_losses, ref_state, _ = _losses_and_state(dict(config, swap_dir=swap_dir + "-ref"), data)
    assert losses == ref_losses
    assert max_rel_error(state, ref_state) == 0


@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("host", "host")])
def test_pinned_bytes_are_the_host_tiers_own_buffers_at_their_size_and_go_back_at_close(tiers, swap_dir, standin,
                                                                                      monkeypatch):
    """Issue 37, finding 4 ([Note: pinned buffers]): for a device the host does not address,
    the host tier page-locks each buffer it allocates, at its own size (no power-of-two
    rounding, nothing cached), and unlocks it at close; copies to the device come from
    pinned memory only (the stand-in raises otherwise). A CPU device pins nothing."""
    param_tier, optimizer_tier = tiers
    config = dict(param_tier=param_tier, optimizer_tier=optimizer_tier, swap_dir=swap_dir, device="cpu",
                  device_budget=200_000)
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = offload.wrap(model, make_opt(model.parameters()), config=config)
    host, streams = engine.debug.host, engine.debug.device.streams
    with engine:
        for b in batches(2):
            engine.backward(gpt_loss(engine, b))
            assert host.pinned_bytes == host.used_bytes > 0  # gradients included: no adopted tensors here
            engine.step()
        engine.state_dict()
        assert host.pinned_bytes == host.used_bytes == sum(streams.pinned.values())
    assert streams.pinned == {} and host.pinned_bytes == 0
    monkeypatch.delenv(STANDIN_ENV)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=dict(config, swap_dir=swap_dir + "-cpu")) as engine:
        train_offload(engine, batches(1))
        assert engine.debug.host.pinned_bytes == 0


def test_soft_overshoots_of_the_host_budget_do_not_fail_a_planned_buffer_made_meanwhile():
    """[Note: planned host bytes] Unplanned bytes (a spilled gradient read back, the stand-in's
    flag byte) may hold the host tier past its budget; a planned buffer is checked against
    what the plan's own buffers hold, and the accounting of both goes back at release."""
    from offload.tiers import HostTier

    host = HostTier(budget_bytes=4096)
    soft = host.allocate(1, torch.uint8, planned=False)
    planned = host.allocate(1024, torch.float32)  # the whole budget
    assert (host.used_bytes, host.planned_bytes, host.peak_bytes) == (4097, 4096, 4097)
    with pytest.raises(AssertionError, match="host budget exceeded"):
        host.allocate(1, torch.uint8)
    host.release(soft)
    host.release(planned)
    assert host.used_bytes == host.planned_bytes == 0


def test_every_unit_waiting_for_its_update_fits_a_host_budget_of_exactly_the_plan(swap_dir, standin):
    """[Note: planned host bytes] With the optimizer worker held at its first update until
    backward is done, every unit's gradient takes a pooled host buffer at once: the most the
    plan counts. At host_budget exactly the plan that fits, though the stand-in's flag byte
    (unplanned) already holds the host tier one byte past the plan; it failed before the
    check counted planned bytes apart (CI's stand-in run, under load)."""
    import offload.faults

    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=swap_dir, device="cpu", device_budget=100_000)
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as probe:
        planned = probe._host_planned_bytes
    backward_done = threading.Event()
    torch.manual_seed(0)
    model = GPT(CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=dict(config, host_budget=planned)) as engine:
        host = engine.debug.host
        trainable = [u for u in engine.units if u.trainable]
        with offload.faults.inject("optim.adam_range", lambda **_: backward_done.wait(timeout=60), at=1):
            engine.backward(gpt_loss(engine, batches(1)[0]))
            held = sum(u.grad is not None for u in trainable)
            backward_done.set()
            engine.step()
        assert held == len(trainable) > 1, "the worker was held: every unit took a gradient buffer"
        assert host.planned_bytes <= planned < host.peak_bytes
        train_offload(engine, batches(2, seed=2))


def test_gradients_leave_the_device_without_blocking_and_are_waited_for_before_they_are_read(swap_dir, standin,
                                                                                           monkeypatch):
    """Issue 37, finding 5 ([Note: gradients off the device]): a gradient is queued on the
    device-to-host stream into its unit's pinned buffer and autograd goes on; the norm and the
    update wait for it. Without that wait the stand-in names the read that comes too early,
    however fast the copy happened to run."""
    from offload.optim.gradients import Gradients

    config = dict(param_tier="host", optimizer_tier="host", device="cpu", max_grad_norm=1.0)
    data = batches(3)
    losses, state, _ = _losses_and_state(config, data)
    monkeypatch.delenv(STANDIN_ENV)
    ref_losses, ref_state, _ = _losses_and_state(config, data)
    assert losses == ref_losses and max_rel_error(state, ref_state) == 0
    monkeypatch.setenv(STANDIN_ENV, "cuda")
    monkeypatch.setattr(Gradients, "landed", lambda self, u: None)
    with pytest.raises(StreamHazard, match=r"a read of unit '.*'s gradient reads bytes .* not ordered after the "
                                           r"gradient of '.*', which wrote them on the d2h stream"):
        _losses_and_state(config, data[:1])


@pytest.mark.parametrize("standin_device", [True, False])
def test_a_write_into_a_released_parameter_is_found_without_the_forward_waiting_for_the_device(
        standin_device, standin, monkeypatch):
    """Issue 37, finding 8 ([Note: released parameters]): where the host does not address
    the device, the check of the placeholders is queued at a forward's start and its answer
    comes back on the device-to-host stream, read at the next forward's start: so a write is
    reported one forward later than on the CPU device, naming the parameter, and the
    engine's values are untouched either way."""
    if not standin_device:
        monkeypatch.delenv(STANDIN_ENV)
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(param_tier="host", optimizer_tier="host", device="cpu", device_budget=200_000)
    data = batches(3)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        engine.backward(gpt_loss(engine, data[0]))
        engine.step()
        before = engine.state_dict()
        copies_out = []
        streams = engine.debug.device.streams
        monkeypatch.setattr(streams, "copy_out", lambda dst, src, what="", f=streams.copy_out:
                            copies_out.append(what) or f(dst, src, what=what))
        model.blocks[1].fc.weight.data.zero_()
        written = pytest.raises(RuntimeError, match=r"blocks\.1\.fc\.weight.*written in place while their unit")
        if standin_device:
            with torch.no_grad():
                gpt_loss(engine, data[1])  # its start queued the check that finds the write
            assert "the check of released parameters" in copies_out
        with written, torch.no_grad():
            gpt_loss(engine, data[2])
        assert copies_out == (["the check of released parameters"] if standin_device else [])
        assert max_rel_error(engine.state_dict(), before) == 0
        with torch.no_grad():  # the scratch was reset: the next passes run clean
            gpt_loss(engine, data[1])
            gpt_loss(engine, data[2])


def test_the_bodies_of_the_gpu_tests_of_delayed_updates_and_activation_offload_run_here(tmp_path):
    """tests/test_engine_gpu.py's newer tests have not run on a GPU yet: their bodies run
    here on the CPU device (the delayed run against itself, the activations' bytes), so the
    next GPU session tests CUDA, not them."""
    check_delayed_updates(("cpu", "cpu"), tmp_path / "delayed")
    for kind in ("host", "nvme"):
        check_activation_offload(kind, ("cpu",), tmp_path / kind)


def test_activations_moved_in_pieces_are_ordered_on_the_standin(standin, swap_dir, monkeypatch):
    """[Note: activation pieces] Under the stand-in's hazard checker: groups larger than the
    host room go to NVMe and back in pieces through one host buffer; every copy of a piece is
    waited for before the buffer takes the next one or is let go (a buffer of the backward
    reuses the bytes of one from the forward: waiting for the last copy out alone left the
    others unordered, a StreamHazard). Bit for bit the run without offload."""
    import offload.memory.layout as layout_module
    from offload.memory.budget import model_unit_sizes
    from offload.memory.placement import minimum_state_host_bytes
    from offload.gpt import GPTConfig

    monkeypatch.setattr(layout_module, "ACTIVATION_PIECE_BYTES", 64 << 10)
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=2, num_layers=3)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=swap_dir)
    room = 90_000  # below a block's group (278,528 bytes), above the floor

    def run(activation_offload, host_budget=None):
        torch.manual_seed(0)
        model = GPT(cfg)
        g = torch.Generator().manual_seed(7)
        losses = []
        extra = dict(activation_offload=activation_offload) if activation_offload else {}
        with offload.wrap(model, make_opt(model.parameters()), config=dict(config, host_budget=host_budget,
                                                                            **extra)) as engine:
            for _ in range(3):
                b = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
                loss = engine(b[:, :-1], b[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses, engine.stats(), engine.device

    plain, _, device = run(None)
    least = minimum_state_host_bytes(offload.OffloadConfig.from_any(dict(config, activation_offload="nvme")),
                                     device, None, model_unit_sizes(GPT(cfg), 4))
    losses, stats, _ = run("nvme", host_budget=least + room)
    act = stats["activations"]
    assert losses == plain
    assert act["host_room_bytes"] == room and act["host_peak_bytes"] == room // 4096 * 4096
    assert act["to_nvme_bytes"] > 0 and act["nvme_bytes_written"] == act["nvme_bytes_read"] == 3 * act["to_nvme_bytes"]
