"""Delayed parameter updates: ZeRO-Offload's one-step delayed parameter update (Ren et al.,
"ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021), opt-in with
``delayed_update=True``.

[Note: delayed updates] The rule. Optimizer steps are counted k = 1, 2, ... (one per
accumulation_steps micro-steps: k = micro_step // accumulation_steps, which a checkpoint
restores). w_k is the state (fp32 master, moments, step counts) after step k's update, w_0
the one at wrap. Step k's update is always w_k = Adam(w_{k-1}, g_k), g_k the gradient that
step k's forward and backward took at the weights they used. Exact: step k+1's forward and
backward use w_k. Delayed: step k's update runs on the optimizer worker after step()
returned, and step k+1's forward and backward use w_{k-1} (the gradients are those of weights
one update old, as the paper describes). Step k's update is delayed iff k > W
(delayed_update_warmup_steps) and step k is neither skipped (fp16 overflow,
skip_nonfinite_steps) nor clipped (torch's clip_grad_norm_ coefficient max_norm / (norm +
1e-6) < 1): those *fall back* to exact steps, so the step after one uses its weights. Steps
1..W+1 thus use exact weights, step W+2's forward is the first one that reads weights one
update old, and w_k of a run with W >= k equals the exact run's bit for bit.

Where the two states live. Every trainable unit has spare homes (``Layout.spare_homes``,
counted by memory/budget.py): a second compute copy, on the compute copy's tier; their
master and moments are the unit's own (``Layout.spare_states`` is false). The homes' compute
copy is always the one the forward reads: w_{k-1}'s while step k's update is pending. The
update reads the homes and writes w_k's compute copy and step counts into the spare homes,
and its master and moments in place, through the speculative updates' paths
(``PipelinedStep.update_early`` with ``into_spare``, ``UnitAdam.update_in_place`` with
``speculative``: out-of-place writes whose master and moments targets are their sources), and
never touches the device copy. Nothing waits for it before the next step(): no ticket on
``u.update`` (so residency's fetches read the homes at once), and Hooks' root forward does
not wait for the worker while it runs (``UpdateScheduler.overlapping``). step() k+1 then, in
this order:
1. waits for every delayed update and its writes; a failure of either is fatal ([Note:
   failures inside a step]): master and moments are half-written;
2. takes back the gradient fields of units that got no gradient in this step (below);
3. commits: each pending unit's spare compute copy becomes its compute copy
   (``UnitState.commit_spare``, a swap of references; the old copy is the next spare one),
   and its device copy, now stale, is dropped;
4. takes the norm and decides: delayed, or an exact step (the serialized one, unchanged);
5. delayed: queues each unit with a gradient on the worker, in the order the next backward
   reaches them (``queue``).
Only the compute copy is doubled because only it is read while the update runs: master and
moments are read by the update alone, and by readers that wait for it first (step(),
checkpoints, state_dict). A failed update is fatal either way, so a second master and
moments would keep nothing a run can use, and would double the states' RAM, so that auto
placement keeps fewer of them off the disk. The merged fp32 master is a compute copy (its
spare is a second master); the split master's high halves are the compute copy, its low
halves are written in place with the moments. The warm-up and fallback steps run the exact
step on the same buffers, bit for bit.

Gradients. A delayed update reads u's gradient fields (has_grad, grad or param_grads, a
spilled copy) while the next backward produces new ones. It owns them from step() on
(``u.delayed_update`` is its ticket) and gives the buffers back itself when done, as a
non-speculative update does; the main thread takes the fields back (``Gradients.take_back``:
waits for the ticket, counted in ``delayed_grad_waits``, then clears has_grad) at the unit's
first gradient hand-off of the next backward, in step() for units that got none, and before
checkpoints. We wait rather than double-buffer: no second set of gradient buffers, and since
the updates are queued in the order backward reaches the units, an update has mostly run
during the forward by then. zero_grad leaves such units alone (their gradients are the update's, the
user's step is over), and no such unit is spilled ([Note: gradient spill]).

Reading. state_dict, save_pretrained and checkpoints see the true weights w_k: after waiting,
each pending unit's homes and spare homes are swapped for the read and swapped back
(``committed_view``, ``read_committed``). A checkpoint saved with updates pending records it
per unit (``units[i].delayed_pending`` in the manifest) with the trainable values of the
copy the forward reads (each trainable piece's fp32 ``lagging`` section); load writes w_k as
always, then swaps it into the spare homes and writes the lagging copy into the homes
(CheckpointAccess.restore_lagging), so the resumed run goes on bit for bit. Checkpoints
without the field load with nothing pending.

Not with param_tier "device" (the update would write the copy the forward reads), or early
and speculative updates (the norm is known in step(), where every update starts): the
warm-up and fallback steps thus run the serialized step, without the overlap with backward
that early updates give.

[Note: delayed updates across ranks] [zero] With several ranks each rank delays the update
of what it keeps, and the rule above holds for the whole run: the norm and the skip are
all-reduced, so every rank delays or falls back alike, and the units with a gradient (the
flags agreed in finish_gradients) are queued in one order on every rank.
- Stage 0: each rank updates every unit, as one process does (no collective in the update).
- Stage 3: ``ShardedStep.run(speculative=True)`` updates the rank's shard and writes its
  chunk of the compute copy into the spare chunk; no collective: after the commit the next
  fetch gathers every rank's committed chunk, and until then every rank's homes hold the
  lagging chunks, so the forward gathers w_{k-1} everywhere.
- Stages 1-2: the update writes the rank's part of the spare compute copy (in full
  coordinates: the spare host tensor, or with the copy on NVMe the buffer the home's copy
  was read into, then written whole to the spare extent), and all-gathers the other
  ranks' parts into it before that write, on the optimizer worker, over the
  Partition's "param" lane (its own process group; the copy worker issues nothing there
  below stage 3). The workers of all ranks run the same updates in the same order, so the
  gathers match; no thread waits for another rank's main thread meanwhile. So the spare
  copy is whole when the update is done, and the commit, readers (``committed_view``) and
  checkpoints see w_k as one process does; nothing is owed to step().
Gradients: a stage >= 2 backward lands each unit's reduce-scattered shard in its host buffer,
a unit this rank gave no gradient included (its zeros, in ``_after_backward``), so
``Gradients.land_shard`` takes the fields back first; and queue() clears the partition's
per-step record (``Partition.zero_grad``: the next backward's shards are copied, not added),
as zero_grad() does after an exact step. A checkpoint's lagging section is written per
trainable range like the master (stage 3: read from the rank's spare chunk), and loads on
any number of ranks (restore_lagging writes the range this rank keeps).
Failures: once an update fails (the step is failed anyway: [Note: failures inside a step]),
the worker runs none of that step's later updates, so a stage 1-2 gather is never matched
with another unit's gather on a rank that went on: the other ranks' worker waits in the
failed unit's gather and raises naming this rank ([Note: failures] in zero/partition.py).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol

from offload import faults
from offload.memory.layout import Layout, UnitState
from offload.memory.residency import DeviceResidency
from offload.optim.failure import FailureState
from offload.optim.gradients import Gradients
from offload.optim.paths import UpdatePaths
from offload.tiers.context import TierContext
from offload.units import Residency

__all__ = ["DelayedUpdates", "OptimizerWorker"]


class OptimizerWorker(Protocol):
    """What the delayed updates need of the update scheduler (optim.updates.UpdateScheduler),
    which owns the optimizer worker and counts the micro-steps."""

    micro_step: int  # the engine's step() calls so far

    def submit_update(self, run: Callable[..., None], *args: Any) -> Future:
        """Run ``run(*args)`` on the optimizer worker after what is queued there;
        ``finish_optimizer`` waits for it with every other update."""

    def finish_optimizer(self) -> Optional[BaseException]:
        """Wait for every update on the worker and the staging slots' writes (a failed
        update stops the engine); return an interrupt that came meanwhile."""


class DelayedUpdates:
    """The delayed updates of one engine ([Note: delayed updates]): which step delays, the
    updates on the optimizer worker, their commit, and the committed view readers take.

    Threads: the main thread calls every method but ``_run``, which the optimizer worker runs
    (one update at a time, like every update there).
    """

    def __init__(self, units: List[UnitState], *, layout: Layout, tiers: TierContext, paths: UpdatePaths,
                 worker: OptimizerWorker, gradients: Gradients, residency: DeviceResidency,
                 failures: FailureState) -> None:
        """``tiers``: its counters and timeline are what it records in. ``paths``: how a
        unit's update runs (``UpdatePaths.delayed``), the staged step's failed spare writes,
        [zero] the partition whose per-step gradient record ``queue`` clears. ``worker``: the
        update scheduler, which runs the updates on its worker and waits for them.
        ``gradients``: a unit's gradients given back once its update is done, its fields
        taken back. ``residency``: the stale device copies a commit drops, the fetches it
        lands first. ``failures``: a failed update or spare write stops the engine."""
        self._units = units
        self._layout = layout
        self._stats, self._timeline = tiers.stats, tiers.timeline
        self._paths = paths
        self._worker = worker
        self._gradients = gradients
        self._residency = residency
        self._failures = failures
        self._running: List[Future] = []  # tickets of the last delayed step's updates
        # [Note: delayed updates across ranks] an update of the last delayed step failed on
        # this rank: the worker runs none of the others (written there, reset by queue())
        self._abandoned = False

    def in_flight(self) -> bool:
        """A delayed update still runs on the worker."""
        return any(not ticket.done() for ticket in self._running)

    def wait(self) -> None:
        """Wait for every delayed update and its writes (step 1 of the Note); a failure of
        either stops the engine. An interrupt meanwhile is raised after both are judged
        ([Note: interrupts while waiting])."""
        interrupt = self._worker.finish_optimizer()  # raises through fail_step when an update failed
        self._running.clear()
        ring = self._paths.ring
        failed, ring.failed_spare_writes = ring.failed_spare_writes, []
        if failed:
            names = ", ".join(sorted({repr(u.name) for u, _ in failed}))
            self._failures.fail_step(failed[0][1],
                                     f"while writing the delayed updates of units {names} to their spare homes")
        if interrupt is not None:
            raise interrupt

    def take_back_all(self) -> None:
        """Every unit's gradient fields back from its delayed update (step 2 of the Note),
        all of them even when one raises (a failed update, raised once, after the rest)."""
        first_error = None
        for u in self._units:
            try:
                self._gradients.take_back(u)
            except BaseException as error:  # noqa: B902 - raised below, after the other units
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def commit(self) -> None:
        """Step 3 of the Note: the pending updates become the homes; the device copies read
        from the old ones are dropped. Main thread, after ``wait``."""
        self._residency.drain_fetches()  # a copy in flight lands before it is judged
        for u in self._units:
            if u.delayed_pending:
                u.commit_spare()
                u.delayed_pending = False
                if u.compute_state == Residency.LOADED:
                    self._residency.release(u)

    def delays(self, skip: bool, clipped: bool) -> bool:
        """Whether this optimizer step's update is delayed (the rule of the Note); a step
        past the warm-up that is not counts as a fallback."""
        optimizer_steps = self._worker.micro_step // self._layout.accumulation_steps
        past_warmup = optimizer_steps > self._layout.delayed_update_warmup_steps
        if past_warmup and (skip or clipped):
            self._stats.count("delayed_fallbacks")
        return past_warmup and not skip and not clipped

    def queue(self, groups: List[Dict[str, Any]], grad_factor: float) -> None:
        """Step 5 of the Note: every unit with a gradient on the worker, in the order the
        next backward hands their gradients over (where it waits for them): the root first
        (a language model's head and final norm, whose gradients come first), then the
        units last to first; each owns its gradient fields until taken back."""
        self._abandoned = False  # the worker is idle: wait() came first
        for u in [self._units[0]] + self._units[:0:-1]:
            if not any(u.has_grad):
                continue
            u.delayed_pending = True
            ticket = self._worker.submit_update(self._run, u, groups, grad_factor)
            u.delayed_update = ticket
            self._running.append(ticket)
        self._stats.count("delayed_updates")
        if self._paths.partition is not None:  # [zero] the next backward's gradients start afresh
            self._paths.partition.zero_grad()

    def _run(self, u: UnitState, groups: List[Dict[str, Any]], grad_factor: float) -> None:
        """On the optimizer worker: u's update from its homes into its spare homes."""
        if self._abandoned:
            raise RuntimeError(f"the delayed update of unit {u.name!r} did not run: an earlier one of the "
                               "same optimizer step failed")
        try:
            faults.hit("optim.deferred_update", unit=u.name)
            start = time.perf_counter()
            self._paths.delayed(u, groups, grad_factor, self._worker.micro_step)
        except BaseException:
            self._abandoned = True
            raise
        self._gradients.release(u)  # the update owns them ([Note: threads] in memory/layout.py)
        end = time.perf_counter()
        self._timeline.span("optimizer", f"update {u.name} (delayed)", start, end)
        self._stats.add_seconds("worker_updates", end - start)

    @contextlib.contextmanager
    def committed_view(self) -> Iterator[None]:
        """While inside, every pending unit's homes hold its true state (the pending update)
        and its spare homes the copy the forward reads; swapped back on leaving. Main thread,
        after ``wait``."""
        pending = [u for u in self._units if u.delayed_pending]
        for u in pending:
            u.commit_spare()
        try:
            yield
        finally:
            for u in pending:
                u.commit_spare()

    def read_committed(self, u: UnitState, read: Callable[[], Any]) -> Any:
        """``read()`` of u with its true state in its homes (see committed_view)."""
        if not u.delayed_pending:
            return read()
        u.commit_spare()
        try:
            return read()
        finally:
            u.commit_spare()
