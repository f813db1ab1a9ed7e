"""A Ctrl-C at every fault point of the delayed and speculative paths ([Note: interrupts while
waiting] and [Note: failures inside a step] in offload/optim/failure.py).

The fault matrix's tiny GPT (tests/test_engine_fault_matrix.py), both tiers on NVMe, trained
one verb at a time (forward, backward, step, zero_grad), with a window of verbs where the
interrupts go (MODES):

- delayed: ``delayed_update=True`` from the first step ([Note: delayed updates]); the window
  runs from step() of batch 1, which queues that step's delayed update, to the end of batch
  2, whose forward and backward it runs under and whose step() commits it;
- speculative-redone and speculative-kept: clipping at MAX_GRAD_NORM, which the batches'
  norms cross both ways ([Note: speculative updates]): backward speculates after a step that
  did not clip, and the speculation is redone (batch 2 clips) or kept (batch 4 does not). The
  window is that batch; speculative-kept's loop leaves zero_grad() out, so its window goes on
  to the next backward, whose forward waits for the deferred update.

For every fault point that the uninterrupted run reaches in the window (hits counted as the
fault matrix counts them), a KeyboardInterrupt is raised at its first hit: on the main thread
it is what a Ctrl-C landing there raises, on the optimizer worker an exception of the update
(the worker gets no signals). And where the main thread waits for the worker (Mode.waits), a
real SIGINT is sent (support.sigint_once_main_waits_in) while the update it waits for is held.
Each case ends in one of the two outcomes, never a third:

- consistent: the engine trains on, its weights those before the interrupted batch (or after
  it, when zero_grad() raised once its step was done); after that batch again (or the next
  one) the run equals the uninterrupted one bit for bit, losses and state_dict. Each case runs
  twice: calling zero_grad() first, and carrying on without it (reliability.md: nothing needs
  doing);
- failed: forward, backward and step() raise EngineFailedError naming the checkpoint, and after
  load_checkpoint of the checkpoint saved before the window the run equals the uninterrupted
  one bit for bit.

A failed speculative update is neither: it is dropped with a warning and step() redoes it; the
run must then equal the uninterrupted one with nothing done. A case that finds an engine bug
is a strict xfail (KNOWN_BUGS), with the failure it gives, until the bug is fixed.
"""
import contextlib
import dataclasses
import functools
import threading
import time
import warnings
from typing import Dict, FrozenSet, Optional, Tuple

import pytest
import torch

import offload
import offload.faults
from offload.errors import EngineFailedError
from offload.gpt import GPT, GPTConfig

from support import assert_same_state, sigint_once_main_waits_in

pytestmark = [
    # An abandoned pass leaves the recorded trace: the next one warns that it diverged.
    pytest.mark.filterwarnings("ignore:offload. execution left the recorded unit trace"),
    # [Note: speculative updates] an interrupted speculative update is dropped with this warning
    pytest.mark.filterwarnings("ignore:.*a speculative update of unit"),
]

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2)  # 3 units
# The batches' gradient norms with clipping at 5.7 are 7.17, 5.51, 5.87, 4.87, 4.34, 5.61:
# batches 0 and 2 clip, the others do not. Backward speculates after a step that did not clip,
# so batch 2's speculation is redone and batch 4's kept; batches 1 and 3 do not speculate
# (Mode.grows checks it).
MAX_GRAD_NORM = 5.7
VERBS = ("forward", "backward", "step", "zero_grad")
# Points no step reaches: wrap's, the checkpoint's (tests/test_checkpoint_crash.py), and the
# I/O engine hand-off.
NOT_IN_A_STEP = ("wrap.", "checkpoint.", "nvme.io_engine")
STEP_POINTS = [n for n in offload.faults.points() if not n.startswith(NOT_IN_A_STEP)]

Action = Tuple[int, str]  # (batch, verb)


@dataclasses.dataclass(frozen=True)
class Mode:
    config: Tuple[Tuple[str, object], ...]
    num_batches: int
    window: Tuple[Action, Action]  # the first and the last verb where faults are armed
    zero_grad: bool  # whether the training loop calls zero_grad() after step()
    not_reached: FrozenSet[str]  # points the window does not reach
    # [Note: interrupts while waiting] (point, hit, function): while the update that reaches
    # ``point`` for the ``hit``-th time in the window is held, the main thread waits for it in
    # ``function``, and a real SIGINT is sent then
    waits: Tuple[Tuple[str, int, str], ...]
    # stats() counters the window must increase, and those it must leave: it runs its path
    grows: Tuple[str, ...]
    stays: Tuple[str, ...]
    slow: bool

    @property
    def checkpoint_after(self) -> int:
        """The batch after which the run saves the checkpoint that a failed outcome loads."""
        return self.window[0][0] - 1

    def bounds(self):
        """Indices into actions(): the first action after the checkpoint, the window's first
        and its last."""
        actions = self.actions()
        return (actions.index((self.checkpoint_after + 1, "forward")), actions.index(self.window[0]),
                actions.index(self.window[1]))

    def actions(self):
        verbs = VERBS if self.zero_grad else VERBS[:3]
        return [(b, v) for b in range(self.num_batches) for v in verbs]


MODES: Dict[str, Mode] = {
    # Each unit's delayed update of batch 1 is waited for by the gradient hand-off of batch 2's
    # backward (Gradients.take_back), in the order the updates run: the root, then the blocks
    # last to first.
    "delayed": Mode(
        config=(("delayed_update", True), ("delayed_update_warmup_steps", 0)), num_batches=4,
        window=((1, "step"), (2, "zero_grad")), zero_grad=True, not_reached=frozenset({"optim.early_update"}),
        waits=tuple(("optim.deferred_update", hit, "take_back") for hit in (1, 2, 3)),
        grows=("delayed_updates",), stays=("delayed_fallbacks",), slow=False),
    # The first speculative update is waited for by step(); the redone ones, deferred after
    # step() returned ([Note: deferred updates]), by zero_grad().
    "speculative-redone": Mode(
        config=(("max_grad_norm", MAX_GRAD_NORM),), num_batches=4,
        window=((2, "forward"), (2, "zero_grad")), zero_grad=True, not_reached=frozenset(),
        waits=(("optim.early_update", 1, "step"),
               *(("optim.deferred_update", hit, "zero_grad") for hit in (1, 2, 3))),
        grows=("speculative_updates", "redone_updates"), stays=(), slow=False),
    # Without zero_grad() in the loop the deferred update (the root's: the blocks'
    # speculations are kept) is waited for by the next forward's fetch of the root
    # (UpdateScheduler.settle_unit).
    "speculative-kept": Mode(
        config=(("max_grad_norm", MAX_GRAD_NORM),), num_batches=6,
        window=((4, "forward"), (5, "backward")), zero_grad=False, not_reached=frozenset(),
        waits=(("optim.early_update", 1, "step"),
               ("optim.deferred_update", 1, "settle_unit")),
        grows=("speculative_updates",), stays=("redone_updates",), slow=True),
}


def batch(i):
    g = torch.Generator().manual_seed(500 + i)
    return torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)


def make_engine(mode, swap_dir):
    torch.manual_seed(0)
    model = GPT(CFG)
    config = dict(param_tier="nvme", optimizer_tier="nvme", swap_dir=str(swap_dir), device_budget=60_000,
                  **dict(mode.config))
    return offload.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)


class Loop:
    """The training loop of one engine, one verb at a time: the loss of each batch, taken
    once its step() returned."""

    def __init__(self, engine):
        self.engine = engine
        self.losses: Dict[int, float] = {}
        self.loss: Optional[torch.Tensor] = None

    def run(self, action: Action) -> None:
        b, verb = action
        if verb == "forward":
            x = batch(b)
            self.loss = self.engine(x[:, :-1], x[:, 1:])
        elif verb == "backward":
            self.engine.backward(self.loss)
        elif verb == "step":
            self.engine.step()
            self.losses[b] = self.loss.item()
        else:
            self.engine.zero_grad()


@dataclasses.dataclass
class Reference:
    hits: Dict[str, int]  # of each point in the window
    after: Dict[int, Dict[str, torch.Tensor]]  # state_dict after each batch
    losses: Dict[int, float]
    final: Dict[str, torch.Tensor]


class Window:
    """Inside, every step point is armed: its hits are counted, and ``action`` runs at hit
    ``at`` of ``point`` (None: no fault)."""

    def __init__(self, engine, point=None, action=None, at=None):
        self.engine, self.point, self.action, self.at = engine, point, action, at
        self.hits = dict.fromkeys(STEP_POINTS, 0)
        self.fired = False
        self.acting = False  # the action runs (a held update, for one)
        self._lock = threading.Lock()
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        self.early_updates_before = self.engine.stats()["early_updates"]
        for name in STEP_POINTS:
            self._stack.enter_context(offload.faults.inject(name, functools.partial(self._hit, name)))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def _hit(self, name, **context):
        with self._lock:
            self.hits[name] += 1
            if name != self.point or self.hits[name] != self.at:
                return
            self.fired = self.acting = True
        try:
            self.action(**context)
        finally:
            self.acting = False

    def run(self, loop, actions, timeout=30.0):
        """run_until_raised(loop, actions), waiting after each backward until the worker has
        started every early update queued so far, unless the action holds it. step() takes
        back the speculative updates not started ([Note: speculative updates]): without the
        wait, which units are updated speculatively, and so which points a window reaches,
        would depend on the machine's load."""
        def started_every_early_update():
            deadline = time.monotonic() + timeout
            while not self.acting and \
                    self.hits["optim.early_update"] < self.engine.stats()["early_updates"] - self.early_updates_before:
                assert time.monotonic() < deadline, f"the worker started no early update in {timeout} s"
                time.sleep(0.001)
        return run_until_raised(loop, actions, after_backward=started_every_early_update)


def run_until_raised(loop, actions, after_backward=lambda: None):
    """Run ``actions`` of ``loop`` up to the first that raises an interrupt or an OSError:
    (that exception, its action), or (None, None)."""
    for action in actions:
        try:
            loop.run(action)
        except (KeyboardInterrupt, OSError) as error:
            return error, action
        if action[1] == "backward":
            after_backward()
    return None, None


@functools.lru_cache(maxsize=None)
def reference(name, swap_root):
    """The uninterrupted run of MODES[name], twice: once with the window's points counted,
    once reading the state after every batch (which must change nothing)."""
    mode = MODES[name]
    actions, (first, start, end) = mode.actions(), mode.bounds()
    with make_engine(mode, swap_root / "counted") as engine:
        loop = Loop(engine)
        for action in actions[:first]:
            loop.run(action)
        engine.save_checkpoint(str(swap_root / "reference-ckpt"))  # as the faulted run does
        for action in actions[first:start]:
            loop.run(action)
        counts_before = engine.stats()
        with Window(engine) as window:
            assert window.run(loop, actions[start:end + 1]) == (None, None)
        counts_after = engine.stats()
        changed = {k: counts_after[k] - counts_before[k] for k in (*mode.grows, *mode.stays)}
        assert all(changed[k] > 0 for k in mode.grows) and not any(changed[k] for k in mode.stays), changed
        for action in actions[end + 1:]:
            loop.run(action)
        losses, final = loop.losses, engine.state_dict()
    after = {}
    with make_engine(mode, swap_root / "read") as engine:
        loop = Loop(engine)
        for action in actions:
            loop.run(action)
            if action[1] == actions[-1][1]:
                after[action[0]] = engine.state_dict()
        assert loop.losses == losses
    assert_same_state(after[mode.num_batches - 1], final)
    return Reference(window.hits, after, losses, final)


# Engine bugs these cases find, by case id: (the exception the case fails with, why).
KNOWN_BUGS: Dict[str, Tuple[type, str]] = {}  # none known today


def cases():
    """(mode, point, hit, function, recovery) for every point reached and every wait of each
    mode; ``recovery`` of a consistent outcome: "then-zero_grad" calls zero_grad() before
    the batch again, "carry-on" does not (reliability.md: nothing needs doing)."""
    for name, mode in MODES.items():
        marks = (pytest.mark.slow,) if mode.slow else ()
        interrupts = [(point, 1, None, f"{name}-{point}") for point in STEP_POINTS if point not in mode.not_reached]
        interrupts += [(point, hit, function, f"{name}-sigint-in-{function}-holding-{point}-{hit}")
                       for point, hit, function in mode.waits]
        for point, hit, function, case in interrupts:
            for recovery in ("then-zero_grad", "carry-on"):
                bug = KNOWN_BUGS.get(f"{case}-{recovery}")
                yield pytest.param(name, point, hit, function, recovery, id=f"{case}-{recovery}", marks=marks + (
                    (pytest.mark.xfail(strict=True, raises=bug[0], reason=bug[1]),) if bug else ()))


@pytest.mark.parametrize("name,point,hit,function,recovery", list(cases()))
def test_an_interrupt_leaves_a_consistent_or_a_failed_engine(name, point, hit, function, recovery,
                                                             tmp_path_factory):
    """The interrupt at ``point`` (a SIGINT while the main thread waits in ``function``) ends
    consistent or failed, and the run recovered as that outcome says equals the uninterrupted
    one bit for bit (see the module docstring)."""
    mode = MODES[name]
    swap_root = tmp_path_factory.getbasetemp() / f"interrupts-{name}"
    swap_root.mkdir(exist_ok=True)
    ref = reference(name, swap_root)
    assert ref.hits[point] >= hit, f"the window of {name} no longer reaches {point} {hit} time(s)"
    actions, (first, start, end) = mode.actions(), mode.bounds()
    ckpt = tmp_path_factory.mktemp("ckpt") / "before-the-window"
    with make_engine(mode, swap_root) as engine, interrupts_fail_the_test():
        loop = Loop(engine)
        for action in actions[:first]:
            loop.run(action)
        engine.save_checkpoint(str(ckpt))
        for action in actions[first:start]:
            loop.run(action)
        interrupt = sigint_once_main_waits_in(function) if function else offload.faults.raising(KeyboardInterrupt)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            with Window(engine, point, interrupt, hit) as window:
                raised, where = window.run(loop, actions[start:end + 1])
            assert window.fired, f"{point} was not reached {hit} time(s) in the window ({raised!r} in {where})"
            if raised is None:  # a failure reported by a later call
                raised, where = run_until_raised(loop, actions[end + 1:])
        if function:
            assert interrupt.sent, f"the main thread never waited in {function}"
            assert isinstance(raised, KeyboardInterrupt), f"the SIGINT raised {raised!r} in {where}"
        if raised is None:
            # [Note: speculative updates] a failed speculative update is dropped with a warning
            # and step() updates the unit from its homes: nothing to recover
            assert any("a speculative update of unit" in str(w.message) for w in warned), \
                f"the KeyboardInterrupt at {point} was dropped without a word"
        else:
            said = " ".join([str(raised), *getattr(raised, "__notes__", [])])
            b, verb = where
            if recovery == "then-zero_grad":
                engine.zero_grad()  # allowed in either outcome
            x = batch(b + (verb == "zero_grad"))
            try:
                loss = engine(x[:, :-1], x[:, 1:])
            except EngineFailedError as refused:  # the failed outcome
                assert "checkpoint" in str(refused), str(refused)
                assert "checkpoint" in said, said
                # save_checkpoint: test_save_checkpoint_refuses_after_a_failed_delayed_update_reported_by_forward
                for verb_after in (engine.step, lambda: engine.backward(torch.zeros((), requires_grad=True))):
                    with pytest.raises(EngineFailedError, match="checkpoint"):
                        verb_after()
                engine.load_checkpoint(str(ckpt))
                resume = first
            else:  # the consistent outcome: the batch again, or the next one once its step was done
                assert "checkpoint" not in said, said
                done = b if verb == "zero_grad" else b - 1
                assert_same_state(engine.state_dict(), ref.after[done])
                loop.loss = loss
                resume = actions.index((done + 1, "backward"))
            for action in actions[resume:]:
                loop.run(action)
        assert {b: v for b, v in loop.losses.items() if b > mode.checkpoint_after} == \
            {b: v for b, v in ref.losses.items() if b > mode.checkpoint_after}
        assert_same_state(engine.state_dict(), ref.final)


@contextlib.contextmanager
def interrupts_fail_the_test():
    """A KeyboardInterrupt the test did not expect fails it, instead of ending the session."""
    try:
        yield
    except KeyboardInterrupt as error:
        pytest.fail(f"an interrupt escaped: {error!r} {getattr(error, '__notes__', '')}")


def test_save_checkpoint_refuses_after_a_failed_delayed_update_reported_by_forward(tmp_path):
    """[Note: failures inside a step] A delayed update that failed before the next forward
    started is reported by that forward (its root waits for the idle worker), which leaves the
    update's ticket with the unit; save_checkpoint must refuse like every other training verb
    (reliability.md), not raise the update's own exception again. The matrix above meets this
    when its delayed-mode fault at optim.write_back (or adam, adam_range, deferred_update) wins
    the race with the forward; here the forward waits for the worker to be idle first."""
    mode = MODES["delayed"]
    actions, start = mode.actions(), mode.bounds()[1]
    with make_engine(mode, tmp_path / "swap") as engine, interrupts_fail_the_test():
        loop = Loop(engine)
        for action in actions[:start]:
            loop.run(action)
        with offload.faults.inject("optim.write_back", offload.faults.raising(KeyboardInterrupt), at=1) as armed:
            loop.run((1, "step"))  # queues the delayed updates; the first write-back of the first fails
            deadline = time.monotonic() + 30
            while engine.debug.updates.delayed.in_flight():
                assert time.monotonic() < deadline, "the delayed updates did not end in 30 s"
                time.sleep(0.001)
        assert armed.fired
        with pytest.raises(KeyboardInterrupt) as reported:
            loop.run((2, "forward"))
        assert "resume from the last checkpoint" in str(reported.value.__notes__)
        for verb in (lambda: loop.run((2, "forward")), engine.step):
            with pytest.raises(EngineFailedError, match="checkpoint"):
                verb()
        try:
            engine.save_checkpoint(str(tmp_path / "mixed"))
            raised = None
        except BaseException as error:  # noqa: B902 - a KeyboardInterrupt must not end the session
            raised = error
        assert isinstance(raised, EngineFailedError), f"save_checkpoint raised {raised!r}"
        assert not (tmp_path / "mixed").exists()
