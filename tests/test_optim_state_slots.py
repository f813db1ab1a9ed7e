"""Per-entry state slots ([Note: per-entry state slots] in offload/memory/state_slots.py): each
parameter's moments take only the slots its own optimizer keeps, in whole pages, so Muon's
matrices beside AdamW keep one fp32 tensor and Adafactor's factored matrices none; the bytes on
each tier are what torch keeps per parameter (to the page), the numbers stay plain PyTorch's."""
import copy
import dataclasses

import pytest
import torch

import offload
from offload.gpt import GPT, GPTConfig
from offload.memory.state_slots import PAGE_NUMEL, StateSlots

from support import batches, correctly_rounded_sqrt, gpt_loss, train_offload

# d_model 64: a block's matrices are whole pages (64 x 64 = 4 pages), its norms and biases are not
WIDE = GPTConfig(vocab_size=64, seq_len=16, d_model=64, num_heads=2, num_layers=2)
PAGE_BYTES = PAGE_NUMEL * 4
# six blocks: "auto" has host budgets between all on NVMe and all in RAM (test_memory_placement's gpt-wide)
DEEP = GPTConfig(vocab_size=128, seq_len=16, d_model=64, num_heads=4, num_layers=6)


def blocks_matrices(model):
    return [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]


def the_rest(m):
    return [p for p in m.parameters() if not any(p is q for q in blocks_matrices(m))]


OPTIMIZERS = {
    "muon+adamw": lambda m: [torch.optim.Muon(blocks_matrices(m), lr=0.02, weight_decay=0.1),
                             torch.optim.AdamW(the_rest(m), lr=1e-2, foreach=False)],
    "adafactor": lambda m: [torch.optim.Adafactor(m.parameters(), lr=0.01, foreach=False)],
}


def torch_state(model, opts, data):
    """For each parameter of ``model`` (by name): how many fp32 tensors shaped like it its
    optimizer keeps in plain PyTorch after ``data``'s steps."""
    for b in data:
        gpt_loss(model, b).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    state = {p: s for opt in opts for p, s in opt.state.items()}
    return {n: sum(isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0 for v in state[p].values())
            for n, p in model.named_parameters()}


def paged_bytes(units, tensors_of):
    """The moments homes' bytes as the page rule gives them from torch's counts: slot s of a
    unit holds every page its master shares with a parameter keeping more than s tensors."""
    total = 0
    for u in units:
        for s in range(u.state_slots):
            pages = {page for e in u.trainable if tensors_of[e.fqn] > s and e.numel
                     for page in range(e.offset // PAGE_NUMEL, (e.offset + e.numel - 1) // PAGE_NUMEL + 1)}
            total += len(pages) * PAGE_BYTES
    return total


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_bytes_on_each_tier_are_what_torch_keeps_per_parameter(name, tier, tmp_path):
    """fp32 (the master is the compute copy, so the state homes hold the optimizer's tensors
    alone): the state bytes on the tier are torch's tensors per parameter, in whole pages,
    far below a home of the most slots for every parameter; on NVMe a step reads and writes
    them once; the numbers are plain PyTorch's bit for bit."""
    torch.manual_seed(0)
    reference = GPT(WIDE)
    model = copy.deepcopy(reference)
    data = batches(3)
    with correctly_rounded_sqrt():
        tensors_of = torch_state(reference, OPTIMIZERS[name](reference), data)
        config = dict(device="cpu", dtype="fp32", param_tier="host", optimizer_tier=tier,
                      swap_dir=str(tmp_path / "swap"), overlap_step_with_forward=False)
        with offload.wrap(model, OPTIMIZERS[name](model), config=config) as engine:
            units = engine.units
            train_offload(engine, data[:2])
            before = engine.stats()
            train_offload(engine, data[2:])
            after = engine.stats()
            got = engine.state_dict()
    torch_bytes = sum(k * p.numel() * 4 for (n, p), k in zip(reference.named_parameters(), tensors_of.values()))
    expected = paged_bytes(units, tensors_of)
    assert after["optimizer_state_bytes"] == expected
    whole_slots = sum(u.state_slots * u.master_numel * 4 for u in units)
    assert torch_bytes <= expected < whole_slots
    # at most one page per slot where a unit's parameters change between keeping it and not
    changes = sum(1 for u in units for s in range(u.state_slots)
                  for a, b in zip(u.trainable, u.trainable[1:]) if (tensors_of[a.fqn] > s) != (tensors_of[b.fqn] > s))
    assert expected - torch_bytes <= (changes + sum(u.state_slots for u in units)) * PAGE_BYTES
    if tier == "nvme":
        assert after["bytes_read_nvme"] - before["bytes_read_nvme"] == expected
        assert after["bytes_written_nvme"] - before["bytes_written_nvme"] == expected
    else:
        assert after["bytes_read_nvme"] == after["bytes_written_nvme"] == 0
    expected_values = reference.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected_values.items())


def test_a_unit_whose_parameters_keep_every_slot_has_the_plain_layout():
    assert StateSlots.of(2, 2048, [(0, 1000, (0, 1)), (1000, 1000, (0, 1))]) is None
    slots = StateSlots.of(2, 3 * PAGE_NUMEL, [(0, 2048, (0,)), (2048, 100, (0, 1)), (2148, 10, ())])
    assert slots.slot_numel == [3 * PAGE_NUMEL, PAGE_NUMEL]
    # slot 1 keeps only the third page: the second parameter's elements, from the home's
    # page 3 on; a piece of the master's pages is one page-aligned span of each slot
    assert slots.physical(1, 2048 + 5) == 3 * PAGE_NUMEL + 5
    assert slots.span(1, 0, 2 * PAGE_NUMEL) == (3 * PAGE_NUMEL, 3 * PAGE_NUMEL)
    assert slots.span(1, 2 * PAGE_NUMEL, 3 * PAGE_NUMEL) == (3 * PAGE_NUMEL, 4 * PAGE_NUMEL)
    assert slots.owned_parts(1, 0, 3 * PAGE_NUMEL) == [(2048, 2148)]


def sgd_matrices_adamw_rest(m):
    return [torch.optim.SGD(blocks_matrices(m), lr=0.05, momentum=0.9, foreach=False),
            torch.optim.AdamW(the_rest(m), lr=1e-2, foreach=False)]


def run_pieces(model, tier, swap, data, **kw):
    config = dict(device="cpu", dtype="fp32", param_tier="host", optimizer_tier=tier, swap_dir=str(swap), **kw)
    with offload.wrap(model, sgd_matrices_adamw_rest(model), config=config) as engine:
        assert any(u.state_pages is not None for u in engine.units)
        train_offload(engine, data, settle_backward=kw.get("speculative_updates", False))
        return engine.state_dict(), engine.stats()


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_per_entry_slots_over_pieces_and_speculation_equal_plain_pytorch(tier, tmp_path, monkeypatch):
    """SGD with momentum on the matrices (one slot) beside AdamW (two), updated in pieces of
    one page (every piece a span of each slot, pieces without the second slot included):
    plain PyTorch's numbers; with clipping that triggers, speculative updates (out of place
    into the spare homes, what a parameter does not update carried over slot by slot, some
    redone) give the serialized step's numbers."""
    monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", PAGE_NUMEL)
    torch.manual_seed(0)
    reference = GPT(WIDE)
    fresh = copy.deepcopy(reference)
    data = batches(4)
    with correctly_rounded_sqrt():
        opts = sgd_matrices_adamw_rest(reference)
        for b in data:
            gpt_loss(reference, b).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        got, _ = run_pieces(copy.deepcopy(fresh), tier, tmp_path / "plain", data)
        assert all(torch.equal(got[k], v) for k, v in reference.state_dict().items())
        on, on_stats = run_pieces(copy.deepcopy(fresh), tier, tmp_path / "on", data, max_grad_norm=0.5,
                                  speculative_updates=True)
        off, _ = run_pieces(copy.deepcopy(fresh), tier, tmp_path / "off", data, max_grad_norm=0.5,
                            speculative_updates=False)
    assert on_stats["speculative_updates"] > 0 and on_stats["redone_updates"] > 0
    assert all(torch.equal(on[k], off[k]) for k in off)


class SometimesBlock(torch.nn.Module):
    """A matrix (SGD's), a norm and a vector ``extra`` (AdamW's) that forward uses only while
    ``use_extra`` is set: on the other steps it gets no gradient and keeps its state."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64, bias=False)
        self.norm = torch.nn.LayerNorm(64)
        self.extra = torch.nn.Parameter(torch.randn(64) * 0.1)
        self.use_extra = True

    def forward(self, x):
        x = self.norm(torch.tanh(self.linear(x)))
        return x + self.extra if self.use_extra else x


class Sometimes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([SometimesBlock() for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def sometimes_optimizers(m):
    matrices = [b.linear.weight for b in m.blocks]
    return [torch.optim.SGD(matrices, lr=0.05, momentum=0.9, foreach=False),
            torch.optim.AdamW([p for p in m.parameters() if not any(p is q for q in matrices)], lr=1e-2,
                              foreach=False)]


def run_sometimes(model, tier, swap, inputs, speculative, max_grad_norm):
    config = dict(device="cpu", dtype="fp32", param_tier="host", optimizer_tier=tier, swap_dir=str(swap),
                  max_grad_norm=max_grad_norm, speculative_updates=speculative)
    with offload.wrap(model, sometimes_optimizers(model), config=config) as engine:
        assert all(u.state_pages is not None for u in engine.units[1:])
        for i, x in enumerate(inputs):
            for b in model.blocks:
                b.use_extra = i % 2 == 0
            engine.backward(engine(x).square().mean())
            if speculative:
                engine.debug.updates.wait_optimizer()
            engine.step()
        return engine.state_dict(), engine.stats()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_parameter_without_a_gradient_keeps_its_slots_through_speculative_updates(tier, tmp_path):
    """Speculative updates write the spare homes, which become the homes; a parameter of a
    per-entry home with no gradient on every other step keeps its state (AdamW's two slots
    beside the matrix's one): the serialized step's numbers. (Its unit's update then waits
    for step(): an early one starts only once every gradient of the unit has come.)"""
    torch.manual_seed(0)
    fresh = Sometimes()
    inputs = [torch.randn(4, 64) for _ in range(6)]
    # the norm stays under 1.0: the speculations are committed
    on, on_stats = run_sometimes(copy.deepcopy(fresh), tier, tmp_path / "on", inputs, True, 1.0)
    off, _ = run_sometimes(copy.deepcopy(fresh), tier, tmp_path / "off", inputs, False, 1.0)
    assert on_stats["speculative_updates"] > 0
    assert all(torch.equal(on[k], off[k]) for k in off)


def train_steps(engine, data):
    for b in data:
        engine.backward(gpt_loss(engine, b))
        engine.step()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failed_write_of_per_entry_slots_is_held_and_saved_in_the_checkpoint_layout(tmp_path, monkeypatch):
    """[Note: swap I/O failures] A swap write of a per-entry home fails part-way through a
    unit's pieces: the unit's states are held in host RAM in the checkpoint's layout (every
    slot whole, zeros where a parameter keeps none), state_dict() reads them, a checkpoint
    saved then resumes in a fresh engine as the run that never failed."""
    from support import FaultyIO, unwrap_swap_io, wrap_swap_io
    import errno

    monkeypatch.setattr(offload.units, "OPTIMIZER_PIECE_NUMEL", PAGE_NUMEL)
    torch.manual_seed(0)
    fresh = GPT(WIDE)
    data = batches(5)
    config = dict(device="cpu", dtype="fp32", param_tier="host", optimizer_tier="nvme",
                  swap_dir=str(tmp_path / "swap"), overlap_step_with_forward=False)
    with correctly_rounded_sqrt():
        with offload.wrap(model := copy.deepcopy(fresh), sgd_matrices_adamw_rest(model), config=config) as ref:
            train_steps(ref, data[:3])
            after_fault_step = ref.state_dict()
            train_steps(ref, data[3:])
            final = ref.state_dict()
        with offload.wrap(model := copy.deepcopy(fresh), sgd_matrices_adamw_rest(model), config=config) as engine:
            train_steps(engine, data[:2])
            wrap_swap_io(engine, FaultyIO, errno.EIO, fail_write=2)  # a unit's second piece
            engine.backward(gpt_loss(engine, data[2]))
            with pytest.raises(OSError, match="save_checkpoint"):
                engine.step()
            assert all(torch.equal(v, after_fault_step[k]) for k, v in engine.state_dict().items())
            unwrap_swap_io(engine)
            engine.save_checkpoint(str(tmp_path / "elsewhere"))
        with offload.wrap(model := copy.deepcopy(fresh), sgd_matrices_adamw_rest(model), config=config) as engine:
            engine.load_checkpoint(str(tmp_path / "elsewhere"))
            train_steps(engine, data[3:])
            got = engine.state_dict()
    assert all(torch.equal(got[k], v) for k, v in final.items())


MODES = {
    # (optimizers, config): delayed updates write master and moments in place, the compute copy
    # into the spare one; the checkpoint is taken with an update pending
    "delayed-nvme": (sgd_matrices_adamw_rest, dict(param_tier="nvme", optimizer_tier="nvme", device_budget=1 << 20,
                                                   delayed_update=True)),
    "muon-host-clip-accumulate": (OPTIMIZERS["muon+adamw"], dict(param_tier="host", optimizer_tier="host",
                                                                 max_grad_norm=0.5, gradient_accumulation_steps=2)),
    "adafactor-nvme-bf16": (OPTIMIZERS["adafactor"], dict(param_tier="nvme", optimizer_tier="nvme", dtype="bf16")),
}


def run_mode(mode, swap, ckpt):
    make, extra = MODES[mode]
    torch.manual_seed(0)
    model = GPT(WIDE)
    config = dict(dict(device="cpu", swap_dir=str(swap)), **extra)
    with offload.wrap(model, make(model), config=config) as engine:
        losses = train_offload(engine, batches(6))
        engine.save_checkpoint(str(ckpt))
        return losses, engine.state_dict(), [u.state_pages is not None for u in engine.units]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", list(MODES))
def test_per_entry_slots_change_no_number_and_no_checkpoint_byte(mode, tmp_path, monkeypatch):
    """The same run with every unit's moments home in whole slots (StateSlots.of taken away,
    as before per-entry slots) and with per-entry slots: the same losses and weights bit for
    bit, and checkpoints whose unit files are the same bytes (the checkpoint keeps every slot
    whole, zeros where a parameter keeps none)."""
    import os

    with correctly_rounded_sqrt():
        losses, weights, packed = run_mode(mode, tmp_path / "swap-a", tmp_path / "packed")
        assert any(packed)
        monkeypatch.setattr(StateSlots, "of", classmethod(lambda cls, *args: None))
        whole_losses, whole_weights, whole = run_mode(mode, tmp_path / "swap-b", tmp_path / "whole")
        assert not any(whole)
    assert losses == whole_losses
    assert all(torch.equal(weights[k], whole_weights[k]) for k in weights)
    files = sorted(f for f in os.listdir(tmp_path / "packed") if f != "manifest.json")
    assert files == sorted(f for f in os.listdir(tmp_path / "whole") if f != "manifest.json") and files
    for f in files:
        a, b = tmp_path / "packed" / f, tmp_path / "whole" / f
        if a.is_file():
            assert a.read_bytes() == b.read_bytes(), f


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_auto_placement_of_per_entry_homes_is_the_plans(name, tmp_path):
    """"auto" places each unit by its home bytes: with per-entry slots wrap and `offload plan
    --optimizer NAME` (plan.auto_placement over the shape it learns) place every unit alike
    at host budgets from the all-NVMe floor to the all-RAM need."""
    from offload import plan
    from offload.config import OffloadConfig
    from offload.memory.budget import host_bytes, minimum_device_budget, minimum_host_budget
    from offload.memory.layout import Layout
    from offload.plan_optimizers import build_optimizers

    if name == "adafactor":
        pytest.importorskip("transformers")
    cpu = torch.device("cpu")
    with torch.device("meta"):
        shape = plan.shape_from_module(GPT(DEEP), "gpt", optimizer=name)
    assert any(u.moments_numel is not None for u in shape.units)
    slots = shape.optimizer.state_slots
    # bf16: in fp32 this model has no budget between all in RAM and gradient spills
    # (test_memory_placement's note) where states are split between the tiers
    sizes = [u.sizes(2) for u in shape.units]
    config = dict(device="cpu", dtype="bf16", swap_dir=str(tmp_path / "swap"), param_tier="auto",
                  optimizer_tier="auto", max_grad_norm=1.0, device_budget=minimum_device_budget(sizes, "nvme", 2))
    sizes = [dataclasses.replace(s, state_slots=slots) for s in sizes]

    def need(tier, bound):
        return bound(sizes, Layout.resolve(OffloadConfig(**config), cpu, None, ((tier,) * len(sizes),
                                                                               (tier,) * len(sizes))))
    floor = need("nvme", minimum_host_budget)
    full = need("host", lambda s, layout: host_bytes(s, layout).total)
    seen = set()
    for budget in (floor + (full - floor) * k // 6 for k in range(7)):
        planned, _, _ = plan.auto_placement(shape, dict(config, host_budget=budget), slots)
        torch.manual_seed(0)
        model = GPT(DEEP)
        with offload.wrap(model, build_optimizers(name, model), config=dict(config, host_budget=budget)) as engine:
            assert engine.placement() == planned, budget
        seen.add(str(planned))
    assert len(seen) >= 2  # the budgets change the placement (Adafactor's tiny states: two of them)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_state_carried_from_optimizers_that_have_stepped_goes_into_per_entry_homes(tier, tmp_path):
    """Muon and AdamW that took two steps in plain PyTorch are wrapped: their momentum buffers
    and moments go into the per-entry homes, and two more steps are plain PyTorch's four."""
    torch.manual_seed(0)
    reference = GPT(WIDE)
    model = copy.deepcopy(reference)
    data = batches(4)
    with correctly_rounded_sqrt():
        torch_state(reference, OPTIMIZERS["muon+adamw"](reference), data)
        opts = OPTIMIZERS["muon+adamw"](model)
        torch_state(model, opts, data[:2])
        config = dict(device="cpu", param_tier="host", optimizer_tier=tier, swap_dir=str(tmp_path / "swap"))
        with offload.wrap(model, opts, config=config) as engine:
            assert any(u.state_pages is not None for u in engine.units)
            train_offload(engine, data[2:])
            got = engine.state_dict()
    assert all(torch.equal(got[k], v) for k, v in reference.state_dict().items())


# Five pages: slot 0 keeps pages 0-3, slot 1 keeps pages 1, 3 and 4 (page 2 holds only a
# parameter without slot 1); parameters cut pages and leave padding on kept pages.
CARRY_ENTRIES = [(0, 1500, (0,)),             # pages 0-1, slot 0 only
                 (1536, 400, (0, 1)),         # page 1
                 (2304, 100, (0,)),           # page 2, slot 0 only
                 (3072, 1024, (0, 1)),        # page 3, whole
                 (4200, 500, (1,))]           # page 4, slot 1 only
CARRY_KEPT = {0: [0, 1, 2, 3], 1: [1, 3, 4]}


def carried_pair(s, lo, hi):
    """Slot s of piece [lo, hi) in two distinct buffers: ``src`` numbered by master element
    (x + 0.5 at master element x), ``dst`` all -1."""
    slots = StateSlots(2, 5 * PAGE_NUMEL, CARRY_ENTRIES)
    a, b = slots.span(s, lo, hi)
    kept = [p for p in CARRY_KEPT[s] if lo // PAGE_NUMEL <= p < hi // PAGE_NUMEL]
    assert b - a == len(kept) * PAGE_NUMEL  # the page rule, worked out by hand above
    src = torch.empty(b - a)
    for i, p in enumerate(kept):  # the i-th kept page of the piece is at i * PAGE_NUMEL
        src[i * PAGE_NUMEL:(i + 1) * PAGE_NUMEL] = torch.arange(p * PAGE_NUMEL, (p + 1) * PAGE_NUMEL) + 0.5
    dst = torch.full((b - a,), -1.0)
    from offload.memory.state_slots import PackedSlot
    return PackedSlot(slots, s, lo, src), PackedSlot(slots, s, lo, dst), kept


def carried_values(dst, kept):
    """{master element: value} of every element the destination buffer holds."""
    return {p * PAGE_NUMEL + j: float(dst.buffer[i * PAGE_NUMEL + j])
            for i, p in enumerate(kept) for j in range(PAGE_NUMEL)}


def expected_carry(s, kept, ranges):
    """What the destination holds after copying ``ranges`` (master elements) of slot s:
    the source's values exactly at the elements of parameters using s inside them."""
    owned = [(o, o + n) for o, n, used in CARRY_ENTRIES if s in used]
    copied = {x for a, b in ranges for o, e in owned for x in range(max(a, o), min(b, e))}
    return {x: (x + 0.5 if x in copied else -1.0) for p in kept for x in range(p * PAGE_NUMEL, (p + 1) * PAGE_NUMEL)}


@pytest.mark.parametrize("s", [0, 1])
def test_copy_owned_copies_exactly_the_owned_elements_of_its_range(s):
    """[Note: per-entry state slots] PackedSlot.copy_owned(src, a, b) of a piece that starts at
    page 1 (indices relative to it) copies the elements of parameters using the slot in
    [a, b), at their physical places past a page the slot does not keep, and nothing else:
    not the padding beside them on kept pages, not what lies outside [a, b)."""
    lo, hi = PAGE_NUMEL, 5 * PAGE_NUMEL
    # master ranges: cutting parameters, the whole piece, one parameter, padding and a
    # parameter without slot 1, a few elements
    for a, b in [(1700, 4300), (lo, hi), (1536, 1936), (2400, 3100), (lo + 10, lo + 12)]:
        src, dst, kept = carried_pair(s, lo, hi)
        dst.copy_owned(src, a - lo, b - lo)
        assert carried_values(dst, kept) == expected_carry(s, kept, [(a, b)]), (a, b)


@pytest.mark.parametrize("s", [0, 1])
def test_out_of_place_carry_over_copies_a_packed_slots_gaps_only(s):
    """[Note: out-of-place Adam] UnitAdam._carry_over, the path that calls copy_owned: a
    speculative update of piece [1024, 5120) that updated only the fourth parameter carries
    every other parameter's elements of the slot from the home to the spare home (what a
    parameter without a gradient keeps), leaves the updated range as the kernel wrote it and
    the padding alone; a plain master beside it gets every gap element."""
    from offload.optim.adam_ranges import UnitAdam

    lo, hi = PAGE_NUMEL, 5 * PAGE_NUMEL
    src, dst, kept = carried_pair(s, lo, hi)
    updated = (3072 - lo, 4096 - lo)
    dst[updated[0]:updated[1]].fill_(7.0)  # what the kernel wrote
    master_src, master_dst = torch.arange(float(hi - lo)), torch.zeros(hi - lo)
    UnitAdam._carry_over(hi - lo, [updated], [(src, dst), (master_src, master_dst)])
    expected = expected_carry(s, kept, [(lo, 3072), (4096, hi)])
    expected.update({x: 7.0 for x in range(3072, 4096)})
    assert carried_values(dst, kept) == expected
    gaps = torch.ones(hi - lo, dtype=torch.bool)
    gaps[updated[0]:updated[1]] = False
    assert torch.equal(master_dst[gaps], master_src[gaps]) and not master_dst[~gaps].any()


def run_staging(name, swap, whole_slots, monkeypatch):
    """Two steps of ``name`` with the states on NVMe (fp32, compute copies at home in RAM):
    the state_dict, the host tier's bytes once wrap is done (homes and staging slots: what
    the host holds after a step depends on when the last gradients were let go), the units'
    sizes and the layout. ``whole_slots``: every moments home in whole slots (StateSlots.of
    taken away)."""
    from offload.memory.budget import UnitSizes

    with monkeypatch.context() as m:
        if whole_slots:
            m.setattr(StateSlots, "of", classmethod(lambda cls, *args: None))
        torch.manual_seed(0)
        model = GPT(WIDE)
        config = dict(device="cpu", dtype="fp32", param_tier="host", optimizer_tier="nvme", swap_dir=str(swap),
                      overlap_step_with_forward=False)
        with offload.wrap(model, OPTIMIZERS[name](model), config=config) as engine:
            assert any(u.state_pages is not None for u in engine.units) != whole_slots
            at_wrap = engine.stats()["host_bytes"]
            train_steps(engine, batches(2))
            return (engine.state_dict(), at_wrap, [UnitSizes.of(u) for u in engine.units], engine.layout,
                    engine.units)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_staging_slots_hold_the_state_slots_the_largest_piece_moves(name, tmp_path, monkeypatch):
    """[Note: per-entry state slots] A staging slot's moments buffer holds what the largest
    piece of an NVMe-homed moments home moves: each unit here is one piece (a whole-parameter
    optimizer's, or smaller than a piece), so that is the largest unit's home by the page rule
    over torch's tensors per parameter, not its optimizer's most slots over the largest master.
    The host tier holds exactly that less than with whole-slot homes, host_budget's
    arithmetic (host_bytes' optimizer staging) counts the same bytes, and the numbers are the
    same bit for bit."""
    from offload.memory.budget import host_bytes, slot_shape

    with correctly_rounded_sqrt():
        torch.manual_seed(0)
        reference = GPT(WIDE)
        tensors_of = torch_state(reference, OPTIMIZERS[name](reference), batches(1))
        packed = run_staging(name, tmp_path / "packed", False, monkeypatch)
        whole = run_staging(name, tmp_path / "whole", True, monkeypatch)
    assert all(torch.equal(packed[0][k], whole[0][k]) for k in whole[0])
    (_, host, sizes, layout, units), (_, whole_host, whole_sizes, _, _) = packed, whole
    assert all(u.master_numel <= offload.units.OPTIMIZER_PIECE_NUMEL or u.whole_step for u in units)
    # by hand: the page rule per unit, the largest one
    expected = max(paged_bytes([u], tensors_of) for u in units if u.trainable) // 4
    slots = max(u.state_slots for u in units)
    master = max(u.master_numel for u in units)
    assert expected < slots * master
    depth = layout.optimizer_pipeline_depth
    assert slot_shape(sizes, layout).moments_numel == expected
    assert slot_shape(whole_sizes, layout).moments_numel == slots * master
    assert host_bytes(sizes, layout).optimizer_staging == depth * (master + expected) * 4
    assert host_bytes(whole_sizes, layout).optimizer_staging - host_bytes(sizes, layout).optimizer_staging \
        == whole_host - host == depth * (slots * master - expected) * 4
