"""activation_offload ([Note: saved activations] in offload/memory/activations.py): the
tensors autograd saves leave the device between a unit's forward and its backward, come back
unchanged (the run equals the one without, bit for bit), and every byte is where the
counters say: the device tier counts what stays, the host tier what waits in RAM, the
store's own NVMe tier what was written to swap."""
import errno

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import offload
from offload.gpt import GPT, GPTConfig
from offload.memory.activations import ACTIVATION_MIN_BYTES
from offload.memory.budget import minimum_device_budget, model_unit_sizes

from support import FaultyIO, assert_same_state, make_opt

# Activations of a block: 2 x 32 x 64 fp32 = 16 KiB per (batch, seq, d_model) tensor, above
# ACTIVATION_MIN_BYTES, so that most saved tensors move.
ACT_CFG = GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_heads=2, num_layers=5)


class CheckpointedGPT(GPT):
    """The GPT with every block under torch.utils.checkpoint."""

    def __init__(self, cfg, use_reentrant):
        super().__init__(cfg)
        self.use_reentrant = use_reentrant

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def data(n, cfg=ACT_CFG, batch=2):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g) for _ in range(n)]


def train(config, steps=4, checkpointed=None, cfg=ACT_CFG, inspect=None):
    """(losses, state_dict after every optimizer step, stats) of the GPT trained with
    ``config``; ``inspect(engine)`` runs between each forward and its backward."""
    torch.manual_seed(0)
    model = GPT(cfg) if checkpointed is None else CheckpointedGPT(cfg, checkpointed)
    losses, states = [], []
    accumulation = config.get("gradient_accumulation_steps", 1)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for i, b in enumerate(data(steps, cfg)):
            loss = engine(b[:, :-1], b[:, 1:])
            if inspect is not None:
                inspect(engine)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if (i + 1) % accumulation == 0:
                states.append(engine.state_dict())
        return losses, states, engine.stats()


def assert_same_run(a, b):
    assert a[0] == b[0], "losses differ"
    assert len(a[1]) == len(b[1])
    for sa, sb in zip(a[1], b[1]):
        assert_same_state(sa, sb)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_host_offload_trains_bit_for_bit_as_without(dtype, accumulation):
    config = dict(dtype=dtype, gradient_accumulation_steps=accumulation)
    plain = train(config)
    offloaded = train(dict(config, activation_offload="host"))
    assert_same_run(plain, offloaded)
    act = offloaded[2]["activations"]
    # every unit's saved tensors but the last's left the device, and came back
    assert act["to_host_bytes"] > act["kept_bytes"] > 0
    assert act["moved_to_host_bytes"] == act["returned_bytes"] == 4 * act["to_host_bytes"]
    assert act["to_nvme_bytes"] == act["nvme_bytes_written"] == 0
    assert plain[2]["activations"]["moved_to_host_bytes"] == 0


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_host_offload_with_activation_checkpointing(use_reentrant):
    plain = train({}, steps=3, checkpointed=use_reentrant)
    offloaded = train(dict(activation_offload="host"), steps=3, checkpointed=use_reentrant)
    assert_same_run(plain, offloaded)
    act = offloaded[2]["activations"]
    if use_reentrant:
        # the checkpointed inputs, saved by torch after each block ran, leave with its group
        assert act["to_host_bytes"] >= (ACT_CFG.num_layers - 1) * 2 * ACT_CFG.seq_len * ACT_CFG.d_model * 4
    assert act["moved_to_host_bytes"] == act["returned_bytes"]


def test_nvme_offload_writes_the_moved_bytes_to_swap_and_stages_few(tmp_path):
    swap = tmp_path / "swap"
    plain = train({}, steps=3)
    offloaded = train(dict(activation_offload="nvme", swap_dir=str(swap)), steps=3)
    assert_same_run(plain, offloaded)
    act = offloaded[2]["activations"]
    assert act["to_host_bytes"] == 0 and act["to_nvme_bytes"] > 0
    # the store's own I/O engine wrote exactly the groups that left (whole pages), and read them back
    assert act["nvme_bytes_written"] == act["written_to_nvme_bytes"] == act["nvme_bytes_read"]
    assert act["moved_to_nvme_bytes"] == 3 * act["to_nvme_bytes"] == act["returned_bytes"]
    assert 0 <= act["written_to_nvme_bytes"] - act["moved_to_nvme_bytes"] < 3 * ACT_CFG.num_layers * 4096
    # the host staged at most two groups at a time, never the whole forward's
    assert 0 < act["host_peak_bytes"] < act["to_nvme_bytes"]
    assert act["nvme_peak_bytes"] == act["written_to_nvme_bytes"] // 3
    assert act["host_bytes"] == act["nvme_bytes"] == 0
    assert not any(swap.iterdir()), "the swap files are removed on close"


def test_nvme_swap_space_does_not_grow_with_changing_shapes(tmp_path):
    """Extents are reused by the smallest that holds a group: batches of alternating
    lengths leave the activations' swap space at the size the first two steps made it."""
    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    config = dict(activation_offload="nvme", swap_dir=str(tmp_path / "swap"))
    sizes = []
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for i, b in enumerate(data(6)):
            b = b[:, :ACT_CFG.seq_len // 2 + 1] if i % 2 else b
            engine.backward(engine(b[:, :-1], b[:, 1:]))
            engine.step()
            sizes.append(engine.debug.activations.nvme.space.capacity_bytes)
        assert engine.stats()["activations"]["nvme_bytes"] == 0
    assert sizes[1] > 0 and sizes[1:] == [sizes[1]] * 5


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_offload_beside_speculative_updates_and_evicting_units(mode, tmp_path):
    """States on NVMe with clipping (speculative early updates during backward), compute
    copies on NVMe under a device budget that evicts: the saved activations move beside
    all of it and the run is the same, bit for bit."""
    base = dict(param_tier="nvme", optimizer_tier="nvme", max_grad_norm=0.5, swap_dir=str(tmp_path / "swap"),
                device_budget=1_300_000)
    plain = train(base, steps=3)
    offloaded = train(dict(base, activation_offload=mode), steps=3)
    assert_same_run(plain, offloaded)
    assert offloaded[2]["speculative_updates"] > 0
    act = offloaded[2]["activations"]
    assert act["to_host_bytes" if mode == "host" else "to_nvme_bytes"] > 0
    assert offloaded[2]["device_peak_bytes"] <= 1_300_000


def test_host_offload_writes_nothing_to_disk(tmp_path):
    offloaded = train(dict(activation_offload="host", param_tier="nvme", optimizer_tier="nvme",
                           swap_dir=str(tmp_path / "swap")), steps=2)
    plain = train(dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap")), steps=2)
    assert_same_run(plain, offloaded)
    assert offloaded[2]["bytes_written_nvme"] == plain[2]["bytes_written_nvme"]
    assert offloaded[2]["activations"]["nvme_bytes_written"] == 0


def test_every_saved_tensor_is_counted_once():
    """kept + moved bytes of a forward equal the bytes plain autograd saves in the same
    forward of the unwrapped model (parameters aside, each saved tensor once), counted by
    saved-tensor hooks of the test's own."""
    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in parameters:
            saved[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)] = \
                t.numel() * t.element_size()
        return t

    b = data(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(b[:, :-1], b[:, 1:])
    for mode in ("host", "auto"):
        act = train(dict(activation_offload=mode), steps=1)[2]["activations"]
        assert act["kept_bytes"] + act["to_host_bytes"] == sum(saved.values())


def test_the_device_tier_counts_what_stays_and_not_what_left():
    """Between forward and backward the device tier holds exactly the kept bytes; every
    moved group's tensors are gone from it; after backward nothing is held."""
    seen = []

    def inspect(engine):
        device, act = engine.debug.device, engine.stats()["activations"]
        seen.append((device.activation_bytes, act["kept_bytes"], act["to_host_bytes"], engine.debug.host.used_bytes))

    plain_host = []
    train(dict(activation_offload="host"), steps=2, inspect=inspect)
    train({}, steps=1, inspect=lambda e: plain_host.append(e.debug.host.used_bytes))
    for held, kept, moved, host_used in seen:
        assert held == kept > 0
        assert moved > 0
        assert host_used >= plain_host[0] + moved  # the moved bytes wait in the host tier


def test_kept_activations_count_against_device_budget():
    """With a budget set, the device tier's peak (compute copies, gradients, activations)
    stays within it, compute copies fetched ahead making room for activations; a budget the
    kept activations cannot fit in (every compute copy on the device for good) is an error
    naming it."""
    unbounded = train(dict(activation_offload="host", param_tier="host"), steps=1)
    budget = unbounded[2]["device_peak_bytes"]
    for tight in (budget, budget - unbounded[2]["activations"]["device_peak_bytes"] // 2):
        bounded = train(dict(activation_offload="host", param_tier="host", device_budget=tight), steps=2)
        assert bounded[2]["activations"]["device_peak_bytes"] > 0
        assert bounded[2]["device_peak_bytes"] <= tight
    resident = train(dict(param_tier="device"), steps=1)[2]["device_peak_bytes"]  # units and gradients only
    with pytest.raises(RuntimeError, match="device_budget.*saved activations of unit"):
        train(dict(activation_offload="host", param_tier="device", device_budget=resident), steps=1)


def test_auto_moves_nothing_when_everything_fits():
    plain = train({}, steps=2)
    for budget in (None, 64 << 20):
        auto = train(dict(activation_offload="auto", device_budget=budget), steps=2)
        assert_same_run(plain, auto)
        act = auto[2]["activations"]
        assert act["moved_to_host_bytes"] == act["moved_to_nvme_bytes"] == act["returned_bytes"] == 0
        assert act["kept_bytes"] == act["device_peak_bytes"] > 0


def test_auto_moves_the_earliest_units_only_as_needed():
    """Under a budget whose room for activations (beyond the compute copies wrap guarantees,
    budget.activation_room_bytes) lies between what keeping everything and moving every
    unit but the last keep, "auto" moves some groups, fewer bytes than "host", stays within
    the budget, and computes the same numbers."""
    base = dict(param_tier="host")
    move_all = train(dict(base, activation_offload="host"), steps=1)
    act = move_all[2]["activations"]
    floor = minimum_device_budget(model_unit_sizes(GPT(ACT_CFG), 4), "host", 4)
    budget = floor + act["kept_bytes"] + act["to_host_bytes"] // 2
    plain = train(base, steps=3)
    auto = train(dict(base, activation_offload="auto", device_budget=budget), steps=3)
    assert_same_run(plain, auto)
    act = auto[2]["activations"]
    assert 0 < act["to_host_bytes"] < move_all[2]["activations"]["to_host_bytes"]
    assert act["moved_to_host_bytes"] == act["returned_bytes"]
    assert auto[2]["device_peak_bytes"] <= budget


def test_activation_offload_config_is_checked():
    with pytest.raises(ValueError, match="activation_offload"):
        offload.OffloadConfig(activation_offload="disk")
    with pytest.raises(ValueError, match="swap_dir"):
        offload.OffloadConfig(activation_offload="nvme")
    assert offload.OffloadConfig(activation_offload="host").activation_offload == "host"


def test_small_tensors_stay():
    """A model whose saved tensors are all under ACTIVATION_MIN_BYTES moves nothing."""
    tiny = GPTConfig(vocab_size=16, seq_len=4, d_model=16, num_heads=2, num_layers=2)
    assert 2 * tiny.seq_len * tiny.d_model * 4 < ACTIVATION_MIN_BYTES
    act = train(dict(activation_offload="host"), steps=1, cfg=tiny)[2]["activations"]
    assert act["moved_to_host_bytes"] == 0 and act["kept_bytes"] > 0


@pytest.mark.parametrize("early", [False, True], ids=["no-early-updates", "early-updates"])
def test_a_failed_activation_read_fails_that_backward_by_the_engines_rule(early, tmp_path):
    """The swap read of a group fails in backward: the OSError names the unit and the swap
    file. The engine's rule for a failed backward ([Note: failures inside a step]) applies:
    with no unit updated yet (max_grad_norm: no early updates on host states) the gradients
    are dropped, no step is taken, and the next batch trains as if the failed one never ran;
    where a unit was updated early during that backward the engine stops until a
    checkpoint is loaded."""
    config = dict(activation_offload="nvme", swap_dir=str(tmp_path / "swap"))
    if not early:
        config["max_grad_norm"] = 1.0
    batches = data(3)
    torch.manual_seed(0)
    reference_model = GPT(ACT_CFG)
    with offload.wrap(reference_model, make_opt(reference_model.parameters()), config=config) as engine:
        for b in (batches[0], batches[2]):
            engine.backward(engine(b[:, :-1], b[:, 1:]))
            engine.step()
        expected = engine.state_dict()
    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        b = batches[0]
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()
        store = engine.debug.activations
        store.nvme.io = FaultyIO(store.nvme.io, errno.EIO, fail_read=1)
        b = batches[1]
        loss = engine(b[:, :-1], b[:, 1:])
        named = r"saved activations of unit 'blocks\.\d' from .*swap-\d+\.bin"
        with pytest.raises(OSError, match=named):
            engine.backward(loss)
        store.nvme.io = store.nvme.io.inner
        del loss
        if early:
            with pytest.raises(offload.EngineFailedError, match=named + ".*load_checkpoint"):
                engine.step()
            return
        engine.step()  # a no-op: the gradients were dropped
        b = batches[2]
        engine.backward(engine(b[:, :-1], b[:, 1:]))
        engine.step()
        assert_same_state(engine.state_dict(), expected)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_models_train_bit_for_bit_with_host_offload(kind, checkpointing):
    """Tiny transformers models (rotary buffers, grouped-query attention; GPT-2's dropout
    masks, which are saved tensors too), with and without their own gradient checkpointing."""
    import warnings

    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        build = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        build = transformers.GPT2LMHeadModel
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 128, (2, 48), generator=g) for _ in range(3)]

    def run(offload_config):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build(config)
            model.train()
            if checkpointing:
                model.gradient_checkpointing_enable()
        losses, states = [], []
        with offload.wrap(model, make_opt(model.parameters()), config=offload_config) as engine:
            for b in batches:
                loss = engine(input_ids=b, labels=b).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                states.append(engine.state_dict())
            return losses, states, engine.stats()

    plain = run({})
    offloaded = run(dict(activation_offload="host"))
    assert_same_run(plain, offloaded)
    act = offloaded[2]["activations"]
    assert act["moved_to_host_bytes"] == act["returned_bytes"]
    if not checkpointing:
        assert act["to_host_bytes"] > 0


def test_export_trace_shows_the_activation_copies_and_their_swap_requests(tmp_path):
    import json

    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=dict(activation_offload="nvme", swap_dir=str(tmp_path / "swap"))) as engine:
        for b in data(2):
            engine.backward(engine(b[:, :-1], b[:, 1:]))
            engine.step()
        engine.export_trace(str(tmp_path / "trace.json"))
        written = engine.stats()["activations"]["nvme_bytes_written"]
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    lanes = [e["name"].split()[0] for e in events if e["cat"] == "activations"]
    # per step: every block's group but the last's goes out and comes back (the root's
    # holds only the token ids, under ACTIVATION_MIN_BYTES: it has nothing to move)
    assert lanes.count("out") == lanes.count("back") == 2 * (ACT_CFG.num_layers - 1)
    assert sum(1 for e in events if e["cat"] == "nvme write") >= 2 * (ACT_CFG.num_layers - 1) and written > 0


def test_a_failed_activation_write_fails_that_forward_and_the_next_one_trains(tmp_path):
    """The swap write of a group fails: the forward that wrote it raises an OSError naming
    the unit and the swap file, and is abandoned; the next forward and backward train as
    if the failed one never ran."""
    config = dict(activation_offload="nvme", swap_dir=str(tmp_path / "swap"))
    batches = data(2)
    plain = train(config, steps=1)  # batches[0] only
    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        store = engine.debug.activations
        store.nvme.io = FaultyIO(store.nvme.io, errno.EIO, fail_write=2)
        b = batches[1]
        with pytest.raises(OSError, match=r"writing the saved activations of unit '[a-z.0-9]+' to .*swap-\d+\.bin"):
            engine(b[:, :-1], b[:, 1:])
        store.nvme.io = store.nvme.io.inner
        b = batches[0]
        loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
        assert loss.item() == plain[0][0]
        assert_same_state(engine.state_dict(), plain[1][0])


def test_host_buffers_stay_within_host_budget_and_go_on_to_nvme_beyond_it(tmp_path):
    """The host buffers of the activations hold at most what host_budget leaves beside the
    engine's plan (stats: host_room_bytes); beyond it the earliest groups of the forward go
    on to NVMe under swap_dir, and the run is still the one without offload, bit for bit.
    Without swap_dir a budget too small for them is a ValueError naming host_budget, raised
    in that forward before the group it could not place moved."""
    generous = 1 << 30
    probe = train(dict(activation_offload="host", host_budget=generous), steps=1)[2]["activations"]
    planned = generous - probe["host_room_bytes"]
    group_bytes = max(u["moved_bytes"] for u in probe["units"]) + 4096  # a group's buffer, whole pages
    budget = planned + 2 * group_bytes  # room for two of the four groups that leave
    plain = train(dict(host_budget=budget), steps=3)
    offloaded = train(dict(activation_offload="host", host_budget=budget, swap_dir=str(tmp_path / "swap")), steps=3)
    assert_same_run(plain, offloaded)
    act = offloaded[2]["activations"]
    assert act["host_room_bytes"] == budget - planned
    assert 0 < act["host_peak_bytes"] <= act["host_room_bytes"]
    assert offloaded[2]["host_peak_bytes"] <= budget
    where = [u["where"] for u in act["units"] if u["where"] != "keep"]
    assert where == ["nvme", "nvme", "host", "host"]  # the earliest went on, the latest stayed
    assert act["to_nvme_bytes"] > 0 and act["nvme_bytes_written"] == act["written_to_nvme_bytes"] > 0
    assert act["moved_to_host_bytes"] + act["moved_to_nvme_bytes"] == act["returned_bytes"]
    assert not [p for p in (tmp_path / "swap").rglob("*") if p.is_file()]
    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    with offload.wrap(model, make_opt(model.parameters()),
                      config=dict(activation_offload="host", host_budget=planned + group_bytes // 2)) as engine:
        b = data(1)[0]
        with pytest.raises(ValueError, match=r"host_budget: the saved activations of unit 'blocks\.\d'.*swap_dir"):
            engine(b[:, :-1], b[:, 1:])
        assert engine.stats()["activations"]["host_bytes"] == 0


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_device_pages_given_back_change_no_number(mode, tmp_path):
    """[Note: device pages follow the slots] An arena of more than 2 MiB whose units are
    evicted and fetched again: the pages of every freed slot go back to the kernel, and the
    run is the one without activation offload (whose arena keeps its pages), bit for bit."""
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=128, num_heads=2, num_layers=4)
    base = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(tmp_path / "swap"), device_budget=3 << 20)
    follows = []
    plain = train(base, steps=3, cfg=cfg)
    offloaded = train(dict(base, activation_offload=mode), steps=3, cfg=cfg,
                      inspect=lambda e: follows.append(e.debug.device.pages_follow_slots))
    assert follows == [True] * 3
    assert_same_run(plain, offloaded)
    assert offloaded[2]["activations"]["to_host_bytes" if mode == "host" else "to_nvme_bytes"] > 0


class _ThreeReaders(torch.nn.Module):
    """A block whose three Linears read one 3-D input (each saves its own 2-D view of the
    same bytes, as a Llama's q, k and v projections do) and whose complex product saves a
    tensor and its lazy conjugate (the same bytes, read otherwise)."""

    def __init__(self, width):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        h = self.q(x) * self.k(x) + self.v(x)
        c = torch.complex(h, 0.5 * h)
        return x + (c * c.conj()).real


class _ReadersNet(torch.nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ThreeReaders(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def test_views_of_the_same_bytes_are_copied_once_and_a_conjugate_is_not_taken_for_them():
    """[Note: saved activations] "Once": the three Linears' views of one input are one
    record (each forward's kept + moved bytes are what plain autograd saves, counted once
    per storage, offset, shape, strides and dtype), while a lazy conjugate of a saved
    tensor, over the same bytes, is a record of its own: the run equals the one without
    offload, bit for bit."""
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))

    def run(config):
        torch.manual_seed(0)
        model = _ReadersNet()
        losses, states = [], []
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            for _ in range(3):
                loss = engine(x)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                states.append(engine.state_dict())
            return losses, states, engine.stats()

    torch.manual_seed(0)
    model = _ReadersNet()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, conjugates = {}, 0

    def pack(t):
        nonlocal conjugates
        if t.untyped_storage().data_ptr() not in parameters:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                   t.is_conj())
            saved[key] = t.numel() * t.element_size()
            conjugates += t.is_conj()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    assert conjugates > 0
    plain = run({})
    offloaded = run(dict(activation_offload="host"))
    assert_same_run(plain, offloaded)
    act = offloaded[2]["activations"]
    assert act["to_host_bytes"] > 0
    assert act["kept_bytes"] + act["to_host_bytes"] == sum(saved.values())


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_a_graph_dropped_without_backward_lets_go_of_its_activations(mode, tmp_path):
    """[Note: saved activations] (cycles): a forward under grad mode whose loss is dropped
    without backward (an evaluation that forgot no_grad; a forward that raised) lets go of
    every record at once, the saved outputs' too: nothing stays counted on the device or
    held in host RAM or swap, and the next step trains as if it never ran."""
    config = dict(activation_offload=mode, swap_dir=str(tmp_path / "swap"))
    plain = train(config, steps=1)
    torch.manual_seed(0)
    model = GPT(ACT_CFG)
    b = data(1)[0]
    with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
        for _ in range(2):
            loss = engine(b[:, :-1], b[:, 1:])
            act = engine.stats()["activations"]
            assert act["device_bytes"] > 0 and act["to_host_bytes" if mode == "host" else "to_nvme_bytes"] > 0
            del loss  # no backward, no gc.collect(): reference counts alone free the graph
            act = engine.stats()["activations"]
            assert act["device_bytes"] == act["host_bytes"] == act["nvme_bytes"] == 0
            assert engine.debug.device.activation_bytes == 0
        loss = engine(b[:, :-1], b[:, 1:])
        engine.backward(loss)
        engine.step()
        assert loss.item() == plain[0][0]
        assert_same_state(engine.state_dict(), plain[1][0])


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_q_k_v_views_with_gaps_leave_once_as_the_span_of_their_fused_projection(mode, tmp_path, monkeypatch):
    """[Note: saved activations] The GPT's attention saves q, k and v: views with gaps into
    one qkv output (each row holds q's, k's and v's parts side by side). They leave the device
    together as one span, the qkv output's bytes, copied once, and come back as views of one
    fresh storage with their own strides and offsets: the run equals the one without offload,
    bit for bit. The bytes: against the same run with view_spans taken away (q, k and v then
    stay on the device, as before), each block group that leaves moves exactly the qkv
    output's bytes more, its host buffer and its swap writes grow by as much, and the
    counters say so (views_moved_bytes; views_kept_bytes without it)."""
    import offload.memory.activations as activations

    config = dict(activation_offload=mode, swap_dir=str(tmp_path / "swap"))
    steps = 3
    qkv_bytes = 2 * ACT_CFG.seq_len * 3 * ACT_CFG.d_model * 4  # batch 2, fp32
    plain = train({}, steps=steps)
    spans = train(config, steps=steps)
    assert_same_run(plain, spans)
    with monkeypatch.context() as m:
        m.setattr(activations, "view_spans", lambda views: [])
        without = train(config, steps=steps)
    assert_same_run(plain, without)
    act, before = spans[2]["activations"], without[2]["activations"]
    moved_groups = [u for u in act["units"] if u["where"] != "keep"]
    assert len(moved_groups) == ACT_CFG.num_layers - 1  # every block's but the last
    for u, v in zip(act["units"], before["units"]):
        assert u["saved_bytes"] == v["saved_bytes"]
        assert u["moved_bytes"] - v["moved_bytes"] == (qkv_bytes if u["where"] != "keep" else 0)
    extra = len(moved_groups) * qkv_bytes
    assert act["views_moved_bytes"] == steps * extra and act["views_kept_bytes"] == 0
    assert before["views_moved_bytes"] == 0 and before["views_kept_bytes"] == extra
    assert before["kept_bytes"] - act["kept_bytes"] == extra
    assert act["device_peak_bytes"] < before["device_peak_bytes"]
    # the host buffers (a whole block group's layout: qkv_bytes is whole pages) and the swap writes
    if mode == "host":
        assert act["host_peak_bytes"] - before["host_peak_bytes"] == extra
        assert act["moved_to_host_bytes"] == steps * act["to_host_bytes"]
    else:
        assert act["host_peak_bytes"] - before["host_peak_bytes"] == 2 * qkv_bytes  # two groups staged
        assert act["nvme_bytes_written"] - before["nvme_bytes_written"] == steps * extra
        assert act["nvme_bytes_written"] == act["written_to_nvme_bytes"] == act["nvme_bytes_read"]
    assert act["returned_bytes"] == steps * act[f"to_{mode}_bytes"]


class _OneStridedView(torch.nn.Module):
    """A block that saves one view with gaps (every other column of its Linear's output):
    its span holds the columns between, which nothing saves."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            a = block(x)
            s = a[..., ::2]
            x = a + (s * s).sum(-1, keepdim=True)
        return x.square().mean()


def test_a_view_whose_span_holds_unsaved_bytes_stays_and_is_counted():
    """[Note: saved activations] A view with gaps whose span holds bytes no saved view reads
    (every other column of a tensor) stays on the device (moving its span would move twice
    its bytes and free nothing the rest of its storage holds): counted in views_kept_bytes,
    the run bit for bit the one without offload."""
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1))

    def run(config):
        torch.manual_seed(0)
        model = _OneStridedView()
        losses = []
        with offload.wrap(model, make_opt(model.parameters()), config=config) as engine:
            for _ in range(2):
                loss = engine(x)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return losses, engine.state_dict(), engine.stats()

    plain = run({})
    offloaded = run(dict(activation_offload="host"))
    assert offloaded[0] == plain[0]
    assert_same_state(offloaded[1], plain[1])
    act = offloaded[2]["activations"]
    view_bytes = 2 * 32 * 32 * 4  # s: every other of 64 columns, fp32
    assert act["views_kept_bytes"] == 2 * view_bytes  # blocks 0 and 1 leave; block 2's group stays whole
    assert act["views_moved_bytes"] == 0 and act["to_host_bytes"] > 0
