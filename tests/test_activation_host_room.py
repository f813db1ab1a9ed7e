"""[Note: activation host room] (offload/memory/budget.py): host_budget is shared between the
engine's own host needs, "auto" placement included, and the saved activations' host buffers.
activation_host_bytes is the activations' share: placement never takes it, so "auto" tiers
with activation_offload stay within host_budget and keep the activations in RAM where the
budget has room for them, and `offload plan --seq-len` gives the share and agrees with wrap."""
import json

import pytest
import torch

import offload
from offload import plan
from offload.cli import main
from offload.gpt import GPT, GPTConfig
from offload.memory.budget import UnitSizes, check_host_budget, minimum_host_budget
from offload.plan_activations import activation_host_share, plan_activations

from support import make_opt

CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=2, num_layers=5)
BATCH = 2
# Above what the engine keeps in RAM with every "auto" role on NVMe plus the activations of
# one forward, below what placing every role in RAM takes: "auto" placement fills it.
HOST_BUDGET = 4_200_000


def gpt():
    return GPT(CFG)


def train(config, steps=3):
    """(losses, stats, placement, the host bytes wrap planned) of the GPT trained with ``config``."""
    torch.manual_seed(0)
    model = gpt()
    g = torch.Generator().manual_seed(7)
    losses = []
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        planned = check_host_budget([UnitSizes.of(u) for u in engine.units], engine.layout).total
        for _ in range(steps):
            b = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
            loss = engine(b[:, :-1], b[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, engine.stats(), engine.placement(), planned


def test_auto_placement_leaves_the_activations_their_share_of_host_budget(tmp_path):
    config = dict(activation_offload="host", host_budget=HOST_BUDGET, swap_dir=str(tmp_path / "swap"))
    share = activation_host_share(gpt, config, CFG.seq_len, BATCH)
    unbounded = plan_activations(gpt, dict(config, host_budget=None), CFG.seq_len, BATCH)
    assert share == unbounded.host_needed_bytes == unbounded.host_peak_bytes > 0  # the budget has room for all

    # Without a share "auto" placement takes the room: groups that had it go on to NVMe.
    with pytest.warns(RuntimeWarning, match="activation_host_bytes"):
        taken = train(config)
    act = taken[1]["activations"]
    assert act["host_room_bytes"] < share and act["to_nvme_bytes"] > 0
    assert taken[3] + act["host_peak_bytes"] <= HOST_BUDGET

    shared = dict(config, activation_host_bytes=share)
    predicted = plan_activations(gpt, shared, CFG.seq_len, BATCH)
    plain = train(dict(host_budget=HOST_BUDGET, swap_dir=str(tmp_path / "swap")))
    losses, stats, placement, planned = train(shared)
    act = stats["activations"]
    # every group that leaves is in RAM, none on NVMe, and the run is the one without offload
    assert losses == plain[0]
    assert act["to_nvme_bytes"] == act["moved_to_nvme_bytes"] == act["nvme_bytes_written"] == 0
    assert act["to_host_bytes"] == predicted.moved_bytes("host") > 0
    assert [dict(u) for u in act["units"]] == [vars(g) for g in predicted.groups]
    # byte accounting: the placement's plan and the activations' buffers within host_budget
    assert planned <= HOST_BUDGET - share
    assert act["host_room_bytes"] == predicted.host_room_bytes == HOST_BUDGET - planned >= share
    assert act["host_peak_bytes"] == predicted.host_peak_bytes == share
    assert planned + act["host_peak_bytes"] <= HOST_BUDGET and stats["host_peak_bytes"] <= HOST_BUDGET
    # placement still uses the rest: some roles in RAM, fewer than without the share
    assert 0 < placement.bytes_per_tier()["host"] < taken[2].bytes_per_tier()["host"]
    # offload plan's placement is wrap's
    shape = plan.shape_from_module(gpt(), "gpt")
    assert plan.auto_placement(shape, shared)[0] == placement
    assert not [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]


def test_the_share_counts_where_gradients_spill(tmp_path):
    """Where the engine's own needs pass their part of host_budget, gradients spill within
    that part: the activations keep their share (without one the gradients hold that RAM and
    activations go on to NVMe)."""
    config = dict(activation_offload="host", param_tier="nvme", optimizer_tier="nvme",
                  swap_dir=str(tmp_path / "swap"))
    probe = plan_activations(gpt, dict(config, host_budget=None), CFG.seq_len, BATCH)
    share = probe.host_needed_bytes
    torch.manual_seed(0)
    model = gpt()
    with offload.wrap(model, make_opt(model.parameters()), config=dict(config, host_budget=None)) as engine:
        # the engine's own least needs: without what Layout keeps for activations (the piece floor)
        floor = minimum_host_budget([UnitSizes.of(u) for u in engine.units], engine.layout) \
            - engine.layout.activation_host_bytes
    # a few units' gradients at most in RAM beside the activations' share
    budget = floor + share + (64 << 10)
    spilling = dict(config, host_budget=budget, activation_host_bytes=share)
    losses, stats, _, _ = train(spilling)
    plain = train(dict(config, host_budget=budget, activation_offload=None))
    assert losses == plain[0]
    act = stats["activations"]
    assert stats["spilled_gradient_bytes"] > 0
    assert act["host_room_bytes"] == share == act["host_peak_bytes"]
    assert act["to_nvme_bytes"] == 0
    assert stats["host_peak_bytes"] <= budget
    assert plan_activations(gpt, spilling, CFG.seq_len, BATCH).host_room_bytes == share
    unshared = plan_activations(gpt, dict(spilling, activation_host_bytes=None), CFG.seq_len, BATCH)
    assert unshared.host_room_bytes < share and unshared.moved_bytes("nvme") > 0


def test_activation_host_bytes_is_checked():
    with pytest.raises(ValueError, match="activation_host_bytes: .*activation_offload"):
        offload.OffloadConfig(activation_host_bytes="1MiB")
    with pytest.raises(ValueError, match="activation_host_bytes: .*host_budget"):
        offload.OffloadConfig(activation_offload="host", host_budget="1MiB", activation_host_bytes="2MiB")
    with pytest.raises(ValueError, match="activation_host_bytes"):
        offload.OffloadConfig(activation_offload="host", activation_host_bytes="lots")
    # explicit tiers: the engine's own needs must fit beside the share, else host_budget is named
    torch.manual_seed(0)
    model = gpt()
    with pytest.raises(ValueError, match=r"host_budget: .* less activation_host_bytes"):
        offload.wrap(model, make_opt(model.parameters()),
                     config=dict(activation_offload="host", param_tier="host", optimizer_tier="host",
                                 host_budget=HOST_BUDGET, activation_host_bytes=HOST_BUDGET - 1000))


def test_cli_reserves_the_predicted_share_and_places_beside_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "offload.gpt:GPT", "--seq-len", "64", "--batch", "2", "--activation-offload", "host",
            "--host-budget", "60MiB", "--swap-dir", str(tmp_path), "--dtype", "bf16", "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    act, auto = saved["activations"], saved["auto"]
    config = dict(device="cpu", dtype="bf16", activation_offload="host", host_budget=60 << 20, swap_dir=str(tmp_path))
    share = activation_host_share("offload.gpt:GPT", config, 64, 2)
    assert act["host_share_bytes"] == act["host_needed_bytes"] == act["host_peak_bytes"] == share > 0
    assert auto["activation_host_bytes"] == share and act["to_nvme_bytes"] == 0
    assert f"activation_host_bytes={share}" in text and "kept for activations" in text
    shape = plan.shape_from_model("offload.gpt:GPT")
    placed = plan.auto_placement(shape, dict(config, activation_host_bytes=share))[0]
    assert [tuple(u.values()) for u in auto["units"]] == [tuple(vars(u).values()) for u in placed.units]


def test_activations_sent_to_nvme_for_want_of_room_warn_once_at_the_first_step(tmp_path):
    """[Note: activation host room] With no activation_host_bytes, "auto" placement takes the
    host room and the first forward's earliest groups go on to NVMe: that forward warns,
    once, naming activation_host_bytes and the bytes that went to disk; later steps do not
    warn again. With the share set (nothing goes to disk), with everything fitting, and with
    "nvme" (asked for, not for want of room) no step warns."""
    import gc
    import warnings

    def warnings_per_step(config, steps=3):
        """(the activation warnings of each step's forward, of its backward and step, stats)."""
        torch.manual_seed(0)
        model = gpt()
        g = torch.Generator().manual_seed(7)
        seen = []
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            for _ in range(steps):
                b = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
                with warnings.catch_warnings(record=True) as in_forward:
                    warnings.simplefilter("always")
                    loss = engine(b[:, :-1], b[:, 1:])
                    forward_nvme = engine.stats()["activations"]["to_nvme_bytes"]
                with warnings.catch_warnings(record=True) as after:
                    warnings.simplefilter("always")
                    engine.backward(loss)
                    engine.step()
                seen.append(([str(w.message) for w in in_forward if "activation_host_bytes" in str(w.message)],
                             [str(w.message) for w in after if "activation_host_bytes" in str(w.message)],
                             forward_nvme))
            return seen, engine.stats()

    swap = str(tmp_path / "swap")
    for mode in ("host", "auto"):
        config = dict(activation_offload=mode, host_budget=HOST_BUDGET, swap_dir=swap)
        if mode == "auto":
            config["device_budget"] = 1_900_000  # "auto" moves three groups, the host room holds two
        seen, stats = warnings_per_step(config)
        (first, first_after, first_nvme), rest = seen[0], seen[1:]
        assert first_nvme > 0 and stats["activations"]["moved_to_nvme_bytes"] > 0
        assert len(first) == 1 and not first_after
        assert f"{first_nvme} bytes of this forward's saved activations" in first[0]
        assert "activation_host_bytes" in first[0] and "offload plan" in first[0]
        assert all(not w and not a and nvme == first_nvme for w, a, nvme in rest)  # the same bytes, no warning
    share = activation_host_share(gpt, dict(activation_offload="host", host_budget=HOST_BUDGET, swap_dir=swap),
                                  CFG.seq_len, BATCH)
    quiet = [dict(activation_offload="host", host_budget=HOST_BUDGET, swap_dir=swap, activation_host_bytes=share),
             dict(activation_offload="host", swap_dir=swap),  # no host budget: everything fits
             dict(activation_offload="nvme", host_budget=HOST_BUDGET, swap_dir=swap)]
    # a forward interrupted after groups went to NVMe (Hooks.abort_forward ends its pass)
    # warns of nothing, so that a warning filter set to raise cannot hide the interrupt; its
    # graph gone, its host buffers are free, and the next forward that sends groups there warns
    torch.manual_seed(0)
    model = gpt()
    b = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=torch.Generator().manual_seed(7))
    with offload.wrap(model, make_opt(model.parameters()),
                      config=dict(activation_offload="host", host_budget=HOST_BUDGET, swap_dir=swap)) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with offload.faults.inject("hooks.forward", offload.faults.raising(KeyboardInterrupt),
                                       at=CFG.num_layers):
                with pytest.raises(KeyboardInterrupt):
                    engine(b[:, :-1], b[:, 1:])
        assert engine.stats()["activations"]["to_nvme_bytes"] > 0
        assert not [w for w in caught if "activation_host_bytes" in str(w.message)]
        gc.collect()  # the interrupt's traceback, a cycle, held the abandoned graph
        assert engine.stats()["activations"]["host_bytes"] == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = engine(b[:, :-1], b[:, 1:])
        assert len([w for w in caught if "activation_host_bytes" in str(w.message)]) == 1
        engine.backward(loss)
        engine.step()
    for config in quiet:
        seen, stats = warnings_per_step(config, steps=2)
        assert all(not w and not a for w, a, _ in seen), config
        if config["activation_offload"] == "nvme":
            assert stats["activations"]["moved_to_nvme_bytes"] > 0
        else:
            assert stats["activations"]["moved_to_nvme_bytes"] == 0
    assert not [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]
    assert not [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]


# "auto" placement leaves 86,720 bytes of host room beside its plan at this budget without a
# floor, less than one block's group of saved activations (278,528 bytes, q, k and v included).
TIGHT_BUDGET = 3_000_000
GROUP_BYTES = 278_528


def _swap_files(tmp_path):
    return [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]


def _tight_run(mode, tmp_path):
    """Activations offloaded (``mode``) at TIGHT_BUDGET beside the same run without offload:
    (the plain run, offload plan's prediction, losses, stats, planned host bytes)."""
    config = dict(activation_offload=mode, host_budget=TIGHT_BUDGET, swap_dir=str(tmp_path / "swap"))
    if mode == "auto":
        config["device_budget"] = 1_900_000  # moves groups off the device
    plain = train(dict(host_budget=TIGHT_BUDGET, swap_dir=str(tmp_path / "swap")))
    predicted = plan_activations(gpt, config, CFG.seq_len, BATCH)
    with pytest.warns(RuntimeWarning, match="activation_host_bytes") if mode == "auto" else _no_warning():
        losses, stats, _, planned = train(config)
    return plain, predicted, losses, stats, planned


@pytest.mark.parametrize("mode", ["nvme", "auto"])
def test_nvme_and_auto_without_a_share_train_where_auto_placement_fills_host_budget(mode, tmp_path):
    """[Note: activation host room] At TIGHT_BUDGET "auto" placement took all but 86,720
    bytes of host room, and "nvme" (or "auto" moving groups beyond its device room) stopped
    at the first forward with a ValueError naming host_budget, after wrap had accepted the
    config. Layout now keeps ACTIVATION_PIECE_BYTES for activations that may reach NVMe:
    placement plans beside it, groups larger than that go in pieces through it, and the run
    is the one without offload."""
    from offload.memory.layout import ACTIVATION_PIECE_BYTES

    plain, predicted, losses, stats, planned = _tight_run(mode, tmp_path)
    act = stats["activations"]
    assert losses == plain[0]
    assert ACTIVATION_PIECE_BYTES <= act["host_room_bytes"] == predicted.host_room_bytes
    # the engine's own needs (gradients spilling where they pass their part) beside the room
    assert min(planned, TIGHT_BUDGET - ACTIVATION_PIECE_BYTES) + act["host_room_bytes"] == TIGHT_BUDGET
    assert [dict(u) for u in act["units"]] == [vars(g) for g in predicted.groups]
    to_nvme = act["to_nvme_bytes"]
    assert to_nvme == predicted.moved_bytes("nvme") > 0 and to_nvme % GROUP_BYTES == 0
    # three steps, every group written and read back whole (GROUP_BYTES is whole pages)
    assert act["nvme_bytes_written"] == act["written_to_nvme_bytes"] == act["nvme_bytes_read"] == 3 * to_nvme
    assert act["host_peak_bytes"] == predicted.host_peak_bytes <= act["host_room_bytes"]
    assert stats["host_peak_bytes"] <= TIGHT_BUDGET
    assert not _swap_files(tmp_path)


@pytest.mark.parametrize("mode", ["nvme", "auto"])
def test_a_group_larger_than_the_host_room_goes_to_nvme_in_pieces(mode, tmp_path, monkeypatch):
    """[Note: activation pieces] With the floor at 64 KiB, the host room at TIGHT_BUDGET
    (86,720 bytes) holds no whole group: each goes to its swap extent and back through one
    buffer of the room's whole pages (86,016 bytes), and the run is still the one without
    offload, bit for bit. The bytes: every group's are written once and read once a step,
    the host buffers never hold more than that piece, and offload plan predicts it."""
    import offload.memory.layout as layout_module

    monkeypatch.setattr(layout_module, "ACTIVATION_PIECE_BYTES", 64 << 10)
    plain, predicted, losses, stats, planned = _tight_run(mode, tmp_path)
    act = stats["activations"]
    assert losses == plain[0]
    room = act["host_room_bytes"]
    assert room == predicted.host_room_bytes == TIGHT_BUDGET - planned == 86_720 < GROUP_BYTES
    piece = room // 4096 * 4096
    assert act["host_peak_bytes"] == predicted.host_peak_bytes == piece
    assert [dict(u) for u in act["units"]] == [vars(g) for g in predicted.groups]
    moved = [u for u in act["units"] if u["where"] != "keep"]
    assert moved and all(u["where"] == "nvme" and u["moved_bytes"] == GROUP_BYTES for u in moved)
    to_nvme = act["to_nvme_bytes"]
    assert to_nvme == len(moved) * GROUP_BYTES
    assert act["nvme_bytes_written"] == act["written_to_nvme_bytes"] == act["nvme_bytes_read"] == 3 * to_nvme
    assert act["moved_to_nvme_bytes"] == 3 * to_nvme and act["moved_to_host_bytes"] == 0
    assert not _swap_files(tmp_path)


def test_failed_piece_io_fails_that_forward_or_backward_by_the_engines_rule(tmp_path, monkeypatch):
    """[Note: activation pieces] A piece's swap write that fails raises an OSError naming the
    unit and the swap file from the forward, nothing having left the device; a piece's read
    that fails raises one from the backward, whose gradients are dropped (max_grad_norm: no
    early updates), and the next batch trains as if the failed ones never ran."""
    import errno

    import offload.memory.layout as layout_module
    from support import FaultyIO, assert_same_state

    monkeypatch.setattr(layout_module, "ACTIVATION_PIECE_BYTES", 64 << 10)
    config = dict(activation_offload="nvme", host_budget=TIGHT_BUDGET, swap_dir=str(tmp_path / "swap"),
                  max_grad_norm=1.0)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g) for _ in range(3)]

    def run(engine, b):
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()

    torch.manual_seed(0)
    model = gpt()
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        run(engine, batches[0])
        run(engine, batches[2])
        expected = engine.state_dict()
    torch.manual_seed(0)
    model = gpt()
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        run(engine, batches[0])
        store = engine.debug.activations
        b = batches[1]
        store.nvme.io = FaultyIO(store.nvme.io, errno.EIO, fail_write=2)  # the first group's second piece
        with pytest.raises(OSError, match=r"writing the saved activations of unit 'blocks\.0' to .*swap-\d+\.bin"):
            engine(b[:, :-1], b[:, 1:])
        store.nvme.io = store.nvme.io.inner
        assert store.stats()["host_bytes"] == 0
        store.nvme.io = FaultyIO(store.nvme.io, errno.EIO, fail_read=1)
        loss = engine(b[:, :-1], b[:, 1:])
        with pytest.raises(OSError, match=r"reading the saved activations of unit 'blocks\.\d' from .*swap-\d+\.bin"):
            engine.backward(loss)
        store.nvme.io = store.nvme.io.inner
        del loss
        assert store.stats()["host_bytes"] == 0
        engine.step()  # a no-op: the gradients were dropped
        run(engine, batches[2])
        assert_same_state(engine.state_dict(), expected)
    assert not _swap_files(tmp_path)


def test_a_host_budget_without_room_for_a_piece_is_refused_at_wrap(tmp_path):
    """[Note: activation host room] host_budget at the engine's least host needs plus
    ACTIVATION_PIECE_BYTES trains with activations on NVMe; one byte less is a ValueError at
    wrap naming host_budget and the bytes, before anything is touched (it used to stop at the
    first forward)."""
    from offload.memory.budget import model_unit_sizes
    from offload.memory.layout import ACTIVATION_PIECE_BYTES
    from offload.memory.placement import minimum_state_host_bytes

    config = dict(activation_offload="nvme", swap_dir=str(tmp_path / "swap"))
    sizes = model_unit_sizes(gpt(), 4, (), None)
    least = minimum_state_host_bytes(offload.OffloadConfig.from_any(dict(config, host_budget=TIGHT_BUDGET)),
                                     torch.device("cpu"), None, sizes) + ACTIVATION_PIECE_BYTES
    losses, stats, placement, _ = train(dict(config, host_budget=least), steps=1)
    assert placement.bytes_per_tier()["host"] == 0 and stats["activations"]["to_nvme_bytes"] > 0
    torch.manual_seed(0)
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"host_budget: .*{least} bytes\) in RAM .*kept for activations"):
        offload.wrap(model, make_opt(model.parameters()), config=dict(config, host_budget=least - 1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not _swap_files(tmp_path)


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def block():
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            yield
    return block()
