"""Whether the engine may go on training, and why not: closed, or failed part-way through a
step ([Note: swap I/O failures], [Note: failures inside a step]).

``FailureState`` is the one record of it. The engine builds it first and hands its bound
methods to the mechanisms that can stop a step part-way (the staged step, the update
scheduler, [zero] the sharded step) and to the checkpoint code (which replaces the states
and so clears a failure). It lives in optim because what it guards is the optimizer
step's all-or-nothing: every failure it records is one where some units may hold a newer
step than others, or where a step's states are held only in host RAM.

[Note: failures inside a step] What a failure inside forward, backward or step() leaves
behind, by where it happens (the fault matrix, tests/test_engine_fault_matrix.py, injects
one at every point of offload.faults and checks that each ends in one of the two
outcomes below, never a third):
- forward (a fetch, a release, a hook, the user's own code): nothing but the device
  copies changed. The pass is abandoned (Hooks.abort_forward), the error is raised as it
  came (a fetch's OSError names the unit) and the engine is consistent: carry on.
- backward, before any unit's update was queued: the gradients accumulated since the
  last optimizer step are partial (some parameters have this micro-batch's, others not),
  so they are dropped as by ``zero_grad()``; weights and optimizer states are those
  before this backward. The error is raised with that said (a note, or the message of an
  OSError): consistent, carry on with the next batch or this one again.
- backward, after an early update ([Note: early updates]) was queued: that unit has this
  step's update and the others never will, so the engine fails (``fail_step``): forward,
  backward, step and save_checkpoint raise EngineFailedError until a checkpoint is
  loaded (engine.load_checkpoint(DIR) or a new process). A queued update is not taken
  back; the worker finishes it first.
- step(): whatever raises there is fatal the same way (fail_step_unless_recorded):
  units are updated one after the other and the step's end drops stale device copies,
  so an exception may leave any part of it done. The exception: a failed swap write,
  whose states are held in host RAM ([Note: swap I/O failures]): save a checkpoint
  elsewhere and load it (or load an older one).
A failure of the deferred updates ([Note: deferred updates]) is the step's, reported by
the next call that settles them. A refusal (EngineFailedError, a closed engine) changes
nothing, the micro-step count included.

[Note: interrupts while waiting] An interrupt (KeyboardInterrupt on Ctrl-C, or whatever a
signal handler raises) that reaches the main thread while it waits for the optimizer
worker is not a failure of the updates it waits for, and it cannot stop them half-way:
the wait goes on to its end (``wait_through_interrupts``) and the interrupt is raised after
it, where the outcomes above apply. Backward waiting for a delayed update's gradient
fields, or for a running update before spilling gradients, fails before any of its own
updates: consistent. save_checkpoint and state_dict waiting for delayed updates raise it
before reading or writing anything: consistent, the engine trains on. A call that settles
a deferred step (zero_grad, the next backward) raises it once the step's bookkeeping (norm,
zero_grad, write errors) is done. Only a wait in step() stays fatal, as everything raised
there does.
"""
from __future__ import annotations

import weakref
from concurrent.futures import ALL_COMPLETED, Future, wait as wait_futures
from typing import Any, Callable, Collection, Dict, List, NoReturn, Optional, Tuple

from torch import nn

from offload.errors import EngineFailedError

__all__ = ["FailureState", "wait_through_interrupts", "with_note"]


def with_note(error: BaseException, note: str) -> BaseException:
    """``error`` saying ``note`` too: an OSError becomes a new one (same errno) whose
    message ends with it, since callers print and match str(error); any other exception
    stays itself (a KeyboardInterrupt must stay one) and gets the note in its traceback."""
    if isinstance(error, OSError):
        plain = error.errno is not None and error.strerror and error.filename is None
        message = f"{error.strerror if plain else error}; {note}"
        new = OSError(error.errno, message) if error.errno is not None else OSError(message)
        new.__cause__ = error
        return new
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"offload: {note}")
    return error


def wait_through_interrupts(futures: Collection[Future], return_when: str = ALL_COMPLETED) -> Optional[BaseException]:
    """Wait for ``futures`` (concurrent.futures.wait's ``return_when``) whatever interrupts
    this thread meanwhile; the first such interrupt is returned once the wait is over, for
    the caller to raise where the engine is consistent ([Note: interrupts while waiting]).
    The futures' own errors stay in them."""
    interrupt: Optional[BaseException] = None
    while True:
        try:
            wait_futures(futures, return_when=return_when)
            return interrupt
        except BaseException as error:  # noqa: B902 - asynchronous: a signal, raised by the caller after the wait
            if interrupt is None:
                interrupt = error


class FailureState:
    """Whether the engine refuses to train: ``closed`` (for good), or ``failure``: None, or
    {"fatal": bool, "message": str}, the message saying how to recover. Main thread only:
    the optimizer worker's errors reach it through the update tickets."""

    def __init__(self) -> None:
        self.closed = False
        self.failure: Optional[Dict[str, Any]] = None
        # [Note: the model after close] why close() left the parameters without values
        self.not_restored: Optional[str] = None

    def set(self, failure: Optional[Dict[str, Any]]) -> None:
        """Record ``failure`` (None: the engine trains again, after a checkpoint load)."""
        self.failure = failure

    def check(self, what: str) -> None:
        """Raise unless the engine may run ``what`` (a public verb): RuntimeError when it is
        closed, EngineFailedError after a failure."""
        if self.closed:
            raise RuntimeError(f"{what}: the engine is closed (close() was called); its model's parameters "
                               "hold no values any more: build the model again, wrap it and load a checkpoint")
        if self.failure is not None:
            raise EngineFailedError(f"{what}: {self.failure['message']}")

    def check_open(self, what: str) -> None:
        """Raise RuntimeError when the engine is closed (``what`` is allowed after a failure)."""
        if self.closed:
            self.check(what)

    def fail_step(self, error: BaseException, where: str) -> NoReturn:
        """[Note: swap I/O failures] An update loop stopped part-way ``where``: some units
        hold this step's states and others the last one's, so the engine refuses to go on
        (a fatal failure) whatever stopped it: a swap I/O error (re-raised as an OSError
        with the message), an interrupt, a failed collective [zero] or a bug (re-raised as
        itself, the message in a note)."""
        cause = f"swap I/O failed ({error})" if isinstance(error, OSError) else \
            f"{type(error).__name__} ({error})" if str(error) else type(error).__name__
        self.failure = {"fatal": True, "message": (
            f"{cause} {where}; some units were updated and others not, so the in-memory state "
            "mixes two steps: resume from the last checkpoint (engine.load_checkpoint(DIR) or "
            "a new process)")}
        if isinstance(error, OSError):
            raise OSError(error.errno, self.failure["message"]) from error
        raise with_note(error, self.failure["message"])

    def fail_step_unless_recorded(self, error: BaseException, where: str) -> NoReturn:
        """``error`` stopped step() ``where``: raise it, the engine failed (fail_step) unless
        the code that raised it recorded a failure already (a fatal one, or the swap writes
        held in host RAM). A step that raised may have updated any number of units and left
        device copies stale, so it is never a consistent outcome."""
        if self.failure is not None:
            raise error
        self.fail_step(error, where)

    def close(self, finish: List[Callable[[], None]], release: List[Callable[[], None]],
              write_errors: Callable[[], List[Tuple[Any, OSError]]]) -> None:
        """Engine.close(): run every ``finish`` (wait for what is in flight) and every
        ``release`` (threads, hooks, swap files and their lock), each whatever the others
        raised; then raise the first error, or report the swap writes of a deferred step
        that failed (``write_errors()``: (unit, error) pairs), whose states are lost now."""
        errors: List[BaseException] = []
        for action in (*finish, *release):
            try:
                action()
            except BaseException as error:  # noqa: B902 - raised below, once all is released
                errors.append(error)
        if errors:
            raise errors[0]
        failed_writes = write_errors()
        if failed_writes:
            (unit, first), *_ = failed_writes
            raise OSError(first.errno, f"close(): swap writes of the last optimizer step failed (unit "
                          f"{unit.name!r}: {first}), so that step is lost; call save_checkpoint(DIR) "
                          "before close() to keep it")

    # ------------------------------------------------------------------ which modules it holds
    # Every module of a wrapped model, to the state of the engine that wrapped it: its
    # parameters hold placeholders from then on, so wrapping it (or a model sharing a
    # module with it) again must be refused before anything is touched.
    _holders: "weakref.WeakKeyDictionary[nn.Module, FailureState]" = weakref.WeakKeyDictionary()

    @staticmethod
    def check_not_wrapped(model: nn.Module) -> None:
        """ValueError when a module of ``model`` belongs to a model an engine wrapped."""
        for name, module in model.named_modules():
            holder = FailureState._holders.get(module)
            if holder is not None:
                what = f"module {name!r} of the model" if name else "the model"
                state = (f"an engine that is closed now, and its parameters hold no values any more "
                         f"(close() could not give them back: {holder.not_restored}); build the model again and "
                         "wrap it with weights=DIR from an engine.save_pretrained(DIR) made before close(), or "
                         "load a checkpoint into the new engine") if holder.closed else \
                    ("a live engine: train, evaluate and save it through that engine (an OffloadTrainer's "
                     "trainer.engine), or close that engine first (engine.close() or trainer.close()): close() "
                     "gives the model its trained values back, and it can be wrapped again")
                raise ValueError(f"wrap: {what} was wrapped before, by {state}")

    def hold(self, model: nn.Module) -> None:
        """``model`` is wrapped by the engine of this state (after wrap succeeded)."""
        for module in model.modules():
            FailureState._holders[module] = self

    def let_go(self, model: nn.Module) -> None:
        """``model`` holds its values again ([Note: the model after close]): it may be wrapped again."""
        for module in model.modules():
            if FailureState._holders.get(module) is self:
                del FailureState._holders[module]
