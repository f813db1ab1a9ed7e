"""The optimizer update scheduler: when each unit's Adam runs, on the main thread in
step() or on the optimizer worker, early (during backward: [Note: early updates]) or
deferred (after step() returned: [Note: deferred updates]), and what waits for it.

``UpdateScheduler`` owns the worker's queue (a heap, best first), its lock and the
tickets of what is queued, and whether a deferred step is pending; each unit's part is
its ``UnitUpdate`` record (``u.update``, [Note: update states]). The engine builds it
once at wrap and hands it the mechanisms it drives: the update paths (``UpdatePaths``: the
staged step, the [zero] sharded step and Adam over a unit, UnitAdam, which also snapshots
the param groups an update runs with), the prefetcher, the gradients, the residency and the
failure state. It owns the optimizer worker (one thread) and shuts it down
(``shutdown_worker``), and builds the delayed updates over the same collaborators.

[Note: speculative updates] With max_grad_norm, fp16 or skip_nonfinite_steps the step needs
the global gradient norm before any update, and the norm is known only when backward ends.
Instead of holding every update until then (the serialized path: norm, then Adam over every
unit in step()), a unit done in backward is updated at once on the optimizer worker as if
the step's gradient factor were the loss scale's inverse alone (clip coefficient 1, no
skip), into its *spare homes* (``UnitState.spare``: a second master, moments (or compact
home, [Note: compact optimizer states]) and compute copy at home, same tiers and sizes,
allocated at wrap; host-homed states are read at home and the results written there in
one pass, [Note: out-of-place Adam]; compact ones are copied there and stepped). Its homes, its step
counts and its gradients are left as they were. It never fills a slot, but it writes a
resident device copy as a non-speculative update does, once the pass needs no other unit
([Note: updates through the device copy]): that copy then holds the speculative result, and
goes wherever the result does not become the unit's state (a dropped speculation below, a
forward before step(), zero_grad(), a failed backward: ``release_speculative_copies``).

step() first takes back the speculative updates the worker has not started
(``_take_back_speculation``, QUEUED -> IDLE in [Note: update states]; counted in
``taken_back_updates``, not in ``speculative_updates`` or ``early_updates``):
nothing of theirs was written, the norm takes their squares from the gradients, and the
step updates those units with its own factor like units never updated (deferred to the next
forward with the rest, where they can fill slots, [Note: deferred updates]). It waits for
the one running, takes the norm, and then (``_resolve_speculation``):
- no clipping (torch's coefficient ``max_norm / (norm + 1e-6)`` is >= 1, so the serialized
  factor equals the speculated one to the bit) and no skip: each unit's spare homes and
  step counts become its homes (a swap of references, ``UnitState.commit_spare``); the old
  homes are the next step's spares;
- clipping: the speculative results are dropped (with the device copies they wrote) and
  those units are updated by the step from their untouched homes and kept gradients with
  the true factor, like units never updated (``redone_updates``);
- a skipped step (fp16 overflow, skip_nonfinite_steps): dropped, nothing else.

Either way every unit's new state is what the serialized path computes, bit for bit: the
kernel runs on the same inputs with the same factor, and the norm sums the same
per-parameter squares in the same order (``UnitState.early_grad_squares``). A speculative
swap write that fails leaves the homes intact: that unit is redone whatever the norm
(``speculation_failed``). So is one whose update raised (Adam, a gradient read-back, a bug):
``finish_optimizer`` takes it back to IDLE with a warning, its device copy dropped, and the
step updates it like a unit never updated, its squares taken from the kept gradients.
Until step() the homes hold the last step's state, so state_dict() or a checkpoint between
backward and step() is consistent, and a backward that fails after speculative updates
only is still consistent ([Note: failures inside a step]). The spare homes include the
compute copy's frozen tail, which no update writes: ``Homes.store_compute`` writes it to
both copies (wrap, checkpoint load).

A backward after a step that clipped does not speculate (``UpdateScheduler.speculate``; a skipped step
changes nothing): clipping tends to go on for a while (a fresh model's norm is far above
max_grad_norm), and each redo costs the update twice; that step's updates run once the
norm is known, deferred ([Note: deferred updates]), and speculation resumes after a step
that did not clip.

Cost: every state an early update writes twice on its tier (on by
default only with the states on NVMe: ``speculative_updates``); the root, updated in
step() only, has no spare homes (``Layout.has_spare``). Left to the engine (None),
speculation takes only the swap space there is: when the swap directory cannot hold every
spare beside the run, the units backward finishes first get theirs while they fit
(``memory.placement.fit_spares_to_swap``, with a warning) and the others are updated once
the norm is known, deferred to the next forward ([Note: deferred updates]). Not with
param_tier "device" (the update writes the device copy itself) or [zero] with several
ranks where they have no early updates (below stage 2, or stage 2 with compute copies not
on the host: [Note: early updates across ranks]).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

from offload import faults
from offload.errors import warn_at_caller
from offload.memory.layout import Layout, UnitState
from offload.memory.residency import DeviceResidency
from offload.optim.delayed import DelayedUpdates
from offload.optim.failure import FailureState, wait_through_interrupts, with_note
from offload.optim.gradients import Gradients
from offload.optim.paths import UpdatePaths
from offload.prefetch import Prefetcher
from offload.tiers.context import TierContext
from offload.units import Residency

__all__ = ["UpdateScheduler"]


class UpdateScheduler:
    """Runs the optimizer step and the early and deferred updates of every unit.

    Threads ([Note: threads] in memory/layout.py): the main thread calls every public
    method; the optimizer worker runs
    ``_run_next_update`` (one update at a time) and nothing else. ``lock`` guards the
    heap and the QUEUED -> RUNNING move against a fill being attached meanwhile
    ([Note: update states]); the residency code takes it for that (``prefetch_updating``).
    """

    def __init__(self, units: List[UnitState], *, layout: Layout, tiers: TierContext, paths: UpdatePaths,
                 prefetcher: Prefetcher, gradients: Gradients, residency: DeviceResidency,
                 status: FailureState) -> None:
        """``units``: every unit, the root first. ``tiers``: its counters and timeline are what
        it records in. ``paths``: how a unit's update runs (the staged step, [zero] the
        sharded step at stage >= 1, Adam in place on host homes) and [zero] the Partition of
        several ranks, or None. ``prefetcher``: the order of the passes, which early updates
        and deferred ones follow. ``gradients``: the gradients the updates read, whose norm,
        factor and skip decision the step takes and which zero_grad drops. ``residency``:
        the device copies an update makes stale (dropped on the main thread), releases, the
        fetches it lands and those it brings behind updates. ``status``: the engine's failure
        state (refuse when failed, stop after a step failed part-way). The scheduler counts
        the micro-steps (``micro_step``: the engine's step() calls so far)."""
        self._units = units
        self._root = units[0]
        self._layout = layout
        # Early optimizer updates (a unit's Adam as soon as its gradients are final in backward;
        # when, see Layout.early_allowed) run on this worker, overlapping the rest of backward.
        # [zero] Collectives run only on the main thread (this also skips the root prestage).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-adam")
        self._paths = paths
        self._step_ring, self._sharded_step, self._partition = paths.ring, paths.sharded, paths.partition
        self._prefetcher = prefetcher
        self._stats, self._timeline = tiers.stats, tiers.timeline
        self._mark_stale = residency.mark_stale
        self._forget_stale = residency.forget_stale
        self._gradients = gradients
        self.micro_step = 0  # step() calls so far; a checkpoint keeps it
        self._check_not_failed = status.check
        self._check_open = status.check_open
        self._fail_step = status.fail_step
        self._update_in_place = paths.adam.update_in_place
        self._hyperparameters = paths.adam.hyperparameters
        self._release = residency.release
        self._drain_fetches = residency.drain_fetches
        self._land_fills = residency.land_fills
        self._prefetch_updating = residency.prefetch_updating
        self._start_fetch = residency.start_fetch
        # Set by the engine for the backward before an update (when, see
        # Layout.early_allowed): units may then be updated as soon as they are done.
        self.early_updates = False
        self._early_futures: List[Future] = []  # tickets of the updates queued on the worker
        # [Note: deferred updates] units waiting for the worker, best first: (priority,
        # sequence, unit index, unit, hyperparameters, gradient factor, ticket, fault point)
        self._heap: List[Tuple[float, int, int, UnitState, List[Dict[str, Any]], float, Future, str]] = []
        # [Note: speculative updates] the gradient factor this backward's speculative
        # updates used (the loss scale's inverse), and whether settle_all still has to take
        # the deferred step's norm (not when step() took it before deferring)
        self._speculated_factor = 1.0
        self._norm_pending = False
        # [Note: speculative updates] whether the next backward speculates: the last step
        # that was not skipped did not clip (its speculation was kept), or none ran yet
        self.speculate = True
        self.lock = threading.Lock()
        self._sequence = itertools.count()
        self.step_pending = False  # a deferred step's updates or bookkeeping are not done
        # [Note: early updates across ranks] stages 1-2: the last backward settled its units,
        # whose early updates (on any rank) owe their all-gathers to the step (set by the engine)
        self.gathers_owed = False
        # [Note: delayed updates] None unless delayed_update
        self.delayed: Optional[DelayedUpdates] = DelayedUpdates(
            units, layout=layout, tiers=tiers, paths=paths, worker=self, gradients=gradients, residency=residency,
            failures=status) if layout.delayed_update else None

    def submit_update(self, run: Callable[..., None], *args: Any) -> Future:
        """Run ``run(*args)`` on the optimizer worker after what is queued there (the delayed
        updates' OptimizerWorker port); ``finish_optimizer`` waits for it with the rest."""
        ticket = self._worker.submit(run, *args)
        self._early_futures.append(ticket)
        return ticket

    def shutdown_worker(self) -> None:
        """Stop the optimizer worker once what it runs has finished (close())."""
        self._worker.shutdown(wait=True)

    def zero_grad(self) -> None:
        """Drop every unit's gradients: the updates still queued run first ([Note: update
        states]), the device copies speculative updates wrote go ([Note: speculative
        updates]); a delayed update keeps its unit's ([Note: delayed updates])."""
        self.settle_all()
        self.wait_queued()
        self.release_speculative_copies()
        if self.gathers_owed:  # [zero] a zero_grad() in place of the step after early updates
            self.gathers_owed = False
            self._sharded_step.run([], 1.0, self.micro_step,
                                   updated_early=[u for u in self._units if any(u.has_grad)])
        for u in self._units:
            for e in u.trainable:  # one a failed hand-off left ([Note: failures inside a step])
                e.param.grad = None  # never a delayed update's: those took theirs off the parameter
            if u.delayed_update is not None:  # [Note: delayed updates] its gradients are the update's
                continue
            u.has_grad = [False] * len(u.trainable)
            u.update.reset()
            self._gradients.release(u)
        self._gradients.drop_partials()  # [Note: shared parameter gradients]
        if self._partition is not None:  # [zero]
            self._partition.zero_grad()

    def wait_queued(self) -> None:
        """Wait for the updates still queued when no step() came since backward (zero_grad
        then drops the gradients they read, [Note: update states]); not for delayed ones,
        whose gradients zero_grad leaves alone ([Note: delayed updates])."""
        if self._early_futures and self.delayed is None:
            self.wait_optimizer()

    def quiesce(self, raise_errors: bool = True) -> None:
        """Nothing in flight afterwards: early and delayed updates done (the gradient fields
        back from the delayed ones), fetches landed."""
        self.settle_all(raise_errors)
        try:
            if self.delayed is not None:
                self.delayed.wait()
                self.delayed.take_back_all()
            self.wait_optimizer()
        except BaseException:  # noqa: B902 - recorded as the engine's failure either way
            if raise_errors:
                raise
        self._drain_fetches()

    def overlapping(self) -> bool:
        """The last step's updates run on under the next forward, which must not wait for
        the worker: deferred ones ([Note: deferred updates]) or delayed ones ([Note: delayed
        updates])."""
        return self.step_pending or (self.delayed is not None and self.delayed.in_flight())

    def settle_for_reading(self) -> None:
        """Before reading the units' current values: the deferred step settled, the delayed
        updates done ([Note: delayed updates]: then read through ``read_committed``)."""
        self.settle_all()
        if self.delayed is not None:
            self.delayed.wait()

    def settled_values(self, what: str) -> Callable[[UnitState], Dict[int, Any]]:
        """The reader of a unit's current values (``values_reader``), refused (RuntimeError)
        when the engine is closed."""
        self._check_open(what)
        return self.values_reader(what)

    def values_reader(self, what: str, step_finished: bool = False) -> Callable[[UnitState], Dict[int, Any]]:
        """The reader of a unit's current values (``PipelinedStep.unit_values``: element
        offset -> tensor), once this step's updates are all done or none started: a
        RuntimeError naming ``what`` between early updates and step(), unless
        ``step_finished`` (close() waited for a deferred step whose bookkeeping it skips,
        so units marked updated hold that whole step). [Note: delayed updates] a pending
        delayed update's result is read (``read_committed``)."""
        self.settle_for_reading()
        early = [] if step_finished else self.updated_early()
        if early:
            raise RuntimeError(
                f"{what}() between backward() and step(): the optimizer already updated {len(early)} "
                f"unit(s) during backward ({', '.join(early[:4])}{', ...' if len(early) > 4 else ''}) "
                "and not the others yet, so the weights would mix two steps; call it after step()")
        return lambda u: self.read_committed(u, lambda: self._step_ring.unit_values(u))

    def training_counters(self) -> Dict[str, Any]:
        """The scalar training state as a checkpoint keeps it (checkpoint.access.TrainingState):
        the micro-steps counted here, the loss scale, good steps and last norm of the gradients."""
        gradients = self._gradients
        return {"micro_step": self.micro_step, "loss_scale": gradients.loss_scale,
                "good_steps": gradients.good_steps, "last_grad_norm": gradients.last_grad_norm}

    def restore_training_counters(self, counters: Dict[str, Any]) -> None:
        """Set the counters that ``training_counters()`` returned (a checkpoint load)."""
        gradients = self._gradients
        self.micro_step, gradients.loss_scale = counters["micro_step"], counters["loss_scale"]
        gradients.good_steps, gradients.last_grad_norm = counters["good_steps"], counters["last_grad_norm"]

    def held_states(self, u: UnitState) -> Dict[str, Any]:
        """[Note: swap I/O failures] u's states whose swap write failed, held in host RAM by
        the staged step and current: "master" and/or "moments"; {} when none."""
        return self._step_ring.dirty.get(u.index, {})

    def forget_held_states(self) -> None:
        """Drop every host copy of a failed swap write (stale after a checkpoint load)."""
        self._step_ring.dirty.clear()

    def read_committed(self, u: UnitState, read: Callable[[], Any]) -> Any:
        """``read()`` of u's values with a pending delayed update's result in its homes."""
        return read() if self.delayed is None else self.delayed.read_committed(u, read)

    def committed_view(self) -> Any:
        """A context in which every unit's homes hold its true state ([Note: delayed updates])."""
        return contextlib.nullcontext() if self.delayed is None else self.delayed.committed_view()

    def step(self) -> None:
        """The optimizer step of Engine.step (every accumulation_steps-th call): deferred
        to the worker when it can be, else the updates not run early, here and now."""
        self._check_not_failed("step")
        self.settle_all()
        self.gathers_owed = False  # [Note: early updates across ranks] this step gathers (or skips)
        if self.delayed is not None:  # [Note: delayed updates] steps 1-3: the last step's updates committed
            self.delayed.wait()
            self.delayed.take_back_all()
            self.delayed.commit()
        if self.defers_updates() and self._layout.early_allowed and not self._layout.speculative:
            # the norm can wait for the updates (early_allowed without speculation: no clipping, fp16 or skips)
            self._defer_updates(1.0, norm_pending=True)
            return
        if self._layout.speculative:
            self._take_back_speculation()
        self.wait_optimizer()
        if self._partition is not None:  # [zero] agree on has_grad; average stage 0/1 grads
            self._partition.finish_gradients(self._units)
        grad_factor, skip = self._gradients.scale_and_skip(self.micro_step)
        self._resolve_speculation(keep=not skip and grad_factor == self._speculated_factor, skip=skip)
        if not skip:  # a skip (fp16 overflow) says nothing about the next step's norm
            self.speculate = not self._gradients.clipped
        delayed = self.delayed is not None and self.delayed.delays(skip, self._gradients.clipped)
        if skip:
            self._stats.count("skipped_steps")
            self._step_ring.wait_root_reads()
            self.zero_grad()
            return
        if self.defers_updates():
            self._defer_updates(grad_factor, norm_pending=False)
            return
        if delayed:  # [Note: delayed updates] steps 4-5
            self.delayed.queue(self._hyperparameters(), grad_factor)
            return
        units = [u for u in self._units if any(u.has_grad) and not u.update.updated]
        try:
            with self._stats.timed("optimizer"):
                if self._sharded_step is not None:  # [zero] stage >= 1 ([Note: early updates across ranks])
                    self._sharded_step.run(units, grad_factor, self.micro_step, updated_early=[
                        u for u in self._units if any(u.has_grad) and u.update.updated])
                elif self._layout.staged_step:
                    self._step_ring.staged_update(units, grad_factor, self.micro_step)
                else:
                    self._update_all_in_place(units, grad_factor)
        finally:  # also after a swap failure: the step is over either way
            self._step_ring.drain_root_reads()  # the root got no gradient this step
            self.zero_grad()
            # Device copies are stale now, except those the update wrote in place.
            self._drain_fetches()
            self._forget_stale()
            if self._layout.param_tier != "device":
                for u in self._units:
                    if u.compute_state == Residency.LOADED and not u.update.in_device:
                        self._release(u)
                    u.update.in_device = False
        self._step_ring.raise_write_errors(self.micro_step)

    def _take_back_speculation(self) -> None:
        """[Note: speculative updates] The speculative updates the worker has not started
        come off its queue: the norm takes their squares from the gradients, as for a unit
        never updated, and the step updates those units with its own factor (deferred with
        the rest, or here), instead of waiting for them, then committing or redoing them."""
        with self.lock:  # every entry on the heap is QUEUED: the worker pops and starts under it
            taken = [entry for entry in self._heap if entry[3].update.speculative]
            if not taken:
                return
            self._heap = [entry for entry in self._heap if not entry[3].update.speculative]
            heapq.heapify(self._heap)
            for entry in taken:
                entry[3].update.take_back()
        tickets = [entry[6] for entry in taken]
        self._early_futures = [f for f in self._early_futures if not any(f is t for t in tickets)]
        for ticket in tickets:  # nobody waits for it; the worker's turn for it finds nothing
            ticket.set_result(None)
        self._stats.count("early_updates", -len(taken))
        self._stats.count("speculative_updates", -len(taken))
        self._stats.count("taken_back_updates", len(taken))

    def _resolve_speculation(self, keep: bool, skip: bool) -> None:
        """[Note: speculative updates] The norm is known and every speculative update is
        done (wait_optimizer): ``keep`` (no clipping, no skip) commits them, each unit's
        spare homes becoming its homes; otherwise they are dropped, and, unless the step is
        ``skip``-ped, redone by the step like units never updated (their homes were not
        written). A unit whose spare write failed is redone either way."""
        for u in self._units:
            if not u.update.speculative:
                continue
            if keep and not u.update.speculation_failed:
                u.commit_spare()
                u.update.speculative = False
                self._gradients.release(u)
            else:
                if u.update.in_device:
                    self._release(u)  # its device copy holds the dropped update
                u.update.reset()  # DONE -> IDLE: the step updates it from its homes (or skips it)
                if not skip:
                    self._stats.count("redone_updates")

    def release_speculative_copies(self) -> None:
        """[Note: speculative updates] Drop the device copies that speculative updates not
        yet committed wrote: before a forward between backward and step() (it computes with
        the weights of the last step, as plain PyTorch does), and in zero_grad() (the
        speculation is dropped; a failed backward calls it too). Their spare homes are left
        as they are."""
        for u in self._units:
            if u.update.speculative and u.update.in_device:
                self._release(u)

    def updated_early(self) -> List[str]:
        """The units updated during backward whose step has not come ([Note: early updates];
        a speculative update wrote spare homes only). [zero] Between a backward that settled
        its units and the step, any rank's list, agreed on by a collective, so that every
        rank refuses a read alike ([Note: early updates across ranks])."""
        names = [u.name for u in self._units if u.update.updated and not u.update.speculative]
        if self._partition is not None and self._partition.settled_any:
            everyone = self._partition.all_gather_object("early-update check", names)
            names = next((n for n in everyone if n), [])
        return names

    def wait_before_forward(self) -> None:
        """What a forward waits for when no deferred or delayed step is pending: every
        queued update, and the release of speculative device copies."""
        self.wait_optimizer()
        self.release_speculative_copies()

    def _update_all_in_place(self, units: List[UnitState], grad_factor: float) -> None:
        """The step's updates of host-homed units, one after the other: stopping part-way
        mixes two steps, which is fatal ([Note: failures inside a step])."""
        done = 0
        try:
            for u in units:
                self._update_in_place(u, grad_factor)
                done += 1
        except BaseException as error:
            where = f"unit {units[done].name!r}" if done < len(units) else "a unit"
            self._fail_step(error, f"in the optimizer step at micro-step {self.micro_step} while working on {where}")

    def abort_backward(self, error: BaseException) -> None:
        """[Note: failures inside a step] backward raised ``error``: raise it, the engine
        either failed (an early update was queued: that unit has this step's update, the
        others never will) or consistent (none was: the partial gradients are dropped as by
        zero_grad, the weights and states are those before this backward)."""
        self.early_updates = False
        # [zero] a failed backward runs no more collectives: the other ranks may be anywhere
        self.gathers_owed = False
        self._step_ring.drain_root_reads()  # nothing is left reading into a slot
        # [Note: speculative updates] a speculative update wrote spare homes only
        queued = [u.name for u in self._units if u.update.updated and not u.update.speculative]
        update_failed = False
        try:
            # what was queued runs to its end: nothing moves afterwards (a second interrupt
            # meanwhile is dropped: ``error`` is raised either way)
            self.finish_optimizer()
        except BaseException:  # noqa: B902 - fatal either way, reported with ``error`` below
            update_failed = True
        if queued:
            self._fail_step(error, f"in backward, after {len(queued)} unit(s) were updated early "
                                   f"({', '.join(queued[:4])}{', ...' if len(queued) > 4 else ''})")
        if update_failed:
            # an update on the worker failed (wait_optimizer recorded it: fatal, not consistent),
            # e.g. [Note: delayed updates] the last step's, which the gradient hand-off raised
            raise error
        self.zero_grad()  # with the device copies that speculative updates wrote
        raise with_note(error, "backward failed before any unit was updated: the gradients accumulated "
                               "since the last optimizer step were dropped (as by zero_grad()); weights and "
                               "optimizer states are unchanged, so training can go on with the next batch")

    def maybe_update_early(self) -> None:
        """[Note: early updates] In the backward before an update, a unit is done for this
        pass when all its gradients came in since it was last needed and either the trace
        needs it no more, or every call it got in this pass has finished its backward
        (recomputation by activation checkpointing adds calls whose backward never fires:
        such units wait for the trace, or for step()). A done unit is updated right away on
        the optimizer worker, so its state I/O and Adam overlap the rest of backward; its
        device copy is then stale and is dropped on the main thread. Without either signal
        units wait for step(), which is always correct."""
        if not self.early_updates:
            return
        for u in self._units[1:]:
            if u.update.updated or not any(u.has_grad) or u.grads_since_use < len(u.trainable):
                continue
            if self._layout.speculative and u.spare is None:  # no spare homes: updated after the norm
                continue
            if self._partition is not None and not self._partition.settled(u):  # [zero] [Note: early
                continue  # updates across ranks] not reduced and agreed on by every rank yet
            trace_done = self._prefetcher.used_later(u.index) is False
            calls_done = 0 < u.calls <= u.backward_done
            if trace_done or calls_done:
                self._stats.count("early_updates")
                factor = 1.0
                if self._layout.speculative:  # [Note: speculative updates] into the spare homes
                    u.update.speculative = True
                    factor = self._speculated_factor = 1.0 / self._gradients.loss_scale
                    self._stats.count("speculative_updates")
                # [Note: updates through the device copy] only once the pass needs no
                # other unit: until then its slot may be wanted for the next ones (a
                # speculative update too: the copy goes if the update is dropped)
                u.update.in_device = self._prefetcher.pass_complete and self._step_ring.device_copy_updatable(u)
                self.queue_update(u, self._hyperparameters(), factor, math.inf, "optim.early_update")  # arrival order
                if self._layout.param_tier != "device" and not u.update.in_device:
                    self._mark_stale(u)

    def queue_update(self, u: UnitState, groups: List[Dict[str, Any]], grad_factor: float, priority: float,
                     point: str) -> None:
        """Queue u's update (gradients times ``grad_factor``) on the optimizer worker;
        u.update.ticket completes with it. The worker takes the lowest ``priority`` first,
        then the order of queueing; ``point``: the fault point the update hits when it
        starts (early or deferred)."""
        ticket: Future = Future()
        with self.lock:
            u.update.queue(ticket)  # [Note: update states]
            heapq.heappush(self._heap, (priority, next(self._sequence), u.index, u, groups, grad_factor, ticket, point))
        self._early_futures.append(ticket)
        self._worker.submit(self._run_next_update)

    def _run_next_update(self) -> None:
        """On the optimizer worker: the best queued update (one per queue_update call)."""
        with self.lock:
            if not self._heap:  # its update was taken back ([Note: speculative updates])
                return
            _, _, _, u, groups, grad_factor, ticket, point = heapq.heappop(self._heap)
            u.update.start()  # from here on no fill is attached (_prefetch_updating)
        try:
            faults.hit(point, unit=u.name)
            self._update_early(u, groups, grad_factor)
        except BaseException as error:  # noqa: B902 - reported through the ticket
            ticket.set_exception(error)
        else:
            ticket.set_result(None)

    def _reprioritize(self, priority: Callable[[UnitState], float]) -> None:
        with self.lock:
            self._heap = [(priority(u), n, i, u, g, f, t, p) for _, n, i, u, g, f, t, p in self._heap]
            heapq.heapify(self._heap)

    def defers_updates(self) -> bool:
        """[Note: deferred updates] Whether step() leaves the updates to the optimizer
        worker and returns: optimizer states on NVMe, prefetch on, one rank, no delayed
        updates. Under clipping (fp16, skips) without speculation, step() takes the norm
        first, from the finished backward, and defers the updates with the true factor."""
        return self._layout.overlap_step_with_forward and self._layout.staged_step and self._prefetcher.enabled \
            and self._partition is None and self.delayed is None

    def _defer_updates(self, grad_factor: float, norm_pending: bool) -> None:
        """[Note: deferred updates] step() without waiting for Adam: the units not updated
        during backward are queued on the optimizer worker, and everything still queued
        there is reordered to the order in which the next training forward needs the
        units (the root first), so that forward starts as soon as its first units are
        done and overlaps the rest of the updates. Each unit's fetch waits for its own
        update (settle_unit); the step's bookkeeping (gradient norm, zero_grad, write
        errors) is finished by the next backward, step, zero_grad, state_dict, checkpoint
        or close (settle_all), which is also where a failed update is raised.
        ``norm_pending``: the step's norm is taken there too, from the updates' squares
        (without clipping or skips); else step() took it and ``grad_factor`` is its factor
        (clipping, fp16 or skips: after speculative updates, or without them, when every
        unit's update is deferred with the clip coefficient, none having run in backward)."""
        first_use: Dict[int, int] = {}
        key = self._prefetcher.last_train_key
        for position, index in enumerate(self._prefetcher.first_units(key) if key is not None else ()):
            first_use.setdefault(index, position)

        def priority(u: UnitState) -> float:
            return -1.0 if u is self._root else float(first_use.get(u.index, len(first_use)))

        groups = self._hyperparameters()
        self._drain_fetches()  # what is in flight lands before device copies are judged
        for u in self._units:
            if any(u.has_grad) and not u.update.updated:
                u.update.in_device = self._step_ring.device_copy_updatable(u)
                self.queue_update(u, groups, grad_factor, priority(u), "optim.deferred_update")
                self._stats.count("deferred_updates")
        self._reprioritize(priority)
        self._forget_stale()
        for u in self._units:  # device copies that the updates do not write are stale now
            if u.compute_state == Residency.LOADED and not u.update.in_device:
                self._release(u)
        self._norm_pending = norm_pending
        self.step_pending = True

    @property
    def norm_pending(self) -> bool:
        """A deferred step's gradient norm is still to be taken (settle_all takes it)."""
        return self.step_pending and self._norm_pending

    def pending(self, u: UnitState) -> bool:
        """u's queued update, or its swap writes, are not done yet."""
        return u.update.ticket is not None and (
            not u.update.ticket.done() or not all(h.done() for h in u.update.home_writes))

    def settle_unit(self, u: UnitState) -> None:
        """[Note: deferred updates] Wait for u's queued update; a failed one stops the
        engine (see wait_optimizer)."""
        ticket = u.update.ticket
        if ticket is None:
            return
        with self._stats.timed("optimizer_wait"):
            interrupt = wait_through_interrupts([ticket])  # [Note: interrupts while waiting]
            try:
                for handle in u.update.home_writes:  # the home is current before anything reads it
                    handle.wait()
            except OSError:
                self.settle_all()  # waits for the rest and reports the failed write
                raise
        u.update.forget()
        if ticket.exception() is not None or self._step_ring.write_errors:
            self.settle_all()  # raises: a failed update, or a home this fetch may read is not written
        if interrupt is not None:
            raise interrupt

    def settle_all(self, raise_errors: bool = True) -> None:
        """[Note: deferred updates] Finish the last deferred step: wait for its updates,
        then take the gradient norm, zero the gradients and report swap write failures
        (recorded as the engine's failure either way; raised when ``raise_errors``)."""
        if not self.step_pending:
            return
        self.step_pending = False
        interrupt = landed = None
        try:
            try:
                interrupt = self.finish_optimizer("in the last optimizer step, whose updates ran on after "
                                                  "step() returned (overlap_step_with_forward=True)")
            finally:
                landed = self._land_fills()
                for u in self._units:
                    u.update.forget()
            if self._norm_pending:  # the norm (and a warning for NaN/Inf) from the early squares
                self._norm_pending = False
                self._gradients.scale_and_skip(self.micro_step)
            self.zero_grad()
            self._step_ring.raise_write_errors(self.micro_step)
        except BaseException:
            if raise_errors:
                raise
        interrupt = interrupt or landed
        if interrupt is not None:  # [Note: interrupts while waiting] once the step's bookkeeping is done
            raise interrupt

    def _update_early(self, u: UnitState, groups: List[Dict[str, Any]], grad_factor: float) -> None:
        start = time.perf_counter()
        # One square per parameter, summed into the norm in the step's own order, so that the
        # norm does not depend on which units were updated early ([Note: speculative updates]:
        # the clip coefficient is the serialized path's).
        u.early_grad_squares, u.early_nonfinite = [], None
        if self._partition is not None:  # [zero] this rank's terms ([Note: early updates across ranks])
            u.early_grad_squares = [term.item() for term in self._partition.local_grad_squares(u)]
        for k, e in enumerate(u.trainable if self._partition is None else ()):
            if u.has_grad[k]:
                square = self._gradients.squares(u, k).item()
                if u.early_nonfinite is None and not math.isfinite(square):
                    u.early_nonfinite = e
                u.early_grad_squares.append(square)
        self._paths.early(u, groups, grad_factor, self.micro_step)  # [zero] no collective at stage 3
        if u.update.speculative:  # its gradients wait for the norm, on NVMe if they came from there
            self._gradients.park(u)  # ([Note: gradient spill])
        # The whole unit, its I/O waits included ("adam" spans are the kernel alone).
        end = time.perf_counter()
        self._timeline.span("optimizer", f"update {u.name} (early)", start, end)
        self._stats.add_seconds("worker_updates", end - start)

    def wait_optimizer(self, where: Optional[str] = None) -> None:
        """Wait for early updates and their write-backs. A failed write is kept in host RAM
        and reported when the step ends ([Note: swap I/O failures]); any other failure there
        is fatal: the units updated early and the rest no longer belong to one step. An
        interrupt meanwhile is raised once all is done ([Note: interrupts while waiting])."""
        interrupt = self.finish_optimizer(where)
        if interrupt is not None:
            raise interrupt

    def finish_optimizer(self, where: Optional[str] = None) -> Optional[BaseException]:
        """``wait_optimizer``, returning the interrupt that came while it waited (or None)
        instead of raising it. ``where``: the updates waited for, for a failure's message
        (default: the early updates of backward, or the delayed ones)."""
        futures, self._early_futures = self._early_futures, []
        errors: List[BaseException] = []
        speculation_failed: List[Tuple[UnitState, BaseException]] = []
        owners = {id(u.update.ticket): u for u in self._units if u.update.ticket is not None}
        with self._stats.timed("optimizer_wait"):
            interrupt = wait_through_interrupts(futures)
            for f in futures:  # all done: their errors only
                try:
                    f.result()
                except BaseException as error:  # noqa: B902 - reported below, after draining
                    u = owners.get(id(f))
                    if u is not None and u.update.speculative:
                        speculation_failed.append((u, error))
                    else:
                        errors.append(error)
            for index in range(len(self._step_ring.slots)):
                try:
                    self._step_ring.finish_slot_writes(index)  # write failures are kept, not raised
                except OSError as error:
                    errors.append(error)
        for u in self._units:  # [Note: update states] (nothing reads the tickets meanwhile)
            if u.update.ticket in futures:
                u.update.finish()
        for u, error in speculation_failed:
            # [Note: speculative updates] it wrote the spare homes (and the device copy) only:
            # the step updates the unit from its homes and kept gradients, like one never updated
            if u.update.in_device:
                self._release(u)
            u.update.reset()
            self._stats.count("redone_updates")
            warn_at_caller(f"a speculative update of unit {u.name!r} failed ({type(error).__name__}: {error}); "
                           "its second copy of the states is dropped and the optimizer step updates the unit "
                           "from its homes, as if it had not run")
        if errors:
            self._land_fills()
            for u in self._units:  # a device copy the failed updates were writing into
                if u.update.in_device:
                    self._release(u)
            if where is None:
                where = "while updating units during backward" if self.delayed is None else \
                    "in a delayed update of the last optimizer step (delayed_update=True)"
            self._fail_step(errors[0], where)
        return interrupt

    def prefetch_next_pass(self) -> None:
        """After an update every device copy is gone: start bringing back the root and the
        first units of the next training pass while the caller prepares its batch."""
        if not self._prefetcher.enabled or self._prefetcher.last_train_key is None:
            return
        budget = self._layout.prefetch_units
        for index in self._prefetcher.first_units(self._prefetcher.last_train_key)[:budget]:
            u = self._units[index]
            if self.pending(u):
                if self._prefetch_updating(u):
                    continue
                break  # [Note: deferred updates] fetches go in the order of use
            if u.compute_state == Residency.HOME and not self._start_fetch(u, evict=False):
                break
        root = self._root
        if root.compute_state == Residency.HOME:
            if self.pending(root):
                self._prefetch_updating(root)
            else:
                self._start_fetch(root, evict=False)
