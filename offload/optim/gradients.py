"""Gradients from the moment autograd has accumulated them to the unit's update: who owns
them ([Note: gradient ownership]), the pool of flat buffers ([Note: gradient pool]), how
they leave a device the host does not address ([Note: gradients off the device]), and what
the optimizer step takes from them (the global norm, the clipping factor, fp16 loss
scaling and the check for NaN/Inf). Measurements behind these designs:
docs/performance.md, "Gradients".

[Note: gradient ownership] A parameter's gradient leaves the device as soon as autograd has
accumulated it (``Gradients.on_grad_ready``) and is held on the host tier until the unit's
Adam has run. On a device the host does not address (CUDA, its stand-in), and [zero] with
several ranks (whose collectives need flat buffers), it goes into the unit's flat fp32
buffer from the gradient pool ([Note: gradient pool]). On the CPU device with one rank the
gradient already lies in host RAM: the host tier takes autograd's tensor itself (adopts it,
``HostTier.adopt``/``release``), one per parameter, and drops it when the unit is updated:
no copy, nothing allocated between steps. ``bytes_device_to_host`` counts either as moved.

[Note: 16-bit gradients] Where gradients are adopted and a step has one backward
(gradient_accumulation_steps 1), a bf16 or fp16 gradient is held in the dtype autograd
made it in (``Layout.grad_dtype``), and so is its spill extent. The numbers are those of
fp32 gradients: widening is exact, and both readers widen each element first (the norm's
squares, [Note: gradient squares]; the Adam kernel). A sum is taken in fp32: with
accumulation gradients are held in fp32, and a second gradient for a parameter holding a
16-bit one first replaces it with its fp32 copy (``_widen``), which may take the host tier
past the budget planned at 16 bits; such a unit is not spilled while its extent is 16-bit.

[Note: shared parameter gradients] A parameter the model uses in several places (a head
tied to the token embedding) gets one gradient per use, which autograd would sum out of
place (three whole gradients at once, none counted by a tier). Instead every module slot
that holds it, but its first, holds an alias while its module's forward runs under grad
mode (``hooks._AliasSlot``), so each use's gradient arrives by itself
(``on_shared_grad``): the first is kept, counted inside the spill allowance
(``memory.budget.held_shared_bytes``), the next are added to it in place in arrival order,
and ``finish_backward`` hands the sum off as the parameter's gradient. The peak is two
gradients, not three. The sum is autograd's to the bit (autograd adds in the order these
hooks fire), except where one module uses the parameter twice in a forward or the model
reads it outside any module slot. Shared parameters live in the root unit, updated only in
step(), so the hand-off at the end of backward delays nothing; zero_grad and a failed
backward drop the sums. Only where gradients are adopted: elsewhere the device budget keeps
no room for a held head gradient, and autograd sums.

[Note: gradient spill] ``host_budget`` bounds the gradients too. When the step's gradients
do not fit beside the fixed host needs, the *allowance* is the budget minus everything else
(``memory.budget.gradient_spill``: the bounce buffer and room for the largest unit's
gradients, twice where an update on the worker may read a spilled unit back during
backward; the tied sums count in it), each trainable unit gets a gradient extent on NVMe at
wrap, and after every gradient hook the main thread writes whole units' gradients there
until those in RAM are within the allowance. Invariants:
- Only a unit with no update queued or running is spilled (its ticket is None or done, no
  delayed update holds its fields): the thread that updates a unit owns its gradients.
  When what is over the allowance belongs to units being updated, the main thread waits
  for the first of those updates, then spills again (``gradient_budget_waits``). A
  speculative update that read a unit back lets the RAM go and marks it spilled again
  (``park``): the extent still holds the values for a redo.
- A unit whose gradients in RAM are less than half its extent stays (``_worth_spilling``):
  a spill writes the whole extent and the next gradient reads it all back.
- A unit is spilled whole, through the two halves of the bounce buffer, each piece written
  while the next is copied in; its RAM is released only once every write succeeded. A
  failed write keeps the gradients in RAM and the step goes on (``failed_gradient_spills``).
- The per-parameter squared norms are taken before the write (``spilled_grad_squares``)
  and summed in the step's own order: the norm is the unspilled run's to the bit.
- ``grad_range`` reads a spilled unit back whole (into ``UnitState.grad``) on the thread
  that updates it; a failed read fails the step ([Note: swap I/O failures]) before any of
  the unit's homes is written.
- With accumulation, a gradient arriving for a spilled unit reads it back first, then adds
  in the same order as into autograd's tensors; zero_grad forgets the mark.
The allowance is soft (units being updated, the unit backward is producing and a read-back
buffer may hold RAM beyond it, within the room the floor keeps), so the host tier stays
within host_budget. Only where gradients are adopted.
"""
from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn

from offload import faults
from offload.errors import warn_at_caller
from offload.memory.budget import SQUARES_THREADS, UnitSizes, gradient_spill, squares_scratch_numel
from offload.memory.layout import Layout, UnitState, sub_extent
from offload.optim.failure import wait_through_interrupts
from offload.optim.squares import grad_squares
from offload.stats import Stats
from offload.tiers import DeviceTier, HostTier, NvmeTier
from offload.tiers.streams import Event
from offload.units import PAGE_BYTES, ParamEntry
from offload.zero import Partition

__all__ = ["Gradients"]


class EarlyUpdates(Protocol):
    """What the gradients need of the update scheduler ([Note: early updates])."""

    #: whether this backward may update units as soon as their gradients are final
    early_updates: bool

    def maybe_update_early(self) -> None:
        """Start the updates of the units now done."""


class Gradients:
    """Owns the gradients between backward and each unit's update, and the loss-scale
    state of the step that consumes them.

    The per-unit buffers themselves stay on the UnitState (``grad``, ``param_grads``,
    ``has_grad``); this object decides where they come from and where they go. The
    gradient hooks run on the main thread; ``release`` and ``grad_range`` also run on the
    optimizer worker (early and deferred updates), hence the pool's lock.
    """

    def __init__(self, units: List[UnitState], *, layout: Layout, partition: Optional[Partition],
                 device: DeviceTier, host: HostTier, stats: Stats) -> None:
        """``partition``: [zero] the ranks' partition, or None with one rank. The update
        scheduler, built after it, is connected once built (``connect``)."""
        self._units = units
        self._layout = layout
        self._partition = partition
        self._device = device
        self._host = host
        self._stats = stats
        self._updates: Optional[EarlyUpdates] = None  # connect
        # [Note: gradient pool] free flat buffers by element count
        self._grad_pool: Dict[int, List[torch.Tensor]] = {}
        self._grad_pool_lock = threading.Lock()
        # [Note: gradients off the device] a device the host does not address: the copies
        # out in flight, by unit index (under the pool's lock)
        self._copies_out = not layout.device_is_host
        self._copies: Dict[int, List[Event]] = {}
        # [Note: gradient spill] the allowance (None: no spill), the bounce buffer, the
        # NVMe tier (spill_through), the gradient bytes held in RAM (under the pool's lock)
        sizes = [UnitSizes.of(u) for u in units]
        spill = gradient_spill(sizes, layout)
        self._allowance_bytes = None if spill is None else spill.allowance_bytes
        self._bounce_numel = 0 if spill is None else spill.bounce_bytes // layout.grad_element_bytes
        self._bounce: Optional[torch.Tensor] = None
        # [Note: shared parameter gradients] (unit index, k) -> this backward's sum so far
        self._partials: Dict[Tuple[int, int], torch.Tensor] = {}
        self._nvme: Optional[NvmeTier] = None
        self._ram_bytes = 0
        # [Note: 16-bit gradients] fp32 copies made of 16-bit gradients that a second one was
        # added to, held now (beyond the plan: until they go, no gradient is adopted as planned)
        self._widened = 0
        # [Note: gradient squares] the threads' fp32 scratch buffers, planned with the host
        # needs and allocated now, before any gradient can take the host tier past its plan
        scratch_numel = squares_scratch_numel(sizes, layout)
        self._free_scratch = [host.allocate(scratch_numel, torch.float32)
                              for _ in range(SQUARES_THREADS if scratch_numel else 0)]
        self._scratch = threading.local()
        # fp16 loss scaling: the scale and the finite steps since it last changed
        self.loss_scale = layout.starting_loss_scale
        self.good_steps = 0
        # fp16: steps skipped one after the other with the scale at min_loss_scale (it can
        # fall no further, so the run is stuck until the gradients fit fp16)
        self._skipped_at_minimum = 0
        # The global gradient norm of the last step with finite gradients, the loss scale
        # divided out, before clipping (None before such a step); stats()["grad_norm"].
        self.last_grad_norm: Optional[float] = None
        # Whether the last norm clipped (torch's coefficient < 1): [Note: delayed updates] fall back
        self.clipped = False

    def connect(self, updates: EarlyUpdates) -> None:
        """The update scheduler, once it is built (it is built with these gradients)."""
        self._updates = updates

    @property
    def element_bytes(self) -> int:
        """Bytes of a gradient element as held ([Note: 16-bit gradients])."""
        return self._layout.grad_element_bytes

    # ------------------------------------------------------------------ ownership
    @torch.no_grad()
    def on_grad_ready(self, u: UnitState, k: int, param: nn.Parameter) -> None:
        """A parameter's gradient is final for this backward: move it to the host fp32
        buffer (accumulating across micro-steps) and free the device copy."""
        grad = param.grad
        if grad is None:
            return
        faults.hit("optim.grad_ready", unit=u.name, param=u.trainable[k].fqn)
        self._take(u, k, grad, held=False)
        param.grad = None

    @property
    def sums_shared_uses(self) -> bool:
        """[Note: shared parameter gradients] Whether the uses of a shared parameter hand
        their gradients off one by one (with a CPU device, one rank)."""
        return self._layout.adopts_grads

    @torch.no_grad()
    def on_shared_grad(self, u: UnitState, k: int, leaf: torch.Tensor) -> None:
        """[Note: shared parameter gradients] One use's gradient of u's k-th trainable
        parameter, which the model uses in several places (``leaf``: the parameter or the
        alias of one use): added to this backward's sum of its uses, in arrival order."""
        grad = leaf.grad
        if grad is None:
            return
        leaf.grad = None
        key = (u.index, k)
        partial = self._partials.get(key)
        if partial is not None:
            partial.add_(grad)  # autograd's own old + new; exact and commutative for two uses
            return
        self._partials[key] = grad  # in RAM, like every other gradient: the allowance counts it
        self._host.adopt(grad, planned=False)
        self._count_ram(grad.numel() * grad.element_size())
        if self._allowance_bytes is not None and self._ram_bytes > self._allowance_bytes:
            self._spill_over_allowance(u)

    def finish_backward(self) -> None:
        """[Note: shared parameter gradients] The backward is over: each shared parameter's
        sum of its uses is its gradient, handed off as autograd's would have been."""
        while self._partials:
            (index, k), partial = next(iter(self._partials.items()))
            u = self._units[index]
            faults.hit("optim.grad_ready", unit=u.name, param=u.trainable[k].fqn)
            del self._partials[(index, k)]
            try:
                with torch.no_grad():
                    self._take(u, k, partial, held=True)
            except BaseException:
                if not any(g is partial for g in u.param_grads):  # not adopted: nobody holds it now
                    self._unhold(partial)
                raise

    def drop_partials(self) -> None:
        """[Note: shared parameter gradients] The sums of a backward that failed or whose
        gradients are dropped (zero_grad)."""
        while self._partials:
            _, partial = self._partials.popitem()
            self._unhold(partial)

    def _unhold(self, partial: torch.Tensor) -> None:
        self._host.release(partial)
        self._count_ram(-partial.numel() * partial.element_size())

    def _take(self, u: UnitState, k: int, grad: torch.Tensor, held: bool) -> None:
        """u's k-th gradient of this backward into its fp32 home on the host. ``held``: a
        shared parameter's sum, already counted where it lies (see ``on_shared_grad``)."""
        self.take_back(u)  # [Note: delayed updates] the fields are this backward's from here on
        if u.compute_home is None and u.device_offset is not None:
            # [Note: streams] an update written into u's slot waits for the reads so far
            self._device.reads_done(u.device_offset, u.compute_numel, what=f"the backward of unit {u.name!r}")
        num_bytes = grad.numel() * grad.element_size()
        if not held:
            self._device.hold_transient(num_bytes)
        e = u.trainable[k]
        sharded_grads = self._partition is not None and self._partition.shards_gradients
        src = grad.reshape(-1)
        if u.grad_spilled:  # [Note: gradient spill] accumulating onto spilled gradients
            self._read_back(u)
        u.read_back_squares = None  # the values change from here: no longer the extent's
        adopted = False
        if self._layout.adopts_grads and u.grad is None:  # [Note: gradient ownership]
            if u.has_grad[k]:
                self._widen(u, k).add_(src)
            else:
                # autograd's own tensor (exclusively the parameter's, which is why PyTorch
                # accumulates into it in place), in fp32 or the 16-bit dtype it is held in
                # ([Note: 16-bit gradients]); else a new fp32 copy
                keep = src.dtype in (torch.float32, self._layout.grad_dtype)
                u.param_grads[k] = src if keep else src.to(torch.float32)
                adopted = held and u.param_grads[k] is src
                if not adopted:
                    # planned unless spilling, or widened gradients hold more than the plan,
                    # or it is the fp32 copy of a shared parameter's sum, beside the sum
                    planned = self._allowance_bytes is None and not self._widened and not held
                    self._host.adopt(u.param_grads[k], planned=planned)
                    self._count_ram(u.param_grads[k].nbytes)
        elif self._copies_out and not u.has_grad[k] and not sharded_grads:
            # [Note: gradients off the device] widened where it lies, copied out behind the
            # compute that made it; the update or the norm waits for it (landed)
            dst = self.grad_buffer(u)[e.offset:e.offset + e.numel]
            wide = src if src.dtype == torch.float32 else src.to(torch.float32)
            event = self._device.streams.copy_out(dst, wide, what=f"the gradient of {e.fqn!r}")
            with self._grad_pool_lock:
                self._copies.setdefault(u.index, []).append(event)
        else:
            if sharded_grads:  # [zero] stage >= 2: into u's bucket on the device (zeroed), [Note:
                # collectives on the device]
                dst = self._partition.gradient_bucket(u)[e.offset:e.offset + e.numel]
            else:
                self.landed(u)  # a second gradient is added to the first
                dst = self.grad_buffer(u)[e.offset:e.offset + e.numel]
            if src.device != dst.device:
                src = src.to(dst.device)  # a second gradient, added on the host: a synchronous copy
            if u.has_grad[k] and u.grad is not None and u.grad.dtype != torch.float32:
                dst = self._widen(u, k)  # [Note: 16-bit gradients] a read-back buffer, summed into
            if u.has_grad[k] or sharded_grads:
                dst.add_(src)
            else:
                dst.copy_(src)
        if held and not adopted:
            self._unhold(grad)
        u.has_grad[k] = True
        if not held:
            self._device.drop_transient(num_bytes)
        if not sharded_grads:  # else only its shard leaves the device (land_shard)
            self._stats.add_bytes("device_to_host", num_bytes)
        if sharded_grads:  # [zero] reduce-scatter u once its last gradient is in
            self._partition.gradient_arrived(u)
        u.grads_since_use += 1
        if self._updates.early_updates and u.grads_since_use >= len(u.trainable):
            self._updates.maybe_update_early()
        if self._allowance_bytes is not None and self._ram_bytes > self._allowance_bytes:
            self._spill_over_allowance(u)

    def _widen(self, u: UnitState, k: int) -> torch.Tensor:
        """[Note: 16-bit gradients] u's k-th gradient, where a second one is to be added to
        it: a sum is taken in fp32, so a 16-bit gradient held (its own tensor, or u's read-
        back buffer) is replaced by its fp32 copy first. Returns the k-th gradient's tensor."""
        e = u.trainable[k]
        if u.grad is not None:
            if u.grad.dtype != torch.float32:
                wide = self._host.allocate(u.grad.numel(), torch.float32, planned=False)
                wide.copy_(u.grad)
                self._host.release(u.grad)
                self._count_ram(wide.nbytes - u.grad.nbytes, widened=1)
                u.grad = wide
            return u.grad[e.offset - u.grad_base:e.offset - u.grad_base + e.numel]
        g = u.param_grads[k]
        if g.dtype != torch.float32:
            wide = g.to(torch.float32)
            self._host.adopt(wide, planned=False)  # beyond the plan's 16-bit bytes: a soft overshoot
            self._host.release(g)
            self._count_ram(wide.nbytes - g.nbytes, widened=1)
            u.param_grads[k] = g = wide
        return g

    def take_back(self, u: UnitState) -> None:
        """[Note: delayed updates] u's gradient fields back from its delayed update: wait for
        it (counted in ``delayed_grad_waits``), then they are empty and this step's to fill.
        A failed update raises here (once): the step failed, which wait_optimizer reports."""
        ticket = u.delayed_update
        if ticket is None:
            return
        interrupt = None
        if not ticket.done():
            self._stats.count("delayed_grad_waits")
            with self._stats.timed("optimizer_wait"):
                interrupt = wait_through_interrupts([ticket])  # [Note: interrupts while waiting]
        u.delayed_update = None
        u.has_grad = [False] * len(u.trainable)
        ticket.result()
        if interrupt is not None:
            raise interrupt

    # ------------------------------------------------------------------ spill
    def spill_through(self, nvme: Optional[NvmeTier]) -> None:
        """[Note: gradient spill] The NVMe tier the gradient extents are on, and the bounce
        buffer, planned with the fixed host needs (wrap)."""
        self._nvme = nvme
        if self._allowance_bytes is not None:
            self._bounce = self._host.allocate(self._bounce_numel, self._layout.grad_dtype)

    def _count_ram(self, num_bytes: int, widened: int = 0) -> None:
        """Gradient bytes held in RAM, and ([Note: 16-bit gradients]) fp32 copies of 16-bit
        ones held, change by these (any thread)."""
        with self._grad_pool_lock:
            self._ram_bytes += num_bytes
            self._widened += widened

    @staticmethod
    def _spillable_grads(u: UnitState) -> bool:
        """u has a gradient extent and gradients in RAM."""
        return u.grad_home is not None and not u.grad_spilled and bool(Gradients._held_tensors(u))

    @staticmethod
    def _held_tensors(u: UnitState) -> List[torch.Tensor]:
        """u's gradient tensors in RAM: its read-back buffer, or its parameters' own."""
        return [u.grad] if u.grad is not None else [g for g in u.param_grads if g is not None]

    def _spillable(self, u: UnitState) -> bool:
        """u's gradients are in RAM, worth spilling, and no update of u is queued or running."""
        ticket = u.update.ticket
        return self._spillable_grads(u) and (ticket is None or ticket.done()) and u.delayed_update is None \
            and self._worth_spilling(u)

    def _worth_spilling(self, u: UnitState) -> bool:
        """[Note: gradient spill] u holds at least half of its gradient extent in RAM: a spill
        writes the whole extent, and reading it back reads all of it. Only gradients in the
        extent's dtype: a 16-bit extent cannot take fp32 sums ([Note: 16-bit gradients])."""
        held = self._held_tensors(u)
        if any(g.dtype != self._layout.grad_dtype for g in held):
            return False
        return 2 * sum(g.nbytes for g in held) >= u.grad_home.nbytes

    def _spill_over_allowance(self, current: UnitState) -> None:
        """Spill units until the gradients in RAM are within the allowance: units backward
        is done with first (all their gradients came in since they were last needed), the
        one whose gradient just arrived last, and only once it has them all (spilled part-
        way, its next gradient would read it back at once)."""
        def done(u: UnitState) -> bool:
            return u.grads_since_use >= len(u.trainable)

        while True:
            candidates = [u for u in self._units if u is not current and self._spillable(u)]
            candidates.sort(key=lambda u: not done(u))  # stable
            if done(current) and self._spillable(current):
                candidates.append(current)
            for u in candidates:
                if self._ram_bytes <= self._allowance_bytes:
                    return
                self._spill(u)
            if self._ram_bytes <= self._allowance_bytes:
                return
            # Still over: the rest are units whose updates are queued or running (early or
            # speculative, during backward). Their gradients cannot be spilled until the update
            # is done, so backward waits for the first of them to finish instead of going past
            # the budget by the worker's backlog ([Note: gradient spill]).
            running = [u.update.ticket for u in self._units if u.update.ticket is not None and
                       not u.update.ticket.done() and self._spillable_grads(u)]
            if not running:
                return
            self._stats.count("gradient_budget_waits")
            with self._stats.timed("optimizer_wait"):
                interrupt = wait_through_interrupts(running, return_when=FIRST_COMPLETED)
            if interrupt is not None:  # [Note: interrupts while waiting]
                raise interrupt

    @torch.no_grad()
    def _spill(self, u: UnitState) -> None:
        """Write u's gradients to its extent and release their RAM; a failed write keeps
        them in RAM."""
        squares = [(k, self.squares(u, k)) for k in range(len(u.trainable)) if u.has_grad[k]]
        numel = u.grad_home.nbytes // self._layout.grad_element_bytes
        try:
            if u.grad is not None:  # read back earlier (accumulation): written as it is
                self._nvme.write(u.grad, u.grad_home, unit=u.name).wait()
            else:
                self._write_through_bounce(u, numel)
        except OSError:
            self._stats.count("failed_gradient_spills")
            return
        self.release(u)
        u.grad_spilled, u.spilled_grad_squares = True, squares
        self._stats.add_bytes("gradient_spill", u.grad_home.nbytes)

    def _write_through_bounce(self, u: UnitState, numel: int) -> None:
        """u's gradients (in their own tensors) to its extent, piece by piece through the
        bounce buffer's two halves: a piece is copied in while the one before is written.
        Every write is waited for, a failed one raises OSError."""
        bounce = self._bounce
        page = PAGE_BYTES // bounce.element_size()
        piece = numel if numel <= bounce.numel() else bounce.numel() // 2 // page * page  # whole pages
        in_flight: List[Any] = []
        try:
            for i, a in enumerate(range(0, numel, piece)):
                b = min(a + piece, numel)
                buf = bounce[(i % 2) * piece:][:b - a]  # its last write (piece i - 2) is done
                for k, e in enumerate(u.trainable):
                    lo, hi = max(a, e.offset), min(b, e.offset + e.numel)
                    if u.param_grads[k] is not None and lo < hi:
                        buf[lo - a:hi - a].copy_(u.param_grads[k][lo - e.offset:hi - e.offset])
                size = bounce.element_size()
                extent = sub_extent(u.grad_home, a * size, (b - a) * size)
                in_flight.append(self._nvme.write(buf, extent, unit=u.name))
                if len(in_flight) == 2:
                    in_flight.pop(0).wait()
            while in_flight:
                in_flight.pop(0).wait()
        finally:
            for handle in in_flight:  # a write failed: the others still read the bounce buffer
                try:
                    handle.wait()
                except OSError:
                    pass

    def _read_back(self, u: UnitState) -> None:
        """u's spilled gradients back into a flat buffer (``u.grad``), on the thread that
        needs them; a failed read raises, and u stays spilled."""
        numel = u.grad_home.nbytes // self._layout.grad_element_bytes
        buffer = self._host.allocate(numel, self._layout.grad_dtype, planned=False)
        try:
            self._nvme.read(buffer, u.grad_home, unit=u.name).wait()
        except BaseException:
            self._host.release(buffer)
            raise
        self._count_ram(buffer.nbytes)
        u.read_back_squares = u.spilled_grad_squares  # the extent still holds these values
        u.grad, u.grad_spilled, u.spilled_grad_squares = buffer, False, []

    def park(self, u: UnitState) -> None:
        """[Note: gradient spill] After a speculative update (UpdateScheduler), on its thread: gradients it
        read back from u's extent and nobody changed since go back to being spilled (the
        extent still holds them, with their squares), and their RAM is released; a redo
        reads them back again. Gradients that never left RAM stay, as before."""
        if u.read_back_squares is None or u.grad is None or not self._layout.adopts_grads:
            return
        self._release_held(u.grad)
        u.grad = None
        u.grad_spilled, u.spilled_grad_squares, u.read_back_squares = True, u.read_back_squares, None

    def grad_buffer(self, u: UnitState) -> torch.Tensor:
        """u's flat fp32 gradient buffer, taken from the pool when its first gradient
        arrives (not with a CPU device: see [Note: gradient ownership]).
        [Note: gradient pool] Buffers go back to the pool as soon as the unit is updated,
        so with early updates only the units between backward and update hold one; they
        are reused, never freed (memory touched again is fast, fresh memory is not)."""
        if u.grad is None:
            with self._grad_pool_lock:
                pool = self._grad_pool.setdefault(u.grad_numel, [])  # [zero] shard-sized at stage 2
                u.grad = pool.pop() if pool else None
            if u.grad is None:
                u.grad = self._host.allocate(u.grad_numel, torch.float32)
        return u.grad

    def release(self, u: UnitState) -> None:
        """u is updated (or its gradients dropped): its buffer back to the pool ([Note:
        gradient pool]), autograd's tensors back to the host tier ([Note: gradient
        ownership])."""
        if u.grad is not None and self._layout.adopts_grads:  # [Note: gradient spill] read back
            self._release_held(u.grad)
            u.grad = None
        elif u.grad is not None:
            self.landed(u)  # no copy still writes the buffer the pool hands out again
            with self._grad_pool_lock:
                self._grad_pool.setdefault(u.grad_numel, []).append(u.grad)
            u.grad = None
        for k, g in enumerate(u.param_grads):
            if g is not None:
                self._release_held(g)
                u.param_grads[k] = None
        u.grad_spilled, u.spilled_grad_squares, u.read_back_squares = False, [], None  # [Note: gradient spill]

    def _release_held(self, g: torch.Tensor) -> None:
        """A gradient tensor held in RAM goes (on the main thread or the optimizer worker)."""
        self._host.release(g)
        widened = g.dtype == torch.float32 != self._layout.grad_dtype  # [Note: 16-bit gradients]
        self._count_ram(-g.nbytes, widened=-1 if widened else 0)

    # [Note: gradients off the device] On a device the host does not address (CUDA, its
    # stand-in), a gradient's first arrival in a backward is widened to fp32 where it lies
    # and queued on the device-to-host stream into u's pooled buffer (pinned), behind the
    # compute that made it; autograd's thread goes on at once ([zero] at stage >= 2 the
    # unit's reduce-scattered shard is, [Note: collectives on the device]). Whoever reads
    # the buffer next waits for those copies (``landed``): an update or the norm
    # (grad_range), a second gradient added to it, the pool taking the buffer back
    # (release), the collectives of the step (``host_buffer``). A second gradient in the
    # same buffer is added on the host after the first has landed.
    # ------------------------------------------------------------------ [zero] the partition's port
    # (offload.zero.partition.GradientShards)
    def host_buffer(self, u: UnitState) -> torch.Tensor:
        """u's host gradient buffer once every copy into it has landed."""
        self.landed(u)
        return self.grad_buffer(u)

    def land_shard(self, u: UnitState, shard: torch.Tensor, add: bool) -> Optional[Event]:
        """[Note: collectives on the device] u's reduce-scattered shard (fp32, on the device)
        into u's host buffer, or added to what the earlier micro-steps left there (``add``).
        On a device the host does not address, the first is queued on the device-to-host
        stream and its event returned (``shard`` must not be written again until it has
        completed: the partition's next reduce-scatter into it waits for it); an added one
        is copied synchronously, then added (None: nothing reads ``shard`` any more)."""
        self.take_back(u)  # [Note: delayed updates] a unit this rank gave no gradient reaches here alone
        self._stats.add_bytes("device_to_host", shard.numel() * shard.element_size())
        dst = self.host_buffer(u)[:shard.numel()]
        if not self._copies_out:
            if add:
                dst.add_(shard)
            else:
                dst.copy_(shard)
        elif add:
            dst.add_(shard.to(dst.device))
        else:
            event = self._device.streams.copy_out(dst, shard, what=f"the gradient shard of unit {u.name!r}")
            with self._grad_pool_lock:
                self._copies.setdefault(u.index, []).append(event)
            return event
        return None

    def landed(self, u: UnitState) -> None:
        """[Note: gradients off the device] Wait for u's gradients still on their way out."""
        if not self._copies_out:  # nothing is ever in flight: no lock on the update's path
            return
        with self._grad_pool_lock:
            events = self._copies.pop(u.index, [])
        for event in events:
            event.synchronize()

    def grad_range(self, u: UnitState, k: int, a: int, b: int) -> torch.Tensor:
        """The gradient (fp32, or 16-bit: [Note: 16-bit gradients]) of elements [a, b) (unit
        coordinates) of u's k-th trainable parameter: in the flat buffer ([zero]: which starts at element ``u.grad_base``) or
        in the parameter's own tensor. A spilled unit is read back first ([Note: gradient
        spill]: by the thread that updates it); one on its way out is waited for."""
        if u.grad_spilled:
            self._read_back(u)
        if u.grad is not None:
            self.landed(u)
            grad = u.grad[a - u.grad_base:b - u.grad_base]
            self._device.streams.host_access(grad, write=False, what=f"a read of unit {u.name!r}'s gradient")
            return grad
        e = u.trainable[k]
        return u.param_grads[k][a - e.offset:b - e.offset]

    # ------------------------------------------------------------------ norm and scaling
    def scale_and_skip(self, micro_step: int) -> Tuple[float, bool]:
        """Factor folded into Adam (unscale x clip) and whether to skip this step.
        ``micro_step``: the engine's count, for the NaN/Inf warning."""
        # The norm is taken on every step, clipping or not: it is also how NaN/Inf gradients
        # are found (and reported with the first parameter that has them). Units updated
        # early (only when neither clipping nor skipping needs the norm first) brought theirs.
        squares = torch.zeros((), dtype=torch.float64)
        first_nonfinite: Optional[Tuple[UnitState, ParamEntry]] = None
        scanned = self._units
        if self._partition is not None:  # [zero] each rank its part; one all-reduce per step
            # ([Note: early updates across ranks]: an early update took its unit's terms)
            squares = self._partition.sum_grad_squares([
                u.early_grad_squares if u.update.updated else self._partition.local_grad_squares(u)
                for u in self._units])
            scanned = []  # (a NaN is then reported without the parameter that has it)
        for u in scanned:
            if u.update.updated:
                for square in u.early_grad_squares:  # the order of the loop below
                    squares += square
                if first_nonfinite is None and u.early_nonfinite is not None:
                    first_nonfinite = (u, u.early_nonfinite)
                continue
            if u.grad_spilled:  # [Note: gradient spill] taken before the write, in this order
                for k, square in u.spilled_grad_squares:
                    if u.has_grad[k]:
                        if first_nonfinite is None and not torch.isfinite(square):
                            first_nonfinite = (u, u.trainable[k])
                        squares += square
                continue
            for k, e in enumerate(u.trainable):
                if u.has_grad[k]:
                    square = self.squares(u, k)
                    if first_nonfinite is None and not torch.isfinite(square):
                        first_nonfinite = (u, e)
                    squares += square
        layout = self._layout
        inv_scale = 1.0 / self.loss_scale
        total_norm = squares.sqrt().item() * inv_scale
        finite = total_norm == total_norm and total_norm != float("inf")
        if not finite:
            self._stats.count("nonfinite_steps")
            if not layout.fp16:  # with fp16 an overflow is routine loss scaling
                where = (f"unit {first_nonfinite[0].name!r} (parameter {first_nonfinite[1].fqn!r})"
                         if first_nonfinite else "the gradient norm")
                action = ("the step is skipped (skip_nonfinite_steps=True)" if layout.skip_nonfinite_steps
                          else "the step goes ahead and writes NaN/Inf into the parameters; set "
                          "skip_nonfinite_steps=True to skip such steps")
                # at the user's line: step(), or the call that settles a deferred step
                warn_at_caller(f"non-finite gradient (NaN/Inf) at micro-step {micro_step}, first "
                               f"in {where}; {action}")
            if layout.fp16:
                self._warn_if_stuck_at_minimum(micro_step)
                self.loss_scale = max(self.loss_scale / 2, layout.min_loss_scale)
                self.good_steps = 0
                return inv_scale, True
            if layout.skip_nonfinite_steps:
                return inv_scale, True
        elif layout.fp16:
            self._skipped_at_minimum = 0
            self.good_steps += 1
            if self.good_steps % layout.loss_scale_window == 0:
                self.loss_scale *= 2
        self.last_grad_norm = total_norm
        factor = inv_scale
        self.clipped = False
        if layout.max_grad_norm is not None and finite:
            clip = layout.max_grad_norm / (total_norm + 1e-6)
            if clip < 1.0:
                factor *= clip
                self.clipped = True
        return factor, False

    def _warn_if_stuck_at_minimum(self, micro_step: int) -> None:
        """fp16: an overflow with the scale at min_loss_scale skips the step without the scale
        falling any more. Said at the first such step in a row and as the count doubles
        (1, 2, 4, ...): skips above the minimum are routine loss scaling."""
        if self.loss_scale > self._layout.min_loss_scale:
            return
        self._skipped_at_minimum += 1
        count = self._skipped_at_minimum
        if count & (count - 1) == 0:
            warn_at_caller(f"fp16: {count} optimizer step(s) in a row skipped at micro-step {micro_step}: the "
                           f"gradients overflow fp16 at the minimum loss scale {self.loss_scale:g} "
                           "(min_loss_scale), so the parameters do not change; lower min_loss_scale or the "
                           "learning rate, or train in bf16")

    def squares(self, u: UnitState, k: int) -> torch.Tensor:
        """Sum of squares of u's k-th trainable parameter's gradient (float64, 0-d; [Note:
        gradient squares])."""
        e = u.trainable[k]
        return grad_squares(self.grad_range(u, k, e.offset, e.offset + e.numel), self._squares_scratch)

    def _squares_scratch(self) -> torch.Tensor:
        """[Note: gradient squares] This thread's fp32 scratch (the main thread's and the
        optimizer worker's), kept for the engine's life."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None:
            with self._grad_pool_lock:
                buffer = self._scratch.buffer = self._free_scratch.pop()  # one per thread (SQUARES_THREADS)
        return buffer
