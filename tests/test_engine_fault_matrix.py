"""The fault matrix of a step (issue 21): an exception at every fault point of forward,
backward and step() (offload.faults.POINTS, so a new point joins the matrix), and a failed
swap read or write, for fp32/bf16 and tiers (host, host)/(nvme, nvme), with speculative and
with delayed updates too (issue 36), at the first and the last hit of one training step.
Each case ends in one of the two outcomes of [Note: failures inside a step]
(offload/optim/failure.py), never a third (a failed speculative update that the step redoes
is the first: the step completes and equals the uninterrupted one):

- consistent: the engine trains on, and its weights are those before the failed batch;
  after the documented recovery (zero_grad(), then the same batch again) the run equals
  the uninterrupted one bit for bit;
- failed: every training verb raises EngineFailedError saying to load a checkpoint; after
  load_checkpoint the run equals the uninterrupted one bit for bit.

Host tiers have no swap I/O and no deferred updates, clipping no early or deferred
updates: those points are not generated for them; every other point must be reached by the reference run's step (its hits are counted
there, and give the last hit).
"""
import contextlib
import errno
import functools

import pytest
import torch

import offload
import offload.faults
from offload.errors import EngineFailedError
from offload.gpt import GPT, GPTConfig

from support import FaultyIO, assert_same_state, unwrap_swap_io, wrap_swap_io

# A failed pass leaves the recorded trace: the next one warns that it diverged.
pytestmark = [pytest.mark.filterwarnings("ignore:offload. execution left the recorded unit trace"),
              # a failed read ahead of the next pass, landed before its use: assert_the_next_pass_reads_again
              pytest.mark.filterwarnings("ignore:offload. .Errno 5. fetching unit")]

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2)
# "nvme-clipped" (fp32 only): with clipping no unit is updated during backward and step()
# runs the staged pipeline itself ([Note: the piece ring]) instead of deferring.
# "nvme-speculative": clipping that never triggers, so units are updated during backward
# into spare homes and step() commits them ([Note: speculative updates]); "nvme-delayed":
# every step's updates run after step() returns ([Note: delayed updates]).
TIERS = {"host": ("host", "host"), "nvme": ("nvme", "nvme"), "nvme-clipped": ("nvme", "nvme"),
         "nvme-speculative": ("nvme", "nvme"), "nvme-delayed": ("nvme", "nvme")}
# Points the matrix does not arm: wrap's own (a failed wrap changes nothing: its own tests),
# the checkpoint's (the crash-point harness), and the I/O engine hand-off, which the I/O
# faults below stand for (a failed read or write of the NVMe tier).
NOT_IN_A_STEP = ("wrap.", "checkpoint.", "nvme.io_engine")
STEP_POINTS = [n for n in offload.faults.points() if not n.startswith(NOT_IN_A_STEP)]
IO_FAULTS = ["nvme.read", "nvme.write"]
NOT_REACHED = {"host": {"optim.deferred_update", "optim.write_back", *IO_FAULTS}, "nvme": set(),
               # every unit stays resident, updated through its device copy: no fetch, no release
               "nvme-clipped": {"optim.early_update", "optim.deferred_update", "memory.fetch", "memory.release"},
               "nvme-speculative": set(),
               # no update during backward; every unit stays resident through a step's updates
               "nvme-delayed": {"optim.early_update", "memory.fetch"}}
FAST = {("fp32", "nvme"), ("bf16", "host"), ("fp32", "nvme-speculative"), ("bf16", "nvme-delayed")}  # the rest: slow


class InjectedFault(Exception):
    pass


def batch(i):
    g = torch.Generator().manual_seed(500 + i)
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)


def config(dtype, tiers, swap_dir):
    param_tier, optimizer_tier = TIERS[tiers]
    max_grad_norm = {"nvme-clipped": 1.0, "nvme-speculative": 1e9}.get(tiers)
    delayed = dict(delayed_update=True, delayed_update_warmup_steps=0) if tiers == "nvme-delayed" else {}
    return dict(dtype=dtype, param_tier=param_tier, optimizer_tier=optimizer_tier, swap_dir=str(swap_dir),
                device_budget=60_000, max_grad_norm=max_grad_norm,
                # the serialized step of clipping
                speculative_updates=False if tiers == "nvme-clipped" else None, **delayed)


def make_engine(cfg):
    torch.manual_seed(0)
    model = GPT(CFG)
    return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)


def train_step(engine, i):
    """One training step on batch i, settled: with deferred updates ([Note: deferred
    updates]) step() returns before they finish; zero_grad() waits for them. Speculative
    updates all run before step() (else it takes back those the worker has not started,
    and which points a step reaches depends on timing); delayed ones are waited for after
    it (as state_dict and checkpoints wait, without reading anything), so that the step's
    hits are its own."""
    b = batch(i)
    engine.backward(engine(b[:, :-1], b[:, 1:]))
    if engine.layout.speculative:
        engine.debug.updates.wait_optimizer()
    engine.step()
    engine.zero_grad()
    if engine.layout.delayed_update:
        engine.debug.updates.delayed.wait()


@functools.lru_cache(maxsize=None)
def reference(dtype, tiers, swap_root):
    """(state after step 0, state after step 2, hits of each point in step 1, reads and
    writes of the NVMe tier in step 1) of the uninterrupted run."""
    with make_engine(config(dtype, tiers, swap_root)) as engine:
        train_step(engine, 0)
        after_0 = engine.state_dict()
        engine.save_checkpoint(str(swap_root / "reference-ckpt"))  # as the faulty run does
        with contextlib.ExitStack() as stack:
            armed = {n: stack.enter_context(offload.faults.inject(n, lambda **context: None)) for n in STEP_POINTS}
            io = wrap_swap_io(engine, FaultyIO, errno.EIO) if engine.debug.nvme is not None else None
            train_step(engine, 1)
            hits = {n: a.hits for n, a in armed.items()}
            if io is not None:
                hits.update({"nvme.read": io.reads, "nvme.write": io.writes})
                unwrap_swap_io(engine)
        train_step(engine, 2)
        return after_0, engine.state_dict(), hits


def cases():
    for dtype in ("fp32", "bf16"):
        for tiers in TIERS:
            if tiers == "nvme-clipped" and dtype != "fp32":
                continue
            marks = () if (dtype, tiers) in FAST else (pytest.mark.slow,)
            for point in STEP_POINTS + IO_FAULTS:
                if point in NOT_REACHED[tiers]:
                    continue
                for which in ("first", "last"):
                    yield pytest.param(dtype, tiers, point, which, marks=marks,
                                       id=f"{dtype}-{tiers}-{point}-{which}")


@contextlib.contextmanager
def fault(engine, point, at, error):
    """Inside the block, the ``at``-th hit of ``point`` in the engine fails with ``error``
    (a failed swap read or write: an OSError(EIO)). Yields a function giving the hits so far."""
    if point in IO_FAULTS:
        io = wrap_swap_io(engine, FaultyIO, errno.EIO, **{"fail_read" if point == "nvme.read" else "fail_write": at})
        try:
            yield lambda: io.reads if point == "nvme.read" else io.writes
        finally:
            unwrap_swap_io(engine)
    else:
        with offload.faults.inject(point, offload.faults.raising(error), at=at) as armed:
            yield lambda: armed.hits


REDONE = "redone"


def faulted_step(engine, point, at, error, ckpt):
    """Step 1 with the ``at``-th hit of ``point`` failing: the exception it raised; None
    when that hit was a swap read ahead of the next pass, which step 1 does not wait for,
    or a fetch that no use waited for, which step 1 landed and counted;
    REDONE when it failed a speculative update, which the step redid ([Note: speculative
    updates]: only its spare homes were written). A
    step's hits can differ by one between runs: in step() the next pass's prefetch reads
    only the compute copies whose early or deferred updates are done by then, so one run
    reads one more or one fewer. A step that ends before hit ``at`` is taken back by loading
    ``ckpt`` (the state before it) and run again failing at its own last hit."""
    for _ in range(3):
        before = engine.stats()
        with fault(engine, point, at, error) as hits:
            try:
                train_step(engine, 1)
            except (KeyboardInterrupt, InjectedFault, OSError) as raised:
                assert hits() >= at
                return raised
        if hits() >= at:
            after = engine.stats()
            if after["redone_updates"] > before["redone_updates"]:
                return REDONE
            # a fetch no use waited for yet, landed by the step ([Note: residency]:
            # drain_fetches counts and warns); on CUDA and its stand-in, where the step
            # drops every device copy, a fetch of the pass's last units can be one
            landed = point == "memory.fetch" and after["failed_prefetches"] > before["failed_prefetches"]
            assert point == "nvme.read" or landed, f"hit {at} of {point} was reached and did not fail"
            return None
        at = hits()
        engine.load_checkpoint(str(ckpt))
    pytest.fail(f"three runs of step 1 ended before their last hit of {point}")


def assert_the_next_pass_reads_again(engine):
    """Step 2 after a failed read that step 1 started for it: the read's failure reaches its
    first use in the forward (which abandons the pass and changes nothing, so step 2 runs
    again), or it is landed and warned about first ([Note: residency], drain_fetches)."""
    try:
        train_step(engine, 2)
    except OSError as failed:
        said = " ".join([str(failed), *getattr(failed, "__notes__", [])])
        assert "the next forward reads the unit again" in said and "checkpoint" not in said, said
        engine.zero_grad()
        train_step(engine, 2)


@pytest.mark.parametrize("dtype,tiers,point,which", list(cases()))
def test_a_fault_in_a_step_leaves_a_consistent_or_a_failed_engine(dtype, tiers, point, which, tmp_path_factory):
    swap_root = tmp_path_factory.getbasetemp() / f"matrix-swap-{dtype}-{tiers}"
    swap_root.mkdir(exist_ok=True)
    after_0, final, hits = reference(dtype, tiers, swap_root)
    assert hits[point] > 0, f"one step of this mode no longer reaches {point}"
    at = 1 if which == "first" else hits[point]
    # A KeyboardInterrupt at the first hit (it skips torch's always-called hooks and most
    # except-Exception clauses), an ordinary exception at the last.
    error = KeyboardInterrupt if which == "first" else InjectedFault(f"injected at {point}")
    ckpt = tmp_path_factory.mktemp("ckpt") / "after-step-0"
    with make_engine(config(dtype, tiers, swap_root)) as engine:
        train_step(engine, 0)
        engine.save_checkpoint(str(ckpt))
        raised = faulted_step(engine, point, at, error, ckpt)
        if raised is None:  # a read ahead of the next pass failed: step 1 is done, nothing lost
            assert_the_next_pass_reads_again(engine)
            assert_same_state(engine.state_dict(), final)
            return
        if raised is REDONE:  # step 1 is done, the failed speculation redone: nothing lost
            assert config(dtype, tiers, swap_root).get("max_grad_norm") == 1e9  # else redos are routine
            train_step(engine, 2)
            assert_same_state(engine.state_dict(), final)
            return
        said = " ".join([str(raised), *getattr(raised, "__notes__", [])])
        b = batch(1)
        try:
            loss = engine(b[:, :-1], b[:, 1:])
        except EngineFailedError as refused:  # the failed outcome
            assert "checkpoint" in str(refused), str(refused)
            assert "checkpoint" in said and "reads it again" not in said, said
            with pytest.raises(EngineFailedError, match="checkpoint"):
                engine.step()
            engine.load_checkpoint(str(ckpt))
            train_step(engine, 1)
        else:  # the consistent outcome: nothing of the failed step is left
            assert "checkpoint" not in said, said
            assert_same_state(engine.state_dict(), after_0)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        train_step(engine, 2)
        assert_same_state(engine.state_dict(), final)


def raising_hook(grad):
    raise InjectedFault("the user's gradient hook failed")


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_user_hook_failing_after_early_updates_stops_the_engine_until_a_checkpoint_is_loaded(tiers, tmp_path):
    """Issue 21 item 1: the user's gradient hook raises in backward after the optimizer
    worker updated later blocks early. The engine must not mix two steps (nor fail later
    with AttributeError): it refuses to train until a checkpoint is loaded, and then
    equals the uninterrupted run."""
    cfg = config("fp32", tiers, tmp_path)
    with make_engine(cfg) as ref:
        for i in range(3):
            train_step(ref, i)
        final = ref.state_dict()
    with make_engine(cfg) as engine:
        train_step(engine, 0)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        first_block = engine.units[1]
        handle = first_block.trainable[0].param.register_hook(raising_hook)  # its gradients come late
        b = batch(1)
        with pytest.raises(InjectedFault) as info:
            engine.backward(engine(b[:, :-1], b[:, 1:]))
        handle.remove()
        assert engine.stats()["early_updates"] > 0, "later blocks were updated during backward"
        assert any("resume from the last checkpoint" in note for note in info.value.__notes__)
        for verb in (lambda: engine(b[:, :-1], b[:, 1:]), engine.step,
                     lambda: engine.save_checkpoint(str(tmp_path / "mixed"))):
            with pytest.raises(EngineFailedError, match="resume from the last checkpoint"):
                verb()
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        train_step(engine, 1)
        train_step(engine, 2)
        assert_same_state(engine.state_dict(), final)


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_user_hook_failing_before_any_update_drops_the_gradients(tiers, tmp_path):
    """Issue 21 item 1: a failure in backward before any unit was updated (with clipping
    no unit is updated during backward) drops the step's gradients and says so;
    zero_grad() and carrying on equals the run that skipped that batch."""
    cfg = dict(config("fp32", tiers, tmp_path), max_grad_norm=1e9)
    with make_engine(cfg) as ref:
        train_step(ref, 0)
        train_step(ref, 2)
        skipped = ref.state_dict()
    with make_engine(cfg) as engine:
        train_step(engine, 0)
        handle = engine.units[1].trainable[0].param.register_hook(raising_hook)
        b = batch(1)
        with pytest.raises(InjectedFault) as info:
            engine.backward(engine(b[:, :-1], b[:, 1:]))
        handle.remove()
        assert any("were dropped" in note for note in info.value.__notes__)
        # already dropped: no zero_grad() needed (it would change nothing)
        train_step(engine, 2)
        assert_same_state(engine.state_dict(), skipped)
