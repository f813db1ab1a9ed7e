"""Device residency: which units' compute copies are on the device, moving them there
(fetch, prefetch) and dropping them again (release, eviction).

[Note: residency] A unit's compute copy on the device (``UnitState.compute_state``) moves
only along ``offload.units.LEGAL_TRANSITIONS``, and only on the main thread: the copy
worker moves bytes and the optimizer worker writes into a slot a fill gave it, neither
changes the state.

    from     to       who moves it, and when
    HOME     LOADING  DeviceResidency.start_fetch: a use (fetch), the prefetch plan
                      (prefetch), the next pass's first units (the engine after step());
                      DeviceResidency.prefetch_updating: a slot that waits for a deferred
                      update ([Note: updates fill the device copy])
    LOADING  LOADED   DeviceResidency.finish_fetch: the transfer landed (a use, drain_fetches,
                      land_fills); the parameters are bound to the slot
    LOADING  HOME     DeviceResidency.finish_fetch: the transfer failed; the slot goes back
                      (not the root's) and the home copy, unchanged, is read at the next use;
                      raised to a use that waits for it, counted and warned about when
                      drain_fetches lands it (a fetch ahead of its use: nothing lost)
    LOADED   IN_USE   the engine's forward hooks, while the unit's forward runs (the root's:
                      the whole forward); an IN_USE unit is never evicted
    IN_USE   LOADED   the engine's forward hooks, when that forward ends
    LOADED   IN_USE   DeviceResidency.hold, for engine.gathered() ([Note: gathered
                      parameters]); no pass runs while units are held (begin_pass refuses)
    IN_USE   LOADED   DeviceResidency.let_go, when the gathered block ends
    LOADED   HOME     DeviceResidency.release: evicted for another unit (allocate_slot) or by
                      the prefetch plan, stale after an optimizer update, or let go by a
                      checkpoint load; the parameters point at the placeholder again

[Note: gathered parameters] ``engine.gathered(params, modify)`` lets user code read and
edit weights between steps. Before anything moves the engine refuses (ValueError) inside a
pass, with a step pending (un-stepped gradients, units updated early), with several ranks
and, when editing, with a delayed update pending; it settles the last step's deferred
updates as state_dict() does, and ``budget.check_gathered_fits`` checks that every unit
asked for fits in the arena at once beside the root's slot. ``hold`` then lands the
fetches in flight, sends every other unit home (so the held ones pack after the root's
slot: no fragmentation), fetches the units asked for and marks them IN_USE, the forward's
protection from eviction; ``begin_pass`` (and the engine's forward, backward, step and
loads) refuse while units are held, so nothing but the block's code touches them. At the
end ``let_go`` makes them LOADED; with ``modify`` each unit's slot is copied to the host
and written home by CheckpointAccess.write_edited_weights (the compute copy's home and,
for trainable elements, the fp32 master: an element whose compute value changed takes it
as its master, one left as it was keeps its finer master); then every unit is released,
its parameters back on their placeholders. Adam's moments, step counts and gradients are
not touched.

Units whose compute copies live on the device (param_tier "device") go HOME -> LOADING ->
LOADED once at wrap and stay LOADED: release leaves them alone. The root unit keeps its
device slot for the whole run (allocated with the homes); only its state moves.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import torch

from offload import faults
from offload.errors import warn_at_caller
from offload.memory.budget import UnitSizes, compute_home_numel, fetch_buffer_numels
from offload.memory.layout import Layout, UnitState, on_nvme, sub_extent
from offload.memory.released import ReleasedParameters
from offload.memory.restored import RestoredParameters
from offload.tiers.nvme import wait_all
from offload.prefetch import Prefetcher
from offload.stats import profiled
from offload.tiers.context import TierContext
from offload.tiers.streams import Event
from offload.units import ParamEntry, Residency, padded_numel
from offload.zero import Partition


class UpdateNotLanded(RuntimeError):
    """A fetch chained behind an update found the update (or its swap writes) failed: the
    update's ticket reports that, not the fetch ([Note: updates fill the device copy])."""


class _Staging:
    """A pinned buffer that fetches from NVMe pass through on their way to a slot that the
    host does not address; ``busy``: the last such fetch (its result: the copy's event)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.busy: Optional[Future] = None


class PendingUpdates(Protocol):
    """What residency needs of the update scheduler ([Note: deferred updates]; and the
    current values a restore is compared with, [Note: restored parameters])."""

    #: the lock under which the optimizer worker takes an update off its queue and marks it
    #: started (``u.update.started``); a fill is attached under it, so the update either
    #: sees the fill or starts before it is attached
    lock: Any

    def settle_unit(self, u: UnitState) -> None:
        """Wait for u's queued update and its swap writes (a failed one raises); a fetch
        calls it before it reads u's home."""

    def pending(self, u: UnitState) -> bool:
        """Whether u's queued update or its swap writes are not done: such a unit is not
        evicted while another will do, and its prefetch waits for the update."""

    def settled_values(self, what: str) -> Callable[[UnitState], Dict[int, torch.Tensor]]:
        """The reader of a unit's current values once the last step's updates are done,
        refusing ``what`` between an early update and step(); ending a restore compares the
        restored copies with it ([Note: restored parameters])."""


class DeviceResidency:
    """Moves units' compute copies between their homes and device slots ([Note: residency]).

    It owns the copy worker, the staging buffers of fetches, the use clock, the stale units
    and the placeholder that a parameter whose unit is not on the device holds ([Note:
    released parameters] in memory/released.py), and it drives the prefetcher.

    Collaborators, given at construction: ``layout``; ``units`` (``units[0]`` is the root);
    the ``tiers`` with their counters and timeline (``nvme`` None without swap);
    ``partition`` ([zero] None with one rank); ``prefetcher`` (the engine's: the hooks
    start its passes through ``begin_trace``, the update scheduler reads its trace). The update scheduler, which is built after it
    and drives it, is connected once built (``connect``: a PendingUpdates, [Note: deferred
    updates]).
    """

    def __init__(self, *, layout: Layout, units: List[UnitState], tiers: TierContext, partition: Optional[Partition],
                 prefetcher: Prefetcher) -> None:
        self._layout = layout
        self.units = units
        self._root = units[0]
        device, host = tiers.device, tiers.host
        self._device, self._nvme = device, tiers.nvme
        self._partition = partition
        self._stats, self._timeline = tiers.stats, tiers.timeline
        self._prefetcher = prefetcher
        self._updates: Optional[PendingUpdates] = None  # connect
        # [Note: updates fill the device copy] False: a unit whose update is pending is left
        # to an on-demand fetch, as before fills existed (tests compare the two).
        self.fill_behind_updates = True
        # [Note: released parameters] what a parameter holds while its unit is not on the device
        self.released = ReleasedParameters([u.spec for u in units], layout.compute_dtype, layout.device,
                                           device.streams, host)
        # [Note: restored parameters] what they hold between passes after engine.restore_model()
        self.restored = RestoredParameters()
        self._unit_bytes = [u.compute_numel * layout.compute_element_bytes for u in units]
        self._last_needed: Optional[UnitState] = None
        self.held: List[UnitState] = []  # [Note: gathered parameters] IN_USE until let_go
        self._tick = 0  # the use clock: u.last_use orders eviction among units the trace does not know
        # Device copies an early optimizer update made stale: dropped at the next new use
        # of a unit (release_stale), not where the update is queued.
        self._stale_units: List[UnitState] = []
        # Copies to the device run on this one worker thread (the CPU's "copy stream"; on
        # CUDA it chains NVMe reads and copy-stream transfers), so they overlap compute.
        self._copy_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-copy")
        # the host buffers of reads from NVMe, as budget.host_bytes counts them
        fetch_numels = fetch_buffer_numels([UnitSizes.of(u) for u in units], layout)
        # used in turn ([Note: streams])
        self._fetch_staging: List[_Staging] = [] if layout.gathers else \
            [_Staging(host.allocate(numel, layout.home_dtype)) for numel in fetch_numels]
        # [zero] Stage 3 fetches run one at a time on the copy worker: one buffer for the
        # rank's chunks read from NVMe (gathered on the device: [Note: collectives on the device]).
        self._gather_home: Optional[torch.Tensor] = host.allocate(fetch_numels[0], layout.home_dtype) \
            if layout.gathers and fetch_numels else None

    def connect(self, updates: PendingUpdates) -> None:
        """The update scheduler, once it is built (it is built with this residency)."""
        self._updates = updates

    def begin_trace(self, key: Hashable, training: bool) -> None:
        """The pass of kind ``key`` begins: the prefetcher replays its trace, or records one."""
        self._prefetcher.begin_pass(key, training=training)

    def shutdown(self) -> None:
        """Stop the copy worker (after drain_fetches: nothing may be in flight)."""
        self._copy_worker.shutdown(wait=True)

    def end_restore(self, what: str, compare: bool = True) -> List[str]:
        """[Note: restored parameters] End a restore, if one is on; the names of the
        parameters written meanwhile (``compare=False``: not looked for, the caller replaces
        every value)."""
        if not self.restored.active:
            return []
        return self.restored.end(self.units, self._updates.settled_values(what) if compare else None, self.point_back)

    def begin_pass(self) -> None:
        """A forward pass starts: its first unit is a new use, whatever the last pass used.
        First, a restore ends (``end_restore``), then a ValueError inside engine.gathered()
        ([Note: gathered parameters]), and a RuntimeError if a released parameter was
        written or a parameter's ``.data`` replaced ([Note: released parameters]), or a
        restored one written ([Note: restored parameters])."""
        restored_written = self.end_restore("a forward")
        self.refuse_while_held("a forward")
        self.released.check_unwritten(self._point_back_replaced(), restored_written)
        self._last_needed = None

    def hold(self, units: List[UnitState]) -> None:
        """[Note: gathered parameters] Bring ``units`` (index order) to the device and keep
        them there, IN_USE, until ``let_go``. Fetches in flight land first and every other
        unit but the root leaves the device, so the held ones are packed after the root's
        slot: ``check_gathered_fits`` has checked that they fit. A failed fetch lets go of
        those held so far and raises."""
        assert not self.held, "engine.gathered() blocks do not nest"
        self.drain_fetches()
        self.release_stale()
        for u in self.units[1:]:
            self.release(u)  # a no-op with param_tier "device" and for units not LOADED
        try:
            for u in units:
                self.fetch(u)
                self.wait_ready(u)  # [Note: streams] the caller's reads come after the fill
                u.compute_state.to(Residency.IN_USE)
                self.held.append(u)
        except BaseException:
            self.let_go()
            raise

    def let_go(self) -> List[UnitState]:
        """The units ``hold`` kept, LOADED again (evictable); returned. (The forward hooks
        may have made one LOADED already: a forward refused by ``begin_pass`` still runs
        the root's always-called post-forward hook.)"""
        held, self.held = self.held, []
        for u in held:
            if u.compute_state == Residency.IN_USE:
                u.compute_state.to(Residency.LOADED)
        return held

    def refuse_while_held(self, what: str) -> None:
        """[Note: gathered parameters] A ValueError when units are held: ``what`` (a
        forward, backward or step) would move or change them."""
        if self.held:
            raise ValueError(f"{what} inside engine.gathered() (it holds unit(s) "
                             f"{[u.name for u in self.held][:4]} on the device): run it after the block")

    def _point_back_replaced(self) -> List[str]:
        """[Note: released parameters] The names of the parameters whose ``.data`` no longer
        holds what the engine gave them (user code set ``p.data = t``): their placeholder,
        or while their unit is on the device a view of its slot. Each is given it back."""
        replaced = []
        element_bytes = self._device.element_bytes
        for u in self.units:
            bound = u.compute_state.value in (Residency.LOADED, Residency.IN_USE)
            base = self._device.view(u.device_offset, u.compute_numel).data_ptr() if bound else 0
            here = [e.fqn for e in u.spec.entries
                    if e.param.data_ptr() != (base + e.offset * element_bytes if bound else self.released.address(e))]
            if here:
                if bound:
                    self.bind(u)
                else:
                    self.unbind(u)
                replaced += here
        return replaced

    def mark_stale(self, u: UnitState) -> None:
        """u's device copy is stale (an early update is changing its home): drop it at the
        next use of a unit (release_stale)."""
        self._stale_units.append(u)

    def forget_stale(self) -> None:
        """The stale units were dealt with otherwise (the optimizer step released them)."""
        self._stale_units.clear()

    def bind(self, u: UnitState) -> None:
        view = self._device.view(u.device_offset, u.compute_numel)
        for e in u.spec.entries:
            e.param.data = view[e.offset:e.offset + e.numel].view(e.shape)

    def point_back(self, u: UnitState, e: ParamEntry) -> None:
        """``e.param`` (of ``u``) holds what the engine gives it: a view of u's slot while u
        is on the device, else its placeholder ([Note: restored parameters])."""
        if u.compute_state.value in (Residency.LOADED, Residency.IN_USE):
            view = self._device.view(u.device_offset, u.compute_numel)
            e.param.data = view[e.offset:e.offset + e.numel].view(e.shape)
        else:
            self.released.release(e)

    def unbind(self, u: UnitState) -> None:
        for e in u.spec.entries:
            self.released.release(e)

    def need(self, u: UnitState) -> None:
        """u is about to be used: record it in the trace, have it on the device, and let the
        prefetcher move what comes next."""
        if u is not self._root:
            new_use = self._last_needed is not u
            self._last_needed = u
            if new_use:
                self._prefetcher.need(u.index)
                u.grads_since_use = 0
                state = u.compute_state.value
                self._prefetcher.count(on_device=state in (Residency.LOADED, Residency.IN_USE),
                                       in_flight=state == Residency.LOADING)  # [Note: prefetch counters]
                self.release_stale()
        self.fetch(u)
        self.prefetch()

    @profiled("fetch")
    def fetch(self, u: UnitState) -> None:
        """Have u's compute copy on the device: wait for its transfer when one is in flight,
        else move it now."""
        self._tick += 1
        u.last_use = self._tick
        self._updates.settle_unit(u)  # [Note: deferred updates]
        state = u.compute_state.value
        if state in (Residency.LOADED, Residency.IN_USE):
            return
        if state == Residency.HOME:
            self.start_fetch(u, evict=True)
        with self._stats.timed("fetch_wait"):
            self.finish_fetch(u)

    def start_fetch(self, u: UnitState, evict: bool, after: Optional[Callable[[], None]] = None) -> bool:
        """Begin moving u's compute copy into a device slot; False when no slot is free and
        ``evict`` is off. ``after``: the copy worker calls it first and moves the copy once
        it returns ([Note: updates fill the device copy]: a fetch behind an update)."""
        if u.device_offset is None:
            offset = self._allocate_slot(u) if evict else self._device.allocate(u.compute_numel)
            if offset is None:
                return False
            u.device_offset = offset
        u.compute_state.to(Residency.LOADING)
        u.fetch_started = time.perf_counter()
        try:
            self._issue_fetch(u, after)
        except BaseException:
            self._back_home(u)  # nothing was issued: the home copy is read at the next use
            raise
        return True

    def _issue_fetch(self, u: UnitState, after: Optional[Callable[[], None]]) -> None:
        """Start u's transfer into its slot and set ``u.pending`` (start_fetch)."""
        layout = self._layout
        dst = self._device.view(u.device_offset, u.compute_numel)
        num_bytes = u.compute_numel * dst.element_size()
        if after is not None:
            assert not layout.gathers, "no deferred updates at stage 3"
            move, staging = self._move_home_to_device(u, dst)
            future = self._copy_worker.submit(lambda: (after(), move())[1])
            if staging is not None:
                staging.busy = future
            u.pending = future.result
            on_cpu_from_nvme = on_nvme(u.compute_home) and layout.device_is_host
            self._stats.add_bytes("nvme_to_device" if on_cpu_from_nvme else "host_to_device", num_bytes)
        elif layout.gathers:  # [zero] stage 3: [Note: parameter all-gathers]
            future = self._copy_worker.submit(self._gather_to_device, u, dst)
            u.pending = future.result
            home_bytes = compute_home_numel(u.compute_numel, u.param_shard) * dst.element_size()
            self._stats.add_bytes("nvme_to_host" if on_nvme(u.compute_home) else "host_to_host", home_bytes)
            self._stats.add_bytes("all_gather", num_bytes)
            if not layout.device_is_host:  # only the rank's own chunks cross to the device
                self._stats.add_bytes("host_to_device", self._partition.own_chunk_numel(u) * dst.element_size())
        elif on_nvme(u.compute_home) and layout.device_is_host:
            # The CPU "device" is RAM: read from the swap file straight into the slot.
            handle = self._nvme.read(dst, u.compute_home, unit=u.name)
            u.pending = lambda: (handle.wait(), None)[1]
            self._stats.add_bytes("nvme_to_device", num_bytes)
        elif on_nvme(u.compute_home):
            # the read starts now, beside those of other fetches; the copy worker hands the
            # bytes to the copy stream once they are in ([Note: streams])
            staging = self._take_staging()
            view = staging.buffer[:u.compute_numel]
            handle = self._nvme.read(view, u.compute_home, unit=u.name)
            future = self._copy_worker.submit(self._staged_to_device, lambda: handle.wait(), view, dst, u.name)
            staging.busy = future
            u.pending = future.result
            self._stats.add_bytes("host_to_device", num_bytes)
        elif layout.device_is_host:
            future = self._copy_worker.submit(dst.copy_, u.compute_home)
            u.pending = lambda: (future.result(), None)[1]
            self._stats.add_bytes("host_to_device", num_bytes)
        else:
            event = self._device.copy_in(dst, u.compute_home, what=f"the fill of unit {u.name!r}")
            u.pending = lambda: event
            self._stats.add_bytes("host_to_device", num_bytes)

    def _back_home(self, u: UnitState) -> None:
        """u's slot holds no valid copy: back to HOME, its slot freed (not the root's)."""
        u.compute_state.to(Residency.HOME)
        if u is not self._root:
            self._device.free(u.device_offset, u.compute_numel)
            u.device_offset = None

    def _move_home_to_device(self, u: UnitState, dst: torch.Tensor
                             ) -> Tuple[Callable[[], Optional[Event]], Optional[_Staging]]:
        """The transfers of start_fetch, to be issued from the copy worker: what returns the
        event the use waits for (if any), and the fetch staging buffer taken for it."""
        home = u.compute_home
        if on_nvme(home) and self._layout.device_is_host:
            return lambda: (self._nvme.read(dst, home, unit=u.name).wait(), None)[1], None
        if on_nvme(home):
            staging = self._take_staging()
            view = staging.buffer[:u.compute_numel]
            return lambda: self._staged_to_device(lambda: self._nvme.read(view, home, unit=u.name).wait(),
                                                  view, dst, u.name), staging
        if self._layout.device_is_host:
            return lambda: (dst.copy_(home), None)[1], None
        return lambda: self._device.copy_in(dst, home, what=f"the fill of unit {u.name!r}"), None

    def _take_staging(self) -> "_Staging":
        """The next fetch staging buffer in turn (main thread), once the fetch that last
        went through it has copied its bytes out ([Note: streams]: a read into it would
        overwrite them). Fetches take them in the order they are queued on the copy worker,
        so this waits only for work queued before."""
        staging = self._fetch_staging.pop(0)
        self._fetch_staging.append(staging)
        busy, staging.busy = staging.busy, None
        if busy is not None:
            wait_futures([busy])
            if busy.exception() is None and busy.result() is not None:
                busy.result().synchronize()
        return staging

    def _staged_to_device(self, read: Callable[[], Any], view: torch.Tensor, dst: torch.Tensor, unit: str) -> Event:
        """On the copy worker: wait for ``read`` (swap file -> pinned staging ``view``),
        then queue the copy into the slot; the copy's event."""
        read()
        return self._device.copy_in(dst, view, what=f"the fill of unit {unit!r}")

    def _gather_to_device(self, u: UnitState, dst: torch.Tensor) -> Optional[Event]:
        """[zero] Stage 3, on the copy worker: read this rank's chunks of u (from NVMe into
        a staging buffer, or the host home as is) and all-gather them into the device slot:
        where the host does not address the device, the chunks are copied to their place in
        the slot and gathered there ([Note: collectives on the device]); the returned event
        orders u's use after it."""
        home = u.compute_home
        if on_nvme(home):
            own = self._gather_home[:compute_home_numel(u.compute_numel, u.param_shard)]
            self._nvme.read(own, home, unit=u.name).wait()
        else:
            own = home
        if self._layout.device_is_host:
            self._partition.gather_params(u, own, dst, lane="param")
            return None
        self._device.wait_for_reads(dst)  # the gather writes the whole slot
        copied = self._partition.gather_params_on_device(
            u, own, dst, lambda slot, chunk: self._device.copy_in(slot, chunk, what=f"the fill of unit {u.name!r}"))
        return self._device.streams.after_collective(copied)

    def finish_fetch(self, u: UnitState) -> None:
        pending, u.pending = u.pending, None
        u.update.fetch_chained = False
        try:
            u.ready_event = pending()
            faults.hit("memory.fetch", unit=u.name)
        except BaseException as error:
            # A later use reads it again (the home copy is untouched; nothing else changed).
            self._back_home(u)
            if isinstance(error, OSError):
                raise OSError(error.errno, f"fetching unit {u.name!r} to the device failed ({error}); "
                              "its home copy is unchanged") from error
            raise
        u.compute_state.to(Residency.LOADED)
        self._timeline.span("copy", f"fetch {u.name}", u.fetch_started, time.perf_counter())
        self.bind(u)

    def _land_one_ahead(self, needed: Optional[UnitState]) -> Optional[UnitState]:
        """[Note: saved activations] Land the prefetch in flight (not ``needed``'s) whose use
        is farthest, so that its slot can be evicted: it took the slot while the saved
        activations were fewer. None when none is in flight. A failure is counted and
        warned about as drain_fetches does (the unit is HOME, its slot free)."""
        in_flight = [v for v in self.units
                     if v is not needed and v is not self._root and v.compute_state == Residency.LOADING]
        if not in_flight:
            return None
        ahead = max(in_flight, key=lambda v: self._prefetcher.next_use(v.index))
        try:
            self.finish_fetch(ahead)
        except Exception as error:  # noqa: BLE001 - nothing used it yet
            self._failed_ahead(ahead, error)
        return ahead

    def _allocate_slot(self, u: UnitState) -> int:
        """A device slot for u, evicting resident units whose next use is farthest (least
        recently used among those the trace does not know)."""
        while True:
            offset = self._device.allocate(u.compute_numel)
            if offset is not None:
                return offset
            victims = [v for v in self.units
                       if v is not u and v is not self._root and v.compute_state == Residency.LOADED]
            if not victims and self._device.activation_bytes:
                landed = self._land_one_ahead(u)  # [Note: saved activations]
                if landed is not None:
                    victims = [landed] if landed.compute_state == Residency.LOADED else []
                    if not victims:
                        continue  # it failed: its slot is free again
            if not victims:
                busy = [v.name for v in self.units
                        if v.compute_state.value in (Residency.IN_USE, Residency.LOADING)]
                raise RuntimeError(
                    f"device budget exhausted fetching unit {u.name!r}: units in use or in "
                    f"flight {busy}; raise device_budget")
            # not one still being updated in place when another will do: it would have to
            # wait for that update ([Note: deferred updates])
            self.release(max(victims, key=lambda v: (not self._updates.pending(v),
                                                     self._prefetcher.next_use(v.index), -v.last_use)))

    def evict_one(self) -> bool:
        """[Note: saved activations] Drop the device copy of the resident unit not in use
        (not the root) whose next use is farthest, for room on the device (a prefetch in
        flight when no copy is resident); False when none is."""
        if self._layout.param_tier == "device":
            return False
        victims = [v for v in self.units if v is not self._root and v.compute_state == Residency.LOADED]
        if not victims:
            landed = self._land_one_ahead(None)
            if landed is None:
                return False
            victims = [landed]
            if landed.compute_state != Residency.LOADED:
                return True  # it failed: its slot is free again
        self.release(max(victims, key=lambda v: (not self._updates.pending(v),
                                                 self._prefetcher.next_use(v.index), -v.last_use)))
        return True

    @profiled("release")
    def release(self, u: UnitState) -> None:
        """Drop u's device copy (its home copy is current)."""
        if self._layout.param_tier == "device" or u.compute_state != Residency.LOADED:
            return
        faults.hit("memory.release", unit=u.name)
        if u.update.in_device and u.update.ticket is not None:
            wait_futures([u.update.ticket])  # the optimizer worker may still be updating this copy
        u.update.in_device = False
        u.compute_state.to(Residency.HOME)
        self.unbind(u)
        # [Note: streams] a fill of the slot waits for the compute stream's reads queued so far
        self._device.reads_done(u.device_offset, u.compute_numel, what=f"the use of unit {u.name!r}")
        if u is not self._root:
            self._device.free(u.device_offset, u.compute_numel)
            u.device_offset = None

    def release_stale(self) -> None:
        """Drop device copies that an early optimizer update made stale (main thread only:
        it changes parameters)."""
        if self._stale_units:
            for u in self._stale_units:
                self.release(u)
            self._stale_units.clear()

    def drain_fetches(self) -> None:
        """Land every fetch in flight, before device copies are judged, states read or the
        engine closed: nobody uses these copies yet. So a fetch that failed (a swap read, a
        transfer) is not raised here (its unit is HOME again, nothing changed, and its next
        use reads it again and raises if it fails again): it is counted in
        ``stats()["failed_prefetches"]`` and warned about."""
        for u in self.units:
            if u.compute_state == Residency.LOADING:
                try:
                    self.finish_fetch(u)
                except Exception as error:  # noqa: BLE001 - counted and warned about
                    self._failed_ahead(u, error)

    def _failed_ahead(self, u: UnitState, error: Exception) -> None:
        """A fetch that no use waited for failed: its unit is HOME again, nothing changed,
        and its next use reads it again (and raises if the transfer fails again)."""
        self._stats.count("failed_prefetches")
        said = str(error) if isinstance(error, OSError) else \
            f"fetching unit {u.name!r} to the device failed ({type(error).__name__}: {error})"
        warn_at_caller(f"offload: {said}; nothing used it yet, and its next use reads it again")

    def prefetch(self) -> None:
        """Start the transfers the trace says come next (see offload/prefetch/)."""
        if not self._prefetcher.replaying:
            return
        others = self.units[1:]
        current = self._last_needed.index if self._last_needed is not None else -1
        plan = self._prefetcher.plan(
            unit_bytes=self._unit_bytes,
            resident=frozenset(u.index for u in others
                               if u.compute_state.value in (Residency.LOADED, Residency.IN_USE)),
            in_flight=frozenset(u.index for u in others if u.compute_state == Residency.LOADING),
            pinned=frozenset(u.index for u in others
                             if u.compute_state == Residency.IN_USE or self._updates.pending(u)) | {current},
            free_bytes=self._device.free_bytes)
        for v in plan.evict:
            self.release(self.units[v])
        for f in plan.fetch:
            u = self.units[f]
            if self._updates.pending(u):
                if self.prefetch_updating(u):
                    continue
                break  # [Note: deferred updates] not before its update; the later ones after it
            if not self.start_fetch(u, evict=False):
                break  # the free space is in pieces: the rest comes on demand

    def prefetch_updating(self, u: UnitState) -> bool:
        """[Note: updates fill the device copy] Bring u, whose deferred update is queued or
        running, to a free device slot (no eviction) in time for its use. On a CPU device
        with the compute copies on NVMe, an update not yet started writes the new compute
        copy into the slot as it goes (the part past the trainable prefix, if any, is read
        from home now: no update writes it). Otherwise the slot's fetch is chained behind
        the update and its swap writes, on the copy worker. The slot is "in flight" until
        then. False when that cannot be: u already on the device, or no free slot; the
        caller then stops, so that the units after u do not take the room u needs."""
        if not self.fill_behind_updates or self._layout.param_tier == "device" or u.compute_state != Residency.HOME:
            return False
        with self._updates.lock:
            if u.update.ticket is None:
                return False
            # [Note: speculative updates] never fill from an update that may not be kept:
            # chained behind it, the fetch reads the home, which it does not write
            fill = self._layout.device_copy_updates and on_nvme(u.compute_home) and not u.update.started \
                and not u.update.speculative
            if fill:
                offset = u.device_offset if u.device_offset is not None else self._device.allocate(u.compute_numel)
                if offset is None:
                    return False
                u.device_offset = offset
                u.update.attach_fill()
        ticket = u.update.ticket

        def wait_update() -> None:
            wait_futures([ticket])
            if ticket.exception() is not None:
                raise UpdateNotLanded(f"the update of unit {u.name!r} failed") from ticket.exception()

        if not fill:
            def wait_update_and_writes() -> None:
                wait_update()
                try:
                    for handle in u.update.home_writes:  # all issued once the update is done
                        handle.wait()
                except BaseException as error:  # noqa: B902 - the step reports its writes' failures
                    raise UpdateNotLanded(f"a swap write of the update of unit {u.name!r} failed") from error
            if not self.start_fetch(u, evict=False, after=wait_update_and_writes):
                return False
            u.update.fetch_chained = True
            return True
        u.compute_state.to(Residency.LOADING)
        u.fetch_started = time.perf_counter()
        u.update.fetch_chained = True
        dst = self._device.view(u.device_offset, u.compute_numel)
        size = dst.element_size()
        tail = padded_numel(u.spec.trainable_numel, size)
        handles = []
        if tail < u.compute_numel:
            extent = sub_extent(u.compute_home, tail * size, (u.compute_numel - tail) * size)
            handles.append(self._nvme.read(dst[tail:], extent, unit=u.name))
            self._stats.add_bytes("nvme_to_device", (u.compute_numel - tail) * size)

        def pending() -> None:
            wait_all(handles, self._stats)
            wait_update()
        u.pending = pending
        self._stats.count("update_fills")
        return True

    def land_fills(self) -> Optional[BaseException]:
        """Finish the fetches that waited for updates now over (prefetch_updating): the
        slot of a failed one goes back (an update's failure is reported with the update's
        own; a transfer's own is counted and warned about as drain_fetches does). An
        interrupt of this thread meanwhile (a KeyboardInterrupt, not an error) is returned
        once every fill has landed, for the caller to raise ([Note: interrupts while
        waiting])."""
        interrupt: Optional[BaseException] = None
        for u in self.units:
            if u.update.fetch_chained and u.compute_state == Residency.LOADING:
                try:
                    self.finish_fetch(u)
                except UpdateNotLanded:
                    pass  # the update's ticket (or the step, its writes) reports it
                except Exception as error:  # noqa: BLE001 - the transfer's own: nothing used it yet
                    self._failed_ahead(u, error)
                except BaseException as error:  # noqa: B902 - the unit is back home; raised by the caller
                    interrupt = interrupt or error
        return interrupt

    def wait_ready(self, u: UnitState) -> None:
        """u's forward or backward is next on the compute stream: it waits for u's fill
        ([Note: streams])."""
        event, u.ready_event = u.ready_event, None
        self._device.compute_uses(u.device_offset, u.compute_numel, event, what=f"the use of unit {u.name!r}")
